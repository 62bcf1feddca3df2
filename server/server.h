/* server.h: `caraserve serve`, the HTTP server. libmicrohttpd's thread pool parses requests
 * (http.c: routing, body limits, auth, JSON and SSE responses, suspend/resume); the
 * dispatcher (api.c) hands each to its endpoint: api_openai.c validates OpenAI-style JSON,
 * tokenizes or renders the chat template, rollout_api/routes.c the rollout side; both submit
 * jobs (api_jobs.c) to the engine, whose thread feeds each token back through a sink into the
 * waiting connection; api_metrics.c serves /metrics. cmd_serve.c reads flags and the config
 * file (through options.c's table), loads the model and runs the lifecycle (signals,
 * graceful drain). */
#ifndef CS_SERVER_H
#define CS_SERVER_H

#include <jansson.h>
#include <microhttpd.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <time.h>

#include "text/chat_template.h"
#include "engine/engine.h"
#include "server/http.h"
#include "server/metrics.h"
#include "server/options.h"

/* serve's flags and config file (server/options.h) */
typedef cs_options_t serve_config_t;

/* An adapter served by name, with the requests using it (an unload waits for them). */
typedef struct served_adapter {
    char *name, *path;
    int in_flight;
    bool unloading;
    struct MHD_Connection **waiters;  /* unload requests suspended until in_flight is 0 */
    int n_waiters;
    time_t created;
    struct served_adapter *next;      /* newest first */
    struct served_adapter *hnext;     /* the name index's chain */
} served_adapter_t;

typedef struct server_metrics {
    metrics_t *reg;
    metric_t *ttft, *itl, *e2e, *queue, *prompt_tokens, *gen_tokens, *success;
    metric_t *running, *waiting, *kv_usage, *prefix_queries, *prefix_hits, *preemptions;
    metric_t *lora_tier, *lora_load, *lora_hits, *lora_misses, *lora_loads, *prefill_tokens;
    metric_t *lora_streamed, *lora_partial;
    metric_t *lora_transfer, *cold_starts, *cold_layers, *cold_auto; /* the cold start */
    metric_t *cost_r2, *cost_err, *cost_coef, *cost_steps; /* the iteration cost model's fit */
    metric_t *slo_requests, *slo_met; /* requests with SLOs (own or --adapter-slos), and those that met them */
    metric_t *a_ttft, *a_itl, *a_e2e;   /* per adapter (api_stats.c's bounded label): sums and counts */
    metric_t *adapter_series, *adapter_folds, *lora_resolved;
    /* engine counters already reported (metrics are cumulative there) */
    pthread_mutex_t mu;
    uint64_t last_prefix_queries, last_prefix_hits, last_preemptions, last_lora_hits, last_lora_misses;
    uint64_t last_cold_assisted, last_cold_waited, last_cold_host_layers, last_cold_device_layers;
    uint64_t last_cold_auto_assist, last_cold_auto_wait;
    uint64_t last_prefill_tokens, last_lora_loads_direct, last_lora_loads_buffered;
    uint64_t last_lora_streamed, last_lora_partial;
    uint64_t last_adapter_folds, last_resolved, last_resolve_failed;
} server_metrics_t;

typedef struct server {
    serve_config_t cfg;
    const char *model_name;         /* served name of the base model */
    struct backend *be;
    model_t *model;                 /* the first weights until the engine owns them (then NULL) */
    model_config_t mcfg;            /* the model's config: every weight version's */
    char *weights_dir;              /* under mu: the directory of the active weights (NULL: --model) */
    char weights_note[224];         /* where the first weights live, for the ready line */
    bool sleeping;                  /* under mu: /sleep until /wake_up has everything back */
    tokenizer_t *tok;
    lora_registry_t *reg;
    struct lora_assist *assist;     /* the cold start's host LoRA workers (NULL: none) */
    struct sched *sched;            /* the engine's scheduling policy */
    struct cost_model *cost;        /* the iteration cost model it feeds (sched/cost.h) */
    struct sched_slo_table *slos;   /* --adapter-slos (NULL: none); read-only once serving */
    engine_t *engine;
    chat_template_t *tmpl;          /* NULL: the model has no chat template */
    bool tmpl_wants_parts;          /* the template reads content parts (['type']) */
    int tool_format;                /* tool_format (text/tool_calls.h) of chat replies with tools */
    int reasoning;                  /* --reasoning-parser: REASONING_* (api_internal.h), 0: none */
    int32_t think_start_id, think_end_id; /* the tokens of <think> and </think> (-1: none) */
    char *bos_token, *eos_token;    /* strings for the template */
    int max_model_len;
    model_gen_defaults_t gen_defaults; /* --generation-config: requests' sampling defaults */
    int vocab_size;                 /* the model's: token ids must be below it */
    time_t created;
    char *upload_dir;               /* where uploaded adapter versions are written */
    char **roots;                   /* realpath of each --lora-root */
    int n_roots;
    server_metrics_t m;
    http_site_t site;               /* what http.c's access handler calls */
    struct MHD_Daemon *d;
    int bound_port;

    pthread_mutex_t mu;
    pthread_cond_t cv;
    served_adapter_t *adapters;
    served_adapter_t **index;       /* the adapters by name: chains of index_cap (a power of two) */
    size_t index_cap, n_adapters;
    struct resolving *resolving;    /* --lora-resolve: names being registered now (api_resolve.c) */
    uint64_t n_resolved, n_resolve_failed; /* under mu: first requests that registered, that found nothing */
    char **resolve_dirs;            /* realpath of each --lora-resolve directory */
    int n_resolve_dirs;
    struct keyring *keys;           /* under mu: the keys in force (--api-keys, --api-key; server/keys.h) */
    struct adapter_stats *astats;   /* per-adapter statistics and the bounded labels (api_stats.c) */
    bool ready;                     /* model loaded: /health says 200 */
    bool draining;                  /* SIGTERM: no new generation requests */
    bool paused;                    /* /v1/pause: requests are accepted and wait */
    int n_jobs;                     /* generation jobs alive (each holds its connection) */
    int n_unload_waiting;           /* suspended unload requests */
    struct gen_job *jobs;           /* list of them (for shutdown) */
    pthread_t watch;                /* notices clients hanging up on suspended connections */
    pthread_cond_t watch_cv;
    bool watch_started, watch_stop;
    struct grammar_cache *grammars; /* structured output's compiled grammars (api_structured.c) */
    pthread_mutex_t drop_mu;        /* a leaf lock: the directories of dropped uploads, */
    char **drops;                   /* deleted later with no lock held (server_drain_drops) */
    int n_drops, cap_drops;
} server_t;

/* ---- api_structured.c: the compiled grammars, keyed by their GBNF text ---- */
typedef struct grammar_cache grammar_cache_t;
grammar_cache_t *grammar_cache_new(void);
void grammar_cache_free(grammar_cache_t *c);

/* ---- http.c ---- */
typedef struct conn conn_t;

/* Start listening (the model may still be loading: /health answers 503 until ready). */
int http_start(server_t *s);
void http_stop(server_t *s);

/* ---- the endpoints (api.c: the dispatcher; api_jobs.c; api_openai.c) ---- */
/* body: the request's body (any bytes; "" for none) */
enum MHD_Result api_dispatch(server_t *s, conn_t *cn, struct MHD_Connection *c, const char *method,
                             const char *url, const char *body, size_t body_len);
/* A suspended unload request resumed: its answer. */
enum MHD_Result api_unload_resume(server_t *s, conn_t *cn, struct MHD_Connection *c);
/* Called again after a suspended generation request resumes: its response. */
enum MHD_Result api_resume(server_t *s, conn_t *cn, struct MHD_Connection *c);
/* The connection is finished (normally or not): abort what is still running. */
void api_conn_done(server_t *s, conn_t *cn);
/* The thread that aborts requests whose client hung up while suspended. */
int api_watch_start(server_t *s);
void api_watch_stop(server_t *s);
/* Every live job: abort its engine requests (shutdown after the timeout). */
void api_abort_all(server_t *s);

/* the endpoints' state of a request (http_conn_t.app; its body is http.c's) */
struct conn {
    server_t *srv;
    bool answered;                  /* the job's answer is queued */
    char *unload_name;              /* a suspended /v1/unload_lora_adapter waiting for in-flight requests */
    bool unload_waiting;
    bool unload_sglang;             /* ... as SGLang's /unload_lora_adapter: answered in its JSON */
    struct gen_job *job;
    double t_arrival;               /* cs_time_ms() */
    const struct key_grant *who;    /* the request's key (NULL: a route without keys); its ring
                                     * is held by http.c until the request is done */
};

/* ---- metrics wiring (api_metrics.c) ---- */
int server_metrics_init(server_t *s);
void server_on_load_time(void *user, const char *name, double seconds); /* the registry's on_load_time */
void server_on_streamed(void *user, const char *name, double seconds);  /* the registry's on_streamed */
void server_metrics_free(server_t *s);
/* ---- uploaded adapter versions (rollout_api/routes.c) ---- */
void server_on_dropped(void *user, const char *name, int version, const char *dir); /* the registry's on_dropped */
void server_drain_drops(server_t *s);  /* delete the dropped uploads' files (no lock held) */
/* ---- adapters (api_openai.c) ---- */
/* Register NAME -> DIR (a new version when it exists and inplace), validated first. CS_OK, or
 * a CS_E* code with *E the HTTP error (param "lora_path"). */
int server_add_adapter(server_t *s, const char *name, const char *dir, bool inplace, perr_t *e);
/* The same; PROBE checks the adapter's config and safetensors headers only (its weights are
 * read at its first request, as any adapter's after an eviction). */
int server_add_adapter_ex(server_t *s, const char *name, const char *dir, bool inplace, bool probe, perr_t *e);

/* ---- adapters found by name (api_resolve.c) ---- */
/* NAME, not registered: registered now from a --lora-resolve directory (CS_OK), else
 * CS_ENOTFOUND (the caller answers as for any unknown model) or CS_ENOMEM. Concurrent calls
 * for one name register it once; the others wait for the outcome. No lock held. */
int server_resolve_adapter(server_t *s, const char *name);
/* --lora-modules-dir DIR: every adapter directory in DIR (the ones that do not fit are
 * skipped, and said); the number registered, or CS_ENOTFOUND when DIR cannot be read */
int server_modules_dir(server_t *s, const char *dir);

/* ---- every adapter's statistics; the bounded adapter label of /metrics (api_stats.c) ---- */
typedef struct adapter_stats adapter_stats_t;
int astats_init(server_t *s);   /* after server_metrics_init */
void astats_free(server_t *s);
/* NAME (the base model's served name or an adapter's) had a token: TTFT or ITL (< 0: not
 * this one), in seconds */
void astats_token(server_t *s, const char *name, double ttft_s, double itl_s);
/* a request (one prompt's samples) on NAME is over */
void astats_done(server_t *s, const char *name, int n_prompt, const char *finish, double e2e_s, double queue_s);
/* a request with SLOs on NAME (ADAPTER: NULL for the base model) is over: did it meet them */
void astats_slo(server_t *s, const char *name, const char *adapter, bool met);
/* NAME's weights came from disk (or, TRANSFER, went to the device) in SECONDS */
void astats_load(server_t *s, const char *name, double seconds, bool transfer);
/* at a scrape: the adapters with series of their own chosen again (the rest folded) */
void astats_rebalance(server_t *s);
/* NAME's statistics as JSON; KNOWN: zeros for a name never asked for (else NULL) */
json_t *astats_get(server_t *s, const char *name, bool known);

/* ---- security ---- */
/* a reference to the keys in force (keyring_unref it) */
struct keyring *server_keys(server_t *s);
/* realpath(path) inside one of the --lora-root directories: 0 and *real set (malloc'd),
 * else an HTTP status (403 outside, 404 missing), the error in *e. */
int lora_path_check(const server_t *s, const char *path, char **real, perr_t *e);
/* the same for a directory of base weights (every file in it must stay in the root) */
int weights_path_check(const server_t *s, const char *path, char **real, perr_t *e);

#endif
