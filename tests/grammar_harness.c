/* grammar_harness.c: the grammar engine on a real tokenizer, for tests/test_grammar_masks.py.
 *
 *   grammar_harness TOKDIR bytes                  every token's bytes: "id hex" per line
 *                                                 (special or empty: "id -")
 *   grammar_harness TOKDIR walk GBNF SEED STEPS   a random walk through the grammar: at each
 *                                                 step the trie-walk mask must equal the
 *                                                 per-token reference; then a random allowed
 *                                                 token. Prints the steps and the mean time
 *                                                 of each mask; exit 1 on a difference.
 *   grammar_harness - match regex|schema|gbnf|lark SPEC  for each line of stdin (a JSON string),
 *                                                 "1" when SPEC (a regex, JSON Schema text or
 *                                                 GBNF) matches it in full, else "0"; or one
 *                                                 line "error: MESSAGE" when SPEC is refused
 *   grammar_harness - sample regex|schema|gbnf|lark SPEC N SEED   up to N strings of SPEC's language
 *                                                 (JSON lines), each a random walk over the
 *                                                 bytes the grammar allows until it may end;
 *                                                 walks longer than 3000 bytes are dropped */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "text/grammar/grammar.h"

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    if (b && fread(b, 1, (size_t)n, f) != (size_t)n) { free(b); b = NULL; }
    fclose(f);
    if (b) { b[n] = 0; *len = (size_t)n; }
    return b;
}

static uint64_t rng = 88172645463325252ull;
static uint32_t rnd(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)rng;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int walk(const grammar_vocab_t *v, const char *gbnf_path, int steps) {
    size_t len;
    char *src = read_file(gbnf_path, &len);
    grammar_t *g;
    if (!src || grammar_compile(src, len, &g)) { fprintf(stderr, "grammar: %s\n", cs_error_last()); return 2; }
    int n = grammar_vocab_size(v), words = (n + 31) / 32;
    uint32_t *fast = malloc(sizeof *fast * (size_t)words), *ref = malloc(sizeof *ref * (size_t)words);
    int32_t *allowed = malloc(sizeof *allowed * (size_t)n);
    grammar_matcher_t *m = grammar_matcher_new(g);
    double t_fast = 0, t_ref = 0, *times = malloc(sizeof(double) * (size_t)(steps + 1));
    int done = 0, rc = 0, restarts = 0;
    for (int step = 0; step < steps && rc == 0; step++) {
        double t0 = cs_time_ms();
        grammar_matcher_mask(m, v, fast);
        double t1 = cs_time_ms();
        grammar_matcher_mask_ref(m, v, ref);
        t_fast += t1 - t0;
        times[done] = t1 - t0;
        t_ref += cs_time_ms() - t1;
        done++;
        int na = 0;
        for (int w = 0; w < words; w++) {
            if (fast[w] != ref[w]) {
                fprintf(stderr, "step %d: mask word %d: %08x vs reference %08x\n", step, w, fast[w], ref[w]);
                rc = 1;
            }
            for (int b = 0; b < 32; b++)
                if (ref[w] >> b & 1) allowed[na++] = w * 32 + b;
        }
        int32_t t = na ? allowed[rnd() % (uint32_t)na] : -1;
        size_t tl;
        if (na > 1 && (!grammar_vocab_bytes(v, t, &tl) || rnd() % 3 == 0)) /* EOS now and then only */
            for (int k = 0; k < 8 && !grammar_vocab_bytes(v, t, &tl); k++) t = allowed[rnd() % (uint32_t)na];
        if (t < 0 || !grammar_vocab_bytes(v, t, &tl)) { /* the end: start again */
            grammar_matcher_free(m);
            m = grammar_matcher_new(g);
            restarts++;
            continue;
        }
        if (!grammar_matcher_accept_token(m, v, t)) {
            fprintf(stderr, "step %d: token %d was allowed but not accepted\n", step, t);
            rc = 1;
        }
    }
    qsort(times, (size_t)done, sizeof *times, cmp_double);
    printf("steps %d restarts %d mask_ms %.4f median_ms %.4f ref_ms %.4f\n", done, restarts, t_fast / done,
           times[done / 2], t_ref / done);
    free(times);
    grammar_matcher_free(m);
    grammar_unref(g);
    free(fast);
    free(ref);
    free(allowed);
    free(src);
    return rc;
}

static grammar_t *spec_grammar(const char *kind, const char *spec);

/* the sample mode: a vocabulary of the 256 bytes and EOS */
static int sample(const char *kind, const char *spec, int n, unsigned seed) {
    grammar_t *g = spec_grammar(kind, spec);
    if (!g) return 0;
    const char *toks[257];
    size_t lens[257];
    char bytes[256];
    for (int b = 0; b < 256; b++) {
        bytes[b] = (char)b;
        toks[b] = &bytes[b];
        lens[b] = 1;
    }
    toks[256] = NULL;
    lens[256] = 0;
    int32_t eos = 256;
    grammar_vocab_t *v;
    if (grammar_vocab_from_bytes(toks, lens, 257, &eos, 1, &v)) return 2;
    rng += seed * 0x9E3779B97F4A7C15ull;
    uint32_t mask[9];
    char *buf = malloc(3001);
    for (int k = 0; k < n; k++) {
        grammar_matcher_t *m = grammar_matcher_new(g);
        int len = 0;
        bool done = false;
        while (len < 3000) {
            grammar_matcher_mask(m, v, mask);
            int allowed[257], na = 0, weight = 0, w[257];
            for (int t = 0; t < 257; t++)
                if (mask[t >> 5] >> (t & 31) & 1) {
                    /* closers and separators more often, so walks end */
                    w[na] = t == 256 ? 40 : strchr("\"]},", t) && t ? 12 : t < 128 ? 2 : 1;
                    weight += w[na];
                    allowed[na++] = t;
                }
            if (!na) break;
            int r = (int)(rnd() % (uint32_t)weight), i = 0;
            while (r >= w[i]) r -= w[i++];
            if (allowed[i] == 256) { done = true; break; }
            buf[len++] = (char)allowed[i];
            grammar_matcher_accept_token(m, v, allowed[i]);
            if (grammar_matcher_done(m)) { done = true; break; }
        }
        grammar_matcher_free(m);
        if (!done) continue;
        json_t *str = json_stringn_nocheck(buf, (size_t)len);
        char *line = json_dumps(str, JSON_ENCODE_ANY);
        printf("%s\n", line);
        free(line);
        json_decref(str);
    }
    free(buf);
    grammar_vocab_free(v);
    grammar_unref(g);
    return 0;
}

/* SPEC compiled (NULL after printing "error: ..." when it is refused) */
static grammar_t *spec_grammar(const char *kind, const char *spec) {
    char *gbnf = NULL, *path = NULL;
    int rc;
    if (!strcmp(kind, "regex")) rc = grammar_regex_to_gbnf(spec, strlen(spec), &gbnf);
    else if (!strcmp(kind, "gbnf")) rc = (gbnf = strdup(spec)) ? CS_OK : CS_ENOMEM;
    else if (!strcmp(kind, "lark")) rc = grammar_lark_to_gbnf(spec, strlen(spec), &gbnf);
    else {
        json_error_t je;
        json_t *sc = json_loads(spec, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
        rc = sc ? grammar_json_schema_to_gbnf(sc, NULL, &gbnf, &path) : cs_error_set(CS_EINVAL, "not JSON");
        json_decref(sc);
    }
    grammar_t *g = NULL;
    if (rc == CS_OK && getenv("CS_PRINT_GBNF")) fprintf(stderr, "%s", gbnf);
    if (rc == CS_OK) rc = grammar_compile(gbnf, strlen(gbnf), &g);
    if (rc) printf("error: %s%s%s\n", cs_error_last(), path ? " at " : "", path ? path : "");
    free(gbnf);
    free(path);
    return rc ? NULL : g;
}

/* the match mode: no tokenizer */
static int match(const char *kind, const char *spec) {
    grammar_t *g = spec_grammar(kind, spec);
    if (!g) return 0;
    char line[65536];
    while (fgets(line, sizeof line, stdin)) {
        json_error_t je;
        json_t *str = json_loads(line, JSON_DECODE_ANY, &je);
        grammar_matcher_t *m = grammar_matcher_new(g);
        bool ok = json_is_string(str) &&
                  grammar_matcher_accept_bytes(m, (const uint8_t *)json_string_value(str), json_string_length(str)) &&
                  grammar_matcher_can_end(m);
        printf("%d\n", ok);
        grammar_matcher_free(m);
        json_decref(str);
    }
    grammar_unref(g);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 5 && !strcmp(argv[1], "-") && !strcmp(argv[2], "match")) return match(argv[3], argv[4]);
    if (argc == 7 && !strcmp(argv[1], "-") && !strcmp(argv[2], "sample"))
        return sample(argv[3], argv[4], atoi(argv[5]), (unsigned)atoi(argv[6]));
    if (argc < 3) { fprintf(stderr, "usage: grammar_harness TOKDIR bytes | walk GBNF SEED STEPS\n"); return 2; }
    tokenizer_t *t;
    if (tokenizer_load(argv[1], &t)) { fprintf(stderr, "%s\n", cs_error_last()); return 2; }
    const int32_t *eos;
    int n_eos = tokenizer_eos_ids(t, &eos);
    grammar_vocab_t *v;
    double t0 = cs_time_ms();
    if (grammar_vocab_new(t, eos, n_eos, &v)) { fprintf(stderr, "%s\n", cs_error_last()); return 2; }
    fprintf(stderr, "vocabulary of %d tokens in %.1f ms\n", grammar_vocab_size(v), cs_time_ms() - t0);
    int rc = 0;
    if (!strcmp(argv[2], "bytes")) {
        for (int id = 0; id < grammar_vocab_size(v); id++) {
            size_t len;
            const uint8_t *b = grammar_vocab_bytes(v, id, &len);
            printf("%d ", id);
            if (!b) printf("-");
            for (size_t i = 0; b && i < len; i++) printf("%02x", b[i]);
            printf("\n");
        }
    } else if (!strcmp(argv[2], "walk") && argc == 6) {
        rng += (uint64_t)atoll(argv[4]) * 0x9E3779B97F4A7C15ull;
        rc = walk(v, argv[3], atoi(argv[5]));
    } else {
        fprintf(stderr, "usage: grammar_harness TOKDIR bytes | walk GBNF SEED STEPS\n");
        rc = 2;
    }
    grammar_vocab_free(v);
    tokenizer_free(t);
    return rc;
}
