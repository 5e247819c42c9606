/* attention.c under emulation: moeserve_paged_decode_attention on the arguments
 * ops/cpu/attention.py's _call would pass. Reads the int64 scalars [B, G, Hg, Dk, Dv, D1,
 * q1_sb, q1_sh, q2_sb, q2_sh, ld_slot, k_off, k_hs, v_off, v_hs, ldt, bs, out_sb, out_sh,
 * cache_bf16, wide], scale [1], then the memory each pointer spans: q1 and q2 (float32), the cache
 * (float32, or uint16 bf16 bits), the block table and lens (int32) and out (float32);
 * writes the return code [1] (int64) and out. */
#include "blob.h"

int moeserve_paged_decode_attention(
    int64_t B, int64_t G, int64_t Hg, int64_t Dk, int64_t Dv, int64_t D1, const float *q1,
    int64_t q1_sb, int64_t q1_sh, const float *q2, int64_t q2_sb, int64_t q2_sh, float scale,
    const void *cache, int64_t ld_slot, int64_t k_off, int64_t k_hs, int64_t v_off,
    int64_t v_hs, const int32_t *table, int64_t ldt, const int32_t *lens, int64_t bs,
    float *out, int64_t out_sb, int64_t out_sh, int cache_bf16, int wide);

int main(void) {
    int64_t n, n_out;
    const int64_t *d = blob_read(BLOB_I64, &n);
    const float *scale = blob_read(BLOB_F32, &n);
    const float *q1 = blob_read(BLOB_F32, &n), *q2 = blob_read(BLOB_F32, &n);
    const void *cache = blob_read(d[19] ? BLOB_U16 : BLOB_F32, &n);
    const int32_t *table = blob_read(BLOB_I32, &n), *lens = blob_read(BLOB_I32, &n);
    float *out = blob_read(BLOB_F32, &n_out);
    const int64_t rc = moeserve_paged_decode_attention(
        d[0], d[1], d[2], d[3], d[4], d[5], q1, d[6], d[7], q2, d[8], d[9], scale[0], cache,
        d[10], d[11], d[12], d[13], d[14], table, d[15], lens, d[16], out, d[17], d[18],
        (int)d[19], (int)d[20]);
    blob_write(BLOB_I64, 1, &rc);
    blob_write(BLOB_F32, n_out, out);
    return 0;
}
