/* GEMMs, per-head GEMMs and MoE calls on bf16 weights with the Armv8.6 BF16 extension (`bf16`
 * in /proc/cpuinfo: BFMMLA, BFDOT), for fp32.c's aarch64 body.
 *
 * The token rows are rounded to bf16 once per call (to nearest even, BFCVTN; the hidden of an
 * MoE call after its gated activation too), as AMX's bf16 tiles take them on x86
 * (bf16_amx.c), and the products are summed in fp32. The rows are stored one after another,
 * zero padded to a multiple of 8 columns, with a zero row after the last one.
 *
 * Two token rows and two weight rows meet in BFMMLA: a [2 x 4] block of each (a pair's
 * 4-column slices side by side in one register, two 64-bit zips of the rows' loads) adds
 * their [2 x 2] products into one fp32 register, 16 products per instruction. A job is 4
 * weight rows (two pairs) against blocks of BM_RP token-row pairs (12 rows: 12 accumulators,
 * 4 weight and 2 row registers); an odd last row pairs with the zero row. A single token
 * row (decode at batch 1, an MoE expert with one row) takes BFDOT instead, 8 products an
 * instruction into a lane per weight row and no zips: the weight stream bounds it either way.
 * The weights' last K % 8 columns are copied to a zeroed block and take one more step.
 *
 * BFMMLA and BFDOT sum without intermediate IEEE rounding of each product (Arm's BF16
 * semantics: round to odd, denormals flushed, unless the CPU implements FEAT_EBF16's
 * extended mode), so the sums differ from fp32's in the last bits, far below the rows'
 * rounding to bf16 (2^-9 of a value). Included by fp32.c where the build has +bf16; not a
 * translation unit of its own. */
#ifndef MOESERVE_BF16_MMLA_H
#define MOESERVE_BF16_MMLA_H

#define BM_KP(K) (((K) + 7) / 8 * 8)
#define BM_RP 6 /* token-row pairs a block */

/* The rounded rows of a call: row i at x + i * kp (bf16 bits), row `zero` all zeros */
struct bm_rows {
    uint16_t *x;
    int64_t K, kp, zero;
};

/* r's M rows (and its zero row) in the calling thread's scratch `slot`; -1 when it cannot
 * be had */
static int bm_alloc(int64_t M, int64_t K, int slot, struct bm_rows *r) {
    r->K = K;
    r->kp = BM_KP(K);
    r->zero = M;
    r->x = thread_scratch(slot, (size_t)((M + 1) * r->kp) * sizeof(uint16_t));
    if (!r->x) return -1;
    memset(r->x + M * r->kp, 0, (size_t)r->kp * sizeof(uint16_t));
    return 0;
}

static inline const uint16_t *bm_row(const struct bm_rows *r, int64_t i) {
    return r->x + i * r->kp;
}

/* x (K floats) rounded to bf16 into row i of r, zero padded */
static void bm_round_row(int64_t K, const float *x, const struct bm_rows *r, int64_t i) {
    uint16_t *out = r->x + i * r->kp;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        const bfloat16x8_t b = vcvtq_high_bf16_f32(vcvtq_low_bf16_f32(vld1q_f32(x + k)),
                                                   vld1q_f32(x + k + 4));
        vst1q_u16(out + k, vreinterpretq_u16_bf16(b));
    }
    for (; k < K; k++) {
        const bfloat16_t b = vcvth_bf16_f32(x[k]);
        memcpy(out + k, &b, sizeof b);
    }
    for (; k < r->kp; k++) out[k] = 0;
}

/* [a's 4 columns | b's 4 columns] and the next 4 of each (common.h: zip_rows64) */
static inline void bm_zip(const uint16_t *a, const uint16_t *b, bfloat16x8_t *lo,
                          bfloat16x8_t *hi) {
    uint64x2_t l, h;
    zip_rows64(a, b, &l, &h);
    *lo = vreinterpretq_bf16_u64(l);
    *hi = vreinterpretq_bf16_u64(h);
}

/* One step of 8 columns: row pairs 0..mp-1 (rows x[2 i], x[2 i + 1], each at column k)
 * against the weight rows w[0..3] (each at its column) into a[i][j] */
static inline __attribute__((always_inline)) void bm_step(const int mp, const uint16_t **x,
                                                          int64_t k, const uint16_t *const *w,
                                                          float32x4_t a[BM_RP][2]) {
    bfloat16x8_t b[2][2];
    bm_zip(w[0], w[1], &b[0][0], &b[0][1]);
    bm_zip(w[2], w[3], &b[1][0], &b[1][1]);
#pragma GCC unroll 6
    for (int i = 0; i < BM_RP; i++) {
        if (i < mp) {
            bfloat16x8_t lo, hi;
            bm_zip(x[2 * i] + k, x[2 * i + 1] + k, &lo, &hi);
            for (int j = 0; j < 2; j++) {
                a[i][j] = vbfmmlaq_f32(a[i][j], lo, b[j][0]);
                a[i][j] = vbfmmlaq_f32(a[i][j], hi, b[j][1]);
            }
        }
    }
}

/* the last K % 8 columns of the 4 weight rows wr, zero padded, as step pointers */
static inline void bm_tail(int64_t K, const uint16_t *const *wr, uint16_t t[4][8],
                           const uint16_t *w[4]) {
    const int64_t kv = K - K % 8;
    for (int j = 0; j < 4; j++) {
        for (int u = 0; u < 8; u++) t[j][u] = kv + u < K ? wr[j][kv + u] : 0;
        w[j] = t[j];
    }
}

/* rows m0 + 2 i (+ 1) of r, i < mp, against the 4 weight rows wr (the first nw real): y[:, 0:nw]
 * of the `rows` real token rows; pf: prefetch distance in weights */
static inline __attribute__((always_inline)) void bm_block(const int mp, int64_t K,
                                                           const struct bm_rows *r, int64_t m0,
                                                           int64_t rows, const uint16_t **wr,
                                                           int nw, float *y, int64_t ldy,
                                                           int64_t pf) {
    const uint16_t *x[2 * BM_RP];
    for (int i = 0; i < 2 * mp && i < 2 * BM_RP; i++) x[i] = bm_row(r, i < rows ? m0 + i : r->zero);
    float32x4_t a[BM_RP][2];
    for (int i = 0; i < BM_RP; i++) a[i][0] = a[i][1] = vdupq_n_f32(0.0f);
    const int64_t kv = K - K % 8;
    for (int64_t k = 0; k < kv; k += 8) {
        const uint16_t *w[4];
        for (int j = 0; j < 4; j++) {
            PREFETCH_T0(wr[j] + k + pf);
            w[j] = wr[j] + k;
        }
        bm_step(mp, x, k, w, a);
    }
    if (kv < K) {
        uint16_t t[4][8];
        const uint16_t *w[4];
        bm_tail(K, wr, t, w);
        bm_step(mp, x, kv, w, a);
    }
    for (int i = 0; i < mp; i++) {
        float s[4]; /* (row 2i, w 2j), (2i, 2j + 1), (2i + 1, 2j), (2i + 1, 2j + 1) */
        for (int j = 0; j < 2; j++) {
            vst1q_f32(s, a[i][j]);
            for (int u = 0; u < 4; u++) {
                const int row = 2 * i + u / 2, col = 2 * j + u % 2;
                if (row < rows && col < nw) y[row * ldy + col] = s[u];
            }
        }
    }
}

/* one token row x (bf16, zero padded to a multiple of 8) against the 4 weight rows wr (the
 * first nw real) on BFDOT: two partial sums a weight row */
static void bm_row1(int64_t K, const uint16_t *x, const uint16_t **wr, int nw, float *y,
                    int64_t pf) {
    float32x4_t a[4][2];
    for (int j = 0; j < 4; j++) a[j][0] = a[j][1] = vdupq_n_f32(0.0f);
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        const bfloat16x8_t x0 = vreinterpretq_bf16_u16(vld1q_u16(x + k));
        const bfloat16x8_t x1 = vreinterpretq_bf16_u16(vld1q_u16(x + k + 8));
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            PREFETCH_T0(wr[j] + k + pf);
            a[j][0] = vbfdotq_f32(a[j][0], x0, vreinterpretq_bf16_u16(vld1q_u16(wr[j] + k)));
            a[j][1] = vbfdotq_f32(a[j][1], x1, vreinterpretq_bf16_u16(vld1q_u16(wr[j] + k + 8)));
        }
    }
    for (; k < K; k += 8) { /* x is padded: the weights' last columns come from a zeroed copy */
        uint16_t t[4][8];
        const uint16_t *w[4];
        if (k + 8 <= K) {
            for (int j = 0; j < 4; j++) w[j] = wr[j] + k;
        } else {
            bm_tail(K, wr, t, w);
        }
        const bfloat16x8_t xv = vreinterpretq_bf16_u16(vld1q_u16(x + k));
        for (int j = 0; j < 4; j++)
            a[j][0] = vbfdotq_f32(a[j][0], xv, vreinterpretq_bf16_u16(vld1q_u16(w[j])));
    }
    for (int j = 0; j < nw; j++) y[j] = vaddvq_f32(vaddq_f32(a[j][0], a[j][1]));
}

/* A job: rows m0 .. m0 + M of r against the nw (<= 4) weight rows at w (stride ldw) into
 * y[:, 0:nw] */
static void bm_job(int64_t M, int64_t K, const struct bm_rows *r, int64_t m0, const uint16_t *w,
                   int64_t ldw, int nw, float *y, int64_t ldy, int64_t pf) {
    const uint16_t *wr[4];
    for (int j = 0; j < 4; j++) wr[j] = w + (j < nw ? j : 0) * ldw;
    if (M == 1) {
        bm_row1(K, bm_row(r, m0), wr, nw, y, pf);
        return;
    }
    for (int64_t i0 = 0; i0 < M; i0 += 2 * BM_RP) {
        const int64_t rows = M - i0, pairs = (rows + 1) / 2;
#define CALL_BM(mp) bm_block(mp, K, r, m0 + i0, rows, wr, nw, y + i0 * ldy, ldy, pf)
        DISPATCH_MB(pairs, BM_RP, CALL_BM)
#undef CALL_BM
    }
}

/* prefetch distance of jobs of 4 weight rows: the same offset in a later job */
static inline int64_t bm_prefetch(int64_t ldw) {
    const int64_t job = 4 * ldw;
    return job * ((MIN_PREFETCH + job - 1) / job);
}

/* y = x @ w^T for M fp32 rows and bf16 weights: the rows rounded once, then the threads share
 * out jobs of 4 weight rows. -1 when the scratch cannot be had (nothing computed). */
static int gemm_bf16_mmla(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx,
                          const uint16_t *w, int64_t ldw, float *y, int64_t ldy) {
    struct bm_rows r;
    if (bm_alloc(M, K, 0, &r)) return -1;
    for (int64_t i = 0; i < M; i++) bm_round_row(K, x + i * ldx, &r, i);
    const int64_t jobs = (N + 3) / 4, pf = bm_prefetch(ldw);
#pragma omp parallel for schedule(static) if (N * K >= 32768)
    for (int64_t p = 0; p < jobs; p++) {
        const int nw = N - 4 * p < 4 ? (int)(N - 4 * p) : 4;
        bm_job(M, K, &r, 0, w + 4 * p * ldw, ldw, nw, y + 4 * p, ldy, pf);
    }
    return 0;
}

/* gemm_bf16_mmla for each of Hh heads (x, w, y strided by head: fp32.c's head_gemm) */
static int head_gemm_bf16_mmla(int64_t Hh, int64_t M, int64_t N, int64_t K, const float *x,
                               int64_t sxh, int64_t sxm, const uint16_t *w, int64_t swh,
                               int64_t ldw, float *y, int64_t syh, int64_t sym) {
    struct bm_rows r;
    if (bm_alloc(Hh * M, K, 0, &r)) return -1;
    for (int64_t h = 0; h < Hh; h++)
        for (int64_t i = 0; i < M; i++) bm_round_row(K, x + h * sxh + i * sxm, &r, h * M + i);
    const int64_t jobs = (N + 3) / 4, pf = bm_prefetch(ldw);
#pragma omp parallel for schedule(static) if (Hh * N * K >= 32768)
    for (int64_t job = 0; job < Hh * jobs; job++) {
        const int64_t h = job / jobs, n0 = 4 * (job % jobs);
        const int nw = N - n0 < 4 ? (int)(N - n0) : 4;
        bm_job(M, K, &r, h * M, w + h * swh + n0 * ldw, ldw, nw, y + h * syh + n0, sym, pf);
    }
    return 0;
}

/* bm_round_row as common.h's round_group_rows takes it */
static void bm_round_any(const void *r, int64_t i, const float *x) {
    const struct bm_rows *rows = r;
    bm_round_row(rows->K, x, rows, i);
}

/* the bf16 weights of an MoE call (moe_rounded's ctx) */
struct bm_moe {
    const int64_t *expert;
    const uint16_t *w13, *w2;
    int64_t pf13, pf2;
};

static void bm_moe_up(const struct moe_rounded *c, int64_t g, int64_t n0, int64_t nr) {
    const struct bm_moe *m = c->ctx;
    const int64_t D = c->D, F = c->F, j = c->start[g];
    bm_job(c->count[g], D, c->rx, j, m->w13 + (m->expert[g] * 2 * F + n0) * D, D, (int)nr,
           c->h + j * 2 * F + n0, 2 * F, m->pf13);
}

static void bm_moe_down(const struct moe_rounded *c, int64_t g, int64_t n0, int64_t nr) {
    const struct bm_moe *m = c->ctx;
    const int64_t D = c->D, F = c->F, j = c->start[g];
    bm_job(c->count[g], F, c->rh, j, m->w2 + (m->expert[g] * D + n0) * F, F, (int)nr,
           c->y + j * D + n0, D, m->pf2);
}

/* fp32.c's moe body on BFMMLA/BFDOT (common.h's moe_rounded_run in jobs of 4 weight rows):
 * the groups' rows rounded to bf16 once, the hidden after its activation too. -1 when the
 * scratch cannot be had (nothing computed). */
static int moe_bf16_mmla(int64_t n_groups, const int64_t *expert, const int64_t *start,
                         const int64_t *count, int64_t D, int64_t F, const float *x,
                         const uint16_t *w13, const uint16_t *w2, const float *route_w,
                         float *h, float *y) {
    int64_t R = 0;
    for (int64_t g = 0; g < n_groups; g++)
        R = start[g] + count[g] > R ? start[g] + count[g] : R;
    struct bm_rows rx, rh;
    if (bm_alloc(R, D, 0, &rx) || bm_alloc(R, F, 1, &rh)) return -1;
    const struct bm_moe m = {expert, w13, w2, bm_prefetch(D), bm_prefetch(F)};
    const struct moe_rounded c = {n_groups, start, count, D, F, 4, x, route_w, h, y,
                                  bm_round_any, &rx, &rh, bm_moe_up, bm_moe_down, &m};
    moe_rounded_run(&c);
    return 0;
}

#endif
