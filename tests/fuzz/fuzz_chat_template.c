/* fuzz_chat_template.c: the chat-template parser and renderer (text/chat_template.c), which a
 * request may reach with its own 'chat_template'. Input: a template, then optionally a NUL
 * and a JSON object whose keys join the context (other messages, tools, kwargs); without one
 * the context is a short chat (user, assistant, user: what every template accepts).
 * A render either succeeds with text within the output limit or fails with a message;
 * neither may crash, leak or run away (the limits of chat_template.h bound it). */
#include <jansson.h>
#include <string.h>

#include "text/chat_template.h"
#include "tests/fuzz/fuzz.h"

static json_t *base_ctx;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    json_error_t je;
    base_ctx = json_loads(
        "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi \\u00e9\\n<s>\"},"
        " {\"role\": \"assistant\", \"content\": \"Hello\"},"
        " {\"role\": \"user\", \"content\": \"More\"}],"
        " \"add_generation_prompt\": true, \"bos_token\": \"<s>\", \"eos_token\": \"</s>\","
        " \"tools\": null, \"documents\": null}",
        0, &je);
    if (!base_ctx) abort();
    return 0;
}

/* A failure set a message (cs_error_last() has one of its own for none). */
static bool has_message(void) { return strcmp(cs_error_last(), "no error message") != 0; }

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const uint8_t *nul = memchr(data, 0, size);
    size_t tlen = nul ? (size_t)(nul - data) : size;
    chat_template_t *t = NULL;
    cs_error_clear();
    if (chat_template_parse((const char *)data, tlen, &t) != CS_OK) {
        FUZZ_CHECK(has_message(), "a parse failure without a message");
        return 0;
    }
    json_t *ctx = json_deep_copy(base_ctx);
    if (nul) {
        json_t *extra = json_loadb((const char *)nul + 1, size - tlen - 1, JSON_ALLOW_NUL, NULL);
        if (json_is_object(extra)) json_object_update(ctx, extra);
        json_decref(extra);
    }
    char *out = NULL;
    size_t len = 0;
    cs_error_clear();
    if (chat_template_render(t, ctx, &out, &len) == CS_OK) {
        fuzz_accepted++;
        FUZZ_CHECK(out && strlen(out) <= len && len <= CHAT_TEMPLATE_MAX_OUTPUT, "render gave %zu bytes", len);
    } else {
        FUZZ_CHECK(has_message(), "a render failure without a message");
    }
    free(out);
    json_decref(ctx);
    chat_template_free(t);
    return 0;
}
