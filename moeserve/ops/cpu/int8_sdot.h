/* Weight-only int8 GEMMs and MoE calls on the Armv8.2 dot product (SDOT, `asimddp`) and,
 * where the CPU has it, the int8 matrix multiply (SMMLA, `i8mm`), for int8.c's aarch64 body.
 *
 * The token rows are rounded once per call to 16-bit fixed point, one scale per row, and
 * split into two signed byte planes, as int4_idot.h takes them on x86:
 *
 *   c[i] = max_k |x[i, k]| / XMAX,   xi[i, k] = round(x[i, k] / c[i]),   |xi| <= XMAX = 32639
 *   xi = xh * 256 + xl                                   (xh, xl in [-128, 127])
 *   y[i, n] = c[i] * scale[n] * (256 * sum_k q[n, k] xh[i, k] + sum_k q[n, k] xl[i, k])
 *
 * Each sum is exact in int32 lanes (a lane adds K products of at most 127 * 128: 300M at
 * K = 18432). So the result is the reference's on x rounded per row to
 * 2^-16 of its largest |x| (ops/cpu/int4.py round_rows_ref), ~1e-5 of an output, far below
 * int8's own rounding of the weights. Per 16 weights and token row the dots take 2 SDOT
 * where the fp32 form takes 4 FMAs and 11 conversions per 16 weights: the weight stream, not
 * the conversions, then bounds a decode step.
 *
 * Token rows are planes of SD_KP(K) bytes (zero padded to 16); a pair of weight rows is dotted
 * with blocks of SD_MB token rows (4 int32 accumulators a row: 24 + 4 of 32 registers); the
 * weights' last K % 16 columns are summed in scalar code. With SMMLA, calls of two rows or more
 * take it instead (below: pairs of rows against pairs of weight rows, twice SDOT's products an
 * instruction), with no limit on the rows. The MoE call rounds the groups' rows,
 * runs the gate/up pairs, the gated activation, rounds the hidden, then the down pairs, in one
 * parallel region as int8.c's moe body. Included by int8.c where the build has +dotprod; not a
 * translation unit of its own. */
#ifndef MOESERVE_INT8_SDOT_H
#define MOESERVE_INT8_SDOT_H

#define SD_XMAX 32639
#define SD_KP(K) (((K) + 15) / 16 * 16)
#define SD_MB 6

/* The rounded rows of a call: row i's planes at xh + i * kp and xl + i * kp, its scale c[i];
 * row `zero` (after the last) all zeros, the partner of an odd last row in SMMLA's pairs */
struct sd_rows {
    int8_t *xh, *xl;
    float *c;
    int64_t K, kp, zero;
};

/* r's rows in the calling thread's scratch `slot` (common.h); -1 when it cannot be had */
static int sd_alloc(int64_t M, int64_t K, int slot, struct sd_rows *r) {
    r->K = K;
    r->kp = SD_KP(K);
    r->zero = M++;
    r->xh = thread_scratch(slot, (size_t)(2 * M * r->kp) + (size_t)M * sizeof(float));
    if (!r->xh) return -1;
    r->xl = r->xh + M * r->kp;
    r->c = (float *)(r->xl + M * r->kp);
    memset(r->xh + r->zero * r->kp, 0, (size_t)r->kp);
    memset(r->xl + r->zero * r->kp, 0, (size_t)r->kp);
    return 0;
}

/* four int32 vectors' lanes (each in [-128, 127]) as 16 bytes */
static inline int8x16_t sd_bytes(int32x4_t a, int32x4_t b, int32x4_t c, int32x4_t d) {
    const int16x8_t lo = vcombine_s16(vmovn_s32(a), vmovn_s32(b));
    const int16x8_t hi = vcombine_s16(vmovn_s32(c), vmovn_s32(d));
    return vcombine_s8(vmovn_s16(lo), vmovn_s16(hi));
}

/* Row x (K floats) rounded into row i of r. A row with a nan or an inf gets c nan, so its
 * outputs are nan as the reference's are; a zero row gets c 0. */
static void sd_round_row(int64_t K, const float *x, const struct sd_rows *r, int64_t i) {
    int8_t *xh = r->xh + i * r->kp, *xl = r->xl + i * r->kp;
    float32x4_t m = vdupq_n_f32(0.0f);
    uint32x4_t bad = vdupq_n_u32(0);
    int64_t k = 0;
    for (; k + 4 <= K; k += 4) {
        const float32x4_t v = vld1q_f32(x + k);
        m = vmaxq_f32(m, vabsq_f32(v));
        bad = vorrq_u32(bad, vmvnq_u32(vceqq_f32(vsubq_f32(v, v), vdupq_n_f32(0.0f))));
    }
    float amax = vmaxvq_f32(m);
    int nonfinite = vmaxvq_u32(bad) != 0;
    for (; k < K; k++) {
        amax = fabsf(x[k]) > amax ? fabsf(x[k]) : amax;
        nonfinite |= x[k] - x[k] != 0.0f;
    }
    r->c[i] = nonfinite ? NAN : amax / (float)SD_XMAX;
    const float inv = amax > 0.0f && !nonfinite ? (float)SD_XMAX / amax : 0.0f;
    const int32x4_t top = vdupq_n_s32(SD_XMAX), bottom = vdupq_n_s32(-SD_XMAX);
    for (k = 0; k < r->kp; k += 16) {
        int32x4_t h[4], l[4];
        for (int j = 0; j < 4; j++) {
            int32x4_t xi = vdupq_n_s32(0); /* past K: zeros */
            if (k + 4 * j + 4 <= K) {
                xi = vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(x + k + 4 * j), inv));
            } else if (k + 4 * j < K) {
                float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                for (int64_t u = k + 4 * j; u < K; u++) t[u - k - 4 * j] = x[u];
                xi = vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(t), inv));
            }
            xi = vmaxq_s32(vminq_s32(xi, top), bottom);
            l[j] = vshrq_n_s32(vshlq_n_s32(xi, 24), 24); /* the low byte, sign-extended */
            h[j] = vshrq_n_s32(vsubq_s32(xi, l[j]), 8);
        }
        vst1q_s8(xh + k, sd_bytes(h[0], h[1], h[2], h[3]));
        vst1q_s8(xl + k, sd_bytes(l[0], l[1], l[2], l[3]));
    }
}

/* sd_round_row as common.h's round_group_rows takes it */
static void sd_round_any(const void *r, int64_t i, const float *x) {
    const struct sd_rows *rows = r;
    sd_round_row(rows->K, x, rows, i);
}

/* rows 0..mb-1 of r (from row m0) against int8 weight rows q0 and q1 (q1 == q0 when !two),
 * scales s0 and s1: y[i * ldy] (and y[i * ldy + 1]) = the rows' products */
static inline __attribute__((always_inline)) void sd_block(const int mb, const int two,
                                                           int64_t K, const struct sd_rows *r,
                                                           int64_t m0, const int8_t *q0,
                                                           const int8_t *q1, float s0, float s1,
                                                           float *y, int64_t ldy) {
    int32x4_t a[SD_MB][4];
    for (int i = 0; i < SD_MB; i++) a[i][0] = a[i][1] = a[i][2] = a[i][3] = vdupq_n_s32(0);
    const int64_t kv = K - K % 16;
    for (int64_t k = 0; k < kv; k += 16) {
        PREFETCH_T0(q0 + k + PREFETCH);
        PREFETCH_T0(q1 + k + PREFETCH);
        const int8x16_t w0 = vld1q_s8(q0 + k), w1 = vld1q_s8(q1 + k);
        for (int i = 0; i < SD_MB; i++) {
            if (i < mb) {
                const int8x16_t h = vld1q_s8(r->xh + (m0 + i) * r->kp + k);
                const int8x16_t l = vld1q_s8(r->xl + (m0 + i) * r->kp + k);
                a[i][0] = vdotq_s32(a[i][0], w0, h);
                a[i][1] = vdotq_s32(a[i][1], w0, l);
                a[i][2] = vdotq_s32(a[i][2], w1, h);
                a[i][3] = vdotq_s32(a[i][3], w1, l);
            }
        }
    }
    for (int i = 0; i < SD_MB; i++) {
        if (i >= mb) continue;
        const int8_t *xh = r->xh + (m0 + i) * r->kp, *xl = r->xl + (m0 + i) * r->kp;
        int64_t d0 = (int64_t)vaddvq_s32(a[i][0]) * 256 + vaddvq_s32(a[i][1]);
        int64_t d1 = (int64_t)vaddvq_s32(a[i][2]) * 256 + vaddvq_s32(a[i][3]);
        for (int64_t k = kv; k < K; k++) {
            const int64_t xi = (int64_t)xh[k] * 256 + xl[k];
            d0 += xi * q0[k];
            d1 += xi * q1[k];
        }
        const float c = r->c[m0 + i];
        y[i * ldy] = (float)d0 * c * s0;
        if (two) y[i * ldy + 1] = (float)d1 * c * s1;
    }
}

#if defined(__ARM_FEATURE_MATMUL_INT8)
/* ---- SMMLA (`i8mm`): two token rows and two weight rows meet in one instruction, a [2 x 8]
 * byte block of each (the pair's 8-column slices side by side: two 64-bit zips of the rows'
 * loads) adding their [2 x 2] int32 products, 32 products an instruction where SDOT adds 16.
 * A job is 4 weight rows against blocks of SM_RP row pairs, each plane in its own
 * accumulators (16 + 4 weight + 4 row registers); an odd last row pairs with the zero row;
 * the weights' last K % 16 columns come from a zeroed copy (the planes are zero padded). ---- */
#define SM_RP 4

/* [a's 8 bytes | b's 8 bytes] and the next 8 of each (common.h: zip_rows64) */
static inline void sm_zip(const int8_t *a, const int8_t *b, int8x16_t *lo, int8x16_t *hi) {
    uint64x2_t l, h;
    zip_rows64(a, b, &l, &h);
    *lo = vreinterpretq_s8_u64(l);
    *hi = vreinterpretq_s8_u64(h);
}

/* One step of 16 columns: row pairs i < mp (planes xh[2 i], xh[2 i + 1] and xl's, at column
 * k) against the weight rows w[0..3] (each at its column): a[i][j][plane] */
static inline __attribute__((always_inline)) void sm_step(const int mp, const int8_t **xh,
                                                          const int8_t **xl, int64_t k,
                                                          const int8_t *const *w,
                                                          int32x4_t a[SM_RP][2][2]) {
    int8x16_t b[2][2];
    sm_zip(w[0], w[1], &b[0][0], &b[0][1]);
    sm_zip(w[2], w[3], &b[1][0], &b[1][1]);
#pragma GCC unroll 4
    for (int i = 0; i < SM_RP; i++) {
        if (i < mp) {
            int8x16_t h[2], l[2];
            sm_zip(xh[2 * i] + k, xh[2 * i + 1] + k, &h[0], &h[1]);
            sm_zip(xl[2 * i] + k, xl[2 * i + 1] + k, &l[0], &l[1]);
            for (int j = 0; j < 2; j++) {
                for (int u = 0; u < 2; u++) {
                    a[i][j][0] = vmmlaq_s32(a[i][j][0], h[u], b[j][u]);
                    a[i][j][1] = vmmlaq_s32(a[i][j][1], l[u], b[j][u]);
                }
            }
        }
    }
}

/* rows m0 + 2 i (+ 1) of r, i < mp, against the 4 int8 weight rows qr (the first nw real,
 * scales s): y[:, 0:nw] of the `rows` real token rows */
static inline __attribute__((always_inline)) void sm_block(const int mp, int64_t K,
                                                           const struct sd_rows *r, int64_t m0,
                                                           int64_t rows, const int8_t **qr,
                                                           int nw, const float *s, float *y,
                                                           int64_t ldy) {
    const int8_t *xh[2 * SM_RP], *xl[2 * SM_RP];
    for (int i = 0; i < 2 * mp && i < 2 * SM_RP; i++) {
        const int64_t row = i < rows ? m0 + i : r->zero;
        xh[i] = r->xh + row * r->kp;
        xl[i] = r->xl + row * r->kp;
    }
    int32x4_t a[SM_RP][2][2];
    for (int i = 0; i < SM_RP; i++)
        for (int j = 0; j < 2; j++) a[i][j][0] = a[i][j][1] = vdupq_n_s32(0);
    const int64_t kv = K - K % 16;
    for (int64_t k = 0; k < kv; k += 16) {
        const int8_t *w[4];
        for (int j = 0; j < 4; j++) {
            PREFETCH_T0(qr[j] + k + PREFETCH);
            w[j] = qr[j] + k;
        }
        sm_step(mp, xh, xl, k, w, a);
    }
    if (kv < K) {
        int8_t t[4][16];
        const int8_t *w[4];
        for (int j = 0; j < 4; j++) {
            for (int u = 0; u < 16; u++) t[j][u] = kv + u < K ? qr[j][kv + u] : 0;
            w[j] = t[j];
        }
        sm_step(mp, xh, xl, kv, w, a);
    }
    for (int i = 0; i < mp; i++) {
        for (int j = 0; j < 2; j++) {
            int32_t h[4], l[4]; /* (row 2i, w 2j), (2i, 2j + 1), (2i + 1, 2j), (2i + 1, 2j + 1) */
            vst1q_s32(h, a[i][j][0]);
            vst1q_s32(l, a[i][j][1]);
            for (int u = 0; u < 4; u++) {
                const int row = 2 * i + u / 2, col = 2 * j + u % 2;
                if (row < rows && col < nw)
                    y[row * ldy + col] =
                        (float)((int64_t)h[u] * 256 + l[u]) * r->c[m0 + row] * s[col];
            }
        }
    }
}

/* rows m0 .. m0 + M of r against the `rows` (<= PANEL) int8 weight rows at q (scales s) */
static void sm_panel(int64_t M, int64_t K, const struct sd_rows *r, int64_t m0, const int8_t *q,
                     int64_t ldq, const float *s, int64_t rows, float *y, int64_t ldy) {
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
        const int nw = rows - r0 < 4 ? (int)(rows - r0) : 4;
        const int8_t *qr[4];
        for (int j = 0; j < 4; j++) qr[j] = q + (r0 + (j < nw ? j : 0)) * ldq;
        for (int64_t i0 = 0; i0 < M; i0 += 2 * SM_RP) {
            const int64_t left = M - i0;
#define CALL_SM(mp) sm_block(mp, K, r, m0 + i0, left, qr, nw, s + r0, y + i0 * ldy + r0, ldy)
            DISPATCH_MB((left + 1) / 2, SM_RP, CALL_SM)
#undef CALL_SM
        }
    }
}
#endif

/* rows m0 .. m0 + M of r against the `rows` (<= PANEL) int8 weight rows at q (scales s):
 * from two token rows on SMMLA where the CPU has it, else (and for one row) SDOT */
static void sd_panel(int64_t M, int64_t K, const struct sd_rows *r, int64_t m0, const int8_t *q,
                     int64_t ldq, const float *s, int64_t rows, float *y, int64_t ldy) {
#if defined(__ARM_FEATURE_MATMUL_INT8)
    if (M >= 2) {
        sm_panel(M, K, r, m0, q, ldq, s, rows, y, ldy);
        return;
    }
#endif
    for (int64_t r0 = 0; r0 < rows; r0 += 2) {
        const int two = r0 + 1 < rows;
        const int8_t *q0 = q + r0 * ldq, *q1 = q0 + (two ? ldq : 0);
        for (int64_t i0 = 0; i0 < M; i0 += SD_MB) {
            const int64_t left = M - i0;
#define CALL_SD(mb) \
    sd_block(mb, two, K, r, m0 + i0, q0, q1, s[r0], s[r0 + two], y + i0 * ldy + r0, ldy)
            DISPATCH_MB(left, SD_MB, CALL_SD)
#undef CALL_SD
        }
    }
}

/* y = (x @ q^T) * scale for M token rows: the rows rounded once, then the threads share out
 * panels of PANEL weight rows. -1 when the scratch cannot be allocated (nothing computed). */
static int gemm_sdot(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx,
                     const int8_t *q, int64_t ldq, const float *scale, float *y, int64_t ldy) {
    struct sd_rows r;
    if (sd_alloc(M, K, 0, &r)) return -1;
    for (int64_t i = 0; i < M; i++) sd_round_row(K, x + i * ldx, &r, i);
    const int64_t panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) if (N * K >= 65536)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t n0 = p * PANEL, rows = N - n0 < PANEL ? N - n0 : PANEL;
        sd_panel(M, K, &r, 0, q + n0 * ldq, ldq, scale + n0, rows, y + n0, ldy);
    }
    return 0;
}

/* the int8 weights of an MoE call (moe_rounded's ctx) */
struct sd_moe {
    const int64_t *expert;
    const int8_t *q13, *q2;
    const float *s13, *s2;
};

static void sd_moe_up(const struct moe_rounded *c, int64_t g, int64_t n0, int64_t nr) {
    const struct sd_moe *m = c->ctx;
    const int64_t D = c->D, F = c->F, row = m->expert[g] * 2 * F + n0;
    sd_panel(c->count[g], D, c->rx, c->start[g], m->q13 + row * D, D, m->s13 + row, nr,
             c->h + c->start[g] * 2 * F + n0, 2 * F);
}

static void sd_moe_down(const struct moe_rounded *c, int64_t g, int64_t n0, int64_t nr) {
    const struct sd_moe *m = c->ctx;
    const int64_t D = c->D, F = c->F, row = m->expert[g] * D + n0;
    sd_panel(c->count[g], F, c->rh, c->start[g], m->q2 + row * F, F, m->s2 + row, nr,
             c->y + c->start[g] * D + n0, D);
}

/* int8.c's moe body on the dot products (common.h's moe_rounded_run in panels): the groups'
 * rows rounded once, the hidden after its activation too. -1 when the scratch cannot be
 * allocated (nothing computed). */
static int moe_sdot(int64_t n_groups, const int64_t *expert, const int64_t *start,
                    const int64_t *count, int64_t D, int64_t F, const float *x,
                    const int8_t *q13, const float *s13, const int8_t *q2, const float *s2,
                    const float *route_w, float *h, float *y) {
    int64_t R = 0;
    for (int64_t g = 0; g < n_groups; g++)
        R = start[g] + count[g] > R ? start[g] + count[g] : R;
    struct sd_rows rx, rh;
    if (sd_alloc(R, D, 0, &rx) || sd_alloc(R, F, 1, &rh)) return -1;
    const struct sd_moe m = {expert, q13, q2, s13, s2};
    const struct moe_rounded c = {n_groups, start, count, D, F, PANEL, x, route_w, h, y,
                                  sd_round_any, &rx, &rh, sd_moe_up, sd_moe_down, &m};
    moe_rounded_run(&c);
    return 0;
}

#endif
