/* A packed token bitmask applied to fp32 logits (structured output): bit i of word w allows
 * token 32 w + i; every token not allowed, and every token past the mask, becomes -inf.
 * Reference: moeserve/grammar/bitmask.py (apply_bitmask, plain torch).
 *
 * A word with every bit set (the common case inside a JSON string) is skipped; one with no
 * bit set (outside one) is a run of 32 stores. Rows run in parallel.
 */
#include <math.h>
#include <stdint.h>

void moeserve_apply_token_bitmask(float *logits, int64_t rows, int64_t vocab, int64_t stride,
                                  const int32_t *mask, int64_t words) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *row = logits + r * stride;
        const uint32_t *m = (const uint32_t *)(mask + r * words);
        int64_t covered = words * 32 < vocab ? words * 32 : vocab;
        for (int64_t w = 0; w * 32 < covered; w++) {
            uint32_t bits = m[w];
            if (bits == 0xFFFFFFFFu) continue;
            int64_t base = w * 32, n = covered - base < 32 ? covered - base : 32;
            for (int64_t i = 0; i < n; i++)
                if (!((bits >> i) & 1u)) row[base + i] = -INFINITY;
        }
        for (int64_t t = covered; t < vocab; t++) row[t] = -INFINITY;
    }
}
