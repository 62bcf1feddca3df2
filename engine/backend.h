/* backend.h: the one interface a compute backend implements (CPU in cpu_kernels/, CUDA in
 * gpu_kernels/). The engine only calls the backend_* wrappers below; main() builds a
 * concrete backend and hands it over, so the engine never names one. Activations are F32,
 * row-major; weights keep their file dtype (F32, BF16 or F16) and layout (out, in), so a
 * projection is y = x · Wᵀ as in PyTorch's nn.Linear. Optional methods are marked. */
#ifndef CS_BACKEND_H
#define CS_BACKEND_H

#include "engine/common.h"

typedef struct backend backend_t;

typedef struct cs_weight {
    cs_dtype dtype;     /* F32, BF16 or F16 */
    int rows, cols;     /* (out, in) for matrices; rows = 1 for vectors */
    const void *data;   /* backend-accessible memory (may point into an mmap) */
} cs_weight_t;

typedef struct backend_attn_seq {
    int row0, n, pos0;
    const int32_t *blocks;  /* block table covering positions [0, pos0 + n) */
} backend_attn_seq_t;

typedef struct backend_lora_seg {
    int row0, n;
    const float *a, *b;     /* (rank, d_in), (d_out, rank) F32 */
    int rank;
    float scale;
    const float *bt;        /* optional: b transposed, (rank, d_out) */
} backend_lora_seg_t;

struct backend_i {
    const char *name;
    /* true when ops read host memory directly: the model then uses its mmap'd weights in
     * place instead of uploading them */
    bool host_memory;

    /* Memory visible to the ops. On the CPU these are plain host allocations. */
    void *(*buf_alloc)(backend_t *b, size_t nbytes);
    void (*buf_free)(backend_t *b, void *p);
    void (*buf_set)(backend_t *b, void *dst, const void *src, size_t nbytes); /* host -> backend */
    void (*buf_get)(backend_t *b, void *dst, const void *src, size_t nbytes); /* backend -> host */

    /* y[n, w.rows] = x[n, w.cols] · wᵀ (+ bias[w.rows], F32, may be NULL) */
    void (*matmul)(backend_t *b, float *y, const float *x, int n, const cs_weight_t *w, const float *bias);
    /* Several projections of the same input in one go: ys[k] = x · ws[k]ᵀ (+ biases[k]), k <
     * count (q/k/v, gate/up). Optional: without it, matmul per weight. */
    void (*matmul_multi)(backend_t *b, float *const *ys, const float *x, int n, const cs_weight_t *const *ws,
                         const float *const *biases, int count);
    /* y[n, dim] = x / rms(x) * w ; w is a (1, dim) weight; y may equal x */
    void (*rmsnorm)(backend_t *b, float *y, const float *x, int n, int dim, const cs_weight_t *w, float eps);
    /* rotate-half RoPE in place on x[n, n_heads, head_dim], row i at position pos[i];
     * inv_freq has head_dim/2 entries */
    void (*rope)(backend_t *b, float *x, int n, int n_heads, int head_dim, const int32_t *pos, const float *inv_freq);
    /* Causal attention of n new queries q[n, n_heads, head_dim] at positions
     * pos0..pos0+n-1 over the cache k/v[0 .. pos0+n, n_kv_heads, head_dim] (the new keys
     * already written). window > 0 limits keys to (p - window, p]. out[n, n_heads, head_dim] */
    void (*attention)(backend_t *b, float *out, const float *q, const float *k, const float *v, int n,
                      int pos0, int n_heads, int n_kv_heads, int head_dim, int window);
    /* Paged attention for a batch of sequences. Sequence s owns query rows
     * [seq[s].row0, seq[s].row0 + seq[s].n) of q/out at positions pos0 .. pos0 + n - 1; its
     * keys and values for positions [0, pos0 + n) live in the pools k/v, laid out as
     * [block][block_size][n_kv_heads * head_dim], position p at block blocks[p / block_size]
     * (the new keys already stored). Causal; window > 0 limits keys to (p - window, p]. */
    void (*attention_paged)(backend_t *b, float *out, const float *q, const float *k, const float *v,
                            const struct backend_attn_seq *seqs, int n_seqs, int block_size, int n_heads,
                            int n_kv_heads, int head_dim, int window);
    /* dst row idx[i] = src row i (scatter), rows of row_len floats */
    void (*set_rows)(backend_t *b, float *dst, const float *src, const int32_t *idx, int n, int row_len);
    /* dst row i = src row idx[i] (gather) */
    void (*get_rows)(backend_t *b, float *dst, const float *src, const int32_t *idx, int n, int row_len);
    /* gate[i] = silu(gate[i]) * up[i] */
    void (*silu_mul)(backend_t *b, float *gate, const float *up, size_t n);
    /* y[i] += x[i] */
    void (*add)(backend_t *b, float *y, const float *x, size_t n);
    /* y[n, d_out] += scale · (x[n, d_in] · aᵀ) · bᵀ ; a (rank, d_in), b (d_out, rank), F32 */
    void (*lora)(backend_t *b, float *y, const float *x, int n, const float *a, const float *bm, int rank,
                 int d_in, int d_out, float scale);
    /* Grouped LoRA for a batch mixing adapters (the CPU analogue of SGMV/BGMV): for every
     * segment, y[row0 .. row0 + n) += scale · (x rows · aᵀ) · bᵀ, a (rank, d_in), b (d_out,
     * rank). Segments cover disjoint rows. Optional: without it, lora() per segment. */
    void (*lora_batch)(backend_t *b, float *y, const float *x, const struct backend_lora_seg *segs, int n_segs,
                       int d_in, int d_out);
    /* y[n, table.cols] = rows ids[i] of table */
    void (*embed)(backend_t *b, float *y, const cs_weight_t *table, const int32_t *ids, int n);

    void (*synchronize)(backend_t *b);  /* optional */
    void (*free)(backend_t *b);
};

struct backend {
    const struct backend_i *iface;
    void *ctx;
    int n_threads;
};

static inline void *backend_buf_alloc(backend_t *b, size_t n) { return b->iface->buf_alloc(b, n); }
static inline void backend_buf_free(backend_t *b, void *p) { if (p) b->iface->buf_free(b, p); }
static inline void backend_buf_set(backend_t *b, void *d, const void *s, size_t n) { b->iface->buf_set(b, d, s, n); }
static inline void backend_buf_get(backend_t *b, void *d, const void *s, size_t n) { b->iface->buf_get(b, d, s, n); }
static inline void backend_matmul(backend_t *b, float *y, const float *x, int n, const cs_weight_t *w, const float *bias) {
    b->iface->matmul(b, y, x, n, w, bias);
}
static inline void backend_matmul_multi(backend_t *b, float *const *ys, const float *x, int n,
                                        const cs_weight_t *const *ws, const float *const *biases, int count) {
    if (b->iface->matmul_multi) {
        b->iface->matmul_multi(b, ys, x, n, ws, biases, count);
        return;
    }
    for (int k = 0; k < count; k++) b->iface->matmul(b, ys[k], x, n, ws[k], biases[k]);
}
static inline void backend_rmsnorm(backend_t *b, float *y, const float *x, int n, int dim, const cs_weight_t *w, float eps) {
    b->iface->rmsnorm(b, y, x, n, dim, w, eps);
}
static inline void backend_rope(backend_t *b, float *x, int n, int nh, int hd, const int32_t *pos, const float *inv_freq) {
    b->iface->rope(b, x, n, nh, hd, pos, inv_freq);
}
static inline void backend_attention(backend_t *b, float *out, const float *q, const float *k, const float *v, int n,
                                     int pos0, int nh, int nkv, int hd, int window) {
    b->iface->attention(b, out, q, k, v, n, pos0, nh, nkv, hd, window);
}
static inline void backend_attention_paged(backend_t *b, float *out, const float *q, const float *k, const float *v,
                                           const backend_attn_seq_t *seqs, int n_seqs, int bs, int nh, int nkv, int hd,
                                           int window) {
    b->iface->attention_paged(b, out, q, k, v, seqs, n_seqs, bs, nh, nkv, hd, window);
}
static inline void backend_set_rows(backend_t *b, float *dst, const float *src, const int32_t *idx, int n, int len) {
    b->iface->set_rows(b, dst, src, idx, n, len);
}
static inline void backend_get_rows(backend_t *b, float *dst, const float *src, const int32_t *idx, int n, int len) {
    b->iface->get_rows(b, dst, src, idx, n, len);
}
static inline void backend_silu_mul(backend_t *b, float *g, const float *u, size_t n) { b->iface->silu_mul(b, g, u, n); }
static inline void backend_add(backend_t *b, float *y, const float *x, size_t n) { b->iface->add(b, y, x, n); }
static inline void backend_lora(backend_t *b, float *y, const float *x, int n, const float *a, const float *bm, int rank,
                                int d_in, int d_out, float scale) {
    b->iface->lora(b, y, x, n, a, bm, rank, d_in, d_out, scale);
}
static inline void backend_lora_batch(backend_t *b, float *y, const float *x, const backend_lora_seg_t *segs, int n_segs,
                                      int d_in, int d_out) {
    if (b->iface->lora_batch) {
        b->iface->lora_batch(b, y, x, segs, n_segs, d_in, d_out);
        return;
    }
    for (int i = 0; i < n_segs; i++)
        b->iface->lora(b, y + (size_t)segs[i].row0 * d_out, x + (size_t)segs[i].row0 * d_in, segs[i].n, segs[i].a,
                       segs[i].b, segs[i].rank, d_in, d_out, segs[i].scale);
}
static inline void backend_embed(backend_t *b, float *y, const cs_weight_t *t, const int32_t *ids, int n) {
    b->iface->embed(b, y, t, ids, n);
}
static inline void backend_synchronize(backend_t *b) { if (b->iface->synchronize) b->iface->synchronize(b); }
static inline void backend_free(backend_t *b) { if (b) b->iface->free(b); }

#endif
