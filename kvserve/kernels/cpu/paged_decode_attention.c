/* Paged decode attention on the CPU, reading K/V blocks where they lie (no gather copy).
 *
 * One query token per sequence; the cache is NHD per layer: [num_blocks, block_size, kv_heads, head_dim].
 * Work unit = (sequence, KV head): its G = heads / kv_heads query heads share every K and V row, so each
 * row is read once per unit. Two passes: scores for all G heads, softmax, then the V-weighted sum.
 * Sequences [seq_begin, seq_end) are done by this call, so callers split a batch across threads.
 * fp32 throughout; `omp simd` lets the compiler vectorise the dot products without -ffast-math.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int paged_decode_attention_f32(const float *query, const float *k_cache, const float *v_cache,
                               const int64_t *block_tables, const int32_t *context_lens, float *out,
                               int64_t seq_begin, int64_t seq_end, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    int64_t longest = 0;
    for (int64_t b = seq_begin; b < seq_end; b++)
        if (context_lens[b] > longest) longest = context_lens[b];
    float *scores = (float *)malloc(sizeof(float) * (size_t)(group * (longest > 0 ? longest : 1)));
    float *acc = (float *)malloc(sizeof(float) * (size_t)(group * head_dim));
    if (!scores || !acc) { free(scores); free(acc); return -1; }
    for (int64_t b = seq_begin; b < seq_end; b++) {
        const int64_t length = context_lens[b];
        const int64_t *table = block_tables + b * max_blocks;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const float *q = query + (b * num_heads + h * group) * head_dim;
            float *o = out + (b * num_heads + h * group) * head_dim;
            if (length <= 0) { memset(o, 0, sizeof(float) * (size_t)(group * head_dim)); continue; }
            for (int64_t t = 0; t < length; t++) {
                const float *k = k_cache + (table[t / block_size] * block_size + t % block_size) * token_stride
                                 + h * head_dim;
                for (int64_t g = 0; g < group; g++) {
                    const float *qg = q + g * head_dim;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < head_dim; d++) dot += qg[d] * k[d];
                    scores[g * length + t] = dot * scale;
                }
            }
            for (int64_t g = 0; g < group; g++) {
                float *s = scores + g * length;
                float peak = s[0];
                for (int64_t t = 1; t < length; t++) peak = s[t] > peak ? s[t] : peak;
                float total = 0.0f;
                for (int64_t t = 0; t < length; t++) { s[t] = expf(s[t] - peak); total += s[t]; }
                const float inv = 1.0f / total;
                for (int64_t t = 0; t < length; t++) s[t] *= inv;
            }
            memset(acc, 0, sizeof(float) * (size_t)(group * head_dim));
            for (int64_t t = 0; t < length; t++) {
                const float *v = v_cache + (table[t / block_size] * block_size + t % block_size) * token_stride
                                 + h * head_dim;
                for (int64_t g = 0; g < group; g++) {
                    const float p = scores[g * length + t];
                    float *a = acc + g * head_dim;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++) a[d] += p * v[d];
                }
            }
            memcpy(o, acc, sizeof(float) * (size_t)(group * head_dim));
        }
    }
    free(scores);
    free(acc);
    return 0;
}
