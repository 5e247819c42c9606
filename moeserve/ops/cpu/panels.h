/* Packed weight panels and the outer-product tile over them: the AVX-512F building blocks of
 * the many-row GEMMs (moe_packed.h: prefill's MoE layers and int8 projections) and of the
 * prefill attention (prefill_attention.c). Include inside an AVX-512F section; not a
 * translation unit of its own.
 *
 * A panel is PK_NR = 64 rows of a [N, K] matrix (weight rows, or keys) transposed into a
 * [K, 64] fp32 buffer (16 x 16 register transposes; int8 rows are converted and scaled on
 * the way); a tile is a block of up to PK_MR = 6 rows of x against a panel: per k, 4 loads of
 * the panel, 6 broadcasts of x and 24 FMAs into a [6, 64] block of accumulators, no
 * horizontal reduction. A buffer that already has the [K, 64] layout (prefill attention's
 * values) is a panel without the transpose.
 */
#ifndef MOESERVE_PANELS_H
#define MOESERVE_PANELS_H

#define PK_NV 4             /* vectors of 16 per panel row */
#define PK_NR (16 * PK_NV) /* weight rows (output columns) per panel */
#define PK_MR 6             /* token rows per tile: 6 x 4 accumulators */

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
static inline void pack_panel(int64_t K, const float *w, int64_t ldw, int nc, float *buf) {
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

/* buf[k * PK_NR + c] = q[c * ldq + k] * s[c] for c < nc (<= PK_NR; columns past nc are 0) */
static inline void pack_panel_q8(int64_t K, const int8_t *q, int64_t ldq, const float *s,
                                 int nc, float *buf) {
    const int64_t K16 = K - K % 16;
    for (int v = 0; v < PK_NV; v++) {
        const int c0 = 16 * v;
        const int live = nc - c0 <= 0 ? 0 : (nc - c0 >= 16 ? 16 : nc - c0);
        const __m512 sv = _mm512_maskz_loadu_ps((__mmask16)((1u << live) - 1u), s + c0);
        for (int64_t k = 0; k < K16; k += 16) {
            __m512 r[16];
            for (int j = 0; j < 16; j++)
                r[j] = j < live ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                                      (const __m128i *)(q + (c0 + j) * ldq + k))))
                                : _mm512_setzero_ps();
            transpose16(r);
            for (int j = 0; j < 16; j++)
                _mm512_store_ps(buf + (k + j) * PK_NR + c0, _mm512_mul_ps(r[j], sv));
        }
    }
    for (int64_t k = K16; k < K; k++)
        for (int c = 0; c < PK_NR; c++) buf[k * PK_NR + c] = c < nc ? q[c * ldq + k] * s[c] : 0.0f;
}

/* The weight rows a thread packs next, fetched into L2 a few lines at a time while the tiles
 * of the current panel run, so that the next pack reads L2 instead of memory. Without it the
 * pack of a 256 KB panel (memory bound) and the tiles over it (FMA bound) take turns;
 * measured on the prefill MoE layer at 512 tokens (48 rows per expert), 10% faster. */
struct prefetcher {
    const char *w;      /* first weight row; 0: nothing to fetch */
    int64_t row_bytes;  /* row stride */
    int64_t lines;      /* cache lines per row */
    int64_t rows, row;  /* rows to fetch, the current one */
    int64_t line;       /* the next line of the current row */
    int64_t per_step;   /* lines per prefetch_step */
};

/* nr rows of `bytes` each (stride row_bytes) at w, spread over steps calls of prefetch_step */
static void prefetcher_init(struct prefetcher *p, const void *w, int64_t row_bytes,
                            int64_t bytes, int nr, int64_t steps) {
    p->w = (const char *)w;
    p->row_bytes = row_bytes;
    p->lines = (bytes + 63) / 64;
    p->rows = w ? nr : 0;
    p->row = p->line = 0;
    p->per_step = steps > 0 ? (p->lines * nr + steps - 1) / steps : 0;
}

static inline void prefetch_step(struct prefetcher *p) {
    for (int64_t i = 0; i < p->per_step && p->row < p->rows; i++) {
        _mm_prefetch(p->w + p->row * p->row_bytes + 64 * p->line, _MM_HINT_T1);
        if (++p->line == p->lines) {
            p->line = 0;
            p->row++;
        }
    }
}

/* y[i, 0:nc] = (x[i] . panel) * (scale ? scale[i] : 1) for the mr (<= PK_MR) rows at x */
static inline __attribute__((always_inline)) void panel_tile(const int mr, int64_t K,
                                                             const float *x, int64_t ldx,
                                                             const float *buf, float *y,
                                                             int64_t ldy, int nc,
                                                             const float *scale,
                                                             struct prefetcher *pf) {
    __m512 c[PK_MR][PK_NV];
    for (int i = 0; i < PK_MR; i++)
        for (int v = 0; v < PK_NV; v++) c[i][v] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        if ((k & 15) == 0) prefetch_step(pf);
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

#endif /* MOESERVE_PANELS_H */
