/* The job of the AMX GEMMs: weight rows n0 .. n0 + nr (nr 16 or 32) against every packed
 * 16-row block of the token rows, two blocks at a time into four accumulator tiles (0: weight
 * rows 0-15 x block 0, 1: x block 1, 2-3: rows 16-31), the result tiles handed to the
 * format's store. Included once by each AMX kernel inside its target section, after
 * amx_tiles.h and panels.h (not a translation unit of its own); the includer defines
 *   AJ_T       the weight and packed-row element (uint16_t: bf16 in bf16_amx.c, int8_t in
 *              int8_amx.c)
 *   AJ_KT      k per tile row: 64 bytes of AJ_T (32 bf16, 64 int8)
 *   AJ_DP      the tile product (_tile_dpbf16ps, _tile_dpbssd)
 *   AJ_OUT     the output's struct: p, ld and by_column (the 4-byte accumulator tiles stored
 *              as they are: column n, row m at p + 4 * (n * ld + m) bytes)
 *   AJ_STORE   AJ_STORE(t, m0, mv, n0, o): the accumulator tile t[n][m] (16 x 16 4-byte
 *              values, 64-byte aligned) into output rows m0 .. m0 + min(mv, 16), columns
 *              n0 .. n0 + 16
 * Weights are the A operand, read straight from their rows (ldw elements apart); the token
 * rows are the B operand, packed in blocks of 16 x 64 bytes: block (mb, kb) at
 * xp + (mb * KB + kb) * 16 * AJ_KT (KB = K / AJ_KT). */
#ifndef MOESERVE_AMX_JOB_H
#define MOESERVE_AMX_JOB_H

#define AJ_BLK (16 * AJ_KT) /* elements per packed block (1 KB) */

/* The KB k blocks of one pair of token blocks (b1 unused unless two) against the job's one or
 * two weight tiles, into accumulators 0-3 */
static inline __attribute__((always_inline)) void run_k(int nr, int two, const AJ_T *a0,
                                                        const AJ_T *a1, int64_t sw,
                                                        const AJ_T *b0, const AJ_T *b1,
                                                        int64_t KB, struct prefetcher *pf) {
    for (int64_t kb = 0; kb < KB; kb++) {
        prefetch_step(pf);
        _tile_loadd(4, a0 + AJ_KT * kb, sw);
        _tile_loadd(6, b0 + kb * AJ_BLK, 64);
        AJ_DP(0, 4, 6);
        if (nr == 32) {
            _tile_loadd(5, a1 + AJ_KT * kb, sw);
            AJ_DP(2, 5, 6);
        }
        if (two) {
            _tile_loadd(7, b1 + kb * AJ_BLK, 64);
            AJ_DP(1, 4, 7);
            if (nr == 32) AJ_DP(3, 5, 7);
        }
    }
}

/* Weight rows n0 .. n0 + nr (w points at row n0) against the M packed token rows at xp:
 * output columns n0 .. n0 + nr of every row. Meanwhile the 32 rows at next (the thread's
 * next job; 0: none) are fetched into L2: a job's first pass reads 32 rows 2 KB or more
 * apart, too many streams for the hardware prefetcher (measured on the bf16 prefill MoE call
 * at 512 tokens: 1.2-1.3x). Splitting K into chunks whose weight tiles stay in L1 across the
 * token blocks was slower (0.87-0.92x at 48-2048 rows). */
static void gemm_job(int64_t K, const AJ_T *w, int64_t ldw, int nr, const AJ_T *xp, int64_t M,
                     int64_t n0, const AJ_OUT *o, const AJ_T *next) {
    const int64_t KB = K / AJ_KT, MB = (M + 15) / 16, sw = (int64_t)sizeof(AJ_T) * ldw;
    struct prefetcher pf;
    prefetcher_init(&pf, next, sw, (int64_t)sizeof(AJ_T) * K, 32, KB * ((MB + 1) / 2));
    const AJ_T *a0 = w, *a1 = w + 16 * ldw;
    float t[4][256] __attribute__((aligned(64)));
    for (int64_t mb = 0; mb < MB; mb += 2) {
        const int two = mb + 1 < MB;
        const AJ_T *b0 = xp + mb * KB * AJ_BLK, *b1 = b0 + KB * AJ_BLK;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        if (nr == 32 && two)
            run_k(32, 1, a0, a1, sw, b0, b1, KB, &pf);
        else if (nr == 32)
            run_k(32, 0, a0, a1, sw, b0, b1, KB, &pf);
        else if (two)
            run_k(16, 1, a0, a1, sw, b0, b1, KB, &pf);
        else
            run_k(16, 0, a0, a1, sw, b0, b1, KB, &pf);
        const int64_t m0 = 16 * mb;
        if (o->by_column) { /* no transposes: [n][m] blocks of 16 x 16 */
            float *d = (float *)o->p + n0 * o->ld + m0;
            const int64_t st = 4 * o->ld;
            _tile_stored(0, d, st);
            if (two) _tile_stored(1, d + 16, st);
            if (nr == 32) _tile_stored(2, d + 16 * o->ld, st);
            if (nr == 32 && two) _tile_stored(3, d + 16 * o->ld + 16, st);
            continue;
        }
        _tile_stored(0, t[0], 64);
        _tile_stored(1, t[1], 64);
        _tile_stored(2, t[2], 64);
        _tile_stored(3, t[3], 64);
        AJ_STORE(t[0], m0, M - m0, n0, o);
        if (two) AJ_STORE(t[1], m0 + 16, M - m0 - 16, n0, o);
        if (nr == 32) {
            AJ_STORE(t[2], m0, M - m0, n0 + 16, o);
            if (two) AJ_STORE(t[3], m0 + 16, M - m0 - 16, n0 + 16, o);
        }
    }
}

#endif
