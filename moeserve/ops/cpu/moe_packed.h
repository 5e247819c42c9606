/* Many-row GEMMs on AVX-512 through packed panels: prefill's MoE layer and int8/int4
 * projections.
 *
 * Included inside an AVX-512F section once per weight format, after that format's kernels:
 * by fp32.c for fp32 weights, int8.c for int8 ones and int4.c for int4 ones (not a
 * translation unit of its own). The panels and the tile are panels.h's. The includer defines
 *   PK_T                  the weight element (float, int8_t; int4: uint8_t, two codes a byte)
 *   PK_SFX                the suffix of this format's functions (moe_panels##PK_SFX)
 *   PK_PACK(K, r, buf)    the panel of the weight rows r (a const struct panel_rows *:
 *                         r->nr rows of K weights), dequantized (times their scales, less
 *                         their zero points) as fp32 into buf [K, PK_NR]
 *   PK_ROWS(M, K, x, ldx, r, y, ldy)
 *                         y[:M, :r->nr] = x @ w^T for the rows r: the format's few-row kernel,
 *                         for experts of fewer than PK_MIN_ROWS rows
 *   PK_ROW_BYTES(K)       (optional) the bytes of a row of K weights (K * sizeof(PK_T))
 *   PK_MIN_ROWS           (optional) rows of x from which a job packs (PACK_MIN_ROWS)
 *   PK_GEMM               (optional) also define gemm_panels##PK_SFX, the plain GEMM
 * and this file undefines them at its end.
 *
 * The decode kernels dot weight rows with token rows along K (4 weight rows x 6 token rows,
 * 24 accumulators, then a horizontal reduction): the weight streams from memory once, which is
 * what few rows need. With tens of rows per expert (prefill: T x top_k / E) the work is the
 * FMAs, and there that form reaches ~60-85 GFLOP/s per core of the ~155 peak. Here a job is a
 * panel of 64 weight rows, packed once and then tiled over all of the expert's token rows
 * (panels.h). Measured on one prefill MoE layer of the benchmark model (routed experts, 2
 * threads, docs/benchmarks.md "Prefill MoE"): 48 rows per expert 84 -> 71 ms, 24 rows
 * 47 -> 44 ms; 12 rows 8% slower, hence PACK_MIN_ROWS.
 */
#include "panels.h"

#ifndef MOESERVE_PANEL_ROWS
#define MOESERVE_PANEL_ROWS
#ifndef PACK_MIN_ROWS
#define PACK_MIN_ROWS 24 /* rows of x from which a job packs its panel (fewer: PK_ROWS) */
#endif

/* nr weight rows at w, ld elements apart, of row_bytes bytes each (K weights), with their
 * scales s: one per row (int8; fp32: none) when G is 0, else (int4) K / G per row, rows K / G
 * apart, one per group of G columns, with as many zero points z */
struct panel_rows {
    const void *w;
    const float *s;
    const uint8_t *z;
    int64_t ld, row_bytes, G;
    int nr;
};
#endif

#ifndef PK_ROW_BYTES
#define PK_ROW_BYTES(K) ((K) * (int64_t)sizeof(PK_T))
#endif
#ifndef PK_MIN_ROWS
#define PK_MIN_ROWS PACK_MIN_ROWS
#endif

/* ---- this format's jobs and MoE call ---- */
#define PK_CAT_(a, b) a##b
#define PK_CAT(a, b) PK_CAT_(a, b)

/* job `job` of a projection with N output rows of K elements per expert (jobs of PK_NR rows
 * per expert): its group g, first output row n0, and weight rows (w: [E, N, K] weights with
 * rows ld apart, experts N * ld apart; s: [E, N] scales or 0, or with groups of G columns
 * (G > 0) [E, N, K / G] scales and zero points z) */
static inline struct panel_rows PK_CAT(panel_of, PK_SFX)(int64_t job, int64_t jobs,
                                                        const int64_t *expert, const PK_T *w,
                                                        const float *s, const uint8_t *z,
                                                        int64_t G, int64_t N, int64_t K,
                                                        int64_t ld, int64_t *g, int64_t *n0) {
    *g = job / jobs;
    *n0 = PK_NR * (job % jobs);
    const int64_t row = expert[*g] * N + *n0, ns = G ? K / G : 1;
    const struct panel_rows r = {w + row * ld,      s ? s + row * ns : 0, z ? z + row * ns : 0,
                                 ld,                PK_ROW_BYTES(K),      G,
                                 N - *n0 < PK_NR ? (int)(N - *n0) : PK_NR};
    return r;
}

/* One job: the weight rows r (K elements each) against the M token rows at x into
 * y[:, 0:r.nr], each output row scaled by scale[i] when scale is given. Packed when M is
 * large enough and there is a buffer, otherwise PK_ROWS. next: the weight rows of the
 * thread's next job (next->w 0: none), prefetched during the tiles. */
static void PK_CAT(panel_job, PK_SFX)(int64_t M, int64_t K, const float *x, int64_t ldx,
                                      const struct panel_rows *r, float *y, int64_t ldy,
                                      const float *scale, float *buf,
                                      const struct panel_rows *next) {
    const int nc = r->nr;
    if (M >= PK_MIN_ROWS && buf) {
        PK_PACK(K, r, buf);
        /* int4: the next rows' group scales and zero points too (K / G a row; group 32, MoE
         * layer at 512 tokens: 22.8 -> 21.4 ms) */
        if (next->G) {
            const int64_t n = next->nr * (K / next->G);
            for (int64_t b = 0; b < 4 * n; b += 64)
                _mm_prefetch((const char *)next->s + b, _MM_HINT_T1);
            for (int64_t b = 0; b < n; b += 64)
                _mm_prefetch((const char *)next->z + b, _MM_HINT_T1);
        }
        struct prefetcher pf;
        prefetcher_init(&pf, next->w, next->ld * (int64_t)sizeof(PK_T), next->row_bytes, next->nr,
                        (M + PK_MR - 1) / PK_MR * ((K + 15) / 16));
        for (int64_t m0 = 0; m0 < M; m0 += PK_MR) {
            const int64_t left = M - m0;
            const float *sc = scale ? scale + m0 : 0;
#define TILE(mr) panel_tile(mr, K, x + m0 * ldx, ldx, buf, y + m0 * ldy, ldy, nc, sc, &pf)
            DISPATCH_MB(left, PK_MR, TILE)
#undef TILE
        }
        return;
    }
    PK_ROWS(M, K, x, ldx, r, y, ldy);
    if (scale)
        for (int64_t i = 0; i < M; i++)
            for (int c = 0; c < nc; c++) y[i * ldy + c] *= scale[i];
}

/* The routed experts of a call in which some expert has PK_MIN_ROWS rows or more: the
 * one-call MoE contract of this format (moeserve_moe_small, moeserve_int8_moe_small,
 * moeserve_int4_moe_small; s13 and s2 are 0 for fp32, z13, z2 and G are 0 but for int4),
 * jobs of PK_NR weight rows shared out as in the decode kernels (contiguous shares of equal
 * cost), each thread with its own panel buffer. */
static void PK_CAT(moe_panels, PK_SFX)(int64_t n_groups, const int64_t *expert,
                                       const int64_t *start, const int64_t *count, int64_t D,
                                       int64_t F, const float *x, const PK_T *w13,
                                       const float *s13, const uint8_t *z13, const PK_T *w2,
                                       const float *s2, const uint8_t *z2, int64_t G,
                                       const float *route_w, float *h, float *y) {
    const int64_t jobs13 = (2 * F + PK_NR - 1) / PK_NR, jobs2 = (D + PK_NR - 1) / PK_NR;
    const size_t buf_bytes = (size_t)(D > F ? D : F) * PK_NR * sizeof(float);
#pragma omp parallel
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        /* no buffer (out of memory): every job takes the unpacked path */
        float *buf = aligned_alloc(64, (buf_bytes + 63) / 64 * 64);
        const struct panel_rows none = {0};
        int64_t lo13, end13;
        moe_share(n_groups, count, jobs13, t, nt, &lo13, &end13);
        for (int64_t job = lo13; job < end13; job++) {
            int64_t g, n0, gn, nn;
            const int64_t ld = PK_ROW_BYTES(D) / (int64_t)sizeof(PK_T);
            const struct panel_rows r = PK_CAT(panel_of, PK_SFX)(job, jobs13, expert, w13, s13,
                                                                 z13, G, 2 * F, D, ld, &g, &n0);
            const struct panel_rows next =
                job + 1 < end13 ? PK_CAT(panel_of, PK_SFX)(job + 1, jobs13, expert, w13, s13, z13,
                                                           G, 2 * F, D, ld, &gn, &nn)
                                : none;
            PK_CAT(panel_job, PK_SFX)(count[g], D, x + start[g] * D, D, &r,
                                      h + start[g] * 2 * F + n0, 2 * F, 0, buf, &next);
        }
        moe_activation_phase(n_groups, start, count, F, h, t, nt);
        int64_t lo2, end2;
        moe_share(n_groups, count, jobs2, t, nt, &lo2, &end2);
        for (int64_t job = lo2; job < end2; job++) {
            int64_t g, n0, gn, nn;
            const int64_t ld = PK_ROW_BYTES(F) / (int64_t)sizeof(PK_T);
            const struct panel_rows r = PK_CAT(panel_of, PK_SFX)(job, jobs2, expert, w2, s2, z2,
                                                                 G, D, F, ld, &g, &n0);
            const struct panel_rows next =
                job + 1 < end2 ? PK_CAT(panel_of, PK_SFX)(job + 1, jobs2, expert, w2, s2, z2, G,
                                                          D, F, ld, &gn, &nn)
                               : none;
            PK_CAT(panel_job, PK_SFX)(count[g], F, h + start[g] * 2 * F, 2 * F, &r,
                                      y + start[g] * D + n0, D, route_w + start[g], buf, &next);
        }
        free(buf);
    }
}

#ifdef PK_GEMM
/* y[:M, :N] = x @ w^T (times the output scales s when given, or with groups of G columns
 * their scales s and zero points z; w's rows ldw apart) for a many-row GEMM (int8 and int4
 * projections from PK_MIN_ROWS rows): the panels of PK_NR weight rows
 * against all M rows, the (panel, row) pairs shared out in equal contiguous ranges (each cut
 * at a tile boundary), so a thread packs each panel it touches once. */
static void PK_CAT(gemm_panels, PK_SFX)(int64_t M, int64_t N, int64_t K, const float *x,
                                        int64_t ldx, const PK_T *w, int64_t ldw, const float *s,
                                        const uint8_t *z, int64_t G, float *y, int64_t ldy) {
    const int64_t panels = (N + PK_NR - 1) / PK_NR, zero = 0;
    const size_t buf_bytes = (size_t)K * PK_NR * sizeof(float);
#pragma omp parallel
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        float *buf = aligned_alloc(64, (buf_bytes + 63) / 64 * 64);
        const struct panel_rows none = {0};
        /* this thread's (panel, row) range, each end moved to a tile boundary of its panel */
        int64_t ends[2];
        for (int i = 0; i < 2; i++) {
            const int64_t u = panels * M * (t + i) / nt, r = (u % M + PK_MR - 1) / PK_MR * PK_MR;
            ends[i] = u / M * M + (r < M ? r : M);
        }
        for (int64_t u = ends[0]; u < ends[1];) {
            const int64_t p = u / M, r0 = u % M;
            const int64_t r1 = ends[1] - p * M < M ? ends[1] - p * M : M;
            int64_t g, n0, gn, nn;
            const struct panel_rows r =
                PK_CAT(panel_of, PK_SFX)(p, panels, &zero, w, s, z, G, N, K, ldw, &g, &n0);
            const struct panel_rows next =
                r1 == M && u + (r1 - r0) < ends[1]
                    ? PK_CAT(panel_of, PK_SFX)(p + 1, panels, &zero, w, s, z, G, N, K, ldw, &gn,
                                               &nn)
                    : none;
            PK_CAT(panel_job, PK_SFX)(r1 - r0, K, x + r0 * ldx, ldx, &r, y + r0 * ldy + n0, ldy,
                                      0, buf, &next);
            u += r1 - r0;
        }
        free(buf);
    }
}

#endif /* PK_GEMM */

#undef PK_CAT
#undef PK_CAT_
#undef PK_GEMM
#undef PK_T
#undef PK_SFX
#undef PK_PACK
#undef PK_ROWS
#undef PK_ROW_BYTES
#undef PK_MIN_ROWS
