/* safetensors.h: memory-mapped reader (and a small writer) for Hugging Face safetensors
 * files (or buffers already in memory), single or sharded through model.safetensors.index.json. The header is validated
 * fully before any tensor is handed out: offsets in bounds, no overlap, dtype x shape ==
 * byte size; every error names the file and the tensor. */
#ifndef CS_SAFETENSORS_H
#define CS_SAFETENSORS_H

#include "base/common.h"

#define ST_MAX_DIMS 8

#define ST_MAX_HEADER (100u * 1000u * 1000u) /* header JSON cap, as the Python library */

typedef struct st_tensor {
    const char *name;
    cs_dtype dtype;
    int n_dims;
    int64_t shape[ST_MAX_DIMS];
    const void *data;   /* points into the mapping; aligned to the element size only if the
                         * writer aligned it (ours and the Python library's do) */
    size_t nbytes;
    size_t shard;       /* which file of a sharded checkpoint holds it (0 for one file) */
} st_tensor_t;

typedef struct safetensors safetensors_t;

/* One .safetensors file. */
int safetensors_open(const char *path, safetensors_t **out);
/* A model directory: model.safetensors.index.json (sharded) if present, else
 * model.safetensors. `basename` is "model" for models, "adapter_model" for PEFT. */
int safetensors_open_dir(const char *dir, const char *basename, safetensors_t **out);
/* How a file's bytes come in: mapped (ST_MMAP: the page cache in place, shared with other
 * processes), or read into the process's own memory in 2 MiB transparent huge pages
 * (ST_COPY_HUGE: one page-table entry per 2 MiB for the kernels that stream the weights;
 * the kernel may still give 4 KiB pages, safetensors_copied_bytes says how many it did not). */
typedef enum { ST_MMAP, ST_COPY_HUGE } st_load_t;
int safetensors_open_dir_how(const char *dir, const char *basename, st_load_t how, safetensors_t **out);
/* ST_COPY_HUGE's read, for the other weight formats' readers (gguf.c): SIZE bytes of FD into
 * fresh anonymous memory aligned to 2 MiB and asked for huge pages, read in parts on up to 8
 * threads, then made read-only. *copy and *copy_len (a multiple of 2 MiB) are set as soon as
 * the memory exists, also on an error (the caller unmaps them); *huge: the bytes in huge pages. */
int safetensors_read_huge(int fd, size_t size, const char *path, void **copy, size_t *copy_len, size_t *huge);
/* bytes read in by ST_COPY_HUGE (0 when mapped); *huge (may be NULL): of those, in huge pages */
size_t safetensors_copied_bytes(const safetensors_t *st, size_t *huge);
/* Give back the memory of [p, p + n), which must lie in one file's mapping or copy (0
 * otherwise): the whole pages inside it are dropped and made inaccessible (a read faults),
 * for tensors a backend no longer reads (a weight kept in a form of its own). Returns the
 * bytes released; safetensors_released_bytes sums them. */
size_t safetensors_release(safetensors_t *st, const void *p, size_t n);
size_t safetensors_released_bytes(const safetensors_t *st);
/* the kernel offers transparent huge pages to MADV_HUGEPAGE (its mode is always or madvise) */
bool safetensors_huge_pages_offered(void);
/* One safetensors file already in memory (read by the io_uring loader, received over
 * HTTP): the same validation as safetensors_open, messages name `label` (the path it came
 * from). Tensors point into `buf`, which must stay valid until safetensors_free. With
 * take_ownership, `buf` (from malloc / cs_aligned_alloc) is free()d by safetensors_free, or
 * by this function when it fails; without, the caller keeps it. */
int safetensors_open_buffer(const char *label, void *buf, size_t len, bool take_ownership,
                            safetensors_t **out);
void safetensors_free(safetensors_t *st);

/* Tensors in header order, shard after shard (shards in order of first mention in the
 * index). Names are unique across shards. */
size_t safetensors_count(const safetensors_t *st);
const st_tensor_t *safetensors_at(const safetensors_t *st, size_t i);
const st_tensor_t *safetensors_find(const safetensors_t *st, const char *name); /* NULL if absent */
/* __metadata__ string value, NULL if absent */
const char *safetensors_metadata(const safetensors_t *st, const char *key);

/* Writer: tensors are written in the order given, data contiguous, 8-byte aligned header. */
typedef struct st_write_tensor {
    const char *name;
    cs_dtype dtype;
    int n_dims;
    int64_t shape[ST_MAX_DIMS];
    const void *data;
} st_write_tensor_t;
int safetensors_write(const char *path, const st_write_tensor_t *t, size_t n,
                      const char *const *metadata_kv /* key,value,...,NULL or NULL */);
/* Streaming variant for files larger than memory: `data` is ignored and fill(user, i, buf,
 * nbytes) writes tensor i's bytes into buf (a nonzero return aborts with that status).
 * The file appears atomically (written to a temporary name, then renamed). */
typedef int (*st_fill_fn)(void *user, size_t i, void *buf, size_t nbytes);
int safetensors_write_cb(const char *path, const st_write_tensor_t *t, size_t n,
                         const char *const *metadata_kv, st_fill_fn fill, void *user);
/* Bytes of a tensor of this dtype and shape; 0 with *ok = false on overflow. */
size_t safetensors_nbytes(cs_dtype dtype, int n_dims, const int64_t *shape, bool *ok);

#endif
