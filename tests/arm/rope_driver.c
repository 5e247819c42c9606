/* rope.c under emulation: reads [T, H, N, R, C, ldq, q_offset, ldkv, kv_offset, interleave]
 * (int64), the q buffer, the kv buffer, norm_w [C], eps [1], cos and sin [P * R/2] (float32),
 * positions [T] (int64), the cache [S * (C + R)] (float32) and slots [T] (int64); writes the
 * q buffer and the cache after moeserve_mla_rope_cache. */
#include "blob.h"

void moeserve_mla_rope_cache(int64_t T, int64_t H, int64_t N, int64_t R, int64_t C,
                             float *q, int64_t ldq, const float *kv, int64_t ldkv,
                             const float *norm_w, float eps, const float *cos_tab,
                             const float *sin_tab, const int64_t *pos, int interleave,
                             float *cache, const int64_t *slot);

int main(void) {
    int64_t n, nq, ncache;
    const int64_t *d = blob_read(BLOB_I64, &n);
    float *q = blob_read(BLOB_F32, &nq);
    const float *kv = blob_read(BLOB_F32, &n), *norm_w = blob_read(BLOB_F32, &n);
    const float *eps = blob_read(BLOB_F32, &n);
    const float *cos_tab = blob_read(BLOB_F32, &n), *sin_tab = blob_read(BLOB_F32, &n);
    const int64_t *pos = blob_read(BLOB_I64, &n);
    float *cache = blob_read(BLOB_F32, &ncache);
    const int64_t *slot = blob_read(BLOB_I64, &n);
    moeserve_mla_rope_cache(d[0], d[1], d[2], d[3], d[4], q + d[6], d[5], kv + d[8], d[7], norm_w,
                            eps[0], cos_tab, sin_tab, pos, (int)d[9], cache, slot);
    blob_write(BLOB_F32, nq, q);
    blob_write(BLOB_F32, ncache, cache);
    return 0;
}
