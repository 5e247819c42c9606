/* Helpers shared by the C kernels of this folder (attention.c, fp32.c, int8.c, int4.c): a
 * horizontal sum, a vector e^x, the gated activation of the MoE layers, a prefetch, and how
 * an MoE call's jobs are split among threads. The vector helpers exist for x86-64 (AVX2+FMA,
 * the baseline of the x86 kernels) and for aarch64 (NEON, the baseline there: the same
 * Cephes polynomial 4 lanes at a time); the rest is plain C. build.py hashes this header
 * with each source, so a change to it rebuilds them. */
#ifndef MOESERVE_CPU_COMMON_H
#define MOESERVE_CPU_COMMON_H
#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

/* a read prefetch of the line at p into every cache level */
#define PREFETCH_T0(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
/* into L2 (and L3): the far half of a weight stream's two prefetches (int8.c, int4_idot.h) */
#define PREFETCH_T1(p) _mm_prefetch((const char *)(p), _MM_HINT_T1)

/* the sum of v's 8 lanes (fp32.c, int8.c, int4.c) */
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 h = _mm_movehdup_ps(s);
    s = _mm_add_ps(s, h);
    h = _mm_movehl_ps(h, s);
    return _mm_cvtss_f32(_mm_add_ss(s, h));
}

/* e^x for x <= 0, 8 at a time: Cephes' expf (relative error ~1e-7); below -87 it returns
 * ~e^-87 instead of a denormal or 0, which neither a softmax sum nor a sigmoid notices. */
static inline __m256 exp256_neg(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i n127 = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    const __m256i e = _mm256_slli_epi32(n127, 23); /* 2^n */
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* AVX-512F (fp32.c, attention.c): sums of 16 vectors in one, lane 4q + l of the result holding
 * the sum of v[4l + q] (REDUCE16_LANE(n): where v[n]'s sum lands); a transposing butterfly,
 * 45 shuffles and adds instead of 16 separate reductions, which weigh at K = 512: 32 FMAs per
 * accumulator */
#define AVX512_INLINE static inline __attribute__((always_inline, target("avx512f")))
AVX512_INLINE __m512 reduce16(const __m512 *v) {
    __m512 r[8], s[4];
    for (int n = 0; n < 8; n++)
        r[n] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * n], v[2 * n + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * n], v[2 * n + 1], 0xEE));
    for (int n = 0; n < 4; n++) /* s[n], quarter q: 4 partial sums of v[4n + q] */
        s[n] = _mm512_add_ps(_mm512_shuffle_f32x4(r[2 * n], r[2 * n + 1], 0x88),
                             _mm512_shuffle_f32x4(r[2 * n], r[2 * n + 1], 0xDD));
    const __m512 u0 = _mm512_add_ps(_mm512_unpacklo_ps(s[0], s[1]), _mm512_unpackhi_ps(s[0], s[1]));
    const __m512 u1 = _mm512_add_ps(_mm512_unpacklo_ps(s[2], s[3]), _mm512_unpackhi_ps(s[2], s[3]));
    const __m512d d0 = _mm512_castps_pd(u0), d1 = _mm512_castps_pd(u1);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(d0, d1)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(d0, d1)));
}
#define REDUCE16_LANE(n) (4 * ((n) % 4) + (n) / 4)

/* One row of an MoE hidden [gate F | up F]: row[f] = silu(gate[f]) * up[f] for f < F, with
 * silu(g) = g * sigmoid(g) taken from e = e^-|g| (never overflows): sigmoid(g) = 1 / (1 + e)
 * for g >= 0 and e / (1 + e) below. Scalar expf was ~7% of a prefill MoE layer. */
static inline void silu_mul_row(int64_t F, float *row) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    int64_t f = 0;
    for (; f + 8 <= F; f += 8) {
        const __m256 g = _mm256_loadu_ps(row + f);
        const __m256 e = exp256_neg(_mm256_or_ps(g, sign)); /* e^-|g| */
        const __m256 neg = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
        const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(one, e, neg), _mm256_add_ps(one, e));
        _mm256_storeu_ps(row + f, _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(row + F + f)));
    }
    for (; f < F; f++) {
        const float g = row[f];
        row[f] = g / (1.0f + expf(-g)) * row[F + f];
    }
}

#elif defined(__aarch64__)
#include <arm_neon.h>

#define PREFETCH_T0(p) __builtin_prefetch((const void *)(p), 0, 3)
#define PREFETCH_T1(p) __builtin_prefetch((const void *)(p), 0, 2)

/* Two rows' 16 bytes at a and b as the matrix instructions (SMMLA, BFMMLA) take a pair of
 * rows: lo = [a's first 8 bytes | b's first 8], hi = [a's last 8 | b's last 8] */
static inline void zip_rows64(const void *a, const void *b, uint64x2_t *lo, uint64x2_t *hi) {
    const uint64x2_t u = vreinterpretq_u64_u8(vld1q_u8((const uint8_t *)a));
    const uint64x2_t v = vreinterpretq_u64_u8(vld1q_u8((const uint8_t *)b));
    *lo = vzip1q_u64(u, v);
    *hi = vzip2q_u64(u, v);
}

/* e^x for x <= 0, 4 at a time: exp256_neg's polynomial and clamp on NEON */
static inline float32x4_t exp4_neg(float32x4_t x) {
    x = vmaxq_f32(x, vdupq_n_f32(-87.0f));
    const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));
    r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
    float32x4_t p = vdupq_n_f32(1.9875691500e-4f);
    p = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), p, r);
    p = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), p, r);
    p = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.0f)), vmulq_f32(p, r), r);
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)), 23);
    return vmulq_f32(p, vreinterpretq_f32_s32(e));
}

/* silu_mul_row of the x86 helpers, 4 lanes at a time */
static inline void silu_mul_row(int64_t F, float *row) {
    const float32x4_t one = vdupq_n_f32(1.0f);
    int64_t f = 0;
    for (; f + 4 <= F; f += 4) {
        const float32x4_t g = vld1q_f32(row + f);
        const float32x4_t e = exp4_neg(vnegq_f32(vabsq_f32(g))); /* e^-|g| */
        const uint32x4_t neg = vcltq_f32(g, vdupq_n_f32(0.0f));
        const float32x4_t sig = vdivq_f32(vbslq_f32(neg, e, one), vaddq_f32(one, e));
        vst1q_f32(row + f, vmulq_f32(vmulq_f32(g, sig), vld1q_f32(row + F + f)));
    }
    for (; f < F; f++) {
        const float g = row[f];
        row[f] = g / (1.0f + expf(-g)) * row[F + f];
    }
}
#endif

/* The calling thread's scratch `slot` (0 or 1) of at least `bytes`, 64-byte aligned, kept
 * for its next calls (a decode step makes hundreds; malloc and free each time cost 1-3% of a
 * small GEMM; OpenMP's threads persist); NULL when it cannot grow. Each source including this
 * header has its own. */
static inline void *thread_scratch(int slot, size_t bytes) {
    static __thread void *buf[2];
    static __thread size_t cap[2];
    if (bytes > cap[slot]) {
        bytes += bytes / 4 + 64 - (bytes + bytes / 4) % 64; /* room to grow, 64-byte multiple */
        void *p = aligned_alloc(64, bytes);
        if (!p) return NULL;
        free(buf[slot]);
        buf[slot] = p;
        cap[slot] = bytes;
    }
    return buf[slot];
}

/* fn(j, ctx) for thread t of nt's equal share of the rows j of every group (group g: rows
 * start[g] .. start[g] + count[g]); the groups need not be back to back (an MoE call may
 * leave rows to another path). */
static inline void for_group_rows(int64_t n_groups, const int64_t *start, const int64_t *count,
                                  int t, int nt, void (*fn)(int64_t, void *), void *ctx) {
    int64_t rows = 0;
    for (int64_t g = 0; g < n_groups; g++) rows += count[g];
    const int64_t lo = rows * t / nt, hi = rows * (t + 1) / nt;
    int64_t before = 0;
    for (int64_t g = 0; g < n_groups && before < hi; g++) {
        const int64_t a = lo > before ? lo - before : 0;
        const int64_t b = hi - before < count[g] ? hi - before : count[g];
        for (int64_t r = a; r < b; r++) fn(start[g] + r, ctx);
        before += count[g];
    }
}

struct silu_rows {
    int64_t F;
    float *h;
};

static inline void silu_mul_one(int64_t j, void *ctx) {
    const struct silu_rows *s = ctx;
    silu_mul_row(s->F, s->h + j * 2 * s->F);
}

/* silu_mul_row over the rows of every group (rows of h 2F apart), thread t of nt taking an
 * equal share of them (for_group_rows) */
static inline void silu_mul_groups(int64_t n_groups, const int64_t *start, const int64_t *count,
                                   int64_t F, float *h, int t, int nt) {
    struct silu_rows s = {F, h};
    for_group_rows(n_groups, start, count, t, nt, silu_mul_one, &s);
}

/* How a kernel's rounded token rows (int4_idot.h, int8_sdot.h, bf16_mmla.h) take row i from
 * x (its K columns: the rows' own K) */
typedef void (*round_row_fn)(const void *rows, int64_t i, const float *x);

struct round_groups_ctx {
    int64_t K, ldx;
    float *x;
    int act;
    round_row_fn round;
    const void *rows;
};

static inline void round_groups_one(int64_t j, void *ctx) {
    const struct round_groups_ctx *c = ctx;
    float *row = c->x + j * c->ldx;
    if (c->act) silu_mul_row(c->K, row);
    c->round(c->rows, j, row);
}

/* Thread t of nt's share of the rows of an MoE call's groups (for_group_rows) rounded by
 * `round` into `rows`: row j of x (row stride ldx, K columns), first through the gated
 * activation (silu_mul_row: x is the hidden [gate K | up K]) when act is set */
static inline void round_group_rows(int64_t n_groups, const int64_t *start, const int64_t *count,
                                    int64_t K, float *x, int64_t ldx, int act,
                                    round_row_fn round, const void *rows, int t, int nt) {
    struct round_groups_ctx c = {K, ldx, x, act, round, rows};
    for_group_rows(n_groups, start, count, t, nt, round_groups_one, &c);
}

/* the weight stream of an MoE job in token-row equivalents (balanced_first_job) */
#define MOE_FIXED 8

/* The first job of thread t among nt when the n_groups groups of an MoE call have J jobs each
 * and a job of group g costs count[g] + fixed (its token rows, plus the weight rows it streams
 * in row equivalents): contiguous shares of equal cost. An even split of the jobs leaves a
 * thread with the busier experts waiting at the barrier (~5% of a prefill layer). */
static inline int64_t balanced_first_job(int64_t n_groups, const int64_t *count, int64_t J,
                                         int64_t fixed, int t, int nt) {
    if (t <= 0) return 0;
    if (t >= nt) return n_groups * J;
    int64_t total = 0;
    for (int64_t g = 0; g < n_groups; g++) total += count[g] + fixed;
    const int64_t target = total * J * t / nt; /* cost units before this thread's share */
    int64_t before = 0;
    for (int64_t g = 0; g < n_groups; g++) {
        const int64_t c = count[g] + fixed;
        if (before + c * J > target) {
            const int64_t j = (target - before + c - 1) / c;
            return g * J + (j < J ? j : J);
        }
        before += c * J;
    }
    return n_groups * J;
}

/* Thread t's jobs [*lo, *hi) of an MoE call's n_groups x J jobs (balanced_first_job with
 * MOE_FIXED), called inside the call's parallel region. */
static inline void moe_share(int64_t n_groups, const int64_t *count, int64_t J, int t, int nt,
                             int64_t *lo, int64_t *hi) {
    *lo = balanced_first_job(n_groups, count, J, MOE_FIXED, t, nt);
    *hi = balanced_first_job(n_groups, count, J, MOE_FIXED, t + 1, nt);
}

/* Work stealing over the jobs of a parallel loop (an MoE call's phase, a GEMM's panels). Each
 * thread starts on its own contiguous share, so it streams one run of weights as with a
 * static split; a thread whose share is done takes the back half of what is left of the
 * largest other share (contiguous again), and so on until no job is left. A static split
 * left one thread waiting at the barrier for the other's last jobs (the benchmark model's
 * MoE call at one token, int4: 11 of ~150 us a phase; 1.04x the call with stealing).
 *
 * A thread's range [lo, hi) is one 64-bit word (lo in the low half), so taking the next job
 * (lo + 1) and stealing (hi - k) are each one compare-and-swap. The slots are filled before
 * the parallel region for omp_get_max_threads() threads (jobs_share, moe_jobs_share); a
 * region that runs fewer threads (an `if` clause, nesting) steals the absent threads' shares.
 * Which thread runs a job never changes what it computes. Job indices stay below 2^32. */
struct job_slot {
    _Alignas(64) _Atomic uint64_t range; /* a cache line each */
};

static inline uint64_t job_range(int64_t lo, int64_t hi) {
    return (uint64_t)lo | ((uint64_t)hi << 32);
}

/* slots of ns threads, thread t's share [n * t / ns, n * (t + 1) / ns) of n jobs */
static inline void jobs_share(struct job_slot *s, int ns, int64_t n) {
    for (int t = 0; t < ns; t++)
        atomic_init(&s[t].range, job_range(n * t / ns, n * (t + 1) / ns));
}

/* slots of ns threads for an MoE call's n_groups x J jobs (moe_share's shares) */
static inline void moe_jobs_share(struct job_slot *s, int ns, int64_t n_groups,
                                  const int64_t *count, int64_t J) {
    for (int t = 0; t < ns; t++) {
        int64_t lo, hi;
        moe_share(n_groups, count, J, t, ns, &lo, &hi);
        atomic_init(&s[t].range, job_range(lo, hi));
    }
}

/* Thread t's next job of the ns slots, or -1 when none is left (inside the region). */
static inline int64_t jobs_next(struct job_slot *s, int t, int ns) {
    if (t >= ns) return -1; /* no slot: the others run its jobs */
    for (;;) {
        uint64_t r = atomic_load_explicit(&s[t].range, memory_order_relaxed);
        const int64_t lo = (int64_t)(r & 0xffffffffu), hi = (int64_t)(r >> 32);
        if (lo < hi) {
            if (atomic_compare_exchange_weak_explicit(&s[t].range, &r, job_range(lo + 1, hi),
                                                      memory_order_relaxed,
                                                      memory_order_relaxed))
                return lo;
            continue; /* a thief moved hi */
        }
        int victim = -1;
        int64_t most = 0;
        uint64_t rv = 0;
        for (int v = 0; v < ns; v++) {
            const uint64_t w = atomic_load_explicit(&s[v].range, memory_order_relaxed);
            const int64_t left = (int64_t)(w >> 32) - (int64_t)(w & 0xffffffffu);
            if (v != t && left > most) {
                most = left;
                victim = v;
                rv = w;
            }
        }
        if (victim < 0) return -1;
        const int64_t vlo = (int64_t)(rv & 0xffffffffu), vhi = (int64_t)(rv >> 32);
        const int64_t cut = vhi - (most + 1) / 2; /* the back half, the last job at least */
        if (atomic_compare_exchange_strong_explicit(&s[victim].range, &rv, job_range(vlo, cut),
                                                    memory_order_relaxed, memory_order_relaxed))
            atomic_store_explicit(&s[t].range, job_range(cut, vhi), memory_order_relaxed);
    }
}

/* An MoE call's output rows times their routing weights: y[r * ld + c] *= w[r] for the
 * `rows` rows and `cols` columns a down-projection job wrote */
static inline void weigh_rows(int64_t rows, const float *w, float *y, int64_t ld, int64_t cols) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) y[r * ld + c] *= w[r];
}

/* Between an MoE call's two projections, inside its parallel region: wait for every thread's
 * gate/up rows, apply the gated activation to this thread's share of the rows
 * (silu_mul_groups), and wait again before the down projection reads them. */
static inline void moe_activation_phase(int64_t n_groups, const int64_t *start,
                                        const int64_t *count, int64_t F, float *h, int t,
                                        int nt) {
#pragma omp barrier
    silu_mul_groups(n_groups, start, count, F, h, t, nt);
#pragma omp barrier
}

/* An MoE call on rounded token rows (int4_idot.h, int8_sdot.h, bf16_mmla.h): rows sorted by
 * expert, group g rows start[g] .. start[g] + count[g] of x [R, D]; its expert's gate/up
 * product into the hidden h [R, 2F] (`up`), then the down product into y [R, D] (`down`),
 * each in jobs of `width` weight rows (rows n0 .. n0 + nr of the expert's), with the kernel's
 * own operands at ctx. */
struct moe_rounded {
    int64_t n_groups;
    const int64_t *start, *count;
    int64_t D, F, width;
    const float *x, *route_w;
    float *h, *y;
    round_row_fn round; /* rows of x into rx (D columns), of the hidden into rh (F) */
    const void *rx, *rh;
    void (*up)(const struct moe_rounded *c, int64_t g, int64_t n0, int64_t nr);
    void (*down)(const struct moe_rounded *c, int64_t g, int64_t n0, int64_t nr);
    const void *ctx;
};

/* Thread t's jobs of one phase (`total` weight rows an expert; the slots s of ns threads,
 * moe_jobs_share), each through fn; with weigh (the down phase), the rows it wrote times
 * their routing weights after it */
static inline void moe_rounded_phase(const struct moe_rounded *c, int64_t total, int weigh,
                                     struct job_slot *s, int t, int ns,
                                     void (*fn)(const struct moe_rounded *, int64_t, int64_t,
                                                int64_t)) {
    const int64_t J = (total + c->width - 1) / c->width;
    for (int64_t job; (job = jobs_next(s, t, ns)) >= 0;) {
        const int64_t g = job / J, n0 = (job % J) * c->width;
        const int64_t nr = total - n0 < c->width ? total - n0 : c->width;
        fn(c, g, n0, nr);
        if (weigh)
            weigh_rows(c->count[g], c->route_w + c->start[g], c->y + c->start[g] * c->D + n0,
                       c->D, nr);
    }
}

/* The call in one parallel region: the groups' rows rounded once, the gate/up jobs, the
 * gated activation and the rounding of each hidden row, the down jobs (each output row
 * times its routing weight) */
static inline void moe_rounded_run(const struct moe_rounded *c) {
    const int ns = omp_get_max_threads();
    struct job_slot up[ns], down[ns];
    moe_jobs_share(up, ns, c->n_groups, c->count, (2 * c->F + c->width - 1) / c->width);
    moe_jobs_share(down, ns, c->n_groups, c->count, (c->D + c->width - 1) / c->width);
#pragma omp parallel
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        round_group_rows(c->n_groups, c->start, c->count, c->D, (float *)c->x, c->D, 0,
                         c->round, c->rx, t, nt);
#pragma omp barrier
        moe_rounded_phase(c, 2 * c->F, 0, up, t, ns, c->up);
#pragma omp barrier
        round_group_rows(c->n_groups, c->start, c->count, c->F, c->h, 2 * c->F, 1, c->round,
                         c->rh, t, nt);
#pragma omp barrier
        moe_rounded_phase(c, c->D, 1, down, t, ns, c->down);
    }
}

/* mb = min(left, lim) (lim <= 12) as a compile-time constant in each case: CALL(mb) inlines a
 * block of that many rows (cases past lim are dead code) */
#define DISPATCH_MB(left, lim, CALL)                       \
    switch ((left) >= (lim) ? (lim) : (int)(left)) {       \
        case 1: CALL(1); break;                            \
        case 2: CALL(2); break;                            \
        case 3: CALL(3); break;                            \
        case 4: CALL(4); break;                            \
        case 5: CALL(5); break;                            \
        case 6: CALL(6); break;                            \
        case 7: if ((lim) >= 7) CALL(7); break;            \
        case 8: if ((lim) >= 8) CALL(8); break;            \
        case 9: if ((lim) >= 9) CALL(9); break;            \
        case 10: if ((lim) >= 10) CALL(10); break;         \
        case 11: if ((lim) >= 11) CALL(11); break;         \
        default: if ((lim) >= 12) CALL(12); break;         \
    }
#endif
