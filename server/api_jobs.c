/* api_jobs.c: the jobs that generation requests become (api_internal.h). A job is one
 * engine request per prompt (each with n samples), whose sink runs on the engine thread and
 * appends to the job under its mutex, or a rollout batch (rollout_api/routes.c). A streaming
 * job's connection reads Server-Sent Events (or a rollout's NDJSON lines) from the job's
 * buffer and suspends itself when the buffer is empty; the sink resumes it. A non-streaming
 * job suspends the connection until the last engine request is done, then answers in one
 * piece. The job is freed when the connection, the stream reader and every engine request
 * have let go of it. Also the watcher of suspended connections whose client hung up, and the
 * aborts of shutdown and /v1/pause. */
#define _GNU_SOURCE 1 /* POLLRDHUP */
#include <malloc.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rollout_api/routes.h"
#include "server/api_internal.h"
#include "text/tool_calls.h"

/* ---- jobs ---- */
/* tokens with logprobs in a completions (object of arrays) or chat (array) logprobs value */
static size_t lp_tokens(const lp_text_t *lp) { return lp->n; }

static void lp_text_free(lp_text_t *lp) {
    for (int k = 0; k < 4; k++) free(lp->a[k].p);
}

/* V's compact JSON appended to B (after a comma when SEP) */
static void buf_json(cs_buf_t *b, const json_t *v, bool sep) {
    if (sep) cs_buf_add(b, ",", 1);
    char small[256];
    size_t n = json_dumpb(v, small, sizeof small, JSON_COMPACT | JSON_ENCODE_ANY);
    if (n && n <= sizeof small) {
        cs_buf_add(b, small, n);
        return;
    }
    char *big = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    if (big) cs_buf_add(b, big, strlen(big));
    free(big);
}

/* a job holding this many tokens with logprobs (their top-k objects: about 2 KB each at 20)
 * gives the heap back to the system when it is freed: glibc keeps freed small blocks in its
 * arenas otherwise, and one 32k-token echo left 760 MB resident while idle */
#define TRIM_LP_TOKENS 4096

static void job_free(gen_job_t *j) {
    size_t lp = 0;
    for (int i = 0; i < j->n_parts; i++) lp += lp_tokens(&j->parts[i].echo_lp);
    for (int i = 0; i < j->n_parts * j->n; i++) lp += lp_tokens(&j->choices[i].lp);
    for (int i = 0; i < j->n_parts; i++) {
        free(j->parts[i].prompt);
        free(j->parts[i].prompt_text);
        lp_text_free(&j->parts[i].echo_lp);
        json_decref(j->parts[i].plp);
    }
    for (int i = 0; i < j->n_parts * j->n; i++) {
        free(j->choices[i].text.p);
        lp_text_free(&j->choices[i].lp);
    }
    free(j->parts);
    free(j->choices);
    free(j->model);
    free(j->tool_name);
    free(j->label);
    free(j->out.p);
    free(j->err_msg);
    rollout_release(j->ro);
    json_decref(j->ro_groups);
    json_decref(j->ro_summary);
    json_decref(j->sglang);
    pthread_mutex_destroy(&j->mu);
    free(j);
#ifdef __GLIBC__
    if (lp >= TRIM_LP_TOKENS) malloc_trim(0);
#endif
}

void job_unref(gen_job_t *j) {
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

/* the draining check and the count are one step under s->mu, so the drain never misses a job */
gen_job_t *job_new(server_t *s, bool chat, int n_parts, int n, bool *draining) {
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

/* one token of a completions logprobs value: v[0..3] its entries of tokens, token_logprobs,
 * top_logprobs and text_offset (new references); *offset advances by its characters */
static void lp_legacy_token(const gen_job_t *j, int32_t tok, float logprob, bool has_lp, int n_top,
                            const int32_t *top_ids, const float *top_lps, size_t *offset, json_t *v[4]) {
    json_t *ts = tok_json(j, tok);
    const char *tstr = json_string_value(ts);
    v[3] = json_integer((json_int_t)*offset);
    *offset += cs_utf8_count(tstr, strlen(tstr));
    v[0] = ts;
    v[1] = has_lp ? cs_json_logprob(logprob) : json_null();
    /* vLLM's order: the chosen token, then the alternatives by rank (at most n_top + 1) */
    json_t *top = json_null();
    if (has_lp) {
        top = json_object();
        json_object_set_new(top, tstr, cs_json_logprob(logprob));
        for (int i = 0; top_ids && i < n_top; i++) {
            if (top_ids[i] < 0) continue;
            json_t *k = tok_json(j, top_ids[i]);
            if (!json_object_get(top, json_string_value(k))) json_object_set_new(top, json_string_value(k), cs_json_logprob(top_lps[i]));
            json_decref(k);
        }
    }
    v[2] = top;
}

static const char *const LP_KEYS[4] = {"tokens", "token_logprobs", "top_logprobs", "text_offset"};

/* append one token to a completions logprobs object (a stream's event) */
static void lp_legacy_add(const gen_job_t *j, json_t *lp, int32_t tok, float logprob, bool has_lp, int n_top,
                          const int32_t *top_ids, const float *top_lps, size_t *offset) {
    json_t *v[4];
    lp_legacy_token(j, tok, logprob, has_lp, n_top, top_ids, top_lps, offset, v);
    for (int k = 0; k < 4; k++) json_array_append_new(json_object_get(lp, LP_KEYS[k]), v[k]);
}

/* the same token appended to the text of a response being built */
static void lp_legacy_add_text(const gen_job_t *j, lp_text_t *lp, int32_t tok, float logprob, bool has_lp, int n_top,
                               const int32_t *top_ids, const float *top_lps, size_t *offset) {
    json_t *v[4];
    lp_legacy_token(j, tok, logprob, has_lp, n_top, top_ids, top_lps, offset, v);
    for (int k = 0; k < 4; k++) {
        buf_json(&lp->a[k], v[k], lp->n > 0);
        json_decref(v[k]);
    }
    lp->n++;
}

/* chat's logprobs entry of one token: top_logprobs as vLLM lists them, the chosen token
 * first, then the best others, n_top in all */
static json_t *lp_chat_entry(const gen_job_t *j, int32_t tok, float logprob, int n_top, const int32_t *top_ids,
                             const float *top_lps) {
    json_t *ts = tok_json(j, tok);
    json_t *tops = json_array();
    for (int i = -1; i < n_top && (int)json_array_size(tops) < n_top; i++) {
        if (i >= 0 && (top_ids[i] < 0 || top_ids[i] == tok)) continue;
        json_t *k = i < 0 ? json_incref(ts) : tok_json(j, top_ids[i]);
        json_array_append_new(tops, json_pack("{s:o, s:o, s:o}", "token", k, "logprob",
                                              cs_json_logprob(i < 0 ? logprob : top_lps[i]), "bytes",
                                              bytes_json(json_string_value(k))));
    }
    return json_pack("{s:o, s:o, s:o, s:o}", "token", ts, "logprob", cs_json_logprob(logprob), "bytes",
                     bytes_json(json_string_value(ts)), "top_logprobs", tops);
}

/* vLLM's prompt_logprobs: null for the first position, then {"id": {"logprob", "rank",
 * "decoded_token"}} with the prompt's token first and the best j->prompt_logprobs after it */
static json_t *plp_json(const gen_job_t *j, const gen_part_t *p, const engine_event_t *ev) {
    json_t *a = json_array();
    json_array_append_new(a, json_null());
    int stride = ev->prompt_n_top, k = j->prompt_logprobs < stride ? j->prompt_logprobs : stride;
    for (int t = 1; t < p->n_prompt; t++) {
        json_t *d = json_object();
        for (int i = -1; i < k; i++) {
            int32_t id = i < 0 ? p->prompt[t] : ev->prompt_top_ids[(size_t)t * stride + i];
            char key[16];
            snprintf(key, sizeof key, "%d", id);
            if (id < 0 || json_object_get(d, key)) continue;
            float lp = i < 0 ? ev->prompt_logprobs[t] : ev->prompt_top_logprobs[(size_t)t * stride + i];
            json_object_set_new(d, key, json_pack("{s:o, s:i, s:o}", "logprob", cs_json_logprob(lp), "rank",
                                                  i < 0 ? ev->prompt_ranks[t] : i + 1, "decoded_token", tok_json(j, id)));
        }
        json_array_append_new(a, d);
    }
    return a;
}

static json_t *usage_of(const gen_job_t *j, long long prompt, long long completion, long long cached) {
    json_t *u = json_pack("{s:I, s:I, s:I}", "prompt_tokens", (json_int_t)prompt, "completion_tokens",
                          (json_int_t)completion, "total_tokens", (json_int_t)(prompt + completion));
    if (j->srv->cfg.enable_prompt_tokens_details) /* vLLM: only with --enable-prompt-tokens-details */
        json_object_set_new(u, "prompt_tokens_details", json_pack("{s:I}", "cached_tokens", (json_int_t)cached));
    return u;
}

static json_t *usage_json(const gen_job_t *j) {
    long long prompt = 0, cached = 0;
    for (int i = 0; i < j->n_parts; i++) {
        prompt += j->parts[i].n_prompt;
        cached += j->parts[i].n_cached;
    }
    return usage_of(j, prompt, j->completion_tokens, cached);
}

/* ---- SSE ---- */
static void sse_json(gen_job_t *j, json_t *o) {
    api_frame(&j->out, o, false);
    json_decref(o);
}

static json_t *chunk_new(gen_job_t *j) {
    json_t *o = json_pack("{s:s, s:s, s:I, s:s, s:[]}", "id", j->id, "object",
                          j->chat ? "chat.completion.chunk" : "text_completion", "created", (json_int_t)j->created,
                          "model", j->model, "choices");
    if (j->include_usage) json_object_set_new(o, "usage", json_null());
    return o;
}

/* a chat chunk of one choice: its delta (taken), logprobs (or NULL), finish reason (or NULL) */
static void sse_delta(gen_job_t *j, int index, json_t *delta, json_t *lp, const char *finish) {
    json_t *o = chunk_new(j);
    if (j->continuous_usage) { /* vLLM: this choice's prompt and tokens so far */
        const gen_part_t *p = &j->parts[index / j->n];
        json_object_set_new(o, "usage", usage_of(j, p->n_prompt, j->choices[index].n_tokens, p->n_cached));
    }
    if (!json_object_get(delta, "reasoning_content")) /* read by SGLang-style clients */
        json_object_set_new(delta, "reasoning_content", json_null());
    json_t *c = json_pack("{s:i, s:o, s:o, s:o}", "index", index, "delta", delta, "logprobs",
                          lp ? json_pack("{s:o}", "content", lp) : json_null(), "finish_reason",
                          finish ? json_string(finish) : json_null());
    json_array_append_new(json_object_get(o, "choices"), c);
    sse_json(j, o);
}

/* one choice's chunk: text delta, its logprobs (or NULL), finish reason (or NULL) */
static void sse_choice(gen_job_t *j, int index, const char *text, size_t len, json_t *lp, const char *finish,
                       bool role) {
    json_t *c;
    if (j->chat) {
        json_t *delta = json_object();
        if (role) {
            json_object_set_new(delta, "role", json_string("assistant"));
            json_object_set_new(delta, "content", json_string(""));
        } else if (len || !finish) {
            json_object_set_new(delta, "content", jstr(text, len));
        }
        sse_delta(j, index, delta, lp, finish);
        return;
    } else {
        c = json_pack("{s:i, s:o, s:o, s:o}", "index", index, "text", jstr(text, len), "logprobs",
                      lp ? lp : json_null(), "finish_reason", finish ? json_string(finish) : json_null());
    }
    json_t *o = chunk_new(j);
    if (j->continuous_usage) { /* vLLM: this choice's prompt and tokens so far */
        const gen_part_t *p = &j->parts[index / j->n];
        json_object_set_new(o, "usage", usage_of(j, p->n_prompt, j->choices[index].n_tokens, p->n_cached));
    }
    json_array_append_new(json_object_get(o, "choices"), c);
    sse_json(j, o);
}

/* ---- reasoning and tool calls in chat replies ---- */
#define THINK_OPEN "<think>"
#define THINK_CLOSE "</think>"

/* A reply t[0, n) as vLLM's reasoning parsers split it: reasoning t[r0, r1), content from c0
 * (t[c0, c1) can go out now). Streaming (!final), an undecided start and what may begin
 * </think> are held back. */
typedef struct split {
    size_t r0, r1, c0, c1;
} split_t;

static bool prefix_of(const char *t, size_t n, const char *word) { return n < strlen(word) && !memcmp(word, t, n); }

static split_t split_reply(int mode, const char *t, size_t n, bool final) {
    split_t sp = {0, 0, 0, n};
    if (!mode) return sp;
    bool open = n >= strlen(THINK_OPEN) && !memcmp(t, THINK_OPEN, strlen(THINK_OPEN));
    if (!open && !final && prefix_of(t, n, THINK_OPEN)) return (split_t){0, 0, 0, 0}; /* undecided */
    if (!open && mode == REASONING_QWEN3) return sp; /* no thinking: all content */
    sp.r0 = open ? strlen(THINK_OPEN) : 0;
    const char *close = NULL;
    for (size_t i = sp.r0; i + strlen(THINK_CLOSE) <= n && !close; i++)
        if (!memcmp(t + i, THINK_CLOSE, strlen(THINK_CLOSE))) close = t + i;
    if (close) {
        sp.r1 = (size_t)(close - t);
        sp.c0 = sp.r1 + strlen(THINK_CLOSE);
        return sp;
    }
    sp.r1 = n; /* still thinking: hold what may begin </think> */
    for (size_t k = strlen(THINK_CLOSE) - 1; !final && k > 0; k--)
        if (k <= n - sp.r0 && !memcmp(t + n - k, THINK_CLOSE, k)) {
            sp.r1 = n - k;
            break;
        }
    sp.c0 = sp.c1 = n;
    return sp;
}

/* the calls in a reply's content t[0, n) (NULL: none), *content_len the content before them */
static json_t *content_calls(gen_job_t *j, const char *t, size_t n, size_t *content_len) {
    json_t *calls = NULL;
    *content_len = n;
    if (!j->tool_fmt) return NULL;
    if (j->tool_fmt >= TOOLS_REQUIRED) { /* the reply is the JSON of the calls (or of one's arguments) */
        json_t *v = json_loadb(t, n, 0, NULL);
        if (j->tool_fmt == TOOLS_NAMED && json_is_object(v)) {
            calls = json_pack("[{s:s, s:O}]", "name", j->tool_name, "arguments", v);
        } else if (j->tool_fmt == TOOLS_REQUIRED && json_is_array(v)) {
            calls = json_array();
            size_t k;
            json_t *x;
            json_array_foreach(v, k, x)
                json_array_append_new(calls, json_pack("{s:O, s:O}", "name", json_object_get(x, "name"), "arguments",
                                                       json_object_get(x, "parameters")));
        }
        json_decref(v);
        if (calls) *content_len = 0;
    } else {
        tool_calls_parse((tool_format)j->tool_fmt, t, n, &calls, content_len);
    }
    while (calls && j->one_tool_call && json_array_size(calls) > 1) json_array_remove(calls, json_array_size(calls) - 1);
    return calls;
}

/* OpenAI's form of call k of choice ci: {"id", "type": "function", "function": {"name", "arguments"}};
 * arguments as JSON text (with_args false: "") */
static json_t *openai_call(gen_job_t *j, int ci, int k, json_t *call, bool with_args) {
    char id[64];
    const char *h = strchr(j->id, '-');
    if (j->tool_fmt == TOOL_FORMAT_MISTRAL) /* its templates want 9 letters or digits, as vLLM's parser makes them */
        snprintf(id, sizeof id, "%.7s%02x", h ? h + 1 : j->id, (ci * 16 + k) & 255);
    else
        snprintf(id, sizeof id, "call_%.20s%02x%02x", h ? h + 1 : j->id, ci & 255, k & 255);
    char *args = with_args ? json_dumps(json_object_get(call, "arguments"), JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
    json_t *o = json_pack("{s:s, s:s, s:{s:O, s:s}}", "id", id, "type", "function", "function", "name",
                          json_object_get(call, "name"), "arguments", args ? args : "");
    free(args);
    return o;
}

/* A streamed chat reply with reasoning or tools (its text so far in c->text): the reasoning
 * goes out as reasoning_content, the content as far as it cannot begin a call; at the end its
 * calls go out as OpenAI streams them (each its id and name, then its arguments), finish
 * reason "tool_calls" (a named function's: the engine's). */
static void chat_stream(gen_job_t *j, int ci, json_t *lp, const char *fin) {
    gen_choice_t *c = &j->choices[ci];
    const char *t = c->text.p ? c->text.p : "";
    split_t sp = split_reply(j->reasoning, t, c->text.len, fin != NULL);
    size_t rs = c->rsent > sp.r0 ? c->rsent : sp.r0;
    if (sp.r1 > rs) {
        sse_delta(j, ci, json_pack("{s:o}", "reasoning_content", jstr(t + rs, sp.r1 - rs)), lp, NULL);
        lp = NULL;
        c->rsent = sp.r1;
    }
    const char *ct = t + sp.c0;
    size_t clen = c->text.len - sp.c0;
    json_t *calls = fin ? content_calls(j, ct, clen, &clen) : NULL;
    size_t upto = fin                            ? clen
                  : j->tool_fmt >= TOOLS_REQUIRED ? 0 /* all of it is the calls */
                  : j->tool_fmt                   ? tool_calls_content_prefix((tool_format)j->tool_fmt, ct, sp.c1 - sp.c0)
                                                  : sp.c1 - sp.c0;
    if (upto > c->sent || lp) {
        sse_choice(j, ci, ct + c->sent, upto > c->sent ? upto - c->sent : 0, lp, NULL, false);
        if (upto > c->sent) c->sent = upto;
    }
    if (!fin) return;
    size_t k;
    json_t *call;
    json_array_foreach(calls, k, call) {
        json_t *head = openai_call(j, ci, (int)k, call, false), *args = openai_call(j, ci, (int)k, call, true);
        json_object_set_new(head, "index", json_integer((json_int_t)k));
        sse_delta(j, ci, json_pack("{s:[o]}", "tool_calls", head), NULL, NULL);
        json_t *piece = json_pack("{s:I, s:{s:O}}", "index", (json_int_t)k, "function", "arguments",
                                  json_object_get(json_object_get(args, "function"), "arguments"));
        json_decref(args);
        sse_delta(j, ci, json_pack("{s:[o]}", "tool_calls", piece), NULL, NULL);
    }
    sse_choice(j, ci, "", 0, NULL, calls && j->tool_fmt != TOOLS_NAMED ? "tool_calls" : fin, false);
    json_decref(calls);
}

/* the message of a finished chat choice, as text into b; its finish reason into *finish */
static void chat_message(gen_job_t *j, int ci, cs_buf_t *b, const char **finish) {
    gen_choice_t *c = &j->choices[ci];
    const char *t = c->text.p ? c->text.p : "";
    split_t sp = split_reply(j->reasoning, t, c->text.len, true);
    size_t clen = c->text.len - sp.c0;
    json_t *calls = content_calls(j, t + sp.c0, clen, &clen);
    json_t *m = json_pack("{s:s, s:o}", "role", "assistant", "content",
                          (calls || j->reasoning) && !clen ? json_null() : jstr(t + sp.c0, clen));
    if (j->reasoning)
        json_object_set_new(m, "reasoning_content", sp.r1 > sp.r0 ? jstr(t + sp.r0, sp.r1 - sp.r0) : json_null());
    if (calls) {
        json_t *a = json_array();
        size_t k;
        json_t *call;
        json_array_foreach(calls, k, call) json_array_append_new(a, openai_call(j, ci, (int)k, call, true));
        json_object_set_new(m, "tool_calls", a);
        if (j->tool_fmt != TOOLS_NAMED) *finish = "tool_calls";
    }
    json_decref(calls);
    buf_json(b, m, false);
    json_decref(m);
}

/* Under j->mu: whether the suspended connection has something now (the end, or stream
 * bytes); if so it counts as resumed, and the caller resumes it after unlocking (it cannot
 * go away while suspended). */
bool take_resume(gen_job_t *j) {
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

unsigned api_status_of(int cs) {
    switch (cs) {
    case CS_ENOTFOUND: return 404;
    case CS_EINVAL: case CS_EFORMAT: case CS_ESHAPE: case CS_EUNSUPPORTED: return 400;
    default: return 500;
    }
}

/* a request with SLOs (its own or its model's) is over: did it meet them? (per adapter and
 * rank) TTFT is arrival to first token; TPOT is each sample's (last - first) / (tokens - 1),
 * the worst */
static void slo_account(gen_job_t *j, gen_part_t *p, double now) {
    bool met = p->first_token && !j->err_status;
    double worst_tpot = 0, first = now;
    for (int k = 0; k < j->n; k++) {
        const gen_choice_t *c = &j->choices[p->index * j->n + k];
        if (c->n_tokens == 0) continue;
        first = CS_MIN(first, c->t_first);
        if (c->n_tokens > 1) worst_tpot = CS_MAX(worst_tpot, (c->t_last - c->t_first) / (c->n_tokens - 1));
    }
    if (j->slo_ttft_ms > 0 && first - j->t_arrival > j->slo_ttft_ms) met = false;
    if (j->slo_tpot_ms > 0 && worst_tpot > j->slo_tpot_ms) met = false;
    astats_slo(j->srv, j->label, j->adapter ? j->adapter->name : NULL, met);
}

/* The engine's prompt-logprob event (engine thread, under j->mu): echo's logprobs of the
 * prompt tokens, and vLLM's prompt_logprobs */
static void on_prompt_logprobs(gen_job_t *j, gen_part_t *p, const engine_event_t *ev) {
    if (j->echo && j->logprobs >= 0) {
        /* the prompt's tokens with their logprobs (the first has none): an event of the
         * stream, or the start of each choice's logprobs in the response */
        json_t *lp = j->stream ? lp_legacy_new() : NULL;
        size_t off = 0;
        int nt = ev->prompt_n_top < j->logprobs ? ev->prompt_n_top : j->logprobs; /* prompt_logprobs may ask more */
        for (int t = 0; t < p->n_prompt; t++) {
            const int32_t *ids = nt ? ev->prompt_top_ids + (size_t)t * ev->prompt_n_top : NULL;
            const float *lps = nt ? ev->prompt_top_logprobs + (size_t)t * ev->prompt_n_top : NULL;
            if (lp)
                lp_legacy_add(j, lp, p->prompt[t], ev->prompt_logprobs[t], t > 0, t > 0 ? nt : 0, t > 0 ? ids : NULL,
                              lps, &off);
            else
                lp_legacy_add_text(j, &p->echo_lp, p->prompt[t], ev->prompt_logprobs[t], t > 0, t > 0 ? nt : 0,
                                   t > 0 ? ids : NULL, lps, &off);
        }
        /* the text offsets of the prompt tokens count from the prompt text's start */
        for (int k = 0; k < j->n; k++) {
            gen_choice_t *c = &j->choices[p->index * j->n + k];
            c->offset = cs_utf8_count(p->prompt_text, p->prompt_text_len);
            if (j->stream)
                sse_choice(j, p->index * j->n + k, p->prompt_text, p->prompt_text_len, json_deep_copy(lp), NULL, false);
        }
        json_decref(lp);
    }
    if (j->prompt_logprobs >= 0) {
        json_t *a = plp_json(j, p, ev);
        if (!j->stream) {
            p->plp = a;
        } else if (j->chat) { /* the response's own field: a chunk of its own, before the tokens */
            json_t *o = chunk_new(j);
            json_object_set_new(o, "prompt_logprobs", a);
            sse_json(j, o);
        } else { /* each choice's first chunk carries it */
            for (int k = 0; k < j->n; k++) {
                json_t *o = chunk_new(j);
                json_array_append_new(json_object_get(o, "choices"),
                                      json_pack("{s:i, s:s, s:n, s:n, s:O}", "index", p->index * j->n + k, "text", "",
                                                "logprobs", "finish_reason", "prompt_logprobs", a));
                sse_json(j, o);
            }
            json_decref(a);
        }
    }
}

static void on_event(void *user, const engine_event_t *ev) {
    gen_part_t *p = user;
    gen_job_t *j = p->job;
    server_t *s = j->srv;
    double now = cs_time_ms();
    pthread_mutex_lock(&j->mu);
    p->n_prompt = ev->n_prompt_tokens;
    p->n_cached = ev->n_cached_tokens;
    if (ev->prompt_logprobs) on_prompt_logprobs(j, p, ev);
    int ci = p->index * j->n + ev->index;
    gen_choice_t *c = &j->choices[ci];
    json_t *lp_delta = NULL;
    if (ev->has_token) {
        double ttft = -1, itl = -1;
        if (!p->first_token) {
            p->first_token = true;
            ttft = (now - j->t_arrival) / 1000.0;
        } else if (c->t_last > 0) {
            itl = (now - c->t_last) / 1000.0;
        }
        astats_token(s, j->label, ttft, itl);
        if (c->n_tokens == 0) c->t_first = now;
        c->t_last = now;
        c->n_tokens++;
        j->completion_tokens++;
        if (j->logprobs >= 0) {
            if (j->chat) {
                json_t *e = lp_chat_entry(j, ev->token, ev->logprob, ev->n_top, ev->top_ids, ev->top_logprobs);
                if (j->stream) {
                    lp_delta = json_pack("[o]", e);
                } else {
                    buf_json(&c->lp.a[0], e, c->lp.n++ > 0);
                    json_decref(e);
                }
            } else if (j->stream) {
                lp_delta = lp_legacy_new();
                lp_legacy_add(j, lp_delta, ev->token, ev->logprob, true, ev->n_top, ev->top_ids, ev->top_logprobs,
                              &c->offset);
            } else {
                lp_legacy_add_text(j, &c->lp, ev->token, ev->logprob, true, ev->n_top, ev->top_ids, ev->top_logprobs,
                                   &c->offset);
            }
        }
        if (!j->stream || j->tool_fmt || j->reasoning) cs_buf_add(&c->text, ev->text, ev->text_len);
    }
    const char *fin = finish_name(ev->finish);
    if (ev->finish == ENGINE_FINISH_ERROR && !j->err_status) {
        j->err_status = api_status_of(ev->error);
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
        if (j->chat && (j->tool_fmt || j->reasoning)) chat_stream(j, ci, lp_delta, fin);
        else sse_choice(j, ci, ev->text, ev->text_len, lp_delta, fin, false);
    } else {
        json_decref(lp_delta);
    }
    bool drop = false;
    if (ev->request_done) {
        p->done = true;
        j->n_done++;
        drop = true;
        double e2e = (now - j->t_arrival) / 1000.0;
        astats_done(s, j->label, p->n_prompt, fin ? fin : "abort", e2e, ev->queue_ms / 1000.0);
        if (j->slo_ttft_ms > 0 || j->slo_tpot_ms > 0) slo_account(j, p, now);
        if (j->n_done == j->n_parts) {
            if (j->stream) {
                if (j->include_usage) {
                    json_t *o = chunk_new(j);
                    json_object_set_new(o, "usage", usage_json(j));
                    sse_json(j, o);
                }
                cs_buf_add(&j->out, "data: [DONE]\n\n", 14);
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
    ssize_t n = http_stream_take(&j->out, &j->out_off, j->finished, &j->suspended, j->conn, buf, max);
    pthread_mutex_unlock(&j->mu);
    return n;
}

static void stream_free(void *cls) { job_unref(cls); }

/* ---- submitting a job ---- */
/* Submit every part; on a submit error abort the ones already in and answer the error. */
enum MHD_Result job_start(server_t *s, conn_t *cn, struct MHD_Connection *c, gen_job_t *j, gen_opts_t *o) {
    if (j->stream && j->chat) /* the role first, as OpenAI sends it */
        for (int i = 0; i < j->n_parts * j->n; i++) sse_choice(j, i, "", 0, NULL, NULL, true);
    if (j->stream && j->echo && j->logprobs < 0) /* echo without logprobs: the prompt text first */
        for (int i = 0; i < j->n_parts * j->n; i++) {
            gen_part_t *p = &j->parts[i / j->n];
            sse_choice(j, i, p->prompt_text ? p->prompt_text : "", p->prompt_text_len, NULL, NULL, false);
        }
    perr_t e = {0};
    int k;
    j->slo_ttft_ms = o->rq.slo_ttft_ms;
    j->slo_tpot_ms = o->rq.slo_tpot_ms;
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
            fail(&e, api_status_of(rc), NULL, "%s", cs_error_last());
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
        pthread_mutex_lock(&j->mu);
        j->conn = c;
        j->refs++; /* the reader's */
        pthread_mutex_unlock(&j->mu);
        return http_stream_queue(c, 200, j->ro ? "application/x-ndjson" : "text/event-stream", NULL, NULL,
                                 stream_reader, j, stream_free);
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

/* the response of a finished completions or chat job, as text: the logprobs, held as text,
 * go in without a tree of them ever being built */
#define ADD_LIT(b, lit) cs_buf_add((b), (lit), sizeof(lit) - 1)

static void final_text(gen_job_t *j, cs_buf_t *b) {
    ADD_LIT(b, "{\"id\":");
    json_t *v = json_string(j->id);
    buf_json(b, v, false);
    json_decref(v);
    ADD_LIT(b, ",\"object\":");
    v = json_string(j->chat ? "chat.completion" : "text_completion");
    buf_json(b, v, false);
    json_decref(v);
    char num[48];
    cs_buf_add(b, num, (size_t)snprintf(num, sizeof num, ",\"created\":%lld,\"model\":", j->created));
    v = json_string(j->model);
    buf_json(b, v, false);
    json_decref(v);
    ADD_LIT(b, ",\"choices\":[");
    for (int i = 0; i < j->n_parts * j->n; i++) {
        gen_choice_t *c = &j->choices[i];
        gen_part_t *p = &j->parts[i / j->n];
        if (i) ADD_LIT(b, ",");
        cs_buf_add(b, num, (size_t)snprintf(num, sizeof num, "{\"index\":%d,", i));
        const char *finish = c->finish ? c->finish : "abort";
        if (j->chat) {
            ADD_LIT(b, "\"message\":");
            if (j->tool_fmt || j->reasoning) {
                chat_message(j, i, b, &finish);
            } else {
                ADD_LIT(b, "{\"role\":\"assistant\",\"content\":");
                v = jstr(c->text.p ? c->text.p : "", c->text.len);
                buf_json(b, v, false);
                json_decref(v);
                ADD_LIT(b, "}");
            }
            ADD_LIT(b, ",\"logprobs\":");
            if (j->logprobs >= 0) {
                ADD_LIT(b, "{\"content\":[");
                cs_buf_add(b, c->lp.a[0].p ? c->lp.a[0].p : "", c->lp.a[0].len);
                ADD_LIT(b, "]}");
            } else {
                ADD_LIT(b, "null");
            }
        } else {
            cs_buf_t t = {0};
            if (j->echo) cs_buf_add(&t, p->prompt_text ? p->prompt_text : "", p->prompt_text_len);
            cs_buf_add(&t, c->text.p ? c->text.p : "", c->text.len);
            ADD_LIT(b, "\"text\":");
            v = jstr(t.p ? t.p : "", t.len);
            buf_json(b, v, false);
            json_decref(v);
            free(t.p);
            ADD_LIT(b, ",\"logprobs\":");
            if (j->logprobs >= 0) {
                const lp_text_t *e = j->echo ? &p->echo_lp : NULL;
                for (int k = 0; k < 4; k++) {
                    if (k) ADD_LIT(b, "],\"");
                    else ADD_LIT(b, "{\"");
                    cs_buf_add(b, LP_KEYS[k], strlen(LP_KEYS[k]));
                    ADD_LIT(b, "\":[");
                    if (e && e->n) cs_buf_add(b, e->a[k].p, e->a[k].len);
                    if (e && e->n && c->lp.n) ADD_LIT(b, ",");
                    if (c->lp.n) cs_buf_add(b, c->lp.a[k].p, c->lp.a[k].len);
                }
                ADD_LIT(b, "]}");
            } else {
                ADD_LIT(b, "null");
            }
            ADD_LIT(b, ",\"prompt_logprobs\":");
            buf_json(b, p->plp ? p->plp : json_null(), false);
        }
        ADD_LIT(b, ",\"finish_reason\":");
        v = json_string(finish);
        buf_json(b, v, false);
        json_decref(v);
        ADD_LIT(b, "}");
    }
    ADD_LIT(b, "],");
    if (j->chat) {
        ADD_LIT(b, "\"prompt_logprobs\":");
        buf_json(b, j->parts[0].plp ? j->parts[0].plp : json_null(), false);
        ADD_LIT(b, ",");
    }
    ADD_LIT(b, "\"usage\":");
    v = usage_json(j);
    buf_json(b, v, false);
    json_decref(v);
    ADD_LIT(b, "}");
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
    if (!j->sglang && !j->ro) {
        cs_buf_t b = {0};
        final_text(j, &b);
        pthread_mutex_unlock(&j->mu);
        if (!b.p) return MHD_NO; /* out of memory */
        return http_text(c, 200, "application/json", b.p, b.len);
    }
    json_t *o = j->sglang ? rollout_route_sglang_json(s, j)
                          : json_pack("{s:O, s:O}", "groups", j->ro_groups, "summary",
                                      json_object_get(j->ro_summary, "summary"));
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
