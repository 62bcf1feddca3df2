/* loader_uring.c: one thread, one io_uring. Jobs queue under a mutex; one eventfd, also
 * registered with the ring so that every completion signals it, wakes the thread, whose
 * only blocking point is poll() on it (io_uring_enter is only used to submit, which also
 * keeps the thread visible as blocked to tools like valgrind). Each file goes openat -> statx -> reads of
 * chunk_bytes at increasing offsets (short reads resubmit the rest) -> close, all through
 * the ring, with at most queue_depth operations in flight over all files of all jobs and
 * the oldest job's files served first. Every io_uring call is checked; errors name the
 * call or operation, the file, and this source's file and line.
 *
 * O_DIRECT: offsets are multiples of 4096 (chunks are) and lengths are rounded up to 4096
 * (the buffer has the room: it is allocated in whole 4096-byte pages past the NUL), so the
 * last read of a file asks past its end and gets what is there. A file system that refuses
 * O_DIRECT says EINVAL at openat (the file is opened again without it) or at a read (O_DIRECT
 * is cleared on the descriptor with fcntl and the read goes again); so does a short read that
 * left an unaligned offset. Either way the file is read, through the page cache. */
#include "config.h" /* _GNU_SOURCE: statx, AT_EMPTY_PATH */
#include "lora/loader_uring.h"

#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <poll.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#if defined(__has_include)
#if __has_include(<valgrind/memcheck.h>)
#include <valgrind/memcheck.h> /* valgrind cannot see the kernel's io_uring writes: say them */
#endif
#endif
#ifndef VALGRIND_MAKE_MEM_DEFINED
#define VALGRIND_MAKE_MEM_DEFINED(p, n) ((void)(p), (void)(n))
#endif

/* Ring-level failures: a status with the call, file and line. */
#define URING_CHECK(call) uring_check((call), #call, __FILE__, __LINE__)
static int uring_check(int rc, const char *what, const char *file, int line) {
    if (rc >= 0) return rc;
    return cs_error_set(CS_EIO, "%s:%d: %s: %s", file, line, what, strerror(-rc));
}
/* In the thread a broken ring (EBADF, EFAULT, ... from wait/submit) is a programming error:
 * operations in flight may still write into buffers, so nothing can be safely unwound. */
#define URING_FATAL(what, rc)                                                                     \
    do {                                                                                          \
        cs_log("%s:%d: %s: %s", __FILE__, __LINE__, what, strerror(-(rc)));                       \
        abort();                                                                                  \
    } while (0)

enum { OP_OPEN, OP_STATX, OP_READ, OP_CLOSE, OP_TIMER };

enum { F_QUEUED, F_NEED_STATX, F_READING, F_NEED_CLOSE, F_BUSY, F_DONE };

typedef struct ld_job ld_job_t;

#define HUGE_BYTES ((size_t)2 << 20)
#define POOL_MAX 8
#define POOL_BYTES_DEFAULT ((size_t)256 << 20)

typedef struct ld_buf {
    char *p;                /* NULL: a free entry */
    size_t cap;
    bool busy;              /* a file's, until its job's callback has returned */
    bool registered;        /* in the ring's buffer table at this entry's index */
    bool dead;              /* an unregistration failed: this index is not used again */
} ld_buf_t;

typedef struct ld_file {
    ld_job_t *job;
    lora_file_t *pub;
    int state;
    int fd;
    struct statx stx;       /* written by the kernel: zeroed first (valgrind cannot see it) */
    bool direct;            /* opened (and still) O_DIRECT */
    int buf;                /* its buffer's pool index, -1: a buffer of its own */
    size_t next_off;        /* next offset to issue a read at */
    size_t done_bytes;      /* bytes read so far */
    int reads;              /* reads in flight or waiting to resubmit */
    /* a streamed file (lora_loader_submit_stream): chunks in the order asked, each reported */
    size_t n_chunks;
    uint8_t *issued;        /* [n_chunks]: a read of the chunk was issued */
    size_t *order;          /* lora_loader_reorder: chunks to read first, in this order */
    size_t n_order, order_at;
    size_t chunks_issued;
} ld_file_t;

struct ld_job {
    ld_job_t *next;
    lora_loader_chunk_fn chunk; /* a streamed job (one file): called per chunk read */
    lora_loader_done_fn done;
    void *user;
    size_t n_files, n_done;
    ld_file_t *files;
    lora_file_t *pub;
};

typedef struct ld_op {
    int kind;
    ld_file_t *f;
    size_t off, len;
    bool direct;            /* a read issued on an O_DIRECT descriptor */
    size_t chunk;           /* a streamed file's chunk this read is */
    struct ld_op *next;     /* free list, or the resubmit list */
} ld_op_t;

typedef struct ld_timer {
    int kind;               /* OP_TIMER: user_data points here as it does at an ld_op_t */
    struct __kernel_timespec ts;
    lora_loader_timer_fn fn;
    void *user;
    struct ld_timer *next;  /* l->timers_new, then l->timers_armed */
} ld_timer_t;

struct lora_loader {
    struct io_uring ring;
    bool ring_ok;
    int efd;
    pthread_t thread;
    bool thread_ok;
    int qd;
    size_t chunk;
    bool buffered;          /* never O_DIRECT */
    int refuse;             /* test_refuse_direct */
    const char *fault_eio;  /* CS_FAULT_EIO_PATH: reads of paths containing it fail with EIO */
    const char *fault_while;/* CS_FAULT_EIO_WHILE: ... while this file exists (NULL: always) */
    const char *hold_path;  /* CS_FAULT_HOLD_PATH: a streamed file whose path contains it ... */
    size_t hold_chunks;     /* CS_FAULT_HOLD_CHUNKS: ... issues no read past this many chunks ... */
    const char *hold_while; /* CS_FAULT_HOLD_WHILE: ... while this file exists */
    bool hold_armed;        /* a timer looks at the hold again */
    bool fixed;             /* a sparse table of POOL_MAX registered buffers is set up */
    size_t pool_limit;      /* bytes of pooled buffers at most (0: no pool) */
    size_t pool_used;
    ld_buf_t pool[POOL_MAX]; /* loader thread only (and lora_loader_free after it) */

    pthread_mutex_t mu;     /* guards queue_head/tail and stopping */
    ld_job_t *queue_head, *queue_tail;
    ld_timer_t *timers_new;
    bool stopping;

    /* loader thread only */
    ld_job_t *active_head, *active_tail;
    ld_op_t *ops, *free_ops, *resubmit;
    int ops_used;           /* allocated from ops: in flight or on resubmit */
    int files_open;         /* files between openat and close */
    ld_timer_t *timers_armed; /* in the ring: freed on completion or at free */
};

static void put_data(lora_loader_t *l, ld_file_t *f);

static void job_free(lora_loader_t *l, ld_job_t *j) {
    if (!j) return;
    for (size_t i = 0; i < j->n_files; i++) {
        put_data(l, &j->files[i]);
        free(j->files[i].issued);
        free(j->files[i].order);
        free((char *)j->pub[i].path);
    }
    free(j->files);
    free(j->pub);
    free(j);
}

/* The file failed: status and message (the first error is kept). Its buffer stays until no
 * read of it is in flight (the kernel may still be writing into it): drop_data then. */
static void file_fail(ld_file_t *f, int err, const char *what, int line) {
    if (f->pub->status != CS_OK) return;  /* keep the first error */
    f->pub->status = err == -ENOENT ? CS_ENOTFOUND : err == -ENOMEM ? CS_ENOMEM : CS_EIO;
    snprintf(f->pub->error, sizeof f->pub->error, "%s: %s: %s (%s:%d)", f->pub->path, what,
             err < 0 ? strerror(-err) : "unexpected end of file", __FILE__, line);
}

static void drop_data(lora_loader_t *l, ld_file_t *f) {
    put_data(l, f);
    f->pub->len = 0;
}

static ld_op_t *op_get(lora_loader_t *l, int kind, ld_file_t *f) {
    ld_op_t *op = l->free_ops;
    CS_ASSERT(op && l->ops_used < l->qd);
    l->free_ops = op->next;
    l->ops_used++;
    memset(op, 0, sizeof *op);
    op->kind = kind;
    op->f = f;
    return op;
}

static void op_put(lora_loader_t *l, ld_op_t *op) {
    op->next = l->free_ops;
    l->free_ops = op;
    l->ops_used--;
}

static struct io_uring_sqe *sqe_get(lora_loader_t *l) {
    /* the ring has room for queue_depth entries and is submitted after every round;
     * timers can fill it sooner: then what is queued goes first */
    struct io_uring_sqe *sqe = io_uring_get_sqe(&l->ring);
    if (!sqe) {
        int rc = io_uring_submit(&l->ring);
        if (rc < 0) URING_FATAL("io_uring_submit", rc);
        sqe = io_uring_get_sqe(&l->ring);
    }
    CS_ASSERT(sqe != NULL);
    return sqe;
}

static void prep(lora_loader_t *l, ld_op_t *op) {
    struct io_uring_sqe *sqe = sqe_get(l);
    ld_file_t *f = op->f;
    switch (op->kind) {
    case OP_OPEN:
        io_uring_prep_openat(sqe, AT_FDCWD, f->pub->path, O_RDONLY | O_CLOEXEC | (f->direct ? O_DIRECT : 0), 0);
        break;
    case OP_STATX:
        io_uring_prep_statx(sqe, f->fd, "", AT_EMPTY_PATH, STATX_TYPE | STATX_SIZE, &f->stx);
        break;
    case OP_READ:
        /* O_DIRECT: whole 4096-byte blocks (the buffer's pages past the file's end have room) */
        op->direct = f->direct;
        {
            unsigned n = (unsigned)(op->direct ? (op->len + LORA_LOADER_ALIGN - 1) / LORA_LOADER_ALIGN * LORA_LOADER_ALIGN
                                               : op->len);
            char *dst = (char *)f->pub->data + op->off;
            if (f->buf >= 0 && l->pool[f->buf].registered) io_uring_prep_read_fixed(sqe, f->fd, dst, n, op->off, f->buf);
            else io_uring_prep_read(sqe, f->fd, dst, n, op->off);
        }
        break;
    case OP_CLOSE: io_uring_prep_close(sqe, f->fd); break;
    default: CS_ASSERT(!"loader: bad op");
    }
    io_uring_sqe_set_data(sqe, op);
}

static void hold_tick(void *user) { ((lora_loader_t *)user)->hold_armed = false; }

/* the test hold (CS_FAULT_HOLD_*): F may issue no more reads now */
static bool held(lora_loader_t *l, ld_file_t *f) {
    if (!l->hold_path || f->chunks_issued < l->hold_chunks || !strstr(f->pub->path, l->hold_path) ||
        (l->hold_while && access(l->hold_while, F_OK) != 0))
        return false;
    if (!l->hold_armed) /* look again in 2 ms (the timer's completion runs the loop) */
        l->hold_armed = lora_loader_timer(l, 2, hold_tick, l) == CS_OK;
    return true;
}

/* a streamed file's reads: the chunks asked for first (lora_loader_reorder), then the rest
 * in file order */
static void issue_stream(lora_loader_t *l, ld_file_t *f, bool stopping) {
    while (!stopping && f->pub->status == CS_OK && l->ops_used < l->qd && !held(l, f)) {
        size_t c = SIZE_MAX;
        while (c == SIZE_MAX && f->order_at < f->n_order) {
            size_t k = f->order[f->order_at++];
            if (k < f->n_chunks && !f->issued[k]) c = k;
        }
        while (c == SIZE_MAX && f->next_off < f->pub->len) {
            size_t k = f->next_off / l->chunk;
            f->next_off += l->chunk;
            if (!f->issued[k]) c = k;
        }
        if (c == SIZE_MAX) return;
        f->issued[c] = 1;
        f->chunks_issued++;
        ld_op_t *op = op_get(l, OP_READ, f);
        op->chunk = c;
        op->off = c * l->chunk;
        op->len = CS_MIN(l->chunk, f->pub->len - op->off);
        f->reads++;
        prep(l, op);
    }
}

/* Prepare what can go now: resubmits, then per file in job order its next step. */
static void issue(lora_loader_t *l, ld_timer_t *timers, bool stopping) {
    while (timers) {
        ld_timer_t *t = timers;
        timers = t->next;
        struct io_uring_sqe *sqe = sqe_get(l);
        io_uring_prep_timeout(sqe, &t->ts, 0, 0);
        io_uring_sqe_set_data(sqe, t);
        t->next = l->timers_armed;
        l->timers_armed = t;
    }
    while (l->resubmit) {
        ld_op_t *op = l->resubmit;
        l->resubmit = op->next;
        prep(l, op);
    }
    for (ld_job_t *j = l->active_head; j && l->ops_used < l->qd; j = j->next) {
        for (size_t i = 0; i < j->n_files && l->ops_used < l->qd; i++) {
            ld_file_t *f = &j->files[i];
            switch (f->state) {
            case F_QUEUED:
                if (stopping || l->files_open >= l->qd) break;
                l->files_open++;
                f->state = F_BUSY;
                f->direct = !l->buffered;
                f->buf = -1;
                prep(l, op_get(l, OP_OPEN, f));
                break;
            case F_NEED_STATX:
                f->state = F_BUSY;
                prep(l, op_get(l, OP_STATX, f));
                break;
            case F_READING:
                if (j->chunk) {
                    issue_stream(l, f, stopping);
                    break;
                }
                while (!stopping && f->pub->status == CS_OK && f->next_off < f->pub->len && l->ops_used < l->qd) {
                    ld_op_t *op = op_get(l, OP_READ, f);
                    op->off = f->next_off;
                    op->len = CS_MIN(l->chunk, f->pub->len - f->next_off);
                    f->next_off += op->len;
                    f->reads++;
                    prep(l, op);
                }
                break;
            case F_NEED_CLOSE:
                f->state = F_BUSY;
                prep(l, op_get(l, OP_CLOSE, f));
                break;
            default: break;
            }
        }
    }
}

/* ---- buffers ----
 * A file is read into a buffer of whole 4096-byte pages past a NUL after its data (O_DIRECT
 * reads of the last block have the room), zeroed from its end to that page's end once it is
 * read; the bytes before are left for the reads to write (no pass over memory about to be
 * overwritten).
 * From 2 MiB up, buffers come from a pool the loader keeps (up to pool_bytes, POOL_MAX
 * buffers): 2 MiB-aligned, asked for transparent huge pages, registered with the ring once
 * (reads are READ_FIXED: the pages are pinned once, not at every read), and used again by the
 * next load once the job's callback has returned, so a steady stream of loads neither faults
 * in nor zeroes fresh memory. A callback that takes a pooled buffer keeps it (it leaves the
 * pool). Smaller files, and larger ones when the pool is full, get buffers of their own. */
static size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

static void *huge_alloc(size_t cap) {
    void *p = aligned_alloc(HUGE_BYTES, cap);
    if (p) (void)madvise(p, cap, MADV_HUGEPAGE); /* a hint: without THP, 4 KiB pages */
    return p;
}

/* forget pool entry I: unregistered, and freed unless TAKEN by a callback */
static void pool_drop(lora_loader_t *l, int i, bool taken) {
    ld_buf_t *b = &l->pool[i];
    if (b->registered) {
        struct iovec iov = {.iov_base = NULL, .iov_len = 0};
        __u64 tag = 0;
        int rc = io_uring_register_buffers_update_tag(&l->ring, (unsigned)i, &iov, &tag, 1);
        if (rc != 1) { /* still in the table: its memory is never freed nor its entry used again */
            cs_log("%s:%d: io_uring_register_buffers_update_tag (drop): %s: %zu bytes left registered", __FILE__,
                   __LINE__, strerror(rc < 0 ? -rc : EIO), b->cap);
            l->pool_used -= b->cap;
            *b = (ld_buf_t){.dead = true};
            return;
        }
    }
    if (!taken) free(b->p);
    l->pool_used -= b->cap;
    *b = (ld_buf_t){0};
}

/* a pooled buffer of at least NEED bytes: its index, or -1 (then the file gets its own) */
static int pool_get(lora_loader_t *l, size_t need) {
    if (need < HUGE_BYTES || need > l->pool_limit) return -1;
    int best = -1;
    for (int i = 0; i < POOL_MAX; i++) {
        ld_buf_t *b = &l->pool[i];
        if (b->p && !b->busy && b->cap >= need && (best < 0 || b->cap < l->pool[best].cap)) best = i;
    }
    if (best >= 0) {
        l->pool[best].busy = true;
        return best;
    }
    size_t cap = round_up(need, HUGE_BYTES), idle = 0;
    int e = -1, n_idle = 0;
    for (int i = 0; i < POOL_MAX; i++) {
        if (l->pool[i].p && !l->pool[i].busy) idle += l->pool[i].cap, n_idle++;
        if (!l->pool[i].p && !l->pool[i].dead && e < 0) e = i;
    }
    /* room only by dropping idle buffers (too small for this file): when that makes enough */
    if (cap > l->pool_limit || l->pool_used - idle + cap > l->pool_limit || (e < 0 && n_idle == 0)) return -1;
    for (int i = 0; i < POOL_MAX && (l->pool_used + cap > l->pool_limit || e < 0); i++)
        if (l->pool[i].p && !l->pool[i].busy) {
            pool_drop(l, i, false);
            if (e < 0 && !l->pool[i].dead) e = i;
        }
    if (e < 0 || l->pool_used + cap > l->pool_limit) return -1;
    ld_buf_t *b = &l->pool[e];
    if (!(b->p = huge_alloc(cap))) return -1;
    b->cap = cap;
    b->busy = true;
    l->pool_used += cap;
    if (l->fixed) {
        struct iovec iov = {.iov_base = b->p, .iov_len = cap};
        __u64 tag = 0;
        /* refused (RLIMIT_MEMLOCK without CAP_IPC_LOCK, say): plain reads into it */
        b->registered = cap <= ((size_t)1 << 30) && /* the kernel's bound on one registered buffer */
                        io_uring_register_buffers_update_tag(&l->ring, (unsigned)e, &iov, &tag, 1) == 1;
    }
    return e;
}

/* the buffer for F (LEN bytes): from the pool or its own; NULL when out of memory */
static void *file_buffer(lora_loader_t *l, ld_file_t *f, size_t len) {
    size_t need = round_up(len + 1, LORA_LOADER_ALIGN);
    char *p;
    f->buf = l->pool_limit ? pool_get(l, need) : -1;
    if (f->buf >= 0) {
        p = l->pool[f->buf].p;
        f->pub->registered = l->pool[f->buf].registered;
    } else if (need >= HUGE_BYTES) {
        p = huge_alloc(round_up(need, HUGE_BYTES));
    } else {
        p = aligned_alloc(LORA_LOADER_ALIGN, need);
    }
    return p; /* its padding is zeroed once the file is read (read_settled) */
}

/* F's buffer leaves the file: back to the pool (or, taken by the callback, out of it), or
 * freed */
static void put_data(lora_loader_t *l, ld_file_t *f) {
    if (!f->pub) return;
    if (f->buf >= 0) {
        ld_buf_t *b = &l->pool[f->buf];
        if (f->pub->data == b->p) b->busy = false;
        else pool_drop(l, f->buf, true);
        f->buf = -1;
    } else {
        free(f->pub->data);
    }
    f->pub->data = NULL;
}

static void file_finish(lora_loader_t *l, ld_file_t *f) {
    f->state = F_DONE;
    f->job->n_done++;
}

/* A read finished or failed: close once nothing of this file is in flight any more. */
static void read_settled(lora_loader_t *l, ld_file_t *f) {
    if (f->reads == 0 && (f->pub->status != CS_OK || f->done_bytes == f->pub->len)) {
        f->state = F_NEED_CLOSE;
        if (f->pub->status != CS_OK) {
            drop_data(l, f);
        } else if (f->pub->data) { /* an O_DIRECT read of the last block brings the block whole,
                                    * past the end as the file system has it: zero the padding */
            size_t len = f->pub->len;
            memset((char *)f->pub->data + len, 0, round_up(len + 1, LORA_LOADER_ALIGN) - len);
        }
    }
}

/* Clear O_DIRECT on F's descriptor: reads in flight keep their mode, new ones are buffered.
 * false (F failed, with the reason) when fcntl refuses. */
static bool buffered_fd(ld_file_t *f) {
    int fl = fcntl(f->fd, F_GETFL);
    if (fl < 0 || fcntl(f->fd, F_SETFL, fl & ~O_DIRECT) < 0) {
        file_fail(f, -errno, "fcntl(F_SETFL, no O_DIRECT)", __LINE__);
        return false;
    }
    f->direct = false;
    f->pub->direct = false;
    return true;
}

static void complete(lora_loader_t *l, ld_op_t *op, int res) {
    if (op->kind == OP_TIMER) {
        ld_timer_t *t = (ld_timer_t *)op, **pp = &l->timers_armed;
        while (*pp != t) pp = &(*pp)->next;
        *pp = t->next;
        if (res == -ETIME || res == 0) t->fn(t->user);   /* -ECANCELED: dropped */
        free(t);
        return;
    }
    ld_file_t *f = op->f;
    if (l->refuse == 1 && op->kind == OP_OPEN && f->direct && res >= 0) {
        close(res);
        res = -EINVAL;
    } else if (l->refuse == 2 && op->kind == OP_READ && op->direct && res >= 0) {
        res = -EINVAL; /* what was read is read again */
    } else if (l->refuse == 3 && op->kind == OP_READ && op->direct && res > 1) {
        res = 1; /* short at offset + 1: the rest through the page cache */
    }
    if (l->fault_eio && op->kind == OP_READ && res >= 0 && strstr(f->pub->path, l->fault_eio) &&
        (!l->fault_while || access(l->fault_while, F_OK) == 0))
        res = -EIO;
    switch (op->kind) {
    case OP_OPEN:
        if (res == -EINVAL && f->direct) { /* no O_DIRECT on this file system: the page cache */
            f->direct = false;
            op->next = l->resubmit;
            l->resubmit = op;
            return;
        }
        op_put(l, op);
        if (res < 0) {
            file_fail(f, res, "openat", __LINE__);
            l->files_open--;
            file_finish(l, f);
            return;
        }
        f->fd = res;
        f->state = F_NEED_STATX;
        return;
    case OP_STATX: {
        op_put(l, op);
        if (res < 0) {
            file_fail(f, res, "statx", __LINE__);
            f->state = F_NEED_CLOSE;
            return;
        }
        if (!S_ISREG(f->stx.stx_mode)) {
            file_fail(f, -EISDIR, "not a regular file", __LINE__);
            f->state = F_NEED_CLOSE;
            return;
        }
        f->pub->len = (size_t)f->stx.stx_size;
        f->pub->data = file_buffer(l, f, f->pub->len);
        if (!f->pub->data) {
            f->pub->len = 0;
            file_fail(f, -ENOMEM, "buffer", __LINE__);
            f->state = F_NEED_CLOSE;
            return;
        }
        if (f->job->chunk) {
            f->n_chunks = (f->pub->len + l->chunk - 1) / l->chunk;
            if (!(f->issued = calloc(f->n_chunks ? f->n_chunks : 1, 1))) {
                drop_data(l, f);
                file_fail(f, -ENOMEM, "buffer", __LINE__);
                f->state = F_NEED_CLOSE;
                return;
            }
        }
        f->state = F_READING;
        f->pub->direct = f->direct;
        read_settled(l, f);    /* an empty file is read already */
        return;
    }
    case OP_READ:
        if (res == -EINVAL && op->direct && f->pub->status == CS_OK && (!f->direct || buffered_fd(f))) {
            /* the file system took O_DIRECT at open but not for reads (or an earlier read
             * found that out): the page cache from here */
            op->next = l->resubmit;
            l->resubmit = op;
            return;
        }
        if (res > 0) VALGRIND_MAKE_MEM_DEFINED((char *)f->pub->data + op->off, (size_t)res);
        if (res > 0 && (size_t)res > op->len) /* O_DIRECT past the end: the file grew since statx (the */
            res = (int)op->len;                 /* padding it wrote is zeroed when the file settles) */
        if (res == -EAGAIN || res == -EINTR || (res > 0 && (size_t)res < op->len && f->pub->status == CS_OK)) {
            if (res > 0) {
                f->done_bytes += (size_t)res;
                op->off += (size_t)res;
                op->len -= (size_t)res;
                /* O_DIRECT reads need an aligned offset: the rest through the page cache */
                if (f->direct && op->off % LORA_LOADER_ALIGN != 0 && !buffered_fd(f)) {
                    f->reads--;
                    op_put(l, op);
                    read_settled(l, f);
                    return;
                }
            }
            op->next = l->resubmit;         /* short read: the rest goes again */
            l->resubmit = op;
            return;
        }
        f->reads--;
        if (res < 0) file_fail(f, res, "read", __LINE__);
        else if (res == 0 && op->len > 0) file_fail(f, 0, "read", __LINE__); /* file shrank */
        else f->done_bytes += (size_t)res;
        if (f->job->chunk && f->pub->status == CS_OK) /* a streamed file's chunk is complete */
            f->job->chunk(f->job->user, f->pub, op->chunk, l->chunk);
        op_put(l, op);
        read_settled(l, f);
        return;
    case OP_CLOSE:
        op_put(l, op);
        if (res < 0) {
            file_fail(f, res, "close", __LINE__);
            drop_data(l, f);
        }
        l->files_open--;
        file_finish(l, f);
        return;
    default: CS_ASSERT(!"loader: bad completion");
    }
}

/* Call and free every active job whose files are all done. */
static void finish_jobs(lora_loader_t *l) {
    ld_job_t **pp = &l->active_head, *prev = NULL;
    while (*pp) {
        ld_job_t *j = *pp;
        if (j->n_done < j->n_files) {
            prev = j;
            pp = &j->next;
            continue;
        }
        *pp = j->next;
        if (l->active_tail == j) l->active_tail = prev;
        j->done(j->user, j->pub, j->n_files);
        job_free(l, j);
    }
}

static void cancel_job(lora_loader_t *l, ld_job_t *j) {
    for (size_t i = 0; i < j->n_files; i++) {
        ld_file_t *f = &j->files[i];
        if (f->state == F_DONE) continue;
        if (f->pub->status == CS_OK) {
            f->pub->status = CS_EIO;
            snprintf(f->pub->error, sizeof f->pub->error, "%s: loader shut down before the file was read",
                     f->pub->path);
        }
        drop_data(l, f);
    }
    j->done(j->user, j->pub, j->n_files);
    job_free(l, j);
}

static void *loader_main(void *arg) {
    lora_loader_t *l = arg;
    for (;;) {
        pthread_mutex_lock(&l->mu);
        bool stopping = l->stopping;
        ld_timer_t *timers = stopping ? NULL : l->timers_new;
        if (timers) l->timers_new = NULL;
        if (l->queue_head) {
            if (l->active_tail) l->active_tail->next = l->queue_head;
            else l->active_head = l->queue_head;
            l->active_tail = l->queue_tail;
            l->queue_head = l->queue_tail = NULL;
        }
        pthread_mutex_unlock(&l->mu);

        if (stopping) {
            /* nothing new starts; once no operation is in flight, unwind */
            while (l->resubmit) {
                ld_op_t *op = l->resubmit;
                l->resubmit = op->next;
                if (op->kind == OP_READ) op->f->reads--;
                op_put(l, op);
            }
            if (l->ops_used == 0) break;
        }
        issue(l, timers, stopping);
        int rc = io_uring_submit(&l->ring);
        if (rc == -EAGAIN || rc == -EBUSY || rc == -EINTR) {
            usleep(1000);   /* kernel short of resources: the SQEs stay queued, retry */
            continue;
        }
        if (rc < 0) URING_FATAL("io_uring_submit", rc);

        struct io_uring_cqe *cqe;
        unsigned head, n = 0;
        io_uring_for_each_cqe(&l->ring, head, cqe) {
            complete(l, io_uring_cqe_get_data(cqe), cqe->res);
            n++;
        }
        io_uring_cq_advance(&l->ring, n);
        finish_jobs(l);
        if (n) continue;
        /* nothing completed: sleep until a completion or a submit writes the eventfd (a
         * completion posted since the peek above has already written it) */
        struct pollfd pfd = { .fd = l->efd, .events = POLLIN };
        if (poll(&pfd, 1, -1) < 0 && errno != EINTR) {
            cs_log("%s:%d: poll(eventfd): %s", __FILE__, __LINE__, strerror(errno));
            abort();
        }
        uint64_t cnt;
        if (read(l->efd, &cnt, sizeof cnt) < 0) { /* EAGAIN: another wake-up got it first */ }
    }
    /* stopping, nothing in flight: close what is open, cancel the rest */
    for (ld_job_t *j = l->active_head; j; j = j->next)
        for (size_t i = 0; i < j->n_files; i++) {
            ld_file_t *f = &j->files[i];
            if (f->state != F_DONE && f->state != F_QUEUED && f->fd >= 0) close(f->fd);
        }
    while (l->active_head) {
        ld_job_t *j = l->active_head;
        l->active_head = j->next;
        cancel_job(l, j);
    }
    l->active_tail = NULL;
    return NULL;
}

int lora_loader_init(const lora_loader_params_t *p, lora_loader_t **out) {
    int rc = CS_OK;
    *out = NULL;
    lora_loader_t *l = calloc(1, sizeof *l);
    if (!l) return cs_error_set(CS_ENOMEM, "loader: out of memory");
    l->efd = -1;
    l->qd = p && p->queue_depth ? p->queue_depth : 16;
    l->chunk = p && p->chunk_bytes ? p->chunk_bytes : (size_t)1 << 20;
    l->buffered = p && p->buffered;
    l->refuse = p ? p->test_refuse_direct : 0;
    /* fault injection for the reliability tests (tests/test_faults.py): a disk that answers
     * reads with EIO, as the kernel reports a media error; nothing else changes */
    l->fault_eio = getenv("CS_FAULT_EIO_PATH");
    if (l->fault_eio && !*l->fault_eio) l->fault_eio = NULL;
    l->fault_while = getenv("CS_FAULT_EIO_WHILE");
    /* and a disk that stops a streamed file part way until told to go on (test_cold_start.py)
     * in chunks of CS_FAULT_LOAD_CHUNK bytes */
    l->hold_path = getenv("CS_FAULT_HOLD_PATH");
    if (l->hold_path && !*l->hold_path) l->hold_path = NULL;
    l->hold_chunks = getenv("CS_FAULT_HOLD_CHUNKS") ? strtoull(getenv("CS_FAULT_HOLD_CHUNKS"), NULL, 10) : 0;
    l->hold_while = getenv("CS_FAULT_HOLD_WHILE");
    if (getenv("CS_FAULT_LOAD_CHUNK") && strtoull(getenv("CS_FAULT_LOAD_CHUNK"), NULL, 10) > 0)
        l->chunk = strtoull(getenv("CS_FAULT_LOAD_CHUNK"), NULL, 10);
    l->pool_limit = p && p->no_pool ? 0 : p && p->pool_bytes ? p->pool_bytes : POOL_BYTES_DEFAULT;
    if (l->qd < 1 || l->qd > 256 || l->chunk % LORA_LOADER_ALIGN != 0 || l->chunk > (1u << 30)) {
        rc = cs_error_set(CS_EINVAL, "loader: queue_depth %d (1..256) or chunk_bytes %zu (a multiple of %d) out of range",
                          l->qd, l->chunk, LORA_LOADER_ALIGN);
        goto err;
    }
    pthread_mutex_init(&l->mu, NULL);
    if (!(l->ops = calloc((size_t)l->qd, sizeof *l->ops))) {
        rc = cs_error_set(CS_ENOMEM, "loader: out of memory");
        goto err;
    }
    for (int i = 0; i < l->qd; i++) {
        l->ops[i].next = l->free_ops;
        l->free_ops = &l->ops[i];
    }
    if ((l->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) < 0) {
        rc = cs_error_set(CS_EIO, "%s:%d: eventfd: %s", __FILE__, __LINE__, strerror(errno));
        goto err;
    }
    if ((rc = URING_CHECK(io_uring_queue_init((unsigned)l->qd, &l->ring, 0))) < 0) goto err;
    l->ring_ok = true;
    if ((rc = URING_CHECK(io_uring_register_eventfd(&l->ring, l->efd))) < 0) goto err;
    /* a table for the pool's registered buffers (best effort: an old kernel reads without) */
    l->fixed = l->pool_limit && io_uring_register_buffers_sparse(&l->ring, POOL_MAX) == 0;
    int prc = pthread_create(&l->thread, NULL, loader_main, l);
    if (prc != 0) {
        rc = cs_error_set(CS_ENOMEM, "loader: pthread_create: %s", strerror(prc));
        goto err;
    }
    l->thread_ok = true;
    *out = l;
    return CS_OK;
err:
    lora_loader_free(l);
    return rc;
}

void lora_loader_free(lora_loader_t *l) {
    if (!l) return;
    if (l->thread_ok) {
        pthread_mutex_lock(&l->mu);
        l->stopping = true;
        pthread_mutex_unlock(&l->mu);
        uint64_t one = 1;
        if (write(l->efd, &one, sizeof one) < 0) { /* the counter is already non-zero: awake */ }
        pthread_join(l->thread, NULL);
        pthread_mutex_lock(&l->mu);
        ld_job_t *q = l->queue_head;    /* submitted after the thread last looked */
        l->queue_head = l->queue_tail = NULL;
        pthread_mutex_unlock(&l->mu);
        while (q) {
            ld_job_t *j = q;
            q = j->next;
            cancel_job(l, j);
        }
    }
    if (l->ring_ok) io_uring_queue_exit(&l->ring);   /* cancels armed timers */
    ld_timer_t *lists[2] = { l->timers_armed, l->timers_new };
    for (int k = 0; k < 2; k++)
        for (ld_timer_t *t = lists[k], *nx; t; t = nx) {
            nx = t->next;
            free(t);
        }
    if (l->efd >= 0) close(l->efd);
    pthread_mutex_destroy(&l->mu);
    for (int i = 0; i < POOL_MAX; i++) free(l->pool[i].p);
    free(l->ops);
    free(l);
}

static int submit(lora_loader_t *l, const char *const *paths, size_t n, lora_loader_chunk_fn chunk,
                  lora_loader_done_fn done, void *user) {
    CS_ASSERT(done && (paths || n == 0));
    ld_job_t *j = calloc(1, sizeof *j);
    if (!j || !(j->files = calloc(n ? n : 1, sizeof *j->files)) || !(j->pub = calloc(n ? n : 1, sizeof *j->pub))) {
        job_free(l, j);
        return cs_error_set(CS_ENOMEM, "loader: out of memory");
    }
    j->n_files = n;
    j->chunk = chunk;
    j->done = done;
    j->user = user;
    for (size_t i = 0; i < n; i++) { /* all of them first: job_free may see any */
        j->files[i] = (ld_file_t){ .job = j, .pub = &j->pub[i], .state = F_QUEUED, .fd = -1, .buf = -1 };
        j->pub[i].priv = &j->files[i];
    }
    for (size_t i = 0; i < n; i++) {
        if (!(j->pub[i].path = strdup(paths[i]))) {
            job_free(l, j);
            return cs_error_set(CS_ENOMEM, "loader: out of memory");
        }
    }
    pthread_mutex_lock(&l->mu);
    if (l->stopping) {
        pthread_mutex_unlock(&l->mu);
        job_free(l, j);
        return cs_error_set(CS_EINVAL, "loader: shutting down");
    }
    if (l->queue_tail) l->queue_tail->next = j;
    else l->queue_head = j;
    l->queue_tail = j;
    pthread_mutex_unlock(&l->mu);
    uint64_t one = 1;
    if (write(l->efd, &one, sizeof one) < 0) { /* EAGAIN: the counter is already non-zero */ }
    return CS_OK;
}

int lora_loader_submit(lora_loader_t *l, const char *const *paths, size_t n, lora_loader_done_fn done,
                       void *user) {
    return submit(l, paths, n, NULL, done, user);
}

int lora_loader_submit_stream(lora_loader_t *l, const char *path, lora_loader_chunk_fn chunk,
                              lora_loader_done_fn done, void *user) {
    CS_ASSERT(chunk);
    return submit(l, &path, 1, chunk, done, user);
}

int lora_loader_reorder(lora_file_t *file, const size_t *order, size_t n) {
    ld_file_t *f = file->priv;
    size_t *o = malloc(sizeof *o * (n ? n : 1));
    if (!o) return cs_error_set(CS_ENOMEM, "loader: out of memory");
    memcpy(o, order, sizeof *o * n);
    free(f->order);
    f->order = o;
    f->n_order = n;
    f->order_at = 0;
    return CS_OK;
}

int lora_loader_timer(lora_loader_t *l, unsigned ms, lora_loader_timer_fn fn, void *user) {
    CS_ASSERT(fn);
    ld_timer_t *t = calloc(1, sizeof *t);
    if (!t) return cs_error_set(CS_ENOMEM, "loader: out of memory");
    t->kind = OP_TIMER;
    t->ts.tv_sec = ms / 1000;
    t->ts.tv_nsec = (long long)(ms % 1000) * 1000000;
    t->fn = fn;
    t->user = user;
    pthread_mutex_lock(&l->mu);
    if (l->stopping) {
        pthread_mutex_unlock(&l->mu);
        free(t);
        return cs_error_set(CS_EINVAL, "loader: shutting down");
    }
    t->next = l->timers_new;
    l->timers_new = t;
    pthread_mutex_unlock(&l->mu);
    uint64_t one = 1;
    if (write(l->efd, &one, sizeof one) < 0) { /* EAGAIN: the counter is already non-zero */ }
    return CS_OK;
}
