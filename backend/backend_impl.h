/* backend_impl.h: what a backend implements: the method table (struct backend_i) and struct
 * backend, which it allocates and fills (table, capabilities, context). Included only by the
 * backends (cpu_kernels/cpu_device.c, gpu_kernels/backend.cu, the stand-in devices of the
 * micro-benchmarks) and by backend/backend.c, whose functions call the methods; callers use
 * backend.h, where each method's meaning is written on its function.
 *
 * Optional methods are marked; their fallbacks live in backend.c. A backend declares in
 * struct backend's caps what it offers, and caps agrees with the methods it fills:
 * host_memory with buf_from_host, async_copies with buf_set_async/buf_get_async,
 * pinned_host with host_alloc/host_free, events with the event methods (all or none),
 * adapter_stream with adapter_stream/adapter_arrived, adapter_feed with adapter_feed,
 * host_assist with get_signal/wait_add, graphs with graph_begin/graph_end/graph_reset. */
#ifndef CS_BACKEND_IMPL_H
#define CS_BACKEND_IMPL_H

#include "backend/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

struct backend_i {
    const char *name;

    /* ---- memory ---- */
    backend_buf_t *(*buf_alloc)(backend_t *b, size_t nbytes);
    void (*buf_free)(backend_t *b, backend_buf_t *buf);
    size_t (*buf_size)(backend_t *b, const backend_buf_t *buf);
    backend_buf_t *(*buf_from_host)(backend_t *b, void *p, size_t nbytes); /* optional (host memory) */
    int (*weight_prepare)(backend_t *b, const backend_weight_t *w);        /* optional */
    void (*buf_set)(backend_t *b, backend_buf_t *dst, size_t off, const void *src, size_t n);
    void (*buf_get)(backend_t *b, void *dst, const backend_buf_t *src, size_t off, size_t n);
    void (*buf_copy)(backend_t *b, backend_buf_t *dst, size_t doff, const backend_buf_t *src, size_t soff, size_t n);
    /* optional (both or none) */
    void (*buf_set_async)(backend_t *b, backend_buf_t *dst, size_t off, const void *src, size_t n);
    void (*buf_get_async)(backend_t *b, void *dst, const backend_buf_t *src, size_t off, size_t n);
    /* optional (both or none) */
    void *(*host_alloc)(backend_t *b, size_t nbytes);
    void (*host_free)(backend_t *b, void *p);
    /* optional (all or none) */
    backend_event_t *(*event_new)(backend_t *b);
    void (*event_free)(backend_t *b, backend_event_t *ev);
    void (*event_record)(backend_t *b, backend_event_t *ev);
    void (*event_wait)(backend_t *b, backend_event_t *ev);
    bool (*event_query)(backend_t *b, backend_event_t *ev);
    void (*event_synchronize)(backend_t *b, backend_event_t *ev);

    /* ---- the per-forward batch and adapter slots ---- */
    int (*batch_upload)(backend_t *b, backend_batch_t **batch, const backend_batch_desc_t *d);
    void (*batch_free)(backend_t *b, backend_batch_t *batch);
    int (*adapter_upload)(backend_t *b, const backend_adapter_desc_t *d, backend_adapter_t **slot);
    void (*adapter_free)(backend_t *b, backend_adapter_t *slot);
    size_t (*adapter_bytes)(backend_t *b, const backend_adapter_t *slot);
    /* optional (both or none) */
    int (*adapter_stream)(backend_t *b, const backend_adapter_desc_t *d, int group, void (*on_group)(void *user),
                          void *user, backend_adapter_t **slot);
    int (*adapter_arrived)(backend_t *b, const backend_adapter_t *slot);
    void (*adapter_feed)(backend_t *b, backend_adapter_t *slot, int n); /* optional (with adapter_stream) */

    /* ---- compute ---- */
    void (*embed)(backend_t *b, backend_buf_t *y, const backend_weight_t *table, const backend_batch_t *batch);
    void (*matmul)(backend_t *b, backend_buf_t *y, const backend_buf_t *x, int n, const backend_weight_t *w,
                   const backend_buf_t *bias);
    /* optional */
    void (*matmul_multi)(backend_t *b, backend_buf_t *const *ys, const backend_buf_t *x, int n,
                         const backend_weight_t *const *ws, const backend_buf_t *const *biases, int count);
    void (*rmsnorm)(backend_t *b, backend_buf_t *y, const backend_buf_t *x, int n, int dim, const backend_weight_t *w,
                    float eps);
    void (*rope)(backend_t *b, backend_buf_t *x, int n_heads, int head_dim, const backend_batch_t *batch,
                 const backend_buf_t *inv_freq);
    void (*kv_store)(backend_t *b, backend_buf_t *pool, cs_dtype kv_dtype, const backend_buf_t *src,
                     const backend_batch_t *batch, int row_len);
    void (*attention)(backend_t *b, backend_buf_t *out, const backend_buf_t *q, const backend_buf_t *k,
                      const backend_buf_t *v, cs_dtype kv_dtype, const backend_batch_t *batch, int block_size,
                      int n_heads, int n_kv_heads, int head_dim, int window);
    void (*get_out_rows)(backend_t *b, backend_buf_t *dst, const backend_buf_t *src, const backend_batch_t *batch,
                         int row_len);
    void (*silu_mul)(backend_t *b, backend_buf_t *gate, const backend_buf_t *up, size_t n);
    void (*add)(backend_t *b, backend_buf_t *y, const backend_buf_t *x, size_t n);
    void (*lora)(backend_t *b, backend_buf_t *y, const backend_buf_t *x, const backend_batch_t *batch, int layer,
                 int target, int d_in, int d_out);
    /* optional (both or none) */
    void (*get_signal)(backend_t *b, void *dst, const backend_buf_t *src, size_t off, size_t n, uint32_t *flag,
                       uint32_t value);
    void (*wait_add)(backend_t *b, backend_buf_t *y, size_t off, const void *src, cs_dtype src_dtype, size_t n,
                     const uint32_t *flag, uint32_t value, const uint32_t *alive, int layer);

    /* optional (all or none) */
    bool (*graph_begin)(backend_t *b, uint64_t key);
    void (*graph_end)(backend_t *b);
    void (*graph_reset)(backend_t *b);

    void (*synchronize)(backend_t *b);  /* optional: wait for the compute queue */
    void (*get_stats)(backend_t *b, backend_stats_t *st); /* optional */
    void (*free)(backend_t *b);
};

struct backend {
    const struct backend_i *iface;
    backend_caps_t caps;    /* what it offers (see the top of this file), set when it is made */
    void *ctx;
    int n_threads;
};

#ifdef __cplusplus
}
#endif
#endif
