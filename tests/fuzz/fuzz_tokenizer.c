/* fuzz_tokenizer.c: the tokenizer itself on arbitrary input, with the real tokenizer files of
 * tests/data/tokenizers (Llama 3.1, Qwen3, a 32k SentencePiece-style one). The first byte
 * picks the tokenizer and the mode; the rest is text to encode, or (ids mode) token ids as
 * the model could sample them, two bytes each. Properties:
 *  - ids are below the vocabulary size;
 *  - the incremental detokenizer's pieces plus its flush equal tokenizer_decode of the same
 *    ids (tokenizer.h promises it: streamed and whole answers must not differ);
 *  - Llama 3.1 (byte-level, no normalizer) decodes what it encoded back to the same bytes,
 *    for any valid UTF-8 text. */
#include <string.h>

#include "base/common.h"
#include "text/tokenizer.h"
#include "tests/fuzz/fuzz.h"

static const char *const NAMES[] = {"llama-3.1", "qwen3", "spm-32k"};
#define N_TOK 3
static tokenizer_t *toks[N_TOK];

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    for (int i = 0; i < N_TOK; i++) {
        char rel[128];
        snprintf(rel, sizeof rel, "tests/fuzz-data/%s/tokenizer.json", NAMES[i]);
        if (tokenizer_load_files(fuzz_build_path(rel), NULL, &toks[i]) != CS_OK) {
            fprintf(stderr, "fuzz_tokenizer: %s (make tests/fuzz-data.stamp, or set CS_FUZZ_BUILDDIR)\n",
                    cs_error_last());
            abort();
        }
    }
    return 0;
}

static void check_stream(const tokenizer_t *t, const int32_t *ids, size_t n, bool skip) {
    char *whole = NULL;
    size_t wlen = 0;
    FUZZ_CHECK(tokenizer_decode(t, ids, n, skip, &whole, &wlen) == CS_OK, "decode: %s", cs_error_last());
    tokenizer_stream_t *s = tokenizer_stream_new(t, skip);
    FUZZ_CHECK(s, "stream_new");
    cs_buf_t b = {0};
    char *piece;
    size_t plen;
    for (size_t i = 0; i < n; i++) {
        FUZZ_CHECK(tokenizer_stream_push(s, ids[i], &piece, &plen) == CS_OK, "push: %s", cs_error_last());
        cs_buf_add(&b, piece, plen);
        free(piece);
    }
    FUZZ_CHECK(tokenizer_stream_flush(s, &piece, &plen) == CS_OK, "flush: %s", cs_error_last());
    cs_buf_add(&b, piece, plen);
    free(piece);
    tokenizer_stream_free(s);
    FUZZ_CHECK(b.len == wlen && (wlen == 0 || !memcmp(b.p, whole, wlen)),
               "streamed text (%zu bytes) differs from the decoded text (%zu bytes), %zu ids, skip_special %d", b.len,
               wlen, n, skip);
    free(b.p);
    free(whole);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    int which = data[0] % N_TOK;
    bool ids_mode = data[0] & 0x10, skip = data[0] & 0x20, add_special = data[0] & 0x40;
    const tokenizer_t *t = toks[which];
    int vocab = tokenizer_vocab_size(t);
    data++;
    size--;
    if (ids_mode) {
        size_t n = size / 2;
        int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
        for (size_t i = 0; i < n; i++) ids[i] = (int32_t)(((uint32_t)data[2 * i] << 8 | data[2 * i + 1]) * 131u % (uint32_t)vocab);
        check_stream(t, ids, n, skip);
        free(ids);
        return 0;
    }
    int32_t *ids = NULL;
    size_t n = 0;
    if (tokenizer_encode(t, (const char *)data, size, add_special, &ids, &n) != CS_OK) return 0;
    fuzz_accepted++;
    for (size_t i = 0; i < n; i++) FUZZ_CHECK(ids[i] >= 0 && ids[i] < vocab, "id %d, vocab %d", ids[i], vocab);
    check_stream(t, ids, n, skip);
    if (which == 0 && !add_special && cs_utf8_valid((const char *)data, size)) {
        char *back = NULL;
        size_t blen = 0;
        FUZZ_CHECK(tokenizer_decode(t, ids, n, false, &back, &blen) == CS_OK, "decode");
        FUZZ_CHECK(blen == size && (size == 0 || !memcmp(back, data, size)),
                   "llama-3.1 did not round-trip %zu bytes of UTF-8 (got %zu)", size, blen);
        free(back);
    }
    free(ids);
    return 0;
}
