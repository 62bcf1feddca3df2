/* fuzz_grammar.c: the grammar engine's four front ends, which a request reaches with its own
 * text (text/grammar/): built as fuzz_gbnf (GBNF -> grammar_compile), fuzz_regex (a regular
 * expression -> grammar_regex_to_gbnf -> grammar_compile), fuzz_schema (JSON text ->
 * grammar_json_schema_to_gbnf -> grammar_compile) and fuzz_lark (Lark text ->
 * grammar_lark_to_gbnf -> grammar_compile). A refusal must carry a message; what a regex or
 * schema translation produces must compile (a Lark one may still be refused by the compiler,
 * for a left recursion through other rules, with a message); a compiled grammar is then driven: the input's bytes
 * through a matcher (accepted or not, never a crash), and at each of a few steps the
 * trie-walk mask of a small vocabulary must equal the per-token reference. */
#include <jansson.h>
#include <string.h>

#include "tests/fuzz/fuzz.h"
#include "text/grammar/grammar.h"

static grammar_vocab_t *vocab;
static const char *const TOKS[] = {"{", "}", "[", "]", "\"", ":", ",", "a", "b", "ab", "0", "1", "12", "-", ".", "e",
                                   "true", "false", "null", " ", "\n", "\\", "x", "\"a\"", "\":", "\xc3\xa9", "\xc3",
                                   "\xa9", "\xe4\xb8\x80", "\xf0\x9f", "\x98\x80", "abc", "(", ")", "|", "*", "+"};
enum { NT = sizeof TOKS / sizeof TOKS[0] };

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    size_t lens[NT + 1];
    const char *toks[NT + 1];
    for (int i = 0; i < NT; i++) {
        toks[i] = TOKS[i];
        lens[i] = strlen(TOKS[i]);
    }
    toks[NT] = NULL; /* EOS */
    lens[NT] = 0;
    int32_t eos = NT;
    if (grammar_vocab_from_bytes(toks, lens, NT + 1, &eos, 1, &vocab)) abort();
    return 0;
}

static bool has_message(void) { return strcmp(cs_error_last(), "no error message") != 0; }

/* drive a compiled grammar: masks against the reference, tokens taken from the input */
static void drive(grammar_t *g, const uint8_t *data, size_t size) {
    grammar_matcher_t *m = grammar_matcher_new(g);
    FUZZ_CHECK(m != NULL, "no matcher");
    uint32_t fast[(NT + 1 + 31) / 32], ref[(NT + 1 + 31) / 32];
    for (size_t step = 0; step < 8; step++) {
        grammar_matcher_mask(m, vocab, fast);
        grammar_matcher_mask_ref(m, vocab, ref);
        FUZZ_CHECK(!memcmp(fast, ref, sizeof fast), "step %zu: the mask differs from the reference", step);
        int t = size ? data[step % size] % (NT + 1) : 0, k = 0;
        while (k <= NT && !(ref[t >> 5] >> (t & 31) & 1)) t = (t + 1) % (NT + 1), k++;
        if (k > NT || t == NT) break;
        bool ok = grammar_matcher_accept_token(m, vocab, t);
        if (!ok && grammar_matcher_too_ambiguous(m)) break; /* refused for its parse count, by design */
        FUZZ_CHECK(ok, "an allowed token (%d) was refused", t);
    }
    grammar_matcher_free(m);
    m = grammar_matcher_new(g);
    grammar_matcher_accept_bytes(m, data, size); /* any answer; no crash */
    grammar_matcher_free(m);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size > 4096) return 0; /* the repetition bounds make long inputs slow, not interesting */
    cs_error_clear();
    char *gbnf = NULL;
    int rc;
#if defined(FUZZ_GBNF)
    gbnf = fuzz_cstr(data, size);
    rc = CS_OK;
#elif defined(FUZZ_REGEX)
    rc = grammar_regex_to_gbnf((const char *)data, size, &gbnf);
#elif defined(FUZZ_LARK)
    rc = grammar_lark_to_gbnf((const char *)data, size, &gbnf);
#else
    json_error_t je;
    json_t *schema = json_loadb((const char *)data, size, 0, &je);
    char *path = NULL;
    rc = schema ? grammar_json_schema_to_gbnf(schema, NULL, &gbnf, &path) : CS_EINVAL;
    if (!schema) cs_error_set(CS_EINVAL, "not JSON");
    json_decref(schema);
    free(path);
#endif
    if (rc != CS_OK) {
        FUZZ_CHECK(has_message(), "a refusal without a message");
        free(gbnf);
        return 0;
    }
    grammar_t *g = NULL;
    rc = grammar_compile(gbnf, strlen(gbnf), &g);
#if !defined(FUZZ_GBNF) && !defined(FUZZ_LARK)
    FUZZ_CHECK(rc == CS_OK || rc == CS_ENOMEM || strstr(cs_error_last(), "too large"),
               "a translation that does not compile: %s\n%s", cs_error_last(), gbnf);
#endif
    free(gbnf);
    if (rc != CS_OK) {
        FUZZ_CHECK(has_message(), "a compile failure without a message");
        return 0;
    }
    fuzz_accepted++;
    drive(g, data, size);
    grammar_unref(g);
    return 0;
}
