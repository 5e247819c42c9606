/* fp32 kernels for decode (a few token rows) on AVX2+FMA CPUs. The core is the few-row GEMM
 * y[M, N] = x[M, K] @ w[N, K]^T; the MoE layer, RMSNorm and routing build on it.
 *
 * Decode multiplies a handful of token rows by large weights, so the weight must be streamed
 * from memory exactly once at full bandwidth. Each thread takes pairs of weight rows (each
 * row is K contiguous floats: a sequential stream) and dots them with up to MB token rows
 * that stay in L1, keeping 2 * MB accumulators in registers. BLAS libraries tile for large M
 * and read the weight at a fraction of the bandwidth when M is 2..16.
 *
 * Compiled at first use (moeserve/ops/cpu/kernels.py) with -fopenmp; loaded after torch,
 * it shares torch's OpenMP runtime and thread count.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define MB 6          /* token rows per block: 2 * MB accumulators + 3 registers */
#ifndef MIN_PREFETCH
#define MIN_PREFETCH 2048 /* floats (8 KB); see prefetch_ahead */
#endif

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 h = _mm_movehdup_ps(s);
    s = _mm_add_ps(s, h);
    h = _mm_movehl_ps(h, s);
    return _mm_cvtss_f32(_mm_add_ss(s, h));
}

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

/* rows m0..m0+mb-1 of x against weight rows n0 (and n0+1 when two) */
static inline __attribute__((always_inline)) void dot_block(
    const int mb, const int two, int64_t K, const float *x, int64_t ldx, const float *w0,
    const float *w1, float *y, int64_t ldy, int64_t pf) {
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
        _mm_prefetch((const char *)(w0 + k + pf), _MM_HINT_T0);
        _mm_prefetch((const char *)(w1 + k + pf), _MM_HINT_T0);
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

/* One token row against weight rows n0 and n0 + 1: with one row, dot_block keeps only two
 * FMA chains in flight, and the FMA latency (4 cycles, 2 ports) caps the stream at ~60% of the
 * read bandwidth; four partial sums per weight row keep eight chains in flight (measured
 * 55-64 -> 81-90 GB/s on a 2-core EPYC whose streaming read peaks at ~86 GB/s). */
static inline void dot_row1(int64_t K, const float *x, const float *w0, const float *w1,
                            int two, float *y, int64_t pf) {
    __m256 a0[4], a1[4];
    for (int j = 0; j < 4; j++) a0[j] = a1[j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        _mm_prefetch((const char *)(w0 + k + pf), _MM_HINT_T0);
        _mm_prefetch((const char *)(w0 + k + 16 + pf), _MM_HINT_T0);
        _mm_prefetch((const char *)(w1 + k + pf), _MM_HINT_T0);
        _mm_prefetch((const char *)(w1 + k + 16 + pf), _MM_HINT_T0);
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            const __m256 xv = _mm256_loadu_ps(x + k + 8 * j);
            a0[j] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w0 + k + 8 * j), a0[j]);
            a1[j] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w1 + k + 8 * j), a1[j]);
        }
    }
    for (; k + 8 <= K; k += 8) {
        const __m256 xv = _mm256_loadu_ps(x + k);
        a0[0] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w0 + k), a0[0]);
        a1[0] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w1 + k), a1[0]);
    }
    float s0 = hsum256(_mm256_add_ps(_mm256_add_ps(a0[0], a0[1]), _mm256_add_ps(a0[2], a0[3])));
    float s1 = hsum256(_mm256_add_ps(_mm256_add_ps(a1[0], a1[1]), _mm256_add_ps(a1[2], a1[3])));
    for (; k < K; k++) {
        s0 += x[k] * w0[k];
        s1 += x[k] * w1[k];
    }
    y[0] = s0;
    if (two) y[1] = s1;
}

/* All M rows of x (in blocks of MB) against weight rows n0 and n0 + 1 (n0 alone when !two). */
static void pair_rows(int64_t M, int64_t K, const float *x, int64_t ldx, const float *w0,
                      const float *w1, int two, float *y, int64_t ldy, int64_t pf) {
    if (M == 1) {
        dot_row1(K, x, w0, w1, two, y, pf);
        return;
    }
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t left = M - m0;
        const float *xm = x + m0 * ldx;
        float *ym = y + m0 * ldy;
        switch (left >= MB ? MB : (int)left) {
            case 1: dot_block(1, two, K, xm, ldx, w0, w1, ym, ldy, pf); break;
            case 2: dot_block(2, two, K, xm, ldx, w0, w1, ym, ldy, pf); break;
            case 3: dot_block(3, two, K, xm, ldx, w0, w1, ym, ldy, pf); break;
            case 4: dot_block(4, two, K, xm, ldx, w0, w1, ym, ldy, pf); break;
            case 5: dot_block(5, two, K, xm, ldx, w0, w1, ym, ldy, pf); break;
            default: dot_block(6, two, K, xm, ldx, w0, w1, ym, ldy, pf); break;
        }
    }
}

void moeserve_gemm_nt_small(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx,
                            const float *w, int64_t ldw, float *y, int64_t ldy) {
    const int64_t pairs = (N + 1) / 2, pf = prefetch_ahead(ldw);
#pragma omp parallel for schedule(static) if (N * K >= 32768)
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t n0 = 2 * p;
        const int two = n0 + 1 < N;
        const float *w0 = w + n0 * ldw;
        pair_rows(M, K, x, ldx, w0, w0 + (two ? ldw : 0), two, y + n0, ldy, pf);
    }
}

/* Routed experts for few rows, one call per MoE layer: for each group g (rows
 * [start[g], start[g] + count[g]) of x, all routed to expert[g]):
 *   h = x_g @ w13[e]^T            (gate rows then up rows: [count, 2F])
 *   a = silu(h[:, :F]) * h[:, F:]  (written over h[:, :F])
 *   y_g = route_w_g * (a @ w2[e]^T)
 * w13 is [E, 2F, D] and w2 [E, D, F], both contiguous; h is scratch of [rows, 2F]. One
 * parallel region: the threads share out the weight row pairs of all experts at once (three
 * barriers per layer instead of two parallel regions per expert). */
void moeserve_moe_small(int64_t n_groups, const int64_t *expert, const int64_t *start,
                        const int64_t *count, int64_t D, int64_t F, const float *x,
                        const float *w13, const float *w2, const float *route_w, float *h,
                        float *y) {
    const int64_t pairs13 = F, pairs2 = (D + 1) / 2; /* the 2F rows of w13 make F pairs */
    const int64_t pf13 = prefetch_ahead(D), pf2 = prefetch_ahead(F);
    int64_t rows = 0;
    for (int64_t g = 0; g < n_groups; g++) rows += count[g];
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t job = 0; job < n_groups * pairs13; job++) {
            const int64_t g = job / pairs13, n0 = 2 * (job % pairs13);
            const float *w0 = w13 + expert[g] * 2 * F * D + n0 * D;
            pair_rows(count[g], D, x + start[g] * D, D, w0, w0 + D, 1,
                      h + start[g] * 2 * F + n0, 2 * F, pf13);
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            float *row = h + r * 2 * F;
            for (int64_t f = 0; f < F; f++) {
                const float gate = row[f];
                row[f] = gate / (1.0f + expf(-gate)) * row[F + f];
            }
        }
#pragma omp for schedule(static)
        for (int64_t job = 0; job < n_groups * pairs2; job++) {
            const int64_t g = job / pairs2, n0 = 2 * (job % pairs2);
            const int two = n0 + 1 < D;
            const float *w0 = w2 + expert[g] * D * F + n0 * F;
            float *yg = y + start[g] * D + n0;
            pair_rows(count[g], F, h + start[g] * 2 * F, 2 * F, w0, w0 + (two ? F : 0), two,
                      yg, D, pf2);
            for (int64_t r = 0; r < count[g]; r++) {
                const float w = route_w[start[g] + r];
                yg[r * D] *= w;
                if (two) yg[r * D + 1] *= w;
            }
        }
    }
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

/* DeepSeek-V3 routing for few rows (the reference is layers/moe.py: route_grouped_sigmoid):
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

/* Per-head few-row GEMMs, one call for all heads: y[h] = x[h] @ w[h]^T for h < Hh, with
 * x[h] rows at x + h*sxh + m*sxm, w[h] an [N, K] block at w + h*swh (row stride ldw), y[h]
 * rows at y + h*syh + m*sym. MLA's absorbed decode uses it for q_nope @ W_UK and
 * o_lat @ W_UV (16 small weights per layer); the threads share the (head, row pair) jobs. */
void moeserve_head_gemm_nt_small(int64_t Hh, int64_t M, int64_t N, int64_t K, const float *x,
                                 int64_t sxh, int64_t sxm, const float *w, int64_t swh,
                                 int64_t ldw, float *y, int64_t syh, int64_t sym) {
    const int64_t pairs = (N + 1) / 2, pf = prefetch_ahead(ldw);
#pragma omp parallel for schedule(static) if (Hh * N * K >= 32768)
    for (int64_t job = 0; job < Hh * pairs; job++) {
        const int64_t h = job / pairs, n0 = 2 * (job % pairs);
        const int two = n0 + 1 < N;
        const float *w0 = w + h * swh + n0 * ldw;
        pair_rows(M, K, x + h * sxh, sxm, w0, w0 + (two ? ldw : 0), two, y + h * syh + n0, sym,
                  pf);
    }
}
