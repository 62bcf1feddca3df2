/* grammarbench.c: structured output's own costs on a real vocabulary, for bench/grammar.sh.
 *
 *   grammarbench TOKDIR SCHEMA|- TOKENS
 *
 * SCHEMA: a JSON Schema file ("-": any JSON object, json_object mode); TOKENS: the token ids of
 * an output valid against it (whitespace separated). Prints one JSON line: the vocabulary's
 * size and build time, the schema's compile time (translation to GBNF + compile, median of
 * 5), and the mask time per token while the matcher follows TOKENS: on the first pass (the
 * grammar fresh: its stack tops' token classes computed as they are met) and on 5 more passes
 * (the classes kept, as for every later request with the same schema): mean and median. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "text/grammar/grammar.h"

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static char *gbnf_of(json_t *schema) {
    char *gbnf = NULL, *path = NULL;
    if (grammar_json_schema_to_gbnf(schema, NULL, &gbnf, &path)) {
        fprintf(stderr, "grammarbench: the schema: %s (%s)\n", cs_error_last(), path ? path : "");
        exit(2);
    }
    free(path);
    return gbnf;
}

/* one pass over the tokens: each step's mask time into t (ms) */
static void pass(const grammar_t *g, const grammar_vocab_t *v, const int32_t *toks, int n, double *t, uint32_t *mask) {
    grammar_matcher_t *m = grammar_matcher_new(g);
    for (int i = 0; i < n; i++) {
        double t0 = cs_time_ms();
        grammar_matcher_mask(m, v, mask);
        t[i] = cs_time_ms() - t0;
        if (!(mask[toks[i] >> 5] >> (toks[i] & 31) & 1) || !grammar_matcher_accept_token(m, v, toks[i])) {
            fprintf(stderr, "grammarbench: token %d (#%d) is not allowed: the output does not follow the schema\n",
                    toks[i], i);
            exit(2);
        }
    }
    grammar_matcher_free(m);
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: grammarbench TOKDIR SCHEMA|- TOKENS\n");
        return 2;
    }
    tokenizer_t *tk;
    if (tokenizer_load(argv[1], &tk)) { fprintf(stderr, "%s\n", cs_error_last()); return 2; }
    const int32_t *eos;
    int n_eos = tokenizer_eos_ids(tk, &eos);
    grammar_vocab_t *v;
    double t0 = cs_time_ms();
    if (grammar_vocab_new(tk, eos, n_eos, &v)) { fprintf(stderr, "%s\n", cs_error_last()); return 2; }
    double vocab_ms = cs_time_ms() - t0;
    json_error_t je;
    json_t *schema = strcmp(argv[2], "-") ? json_load_file(argv[2], 0, &je) : NULL;
    if (strcmp(argv[2], "-") && !schema) { fprintf(stderr, "%s: %s\n", argv[2], je.text); return 2; }
    FILE *f = fopen(argv[3], "r");
    if (!f) { perror(argv[3]); return 2; }
    int32_t toks[65536];
    int n = 0;
    while (n < 65536 && fscanf(f, "%d", &toks[n]) == 1) n++;
    fclose(f);
    double comp[5];
    grammar_t *g = NULL;
    for (int r = 0; r < 5; r++) {
        t0 = cs_time_ms();
        char *gbnf = gbnf_of(schema);
        grammar_unref(g);
        if (grammar_compile(gbnf, strlen(gbnf), &g)) { fprintf(stderr, "%s\n", cs_error_last()); return 2; }
        comp[r] = cs_time_ms() - t0;
        free(gbnf);
    }
    qsort(comp, 5, sizeof *comp, cmp_double);
    uint32_t *mask = malloc(sizeof(uint32_t) * (size_t)(grammar_vocab_size(v) + 31) / 32 + 4);
    double *cold = malloc(sizeof(double) * (size_t)n), *warm = malloc(sizeof(double) * (size_t)n * 5);
    pass(g, v, toks, n, cold, mask);
    for (int r = 0; r < 5; r++) pass(g, v, toks, n, warm + (size_t)r * n, mask);
    double cs = 0, ws = 0;
    for (int i = 0; i < n; i++) cs += cold[i];
    for (int i = 0; i < 5 * n; i++) ws += warm[i];
    qsort(warm, (size_t)n * 5, sizeof *warm, cmp_double);
    printf("{\"engine\": \"caraserve\", \"vocab\": %d, \"vocab_ms\": %.2f, \"tokens\": %d, \"compile_ms\": %.3f, "
           "\"first_pass_mask_us\": %.2f, \"mask_us_mean\": %.2f, \"mask_us_median\": %.2f}\n",
           grammar_vocab_size(v), vocab_ms, n, comp[2], cs / n * 1e3, ws / (5.0 * n) * 1e3, warm[(size_t)n * 5 / 2] * 1e3);
    free(mask);
    free(cold);
    free(warm);
    json_decref(schema);
    grammar_unref(g);
    grammar_vocab_free(v);
    tokenizer_free(tk);
    return 0;
}
