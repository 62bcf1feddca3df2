/* gguf_harness.c: base/gguf.c's view of a GGUF file as one JSON object, for
 * tests/test_gguf_ref.py to compare with the gguf package's GGUFReader.
 *   gguf_harness [--huge] FILE
 * prints {"version", "alignment", "kv": [{"key", "type", ("elem",) "value"}...],
 * "tensors": [{"name", "type", "type_name", "ne", "offset" (of the data, from the file's
 * start), "nbytes", "fnv" (FNV-1a 64 of the data, hex)}...]}. Numbers print at full
 * precision (FLOAT32 %.9g, FLOAT64 %.17g, 64-bit integers exact), strings JSON-escaped
 * with bytes >= 0x80 as they are. The file is read into memory and opened as a buffer (so
 * offsets are known), and opened again with gguf_open (mapped, or with --huge read into
 * huge pages), which must give the same tensors and values. A refused file: the error on
 * stderr, exit 1. */
#include "base/gguf.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void put_str(const char *s, size_t n) {
    putchar('"');
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') printf("\\%c", c);
        else if (c < 0x20) printf("\\u%04x", c);
        else putchar(c);
    }
    putchar('"');
}

/* a double as JSON (Python's json reads NaN and Infinity) */
static void put_double(double v, int digits) {
    if (isnan(v)) printf("NaN");
    else if (isinf(v)) printf(v > 0 ? "Infinity" : "-Infinity");
    else printf("%.*g", digits, v);
}

static uint64_t rd64(const void *p, uint64_t i) {
    uint64_t v;
    memcpy(&v, (const uint8_t *)p + 8 * i, 8); /* the file is little-endian, as this host */
    return v;
}

static void put_elem(gguf_type t, const void *data, uint64_t i) {
    switch (t) {
    case GGUF_UINT64: printf("%" PRIu64, rd64(data, i)); break;
    case GGUF_INT64: printf("%" PRId64, (int64_t)rd64(data, i)); break;
    case GGUF_FLOAT32: put_double((float)gguf_arr_num(t, data, i), 9); break;
    case GGUF_FLOAT64: put_double(gguf_arr_num(t, data, i), 17); break;
    case GGUF_BOOL: printf(gguf_arr_num(t, data, i) ? "true" : "false"); break;
    default: printf("%" PRId64, (int64_t)gguf_arr_num(t, data, i)); break; /* 8 to 32 bits: exact */
    }
}

static int put_value(const gguf_t *g, const char *key, gguf_type t) {
    bool bad = false;
    switch (t) {
    case GGUF_UINT8: case GGUF_UINT16: case GGUF_UINT32: case GGUF_UINT64: {
        uint64_t v;
        if (!gguf_get_u64(g, key, &v, &bad)) return -1;
        printf("%" PRIu64, v);
        return 0;
    }
    case GGUF_INT8: case GGUF_INT16: case GGUF_INT32: case GGUF_INT64: {
        int64_t v;
        if (!gguf_get_i64(g, key, &v, &bad)) return -1;
        printf("%" PRId64, v);
        return 0;
    }
    case GGUF_FLOAT32: case GGUF_FLOAT64: {
        double v;
        if (!gguf_get_f64(g, key, &v, &bad)) return -1;
        put_double(t == GGUF_FLOAT32 ? (float)v : v, t == GGUF_FLOAT32 ? 9 : 17);
        return 0;
    }
    case GGUF_BOOL: {
        bool v;
        if (!gguf_get_bool(g, key, &v, &bad)) return -1;
        printf(v ? "true" : "false");
        return 0;
    }
    case GGUF_STRING: {
        size_t n;
        const char *s = gguf_get_str(g, key, &n, &bad);
        if (!s) return -1;
        put_str(s, n);
        return 0;
    }
    case GGUF_ARRAY: {
        gguf_type elem;
        uint64_t n;
        const void *data;
        if (!gguf_get_arr(g, key, &elem, &n, &data, &bad)) return -1;
        printf("%d, \"value\": [", (int)elem);
        for (uint64_t i = 0; i < n; i++) {
            if (i) putchar(',');
            if (elem == GGUF_STRING) {
                size_t len;
                const char *s = gguf_arr_str(g, key, i, &len);
                if (!s) return -1;
                put_str(s, len);
            } else {
                put_elem(elem, data, i);
            }
        }
        putchar(']');
        return 0;
    }
    }
    return -1;
}

static uint64_t fnv1a(const uint8_t *p, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

/* the file opened again with gguf_open gives the same tensors and values */
static int same(const gguf_t *a, const gguf_t *b) {
    if (gguf_n_tensors(a) != gguf_n_tensors(b) || gguf_n_kv(a) != gguf_n_kv(b) ||
        gguf_alignment(a) != gguf_alignment(b) || gguf_version(a) != gguf_version(b))
        return -1;
    for (size_t i = 0; i < gguf_n_tensors(a); i++) {
        const gguf_tensor_t *x = gguf_tensor_at(a, i), *y = gguf_tensor_at(b, i);
        if (strcmp(x->name, y->name) || x->nbytes != y->nbytes || x->ggml_type != y->ggml_type ||
            memcmp(x->data, y->data, x->nbytes))
            return -1;
    }
    for (size_t i = 0; i < gguf_n_kv(a); i++)
        if (strcmp(gguf_key_at(a, i), gguf_key_at(b, i)) || gguf_kv_type(a, (int)i) != gguf_kv_type(b, (int)i))
            return -1;
    return 0;
}

int main(int argc, char **argv) {
    bool huge = argc == 3 && strcmp(argv[1], "--huge") == 0;
    if (argc != 2 && !huge) {
        fprintf(stderr, "usage: gguf_harness [--huge] FILE\n");
        return 2;
    }
    const char *path = argv[argc - 1];
    size_t len;
    char *buf = cs_read_file(path, &len);
    if (!buf) {
        fprintf(stderr, "%s\n", cs_error_last());
        return 1;
    }
    gguf_t *g, *o;
    if (gguf_open_buffer(path, buf, len, &g) != CS_OK) {
        fprintf(stderr, "%s\n", cs_error_last());
        free(buf);
        return 1;
    }
    if (gguf_open(path, huge ? ST_COPY_HUGE : ST_MMAP, &o) != CS_OK) {
        fprintf(stderr, "gguf_open refused what gguf_open_buffer took: %s\n", cs_error_last());
        return 1;
    }
    size_t n_huge;
    if (same(g, o) != 0 || gguf_copied_bytes(o, &n_huge) != (huge ? len : 0) || n_huge > len) {
        fprintf(stderr, "%s: gguf_open and gguf_open_buffer disagree\n", path);
        return 1;
    }
    gguf_free(o);

    printf("{\"version\": %u, \"alignment\": %zu, \"kv\": [", gguf_version(g), gguf_alignment(g));
    for (size_t i = 0; i < gguf_n_kv(g); i++) {
        const char *key = gguf_key_at(g, i);
        gguf_type t = gguf_kv_type(g, (int)i);
        printf("%s\n{\"key\": ", i ? "," : "");
        put_str(key, strlen(key));
        printf(", \"type\": %d, %s", (int)t, t == GGUF_ARRAY ? "\"elem\": " : "\"value\": ");
        if (put_value(g, key, t) != 0) {
            fprintf(stderr, "%s: key '%s' cannot be read back: %s\n", path, key, cs_error_last());
            return 1;
        }
        putchar('}');
    }
    printf("],\n\"tensors\": [");
    for (size_t i = 0; i < gguf_n_tensors(g); i++) {
        const gguf_tensor_t *t = gguf_tensor_at(g, i);
        printf("%s\n{\"name\": ", i ? "," : "");
        put_str(t->name, strlen(t->name));
        printf(", \"type\": %u, \"type_name\": \"%s\", \"dtype\": \"%s\", \"ne\": [", t->ggml_type, t->type_name,
               t->dtype == CS_DTYPE_COUNT ? "" : cs_dtype_name(t->dtype));
        for (int d = 0; d < t->n_dims; d++) printf("%s%" PRId64, d ? ", " : "", t->ne[d]);
        printf("], \"offset\": %zu, \"nbytes\": %zu, \"fnv\": \"%016" PRIx64 "\"}", (size_t)((const char *)t->data - buf),
               t->nbytes, fnv1a(t->data, t->nbytes));
    }
    printf("]}\n");
    gguf_free(g);
    free(buf);
    return 0;
}
