/* The AVX-512 MoE layer for prefill: experts with many rows through packed weight panels.
 *
 * Included by kernels.c inside its AVX-512F section, after the fp32 body (it uses
 * job_rows_avx512 and the helpers of common.h); not a translation unit of its own.
 *
 * The decode kernels dot weight rows with token rows along K (4 weight rows x 6 token rows,
 * 24 accumulators, then a horizontal reduction): the weight streams from memory once, which is
 * what few rows need. With tens of rows per expert (prefill: T x top_k / E) the work is the
 * FMAs, and there that form reaches ~60-85 GFLOP/s per core of the ~155 peak. Here a job is a
 * panel of NR = 64 weight rows (output columns): it is transposed once into a [K, 64] buffer
 * (16 x 16 register transposes; the buffer stays in L2), then every block of MR = 6 token rows
 * runs an outer product over it: per k, 4 loads of the panel, 6 broadcasts of x and 24 FMAs
 * into a [6, 64] tile of accumulators, no reduction. Measured on one prefill MoE layer of the
 * benchmark model (routed experts, 2 threads, docs/benchmarks.md "Prefill MoE"): 48 rows per
 * expert 84 -> 71 ms, 24 rows 47 -> 44 ms; 12 rows 8% slower, hence PACK_MIN_ROWS.
 */
#ifndef MOESERVE_MOE_PACKED_H
#define MOESERVE_MOE_PACKED_H

#define PK_NV 4             /* vectors of 16 per panel row */
#define PK_NR (16 * PK_NV) /* weight rows (output columns) per panel */
#define PK_MR 6             /* token rows per tile: 6 x 4 accumulators */
#ifndef PACK_MIN_ROWS
#define PACK_MIN_ROWS 24 /* an expert's rows from which its jobs pack (fewer: job_rows) */
#endif

/* 16 vectors transposed in place: r[j][i] <- r[i][j] */
static inline __attribute__((always_inline)) void transpose16(__m512 *r) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        const __m512d a0 = _mm512_castps_pd(t[4 * i]), a1 = _mm512_castps_pd(t[4 * i + 1]);
        const __m512d a2 = _mm512_castps_pd(t[4 * i + 2]), a3 = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a0, a2));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a0, a2));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(a1, a3));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(a1, a3));
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) {
            t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
            t[8 * i + j + 4] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + j + 4], 0xDD);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xDD);
    }
}

/* buf[k * PK_NR + c] = w[c * ldw + k] for c < nc (<= PK_NR; columns past nc are 0), k < K */
static void pack_panel(int64_t K, const float *w, int64_t ldw, int nc, float *buf) {
    const int64_t K16 = K - K % 16;
    for (int v = 0; v < PK_NV; v++) {
        for (int64_t k = 0; k < K16; k += 16) {
            __m512 r[16];
            for (int j = 0; j < 16; j++) {
                const int c = 16 * v + j;
                r[j] = c < nc ? _mm512_loadu_ps(w + c * ldw + k) : _mm512_setzero_ps();
            }
            transpose16(r);
            for (int j = 0; j < 16; j++) _mm512_store_ps(buf + (k + j) * PK_NR + 16 * v, r[j]);
        }
    }
    for (int64_t k = K16; k < K; k++)
        for (int c = 0; c < PK_NR; c++) buf[k * PK_NR + c] = c < nc ? w[c * ldw + k] : 0.0f;
}

/* y[i, 0:nc] = (x[i] . panel) * (scale ? scale[i] : 1) for the mr (<= PK_MR) rows at x */
static inline __attribute__((always_inline)) void panel_tile(const int mr, int64_t K,
                                                             const float *x, int64_t ldx,
                                                             const float *buf, float *y,
                                                             int64_t ldy, int nc,
                                                             const float *scale) {
    __m512 c[PK_MR][PK_NV];
    for (int i = 0; i < PK_MR; i++)
        for (int v = 0; v < PK_NV; v++) c[i][v] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m512 b[PK_NV];
#pragma GCC unroll 4
        for (int v = 0; v < PK_NV; v++) b[v] = _mm512_load_ps(buf + k * PK_NR + 16 * v);
#pragma GCC unroll 6
        for (int i = 0; i < PK_MR; i++) {
            if (i < mr) {
                const __m512 xi = _mm512_set1_ps(x[i * ldx + k]);
#pragma GCC unroll 4
                for (int v = 0; v < PK_NV; v++) c[i][v] = _mm512_fmadd_ps(xi, b[v], c[i][v]);
            }
        }
    }
    for (int i = 0; i < PK_MR; i++) {
        if (i >= mr) break;
        if (scale) {
            const __m512 s = _mm512_set1_ps(scale[i]);
            for (int v = 0; v < PK_NV; v++) c[i][v] = _mm512_mul_ps(c[i][v], s);
        }
        if (nc == PK_NR) {
            for (int v = 0; v < PK_NV; v++) _mm512_storeu_ps(y + i * ldy + 16 * v, c[i][v]);
        } else {
            float row[PK_NR];
            for (int v = 0; v < PK_NV; v++) _mm512_storeu_ps(row + 16 * v, c[i][v]);
            for (int n = 0; n < nc; n++) y[i * ldy + n] = row[n];
        }
    }
}

/* One job: the nc (<= PK_NR) weight rows at w (stride ldw) against the M token rows at x into
 * y[:, 0:nc], each output row scaled by scale[i] when scale is given. Packed when M is large
 * enough and there is a buffer, otherwise the decode kernels' jobs of NJ rows. */
static void panel_job(int64_t M, int64_t K, const float *x, int64_t ldx, const float *w,
                      int64_t ldw, int nc, float *y, int64_t ldy, const float *scale,
                      float *buf) {
    if (M >= PACK_MIN_ROWS && buf) {
        pack_panel(K, w, ldw, nc, buf);
        for (int64_t m0 = 0; m0 < M; m0 += PK_MR) {
            const int64_t left = M - m0;
            const float *sc = scale ? scale + m0 : 0;
#define TILE(mr) panel_tile(mr, K, x + m0 * ldx, ldx, buf, y + m0 * ldy, ldy, nc, sc)
            DISPATCH_MB(left, PK_MR, TILE)
#undef TILE
        }
        return;
    }
    const int64_t pf = prefetch_ahead(ldw), pf4 = prefetch_ahead4_avx512(ldw);
    for (int q = 0; q < nc; q += NJ) {
        const int nw = nc - q < NJ ? nc - q : NJ;
        job_rows_avx512(M, K, x, ldx, w + q * ldw, ldw, nw, y + q, ldy, pf, pf4);
        if (scale)
            for (int64_t r = 0; r < M; r++)
                for (int c = 0; c < nw; c++) y[r * ldy + q + c] *= scale[r];
    }
}

/* The routed experts of a call in which some expert has PACK_MIN_ROWS rows or more: the
 * moeserve_moe_small contract (kernels.c), jobs of PK_NR weight rows shared out as in moe_*
 * (contiguous shares of equal cost), each thread with its own panel buffer. */
static void moe_panels(int64_t n_groups, const int64_t *expert, const int64_t *start,
                       const int64_t *count, int64_t D, int64_t F, const float *x,
                       const float *w13, const float *w2, const float *route_w, float *h,
                       float *y) {
    const int64_t jobs13 = (2 * F + PK_NR - 1) / PK_NR, jobs2 = (D + PK_NR - 1) / PK_NR;
    const size_t buf_bytes = (size_t)(D > F ? D : F) * PK_NR * sizeof(float);
#pragma omp parallel
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        /* no buffer (out of memory): every job takes the unpacked path */
        float *buf = aligned_alloc(64, (buf_bytes + 63) / 64 * 64);
        int64_t lo13, end13;
        moe_share(n_groups, count, jobs13, t, nt, &lo13, &end13);
        for (int64_t job = lo13; job < end13; job++) {
            const int64_t g = job / jobs13, n0 = PK_NR * (job % jobs13);
            const int nc = 2 * F - n0 < PK_NR ? (int)(2 * F - n0) : PK_NR;
            panel_job(count[g], D, x + start[g] * D, D, w13 + (expert[g] * 2 * F + n0) * D, D,
                      nc, h + start[g] * 2 * F + n0, 2 * F, 0, buf);
        }
        moe_activation_phase(n_groups, start, count, F, h, t, nt);
        int64_t lo2, end2;
        moe_share(n_groups, count, jobs2, t, nt, &lo2, &end2);
        for (int64_t job = lo2; job < end2; job++) {
            const int64_t g = job / jobs2, n0 = PK_NR * (job % jobs2);
            const int nc = D - n0 < PK_NR ? (int)(D - n0) : PK_NR;
            panel_job(count[g], F, h + start[g] * 2 * F, 2 * F, w2 + (expert[g] * D + n0) * F,
                      F, nc, y + start[g] * D + n0, D, route_w + start[g], buf);
        }
        free(buf);
    }
}
#endif
