/* backend.cu: struct backend_i (engine/backend.h) on one CUDA device.
 *
 * Memory: every buffer is a cudaMalloc under the backend's budget (memory_fraction of the
 * device's memory); a request past it fails with a message saying how much was asked, how
 * much is in use and what the budget is, and the caller names what it was for.
 * Queues: the compute stream runs the ops in order (cuBLAS is bound to it); the copy stream
 * carries the asynchronous copies, and events order the two. A synchronous copy runs on the
 * compute stream and waits for it.
 * A batch: its description is packed into pinned host memory and uploaded in one copy
 * (ids, positions, KV slots, output rows, block tables, per-row sequence and LoRA segment,
 * the sequence and segment tables). The host keeps what launches need to size their grids.
 * Adapter slots: one device allocation per adapter holding every module's A (rank, d_in)
 * and B transposed (rank, d_out) in the dtype they came in, and the slot's module table
 * (lora_mod per layer and target) that the LoRA kernels read through a batch's segments.
 * Graphs (opt-in, params.graphs): a decode step's ops, whose launches are fixed by the batch
 * size and whether adapters take part (graph_begin's key), run eagerly the first time (its
 * scratch settles), are captured into a CUDA graph the second, and replayed after. Every
 * launch in graph mode is shaped for the key alone: the batch's arrays sit at offsets that
 * depend only on its size, and the LoRA grids cover the largest rank. Anything that moves a
 * captured buffer (a batch or scratch that grows, the caller's graph_reset) drops them all.
 *
 * Built twice: with nvcc (cuda_backend_new) and against the host emulator
 * (cuda_emu_backend_new, -DCS_CUDA_EMU): the code below is the same. */
#include "gpu_kernels/ops.cuh"

#include <pthread.h>
#include <string.h>

#include "gpu_kernels/cuda_pub.h"
#include "gpu_kernels/gpu_backend.h"

#ifdef CS_CUDA_EMU
#define PUB_NEW cuda_emu_backend_new
#define PUB_NAME CUDA_EMU_BACKEND_NAME
#else
#define PUB_NEW cuda_backend_new
#define PUB_NAME CUDA_BACKEND_NAME
#endif

namespace CS_NS {

[[noreturn]] void cuda_fatal(const char *call, const char *err, const char *file, int line) {
    fprintf(stderr, "CUDA error: %s\n  in %s at %s:%d\n", err, call, file, line);
    abort();
}

enum { MAX_GRAPHS = 64, CUBLAS_WORKSPACE = 32 << 20 };

struct graph_entry {
    uint64_t key;
    bool warm;              /* ran eagerly once */
    cudaGraphExec_t exec;   /* captured (NULL until the second run) */
    uint64_t last_use;
};

struct ctx {
    cuda_pub_t pub;         /* first: cuda_pub.c reads it */
    int device;
    size_t total;           /* the device's memory */
    cudaStream_t compute, copy;
    cudaEvent_t compute_mark; /* where the copy stream waits for compute */
    cublasHandle_t blas;
    void *xh;               /* activations rounded to 16 bits for a GEMM */
    size_t xh_cap;
    float *lora_t;          /* the shrink's results, (rows, max rank) */
    size_t lora_t_cap;
    pthread_mutex_t mu;     /* stats */
    backend_stats_t stats;
    void *workspace;        /* cuBLAS's, set once: graph captures must not allocate */
    /* graphs */
    bool graphs;
    graph_entry graph[MAX_GRAPHS];
    int n_graphs;
    uint64_t graph_clock;
    bool graph_mode;        /* between a graph_begin that returned false and graph_end */
    graph_entry *cur;       /* its entry */
    graph_entry *capturing; /* the entry being captured, or NULL */
    pthread_mutex_t capture_mu; /* held through a capture: no event is recorded on compute meanwhile */
};

} /* namespace CS_NS */

struct backend_buf {
    void *d;
    size_t n;
};

struct backend_event {
    cudaEvent_t ev;
    bool recorded;
};

struct backend_adapter {
    int n_layers;
    void *mem;                      /* every module's a and bt, then the table */
    size_t bytes;
    CS_NS::lora_mod *table;         /* on the device: [n_layers * BACKEND_LORA_TARGETS] */
    CS_NS::lora_mod *host_table;    /* its host copy (device pointers inside) */
    int32_t *dims;                  /* [2 * modules]: d_in, d_out of each, on the host */
};

struct backend_batch {
    void *mem;                      /* the device arrays */
    size_t mem_cap;
    char *stage;                    /* pinned */
    size_t stage_cap;
    cudaEvent_t uploaded;           /* the last upload's copy has read the stage */
    bool pending;
    int n_tokens, n_out, n_seqs, n_lora, n_blocks;
    const int32_t *ids, *pos, *slots, *out_rows, *blocks, *row_seq, *row_lseg; /* device */
    const CS_NS::attn_seq *seqs;    /* device */
    const CS_NS::lora_seg *lsegs;   /* device */
    const backend_adapter_t **hslots; /* host: each segment's slot */
    int hslot_cap;
};

namespace CS_NS {

static ctx *C(backend_t *b) { return (ctx *)b->ctx; }

static void stat_add(ctx *c, uint64_t *bytes, uint64_t *count, size_t n) {
    pthread_mutex_lock(&c->mu);
    *bytes += n;
    (*count)++;
    pthread_mutex_unlock(&c->mu);
}

/* device memory under the budget; NULL with a message */
static void *dalloc(ctx *c, size_t n) {
    size_t want = n ? n : 1;
    size_t used = __atomic_add_fetch(&c->pub.used, want, __ATOMIC_RELAXED);
    if (used > c->pub.budget) {
        __atomic_sub_fetch(&c->pub.used, want, __ATOMIC_RELAXED);
        cs_error_set(CS_ENOMEM,
                     "GPU memory: %.1f MiB do not fit: %.1f MiB of the budget of %.1f MiB are in use "
                     "(--gpu-memory-fraction %.2f of %.1f MiB)",
                     want / 1048576.0, (used - want) / 1048576.0, c->pub.budget / 1048576.0,
                     (double)c->pub.budget / (double)c->total, c->total / 1048576.0);
        return NULL;
    }
    CUDA_CHECK(cudaSetDevice(c->device));
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, want);
    if (e != cudaSuccess) {
        (void)cudaGetLastError(); /* clear it */
        __atomic_sub_fetch(&c->pub.used, want, __ATOMIC_RELAXED);
        size_t fr = 0, tot = 0;
        (void)cudaMemGetInfo(&fr, &tot);
        cs_error_set(CS_ENOMEM, "GPU memory: cudaMalloc of %.1f MiB failed (%s); the device has %.1f MiB free",
                     want / 1048576.0, cudaGetErrorString(e), fr / 1048576.0);
        return NULL;
    }
    return p;
}

static void dfree(ctx *c, void *p, size_t n) {
    if (!p) return;
    CUDA_CHECK(cudaFree(p));
    __atomic_sub_fetch(&c->pub.used, n ? n : 1, __ATOMIC_RELAXED);
}

/* the copy stream waits for everything queued on compute so far */
static void copy_after_compute(ctx *c) {
    pthread_mutex_lock(&c->capture_mu); /* not while compute is being captured (another thread) */
    CUDA_CHECK(cudaEventRecord(c->compute_mark, c->compute));
    CUDA_CHECK(cudaStreamWaitEvent(c->copy, c->compute_mark, 0));
    pthread_mutex_unlock(&c->capture_mu);
}

/* ---- graphs ---- */
static void graphs_reset(ctx *c) {
    CS_ASSERT(!c->capturing);
    c->cur = NULL;
    for (int i = 0; i < c->n_graphs; i++)
        if (c->graph[i].exec) CUDA_CHECK(cudaGraphExecDestroy(c->graph[i].exec));
    c->n_graphs = 0;
}

static bool be_graph_begin(backend_t *b, uint64_t key) {
    ctx *c = C(b);
    if (!c->graphs) return false;
    graph_entry *g = NULL;
    for (int i = 0; i < c->n_graphs && !g; i++)
        if (c->graph[i].key == key) g = &c->graph[i];
    if (!g) {
        if (c->n_graphs == MAX_GRAPHS) { /* the least recently used goes */
            int lru = 0;
            for (int i = 1; i < c->n_graphs; i++)
                if (c->graph[i].last_use < c->graph[lru].last_use) lru = i;
            if (c->graph[lru].exec) CUDA_CHECK(cudaGraphExecDestroy(c->graph[lru].exec));
            c->graph[lru] = c->graph[--c->n_graphs];
        }
        g = &c->graph[c->n_graphs++];
        *g = graph_entry{key, false, NULL, 0};
    }
    g->last_use = ++c->graph_clock;
    if (g->exec) {
        CUDA_CHECK(cudaGraphLaunch(g->exec, c->compute));
        pthread_mutex_lock(&c->mu);
        c->stats.graph_replays++;
        pthread_mutex_unlock(&c->mu);
        return true;
    }
    c->graph_mode = true;
    c->cur = g;
    if (g->warm) { /* the second time: record it */
        pthread_mutex_lock(&c->capture_mu);
        CUDA_CHECK(cudaStreamBeginCapture(c->compute, cudaStreamCaptureModeRelaxed));
        c->capturing = g;
    }
    return false;
}

static void be_graph_end(backend_t *b) {
    ctx *c = C(b);
    if (!c->graph_mode) return;
    c->graph_mode = false;
    graph_entry *g = c->capturing;
    if (!g) { /* the eager first run of its key (unless a reset dropped it meanwhile) */
        if (c->cur >= c->graph && c->cur < c->graph + c->n_graphs) c->cur->warm = true;
        return;
    }
    cudaGraph_t graph;
    CUDA_CHECK(cudaStreamEndCapture(c->compute, &graph));
    c->capturing = NULL;
    pthread_mutex_unlock(&c->capture_mu);
    CUDA_CHECK(cudaGraphInstantiate(&g->exec, graph, 0));
    CUDA_CHECK(cudaGraphDestroy(graph));
    CUDA_CHECK(cudaGraphLaunch(g->exec, c->compute)); /* the captured work has not run yet */
    pthread_mutex_lock(&c->mu);
    c->stats.graph_captures++;
    pthread_mutex_unlock(&c->mu);
}

static void be_graph_reset(backend_t *b) { graphs_reset(C(b)); }

/* ---- memory ---- */
static backend_buf_t *be_buf_alloc(backend_t *b, size_t n) {
    backend_buf_t *buf = (backend_buf_t *)calloc(1, sizeof *buf);
    if (!buf) {
        cs_error_set(CS_ENOMEM, "out of memory");
        return NULL;
    }
    if (!(buf->d = dalloc(C(b), n))) {
        free(buf);
        return NULL;
    }
    buf->n = n;
    return buf;
}

static void be_buf_free(backend_t *b, backend_buf_t *buf) {
    dfree(C(b), buf->d, buf->n);
    free(buf);
}

static size_t be_buf_size(backend_t *b, const backend_buf_t *buf) {
    (void)b;
    return buf->n;
}

static char *at(const backend_buf_t *buf, size_t off, size_t n) {
    CS_ASSERT(off <= buf->n && n <= buf->n - off);
    return (char *)buf->d + off;
}

static void be_buf_set(backend_t *b, backend_buf_t *dst, size_t off, const void *src, size_t n) {
    ctx *c = C(b);
    if (!n) return;
    CUDA_CHECK(cudaMemcpyAsync(at(dst, off, n), src, n, cudaMemcpyHostToDevice, c->compute));
    CUDA_CHECK(cudaStreamSynchronize(c->compute));
    stat_add(c, &c->stats.h2d_bytes, &c->stats.h2d_copies, n);
}

static void be_buf_get(backend_t *b, void *dst, const backend_buf_t *src, size_t off, size_t n) {
    ctx *c = C(b);
    if (!n) return;
    CUDA_CHECK(cudaMemcpyAsync(dst, at(src, off, n), n, cudaMemcpyDeviceToHost, c->compute));
    CUDA_CHECK(cudaStreamSynchronize(c->compute));
    stat_add(c, &c->stats.d2h_bytes, &c->stats.d2h_copies, n);
}

static void be_buf_copy(backend_t *b, backend_buf_t *dst, size_t doff, const backend_buf_t *src, size_t soff, size_t n) {
    ctx *c = C(b);
    if (!n) return;
    CUDA_CHECK(cudaMemcpyAsync(at(dst, doff, n), at(src, soff, n), n, cudaMemcpyDeviceToDevice, c->compute));
    stat_add(c, &c->stats.d2d_bytes, &c->stats.d2d_copies, n);
}

static void be_buf_set_async(backend_t *b, backend_buf_t *dst, size_t off, const void *src, size_t n) {
    ctx *c = C(b);
    if (!n) return;
    copy_after_compute(c);
    CUDA_CHECK(cudaMemcpyAsync(at(dst, off, n), src, n, cudaMemcpyHostToDevice, c->copy));
    stat_add(c, &c->stats.h2d_bytes, &c->stats.h2d_copies, n);
}

static void be_buf_get_async(backend_t *b, void *dst, const backend_buf_t *src, size_t off, size_t n) {
    ctx *c = C(b);
    if (!n) return;
    copy_after_compute(c);
    CUDA_CHECK(cudaMemcpyAsync(dst, at(src, off, n), n, cudaMemcpyDeviceToHost, c->copy));
    stat_add(c, &c->stats.d2h_bytes, &c->stats.d2h_copies, n);
}

static void *be_host_alloc(backend_t *b, size_t n) {
    CUDA_CHECK(cudaSetDevice(C(b)->device));
    void *p = NULL;
    if (cudaMallocHost(&p, n ? n : 1) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return p;
}

static void be_host_free(backend_t *b, void *p) {
    (void)b;
    if (p) CUDA_CHECK(cudaFreeHost(p));
}

static backend_event_t *be_event_new(backend_t *b) {
    CUDA_CHECK(cudaSetDevice(C(b)->device));
    backend_event_t *ev = (backend_event_t *)calloc(1, sizeof *ev);
    if (!ev) return NULL;
    if (cudaEventCreateWithFlags(&ev->ev, cudaEventDisableTiming) != cudaSuccess) {
        (void)cudaGetLastError();
        free(ev);
        return NULL;
    }
    return ev;
}

static void be_event_free(backend_t *b, backend_event_t *ev) {
    (void)b;
    CUDA_CHECK(cudaEventDestroy(ev->ev));
    free(ev);
}

static void be_event_record(backend_t *b, backend_event_t *ev) {
    CUDA_CHECK(cudaEventRecord(ev->ev, C(b)->copy));
    ev->recorded = true;
}

static void be_event_wait(backend_t *b, backend_event_t *ev) {
    if (ev->recorded) CUDA_CHECK(cudaStreamWaitEvent(C(b)->compute, ev->ev, 0));
}

static bool be_event_query(backend_t *b, backend_event_t *ev) {
    (void)b;
    if (!ev->recorded) return true;
    cudaError_t e = cudaEventQuery(ev->ev);
    if (e == cudaErrorNotReady) {
        (void)cudaGetLastError();
        return false;
    }
    CUDA_CHECK(e);
    return true;
}

static void be_event_synchronize(backend_t *b, backend_event_t *ev) {
    (void)b;
    if (ev->recorded) CUDA_CHECK(cudaEventSynchronize(ev->ev));
}

/* ---- the batch ---- */
static size_t align16(size_t n) { return (n + 15) & ~(size_t)15; }

static int be_batch_upload(backend_t *b, backend_batch_t **io, const backend_batch_desc_t *d) {
    ctx *c = C(b);
    backend_batch_t *bt = *io;
    if (!bt) {
        if (!(bt = (backend_batch_t *)calloc(1, sizeof *bt))) return cs_error_set(CS_ENOMEM, "out of memory");
        if (cudaEventCreateWithFlags(&bt->uploaded, cudaEventDisableTiming) != cudaSuccess) {
            free(bt);
            return cs_error_set(CS_ENOMEM, "cannot create a CUDA event");
        }
        *io = bt;
    }
    if (d->n_tokens < 0 || d->n_seqs < 0 || d->n_out < 0 || d->n_blocks < 0 || d->n_lora < 0)
        return cs_error_set(CS_EINVAL, "batch: negative counts");
    int T = d->n_tokens;
    /* ids | pos | slots | out_rows | row_seq | row_lseg, the sequence table, the segment table
     * (room for one per sequence), and last the block tables: every offset but the end's
     * depends only on the token, output and sequence counts (a graph's launches keep them) */
    size_t n32 = (size_t)5 * T + d->n_out;
    size_t o_seqs = align16(n32 * sizeof(int32_t));
    size_t o_lsegs = align16(o_seqs + sizeof(attn_seq) * (size_t)d->n_seqs);
    size_t o_blocks = align16(o_lsegs + sizeof(lora_seg) * (size_t)(d->n_lora > d->n_seqs ? d->n_lora : d->n_seqs));
    size_t need = o_blocks + sizeof(int32_t) * (size_t)d->n_blocks;
    if (bt->pending) { /* the last upload's copy still reads the stage */
        CUDA_CHECK(cudaEventSynchronize(bt->uploaded));
        bt->pending = false;
    }
    if (need > bt->mem_cap) {
        size_t cap = need > 4096 ? need + need / 2 : 4096;
        void *m = dalloc(c, cap);
        if (!m) return cs_error_set(CS_ENOMEM, "batch description: %s", cs_error_last());
        CUDA_CHECK(cudaStreamSynchronize(c->compute)); /* ops of the last forward may still read it */
        graphs_reset(c);
        dfree(c, bt->mem, bt->mem_cap);
        bt->mem = m;
        bt->mem_cap = cap;
    }
    if (need > bt->stage_cap) {
        if (bt->stage) CUDA_CHECK(cudaFreeHost(bt->stage));
        bt->stage = NULL;
        bt->stage_cap = 0;
        if (cudaMallocHost((void **)&bt->stage, bt->mem_cap) != cudaSuccess) {
            bt->stage = NULL;
            return cs_error_set(CS_ENOMEM, "out of pinned memory for a batch description");
        }
        bt->stage_cap = bt->mem_cap;
    }
    if (d->n_lora > bt->hslot_cap) {
        free(bt->hslots);
        bt->hslots = (const backend_adapter_t **)malloc(sizeof *bt->hslots * (size_t)d->n_lora);
        bt->hslot_cap = bt->hslots ? d->n_lora : 0;
        if (!bt->hslots) return cs_error_set(CS_ENOMEM, "out of memory");
    }
    int32_t *h = (int32_t *)bt->stage;
    int32_t *ids = h, *pos = ids + T, *slots = pos + T, *outr = slots + T, *row_seq = outr + d->n_out;
    int32_t *row_lseg = row_seq + T, *blocks = (int32_t *)(bt->stage + o_blocks);
    if (T) {
        memcpy(ids, d->ids, sizeof(int32_t) * T);
        memcpy(pos, d->pos, sizeof(int32_t) * T);
        memcpy(slots, d->slots, sizeof(int32_t) * T);
    }
    for (int i = 0; i < d->n_out; i++) {
        if (d->out_rows[i] < 0 || d->out_rows[i] >= T) return cs_error_set(CS_EINVAL, "batch: output row %d is outside", i);
        outr[i] = d->out_rows[i];
    }
    if (d->n_blocks) memcpy(blocks, d->blocks, sizeof(int32_t) * d->n_blocks);
    for (int i = 0; i < T; i++) row_seq[i] = -1, row_lseg[i] = -1;
    attn_seq *seqs = (attn_seq *)(bt->stage + o_seqs);
    for (int s = 0; s < d->n_seqs; s++) {
        const backend_seq_desc_t *q = &d->seqs[s];
        if (q->row0 < 0 || q->n < 0 || q->row0 + q->n > T || q->pos0 < 0)
            return cs_error_set(CS_EINVAL, "batch: sequence %d's rows are outside", s);
        if (q->blk0 < 0 || q->blk0 > d->n_blocks) return cs_error_set(CS_EINVAL, "batch: sequence %d's table is outside", s);
        for (int i = q->row0; i < q->row0 + q->n; i++) {
            if (row_seq[i] >= 0) return cs_error_set(CS_EINVAL, "batch: row %d is in two sequences", i);
            row_seq[i] = s;
        }
        seqs[s] = attn_seq{q->row0, q->n, q->pos0, q->blk0};
    }
    for (int i = 0; i < T; i++)
        if (row_seq[i] < 0) return cs_error_set(CS_EINVAL, "batch: row %d is in no sequence", i);
    lora_seg *lsegs = (lora_seg *)(bt->stage + o_lsegs);
    for (int i = 0; i < d->n_lora; i++) {
        const backend_lora_seg_desc_t *g = &d->lora[i];
        if (!g->slot) return cs_error_set(CS_EINVAL, "batch: segment %d names no adapter slot", i);
        if (g->row0 < 0 || g->n < 0 || g->row0 + g->n > T)
            return cs_error_set(CS_EINVAL, "batch: segment %d's rows are outside", i);
        for (int r = g->row0; r < g->row0 + g->n; r++) {
            if (row_lseg[r] >= 0) return cs_error_set(CS_EINVAL, "batch: row %d is in two LoRA segments", r);
            row_lseg[r] = i;
        }
        lsegs[i] = lora_seg{g->row0, g->n, g->slot->table, g->device_layers, 0};
        bt->hslots[i] = g->slot;
    }
    CUDA_CHECK(cudaMemcpyAsync(bt->mem, bt->stage, need, cudaMemcpyHostToDevice, c->compute));
    CUDA_CHECK(cudaEventRecord(bt->uploaded, c->compute));
    bt->pending = true;
    const int32_t *m = (const int32_t *)bt->mem;
    bt->ids = m;
    bt->pos = m + T;
    bt->slots = m + 2 * (size_t)T;
    bt->out_rows = m + 3 * (size_t)T;
    bt->row_seq = bt->out_rows + d->n_out;
    bt->row_lseg = bt->row_seq + T;
    bt->blocks = (const int32_t *)((const char *)bt->mem + o_blocks);
    bt->seqs = (const attn_seq *)((const char *)bt->mem + o_seqs);
    bt->lsegs = (const lora_seg *)((const char *)bt->mem + o_lsegs);
    bt->n_tokens = T;
    bt->n_out = d->n_out;
    bt->n_seqs = d->n_seqs;
    bt->n_lora = d->n_lora;
    bt->n_blocks = d->n_blocks;
    pthread_mutex_lock(&c->mu);
    c->stats.batch_uploads++;
    c->stats.h2d_bytes += need;
    c->stats.h2d_copies++;
    pthread_mutex_unlock(&c->mu);
    return CS_OK;
}

static void be_batch_free(backend_t *b, backend_batch_t *bt) {
    ctx *c = C(b);
    CUDA_CHECK(cudaStreamSynchronize(c->compute));
    dfree(c, bt->mem, bt->mem_cap);
    if (bt->stage) CUDA_CHECK(cudaFreeHost(bt->stage));
    CUDA_CHECK(cudaEventDestroy(bt->uploaded));
    free(bt->hslots);
    free(bt);
}

/* ---- adapter slots ---- */
static int dt_of(cs_dtype t) { return t == CS_DTYPE_F32 ? DT_F32 : t == CS_DTYPE_BF16 ? DT_BF16 : DT_F16; }

static size_t align256(size_t n) { return (n + 255) & ~(size_t)255; }

static int be_adapter_upload(backend_t *b, const backend_adapter_desc_t *ad, backend_adapter_t **out) {
    ctx *c = C(b);
    *out = NULL;
    int nm = ad->n_layers * BACKEND_LORA_TARGETS;
    if (nm <= 0) return cs_error_set(CS_EINVAL, "adapter slot: no layers");
    /* sizes first: one allocation holds everything */
    size_t total = 0;
    for (int i = 0; i < nm; i++) {
        const backend_lora_module_desc_t *m = &ad->mods[i];
        if (m->rank <= 0) continue;
        if (m->dtype != CS_DTYPE_F32 && m->dtype != CS_DTYPE_BF16 && m->dtype != CS_DTYPE_F16)
            return cs_error_set(CS_EUNSUPPORTED, "adapter slot: %s LoRA weights (the CUDA kernels take F32, F16 and BF16)",
                                cs_dtype_name(m->dtype));
        if (m->rank > LORA_MAX_RANK)
            return cs_error_set(CS_EUNSUPPORTED, "adapter slot: rank %d (the CUDA kernels take ranks up to %d)", m->rank,
                                LORA_MAX_RANK);
        size_t es = cs_dtype_size(m->dtype);
        total += align256(es * (size_t)m->rank * m->d_in) + align256(es * (size_t)m->rank * m->d_out);
    }
    size_t table_off = total;
    total += sizeof(lora_mod) * (size_t)nm;
    backend_adapter_t *s = (backend_adapter_t *)calloc(1, sizeof *s);
    if (!s) return cs_error_set(CS_ENOMEM, "out of memory");
    s->n_layers = ad->n_layers;
    s->host_table = (lora_mod *)calloc((size_t)nm, sizeof(lora_mod));
    s->dims = (int32_t *)calloc((size_t)nm * 2, sizeof(int32_t));
    if (!s->host_table || !s->dims) {
        free(s->host_table);
        free(s->dims);
        free(s);
        return cs_error_set(CS_ENOMEM, "out of memory");
    }
    if (!(s->mem = dalloc(c, total))) {
        int rc = cs_error_set(CS_ENOMEM, "adapter slot: %s", cs_error_last());
        free(s->host_table);
        free(s->dims);
        free(s);
        return rc;
    }
    s->bytes = total;
    s->table = (lora_mod *)((char *)s->mem + table_off);
    /* B transposed where the description has none: staged on the host until the copies end */
    void **temps = (void **)calloc((size_t)nm, sizeof(void *));
    if (!temps) {
        dfree(c, s->mem, s->bytes);
        free(s->host_table);
        free(s->dims);
        free(s);
        return cs_error_set(CS_ENOMEM, "out of memory");
    }
    copy_after_compute(c);
    size_t off = 0;
    int rc = CS_OK;
    for (int i = 0; i < nm && rc == CS_OK; i++) {
        const backend_lora_module_desc_t *m = &ad->mods[i];
        s->dims[2 * i] = m->d_in;
        s->dims[2 * i + 1] = m->d_out;
        if (m->rank <= 0) continue;
        size_t es = cs_dtype_size(m->dtype), na = es * (size_t)m->rank * m->d_in, nb = es * (size_t)m->rank * m->d_out;
        char *da = (char *)s->mem + off, *db = da + align256(na);
        off += align256(na) + align256(nb);
        const void *bt = m->bt;
        if (!bt) {
            char *tp = (char *)malloc(nb ? nb : 1);
            if (!tp) { rc = cs_error_set(CS_ENOMEM, "out of memory"); break; }
            temps[i] = tp;
            const char *src = (const char *)m->b; /* (d_out, rank) -> (rank, d_out) */
            for (int o = 0; o < m->d_out; o++)
                for (int r = 0; r < m->rank; r++)
                    memcpy(tp + ((size_t)r * m->d_out + o) * es, src + ((size_t)o * m->rank + r) * es, es);
            bt = tp;
        }
        CUDA_CHECK(cudaMemcpyAsync(da, m->a, na, cudaMemcpyHostToDevice, c->copy));
        CUDA_CHECK(cudaMemcpyAsync(db, bt, nb, cudaMemcpyHostToDevice, c->copy));
        s->host_table[i] = lora_mod{da, db, m->rank, dt_of(m->dtype), m->scale, 0};
    }
    if (rc == CS_OK)
        CUDA_CHECK(cudaMemcpyAsync(s->table, s->host_table, sizeof(lora_mod) * (size_t)nm, cudaMemcpyHostToDevice, c->copy));
    /* the host memory may go once this returns; the slot is ready for compute */
    CUDA_CHECK(cudaStreamSynchronize(c->copy));
    for (int i = 0; i < nm; i++) free(temps[i]);
    free(temps);
    if (rc) {
        dfree(c, s->mem, s->bytes);
        free(s->host_table);
        free(s->dims);
        free(s);
        return rc;
    }
    stat_add(c, &c->stats.h2d_bytes, &c->stats.h2d_copies, total);
    *out = s;
    return CS_OK;
}

static void be_adapter_free(backend_t *b, backend_adapter_t *s) {
    ctx *c = C(b);
    CUDA_CHECK(cudaStreamSynchronize(c->compute)); /* a forward may still read it */
    dfree(c, s->mem, s->bytes);
    free(s->host_table);
    free(s->dims);
    free(s);
}

static size_t be_adapter_bytes(backend_t *b, const backend_adapter_t *s) {
    (void)b;
    return s->bytes;
}

/* ---- compute ---- */
static const void *P(const backend_buf_t *buf) { return buf->d; }
static float *F(backend_buf_t *buf) { return (float *)buf->d; }
static const float *CF(const backend_buf_t *buf) { return (const float *)buf->d; }

static void be_embed(backend_t *b, backend_buf_t *y, const backend_weight_t *t, const backend_batch_t *bt) {
    CS_ASSERT(y->n >= sizeof(float) * (size_t)bt->n_tokens * t->cols);
    op_embed(C(b)->compute, F(y), P(t->buf), dt_of(t->dtype), t->cols, bt->ids, bt->n_tokens);
}

static cudaDataType cuda_type(cs_dtype t) {
    return t == CS_DTYPE_BF16 ? CUDA_R_16BF : t == CS_DTYPE_F16 ? CUDA_R_16F : CUDA_R_32F;
}

/* x rounded to w's 16-bit dtype in the scratch (F32 weights: x itself) */
static const void *gemm_input(ctx *c, const float *x, size_t nx, cs_dtype dt) {
    if (dt == CS_DTYPE_F32) return x;
    size_t need = nx * 2;
    if (need > c->xh_cap) {
        size_t cap = need + need / 4;
        if (c->capturing) cuda_fatal("the GEMM input scratch", "grew during a graph capture", __FILE__, __LINE__);
        void *m = dalloc(c, cap);
        if (!m) cuda_fatal("the GEMM input scratch", cs_error_last(), __FILE__, __LINE__);
        CUDA_CHECK(cudaStreamSynchronize(c->compute));
        graphs_reset(c);
        dfree(c, c->xh, c->xh_cap);
        c->xh = m;
        c->xh_cap = cap;
    }
    op_convert(c->compute, c->xh, dt_of(dt), x, nx);
    return c->xh;
}

/* y[n, rows] = xin[n, cols] · wᵀ: column-major, that is yᵀ = w · xinᵀ with w read transposed */
static void gemm(ctx *c, float *y, const void *xin, int n, const backend_weight_t *w) {
    const float one = 1.0f, zero = 0.0f;
    cudaDataType t = cuda_type(w->dtype);
    CUBLAS_CHECK(cublasGemmEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, w->rows, n, w->cols, &one, P(w->buf), t, w->cols, xin,
                              t, w->cols, &zero, y, CUDA_R_32F, w->rows, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

static void be_matmul(backend_t *b, backend_buf_t *y, const backend_buf_t *x, int n, const backend_weight_t *w,
                      const backend_buf_t *bias) {
    ctx *c = C(b);
    if (n <= 0) return;
    CS_ASSERT(x->n >= sizeof(float) * (size_t)n * w->cols && y->n >= sizeof(float) * (size_t)n * w->rows);
    gemm(c, F(y), gemm_input(c, CF(x), (size_t)n * w->cols, w->dtype), n, w);
    if (bias) op_add_bias(c->compute, F(y), CF(bias), n, w->rows);
}

static void be_matmul_multi(backend_t *b, backend_buf_t *const *ys, const backend_buf_t *x, int n,
                            const backend_weight_t *const *ws, const backend_buf_t *const *biases, int count) {
    ctx *c = C(b);
    if (n <= 0) return;
    const void *xin = NULL;
    cs_dtype have = CS_DTYPE_COUNT;
    for (int k = 0; k < count; k++) {
        if (ws[k]->dtype != have) { /* one rounding for every weight of the same dtype */
            xin = gemm_input(c, CF(x), (size_t)n * ws[k]->cols, ws[k]->dtype);
            have = ws[k]->dtype;
        }
        gemm(c, F(ys[k]), xin, n, ws[k]);
        if (biases[k]) op_add_bias(c->compute, F(ys[k]), CF(biases[k]), n, ws[k]->rows);
    }
}

static void be_rmsnorm(backend_t *b, backend_buf_t *y, const backend_buf_t *x, int n, int dim, const backend_weight_t *w,
                       float eps) {
    CS_ASSERT(w->dtype == CS_DTYPE_F32);
    op_rmsnorm(C(b)->compute, F(y), CF(x), n, dim, CF(w->buf), eps);
}

static void be_rope(backend_t *b, backend_buf_t *x, int nh, int hd, const backend_batch_t *bt, const backend_buf_t *inv_freq) {
    op_rope(C(b)->compute, F(x), bt->n_tokens, nh, hd, bt->pos, CF(inv_freq));
}

static void be_kv_store(backend_t *b, backend_buf_t *pool, const backend_buf_t *src, const backend_batch_t *bt, int row_len) {
    op_set_rows(C(b)->compute, F(pool), CF(src), bt->slots, bt->n_tokens, row_len);
}

static void be_attention(backend_t *b, backend_buf_t *out, const backend_buf_t *q, const backend_buf_t *k,
                         const backend_buf_t *v, cs_dtype kv_dtype, const backend_batch_t *bt, int bs, int nh, int nkv,
                         int hd, int window) {
    CS_ASSERT(kv_dtype == CS_DTYPE_F32);
    CS_ASSERT(hd <= 256 && nkv > 0 && nh % nkv == 0);
    op_attention(C(b)->compute, F(out), CF(q), CF(k), CF(v), bt->seqs, bt->row_seq, bt->blocks, bt->n_tokens, bs, nh, nkv,
                 hd, window);
}

static void be_get_out_rows(backend_t *b, backend_buf_t *dst, const backend_buf_t *src, const backend_batch_t *bt,
                            int row_len) {
    op_get_rows(C(b)->compute, F(dst), CF(src), bt->out_rows, bt->n_out, row_len);
}

static void be_silu_mul(backend_t *b, backend_buf_t *g, const backend_buf_t *u, size_t n) {
    op_silu_mul(C(b)->compute, F(g), CF(u), n);
}

static void be_add(backend_t *b, backend_buf_t *y, const backend_buf_t *x, size_t n) {
    op_add(C(b)->compute, F(y), CF(x), n);
}

static void be_lora(backend_t *b, backend_buf_t *y, const backend_buf_t *x, const backend_batch_t *bt, int layer,
                    int target, int d_in, int d_out) {
    ctx *c = C(b);
    int mod = layer * BACKEND_LORA_TARGETS + target, max_rank = 0;
    for (int i = 0; i < bt->n_lora; i++) {
        const backend_adapter_t *s = bt->hslots[i];
        CS_ASSERT(layer >= 0 && layer < s->n_layers);
        int r = s->host_table[mod].rank;
        if (r <= 0) continue;
        CS_ASSERT(s->dims[2 * mod] == d_in && s->dims[2 * mod + 1] == d_out);
        if (r > max_rank) max_rank = r;
    }
    if (c->graph_mode && bt->n_lora) max_rank = LORA_MAX_RANK; /* the launch fits any adapters of the key */
    if (!max_rank) return;
    size_t need = (size_t)bt->n_tokens * max_rank;
    if (need > c->lora_t_cap) {
        if (c->capturing) cuda_fatal("the LoRA scratch", "grew during a graph capture", __FILE__, __LINE__);
        size_t cap = need + need / 2;
        float *m = (float *)dalloc(c, cap * sizeof(float));
        if (!m) cuda_fatal("the LoRA scratch", cs_error_last(), __FILE__, __LINE__);
        CUDA_CHECK(cudaStreamSynchronize(c->compute));
        graphs_reset(c);
        dfree(c, c->lora_t, c->lora_t_cap * sizeof(float));
        c->lora_t = m;
        c->lora_t_cap = cap;
    }
    op_lora_shrink(c->compute, c->lora_t, max_rank, CF(x), d_in, bt->row_lseg, bt->lsegs, mod, bt->n_tokens, max_rank);
    op_lora_expand(c->compute, F(y), d_out, c->lora_t, max_rank, bt->row_lseg, bt->lsegs, mod, bt->n_tokens, max_rank);
}

static void be_synchronize(backend_t *b) { CUDA_CHECK(cudaStreamSynchronize(C(b)->compute)); }

static void be_get_stats(backend_t *b, backend_stats_t *st) {
    ctx *c = C(b);
    pthread_mutex_lock(&c->mu);
    *st = c->stats;
    pthread_mutex_unlock(&c->mu);
    st->allocated = __atomic_load_n(&c->pub.used, __ATOMIC_RELAXED);
}

static void be_free(backend_t *b) {
    ctx *c = C(b);
    if (c) {
        CUDA_CHECK(cudaSetDevice(c->device));
        CUDA_CHECK(cudaStreamSynchronize(c->compute));
        CUDA_CHECK(cudaStreamSynchronize(c->copy));
        graphs_reset(c);
        dfree(c, c->xh, c->xh_cap);
        dfree(c, c->lora_t, c->lora_t_cap * sizeof(float));
        dfree(c, c->workspace, CUBLAS_WORKSPACE);
        if (c->blas) CUBLAS_CHECK(cublasDestroy(c->blas));
        CUDA_CHECK(cudaEventDestroy(c->compute_mark));
        CUDA_CHECK(cudaStreamDestroy(c->compute));
        CUDA_CHECK(cudaStreamDestroy(c->copy));
        pthread_mutex_destroy(&c->mu);
        pthread_mutex_destroy(&c->capture_mu);
        free(c);
    }
    free(b);
}

static backend_i make_iface() {
    backend_i i;
    memset(&i, 0, sizeof i);
    i.name = PUB_NAME;
    i.host_memory = false;
    i.buf_alloc = be_buf_alloc;
    i.buf_free = be_buf_free;
    i.buf_size = be_buf_size;
    i.buf_set = be_buf_set;
    i.buf_get = be_buf_get;
    i.buf_copy = be_buf_copy;
    i.buf_set_async = be_buf_set_async;
    i.buf_get_async = be_buf_get_async;
    i.host_alloc = be_host_alloc;
    i.host_free = be_host_free;
    i.event_new = be_event_new;
    i.event_free = be_event_free;
    i.event_record = be_event_record;
    i.event_wait = be_event_wait;
    i.event_query = be_event_query;
    i.event_synchronize = be_event_synchronize;
    i.batch_upload = be_batch_upload;
    i.batch_free = be_batch_free;
    i.adapter_upload = be_adapter_upload;
    i.adapter_free = be_adapter_free;
    i.adapter_bytes = be_adapter_bytes;
    i.embed = be_embed;
    i.matmul = be_matmul;
    i.matmul_multi = be_matmul_multi;
    i.rmsnorm = be_rmsnorm;
    i.rope = be_rope;
    i.kv_store = be_kv_store;
    i.attention = be_attention;
    i.get_out_rows = be_get_out_rows;
    i.silu_mul = be_silu_mul;
    i.add = be_add;
    i.lora = be_lora;
    i.kv_dtypes = 1u << CS_DTYPE_F32;
    i.graph_begin = be_graph_begin;
    i.graph_end = be_graph_end;
    i.graph_reset = be_graph_reset;
    i.synchronize = be_synchronize;
    i.get_stats = be_get_stats;
    i.free = be_free;
    return i;
}
static const backend_i iface = make_iface();

static backend_t *create(const cuda_backend_params_t *p) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n <= 0) {
        (void)cudaGetLastError();
        cs_error_set(CS_EUNSUPPORTED, "no CUDA device is visible (%s)", e != cudaSuccess ? cudaGetErrorString(e) : "none");
        return NULL;
    }
    if (p->device < 0 || p->device >= n) {
        cs_error_set(CS_EINVAL, "CUDA device %d: there are %d", p->device, n);
        return NULL;
    }
    double frac = p->memory_fraction > 0 ? p->memory_fraction : 0.90;
    if (frac > 1.0) {
        cs_error_set(CS_EINVAL, "--gpu-memory-fraction %.3f: at most 1", frac);
        return NULL;
    }
    CUDA_CHECK(cudaSetDevice(p->device));
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, p->device));
    size_t fr = 0, tot = 0;
    CUDA_CHECK(cudaMemGetInfo(&fr, &tot));
    backend_t *b = (backend_t *)calloc(1, sizeof *b);
    ctx *c = (ctx *)calloc(1, sizeof *c);
    if (!b || !c) {
        free(b);
        free(c);
        cs_error_set(CS_ENOMEM, "out of memory");
        return NULL;
    }
    c->device = p->device;
    c->total = tot;
    c->pub.budget = (size_t)(frac * (double)tot);
    if (c->pub.budget > fr) c->pub.budget = fr; /* another process holds the rest */
    snprintf(c->pub.desc, sizeof c->pub.desc, "%.120s, %.1f GiB, sm_%d%d, budget %.1f GiB", prop.name,
             tot / 1073741824.0, prop.major, prop.minor, c->pub.budget / 1073741824.0);
    pthread_mutex_init(&c->mu, NULL);
    pthread_mutex_init(&c->capture_mu, NULL);
    c->graphs = p->graphs;
    CUDA_CHECK(cudaStreamCreateWithFlags(&c->compute, cudaStreamNonBlocking));
    CUDA_CHECK(cudaStreamCreateWithFlags(&c->copy, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&c->compute_mark, cudaEventDisableTiming));
    cublasStatus_t st = cublasCreate(&c->blas);
    if (st != CUBLAS_STATUS_SUCCESS) {
        cs_error_set(CS_EUNSUPPORTED, "cuBLAS: %s", cublasGetStatusString(st));
        c->blas = NULL;
        b->ctx = c;
        b->iface = &iface;
        be_free(b);
        return NULL;
    }
    CUBLAS_CHECK(cublasSetStream(c->blas, c->compute));
    if (!(c->workspace = dalloc(c, CUBLAS_WORKSPACE))) {
        cs_error_set(CS_ENOMEM, "cuBLAS's workspace: %s", cs_error_last());
        b->ctx = c;
        b->iface = &iface;
        be_free(b);
        return NULL;
    }
    CUBLAS_CHECK(cublasSetWorkspace(c->blas, c->workspace, CUBLAS_WORKSPACE));
    b->iface = &iface;
    b->ctx = c;
    b->n_threads = 1;
    return b;
}

} /* namespace CS_NS */

extern "C" backend_t *PUB_NEW(const cuda_backend_params_t *p) {
    cuda_backend_params_t d = {0, 0, false};
    return CS_NS::create(p ? p : &d);
}
