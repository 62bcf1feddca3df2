/* fuzz_stream.c: the SSE and NDJSON frame writers (server/api_util.c) with token text of any
 * bytes (a stream's pieces may end inside a UTF-8 character, and a model may emit newlines,
 * NULs and quotes). Each frame must be exactly one event ("data: " + one line + blank line)
 * or one line, parse back as JSON, and carry the text unchanged when it was valid UTF-8
 * (invalid bytes become U+FFFD, never raw). */
#include <string.h>

#include "server/api_internal.h"
#include "tests/fuzz/fuzz.h"

static void check_frame(const cs_buf_t *b, bool ndjson, const uint8_t *data, size_t size) {
    const char *p = b->p;
    size_t n = b->len, head = ndjson ? 0 : 6, tail = ndjson ? 1 : 2;
    FUZZ_CHECK(n > head + tail, "frame of %zu bytes", n);
    if (!ndjson) FUZZ_CHECK(!memcmp(p, "data: ", 6), "no 'data: '");
    FUZZ_CHECK(!memcmp(p + n - tail, "\n\n", tail), "frame does not end the event");
    FUZZ_CHECK(!memchr(p + head, '\n', n - head - tail) && !memchr(p + head, '\r', n - head - tail),
               "a raw line break inside a frame");
    json_error_t je;
    json_t *o = json_loadb(p + head, n - head - tail, JSON_ALLOW_NUL, &je);
    FUZZ_CHECK(o, "frame is not JSON: %s", je.text);
    json_t *text = json_object_get(json_array_get(json_object_get(o, "choices"), 0), "text");
    FUZZ_CHECK(json_is_string(text), "no text");
    if (cs_utf8_valid((const char *)data, size))
        FUZZ_CHECK(json_string_length(text) == size && !memcmp(json_string_value(text), data, size),
                   "valid UTF-8 changed in the frame");
    else
        FUZZ_CHECK(json_string_length(text) <= 3 * size, "%zu bytes from %zu", json_string_length(text), size);
    json_decref(o);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    json_t *o = json_pack("{s:s, s:s, s:[{s:i, s:o, s:n, s:n}]}", "id", "cmpl-fuzz", "object", "text_completion",
                          "choices", "index", 0, "text", jstr((const char *)data, size), "logprobs", "finish_reason");
    FUZZ_CHECK(o, "jstr gave no string");
    fuzz_accepted++;
    for (int nd = 0; nd < 2; nd++) {
        cs_buf_t b = {0};
        FUZZ_CHECK(api_frame(&b, o, nd), "api_frame failed");
        check_frame(&b, nd, data, size);
        free(b.p);
    }
    json_decref(o);
    return 0;
}
