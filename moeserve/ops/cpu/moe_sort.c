/* A decode step's (token, choice) pairs sorted by expert for the one-call MoE kernels, and the
 * weighted expert rows added back per token: one C call each instead of an argsort, a bincount,
 * a gather, an index and an index_add_ (references: ops/cpu/moe_sort.py; ops/moe.py's
 * sort_rows and combine_rows call one or the other).
 *
 * Pair r = t * K + k is token t's k-th choice, ids[r] its expert. The sort is stable (a
 * counting sort), so rows of one expert keep their token order, as argsort(stable=True) does.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Writes, for the G experts with pairs (ascending id): expert[g], start[g] (first sorted row),
 * count[g]; per sorted row i: token[i], weight[i] = w[r], x_sorted[i] = x[token[i]] (D floats;
 * x rows at x + t * ldx). Returns G; -1 when an id lies outside [0, E). */
int64_t moeserve_moe_sort(int64_t T, int64_t K, int64_t E, const int64_t *ids, const float *w,
                          const float *x, int64_t ldx, int64_t D, int64_t *expert,
                          int64_t *start, int64_t *count, int64_t *token, float *weight,
                          float *x_sorted) {
    const int64_t R = T * K;
    int64_t *next = calloc(E > 0 ? E : 1, sizeof(int64_t));
    for (int64_t r = 0; r < R; r++) {
        if (ids[r] < 0 || ids[r] >= E) {
            free(next);
            return -1;
        }
        next[ids[r]]++;
    }
    int64_t G = 0, pos = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t n = next[e];
        next[e] = pos;
        if (n) {
            expert[G] = e, start[G] = pos, count[G] = n;
            G++;
            pos += n;
        }
    }
    for (int64_t r = 0; r < R; r++) {
        const int64_t i = next[ids[r]]++, t = r / K;
        token[i] = t;
        weight[i] = w[r];
        memcpy(x_sorted + i * D, x + t * ldx, D * sizeof(float));
    }
    free(next);
    return G;
}

/* y[t] = sum of y_sorted[i] over the sorted rows i of token t, added in row order (as
 * index_add_ does); y is [T, D], zeroed first. */
void moeserve_moe_combine(int64_t R, int64_t T, int64_t D, const float *y_sorted,
                          const int64_t *token, float *y) {
    memset(y, 0, T * D * sizeof(float));
    for (int64_t i = 0; i < R; i++) {
        float *dst = y + token[i] * D;
        const float *src = y_sorted + i * D;
        for (int64_t d = 0; d < D; d++) dst[d] += src[d];
    }
}
