/* tokenizer_harness.c: drives engine/tokenizer.c from JSON lines so that
 * tests/test_ref_tokenizer.py can compare it with the Python `tokenizers` library.
 * DIR may also be a FILE.gguf: the tokenizer built from its metadata (test_gguf_tokenizer.py).
 *   tokenizer_harness DIR            {"text": s, "add_special": b} -> ids, decodes, streams
 *                                    ("stream": false leaves the streams out)
 *   tokenizer_harness DIR --decode   {"ids": [...]}                -> decodes, streams
 *   tokenizer_harness DIR --info     one line: vocab size, bos/eos ids, chat template
 *   tokenizer_harness DIR --bench N  stdin is one text, encoded N times; prints tokens/s */
#include "text/tokenizer.h"

#include "base/gguf.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Concatenated pieces of a stream fed with ids, plus the flush. */
static int stream_all(const tokenizer_t *t, const int32_t *ids, size_t n, bool skip, char **out,
                      size_t *out_len) {
    tokenizer_stream_t *s = tokenizer_stream_new(t, skip);
    if (!s) return CS_ENOMEM;
    size_t cap = 256, len = 0;
    char *buf = malloc(cap);
    int rc = buf ? CS_OK : CS_ENOMEM;
    for (size_t i = 0; i <= n && rc == CS_OK; i++) {
        char *piece;
        size_t plen;
        rc = i < n ? tokenizer_stream_push(s, ids[i], &piece, &plen)
                   : tokenizer_stream_flush(s, &piece, &plen);
        if (rc < 0) break;
        if (len + plen + 1 > cap) {
            while (len + plen + 1 > cap) cap *= 2;
            char *nb = realloc(buf, cap);
            if (!nb) {
                free(piece);
                rc = CS_ENOMEM;
                break;
            }
            buf = nb;
        }
        memcpy(buf + len, piece, plen);
        len += plen;
        free(piece);
    }
    tokenizer_stream_free(s);
    if (rc < 0) {
        free(buf);
        return rc;
    }
    buf[len] = 0;
    *out = buf;
    *out_len = len;
    return CS_OK;
}

/* Adds decode, decode_skip and (with streams) stream, stream_skip for ids to obj. */
static int add_decodes(const tokenizer_t *t, json_t *obj, const int32_t *ids, size_t n, bool streams) {
    static const char *keys[4] = {"decode", "decode_skip", "stream", "stream_skip"};
    for (int k = 0; k < (streams ? 4 : 2); k++) {
        char *s;
        size_t len;
        bool skip = k & 1;
        int rc = k < 2 ? tokenizer_decode(t, ids, n, skip, &s, &len) : stream_all(t, ids, n, skip, &s, &len);
        if (rc < 0) return rc;
        json_object_set_new(obj, keys[k], json_stringn(s, len));
        free(s);
    }
    return CS_OK;
}

static json_t *error_obj(int rc) {
    json_t *o = json_object();
    char msg[1200];
    snprintf(msg, sizeof msg, "%s: %s", cs_strerror(rc), cs_error_last());
    json_object_set_new(o, "error", json_string(msg));
    return o;
}

static json_t *handle_encode(const tokenizer_t *t, json_t *in) {
    json_t *jt = json_object_get(in, "text");
    if (!json_is_string(jt)) return error_obj(cs_error_set(CS_EINVAL, "line has no \"text\""));
    bool add_special = !json_is_false(json_object_get(in, "add_special"));
    int32_t *ids;
    size_t n;
    int rc = tokenizer_encode(t, json_string_value(jt), json_string_length(jt), add_special, &ids, &n);
    if (rc < 0) return error_obj(rc);
    json_t *o = json_object(), *arr = json_array();
    for (size_t i = 0; i < n; i++) json_array_append_new(arr, json_integer(ids[i]));
    json_object_set_new(o, "ids", arr);
    rc = add_decodes(t, o, ids, n, !json_is_false(json_object_get(in, "stream")));
    free(ids);
    if (rc < 0) {
        json_decref(o);
        return error_obj(rc);
    }
    return o;
}

static json_t *handle_decode(const tokenizer_t *t, json_t *in) {
    json_t *arr = json_object_get(in, "ids");
    if (!json_is_array(arr)) return error_obj(cs_error_set(CS_EINVAL, "line has no \"ids\""));
    size_t n = json_array_size(arr);
    int32_t *ids = malloc((n + 1) * sizeof *ids);
    if (!ids) return error_obj(CS_ENOMEM);
    for (size_t i = 0; i < n; i++) ids[i] = (int32_t)json_integer_value(json_array_get(arr, i));
    json_t *o = json_object();
    int rc = add_decodes(t, o, ids, n, true);
    free(ids);
    if (rc < 0) {
        json_decref(o);
        return error_obj(rc);
    }
    return o;
}

static int print_info(const tokenizer_t *t) {
    json_t *o = json_object(), *eos = json_array();
    const int32_t *e;
    int ne = tokenizer_eos_ids(t, &e);
    for (int i = 0; i < ne; i++) json_array_append_new(eos, json_integer(e[i]));
    json_object_set_new(o, "vocab_size", json_integer(tokenizer_vocab_size(t)));
    json_object_set_new(o, "bos_id", json_integer(tokenizer_bos_id(t)));
    json_object_set_new(o, "eos_ids", eos);
    const char *ct = tokenizer_chat_template(t);
    json_object_set_new(o, "chat_template", ct ? json_string(ct) : json_null());
    char *s = json_dumps(o, JSON_COMPACT | JSON_ENSURE_ASCII);
    puts(s);
    free(s);
    json_decref(o);
    return 0;
}

static int bench(const tokenizer_t *t, int reps) {
    size_t cap = 1 << 16, len = 0, r;
    char *text = malloc(cap);
    while (text && (r = fread(text + len, 1, cap - len, stdin)) > 0) {
        len += r;
        if (len == cap) {
            char *nt = realloc(text, cap *= 2);
            if (!nt) break;
            text = nt;
        }
    }
    if (!text) return 1;
    double best = 1e30;
    size_t n = 0;
    for (int i = 0; i < reps; i++) {
        int32_t *ids;
        double t0 = cs_time_ms();
        int rc = tokenizer_encode(t, text, len, false, &ids, &n);
        double dt = cs_time_ms() - t0;
        if (rc < 0) {
            fprintf(stderr, "encode: %s\n", cs_error_last());
            free(text);
            return 1;
        }
        free(ids);
        if (dt < best) best = dt;
    }
    printf("{\"bytes\": %zu, \"tokens\": %zu, \"best_ms\": %.3f, \"tokens_per_s\": %.0f}\n", len, n,
           best, n / (best / 1000.0));
    free(text);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s DIR|FILE.gguf [--decode | --info | --bench N] < in.jsonl\n", argv[0]);
        return 2;
    }
    const char *mode = argc > 2 ? argv[2] : "";
    tokenizer_t *t;
    size_t n = strlen(argv[1]);
    int rc;
    if (n > 5 && strcmp(argv[1] + n - 5, ".gguf") == 0) {
        gguf_t *g;
        rc = gguf_open(argv[1], ST_MMAP, &g);
        if (rc == CS_OK) {
            rc = tokenizer_load_gguf(g, &t);
            gguf_free(g); /* the tokenizer keeps copies of what it needs */
        }
    } else {
        rc = tokenizer_load(argv[1], &t);
    }
    if (rc < 0) {
        fprintf(stderr, "tokenizer_load(%s): %s: %s\n", argv[1], cs_strerror(rc), cs_error_last());
        return 1;
    }
    int status = 0;
    if (strcmp(mode, "--info") == 0) {
        status = print_info(t);
    } else if (strcmp(mode, "--bench") == 0) {
        status = bench(t, argc > 3 ? atoi(argv[3]) : 5);
    } else {
        bool dec = strcmp(mode, "--decode") == 0;
        char *line = NULL;
        size_t cap = 0;
        ssize_t len;
        while ((len = getline(&line, &cap, stdin)) > 0) {
            json_error_t err;
            json_t *in = json_loadb(line, (size_t)len, JSON_ALLOW_NUL, &err);
            json_t *o = in ? (dec ? handle_decode(t, in) : handle_encode(t, in))
                           : error_obj(cs_error_set(CS_EFORMAT, "bad input line: %s", err.text));
            char *s = json_dumps(o, JSON_COMPACT | JSON_ENSURE_ASCII);
            puts(s);
            free(s);
            json_decref(o);
            json_decref(in);
        }
        free(line);
    }
    tokenizer_free(t);
    return status;
}
