/* fuzz_gguf.c: the GGUF reader (base/gguf.c) on any bytes. What it accepts must be what it
 * promises: every tensor's bytes inside the buffer at the file's alignment, its byte size
 * the block math over its shape, tensors and keys found again by name at their index, every
 * string array's elements readable, every getter safe on every key. A refusal has a message. */
#include <string.h>

#include "base/gguf.h"
#include "tests/fuzz/fuzz.h"

static size_t elem_size(gguf_type t) {
    switch (t) {
    case GGUF_UINT8: case GGUF_INT8: case GGUF_BOOL: return 1;
    case GGUF_UINT16: case GGUF_INT16: return 2;
    case GGUF_UINT32: case GGUF_INT32: case GGUF_FLOAT32: return 4;
    case GGUF_UINT64: case GGUF_INT64: case GGUF_FLOAT64: return 8;
    default: return 0;
    }
}

/* ggml's elements per block, by the type's size class: what the reader's table must agree with */
static int64_t block_of(const char *type_name) {
    if (!strcmp(type_name, "F32") || !strcmp(type_name, "F16") || !strcmp(type_name, "BF16") ||
        !strcmp(type_name, "F64") || (type_name[0] == 'I' && type_name[1] >= '0' && type_name[1] <= '9'))
        return 1; /* I8 .. I64 */
    if (strstr(type_name, "_K") || !strncmp(type_name, "IQ", 2) || !strncmp(type_name, "TQ", 2))
        return !strcmp(type_name, "IQ4_NL") ? 32 : 256;
    if (!strcmp(type_name, "NVFP4")) return 64;
    if (!strcmp(type_name, "Q1_0")) return 128;
    return 32;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    /* an exact-size copy: a read past the end is a sanitizer's finding */
    uint8_t *buf = malloc(size ? size : 1);
    if (!buf) return 0;
    if (size) memcpy(buf, data, size);
    gguf_t *g = NULL;
    cs_error_clear();
    if (gguf_open_buffer("fuzz.gguf", buf, size, &g) != CS_OK) {
        FUZZ_CHECK(g == NULL, "a refusal left a handle");
        FUZZ_CHECK(cs_error_last()[0] != 0, "a refusal without a message");
        free(buf);
        return 0;
    }
    fuzz_accepted++;
    const uint8_t *lo = buf, *hi = lo + size;
    size_t align = gguf_alignment(g);
    FUZZ_CHECK(align && !(align & (align - 1)), "alignment %zu", align);
    FUZZ_CHECK(gguf_version(g) == 2 || gguf_version(g) == 3, "version %u", gguf_version(g));
    FUZZ_CHECK(gguf_copied_bytes(g, NULL) == 0, "a buffer was copied");

    size_t n = gguf_n_tensors(g);
    const uint8_t *data0 = NULL; /* the data section starts at a multiple of the alignment */
    for (size_t i = 0; i < n; i++) {
        const gguf_tensor_t *t = gguf_tensor_at(g, i);
        FUZZ_CHECK(t && t->name && t->type_name, "tensor %zu has no name or type", i);
        FUZZ_CHECK(strlen(t->name) < 64, "%s: a name of %zu bytes", t->name, strlen(t->name));
        FUZZ_CHECK(gguf_ggml_type_name(t->ggml_type) == t->type_name, "%s: type %u", t->name, t->ggml_type);
        FUZZ_CHECK(t->n_dims >= 1 && t->n_dims <= GGUF_MAX_DIMS, "%s: %d dims", t->name, t->n_dims);
        int64_t block = block_of(t->type_name);
        size_t nb = 1;
        bool ok = true;
        for (int d = 0; d < GGUF_MAX_DIMS; d++) {
            FUZZ_CHECK(t->ne[d] >= 0 && (d < t->n_dims || t->ne[d] == 1), "%s: ne[%d] = %lld", t->name, d,
                       (long long)t->ne[d]);
            ok = ok && !__builtin_mul_overflow(nb, (size_t)(d ? t->ne[d] : t->ne[0] / block), &nb);
        }
        FUZZ_CHECK(t->ne[0] % block == 0, "%s: a row of %lld in blocks of %lld", t->name, (long long)t->ne[0],
                   (long long)block);
        if (t->dtype != CS_DTYPE_COUNT) {
            FUZZ_CHECK(cs_dtype_block(t->dtype) == block, "%s: %s's block", t->name, t->type_name);
            ok = ok && !__builtin_mul_overflow(nb, cs_dtype_size(t->dtype), &nb);
            FUZZ_CHECK(ok && nb == t->nbytes, "%s: %zu bytes for its shape, %zu given", t->name, nb, t->nbytes);
        } else {
            FUZZ_CHECK(ok && (nb == 0 ? t->nbytes == 0 : t->nbytes % nb == 0), "%s: %zu bytes for %zu blocks",
                       t->name, t->nbytes, nb);
        }
        const uint8_t *p = t->data;
        FUZZ_CHECK(p >= lo && p <= hi && t->nbytes <= (size_t)(hi - p), "%s: its bytes are outside the buffer", t->name);
        if (!data0 || p < data0) data0 = p;
        volatile uint8_t sink = 0;
        if (t->nbytes) sink ^= p[0] ^ p[t->nbytes - 1];
        (void)sink;
        FUZZ_CHECK(gguf_find_tensor(g, t->name) == t, "%s: not found by its name", t->name);
    }
    for (size_t i = 0; data0 && i < n; i++) {
        const gguf_tensor_t *t = gguf_tensor_at(g, i);
        FUZZ_CHECK((size_t)((const uint8_t *)t->data - lo) % align == 0 && (size_t)(data0 - lo) % align == 0,
                   "%s: data at byte %zu, alignment %zu", t->name, (size_t)((const uint8_t *)t->data - lo), align);
    }
    FUZZ_CHECK(gguf_tensor_at(g, n) == NULL, "a tensor past the count");

    size_t nk = gguf_n_kv(g);
    for (size_t i = 0; i < nk; i++) {
        const char *key = gguf_key_at(g, i);
        FUZZ_CHECK(key, "key %zu is NULL", i);
        FUZZ_CHECK(gguf_find_key(g, key) == (int)i, "%s: found at %d, not %zu", key, gguf_find_key(g, key), i);
        gguf_type t = gguf_kv_type(g, (int)i);
        uint32_t u32;
        uint64_t u64;
        int64_t i64;
        double f;
        bool b, bad = false;
        size_t len;
        (void)gguf_get_u32(g, key, &u32, &bad);
        (void)gguf_get_u64(g, key, &u64, &bad);
        (void)gguf_get_i64(g, key, &i64, &bad);
        (void)gguf_get_f64(g, key, &f, &bad);
        (void)gguf_get_bool(g, key, &b, &bad);
        const char *s = gguf_get_str(g, key, &len, &bad);
        FUZZ_CHECK((s != NULL) == (t == GGUF_STRING), "%s: a string of type %d", key, (int)t);
        if (s) FUZZ_CHECK(s[len] == 0, "%s: not NUL-terminated", key);
        gguf_type elem;
        uint64_t count;
        const void *arr;
        bool is_arr = gguf_get_arr(g, key, &elem, &count, &arr, &bad);
        FUZZ_CHECK(is_arr == (t == GGUF_ARRAY), "%s: an array of type %d", key, (int)t);
        FUZZ_CHECK(bad, "%s: no getter found it of a wrong type", key); /* it has one type */
        if (!is_arr) continue;
        FUZZ_CHECK(elem != GGUF_ARRAY, "%s: an array of arrays", key);
        if (elem == GGUF_STRING) {
            FUZZ_CHECK(count <= size / 8, "%s: %llu strings in %zu bytes", key, (unsigned long long)count, size);
            size_t total = 0;
            for (uint64_t k = 0; k < count; k++) {
                const char *e = gguf_arr_str(g, key, k, &len);
                FUZZ_CHECK(e && e[len] == 0, "%s[%llu]: unreadable", key, (unsigned long long)k);
                total += len;
            }
            FUZZ_CHECK(total <= size, "%s: %zu bytes of strings in a %zu-byte file", key, total, size);
            FUZZ_CHECK(gguf_arr_str(g, key, count, &len) == NULL, "%s: an element past the count", key);
        } else {
            const uint8_t *p = arr;
            size_t sz = elem_size(elem);
            FUZZ_CHECK(sz, "%s: an array of type %d", key, (int)elem);
            FUZZ_CHECK(count == 0 || (p >= lo && p < hi && count <= (size_t)(hi - p) / sz), "%s: outside the buffer", key);
            volatile double sink = 0;
            for (uint64_t k = 0; k < count; k++) sink += gguf_arr_num(elem, arr, k);
            (void)sink;
        }
    }
    FUZZ_CHECK(gguf_key_at(g, nk) == NULL, "a key past the count");
    int a = gguf_find_key(g, "fuzz.absent.key");
    FUZZ_CHECK(a == -1 || !strcmp(gguf_key_at(g, (size_t)a), "fuzz.absent.key"), "found the wrong key");
    FUZZ_CHECK(gguf_find_tensor(g, "fuzz.absent.tensor") == NULL || n > 0, "found a tensor in an empty file");
    gguf_free(g);
    free(buf);
    return 0;
}
