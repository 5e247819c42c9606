/* int8.c under emulation. Reads an int64 array whose first element picks the kernel, the rest
 * its sizes, then its inputs; writes its outputs:
 *   0 gemm     [0, M, N, K], x [M K] (float32), q [N K] (int8 values as int64), scale [N]
 *                                                                      -> y [M N]
 *   1 moe      [1, G, D, F], expert, start, count [G] (int64), x [R D], q13 [E 2F D] (int64),
 *              s13 [E 2F], q2 [E D F] (int64), s2 [E D], route_w [R]   -> y [R D]
 *   2 dequant  [2, N, K], q [N K] (int64), scale [N]                    -> out [N K]
 *   3 head     [3, H, M, K, N, g, grouped_out], x [H M K], q [H K N] (int64), s (grouped_out:
 *              [H K N/g], else [H K/g N])                                  -> y [H M N]
 * (int8 weights travel as int64, blob.h's integer type, and are narrowed here.) */
#include "blob.h"

void moeserve_int8_gemm_nt_small(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx,
                                 const int8_t *q, int64_t ldq, const float *scale, float *y,
                                 int64_t ldy, int wide);
void moeserve_int8_moe_small(int64_t n_groups, const int64_t *expert, const int64_t *start,
                             const int64_t *count, int64_t D, int64_t F, const float *x,
                             const int8_t *q13, const float *s13, const int8_t *q2,
                             const float *s2, const float *route_w, float *h, float *y,
                             int wide);
void moeserve_int8_dequant(int64_t N, int64_t K, const int8_t *q, int64_t ldq,
                           const float *scale, float *out, int64_t ldo);
void moeserve_int8_head_gemm_small(int64_t Hh, int64_t M, int64_t N, int64_t K, const float *x,
                                   int64_t sxh, int64_t sxm, const int8_t *q, int64_t sqh,
                                   int64_t ldq, const float *s, int64_t g, int grouped_out,
                                   float *y, int64_t syh, int64_t sym, int wide);

/* an int64 array narrowed to int8, in a buffer of its own (exactly its size: a read past
 * its end is the emulator's fault to find, not hidden by slack) */
static int8_t *read_q(void) {
    int64_t n;
    const int64_t *v = blob_read(BLOB_I64, &n);
    int8_t *q = malloc(n ? n : 1);
    for (int64_t i = 0; i < n; i++) q[i] = (int8_t)v[i];
    return q;
}

int main(void) {
    int64_t n;
    const int64_t *d = blob_read(BLOB_I64, &n);
    if (d[0] == 0) {
        const int64_t M = d[1], N = d[2], K = d[3];
        const float *x = blob_read(BLOB_F32, &n);
        const int8_t *q = read_q();
        const float *scale = blob_read(BLOB_F32, &n);
        float *y = malloc(M * N * sizeof(float));
        moeserve_int8_gemm_nt_small(M, N, K, x, K, q, K, scale, y, N, 1);
        blob_write(BLOB_F32, M * N, y);
    } else if (d[0] == 1) {
        const int64_t G = d[1], D = d[2], F = d[3];
        const int64_t *expert = blob_read(BLOB_I64, &n), *start = blob_read(BLOB_I64, &n);
        const int64_t *count = blob_read(BLOB_I64, &n);
        int64_t R;
        const float *x = blob_read(BLOB_F32, &R);
        const int8_t *q13 = read_q();
        const float *s13 = blob_read(BLOB_F32, &n);
        const int8_t *q2 = read_q();
        const float *s2 = blob_read(BLOB_F32, &n), *route_w = blob_read(BLOB_F32, &n);
        R /= D;
        float *h = malloc(R * 2 * F * sizeof(float)), *y = malloc(R * D * sizeof(float));
        moeserve_int8_moe_small(G, expert, start, count, D, F, x, q13, s13, q2, s2, route_w, h, y,
                                1);
        blob_write(BLOB_F32, R * D, y);
    } else if (d[0] == 3) {
        const int64_t H = d[1], M = d[2], K = d[3], N = d[4], g = d[5];
        const float *x = blob_read(BLOB_F32, &n);
        const int8_t *q = read_q();
        const float *s = blob_read(BLOB_F32, &n);
        float *y = malloc(H * M * N * sizeof(float));
        moeserve_int8_head_gemm_small(H, M, N, K, x, M * K, K, q, K * N, N, s, g, (int)d[6], y,
                                      M * N, N, 1);
        blob_write(BLOB_F32, H * M * N, y);
    } else {
        const int64_t N = d[1], K = d[2];
        const int8_t *q = read_q();
        const float *scale = blob_read(BLOB_F32, &n);
        float *out = malloc(N * K * sizeof(float));
        moeserve_int8_dequant(N, K, q, K, scale, out, K);
        blob_write(BLOB_F32, N * K, out);
    }
    return 0;
}
