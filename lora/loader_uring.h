/* loader_uring.h: the adapter loader thread. Callers queue jobs (a few files each, read
 * whole); one thread runs every queued job's files through a single io_uring at once:
 * openat (O_DIRECT where the file system allows it), statx, then chunked reads into
 * 4096-aligned buffers with up to queue_depth operations in flight across all files, then
 * close. The caller never touches the disk:
 * lora_loader_submit only queues, and the job's done callback runs on the loader thread.
 * Timers (lora_loader_timer) run on the same thread.
 * Used by lora/registry.c; kept free of adapter semantics so an HTTP upload path or a
 * device-slot stage can queue jobs of its own. */
#ifndef CS_LORA_LOADER_URING_H
#define CS_LORA_LOADER_URING_H

#include "base/common.h"

#define LORA_LOADER_ALIGN 4096

typedef struct lora_loader lora_loader_t;

typedef struct lora_loader_params {
    int queue_depth;        /* operations in flight at once (1..256; 8..32 is right for
                             * NVMe); 0 = 16 */
    size_t chunk_bytes;     /* bytes per read, a multiple of 4096; 0 = 1 MiB */
    bool buffered;          /* read through the page cache only. Otherwise (the default)
                             * files are opened O_DIRECT: reads go from the device into the
                             * buffer with no page-cache copy and leave the cache alone; a file
                             * system that refuses O_DIRECT (EINVAL at open or at a read: tmpfs,
                             * some FUSE and network file systems) gets buffered reads for
                             * that file, without error */
    size_t pool_bytes;      /* read buffers kept for reuse (files from 2 MiB up): at most this
                             * many bytes, in at most 8 buffers, each registered with the ring
                             * (READ_FIXED) where the kernel and RLIMIT_MEMLOCK allow; 0 = 256 MiB.
                             * Held (and pinned, when registered) for the loader's lifetime */
    bool no_pool;           /* a fresh buffer for every file (nothing kept, nothing registered) */
    int test_refuse_direct; /* tests only: 1 = act as if openat refused O_DIRECT, 2 = as if
                             * every O_DIRECT read did (EINVAL), 3 = as if an O_DIRECT read
                             * came back short at an unaligned offset */
} lora_loader_params_t;

/* One file of a job, as the done callback sees it. */
typedef struct lora_file {
    const char *path;
    void *data;             /* len bytes, LORA_LOADER_ALIGN-aligned, NUL after the last byte
                             * (zero-filled up to a multiple of the alignment). The callback
                             * may take it by setting data = NULL (then free() it); what is
                             * left after the callback returns goes back to the loader (its
                             * pool, or freed): a callback that only reads it lets the next
                             * load reuse the memory. NULL on error. */
    size_t len;
    bool direct;            /* every byte came by O_DIRECT (no page cache) */
    bool registered;        /* its reads went into a pooled buffer registered with the ring */
    int status;             /* CS_OK, or CS_ENOTFOUND (no such file), CS_EIO, CS_ENOMEM */
    char error[384];        /* with status != CS_OK: what failed, naming the file */
    void *priv;             /* the loader's */
} lora_file_t;

/* Called exactly once per submitted job: from the loader thread when all its files are
 * read or failed, or from lora_loader_free for jobs that never finished (every file then
 * has status CS_EIO, "loader shut down"). Must not call lora_loader_free; may submit. */
typedef void (*lora_loader_done_fn)(void *user, lora_file_t *files, size_t n_files);

/* Set up the ring (checked: an error names the io_uring call, file and line) and start
 * the thread. p may be NULL for the defaults. */
int lora_loader_init(const lora_loader_params_t *p, lora_loader_t **out);

/* Stop the thread: operations in flight are waited for, queued and unfinished jobs get
 * their done callback with CS_EIO. Then frees everything. NULL does nothing. */
void lora_loader_free(lora_loader_t *l);

/* Queue a job reading the N files PATHS (copied) whole; DONE(USER, ...) reports it. Never
 * blocks on I/O (takes a mutex and writes an eventfd); callable from any thread, including
 * from a done callback. CS_ENOMEM, or CS_EINVAL after lora_loader_free has begun. */
int lora_loader_submit(lora_loader_t *l, const char *const *paths, size_t n,
                       lora_loader_done_fn done, void *user);

/* A file streamed as it is read (the cold start: an adapter's layers are used as they
 * arrive): one file, read in chunks of chunk_bytes; after each chunk is in, CHUNK(USER, FILE,
 * INDEX, CHUNK_BYTES) runs on the loader thread, and from then on FILE->data holds bytes
 * [INDEX * CHUNK_BYTES, min(len, (INDEX + 1) * CHUNK_BYTES)) (other chunks may still be in
 * flight; FILE->len is the file's size from statx). Chunks go in file order unless a CHUNK
 * callback asks for another (lora_loader_reorder). DONE reports the whole file as for
 * lora_loader_submit; a chunk is reported only while the file has not failed. */
typedef void (*lora_loader_chunk_fn)(void *user, lora_file_t *file, size_t index, size_t chunk_bytes);
int lora_loader_submit_stream(lora_loader_t *l, const char *path, lora_loader_chunk_fn chunk,
                              lora_loader_done_fn done, void *user);
/* From a CHUNK callback of FILE: read the chunks ORDER[0..n) first, in that order (those
 * issued already are skipped), then what is left in file order. CS_ENOMEM. */
int lora_loader_reorder(lora_file_t *file, const size_t *order, size_t n);

/* Call FN(USER) from the loader thread after MS milliseconds (an io_uring timeout, so the
 * thread keeps serving files meanwhile). Timers still pending at lora_loader_free are
 * dropped without a call. Callable from any thread and from callbacks. CS_ENOMEM, or
 * CS_EINVAL after lora_loader_free has begun. */
typedef void (*lora_loader_timer_fn)(void *user);
int lora_loader_timer(lora_loader_t *l, unsigned ms, lora_loader_timer_fn fn, void *user);

#endif
