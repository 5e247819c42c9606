/* int8 GEMMs on Intel AMX (TDPBSSD) for the w8a8_int8 weight format: int8 weights with one
 * fp32 scale per output row (quant/int8.py) times activations quantized to int8 per token row
 * as they are packed, symmetric:
 *
 *     s[m] = max_k |x[m, k]| / 127,   xq[m, k] = round(x[m, k] * (127 / max_k |x[m, k]|))
 *     y[m, n] = (sum_k xq[m, k] q[n, k]) * scale[n] * s[m]          (int32 sums, exact)
 *
 * (a zero row gets s 0 and xq 0; round is to nearest even). This is the scheme of SGLang's
 * w8a8_int8 (per-channel weights, dynamic per-token activations); on AMX its products run at
 * twice the bf16 rate and the weight is read as int8, half of bf16's bytes.
 *
 * The layout is bf16_amx.c's: a tile product C[16, 16] += A[16, 64] . B[64, 16] (int32
 * accumulators) takes A as 16 rows of 64 int8 with any row stride, so the weight is the A
 * operand read straight from its [N, K] rows (C = W . X^T), and B in quads of k ("VNNI": row p
 * of B holds (b[4p][c] .. b[4p + 3][c]) for its 16 columns c). Token rows are quantized and
 * packed per call into 1 KB blocks of 16 quads x 16 rows (a 16 x 16 transpose of 32-bit
 * words; rows past the count are zero). A job (amx_job.h, shared with bf16_amx.c) is 32 weight rows
 * against every 16-row block of the tokens, two at a time (four accumulator tiles), the next
 * job's rows prefetched into L2.
 *
 * In the MoE call the gate/up sums stay int32 by column (as the tiles come out), are scaled,
 * activated and quantized per token row in one pass, and packed for the down projection by
 * taking four columns into each 32-bit word. Needs K % 64 == 0 and N % 16 == 0 (checked by
 * the caller, ops/cpu/int8_amx.py). The references are int8_amx.py's gemm_ref and moe_ref.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,amx-tile,amx-int8")
#include "amx_tiles.h"
#include "panels.h"
#include "amx_i8_rows.h"

int moeserve_amx_i8_enable(void) { return amx_request(); }

/* Where results go: row m, column n at p + m * ld + n (fp32), the int32 sum times ws[n] (the
 * weight row's scale, ws indexed by output column) times xs[m] (the token row's scale) times
 * rw[m] when rw is set. by_column: the int32 tiles as they are (column n, row m at
 * (int32_t *)p + n * ld + m), scaled later. */
struct out_q {
    void *p;
    int64_t ld;
    const float *ws, *xs, *rw;
    int by_column;
};

/* an accumulator tile t[n][m] (16 weight rows by 16 token rows) into rows m0 .. m0 + mv of
 * the output, columns n0 .. n0 + 16 */
static inline void store_tile_q(const int32_t *t, int64_t m0, int64_t mv, int64_t n0,
                                const struct out_q *o) {
    __m512 r[16];
    for (int j = 0; j < 16; j++) r[j] = _mm512_load_ps((const float *)(t + 16 * j));
    transpose16(r); /* r[m]: the sums of row m0 + m, columns n0 .. n0 + 16 */
    const __m512 ws = _mm512_loadu_ps(o->ws + n0);
    for (int64_t m = 0; m < mv && m < 16; m++) {
        const float s = o->rw ? o->xs[m0 + m] * o->rw[m0 + m] : o->xs[m0 + m];
        const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_castps_si512(r[m])), ws);
        _mm512_storeu_ps((float *)o->p + (m0 + m) * o->ld + n0,
                         _mm512_mul_ps(v, _mm512_set1_ps(s)));
    }
}

#define AJ_T int8_t
#define AJ_KT 64
#define AJ_DP _tile_dpbssd
#define AJ_OUT struct out_q
#define AJ_STORE(t, m0, mv, n0, o) store_tile_q((const int32_t *)(t), m0, mv, n0, o)
#include "amx_job.h"

/* out[M, N] = dequant(quantize_rows(x[M, K]) . q[N, K]^T): fp32 x (row stride ldx), int8 q
 * (row stride ldq bytes) with fp32 row scales ws, fp32 out (ldo). The argument list of
 * int8.c's few-row GEMM (ops/linear.py: BoundLinear binds either). Jobs are 32 weight rows,
 * an equal run of them per thread. Returns 0, or -1 when the packed rows cannot be
 * allocated. */
int moeserve_amx_i8_gemm_nt(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx,
                            const int8_t *q, int64_t ldq, const float *ws, float *out,
                            int64_t ldo, int unused) {
    (void)unused;
    const int64_t J = (N + 31) / 32;
    int64_t lp;
    float *xs;
    int8_t *xp = packed_rows_alloc(M, K, 1, &lp, &xs);
    if (!xp) return -1;
    const int par = J > 1 && (N * K >= 65536 || M * N * K >= (1 << 22));
#pragma omp parallel if (par)
    {
        pack_rows_blocks(M, K, x, ldx, xp, lp, xs);
        tiles_on();
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t lo = J * t / nt, hi = J * (t + 1) / nt;
        const struct out_q o = {out, ldo, ws, xs, 0, 0};
        for (int64_t j = lo; j < hi; j++) {
            const int nr = N - 32 * j >= 32 ? 32 : 16;
            const int next = j + 1 < hi && N - 32 * (j + 1) >= 32;
            gemm_job(K, q + 32 * j * ldq, ldq, nr, xp, M, 32 * j, &o,
                     next ? q + 32 * (j + 1) * ldq : 0);
        }
        _tile_release();
    }
    free(xp);
    return 0;
}

/* The routed experts of an MoE layer for rows sorted by expert: group g is rows start[g] ..
 * start[g] + count[g] of x [R, D] (fp32), for expert expert[g] of q13 [E, 2F, D] (gate rows
 * then up rows; row scales s13 [E, 2F]) and q2 [E, D, F] (s2 [E, D]);
 * y[r] = weight[r] * w2 . (silu(gate) * up) (fp32), the rows of x and the hidden each
 * quantized per row. Workspaces for P = sum_g ceil(count[g] / 16) * 16 rows: xp [P, D] and
 * hp [P, F] int8 (64-byte aligned), xs and hs [P] fp32, h [P, 2F] int32 (by column per
 * group: the group's 2F columns of its padded rows). */
void moeserve_amx_i8_moe(int64_t G, const int64_t *expert, const int64_t *start,
                         const int64_t *count, int64_t D, int64_t F, const float *x,
                         const int8_t *q13, const float *s13, const int8_t *q2, const float *s2,
                         const float *weight, float *y, int8_t *xp, float *xs, int32_t *h,
                         int8_t *hp, float *hs) {
    int64_t first_block[G > 0 ? G : 1]; /* packed 16-row blocks before each group */
    group_blocks(G, count, first_block);
    const int64_t J13 = 2 * F / 32, J2 = D / 32;
#pragma omp parallel
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#pragma omp for schedule(dynamic, 1)
        for (int64_t g = 0; g < G; g++)
            pack_rows_q(count[g], D, x + start[g] * D, D, xp + first_block[g] * 16 * D, 0,
                        xs + first_block[g] * 16);
        tiles_on();
        {
            int64_t lo, hi;
            job_share(G, count, J13, t, nt, &lo, &hi);
            for (int64_t i = lo; i < hi; i++) {
                const int64_t g = i / J13, j = i % J13, pad = (count[g] + 15) / 16 * 16;
                const struct out_q o = {h + first_block[g] * 16 * 2 * F, pad, 0, 0, 0, 1};
                const int64_t gn = (i + 1) / J13, jn = (i + 1) % J13;
                gemm_job(D, q13 + (expert[g] * 2 * F + 32 * j) * D, D, 32,
                         xp + first_block[g] * 16 * D, count[g], 32 * j, &o,
                         i + 1 < hi ? q13 + (expert[gn] * 2 * F + 32 * jn) * D : 0);
            }
        }
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
        for (int64_t g = 0; g < G; g++) {
            const int64_t pad = (count[g] + 15) / 16 * 16, b0 = first_block[g];
            for (int64_t mb = 0; mb < pad / 16; mb++)
                activate_pack(F, h + b0 * 16 * 2 * F + 16 * mb, pad, s13 + expert[g] * 2 * F,
                              xs + 16 * (b0 + mb), hp + (b0 + mb) * 16 * F, 0, hs + 16 * (b0 + mb));
        }
        {
            int64_t lo, hi;
            job_share(G, count, J2, t, nt, &lo, &hi);
            for (int64_t i = lo; i < hi; i++) {
                const int64_t g = i / J2, j = i % J2;
                const struct out_q o = {y + start[g] * D, D, s2 + expert[g] * D,
                                        hs + 16 * first_block[g], weight + start[g], 0};
                const int64_t gn = (i + 1) / J2, jn = (i + 1) % J2;
                gemm_job(F, q2 + (expert[g] * D + 32 * j) * F, F, 32,
                         hp + first_block[g] * 16 * F, count[g], 32 * j, &o,
                         i + 1 < hi ? q2 + (expert[gn] * D + 32 * jn) * F : 0);
            }
        }
        _tile_release();
    }
}

#pragma GCC pop_options
