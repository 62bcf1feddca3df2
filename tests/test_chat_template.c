/* test_chat_template.c: the Jinja2-subset interpreter of engine/chat_template.c on its own.
 * Byte-for-byte agreement with transformers is tests/test_ref_chat_template.py's job; here:
 * whitespace control worked out by hand, Python value semantics, what is refused when a
 * template is parsed (with its line), runtime errors and raise_exception, the guards against
 * runaway templates, concurrent renders of one parsed template, the transformers message
 * normalization, and random / truncated / mutated sources that must parse or fail cleanly. */
#include <check.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "text/chat_template.h"
#include "testutil.h"

static chat_template_t *parse_ok(const char *src) {
    chat_template_t *t = NULL;
    int rc = chat_template_parse(src, strlen(src), &t);
    ck_assert_msg(rc == CS_OK, "parse failed: %s\n%s", cs_error_last(), src);
    ck_assert_ptr_nonnull(t);
    return t;
}

/* Renders src with ctx (a JSON object text, or NULL); returns the malloc'd text or NULL with
 * the message in cs_error_last(). */
static char *render(const char *src, const char *ctx_json) {
    chat_template_t *t = NULL;
    if (chat_template_parse(src, strlen(src), &t) != CS_OK) return NULL;
    json_t *ctx = ctx_json ? json_loads(ctx_json, 0, NULL) : NULL;
    if (ctx_json) ck_assert_msg(ctx != NULL, "bad test JSON: %s", ctx_json);
    char *out = NULL;
    size_t len = 0;
    int rc = chat_template_render(t, ctx, &out, &len);
    if (rc == CS_OK) {
        ck_assert_ptr_nonnull(out);
        ck_assert_uint_eq(strlen(out), len);
    } else {
        ck_assert_ptr_null(out);
    }
    json_decref(ctx);
    chat_template_free(t);
    return out;
}

static void expect(const char *src, const char *ctx_json, const char *want) {
    char *got = render(src, ctx_json);
    ck_assert_msg(got != NULL, "template %s failed: %s", src, cs_error_last());
    ck_assert_msg(strcmp(got, want) == 0, "template %s\n  got  [%s]\n  want [%s]", src, got, want);
    free(got);
}

/* The parse must fail with a message that contains each of the given parts. */
static void expect_parse_error(const char *src, const char *part1, const char *part2) {
    chat_template_t *t = NULL;
    int rc = chat_template_parse(src, strlen(src), &t);
    const char *err = cs_error_last();
    ck_assert_msg(rc == CS_EINVAL, "template %s parsed (rc %d)", src, rc);
    ck_assert_ptr_null(t);
    ck_assert_msg(strstr(err, part1) != NULL, "template %s: error [%s] lacks [%s]", src, err, part1);
    if (part2) ck_assert_msg(strstr(err, part2) != NULL, "template %s: error [%s] lacks [%s]", src, err, part2);
}

static void expect_render_error(const char *src, const char *ctx_json, const char *part) {
    char *got = render(src, ctx_json);
    const char *err = cs_error_last();
    ck_assert_msg(got == NULL, "template %s rendered [%s]", src, got ? got : "");
    ck_assert_msg(strstr(err, part) != NULL, "template %s: error [%s] lacks [%s]", src, err, part);
}

/* a template, its context (JSON text or NULL) and what it must render, or a part of the
 * error it must fail with */
typedef struct render_case {
    const char *src, *ctx, *want;
} render_case;

static void expect_all(const render_case *c, size_t n) {
    for (size_t i = 0; i < n; i++) expect(c[i].src, c[i].ctx, c[i].want);
}

static void expect_render_errors(const render_case *c, size_t n) {
    for (size_t i = 0; i < n; i++) expect_render_error(c[i].src, c[i].ctx, c[i].want);
}

START_TEST(test_whitespace_control) {
    /* trim_blocks: the newline after a block tag goes; lstrip_blocks: the indentation before one */
    static const render_case cases[] = {
        {"{% if true %}\nyes\n{% endif %}\nafter", NULL, "yes\nafter"},
        {"  {% if true %}\n  yes\n  {% endif %}\n", NULL, "  yes\n"},
        {"a {% if true %}b{% endif %} c", NULL, "a b c"}, /* not at the start of a line: kept */
        {"{{ 1 }}\n{{ 2 }}\n", NULL, "1\n2"},             /* one trailing newline is dropped */
        {"x\n\n", NULL, "x\n"},
        {"a  {%- if true -%}  b  {%- endif -%}  c", NULL, "abc"},
        {"a \n {{- 'b' -}} \n c", NULL, "abc"},
        {"  {%+ if true %}x{% endif +%}\ny", NULL, "  x\ny"},
        {"  {# c #}\nz", NULL, "z"},
        {"a {#- c -#} b", NULL, "ab"},
        {"{% raw %}{{ x }}{% endraw %}", NULL, "{{ x }}"},
        {"a\r\nb\rc", NULL, "a\nb\nc"},
        {"  {{ 'x' }}", NULL, "  x"}, /* lstrip_blocks does not touch {{ */
        {"\t{% for i in [1, 2] %}\n\t{{ i }}\n\t{% endfor %}\n", NULL, "\t1\n\t2\n"},
    };
    expect_all(cases, CS_ARRAY_LEN(cases));
}
END_TEST

START_TEST(test_values_like_python) {
    static const render_case cases[] = {
        {"{{ 1.0 }} {{ true }} {{ none }} {{ [1, 'a', none] }} {{ {'k': (1,)} }}", NULL,
         "1.0 True None [1, 'a', None] {'k': (1,)}"},
        {"{{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** -1 }} {{ 1e16 }} {{ 0.1 + 0.2 }}", NULL,
         "3 -4 2 3.5 0.5 1e+16 0.30000000000000004"},
        {"{{ 'ab' * 2 }} {{ [1] + [2] }} {{ 'a' ~ 1 ~ none }} {{ 1 == 1.0 }} {{ 1 < 2 < 3 }}", NULL,
         "abab [1, 2] a1None True True"},
        {"{{ 'héllo'[1:3] }} {{ 'ab😀'|length }} {{ 'abc'[::-1] }} {{ [1, 2, 3][-1] }}", NULL, "él 3 cba 3"},
        {"{{ '  x  '.strip() }}|{{ 'a,b'.split(',') }}|{{ 'Hi'.upper() }}|{{ 'ß'.upper() }}", NULL,
         "x|['a', 'b']|HI|SS"},
        {"{{ \"it's\" }} {{ ['it\\'s'] }} {{ 'a\\tb' }}", NULL, "it's [\"it's\"] a\tb"},
        {"{{ x }}|{{ x is defined }}|{{ x|default('d') }}|{{ d.missing is defined }}", "{\"d\": {}}",
         "|False|d|False"},
        {"{{ m|tojson }} {{ m|tojson(indent=2) }}", "{\"m\": {\"a\": [1, \"é\"]}}",
         "{\"a\": [1, \"é\"]} {\n  \"a\": [\n    1,\n    \"é\"\n  ]\n}"},
        {"{% set ns = namespace(n=0) %}{% for i in range(4) %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}",
         NULL, "6"},
        {"{% set x = 1 %}{% for i in [1] %}{% set x = 5 %}{% endfor %}{{ x }}", NULL, "1"}, /* loop scope */
        {"{% macro m(a, b='B') %}{{ a }}{{ b }}{% endmacro %}{{ m(1) }}{{ m(2, b=3) }}", NULL, "1B23"},
        {"{% for k, v in d|items %}{{ k }}={{ v }}{{ ',' if not loop.last }}{% endfor %}",
         "{\"d\": {\"b\": 1, \"a\": 2}}", "b=1,a=2"},
        {"{{ ('<b>'|safe) + '<i>' }}", NULL, "<b>&lt;i&gt;"},
    };
    expect_all(cases, CS_ARRAY_LEN(cases));
}
END_TEST

START_TEST(test_parse_errors_have_lines) {
    /* each template and the one or two parts its parse error must contain */
    static const struct { const char *src, *part1, *part2; } cases[] = {
        {"ok\n\n{% frobnicate %}", "line 3", "unknown tag 'frobnicate'"},
        {"{{ x|nosuchfilter }}", "line 1", "no filter named 'nosuchfilter'"},
        {"\n{{ x is nosuchtest }}", "line 2", "no test named 'nosuchtest'"},
        {"{{ x.frobnicate() }}", "line 1", "unknown method 'frobnicate'"},
        {"a\nb\n{{ lipsum(2) }}", "line 3", "lipsum"},
        {"{{ foo() }}", "line 1", "unknown function 'foo'"},
        {"{{ x|random }}", "line 1", "not supported"},
        {"{{ x|urlize }}", "line 1", "not supported"},
        {"{% include 'x.jinja' %}", "line 1", "not supported"},
        {"{% extends 'base' %}", "line 1", "not supported"},
        {"{% for x in y recursive %}{% endfor %}", "line 1", "recursive"},
        {"{{ f(*args) }}", "line 1", "not supported"},
        {"\n{% break %}", "line 2", "outside of a loop"},
        {"{% if x %}\nno end", "line 2", "endif"},
        {"{% for x in y %}", "line 1", "endfor"},
        {"{{ 'unterminated }}", "line 1", NULL},
        {"{# never closed", "line 1", "comment"},
        {"{% raw %} never closed", "line 1", "raw"},
        {"{{ (1 }}", "line 1", NULL},
        {"{{ 1 + }}", "line 1", NULL},
        {"{{ 'a' 'b }}", "line 1", NULL},
        {"{% endif %}", "line 1", "unknown tag 'endif'"},
        {"{{ x ! y }}", "line 1", "unexpected char '!'"},
        {"{{ '\\N{BULLET}' }}", "line 1", NULL},
        {"caf\xe9", "UTF-8", NULL},
        /* the filter-name check does not depend on the branch being taken */
        {"{% if false %}{{ x|nosuchfilter }}{% endif %}", "line 1", "nosuchfilter"},
    };
    for (size_t i = 0; i < CS_ARRAY_LEN(cases); i++) expect_parse_error(cases[i].src, cases[i].part1, cases[i].part2);
    /* a joiner or a macro defined anywhere can be called */
    expect("{% set j = joiner('/') %}{{ j() }}a{{ j() }}b", NULL, "a/b");
    expect_render_error("{{ m() }}{% macro m() %}late{% endmacro %}", NULL, "'m' is undefined");
}
END_TEST

START_TEST(test_runtime_errors) {
    static const render_case errors[] = {
        /* raise_exception's message comes back as it is */
        {"{{ raise_exception('Conversation roles must alternate') }}", NULL, "Conversation roles must alternate"},
        {"line one\n{{ 1 + 'a' }}", NULL, "line 2"},
        {"{{ x.y }}", NULL, "'x' is undefined"},
        {"{{ m[0].role }}", "{\"m\": []}", "has no element 0"},
        {"{{ 1 / 0 }}", NULL, "division by zero"},
        {"{{ [].append(1) }}", NULL, "unsafe"},
        {"{{ namespace(_x=1) }}", NULL, "underscore"},
        {"{% set x = 1 %}{% set x.a = 2 %}", NULL, "non-namespace"},
        {"{{ 9223372036854775807 + 1 }}", NULL, "64 bits"},
        {"{{ range(200000)|length }}", NULL, "Range too big"},
        {"{{ 'x'|int(bse=1) }}", NULL, "unexpected keyword argument 'bse'"},
        /* a generator fails only when something consumes it, as in Python */
        {"{{ [1, 2]|map('nosuch')|list }}", NULL, "no filter named 'nosuch'"},
        /* printing what Python would print with a memory address is refused */
        {"{{ 'x'.upper }}", NULL, "memory address"},
    };
    expect_render_errors(errors, CS_ARRAY_LEN(errors));
    char *got = render("{% if true %}\n{{ raise_exception('exact') }}{% endif %}", NULL);
    ck_assert_ptr_null(got);
    ck_assert_str_eq(cs_error_last(), "exact");
    expect("{{ 'x'|int(base=1) }}", NULL, "0"); /* a bad base is a ValueError: the default */
    expect("{% set g = [1, 2]|map('nosuch') %}ok", NULL, "ok"); /* not consumed */
    /* a context that is not an object */
    chat_template_t *t = parse_ok("x");
    json_t *arr = json_array();
    char *out = NULL;
    ck_assert_int_eq(chat_template_render(t, arr, &out, NULL), CS_EINVAL);
    ck_assert_ptr_null(out);
    json_decref(arr);
    ck_assert_int_eq(chat_template_render(t, NULL, &out, NULL), CS_OK);
    ck_assert_str_eq(out, "x");
    free(out);
    chat_template_free(t);
    chat_template_free(NULL);
}
END_TEST

START_TEST(test_limits) {
    static const render_case errors[] = {
        {"{% macro r(n) %}{{ r(n + 1) }}{% endmacro %}{{ r(0) }}", NULL, "deeper than"},
        {"{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", NULL, "longer than"},
        {"{% set ns = namespace(s='xx') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", NULL,
         "MiB"},
        {"{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", NULL, "loop iterations"},
        {"{{ 'x' * 100000000 }}", NULL, "too long"},
    };
    expect_render_errors(errors, CS_ARRAY_LEN(errors));
    /* deeply nested source is refused when parsed, without exhausting the stack */
    char *deep = malloc(20001);
    memset(deep, '(', 10000);
    memset(deep + 10000, ')', 10000);
    deep[20000] = 0;
    char *src = malloc(20010);
    snprintf(src, 20010, "{{ %s }}", deep);
    expect_parse_error(src, "nested too deeply", NULL);
    free(deep);
    free(src);
    size_t open_len = strlen("{% if x %}"), close_len = strlen("{% endif %}");
    src = malloc(3000 * (open_len + close_len) + 1);
    char *p = src;
    for (int i = 0; i < 3000; i++, p += open_len) memcpy(p, "{% if x %}", open_len);
    for (int i = 0; i < 3000; i++, p += close_len) memcpy(p, "{% endif %}", close_len);
    *p = 0;
    expect_parse_error(src, "nested too deeply", NULL);
    free(src);
}
END_TEST

static const char *const MT_TEMPLATE =
    "{%- for m in messages %}<{{ m.role }}>{{ m.content|trim }}{% if m.tools %}{{ m.tools|tojson }}{% endif %}"
    "</{{ m.role }}>\n{%- endfor %}{% if add_generation_prompt %}<assistant>{% endif %}";

typedef struct worker {
    const chat_template_t *t;
    const json_t *ctx;
    const char *want;
    int failures;
} worker;

static void *render_many(void *arg) {
    worker *w = arg;
    for (int i = 0; i < 300; i++) {
        char *out = NULL;
        size_t len = 0;
        if (chat_template_render(w->t, w->ctx, &out, &len) != CS_OK || strcmp(out, w->want) != 0)
            w->failures++;
        free(out);
    }
    return NULL;
}

START_TEST(test_concurrent_renders) {
    chat_template_t *t = parse_ok(MT_TEMPLATE);
    json_t *ctx = json_loads("{\"add_generation_prompt\": true, \"messages\": ["
                             "{\"role\": \"system\", \"content\": \"  be brief  \"},"
                             "{\"role\": \"user\", \"content\": \"日本語 😀\", \"tools\": [{\"a\": 1}]}]}",
                             0, NULL);
    ck_assert_ptr_nonnull(ctx);
    char *want = NULL;
    ck_assert_int_eq(chat_template_render(t, ctx, &want, NULL), CS_OK);
    ck_assert_str_eq(want, "<system>be brief</system><user>日本語 😀[{\"a\": 1}]</user><assistant>");
    enum { N = 4 };
    pthread_t th[N];
    worker w[N];
    for (int i = 0; i < N; i++) {
        w[i] = (worker){t, ctx, want, 0};
        ck_assert_int_eq(pthread_create(&th[i], NULL, render_many, &w[i]), 0);
    }
    for (int i = 0; i < N; i++) {
        pthread_join(th[i], NULL);
        ck_assert_int_eq(w[i].failures, 0);
    }
    free(want);
    json_decref(ctx);
    chat_template_free(t);
}
END_TEST

START_TEST(test_hf_messages) {
    json_t *in = json_loads("[{\"role\": \"assistant\", \"content\": \"a\", \"reasoning\": \"r\", \"x\": null},"
                            "{\"role\": \"user\", \"content\": null}]",
                            0, NULL);
    json_t *out = chat_template_hf_messages(in, false);
    char *s = json_dumps(out, JSON_COMPACT);
    ck_assert_str_eq(s, "[{\"thinking\":\"r\",\"role\":\"assistant\",\"content\":\"a\",\"reasoning\":\"r\",\"x\":null,"
                        "\"reasoning_content\":\"r\"},{\"role\":\"user\",\"content\":null}]");
    free(s);
    json_decref(out);
    out = chat_template_hf_messages(in, true);
    s = json_dumps(out, JSON_COMPACT);
    ck_assert_str_eq(s, "[{\"thinking\":\"r\",\"role\":\"assistant\",\"content\":\"a\",\"reasoning\":\"r\","
                        "\"reasoning_content\":\"r\"},{\"role\":\"user\"}]");
    free(s);
    json_decref(out);
    json_decref(in);
    in = json_loads("[1]", 0, NULL);
    ck_assert_ptr_null(chat_template_hf_messages(in, false));
    json_decref(in);
    ck_assert_ptr_null(chat_template_hf_messages(NULL, false));
}
END_TEST

/* Parse (and render when it parses) must return OK or EINVAL, never crash or leak. */
static void try_source(const char *src, size_t len, const json_t *ctx) {
    chat_template_t *t = NULL;
    int rc = chat_template_parse(src, len, &t);
    ck_assert(rc == CS_OK || rc == CS_EINVAL);
    if (rc != CS_OK) {
        ck_assert_ptr_null(t);
        const char *err = cs_error_last();
        ck_assert(strncmp(err, "line ", 5) == 0 || strstr(err, "UTF-8") != NULL);
        return;
    }
    char *out = NULL;
    rc = chat_template_render(t, ctx, &out, NULL);
    ck_assert(rc == CS_OK || rc == CS_EINVAL);
    free(out);
    chat_template_free(t);
}

static const char *const FUZZ_BASE =
    "{%- if messages[0]['role'] == 'system' %}{%- set sys = messages[0].content|trim %}{%- endif %}\n"
    "{%- for m in messages if m.role != 'system' %}\n"
    "  {%- if (m.role == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('alternate') }}{% endif %}\n"
    "  {{- '<|' ~ m.role ~ '|>\\n' + (m.content if m.content is string else m.content|tojson(indent=2)) }}\n"
    "  {%- set ns = namespace(x=loop.index) %}{# comment #}{% raw %}{{ raw }}{% endraw %}\n"
    "{%- endfor %}{% macro f(a, b=[1, 2]) %}{{ a|upper }}{{ b|join(',') }}{% endmacro %}{{ f('x') }}\n"
    "{{ \"it's\\n\"|replace('i', 'I') }}{{ {'k': (1, 2.5, none, true)}|dictsort }}{{ 'a b'.split()[-1] }}";

START_TEST(test_fuzz_sources) {
    json_t *ctx = json_loads("{\"messages\": [{\"role\": \"system\", \"content\": \" s \"}, {\"role\": \"user\", "
                             "\"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": [1, {\"a\": 2}]}]}",
                             0, NULL);
    size_t n = strlen(FUZZ_BASE);
    try_source(FUZZ_BASE, n, ctx);
    for (size_t cut = 0; cut <= n; cut++) try_source(FUZZ_BASE, cut, ctx); /* every truncation */
    srand(12345);
    char *buf = malloc(n + 1);
    for (int iter = 0; iter < 3000; iter++) { /* random byte edits of the base */
        memcpy(buf, FUZZ_BASE, n + 1);
        int edits = 1 + rand() % 4;
        for (int e = 0; e < edits; e++) {
            size_t at = (size_t)rand() % n;
            static const char pool[] = "{}%#-+()[]|.,:'\"\\~ \nx1=!<>";
            buf[at] = rand() % 8 ? pool[rand() % (sizeof pool - 1)] : (char)(rand() % 256);
        }
        try_source(buf, n, ctx);
    }
    free(buf);
    static const char *const pieces[] = {"{{", "}}", "{%", "%}", "{#", "#}", "-", "+", " ", "\n", "if ", "for ",
                                         "in ", "endif", "endfor", "else", "x", "'s'", "\"", "(", ")", "[", "]",
                                         "{", "}", "|", "trim", "upper", ".", "1", "2.5", ",", ":", "=", "set ",
                                         "macro ", "endmacro", "raw", "endraw", "is ", "not ", "and ", "~", "*",
                                         "loop.index", "messages", "none", "range(3)", "\\", "\xc3\xa9"};
    char src[512];
    for (int iter = 0; iter < 5000; iter++) { /* random token soup */
        size_t len = 0;
        int count = 1 + rand() % 30;
        for (int k = 0; k < count; k++) {
            const char *p = pieces[rand() % (sizeof pieces / sizeof pieces[0])];
            size_t l = strlen(p);
            if (len + l >= sizeof src) break;
            memcpy(src + len, p, l);
            len += l;
        }
        try_source(src, len, ctx);
    }
    json_decref(ctx);
}
END_TEST

int main(void) {
    const TTest *const tests[] = {
        test_whitespace_control, test_values_like_python, test_parse_errors_have_lines, test_runtime_errors,
        test_limits, test_concurrent_renders, test_hf_messages, test_fuzz_sources,
    };
    /* test_limits runs ten million loop iterations; slower under sanitizers */
    return cs_check_main("chat_template", tests, CS_ARRAY_LEN(tests), 120, CK_FORK);
}
