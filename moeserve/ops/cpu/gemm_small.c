/* Few-row fp32 GEMM for decode on AVX2+FMA CPUs: y[M, N] = x[M, K] @ w[N, K]^T.
 *
 * Decode multiplies a handful of token rows by large weights, so the weight must be streamed
 * from memory exactly once at full bandwidth. Each thread takes pairs of weight rows (each
 * row is K contiguous floats: a sequential stream) and dots them with up to MB token rows
 * that stay in L1, keeping 2 * MB accumulators in registers. BLAS libraries tile for large M
 * and read the weight at a fraction of the bandwidth when M is 2..16.
 *
 * Compiled at first use (moeserve/ops/cpu/small_gemm.py) with -fopenmp; loaded after torch,
 * it shares torch's OpenMP runtime and thread count.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define MB 6          /* token rows per block: 2 * MB accumulators + 3 registers */
#define PREFETCH 1024 /* floats ahead (4 KB), measured best of 64..2048 on AVX2 EPYC */

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 h = _mm_movehdup_ps(s);
    s = _mm_add_ps(s, h);
    h = _mm_movehl_ps(h, s);
    return _mm_cvtss_f32(_mm_add_ss(s, h));
}

/* rows m0..m0+mb-1 of x against weight rows n0 (and n0+1 when two) */
static inline __attribute__((always_inline)) void dot_block(
    const int mb, const int two, int64_t K, const float *x, int64_t ldx, const float *w0,
    const float *w1, float *y, int64_t ldy) {
    __m256 a0[MB], a1[MB];
#pragma GCC unroll 6
    for (int i = 0; i < MB; i++) {
        a0[i] = _mm256_setzero_ps();
        a1[i] = _mm256_setzero_ps();
    }
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        /* the pair's rows are adjacent: prefetching 4 KB ahead of each keeps the stream
         * (and the next pair's rows) in flight; past the end of w it is a harmless no-op */
        _mm_prefetch((const char *)(w0 + k + PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(w1 + k + PREFETCH), _MM_HINT_T0);
        __m256 v0 = _mm256_loadu_ps(w0 + k);
        __m256 v1 = _mm256_loadu_ps(w1 + k); /* w1 == w0 for the last odd row */
#pragma GCC unroll 6
        for (int i = 0; i < MB; i++) {
            if (i < mb) {
                __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
                a0[i] = _mm256_fmadd_ps(xv, v0, a0[i]);
                a1[i] = _mm256_fmadd_ps(xv, v1, a1[i]);
            }
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < MB; i++) {
        if (i < mb) {
            float s0 = hsum256(a0[i]), s1 = hsum256(a1[i]);
            for (int64_t t = k; t < K; t++) {
                s0 += x[i * ldx + t] * w0[t];
                s1 += x[i * ldx + t] * w1[t];
            }
            y[i * ldy] = s0;
            if (two) y[i * ldy + 1] = s1;
        }
    }
}

void moeserve_gemm_nt_small(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx,
                            const float *w, int64_t ldw, float *y, int64_t ldy) {
    const int64_t pairs = (N + 1) / 2;
#pragma omp parallel for schedule(static) if (N * K >= 32768)
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t n0 = 2 * p;
        const int two = n0 + 1 < N;
        const float *w0 = w + n0 * ldw;
        const float *w1 = w0 + (two ? ldw : 0);
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
            const int64_t left = M - m0;
            const float *xm = x + m0 * ldx;
            float *ym = y + m0 * ldy + n0;
            switch (left >= MB ? MB : (int)left) {
                case 1: dot_block(1, two, K, xm, ldx, w0, w1, ym, ldy); break;
                case 2: dot_block(2, two, K, xm, ldx, w0, w1, ym, ldy); break;
                case 3: dot_block(3, two, K, xm, ldx, w0, w1, ym, ldy); break;
                case 4: dot_block(4, two, K, xm, ldx, w0, w1, ym, ldy); break;
                case 5: dot_block(5, two, K, xm, ldx, w0, w1, ym, ldy); break;
                default: dot_block(6, two, K, xm, ldx, w0, w1, ym, ldy); break;
            }
        }
    }
}

/* Routed experts for few rows, one call per MoE layer: for each group g (rows
 * [start[g], start[g] + count[g]) of x, all routed to expert[g]):
 *   h = x_g @ w13[e]^T            (gate rows then up rows: [count, 2F])
 *   a = silu(h[:, :F]) * h[:, F:]  (written over h[:, :F])
 *   y_g = route_w_g * (a @ w2[e]^T)
 * w13 is [E, 2F, D] and w2 [E, D, F], both contiguous; h is scratch of [rows, 2F]. */
void moeserve_moe_small(int64_t n_groups, const int64_t *expert, const int64_t *start,
                        const int64_t *count, int64_t D, int64_t F, const float *x,
                        const float *w13, const float *w2, const float *route_w, float *h,
                        float *y) {
    for (int64_t g = 0; g < n_groups; g++) {
        const int64_t e = expert[g], s = start[g], n = count[g];
        float *hg = h + s * 2 * F;
        moeserve_gemm_nt_small(n, 2 * F, D, x + s * D, D, w13 + e * 2 * F * D, D, hg, 2 * F);
        for (int64_t r = 0; r < n; r++) {
            float *row = hg + r * 2 * F;
            for (int64_t f = 0; f < F; f++) {
                const float gate = row[f];
                row[f] = gate / (1.0f + expf(-gate)) * row[F + f];
            }
        }
        float *yg = y + s * D;
        moeserve_gemm_nt_small(n, D, F, hg, 2 * F, w2 + e * D * F, F, yg, D);
        for (int64_t r = 0; r < n; r++) {
            const float w = route_w[s + r];
            for (int64_t d = 0; d < D; d++) yg[r * D + d] *= w;
        }
    }
}
