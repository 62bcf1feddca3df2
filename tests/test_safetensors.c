/* test_safetensors.c: the safetensors reader and writer: round trips (single file and
 * sharded directories) and every kind of malformed file we know of, each of which must be
 * refused with the right status and a message naming the tensor, never a crash. */
#define _GNU_SOURCE /* memfd_create */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/safetensors.h"
#include "testutil.h"

static char tmpdir[256];

static void setup(void) {
    snprintf(tmpdir, sizeof tmpdir, "/tmp/cs_test_st_XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(tmpdir));
}

static void teardown(void) { cs_rmtree(tmpdir); }

static char *path_in(const char *name) {
    static char p[512];
    snprintf(p, sizeof p, "%s/%s", tmpdir, name);
    return p;
}

static void write_bytes(const char *name, const void *data, size_t n) {
    FILE *f = fopen(path_in(name), "wb");
    ck_assert_ptr_nonnull(f);
    ck_assert_uint_eq(fwrite(data, 1, n, f), n);
    fclose(f);
}

/* a raw safetensors file: header text (unpadded) + `dlen` data bytes */
static void write_raw(const char *name, const char *header, size_t dlen) {
    size_t hl = strlen(header);
    unsigned char *buf = calloc(1, 8 + hl + dlen + 1);
    for (int i = 0; i < 8; i++) buf[i] = (unsigned char)((uint64_t)hl >> (8 * i));
    memcpy(buf + 8, header, hl);
    for (size_t i = 0; i < dlen; i++) buf[8 + hl + i] = (unsigned char)i;
    write_bytes(name, buf, 8 + hl + dlen);
    free(buf);
}

static void write_text(const char *name, const char *text) { write_bytes(name, text, strlen(text)); }

/* open must fail with `want`, and the message must contain `needle` */
static void expect_fail(const char *name, int want, const char *needle) {
    safetensors_t *st = (safetensors_t *)0x1;
    cs_error_clear();
    int rc = safetensors_open(path_in(name), &st);
    ck_assert_msg(rc == want, "%s: got %d (%s), want %d", name, rc, cs_error_last(), want);
    ck_assert_ptr_null(st);
    if (needle)
        ck_assert_msg(strstr(cs_error_last(), needle) != NULL, "message '%s' lacks '%s'", cs_error_last(), needle);
}

static float f32_data[6] = { 1, -2, 3.5f, 0, 1e-3f, 65504 };
static uint16_t bf16_data[4] = { 0x3f80, 0xc000, 0x4040, 0x0000 };
static int64_t i64_data[1] = { -42 };

static void write_sample(const char *name) {
    st_write_tensor_t t[] = {
        { .name = "w.f32", .dtype = CS_DTYPE_F32, .n_dims = 2, .shape = { 2, 3 }, .data = f32_data },
        { .name = "b.bf16", .dtype = CS_DTYPE_BF16, .n_dims = 1, .shape = { 4 }, .data = bf16_data },
        { .name = "scalar", .dtype = CS_DTYPE_I64, .n_dims = 0, .data = i64_data },
        { .name = "empty", .dtype = CS_DTYPE_F32, .n_dims = 2, .shape = { 0, 5 }, .data = NULL },
    };
    const char *meta[] = { "format", "pt", "note", "caf\xc3\xa9 \"quoted\"", NULL };
    ck_assert_int_eq(safetensors_write(path_in(name), t, 4, meta), CS_OK);
}

START_TEST(test_round_trip) {
    write_sample("a.safetensors");
    /* header padded with spaces so the data starts 8-aligned */
    size_t len;
    char *raw = cs_read_file(path_in("a.safetensors"), &len);
    ck_assert_ptr_nonnull(raw);
    uint64_t hl = 0;
    for (int i = 7; i >= 0; i--) hl = (hl << 8) | (unsigned char)raw[i];
    ck_assert_uint_eq(hl % 8, 0);
    ck_assert_uint_eq(len, 8 + hl + 24 + 8 + 8);
    ck_assert_int_eq(raw[8], '{');
    ck_assert(raw[8 + hl - 1] == '}' || raw[8 + hl - 1] == ' ');
    free(raw);

    safetensors_t *st;
    ck_assert_int_eq(safetensors_open(path_in("a.safetensors"), &st), CS_OK);
    ck_assert_uint_eq(safetensors_count(st), 4);
    ck_assert_str_eq(safetensors_at(st, 0)->name, "w.f32");   /* header order */
    ck_assert_ptr_null(safetensors_at(st, 4));
    const st_tensor_t *w = safetensors_find(st, "w.f32");
    ck_assert_ptr_nonnull(w);
    ck_assert_int_eq(w->dtype, CS_DTYPE_F32);
    ck_assert_int_eq(w->n_dims, 2);
    ck_assert_int_eq(w->shape[0], 2);
    ck_assert_int_eq(w->shape[1], 3);
    ck_assert_uint_eq(w->nbytes, 24);
    ck_assert_mem_eq(w->data, f32_data, 24);
    ck_assert_uint_eq((uintptr_t)w->data % 8, 0);
    const st_tensor_t *b = safetensors_find(st, "b.bf16");
    ck_assert_int_eq(b->dtype, CS_DTYPE_BF16);
    ck_assert_mem_eq(b->data, bf16_data, 8);
    float f[4];
    cs_to_f32(f, b->data, CS_DTYPE_BF16, 4);
    ck_assert_float_eq(f[0], 1.0f);
    ck_assert_float_eq(f[1], -2.0f);
    const st_tensor_t *s = safetensors_find(st, "scalar");
    ck_assert_int_eq(s->n_dims, 0);
    ck_assert_uint_eq(s->nbytes, 8);
    ck_assert_mem_eq(s->data, i64_data, 8);
    const st_tensor_t *e = safetensors_find(st, "empty");
    ck_assert_uint_eq(e->nbytes, 0);
    ck_assert_int_eq(e->shape[0], 0);
    ck_assert_ptr_null(safetensors_find(st, "nope"));
    ck_assert_ptr_null(safetensors_find(st, ""));
    ck_assert_str_eq(safetensors_metadata(st, "format"), "pt");
    ck_assert_str_eq(safetensors_metadata(st, "note"), "caf\xc3\xa9 \"quoted\"");
    ck_assert_ptr_null(safetensors_metadata(st, "missing"));
    safetensors_free(st);
    safetensors_free(NULL);
}
END_TEST

START_TEST(test_write_no_metadata_and_errors) {
    float x = 1;
    st_write_tensor_t t[] = {
        { .name = "x", .dtype = CS_DTYPE_F32, .n_dims = 1, .shape = { 1 }, .data = &x },
        { .name = "x", .dtype = CS_DTYPE_F32, .n_dims = 1, .shape = { 1 }, .data = &x },
    };
    ck_assert_int_eq(safetensors_write(path_in("n.safetensors"), t, 1, NULL), CS_OK);
    safetensors_t *st;
    ck_assert_int_eq(safetensors_open(path_in("n.safetensors"), &st), CS_OK);
    ck_assert_ptr_null(safetensors_metadata(st, "format"));
    safetensors_free(st);
    ck_assert_int_eq(safetensors_write(path_in("d.safetensors"), t, 2, NULL), CS_EINVAL);
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "'x'"));
    ck_assert(!cs_file_exists(path_in("d.safetensors")));
    st_write_tensor_t bad = { .name = "neg", .dtype = CS_DTYPE_F32, .n_dims = 1, .shape = { -1 }, .data = &x };
    ck_assert_int_eq(safetensors_write(path_in("e.safetensors"), &bad, 1, NULL), CS_EINVAL);
    st_write_tensor_t badname = { .name = "bad\xff", .dtype = CS_DTYPE_F32, .n_dims = 1, .shape = { 1 }, .data = &x };
    ck_assert_int_eq(safetensors_write(path_in("u.safetensors"), &badname, 1, NULL), CS_EINVAL);
    st_write_tensor_t nodata = { .name = "nd", .dtype = CS_DTYPE_F32, .n_dims = 1, .shape = { 2 }, .data = NULL };
    ck_assert_int_eq(safetensors_write(path_in("f.safetensors"), &nodata, 1, NULL), CS_EINVAL);
    ck_assert_int_eq(safetensors_write("/nonexistent-dir/x.safetensors", t, 1, NULL), CS_EIO);
    /* empty file list is a valid (empty) safetensors file */
    ck_assert_int_eq(safetensors_write(path_in("g.safetensors"), t, 0, NULL), CS_OK);
    ck_assert_int_eq(safetensors_open(path_in("g.safetensors"), &st), CS_OK);
    ck_assert_uint_eq(safetensors_count(st), 0);
    safetensors_free(st);
}
END_TEST

static void write_shards(void) {
    float a[2] = { 1, 2 }, b[3] = { 3, 4, 5 }, c[1] = { 6 };
    st_write_tensor_t s1[] = {
        { .name = "model.a", .dtype = CS_DTYPE_F32, .n_dims = 1, .shape = { 2 }, .data = a },
        { .name = "model.b", .dtype = CS_DTYPE_F32, .n_dims = 1, .shape = { 3 }, .data = b },
    };
    st_write_tensor_t s2[] = { { .name = "model.c", .dtype = CS_DTYPE_F32, .n_dims = 1, .shape = { 1 }, .data = c } };
    const char *meta[] = { "format", "pt", NULL };
    ck_assert_int_eq(safetensors_write(path_in("model-00001-of-00002.safetensors"), s1, 2, meta), CS_OK);
    ck_assert_int_eq(safetensors_write(path_in("model-00002-of-00002.safetensors"), s2, 1, meta), CS_OK);
}

/* the index of write_shards' two files, its tensors out of order */
static void write_index(void) {
    write_text("model.safetensors.index.json",
               "{\"metadata\": {\"total_size\": 24}, \"weight_map\": {"
               "\"model.a\": \"model-00001-of-00002.safetensors\","
               "\"model.c\": \"model-00002-of-00002.safetensors\","
               "\"model.b\": \"model-00001-of-00002.safetensors\"}}");
}

START_TEST(test_sharded) {
    write_shards();
    write_index();
    safetensors_t *st;
    ck_assert_int_eq(safetensors_open_dir(tmpdir, "model", &st), CS_OK);
    ck_assert_uint_eq(safetensors_count(st), 3);
    const st_tensor_t *c = safetensors_find(st, "model.c");
    ck_assert_ptr_nonnull(c);
    ck_assert_float_eq(((const float *)c->data)[0], 6.0f);
    ck_assert_float_eq(((const float *)safetensors_find(st, "model.b")->data)[2], 5.0f);
    ck_assert_str_eq(safetensors_metadata(st, "format"), "pt");
    safetensors_free(st);
}
END_TEST

/* ST_COPY_HUGE reads every shard into the process's memory: the same tensors, bytes and
 * metadata as the mapping, at other addresses, with each file's bytes counted; a tensor of
 * several MiB spans 2 MiB pages; bad files fail as they do mapped */
START_TEST(test_copy_huge) {
    write_shards();
    write_index();
    enum { BIG = 5 << 18 }; /* 5 MiB of F32 */
    float *big = malloc(sizeof(float) * BIG);
    for (int i = 0; i < BIG; i++) big[i] = (float)i * 0.5f;
    st_write_tensor_t bt = { .name = "w", .dtype = CS_DTYPE_F32, .n_dims = 2, .shape = { 5 << 8, 1 << 10 }, .data = big };
    ck_assert_int_eq(safetensors_write(path_in("big.safetensors"), &bt, 1, NULL), CS_OK);
    const char *bases[] = { "model", "big" };
    for (int k = 0; k < 2; k++) {
        safetensors_t *m, *c;
        ck_assert_int_eq(safetensors_open_dir(tmpdir, bases[k], &m), CS_OK);
        ck_assert_int_eq(safetensors_open_dir_how(tmpdir, bases[k], ST_COPY_HUGE, &c), CS_OK);
        ck_assert_uint_eq(safetensors_copied_bytes(m, NULL), 0);
        size_t huge = 0, want = 0, got = safetensors_copied_bytes(c, &huge);
        const char *files[] = { "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "big.safetensors" };
        for (int f = k ? 2 : 0; f < (k ? 3 : 2); f++) {
            struct stat sb;
            ck_assert_int_eq(stat(path_in(files[f]), &sb), 0);
            want += (size_t)sb.st_size;
        }
        ck_assert_uint_eq(got, want);
        ck_assert_uint_le(huge, got);
        ck_assert_uint_eq(safetensors_count(c), safetensors_count(m));
        for (size_t i = 0; i < safetensors_count(m); i++) {
            const st_tensor_t *tm = safetensors_at(m, i), *tc = safetensors_at(c, i);
            ck_assert_str_eq(tc->name, tm->name);
            ck_assert_uint_eq(tc->nbytes, tm->nbytes);
            ck_assert_ptr_ne(tc->data, tm->data);
            ck_assert_uint_eq((uintptr_t)tc->data % 4096, (uintptr_t)tm->data % 4096); /* the file's layout */
            ck_assert_int_eq(memcmp(tc->data, tm->data, tm->nbytes), 0);
        }
        if (k == 1) ck_assert_float_eq(((const float *)safetensors_find(c, "w")->data)[BIG - 1], (float)(BIG - 1) * 0.5f);
        else ck_assert_str_eq(safetensors_metadata(c, "format"), "pt");
        safetensors_free(m);
        safetensors_free(c);
    }
    free(big);
    /* a header that lies, read in: the mapped reader's error */
    write_raw("bad.safetensors", "{\"t\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]}}", 8);
    safetensors_t *st;
    ck_assert_int_eq(safetensors_open_dir_how(tmpdir, "bad", ST_COPY_HUGE, &st), CS_EFORMAT);
    ck_assert_ptr_null(st);
    ck_assert_int_eq(safetensors_open_dir_how(tmpdir, "absent", ST_COPY_HUGE, &st), CS_ENOTFOUND);
}
END_TEST

START_TEST(test_sharded_errors) {
    write_shards();
    safetensors_t *st;
    /* missing shard */
    write_text("model.safetensors.index.json",
               "{\"weight_map\": {\"model.a\": \"model-00001-of-00002.safetensors\","
               "\"model.z\": \"model-00003-of-00003.safetensors\"}}");
    ck_assert_int_eq(safetensors_open_dir(tmpdir, "model", &st), CS_ENOTFOUND);
    ck_assert_ptr_null(st);
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "model-00003-of-00003.safetensors"));
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "model.z"));
    /* tensor listed but absent */
    write_text("model.safetensors.index.json",
               "{\"weight_map\": {\"model.a\": \"model-00001-of-00002.safetensors\","
               "\"model.q\": \"model-00002-of-00002.safetensors\"}}");
    ck_assert_int_eq(safetensors_open_dir(tmpdir, "model", &st), CS_ENOTFOUND);
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "'model.q'"));
    /* tensor listed in the wrong shard */
    write_text("model.safetensors.index.json",
               "{\"weight_map\": {\"model.a\": \"model-00002-of-00002.safetensors\","
               "\"model.c\": \"model-00001-of-00002.safetensors\"}}");
    ck_assert_int_eq(safetensors_open_dir(tmpdir, "model", &st), CS_EFORMAT);
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "'model."));
    /* a shard name that escapes the directory */
    write_text("model.safetensors.index.json", "{\"weight_map\": {\"model.a\": \"../x.safetensors\"}}");
    ck_assert_int_eq(safetensors_open_dir(tmpdir, "model", &st), CS_EFORMAT);
    /* not JSON, no weight_map */
    write_text("model.safetensors.index.json", "{\"weight_map\": ");
    ck_assert_int_eq(safetensors_open_dir(tmpdir, "model", &st), CS_EFORMAT);
    write_text("model.safetensors.index.json", "{\"metadata\": {}}");
    ck_assert_int_eq(safetensors_open_dir(tmpdir, "model", &st), CS_EFORMAT);
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "weight_map"));
    /* duplicate name across shards */
    float x = 0;
    st_write_tensor_t dup = { .name = "model.a", .dtype = CS_DTYPE_F32, .n_dims = 1, .shape = { 1 }, .data = &x };
    ck_assert_int_eq(safetensors_write(path_in("model-00002-of-00002.safetensors"), &dup, 1, NULL), CS_OK);
    write_text("model.safetensors.index.json",
               "{\"weight_map\": {\"model.a\": \"model-00001-of-00002.safetensors\","
               "\"model.b\": \"model-00002-of-00002.safetensors\"}}");
    ck_assert_int_eq(safetensors_open_dir(tmpdir, "model", &st), CS_EFORMAT);
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "'model.a'"));
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "both"));
}
END_TEST

START_TEST(test_single_dir) {
    safetensors_t *st;
    ck_assert_int_eq(safetensors_open_dir(tmpdir, "adapter_model", &st), CS_ENOTFOUND);
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "adapter_model.safetensors"));
    write_sample("adapter_model.safetensors");
    ck_assert_int_eq(safetensors_open_dir(tmpdir, "adapter_model", &st), CS_OK);
    ck_assert_uint_eq(safetensors_count(st), 4);
    safetensors_free(st);
}
END_TEST

START_TEST(test_bad_files) {
    /* missing file */
    expect_fail("absent.safetensors", CS_ENOTFOUND, "absent.safetensors");
    /* shorter than the length prefix */
    write_bytes("short.safetensors", "\x10\x00\x00", 3);
    expect_fail("short.safetensors", CS_EFORMAT, "short.safetensors");
    write_bytes("zero.safetensors", "", 0);
    expect_fail("zero.safetensors", CS_EFORMAT, "too short");
    /* header length larger than the file, and absurdly large */
    unsigned char big[16] = { 0xff, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, '{', '}' };
    write_bytes("hlen.safetensors", big, 10);
    expect_fail("hlen.safetensors", CS_EFORMAT, "larger than the file");
    unsigned char huge[10] = { 0, 0, 0, 0, 0, 0, 0, 0x80, '{', '}' };
    write_bytes("huge.safetensors", huge, 10);
    expect_fail("huge.safetensors", CS_EFORMAT, "limit");
    unsigned char one[9] = { 1, 0, 0, 0, 0, 0, 0, 0, '{' };
    write_bytes("one.safetensors", one, 9);
    expect_fail("one.safetensors", CS_EFORMAT, "too small");
    /* headers that must not open: file, header, data bytes after it, error, part of the message */
    static const struct {
        const char *name, *header;
        size_t dlen;
        int want;
        const char *needle;
    } bad[] = {
        /* header not JSON / not an object / bad start */
        {"notjson.safetensors", "{\"a\": [1, 2", 0, CS_EFORMAT, "not valid JSON"},
        {"array.safetensors", "[1, 2, 3]", 0, CS_EFORMAT, NULL},
        {"trail.safetensors", "{} x", 0, CS_EFORMAT, "JSON"},
        {"dupkey.safetensors",
         "{\"t\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
         "\"t\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}", 2, CS_EFORMAT, NULL},
        /* unknown dtype, known-but-unsupported dtype */
        {"dtype.safetensors", "{\"model.w\":{\"dtype\":\"Q4_K\",\"shape\":[2],\"data_offsets\":[0,2]}}",
         2, CS_EFORMAT, "tensor 'model.w': unknown dtype 'Q4_K'"},
        {"fp8.safetensors", "{\"model.w\":{\"dtype\":\"F8_E4M3\",\"shape\":[2],\"data_offsets\":[0,2]}}",
         2, CS_EUNSUPPORTED, "'model.w'"},
        {"dtype2.safetensors", "{\"model.w\":{\"dtype\":7,\"shape\":[2],\"data_offsets\":[0,2]}}",
         2, CS_EFORMAT, "'model.w'"},
        /* missing keys, bad shapes */
        {"nodtype.safetensors", "{\"model.w\":{\"shape\":[2],\"data_offsets\":[0,2]}}",
         2, CS_EFORMAT, "'model.w': missing 'dtype'"},
        {"noshape.safetensors", "{\"model.w\":{\"dtype\":\"U8\",\"data_offsets\":[0,2]}}",
         2, CS_EFORMAT, "missing 'shape'"},
        {"negshape.safetensors", "{\"model.w\":{\"dtype\":\"U8\",\"shape\":[-2],\"data_offsets\":[0,2]}}",
         2, CS_EFORMAT, "'model.w'"},
        {"realshape.safetensors", "{\"model.w\":{\"dtype\":\"U8\",\"shape\":[2.0],\"data_offsets\":[0,2]}}",
         2, CS_EFORMAT, "'model.w'"},
        {"dims.safetensors", "{\"model.w\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,1]}}",
         1, CS_EFORMAT, "dimensions"},
        {"ovf.safetensors",
         "{\"model.w\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,1]}}",
         1, CS_EFORMAT, "overflows"},
        {"entry.safetensors", "{\"model.w\":[1,2]}", 0, CS_EFORMAT, "'model.w'"},
        /* offsets out of bounds, reversed, malformed */
        {"oob.safetensors",
         "{\"model.layers.0.mlp.up_proj.weight\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}",
         8, CS_EFORMAT, "tensor 'model.layers.0.mlp.up_proj.weight': data_offsets [0,16] exceed data size 8"},
        {"rev.safetensors", "{\"model.w\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[2,0]}}",
         2, CS_EFORMAT, "'model.w'"},
        {"offs.safetensors", "{\"model.w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0]}}",
         2, CS_EFORMAT, "'model.w'"},
        {"negoff.safetensors", "{\"model.w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[-1,0]}}",
         2, CS_EFORMAT, "'model.w'"},
        /* size does not match dtype x shape */
        {"size.safetensors", "{\"model.w\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,12]}}",
         16, CS_EFORMAT, "tensor 'model.w': data_offsets [0,12] hold 12 bytes but F32 [2, 2] needs 16"},
        /* one tensor inside another */
        {"contain.safetensors",
         "{\"big\":{\"dtype\":\"U8\",\"shape\":[16],\"data_offsets\":[0,16]},"
         "\"small\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[4,6]}}", 16, CS_EFORMAT, "'small'"},
        /* metadata must map strings to strings */
        {"meta.safetensors", "{\"__metadata__\":{\"format\":1}}", 0, CS_EFORMAT, "__metadata__"},
        {"meta2.safetensors", "{\"__metadata__\":[\"pt\"]}", 0, CS_EFORMAT, "__metadata__"},
    };
    for (size_t i = 0; i < CS_ARRAY_LEN(bad); i++) {
        write_raw(bad[i].name, bad[i].header, bad[i].dlen);
        expect_fail(bad[i].name, bad[i].want, bad[i].needle);
    }
    /* overlapping tensors, in either header order: the message names both */
    write_raw("overlap.safetensors",
              "{\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]},"
              "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 16);
    expect_fail("overlap.safetensors", CS_EFORMAT, "overlap");
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "'a'"));
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "'b'"));
    /* data section cut short (a truncated download) */
    write_sample("full.safetensors");
    size_t len;
    char *raw = cs_read_file(path_in("full.safetensors"), &len);
    write_bytes("trunc.safetensors", raw, len - 4);
    free(raw);
    expect_fail("trunc.safetensors", CS_EFORMAT, "exceed data size");
}
END_TEST

START_TEST(test_good_edge_cases) {
    /* adjacent tensors, zero-size tensors anywhere, holes, trailing header spaces: all valid */
    write_raw("ok.safetensors",
              "{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
              "\"z\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[2,2]},"
              "\"b\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[6,8]},"
              "\"__metadata__\":{}}      ", 8);
    safetensors_t *st;
    ck_assert_int_eq(safetensors_open(path_in("ok.safetensors"), &st), CS_OK);
    ck_assert_uint_eq(safetensors_count(st), 3);
    ck_assert_int_eq(((const unsigned char *)safetensors_find(st, "b")->data)[0], 6);
    safetensors_free(st);
    write_raw("empty.safetensors", "{}", 0);
    ck_assert_int_eq(safetensors_open(path_in("empty.safetensors"), &st), CS_OK);
    ck_assert_uint_eq(safetensors_count(st), 0);
    safetensors_free(st);
}
END_TEST

/* an in-memory file (memfd) holding `data`, reachable by path: no disk round trips */
static const char *mem_file(int fd, const void *data, size_t n) {
    static char p[64];
    ck_assert_int_eq(ftruncate(fd, 0), 0);
    ck_assert_int_eq(pwrite(fd, data, n, 0), (ssize_t)n);
    snprintf(p, sizeof p, "/proc/self/fd/%d", fd);
    return p;
}

/* every truncation and many corruptions of a valid file: a status, never a crash */
START_TEST(test_no_crash_on_corruption) {
    write_sample("base.safetensors");
    size_t len;
    unsigned char *raw = (unsigned char *)cs_read_file(path_in("base.safetensors"), &len);
    ck_assert_ptr_nonnull(raw);
    int fd = memfd_create("cs_test_st", 0);
    ck_assert_int_ge(fd, 0);
    for (size_t cut = 0; cut < len; cut++) {
        safetensors_t *st = NULL;
        int rc = safetensors_open(mem_file(fd, raw, cut), &st);
        ck_assert_int_lt(rc, 0);
        ck_assert_ptr_null(st);
    }
    unsigned char *mut = malloc(len);
    uint64_t x = 12345;
    for (int iter = 0; iter < 3000; iter++) {
        memcpy(mut, raw, len);
        int flips = 1 + iter % 4;
        for (int k = 0; k < flips; k++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            size_t pos = (size_t)(x >> 33) % (len < 200 ? len : 200); /* mostly the header */
            mut[pos] = (unsigned char)(x >> 20);
        }
        safetensors_t *st = NULL;
        int rc = safetensors_open(mem_file(fd, mut, len), &st);
        if (rc == CS_OK) {
            for (size_t i = 0; i < safetensors_count(st); i++) {
                const st_tensor_t *t = safetensors_at(st, i);
                volatile unsigned char sink = 0;
                for (size_t b = 0; b < t->nbytes; b++) sink ^= ((const unsigned char *)t->data)[b];
                (void)sink;
                ck_assert_ptr_eq(safetensors_find(st, t->name), t);
            }
            safetensors_free(st);
        } else {
            ck_assert_ptr_null(st);
            ck_assert_int_lt(rc, 0);
        }
    }
    close(fd);
    free(mut);
    free(raw);
}
END_TEST

int main(void) {
    const TTest *const tests[] = {
        test_round_trip, test_write_no_metadata_and_errors, test_sharded, test_copy_huge,
        test_sharded_errors, test_single_dir, test_bad_files, test_good_edge_cases,
        test_no_crash_on_corruption,
    };
    return cs_check_main_fixture("safetensors", tests, CS_ARRAY_LEN(tests), 0, CK_FORK, setup, teardown);
}
