/* kernels_paged.h: plain reference kernels for the paged KV layout (engine/kv_cache.h):
 * the readable definitions the CPU backend's fast paged attention is tested against. */
#ifndef CS_KERNELS_PAGED_H
#define CS_KERNELS_PAGED_H

#include "cpu_kernels/cpu_raw.h"

/* backend_i.attention_paged as plain loops (double-precision softmax sums) */
void cs_attention_paged_ref(float *out, const float *q, const float *k, const float *v, const cpu_attn_seq_t *seqs,
                            int n_seqs, int block_size, int n_heads, int n_kv_heads, int head_dim, int window);
/* the same over pools of KV_DTYPE: F32 or BF16 (each element widened to F32 as it is read) */
void cs_attention_paged_kv_ref(float *out, const float *q, const void *k, const void *v, cs_dtype kv_dtype,
                               const cpu_attn_seq_t *seqs, int n_seqs, int block_size, int n_heads, int n_kv_heads,
                               int head_dim, int window);
/* pool row slots[i] = src row i (row_len floats), stored as KV_DTYPE: F32 as is, BF16
 * rounded to nearest even (cs_f32_to_bf16) */
void cs_kv_store_ref(void *pool, cs_dtype kv_dtype, const float *src, const int32_t *slots, int n, int row_len);
/* row index in a pool of the key at position p of a sequence with this block table */
static inline size_t cs_paged_row(const int32_t *blocks, int block_size, int p) {
    return (size_t)blocks[p / block_size] * (size_t)block_size + (size_t)(p % block_size);
}

#endif
