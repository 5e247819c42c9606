/* The fp32 form's dot of int8.c and int4.c (included in each ISA's body of both, after its
 * vector macros VF, VZERO, VLOAD, VLOADU, VFMA, VHSUM, MBF and suffix SFX): token rows
 * against a panel's weight rows once they are dequantized into an fp32 chunk. */

/* rows 0..mb-1 of x (already offset to the chunk) against fp32 rows w0 and w1 of length kc
 * (a multiple of W); y[i] = dot when first, else y[i] += dot. */
static inline __attribute__((always_inline)) void CAT(dot_block_f, SFX)(
    const int mb, const int two, int first, int64_t kc, const float *x, int64_t ldx,
    const float *w0, const float *w1, float *y, int64_t ldy) {
    VF a0[MBF], a1[MBF];
#pragma GCC unroll 12
    for (int i = 0; i < MBF; i++) {
        a0[i] = VZERO();
        a1[i] = VZERO();
    }
    for (int64_t k = 0; k < kc; k += W) {
        const VF v0 = VLOAD(w0 + k), v1 = VLOAD(w1 + k);
#pragma GCC unroll 12
        for (int i = 0; i < MBF; i++) {
            if (i < mb) {
                const VF xv = VLOADU(x + i * ldx + k);
                a0[i] = VFMA(xv, v0, a0[i]);
                a1[i] = VFMA(xv, v1, a1[i]);
            }
        }
    }
#pragma GCC unroll 12
    for (int i = 0; i < MBF; i++) {
        if (i < mb) {
            const float d0 = VHSUM(a0[i]), d1 = VHSUM(a1[i]);
            y[i * ldy] = first ? d0 : y[i * ldy] + d0;
            if (two) y[i * ldy + 1] = first ? d1 : y[i * ldy + 1] + d1;
        }
    }
}
