/* fuzz_gguf_tokenizer.c: the tokenizer of a GGUF file (text/tokenizer_gguf.c) on any bytes the
 * GGUF reader accepts. A refusal leaves no tokenizer and has a message. A tokenizer it builds
 * outlives the file (freed before use: nothing may point into it), its bos/eos ids are below
 * its vocabulary size, its chat template is the file's, and it encodes a fixed text (special
 * tokens, spaces, non-ASCII) into ids below the vocabulary size; those ids and the first ids of
 * the vocabulary decode, and the incremental detokenizer's pieces equal the whole decode. */
#include <string.h>

#include "base/gguf.h"
#include "text/tokenizer.h"
#include "tests/fuzz/fuzz.h"

static void check_decode(const tokenizer_t *t, const int32_t *ids, size_t n, bool skip) {
    char *whole = NULL;
    size_t wlen = 0;
    FUZZ_CHECK(tokenizer_decode(t, ids, n, skip, &whole, &wlen) == CS_OK, "decode: %s", cs_error_last());
    FUZZ_CHECK(whole && strlen(whole) <= wlen && whole[wlen] == 0, "decode gave no NUL-terminated text");
    tokenizer_stream_t *s = tokenizer_stream_new(t, skip);
    FUZZ_CHECK(s, "stream_new");
    cs_buf_t b = {0};
    char *piece;
    size_t plen;
    for (size_t i = 0; i < n; i++) {
        FUZZ_CHECK(tokenizer_stream_push(s, ids[i], &piece, &plen) == CS_OK, "push: %s", cs_error_last());
        FUZZ_CHECK(cs_buf_add(&b, piece, plen), "out of memory");
        free(piece);
    }
    FUZZ_CHECK(tokenizer_stream_flush(s, &piece, &plen) == CS_OK, "flush: %s", cs_error_last());
    FUZZ_CHECK(cs_buf_add(&b, piece, plen), "out of memory");
    free(piece);
    tokenizer_stream_free(s);
    FUZZ_CHECK(b.len == wlen && (wlen == 0 || !memcmp(b.p, whole, wlen)),
               "streamed text (%zu bytes) differs from the decoded text (%zu bytes), %zu ids, skip_special %d", b.len,
               wlen, n, skip);
    for (size_t i = 0; i < n; i++) {
        char *tb = NULL;
        size_t tlen = 0;
        FUZZ_CHECK(tokenizer_token_bytes(t, ids[i], &tb, &tlen) == CS_OK, "token_bytes(%d): %s", ids[i],
                   cs_error_last());
        free(tb);
    }
    free(b.p);
    free(whole);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    /* an exact-size copy: a read past the end is a sanitizer's finding */
    uint8_t *buf = malloc(size ? size : 1);
    if (!buf) return 0;
    if (size) memcpy(buf, data, size);
    gguf_t *g = NULL;
    if (gguf_open_buffer("fuzz.gguf", buf, size, &g) != CS_OK) {
        free(buf);
        return 0;
    }
    tokenizer_t *t = NULL;
    cs_error_clear();
    if (tokenizer_load_gguf(g, &t) != CS_OK) {
        FUZZ_CHECK(t == NULL, "a refusal left a tokenizer");
        FUZZ_CHECK(cs_error_last()[0] != 0, "a refusal without a message");
        gguf_free(g);
        free(buf);
        return 0;
    }
    fuzz_accepted++;
    const char *tmpl = gguf_get_str(g, "tokenizer.chat_template", NULL, NULL);
    char *want_tmpl = tmpl ? strdup(tmpl) : NULL;
    FUZZ_CHECK(!tmpl || want_tmpl, "out of memory");
    /* the tokenizer must own everything it uses: the file goes first */
    gguf_free(g);
    memset(buf, 0xA5, size);
    free(buf);

    int vocab = tokenizer_vocab_size(t);
    FUZZ_CHECK(vocab > 0, "vocab %d", vocab);
    int32_t bos = tokenizer_bos_id(t);
    FUZZ_CHECK(bos >= -1 && bos < vocab, "bos %d, vocab %d", bos, vocab);
    const int32_t *eos;
    int n_eos = tokenizer_eos_ids(t, &eos);
    for (int i = 0; i < n_eos; i++) FUZZ_CHECK(eos[i] >= 0 && eos[i] < vocab, "eos %d, vocab %d", eos[i], vocab);
    const char *got_tmpl = tokenizer_chat_template(t);
    FUZZ_CHECK(!want_tmpl == !got_tmpl && (!want_tmpl || !strcmp(want_tmpl, got_tmpl)),
               "the chat template is not the file's");
    free(want_tmpl);

    static const char text[] = "Hello  world <s></s><|im_start|> caf\xc3\xa9 \xe2\x96\x81x\n\t123 \xf0\x9f\x99\x82"
                               "<|endoftext|><|eot_id|>";
    for (int add_special = 0; add_special < 2; add_special++) {
        int32_t *ids = NULL;
        size_t n = 0;
        if (tokenizer_encode(t, text, sizeof text - 1, add_special, &ids, &n) != CS_OK) {
            FUZZ_CHECK(cs_error_last()[0] != 0, "an encode failed without a message");
            continue;
        }
        for (size_t i = 0; i < n; i++) FUZZ_CHECK(ids[i] >= 0 && ids[i] < vocab, "id %d, vocab %d", ids[i], vocab);
        check_decode(t, ids, n, add_special);
        free(ids);
    }
    /* the vocabulary's first ids (byte tokens, specials, merged pieces) in order */
    int32_t first[320];
    size_t nf = (size_t)vocab < CS_ARRAY_LEN(first) ? (size_t)vocab : CS_ARRAY_LEN(first);
    for (size_t i = 0; i < nf; i++) first[i] = (int32_t)i;
    check_decode(t, first, nf, false);
    check_decode(t, first, nf, true);
    tokenizer_free(t);
    return 0;
}
