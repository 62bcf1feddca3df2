/* api_structured.c: structured output. The fields that ask for it, OpenAI's response_format
 * (json_object, json_schema), vLLM's structured_outputs ({json, regex, choice, grammar,
 * json_object, whitespace_pattern}) and its older guided_json, guided_regex, guided_choice,
 * guided_grammar and guided_whitespace_pattern, and SGLang's regex, ebnf and json_schema,
 * become GBNF text (text/grammar/) and then a compiled grammar, kept in a small cache keyed by
 * that text: a schema sent with every request is compiled once. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "server/api_internal.h"
#include "text/grammar/grammar.h"

#define GCACHE_N 64

typedef struct gentry {
    char *gbnf;
    grammar_t *g;
    uint64_t used;
} gentry_t;

struct grammar_cache {
    pthread_mutex_t mu;
    gentry_t e[GCACHE_N];
    uint64_t clock;
};

grammar_cache_t *grammar_cache_new(void) {
    grammar_cache_t *c = calloc(1, sizeof *c);
    if (c) pthread_mutex_init(&c->mu, NULL);
    return c;
}

void grammar_cache_free(grammar_cache_t *c) {
    if (!c) return;
    for (int i = 0; i < GCACHE_N; i++) {
        free(c->e[i].gbnf);
        grammar_unref(c->e[i].g);
    }
    pthread_mutex_destroy(&c->mu);
    free(c);
}

/* the compiled grammar of gbnf (a reference for the caller), from the cache when it is there */
static int compile_cached(grammar_cache_t *c, const char *gbnf, grammar_t **out) {
    if (c) {
        pthread_mutex_lock(&c->mu);
        for (int i = 0; i < GCACHE_N; i++)
            if (c->e[i].gbnf && !strcmp(c->e[i].gbnf, gbnf)) {
                c->e[i].used = ++c->clock;
                *out = grammar_ref(c->e[i].g);
                pthread_mutex_unlock(&c->mu);
                return CS_OK;
            }
        pthread_mutex_unlock(&c->mu);
    }
    int rc = grammar_compile(gbnf, strlen(gbnf), out);
    if (rc || !c) return rc;
    char *key = strdup(gbnf);
    if (!key) return CS_OK; /* not kept */
    pthread_mutex_lock(&c->mu);
    int v = 0; /* the least recently used entry */
    for (int i = 1; i < GCACHE_N; i++)
        if (c->e[i].used < c->e[v].used) v = i;
    free(c->e[v].gbnf);
    grammar_unref(c->e[v].g);
    c->e[v] = (gentry_t){key, grammar_ref(*out), ++c->clock};
    pthread_mutex_unlock(&c->mu);
    return CS_OK;
}

/* one constraint a request names: which field, what kind, its value */
typedef enum { K_JSON, K_JSON_OBJECT, K_REGEX, K_CHOICE, K_GRAMMAR } kind_t;
typedef struct want {
    const char *param;
    kind_t kind;
    json_t *v;
} want_t;

static bool add_want(want_t *w, int *n, const char *param, kind_t kind, json_t *v, perr_t *e) {
    if (*n) /* vLLM's rule: one constraint per request */
        return fail(e, 400, param,
                    "You can only use one kind of constraints for structured outputs ('%s' and '%s' were both given)",
                    w[0].param, param);
    w[(*n)++] = (want_t){param, kind, v};
    return true;
}

static bool response_format(json_t *rf, want_t *w, int *n, perr_t *e) {
    if (!json_is_object(rf)) return fail(e, 400, "response_format", "'response_format' must be an object");
    json_t *t = json_object_get(rf, "type");
    const char *ty = json_string_value(t);
    if (!ty) return fail(e, 400, "response_format", "'response_format.type' must be a string");
    if (!strcmp(ty, "text")) return true;
    if (!strcmp(ty, "json_object")) return add_want(w, n, "response_format", K_JSON_OBJECT, NULL, e);
    if (strcmp(ty, "json_schema"))
        return fail(e, 400, "response_format",
                    "response_format type '%s' is not supported (text, json_object or json_schema)", ty);
    json_t *js = json_object_get(rf, "json_schema");
    json_t *schema = json_is_object(js) ? json_object_get(js, "schema") : NULL;
    if (!json_is_object(schema))
        return fail(e, 400, "response_format", "response_format of type json_schema needs 'json_schema.schema', an object");
    return add_want(w, n, "response_format", K_JSON, schema, e);
}

/* vLLM's structured_outputs object */
static bool structured_outputs(json_t *so, want_t *w, int *n, const char **ws, perr_t *e) {
    static const char *const keys[] = {"json", "regex", "choice", "grammar", "json_object"};
    if (!json_is_object(so)) return fail(e, 400, "structured_outputs", "'structured_outputs' must be an object");
    const char *k;
    json_t *v;
    json_object_foreach(so, k, v) {
        if (json_is_null(v)) continue;
        int i = 0;
        while (i < 5 && strcmp(k, keys[i])) i++;
        if (i < 5) {
            if (i == 4 && !json_is_true(v)) {
                if (json_is_false(v)) continue;
                return fail(e, 400, "structured_outputs", "'structured_outputs.json_object' must be true or false");
            }
            kind_t kinds[] = {K_JSON, K_REGEX, K_CHOICE, K_GRAMMAR, K_JSON_OBJECT};
            if (!add_want(w, n, "structured_outputs", kinds[i], v, e)) return false;
        } else if (!strcmp(k, "whitespace_pattern")) {
            if (!json_is_string(v))
                return fail(e, 400, "structured_outputs", "'structured_outputs.whitespace_pattern' must be a string");
            *ws = json_string_value(v);
        } else if (!strcmp(k, "disable_any_whitespace") || !strcmp(k, "disable_fallback")) {
            if (!json_is_boolean(v)) return fail(e, 400, "structured_outputs", "'structured_outputs.%s' must be true or false", k);
        } else if (!strcmp(k, "backend")) {
            if (!json_is_string(v)) return fail(e, 400, "structured_outputs", "'structured_outputs.backend' must be a string");
        } else {
            return fail(e, 400, "structured_outputs", "'structured_outputs.%s' is not supported", k);
        }
    }
    return true;
}

/* the schema a field gives: an object, or JSON text of one (guided_json, SGLang's json_schema) */
static bool schema_of(const want_t *w, json_t **out, perr_t *e) {
    if (json_is_object(w->v) || json_is_boolean(w->v)) {
        *out = json_incref(w->v);
        return true;
    }
    if (json_is_string(w->v)) {
        json_error_t je;
        *out = json_loads(json_string_value(w->v), 0, &je);
        if (json_is_object(*out)) return true;
        json_decref(*out);
    }
    return fail(e, 400, w->param, "'%s' must be a JSON schema (an object, or its JSON text)", w->param);
}

/* the GBNF text of the constraint */
static bool gbnf_of(const want_t *w, const char *ws, char **gbnf, perr_t *e) {
    int rc = CS_OK;
    char *path = NULL;
    if (w->kind == K_JSON || w->kind == K_JSON_OBJECT) {
        json_t *schema = NULL;
        if (w->kind == K_JSON && !schema_of(w, &schema, e)) return false;
        rc = grammar_json_schema_to_gbnf(schema, ws, gbnf, &path);
        json_decref(schema);
    } else if (w->kind == K_REGEX) {
        if (!json_is_string(w->v)) return fail(e, 400, w->param, "'%s' must be a regular expression (a string)", w->param);
        rc = grammar_regex_to_gbnf(json_string_value(w->v), json_string_length(w->v), gbnf);
    } else if (w->kind == K_CHOICE) {
        size_t n = json_array_size(w->v);
        if (!json_is_array(w->v) || !n || n > 4096)
            return fail(e, 400, w->param, "'%s' must be a non-empty list of strings", w->param);
        const char **c = malloc(sizeof *c * n);
        if (!c) return fail(e, 500, NULL, "out of memory");
        for (size_t i = 0; i < n; i++)
            if (!(c[i] = json_string_value(json_array_get(w->v, i)))) {
                free(c);
                return fail(e, 400, w->param, "'%s' must be a non-empty list of strings", w->param);
            }
        rc = grammar_choice_to_gbnf(c, (int)n, gbnf);
        free(c);
    } else {
        if (!json_is_string(w->v)) return fail(e, 400, w->param, "'%s' must be a grammar (GBNF or Lark text)", w->param);
        const char *src = json_string_value(w->v);
        size_t n = json_string_length(w->v);
        if (grammar_is_lark(src, n)) {
            rc = grammar_lark_to_gbnf(src, n, gbnf);
        } else {
            *gbnf = strdup(src);
            if (!*gbnf) rc = cs_error_set(CS_ENOMEM, "out of memory");
        }
    }
    if (rc) {
        if (path) fail(e, api_status_of(rc), w->param, "%s: %s (at %s)", w->param, cs_error_last(), path);
        else fail(e, api_status_of(rc), w->param, "%s: %s", w->param, cs_error_last());
    }
    free(path);
    return rc == CS_OK;
}

bool api_structured(server_t *s, json_t *b, grammar_t **g, perr_t *e) {
    *g = NULL;
    want_t w[2] = {{0}};
    int n = 0;
    const char *ws = NULL;
    static const struct { const char *name; kind_t kind; } plain[] = {
        {"guided_json", K_JSON}, {"guided_regex", K_REGEX}, {"guided_choice", K_CHOICE}, {"guided_grammar", K_GRAMMAR},
        {"json_schema", K_JSON}, {"regex", K_REGEX},         {"ebnf", K_GRAMMAR},
    };
    json_t *v = cs_json_get(b, "response_format");
    if (v && !response_format(v, w, &n, e)) return false;
    if ((v = cs_json_get(b, "structured_outputs")) && !structured_outputs(v, w, &n, &ws, e)) return false;
    for (size_t i = 0; i < sizeof plain / sizeof plain[0]; i++)
        if ((v = cs_json_get(b, plain[i].name)) && !add_want(w, &n, plain[i].name, plain[i].kind, v, e)) return false;
    if ((v = cs_json_get(b, "guided_whitespace_pattern"))) {
        if (!json_is_string(v))
            return fail(e, 400, "guided_whitespace_pattern", "'guided_whitespace_pattern' must be a string");
        ws = json_string_value(v);
    }
    if ((v = cs_json_get(b, "guided_decoding_backend")) && !json_is_string(v))
        return fail(e, 400, "guided_decoding_backend", "'guided_decoding_backend' must be a string");
    if (!n) return true;
    if (!s->tok) return fail(e, 400, w[0].param, "structured output needs the model's tokenizer");
    char *gbnf = NULL;
    if (!gbnf_of(&w[0], ws, &gbnf, e)) return false;
    int rc = compile_cached(s->grammars, gbnf, g);
    free(gbnf);
    if (rc) return fail(e, api_status_of(rc), w[0].param, "%s: %s", w[0].param, cs_error_last());
    return true;
}
