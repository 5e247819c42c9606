/* attention.c's value update of a tile, written once in the vector macros of the ISA that
 * includes it (VF, W lanes, VB_NV vectors at most, VLOADU, VSTOREU, VMUL, VDUP, VFMA; VFMA(a,
 * b, c) = a * b + c) under the name VALUE_BLOCK with the attributes VALUE_ATTR:
 *   acc[i][c0 .. c0 + W * NV) = acc[i] * alpha[i] + sum_t p[i][t] * val_t
 * for heads i < mh <= 4 and NV <= VB_NV vectors; missing heads repeat head 0 and are not
 * stored. Included for AVX2, AVX-512F and aarch64; not a translation unit of its own. With
 * VALUE_UNDEF defined (x86, whose two ISAs define the macros in turn) it undefines them all
 * after use; VALUE_BLOCK and VALUE_ATTR always. */
VALUE_ATTR void VALUE_BLOCK(const int NV, int mh, int64_t nt, int64_t c0, const float *p,
                            const float *alpha, const float *const *val, float *acc,
                            int64_t acc_sh) {
    VF a[4][VB_NV];
    const float *pr[4];
    for (int i = 0; i < 4; i++) {
        const int ii = i < mh ? i : 0;
        pr[i] = p + ii * TILE;
        for (int k = 0; k < NV; k++)
            a[i][k] = VMUL(VLOADU(acc + ii * acc_sh + c0 + W * k), VDUP(alpha[ii]));
    }
    for (int64_t t = 0; t < nt; t++) {
        VF x[VB_NV];
        for (int k = 0; k < NV; k++) x[k] = VLOADU(val[t] + c0 + W * k);
        for (int i = 0; i < 4; i++) {
            const VF w = VDUP(pr[i][t]);
            for (int k = 0; k < NV; k++) a[i][k] = VFMA(x[k], w, a[i][k]);
        }
    }
    for (int i = 0; i < mh; i++)
        for (int k = 0; k < NV; k++) VSTOREU(acc + i * acc_sh + c0 + W * k, a[i][k]);
}
#undef VALUE_BLOCK
#undef VALUE_ATTR
#ifdef VALUE_UNDEF
#undef VF
#undef W
#undef VB_NV
#undef VLOADU
#undef VSTOREU
#undef VMUL
#undef VDUP
#undef VFMA
#undef VALUE_UNDEF
#endif
