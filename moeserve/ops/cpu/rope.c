/* Rotary embedding and the MLA latent write for a step's tokens, fused: one call per layer
 * instead of a norm, two rotary ops (each a handful of torch ops), a concatenation and an
 * index copy. References: layers/rotary.py (RotaryEmbedding) and layers/mla.py (the torch
 * path of MLAttention.forward).
 *
 * Rotary convention (cos/sin rows already scaled by the attention factor, R/2 entries each):
 *   (a, b) = (x[2i], x[2i+1]) when interleaved, else (x[i], x[i + R/2])
 *   out[i] = a cos_i - b sin_i,  out[i + R/2] = b cos_i + a sin_i
 * so an interleaved input comes out de-interleaved, as transformers' DeepSeek code does.
 */
#include <math.h>
#include <stdint.h>

#define MAX_HALF 512

/* rotate R numbers at x (unit stride) in place, using cos/sin rows of R/2 */
static inline void rope_inplace(float *x, int64_t R, const float *cos, const float *sin,
                                int interleave) {
    const int64_t half = R / 2;
    float a[MAX_HALF], b[MAX_HALF];
    for (int64_t i = 0; i < half; i++) {
        a[i] = interleave ? x[2 * i] : x[i];
        b[i] = interleave ? x[2 * i + 1] : x[i + half];
    }
    for (int64_t i = 0; i < half; i++) {
        x[i] = a[i] * cos[i] - b[i] * sin[i];
        x[i + half] = b[i] * cos[i] + a[i] * sin[i];
    }
}

/* For each of T tokens (single-threaded: a step's few rows are microseconds of work):
 *   q[t, h, N:N+R] roped in place, for the H heads (row t at q + t*ldq, head h at + h*(N+R));
 *   cache[slot[t], :C] = rmsnorm(kv[t, :C]) * norm_w;  cache[slot[t], C:C+R] = rope(kv[t, C:]).
 * cos/sin are the tables [max_positions, R/2]; pos[t] selects the row. */
void moeserve_mla_rope_cache(int64_t T, int64_t H, int64_t N, int64_t R, int64_t C,
                             float *q, int64_t ldq, const float *kv, int64_t ldkv,
                             const float *norm_w, float eps, const float *cos_tab,
                             const float *sin_tab, const int64_t *pos, int interleave,
                             float *cache, const int64_t *slot) {
    const int64_t half = R / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *cs = cos_tab + pos[t] * half, *sn = sin_tab + pos[t] * half;
        float *qt = q + t * ldq;
        for (int64_t h = 0; h < H; h++) rope_inplace(qt + h * (N + R) + N, R, cs, sn, interleave);
        const float *kt = kv + t * ldkv;
        float *row = cache + slot[t] * (C + R);
        double ss = 0.0;
        for (int64_t c = 0; c < C; c++) ss += (double)kt[c] * kt[c];
        const float inv = 1.0f / sqrtf((float)(ss / (double)C) + eps);
        for (int64_t c = 0; c < C; c++) row[c] = kt[c] * inv * norm_w[c];
        for (int64_t r = 0; r < R; r++) row[C + r] = kt[C + r];
        rope_inplace(row + C, R, cs, sn, interleave);
    }
}
