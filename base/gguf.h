/* gguf.h: a reader for GGUF files (llama.cpp's model format, versions 2 and 3, little-endian):
 * the metadata (typed key-value pairs) and the tensor table, validated fully before anything is
 * handed out: every count, length and offset in bounds, sizes without overflow, keys and tensor
 * names unique, each tensor's bytes (its type's block size times its shape) inside the data
 * section at the alignment the file declares. Every error names the file and what is wrong. */
#ifndef CS_GGUF_H
#define CS_GGUF_H

#include "base/common.h"
#include "base/safetensors.h" /* st_load_t */

/* metadata value types, as the file numbers them */
typedef enum gguf_type {
    GGUF_UINT8 = 0, GGUF_INT8 = 1, GGUF_UINT16 = 2, GGUF_INT16 = 3, GGUF_UINT32 = 4, GGUF_INT32 = 5,
    GGUF_FLOAT32 = 6, GGUF_BOOL = 7, GGUF_STRING = 8, GGUF_ARRAY = 9, GGUF_UINT64 = 10, GGUF_INT64 = 11,
    GGUF_FLOAT64 = 12,
} gguf_type;

#define GGUF_MAX_DIMS 4

typedef struct gguf_tensor {
    const char *name;       /* NUL-terminated copy */
    uint32_t ggml_type;     /* the file's type id */
    const char *type_name;  /* ggml's name of it: "Q4_K", "IQ2_XXS", ... */
    cs_dtype dtype;         /* the type as a cs_dtype; CS_DTYPE_COUNT where caraserve has none
                             * (a type the reader knows the size of but nothing computes with) */
    int n_dims;
    int64_t ne[GGUF_MAX_DIMS]; /* ggml order: ne[0] is the row (contiguous); 1 past n_dims */
    const void *data;
    size_t nbytes;
} gguf_tensor_t;

typedef struct gguf gguf_t;

/* A file, mapped (ST_MMAP) or read into huge pages (ST_COPY_HUGE), as safetensors_open_dir_how. */
int gguf_open(const char *path, st_load_t how, gguf_t **out);
/* A file already in memory (kept by the caller until gguf_free); messages name label. */
int gguf_open_buffer(const char *label, const void *buf, size_t len, gguf_t **out);
void gguf_free(gguf_t *g);
const char *gguf_path(const gguf_t *g);
uint32_t gguf_version(const gguf_t *g);
size_t gguf_alignment(const gguf_t *g);
/* bytes read into the process's memory (0 when mapped); *huge (may be NULL): of those in huge pages */
size_t gguf_copied_bytes(const gguf_t *g, size_t *huge);

/* ---- tensors, in file order ---- */
size_t gguf_n_tensors(const gguf_t *g);
const gguf_tensor_t *gguf_tensor_at(const gguf_t *g, size_t i);
const gguf_tensor_t *gguf_find_tensor(const gguf_t *g, const char *name); /* NULL if absent */

/* ---- metadata ---- */
size_t gguf_n_kv(const gguf_t *g);
const char *gguf_key_at(const gguf_t *g, size_t i);
int gguf_find_key(const gguf_t *g, const char *key); /* its index, -1 if absent */
gguf_type gguf_kv_type(const gguf_t *g, int i); /* i < gguf_n_kv (asserted) */
/* The typed getters: true with *out set when the key is present with a value of a type that
 * converts without loss (any integer type for u32/u64/i64 when the value fits; FLOAT32 or
 * FLOAT64 for f64, or an integer a double holds exactly; BOOL for bool); false when absent.
 * A present key of the wrong type or range is an error: they return false and set cs_error
 * (CS_EINVAL) naming the key and what it holds, and *bad (may be NULL) is set true. */
bool gguf_get_u32(const gguf_t *g, const char *key, uint32_t *out, bool *bad);
bool gguf_get_i64(const gguf_t *g, const char *key, int64_t *out, bool *bad);
bool gguf_get_u64(const gguf_t *g, const char *key, uint64_t *out, bool *bad); /* a UINT64 past INT64_MAX */
bool gguf_get_f64(const gguf_t *g, const char *key, double *out, bool *bad);
bool gguf_get_bool(const gguf_t *g, const char *key, bool *out, bool *bad);
/* a STRING value: its bytes (not NUL-terminated in the file; this gives a NUL-terminated copy
 * made at open) and length (*len may be NULL) */
const char *gguf_get_str(const gguf_t *g, const char *key, size_t *len, bool *bad);
/* an ARRAY value: its element type and count. Numeric elements: *data points at the packed
 * little-endian values (not necessarily aligned: copy them out, gguf_arr_* below do). String
 * elements: use gguf_arr_str (*data is NULL). */
bool gguf_get_arr(const gguf_t *g, const char *key, gguf_type *elem, uint64_t *n, const void **data, bool *bad);
/* element i of an ARRAY of STRING: a NUL-terminated copy made at open (the bytes may hold a
 * NUL: *len, may be NULL, is the length); NULL when there is no such key, array or element */
const char *gguf_arr_str(const gguf_t *g, const char *key, uint64_t i, size_t *len);
double gguf_arr_num(gguf_type elem, const void *data, uint64_t i); /* element i of a numeric array */

/* ggml's name for a type id ("Q4_K"), NULL for an id it never had */
const char *gguf_ggml_type_name(uint32_t type);

#endif
