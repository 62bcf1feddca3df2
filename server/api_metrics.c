/* api_metrics.c: the server's metrics (server_metrics_t, on metrics.c's registry): their
 * families, the adapter registry's load-time callback and GET /metrics. The engine's and the
 * adapter registry's counters are cumulative there; a scrape adds what is new since the last
 * one. The families of generation requests are observed by the engine's sink (api_jobs.c)
 * and the rollout's taps (rollout_api/routes.c). */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sched/cost.h"
#include "engine/sched.h"
#include "server/api_internal.h"

static const double LAT_BUCKETS[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                                     2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
#define N_LAT (int)(sizeof LAT_BUCKETS / sizeof LAT_BUCKETS[0])

void server_on_load_time(void *user, const char *name, double seconds) {
    server_t *s = user;
    if (s->astats) astats_load(s, name, seconds, false);
}

void server_on_streamed(void *user, const char *name, double seconds) {
    server_t *s = user;
    if (s->astats) astats_load(s, name, seconds, true);
}

static const double LOAD_BUCKETS[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0};
#define N_LOAD (int)(sizeof LOAD_BUCKETS / sizeof LOAD_BUCKETS[0])

static const char *const L_ADAPTER[] = {"adapter", NULL}, *const L_FIN[] = {"adapter", "finished_reason", NULL},
                         *const L_TIER[] = {"tier", NULL}, *const L_MODE[] = {"mode", NULL},
                         *const L_PATH[] = {"path", NULL}, *const L_IO[] = {"io", NULL},
                         *const L_TERM[] = {"term", NULL}, *const L_ADAPTER_RANK[] = {"adapter", "rank", NULL},
                         *const L_SERIES[] = {"series", NULL}, *const L_RESULT[] = {"result", NULL};

/* The server's metric families, in the order /metrics lists them: where each lives in
 * server_metrics_t, its kind, name (after --metrics-prefix), help, labels and buckets. */
typedef enum { FAM_COUNTER, FAM_GAUGE, FAM_HISTOGRAM, FAM_SUMMARY } family_kind_t;
static const struct family {
    size_t off;
    family_kind_t kind;
    const char *name, *help;
    const char *const *labels;
    const double *buckets;
    int n_buckets;
} FAMILIES[] = {
#define F(field, kind, name, help, labels) {offsetof(server_metrics_t, field), kind, name, help, labels, NULL, 0}
#define H(field, name, help, labels, b, n) {offsetof(server_metrics_t, field), FAM_HISTOGRAM, name, help, labels, b, n}
    H(ttft, "time_to_first_token_seconds", "Time from arrival to the first token.", NULL, LAT_BUCKETS, N_LAT),
    H(itl, "inter_token_latency_seconds", "Time between consecutive tokens of a sample.", NULL, LAT_BUCKETS, N_LAT),
    H(e2e, "e2e_request_latency_seconds", "Time from arrival to the last token.", NULL, LAT_BUCKETS, N_LAT),
    H(queue, "request_queue_time_seconds", "Time a request waited before it was first scheduled.", NULL,
      LAT_BUCKETS, N_LAT),
    F(a_ttft, FAM_SUMMARY, "adapter_time_to_first_token_seconds",
      "Time to the first token by model (the base model, the --metrics-max-adapters most requested adapters, the "
      "rest as _other).", L_ADAPTER),
    F(a_itl, FAM_SUMMARY, "adapter_inter_token_latency_seconds", "Time between consecutive tokens, by model.",
      L_ADAPTER),
    F(a_e2e, FAM_SUMMARY, "adapter_e2e_request_latency_seconds", "Time from arrival to the last token, by model.",
      L_ADAPTER),
    F(prompt_tokens, FAM_COUNTER, "prompt_tokens_total", "Prompt tokens of finished requests.", L_ADAPTER),
    F(gen_tokens, FAM_COUNTER, "generation_tokens_total", "Generated tokens.", L_ADAPTER),
    F(success, FAM_COUNTER, "request_success_total", "Finished requests by finish reason.", L_FIN),
    F(running, FAM_GAUGE, "num_requests_running", "Sequences running in the engine.", NULL),
    F(waiting, FAM_GAUGE, "num_requests_waiting", "Sequences waiting for the engine.", NULL),
    F(kv_usage, FAM_GAUGE, "kv_cache_usage_perc", "Fraction of KV-cache blocks held by sequences (1 = full).", NULL),
    F(prefix_queries, FAM_COUNTER, "prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", NULL),
    F(prefix_hits, FAM_COUNTER, "prefix_cache_hits_total", "Prompt tokens whose KV came from the prefix cache.", NULL),
    F(preemptions, FAM_COUNTER, "num_preemptions_total", "Sequences preempted (KV cache full).", NULL),
    F(prefill_tokens, FAM_COUNTER, "prefill_tokens_total",
      "Prompt tokens computed (not taken from the prefix cache or a group's shared blocks).", NULL),
    F(lora_tier, FAM_GAUGE, "lora_adapters",
      "Adapters by tier: registered (served names), host (resident in memory), loading, device (in a device slot).",
      L_TIER),
    H(lora_load, "lora_load_seconds", "Adapter load time, disk to host memory.", NULL, LOAD_BUCKETS, N_LOAD),
    H(lora_transfer, "lora_transfer_seconds",
      "Adapter slot streaming time, host memory to the device (upload to last layer).", NULL, LOAD_BUCKETS, N_LOAD),
    F(cold_starts, FAM_COUNTER, "cold_starts_total",
      "Requests that found their adapter's device slot still streaming in, by what they did (cpu_assist, wait).",
      L_MODE),
    F(cold_auto, FAM_COUNTER, "cold_start_auto_total",
      "Cold-start requests under --cold-start auto, by what the byte model chose (cpu_assist: its rows and terms "
      "cost the link fewer bytes than the rest of the adapter; wait: more).",
      L_MODE),
    F(cold_layers, FAM_COUNTER, "cold_start_layers_total",
      "Adapter layers of cold-start forwards, by where their LoRA ran (host, device).", L_PATH),
    F(lora_hits, FAM_COUNTER, "lora_cache_hits_total", "Adapter acquires that found it resident.", NULL),
    F(lora_misses, FAM_COUNTER, "lora_cache_misses_total", "Adapter acquires that started a load.", NULL),
    F(lora_loads, FAM_COUNTER, "lora_loads_total",
      "Adapter loads from disk that finished, by how the weights were read (direct: O_DIRECT; buffered: the page "
      "cache).",
      L_IO),
    F(lora_streamed, FAM_COUNTER, "lora_streamed_loads_total",
      "Adapter loads handed out while their file still streamed in from disk (the header read; layers followed).",
      NULL),
    F(lora_partial, FAM_COUNTER, "lora_partial_acquires_total",
      "Requests that started on an adapter whose file still streamed in from disk.", NULL),
    F(cost_r2, FAM_GAUGE, "cost_model_r2",
      "The iteration cost model's R² on the steps it was fitted on (0 before a fit).", NULL),
    F(cost_err, FAM_GAUGE, "cost_model_heldout_error",
      "Mean relative error of the cost model on held-out steps (every fifth).", NULL),
    F(cost_coef, FAM_GAUGE, "cost_model_coefficient_seconds",
      "The cost model's seconds per unit of each term of an iteration.", L_TERM),
    F(cost_steps, FAM_GAUGE, "cost_model_fitted_steps", "Steps behind the cost model's fit.", NULL),
    F(slo_requests, FAM_COUNTER, "slo_requests_total",
      "Requests and rollout groups with an SLO (their own slo, or their model's from --adapter-slos), by adapter and "
      "rank.",
      L_ADAPTER_RANK),
    F(slo_met, FAM_COUNTER, "slo_attained_total",
      "Of those, the ones that met every bound they had (TTFT; worst sample's TPOT).", L_ADAPTER_RANK),
    F(adapter_series, FAM_GAUGE, "metrics_adapters",
      "Adapters that had requests, by whether they have series of their own (own) or are summed under "
      "adapter=\"_other\" (other).", L_SERIES),
    F(adapter_folds, FAM_COUNTER, "metrics_adapter_folds_total",
      "Times an adapter's series were folded into adapter=\"_other\" (it left the most requested).", NULL),
    F(lora_resolved, FAM_COUNTER, "lora_resolutions_total",
      "First requests for an unregistered name, by result: registered from a --lora-resolve directory, or not_found.",
      L_RESULT),
#undef F
#undef H
};

int server_metrics_init(server_t *s) {
    server_metrics_t *m = &s->m;
    pthread_mutex_init(&m->mu, NULL);
    if (!(m->reg = metrics_new())) return cs_error_set(CS_ENOMEM, "out of memory");
    for (size_t i = 0; i < sizeof FAMILIES / sizeof FAMILIES[0]; i++) {
        const struct family *f = &FAMILIES[i];
        char name[128];
        snprintf(name, sizeof name, "%s%s", s->cfg.metrics_prefix, f->name);
        metric_t *x = f->kind == FAM_COUNTER   ? metrics_counter(m->reg, name, f->help, f->labels)
                      : f->kind == FAM_GAUGE   ? metrics_gauge(m->reg, name, f->help, f->labels)
                      : f->kind == FAM_SUMMARY ? metrics_summary(m->reg, name, f->help, f->labels)
                                               : metrics_histogram(m->reg, name, f->help, f->labels, f->buckets,
                                                                   f->n_buckets);
        if (!x) return cs_error_set(CS_ENOMEM, "metrics: %s", cs_error_last());
        *(metric_t **)((char *)m + f->off) = x;
    }
    return CS_OK;
}

void server_metrics_free(server_t *s) {
    metrics_free(s->m.reg);
    s->m.reg = NULL;
    pthread_mutex_destroy(&s->m.mu);
}

/* GET /metrics: the engine's and the registry's counters brought up to date, then the text */
enum MHD_Result api_metrics(server_t *s, struct MHD_Connection *c) {
    server_metrics_t *m = &s->m;
    pthread_mutex_lock(&s->mu);
    bool ready = s->ready; /* the engine and registry are set up before ready, under mu */
    pthread_mutex_unlock(&s->mu);
    if (ready) {
        engine_stats_t st;
        lora_registry_stats_t ls = {0};
        /* the snapshots and the deltas under one lock: a concurrent scrape must not apply an
         * older snapshot after a newer one (the deltas would underflow) */
        pthread_mutex_lock(&m->mu);
        engine_get_stats(s->engine, &st);
        if (s->reg) lora_registry_stats(s->reg, &ls);
        metric_set(m->running, NULL, st.n_running);
        metric_set(m->waiting, NULL, st.n_waiting);
        int used = st.kv.n_blocks - st.kv.n_free - st.kv.n_cached;
        metric_set(m->kv_usage, NULL, st.kv.n_blocks ? (double)used / st.kv.n_blocks : 0);
        metric_inc(m->prefix_queries, NULL, (double)(st.prompt_tokens - m->last_prefix_queries));
        metric_inc(m->prefix_hits, NULL, (double)(st.cached_prompt_tokens - m->last_prefix_hits));
        metric_inc(m->preemptions, NULL, (double)(st.preemptions - m->last_preemptions));
        metric_inc(m->prefill_tokens, NULL, (double)(st.prefill_tokens - m->last_prefill_tokens));
        m->last_prefill_tokens = st.prefill_tokens;
        metric_inc(m->lora_hits, NULL, (double)(ls.hits - m->last_lora_hits));
        metric_inc(m->lora_misses, NULL, (double)(ls.misses - m->last_lora_misses));
        m->last_prefix_queries = st.prompt_tokens;
        m->last_prefix_hits = st.cached_prompt_tokens;
        m->last_preemptions = st.preemptions;
        m->last_lora_hits = ls.hits;
        m->last_lora_misses = ls.misses;
        metric_inc(m->lora_loads, (const char *[]){"direct"}, (double)(ls.loads_direct - m->last_lora_loads_direct));
        metric_inc(m->lora_loads, (const char *[]){"buffered"},
                   (double)((ls.loads - ls.loads_direct) - m->last_lora_loads_buffered));
        m->last_lora_loads_direct = ls.loads_direct;
        metric_inc(m->lora_streamed, NULL, (double)(ls.host_streams - m->last_lora_streamed));
        metric_inc(m->lora_partial, NULL, (double)(ls.partial_acquires - m->last_lora_partial));
        m->last_lora_streamed = ls.host_streams;
        m->last_lora_partial = ls.partial_acquires;
        m->last_lora_loads_buffered = ls.loads - ls.loads_direct;
        metric_inc(m->cold_starts, (const char *[]){"cpu_assist"}, (double)(st.cold_assisted - m->last_cold_assisted));
        metric_inc(m->cold_starts, (const char *[]){"wait"}, (double)(st.cold_waited - m->last_cold_waited));
        metric_inc(m->cold_layers, (const char *[]){"host"}, (double)(st.cold_host_layers - m->last_cold_host_layers));
        metric_inc(m->cold_layers, (const char *[]){"device"}, (double)(st.cold_device_layers - m->last_cold_device_layers));
        metric_inc(m->cold_auto, (const char *[]){"cpu_assist"}, (double)(st.cold_auto_assist - m->last_cold_auto_assist));
        metric_inc(m->cold_auto, (const char *[]){"wait"}, (double)(st.cold_auto_wait - m->last_cold_auto_wait));
        m->last_cold_auto_assist = st.cold_auto_assist;
        m->last_cold_auto_wait = st.cold_auto_wait;
        m->last_cold_assisted = st.cold_assisted;
        m->last_cold_waited = st.cold_waited;
        m->last_cold_host_layers = st.cold_host_layers;
        m->last_cold_device_layers = st.cold_device_layers;
        pthread_mutex_lock(&s->mu);
        uint64_t resolved = s->n_resolved, unresolved = s->n_resolve_failed;
        pthread_mutex_unlock(&s->mu);
        metric_inc(m->lora_resolved, (const char *[]){"registered"}, (double)(resolved - m->last_resolved));
        metric_inc(m->lora_resolved, (const char *[]){"not_found"}, (double)(unresolved - m->last_resolve_failed));
        m->last_resolved = resolved;
        m->last_resolve_failed = unresolved;
        pthread_mutex_unlock(&m->mu);
        astats_rebalance(s);
        metric_set(m->lora_tier, (const char *[]){"registered"}, ls.n_registered);
        metric_set(m->lora_tier, (const char *[]){"host"}, ls.n_resident);
        metric_set(m->lora_tier, (const char *[]){"loading"}, ls.n_loading);
        metric_set(m->lora_tier, (const char *[]){"device"}, ls.n_device);
    }
    if (s->cost) {
        cost_fit_t cf;
        cost_model_get(s->cost, &cf);
        metric_set(m->cost_r2, NULL, cf.fitted ? cf.r2 : 0);
        metric_set(m->cost_err, NULL, cf.fitted && isfinite(cf.heldout_mape) ? cf.heldout_mape : 0);
        metric_set(m->cost_steps, NULL, (double)cf.n_fit);
        for (int i = 0; i < COST_N_TERMS; i++) metric_set(m->cost_coef, (const char *[]){cost_term_names[i]}, cf.coef[i] / 1000);
    }
    size_t len = 0;
    char *txt = metrics_render(m->reg, &len);
    if (!txt) return http_error(c, 500, NULL, "out of memory");
    return http_text(c, 200, "text/plain; version=0.0.4; charset=utf-8", txt, len);
}

/* GET /v1/state: what a router needs to place a request here (sched/route.h): the running and
 * waiting sequences with their adapters' ranks, the adapters served with theirs, and the
 * iteration cost model that turns those into predicted milliseconds. */
enum MHD_Result api_state(server_t *s, struct MHD_Connection *c) {
    engine_seq_info_t *seqs = NULL;
    int n = 0;
    if (engine_get_state(s->engine, &seqs, &n)) return http_error(c, 500, NULL, "%s", cs_error_last());
    json_t *running = json_array(), *waiting = json_array(), *adapters = json_object();
    for (int i = 0; i < n; i++) {
        const engine_seq_info_t *q = &seqs[i];
        int rank = q->rank;
        long rank_sum = q->rank_sum;
        if (rank < 0 && s->reg) { /* not probed by the engine yet: the registry knows */
            lora_adapter_info_t li;
            if (!lora_registry_info(s->reg, q->adapter, 0, &li)) rank = li.max_rank, rank_sum = li.rank_sum;
        }
        json_t *o = json_pack("{s:I, s:i, s:s?, s:i, s:I, s:i, s:i, s:i, s:i, s:f}", "id", (json_int_t)q->req_id,
                              "index", q->index, "adapter", q->adapter[0] ? q->adapter : NULL, "rank", rank,
                              "rank_sum", (json_int_t)rank_sum, "prompt_tokens", q->n_prompt, "computed_tokens",
                              q->n_computed, "generated_tokens", q->n_generated, "max_tokens", q->max_tokens,
                              "age_ms", cs_time_ms() - q->t_submit_ms);
        if (o && (q->slo_ttft_ms > 0 || q->slo_tpot_ms > 0))
            json_object_set_new(o, "slo", json_pack("{s:f, s:f}", "ttft_ms", q->slo_ttft_ms, "tpot_ms", q->slo_tpot_ms));
        json_array_append_new(q->running ? running : waiting, o);
    }
    free(seqs);
    pthread_mutex_lock(&s->mu);
    int n_names = 0;
    for (served_adapter_t *a = s->adapters; a; a = a->next) n_names++;
    char **names = calloc((size_t)(n_names ? n_names : 1), sizeof *names);
    n_names = 0;
    for (served_adapter_t *a = s->adapters; a && names; a = a->next)
        if (!a->unloading) names[n_names++] = strdup(a->name);
    pthread_mutex_unlock(&s->mu);
    for (int i = 0; i < n_names; i++) {
        lora_adapter_info_t li;
        if (names[i] && s->reg && !lora_registry_info(s->reg, names[i], 0, &li))
            json_object_set_new(adapters, names[i], json_pack("{s:i, s:I}", "rank", li.max_rank, "rank_sum", (json_int_t)li.rank_sum));
        free(names[i]);
    }
    free(names);
    json_t *cm = json_null();
    if (s->cost) {
        cost_fit_t cf;
        cost_model_get(s->cost, &cf);
        json_t *terms = json_object();
        for (int i = 0; i < COST_N_TERMS; i++) json_object_set_new(terms, cost_term_names[i], json_real(cf.coef[i]));
        cm = json_pack("{s:o, s:b, s:f, s:f, s:I}", "terms", terms, "fitted", cf.fitted, "r2", cf.fitted ? cf.r2 : 0.0,
                       "heldout_mape", cf.fitted && isfinite(cf.heldout_mape) ? cf.heldout_mape : 0.0, "n_fit",
                       (json_int_t)cf.n_fit);
    }
    pthread_mutex_lock(&s->mu);
    bool draining = s->draining, paused = s->paused;
    pthread_mutex_unlock(&s->mu);
    json_t *out = json_pack("{s:s, s:s, s:i, s:i, s:b, s:b, s:o, s:o, s:o, s:o}", "model", s->model_name, "scheduler",
                            s->sched ? s->sched->iface->name : "fcfs", "max_num_seqs", s->cfg.max_num_seqs,
                            "max_model_len", s->max_model_len, "draining", draining, "paused", paused, "running",
                            running, "waiting", waiting, "adapters", adapters, "cost_model", cm);
    if (!out) return http_error(c, 500, NULL, "out of memory");
    return http_json(c, 200, out);
}
