/* cmd_batch.c: `caraserve batch`: runs a file of JSON-lines requests through the serving
 * engine (continuous batching, paged KV, prefix cache, many adapters) and prints one JSON
 * line per request with every sample's tokens, logprobs, text and finish reason. It is
 * how tests and bench/engine.sh drive the engine without HTTP. --sequential runs each
 * request alone (to compare with the batched run). */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cpu_kernels/cpu_backend.h"
#include "server/setup.h"
#include "engine/engine.h"
#include "engine/sched.h"
#include "engine/sampling_json.h"
#include "sched/cost.h"
#include "sched/slo.h"
#include "lora/assist.h"
#include "lora/registry.h"
#include "server/commands.h"
#include "server/options.h"

/* a "Key:   N kB" line of /proc/self/status in bytes (0 where there is none: not Linux) */
static size_t proc_status_bytes(const char *key) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return 0;
    char line[256];
    size_t v = 0, klen = strlen(key);
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, key, klen)) {
            v = (size_t)strtoull(line + klen, NULL, 10) * 1024;
            break;
        }
    fclose(f);
    return v;
}

static void usage_batch(FILE *f) {
    options_usage(f, OPT_CMD_BATCH, "usage: caraserve batch --model DIR [--lora NAME=DIR ...] [--requests FILE] [options]",
                  "A request line: {\"prompt_ids\": [1, 2], or \"prompt\": \"text\", \"adapter\": \"NAME\",\n"
                  "  \"max_tokens\", \"min_tokens\", \"n\", \"temperature\", \"top_k\", \"top_p\", \"min_p\",\n"
                  "  \"repetition_penalty\", \"presence_penalty\", \"frequency_penalty\", \"seed\", \"stop\": [..],\n"
                  "  \"stop_token_ids\": [..], \"ignore_eos\", \"logprobs\": K, \"logprobs_mode\": \"raw\"|\"processed\",\n"
                  "  \"abort_after\": K (abort once sample 0 has K tokens; for tests), \"id\": anything}\n"
                  "A control line {\"add_adapter\": {\"name\": N, \"dir\": D}} registers a new version of N when\n"
                  "it is reached (with --sequential: after the requests before it have finished).\n");
}

typedef struct sample_res {
    json_t *tokens, *logprobs, *top;
    char *text;
    size_t text_len, text_cap;
    const char *finish;
    char *error;
} sample_res_t;

typedef struct job {
    json_t *in;              /* the request line */
    engine_request_t rq;
    int32_t *prompt;
    char **stops;
    int32_t *stop_ids;
    uint64_t id;
    int n;
    sample_res_t *samples;
    int prompt_tokens, cached_tokens, adapter_version;
    bool done, submitted;
    char *submit_error;
    int abort_after;
    bool abort_sent;
    bool control;            /* {"add_adapter": {"name", "dir"}}: registers (a new version) in order */
    int control_version;
    engine_t *engine;
    double t_submit, t_first, t_done; /* cs_time_ms(): --timings */
} job_t;

static bool g_timings; /* --timings: each line gains ttft_ms and e2e_ms */

static void sink(void *user, const engine_event_t *ev) {
    job_t *j = user;
    if (ev->index < 0 || ev->index >= j->n) return;
    sample_res_t *s = &j->samples[ev->index];
    j->prompt_tokens = ev->n_prompt_tokens;
    j->cached_tokens = ev->n_cached_tokens;
    j->adapter_version = ev->adapter_version;
    if (ev->has_token) {
        if (j->t_first == 0) j->t_first = cs_time_ms();
        json_array_append_new(s->tokens, json_integer(ev->token));
        if (j->rq.sampling.logprobs >= 0) {
            json_array_append_new(s->logprobs, isfinite(ev->logprob) ? json_real(ev->logprob) : json_null());
            json_t *alts = json_array();
            for (int i = 0; i < ev->n_top; i++)
                json_array_append_new(alts, json_pack("[i,o]", ev->top_ids[i],
                                                      isfinite(ev->top_logprobs[i]) ? json_real(ev->top_logprobs[i]) : json_null()));
            json_array_append_new(s->top, alts);
        }
    }
    if (ev->text_len) {
        if (s->text_len + ev->text_len + 1 > s->text_cap) {
            size_t nc = (s->text_len + ev->text_len + 1) * 2;
            char *nt = realloc(s->text, nc);
            if (nt) { s->text = nt; s->text_cap = nc; }
        }
        if (s->text_len + ev->text_len + 1 <= s->text_cap) {
            memcpy(s->text + s->text_len, ev->text, ev->text_len);
            s->text_len += ev->text_len;
            s->text[s->text_len] = 0;
        }
    }
    if (ev->finish != ENGINE_FINISH_NONE) {
        s->finish = engine_finish_names[ev->finish];
        if (ev->error_msg) s->error = strdup(ev->error_msg);
    }
    if (ev->request_done) {
        j->done = true;
        j->t_done = cs_time_ms();
    }
    if (j->abort_after > 0 && !j->abort_sent && ev->index == 0 && ev->n_generated >= j->abort_after &&
        ev->finish == ENGINE_FINISH_NONE) {
        engine_abort(j->engine, j->id);
        j->abort_sent = true;
    }
}

static int json_int_array(json_t *a, int32_t **out, int *n, const char *what) {
    if (!json_is_array(a)) return cs_error_set(CS_EINVAL, "%s must be an array of integers", what);
    size_t k = json_array_size(a);
    int32_t *v = malloc(sizeof(int32_t) * (k ? k : 1));
    for (size_t i = 0; i < k; i++) {
        json_t *x = json_array_get(a, i);
        if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) > INT32_MAX) {
            free(v);
            return cs_error_set(CS_EINVAL, "%s[%zu] is not a token id", what, i);
        }
        v[i] = (int32_t)json_integer_value(x);
    }
    *out = v;
    *n = (int)k;
    return 0;
}

/* fill j->rq from the JSON line: CS_OK, or CS_EINVAL with cs_error_set's message on a bad field */
static int job_parse(job_t *j, const tokenizer_t *tok) {
    json_t *o = j->in;
    engine_request_t *rq = &j->rq;
    memset(rq, 0, sizeof *rq);
    json_t *v;
    if ((v = json_object_get(o, "prompt_ids"))) {
        if (json_int_array(v, &j->prompt, &rq->n_prompt, "prompt_ids")) return CS_EINVAL;
    } else if ((v = json_object_get(o, "prompt"))) {
        if (!json_is_string(v)) return cs_error_set(CS_EINVAL, "prompt must be a string");
        if (!tok) return cs_error_set(CS_EINVAL, "the model has no tokenizer.json: give prompt_ids");
        size_t n;
        if (tokenizer_encode(tok, json_string_value(v), json_string_length(v), true, &j->prompt, &n)) {
            return cs_error_set(CS_EINVAL, "tokenize: %s", cs_error_last());
        }
        rq->n_prompt = (int)n;
    } else {
        return cs_error_set(CS_EINVAL, "a request needs prompt_ids or prompt");
    }
    rq->prompt = j->prompt;
    if ((v = json_object_get(o, "adapter")) && !json_is_null(v)) {
        if (!json_is_string(v)) return cs_error_set(CS_EINVAL, "adapter must be a string");
        rq->adapter = json_string_value(v);
    }
    sampling_json_opts_t opt = {.style = SAMPLING_JSON_BATCH, .logprobs = SAMPLING_JSON_LOGPROBS_COUNT_MODE,
                                .max_tokens_default = 16, .seed = true};
    sampling_json_t sj;
    if (sampling_params_from_json(o, &opt, &sj)) {
        sampling_json_free(&sj);
        return CS_EINVAL;
    }
    rq->sampling = sj.sampling;
    rq->max_tokens = sj.max_tokens;
    rq->min_tokens = sj.min_tokens;
    rq->ignore_eos = sj.ignore_eos;
    if (sj.stop) {
        j->stops = calloc(sj.n_stop ? (size_t)sj.n_stop : 1, sizeof(char *));
        for (rq->n_stop = 0; rq->n_stop < sj.n_stop; rq->n_stop++) j->stops[rq->n_stop] = strdup(sj.stop[rq->n_stop]);
        rq->stop = (const char *const *)j->stops;
    }
    j->stop_ids = sj.stop_ids;
    rq->stop_token_ids = j->stop_ids;
    rq->n_stop_token_ids = sj.n_stop_ids;
    sj.stop_ids = NULL;
    sampling_json_free(&sj);
    if ((v = json_object_get(o, "n")) && !json_is_null(v)) {
        if (!json_is_integer(v)) return cs_error_set(CS_EINVAL, "n must be an integer");
        rq->n = (int)json_integer_value(v);
    }
    if ((v = json_object_get(o, "abort_after")) && !json_is_null(v)) {
        if (!json_is_integer(v)) return cs_error_set(CS_EINVAL, "abort_after must be an integer");
        j->abort_after = (int)json_integer_value(v);
    }
    if (sched_parse_slo(json_object_get(o, "slo"), &rq->slo_ttft_ms, &rq->slo_tpot_ms)) return CS_EINVAL;
    j->n = rq->n > 0 ? rq->n : 1;
    return CS_OK;
}

static json_t *job_result(job_t *j) {
    json_t *o = json_object();
    json_t *id = json_object_get(j->in, "id");
    if (id) json_object_set(o, "id", id);
    if (j->submit_error) {
        json_object_set_new(o, "error", json_string(j->submit_error));
        return o;
    }
    if (j->control) {
        json_object_set(o, "add_adapter", json_object_get(json_object_get(j->in, "add_adapter"), "name"));
        json_object_set_new(o, "version", json_integer(j->control_version));
        return o;
    }
    json_object_set_new(o, "prompt_tokens", json_integer(j->prompt_tokens));
    json_object_set_new(o, "cached_tokens", json_integer(j->cached_tokens));
    json_object_set_new(o, "adapter_version", json_integer(j->adapter_version));
    json_t *arr = json_array();
    for (int i = 0; i < j->n; i++) {
        sample_res_t *s = &j->samples[i];
        json_t *so = json_object();
        json_object_set_new(so, "index", json_integer(i));
        json_object_set(so, "tokens", s->tokens);
        if (j->rq.sampling.logprobs >= 0) {
            json_object_set(so, "logprobs", s->logprobs);
            json_object_set(so, "top_logprobs", s->top);
        }
        json_object_set_new(so, "text", json_stringn(s->text ? s->text : "", s->text_len));
        json_object_set_new(so, "finish_reason", s->finish ? json_string(s->finish) : json_null());
        if (s->error) json_object_set_new(so, "error", json_string(s->error));
        json_array_append_new(arr, so);
    }
    json_object_set_new(o, "samples", arr);
    if (g_timings) {
        json_object_set_new(o, "ttft_ms", j->t_first > 0 ? json_real(j->t_first - j->t_submit) : json_null());
        json_object_set_new(o, "e2e_ms", j->t_done > 0 ? json_real(j->t_done - j->t_submit) : json_null());
    }
    return o;
}

static void job_free(job_t *j) {
    json_decref(j->in);
    free(j->prompt);
    if (j->stops)
        for (int i = 0; i < j->rq.n_stop; i++) free(j->stops[i]);
    free(j->stops);
    free(j->stop_ids);
    for (int i = 0; j->samples && i < j->n; i++) {
        json_decref(j->samples[i].tokens);
        json_decref(j->samples[i].logprobs);
        json_decref(j->samples[i].top);
        free(j->samples[i].text);
        free(j->samples[i].error);
    }
    free(j->samples);
    free(j->submit_error);
}

static void submit_job(engine_t *e, job_t *j) {
    j->engine = e;
    j->samples = calloc((size_t)j->n, sizeof *j->samples);
    for (int i = 0; i < j->n; i++) {
        j->samples[i].tokens = json_array();
        j->samples[i].logprobs = json_array();
        j->samples[i].top = json_array();
    }
    j->rq.sink = sink;
    j->rq.user = j;
    j->t_submit = cs_time_ms();
    if (engine_submit(e, &j->rq, &j->id)) j->submit_error = strdup(cs_error_last());
    else j->submitted = true;
}

/* the registry's on_loaded (loader and copy threads): the engine pointer is set and cleared
 * under this lock, so a load finishing around engine_new or engine_free never sees a
 * half-made or freed engine */
static pthread_mutex_t wake_mu = PTHREAD_MUTEX_INITIALIZER;

static void wake_engine(void *user) {
    engine_t **ep = user;
    pthread_mutex_lock(&wake_mu);
    if (*ep) engine_wake(*ep);
    pthread_mutex_unlock(&wake_mu);
}

static void set_engine(engine_t **ep, engine_t *e) {
    pthread_mutex_lock(&wake_mu);
    *ep = e;
    pthread_mutex_unlock(&wake_mu);
}

/* one `caraserve batch` run: its options, what it loaded, its requests */
typedef struct batch {
    cs_options_t o;
    FILE *in;
    backend_t *be;
    model_t *model;
    tokenizer_t *tok;
    lora_assist_t *assist;
    lora_registry_t *reg;
    cost_model_t *cost;
    sched_t *sched;
    engine_t *engine;
    job_t *jobs;
    int n_jobs, cap_jobs;
} batch_t;

/* the flags into O: -1 to go on, else the exit status */
static int batch_parse(cs_options_t *o, int argc, char **argv) {
    options_init(o);
    int r = options_parse(o, OPT_CMD_BATCH, argc, argv);
    if (r == OPT_HELP) { usage_batch(stdout); return 0; }
    if (r != OPT_OK) goto usage_err;
    if (!o->model) { fprintf(stderr, "caraserve batch: --model DIR is required\n"); goto usage_err; }
    for (int i = 0; i < o->n_lora_modules; i++)
        if (!strchr(o->lora_modules[i], '=') || o->lora_modules[i][0] == '=') {
            fprintf(stderr, "caraserve batch: --lora wants NAME=DIR, got '%s'\n", o->lora_modules[i]);
            goto usage_err;
        }
    if (o->kv_cache_fraction > 0) {
        size_t avail = cs_mem_available();
        if (!avail) { fprintf(stderr, "caraserve batch: cannot read MemAvailable from /proc/meminfo; use --kv-cache-bytes\n"); goto usage_err; }
        o->kv_cache_bytes = (long long)(o->kv_cache_fraction * (double)avail);
        o->kv_cache_explicit = true;
    }
    g_timings = o->timings;
    return -1;
usage_err:
    usage_batch(stderr);
    return 2;
}

/* the requests file, the backend, the model, its tokenizer and the cold start's workers */
static int batch_load_model(batch_t *b) {
    const cs_options_t *o = &b->o;
    b->in = stdin;
    if (o->requests && strcmp(o->requests, "-") && !(b->in = fopen(o->requests, "r"))) {
        fprintf(stderr, "caraserve batch: %s: %s\n", o->requests, strerror(errno));
        return -1;
    }
    b->be = setup_backend(&(setup_backend_opts_t){.device = o->device, .threads = o->threads,
                                                  .reference = o->reference_kernels,
                                                  .batch_invariant = o->batch_invariant, .precision_bf16 = o->precision == 1, .precision_int8 = o->precision == 2,
                                                  .compress_weights = o->compress_weights,
                                                  .compress_weights_only = o->compress_weights_only,
                                                  .gpu_memory_fraction = o->gpu_memory_fraction,
                                                  .cuda_graphs = o->cuda_graphs});
    if (!b->be) { fprintf(stderr, "caraserve: %s\n", cs_error_last()); return -1; }
    model_set_load_quantization((cs_dtype)o->quantization, backend_n_threads(b->be));
    if (model_load_how(o->model, b->be, o->weights_mem, &b->model)) {
        fprintf(stderr, "caraserve: %s: %s\n", o->model, cs_error_last());
        return -1;
    }
    if (setup_tokenizer(o->model, &b->tok)) { fprintf(stderr, "caraserve: %s: %s\n", o->model, cs_error_last()); return -1; }
    bool assist_failed;
    b->assist = setup_assist(b->be, o->cold_start, o->assist_threads, o->assist_dtype, model_weight_dtype(b->model),
                             &assist_failed);
    if (assist_failed) { fprintf(stderr, "caraserve: %s\n", cs_error_last()); return -1; }
    model_set_assist(b->model, b->assist);
    return 0;
}

/* SPEC's "NAME=DIR" registered; --preload-adapters: resident before the first request, so
 * which requests share an iteration does not depend on how fast the loads were (a
 * reproducible batch) */
static int batch_add_adapter(batch_t *b, const char *spec) {
    char *name = strdup(spec);
    char *eq = strchr(name, '=');
    *eq = 0;
    int ver;
    int rc = lora_registry_add(b->reg, name, eq + 1, &ver);
    if (rc) fprintf(stderr, "caraserve: adapter %s: %s\n", name, cs_error_last());
    for (lora_ref_t *ref = NULL; !rc && b->o.preload_adapters;) {
        rc = lora_registry_acquire(b->reg, name, &ref);
        if (rc == CS_OK && !lora_adapter_complete(ref->adapter)) {
            lora_registry_release(b->reg, ref); /* still streaming in from disk (or failed: said next) */
            ref = NULL;
            rc = CS_EAGAIN;
        }
        if (rc == CS_EAGAIN) { rc = 0; usleep(1000); continue; }
        if (rc) fprintf(stderr, "caraserve: adapter %s: %s\n", name, cs_error_last());
        else lora_registry_release(b->reg, ref);
        break;
    }
    free(name);
    return rc;
}

/* the adapter registry with the --lora adapters, the cost model, the policy, the engine */
static int batch_make_engine(batch_t *b) {
    const cs_options_t *o = &b->o;
    const model_config_t *cfg = model_get_config(b->model);
    lora_registry_params_t lp = {.cfg = cfg, .buffered_io = o->lora_buffered_io, .hold_bf16 = o->lora_bf16,
                                 .cache_bytes = (size_t)o->lora_cache_bytes, .max_loras = o->max_cpu_loras,
                                 .device = b->be, .device_slots = o->max_loras, .on_loaded = wake_engine, .user = &b->engine,
                                 .stream_group = 1, .stream_host = true};
    if (lora_registry_new(&lp, &b->reg)) { fprintf(stderr, "caraserve: %s\n", cs_error_last()); return -1; }
    for (int i = 0; i < o->n_lora_modules; i++)
        if (batch_add_adapter(b, o->lora_modules[i])) return -1;
    const int32_t *eos = cfg->n_eos ? cfg->eos_token_ids : NULL;
    if (!(b->cost = cost_model_new(1)) || !(b->sched = setup_scheduler(o->scheduler, b->cost, 0))) {
        fprintf(stderr, "caraserve: %s\n", cs_error_last());
        return -1;
    }
    engine_params_t ep = {.model = b->model, .tokenizer = b->tok, .loras = b->reg,
                          .kv_cache_bytes = setup_kv_bytes(b->be, (size_t)o->kv_cache_bytes, o->kv_cache_explicit),
                          .sched = b->sched, .max_num_seqs = o->max_num_seqs,
                          .max_num_batched_tokens = o->max_num_batched_tokens, .max_model_len = o->max_model_len,
                          .no_prefix_caching = o->no_prefix_caching, .cold_start = o->cold_start,
                          .kv_cache_dtype = setup_kv_dtype(b->be, o->kv_cache_dtype, o->precision == 1,
                                                           model_weight_dtype(b->model))};
    if (!b->tok && eos) { ep.eos_ids = eos; ep.n_eos = cfg->n_eos; }
    engine_t *made = NULL;
    if (engine_new(&ep, &made)) { fprintf(stderr, "caraserve: %s\n", cs_error_last()); return -1; }
    set_engine(&b->engine, made);
    return 0;
}

/* every request line of the input into b->jobs, a bad one with its error */
static void batch_read_jobs(batch_t *b) {
    char *line = NULL;
    size_t lcap = 0;
    ssize_t len;
    int lineno = 0;
    while ((len = getline(&line, &lcap, b->in)) > 0) {
        lineno++;
        bool blank = true;
        for (ssize_t i = 0; i < len && blank; i++) blank = line[i] == ' ' || line[i] == '\n' || line[i] == '\t' || line[i] == '\r';
        if (blank) continue;
        if (b->n_jobs == b->cap_jobs) {
            b->cap_jobs = b->cap_jobs ? b->cap_jobs * 2 : 64;
            b->jobs = realloc(b->jobs, sizeof *b->jobs * (size_t)b->cap_jobs);
        }
        job_t *j = &b->jobs[b->n_jobs++];
        memset(j, 0, sizeof *j);
        json_error_t jerr;
        j->in = json_loadb(line, (size_t)len, 0, &jerr);
        char err[512];
        if (!j->in || !json_is_object(j->in)) {
            snprintf(err, sizeof err, "line %d: not a JSON object (%s)", lineno, j->in ? "wrong type" : jerr.text);
            json_decref(j->in);
            j->in = json_object();
            j->submit_error = strdup(err);
            continue;
        }
        json_t *add = json_object_get(j->in, "add_adapter");
        if (add) {
            j->control = true;
            if (!json_is_string(json_object_get(add, "name")) || !json_is_string(json_object_get(add, "dir")))
                j->submit_error = strdup("add_adapter needs {\"name\": ..., \"dir\": ...}");
            continue;
        }
        if (job_parse(j, b->tok)) {
            char full[600];
            snprintf(full, sizeof full, "line %d: %s", lineno, cs_error_last());
            j->submit_error = strdup(full);
        }
    }
    free(line);
}

/* every job submitted in order (--sequential: each run to the end first) and run; the wall
 * time in ms */
static double batch_run(batch_t *b) {
    double t0 = cs_time_ms();
    for (int i = 0; i < b->n_jobs; i++) {
        job_t *j = &b->jobs[i];
        if (j->submit_error) continue;
        if (j->control) {
            json_t *add = json_object_get(j->in, "add_adapter");
            if (lora_registry_add(b->reg, json_string_value(json_object_get(add, "name")),
                                  json_string_value(json_object_get(add, "dir")), &j->control_version))
                j->submit_error = strdup(cs_error_last());
            continue;
        }
        submit_job(b->engine, j);
        if (b->o.sequential) engine_run_until_idle(b->engine);
    }
    if (!b->o.sequential) engine_run_until_idle(b->engine);
    return cs_time_ms() - t0;
}

/* the cost model's fit as JSON ("null" where it has none) */
static void cost_fit_json(cost_model_t *cost, char *cm, size_t len) {
    snprintf(cm, len, "null");
    cost_fit_t cf;
    cost_model_get(cost, &cf);
    if (!cf.fitted) return;
    int o = snprintf(cm, len, "{\"r2\": %.6f, \"heldout_mape\": %.6f, \"n_fit\": %ld, \"n_heldout\": %ld, "
                     "\"terms_ms\": {", cf.r2, isfinite(cf.heldout_mape) ? cf.heldout_mape : -1.0, cf.n_fit,
                     cf.n_heldout);
    for (int i = 0; i < COST_N_TERMS && o < (int)len; i++)
        o += snprintf(cm + o, len - (size_t)o, "%s\"%s\": %.6g", i ? ", " : "", cost_term_names[i], cf.coef[i]);
    if (o < (int)len) snprintf(cm + o, len - (size_t)o, "}}");
}

/* --stats: the engine's, the registry's, the backend's and the cold start's counters as one
 * JSON line on stderr */
static void batch_print_stats(batch_t *b, double wall) {
    char cm[640];
    cost_fit_json(b->cost, cm, sizeof cm);
    engine_stats_t st;
    engine_get_stats(b->engine, &st);
    lora_registry_stats_t ls;
    lora_registry_stats(b->reg, &ls);
    backend_stats_t bs;
    backend_get_stats(b->be, &bs);
    size_t huge = 0, copied = model_weights_copied(b->model, &huge);
    fprintf(stderr,
            "{\"wall_ms\": %.3f, \"steps\": %llu, \"prefill_tokens\": %llu, \"decode_tokens\": %llu, "
            "\"busy_ms\": %.3f, \"decode_only_ms\": %.3f, \"decode_only_tokens\": %llu, \"preemptions\": %llu, "
            "\"prompt_tokens\": %llu, \"cached_prompt_tokens\": %llu, \"kv_blocks\": %d, \"kv_free\": %d, "
            "\"kv_cached\": %d, \"kv_dtype\": \"%s\", \"prefix_lookups\": %llu, \"prefix_hits\": %llu, \"lora_loads\": %llu, \"lora_loads_direct\": %llu, "
            "\"lora_evictions\": %llu, \"lora_load_failures\": %llu, \"lora_device_uploads\": %llu, "
            "\"lora_device_evictions\": %llu, \"lora_device_waits\": %llu, \"threads\": %d, "
            "\"weights\": {\"memory\": \"%s\", \"copied_bytes\": %zu, \"huge_page_bytes\": %zu, "
            "\"coded_bytes\": %zu, \"coded_from_bytes\": %zu, \"coded_exceptions\": %llu, \"released_bytes\": %zu}, \"backend\": {\"name\": \"%s\", "
            "\"kernels\": \"%s\", \"h2d_bytes\": %llu, \"d2h_bytes\": %llu, \"d2d_bytes\": %llu, \"h2d_copies\": %llu, "
            "\"d2h_copies\": %llu, \"d2d_copies\": %llu, \"batch_uploads\": %llu, \"allocated\": %zu, "
            "\"graph_captures\": %llu, \"graph_replays\": %llu}, "
            "\"cold_start\": {\"requests\": %llu, \"assisted\": %llu, \"waited\": %llu, \"forwards\": %llu, "
            "\"host_layers\": %llu, \"device_layers\": %llu, \"host_rows\": %llu, \"streams\": %llu, "
            "\"stream_ms\": %.3f, \"assist_threads\": %d, \"host_streams\": %llu, \"partial_acquires\": %llu, \"disk_waits\": %llu, \"pinned_allocs\": %llu, "
            "\"auto_assist\": %llu, \"auto_wait\": %llu}, "
            "\"scheduler\": \"%s\", \"cost_model\": %s, \"rss_bytes\": %zu, \"peak_rss_bytes\": %zu}\n",
            wall, (unsigned long long)st.steps, (unsigned long long)st.prefill_tokens,
            (unsigned long long)st.decode_tokens, st.busy_ms, st.decode_only_ms,
            (unsigned long long)st.decode_only_tokens, (unsigned long long)st.preemptions,
            (unsigned long long)st.prompt_tokens, (unsigned long long)st.cached_prompt_tokens, st.kv.n_blocks,
            st.kv.n_free, st.kv.n_cached, cs_dtype_name(st.kv.dtype), (unsigned long long)st.kv.lookups, (unsigned long long)st.kv.hits,
            (unsigned long long)ls.loads, (unsigned long long)ls.loads_direct, (unsigned long long)ls.evictions, (unsigned long long)ls.load_failures,
            (unsigned long long)ls.device_uploads, (unsigned long long)ls.device_evictions,
            (unsigned long long)ls.device_waits, backend_n_threads(b->be), copied ? "copy" : "mmap", copied, huge, bs.prepared_bytes, bs.prepared_from,
            (unsigned long long)bs.prepared_exceptions, model_weights_released(b->model), backend_name(b->be), cpu_backend_path(b->be), (unsigned long long)bs.h2d_bytes,
            (unsigned long long)bs.d2h_bytes, (unsigned long long)bs.d2d_bytes, (unsigned long long)bs.h2d_copies,
            (unsigned long long)bs.d2h_copies, (unsigned long long)bs.d2d_copies, (unsigned long long)bs.batch_uploads,
            bs.allocated, (unsigned long long)bs.graph_captures, (unsigned long long)bs.graph_replays,
            (unsigned long long)st.cold_starts, (unsigned long long)st.cold_assisted,
            (unsigned long long)st.cold_waited, (unsigned long long)st.cold_forwards,
            (unsigned long long)st.cold_host_layers, (unsigned long long)st.cold_device_layers,
            (unsigned long long)st.cold_host_rows, (unsigned long long)ls.device_streams, ls.device_stream_ms,
            b->assist ? lora_assist_threads(b->assist) : 0, (unsigned long long)ls.host_streams,
            (unsigned long long)ls.partial_acquires, (unsigned long long)st.cold_disk_waits,
            (unsigned long long)st.cold_pinned_allocs, (unsigned long long)st.cold_auto_assist,
            (unsigned long long)st.cold_auto_wait, sched_name(b->sched), cm,
            proc_status_bytes("VmRSS:"), proc_status_bytes("VmHWM:"));
}

/* one JSON line per request in order; --cost-model-out */
static void batch_print_results(batch_t *b) {
    for (int i = 0; i < b->n_jobs; i++) {
        json_t *r = job_result(&b->jobs[i]);
        char *s = json_dumps(r, JSON_COMPACT);
        printf("%s\n", s);
        free(s);
        json_decref(r);
    }
    int cfit = cost_model_fit(b->cost); /* the whole run's steps */
    if (b->o.cost_model_out) {
        if (cfit) fprintf(stderr, "caraserve batch: --cost-model-out: %s\n", cs_error_last());
        else if (cost_model_save(b->cost, b->o.cost_model_out)) fprintf(stderr, "caraserve batch: %s\n", cs_error_last());
    }
}

static void batch_free(batch_t *b) {
    engine_t *dying = b->engine;
    set_engine(&b->engine, NULL);
    engine_free(dying);
    sched_free(b->sched);
    cost_model_free(b->cost);
    for (int i = 0; i < b->n_jobs; i++) job_free(&b->jobs[i]);
    free(b->jobs);
    lora_registry_free(b->reg);
    lora_assist_free(b->assist);
    tokenizer_free(b->tok);
    model_free(b->model);
    backend_free(b->be);
    if (b->in && b->in != stdin) fclose(b->in);
    options_free(&b->o);
}

int cmd_batch(int argc, char **argv) {
    batch_t b = {0};
    int status = batch_parse(&b.o, argc, argv);
    if (status >= 0) {
        options_free(&b.o);
        return status;
    }
    status = 1;
    if (!batch_load_model(&b) && !batch_make_engine(&b)) {
        batch_read_jobs(&b); /* every request first */
        double wall = batch_run(&b);
        batch_print_results(&b);
        if (b.o.stats) batch_print_stats(&b, wall);
        status = 0;
        for (int i = 0; i < b.n_jobs; i++)
            if (b.jobs[i].submitted && !b.jobs[i].done) {
                fprintf(stderr, "caraserve batch: request %d did not finish\n", i);
                status = 1;
            }
    }
    batch_free(&b);
    return status;
}
