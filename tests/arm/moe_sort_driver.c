/* moe_sort.c under emulation: reads [T, K, E, D] (int64), ids [T*K] (int64), w [T*K] and
 * x [T*D] (float32); writes G, expert, start, count, token (int64), weight, x_sorted
 * (float32), then moeserve_moe_combine of x_sorted by token: y [T*D] (float32). */
#include "blob.h"

int64_t moeserve_moe_sort(int64_t T, int64_t K, int64_t E, const int64_t *ids, const float *w,
                          const float *x, int64_t ldx, int64_t D, int64_t *expert,
                          int64_t *start, int64_t *count, int64_t *token, float *weight,
                          float *x_sorted);
void moeserve_moe_combine(int64_t R, int64_t T, int64_t D, const float *y_sorted,
                          const int64_t *token, float *y);

int main(void) {
    int64_t n;
    const int64_t *dims = blob_read(BLOB_I64, &n);
    const int64_t T = dims[0], K = dims[1], E = dims[2], D = dims[3], R = T * K;
    const int64_t *ids = blob_read(BLOB_I64, &n);
    const float *w = blob_read(BLOB_F32, &n), *x = blob_read(BLOB_F32, &n);
    int64_t *expert = calloc(E + 1, 8), *start = calloc(E + 1, 8), *count = calloc(E + 1, 8);
    int64_t *token = calloc(R + 1, 8);
    float *weight = calloc(R + 1, 4), *x_sorted = calloc(R * D + 1, 4), *y = calloc(T * D + 1, 4);
    const int64_t G = moeserve_moe_sort(T, K, E, ids, w, x, D, D, expert, start, count, token,
                                        weight, x_sorted);
    blob_write(BLOB_I64, 1, &G);
    const int64_t g = G < 0 ? 0 : G;
    blob_write(BLOB_I64, g, expert);
    blob_write(BLOB_I64, g, start);
    blob_write(BLOB_I64, g, count);
    blob_write(BLOB_I64, R, token);
    blob_write(BLOB_F32, R, weight);
    blob_write(BLOB_F32, R * D, x_sorted);
    moeserve_moe_combine(R, T, D, x_sorted, token, y);
    blob_write(BLOB_F32, T * D, y);
    return 0;
}
