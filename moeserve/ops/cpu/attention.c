/* fp32 decode attention over a paged KV cache on AVX2+FMA CPUs (AVX-512F scores and values
 * where the CPU has it: `wide`) and aarch64, without gathering the context.
 *
 * One query token per sequence b; its Hg query heads of KV head g attend to the sequence's
 * first lens[b] cached tokens. Token p lives in slot table[b][p / bs] * bs + p % bs; the slot's
 * row starts at cache + slot * ld_slot, its key (Dk floats) at k_off + g * k_hs and its value
 * (Dv floats) at v_off + g * v_hs. Two users:
 *
 *   MLA (absorbed):  G = 1, Hg = H, key = [c_kv | k_pe] (Dk = C + R, k_off = 0),
 *                    value = c_kv (Dv = C, v_off = 0): the value is a prefix of the key row.
 *   GQA:             cache [slots, 2, G, Hd]: k_off = 0, v_off = G * Hd, k_hs = v_hs = Hd.
 *
 * Each key/value row is read once per step for all Hg heads: a tile of TILE tokens gets the
 * scores of all heads (s = q . k, q pre-scaled), an online-softmax update (running max m and
 * sum l per head), then acc[h] = acc[h] * alpha[h] + sum_t p[h][t] * v_t while the tile is in
 * L1, and the next tile's rows are prefetched meanwhile (the blocks lie anywhere in the cache;
 * without it a cold cache costs ~20%). A token costs Hg * (Dk + Dv) multiply-adds for the
 * Dk floats of an MLA row: with 16 heads the kernel is bound by the FMA units, not by memory.
 *
 * Work items are (b, g, token range, head range): a long context is split into ranges that
 * threads take concurrently and whose partial (m, l, acc) are merged at the end
 * (flash-decoding), so batch 1 uses every thread; a context too short for that (under
 * 2 * MIN_CHUNK tokens) with fewer (b, g) than threads has its heads split instead, in ranges
 * of whole score blocks, which need no merge (batch 1 at 48 tokens, in the engine: 35 -> 31-33
 * us a call); with many sequences each (b, g) is one item.
 *
 * The cache may hold bf16 rows (a bf16 model's): each tile's rows are then widened to fp32
 * into a per-thread scratch as they are gathered, and everything after runs as for fp32.
 *
 * The query comes in two parts (q1 = the first D1 dims, q2 the rest; for MLA q_lat and q_pe)
 * with their own batch/head strides, so the caller needs no torch.cat; the output's batch and
 * head strides are free too (MLA writes [H, B, C] for the W_UV bmm that follows).
 *
 * The vector helpers (scores, values, the softmax's max and exponentials, the bf16 widening)
 * exist for AVX2+FMA (the scores and values also for AVX-512F: 4 heads x 4 tokens a score
 * block, 1.1-1.2x the AVX2 form on a 2-core Xeon VM, benchmarks/mla_decode.py; the value
 * update is one body for all three, attention_value.h) and for aarch64 (the scores and values
 * in arm_vec.h's vectors: SVE at
 * the build's length, else NEON; the rest NEON); the tiles, the splits and the merge around
 * them are plain C.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define TILE 32        /* tokens per online-softmax step: rows stay in L1 between the passes */
#define HMAX 256       /* query heads per KV head (stack scratch of the scores) */
#define MIN_CHUNK 64   /* fewest tokens a split of one sequence gets (256 before: a batch-1
                          context under 512 then ran on one thread; 64: 0.058 -> 0.048 ms at
                          128 tokens, 0.072 -> 0.060 at 200, benchmarks/mla_decode.py) */
#define PAR_WORK 65536 /* head-token-dims below which one thread does it all */
#define MAX_SPLITS 64  /* ranges one sequence is split into at most */

typedef struct {
    int64_t b, g, t0, t1, part; /* part < 0: the only split, written to out directly */
    int64_t h0, nh;             /* its heads of KV head g: [h0, h0 + nh) */
} Item;

typedef struct {
    int64_t B, G, Hg, Dk, Dv, D1, ld_slot, k_off, k_hs, v_off, v_hs, ldt, bs;
    const void *cache; /* fp32, or bf16 when cache_bf16 */
    int cache_bf16;
    int wide; /* x86: the AVX-512F scores and values */
    const float *qpack;
    const int32_t *table, *lens;
    float *out;
    int64_t out_sb, out_sh;
} Params;

#if defined(__x86_64__)
static inline float hsum(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

/* [a0 . 1, a1 . 1, ..., a7 . 1]: the horizontal sums of eight vectors in one vector */
static inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                           __m256 a6, __m256 a7) {
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 v = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u, v, 0x20), _mm256_permute2f128_ps(u, v, 0x31));
}

/* s[i * TILE + j] = q_i . k_j for heads i < mh <= 4 and tokens j < mt <= 2. Missing heads and
 * tokens repeat the first one (computed, not stored), so the inner loop has no branches. */
static void score_block(int mh, int mt, int64_t Dk, const float *q, const float *const *key,
                        float *s) {
    const float *q0 = q, *q1 = q + (mh > 1 ? Dk : 0), *q2 = q + (mh > 2 ? 2 * Dk : 0),
                *q3 = q + (mh > 3 ? 3 * Dk : 0);
    const float *k0 = key[0], *k1 = key[mt > 1 ? 1 : 0];
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
           a30 = a00, a31 = a00;
    int64_t d = 0;
    for (; d + 8 <= Dk; d += 8) {
        const __m256 x0 = _mm256_loadu_ps(k0 + d), x1 = _mm256_loadu_ps(k1 + d);
        __m256 w = _mm256_loadu_ps(q0 + d);
        a00 = _mm256_fmadd_ps(w, x0, a00);
        a01 = _mm256_fmadd_ps(w, x1, a01);
        w = _mm256_loadu_ps(q1 + d);
        a10 = _mm256_fmadd_ps(w, x0, a10);
        a11 = _mm256_fmadd_ps(w, x1, a11);
        w = _mm256_loadu_ps(q2 + d);
        a20 = _mm256_fmadd_ps(w, x0, a20);
        a21 = _mm256_fmadd_ps(w, x1, a21);
        w = _mm256_loadu_ps(q3 + d);
        a30 = _mm256_fmadd_ps(w, x0, a30);
        a31 = _mm256_fmadd_ps(w, x1, a31);
    }
    float r[8];
    _mm256_storeu_ps(r, hsum8(a00, a01, a10, a11, a20, a21, a30, a31));
    const float *qs[4] = {q0, q1, q2, q3};
    for (int i = 0; i < mh; i++)
        for (int j = 0; j < mt; j++) {
            float v = r[2 * i + j];
            for (int64_t t = d; t < Dk; t++) v += qs[i][t] * key[j][t];
            s[i * TILE + j] = v;
        }
}

#define VCOLS 8 /* columns of one value vector */
#define VB_NV 2
#define VF __m256
#define W 8
#define VLOADU(p) _mm256_loadu_ps(p)
#define VSTOREU(p, v) _mm256_storeu_ps(p, v)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VDUP(s) _mm256_set1_ps(s)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VALUE_BLOCK value_block
#define VALUE_ATTR static inline __attribute__((always_inline))
#define VALUE_UNDEF
#include "attention_value.h"
#define VB_NV 2 /* vectors of a wide value block (tile_step's) */

/* n bf16 values widened to fp32 (exact: a bf16 is the top half of an fp32) */
static inline void widen_bf16(const uint16_t *src, int64_t n, float *dst) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
    }
    for (; i < n; i++) {
        const uint32_t u = (uint32_t)src[i] << 16;
        memcpy(dst + i, &u, sizeof u);
    }
}

/* the largest of mx and sh[0 .. nt) */
static inline float row_max(const float *sh, int64_t nt, float mx) {
    int64_t t = 0;
    if (nt >= 8) {
        __m256 vm = _mm256_loadu_ps(sh);
        for (t = 8; t + 8 <= nt; t += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(sh + t));
        __m128 x = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
        x = _mm_max_ps(x, _mm_movehl_ps(x, x));
        x = _mm_max_ss(x, _mm_movehdup_ps(x));
        mx = _mm_cvtss_f32(x) > mx ? _mm_cvtss_f32(x) : mx;
    }
    for (; t < nt; t++) mx = sh[t] > mx ? sh[t] : mx;
    return mx;
}

/* sh[t] = e^(sh[t] - mx) for t < nt (all <= 0); returns their sum */
static inline float exp_sum(float *sh, int64_t nt, float mx) {
    float sum = 0.0f;
    int64_t t = 0;
    if (nt >= 8) {
        const __m256 vmx = _mm256_set1_ps(mx);
        __m256 vsum = _mm256_setzero_ps();
        for (; t + 8 <= nt; t += 8) {
            const __m256 e = exp256_neg(_mm256_sub_ps(_mm256_loadu_ps(sh + t), vmx));
            _mm256_storeu_ps(sh + t, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        sum = hsum(vsum);
    }
    for (; t < nt; t++) {
        sh[t] = expf(sh[t] - mx);
        sum += sh[t];
    }
    return sum;
}

/* The AVX-512F forms (`wide`, where the CPU has it: 16 lanes, 32 registers). Scores: s[i *
 * TILE + j] = q_i . k_j for heads i < mh <= 4 and tokens j < mt <= 4, the last Dk % 16 dims
 * under a mask, the 16 sums across lanes in one butterfly (reduce16); missing heads and
 * tokens repeat the first. */
static __attribute__((target("avx512f"))) void score_block16(int mh, int mt, int64_t Dk,
                                                             const float *q,
                                                             const float *const *key, float *s) {
    const float *qr[4], *kr[4];
    for (int i = 0; i < 4; i++) {
        qr[i] = q + (i < mh ? i : 0) * Dk;
        kr[i] = key[i < mt ? i : 0];
    }
    __m512 a[16];
    for (int n = 0; n < 16; n++) a[n] = _mm512_setzero_ps();
    for (int64_t d = 0; d < Dk; d += 16) {
        const __mmask16 mk = Dk - d >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (Dk - d)) - 1);
        __m512 x[4];
        for (int j = 0; j < 4; j++) x[j] = _mm512_maskz_loadu_ps(mk, kr[j] + d);
        for (int i = 0; i < 4; i++) {
            const __m512 w = _mm512_maskz_loadu_ps(mk, qr[i] + d);
            for (int j = 0; j < 4; j++) a[4 * i + j] = _mm512_fmadd_ps(w, x[j], a[4 * i + j]);
        }
    }
    float r[16];
    _mm512_storeu_ps(r, reduce16(a));
    for (int i = 0; i < mh; i++)
        for (int j = 0; j < mt; j++) s[i * TILE + j] = r[REDUCE16_LANE(4 * i + j)];
}

/* value_block's AVX-512F form: NV <= 4 vectors of 16 columns for 4 heads (16 accumulators) */
#undef VB_NV
#define VF __m512
#define W 16
#define VB_NV 4
#define VLOADU(p) _mm512_loadu_ps(p)
#define VSTOREU(p, v) _mm512_storeu_ps(p, v)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VDUP(s) _mm512_set1_ps(s)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VALUE_BLOCK value_block16
#define VALUE_ATTR AVX512_INLINE
#define VALUE_UNDEF
#include "attention_value.h"
#define VB_NV 2 /* the AVX2 blocks' (tile_step's) */

/* the value update of 4 heads over all Dv columns in AVX-512F blocks; returns the first
 * column left to the caller (Dv % 16) */
static __attribute__((target("avx512f"))) int64_t values16(int mh, int64_t nt, int64_t Dv,
                                                           const float *p, const float *alpha,
                                                           const float *const *val, float *acc,
                                                           int64_t acc_sh) {
    int64_t c = 0;
    for (; c + 64 <= Dv; c += 64) value_block16(4, mh, nt, c, p, alpha, val, acc, acc_sh);
    for (; c + 16 <= Dv; c += 16) value_block16(1, mh, nt, c, p, alpha, val, acc, acc_sh);
    return c;
}

#elif defined(__aarch64__)
/* The scores and the value update in arm_vec.h's vectors: SVE where the build fixed its
 * length (W lanes), else NEON's 4; the softmax's helpers and the bf16 widening below are
 * NEON's on every aarch64 CPU (a tile is 32 tokens). */
#include "arm_vec.h"
#define VCOLS W /* columns of one value vector */
#define VB_NV 4 /* vectors of a wide value block: 16 accumulators of 32 registers */

/* s[i * TILE + j] = q_i . k_j for heads i < mh <= 4 and tokens j < mt <= 2, as the AVX2
 * body: missing heads and tokens repeat the first one (computed, not stored). */
static void score_block(int mh, int mt, int64_t Dk, const float *q, const float *const *key,
                        float *s) {
    const float *qs[4] = {q, q + (mh > 1 ? Dk : 0), q + (mh > 2 ? 2 * Dk : 0),
                          q + (mh > 3 ? 3 * Dk : 0)};
    const float *k0 = key[0], *k1 = key[mt > 1 ? 1 : 0];
    VF a[4][2];
    for (int i = 0; i < 4; i++) a[i][0] = a[i][1] = VZERO();
    int64_t d = 0;
    for (; d + W <= Dk; d += W) {
        const VF x0 = VLOADU(k0 + d), x1 = VLOADU(k1 + d);
        for (int i = 0; i < 4; i++) {
            const VF w = VLOADU(qs[i] + d);
            a[i][0] = VFMA(w, x0, a[i][0]);
            a[i][1] = VFMA(w, x1, a[i][1]);
        }
    }
    for (int i = 0; i < mh; i++)
        for (int j = 0; j < mt; j++) {
            float v = VHSUM(a[i][j]);
            for (int64_t t = d; t < Dk; t++) v += qs[i][t] * key[j][t];
            s[i * TILE + j] = v;
        }
}

#define VSTOREU(p, v) VSTORE(p, v) /* unaligned on both */
#define VALUE_BLOCK value_block
#define VALUE_ATTR static inline __attribute__((always_inline))
#include "attention_value.h"

/* n bf16 values widened to fp32 (exact: a bf16 is the top half of an fp32) */
static inline void widen_bf16(const uint16_t *src, int64_t n, float *dst) {
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
        vst1q_f32(dst + i, vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(src + i), 16)));
    for (; i < n; i++) {
        const uint32_t u = (uint32_t)src[i] << 16;
        memcpy(dst + i, &u, sizeof u);
    }
}

/* the largest of mx and sh[0 .. nt) */
static inline float row_max(const float *sh, int64_t nt, float mx) {
    int64_t t = 0;
    if (nt >= 4) {
        float32x4_t vm = vld1q_f32(sh);
        for (t = 4; t + 4 <= nt; t += 4) vm = vmaxq_f32(vm, vld1q_f32(sh + t));
        const float v = vmaxvq_f32(vm);
        mx = v > mx ? v : mx;
    }
    for (; t < nt; t++) mx = sh[t] > mx ? sh[t] : mx;
    return mx;
}

/* sh[t] = e^(sh[t] - mx) for t < nt (all <= 0); returns their sum */
static inline float exp_sum(float *sh, int64_t nt, float mx) {
    float sum = 0.0f;
    int64_t t = 0;
    if (nt >= 4) {
        const float32x4_t vmx = vdupq_n_f32(mx);
        float32x4_t vsum = vdupq_n_f32(0.0f);
        for (; t + 4 <= nt; t += 4) {
            const float32x4_t e = exp4_neg(vsubq_f32(vld1q_f32(sh + t), vmx));
            vst1q_f32(sh + t, e);
            vsum = vaddq_f32(vsum, e);
        }
        sum = vaddvq_f32(vsum);
    }
    for (; t < nt; t++) {
        sh[t] = expf(sh[t] - mx);
        sum += sh[t];
    }
    return sum;
}
#endif

static inline void prefetch_span(const float *p, int64_t n) {
    for (int64_t d = 0; d < n; d += 16) PREFETCH_T0(p + d);
}

/* One tile: scores, online-softmax update of (m, l), then the values into acc. The n_next
 * rows of the next tile (keys next_key, values next_val unless they lie in the keys) come
 * from blocks anywhere in the cache, where the hardware prefetcher has no stream to follow:
 * they are requested two at a time during the first sweep of the scores. */
static void tile_step(const Params *P, int64_t Hg, int64_t nt, const float *q,
                      const float *const *key, const float *const *val, float *s, float *m,
                      float *l, float *acc, int64_t acc_sh, int64_t n_next,
                      const float *const *next_key, const float *const *next_val) {
    const int64_t Dv = P->Dv;
#if defined(__x86_64__)
    const int wide = P->wide;
#else
    const int wide = 0;
#endif
    const int64_t tb = wide ? 4 : 2; /* tokens per score block */
    for (int64_t h0 = 0; h0 < Hg; h0 += 4) {
        const int mh = Hg - h0 >= 4 ? 4 : (int)(Hg - h0);
        for (int64_t t0 = 0; t0 < nt; t0 += tb) {
            if (h0 == 0)
                for (int64_t j = t0; j < t0 + tb && j < n_next; j++) {
                    prefetch_span(next_key[j], P->Dk);
                    if (next_val) prefetch_span(next_val[j], Dv);
                }
            const int mt = nt - t0 >= tb ? (int)tb : (int)(nt - t0);
            const float *qh = q + h0 * P->Dk;
#if defined(__x86_64__)
            if (wide) {
                score_block16(mh, mt, P->Dk, qh, key + t0, s + h0 * TILE + t0);
                continue;
            }
#endif
            score_block(mh, mt, P->Dk, qh, key + t0, s + h0 * TILE + t0);
        }
    }
    float alpha[HMAX];
    for (int64_t h = 0; h < Hg; h++) {
        float *sh = s + h * TILE;
        const float mx = row_max(sh, nt, m[h]);
        alpha[h] = expf(m[h] - mx); /* 0 on the first tile (m = -inf) */
        const float sum = exp_sum(sh, nt, mx);
        l[h] = l[h] * alpha[h] + sum;
        m[h] = mx;
    }
    for (int64_t h0 = 0; h0 < Hg; h0 += 4) {
        const int mh = Hg - h0 >= 4 ? 4 : (int)(Hg - h0);
        const float *p = s + h0 * TILE;
        float *ah = acc + h0 * acc_sh;
        int64_t c = 0;
#if defined(__x86_64__)
        if (wide) c = values16(mh, nt, Dv, p, alpha + h0, val, ah, acc_sh);
#endif
        for (; c + VB_NV * VCOLS <= Dv; c += VB_NV * VCOLS)
            value_block(VB_NV, mh, nt, c, p, alpha + h0, val, ah, acc_sh);
        for (; c + VCOLS <= Dv; c += VCOLS)
            value_block(1, mh, nt, c, p, alpha + h0, val, ah, acc_sh);
        for (; c < Dv; c++)
            for (int i = 0; i < mh; i++) {
                float v = ah[i * acc_sh + c] * alpha[h0 + i];
                for (int64_t t = 0; t < nt; t++) v += p[i * TILE + t] * val[t][c];
                ah[i * acc_sh + c] = v;
            }
    }
}

/* Tokens [t0, t1) of sequence b against the item's heads of KV head g: unnormalised acc
 * (head stride acc_sh), running max m and sum l, from the item's first head. A bf16 cache's
 * rows are widened into wide (2 * TILE rows of Dk + Dv floats). */
static void run_item(const Params *P, const Item *it, float *acc, int64_t acc_sh, float *m,
                     float *l, float *wide) {
    const int64_t Hg = it->nh, bs = P->bs;
    const float *q = P->qpack + ((it->b * P->G + it->g) * P->Hg + it->h0) * P->Dk;
    const int32_t *table = P->table + it->b * P->ldt;
    const float *key[2][TILE], *val[2][TILE]; /* this tile's rows and the next one's */
    float s[HMAX * TILE];
    for (int64_t h = 0; h < Hg; h++) {
        memset(acc + h * acc_sh, 0, P->Dv * sizeof(float));
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    const int64_t koff = P->k_off + it->g * P->k_hs, voff = P->v_off + it->g * P->v_hs;
    const int val_in_key = voff >= koff && voff + P->Dv <= koff + P->Dk; /* MLA */
    int cur = 0;
    for (int64_t t0 = it->t0 - TILE; t0 < it->t1; t0 += TILE, cur = 1 - cur) {
        /* rows of tile t0 + TILE into the other buffer, then tile t0 (none the first time) */
        const int64_t n_next = it->t1 - t0 - TILE < TILE ? it->t1 - t0 - TILE : TILE;
        for (int64_t j = 0; j < n_next; j++) {
            const int64_t pos = t0 + TILE + j;
            const int64_t at = ((int64_t)table[pos / bs] * bs + pos % bs) * P->ld_slot;
            if (P->cache_bf16) {
                const uint16_t *row = (const uint16_t *)P->cache + at;
                float *kw = wide + ((1 - cur) * TILE + j) * (P->Dk + P->Dv);
                widen_bf16(row + koff, P->Dk, kw);
                key[1 - cur][j] = kw;
                if (val_in_key) {
                    val[1 - cur][j] = kw + (voff - koff);
                } else {
                    widen_bf16(row + voff, P->Dv, kw + P->Dk);
                    val[1 - cur][j] = kw + P->Dk;
                }
            } else {
                const float *row = (const float *)P->cache + at;
                key[1 - cur][j] = row + koff;
                val[1 - cur][j] = row + voff;
            }
        }
        if (t0 >= it->t0)
            tile_step(P, Hg, it->t1 - t0 < TILE ? it->t1 - t0 : TILE, q, key[cur], val[cur], s,
                      m, l, acc, acc_sh, n_next > 0 ? n_next : 0, key[1 - cur],
                      val_in_key ? NULL : val[1 - cur]);
    }
}

typedef struct {
    int64_t b, g, item0, S; /* the S splits of (b, g) are items item0 .. item0 + S - 1 */
} Merge;

/* 0, or -1 when scratch memory could not be allocated (nothing is written then) */
int moeserve_paged_decode_attention(
    int64_t B, int64_t G, int64_t Hg, int64_t Dk, int64_t Dv, int64_t D1, const float *q1,
    int64_t q1_sb, int64_t q1_sh, const float *q2, int64_t q2_sb, int64_t q2_sh, float scale,
    const void *cache, int64_t ld_slot, int64_t k_off, int64_t k_hs, int64_t v_off,
    int64_t v_hs, const int32_t *table, int64_t ldt, const int32_t *lens, int64_t bs,
    float *out, int64_t out_sb, int64_t out_sh, int cache_bf16, int wide) {
    const int64_t H = G * Hg;
    int64_t total = 0;
    for (int64_t b = 0; b < B; b++) total += lens[b] > 0 ? lens[b] : 0;
    const int threads = omp_get_max_threads();
    const int split = threads > 1 && total * H * (Dk + Dv) >= PAR_WORK;
    /* a split per ~1/(2 * threads) of the work, at least MIN_CHUNK tokens, whole tiles */
    int64_t chunk = (total * G + 2 * threads - 1) / (2 * threads);
    chunk = chunk < MIN_CHUNK ? MIN_CHUNK : chunk;
    chunk = (chunk + TILE - 1) / TILE * TILE;
    int64_t n_items = 0, n_parts = 0, n_merges = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = lens[b] > 0 ? lens[b] : 0;
        int64_t S = split ? (n + chunk - 1) / chunk : 1;
        S = S < 1 ? 1 : S > MAX_SPLITS ? MAX_SPLITS : S;
        n_items += G * S;
        if (S > 1) n_parts += G * S, n_merges += G;
    }
    /* fewer (b, g) pairs than threads and none split by tokens (short contexts): their heads
     * are split instead, in ranges of whole score blocks (4 heads), which need no merge */
    int64_t hper = Hg, nhr = 1; /* heads per range, ranges per (b, g) */
    if (split && !n_merges && B * G < threads) {
        const int64_t want = (threads + B * G - 1) / (B * G);
        hper = ((Hg + want - 1) / want + 3) / 4 * 4;
        nhr = (Hg + hper - 1) / hper;
        n_items *= nhr;
    }
    const int par = split && n_items > 1; /* one item: no thread to wake */
    Item *items = malloc(n_items * sizeof(Item));
    Merge *merges = malloc((n_merges + 1) * sizeof(Merge));
    float *qpack = malloc((B * H * Dk + 1) * sizeof(float));
    float *part_acc = malloc((n_parts * Hg * Dv + 1) * sizeof(float));
    float *ml = malloc((n_items * Hg * 2 + 1) * sizeof(float)); /* m then l of each item */
    if (!items || !merges || !qpack || !part_acc || !ml) {
        free(items), free(merges), free(qpack), free(part_acc), free(ml);
        return -1;
    }
    int64_t k = 0, part = 0, mg = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = lens[b] > 0 ? lens[b] : 0;
        int64_t S = split ? (n + chunk - 1) / chunk : 1;
        S = S < 1 ? 1 : S > MAX_SPLITS ? MAX_SPLITS : S;
        const int64_t per = (n + S - 1) / S; /* S equal ranges; S > 1 implies per >= TILE */
        for (int64_t g = 0; g < G; g++) {
            if (S > 1) merges[mg++] = (Merge){b, g, k, S};
            for (int64_t s = 0; s < S; s++) {
                const int64_t t0 = s * per, t1 = t0 + per < n ? t0 + per : n;
                for (int64_t r = 0; r < nhr; r++) {
                    const int64_t h0 = r * hper, nh = Hg - h0 < hper ? Hg - h0 : hper;
                    items[k++] = (Item){b, g, t0, t1, S > 1 ? part++ : -1, h0, nh};
                }
            }
        }
    }
    Params P = {B, G, Hg, Dk, Dv, D1, ld_slot, k_off, k_hs, v_off, v_hs, ldt, bs,
                cache, cache_bf16, wide, qpack, table, lens, out, out_sb, out_sh};
    int failed = 0;
#pragma omp parallel if (par)
    {
        float *wide = cache_bf16 ? malloc(2 * TILE * (Dk + Dv) * sizeof(float)) : NULL;
        if (cache_bf16 && !wide) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * H; bh++) {
            const int64_t b = bh / H, h = bh % H;
            float *dst = qpack + bh * Dk;
            for (int64_t d = 0; d < D1; d++) dst[d] = scale * q1[b * q1_sb + h * q1_sh + d];
            for (int64_t d = D1; d < Dk; d++)
                dst[d] = scale * q2[b * q2_sb + h * q2_sh + d - D1];
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_items; i++) {
            if (failed) continue;
            const Item *it = &items[i];
            float *m = ml + i * Hg * 2, *l = m + Hg;
            if (it->part < 0) {
                float *o = out + it->b * out_sb + (it->g * Hg + it->h0) * out_sh;
                run_item(&P, it, o, out_sh, m, l, wide);
                for (int64_t h = 0; h < it->nh; h++) {
                    const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f; /* 0 for no context */
                    for (int64_t c = 0; c < Dv; c++) o[h * out_sh + c] *= inv;
                }
            } else {
                run_item(&P, it, part_acc + it->part * Hg * Dv, Dv, m, l, wide);
            }
        }
        /* merge the splits: o = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s; a merge's
         * items are consecutive and so are their parts */
#pragma omp for schedule(static)
        for (int64_t j = 0; j < n_merges * Hg; j++) {
            if (failed) continue;
            const Merge *mr = &merges[j / Hg];
            const int64_t h = j % Hg;
            const int64_t i0 = mr->item0;
            float M = -INFINITY, L = 0.0f, w[MAX_SPLITS];
            for (int64_t s = 0; s < mr->S; s++) {
                const float ms = ml[(i0 + s) * Hg * 2 + h];
                M = ms > M ? ms : M;
            }
            for (int64_t s = 0; s < mr->S; s++) {
                const float *mls = ml + (i0 + s) * Hg * 2;
                w[s] = expf(mls[h] - M);
                L += w[s] * mls[Hg + h];
            }
            const float inv = 1.0f / L;
            for (int64_t s = 0; s < mr->S; s++) w[s] *= inv;
            float *o = out + mr->b * out_sb + (mr->g * Hg + h) * out_sh;
            const float *a = part_acc + (items[i0].part * Hg + h) * Dv;
            for (int64_t c = 0; c < Dv; c++) {
                float v = 0.0f;
                for (int64_t s = 0; s < mr->S; s++) v += w[s] * a[s * Hg * Dv + c];
                o[c] = v;
            }
        }
        free(wide);
    }
    free(items), free(merges), free(qpack), free(part_acc), free(ml);
    return failed ? -1 : 0;
}
