/* int4 GEMMs and MoE calls on integer dot products of bytes, for int4.c: vpdpbusd on AVX-512
 * VNNI, vpmaddubsw + vpmaddwd on AVX2.
 *
 * The token rows are rounded once per call to 16-bit fixed point, one scale per row, and
 * each element split into two signed bytes:
 *
 *   c[i] = max_k |x[i, k]| / XMAX,   xi[i, k] = round(x[i, k] / c[i]),   |xi| <= XMAX = 32639
 *   xi = xh * 256 + xl                                   (xh, xl in [-128, 127])
 *
 * A weight row's codes u (unsigned bytes once the nibbles are split) are dotted with both
 * byte planes (exact int32 sums):
 *
 *   y[i, n] = c[i] * (sum_g s[n, g] * sum_{k in g} u[n, k] xi[i, k]
 *                     - sum_g s[n, g] z[n, g] xs[i, g])
 *
 * with the group sums xs[i, g] = sum_{k in g} xi[i, k]; the second sum is taken once per row
 * pair, after the dot. Per 128 columns, weight row and token row, AVX-512 VNNI takes 4
 * vpdpbusd (64 products each), a shift, a conversion and an FMA by the group's scale (one
 * lane vector of scales: a broadcast at group 128, a permute of 2 or 4 at 64 and 32), and per
 * 128 columns and weight row one load and three ops to split the nibbles; the lookup form of
 * int4.c takes 8 FMAs and 8 lookups per 128 columns and row. AVX2 takes, per 64 columns, 4
 * vpmaddubsw (pairs of byte products into int16: at most 2 * 15 * 128, and the two nibble
 * halves added: 7680), 2 vpmaddwd (the planes weighted 256 and 1 into int32) and an add:
 * ~2.3x fewer instructions than its FMA form, which dequantizes every 8 weights.
 *
 * Numerics: each lane's sum is exact (at most 8 products of 15 * 32639 a block); the result
 * is the reference's on x rounded per row to 2^-16 of its largest |x| (round_rows_ref in
 * ops/cpu/int4.py reproduces it): for Gaussian rows an error of ~3e-5 of a typical output
 * (rms), ~1e-4 at the tails of many. That is finer than bf16 or fp16 activations (what w4a16
 * GPU kernels take) and far below int4's own rounding of the weights (~10% of each weight).
 * A third plane (24 bits, fp32's precision: XMAX 8355711) was as fast at one token row on
 * AVX-512, where the memory bounds it, and 1.4x slower from 4 rows (slower than the lookup
 * form), so the kernels take two.
 *
 * Measured (2 threads, Zen 5 EPYC VM, 32000 x 1024 from memory, group 128; the memory gave
 * int8 0.70-0.75 ms a call in that hour), AVX-512 VNNI: one token row 0.34 ms (52 GB/s)
 * against the lookup form's 0.36-0.40, and 2/4/16 rows 1.2-1.4x it; group 32 1.35x at one
 * row. That was one weight row at a time at one token row; four at a time (then with one
 * prefetch 16 KB ahead) gave 0.43 ms there. In cache (256 x 4096, one thread): 80
 * Gweights/s against 53 at one row, 138 against 109 at four. AVX2: see int4.c's header.
 *
 * One token row now runs idot_row1, four weight rows at a time: on the Xeon host (AMX, 2
 * threads) the row-at-a-time form was bound by its instructions, not the memory: the
 * benchmark model's MoE call took 182 us with its weights in L3 and 187 from memory, and one
 * thread read 15 GB/s of 256-byte rows from L2, where a bare loop of the same dots runs at
 * 32. idot_row1: 1.4x in L2, the MoE call 230 -> 193 us in the engine, the int4 decode step
 * 1.125x (benchmarks/kernel_ab.py). Not measured again on the Zen 5 host.
 *
 * The code layout is int4.c's: 128 columns are 64 bytes of a row, four runs of 32 columns
 * with run j's columns 0..15 in the low nibbles of its 16 bytes and 16..31 in the high ones.
 * So the rounded token rows are stored per block of 128 columns in the same order: plane p
 * (0: xh, 1: xl) as 64 bytes of the low-nibble columns, then 64 of the high ones (AVX2 reads
 * each half of a block as one step of 64 columns); a row is XP * 128 * ceil(K / 128) bytes, a
 * last partial block padded with zero bytes.
 *
 * Included once by int4.c, after its AVX-512F body (hsum4_512, PANEL, DISPATCH_G,
 * DISPATCH_FEW, prefetch_groups); the body below is compiled twice (this file includes
 * itself): AVX2 (the baseline flags) and AVX-512 VNNI (`#pragma GCC target`), as
 * gemm_idot_avx2 / gemm_idot_vnni and moe_idot_*.
 */
#ifndef IDOT_BODY
#define XP 2        /* byte planes of a rounded token row */
#define XMAX 32639  /* 127 * (1 + 256): every byte digit in [-128, 127] */
#define XBLOCK (XP * 128) /* bytes of a rounded row per 128 columns */
#define XROW_BYTES(K) (XBLOCK * (((K) + 127) / 128))
#define XS_LD(ng) (((ng) + 7) / 8 * 8) /* group sums a rounded row, zero-padded to 8 */
/* Bytes ahead on each weight row: a prefetch into L1 IPREFETCH ahead and one into L2
 * IPREFETCH_FAR ahead, per 64 bytes of codes. A decode step streams many short weights (a
 * projection of the benchmark model is 200-550 KB, a thread's share half that): the one
 * prefetch 16384 ahead (the best on one long 32000 x 1024 weight) left the first 16 KB of
 * each to the hardware and its loads stalled on memory (perf: a third of the panel's time
 * on the load of the codes). Measured in the engine (benchmark model, decode at batch 1, 2
 * threads, Xeon with AMX; one process, 10 alternating rounds): one prefetch at 4096 1.02x
 * the one at 16384, then L1 at 2048 with L2 at 8192 1.11x that (L1 1024-4096 with L2
 * 4096-16384 within 2%). */
#define IPREFETCH 2048
#define IPREFETCH_FAR 8192

static inline float hmax256(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline int32_t hsum256_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
}

/* the 16 int32 lanes of a and b (each in [-128, 127]) as 16 bytes a0..a7 b0..b7 */
static inline __m128i bytes16(__m256i a, __m256i b) {
    const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), _MM_SHUFFLE(3, 1, 2, 0));
    return _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
}

/* Row x (K fp32, K a multiple of 32) rounded into xq (XROW_BYTES(K) bytes, 64-byte aligned),
 * its scale into *c and its group sums (K / G of them, then zeros to XS_LD) into xs. A row
 * with a nan or an inf gets c nan, so its outputs are nan as the reference's are; a zero row
 * gets c 0. With grid8 (w4a8_int8) the row is first rounded to its int8 grid as
 * int8_amx.quantize_rows_ref rounds it (xq8 = round(x * (127 / max)), s = max / 127), which
 * the 16-bit form holds exactly: xi = 257 xq8, c = s / 257. AVX2 for both bodies: once per
 * token row, a small share of a call. */
static void idot_round_row(int64_t K, int64_t G, const float *x, int8_t *xq, float *c,
                           float *xs, int grid8) {
    for (int64_t g = K / G; g < XS_LD(K / G); g++) xs[g] = 0.0f; /* the padding */
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    int bad = 0;
    for (int64_t k = 0; k < K; k += 8) {
        const __m256 v = _mm256_loadu_ps(x + k);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v));
        const __m256 inf_nan = _mm256_sub_ps(v, v); /* 0 for a finite v */
        bad |= _mm256_movemask_ps(_mm256_cmp_ps(inf_nan, _mm256_setzero_ps(), _CMP_NEQ_UQ));
    }
    const float amax = hmax256(m), top = grid8 ? 127.0f : (float)XMAX;
    *c = bad ? NAN : grid8 ? amax / 127.0f / 257.0f : amax / (float)XMAX;
    const __m256 inv = _mm256_set1_ps(amax > 0.0f && !bad ? top / amax : 0.0f);
    const __m256i hi = _mm256_set1_epi32((int)top), lo = _mm256_set1_epi32(-(int)top);
    const __m256i step = _mm256_set1_epi32(grid8 ? 257 : 1);
    __m256i sum = _mm256_setzero_si256(); /* the current group's xi, exact in int32 */
    for (int64_t col = 0; col < XROW_BYTES(K) / XP; col += 16) {
        __m256i xi[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}; /* past K: zeros */
        if (col < K) {
            for (int j = 0; j < 2; j++) {
                const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + col + 8 * j), inv);
                xi[j] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(v), hi), lo);
                xi[j] = _mm256_mullo_epi32(xi[j], step);
                sum = _mm256_add_epi32(sum, xi[j]);
            }
            if ((col + 16) % G == 0) {
                xs[col / G] = (float)hsum256_epi32(sum);
                sum = _mm256_setzero_si256();
            }
        }
        /* the digits of xi in base 256, each in [-128, 127], lowest first: d = the low byte
         * sign-extended, xi = (xi - d) / 256; plane XP - 1 holds the lowest */
        int8_t *at = xq + col / 128 * XBLOCK + (col % 32) / 16 * 64 + (col % 128) / 32 * 16;
        for (int p = XP - 1; p >= 0; p--) {
            __m256i d[2];
            for (int j = 0; j < 2; j++) {
                d[j] = _mm256_srai_epi32(_mm256_slli_epi32(xi[j], 24), 24);
                xi[j] = _mm256_srai_epi32(_mm256_sub_epi32(xi[j], d[j]), 8);
            }
            _mm_store_si128((__m128i *)(at + p * 128), bytes16(d[0], d[1]));
        }
    }
}

/* The rounded rows of a call: M rows of K columns with groups of G, one allocation; grid8:
 * each row on its int8 grid first (idot_round_row). */
struct idot_rows {
    int8_t *xq;
    float *c, *xs;
    int64_t K, G;
    int grid8;
};

/* r's rows in the calling thread's scratch `slot`; -1 when it cannot be had */
static int idot_alloc(int64_t M, int64_t K, int64_t G, int slot, int grid8,
                      struct idot_rows *t) {
    t->K = K;
    t->G = G;
    t->grid8 = grid8;
    const size_t q = (size_t)M * XROW_BYTES(K);
    const size_t cs = (size_t)M * (1 + XS_LD(K / G)) * sizeof(float);
    t->xq = thread_scratch(slot, q + cs);
    if (!t->xq) return -1;
    t->c = (float *)(t->xq + q);
    t->xs = t->c + M;
    return 0;
}

/* x (the rows' K columns) rounded into row i of r (r->xq + i * XROW_BYTES(K), r->c[i],
 * r->xs + i * XS_LD(K / G)); as common.h's round_group_rows takes it */
static void idot_round_any(const void *r, int64_t i, const float *x) {
    const struct idot_rows *t = r;
    idot_round_row(t->K, t->G, x, t->xq + i * XROW_BYTES(t->K), t->c + i,
                   t->xs + i * XS_LD(t->K / t->G), t->grid8);
}

/* the int4 weights of an MoE call (common.h's moe_rounded ctx) */
struct idot_moe {
    const int64_t *expert;
    const uint8_t *q13;
    const float *s13;
    const uint8_t *z13, *q2;
    const float *s2;
    const uint8_t *z2;
    int64_t G;
};

/* Rows [lo, hi) of x (row stride ldx) rounded into r */
static void idot_round_rows(int64_t lo, int64_t hi, const float *x, int64_t ldx,
                            const struct idot_rows *r) {
    for (int64_t i = lo; i < hi; i++) idot_round_any(r, i, x + i * ldx);
}

/* ---- AVX2: 8 lanes, a step of 64 columns (32 code bytes), half a block ---- */
#define IDOT_BODY
#define ISFX _avx2
#define CB 32  /* code bytes a step */
#define INQ 1 /* weight rows at a time (2 with blocks of 3 rows: 1.1-1.2x slower at 2-16 rows) */
#define INB 4 /* token rows per block (3 and 6: 1.1x and 1.2x slower at 4-16 rows) */
typedef __m256 if_avx2;
typedef __m256i ii_avx2;
#define IF if_avx2
#define II ii_avx2
#define IFZERO() _mm256_setzero_ps()
#define IFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define ICVT(d) _mm256_cvtepi32_ps(d)
#define ISUB(a, b) _mm256_sub_ps(a, b)
/* sum_g zr[g] * xs[g] over ng groups in the lanes of a vector (xs zero-padded to 8) */
static inline __m256 izdot_avx2(const float *zr, const float *xs, int64_t ng) {
    __m256 t = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= ng; g += 8)
        t = _mm256_fmadd_ps(_mm256_loadu_ps(zr + g), _mm256_loadu_ps(xs + g), t);
    if (g < ng) { /* the last 1-7: zr's past ng masked off, xs's are zero anyway */
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(ng - g)), lane);
        t = _mm256_fmadd_ps(_mm256_maskload_ps(zr + g, m), _mm256_loadu_ps(xs + g), t);
    }
    return t;
}
#define IZDOT(zr, xs, ng) izdot_avx2(zr, xs, ng)
#define IHSUM(v) hsum256(v)
#define ILOADX(p) _mm256_load_si256((const __m256i *)(p))
#define ILOADU(p) _mm256_loadu_si256((const __m256i *)(p))
#define IAND(a, b) _mm256_and_si256(a, b)
#define ISRL4(a) _mm256_srli_epi32(a, 4)
#define INIB() _mm256_set1_epi8(15)
/* the step's n (32 or 16) code bytes, zero after */
#define ICODES(p, n)                                           \
    ((n) == 32 ? _mm256_loadu_si256((const __m256i *)(p))      \
               : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(p))))
/* the two planes' dot of the low (ul) and high (uh) nibbles with the step's token bytes
 * (xh of the low-nibble columns, of the high ones, then xl's: at xb, xb + 64, xb + 128 and
 * xb + 192 of a rounded row), as 8 int32 lanes */
static inline __m256i idot2_avx2(__m256i ul, __m256i uh, __m256i hl, __m256i hh, __m256i ll,
                                 __m256i lh) {
    const __m256i h = _mm256_add_epi16(_mm256_maddubs_epi16(ul, hl), _mm256_maddubs_epi16(uh, hh));
    const __m256i l = _mm256_add_epi16(_mm256_maddubs_epi16(ul, ll), _mm256_maddubs_epi16(uh, lh));
    return _mm256_add_epi32(_mm256_madd_epi16(h, _mm256_set1_epi16(256)),
                            _mm256_madd_epi16(l, _mm256_set1_epi16(1)));
}
#define IDOT2(ul, uh, hl, hh, ll, lh) idot2_avx2(ul, uh, hl, hh, ll, lh)
/* the scales of weight row sr's groups over the step's columns c0.. (64; lanes 4j..4j+3 hold
 * run j's), never past its ng */
static inline __attribute__((always_inline)) __m256 iscales_avx2(const int G, const float *sr,
                                                                 int64_t c0, int64_t ng) {
    const int64_t g = c0 / G;
    if (G >= 64 || g + 1 >= ng) return _mm256_set1_ps(sr[g]);
    return _mm256_setr_m128(_mm_set1_ps(sr[g]), _mm_set1_ps(sr[g + 1]));
}
#define ISCALES(G, sr, c0, ng) iscales_avx2(G, sr, c0, ng)
#include "int4_idot.h" /* this file: its body, for this ISA (it undefines the macros above) */

/* ---- AVX-512 VNNI: 16 lanes, a step of a whole block (128 columns, 64 code bytes) ---- */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
#define ISFX _vnni
#define CB 64
#define INQ 4 /* weight rows at a time, from two token rows (one: idot_row1, four too) */
#define INB 4 /* token rows per block: 16 accumulators, 8 code and 4 scale vectors of 32 */
typedef __m512 if_vnni;
typedef __m512i ii_vnni;
#define IF if_vnni
#define II ii_vnni
#define IFZERO() _mm512_setzero_ps()
#define IFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define ICVT(d) _mm512_cvtepi32_ps(d)
#define ISUB(a, b) _mm512_sub_ps(a, b)
static inline __m512 izdot_vnni(const float *zr, const float *xs, int64_t ng) {
    __m512 t = _mm512_setzero_ps();
    int64_t g = 0;
    for (; g + 16 <= ng; g += 16)
        t = _mm512_fmadd_ps(_mm512_loadu_ps(zr + g), _mm512_loadu_ps(xs + g), t);
    if (g < ng) {
        const __mmask16 m = (__mmask16)((1u << (ng - g)) - 1u);
        t = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, zr + g), _mm512_maskz_loadu_ps(m, xs + g), t);
    }
    return t;
}
#define IZDOT(zr, xs, ng) izdot_vnni(zr, xs, ng)
#define IHSUM(v) _mm512_reduce_add_ps(v)
#define IHSUM4(a, b, c, d) hsum4_512(a, b, c, d)
#define ILOADX(p) _mm512_load_si512(p)
#define ILOADU(p) _mm512_loadu_si512(p)
#define IAND(a, b) _mm512_and_si512(a, b)
#define ISRL4(a) _mm512_srli_epi32(a, 4)
#define INIB() _mm512_set1_epi8(15)
#define ICODES(p, n) \
    _mm512_maskz_loadu_epi8((n) == 64 ? ~(__mmask64)0 : (((__mmask64)1 << (n)) - 1), p)
static inline __m512i idot2_vnni(__m512i ul, __m512i uh, __m512i hl, __m512i hh, __m512i ll,
                                 __m512i lh) {
    __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ul, hl);
    d = _mm512_dpbusd_epi32(d, uh, hh);
    d = _mm512_slli_epi32(d, 8);
    d = _mm512_dpbusd_epi32(d, ul, ll);
    return _mm512_dpbusd_epi32(d, uh, lh);
}
#define IDOT2(ul, uh, hl, hh, ll, lh) idot2_vnni(ul, uh, hl, hh, ll, lh)
/* the scales of weight row sr's groups over the block's columns c0.. (128): lane l holds the
 * dot of bytes 4l..4l+3, columns of run l / 4, so group (c0 + 32 (l / 4)) / G. Masked loads:
 * never past the row's ng scales (a missing group's lanes 0: their codes are zero). */
static inline __attribute__((always_inline)) __m512 iscales_vnni(const int G, const float *sr,
                                                                 int64_t c0, int64_t ng) {
    if (G == 128) return _mm512_set1_ps(sr[c0 / G]);
    const int per = 128 / G; /* groups per block */
    const int64_t g0 = c0 / G, left = ng - g0 < per ? ng - g0 : per;
    const __m512 v = _mm512_maskz_loadu_ps((__mmask16)((1u << left) - 1u), sr + g0);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    /* group of lane l within the block: l / (16 / per) = (l * per) >> 4 */
    const __m512i group = _mm512_srli_epi32(_mm512_mullo_epi32(lane, _mm512_set1_epi32(per)), 4);
    return _mm512_permutexvar_ps(group, v);
}
#define ISCALES(G, sr, c0, ng) iscales_vnni(G, sr, c0, ng)
#include "int4_idot.h" /* this file: its body, for this ISA */
#pragma GCC pop_options

#else /* IDOT_BODY: the kernels for one ISA, named with the suffix ISFX */

#define ICAT_(a, b) a##b
#define ICAT(a, b) ICAT_(a, b)
#define STEP (2 * CB) /* columns a step: 64 (AVX2) or 128 */

/* Token rows 0..mb-1 (rounded: xq, c, xs; XROW_BYTES(K) bytes and XS_LD(K / G) sums a row)
 * against the nq (<= NR: 1 or INQ) weight rows q + r * ldq with their scales s + r * ng and
 * s * zero sz + r * ng; y[i * ldy + r] = dot. */
static inline __attribute__((always_inline)) void ICAT(idot_block, ISFX)(
    const int mb, const int G, const int NR, const int nq, int64_t K, const int8_t *xq,
    const float *c, const float *xs, const uint8_t *q, int64_t ldq, const float *s,
    const float *sz, float *y, int64_t ldy) {
    const int64_t ng = K / G, xrow = XROW_BYTES(K), ld = XS_LD(ng);
    const uint8_t *qr[INQ];
    const float *sr[INQ], *zr[INQ];
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        const int64_t rr = r < nq ? r : 0; /* rows past nq: row 0 again, not stored */
        qr[r] = q + rr * ldq;
        sr[r] = s + rr * ng;
        zr[r] = sz + rr * ng;
    }
    IF a[INQ][INB];
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
        for (int i = 0; i < INB; i++) a[r][i] = IFZERO();
    const II low = INIB();
    for (int64_t c0 = 0; c0 < K; c0 += STEP) {
        /* the last step of a K that is not a multiple of STEP: its runs, zero bytes after */
        const int n = K - c0 >= STEP ? CB : (int)(K - c0) / 2;
        const int8_t *xb = xq + c0 / 128 * XBLOCK + (c0 % 128) / 2;
        II ul[INQ], uh[INQ];
        IF sv[INQ];
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const II codes = ICODES(qr[r] + c0 / 2, n);
            if ((c0 & 127) == 0) {
                PREFETCH_T0(qr[r] + c0 / 2 + IPREFETCH);
                PREFETCH_T1(qr[r] + c0 / 2 + IPREFETCH_FAR);
            }
            ul[r] = IAND(codes, low);
            uh[r] = IAND(ISRL4(codes), low);
            sv[r] = ISCALES(G, sr[r], c0, ng);
        }
        /* each token row's four byte vectors loaded once for the NR weight rows */
#pragma GCC unroll 4
        for (int i = 0; i < INB; i++) {
            if (i >= mb) continue;
            const int8_t *xi = xb + i * xrow;
            const II x0 = ILOADX(xi), x1 = ILOADX(xi + 64), x2 = ILOADX(xi + 128);
            const II x3 = ILOADX(xi + 192);
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++)
                a[r][i] = IFMA(ICVT(IDOT2(ul[r], uh[r], x0, x1, x2, x3)), sv[r], a[r][i]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < INB; i++) {
        if (i >= mb) continue;
        /* less the zero points' share, sum_g s z xs, taken into the lanes */
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) a[r][i] = ISUB(a[r][i], IZDOT(zr[r], xs + i * ld, ng));
        float d[4];
#if INQ == 4
        if (NR == 4) {
            _mm_storeu_ps(d, IHSUM4(a[0][i], a[1][i], a[2][i], a[3][i]));
        } else
#endif
        {
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) d[r] = IHSUM(a[r][i]);
        }
        for (int r = 0; r < nq; r++) y[i * ldy + r] = c[i] * d[r];
    }
}

/* One rounded token row (xq, its scale c and group sums xs) against `rows` weight rows
 * q + r * ldq (scales s + r * ng, s * zero sz + r * ng), four at a time: each step's token
 * vectors loaded once for the four, whole steps' codes loaded without a mask, one reduction
 * for the four where the ISA has it (IHSUM4); y[r] = dot. A quad past `rows` repeats row 0
 * of the quad, not stored. In cache ~1.4x the rows one at a time (idot_block with one row:
 * its accumulators, pointers and reduction per row). */
static inline __attribute__((always_inline)) void ICAT(idot_row1, ISFX)(
    const int G, int64_t K, const int8_t *xq, float c, const float *xs, const uint8_t *q,
    int64_t ldq, const float *s, const float *sz, int64_t rows, float *y) {
    const int64_t ng = K / G, whole = K / STEP * STEP;
    const II low = INIB();
    for (int64_t r = 0; r < rows; r += 4) {
        const int nq = rows - r < 4 ? (int)(rows - r) : 4;
        const uint8_t *qr[4];
        const float *sr[4], *zr[4];
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            const int64_t rr = r + (k < nq ? k : 0);
            qr[k] = q + rr * ldq;
            sr[k] = s + rr * ng;
            zr[k] = sz + rr * ng;
        }
        IF a[4] = {IFZERO(), IFZERO(), IFZERO(), IFZERO()};
        for (int64_t c0 = 0; c0 < K; c0 += STEP) {
            const int n = c0 < whole ? CB : (int)(K - c0) / 2;
            const int8_t *xb = xq + c0 / 128 * XBLOCK + (c0 % 128) / 2;
            const II x0 = ILOADX(xb), x1 = ILOADX(xb + 64), x2 = ILOADX(xb + 128);
            const II x3 = ILOADX(xb + 192);
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const II codes = n == CB ? ILOADU(qr[k] + c0 / 2) : ICODES(qr[k] + c0 / 2, n);
                if ((c0 & 127) == 0) {
                    PREFETCH_T0(qr[k] + c0 / 2 + IPREFETCH);
                    PREFETCH_T1(qr[k] + c0 / 2 + IPREFETCH_FAR);
                }
                const II ul = IAND(codes, low), uh = IAND(ISRL4(codes), low);
                const IF d = ICVT(IDOT2(ul, uh, x0, x1, x2, x3));
                a[k] = IFMA(d, ISCALES(G, sr[k], c0, ng), a[k]);
            }
        }
        float d[4];
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) a[k] = ISUB(a[k], IZDOT(zr[k], xs, ng));
#ifdef IHSUM4
        _mm_storeu_ps(d, IHSUM4(a[0], a[1], a[2], a[3]));
#else
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) d[k] = IHSUM(a[k]);
#endif
        for (int k = 0; k < nq; k++) y[r + k] = c * d[k];
    }
}

/* All M rounded token rows against a panel of `rows` (<= PANEL) weight rows q + r * ldq with
 * their groups' scales and zero points at scale + r * K / G, zero + ... (zero NULL: every
 * zero point 8, int4.c's ISA_ZERO8); y[i, r]. */
static void ICAT(idot_panel, ISFX)(int64_t M, int64_t K, const int8_t *xq, const float *c,
                                   const float *xs, const uint8_t *q, int64_t ldq,
                                   const float *scale, const uint8_t *zero, int64_t G,
                                   int64_t rows, float *y, int64_t ldy) {
    const int64_t ng = K / G, xrow = XROW_BYTES(K);
    prefetch_groups(scale + SCALE_AHEAD * ng, zero ? zero + SCALE_AHEAD * ng : NULL, PANEL * ng);
    float sz[PANEL * ng]; /* s * z of the panel's rows */
    if (zero)
        for (int64_t j = 0; j < rows * ng; j++) sz[j] = scale[j] * (float)zero[j];
    else /* every zero point 8 (ISA_ZERO8) */
        for (int64_t j = 0; j < rows * ng; j++) sz[j] = scale[j] * 8.0f;
    if (M == 1) {
#define CALL_1(n, GC) ICAT(idot_row1, ISFX)(GC, K, xq, c[0], xs, q, ldq, scale, sz, rows, y)
        DISPATCH_G(G, 1, CALL_1);
#undef CALL_1
        return;
    }
    /* INQ weight rows at a time, each token vector feeding INQ products */
    const int64_t nb = (M + INB - 1) / INB;
    for (int64_t r = 0; r < rows; r += INQ) {
        const int nq = rows - r < INQ ? (int)(rows - r) : INQ;
        for (int64_t b = 0, m0 = 0; b < nb; b++) {
            const int64_t mb = (M - m0 + nb - b - 1) / (nb - b); /* near-equal blocks */
#define CALL_I(n, GC)                                                                       \
    ICAT(idot_block, ISFX)(n, GC, INQ, nq, K, xq + m0 * xrow, c + m0, xs + m0 * XS_LD(ng),    \
                           q + r * ldq, ldq, scale + r * ng, sz + r * ng, y + m0 * ldy + r, \
                           ldy)
#define CALL_IG(n) DISPATCH_G(G, n, CALL_I)
            DISPATCH_FEW(mb, INB, CALL_IG)
#undef CALL_IG
#undef CALL_I
            m0 += mb;
        }
    }
}

/* y = x @ w^T for M token rows on the integer dots: the rows rounded once (split among the
 * threads; grid8: to their int8 grids first), then the threads share out panels of PANEL
 * weight rows (zero NULL: every zero point 8). -1 when the scratch cannot be allocated
 * (nothing computed). */
static int ICAT(gemm_idot, ISFX)(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx,
                                 const uint8_t *q, int64_t ldq, const float *scale,
                                 const uint8_t *zero, int64_t G, float *y, int64_t ldy,
                                 int grid8) {
    struct idot_rows t;
    if (idot_alloc(M, K, G, 0, grid8, &t)) return -1;
    const int64_t panels = (N + PANEL - 1) / PANEL, ng = K / G;
    const int ns = omp_get_max_threads();
    struct job_slot s[ns]; /* the panels, stolen as common.h's jobs_next says */
    jobs_share(s, ns, panels);
    /* a few rows are rounded before the threads start, more by the threads (then a barrier) */
    const int alone = M * K <= 16384;
    if (alone) idot_round_rows(0, M, x, ldx, &t);
#pragma omp parallel if (N * K >= 65536)
    {
        const int th = omp_get_thread_num();
        if (!alone) {
            const int nt = omp_get_num_threads();
            idot_round_rows(M * th / nt, M * (th + 1) / nt, x, ldx, &t);
#pragma omp barrier
        }
        for (int64_t p; (p = jobs_next(s, th, ns)) >= 0;) {
            const int64_t n0 = p * PANEL, rows = N - n0 < PANEL ? N - n0 : PANEL;
            ICAT(idot_panel, ISFX)(M, K, t.xq, t.c, t.xs, q + n0 * ldq, ldq, scale + n0 * ng,
                                   zero ? zero + n0 * ng : NULL, G, rows, y + n0, ldy);
        }
    }
    return 0;
}

/* the gate/up rows n0 .. n0 + nr of group g's expert (moe_rounded's up; its ctx an
 * idot_moe) */
static void ICAT(idot_moe_up, ISFX)(const struct moe_rounded *c, int64_t g, int64_t n0,
                                    int64_t nr) {
    const struct idot_moe *m = c->ctx;
    const struct idot_rows *r = c->rx;
    const int64_t D = c->D, F = c->F, ng = D / m->G, j = c->start[g];
    const int64_t row = m->expert[g] * 2 * F + n0;
    ICAT(idot_panel, ISFX)(c->count[g], D, r->xq + j * XROW_BYTES(D), r->c + j,
                           r->xs + j * XS_LD(ng), m->q13 + row * (D / 2), D / 2,
                           m->s13 + row * ng, m->z13 ? m->z13 + row * ng : NULL, m->G, nr,
                           c->h + j * 2 * F + n0, 2 * F);
}

/* the down rows n0 .. n0 + nr of group g's expert (moe_rounded's down) */
static void ICAT(idot_moe_down, ISFX)(const struct moe_rounded *c, int64_t g, int64_t n0,
                                      int64_t nr) {
    const struct idot_moe *m = c->ctx;
    const struct idot_rows *r = c->rh;
    const int64_t D = c->D, F = c->F, ng = F / m->G, j = c->start[g];
    const int64_t row = m->expert[g] * D + n0;
    ICAT(idot_panel, ISFX)(c->count[g], F, r->xq + j * XROW_BYTES(F), r->c + j,
                           r->xs + j * XS_LD(ng), m->q2 + row * (F / 2), F / 2,
                           m->s2 + row * ng, m->z2 ? m->z2 + row * ng : NULL, m->G, nr,
                           c->y + j * D + n0, D);
}

/* int4.c's moe body on the integer dots (common.h's moe_rounded_run in panels): the groups'
 * rows rounded once, the hidden after its activation too (grid8: the rows and the hidden on
 * their int8 grids first; z13 and z2 NULL: every zero point 8). -1 when the scratch cannot
 * be allocated (nothing computed). */
static int ICAT(moe_idot, ISFX)(int64_t n_groups, const int64_t *expert, const int64_t *start,
                                const int64_t *count, int64_t D, int64_t F, const float *x,
                                const uint8_t *q13, const float *s13, const uint8_t *z13,
                                const uint8_t *q2, const float *s2, const uint8_t *z2, int64_t G,
                                const float *route_w, float *h, float *y, int grid8) {
    int64_t R = 0;
    for (int64_t g = 0; g < n_groups; g++)
        R = start[g] + count[g] > R ? start[g] + count[g] : R;
    struct idot_rows rx, rh;
    if (idot_alloc(R, D, G, 0, grid8, &rx) || idot_alloc(R, F, G, 1, grid8, &rh)) return -1;
    const struct idot_moe m = {expert, q13, s13, z13, q2, s2, z2, G};
    const struct moe_rounded c = {n_groups, start, count, D, F, PANEL, x, route_w, h, y,
                                  idot_round_any, &rx, &rh, ICAT(idot_moe_up, ISFX),
                                  ICAT(idot_moe_down, ISFX), &m};
    moe_rounded_run(&c);
    return 0;
}

#undef STEP
/* the including ISA's macros, so that the next ISA defines its own */
#undef ISFX
#undef CB
#undef INQ
#undef INB
#undef IF
#undef II
#undef IFZERO
#undef IFMA
#undef ICVT
#undef ISUB
#undef IZDOT
#undef IHSUM
#undef IHSUM4
#undef ILOADX
#undef ILOADU
#undef IAND
#undef ISRL4
#undef INIB
#undef ICODES
#undef IDOT2
#undef ISCALES
#endif /* IDOT_BODY */
