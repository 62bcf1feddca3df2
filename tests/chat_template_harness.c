/* chat_template_harness.c: renders chat-template test cases with text/chat_template.c so
 * that tests/test_ref_chat_template.py can compare them with transformers.
 *   chat_template_harness TEMPLATE CASES.json
 * TEMPLATE is a tokenizer_config.json (a name ending in .json; its "chat_template": a string,
 * or a list of {name, template} of which "default" is used) or else a raw template file. CASES is a JSON array of objects:
 * "messages" plus any template variables (add_generation_prompt, bos_token, tools, ...).
 * Like transformers' render_jinja_template, tools and documents default to null,
 * add_generation_prompt to false, and reasoning fields of messages are aliased.
 * Prints one JSON line per case: {"text": ...} or {"error": ...}. A template that does not
 * parse prints {"parse_error": ...} once and exits 1. */
#include "text/chat_template.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The template text of a .jinja file or a tokenizer_config.json; NULL + message on error. */
static char *load_template(const char *path, size_t *len, char *err, size_t errlen) {
    size_t n;
    char *src = cs_read_file(path, &n);
    if (!src) {
        snprintf(err, errlen, "%s: %s", path, cs_error_last());
        return NULL;
    }
    size_t plen = strlen(path);
    if (plen < 5 || strcmp(path + plen - 5, ".json") != 0) {
        *len = n;
        return src;
    }
    /* model_max_length is often larger than 64 bits: read integers as reals */
    json_error_t jerr;
    json_t *cfg = json_loadb(src, n, JSON_DECODE_INT_AS_REAL, &jerr);
    free(src);
    if (!json_is_object(cfg)) {
        snprintf(err, errlen, "%s: %s", path, cfg ? "not a JSON object" : jerr.text);
        json_decref(cfg);
        return NULL;
    }
    json_t *tmpl = json_object_get(cfg, "chat_template");
    if (json_is_array(tmpl)) {
        size_t i;
        json_t *item, *found = NULL;
        json_array_foreach(tmpl, i, item) {
            if (json_is_string(json_object_get(item, "name")) &&
                !strcmp(json_string_value(json_object_get(item, "name")), "default"))
                found = json_object_get(item, "template");
        }
        tmpl = found;
    }
    if (!json_is_string(tmpl)) {
        snprintf(err, errlen, "%s: no chat_template", path);
        json_decref(cfg);
        return NULL;
    }
    *len = json_string_length(tmpl);
    char *out = malloc(*len + 1);
    if (out) {
        memcpy(out, json_string_value(tmpl), *len);
        out[*len] = 0;
    }
    json_decref(cfg);
    return out;
}

static void print_line(const char *key, const char *value, size_t len) {
    json_t *o = json_object();
    json_object_set_new(o, key, json_stringn(value, len));
    char *s = json_dumps(o, JSON_COMPACT);
    printf("%s\n", s);
    free(s);
    json_decref(o);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s TEMPLATE CASES.json\n", argv[0]);
        return 2;
    }
    char err[1024];
    size_t len;
    char *src = load_template(argv[1], &len, err, sizeof err);
    if (!src) {
        fprintf(stderr, "%s\n", err);
        return 2;
    }
    chat_template_t *t;
    int rc = chat_template_parse(src, len, &t);
    free(src);
    if (rc != CS_OK) {
        print_line("parse_error", cs_error_last(), strlen(cs_error_last()));
        return 1;
    }
    json_error_t jerr;
    json_t *cases = json_load_file(argv[2], JSON_REJECT_DUPLICATES, &jerr);
    if (!json_is_array(cases)) {
        fprintf(stderr, "%s: %s\n", argv[2], cases ? "not a JSON array" : jerr.text);
        chat_template_free(t);
        return 2;
    }
    size_t i;
    json_t *c;
    json_array_foreach(cases, i, c) {
        json_t *ctx = json_deep_copy(c);
        json_t *messages = chat_template_hf_messages(json_object_get(c, "messages"), false);
        if (messages) json_object_set_new(ctx, "messages", messages);
        if (!json_object_get(ctx, "tools")) json_object_set_new(ctx, "tools", json_null());
        if (!json_object_get(ctx, "documents")) json_object_set_new(ctx, "documents", json_null());
        if (!json_object_get(ctx, "add_generation_prompt")) json_object_set_new(ctx, "add_generation_prompt", json_false());
        char *text;
        size_t n;
        rc = chat_template_render(t, ctx, &text, &n);
        if (rc == CS_OK) {
            print_line("text", text, n);
            free(text);
        } else {
            print_line("error", cs_error_last(), strlen(cs_error_last()));
        }
        json_decref(ctx);
    }
    fflush(stdout);
    json_decref(cases);
    chat_template_free(t);
    return 0;
}
