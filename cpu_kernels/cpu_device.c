/* cpu_device.c: the CPU backend and the strict test device of cpu_backend.h: two method tables
 * (struct backend_i, backend/backend_impl.h) over the CPU kernels (cpu_raw.h), with the
 * capabilities each declares.
 *
 * The CPU backend: a buffer handle wraps a host allocation (or, from buf_from_host, host
 * memory the caller owns, such as a weight in the checkpoint's mmap); copies are memcpy;
 * adapter slots given host memory that stays use it in place. What it adds over calling the
 * kernels directly is a lookup per handle.
 *
 * The strict test device: the same kernels, but every handle is checked (one of its live
 * handles, the range inside it) before it is resolved, fresh buffers are NaN, and
 * host<->device copies cross a simulated link on the device's copy thread (bandwidth,
 * latency, counted), synchronous ones waiting for it and asynchronous ones overlapping the
 * ops until an event says they are done. It proves no host pointer crosses the interface
 * and gives the cold-start work a device to test on without a GPU. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <string.h>
#include <time.h>

#include "backend/backend_impl.h"
#include "cpu_kernels/cpu_backend.h"
#include "cpu_kernels/cpu_raw.h"
#include "cpu_kernels/kernels.h"
#include "cpu_kernels/wcode.h"

#define BUF_MAGIC 0x42554631u   /* "BUF1" */
#define BATCH_MAGIC 0x42415431u
#define SLOT_MAGIC 0x534c5431u
#define EVENT_MAGIC 0x45565431u

struct backend_buf {
    uint32_t magic;
    const void *owner;      /* the backend_t that made it */
    void *p;
    size_t n;
    bool external;          /* buf_from_host: the memory is the caller's */
    struct cs_wcode *code;  /* weight_prepare: the weight coded in 12 bits (--compress-weights) */
    bool code_only;         /* ... and only the code is read from here on (host bytes released) */
    struct cs_qpack *pack;  /* weight_prepare: the weight repacked for the int8 kernels */
    size_t mapped;          /* an anonymous mapping of this length (freed with munmap), or 0 */
};

typedef struct slot_mod {
    int rank, d_in, d_out;
    float scale;
    cs_dtype dtype;            /* F32 or BF16, as uploaded */
    backend_buf_t *a, *b, *bt; /* strict device: its copies */
    const void *pa, *pb, *pbt;
} slot_mod_t;

struct backend_adapter {
    uint32_t magic;
    const void *owner;
    int n_layers;
    slot_mod_t *mods;
    size_t bytes;           /* device bytes (0 when used in place) */
    int arrived;            /* layers in place (atomic: the copy thread raises it) */
    struct backend_event *done; /* streaming: recorded after its last group (adapter_free waits) */
    void (*on_group)(void *);
    void *user;
    /* lockstep, or a host copy still coming in (host_partial): the groups not sent yet (the
     * host weights stay valid: host_stays) */
    backend_lora_module_desc_t *held;
    int group, next_layer;
    int fed;                /* layers in host memory (adapter_feed; atomic); n_layers when whole */
    bool lockstep;
};

struct backend_batch {
    uint32_t magic;
    const void *owner;
    backend_buf_t *mem;     /* the uploaded arrays */
    size_t mem_cap;
    int32_t *stage;         /* host staging of the arrays, kept between forwards */
    size_t stage_cap;       /* bytes */
    int n_tokens, n_seqs, n_out, n_lora, n_blocks;
    const int32_t *ids, *pos, *slots, *out_rows, *blocks; /* into mem */
    cpu_attn_seq_t *seqs;   /* host-side views of the uploaded tables (pointers into mem) */
    int seq_cap;
    backend_lora_seg_desc_t *lora;
    int lora_cap;
    cpu_lora_seg_t *lsegs;  /* scratch for one projection */
};

typedef struct copy_job {
    int kind;               /* 0 set, 1 get, 2 event marker, 3 layers arrived (slot, n) */
    backend_buf_t *buf;
    size_t off, n;
    void *host;
    const void *src;
    struct backend_event *ev;
    bool *done;             /* synchronous jobs: set when finished */
    struct copy_job *next;
} copy_job_t;

struct backend_event {
    uint32_t magic;
    bool recorded, complete;
};

typedef struct dev_ctx {
    cpu_raw_t *raw;
    bool strict;
    /* strict: its live handles, a set of pointers (open addressing), so a handle is checked
     * before anything behind it is read */
    const backend_buf_t **live;
    size_t live_cap, live_n, live_used; /* used: live + tombstones */
    /* copy thread (strict) */
    pthread_t copier;
    bool copier_started, stopping;
    pthread_mutex_t mu;
    pthread_cond_t cv;      /* new job / job done */
    copy_job_t *head, *tail;
    double bytes_per_s, latency_us;
    bool lockstep;          /* streaming slots advance one group per adapter_arrived (tests) */
    backend_stats_t stats;  /* under mu */
} dev_ctx_t;

static dev_ctx_t *dev(backend_t *b) { return b->ctx; }

#define TOMB ((const backend_buf_t *)(uintptr_t)1)

static size_t live_slot(const void *p, size_t mask) {
    uint64_t x = (uint64_t)(uintptr_t)p;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return (size_t)x & mask;
}

static bool live_has(const dev_ctx_t *d, const void *p) {
    if (!d->live_cap) return false;
    for (size_t i = live_slot(p, d->live_cap - 1);; i = (i + 1) & (d->live_cap - 1)) {
        if (d->live[i] == p) return true;
        if (!d->live[i]) return false;
    }
}

static bool live_add(dev_ctx_t *d, const backend_buf_t *p) {
    if ((d->live_used + 1) * 2 > d->live_cap) { /* grow (or clean the tombstones) */
        size_t nc = d->live_cap ? d->live_cap : 256;
        while ((d->live_n + 1) * 4 > nc) nc *= 2;
        const backend_buf_t **nl = calloc(nc, sizeof *nl);
        if (!nl) return false;
        for (size_t i = 0; i < d->live_cap; i++) {
            const backend_buf_t *q = d->live[i];
            if (!q || q == TOMB) continue;
            size_t j = live_slot(q, nc - 1);
            while (nl[j]) j = (j + 1) & (nc - 1);
            nl[j] = q;
        }
        free(d->live);
        d->live = nl;
        d->live_cap = nc;
        d->live_used = d->live_n;
    }
    size_t i = live_slot(p, d->live_cap - 1);
    while (d->live[i] && d->live[i] != TOMB) i = (i + 1) & (d->live_cap - 1);
    if (!d->live[i]) d->live_used++;
    d->live[i] = p;
    d->live_n++;
    return true;
}

static void live_del(dev_ctx_t *d, const backend_buf_t *p) {
    for (size_t i = live_slot(p, d->live_cap - 1);; i = (i + 1) & (d->live_cap - 1)) {
        if (d->live[i] == p) {
            d->live[i] = TOMB;
            d->live_n--;
            return;
        }
        CS_ASSERT(d->live[i]);
    }
}

static void strict_fail(const char *what) {
    fprintf(stderr, "strict device: %s\n", what);
    abort();
}

/* ---- handles ---- */
static void *resolve(backend_t *b, const backend_buf_t *buf, size_t off, size_t need, const char *what) {
    dev_ctx_t *d = dev(b);
    if (!buf) {
        if (d->strict) {
            char m[128];
            snprintf(m, sizeof m, "%s: NULL buffer", what);
            strict_fail(m);
        }
        return NULL;
    }
    if (d->strict) {
        char m[200];
        pthread_mutex_lock(&d->mu);
        bool ok = live_has(d, buf) && buf->magic == BUF_MAGIC && buf->owner == b;
        pthread_mutex_unlock(&d->mu);
        if (!ok) {
            snprintf(m, sizeof m, "%s: %p is not a live buffer of this device (a host pointer, a freed or a foreign handle)",
                     what, (const void *)buf);
            strict_fail(m);
        }
        if (off > buf->n || need > buf->n - off) {
            snprintf(m, sizeof m, "%s: bytes [%zu, %zu) outside the buffer of %zu", what, off, off + need, buf->n);
            strict_fail(m);
        }
    }
    return (char *)buf->p + off;
}

#define F(b, buf, nfloats, what) ((float *)resolve((b), (buf), 0, sizeof(float) * (size_t)(nfloats), (what)))

static cs_weight_t raw_weight(backend_t *b, const backend_weight_t *w, const char *what) {
    cs_weight_t r = {w->dtype, w->rows, w->cols, NULL, NULL, NULL};
    r.data = resolve(b, w->buf, 0, (size_t)w->rows * cs_dtype_row_bytes(w->dtype, w->cols), what);
    r.code = w->buf && w->buf->code && w->dtype == CS_DTYPE_BF16 && w->buf->code->rows == w->rows &&
                     w->buf->code->cols == w->cols
                 ? w->buf->code
                 : NULL;
    r.pack = w->buf && w->buf->pack && w->buf->pack->dtype == w->dtype && w->buf->pack->rows == w->rows &&
                     w->buf->pack->cols == w->cols
                 ? w->buf->pack
                 : NULL;
    if (w->buf && w->buf->code_only) {
        CS_ASSERT(r.code); /* its BF16 bytes are gone: a view of another shape could not be served */
        r.data = NULL;
    }
    return r;
}

static backend_buf_t *buf_new(backend_t *b, void *p, size_t n, bool external) {
    dev_ctx_t *d = dev(b);
    backend_buf_t *buf = calloc(1, sizeof *buf);
    if (!buf) return NULL;
    *buf = (backend_buf_t){BUF_MAGIC, b, p, n, external, NULL, false, NULL, 0};
    pthread_mutex_lock(&d->mu);
    if (d->strict && !live_add(d, buf)) {
        pthread_mutex_unlock(&d->mu);
        free(buf);
        return NULL;
    }
    d->stats.allocated += n;
    pthread_mutex_unlock(&d->mu);
    return buf;
}

#define DEV_MAP_MIN ((size_t)4 << 20)
/* A large buffer is an anonymous mapping populated at once (MAP_POPULATE: the kernel faults
 * and zeroes its pages in one go, several times faster than a memset's page faults), so a
 * KV pool of a GB is resident from the start and a decode step never waits on a first
 * touch. Smaller ones come from the heap, not filled (as cudaMalloc's memory is not; the
 * strict device fills them with NaN so that a read of what nobody wrote shows). */
static backend_buf_t *dev_buf_alloc(backend_t *b, size_t n) {
    void *p;
    size_t mapped = 0;
    if (n >= DEV_MAP_MIN) {
        mapped = (n + 4095) & ~(size_t)4095;
        p = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
        if (p == MAP_FAILED) return NULL;
    } else {
        p = cs_aligned_alloc_uninit(64, n ? n : 1);
        if (!p) return NULL;
    }
    if (dev(b)->strict) memset(p, 0xff, n); /* NaN: a read of what nobody wrote shows */
    backend_buf_t *buf = buf_new(b, p, n, false);
    if (!buf) {
        if (mapped) munmap(p, mapped);
        else free(p);
        return NULL;
    }
    buf->mapped = mapped;
    return buf;
}

static backend_buf_t *dev_buf_from_host(backend_t *b, void *p, size_t n) { return buf_new(b, p, n, true); }

static void dev_buf_free(backend_t *b, backend_buf_t *buf) {
    dev_ctx_t *d = dev(b);
    resolve(b, buf, 0, 0, "buf_free");
    pthread_mutex_lock(&d->mu);
    if (d->strict) live_del(d, buf);
    d->stats.allocated -= buf->n;
    pthread_mutex_unlock(&d->mu);
    if (buf->mapped) munmap(buf->p, buf->mapped);
    else if (!buf->external) free(buf->p);
    cs_wcode_free(buf->code);
    cs_qpack_free(buf->pack);
    buf->magic = 0;
    free(buf);
}

static size_t dev_buf_size(backend_t *b, const backend_buf_t *buf) {
    resolve(b, buf, 0, 0, "buf_size");
    return buf->n;
}

/* ---- copies: direct on the CPU, through the copy thread on the strict device ---- */
static void link_delay(dev_ctx_t *d, size_t n) {
    double us = d->latency_us + (d->bytes_per_s > 0 ? (double)n / d->bytes_per_s * 1e6 : 0);
    if (us <= 0) return;
    struct timespec ts = {(time_t)(us / 1e6), (long)(fmod(us, 1e6) * 1e3)};
    nanosleep(&ts, NULL);
}

static void *copier_main(void *arg) {
    backend_t *b = arg;
    dev_ctx_t *d = dev(b);
    pthread_mutex_lock(&d->mu);
    for (;;) {
        while (!d->head && !d->stopping) pthread_cond_wait(&d->cv, &d->mu);
        if (!d->head) break;
        copy_job_t *j = d->head;
        pthread_mutex_unlock(&d->mu);
        if (j->kind == 0) {
            link_delay(d, j->n);
            memcpy((char *)j->buf->p + j->off, j->src, j->n);
        } else if (j->kind == 1) {
            link_delay(d, j->n);
            memcpy(j->host, (const char *)j->buf->p + j->off, j->n);
        } else if (j->kind == 3) { /* a slot's layer group is in: ops issued after a read see it */
            backend_adapter_t *s = j->host;
            __atomic_store_n(&s->arrived, (int)j->n, __ATOMIC_RELEASE);
            if (s->on_group) s->on_group(s->user);
        }
        pthread_mutex_lock(&d->mu);
        d->head = j->next;
        if (!d->head) d->tail = NULL;
        if (j->kind == 0) { d->stats.h2d_bytes += j->n; d->stats.h2d_copies++; }
        if (j->kind == 1) { d->stats.d2h_bytes += j->n; d->stats.d2h_copies++; }
        if (j->kind == 2) j->ev->complete = true;
        if (j->done) *j->done = true;
        pthread_cond_broadcast(&d->cv);
        free(j);
    }
    pthread_mutex_unlock(&d->mu);
    return NULL;
}

/* queue a job on the copy thread; wait for it when sync */
static void enqueue(backend_t *b, copy_job_t *j, bool sync) {
    dev_ctx_t *d = dev(b);
    bool done = false;
    if (sync) j->done = &done;
    pthread_mutex_lock(&d->mu);
    if (d->tail) d->tail->next = j;
    else d->head = j;
    d->tail = j;
    pthread_cond_broadcast(&d->cv);
    while (sync && !done) pthread_cond_wait(&d->cv, &d->mu);
    pthread_mutex_unlock(&d->mu);
}

static copy_job_t *job(int kind, backend_buf_t *buf, size_t off, void *host, const void *src, size_t n) {
    copy_job_t *j = calloc(1, sizeof *j);
    CS_ASSERT(j);
    *j = (copy_job_t){kind, buf, off, n, host, src, NULL, NULL, NULL};
    return j;
}

static void set_impl(backend_t *b, backend_buf_t *dst, size_t off, const void *src, size_t n, bool sync) {
    dev_ctx_t *d = dev(b);
    void *p = resolve(b, dst, off, n, "buf_set");
    if (!d->strict || sync) { /* the compute queue's copies do not queue behind the copy queue's */
        if (d->strict) link_delay(d, n);
        memcpy(p, src, n);
        pthread_mutex_lock(&d->mu);
        d->stats.h2d_bytes += n;
        d->stats.h2d_copies++;
        pthread_mutex_unlock(&d->mu);
        return;
    }
    enqueue(b, job(0, dst, off, NULL, src, n), false);
}

static void get_impl(backend_t *b, void *dst, const backend_buf_t *src, size_t off, size_t n, bool sync) {
    dev_ctx_t *d = dev(b);
    void *p = resolve(b, src, off, n, "buf_get");
    if (!d->strict || sync) {
        if (d->strict) link_delay(d, n);
        memcpy(dst, p, n);
        pthread_mutex_lock(&d->mu);
        d->stats.d2h_bytes += n;
        d->stats.d2h_copies++;
        pthread_mutex_unlock(&d->mu);
        return;
    }
    enqueue(b, job(1, (backend_buf_t *)src, off, dst, NULL, n), false);
}

static void dev_buf_set(backend_t *b, backend_buf_t *dst, size_t off, const void *src, size_t n) {
    set_impl(b, dst, off, src, n, true);
}
static void dev_buf_get(backend_t *b, void *dst, const backend_buf_t *src, size_t off, size_t n) {
    get_impl(b, dst, src, off, n, true);
}
static void dev_buf_set_async(backend_t *b, backend_buf_t *dst, size_t off, const void *src, size_t n) {
    set_impl(b, dst, off, src, n, false);
}
static void dev_buf_get_async(backend_t *b, void *dst, const backend_buf_t *src, size_t off, size_t n) {
    get_impl(b, dst, src, off, n, false);
}

static void dev_buf_copy(backend_t *b, backend_buf_t *dst, size_t doff, const backend_buf_t *src, size_t soff, size_t n) {
    dev_ctx_t *d = dev(b);
    void *pd = resolve(b, dst, doff, n, "buf_copy dst");
    const void *ps = resolve(b, src, soff, n, "buf_copy src");
    memmove(pd, ps, n);
    pthread_mutex_lock(&d->mu);
    d->stats.d2d_bytes += n;
    d->stats.d2d_copies++;
    pthread_mutex_unlock(&d->mu);
}

static backend_event_t *dev_event_new(backend_t *b) {
    (void)b;
    backend_event_t *ev = calloc(1, sizeof *ev);
    if (ev) ev->magic = EVENT_MAGIC;
    return ev;
}

static void check_event(backend_event_t *ev) {
    if (!ev || ev->magic != EVENT_MAGIC) strict_fail("not an event of this device");
}

static void dev_event_free(backend_t *b, backend_event_t *ev) {
    check_event(ev);
    backend_event_synchronize(b, ev); /* the copy thread may still point at it */
    ev->magic = 0;
    free(ev);
}

static void dev_event_record(backend_t *b, backend_event_t *ev) {
    dev_ctx_t *d = dev(b);
    check_event(ev);
    pthread_mutex_lock(&d->mu);
    ev->recorded = true;
    ev->complete = false;
    pthread_mutex_unlock(&d->mu);
    copy_job_t *j = job(2, NULL, 0, NULL, NULL, 0);
    j->ev = ev;
    enqueue(b, j, false);
}

static void dev_event_synchronize(backend_t *b, backend_event_t *ev) {
    dev_ctx_t *d = dev(b);
    check_event(ev);
    pthread_mutex_lock(&d->mu);
    while (ev->recorded && !ev->complete) pthread_cond_wait(&d->cv, &d->mu);
    pthread_mutex_unlock(&d->mu);
}

/* the compute queue runs on the caller's thread: waiting for an event is blocking on it */
static void dev_event_wait(backend_t *b, backend_event_t *ev) { dev_event_synchronize(b, ev); }

static bool dev_event_query(backend_t *b, backend_event_t *ev) {
    dev_ctx_t *d = dev(b);
    check_event(ev);
    pthread_mutex_lock(&d->mu);
    bool c = !ev->recorded || ev->complete;
    pthread_mutex_unlock(&d->mu);
    return c;
}

static void *dev_host_alloc(backend_t *b, size_t n) { (void)b; return cs_aligned_alloc(4096, n ? n : 1); }
static void dev_host_free(backend_t *b, void *p) { (void)b; free(p); }

/* ---- the batch ---- */
static const backend_batch_t *check_batch(backend_t *b, const backend_batch_t *bt, const char *what) {
    if (!bt || bt->magic != BATCH_MAGIC || bt->owner != b) {
        char m[128];
        snprintf(m, sizeof m, "%s: not a batch of this device", what);
        strict_fail(m);
    }
    return bt;
}

static int dev_batch_upload(backend_t *b, backend_batch_t **io, const backend_batch_desc_t *d) {
    backend_batch_t *bt = *io;
    if (!bt) {
        if (!(bt = calloc(1, sizeof *bt))) return cs_error_set(CS_ENOMEM, "out of memory");
        bt->magic = BATCH_MAGIC;
        bt->owner = b;
        *io = bt;
    } else {
        check_batch(b, bt, "batch_upload");
    }
    if (d->n_tokens < 0 || d->n_seqs < 0 || d->n_out < 0 || d->n_blocks < 0 || d->n_lora < 0)
        return cs_error_set(CS_EINVAL, "batch: negative counts");
    /* one upload: ids | pos | slots | out_rows | blocks */
    size_t n4 = (size_t)3 * d->n_tokens + d->n_out + d->n_blocks;
    size_t need = n4 * sizeof(int32_t);
    if (need > bt->mem_cap || !bt->mem) {
        backend_buf_free(b, bt->mem);
        size_t cap = need > 4096 ? need + need / 2 : 4096;
        if (!(bt->mem = dev_buf_alloc(b, cap))) { bt->mem_cap = 0; return cs_error_set(CS_ENOMEM, "out of memory"); }
        bt->mem_cap = cap;
    }
    if (need > bt->stage_cap) {
        free(bt->stage);
        if (!(bt->stage = malloc(bt->mem_cap))) { bt->stage_cap = 0; return cs_error_set(CS_ENOMEM, "out of memory"); }
        bt->stage_cap = bt->mem_cap;
    }
    int32_t *host = bt->stage;
    size_t o = 0;
    memcpy(host + o, d->ids, sizeof(int32_t) * d->n_tokens), o += d->n_tokens;
    memcpy(host + o, d->pos, sizeof(int32_t) * d->n_tokens), o += d->n_tokens;
    memcpy(host + o, d->slots, sizeof(int32_t) * d->n_tokens), o += d->n_tokens;
    if (d->n_out) memcpy(host + o, d->out_rows, sizeof(int32_t) * d->n_out);
    o += d->n_out;
    if (d->n_blocks) memcpy(host + o, d->blocks, sizeof(int32_t) * d->n_blocks);
    set_impl(b, bt->mem, 0, host, need, true);
    pthread_mutex_lock(&dev(b)->mu);
    dev(b)->stats.batch_uploads++;
    pthread_mutex_unlock(&dev(b)->mu);
    const int32_t *m = bt->mem->p;
    bt->ids = m;
    bt->pos = m + d->n_tokens;
    bt->slots = m + 2 * (size_t)d->n_tokens;
    bt->out_rows = m + 3 * (size_t)d->n_tokens;
    bt->blocks = bt->out_rows + d->n_out;
    bt->n_tokens = d->n_tokens;
    bt->n_out = d->n_out;
    bt->n_blocks = d->n_blocks;
    /* the sequence and segment tables: small, kept beside the handle (a GPU backend
     * uploads them with the rest) */
    if (d->n_seqs > bt->seq_cap) {
        free(bt->seqs);
        if (!(bt->seqs = malloc(sizeof *bt->seqs * (size_t)d->n_seqs))) { bt->seq_cap = 0; return cs_error_set(CS_ENOMEM, "out of memory"); }
        bt->seq_cap = d->n_seqs;
    }
    for (int s = 0; s < d->n_seqs; s++) {
        const backend_seq_desc_t *q = &d->seqs[s];
        if (q->blk0 < 0 || q->blk0 > d->n_blocks) return cs_error_set(CS_EINVAL, "batch: sequence %d's table is outside", s);
        bt->seqs[s] = (cpu_attn_seq_t){q->row0, q->n, q->pos0, bt->blocks + q->blk0};
    }
    bt->n_seqs = d->n_seqs;
    if (d->n_lora > bt->lora_cap) {
        free(bt->lora);
        free(bt->lsegs);
        bt->lora = malloc(sizeof *bt->lora * (size_t)d->n_lora);
        bt->lsegs = malloc(sizeof *bt->lsegs * (size_t)d->n_lora);
        if (!bt->lora || !bt->lsegs) { bt->lora_cap = 0; return cs_error_set(CS_ENOMEM, "out of memory"); }
        bt->lora_cap = d->n_lora;
    }
    for (int i = 0; i < d->n_lora; i++) {
        const backend_adapter_t *s = d->lora[i].slot;
        if (!s || s->magic != SLOT_MAGIC || s->owner != b) return cs_error_set(CS_EINVAL, "batch: segment %d names no adapter slot of this backend", i);
        bt->lora[i] = d->lora[i];
    }
    bt->n_lora = d->n_lora;
    return CS_OK;
}

static void dev_batch_free(backend_t *b, backend_batch_t *bt) {
    check_batch(b, bt, "batch_free");
    backend_buf_free(b, bt->mem);
    free(bt->stage);
    free(bt->seqs);
    free(bt->lora);
    free(bt->lsegs);
    bt->magic = 0;
    free(bt);
}

/* ---- adapter slots ---- */
/* layers [l0, l1) of slot S onto the copy queue, a marker raising its arrived count after
 * every group; the done event after the last layer */
static void send_layers(backend_t *b, backend_adapter_t *s, const backend_lora_module_desc_t *mods, int l0, int l1) {
    for (int l = l0; l < l1; l++) {
        for (int t = 0; t < BACKEND_LORA_TARGETS; t++) {
            const backend_lora_module_desc_t *m = &mods[l * BACKEND_LORA_TARGETS + t];
            slot_mod_t *sm = &s->mods[l * BACKEND_LORA_TARGETS + t];
            if (m->rank <= 0) continue;
            set_impl(b, sm->a, 0, m->a, sm->a->n, false);
            set_impl(b, sm->b, 0, m->b, sm->b->n, false);
            if (m->bt) set_impl(b, sm->bt, 0, m->bt, sm->bt->n, false);
        }
        if (s->group > 0 && ((l + 1) % s->group == 0 || l + 1 == s->n_layers)) {
            copy_job_t *j = job(3, NULL, 0, s, NULL, (size_t)(l + 1));
            enqueue(b, j, false);
        }
    }
    if (s->group > 0 && l1 == s->n_layers) dev_event_record(b, s->done);
}

/* A slot's buffers for D, copied on the copy queue; GROUP > 0 streams (a marker raises the
 * arrived count after every GROUP layers, the call returns at once), GROUP == 0 waits for
 * the copies. The CPU backend uses host memory that stays in place. */
static int slot_make(backend_t *b, const backend_adapter_desc_t *ad, int group, void (*on_group)(void *), void *user,
                     backend_adapter_t **out) {
    dev_ctx_t *d = dev(b);
    *out = NULL;
    int nm = ad->n_layers * BACKEND_LORA_TARGETS;
    backend_adapter_t *s = calloc(1, sizeof *s);
    if (!s || !(s->mods = calloc((size_t)(nm ? nm : 1), sizeof *s->mods))) {
        free(s);
        return cs_error_set(CS_ENOMEM, "out of memory");
    }
    s->magic = SLOT_MAGIC;
    s->owner = b;
    s->n_layers = ad->n_layers;
    bool in_place = !d->strict && ad->host_stays;
    int rc = CS_OK;
    /* every buffer first (a failure copies nothing), then the copies, layer by layer */
    for (int i = 0; i < nm && rc == CS_OK; i++) {
        const backend_lora_module_desc_t *m = &ad->mods[i];
        slot_mod_t *sm = &s->mods[i];
        if (m->rank <= 0) continue;
        if (m->dtype != CS_DTYPE_F32 && m->dtype != CS_DTYPE_BF16) {
            rc = cs_error_set(CS_EUNSUPPORTED, "adapter slot: %s LoRA weights (the CPU kernels take F32 and BF16)",
                              cs_dtype_name(m->dtype));
            break;
        }
        *sm = (slot_mod_t){m->rank, m->d_in, m->d_out, m->scale, m->dtype, NULL, NULL, NULL, m->a, m->b, m->bt};
        if (in_place) continue;
        size_t es = cs_dtype_size(m->dtype);
        size_t na = es * (size_t)m->rank * m->d_in, nb = es * (size_t)m->rank * m->d_out;
        sm->a = dev_buf_alloc(b, na);
        sm->b = dev_buf_alloc(b, nb);
        sm->bt = m->bt ? dev_buf_alloc(b, nb) : NULL;
        if (!sm->a || !sm->b || (m->bt && !sm->bt)) { rc = cs_error_set(CS_ENOMEM, "out of memory for an adapter slot"); break; }
        s->bytes += na + nb + (m->bt ? nb : 0);
        sm->pa = sm->a->p;
        sm->pb = sm->b->p;
        sm->pbt = sm->bt ? sm->bt->p : NULL;
    }
    if (rc == CS_OK && group > 0 && !(s->done = dev_event_new(b))) rc = cs_error_set(CS_ENOMEM, "out of memory");
    if (rc) {
        backend_adapter_free(b, s);
        return rc;
    }
    if (in_place) {
        s->arrived = s->n_layers;
        *out = s;
        return CS_OK;
    }
    s->on_group = on_group;
    s->user = user;
    s->group = group;
    s->fed = ad->host_partial ? CS_MAX(0, CS_MIN(ad->host_ready, s->n_layers)) : s->n_layers;
    s->lockstep = group > 0 && d->lockstep;
    if (group > 0 && (d->lockstep || ad->host_partial)) { /* sent a group a call (lockstep) or as fed */
        if (!(s->held = malloc(sizeof *s->held * (size_t)(nm ? nm : 1)))) {
            backend_adapter_free(b, s);
            return cs_error_set(CS_ENOMEM, "out of memory");
        }
        memcpy(s->held, ad->mods, sizeof *s->held * (size_t)nm);
        if (!s->lockstep) {
            send_layers(b, s, s->held, 0, s->fed);
            s->next_layer = s->fed;
        }
        *out = s;
        return CS_OK;
    }
    send_layers(b, s, ad->mods, 0, s->n_layers);
    if (group <= 0) { /* the host memory may go once this returns */
        backend_event_t *ev = dev_event_new(b);
        CS_ASSERT(ev);
        dev_event_record(b, ev);
        dev_event_free(b, ev);
        s->arrived = s->n_layers;
    }
    *out = s;
    return CS_OK;
}

static void check_slot(backend_t *b, const backend_adapter_t *s, const char *what);

/* more of a streaming slot's host copy is in: queue its copies (lockstep: adapter_arrived
 * sends them, as far as they are fed) */
static void dev_adapter_feed(backend_t *b, backend_adapter_t *s, int n) {
    check_slot(b, s, "adapter_feed");
    n = CS_MIN(n, s->n_layers);
    if (!s->held || n <= __atomic_load_n(&s->fed, __ATOMIC_ACQUIRE)) return;
    __atomic_store_n(&s->fed, n, __ATOMIC_RELEASE);
    if (s->lockstep) return;
    send_layers(b, s, s->held, s->next_layer, n);
    s->next_layer = n;
}

static int dev_adapter_upload(backend_t *b, const backend_adapter_desc_t *ad, backend_adapter_t **out) {
    return slot_make(b, ad, 0, NULL, NULL, out);
}

static int dev_adapter_stream(backend_t *b, const backend_adapter_desc_t *ad, int group, void (*on_group)(void *),
                              void *user, backend_adapter_t **out) {
    return slot_make(b, ad, group > 0 ? group : 1, on_group, user, out);
}

static void check_slot(backend_t *b, const backend_adapter_t *s, const char *what) {
    if (!s || s->magic != SLOT_MAGIC || s->owner != b) {
        char m[128];
        snprintf(m, sizeof m, "%s: not an adapter slot of this device", what);
        strict_fail(m);
    }
}

static void dev_adapter_free(backend_t *b, backend_adapter_t *s) {
    check_slot(b, s, "adapter_free");
    if (s->done) {
        if (s->next_layer < s->n_layers && s->held) dev_event_record(b, s->done); /* sent part way */
        dev_event_free(b, s->done); /* waits for the copies still streaming into it */
    }
    free(s->held);
    for (int i = 0; i < s->n_layers * BACKEND_LORA_TARGETS; i++) {
        backend_buf_free(b, s->mods[i].a);
        backend_buf_free(b, s->mods[i].b);
        backend_buf_free(b, s->mods[i].bt);
    }
    free(s->mods);
    s->magic = 0;
    free(s);
}

static size_t dev_adapter_bytes(backend_t *b, const backend_adapter_t *s) {
    check_slot(b, s, "adapter_bytes");
    return s->bytes;
}

static int dev_adapter_arrived(backend_t *b, const backend_adapter_t *cs) {
    check_slot(b, cs, "adapter_arrived");
    backend_adapter_t *s = (backend_adapter_t *)cs;
    int fed = __atomic_load_n(&s->fed, __ATOMIC_ACQUIRE);
    if (s->lockstep && s->next_layer < fed) { /* one more group (as far as fed), landed before the answer */
        int l1 = CS_MIN(fed, s->next_layer + s->group);
        send_layers(b, s, s->held, s->next_layer, l1);
        s->next_layer = l1;
        backend_event_t *ev = dev_event_new(b);
        CS_ASSERT(ev);
        dev_event_record(b, ev);
        dev_event_free(b, ev);
    }
    return __atomic_load_n(&s->arrived, __ATOMIC_ACQUIRE);
}

/* ---- host-assisted ops: the compute queue is the caller's thread ---- */
static void dev_get_signal(backend_t *b, void *dst, const backend_buf_t *src, size_t off, size_t n, uint32_t *flag,
                           uint32_t value) {
    dev_ctx_t *d = dev(b);
    const void *p = resolve(b, src, off, n, "get_signal");
    link_delay(d, n); /* device -> host over the link */
    memcpy(dst, p, n);
    pthread_mutex_lock(&d->mu);
    d->stats.d2h_bytes += n;
    d->stats.d2h_copies++;
    pthread_mutex_unlock(&d->mu);
    cs_flag_store(flag, value);
}

static void dev_wait_add(backend_t *b, backend_buf_t *y, size_t off, const void *src, cs_dtype src_dtype, size_t n,
                         const uint32_t *flag, uint32_t value, const uint32_t *alive, int layer) {
    dev_ctx_t *d = dev(b);
    (void)layer, (void)alive; /* a host thread's wait: no deadline */
    float *p = resolve(b, y, off, sizeof(float) * n, "wait_add");
    cs_flag_wait_geq(flag, value);
    size_t bytes = cs_dtype_size(src_dtype) * n;
    link_delay(d, bytes); /* the host's result comes over the link */
    if (src_dtype == CS_DTYPE_F32) {
        cpu_raw_add(d->raw, p, src, n);
    } else { /* BF16: widened exactly, then added in F32 */
        const uint16_t *h = src;
        for (size_t i = 0; i < n; i++) p[i] += cs_bf16_to_f32(h[i]);
    }
    pthread_mutex_lock(&d->mu);
    d->stats.h2d_bytes += bytes;
    d->stats.h2d_copies++;
    pthread_mutex_unlock(&d->mu);
}

/* --compress-weights: a BF16 matmul weight coded in 12 bits beside it, once per buffer (a
 * tied lm_head shares the embedding's). Not coded, and read as BF16: a matrix of 2^32
 * weights or more (the exception index is 32-bit), or one whose high bytes are so spread
 * that over 1% of its weights are exceptions (then the code would not be smaller enough to
 * pay: 8 bytes and a scalar step each). Where the code serves every path (cpu_raw_code_only:
 * not on AMX) and the buffer is the caller's memory, only the code is read from here on and
 * the caller may release that memory. --precision int8 (AVX512-VNNI, AVX2): a Q8_0/Q4_K/Q5_K/Q6_K
 * matrix repacked beside its blocks (cpu_raw_qpack_new), which stay. Both run the pool from the
 * loading thread: the server holds the engine still while a model loads beside it with either
 * (rollout_api/weights.c). */
static int dev_weight_prepare(backend_t *b, const backend_weight_t *w) {
    dev_ctx_t *d = dev(b);
    if (cpu_raw_packs_quant(d->raw) && cs_qpack_supports(w->dtype, w->rows, w->cols)) {
        cs_weight_t rw = raw_weight(b, w, "weight_prepare");
        if (!w->buf || w->buf->pack) return CS_OK;
        if (!(w->buf->pack = cpu_raw_qpack_new(d->raw, &rw)))
            return cs_error_set(CS_ENOMEM, "--precision int8: out of memory repacking a %dx%d %s weight", w->rows, w->cols,
                                cs_dtype_name(w->dtype));
        return CS_OK;
    }
    if (!cpu_raw_codes_weights(d->raw) || w->dtype != CS_DTYPE_BF16 || w->rows < 1 || w->cols < 1 ||
        (uint64_t)w->rows * (uint64_t)w->cols >= ((uint64_t)1 << 32))
        return CS_OK;
    cs_weight_t rw = raw_weight(b, w, "weight_prepare"); /* the strict device checks the handle here */
    if (!w->buf) return CS_OK;
    if (w->buf->code) return w->buf->code_only ? BACKEND_WEIGHT_HOST_UNUSED : CS_OK;
    struct cs_wcode *code = cpu_raw_wcode_new(d->raw, &rw);
    if (!code) return cs_error_set(CS_ENOMEM, "--compress-weights: out of memory coding a %dx%d weight", w->rows, w->cols);
    if (code->n_exc * 100 > (size_t)w->rows * w->cols) {
        cs_wcode_free(code);
        return CS_OK;
    }
    w->buf->code = code;
    /* only a buffer over the caller's memory is handed back (one of ours keeps its bytes) */
    w->buf->code_only = w->buf->external && cpu_raw_code_only(d->raw);
    pthread_mutex_lock(&d->mu);
    d->stats.prepared_from += (size_t)w->rows * w->cols * 2;
    d->stats.prepared_bytes += cs_wcode_bytes(code);
    d->stats.prepared_exceptions += code->n_exc;
    pthread_mutex_unlock(&d->mu);
    return w->buf->code_only ? BACKEND_WEIGHT_HOST_UNUSED : CS_OK;
}

/* ---- compute ---- */
static void dev_embed(backend_t *b, backend_buf_t *y, const backend_weight_t *t, const backend_batch_t *bt) {
    check_batch(b, bt, "embed");
    cs_weight_t w = raw_weight(b, t, "embed table");
    for (int i = 0; i < bt->n_tokens; i++)
        if (bt->ids[i] < 0 || bt->ids[i] >= t->rows) strict_fail("embed: token id out of range");
    cpu_raw_embed(dev(b)->raw, F(b, y, (size_t)bt->n_tokens * t->cols, "embed y"), &w, bt->ids, bt->n_tokens);
}

static void dev_matmul(backend_t *b, backend_buf_t *y, const backend_buf_t *x, int n, const backend_weight_t *w,
                       const backend_buf_t *bias) {
    cs_weight_t rw = raw_weight(b, w, "matmul w");
    cpu_raw_matmul(dev(b)->raw, F(b, y, (size_t)n * w->rows, "matmul y"), F(b, x, (size_t)n * w->cols, "matmul x"), n, &rw,
                   bias ? F(b, bias, w->rows, "matmul bias") : NULL);
}

static void dev_matmul_multi(backend_t *b, backend_buf_t *const *ys, const backend_buf_t *x, int n,
                             const backend_weight_t *const *ws, const backend_buf_t *const *biases, int count) {
    enum { MAXK = 8 };
    CS_ASSERT(count <= MAXK);
    float *ry[MAXK];
    const float *rb[MAXK];
    cs_weight_t rw[MAXK];
    const cs_weight_t *pw[MAXK];
    for (int k = 0; k < count; k++) {
        rw[k] = raw_weight(b, ws[k], "matmul_multi w");
        pw[k] = &rw[k];
        ry[k] = F(b, ys[k], (size_t)n * ws[k]->rows, "matmul_multi y");
        rb[k] = biases[k] ? F(b, biases[k], ws[k]->rows, "matmul_multi bias") : NULL;
    }
    cpu_raw_matmul_multi(dev(b)->raw, ry, F(b, x, (size_t)n * ws[0]->cols, "matmul_multi x"), n, pw, rb, count);
}

static void dev_rmsnorm(backend_t *b, backend_buf_t *y, const backend_buf_t *x, int n, int dim,
                        const backend_weight_t *w, float eps) {
    cs_weight_t rw = raw_weight(b, w, "rmsnorm w");
    cpu_raw_rmsnorm(dev(b)->raw, F(b, y, (size_t)n * dim, "rmsnorm y"), F(b, x, (size_t)n * dim, "rmsnorm x"), n, dim, &rw,
                    eps);
}

static void dev_rope(backend_t *b, backend_buf_t *x, int nh, int hd, const backend_batch_t *bt,
                     const backend_buf_t *inv_freq) {
    check_batch(b, bt, "rope");
    cpu_raw_rope(dev(b)->raw, F(b, x, (size_t)bt->n_tokens * nh * hd, "rope x"), bt->n_tokens, nh, hd, bt->pos,
                 F(b, inv_freq, hd / 2, "rope inv_freq"));
}

static void check_rows(backend_t *b, const backend_buf_t *buf, size_t elem, const int32_t *idx, int n, int row_len,
                       const char *what) {
    if (!dev(b)->strict) return;
    size_t rows = buf->n / (elem * (size_t)row_len);
    for (int i = 0; i < n; i++)
        if (idx[i] < 0 || (size_t)idx[i] >= rows) strict_fail(what);
}

static bool kv_dtype_ok(cs_dtype t) { return t == CS_DTYPE_F32 || t == CS_DTYPE_BF16; }

static void dev_kv_store(backend_t *b, backend_buf_t *pool, cs_dtype kv_dtype, const backend_buf_t *src,
                         const backend_batch_t *bt, int row_len) {
    check_batch(b, bt, "kv_store");
    if (!kv_dtype_ok(kv_dtype)) strict_fail("kv_store: KV pools are F32 or BF16");
    void *p = resolve(b, pool, 0, 0, "kv_store pool");
    check_rows(b, pool, cs_dtype_size(kv_dtype), bt->slots, bt->n_tokens, row_len, "kv_store: a slot outside the pool");
    cpu_raw_kv_store(dev(b)->raw, p, kv_dtype, F(b, src, (size_t)bt->n_tokens * row_len, "kv_store src"), bt->slots,
                     bt->n_tokens, row_len);
}

static void dev_attention(backend_t *b, backend_buf_t *out, const backend_buf_t *q, const backend_buf_t *k,
                          const backend_buf_t *v, cs_dtype kv_dtype, const backend_batch_t *bt, int bs, int nh, int nkv,
                          int hd, int window) {
    check_batch(b, bt, "attention");
    if (!kv_dtype_ok(kv_dtype)) strict_fail("attention: KV pools are F32 or BF16");
    const void *pk = resolve(b, k, 0, 0, "attention k"), *pv = resolve(b, v, 0, 0, "attention v");
    if (dev(b)->strict) { /* every block a table names lies in the pools */
        size_t nblk = k->n / (cs_dtype_size(kv_dtype) * (size_t)bs * nkv * hd);
        for (int s = 0; s < bt->n_seqs; s++) {
            int need = (bt->seqs[s].pos0 + bt->seqs[s].n + bs - 1) / bs;
            if (bt->seqs[s].blocks + need > bt->blocks + bt->n_blocks) strict_fail("attention: a block table runs past the batch's");
            for (int i = 0; i < need; i++)
                if (bt->seqs[s].blocks[i] < 0 || (size_t)bt->seqs[s].blocks[i] >= nblk) strict_fail("attention: a block outside the pools");
        }
        if (v->n != k->n) strict_fail("attention: k and v pools differ");
    }
    size_t rows = (size_t)bt->n_tokens;
    cpu_raw_attention_paged_kv(dev(b)->raw, F(b, out, rows * nh * hd, "attention out"),
                               F(b, q, rows * nh * hd, "attention q"), pk, pv, kv_dtype, bt->seqs, bt->n_seqs, bs, nh, nkv,
                               hd, window);
}

static void dev_get_out_rows(backend_t *b, backend_buf_t *dst, const backend_buf_t *src, const backend_batch_t *bt,
                             int row_len) {
    check_batch(b, bt, "get_out_rows");
    check_rows(b, src, sizeof(float), bt->out_rows, bt->n_out, row_len, "get_out_rows: a row outside the source");
    cpu_raw_get_rows(dev(b)->raw, F(b, dst, (size_t)bt->n_out * row_len, "get_out_rows dst"), F(b, src, 0, "get_out_rows src"),
                     bt->out_rows, bt->n_out, row_len);
}

static void dev_silu_mul(backend_t *b, backend_buf_t *g, const backend_buf_t *u, size_t n) {
    cpu_raw_silu_mul(dev(b)->raw, F(b, g, n, "silu_mul gate"), F(b, u, n, "silu_mul up"), n);
}

static void dev_add(backend_t *b, backend_buf_t *y, const backend_buf_t *x, size_t n) {
    cpu_raw_add(dev(b)->raw, F(b, y, n, "add y"), F(b, x, n, "add x"), n);
}

static void dev_lora(backend_t *b, backend_buf_t *y, const backend_buf_t *x, const backend_batch_t *bt, int layer,
                     int target, int d_in, int d_out) {
    check_batch(b, bt, "lora");
    backend_batch_t *mb = (backend_batch_t *)bt; /* its segment scratch */
    int ns = 0;
    for (int i = 0; i < bt->n_lora; i++) {
        const backend_adapter_t *s = bt->lora[i].slot;
        check_slot(b, s, "lora");
        if (layer < 0 || layer >= s->n_layers) strict_fail("lora: layer outside the adapter");
        if (layer >= bt->lora[i].device_layers) continue; /* the host adds this one (cold start) */
        if (layer >= __atomic_load_n(&s->arrived, __ATOMIC_ACQUIRE)) strict_fail("lora: a layer of the slot not arrived yet");
        const slot_mod_t *m = &s->mods[layer * BACKEND_LORA_TARGETS + target];
        if (m->rank <= 0) continue;
        if (m->d_in != d_in || m->d_out != d_out) strict_fail("lora: the slot's shape is not the projection's");
        if (bt->lora[i].row0 < 0 || bt->lora[i].row0 + bt->lora[i].n > bt->n_tokens) strict_fail("lora: rows outside the batch");
        if (dev(b)->strict) { /* still live handles */
            resolve(b, m->a, 0, 0, "lora a");
            resolve(b, m->b, 0, 0, "lora b");
        }
        mb->lsegs[ns++] = (cpu_lora_seg_t){bt->lora[i].row0, bt->lora[i].n, m->pa, m->pb, m->rank, m->scale, m->pbt, m->dtype};
    }
    if (!ns) return;
    size_t rows = (size_t)bt->n_tokens;
    cpu_raw_lora_batch(dev(b)->raw, F(b, y, rows * d_out, "lora y"), F(b, x, rows * d_in, "lora x"), mb->lsegs, ns, d_in,
                       d_out);
}

static void dev_synchronize(backend_t *b) { (void)b; } /* the ops ran on the caller's thread */

static void dev_get_stats(backend_t *b, backend_stats_t *st) {
    dev_ctx_t *d = dev(b);
    pthread_mutex_lock(&d->mu);
    *st = d->stats;
    pthread_mutex_unlock(&d->mu);
}

static void dev_free(backend_t *b) {
    dev_ctx_t *d = dev(b);
    if (d) {
        if (d->copier_started) {
            cs_stop_flag(&d->mu, &d->cv, &d->stopping);
            pthread_join(d->copier, NULL);
        }
        cpu_raw_free(d->raw);
        free(d->live);
        pthread_mutex_destroy(&d->mu);
        pthread_cond_destroy(&d->cv);
        free(d);
    }
    free(b);
}

#define KV_DTYPES .kv_dtypes = 1u << CS_DTYPE_F32 | 1u << CS_DTYPE_BF16, .quant_weights = true
#define COMMON_OPS                                                                                          \
    .buf_alloc = dev_buf_alloc, .buf_free = dev_buf_free, .buf_size = dev_buf_size, .buf_set = dev_buf_set,  \
    .buf_get = dev_buf_get, .buf_copy = dev_buf_copy, .batch_upload = dev_batch_upload,                     \
    .batch_free = dev_batch_free, .adapter_upload = dev_adapter_upload, .adapter_free = dev_adapter_free,    \
    .adapter_bytes = dev_adapter_bytes, .embed = dev_embed, .matmul = dev_matmul,                           \
    .matmul_multi = dev_matmul_multi, .rmsnorm = dev_rmsnorm, .rope = dev_rope, .kv_store = dev_kv_store,   \
    .attention = dev_attention, .get_out_rows = dev_get_out_rows, .silu_mul = dev_silu_mul, .add = dev_add, \
    .lora = dev_lora, .synchronize = dev_synchronize, .weight_prepare = dev_weight_prepare,                \
    .get_stats = dev_get_stats, .free = dev_free

static const struct backend_i cpu_backend_iface = {
    .name = "cpu",
    .buf_from_host = dev_buf_from_host,
    COMMON_OPS,
};
/* host memory read in place; copies are memcpy (synchronous) */
static const backend_caps_t cpu_backend_caps = {.host_memory = true, KV_DTYPES};

#define STRICT_OPS                                                                                          \
    .buf_set_async = dev_buf_set_async, .buf_get_async = dev_buf_get_async,                                 \
    .host_alloc = dev_host_alloc, .host_free = dev_host_free, .event_new = dev_event_new,                   \
    .event_free = dev_event_free, .event_record = dev_event_record, .event_wait = dev_event_wait,            \
    .event_query = dev_event_query, .event_synchronize = dev_event_synchronize, COMMON_OPS

static const struct backend_i strict_iface = {
    .name = "strict",
    .adapter_stream = dev_adapter_stream,
    .adapter_arrived = dev_adapter_arrived,
    .adapter_feed = dev_adapter_feed,
    .get_signal = dev_get_signal,
    .wait_add = dev_wait_add,
    STRICT_OPS,
};
/* a device's: no host memory in the ops, copies over the link on its copy thread with
 * events, page-aligned host buffers standing for pinned ones */
#define STRICT_CAPS .async_copies = true, .pinned_host = true, .events = true, KV_DTYPES
static const backend_caps_t strict_caps = {
    .adapter_stream = true, .adapter_feed = true, .host_assist = true, STRICT_CAPS,
};

/* the same without streaming slots or host-assisted ops: a device that uploads whole */
static const struct backend_i strict_whole_iface = {
    .name = "strict",
    STRICT_OPS,
};
static const backend_caps_t strict_whole_caps = {STRICT_CAPS};

static backend_t *dev_new(const struct backend_i *iface, const backend_caps_t *caps, const cpu_backend_params_t *cp,
                          bool strict) {
    backend_t *b = calloc(1, sizeof *b);
    dev_ctx_t *d = calloc(1, sizeof *d);
    if (!b || !d) goto err;
    b->iface = iface;
    b->caps = *caps;
    b->ctx = d;
    d->strict = strict;
    pthread_mutex_init(&d->mu, NULL);
    pthread_cond_init(&d->cv, NULL);
    if (!(d->raw = cpu_raw_new(cp))) {
        b->ctx = NULL;
        pthread_mutex_destroy(&d->mu);
        pthread_cond_destroy(&d->cv);
        goto err;
    }
    b->n_threads = d->raw->n_threads;
    if (strict) {
        if (pthread_create(&d->copier, NULL, copier_main, b)) {
            dev_free(b);
            cs_error_set(CS_ENOMEM, "strict device: cannot start its copy thread");
            return NULL;
        }
        d->copier_started = true;
    }
    return b;
err:
    free(b);
    free(d);
    cs_error_set(CS_ENOMEM, "backend: out of memory");
    return NULL;
}

backend_t *cpu_backend_new(const cpu_backend_params_t *p) { return dev_new(&cpu_backend_iface, &cpu_backend_caps, p, false); }

const char *cpu_backend_path(const backend_t *b) {
    if (b->iface != &cpu_backend_iface && b->iface != &strict_iface && b->iface != &strict_whole_iface) return "?";
    return cpu_raw_path(((const dev_ctx_t *)b->ctx)->raw);
}

backend_t *strict_device_new(const strict_device_params_t *p) {
    bool whole = p && p->no_stream;
    backend_t *b = dev_new(whole ? &strict_whole_iface : &strict_iface, whole ? &strict_whole_caps : &strict_caps,
                           p ? &p->cpu : NULL, true);
    if (b && p) {
        dev(b)->bytes_per_s = p->bytes_per_s;
        dev(b)->lockstep = p->lockstep;
        dev(b)->latency_us = p->latency_us;
    }
    return b;
}

bool backend_is_strict_device(const backend_t *b) {
    return b && (b->iface == &strict_iface || b->iface == &strict_whole_iface);
}
