/* Causal attention of a prefill chunk on AVX-512F, one call for all heads:
 *
 *   out[t, h] = softmax(scale * q[t, h] . k[0:n_t, g]) @ v[0:n_t, g]     g = h / group
 *
 * for the T queries at context positions L - T .. L - 1 (n_t = L - T + t + 1 keys visible).
 * A key is two parts, k1[l, g, 0:D1] and k2[l, g, 0:D2], so MLA's per-head k_nope and its
 * k_pe shared by all heads (head stride 0) need no concatenated copy; q[t, h] holds the D1 +
 * D2 matching values back to back.
 *
 * The work is panels.h's tile twice. A thread packs the keys of its kv head once into panels
 * of 64 keys ([D1 + D2, 64] each: scores for 6 queries against 64 keys are one tile) and its
 * values into [L, 64] panels (already the tile's layout: probabilities times values are one
 * tile per 64 value columns), as far as its queries reach. Then per block of 6 queries: the
 * tiles over the visible key panels write the scores, a vector softmax per query turns them
 * into probabilities (the keys past a query's position get 0), and the value tiles write the
 * output rows scaled by 1 / sum. The threads share out (head, 48-query chunk) jobs in
 * contiguous ranges of equal cost (visible keys), so a thread packs each head it touches once.
 *
 * Pure-torch reference: ops/prefill_attention.py (causal_attention_ref, SDPA with the causal
 * mask). The Python side (ops/cpu/prefill_attention.py) calls it only where the CPU has
 * AVX-512F; elsewhere the blocked bmm form of ops/prefill_attention.py runs.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "common.h"

#pragma GCC push_options
#pragma GCC target("avx512f")
#include "panels.h"

#define QCHUNK 48 /* queries per job */

/* e^x for x <= 0, 16 at a time: common.h's exp256_neg on each half */
static inline __m512 exp512_neg(__m512 x) {
    const __m256 lo = exp256_neg(_mm512_castps512_ps256(x));
    const __m256 hi = exp256_neg(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    return _mm512_castpd_ps(
        _mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}

/* row[0:n] <- e^(scale * (row - max)) and row[n:width] <- 0; returns the sum of the first n */
static float softmax_row(float *row, int64_t n, int64_t width, float scale) {
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    int64_t l = 0;
    for (; l + 16 <= n; l += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(row + l));
    float mx = _mm512_reduce_max_ps(vmax);
    for (; l < n; l++) mx = row[l] > mx ? row[l] : mx;
    const __m512 vs = _mm512_set1_ps(scale), vm = _mm512_set1_ps(mx);
    __m512 vsum = _mm512_setzero_ps();
    for (l = 0; l + 16 <= n; l += 16) {
        const __m512 e = exp512_neg(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(row + l), vm), vs));
        _mm512_storeu_ps(row + l, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    if (l < n) {
        const __mmask16 m = (__mmask16)((1u << (n - l)) - 1u);
        const __m512 x = _mm512_maskz_loadu_ps(m, row + l);
        const __m512 z = _mm512_mul_ps(_mm512_sub_ps(x, vm), vs);
        const __m512 e = _mm512_maskz_mov_ps(m, exp512_neg(z));
        _mm512_storeu_ps(row + l, e); /* zeros past n: row has room to a multiple of 16 */
        vsum = _mm512_add_ps(vsum, e);
        l += 16;
    }
    for (; l < width; l++) row[l] = 0.0f;
    return _mm512_reduce_add_ps(vsum);
}

/* the mask of the first n (clamped to 0..16) lanes */
static inline __mmask16 lanes(int64_t n) {
    return (__mmask16)(n >= 16 ? 0xFFFFu : (n <= 0 ? 0u : (1u << n) - 1u));
}

/* The packed keys and values of one kv head, as far as they reach. */
struct head_cache {
    int64_t g;             /* kv head, -1: none yet */
    int64_t key_panels;    /* panels of 64 keys packed */
    int64_t value_rows;    /* value rows packed (in steps of 64) */
    float *keys;           /* [ceil(L / 64)][D1 + D2][64] */
    float *values;         /* [ceil(Dv / 64)][L64][64] */
};

typedef struct {
    int64_t H, T, L, group;
    const float *q;
    int64_t sq_t, sq_h;
    const float *k1;
    int64_t sk1_l, sk1_g, D1;
    const float *k2;
    int64_t sk2_l, sk2_g, D2;
    const float *v;
    int64_t sv_l, sv_g, Dv;
    float scale;
    float *out;
    int64_t so_t, so_h;
} Params;

/* extend c to kv head g's first n keys and values (whole panels of 64) */
static void cache_reach(const Params *P, struct head_cache *c, int64_t g, int64_t n) {
    const int64_t Dk = P->D1 + P->D2, L64 = (P->L + PK_NR - 1) / PK_NR * PK_NR;
    if (c->g != g) {
        c->g = g;
        c->key_panels = c->value_rows = 0;
    }
    const int64_t panels = (n + PK_NR - 1) / PK_NR;
    for (int64_t p = c->key_panels; p < panels; p++) {
        const int64_t l0 = p * PK_NR;
        const int nc = P->L - l0 < PK_NR ? (int)(P->L - l0) : PK_NR;
        float *buf = c->keys + p * Dk * PK_NR;
        pack_panel(P->D1, P->k1 + l0 * P->sk1_l + g * P->sk1_g, P->sk1_l, nc, buf);
        if (P->D2)
            pack_panel(P->D2, P->k2 + l0 * P->sk2_l + g * P->sk2_g, P->sk2_l, nc,
                       buf + P->D1 * PK_NR);
    }
    c->key_panels = panels > c->key_panels ? panels : c->key_panels;
    const int64_t rows = panels * PK_NR < P->L ? panels * PK_NR : P->L;
    const int64_t vpanels = (P->Dv + PK_NR - 1) / PK_NR;
    for (int64_t j = 0; j < vpanels; j++) {
        const int64_t d0 = j * PK_NR, nd = P->Dv - d0 < PK_NR ? P->Dv - d0 : PK_NR;
        __mmask16 live[PK_NV];
        for (int u = 0; u < PK_NV; u++) live[u] = lanes(nd - 16 * u);
        float *dst = c->values + j * L64 * PK_NR;
        for (int64_t l = c->value_rows; l < rows; l++) {
            const float *src = P->v + l * P->sv_l + g * P->sv_g + d0;
            for (int u = 0; u < PK_NV; u++)
                _mm512_store_ps(dst + l * PK_NR + 16 * u,
                                _mm512_maskz_loadu_ps(live[u], src + 16 * u));
        }
    }
    c->value_rows = rows > c->value_rows ? rows : c->value_rows;
}

/* queries [t0, t0 + mr) of head h (mr <= PK_MR); c holds their kv head's keys and values */
static void query_block(const Params *P, const struct head_cache *c, int64_t h, int64_t t0,
                        int mr, float *S, int64_t ldS, struct prefetcher *none) {
    const int64_t Dk = P->D1 + P->D2, L64 = (P->L + PK_NR - 1) / PK_NR * PK_NR;
    const int64_t offset = P->L - P->T, n_vis = offset + t0 + mr;
    const float *q = P->q + t0 * P->sq_t + h * P->sq_h;
    for (int64_t p = 0; p * PK_NR < n_vis; p++) {
        const int nc = n_vis - p * PK_NR < PK_NR ? (int)(n_vis - p * PK_NR) : PK_NR;
        const float *keys = c->keys + p * Dk * PK_NR;
#define SCORES(m) panel_tile(m, Dk, q, P->sq_t, keys, S + p * PK_NR, ldS, nc, 0, none)
        DISPATCH_MB(mr, PK_MR, SCORES)
#undef SCORES
    }
    float inv[PK_MR];
    for (int i = 0; i < mr; i++)
        inv[i] = 1.0f / softmax_row(S + i * ldS, offset + t0 + i + 1, n_vis, P->scale);
    float *o = P->out + t0 * P->so_t + h * P->so_h;
    for (int64_t d0 = 0, j = 0; d0 < P->Dv; d0 += PK_NR, j++) {
        const int nd = P->Dv - d0 < PK_NR ? (int)(P->Dv - d0) : PK_NR;
        const float *values = c->values + j * L64 * PK_NR;
#define VALUES(m) panel_tile(m, n_vis, S, ldS, values, o + d0, P->so_t, nd, inv, none)
        DISPATCH_MB(mr, PK_MR, VALUES)
#undef VALUES
    }
}

/* the cost of job j (head j / chunks, chunk j % chunks): its queries' visible keys, plus a
 * fixed part for the per-block work */
static inline int64_t job_cost(const Params *P, int64_t chunks, int64_t j) {
    const int64_t t0 = (j % chunks) * QCHUNK, nq = P->T - t0 < QCHUNK ? P->T - t0 : QCHUNK;
    return nq * (P->L - P->T + t0 + (nq + 1) / 2) + 64 * nq;
}

/* Returns 0, or -1 when a thread's buffers could not be allocated (out is then incomplete). */
int moeserve_prefill_attention(int64_t H, int64_t T, int64_t L, int64_t group, const float *q,
                                int64_t sq_t, int64_t sq_h, const float *k1, int64_t sk1_l,
                                int64_t sk1_g, int64_t D1, const float *k2, int64_t sk2_l,
                                int64_t sk2_g, int64_t D2, const float *v, int64_t sv_l,
                                int64_t sv_g, int64_t Dv, float scale, float *out, int64_t so_t,
                                int64_t so_h) {
    const Params P = {.H = H, .T = T, .L = L, .group = group,
                      .q = q, .sq_t = sq_t, .sq_h = sq_h,
                      .k1 = k1, .sk1_l = sk1_l, .sk1_g = sk1_g, .D1 = D1,
                      .k2 = k2, .sk2_l = sk2_l, .sk2_g = sk2_g, .D2 = D2,
                      .v = v, .sv_l = sv_l, .sv_g = sv_g, .Dv = Dv,
                      .scale = scale, .out = out, .so_t = so_t, .so_h = so_h};
    const int64_t chunks = (T + QCHUNK - 1) / QCHUNK, jobs = H * chunks;
    const int64_t Dk = D1 + D2, L64 = (L + PK_NR - 1) / PK_NR * PK_NR;
    const int64_t ldS = (L + 15) / 16 * 16;
    int64_t total = 0;
    for (int64_t j = 0; j < chunks; j++) total += job_cost(&P, chunks, j);
    total *= H;
    int failed = 0;
#pragma omp parallel
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        /* this thread's jobs: those whose cost starts in [total * t / nt, total * (t+1) / nt) */
        const int64_t lo = total * t / nt, hi = total * (t + 1) / nt;
        int64_t j0 = jobs, j1 = jobs, before = 0;
        for (int64_t j = 0; j < jobs; j++) {
            if (before >= lo && j0 == jobs) j0 = j;
            if (before >= hi) {
                j1 = j;
                break;
            }
            before += job_cost(&P, chunks, j);
        }
        struct head_cache c = {-1, 0, 0, 0, 0};
        c.keys = aligned_alloc(64, (size_t)L64 * Dk * sizeof(float));
        const size_t vpanels = (size_t)((Dv + PK_NR - 1) / PK_NR);
        c.values = aligned_alloc(64, vpanels * L64 * PK_NR * sizeof(float));
        float *S = aligned_alloc(64, (size_t)PK_MR * ldS * sizeof(float));
        struct prefetcher none;
        prefetcher_init(&none, 0, 0, 0, 0, 0);
        if (!(c.keys && c.values && S)) {
#pragma omp atomic write
            failed = 1;
        } else {
            for (int64_t j = j0; j < j1; j++) {
                const int64_t h = j / chunks, t0 = (j % chunks) * QCHUNK;
                const int64_t t1 = t0 + QCHUNK < T ? t0 + QCHUNK : T;
                cache_reach(&P, &c, h / group, L - T + t1);
                for (int64_t b = t0; b < t1; b += PK_MR)
                    query_block(&P, &c, h, b, t1 - b < PK_MR ? (int)(t1 - b) : PK_MR, S, ldS,
                                &none);
            }
        }
        free(c.keys);
        free(c.values);
        free(S);
    }
    return failed ? -1 : 0;
}
#pragma GCC pop_options
