/* kernels_paged.c: see kernels_paged.h. */
#include "cpu_kernels/kernels_paged.h"

#include <math.h>
#include <stdlib.h>

/* element i of a pool of dtype t (F32 or BF16) */
static inline float kv_at(const void *pool, cs_dtype t, size_t i) {
    return t == CS_DTYPE_BF16 ? cs_bf16_to_f32(((const uint16_t *)pool)[i]) : ((const float *)pool)[i];
}

void cs_attention_paged_ref(float *out, const float *q, const float *k, const float *v, const cpu_attn_seq_t *seqs,
                            int n_seqs, int block_size, int n_heads, int n_kv_heads, int head_dim, int window) {
    cs_attention_paged_kv_ref(out, q, k, v, CS_DTYPE_F32, seqs, n_seqs, block_size, n_heads, n_kv_heads, head_dim, window);
}

void cs_attention_paged_kv_ref(float *out, const float *q, const void *k, const void *v, cs_dtype kv_dtype,
                               const cpu_attn_seq_t *seqs, int n_seqs, int block_size, int n_heads, int n_kv_heads,
                               int head_dim, int window) {
    CS_ASSERT(kv_dtype == CS_DTYPE_F32 || kv_dtype == CS_DTYPE_BF16);
    int group = n_heads / n_kv_heads, kv_dim = n_kv_heads * head_dim;
    float scale = 1.0f / sqrtf((float)head_dim);
    for (int s = 0; s < n_seqs; s++) {
        const cpu_attn_seq_t *sq = &seqs[s];
        int len = sq->pos0 + sq->n;
        float *sc = malloc(sizeof(float) * (size_t)len);
        CS_ASSERT(sc);
        for (int i = 0; i < sq->n; i++) {
            int p = sq->pos0 + i, first = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
            for (int h = 0; h < n_heads; h++) {
                const float *qh = q + ((size_t)(sq->row0 + i) * n_heads + h) * head_dim;
                int kvh = h / group;
                float mx = -INFINITY;
                for (int t = first; t <= p; t++) {
                    size_t kr = cs_paged_row(sq->blocks, block_size, t) * kv_dim + (size_t)kvh * head_dim;
                    float d = 0;
                    for (int e = 0; e < head_dim; e++) d += qh[e] * kv_at(k, kv_dtype, kr + e);
                    sc[t] = d * scale;
                    mx = fmaxf(mx, sc[t]);
                }
                double sum = 0;
                for (int t = first; t <= p; t++) { sc[t] = expf(sc[t] - mx); sum += sc[t]; }
                float *oh = out + ((size_t)(sq->row0 + i) * n_heads + h) * head_dim;
                for (int e = 0; e < head_dim; e++) oh[e] = 0;
                for (int t = first; t <= p; t++) {
                    size_t vr = cs_paged_row(sq->blocks, block_size, t) * kv_dim + (size_t)kvh * head_dim;
                    float w = (float)(sc[t] / sum);
                    for (int e = 0; e < head_dim; e++) oh[e] += w * kv_at(v, kv_dtype, vr + e);
                }
            }
        }
        free(sc);
    }
}

void cs_kv_store_ref(void *pool, cs_dtype kv_dtype, const float *src, const int32_t *slots, int n, int row_len) {
    CS_ASSERT(kv_dtype == CS_DTYPE_F32 || kv_dtype == CS_DTYPE_BF16);
    for (int i = 0; i < n; i++)
        for (int e = 0; e < row_len; e++) {
            size_t at = (size_t)slots[i] * (size_t)row_len + (size_t)e;
            float x = src[(size_t)i * (size_t)row_len + (size_t)e];
            if (kv_dtype == CS_DTYPE_BF16) ((uint16_t *)pool)[at] = cs_f32_to_bf16(x);
            else ((float *)pool)[at] = x;
        }
}
