/* kernels_paged.c: see kernels_paged.h. */
#include "cpu_kernels/kernels_paged.h"

#include <math.h>
#include <stdlib.h>

void cs_attention_paged_ref(float *out, const float *q, const float *k, const float *v, const cpu_attn_seq_t *seqs,
                            int n_seqs, int block_size, int n_heads, int n_kv_heads, int head_dim, int window) {
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
                    const float *kr = k + cs_paged_row(sq->blocks, block_size, t) * kv_dim + kvh * head_dim;
                    float d = 0;
                    for (int e = 0; e < head_dim; e++) d += qh[e] * kr[e];
                    sc[t] = d * scale;
                    mx = fmaxf(mx, sc[t]);
                }
                double sum = 0;
                for (int t = first; t <= p; t++) { sc[t] = expf(sc[t] - mx); sum += sc[t]; }
                float *oh = out + ((size_t)(sq->row0 + i) * n_heads + h) * head_dim;
                for (int e = 0; e < head_dim; e++) oh[e] = 0;
                for (int t = first; t <= p; t++) {
                    const float *vr = v + cs_paged_row(sq->blocks, block_size, t) * kv_dim + kvh * head_dim;
                    float w = (float)(sc[t] / sum);
                    for (int e = 0; e < head_dim; e++) oh[e] += w * vr[e];
                }
            }
        }
        free(sc);
    }
}
