/* Weight-only int8 kernels for few token rows: fp32 activations, int8 weights with one fp32
 * scale per output row (w[n, k] ~= q[n, k] * scale[n]).
 *
 *   y[M, N] = (x[M, K] @ q[N, K]^T) * scale[N]       the scale is applied once per output
 *
 * Like the fp32 kernel (fp32.c), each weight row is streamed from memory once: the
 * threads share out panels of PANEL weight rows, and each pair of rows in a panel is dotted
 * with blocks of token rows. With 4x fewer weight bytes than fp32, the work per byte
 * (int8 -> fp32 conversion, then one FMA per token row) decides the speed from about 2 rows
 * up, so:
 *
 *   M <= MBQ  convert in registers and FMA straight away; a block of 1-3 rows spreads its
 *             sums over 4 or 2 accumulator chains so it is not bound by the FMA latency
 *   M >  MBQ  convert a KC-column chunk of the panel once into an fp32 buffer, then for
 *             each block of MBF token rows sweep the panel's pairs (each weight is converted
 *             once, and a block's x chunk stays in the near caches across the panel)
 *
 * The body is compiled twice on x86-64 (this file includes itself): for AVX2+FMA (8 lanes),
 * the baseline, and for AVX-512F (16 lanes, twice the FMA work per instruction) with
 * `#pragma GCC target`; the caller picks one per call (`wide`), ops/cpu/int8.py from the
 * CPU's flags. On aarch64 it is compiled once, for NEON or for SVE at the build's vector
 * length. Pure-torch references: ops/cpu/int8.py (linear_int8_ref, moe_int8_ref).
 */
#ifndef INT8_BODY
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "common.h"

#define PANEL 8 /* weight rows per job: a block's x chunk is swept over all of them */
#ifndef KC
#define KC 1024 /* columns per converted chunk (8 rows x 4 KB of fp32): best of 256..1024 */
#endif
#ifndef PREFETCH
#if defined(__x86_64__)
/* bytes ahead on each weight row, into L1, and (PREFETCH_FAR) into L2: a decode step's
 * weights are short streams, whose start a single far prefetch leaves to the hardware
 * (int4_idot.h's IPREFETCH). The benchmark model's decode step at batch 1 (2 threads, Xeon
 * with AMX, one process, 10 alternating rounds): one prefetch at 4096 1.02x the one at 8192,
 * then 2048 with 8192 into L2 1.12x that (4096 with 16384: 1.09x) */
#define PREFETCH 2048
#define PREFETCH_FAR 8192
#else
#define PREFETCH 8192 /* measured best of 0..16384 */
#endif
#endif
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)

/* head_gemm's outputs [n0, n1) of one token row xr in scalar code (the outputs past the last
 * whole vector, and a grouped_out whose groups split a vector): the codes qh (rows ldq
 * apart) times their scales sh (J groups; see head_gemm) */
static void head_scalar(int64_t n0, int64_t n1, int64_t N, int64_t K, const float *xr,
                        const int8_t *qh, int64_t ldq, const float *sh, int64_t J, int64_t g,
                        int grouped_out, float *yr) {
    for (int64_t n = n0; n < n1; n++) {
        float a = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            const float sc = grouped_out ? sh[k * J + n / g] : sh[(k / g) * N + n];
            a += xr[k] * ((float)qh[k * ldq + n] * sc);
        }
        yr[n] = a;
    }
}

#if defined(__x86_64__)
/* ---- AVX2 + FMA: 8 lanes, blocks of 6 rows (12 accumulators of 16 registers) ---- */
#define INT8_BODY
#define W 8
#define MBQ 6 /* rows converted in registers: 2 * 6 accumulators + 3 of 16 registers */
#define MBF 6 /* rows per block over the converted chunk */
#define HC_MB 2 /* head_gemm: 8 accumulators + 4 weights + 1 of 16 registers */
#define HC1_VECS 8 /* head_gemm of one token row: vectors of outputs a job (accumulators) */
#define SFX _avx2
typedef __m256 vf_avx2;
#define VF vf_avx2
#define VZERO() _mm256_setzero_ps()
#define VLOADU(p) _mm256_loadu_ps(p)
#define VLOAD(p) _mm256_load_ps(p)
#define VSTORE(p, v) _mm256_store_ps(p, v)
#define VSTOREU(p, v) _mm256_storeu_ps(p, v)
#define VDUP(s) _mm256_set1_ps(s)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VHSUM(v) hsum256(v)
/* W int8 weights as W floats */
#define VLOADQ(q) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q))))
#include "int8.c" /* this file: its body, for this ISA */
#undef W
#undef MBQ
#undef MBF
#undef HC_MB
#undef HC1_VECS
#undef SFX
#undef VF
#undef VZERO
#undef VLOADU
#undef VLOAD
#undef VSTORE
#undef VSTOREU
#undef VDUP
#undef VMUL
#undef VFMA
#undef VADD
#undef VHSUM
#undef VLOADQ

/* ---- AVX-512F: 16 lanes, 12 rows in registers (24 accumulators of 32 registers) ---- */
#pragma GCC push_options
#pragma GCC target("avx512f")
#define W 16
#define MBQ 12 /* 24 accumulators + 3 of 32 registers */
#define MBF 6  /* measured faster than 12 over the converted chunk */
#define HC_MB 6 /* head_gemm: 24 accumulators + 4 weights + 1 of 32 registers */
#define HC1_VECS 16
#define SFX _avx512
typedef __m512 vf_avx512;
#define VF vf_avx512
#define VZERO() _mm512_setzero_ps()
#define VLOADU(p) _mm512_loadu_ps(p)
#define VLOAD(p) _mm512_load_ps(p)
#define VSTORE(p, v) _mm512_store_ps(p, v)
#define VSTOREU(p, v) _mm512_storeu_ps(p, v)
#define VDUP(s) _mm512_set1_ps(s)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VHSUM(v) _mm512_reduce_add_ps(v)
#define VLOADQ(q) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q))))
#include "int8.c" /* this file: its body, for this ISA */

/* y[:M, :nc] = (x @ q^T) * s through the decode panels: moe_packed.h's few-row path */
static void rows_q8(int64_t M, int64_t K, const float *x, int64_t ldx, const int8_t *q,
                    int64_t ldq, const float *s, int nc, float *y, int64_t ldy) {
    for (int r = 0; r < nc; r += PANEL)
        panel_rows_avx512(M, K, x, ldx, q + r * ldq, ldq, s + r, nc - r < PANEL ? nc - r : PANEL,
                          y + r, ldy);
}

/* prefill MoE: experts with many rows through packed panels, converted while packing */
#define PK_T int8_t
#define PK_SFX _q8
#define PK_PACK(K, r, buf) \
    pack_panel_q8(K, (const int8_t *)(r)->w, (r)->ld, (r)->s, (r)->nr, buf)
#define PK_ROWS(M, K, x, ldx, r, y, ldy) \
    rows_q8(M, K, x, ldx, (const int8_t *)(r)->w, (r)->ld, (r)->s, (r)->nr, y, ldy)
#define PK_GEMM /* the projections from PACK_MIN_ROWS rows */
#include "moe_packed.h"
#pragma GCC pop_options

void moeserve_int8_gemm_nt_small(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx,
                                 const int8_t *q, int64_t ldq, const float *scale, float *y,
                                 int64_t ldy, int wide) {
    if (wide && M >= PACK_MIN_ROWS) /* 1.1-1.9x the dot form from 24 rows (int8_gemm.py) */
        gemm_panels_q8(M, N, K, x, ldx, q, ldq, scale, 0, 0, y, ldy);
    else if (wide)
        gemm_avx512(M, N, K, x, ldx, q, ldq, scale, y, ldy);
    else
        gemm_avx2(M, N, K, x, ldx, q, ldq, scale, y, ldy);
}

/* MLA's absorbed per-head products on int8 codes (the body's head_gemm: the fp32 form on
 * every ISA); the per-head GEMMs' argument list (ops/cpu/bound.py) with the codes' pointer
 * and strides, their scales, the group size and where the groups run */
void moeserve_int8_head_gemm_small(int64_t Hh, int64_t M, int64_t N, int64_t K, const float *x,
                                   int64_t sxh, int64_t sxm, const int8_t *q, int64_t sqh,
                                   int64_t ldq, const float *s, int64_t g, int grouped_out,
                                   float *y, int64_t syh, int64_t sym, int wide) {
    if (wide)
        head_gemm_avx512(Hh, M, N, K, x, sxh, sxm, q, sqh, ldq, s, g, grouped_out, y, syh, sym);
    else
        head_gemm_avx2(Hh, M, N, K, x, sxh, sxm, q, sqh, ldq, s, g, grouped_out, y, syh, sym);
}

/* Routed experts for few rows, one call per MoE layer: the int8 twin of moeserve_moe_small
 * (fp32.c). For each group g (rows [start[g], start[g] + count[g]) of x, all routed to
 * expert[g]):
 *   h = (x_g @ q13[e]^T) * s13[e]           (gate rows then up rows: [count, 2F])
 *   a = silu(h[:, :F]) * h[:, F:]            (written over h[:, :F])
 *   y_g = route_w_g * (a @ q2[e]^T) * s2[e]
 * q13 is [E, 2F, D] int8 with s13 [E, 2F]; q2 is [E, D, F] with s2 [E, D]; all contiguous.
 * h is scratch of [rows, 2F]. One parallel region: the threads share out the weight panels
 * of all experts at once. Any number of rows per expert: with AVX-512 and an expert of
 * PACK_MIN_ROWS rows or more (prefill), moe_panels_q8 (moe_packed.h). */
void moeserve_int8_moe_small(int64_t n_groups, const int64_t *expert, const int64_t *start,
                             const int64_t *count, int64_t D, int64_t F, const float *x,
                             const int8_t *q13, const float *s13, const int8_t *q2,
                             const float *s2, const float *route_w, float *h, float *y,
                             int wide) {
    int64_t most = 0;
    for (int64_t g = 0; g < n_groups; g++) most = count[g] > most ? count[g] : most;
    if (wide && most >= PACK_MIN_ROWS)
        moe_panels_q8(n_groups, expert, start, count, D, F, x, q13, s13, 0, q2, s2, 0, 0, route_w,
                      h, y);
    else if (wide)
        moe_avx512(n_groups, expert, start, count, D, F, x, q13, s13, q2, s2, route_w, h, y);
    else
        moe_avx2(n_groups, expert, start, count, D, F, x, q13, s13, q2, s2, route_w, h, y);
}

/* out[n, :] = q[n, :] * scale[n] for rows [0, N): the dequantized fp32 weight block that a
 * many-row GEMM (prefill) hands to BLAS. Bound by memory: AVX2 only. */
void moeserve_int8_dequant(int64_t N, int64_t K, const int8_t *q, int64_t ldq,
                           const float *scale, float *out, int64_t ldo) {
#pragma omp parallel for schedule(static) if (N * K >= 65536)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *qn = q + n * ldq;
        float *on = out + n * ldo;
        const __m256 s = _mm256_set1_ps(scale[n]);
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) {
            const __m256 v = _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qn + k))));
            _mm256_storeu_ps(on + k, _mm256_mul_ps(v, s));
        }
        for (; k < K; k++) on[k] = (float)qn[k] * scale[n];
    }
}

#elif defined(__aarch64__)
/* ---- aarch64: NEON (4 lanes), or SVE at the build's fixed vector length (arm_vec.h);
 * 12 rows converted in registers (24 accumulators of 32 registers), 6 over a converted
 * chunk, the AVX-512 body's shape. One body per build; `wide` is x86's choice. ---- */
#define INT8_BODY
#define MBQ 12
#define MBF 6
#define HC_MB 6 /* head_gemm: 24 accumulators + 4 weights + 1 of 32 registers */
#define HC1_VECS 16
#include "arm_vec.h"
#define VSTOREU(p, v) VSTORE(p, v) /* unaligned on both */
#include "int8.c" /* this file: its body, for this ISA */
#if defined(__ARM_FEATURE_DOTPROD)
#include "int8_sdot.h"
/* token rows up to which the integer form runs (a GEMM's; an MoE call's largest expert's):
 * on SDOT alone the converted-chunk form shares each conversion among more rows; SMMLA takes
 * 32 products an instruction to the fp32 form's 4 (NEON) and has no limit */
#if defined(__ARM_FEATURE_MATMUL_INT8)
#define SDOT_MAX_ROWS INT64_MAX
#else
#define SDOT_MAX_ROWS 12
#endif
#endif

/* On a CPU with the dot product (SDOT), up to SDOT_MAX_ROWS rows take int8_sdot.h: the rows
 * rounded to 16-bit fixed point, on SMMLA from two rows where the CPU has it (where its
 * scratch cannot be had, the fp32 form runs) */
void moeserve_int8_gemm_nt_small(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx,
                                 const int8_t *q, int64_t ldq, const float *scale, float *y,
                                 int64_t ldy, int wide) {
    (void)wide;
#if defined(__ARM_FEATURE_DOTPROD)
    if (M <= SDOT_MAX_ROWS && !gemm_sdot(M, N, K, x, ldx, q, ldq, scale, y, ldy)) return;
#endif
    CAT(gemm, SFX)(M, N, K, x, ldx, q, ldq, scale, y, ldy);
}

void moeserve_int8_moe_small(int64_t n_groups, const int64_t *expert, const int64_t *start,
                             const int64_t *count, int64_t D, int64_t F, const float *x,
                             const int8_t *q13, const float *s13, const int8_t *q2,
                             const float *s2, const float *route_w, float *h, float *y,
                             int wide) {
    (void)wide;
#if defined(__ARM_FEATURE_DOTPROD)
    int64_t most = 0;
    for (int64_t g = 0; g < n_groups; g++) most = count[g] > most ? count[g] : most;
    if (most <= SDOT_MAX_ROWS && !moe_sdot(n_groups, expert, start, count, D, F, x, q13, s13,
                                           q2, s2, route_w, h, y))
        return;
#endif
    CAT(moe, SFX)(n_groups, expert, start, count, D, F, x, q13, s13, q2, s2, route_w, h, y);
}

void moeserve_int8_head_gemm_small(int64_t Hh, int64_t M, int64_t N, int64_t K, const float *x,
                                   int64_t sxh, int64_t sxm, const int8_t *q, int64_t sqh,
                                   int64_t ldq, const float *s, int64_t g, int grouped_out,
                                   float *y, int64_t syh, int64_t sym, int wide) {
    (void)wide;
    CAT(head_gemm, SFX)(Hh, M, N, K, x, sxh, sxm, q, sqh, ldq, s, g, grouped_out, y, syh, sym);
}

/* moeserve_int8_dequant of the x86 body, 4 lanes at a time */
void moeserve_int8_dequant(int64_t N, int64_t K, const int8_t *q, int64_t ldq,
                           const float *scale, float *out, int64_t ldo) {
#pragma omp parallel for schedule(static) if (N * K >= 65536)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *qn = q + n * ldq;
        float *on = out + n * ldo;
        int64_t k = 0;
        for (; k + 4 <= K; k += 4) vst1q_f32(on + k, vmulq_n_f32(q8x4(qn + k), scale[n]));
        for (; k < K; k++) on[k] = (float)qn[k] * scale[n];
    }
}
#endif

#else /* INT8_BODY: the kernels for one ISA, named with the suffix SFX */

/* rows 0..mb-1 of x against int8 weight rows q0 and q1 (q1 == q0 when !two), converting in
 * registers; y[i] = dot * scale. */
static inline __attribute__((always_inline)) void CAT(dot_block_q, SFX)(
    const int mb, const int two, int64_t K, const float *x, int64_t ldx, const int8_t *q0,
    const int8_t *q1, float s0, float s1, float *y, int64_t ldy) {
    /* independent chains per accumulator: 4 for one row, 2 for up to three, else 1 */
    const int U = mb == 1 ? 4 : (mb <= 3 ? 2 : 1);
    VF a0[4][MBQ], a1[4][MBQ];
#pragma GCC unroll 4
    for (int u = 0; u < 4; u++) {
#pragma GCC unroll 12
        for (int i = 0; i < MBQ; i++) {
            a0[u][i] = VZERO();
            a1[u][i] = VZERO();
        }
    }
    int64_t k = 0;
    for (; k + 4 * W <= K; k += 4 * W) {
        PREFETCH_T0(q0 + k + PREFETCH);
        PREFETCH_T0(q1 + k + PREFETCH);
#ifdef PREFETCH_FAR
        PREFETCH_T1(q0 + k + PREFETCH_FAR);
        PREFETCH_T1(q1 + k + PREFETCH_FAR);
#endif
#pragma GCC unroll 4
        for (int s = 0; s < 4; s++) {
            const int u = s & (U - 1);
            const VF v0 = VLOADQ(q0 + k + W * s), v1 = VLOADQ(q1 + k + W * s);
#pragma GCC unroll 12
            for (int i = 0; i < MBQ; i++) {
                if (i < mb) {
                    const VF xv = VLOADU(x + i * ldx + k + W * s);
                    a0[u][i] = VFMA(xv, v0, a0[u][i]);
                    a1[u][i] = VFMA(xv, v1, a1[u][i]);
                }
            }
        }
    }
    for (; k + W <= K; k += W) {
        const VF v0 = VLOADQ(q0 + k), v1 = VLOADQ(q1 + k);
#pragma GCC unroll 12
        for (int i = 0; i < MBQ; i++) {
            if (i < mb) {
                const VF xv = VLOADU(x + i * ldx + k);
                a0[0][i] = VFMA(xv, v0, a0[0][i]);
                a1[0][i] = VFMA(xv, v1, a1[0][i]);
            }
        }
    }
#pragma GCC unroll 12
    for (int i = 0; i < MBQ; i++) {
        if (i < mb) {
#pragma GCC unroll 4
            for (int u = 1; u < 4; u++) {
                if (u < U) {
                    a0[0][i] = VADD(a0[0][i], a0[u][i]);
                    a1[0][i] = VADD(a1[0][i], a1[u][i]);
                }
            }
            float d0 = VHSUM(a0[0][i]), d1 = VHSUM(a1[0][i]);
            for (int64_t t = k; t < K; t++) {
                d0 += x[i * ldx + t] * (float)q0[t];
                d1 += x[i * ldx + t] * (float)q1[t];
            }
            y[i * ldy] = d0 * s0;
            if (two) y[i * ldy + 1] = d1 * s1;
        }
    }
}

#include "dot_f.h" /* dot_block_f: the fp32 chunks' dot */

/* All M rows of x against a panel of `rows` (<= PANEL) int8 weight rows q[r * ldq] with
 * scales scale[r]; y[i, r] for i < M, r < rows. */
static void CAT(panel_rows, SFX)(int64_t M, int64_t K, const float *x, int64_t ldx,
                                 const int8_t *q, int64_t ldq, const float *scale,
                                 int64_t rows, float *y, int64_t ldy) {
    if (M <= MBQ) { /* convert in registers, pair by pair */
        for (int64_t r = 0; r < rows; r += 2) {
            const int two = r + 1 < rows;
            const int8_t *q0 = q + r * ldq, *q1 = q0 + (two ? ldq : 0);
            const float s0 = scale[r], s1 = scale[r + two];
#define CALL_Q(mb) CAT(dot_block_q, SFX)(mb, two, K, x, ldx, q0, q1, s0, s1, y + r, ldy)
            DISPATCH_MB(M, MBQ, CALL_Q)
#undef CALL_Q
        }
        return;
    }
    /* chunks of KC columns: convert the panel's rows once into buf, then for each block of
     * MBF token rows sweep the panel's pairs, so the block's x chunk stays in cache across
     * them; a chunk's last kc % W columns are done in scalar code */
    float buf[PANEL][KC] __attribute__((aligned(64)));
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = K - k0 < KC ? K - k0 : KC;
        const int64_t kv = kc - kc % W; /* vector part */
        for (int64_t r = 0; r < rows; r++) {
            const int8_t *qr = q + r * ldq + k0;
            for (int64_t k = 0; k < kv; k += W) {
                if (k % 64 == 0) {
                    PREFETCH_T0(qr + k + PREFETCH);
#ifdef PREFETCH_FAR
                    PREFETCH_T1(qr + k + PREFETCH_FAR);
#endif
                }
                VSTORE(buf[r] + k, VLOADQ(qr + k));
            }
        }
        for (int64_t m0 = 0; m0 < M; m0 += MBF) {
            const int64_t mb = M - m0 < MBF ? M - m0 : MBF;
            const float *xm = x + m0 * ldx + k0;
            float *ym = y + m0 * ldy;
            for (int64_t r = 0; r < rows; r += 2) {
                const int two = r + 1 < rows;
                const float *w0 = buf[r], *w1 = buf[r + two];
#define CALL_F(n) CAT(dot_block_f, SFX)(n, two, k0 == 0, kv, xm, ldx, w0, w1, ym + r, ldy)
                DISPATCH_MB(mb, MBF, CALL_F)
#undef CALL_F
                for (int64_t i = 0; i < mb; i++) {
                    float d0 = 0.0f, d1 = 0.0f;
                    for (int64_t k = kv; k < kc; k++) {
                        d0 += xm[i * ldx + k] * (float)q[r * ldq + k0 + k];
                        if (two) d1 += xm[i * ldx + k] * (float)q[(r + 1) * ldq + k0 + k];
                    }
                    ym[i * ldy + r] += d0;
                    if (two) ym[i * ldy + r + 1] += d1;
                }
            }
        }
    }
    for (int64_t i = 0; i < M; i++)
        for (int64_t r = 0; r < rows; r++) y[i * ldy + r] *= scale[r];
}

static void CAT(gemm, SFX)(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx,
                           const int8_t *q, int64_t ldq, const float *scale, float *y,
                           int64_t ldy) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
    const int ns = omp_get_max_threads();
    struct job_slot s[ns]; /* the panels, stolen as common.h's jobs_next says */
    jobs_share(s, ns, panels);
#pragma omp parallel if (N * K >= 65536)
    for (int64_t p; (p = jobs_next(s, omp_get_thread_num(), ns)) >= 0;) {
        const int64_t n0 = p * PANEL, rows = N - n0 < PANEL ? N - n0 : PANEL;
        CAT(panel_rows, SFX)(M, K, x, ldx, q + n0 * ldq, ldq, scale + n0, rows, y + n0, ldy);
    }
}

static void CAT(moe, SFX)(int64_t n_groups, const int64_t *expert, const int64_t *start,
                          const int64_t *count, int64_t D, int64_t F, const float *x,
                          const int8_t *q13, const float *s13, const int8_t *q2,
                          const float *s2, const float *route_w, float *h, float *y) {
    const int64_t panels13 = (2 * F + PANEL - 1) / PANEL, panels2 = (D + PANEL - 1) / PANEL;
    const int ns = omp_get_max_threads();
    struct job_slot up[ns], down[ns];
    moe_jobs_share(up, ns, n_groups, count, panels13);
    moe_jobs_share(down, ns, n_groups, count, panels2);
#pragma omp parallel
    {
        /* contiguous shares of equal cost, and stealing, as in fp32.c */
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int64_t job; (job = jobs_next(up, t, ns)) >= 0;) {
            const int64_t g = job / panels13, n0 = (job % panels13) * PANEL, e = expert[g];
            const int64_t nr = 2 * F - n0 < PANEL ? 2 * F - n0 : PANEL;
            CAT(panel_rows, SFX)(count[g], D, x + start[g] * D, D, q13 + (e * 2 * F + n0) * D,
                                 D, s13 + e * 2 * F + n0, nr, h + start[g] * 2 * F + n0,
                                 2 * F);
        }
        moe_activation_phase(n_groups, start, count, F, h, t, nt);
        for (int64_t job; (job = jobs_next(down, t, ns)) >= 0;) {
            const int64_t g = job / panels2, n0 = (job % panels2) * PANEL, e = expert[g];
            const int64_t nr = D - n0 < PANEL ? D - n0 : PANEL;
            float *yg = y + start[g] * D + n0;
            CAT(panel_rows, SFX)(count[g], F, h + start[g] * 2 * F, 2 * F,
                                 q2 + (e * D + n0) * F, F, s2 + e * D + n0, nr, yg, D);
            weigh_rows(count[g], route_w + start[g], yg, D, nr);
        }
    }
}

/* MLA's absorbed per-head products on int8 codes (ops/cpu/int8_heads.py, quant/head_codes.py):
 * codes stored input-major, q[h, k, n] for input k and output n, so that
 *   y[h, m, n] = sum_k x[h, m, k] * (q[h, k, n] * S[h, k, n])
 *   S = s[h, k, n / g]   (grouped_out: W_UK, kv_b_proj's rows as stored, groups of outputs)
 *   S = s[h, k / g, n]   (else: W_UV, the rows transposed, groups of inputs)
 * Each job (head, block of HC_VECS vectors of outputs) runs down the K stored rows once per
 * HC_MB token rows: a row's codes times their scales, then a broadcast of each token value
 * and an FMA per vector (no horizontal sums; K is 64-512). With more token rows than one
 * block the job's scaled codes are converted once into fp32 first. grouped_out with groups
 * that split a vector (g not a multiple of W), and the outputs past the last whole vector,
 * run in scalar code. */
#define HC_VECS 4
#define HC_BUF 16384 /* floats of a job's converted codes at most (64 KB) */
#define HC1_AHEAD 4096 /* head_gemm1: bytes of rows ahead requested (a second, far one into
                        * L2 as the GEMMs' did not help here) */

/* head_gemm of one token row (a decode step at batch 1): a job is a head and a block of up
 * to HC1_VECS vectors of outputs (the benchmark model's W_UK: a whole row, so a job streams
 * a head's codes from end to end; head_gemm's jobs take 4 vectors, a quarter of each row),
 * the rows HC1_AHEAD bytes ahead requested, the jobs shared out by work stealing.
 * head_gemm's products and sums in the same order, so a row's outputs are the same bits at
 * any M. The benchmark model's two products a layer (16 heads, 270 KB of codes each;
 * called from Python, ~4.5 us of each the call's own): 19.9 and 19.0 -> 15.0 and 13.5 us;
 * the decode step (int8) 1.02x. */
static void CAT(head_gemm1, SFX)(int64_t Hh, int64_t N, int64_t K, const float *x,
                                 int64_t sxh, const int8_t *q, int64_t sqh, int64_t ldq,
                                 const float *s, int64_t g, int grouped_out, float *y,
                                 int64_t syh) {
    const int64_t J = grouped_out ? N / g : K / g; /* scale groups */
    const int64_t span = W * (N / W < HC1_VECS ? (N + W - 1) / W : HC1_VECS);
    const int64_t blocks = (N + span - 1) / span, ahead = (HC1_AHEAD + ldq - 1) / ldq;
    const int ns = omp_get_max_threads();
    struct job_slot jobs[ns];
    jobs_share(jobs, ns, Hh * blocks);
#pragma omp parallel if (Hh * N * K >= 65536)
    for (int64_t job; (job = jobs_next(jobs, omp_get_thread_num(), ns)) >= 0;) {
        const int64_t h = job / blocks, n0 = (job % blocks) * span;
        const int64_t n1 = N - n0 < span ? N : n0 + span;
        const int nv = grouped_out && g % W ? 0 : (int)((n1 - n0) / W); /* whole vectors */
        const int8_t *qh = q + h * sqh;
        const float *sh = s + h * J * (grouped_out ? K : N), *xh = x + h * sxh;
        int64_t jv[HC1_VECS]; /* grouped_out: each vector's group */
        for (int v = 0; v < HC1_VECS; v++) jv[v] = grouped_out ? (n0 + v * W) / g : 0;
        VF acc[HC1_VECS];
#pragma GCC unroll 16
        for (int v = 0; v < HC1_VECS; v++) acc[v] = VZERO();
        const float *sg = sh + n0; /* W_UV: the scales of row k's group (k / g) */
        for (int64_t k = 0, left = g; k < K; k++) {
            const int8_t *qr = qh + k * ldq + n0;
            for (int64_t b = 0; b < nv * W; b += 64) PREFETCH_T0(qr + ahead * ldq + b);
            const VF xb = VDUP(xh[k]);
#pragma GCC unroll 16
            for (int v = 0; v < HC1_VECS; v++) {
                if (v < nv) {
                    const VF sc = grouped_out ? VDUP(sh[k * J + jv[v]]) : VLOADU(sg + v * W);
                    acc[v] = VFMA(xb, VMUL(VLOADQ(qr + v * W), sc), acc[v]);
                }
            }
            if (--left == 0) { /* the next group of rows (no division in the loop) */
                sg += N;
                left = g;
            }
        }
        float *yr = y + h * syh;
        for (int v = 0; v < nv; v++) VSTOREU(yr + n0 + v * W, acc[v]);
        head_scalar(n0 + nv * W, n1, N, K, xh, qh, ldq, sh, J, g, grouped_out, yr);
    }
}

static void CAT(head_gemm, SFX)(int64_t Hh, int64_t M, int64_t N, int64_t K, const float *x,
                                int64_t sxh, int64_t sxm, const int8_t *q, int64_t sqh,
                                int64_t ldq, const float *s, int64_t g, int grouped_out,
                                float *y, int64_t syh, int64_t sym) {
    if (M == 1) {
        CAT(head_gemm1, SFX)(Hh, N, K, x, sxh, q, sqh, ldq, s, g, grouped_out, y, syh);
        return;
    }
    const int64_t span = HC_VECS * W, blocks = (N + span - 1) / span;
    const int64_t J = grouped_out ? N / g : K / g; /* scale groups */
#pragma omp parallel for schedule(static) if (Hh * N * K >= 65536)
    for (int64_t job = 0; job < Hh * blocks; job++) {
        const int64_t h = job / blocks, n0 = (job % blocks) * span;
        const int64_t n1 = N - n0 < span ? N : n0 + span;
        const int nv = grouped_out && g % W ? 0 : (int)((n1 - n0) / W); /* whole vectors */
        const int8_t *qh = q + h * sqh;
        const float *sh = s + h * J * (grouped_out ? K : N), *xh = x + h * sxh;
        /* a block of W_UK's outputs is a column block of rows C apart: the next job's part of
         * each row is requested while this job reads its own */
        const int64_t nxt = job + 1 < Hh * blocks ? job + 1 : job;
        const int8_t *qn = q + (nxt / blocks) * sqh + (nxt % blocks) * span;
        int64_t jv[HC_VECS]; /* grouped_out: each vector's group */
        for (int v = 0; v < HC_VECS; v++) jv[v] = grouped_out ? (n0 + v * W) / g : 0;
        const int conv = M > HC_MB && K * span <= HC_BUF;
        float wbuf[conv ? K * span : 1];
        for (int64_t m0 = 0; m0 < M; m0 += HC_MB) {
            const int mb = M - m0 < HC_MB ? (int)(M - m0) : HC_MB;
            VF acc[HC_MB][HC_VECS];
#pragma GCC unroll 6
            for (int i = 0; i < HC_MB; i++)
#pragma GCC unroll 4
                for (int v = 0; v < HC_VECS; v++) acc[i][v] = VZERO();
            const float *sg = sh + n0; /* W_UV: the scales of row k's group (k / g) */
            for (int64_t k = 0, left = g; k < K; k++) {
                VF wv[HC_VECS]; /* the row's codes times their scales */
                if (conv && m0) {
#pragma GCC unroll 4
                    for (int v = 0; v < HC_VECS; v++)
                        if (v < nv) wv[v] = VLOADU(wbuf + k * span + v * W);
                } else {
                    const int8_t *qr = qh + k * ldq + n0;
                    PREFETCH_T0(qn + k * ldq);
#pragma GCC unroll 4
                    for (int v = 0; v < HC_VECS; v++) {
                        if (v < nv) {
                            const VF sc = grouped_out ? VDUP(sh[k * J + jv[v]])
                                                      : VLOADU(sg + v * W);
                            wv[v] = VMUL(VLOADQ(qr + v * W), sc);
                            if (conv) VSTOREU(wbuf + k * span + v * W, wv[v]);
                        }
                    }
                }
#pragma GCC unroll 6
                for (int i = 0; i < HC_MB; i++) {
                    if (i < mb) {
                        const VF xb = VDUP(xh[(m0 + i) * sxm + k]);
#pragma GCC unroll 4
                        for (int v = 0; v < HC_VECS; v++)
                            if (v < nv) acc[i][v] = VFMA(xb, wv[v], acc[i][v]);
                    }
                }
                if (--left == 0) { /* the next group of rows (no division in the loop) */
                    sg += N;
                    left = g;
                }
            }
            for (int i = 0; i < mb; i++) {
                float *yr = y + h * syh + (m0 + i) * sym;
                for (int v = 0; v < nv; v++) VSTOREU(yr + n0 + v * W, acc[i][v]);
                head_scalar(n0 + nv * W, n1, N, K, xh + (m0 + i) * sxm, qh, ldq, sh, J, g,
                            grouped_out, yr);
            }
        }
    }
}
#undef HC_VECS
#undef HC_BUF
#undef HC1_AHEAD

#endif /* INT8_BODY */
