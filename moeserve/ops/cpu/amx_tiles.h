/* What every AMX kernel of this folder (bf16_amx.c: bf16, int8_amx.c: int8, int4_amx.c: int4)
 * needs before its first tile instruction: the process's permission for the tile state and
 * each thread's tile configuration (eight 16 x 64-byte tiles); and how their MoE calls split
 * the experts' rows into 16-row blocks and the jobs among threads. Include inside a section
 * whose target has amx-tile; not a translation unit of its own. */
#ifndef MOESERVE_AMX_TILES_H
#define MOESERVE_AMX_TILES_H
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 0 once this process may use the AMX tile registers (Linux asks processes to request the
 * 8 KB of extra state before the first tile instruction), -1 when the kernel refuses. */
static inline int amx_request(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Eight 16 x 64-byte tiles: 0-3 accumulators, 4-5 weight rows, 6-7 token blocks. A
 * constant in memory: GCC 12 does not count LDTILECFG as reading its operand, so a struct
 * filled on the stack just before it can lose its stores. */
static const struct tile_config TILES = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

/* every thread that runs tiles loads the configuration */
static inline void tiles_on(void) { _tile_loadconfig(&TILES); }

/* The MoE calls' groups (an expert's rows, padded to 16 in the packed rows): first_block[g]
 * is the number of packed 16-row blocks before group g; returns the total. */
static inline int64_t group_blocks(int64_t G, const int64_t *count, int64_t *first_block) {
    int64_t blocks = 0;
    for (int64_t g = 0; g < G; g++) {
        first_block[g] = blocks;
        blocks += (count[g] + 15) / 16;
    }
    return blocks;
}

/* Thread t's jobs [*lo, *hi) of the G x J jobs of an MoE call's phase, contiguous shares of
 * equal cost (common.h: balanced_first_job; a job costs its rows plus 16 for its weights) */
static inline void job_share(int64_t G, const int64_t *count, int64_t J, int t, int nt,
                             int64_t *lo, int64_t *hi) {
    *lo = balanced_first_job(G, count, J, 16, t, nt);
    *hi = balanced_first_job(G, count, J, 16, t + 1, nt);
}

#endif
