/* backend.h: the one interface a compute backend implements (the CPU in cpu_kernels/, the
 * strict test device beside it, CUDA in gpu_kernels/). It is shaped for a device with its own
 * memory, as ggml-backend is:
 *
 *  - memory is behind opaque buffer handles (backend_buf_t) that the engine never
 *    dereferences: weights, KV pools, activations, the batch description and adapter
 *    weights are all allocated through the backend, and data crosses only by the copy
 *    methods (buf_set/buf_get, their asynchronous forms on the copy queue, buf_copy);
 *  - each forward's batch description (token ids, positions, KV slots, block tables
 *    flattened with offsets, output rows, LoRA segments) is packed on the host once and
 *    uploaded once (batch_upload); the ops take that handle, not host arrays;
 *  - adapter weights live in backend-owned slots (adapter_upload), in the dtype they came
 *    in; LoRA segments name slots;
 *  - an adapter slot may fill in while it is used (adapter_stream: layer groups on the copy
 *    queue, an "arrived" count to read); rows of a layer not yet there get their LoRA term
 *    from the host (get_signal / wait_add: host-assisted LoRA, the cold start);
 *  - optional methods (marked) have fallbacks in the wrappers below.
 *
 * Activations are F32, row-major. Weights keep their file dtype (F32, BF16 or F16) and
 * layout (out, in), so a projection is y = x · Wᵀ as in PyTorch's nn.Linear. The compute
 * ops run in order on the backend's compute queue; backend_synchronize waits for them. */
#ifndef CS_BACKEND_H
#define CS_BACKEND_H

#include <limits.h>

#include "base/common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct backend backend_t;
typedef struct backend_buf backend_buf_t;         /* device memory: a handle */
typedef struct backend_batch backend_batch_t;     /* an uploaded batch description */
typedef struct backend_adapter backend_adapter_t; /* an adapter slot */
typedef struct backend_event backend_event_t;

/* A weight matrix (or vector, rows = 1) in a backend buffer. */
typedef struct backend_weight {
    cs_dtype dtype;         /* F32, BF16 or F16 */
    int rows, cols;         /* (out, in) for matrices */
    backend_buf_t *buf;     /* rows * cols elements from its start */
    void *host;             /* the model's: the host bytes buf was made over (buf_from_host), or NULL */
} backend_weight_t;

/* ---- the batch description (host side; batch_upload copies what the ops need) ---- */
typedef struct backend_seq_desc {
    int row0, n, pos0;      /* query rows [row0, row0 + n) at positions pos0 .. pos0 + n - 1 */
    int blk0;               /* its block table: blocks[blk0 ...] covers positions [0, pos0 + n) */
} backend_seq_desc_t;

typedef struct backend_lora_seg_desc {
    int row0, n;            /* rows [row0, row0 + n) use this adapter slot */
    backend_adapter_t *slot;
    int device_layers;      /* the lora op adds this segment's term for layers below this
                             * (a slot still streaming in: the rest is the host's, cold start);
                             * INT_MAX for a complete slot */
} backend_lora_seg_desc_t;

typedef struct backend_batch_desc {
    int n_tokens;
    const int32_t *ids;         /* [n_tokens] */
    const int32_t *pos;         /* [n_tokens] */
    const int32_t *slots;       /* [n_tokens] KV rows: block * block_size + position % block_size */
    int n_seqs;
    const backend_seq_desc_t *seqs;
    int n_blocks;
    const int32_t *blocks;      /* the block tables, flattened */
    int n_out;
    const int32_t *out_rows;    /* [n_out] rows whose logits are wanted */
    int n_lora;
    const backend_lora_seg_desc_t *lora; /* disjoint row ranges with an adapter (others: none) */
} backend_batch_desc_t;

/* ---- adapter slots ---- */
enum { BACKEND_LORA_TARGETS = 7 }; /* q, k, v, o, gate, up, down */

typedef struct backend_lora_module_desc {
    int rank;               /* 0: not adapted */
    int d_in, d_out;
    float scale;
    cs_dtype dtype;         /* of a, b and bt */
    const void *a;          /* (rank, d_in), host memory */
    const void *b;          /* (d_out, rank) */
    const void *bt;         /* optional: b transposed, (rank, d_out) */
} backend_lora_module_desc_t;

typedef struct backend_adapter_desc {
    int n_layers;
    const backend_lora_module_desc_t *mods; /* [n_layers * BACKEND_LORA_TARGETS] */
    /* The host memory of mods stays valid and unchanged for the slot's life (a backend
     * that reads host memory may use it in place instead of copying). */
    bool host_stays;
    /* A host copy still coming in (an adapter streaming from disk): only layers below
     * host_ready are in host memory now; adapter_feed says when more are. Only for
     * adapter_stream, and only on a backend with adapter_feed. */
    bool host_partial;
    int host_ready;
} backend_adapter_desc_t;

typedef struct backend_stats {
    uint64_t h2d_bytes, d2h_bytes, d2d_bytes; /* bytes copied, by direction */
    uint64_t h2d_copies, d2h_copies, d2d_copies;
    size_t allocated;       /* bytes in live buffers */
    uint64_t batch_uploads;
    uint64_t graph_captures, graph_replays; /* forwards recorded as, and replayed from, device graphs */
    size_t prepared_from, prepared_bytes; /* weight_prepare: bytes of the weights given, of the forms kept */
    uint64_t prepared_exceptions;         /* CPU --compress-weights: weights listed apart */
} backend_stats_t;

struct backend_i {
    const char *name;
    /* true when the ops read host memory directly: then buf_from_host is offered and the
     * model uses its mmap'd weights in place */
    bool host_memory;

    /* ---- memory ---- */
    /* the contents are undefined until written (as cudaMalloc's; the strict device fills
     * them with NaN so that a read of what nobody wrote shows) */
    backend_buf_t *(*buf_alloc)(backend_t *b, size_t nbytes);
    void (*buf_free)(backend_t *b, backend_buf_t *buf);
    size_t (*buf_size)(backend_t *b, const backend_buf_t *buf);
    /* optional (host-memory backends): a buffer over host memory that the caller keeps
     * valid until buf_free, which does not free it */
    backend_buf_t *(*buf_from_host)(backend_t *b, void *p, size_t nbytes);
    /* optional: W, loaded and read-only from here on, is a matmul weight; the backend may
     * keep a form of its own beside it until W's buffer is freed (the CPU backend's
     * --compress-weights: BF16 coded in 12 bits). 0; BACKEND_WEIGHT_HOST_UNUSED when the
     * backend's own form serves every op on W's buffer from now on, so that the caller may
     * release the host memory behind a buf_from_host buffer (the buffer stays valid, its
     * bytes are never read again); or an error code with cs_error set (out of memory). */
    int (*weight_prepare)(backend_t *b, const backend_weight_t *w);
    /* host -> buffer and buffer -> host, synchronous (after every op queued before) */
    void (*buf_set)(backend_t *b, backend_buf_t *dst, size_t off, const void *src, size_t n);
    void (*buf_get)(backend_t *b, void *dst, const backend_buf_t *src, size_t off, size_t n);
    /* buffer -> buffer, in order with the compute ops (the n-sample fork's KV copy) */
    void (*buf_copy)(backend_t *b, backend_buf_t *dst, size_t doff, const backend_buf_t *src, size_t soff, size_t n);
    /* optional: the copies on the copy queue, overlapping compute; the host memory must stay
     * valid (and, for set, unchanged) until an event recorded after them has completed.
     * Without them: the synchronous copies. */
    void (*buf_set_async)(backend_t *b, backend_buf_t *dst, size_t off, const void *src, size_t n);
    void (*buf_get_async)(backend_t *b, void *dst, const backend_buf_t *src, size_t off, size_t n);
    /* optional: page-locked host memory for the async copies. Without: malloc. */
    void *(*host_alloc)(backend_t *b, size_t nbytes);
    void (*host_free)(backend_t *b, void *p);
    /* optional events (all or none): record marks the copy queue's position; wait makes the
     * compute queue wait for it; query is true once it completed; synchronize blocks the
     * host until then. Without them: copies are synchronous and events complete at once. */
    backend_event_t *(*event_new)(backend_t *b);
    void (*event_free)(backend_t *b, backend_event_t *ev);
    void (*event_record)(backend_t *b, backend_event_t *ev);
    void (*event_wait)(backend_t *b, backend_event_t *ev);
    bool (*event_query)(backend_t *b, backend_event_t *ev);
    void (*event_synchronize)(backend_t *b, backend_event_t *ev);

    /* ---- the per-forward batch and adapter slots ---- */
    /* Upload a batch description into *batch (allocated on first use, reused after): one
     * upload per forward. */
    int (*batch_upload)(backend_t *b, backend_batch_t **batch, const backend_batch_desc_t *d);
    void (*batch_free)(backend_t *b, backend_batch_t *batch);
    /* An adapter's weights into a slot of the backend (kept in their dtype). */
    int (*adapter_upload)(backend_t *b, const backend_adapter_desc_t *d, backend_adapter_t **slot);
    void (*adapter_free)(backend_t *b, backend_adapter_t *slot);
    size_t (*adapter_bytes)(backend_t *b, const backend_adapter_t *slot); /* device bytes it holds */
    /* optional (both or none): a slot that fills in on the copy queue, GROUP layers at a
     * time, layer 0 first; it returns at once. adapter_arrived reads how many layers are in
     * place (a count the copy queue raises after each group: no lock, no device sync); ops
     * queued after that read may use those layers. ON_GROUP(USER) (may be NULL) runs after
     * each group, on the backend's copy thread: it must be cheap. The host memory of D stays
     * valid until every layer arrived or the slot is freed (adapter_free waits for the copies
     * in flight). Without them: adapter_upload, every layer there at once. */
    int (*adapter_stream)(backend_t *b, const backend_adapter_desc_t *d, int group, void (*on_group)(void *user),
                          void *user, backend_adapter_t **slot);
    int (*adapter_arrived)(backend_t *b, const backend_adapter_t *slot);
    /* optional (with adapter_stream): the host memory of a slot streamed with host_partial
     * now holds layers [0, N) (N only grows; N = n_layers: all of it): their copies may be
     * queued. Never waits (it may be called from a thread the copies must not block: the
     * adapter loader's); callable from any one thread at a time per slot, while the slot
     * lives. */
    void (*adapter_feed)(backend_t *b, backend_adapter_t *slot, int n);

    /* ---- compute ---- */
    /* y[batch rows, table.cols] = rows ids[i] of table */
    void (*embed)(backend_t *b, backend_buf_t *y, const backend_weight_t *table, const backend_batch_t *batch);
    /* y[n, w.rows] = x[n, w.cols] · wᵀ (+ bias[w.rows], F32, may be NULL) */
    void (*matmul)(backend_t *b, backend_buf_t *y, const backend_buf_t *x, int n, const backend_weight_t *w,
                   const backend_buf_t *bias);
    /* optional: ys[k] = x · ws[k]ᵀ (+ biases[k]) for k < count (q/k/v, gate/up) in one go */
    void (*matmul_multi)(backend_t *b, backend_buf_t *const *ys, const backend_buf_t *x, int n,
                         const backend_weight_t *const *ws, const backend_buf_t *const *biases, int count);
    /* y[n, dim] = x / rms(x) * w ; w is a (1, dim) F32 weight; y may equal x */
    void (*rmsnorm)(backend_t *b, backend_buf_t *y, const backend_buf_t *x, int n, int dim, const backend_weight_t *w,
                    float eps);
    /* rotate-half RoPE in place on x[batch rows, n_heads, head_dim], row i at the batch's
     * position i; inv_freq: head_dim/2 F32 values */
    void (*rope)(backend_t *b, backend_buf_t *x, int n_heads, int head_dim, const backend_batch_t *batch,
                 const backend_buf_t *inv_freq);
    /* pool row slots[i] = src row i, rows of row_len floats (the new keys or values), stored
     * as kv_dtype (one attention reads: BF16 rounded to nearest even) */
    void (*kv_store)(backend_t *b, backend_buf_t *pool, cs_dtype kv_dtype, const backend_buf_t *src,
                     const backend_batch_t *batch, int row_len);
    /* Paged attention over the batch's sequences: sequence s owns query rows [row0, row0 +
     * n) of q/out; its keys and values for positions [0, pos0 + n) live in the pools k/v as
     * [block][block_size][n_kv_heads * head_dim], position p at its table's block p /
     * block_size (the new keys already stored). Causal; window > 0 limits keys to (p -
     * window, p]. The pools are kv_dtype (F32; BF16 where the backend says so). */
    void (*attention)(backend_t *b, backend_buf_t *out, const backend_buf_t *q, const backend_buf_t *k,
                      const backend_buf_t *v, cs_dtype kv_dtype, const backend_batch_t *batch, int block_size,
                      int n_heads, int n_kv_heads, int head_dim, int window);
    /* dst row i = src row out_rows[i] of the batch, rows of row_len floats */
    void (*get_out_rows)(backend_t *b, backend_buf_t *dst, const backend_buf_t *src, const backend_batch_t *batch,
                         int row_len);
    /* gate[i] = silu(gate[i]) * up[i], n elements */
    void (*silu_mul)(backend_t *b, backend_buf_t *gate, const backend_buf_t *up, size_t n);
    /* y[i] += x[i], n elements */
    void (*add)(backend_t *b, backend_buf_t *y, const backend_buf_t *x, size_t n);
    /* Grouped LoRA (SGMV/BGMV): for every LoRA segment of the batch whose slot adapts
     * (layer, target), y rows += scale · (x rows · aᵀ) · bᵀ. */
    void (*lora)(backend_t *b, backend_buf_t *y, const backend_buf_t *x, const backend_batch_t *batch, int layer,
                 int target, int d_in, int d_out);
    /* optional (both or none): host-assisted ops, the device side of the cold start.
     * get_signal: on the compute queue, after the ops before it, copy N bytes of SRC at OFF
     * into DST (host memory from host_alloc) and then set *FLAG = VALUE (cs_flag_store's
     * meaning); the caller's host does not wait. wait_add: on the compute queue, wait until
     * *FLAG >= VALUE (written by host threads with cs_flag_add/cs_flag_store), then add the N
     * floats at SRC (host memory from host_alloc) to Y's floats from OFF bytes on. The host
     * memory and flags stay valid until the queue passed them (backend_synchronize). */
    void (*get_signal)(backend_t *b, void *dst, const backend_buf_t *src, size_t off, size_t n, uint32_t *flag,
                       uint32_t value);
    void (*wait_add)(backend_t *b, backend_buf_t *y, size_t off, const float *src, size_t n, const uint32_t *flag,
                     uint32_t value);
    /* which KV dtypes attention reads (a bit per cs_dtype) */
    unsigned kv_dtypes;

    /* optional: a forward's ops replayed as a device graph (CUDA graphs). The caller brackets
     * a forward whose every launch is fixed by key (the same buffers and shapes; only the
     * uploaded batch's contents differ) with graph_begin and, when that returned false,
     * graph_end. graph_begin returns true when it launched the graph recorded for key in
     * place of the ops (the caller issues none of them), false when the caller must issue
     * them (the backend may record them, or run them once first to settle its scratch).
     * graph_reset forgets every graph (the caller's buffers moved). Without: ops always run. */
    bool (*graph_begin)(backend_t *b, uint64_t key);
    void (*graph_end)(backend_t *b);
    void (*graph_reset)(backend_t *b);

    void (*synchronize)(backend_t *b);  /* optional: wait for the compute queue */
    void (*get_stats)(backend_t *b, backend_stats_t *st); /* optional */
    void (*free)(backend_t *b);
};

struct backend {
    const struct backend_i *iface;
    void *ctx;
    int n_threads;
};

/* ---- wrappers (the engine calls only these) ---- */
static inline const char *backend_name(const backend_t *b) { return b->iface->name; }
static inline backend_buf_t *backend_buf_alloc(backend_t *b, size_t n) { return b->iface->buf_alloc(b, n); }
static inline void backend_buf_free(backend_t *b, backend_buf_t *p) { if (p) b->iface->buf_free(b, p); }
static inline size_t backend_buf_size(backend_t *b, const backend_buf_t *p) { return b->iface->buf_size(b, p); }
static inline backend_buf_t *backend_buf_from_host(backend_t *b, void *p, size_t n) {
    return b->iface->buf_from_host ? b->iface->buf_from_host(b, p, n) : NULL;
}
#define BACKEND_WEIGHT_HOST_UNUSED 1 /* weight_prepare: see there */
static inline int backend_weight_prepare(backend_t *b, const backend_weight_t *w) {
    return b->iface->weight_prepare ? b->iface->weight_prepare(b, w) : 0;
}
static inline void backend_buf_set(backend_t *b, backend_buf_t *d, size_t off, const void *s, size_t n) {
    b->iface->buf_set(b, d, off, s, n);
}
static inline void backend_buf_get(backend_t *b, void *d, const backend_buf_t *s, size_t off, size_t n) {
    b->iface->buf_get(b, d, s, off, n);
}
static inline void backend_buf_copy(backend_t *b, backend_buf_t *d, size_t doff, const backend_buf_t *s, size_t soff,
                                    size_t n) {
    b->iface->buf_copy(b, d, doff, s, soff, n);
}
static inline void backend_buf_set_async(backend_t *b, backend_buf_t *d, size_t off, const void *s, size_t n) {
    if (b->iface->buf_set_async) b->iface->buf_set_async(b, d, off, s, n);
    else b->iface->buf_set(b, d, off, s, n);
}
static inline void backend_buf_get_async(backend_t *b, void *d, const backend_buf_t *s, size_t off, size_t n) {
    if (b->iface->buf_get_async) b->iface->buf_get_async(b, d, s, off, n);
    else b->iface->buf_get(b, d, s, off, n);
}
void *backend_host_alloc(backend_t *b, size_t n);     /* pinned where offered, else aligned malloc */
void backend_host_free(backend_t *b, void *p);
/* without events: a non-NULL token whose every query is true (copies were synchronous) */
backend_event_t *backend_event_new(backend_t *b);
void backend_event_free(backend_t *b, backend_event_t *ev);
static inline void backend_event_record(backend_t *b, backend_event_t *ev) {
    if (b->iface->event_record) b->iface->event_record(b, ev);
}
static inline void backend_event_wait(backend_t *b, backend_event_t *ev) {
    if (b->iface->event_wait) b->iface->event_wait(b, ev);
}
static inline bool backend_event_query(backend_t *b, backend_event_t *ev) {
    return b->iface->event_query ? b->iface->event_query(b, ev) : true;
}
static inline void backend_event_synchronize(backend_t *b, backend_event_t *ev) {
    if (b->iface->event_synchronize) b->iface->event_synchronize(b, ev);
}
static inline int backend_batch_upload(backend_t *b, backend_batch_t **batch, const backend_batch_desc_t *d) {
    return b->iface->batch_upload(b, batch, d);
}
static inline void backend_batch_free(backend_t *b, backend_batch_t *batch) {
    if (batch) b->iface->batch_free(b, batch);
}
static inline int backend_adapter_upload(backend_t *b, const backend_adapter_desc_t *d, backend_adapter_t **slot) {
    return b->iface->adapter_upload(b, d, slot);
}
static inline void backend_adapter_free(backend_t *b, backend_adapter_t *slot) {
    if (slot) b->iface->adapter_free(b, slot);
}
static inline size_t backend_adapter_bytes(backend_t *b, const backend_adapter_t *slot) {
    return b->iface->adapter_bytes(b, slot);
}
/* a slot streaming in (adapter_stream), or uploaded whole where the backend cannot stream */
static inline int backend_adapter_stream(backend_t *b, const backend_adapter_desc_t *d, int group,
                                         void (*on_group)(void *), void *user, backend_adapter_t **slot) {
    if (b->iface->adapter_stream) return b->iface->adapter_stream(b, d, group, on_group, user, slot);
    int rc = b->iface->adapter_upload(b, d, slot);
    if (rc == CS_OK && on_group) on_group(user);
    return rc;
}
/* layers of SLOT in place (INT_MAX for a backend that does not stream: all) */
static inline int backend_adapter_arrived(backend_t *b, const backend_adapter_t *slot) {
    return b->iface->adapter_arrived ? b->iface->adapter_arrived(b, slot) : INT_MAX;
}
static inline bool backend_can_stream(const backend_t *b) { return b->iface->adapter_stream != NULL; }
/* slots can stream from a host copy still coming in (backend_adapter_desc_t.host_partial) */
static inline bool backend_can_feed(const backend_t *b) { return b->iface->adapter_feed != NULL; }
static inline void backend_adapter_feed(backend_t *b, backend_adapter_t *slot, int n) {
    b->iface->adapter_feed(b, slot, n);
}
static inline bool backend_has_host_assist(const backend_t *b) { return b->iface->get_signal && b->iface->wait_add; }
static inline void backend_get_signal(backend_t *b, void *dst, const backend_buf_t *src, size_t off, size_t n,
                                      uint32_t *flag, uint32_t value) {
    b->iface->get_signal(b, dst, src, off, n, flag, value);
}
static inline void backend_wait_add(backend_t *b, backend_buf_t *y, size_t off, const float *src, size_t n,
                                    const uint32_t *flag, uint32_t value) {
    b->iface->wait_add(b, y, off, src, n, flag, value);
}
static inline void backend_embed(backend_t *b, backend_buf_t *y, const backend_weight_t *t, const backend_batch_t *bt) {
    b->iface->embed(b, y, t, bt);
}
static inline void backend_matmul(backend_t *b, backend_buf_t *y, const backend_buf_t *x, int n, const backend_weight_t *w,
                                  const backend_buf_t *bias) {
    b->iface->matmul(b, y, x, n, w, bias);
}
static inline void backend_matmul_multi(backend_t *b, backend_buf_t *const *ys, const backend_buf_t *x, int n,
                                        const backend_weight_t *const *ws, const backend_buf_t *const *biases,
                                        int count) {
    if (b->iface->matmul_multi) {
        b->iface->matmul_multi(b, ys, x, n, ws, biases, count);
        return;
    }
    for (int k = 0; k < count; k++) b->iface->matmul(b, ys[k], x, n, ws[k], biases[k]);
}
static inline void backend_rmsnorm(backend_t *b, backend_buf_t *y, const backend_buf_t *x, int n, int dim,
                                   const backend_weight_t *w, float eps) {
    b->iface->rmsnorm(b, y, x, n, dim, w, eps);
}
static inline void backend_rope(backend_t *b, backend_buf_t *x, int nh, int hd, const backend_batch_t *bt,
                                const backend_buf_t *inv_freq) {
    b->iface->rope(b, x, nh, hd, bt, inv_freq);
}
static inline void backend_kv_store(backend_t *b, backend_buf_t *pool, cs_dtype kv_dtype, const backend_buf_t *src,
                                    const backend_batch_t *bt, int row_len) {
    b->iface->kv_store(b, pool, kv_dtype, src, bt, row_len);
}
static inline void backend_attention(backend_t *b, backend_buf_t *out, const backend_buf_t *q, const backend_buf_t *k,
                                     const backend_buf_t *v, cs_dtype kv_dtype, const backend_batch_t *bt, int bs,
                                     int nh, int nkv, int hd, int window) {
    b->iface->attention(b, out, q, k, v, kv_dtype, bt, bs, nh, nkv, hd, window);
}
static inline void backend_get_out_rows(backend_t *b, backend_buf_t *dst, const backend_buf_t *src,
                                        const backend_batch_t *bt, int row_len) {
    b->iface->get_out_rows(b, dst, src, bt, row_len);
}
static inline void backend_silu_mul(backend_t *b, backend_buf_t *g, const backend_buf_t *u, size_t n) {
    b->iface->silu_mul(b, g, u, n);
}
static inline void backend_add(backend_t *b, backend_buf_t *y, const backend_buf_t *x, size_t n) {
    b->iface->add(b, y, x, n);
}
static inline void backend_lora(backend_t *b, backend_buf_t *y, const backend_buf_t *x, const backend_batch_t *bt,
                                int layer, int target, int d_in, int d_out) {
    b->iface->lora(b, y, x, bt, layer, target, d_in, d_out);
}
static inline bool backend_supports_kv_dtype(const backend_t *b, cs_dtype t) {
    return (b->iface->kv_dtypes >> (unsigned)t) & 1u;
}
static inline bool backend_graph_begin(backend_t *b, uint64_t key) {
    return b->iface->graph_begin ? b->iface->graph_begin(b, key) : false;
}
static inline void backend_graph_end(backend_t *b) { if (b->iface->graph_end) b->iface->graph_end(b); }
static inline void backend_graph_reset(backend_t *b) { if (b->iface->graph_reset) b->iface->graph_reset(b); }
static inline void backend_synchronize(backend_t *b) { if (b->iface->synchronize) b->iface->synchronize(b); }
static inline void backend_get_stats(backend_t *b, backend_stats_t *st) {
    memset(st, 0, sizeof *st);
    if (b->iface->get_stats) b->iface->get_stats(b, st);
}
static inline void backend_free(backend_t *b) { if (b) b->iface->free(b); }

#ifdef __cplusplus
}
#endif
#endif
