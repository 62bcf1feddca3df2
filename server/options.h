/* options.h: the one option table of the `caraserve` commands. Each option is defined once
 * (server/options.c): its name, argument kind, help, default, the commands that take it (a
 * mask of OPT_CMD_*) and the field of cs_options_t its value goes to. The table feeds each
 * command's getopt_long parsing, its --help, and serve's --config file (the same names as
 * 'name = value' lines). */
#ifndef CS_OPTIONS_H
#define CS_OPTIONS_H

#include <stdbool.h>
#include <stdio.h>

#include "engine/model.h"

enum { OPT_CMD_GENERATE = 1u << 0, OPT_CMD_BATCH = 1u << 1, OPT_CMD_SERVE = 1u << 2 };

/* The values of every command's options; a command reads the fields of its own. Strings and
 * lists are malloc'd (cs_options_free). */
typedef struct cs_options {
    /* the model and its adapters */
    char *model;
    char *served_model_name;
    char *weight_version;
    char **lora_modules;            /* serve --lora-modules, batch --lora: "name=dir" (serve: or JSON) */
    int n_lora_modules;
    char *lora_dir;                 /* generate --lora DIR */
    char **lora_roots;
    int n_lora_roots;
    char **lora_resolve;            /* --lora-resolve: directories searched for unknown models */
    int n_lora_resolve;
    char **lora_modules_dirs;       /* --lora-modules-dir */
    int n_lora_modules_dirs;
    char *chat_template;            /* file overriding the tokenizer_config.json template */
    char *tool_call_parser;
    char *reasoning_parser;         /* --reasoning-parser: qwen3, deepseek_r1 (default: none) */         /* --tool-call-parser: hermes, llama3_json, mistral, none (default: from the template) */
    char *generation_config;        /* auto, vllm or a directory: where requests' sampling defaults come from */
    /* HTTP */
    char *host;
    int port;
    char *api_key;
    char *api_keys;                 /* --api-keys FILE */
    int metrics_max_adapters;       /* adapters with series of their own; the rest are "_other" */
    int http_threads;               /* libmicrohttpd pool */
    long long max_body_bytes;
    long long max_adapter_bytes;    /* PUT /v1/adapters/... bodies */
    char *adapter_upload_dir;
    int max_n;                      /* samples per request (n, times prompts for batches) */
    int max_logprobs;
    int max_lora_rank;              /* --max-lora-rank: 0 = no limit */
    bool return_tokens_as_token_ids; /* --return-tokens-as-token-ids: every request's default */
    bool enable_prompt_tokens_details; /* usage.prompt_tokens_details (cached_tokens) */
    double shutdown_timeout;        /* seconds */
    char *metrics_prefix;           /* "caraserve_" */
    /* the engine */
    int threads;                    /* CPU compute threads (0: all) */
    long long kv_cache_bytes;
    double kv_cache_fraction;
    bool kv_cache_explicit;         /* --kv-cache-bytes was given */
    int kv_cache_dtype;             /* --kv-cache-dtype: SETUP_KV_AUTO or a cs_dtype */
    int max_num_seqs, max_num_batched_tokens, max_model_len, max_cpu_loras;
    int max_loras;                  /* adapters in device slots at once (0: unbounded) */
    char *scheduler;                /* --scheduler: NULL or "fcfs" */
    double slo_headroom;            /* --slo-headroom (0: the policy's default) */
    char *cost_model;               /* --cost-model FILE */
    double profile_seconds;         /* --profile-cost-model S (0: none) */
    char *adapter_slos;             /* --adapter-slos FILE: per-model SLOs (sched/slo.h) */
    long long lora_cache_bytes;
    bool lora_buffered_io;          /* --lora-io buffered */
    bool lora_bf16;                 /* --lora-dtype bf16: adapters held in BF16 */
    bool no_prefix_caching;
    int cold_start;                 /* --cold-start: SCHED_COLD_* (0: auto) */
    int assist_threads;             /* --assist-threads (0: the default) */
    int assist_dtype;               /* --assist-dtype: SETUP_ASSIST_* */
    /* the backend */
    char *device;                   /* --device: auto (NULL), cpu, cuda or cuda:N */
    bool reference_kernels;
    bool batch_invariant;           /* --batch-invariant: the CPU backend's batch-invariant kernels */
    int precision;                  /* --precision: 0 exact, 1 bf16, 2 int8 (setup_parse_precision) */
    int quantization;               /* --quantization: a cs_dtype block type, CS_DTYPE_COUNT for none */
    model_weights_mem weights_mem;  /* --mmap / --no-mmap (default MODEL_WEIGHTS_AUTO) */
    bool compress_weights;          /* --compress-weights */
    bool compress_weights_only;     /* --compress-weights-only */
    double gpu_memory_fraction;     /* --gpu-memory-fraction (0: the backend's default) */
    bool cuda_graphs;               /* --cuda-graphs */
    /* generate */
    char *prompt, *prompt_ids;
    int max_tokens;
    float temperature;
    unsigned long long seed;
    bool print_ids, no_special, ignore_eos;
    char *dump_logits;
    bool stats;                     /* generate, batch: --stats */
    /* batch */
    char *requests;                 /* JSON lines (NULL or "-": stdin) */
    char *cost_model_out;
    bool sequential, preload_adapters, timings;
} cs_options_t;

/* options_parse's results */
enum { OPT_OK = 0, OPT_HELP = 1, OPT_EVALUE = -1 /* a bad value or argument: said on stderr */,
       OPT_EUNKNOWN = -2 /* an unknown option or a missing value: getopt said so */,
       OPT_ECONFIG = -3 /* a config file that cannot be read or has a bad line: said on stderr */ };

/* the "caraserve NAME" of a command's messages */
const char *options_cmd_name(unsigned cmd);
/* O filled with the defaults of every option */
void options_init(cs_options_t *o);
void options_free(cs_options_t *o);
/* argv[1..] as options of command CMD (OPT_CMD_*), later ones winning, after the words of
 * each --config FILE where CMD takes one; OPT_OK, OPT_HELP (--help, -h for serve), or an
 * error said on stderr. argv[0] names the command in getopt's messages (serve: "caraserve
 * serve"). */
int options_parse(cs_options_t *o, unsigned cmd, int argc, char **argv);
/* command CMD's --help: SYNOPSIS, its options from the table, EPILOGUE (may be NULL) */
void options_usage(FILE *f, unsigned cmd, const char *synopsis, const char *epilogue);
/* a config file (serve's --config) as argv words ("--name", "value"; switches take true or
 * false) naming options of command CMD; *words and each word malloc'd, also on failure: 0,
 * or -1 with the reason (file:line) on stderr */
int options_read_config(const char *path, unsigned cmd, char ***words, int *n);

#endif
