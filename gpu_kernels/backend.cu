/* backend.cu: struct backend_i (backend/backend_impl.h) on one CUDA device.
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
 * A streaming slot (adapter_stream, the cold start) fills in on a loader thread: the
 * adapter's host memory is ordinary pageable memory, so the loader packs each layer group
 * into a ring of pinned staging buffers and queues their copies on the load stream (its
 * own, so that adapter loads neither wait behind nor hold up the copy stream); after a
 * group's copies a host function raises the slot's arrived count (release) and calls
 * on_group. The table goes first, so layer 0's report covers it. The caller returns once the
 * slot is allocated and queued.
 * Host-assisted LoRA (get_signal / wait_add): get_signal copies rows to pinned host memory and
 * raises the flag from a host function, both on the signal stream, which waits for compute
 * by an event (compute itself stops neither for the copy nor for a host function; the host
 * function's cs_flag_store wakes futex waiters). wait_add is a kernel on the compute stream
 * that spins on the flag in mapped host memory and then adds the host's terms, read in place
 * (pinned memory is in the device's address space under unified addressing). Neither is
 * allowed in a graph forward.
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

#include "backend/backend_impl.h"
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

/* the spin reports of the backends alive (op_wait_add's): a kernel that gave up on the host
 * fills one in before it traps, and the CUDA call that then fails says why */
enum { MAX_REPORTS = 16 };
static spin_report *reports[MAX_REPORTS];
static pthread_mutex_t reports_mu = PTHREAD_MUTEX_INITIALIZER;

static void report_add(spin_report *r, bool add) {
    pthread_mutex_lock(&reports_mu);
    for (int i = 0; i < MAX_REPORTS; i++)
        if (add ? !reports[i] : reports[i] == r) {
            reports[i] = add ? r : NULL;
            break;
        }
    pthread_mutex_unlock(&reports_mu);
}

[[noreturn]] void cuda_fatal(const char *call, const char *err, const char *file, int line) {
    fprintf(stderr, "CUDA error: %s\n  in %s at %s:%d\n", err, call, file, line);
    for (int i = 0; i < MAX_REPORTS; i++) { /* no lock: the process is going */
        const spin_report *r = reports[i];
        if (r && r->hit)
            fprintf(stderr, "  the GPU had waited %.1f s for the host's LoRA terms of layer %d (flag %u, waiting for %u) "
                    "and stopped\n", (double)r->waited_ns * 1e-9, r->layer, r->seen, r->value);
    }
    abort();
}

enum { MAX_GRAPHS = 64, CUBLAS_WORKSPACE = 32 << 20 };
/* above this many rows, 4 or more a segment, the LoRA shrink stages row tiles (prefill);
 * decode keeps a warp per row */
enum { LORA_TILE_MIN_ROWS = 16 };
/* from this many rows, 4 or more a sequence, attention takes query tiles (prefill) */
enum { ATTN_TILE_MIN_ROWS = 32 };
/* adapter streaming's pinned staging: a ring of buffers, each reused once its copy is done */
enum { STAGE_BUFS = 3, STAGE_BYTES = 4 << 20 };

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
    size_t xh_cap;          /* bytes */
    float *lora_t;          /* the shrink's results, (rows, max rank) */
    size_t lora_t_cap;      /* bytes */
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
    bool uva;               /* unified addressing: pinned host memory is the device's at the same address */
    /* adapter streaming: the loader thread, its queue of slots, the pinned staging ring */
    cudaStream_t load;
    pthread_mutex_t load_mu;
    pthread_cond_t load_cv;  /* a slot queued, a slot loaded, stop */
    pthread_t loader;
    bool loader_running, loader_stop;
    backend_adapter_t *load_head, *load_tail;
    char *stage[STAGE_BUFS];
    cudaEvent_t stage_ev[STAGE_BUFS]; /* after the last copy out of each */
    bool stage_busy[STAGE_BUFS];      /* the loader's own: a copy was queued out of it */
    int stage_at;                     /* the loader's own: the next to fill */
    /* get_signal: its host functions run here, after compute's position (an event) */
    cudaStream_t signal;
    cudaEvent_t signal_mark;
    /* wait_add's deadline and where a wait that gave up reports (pinned, mapped) */
    uint64_t spin_timeout_ns;
    spin_report *report;
    cudaEvent_t sync_ev;    /* blocking sync: a host waiting for compute sleeps, not spins */
    int lora_tiled;         /* the shrink's row tiles: 0 for many rows, -1 never, 1 always */
    int attn_tiled;         /* attention's query tiles: the same */
    /* attention's key ranges (flash-decoding): the parameter, the SM count, the partials */
    int attn_splits, sms;
    float *attn_part;
    size_t attn_part_cap;   /* bytes */
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
    size_t table_off;               /* the table's offset in mem */
    CS_NS::lora_mod *table;         /* on the device: [n_layers * BACKEND_LORA_TARGETS] */
    CS_NS::lora_mod *host_table;    /* its host copy (device pointers inside) */
    int32_t *dims;                  /* [2 * modules]: d_in, d_out of each, on the host */
    int arrived;                    /* layers in place (adapter_arrived); raised by the load
                                     * stream's host functions; n_layers for an uploaded slot */
    /* streaming (adapter_stream) */
    bool streamed;
    int group;
    void (*on_group)(void *);
    void *user;
    backend_lora_module_desc_t *src; /* the description (the host memory it names is the caller's) */
    int load_state;                 /* LOAD_*, under ctx.load_mu */
    int cancel;                     /* adapter_free: the loader stops queueing copies */
    int fed;                        /* layers in host memory (adapter_feed), under ctx.load_mu */
    int next_l0;                    /* the loader's next layer to queue; table_sent: the table went */
    bool table_sent;
    bool done_recorded;             /* done was recorded (the loader, before LOAD_DONE) */
    cudaEvent_t done;               /* after the slot's last copy and host function */
    backend_adapter_t *load_next;   /* the loader's queue */
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

/* the backend's device current on the calling thread: launches go to the current device's
 * streams only, and the entry points are called from several threads (the engine's, the
 * loader's, the server's) */
static void bind(ctx *c) {
    int d = -1;
    CUDA_CHECK(cudaGetDevice(&d));
    if (d != c->device) CUDA_CHECK(cudaSetDevice(c->device));
}

/* the host waits for everything queued on compute so far, sleeping (a blocking-sync event:
 * a stream synchronize would spin a core beside the host's LoRA workers) */
static void sync_compute(ctx *c) {
    bind(c);
    CUDA_CHECK(cudaEventRecord(c->sync_ev, c->compute));
    CUDA_CHECK(cudaEventSynchronize(c->sync_ev));
}

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
    bind(c);
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
    bind(c);
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
    bind(c);
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
    bind(c);
    CUDA_CHECK(cudaMemcpyAsync(at(dst, off, n), src, n, cudaMemcpyHostToDevice, c->compute));
    sync_compute(c);
    stat_add(c, &c->stats.h2d_bytes, &c->stats.h2d_copies, n);
}

static void be_buf_get(backend_t *b, void *dst, const backend_buf_t *src, size_t off, size_t n) {
    ctx *c = C(b);
    if (!n) return;
    bind(c);
    CUDA_CHECK(cudaMemcpyAsync(dst, at(src, off, n), n, cudaMemcpyDeviceToHost, c->compute));
    sync_compute(c);
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
    bind(C(b));
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
    bind(C(b));
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
    bind(c); /* once per forward: the ops after it launch from this thread */
    if (!bt) {
        if (!(bt = (backend_batch_t *)calloc(1, sizeof *bt))) return cs_error_set(CS_ENOMEM, "out of memory");
        if (cudaEventCreateWithFlags(&bt->uploaded, cudaEventDisableTiming) != cudaSuccess) {
            (void)cudaGetLastError(); /* handled here: not a later launch's error */
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
            (void)cudaGetLastError();
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

/* ---- adapter slots ----
 * A slot's allocation: every module's A then B transposed, each 256-byte aligned, in module
 * order (layer-major: a group of layers is one contiguous range), and the module table last. */
static int dt_of(cs_dtype t) { return t == CS_DTYPE_F32 ? DT_F32 : t == CS_DTYPE_BF16 ? DT_BF16 : DT_F16; }

static size_t align256(size_t n) { return (n + 255) & ~(size_t)255; }

enum { LOAD_QUEUED = 1, LOAD_RUNNING, LOAD_WAITING, LOAD_DONE }; /* WAITING: for adapter_feed */

static void slot_delete(ctx *c, backend_adapter_t *s) {
    dfree(c, s->mem, s->bytes);
    if (s->done) CUDA_CHECK(cudaEventDestroy(s->done));
    free(s->src);
    free(s->host_table);
    free(s->dims);
    free(s);
}

/* a slot for AD: its device memory and host table (the device addresses of every module),
 * nothing copied yet; every layer counts as arrived */
static int slot_new(ctx *c, const backend_adapter_desc_t *ad, backend_adapter_t **out) {
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
        slot_delete(c, s);
        return cs_error_set(CS_ENOMEM, "out of memory");
    }
    if (!(s->mem = dalloc(c, total))) {
        int rc = cs_error_set(CS_ENOMEM, "adapter slot: %s", cs_error_last());
        slot_delete(c, s);
        return rc;
    }
    s->bytes = total;
    s->table_off = table_off;
    s->table = (lora_mod *)((char *)s->mem + table_off);
    size_t off = 0;
    for (int i = 0; i < nm; i++) {
        const backend_lora_module_desc_t *m = &ad->mods[i];
        s->dims[2 * i] = m->d_in;
        s->dims[2 * i + 1] = m->d_out;
        if (m->rank <= 0) continue;
        size_t es = cs_dtype_size(m->dtype), na = es * (size_t)m->rank * m->d_in, nb = es * (size_t)m->rank * m->d_out;
        char *da = (char *)s->mem + off, *db = da + align256(na);
        off += align256(na) + align256(nb);
        s->host_table[i] = lora_mod{da, db, m->rank, dt_of(m->dtype), m->scale, 0};
    }
    s->arrived = s->n_layers;
    *out = s;
    return CS_OK;
}

/* B (d_out, rank) transposed into DST (rank, d_out): elements [e0, e1) of DST */
static void transpose_b(char *dst, const backend_lora_module_desc_t *m, size_t e0, size_t e1) {
    size_t es = cs_dtype_size(m->dtype), d_out = (size_t)m->d_out, rank = (size_t)m->rank;
    const char *src = (const char *)m->b;
    for (size_t e = e0; e < e1; e++) {
        size_t r = e / d_out, o = e % d_out;
        memcpy(dst + (e - e0) * es, src + (o * rank + r) * es, es);
    }
}

static int be_adapter_upload(backend_t *b, const backend_adapter_desc_t *ad, backend_adapter_t **out) {
    ctx *c = C(b);
    backend_adapter_t *s;
    int rc = slot_new(c, ad, &s);
    if (rc) return rc;
    int nm = ad->n_layers * BACKEND_LORA_TARGETS;
    /* B transposed where the description has none: staged on the host until the copies end */
    void **temps = (void **)calloc((size_t)nm, sizeof(void *));
    if (!temps) {
        slot_delete(c, s);
        return cs_error_set(CS_ENOMEM, "out of memory");
    }
    copy_after_compute(c);
    for (int i = 0; i < nm && rc == CS_OK; i++) {
        const backend_lora_module_desc_t *m = &ad->mods[i];
        if (m->rank <= 0) continue;
        size_t es = cs_dtype_size(m->dtype), na = es * (size_t)m->rank * m->d_in, nb = es * (size_t)m->rank * m->d_out;
        const void *bt = m->bt;
        if (!bt) {
            char *tp = (char *)malloc(nb ? nb : 1);
            if (!tp) { rc = cs_error_set(CS_ENOMEM, "out of memory"); break; }
            temps[i] = tp;
            transpose_b(tp, m, 0, (size_t)m->rank * m->d_out);
            bt = tp;
        }
        CUDA_CHECK(cudaMemcpyAsync((void *)s->host_table[i].a, m->a, na, cudaMemcpyHostToDevice, c->copy));
        CUDA_CHECK(cudaMemcpyAsync((void *)s->host_table[i].bt, bt, nb, cudaMemcpyHostToDevice, c->copy));
    }
    if (rc == CS_OK)
        CUDA_CHECK(cudaMemcpyAsync(s->table, s->host_table, sizeof(lora_mod) * (size_t)nm, cudaMemcpyHostToDevice, c->copy));
    /* the host memory may go once this returns; the slot is ready for compute */
    CUDA_CHECK(cudaStreamSynchronize(c->copy));
    for (int i = 0; i < nm; i++) free(temps[i]);
    free(temps);
    if (rc) {
        slot_delete(c, s);
        return rc;
    }
    stat_add(c, &c->stats.h2d_bytes, &c->stats.h2d_copies, s->bytes);
    *out = s;
    return CS_OK;
}

/* ---- streaming slots: the loader thread ----
 * The adapter's host memory is pageable (malloc'd or mapped files): a copy straight from it
 * would be a staged, synchronous one. The loader packs the bytes of the slot into pinned
 * staging buffers (each holds a contiguous range of the slot; the alignment gaps between
 * modules go along) and queues one copy per full buffer or group end on the load stream. */
struct stager {
    ctx *c;
    char *base;             /* the slot's device memory */
    bool open;              /* c->stage[c->stage_at] holds [dst0, dst0 + fill) of the slot */
    size_t dst0, fill;
};

static void stage_flush(stager *w) {
    ctx *c = w->c;
    if (!w->open) return;
    w->open = false;
    if (!w->fill) return;
    int i = c->stage_at;
    CUDA_CHECK(cudaMemcpyAsync(w->base + w->dst0, c->stage[i], w->fill, cudaMemcpyHostToDevice, c->load));
    CUDA_CHECK(cudaEventRecord(c->stage_ev[i], c->load));
    c->stage_busy[i] = true;
    c->stage_at = (i + 1) % STAGE_BUFS;
    stat_add(c, &c->stats.h2d_bytes, &c->stats.h2d_copies, w->fill);
}

/* room in the staging for the slot's bytes [dst, dst + *k), *k <= n as much as fits: the
 * caller writes them */
static char *stage_room(stager *w, size_t dst, size_t n, size_t *k) {
    ctx *c = w->c;
    if (w->open && (dst < w->dst0 + w->fill || dst - w->dst0 >= (size_t)STAGE_BYTES)) stage_flush(w);
    if (!w->open) {
        int i = c->stage_at;
        if (c->stage_busy[i]) CUDA_CHECK(cudaEventSynchronize(c->stage_ev[i])); /* its last copy has read it */
        c->stage_busy[i] = false;
        w->open = true;
        w->dst0 = dst;
        w->fill = 0;
    }
    size_t at = dst - w->dst0;
    *k = CS_MIN(n, (size_t)STAGE_BYTES - at);
    w->fill = at + *k;
    return c->stage[c->stage_at] + at;
}

static void stage_put(stager *w, size_t dst, const void *src, size_t n) {
    const char *p = (const char *)src;
    while (n) {
        size_t k;
        char *room = stage_room(w, dst, n, &k); /* before k is read */
        memcpy(room, p, k);
        dst += k, p += k, n -= k;
    }
}

/* module m's B transposed at dst: written into the staging directly */
static void stage_put_bt(stager *w, size_t dst, const backend_lora_module_desc_t *m) {
    size_t es = cs_dtype_size(m->dtype), ne = (size_t)m->rank * m->d_out;
    for (size_t e = 0; e < ne;) {
        size_t k;
        char *p = stage_room(w, dst + e * es, (ne - e) * es, &k);
        size_t ke = k / es; /* every offset in a slot is a multiple of the element size */
        CS_ASSERT(ke > 0 && ke * es == k);
        transpose_b(p, m, e, e + ke);
        e += ke;
    }
}

/* the loader's events: a wait for them sleeps (the host's cores do the cold start's LoRA) */
static const unsigned LOAD_EVENT_FLAGS = cudaEventDisableTiming | cudaEventBlockingSync;

static bool load_cancelled(const backend_adapter_t *s) { return __atomic_load_n(&s->cancel, __ATOMIC_RELAXED) != 0; }

/* a host function on the load stream after a group's copies: its layers are in place */
static void group_landed(void *p) {
    backend_adapter_t *s = (backend_adapter_t *)p;
    int a = __atomic_load_n(&s->arrived, __ATOMIC_RELAXED) + s->group; /* only these raise it, in order */
    __atomic_store_n(&s->arrived, a < s->n_layers ? a : s->n_layers, __ATOMIC_RELEASE);
    if (s->on_group) s->on_group(s->user);
}

/* the copies of slot S queued on the load stream (the loader thread), as far as its host
 * copy is fed (FED layers); true when every layer's are */
static bool load_slot(ctx *c, backend_adapter_t *s, int fed) {
    int nl = s->n_layers;
    stager w = {c, (char *)s->mem, false, 0, 0};
    if (!s->table_sent) { /* the table first: the LoRA kernels read it for any layer that arrived */
        stage_put(&w, s->table_off, s->host_table, sizeof(lora_mod) * (size_t)nl * BACKEND_LORA_TARGETS);
        stage_flush(&w);
        s->table_sent = true;
    }
    for (int l0 = s->next_l0; l0 < nl && !load_cancelled(s); l0 += s->group) {
        int l1 = CS_MIN(nl, l0 + s->group);
        if (l1 > fed) return false; /* the group's host memory is not all there yet */
        s->next_l0 = l1;
        for (int i = l0 * BACKEND_LORA_TARGETS; i < l1 * BACKEND_LORA_TARGETS && !load_cancelled(s); i++) {
            const backend_lora_module_desc_t *m = &s->src[i];
            if (m->rank <= 0) continue;
            size_t na = cs_dtype_size(m->dtype) * (size_t)m->rank * m->d_in;
            size_t oa = (size_t)((const char *)s->host_table[i].a - (const char *)s->mem);
            size_t ob = (size_t)((const char *)s->host_table[i].bt - (const char *)s->mem);
            stage_put(&w, oa, m->a, na);
            if (m->bt) stage_put(&w, ob, m->bt, cs_dtype_size(m->dtype) * (size_t)m->rank * m->d_out);
            else stage_put_bt(&w, ob, m);
        }
        stage_flush(&w);
        if (!load_cancelled(s)) CUDA_CHECK(cudaLaunchHostFunc(c->load, group_landed, s));
    }
    return true;
}

/* S to the back of the loader's queue (load_mu held) */
static void load_queue(ctx *c, backend_adapter_t *s) {
    s->load_state = LOAD_QUEUED;
    if (c->load_tail) c->load_tail->load_next = s;
    else c->load_head = s;
    c->load_tail = s;
    pthread_cond_broadcast(&c->load_cv);
}

static void *loader_main(void *p) {
    ctx *c = (ctx *)p;
    CUDA_CHECK(cudaSetDevice(c->device));
    pthread_mutex_lock(&c->load_mu);
    for (;;) {
        while (!c->load_head && !c->loader_stop) pthread_cond_wait(&c->load_cv, &c->load_mu);
        if (c->loader_stop) break;
        backend_adapter_t *s = c->load_head;
        c->load_head = s->load_next;
        if (!c->load_head) c->load_tail = NULL;
        s->load_next = NULL;
        s->load_state = LOAD_RUNNING;
        int fed = s->fed;
        pthread_mutex_unlock(&c->load_mu);
        bool all = load_slot(c, s, fed);
        pthread_mutex_lock(&c->load_mu); /* cancel is set under it: one reading decides */
        if (all || load_cancelled(s)) {
            CUDA_CHECK(cudaEventRecord(s->done, c->load)); /* after every copy and host function of the slot */
            s->done_recorded = true;
            s->load_state = LOAD_DONE;
        } else if (s->fed > fed) { /* fed meanwhile: again, after the others */
            load_queue(c, s);
        } else {
            s->load_state = LOAD_WAITING;   /* adapter_feed queues it again */
        }
        pthread_cond_broadcast(&c->load_cv);
    }
    pthread_mutex_unlock(&c->load_mu);
    return NULL;
}

/* the staging ring and the loader thread, on the first streaming slot */
static int loader_start(ctx *c) {
    int rc = CS_OK;
    pthread_mutex_lock(&c->load_mu);
    if (!c->loader_running) {
        CUDA_CHECK(cudaSetDevice(c->device));
        for (int i = 0; i < STAGE_BUFS && rc == CS_OK; i++) {
            if (!c->stage[i] && cudaMallocHost((void **)&c->stage[i], STAGE_BYTES) != cudaSuccess) {
                (void)cudaGetLastError();
                c->stage[i] = NULL;
                rc = cs_error_set(CS_ENOMEM, "out of pinned memory for the adapter staging (%d x %d MiB)", STAGE_BUFS,
                                  STAGE_BYTES >> 20);
            } else if (!c->stage_ev[i] && cudaEventCreateWithFlags(&c->stage_ev[i], LOAD_EVENT_FLAGS) != cudaSuccess) {
                (void)cudaGetLastError();
                c->stage_ev[i] = NULL;
                rc = cs_error_set(CS_ENOMEM, "cannot create a CUDA event");
            }
        }
        if (rc == CS_OK) {
            if (pthread_create(&c->loader, NULL, loader_main, c)) rc = cs_error_set(CS_ENOMEM, "cannot start the adapter loader");
            else c->loader_running = true;
        }
    }
    pthread_mutex_unlock(&c->load_mu);
    return rc;
}

static int be_adapter_stream(backend_t *b, const backend_adapter_desc_t *ad, int group, void (*on_group)(void *),
                             void *user, backend_adapter_t **out) {
    ctx *c = C(b);
    *out = NULL;
    int rc = loader_start(c);
    backend_adapter_t *s;
    if (rc || (rc = slot_new(c, ad, &s))) return rc;
    int nm = ad->n_layers * BACKEND_LORA_TARGETS;
    s->streamed = true;
    s->arrived = 0;
    s->group = group > 0 ? group : 1;
    s->on_group = on_group;
    s->user = user;
    s->src = (backend_lora_module_desc_t *)malloc(sizeof *s->src * (size_t)nm);
    if (!s->src || cudaEventCreateWithFlags(&s->done, LOAD_EVENT_FLAGS) != cudaSuccess) {
        (void)cudaGetLastError();
        s->done = NULL;
        slot_delete(c, s);
        return cs_error_set(CS_ENOMEM, "adapter slot: out of memory");
    }
    memcpy(s->src, ad->mods, sizeof *s->src * (size_t)nm); /* the caller's array may go; the weights stay */
    s->fed = ad->host_partial ? CS_MAX(0, CS_MIN(ad->host_ready, ad->n_layers)) : ad->n_layers;
    s->next_l0 = 0;
    s->table_sent = false;
    pthread_mutex_lock(&c->load_mu);
    load_queue(c, s);
    pthread_mutex_unlock(&c->load_mu);
    *out = s;
    return CS_OK;
}

static void be_adapter_feed(backend_t *b, backend_adapter_t *s, int n) {
    ctx *c = C(b);
    if (!s->streamed) return;
    pthread_mutex_lock(&c->load_mu);
    if (n > s->fed) {
        s->fed = CS_MIN(n, s->n_layers);
        if (s->load_state == LOAD_WAITING) load_queue(c, s);
    }
    pthread_mutex_unlock(&c->load_mu);
}

static int be_adapter_arrived(backend_t *b, const backend_adapter_t *s) {
    (void)b;
    return __atomic_load_n(&s->arrived, __ATOMIC_ACQUIRE);
}

static void be_adapter_free(backend_t *b, backend_adapter_t *s) {
    ctx *c = C(b);
    if (s->streamed) { /* no copy may still be going into it, nor a host function about to touch it */
        pthread_mutex_lock(&c->load_mu);
        if (s->load_state == LOAD_QUEUED) { /* not started: out of the queue */
            backend_adapter_t **pp = &c->load_head, *prev = NULL;
            while (*pp != s) prev = *pp, pp = &(*pp)->load_next;
            *pp = s->load_next;
            if (c->load_tail == s) c->load_tail = prev;
            if (s->table_sent) { /* queued again after a part (adapter_feed): its copies so far */
                CUDA_CHECK(cudaEventRecord(s->done, c->load));
                s->done_recorded = true;
            }
            s->load_state = LOAD_DONE;
        } else if (s->load_state == LOAD_WAITING) { /* fed part way: after the copies queued so far */
            CUDA_CHECK(cudaEventRecord(s->done, c->load));
            s->done_recorded = true;
            s->load_state = LOAD_DONE;
        }
        __atomic_store_n(&s->cancel, 1, __ATOMIC_RELAXED);
        while (s->load_state != LOAD_DONE) pthread_cond_wait(&c->load_cv, &c->load_mu);
        pthread_mutex_unlock(&c->load_mu);
        if (s->done_recorded) CUDA_CHECK(cudaEventSynchronize(s->done));
    }
    CUDA_CHECK(cudaStreamSynchronize(c->compute)); /* a forward may still read it */
    slot_delete(c, s);
}

static size_t be_adapter_bytes(backend_t *b, const backend_adapter_t *s) {
    (void)b;
    return s->bytes;
}

/* ---- host-assisted LoRA (the cold start) ---- */
static void no_graph(ctx *c, const char *op) {
    if (c->capturing || c->graph_mode)
        cuda_fatal(op, "a host-assisted op inside a graph forward (graph_begin .. graph_end)", __FILE__, __LINE__);
}

struct signal_rec {
    uint32_t *flag;
    uint32_t value;
};

/* a host function on the signal stream: the copy before it is done */
static void signal_raise(void *p) {
    signal_rec *r = (signal_rec *)p;
    cs_flag_store(r->flag, r->value);
    free(r);
}

static void be_get_signal(backend_t *b, void *dst, const backend_buf_t *src, size_t off, size_t n, uint32_t *flag,
                          uint32_t value) {
    ctx *c = C(b);
    no_graph(c, "get_signal");
    signal_rec *r = (signal_rec *)malloc(sizeof *r);
    if (!r) cuda_fatal("get_signal", "out of memory", __FILE__, __LINE__);
    *r = signal_rec{flag, value};
    /* the rows and then the flag from the signal stream once compute passed this point:
     * compute goes on meanwhile (the caller writes SRC again only after a wait_add that waits
     * for these rows) */
    bind(c);
    CUDA_CHECK(cudaEventRecord(c->signal_mark, c->compute));
    CUDA_CHECK(cudaStreamWaitEvent(c->signal, c->signal_mark, 0));
    if (n) {
        CUDA_CHECK(cudaMemcpyAsync(dst, at(src, off, n), n, cudaMemcpyDeviceToHost, c->signal));
        stat_add(c, &c->stats.d2h_bytes, &c->stats.d2h_copies, n);
    }
    CUDA_CHECK(cudaLaunchHostFunc(c->signal, signal_raise, r));
}

static void be_wait_add(backend_t *b, backend_buf_t *y, size_t off, const void *src, cs_dtype src_dtype, size_t n,
                        const uint32_t *flag, uint32_t value, const uint32_t *alive, int layer) {
    ctx *c = C(b);
    no_graph(c, "wait_add");
    /* src and flag are host_alloc's (cudaMallocHost): mapped and portable under unified
     * addressing, where the kernel reads them at their host addresses */
    if (!c->uva) cuda_fatal("wait_add", "the device has no unified addressing: host memory is not mapped into it",
                            __FILE__, __LINE__);
    CS_ASSERT(off % sizeof(float) == 0);
    float *p = (float *)at(y, off, sizeof(float) * n);
    op_wait_add(c->compute, p, src, dt_of(src_dtype), n, flag, value, alive, c->spin_timeout_ns, layer, c->report);
    if (n) stat_add(c, &c->stats.h2d_bytes, &c->stats.h2d_copies, cs_dtype_size(src_dtype) * n);
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

/* scratch *p of *cap bytes grown to NEED bytes or more (half again): the last forward's ops
 * that may still read the old buffer are waited for and the graphs that captured it dropped;
 * never during a capture (a graph key's eager first run settles its scratch) */
template <class T> static void scratch_reserve(ctx *c, T **p, size_t *cap, size_t need, const char *what) {
    if (need <= *cap) return;
    if (c->capturing) cuda_fatal(what, "grew during a graph capture", __FILE__, __LINE__);
    size_t n = need + need / 2;
    void *m = dalloc(c, n);
    if (!m) cuda_fatal(what, cs_error_last(), __FILE__, __LINE__);
    CUDA_CHECK(cudaStreamSynchronize(c->compute));
    graphs_reset(c);
    dfree(c, *p, *cap);
    *p = (T *)m;
    *cap = n;
}

/* x rounded to w's 16-bit dtype in the scratch (F32 weights: x itself) */
static const void *gemm_input(ctx *c, const float *x, size_t nx, cs_dtype dt) {
    if (dt == CS_DTYPE_F32) return x;
    scratch_reserve(c, &c->xh, &c->xh_cap, nx * 2, "the GEMM input scratch");
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

static void be_kv_store(backend_t *b, backend_buf_t *pool, cs_dtype kv_dtype, const backend_buf_t *src,
                        const backend_batch_t *bt, int row_len) {
    CS_ASSERT(kv_dtype == CS_DTYPE_F32 || kv_dtype == CS_DTYPE_BF16);
    op_set_rows(C(b)->compute, pool->d, kv_dtype == CS_DTYPE_BF16 ? DT_BF16 : DT_F32, CF(src), bt->slots, bt->n_tokens,
                row_len);
}

/* query tiles pay where sequences bring many rows each (prefill); a decode batch's tiles would
 * hold one row of each of 16 sequences, taken in turn by one warp of four */
static bool attn_tile(const backend_batch_t *bt) {
    return bt->n_tokens >= ATTN_TILE_MIN_ROWS && bt->n_tokens >= 4 * bt->n_seqs;
}

/* key ranges per row: enough blocks for two per SM where rows x head groups give fewer (a
 * function of the batch's rows and heads alone: a graph's key fixes them) */
static int attn_splits(const ctx *c, int n_tokens, int nh) {
    if (c->attn_splits) return c->attn_splits < 0 ? 1 : c->attn_splits;
    long blocks = (long)n_tokens * ((nh + 3) / 4), want = 2L * c->sms;
    if (blocks <= 0 || blocks >= want) return 1;
    long s = (want + blocks - 1) / blocks;
    return s > 32 ? 32 : (int)s;
}

static void be_attention(backend_t *b, backend_buf_t *out, const backend_buf_t *q, const backend_buf_t *k,
                         const backend_buf_t *v, cs_dtype kv_dtype, const backend_batch_t *bt, int bs, int nh, int nkv,
                         int hd, int window) {
    ctx *c = C(b);
    CS_ASSERT(kv_dtype == CS_DTYPE_F32 || kv_dtype == CS_DTYPE_BF16);
    CS_ASSERT(hd <= 256 && nkv > 0 && nh % nkv == 0);
    int splits = attn_splits(c, bt->n_tokens, nh);
    scratch_reserve(c, &c->attn_part, &c->attn_part_cap,
                    sizeof(float) * attention_part_floats(bt->n_tokens, nh, hd, splits), "the attention scratch");
    op_attention(c->compute, F(out), CF(q), k->d, v->d, kv_dtype == CS_DTYPE_BF16 ? DT_BF16 : DT_F32, bt->seqs,
                 bt->row_seq, bt->blocks, bt->n_tokens, bs, nh, nkv, hd, window, splits,
                 c->attn_tiled ? c->attn_tiled > 0 : attn_tile(bt), c->attn_part);
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
    scratch_reserve(c, &c->lora_t, &c->lora_t_cap, sizeof(float) * bt->n_tokens * max_rank, "the LoRA scratch");
    /* row tiles pay where segments bring many rows each (prefill): in a decode batch of many
     * adapters a tile would take up to 8 of them in turn; never in a graph, whose key does not
     * fix the segments */
    bool tiled = c->lora_tiled ? c->lora_tiled > 0
                               : !c->graph_mode && bt->n_tokens > LORA_TILE_MIN_ROWS && bt->n_tokens >= 4 * bt->n_lora;
    op_lora_shrink(c->compute, c->lora_t, max_rank, CF(x), d_in, bt->row_lseg, bt->lsegs, mod, bt->n_tokens, max_rank,
                   tiled);
    op_lora_expand(c->compute, F(y), d_out, c->lora_t, max_rank, bt->row_lseg, bt->lsegs, mod, bt->n_tokens, max_rank);
}

static void be_synchronize(backend_t *b) { sync_compute(C(b)); }

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
        if (c->loader_running) { /* its slots were freed before: it waits for none */
            pthread_mutex_lock(&c->load_mu);
            c->loader_stop = true;
            pthread_cond_broadcast(&c->load_cv);
            pthread_mutex_unlock(&c->load_mu);
            pthread_join(c->loader, NULL);
        }
        CUDA_CHECK(cudaStreamSynchronize(c->compute));
        CUDA_CHECK(cudaStreamSynchronize(c->copy));
        CUDA_CHECK(cudaStreamSynchronize(c->load));
        CUDA_CHECK(cudaStreamSynchronize(c->signal));
        for (int i = 0; i < STAGE_BUFS; i++) {
            if (c->stage[i]) CUDA_CHECK(cudaFreeHost(c->stage[i]));
            if (c->stage_ev[i]) CUDA_CHECK(cudaEventDestroy(c->stage_ev[i]));
        }
        graphs_reset(c);
        dfree(c, c->xh, c->xh_cap);
        dfree(c, c->lora_t, c->lora_t_cap);
        dfree(c, c->attn_part, c->attn_part_cap);
        if (c->blas) CUBLAS_CHECK(cublasDestroy(c->blas)); /* before its workspace goes */
        dfree(c, c->workspace, CUBLAS_WORKSPACE);
        CUDA_CHECK(cudaEventDestroy(c->compute_mark));
        CUDA_CHECK(cudaStreamDestroy(c->compute));
        CUDA_CHECK(cudaStreamDestroy(c->copy));
        CUDA_CHECK(cudaEventDestroy(c->signal_mark));
        CUDA_CHECK(cudaEventDestroy(c->sync_ev));
        if (c->report) {
            report_add(c->report, false);
            CUDA_CHECK(cudaFreeHost(c->report));
        }
        CUDA_CHECK(cudaStreamDestroy(c->load));
        CUDA_CHECK(cudaStreamDestroy(c->signal));
        pthread_mutex_destroy(&c->mu);
        pthread_mutex_destroy(&c->capture_mu);
        pthread_mutex_destroy(&c->load_mu);
        pthread_cond_destroy(&c->load_cv);
        free(c);
    }
    free(b);
}

static backend_i make_iface() {
    backend_i i;
    memset(&i, 0, sizeof i);
    i.name = PUB_NAME;
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
    i.adapter_stream = be_adapter_stream;
    i.adapter_feed = be_adapter_feed;
    i.adapter_arrived = be_adapter_arrived;
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
    i.get_signal = be_get_signal;
    i.wait_add = be_wait_add;
    i.graph_begin = be_graph_begin;
    i.graph_end = be_graph_end;
    i.graph_reset = be_graph_reset;
    i.synchronize = be_synchronize;
    i.get_stats = be_get_stats;
    i.free = be_free;
    return i;
}
static const backend_i iface = make_iface();

/* device memory; pinned host buffers, copy and load streams with events, streaming slots fed
 * from the loader, host-assisted ops; graphs when asked for */
static backend_caps_t make_caps(bool graphs) {
    backend_caps_t k;
    memset(&k, 0, sizeof k);
    k.async_copies = k.pinned_host = k.events = true;
    k.adapter_stream = k.adapter_feed = k.host_assist = true;
    k.graphs = graphs;
    k.kv_dtypes = 1u << CS_DTYPE_F32 | 1u << CS_DTYPE_BF16;
    return k;
}

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
    /* what is free now, less room for what the runtime takes later on its own (cuBLAS's
     * modules and heuristics, graph executables): another process may hold the rest */
    size_t rt_reserve = fr / 8 < ((size_t)512 << 20) ? fr / 8 : ((size_t)512 << 20);
    if (c->pub.budget > fr - rt_reserve) c->pub.budget = fr - rt_reserve;
    snprintf(c->pub.desc, sizeof c->pub.desc, "%.120s, %.1f GiB, sm_%d%d, budget %.1f GiB", prop.name,
             tot / 1073741824.0, prop.major, prop.minor, c->pub.budget / 1073741824.0);
    pthread_mutex_init(&c->mu, NULL);
    pthread_mutex_init(&c->capture_mu, NULL);
    pthread_mutex_init(&c->load_mu, NULL);
    pthread_cond_init(&c->load_cv, NULL);
    c->graphs = p->graphs;
    c->uva = prop.unifiedAddressing != 0;
    c->sms = prop.multiProcessorCount > 0 ? prop.multiProcessorCount : 1;
    c->attn_splits = p->attn_splits > 32 ? 32 : p->attn_splits;
    c->lora_tiled = p->lora_tiled;
    c->attn_tiled = p->attn_tiled;
    CUDA_CHECK(cudaStreamCreateWithFlags(&c->compute, cudaStreamNonBlocking));
    CUDA_CHECK(cudaStreamCreateWithFlags(&c->copy, cudaStreamNonBlocking));
    CUDA_CHECK(cudaStreamCreateWithFlags(&c->load, cudaStreamNonBlocking));
    CUDA_CHECK(cudaStreamCreateWithFlags(&c->signal, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&c->compute_mark, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&c->signal_mark, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&c->sync_ev, cudaEventDisableTiming | cudaEventBlockingSync));
    double spin_s = p->spin_timeout_s;
    const char *env = getenv("CS_CUDA_SPIN_TIMEOUT_S");
    if (spin_s <= 0 && env && atof(env) > 0) spin_s = atof(env);
    if (spin_s <= 0) spin_s = 60;
    c->spin_timeout_ns = (uint64_t)(spin_s * 1e9);
    CUDA_CHECK(cudaMallocHost((void **)&c->report, sizeof *c->report));
    memset(c->report, 0, sizeof *c->report);
    report_add(c->report, true);
    /* every kernel loaded now: none loads lazily while a wait_add spins */
    load_embed_kernels();
    load_rows_kernels();
    load_convert_kernels();
    load_add_kernels();
    load_silu_mul_kernels();
    load_rmsnorm_kernels();
    load_rope_kernels();
    load_attention_kernels();
    load_lora_kernels();
    load_assist_kernels();
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
    b->caps = make_caps(p->graphs);
    b->ctx = c;
    b->n_threads = 1;
    return b;
}

} /* namespace CS_NS */

extern "C" backend_t *PUB_NEW(const cuda_backend_params_t *p) {
    cuda_backend_params_t d = {0, 0, false, 0, 0, 0, 0};
    return CS_NS::create(p ? p : &d);
}
