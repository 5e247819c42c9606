/* The token side of the int8 AMX kernels (int8_amx.c: w8a8_int8, int4_amx.c: w4a8_int8 and
 * int4): fp32 rows quantized per row and packed as the B operand of the tile products, and
 * the MoE calls' gated activation between the projections, quantized and packed the same way.
 *
 * Two forms, by `lp`: lp == 0, each row on its int8 grid (qmax 127, w8a8_int8's rounding);
 * lp > 0, each row in 16-bit fixed point (qmax XMAX = 32639, int4_idot.h's rounding: the int4
 * format's numerics), split into two signed byte planes xi = 256 xh + xl, the high bytes
 * packed at xp and the low ones in the same layout lp bytes further (a tile product per plane:
 * int4_amx.c). Include inside a section whose target has AVX-512 (F, BW, VL, DQ), after
 * common.h and panels.h (transpose16); not a translation unit of its own. */
#ifndef MOESERVE_AMX_I8_ROWS_H
#define MOESERVE_AMX_I8_ROWS_H

#define QBLK 1024     /* bytes per packed block: 16 quads of k x 16 token rows */
#define QMAX8 127.0f  /* a row's largest magnitude on its int8 grid */
#define QMAX16 32639.0f /* in 16-bit fixed point: 127 * (1 + 256), every byte in [-128, 127] */

static inline float qmax_of(int64_t lp) { return lp ? QMAX16 : QMAX8; }

/* v - v: 0 for a finite lane, nan for a nan or an inf */
static inline __mmask16 nonfinite16(__m512 v) {
    return _mm512_cmp_ps_mask(_mm512_sub_ps(v, v), _mm512_setzero_ps(), _CMP_UNORD_Q);
}

/* qmax / max|row| (0 for a zero row); the row's scale max|row| / qmax into *scale. A row with
 * a nan or an inf gets scale nan, so its outputs are nan (max alone would drop a nan; an inf
 * would give inf times zero sums). */
static inline float row_inv(const float *row, int64_t K, float qmax, float *scale) {
    __m512 m = _mm512_setzero_ps();
    __mmask16 nan = 0;
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        const __m512 v = _mm512_loadu_ps(row + k);
        m = _mm512_max_ps(m, _mm512_abs_ps(v));
        nan |= nonfinite16(v);
    }
    float amax = _mm512_reduce_max_ps(m);
    for (; k < K; k++) {
        amax = fmaxf(amax, fabsf(row[k]));
        nan |= row[k] - row[k] != 0.0f;
    }
    if (nan) amax = NAN;
    *scale = amax / qmax;
    return amax > 0.0f ? qmax / amax : 0.0f;
}

/* 16 values times inv, rounded (nearest even) to int32 lanes */
static inline __m512i quant16(__m512 v, __m512 inv) {
    return _mm512_cvtps_epi32(_mm512_mul_ps(v, inv));
}

/* q (int32 lanes, |q| <= QMAX16) as the signed low byte l and the high byte h = (q - l) / 256
 * of each lane */
static inline void split16(__m512i q, __m512i *h, __m512i *l) {
    *l = _mm512_srai_epi32(_mm512_slli_epi32(q, 24), 24);
    *h = _mm512_srai_epi32(_mm512_sub_epi32(q, *l), 8);
}

/* 64 int32 lanes (q[0..3], each in [-128, 127]) as 64 bytes, in order */
static inline __m512 bytes64(const __m512i *q) {
    __m512i v = _mm512_castsi128_si512(_mm512_cvtsepi32_epi8(q[0]));
    v = _mm512_inserti32x4(v, _mm512_cvtsepi32_epi8(q[1]), 1);
    v = _mm512_inserti32x4(v, _mm512_cvtsepi32_epi8(q[2]), 2);
    v = _mm512_inserti32x4(v, _mm512_cvtsepi32_epi8(q[3]), 3);
    return _mm512_castsi512_ps(v);
}

/* M fp32 token rows (row stride ldx) quantized per row and packed as B blocks: block
 * (mb, kb) at xp + (mb * KB + kb) * QBLK holds word (p, m) = xq[16 mb + m][64 kb + 4p ..
 * +3] (with lp, the high bytes; the low ones lp bytes further). Each row's scale goes to
 * xs[m]; rows past M (to the next multiple of 16) pack as zero with scale 0. */
static void pack_rows_q(int64_t M, int64_t K, const float *x, int64_t ldx, int8_t *xp,
                        int64_t lp, float *xs) {
    const int64_t KB = K / 64;
    const float qmax = qmax_of(lp);
    for (int64_t mb = 0; mb * 16 < M; mb++) {
        __m512 inv[16];
        for (int j = 0; j < 16; j++) {
            const int64_t m = 16 * mb + j;
            if (m < M) {
                inv[j] = _mm512_set1_ps(row_inv(x + m * ldx, K, qmax, xs + m));
            } else {
                inv[j] = _mm512_setzero_ps();
                xs[m] = 0.0f;
            }
        }
        for (int64_t kb = 0; kb < KB; kb++) {
            __m512 r[16], rl[16];
            for (int j = 0; j < 16; j++) {
                const int64_t m = 16 * mb + j;
                if (m >= M) {
                    r[j] = rl[j] = _mm512_setzero_ps();
                    continue;
                }
                const float *row = x + m * ldx + 64 * kb;
                __m512i q[4], l[4];
                for (int i = 0; i < 4; i++) {
                    q[i] = quant16(_mm512_loadu_ps(row + 16 * i), inv[j]);
                    if (lp) split16(q[i], &q[i], &l[i]);
                }
                r[j] = bytes64(q);
                if (lp) rl[j] = bytes64(l);
            }
            transpose16(r);
            int8_t *dst = xp + (mb * KB + kb) * QBLK;
            for (int j = 0; j < 16; j++) _mm512_store_ps((float *)(dst + 64 * j), r[j]);
            if (lp) {
                transpose16(rl);
                for (int j = 0; j < 16; j++) _mm512_store_ps((float *)(dst + lp + 64 * j), rl[j]);
            }
        }
    }
}

/* The packed rows of a GEMM's M token rows (pack_rows_q's 16-row blocks, `planes` of them:
 * the low bytes at *lp, 0 with one plane), their scales at *xs after them; NULL when they
 * cannot be allocated (free() them). */
static int8_t *packed_rows_alloc(int64_t M, int64_t K, int planes, int64_t *lp, float **xs) {
    const size_t plane = (size_t)(((M + 15) / 16) * 16 * K + 63) / 64 * 64;
    int8_t *xp = aligned_alloc(64, planes * plane + (size_t)(M + 15) / 16 * 16 * sizeof(float));
    *lp = planes > 1 ? (int64_t)plane : 0;
    if (xp) *xs = (float *)(xp + planes * plane);
    return xp;
}

/* pack_rows_q of all M rows into xp (packed_rows_alloc's), the 16-row blocks shared out
 * among the threads of the enclosing parallel region (an orphaned omp for: its barrier ends
 * it; outside a region, one thread packs them all) */
static void pack_rows_blocks(int64_t M, int64_t K, const float *x, int64_t ldx, int8_t *xp,
                             int64_t lp, float *xs) {
    const int64_t KB = K / 64, MB = (M + 15) / 16;
#pragma omp for schedule(static)
    for (int64_t mb = 0; mb < MB; mb++) {
        const int64_t rows = M - 16 * mb < 16 ? M - 16 * mb : 16;
        pack_rows_q(rows, K, x + 16 * mb * ldx, ldx, xp + mb * KB * QBLK, lp, xs + 16 * mb);
    }
}

/* silu(g) * u for 16 lanes (common.h: silu_mul_row's form, e^-|g| never overflows) */
static inline __m512 silu_mul16(__m512 g, __m512 u) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 g0 = _mm512_castps512_ps256(g);
    const __m256 g1 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(g), 1));
    const __m256 e0 = exp256_neg(_mm256_or_ps(g0, sign)), e1 = exp256_neg(_mm256_or_ps(g1, sign));
    const __m512 e = _mm512_insertf32x8(_mm512_castps256_ps512(e0), e1, 1); /* e^-|g| */
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 den = _mm512_add_ps(one, e);
    const __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(neg, one, e), den);
    return _mm512_mul_ps(_mm512_mul_ps(g, sig), u);
}

/* the bytes of q0..q3 (int32 lanes, each in [-128, 127]) interleaved: lane i's word holds q0's
 * byte i, then q1's, q2's and q3's */
static inline __m512i quad_words(__m512i q0, __m512i q1, __m512i q2, __m512i q3) {
    const __m512i byte = _mm512_set1_epi32(0xff);
    __m512i w = _mm512_and_si512(q0, byte);
    w = _mm512_or_si512(w, _mm512_slli_epi32(_mm512_and_si512(q1, byte), 8));
    w = _mm512_or_si512(w, _mm512_slli_epi32(_mm512_and_si512(q2, byte), 16));
    return _mm512_or_si512(w, _mm512_slli_epi32(q3, 24));
}

/* One 16-row block of an MoE group's hidden, held by column (column n of these rows at
 * h + n * ld; [gate F | up F] columns): with ws, int32 sums of the gate/up product, scaled to
 * fp32 here (column scale ws[n], row scales xs); without (ws 0), fp32 values already scaled
 * (int4_amx.c applies its group scales as it sums). Activated into the gate columns,
 * quantized per row (scales into hs) and packed as the down projection's B blocks at hp
 * (KB = F / 64 blocks; with lp, two planes as pack_rows_q). */
static void activate_pack(int64_t F, int32_t *h, int64_t ld, const float *ws, const float *xs,
                          int8_t *hp, int64_t lp, float *hs) {
    float *a = (float *)h; /* the activation overwrites the gate columns */
    const __m512 xsv = ws ? _mm512_loadu_ps(xs) : _mm512_setzero_ps();
    __m512 amax = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t n = 0; n < F; n++) {
        if (!ws) {
            const __m512 v =
                silu_mul16(_mm512_loadu_ps(a + n * ld), _mm512_loadu_ps(a + (F + n) * ld));
            _mm512_storeu_ps(a + n * ld, v);
            amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
            nan |= nonfinite16(v);
            continue;
        }
        const __m512 g = _mm512_mul_ps(
            _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(h + n * ld)),
                          _mm512_set1_ps(ws[n])),
            xsv);
        const __m512 u = _mm512_mul_ps(
            _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(h + (F + n) * ld)),
                          _mm512_set1_ps(ws[F + n])),
            xsv);
        const __m512 v = silu_mul16(g, u);
        _mm512_storeu_ps(a + n * ld, v);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
        nan |= nonfinite16(v);
    }
    amax = _mm512_mask_mov_ps(amax, nan, _mm512_set1_ps(NAN)); /* as row_inv: nan rows */
    const __mmask16 live = _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ);
    const __m512 qmax = _mm512_set1_ps(qmax_of(lp));
    const __m512 inv = _mm512_maskz_div_ps(live, qmax, amax);
    _mm512_storeu_ps(hs, _mm512_div_ps(amax, qmax));
    for (int64_t kb = 0; kb < F / 64; kb++)
        for (int p = 0; p < 16; p++) {
            const float *c = a + (64 * kb + 4 * p) * ld; /* columns 4p .. 4p + 3 of block kb */
            __m512i q[4], l[4];
            for (int i = 0; i < 4; i++) {
                q[i] = quant16(_mm512_loadu_ps(c + i * ld), inv);
                if (lp) split16(q[i], &q[i], &l[i]);
            }
            _mm512_store_si512(hp + kb * QBLK + 64 * p, quad_words(q[0], q[1], q[2], q[3]));
            if (lp)
                _mm512_store_si512(hp + lp + kb * QBLK + 64 * p,
                                   quad_words(l[0], l[1], l[2], l[3]));
        }
}

#endif
