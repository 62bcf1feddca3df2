/* weights.c: the base weights' routes (weights.h). An update names a Hugging Face directory
 * under --lora-root; it is checked (model_probe: config, every tensor, the files' sizes) and
 * compared with the served model (same architecture and shapes) before anything changes,
 * then loaded beside the old weights when memory allows, else in place (engine.h). SGLang's
 * and vLLM's RL routes that ask about the model, its version and its load live here too. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>

#include "config.h"
#include "rollout_api/weights.h"
#include "server/api_internal.h"

/* ---- the body's fields ---- */
static bool field_str(json_t *b, const char *k, const char **out, perr_t *e) {
    json_t *v = json_object_get(b, k);
    if (!v || json_is_null(v)) return true;
    if (!json_is_string(v)) return fail(e, 400, k, "'%s' must be a string", k);
    *out = json_string_value(v);
    return true;
}

static bool field_bool(json_t *b, const char *k, bool *out, perr_t *e) {
    json_t *v = json_object_get(b, k);
    if (!v || json_is_null(v)) return true;
    if (!json_is_boolean(v)) return fail(e, 400, k, "'%s' must be true or false", k);
    *out = json_is_true(v);
    return true;
}

static bool field_int(json_t *b, const char *k, int lo, int hi, int *out, perr_t *e) {
    json_t *v = json_object_get(b, k);
    if (!v || json_is_null(v)) return true;
    if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi)
        return fail(e, 400, k, "'%s' must be an integer from %d to %d", k, lo, hi);
    *out = (int)json_integer_value(v);
    return true;
}

/* bytes of DIR's safetensors files */
static size_t weights_bytes(const char *dir) {
    size_t n = 0;
    DIR *d = opendir(dir);
    for (struct dirent *de; d && (de = readdir(d));) {
        size_t l = strlen(de->d_name);
        if (l < 12 || strcmp(de->d_name + l - 12, ".safetensors")) continue;
        char *f = cs_path_join(dir, de->d_name);
        struct stat st;
        if (f && !stat(f, &st)) n += (size_t)st.st_size;
        free(f);
    }
    if (d) closedir(d);
    return n;
}

const char *const weights_apply_names[] = {"next_request", "abort_inflight", "pause_keep"};

/* One update: the body's fields in our names, done. On success *out is the answer. */
typedef struct weights_req {
    const char *path, *label, *mode, *apply;
    int keep;
    bool flush;
} weights_req_t;

static bool update(server_t *s, const weights_req_t *q, json_t **out, perr_t *e) {
    int apply = 0;
    if (q->apply) {
        while (apply < 3 && strcmp(q->apply, weights_apply_names[apply])) apply++;
        if (apply == 3) return fail(e, 400, "apply", "apply is next_request, abort_inflight or pause_keep");
    }
    const char *mode = q->mode ? q->mode : "auto";
    if (strcmp(mode, "auto") && strcmp(mode, "beside") && strcmp(mode, "in_place"))
        return fail(e, 400, "load", "load is auto, beside or in_place");
    if (!q->path || !q->path[0]) return fail(e, 400, "path", "the directory of the new weights is required");
    if (q->label && (!q->label[0] || strlen(q->label) >= ENGINE_LABEL_MAX))
        return fail(e, 400, "weight_version", "a weight version is 1 to %d bytes", ENGINE_LABEL_MAX - 1);
    char *dir = NULL;
    int st = weights_path_check(s, q->path, &dir, e);
    if (st) return false;
    double t0 = cs_time_ms();
    size_t bytes = weights_bytes(dir);
    /* beside when the memory holds both (the CPU's weights live in the process; a device's
     * free memory is not known here: in place unless asked) */
    const backend_caps_t *caps = backend_caps(s->be);
    size_t avail = caps->host_memory ? cs_mem_available() : 0;
    /* --precision int8 keeps a repacked copy of the quantized matrices beside them (about their
     * bytes again, on AVX512-VNNI CPUs) */
    size_t need = bytes + bytes / 4 + (s->cfg.precision == 2 ? bytes : 0) + ((size_t)256 << 20);
    bool beside = !strcmp(mode, "beside") || (!strcmp(mode, "auto") && avail > need);
    /* a load beside runs while the engine serves, except where the backend's loading uses what
     * its forwards use (the CPU's weight coding and int8 repacking run the compute pool; a
     * device's copies its queue): then the engine holds still for the load */
    bool hold = beside && (!caps->host_memory || s->cfg.compress_weights || s->cfg.compress_weights_only ||
                           s->cfg.precision == 2);
    engine_base_update_t u = {.dir = dir, .how = s->cfg.weights_mem, .label = q->label, .apply = (engine_apply)apply,
                              .keep_versions = q->keep};
    double held_ms = 0;
    if (beside) {
        model_config_t nc;
        char why[320];
        int rc = model_probe(dir, &nc); /* before the load: a refusal costs no memory */
        if (!rc && model_config_compatible(&s->mcfg, &nc, why, sizeof why))
            rc = cs_error_set(CS_ESHAPE, "%s cannot replace the served weights: %s", dir, why);
        if (rc) {
            fail(e, 400, "path", "%s", cs_error_last());
            free(dir);
            return false;
        }
        double th = cs_time_ms();
        if (hold) engine_set_pause(s->engine, ENGINE_PAUSE_HOLD);
        rc = model_load_how(dir, s->be, s->cfg.weights_mem, &u.model);
        if (!rc) model_set_assist(u.model, s->assist);
        if (hold) {
            pthread_mutex_lock(&s->mu);
            bool paused = s->paused;
            pthread_mutex_unlock(&s->mu);
            if (!paused) engine_set_pause(s->engine, ENGINE_RUN);
            held_ms = cs_time_ms() - th;
        }
        if (rc) {
            fail(e, rc == CS_ENOMEM ? 507 : 400, "path", "%s: %s", dir, cs_error_last());
            free(dir);
            return false;
        }
    }
    engine_base_result_t res;
    int rc = engine_update_base(s->engine, &u, &res);
    if (rc) {
        fail(e, rc == CS_ENOMEM ? 507 : res.version ? 500 : 400, "path", "%s", cs_error_last());
        free(dir);
        return false;
    }
    if (q->flush) engine_flush_prefix_cache(s->engine);
    pthread_mutex_lock(&s->mu);
    free(s->weights_dir);
    s->weights_dir = dir;
    pthread_mutex_unlock(&s->mu);
    engine_base_info_t bi;
    engine_base_versions(s->engine, &bi, 1);
    *out = json_pack("{s:i, s:s, s:s, s:s, s:I, s:f, s:f, s:i, s:i}", "version", res.version, "weight_version", bi.label,
                     "path", bi.dir, "load", res.in_place ? "in_place" : "beside", "bytes", (json_int_t)bytes,
                     "load_ms", cs_time_ms() - t0, "pause_ms", res.pause_ms + held_ms, "moved_requests", res.moved,
                     "aborted_requests", res.aborted);
    return *out != NULL || fail(e, 500, NULL, "out of memory");
}

/* ---- our routes ---- */
/* POST /v1/weights {path, weight_version, apply, load, keep_versions, flush_cache} */
enum MHD_Result weights_route_update(server_t *s, struct MHD_Connection *c, json_t *b) {
    perr_t e = {0};
    weights_req_t q = {.keep = 1};
    if (!field_str(b, "path", &q.path, &e) || !field_str(b, "weight_version", &q.label, &e) ||
        !field_str(b, "apply", &q.apply, &e) || !field_str(b, "load", &q.mode, &e) ||
        !field_int(b, "keep_versions", 1, 16, &q.keep, &e) || !field_bool(b, "flush_cache", &q.flush, &e))
        return reply_err(c, &e);
    json_t *out = NULL;
    if (!update(s, &q, &out, &e)) return reply_err(c, &e);
    return http_json(c, 200, out);
}

/* GET /v1/weights: the versions held, the active one first */
enum MHD_Result weights_route_list(server_t *s, struct MHD_Connection *c) {
    engine_base_info_t bi[32];
    int n = CS_MIN(engine_base_versions(s->engine, bi, 32), 32);
    json_t *a = json_array();
    for (int i = 0; i < n; i++)
        json_array_append_new(a, json_pack("{s:i, s:s, s:s, s:b, s:b, s:i}", "version", bi[i].version, "weight_version",
                                           bi[i].label, "path", bi[i].dir, "active", bi[i].active, "kept", bi[i].kept,
                                           "inflight", bi[i].requests));
    return http_json(c, 200, json_pack("{s:o}", "versions", a));
}

/* ---- SGLang's ---- */
/* POST /update_weights_from_disk {model_path, load_format, weight_version, abort_all_requests,
 * flush_cache, ...} -> {success, message, num_paused_requests}; 400 with success false */
enum MHD_Result weights_route_sgl_update(server_t *s, struct MHD_Connection *c, json_t *b) {
    perr_t e = {0};
    weights_req_t q = {.keep = 1, .flush = true};
    const char *fmt = NULL;
    bool abort_all = false;
    if (!field_str(b, "model_path", &q.path, &e) || !field_str(b, "weight_version", &q.label, &e) ||
        !field_str(b, "load_format", &fmt, &e) || !field_bool(b, "abort_all_requests", &abort_all, &e) ||
        !field_bool(b, "flush_cache", &q.flush, &e))
        goto refused;
    if (fmt && strcmp(fmt, "auto") && strcmp(fmt, "safetensors")) {
        fail(&e, 400, "load_format", "load_format '%s': the weights are read as safetensors (auto)", fmt);
        goto refused;
    }
    q.apply = abort_all ? "abort_inflight" : "next_request";
    json_t *out = NULL;
    if (!update(s, &q, &out, &e)) goto refused;
    char msg[512] = "Succeeded to update model weights.";
    if (q.label) snprintf(msg + strlen(msg), sizeof msg - strlen(msg), " Weight version updated to %s.", q.label);
    json_t *ans = json_pack("{s:b, s:s, s:i}", "success", 1, "message", msg, "num_paused_requests", 0);
    json_object_update_missing(ans, out);
    json_decref(out);
    return http_json(c, 200, ans);
refused: /* SGLang answers every failure 400 */
    return http_json(c, 400,
                     json_pack("{s:b, s:s, s:i}", "success", 0, "message", e.msg, "num_paused_requests", 0));
}

/* GET /get_weight_version -> {"weight_version": LABEL} */
enum MHD_Result weights_route_sgl_version(server_t *s, struct MHD_Connection *c) {
    engine_base_info_t bi;
    engine_base_versions(s->engine, &bi, 1);
    return http_json(c, 200, json_pack("{s:s}", "weight_version", bi.label));
}

/* POST /update_weight_version {new_version, abort_all_requests (true)} -> {success, message, new_version} */
enum MHD_Result weights_route_sgl_set_version(server_t *s, struct MHD_Connection *c, json_t *b) {
    perr_t e = {0};
    const char *nv = NULL;
    bool abort_all = true;
    if (!field_str(b, "new_version", &nv, &e) || !field_bool(b, "abort_all_requests", &abort_all, &e))
        return reply_err(c, &e);
    if (!nv || !nv[0] || strlen(nv) >= ENGINE_LABEL_MAX)
        return http_error(c, 400, "new_version", "'new_version' is a string of 1 to %d bytes", ENGINE_LABEL_MAX - 1);
    if (abort_all) api_abort_all(s);
    engine_base_relabel(s->engine, nv);
    char msg[256];
    snprintf(msg, sizeof msg, "Weight version updated to %s", nv);
    return http_json(c, 200, json_pack("{s:b, s:s, s:s}", "success", 1, "message", msg, "new_version", nv));
}

/* GET /get_model_info */
enum MHD_Result weights_route_sgl_model_info(server_t *s, struct MHD_Connection *c) {
    engine_base_info_t bi;
    engine_base_versions(s->engine, &bi, 1);
    pthread_mutex_lock(&s->mu);
    json_t *path = json_string(s->weights_dir ? s->weights_dir : s->cfg.model);
    pthread_mutex_unlock(&s->mu);
    return http_json(c, 200, json_pack("{s:o, s:s, s:b, s:n, s:s, s:b, s:b, s:s, s:[s]}", "model_path", path,
                                       "tokenizer_path", s->cfg.model, "is_generation", 1, "preferred_sampling_params",
                                       "weight_version", bi.label, "has_image_understanding", 0,
                                       "has_audio_understanding", 0, "model_type", "llama", "architectures",
                                       s->mcfg.arch_name));
}

/* GET /get_server_info: the arguments that matter to a client, and the version */
enum MHD_Result weights_route_sgl_server_info(server_t *s, struct MHD_Connection *c) {
    engine_base_info_t bi;
    engine_base_versions(s->engine, &bi, 1);
    engine_stats_t st;
    engine_get_stats(s->engine, &st);
    json_t *o = json_pack("{s:s, s:s, s:s, s:i, s:i, s:i, s:b, s:s, s:s, s:I}", "model_path", s->cfg.model,
                          "tokenizer_path", s->cfg.model, "served_model_name", s->model_name, "context_length",
                          s->max_model_len, "max_running_requests", s->cfg.max_num_seqs > 0 ? s->cfg.max_num_seqs : 256,
                          "chunked_prefill_size", s->cfg.max_num_batched_tokens > 0 ? s->cfg.max_num_batched_tokens : 2048,
                          "enable_lora", 1, "version", PACKAGE_VERSION, "weight_version", bi.label,
                          "max_total_num_tokens", (json_int_t)st.kv.n_blocks * KV_BLOCK_SIZE);
    json_object_set_new(o, "internal_states", json_pack("[{s:s, s:i}]", "weight_version", bi.label, "num_running_reqs",
                                                        st.n_running));
    return http_json(c, 200, o);
}

/* GET /v1/loads[?include=...&dp_rank=...]: the engine's load in SGLang's shape, one rank */
enum MHD_Result weights_route_sgl_loads(server_t *s, struct MHD_Connection *c) {
    const char *inc = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "include");
    const char *fmt = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "format");
    const char *dpr = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "dp_rank");
    static const char *const sections = ",core,memory,spec,lora,disagg,queues,all,";
    if (inc) {
        char *dup = strdup(inc), *save = NULL;
        for (char *t = strtok_r(dup, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
            char w[48];
            snprintf(w, sizeof w, ",%.40s,", t);
            if (!strstr(sections, w)) {
                free(dup);
                return http_error(c, 400, "include", "include takes core, memory, spec, lora, disagg, queues or all");
            }
        }
        free(dup);
    }
    if (fmt && strcmp(fmt, "json")) return http_error(c, 400, "format", "format is json (Prometheus text is at /metrics)");
    if (dpr && strcmp(dpr, "0")) return http_error(c, 400, "dp_rank", "this server is one rank: dp_rank 0");
    engine_stats_t st;
    engine_get_stats(s->engine, &st);
    size_t used = (size_t)(st.kv.n_blocks - st.kv.n_free - st.kv.n_cached) * KV_BLOCK_SIZE;
    size_t total = (size_t)st.kv.n_blocks * KV_BLOCK_SIZE;
    double usage = total ? (double)used / (double)total : 0.0;
    int max_running = s->cfg.max_num_seqs > 0 ? s->cfg.max_num_seqs : 256;
    double hit = st.prompt_tokens ? (double)st.cached_prompt_tokens / (double)st.prompt_tokens : 0.0;
    json_t *one = json_pack("{s:i, s:i, s:i, s:I, s:I, s:I, s:f, s:f, s:f, s:f, s:i, s:i}", "dp_rank", 0,
                            "num_running_reqs", st.n_running, "num_waiting_reqs", st.n_waiting, "num_used_tokens",
                            (json_int_t)used, "num_total_tokens", (json_int_t)used, "max_total_num_tokens",
                            (json_int_t)total, "token_usage", usage, "gen_throughput", 0.0, "cache_hit_rate", hit,
                            "utilization", (double)st.n_running / max_running, "max_running_requests", max_running,
                            "num_total_reqs", st.n_running + st.n_waiting);
    char ts[40];
    time_t now = time(NULL);
    struct tm tm;
    strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%SZ", gmtime_r(&now, &tm));
    return http_json(c, 200, json_pack("{s:s, s:s, s:i, s:[o], s:{s:i, s:i, s:i, s:f, s:f, s:f}}", "timestamp", ts,
                                       "version", PACKAGE_VERSION, "dp_rank_count", 1, "loads", one, "aggregate",
                                       "total_running_reqs", st.n_running, "total_waiting_reqs", st.n_waiting,
                                       "total_reqs", st.n_running + st.n_waiting, "avg_token_usage", usage,
                                       "avg_throughput", 0.0, "avg_utilization", (double)st.n_running / max_running));
}

/* POST /update_weights_from_tensor, /update_weights_from_distributed, /init_weights_update_group,
 * ...: torch-serialized tensors and NCCL groups, which this server does not speak: 501 */
enum MHD_Result weights_route_unspeakable(server_t *s, struct MHD_Connection *c, const char *url) {
    (void)s;
    char msg[768];
    snprintf(msg, sizeof msg,
             "POST %s takes torch-serialized tensors or an NCCL group, which caraserve does not speak: save the "
             "weights as safetensors and call POST /update_weights_from_disk (or POST /v1/weights), or push a LoRA "
             "with PUT /v1/adapters/NAME/versions/V",
             url);
    return http_json(c, 501, json_pack("{s:b, s:s, s:{s:s, s:s, s:i}}", "success", 0, "message", msg, "error", "message",
                                       msg, "type", "NotImplementedError", "code", 501));
}

/* ---- GET /health_generate: one token generated, or 503 ---- */
typedef struct probe {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done, ok;
} probe_t;

static void probe_sink(void *user, const engine_event_t *ev) {
    probe_t *p = user;
    if (!ev->request_done) return;
    pthread_mutex_lock(&p->mu);
    p->done = true;
    p->ok = ev->finish == ENGINE_FINISH_LENGTH || ev->finish == ENGINE_FINISH_STOP;
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

enum MHD_Result weights_route_health_generate(server_t *s, struct MHD_Connection *c) {
    pthread_mutex_lock(&s->mu);
    bool paused = s->paused, draining = s->draining, sleeping = s->sleeping;
    pthread_mutex_unlock(&s->mu);
    if (draining) return http_error(c, 503, NULL, "shutting down");
    if (sleeping && engine_sleeping(s->engine)) return http_error(c, 503, NULL, "asleep (POST /wake_up)");
    if (paused) return http_text(c, 200, "text/plain; charset=utf-8", strdup(""), 0); /* as SGLang: paused is healthy */
    probe_t *p = calloc(1, sizeof *p); /* the engine may call the sink after a timeout here: it leaks then */
    if (!p) return http_error(c, 500, NULL, "out of memory");
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    int32_t tok = 0;
    engine_request_t q = {.prompt = &tok, .n_prompt = 1, .max_tokens = 1, .ignore_eos = true, .sink = probe_sink, .user = p};
    sampling_params_default(&q.sampling);
    q.sampling.temperature = 0;
    uint64_t id;
    if (engine_submit(s->engine, &q, &id)) {
        free(p);
        return http_error(c, 503, NULL, "the engine refused a request: %s", cs_error_last());
    }
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += 20;
    pthread_mutex_lock(&p->mu);
    while (!p->done && pthread_cond_timedwait(&p->cv, &p->mu, &dl) == 0) {}
    bool done = p->done, ok = p->ok;
    pthread_mutex_unlock(&p->mu);
    if (!done) {
        engine_abort(s->engine, id); /* its last event still comes: p stays for it */
        return http_error(c, 503, NULL, "no token was generated within 20 s");
    }
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p);
    return ok ? http_text(c, 200, "text/plain; charset=utf-8", strdup(""), 0)
              : http_error(c, 503, NULL, "the generation failed");
}
