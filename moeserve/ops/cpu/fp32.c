/* fp32 kernels for decode (a few token rows) on AVX2+FMA CPUs, with an AVX-512F variant of
 * the GEMMs, and on aarch64 with NEON or SVE bodies of the same GEMMs (at the end of the
 * x86 part). The core is the few-row GEMM y[M, N] = x[M, K] @ w[N, K]^T; the MoE layer, the
 * per-head GEMMs of MLA, RMSNorm and routing build on it.
 *
 * Decode multiplies a handful of token rows by large weights, so the weight must be streamed
 * from memory exactly once at full bandwidth. Each thread takes pairs of weight rows (each
 * row is K contiguous floats: a sequential stream) and dots them with up to MB token rows
 * that stay in L1, keeping 2 * MB accumulators in registers. BLAS libraries tile for large M
 * and read the weight at a fraction of the bandwidth when M is 2..16.
 *
 * The GEMM bodies are compiled twice (this file includes itself, as int8.c does): for
 * AVX2+FMA (8 lanes, pairs of weight rows against blocks of 6 token rows), the baseline, and
 * for AVX-512F with `#pragma GCC target` (16 lanes, 32 registers: from QUAD_MIN token rows on,
 * where the FMAs and the token rows' loads bound the speed rather than the weight stream,
 * quads of weight rows against blocks of 6 token rows, so each loaded token vector feeds 4
 * FMAs; fewer rows run the pairs). The caller picks one per call (`wide`), ops/cpu/fp32.py
 * from the CPU's flags. An AVX-512 MoE call in which an expert has PACK_MIN_ROWS rows or more
 * (prefill) runs moe_packed.h instead: packed weight panels and an outer-product tile.
 *
 * Compiled at first use (moeserve/ops/cpu/fp32.py) with -fopenmp; loaded after torch,
 * it shares torch's OpenMP runtime and thread count.
 */
#ifndef FP32_BODY
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#ifndef MIN_PREFETCH
#define MIN_PREFETCH 2048 /* floats (8 KB); see prefetch_ahead */
#endif
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)

/* How far ahead (in floats) to prefetch the weight stream: the same offset in a later pair of
 * weight rows (pairs start 2 * ldw apart), at least MIN_PREFETCH floats ahead, so both rows of
 * that pair are fetched. A fixed distance of one row (4 KB with K = 1024) lands in the pair's
 * own second row, already streaming, and leaves the next pair's first row to the hardware:
 * measured here (1 thread, K = 1024) 23 -> 36 GB/s at 2 token rows, 18 -> 34 at 6, 40 -> 50
 * at 1. */
static inline int64_t prefetch_ahead(int64_t ldw) {
    const int64_t pair = 2 * ldw;
    return pair * ((MIN_PREFETCH + pair - 1) / pair);
}

/* a bf16 weight as fp32 (exact: a bf16 is the top half of an fp32). Each body below is also
 * instantiated on bf16 weights (WT uint16_t, suffix _bf16): VLOADW widens W of them in
 * registers, so bf16 weights stream at 2 bytes each without AMX, the tokens staying fp32. */
static inline float bf16_f32(uint16_t v) {
    const uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#if defined(__x86_64__)
/* ---- AVX2 + FMA: 8 lanes, blocks of 6 rows (12 accumulators + 3 of 16 registers) ---- */
#define FP32_BODY
#define W 8
#define MB 6
#define SFX _avx2
typedef __m256 vf_avx2;
#define VF vf_avx2
#define VZERO() _mm256_setzero_ps()
#define VLOADU(p) _mm256_loadu_ps(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VHSUM(v) hsum256(v)
#define NJ 2 /* weight rows per job: a pair */
#define PAIR_ROWS_FEW pair_rows_avx2
#define WT float
#define VLOADW(p) VLOADU(p)
#define WF(v) (v)
#include "fp32.c" /* this file: its body, for this ISA */
#undef SFX
#undef PAIR_ROWS_FEW
#undef WT
#undef VLOADW
#undef WF
#define SFX _avx2_bf16
#define PAIR_ROWS_FEW pair_rows_avx2_bf16
#define WT uint16_t
#define VLOADW(p)                                                                      \
    _mm256_castsi256_ps(                                                               \
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define WF(v) bf16_f32(v)
#include "fp32.c" /* the body on bf16 weights */
#undef WT
#undef VLOADW
#undef WF
#undef NJ
#undef PAIR_ROWS_FEW
#undef W
#undef MB
#undef SFX
#undef VF
#undef VZERO
#undef VLOADU
#undef VFMA
#undef VADD
#undef VHSUM

/* ---- AVX-512F: 16 lanes; from QUAD_MIN token rows on, jobs of 4 weight rows against blocks
 * of 6 token rows (24 accumulators + 4 weights + 1 of 32 registers) ---- */
#pragma GCC push_options
#pragma GCC target("avx512f")
#define VREDUCE16 reduce16
#define VSTOREU(p, v) _mm512_storeu_ps(p, v)
#define W 16
#define MB 12 /* pairs: 24 accumulators + 3 of 32 registers */
#define NJ 4  /* weight rows per job: a quad (run as two pairs below QUAD_MIN token rows) */
#define MBQ 6 /* token rows per quad block */
#ifndef QUAD_MIN
#define QUAD_MIN 8 /* measured: pairs are bound by the token rows' loads from 8 rows on */
#endif
#ifndef WIDE_MIN_ROWS
#define WIDE_MIN_ROWS 5
#endif
/* below WIDE_MIN_ROWS token rows (bound by the weight stream) the AVX2 pairs stream faster:
 * measured 77 against 64-69 GFLOP/s at 2 rows, K = 1024. A call whose rows (every group's,
 * for the MoE) are all that few runs the AVX2 kernel; a MoE call mixing few-row and many-row
 * groups runs the AVX2 pairs for the former. */
#define PAIR_ROWS_FEW(M, ...) \
    ((M) < WIDE_MIN_ROWS ? pair_rows_avx2(M, __VA_ARGS__) : pair_rows_avx512(M, __VA_ARGS__))
#define SFX _avx512
typedef __m512 vf_avx512;
#define VF vf_avx512
#define VZERO() _mm512_setzero_ps()
#define VLOADU(p) _mm512_loadu_ps(p)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VHSUM(v) _mm512_reduce_add_ps(v)
#define WT float
#define VLOADW(p) VLOADU(p)
#define WF(v) (v)
#include "fp32.c" /* this file: its body, for this ISA */

/* y[:M, :nc] = x @ w^T through the decode jobs of NJ rows: moe_packed.h's few-row path */
static void rows_f32(int64_t M, int64_t K, const float *x, int64_t ldx, const float *w,
                     int64_t ldw, int nc, float *y, int64_t ldy) {
    const int64_t pf = prefetch_ahead(ldw), pf4 = prefetch_ahead4_avx512(ldw);
    for (int q = 0; q < nc; q += NJ)
        job_rows_avx512(M, K, x, ldx, w + q * ldw, ldw, nc - q < NJ ? nc - q : NJ, y + q, ldy,
                        pf, pf4);
}

/* prefill MoE: experts with many rows through packed panels */
#define PK_T float
#define PK_SFX _f32
#define PK_PACK(K, r, buf) pack_panel(K, (const float *)(r)->w, (r)->ld, (r)->nr, buf)
#define PK_ROWS(M, K, x, ldx, r, y, ldy) \
    rows_f32(M, K, x, ldx, (const float *)(r)->w, (r)->ld, (r)->nr, y, ldy)
#include "moe_packed.h"

/* the body on bf16 weights (no packed panels: prefill's many rows go to the bf16 AMX kernels
 * or torch) */
#undef SFX
#undef PAIR_ROWS_FEW
#undef WT
#undef VLOADW
#undef WF
#define SFX _avx512_bf16
#define PAIR_ROWS_FEW(M, ...)                                                  \
    ((M) < WIDE_MIN_ROWS ? pair_rows_avx2_bf16(M, __VA_ARGS__)                 \
                         : pair_rows_avx512_bf16(M, __VA_ARGS__))
#define WT uint16_t
#define VLOADW(p)                                                              \
    _mm512_castsi512_ps(                                                       \
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define WF(v) bf16_f32(v)
#include "fp32.c" /* the body on bf16 weights */
#pragma GCC pop_options

void moeserve_gemm_nt_small(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx,
                            const float *w, int64_t ldw, float *y, int64_t ldy, int wide) {
    if (wide && M >= WIDE_MIN_ROWS) /* fewer rows: the AVX2 pairs, as jobs of their own */
        gemm_avx512(M, N, K, x, ldx, w, ldw, y, ldy);
    else
        gemm_avx2(M, N, K, x, ldx, w, ldw, y, ldy);
}

/* Routed experts, one call per MoE layer: for each group g (rows
 * [start[g], start[g] + count[g]) of x, all routed to expert[g]):
 *   h = x_g @ w13[e]^T            (gate rows then up rows: [count, 2F])
 *   a = silu(h[:, :F]) * h[:, F:]  (written over h[:, :F])
 *   y_g = route_w_g * (a @ w2[e]^T)
 * w13 is [E, 2F, D] and w2 [E, D, F], both contiguous; h is scratch of [rows, 2F]. One
 * parallel region: the threads share out the weight row pairs of all experts at once (three
 * barriers per layer instead of two parallel regions per expert). With AVX-512 and an expert
 * of PACK_MIN_ROWS rows or more, moe_panels_f32 (moe_packed.h). */
void moeserve_moe_small(int64_t n_groups, const int64_t *expert, const int64_t *start,
                        const int64_t *count, int64_t D, int64_t F, const float *x,
                        const float *w13, const float *w2, const float *route_w, float *h,
                        float *y, int wide) {
    int64_t most = 0;
    for (int64_t g = 0; g < n_groups; g++) most = count[g] > most ? count[g] : most;
    if (wide && most >= PACK_MIN_ROWS)
        moe_panels_f32(n_groups, expert, start, count, D, F, x, w13, 0, 0, w2, 0, 0, 0, route_w,
                       h, y);
    else if (wide && most >= WIDE_MIN_ROWS)
        moe_avx512(n_groups, expert, start, count, D, F, x, w13, w2, route_w, h, y);
    else
        moe_avx2(n_groups, expert, start, count, D, F, x, w13, w2, route_w, h, y);
}

/* Per-head few-row GEMMs, one call for all heads: y[h] = x[h] @ w[h]^T for h < Hh, with
 * x[h] rows at x + h*sxh + m*sxm, w[h] an [N, K] block at w + h*swh (row stride ldw), y[h]
 * rows at y + h*syh + m*sym. MLA's absorbed decode uses it for q_nope @ W_UK and
 * o_lat @ W_UV (16 small weights per layer); the threads share the (head, row pair) jobs. */
void moeserve_head_gemm_nt_small(int64_t Hh, int64_t M, int64_t N, int64_t K, const float *x,
                                 int64_t sxh, int64_t sxm, const float *w, int64_t swh,
                                 int64_t ldw, float *y, int64_t syh, int64_t sym, int wide) {
    if (wide && M >= WIDE_MIN_ROWS)
        head_gemm_avx512(Hh, M, N, K, x, sxh, sxm, w, swh, ldw, y, syh, sym);
    else
        head_gemm_avx2(Hh, M, N, K, x, sxh, sxm, w, swh, ldw, y, syh, sym);
}

/* The three entry points above on bf16 weights (w, w13 and w2 uint16_t bf16 bits): the same
 * bodies, each weight widened in registers; the MoE call's experts all in the dots (no
 * packed panels). */
void moeserve_bf16w_gemm_nt_small(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx,
                                  const uint16_t *w, int64_t ldw, float *y, int64_t ldy,
                                  int wide) {
    if (wide && M >= WIDE_MIN_ROWS)
        gemm_avx512_bf16(M, N, K, x, ldx, w, ldw, y, ldy);
    else
        gemm_avx2_bf16(M, N, K, x, ldx, w, ldw, y, ldy);
}

void moeserve_bf16w_moe_small(int64_t n_groups, const int64_t *expert, const int64_t *start,
                              const int64_t *count, int64_t D, int64_t F, const float *x,
                              const uint16_t *w13, const uint16_t *w2, const float *route_w,
                              float *h, float *y, int wide) {
    int64_t most = 0;
    for (int64_t g = 0; g < n_groups; g++) most = count[g] > most ? count[g] : most;
    if (wide && most >= WIDE_MIN_ROWS)
        moe_avx512_bf16(n_groups, expert, start, count, D, F, x, w13, w2, route_w, h, y);
    else
        moe_avx2_bf16(n_groups, expert, start, count, D, F, x, w13, w2, route_w, h, y);
}

void moeserve_bf16w_head_gemm_nt_small(int64_t Hh, int64_t M, int64_t N, int64_t K,
                                       const float *x, int64_t sxh, int64_t sxm,
                                       const uint16_t *w, int64_t swh, int64_t ldw, float *y,
                                       int64_t syh, int64_t sym, int wide) {
    if (wide && M >= WIDE_MIN_ROWS)
        head_gemm_avx512_bf16(Hh, M, N, K, x, sxh, sxm, w, swh, ldw, y, syh, sym);
    else
        head_gemm_avx2_bf16(Hh, M, N, K, x, sxh, sxm, w, swh, ldw, y, syh, sym);
}

/* RMSNorm of few rows: y[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w, single-threaded (a decode
 * step's rows are a few KB; waking threads would cost more than the work). */
void moeserve_rms_norm(int64_t rows, int64_t D, const float *x, int64_t ldx, const float *w,
                       float eps, float *y, int64_t ldy) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        float *yr = y + r * ldy;
        __m256 acc = _mm256_setzero_ps();
        int64_t d = 0;
        for (; d + 8 <= D; d += 8) {
            __m256 v = _mm256_loadu_ps(xr + d);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum256(acc);
        for (; d < D; d++) ss += xr[d] * xr[d];
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
        const __m256 vinv = _mm256_set1_ps(inv);
        for (d = 0; d + 8 <= D; d += 8) {
            __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xr + d), vinv);
            _mm256_storeu_ps(yr + d, _mm256_mul_ps(v, _mm256_loadu_ps(w + d)));
        }
        for (; d < D; d++) yr[d] = xr[d] * inv * w[d];
    }
}

#elif defined(__aarch64__)
/* ---- aarch64: NEON (4 lanes), or SVE where the build fixed its vector length (arm_vec.h);
 * pairs of weight rows against blocks of 12 token rows (24 accumulators + 3 of 32
 * registers), the AVX-512 pairs' shape. One body per build: the SVE one where it was
 * compiled, else NEON's (`wide` is x86's choice). ---- */
#define FP32_BODY
#define MB 12
#define NJ 2
#include "arm_vec.h"
#define PAIR_ROWS_FEW CAT(pair_rows, SFX)
#define WT float
#define VLOADW(p) VLOADU(p)
#define WF(v) (v)
#include "fp32.c" /* this file: its body, for this ISA */
#undef SFX
#undef WT
#undef VLOADW
#undef WF
#define WT uint16_t
#define WF(v) bf16_f32(v)
#if defined(__ARM_FEATURE_SVE_BITS) && __ARM_FEATURE_SVE_BITS > 0
#define SFX _sve_bf16
#define VLOADW(p)                                                                          \
    svreinterpret_f32_u32(                                                                 \
        svlsl_n_u32_x(svptrue_b32(), svld1uh_u32(svptrue_b32(), (const uint16_t *)(p)), 16))
#else
#define SFX _neon_bf16
#define VLOADW(p) vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t *)(p)), 16))
#endif
#include "fp32.c" /* the body on bf16 weights */
#undef SFX
#if defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
#include "bf16_mmla.h" /* the bf16 weights' calls where the CPU has BFMMLA/BFDOT */
#define BF16_MMLA(call) (!(call))
#else
#define BF16_MMLA(call) 0
#endif
#if defined(__ARM_FEATURE_SVE_BITS) && __ARM_FEATURE_SVE_BITS > 0
#define ARM_F32(name) name##_sve
#define ARM_B16(name) name##_sve_bf16
#else
#define ARM_F32(name) name##_neon
#define ARM_B16(name) name##_neon_bf16
#endif

void moeserve_gemm_nt_small(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx,
                            const float *w, int64_t ldw, float *y, int64_t ldy, int wide) {
    (void)wide;
    ARM_F32(gemm)(M, N, K, x, ldx, w, ldw, y, ldy);
}

void moeserve_moe_small(int64_t n_groups, const int64_t *expert, const int64_t *start,
                        const int64_t *count, int64_t D, int64_t F, const float *x,
                        const float *w13, const float *w2, const float *route_w, float *h,
                        float *y, int wide) {
    (void)wide;
    ARM_F32(moe)(n_groups, expert, start, count, D, F, x, w13, w2, route_w, h, y);
}

void moeserve_head_gemm_nt_small(int64_t Hh, int64_t M, int64_t N, int64_t K, const float *x,
                                 int64_t sxh, int64_t sxm, const float *w, int64_t swh,
                                 int64_t ldw, float *y, int64_t syh, int64_t sym, int wide) {
    (void)wide;
    ARM_F32(head_gemm)(Hh, M, N, K, x, sxh, sxm, w, swh, ldw, y, syh, sym);
}

/* the three above on bf16 weights (x86's moeserve_bf16w_*): where the CPU has the BF16
 * extension, with the rows rounded to bf16 on BFMMLA/BFDOT (bf16_mmla.h: AMX's rounding),
 * else (or where its scratch cannot be had) fp32 rows against the weights widened */
void moeserve_bf16w_gemm_nt_small(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx,
                                  const uint16_t *w, int64_t ldw, float *y, int64_t ldy,
                                  int wide) {
    (void)wide;
    if (BF16_MMLA(gemm_bf16_mmla(M, N, K, x, ldx, w, ldw, y, ldy))) return;
    ARM_B16(gemm)(M, N, K, x, ldx, w, ldw, y, ldy);
}

void moeserve_bf16w_moe_small(int64_t n_groups, const int64_t *expert, const int64_t *start,
                              const int64_t *count, int64_t D, int64_t F, const float *x,
                              const uint16_t *w13, const uint16_t *w2, const float *route_w,
                              float *h, float *y, int wide) {
    (void)wide;
    if (BF16_MMLA(moe_bf16_mmla(n_groups, expert, start, count, D, F, x, w13, w2, route_w, h, y)))
        return;
    ARM_B16(moe)(n_groups, expert, start, count, D, F, x, w13, w2, route_w, h, y);
}

void moeserve_bf16w_head_gemm_nt_small(int64_t Hh, int64_t M, int64_t N, int64_t K,
                                       const float *x, int64_t sxh, int64_t sxm,
                                       const uint16_t *w, int64_t swh, int64_t ldw, float *y,
                                       int64_t syh, int64_t sym, int wide) {
    (void)wide;
    if (BF16_MMLA(head_gemm_bf16_mmla(Hh, M, N, K, x, sxh, sxm, w, swh, ldw, y, syh, sym)))
        return;
    ARM_B16(head_gemm)(Hh, M, N, K, x, sxh, sxm, w, swh, ldw, y, syh, sym);
}

/* RMSNorm of few rows (the x86 one's arithmetic, NEON's 4 lanes) */
void moeserve_rms_norm(int64_t rows, int64_t D, const float *x, int64_t ldx, const float *w,
                       float eps, float *y, int64_t ldy) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        float *yr = y + r * ldy;
        float32x4_t acc = vdupq_n_f32(0.0f);
        int64_t d = 0;
        for (; d + 4 <= D; d += 4) {
            const float32x4_t v = vld1q_f32(xr + d);
            acc = vfmaq_f32(acc, v, v);
        }
        float ss = vaddvq_f32(acc);
        for (; d < D; d++) ss += xr[d] * xr[d];
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
        for (d = 0; d + 4 <= D; d += 4) {
            const float32x4_t v = vmulq_n_f32(vld1q_f32(xr + d), inv);
            vst1q_f32(yr + d, vmulq_f32(v, vld1q_f32(w + d)));
        }
        for (; d < D; d++) yr[d] = xr[d] * inv * w[d];
    }
}
#endif

/* A decoder layer's residual step for few rows: h[r] += y[r] (one rounding per element, as
 * torch's add), then, with a norm weight w, out[r] = RMSNorm(h[r]) by moeserve_rms_norm, so the
 * result is the add and the norm kernel's, bit for bit. No y: the norm alone; no w: the add
 * alone. Single-threaded, as the norm. */
void moeserve_add_rms_norm(int64_t rows, int64_t D, float *h, int64_t ldh, const float *y,
                           int64_t ldy, const float *w, float eps, float *out, int64_t ldo) {
    for (int64_t r = 0; r < rows; r++) {
        float *hr = h + r * ldh;
        if (y) {
            const float *yr = y + r * ldy;
            for (int64_t d = 0; d < D; d++) hr[d] += yr[d];
        }
        if (w) moeserve_rms_norm(1, D, hr, ldh, w, eps, out + r * ldo, ldo);
    }
}

/* A gated MLP's activation for the rows of its hidden [gate F | up F] (rows ldh apart):
 * h[r, f] = silu(gate) * up for f < F, written over the gate half (common.h: silu_mul_row,
 * the MoE kernels' form). Rows over the threads from SILU_PARALLEL elements (a prefill's
 * hidden); a decode step's few rows in the calling thread (waking threads would cost more). */
#define SILU_PARALLEL 65536
void moeserve_silu_mul(int64_t rows, int64_t F, float *h, int64_t ldh) {
#pragma omp parallel for schedule(static) if (rows * F >= SILU_PARALLEL)
    for (int64_t r = 0; r < rows; r++) silu_mul_row(F, h + r * ldh);
}

/* DeepSeek-V3 routing for few rows (the reference is ops/routing.py: route_grouped_sigmoid):
 * scores = sigmoid(logits); choice = scores + bias; keep the topk_group groups whose two best
 * choice values sum highest; take the top_k choices among them (first index on ties);
 * weights = scores of those, optionally renormalised, times scale. */
void moeserve_route_grouped_sigmoid(int64_t T, int64_t E, int64_t n_group, int64_t topk_group,
                                    int64_t top_k, const float *logits, const float *bias,
                                    int norm, float scale, int64_t *ids, float *weights,
                                    int64_t *counts, int64_t extra) {
    /* a row of ids/weights holds top_k choices, then (extra >= 0) the id `extra` with weight
     * 1 (the shared expert's slot); counts (if given) gains one per routed choice */
    const int64_t ld = top_k + (extra >= 0);
    float score[1024], choice[1024], group_score[256];
    const int64_t per_group = E / n_group;
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * E;
        for (int64_t e = 0; e < E; e++) {
            score[e] = 1.0f / (1.0f + expf(-l[e]));
            choice[e] = bias ? score[e] + bias[e] : score[e];
        }
        if (n_group > 1 && topk_group < n_group) {
            for (int64_t g = 0; g < n_group; g++) {
                float b1 = -INFINITY, b2 = -INFINITY;
                for (int64_t e = g * per_group; e < (g + 1) * per_group; e++) {
                    const float c = choice[e];
                    if (c > b1) { b2 = b1; b1 = c; } else if (c > b2) { b2 = c; }
                }
                group_score[g] = per_group > 1 ? b1 + b2 : b1;
            }
            for (int64_t drop = 0; drop < n_group - topk_group; drop++) {
                int64_t worst = -1;
                for (int64_t g = 0; g < n_group; g++)
                    if (group_score[g] != INFINITY &&
                        (worst < 0 || group_score[g] < group_score[worst]))
                        worst = g;
                group_score[worst] = INFINITY; /* marks a dropped group */
                for (int64_t e = worst * per_group; e < (worst + 1) * per_group; e++)
                    choice[e] = -INFINITY;
            }
        }
        float sum = 0.0f;
        for (int64_t k = 0; k < top_k; k++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (choice[e] != -INFINITY && (best < 0 || choice[e] > choice[best])) best = e;
            ids[t * ld + k] = best;
            weights[t * ld + k] = score[best];
            sum += score[best];
            choice[best] = -INFINITY;
            if (counts) counts[best]++;
        }
        const float f = norm ? scale / (sum + 1e-20f) : scale;
        for (int64_t k = 0; k < top_k; k++) weights[t * ld + k] *= f;
        if (extra >= 0) {
            ids[t * ld + top_k] = extra;
            weights[t * ld + top_k] = 1.0f;
        }
    }
}

#else /* FP32_BODY: the GEMM kernels for one ISA, named with the suffix SFX */

/* rows 0..mb-1 of x against weight rows w0 and w1 (w1 == w0 for a last odd row; y gets its
 * second column only when two) */
static inline __attribute__((always_inline)) void CAT(dot_block, SFX)(
    const int mb, const int two, int64_t K, const float *x, int64_t ldx, const WT *w0,
    const WT *w1, float *y, int64_t ldy, int64_t pf) {
    VF a0[MB], a1[MB];
#pragma GCC unroll 12
    for (int i = 0; i < MB; i++) {
        a0[i] = VZERO();
        a1[i] = VZERO();
    }
    int64_t k = 0;
    for (; k + W <= K; k += W) {
        /* the pair's rows are adjacent: prefetching pf floats ahead of each keeps the stream
         * (and the next pair's rows) in flight; past the end of w it is a harmless no-op */
        PREFETCH_T0(w0 + k + pf);
        PREFETCH_T0(w1 + k + pf);
        const VF v0 = VLOADW(w0 + k), v1 = VLOADW(w1 + k);
#pragma GCC unroll 12
        for (int i = 0; i < MB; i++) {
            if (i < mb) {
                const VF xv = VLOADU(x + i * ldx + k);
                a0[i] = VFMA(xv, v0, a0[i]);
                a1[i] = VFMA(xv, v1, a1[i]);
            }
        }
    }
#pragma GCC unroll 12
    for (int i = 0; i < MB; i++) {
        if (i < mb) {
            float s0 = VHSUM(a0[i]), s1 = VHSUM(a1[i]);
            for (int64_t t = k; t < K; t++) {
                s0 += x[i * ldx + t] * WF(w0[t]);
                s1 += x[i * ldx + t] * WF(w1[t]);
            }
            y[i * ldy] = s0;
            if (two) y[i * ldy + 1] = s1;
        }
    }
}

/* One token row against weight rows w0 and w1: with one row, dot_block keeps only two FMA
 * chains in flight, and the FMA latency (4 cycles, 2 ports) caps the stream at ~60% of the
 * read bandwidth; four partial sums per weight row keep eight chains in flight (measured
 * 55-64 -> 81-90 GB/s on a 2-core EPYC whose streaming read peaks at ~86 GB/s). */
static inline void CAT(dot_row1, SFX)(int64_t K, const float *x, const WT *w0,
                                      const WT *w1, int two, float *y, int64_t pf) {
    VF a0[4], a1[4];
    for (int j = 0; j < 4; j++) a0[j] = a1[j] = VZERO();
    int64_t k = 0;
    for (; k + 4 * W <= K; k += 4 * W) {
#pragma GCC unroll 4
        for (int c = 0; c < 4 * W; c += 16) { /* one prefetch per 64-byte line */
            PREFETCH_T0(w0 + k + c + pf);
            PREFETCH_T0(w1 + k + c + pf);
        }
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            const VF xv = VLOADU(x + k + W * j);
            a0[j] = VFMA(xv, VLOADW(w0 + k + W * j), a0[j]);
            a1[j] = VFMA(xv, VLOADW(w1 + k + W * j), a1[j]);
        }
    }
    for (; k + W <= K; k += W) {
        const VF xv = VLOADU(x + k);
        a0[0] = VFMA(xv, VLOADW(w0 + k), a0[0]);
        a1[0] = VFMA(xv, VLOADW(w1 + k), a1[0]);
    }
    float s0 = VHSUM(VADD(VADD(a0[0], a0[1]), VADD(a0[2], a0[3])));
    float s1 = VHSUM(VADD(VADD(a1[0], a1[1]), VADD(a1[2], a1[3])));
    for (; k < K; k++) {
        s0 += x[k] * WF(w0[k]);
        s1 += x[k] * WF(w1[k]);
    }
    y[0] = s0;
    if (two) y[1] = s1;
}

/* All M rows of x (in blocks of MB) against weight rows w0 and w1 (w0 alone when !two). */
static void CAT(pair_rows, SFX)(int64_t M, int64_t K, const float *x, int64_t ldx,
                                const WT *w0, const WT *w1, int two, float *y,
                                int64_t ldy, int64_t pf) {
    if (M == 1) {
        CAT(dot_row1, SFX)(K, x, w0, w1, two, y, pf);
        return;
    }
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t left = M - m0;
        const float *xm = x + m0 * ldx;
        float *ym = y + m0 * ldy;
#define CALL(mb) CAT(dot_block, SFX)(mb, two, K, xm, ldx, w0, w1, ym, ldy, pf)
        /* a block of mb rows, mb a compile-time constant in each case */
        switch (left >= MB ? MB : (int)left) {
            case 1: CALL(1); break;
            case 2: CALL(2); break;
            case 3: CALL(3); break;
            case 4: CALL(4); break;
            case 5: CALL(5); break;
#if MB > 6
            case 6: CALL(6); break;
            case 7: CALL(7); break;
            case 8: CALL(8); break;
            case 9: CALL(9); break;
            case 10: CALL(10); break;
            case 11: CALL(11); break;
#endif
            default: CALL(MB); break;
        }
#undef CALL
    }
}

#ifdef MBQ
/* rows 0..mb-1 of x against the 4 weight rows at w (row stride ldw; the first nw are real,
 * the others repeat row 0 and are not stored): 4 * mb accumulators, and per column step 4 + mb
 * loads for 4 * mb FMAs, so the token rows (streamed from L2 when a block of them does not
 * fit in L1) are read half as often per FMA as with pairs. */
static inline __attribute__((always_inline)) void CAT(dot_quad, SFX)(
    const int mb, const int nw, int64_t K, const float *x, int64_t ldx, const WT *w,
    int64_t ldw, float *y, int64_t ldy, int64_t pf) {
    const WT *wr[4];
    for (int j = 0; j < 4; j++) wr[j] = w + (j < nw ? j : 0) * ldw;
    VF a[MBQ][4];
#pragma GCC unroll 8
    for (int i = 0; i < MBQ; i++)
        for (int j = 0; j < 4; j++) a[i][j] = VZERO();
    int64_t k = 0;
    for (; k + W <= K; k += W) {
        VF v[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            PREFETCH_T0(wr[j] + k + pf);
            v[j] = VLOADW(wr[j] + k);
        }
#pragma GCC unroll 8
        for (int i = 0; i < MBQ; i++) {
            if (i < mb) {
                const VF xv = VLOADU(x + i * ldx + k);
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) a[i][j] = VFMA(xv, v[j], a[i][j]);
            }
        }
    }
    /* reduce 4 token rows x 4 weight rows at a time: sums[4 i + j] */
    float sums[4 * MBQ + 16];
#pragma GCC unroll 2
    for (int i0 = 0; i0 < MBQ; i0 += 4) {
        if (i0 < mb) {
            VF v[16];
#pragma GCC unroll 16
            for (int n = 0; n < 16; n++) {
                const int i = i0 + n / 4;
                v[n] = i < mb ? a[i < MBQ ? i : 0][n % 4] : VZERO();
            }
            float f[16];
            VSTOREU(f, VREDUCE16(v));
#pragma GCC unroll 16
            for (int n = 0; n < 16; n++) sums[4 * i0 + n] = f[REDUCE16_LANE(n)];
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MBQ; i++) {
        if (i < mb) {
            for (int j = 0; j < nw; j++) {
                float s = sums[4 * i + j];
                for (int64_t t = k; t < K; t++) s += x[i * ldx + t] * WF(wr[j][t]);
                y[i * ldy + j] = s;
            }
        }
    }
}
#endif

/* A job: NJ weight rows at w (row stride ldw, the first nw of them real) against all M rows
 * of x into y[:, 0:nw]. Pairs of weight rows for few token rows (bound by the weight stream),
 * quads from QUAD_MIN rows on (bound by the FMAs and the token rows' loads). pf: prefetch
 * distance of the pairs (prefetch_ahead), pf4: of the quads. */
static void CAT(job_rows, SFX)(int64_t M, int64_t K, const float *x, int64_t ldx,
                               const WT *w, int64_t ldw, int nw, float *y, int64_t ldy,
                               int64_t pf, int64_t pf4) {
#ifdef MBQ
    if (M >= QUAD_MIN) {
        for (int64_t m0 = 0; m0 < M; m0 += MBQ) {
            const int64_t left = M - m0;
            const float *xm = x + m0 * ldx;
            float *ym = y + m0 * ldy;
#define CALL(mb) CAT(dot_quad, SFX)(mb, nw, K, xm, ldx, w, ldw, ym, ldy, pf4)
            DISPATCH_MB(left, MBQ, CALL)
#undef CALL
        }
        return;
    }
#endif
    (void)pf4;
    for (int r = 0; r < nw; r += 2) {
        const int two = r + 1 < nw;
        PAIR_ROWS_FEW(M, K, x, ldx, w + r * ldw, w + (r + two) * ldw, two, y + r, ldy, pf);
    }
}

/* prefetch distance of jobs of 4 weight rows: the same offset in a later quad */
static inline int64_t CAT(prefetch_ahead4, SFX)(int64_t ldw) {
    const int64_t quad = 4 * ldw;
    return quad * ((MIN_PREFETCH + quad - 1) / quad);
}

static void CAT(gemm, SFX)(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx,
                           const WT *w, int64_t ldw, float *y, int64_t ldy) {
    const int64_t jobs = (N + NJ - 1) / NJ, pf = prefetch_ahead(ldw);
    const int64_t pf4 = CAT(prefetch_ahead4, SFX)(ldw);
    const int ns = omp_get_max_threads();
    struct job_slot s[ns]; /* the jobs, stolen as common.h's jobs_next says */
    jobs_share(s, ns, jobs);
#pragma omp parallel if (N * K >= 32768)
    for (int64_t p; (p = jobs_next(s, omp_get_thread_num(), ns)) >= 0;) {
        const int64_t n0 = NJ * p;
        const int nw = N - n0 < NJ ? (int)(N - n0) : NJ;
        CAT(job_rows, SFX)(M, K, x, ldx, w + n0 * ldw, ldw, nw, y + n0, ldy, pf, pf4);
    }
}

static void CAT(moe, SFX)(int64_t n_groups, const int64_t *expert, const int64_t *start,
                          const int64_t *count, int64_t D, int64_t F, const float *x,
                          const WT *w13, const WT *w2, const float *route_w, float *h,
                          float *y) {
    const int64_t jobs13 = (2 * F + NJ - 1) / NJ, jobs2 = (D + NJ - 1) / NJ;
    const int64_t pf13 = prefetch_ahead(D), pf2 = prefetch_ahead(F);
    const int64_t pf13q = CAT(prefetch_ahead4, SFX)(D), pf2q = CAT(prefetch_ahead4, SFX)(F);
    const int ns = omp_get_max_threads();
    struct job_slot up[ns], down[ns];
    moe_jobs_share(up, ns, n_groups, count, jobs13);
    moe_jobs_share(down, ns, n_groups, count, jobs2);
#pragma omp parallel
    {
        /* contiguous shares of equal cost (balanced_first_job): each thread streams its own
         * experts' weights, and the busiest experts do not all fall to one thread; a thread
         * done early takes the back half of what another has left (jobs_next) */
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int64_t job; (job = jobs_next(up, t, ns)) >= 0;) {
            const int64_t g = job / jobs13, n0 = NJ * (job % jobs13);
            const int nw = 2 * F - n0 < NJ ? (int)(2 * F - n0) : NJ;
            const WT *w0 = w13 + expert[g] * 2 * F * D + n0 * D;
            CAT(job_rows, SFX)(count[g], D, x + start[g] * D, D, w0, D, nw,
                               h + start[g] * 2 * F + n0, 2 * F, pf13, pf13q);
        }
        moe_activation_phase(n_groups, start, count, F, h, t, nt);
        for (int64_t job; (job = jobs_next(down, t, ns)) >= 0;) {
            const int64_t g = job / jobs2, n0 = NJ * (job % jobs2);
            const int nw = D - n0 < NJ ? (int)(D - n0) : NJ;
            float *yg = y + start[g] * D + n0;
            CAT(job_rows, SFX)(count[g], F, h + start[g] * 2 * F, 2 * F,
                               w2 + expert[g] * D * F + n0 * F, F, nw, yg, D, pf2, pf2q);
            weigh_rows(count[g], route_w + start[g], yg, D, nw);
        }
    }
}

static void CAT(head_gemm, SFX)(int64_t Hh, int64_t M, int64_t N, int64_t K, const float *x,
                                int64_t sxh, int64_t sxm, const WT *w, int64_t swh,
                                int64_t ldw, float *y, int64_t syh, int64_t sym) {
    const int64_t jobs = (N + NJ - 1) / NJ, pf = prefetch_ahead(ldw);
    const int64_t pf4 = CAT(prefetch_ahead4, SFX)(ldw);
#pragma omp parallel for schedule(static) if (Hh * N * K >= 32768)
    for (int64_t job = 0; job < Hh * jobs; job++) {
        const int64_t h = job / jobs, n0 = NJ * (job % jobs);
        const int nw = N - n0 < NJ ? (int)(N - n0) : NJ;
        CAT(job_rows, SFX)(M, K, x + h * sxh, sxm, w + h * swh + n0 * ldw, ldw, nw,
                           y + h * syh + n0, sym, pf, pf4);
    }
}

#endif /* FP32_BODY */
