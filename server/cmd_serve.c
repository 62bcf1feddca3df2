/* cmd_serve.c: `caraserve serve`. Reads flags (from --config FILE first, then the command
 * line, which wins), starts listening at once (/health answers 503 while the model loads),
 * loads the model, tokenizer, chat template and adapters, starts the engine thread, then
 * waits for SIGTERM or SIGINT: stop accepting, let in-flight requests finish within
 * --shutdown-timeout, abort the rest, exit 0. SIGHUP rereads --api-keys. */
#include "config.h" /* first: _GNU_SOURCE for nftw */

#include <errno.h>
#include <ftw.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "server/setup.h"
#include "lora/assist.h"
#include "lora/registry.h"
#include "server/commands.h"
#include "text/tool_calls.h"
#include "engine/sched.h"
#include "sched/cost.h"
#include "sched/slo.h"
#include "server/keys.h"
#include "server/server.h"

/* SIGTERM/SIGINT reach whichever thread (OpenBLAS starts its own before main): the handler
 * only writes the signal to a pipe the main thread reads */
static int sig_pipe[2] = {-1, -1};

static volatile sig_atomic_t loading = 1;

/* the registry's on_loaded (loader thread): under s->mu, so the engine cannot be freed
 * meanwhile (engine_wake only takes the engine's own lock) */
static void wake_engine(void *user) {
    server_t *s = user;
    pthread_mutex_lock(&s->mu);
    if (s->engine) engine_wake(s->engine);
    pthread_mutex_unlock(&s->mu);
}

static void on_signal(int sig) {
    if (loading && sig != SIGHUP) _exit(0); /* nothing accepted yet (requests got 503): no need to wait for the load */
    int saved = errno;
    unsigned char b = (unsigned char)sig;
    if (write(sig_pipe[1], &b, 1) < 0) {}
    errno = saved;
}

/* the next signal, waiting at most timeout_ms (-1: forever); 0 when none came */
static int next_signal(int timeout_ms) {
    struct pollfd p = {.fd = sig_pipe[0], .events = POLLIN};
    int r;
    while ((r = poll(&p, 1, timeout_ms)) < 0 && errno == EINTR) {}
    unsigned char b = 0;
    if (r > 0 && read(sig_pipe[0], &b, 1) != 1) b = 0;
    return b;
}

static void usage_serve(FILE *f) {
    options_usage(f, OPT_CMD_SERVE, "usage: caraserve serve --model DIR [options]", NULL);
}

/* the serving cost model forgets slowly: a step 2,000 steps ago weighs 1/e */
#define COST_FORGET_SERVE 0.9995

/* the "bos_token"/"eos_token" string of tokenizer_config.json (a string or {"content": ...}) */
static char *special_token(json_t *cfg, const char *key) {
    json_t *v = json_object_get(cfg, key);
    if (json_is_object(v)) v = json_object_get(v, "content");
    return json_is_string(v) ? strdup(json_string_value(v)) : NULL;
}

static char *template_source(const char *model_dir, const tokenizer_t *tok, const char *override, json_t **tcfg) {
    if (model_path_is_gguf(model_dir)) { /* the file's tokenizer.chat_template, and its bos and eos */
        *tcfg = json_object();
        const char *b = tok ? tokenizer_id_to_token(tok, tokenizer_bos_id(tok)) : NULL;
        const int32_t *eos;
        const char *e = tok && tokenizer_eos_ids(tok, &eos) > 0 ? tokenizer_id_to_token(tok, eos[0]) : NULL;
        if (b) json_object_set_new(*tcfg, "bos_token", json_string(b));
        if (e) json_object_set_new(*tcfg, "eos_token", json_string(e));
        if (override) return cs_read_file(override, NULL);
        const char *ct = tok ? tokenizer_chat_template(tok) : NULL;
        return ct ? strdup(ct) : NULL;
    }
    char *path = cs_path_join(model_dir, "tokenizer_config.json");
    json_error_t je;
    /* model_max_length may be 1e30: read integers as reals */
    *tcfg = path && cs_file_exists(path) ? json_load_file(path, JSON_DECODE_INT_AS_REAL, &je) : NULL;
    free(path);
    if (override) return cs_read_file(override, NULL);
    json_t *t = json_object_get(*tcfg, "chat_template");
    if (json_is_string(t)) return strdup(json_string_value(t));
    if (json_is_array(t)) {
        size_t i;
        json_t *x;
        json_array_foreach(t, i, x) {
            const char *name = json_string_value(json_object_get(x, "name"));
            json_t *tt = json_object_get(x, "template");
            if (name && !strcmp(name, "default") && json_is_string(tt)) return strdup(json_string_value(tt));
        }
    }
    char *jpath = cs_path_join(model_dir, "chat_template.jinja"); /* transformers' newer layout */
    char *src = jpath && cs_file_exists(jpath) ? cs_read_file(jpath, NULL) : NULL;
    free(jpath);
    return src;
}

static bool parse_lora_module(const char *spec, char **name, char **dir) {
    *name = *dir = NULL;
    if (spec[0] == '{') {
        json_error_t je;
        json_t *o = json_loads(spec, 0, &je);
        const char *n = json_string_value(json_object_get(o, "name")), *p = json_string_value(json_object_get(o, "path"));
        if (n && p) {
            *name = strdup(n);
            *dir = strdup(p);
        }
        json_decref(o);
        return *name && *dir;
    }
    const char *eq = strchr(spec, '=');
    if (!eq || eq == spec || !eq[1]) return false;
    *name = strndup(spec, (size_t)(eq - spec));
    *dir = strdup(eq + 1);
    return *name && *dir;
}

static int remove_entry(const char *path, const struct stat *st, int type, struct FTW *ftw) {
    (void)st; (void)type; (void)ftw;
    remove(path);
    return 0;
}


/* the adapters of --lora-modules as names and directories */
typedef struct serve_modules {
    char **names, **dirs;
    int n;
} serve_modules_t;

static void serve_modules_free(serve_modules_t *m) {
    for (int i = 0; i < m->n; i++) { free(m->names[i]); free(m->dirs[i]); }
    free(m->names);
    free(m->dirs);
}

/* the flags (config files first) into CFG and M: -1 to go on, else the exit status */
static int serve_parse(int argc, char **argv, serve_config_t *cfg, serve_modules_t *m) {
    options_init(cfg);
    int r = options_parse(cfg, OPT_CMD_SERVE, argc, argv);
    if (r == OPT_HELP) { usage_serve(stdout); return 0; }
    if (r == OPT_ECONFIG) return 1;
    if (r != OPT_OK) goto usage_err;
    if (!cfg->model) { fprintf(stderr, "caraserve serve: --model DIR is required\n"); goto usage_err; }
    if (cfg->api_key && cfg->api_keys) {
        fprintf(stderr, "caraserve serve: --api-key and --api-keys together: give the admin key an entry in the file\n");
        goto usage_err;
    }
    if (!cfg->api_key && !cfg->api_keys && getenv("CARASERVE_API_KEY") && getenv("CARASERVE_API_KEY")[0])
        cfg->api_key = strdup(getenv("CARASERVE_API_KEY"));
    for (const char *p = cfg->metrics_prefix; *p; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9' && p != cfg->metrics_prefix) || *p == '_' || *p == ':')) {
            fprintf(stderr, "caraserve serve: --metrics-prefix '%s' is not a valid metric name prefix\n", cfg->metrics_prefix);
            goto usage_err;
        }
    m->names = calloc((size_t)cfg->n_lora_modules + 1, sizeof(char *));
    m->dirs = calloc((size_t)cfg->n_lora_modules + 1, sizeof(char *));
    for (m->n = 0; m->n < cfg->n_lora_modules; m->n++)
        if (!parse_lora_module(cfg->lora_modules[m->n], &m->names[m->n], &m->dirs[m->n])) {
            fprintf(stderr, "caraserve serve: --lora-modules wants NAME=DIR or {\"name\": N, \"path\": DIR}, got '%s'\n",
                    cfg->lora_modules[m->n]);
            m->n++; /* its halves freed too */
            goto usage_err;
        }
    return -1;
usage_err:
    usage_serve(stderr);
    return 2;
}

/* --generation-config: auto takes the sampling defaults of the model's generation_config.json
 * (as vLLM does), vllm none, DIR those of DIR/generation_config.json */
static int serve_generation_config(server_t *s) {
    const char *gc = s->cfg.generation_config;
    if (!gc || !strcmp(gc, "vllm")) return 0;
    bool from_model = !strcmp(gc, "auto");
    const char *dir = from_model ? s->cfg.model : gc;
    char *path = cs_path_join(dir, "generation_config.json");
    if (!path) return -1;
    int rc = !from_model && !cs_file_exists(path) ? cs_error_set(CS_ENOTFOUND, "no %s", path)
                                                 : model_gen_defaults_load(dir, &s->gen_defaults);
    if (rc) {
        fprintf(stderr, "caraserve serve: --generation-config %s: %s\n", gc, cs_error_last());
        free(path);
        return -1;
    }
    const model_gen_defaults_t *g = &s->gen_defaults;
    if (g->set) {
        char b[256] = "";
        size_t n = 0;
        if (g->set & MODEL_GEN_TEMPERATURE) n += (size_t)snprintf(b + n, sizeof b - n, " temperature=%g", g->temperature);
        if (g->set & MODEL_GEN_TOP_P) n += (size_t)snprintf(b + n, sizeof b - n, " top_p=%g", g->top_p);
        if (g->set & MODEL_GEN_TOP_K) n += (size_t)snprintf(b + n, sizeof b - n, " top_k=%d", g->top_k);
        if (g->set & MODEL_GEN_MIN_P) n += (size_t)snprintf(b + n, sizeof b - n, " min_p=%g", g->min_p);
        if (g->set & MODEL_GEN_REPETITION_PENALTY)
            n += (size_t)snprintf(b + n, sizeof b - n, " repetition_penalty=%g", g->repetition_penalty);
        if (g->set & MODEL_GEN_MAX_TOKENS) snprintf(b + n, sizeof b - n, " max_tokens=%d", g->max_tokens);
        fprintf(stderr, "caraserve: requests' default sampling from %s:%s (a request's own values win; "
                        "--generation-config vllm: vLLM's defaults)\n", path, b);
    }
    free(path);
    return 0;
}

/* before the model: the served name, --generation-config, --adapter-slos, the roots, the
 * upload directory, the listener (/health answers 503 while the model loads) */
static int serve_prepare(server_t *s) {
    if (!s->cfg.served_model_name) {
        const char *b = s->cfg.model + strlen(s->cfg.model);
        while (b > s->cfg.model && b[-1] == '/') b--;
        const char *e = b;
        while (b > s->cfg.model && b[-1] != '/') b--;
        s->cfg.served_model_name = e > b ? strndup(b, (size_t)(e - b)) : strdup(s->cfg.model);
    }
    s->model_name = s->cfg.served_model_name;
    if (serve_generation_config(s)) return -1;
    if (s->cfg.adapter_slos) { /* before anything slow: a bad file stops the start at once */
        if (sched_slo_table_load(s->cfg.adapter_slos, &s->slos)) {
            fprintf(stderr, "caraserve serve: --adapter-slos %s: %s\n", s->cfg.adapter_slos, cs_error_last());
            return -1;
        }
    }
    s->roots = calloc((size_t)s->cfg.n_lora_roots + 1, sizeof(char *));
    for (int i = 0; i < s->cfg.n_lora_roots; i++) {
        char *rp = realpath(s->cfg.lora_roots[i], NULL);
        if (!rp) {
            fprintf(stderr, "caraserve serve: --lora-root %s: %s\n", s->cfg.lora_roots[i], strerror(errno));
            return -1;
        }
        s->roots[s->n_roots++] = rp;
    }
    s->keys = s->cfg.api_keys ? keyring_load(s->cfg.api_keys) : keyring_single(s->cfg.api_key);
    if (!s->keys) {
        fprintf(stderr, "caraserve serve: %s\n", cs_error_last());
        return -1;
    }
    s->resolve_dirs = calloc((size_t)s->cfg.n_lora_resolve + 1, sizeof(char *));
    for (int i = 0; i < s->cfg.n_lora_resolve; i++) {
        char *rp = realpath(s->cfg.lora_resolve[i], NULL);
        if (!rp) {
            fprintf(stderr, "caraserve serve: --lora-resolve %s: %s\n", s->cfg.lora_resolve[i], strerror(errno));
            return -1;
        }
        s->resolve_dirs[s->n_resolve_dirs++] = rp;
        bool inside = false;
        for (int k = 0; k < s->n_roots && !inside; k++) {
            size_t n = strlen(s->roots[k]);
            inside = !strncmp(rp, s->roots[k], n) && (rp[n] == '/' || rp[n] == 0 || n == 1);
        }
        if (!inside) {
            fprintf(stderr, "caraserve serve: --lora-resolve %s is not inside a --lora-root directory\n",
                    s->cfg.lora_resolve[i]);
            return -1;
        }
    }
    if (s->cfg.adapter_upload_dir) {
        if (mkdir(s->cfg.adapter_upload_dir, 0700) && errno != EEXIST) {
            fprintf(stderr, "caraserve serve: --adapter-upload-dir %s: %s\n", s->cfg.adapter_upload_dir, strerror(errno));
            return -1;
        }
        s->upload_dir = strdup(s->cfg.adapter_upload_dir);
    } else {
        const char *tmp = getenv("TMPDIR");
        char tmpl[4096];
        snprintf(tmpl, sizeof tmpl, "%s/caraserve-uploads-XXXXXX", tmp && *tmp ? tmp : "/tmp");
        s->upload_dir = mkdtemp(tmpl) ? strdup(tmpl) : NULL;
        if (!s->upload_dir) {
            fprintf(stderr, "caraserve serve: cannot create an upload directory in %s: %s\n", tmp && *tmp ? tmp : "/tmp",
                    strerror(errno));
            return -1;
        }
    }
    if (server_metrics_init(s) || astats_init(s)) { fprintf(stderr, "caraserve serve: %s\n", cs_error_last()); return -1; }
    if (http_start(s)) { fprintf(stderr, "caraserve serve: %s\n", cs_error_last()); return -1; }
    fprintf(stderr, "caraserve: listening on http://%s%s%s:%d (loading %s)\n", strchr(s->cfg.host, ':') ? "[" : "",
            s->cfg.host, strchr(s->cfg.host, ':') ? "]" : "", s->bound_port, s->cfg.model);
    return 0;
}

/* the backend, the model, the cold start's workers, the tokenizer and the chat template */
static int serve_load_model(server_t *s) {
    s->be = setup_backend(&(setup_backend_opts_t){.device = s->cfg.device, .threads = s->cfg.threads,
                                                  .reference = s->cfg.reference_kernels,
                                                  .batch_invariant = s->cfg.batch_invariant,
                                                  .precision_bf16 = s->cfg.precision == 1, .precision_int8 = s->cfg.precision == 2,
                                                  .compress_weights = s->cfg.compress_weights,
                                                  .compress_weights_only = s->cfg.compress_weights_only,
                                                  .gpu_memory_fraction = s->cfg.gpu_memory_fraction,
                                                  .cuda_graphs = s->cfg.cuda_graphs});
    if (!s->be) { fprintf(stderr, "caraserve serve: %s\n", cs_error_last()); return -1; }
    model_set_load_quantization((cs_dtype)s->cfg.quantization, backend_n_threads(s->be));
    if (model_load_how(s->cfg.model, s->be, s->cfg.weights_mem, &s->model)) {
        fprintf(stderr, "caraserve serve: %s: %s\n", s->cfg.model, cs_error_last());
        return -1;
    }
    bool assist_failed;
    s->assist = setup_assist(s->be, s->cfg.cold_start, s->cfg.assist_threads, s->cfg.assist_dtype,
                             model_weight_dtype(s->model), &assist_failed);
    if (assist_failed) { fprintf(stderr, "caraserve serve: %s\n", cs_error_last()); return -1; }
    model_set_assist(s->model, s->assist);
    if (setup_tokenizer(s->cfg.model, &s->tok)) { fprintf(stderr, "caraserve serve: %s: %s\n", s->cfg.model, cs_error_last()); return -1; }
    json_t *tcfg = NULL;
    char *tsrc = template_source(s->cfg.model, s->tok, s->cfg.chat_template, &tcfg);
    int rc = 0;
    if (s->cfg.chat_template && !tsrc) {
        fprintf(stderr, "caraserve serve: --chat-template %s: %s\n", s->cfg.chat_template, cs_error_last());
        rc = -1;
    } else if (tsrc) {
        if (chat_template_parse(tsrc, strlen(tsrc), &s->tmpl)) {
            fprintf(stderr, "caraserve serve: the chat template of %s cannot be served: %s\n",
                    s->cfg.chat_template ? s->cfg.chat_template : s->cfg.model, cs_error_last());
            rc = -1;
        }
        s->tmpl_wants_parts = strstr(tsrc, "['type']") || strstr(tsrc, "[\"type\"]");
        s->tool_format = tool_format_detect(tsrc);
    }
    const char *tp = s->cfg.tool_call_parser;
    if (tp && strcmp(tp, "none") && !tool_format_by_name(tp)) {
        fprintf(stderr, "caraserve serve: --tool-call-parser %s: not one of hermes, llama3_json, mistral, none\n", tp);
        rc = -1;
    } else if (tp) {
        s->tool_format = tool_format_by_name(tp);
    }
    const char *rp = s->cfg.reasoning_parser;
    s->think_start_id = s->tok ? tokenizer_token_to_id(s->tok, "<think>") : -1;
    s->think_end_id = s->tok ? tokenizer_token_to_id(s->tok, "</think>") : -1;
    if (rp && strcmp(rp, "qwen3") && strcmp(rp, "deepseek_r1")) {
        fprintf(stderr, "caraserve serve: --reasoning-parser %s: not one of qwen3, deepseek_r1\n", rp);
        rc = -1;
    } else if (rp) {
        s->reasoning = !strcmp(rp, "qwen3") ? 1 : 2;
    }
    if (rc == 0) {
        s->bos_token = special_token(tcfg, "bos_token");
        s->eos_token = special_token(tcfg, "eos_token");
    }
    free(tsrc);
    json_decref(tcfg);
    return rc;
}

/* where the weights are, for the ready line (before the engine owns them) */
static void serve_weights_note(server_t *s) {
    size_t huge = 0, copied = model_weights_copied(s->model, &huge);
    char *wmem = s->weights_note;
    size_t wlen = sizeof s->weights_note;
    snprintf(wmem, wlen, "weights mapped");
    if (copied)
        snprintf(wmem, wlen, "weights in memory, %.0f of %.0f MiB in huge pages", (double)huge / (1 << 20),
                 (double)copied / (1 << 20));
    backend_stats_t wbs;
    backend_get_stats(s->be, &wbs);
    if (wbs.prepared_bytes) {
        size_t l = strlen(wmem);
        snprintf(wmem + l, wlen - l, ", coded in %.0f of %.0f MiB%s", (double)wbs.prepared_bytes / (1 << 20),
                 (double)wbs.prepared_from / (1 << 20),
                 model_weights_released(s->model) ? ", the BF16 released" : " for decode");
    }
}

/* the adapter registry, the cost model, the policy and the engine; *KV_DTYPE: its KV cache's */
static int serve_make_engine(server_t *s, cs_dtype *kv_dtype) {
    s->mcfg = *model_get_config(s->model);
    const model_config_t *mc = &s->mcfg;
    s->vocab_size = mc->vocab_size;
    lora_registry_params_t lp = {.cfg = mc, .buffered_io = s->cfg.lora_buffered_io, .hold_bf16 = s->cfg.lora_bf16,
                                 .cache_bytes = (size_t)s->cfg.lora_cache_bytes, .max_loras = s->cfg.max_cpu_loras,
                                 .device = s->be, .device_slots = s->cfg.max_loras, .on_loaded = NULL, .on_load_time = server_on_load_time,
                                 .stream_group = 1, .stream_host = true, .on_streamed = server_on_streamed,
                                 .on_dropped = server_on_dropped, .user = s};
    size_t kv_bytes = (size_t)s->cfg.kv_cache_bytes;
    if (s->cfg.kv_cache_fraction > 0) {
        size_t avail = cs_mem_available();
        if (!avail) { fprintf(stderr, "caraserve serve: cannot read MemAvailable for --kv-cache-fraction\n"); return -1; }
        kv_bytes = (size_t)((double)avail * s->cfg.kv_cache_fraction);
    }
    kv_bytes = setup_kv_bytes(s->be, kv_bytes, s->cfg.kv_cache_explicit || s->cfg.kv_cache_fraction > 0);
    if (!(s->cost = cost_model_new(COST_FORGET_SERVE))) { fprintf(stderr, "caraserve serve: out of memory\n"); return -1; }
    if (s->cfg.cost_model && cost_model_load(s->cost, s->cfg.cost_model)) {
        fprintf(stderr, "caraserve serve: --cost-model: %s\n", cs_error_last());
        return -1;
    }
    if (!(s->sched = setup_scheduler(s->cfg.scheduler, s->cost, s->cfg.slo_headroom))) { fprintf(stderr, "caraserve serve: %s\n", cs_error_last()); return -1; }
    engine_params_t ep = {.model = s->model, .tokenizer = s->tok, .kv_cache_bytes = kv_bytes, .sched = s->sched,
                          .max_num_seqs = s->cfg.max_num_seqs, .max_num_batched_tokens = s->cfg.max_num_batched_tokens,
                          .max_model_len = s->cfg.max_model_len, .no_prefix_caching = s->cfg.no_prefix_caching,
                          .cold_start = s->cfg.cold_start, .own_model = true, .model_dir = s->cfg.model,
                          .weight_version = s->cfg.weight_version,
                          .kv_cache_dtype = setup_kv_dtype(s->be, s->cfg.kv_cache_dtype, s->cfg.precision == 1,
                                                          model_weight_dtype(s->model))};
    if (!s->tok && mc->n_eos) { ep.eos_ids = mc->eos_token_ids; ep.n_eos = mc->n_eos; }
    *kv_dtype = ep.kv_cache_dtype;
    /* a finished load wakes the engine at once (else it would notice at its next 20 ms poll):
     * the registry comes first, and finds the engine through s */
    lp.on_loaded = wake_engine;
    if (lora_registry_new(&lp, &s->reg)) { fprintf(stderr, "caraserve serve: %s\n", cs_error_last()); return -1; }
    ep.loras = s->reg;
    engine_t *engine = NULL;
    if (engine_new(&ep, &engine)) { fprintf(stderr, "caraserve serve: %s\n", cs_error_last()); return -1; }
    serve_weights_note(s);
    pthread_mutex_lock(&s->mu);
    s->engine = engine;
    s->model = NULL; /* the engine's now: an update may free it */
    pthread_mutex_unlock(&s->mu);
    s->max_model_len = engine_max_model_len(s->engine);
    if (!s->cfg.max_n) s->cfg.max_n = s->cfg.max_num_seqs > 0 ? s->cfg.max_num_seqs : 256;
    return 0;
}

/* the --lora-modules adapters, --profile-cost-model, then the engine thread and the watcher */
static int serve_start(server_t *s, const serve_modules_t *m) {
    for (int i = 0; i < m->n; i++) {
        perr_t e;
        if (server_add_adapter(s, m->names[i], m->dirs[i], false, &e)) {
            fprintf(stderr, "caraserve serve: --lora-modules %s=%s: %s\n", m->names[i], m->dirs[i], e.msg);
            return -1;
        }
    }
    for (int i = 0; i < s->cfg.n_lora_modules_dirs; i++)
        if (server_modules_dir(s, s->cfg.lora_modules_dirs[i]) < 0) {
            fprintf(stderr, "caraserve serve: %s\n", cs_error_last());
            return -1;
        }
    if (s->cfg.profile_seconds > 0) {
        double tp = cs_time_ms();
        int steps = setup_profile_cost_model(s->engine, s->cost, (const char *const *)m->names, m->n,
                                             s->vocab_size, s->max_model_len, s->cfg.profile_seconds);
        if (steps < 0) { fprintf(stderr, "caraserve serve: %s\n", cs_error_last()); return -1; }
        cost_fit_t cf;
        cost_model_get(s->cost, &cf);
        fprintf(stderr, "caraserve: cost model: %d steps profiled in %.1f s: R² %.3f, held-out error %.1f%%; ms per unit:",
                steps, (cs_time_ms() - tp) / 1000, cf.r2, 100 * cf.heldout_mape);
        for (int i = 0; i < COST_N_TERMS; i++) fprintf(stderr, " %s %.4g", cost_term_names[i], cf.coef[i]);
        fprintf(stderr, "\n");
    }
    if (engine_start(s->engine)) { fprintf(stderr, "caraserve serve: %s\n", cs_error_last()); return -1; }
    if (api_watch_start(s)) { fprintf(stderr, "caraserve serve: %s\n", cs_error_last()); return -1; }
    return 0;
}

/* "caraserve: ready: ..." with where the weights are */
static void serve_say_ready(server_t *s, cs_dtype kv_dtype) {
    const char *wmem = s->weights_note;
    pthread_mutex_lock(&s->mu); /* first requests may be registering adapters already */
    size_t n_adapters = s->n_adapters;
    pthread_mutex_unlock(&s->mu);
    fprintf(stderr, "caraserve: ready: %s (%zu adapters, context %d, %s KV cache, %s chat template, %s) on http://%s:%d\n",
            s->model_name, n_adapters, s->max_model_len, cs_dtype_name(kv_dtype),
            s->tmpl ? "with a" : "no", wmem, s->cfg.host, s->bound_port);
}

/* requests and adapter unloads still in flight */
static int serve_in_flight(server_t *s) {
    pthread_mutex_lock(&s->mu);
    int n = s->n_jobs + s->n_unload_waiting;
    pthread_mutex_unlock(&s->mu);
    return n;
}

/* SIGHUP: --api-keys read again. New requests get the new keys; those already in get to
 * finish on the ones they came with. A file that does not parse leaves the keys as they were. */
static void serve_reload_keys(server_t *s) {
    if (!s->cfg.api_keys) {
        fprintf(stderr, "caraserve: SIGHUP: no --api-keys file to read again\n");
        return;
    }
    keyring_t *r = keyring_load(s->cfg.api_keys);
    if (!r) {
        fprintf(stderr, "caraserve: SIGHUP: the keys stay as they were: %s\n", cs_error_last());
        return;
    }
    pthread_mutex_lock(&s->mu);
    keyring_t *old = s->keys;
    s->keys = r;
    pthread_mutex_unlock(&s->mu);
    keyring_unref(old);
    fprintf(stderr, "caraserve: SIGHUP: %d keys from %s\n", keyring_count(r), s->cfg.api_keys);
}

/* until SIGTERM or SIGINT, then the drain: in-flight requests get --shutdown-timeout, the
 * rest are aborted; connections that still do not finish end the process here */
static void serve_until_signal(server_t *s) {
    int sig;
    while ((sig = next_signal(-1)) == SIGHUP) serve_reload_keys(s);
    fprintf(stderr, "caraserve: %s: draining (at most %gs)\n", sig == SIGINT ? "SIGINT" : "SIGTERM", s->cfg.shutdown_timeout);
    pthread_mutex_lock(&s->mu);
    s->draining = true;
    pthread_mutex_unlock(&s->mu);
    /* the listener stays open while the drain lasts: /health answers 503 (a load balancer's
     * readiness probe takes the server out) and new generation requests 503 "shutting down"
     * (a client retries elsewhere), where a closed socket would say nothing */
    engine_set_pause(s->engine, ENGINE_RUN); /* a paused server lets its requests finish now */
    double deadline = cs_time_ms() + s->cfg.shutdown_timeout * 1000.0;
    bool forced = false;
    while (serve_in_flight(s) > 0 && cs_time_ms() < deadline && !forced) {
        if (next_signal(20) == SIGINT) { /* a second Ctrl-C: do not wait */
            fprintf(stderr, "caraserve: second SIGINT: not waiting\n");
            forced = true;
        }
    }
    int left = serve_in_flight(s);
    if (left) {
        fprintf(stderr, "caraserve: aborting %d request(s) still running\n", left);
        api_abort_all(s);
        double d2 = cs_time_ms() + 5000;
        while (serve_in_flight(s) > 0 && cs_time_ms() < d2) usleep(20000);
        left = serve_in_flight(s);
    }
    if (left) { /* connections still held: stopping the daemon under them is not allowed */
        fprintf(stderr, "caraserve: %d connection(s) did not finish; exiting\n", left);
        _exit(0);
    }
}

static server_t *serve_new(serve_config_t *cfg) {
    server_t *s = calloc(1, sizeof *s);
    s->cfg = *cfg;
    memset(cfg, 0, sizeof *cfg); /* owned by s now */
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->drop_mu, NULL);
    s->grammars = grammar_cache_new();
    pthread_cond_init(&s->cv, NULL);
    s->created = time(NULL);
    return s;
}

static void serve_free(server_t *s) {
    api_watch_stop(s);
    http_stop(s);
    pthread_mutex_lock(&s->mu); /* the loader thread's wake_engine sees NULL from here on */
    engine_t *dying = s->engine;
    s->engine = NULL;
    pthread_mutex_unlock(&s->mu);
    engine_free(dying);
    sched_free(s->sched);
    cost_model_free(s->cost);
    sched_slo_table_free(s->slos);
    lora_registry_free(s->reg);
    lora_assist_free(s->assist);
    chat_template_free(s->tmpl);
    grammar_cache_free(s->grammars);
    tokenizer_free(s->tok);
    model_free(s->model); /* NULL once the engine had it */
    free(s->weights_dir);
    backend_free(s->be);
    server_metrics_free(s);
    for (served_adapter_t *a = s->adapters, *nx; a; a = nx) {
        nx = a->next;
        free(a->name);
        free(a->path);
        free(a->waiters);
        free(a);
    }
    free(s->index);
    for (int i = 0; i < s->n_roots; i++) free(s->roots[i]);
    free(s->roots);
    for (int i = 0; i < s->n_resolve_dirs; i++) free(s->resolve_dirs[i]);
    free(s->resolve_dirs);
    keyring_unref(s->keys);
    astats_free(s);
    if (s->upload_dir && !s->cfg.adapter_upload_dir) /* ours (mkdtemp): uploads do not outlive the server */
        nftw(s->upload_dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    free(s->upload_dir);
    free(s->bos_token);
    free(s->eos_token);
    options_free(&s->cfg);
    server_drain_drops(s);
    free(s->drops);
    pthread_mutex_destroy(&s->drop_mu);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}

int cmd_serve(int argc, char **argv) {
    serve_config_t cfg;
    serve_modules_t m = {0};
    int rc = serve_parse(argc, argv, &cfg, &m);
    if (rc < 0 && pipe(sig_pipe)) {
        perror("caraserve serve: pipe");
        usage_serve(stderr);
        rc = 2;
    }
    if (rc >= 0) {
        serve_modules_free(&m);
        options_free(&cfg);
        return rc;
    }
    struct sigaction sa = {0};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    server_t *s = serve_new(&cfg);
    cs_dtype kv_dtype;
    rc = 1;
    if (!serve_prepare(s) && !serve_load_model(s) && !serve_make_engine(s, &kv_dtype) && !serve_start(s, &m)) {
        pthread_mutex_lock(&s->mu);
        s->ready = true;
        pthread_mutex_unlock(&s->mu);
        loading = 0;
        serve_say_ready(s, kv_dtype);
        serve_until_signal(s);
        rc = 0;
    }
    serve_free(s);
    serve_modules_free(&m);
    if (rc == 0) fprintf(stderr, "caraserve: stopped\n");
    return rc;
}
