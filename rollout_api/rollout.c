/* rollout.c: a rollout batch (see rollout.h). Each group is one engine request with n
 * samples, so the samples share the prompt's KV blocks and sample i is seeded seed + i. The
 * engine's sink collects every sample's ids and logprobs; a finished group becomes one JSON
 * line; once target_groups groups have completed the rest are aborted and come back with
 * their partial output; the summary closes the batch. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rollout_api/rollout.h"
#include "engine/sampling_json.h"
#include "sched/slo.h"
#include "text/grammar/grammar.h"
#include "text/tokenizer.h"
#include "text/tool_calls.h"

typedef struct ro_sample {
    json_t *ids, *lps, *tops;   /* tops: per token [[id, logprob], ...] when top_k > 0 */
    json_t *kept;               /* per token kept_logmass (logprobs.kept_mass) */
    json_t *spans;              /* [[start, end, adapter version, base version], ...]: which versions
                                 * made which tokens */
    const char *finish;
    int version, base_version;
    double queued_ms, t_first, t_last;
} ro_sample_t;

typedef struct ro_group {
    rollout_t *r;
    int index;
    char *group_id;
    int n;
    long long seed;
    bool has_seed;
    int32_t *prompt;            /* input_ids + continue_from.output_ids, or input_ids + the turns */
    int n_input, n_prompt, resumed_len, max_tokens;
    /* a multi-turn group: the earlier turns' tokens after input_ids (prompt[n_input ..
     * n_prompt)), which of them the model generated (1) and which the environment added (0),
     * and the model's logprobs of them when every turn gave its own (else NULL) */
    int n_hist;
    uint8_t *hist_mask;
    float *hist_lps;
    char *adapter;              /* NULL: the base model */
    int adapter_version;        /* 0: the active one (follows updates); > 0 pinned */
    double slo_ttft_ms, slo_tpot_ms; /* the group's SLO: the request's, else its model's (0: none) */
    bool submitted, done, first_token;
    int n_cached;
    struct grammar *grammar;    /* its structured-output constraint (NULL: none) */
    ro_sample_t *samples;
} ro_group_t;

struct rollout {
    pthread_mutex_t mu;
    int refs;                   /* the caller's + one per submitted group */
    engine_t *e;
    rollout_emit_fn emit;
    void *user;
    bool target_hit;
    char *batch_id;
    int n_groups, n_done, n_completed, n_aborted;
    int target;
    ro_group_t *groups;
    uint64_t *ids;              /* engine request of each group (written before any sink runs) */
    long long prompt_tokens, output_tokens;
    double t0;
    int top_k;
    bool want_lp, want_kept;
    const struct tokenizer *tok; /* want_tools: each sample's text and tool calls */
    int tool_format;
    bool want_tools;
    rollout_observer_t obs;
};

static void rollout_free(rollout_t *r) {
    if (!r) return;
    for (int g = 0; g < r->n_groups; g++) {
        ro_group_t *gr = &r->groups[g];
        for (int i = 0; gr->samples && i < gr->n; i++) {
            json_decref(gr->samples[i].ids);
            json_decref(gr->samples[i].lps);
            json_decref(gr->samples[i].tops);
            json_decref(gr->samples[i].kept);
            json_decref(gr->samples[i].spans);
        }
        free(gr->samples);
        free(gr->group_id);
        free(gr->prompt);
        free(gr->hist_mask);
        free(gr->hist_lps);
        free(gr->adapter);
        grammar_unref(gr->grammar);
    }
    free(r->groups);
    free(r->ids);
    free(r->batch_id);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

static void unref(rollout_t *r) {
    pthread_mutex_lock(&r->mu);
    bool last = --r->refs == 0;
    pthread_mutex_unlock(&r->mu);
    if (last) rollout_free(r);
}

void rollout_release(rollout_t *r) {
    if (r) unref(r);
}

/* a multi-turn sample's whole response, veRL's agent-loop shape: response_ids (the earlier
 * turns' tokens, then this turn's output), response_mask (1: the model generated it, 0: the
 * environment added it) and, when the turns carried theirs, response_logprobs (0 for the
 * environment's tokens) */
static json_t *turn_json(rollout_t *r, ro_group_t *g, ro_sample_t *s) {
    json_t *ids = json_array(), *mask = json_array();
    json_t *lps = r->want_lp && g->hist_lps ? json_array() : NULL;
    for (int i = 0; i < g->n_hist; i++) {
        json_array_append_new(ids, json_integer(g->prompt[g->n_input + i]));
        json_array_append_new(mask, json_integer(g->hist_mask[i]));
        if (lps) json_array_append_new(lps, json_real(g->hist_mask[i] ? g->hist_lps[i] : 0.0));
    }
    size_t k;
    json_t *v;
    json_array_foreach(s->ids, k, v) {
        json_array_append(ids, v);
        json_array_append_new(mask, json_integer(1));
        if (lps) json_array_append(lps, json_array_get(s->lps, k));
    }
    json_t *o = json_pack("{s:o, s:o, s:i}", "response_ids", ids, "response_mask", mask, "history_len", g->n_hist);
    if (lps) json_object_set_new(o, "response_logprobs", lps);
    return o;
}

/* a sample's text and the tool calls in it ("tool_calls": true): {text, content, tool_calls} */
static json_t *tools_json(rollout_t *r, ro_sample_t *s) {
    size_t n = json_array_size(s->ids), len = 0, content = 0;
    int32_t *v = malloc(sizeof(int32_t) * (n + 1));
    char *text = NULL;
    json_t *calls = NULL;
    for (size_t k = 0; v && k < n; k++) v[k] = (int32_t)json_integer_value(json_array_get(s->ids, k));
    if (v && !tokenizer_decode(r->tok, v, n, true, &text, &len))
        tool_calls_parse((tool_format)r->tool_format, text, len, &calls, &content);
    free(v);
    json_t *o = json_pack("{s:s%, s:s%, s:o}", "text", text ? text : "", text ? len : 0, "content", text ? text : "",
                          text ? content : 0, "tool_calls", calls ? calls : json_null());
    free(text);
    return o;
}

static json_t *group_json(rollout_t *r, ro_group_t *g) {
    json_t *samples = json_array();
    for (int i = 0; i < g->n; i++) {
        ro_sample_t *s = &g->samples[i];
        json_t *o = json_pack("{s:i, s:I, s:O, s:s, s:s?, s:i, s:O, s:i, s:{s:f, s:f, s:f}}", "index", i,
                              "seed", (json_int_t)(g->seed + i), "output_ids", s->ids, "finish_reason",
                              s->finish ? s->finish : "abort", "adapter", g->adapter, "adapter_version", s->version,
                              "version_spans", s->spans, "resumed_len", g->resumed_len, "timing",
                              "queued_ms", s->queued_ms, "ttft_ms", s->t_first > 0 ? s->t_first - r->t0 : -1.0,
                              "e2e_ms", s->t_last > 0 ? s->t_last - r->t0 : -1.0);
        if (!g->adapter) json_object_set_new(o, "adapter", json_null());
        json_object_set_new(o, "base_version", json_integer(s->base_version));
        if (r->want_lp) json_object_set(o, "logprobs", s->lps);
        if (r->want_tools) {
            json_t *t = tools_json(r, s);
            json_object_update(o, t);
            json_decref(t);
        }
        if (g->n_hist) {
            json_t *t = turn_json(r, g, s);
            json_object_update(o, t);
            json_decref(t);
        }
        if (r->want_lp && r->top_k > 0) json_object_set(o, "top_logprobs", s->tops);
        if (r->want_kept) json_object_set(o, "kept_logmass", s->kept);
        json_array_append_new(samples, o);
    }
    return json_pack("{s:s, s:i, s:i, s:i, s:o}", "group_id", g->group_id, "prompt_len", g->n_input,
                     "cached_prompt_tokens", g->n_cached, "shared_prompt_tokens", g->n_prompt * (g->n - 1), "samples",
                     samples);
}

/* a finished group against its SLO, as completions are judged: a first token, TTFT (the
 * batch's start to the group's first token) and the worst sample's TPOT ((last - first) /
 * (tokens - 1)) within the bounds it has; under r->mu */
static bool group_met_slo(const rollout_t *r, const ro_group_t *g) {
    double first = INFINITY, worst_tpot = 0;
    for (int i = 0; i < g->n; i++) {
        const ro_sample_t *s = &g->samples[i];
        size_t nt = json_array_size(s->ids);
        if (nt == 0) continue;
        first = fmin(first, s->t_first);
        if (nt > 1) worst_tpot = fmax(worst_tpot, (s->t_last - s->t_first) / (double)(nt - 1));
    }
    if (!g->first_token || !isfinite(first)) return false;
    if (g->slo_ttft_ms > 0 && first - r->t0 > g->slo_ttft_ms) return false;
    return !(g->slo_tpot_ms > 0 && worst_tpot > g->slo_tpot_ms);
}

static void on_event(void *user, const engine_event_t *ev) {
    ro_group_t *g = user;
    rollout_t *r = g->r;
    double now = cs_time_ms();
    uint64_t abort_ids[64];
    int n_abort = 0;
    json_t *line = NULL, *summary = NULL;
    int slo_met = -1; /* a finished group with an SLO: 1 met, 0 missed */
    pthread_mutex_lock(&r->mu);
    g->n_cached = ev->n_cached_tokens;
    if (ev->index >= 0 && ev->index < g->n) {
        ro_sample_t *s = &g->samples[ev->index];
        s->version = ev->adapter_version;
        s->base_version = ev->base_version;
        if (ev->queue_ms > 0 && s->queued_ms == 0) s->queued_ms = ev->queue_ms;
        if (ev->has_token) {
            if (r->obs.token) {
                double ttft = g->first_token ? -1 : (now - r->t0) / 1000.0;
                r->obs.token(r->obs.user, g->adapter, ttft, g->first_token && s->t_last > 0 ? (now - s->t_last) / 1000.0 : -1);
            }
            g->first_token = true;
            if (s->t_first == 0) s->t_first = now;
            s->t_last = now;
            json_array_append_new(s->ids, json_integer(ev->token));
            size_t nt = json_array_size(s->ids), ns = json_array_size(s->spans);
            json_t *last = ns ? json_array_get(s->spans, ns - 1) : NULL;
            if (last && json_integer_value(json_array_get(last, 2)) == ev->adapter_version &&
                json_integer_value(json_array_get(last, 3)) == ev->base_version)
                json_array_set_new(last, 1, json_integer((json_int_t)nt));
            else
                json_array_append_new(s->spans, json_pack("[I, I, i, i]", (json_int_t)nt - 1, (json_int_t)nt,
                                                          ev->adapter_version, ev->base_version));
            if (r->want_lp) {
                json_array_append_new(s->lps, cs_json_logprob(ev->logprob));
                if (r->want_kept) json_array_append_new(s->kept, json_real(ev->kept_logmass));
                if (r->top_k > 0) {
                    json_t *t = json_array();
                    for (int k = 0; k < ev->n_top; k++)
                        json_array_append_new(t, json_pack("[i, o]", ev->top_ids[k], cs_json_logprob(ev->top_logprobs[k])));
                    json_array_append_new(s->tops, t);
                }
            }
            r->output_tokens++;
        }
        if (ev->finish) {
            s->finish = ev->finish == ENGINE_FINISH_STOP     ? "stop"
                        : ev->finish == ENGINE_FINISH_LENGTH ? "length"
                        : ev->finish == ENGINE_FINISH_ABORT  ? "abort"
                                                             : "error";
            if (s->t_last == 0) s->t_last = now;
        }
    }
    bool drop = false;
    if (ev->request_done) {
        drop = true;
        g->done = true;
        r->n_done++;
        bool aborted = false;
        for (int i = 0; i < g->n; i++)
            if (!g->samples[i].finish || strcmp(g->samples[i].finish, "abort") == 0) aborted = true;
        if (aborted) r->n_aborted++;
        else r->n_completed++;
        r->prompt_tokens += g->n_input;
        if (r->obs.done) {
            const ro_sample_t *ls = ev->index >= 0 && ev->index < g->n ? &g->samples[ev->index] : &g->samples[0];
            r->obs.done(r->obs.user, g->adapter, g->n_prompt, ls->finish ? ls->finish : "abort", (now - r->t0) / 1000.0,
                        ev->queue_ms / 1000.0);
        }
        if (g->slo_ttft_ms > 0 || g->slo_tpot_ms > 0) slo_met = group_met_slo(r, g);
        line = group_json(r, g);
        if (r->target > 0 && r->n_completed >= r->target && !r->target_hit) {
            r->target_hit = true; /* over-provisioned: the rest are not needed */
            for (int k = 0; k < r->n_groups && n_abort < 64; k++)
                if (r->groups[k].submitted && !r->groups[k].done) abort_ids[n_abort++] = r->ids[k];
        }
        if (r->n_done == r->n_groups)
            summary = json_pack("{s:{s:s?, s:i, s:i, s:I, s:I, s:f, s:b}}", "summary", "batch_id", r->batch_id,
                                "completed_groups", r->n_completed, "aborted_groups", r->n_aborted, "prompt_tokens",
                                (json_int_t)r->prompt_tokens, "output_tokens", (json_int_t)r->output_tokens, "wall_ms",
                                now - r->t0, "target_reached", r->target_hit);
    }
    pthread_mutex_unlock(&r->mu);
    if (slo_met >= 0 && r->obs.slo) r->obs.slo(r->obs.user, g->adapter, slo_met); /* r, so g, alive until unref */
    for (int i = 0; i < n_abort; i++) engine_abort(r->e, abort_ids[i]);
    if (line) r->emit(r->user, line, false);
    if (summary) r->emit(r->user, summary, true);
    if (drop) unref(r);
}

void rollout_abort(rollout_t *r) {
    uint64_t ids[4096];
    int n = 0;
    pthread_mutex_lock(&r->mu);
    for (int k = 0; k < r->n_groups && n < 4096; k++)
        if (r->groups[k].submitted && !r->groups[k].done) ids[n++] = r->ids[k];
    pthread_mutex_unlock(&r->mu);
    for (int i = 0; i < n; i++) engine_abort(r->e, ids[i]);
}

int rollout_abort_groups(rollout_t *r, json_t *group_ids) {
    uint64_t ids[4096];
    int n = 0;
    pthread_mutex_lock(&r->mu);
    for (int k = 0; k < r->n_groups && n < 4096; k++) {
        if (!r->groups[k].submitted || r->groups[k].done) continue;
        size_t i;
        json_t *x;
        json_array_foreach(group_ids, i, x)
            if (json_is_string(x) && !strcmp(json_string_value(x), r->groups[k].group_id)) { ids[n++] = r->ids[k]; break; }
    }
    pthread_mutex_unlock(&r->mu);
    for (int i = 0; i < n; i++) engine_abort(r->e, ids[i]);
    return n;
}

int rollout_abort_adapter(rollout_t *r, const char *adapter) {
    uint64_t ids[4096];
    int n = 0;
    pthread_mutex_lock(&r->mu);
    for (int k = 0; k < r->n_groups && n < 4096; k++)
        if (r->groups[k].submitted && !r->groups[k].done && r->groups[k].adapter && !r->groups[k].adapter_version &&
            !strcmp(r->groups[k].adapter, adapter))
            ids[n++] = r->ids[k];
    pthread_mutex_unlock(&r->mu);
    for (int i = 0; i < n; i++) engine_abort(r->e, ids[i]);
    return n;
}

const char *rollout_batch_id(const rollout_t *r) { return r->batch_id; }

/* ---- parsing ---- */
/* a refusal: the status with cs_error_set's message, the field it is about in rq->param */
#define BAD(status, p, ...) \
    do { rc = cs_error_set(status, __VA_ARGS__); rq->param = (p); goto fail; } while (0)

/* an integer, or a real with an integer value that a long long holds (1e300 is not one) */
static bool is_int(json_t *v) {
    if (json_is_integer(v)) return true;
    double x = json_real_value(v);
    return json_is_real(v) && x == floor(x) && x >= -9.2e18 && x <= 9.2e18;
}
static long long int_of(json_t *v) { return json_is_integer(v) ? (long long)json_integer_value(v) : (long long)json_real_value(v); }

static int ids_of(json_t *a, int vocab, int32_t **out, int *n, const char *what) {
    if (!json_is_array(a)) return cs_error_set(CS_EINVAL, "%s must be a list of token ids", what);
    size_t len = json_array_size(a);
    int32_t *ids = malloc(sizeof(int32_t) * (len + 1));
    if (!ids) return cs_error_set(CS_ENOMEM, "out of memory");
    for (size_t i = 0; i < len; i++) {
        json_t *x = json_array_get(a, i);
        if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) >= vocab) {
            free(ids);
            return cs_error_set(CS_EINVAL, "%s[%zu] is not a token id in [0, %d)", what, i, vocab);
        }
        ids[i] = (int32_t)json_integer_value(x);
    }
    *out = ids;
    *n = (int)len;
    return CS_OK;
}

/* the adapter of the request or a group: "name", {"name", "version"} or null */
static int adapter_of(json_t *a, const rollout_limits_t *lim, char **name, int *version) {
    *name = NULL;
    *version = 0;
    if (!a || json_is_null(a)) return CS_OK;
    const char *n = NULL;
    if (json_is_string(a)) n = json_string_value(a);
    else if (json_is_object(a)) n = json_string_value(json_object_get(a, "name"));
    if (!n) return cs_error_set(CS_EINVAL, "'adapter' must be a name or {\"name\": ...}");
    json_t *v = json_is_object(a) ? json_object_get(a, "version") : NULL;
    if (v && !json_is_null(v)) { /* pinned: exactly that kept version (checked at submission) */
        if (!json_is_integer(v) || json_integer_value(v) < 1 || json_integer_value(v) > INT32_MAX)
            return cs_error_set(CS_EINVAL, "adapter '%s': 'version' must be a positive integer", n);
        *version = (int)json_integer_value(v);
    }
    if (lim->base_name && !strcmp(n, lim->base_name)) {
        if (*version) return cs_error_set(CS_EINVAL, "'%s' is the base model: it has no versions", n);
        return CS_OK;
    }
    *name = strdup(n);
    return *name ? CS_OK : cs_error_set(CS_ENOMEM, "out of memory");
}

/* a rollout with nothing parsed yet */
static rollout_t *rollout_new(const rollout_request_t *rq) {
    rollout_t *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    pthread_mutex_init(&r->mu, NULL);
    r->refs = 1;
    r->emit = rq->emit;
    r->user = rq->user;
    r->want_lp = true;
    r->obs = rq->lim->obs;
    return r;
}

/* "sampling" (sampling_json.h) and the request's SLO into *base, with r's logprobs */
static int parse_sampling(rollout_t *r, rollout_request_t *rq, engine_request_t *base, sampling_json_t *sj) {
    int rc;
    json_t *sp = json_object_get(rq->body, "sampling");
    if (sp && !json_is_null(sp) && !json_is_object(sp)) BAD(CS_EINVAL, "sampling", "'sampling' must be an object");
    sampling_json_opts_t opt = {.style = SAMPLING_JSON_ROLLOUT, .logprobs = SAMPLING_JSON_LOGPROBS_OBJECT,
                                .max_logprobs = rq->lim->max_logprobs, .max_tokens_default = -1,
                                .vocab = rq->lim->vocab};
    if ((rc = sampling_params_from_json(json_is_object(sp) ? sp : NULL, &opt, sj))) BAD(rc, sj->param, "%s", cs_error_last());
    base->sampling = sj->sampling;
    base->max_tokens = sj->max_tokens;
    base->min_tokens = sj->min_tokens;
    base->ignore_eos = sj->ignore_eos;
    base->stop = sj->stop;
    base->n_stop = sj->n_stop;
    base->stop_token_ids = sj->stop_ids;
    base->n_stop_token_ids = sj->n_stop_ids;
    r->want_lp = sj->sampling.logprobs >= 0;
    r->top_k = CS_MAX(sj->sampling.logprobs, 0);
    json_t *km = json_is_object(sp) ? json_object_get(json_object_get(sp, "logprobs"), "kept_mass") : NULL;
    if (km && !json_is_null(km)) {
        if (!json_is_boolean(km)) BAD(CS_EINVAL, "logprobs", "sampling.logprobs.kept_mass must be true or false");
        r->want_kept = json_is_true(km);
        if (r->want_kept && sj->sampling.logprobs_mode != SAMPLING_LOGPROBS_PROCESSED)
            BAD(CS_EINVAL, "logprobs", "sampling.logprobs.kept_mass goes with mode \"processed\" (raw logprobs keep "
                                       "the whole distribution)");
    }
    if (sched_parse_slo(json_object_get(rq->body, "slo"), &base->slo_ttft_ms, &base->slo_tpot_ms))
        BAD(CS_EINVAL, "slo", "%s", cs_error_last());
    if (sampling_params_validate(&base->sampling)) BAD(CS_EINVAL, "sampling", "%s", cs_error_last());
    json_t *tc = json_object_get(rq->body, "tool_calls");
    if (tc && !json_is_null(tc)) {
        if (!json_is_boolean(tc)) BAD(CS_EINVAL, "tool_calls", "'tool_calls' must be true or false");
        r->want_tools = json_is_true(tc);
        if (r->want_tools && (!rq->lim->tok || !rq->lim->tool_format))
            BAD(CS_EINVAL, "tool_calls", "'tool_calls' needs the model's tokenizer and a tool-call format (its chat "
                                         "template's, or --tool-call-parser)");
        r->tok = rq->lim->tok;
        r->tool_format = rq->lim->tool_format;
    }
    json_t *bv = json_object_get(rq->body, "base_version");
    if (bv && !json_is_null(bv)) {
        if (!json_is_integer(bv) || json_integer_value(bv) < 1 || json_integer_value(bv) > INT_MAX)
            BAD(CS_EINVAL, "base_version", "'base_version' is a version of the base weights (an integer from 1)");
        base->base_version = (int)json_integer_value(bv);
    }
    return CS_OK;
fail:
    return rc;
}

/* the request's fields other than its groups: r's batch id and target, *base, the request's
 * adapter (*adapter, *version) */
static int parse_request(rollout_t *r, rollout_request_t *rq, engine_request_t *base, sampling_json_t *sj,
                         char **adapter, int *version) {
    int rc;
    json_t *req = rq->body;
    json_t *groups = json_object_get(req, "groups");
    if (!json_is_array(groups) || json_array_size(groups) == 0) BAD(CS_EINVAL, "groups", "'groups' must be a non-empty list");
    json_t *bid = json_object_get(req, "batch_id");
    if (bid && !json_is_null(bid)) {
        if (!json_is_string(bid)) BAD(CS_EINVAL, "batch_id", "'batch_id' must be a string");
        r->batch_id = strdup(json_string_value(bid));
    }
    json_t *st = json_object_get(req, "stream");
    if (st && !json_is_null(st) && !json_is_boolean(st)) BAD(CS_EINVAL, "stream", "'stream' must be true or false");
    if ((rc = parse_sampling(r, rq, base, sj))) return rc;
    if ((rc = adapter_of(json_object_get(req, "adapter"), rq->lim, adapter, version))) BAD(rc, "adapter", "%s", cs_error_last());
    json_t *comp = json_object_get(req, "completion");
    if (comp && !json_is_null(comp) && !json_is_object(comp))
        BAD(CS_EINVAL, "completion", "'completion' must be an object {\"target_groups\", \"on_target\"}");
    if (comp && !json_is_null(comp)) {
        json_t *t = json_object_get(comp, "target_groups");
        if (t && !json_is_null(t)) {
            if (!is_int(t) || int_of(t) < 1 || int_of(t) > INT32_MAX)
                BAD(CS_EINVAL, "completion", "completion.target_groups must be a positive integer");
            r->target = (int)int_of(t);
        }
        json_t *ov = json_object_get(comp, "on_target");
        const char *on = json_string_value(ov);
        if ((ov && !json_is_null(ov) && !on) || (on && strcmp(on, "abort_return_partial")))
            BAD(CS_EINVAL, "completion", "completion.on_target: only \"abort_return_partial\" is supported");
    }
    return CS_OK;
fail:
    return rc;
}

/* group g's prompt: input_ids, then continue_from's output_ids (n must be 1 then) */
/* a multi-turn group: input_ids, then per earlier turn the model's output_ids (with their
 * logprobs, optional) and the environment's env_ids, appended as they are (no re-tokenizing) */
static int parse_turns(ro_group_t *gr, rollout_request_t *rq, json_t *jg, json_t *turns, const char *gp) {
    int rc = CS_OK;
    char what[160];
    int32_t *in = NULL, *part = NULL;
    int n_in = 0, n_part = 0;
    if (!json_is_array(turns) || json_array_size(turns) == 0)
        BAD(CS_EINVAL, "groups", "%s.turns must be a non-empty list of {\"output_ids\", \"env_ids\"}", gp);
    snprintf(what, sizeof what, "%s.input_ids", gp);
    if ((rc = ids_of(json_object_get(jg, "input_ids"), rq->lim->vocab, &in, &n_in, what))) BAD(rc, "groups", "%s", cs_error_last());
    if (n_in == 0) BAD(CS_EINVAL, "groups", "%s.input_ids is empty", gp);
    size_t cap = (size_t)n_in + 64;
    gr->prompt = malloc(sizeof(int32_t) * cap);
    gr->hist_mask = malloc(cap);
    gr->hist_lps = malloc(sizeof(float) * cap);
    if (!gr->prompt || !gr->hist_mask || !gr->hist_lps) BAD(CS_ENOMEM, NULL, "out of memory");
    memcpy(gr->prompt, in, sizeof(int32_t) * (size_t)n_in);
    int len = n_in;
    bool all_lps = true;
    size_t ti;
    json_t *t;
    json_array_foreach(turns, ti, t) {
        if (!json_is_object(t)) BAD(CS_EINVAL, "groups", "%s.turns[%zu] must be {\"output_ids\", \"env_ids\"}", gp, ti);
        static const char *const keys[] = {"output_ids", "env_ids"};
        for (int k = 0; k < 2; k++) {
            snprintf(what, sizeof what, "%s.turns[%zu].%s", gp, ti, keys[k]);
            json_t *a = json_object_get(t, keys[k]);
            free(part);
            part = NULL;
            n_part = 0;
            if (!a || json_is_null(a) || (json_is_array(a) && json_array_size(a) == 0)) {
                if (k == 0 && json_object_get(t, "logprobs") && json_array_size(json_object_get(t, "logprobs")))
                    BAD(CS_EINVAL, "groups", "%s.turns[%zu].logprobs must be a number per output id", gp, ti);
                continue;
            }
            if ((rc = ids_of(a, rq->lim->vocab, &part, &n_part, what))) BAD(rc, "groups", "%s", cs_error_last());
            if ((size_t)len + (size_t)n_part > cap) {
                cap = ((size_t)len + (size_t)n_part) * 2;
                int32_t *np = realloc(gr->prompt, sizeof(int32_t) * cap);
                if (np) gr->prompt = np;
                uint8_t *nm = realloc(gr->hist_mask, cap);
                if (nm) gr->hist_mask = nm;
                float *nl = realloc(gr->hist_lps, sizeof(float) * cap);
                if (nl) gr->hist_lps = nl;
                if (!np || !nm || !nl) BAD(CS_ENOMEM, NULL, "out of memory");
            }
            memcpy(gr->prompt + len, part, sizeof(int32_t) * (size_t)n_part);
            memset(gr->hist_mask + (len - n_in), k == 0, (size_t)n_part);
            if (k == 0) { /* the model's logprobs of its turn, when given */
                json_t *lp = json_object_get(t, "logprobs");
                if (!lp || json_is_null(lp)) {
                    all_lps = all_lps && n_part == 0;
                } else if (!json_is_array(lp) || json_array_size(lp) != (size_t)n_part) {
                    BAD(CS_EINVAL, "groups", "%s.turns[%zu].logprobs must be a number per output id", gp, ti);
                } else {
                    for (int i = 0; i < n_part; i++) {
                        json_t *x = json_array_get(lp, (size_t)i);
                        if (!json_is_number(x))
                            BAD(CS_EINVAL, "groups", "%s.turns[%zu].logprobs must be a number per output id", gp, ti);
                        gr->hist_lps[len - n_in + i] = (float)json_number_value(x);
                    }
                }
            }
            len += n_part;
        }
    }
    if (len == n_in) BAD(CS_EINVAL, "groups", "%s.turns hold no tokens", gp);
    if (!all_lps) {
        free(gr->hist_lps);
        gr->hist_lps = NULL;
    }
    gr->n_input = n_in;
    gr->n_prompt = len;
    gr->n_hist = len - n_in;
    rc = CS_OK;
fail:
    free(in);
    free(part);
    return rc;
}

static int parse_prompt(ro_group_t *gr, rollout_request_t *rq, json_t *jg, const char *gp) {
    int rc;
    int32_t *in = NULL, *cont = NULL;
    int n_in = 0, n_cont = 0;
    char what[128];
    snprintf(what, sizeof what, "%s.input_ids", gp);
    if ((rc = ids_of(json_object_get(jg, "input_ids"), rq->lim->vocab, &in, &n_in, what))) BAD(rc, "groups", "%s", cs_error_last());
    if (n_in == 0) BAD(CS_EINVAL, "groups", "%s.input_ids is empty", gp);
    json_t *cf = json_object_get(jg, "continue_from"), *turns = json_object_get(jg, "turns");
    if (turns && !json_is_null(turns)) {
        free(in);
        in = NULL;
        if (cf && !json_is_null(cf)) BAD(CS_EINVAL, "groups", "%s: turns and continue_from do not go together", gp);
        return parse_turns(gr, rq, jg, turns, gp);
    }
    if (cf && !json_is_null(cf)) {
        snprintf(what, sizeof what, "%s.continue_from.output_ids", gp);
        if (!json_is_object(cf)) BAD(CS_EINVAL, "groups", "%s.continue_from must be {\"output_ids\": [...]}", gp);
        if ((rc = ids_of(json_object_get(cf, "output_ids"), rq->lim->vocab, &cont, &n_cont, what)))
            BAD(rc, "groups", "%s", cs_error_last());
        if (gr->n != 1) BAD(CS_EINVAL, "groups", "%s: continue_from needs n = 1", gp);
    }
    gr->prompt = malloc(sizeof(int32_t) * (size_t)(n_in + n_cont));
    if (!gr->prompt) BAD(CS_ENOMEM, NULL, "out of memory");
    memcpy(gr->prompt, in, sizeof(int32_t) * (size_t)n_in);
    if (n_cont) memcpy(gr->prompt + n_in, cont, sizeof(int32_t) * (size_t)n_cont);
    gr->n_input = n_in;
    gr->n_prompt = n_in + n_cont;
    gr->resumed_len = n_cont;
    rc = CS_OK;
fail:
    free(in);
    free(cont);
    return rc;
}

/* group g of the request: its id, n, seed, prompt, max_tokens and adapter (else the
 * request's); *samples counts the batch's samples */
static int parse_group(rollout_t *r, rollout_request_t *rq, int g, const engine_request_t *base, const char *req_adapter,
                       int req_version, long long *samples) {
    int rc;
    const rollout_limits_t *lim = rq->lim;
    json_t *jg = json_array_get(json_object_get(rq->body, "groups"), (size_t)g);
    ro_group_t *gr = &r->groups[g];
    gr->r = r;
    gr->index = g;
    char gp[48];
    snprintf(gp, sizeof gp, "groups[%d]", g);
    if (!json_is_object(jg)) BAD(CS_EINVAL, "groups", "%s must be an object", gp);
    json_t *gid = json_object_get(jg, "group_id");
    char defid[32];
    snprintf(defid, sizeof defid, "%d", g);
    if (gid && !json_is_null(gid) && !json_is_string(gid)) BAD(CS_EINVAL, "groups", "%s.group_id must be a string", gp);
    gr->group_id = strdup(json_is_string(gid) ? json_string_value(gid) : defid);
    json_t *n = json_object_get(jg, "n");
    gr->n = 1;
    if (n && !json_is_null(n)) {
        if (!is_int(n) || int_of(n) < 1 || int_of(n) > lim->max_samples)
            BAD(CS_EINVAL, "groups", "%s.n must be between 1 and %d", gp, lim->max_samples);
        gr->n = (int)int_of(n);
    }
    *samples += gr->n;
    if (*samples > lim->max_samples) BAD(CS_EINVAL, "groups", "the batch asks for more than %d samples", lim->max_samples);
    json_t *seed = json_object_get(jg, "seed");
    if (seed && !json_is_null(seed)) {
        if (!json_is_integer(seed)) BAD(CS_EINVAL, "groups", "%s.seed must be an integer", gp);
        gr->seed = (long long)json_integer_value(seed);
    } else { /* a fresh one, reported, so the sample can be reproduced */
        sampling_params_t fresh;
        sampling_params_default(&fresh);
        gr->seed = (long long)(sampling_seed_for(&fresh, 0) >> 2);
    }
    gr->has_seed = true;
    if ((rc = parse_prompt(gr, rq, jg, gp))) return rc;
    gr->max_tokens = base->max_tokens;
    if (base->max_tokens > 0) { /* max_tokens counts the whole sample */
        gr->max_tokens = base->max_tokens - gr->resumed_len;
        if (gr->max_tokens < 1)
            BAD(CS_EINVAL, "groups", "%s: continue_from already has %d of max_tokens %d", gp, gr->resumed_len,
                base->max_tokens);
    }
    json_t *ga = json_object_get(jg, "adapter");
    if (ga && !json_is_null(ga)) {
        if ((rc = adapter_of(ga, lim, &gr->adapter, &gr->adapter_version))) BAD(rc, "groups", "%s", cs_error_last());
    } else if (req_adapter) {
        gr->adapter = strdup(req_adapter);
        gr->adapter_version = req_version;
    }
    json_t *so = json_object_get(jg, "structured_outputs");
    if (!so || json_is_null(so)) so = json_object_get(rq->body, "structured_outputs"); /* the request's, for all */
    if (so && !json_is_null(so)) {
        if (!lim->compile) BAD(CS_EINVAL, "structured_outputs", "structured output is not available here");
        if ((rc = lim->compile(lim->compile_user, so, &gr->grammar)))
            BAD(rc, "structured_outputs", "%s: %s", gp, cs_error_last());
    }
    gr->samples = calloc((size_t)gr->n, sizeof *gr->samples);
    if (!gr->samples) BAD(CS_ENOMEM, NULL, "out of memory");
    for (int i = 0; i < gr->n; i++) {
        gr->samples[i].ids = json_array();
        gr->samples[i].lps = json_array();
        gr->samples[i].tops = json_array();
        gr->samples[i].kept = json_array();
        gr->samples[i].spans = json_array();
    }
    return CS_OK;
fail:
    return rc;
}

/* Every check of the request short of the engine's own: r's groups and *base filled. */
static int parse(rollout_t *r, rollout_request_t *rq, engine_request_t *base, sampling_json_t *sj) {
    char *req_adapter = NULL;
    int req_version = 0;
    int rc = parse_request(r, rq, base, sj, &req_adapter, &req_version);
    if (rc) goto fail; /* the adapter's name may be parsed before a later field fails */
    r->n_groups = (int)json_array_size(json_object_get(rq->body, "groups"));
    r->groups = calloc((size_t)r->n_groups, sizeof *r->groups);
    if (!r->groups) BAD(CS_ENOMEM, NULL, "out of memory");
    long long samples = 0;
    for (int g = 0; g < r->n_groups && !rc; g++) rc = parse_group(r, rq, g, base, req_adapter, req_version, &samples);
fail:
    free(req_adapter);
    return rc;
}

/* every group at once: they reach the engine in one intake, so the batch they form does not
 * depend on thread timing; the ids are written before any sink can run */
static int submit(rollout_t *r, engine_t *e, rollout_request_t *rq, const engine_request_t *base) {
    int rc;
    const rollout_limits_t *lim = rq->lim;
    r->e = e;
    r->t0 = cs_time_ms();
    engine_request_t *qs = NULL;
    for (int g = 0; g < r->n_groups && lim->adapter_check; g++)
        if ((rc = lim->adapter_check(lim->adapter_user, r->groups[g].adapter))) BAD(rc, "groups", "groups[%d]: %s", g, cs_error_last());
    qs = calloc((size_t)r->n_groups, sizeof *qs);
    r->ids = calloc((size_t)r->n_groups, sizeof *r->ids);
    if (!qs || !r->ids) BAD(CS_ENOMEM, NULL, "out of memory");
    for (int g = 0; g < r->n_groups; g++) {
        ro_group_t *gr = &r->groups[g];
        engine_request_t *q = &qs[g];
        *q = *base;
        /* the bounds the request left unset: its model's (--adapter-slos) */
        sched_slo_table_apply(lim->slos, gr->adapter ? gr->adapter : lim->base_name, &q->slo_ttft_ms, &q->slo_tpot_ms);
        gr->slo_ttft_ms = q->slo_ttft_ms;
        gr->slo_tpot_ms = q->slo_tpot_ms;
        q->prompt = gr->prompt;
        q->n_prompt = gr->n_prompt;
        q->n = gr->n;
        q->max_tokens = gr->max_tokens;
        q->adapter = gr->adapter;
        q->adapter_version = gr->adapter_version;
        q->n_resumed = gr->resumed_len;
        q->grammar = gr->grammar;
        q->min_tokens = base->min_tokens > gr->resumed_len ? base->min_tokens - gr->resumed_len : 0;
        q->sampling.has_seed = true;
        q->sampling.seed = (uint64_t)gr->seed;
        q->sink = on_event;
        q->user = gr;
        gr->submitted = true;
    }
    r->refs += r->n_groups;
    int failed = 0;
    int src = engine_submit_batch(e, qs, r->n_groups, r->ids, &failed);
    if (src) { /* the engine refuses a group: an unknown adapter, else a bad request */
        r->refs -= r->n_groups;
        for (int g = 0; g < r->n_groups; g++) r->groups[g].submitted = false;
        BAD(src == CS_ENOTFOUND ? CS_ENOTFOUND : CS_EINVAL, "groups", "groups[%d]: %s", failed, cs_error_last());
    }
    rc = CS_OK;
fail:
    free(qs);
    return rc;
}

/* A rollout with every check of rq short of the engine's own passed: its groups, *base and
 * *sj (freed by the caller) filled; NULL with the error in *rc. */
static rollout_t *rollout_parse(rollout_request_t *rq, engine_request_t *base, sampling_json_t *sj, int *rc) {
    rq->param = NULL;
    rollout_t *r = rollout_new(rq);
    if (!r) {
        *rc = cs_error_set(CS_ENOMEM, "out of memory");
        return NULL;
    }
    if ((*rc = parse(r, rq, base, sj))) {
        rollout_free(r);
        return NULL;
    }
    return r;
}

int rollout_start(engine_t *e, rollout_request_t *rq, rollout_t **out) {
    CS_ASSERT(e);
    engine_request_t base = {0};
    sampling_json_t sj = {0};
    int rc;
    rollout_t *r = rollout_parse(rq, &base, &sj, &rc);
    if (r && (rc = submit(r, e, rq, &base))) {
        rollout_free(r);
        r = NULL;
    }
    sampling_json_free(&sj); /* the engine copied the stops */
    *out = r;
    return rc;
}

int rollout_validate(rollout_request_t *rq) {
    engine_request_t base = {0};
    sampling_json_t sj = {0};
    int rc;
    rollout_free(rollout_parse(rq, &base, &sj, &rc));
    sampling_json_free(&sj);
    return rc;
}
