/* gguf.c: the GGUF reader. The whole file is checked at open, in one pass over the header,
 * before anything is handed out: a count or length is compared with the bytes left before
 * anything is allocated for it (a file's u64 says 2^62 tensors; the file has 300 bytes), and
 * sizes are computed with overflow checks, so a hostile file is refused, never trusted.
 * Keys, tensor names and strings are copied NUL-terminated; numbers stay in the file's bytes
 * and are read little-endian when asked for. */
#include "base/gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define GGUF_MAGIC "GGUF"
#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_MAX_NAME 64 /* ggml's GGML_MAX_NAME: a name and its NUL, so at most 63 bytes */

/* ggml's types by file id: elements per block, bytes per block. The ids that were removed
 * (4, 5, 31-33, 36-38) stay empty, so a file that uses them is refused as unknown. Sizes as
 * ggml's type traits (sizeof of each block struct); the gguf Python package has Q8_1 at 40,
 * an old layout with float d and s: ggml's block_q8_1 is two halves and 32 bytes, 36. */
typedef struct ggml_type_info {
    const char *name;
    uint32_t block, size;
    cs_dtype dtype;
} ggml_type_info_t;

#define T(id, nm, bl, sz, dt) [id] = { nm, bl, sz, dt }
static const ggml_type_info_t ggml_types[] = {
    T(0, "F32", 1, 4, CS_DTYPE_F32),           T(1, "F16", 1, 2, CS_DTYPE_F16),
    T(2, "Q4_0", 32, 18, CS_DTYPE_Q4_0),       T(3, "Q4_1", 32, 20, CS_DTYPE_Q4_1),
    T(6, "Q5_0", 32, 22, CS_DTYPE_Q5_0),       T(7, "Q5_1", 32, 24, CS_DTYPE_Q5_1),
    T(8, "Q8_0", 32, 34, CS_DTYPE_Q8_0),       T(9, "Q8_1", 32, 36, CS_DTYPE_COUNT),
    T(10, "Q2_K", 256, 84, CS_DTYPE_COUNT),    T(11, "Q3_K", 256, 110, CS_DTYPE_COUNT),
    T(12, "Q4_K", 256, 144, CS_DTYPE_Q4_K),    T(13, "Q5_K", 256, 176, CS_DTYPE_Q5_K),
    T(14, "Q6_K", 256, 210, CS_DTYPE_Q6_K),    T(15, "Q8_K", 256, 292, CS_DTYPE_COUNT),
    T(16, "IQ2_XXS", 256, 66, CS_DTYPE_COUNT), T(17, "IQ2_XS", 256, 74, CS_DTYPE_COUNT),
    T(18, "IQ3_XXS", 256, 98, CS_DTYPE_COUNT), T(19, "IQ1_S", 256, 50, CS_DTYPE_COUNT),
    T(20, "IQ4_NL", 32, 18, CS_DTYPE_COUNT),   T(21, "IQ3_S", 256, 110, CS_DTYPE_COUNT),
    T(22, "IQ2_S", 256, 82, CS_DTYPE_COUNT),   T(23, "IQ4_XS", 256, 136, CS_DTYPE_COUNT),
    T(24, "I8", 1, 1, CS_DTYPE_I8),            T(25, "I16", 1, 2, CS_DTYPE_I16),
    T(26, "I32", 1, 4, CS_DTYPE_I32),          T(27, "I64", 1, 8, CS_DTYPE_I64),
    T(28, "F64", 1, 8, CS_DTYPE_F64),          T(29, "IQ1_M", 256, 56, CS_DTYPE_COUNT),
    T(30, "BF16", 1, 2, CS_DTYPE_BF16),        T(34, "TQ1_0", 256, 54, CS_DTYPE_COUNT),
    T(35, "TQ2_0", 256, 66, CS_DTYPE_COUNT),   T(39, "MXFP4", 32, 17, CS_DTYPE_COUNT),
    T(40, "NVFP4", 64, 36, CS_DTYPE_COUNT),    T(41, "Q1_0", 128, 18, CS_DTYPE_COUNT),
};
#undef T

static const ggml_type_info_t *ggml_type_info(uint32_t type) {
    return type < CS_ARRAY_LEN(ggml_types) && ggml_types[type].name ? &ggml_types[type] : NULL;
}

const char *gguf_ggml_type_name(uint32_t type) {
    const ggml_type_info_t *t = ggml_type_info(type);
    return t ? t->name : NULL;
}

/* bytes of a scalar of this type, 0 for STRING, ARRAY and ids the format has not */
static size_t value_size(uint32_t t) {
    switch (t) {
    case GGUF_UINT8: case GGUF_INT8: case GGUF_BOOL: return 1;
    case GGUF_UINT16: case GGUF_INT16: return 2;
    case GGUF_UINT32: case GGUF_INT32: case GGUF_FLOAT32: return 4;
    case GGUF_UINT64: case GGUF_INT64: case GGUF_FLOAT64: return 8;
    default: return 0;
    }
}

static const char *value_type_name(uint32_t t) {
    static const char *const names[] = { "UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "FLOAT32",
                                         "BOOL", "STRING", "ARRAY", "UINT64", "INT64", "FLOAT64" };
    return t < CS_ARRAY_LEN(names) ? names[t] : "unknown";
}

static bool is_integer(gguf_type t) { return value_size(t) && t != GGUF_BOOL && t != GGUF_FLOAT32 && t != GGUF_FLOAT64; }

/* what a value is, for messages: "GGUF key 'k' is a string, not an integer" */
static const char *value_kind(gguf_type t) {
    if (is_integer(t)) return "an integer";
    switch (t) {
    case GGUF_FLOAT32: case GGUF_FLOAT64: return "a float";
    case GGUF_BOOL: return "a boolean";
    case GGUF_STRING: return "a string";
    default: return "an array";
    }
}

static uint64_t le(const uint8_t *p, size_t n) {
    uint64_t v = 0;
    for (size_t i = n; i-- > 0;) v = v << 8 | p[i];
    return v;
}

typedef struct gguf_kv {
    char *key;
    gguf_type type;
    gguf_type elem;         /* ARRAY: its elements' type */
    uint64_t n;             /* ARRAY: its elements */
    const uint8_t *val;     /* in the file: a number's bytes, a numeric array's packed elements */
    char *str;              /* STRING: a NUL-terminated copy; ARRAY of STRING: every element,
                             * each NUL-terminated, one after another */
    size_t len;             /* STRING: its bytes */
    uint64_t *soff;         /* ARRAY of STRING (n + 1): element i at str + soff[i], soff[i + 1] -
                             * soff[i] - 1 bytes, so gguf_arr_str is O(1) on 150k-token vocabularies */
} gguf_kv_t;

struct gguf {
    char *path;             /* the file, or the caller's label for a buffer */
    const uint8_t *buf;
    size_t len;
    void *map;              /* ST_MMAP: the file, PROT_READ */
    void *copy;             /* ST_COPY_HUGE: the file read into anonymous memory, copy_len bytes */
    size_t copy_len, copy_huge; /* copy_huge: of those, in 2 MiB pages (smaps) */
    uint32_t version;
    size_t alignment;
    gguf_kv_t *kv;
    size_t n_kv;
    gguf_tensor_t *tensors;
    size_t n_tensors;
    /* open-addressing tables of indices by FNV-1a of the name (SIZE_MAX: empty slot);
     * capacity a power of two at least twice the count */
    size_t *kv_slots, kv_mask;
    size_t *tensor_slots, tensor_mask;
};

/* ---------------------------------------------------------------- reading the header ---- */

typedef struct rd {
    const gguf_t *g;
    const uint8_t *p;
    size_t len, at;
} rd_t;

static size_t rd_left(const rd_t *r) { return r->len - r->at; }

/* n more bytes, or the error that the file ends first; `what` says what was being read */
static int rd_need(rd_t *r, size_t n, const char *what) {
    if (n > rd_left(r))
        return cs_error_set(CS_EFORMAT, "%s: truncated: %s at byte %zu needs %zu bytes, %zu remain", r->g->path,
                            what, r->at, n, rd_left(r));
    return CS_OK;
}

static int rd_uint(rd_t *r, size_t n, uint64_t *v, const char *what) {
    int rc = rd_need(r, n, what);
    if (rc) return rc;
    *v = le(r->p + r->at, n);
    r->at += n;
    return CS_OK;
}

static int rd_u32(rd_t *r, uint32_t *v, const char *what) {
    uint64_t x;
    int rc = rd_uint(r, 4, &x, what);
    *v = (uint32_t)x;
    return rc;
}

/* a string's length and bytes (in the file, not copied) */
static int rd_str(rd_t *r, const uint8_t **s, size_t *n, const char *what) {
    uint64_t len;
    int rc = rd_uint(r, 8, &len, what);
    if (rc) return rc;
    if (len > rd_left(r))
        return cs_error_set(CS_EFORMAT, "%s: %s: a string of %" PRIu64 " bytes at byte %zu, %zu bytes remain",
                            r->g->path, what, len, r->at, rd_left(r));
    *s = r->p + r->at;
    *n = (size_t)len;
    r->at += *n;
    return CS_OK;
}

static char *dup_bytes(const uint8_t *s, size_t n) {
    char *c = malloc(n + 1);
    if (!c) return NULL;
    if (n) memcpy(c, s, n);
    c[n] = 0;
    return c;
}

/* a key or tensor name: copied, and refused when it holds a NUL (it could not be looked up) */
static int rd_name(rd_t *r, char **out, size_t *n, const char *what) {
    const uint8_t *s;
    int rc = rd_str(r, &s, n, what);
    if (rc) return rc;
    if (memchr(s, 0, *n))
        return cs_error_set(CS_EFORMAT, "%s: %s holds a NUL byte", r->g->path, what);
    if (!(*out = dup_bytes(s, *n))) return cs_error_set(CS_ENOMEM, "%s: out of memory", r->g->path);
    return CS_OK;
}

static int check_bools(const gguf_t *g, const gguf_kv_t *kv, const uint8_t *p, uint64_t n) {
    for (uint64_t i = 0; i < n; i++)
        if (p[i] > 1)
            return cs_error_set(CS_EFORMAT, "%s: key '%s': a BOOL holds %u (0 or 1)", g->path, kv->key, p[i]);
    return CS_OK;
}

/* an array of strings: the lengths checked in a first pass, then copied into one block */
static int read_str_array(rd_t *r, gguf_kv_t *kv, const char *what) {
    const gguf_t *g = r->g;
    /* each element takes at least its 8-byte length: a larger count cannot be in the file */
    if (kv->n > rd_left(r) / 8)
        return cs_error_set(CS_EFORMAT, "%s: key '%s': an array of %" PRIu64 " strings, more than the %zu bytes left hold",
                            g->path, kv->key, kv->n, rd_left(r));
    size_t start = r->at, total = 0;
    for (uint64_t i = 0; i < kv->n; i++) {
        const uint8_t *s;
        size_t n;
        int rc = rd_str(r, &s, &n, what);
        if (rc) return rc;
        total += n + 1; /* fits: n + 1 <= 8 + n, the bytes this element took in the file */
    }
    kv->soff = malloc((size_t)(kv->n + 1) * sizeof *kv->soff);
    kv->str = malloc(total ? total : 1);
    if (!kv->soff || !kv->str) return cs_error_set(CS_ENOMEM, "%s: key '%s': out of memory", g->path, kv->key);
    r->at = start;
    size_t o = 0;
    for (uint64_t i = 0; i < kv->n; i++) {
        const uint8_t *s;
        size_t n;
        (void)rd_str(r, &s, &n, what); /* read above */
        kv->soff[i] = o;
        if (n) memcpy(kv->str + o, s, n);
        kv->str[o + n] = 0;
        o += n + 1;
    }
    kv->soff[kv->n] = o;
    return CS_OK;
}

static int read_value(rd_t *r, gguf_kv_t *kv) {
    const gguf_t *g = r->g;
    int rc;
    char what[128];
    snprintf(what, sizeof what, "key '%s'", kv->key);
    size_t sz = value_size(kv->type);
    if (sz) {
        if ((rc = rd_need(r, sz, what))) return rc;
        kv->val = r->p + r->at;
        r->at += sz;
        return kv->type == GGUF_BOOL ? check_bools(g, kv, kv->val, 1) : CS_OK;
    }
    if (kv->type == GGUF_STRING) {
        const uint8_t *s;
        if ((rc = rd_str(r, &s, &kv->len, what))) return rc;
        if (!(kv->str = dup_bytes(s, kv->len))) return cs_error_set(CS_ENOMEM, "%s: out of memory", g->path);
        return CS_OK;
    }
    if (kv->type != GGUF_ARRAY)
        return cs_error_set(CS_EFORMAT, "%s: key '%s' has unknown value type %u", g->path, kv->key, (unsigned)kv->type);
    uint32_t elem;
    if ((rc = rd_u32(r, &elem, what))) return rc;
    /* ggml refuses them too: no model has one, and a reader of them needs a depth limit */
    if (elem == GGUF_ARRAY)
        return cs_error_set(CS_EFORMAT, "%s: key '%s': arrays of arrays are not supported", g->path, kv->key);
    if (elem != GGUF_STRING && !value_size(elem))
        return cs_error_set(CS_EFORMAT, "%s: key '%s': an array of unknown value type %u", g->path, kv->key, elem);
    kv->elem = (gguf_type)elem;
    if ((rc = rd_uint(r, 8, &kv->n, what))) return rc;
    if (elem == GGUF_STRING) return read_str_array(r, kv, what);
    sz = value_size(elem);
    if (kv->n > rd_left(r) / sz)
        return cs_error_set(CS_EFORMAT, "%s: key '%s': an array of %" PRIu64 " %s needs more than the %zu bytes left",
                            g->path, kv->key, kv->n, value_type_name(elem), rd_left(r));
    kv->val = r->p + r->at;
    r->at += (size_t)kv->n * sz;
    return elem == GGUF_BOOL ? check_bools(g, kv, kv->val, kv->n) : CS_OK;
}

/* ------------------------------------------------------------- the name tables ---- */

typedef const char *(*name_fn)(const gguf_t *g, size_t i);
static const char *kv_name(const gguf_t *g, size_t i) { return g->kv[i].key; }
static const char *tensor_name(const gguf_t *g, size_t i) { return g->tensors[i].name; }

static size_t *slot_of(size_t *slots, size_t mask, const gguf_t *g, name_fn name, const char *s) {
    for (size_t h = (size_t)cs_hash_str(s) & mask;; h = (h + 1) & mask)
        if (slots[h] == SIZE_MAX || strcmp(name(g, slots[h]), s) == 0) return &slots[h];
}

/* the table of n names; a name seen twice is refused (`what`: "key", "tensor name") */
static int build_index(gguf_t *g, size_t n, name_fn name, const char *what, size_t **slots, size_t *mask) {
    size_t cap = 8;
    while (cap < 2 * n) cap *= 2;
    if (!(*slots = malloc(cap * sizeof **slots))) return cs_error_set(CS_ENOMEM, "%s: out of memory", g->path);
    memset(*slots, 0xff, cap * sizeof **slots);
    *mask = cap - 1;
    for (size_t i = 0; i < n; i++) {
        size_t *s = slot_of(*slots, *mask, g, name, name(g, i));
        if (*s != SIZE_MAX) return cs_error_set(CS_EFORMAT, "%s: duplicate %s '%s'", g->path, what, name(g, i));
        *s = i;
    }
    return CS_OK;
}

/* ------------------------------------------------------------------ the header ---- */

static int read_tensor_info(rd_t *r, gguf_tensor_t *t, uint64_t *offset) {
    const gguf_t *g = r->g;
    int rc;
    size_t nlen;
    char *name;
    char what[96];
    snprintf(what, sizeof what, "the name of tensor %zu", (size_t)(t - g->tensors));
    if ((rc = rd_name(r, &name, &nlen, what))) return rc;
    t->name = name;
    if (nlen >= GGUF_MAX_NAME)
        return cs_error_set(CS_EFORMAT, "%s: tensor '%s': a name of %zu bytes is too long (ggml's limit is %d)",
                            g->path, name, nlen, GGUF_MAX_NAME - 1);
    snprintf(what, sizeof what, "tensor '%s'", name);
    uint32_t n_dims, type;
    if ((rc = rd_u32(r, &n_dims, what))) return rc;
    if (n_dims < 1 || n_dims > GGUF_MAX_DIMS)
        return cs_error_set(CS_EFORMAT, "%s: tensor '%s' has %u dimensions (1 to %d)", g->path, name, n_dims,
                            GGUF_MAX_DIMS);
    t->n_dims = (int)n_dims;
    int64_t elems = 1;
    for (int d = 0; d < GGUF_MAX_DIMS; d++) {
        uint64_t ne = 1;
        if (d < t->n_dims && (rc = rd_uint(r, 8, &ne, what))) return rc;
        if (ne > INT64_MAX)
            return cs_error_set(CS_EFORMAT, "%s: tensor '%s': dimension %d is negative", g->path, name, d);
        t->ne[d] = (int64_t)ne;
        if (__builtin_mul_overflow(elems, t->ne[d], &elems))
            return cs_error_set(CS_EFORMAT, "%s: tensor '%s': its element count overflows", g->path, name);
    }
    if ((rc = rd_u32(r, &type, what))) return rc;
    const ggml_type_info_t *ti = ggml_type_info(type);
    if (!ti) return cs_error_set(CS_EFORMAT, "%s: tensor '%s': unknown tensor type %u", g->path, name, type);
    t->ggml_type = type;
    t->type_name = ti->name;
    t->dtype = ti->dtype;
    if (t->ne[0] % ti->block)
        return cs_error_set(CS_EFORMAT, "%s: tensor '%s': a row of %" PRId64 " elements is not a multiple of %s's block of %u",
                            g->path, name, t->ne[0], ti->name, ti->block);
    size_t nb = (size_t)(t->ne[0] / ti->block);
    bool over = __builtin_mul_overflow(nb, (size_t)ti->size, &nb);
    for (int d = 1; d < GGUF_MAX_DIMS; d++) over = over || __builtin_mul_overflow(nb, (size_t)t->ne[d], &nb);
    if (over) return cs_error_set(CS_EFORMAT, "%s: tensor '%s': its byte size overflows", g->path, name);
    t->nbytes = nb;
    return rd_uint(r, 8, offset, what);
}

static int offset_cmp(const void *a, const void *b) {
    const gguf_tensor_t *x = *(const gguf_tensor_t *const *)a, *y = *(const gguf_tensor_t *const *)b;
    uintptr_t p = (uintptr_t)x->data, q = (uintptr_t)y->data;
    return p < q ? -1 : p > q;
}

static int parse(gguf_t *g) {
    rd_t r = { g, g->buf, g->len, 0 };
    int rc;
    if (g->len < 4 || memcmp(g->buf, GGUF_MAGIC, 4) != 0)
        return cs_error_set(CS_EFORMAT, "%s: not a GGUF file (it does not start with \"GGUF\")", g->path);
    r.at = 4;
    if ((rc = rd_u32(&r, &g->version, "the version"))) return rc;
    /* the magic is bytes, the version a number: a big-endian file's 3 reads as 0x03000000 */
    if ((g->version & 0xffff) == 0)
        return cs_error_set(CS_EUNSUPPORTED, "%s: big-endian GGUF files are not supported", g->path);
    if (g->version == 1) return cs_error_set(CS_EUNSUPPORTED, "%s: GGUF version 1 is not supported", g->path);
    if (g->version != 2 && g->version != 3)
        return cs_error_set(CS_EUNSUPPORTED, "%s: GGUF version %u is not supported (2 and 3 are)", g->path, g->version);
    uint64_t n_tensors, n_kv;
    if ((rc = rd_uint(&r, 8, &n_tensors, "the tensor count"))) return rc;
    if ((rc = rd_uint(&r, 8, &n_kv, "the key-value count"))) return rc;
    /* the least a pair takes is a key's length, a type and a one-byte value (13 bytes); a
     * tensor's info a name's length, one dimension, a type and an offset (32) */
    if (n_kv > rd_left(&r) / 13)
        return cs_error_set(CS_EFORMAT, "%s: %" PRIu64 " key-value pairs cannot fit in the %zu bytes left", g->path,
                            n_kv, rd_left(&r));
    if (n_tensors > rd_left(&r) / 32)
        return cs_error_set(CS_EFORMAT, "%s: %" PRIu64 " tensors cannot fit in the %zu bytes left", g->path,
                            n_tensors, rd_left(&r));
    g->kv = calloc(n_kv ? (size_t)n_kv : 1, sizeof *g->kv);
    g->tensors = calloc(n_tensors ? (size_t)n_tensors : 1, sizeof *g->tensors);
    if (!g->kv || !g->tensors) return cs_error_set(CS_ENOMEM, "%s: out of memory", g->path);

    for (size_t i = 0; i < n_kv; i++) {
        gguf_kv_t *kv = &g->kv[g->n_kv];
        char what[128];
        size_t klen;
        uint32_t type;
        snprintf(what, sizeof what, "the key of pair %zu", i);
        if ((rc = rd_name(&r, &kv->key, &klen, what))) return rc;
        g->n_kv++; /* from here gguf_free frees it */
        snprintf(what, sizeof what, "the type of key '%s'", kv->key);
        if ((rc = rd_u32(&r, &type, what))) return rc;
        kv->type = (gguf_type)type;
        if ((rc = read_value(&r, kv))) return rc;
    }
    if ((rc = build_index(g, g->n_kv, kv_name, "key", &g->kv_slots, &g->kv_mask))) return rc;

    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    int a = gguf_find_key(g, "general.alignment");
    if (a >= 0) {
        const gguf_kv_t *kv = &g->kv[a];
        /* as ggml reads it (gguf_get_val_u32): UINT32 and nothing else */
        if (kv->type != GGUF_UINT32)
            return cs_error_set(CS_EFORMAT, "%s: general.alignment is a %s, not a UINT32", g->path,
                                value_type_name(kv->type));
        uint32_t v = (uint32_t)le(kv->val, 4);
        if (v == 0 || (v & (v - 1)))
            return cs_error_set(CS_EFORMAT, "%s: general.alignment %u is not a nonzero power of two", g->path, v);
        g->alignment = v;
    }

    uint64_t *offsets = calloc(n_tensors ? (size_t)n_tensors : 1, sizeof *offsets);
    if (!offsets) return cs_error_set(CS_ENOMEM, "%s: out of memory", g->path);
    for (size_t i = 0; i < n_tensors; i++) {
        g->n_tensors++;
        if ((rc = read_tensor_info(&r, &g->tensors[i], &offsets[i]))) goto out;
    }
    if ((rc = build_index(g, g->n_tensors, tensor_name, "tensor name", &g->tensor_slots, &g->tensor_mask))) goto out;

    /* the data section starts at the first multiple of the alignment after the infos; a
     * file without tensors may end before it */
    size_t data = (r.at + g->alignment - 1) / g->alignment * g->alignment; /* r.at <= len, alignment < 2^32 */
    for (size_t i = 0; i < n_tensors; i++) {
        gguf_tensor_t *t = &g->tensors[i];
        if (offsets[i] % g->alignment) {
            rc = cs_error_set(CS_EFORMAT, "%s: tensor '%s': data offset %" PRIu64 " is not a multiple of the alignment %zu",
                              g->path, t->name, offsets[i], g->alignment);
            goto out;
        }
        uint64_t at, end;
        if (__builtin_add_overflow((uint64_t)data, offsets[i], &at) || __builtin_add_overflow(at, (uint64_t)t->nbytes, &end) ||
            end > g->len) {
            rc = cs_error_set(CS_EFORMAT, "%s: tensor '%s': its %zu bytes at offset %" PRIu64 " of the data section "
                              "(byte %zu) lie past the end of the file (%zu bytes)",
                              g->path, t->name, t->nbytes, offsets[i], data, g->len);
            goto out;
        }
        t->data = g->buf + at;
    }
    /* no two tensors share a byte (empty ones take none) */
    const gguf_tensor_t **by_off = malloc((n_tensors ? n_tensors : 1) * sizeof *by_off);
    if (!by_off) {
        rc = cs_error_set(CS_ENOMEM, "%s: out of memory", g->path);
        goto out;
    }
    size_t m = 0;
    for (size_t i = 0; i < n_tensors; i++)
        if (g->tensors[i].nbytes) by_off[m++] = &g->tensors[i];
    qsort(by_off, m, sizeof *by_off, offset_cmp);
    for (size_t i = 1; i < m && rc == CS_OK; i++) {
        const gguf_tensor_t *p = by_off[i - 1], *q = by_off[i];
        if ((const uint8_t *)p->data + p->nbytes > (const uint8_t *)q->data)
            rc = cs_error_set(CS_EFORMAT, "%s: tensors '%s' and '%s' overlap", g->path, p->name, q->name);
    }
    free(by_off);
out:
    free(offsets);
    return rc;
}

/* ------------------------------------------------------------- opening a file ---- */

/* ST_COPY_HUGE: the file read into memory of the process's own in 2 MiB pages, as safetensors'
 * weights are (safetensors_read_huge) */
static int copy_file(gguf_t *g, int fd) {
    int rc = safetensors_read_huge(fd, g->len, g->path, &g->copy, &g->copy_len, &g->copy_huge);
    if (!rc) g->buf = g->copy;
    return rc;
}

static gguf_t *gguf_new(const char *path) {
    gguf_t *g = calloc(1, sizeof *g);
    if (g && !(g->path = strdup(path))) {
        free(g);
        g = NULL;
    }
    return g;
}

int gguf_open(const char *path, st_load_t how, gguf_t **out) {
    *out = NULL;
    gguf_t *g = gguf_new(path);
    if (!g) return cs_error_set(CS_ENOMEM, "%s: out of memory", path);
    int rc = CS_OK, fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        rc = cs_error_set(errno == ENOENT ? CS_ENOTFOUND : CS_EIO, "%s: %s", path, strerror(errno));
        goto err;
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        rc = cs_error_set(CS_EIO, "%s: not a regular file", path);
        goto err;
    }
    g->len = (size_t)sb.st_size;
    if (g->len == 0) { /* mmap of an empty file fails: let the parser say what is wrong */
        g->buf = (const uint8_t *)"";
    } else if (how == ST_COPY_HUGE) {
        if ((rc = copy_file(g, fd))) goto err;
    } else {
        void *map = mmap(NULL, g->len, PROT_READ, MAP_PRIVATE, fd, 0);
        if (map == MAP_FAILED) {
            rc = cs_error_set(CS_EIO, "%s: mmap: %s", path, strerror(errno));
            goto err;
        }
        g->map = map;
        g->buf = map;
    }
    close(fd);
    fd = -1;
    if ((rc = parse(g))) goto err;
    *out = g;
    return CS_OK;
err:
    if (fd >= 0) close(fd);
    gguf_free(g);
    return rc;
}

int gguf_open_buffer(const char *label, const void *buf, size_t len, gguf_t **out) {
    *out = NULL;
    gguf_t *g = gguf_new(label);
    if (!g) return cs_error_set(CS_ENOMEM, "%s: out of memory", label);
    g->buf = len ? buf : (const uint8_t *)"";
    g->len = len;
    int rc = parse(g);
    if (rc) {
        gguf_free(g);
        return rc;
    }
    *out = g;
    return CS_OK;
}

void gguf_free(gguf_t *g) {
    if (!g) return;
    for (size_t i = 0; i < g->n_kv; i++) {
        free(g->kv[i].key);
        free(g->kv[i].str);
        free(g->kv[i].soff);
    }
    for (size_t i = 0; i < g->n_tensors; i++) free((char *)g->tensors[i].name);
    free(g->kv);
    free(g->tensors);
    free(g->kv_slots);
    free(g->tensor_slots);
    if (g->map) munmap(g->map, g->len);
    if (g->copy) munmap(g->copy, g->copy_len);
    free(g->path);
    free(g);
}

const char *gguf_path(const gguf_t *g) { return g->path; }
uint32_t gguf_version(const gguf_t *g) { return g->version; }
size_t gguf_alignment(const gguf_t *g) { return g->alignment; }

size_t gguf_copied_bytes(const gguf_t *g, size_t *huge) {
    if (huge) *huge = g->copy ? g->copy_huge : 0;
    return g->copy ? g->len : 0;
}

/* ------------------------------------------------------------------- tensors ---- */

size_t gguf_n_tensors(const gguf_t *g) { return g->n_tensors; }

const gguf_tensor_t *gguf_tensor_at(const gguf_t *g, size_t i) { return i < g->n_tensors ? &g->tensors[i] : NULL; }

const gguf_tensor_t *gguf_find_tensor(const gguf_t *g, const char *name) {
    size_t i = *slot_of(g->tensor_slots, g->tensor_mask, g, tensor_name, name);
    return i == SIZE_MAX ? NULL : &g->tensors[i];
}

/* ------------------------------------------------------------------ metadata ---- */

size_t gguf_n_kv(const gguf_t *g) { return g->n_kv; }

const char *gguf_key_at(const gguf_t *g, size_t i) { return i < g->n_kv ? g->kv[i].key : NULL; }

int gguf_find_key(const gguf_t *g, const char *key) {
    size_t i = *slot_of(g->kv_slots, g->kv_mask, g, kv_name, key);
    return i == SIZE_MAX || i > INT32_MAX ? -1 : (int)i;
}

gguf_type gguf_kv_type(const gguf_t *g, int i) {
    CS_ASSERT(i >= 0 && (size_t)i < g->n_kv);
    return g->kv[i].type;
}

static const gguf_kv_t *kv_get(const gguf_t *g, const char *key) {
    int i = gguf_find_key(g, key);
    return i < 0 ? NULL : &g->kv[i];
}

static bool wrong(const gguf_t *g, const gguf_kv_t *kv, const char *want, bool *bad) {
    cs_error_set(CS_EINVAL, "%s: GGUF key '%s' is %s, not %s", g->path, kv->key, value_kind(kv->type), want);
    if (bad) *bad = true;
    return false;
}

/* an integer value as (negative, magnitude): every integer type without loss */
static void kv_integer(const gguf_kv_t *kv, bool *neg, uint64_t *mag) {
    size_t sz = value_size(kv->type);
    uint64_t u = le(kv->val, sz);
    bool is_signed = kv->type == GGUF_INT8 || kv->type == GGUF_INT16 || kv->type == GGUF_INT32 ||
                     kv->type == GGUF_INT64;
    *neg = is_signed && (u >> (8 * sz - 1)) & 1;
    /* the magnitude of a negative sz-byte value: its two's complement within 64 bits */
    if (*neg) u = (sz < 8 ? (uint64_t)1 << (8 * sz) : 0) - u;
    *mag = u;
}

static bool out_of_range(const gguf_t *g, const gguf_kv_t *kv, bool neg, uint64_t mag, const char *as, bool *bad) {
    cs_error_set(CS_EINVAL, "%s: GGUF key '%s' holds %s%" PRIu64 ", which does not fit in %s", g->path, kv->key,
                 neg ? "-" : "", mag, as);
    if (bad) *bad = true;
    return false;
}

bool gguf_get_u32(const gguf_t *g, const char *key, uint32_t *out, bool *bad) {
    const gguf_kv_t *kv = kv_get(g, key);
    if (!kv) return false;
    if (!is_integer(kv->type)) return wrong(g, kv, "an integer", bad);
    bool neg;
    uint64_t m;
    kv_integer(kv, &neg, &m);
    if (neg || m > UINT32_MAX) return out_of_range(g, kv, neg, m, "a u32", bad);
    *out = (uint32_t)m;
    return true;
}

bool gguf_get_u64(const gguf_t *g, const char *key, uint64_t *out, bool *bad) {
    const gguf_kv_t *kv = kv_get(g, key);
    if (!kv) return false;
    if (!is_integer(kv->type)) return wrong(g, kv, "an integer", bad);
    bool neg;
    uint64_t m;
    kv_integer(kv, &neg, &m);
    if (neg) return out_of_range(g, kv, neg, m, "a u64", bad);
    *out = m;
    return true;
}

bool gguf_get_i64(const gguf_t *g, const char *key, int64_t *out, bool *bad) {
    const gguf_kv_t *kv = kv_get(g, key);
    if (!kv) return false;
    if (!is_integer(kv->type)) return wrong(g, kv, "an integer", bad);
    bool neg;
    uint64_t m;
    kv_integer(kv, &neg, &m);
    if (m > (neg ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX)) return out_of_range(g, kv, neg, m, "an i64", bad);
    *out = neg ? (int64_t)(0 - m) : (int64_t)m; /* 0 - m wraps to the two's complement */
    return true;
}

bool gguf_get_f64(const gguf_t *g, const char *key, double *out, bool *bad) {
    const gguf_kv_t *kv = kv_get(g, key);
    if (!kv) return false;
    if (kv->type == GGUF_FLOAT32) {
        union { uint32_t u; float f; } v = { .u = (uint32_t)le(kv->val, 4) };
        *out = v.f;
        return true;
    }
    if (kv->type == GGUF_FLOAT64) {
        union { uint64_t u; double f; } v = { .u = le(kv->val, 8) };
        *out = v.f;
        return true;
    }
    if (!is_integer(kv->type)) return wrong(g, kv, "a number", bad);
    /* an integer a double holds exactly (a converter that wrote rope_freq_base as 10000) */
    bool neg;
    uint64_t m;
    kv_integer(kv, &neg, &m);
    if (m > (uint64_t)1 << 53) return out_of_range(g, kv, neg, m, "a double exactly", bad);
    *out = neg ? -(double)m : (double)m;
    return true;
}

bool gguf_get_bool(const gguf_t *g, const char *key, bool *out, bool *bad) {
    const gguf_kv_t *kv = kv_get(g, key);
    if (!kv) return false;
    if (kv->type != GGUF_BOOL) return wrong(g, kv, "a boolean", bad);
    *out = kv->val[0] != 0;
    return true;
}

const char *gguf_get_str(const gguf_t *g, const char *key, size_t *len, bool *bad) {
    const gguf_kv_t *kv = kv_get(g, key);
    if (!kv) return NULL;
    if (kv->type != GGUF_STRING) {
        wrong(g, kv, "a string", bad);
        return NULL;
    }
    if (len) *len = kv->len;
    return kv->str;
}

bool gguf_get_arr(const gguf_t *g, const char *key, gguf_type *elem, uint64_t *n, const void **data, bool *bad) {
    const gguf_kv_t *kv = kv_get(g, key);
    if (!kv) return false;
    if (kv->type != GGUF_ARRAY) return wrong(g, kv, "an array", bad);
    if (elem) *elem = kv->elem;
    if (n) *n = kv->n;
    if (data) *data = kv->elem == GGUF_STRING ? NULL : kv->val;
    return true;
}

const char *gguf_arr_str(const gguf_t *g, const char *key, uint64_t i, size_t *len) {
    const gguf_kv_t *kv = kv_get(g, key);
    if (!kv || kv->type != GGUF_ARRAY || kv->elem != GGUF_STRING || i >= kv->n) return NULL;
    if (len) *len = (size_t)(kv->soff[i + 1] - kv->soff[i] - 1);
    return kv->str + kv->soff[i];
}

double gguf_arr_num(gguf_type elem, const void *data, uint64_t i) {
    size_t sz = value_size(elem);
    CS_ASSERT(sz > 0); /* a numeric (or BOOL) element type */
    uint64_t u = le((const uint8_t *)data + i * sz, sz);
    switch (elem) {
    case GGUF_INT8: return (int8_t)u;
    case GGUF_INT16: return (int16_t)u;
    case GGUF_INT32: return (int32_t)u;
    case GGUF_INT64: return (double)(int64_t)u;
    case GGUF_FLOAT32: {
        union { uint32_t u; float f; } v = { .u = (uint32_t)u };
        return v.f;
    }
    case GGUF_FLOAT64: {
        union { uint64_t u; double f; } v = { .u = u };
        return v.f;
    }
    default: return (double)u; /* unsigned, BOOL */
    }
}
