/* api.c: the endpoints. OpenAI's /v1/completions and /v1/chat/completions (with vLLM's
 * extensions), /v1/models, vLLM's adapter management (/v1/load_lora_adapter,
 * /v1/unload_lora_adapter), /tokenize, /detokenize, /health, /metrics, /version.
 *
 * A generation request becomes a job: one engine request per prompt (each with n samples),
 * whose sink runs on the engine thread and appends to the job under its mutex. A streaming
 * job's connection reads Server-Sent Events from the job's buffer and suspends itself when
 * the buffer is empty; the sink resumes it. A non-streaming job suspends the connection
 * until the last engine request is done, then answers in one piece. The job is freed when
 * the connection, the stream reader and every engine request have let go of it. */
#define _GNU_SOURCE 1 /* POLLRDHUP */
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include "config.h"
#include "engine/safetensors.h"
#include "lora/peft.h"
#include "rollout_api/rollout.h"
#include "server/routes.h"
#include "server/server.h"

#define MAX_STOP_STRINGS 64
#define MAX_PROMPTS 1024

/* ---- small helpers ---- */
typedef struct sbuf { char *p; size_t len, cap; } sbuf_t;

static bool sb_add(sbuf_t *b, const char *s, size_t n) {
    if (b->len + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap : 256;
        while (nc < b->len + n + 1) nc *= 2;
        char *np = realloc(b->p, nc);
        if (!np) return false;
        b->p = np;
        b->cap = nc;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
    return true;
}

/* a JSON string from bytes that may not be valid UTF-8 (bad bytes become U+FFFD) */
static json_t *jstr(const char *s, size_t n) {
    json_t *j = json_stringn(s, n);
    if (j) return j;
    sbuf_t b = {0};
    size_t i = 0;
    while (i < n) {
        unsigned char c = (unsigned char)s[i];
        int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        bool ok = len > 0 && i + (size_t)len <= n;
        for (int k = 1; ok && k < len; k++) ok = ((unsigned char)s[i + k] & 0xC0) == 0x80;
        if (ok && len > 1) { /* overlong forms, surrogates: let jansson judge the one character */
            json_t *one = json_stringn(s + i, (size_t)len);
            ok = one != NULL;
            json_decref(one);
        }
        if (ok) {
            sb_add(&b, s + i, (size_t)len);
            i += (size_t)len;
        } else {
            sb_add(&b, "\xEF\xBF\xBD", 3);
            i++;
        }
    }
    j = json_stringn(b.p ? b.p : "", b.len);
    free(b.p);
    return j;
}

static size_t utf8_chars(const char *s, size_t n) {
    size_t c = 0;
    for (size_t i = 0; i < n; i++) c += ((unsigned char)s[i] & 0xC0) != 0x80;
    return c;
}

/* logprobs as JSON numbers: -inf has no JSON spelling; vLLM writes -9999.0 */
static json_t *jlp(float v) {
    if (isnan(v)) return json_null();
    if (isinf(v)) return json_real(-9999.0);
    return json_real(v);
}

typedef struct perr {
    unsigned status;
    char param[64];
    char msg[1536];
} perr_t;

static bool fail(perr_t *e, unsigned status, const char *param, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static bool fail(perr_t *e, unsigned status, const char *param, const char *fmt, ...) {
    e->status = status;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
    return false;
}

static enum MHD_Result reply_err(struct MHD_Connection *c, const perr_t *e) {
    return http_error(c, e->status ? e->status : 400, e->param[0] ? e->param : NULL, "%s", e->msg);
}

/* optional fields: absent or null keeps the default */
static json_t *field(json_t *o, const char *k) {
    json_t *v = json_object_get(o, k);
    return json_is_null(v) ? NULL : v;
}

static bool get_num(json_t *o, const char *k, double lo, double hi, double *out, perr_t *e) {
    json_t *v = field(o, k);
    if (!v) return true;
    if (!json_is_number(v)) return fail(e, 400, k, "'%s' must be a number", k);
    double x = json_number_value(v);
    if (!(x >= lo && x <= hi)) return fail(e, 400, k, "'%s' must be between %g and %g, got %g", k, lo, hi, x);
    *out = x;
    return true;
}

static bool get_int(json_t *o, const char *k, long long lo, long long hi, long long *out, perr_t *e) {
    json_t *v = field(o, k);
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
    json_t *v = field(o, k);
    if (!v) return true;
    if (!json_is_boolean(v)) return fail(e, 400, k, "'%s' must be true or false", k);
    *out = json_is_true(v);
    return true;
}

static bool get_str(json_t *o, const char *k, const char **out, perr_t *e) {
    json_t *v = field(o, k);
    if (!v) return true;
    if (!json_is_string(v)) return fail(e, 400, k, "'%s' must be a string", k);
    *out = json_string_value(v);
    return true;
}

/* ---- adapters ---- */
static served_adapter_t *adapter_find(server_t *s, const char *name) {
    for (served_adapter_t *a = s->adapters; a; a = a->next)
        if (!strcmp(a->name, name)) return a;
    return NULL;
}

/* model name -> adapter (NULL: the base model); pins the adapter (in_flight) */
static bool resolve_model(server_t *s, json_t *body, served_adapter_t **ad, char **label, perr_t *e) {
    const char *m = NULL;
    *ad = NULL;
    if (!get_str(body, "model", &m, e)) return false;
    if (!m || !strcmp(m, s->model_name)) {
        *label = strdup(s->model_name);
        return *label != NULL || fail(e, 500, NULL, "out of memory");
    }
    pthread_mutex_lock(&s->mu);
    served_adapter_t *a = adapter_find(s, m);
    if (a && !a->unloading) {
        a->in_flight++;
        *ad = a;
    }
    pthread_mutex_unlock(&s->mu);
    if (!*ad) return fail(e, 404, "model", "The model `%s` does not exist.", m);
    *label = strdup(m);
    return true;
}

static void adapter_unlink(server_t *s, served_adapter_t *a) {
    served_adapter_t **pp = &s->adapters;
    while (*pp != a) pp = &(*pp)->next;
    *pp = a->next;
}

static void adapter_free(served_adapter_t *a) {
    free(a->name);
    free(a->path);
    free(a->waiters);
    free(a);
}

/* The last in-flight request of an adapter being unloaded takes it away and wakes the
 * unload requests waiting for that. */
static void adapter_unpin(server_t *s, served_adapter_t *a) {
    if (!a) return;
    served_adapter_t *gone = NULL;
    pthread_mutex_lock(&s->mu);
    if (--a->in_flight == 0 && a->unloading) {
        lora_registry_remove(s->reg, a->name);
        adapter_unlink(s, a);
        gone = a;
    }
    pthread_mutex_unlock(&s->mu);
    if (!gone) return;
    for (int i = 0; i < gone->n_waiters; i++) MHD_resume_connection(gone->waiters[i]); /* suspended until now */
    adapter_free(gone);
}

/* ---- jobs ---- */
typedef struct gen_job gen_job_t;

typedef struct gen_choice {
    sbuf_t text;
    json_t *lp;                 /* completions: {tokens, token_logprobs, top_logprobs, text_offset};
                                   chat: the "content" array */
    size_t offset;              /* text_offset of the next token (characters) */
    int n_tokens;
    const char *finish;
    double t_last;              /* last token (for inter-token latency) */
} gen_choice_t;

typedef struct gen_part {       /* one prompt = one engine request */
    gen_job_t *job;
    int index;
    uint64_t id;
    bool submitted, done;
    int32_t *prompt;
    int n_prompt, n_cached;
    char *prompt_text;          /* for echo */
    size_t prompt_text_len;
    json_t *echo_lp;            /* completions' logprobs entries of the prompt (echo) */
    bool first_token;
} gen_part_t;

struct gen_job {
    server_t *srv;
    pthread_mutex_t mu;
    int refs;
    struct MHD_Connection *conn;    /* NULL once the connection is finished */
    bool suspended;
    bool chat, stream, include_usage, echo, tok_ids, skip_special;
    int logprobs;                   /* -1: none */
    int n;                          /* samples per prompt */
    int n_parts, n_done;
    gen_part_t *parts;
    gen_choice_t *choices;          /* [n_parts * n] */
    char id[48];
    long long created;
    char *model;                    /* as the client named it */
    served_adapter_t *adapter;
    char *label;                    /* metrics label */
    double t_arrival;
    sbuf_t out;                     /* SSE bytes not yet sent */
    size_t out_off;
    bool finished;
    bool hung_up;                   /* the watcher saw the client go */
    rollout_t *ro;                  /* a /v1/rollout batch (the parts are unused then) */
    json_t *ro_groups, *ro_summary; /* its lines, when not streamed */
    json_t *sglang;                 /* SGLang /generate: {"batch": bool, "return_logprob": bool} */
    unsigned err_status;
    char *err_msg;
    long long completion_tokens;
    gen_job_t *next, *prev;
};

static void job_free(gen_job_t *j) {
    for (int i = 0; i < j->n_parts; i++) {
        free(j->parts[i].prompt);
        free(j->parts[i].prompt_text);
        json_decref(j->parts[i].echo_lp);
    }
    for (int i = 0; i < j->n_parts * j->n; i++) {
        free(j->choices[i].text.p);
        json_decref(j->choices[i].lp);
    }
    free(j->parts);
    free(j->choices);
    free(j->model);
    free(j->label);
    free(j->out.p);
    free(j->err_msg);
    rollout_release(j->ro);
    json_decref(j->ro_groups);
    json_decref(j->ro_summary);
    json_decref(j->sglang);
    pthread_mutex_destroy(&j->mu);
    free(j);
}

static void job_unref(gen_job_t *j) {
    pthread_mutex_lock(&j->mu);
    bool last = --j->refs == 0;
    pthread_mutex_unlock(&j->mu);
    if (!last) return;
    server_t *s = j->srv;
    pthread_mutex_lock(&s->mu);
    if (j->prev) j->prev->next = j->next;
    else s->jobs = j->next;
    if (j->next) j->next->prev = j->prev;
    s->n_jobs--;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    job_free(j);
}

/* NULL when out of memory or (*draining) when the server has begun shutting down: the check
 * and the count are one step under s->mu, so the drain never misses a job */
static gen_job_t *job_new(server_t *s, bool chat, int n_parts, int n, bool *draining) {
    *draining = false;
    gen_job_t *j = calloc(1, sizeof *j);
    if (!j) return NULL;
    j->srv = s;
    pthread_mutex_init(&j->mu, NULL);
    j->refs = 1; /* the connection's */
    j->chat = chat;
    j->n_parts = n_parts;
    j->n = n;
    j->logprobs = -1;
    j->skip_special = true;
    j->parts = calloc((size_t)n_parts, sizeof *j->parts);
    j->choices = calloc((size_t)n_parts * (size_t)n, sizeof *j->choices);
    if (!j->parts || !j->choices) {
        job_free(j);
        return NULL;
    }
    for (int i = 0; i < n_parts; i++) {
        j->parts[i].job = j;
        j->parts[i].index = i;
    }
    static const char hex[] = "0123456789abcdef";
    unsigned char rnd[16];
    FILE *f = fopen("/dev/urandom", "rb");
    if (!f || fread(rnd, 1, sizeof rnd, f) != sizeof rnd)
        for (size_t i = 0; i < sizeof rnd; i++) rnd[i] = (unsigned char)rand();
    if (f) fclose(f);
    int o = snprintf(j->id, sizeof j->id, "%s", chat ? "chatcmpl-" : "cmpl-");
    for (size_t i = 0; i < sizeof rnd && o + 2 < (int)sizeof j->id; i++) {
        j->id[o++] = hex[rnd[i] >> 4];
        j->id[o++] = hex[rnd[i] & 15];
    }
    j->id[o] = 0;
    j->created = (long long)time(NULL);
    pthread_mutex_lock(&s->mu);
    if (s->draining) {
        pthread_mutex_unlock(&s->mu);
        *draining = true;
        j->refs = 0;
        job_free(j);
        return NULL;
    }
    j->next = s->jobs;
    if (s->jobs) s->jobs->prev = j;
    s->jobs = j;
    s->n_jobs++;
    pthread_mutex_unlock(&s->mu);
    return j;
}

/* the string of one token in logprobs */
static json_t *tok_json(const gen_job_t *j, int32_t id) {
    if (j->tok_ids) {
        char b[32];
        snprintf(b, sizeof b, "token_id:%d", id);
        return json_string(b);
    }
    char *t = NULL;
    size_t n = 0;
    if (!j->srv->tok || tokenizer_decode(j->srv->tok, &id, 1, false, &t, &n)) {
        free(t);
        char b[32];
        snprintf(b, sizeof b, "token_id:%d", id);
        return json_string(b);
    }
    json_t *r = jstr(t, n);
    free(t);
    return r;
}

static json_t *bytes_json(const char *s) {
    json_t *a = json_array();
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) json_array_append_new(a, json_integer(*p));
    return a;
}

/* completions' logprobs object, empty */
static json_t *lp_legacy_new(void) {
    return json_pack("{s:[], s:[], s:[], s:[]}", "tokens", "token_logprobs", "top_logprobs", "text_offset");
}

/* append one token to a completions logprobs object; *offset advances by its characters */
static void lp_legacy_add(const gen_job_t *j, json_t *lp, int32_t tok, float logprob, bool has_lp, int n_top,
                          const int32_t *top_ids, const float *top_lps, size_t *offset) {
    json_t *ts = tok_json(j, tok);
    const char *tstr = json_string_value(ts);
    json_array_append_new(json_object_get(lp, "text_offset"), json_integer((json_int_t)*offset));
    *offset += utf8_chars(tstr, strlen(tstr));
    json_array_append(json_object_get(lp, "tokens"), ts);
    json_array_append_new(json_object_get(lp, "token_logprobs"), has_lp ? jlp(logprob) : json_null());
    json_t *top = json_null();
    if (has_lp && top_ids) {
        top = json_object();
        for (int i = 0; i < n_top; i++) {
            if (top_ids[i] < 0) continue;
            json_t *k = tok_json(j, top_ids[i]);
            if (!json_object_get(top, json_string_value(k))) json_object_set_new(top, json_string_value(k), jlp(top_lps[i]));
            json_decref(k);
        }
        if (!json_object_get(top, tstr)) json_object_set_new(top, tstr, jlp(logprob));
    }
    json_array_append_new(json_object_get(lp, "top_logprobs"), top);
    json_decref(ts);
}

/* chat's logprobs entry of one token */
static json_t *lp_chat_entry(const gen_job_t *j, int32_t tok, float logprob, int n_top, const int32_t *top_ids,
                             const float *top_lps) {
    json_t *ts = tok_json(j, tok);
    json_t *tops = json_array();
    for (int i = 0; i < n_top; i++) {
        if (top_ids[i] < 0) continue;
        json_t *k = tok_json(j, top_ids[i]);
        json_array_append_new(tops, json_pack("{s:o, s:o, s:o}", "token", k, "logprob", jlp(top_lps[i]), "bytes",
                                              bytes_json(json_string_value(k))));
    }
    return json_pack("{s:o, s:o, s:o, s:o}", "token", ts, "logprob", jlp(logprob), "bytes",
                     bytes_json(json_string_value(ts)), "top_logprobs", tops);
}

static json_t *usage_json(const gen_job_t *j) {
    long long prompt = 0, cached = 0;
    for (int i = 0; i < j->n_parts; i++) {
        prompt += j->parts[i].n_prompt;
        cached += j->parts[i].n_cached;
    }
    return json_pack("{s:I, s:I, s:I, s:{s:I}}", "prompt_tokens", (json_int_t)prompt, "completion_tokens",
                     (json_int_t)j->completion_tokens, "total_tokens", (json_int_t)(prompt + j->completion_tokens),
                     "prompt_tokens_details", "cached_tokens", (json_int_t)cached);
}

/* ---- SSE ---- */
static void sse_json(gen_job_t *j, json_t *o) {
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (!s) return;
    sb_add(&j->out, "data: ", 6);
    sb_add(&j->out, s, strlen(s));
    sb_add(&j->out, "\n\n", 2);
    free(s);
}

static json_t *chunk_new(gen_job_t *j) {
    json_t *o = json_pack("{s:s, s:s, s:I, s:s, s:[]}", "id", j->id, "object",
                          j->chat ? "chat.completion.chunk" : "text_completion", "created", (json_int_t)j->created,
                          "model", j->model, "choices");
    if (j->include_usage) json_object_set_new(o, "usage", json_null());
    return o;
}

/* one choice's chunk: text delta, its logprobs (or NULL), finish reason (or NULL) */
static void sse_choice(gen_job_t *j, int index, const char *text, size_t len, json_t *lp, const char *finish,
                       bool role) {
    json_t *o = chunk_new(j);
    json_t *c;
    if (j->chat) {
        json_t *delta = json_object();
        if (role) {
            json_object_set_new(delta, "role", json_string("assistant"));
            json_object_set_new(delta, "content", json_string(""));
        } else if (len || !finish) {
            json_object_set_new(delta, "content", jstr(text, len));
        }
        c = json_pack("{s:i, s:o, s:o, s:o}", "index", index, "delta", delta, "logprobs",
                      lp ? json_pack("{s:o}", "content", lp) : json_null(), "finish_reason",
                      finish ? json_string(finish) : json_null());
    } else {
        c = json_pack("{s:i, s:o, s:o, s:o}", "index", index, "text", jstr(text, len), "logprobs",
                      lp ? lp : json_null(), "finish_reason", finish ? json_string(finish) : json_null());
    }
    json_array_append_new(json_object_get(o, "choices"), c);
    sse_json(j, o);
}

/* Under j->mu: whether the suspended connection has something now (the end, or stream
 * bytes); if so it counts as resumed, and the caller resumes it after unlocking (it cannot
 * go away while suspended). */
static bool take_resume(gen_job_t *j) {
    if (!(j->suspended && j->conn && (j->finished || (j->stream && j->out.len > j->out_off)))) return false;
    j->suspended = false;
    return true;
}

/* ---- the engine's sink (engine thread) ---- */
static const char *finish_name(engine_finish f) {
    switch (f) {
    case ENGINE_FINISH_STOP: return "stop";
    case ENGINE_FINISH_LENGTH: return "length";
    case ENGINE_FINISH_ABORT: return "abort";
    case ENGINE_FINISH_ERROR: return "error";
    default: return NULL;
    }
}

static unsigned status_of(int cs) {
    switch (cs) {
    case CS_ENOTFOUND: return 404;
    case CS_EINVAL: case CS_EFORMAT: case CS_ESHAPE: case CS_EUNSUPPORTED: return 400;
    default: return 500;
    }
}

static void on_event(void *user, const engine_event_t *ev) {
    gen_part_t *p = user;
    gen_job_t *j = p->job;
    server_t *s = j->srv;
    server_metrics_t *m = &s->m;
    const char *lab[] = {j->label};
    double now = cs_time_ms();
    pthread_mutex_lock(&j->mu);
    p->n_prompt = ev->n_prompt_tokens;
    p->n_cached = ev->n_cached_tokens;
    if (ev->prompt_logprobs && j->echo && j->logprobs >= 0) {
        /* the prompt's tokens with their logprobs (the first has none) */
        json_t *lp = lp_legacy_new();
        size_t off = 0;
        for (int t = 0; t < p->n_prompt; t++) {
            const int32_t *ids = ev->prompt_n_top ? ev->prompt_top_ids + (size_t)t * ev->prompt_n_top : NULL;
            const float *lps = ev->prompt_n_top ? ev->prompt_top_logprobs + (size_t)t * ev->prompt_n_top : NULL;
            lp_legacy_add(j, lp, p->prompt[t], ev->prompt_logprobs[t], t > 0, t > 0 ? ev->prompt_n_top : 0,
                          t > 0 ? ids : NULL, lps, &off);
        }
        /* the text offsets of the prompt tokens count from the prompt text's start */
        p->echo_lp = lp;
        for (int k = 0; k < j->n; k++) {
            gen_choice_t *c = &j->choices[p->index * j->n + k];
            c->offset = utf8_chars(p->prompt_text, p->prompt_text_len);
            if (j->stream)
                sse_choice(j, p->index * j->n + k, p->prompt_text, p->prompt_text_len, json_deep_copy(lp), NULL, false);
        }
    }
    int ci = p->index * j->n + ev->index;
    gen_choice_t *c = &j->choices[ci];
    json_t *lp_delta = NULL;
    if (ev->has_token) {
        if (!p->first_token) {
            p->first_token = true;
            metric_observe(m->ttft, lab, (now - j->t_arrival) / 1000.0);
        } else if (c->t_last > 0) {
            metric_observe(m->itl, lab, (now - c->t_last) / 1000.0);
        }
        c->t_last = now;
        c->n_tokens++;
        j->completion_tokens++;
        metric_inc(m->gen_tokens, lab, 1);
        if (j->logprobs >= 0) {
            if (j->chat) {
                json_t *e = lp_chat_entry(j, ev->token, ev->logprob, ev->n_top, ev->top_ids, ev->top_logprobs);
                if (!c->lp) c->lp = json_array();
                if (j->stream) lp_delta = json_pack("[o]", e);
                else json_array_append_new(c->lp, e);
            } else {
                json_t *dst = j->stream ? (lp_delta = lp_legacy_new()) : (c->lp ? c->lp : (c->lp = lp_legacy_new()));
                lp_legacy_add(j, dst, ev->token, ev->logprob, true, ev->n_top, ev->top_ids, ev->top_logprobs, &c->offset);
            }
        }
        if (!j->stream) sb_add(&c->text, ev->text, ev->text_len);
    }
    const char *fin = finish_name(ev->finish);
    if (ev->finish == ENGINE_FINISH_ERROR && !j->err_status) {
        j->err_status = status_of(ev->error);
        j->err_msg = strdup(ev->error_msg ? ev->error_msg : cs_strerror(ev->error));
    }
    if (fin) c->finish = fin;
    if (j->stream && (ev->has_token || fin)) {
        if (ev->finish == ENGINE_FINISH_ERROR) {
            json_t *eo = json_pack("{s:{s:s, s:s, s:n, s:i}}", "error", "message", j->err_msg ? j->err_msg : "error",
                                   "type", j->err_status >= 500 ? "InternalServerError" : "BadRequestError", "param",
                                   "code", (int)j->err_status);
            if (eo) sse_json(j, eo);
        }
        sse_choice(j, ci, ev->text, ev->text_len, lp_delta, fin, false);
    } else {
        json_decref(lp_delta);
    }
    bool drop = false;
    if (ev->request_done) {
        p->done = true;
        j->n_done++;
        drop = true;
        double e2e = (now - j->t_arrival) / 1000.0;
        metric_observe(m->e2e, lab, e2e);
        metric_observe(m->queue, lab, ev->queue_ms / 1000.0);
        metric_inc(m->prompt_tokens, lab, p->n_prompt);
        const char *rl[] = {j->label, fin ? fin : "abort"};
        metric_inc(m->success, rl, 1);
        if (j->n_done == j->n_parts) {
            if (j->stream) {
                if (j->include_usage) {
                    json_t *o = chunk_new(j);
                    json_object_set_new(o, "usage", usage_json(j));
                    sse_json(j, o);
                }
                sb_add(&j->out, "data: [DONE]\n\n", 14);
            }
            j->finished = true;
        }
    }
    bool resume = take_resume(j);
    struct MHD_Connection *conn = j->conn;
    bool unpin = ev->request_done && j->n_done == j->n_parts;
    pthread_mutex_unlock(&j->mu);
    /* still suspended until this call: the connection cannot go away before it */
    if (resume) MHD_resume_connection(conn);
    if (unpin) {
        adapter_unpin(s, j->adapter);
    }
    if (drop) job_unref(j);
}

/* ---- streaming responses ---- */
static ssize_t stream_reader(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    gen_job_t *j = cls;
    pthread_mutex_lock(&j->mu);
    if (j->out_off < j->out.len) {
        size_t n = j->out.len - j->out_off;
        if (n > max) n = max;
        memcpy(buf, j->out.p + j->out_off, n);
        j->out_off += n;
        if (j->out_off == j->out.len) j->out_off = j->out.len = 0;
        pthread_mutex_unlock(&j->mu);
        return (ssize_t)n;
    }
    if (j->finished) {
        pthread_mutex_unlock(&j->mu);
        return MHD_CONTENT_READER_END_OF_STREAM;
    }
    j->suspended = true;
    MHD_suspend_connection(j->conn);
    pthread_mutex_unlock(&j->mu);
    return 0;
}

static void stream_free(void *cls) { job_unref(cls); }

/* ---- submitting a job ---- */
typedef struct gen_opts {
    engine_request_t rq;        /* sampling etc.; prompt/sink/user set per part */
    const char *stops[MAX_STOP_STRINGS];
    int32_t *stop_ids;
} gen_opts_t;

/* Submit every part; on a submit error abort the ones already in and answer the error. */
static enum MHD_Result job_start(server_t *s, conn_t *cn, struct MHD_Connection *c, gen_job_t *j, gen_opts_t *o) {
    if (j->stream && j->chat) /* the role first, as OpenAI sends it */
        for (int i = 0; i < j->n_parts * j->n; i++) sse_choice(j, i, "", 0, NULL, NULL, true);
    if (j->stream && j->echo && j->logprobs < 0) /* echo without logprobs: the prompt text first */
        for (int i = 0; i < j->n_parts * j->n; i++) {
            gen_part_t *p = &j->parts[i / j->n];
            sse_choice(j, i, p->prompt_text ? p->prompt_text : "", p->prompt_text_len, NULL, NULL, false);
        }
    perr_t e = {0};
    int k;
    for (k = 0; k < j->n_parts; k++) {
        gen_part_t *p = &j->parts[k];
        engine_request_t rq = o->rq;
        rq.prompt = p->prompt;
        rq.n_prompt = p->n_prompt;
        rq.sink = on_event;
        rq.user = p;
        rq.adapter = j->adapter ? j->adapter->name : NULL;
        pthread_mutex_lock(&j->mu);
        j->refs++;
        pthread_mutex_unlock(&j->mu);
        uint64_t id = 0;
        int rc = engine_submit(s->engine, &rq, &id);
        if (rc) {
            fail(&e, status_of(rc), NULL, "%s", cs_error_last());
            pthread_mutex_lock(&j->mu);
            j->refs--;
            pthread_mutex_unlock(&j->mu);
            break;
        }
        pthread_mutex_lock(&j->mu);
        p->id = id;
        p->submitted = true;
        pthread_mutex_unlock(&j->mu);
    }
    if (k < j->n_parts) {
        /* parts already in will finish as aborted; their events still come */
        pthread_mutex_lock(&j->mu);
        j->n_done += j->n_parts - k; /* the ones never submitted */
        bool all = j->n_done == j->n_parts;
        if (all) j->finished = true;
        pthread_mutex_unlock(&j->mu);
        for (int i = 0; i < k; i++) engine_abort(s->engine, j->parts[i].id);
        if (all) adapter_unpin(s, j->adapter);
        cn->job = NULL;
        job_unref(j); /* the connection's reference */
        return reply_err(c, &e);
    }
    cn->job = j;
    if (j->stream) {
        struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, stream_reader, j, stream_free);
        if (!r) return MHD_NO;
        pthread_mutex_lock(&j->mu);
        j->conn = c;
        j->refs++; /* the reader's */
        pthread_mutex_unlock(&j->mu);
        MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, j->ro ? "application/x-ndjson" : "text/event-stream");
        MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
        enum MHD_Result ret = MHD_queue_response(c, 200, r);
        MHD_destroy_response(r);
        return ret;
    }
    pthread_mutex_lock(&j->mu);
    j->conn = c;
    if (!j->finished) {
        j->suspended = true;
        MHD_suspend_connection(c);
        pthread_mutex_unlock(&j->mu);
        return MHD_YES;
    }
    pthread_mutex_unlock(&j->mu);
    return api_resume(s, cn, c);
}

static json_t *final_json(gen_job_t *j) {
    json_t *choices = json_array();
    for (int i = 0; i < j->n_parts * j->n; i++) {
        gen_choice_t *c = &j->choices[i];
        gen_part_t *p = &j->parts[i / j->n];
        json_t *ch;
        if (j->chat) {
            json_t *lp = j->logprobs >= 0 ? json_pack("{s:o}", "content", c->lp ? json_incref(c->lp) : json_array())
                                          : json_null();
            ch = json_pack("{s:i, s:{s:s, s:o}, s:o, s:s}", "index", i, "message", "role", "assistant", "content",
                           jstr(c->text.p ? c->text.p : "", c->text.len), "logprobs", lp, "finish_reason",
                           c->finish ? c->finish : "abort");
        } else {
            sbuf_t t = {0};
            if (j->echo) sb_add(&t, p->prompt_text ? p->prompt_text : "", p->prompt_text_len);
            sb_add(&t, c->text.p ? c->text.p : "", c->text.len);
            json_t *lp = json_null();
            if (j->logprobs >= 0) {
                lp = j->echo && p->echo_lp ? json_deep_copy(p->echo_lp) : lp_legacy_new();
                if (c->lp) {
                    const char *keys[] = {"tokens", "token_logprobs", "top_logprobs", "text_offset"};
                    for (int k = 0; k < 4; k++)
                        json_array_extend(json_object_get(lp, keys[k]), json_object_get(c->lp, keys[k]));
                }
            }
            ch = json_pack("{s:i, s:o, s:o, s:s}", "index", i, "text", jstr(t.p ? t.p : "", t.len), "logprobs", lp,
                           "finish_reason", c->finish ? c->finish : "abort");
            free(t.p);
        }
        json_array_append_new(choices, ch);
    }
    return json_pack("{s:s, s:s, s:I, s:s, s:o, s:o}", "id", j->id, "object", j->chat ? "chat.completion" : "text_completion",
                     "created", (json_int_t)j->created, "model", j->model, "choices", choices, "usage", usage_json(j));
}

/* SGLang's /generate answer from the rollout's groups (one sample per prompt, in order) */
static json_t *sglang_json(server_t *s, gen_job_t *j) {
    json_t *list = json_array();
    bool lp = json_is_true(json_object_get(j->sglang, "return_logprob"));
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
            if (s->tok) tokenizer_decode(s->tok, v, n, true, &text, &tl);
            free(v);
            const char *fin = json_string_value(json_object_get(sm, "finish_reason"));
            json_t *meta = json_pack("{s:s, s:{s:s}, s:O, s:I, s:O, s:O}", "id",
                                     json_string_value(json_object_get(g, "group_id")), "finish_reason", "type", fin,
                                     "prompt_tokens", json_object_get(g, "prompt_len"), "completion_tokens",
                                     (json_int_t)n, "cached_tokens", json_object_get(g, "cached_prompt_tokens"),
                                     "weight_version", json_object_get(sm, "adapter_version"));
            if (lp) {
                json_t *otl = json_array(), *lps = json_object_get(sm, "logprobs");
                for (size_t k = 0; k < n; k++)
                    json_array_append_new(otl, json_pack("[O, O, n]", json_array_get(lps, k), json_array_get(ids, k)));
                json_object_set_new(meta, "output_token_logprobs", otl);
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

enum MHD_Result api_resume(server_t *s, conn_t *cn, struct MHD_Connection *c) {
    gen_job_t *j = cn->job;
    if (j->stream) return MHD_YES; /* the reader goes on */
    pthread_mutex_lock(&j->mu);
    if (!j->finished) { /* not for us yet */
        j->suspended = true;
        MHD_suspend_connection(c);
        pthread_mutex_unlock(&j->mu);
        return MHD_YES;
    }
    if (cn->answered) {
        pthread_mutex_unlock(&j->mu);
        return MHD_YES;
    }
    cn->answered = true;
    if (j->err_status) {
        unsigned st = j->err_status;
        char *msg = strdup(j->err_msg ? j->err_msg : "error");
        pthread_mutex_unlock(&j->mu);
        enum MHD_Result r = http_error(c, st, NULL, "%s", msg ? msg : "error");
        free(msg);
        return r;
    }
    json_t *o = j->sglang ? sglang_json(s, j)
                : j->ro   ? json_pack("{s:O, s:O}", "groups", j->ro_groups, "summary",
                                      json_object_get(j->ro_summary, "summary"))
                          : final_json(j);
    pthread_mutex_unlock(&j->mu);
    return http_json(c, 200, o);
}

void api_conn_done(server_t *s, conn_t *cn) {
    gen_job_t *j = cn->job;
    if (!j) return;
    cn->job = NULL;
    uint64_t ids[MAX_PROMPTS];
    int n = 0;
    pthread_mutex_lock(&j->mu);
    j->conn = NULL;
    j->suspended = false;
    if (!j->finished)
        for (int i = 0; i < j->n_parts; i++)
            if (j->parts[i].submitted && !j->parts[i].done) ids[n++] = j->parts[i].id;
    rollout_t *ro = !j->finished ? j->ro : NULL;
    pthread_mutex_unlock(&j->mu);
    if (ro) rollout_abort(ro); /* its partial lines are dropped with the connection */
    for (int i = 0; i < n; i++) engine_abort(s->engine, ids[i]); /* a client that went away */
    job_unref(j);
}

/* MHD does not notice a client hanging up while its connection is suspended (a request still
 * queued or prefilling, or any non-streaming one): look at the sockets of suspended
 * connections every 100 ms and abort the requests of those that have closed. */
static void *watch_thread(void *arg) {
    server_t *s = arg;
    for (;;) {
        uint64_t ids[64];
        int n = 0;
        pthread_mutex_lock(&s->mu);
        while (!s->watch_stop) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 100 * 1000000L;
            if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
            if (pthread_cond_timedwait(&s->watch_cv, &s->mu, &ts) != 0) break;
        }
        if (s->watch_stop) {
            pthread_mutex_unlock(&s->mu);
            return NULL;
        }
        for (gen_job_t *j = s->jobs; j && n < 64; j = j->next) {
            pthread_mutex_lock(&j->mu);
            if (j->suspended && j->conn && !j->finished && !j->hung_up) {
                /* suspended: the connection cannot go away while we hold j->mu */
                const union MHD_ConnectionInfo *ci = MHD_get_connection_info(j->conn, MHD_CONNECTION_INFO_CONNECTION_FD);
                struct pollfd p = {.fd = ci ? ci->connect_fd : -1, .events = POLLRDHUP};
                if (p.fd >= 0 && poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR))) {
                    j->hung_up = true;
                    if (j->ro) rollout_abort(j->ro);
                    for (int i = 0; i < j->n_parts && n < 64; i++)
                        if (j->parts[i].submitted && !j->parts[i].done) ids[n++] = j->parts[i].id;
                }
            }
            pthread_mutex_unlock(&j->mu);
        }
        pthread_mutex_unlock(&s->mu);
        for (int i = 0; i < n; i++) engine_abort(s->engine, ids[i]);
        server_drain_drops(s); /* uploads dropped by the engine thread (a request's last release) */
    }
}

int api_watch_start(server_t *s) {
    pthread_cond_init(&s->watch_cv, NULL);
    if (pthread_create(&s->watch, NULL, watch_thread, s)) return cs_error_set(CS_ENOMEM, "cannot start a thread");
    s->watch_started = true;
    return CS_OK;
}

void api_watch_stop(server_t *s) {
    if (!s->watch_started) return;
    pthread_mutex_lock(&s->mu);
    s->watch_stop = true;
    pthread_cond_signal(&s->watch_cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->watch, NULL);
    pthread_cond_destroy(&s->watch_cv);
    s->watch_started = false;
}

void api_abort_all(server_t *s) {
    pthread_mutex_lock(&s->mu);
    for (gen_job_t *j = s->jobs; j; j = j->next) {
        pthread_mutex_lock(&j->mu);
        for (int i = 0; i < j->n_parts; i++)
            if (j->parts[i].submitted && !j->parts[i].done) engine_abort(s->engine, j->parts[i].id);
        if (j->ro && !j->finished) rollout_abort(j->ro);
        pthread_mutex_unlock(&j->mu);
    }
    pthread_mutex_unlock(&s->mu);
}

/* ---- request fields shared by completions and chat ---- */
static bool parse_sampling(server_t *s, json_t *b, bool chat, gen_job_t *j, gen_opts_t *o, int n_prompts, perr_t *e) {
    engine_request_t *rq = &o->rq;
    sampling_params_t *sp = &rq->sampling;
    sampling_params_default(sp);
    double d;
    long long v;
    d = sp->temperature;
    if (!get_num(b, "temperature", 0, 100, &d, e)) return false;
    sp->temperature = (float)d;
    d = sp->top_p;
    if (!get_num(b, "top_p", 0, 1, &d, e)) return false;
    if (field(b, "top_p") && d <= 0) return fail(e, 400, "top_p", "'top_p' must be in (0, 1], got %g", d);
    sp->top_p = (float)d;
    v = sp->top_k;
    if (!get_int(b, "top_k", -1, 1 << 30, &v, e)) return false;
    sp->top_k = (int)v;
    d = sp->min_p;
    if (!get_num(b, "min_p", 0, 1, &d, e)) return false;
    sp->min_p = (float)d;
    d = sp->presence_penalty;
    if (!get_num(b, "presence_penalty", -2, 2, &d, e)) return false;
    sp->presence_penalty = (float)d;
    d = sp->frequency_penalty;
    if (!get_num(b, "frequency_penalty", -2, 2, &d, e)) return false;
    sp->frequency_penalty = (float)d;
    d = sp->repetition_penalty;
    if (!get_num(b, "repetition_penalty", 0, 100, &d, e)) return false;
    if (field(b, "repetition_penalty") && d <= 0)
        return fail(e, 400, "repetition_penalty", "'repetition_penalty' must be > 0, got %g", d);
    sp->repetition_penalty = (float)d;
    if (field(b, "seed")) {
        v = 0;
        if (!get_int(b, "seed", LLONG_MIN, LLONG_MAX, &v, e)) return false;
        sp->seed = (uint64_t)v;
        sp->has_seed = true;
    }
    v = 1;
    if (!get_int(b, "n", 1, 1 << 20, &v, e)) return false;
    if (v * n_prompts > s->cfg.max_n)
        return fail(e, 400, "n", "n = %lld%s exceeds this server's limit of %d samples per request", v,
                    n_prompts > 1 ? " times the number of prompts" : "", s->cfg.max_n);
    rq->n = (int)v;
    gen_choice_t *nc = calloc((size_t)j->n_parts * (size_t)v, sizeof *nc);
    if (!nc) return fail(e, 500, NULL, "out of memory");
    free(j->choices); /* still empty: sized for n = 1 */
    j->choices = nc;
    j->n = (int)v;
    if (field(b, "best_of") && !(json_is_integer(field(b, "best_of")) && json_integer_value(field(b, "best_of")) == v))
        return fail(e, 400, "best_of", "best_of is not supported (only best_of == n)");
    if (field(b, "logit_bias") && !(json_is_object(field(b, "logit_bias")) && json_object_size(field(b, "logit_bias")) == 0))
        return fail(e, 400, "logit_bias", "logit_bias is not supported");
    /* max_tokens: completions default 16 (OpenAI), chat: up to the context */
    v = chat ? -1 : 16;
    const char *mt = chat && field(b, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
    if (field(b, mt)) {
        if (!get_int(b, mt, LLONG_MIN, LLONG_MAX, &v, e)) return false;
        if (v < 0) return fail(e, 400, mt, "'%s' must be at least 0, got %lld", mt, v);
        if (v > s->max_model_len)
            return fail(e, 400, mt, "'%s' = %lld exceeds this model's maximum context length of %d tokens", mt, v,
                        s->max_model_len);
    }
    rq->max_tokens = (int)v;
    v = 0;
    if (!get_int(b, "min_tokens", 0, 1 << 30, &v, e)) return false;
    rq->min_tokens = (int)v;
    json_t *stop = field(b, "stop");
    if (stop) {
        if (json_is_string(stop)) {
            o->stops[0] = json_string_value(stop);
            rq->n_stop = 1;
        } else if (json_is_array(stop)) {
            if (json_array_size(stop) > MAX_STOP_STRINGS)
                return fail(e, 400, "stop", "at most %d stop strings", MAX_STOP_STRINGS);
            size_t i;
            json_t *x;
            json_array_foreach(stop, i, x) {
                if (!json_is_string(x)) return fail(e, 400, "stop", "'stop' must be a string or a list of strings");
                o->stops[i] = json_string_value(x);
            }
            rq->n_stop = (int)json_array_size(stop);
        } else {
            return fail(e, 400, "stop", "'stop' must be a string or a list of strings");
        }
        for (int i = 0; i < rq->n_stop; i++)
            if (!o->stops[i][0]) return fail(e, 400, "stop", "stop strings must not be empty");
        rq->stop = o->stops;
        if (rq->n_stop && !s->tok) return fail(e, 400, "stop", "stop strings need the model's tokenizer");
    }
    json_t *sti = field(b, "stop_token_ids");
    if (sti) {
        if (!json_is_array(sti) || json_array_size(sti) > 256)
            return fail(e, 400, "stop_token_ids", "'stop_token_ids' must be a list of at most 256 token ids");
        o->stop_ids = malloc(sizeof(int32_t) * (json_array_size(sti) + 1));
        size_t i;
        json_t *x;
        json_array_foreach(sti, i, x) {
            if (!json_is_integer(x)) return fail(e, 400, "stop_token_ids", "'stop_token_ids' must be a list of integers");
            long long t = json_integer_value(x);
            if (t < 0 || t >= model_get_config(s->model)->vocab_size)
                return fail(e, 400, "stop_token_ids", "stop token id %lld is out of range", t);
            o->stop_ids[i] = (int32_t)t;
        }
        rq->stop_token_ids = o->stop_ids;
        rq->n_stop_token_ids = (int)json_array_size(sti);
    }
    bool b1 = false;
    if (!get_bool(b, "ignore_eos", &b1, e)) return false;
    rq->ignore_eos = b1;
    b1 = true;
    if (!get_bool(b, "skip_special_tokens", &b1, e)) return false;
    rq->keep_special_text = !b1;
    j->skip_special = b1;
    b1 = false;
    if (!get_bool(b, "return_tokens_as_token_ids", &b1, e)) return false;
    j->tok_ids = b1;
    b1 = false;
    if (!get_bool(b, "include_stop_str_in_output", &b1, e)) return false;
    if (b1) return fail(e, 400, "include_stop_str_in_output", "include_stop_str_in_output is not supported");
    const char *user = NULL;
    if (!get_str(b, "user", &user, e)) return false;
    json_t *rf = field(b, "response_format");
    if (rf) {
        const char *t = json_string_value(json_object_get(rf, "type"));
        if (!json_is_object(rf) || !t || strcmp(t, "text"))
            return fail(e, 400, "response_format", "response_format other than {\"type\": \"text\"} is not supported");
    }
    json_t *tc = field(b, "tool_choice");
    if (tc && !(json_is_string(tc) && (!strcmp(json_string_value(tc), "none") || !strcmp(json_string_value(tc), "auto"))))
        return fail(e, 400, "tool_choice", "tool_choice other than \"none\" or \"auto\" is not supported (tools are "
                                            "shown to the chat template; tool calls are not parsed out of the text)");
    /* logprobs: completions an integer, chat a boolean plus top_logprobs */
    sp->logprobs = -1;
    if (chat) {
        bool lp = false;
        if (!get_bool(b, "logprobs", &lp, e)) return false;
        v = 0;
        if (!get_int(b, "top_logprobs", 0, s->cfg.max_logprobs, &v, e)) return false;
        if (v > 0 && !lp) return fail(e, 400, "top_logprobs", "top_logprobs needs logprobs: true");
        if (lp) sp->logprobs = (int)v;
    } else {
        v = -1;
        if (!get_int(b, "logprobs", 0, s->cfg.max_logprobs, &v, e)) return false;
        sp->logprobs = (int)v;
    }
    sp->logprobs_mode = SAMPLING_LOGPROBS_RAW;
    j->logprobs = sp->logprobs;
    bool stream = false;
    if (!get_bool(b, "stream", &stream, e)) return false;
    j->stream = stream;
    json_t *so = field(b, "stream_options");
    if (so) {
        if (!json_is_object(so)) return fail(e, 400, "stream_options", "'stream_options' must be an object");
        if (!stream) return fail(e, 400, "stream_options", "stream_options is only allowed with stream: true");
        bool iu = false;
        if (!get_bool(so, "include_usage", &iu, e)) return false;
        j->include_usage = iu;
    }
    if (sampling_params_validate(sp)) return fail(e, 400, NULL, "%s", cs_error_last());
    return true;
}

/* a prompt given as token ids */
static bool ids_of(server_t *s, json_t *a, int32_t **out, int *n, perr_t *e) {
    size_t len = json_array_size(a);
    if (len == 0) return fail(e, 400, "prompt", "the prompt is empty");
    int32_t *ids = malloc(sizeof(int32_t) * len);
    if (!ids) return fail(e, 500, NULL, "out of memory");
    int vocab = model_get_config(s->model)->vocab_size;
    for (size_t i = 0; i < len; i++) {
        json_t *x = json_array_get(a, i);
        if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) >= vocab) {
            free(ids);
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
    if (ni == 0) return fail(e, 400, "prompt", "the prompt is empty");
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

/* ---- /v1/completions ---- */
static enum MHD_Result completions(server_t *s, conn_t *cn, struct MHD_Connection *c, json_t *b) {
    perr_t e = {0};
    served_adapter_t *ad = NULL;
    char *label = NULL;
    gen_job_t *j = NULL;
    gen_opts_t o = {0};
    enum MHD_Result ret;
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
        fail(&e, 400, "prompt", json_is_array(prompt) && json_array_size(prompt) == 0 ? "the prompt is empty"
                                : "'prompt' must be a string, a list of token ids, or a list of either");
        goto err;
    }
    if (n_prompts > MAX_PROMPTS) { fail(&e, 400, "prompt", "at most %d prompts per request", MAX_PROMPTS); goto err; }
    const char *suffix = NULL;
    if (!get_str(b, "suffix", &suffix, &e)) goto err;
    if (suffix && suffix[0]) { fail(&e, 400, "suffix", "suffix is not supported"); goto err; }
    if (!resolve_model(s, b, &ad, &label, &e)) goto err;
    bool draining;
    j = job_new(s, false, n_prompts, 1, &draining);
    if (!j) { fail(&e, draining ? 503 : 500, NULL, draining ? "the server is shutting down" : "out of memory"); goto err; }
    j->adapter = ad;
    ad = NULL;
    j->label = label;
    label = NULL;
    j->t_arrival = cn->t_arrival;
    const char *mname = NULL;
    get_str(b, "model", &mname, &e);
    j->model = strdup(mname ? mname : s->model_name);
    if (!parse_sampling(s, b, false, j, &o, n_prompts, &e)) goto err;
    bool echo = false;
    if (!get_bool(b, "echo", &echo, &e)) goto err;
    j->echo = echo;
    if (o.rq.max_tokens == 0 && !echo) { fail(&e, 400, "max_tokens", "max_tokens = 0 is only allowed with echo"); goto err; }
    if (echo && (j->logprobs >= 0 || o.rq.max_tokens == 0)) { /* score the prompt */
        o.rq.prompt_logprobs = true;
        o.rq.prompt_top_logprobs = j->logprobs > 0 ? j->logprobs : 0;
    }
    for (int i = 0; i < n_prompts; i++) {
        json_t *pi = list_of ? json_array_get(prompt, (size_t)i) : prompt;
        gen_part_t *p = &j->parts[i];
        if (json_is_string(pi)) {
            if (!text_prompt(s, json_string_value(pi), json_string_length(pi), true, &p->prompt, &p->n_prompt, &e)) goto err;
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
            if (echo && s->tok && tokenizer_decode(s->tok, p->prompt, (size_t)p->n_prompt, j->skip_special,
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
    ret = job_start(s, cn, c, j, &o);
    free(o.stop_ids);
    return ret;
err:
    free(o.stop_ids);
    free(label);
    if (ad) adapter_unpin(s, ad);
    if (j) {
        adapter_unpin(s, j->adapter);
        job_unref(j);
    }
    return reply_err(c, &e);
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
            sbuf_t t = {0};
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
                if (k) sb_add(&t, "\n", 1);
                sb_add(&t, json_string_value(text), json_string_length(text));
            }
            if (!wants_parts) json_object_set_new(mm, "content", json_stringn(t.p ? t.p : "", t.len));
            free(t.p);
        } else if (content && !json_is_string(content) && !json_is_null(content)) {
            json_decref(mm);
            json_decref(res);
            return fail(e, 400, "messages", "messages[%zu].content must be a string or a list of parts", i);
        }
        json_array_append_new(res, mm);
    }
    /* then exactly what apply_chat_template does: null keys dropped, reasoning aliased */
    *out = chat_template_hf_messages(res, true);
    json_decref(res);
    return *out != NULL || fail(e, 500, NULL, "out of memory");
}

/* render messages to the prompt text with the model's (or the request's) template */
static bool chat_render(server_t *s, json_t *b, char **text, size_t *len, bool *add_special, perr_t *e) {
    json_t *msgs = NULL;
    chat_template_t *t = s->tmpl, *own = NULL;
    bool wants_parts = s->tmpl_wants_parts;
    const char *req_tmpl = NULL;
    char err[1024];
    if (!get_str(b, "chat_template", &req_tmpl, e)) goto fail;
    if (req_tmpl) {
        if (chat_template_parse(req_tmpl, strlen(req_tmpl), &own, err, sizeof err)) {
            fail(e, 400, "chat_template", "chat_template: %s", err);
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
    if (!get_bool(b, "add_generation_prompt", &agp, e) || !get_bool(b, "continue_final_message", &cont, e)) goto fail;
    if (cont) { fail(e, 400, "continue_final_message", "continue_final_message is not supported"); goto fail; }
    *add_special = false;
    if (!get_bool(b, "add_special_tokens", add_special, e)) goto fail;
    json_t *ctx = json_object();
    json_object_set_new(ctx, "messages", msgs);
    msgs = NULL;
    json_object_set_new(ctx, "add_generation_prompt", json_boolean(agp));
    json_t *tools = field(b, "tools");
    if (tools && !json_is_array(tools)) {
        json_decref(ctx);
        fail(e, 400, "tools", "'tools' must be a list");
        goto fail;
    }
    json_object_set(ctx, "tools", tools ? tools : json_null());
    json_object_set_new(ctx, "documents", json_null());
    if (s->bos_token) json_object_set_new(ctx, "bos_token", json_string(s->bos_token));
    if (s->eos_token) json_object_set_new(ctx, "eos_token", json_string(s->eos_token));
    json_t *kw = field(b, "chat_template_kwargs");
    if (kw) {
        if (!json_is_object(kw)) {
            json_decref(ctx);
            fail(e, 400, "chat_template_kwargs", "'chat_template_kwargs' must be an object");
            goto fail;
        }
        json_object_update(ctx, kw);
    }
    int rc = chat_template_render(t, ctx, text, len, err, sizeof err);
    json_decref(ctx);
    if (rc) { fail(e, 400, "messages", "chat template: %s", err); goto fail; }
    chat_template_free(own);
    return true;
fail:
    json_decref(msgs);
    chat_template_free(own);
    return false;
}

/* ---- /v1/chat/completions ---- */
static enum MHD_Result chat(server_t *s, conn_t *cn, struct MHD_Connection *c, json_t *b) {
    perr_t e = {0};
    served_adapter_t *ad = NULL;
    char *label = NULL, *text = NULL;
    size_t tlen = 0;
    gen_job_t *j = NULL;
    gen_opts_t o = {0};
    enum MHD_Result ret;
    if (!json_object_get(b, "messages")) { fail(&e, 400, "messages", "'messages' is required"); goto err; }
    if (!resolve_model(s, b, &ad, &label, &e)) goto err;
    bool draining;
    j = job_new(s, true, 1, 1, &draining);
    if (!j) { fail(&e, draining ? 503 : 500, NULL, draining ? "the server is shutting down" : "out of memory"); goto err; }
    j->adapter = ad;
    ad = NULL;
    j->label = label;
    label = NULL;
    j->t_arrival = cn->t_arrival;
    const char *mname = NULL;
    get_str(b, "model", &mname, &e);
    j->model = strdup(mname ? mname : s->model_name);
    if (!parse_sampling(s, b, true, j, &o, 1, &e)) goto err;
    if (o.rq.max_tokens == 0) { fail(&e, 400, "max_tokens", "'max_tokens' must be at least 1"); goto err; }
    bool add_special = false;
    if (!chat_render(s, b, &text, &tlen, &add_special, &e)) goto err;
    gen_part_t *p = &j->parts[0];
    if (!text_prompt(s, text, tlen, add_special, &p->prompt, &p->n_prompt, &e)) goto err;
    if (!check_len(s, p->n_prompt, o.rq.max_tokens, &e)) goto err;
    free(text);
    ret = job_start(s, cn, c, j, &o);
    free(o.stop_ids);
    return ret;
err:
    free(text);
    free(o.stop_ids);
    free(label);
    if (ad) adapter_unpin(s, ad);
    if (j) {
        adapter_unpin(s, j->adapter);
        job_unref(j);
    }
    return reply_err(c, &e);
}

/* ---- /v1/rollout (rollout_api/) ---- */
/* a finished group (or, last, the summary): engine thread */
static void ro_emit(void *user, json_t *line, bool last) {
    gen_job_t *j = user;
    pthread_mutex_lock(&j->mu);
    if (j->stream) {
        char *txt = json_dumps(line, JSON_COMPACT);
        if (txt) {
            sb_add(&j->out, txt, strlen(txt));
            sb_add(&j->out, "\n", 1);
            free(txt);
        }
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

static enum MHD_Result rollout_run(server_t *s, conn_t *cn, struct MHD_Connection *c, json_t *b, json_t *sglang);
static enum MHD_Result rollout_abort_endpoint(server_t *s, struct MHD_Connection *c, json_t *b);

static enum MHD_Result rollout_endpoint(server_t *s, conn_t *cn, struct MHD_Connection *c, json_t *b) {
    return rollout_run(s, cn, c, b, NULL);
}

/* sglang (stolen): answer in SGLang's /generate shape instead */
/* the rollout's metrics taps: the same series as completions, labelled by adapter */
static void ro_obs_token(void *user, const char *adapter, double ttft_s, double itl_s) {
    server_t *s = user;
    const char *lab[] = {adapter ? adapter : s->model_name};
    if (ttft_s >= 0) metric_observe(s->m.ttft, lab, ttft_s);
    if (itl_s >= 0) metric_observe(s->m.itl, lab, itl_s);
    metric_inc(s->m.gen_tokens, lab, 1);
}

static void ro_obs_done(void *user, const char *adapter, int n_prompt, const char *finish, double e2e_s, double queue_s) {
    server_t *s = user;
    const char *lab[] = {adapter ? adapter : s->model_name};
    const char *rl[] = {lab[0], finish};
    metric_observe(s->m.e2e, lab, e2e_s);
    metric_observe(s->m.queue, lab, queue_s);
    metric_inc(s->m.prompt_tokens, lab, n_prompt);
    metric_inc(s->m.success, rl, 1);
}

static enum MHD_Result rollout_run(server_t *s, conn_t *cn, struct MHD_Connection *c, json_t *b, json_t *sglang) {
    bool draining;
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
                            .base_name = s->model_name, .vocab = model_get_config(s->model)->vocab_size,
                            .obs = {ro_obs_token, ro_obs_done, s}};
    char err[1536], param[64];
    rollout_t *ro = NULL;
    int st = rollout_start(s->engine, &lim, b, ro_emit, j, &ro, err, sizeof err, param, sizeof param);
    if (st) { /* nothing was emitted and nothing will be */
        pthread_mutex_lock(&j->mu);
        j->refs--;
        pthread_mutex_unlock(&j->mu);
        job_unref(j);
        return http_error(c, (unsigned)st, param[0] ? param : NULL, "%s", err);
    }
    pthread_mutex_lock(&j->mu);
    j->ro = ro;
    pthread_mutex_unlock(&j->mu);
    gen_opts_t none = {0};
    return job_start(s, cn, c, j, &none);
}

/* SGLang's POST /generate: input_ids (or text; or lists of them), sampling_params,
 * return_logprob, lora_path (an adapter name), rid; answered in SGLang's shape */
static enum MHD_Result sglang_generate(server_t *s, conn_t *cn, struct MHD_Connection *c, json_t *b) {
    json_t *ids = json_object_get(b, "input_ids"), *text = json_object_get(b, "text");
    if (json_is_true(json_object_get(b, "stream"))) return http_error(c, 400, "stream", "stream is not supported on /generate (use /v1/completions to stream tokens, or /v1/rollout with stream to get each group as it finishes)");
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
    json_t *sp = json_object_get(b, "sampling_params");
    json_t *samp = json_object();
    if (json_is_object(sp)) {
        const char *keys[] = {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                              "frequency_penalty", "stop", "stop_token_ids", "ignore_eos", "min_tokens"};
        for (size_t k = 0; k < sizeof keys / sizeof keys[0]; k++)
            if (json_object_get(sp, keys[k])) json_object_set(samp, keys[k], json_object_get(sp, keys[k]));
        json_t *mnt = json_object_get(sp, "max_new_tokens");
        if (mnt && !json_is_null(mnt)) json_object_set(samp, "max_tokens", mnt);
    }
    if (!json_object_get(samp, "max_tokens")) json_object_set_new(samp, "max_tokens", json_integer(128)); /* SGLang's default */
    json_object_set_new(samp, "logprobs", json_pack("{s:s}", "mode", "raw"));
    const char *rid = json_string_value(json_object_get(b, "rid"));
    json_t *groups = json_array();
    size_t i;
    json_t *p;
    json_array_foreach(prompts, i, p) {
        char gid[300];
        snprintf(gid, sizeof gid, "%s%s%zu", rid ? rid : "", rid ? "-" : "", i);
        if (!batch && rid) snprintf(gid, sizeof gid, "%s", rid);
        json_array_append_new(groups, json_pack("{s:s, s:O}", "group_id", gid, "input_ids", p));
    }
    json_decref(prompts);
    json_t *req = json_pack("{s:o, s:o}", "groups", groups, "sampling", samp);
    const char *lora = json_string_value(json_object_get(b, "lora_path"));
    if (lora) json_object_set_new(req, "adapter", json_string(lora));
    if (rid) json_object_set_new(req, "batch_id", json_string(rid));
    enum MHD_Result r = rollout_run(s, cn, c, req, json_pack("{s:b, s:b}", "batch", batch, "return_logprob",
                                                             json_is_true(json_object_get(b, "return_logprob"))));
    json_decref(req);
    return r;
}

/* POST /v1/pause {"mode": "abort"|"wait"|"keep"}: new requests are accepted and wait.
 * keep: running ones stop where they are (KV kept) and go on after /v1/resume; wait: running
 * ones finish first (the answer comes then); abort: running ones end now as aborted and
 * return their partial output. */
static enum MHD_Result pause_endpoint(server_t *s, struct MHD_Connection *c, json_t *b) {
    const char *mode = json_string_value(json_object_get(b, "mode"));
    if (!mode) mode = "keep";
    double t0 = cs_time_ms();
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
        return http_error(c, 400, "mode", "mode is \"abort\", \"wait\" or \"keep\"");
    }
    pthread_mutex_lock(&s->mu);
    s->paused = true;
    pthread_mutex_unlock(&s->mu);
    return http_json(c, 200, json_pack("{s:b, s:s, s:f}", "paused", 1, "mode", mode, "took_ms", cs_time_ms() - t0));
}

static enum MHD_Result resume_endpoint(server_t *s, struct MHD_Connection *c) {
    engine_set_pause(s->engine, ENGINE_RUN);
    pthread_mutex_lock(&s->mu);
    s->paused = false;
    pthread_mutex_unlock(&s->mu);
    return http_json(c, 200, json_pack("{s:b}", "paused", 0));
}

/* SGLang's POST /abort_request {rid | abort_all} */
static enum MHD_Result sglang_abort(server_t *s, struct MHD_Connection *c, json_t *b) {
    json_t *q = json_is_true(json_object_get(b, "abort_all")) ? json_pack("{s:b}", "all", 1)
                                                              : json_pack("{s:O}", "batch_id", json_object_get(b, "rid"));
    enum MHD_Result r = rollout_abort_endpoint(s, c, q);
    json_decref(q);
    return r;
}

static enum MHD_Result rollout_abort_endpoint(server_t *s, struct MHD_Connection *c, json_t *b) {
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

/* ---- /tokenize, /detokenize (vLLM's shapes) ---- */
static enum MHD_Result tokenize(server_t *s, struct MHD_Connection *c, json_t *b) {
    perr_t e = {0};
    int32_t *ids = NULL;
    int n = 0;
    if (field(b, "model")) {
        const char *m = NULL;
        if (!get_str(b, "model", &m, &e)) return reply_err(c, &e);
        pthread_mutex_lock(&s->mu);
        bool known = !strcmp(m, s->model_name) || adapter_find(s, m);
        pthread_mutex_unlock(&s->mu);
        if (!known) return http_error(c, 404, "model", "The model `%s` does not exist.", m);
    }
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

static enum MHD_Result detokenize(server_t *s, struct MHD_Connection *c, json_t *b) {
    perr_t e = {0};
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
static enum MHD_Result models(server_t *s, struct MHD_Connection *c) {
    json_t *data = json_array();
    json_array_append_new(data, json_pack("{s:s, s:s, s:I, s:s, s:s, s:n, s:i}", "id", s->model_name, "object", "model",
                                          "created", (json_int_t)s->created, "owned_by", "caraserve", "root", s->cfg.model,
                                          "parent", "max_model_len", s->max_model_len));
    pthread_mutex_lock(&s->mu);
    for (served_adapter_t *a = s->adapters; a; a = a->next) {
        if (a->unloading) continue;
        json_array_append_new(data, json_pack("{s:s, s:s, s:I, s:s, s:s, s:s, s:i}", "id", a->name, "object", "model",
                                              "created", (json_int_t)a->created, "owned_by", "caraserve", "root", a->path,
                                              "parent", s->model_name, "max_model_len", s->max_model_len));
    }
    pthread_mutex_unlock(&s->mu);
    return http_json(c, 200, json_pack("{s:s, s:o}", "object", "list", "data", data));
}

static bool valid_adapter_name(const char *n) {
    if (!n[0] || strlen(n) > 256) return false;
    for (const char *p = n; *p; p++)
        if ((unsigned char)*p < 0x20 || *p == '/') return false;
    return true;
}

/* Register NAME -> DIR (a new version when it exists and inplace). Validates the adapter
 * against the base model first, so a bad one is refused here and not at its first request. */
int server_add_adapter(server_t *s, const char *name, const char *dir, bool inplace, unsigned *status, char *err,
                       size_t errlen) {
    lora_adapter_t *a = NULL;
    if (!valid_adapter_name(name)) {
        *status = 400;
        snprintf(err, errlen, "invalid adapter name '%s'", name);
        return CS_EINVAL;
    }
    if (!strcmp(name, s->model_name)) {
        *status = 400;
        snprintf(err, errlen, "'%s' is the base model's name", name);
        return CS_EINVAL;
    }
    int rc = lora_adapter_load(dir, model_get_config(s->model), &a);
    if (rc) {
        *status = rc == CS_ENOTFOUND ? 404 : 400;
        snprintf(err, errlen, "adapter '%s' at %s: %s", name, dir, cs_error_last());
        return rc;
    }
    lora_adapter_free(a);
    pthread_mutex_lock(&s->mu);
    served_adapter_t *ad = adapter_find(s, name);
    if (ad && !inplace) {
        pthread_mutex_unlock(&s->mu);
        *status = 400;
        snprintf(err, errlen, "adapter '%s' is already loaded (use load_inplace: true to replace its weights)", name);
        return CS_EINVAL;
    }
    if (ad && ad->unloading) {
        pthread_mutex_unlock(&s->mu);
        *status = 409;
        snprintf(err, errlen, "adapter '%s' is being unloaded", name);
        return CS_EINVAL;
    }
    int ver = 0;
    rc = lora_registry_add(s->reg, name, dir, &ver);
    if (rc) {
        pthread_mutex_unlock(&s->mu);
        *status = 500;
        snprintf(err, errlen, "%s", cs_error_last());
        return rc;
    }
    if (!ad) {
        ad = calloc(1, sizeof *ad);
        ad->name = strdup(name);
        ad->next = s->adapters;
        s->adapters = ad;
    }
    free(ad->path);
    ad->path = strdup(dir);
    ad->created = time(NULL);
    pthread_mutex_unlock(&s->mu);
    return CS_OK;
}

static enum MHD_Result load_lora(server_t *s, struct MHD_Connection *c, json_t *b) {
    perr_t e = {0};
    const char *name = NULL, *path = NULL;
    bool inplace = false;
    if (!get_str(b, "lora_name", &name, &e) || !get_str(b, "lora_path", &path, &e) ||
        !get_bool(b, "load_inplace", &inplace, &e))
        return reply_err(c, &e);
    if (!name || !path) return http_error(c, 400, name ? "lora_path" : "lora_name", "'lora_name' and 'lora_path' are required");
    char err[1536], *real = NULL;
    int st = lora_path_check(s, path, &real, err, sizeof err);
    if (st) return http_error(c, (unsigned)st, "lora_path", "%s", err);
    unsigned status = 200;
    int rc = server_add_adapter(s, name, real, inplace, &status, err, sizeof err);
    free(real);
    if (rc) return http_error(c, status, "lora_path", "%s", err);
    char msg[512];
    snprintf(msg, sizeof msg, "Success: LoRA adapter '%s' added successfully.", name);
    return http_text(c, 200, "text/plain; charset=utf-8", strdup(msg), strlen(msg));
}

static enum MHD_Result unload_done(struct MHD_Connection *c, const char *name) {
    char msg[512];
    snprintf(msg, sizeof msg, "Success: LoRA adapter '%s' removed successfully.", name);
    return http_text(c, 200, "text/plain; charset=utf-8", strdup(msg), strlen(msg));
}

/* New requests for the adapter get 404 at once; the answer (and the removal) waits until
 * the requests in flight on it have finished, without holding an HTTP thread. */
static enum MHD_Result unload_lora(server_t *s, conn_t *cn, struct MHD_Connection *c, json_t *b) {
    perr_t e = {0};
    const char *name = NULL;
    if (!get_str(b, "lora_name", &name, &e)) return reply_err(c, &e);
    if (!name) return http_error(c, 400, "lora_name", "'lora_name' is required");
    pthread_mutex_lock(&s->mu);
    served_adapter_t *a = adapter_find(s, name);
    if (!a || a->unloading) {
        pthread_mutex_unlock(&s->mu);
        return http_error(c, 404, "lora_name", "The lora adapter '%s' cannot be found.", name);
    }
    a->unloading = true;
    if (a->in_flight == 0) {
        lora_registry_remove(s->reg, name);
        adapter_unlink(s, a);
        pthread_mutex_unlock(&s->mu);
        enum MHD_Result r = unload_done(c, name);
        adapter_free(a);
        return r;
    }
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

enum MHD_Result api_unload_resume(server_t *s, conn_t *cn, struct MHD_Connection *c) {
    cn->unload_waiting = false;
    pthread_mutex_lock(&s->mu);
    s->n_unload_waiting--;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return unload_done(c, cn->unload_name);
}

/* ---- versioned adapters (the rollout API): PUT/DELETE /v1/adapters/{name}/versions/{v}, GET /v1/adapters ---- */
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

/* the files of a refused upload (its own directory) */
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
            json_array_append_new(out, json_pack("{s:i, s:s, s:i, s:b}", "version", vi[i].version, "tier",
                                                 lora_state_name(vi[i].state), "inflight", vi[i].refs, "active",
                                                 vi[i].active));
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

static enum MHD_Result put_version(server_t *s, struct MHD_Connection *c, const char *url, const char *body, size_t len) {
    perr_t e = {0};
    char name[257];
    int version;
    if (!parse_version_url(url, name, sizeof name, &version))
        return http_error(c, 404, NULL, "PUT /v1/adapters/NAME/versions/V (V a positive integer)");
    if (!valid_adapter_name(name) || !strcmp(name, s->model_name)) return http_error(c, 400, NULL, "invalid adapter name '%s'", name);
    const char *apply = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "apply");
    const char *activate_s = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "activate");
    const char *keep_s = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "keep_versions");
    if (apply && strcmp(apply, "next_request") && strcmp(apply, "abort_inflight") && strcmp(apply, "pause_keep"))
        return http_error(c, 400, "apply", "apply is next_request, abort_inflight or pause_keep");
    if (activate_s && strcmp(activate_s, "true") && strcmp(activate_s, "false"))
        return http_error(c, 400, "activate", "activate is true or false");
    bool activate = !activate_s || !strcmp(activate_s, "true");
    if (!activate && apply && strcmp(apply, "next_request"))
        return http_error(c, 400, "apply", "apply=%s needs activate=true (a staged version runs nothing yet)", apply);
    int keep = 0;
    if (keep_s) {
        char *end;
        long k = strtol(keep_s, &end, 10);
        if (*end || end == keep_s || k < 1 || k > 1000)
            return http_error(c, 400, "keep_versions", "keep_versions is an integer from 1 to 1000");
        keep = (int)k;
    }
    double t0 = cs_time_ms();
    const char *ct = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_TYPE);
    char *dir = NULL;
    char err[1536];
    size_t nbytes = 0;
    bool uploaded = false; /* dir is ours: removed again when the upload is refused */
    char prev_dir[4096] = "";
    if (len == 0) { /* no body: activate a kept (staged or older) version */
        if (!activate) return http_error(c, 400, NULL, "an empty PUT activates a kept version: activate=false makes no sense");
        if (lora_registry_activate(s->reg, name, version, keep, prev_dir, sizeof prev_dir))
            return http_error(c, 404, "version", "%s (an empty body activates a kept version)", cs_error_last());
        pthread_mutex_lock(&s->mu);
        served_adapter_t *ad = adapter_find(s, name);
        if (ad) {
            free(ad->path);
            ad->path = strdup(prev_dir);
            ad->created = time(NULL);
        }
        pthread_mutex_unlock(&s->mu);
        goto applied;
    }
    lora_state st0;
    if (!activate && lora_registry_state(s->reg, name, &st0, NULL))
        return http_error(c, 400, "activate", "adapter '%s' has no active version: its first version must be activated", name);
    if (ct && !strncmp(ct, "application/json", 16)) { /* {"path": DIR} under --lora-root */
        json_error_t je;
        json_t *b = json_loadb(body, len, 0, &je);
        const char *path = json_string_value(json_object_get(b, "path"));
        if (!path) {
            json_decref(b);
            return http_error(c, 400, "path", "a JSON body is {\"path\": DIR}");
        }
        int st = lora_path_check(s, path, &dir, err, sizeof err);
        json_decref(b);
        if (st) return http_error(c, (unsigned)st, "path", "%s", err);
    } else { /* the raw adapter_model.safetensors */
        json_t *cfg = upload_config(c, body, len, &e);
        if (!cfg) return reply_err(c, &e);
        /* a directory of its own (UPLOAD_DIR/NAME/vV-XXXXXX): an upload refused below, or a
         * concurrent one, never touches the files of a version already kept */
        char sub[512];
        snprintf(sub, sizeof sub, "%s/%s", s->upload_dir, name);
        mkdir(sub, 0700);
        size_t dl = strlen(sub) + 40;
        dir = malloc(dl);
        if (dir) snprintf(dir, dl, "%s/v%d-XXXXXX", sub, version);
        if (!dir || !mkdtemp(dir)) {
            free(dir);
            json_decref(cfg);
            return http_error(c, 500, NULL, "cannot create a directory under %s", s->upload_dir);
        }
        uploaded = true;
        char *f1 = cs_path_join(dir, "adapter_model.safetensors"), *f2 = cs_path_join(dir, "adapter_config.json");
        char *cj = json_dumps(cfg, JSON_INDENT(1));
        json_decref(cfg);
        bool ok = f1 && f2 && cj && write_file(f1, body, len) && write_file(f2, cj, strlen(cj));
        free(f1);
        free(f2);
        free(cj);
        if (!ok) {
            remove_upload(dir);
            free(dir);
            return http_error(c, 500, NULL, "cannot store the upload under %s", s->upload_dir);
        }
    }
    lora_adapter_t *a = NULL; /* refused here if it does not fit the base model */
    if (lora_adapter_load(dir, model_get_config(s->model), &a)) {
        snprintf(err, sizeof err, "adapter '%s' version %d: %s", name, version, cs_error_last());
        if (uploaded) remove_upload(dir);
        free(dir);
        return http_error(c, 400, NULL, "%s", err);
    }
    nbytes = a->nbytes;
    lora_adapter_free(a);
    pthread_mutex_lock(&s->mu);
    served_adapter_t *ad = adapter_find(s, name);
    if (ad && ad->unloading) {
        pthread_mutex_unlock(&s->mu);
        if (uploaded) remove_upload(dir);
        free(dir);
        return http_error(c, 409, NULL, "adapter '%s' is being unloaded", name);
    }
    int arc = lora_registry_add_ex(s->reg, name, dir, version, activate, keep, NULL);
    if (arc) {
        snprintf(err, sizeof err, "%s", cs_error_last());
        pthread_mutex_unlock(&s->mu);
        if (uploaded) remove_upload(dir);
        free(dir);
        return http_error(c, arc == CS_ENOMEM ? 500 : 409, "version", "%s", err);
    }
    if (!ad) {
        ad = calloc(1, sizeof *ad);
        ad->name = strdup(name);
        ad->next = s->adapters;
        s->adapters = ad;
    }
    if (activate) {
        free(ad->path);
        ad->path = dir;
        ad->created = time(NULL);
    } else {
        free(dir);
    }
    pthread_mutex_unlock(&s->mu);
applied:;
    int aborted = 0, moved = 0;
    bool pending = false;
    if (activate && apply && !strcmp(apply, "abort_inflight")) aborted = abort_adapter_requests(s, name);
    if (activate && apply && !strcmp(apply, "pause_keep")) {
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

static enum MHD_Result delete_version(server_t *s, struct MHD_Connection *c, const char *url) {
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

static enum MHD_Result list_adapters(server_t *s, struct MHD_Connection *c) {
    json_t *a = json_array();
    pthread_mutex_lock(&s->mu);
    for (served_adapter_t *ad = s->adapters; ad; ad = ad->next) {
        lora_state st = LORA_ON_DISK;
        int ver = 0;
        if (ad->unloading || lora_registry_state(s->reg, ad->name, &st, &ver)) continue;
        json_t *loaded = json_array(), *kept = kept_versions_json_ex(s, ad->name, true, loaded);
        json_array_append_new(a, json_pack("{s:s, s:i, s:o, s:o, s:i, s:s, s:s}", "name", ad->name, "active_version", ver,
                                           "loaded_versions", loaded, "versions", kept, "inflight", ad->in_flight, "tier",
                                           lora_state_name(st), "path", ad->path ? ad->path : ""));
    }
    pthread_mutex_unlock(&s->mu);
    return http_json(c, 200, a);
}

/* ---- /metrics ---- */
static const double LAT_BUCKETS[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                                     2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
#define N_LAT (int)(sizeof LAT_BUCKETS / sizeof LAT_BUCKETS[0])

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
    static const char *const files[] = {"adapter_model.safetensors", "adapter_config.json"};
    for (int i = 0; i < n; i++) {
        for (size_t k = 0; k < CS_ARRAY_LEN(files); k++) {
            char *f = cs_path_join(drops[i], files[k]);
            if (f) unlink(f);
            free(f);
        }
        rmdir(drops[i]);
        free(drops[i]);
    }
    free(drops);
}

void server_on_load_time(void *user, double seconds) {
    server_t *s = user;
    if (s->m.lora_load) metric_observe(s->m.lora_load, NULL, seconds);
}

int server_metrics_init(server_t *s) {
    server_metrics_t *m = &s->m;
    pthread_mutex_init(&m->mu, NULL);
    if (!(m->reg = metrics_new())) return cs_error_set(CS_ENOMEM, "out of memory");
    const char *const adapter[] = {"adapter", NULL};
    const char *const fin[] = {"adapter", "finished_reason", NULL};
    const char *const tier[] = {"tier", NULL};
    char n[128];
#define NAME(x) (snprintf(n, sizeof n, "%s%s", s->cfg.metrics_prefix, x), n)
    m->ttft = metrics_histogram(m->reg, NAME("time_to_first_token_seconds"), "Time from arrival to the first token.",
                                adapter, LAT_BUCKETS, N_LAT);
    m->itl = metrics_histogram(m->reg, NAME("inter_token_latency_seconds"), "Time between consecutive tokens of a sample.",
                               adapter, LAT_BUCKETS, N_LAT);
    m->e2e = metrics_histogram(m->reg, NAME("e2e_request_latency_seconds"), "Time from arrival to the last token.",
                               adapter, LAT_BUCKETS, N_LAT);
    m->queue = metrics_histogram(m->reg, NAME("request_queue_time_seconds"),
                                 "Time a request waited before it was first scheduled.", adapter, LAT_BUCKETS, N_LAT);
    m->prompt_tokens = metrics_counter(m->reg, NAME("prompt_tokens_total"), "Prompt tokens of finished requests.", adapter);
    m->gen_tokens = metrics_counter(m->reg, NAME("generation_tokens_total"), "Generated tokens.", adapter);
    m->success = metrics_counter(m->reg, NAME("request_success_total"), "Finished requests by finish reason.", fin);
    m->running = metrics_gauge(m->reg, NAME("num_requests_running"), "Sequences running in the engine.", NULL);
    m->waiting = metrics_gauge(m->reg, NAME("num_requests_waiting"), "Sequences waiting for the engine.", NULL);
    m->kv_usage = metrics_gauge(m->reg, NAME("kv_cache_usage_perc"),
                                "Fraction of KV-cache blocks held by sequences (1 = full).", NULL);
    m->prefix_queries = metrics_counter(m->reg, NAME("prefix_cache_queries_total"),
                                        "Prompt tokens looked up in the prefix cache.", NULL);
    m->prefix_hits = metrics_counter(m->reg, NAME("prefix_cache_hits_total"),
                                     "Prompt tokens whose KV came from the prefix cache.", NULL);
    m->preemptions = metrics_counter(m->reg, NAME("num_preemptions_total"), "Sequences preempted (KV cache full).", NULL);
    m->prefill_tokens = metrics_counter(m->reg, NAME("prefill_tokens_total"),
                                        "Prompt tokens computed (not taken from the prefix cache or a group's shared blocks).",
                                        NULL);
    m->lora_tier = metrics_gauge(m->reg, NAME("lora_adapters"),
                                 "Adapters by tier: registered (served names), host (resident in memory), loading.", tier);
    static const double LOAD_BUCKETS[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0};
    m->lora_load = metrics_histogram(m->reg, NAME("lora_load_seconds"), "Adapter load time, disk to host memory.", NULL,
                                     LOAD_BUCKETS, (int)(sizeof LOAD_BUCKETS / sizeof LOAD_BUCKETS[0]));
    m->lora_hits = metrics_counter(m->reg, NAME("lora_cache_hits_total"), "Adapter acquires that found it resident.", NULL);
    m->lora_misses = metrics_counter(m->reg, NAME("lora_cache_misses_total"), "Adapter acquires that started a load.", NULL);
#undef NAME
    if (!m->ttft || !m->itl || !m->e2e || !m->queue || !m->prompt_tokens || !m->gen_tokens || !m->success ||
        !m->running || !m->waiting || !m->kv_usage || !m->prefix_queries || !m->prefix_hits || !m->preemptions ||
        !m->lora_tier || !m->lora_load || !m->lora_hits || !m->lora_misses || !m->prefill_tokens)
        return cs_error_set(CS_ENOMEM, "metrics: %s", cs_error_last());
    return CS_OK;
}

void server_metrics_free(server_t *s) {
    metrics_free(s->m.reg);
    s->m.reg = NULL;
    pthread_mutex_destroy(&s->m.mu);
}


static enum MHD_Result metrics_endpoint(server_t *s, struct MHD_Connection *c) {
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
        pthread_mutex_unlock(&m->mu);
        metric_set(m->lora_tier, (const char *[]){"registered"}, ls.n_registered);
        metric_set(m->lora_tier, (const char *[]){"host"}, ls.n_resident);
        metric_set(m->lora_tier, (const char *[]){"loading"}, ls.n_loading);
    }
    size_t len = 0;
    char *txt = metrics_render(m->reg, &len);
    if (!txt) return http_error(c, 500, NULL, "out of memory");
    return http_text(c, 200, "text/plain; version=0.0.4; charset=utf-8", txt, len);
}

/* ---- routing (the table: server/routes.c) ---- */
static enum MHD_Result route(server_t *s, conn_t *cn, struct MHD_Connection *c, const char *method, const char *url,
                             const char *body, size_t body_len) {
    const route_t *rt = route_find(url);
    if (!rt) return http_error(c, 404, NULL, "no route %s %s", method, url);
    pthread_mutex_lock(&s->mu);
    bool ready = s->ready, draining = s->draining;
    pthread_mutex_unlock(&s->mu);
    if ((rt->flags & ROUTE_READY) && !ready) return http_error(c, 503, NULL, "the model is loading");
    if (!route_allows(rt, method)) {
        char m[64];
        return http_error(c, 405, NULL, "use %s %s", route_methods_text(rt, m, sizeof m), url);
    }
    switch (rt->id) { /* the routes without a JSON body */
    case R_HEALTH:
        if (!ready || draining) return http_error(c, 503, NULL, draining ? "shutting down" : "the model is loading");
        return http_text(c, 200, "text/plain; charset=utf-8", strdup(""), 0);
    case R_VERSION: return http_json(c, 200, json_pack("{s:s}", "version", PACKAGE_VERSION));
    case R_METRICS: return metrics_endpoint(s, c);
    case R_MODELS: return models(s, c);
    case R_ADAPTERS: return list_adapters(s, c);
    case R_ADAPTER_VERSION:
        return !strcmp(method, "PUT") ? put_version(s, c, url, body, body_len) : delete_version(s, c, url);
    default: break;
    }
    CS_ASSERT(rt->flags & ROUTE_JSON);
    json_error_t je;
    json_t *b = json_loadb(body, body_len, 0, &je);
    if (!b) return http_error(c, 400, NULL, "invalid JSON body: %s (line %d, column %d)", je.text, je.line, je.column);
    if (!json_is_object(b)) {
        json_decref(b);
        return http_error(c, 400, NULL, "the request body must be a JSON object");
    }
    enum MHD_Result r;
    if ((rt->flags & ROUTE_GENERATES) && draining) {
        r = http_error(c, 503, NULL, "the server is shutting down");
    } else {
        switch (rt->id) {
        case R_COMPLETIONS: r = completions(s, cn, c, b); break;
        case R_CHAT: r = chat(s, cn, c, b); break;
        case R_ROLLOUT: r = rollout_endpoint(s, cn, c, b); break;
        case R_ROLLOUT_ABORT: r = rollout_abort_endpoint(s, c, b); break;
        case R_GENERATE: r = sglang_generate(s, cn, c, b); break;
        case R_ABORT_REQUEST: r = sglang_abort(s, c, b); break;
        case R_PAUSE: r = pause_endpoint(s, c, b); break;
        case R_RESUME: r = resume_endpoint(s, c); break;
        case R_TOKENIZE: r = tokenize(s, c, b); break;
        case R_DETOKENIZE: r = detokenize(s, c, b); break;
        case R_LOAD_LORA: r = load_lora(s, c, b); break;
        case R_UNLOAD_LORA: r = unload_lora(s, cn, c, b); break;
        default: r = http_error(c, 500, NULL, "route %s has no handler", rt->path); break;
        }
    }
    json_decref(b);
    return r;
}

enum MHD_Result api_dispatch(server_t *s, conn_t *cn, struct MHD_Connection *c, const char *method, const char *url,
                             const char *body, size_t body_len) {
    return route(s, cn, c, method, url, body, body_len);
}
