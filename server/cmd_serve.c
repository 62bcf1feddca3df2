/* cmd_serve.c: `caraserve serve`. Reads flags (from --config FILE first, then the command
 * line, which wins), starts listening at once (/health answers 503 while the model loads),
 * loads the model, tokenizer, chat template and adapters, starts the engine thread, then
 * waits for SIGTERM or SIGINT: stop accepting, let in-flight requests finish within
 * --shutdown-timeout, abort the rest, exit 0. */
#include "config.h" /* first: _GNU_SOURCE for nftw */

#include <errno.h>
#include <ftw.h>
#include <getopt.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "server/setup.h"
#include "lora/assist.h"
#include "lora/registry.h"
#include "server/commands.h"
#include "engine/sched.h"
#include "sched/cost.h"
#include "sched/slo.h"
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
    if (loading) _exit(0); /* nothing accepted yet (requests got 503): no need to wait for the load */
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
    fprintf(f,
            "usage: caraserve serve --model DIR [options]\n"
            "\n"
            "  --model DIR                   Hugging Face model directory (config.json, *.safetensors, tokenizer.json)\n"
            "  --served-model-name NAME      the base model's name in the API (default: the directory's name)\n"
            "  --lora-modules NAME=DIR ...   serve PEFT adapters (one or more after the flag; repeatable;\n"
            "                                also vLLM's JSON form '{\"name\": N, \"path\": DIR}')\n"
            "  --host ADDR                   address to bind (default 127.0.0.1; 0.0.0.0 or :: for all)\n"
            "  --port N                      TCP port (default 8000; 0 picks a free one, printed at start)\n"
            "  --api-key KEY                 require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize\n"
            "                                (default: $CARASERVE_API_KEY)\n"
            "  --lora-root DIR               adapters loaded over HTTP must be inside DIR (repeatable;\n"
            "                                without it /v1/load_lora_adapter is refused)\n"
            "  --config FILE                 read options from FILE ('name = value' lines; see etc/caraserve.conf)\n"
            "  --chat-template FILE          Jinja chat template instead of tokenizer_config.json's\n"
            "  --threads N                   CPU compute threads (default: all online CPUs)\n"
            "  --http-threads N              HTTP worker threads (default 4)\n"
            "  --kv-cache-bytes N            KV cache budget, suffixes K M G (default 1G)\n"
            "  --kv-cache-fraction F         KV cache budget as a fraction of available memory (0 < F <= 0.9)\n"
            "  --kv-cache-dtype auto|f32|bf16  the KV cache's element type (default auto: bf16 under\n"
            "                                --precision bf16 where the backend reads it, else f32)\n"
            "  --max-num-seqs N              running sequences per iteration (default 256)\n"
            "  --max-num-batched-tokens N    tokens per iteration (default 2048)\n"
            "  --max-model-len N             context length (default: the model's, capped by the KV cache)\n"
            "  --max-cpu-loras N             adapters resident in host memory (default: unbounded)\n"
            "  --max-loras N                 adapters in device slots at once: the running batch's\n"
            "                                distinct adapters (default: unbounded)\n"
            "  --scheduler fcfs              the scheduling policy (default fcfs)\n"
            "  --slo-headroom F              slo: the fraction of a TPOT SLO it plans each\n"
            "                                iteration to, 0.5 to 1 (default 0.9)\n"
            "  --cost-model FILE             start the iteration cost model from FILE (JSON, as\n"
            "                                `caraserve batch --cost-model-out` writes); it keeps\n"
            "                                learning from every step\n"
            "  --profile-cost-model S        before serving, teach the cost model for about S seconds\n"
            "                                on synthetic batches (sizes, prompts, the adapters' ranks)\n"
            "  --adapter-slos FILE           per-model SLOs: JSON {\"NAME\": {\"ttft_ms\": X, \"tpot_ms\": Y}, ...,\n"
            "                                \"*\": {...}}; a request's own slo wins, field by field\n"
            "  --lora-cache-bytes N          host memory for adapters, suffixes K M G (default: unbounded)\n"
            "  --lora-io direct|buffered     how adapter files are read: O_DIRECT, past the page cache\n"
            "                                (default; a file system without it falls back by itself),\n"
            "                                or through the page cache (reloads of evicted adapters may\n"
            "                                then come from RAM)\n"
            "  --no-prefix-caching           do not reuse KV blocks across requests\n"
            "  --max-body-bytes N            largest request body, suffixes K M G (default 32M)\n"
            "  --max-n N                     most samples per request, n times prompts (default: max-num-seqs)\n"
            "  --max-logprobs N              most logprobs alternatives per token (default 20)\n"
            "  --shutdown-timeout S          on SIGTERM/SIGINT, seconds to let requests finish (default 30)\n"
            "  --metrics-prefix P            prefix of /metrics names (default caraserve_)\n"
            "  --max-adapter-bytes N         largest adapter upload (PUT /v1/adapters/...; default 2G)\n"
            "  --adapter-upload-dir DIR      where uploaded adapter versions are stored (default: a new /tmp dir)\n"
            "  --batch-invariant             every sequence's logits independent of the batch and the prefix\n"
            "                                cache (bit-identical repeats; slower prefill)\n"
            "  --precision exact|bf16        CPU matmuls against BF16 weights: exact F32 products of the\n"
            "                                activations (default), or activations rounded to BF16 with F32\n"
            "                                sums, as PyTorch and vLLM run BF16 models (faster prefill and\n"
            "                                batched decode on AVX512-BF16 and AMX CPUs)\n"
            "  --lora-dtype auto|bf16        adapters held as their files have them (default; F32 stays F32,\n"
            "                                exact against peft), or in BF16, F32 rounded when read (half the\n"
            "                                bytes held and streamed per token, as vLLM's --lora-dtype)\n"
            "  --reference-kernels           use the plain reference kernels (slow; for checking)\n"
            "  --mmap, --no-mmap             CPU backend: use the weights in place in the file's mapping (the\n"
            "                                page cache, shared with other processes), or read them into this\n"
            "                                process's memory in 2 MiB huge pages (default: --no-mmap where the\n"
            "                                kernel offers transparent huge pages, else --mmap)\n"
            "  --compress-weights            CPU backend: decode of 1-4 sequences reads the BF16 weights coded\n"
            "                                losslessly in 12 bits (0.75x the bytes per token; 0.75x the\n"
            "                                weights' size more memory)\n"
            "  --compress-weights-only       the same, keeping only the code: 0.75x the weights' memory instead\n"
            "                                of 1.75x; decode of 4-32 sequences 0.84-0.94x as fast (not on AMX\n"
            "                                CPUs: there it is --compress-weights)\n"
            "  --device auto|cpu|cuda        where the model runs (default auto: cuda where a CUDA build sees a GPU)\n"
            "  --gpu-memory-fraction F       of the GPU's memory caraserve may use (0 < F <= 1, default 0.9); on\n"
            "                                a GPU the KV cache takes what the weights leave unless sized\n"
            "  --cuda-graphs                 replay decode steps as CUDA graphs (off until measured faster)\n"
            "  --cold-start MODE             a request whose adapter is still streaming to the device: auto\n"
            "                                (default: cpu-assist where the device can), cpu-assist (its LoRA\n"
            "                                from host workers for the layers not there yet), wait\n"
            "  --assist-threads N            host LoRA workers of cpu-assist (default: a quarter of the CPUs)\n");
}

/* the serving cost model forgets slowly: a step 2,000 steps ago weighs 1/e */
#define COST_FORGET_SERVE 0.9995

enum {
    O_MODEL = 256, O_NAME, O_LORA, O_HOST, O_PORT, O_KEY, O_ROOT, O_CONFIG, O_TEMPLATE, O_THREADS, O_HTTP_THREADS,
    O_KV_BYTES, O_KV_FRAC, O_SEQS, O_BATCHED, O_MODEL_LEN, O_CPU_LORAS, O_LORA_BYTES, O_NO_PREFIX, O_BODY, O_MAX_N,
    O_MAX_LP, O_SHUTDOWN, O_METRICS_PREFIX, O_REFERENCE, O_HELP, O_ADAPTER_BYTES, O_UPLOAD_DIR, O_INVARIANT,
    O_DEVICE, O_MAX_LORAS, O_SCHEDULER, O_COST_MODEL, O_PROFILE, O_ADAPTER_SLOS,
    O_GPU_FRACTION, O_CUDA_GRAPHS, O_COLD_START, O_ASSIST_THREADS, O_LORA_IO, O_SLO_HEADROOM, O_PRECISION,
    O_KV_DTYPE, O_LORA_DTYPE, O_MMAP, O_NO_MMAP, O_COMPRESS, O_COMPRESS_ONLY
};

static const struct option OPTS[] = {
    {"model", required_argument, 0, O_MODEL},
    {"served-model-name", required_argument, 0, O_NAME},
    {"lora-modules", required_argument, 0, O_LORA},
    {"host", required_argument, 0, O_HOST},
    {"port", required_argument, 0, O_PORT},
    {"api-key", required_argument, 0, O_KEY},
    {"lora-root", required_argument, 0, O_ROOT},
    {"config", required_argument, 0, O_CONFIG},
    {"chat-template", required_argument, 0, O_TEMPLATE},
    {"threads", required_argument, 0, O_THREADS},
    {"http-threads", required_argument, 0, O_HTTP_THREADS},
    {"kv-cache-bytes", required_argument, 0, O_KV_BYTES},
    {"kv-cache-fraction", required_argument, 0, O_KV_FRAC},
    {"max-num-seqs", required_argument, 0, O_SEQS},
    {"max-num-batched-tokens", required_argument, 0, O_BATCHED},
    {"max-model-len", required_argument, 0, O_MODEL_LEN},
    {"max-cpu-loras", required_argument, 0, O_CPU_LORAS},
    {"max-loras", required_argument, 0, O_MAX_LORAS},
    {"scheduler", required_argument, 0, O_SCHEDULER},
    {"cost-model", required_argument, 0, O_COST_MODEL},
    {"profile-cost-model", required_argument, 0, O_PROFILE},
    {"adapter-slos", required_argument, 0, O_ADAPTER_SLOS},
    {"lora-cache-bytes", required_argument, 0, O_LORA_BYTES},
    {"lora-io", required_argument, 0, O_LORA_IO},
    {"slo-headroom", required_argument, 0, O_SLO_HEADROOM},
    {"no-prefix-caching", no_argument, 0, O_NO_PREFIX},
    {"max-body-bytes", required_argument, 0, O_BODY},
    {"max-n", required_argument, 0, O_MAX_N},
    {"max-logprobs", required_argument, 0, O_MAX_LP},
    {"shutdown-timeout", required_argument, 0, O_SHUTDOWN},
    {"metrics-prefix", required_argument, 0, O_METRICS_PREFIX},
    {"reference-kernels", no_argument, 0, O_REFERENCE},
    {"mmap", no_argument, 0, O_MMAP},
    {"no-mmap", no_argument, 0, O_NO_MMAP},
    {"compress-weights", no_argument, 0, O_COMPRESS},
    {"compress-weights-only", no_argument, 0, O_COMPRESS_ONLY},
    {"help", no_argument, 0, O_HELP},
    {"max-adapter-bytes", required_argument, 0, O_ADAPTER_BYTES},
    {"adapter-upload-dir", required_argument, 0, O_UPLOAD_DIR},
    {"batch-invariant", no_argument, 0, O_INVARIANT},
    {"precision", required_argument, 0, O_PRECISION},
    {"kv-cache-dtype", required_argument, 0, O_KV_DTYPE},
    {"lora-dtype", required_argument, 0, O_LORA_DTYPE},
    {"device", required_argument, 0, O_DEVICE},
    {"gpu-memory-fraction", required_argument, 0, O_GPU_FRACTION},
    {"cuda-graphs", no_argument, 0, O_CUDA_GRAPHS},
    {"cold-start", required_argument, 0, O_COLD_START},
    {"assist-threads", required_argument, 0, O_ASSIST_THREADS},
    {0, 0, 0, 0},
};

static bool parse_int(const char *name, const char *s, long lo, long hi, int *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (end == s || *end || errno || v < lo || v > hi) {
        fprintf(stderr, "caraserve serve: --%s wants an integer in [%ld, %ld], got '%s'\n", name, lo, hi, s);
        return false;
    }
    *out = (int)v;
    return true;
}

static bool push(char ***list, int *n, const char *v) {
    char **nl = realloc(*list, sizeof(char *) * (size_t)(*n + 1));
    if (!nl) return false;
    *list = nl;
    return ((*list)[(*n)++] = strdup(v)) != NULL;
}

/* --config FILE -> argv words ("--name", "value"); booleans take true/false */
static bool is_flag_opt(const char *name) {
    for (const struct option *o = OPTS; o->name; o++)
        if (!strcmp(o->name, name)) return o->has_arg == no_argument;
    return false;
}

int serve_read_config(const char *path, char ***words, int *n) {
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "caraserve serve: --config %s: %s\n", path, strerror(errno));
        return -1;
    }
    char *line = NULL;
    size_t cap = 0;
    int lineno = 0, rc = 0;
    while (getline(&line, &cap, f) > 0) {
        lineno++;
        char *p = line;
        while (*p == ' ' || *p == '\t') p++;
        char *end = p + strlen(p);
        while (end > p && (end[-1] == '\n' || end[-1] == '\r' || end[-1] == ' ' || end[-1] == '\t')) *--end = 0;
        if (!*p || *p == '#') continue;
        char *eq = strchr(p, '=');
        char *key = p, *val = NULL;
        if (eq) {
            *eq = 0;
            val = eq + 1;
            char *ke = eq;
            while (ke > key && (ke[-1] == ' ' || ke[-1] == '\t')) *--ke = 0;
            while (*val == ' ' || *val == '\t') val++;
            size_t vl = strlen(val);
            if (vl >= 2 && ((val[0] == '"' && val[vl - 1] == '"') || (val[0] == '\'' && val[vl - 1] == '\''))) {
                val[vl - 1] = 0;
                val++;
            }
        }
        if (!strncmp(key, "--", 2)) key += 2;
        const struct option *o = OPTS;
        while (o->name && strcmp(o->name, key)) o++;
        if (!o->name || !strcmp(key, "config") || !strcmp(key, "help")) {
            fprintf(stderr, "caraserve serve: %s:%d: unknown option '%s'\n", path, lineno, key);
            rc = -1;
            break;
        }
        char opt[128];
        snprintf(opt, sizeof opt, "--%s", key);
        if (is_flag_opt(key)) {
            if (val && (!strcasecmp(val, "false") || !strcasecmp(val, "no") || !strcmp(val, "0"))) continue;
            if (val && *val && strcasecmp(val, "true") && strcasecmp(val, "yes") && strcmp(val, "1")) {
                fprintf(stderr, "caraserve serve: %s:%d: '%s' is true or false, got '%s'\n", path, lineno, key, val);
                rc = -1;
                break;
            }
            push(words, n, opt);
        } else {
            if (!val || !*val) {
                fprintf(stderr, "caraserve serve: %s:%d: '%s' needs a value ('%s = VALUE')\n", path, lineno, key, key);
                rc = -1;
                break;
            }
            push(words, n, opt);
            push(words, n, val);
        }
    }
    free(line);
    fclose(f);
    return rc;
}

/* the "bos_token"/"eos_token" string of tokenizer_config.json (a string or {"content": ...}) */
static char *special_token(json_t *cfg, const char *key) {
    json_t *v = json_object_get(cfg, key);
    if (json_is_object(v)) v = json_object_get(v, "content");
    return json_is_string(v) ? strdup(json_string_value(v)) : NULL;
}

static char *template_source(const char *model_dir, const char *override, json_t **tcfg) {
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

static bool parse_double(const char *name, const char *s, double lo, double hi, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= lo && v <= hi)) {
        fprintf(stderr, "caraserve serve: --%s must be a number from %g to %g, got '%s'\n", name, lo, hi, s);
        return false;
    }
    *out = v;
    return true;
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

int cmd_serve(int argc, char **argv) {
    serve_config_t cfg = {0};
    cfg.host = strdup("127.0.0.1");
    cfg.port = 8000;
    cfg.http_threads = 4;
    cfg.kv_cache_bytes = 1LL << 30;
    cfg.kv_cache_dtype = SETUP_KV_AUTO;
    cfg.max_body_bytes = 32LL << 20;
    cfg.max_adapter_bytes = 2LL << 30;
    cfg.max_logprobs = 20;
    cfg.shutdown_timeout = 30;
    cfg.metrics_prefix = strdup("caraserve_");
    int rc = 1;

    /* config file words first, then the command line (later wins) */
    char **words = NULL;
    int n_words = 0;
    push(&words, &n_words, "caraserve serve");
    for (int i = 1; i < argc; i++) {
        const char *cf = NULL;
        if (!strcmp(argv[i], "--config") && i + 1 < argc) cf = argv[i + 1];
        else if (!strncmp(argv[i], "--config=", 9)) cf = argv[i] + 9;
        if (cf && serve_read_config(cf, &words, &n_words)) goto out_words;
    }
    for (int i = 1; i < argc; i++) push(&words, &n_words, argv[i]);

    optind = 1;
    int c;
    bool ok;
    while ((c = getopt_long(n_words, words, "+h", OPTS, NULL)) != -1) {
        switch (c) {
        case O_MODEL: free(cfg.model); cfg.model = strdup(optarg); break;
        case O_NAME: free(cfg.served_model_name); cfg.served_model_name = strdup(optarg); break;
        case O_LORA:
            push(&cfg.lora_modules, &cfg.n_lora_modules, optarg);
            while (optind < n_words && words[optind][0] != '-') push(&cfg.lora_modules, &cfg.n_lora_modules, words[optind++]);
            break;
        case O_HOST: free(cfg.host); cfg.host = strdup(optarg); break;
        case O_PORT: if (!parse_int("port", optarg, 0, 65535, &cfg.port)) goto usage_err; break;
        case O_KEY: free(cfg.api_key); cfg.api_key = strdup(optarg); break;
        case O_ROOT: push(&cfg.lora_roots, &cfg.n_lora_roots, optarg); break;
        case O_CONFIG: break;
        case O_TEMPLATE: free(cfg.chat_template); cfg.chat_template = strdup(optarg); break;
        case O_THREADS: if (!parse_int("threads", optarg, 1, 1024, &cfg.threads)) goto usage_err; break;
        case O_HTTP_THREADS: if (!parse_int("http-threads", optarg, 1, 256, &cfg.http_threads)) goto usage_err; break;
        case O_KV_BYTES:
            cfg.kv_cache_bytes = cs_parse_size(optarg, &ok);
            if (!ok || cfg.kv_cache_bytes <= 0) { fprintf(stderr, "caraserve serve: bad --kv-cache-bytes '%s'\n", optarg); goto usage_err; }
            cfg.kv_cache_explicit = true;
            break;
        case O_KV_FRAC: {
            char *end;
            cfg.kv_cache_fraction = strtod(optarg, &end);
            if (*end || !(cfg.kv_cache_fraction > 0 && cfg.kv_cache_fraction <= 0.9)) {
                fprintf(stderr, "caraserve serve: --kv-cache-fraction wants 0 < F <= 0.9, got '%s'\n", optarg);
                goto usage_err;
            }
            break;
        }
        case O_SEQS: if (!parse_int("max-num-seqs", optarg, 1, 65536, &cfg.max_num_seqs)) goto usage_err; break;
        case O_BATCHED: if (!parse_int("max-num-batched-tokens", optarg, 1, 1 << 24, &cfg.max_num_batched_tokens)) goto usage_err; break;
        case O_MODEL_LEN: if (!parse_int("max-model-len", optarg, 2, 1 << 24, &cfg.max_model_len)) goto usage_err; break;
        case O_CPU_LORAS: if (!parse_int("max-cpu-loras", optarg, 0, 1 << 20, &cfg.max_cpu_loras)) goto usage_err; break;
        case O_MAX_LORAS: if (!parse_int("max-loras", optarg, 0, 1 << 20, &cfg.max_loras)) goto usage_err; break;
        case O_SCHEDULER:
            free(cfg.scheduler);
            cfg.scheduler = strdup(optarg);
            break;
        case O_COST_MODEL:
            free(cfg.cost_model);
            cfg.cost_model = strdup(optarg);
            break;
        case O_SLO_HEADROOM: if (!parse_double("slo-headroom", optarg, 0.5, 1, &cfg.slo_headroom)) goto usage_err; break;
        case O_PROFILE: if (!parse_double("profile-cost-model", optarg, 0, 600, &cfg.profile_seconds)) goto usage_err; break;
        case O_ADAPTER_SLOS: free(cfg.adapter_slos); cfg.adapter_slos = strdup(optarg); break;
        case O_LORA_BYTES:
            cfg.lora_cache_bytes = cs_parse_size(optarg, &ok);
            if (!ok) { fprintf(stderr, "caraserve serve: bad --lora-cache-bytes '%s'\n", optarg); goto usage_err; }
            break;
        case O_LORA_IO:
            if (strcmp(optarg, "direct") && strcmp(optarg, "buffered")) {
                fprintf(stderr, "caraserve serve: --lora-io wants direct or buffered, got '%s'\n", optarg);
                goto usage_err;
            }
            cfg.lora_buffered_io = !strcmp(optarg, "buffered");
            break;
        case O_NO_PREFIX: cfg.no_prefix_caching = true; break;
        case O_BODY:
            cfg.max_body_bytes = cs_parse_size(optarg, &ok);
            if (!ok || cfg.max_body_bytes < 1024) { fprintf(stderr, "caraserve serve: bad --max-body-bytes '%s' (at least 1K)\n", optarg); goto usage_err; }
            break;
        case O_MAX_N: if (!parse_int("max-n", optarg, 1, 65536, &cfg.max_n)) goto usage_err; break;
        case O_MAX_LP: if (!parse_int("max-logprobs", optarg, 0, 20, &cfg.max_logprobs)) goto usage_err; break;
        case O_SHUTDOWN: {
            char *end;
            cfg.shutdown_timeout = strtod(optarg, &end);
            if (*end || !(cfg.shutdown_timeout >= 0)) {
                fprintf(stderr, "caraserve serve: --shutdown-timeout wants seconds >= 0, got '%s'\n", optarg);
                goto usage_err;
            }
            break;
        }
        case O_METRICS_PREFIX: free(cfg.metrics_prefix); cfg.metrics_prefix = strdup(optarg); break;
        case O_REFERENCE: cfg.reference_kernels = true; break;
        case O_MMAP: cfg.weights_mem = MODEL_WEIGHTS_MMAP; break;
        case O_NO_MMAP: cfg.weights_mem = MODEL_WEIGHTS_COPY; break;
        case O_COMPRESS: cfg.compress_weights = true; break;
        case O_COMPRESS_ONLY: cfg.compress_weights_only = true; break;
        case O_INVARIANT: cfg.batch_invariant = true; break;
        case O_PRECISION: {
            int prec = setup_parse_precision(optarg);
            if (prec < 0) {
                fprintf(stderr, "caraserve serve: --precision wants exact or bf16, got '%s'\n", optarg);
                goto usage_err;
            }
            cfg.precision_bf16 = prec == 1;
            break;
        }
        case O_KV_DTYPE:
            if ((cfg.kv_cache_dtype = setup_parse_kv_dtype(optarg)) == -2) {
                fprintf(stderr, "caraserve serve: --kv-cache-dtype wants auto, f32 or bf16, got '%s'\n", optarg);
                goto usage_err;
            }
            break;
        case O_LORA_DTYPE: {
            int d = setup_parse_lora_dtype(optarg);
            if (d < 0) {
                fprintf(stderr, "caraserve serve: --lora-dtype wants auto or bf16, got '%s'\n", optarg);
                goto usage_err;
            }
            cfg.lora_bf16 = d == 1;
            break;
        }
        case O_DEVICE: free(cfg.device); cfg.device = strdup(optarg); break;
        case O_CUDA_GRAPHS: cfg.cuda_graphs = true; break;
        case O_COLD_START:
            if ((cfg.cold_start = setup_parse_cold_start(optarg)) < 0) {
                fprintf(stderr, "caraserve serve: --cold-start wants auto, cpu-assist or wait, got '%s'\n", optarg);
                goto usage_err;
            }
            break;
        case O_ASSIST_THREADS: if (!parse_int("assist-threads", optarg, 1, 256, &cfg.assist_threads)) goto usage_err; break;
        case O_GPU_FRACTION:
            if (!setup_parse_gpu_fraction(optarg, &cfg.gpu_memory_fraction)) {
                fprintf(stderr, "caraserve serve: --gpu-memory-fraction wants 0 < F <= 1, got '%s'\n", optarg);
                goto usage_err;
            }
            break;
        case O_ADAPTER_BYTES:
            cfg.max_adapter_bytes = cs_parse_size(optarg, &ok);
            if (!ok || cfg.max_adapter_bytes < 1024) { fprintf(stderr, "caraserve serve: bad --max-adapter-bytes '%s'\n", optarg); goto usage_err; }
            break;
        case O_UPLOAD_DIR: free(cfg.adapter_upload_dir); cfg.adapter_upload_dir = strdup(optarg); break;
        case 'h':
        case O_HELP: usage_serve(stdout); rc = 0; goto out_words;
        default: goto usage_err;
        }
    }
    if (optind < n_words) { fprintf(stderr, "caraserve serve: unexpected argument '%s'\n", words[optind]); goto usage_err; }
    if (!cfg.model) { fprintf(stderr, "caraserve serve: --model DIR is required\n"); goto usage_err; }
    if (!cfg.api_key && getenv("CARASERVE_API_KEY") && getenv("CARASERVE_API_KEY")[0])
        cfg.api_key = strdup(getenv("CARASERVE_API_KEY"));
    for (const char *p = cfg.metrics_prefix; *p; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9' && p != cfg.metrics_prefix) || *p == '_' || *p == ':')) {
            fprintf(stderr, "caraserve serve: --metrics-prefix '%s' is not a valid metric name prefix\n", cfg.metrics_prefix);
            goto usage_err;
        }
    char **lnames = calloc((size_t)cfg.n_lora_modules + 1, sizeof(char *)), **ldirs = calloc((size_t)cfg.n_lora_modules + 1, sizeof(char *));
    for (int i = 0; i < cfg.n_lora_modules; i++)
        if (!parse_lora_module(cfg.lora_modules[i], &lnames[i], &ldirs[i])) {
            fprintf(stderr, "caraserve serve: --lora-modules wants NAME=DIR or {\"name\": N, \"path\": DIR}, got '%s'\n",
                    cfg.lora_modules[i]);
            for (int k = 0; k <= i; k++) { free(lnames[k]); free(ldirs[k]); }
            free(lnames);
            free(ldirs);
            goto usage_err;
        }

    if (pipe(sig_pipe)) { perror("caraserve serve: pipe"); goto usage_err; }
    struct sigaction sa = {0};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    server_t *s = calloc(1, sizeof *s);
    s->cfg = cfg;
    memset(&cfg, 0, sizeof cfg); /* owned by s now */
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->drop_mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->created = time(NULL);
    json_t *tcfg = NULL;
    char *tsrc = NULL;
    if (!s->cfg.served_model_name) {
        const char *b = s->cfg.model + strlen(s->cfg.model);
        while (b > s->cfg.model && b[-1] == '/') b--;
        const char *e = b;
        while (b > s->cfg.model && b[-1] != '/') b--;
        s->cfg.served_model_name = e > b ? strndup(b, (size_t)(e - b)) : strdup(s->cfg.model);
    }
    s->model_name = s->cfg.served_model_name;
    if (s->cfg.adapter_slos) { /* before anything slow: a bad file stops the start at once */
        char err[512];
        if (!(s->slos = sched_slo_table_load(s->cfg.adapter_slos, err, sizeof err))) {
            fprintf(stderr, "caraserve serve: --adapter-slos %s: %s\n", s->cfg.adapter_slos, err);
            goto out;
        }
    }
    for (int i = 0; i < s->cfg.n_lora_roots; i++) {
        char *rp = realpath(s->cfg.lora_roots[i], NULL);
        if (!rp) {
            fprintf(stderr, "caraserve serve: --lora-root %s: %s\n", s->cfg.lora_roots[i], strerror(errno));
            goto out;
        }
        push(&s->roots, &s->n_roots, rp);
        free(rp);
    }
    if (s->cfg.adapter_upload_dir) {
        if (mkdir(s->cfg.adapter_upload_dir, 0700) && errno != EEXIST) {
            fprintf(stderr, "caraserve serve: --adapter-upload-dir %s: %s\n", s->cfg.adapter_upload_dir, strerror(errno));
            goto out;
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
            goto out;
        }
    }
    if (server_metrics_init(s)) { fprintf(stderr, "caraserve serve: %s\n", cs_error_last()); goto out; }
    if (http_start(s)) { fprintf(stderr, "caraserve serve: %s\n", cs_error_last()); goto out; }
    fprintf(stderr, "caraserve: listening on http://%s%s%s:%d (loading %s)\n", strchr(s->cfg.host, ':') ? "[" : "",
            s->cfg.host, strchr(s->cfg.host, ':') ? "]" : "", s->bound_port, s->cfg.model);

    /* the model */
    s->be = setup_backend(&(setup_backend_opts_t){.device = s->cfg.device, .threads = s->cfg.threads,
                                                  .reference = s->cfg.reference_kernels,
                                                  .batch_invariant = s->cfg.batch_invariant,
                                                  .precision_bf16 = s->cfg.precision_bf16,
                                                  .compress_weights = s->cfg.compress_weights,
                                                  .compress_weights_only = s->cfg.compress_weights_only,
                                                  .gpu_memory_fraction = s->cfg.gpu_memory_fraction,
                                                  .cuda_graphs = s->cfg.cuda_graphs});
    if (!s->be) { fprintf(stderr, "caraserve serve: %s\n", cs_error_last()); goto out; }
    if (model_load_how(s->cfg.model, s->be, s->cfg.weights_mem, &s->model)) {
        fprintf(stderr, "caraserve serve: %s: %s\n", s->cfg.model, cs_error_last());
        goto out;
    }
    {
        bool assist_failed;
        s->assist = setup_assist(s->be, s->cfg.cold_start, s->cfg.assist_threads, &assist_failed);
        if (assist_failed) { fprintf(stderr, "caraserve serve: %s\n", cs_error_last()); goto out; }
        model_set_assist(s->model, s->assist);
    }
    char *tj = cs_path_join(s->cfg.model, "tokenizer.json");
    bool have_tok = tj && cs_file_exists(tj);
    free(tj);
    if (have_tok && tokenizer_load(s->cfg.model, &s->tok)) { fprintf(stderr, "caraserve serve: %s: %s\n", s->cfg.model, cs_error_last()); goto out; }
    tsrc = template_source(s->cfg.model, s->cfg.chat_template, &tcfg);
    if (s->cfg.chat_template && !tsrc) { fprintf(stderr, "caraserve serve: --chat-template %s: %s\n", s->cfg.chat_template, cs_error_last()); goto out; }
    if (tsrc) {
        if (chat_template_parse(tsrc, strlen(tsrc), &s->tmpl)) {
            fprintf(stderr, "caraserve serve: the chat template of %s cannot be served: %s\n",
                    s->cfg.chat_template ? s->cfg.chat_template : s->cfg.model, cs_error_last());
            goto out;
        }
        s->tmpl_wants_parts = strstr(tsrc, "['type']") || strstr(tsrc, "[\"type\"]");
    }
    s->bos_token = special_token(tcfg, "bos_token");
    s->eos_token = special_token(tcfg, "eos_token");
    const model_config_t *mc = model_get_config(s->model);
    s->vocab_size = mc->vocab_size;
    lora_registry_params_t lp = {.cfg = mc, .buffered_io = s->cfg.lora_buffered_io, .hold_bf16 = s->cfg.lora_bf16,
                                 .cache_bytes = (size_t)s->cfg.lora_cache_bytes, .max_loras = s->cfg.max_cpu_loras,
                                 .device = s->be, .device_slots = s->cfg.max_loras, .on_loaded = NULL, .on_load_time = server_on_load_time,
                                 .stream_group = 1, .stream_host = true, .on_streamed = server_on_streamed,
                                 .on_dropped = server_on_dropped, .user = s};
    size_t kv_bytes = (size_t)s->cfg.kv_cache_bytes;
    if (s->cfg.kv_cache_fraction > 0) {
        size_t avail = cs_mem_available();
        if (!avail) { fprintf(stderr, "caraserve serve: cannot read MemAvailable for --kv-cache-fraction\n"); goto out; }
        kv_bytes = (size_t)((double)avail * s->cfg.kv_cache_fraction);
    }
    kv_bytes = setup_kv_bytes(s->be, kv_bytes, s->cfg.kv_cache_explicit || s->cfg.kv_cache_fraction > 0);
    if (!(s->cost = cost_model_new(COST_FORGET_SERVE))) { fprintf(stderr, "caraserve serve: out of memory\n"); goto out; }
    if (s->cfg.cost_model && cost_model_load(s->cost, s->cfg.cost_model)) {
        fprintf(stderr, "caraserve serve: --cost-model: %s\n", cs_error_last());
        goto out;
    }
    if (!(s->sched = setup_scheduler(s->cfg.scheduler, s->cost, s->cfg.slo_headroom))) { fprintf(stderr, "caraserve serve: %s\n", cs_error_last()); goto out; }
    engine_params_t ep = {.model = s->model, .tokenizer = s->tok, .kv_cache_bytes = kv_bytes, .sched = s->sched,
                          .max_num_seqs = s->cfg.max_num_seqs, .max_num_batched_tokens = s->cfg.max_num_batched_tokens,
                          .max_model_len = s->cfg.max_model_len, .no_prefix_caching = s->cfg.no_prefix_caching,
                          .cold_start = s->cfg.cold_start,
                          .kv_cache_dtype = setup_kv_dtype(s->be, s->cfg.kv_cache_dtype, s->cfg.precision_bf16,
                                                          model_weight_dtype(s->model))};
    if (!s->tok && mc->n_eos) { ep.eos_ids = mc->eos_token_ids; ep.n_eos = mc->n_eos; }
    /* a finished load wakes the engine at once (else it would notice at its next 20 ms poll):
     * the registry comes first, and finds the engine through s */
    lp.on_loaded = wake_engine;
    if (lora_registry_new(&lp, &s->reg)) { fprintf(stderr, "caraserve serve: %s\n", cs_error_last()); goto out; }
    ep.loras = s->reg;
    engine_t *engine = NULL;
    if (engine_new(&ep, &engine)) { fprintf(stderr, "caraserve serve: %s\n", cs_error_last()); goto out; }
    pthread_mutex_lock(&s->mu);
    s->engine = engine;
    pthread_mutex_unlock(&s->mu);
    s->max_model_len = engine_max_model_len(s->engine);
    if (!s->cfg.max_n) s->cfg.max_n = s->cfg.max_num_seqs > 0 ? s->cfg.max_num_seqs : 256;
    for (int i = 0; i < s->cfg.n_lora_modules; i++) {
        unsigned st;
        char err[1536];
        if (server_add_adapter(s, lnames[i], ldirs[i], false, &st, err, sizeof err)) {
            fprintf(stderr, "caraserve serve: --lora-modules %s=%s: %s\n", lnames[i], ldirs[i], err);
            goto out;
        }
    }
    if (s->cfg.profile_seconds > 0) {
        double tp = cs_time_ms();
        int steps = setup_profile_cost_model(s->engine, s->cost, (const char *const *)lnames, s->cfg.n_lora_modules,
                                             mc->vocab_size, s->max_model_len, s->cfg.profile_seconds);
        if (steps < 0) { fprintf(stderr, "caraserve serve: %s\n", cs_error_last()); goto out; }
        cost_fit_t cf;
        cost_model_get(s->cost, &cf);
        fprintf(stderr, "caraserve: cost model: %d steps profiled in %.1f s: R² %.3f, held-out error %.1f%%; ms per unit:",
                steps, (cs_time_ms() - tp) / 1000, cf.r2, 100 * cf.heldout_mape);
        for (int i = 0; i < COST_N_TERMS; i++) fprintf(stderr, " %s %.4g", cost_term_names[i], cf.coef[i]);
        fprintf(stderr, "\n");
    }
    if (engine_start(s->engine)) { fprintf(stderr, "caraserve serve: %s\n", cs_error_last()); goto out; }
    if (api_watch_start(s)) { fprintf(stderr, "caraserve serve: %s\n", cs_error_last()); goto out; }
    pthread_mutex_lock(&s->mu);
    s->ready = true;
    pthread_mutex_unlock(&s->mu);
    loading = 0;
    size_t huge = 0, copied = model_weights_copied(s->model, &huge);
    char wmem[224] = "weights mapped";
    if (copied)
        snprintf(wmem, sizeof wmem, "weights in memory, %.0f of %.0f MiB in huge pages", (double)huge / (1 << 20),
                 (double)copied / (1 << 20));
    backend_stats_t wbs;
    backend_get_stats(s->be, &wbs);
    if (wbs.prepared_bytes) {
        size_t l = strlen(wmem);
        snprintf(wmem + l, sizeof wmem - l, ", coded in %.0f of %.0f MiB%s", (double)wbs.prepared_bytes / (1 << 20),
                 (double)wbs.prepared_from / (1 << 20),
                 model_weights_released(s->model) ? ", the BF16 released" : " for decode");
    }
    fprintf(stderr, "caraserve: ready: %s (%d adapters, context %d, %s KV cache, %s chat template, %s) on http://%s:%d\n",
            s->model_name, s->cfg.n_lora_modules, s->max_model_len, cs_dtype_name(ep.kv_cache_dtype),
            s->tmpl ? "with a" : "no", wmem, s->cfg.host, s->bound_port);

    /* until SIGTERM or SIGINT */
    int sig = next_signal(-1);
    fprintf(stderr, "caraserve: %s: draining (at most %gs)\n", sig == SIGINT ? "SIGINT" : "SIGTERM", s->cfg.shutdown_timeout);
    pthread_mutex_lock(&s->mu);
    s->draining = true;
    pthread_mutex_unlock(&s->mu);
    /* the listener stays open while the drain lasts: /health answers 503 (a load balancer's
     * readiness probe takes the server out) and new generation requests 503 "shutting down"
     * (a client retries elsewhere), where a closed socket would say nothing */
    engine_set_pause(s->engine, ENGINE_RUN); /* a paused server lets its requests finish now */
    double deadline = cs_time_ms() + s->cfg.shutdown_timeout * 1000.0;
    pthread_mutex_lock(&s->mu);
    bool forced = false;
    while ((s->n_jobs > 0 || s->n_unload_waiting > 0) && cs_time_ms() < deadline && !forced) {
        pthread_mutex_unlock(&s->mu);
        if (next_signal(20) == SIGINT) { /* a second Ctrl-C: do not wait */
            fprintf(stderr, "caraserve: second SIGINT: not waiting\n");
            forced = true;
        }
        pthread_mutex_lock(&s->mu);
    }
    int left = s->n_jobs + s->n_unload_waiting;
    pthread_mutex_unlock(&s->mu);
    if (left) {
        fprintf(stderr, "caraserve: aborting %d request(s) still running\n", left);
        api_abort_all(s);
        double d2 = cs_time_ms() + 5000;
        pthread_mutex_lock(&s->mu);
        while ((s->n_jobs > 0 || s->n_unload_waiting > 0) && cs_time_ms() < d2) {
            pthread_mutex_unlock(&s->mu);
            usleep(20000);
            pthread_mutex_lock(&s->mu);
        }
        left = s->n_jobs + s->n_unload_waiting;
        pthread_mutex_unlock(&s->mu);
    }
    if (left) { /* connections still held: stopping the daemon under them is not allowed */
        fprintf(stderr, "caraserve: %d connection(s) did not finish; exiting\n", left);
        _exit(0);
    }
    rc = 0;
out:
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
    tokenizer_free(s->tok);
    model_free(s->model);
    backend_free(s->be);
    server_metrics_free(s);
    for (served_adapter_t *a = s->adapters, *nx; a; a = nx) {
        nx = a->next;
        free(a->name);
        free(a->path);
        free(a->waiters);
        free(a);
    }
    for (int i = 0; i < s->n_roots; i++) free(s->roots[i]);
    free(s->roots);
    for (int i = 0; i < s->cfg.n_lora_modules; i++) { free(lnames[i]); free(ldirs[i]); }
    free(lnames);
    free(ldirs);
    free(tsrc);
    json_decref(tcfg);
    if (s->upload_dir && !s->cfg.adapter_upload_dir) /* ours (mkdtemp): uploads do not outlive the server */
        nftw(s->upload_dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    free(s->upload_dir);
    free(s->bos_token);
    free(s->eos_token);
    cfg = s->cfg;
    server_drain_drops(s);
    free(s->drops);
    pthread_mutex_destroy(&s->drop_mu);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
    if (rc == 0) fprintf(stderr, "caraserve: stopped\n");
    goto out_words;
usage_err:
    usage_serve(stderr);
    rc = 2;
out_words:
    for (int i = 0; i < n_words; i++) free(words[i]);
    free(words);
    free(cfg.model);
    free(cfg.served_model_name);
    free(cfg.host);
    free(cfg.api_key);
    free(cfg.chat_template);
    free(cfg.metrics_prefix);
    free(cfg.adapter_upload_dir);
    free(cfg.device);
    free(cfg.scheduler);
    free(cfg.cost_model);
    free(cfg.adapter_slos);
    for (int i = 0; i < cfg.n_lora_modules; i++) free(cfg.lora_modules[i]);
    free(cfg.lora_modules);
    for (int i = 0; i < cfg.n_lora_roots; i++) free(cfg.lora_roots[i]);
    free(cfg.lora_roots);
    return rc;
}
