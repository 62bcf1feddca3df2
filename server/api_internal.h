/* api_internal.h: what the files of the HTTP endpoints share (server/api.c, api_util.c,
 * api_jobs.c, api_openai.c, api_metrics.c and rollout_api/routes.c); no other file includes it.
 *
 * A generation request becomes a job (api_jobs.c): one engine request per prompt (each with n
 * samples), whose sink runs on the engine thread and appends to the job under its mutex, or
 * one rollout batch (rollout_api/). The handlers parse the request, fill the job and start it
 * with job_start, which answers the connection when the job is done or streams it. */
#ifndef CS_API_INTERNAL_H
#define CS_API_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "rollout_api/rollout.h"
#include "server/server.h"

#define MAX_STOP_STRINGS 64
#define MAX_PROMPTS 1024

/* ---- api_util.c ---- */
/* the HTTP status of a CS_E* code: CS_ENOTFOUND 404, the request's own faults (CS_EINVAL,
 * CS_EFORMAT, CS_ESHAPE, CS_EUNSUPPORTED) 400, the rest 500 */
unsigned api_status_of(int cs);
/* a JSON string from bytes that may not be valid UTF-8 (bad bytes become U+FFFD) */
json_t *jstr(const char *s, size_t n);
/* One stream frame of O appended to OUT: SSE ("data: {json}\n\n") or, with ndjson, a line
 * ("{json}\n"); compact JSON never holds a raw newline. false: out of memory. */
bool api_frame(cs_buf_t *out, const json_t *o, bool ndjson);
/* the request-field inventory's refusals for endpoint ep (api_fields.h): false with *e set */
bool api_fields_check(unsigned ep, json_t *b, perr_t *e);
/* the served adapter NAME or NULL; under s->mu */
served_adapter_t *adapter_find(server_t *s, const char *name);
bool adapter_insert(server_t *s, served_adapter_t *a);
/* a new served adapter NAME, inserted (under s->mu; NULL: out of memory) */
served_adapter_t *adapter_add(server_t *s, const char *name);
/* adapter_insert adds A (its name set) to the served adapters (under s->mu; false: out of
 * memory, nothing changed); adapter_unlink takes A off the list of served adapters (under s->mu); adapter_free frees it */
void adapter_unlink(server_t *s, served_adapter_t *a);
void adapter_free(served_adapter_t *a);
/* a request on A (NULL: the base model) is over: its pin (in_flight) goes */
void adapter_unpin(server_t *s, served_adapter_t *a);
/* a name an adapter may be served under: 1 to 256 bytes, no '/' and no control characters,
 * not "." or "..", not "_other" (the label of the adapters without series of their own in
 * /metrics) */
bool valid_adapter_name(const char *n);
/* the request's key may use adapter NAME (NULL: the base model); true without keys */
bool api_may_use(const conn_t *cn, const char *name);
/* the request's key is an admin's (true without keys) */
bool api_is_admin(const conn_t *cn);

/* ---- api_jobs.c ---- */
typedef struct gen_job gen_job_t;

/* Logprobs kept as JSON text while a response builds: a tree of jansson objects per token
 * (20 alternatives each) held about 7 times the answer's size. a[k]: the comma-separated
 * elements of array k, without brackets; n: the tokens. */
typedef struct lp_text {
    cs_buf_t a[4];
    size_t n;
} lp_text_t;

typedef struct gen_choice {
    cs_buf_t text;
    lp_text_t lp;               /* its logprobs (not streamed): completions' four arrays, chat's
                                   "content" entries in a[0] */
    size_t offset;              /* text_offset of the next token (characters) */
    int n_tokens;
    const char *finish;
    double t_last;              /* last token (for inter-token latency) */
    double t_first;             /* first token (for its TPOT against the request's SLO) */
    size_t sent;                /* streamed chat with tools or reasoning: content bytes sent so far */
    size_t rsent;               /* ... and reasoning bytes */
} gen_choice_t;

#define REASONING_QWEN3 1         /* server_t.reasoning: a reply may start with <think>...</think> */
#define REASONING_DEEPSEEK_R1 2   /* a reply starts inside the thinking (the template opened it) */
#define TOOLS_REQUIRED 100        /* gen_job_t.tool_fmt: tool_choice "required" (a JSON list of calls) */
#define TOOLS_NAMED 101           /* a named function (the reply is its arguments) */

typedef struct gen_part {       /* one prompt = one engine request */
    gen_job_t *job;
    int index;
    uint64_t id;
    bool submitted, done;
    int32_t *prompt;
    int n_prompt, n_cached;
    char *prompt_text;          /* for echo */
    size_t prompt_text_len;
    lp_text_t echo_lp;          /* completions' logprobs entries of the prompt (echo, not streamed) */
    json_t *plp;                /* prompt_logprobs as vLLM shapes them (not streamed) */
    bool first_token;
} gen_part_t;

struct gen_job {
    server_t *srv;
    pthread_mutex_t mu;
    int refs;
    struct MHD_Connection *conn;    /* NULL once the connection is finished */
    bool suspended;
    bool chat, stream, include_usage, continuous_usage, echo, tok_ids, skip_special;
    int logprobs;                   /* -1: none */
    int prompt_logprobs;            /* -1: none; else the alternatives per prompt position */
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
    double slo_ttft_ms, slo_tpot_ms; /* the request's SLOs, its own or its model's (0: none): counted in /metrics */
    cs_buf_t out;                   /* SSE bytes not yet sent */
    size_t out_off;
    bool finished;
    bool hung_up;                   /* the watcher saw the client go */
    rollout_t *ro;                  /* a /v1/rollout batch (the parts are unused then) */
    json_t *ro_groups, *ro_summary; /* its lines, when not streamed */
    json_t *sglang;                 /* SGLang /generate: {"batch": bool, "return_logprob": bool} */
    int tool_fmt;                   /* chat with tools: the tool_format calls are read in (0: none), or
                                       TOOLS_REQUIRED / TOOLS_NAMED (the reply is the calls' JSON) */
    char *tool_name;                /* TOOLS_NAMED: the function */
    int reasoning;                  /* REASONING_*: the reply's thinking is reasoning_content */
    bool one_tool_call;             /* parallel_tool_calls: false */
    unsigned err_status;
    char *err_msg;
    long long completion_tokens;
    gen_job_t *next, *prev;
};

typedef struct gen_opts {
    engine_request_t rq;        /* sampling etc.; prompt/sink/user set per part */
    const char *stops[MAX_STOP_STRINGS];
    int32_t *stop_ids;          /* what rq points at (owned; api_request_drop or the submit frees) */
    void *lists;                /* rq->sampling's allowed ids and logit bias */
} gen_opts_t;

/* A new job of n_parts prompts with n samples each, listed in s->jobs and holding the
 * connection's reference. NULL when out of memory or (*draining) when the server has begun
 * shutting down. */
gen_job_t *job_new(server_t *s, bool chat, int n_parts, int n, bool *draining);
/* drops a reference; the last one frees the job */
void job_unref(gen_job_t *j);
/* Submits every part with the options o and answers the connection: a stream, or suspended
 * until the job is done; on a submit error aborts the parts already in and answers the error. */
enum MHD_Result job_start(server_t *s, conn_t *cn, struct MHD_Connection *c, gen_job_t *j, gen_opts_t *o);
/* under j->mu: whether the suspended connection has something now (the caller resumes it
 * after unlocking) */
bool take_resume(gen_job_t *j);

/* ---- api_structured.c ---- */
/* The structured-output constraint a completions or chat body asks for (response_format,
 * structured_outputs, guided_*, SGLang's regex/ebnf/json_schema): *g a compiled grammar (a
 * reference for the caller), NULL when none; false with *e set on a bad one. */
bool api_structured(server_t *s, json_t *b, struct grammar **g, perr_t *e);

/* ---- the handlers the dispatcher (api.c) calls; body: the parsed JSON object ---- */
/* api_openai.c. The parse halves validate a body into a job and its options, nothing
 * submitted (the fuzz targets call them alone): NULL with *e set on a bad request; else the
 * job, which either job_start takes or api_request_drop frees. o's strings point into b. */
gen_job_t *api_completions_parse(server_t *s, conn_t *cn, json_t *b, gen_opts_t *o, perr_t *e);
gen_job_t *api_chat_parse(server_t *s, conn_t *cn, json_t *b, gen_opts_t *o, perr_t *e);
void api_request_drop(server_t *s, gen_job_t *j, gen_opts_t *o);
typedef gen_job_t *(*api_parse_fn)(server_t *s, conn_t *cn, json_t *b, gen_opts_t *o, perr_t *e);
/* POST /v1/completions (parse: api_completions_parse), /v1/chat/completions (api_chat_parse) */
enum MHD_Result api_submit(server_t *s, conn_t *cn, struct MHD_Connection *c, json_t *b, api_parse_fn parse);
enum MHD_Result api_tokenize(server_t *s, conn_t *cn, struct MHD_Connection *c, json_t *b);
enum MHD_Result api_detokenize(server_t *s, conn_t *cn, struct MHD_Connection *c, json_t *b);
enum MHD_Result api_models(server_t *s, conn_t *cn, struct MHD_Connection *c);
enum MHD_Result api_model(server_t *s, conn_t *cn, struct MHD_Connection *c, const char *url);
/* GET /v1/adapters/{name}/stats (api_stats.c's counts) */
enum MHD_Result api_adapter_stats(server_t *s, conn_t *cn, struct MHD_Connection *c, const char *name);
enum MHD_Result api_load_lora(server_t *s, struct MHD_Connection *c, json_t *b);
enum MHD_Result api_unload_lora(server_t *s, conn_t *cn, struct MHD_Connection *c, json_t *b);
enum MHD_Result api_load_lora_sgl(server_t *s, struct MHD_Connection *c, json_t *b);
enum MHD_Result api_unload_lora_sgl(server_t *s, conn_t *cn, struct MHD_Connection *c, json_t *b);
/* api_metrics.c: GET /metrics */
enum MHD_Result api_metrics(server_t *s, struct MHD_Connection *c);
/* GET /v1/state: the running and waiting sequences, adapters and cost model (a router's view) */
enum MHD_Result api_state(server_t *s, struct MHD_Connection *c);

#endif
