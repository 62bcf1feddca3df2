/* backend.h: the compute backend as its callers (engine/, lora/, server/, the tests and
 * micro-benchmarks) see it: an opaque backend_t, the descriptors they fill, the capabilities
 * the backend declares, and the functions they call. What a backend implements (the method
 * table, struct backend) is backend_impl.h, which only backends include. The backends are the
 * CPU in cpu_kernels/, the strict test device beside it, and CUDA in gpu_kernels/. The
 * interface is shaped for a device with its own memory, as ggml-backend is:
 *
 *  - memory is behind opaque buffer handles (backend_buf_t) that the engine never
 *    dereferences: weights, KV pools, activations, the batch description and adapter
 *    weights are all allocated through the backend, and data crosses only by the copy
 *    functions (buf_set/buf_get, their asynchronous forms on the copy queue, buf_copy);
 *  - each forward's batch description (token ids, positions, KV slots, block tables
 *    flattened with offsets, output rows, LoRA segments) is packed on the host once and
 *    uploaded once (batch_upload); the ops take that handle, not host arrays;
 *  - adapter weights live in backend-owned slots (adapter_upload), in the dtype they came
 *    in; LoRA segments name slots;
 *  - an adapter slot may fill in while it is used (adapter_stream: layer groups on the copy
 *    queue, an "arrived" count to read); rows of a layer not yet there get their LoRA term
 *    from the host (get_signal / wait_add: host-assisted LoRA, the cold start);
 *  - what a backend offers beyond the required methods it declares in backend_caps_t;
 *    where it lacks one the functions below fall back (each says how).
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
    cs_dtype dtype;         /* F32, BF16 or F16; a block type of base/quant.h where caps.quant_weights */
    int rows, cols;         /* (out, in) for matrices */
    backend_buf_t *buf;     /* rows rows of cs_dtype_row_bytes(dtype, cols) bytes from its start */
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

/* What a backend offers beyond the required methods, declared by the backend itself when it
 * is made (backend_caps). */
typedef struct backend_caps {
    /* the ops read host memory directly: backend_buf_from_host is offered and the model uses
     * its mmap'd weights in place */
    bool host_memory;
    bool async_copies;      /* backend_buf_set_async/get_async overlap compute (else: synchronous) */
    bool pinned_host;       /* backend_host_alloc gives page-locked memory (else: aligned malloc) */
    bool events;            /* events mark the copy queue (else: every event completes at once) */
    bool adapter_stream;    /* slots fill in on the copy queue (else: uploaded whole) */
    bool adapter_feed;      /* ... from a host copy still coming in (host_partial, backend_adapter_feed) */
    bool host_assist;       /* host-assisted ops: backend_get_signal, backend_wait_add */
    bool graphs;            /* forwards recorded and replayed as device graphs (backend_graph_begin) */
    unsigned kv_dtypes;     /* the KV pool dtypes attention reads, a bit per cs_dtype */
    bool quant_weights;     /* matmul and embed take the block-quantized weights of base/quant.h */
} backend_caps_t;

const backend_caps_t *backend_caps(const backend_t *b);
const char *backend_name(const backend_t *b);
int backend_n_threads(const backend_t *b); /* the host threads its ops run on (a device: 1) */
void backend_free(backend_t *b);           /* NULL: nothing */

/* ---- memory ---- */
/* the contents are undefined until written (as cudaMalloc's; the strict device fills them
 * with NaN so that a read of what nobody wrote shows) */
backend_buf_t *backend_buf_alloc(backend_t *b, size_t n);
void backend_buf_free(backend_t *b, backend_buf_t *p); /* NULL: nothing */
size_t backend_buf_size(backend_t *b, const backend_buf_t *p);
/* a buffer over host memory that the caller keeps valid until backend_buf_free, which does
 * not free it; NULL where the backend does not offer them (caps.host_memory false) */
backend_buf_t *backend_buf_from_host(backend_t *b, void *p, size_t n);
/* W, loaded and read-only from here on, is a matmul weight; the backend may keep a form of
 * its own beside it until W's buffer is freed (the CPU backend's --compress-weights: BF16
 * coded in 12 bits). 0; BACKEND_WEIGHT_HOST_UNUSED when the backend's own form serves every
 * op on W's buffer from now on, so that the caller may release the host memory behind a
 * backend_buf_from_host buffer (the buffer stays valid, its bytes are never read again); or
 * an error code with cs_error set (out of memory). 0 where the backend keeps no form. */
#define BACKEND_WEIGHT_HOST_UNUSED 1
int backend_weight_prepare(backend_t *b, const backend_weight_t *w);
/* host -> buffer and buffer -> host, synchronous (after every op queued before) */
void backend_buf_set(backend_t *b, backend_buf_t *d, size_t off, const void *s, size_t n);
void backend_buf_get(backend_t *b, void *d, const backend_buf_t *s, size_t off, size_t n);
/* buffer -> buffer, in order with the compute ops (the n-sample fork's KV copy) */
void backend_buf_copy(backend_t *b, backend_buf_t *d, size_t doff, const backend_buf_t *s, size_t soff, size_t n);
/* the copies on the copy queue, overlapping compute (caps.async_copies; else the synchronous
 * ones); the host memory must stay valid (and, for set, unchanged) until an event recorded
 * after them has completed */
void backend_buf_set_async(backend_t *b, backend_buf_t *d, size_t off, const void *s, size_t n);
void backend_buf_get_async(backend_t *b, void *d, const backend_buf_t *s, size_t off, size_t n);
void *backend_host_alloc(backend_t *b, size_t n); /* pinned (caps.pinned_host), else aligned malloc */
void backend_host_free(backend_t *b, void *p);
/* Events (caps.events): record marks the copy queue's position; wait makes the compute queue
 * wait for it; query is true once it completed; synchronize blocks the host until then.
 * Without them: a non-NULL token whose every query is true (copies were synchronous). */
backend_event_t *backend_event_new(backend_t *b);
void backend_event_free(backend_t *b, backend_event_t *ev);
void backend_event_record(backend_t *b, backend_event_t *ev);
void backend_event_wait(backend_t *b, backend_event_t *ev);
bool backend_event_query(backend_t *b, backend_event_t *ev);
void backend_event_synchronize(backend_t *b, backend_event_t *ev);

/* ---- the per-forward batch and adapter slots ---- */
/* Upload a batch description into *batch (allocated on first use, reused after): one upload
 * per forward. */
int backend_batch_upload(backend_t *b, backend_batch_t **batch, const backend_batch_desc_t *d);
void backend_batch_free(backend_t *b, backend_batch_t *batch); /* NULL: nothing */
/* An adapter's weights into a slot of the backend (kept in their dtype). */
int backend_adapter_upload(backend_t *b, const backend_adapter_desc_t *d, backend_adapter_t **slot);
void backend_adapter_free(backend_t *b, backend_adapter_t *slot); /* NULL: nothing */
size_t backend_adapter_bytes(backend_t *b, const backend_adapter_t *slot); /* device bytes it holds */
/* A slot that fills in on the copy queue, GROUP layers at a time, layer 0 first
 * (caps.adapter_stream); it returns at once. backend_adapter_arrived reads how many layers
 * are in place (a count the copy queue raises after each group: no lock, no device sync);
 * ops queued after that read may use those layers. ON_GROUP(USER) (may be NULL) runs after
 * each group, on the backend's copy thread: it must be cheap. The host memory of D stays
 * valid until every layer arrived or the slot is freed (adapter_free waits for the copies in
 * flight). Without streaming: adapter_upload, every layer there at once, then ON_GROUP once. */
int backend_adapter_stream(backend_t *b, const backend_adapter_desc_t *d, int group, void (*on_group)(void *),
                           void *user, backend_adapter_t **slot);
/* layers of SLOT in place (INT_MAX for a backend that does not stream: all) */
int backend_adapter_arrived(backend_t *b, const backend_adapter_t *slot);
/* Only with caps.adapter_feed: the host memory of a slot streamed with host_partial now holds
 * layers [0, N) (N only grows; N = n_layers: all of it): their copies may be queued. Never
 * waits (it may be called from a thread the copies must not block: the adapter loader's);
 * callable from any one thread at a time per slot, while the slot lives. */
void backend_adapter_feed(backend_t *b, backend_adapter_t *slot, int n);

/* ---- compute ---- */
/* y[batch rows, table.cols] = rows ids[i] of table */
void backend_embed(backend_t *b, backend_buf_t *y, const backend_weight_t *t, const backend_batch_t *bt);
/* y[n, w.rows] = x[n, w.cols] · wᵀ (+ bias[w.rows], F32, may be NULL) */
void backend_matmul(backend_t *b, backend_buf_t *y, const backend_buf_t *x, int n, const backend_weight_t *w,
                    const backend_buf_t *bias);
/* ys[k] = x · ws[k]ᵀ (+ biases[k]) for k < count (q/k/v, gate/up): in one go where the backend
 * has it, else one matmul each */
void backend_matmul_multi(backend_t *b, backend_buf_t *const *ys, const backend_buf_t *x, int n,
                          const backend_weight_t *const *ws, const backend_buf_t *const *biases, int count);
/* y[n, dim] = x / rms(x) * w ; w is a (1, dim) F32 weight; y may equal x */
void backend_rmsnorm(backend_t *b, backend_buf_t *y, const backend_buf_t *x, int n, int dim, const backend_weight_t *w,
                     float eps);
/* rotate-half RoPE in place on x[batch rows, nh, hd], row i at the batch's position i;
 * inv_freq: hd/2 F32 values */
void backend_rope(backend_t *b, backend_buf_t *x, int nh, int hd, const backend_batch_t *bt,
                  const backend_buf_t *inv_freq);
/* pool row slots[i] = src row i, rows of row_len floats (the new keys or values), stored as
 * kv_dtype (one attention reads: BF16 rounded to nearest even) */
void backend_kv_store(backend_t *b, backend_buf_t *pool, cs_dtype kv_dtype, const backend_buf_t *src,
                      const backend_batch_t *bt, int row_len);
/* Paged attention over the batch's sequences: sequence s owns query rows [row0, row0 + n) of
 * q/out; its keys and values for positions [0, pos0 + n) live in the pools k/v as
 * [block][bs][nkv * hd], position p at its table's block p / bs (the new keys already
 * stored). Causal; window > 0 limits keys to (p - window, p]. The pools are kv_dtype, one of
 * caps.kv_dtypes. */
void backend_attention(backend_t *b, backend_buf_t *out, const backend_buf_t *q, const backend_buf_t *k,
                       const backend_buf_t *v, cs_dtype kv_dtype, const backend_batch_t *bt, int bs, int nh, int nkv,
                       int hd, int window);
/* dst row i = src row out_rows[i] of the batch, rows of row_len floats */
void backend_get_out_rows(backend_t *b, backend_buf_t *dst, const backend_buf_t *src, const backend_batch_t *bt,
                          int row_len);
/* g[i] = silu(g[i]) * u[i], n elements */
void backend_silu_mul(backend_t *b, backend_buf_t *g, const backend_buf_t *u, size_t n);
/* y[i] += x[i], n elements */
void backend_add(backend_t *b, backend_buf_t *y, const backend_buf_t *x, size_t n);
/* Grouped LoRA (SGMV/BGMV): for every LoRA segment of the batch whose slot adapts (layer,
 * target), y rows += scale · (x rows · aᵀ) · bᵀ. */
void backend_lora(backend_t *b, backend_buf_t *y, const backend_buf_t *x, const backend_batch_t *bt, int layer,
                  int target, int d_in, int d_out);
/* Host-assisted ops, the device side of the cold start (only with caps.host_assist).
 * get_signal: after the ops before it on the compute queue, copy N bytes of SRC at OFF into
 * DST (host memory from backend_host_alloc) and then set *FLAG = VALUE (cs_flag_store's
 * meaning); the caller's host does not wait, and the compute queue need not either (the
 * CUDA backend copies on a queue of its own): the caller writes SRC again only after a
 * wait_add that waits, through the host, for these bytes. wait_add: on the compute queue, wait until *FLAG
 * >= VALUE (written by host threads with cs_flag_add/cs_flag_store), then add the N values at
 * SRC (host memory from backend_host_alloc; F32, or BF16: half the bytes over the link) to
 * Y's floats from OFF bytes on. The host memory
 * and flags stay valid until the queue passed them (backend_synchronize). LAYER names the
 * wait: a device that gives up on a wait that never ends (the CUDA backend's spin deadline)
 * says which layer it was. ALIVE (host memory from backend_host_alloc, or NULL): a count the
 * host raises while it is still at work (waiting for a disk): each change restarts the
 * deadline, so only a host that stopped moving is given up on. */
void backend_get_signal(backend_t *b, void *dst, const backend_buf_t *src, size_t off, size_t n, uint32_t *flag,
                        uint32_t value);
void backend_wait_add(backend_t *b, backend_buf_t *y, size_t off, const void *src, cs_dtype src_dtype, size_t n,
                      const uint32_t *flag, uint32_t value, const uint32_t *alive, int layer);

/* A forward's ops replayed as a device graph (caps.graphs: CUDA graphs). The caller brackets
 * a forward whose every launch is fixed by key (the same buffers and shapes; only the
 * uploaded batch's contents differ) with backend_graph_begin and, when that returned false,
 * backend_graph_end. graph_begin returns true when it launched the graph recorded for key in
 * place of the ops (the caller issues none of them), false when the caller must issue them
 * (the backend may record them, or run them once first to settle its scratch). graph_reset
 * forgets every graph (the caller's buffers moved). Without graphs: ops always run. */
bool backend_graph_begin(backend_t *b, uint64_t key);
void backend_graph_end(backend_t *b);
void backend_graph_reset(backend_t *b);

void backend_synchronize(backend_t *b);  /* wait for the compute queue */
void backend_get_stats(backend_t *b, backend_stats_t *st); /* zeros where the backend counts nothing */

#ifdef __cplusplus
}
#endif
#endif
