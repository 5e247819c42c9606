/* fp32.c under emulation. Reads an int64 array whose first element picks the kernel, the rest
 * its sizes, then its inputs; writes its outputs:
 *   0 gemm       [0, M, N, K], x [M K], w [N K]                         -> y [M N]
 *   1 moe        [1, G, D, F], expert, start, count [G] (int64), x [R D], w13 [E 2F D],
 *                w2 [E D F], route_w [R]                               -> y [R D]
 *   2 head gemm  [2, H, M, N, K], x [H M K], w [H N K]                   -> y [H M N]
 *   3 rms norm   [3, rows, D], x [rows D], w [D], eps [1]                -> y [rows D]
 *   4 routing    [4, T, E, n_group, topk_group, top_k, norm, extra], logits [T E],
 *                bias [E] (empty: none), scale [1]  -> ids (int64), weights, counts (int64)
 *   5, 6, 7      0, 1 and 2 with bf16 weights (uint16 bits): the moeserve_bf16w_* twins */
#include "blob.h"

void moeserve_gemm_nt_small(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx,
                            const float *w, int64_t ldw, float *y, int64_t ldy, int wide);
void moeserve_moe_small(int64_t n_groups, const int64_t *expert, const int64_t *start,
                        const int64_t *count, int64_t D, int64_t F, const float *x,
                        const float *w13, const float *w2, const float *route_w, float *h,
                        float *y, int wide);
void moeserve_head_gemm_nt_small(int64_t Hh, int64_t M, int64_t N, int64_t K, const float *x,
                                 int64_t sxh, int64_t sxm, const float *w, int64_t swh,
                                 int64_t ldw, float *y, int64_t syh, int64_t sym, int wide);
void moeserve_bf16w_gemm_nt_small(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx,
                                  const uint16_t *w, int64_t ldw, float *y, int64_t ldy,
                                  int wide);
void moeserve_bf16w_moe_small(int64_t n_groups, const int64_t *expert, const int64_t *start,
                              const int64_t *count, int64_t D, int64_t F, const float *x,
                              const uint16_t *w13, const uint16_t *w2, const float *route_w,
                              float *h, float *y, int wide);
void moeserve_bf16w_head_gemm_nt_small(int64_t Hh, int64_t M, int64_t N, int64_t K,
                                       const float *x, int64_t sxh, int64_t sxm,
                                       const uint16_t *w, int64_t swh, int64_t ldw, float *y,
                                       int64_t syh, int64_t sym, int wide);
void moeserve_rms_norm(int64_t rows, int64_t D, const float *x, int64_t ldx, const float *w,
                       float eps, float *y, int64_t ldy);
void moeserve_add_rms_norm(int64_t rows, int64_t D, float *h, int64_t ldh, const float *y,
                           int64_t ldy, const float *w, float eps, float *out, int64_t ldo);
void moeserve_route_grouped_sigmoid(int64_t T, int64_t E, int64_t n_group, int64_t topk_group,
                                    int64_t top_k, const float *logits, const float *bias,
                                    int norm, float scale, int64_t *ids, float *weights,
                                    int64_t *counts, int64_t extra);

int main(void) {
    int64_t n;
    const int64_t *d = blob_read(BLOB_I64, &n);
    const int64_t nd = n;
    const int op = (int)(d[0] >= 5 ? d[0] - 5 : d[0]), bf16 = d[0] >= 5;
    const int WTYPE = bf16 ? BLOB_U16 : BLOB_F32; /* the weights' blob type */
    if (op == 0) {
        const int64_t M = d[1], N = d[2], K = d[3];
        const float *x = blob_read(BLOB_F32, &n);
        const void *w = blob_read(WTYPE, &n);
        float *y = malloc(M * N * sizeof(float));
        if (bf16)
            moeserve_bf16w_gemm_nt_small(M, N, K, x, K, w, K, y, N, 1);
        else
            moeserve_gemm_nt_small(M, N, K, x, K, w, K, y, N, 1);
        blob_write(BLOB_F32, M * N, y);
    } else if (op == 1) {
        const int64_t G = d[1], D = d[2], F = d[3];
        const int64_t *expert = blob_read(BLOB_I64, &n), *start = blob_read(BLOB_I64, &n);
        const int64_t *count = blob_read(BLOB_I64, &n);
        int64_t R;
        const float *x = blob_read(BLOB_F32, &R);
        const void *w13 = blob_read(WTYPE, &n), *w2 = blob_read(WTYPE, &n);
        const float *route_w = blob_read(BLOB_F32, &n);
        R /= D;
        float *h = malloc(R * 2 * F * sizeof(float)), *y = malloc(R * D * sizeof(float));
        if (bf16)
            moeserve_bf16w_moe_small(G, expert, start, count, D, F, x, w13, w2, route_w, h, y, 1);
        else
            moeserve_moe_small(G, expert, start, count, D, F, x, w13, w2, route_w, h, y, 1);
        blob_write(BLOB_F32, R * D, y);
    } else if (op == 2) {
        const int64_t H = d[1], M = d[2], N = d[3], K = d[4];
        const float *x = blob_read(BLOB_F32, &n);
        const void *w = blob_read(WTYPE, &n);
        float *y = malloc(H * M * N * sizeof(float));
        if (bf16)
            moeserve_bf16w_head_gemm_nt_small(H, M, N, K, x, M * K, K, w, N * K, K, y, M * N, N,
                                              1);
        else
            moeserve_head_gemm_nt_small(H, M, N, K, x, M * K, K, w, N * K, K, y, M * N, N, 1);
        blob_write(BLOB_F32, H * M * N, y);
    } else if (op == 3) {
        const int64_t rows = d[1], D = d[2];
        const float *x = blob_read(BLOB_F32, &n), *w = blob_read(BLOB_F32, &n);
        const float *eps = blob_read(BLOB_F32, &n);
        float *y = malloc(rows * D * sizeof(float));
        if (nd > 3 && d[3]) { /* the residual call: h = x + r (r the next blob), y = norm(h) */
            const float *r = blob_read(BLOB_F32, &n);
            float *h = malloc(rows * D * sizeof(float));
            memcpy(h, x, rows * D * sizeof(float));
            moeserve_add_rms_norm(rows, D, h, D, r, D, w, eps[0], y, D);
            blob_write(BLOB_F32, rows * D, h);
        } else {
            moeserve_rms_norm(rows, D, x, D, w, eps[0], y, D);
        }
        blob_write(BLOB_F32, rows * D, y);
    } else {
        const int64_t T = d[1], E = d[2], top_k = d[5], extra = d[7];
        int64_t nb;
        const float *logits = blob_read(BLOB_F32, &n), *bias = blob_read(BLOB_F32, &nb);
        const float *scale = blob_read(BLOB_F32, &n);
        const int64_t ld = top_k + (extra >= 0);
        int64_t *ids = malloc(T * ld * sizeof(int64_t)), *counts = calloc(E, sizeof(int64_t));
        float *weights = malloc(T * ld * sizeof(float));
        moeserve_route_grouped_sigmoid(T, E, d[3], d[4], top_k, logits, nb ? bias : 0,
                                       (int)d[6], scale[0], ids, weights, counts, extra);
        blob_write(BLOB_I64, T * ld, ids);
        blob_write(BLOB_F32, T * ld, weights);
        blob_write(BLOB_I64, E, counts);
    }
    return 0;
}
