/* routes.c: the rollout API's HTTP routes (routes.h), the server's side of rollout.c: POST
 * /v1/rollout runs a rollout batch as a job of the server (server/api_jobs.c) and streams or
 * collects its lines; SGLang's /generate and /abort_request are translated to and from it;
 * /v1/pause and /v1/resume hold the engine; the versioned adapters are uploaded (or named
 * under --lora-root), activated, listed and deleted here, and the files of the uploads the
 * registry drops are deleted here too. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/safetensors.h"
#include "lora/peft.h"
#include "rollout_api/routes.h"
#include "text/grammar/grammar.h"
#include "server/api_fields.h"
#include "server/api_internal.h"

/* ---- POST /v1/rollout (rollout.c), as a job (server/api_jobs.c) ---- */
/* a finished group (or, last, the summary): engine thread */
static void ro_emit(void *user, json_t *line, bool last) {
    gen_job_t *j = user;
    pthread_mutex_lock(&j->mu);
    if (j->stream) {
        api_frame(&j->out, line, true);
        json_decref(line);
    } else if (last) {
        j->ro_summary = line;
    } else {
        json_array_append_new(j->ro_groups, line);
    }
    if (last) j->finished = true;
    bool resume = take_resume(j);
    struct MHD_Connection *conn = j->conn;
    pthread_mutex_unlock(&j->mu);
    if (resume) MHD_resume_connection(conn);
    if (last) job_unref(j); /* the rollout's reference */
}

/* the rollout's metrics taps: the same series as completions, labelled by adapter */
static void ro_obs_token(void *user, const char *adapter, double ttft_s, double itl_s) {
    server_t *s = user;
    astats_token(s, adapter ? adapter : s->model_name, ttft_s, itl_s);
}

static void ro_obs_done(void *user, const char *adapter, int n_prompt, const char *finish, double e2e_s, double queue_s) {
    server_t *s = user;
    astats_done(s, adapter ? adapter : s->model_name, n_prompt, finish, e2e_s, queue_s);
}

static void ro_obs_slo(void *user, const char *adapter, bool met) {
    server_t *s = user;
    astats_slo(s, adapter ? adapter : s->model_name, adapter, met);
}

/* a group's model: one the request's key may use (another's is answered as the engine
 * answers an adapter it does not know), registered from --lora-resolve if it is not yet */
static int ro_adapter_check(void *user, const char *name) {
    conn_t *cn = user;
    server_t *s = cn->srv;
    if (!name) return api_may_use(cn, NULL) ? CS_OK : cs_error_set(CS_ENOTFOUND, "The model `%s` does not exist.", s->model_name);
    if (!api_may_use(cn, name)) return cs_error_set(CS_ENOTFOUND, "adapter '%s' is not registered", name);
    pthread_mutex_lock(&s->mu);
    bool known = adapter_find(s, name) != NULL;
    pthread_mutex_unlock(&s->mu);
    if (known || !server_resolve_adapter(s, name)) return CS_OK;
    return cs_error_set(CS_ENOTFOUND, "adapter '%s' is not registered", name);
}

/* A /generate request's error in SGLang's names: the rollout's sampling.max_tokens is
 * sampling_params.max_new_tokens there, sampling.X is sampling_params.X. */
/* a group's structured_outputs (vLLM's form) as the OpenAI routes compile it */
static int ro_compile(void *user, json_t *spec, struct grammar **g) {
    perr_t e = {0};
    json_t *b = json_pack("{s:O}", "structured_outputs", spec);
    bool ok = b && api_structured(user, b, g, &e);
    json_decref(b);
    if (ok && !*g) return cs_error_set(CS_EINVAL, "'structured_outputs' names no constraint");
    return ok ? CS_OK : cs_error_set(e.status >= 500 ? CS_ENOMEM : CS_EINVAL, "%s", e.msg);
}

static enum MHD_Result generate_error(struct MHD_Connection *c, unsigned status, const char *param, const char *msg) {
    static const char *const names[][2] = {{"sampling.max_tokens", "sampling_params.max_new_tokens"},
                                           {"sampling.min_tokens", "sampling_params.min_new_tokens"},
                                           {"sampling.", "sampling_params."}};
    cs_buf_t b = {0};
    for (const char *p = msg; *p;) {
        size_t k = 0;
        while (k < 3 && strncmp(p, names[k][0], strlen(names[k][0]))) k++;
        if (k < 3) {
            cs_buf_add(&b, names[k][1], strlen(names[k][1]));
            p += strlen(names[k][0]);
        } else {
            cs_buf_add(&b, p++, 1);
        }
    }
    enum MHD_Result r = http_error(c, status, param && !strcmp(param, "sampling") ? "sampling_params" : param, "%.*s",
                                   (int)b.len, b.p ? b.p : "");
    free(b.p);
    return r;
}

/* request b as a rollout batch, a job of this connection; sglang (stolen): answer in SGLang's
 * /generate shape instead */
static enum MHD_Result rollout_run(server_t *s, conn_t *cn, struct MHD_Connection *c, json_t *b, json_t *sglang) {
    bool draining;
    bool sglang_req = sglang != NULL;
    gen_job_t *j = job_new(s, false, 1, 1, &draining);
    if (!j) {
        json_decref(sglang);
        return http_error(c, draining ? 503 : 500, NULL, draining ? "the server is shutting down" : "out of memory");
    }
    j->t_arrival = cn->t_arrival;
    j->sglang = sglang;
    j->ro_groups = json_array();
    j->stream = json_is_true(json_object_get(b, "stream")); /* before any line can come */
    j->n_parts = 0; /* no engine requests of its own: job_start only sets up the response */
    j->refs++; /* the rollout's, dropped at its summary */
    rollout_limits_t lim = {.max_samples = s->cfg.max_n * 64, .max_logprobs = s->cfg.max_logprobs,
                            .base_name = s->model_name, .vocab = s->vocab_size,
                            .obs = {ro_obs_token, ro_obs_done, ro_obs_slo, s}, .slos = s->slos,
                            .compile = ro_compile, .compile_user = s, .tok = s->tok, .tool_format = s->tool_format,
                            .adapter_check = ro_adapter_check, .adapter_user = cn};
    rollout_request_t rq = {.body = b, .lim = &lim, .emit = ro_emit, .user = j};
    rollout_t *ro = NULL;
    int rc = rollout_start(s->engine, &rq, &ro);
    if (rc) { /* nothing was emitted and nothing will be */
        pthread_mutex_lock(&j->mu);
        j->refs--;
        pthread_mutex_unlock(&j->mu);
        job_unref(j);
        if (sglang_req) return generate_error(c, api_status_of(rc), rq.param, cs_error_last());
        return http_error(c, api_status_of(rc), rq.param, "%s", cs_error_last());
    }
    pthread_mutex_lock(&j->mu);
    j->ro = ro;
    pthread_mutex_unlock(&j->mu);
    gen_opts_t none = {0};
    return job_start(s, cn, c, j, &none);
}

enum MHD_Result rollout_route_rollout(server_t *s, conn_t *cn, struct MHD_Connection *c, json_t *b) {
    perr_t e = {0};
    json_t *st = json_object_get(b, "stream");
    if (st && !json_is_boolean(st) && !json_is_null(st)) return http_error(c, 400, "stream", "'stream' must be true or false");
    if (!api_fields_check(EP_ROLLOUT, b, &e)) return reply_err(c, &e);
    return rollout_run(s, cn, c, b, NULL);
}

/* POST /v1/rollout/abort {batch_id | group_ids | all} */
enum MHD_Result rollout_route_abort(server_t *s, struct MHD_Connection *c, json_t *b) {
    const char *bid = json_string_value(json_object_get(b, "batch_id"));
    json_t *gids = json_object_get(b, "group_ids");
    bool all = json_is_true(json_object_get(b, "all"));
    if (!bid && !json_is_array(gids) && !all)
        return http_error(c, 400, NULL, "say what to abort: 'batch_id', 'group_ids' or 'all': true");
    int n = 0;
    pthread_mutex_lock(&s->mu);
    for (gen_job_t *j = s->jobs; j; j = j->next) {
        pthread_mutex_lock(&j->mu);
        if (j->ro && !j->finished) {
            const char *jb = rollout_batch_id(j->ro);
            if (all || (bid && jb && !strcmp(jb, bid))) {
                rollout_abort(j->ro);
                n++;
            } else if (json_is_array(gids)) {
                n += rollout_abort_groups(j->ro, gids);
            }
        }
        pthread_mutex_unlock(&j->mu);
    }
    pthread_mutex_unlock(&s->mu);
    return http_json(c, 200, json_pack("{s:i}", "aborted", n));
}

/* vLLM's POST /abort_requests {"request_ids": [...]} (absent or empty: every request in
 * flight): the completions' and chats' ids, rollouts' batch ids -> {"status": "aborted",
 * "aborted": N} */
enum MHD_Result rollout_route_vllm_abort(server_t *s, struct MHD_Connection *c, const char *body, size_t len) {
    json_t *b = NULL;
    if (len) {
        json_error_t je;
        if (!(b = json_loadb(body, len, 0, &je)) || !json_is_object(b)) {
            json_decref(b);
            return http_error(c, 400, NULL, "Invalid JSON format");
        }
    }
    json_t *ids = json_object_get(b, "request_ids");
    if (ids && !json_is_null(ids) && !json_is_array(ids)) {
        json_decref(b);
        return http_error(c, 400, "request_ids", "'request_ids' must be a list of request ids");
    }
    size_t k;
    json_t *v;
    json_array_foreach(ids, k, v) if (!json_is_string(v)) {
        json_decref(b);
        return http_error(c, 400, "request_ids", "'request_ids' must be a list of request ids (strings)");
    }
    bool all = json_array_size(ids) == 0;
    int n = 0;
    pthread_mutex_lock(&s->mu);
    for (gen_job_t *j = s->jobs; j; j = j->next) {
        pthread_mutex_lock(&j->mu);
        bool hit = all;
        const char *jb = j->ro ? rollout_batch_id(j->ro) : NULL;
        json_array_foreach(ids, k, v) hit = hit || !strcmp(json_string_value(v), j->id) || (jb && !strcmp(json_string_value(v), jb));
        if (hit && !j->finished) {
            bool any = false;
            for (int i = 0; i < j->n_parts; i++)
                if (j->parts[i].submitted && !j->parts[i].done) { engine_abort(s->engine, j->parts[i].id); any = true; }
            if (j->ro) { rollout_abort(j->ro); any = true; }
            n += any;
        }
        pthread_mutex_unlock(&j->mu);
    }
    pthread_mutex_unlock(&s->mu);
    json_decref(b);
    return http_json(c, 200, json_pack("{s:s, s:i}", "status", "aborted", "aborted", n));
}

/* ---- SGLang's /generate and /abort_request (on the rollout) ---- */
/* SGLang's POST /generate: input_ids (or text; or lists of them), sampling_params,
 * return_logprob, lora_path (an adapter name), rid; answered in SGLang's shape */
enum MHD_Result rollout_route_generate(server_t *s, conn_t *cn, struct MHD_Connection *c, json_t *b) {
    json_t *ids = json_object_get(b, "input_ids"), *text = json_object_get(b, "text");
    perr_t e = {0};
    if (!api_fields_check(EP_GENERATE, b, &e)) return reply_err(c, &e);
    json_t *sp = json_object_get(b, "sampling_params"), *rl = json_object_get(b, "return_logprob");
    json_t *lp = json_object_get(b, "lora_path"), *ri = json_object_get(b, "rid");
    if (sp && !json_is_null(sp) && !json_is_object(sp))
        return http_error(c, 400, "sampling_params", "'sampling_params' must be an object");
    if (rl && !json_is_null(rl) && !json_is_boolean(rl))
        return http_error(c, 400, "return_logprob", "'return_logprob' must be true or false");
    if (lp && !json_is_null(lp) && !json_is_string(lp))
        return http_error(c, 400, "lora_path", "'lora_path' must be an adapter's name (a string)");
    if (ri && !json_is_null(ri) && !json_is_string(ri)) return http_error(c, 400, "rid", "'rid' must be a string");
    if (ids && !json_is_null(ids) && !json_is_array(ids))
        return http_error(c, 400, "input_ids", "'input_ids' must be a list of token ids, or a list of such lists");
    json_t *tln = json_object_get(b, "top_logprobs_num"), *rtl = json_object_get(b, "return_text_in_logprobs");
    json_t *seed = json_is_object(sp) ? json_object_get(sp, "sampling_seed") : NULL;
    json_t *sst = json_is_object(sp) ? json_object_get(sp, "skip_special_tokens") : NULL;
    json_t *nst = json_is_object(sp) ? json_object_get(sp, "no_stop_trim") : NULL;
    if (nst && !json_is_null(nst) && !json_is_boolean(nst))
        return http_error(c, 400, "sampling_params.no_stop_trim", "'sampling_params.no_stop_trim' must be true or false");
    if (tln && !json_is_null(tln) && (!json_is_integer(tln) || json_integer_value(tln) < 0 ||
                                      json_integer_value(tln) > s->cfg.max_logprobs))
        return http_error(c, 400, "top_logprobs_num", "'top_logprobs_num' must be an integer from 0 to %d",
                          s->cfg.max_logprobs);
    if (rtl && !json_is_null(rtl) && !json_is_boolean(rtl))
        return http_error(c, 400, "return_text_in_logprobs", "'return_text_in_logprobs' must be true or false");
    if (seed && !json_is_null(seed) && !json_is_integer(seed))
        return http_error(c, 400, "sampling_params.sampling_seed", "'sampling_params.sampling_seed' must be an integer");
    if (sst && !json_is_null(sst) && !json_is_boolean(sst))
        return http_error(c, 400, "sampling_params.skip_special_tokens",
                          "'sampling_params.skip_special_tokens' must be true or false");
    int top_n = json_is_integer(tln) ? (int)json_integer_value(tln) : 0;
    bool batch = false;
    json_t *prompts = json_array();
    if (ids && !json_is_null(ids)) {
        batch = json_is_array(ids) && json_array_size(ids) > 0 && json_is_array(json_array_get(ids, 0));
        if (batch) json_array_extend(prompts, ids);
        else json_array_append(prompts, ids);
    } else if (json_is_string(text) || json_is_array(text)) {
        batch = json_is_array(text);
        size_t i;
        json_t *t;
        json_t *texts = batch ? text : json_pack("[O]", text);
        json_array_foreach(texts, i, t) {
            int32_t *v = NULL;
            size_t n = 0;
            if (!json_is_string(t) || !s->tok || tokenizer_encode(s->tok, json_string_value(t), json_string_length(t), true, &v, &n)) {
                if (!batch) json_decref(texts);
                json_decref(prompts);
                return http_error(c, 400, "text", "'text' must be a string or a list of strings (and the model needs a tokenizer)");
            }
            json_t *a = json_array();
            for (size_t k = 0; k < n; k++) json_array_append_new(a, json_integer(v[k]));
            free(v);
            json_array_append_new(prompts, a);
        }
        if (!batch) json_decref(texts);
    } else {
        json_decref(prompts);
        return http_error(c, 400, "input_ids", "'input_ids' or 'text' is required");
    }
    json_t *samp = json_object();
    if (json_is_object(sp)) { /* SGLang's names -> the rollout's */
        static const char *const keys[][2] = {
            {"temperature", "temperature"}, {"top_p", "top_p"}, {"top_k", "top_k"}, {"min_p", "min_p"},
            {"repetition_penalty", "repetition_penalty"}, {"presence_penalty", "presence_penalty"},
            {"frequency_penalty", "frequency_penalty"}, {"stop", "stop"}, {"stop_token_ids", "stop_token_ids"},
            {"ignore_eos", "ignore_eos"}, {"min_new_tokens", "min_tokens"}, {"max_new_tokens", "max_tokens"}};
        for (size_t k = 0; k < sizeof keys / sizeof keys[0]; k++) {
            json_t *v = json_object_get(sp, keys[k][0]);
            if (v && !json_is_null(v)) json_object_set(samp, keys[k][1], v);
        }
    }
    if (!json_object_get(samp, "max_tokens")) json_object_set_new(samp, "max_tokens", json_integer(128)); /* SGLang's default */
    json_t *so = json_object(); /* SGLang's constraints, in vLLM's form */
    const char *so_field = NULL;
    if (json_is_object(sp)) {
        static const char *const cons[][2] = {{"json_schema", "json"}, {"regex", "regex"}, {"ebnf", "grammar"}};
        for (size_t k = 0; k < 3; k++) {
            json_t *v = json_object_get(sp, cons[k][0]);
            if (!v || json_is_null(v)) continue;
            json_object_set(so, cons[k][1], v);
            so_field = cons[k][0];
        }
    }
    if (json_object_size(so)) { /* refused here, so the error names SGLang's field */
        struct grammar *g = NULL;
        char field[64];
        snprintf(field, sizeof field, "sampling_params.%s", so_field);
        int crc = ro_compile(s, so, &g);
        grammar_unref(g);
        if (crc) {
            json_decref(so);
            json_decref(samp);
            json_decref(prompts);
            return generate_error(c, api_status_of(crc), field, cs_error_last());
        }
    }
    json_object_set_new(samp, "logprobs", json_pack("{s:s, s:i}", "mode", "raw", "top_k", top_n));
    const char *rid = json_string_value(json_object_get(b, "rid"));
    json_t *groups = json_array();
    size_t i;
    json_t *p;
    json_array_foreach(prompts, i, p) {
        char gid[300];
        snprintf(gid, sizeof gid, "%s%s%zu", rid ? rid : "", rid ? "-" : "", i);
        if (!batch && rid) snprintf(gid, sizeof gid, "%s", rid);
        json_t *g = json_pack("{s:s, s:O}", "group_id", gid, "input_ids", p);
        if (json_is_integer(seed)) json_object_set(g, "seed", seed);
        json_array_append_new(groups, g);
    }
    json_decref(prompts);
    json_t *req = json_pack("{s:o, s:o}", "groups", groups, "sampling", samp);
    if (json_object_size(so)) json_object_set(req, "structured_outputs", so);
    json_decref(so);
    const char *lora = json_string_value(json_object_get(b, "lora_path"));
    if (lora) json_object_set_new(req, "adapter", json_string(lora));
    if (rid) json_object_set_new(req, "batch_id", json_string(rid));
    json_t *stops = json_is_object(sp) ? json_object_get(sp, "stop") : NULL;
    json_t *sg = json_pack("{s:b, s:b, s:i, s:b, s:b, s:b}", "batch", batch, "return_logprob",
                           json_is_true(json_object_get(b, "return_logprob")), "top_logprobs_num", top_n,
                           "text_in_logprobs", json_is_true(rtl), "skip_special", !json_is_false(sst), "no_stop_trim",
                           json_is_true(nst));
    if (json_is_string(stops)) json_object_set_new(sg, "stop", json_pack("[O]", stops));
    else if (json_is_array(stops)) json_object_set(sg, "stop", stops);
    enum MHD_Result r = rollout_run(s, cn, c, req, sg);
    json_decref(req);
    return r;
}

/* a logprob entry's third element: the token's text (return_text_in_logprobs), else null */
static json_t *token_text(server_t *s, json_t *id, bool want) {
    int32_t t = (int32_t)json_integer_value(id);
    char *text = NULL;
    size_t n = 0;
    if (!want || !s->tok || tokenizer_decode(s->tok, &t, 1, false, &text, &n)) return json_null();
    json_t *o = jstr(text, n);
    free(text);
    return o;
}

/* SGLang's /generate answer from the rollout's groups (one sample per prompt, in order) */
json_t *rollout_route_sglang_json(server_t *s, gen_job_t *j) {
    json_t *list = json_array();
    bool lp = json_is_true(json_object_get(j->sglang, "return_logprob"));
    bool tl_text = json_is_true(json_object_get(j->sglang, "text_in_logprobs"));
    bool skip = !json_is_false(json_object_get(j->sglang, "skip_special"));
    int top_n = (int)json_integer_value(json_object_get(j->sglang, "top_logprobs_num"));
    size_t gi;
    json_t *g;
    json_array_foreach(j->ro_groups, gi, g) {
        json_t *samples = json_object_get(g, "samples");
        size_t si;
        json_t *sm;
        json_array_foreach(samples, si, sm) {
            json_t *ids = json_object_get(sm, "output_ids");
            size_t n = json_array_size(ids);
            int32_t *v = malloc(sizeof(int32_t) * (n + 1));
            for (size_t k = 0; k < n; k++) v[k] = (int32_t)json_integer_value(json_array_get(ids, k));
            char *text = NULL;
            size_t tl = 0;
            if (s->tok) tokenizer_decode(s->tok, v, n, skip, &text, &tl);
            free(v);
            const char *fin = json_string_value(json_object_get(sm, "finish_reason"));
            /* SGLang's finish_reason: the stop string matched (the text trimmed before it unless
             * no_stop_trim), the stop or EOS token, or the length */
            json_t *why = json_pack("{s:s}", "type", fin);
            const char *cut = NULL, *matched = NULL;
            size_t si2;
            json_t *st;
            json_array_foreach(json_object_get(j->sglang, "stop"), si2, st) {
                const char *f = text && !strcmp(fin, "stop") && json_string_length(st) ? strstr(text, json_string_value(st)) : NULL;
                if (f && (!cut || f < cut)) { cut = f; matched = json_string_value(st); }
            }
            if (matched) json_object_set_new(why, "matched", json_string(matched));
            else if (!strcmp(fin, "stop") && n) json_object_set(why, "matched", json_array_get(ids, n - 1));
            else if (!strcmp(fin, "length")) json_object_set_new(why, "length", json_integer((json_int_t)n));
            if (cut && !json_is_true(json_object_get(j->sglang, "no_stop_trim"))) tl = (size_t)(cut - text);
            char wv[ENGINE_LABEL_MAX]; /* SGLang's weight_version: the base weights' name */
            engine_base_label(s->engine, (int)json_integer_value(json_object_get(sm, "base_version")), wv, sizeof wv);
            json_t *meta = json_pack("{s:s, s:o, s:O, s:I, s:O, s:s, s:O}", "id",
                                     json_string_value(json_object_get(g, "group_id")), "finish_reason", why,
                                     "prompt_tokens", json_object_get(g, "prompt_len"), "completion_tokens",
                                     (json_int_t)n, "cached_tokens", json_object_get(g, "cached_prompt_tokens"),
                                     "weight_version", wv, "adapter_version", json_object_get(sm, "adapter_version"));
            if (lp) {
                json_t *otl = json_array(), *lps = json_object_get(sm, "logprobs");
                for (size_t k = 0; k < n; k++)
                    json_array_append_new(otl, json_pack("[O, O, o]", json_array_get(lps, k), json_array_get(ids, k),
                                                         token_text(s, json_array_get(ids, k), tl_text)));
                json_object_set_new(meta, "output_token_logprobs", otl);
                if (top_n > 0) { /* per token [[logprob, id, text], ...], as SGLang's output_top_logprobs */
                    json_t *ot = json_array(), *tops = json_object_get(sm, "top_logprobs");
                    size_t k;
                    json_t *row;
                    json_array_foreach(tops, k, row) {
                        json_t *r = json_array();
                        size_t q;
                        json_t *pair;
                        json_array_foreach(row, q, pair)
                            json_array_append_new(r, json_pack("[O, O, o]", json_array_get(pair, 1), json_array_get(pair, 0),
                                                               token_text(s, json_array_get(pair, 0), tl_text)));
                        json_array_append_new(ot, r);
                    }
                    json_object_set_new(meta, "output_top_logprobs", ot);
                }
            }
            json_array_append_new(list, json_pack("{s:o, s:O, s:o}", "text", jstr(text ? text : "", tl), "output_ids", ids,
                                                  "meta_info", meta));
            free(text);
        }
    }
    if (json_is_true(json_object_get(j->sglang, "batch"))) return list;
    json_t *one = json_incref(json_array_get(list, 0));
    json_decref(list);
    return one;
}

/* SGLang's POST /abort_request {rid | abort_all} */
enum MHD_Result rollout_route_abort_request(server_t *s, struct MHD_Connection *c, json_t *b) {
    json_t *q = json_is_true(json_object_get(b, "abort_all")) ? json_pack("{s:b}", "all", 1)
                                                              : json_pack("{s:O}", "batch_id", json_object_get(b, "rid"));
    enum MHD_Result r = rollout_route_abort(s, c, q);
    json_decref(q);
    return r;
}

/* ---- pause and resume: /v1/pause, /v1/resume and SGLang's and vLLM's names ---- */
/* Pause in mode "abort" | "wait" | "keep": new requests are accepted and wait. keep: running
 * ones stop where they are (KV kept) and go on after a resume; wait: running ones finish
 * first (the answer comes then); abort: running ones end now as aborted and return their
 * partial output. false: an unknown mode. */
static bool pause_as(server_t *s, const char *mode) {
    if (!strcmp(mode, "keep")) {
        engine_set_pause(s->engine, ENGINE_PAUSE_HOLD);
    } else if (!strcmp(mode, "abort")) {
        engine_set_pause(s->engine, ENGINE_PAUSE_NO_ADMIT);
        api_abort_all(s);
        engine_set_pause(s->engine, ENGINE_PAUSE_HOLD);
    } else if (!strcmp(mode, "wait")) {
        engine_set_pause(s->engine, ENGINE_PAUSE_NO_ADMIT);
        for (;;) { /* the running ones finish (bounded by their max_tokens) */
            engine_stats_t st;
            engine_get_stats(s->engine, &st);
            if (st.n_running == 0) break;
            usleep(10000);
        }
        engine_set_pause(s->engine, ENGINE_PAUSE_HOLD);
    } else {
        return false;
    }
    pthread_mutex_lock(&s->mu);
    s->paused = true;
    pthread_mutex_unlock(&s->mu);
    return true;
}

static void resume(server_t *s) {
    engine_set_pause(s->engine, ENGINE_RUN);
    pthread_mutex_lock(&s->mu);
    s->paused = false;
    pthread_mutex_unlock(&s->mu);
}

/* POST /v1/pause {"mode": "abort"|"wait"|"keep"} (default keep) */
enum MHD_Result rollout_route_pause(server_t *s, struct MHD_Connection *c, json_t *b) {
    const char *mode = json_string_value(json_object_get(b, "mode"));
    if (!mode) mode = "keep";
    double t0 = cs_time_ms();
    if (!pause_as(s, mode)) return http_error(c, 400, "mode", "mode is \"abort\", \"wait\" or \"keep\"");
    return http_json(c, 200, json_pack("{s:b, s:s, s:f}", "paused", 1, "mode", mode, "took_ms", cs_time_ms() - t0));
}

enum MHD_Result rollout_route_resume(server_t *s, struct MHD_Connection *c) {
    resume(s);
    return http_json(c, 200, json_pack("{s:b}", "paused", 0));
}

/* vLLM's POST /pause?mode=abort|wait|keep (default abort; with clear_cache=true, the default,
 * abort and wait then empty the prefix cache) -> {"status": "paused"} */
enum MHD_Result rollout_route_vllm_pause(server_t *s, struct MHD_Connection *c) {
    const char *mode = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "mode");
    const char *cc = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "clear_cache");
    if (cc && strcasecmp(cc, "true") && strcasecmp(cc, "false"))
        return http_error(c, 400, "clear_cache", "clear_cache is true or false");
    if (!pause_as(s, mode ? mode : "abort")) return http_error(c, 400, "mode", "mode is abort, wait or keep");
    if ((!cc || !strcasecmp(cc, "true")) && strcmp(mode ? mode : "abort", "keep"))
        engine_flush_prefix_cache(s->engine); /* vLLM clears it after draining, not for keep */
    return http_json(c, 200, json_pack("{s:s}", "status", "paused"));
}

/* vLLM's POST /sleep?level=0|1|2&mode=abort|wait|keep: paused as mode says (default abort),
 * then level 1 gives the KV cache's memory back, level 2 the weights' too (engine_sleep); an
 * empty 200 */
enum MHD_Result rollout_route_sleep(server_t *s, struct MHD_Connection *c) {
    const char *ls = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "level");
    const char *mode = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "mode");
    int level = 1;
    if (ls) {
        char *end;
        long v = strtol(ls, &end, 10);
        if (*end || end == ls || v < 0 || v > 2) return http_error(c, 400, "level", "level is 0, 1 or 2");
        level = (int)v;
    }
    if (mode && strcmp(mode, "abort") && strcmp(mode, "wait") && strcmp(mode, "keep"))
        return http_error(c, 400, "mode", "mode is abort, wait or keep");
    pthread_mutex_lock(&s->mu);
    bool asleep = s->sleeping;
    s->sleeping = true;
    pthread_mutex_unlock(&s->mu);
    if (!asleep) pause_as(s, mode ? mode : "abort");
    if (engine_sleep(s->engine, level)) return http_error(c, 500, NULL, "%s", cs_error_last());
    return http_text(c, 200, "text/plain; charset=utf-8", strdup(""), 0);
}

typedef struct wake_tags { bool weights, kv, bad; } wake_tags_t;

static enum MHD_Result wake_tag(void *cls, enum MHD_ValueKind kind, const char *key, const char *value) {
    (void)kind;
    wake_tags_t *t = cls;
    if (strcmp(key, "tags")) return MHD_YES;
    if (value && !strcmp(value, "weights")) t->weights = true;
    else if (value && !strcmp(value, "kv_cache")) t->kv = true;
    else if (!value || strcmp(value, "scheduling")) t->bad = true;
    return MHD_YES;
}

/* vLLM's POST /wake_up[?tags=weights&tags=kv_cache]: what sleep freed comes back (no tags:
 * all of it); awake once both are back, and then the engine runs again */
enum MHD_Result rollout_route_wake_up(server_t *s, struct MHD_Connection *c) {
    wake_tags_t t = {0};
    MHD_get_connection_values(c, MHD_GET_ARGUMENT_KIND, wake_tag, &t);
    if (t.bad) return http_error(c, 400, "tags", "tags are weights, kv_cache and scheduling");
    if (!t.weights && !t.kv) t.weights = t.kv = true;
    if (engine_wake_up(s->engine, t.weights, t.kv)) return http_error(c, 500, NULL, "%s", cs_error_last());
    pthread_mutex_lock(&s->mu);
    bool was = s->sleeping, awake = !engine_sleeping(s->engine);
    if (awake) s->sleeping = false;
    pthread_mutex_unlock(&s->mu);
    if (was && awake) resume(s);
    return http_text(c, 200, "text/plain; charset=utf-8", strdup(""), 0);
}

/* vLLM's GET /is_sleeping -> {"is_sleeping": bool} */
enum MHD_Result rollout_route_is_sleeping(server_t *s, struct MHD_Connection *c) {
    pthread_mutex_lock(&s->mu);
    bool asleep = s->sleeping;
    pthread_mutex_unlock(&s->mu);
    return http_json(c, 200, json_pack("{s:b}", "is_sleeping", asleep));
}

/* SGLang's GET or POST /flush_cache: the prefix cache emptied (running requests keep their
 * blocks; SGLang refuses while requests run, which is not needed here) */
enum MHD_Result rollout_route_flush_cache(server_t *s, struct MHD_Connection *c) {
    engine_flush_prefix_cache(s->engine);
    static const char msg[] = "Cache flushed.\n";
    return http_text(c, 200, "text/plain; charset=utf-8", strdup(msg), sizeof msg - 1);
}

/* vLLM's POST /reset_prefix_cache[?reset_running_requests=...]: the same; an empty 200 */
enum MHD_Result rollout_route_reset_prefix_cache(server_t *s, struct MHD_Connection *c) {
    const char *rr = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "reset_running_requests");
    if (rr && strcasecmp(rr, "true") && strcasecmp(rr, "false"))
        return http_error(c, 400, "reset_running_requests", "reset_running_requests is true or false");
    engine_flush_prefix_cache(s->engine);
    return http_text(c, 200, "text/plain; charset=utf-8", strdup(""), 0);
}

/* vLLM's POST /resume -> {"status": "resumed"} */
enum MHD_Result rollout_route_vllm_resume(server_t *s, struct MHD_Connection *c) {
    resume(s);
    return http_json(c, 200, json_pack("{s:s}", "status", "resumed"));
}

/* vLLM's GET /is_paused -> {"is_paused": bool} */
enum MHD_Result rollout_route_is_paused(server_t *s, struct MHD_Connection *c) {
    pthread_mutex_lock(&s->mu);
    bool paused = s->paused;
    pthread_mutex_unlock(&s->mu);
    return http_json(c, 200, json_pack("{s:b}", "is_paused", paused));
}

/* SGLang's POST /pause_generation {"mode": "abort"|"in_place"|"retract"} (default abort; the
 * body may be empty). in_place keeps the running sequences where they are; retract, which in
 * SGLang frees their KV and recomputes it on continue, is served as in_place: the sequences
 * produce the same tokens either way. */
enum MHD_Result rollout_route_sgl_pause(server_t *s, struct MHD_Connection *c, const char *body, size_t len) {
    json_t *b = NULL;
    if (len) {
        json_error_t je;
        if (!(b = json_loadb(body, len, 0, &je)) || !json_is_object(b)) {
            json_decref(b);
            return http_error(c, 400, NULL, "the body must be a JSON object or empty");
        }
    }
    const json_t *m = json_object_get(b, "mode");
    const char *mode = m ? json_string_value(m) : "abort";
    const char *ours = !mode ? NULL : !strcmp(mode, "abort") ? "abort"
                     : !strcmp(mode, "in_place") || !strcmp(mode, "retract") ? "keep" : NULL;
    json_decref(b);
    if (!ours) return http_error(c, 400, "mode", "mode is \"abort\", \"in_place\" or \"retract\"");
    pause_as(s, ours);
    return http_json(c, 200, json_pack("{s:s, s:s}", "message", "Generation paused successfully.", "status", "ok"));
}

/* SGLang's POST /continue_generation */
enum MHD_Result rollout_route_sgl_continue(server_t *s, struct MHD_Connection *c) {
    resume(s);
    return http_json(c, 200, json_pack("{s:s, s:s}", "message", "Generation continued successfully.", "status", "ok"));
}

/* ---- versioned adapters: PUT/DELETE /v1/adapters/{name}/versions/{v}, GET /v1/adapters ---- */
/* "/v1/adapters/NAME/versions/V" -> name, version; false when it is not that shape */
static bool parse_version_url(const char *url, char *name, size_t nlen, int *version) {
    const char *p = url + strlen("/v1/adapters/");
    const char *slash = strchr(p, '/');
    if (!slash || slash == p || (size_t)(slash - p) >= nlen || strncmp(slash, "/versions/", 10)) return false;
    memcpy(name, p, (size_t)(slash - p));
    name[slash - p] = 0;
    char *end;
    long v = strtol(slash + 10, &end, 10);
    if (*end || end == slash + 10 || v < 1 || v > INT32_MAX) return false;
    *version = (int)v;
    return true;
}

static bool write_file(const char *path, const void *data, size_t len) {
    FILE *f = fopen(path, "wb");
    if (!f) return false;
    bool ok = fwrite(data, 1, len, f) == len;
    return fclose(f) == 0 && ok;
}

/* adapter_config.json for an uploaded adapter_model.safetensors: r and target_modules from
 * the tensors (or the query), lora_alpha from the query (default: r) */
static json_t *upload_config(struct MHD_Connection *c, const void *body, size_t len, perr_t *e) {
    void *copy = malloc(len ? len : 1);
    if (!copy) { fail(e, 500, NULL, "out of memory"); return NULL; }
    memcpy(copy, body, len);
    safetensors_t *st = NULL;
    if (safetensors_open_buffer("upload", copy, len, true, &st)) {
        fail(e, 400, NULL, "the body is not a safetensors file: %s", cs_error_last());
        return NULL;
    }
    int r = 0;
    json_t *targets = json_array();
    for (size_t i = 0; i < safetensors_count(st); i++) {
        const st_tensor_t *t = safetensors_at(st, i);
        const char *a = strstr(t->name, ".lora_A.");
        if (!a || t->n_dims != 2) continue;
        if (!r) r = (int)t->shape[0];
        const char *m = a;
        while (m > t->name && m[-1] != '.') m--;
        char mod[64];
        snprintf(mod, sizeof mod, "%.*s", (int)(a - m), m);
        bool seen = false;
        size_t k;
        json_t *x;
        json_array_foreach(targets, k, x) if (!strcmp(json_string_value(x), mod)) seen = true;
        if (!seen) json_array_append_new(targets, json_string(mod));
    }
    safetensors_free(st);
    const char *qr = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "r");
    const char *qa = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "lora_alpha");
    const char *qt = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "target_modules");
    const char *qs = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "use_rslora");
    if (qr) r = atoi(qr);
    if (r < 1 || json_array_size(targets) == 0) {
        json_decref(targets);
        fail(e, 400, NULL, "no lora_A tensors in the upload (r and target_modules cannot be inferred)");
        return NULL;
    }
    if (qt) {
        json_decref(targets);
        targets = json_array();
        char *dup = strdup(qt);
        char *save = NULL;
        for (char *tok = strtok_r(dup, ",", &save); tok; tok = strtok_r(NULL, ",", &save))
            json_array_append_new(targets, json_string(tok));
        free(dup);
    }
    double alpha = qa ? atof(qa) : r;
    return json_pack("{s:s, s:i, s:f, s:o, s:b, s:f, s:s, s:s}", "peft_type", "LORA", "r", r, "lora_alpha", alpha,
                     "target_modules", targets, "use_rslora", qs && !strcmp(qs, "true"), "lora_dropout", 0.0, "bias",
                     "none", "task_type", "CAUSAL_LM");
}

/* abort the running requests of adapter NAME (apply=abort_inflight) */
static int abort_adapter_requests(server_t *s, const char *name) {
    int n = 0;
    pthread_mutex_lock(&s->mu);
    for (gen_job_t *j = s->jobs; j; j = j->next) {
        pthread_mutex_lock(&j->mu);
        if (j->adapter && !strcmp(j->adapter->name, name) && !j->finished)
            for (int i = 0; i < j->n_parts; i++)
                if (j->parts[i].submitted && !j->parts[i].done) { engine_abort(s->engine, j->parts[i].id); n++; }
        if (j->ro && !j->finished) n += rollout_abort_adapter(j->ro, name);
        pthread_mutex_unlock(&j->mu);
    }
    pthread_mutex_unlock(&s->mu);
    return n;
}

/* the files of an upload (its own directory): refused, or dropped by the registry */
static void remove_upload(const char *dir) {
    static const char *const files[] = {"adapter_model.safetensors", "adapter_config.json"};
    for (size_t k = 0; k < CS_ARRAY_LEN(files); k++) {
        char *f = cs_path_join(dir, files[k]);
        if (f) unlink(f);
        free(f);
    }
    rmdir(dir);
}

/* NAME's kept versions: numbers, or with detail [{version, tier, inflight, active}]; loaded
 * (if not NULL) gets the resident ones */
static json_t *kept_versions_json_ex(server_t *s, const char *name, bool detail, json_t *loaded) {
    json_t *out = json_array();
    int nv = lora_registry_versions(s->reg, name, NULL, 0);
    if (nv <= 0) return out;
    lora_version_info_t *vi = calloc((size_t)nv, sizeof *vi);
    if (!vi) return out;
    nv = CS_MIN(nv, lora_registry_versions(s->reg, name, vi, nv)); /* it may have changed meanwhile */
    for (int i = 0; i < nv; i++) {
        if (detail)
            json_array_append_new(out, json_pack("{s:i, s:s, s:i, s:b, s:b}", "version", vi[i].version, "tier",
                                                 lora_state_name(vi[i].state), "inflight", vi[i].refs, "active",
                                                 vi[i].active, "on_device", vi[i].on_device));
        else
            json_array_append_new(out, json_integer(vi[i].version));
        if (loaded && vi[i].state == LORA_RESIDENT) json_array_append_new(loaded, json_integer(vi[i].version));
    }
    free(vi);
    return out;
}

static json_t *kept_versions_json(server_t *s, const char *name, bool detail) {
    return kept_versions_json_ex(s, name, detail, NULL);
}

/* the query of PUT /v1/adapters/NAME/versions/V: apply, activate, keep_versions */
typedef struct put_query {
    const char *apply;          /* NULL: next_request */
    bool activate;
    int keep;                   /* 0: the registry's default */
} put_query_t;

static bool put_query(struct MHD_Connection *c, put_query_t *q, perr_t *e) {
    const char *apply = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "apply");
    const char *activate_s = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "activate");
    const char *keep_s = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "keep_versions");
    if (apply && strcmp(apply, "next_request") && strcmp(apply, "abort_inflight") && strcmp(apply, "pause_keep"))
        return fail(e, 400, "apply", "apply is next_request, abort_inflight or pause_keep");
    if (activate_s && strcmp(activate_s, "true") && strcmp(activate_s, "false"))
        return fail(e, 400, "activate", "activate is true or false");
    q->apply = apply;
    q->activate = !activate_s || !strcmp(activate_s, "true");
    if (!q->activate && apply && strcmp(apply, "next_request"))
        return fail(e, 400, "apply", "apply=%s needs activate=true (a staged version runs nothing yet)", apply);
    q->keep = 0;
    if (keep_s) {
        char *end;
        long k = strtol(keep_s, &end, 10);
        if (*end || end == keep_s || k < 1 || k > 1000)
            return fail(e, 400, "keep_versions", "keep_versions is an integer from 1 to 1000");
        q->keep = (int)k;
    }
    return true;
}

/* the served adapter NAME now runs the files in dir (taken over) */
static void served_path_set(served_adapter_t *ad, char *dir) {
    free(ad->path);
    ad->path = dir;
    ad->created = time(NULL);
}

/* an empty PUT: activate the kept (staged or older) version */
static bool activate_kept(server_t *s, const char *name, int version, const put_query_t *q, perr_t *e) {
    char prev_dir[4096] = "";
    if (!q->activate) return fail(e, 400, NULL, "an empty PUT activates a kept version: activate=false makes no sense");
    if (lora_registry_activate(s->reg, name, version, q->keep, prev_dir, sizeof prev_dir))
        return fail(e, 404, "version", "%s (an empty body activates a kept version)", cs_error_last());
    pthread_mutex_lock(&s->mu);
    served_adapter_t *ad = adapter_find(s, name);
    if (ad) served_path_set(ad, strdup(prev_dir));
    pthread_mutex_unlock(&s->mu);
    return true;
}

/* The upload's directory in *dir: {"path": DIR} under --lora-root, or the raw
 * adapter_model.safetensors stored with its adapter_config.json in a directory of its own
 * (UPLOAD_DIR/NAME/vV-XXXXXX: an upload refused later, or a concurrent one, never touches the
 * files of a version already kept; *uploaded then). */
static bool store_upload(server_t *s, struct MHD_Connection *c, const char *name, int version, const char *body,
                         size_t len, char **dir, bool *uploaded, perr_t *e) {
    const char *ct = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_TYPE);
    if (ct && !strncmp(ct, "application/json", 16)) {
        json_error_t je;
        json_t *b = json_loadb(body, len, 0, &je);
        const char *path = json_string_value(json_object_get(b, "path"));
        if (!path) {
            json_decref(b);
            return fail(e, 400, "path", "a JSON body is {\"path\": DIR}");
        }
        perr_t pe;
        int st = lora_path_check(s, path, dir, &pe);
        json_decref(b);
        return !st || fail(e, (unsigned)st, "path", "%s", pe.msg);
    }
    json_t *cfg = upload_config(c, body, len, e);
    if (!cfg) return false;
    char sub[512];
    snprintf(sub, sizeof sub, "%s/%s", s->upload_dir, name);
    mkdir(sub, 0700);
    size_t dl = strlen(sub) + 40;
    char *d = malloc(dl);
    if (d) snprintf(d, dl, "%s/v%d-XXXXXX", sub, version);
    if (!d || !mkdtemp(d)) {
        free(d);
        json_decref(cfg);
        return fail(e, 500, NULL, "cannot create a directory under %s", s->upload_dir);
    }
    char *f1 = cs_path_join(d, "adapter_model.safetensors"), *f2 = cs_path_join(d, "adapter_config.json");
    char *cj = json_dumps(cfg, JSON_INDENT(1));
    json_decref(cfg);
    bool ok = f1 && f2 && cj && write_file(f1, body, len) && write_file(f2, cj, strlen(cj));
    free(f1);
    free(f2);
    free(cj);
    if (!ok) {
        remove_upload(d);
        free(d);
        return fail(e, 500, NULL, "cannot store the upload under %s", s->upload_dir);
    }
    *dir = d;
    *uploaded = true;
    return true;
}

/* Version VERSION of NAME from dir (taken over; an upload's files removed when refused): it
 * must fit the base model; kept in the registry, and served (activate). *nbytes: its size. */
static bool add_version(server_t *s, const char *name, int version, char *dir, bool uploaded, const put_query_t *q,
                        size_t *nbytes, perr_t *e) {
    lora_adapter_t *a = NULL;
    if (lora_adapter_load(dir, &s->mcfg, &a)) {
        fail(e, 400, NULL, "adapter '%s' version %d: %s", name, version, cs_error_last());
        goto refused;
    }
    *nbytes = a->nbytes;
    lora_adapter_free(a);
    pthread_mutex_lock(&s->mu);
    served_adapter_t *ad = adapter_find(s, name);
    if (ad && ad->unloading) {
        pthread_mutex_unlock(&s->mu);
        fail(e, 409, NULL, "adapter '%s' is being unloaded", name);
        goto refused;
    }
    int arc = lora_registry_add_ex(s->reg, name, dir, version, q->activate, q->keep, NULL);
    if (arc) {
        fail(e, arc == CS_ENOMEM ? 500 : 409, "version", "%s", cs_error_last());
        pthread_mutex_unlock(&s->mu);
        goto refused;
    }
    if (!ad && !(ad = adapter_add(s, name))) {
        lora_registry_remove(s->reg, name);
        pthread_mutex_unlock(&s->mu);
        fail(e, 500, NULL, "out of memory");
        goto refused;
    }
    if (q->activate) served_path_set(ad, dir);
    else free(dir);
    pthread_mutex_unlock(&s->mu);
    return true;
refused:
    if (uploaded) remove_upload(dir);
    free(dir);
    return false;
}

/* the new active version applied to the running requests (apply=), and the answer */
static enum MHD_Result put_applied(server_t *s, struct MHD_Connection *c, const char *name, int version,
                                   const put_query_t *q, size_t nbytes, double t0) {
    int aborted = 0, moved = 0;
    bool pending = false;
    if (q->activate && q->apply && !strcmp(q->apply, "abort_inflight")) aborted = abort_adapter_requests(s, name);
    if (q->activate && q->apply && !strcmp(q->apply, "pause_keep")) {
        /* the running requests that follow the active version go on with the new weights from
         * the next iteration, keeping their KV cache (engine_follow_active). That needs the new
         * version loaded beside the old one: if the host cache has no room for both yet, the
         * answer is 202 and the move happens once it is loaded. */
        moved = engine_follow_active(s->engine, name, 10000);
        if (moved == CS_EAGAIN) pending = true;
        else if (moved < 0) return http_error(c, 500, NULL, "version %d is active, but %s", version, cs_error_last());
        if (moved < 0) moved = 0;
    }
    server_drain_drops(s);
    int cur = 0;
    lora_registry_state(s->reg, name, NULL, &cur);
    json_t *out = json_pack("{s:s, s:i, s:i, s:I, s:f, s:i, s:i, s:o, s:b}", "name", name, "version", version,
                            "active_version", cur, "bytes", (json_int_t)nbytes, "load_ms", cs_time_ms() - t0,
                            "aborted_requests", aborted, "moved_requests", moved, "kept_versions",
                            kept_versions_json(s, name, false), "move_pending", pending);
    return http_json(c, pending ? 202 : 200, out);
}

enum MHD_Result rollout_route_put_version(server_t *s, struct MHD_Connection *c, const char *url, const char *body,
                                          size_t len) {
    perr_t e = {0};
    char name[257];
    int version;
    if (!parse_version_url(url, name, sizeof name, &version))
        return http_error(c, 404, NULL, "PUT /v1/adapters/NAME/versions/V (V a positive integer)");
    if (!valid_adapter_name(name) || !strcmp(name, s->model_name)) return http_error(c, 400, NULL, "invalid adapter name '%s'", name);
    put_query_t q;
    if (!put_query(c, &q, &e)) return reply_err(c, &e);
    double t0 = cs_time_ms();
    size_t nbytes = 0;
    if (len == 0) { /* no body: activate a kept (staged or older) version */
        if (!activate_kept(s, name, version, &q, &e)) return reply_err(c, &e);
        return put_applied(s, c, name, version, &q, nbytes, t0);
    }
    lora_state st0;
    if (!q.activate && lora_registry_state(s->reg, name, &st0, NULL))
        return http_error(c, 400, "activate", "adapter '%s' has no active version: its first version must be activated", name);
    char *dir = NULL;
    bool uploaded = false; /* dir is ours: removed again when the upload is refused */
    if (!store_upload(s, c, name, version, body, len, &dir, &uploaded, &e) ||
        !add_version(s, name, version, dir, uploaded, &q, &nbytes, &e))
        return reply_err(c, &e);
    return put_applied(s, c, name, version, &q, nbytes, t0);
}

enum MHD_Result rollout_route_delete_version(server_t *s, struct MHD_Connection *c, const char *url) {
    char name[257];
    int version, cur = 0;
    lora_state st;
    if (!parse_version_url(url, name, sizeof name, &version))
        return http_error(c, 404, NULL, "DELETE /v1/adapters/NAME/versions/V");
    if (lora_registry_state(s->reg, name, &st, &cur)) return http_error(c, 404, NULL, "adapter '%s' does not exist", name);
    int rc = lora_registry_remove_version(s->reg, name, version);
    if (rc == CS_EBUSY && version == cur)
        return http_error(c, 409, NULL, "version %d is the active version of '%s' (unload the adapter with "
                                        "/v1/unload_lora_adapter, or activate another version first)", version, name);
    if (rc == CS_EBUSY) return http_error(c, 409, NULL, "%s", cs_error_last());
    if (rc) return http_error(c, 404, NULL, "%s", cs_error_last());
    server_drain_drops(s);
    return http_json(c, 200, json_pack("{s:s, s:i, s:b}", "name", name, "version", version, "deleted", 1));
}

enum MHD_Result rollout_route_list_adapters(server_t *s, conn_t *cn, struct MHD_Connection *c) {
    json_t *a = json_array();
    pthread_mutex_lock(&s->mu);
    for (served_adapter_t *ad = s->adapters; ad; ad = ad->next) {
        lora_state st = LORA_ON_DISK;
        int ver = 0;
        if (ad->unloading || !api_may_use(cn, ad->name) || lora_registry_state(s->reg, ad->name, &st, &ver)) continue;
        json_t *loaded = json_array(), *kept = kept_versions_json_ex(s, ad->name, true, loaded);
        json_array_append_new(a, json_pack("{s:s, s:i, s:o, s:o, s:i, s:s, s:s}", "name", ad->name, "active_version", ver,
                                           "loaded_versions", loaded, "versions", kept, "inflight", ad->in_flight, "tier",
                                           lora_state_name(st), "path", ad->path && api_is_admin(cn) ? ad->path : ""));
    }
    pthread_mutex_unlock(&s->mu);
    return http_json(c, 200, a);
}

/* ---- uploads the registry dropped ---- */
/* The registry dropped a version: an uploaded one's files go too (a trainer pushing every
 * step would fill the disk otherwise). Only directories this server created under its upload
 * dir (UPLOAD_DIR/NAME/vVERSION-XXXXXX). Called with the registry's lock held (and maybe the
 * engine's): the path is queued and deleted by server_drain_drops with no lock held. */
void server_on_dropped(void *user, const char *name, int version, const char *dir) {
    server_t *s = user;
    char want[4096];
    if (!s->upload_dir) return;
    int n = snprintf(want, sizeof want, "%s/%s/v%d-", s->upload_dir, name, version);
    if (n < 0 || (size_t)n >= sizeof want || strncmp(want, dir, (size_t)n) || strchr(dir + n, '/')) return;
    char *d = strdup(dir);
    pthread_mutex_lock(&s->drop_mu);
    if (d && s->n_drops == s->cap_drops) {
        int nc = s->cap_drops ? 2 * s->cap_drops : 16;
        char **nd = realloc(s->drops, sizeof *nd * (size_t)nc);
        if (nd) { s->drops = nd; s->cap_drops = nc; }
    }
    if (d && s->n_drops < s->cap_drops) s->drops[s->n_drops++] = d;
    else free(d);
    pthread_mutex_unlock(&s->drop_mu);
}

void server_drain_drops(server_t *s) {
    pthread_mutex_lock(&s->drop_mu);
    char **drops = s->drops;
    int n = s->n_drops;
    s->drops = NULL;
    s->n_drops = s->cap_drops = 0;
    pthread_mutex_unlock(&s->drop_mu);
    for (int i = 0; i < n; i++) {
        remove_upload(drops[i]);
        free(drops[i]);
    }
    free(drops);
}
