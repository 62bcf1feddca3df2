/* test_gguf.c: the GGUF reader (base/gguf.c) on files built here byte by byte: every value
 * type, arrays of numbers and strings, tensors of several ggml types, a custom alignment, a
 * file on disk mapped and read into huge pages; and every kind of malformed file we know of
 * (each truncation, lying counts, duplicates, bad shapes, types, offsets and alignments),
 * each refused with a message that says what is wrong, never a crash or a huge allocation.
 * tests/test_gguf_ref.py holds the reader against the gguf package's own files. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/gguf.h"
#include "testutil.h"

static char tmpdir[256];

static void setup(void) { cs_test_mkdtemp(tmpdir, sizeof tmpdir, "gguf"); }
static void teardown(void) { cs_rmtree(tmpdir); }

/* ---------------------------------------------------------- a small GGUF writer ---- */

typedef struct wb {
    uint8_t *p;
    size_t len, cap;
} wb_t;

static void put(wb_t *b, const void *s, size_t n) {
    if (b->len + n > b->cap) {
        b->cap = CS_MAX(b->cap * 2, b->len + n + 64);
        b->p = realloc(b->p, b->cap);
        ck_assert_ptr_nonnull(b->p);
    }
    if (n) memcpy(b->p + b->len, s, n);
    b->len += n;
}

static void put_le(wb_t *b, uint64_t v, int n) {
    for (int i = 0; i < n; i++) {
        uint8_t c = (uint8_t)(v >> (8 * i));
        put(b, &c, 1);
    }
}
static void put_u32(wb_t *b, uint32_t v) { put_le(b, v, 4); }
static void put_u64(wb_t *b, uint64_t v) { put_le(b, v, 8); }
static void put_str(wb_t *b, const char *s) {
    put_u64(b, strlen(s));
    put(b, s, strlen(s));
}
static void put_f32(wb_t *b, float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    put_u32(b, u);
}
static void put_f64(wb_t *b, double f) {
    uint64_t u;
    memcpy(&u, &f, 8);
    put_u64(b, u);
}

/* a key and its type: the value follows */
static void kv(wb_t *b, const char *key, gguf_type t) {
    put_str(b, key);
    put_u32(b, t);
}
static void kv_u32(wb_t *b, const char *key, uint32_t v) {
    kv(b, key, GGUF_UINT32);
    put_u32(b, v);
}
static void kv_str(wb_t *b, const char *key, const char *v) {
    kv(b, key, GGUF_STRING);
    put_str(b, v);
}
static void kv_arr(wb_t *b, const char *key, gguf_type elem, uint64_t n) {
    kv(b, key, GGUF_ARRAY);
    put_u32(b, elem);
    put_u64(b, n);
}

typedef struct tinfo {
    const char *name;
    uint32_t n_dims;
    uint64_t ne[5];
    uint32_t type;
    uint64_t offset;
} tinfo_t;

static void put_header(wb_t *b, uint32_t version, uint64_t n_tensors, uint64_t n_kv) {
    put(b, "GGUF", 4);
    put_u32(b, version);
    put_u64(b, n_tensors);
    put_u64(b, n_kv);
}

/* a version 3 file: the pairs already written in kvs, the tensor infos, padding to `align`
 * and `dlen` bytes of data (byte i of the data section is i * 7 + 1) */
static wb_t make_file(const wb_t *kvs, uint64_t n_kv, const tinfo_t *t, size_t nt, size_t align, size_t dlen) {
    wb_t b = { 0 };
    put_header(&b, 3, nt, n_kv);
    put(&b, kvs ? kvs->p : NULL, kvs ? kvs->len : 0);
    for (size_t i = 0; i < nt; i++) {
        put_str(&b, t[i].name);
        put_u32(&b, t[i].n_dims);
        for (uint32_t d = 0; d < t[i].n_dims; d++) put_u64(&b, t[i].ne[d]);
        put_u32(&b, t[i].type);
        put_u64(&b, t[i].offset);
    }
    if (nt || dlen)
        while (b.len % align) put_le(&b, 0, 1);
    for (size_t i = 0; i < dlen; i++) put_le(&b, (uint8_t)(i * 7 + 1), 1);
    return b;
}

/* ------------------------------------------------------------------ checking ---- */

/* open must fail with `want` (0: any error), and the message must contain each needle */
static void expect_bad_(const char *what, const wb_t *b, int want, const char *n1, const char *n2) {
    /* an exact-size copy: a read past the end is a sanitizer's finding */
    void *copy = malloc(b->len ? b->len : 1);
    if (b->len) memcpy(copy, b->p, b->len);
    gguf_t *g = (gguf_t *)0x1;
    cs_error_clear();
    int rc = gguf_open_buffer("bad.gguf", copy, b->len, &g);
    ck_assert_msg(rc < 0 && (want == 0 || rc == want), "%s: got %d (%s), want %d", what, rc, cs_error_last(), want);
    ck_assert_ptr_null(g);
    const char *msg = cs_error_last();
    ck_assert_msg(strstr(msg, "bad.gguf") != NULL, "%s: message '%s' does not name the file", what, msg);
    ck_assert_msg(!n1 || strstr(msg, n1), "%s: message '%s' lacks '%s'", what, msg, n1);
    ck_assert_msg(!n2 || strstr(msg, n2), "%s: message '%s' lacks '%s'", what, msg, n2);
    free(copy);
}
#define expect_bad(b, want, n1, n2) expect_bad_(#b " at line " CS_STR(__LINE__), b, want, n1, n2)
#define CS_STR_(x) #x
#define CS_STR(x) CS_STR_(x)

static gguf_t *open_ok(const wb_t *b) {
    gguf_t *g = NULL;
    int rc = gguf_open_buffer("good.gguf", b->p, b->len, &g);
    ck_assert_msg(rc == CS_OK, "open: %d %s", rc, cs_error_last());
    return g;
}

/* --------------------------------------------------------------- the sample ---- */

static const float f32_vals[6] = { 1, -2, 3.5f, 0, 1e-3f, 65504 };

/* every value type, arrays, and tensors F32, F16, Q8_0, Q4_K, IQ2_XXS and a 3-D BF16 (the
 * last one in the data section ends the file) */
static wb_t sample(void) {
    wb_t k = { 0 };
    kv(&k, "u8", GGUF_UINT8), put_le(&k, 200, 1);
    kv(&k, "i8", GGUF_INT8), put_le(&k, (uint8_t)-100, 1);
    kv(&k, "u16", GGUF_UINT16), put_le(&k, 60000, 2);
    kv(&k, "i16", GGUF_INT16), put_le(&k, (uint16_t)-30000, 2);
    kv_u32(&k, "u32", 4000000000u);
    kv(&k, "i32", GGUF_INT32), put_u32(&k, (uint32_t)-2000000000);
    kv(&k, "f32", GGUF_FLOAT32), put_f32(&k, 1.5f);
    kv(&k, "yes", GGUF_BOOL), put_le(&k, 1, 1);
    kv(&k, "no", GGUF_BOOL), put_le(&k, 0, 1);
    kv_str(&k, "general.name", "caf\xc3\xa9 \"model\"");
    kv(&k, "u64", GGUF_UINT64), put_u64(&k, (1ull << 63) + 5);
    kv(&k, "i64", GGUF_INT64), put_u64(&k, (uint64_t)-(1ll << 62));
    kv(&k, "f64", GGUF_FLOAT64), put_f64(&k, 3.141592653589793);
    kv(&k, "small_i64", GGUF_INT64), put_u64(&k, 7);
    kv_arr(&k, "arr.u32", GGUF_UINT32, 3), put_u32(&k, 1), put_u32(&k, 2), put_u32(&k, 3000000000u);
    kv_arr(&k, "arr.i8", GGUF_INT8, 2), put_le(&k, (uint8_t)-1, 1), put_le(&k, 127, 1);
    kv_arr(&k, "arr.f32", GGUF_FLOAT32, 2), put_f32(&k, 0.25f), put_f32(&k, -8);
    kv_arr(&k, "arr.str", GGUF_STRING, 4), put_str(&k, "a"), put_str(&k, ""), put_str(&k, "\xe4\xb8\xad\xe6\x96\x87"),
        put_str(&k, "<|end|>");
    kv_arr(&k, "arr.bool", GGUF_BOOL, 2), put_le(&k, 0, 1), put_le(&k, 1, 1);
    kv_arr(&k, "arr.empty", GGUF_UINT8, 0);
    kv_arr(&k, "arr.f64", GGUF_FLOAT64, 1), put_f64(&k, -0.5);
    kv_arr(&k, "arr.u64", GGUF_UINT64, 1), put_u64(&k, UINT64_MAX);
    const tinfo_t t[] = {
        { "w.f32", 2, { 3, 2 }, 0, 0 },            /* 24 bytes */
        { "b.f16", 1, { 4 }, 1, 32 },              /* 8 */
        { "q8", 2, { 64, 2 }, 8, 64 },             /* 2 x 2 x 34 = 136 */
        { "q4k", 1, { 256 }, 12, 224 },            /* 144 */
        { "iq2", 1, { 256 }, 16, 384 },            /* 66 */
        { "cube", 3, { 2, 2, 2 }, 30, 480 },       /* 16: ends the data, 496 */
    };
    wb_t b = make_file(&k, 22, t, CS_ARRAY_LEN(t), 32, 496);
    /* w.f32 holds f32_vals */
    size_t data = b.len - 496;
    memcpy(b.p + data, f32_vals, sizeof f32_vals);
    free(k.p);
    return b;
}

START_TEST(test_sample) {
    wb_t b = sample();
    gguf_t *g = open_ok(&b);
    ck_assert_uint_eq(gguf_version(g), 3);
    ck_assert_uint_eq(gguf_alignment(g), 32);
    ck_assert_str_eq(gguf_path(g), "good.gguf");
    ck_assert_uint_eq(gguf_copied_bytes(g, NULL), 0);
    ck_assert_uint_eq(gguf_n_kv(g), 22);
    ck_assert_str_eq(gguf_key_at(g, 0), "u8");
    ck_assert_ptr_null(gguf_key_at(g, 22));
    for (size_t i = 0; i < gguf_n_kv(g); i++) ck_assert_int_eq(gguf_find_key(g, gguf_key_at(g, i)), (int)i);
    ck_assert_int_eq(gguf_find_key(g, "absent"), -1);
    ck_assert_int_eq(gguf_kv_type(g, gguf_find_key(g, "f64")), GGUF_FLOAT64);
    ck_assert_int_eq(gguf_kv_type(g, gguf_find_key(g, "arr.str")), GGUF_ARRAY);

    uint32_t u32;
    uint64_t u64;
    int64_t i64;
    double f;
    bool v, bad = false;
    ck_assert(gguf_get_u32(g, "u8", &u32, &bad) && u32 == 200);
    ck_assert(gguf_get_u32(g, "u16", &u32, &bad) && u32 == 60000);
    ck_assert(gguf_get_u32(g, "u32", &u32, &bad) && u32 == 4000000000u);
    ck_assert(gguf_get_u32(g, "small_i64", &u32, &bad) && u32 == 7);
    ck_assert(gguf_get_i64(g, "i8", &i64, &bad) && i64 == -100);
    ck_assert(gguf_get_i64(g, "i16", &i64, &bad) && i64 == -30000);
    ck_assert(gguf_get_i64(g, "i32", &i64, &bad) && i64 == -2000000000);
    ck_assert(gguf_get_i64(g, "i64", &i64, &bad) && i64 == -(1ll << 62));
    ck_assert(gguf_get_i64(g, "u32", &i64, &bad) && i64 == 4000000000ll);
    ck_assert(gguf_get_u64(g, "u64", &u64, &bad) && u64 == (1ull << 63) + 5);
    ck_assert(gguf_get_f64(g, "f32", &f, &bad) && f == 1.5);
    ck_assert(gguf_get_f64(g, "f64", &f, &bad) && f == 3.141592653589793);
    ck_assert(gguf_get_f64(g, "i16", &f, &bad) && f == -30000); /* exact in a double */
    ck_assert(gguf_get_bool(g, "yes", &v, &bad) && v);
    ck_assert(gguf_get_bool(g, "no", &v, &bad) && !v);
    size_t len;
    ck_assert_str_eq(gguf_get_str(g, "general.name", &len, &bad), "caf\xc3\xa9 \"model\"");
    ck_assert_uint_eq(len, 13);
    ck_assert(!bad);
    /* absent: false, and no error */
    ck_assert(!gguf_get_u32(g, "absent", &u32, &bad) && !bad);
    ck_assert_ptr_null(gguf_get_str(g, "absent", NULL, &bad));
    ck_assert(!gguf_get_arr(g, "absent", NULL, NULL, NULL, &bad) && !bad);

    /* the wrong type or range: false, bad, and a message naming the file and the key */
    bad = false;
    ck_assert(!gguf_get_u32(g, "general.name", &u32, &bad) && bad);
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "GGUF key 'general.name' is a string, not an integer"));
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "good.gguf"));
    ck_assert(!gguf_get_u32(g, "i8", &u32, NULL)); /* bad may be NULL */
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "'i8' holds -100, which does not fit in a u32"));
    ck_assert(!gguf_get_u32(g, "u64", &u32, NULL));
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "does not fit in a u32"));
    ck_assert(!gguf_get_u32(g, "f32", &u32, NULL));
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "'f32' is a float, not an integer"));
    ck_assert(!gguf_get_i64(g, "u64", &i64, NULL));
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "holds 9223372036854775813, which does not fit in an i64"));
    ck_assert(!gguf_get_u64(g, "i64", &u64, NULL));
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "holds -4611686018427387904, which does not fit in a u64"));
    ck_assert(!gguf_get_f64(g, "u64", &f, NULL));
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "double"));
    ck_assert(!gguf_get_f64(g, "yes", &f, NULL));
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "'yes' is a boolean, not a number"));
    ck_assert(!gguf_get_bool(g, "u8", &v, NULL));
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "'u8' is an integer, not a boolean"));
    bad = false;
    ck_assert_ptr_null(gguf_get_str(g, "arr.str", NULL, &bad));
    ck_assert(bad);
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "'arr.str' is an array, not a string"));
    ck_assert(!gguf_get_arr(g, "f64", NULL, NULL, NULL, NULL));
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "'f64' is a float, not an array"));

    /* arrays */
    gguf_type elem;
    uint64_t n;
    const void *data;
    ck_assert(gguf_get_arr(g, "arr.u32", &elem, &n, &data, NULL));
    ck_assert(elem == GGUF_UINT32 && n == 3);
    ck_assert(gguf_arr_num(elem, data, 0) == 1 && gguf_arr_num(elem, data, 2) == 3000000000.0);
    ck_assert(gguf_get_arr(g, "arr.i8", &elem, &n, &data, NULL) && elem == GGUF_INT8 && n == 2);
    ck_assert(gguf_arr_num(elem, data, 0) == -1 && gguf_arr_num(elem, data, 1) == 127);
    ck_assert(gguf_get_arr(g, "arr.f32", &elem, &n, &data, NULL) && elem == GGUF_FLOAT32);
    ck_assert(gguf_arr_num(elem, data, 0) == 0.25 && gguf_arr_num(elem, data, 1) == -8);
    ck_assert(gguf_get_arr(g, "arr.f64", &elem, &n, &data, NULL) && gguf_arr_num(elem, data, 0) == -0.5);
    ck_assert(gguf_get_arr(g, "arr.bool", &elem, &n, &data, NULL) && elem == GGUF_BOOL);
    ck_assert(gguf_arr_num(elem, data, 0) == 0 && gguf_arr_num(elem, data, 1) == 1);
    ck_assert(gguf_get_arr(g, "arr.u64", &elem, &n, &data, NULL) && gguf_arr_num(elem, data, 0) == 18446744073709551615.0);
    ck_assert(gguf_get_arr(g, "arr.empty", &elem, &n, &data, NULL) && elem == GGUF_UINT8 && n == 0);
    ck_assert(gguf_get_arr(g, "arr.str", &elem, &n, &data, NULL) && elem == GGUF_STRING && n == 4);
    ck_assert_ptr_null(data);
    const char *expect[] = { "a", "", "\xe4\xb8\xad\xe6\x96\x87", "<|end|>" };
    for (uint64_t i = 0; i < 4; i++) {
        const char *s = gguf_arr_str(g, "arr.str", i, &len);
        ck_assert_ptr_nonnull(s);
        ck_assert_str_eq(s, expect[i]);
        ck_assert_uint_eq(len, strlen(expect[i]));
    }
    ck_assert_ptr_null(gguf_arr_str(g, "arr.str", 4, &len));
    ck_assert_ptr_null(gguf_arr_str(g, "arr.u32", 0, &len));
    ck_assert_ptr_null(gguf_arr_str(g, "general.name", 0, &len));
    ck_assert_ptr_null(gguf_arr_str(g, "absent", 0, NULL));

    /* tensors */
    ck_assert_uint_eq(gguf_n_tensors(g), 6);
    ck_assert_ptr_null(gguf_tensor_at(g, 6));
    const uint8_t *base = (const uint8_t *)b.p + b.len - 496;
    struct { const char *name; uint32_t type; const char *tn; cs_dtype dt; int nd; int64_t ne[4]; size_t off, nb; } want[] = {
        { "w.f32", 0, "F32", CS_DTYPE_F32, 2, { 3, 2, 1, 1 }, 0, 24 },
        { "b.f16", 1, "F16", CS_DTYPE_F16, 1, { 4, 1, 1, 1 }, 32, 8 },
        { "q8", 8, "Q8_0", CS_DTYPE_Q8_0, 2, { 64, 2, 1, 1 }, 64, 136 },
        { "q4k", 12, "Q4_K", CS_DTYPE_Q4_K, 1, { 256, 1, 1, 1 }, 224, 144 },
        { "iq2", 16, "IQ2_XXS", CS_DTYPE_COUNT, 1, { 256, 1, 1, 1 }, 384, 66 },
        { "cube", 30, "BF16", CS_DTYPE_BF16, 3, { 2, 2, 2, 1 }, 480, 16 },
    };
    for (size_t i = 0; i < 6; i++) {
        const gguf_tensor_t *t = gguf_tensor_at(g, i);
        ck_assert_str_eq(t->name, want[i].name);
        ck_assert_ptr_eq(gguf_find_tensor(g, t->name), t);
        ck_assert_uint_eq(t->ggml_type, want[i].type);
        ck_assert_str_eq(t->type_name, want[i].tn);
        ck_assert_int_eq(t->dtype, want[i].dt);
        ck_assert_int_eq(t->n_dims, want[i].nd);
        for (int d = 0; d < 4; d++) ck_assert_int_eq(t->ne[d], want[i].ne[d]);
        ck_assert_ptr_eq(t->data, base + want[i].off);
        ck_assert_uint_eq(t->nbytes, want[i].nb);
    }
    ck_assert_mem_eq(gguf_find_tensor(g, "w.f32")->data, f32_vals, sizeof f32_vals);
    ck_assert_ptr_null(gguf_find_tensor(g, "absent"));
    ck_assert_ptr_null(gguf_find_tensor(g, ""));
    gguf_free(g);
    gguf_free(NULL);
    free(b.p);
}
END_TEST

START_TEST(test_type_table) {
    /* ggml's block and type sizes (ggml-common.h); caraserve's dtype where it has one */
    static const struct { uint32_t id; const char *name; uint32_t block, size; cs_dtype dt; } types[] = {
        { 0, "F32", 1, 4, CS_DTYPE_F32 },           { 1, "F16", 1, 2, CS_DTYPE_F16 },
        { 2, "Q4_0", 32, 18, CS_DTYPE_Q4_0 },       { 3, "Q4_1", 32, 20, CS_DTYPE_Q4_1 },
        { 6, "Q5_0", 32, 22, CS_DTYPE_Q5_0 },       { 7, "Q5_1", 32, 24, CS_DTYPE_Q5_1 },
        { 8, "Q8_0", 32, 34, CS_DTYPE_Q8_0 },       { 9, "Q8_1", 32, 36, CS_DTYPE_COUNT },
        { 10, "Q2_K", 256, 84, CS_DTYPE_COUNT },    { 11, "Q3_K", 256, 110, CS_DTYPE_COUNT },
        { 12, "Q4_K", 256, 144, CS_DTYPE_Q4_K },    { 13, "Q5_K", 256, 176, CS_DTYPE_Q5_K },
        { 14, "Q6_K", 256, 210, CS_DTYPE_Q6_K },    { 15, "Q8_K", 256, 292, CS_DTYPE_COUNT },
        { 16, "IQ2_XXS", 256, 66, CS_DTYPE_COUNT }, { 17, "IQ2_XS", 256, 74, CS_DTYPE_COUNT },
        { 18, "IQ3_XXS", 256, 98, CS_DTYPE_COUNT }, { 19, "IQ1_S", 256, 50, CS_DTYPE_COUNT },
        { 20, "IQ4_NL", 32, 18, CS_DTYPE_COUNT },   { 21, "IQ3_S", 256, 110, CS_DTYPE_COUNT },
        { 22, "IQ2_S", 256, 82, CS_DTYPE_COUNT },   { 23, "IQ4_XS", 256, 136, CS_DTYPE_COUNT },
        { 24, "I8", 1, 1, CS_DTYPE_I8 },            { 25, "I16", 1, 2, CS_DTYPE_I16 },
        { 26, "I32", 1, 4, CS_DTYPE_I32 },          { 27, "I64", 1, 8, CS_DTYPE_I64 },
        { 28, "F64", 1, 8, CS_DTYPE_F64 },          { 29, "IQ1_M", 256, 56, CS_DTYPE_COUNT },
        { 30, "BF16", 1, 2, CS_DTYPE_BF16 },        { 34, "TQ1_0", 256, 54, CS_DTYPE_COUNT },
        { 35, "TQ2_0", 256, 66, CS_DTYPE_COUNT },   { 39, "MXFP4", 32, 17, CS_DTYPE_COUNT },
        { 40, "NVFP4", 64, 36, CS_DTYPE_COUNT },    { 41, "Q1_0", 128, 18, CS_DTYPE_COUNT },
    };
    size_t k = 0;
    for (uint32_t id = 0; id < 64; id++) {
        if (k < CS_ARRAY_LEN(types) && types[k].id == id) {
            ck_assert_str_eq(gguf_ggml_type_name(id), types[k].name);
            /* two rows of one block and a third of a block: the bytes, and its refusal */
            tinfo_t t = { "t", 2, { types[k].block, 2 }, id, 0 };
            wb_t b = make_file(NULL, 0, &t, 1, 32, 2 * types[k].size);
            gguf_t *g = open_ok(&b);
            const gguf_tensor_t *x = gguf_tensor_at(g, 0);
            ck_assert_uint_eq(x->nbytes, 2 * types[k].size);
            ck_assert_str_eq(x->type_name, types[k].name);
            ck_assert_int_eq(x->dtype, types[k].dt);
            if (x->dtype != CS_DTYPE_COUNT) {
                ck_assert_int_eq(cs_dtype_block(x->dtype), (int)types[k].block);
                ck_assert_uint_eq(cs_dtype_size(x->dtype), types[k].size);
                ck_assert_str_eq(cs_dtype_name(x->dtype), types[k].name);
            }
            gguf_free(g);
            free(b.p);
            if (types[k].block > 1) {
                t.ne[0] = types[k].block * 3 / 2;
                b = make_file(NULL, 0, &t, 1, 32, 4 * types[k].size);
                expect_bad(&b, CS_EFORMAT, "is not a multiple of", types[k].name);
                free(b.p);
            }
            k++;
        } else {
            ck_assert_ptr_null(gguf_ggml_type_name(id));
            tinfo_t t = { "t", 1, { 256 }, id, 0 };
            wb_t b = make_file(NULL, 0, &t, 1, 32, 4096);
            expect_bad(&b, CS_EFORMAT, "tensor 't': unknown tensor type", NULL);
            free(b.p);
        }
    }
    ck_assert_uint_eq(k, CS_ARRAY_LEN(types));
    ck_assert_ptr_null(gguf_ggml_type_name(UINT32_MAX));
}
END_TEST

START_TEST(test_alignment_64) {
    wb_t k = { 0 };
    kv_u32(&k, "general.alignment", 64);
    kv_str(&k, "s", "x");
    const tinfo_t t[] = { { "a", 1, { 5 }, 0, 0 }, { "b", 2, { 32, 3 }, 2, 64 }, { "c", 1, { 1 }, 24, 128 } };
    wb_t b = make_file(&k, 2, t, 3, 64, 129);
    gguf_t *g = open_ok(&b);
    ck_assert_uint_eq(gguf_alignment(g), 64);
    const uint8_t *a = gguf_tensor_at(g, 0)->data;
    ck_assert_uint_eq((size_t)(a - b.p) % 64, 0);
    ck_assert_uint_eq((size_t)(a - b.p), b.len - 129);
    ck_assert_ptr_eq(gguf_tensor_at(g, 1)->data, a + 64);
    ck_assert_uint_eq(gguf_tensor_at(g, 1)->nbytes, 54);
    ck_assert_ptr_eq(gguf_tensor_at(g, 2)->data, a + 128);
    gguf_free(g);
    free(b.p);
    /* at 64, an offset of 32 is misaligned */
    const tinfo_t t2[] = { { "a", 1, { 5 }, 0, 32 } };
    b = make_file(&k, 2, t2, 1, 64, 64);
    expect_bad(&b, CS_EFORMAT, "tensor 'a'", "not a multiple of the alignment 64");
    free(b.p);
    free(k.p);
}
END_TEST

/* a file of pairs only may end right after them; version 2 reads as 3 */
START_TEST(test_no_tensors) {
    wb_t b = { 0 };
    put_header(&b, 2, 0, 1);
    kv_str(&b, "general.architecture", "llama");
    gguf_t *g = open_ok(&b);
    ck_assert_uint_eq(gguf_version(g), 2);
    ck_assert_uint_eq(gguf_n_tensors(g), 0);
    ck_assert_ptr_null(gguf_find_tensor(g, "x"));
    ck_assert_str_eq(gguf_get_str(g, "general.architecture", NULL, NULL), "llama");
    gguf_free(g);
    free(b.p);
    b = (wb_t){ 0 };
    put_header(&b, 3, 0, 0);
    g = open_ok(&b);
    ck_assert_uint_eq(gguf_n_kv(g), 0);
    ck_assert_int_eq(gguf_find_key(g, "general.alignment"), -1);
    gguf_free(g);
    free(b.p);
}
END_TEST

/* many tensors and keys: each found by its name */
START_TEST(test_many_names) {
    wb_t k = { 0 };
    char name[64];
    for (int i = 0; i < 500; i++) {
        snprintf(name, sizeof name, "blk.%d.attn_q.weight", i);
        kv_u32(&k, name, (uint32_t)i);
    }
    tinfo_t *t = calloc(2000, sizeof *t);
    char (*names)[32] = calloc(2000, 32);
    for (int i = 0; i < 2000; i++) {
        snprintf(names[i], 32, "blk.%d.ffn_down.weight", i);
        t[i] = (tinfo_t){ names[i], 1, { 8 }, 0, (uint64_t)i * 32 };
    }
    wb_t b = make_file(&k, 500, t, 2000, 32, 2000 * 32);
    gguf_t *g = open_ok(&b);
    for (int i = 0; i < 500; i++) {
        snprintf(name, sizeof name, "blk.%d.attn_q.weight", i);
        uint32_t v;
        ck_assert_int_eq(gguf_find_key(g, name), i);
        ck_assert(gguf_get_u32(g, name, &v, NULL) && v == (uint32_t)i);
    }
    for (int i = 0; i < 2000; i++) ck_assert_ptr_eq(gguf_find_tensor(g, names[i]), gguf_tensor_at(g, (size_t)i));
    gguf_free(g);
    free(b.p);
    free(k.p);
    free(t);
    free(names);
}
END_TEST

/* every prefix of the sample is refused, with a message */
START_TEST(test_truncated) {
    wb_t b = sample();
    for (size_t cut = 0; cut < b.len; cut++) {
        wb_t c = { b.p, cut, cut };
        expect_bad(&c, 0, NULL, NULL);
        const char *m = cs_error_last();
        ck_assert_msg(strstr(m, "truncated") || strstr(m, "cannot fit") || strstr(m, "not a GGUF file") ||
                      strstr(m, "past the end") || strstr(m, "bytes left") || strstr(m, "remain"),
                      "cut at %zu: '%s'", cut, m);
    }
    wb_t c = { b.p, 40, 40 };
    expect_bad(&c, CS_EFORMAT, "22 key-value pairs cannot fit in the 16 bytes left", NULL);
    c.len = 400;
    expect_bad(&c, CS_EFORMAT, "truncated", NULL);
    c.len = b.len - 1;
    expect_bad(&c, CS_EFORMAT, "tensor 'cube'", "past the end of the file");
    free(b.p);
}
END_TEST

START_TEST(test_bad_header) {
    wb_t b = { 0 };
    expect_bad(&b, CS_EFORMAT, "not a GGUF file", NULL);
    put(&b, "GGU", 3);
    expect_bad(&b, CS_EFORMAT, "not a GGUF file", NULL);
    free(b.p);
    b = (wb_t){ 0 };
    put(&b, "GGML", 4), put_u32(&b, 3), put_u64(&b, 0), put_u64(&b, 0);
    expect_bad(&b, CS_EFORMAT, "not a GGUF file", NULL);
    free(b.p);
    b = (wb_t){ 0 };
    put_header(&b, 1, 0, 0);
    expect_bad(&b, CS_EUNSUPPORTED, "GGUF version 1 is not supported", NULL);
    free(b.p);
    b = (wb_t){ 0 };
    put_header(&b, 4, 0, 0);
    expect_bad(&b, CS_EUNSUPPORTED, "GGUF version 4 is not supported", NULL);
    free(b.p);
    /* a big-endian writer's version 3 and counts */
    b = (wb_t){ 0 };
    put(&b, "GGUF", 4), put_u32(&b, 0x03000000u), put_u64(&b, 0), put_u64(&b, 1ull << 56);
    expect_bad(&b, CS_EUNSUPPORTED, "big-endian GGUF files are not supported", NULL);
    free(b.p);
    b = (wb_t){ 0 };
    put(&b, "GGUF", 4), put_u32(&b, 0x02000000u);
    expect_bad(&b, CS_EUNSUPPORTED, "big-endian", NULL);
    free(b.p);
    b = (wb_t){ 0 };
    put(&b, "GGUF", 4), put_u32(&b, 3), put_u64(&b, 0);
    expect_bad(&b, CS_EFORMAT, "truncated", "key-value count");
    free(b.p);
}
END_TEST

/* counts and lengths far beyond the file: refused before anything is allocated for them
 * (the messages say the count was held against the bytes left) */
START_TEST(test_huge_counts) {
    wb_t b = { 0 };
    put_header(&b, 3, 1ull << 62, 0);
    expect_bad(&b, CS_EFORMAT, "4611686018427387904 tensors cannot fit", NULL);
    free(b.p);
    b = (wb_t){ 0 };
    put_header(&b, 3, 0, 1ull << 62);
    put_u64(&b, 0);
    expect_bad(&b, CS_EFORMAT, "key-value pairs cannot fit", NULL);
    free(b.p);
    b = (wb_t){ 0 };
    put_header(&b, 3, 0, UINT64_MAX);
    expect_bad(&b, CS_EFORMAT, "cannot fit", NULL);
    free(b.p);
    /* a key of 2^63 bytes */
    b = (wb_t){ 0 };
    put_header(&b, 3, 0, 1);
    put_u64(&b, 1ull << 63), put(&b, "abcdefghijklmnop", 16);
    expect_bad(&b, CS_EFORMAT, "string of 9223372036854775808 bytes", "the key of pair 0");
    free(b.p);
    /* a string value of 2^63 and 2^64 - 1 bytes */
    b = (wb_t){ 0 };
    put_header(&b, 3, 0, 1);
    kv(&b, "s", GGUF_STRING), put_u64(&b, 1ull << 63), put(&b, "abcdefgh", 8);
    expect_bad(&b, CS_EFORMAT, "'s'", "string of 9223372036854775808 bytes");
    free(b.p);
    b = (wb_t){ 0 };
    put_header(&b, 3, 0, 1);
    kv(&b, "s", GGUF_STRING), put_u64(&b, UINT64_MAX), put(&b, "abcdefgh", 8);
    expect_bad(&b, CS_EFORMAT, "string of 18446744073709551615 bytes", NULL);
    free(b.p);
    /* arrays of 2^60 numbers and strings, and 2^61 u64s (n x 8 overflows) */
    b = (wb_t){ 0 };
    put_header(&b, 3, 0, 1);
    kv_arr(&b, "a", GGUF_UINT32, 1ull << 60), put_u32(&b, 1);
    expect_bad(&b, CS_EFORMAT, "key 'a': an array of 1152921504606846976 UINT32", "bytes left");
    free(b.p);
    b = (wb_t){ 0 };
    put_header(&b, 3, 0, 1);
    kv_arr(&b, "a", GGUF_UINT64, 1ull << 61), put_u64(&b, 1);
    expect_bad(&b, CS_EFORMAT, "an array of 2305843009213693952 UINT64", NULL);
    free(b.p);
    b = (wb_t){ 0 };
    put_header(&b, 3, 0, 1);
    kv_arr(&b, "tokens", GGUF_STRING, 1ull << 60), put_str(&b, "x");
    expect_bad(&b, CS_EFORMAT, "key 'tokens': an array of 1152921504606846976 strings", NULL);
    free(b.p);
    /* a string array whose count fits but whose strings run past the end */
    b = (wb_t){ 0 };
    put_header(&b, 3, 0, 1);
    kv_arr(&b, "tokens", GGUF_STRING, 3), put_str(&b, "x"), put_u64(&b, 1000), put(&b, "abcdefghijklmnop", 16);
    expect_bad(&b, CS_EFORMAT, "tokens", "string of 1000 bytes");
    free(b.p);
}
END_TEST

START_TEST(test_bad_kv) {
    wb_t k = { 0 };
    kv_u32(&k, "a", 1);
    kv_str(&k, "a", "again");
    wb_t b = make_file(&k, 2, NULL, 0, 32, 0);
    expect_bad(&b, CS_EFORMAT, "duplicate key 'a'", NULL);
    free(b.p), free(k.p);

    k = (wb_t){ 0 };
    kv(&k, "flag", GGUF_BOOL), put_le(&k, 2, 1);
    b = make_file(&k, 1, NULL, 0, 32, 0);
    expect_bad(&b, CS_EFORMAT, "key 'flag'", "BOOL holds 2");
    free(b.p), free(k.p);

    k = (wb_t){ 0 };
    kv_arr(&k, "flags", GGUF_BOOL, 3), put_le(&k, 1, 1), put_le(&k, 0, 1), put_le(&k, 255, 1);
    b = make_file(&k, 1, NULL, 0, 32, 0);
    expect_bad(&b, CS_EFORMAT, "key 'flags'", "BOOL holds 255");
    free(b.p), free(k.p);

    k = (wb_t){ 0 };
    kv(&k, "x", (gguf_type)13), put_u32(&k, 0);
    b = make_file(&k, 1, NULL, 0, 32, 0);
    expect_bad(&b, CS_EFORMAT, "key 'x' has unknown value type 13", NULL);
    free(b.p), free(k.p);

    k = (wb_t){ 0 };
    kv_arr(&k, "x", (gguf_type)77, 1), put_u32(&k, 0);
    b = make_file(&k, 1, NULL, 0, 32, 0);
    expect_bad(&b, CS_EFORMAT, "key 'x': an array of unknown value type 77", NULL);
    free(b.p), free(k.p);

    k = (wb_t){ 0 };
    kv_arr(&k, "nested", GGUF_ARRAY, 1), put_u32(&k, GGUF_UINT8), put_u64(&k, 1), put_le(&k, 1, 1);
    b = make_file(&k, 1, NULL, 0, 32, 0);
    expect_bad(&b, CS_EFORMAT, "key 'nested'", "arrays of arrays are not supported");
    free(b.p), free(k.p);

    k = (wb_t){ 0 };
    put_u64(&k, 3), put(&k, "a\0b", 3), put_u32(&k, GGUF_UINT8), put_le(&k, 1, 1);
    b = make_file(&k, 1, NULL, 0, 32, 0);
    expect_bad(&b, CS_EFORMAT, "the key of pair 0 holds a NUL byte", NULL);
    free(b.p), free(k.p);

    /* a value cut short */
    k = (wb_t){ 0 };
    kv(&k, "f", GGUF_FLOAT64), put_u32(&k, 0);
    b = make_file(&k, 1, NULL, 0, 32, 0);
    expect_bad(&b, CS_EFORMAT, "truncated: key 'f' at byte", NULL);
    free(b.p), free(k.p);
}
END_TEST

START_TEST(test_alignment_bad) {
    struct { uint32_t v; const char *msg; } cases[] = {
        { 0, "general.alignment 0 is not a nonzero power of two" },
        { 3, "general.alignment 3 is not a nonzero power of two" },
        { 96, "general.alignment 96 is not" },
        { 0x80000001u, "not a nonzero power of two" },
    };
    const tinfo_t t = { "a", 1, { 1 }, 0, 0 };
    for (size_t i = 0; i < CS_ARRAY_LEN(cases); i++) {
        wb_t k = { 0 };
        kv_u32(&k, "general.alignment", cases[i].v);
        wb_t b = make_file(&k, 1, &t, 1, 32, 4);
        expect_bad(&b, CS_EFORMAT, cases[i].msg, NULL);
        free(b.p), free(k.p);
    }
    wb_t k = { 0 };
    kv(&k, "general.alignment", GGUF_UINT64), put_u64(&k, 32);
    wb_t b = make_file(&k, 1, &t, 1, 32, 4);
    expect_bad(&b, CS_EFORMAT, "general.alignment is a UINT64, not a UINT32", NULL);
    free(b.p), free(k.p);
    k = (wb_t){ 0 };
    kv_str(&k, "general.alignment", "32");
    b = make_file(&k, 1, &t, 1, 32, 4);
    expect_bad(&b, CS_EFORMAT, "general.alignment is a STRING, not a UINT32", NULL);
    free(b.p), free(k.p);
    /* a large power of two is fine: the data section starts there */
    k = (wb_t){ 0 };
    kv_u32(&k, "general.alignment", 1u << 12);
    b = make_file(&k, 1, &t, 1, 1u << 12, 4);
    gguf_t *g = open_ok(&b);
    ck_assert_uint_eq(gguf_alignment(g), 4096);
    ck_assert_ptr_eq(gguf_tensor_at(g, 0)->data, b.p + 4096);
    gguf_free(g);
    free(b.p), free(k.p);
}
END_TEST

/* one tensor described by t, data dlen bytes */
static void expect_bad_tensor(const tinfo_t *t, size_t nt, size_t dlen, const char *n1, const char *n2) {
    wb_t b = make_file(NULL, 0, t, nt, 32, dlen);
    expect_bad_(t[0].name, &b, CS_EFORMAT, n1, n2);
    free(b.p);
}

START_TEST(test_bad_tensors) {
    const tinfo_t dup[] = { { "w", 1, { 4 }, 0, 0 }, { "w", 1, { 4 }, 0, 32 } };
    expect_bad_tensor(dup, 2, 64, "duplicate tensor name 'w'", NULL);
    expect_bad_tensor(&(tinfo_t){ "w", 0, { 0 }, 0, 0 }, 1, 32, "tensor 'w' has 0 dimensions (1 to 4)", NULL);
    expect_bad_tensor(&(tinfo_t){ "w", 5, { 1, 1, 1, 1, 1 }, 0, 0 }, 1, 32, "tensor 'w' has 5 dimensions", NULL);
    expect_bad_tensor(&(tinfo_t){ "w", 2, { 33, 2 }, 2, 0 }, 1, 4096, "tensor 'w'",
                      "row of 33 elements is not a multiple of Q4_0's block of 32");
    expect_bad_tensor(&(tinfo_t){ "w", 1, { 128 }, 12, 0 }, 1, 4096, "not a multiple of Q4_K's block of 256", NULL);
    expect_bad_tensor(&(tinfo_t){ "w", 1, { 4 }, 99, 0 }, 1, 32, "tensor 'w': unknown tensor type 99", NULL);
    expect_bad_tensor(&(tinfo_t){ "w", 1, { 32 }, 4, 0 }, 1, 32, "unknown tensor type 4", NULL); /* removed Q4_2 */
    expect_bad_tensor(&(tinfo_t){ "w", 1, { 4 }, 0, 8 }, 1, 64, "tensor 'w'", "data offset 8 is not a multiple of the alignment 32");
    expect_bad_tensor(&(tinfo_t){ "w", 1, { 4 }, 0, 0 }, 1, 15, "tensor 'w'", "past the end of the file");
    expect_bad_tensor(&(tinfo_t){ "w", 1, { 4 }, 0, 64 }, 1, 32, "past the end", NULL);
    expect_bad_tensor(&(tinfo_t){ "w", 1, { 4 }, 0, UINT64_MAX - 31 }, 1, 32, "past the end", NULL);
    expect_bad_tensor(&(tinfo_t){ "w", 1, { 1ull << 63 }, 0, 0 }, 1, 32, "tensor 'w': dimension 0 is negative", NULL);
    expect_bad_tensor(&(tinfo_t){ "w", 2, { 1ull << 40, 1ull << 40 }, 0, 0 }, 1, 32, "element count overflows", NULL);
    expect_bad_tensor(&(tinfo_t){ "w", 2, { 1ull << 40, 1ull << 22 }, 0, 0 }, 1, 32, "byte size overflows", NULL);
    expect_bad_tensor(&(tinfo_t){ "w", 2, { 1ull << 40, 1ull << 20 }, 0, 0 }, 1, 32, "past the end", NULL);
    const tinfo_t overlap[] = { { "a", 1, { 16 }, 0, 0 }, { "b", 1, { 4 }, 0, 32 } };
    expect_bad_tensor(overlap, 2, 64, "tensors 'a' and 'b' overlap", NULL);
    const tinfo_t overlap2[] = { { "a", 1, { 4 }, 0, 64 }, { "b", 1, { 4 }, 0, 0 }, { "c", 1, { 32 }, 0, 0 } };
    expect_bad_tensor(overlap2, 3, 128, "overlap", NULL);
    const tinfo_t same[] = { { "a", 1, { 4 }, 0, 0 }, { "b", 1, { 4 }, 0, 0 } };
    expect_bad_tensor(same, 2, 32, "tensors 'a' and 'b' overlap", NULL);
    /* names: 63 bytes are ggml's most (its GGML_MAX_NAME of 64 holds the NUL) */
    char n63[64], n64[65];
    memset(n63, 'x', 63), n63[63] = 0;
    memset(n64, 'y', 64), n64[64] = 0;
    expect_bad_tensor(&(tinfo_t){ n64, 1, { 4 }, 0, 0 }, 1, 32, "a name of 64 bytes is too long", NULL);
    wb_t b = make_file(NULL, 0, &(tinfo_t){ n63, 1, { 4 }, 0, 0 }, 1, 32, 16);
    gguf_t *g = open_ok(&b);
    ck_assert_ptr_nonnull(gguf_find_tensor(g, n63));
    gguf_free(g);
    free(b.p);
    /* a name with a NUL */
    b = (wb_t){ 0 };
    put_header(&b, 3, 1, 0);
    put_u64(&b, 3), put(&b, "a\0b", 3), put_u32(&b, 1), put_u64(&b, 4), put_u32(&b, 0), put_u64(&b, 0);
    while (b.len % 32) put_le(&b, 0, 1);
    put_u64(&b, 0), put_u64(&b, 0);
    expect_bad(&b, CS_EFORMAT, "the name of tensor 0 holds a NUL byte", NULL);
    free(b.p);
    /* empty tensors take no bytes: they may share an offset, even with another tensor */
    const tinfo_t empty[] = { { "a", 1, { 4 }, 0, 0 }, { "e", 2, { 0, 3 }, 0, 0 }, { "f", 1, { 0 }, 12, 16 * 0 } };
    b = make_file(NULL, 0, empty, 3, 32, 16);
    g = open_ok(&b);
    ck_assert_uint_eq(gguf_find_tensor(g, "e")->nbytes, 0);
    ck_assert_uint_eq(gguf_find_tensor(g, "f")->nbytes, 0);
    gguf_free(g);
    free(b.p);
}
END_TEST

/* random corruptions of the sample's header: a status or a file whose tensors all read */
START_TEST(test_no_crash_on_corruption) {
    wb_t b = sample();
    uint8_t *mut = malloc(b.len);
    uint64_t x = 12345;
    size_t header = b.len - 496;
    for (int iter = 0; iter < 4000; iter++) {
        memcpy(mut, b.p, b.len);
        for (int k = 0; k < 1 + iter % 4; k++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            size_t pos = (size_t)(x >> 33) % header;
            mut[pos] = (iter & 1) ? (uint8_t)(x >> 20) : (uint8_t)(mut[pos] ^ (1u << ((x >> 20) & 7)));
        }
        gguf_t *g = NULL;
        if (gguf_open_buffer("m.gguf", mut, b.len, &g) == CS_OK) {
            for (size_t i = 0; i < gguf_n_tensors(g); i++) {
                const gguf_tensor_t *t = gguf_tensor_at(g, i);
                const uint8_t *p = t->data;
                ck_assert(t->nbytes == 0 || (p >= mut && p + t->nbytes <= mut + b.len));
                ck_assert_ptr_eq(gguf_find_tensor(g, t->name), t);
            }
            for (size_t i = 0; i < gguf_n_kv(g); i++) ck_assert_int_eq(gguf_find_key(g, gguf_key_at(g, i)), (int)i);
            gguf_free(g);
        } else {
            ck_assert_ptr_null(g);
            ck_assert(cs_error_last()[0]);
        }
    }
    free(mut);
    free(b.p);
}
END_TEST

static const char *write_tmp(const char *name, const wb_t *b) {
    static char p[512];
    snprintf(p, sizeof p, "%s/%s", tmpdir, name);
    FILE *f = fopen(p, "wb");
    ck_assert_ptr_nonnull(f);
    ck_assert_uint_eq(fwrite(b->p, 1, b->len, f), b->len);
    fclose(f);
    return p;
}

/* from disk, mapped and read into huge pages: the same tensors and values */
START_TEST(test_open_file) {
    wb_t b = sample();
    const char *path = write_tmp("s.gguf", &b);
    gguf_t *m = NULL, *c = NULL;
    ck_assert_int_eq(gguf_open(path, ST_MMAP, &m), CS_OK);
    ck_assert_int_eq(gguf_open(path, ST_COPY_HUGE, &c), CS_OK);
    ck_assert_str_eq(gguf_path(m), path);
    size_t huge = 123;
    ck_assert_uint_eq(gguf_copied_bytes(m, &huge), 0);
    ck_assert_uint_eq(huge, 0);
    ck_assert_uint_eq(gguf_copied_bytes(c, &huge), b.len);
    ck_assert_uint_le(huge, b.len);
    ck_assert_uint_eq(gguf_n_tensors(c), 6);
    for (size_t i = 0; i < gguf_n_tensors(m); i++) {
        const gguf_tensor_t *tm = gguf_tensor_at(m, i), *tc = gguf_tensor_at(c, i);
        ck_assert_str_eq(tm->name, tc->name);
        ck_assert_uint_eq(tm->nbytes, tc->nbytes);
        ck_assert_ptr_ne(tm->data, tc->data);
        ck_assert_uint_eq((uintptr_t)tc->data % 4096, (uintptr_t)tm->data % 4096); /* the file's layout */
        ck_assert_mem_eq(tm->data, tc->data, tm->nbytes);
    }
    ck_assert_mem_eq(gguf_find_tensor(c, "w.f32")->data, f32_vals, sizeof f32_vals);
    ck_assert_str_eq(gguf_get_str(c, "general.name", NULL, NULL), "caf\xc3\xa9 \"model\"");
    ck_assert_str_eq(gguf_arr_str(m, "arr.str", 3, NULL), "<|end|>");
    gguf_free(m);
    gguf_free(c);
    /* a bad file, read in: the same error as from a buffer */
    b.len -= 1;
    path = write_tmp("cut.gguf", &b);
    for (int how = 0; how < 2; how++) {
        gguf_t *g = (gguf_t *)0x1;
        ck_assert_int_eq(gguf_open(path, how ? ST_COPY_HUGE : ST_MMAP, &g), CS_EFORMAT);
        ck_assert_ptr_null(g);
        ck_assert_ptr_nonnull(strstr(cs_error_last(), "cut.gguf"));
        ck_assert_ptr_nonnull(strstr(cs_error_last(), "past the end of the file"));
    }
    b.len = 0;
    path = write_tmp("empty.gguf", &b);
    gguf_t *g = (gguf_t *)0x1;
    ck_assert_int_eq(gguf_open(path, ST_MMAP, &g), CS_EFORMAT);
    ck_assert_ptr_null(g);
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "not a GGUF file"));
    ck_assert_int_eq(gguf_open(path, ST_COPY_HUGE, &g), CS_EFORMAT);
    char missing[512];
    snprintf(missing, sizeof missing, "%s/missing.gguf", tmpdir);
    ck_assert_int_eq(gguf_open(missing, ST_MMAP, &g), CS_ENOTFOUND);
    ck_assert_ptr_null(g);
    ck_assert_int_eq(gguf_open(tmpdir, ST_MMAP, &g), CS_EIO); /* a directory */
    free(b.p);
}
END_TEST

/* a file over 2 MiB read into huge pages: the copy is whole, across the threads' parts */
START_TEST(test_open_file_big) {
    enum { N = 5 << 18 }; /* 5 MiB of F32 */
    const tinfo_t t = { "big", 2, { 1024, N / 1024 }, 0, 0 };
    wb_t b = make_file(NULL, 0, &t, 1, 32, (size_t)N * 4);
    const char *path = write_tmp("big.gguf", &b);
    gguf_t *c = NULL;
    ck_assert_int_eq(gguf_open(path, ST_COPY_HUGE, &c), CS_OK);
    size_t huge;
    ck_assert_uint_eq(gguf_copied_bytes(c, &huge), b.len);
    ck_assert_uint_le(huge, b.len);
    const gguf_tensor_t *x = gguf_find_tensor(c, "big");
    ck_assert_uint_eq(x->nbytes, (size_t)N * 4);
    ck_assert_int_eq(memcmp(x->data, b.p + b.len - x->nbytes, x->nbytes), 0);
    gguf_free(c);
    free(b.p);
}
END_TEST

int main(void) {
    const TTest *const tests[] = {
        test_sample, test_type_table, test_alignment_64, test_no_tensors, test_many_names, test_truncated,
        test_bad_header, test_huge_counts, test_bad_kv, test_alignment_bad, test_bad_tensors,
        test_no_crash_on_corruption, test_open_file, test_open_file_big,
    };
    return cs_check_main_fixture("gguf", tests, CS_ARRAY_LEN(tests), 0, CK_FORK, setup, teardown);
}
