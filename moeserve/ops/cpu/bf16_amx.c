/* bf16 GEMMs on Intel AMX (TDPBF16PS): the projections, MLA's per-head products and the
 * routed experts of a model whose weights are bf16 (--quantization bf16, what dtype "auto"
 * picks on a CPU with AMX: Sapphire Rapids and later, Xeon Max included), with fp32 or bf16
 * activations.
 *
 * A tile product C[16, 16] += A[16, 32] . B[32, 16] (fp32 accumulators, bf16 pairs) takes
 * A as 16 rows of 32 bf16 (64 bytes each, any row stride) and B in pairs of k ("VNNI": row p
 * of B holds (b[2p][c], b[2p + 1][c]) for its 16 columns c). The weight is the A operand,
 * read straight from its [N, K] rows (C = W . X^T, weight rows by token rows), so weights
 * need no packing or second copy and the same call serves decode (one token: memory bound)
 * and prefill (compute bound). The activations are the B operand: 16 token rows at a time,
 * packed per call into 1 KB blocks of 16 pairs x 16 rows (a 16 x 16 transpose of 32-bit
 * words; rows past the count are zero), which is cheap next to the weight stream. A job
 * (amx_job.h) is 32 weight rows (two A tiles) against every 16-row block of the tokens, two
 * at a time (four accumulator tiles); the result tiles are transposed back into rows on the
 * way out (the MoE call's hidden excepted: it stays by column).
 *
 * Needs K % 32 == 0 and N % 16 == 0 (checked by the caller, ops/cpu/bf16_amx.py), and the process
 * must have asked the kernel for the AMX state (moeserve_amx_enable). The reference is
 * F.linear in bf16 (fp32 accumulation); the MoE reference is ops/moe.py: moe_reference.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")
#include "amx_tiles.h"
#include "panels.h"

int moeserve_amx_enable(void) { return amx_request(); }

#define BLK 512 /* bf16 per packed 16 x 32 block (1 KB) */

/* Token rows (row stride ldx; bf16, or fp32 when x_f32: rounded to bf16, nearest even)
 * packed as B blocks: block (mb, kb) at xp + (mb * KB + kb) * BLK holds word (p, m) =
 * x[16 mb + m][32 kb + 2p .. +1]; rows past M are zero. */
static void pack_rows(int64_t M, int64_t K, const void *x, int64_t ldx, int x_f32,
                      uint16_t *xp) {
    const int64_t KB = K / 32;
    for (int64_t mb = 0; mb * 16 < M; mb++)
        for (int64_t kb = 0; kb < KB; kb++) {
            __m512 r[16];
            for (int j = 0; j < 16; j++) {
                const int64_t m = 16 * mb + j;
                if (m >= M) {
                    r[j] = _mm512_setzero_ps();
                } else if (x_f32) {
                    const float *row = (const float *)x + m * ldx + 32 * kb;
                    r[j] = (__m512)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + 16),
                                                       _mm512_loadu_ps(row));
                } else {
                    const uint16_t *row = (const uint16_t *)x + m * ldx + 32 * kb;
                    r[j] = _mm512_castsi512_ps(_mm512_loadu_si512(row));
                }
            }
            transpose16(r);
            uint16_t *dst = xp + (mb * KB + kb) * BLK;
            for (int j = 0; j < 16; j++) _mm512_store_ps((float *)(dst + 32 * j), r[j]);
        }
}

/* pack_rows of the M rows of an fp32 matrix held by column (row m, column k at x[k * ldx +
 * m], ldx a multiple of 16 with the columns padded to it): a block's row p interleaves
 * columns 2p and 2p + 1, rounded to bf16 (nearest even); the padding packs as is. */
static void pack_f32_by_column(int64_t M, int64_t K, const float *x, int64_t ldx,
                               uint16_t *xp) {
    const int64_t KB = K / 32;
    const __m512i mix = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
    for (int64_t mb = 0; mb * 16 < M; mb++)
        for (int64_t kb = 0; kb < KB; kb++) {
            uint16_t *dst = xp + (mb * KB + kb) * BLK;
            const float *col = x + 32 * kb * ldx + 16 * mb;
            for (int p = 0; p < 16; p++) {
                const __m512 lo = _mm512_loadu_ps(col + 2 * p * ldx);      /* column 2p */
                const __m512 hi = _mm512_loadu_ps(col + (2 * p + 1) * ldx); /* 2p + 1 */
                const __m512i b = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);     /* [lo | hi] */
                _mm512_store_si512(dst + 32 * p, _mm512_permutexvar_epi16(mix, b));
            }
        }
}

/* Where results go: row m, column n at p + m * ld + n, fp32 or bf16, each row times
 * scale[m] when scale is set. */
struct out_rows {
    void *p;
    int64_t ld;
    int bf16;
    const float *scale;
    int by_column; /* fp32 tiles stored as they are: column n, row m at p + n * ld + m */
};

/* an accumulator tile t[n][m] (16 weight rows by 16 token rows) into rows m0 .. m0 + mv of
 * the output, columns n0 .. n0 + 16 */
static inline void store_tile(const float *t, int64_t m0, int64_t mv, int64_t n0,
                              const struct out_rows *o) {
    __m512 r[16];
    for (int j = 0; j < 16; j++) r[j] = _mm512_load_ps(t + 16 * j);
    transpose16(r);
    for (int64_t m = 0; m < mv && m < 16; m++) {
        __m512 v = r[m];
        if (o->scale) v = _mm512_mul_ps(v, _mm512_set1_ps(o->scale[m0 + m]));
        if (o->bf16) {
            const __m256bh b = _mm512_cvtneps_pbh(v);
            _mm256_storeu_si256((__m256i *)((uint16_t *)o->p + (m0 + m) * o->ld + n0),
                                (__m256i)b);
        } else {
            _mm512_storeu_ps((float *)o->p + (m0 + m) * o->ld + n0, v);
        }
    }
}

#define AJ_T uint16_t
#define AJ_KT 32
#define AJ_DP _tile_dpbf16ps
#define AJ_OUT struct out_rows
#define AJ_STORE store_tile
#include "amx_job.h"

/* out[h] = x[h] . w[h]^T for each of H heads (H = 1: one projection): x[h] is M rows of K
 * (row stride ldx, head stride x_sh; bf16, or fp32 when x_f32, rounded to bf16 as packed),
 * w[h] N rows of K bf16 (ldw, w_sh), out[h] M rows of N (ldo, o_sh; fp32, or bf16 when
 * out_bf16). Strides count elements. xp is a workspace of H * ceil(M / 16) * 16 * K bf16
 * (64-byte aligned), or 0 to allocate one. Jobs are (head, 32 weight rows), an equal run of
 * them per thread. Returns 0, or -1 when the workspace cannot be allocated. */
int moeserve_amx_gemm_nt(int64_t H, int64_t M, int64_t N, int64_t K, const void *x,
                         int64_t x_sh, int64_t ldx, int x_f32, const uint16_t *w, int64_t w_sh,
                         int64_t ldw, void *out, int64_t o_sh, int64_t ldo, int out_bf16,
                         uint16_t *xp) {
    const int64_t KB = K / 32, MB = (M + 15) / 16, J = (N + 31) / 32, per_head = MB * 16 * K;
    uint16_t *own = 0;
    if (!xp) {
        own = xp = aligned_alloc(64, (size_t)(H * per_head * 2 + 63) / 64 * 64);
        if (!own) return -1;
    }
    const int par = H * J > 1 && (H * N * K >= 65536 || H * M * N * K >= (1 << 22));
#pragma omp parallel if (par)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < H * MB; i++) {
            const int64_t h = i / MB, mb = i % MB;
            const int64_t rows = M - 16 * mb < 16 ? M - 16 * mb : 16;
            const size_t at = (h * x_sh + 16 * mb * ldx) * (x_f32 ? 4 : 2);
            pack_rows(rows, K, (const char *)x + at, ldx, x_f32, xp + h * per_head + mb * KB * BLK);
        }
        tiles_on();
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t lo = H * J * t / nt, hi = H * J * (t + 1) / nt;
        for (int64_t i = lo; i < hi; i++) {
            const int64_t h = i / J, j = i % J;
            const int nr = N - 32 * j >= 32 ? 32 : 16;
            const int64_t hn = (i + 1) / J, jn = (i + 1) % J;
            const int next = i + 1 < hi && N - 32 * jn >= 32;
            const size_t esize = out_bf16 ? 2 : 4;
            const struct out_rows o = {(char *)out + h * o_sh * esize, ldo, out_bf16, 0, 0};
            gemm_job(K, w + h * w_sh + 32 * j * ldw, ldw, nr, xp + h * per_head, M, 32 * j, &o,
                     next ? w + hn * w_sh + 32 * jn * ldw : 0);
        }
        _tile_release();
    }
    free(own);
    return 0;
}

/* The fp32-activation projection with the argument list of fp32.c's few-row GEMM
 * (ops/linear.py: BoundLinear binds either): out[M, N] = x[M, K] . w[N, K]^T. */
int moeserve_amx_gemm_nt_f32(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx,
                             const uint16_t *w, int64_t ldw, float *out, int64_t ldo,
                             int unused) {
    (void)unused;
    return moeserve_amx_gemm_nt(1, M, N, K, x, 0, ldx, 1, w, 0, ldw, out, 0, ldo, 0, 0);
}

/* The per-head products of MLA's absorbed decode with the argument list of fp32.c's
 * moeserve_head_gemm_nt_small: fp32 x and out, bf16 w. */
int moeserve_amx_head_gemm_nt_f32(int64_t H, int64_t M, int64_t N, int64_t K, const float *x,
                                  int64_t x_sh, int64_t ldx, const uint16_t *w, int64_t w_sh,
                                  int64_t ldw, float *out, int64_t o_sh, int64_t ldo,
                                  int unused) {
    (void)unused;
    return moeserve_amx_gemm_nt(H, M, N, K, x, x_sh, ldx, 1, w, w_sh, ldw, out, o_sh, ldo, 0, 0);
}

/* The routed experts of an MoE layer for rows sorted by expert: group g is rows start[g] ..
 * start[g] + count[g] of x [R, D] (bf16, or fp32 when x_f32: rounded to bf16 as packed), for
 * expert expert[g] of w13 [E, 2F, D] (gate rows then up rows) and w2 [E, D, F] (bf16);
 * y[r] = weight[r] * w2 . (silu(gate) * up), bf16 (fp32 when y_f32). Workspaces: xp and hp
 * hold P = sum_g ceil(count[g] / 16) * 16 rows of D and F bf16 (64-byte aligned), h the fp32
 * hidden, P x 2F. The hidden is kept by column per group (the group's 2F columns of its
 * padded rows), which is how the accumulator tiles come out: stored without transposes,
 * activated in place ([gate | up] columns are two halves) and packed for the second product
 * by interleaving column pairs (measured at 512 tokens: 1.1x the row layout). It stays fp32
 * through the activation and is rounded to bf16 once, as the second product's input. */
void moeserve_amx_moe(int64_t G, const int64_t *expert, const int64_t *start,
                      const int64_t *count, int64_t D, int64_t F, const void *x, int x_f32,
                      const uint16_t *w13, const uint16_t *w2, const float *weight, void *y,
                      int y_f32, uint16_t *xp, float *h, uint16_t *hp) {
    int64_t first_block[G > 0 ? G : 1]; /* packed 16-row blocks before each group */
    group_blocks(G, count, first_block);
    const int64_t J13 = 2 * F / 32, J2 = D / 32;
#pragma omp parallel
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#pragma omp for schedule(dynamic, 1)
        for (int64_t g = 0; g < G; g++)
            pack_rows(count[g], D, (const char *)x + start[g] * D * (x_f32 ? 4 : 2), D, x_f32,
                      xp + first_block[g] * 16 * D);
        tiles_on();
        {
            int64_t lo, hi;
            job_share(G, count, J13, t, nt, &lo, &hi);
            for (int64_t i = lo; i < hi; i++) {
                const int64_t g = i / J13, j = i % J13, pad = (count[g] + 15) / 16 * 16;
                const struct out_rows o = {h + first_block[g] * 16 * 2 * F, pad, 0, 0, 1};
                const int64_t gn = (i + 1) / J13, jn = (i + 1) % J13;
                gemm_job(D, w13 + (expert[g] * 2 * F + 32 * j) * D, D, 32,
                         xp + first_block[g] * 16 * D, count[g], 32 * j, &o,
                         i + 1 < hi ? w13 + (expert[gn] * 2 * F + 32 * jn) * D : 0);
            }
        }
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
        for (int64_t g = 0; g < G; g++) {
            const int64_t pad = (count[g] + 15) / 16 * 16;
            float *hg = h + first_block[g] * 16 * 2 * F;
            silu_mul_row(F * pad, hg); /* gate columns are the first half, up the second */
            pack_f32_by_column(count[g], F, hg, pad, hp + first_block[g] * 16 * F);
        }
        {
            int64_t lo, hi;
            job_share(G, count, J2, t, nt, &lo, &hi);
            for (int64_t i = lo; i < hi; i++) {
                const int64_t g = i / J2, j = i % J2;
                const struct out_rows o = {(char *)y + start[g] * D * (y_f32 ? 4 : 2), D, !y_f32,
                                           weight + start[g], 0};
                const int64_t gn = (i + 1) / J2, jn = (i + 1) % J2;
                gemm_job(F, w2 + (expert[g] * D + 32 * j) * F, F, 32,
                         hp + first_block[g] * 16 * F, count[g], 32 * j, &o,
                         i + 1 < hi ? w2 + (expert[gn] * D + 32 * jn) * F : 0);
            }
        }
        _tile_release();
    }
}

#pragma GCC pop_options
