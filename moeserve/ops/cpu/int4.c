/* Weight-only int4 kernels: fp32 activations, group-wise 4-bit weights
 * (quant/int4.py): codes u in [0, 15] with an fp32 scale and a uint8 zero point per group of
 * G = 32, 64 or 128 columns of a row,
 *
 *   w[n, k] = (u[n, k] - zero[n, k / G]) * scale[n, k / G]
 *   y[M, N] = x[M, K] @ w^T
 *
 * A row's codes are K / 2 bytes, each run of 32 columns in 16 bytes: byte j holds column j in
 * its low nibble and column 16 + j in its high one. One 16-byte load widened to 16 dwords
 * (vpmovzxbd) gives the run's columns 0..15 (the low nibbles) and 16..31 (`>> 4`); AVX2 does
 * the same per 8 bytes (columns j..j+7 and 16+j..16+j+7).
 *
 * The int4 twin of int8.c: each weight row is streamed from memory once, the threads share
 * out panels of PANEL weight rows. Half int8's bytes per weight, so the work per weight
 * decides the speed even at one token row, and that shaped the kernel (measured one thread,
 * benchmarks/int4_gemm.py shapes and a 256 x 4096 weight in L2, AVX-512 on a Zen 5 core):
 *
 *   registers   NQ weight rows at a time are dequantized in registers, then dotted with a
 *               block of at most MBQ token rows; more token rows run as several blocks
 *               (near-equal) over the same NQ rows, whose codes stay in L1. AVX-512: quads
 *               of weight rows (each x vector feeds 4 FMAs; 1.3-2x pairs at 1-6 token rows)
 *               and blocks of 4 token rows, at any M (2x the fp32-chunk form below from 16
 *               rows: 4.8 vs 10.4 ns per 32 weights at 16 rows). AVX2: pairs (quads were
 *               30% slower at one row: 16 registers), blocks of up to 6 rows.
 *   fp32 chunk  AVX2 from MBQ + 1 rows, as int8.c: a KC-column chunk of the panel is
 *               dequantized once into an fp32 buffer, then each block of MBF token rows
 *               sweeps the panel's pairs (as fast as register blocks there, and int8's form).
 *
 * Zero point and scale. AVX-512: each group's 16 possible values (u - zero) * scale are one
 * vector (one FMA per group and row), and vpermps, which reads the low 4 bits of each index
 * lane, looks the codes up in it: per 32 weights and row 1 widening load, 1 shift, 2 vpermps
 * and the 2 dot FMAs. Measured against the two forms the task named (one row, group 128, in
 * L2): dequantizing with one FMA per vector (cvtdq2ps, then u * s + (-z * s)) 47 against
 * 61-65 Gweights/s; folding the scale once per group (sum x * u per group, times s, the zero
 * points from per-group sums of x, which all weight rows share) no faster at group 128 and
 * 1.4x slower at 32 (pairs, from memory), and 50 Gweights/s with quads when the codes become
 * floats 1 + u / 16 by integer ops instead of a conversion. AVX2 has no 16-entry lookup
 * (vpermps ymm reads 3 bits): it dequantizes with the FMA (folding was 16% faster at group
 * 128 and one row, slower at group 32 and from 2 rows). The group size is a compile-time
 * constant in the dot (DISPATCH_G), so a group's runs unroll (G = 32: 42 -> 45 Gweights/s).
 *
 * What bounds decode (benchmarks/int4_gemm.py, 32000 x 1024 from memory, one token row): per
 * core the lookups and FMAs (~2.2 cycles per 32 weights and row, ~64 Gweights/s in L2): one
 * thread reads ~29 GB/s of group-128 weight from memory, 1.35-1.45x int8.c's rows/s (int8 is
 * bound by its conversions there too, at ~37 GB/s). With 2 threads int4 streams 43-55 GB/s,
 * 1.25-2.2x int8's rows/s: the most where int8 is bound by the memory (~45 GB/s), the least
 * where the memory gives int8 75 GB/s (this host's bandwidth varies with its other tenants).
 * From 4 token rows both are bound by the dot FMAs (1 per 16 weights and row): int8's speed.
 *
 * Prefill (AVX-512, tens of rows and more): the register form's lookups per weight and token
 * row come on top of the FMAs, so from Q4_GEMM_PACK_MIN_ROWS rows (GEMM) and for experts of
 * Q4_PACK_MIN_ROWS rows or more (MoE call) the rows run as int8's do, through moe_packed.h:
 * each panel of 64 weight rows dequantized once into fp32 [K, 64] (pack_panel_q4: the codes
 * transposed as bytes, then one FMA per 16 weights with the rows' group scale and -zero *
 * scale; ~25 Gweights/s in L2, pack_panel_q8's speed), then 6-row outer-product tiles.
 * Measured, 2 threads: GEMM 4096 x 2048 group 128 at 24/32/40/48/96/256 rows, registers
 * 0.89/1.18/1.45/1.73/3.50/9.31 ms, panels 1.14/1.24/1.47/1.72/3.25/8.37 (int8 8.36 at 256;
 * group 32 at 256 rows 10.5 -> 8.4); 32000 x 1024 at 64 rows 9.07 -> 8.31. The benchmark
 * model's MoE layer (64 experts, D 1024, F 512, top 6, group 128): 512 tokens (48 rows an
 * expert) 24.1 -> 21.9 ms (int8 21.5), 2048 tokens 102.4 -> 80.3 (int8 78.6).
 *
 * Integer dots (int4_idot.h): the GEMM (with VNNI, of fewer than Q4_IDOT_MAX_ROWS token
 * rows) and the MoE call run on integer dot products instead where the CPU has AVX-512 VNNI,
 * and on AVX2 CPUs: the token rows rounded once per call to 16-bit fixed point (2^-16 of
 * each row's largest |x|), split into two byte planes and dotted with the codes (vpdpbusd,
 * 64 products an instruction; AVX2: vpmaddubsw and vpmaddwd), the group scales applied per
 * 128 (64) columns. Measured, 2 threads, 32000 x 1024 from memory, group 128, interleaved:
 * AVX2 0.39 against its FMA form's 0.70 ms at one token row (group 32: 0.47 against 0.91),
 * 1.25-1.8x it up to 64 rows; VNNI as fast as the lookups at one row (both at the memory's
 * speed once the lookups prefetch their scales, SCALE_AHEAD) and 1.1-1.3x them from 4 rows.
 * Its header has the numerics.
 *
 * The lookup and FMA body is compiled twice (this file includes itself): for AVX2+FMA, the
 * baseline, and for AVX-512F with `#pragma GCC target`; the integer dots twice more, for AVX2
 * and AVX-512 VNNI. The caller picks one per call (`isa`: ISA_AVX2, ISA_AVX512, ISA_VNNI,
 * ISA_AVX2_IDOT), ops/cpu/int4.py from the CPU's flags. Pure-torch references:
 * ops/cpu/int4.py (linear_int4_ref, moe_int4_ref, and round_rows_ref for the integer dots'
 * rounding).
 */
#ifndef INT4_BODY
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "common.h"

#define PANEL 8 /* weight rows per job */
#ifndef KC
#define KC 1024 /* columns per dequantized chunk (a multiple of 128: whole groups and runs) */
#endif
#ifndef PREFETCH
#define PREFETCH 8192 /* bytes ahead on each weight row: measured best of 1024..16384 */
#endif
#define RUN 32 /* columns per packed run of 16 bytes */
/* a panel prefetches the scales and zero points of the rows this many rows on (a later
 * panel of its thread's), which a cold panel would otherwise wait for at its start (2
 * threads, 32000 x 1024 from memory, one token row: AVX-512 lookups at group 32 0.52 -> 0.41
 * ms, at 128 0.36 -> 0.34; AVX2, bound by its FMAs, unchanged; the integer dots below) */
#define SCALE_AHEAD 16
/* AVX-512: rows from which an expert of a MoE call packs its panels (512 tokens, packing
 * from 24/32/48/64 rows: 22.0/21.9/22.8/23.6 ms; at 24-31 rows the register form beats int8's
 * panels: 256 tokens 11.9 against 15.5 ms), and from which a GEMM does (32 rows: registers
 * 4-12% faster on the shapes above, 40: panels as fast or faster) */
#ifndef Q4_PACK_MIN_ROWS
#define Q4_PACK_MIN_ROWS 32
#endif
#ifndef Q4_GEMM_PACK_MIN_ROWS
#define Q4_GEMM_PACK_MIN_ROWS 40
#endif
/* AVX-512 VNNI: rows below which GEMMs and MoE calls (the most rows of an expert) run on the
 * integer dots (int4_idot.h), faster than the packed panels there too (2 threads, N x K
 * 4096 x 2048, group 128 at 48/96/256 rows: 1.22/2.42/7.29 ms against 1.84/3.36/8.43; group
 * 32 at 256 rows 7.97 against 8.50, at 1024 rows 39.5 against 33.0; 2048 x 4096 at 256 rows
 * group 32 even. The benchmark model's MoE layer (~48 and ~190 rows an expert) at 512 and
 * 2048 tokens: 20.0 and 81.4 ms against 22.5 and 83.6) */
#define Q4_IDOT_MAX_ROWS 256
/* the `isa` argument of the entry points (ops/cpu/int4.py: isa()) */
#define ISA_AVX2 0      /* dequantize with FMAs */
#define ISA_AVX512 1    /* look the codes up */
#define ISA_VNNI 2      /* AVX-512 VNNI integer dots */
#define ISA_AVX2_IDOT 3 /* AVX2 integer dots */
/* or'ed into the integer dots' isa: the token rows (and the MoE hidden) on their int8 grids
 * first, as w4a8_int8 takes them (ops/cpu/int4_amx.py: its few-row calls) */
#define ISA_INT8_ROWS 16
/* or'ed into the isa of a weight whose zero points are all 8 (symmetric): the integer dots
 * do not read them (a stream less a row; the other forms read them as ever). The benchmark
 * model's decode step at batch 1 (Xeon with AMX, 2 threads): 1.02x. */
#define ISA_ZERO8 32
/* Rows of x per pass over the weight (many-row calls), so they stay in cache across its
 * panels: 512 KB of them, at least 64 rows (decode batches in one pass). One thread, AVX-512,
 * 2048 x 4096 weight, 2048 rows: 150 ms in passes of 32 rows, 484 in one. */
#define X_PASS_BYTES (512 << 10)
#define X_PASS_MIN_ROWS 64
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)

/* DISPATCH_MB (common.h) for lim <= 6 that compiles no case past lim */
#define DISPATCH_FEW(left, lim, CALL)                \
    switch ((left) >= (lim) ? (lim) : (int)(left)) { \
        case 1: CALL(1); break;                      \
        case 2: if ((lim) >= 2) CALL(2); break;      \
        case 3: if ((lim) >= 3) CALL(3); break;      \
        case 4: if ((lim) >= 4) CALL(4); break;      \
        case 5: if ((lim) >= 5) CALL(5); break;      \
        default: if ((lim) >= 6) CALL(6); break;     \
    }
/* CALL(mb, G) with the group size G (32, 64 or 128) as a compile-time constant */
#define DISPATCH_G(G, mb, CALL)        \
    switch (G) {                       \
        case 32: CALL(mb, 32); break;  \
        case 64: CALL(mb, 64); break;  \
        default: CALL(mb, 128); break; \
    }

/* sn[2j] = scale[j] and sn[2j + 1] = -zero[j] * scale[j] for j < n: the multiplier and addend
 * that dequantize group j in one FMA, side by side (one pointer per weight row in the dot) */
static inline void scale_neg_zero(int64_t n, const uint8_t *zero, const float *scale,
                                  float *sn) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256i z8 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(zero + j)));
        const __m256 s = _mm256_loadu_ps(scale + j), neg = _mm256_set1_ps(-0.0f);
        const __m256 nz = _mm256_mul_ps(_mm256_cvtepi32_ps(z8), _mm256_xor_ps(s, neg));
        const __m256 lo = _mm256_unpacklo_ps(s, nz), hi = _mm256_unpackhi_ps(s, nz);
        _mm256_storeu_ps(sn + 2 * j, _mm256_permute2f128_ps(lo, hi, 0x20));
        _mm256_storeu_ps(sn + 2 * j + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
    }
    for (; j < n; j++) {
        sn[2 * j] = scale[j];
        sn[2 * j + 1] = (float)zero[j] * -scale[j];
    }
}

/* the n scales and zero points at scale and zero into L1 (zero NULL: the scales alone) */
static inline void prefetch_groups(const float *scale, const uint8_t *zero, int64_t n) {
    for (int64_t j = 0; j < n; j += 16) _mm_prefetch((const char *)(scale + j), _MM_HINT_T0);
    for (int64_t j = 0; zero && j < n; j += 64)
        _mm_prefetch((const char *)(zero + j), _MM_HINT_T0);
}

/* ---- AVX2 + FMA: 8 lanes, a run in two halves of 8 bytes ---- */
#define INT4_BODY
#define W 8
#define NSUB 2   /* loads of W code bytes per run */
#define NQ 2     /* weight rows dequantized at a time */
#define MBQ 6    /* token rows per block: 2 * 6 accumulators + 4 of 16 registers */
#define CHUNKS 1 /* more than MBQ token rows: the fp32-chunk form */
#define MBF 6    /* token rows per block over the dequantized chunk */
#define LUT 0    /* dequantize with an FMA per vector */
#define SFX _avx2
typedef __m256 vf_avx2;
typedef __m256i vi_avx2;
#define VF vf_avx2
#define VI vi_avx2
#define VZERO() _mm256_setzero_ps()
#define VSET1(f) _mm256_set1_ps(f)
#define VLOADU(p) _mm256_loadu_ps(p)
#define VLOAD(p) _mm256_load_ps(p)
#define VSTORE(p, v) _mm256_store_ps(p, v)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VHSUM(v) hsum256(v)
/* W bytes of codes as W dwords; their low and high nibbles as floats */
#define VBYTES(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define VLO(b) _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)))
#define VHI(b) _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4))
#include "int4.c" /* this file: its body, for this ISA */
#undef W
#undef NSUB
#undef NQ
#undef MBQ
#undef CHUNKS
#undef MBF
#undef LUT
#undef SFX
#undef VF
#undef VI
#undef VZERO
#undef VSET1
#undef VLOADU
#undef VLOAD
#undef VSTORE
#undef VFMA
#undef VADD
#undef VHSUM
#undef VBYTES
#undef VLO
#undef VHI

/* ---- AVX-512F: 16 lanes, a run in one 16-byte load, quads of weight rows ---- */
#pragma GCC push_options
#pragma GCC target("avx512f")
#define W 16
#define NSUB 1
#define NQ 4     /* 4 * 4 accumulators + 4 tables + 8 nibble vectors of 32 registers */
#define MBQ 4    /* measured best of 2..6 (6 spills: 18 vs 20 Gweights/s at 5 rows) */
#define CHUNKS 0 /* any number of token rows in registers */
#define MBF 6
#define LUT 1 /* dequantize by looking the codes up in the group's 16 values */
#define SFX _avx512
typedef __m512 vf_avx512;
typedef __m512i vi_avx512;
#define VF vf_avx512
#define VI vi_avx512
#define VZERO() _mm512_setzero_ps()
#define VSET1(f) _mm512_set1_ps(f)
#define VLOADU(p) _mm512_loadu_ps(p)
#define VLOAD(p) _mm512_load_ps(p)
#define VSTORE(p, v) _mm512_store_ps(p, v)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VHSUM(v) _mm512_reduce_add_ps(v)
#define VBYTES(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define VLO(b) _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)))
#define VHI(b) _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4))
/* the sums of a0, a1, a2 and a3's lanes: a transposing reduction, 9 shuffles and adds */
static inline __m128 hsum4_512(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(a0, a1, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(a2, a3, _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 v = _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
    v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)));
    v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2)));
    const __m512i first = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(first, v));
}
#include "int4.c" /* this file: its body, for this ISA */

#include "panels.h"

/* The 16 x 16 bytes r[i][j] transposed: r[j][i] <- r[i][j] if r[i] holds row bitrev4(i)
 * (4 rounds of interleaving row i with row i + 8, bytes then words, dwords and qwords, leave
 * the rows in bit-reversed order). 64 xmm shuffles for 16 x 32 int4 columns, where a dword
 * transpose (transpose16) of the widened codes takes 128 zmm ones. */
static inline __attribute__((always_inline)) void transpose16_u8(__m128i *r) {
    __m128i t[16];
#define ROUND(W)                                                 \
    for (int i = 0; i < 8; i++) {                                \
        t[2 * i] = _mm_unpacklo_epi##W(r[i], r[i + 8]);          \
        t[2 * i + 1] = _mm_unpackhi_epi##W(r[i], r[i + 8]);      \
    }                                                            \
    for (int i = 0; i < 16; i++) r[i] = t[i];
    ROUND(8) ROUND(16) ROUND(32) ROUND(64)
#undef ROUND
}

/* buf[k * PK_NR + c] = (u[c, k] - z[c, k / G]) * s[c, k / G] for c < nc (<= PK_NR; columns
 * past nc are 0): the rows' codes q + c * ldq (scales and zero points K / G per row) as a
 * packed panel. Per 16 rows and run of 32 columns: the 16 rows' 16 code bytes transposed as
 * bytes (transpose16_u8), so that byte vector j holds columns j (low nibbles) and 16 + j
 * (high) of the 16 rows; each widened once and dequantized by one vector of the rows' group
 * scales and one of their -zero * scale (2 registers per group). */
static inline void pack_panel_q4(int64_t K, const uint8_t *q, int64_t ldq, const float *s,
                                 const uint8_t *z, int64_t G, int nc, float *buf) {
    static const int bitrev4[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
    const int64_t ng = K / G;
    const __m512i low = _mm512_set1_epi32(15);
    float sn_buf[ng * 32] __attribute__((aligned(64)));
    for (int v = 0; v < PK_NV; v++) {
        const int c0 = 16 * v;
        const int live = nc - c0 <= 0 ? 0 : (nc - c0 >= 16 ? 16 : nc - c0);
        /* sn[g][0][j], sn[g][1][j]: group g's scale and -zero * scale of row j, 16 groups of
         * the 16 rows at a time read row by row and transposed (gathering them per group, 16
         * rows K / G apart, was slower: at G = 32, 18 -> 24 Gweights/s packed in L2) */
        float(*sn)[2][16] = (float(*)[2][16])sn_buf;
        for (int64_t g0 = 0; g0 < ng; g0 += 16) {
            const int ngr = ng - g0 < 16 ? (int)(ng - g0) : 16;
            const __mmask16 m = (__mmask16)((1u << ngr) - 1u);
            __m512 sc[16], nz[16];
            for (int j = 0; j < 16; j++) {
                const int64_t i = (c0 + j) * ng + g0;
                sc[j] = j < live ? _mm512_maskz_loadu_ps(m, s + i) : _mm512_setzero_ps();
                __m128i zb = _mm_setzero_si128();
                if (j < live && ngr == 16) {
                    zb = _mm_loadu_si128((const __m128i *)(z + i));
                } else if (j < live) { /* fewer than 16 groups left (AVX-512F: no byte mask) */
                    uint8_t t[16] = {0};
                    for (int gg = 0; gg < ngr; gg++) t[gg] = z[i + gg];
                    zb = _mm_loadu_si128((const __m128i *)t);
                }
                const __m512 zf = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(zb));
                nz[j] = _mm512_mul_ps(zf, _mm512_sub_ps(_mm512_setzero_ps(), sc[j]));
            }
            transpose16(sc);
            transpose16(nz);
            for (int gg = 0; gg < ngr; gg++) {
                _mm512_store_ps(sn[g0 + gg][0], sc[gg]);
                _mm512_store_ps(sn[g0 + gg][1], nz[gg]);
            }
        }
        for (int64_t g = 0; g < ng; g++) {
            const __m512 S = _mm512_loadu_ps(sn[g][0]), NZ = _mm512_loadu_ps(sn[g][1]);
            for (int64_t k = g * G; k < (g + 1) * G; k += RUN) {
                __m128i r[16];
                for (int i = 0; i < 16; i++) {
                    const int row = bitrev4[i];
                    r[i] = row < live
                               ? _mm_loadu_si128((const __m128i *)(q + (c0 + row) * ldq + k / 2))
                               : _mm_setzero_si128();
                }
                transpose16_u8(r);
                for (int j = 0; j < 16; j++) {
                    const __m512i b = _mm512_cvtepu8_epi32(r[j]);
                    const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, low));
                    const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
                    _mm512_store_ps(buf + (k + j) * PK_NR + c0, _mm512_fmadd_ps(lo, S, NZ));
                    _mm512_store_ps(buf + (k + 16 + j) * PK_NR + c0, _mm512_fmadd_ps(hi, S, NZ));
                }
            }
        }
    }
}

/* y[:M, :nc] = x @ w^T for nc int4 rows through the register panels: moe_packed.h's few-row
 * path */
static void rows_q4(int64_t M, int64_t K, const float *x, int64_t ldx, const uint8_t *q,
                    int64_t ldq, const float *s, const uint8_t *z, int64_t G, int nc, float *y,
                    int64_t ldy) {
    const int64_t ng = K / G;
    for (int r = 0; r < nc; r += PANEL)
        panel_rows_avx512(M, K, x, ldx, q + r * ldq, ldq, s + r * ng, z + r * ng, G,
                          nc - r < PANEL ? nc - r : PANEL, y + r, ldy);
}

/* prefill: many-row GEMMs and MoE experts through packed panels, dequantized while packing */
#define PK_T uint8_t
#define PK_SFX _q4
#define PK_ROW_BYTES(K) ((K) / 2)
#define PK_MIN_ROWS Q4_PACK_MIN_ROWS
#define PK_PACK(K, r, buf) \
    pack_panel_q4(K, (const uint8_t *)(r)->w, (r)->ld, (r)->s, (r)->z, (r)->G, (r)->nr, buf)
#define PK_ROWS(M, K, x, ldx, r, y, ldy)                                                    \
    rows_q4(M, K, x, ldx, (const uint8_t *)(r)->w, (r)->ld, (r)->s, (r)->z, (r)->G, (r)->nr, \
            y, ldy)
#define PK_GEMM
#include "moe_packed.h"
#pragma GCC pop_options

/* ---- integer dot products on rounded token rows: AVX2 and AVX-512 VNNI (int4_idot.h) ---- */
#include "int4_idot.h"

/* y[:M, :N] = x @ w^T for int4 rows w: on the integer dots (ISA_AVX2_IDOT; ISA_VNNI with
 * fewer than Q4_IDOT_MAX_ROWS rows), through packed panels (AVX-512, from
 * Q4_GEMM_PACK_MIN_ROWS rows), or in registers (ISA_AVX512, ISA_AVX2). Where the integer dots
 * cannot have their scratch, the fp32 form of the same width runs. Returns 0; with
 * ISA_INT8_ROWS, which only the integer dots take, -1 when they cannot run (their scratch,
 * or a call they do not take: nothing computed). */
int moeserve_int4_gemm_nt_small(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx,
                                const uint8_t *q, int64_t ldq, const float *scale,
                                const uint8_t *zero, int64_t group_size, float *y, int64_t ldy,
                                int isa) {
    const uint8_t *dz = isa & ISA_ZERO8 ? NULL : zero; /* the integer dots' zero points */
    isa &= ~ISA_ZERO8;
    if (isa & ISA_INT8_ROWS) {
        isa &= ~ISA_INT8_ROWS;
        if (isa == ISA_VNNI && M < Q4_IDOT_MAX_ROWS)
            return gemm_idot_vnni(M, N, K, x, ldx, q, ldq, scale, dz, group_size, y, ldy, 1);
        if (isa == ISA_AVX2_IDOT)
            return gemm_idot_avx2(M, N, K, x, ldx, q, ldq, scale, dz, group_size, y, ldy, 1);
        return -1;
    }
    if (isa == ISA_VNNI && M < Q4_IDOT_MAX_ROWS &&
        !gemm_idot_vnni(M, N, K, x, ldx, q, ldq, scale, dz, group_size, y, ldy, 0))
        return 0;
    if (isa == ISA_AVX2_IDOT &&
        !gemm_idot_avx2(M, N, K, x, ldx, q, ldq, scale, dz, group_size, y, ldy, 0))
        return 0;
    if (isa == ISA_AVX2_IDOT) isa = ISA_AVX2;
    if (isa && M >= Q4_GEMM_PACK_MIN_ROWS)
        gemm_panels_q4(M, N, K, x, ldx, q, ldq, scale, zero, group_size, y, ldy);
    else if (isa)
        gemm_avx512(M, N, K, x, ldx, q, ldq, scale, zero, group_size, y, ldy);
    else
        gemm_avx2(M, N, K, x, ldx, q, ldq, scale, zero, group_size, y, ldy);
    return 0;
}

/* Routed experts for few rows, one call per MoE layer: the int4 twin of
 * moeserve_int8_moe_small (int8.c). For each group g (rows [start[g], start[g] + count[g]) of
 * x, all routed to expert[g]):
 *   h = x_g @ w13[e]^T                       (gate rows then up rows: [count, 2F])
 *   a = silu(h[:, :F]) * h[:, F:]            (written over h[:, :F])
 *   y_g = route_w_g * (a @ w2[e]^T)
 * w13 is [E, 2F, D] int4 (q13 [E, 2F, D / 2] codes, s13 and z13 [E, 2F, D / G]); w2 is
 * [E, D, F] (q2 [E, D, F / 2], s2 and z2 [E, D, F / G]); all contiguous, both projections
 * with the one group size G, which divides D and F. h is scratch of [rows, 2F]. One parallel
 * region: the threads share out the weight panels of all experts at once. Any number of rows
 * per expert: on the integer dots with ISA_AVX2_IDOT, and with ISA_VNNI when every expert
 * has fewer than Q4_IDOT_MAX_ROWS rows (moe_idot_*); else with AVX-512 and an expert of
 * Q4_PACK_MIN_ROWS rows or more (prefill), moe_panels_q4 (moe_packed.h). Returns 0; with
 * ISA_INT8_ROWS as moeserve_int4_gemm_nt_small. */
int moeserve_int4_moe_small(int64_t n_groups, const int64_t *expert, const int64_t *start,
                             const int64_t *count, int64_t D, int64_t F, const float *x,
                             const uint8_t *q13, const float *s13, const uint8_t *z13,
                             const uint8_t *q2, const float *s2, const uint8_t *z2,
                            int64_t group_size, const float *route_w, float *h, float *y,
                            int isa) {
    const uint8_t *dz13 = isa & ISA_ZERO8 ? NULL : z13, *dz2 = isa & ISA_ZERO8 ? NULL : z2;
    isa &= ~ISA_ZERO8;
    int64_t most = 0;
    for (int64_t g = 0; g < n_groups; g++) most = count[g] > most ? count[g] : most;
    if (isa & ISA_INT8_ROWS) {
        isa &= ~ISA_INT8_ROWS;
        if (isa == ISA_VNNI && most < Q4_IDOT_MAX_ROWS)
            return moe_idot_vnni(n_groups, expert, start, count, D, F, x, q13, s13, dz13, q2, s2,
                                 dz2, group_size, route_w, h, y, 1);
        if (isa == ISA_AVX2_IDOT)
            return moe_idot_avx2(n_groups, expert, start, count, D, F, x, q13, s13, dz13, q2, s2,
                                 dz2, group_size, route_w, h, y, 1);
        return -1;
    }
    if (isa == ISA_VNNI && most < Q4_IDOT_MAX_ROWS &&
        !moe_idot_vnni(n_groups, expert, start, count, D, F, x, q13, s13, dz13, q2, s2, dz2,
                       group_size, route_w, h, y, 0))
        return 0;
    if (isa == ISA_AVX2_IDOT &&
        !moe_idot_avx2(n_groups, expert, start, count, D, F, x, q13, s13, dz13, q2, s2, dz2,
                       group_size, route_w, h, y, 0))
        return 0;
    if (isa == ISA_AVX2_IDOT) isa = ISA_AVX2;
    if (isa && most >= Q4_PACK_MIN_ROWS)
        moe_panels_q4(n_groups, expert, start, count, D, F, x, q13, s13, z13, q2, s2, z2,
                      group_size, route_w, h, y);
    else if (isa)
        moe_avx512(n_groups, expert, start, count, D, F, x, q13, s13, z13, q2, s2, z2,
                   group_size, route_w, h, y);
    else
        moe_avx2(n_groups, expert, start, count, D, F, x, q13, s13, z13, q2, s2, z2, group_size,
                 route_w, h, y);
    return 0;
}

/* out[n, :] = the dequantized row n for rows [0, N) (codes ldq bytes apart, scales and zero
 * points K / G per row, contiguous): the fp32 weight block that a many-row GEMM (prefill)
 * hands to BLAS. Bound by memory (8 bytes written per byte read): AVX2 only. */
void moeserve_int4_dequant(int64_t N, int64_t K, const uint8_t *q, int64_t ldq,
                           const float *scale, const uint8_t *zero, int64_t group_size,
                           float *out, int64_t ldo) {
    const int64_t ng = K / group_size;
#pragma omp parallel for schedule(static) if (N * K >= 65536)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *qn = q + n * ldq;
        float *on = out + n * ldo;
        for (int64_t g = 0; g < ng; g++) {
            const float sg = scale[n * ng + g];
            const __m256 s = _mm256_set1_ps(sg);
            const __m256 nz = _mm256_set1_ps((float)zero[n * ng + g] * -sg);
            for (int64_t k = g * group_size; k < (g + 1) * group_size; k += RUN) {
                for (int j = 0; j < 16; j += 8) {
                    const __m256i b =
                        _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qn + k / 2 + j)));
                    const __m256i lo = _mm256_and_si256(b, _mm256_set1_epi32(15));
                    const __m256i hi = _mm256_srli_epi32(b, 4);
                    _mm256_storeu_ps(on + k + j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), s, nz));
                    _mm256_storeu_ps(on + k + 16 + j,
                                     _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), s, nz));
                }
            }
        }
    }
}

#else /* INT4_BODY: the kernels for one ISA, named with the suffix SFX */

/* rows 0..mb-1 of x against the nq (<= NQ) int4 weight rows q + r * ldq (r < nq) with groups
 * of G columns, dequantized in registers: group g of row r by sn[r * 2 * ng + 2g] (scale) and
 * [... + 1] (-zero * scale), scale_neg_zero's; y[i * ldy + r] = dot. */
static inline __attribute__((always_inline)) void CAT(dot_block_q, SFX)(
    const int mb, const int G, const int nq, int64_t K, const float *x, int64_t ldx,
    const uint8_t *q, int64_t ldq, const float *sn, float *y, int64_t ldy) {
    /* independent chains per accumulator: a run's vectors (2 * NSUB of them) spread over up
     * to 4 for one token row of a pair, 2 while the block has few accumulators, else 1 */
    const int U = (mb == 1 && NQ == 2) ? (2 * NSUB < 4 ? 2 * NSUB : 4)
                                       : (mb <= 3 && NQ * mb <= 6 ? 2 : 1);
    const int64_t ng = K / G;
    const uint8_t *qr[NQ];
    const float *sr[NQ];
#pragma GCC unroll 4
    for (int r = 0; r < NQ; r++) {
        const int64_t rr = r < nq ? r : 0; /* rows past nq: row 0 again, not stored */
        qr[r] = q + rr * ldq;
        sr[r] = sn + rr * 2 * ng;
    }
    VF a[NQ][4][MBQ];
#pragma GCC unroll 4
    for (int r = 0; r < NQ; r++)
#pragma GCC unroll 4
        for (int u = 0; u < 4; u++)
#pragma GCC unroll 6
            for (int i = 0; i < MBQ; i++) a[r][u][i] = VZERO();
#if LUT
    const VF iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
#endif
    for (int64_t g = 0; g < ng; g++) {
        VF sc[NQ], nz[NQ]; /* the group's scale and -zero * scale (LUT: its 16 values) */
#pragma GCC unroll 4
        for (int r = 0; r < NQ; r++) {
            sc[r] = VSET1(sr[r][2 * g]);
            nz[r] = VSET1(sr[r][2 * g + 1]);
#if LUT
            sc[r] = VFMA(iota, sc[r], nz[r]); /* (u - zero) * scale for u = 0..15 */
#endif
        }
#pragma GCC unroll 4
        for (int run = 0; run < G / RUN; run++) {
            const int64_t k = g * G + run * RUN;
            if ((k & 127) == 0) { /* one cache line of codes per 128 columns */
#pragma GCC unroll 4
                for (int r = 0; r < NQ; r++)
                    _mm_prefetch((const char *)(qr[r] + k / 2 + PREFETCH), _MM_HINT_T0);
            }
#pragma GCC unroll 2
            for (int j = 0; j < NSUB; j++) {
                VF lo[NQ], hi[NQ]; /* the run's columns j * W.. and 16 + j * W.. of each row */
#pragma GCC unroll 4
                for (int r = 0; r < NQ; r++) {
                    const VI b = VBYTES(qr[r] + k / 2 + j * W);
#if LUT /* vpermps reads the low 4 bits of each index lane */
                    lo[r] = _mm512_permutexvar_ps(b, sc[r]);
                    hi[r] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), sc[r]);
#else
                    lo[r] = VFMA(VLO(b), sc[r], nz[r]);
                    hi[r] = VFMA(VHI(b), sc[r], nz[r]);
#endif
                }
                const int ul = (2 * j) & (U - 1), uh = (2 * j + 1) & (U - 1);
#pragma GCC unroll 6
                for (int i = 0; i < MBQ; i++) {
                    if (i < mb) {
                        const float *xi = x + i * ldx + k + j * W;
                        const VF xl = VLOADU(xi), xh = VLOADU(xi + 16);
#pragma GCC unroll 4
                        for (int r = 0; r < NQ; r++) {
                            a[r][ul][i] = VFMA(xl, lo[r], a[r][ul][i]);
                            a[r][uh][i] = VFMA(xh, hi[r], a[r][uh][i]);
                        }
                    }
                }
            }
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < MBQ; i++) {
        if (i < mb) {
#pragma GCC unroll 4
            for (int r = 0; r < NQ; r++)
#pragma GCC unroll 4
                for (int u = 1; u < 4; u++)
                    if (u < U) a[r][0][i] = VADD(a[r][0][i], a[r][u][i]);
#if NQ == 4
            const __m128 d = hsum4_512(a[0][0][i], a[1][0][i], a[2][0][i], a[3][0][i]);
            if (nq == 4) {
                _mm_storeu_ps(y + i * ldy, d);
            } else {
                float t[4];
                _mm_storeu_ps(t, d);
                for (int r = 0; r < nq; r++) y[i * ldy + r] = t[r];
            }
#else
#pragma GCC unroll 4
            for (int r = 0; r < nq; r++) y[i * ldy + r] = VHSUM(a[r][0][i]);
#endif
        }
    }
}

#include "dot_f.h" /* dot_block_f: the fp32 chunks' dot */

/* All M rows of x against a panel of `rows` (<= PANEL) int4 weight rows q + r * ldq (bytes)
 * with the scales and zero points of their K / G groups at scale + r * K / G, zero + ...;
 * y[i, r] for i < M, r < rows. */
static void CAT(panel_rows, SFX)(int64_t M, int64_t K, const float *x, int64_t ldx,
                                 const uint8_t *q, int64_t ldq, const float *scale,
                                 const uint8_t *zero, int64_t G, int64_t rows, float *y,
                                 int64_t ldy) {
    const int64_t ng = K / G;
    prefetch_groups(scale + SCALE_AHEAD * ng, zero + SCALE_AHEAD * ng, PANEL * ng);
    if (!CHUNKS || M <= MBQ) {
        /* in registers: NQ weight rows at a time against blocks of at most MBQ token rows
         * (near-equal), the NQ rows' codes staying in L1 across the blocks */
        float sn[PANEL * 2 * ng];
        scale_neg_zero(rows * ng, zero, scale, sn); /* the panel's rows back to back */
        const int64_t nb = (M + MBQ - 1) / MBQ;
        for (int64_t r = 0; r < rows; r += NQ) {
            const int nq = rows - r < NQ ? (int)(rows - r) : NQ;
            for (int64_t b = 0, m0 = 0; b < nb; b++) {
                const int64_t mb = (M - m0 + nb - b - 1) / (nb - b);
#define CALL_Q(n, GC)                                                                       \
    CAT(dot_block_q, SFX)(n, GC, nq, K, x + m0 * ldx, ldx, q + r * ldq, ldq, sn + r * 2 * ng, \
                          y + m0 * ldy + r, ldy)
#define CALL_QG(n) DISPATCH_G(G, n, CALL_Q)
                DISPATCH_FEW(mb, MBQ, CALL_QG)
#undef CALL_QG
#undef CALL_Q
                m0 += mb;
            }
        }
        return;
    }
    /* chunks of KC columns (whole groups): dequantize the panel's rows once into buf, then
     * for each block of MBF token rows sweep the panel's pairs, so the block's x chunk stays
     * in cache across them */
    float buf[PANEL][KC] __attribute__((aligned(64)));
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = K - k0 < KC ? K - k0 : KC;
        for (int64_t r = 0; r < rows; r++) {
            const uint8_t *qr = q + r * ldq;
            for (int64_t k = 0; k < kc; k += G) {
                const int64_t g = r * ng + (k0 + k) / G;
                const VF s = VSET1(scale[g]), nz = VSET1((float)zero[g] * -scale[g]);
                for (int64_t c = k; c < k + G; c += RUN) {
                    const uint8_t *p = qr + (k0 + c) / 2;
                    if ((c & 127) == 0) _mm_prefetch((const char *)(p + PREFETCH), _MM_HINT_T0);
#pragma GCC unroll 2
                    for (int j = 0; j < NSUB; j++) {
                        const VI b = VBYTES(p + j * W);
                        VSTORE(buf[r] + c + j * W, VFMA(VLO(b), s, nz));
                        VSTORE(buf[r] + c + 16 + j * W, VFMA(VHI(b), s, nz));
                    }
                }
            }
        }
        for (int64_t m0 = 0; m0 < M; m0 += MBF) {
            const int64_t mb = M - m0 < MBF ? M - m0 : MBF;
            const float *xm = x + m0 * ldx + k0;
            float *ym = y + m0 * ldy;
            for (int64_t r = 0; r < rows; r += 2) {
                const int two = r + 1 < rows;
                const float *w0 = buf[r], *w1 = buf[r + two];
#define CALL_F(n) CAT(dot_block_f, SFX)(n, two, k0 == 0, kc, xm, ldx, w0, w1, ym + r, ldy)
                DISPATCH_MB(mb, MBF, CALL_F)
#undef CALL_F
            }
        }
    }
}

static void CAT(gemm, SFX)(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx,
                           const uint8_t *q, int64_t ldq, const float *scale,
                           const uint8_t *zero, int64_t G, float *y, int64_t ldy) {
    const int64_t panels = (N + PANEL - 1) / PANEL, ng = K / G;
    int64_t pass = X_PASS_BYTES / (4 * K);
    pass = pass < X_PASS_MIN_ROWS ? X_PASS_MIN_ROWS : pass;
#pragma omp parallel if (N * K >= 65536)
    for (int64_t m0 = 0; m0 < M; m0 += pass) { /* each pass's rows of x over all panels */
        const int64_t mc = M - m0 < pass ? M - m0 : pass;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const int64_t n0 = p * PANEL, rows = N - n0 < PANEL ? N - n0 : PANEL;
            CAT(panel_rows, SFX)(mc, K, x + m0 * ldx, ldx, q + n0 * ldq, ldq, scale + n0 * ng,
                                 zero + n0 * ng, G, rows, y + m0 * ldy + n0, ldy);
        }
    }
}

static void CAT(moe, SFX)(int64_t n_groups, const int64_t *expert, const int64_t *start,
                          const int64_t *count, int64_t D, int64_t F, const float *x,
                          const uint8_t *q13, const float *s13, const uint8_t *z13,
                          const uint8_t *q2, const float *s2, const uint8_t *z2, int64_t G,
                          const float *route_w, float *h, float *y) {
    const int64_t panels13 = (2 * F + PANEL - 1) / PANEL, panels2 = (D + PANEL - 1) / PANEL;
    const int64_t ng13 = D / G, ng2 = F / G; /* groups per row of each projection */
    const int ns = omp_get_max_threads();
    struct job_slot up[ns], down[ns];
    moe_jobs_share(up, ns, n_groups, count, panels13);
    moe_jobs_share(down, ns, n_groups, count, panels2);
#pragma omp parallel
    {
        /* contiguous shares of equal cost, and stealing, as in fp32.c */
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int64_t job; (job = jobs_next(up, t, ns)) >= 0;) {
            const int64_t g = job / panels13, n0 = (job % panels13) * PANEL, e = expert[g];
            const int64_t nr = 2 * F - n0 < PANEL ? 2 * F - n0 : PANEL, row = e * 2 * F + n0;
            CAT(panel_rows, SFX)(count[g], D, x + start[g] * D, D, q13 + row * (D / 2), D / 2,
                                 s13 + row * ng13, z13 + row * ng13, G, nr,
                                 h + start[g] * 2 * F + n0, 2 * F);
        }
        moe_activation_phase(n_groups, start, count, F, h, t, nt);
        for (int64_t job; (job = jobs_next(down, t, ns)) >= 0;) {
            const int64_t g = job / panels2, n0 = (job % panels2) * PANEL, e = expert[g];
            const int64_t nr = D - n0 < PANEL ? D - n0 : PANEL, row = e * D + n0;
            float *yg = y + start[g] * D + n0;
            CAT(panel_rows, SFX)(count[g], F, h + start[g] * 2 * F, 2 * F, q2 + row * (F / 2),
                                 F / 2, s2 + row * ng2, z2 + row * ng2, G, nr, yg, D);
            weigh_rows(count[g], route_w + start[g], yg, D, nr);
        }
    }
}

#endif /* INT4_BODY */
