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
#include "sched/slo.h"

typedef struct ro_sample {
    json_t *ids, *lps, *tops;   /* tops: per token [[id, logprob], ...] when top_k > 0 */
    json_t *spans;              /* [[start, end, version], ...]: which version made which tokens */
    const char *finish;
    int version;
    double queued_ms, t_first, t_last;
} ro_sample_t;

typedef struct ro_group {
    rollout_t *r;
    int index;
    char *group_id;
    int n;
    long long seed;
    bool has_seed;
    int32_t *prompt;            /* input_ids + continue_from.output_ids */
    int n_input, n_prompt, resumed_len, max_tokens;
    char *adapter;              /* NULL: the base model */
    int adapter_version;        /* 0: the active one (follows updates); > 0 pinned */
    double slo_ttft_ms, slo_tpot_ms; /* the group's SLO: the request's, else its model's (0: none) */
    bool submitted, done, first_token;
    int n_cached;
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
    bool want_lp;
    rollout_observer_t obs;
};

static void rollout_free(rollout_t *r) {
    for (int g = 0; g < r->n_groups; g++) {
        ro_group_t *gr = &r->groups[g];
        for (int i = 0; gr->samples && i < gr->n; i++) {
            json_decref(gr->samples[i].ids);
            json_decref(gr->samples[i].lps);
            json_decref(gr->samples[i].tops);
            json_decref(gr->samples[i].spans);
        }
        free(gr->samples);
        free(gr->group_id);
        free(gr->prompt);
        free(gr->adapter);
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
        if (r->want_lp) json_object_set(o, "logprobs", s->lps);
        if (r->want_lp && r->top_k > 0) json_object_set(o, "top_logprobs", s->tops);
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
            if (last && json_integer_value(json_array_get(last, 2)) == ev->adapter_version)
                json_array_set_new(last, 1, json_integer((json_int_t)nt));
            else
                json_array_append_new(s->spans, json_pack("[I, I, i]", (json_int_t)nt - 1, (json_int_t)nt,
                                                          ev->adapter_version));
            if (r->want_lp) {
                json_array_append_new(s->lps, cs_json_logprob(ev->logprob));
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
#define BAD(status, p, ...) \
    do { snprintf(err, errlen, __VA_ARGS__); snprintf(param, paramlen, "%s", p); rc = status; goto fail; } while (0)

/* an integer, or a real with an integer value that a long long holds (1e300 is not one) */
static bool is_int(json_t *v) {
    if (json_is_integer(v)) return true;
    double x = json_real_value(v);
    return json_is_real(v) && x == floor(x) && x >= -9.2e18 && x <= 9.2e18;
}
static long long int_of(json_t *v) { return json_is_integer(v) ? (long long)json_integer_value(v) : (long long)json_real_value(v); }

static int ids_of(json_t *a, int vocab, int32_t **out, int *n, const char *what, char *err, size_t errlen) {
    if (!json_is_array(a)) { snprintf(err, errlen, "%s must be a list of token ids", what); return -1; }
    size_t len = json_array_size(a);
    int32_t *ids = malloc(sizeof(int32_t) * (len + 1));
    if (!ids) { snprintf(err, errlen, "out of memory"); return -1; }
    for (size_t i = 0; i < len; i++) {
        json_t *x = json_array_get(a, i);
        if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) >= vocab) {
            free(ids);
            snprintf(err, errlen, "%s[%zu] is not a token id in [0, %d)", what, i, vocab);
            return -1;
        }
        ids[i] = (int32_t)json_integer_value(x);
    }
    *out = ids;
    *n = (int)len;
    return 0;
}

/* the adapter of the request or a group: "name", {"name", "version"} or null */
static int adapter_of(json_t *a, const rollout_limits_t *lim, char **name, int *version, char *err, size_t errlen) {
    *name = NULL;
    *version = 0;
    if (!a || json_is_null(a)) return 0;
    const char *n = NULL;
    if (json_is_string(a)) n = json_string_value(a);
    else if (json_is_object(a)) {
        n = json_string_value(json_object_get(a, "name"));
    }
    if (!n) { snprintf(err, errlen, "'adapter' must be a name or {\"name\": ...}"); return -1; }
    json_t *v = json_is_object(a) ? json_object_get(a, "version") : NULL;
    if (v && !json_is_null(v)) { /* pinned: exactly that kept version (checked at submission) */
        if (!json_is_integer(v) || json_integer_value(v) < 1 || json_integer_value(v) > INT32_MAX) {
            snprintf(err, errlen, "adapter '%s': 'version' must be a positive integer", n);
            return -1;
        }
        *version = (int)json_integer_value(v);
    }
    if (lim->base_name && !strcmp(n, lim->base_name)) {
        if (*version) {
            snprintf(err, errlen, "'%s' is the base model: it has no versions", n);
            return -1;
        }
        return 0;
    }
    *name = strdup(n);
    return 0;
}

/* rollout_start, or (e NULL) rollout_validate: everything up to the submission */
static int start(engine_t *e, const rollout_limits_t *lim, json_t *req, rollout_emit_fn emit, void *user,
                 rollout_t **out, char *err, size_t errlen, char *param, size_t paramlen) {
    int rc = 400;
    char *req_adapter = NULL;
    int32_t *stop_ids = NULL;
    *out = NULL;
    param[0] = 0;
    rollout_t *r = calloc(1, sizeof *r);
    if (!r) { snprintf(err, errlen, "out of memory"); return 500; }
    pthread_mutex_init(&r->mu, NULL);
    r->refs = 1;
    r->e = e;
    r->emit = emit;
    r->user = user;
    r->want_lp = true;
    r->obs = lim->obs;
    json_t *groups = json_object_get(req, "groups");
    if (!json_is_array(groups) || json_array_size(groups) == 0) BAD(400, "groups", "'groups' must be a non-empty list");
    json_t *bid = json_object_get(req, "batch_id");
    if (bid && !json_is_null(bid)) {
        if (!json_is_string(bid)) BAD(400, "batch_id", "'batch_id' must be a string");
        r->batch_id = strdup(json_string_value(bid));
    }
    json_t *st = json_object_get(req, "stream");
    if (st && !json_is_null(st) && !json_is_boolean(st)) BAD(400, "stream", "'stream' must be true or false");

    /* sampling: every engine field */
    engine_request_t base = {0};
    sampling_params_default(&base.sampling);
    base.max_tokens = -1;
    json_t *sp = json_object_get(req, "sampling");
    if (sp && !json_is_null(sp) && !json_is_object(sp)) BAD(400, "sampling", "'sampling' must be an object");
    static const struct { const char *name; int kind; } F[] = {
        {"max_tokens", 1}, {"min_tokens", 1}, {"temperature", 0}, {"top_p", 0}, {"top_k", 1}, {"min_p", 0},
        {"repetition_penalty", 0}, {"presence_penalty", 0}, {"frequency_penalty", 0}, {"ignore_eos", 2},
    };
    for (size_t i = 0; sp && i < sizeof F / sizeof F[0]; i++) {
        json_t *v = json_object_get(sp, F[i].name);
        if (!v || json_is_null(v)) continue;
        if (F[i].kind == 0 && !json_is_number(v)) BAD(400, "sampling", "sampling.%s must be a number", F[i].name);
        if (F[i].kind == 1 && !is_int(v)) BAD(400, "sampling", "sampling.%s must be an integer", F[i].name);
        if (F[i].kind == 1 && (int_of(v) > INT32_MAX || int_of(v) < INT32_MIN))
            BAD(400, "sampling", "sampling.%s is out of range", F[i].name);
        if (F[i].kind == 2 && !json_is_boolean(v)) BAD(400, "sampling", "sampling.%s must be true or false", F[i].name);
        double x = json_number_value(v);
        switch (i) {
        case 0: if (int_of(v) < 1) BAD(400, "sampling", "sampling.max_tokens must be at least 1"); base.max_tokens = (int)int_of(v); break;
        case 1: if (int_of(v) < 0) BAD(400, "sampling", "sampling.min_tokens must be at least 0"); base.min_tokens = (int)int_of(v); break;
        case 2: base.sampling.temperature = (float)x; break;
        case 3: base.sampling.top_p = (float)x; break;
        case 4: base.sampling.top_k = (int)int_of(v); break;
        case 5: base.sampling.min_p = (float)x; break;
        case 6: base.sampling.repetition_penalty = (float)x; break;
        case 7: base.sampling.presence_penalty = (float)x; break;
        case 8: base.sampling.frequency_penalty = (float)x; break;
        case 9: base.ignore_eos = json_is_true(v); break;
        }
    }
    char serr[200];
    if (sched_parse_slo(json_object_get(req, "slo"), &base.slo_ttft_ms, &base.slo_tpot_ms, serr, sizeof serr))
        BAD(400, "slo", "%s", serr);
    const char *stops[64];
    json_t *stop = sp ? json_object_get(sp, "stop") : NULL;
    if (stop && !json_is_null(stop)) {
        if (json_is_string(stop)) stops[base.n_stop++] = json_string_value(stop);
        else if (json_is_array(stop) && json_array_size(stop) <= 64) {
            size_t i;
            json_t *x;
            json_array_foreach(stop, i, x) {
                if (!json_is_string(x)) BAD(400, "sampling", "sampling.stop must be a string or a list of strings");
                stops[base.n_stop++] = json_string_value(x);
            }
        } else BAD(400, "sampling", "sampling.stop must be a string or a list of at most 64 strings");
        base.stop = stops;
    }
    json_t *sti = sp ? json_object_get(sp, "stop_token_ids") : NULL;
    if (sti && !json_is_null(sti)) {
        if (ids_of(sti, lim->vocab, &stop_ids, &base.n_stop_token_ids,
                   "sampling.stop_token_ids", err, errlen)) { snprintf(param, paramlen, "sampling"); goto fail; }
        base.stop_token_ids = stop_ids;
    }
    base.sampling.logprobs = 0;
    base.sampling.logprobs_mode = SAMPLING_LOGPROBS_RAW;
    json_t *lp = sp ? json_object_get(sp, "logprobs") : NULL;
    if (json_is_false(lp)) {
        r->want_lp = false;
        base.sampling.logprobs = -1;
    } else if (json_is_object(lp)) {
        const char *mode = json_string_value(json_object_get(lp, "mode"));
        if (mode && !strcmp(mode, "processed")) base.sampling.logprobs_mode = SAMPLING_LOGPROBS_PROCESSED;
        else if (mode && strcmp(mode, "raw")) BAD(400, "sampling", "sampling.logprobs.mode is \"raw\" or \"processed\"");
        json_t *k = json_object_get(lp, "top_k");
        if (k && !json_is_null(k)) {
            if (!is_int(k) || int_of(k) < 0 || int_of(k) > lim->max_logprobs)
                BAD(400, "sampling", "sampling.logprobs.top_k must be between 0 and %d", lim->max_logprobs);
            r->top_k = (int)int_of(k);
            base.sampling.logprobs = r->top_k;
        }
    } else if (lp && !json_is_null(lp) && !json_is_true(lp)) {
        BAD(400, "sampling", "sampling.logprobs must be true, false or {\"mode\", \"top_k\"}");
    }
    if (sampling_params_validate(&base.sampling)) BAD(400, "sampling", "%s", cs_error_last());
    int req_version = 0;
    if (adapter_of(json_object_get(req, "adapter"), lim, &req_adapter, &req_version, err, errlen)) {
        snprintf(param, paramlen, "adapter");
        goto fail;
    }
    json_t *comp = json_object_get(req, "completion");
    if (comp && !json_is_null(comp)) {
        json_t *t = json_object_get(comp, "target_groups");
        if (t && !json_is_null(t)) {
            if (!is_int(t) || int_of(t) < 1 || int_of(t) > INT32_MAX) { BAD(400, "completion", "completion.target_groups must be a positive integer"); }
            r->target = (int)int_of(t);
        }
        const char *on = json_string_value(json_object_get(comp, "on_target"));
        if (on && strcmp(on, "abort_return_partial")) {
            BAD(400, "completion", "completion.on_target: only \"abort_return_partial\" is supported");
        }
    }

    /* groups */
    int vocab_size = lim->vocab;
    r->n_groups = (int)json_array_size(groups);
    r->groups = calloc((size_t)r->n_groups, sizeof *r->groups);
    if (!r->groups) { BAD(500, "", "out of memory"); }
    long long samples = 0;
    for (int g = 0; g < r->n_groups; g++) {
        json_t *jg = json_array_get(groups, (size_t)g);
        ro_group_t *gr = &r->groups[g];
        gr->r = r;
        gr->index = g;
        char gp[48];
        snprintf(gp, sizeof gp, "groups[%d]", g);
        if (!json_is_object(jg)) { BAD(400, "groups", "%s must be an object", gp); }
        json_t *gid = json_object_get(jg, "group_id");
        char defid[32];
        snprintf(defid, sizeof defid, "%d", g);
        if (gid && !json_is_null(gid) && !json_is_string(gid)) { BAD(400, "groups", "%s.group_id must be a string", gp); }
        gr->group_id = strdup(json_is_string(gid) ? json_string_value(gid) : defid);
        json_t *n = json_object_get(jg, "n");
        gr->n = 1;
        if (n && !json_is_null(n)) {
            if (!is_int(n) || int_of(n) < 1 || int_of(n) > lim->max_samples) {
                BAD(400, "groups", "%s.n must be between 1 and %d", gp, lim->max_samples);
            }
            gr->n = (int)int_of(n);
        }
        samples += gr->n;
        if (samples > lim->max_samples) {
            BAD(400, "groups", "the batch asks for more than %d samples", lim->max_samples);
        }
        json_t *seed = json_object_get(jg, "seed");
        if (seed && !json_is_null(seed)) {
            if (!json_is_integer(seed)) { BAD(400, "groups", "%s.seed must be an integer", gp); }
            gr->seed = (long long)json_integer_value(seed);
        } else { /* a fresh one, reported, so the sample can be reproduced */
            sampling_params_t fresh;
            sampling_params_default(&fresh);
            gr->seed = (long long)(sampling_seed_for(&fresh, 0) >> 2);
        }
        gr->has_seed = true;
        int32_t *in = NULL, *cont = NULL;
        int n_in = 0, n_cont = 0;
        char what[128];
        snprintf(what, sizeof what, "%s.input_ids", gp);
        if (ids_of(json_object_get(jg, "input_ids"), vocab_size, &in, &n_in, what, err, errlen)) {
            snprintf(param, paramlen, "groups");
            goto fail;
        }
        if (n_in == 0) { free(in); BAD(400, "groups", "%s.input_ids is empty", gp); }
        json_t *cf = json_object_get(jg, "continue_from");
        if (cf && !json_is_null(cf)) {
            snprintf(what, sizeof what, "%s.continue_from.output_ids", gp);
            if (!json_is_object(cf) || ids_of(json_object_get(cf, "output_ids"), vocab_size, &cont, &n_cont, what, err, errlen)) {
                if (!json_is_object(cf)) snprintf(err, errlen, "%s.continue_from must be {\"output_ids\": [...]}", gp);
                free(in);
                snprintf(param, paramlen, "groups");
                goto fail;
            }
            if (gr->n != 1) { free(in); free(cont); BAD(400, "groups", "%s: continue_from needs n = 1", gp); }
        }
        gr->prompt = malloc(sizeof(int32_t) * (size_t)(n_in + n_cont));
        if (!gr->prompt) { free(in); free(cont); BAD(500, "", "out of memory"); }
        memcpy(gr->prompt, in, sizeof(int32_t) * (size_t)n_in);
        if (n_cont) memcpy(gr->prompt + n_in, cont, sizeof(int32_t) * (size_t)n_cont);
        free(in);
        free(cont);
        gr->n_input = n_in;
        gr->n_prompt = n_in + n_cont;
        gr->resumed_len = n_cont;
        gr->max_tokens = base.max_tokens;
        if (base.max_tokens > 0) { /* max_tokens counts the whole sample */
            gr->max_tokens = base.max_tokens - n_cont;
            if (gr->max_tokens < 1) {
                BAD(400, "groups", "%s: continue_from already has %d of max_tokens %d", gp, n_cont, base.max_tokens);
            }
        }
        json_t *ga = json_object_get(jg, "adapter");
        if (ga && !json_is_null(ga)) {
            if (adapter_of(ga, lim, &gr->adapter, &gr->adapter_version, err, errlen)) {
                snprintf(param, paramlen, "groups");
                goto fail;
            }
        } else if (req_adapter) {
            gr->adapter = strdup(req_adapter);
            gr->adapter_version = req_version;
        }
        gr->samples = calloc((size_t)gr->n, sizeof *gr->samples);
        if (!gr->samples) { BAD(500, "", "out of memory"); }
        for (int i = 0; i < gr->n; i++) {
            gr->samples[i].ids = json_array();
            gr->samples[i].lps = json_array();
            gr->samples[i].tops = json_array();
            gr->samples[i].spans = json_array();
        }
    }
    free(req_adapter);
    req_adapter = NULL;
    if (!e) { /* validation only */
        free(stop_ids);
        rollout_free(r);
        return 0;
    }

    /* every group at once: they reach the engine in one intake, so the batch they form does
     * not depend on thread timing; the ids are written before any sink can run */
    r->t0 = cs_time_ms();
    engine_request_t *qs = calloc((size_t)r->n_groups, sizeof *qs);
    r->ids = calloc((size_t)r->n_groups, sizeof *r->ids);
    if (!qs || !r->ids) { free(qs); BAD(500, "", "out of memory"); }
    for (int g = 0; g < r->n_groups; g++) {
        ro_group_t *gr = &r->groups[g];
        engine_request_t *q = &qs[g];
        *q = base;
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
        q->min_tokens = base.min_tokens > gr->resumed_len ? base.min_tokens - gr->resumed_len : 0;
        q->sampling.has_seed = true;
        q->sampling.seed = (uint64_t)gr->seed;
        q->sink = on_event;
        q->user = gr;
        gr->submitted = true;
    }
    r->refs += r->n_groups;
    int failed = 0;
    int src = engine_submit_batch(e, qs, r->n_groups, r->ids, &failed);
    free(qs);
    if (src) {
        r->refs -= r->n_groups;
        for (int g = 0; g < r->n_groups; g++) r->groups[g].submitted = false;
        BAD(src == CS_ENOTFOUND ? 404 : 400, "groups", "groups[%d]: %s", failed, cs_error_last());
    }
    free(stop_ids);
    *out = r;
    return 0;
fail:
    free(stop_ids);
    free(req_adapter);
    rollout_free(r);
    return rc;
}

int rollout_start(engine_t *e, const rollout_limits_t *lim, json_t *req, rollout_emit_fn emit, void *user,
                  rollout_t **out, char *err, size_t errlen, char *param, size_t paramlen) {
    CS_ASSERT(e);
    return start(e, lim, req, emit, user, out, err, errlen, param, paramlen);
}

int rollout_validate(const rollout_limits_t *lim, json_t *req, char *err, size_t errlen, char *param, size_t paramlen) {
    rollout_t *r = NULL;
    return start(NULL, lim, req, NULL, NULL, &r, err, errlen, param, paramlen);
}
