/* sampling_harness.c: drives engine/sampling.c from JSON lines so that
 * tests/test_ref_sampling.py can compare it with a torch implementation of vLLM's sampler.
 * In (one object per line on stdin):
 *   {"logits": [...], "params": {"temperature", "top_k", "top_p", "min_p",
 *    "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs",
 *    "logprobs_mode": "raw"|"processed", "seed"}, "prompt": [...], "output": [...],
 *    "banned": [...]}
 * Out (one line each): {"processed_logprobs": [...], "token": t, "logprob": x, "rank": r,
 *   "top": [[id, logprob], ...], "u": the first uniform of the seed's RNG}
 * -inf is written as null. Errors: {"error": "..."}. */
#include "engine/sampling.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static json_t *real_or_null(double v) { return isinf(v) || isnan(v) ? json_null() : json_real(v); }

static double num(json_t *o, const char *key, double dflt) {
    json_t *v = json_object_get(o, key);
    return json_is_number(v) ? json_number_value(v) : dflt;
}

static int32_t *ids(json_t *a, int *n) {
    *n = (int)json_array_size(a);
    int32_t *out = malloc(sizeof(int32_t) * (size_t)(*n + 1));
    for (int i = 0; i < *n; i++) out[i] = (int32_t)json_integer_value(json_array_get(a, (size_t)i));
    return out;
}

static json_t *run(json_t *in) {
    json_t *jl = json_object_get(in, "logits"), *jp = json_object_get(in, "params");
    int n = (int)json_array_size(jl);
    if (n <= 0 || !json_is_object(jp)) return json_pack("{s:s}", "error", "need logits and params");
    sampling_params_t p;
    sampling_params_default(&p);
    p.temperature = (float)num(jp, "temperature", 1);
    p.top_k = (int)num(jp, "top_k", 0);
    p.top_p = (float)num(jp, "top_p", 1);
    p.min_p = (float)num(jp, "min_p", 0);
    p.repetition_penalty = (float)num(jp, "repetition_penalty", 1);
    p.presence_penalty = (float)num(jp, "presence_penalty", 0);
    p.frequency_penalty = (float)num(jp, "frequency_penalty", 0);
    p.logprobs = (int)num(jp, "logprobs", 0);
    const char *mode = json_string_value(json_object_get(jp, "logprobs_mode"));
    p.logprobs_mode = mode && !strcmp(mode, "processed") ? SAMPLING_LOGPROBS_PROCESSED : SAMPLING_LOGPROBS_RAW;
    uint64_t seed = (uint64_t)num(jp, "seed", 0);

    float *x = malloc(sizeof(float) * (size_t)n), *proc = malloc(sizeof(float) * (size_t)n);
    for (int i = 0; i < n; i++) x[i] = (float)json_number_value(json_array_get(jl, (size_t)i));
    int np, no, nb;
    int32_t *prompt = ids(json_object_get(in, "prompt"), &np), *outs = ids(json_object_get(in, "output"), &no),
            *banned = ids(json_object_get(in, "banned"), &nb);
    json_t *res;
    sampler_t *s = sampler_new(&p, n, prompt, np, seed);
    if (!s) {
        res = json_pack("{s:s}", "error", cs_error_last());
        goto out;
    }
    for (int i = 0; i < no; i++) sampler_accept(s, outs[i]);
    sampler_process(s, x, banned, nb, proc);
    sampling_log_softmax(proc, proc, n);
    sample_out_t o;
    int32_t t = sampler_sample(s, x, banned, nb, &o);
    cs_rng_t r;
    cs_rng_seed(&r, seed);
    json_t *jproc = json_array(), *jtop = json_array();
    for (int i = 0; i < n; i++) json_array_append_new(jproc, real_or_null(proc[i]));
    for (int i = 0; i < o.n_top; i++)
        json_array_append_new(jtop, json_pack("[i,o]", (json_int_t)o.top[i].id, real_or_null(o.top[i].logprob)));
    res = json_pack("{s:o,s:i,s:o,s:i,s:o,s:f}", "processed_logprobs", jproc, "token", (json_int_t)t, "logprob",
                    real_or_null(o.logprob), "rank", o.rank, "top", jtop, "u", cs_rng_uniform(&r));
    sampler_free(s);
out:
    free(x);
    free(proc);
    free(prompt);
    free(outs);
    free(banned);
    return res;
}

int main(void) {
    char *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, stdin) > 0) {
        json_error_t err;
        json_t *in = json_loads(line, 0, &err), *res;
        res = in ? run(in) : json_pack("{s:s}", "error", err.text);
        char *txt = json_dumps(res, JSON_COMPACT | JSON_REAL_PRECISION(9));
        puts(txt);
        free(txt);
        json_decref(res);
        json_decref(in);
    }
    free(line);
    sampling_scratch_free();
    return 0;
}
