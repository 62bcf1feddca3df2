/* kernels_paged.h: plain reference kernels for the paged KV layout (engine/kv_cache.h):
 * the readable definitions the CPU backend's fast paged attention is tested against. */
#ifndef CS_KERNELS_PAGED_H
#define CS_KERNELS_PAGED_H

#include "cpu_kernels/cpu_raw.h"

/* backend_i.attention_paged as plain loops (double-precision softmax sums) */
void cs_attention_paged_ref(float *out, const float *q, const float *k, const float *v, const cpu_attn_seq_t *seqs,
                            int n_seqs, int block_size, int n_heads, int n_kv_heads, int head_dim, int window);
/* row index in a pool of the key at position p of a sequence with this block table */
static inline size_t cs_paged_row(const int32_t *blocks, int block_size, int p) {
    return (size_t)blocks[p / block_size] * (size_t)block_size + (size_t)(p % block_size);
}

#endif
