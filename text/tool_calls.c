/* tool_calls.c: see tool_calls.h. */
#include "text/tool_calls.h"

#include <string.h>

#define HERMES_OPEN "<tool_call>"
#define HERMES_CLOSE "</tool_call>"
#define PYTHON_TAG "<|python_tag|>"
#define MISTRAL_OPEN "[TOOL_CALLS]"

static const char *const NAMES[] = {"", "hermes", "llama3_json", "mistral"};

tool_format tool_format_by_name(const char *name) {
    for (int f = 1; f < 4; f++)
        if (name && !strcmp(name, NAMES[f])) return (tool_format)f;
    return TOOL_FORMAT_NONE;
}

const char *tool_format_name(tool_format f) { return (int)f >= 0 && (int)f < 4 ? NAMES[f] : ""; }

tool_format tool_format_detect(const char *t) {
    if (!t) return TOOL_FORMAT_NONE;
    if (strstr(t, HERMES_OPEN)) return TOOL_FORMAT_HERMES;
    if (strstr(t, MISTRAL_OPEN)) return TOOL_FORMAT_MISTRAL;
    if (strstr(t, PYTHON_TAG) || (strstr(t, "\"parameters\"") && strstr(t, "<|eom_id|>"))) return TOOL_FORMAT_LLAMA3_JSON;
    return TOOL_FORMAT_NONE;
}

static const char *find(const char *s, size_t n, const char *pat) {
    size_t m = strlen(pat);
    for (size_t i = 0; i + m <= n; i++)
        if (!memcmp(s + i, pat, m)) return s + i;
    return NULL;
}

static size_t skip_ws(const char *s, size_t i, size_t n) {
    while (i < n && (s[i] == ' ' || s[i] == '\n' || s[i] == '\t' || s[i] == '\r')) i++;
    return i;
}

/* {"name": ..., "arguments"|"parameters": ...} -> {"name", "arguments": object}, else NULL */
static json_t *call_of(json_t *o) {
    json_t *name = json_object_get(o, "name"), *args = json_object_get(o, "arguments");
    if (!args) args = json_object_get(o, "parameters");
    if (!json_is_string(name)) return NULL;
    json_t *a = NULL;
    if (json_is_object(args)) a = json_incref(args);
    else if (json_is_string(args)) {
        a = json_loads(json_string_value(args), 0, NULL);
        if (!json_is_object(a)) {
            json_decref(a);
            return NULL;
        }
    } else if (!args || json_is_null(args)) {
        a = json_object();
    } else {
        return NULL;
    }
    return json_pack("{s:O, s:o}", "name", name, "arguments", a);
}

/* one JSON value at s[*i..n): the value, *i past it */
static json_t *value_at(const char *s, size_t *i, size_t n) {
    json_error_t e;
    json_t *v = json_loadb(s + *i, n - *i, JSON_DISABLE_EOF_CHECK, &e);
    if (v) *i += (size_t)e.position;
    return v;
}

static json_t *parse_hermes(const char *s, size_t n, const char *open) {
    json_t *calls = json_array();
    size_t i = (size_t)(open - s);
    while (i < n) {
        i = skip_ws(s, i, n);
        if (i == n) break;
        if (n - i < strlen(HERMES_OPEN) || memcmp(s + i, HERMES_OPEN, strlen(HERMES_OPEN))) goto bad;
        i = skip_ws(s, i + strlen(HERMES_OPEN), n);
        json_t *v = value_at(s, &i, n), *c = v ? call_of(v) : NULL;
        json_decref(v);
        if (!c) goto bad;
        json_array_append_new(calls, c);
        i = skip_ws(s, i, n);
        if (i < n) { /* the closing tag (a reply cut at the end may lack it) */
            if (n - i < strlen(HERMES_CLOSE) || memcmp(s + i, HERMES_CLOSE, strlen(HERMES_CLOSE))) goto bad;
            i += strlen(HERMES_CLOSE);
        }
    }
    return calls;
bad:
    json_decref(calls);
    return NULL;
}

static json_t *parse_llama3(const char *s, size_t n) {
    size_t i = skip_ws(s, 0, n);
    if (n - i >= strlen(PYTHON_TAG) && !memcmp(s + i, PYTHON_TAG, strlen(PYTHON_TAG))) i = skip_ws(s, i + strlen(PYTHON_TAG), n);
    if (i == n || s[i] != '{') return NULL;
    json_t *calls = json_array();
    while (i < n) {
        json_t *v = value_at(s, &i, n), *c = v ? call_of(v) : NULL;
        json_decref(v);
        if (!c) goto bad;
        json_array_append_new(calls, c);
        i = skip_ws(s, i, n);
        if (i < n && s[i] == ';') i = skip_ws(s, i + 1, n);
        else if (i < n) goto bad;
    }
    return calls;
bad:
    json_decref(calls);
    return NULL;
}

static json_t *parse_mistral(const char *s, size_t n, const char *open) {
    size_t i = skip_ws(s, (size_t)(open - s) + strlen(MISTRAL_OPEN), n);
    json_t *v = value_at(s, &i, n), *calls = json_array();
    if (json_is_object(v)) v = json_pack("[o]", v);
    size_t k;
    json_t *x;
    bool ok = json_is_array(v) && json_array_size(v) > 0 && skip_ws(s, i, n) == n;
    json_array_foreach(v, k, x) {
        json_t *c = ok ? call_of(x) : NULL;
        if (!c) { ok = false; break; }
        json_array_append_new(calls, c);
    }
    json_decref(v);
    if (ok) return calls;
    json_decref(calls);
    return NULL;
}

void tool_calls_parse(tool_format f, const char *s, size_t n, json_t **calls, size_t *content_len) {
    *calls = NULL;
    *content_len = n;
    const char *open = NULL;
    json_t *c = NULL;
    if (f == TOOL_FORMAT_HERMES && (open = find(s, n, HERMES_OPEN))) c = parse_hermes(s, n, open);
    else if (f == TOOL_FORMAT_MISTRAL && (open = find(s, n, MISTRAL_OPEN))) c = parse_mistral(s, n, open);
    else if (f == TOOL_FORMAT_LLAMA3_JSON && (c = parse_llama3(s, n))) open = s;
    if (!c) return;
    *calls = c;
    *content_len = (size_t)(open - s);
}

/* the length of s's longest suffix that is a proper prefix of pat */
static size_t partial_suffix(const char *s, size_t n, const char *pat) {
    size_t m = strlen(pat);
    for (size_t k = m - 1 < n ? m - 1 : n; k > 0; k--)
        if (!memcmp(s + n - k, pat, k)) return k;
    return 0;
}

size_t tool_calls_content_prefix(tool_format f, const char *s, size_t n) {
    const char *pat = f == TOOL_FORMAT_HERMES ? HERMES_OPEN : f == TOOL_FORMAT_MISTRAL ? MISTRAL_OPEN : NULL;
    if (pat) {
        const char *at = find(s, n, pat);
        return at ? (size_t)(at - s) : n - partial_suffix(s, n, pat);
    }
    if (f == TOOL_FORMAT_LLAMA3_JSON) { /* a call is the whole reply: content once it cannot be one */
        size_t i = skip_ws(s, 0, n);
        if (i == n) return 0;
        if (s[i] == '{') return 0;
        size_t m = strlen(PYTHON_TAG);
        if (!memcmp(s + i, PYTHON_TAG, n - i < m ? n - i : m)) return 0;
        return n;
    }
    return n;
}
