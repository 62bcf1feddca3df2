/* api_openai.c: the OpenAI/vLLM endpoints. /v1/completions and /v1/chat/completions (with
 * vLLM's extensions): the sampling fields, the prompts (text, token ids, or messages rendered
 * with the chat template), then a job (api_jobs.c); /tokenize and /detokenize; /v1/models;
 * vLLM's adapter management (/v1/load_lora_adapter, /v1/unload_lora_adapter). */
#define _GNU_SOURCE 1 /* memmem */
#include <ctype.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/sampling_json.h"
#include "server/api_fields.h"
#include "sched/slo.h"
#include "server/api_internal.h"
#include "text/grammar/grammar.h"

/* ---- optional fields: absent or null keeps the default ---- */
static bool get_int(json_t *o, const char *k, long long lo, long long hi, long long *out, perr_t *e) {
    json_t *v = cs_json_get(o, k);
    if (!v) return true;
    long long x;
    if (json_is_integer(v)) x = (long long)json_integer_value(v);
    else if (json_is_real(v) && json_real_value(v) == floor(json_real_value(v)) && fabs(json_real_value(v)) < 9e15)
        x = (long long)json_real_value(v); /* 5.0 is 5, as pydantic takes it */
    else return fail(e, 400, k, "'%s' must be an integer", k);
    if (x < lo || x > hi) return fail(e, 400, k, "'%s' must be between %lld and %lld, got %lld", k, lo, hi, x);
    *out = x;
    return true;
}

static bool get_bool(json_t *o, const char *k, bool *out, perr_t *e) {
    json_t *v = cs_json_get(o, k);
    if (!v) return true;
    if (!json_is_boolean(v)) return fail(e, 400, k, "'%s' must be true or false", k);
    *out = json_is_true(v);
    return true;
}

static bool get_str(json_t *o, const char *k, const char **out, perr_t *e) {
    json_t *v = cs_json_get(o, k);
    if (!v) return true;
    if (!json_is_string(v)) return fail(e, 400, k, "'%s' must be a string", k);
    *out = json_string_value(v);
    return true;
}

/* the inventory's refused fields (api_fields.c): a 400 naming the first one b sets */
bool api_fields_check(unsigned ep, json_t *b, perr_t *e) {
    const api_field_t *f;
    if (!api_fields_refused(ep, b, &f)) return true;
    return fail(e, 400, f->name, "'%s' is not supported: %s", f->name, f->note);
}

/* ---- the model a request names ---- */
/* model name -> adapter (NULL: the base model); pins the adapter (in_flight). A name the
 * request's key may not use is answered as one that does not exist; an unregistered one is
 * looked for in the --lora-resolve directories. */
static bool resolve_model(server_t *s, conn_t *cn, json_t *body, served_adapter_t **ad, char **label, perr_t *e) {
    const char *m = NULL;
    *ad = NULL;
    if (!get_str(body, "model", &m, e)) return false;
    if (!m || !m[0] || !strcmp(m, s->model_name)) { /* "" is the base model, as in vLLM */
        if (!api_may_use(cn, NULL)) return fail(e, 404, "model", "The model `%s` does not exist.", m ? m : "");
        *label = strdup(s->model_name);
        return *label != NULL || fail(e, 500, NULL, "out of memory");
    }
    if (!api_may_use(cn, m)) return fail(e, 404, "model", "The model `%s` does not exist.", m);
    for (int tries = 0; tries < 2 && !*ad; tries++) {
        pthread_mutex_lock(&s->mu);
        served_adapter_t *a = adapter_find(s, m);
        if (a && !a->unloading) {
            a->in_flight++;
            *ad = a;
        }
        pthread_mutex_unlock(&s->mu);
        if (a || tries || server_resolve_adapter(s, m)) break;
    }
    if (!*ad) return fail(e, 404, "model", "The model `%s` does not exist.", m);
    *label = strdup(m);
    return true;
}

/* ---- request fields shared by completions and chat ---- */
/* n (with the job's choices sized for it), best_of */
static bool parse_n(server_t *s, json_t *b, gen_job_t *j, gen_opts_t *o, int n_prompts, perr_t *e) {
    long long v = 1;
    if (!get_int(b, "n", 1, 1 << 20, &v, e)) return false;
    if (v * n_prompts > s->cfg.max_n)
        return fail(e, 400, "n", "n = %lld%s exceeds this server's limit of %d samples per request", v,
                    n_prompts > 1 ? " times the number of prompts" : "", s->cfg.max_n);
    o->rq.n = (int)v;
    gen_choice_t *nc = calloc((size_t)j->n_parts * (size_t)v, sizeof *nc);
    if (!nc) return fail(e, 500, NULL, "out of memory");
    free(j->choices); /* still empty: sized for n = 1 */
    j->choices = nc;
    j->n = (int)v;
    if (cs_json_get(b, "best_of") && !(json_is_integer(cs_json_get(b, "best_of")) && json_integer_value(cs_json_get(b, "best_of")) == v))
        return fail(e, 400, "best_of", "best_of is not supported (only best_of == n)");
    return true;
}

/* what the response carries (special tokens, token ids, stream) and the fields refused */
static bool parse_output(json_t *b, gen_job_t *j, gen_opts_t *o, perr_t *e) {
    bool b1 = true;
    if (!get_bool(b, "skip_special_tokens", &b1, e)) return false;
    o->rq.keep_special_text = !b1;
    j->skip_special = b1;
    b1 = j->srv->cfg.return_tokens_as_token_ids;
    if (!get_bool(b, "return_tokens_as_token_ids", &b1, e)) return false;
    j->tok_ids = b1;
    const char *user = NULL;
    if (!get_str(b, "user", &user, e)) return false;
    bool stream = false;
    if (!get_bool(b, "stream", &stream, e)) return false;
    j->stream = stream;
    json_t *so = cs_json_get(b, "stream_options");
    if (so) {
        if (!json_is_object(so)) return fail(e, 400, "stream_options", "'stream_options' must be an object");
        if (!stream) return fail(e, 400, "stream_options", "stream_options is only allowed with stream: true");
        bool iu = false, cu = false;
        if (!get_bool(so, "include_usage", &iu, e) || !get_bool(so, "continuous_usage_stats", &cu, e)) return false;
        j->include_usage = iu;
        j->continuous_usage = iu && cu; /* vLLM: usage in every chunk, with include_usage */
    }
    return true;
}

/* vLLM's beam search: use_beam_search (n beams), length_penalty; what a search cannot apply
 * (it is not sampled: vLLM's drops these without a word) is refused by name */
static bool parse_beam(json_t *b, gen_opts_t *o, perr_t *e) {
    static const struct { const char *name; double neutral; } no[] = {
        {"stop", 0}, {"stop_token_ids", 0}, {"logit_bias", 0}, {"allowed_token_ids", 0}, {"min_tokens", 0},
        {"presence_penalty", 0}, {"frequency_penalty", 0}, {"repetition_penalty", 1},
    };
    bool on = false;
    if (!get_bool(b, "use_beam_search", &on, e)) return false;
    json_t *v = cs_json_get(b, "length_penalty");
    double lp = 1.0;
    if (v && (!json_is_number(v) || !isfinite(lp = json_number_value(v))))
        return fail(e, 400, "length_penalty", "'length_penalty' must be a number");
    if (!on) {
        if (lp != 1.0) return fail(e, 400, "length_penalty", "'length_penalty' is only used with use_beam_search");
        return true;
    }
    for (size_t i = 0; i < sizeof no / sizeof no[0]; i++) {
        json_t *f = cs_json_get(b, no[i].name);
        bool neutral = !f || (json_is_number(f) && json_number_value(f) == no[i].neutral) ||
                       (json_is_array(f) && !json_array_size(f)) || (json_is_object(f) && !json_object_size(f)) ||
                       (json_is_string(f) && !strcmp(no[i].name, "stop") && !json_string_length(f));
        if (!neutral)
            return fail(e, 400, no[i].name, "'%s' is not supported with use_beam_search (a beam search is not sampled)",
                        no[i].name);
    }
    if (o->rq.n > 10) return fail(e, 400, "n", "use_beam_search takes n (the beam width) from 1 to 10, got %d", o->rq.n);
    o->rq.beam_search = true;
    o->rq.length_penalty = (float)lp;
    /* the model's recommended penalties (generation_config) do not apply to a search */
    o->rq.sampling.repetition_penalty = 1;
    o->rq.sampling.presence_penalty = o->rq.sampling.frequency_penalty = 0;
    return true;
}

static bool parse_sampling(server_t *s, json_t *b, bool chat, gen_job_t *j, gen_opts_t *o, int n_prompts, perr_t *e) {
    engine_request_t *rq = &o->rq;
    /* max_tokens: completions default 16 (OpenAI), chat: up to the context */
    sampling_json_opts_t opt = {.style = SAMPLING_JSON_OPENAI,
                                .logprobs = chat ? SAMPLING_JSON_LOGPROBS_CHAT : SAMPLING_JSON_LOGPROBS_COUNT,
                                .max_logprobs = s->cfg.max_logprobs, .max_tokens_default = chat ? -1 : 16,
                                .max_completion_tokens = chat, .max_model_len = s->max_model_len,
                                .vocab = s->vocab_size, .seed = true, .defaults = &s->gen_defaults};
    sampling_json_t sj;
    int rc = sampling_params_from_json(b, &opt, &sj);
    if (!rc && sj.n_stop && !s->tok) {
        sj.param = "stop";
        rc = cs_error_set(CS_EINVAL, "stop strings need the model's tokenizer");
    }
    if (rc) {
        sampling_json_free(&sj);
        return fail(e, api_status_of(rc), sj.param, "%s", cs_error_last());
    }
    rq->sampling = sj.sampling;
    rq->max_tokens = sj.max_tokens;
    rq->min_tokens = sj.min_tokens;
    rq->ignore_eos = sj.ignore_eos;
    if (sj.stop) {
        memcpy(o->stops, sj.stop, sizeof(char *) * (size_t)sj.n_stop); /* at most MAX_STOP_STRINGS */
        rq->stop = o->stops;
        rq->n_stop = sj.n_stop;
    }
    if (sj.stop_ids) {
        o->stop_ids = sj.stop_ids;
        sj.stop_ids = NULL;
        rq->stop_token_ids = o->stop_ids;
        rq->n_stop_token_ids = sj.n_stop_ids;
    }
    /* rq->sampling points at these (allowed_token_ids, logit_bias): the request owns them now */
    o->lists = sj.lists;
    sj.lists = NULL;
    sampling_json_free(&sj);
    j->logprobs = rq->sampling.logprobs;
    if (!parse_n(s, b, j, o, n_prompts, e) || !parse_beam(b, o, e)) return false;
    if (!api_structured(s, b, &o->rq.grammar, e)) return false;
    if (o->rq.grammar && o->rq.beam_search)
        return fail(e, 400, "use_beam_search", "use_beam_search cannot be combined with structured output");
    if (sched_parse_slo(json_object_get(b, "slo"), &rq->slo_ttft_ms, &rq->slo_tpot_ms))
        return fail(e, 400, "slo", "%s", cs_error_last());
    /* what the request left unset: its model's bounds from --adapter-slos (label: the served name) */
    sched_slo_table_apply(s->slos, j->label, &rq->slo_ttft_ms, &rq->slo_tpot_ms);
    if (!parse_output(b, j, o, e)) return false;
    if (sampling_params_validate(&rq->sampling)) return fail(e, 400, NULL, "%s", cs_error_last());
    return true;
}

/* vLLM's prompt_logprobs: the logprob of each prompt token and that many alternatives */
static bool parse_prompt_logprobs(server_t *s, json_t *b, gen_job_t *j, gen_opts_t *o, perr_t *e) {
    json_t *v = cs_json_get(b, "prompt_logprobs");
    j->prompt_logprobs = -1;
    if (!v) return true;
    if (json_is_integer(v) && json_integer_value(v) == -1)
        return fail(e, 400, "prompt_logprobs",
                    "prompt_logprobs = -1 (every token of the vocabulary) is not supported; ask for at most %d",
                    s->cfg.max_logprobs);
    long long k = 0;
    if (!get_int(b, "prompt_logprobs", 0, s->cfg.max_logprobs, &k, e)) return false;
    j->prompt_logprobs = (int)k;
    o->rq.prompt_logprobs = true;
    if (o->rq.prompt_top_logprobs < k) o->rq.prompt_top_logprobs = (int)k;
    return true;
}

/* a prompt given as token ids */
static bool ids_of(server_t *s, json_t *a, int32_t **out, int *n, perr_t *e) {
    size_t len = json_array_size(a);
    if (len == 0) return fail(e, 400, "prompt", "The decoder prompt cannot be empty");
    int32_t *ids = malloc(sizeof(int32_t) * len);
    if (!ids) return fail(e, 500, NULL, "out of memory");
    int vocab = s->vocab_size;
    for (size_t i = 0; i < len; i++) {
        json_t *x = json_array_get(a, i);
        if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) >= vocab) {
            free(ids);
            if (json_is_integer(x)) /* vLLM's words */
                return fail(e, 400, "prompt", "Token id %lld is out of vocabulary (the vocabulary has %d tokens)",
                            (long long)json_integer_value(x), vocab);
            return fail(e, 400, "prompt", "prompt token ids must be integers in [0, %d)", vocab);
        }
        ids[i] = (int32_t)json_integer_value(x);
    }
    *out = ids;
    *n = (int)len;
    return true;
}

static bool text_prompt(server_t *s, const char *text, size_t len, bool add_special, int32_t **out, int *n, perr_t *e) {
    if (!s->tok) return fail(e, 400, "prompt", "this model has no tokenizer: send token ids");
    size_t ni = 0;
    if (tokenizer_encode(s->tok, text, len, add_special, out, &ni)) return fail(e, 400, "prompt", "%s", cs_error_last());
    *n = (int)ni;
    if (ni == 0) return fail(e, 400, "prompt", "The decoder prompt cannot be empty");
    return true;
}

static bool check_len(server_t *s, int n_prompt, int max_tokens, perr_t *e) {
    if (n_prompt >= s->max_model_len)
        return fail(e, 400, "prompt",
                    "This model's maximum context length is %d tokens. However, your prompt has %d tokens (at least one "
                    "must be left for the completion).",
                    s->max_model_len, n_prompt);
    if (max_tokens > 0 && (long long)n_prompt + max_tokens > s->max_model_len)
        return fail(e, 400, "max_tokens",
                    "This model's maximum context length is %d tokens. However, you requested %lld tokens (%d in the "
                    "prompt, %d for the completion). Please reduce the prompt or max_tokens.",
                    s->max_model_len, (long long)n_prompt + max_tokens, n_prompt, max_tokens);
    return true;
}

/* The job of a completions or chat request (one sample per prompt until parse_sampling), with
 * the adapter its model names pinned; NULL with *e set. */
static gen_job_t *request_job(server_t *s, conn_t *cn, json_t *b, bool chat, int n_prompts, perr_t *e) {
    served_adapter_t *ad = NULL;
    char *label = NULL;
    if (!resolve_model(s, cn, b, &ad, &label, e)) return NULL;
    bool draining;
    gen_job_t *j = job_new(s, chat, n_prompts, 1, &draining);
    if (!j) {
        fail(e, draining ? 503 : 500, NULL, draining ? "the server is shutting down" : "out of memory");
        free(label);
        adapter_unpin(s, ad);
        return NULL;
    }
    j->adapter = ad;
    j->label = label;
    j->t_arrival = cn->t_arrival;
    const char *mname = NULL;
    get_str(b, "model", &mname, e);
    j->model = strdup(mname && mname[0] ? mname : s->model_name);
    return j;
}

/* the arrays a request's engine_request_t points at */
static void opts_free(gen_opts_t *o) {
    grammar_unref(o->rq.grammar);
    o->rq.grammar = NULL;
    free(o->stop_ids);
    free(o->lists);
    o->stop_ids = NULL;
    o->lists = NULL;
}

/* a request refused after request_job: its job (if any) and the adapter's pin go */
static void request_job_drop(server_t *s, gen_job_t *j) {
    if (!j) return;
    adapter_unpin(s, j->adapter);
    job_unref(j);
}

/* ---- /v1/completions ---- */
gen_job_t *api_completions_parse(server_t *s, conn_t *cn, json_t *b, gen_opts_t *op, perr_t *ep) {
    perr_t e = {0};
    gen_job_t *j = NULL;
    gen_opts_t o = {0};
    json_t *prompt = json_object_get(b, "prompt");
    /* the prompts: a string, ids, or a list of either */
    int n_prompts = 0;
    bool list_of = false;
    if (json_is_string(prompt)) n_prompts = 1;
    else if (json_is_array(prompt) && json_array_size(prompt) > 0) {
        json_t *x0 = json_array_get(prompt, 0);
        if (json_is_integer(x0)) n_prompts = 1;
        else if (json_is_string(x0) || json_is_array(x0)) {
            n_prompts = (int)json_array_size(prompt);
            list_of = true;
        }
    }
    if (!prompt || json_is_null(prompt)) { fail(&e, 400, "prompt", "'prompt' is required"); goto err; }
    if (n_prompts == 0) {
        fail(&e, 400, "prompt", json_is_array(prompt) && json_array_size(prompt) == 0 ? "The decoder prompt cannot be empty"
                                : "'prompt' must be a string, a list of token ids, or a list of either");
        goto err;
    }
    if (n_prompts > MAX_PROMPTS) { fail(&e, 400, "prompt", "at most %d prompts per request", MAX_PROMPTS); goto err; }
    if (!api_fields_check(EP_COMPLETIONS, b, &e)) goto err;
    bool add_special = true; /* the tokenizer's BOS, as vLLM's completions default */
    if (!get_bool(b, "add_special_tokens", &add_special, &e)) goto err;
    if (!(j = request_job(s, cn, b, false, n_prompts, &e))) goto err;
    if (!parse_sampling(s, b, false, j, &o, n_prompts, &e)) goto err;
    bool echo = false;
    if (!get_bool(b, "echo", &echo, &e)) goto err;
    j->echo = echo;
    if (o.rq.max_tokens == 0 && !echo) { fail(&e, 400, "max_tokens", "max_tokens = 0 is only allowed with echo"); goto err; }
    if (echo && (j->logprobs >= 0 || o.rq.max_tokens == 0)) { /* score the prompt */
        o.rq.prompt_logprobs = true;
        o.rq.prompt_top_logprobs = j->logprobs > 0 ? j->logprobs : 0;
    }
    if (!parse_prompt_logprobs(s, b, j, &o, &e)) goto err;
    for (int i = 0; i < n_prompts; i++) {
        json_t *pi = list_of ? json_array_get(prompt, (size_t)i) : prompt;
        gen_part_t *p = &j->parts[i];
        if (json_is_string(pi)) {
            if (!text_prompt(s, json_string_value(pi), json_string_length(pi), add_special, &p->prompt, &p->n_prompt, &e))
                goto err;
            if (echo) {
                p->prompt_text_len = json_string_length(pi);
                p->prompt_text = malloc(p->prompt_text_len + 1);
                if (p->prompt_text) memcpy(p->prompt_text, json_string_value(pi), p->prompt_text_len + 1);
            }
        } else if (json_is_array(pi)) {
            if (list_of && json_array_size(pi) > 0 && !json_is_integer(json_array_get(pi, 0))) {
                fail(&e, 400, "prompt", "'prompt' must be a string, a list of token ids, or a list of either");
                goto err;
            }
            if (!ids_of(s, pi, &p->prompt, &p->n_prompt, &e)) goto err;
            /* the echoed prompt is the ids' text with special tokens, as vLLM decodes it and
             * as the logprobs' tokens and text_offset count it */
            if (echo && s->tok && tokenizer_decode(s->tok, p->prompt, (size_t)p->n_prompt, false,
                                                   &p->prompt_text, &p->prompt_text_len)) {
                fail(&e, 400, "prompt", "%s", cs_error_last());
                goto err;
            }
        } else {
            fail(&e, 400, "prompt", "'prompt' must be a string, a list of token ids, or a list of either");
            goto err;
        }
        if (!check_len(s, p->n_prompt, o.rq.max_tokens, &e)) goto err;
    }
    *op = o;
    if (op->rq.stop) op->rq.stop = op->stops; /* the copy's own array (the strings are the body's) */
    return j;
err:
    opts_free(&o);
    request_job_drop(s, j);
    *ep = e;
    return NULL;
}

void api_request_drop(server_t *s, gen_job_t *j, gen_opts_t *o) {
    opts_free(o);
    request_job_drop(s, j);
}

/* a completions or chat request, parsed by PARSE, then run as a job */
enum MHD_Result api_submit(server_t *s, conn_t *cn, struct MHD_Connection *c, json_t *b, api_parse_fn parse) {
    perr_t e = {0};
    gen_opts_t o;
    gen_job_t *j = parse(s, cn, b, &o, &e);
    if (!j) return reply_err(c, &e);
    enum MHD_Result ret = job_start(s, cn, c, j, &o);
    opts_free(&o);
    return ret;
}

/* ---- chat templates ---- */
/* Normalize OpenAI messages for the template: text parts joined into a string (unless the
 * template reads parts, as vLLM's content-format detection does), then transformers' own
 * preparation (null keys dropped, reasoning fields aliased). */
static bool template_wants_parts(const char *src) { return strstr(src, "['type']") || strstr(src, "[\"type\"]"); }

static bool chat_messages(json_t *msgs, bool wants_parts, json_t **out, perr_t *e) {
    if (!json_is_array(msgs) || json_array_size(msgs) == 0)
        return fail(e, 400, "messages", "'messages' must be a non-empty list");
    json_t *res = json_array();
    size_t i;
    json_t *m;
    json_array_foreach(msgs, i, m) {
        if (!json_is_object(m)) { json_decref(res); return fail(e, 400, "messages", "messages[%zu] must be an object", i); }
        json_t *role = json_object_get(m, "role");
        if (!json_is_string(role)) {
            json_decref(res);
            return fail(e, 400, "messages", "messages[%zu].role must be a string", i);
        }
        json_t *mm = json_deep_copy(m);
        json_t *content = json_object_get(mm, "content");
        if (json_is_array(content)) {
            cs_buf_t t = {0};
            size_t k;
            json_t *part;
            json_array_foreach(content, k, part) {
                const char *type = json_string_value(json_object_get(part, "type"));
                json_t *text = json_object_get(part, "text");
                if (!type || strcmp(type, "text") || !json_is_string(text)) {
                    free(t.p);
                    json_decref(mm);
                    json_decref(res);
                    return fail(e, 400, "messages", "messages[%zu].content[%zu]: only {\"type\": \"text\", \"text\": ...} parts are supported", i, k);
                }
                if (k) cs_buf_add(&t, "\n", 1);
                cs_buf_add(&t, json_string_value(text), json_string_length(text));
            }
            if (!wants_parts) json_object_set_new(mm, "content", json_stringn(t.p ? t.p : "", t.len));
            free(t.p);
        } else if (content && !json_is_string(content) && !json_is_null(content)) {
            json_decref(mm);
            json_decref(res);
            return fail(e, 400, "messages", "messages[%zu].content must be a string or a list of parts", i);
        }
        json_t *calls = json_object_get(mm, "tool_calls");
        size_t k;
        json_t *tc;
        json_array_foreach(calls, k, tc) { /* arguments as JSON text -> the object, as vLLM gives templates */
            json_t *fn = json_object_get(tc, "function");
            json_t *args = json_object_get(fn, "arguments");
            json_t *obj = json_is_string(args) ? json_loads(json_string_value(args), 0, NULL) : NULL;
            if (json_is_object(obj)) json_object_set(fn, "arguments", obj);
            json_decref(obj);
        }
        json_array_append_new(res, mm);
    }
    /* then exactly what apply_chat_template does: null keys dropped, reasoning aliased */
    *out = chat_template_hf_messages(res, true);
    json_decref(res);
    return *out != NULL || fail(e, 500, NULL, "out of memory");
}

/* continue_final_message as transformers' apply_chat_template does it: a tag appended to the
 * final message's text (a string, or its last text part), the chat rendered, and the text cut
 * at the tag's last occurrence (and right-stripped where the template trimmed the space after
 * it). final: the message's text before the tag (borrowed from msgs). */
#define CONTINUE_TAG "CONTINUE_FINAL_MESSAGE_TAG "

static bool tag_final(json_t *msgs, char **final) {
    json_t *last = json_array_get(msgs, json_array_size(msgs) - 1), *holder = last, *c = json_object_get(last, "content");
    if (json_is_array(c)) {
        holder = NULL;
        for (size_t i = json_array_size(c); i-- > 0 && !holder;)
            if (json_is_string(json_object_get(json_array_get(c, i), "text"))) holder = json_array_get(c, i);
        c = holder ? json_object_get(holder, "text") : NULL;
    }
    if (!json_is_string(c)) return false;
    size_t n = json_string_length(c);
    char *t = malloc(n + sizeof CONTINUE_TAG);
    if (!t || !(*final = malloc(n + 1))) {
        free(t);
        return false;
    }
    memcpy(*final, json_string_value(c), n + 1);
    memcpy(t, json_string_value(c), n);
    memcpy(t + n, CONTINUE_TAG, sizeof CONTINUE_TAG);
    json_object_set_new(holder, holder == last ? "content" : "text", json_stringn(t, n + sizeof CONTINUE_TAG - 1));
    free(t);
    return true;
}

static bool cut_at_tag(char *text, size_t *len, const char *final) {
    const char *st = final, *en = final + strlen(final); /* final.strip() must be in the text */
    while (st < en && isspace((unsigned char)*st)) st++;
    while (en > st && isspace((unsigned char)en[-1])) en--;
    if (!memmem(text, *len, st, (size_t)(en - st))) return false;
    const size_t tl = sizeof CONTINUE_TAG - 2; /* the tag without its space */
    const char *at = NULL;
    for (size_t i = *len >= tl ? *len - tl + 1 : 0; i-- > 0 && !at;)
        if (!memcmp(text + i, CONTINUE_TAG, tl)) at = text + i;
    if (!at) return false;
    bool spaced = (size_t)(at - text) + tl < *len && at[tl] == ' ';
    *len = (size_t)(at - text);
    if (!spaced)
        while (*len && isspace((unsigned char)text[*len - 1])) (*len)--;
    text[*len] = 0;
    return true;
}

/* render messages to the prompt text with the model's (or the request's) template */
static bool chat_render(server_t *s, json_t *b, char **text, size_t *len, bool *add_special, perr_t *e) {
    json_t *msgs = NULL;
    chat_template_t *t = s->tmpl, *own = NULL;
    bool wants_parts = s->tmpl_wants_parts;
    const char *req_tmpl = NULL;
    if (!get_str(b, "chat_template", &req_tmpl, e)) goto fail;
    if (req_tmpl) {
        if (chat_template_parse(req_tmpl, strlen(req_tmpl), &own)) {
            fail(e, 400, "chat_template", "chat_template: %s", cs_error_last());
            goto fail;
        }
        t = own;
        wants_parts = template_wants_parts(req_tmpl);
    }
    if (!chat_messages(json_object_get(b, "messages"), wants_parts, &msgs, e)) goto fail;
    if (!t) {
        fail(e, 400, "messages",
             "this model has no chat template (tokenizer_config.json has no chat_template); start the server with "
             "--chat-template FILE or send one as 'chat_template'");
        goto fail;
    }
    bool agp = true, cont = false;
    if (!get_bool(b, "continue_final_message", &cont, e)) goto fail;
    if (cont) { /* the last message is left open for the model to go on with: no generation prompt */
        if (json_is_true(cs_json_get(b, "add_generation_prompt"))) {
            fail(e, 400, "continue_final_message",
                 "Cannot set both `continue_final_message` and `add_generation_prompt` to True.");
            goto fail;
        }
        agp = false;
    } else if (!get_bool(b, "add_generation_prompt", &agp, e)) {
        goto fail;
    }
    *add_special = false;
    if (!get_bool(b, "add_special_tokens", add_special, e)) goto fail;
    json_t *ctx = json_object();
    json_object_set_new(ctx, "messages", msgs);
    msgs = NULL;
    json_object_set_new(ctx, "add_generation_prompt", json_boolean(agp));
    static const char *const lists[] = {"tools", "documents"}; /* shown to the template as they are */
    for (size_t i = 0; i < sizeof lists / sizeof lists[0]; i++) {
        json_t *x = cs_json_get(b, lists[i]);
        if (x && !json_is_array(x)) {
            json_decref(ctx);
            fail(e, 400, lists[i], "'%s' must be a list", lists[i]);
            goto fail;
        }
        json_object_set(ctx, lists[i], x ? x : json_null());
    }
    if (s->bos_token) json_object_set_new(ctx, "bos_token", json_string(s->bos_token));
    if (s->eos_token) json_object_set_new(ctx, "eos_token", json_string(s->eos_token));
    json_t *kw = cs_json_get(b, "chat_template_kwargs");
    if (kw) {
        if (!json_is_object(kw)) {
            json_decref(ctx);
            fail(e, 400, "chat_template_kwargs", "'chat_template_kwargs' must be an object");
            goto fail;
        }
        json_object_update(ctx, kw);
    }
    char *final = NULL;
    if (cont && !tag_final(json_object_get(ctx, "messages"), &final)) {
        json_decref(ctx);
        fail(e, 400, "continue_final_message",
             "continue_final_message is set but we could not find any text to continue in the final message!");
        goto fail;
    }
    int rc = chat_template_render(t, ctx, text, len);
    if (!rc && cont && !cut_at_tag(*text, len, final)) {
        json_decref(ctx);
        free(final);
        free(*text);
        *text = NULL;
        fail(e, 400, "continue_final_message",
             "continue_final_message is set but the final message does not appear in the chat after applying the chat "
             "template! This can happen if the chat template deletes portions of the final message. Please verify the "
             "chat template and final message in your chat to ensure they are compatible.");
        goto fail;
    }
    free(final);
    json_decref(ctx);
    if (rc) { fail(e, 400, "messages", "chat template: %s", cs_error_last()); goto fail; }
    chat_template_free(own);
    return true;
fail:
    json_decref(msgs);
    chat_template_free(own);
    return false;
}

/* ---- /v1/chat/completions ---- */
/* the parameters schema of tool NAME in tools, a new reference (any object when it has none);
 * NULL: no such tool */
static json_t *tool_params(json_t *tools, const char *name) {
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t) {
        json_t *fn = json_object_get(t, "function");
        if (json_is_string(json_object_get(fn, "name")) && !strcmp(json_string_value(json_object_get(fn, "name")), name)) {
            json_t *p = json_object_get(fn, "parameters");
            return json_is_object(p) ? json_incref(p) : json_pack("{s:s}", "type", "object");
        }
    }
    return NULL;
}

/* vLLM's schema for tool_choice "required": a list of calls {"name", "parameters"} of the tools */
static json_t *required_schema(json_t *tools, bool one) {
    json_t *any = json_array();
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t) {
        json_t *fn = json_object_get(t, "function");
        json_t *p = json_object_get(fn, "parameters");
        json_array_append_new(any, json_pack("{s:s, s:{s:{s:s, s:[O]}, s:O}, s:[s, s], s:b}", "type", "object",
                                             "properties", "name", "type", "string", "enum", json_object_get(fn, "name"),
                                             "parameters", json_is_object(p) ? p : json_pack("{s:s}", "type", "object"),
                                             "required", "name", "parameters", "additionalProperties", 0));
    }
    json_t *sch = json_pack("{s:s, s:i, s:{s:o}}", "type", "array", "minItems", 1, "items", "anyOf", any);
    if (one) json_object_set_new(sch, "maxItems", json_integer(1));
    return sch;
}

/* Tools and tool_choice: auto (the default with tools) reads calls out of the reply in the
 * server's format; "required" constrains the reply to a list of calls and a named function to
 * that function's arguments (both as vLLM does it, with the grammar engine); "none" leaves
 * the reply as content. parallel_tool_calls: false keeps the first call. */
static bool parse_tools(server_t *s, json_t *b, gen_job_t *j, gen_opts_t *o, perr_t *e) {
    json_t *tools = cs_json_get(b, "tools");
    bool parallel = true;
    if (!get_bool(b, "parallel_tool_calls", &parallel, e)) return false;
    j->one_tool_call = !parallel;
    json_t *tc = cs_json_get(b, "tool_choice");
    const char *mode = json_string_value(tc);
    bool have = json_is_array(tools) && json_array_size(tools);
    if (tc && !(mode && (!strcmp(mode, "none") || !strcmp(mode, "auto") || !strcmp(mode, "required"))) &&
        !(json_is_object(tc) && json_is_string(json_object_get(json_object_get(tc, "function"), "name"))))
        return fail(e, 400, "tool_choice",
                    "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}");
    if (!have) {
        if (tc && !(mode && !strcmp(mode, "none")))
            return fail(e, 400, "tool_choice", "tool_choice needs 'tools'");
        return true;
    }
    if (!tc || (mode && !strcmp(mode, "auto"))) {
        j->tool_fmt = s->tool_format;
        return true;
    }
    if (mode && !strcmp(mode, "none")) return true;
    json_t *schema;
    if (json_is_object(tc)) {
        const char *name = json_string_value(json_object_get(json_object_get(tc, "function"), "name"));
        if (!(schema = tool_params(tools, name)))
            return fail(e, 400, "tool_choice", "Tool '%s' has not been passed in `tools`", name);
        j->tool_fmt = TOOLS_NAMED;
        free(j->tool_name);
        j->tool_name = strdup(name);
    } else {
        schema = required_schema(tools, j->one_tool_call);
        j->tool_fmt = TOOLS_REQUIRED;
    }
    if (o->rq.grammar) {
        json_decref(schema);
        return fail(e, 400, "tool_choice", "tool_choice '%s' cannot be combined with structured output",
                    mode ? mode : "function");
    }
    json_t *body = json_pack("{s:o}", "guided_json", schema);
    bool ok = api_structured(s, body, &o->rq.grammar, e);
    json_decref(body);
    if (!ok) strcpy(e->param, "tool_choice");
    return ok;
}

gen_job_t *api_chat_parse(server_t *s, conn_t *cn, json_t *b, gen_opts_t *op, perr_t *ep) {
    perr_t e = {0};
    char *text = NULL;
    size_t tlen = 0;
    gen_job_t *j = NULL;
    gen_opts_t o = {0};
    if (!json_object_get(b, "messages")) { fail(&e, 400, "messages", "'messages' is required"); goto err; }
    if (!api_fields_check(EP_CHAT, b, &e)) goto err;
    if (!(j = request_job(s, cn, b, true, 1, &e))) goto err;
    if (!parse_sampling(s, b, true, j, &o, 1, &e)) goto err;
    if (o.rq.max_tokens == 0) { fail(&e, 400, "max_tokens", "'max_tokens' must be at least 1"); goto err; }
    if (!parse_prompt_logprobs(s, b, j, &o, &e)) goto err;
    if (!parse_tools(s, b, j, &o, &e)) goto err;
    bool add_special = false;
    if (!chat_render(s, b, &text, &tlen, &add_special, &e)) goto err;
    gen_part_t *p = &j->parts[0];
    if (!text_prompt(s, text, tlen, add_special, &p->prompt, &p->n_prompt, &e)) goto err;
    if (!check_len(s, p->n_prompt, o.rq.max_tokens, &e)) goto err;
    j->reasoning = s->reasoning;
    if (s->reasoning && o.rq.grammar && s->think_end_id >= 0) {
        /* constrained after the thinking, unless the prompt already closed it (enable_thinking false) */
        int k = p->n_prompt - 1;
        while (k >= 0 && p->prompt[k] != s->think_end_id && p->prompt[k] != s->think_start_id) k--;
        o.rq.grammar_gated = !(k >= 0 && p->prompt[k] == s->think_end_id);
        o.rq.grammar_gate_id = s->think_end_id;
    }
    free(text);
    *op = o;
    if (op->rq.stop) op->rq.stop = op->stops; /* the copy's own array (the strings are the body's) */
    return j;
err:
    free(text);
    opts_free(&o);
    request_job_drop(s, j);
    *ep = e;
    return NULL;
}

/* ---- /tokenize, /detokenize (vLLM's shapes) ---- */
/* the model a tokenizer request names, if any: the base model or an adapter */
static bool known_model(server_t *s, conn_t *cn, json_t *b, perr_t *e) {
    const char *m = NULL;
    if (!get_str(b, "model", &m, e)) return false;
    if (!m) return true;
    bool base = !m[0] || !strcmp(m, s->model_name);
    if (!api_may_use(cn, base ? NULL : m)) return fail(e, 404, "model", "The model `%s` does not exist.", m);
    if (base) return true;
    pthread_mutex_lock(&s->mu);
    bool known = adapter_find(s, m) != NULL;
    pthread_mutex_unlock(&s->mu);
    return known || !server_resolve_adapter(s, m) || fail(e, 404, "model", "The model `%s` does not exist.", m);
}

enum MHD_Result api_tokenize(server_t *s, conn_t *cn, struct MHD_Connection *c, json_t *b) {
    perr_t e = {0};
    int32_t *ids = NULL;
    int n = 0;
    if (!api_fields_check(EP_TOKENIZE, b, &e) || !known_model(s, cn, b, &e)) return reply_err(c, &e);
    if (json_object_get(b, "messages")) {
        char *text = NULL;
        size_t len = 0;
        bool add_special = false;
        if (!chat_render(s, b, &text, &len, &add_special, &e)) return reply_err(c, &e);
        bool ok = text_prompt(s, text, len, add_special, &ids, &n, &e);
        free(text);
        if (!ok) return reply_err(c, &e);
    } else {
        json_t *p = json_object_get(b, "prompt");
        if (!json_is_string(p)) return http_error(c, 400, "prompt", "'prompt' (a string) or 'messages' is required");
        bool add_special = true;
        if (!get_bool(b, "add_special_tokens", &add_special, &e)) return reply_err(c, &e);
        if (!s->tok) return http_error(c, 400, "prompt", "this model has no tokenizer");
        size_t ni = 0;
        if (tokenizer_encode(s->tok, json_string_value(p), json_string_length(p), add_special, &ids, &ni))
            return http_error(c, 400, "prompt", "%s", cs_error_last());
        n = (int)ni;
    }
    bool strs = false;
    if (!get_bool(b, "return_token_strs", &strs, &e)) {
        free(ids);
        return reply_err(c, &e);
    }
    json_t *toks = json_array(), *ts = strs ? json_array() : json_null();
    for (int i = 0; i < n; i++) {
        json_array_append_new(toks, json_integer(ids[i]));
        if (strs) {
            const char *t = tokenizer_id_to_token(s->tok, ids[i]);
            json_array_append_new(ts, t ? jstr(t, strlen(t)) : json_null());
        }
    }
    free(ids);
    return http_json(c, 200, json_pack("{s:i, s:i, s:o, s:o}", "count", n, "max_model_len", s->max_model_len, "tokens",
                                        toks, "token_strs", ts));
}

enum MHD_Result api_detokenize(server_t *s, conn_t *cn, struct MHD_Connection *c, json_t *b) {
    perr_t e = {0};
    if (!api_fields_check(EP_DETOKENIZE, b, &e) || !known_model(s, cn, b, &e)) return reply_err(c, &e);
    json_t *t = json_object_get(b, "tokens");
    if (!json_is_array(t)) return http_error(c, 400, "tokens", "'tokens' (a list of token ids) is required");
    if (!s->tok) return http_error(c, 400, "tokens", "this model has no tokenizer");
    int32_t *ids = NULL;
    int n = 0;
    if (json_array_size(t) == 0) {
        return http_json(c, 200, json_pack("{s:s}", "prompt", ""));
    }
    if (!ids_of(s, t, &ids, &n, &e)) {
        snprintf(e.param, sizeof e.param, "tokens");
        return reply_err(c, &e);
    }
    char *out = NULL;
    size_t len = 0;
    int rc = tokenizer_decode(s->tok, ids, (size_t)n, false, &out, &len);
    free(ids);
    if (rc) return http_error(c, 400, "tokens", "%s", cs_error_last());
    json_t *r = json_pack("{s:o}", "prompt", jstr(out, len));
    free(out);
    return http_json(c, 200, r);
}

/* ---- /v1/models and adapter management ---- */
/* with --adapter-slos, a model's entry carries the bounds a request for it gets when it sets
 * none: {"ttft_ms", "tpot_ms"}, null where the file gives none (the policy's defaults) */
static json_t *model_entry(server_t *s, json_t *m) {
    if (!s->slos) return m;
    double ttft = 0, tpot = 0;
    sched_slo_table_apply(s->slos, json_string_value(json_object_get(m, "id")), &ttft, &tpot);
    json_object_set_new(m, "slo", json_pack("{s:o, s:o}", "ttft_ms", ttft > 0 ? json_real(ttft) : json_null(), "tpot_ms",
                                            tpot > 0 ? json_real(tpot) : json_null()));
    return m;
}

/* a model's entry: the base model (a == NULL) or a served adapter; under s->mu for an adapter.
 * "root" is its directory for an admin's key, its name for a tenant's (a tenant learns
 * nothing of the server's files) */
static json_t *model_json(server_t *s, const served_adapter_t *a, bool admin) {
    json_t *m = a ? json_pack("{s:s, s:s, s:I, s:s, s:s, s:s, s:i}", "id", a->name, "object", "model", "created",
                              (json_int_t)a->created, "owned_by", "caraserve", "root", admin ? a->path : a->name,
                              "parent", s->model_name, "max_model_len", s->max_model_len)
                  : json_pack("{s:s, s:s, s:I, s:s, s:s, s:n, s:i}", "id", s->model_name, "object", "model", "created",
                              (json_int_t)s->created, "owned_by", "caraserve", "root",
                              admin ? s->cfg.model : s->model_name, "parent", "max_model_len", s->max_model_len);
    return model_entry(s, m);
}

/* a query argument of GET: a whole number from LO to HI (absent: *v as it is) */
static bool query_int(struct MHD_Connection *c, const char *key, long lo, long hi, long *v, perr_t *e) {
    const char *q = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, key);
    if (!q) return true;
    char *end;
    long x = strtol(q, &end, 10);
    if (!*q || *end || x < lo || x > hi) return fail(e, 400, key, "'%s' must be a whole number from %ld to %ld", key, lo, hi);
    *v = x;
    return true;
}

/* GET /v1/models[?limit=N&after=ID]: the base model, then the adapters in the order they were
 * registered, those the request's key may use. Without limit, all of them; with it, N from
 * the one after ID (OpenAI's cursor paging: has_more, first_id, last_id). */
enum MHD_Result api_models(server_t *s, conn_t *cn, struct MHD_Connection *c) {
    perr_t e = {0};
    long limit = -1;
    if (!query_int(c, "limit", 1, 100000, &limit, &e)) return reply_err(c, &e);
    const char *after = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "after");
    json_t *data = json_array();
    bool started = !after, base = api_may_use(cn, NULL);
    if (after && base && !strcmp(after, s->model_name)) started = true;
    else if (!after && base) json_array_append_new(data, model_json(s, NULL, api_is_admin(cn)));
    bool has_more = false;
    pthread_mutex_lock(&s->mu);
    served_adapter_t **v = malloc((s->n_adapters ? s->n_adapters : 1) * sizeof *v);
    size_t n = 0;
    for (served_adapter_t *a = s->adapters; a && v; a = a->next) v[n++] = a; /* newest first */
    for (size_t i = n; i-- > 0 && v;) {
        served_adapter_t *a = v[i];
        if (a->unloading || !api_may_use(cn, a->name)) continue;
        if (!started) {
            started = !strcmp(a->name, after);
            continue;
        }
        if (limit >= 0 && (long)json_array_size(data) >= limit) {
            has_more = true;
            break;
        }
        json_array_append_new(data, model_json(s, a, api_is_admin(cn)));
    }
    pthread_mutex_unlock(&s->mu);
    free(v);
    if (!started) {
        json_decref(data);
        return http_error(c, 400, "after", "'after' is not the id of a model listed here");
    }
    if (!v) {
        json_decref(data);
        return http_error(c, 500, NULL, "out of memory");
    }
    size_t k = json_array_size(data);
    json_t *first = k ? json_object_get(json_array_get(data, 0), "id") : NULL,
           *last = k ? json_object_get(json_array_get(data, k - 1), "id") : NULL;
    return http_json(c, 200, json_pack("{s:s, s:o, s:b, s:O?, s:O?}", "object", "list", "data", data, "has_more",
                                        has_more, "first_id", first, "last_id", last));
}

/* GET /v1/models/{id} (the openai client's models.retrieve) */
enum MHD_Result api_model(server_t *s, conn_t *cn, struct MHD_Connection *c, const char *url) {
    const char *id = url + strlen("/v1/models/");
    json_t *m = NULL;
    bool base = !strcmp(id, s->model_name);
    if (api_may_use(cn, base ? NULL : id)) {
        pthread_mutex_lock(&s->mu);
        served_adapter_t *a = base ? NULL : adapter_find(s, id);
        if (base) m = model_json(s, NULL, api_is_admin(cn));
        else if (a && !a->unloading) m = model_json(s, a, api_is_admin(cn));
        pthread_mutex_unlock(&s->mu);
    }
    if (!m) return http_error(c, 404, "model", "The model `%s` does not exist.", id);
    return http_json(c, 200, m);
}

/* Register NAME -> DIR (a new version when it exists and inplace). Validates the adapter
 * against the base model first, so a bad one is refused here and not at its first request. */
int server_add_adapter(server_t *s, const char *name, const char *dir, bool inplace, perr_t *e) {
    return server_add_adapter_ex(s, name, dir, inplace, false, e);
}

int server_add_adapter_ex(server_t *s, const char *name, const char *dir, bool inplace, bool probe, perr_t *e) {
    lora_adapter_t *a = NULL;
    if (!valid_adapter_name(name)) {
        fail(e, 400, "lora_path", "invalid adapter name '%s'", name);
        return CS_EINVAL;
    }
    if (!strcmp(name, s->model_name)) {
        fail(e, 400, "lora_path", "'%s' is the base model's name", name);
        return CS_EINVAL;
    }
    lora_adapter_info_t info;
    int rc = probe ? lora_adapter_probe(dir, &s->mcfg, s->cfg.lora_bf16, &info) : lora_adapter_load(dir, &s->mcfg, &a);
    if (rc) {
        fail(e, rc == CS_ENOTFOUND ? 404 : 400, "lora_path", "adapter '%s' at %s: %s", name, dir, cs_error_last());
        return rc;
    }
    if (a) {
        lora_adapter_info(a, &info);
        lora_adapter_free(a);
    }
    if (s->cfg.max_lora_rank > 0 && info.max_rank > s->cfg.max_lora_rank) { /* vLLM's words */
        fail(e, 400, "lora_path", "adapter '%s': LoRA rank %d is greater than max_lora_rank %d.", name, info.max_rank,
             s->cfg.max_lora_rank);
        return CS_EINVAL;
    }
    pthread_mutex_lock(&s->mu);
    served_adapter_t *ad = adapter_find(s, name);
    if (ad && !inplace) {
        pthread_mutex_unlock(&s->mu);
        fail(e, 400, "lora_path", "adapter '%s' is already loaded (use load_inplace: true to replace its weights)", name);
        return CS_EINVAL;
    }
    if (ad && ad->unloading) {
        pthread_mutex_unlock(&s->mu);
        fail(e, 409, "lora_path", "adapter '%s' is being unloaded", name);
        return CS_EINVAL;
    }
    int ver = 0;
    rc = lora_registry_add(s->reg, name, dir, &ver);
    if (rc) {
        pthread_mutex_unlock(&s->mu);
        fail(e, 500, "lora_path", "%s", cs_error_last());
        return rc;
    }
    if (!ad && !(ad = adapter_add(s, name))) {
        lora_registry_remove(s->reg, name);
        pthread_mutex_unlock(&s->mu);
        fail(e, 500, NULL, "out of memory");
        return CS_ENOMEM;
    }
    free(ad->path);
    ad->path = strdup(dir);
    ad->created = time(NULL);
    pthread_mutex_unlock(&s->mu);
    return CS_OK;
}

enum MHD_Result api_load_lora(server_t *s, struct MHD_Connection *c, json_t *b) {
    perr_t e = {0};
    const char *name = NULL, *path = NULL;
    bool inplace = false;
    if (!get_str(b, "lora_name", &name, &e) || !get_str(b, "lora_path", &path, &e) ||
        !get_bool(b, "load_inplace", &inplace, &e))
        return reply_err(c, &e);
    if (!name || !path) return http_error(c, 400, name ? "lora_path" : "lora_name", "'lora_name' and 'lora_path' are required");
    char *real = NULL;
    int st = lora_path_check(s, path, &real, &e);
    if (st) return http_error(c, (unsigned)st, "lora_path", "%s", e.msg);
    int rc = server_add_adapter(s, name, real, inplace, &e);
    free(real);
    if (rc) return reply_err(c, &e);
    char msg[512];
    snprintf(msg, sizeof msg, "Success: LoRA adapter '%s' added successfully.", name);
    return http_text(c, 200, "text/plain; charset=utf-8", strdup(msg), strlen(msg));
}

/* SGLang's answer to /load_lora_adapter and /unload_lora_adapter: {success, error_message,
 * loaded_adapters: {name: path}}, 200 or (failed) 400 */
static enum MHD_Result sgl_lora_answer(server_t *s, struct MHD_Connection *c, const char *err) {
    json_t *loaded = json_object();
    pthread_mutex_lock(&s->mu);
    for (served_adapter_t *a = s->adapters; a; a = a->next)
        if (!a->unloading) json_object_set_new(loaded, a->name, json_string(a->path ? a->path : ""));
    pthread_mutex_unlock(&s->mu);
    json_t *o = json_pack("{s:b, s:o, s:o}", "success", err == NULL, "error_message", err ? json_string(err) : json_null(),
                          "loaded_adapters", loaded);
    return http_json(c, err ? 400 : 200, o);
}

/* SGLang's POST /load_lora_adapter {lora_name, lora_path, pinned} */
enum MHD_Result api_load_lora_sgl(server_t *s, struct MHD_Connection *c, json_t *b) {
    perr_t e = {0};
    const char *name = NULL, *path = NULL;
    bool pinned = false;
    if (!get_str(b, "lora_name", &name, &e) || !get_str(b, "lora_path", &path, &e) || !get_bool(b, "pinned", &pinned, &e))
        return sgl_lora_answer(s, c, e.msg);
    if (!name || !path) return sgl_lora_answer(s, c, "'lora_name' and 'lora_path' are required");
    if (pinned)
        return sgl_lora_answer(s, c, "pinned adapters are not offered: device slots are given by use (--max-loras), "
                                     "and an adapter in flight is never evicted");
    char *real = NULL;
    if (lora_path_check(s, path, &real, &e)) return sgl_lora_answer(s, c, e.msg);
    int rc = server_add_adapter(s, name, real, false, &e);
    free(real);
    return sgl_lora_answer(s, c, rc ? e.msg : NULL);
}

static enum MHD_Result unload_done(struct MHD_Connection *c, const char *name) {
    char msg[512];
    snprintf(msg, sizeof msg, "Success: LoRA adapter '%s' removed successfully.", name);
    return http_text(c, 200, "text/plain; charset=utf-8", strdup(msg), strlen(msg));
}

/* New requests for the adapter get 404 at once; the answer (and the removal) waits until
 * the requests in flight on it have finished, without holding an HTTP thread. */
static enum MHD_Result unload(server_t *s, conn_t *cn, struct MHD_Connection *c, json_t *b, bool sgl) {
    perr_t e = {0};
    const char *name = NULL;
    if (!get_str(b, "lora_name", &name, &e)) return sgl ? sgl_lora_answer(s, c, e.msg) : reply_err(c, &e);
    if (!name) return sgl ? sgl_lora_answer(s, c, "'lora_name' is required") : http_error(c, 400, "lora_name", "'lora_name' is required");
    pthread_mutex_lock(&s->mu);
    served_adapter_t *a = adapter_find(s, name);
    if (!a || a->unloading) {
        pthread_mutex_unlock(&s->mu);
        char msg[400];
        snprintf(msg, sizeof msg, "The lora adapter '%.256s' cannot be found.", name);
        return sgl ? sgl_lora_answer(s, c, msg) : http_error(c, 404, "lora_name", "%s", msg);
    }
    a->unloading = true;
    if (a->in_flight == 0) {
        lora_registry_remove(s->reg, name);
        adapter_unlink(s, a);
        pthread_mutex_unlock(&s->mu);
        adapter_free(a);
        return sgl ? sgl_lora_answer(s, c, NULL) : unload_done(c, name);
    }
    cn->unload_sglang = sgl;
    struct MHD_Connection **w = realloc(a->waiters, sizeof *w * (size_t)(a->n_waiters + 1));
    cn->unload_name = strdup(name);
    if (!w || !cn->unload_name) {
        if (w) a->waiters = w;
        pthread_mutex_unlock(&s->mu);
        return http_error(c, 500, NULL, "out of memory");
    }
    a->waiters = w;
    a->waiters[a->n_waiters++] = c;
    cn->unload_waiting = true;
    s->n_unload_waiting++;
    MHD_suspend_connection(c); /* under s->mu: the last unpin resumes it only after this */
    pthread_mutex_unlock(&s->mu);
    return MHD_YES;
}

enum MHD_Result api_unload_lora(server_t *s, conn_t *cn, struct MHD_Connection *c, json_t *b) {
    return unload(s, cn, c, b, false);
}

/* SGLang's POST /unload_lora_adapter {lora_name} */
enum MHD_Result api_unload_lora_sgl(server_t *s, conn_t *cn, struct MHD_Connection *c, json_t *b) {
    return unload(s, cn, c, b, true);
}

enum MHD_Result api_unload_resume(server_t *s, conn_t *cn, struct MHD_Connection *c) {
    cn->unload_waiting = false;
    pthread_mutex_lock(&s->mu);
    s->n_unload_waiting--;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return cn->unload_sglang ? sgl_lora_answer(s, c, NULL) : unload_done(c, cn->unload_name);
}
