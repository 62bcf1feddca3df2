/* safetensors.c: mmap reader and small writer for Hugging Face safetensors files. Reading
 * validates the whole header (length, JSON, dtype, shape, offsets in bounds, dtype x shape
 * == byte size, no overlap) before any tensor is handed out, so the engine can trust every
 * st_tensor_t. Sharded checkpoints go through <basename>.safetensors.index.json. */
#include "base/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct st_shard {
    char *path;         /* file path, or the caller's label for a buffer */
    void *map;          /* whole file, PROT_READ; NULL for a buffer */
    void *owned;        /* a buffer handed over by safetensors_open_buffer: free()d with st */
    void *copy;         /* ST_COPY_HUGE: the file read into anonymous memory, copy_len bytes */
    size_t copy_len, copy_huge; /* copy_huge: of those, in 2 MiB pages (smaps) */
    size_t size;
} st_shard_t;

struct safetensors {
    st_shard_t *shards;
    size_t n_shards;
    st_tensor_t *tensors;
    size_t n_tensors, cap_tensors;
    size_t *by_name;    /* tensor indices sorted by name */
    char **meta;        /* key, value, key, value ... (all shards, first wins on lookup) */
    size_t n_meta;
    st_load_t how;      /* how load_shard brings a file in */
    size_t released;    /* safetensors_release */
};

/* dtypes the format defines that we do not handle: refused as unsupported, not malformed */
static const char *const st_known_unsupported[] = {
    "U16", "U32", "U64", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "C64",
};

size_t safetensors_nbytes(cs_dtype dtype, int n_dims, const int64_t *shape, bool *ok) {
    size_t n = cs_dtype_size(dtype);
    *ok = n > 0 && n_dims >= 0 && n_dims <= ST_MAX_DIMS;
    for (int i = 0; *ok && i < n_dims; i++) {
        if (shape[i] < 0 || __builtin_mul_overflow(n, (size_t)shape[i], &n)) *ok = false;
    }
    return *ok ? n : 0;
}

static void shape_str(char *buf, size_t cap, int n, const int64_t *shape) {
    size_t k = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < n && k < cap; i++)
        k += (size_t)snprintf(buf + k, cap - k, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (k < cap) snprintf(buf + k, cap - k, "]");
}

static int tensor_push(safetensors_t *st, const char *name, size_t shard, st_tensor_t **out) {
    if (st->n_tensors == st->cap_tensors) {
        size_t cap = st->cap_tensors ? st->cap_tensors * 2 : 64;
        st_tensor_t *t = realloc(st->tensors, cap * sizeof *t);
        if (!t) return CS_ENOMEM;
        st->tensors = t;
        st->cap_tensors = cap;
    }
    st_tensor_t *t = &st->tensors[st->n_tensors];
    memset(t, 0, sizeof *t);
    t->name = strdup(name);
    if (!t->name) return CS_ENOMEM;
    t->shard = shard;
    st->n_tensors++;
    *out = t;
    return CS_OK;
}

/* Parse one tensor entry of the header. `dsize` is the size of the data section. */
static int parse_entry(const char *path, const char *name, json_t *v, size_t dsize,
                       st_tensor_t *t, size_t *begin, size_t *end) {
    if (!json_is_object(v))
        return cs_error_set(CS_EFORMAT, "%s: tensor '%s': header entry is %s, expected an object",
                            path, name, cs_json_type_name(v));
    json_t *jd = json_object_get(v, "dtype"), *js = json_object_get(v, "shape"),
           *jo = json_object_get(v, "data_offsets");
    if (!jd || !js || !jo)
        return cs_error_set(CS_EFORMAT, "%s: tensor '%s': missing '%s'", path, name,
                            !jd ? "dtype" : !js ? "shape" : "data_offsets");
    if (!json_is_string(jd))
        return cs_error_set(CS_EFORMAT, "%s: tensor '%s': dtype is %s, expected a string", path,
                            name, cs_json_type_name(jd));
    const char *dn = json_string_value(jd);
    int dt = cs_dtype_from_name(dn);
    if (dt < 0) {
        for (size_t i = 0; i < CS_ARRAY_LEN(st_known_unsupported); i++)
            if (strcmp(dn, st_known_unsupported[i]) == 0)
                return cs_error_set(CS_EUNSUPPORTED, "%s: tensor '%s': dtype %s is not supported",
                                    path, name, dn);
        return cs_error_set(CS_EFORMAT, "%s: tensor '%s': unknown dtype '%s'", path, name, dn);
    }
    t->dtype = (cs_dtype)dt;
    if (!json_is_array(js))
        return cs_error_set(CS_EFORMAT, "%s: tensor '%s': shape is %s, expected an array", path,
                            name, cs_json_type_name(js));
    size_t nd = json_array_size(js);
    if (nd > ST_MAX_DIMS)
        return cs_error_set(CS_EFORMAT, "%s: tensor '%s': %zu dimensions, at most %d supported",
                            path, name, nd, ST_MAX_DIMS);
    t->n_dims = (int)nd;
    for (size_t i = 0; i < nd; i++) {
        json_t *d = json_array_get(js, i);
        if (!json_is_integer(d) || json_integer_value(d) < 0)
            return cs_error_set(CS_EFORMAT,
                                "%s: tensor '%s': shape[%zu] is not a non-negative integer", path,
                                name, i);
        t->shape[i] = json_integer_value(d);
    }
    bool ok;
    size_t nbytes = safetensors_nbytes(t->dtype, t->n_dims, t->shape, &ok);
    if (!ok) return cs_error_set(CS_EFORMAT, "%s: tensor '%s': shape overflows", path, name);
    if (!json_is_array(jo) || json_array_size(jo) != 2 ||
        !json_is_integer(json_array_get(jo, 0)) || !json_is_integer(json_array_get(jo, 1)) ||
        json_integer_value(json_array_get(jo, 0)) < 0 || json_integer_value(json_array_get(jo, 1)) < 0)
        return cs_error_set(CS_EFORMAT,
                            "%s: tensor '%s': data_offsets must be two non-negative integers", path,
                            name);
    uint64_t b = (uint64_t)json_integer_value(json_array_get(jo, 0));
    uint64_t e = (uint64_t)json_integer_value(json_array_get(jo, 1));
    if (b > e)
        return cs_error_set(CS_EFORMAT, "%s: tensor '%s': data_offsets [%llu,%llu] are reversed",
                            path, name, (unsigned long long)b, (unsigned long long)e);
    if (e > dsize)
        return cs_error_set(CS_EFORMAT,
                            "%s: tensor '%s': data_offsets [%llu,%llu] exceed data size %zu", path,
                            name, (unsigned long long)b, (unsigned long long)e, dsize);
    if (e - b != nbytes) {
        char sh[160];
        shape_str(sh, sizeof sh, t->n_dims, t->shape);
        return cs_error_set(CS_EFORMAT,
                            "%s: tensor '%s': data_offsets [%llu,%llu] hold %llu bytes but %s %s "
                            "needs %zu",
                            path, name, (unsigned long long)b, (unsigned long long)e,
                            (unsigned long long)(e - b), cs_dtype_name(t->dtype), sh, nbytes);
    }
    t->nbytes = nbytes;
    *begin = (size_t)b;
    *end = (size_t)e;
    return CS_OK;
}

typedef struct span { size_t begin, end, idx; } span_t;

static int span_cmp(const void *a, const void *b) {
    const span_t *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return 0;
}

/* Append an empty shard named `path`. */
static int shard_push(safetensors_t *st, const char *path, st_shard_t **out) {
    st_shard_t *sh = realloc(st->shards, (st->n_shards + 1) * sizeof *sh);
    if (!sh) return cs_error_set(CS_ENOMEM, "%s: out of memory", path);
    st->shards = sh;
    sh = &st->shards[st->n_shards];
    memset(sh, 0, sizeof *sh);
    if (!(sh->path = strdup(path))) return cs_error_set(CS_ENOMEM, "%s: out of memory", path);
    st->n_shards++;
    *out = sh;
    return CS_OK;
}

static int parse_shard(safetensors_t *st, size_t shard, const unsigned char *p, size_t size);

#define ST_HUGE_PAGE ((size_t)2 << 20)

bool safetensors_huge_pages_offered(void) {
    FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    if (!f) return false; /* a kernel without transparent huge pages */
    char line[128] = "";
    bool on = fgets(line, sizeof line, f) && (strstr(line, "[always]") || strstr(line, "[madvise]"));
    fclose(f);
    return on;
}

/* the AnonHugePages of the mapping that holds P, at most CAP (a mapping merged with a
 * neighbour counts the neighbour's too); 0 where /proc/self/smaps cannot tell */
static size_t huge_bytes_at(const void *p, size_t cap) {
    FILE *f = fopen("/proc/self/smaps", "r");
    if (!f) return 0;
    char line[512];
    bool in = false;
    size_t kb = 0;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && strchr(line, '-') < strchr(line, ' ')) {
            if (in) break;
            in = (uintptr_t)p >= lo && (uintptr_t)p < hi;
        } else if (in && sscanf(line, "AnonHugePages: %zu kB", &kb) == 1) {
            break;
        }
    }
    fclose(f);
    return in ? CS_MIN(kb * 1024, cap) : 0;
}

#define COPY_THREADS 8
typedef struct copy_part {
    int fd;
    char *base;
    size_t at, end;     /* [at, end) of the file still to read into base */
    int err;            /* errno of a failed read */
} copy_part_t;

static void *copy_part(void *arg) {
    copy_part_t *c = arg;
    while (c->at < c->end) {
        ssize_t r = pread(c->fd, c->base + c->at, CS_MIN(c->end - c->at, (size_t)1 << 30), (off_t)c->at);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) { c->err = errno; break; }
        if (r == 0) break; /* the file is shorter than it was */
        c->at += (size_t)r;
    }
    return NULL;
}

/* ST_COPY_HUGE: the file read into anonymous memory aligned to 2 MiB and asked for
 * transparent huge pages (MADV_HUGEPAGE: a hint, 4 KiB pages where the kernel declines),
 * then made read-only as the mapping was. A read of a page-cache mapping walks one 4 KiB
 * page table entry per page; here one entry covers 2 MiB (bench/pages.sh). */
int safetensors_read_huge(int fd, size_t size, const char *path, void **copy, size_t *copy_len, size_t *huge) {
    size_t cap = (size + ST_HUGE_PAGE - 1) / ST_HUGE_PAGE * ST_HUGE_PAGE, len = cap + ST_HUGE_PAGE;
    *copy = NULL;
    *copy_len = *huge = 0;
    char *raw = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED)
        return cs_error_set(CS_ENOMEM, "%s: %zu bytes of memory for the weights: %s", path, cap, strerror(errno));
    char *p = (char *)(((uintptr_t)raw + ST_HUGE_PAGE - 1) & ~(uintptr_t)(ST_HUGE_PAGE - 1));
    if (p > raw) munmap(raw, (size_t)(p - raw)); /* the slack before and after the aligned span */
    if (raw + len > p + cap) munmap(p + cap, (size_t)(raw + len - (p + cap)));
    (void)madvise(p, cap, MADV_HUGEPAGE);
    *copy = p;
    *copy_len = cap;
    /* in 2 MiB-aligned parts, one thread each: the first touch of fresh huge pages (zeroing,
     * and in a VM the host backing them) costs more than the copy, and spreads over cores */
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    int n = (int)CS_MAX(1, CS_MIN(CS_MIN(ncpu, COPY_THREADS), (long)(cap / ST_HUGE_PAGE)));
    size_t per = (size / (size_t)n + ST_HUGE_PAGE - 1) / ST_HUGE_PAGE * ST_HUGE_PAGE;
    copy_part_t parts[COPY_THREADS];
    pthread_t tid[COPY_THREADS];
    bool started[COPY_THREADS] = {false};
    for (int i = 0; i < n; i++) {
        size_t o = CS_MIN(per * (size_t)i, size);
        parts[i] = (copy_part_t){fd, p, o, CS_MIN(size, o + per), 0};
        started[i] = i > 0 && pthread_create(&tid[i], NULL, copy_part, &parts[i]) == 0;
    }
    for (int i = 0; i < n; i++) /* the caller's part, and any whose thread did not start */
        if (!started[i]) copy_part(&parts[i]);
    for (int i = 1; i < n; i++)
        if (started[i]) pthread_join(tid[i], NULL);
    for (int i = 0; i < n; i++) {
        if (parts[i].err)
            return cs_error_set(CS_EIO, "%s: read at byte %zu: %s", path, parts[i].at, strerror(parts[i].err));
        if (parts[i].at < parts[i].end)
            return cs_error_set(CS_EIO, "%s: the file ended at byte %zu of %zu while it was read (changed on disk?)",
                                path, parts[i].at, size);
    }
    (void)mprotect(p, cap, PROT_READ);
    *huge = huge_bytes_at(p, size);
    return CS_OK;
}

static int copy_shard(st_shard_t *sh, int fd, const char *path) {
    return safetensors_read_huge(fd, sh->size, path, &sh->copy, &sh->copy_len, &sh->copy_huge);
}

/* Map `path`, validate its header and append its tensors and metadata to `st`. */
static int load_shard(safetensors_t *st, const char *path) {
    st_shard_t *sh;
    int rc = shard_push(st, path, &sh);
    if (rc != CS_OK) return rc;

    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return cs_error_set(errno == ENOENT ? CS_ENOTFOUND : CS_EIO, "%s: %s", path,
                            strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return cs_error_set(CS_EIO, "%s: not a regular file", path);
    }
    sh->size = (size_t)sb.st_size;
    if (sh->size < 8) { /* mmap of an empty file fails: let the parser say what is wrong */
        close(fd);
        return parse_shard(st, st->n_shards - 1, NULL, sh->size);
    }
    if (st->how == ST_COPY_HUGE) {
        rc = copy_shard(sh, fd, path);
        close(fd);
        return rc ? rc : parse_shard(st, st->n_shards - 1, sh->copy, sh->size);
    }
    void *map = mmap(NULL, sh->size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (map == MAP_FAILED) return cs_error_set(CS_EIO, "%s: mmap: %s", path, strerror(errno));
    sh->map = map;
    return parse_shard(st, st->n_shards - 1, map, sh->size);
}

/* Validate the header of shard `shard` (bytes p[0..size)) and append its tensors and
 * metadata to `st`. */
/* the header's "__metadata__": string keys to string values, appended to st->meta */
static int read_metadata(safetensors_t *st, const char *path, json_t *v) {
    if (!json_is_object(v))
        return cs_error_set(CS_EFORMAT, "%s: __metadata__ is %s, expected an object", path, cs_json_type_name(v));
    const char *mk;
    json_t *mv;
    json_object_foreach(v, mk, mv) {
        if (!json_is_string(mv))
            return cs_error_set(CS_EFORMAT, "%s: __metadata__ '%s' is %s, expected a string", path, mk,
                                cs_json_type_name(mv));
        char **m = realloc(st->meta, (st->n_meta + 2) * sizeof *m);
        if (!m) return cs_error_set(CS_ENOMEM, "%s: out of memory", path);
        st->meta = m;
        m[st->n_meta] = strdup(mk);
        m[st->n_meta + 1] = strdup(json_string_value(mv));
        st->n_meta += 2;
        if (!m[st->n_meta - 2] || !m[st->n_meta - 1]) return cs_error_set(CS_ENOMEM, "%s: out of memory", path);
    }
    return CS_OK;
}

static int parse_shard(safetensors_t *st, size_t shard, const unsigned char *p, size_t size) {
    int rc = CS_OK;
    json_t *root = NULL;
    span_t *spans = NULL;
    size_t first = st->n_tensors;
    const char *path = st->shards[shard].path;

    if (size < 8)
        return cs_error_set(CS_EFORMAT, "%s: file is %zu bytes, too short for a safetensors header",
                            path, size);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | p[i];
    if (hlen < 2)
        return cs_error_set(CS_EFORMAT, "%s: header length %llu is too small", path,
                            (unsigned long long)hlen);
    if (hlen > ST_MAX_HEADER)
        return cs_error_set(CS_EFORMAT, "%s: header length %llu exceeds the %u byte limit", path,
                            (unsigned long long)hlen, ST_MAX_HEADER);
    if (hlen > size - 8)
        return cs_error_set(CS_EFORMAT, "%s: header length %llu is larger than the file (%zu bytes)",
                            path, (unsigned long long)hlen, size);
    const char *hdr = (const char *)p + 8;
    if (hdr[0] != '{') return cs_error_set(CS_EFORMAT, "%s: header does not start with '{'", path);
    size_t dsize = size - 8 - (size_t)hlen;
    const unsigned char *data = p + 8 + hlen;

    json_error_t jerr;
    root = json_loadb(hdr, (size_t)hlen, JSON_REJECT_DUPLICATES, &jerr);
    if (!root) {
        rc = cs_error_set(CS_EFORMAT, "%s: header is not valid JSON: %s (at byte %d)", path,
                          jerr.text, jerr.position);
        goto err;
    }
    if (!json_is_object(root)) {
        rc = cs_error_set(CS_EFORMAT, "%s: header is %s, expected an object", path,
                          cs_json_type_name(root));
        goto err;
    }

    const char *key;
    json_t *v;
    json_object_foreach(root, key, v) {
        if (strcmp(key, "__metadata__") == 0) {
            if ((rc = read_metadata(st, path, v))) goto err;
            continue;
        }
        st_tensor_t *t;
        if (tensor_push(st, key, shard, &t) != CS_OK) {
            rc = cs_error_set(CS_ENOMEM, "%s: out of memory", path);
            goto err;
        }
        size_t b = 0, e = 0;
        if ((rc = parse_entry(path, key, v, dsize, t, &b, &e)) != CS_OK) goto err;
        t->data = data + b;
    }

    /* overlap check: sort by offset, every non-empty tensor must start at or after the
     * furthest end seen so far */
    size_t n = st->n_tensors - first;
    if (n > 1) {
        spans = malloc(n * sizeof *spans);
        if (!spans) { rc = cs_error_set(CS_ENOMEM, "%s: out of memory", path); goto err; }
        for (size_t i = 0; i < n; i++) {
            const st_tensor_t *t = &st->tensors[first + i];
            spans[i].begin = (size_t)((const unsigned char *)t->data - data);
            spans[i].end = spans[i].begin + t->nbytes;
            spans[i].idx = first + i;
        }
        qsort(spans, n, sizeof *spans, span_cmp);
        size_t max_end = 0, max_idx = 0;
        bool have = false;
        for (size_t i = 0; i < n; i++) {
            if (spans[i].end == spans[i].begin) continue;
            if (have && spans[i].begin < max_end) {
                const st_tensor_t *a = &st->tensors[max_idx], *b = &st->tensors[spans[i].idx];
                size_t ab = (size_t)((const unsigned char *)a->data - data);
                rc = cs_error_set(CS_EFORMAT,
                                  "%s: tensor '%s': data_offsets [%zu,%zu] overlap tensor '%s' "
                                  "[%zu,%zu]",
                                  path, b->name, spans[i].begin, spans[i].end, a->name, ab,
                                  ab + a->nbytes);
                goto err;
            }
            if (!have || spans[i].end > max_end) { max_end = spans[i].end; max_idx = spans[i].idx; }
            have = true;
        }
    }
    free(spans);
    json_decref(root);
    return CS_OK;
err:
    free(spans);
    json_decref(root);
    return rc;
}

static _Thread_local const safetensors_t *cmp_ctx; /* qsort has no context argument */
static int name_cmp(const void *a, const void *b) {
    return strcmp(cmp_ctx->tensors[*(const size_t *)a].name, cmp_ctx->tensors[*(const size_t *)b].name);
}

/* Build the name index; duplicate names (possible only across shards) are an error. */
static int build_index(safetensors_t *st) {
    st->by_name = malloc((st->n_tensors ? st->n_tensors : 1) * sizeof *st->by_name);
    if (!st->by_name) return cs_error_set(CS_ENOMEM, "safetensors: out of memory");
    for (size_t i = 0; i < st->n_tensors; i++) st->by_name[i] = i;
    cmp_ctx = st;
    qsort(st->by_name, st->n_tensors, sizeof *st->by_name, name_cmp);
    cmp_ctx = NULL;
    for (size_t i = 1; i < st->n_tensors; i++) {
        size_t a = st->by_name[i - 1], b = st->by_name[i];
        if (strcmp(st->tensors[a].name, st->tensors[b].name) == 0)
            return cs_error_set(CS_EFORMAT, "tensor '%s' appears in both %s and %s",
                                st->tensors[a].name, st->shards[st->tensors[a].shard].path,
                                st->shards[st->tensors[b].shard].path);
    }
    return CS_OK;
}

static safetensors_t *st_new(void) { return calloc(1, sizeof(safetensors_t)); }

int safetensors_open(const char *path, safetensors_t **out) {
    int rc;
    *out = NULL;
    safetensors_t *st = st_new();
    if (!st) return cs_error_set(CS_ENOMEM, "%s: out of memory", path);
    if ((rc = load_shard(st, path)) != CS_OK) goto err;
    if ((rc = build_index(st)) != CS_OK) goto err;
    *out = st;
    return CS_OK;
err:
    safetensors_free(st);
    return rc;
}

int safetensors_open_buffer(const char *label, void *buf, size_t len, bool take_ownership,
                            safetensors_t **out) {
    int rc;
    st_shard_t *sh;
    *out = NULL;
    safetensors_t *st = st_new();
    if (!st) {
        if (take_ownership) free(buf);
        return cs_error_set(CS_ENOMEM, "%s: out of memory", label);
    }
    if ((rc = shard_push(st, label, &sh)) != CS_OK) {
        if (take_ownership) free(buf);
        goto err;
    }
    sh->size = len;
    if (take_ownership) sh->owned = buf;
    if ((rc = parse_shard(st, 0, buf, len)) != CS_OK) goto err;
    if ((rc = build_index(st)) != CS_OK) goto err;
    *out = st;
    return CS_OK;
err:
    safetensors_free(st);
    return rc;
}

static bool shard_name_ok(const char *s) {
    return s[0] && !strchr(s, '/') && strcmp(s, ".") != 0 && strcmp(s, "..") != 0;
}

int safetensors_open_dir(const char *dir, const char *basename, safetensors_t **out) {
    return safetensors_open_dir_how(dir, basename, ST_MMAP, out);
}

size_t safetensors_release(safetensors_t *st, const void *p, size_t n) {
    uintptr_t a = (uintptr_t)p, z = a + n;
    long pg = sysconf(_SC_PAGESIZE);
    uintptr_t page = pg > 0 ? (uintptr_t)pg : 4096;
    for (size_t i = 0; i < st->n_shards; i++) {
        const st_shard_t *sh = &st->shards[i];
        uintptr_t base = (uintptr_t)(sh->copy ? sh->copy : sh->map);
        size_t len = sh->copy ? sh->copy_len : sh->map ? sh->size : 0;
        if (!base || a < base || z > base + len || z < a) continue;
        uintptr_t lo = (a + page - 1) & ~(page - 1), hi = z & ~(page - 1);
        if (hi <= lo) return 0;
        /* dropped first (the copy's memory is freed, a mapping's pages leave this process),
         * then no access: a stray read faults rather than reading zeros */
        if (madvise((void *)lo, hi - lo, MADV_DONTNEED) != 0) return 0;
        (void)mprotect((void *)lo, hi - lo, PROT_NONE);
        st->released += hi - lo;
        return hi - lo;
    }
    return 0;
}

size_t safetensors_released_bytes(const safetensors_t *st) { return st->released; }

size_t safetensors_copied_bytes(const safetensors_t *st, size_t *huge) {
    size_t n = 0, h = 0;
    for (size_t i = 0; i < st->n_shards; i++) {
        n += st->shards[i].copy ? st->shards[i].size : 0;
        h += st->shards[i].copy_huge;
    }
    if (huge) *huge = h;
    return n;
}

int safetensors_open_dir_how(const char *dir, const char *basename, st_load_t how, safetensors_t **out) {
    int rc = CS_OK;
    char *idx_path = NULL, *single = NULL, *text = NULL, *shard_path = NULL;
    const char **names = NULL;   /* distinct shard files, in order of first mention */
    size_t n_names = 0;
    json_t *root = NULL;
    safetensors_t *st = NULL;
    char fname[512];
    *out = NULL;

    snprintf(fname, sizeof fname, "%s.safetensors.index.json", basename);
    idx_path = cs_path_join(dir, fname);
    snprintf(fname, sizeof fname, "%s.safetensors", basename);
    single = cs_path_join(dir, fname);
    if (!idx_path || !single || !(st = st_new())) {
        rc = cs_error_set(CS_ENOMEM, "%s: out of memory", dir);
        goto err;
    }
    st->how = how;
    if (!cs_file_exists(idx_path)) {
        if (!cs_file_exists(single)) {
            rc = cs_error_set(CS_ENOTFOUND, "%s: neither %s.safetensors nor %s.safetensors.index.json found",
                              dir, basename, basename);
            goto err;
        }
        if ((rc = load_shard(st, single)) != CS_OK) goto err;
        if ((rc = build_index(st)) != CS_OK) goto err;
        goto done;
    }

    size_t len;
    if (!(text = cs_read_file(idx_path, &len))) { rc = CS_EIO; goto err; }
    json_error_t jerr;
    root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!root || !json_is_object(root)) {
        rc = cs_error_set(CS_EFORMAT, "%s: not a JSON object%s%s", idx_path, root ? "" : ": ",
                          root ? "" : jerr.text);
        goto err;
    }
    json_t *wm = json_object_get(root, "weight_map");
    if (!json_is_object(wm) || json_object_size(wm) == 0) {
        rc = cs_error_set(CS_EFORMAT, "%s: missing or empty 'weight_map' object", idx_path);
        goto err;
    }
    names = calloc(json_object_size(wm), sizeof *names);
    if (!names) { rc = cs_error_set(CS_ENOMEM, "%s: out of memory", idx_path); goto err; }
    const char *key;
    json_t *v;
    json_object_foreach(wm, key, v) {
        if (!json_is_string(v) || !shard_name_ok(json_string_value(v))) {
            rc = cs_error_set(CS_EFORMAT, "%s: weight_map entry for tensor '%s' is not a file name",
                              idx_path, key);
            goto err;
        }
        const char *f = json_string_value(v);
        size_t i = 0;
        while (i < n_names && strcmp(names[i], f) != 0) i++;
        if (i < n_names) continue;
        names[n_names++] = f;
        shard_path = cs_path_join(dir, f);
        if (!shard_path) { rc = cs_error_set(CS_ENOMEM, "%s: out of memory", idx_path); goto err; }
        if (!cs_file_exists(shard_path)) {
            rc = cs_error_set(CS_ENOTFOUND, "%s: shard %s (holding tensor '%s') is missing",
                              idx_path, shard_path, key);
            goto err;
        }
        if ((rc = load_shard(st, shard_path)) != CS_OK) goto err;
        free(shard_path);
        shard_path = NULL;
    }
    if ((rc = build_index(st)) != CS_OK) goto err;
    json_object_foreach(wm, key, v) {
        const st_tensor_t *t = safetensors_find(st, key);
        const char *f = json_string_value(v);
        size_t want = 0;
        while (strcmp(names[want], f) != 0) want++; /* shards were loaded in `names` order */
        if (!t) {
            rc = cs_error_set(CS_ENOTFOUND, "%s: tensor '%s' is listed in %s but not found in it",
                              dir, key, f);
            goto err;
        }
        if (t->shard != want) {
            rc = cs_error_set(CS_EFORMAT, "%s: tensor '%s' is listed in %s but found in %s", dir,
                              key, f, st->shards[t->shard].path);
            goto err;
        }
    }
done:
    free(names);
    json_decref(root);
    free(text);
    free(idx_path);
    free(single);
    *out = st;
    return CS_OK;
err:
    free(shard_path);
    free(names);
    json_decref(root);
    free(text);
    free(idx_path);
    free(single);
    safetensors_free(st);
    return rc;
}

void safetensors_free(safetensors_t *st) {
    if (!st) return;
    for (size_t i = 0; i < st->n_shards; i++) {
        if (st->shards[i].map) munmap(st->shards[i].map, st->shards[i].size);
        if (st->shards[i].copy) munmap(st->shards[i].copy, st->shards[i].copy_len);
        free(st->shards[i].owned);
        free(st->shards[i].path);
    }
    for (size_t i = 0; i < st->n_tensors; i++) free((char *)st->tensors[i].name);
    for (size_t i = 0; i < st->n_meta; i++) free(st->meta[i]);
    free(st->meta);
    free(st->shards);
    free(st->tensors);
    free(st->by_name);
    free(st);
}

size_t safetensors_count(const safetensors_t *st) { return st->n_tensors; }

const st_tensor_t *safetensors_at(const safetensors_t *st, size_t i) {
    return i < st->n_tensors ? &st->tensors[i] : NULL;
}

const st_tensor_t *safetensors_find(const safetensors_t *st, const char *name) {
    size_t lo = 0, hi = st->n_tensors;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(st->tensors[st->by_name[mid]].name, name);
        if (c == 0) return &st->tensors[st->by_name[mid]];
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}

const char *safetensors_metadata(const safetensors_t *st, const char *key) {
    for (size_t i = 0; i + 1 < st->n_meta; i += 2)
        if (strcmp(st->meta[i], key) == 0) return st->meta[i + 1];
    return NULL;
}

/* ---- writer ---- */

typedef struct mem_fill { const st_write_tensor_t *t; } mem_fill_t;

static int fill_from_mem(void *user, size_t i, void *buf, size_t nbytes) {
    const mem_fill_t *m = user;
    if (nbytes) memcpy(buf, m->t[i].data, nbytes);
    return CS_OK;
}

int safetensors_write(const char *path, const st_write_tensor_t *t, size_t n,
                      const char *const *metadata_kv) {
    for (size_t i = 0; i < n; i++) {
        bool ok;
        size_t nb = safetensors_nbytes(t[i].dtype, t[i].n_dims, t[i].shape, &ok);
        if (ok && nb && !t[i].data)
            return cs_error_set(CS_EINVAL, "%s: tensor '%s' has no data", path,
                                t[i].name ? t[i].name : "?");
    }
    mem_fill_t m = { t };
    return safetensors_write_cb(path, t, n, metadata_kv, fill_from_mem, &m);
}

int safetensors_write_cb(const char *path, const st_write_tensor_t *t, size_t n,
                         const char *const *metadata_kv, st_fill_fn fill, void *user) {
    int rc = CS_OK;
    json_t *root = json_object(), *seen = json_object();
    char *hdr = NULL, *tmp = NULL;
    void *buf = NULL;
    FILE *f = NULL;
    size_t maxb = 0, off = 0;

    if (!root || !seen) { rc = cs_error_set(CS_ENOMEM, "%s: out of memory", path); goto err; }
    if (metadata_kv && metadata_kv[0]) {
        json_t *meta = json_object();
        if (!meta || json_object_set_new(root, "__metadata__", meta)) {
            rc = cs_error_set(CS_ENOMEM, "%s: out of memory", path);
            goto err;
        }
        for (size_t i = 0; metadata_kv[i]; i += 2) {
            if (!metadata_kv[i + 1]) {
                rc = cs_error_set(CS_EINVAL, "%s: metadata key '%s' has no value", path, metadata_kv[i]);
                goto err;
            }
            if (json_object_set_new(meta, metadata_kv[i], json_string(metadata_kv[i + 1]))) {
                rc = cs_error_set(CS_EINVAL, "%s: metadata '%s' is not valid UTF-8", path, metadata_kv[i]);
                goto err;
            }
        }
    }
    for (size_t i = 0; i < n; i++) {
        const char *name = t[i].name;
        bool ok;
        size_t nb = safetensors_nbytes(t[i].dtype, t[i].n_dims, t[i].shape, &ok);
        if (!name || !name[0] || strcmp(name, "__metadata__") == 0) {
            rc = cs_error_set(CS_EINVAL, "%s: tensor %zu has an invalid name", path, i);
            goto err;
        }
        if (!ok) {
            rc = cs_error_set(CS_EINVAL, "%s: tensor '%s': invalid dtype or shape", path, name);
            goto err;
        }
        if (json_object_get(seen, name) || json_object_get(root, name)) {
            rc = cs_error_set(CS_EINVAL, "%s: tensor '%s' given twice", path, name);
            goto err;
        }
        json_object_set_new(seen, name, json_true());
        json_t *e = json_object(), *shape = json_array();
        json_object_set_new(e, "dtype", json_string(cs_dtype_name(t[i].dtype)));
        for (int d = 0; d < t[i].n_dims; d++) json_array_append_new(shape, json_integer(t[i].shape[d]));
        json_object_set_new(e, "shape", shape);
        json_t *offs = json_array();
        json_array_append_new(offs, json_integer((json_int_t)off));
        json_array_append_new(offs, json_integer((json_int_t)(off + nb)));
        json_object_set_new(e, "data_offsets", offs);
        if (json_object_set_new(root, name, e)) {
            rc = cs_error_set(CS_EINVAL, "%s: tensor '%s': name is not valid UTF-8", path, name);
            goto err;
        }
        off += nb;
        if (nb > maxb) maxb = nb;
    }
    hdr = json_dumps(root, JSON_COMPACT);
    if (!hdr) { rc = cs_error_set(CS_ENOMEM, "%s: out of memory", path); goto err; }
    size_t hl = strlen(hdr), padded = (hl + 7) / 8 * 8;

    size_t pl = strlen(path);
    if (!(tmp = malloc(pl + 32))) { rc = cs_error_set(CS_ENOMEM, "%s: out of memory", path); goto err; }
    snprintf(tmp, pl + 32, "%s.tmp.%ld", path, (long)getpid());
    if (!(f = fopen(tmp, "wb"))) {
        rc = cs_error_set(CS_EIO, "%s: %s", tmp, strerror(errno));
        goto err;
    }
    unsigned char lenb[8];
    for (int i = 0; i < 8; i++) lenb[i] = (unsigned char)((uint64_t)padded >> (8 * i));
    bool wok = fwrite(lenb, 1, 8, f) == 8 && fwrite(hdr, 1, hl, f) == hl;
    for (size_t i = hl; wok && i < padded; i++) wok = fputc(' ', f) != EOF;
    if (maxb && !(buf = malloc(maxb))) { rc = cs_error_set(CS_ENOMEM, "%s: out of memory", path); goto err; }
    for (size_t i = 0; wok && i < n; i++) {
        bool ok;
        size_t nb = safetensors_nbytes(t[i].dtype, t[i].n_dims, t[i].shape, &ok);
        if (!nb) continue;
        if ((rc = fill(user, i, buf, nb)) != CS_OK) goto err;
        wok = fwrite(buf, 1, nb, f) == nb;
    }
    if (!wok) { rc = cs_error_set(CS_EIO, "%s: write failed: %s", tmp, strerror(errno)); goto err; }
    int cr = fclose(f);
    f = NULL;
    if (cr != 0) { rc = cs_error_set(CS_EIO, "%s: close failed: %s", tmp, strerror(errno)); goto err; }
    if (rename(tmp, path) != 0) {
        rc = cs_error_set(CS_EIO, "%s: rename from %s failed: %s", path, tmp, strerror(errno));
        goto err;
    }
    free(buf);
    free(tmp);
    free(hdr);
    json_decref(root);
    json_decref(seen);
    return CS_OK;
err:
    if (f) fclose(f);
    if (tmp) unlink(tmp);
    free(buf);
    free(tmp);
    free(hdr);
    json_decref(root);
    json_decref(seen);
    return rc;
}
