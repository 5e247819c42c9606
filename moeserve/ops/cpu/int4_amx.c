/* int4 GEMMs on Intel AMX (TDPBSSD) for the w4a8_int8 weight format: group-wise 4-bit weights
 * (quant/int4.py: codes u, an fp32 scale and a uint8 zero point per group of G columns) times
 * activations quantized to int8 per token row as w8a8_int8's are (amx_i8_rows.h):
 *
 *     s[m] = max_k |x[m, k]| / 127,   xq[m, k] = round(x[m, k] * (127 / max_k |x[m, k]|))
 *     y[m, n] = s[m] * sum_g scale[n, g] * sum_{k in g} xq[m, k] (u[n, k] - zero[n, g])
 *
 * with exact int32 sums per group. A job is 32 weight rows (16 at an odd tail): their codes
 * are unpacked once into int8 (u - zero, in [-15, 15]) in a per-thread buffer (32 K bytes, in
 * L2), the A operand of the tile products read from there, then run against every packed
 * 16-row block of the tokens, two at a time (four accumulator tiles, as amx_job.h). The int32
 * tiles are stored after each group and added to fp32 accumulators times the group's scales
 * (a tile row is a weight row, so one scale per row); the token-row scales multiply at the
 * end. A tile product takes 64 columns with groups of 64 and 128, 32 with groups of 32 (the
 * tile shapes of TILES_K32), so a group never straddles a product.
 *
 * The weights stream at int4's bytes (half of int8's) and the products run on the int8 tiles;
 * what w8a8_int8 does not pay is the unpack (a few AVX2 operations per 32 weights) and the
 * per-group flush of the accumulators (a store and an FMA per row of each tile per group).
 *
 * In the MoE call the gate/up sums come out by column in fp32 (scaled), are activated,
 * quantized per token row and packed for the down projection (amx_i8_rows.h: activate_pack).
 * Needs K % 64 == 0, N % 16 == 0 and G in {32, 64, 128} (checked by the caller,
 * ops/cpu/int4_amx.py). The references are int4_amx.py's gemm_ref and moe_ref.
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
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,amx-tile,amx-int8")
#include "amx_tiles.h"
#include "panels.h"
#include "amx_i8_rows.h"

int moeserve_amx_i4_enable(void) { return amx_request(); }

/* Groups of 32 columns: weight tiles of 16 rows x 32 bytes, token tiles of 8 quads x 16 rows
 * (half a packed block); accumulators 0-3 as in TILES. */
static const struct tile_config TILES_K32 = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 32, 32, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 8, 8},
};

static inline void tiles_for(int64_t G) { _tile_loadconfig(G < 64 ? &TILES_K32 : &TILES); }

/* the zero points of the 64 columns from k of a row (zr: its zero points, groups of 1 << sh
 * columns), one per byte lane */
static inline __m512i zeros64(const uint8_t *zr, int64_t k, int sh) {
    if (sh > 5) return _mm512_set1_epi8((char)zr[k >> sh]);
    return _mm512_inserti64x4(_mm512_set1_epi8((char)zr[k >> 5]),
                              _mm256_set1_epi8((char)zr[(k >> 5) + 1]), 1);
}

/* nr weight rows (codes q, ldq bytes apart; ng zero points a row at zp) as int8 u - zero into
 * wb, rows K apart. quant/int4.py's layout: per 16 bytes, columns j in the low nibbles and
 * 16 + j in the high ones; so 64 bytes are 128 columns, the low and high nibbles' 16-byte runs
 * interleaved by two permutes. (Group indices by shifts: a division per step made the unpack
 * 1.6x slower, and 32-byte steps with 128-bit permutes another 1.2x.) */
static void unpack_rows(int nr, int64_t K, int64_t G, const uint8_t *q, int64_t ldq,
                        const uint8_t *zp, int64_t ng, int8_t *wb) {
    const int sh = G == 32 ? 5 : G == 64 ? 6 : 7;
    const __m512i low = _mm512_set1_epi8(0x0f);
    const __m512i first = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0); /* runs 0, 1: lo hi lo hi */
    const __m512i second = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4); /* runs 2, 3 */
    for (int r = 0; r < nr; r++) {
        const uint8_t *qr = q + r * ldq, *zr = zp + r * ng;
        int8_t *d = wb + r * K;
        int64_t k = 0;
        for (; k + 128 <= K; k += 128) {
            const __m512i b = _mm512_loadu_si512(qr + k / 2);
            const __m512i lo = _mm512_and_si512(b, low);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
            _mm512_store_si512(d + k, _mm512_sub_epi8(_mm512_permutex2var_epi64(lo, first, hi),
                                                      zeros64(zr, k, sh)));
            _mm512_store_si512(d + k + 64,
                               _mm512_sub_epi8(_mm512_permutex2var_epi64(lo, second, hi),
                                               zeros64(zr, k + 64, sh)));
        }
        if (k < K) { /* a last 64 columns: 32 bytes, runs 0 and 1 */
            const __m256i half = _mm256_loadu_si256((const __m256i *)(qr + k / 2));
            const __m512i b = _mm512_castsi256_si512(half);
            const __m512i lo = _mm512_and_si512(b, low);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
            _mm512_store_si512(d + k, _mm512_sub_epi8(_mm512_permutex2var_epi64(lo, first, hi),
                                                      zeros64(zr, k, sh)));
        }
    }
}

/* Where results go: with by_column, row m, column n at p + n * ld + m (the MoE hidden, all
 * 16 rows of a block); else at p + m * ld + n for the M live rows. Each is the sum times
 * xs[m] (the token row's scale) and rw[m] when rw is set. */
struct out4 {
    float *p;
    int64_t ld;
    const float *xs, *rw;
    int by_column;
};

/* acc[n][m] += t[n][m] * s[n * ng] for the 16 rows of a tile (s: the group's scale of its
 * first weight row); with tl (two planes), t the high bytes' sums and tl the low ones':
 * 256 t + tl (exact in int32: a group's sums are at most 128 * 128 * 15 each) */
static inline void scale_add(float *acc, const int32_t *t, const int32_t *tl, const float *s,
                             int64_t ng) {
    for (int n = 0; n < 16; n++) {
        __m512i d = _mm512_load_si512(t + 16 * n);
        if (tl) d = _mm512_add_epi32(_mm512_slli_epi32(d, 8), _mm512_load_si512(tl + 16 * n));
        const __m512 a = _mm512_load_ps(acc + 16 * n);
        _mm512_store_ps(acc + 16 * n,
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(s[n * ng]), a));
    }
}

/* the accumulators acc[n][m] of weight rows n0 .. n0 + 16 and token rows m0 .. m0 + 16 (mv of
 * them live) into the output */
static inline void emit(const float *acc, int64_t m0, int64_t mv, int64_t n0,
                        const struct out4 *o) {
    if (o->by_column) {
        const __m512 xs = _mm512_loadu_ps(o->xs + m0);
        for (int n = 0; n < 16; n++)
            _mm512_storeu_ps(o->p + (n0 + n) * o->ld + m0,
                             _mm512_mul_ps(_mm512_load_ps(acc + 16 * n), xs));
        return;
    }
    __m512 r[16];
    for (int j = 0; j < 16; j++) r[j] = _mm512_load_ps(acc + 16 * j);
    transpose16(r); /* r[m]: row m0 + m, columns n0 .. n0 + 16 */
    for (int64_t m = 0; m < mv && m < 16; m++) {
        const float s = o->rw ? o->xs[m0 + m] * o->rw[m0 + m] : o->xs[m0 + m];
        _mm512_storeu_ps(o->p + (m0 + m) * o->ld + n0, _mm512_mul_ps(r[m], _mm512_set1_ps(s)));
    }
}

/* The products of one group for a pair of token blocks (b1 unused unless two) against the
 * job's one or two weight tiles (a0, a1: the unpacked rows, K apart), into accumulators 0-3;
 * kt columns per product. */
static inline __attribute__((always_inline)) void group_k(int nr, int two, int64_t k0,
                                                          int64_t G, int kt, const int8_t *a0,
                                                          const int8_t *a1, int64_t K,
                                                          const int8_t *b0, const int8_t *b1) {
    for (int64_t k = k0; k < k0 + G; k += kt) {
        const int64_t bo = (k / 64) * QBLK + (k % 64) * 16; /* quad k / 4 of its block */
        _tile_loadd(4, a0 + k, K);
        _tile_loadd(6, b0 + bo, 64);
        _tile_dpbssd(0, 4, 6);
        if (nr == 32) {
            _tile_loadd(5, a1 + k, K);
            _tile_dpbssd(2, 5, 6);
        }
        if (two) {
            _tile_loadd(7, b1 + bo, 64);
            _tile_dpbssd(1, 4, 7);
            if (nr == 32) _tile_dpbssd(3, 5, 7);
        }
    }
}

/* Weight rows n0 .. n0 + nr (nr 16 or 32), unpacked at wb (rows K apart; their scales at sc,
 * ng a row), against the M packed token rows at xp: output columns n0 .. n0 + nr of every
 * row. One plane (lp 0): two token blocks at a time, in accumulators 0/2 and 1/3. Two planes
 * (the low bytes lp bytes after the high ones): one token block at a time, its high bytes in
 * accumulators 0/2 and its low bytes in 1/3 (the second block's places), added per group. */
static void job4(int64_t K, int64_t G, const int8_t *wb, const float *sc, int nr,
                 const int8_t *xp, int64_t lp, int64_t M, int64_t n0, const struct out4 *o) {
    const int64_t KB = K / 64, MB = (M + 15) / 16, ng = K / G;
    const int kt = G < 64 ? (int)G : 64;
    const int8_t *a0 = wb, *a1 = wb + 16 * K;
    float acc[4][256] __attribute__((aligned(64)));
    int32_t t[4][256] __attribute__((aligned(64)));
    for (int64_t mb = 0; mb < MB; mb += lp ? 1 : 2) {
        const int two = lp || mb + 1 < MB, blocks = lp ? 1 : two + 1;
        const int8_t *b0 = xp + mb * KB * QBLK, *b1 = lp ? b0 + lp : b0 + KB * QBLK;
        memset(acc, 0, sizeof(acc));
        for (int64_t g = 0; g < ng; g++) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            if (nr == 32 && two)
                group_k(32, 1, g * G, G, kt, a0, a1, K, b0, b1);
            else if (nr == 32)
                group_k(32, 0, g * G, G, kt, a0, a1, K, b0, b1);
            else if (two)
                group_k(16, 1, g * G, G, kt, a0, a1, K, b0, b1);
            else
                group_k(16, 0, g * G, G, kt, a0, a1, K, b0, b1);
            _tile_stored(0, t[0], 64);
            if (two) _tile_stored(1, t[1], 64);
            if (nr == 32) _tile_stored(2, t[2], 64);
            if (nr == 32 && two) _tile_stored(3, t[3], 64);
            scale_add(acc[0], t[0], lp ? t[1] : 0, sc + g, ng);
            if (blocks == 2) scale_add(acc[1], t[1], 0, sc + g, ng);
            if (nr == 32) scale_add(acc[2], t[2], lp ? t[3] : 0, sc + 16 * ng + g, ng);
            if (nr == 32 && blocks == 2) scale_add(acc[3], t[3], 0, sc + 16 * ng + g, ng);
        }
        const int64_t m0 = 16 * mb;
        emit(acc[0], m0, M - m0, n0, o);
        if (blocks == 2) emit(acc[1], m0 + 16, M - m0 - 16, n0, o);
        if (nr == 32) emit(acc[2], m0, M - m0, n0 + 16, o);
        if (nr == 32 && blocks == 2) emit(acc[3], m0 + 16, M - m0 - 16, n0 + 16, o);
    }
}

/* out[M, N] = the product of fp32 x[M, K] (row stride ldx) and int4 weights (codes q, ldq
 * bytes a row; scales sc and zero points zp [N, K / G]); fp32 out (ldo): the rows on their
 * int8 grids (w4a8_int8), or with rows16 in 16-bit fixed point on two planes (int4's
 * numerics). The argument list of int4.c's few-row GEMM, whose isa argument is rows16 here
 * (ops/linear.py: BoundLinear binds either). Jobs are 32 weight rows, an equal run of them
 * per thread. Returns 0, or -1 when a workspace cannot be allocated. */
int moeserve_amx_i4_gemm_nt(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx,
                            const uint8_t *q, int64_t ldq, const float *sc, const uint8_t *zp,
                            int64_t G, float *out, int64_t ldo, int rows16) {
    const int64_t J = (N + 31) / 32, ng = K / G;
    int64_t lp;
    float *xs;
    int8_t *xp = packed_rows_alloc(M, K, rows16 ? 2 : 1, &lp, &xs);
    if (!xp) return -1;
    int failed = 0;
    const int par = J > 1 && (N * K >= 65536 || M * N * K >= (1 << 22));
#pragma omp parallel if (par)
    {
        pack_rows_blocks(M, K, x, ldx, xp, lp, xs);
        int8_t *wb = thread_scratch(0, (size_t)32 * K); /* the unpacked rows */
        if (!wb) {
#pragma omp atomic write
            failed = 1;
        } else {
            tiles_for(G);
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();
            const int64_t lo = J * t / nt, hi = J * (t + 1) / nt;
            const struct out4 o = {out, ldo, xs, 0, 0};
            for (int64_t j = lo; j < hi; j++) {
                const int nr = N - 32 * j >= 32 ? 32 : 16;
                unpack_rows(nr, K, G, q + 32 * j * ldq, ldq, zp + 32 * j * ng, ng, wb);
                job4(K, G, wb, sc + 32 * j * ng, nr, xp, lp, M, 32 * j, &o);
            }
            _tile_release();
        }
    }
    free(xp);
    return failed ? -1 : 0;
}

/* The routed experts of an MoE layer for rows sorted by expert: group g is rows start[g] ..
 * start[g] + count[g] of x [R, D] (fp32), for expert expert[g] of the int4 w13 [E, 2F, D]
 * (gate rows then up rows: codes q13, scales s13 and zero points z13 [E, 2F, D / G]) and
 * w2 [E, D, F] (q2, s2, z2 [E, D, F / G]), one group size G; y[r] = weight[r] * w2 . (silu(gate)
 * * up) (fp32), the rows of x and the hidden each quantized per row (to int8, or with
 * rows16 to 16-bit fixed point on two planes, as the GEMM). Workspaces for P =
 * sum_g ceil(count[g] / 16) * 16 rows: xp [planes, P, D] and hp [planes, P, F] int8 (64-byte
 * aligned; planes 2 with rows16, else 1), xs and hs [P] fp32, h [P, 2F] fp32 (by column per
 * group: the group's 2F columns of its padded rows). Returns 0, or -1 when a thread's unpack
 * buffer cannot be allocated (y then incomplete). */
int moeserve_amx_i4_moe(int64_t G, const int64_t *expert, const int64_t *start,
                        const int64_t *count, int64_t D, int64_t F, const float *x,
                        const uint8_t *q13, const float *s13, const uint8_t *z13,
                        const uint8_t *q2, const float *s2, const uint8_t *z2, int64_t group,
                        const float *weight, float *y, int8_t *xp, float *xs, float *h,
                        int8_t *hp, float *hs, int rows16) {
    int64_t first_block[G > 0 ? G : 1]; /* packed 16-row blocks before each group */
    const int64_t P = 16 * group_blocks(G, count, first_block);
    const int64_t lpx = rows16 ? P * D : 0, lph = rows16 ? P * F : 0; /* the low planes */
    const int64_t J13 = 2 * F / 32, J2 = D / 32, ng13 = D / group, ng2 = F / group;
    int failed = 0;
#pragma omp parallel
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int8_t *wb = thread_scratch(0, (size_t)32 * (D > F ? D : F)); /* unpacked rows */
        if (!wb) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t g = 0; g < G; g++)
            pack_rows_q(count[g], D, x + start[g] * D, D, xp + first_block[g] * 16 * D, lpx,
                        xs + first_block[g] * 16);
        if (wb) {
            tiles_for(group);
            int64_t lo, hi;
            job_share(G, count, J13, t, nt, &lo, &hi);
            for (int64_t i = lo; i < hi; i++) {
                const int64_t g = i / J13, j = i % J13, pad = (count[g] + 15) / 16 * 16;
                const int64_t row = expert[g] * 2 * F + 32 * j;
                const struct out4 o = {h + first_block[g] * 16 * 2 * F, pad,
                                       xs + 16 * first_block[g], 0, 1};
                unpack_rows(32, D, group, q13 + row * (D / 2), D / 2, z13 + row * ng13, ng13, wb);
                job4(D, group, wb, s13 + row * ng13, 32, xp + first_block[g] * 16 * D, lpx,
                     count[g], 32 * j, &o);
            }
        }
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
        for (int64_t g = 0; g < G; g++) {
            const int64_t pad = (count[g] + 15) / 16 * 16, b0 = first_block[g];
            for (int64_t mb = 0; mb < pad / 16; mb++)
                activate_pack(F, (int32_t *)(h + b0 * 16 * 2 * F + 16 * mb), pad, 0, 0,
                              hp + (b0 + mb) * 16 * F, lph, hs + 16 * (b0 + mb));
        }
        if (wb) {
            int64_t lo, hi;
            job_share(G, count, J2, t, nt, &lo, &hi);
            for (int64_t i = lo; i < hi; i++) {
                const int64_t g = i / J2, j = i % J2, row = expert[g] * D + 32 * j;
                const struct out4 o = {y + start[g] * D, D, hs + 16 * first_block[g],
                                       weight + start[g], 0};
                unpack_rows(32, F, group, q2 + row * (F / 2), F / 2, z2 + row * ng2, ng2, wb);
                job4(F, group, wb, s2 + row * ng2, 32, hp + first_block[g] * 16 * F, lph,
                     count[g], 32 * j, &o);
            }
            _tile_release();
        }
    }
    return failed ? -1 : 0;
}

#pragma GCC pop_options
