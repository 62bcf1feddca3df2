/* test_grammar.c: the GBNF compiler and the matcher (text/grammar/). Compile errors name what
 * is wrong; tables of grammars and strings, each fully matched or not (accept_bytes then
 * can_end), prefixes that stay open, characters split inside UTF-8; and the trie-walk mask
 * equal to the plain per-token reference mask on random walks through JSON and other
 * grammars over a random vocabulary of byte strings (split UTF-8 included). */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "text/grammar/grammar.h"
#include "testutil.h"

static const char JSON_GBNF[] =
    "root ::= object\n"
    "value ::= object | array | string | number | (\"true\" | \"false\" | \"null\")\n"
    "object ::= \"{\" ( string \":\" value (\",\" string \":\" value)* )? \"}\"\n"
    "array ::= \"[\" ( value (\",\" value)* )? \"]\"\n"
    "string ::= \"\\\"\" ( [^\"\\\\\\x00-\\x1f] | \"\\\\\" ([\"\\\\/bfnrt] | \"u\" [0-9a-fA-F]{4}) )* \"\\\"\"\n"
    "number ::= \"-\"? (\"0\" | [1-9] [0-9]*) (\".\" [0-9]+)? ([eE] [-+]? [0-9]+)?\n";

static grammar_t *compile_ok(const char *src) {
    grammar_t *g = NULL;
    int rc = grammar_compile(src, strlen(src), &g);
    ck_assert_msg(rc == CS_OK, "%s: %s", src, cs_error_last());
    return g;
}

/* fully matched: every byte accepted and the grammar can end there */
static int full_match(const grammar_t *g, const char *s, size_t n) {
    grammar_matcher_t *m = grammar_matcher_new(g);
    ck_assert_ptr_nonnull(m);
    int r = grammar_matcher_accept_bytes(m, (const uint8_t *)s, n) ? (grammar_matcher_can_end(m) ? 1 : 2) : 0;
    grammar_matcher_free(m);
    return r; /* 0: rejected, 1: complete, 2: a prefix */
}

typedef struct { const char *gbnf, *msg; } bad_t;
static const bad_t BAD[] = {
    {"root ::= foo\n", "undefined rule 'foo'"},
    {"start ::= \"a\"\n", "no rule named 'root'"},
    {"root ::= root \"a\" | \"b\"\n", "left-recursive"},
    {"root ::= a\na ::= b \"x\"\nb ::= \"\" | a\n", "left-recursive"},
    {"root ::= \"abc\n", "past the end of the line"},
    {"root ::= \"a\\q\"\n", "unknown escape"},
    {"root ::= [a-\n", "unterminated character class"},
    {"root ::= [z-a]\n", "backwards"},
    {"root ::= \"a\"{3,2}\n", "below m"},
    {"root ::= * \"a\"\n", "must follow something"},
    {"root ::= (\"a\"\n", "expecting ')'"},
    {"root = \"a\"\n", "expecting '::='"},
    {"root ::= \"a\"\nroot ::= \"b\"\n", "defined twice"},
    {"root ::= \"\\x4\"\n", "hex digits"},
    {"root ::= [^\\x00-\\U0010FFFF]\n", "empty character class"},
};

START_TEST(compile_errors) {
    const bad_t *c = &BAD[_i];
    grammar_t *g = NULL;
    ck_assert_int_eq(grammar_compile(c->gbnf, strlen(c->gbnf), &g), CS_EINVAL);
    ck_assert_ptr_null(g);
    ck_assert_msg(strstr(cs_error_last(), c->msg), "%s: '%s' lacks '%s'", c->gbnf, cs_error_last(), c->msg);
}
END_TEST

typedef struct { const char *gbnf, *s; int want; } match_t;
static const match_t MATCH[] = {
    {JSON_GBNF, "{}", 1},
    {JSON_GBNF, "{\"a\":1}", 1},
    {JSON_GBNF, "{\"a\":[1,2.5e-3,{\"b\":null}],\"c\":\"x\\u00e9\\n\"}", 1},
    {JSON_GBNF, "{\"a\":\"\xc3\xa9\xf0\x9f\x98\x80\"}", 1},
    {JSON_GBNF, "{\"a\" :1}", 0},
    {JSON_GBNF, "{a:1}", 0},
    {JSON_GBNF, "{\"a\":01}", 0},
    {JSON_GBNF, "[1]", 0},
    {JSON_GBNF, "{\"a\":1", 2},
    {JSON_GBNF, "{\"a\":\"\xc3", 2},         /* inside a character */
    {JSON_GBNF, "{\"a\":\"\xc3\x28\"}", 0},   /* not UTF-8 */
    {JSON_GBNF, "{\"a\":\"\xed\xa0\x80\"}", 0}, /* a surrogate */
    {JSON_GBNF, "{\"a\":\"\x01\"}", 0},
    {JSON_GBNF, "{}{}", 0},
    {"root ::= \"a\"{2,3}\n", "a", 2},
    {"root ::= \"a\"{2,3}\n", "aa", 1},
    {"root ::= \"a\"{2,3}\n", "aaa", 1},
    {"root ::= \"a\"{2,3}\n", "aaaa", 0},
    {"root ::= (\"ab\"){2,}\n", "ababab", 1},
    {"root ::= (\"ab\"){2,}\n", "aba", 2},
    {"root ::= \"ab\"+ \"c\"\n", "ababc", 1},
    {"root ::= \"x\" [\xce\xb1-\xcf\x89]+\n", "x\xce\xb1\xce\xb2", 1},
    {"root ::= \"x\" [\xce\xb1-\xcf\x89]+\n", "xa", 0},
    {"root ::= \"x\" [\xce\xb1-\xcf\x89]+\n", "x\xce", 2},
    {"root ::= .\n", "\n", 1},
    {"root ::= .\n", "\xf0\x9f\x98\x80", 1},
    {"root ::= .\n", "ab", 0},
    {"root ::= [^a-z]\n", "\xc3\xa9", 1},
    {"root ::= [^a-z]\n", "q", 0},
    {"root ::= \"\\u00e9\" \"\\U0001F600\"\n", "\xc3\xa9\xf0\x9f\x98\x80", 1},
    {"# a comment\nroot ::= a | b # another\n\na ::= \"x\"\nb ::= (\n  \"y\" |\n  \"z\"\n)\n", "z", 1},
    {"root ::= \"\" | \"a\"\n", "", 1},
    {"root ::= x* \"b\"\nx ::= \"a\"?\n", "b", 1},       /* a repeated part that can match nothing */
    {"root ::= x* \"b\"\nx ::= \"a\"?\n", "aaab", 1},
    {"root ::= (\"\" | \"yes\" | \"no\")* \"!\"\n", "yesnoyes!", 1},
    {"root ::= (\"\" | \"yes\" | \"no\")* \"!\"\n", "yesn!", 0},
    {"root ::= (x y)+\nx ::= \"a\"*\ny ::= \"b\"?\n", "aabab", 1},
    {"root ::= x \"b\"\nx ::= \"a\" x | \"\"\n", "aaab", 1},
    {"root ::= \"a\" \"\"{2,3} \"b\"\n", "ab", 1},          /* "" repeated is still "" */
    {"root ::= \"\"{2} | \"x\"\n", "", 1},
    {"root ::= \"[\\\"\\\\\\t\\]]\"\n", "[\"\\\t]]", 1},
};

/* a schema whose array items or extra properties translate to a long expression: the whole
 * expression reaches the grammar (it once went through a fixed buffer and was cut) */
START_TEST(schema_long_parts) {
    char lit[400];
    memset(lit, 'o', sizeof lit - 1);
    lit[sizeof lit - 1] = 0;
    const char *fmt[] = {"{\"type\":\"array\",\"items\":{\"enum\":[\"%s\",\"b\"]}}",
                         "{\"type\":\"array\",\"items\":{\"enum\":[\"%s\",\"b\"]},\"maxItems\":3}",
                         "{\"type\":\"object\",\"additionalProperties\":{\"enum\":[\"%s\",\"b\"]}}"};
    const char *want[] = {"[\"b\",\"%s\"]", "[\"%s\",\"b\",\"b\"]", "{\"k\":\"b\",\"j\":\"%s\"}"};
    for (int i = 0; i < 3; i++) {
        char src[1024], out[1024];
        snprintf(src, sizeof src, fmt[i], lit);
        snprintf(out, sizeof out, want[i], lit);
        json_error_t je;
        json_t *schema = json_loads(src, 0, &je);
        ck_assert_ptr_nonnull(schema);
        char *gbnf = NULL, *path = NULL;
        ck_assert_msg(grammar_json_schema_to_gbnf(schema, NULL, &gbnf, &path) == CS_OK, "%s", cs_error_last());
        json_decref(schema);
        free(path);
        grammar_t *g = compile_ok(gbnf);
        ck_assert_msg(full_match(g, out, strlen(out)) == 1, "%s on %s", gbnf, out);
        out[2] = 'x'; /* a string the enum does not hold */
        if (i == 2) out[8] = 'x';
        ck_assert_int_eq(full_match(g, out, strlen(out)), 0);
        grammar_unref(g);
        free(gbnf);
    }
}
END_TEST

START_TEST(matches) {
    const match_t *c = &MATCH[_i];
    grammar_t *g = compile_ok(c->gbnf);
    ck_assert_msg(full_match(g, c->s, strlen(c->s)) == c->want, "%s on '%s': want %d", c->gbnf, c->s, c->want);
    grammar_unref(g);
}
END_TEST

START_TEST(done_and_eos) {
    grammar_t *g = compile_ok(JSON_GBNF);
    const char *toks[] = {"{", "}", "\"a\"", ":", "1", NULL};
    size_t lens[] = {1, 1, 3, 1, 1, 0};
    int32_t eos = 5;
    grammar_vocab_t *v;
    ck_assert_int_eq(grammar_vocab_from_bytes(toks, lens, 6, &eos, 1, &v), CS_OK);
    grammar_matcher_t *m = grammar_matcher_new(g);
    uint32_t mask[1];
    grammar_matcher_mask(m, v, mask);
    ck_assert_uint_eq(mask[0], 1u << 0);
    ck_assert(!grammar_matcher_accept_token(m, v, 5)); /* EOS before the end */
    ck_assert(grammar_matcher_accept_token(m, v, 0));
    ck_assert(!grammar_matcher_done(m));
    ck_assert(grammar_matcher_accept_token(m, v, 1));
    ck_assert(grammar_matcher_done(m));
    grammar_matcher_mask(m, v, mask);
    ck_assert_uint_eq(mask[0], 1u << 5); /* only EOS */
    ck_assert(grammar_matcher_accept_token(m, v, 5));
    grammar_matcher_mask(m, v, mask);
    ck_assert_uint_eq(mask[0], 0);
    grammar_matcher_free(m);
    grammar_vocab_free(v);
    grammar_unref(g);
}
END_TEST

/* a grammar ambiguous past any use (nullable repeats of nullable repeats): one mask would
 * follow hundreds of millions of paths; it stops at 16M, refused, allowing nothing */
START_TEST(too_ambiguous_step) {
    grammar_t *g = compile_ok("root ::= [a-z]?{5,31}?{5,31}?\n");
    const char *toks[] = {"a", "bc", "z", NULL};
    size_t lens[] = {1, 2, 1, 0};
    int32_t eos = 3;
    grammar_vocab_t *v;
    ck_assert_int_eq(grammar_vocab_from_bytes(toks, lens, 4, &eos, 1, &v), CS_OK);
    grammar_matcher_t *m = grammar_matcher_new(g);
    uint32_t mask[1] = {~0u}, ref[1] = {~0u};
    grammar_matcher_mask(m, v, mask);
    ck_assert(grammar_matcher_too_ambiguous(m));
    ck_assert_uint_eq(mask[0], 0);
    grammar_matcher_mask_ref(m, v, ref);
    ck_assert_uint_eq(ref[0], 0);
    ck_assert(!grammar_matcher_accept_token(m, v, 0));
    grammar_matcher_free(m);
    grammar_vocab_free(v);
    grammar_unref(g);
}
END_TEST

/* ---- the fast mask against the reference on random walks ---- */
static uint64_t rng_state;
static uint32_t rnd(void) {
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(rng_state >> 33);
}

static const char *const GRAMMARS[] = {
    JSON_GBNF,
    "root ::= (x y)+ \"$\"\nx ::= \"a\"*\ny ::= (\"b\" | \"\\\"\")?\n",
    "root ::= (\"ab\" | \"a\" [0-9]* | [\xce\xb1-\xcf\x89\xe4\xb8\x80-\xe9\xbf\xbf]{1,3} \"!\")+ \"$\"\n",
    "root ::= item (\",\" item){0,4}\nitem ::= \"x\" | \"xy\" | \"\\\"\" [^\"]* \"\\\"\"\n",
};

START_TEST(mask_equals_reference) {
    rng_state = 1234 + (uint64_t)_i;
    enum { NV = 3000 };
    static const char *frag[] = {"{", "}", "[", "]", "\"", ":", ",", "0", "1", "9", "-", ".", "e", "E", "+", "true",
                                 "false", "null", "\\", "u", "a", "ab", "x", "y", "$", "!", " ", "\n",
                                 "\xc3\xa9", "\xce\xb1", "\xe4\xb8\x80", "\xf0\x9f\x98\x80", "\xc3", "\xa9",
                                 "\xce", "\xb1\xce", "\xe4\xb8", "\x80", "\xf0\x9f", "\x98\x80"};
    const int nf = (int)(sizeof frag / sizeof frag[0]);
    char *toks[NV + 1];
    size_t lens[NV + 1];
    for (int i = 0; i < NV; i++) {
        char buf[32];
        size_t n = 0;
        if (i < 256) buf[n++] = (char)i;
        else
            for (int k = 0, parts = 1 + (int)(rnd() % 4); k < parts; k++) {
                const char *f = frag[rnd() % (uint32_t)nf];
                memcpy(buf + n, f, strlen(f));
                n += strlen(f);
            }
        toks[i] = malloc(n + 1);
        memcpy(toks[i], buf, n);
        lens[i] = n;
    }
    toks[NV] = NULL;
    lens[NV] = 0;
    int32_t eos = NV;
    grammar_vocab_t *v;
    ck_assert_int_eq(grammar_vocab_from_bytes((const char *const *)toks, lens, NV + 1, &eos, 1, &v), CS_OK);
    grammar_t *g = compile_ok(GRAMMARS[_i % 4]);
    uint32_t fast[(NV + 1 + 31) / 32], ref[(NV + 1 + 31) / 32];
    int steps = 0;
    for (int walk = 0; walk < 6; walk++) {
        grammar_matcher_t *m = grammar_matcher_new(g);
        for (int step = 0; step < 60; step++, steps++) {
            grammar_matcher_mask(m, v, fast);
            grammar_matcher_mask_ref(m, v, ref);
            for (int w = 0; w < (NV + 1 + 31) / 32; w++)
                ck_assert_msg(fast[w] == ref[w], "walk %d step %d word %d: %08x vs %08x", walk, step, w, fast[w], ref[w]);
            int allowed[NV + 1], na = 0;
            for (int t = 0; t <= NV; t++)
                if (ref[t >> 5] >> (t & 31) & 1) allowed[na++] = t;
            if (!na) break;
            int bad = (int)(rnd() % (NV + 1));
            if (!(ref[bad >> 5] >> (bad & 31) & 1)) ck_assert(!grammar_matcher_accept_token(m, v, bad));
            int t = allowed[rnd() % (uint32_t)na];
            if (t == NV && na > 1 && rnd() % 4) t = allowed[0] == NV ? allowed[1] : allowed[0];
            ck_assert(grammar_matcher_accept_token(m, v, t));
            if (t == NV) break;
        }
        grammar_matcher_free(m);
    }
    ck_assert_int_gt(steps, 10);
    grammar_unref(g);
    grammar_vocab_free(v);
    for (int i = 0; i < NV; i++) free(toks[i]);
}
END_TEST

int main(void) {
    Suite *s = suite_create("grammar");
    TCase *tc = tcase_create("core");
    tcase_add_loop_test(tc, compile_errors, 0, (int)CS_ARRAY_LEN(BAD));
    tcase_add_loop_test(tc, matches, 0, (int)CS_ARRAY_LEN(MATCH));
    tcase_add_test(tc, done_and_eos);
    tcase_add_test(tc, too_ambiguous_step);
    tcase_add_test(tc, schema_long_parts);
    tcase_add_loop_test(tc, mask_equals_reference, 0, 8);
    tcase_set_timeout(tc, 300);
    suite_add_tcase(s, tc);
    return cs_check_run(s, CK_NOFORK) ? 1 : 0;
}
