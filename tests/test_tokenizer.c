/* test_tokenizer.c: engine/tokenizer.c on tiny tokenizer.json files written inline (no
 * Python needed): a byte-level BPE with merges and special tokens, a SentencePiece-style
 * BPE with byte fallback, unk handling, Metaspace, tokenizer_config.json and
 * generation_config.json, streaming that never emits a partial UTF-8 sequence, concurrent
 * encoding, and load errors that must name what they refuse. Expected ids are derived by
 * hand in comments. */
#include <check.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "text/tokenizer.h"
#include "testutil.h"

/* ---------------------------------------------------------------- fixtures ---- */

static char g_dir[64];

static void write_file(const char *name, const char *text) {
    char path[128];
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    FILE *f = fopen(path, "w");
    ck_assert_msg(f != NULL, "cannot write %s", path);
    fputs(text, f);
    fclose(f);
}

static void setup(void) {
    strcpy(g_dir, "/tmp/cs_tok_test_XXXXXX");
    ck_assert(mkdtemp(g_dir) != NULL);
}

static void teardown(void) { cs_rmtree(g_dir); }

/* Byte-level BPE in the GPT-2 mould. Byte-level alphabet: ' ' -> Ġ, é (C3 A9) -> Ã ©,
 * 😀 (F0 9F 98 80) -> ð Ł ĺ Ģ. */
static const char *BYTELEVEL_JSON =
    "{\"version\": \"1.0\", \"truncation\": null, \"padding\": null,\n"
    " \"added_tokens\": [\n"
    "  {\"id\": 25, \"content\": \"<|end|>\", \"single_word\": false, \"lstrip\": false, \"rstrip\": false,"
    "   \"normalized\": false, \"special\": true},\n"
    "  {\"id\": 26, \"content\": \"<|bos|>\", \"single_word\": false, \"lstrip\": false, \"rstrip\": false,"
    "   \"normalized\": false, \"special\": true}],\n"
    " \"normalizer\": null,\n"
    " \"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true,"
    "   \"use_regex\": true},\n"
    " \"post_processor\": {\"type\": \"TemplateProcessing\","
    "   \"single\": [{\"SpecialToken\": {\"id\": \"<|bos|>\", \"type_id\": 0}}, {\"Sequence\": {\"id\": \"A\", \"type_id\": 0}}],"
    "   \"pair\": [], \"special_tokens\": {\"<|bos|>\": {\"id\": \"<|bos|>\", \"ids\": [26], \"tokens\": [\"<|bos|>\"]}}},\n"
    " \"decoder\": {\"type\": \"ByteLevel\", \"add_prefix_space\": true, \"trim_offsets\": true, \"use_regex\": true},\n"
    " \"model\": {\"type\": \"BPE\", \"dropout\": null, \"unk_token\": null, \"continuing_subword_prefix\": null,"
    "   \"end_of_word_suffix\": null, \"fuse_unk\": false, \"byte_fallback\": false, \"ignore_merges\": false,\n"
    "   \"vocab\": {\"h\": 0, \"e\": 1, \"l\": 2, \"o\": 3, \"\\u0120\": 4, \"w\": 5, \"r\": 6, \"d\": 7, \"!\": 8,"
    "     \"he\": 9, \"ll\": 10, \"hell\": 11, \"hello\": 12, \"\\u0120w\": 13, \"or\": 14, \"\\u0120wor\": 15,"
    "     \"ld\": 16, \"\\u0120world\": 17, \"\\u00c3\": 18, \"\\u00a9\": 19, \"\\u00c3\\u00a9\": 20,"
    "     \"\\u00f0\": 21, \"\\u0141\": 22, \"\\u013a\": 23, \"\\u0122\": 24},\n"
    "   \"merges\": [\"h e\", \"l l\", \"he ll\", \"hell o\", \"\\u0120 w\", \"o r\", \"\\u0120w or\", \"l d\","
    "     \"\\u0120wor ld\", [\"\\u00c3\", \"\\u00a9\"]]}}\n";

/* SentencePiece-style BPE (Llama 2): ids 3..258 are <0x00>..<0xFF>. */
static char *spm_json(bool byte_fallback, bool fuse_unk) {
    static char buf[32768];
    int n = snprintf(buf, sizeof buf,
        "{\"version\": \"1.0\", \"truncation\": null, \"padding\": null,\n"
        " \"added_tokens\": ["
        "{\"id\": 0, \"content\": \"<unk>\", \"single_word\": false, \"lstrip\": false, \"rstrip\": false, \"normalized\": false, \"special\": true},"
        "{\"id\": 1, \"content\": \"<s>\", \"single_word\": false, \"lstrip\": false, \"rstrip\": false, \"normalized\": false, \"special\": true},"
        "{\"id\": 2, \"content\": \"</s>\", \"single_word\": false, \"lstrip\": false, \"rstrip\": false, \"normalized\": false, \"special\": true}],\n"
        " \"normalizer\": {\"type\": \"Sequence\", \"normalizers\": [{\"type\": \"Prepend\", \"prepend\": \"\\u2581\"},"
        "   {\"type\": \"Replace\", \"pattern\": {\"String\": \" \"}, \"content\": \"\\u2581\"}]},\n"
        " \"pre_tokenizer\": null,\n"
        " \"post_processor\": {\"type\": \"TemplateProcessing\","
        "   \"single\": [{\"SpecialToken\": {\"id\": \"<s>\", \"type_id\": 0}}, {\"Sequence\": {\"id\": \"A\", \"type_id\": 0}}],"
        "   \"pair\": [], \"special_tokens\": {\"<s>\": {\"id\": \"<s>\", \"ids\": [1], \"tokens\": [\"<s>\"]}}},\n"
        " \"decoder\": {\"type\": \"Sequence\", \"decoders\": [{\"type\": \"Replace\", \"pattern\": {\"String\": \"\\u2581\"}, \"content\": \" \"},"
        "   {\"type\": \"ByteFallback\"}, {\"type\": \"Fuse\"}, {\"type\": \"Strip\", \"content\": \" \", \"start\": 1, \"stop\": 0}]},\n"
        " \"model\": {\"type\": \"BPE\", \"dropout\": null, \"unk_token\": \"<unk>\", \"continuing_subword_prefix\": null,"
        "   \"end_of_word_suffix\": null, \"fuse_unk\": %s, \"byte_fallback\": %s,\n"
        "   \"vocab\": {\"<unk>\": 0, \"<s>\": 1, \"</s>\": 2",
        fuse_unk ? "true" : "false", byte_fallback ? "true" : "false");
    for (int b = 0; b < 256; b++) n += snprintf(buf + n, sizeof buf - n, ", \"<0x%02X>\": %d", b, 3 + b);
    snprintf(buf + n, sizeof buf - n,
             ", \"\\u2581\": 259, \"a\": 260, \"b\": 261, \"\\u2581a\": 262, \"ab\": 263, \"\\u2581ab\": 264},\n"
             "   \"merges\": [\"\\u2581 a\", \"a b\", \"\\u2581a b\"]}}\n");
    return buf;
}

static char *metaspace_json(const char *scheme) {
    static char buf[4096];
    snprintf(buf, sizeof buf,
        "{\"version\": \"1.0\", \"added_tokens\": [{\"id\": 5, \"content\": \"<s>\", \"single_word\": false,"
        "  \"lstrip\": false, \"rstrip\": false, \"normalized\": false, \"special\": true}],"
        " \"normalizer\": null,"
        " \"pre_tokenizer\": {\"type\": \"Metaspace\", \"replacement\": \"\\u2581\", \"prepend_scheme\": \"%s\", \"split\": true},"
        " \"post_processor\": null,"
        " \"decoder\": {\"type\": \"Metaspace\", \"replacement\": \"\\u2581\", \"prepend_scheme\": \"%s\", \"split\": true},"
        " \"model\": {\"type\": \"BPE\", \"vocab\": {\"\\u2581\": 0, \"a\": 1, \"b\": 2, \"\\u2581a\": 3, \"\\u2581b\": 4, \"<s>\": 5},"
        "   \"merges\": [\"\\u2581 a\", \"\\u2581 b\"]}}",
        scheme, scheme);
    return buf;
}

static tokenizer_t *load(const char *json) {
    write_file("tokenizer.json", json);
    tokenizer_t *t = NULL;
    int rc = tokenizer_load(g_dir, &t);
    ck_assert_msg(rc == CS_OK, "load: %s", cs_error_last());
    return t;
}

static void expect_ids(const tokenizer_t *t, const char *text, bool add_special, const int32_t *want, size_t n) {
    int32_t *ids;
    size_t got;
    int rc = tokenizer_encode(t, text, strlen(text), add_special, &ids, &got);
    ck_assert_msg(rc == CS_OK, "encode '%s': %s", text, cs_error_last());
    char msg[512] = "";
    size_t m = 0;
    for (size_t i = 0; i < got && m + 16 < sizeof msg; i++) m += (size_t)snprintf(msg + m, sizeof msg - m, "%d ", ids[i]);
    ck_assert_msg(got == n, "'%s': got %zu ids (%s), want %zu", text, got, msg, n);
    for (size_t i = 0; i < n; i++) ck_assert_msg(ids[i] == want[i], "'%s': id %zu is %d, want %d (%s)", text, i, ids[i], want[i], msg);
    free(ids);
}

static void expect_decode(const tokenizer_t *t, const int32_t *ids, size_t n, bool skip, const char *want) {
    char *s;
    size_t len;
    int rc = tokenizer_decode(t, ids, n, skip, &s, &len);
    ck_assert_msg(rc == CS_OK, "decode: %s", cs_error_last());
    ck_assert_uint_eq(len, strlen(s));
    ck_assert_str_eq(s, want);
    free(s);
}

static bool valid_utf8(const char *s, size_t n) {
    const unsigned char *p = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        size_t k = p[i] < 0x80 ? 1 : (p[i] >> 5) == 6 ? 2 : (p[i] >> 4) == 14 ? 3 : (p[i] >> 3) == 30 ? 4 : 0;
        if (!k || i + k > n) return false;
        for (size_t j = 1; j < k; j++)
            if ((p[i + j] & 0xC0) != 0x80) return false;
        i += k;
    }
    return true;
}

/* Streams ids; checks every piece is valid UTF-8, optionally the pieces themselves, and that
 * the concatenation equals tokenizer_decode. pieces: n+1 expected strings (last = flush) or NULL. */
static void expect_stream(const tokenizer_t *t, const int32_t *ids, size_t n, bool skip, const char *const *pieces) {
    tokenizer_stream_t *s = tokenizer_stream_new(t, skip);
    ck_assert(s != NULL);
    char all[4096] = "";
    size_t len = 0;
    for (size_t i = 0; i <= n; i++) {
        char *p;
        size_t pl;
        int rc = i < n ? tokenizer_stream_push(s, ids[i], &p, &pl) : tokenizer_stream_flush(s, &p, &pl);
        ck_assert_msg(rc == CS_OK, "stream: %s", cs_error_last());
        ck_assert_msg(valid_utf8(p, pl), "piece %zu is not valid UTF-8", i);
        if (pieces) ck_assert_msg(strcmp(p, pieces[i]) == 0, "piece %zu: '%s', want '%s'", i, p, pieces[i]);
        ck_assert(len + pl < sizeof all);
        memcpy(all + len, p, pl);
        len += pl;
        all[len] = 0;
        free(p);
    }
    tokenizer_stream_free(s);
    char *d;
    size_t dl;
    ck_assert(tokenizer_decode(t, ids, n, skip, &d, &dl) == CS_OK);
    ck_assert_msg(dl == len && memcmp(d, all, len) == 0, "stream '%s' != decode '%s'", all, d);
    free(d);
}

/* 300 sequences of 1 to MAX (at most 32) ids, each streamed as expect_stream() checks it,
 * special tokens skipped in every other one; the ids come from a linear congruential
 * generator started at SEED, ID turning each of its states into an id */
static void expect_random_streams(const tokenizer_t *t, unsigned seed, size_t max, int32_t (*id)(unsigned state)) {
    ck_assert_uint_le(max, 32);
    for (int k = 0; k < 300; k++) {
        int32_t ids[32];
        size_t n = 1 + (size_t)k % max;
        for (size_t i = 0; i < n; i++) {
            seed = seed * 1103515245u + 12345u;
            ids[i] = id(seed);
        }
        expect_stream(t, ids, n, k & 1, NULL);
    }
}

/* any id of BYTELEVEL_JSON's vocabulary, and one unknown id (27) */
static int32_t bytelevel_id(unsigned state) { return (int32_t)((state >> 16) % 28); }

/* for spm_json(): mostly bytes of multi-byte sequences, some pieces and specials */
static int32_t spm_id(unsigned state) {
    unsigned r = (state >> 16) % 100;
    return r < 50 ? (int32_t)(3 + 0x80 + (state >> 8) % 0x78) : r < 85 ? (int32_t)(259 + r % 6) : (int32_t)(r % 3);
}

static void expect_load_error(const char *json, int want, const char *needle) {
    write_file("tokenizer.json", json);
    tokenizer_t *t = (tokenizer_t *)0x1;
    cs_error_clear();
    int rc = tokenizer_load(g_dir, &t);
    ck_assert_msg(rc == want, "got %d (%s), want %d", rc, cs_error_last(), want);
    ck_assert(t == NULL);
    ck_assert_msg(cs_error_last() != NULL && strstr(cs_error_last(), needle) != NULL,
                  "message '%s' lacks '%s'", cs_error_last(), needle);
}

/* ---------------------------------------------------------------- byte-level ---- */

START_TEST(test_bytelevel_encode) {
    tokenizer_t *t = load(BYTELEVEL_JSON);
    /* pieces "hello", " world", "!": h e l l o -> he, ll -> hell -> hello; Ġ w o r l d ->
     * Ġw, or -> Ġwor, ld -> Ġworld */
    expect_ids(t, "hello world!", false, (int32_t[]){12, 17, 8}, 3);
    expect_ids(t, "hello world!", true, (int32_t[]){26, 12, 17, 8}, 4);
    expect_ids(t, "hello<|end|>hello", false, (int32_t[]){12, 25, 12}, 3);
    expect_ids(t, "<|end|><|bos|>", true, (int32_t[]){26, 25, 26}, 3);
    expect_ids(t, "\xC3\xA9", false, (int32_t[]){20}, 1);                     /* é: merged */
    expect_ids(t, "\xF0\x9F\x98\x80", false, (int32_t[]){21, 22, 23, 24}, 4); /* 😀: 4 bytes */
    expect_ids(t, "", false, NULL, 0);
    expect_ids(t, "", true, (int32_t[]){26}, 1);
    expect_ids(t, "z", false, NULL, 0); /* not in vocab, no unk, no byte fallback: dropped */
    expect_ids(t, "z", false, NULL, 0); /* again: now a word-cache hit with no ids (was UB) */
    ck_assert_int_eq(tokenizer_vocab_size(t), 27);
    ck_assert_int_eq(tokenizer_token_to_id(t, "<|end|>"), 25);
    ck_assert_int_eq(tokenizer_token_to_id(t, "hello"), 12);
    ck_assert_int_eq(tokenizer_token_to_id(t, "nope"), -1);
    ck_assert_str_eq(tokenizer_id_to_token(t, 17), "\xC4\xA0world");
    ck_assert_ptr_null(tokenizer_id_to_token(t, 27));
    ck_assert(tokenizer_is_special(t, 25));
    ck_assert(!tokenizer_is_special(t, 12));
    tokenizer_free(t);
}
END_TEST

START_TEST(test_bytelevel_decode) {
    tokenizer_t *t = load(BYTELEVEL_JSON);
    expect_decode(t, (int32_t[]){26, 12, 17, 8}, 4, false, "<|bos|>hello world!");
    expect_decode(t, (int32_t[]){26, 12, 17, 8}, 4, true, "hello world!");
    expect_decode(t, (int32_t[]){12, 25, 12}, 3, true, "hellohello");
    expect_decode(t, (int32_t[]){21, 22, 23, 24}, 4, false, "\xF0\x9F\x98\x80");
    /* an incomplete sequence decodes to U+FFFD, as String::from_utf8_lossy */
    expect_decode(t, (int32_t[]){21}, 1, false, "\xEF\xBF\xBD");
    expect_decode(t, (int32_t[]){21, 22, 12}, 3, false, "\xEF\xBF\xBDhello");
    expect_decode(t, (int32_t[]){19, 18}, 2, false, "\xEF\xBF\xBD\xEF\xBF\xBD"); /* A9 C3 */
    /* unknown ids are skipped */
    expect_decode(t, (int32_t[]){12, 99999, -1, 12}, 4, false, "hellohello");
    expect_decode(t, NULL, 0, false, "");
    tokenizer_free(t);
}
END_TEST

START_TEST(test_bytelevel_stream) {
    tokenizer_t *t = load(BYTELEVEL_JSON);
    /* the emoji arrives byte by byte: nothing until its last byte */
    expect_stream(t, (int32_t[]){12, 21, 22, 23, 24, 17}, 6, false,
                  (const char *const[]){"hello", "", "", "", "\xF0\x9F\x98\x80", " world", ""});
    /* an incomplete tail comes out of the flush as U+FFFD */
    expect_stream(t, (int32_t[]){12, 21, 22}, 3, false, (const char *const[]){"hello", "", "", "\xEF\xBF\xBD"});
    expect_stream(t, (int32_t[]){26, 12, 25, 17}, 4, true, (const char *const[]){"", "hello", "", " world", ""});
    /* random sequences: pieces are valid UTF-8 and add up to decode */
    expect_random_streams(t, 12345, 24, bytelevel_id);
    tokenizer_free(t);
}
END_TEST

START_TEST(test_invalid_input) {
    tokenizer_t *t = load(BYTELEVEL_JSON);
    int32_t *ids = NULL;
    size_t n = 0;
    cs_error_clear();
    ck_assert_int_eq(tokenizer_encode(t, "a\xC3(", 3, false, &ids, &n), CS_EINVAL);
    ck_assert(strstr(cs_error_last(), "UTF-8") != NULL);
    ck_assert_ptr_null(ids);
    ck_assert_int_eq(tokenizer_encode(t, NULL, 3, false, &ids, &n), CS_EINVAL);
    ck_assert_int_eq(tokenizer_encode(NULL, "a", 1, false, &ids, &n), CS_EINVAL);
    char *s;
    ck_assert_int_eq(tokenizer_decode(t, NULL, 2, false, &s, NULL), CS_EINVAL);
    ck_assert_ptr_null(tokenizer_stream_new(NULL, false));
    /* embedded NUL is a character like any other */
    ck_assert_int_eq(tokenizer_encode(t, "h\0h", 3, false, &ids, &n), CS_OK);
    ck_assert_uint_eq(n, 2); /* NUL (Ā) is not in the vocab and is dropped */
    free(ids);
    tokenizer_free(t);
    tokenizer_free(NULL);
    tokenizer_stream_free(NULL);
}
END_TEST

/* ---------------------------------------------------------------- SentencePiece style ---- */

START_TEST(test_spm_encode_decode) {
    tokenizer_t *t = load(spm_json(true, true));
    /* "ab ab" -> "▁ab▁ab": ▁ a (rank 0) twice, then ▁a b (rank 2) twice */
    expect_ids(t, "ab ab", true, (int32_t[]){1, 264, 264}, 3);
    expect_ids(t, "ab ab", false, (int32_t[]){264, 264}, 2);
    /* "é" -> "▁é": ▁ then the bytes C3 A9 of é */
    expect_ids(t, "\xC3\xA9", false, (int32_t[]){259, 3 + 0xC3, 3 + 0xA9}, 3);
    /* the normalizer runs on each piece between special tokens: "▁x", </s>, "▁y" */
    expect_ids(t, "x</s>y", false, (int32_t[]){259, 3 + 'x', 2, 259, 3 + 'y'}, 5);
    expect_ids(t, "", true, (int32_t[]){1}, 1);
    expect_decode(t, (int32_t[]){1, 264, 264}, 3, false, "<s> ab ab");
    expect_decode(t, (int32_t[]){1, 264, 264}, 3, true, "ab ab");
    expect_decode(t, (int32_t[]){259, 3 + 0xC3, 3 + 0xA9}, 3, false, "\xC3\xA9");
    /* invalid byte runs: one U+FFFD per byte */
    expect_decode(t, (int32_t[]){3 + 0xC3, 260}, 2, false, "\xEF\xBF\xBD" "a");
    expect_decode(t, (int32_t[]){3 + 0xE2, 3 + 0x82}, 2, false, "\xEF\xBF\xBD\xEF\xBF\xBD");
    expect_decode(t, (int32_t[]){3 + 0xE2, 3 + 0x82, 3 + 0xAC}, 3, false, "\xE2\x82\xAC");
    tokenizer_free(t);
}
END_TEST

START_TEST(test_spm_stream) {
    tokenizer_t *t = load(spm_json(true, true));
    /* "▁" alone decodes to "" (Strip); the byte run is held until a non-byte token */
    expect_stream(t, (int32_t[]){259, 3 + 0xC3, 3 + 0xA9, 260}, 4, false,
                  (const char *const[]){"", "", "", "\xC3\xA9" "a", ""});
    expect_stream(t, (int32_t[]){259, 3 + 0xC3, 3 + 0xA9}, 3, false, (const char *const[]){"", "", "", "\xC3\xA9"});
    /* a later byte can turn a valid run invalid: € then 0x80 -> four U+FFFD */
    expect_stream(t, (int32_t[]){264, 3 + 0xE2, 3 + 0x82, 3 + 0xAC, 3 + 0x80, 264}, 6, false, NULL);
    /* Strip only removes the space at the very start, never after text was emitted */
    expect_stream(t, (int32_t[]){264, 259, 264}, 3, false, (const char *const[]){"ab", " ", " ab", ""});
    expect_stream(t, (int32_t[]){1, 264, 2, 264}, 4, true, (const char *const[]){"", "ab", "", " ab", ""});
    expect_random_streams(t, 99, 30, spm_id);
    tokenizer_free(t);
}
END_TEST

START_TEST(test_unk) {
    tokenizer_t *t = load(spm_json(false, true));
    expect_ids(t, "cc", false, (int32_t[]){259, 0}, 2); /* fused */
    expect_decode(t, (int32_t[]){259, 0}, 2, false, "<unk>");
    tokenizer_free(t);
    t = load(spm_json(false, false));
    expect_ids(t, "cc", false, (int32_t[]){259, 0, 0}, 3);
    expect_ids(t, "cac", false, (int32_t[]){259, 0, 260, 0}, 4);
    tokenizer_free(t);
}
END_TEST

START_TEST(test_metaspace) {
    tokenizer_t *t = load(metaspace_json("first"));
    /* "a b" -> "▁a▁b" -> "▁a" "▁b"; after <s> the piece is not first: "a" "▁b" */
    expect_ids(t, "a b", false, (int32_t[]){3, 4}, 2);
    expect_ids(t, "<s>a b", false, (int32_t[]){5, 1, 4}, 3);
    expect_decode(t, (int32_t[]){3, 4}, 2, false, "a b");
    expect_stream(t, (int32_t[]){3, 4, 3}, 3, false, (const char *const[]){"a", " b", " a", ""});
    tokenizer_free(t);
    t = load(metaspace_json("always"));
    expect_ids(t, "<s>a b", false, (int32_t[]){5, 3, 4}, 3);
    tokenizer_free(t);
    t = load(metaspace_json("never"));
    expect_ids(t, "a b", false, (int32_t[]){1, 4}, 2);
    expect_decode(t, (int32_t[]){3, 4}, 2, false, " a b");
    tokenizer_free(t);
}
END_TEST

/* ---------------------------------------------------------------- configs ---- */

START_TEST(test_config) {
    write_file("tokenizer_config.json",
               "{\"bos_token\": {\"content\": \"<|bos|>\", \"lstrip\": false}, \"eos_token\": \"<|end|>\","
               " \"add_bos_token\": true, \"model_max_length\": 1000000000000000019884624838656,"
               " \"chat_template\": [{\"name\": \"tool_use\", \"template\": \"T\"},"
               " {\"name\": \"default\", \"template\": \"{{ bos_token }}D\"}]}");
    write_file("generation_config.json", "{\"eos_token_id\": [25, 12], \"bos_token_id\": 26}");
    tokenizer_t *t = load(BYTELEVEL_JSON);
    ck_assert_int_eq(tokenizer_bos_id(t), 26);
    const int32_t *eos;
    ck_assert_int_eq(tokenizer_eos_ids(t, &eos), 2);
    ck_assert_int_eq(eos[0], 25);
    ck_assert_int_eq(eos[1], 12);
    ck_assert_str_eq(tokenizer_chat_template(t), "{{ bos_token }}D");
    tokenizer_free(t);
    write_file("tokenizer_config.json", "{\"eos_token\": null, \"chat_template\": \"S\"}");
    char path[128];
    snprintf(path, sizeof path, "%s/generation_config.json", g_dir);
    unlink(path);
    t = load(BYTELEVEL_JSON);
    ck_assert_int_eq(tokenizer_bos_id(t), -1);
    ck_assert_int_eq(tokenizer_eos_ids(t, &eos), 0);
    ck_assert_str_eq(tokenizer_chat_template(t), "S");
    tokenizer_free(t);
}
END_TEST

/* ---------------------------------------------------------------- threads ---- */

static const char *THREAD_TEXTS[] = {"hello world!", "hello<|end|>hello", "\xC3\xA9 hello", "world world",
                                     "\xF0\x9F\x98\x80!", "hellohello world"};

static void *encode_worker(void *arg) {
    const tokenizer_t *t = arg;
    int32_t *ref[6];
    size_t nref[6];
    for (int k = 0; k < 6; k++)
        if (tokenizer_encode(t, THREAD_TEXTS[k], strlen(THREAD_TEXTS[k]), true, &ref[k], &nref[k]) != CS_OK)
            return (void *)1;
    intptr_t bad = 0;
    for (int i = 0; i < 3000; i++) {
        int k = i % 6;
        int32_t *ids;
        size_t n;
        if (tokenizer_encode(t, THREAD_TEXTS[k], strlen(THREAD_TEXTS[k]), true, &ids, &n) != CS_OK ||
            n != nref[k] || memcmp(ids, ref[k], n * sizeof *ids) != 0)
            bad = 1;
        free(ids);
    }
    for (int k = 0; k < 6; k++) free(ref[k]);
    return (void *)bad;
}

/* encode takes a const tokenizer; several threads share one (its word cache is locked) */
START_TEST(test_threads) {
    tokenizer_t *t = load(BYTELEVEL_JSON);
    pthread_t th[4];
    for (int i = 0; i < 4; i++) ck_assert_int_eq(pthread_create(&th[i], NULL, encode_worker, t), 0);
    for (int i = 0; i < 4; i++) {
        void *r;
        pthread_join(th[i], &r);
        ck_assert_msg(r == NULL, "thread %d saw different ids", i);
    }
    tokenizer_free(t);
}
END_TEST

/* ---------------------------------------------------------------- errors ---- */

/* BYTELEVEL_JSON with one substring replaced */
static char *variant(const char *from, const char *to) {
    static char buf[8192];
    const char *p = strstr(BYTELEVEL_JSON, from);
    ck_assert_msg(p != NULL, "fixture lacks %s", from);
    snprintf(buf, sizeof buf, "%.*s%s%s", (int)(p - BYTELEVEL_JSON), BYTELEVEL_JSON, to, p + strlen(from));
    return buf;
}

START_TEST(test_load_errors) {
    expect_load_error("{\"version\": \"1.0\", \"model\": {", CS_EFORMAT, "bad JSON");
    expect_load_error("[1, 2]", CS_EFORMAT, "not a JSON object");
    expect_load_error(variant("\"normalizer\": null", "\"normalizer\": {\"type\": \"Precompiled\", \"precompiled_charsmap\": \"\"}"),
                      CS_EUNSUPPORTED, "normalizer type 'Precompiled'");
    expect_load_error(variant("\"pre_tokenizer\": {\"type\": \"ByteLevel\"", "\"pre_tokenizer\": {\"type\": \"UnicodeScripts\""),
                      CS_EUNSUPPORTED, "pre_tokenizer type 'UnicodeScripts'");
    expect_load_error(variant("\"decoder\": {\"type\": \"ByteLevel\"", "\"decoder\": {\"type\": \"CTC\""),
                      CS_EUNSUPPORTED, "decoder type 'CTC'");
    expect_load_error(variant("\"post_processor\": {\"type\": \"TemplateProcessing\"", "\"post_processor\": {\"type\": \"Frobnicate\""),
                      CS_EUNSUPPORTED, "post_processor type 'Frobnicate'");
    expect_load_error(variant("\"type\": \"BPE\"", "\"type\": \"Unigram\""), CS_EUNSUPPORTED, "model type 'Unigram'");
    expect_load_error(variant("\"type\": \"BPE\"", "\"type\": \"WordPiece\""), CS_EUNSUPPORTED, "model type 'WordPiece'");
    expect_load_error(variant("\"dropout\": null", "\"dropout\": 0.1"), CS_EUNSUPPORTED, "dropout");
    expect_load_error(variant("\"l d\"", "\"l q\""), CS_EFORMAT, "missing from the vocab");
    expect_load_error(variant("\"l d\"", "\"l d x\""), CS_EFORMAT, "is not 'a b'");
    expect_load_error(variant("\"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true,   \"use_regex\": true}",
                              "\"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"Regex\": \"(\"}, \"behavior\": \"Isolated\", \"invert\": false}"),
                      CS_EUNSUPPORTED, "regex '(' rejected");
    expect_load_error(variant("\"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true,   \"use_regex\": true}",
                              "\"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"Regex\": \"a\"}, \"behavior\": \"Sideways\", \"invert\": false}"),
                      CS_EUNSUPPORTED, "behavior 'Sideways'");
    expect_load_error(variant("\"version\": \"1.0\"", "\"version\": \"2.0\""), CS_EUNSUPPORTED, "version '2.0'");
    expect_load_error(variant("\"decoder\": {\"type\": \"ByteLevel\"", "\"decoder\": {\"kind\": \"ByteLevel\""),
                      CS_EFORMAT, "decoder must be an object with a \"type\"");
    /* keys tokenizers ignores are ignored here too */
    write_file("tokenizer.json", variant("\"normalizer\": null", "\"normalizer\": null, \"comment\": {\"x\": [1]}"));
    tokenizer_t *ok = NULL;
    ck_assert_int_eq(tokenizer_load(g_dir, &ok), CS_OK);
    tokenizer_free(ok);
    /* a bad tokenizer_config.json fails the load too */
    write_file("tokenizer_config.json", "{\"bos_token\": ");
    tokenizer_t *t = NULL;
    write_file("tokenizer.json", BYTELEVEL_JSON);
    ck_assert_int_eq(tokenizer_load(g_dir, &t), CS_EFORMAT);
    ck_assert_ptr_null(t);
    ck_assert(strstr(cs_error_last(), "tokenizer_config.json") != NULL);
    /* missing files */
    ck_assert_int_eq(tokenizer_load("/nonexistent/dir", &t), CS_ENOTFOUND);
    ck_assert(strstr(cs_error_last(), "/nonexistent/dir/tokenizer.json") != NULL);
    ck_assert_int_eq(tokenizer_load_files("/nonexistent.json", NULL, &t), CS_ENOTFOUND);
    ck_assert_int_eq(tokenizer_load(NULL, &t), CS_EINVAL);
}
END_TEST

int main(void) {
    const TTest *const tests[] = {
        test_bytelevel_encode, test_bytelevel_decode, test_bytelevel_stream, test_invalid_input,
        test_spm_encode_decode, test_spm_stream, test_unk, test_metaspace, test_config, test_threads,
        test_load_errors,
    };
    return cs_check_main_fixture("tokenizer", tests, CS_ARRAY_LEN(tests), 0, CK_FORK, setup, teardown);
}
