/* What every AMX kernel of this folder (bf16_amx.c: bf16, int8_amx.c: int8) needs before its first
 * tile instruction: the process's permission for the tile state and each thread's tile
 * configuration (eight 16 x 64-byte tiles). Include inside a section whose target has
 * amx-tile; not a translation unit of its own. */
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

#endif
