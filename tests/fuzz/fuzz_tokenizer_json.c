/* fuzz_tokenizer_json.c: the tokenizer.json loader (text/tokenizer.c) on any bytes; a
 * tokenizer it accepts encodes and decodes a fixed text (with special tokens, spaces,
 * non-ASCII) into ids below its vocabulary size. */
#include <string.h>

#include "text/tokenizer.h"
#include "tests/fuzz/fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    tokenizer_t *t = NULL;
    if (tokenizer_load_files(fuzz_file(data, size), NULL, &t) != CS_OK) return 0;
    fuzz_accepted++;
    static const char text[] = "Hello  world <s></s><|im_start|> caf\xc3\xa9 \xe2\x96\x81x\n\t123 \xf0\x9f\x99\x82";
    int32_t *ids = NULL;
    size_t n = 0;
    if (tokenizer_encode(t, text, sizeof text - 1, true, &ids, &n) == CS_OK) {
        int vocab = tokenizer_vocab_size(t);
        for (size_t i = 0; i < n; i++) FUZZ_CHECK(ids[i] >= 0 && ids[i] < vocab, "id %d, vocab %d", ids[i], vocab);
        char *out = NULL;
        size_t len = 0;
        if (tokenizer_decode(t, ids, n, false, &out, &len) == CS_OK) FUZZ_CHECK(out != NULL, "decode gave no text");
        free(out);
    }
    free(ids);
    tokenizer_free(t);
    return 0;
}
