/* sampling_json.c: a request's sampling fields from JSON (see sampling_json.h for the table
 * of fields and callers). One pass over the fields in a fixed order; where the callers differ
 * (which integers count, which ranges are checked here, the wording of a message) the style
 * of the options says which. */
#include "engine/sampling_json.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct ctx {
    const json_t *o;
    const sampling_json_opts_t *opt;
    sampling_json_t *out;
} ctx_t;

/* the field's name as a message says it: 'top_k', sampling.top_k or top_k */
static const char *name_of(const ctx_t *c, const char *field, char *buf, size_t n) {
    static const char *const fmt[] = {"'%s'", "sampling.%s", "%s"};
    snprintf(buf, n, fmt[c->opt->style], field);
    return buf;
}

/* CS_EINVAL with the message, naming the parameter the caller reports */
__attribute__((format(printf, 3, 4))) static int refuse(const ctx_t *c, const char *field, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    c->out->param = c->opt->style == SAMPLING_JSON_OPENAI ? field
                    : c->opt->style == SAMPLING_JSON_ROLLOUT ? "sampling"
                                                             : NULL;
    return cs_error_set(CS_EINVAL, "%s", msg);
}

/* the field, NULL when absent or null */
static json_t *field(const ctx_t *c, const char *k) {
    json_t *v = json_object_get(c->o, k);
    return json_is_null(v) ? NULL : v;
}

/* a number; OpenAI: within [lo, hi]. *x kept when absent. */
static int get_num(const ctx_t *c, const char *k, double lo, double hi, double *x) {
    json_t *v = field(c, k);
    char nm[80];
    if (!v) return CS_OK;
    if (!json_is_number(v)) return refuse(c, k, "%s must be a number", name_of(c, k, nm, sizeof nm));
    double d = json_number_value(v);
    if (c->opt->style == SAMPLING_JSON_OPENAI && !(d >= lo && d <= hi))
        return refuse(c, k, "%s must be between %g and %g, got %g", name_of(c, k, nm, sizeof nm), lo, hi, d);
    *x = d;
    return CS_OK;
}

/* an integer: OpenAI takes a real with an integer value below 9e15 and checks [lo, hi]; the
 * rollout takes one within +-9.2e18 and checks int32; batch takes JSON integers only. *x kept
 * when absent. */
static int get_int(const ctx_t *c, const char *k, long long lo, long long hi, long long *x) {
    json_t *v = field(c, k);
    char nm[80];
    if (!v) return CS_OK;
    sampling_json_style st = c->opt->style;
    double r = json_is_real(v) ? json_real_value(v) : NAN;
    bool real_ok = r == floor(r) && (st == SAMPLING_JSON_OPENAI ? fabs(r) < 9e15 : r >= -9.2e18 && r <= 9.2e18);
    if (!json_is_integer(v) && (st == SAMPLING_JSON_BATCH || !real_ok))
        return refuse(c, k, "%s must be an integer", name_of(c, k, nm, sizeof nm));
    long long d = json_is_integer(v) ? (long long)json_integer_value(v) : (long long)r;
    if (st == SAMPLING_JSON_OPENAI && (d < lo || d > hi))
        return refuse(c, k, "%s must be between %lld and %lld, got %lld", name_of(c, k, nm, sizeof nm), lo, hi, d);
    if (st == SAMPLING_JSON_ROLLOUT && (d > INT32_MAX || d < INT32_MIN))
        return refuse(c, k, "%s is out of range", name_of(c, k, nm, sizeof nm));
    *x = d;
    return CS_OK;
}

/* true or false; batch: anything but true is false. *x kept when absent. */
static int get_bool(const ctx_t *c, const char *k, bool *x) {
    json_t *v = field(c, k);
    char nm[80];
    if (!v) return CS_OK;
    if (c->opt->style != SAMPLING_JSON_BATCH && !json_is_boolean(v))
        return refuse(c, k, "%s must be true or false", name_of(c, k, nm, sizeof nm));
    *x = json_is_true(v);
    return CS_OK;
}

/* the float knobs and top_k, in OpenAI's order, with OpenAI's ranges */
static const struct knob {
    const char *name;
    bool integer;
    double lo, hi;
    const char *above_lo;        /* OpenAI: lo itself refused, with this message */
    size_t off;
} KNOBS[] = {
    {"temperature", false, 0, 100, NULL, offsetof(sampling_params_t, temperature)},
    {"top_p", false, 0, 1, "%s must be in (0, 1], got %g", offsetof(sampling_params_t, top_p)},
    {"top_k", true, -1, 1 << 30, NULL, offsetof(sampling_params_t, top_k)},
    {"min_p", false, 0, 1, NULL, offsetof(sampling_params_t, min_p)},
    {"presence_penalty", false, -2, 2, NULL, offsetof(sampling_params_t, presence_penalty)},
    {"frequency_penalty", false, -2, 2, NULL, offsetof(sampling_params_t, frequency_penalty)},
    {"repetition_penalty", false, 0, 100, "%s must be > 0, got %g", offsetof(sampling_params_t, repetition_penalty)},
};

static int knobs(const ctx_t *c) {
    char *sp = (char *)&c->out->sampling;
    for (size_t i = 0; i < sizeof KNOBS / sizeof KNOBS[0]; i++) {
        const struct knob *k = &KNOBS[i];
        int rc;
        if (k->integer) {
            long long v = *(int *)(sp + k->off);
            if ((rc = get_int(c, k->name, (long long)k->lo, (long long)k->hi, &v))) return rc;
            *(int *)(sp + k->off) = (int)v;
            continue;
        }
        double d = *(float *)(sp + k->off);
        if ((rc = get_num(c, k->name, k->lo, k->hi, &d))) return rc;
        char nm[80];
        if (k->above_lo && c->opt->style == SAMPLING_JSON_OPENAI && field(c, k->name) && d <= k->lo)
            return refuse(c, k->name, k->above_lo, name_of(c, k->name, nm, sizeof nm), d);
        *(float *)(sp + k->off) = (float)d;
    }
    if (c->opt->seed && field(c, "seed")) {
        json_t *sv = field(c, "seed");
        if (c->opt->style == SAMPLING_JSON_OPENAI && json_is_real(sv) && fabs(json_real_value(sv)) >= 9.2e18)
            return refuse(c, "seed", "seed: Input should be %s", /* pydantic's words, as vLLM */
                          json_real_value(sv) > 0 ? "less than or equal to 9223372036854775807"
                                                  : "greater than or equal to -9223372036854775808");
        long long v = 0;
        int rc = get_int(c, "seed", LLONG_MIN, LLONG_MAX, &v);
        if (rc) return rc;
        c->out->sampling.seed = (uint64_t)v;
        c->out->sampling.has_seed = true;
    }
    return CS_OK;
}

/* max_tokens (chat: max_completion_tokens first) and min_tokens */
static int lengths(const ctx_t *c) {
    const sampling_json_opts_t *opt = c->opt;
    const char *mt = opt->max_completion_tokens && field(c, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
    long long v = c->out->max_tokens; /* the default, or the model's */
    char nm[80];
    int rc = get_int(c, mt, LLONG_MIN, LLONG_MAX, &v);
    if (rc) return rc;
    if (field(c, mt) && opt->style == SAMPLING_JSON_OPENAI) {
        if (v < 0) return refuse(c, mt, "%s must be at least 0, got %lld", name_of(c, mt, nm, sizeof nm), v);
        if (v > opt->max_model_len)
            return refuse(c, mt, "%s = %lld exceeds this model's maximum context length of %d tokens",
                          name_of(c, mt, nm, sizeof nm), v, opt->max_model_len);
    }
    if (field(c, mt) && opt->style == SAMPLING_JSON_ROLLOUT && v < 1)
        return refuse(c, mt, "%s must be at least 1", name_of(c, mt, nm, sizeof nm));
    c->out->max_tokens = (int)v;
    v = 0;
    if ((rc = get_int(c, "min_tokens", 0, 1 << 30, &v))) return rc;
    if (opt->style == SAMPLING_JSON_ROLLOUT && v < 0)
        return refuse(c, "min_tokens", "%s must be at least 0", name_of(c, "min_tokens", nm, sizeof nm));
    c->out->min_tokens = (int)v;
    return CS_OK;
}

/* "stop": a string or a list of strings (pointers into the JSON) */
static int stops(const ctx_t *c) {
    json_t *stop = field(c, "stop");
    sampling_json_style st = c->opt->style;
    if (!stop) return CS_OK;
    size_t n = json_is_array(stop) ? json_array_size(stop) : 1;
    if (st == SAMPLING_JSON_OPENAI && json_is_array(stop) && n > 64) return refuse(c, "stop", "at most %d stop strings", 64);
    bool listed = json_is_string(stop) || (json_is_array(stop) && (st != SAMPLING_JSON_ROLLOUT || n <= 64));
    if (!listed)
        return refuse(c, "stop", st == SAMPLING_JSON_OPENAI  ? "'stop' must be a string or a list of strings"
                                 : st == SAMPLING_JSON_BATCH ? "stop must be a string or an array of strings"
                                                             : "sampling.stop must be a string or a list of at most 64 strings");
    c->out->stop = malloc(sizeof(char *) * (n ? n : 1));
    if (!c->out->stop) return cs_error_set(CS_ENOMEM, "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *x = json_is_array(stop) ? json_array_get(stop, i) : stop;
        if (!json_is_string(x))
            return st == SAMPLING_JSON_BATCH ? refuse(c, "stop", "stop[%zu] must be a string", i)
                                             : refuse(c, "stop", "%s must be a string or a list of strings",
                                                      st == SAMPLING_JSON_OPENAI ? "'stop'" : "sampling.stop");
        c->out->stop[c->out->n_stop++] = json_string_value(x);
    }
    for (int i = 0; st == SAMPLING_JSON_OPENAI && i < c->out->n_stop; i++)
        if (!c->out->stop[i][0]) return refuse(c, "stop", "stop strings must not be empty");
    return CS_OK;
}

/* "stop_token_ids": a list of ids below the vocabulary (OpenAI: at most 256) */
static int stop_ids(const ctx_t *c) {
    json_t *a = field(c, "stop_token_ids");
    sampling_json_style st = c->opt->style;
    long long vocab = c->opt->vocab > 0 ? c->opt->vocab : (long long)INT32_MAX + 1;
    if (!a) return CS_OK;
    if (!json_is_array(a) || (st == SAMPLING_JSON_OPENAI && json_array_size(a) > 256))
        return refuse(c, "stop_token_ids", st == SAMPLING_JSON_OPENAI ? "'stop_token_ids' must be a list of at most 256 token ids"
                                           : st == SAMPLING_JSON_BATCH ? "stop_token_ids must be an array of integers"
                                                                       : "sampling.stop_token_ids must be a list of token ids");
    size_t n = json_array_size(a);
    c->out->stop_ids = malloc(sizeof(int32_t) * (n + 1));
    if (!c->out->stop_ids) return cs_error_set(CS_ENOMEM, "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *x = json_array_get(a, i);
        long long t = json_is_integer(x) ? (long long)json_integer_value(x) : -1;
        if (st == SAMPLING_JSON_OPENAI && !json_is_integer(x))
            return refuse(c, "stop_token_ids", "'stop_token_ids' must be a list of integers");
        if (st == SAMPLING_JSON_OPENAI && (t < 0 || t >= vocab))
            return refuse(c, "stop_token_ids", "stop token id %lld is out of range", t);
        if (st == SAMPLING_JSON_ROLLOUT && (t < 0 || t >= vocab))
            return refuse(c, "stop_token_ids", "sampling.stop_token_ids[%zu] is not a token id in [0, %lld)", i, vocab);
        if (st == SAMPLING_JSON_BATCH && (t < 0 || t >= vocab))
            return refuse(c, "stop_token_ids", "stop_token_ids[%zu] is not a token id", i);
        c->out->stop_ids[c->out->n_stop_ids++] = (int32_t)t;
    }
    return CS_OK;
}

/* OpenAI: "allowed_token_ids" (vLLM: a non-empty list of ids below the vocabulary) and
 * "logit_bias" (OpenAI: {"token id": bias in [-100, 100]}) */
static int token_lists(const ctx_t *c) {
    sampling_params_t *sp = &c->out->sampling;
    long long vocab = c->opt->vocab > 0 ? c->opt->vocab : (long long)INT32_MAX + 1;
    json_t *a = field(c, "allowed_token_ids"), *b = field(c, "logit_bias");
    if (a && !json_is_array(a)) return refuse(c, "allowed_token_ids", "'allowed_token_ids' must be a list of token ids");
    if (a && json_array_size(a) == 0) return refuse(c, "allowed_token_ids", "allowed_token_ids is not None and empty!");
    if (b && !json_is_object(b)) return refuse(c, "logit_bias", "'logit_bias' must be an object of token ids to biases");
    size_t na = json_array_size(a), nb = json_object_size(b);
    if (!na && !nb) return CS_OK;
    /* one block: [na] allowed ids, [nb] biased ids, [nb] biases */
    if (!(c->out->lists = malloc(sizeof(int32_t) * (na + nb) + sizeof(float) * nb)))
        return cs_error_set(CS_ENOMEM, "out of memory");
    int32_t *allowed = c->out->lists, *bias_ids = allowed + na;
    float *bias = (float *)(bias_ids + nb);
    for (size_t i = 0; i < na; i++) {
        json_t *x = json_array_get(a, i);
        if (!json_is_integer(x)) return refuse(c, "allowed_token_ids", "'allowed_token_ids' must be a list of integers");
        long long t = (long long)json_integer_value(x);
        if (t < 0 || t >= vocab)
            return refuse(c, "allowed_token_ids", "allowed_token_ids contains out-of-vocab token id %lld (vocabulary size: %lld)",
                          t, vocab);
        allowed[i] = (int32_t)t;
    }
    const char *k;
    json_t *v;
    int i = 0;
    json_object_foreach(b, k, v) {
        char *end;
        errno = 0;
        long long t = strtoll(k, &end, 10);
        if (!*k || *end || errno)
            return refuse(c, "logit_bias",
                          "Found token_id `%s` in logit_bias but token_id must be an integer or string representing an "
                          "integer",
                          k);
        if (t < 0 || t >= vocab)
            return refuse(c, "logit_bias",
                          "token_id(s) [%lld] in logit_bias contain out-of-vocab token ids. Vocabulary size: %lld", t, vocab);
        if (!json_is_number(v)) return refuse(c, "logit_bias", "logit_bias[\"%s\"] must be a number", k);
        double d = json_number_value(v);
        if (!(d >= -100 && d <= 100))
            return refuse(c, "logit_bias", "logit_bias[\"%s\"] must be between -100 and 100, got %g", k, d);
        bias_ids[i] = (int32_t)t;
        bias[i++] = (float)d;
    }
    sp->allowed_ids = na ? allowed : NULL;
    sp->n_allowed = (int)na;
    sp->bias_ids = nb ? bias_ids : NULL;
    sp->bias = nb ? bias : NULL;
    sp->n_bias = i;
    return CS_OK;
}

/* rollout: "logprobs": true | false | {"mode", "top_k"} */
static int logprobs_object(const ctx_t *c, sampling_params_t *sp) {
    json_t *lp = json_object_get(c->o, "logprobs");
    sp->logprobs = 0;
    if (json_is_false(lp)) {
        sp->logprobs = -1;
    } else if (json_is_object(lp)) {
        const char *mode = json_string_value(json_object_get(lp, "mode"));
        if (mode && !strcmp(mode, "processed")) sp->logprobs_mode = SAMPLING_LOGPROBS_PROCESSED;
        else if (mode && strcmp(mode, "raw")) return refuse(c, "logprobs", "sampling.logprobs.mode is \"raw\" or \"processed\"");
        json_t *k = json_object_get(lp, "top_k");
        if (k && !json_is_null(k)) {
            double r = json_is_real(k) ? json_real_value(k) : NAN;
            bool is_int = json_is_integer(k) || (r == floor(r) && r >= -9.2e18 && r <= 9.2e18);
            long long v = json_is_integer(k) ? (long long)json_integer_value(k) : (long long)r;
            if (!is_int || v < 0 || v > c->opt->max_logprobs)
                return refuse(c, "logprobs", "sampling.logprobs.top_k must be between 0 and %d", c->opt->max_logprobs);
            sp->logprobs = (int)v;
        }
    } else if (lp && !json_is_null(lp) && !json_is_true(lp)) {
        return refuse(c, "logprobs", "sampling.logprobs must be true, false or {\"mode\", \"top_k\"}");
    }
    return CS_OK;
}

static int logprobs(const ctx_t *c) {
    sampling_params_t *sp = &c->out->sampling;
    long long v;
    int rc;
    sp->logprobs = -1;
    sp->logprobs_mode = SAMPLING_LOGPROBS_RAW;
    switch (c->opt->logprobs) {
    case SAMPLING_JSON_LOGPROBS_OBJECT: return logprobs_object(c, sp);
    case SAMPLING_JSON_LOGPROBS_CHAT: {
        bool on = false;
        if ((rc = get_bool(c, "logprobs", &on))) return rc;
        v = 0;
        if ((rc = get_int(c, "top_logprobs", 0, c->opt->max_logprobs, &v))) return rc;
        if (v > 0 && !on) return refuse(c, "top_logprobs", "top_logprobs needs logprobs: true");
        if (on) sp->logprobs = (int)v;
        return CS_OK;
    }
    case SAMPLING_JSON_LOGPROBS_COUNT:
    case SAMPLING_JSON_LOGPROBS_COUNT_MODE:
        v = -1;
        if ((rc = get_int(c, "logprobs", 0, c->opt->max_logprobs, &v))) return rc;
        sp->logprobs = (int)v;
        break;
    }
    json_t *m = c->opt->logprobs == SAMPLING_JSON_LOGPROBS_COUNT_MODE ? field(c, "logprobs_mode") : NULL;
    if (m) {
        const char *s = json_string_value(m);
        if (s && !strcmp(s, "raw")) sp->logprobs_mode = SAMPLING_LOGPROBS_RAW;
        else if (s && !strcmp(s, "processed")) sp->logprobs_mode = SAMPLING_LOGPROBS_PROCESSED;
        else return refuse(c, "logprobs_mode", "logprobs_mode must be \"raw\" or \"processed\"");
    }
    return CS_OK;
}

/* the model's recommended values in place of vLLM's defaults, before the request's own */
static void model_defaults(const model_gen_defaults_t *g, sampling_json_t *out) {
    sampling_params_t *sp = &out->sampling;
    if (g->set & MODEL_GEN_TEMPERATURE) sp->temperature = (float)g->temperature;
    if (g->set & MODEL_GEN_TOP_P) sp->top_p = (float)g->top_p;
    if (g->set & MODEL_GEN_TOP_K) sp->top_k = g->top_k;
    if (g->set & MODEL_GEN_MIN_P) sp->min_p = (float)g->min_p;
    if (g->set & MODEL_GEN_REPETITION_PENALTY) sp->repetition_penalty = (float)g->repetition_penalty;
    if ((g->set & MODEL_GEN_MAX_TOKENS) && out->max_tokens < 0) out->max_tokens = g->max_tokens;
}

int sampling_params_from_json(const json_t *o, const sampling_json_opts_t *opt, sampling_json_t *out) {
    ctx_t c = {.o = o, .opt = opt, .out = out};
    memset(out, 0, sizeof *out);
    sampling_params_default(&out->sampling);
    out->max_tokens = opt->max_tokens_default;
    if (opt->defaults) model_defaults(opt->defaults, out);
    int rc;
    if ((rc = knobs(&c)) || (rc = lengths(&c))) return rc;
    if ((rc = get_bool(&c, "ignore_eos", &out->ignore_eos))) return rc;
    if ((rc = stops(&c)) || (rc = stop_ids(&c))) return rc;
    if (opt->style == SAMPLING_JSON_OPENAI && (rc = token_lists(&c))) return rc;
    return logprobs(&c);
}

void sampling_json_free(sampling_json_t *out) {
    if (!out) return;
    free(out->stop);
    free(out->stop_ids);
    free(out->lists);
    out->stop = NULL;
    out->stop_ids = NULL;
    out->lists = NULL;
}
