/* options.c: the option table of `caraserve generate`, `batch` and `serve`, and what reads
 * it: getopt_long parsing, --help, and serve's --config file. An option is one row: its name,
 * the argument it takes, the commands that take it, the field of cs_options_t its value goes
 * to, its validation, default and help. */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "base/common.h"
#include "server/options.h"
#include "server/setup.h"

typedef enum {
    K_FLAG,      /* a switch: the bool field true */
    K_CONST,     /* a switch: the int field = value */
    K_INT,       /* an integer in [lo, hi] */
    K_U64,       /* an unsigned 64-bit integer */
    K_DOUBLE,    /* a number in [lo, hi] ((lo, hi] with lo_open) */
    K_FLOAT,     /* the same, held as a float */
    K_SIZE,      /* bytes with a K, M or G suffix, at least lo (long long) */
    K_STRING,    /* the last one given wins */
    K_LIST,      /* repeatable: each value appended (char **, count at n_off) */
    K_LIST_MANY, /* the same, also taking the words after it up to the next option */
    K_SET,       /* set() parses it into the field */
    K_CONFIG,    /* --config FILE: read before the command line (options_read_config) */
    K_HELP,
} opt_kind;

typedef struct opt {
    const char *name;
    const char *arg;         /* the value's name in --help; NULL: a switch */
    opt_kind kind;
    unsigned cmds;           /* OPT_CMD_* that take it */
    size_t off;              /* offsetof(cs_options_t, its field) */
    size_t n_off;            /* K_LIST*: the count's offset */
    size_t seen;             /* a bool field set when the option is given (0: none) */
    double lo, hi;
    bool lo_open;
    int value;               /* K_CONST */
    bool (*set)(void *dst, const char *arg); /* K_SET */
    const char *wants;       /* what a bad value is told it wants (NULL: said from the kind) */
    const char *def;         /* the default, parsed as the value would be (NULL: zero) */
    const char *help;
} opt_t;

static bool set_precision(void *dst, const char *arg) {
    int p = setup_parse_precision(arg);
    *(int *)dst = p;
    return p >= 0;
}

static bool set_quantization(void *dst, const char *arg) { return (*(int *)dst = setup_parse_quantization(arg)) >= 0; }

static bool set_kv_dtype(void *dst, const char *arg) { return (*(int *)dst = setup_parse_kv_dtype(arg)) != -2; }

static bool set_lora_dtype(void *dst, const char *arg) {
    int d = setup_parse_lora_dtype(arg);
    *(bool *)dst = d == 1;
    return d >= 0;
}

static bool set_lora_io(void *dst, const char *arg) {
    *(bool *)dst = !strcmp(arg, "buffered");
    return !strcmp(arg, "direct") || !strcmp(arg, "buffered");
}

static bool set_cold_start(void *dst, const char *arg) { return (*(int *)dst = setup_parse_cold_start(arg)) >= 0; }

static bool set_assist_dtype(void *dst, const char *arg) {
    if (!strcmp(arg, "auto")) *(int *)dst = SETUP_ASSIST_AUTO;
    else if (!strcmp(arg, "f32")) *(int *)dst = SETUP_ASSIST_F32;
    else if (!strcmp(arg, "bf16")) *(int *)dst = SETUP_ASSIST_BF16;
    else return false;
    return true;
}

#define F(field) offsetof(cs_options_t, field)
#define GEN OPT_CMD_GENERATE
#define BAT OPT_CMD_BATCH
#define SRV OPT_CMD_SERVE
#define ALL (GEN | BAT | SRV)

static const opt_t OPTS[] = {
    /* the model and its adapters */
    {"model", "DIR", K_STRING, ALL, F(model),
     .help = "Hugging Face model directory (config.json, *.safetensors, tokenizer.json), or a GGUF file"},
    {"lora", "DIR", K_STRING, GEN, F(lora_dir),
     .help = "PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors)"},
    {"lora", "NAME=DIR", K_LIST, BAT, F(lora_modules), F(n_lora_modules),
     .help = "serve the PEFT adapter in DIR as NAME (repeatable)"},
    {"served-model-name", "NAME", K_STRING, SRV, F(served_model_name),
     .help = "the base model's name in the API (default: the directory's name)"},
    {"weight-version", "NAME", K_STRING, SRV, F(weight_version), .def = "default",
     .help = "the name of the first weights' version (SGLang's weight_version; an update names its own)"},
    {"lora-modules", "NAME=DIR ...", K_LIST_MANY, SRV, F(lora_modules), F(n_lora_modules),
     .help = "serve PEFT adapters (one or more after the flag; repeatable; also vLLM's JSON form "
             "'{\"name\": N, \"path\": DIR}')"},
    {"lora-root", "DIR", K_LIST, SRV, F(lora_roots), F(n_lora_roots),
     .help = "adapters loaded over HTTP must be inside DIR (repeatable; without it /v1/load_lora_adapter is "
             "refused)"},
    {"lora-resolve", "DIR", K_LIST, SRV, F(lora_resolve), F(n_lora_resolve),
     .help = "a request for a model that is not registered but names DIR/<model>, a PEFT adapter, loads it "
             "on first use (repeatable, tried in order; DIR inside a --lora-root)"},
    {"lora-modules-dir", "DIR", K_LIST, SRV, F(lora_modules_dirs), F(n_lora_modules_dirs),
     .help = "at start, serve every PEFT adapter directory in DIR under its directory's name (repeatable)"},
    {"config", "FILE", K_CONFIG, SRV,
     .help = "read options from FILE ('name = value' lines; see etc/caraserve.conf); the command line wins"},
    {"generation-config", "auto|vllm|DIR", K_STRING, SRV, F(generation_config), .def = "auto",
     .help = "sampling defaults of requests that leave them out: auto, the model's generation_config.json "
             "(its temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens); vllm, vLLM's "
             "(temperature 1, the rest off); DIR, DIR/generation_config.json's"},
    {"chat-template", "FILE", K_STRING, SRV, F(chat_template),
     .help = "Jinja chat template instead of tokenizer_config.json's"},

    /* generate's prompt and sampling */
    {"prompt", "TEXT", K_STRING, GEN, F(prompt), .help = "prompt text (tokenized with the model's tokenizer.json)"},
    {"prompt-ids", "LIST", K_STRING, GEN, F(prompt_ids),
     .help = "prompt as comma-separated token ids (no tokenizer needed)"},
    {"max-tokens", "N", K_INT, GEN, F(max_tokens), .lo = 0, .hi = INT_MAX, .def = "64",
     .help = "tokens to generate (default 64; 0 only scores the prompt)"},
    {"temperature", "T", K_FLOAT, GEN, F(temperature), .lo = 0, .hi = INFINITY, .def = "0",
     .help = "0 = greedy (default), else sample with this temperature"},
    {"seed", "S", K_U64, GEN, F(seed), .def = "0", .help = "sampling seed"},
    {"print-ids", NULL, K_FLAG, GEN, F(print_ids), .help = "also print the prompt and generated token ids"},
    {"no-special", NULL, K_FLAG, GEN, F(no_special),
     .help = "do not add the tokenizer's special tokens (e.g. BOS) to --prompt"},
    {"ignore-eos", NULL, K_FLAG, GEN, F(ignore_eos), .help = "keep generating past end-of-sequence tokens"},
    {"dump-logits", "FILE", K_STRING, GEN, F(dump_logits),
     .help = "write the logits of every position (binary, for tests)"},

    /* batch's requests and results */
    {"requests", "FILE", K_STRING, BAT, F(requests), .help = "JSON lines, one request each (default: stdin)"},
    {"sequential", NULL, K_FLAG, BAT, F(sequential), .help = "run each request alone, one after the other"},
    {"timings", NULL, K_FLAG, BAT, F(timings),
     .help = "each output line gains ttft_ms and e2e_ms (from its submission)"},
    {"preload-adapters", NULL, K_FLAG, BAT, F(preload_adapters),
     .help = "load every --lora adapter before the first request (a batch that does not depend on load times)"},
    {"stats", NULL, K_FLAG, GEN | BAT, F(stats),
     .help = "print statistics to stderr: generate its load, prefill and decode speed, batch the engine's (JSON) "
             "at the end"},
    {"cost-model-out", "FILE", K_STRING, BAT, F(cost_model_out),
     .help = "write the iteration cost model fitted on this run (JSON)"},

    /* serve's HTTP side */
    {"host", "ADDR", K_STRING, SRV, F(host), .def = "127.0.0.1",
     .help = "address to bind (default 127.0.0.1; 0.0.0.0 or :: for all)"},
    {"port", "N", K_INT, SRV, F(port), .lo = 0, .hi = 65535, .def = "8000",
     .help = "TCP port (default 8000; 0 picks a free one, printed at start)"},
    {"api-key", "KEY", K_STRING, SRV, F(api_key),
     .help = "require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize (default: $CARASERVE_API_KEY)"},
    {"api-keys", "FILE", K_STRING, SRV, F(api_keys),
     .help = "keys and what each may do: {\"keys\": [{\"key\", \"role\": admin|tenant, \"adapters\", \"push\", "
             "\"base\"}]} (docs/tenants.md); reread on SIGHUP"},
    {"http-threads", "N", K_INT, SRV, F(http_threads), .lo = 1, .hi = 256, .def = "4",
     .help = "HTTP worker threads"},
    {"max-body-bytes", "N", K_SIZE, SRV, F(max_body_bytes), .lo = 1024, .def = "32M", .wants = "at least 1K",
     .help = "largest request body, suffixes K M G"},
    {"max-n", "N", K_INT, SRV, F(max_n), .lo = 1, .hi = 65536,
     .help = "most samples per request, n times prompts (default: max-num-seqs)"},
    {"max-logprobs", "N", K_INT, SRV, F(max_logprobs), .lo = 0, .hi = 20, .def = "20",
     .help = "most logprobs alternatives per token"},
    {"max-lora-rank", "N", K_INT, SRV, F(max_lora_rank), .lo = 0, .hi = 65536, .def = "0",
     .help = "refuse adapters whose rank is above N (vLLM's flag; default 0: any rank)"},
    {"tool-call-parser", "NAME", K_STRING, SRV, F(tool_call_parser),
     .help = "how tool calls are read out of chat replies: hermes, llama3_json, mistral or none (default: the "
             "format the chat template teaches)"},
    {"reasoning-parser", "NAME", K_STRING, SRV, F(reasoning_parser),
     .help = "qwen3 or deepseek_r1: a chat reply's <think> part is its reasoning_content, and structured output "
             "applies after it"},
    {"return-tokens-as-token-ids", NULL, K_FLAG, SRV, F(return_tokens_as_token_ids),
     .help = "logprobs name tokens as 'token_id:N' (a request's return_tokens_as_token_ids overrides)"},
    {"enable-prompt-tokens-details", NULL, K_FLAG, SRV, F(enable_prompt_tokens_details),
     .help = "usage carries prompt_tokens_details.cached_tokens (prefix-cache hits)"},
    {"shutdown-timeout", "S", K_DOUBLE, SRV, F(shutdown_timeout), .lo = 0, .hi = INFINITY, .def = "30",
     .wants = "wants seconds >= 0", .help = "on SIGTERM/SIGINT, seconds to let requests finish"},
    {"metrics-prefix", "P", K_STRING, SRV, F(metrics_prefix), .def = "caraserve_", .help = "prefix of /metrics names"},
    {"metrics-max-adapters", "N", K_INT, SRV, F(metrics_max_adapters), .lo = 0, .hi = 100000, .def = "100",
     .help = "adapters with /metrics series of their own: the N most requested over the last 5 minutes; the "
             "rest are summed under adapter=\"_other\" (default 100; GET /v1/adapters/NAME/stats has each)"},
    {"max-adapter-bytes", "N", K_SIZE, SRV, F(max_adapter_bytes), .lo = 1024, .def = "2G",
     .help = "largest adapter upload (PUT /v1/adapters/...)"},
    {"adapter-upload-dir", "DIR", K_STRING, SRV, F(adapter_upload_dir),
     .help = "where uploaded adapter versions are stored (default: a new /tmp dir)"},

    /* the engine */
    {"threads", "N", K_INT, ALL, F(threads), .lo = 1, .hi = 1024, .help = "CPU compute threads (default: all online CPUs)"},
    {"kv-cache-bytes", "N", K_SIZE, BAT | SRV, F(kv_cache_bytes), .lo = 1, .def = "1G", .seen = F(kv_cache_explicit),
     .help = "KV cache budget, suffixes K M G"},
    {"kv-cache-fraction", "F", K_DOUBLE, BAT | SRV, F(kv_cache_fraction), .lo = 0, .lo_open = true, .hi = 0.9,
     .help = "KV cache budget as a fraction of available memory (0 < F <= 0.9; it wins over --kv-cache-bytes)"},
    {"kv-cache-dtype", "auto|f32|bf16", K_SET, ALL, F(kv_cache_dtype), .set = set_kv_dtype, .def = "auto",
     .wants = "wants auto, f32 or bf16",
     .help = "the KV cache's element type (default auto: bf16 under --precision bf16 where the backend reads it, "
             "else f32)"},
    {"max-num-seqs", "N", K_INT, BAT | SRV, F(max_num_seqs), .lo = 1, .hi = 65536,
     .help = "running sequences per iteration (default 256)"},
    {"max-num-batched-tokens", "N", K_INT, BAT | SRV, F(max_num_batched_tokens), .lo = 1, .hi = 1 << 24,
     .help = "tokens per iteration (default 2048)"},
    {"max-model-len", "N", K_INT, BAT | SRV, F(max_model_len), .lo = 2, .hi = 1 << 24,
     .help = "context length (default: the model's, capped by the KV cache)"},
    {"max-cpu-loras", "N", K_INT, BAT | SRV, F(max_cpu_loras), .lo = 0, .hi = 1 << 20,
     .help = "adapters resident in host memory (default: unbounded)"},
    {"max-loras", "N", K_INT, BAT | SRV, F(max_loras), .lo = 0, .hi = 1 << 20,
     .help = "adapters in device slots at once: the running batch's distinct adapters (default: unbounded)"},
    {"scheduler", "fcfs", K_STRING, BAT | SRV, F(scheduler), .help = "the scheduling policy (default fcfs)"},
    {"slo-headroom", "F", K_DOUBLE, SRV, F(slo_headroom), .lo = 0.5, .hi = 1,
     .help = "slo: the fraction of a TPOT SLO it plans each iteration to, 0.5 to 1 (default 0.9)"},
    {"cost-model", "FILE", K_STRING, SRV, F(cost_model),
     .help = "start the iteration cost model from FILE (JSON, as `caraserve batch --cost-model-out` writes); it "
             "keeps learning from every step"},
    {"profile-cost-model", "S", K_DOUBLE, SRV, F(profile_seconds), .lo = 0, .hi = 600,
     .help = "before serving, teach the cost model for about S seconds on synthetic batches (sizes, prompts, the "
             "adapters' ranks)"},
    {"adapter-slos", "FILE", K_STRING, SRV, F(adapter_slos),
     .help = "per-model SLOs: JSON {\"NAME\": {\"ttft_ms\": X, \"tpot_ms\": Y}, ..., \"*\": {...}}; a request's own "
             "slo wins, field by field"},
    {"lora-cache-bytes", "N", K_SIZE, BAT | SRV, F(lora_cache_bytes), .lo = 0,
     .help = "host memory for adapters, suffixes K M G (default: unbounded)"},
    {"lora-io", "direct|buffered", K_SET, BAT | SRV, F(lora_buffered_io), .set = set_lora_io, .def = "direct",
     .wants = "wants direct or buffered",
     .help = "how adapter files are read: O_DIRECT, past the page cache (default; a file system without it falls "
             "back by itself), or through the page cache (reloads of evicted adapters may then come from RAM)"},
    {"lora-dtype", "auto|bf16", K_SET, ALL, F(lora_bf16), .set = set_lora_dtype, .def = "auto",
     .wants = "wants auto or bf16",
     .help = "adapters held as their files have them (default; F32 stays F32, exact against peft), or in BF16, F32 "
             "rounded when read (half the bytes held and streamed per token, as vLLM's --lora-dtype)"},
    {"no-prefix-caching", NULL, K_FLAG, BAT | SRV, F(no_prefix_caching),
     .help = "do not reuse KV blocks across requests"},
    {"cold-start", "MODE", K_SET, BAT | SRV, F(cold_start), .set = set_cold_start, .def = "auto",
     .wants = "wants auto, cpu-assist or wait",
     .help = "a request whose adapter is still streaming to the device: auto (default: cpu-assist where the "
             "device can), cpu-assist (its LoRA from host workers for the layers not there yet), wait"},
    {"assist-threads", "N", K_INT, BAT | SRV, F(assist_threads), .lo = 1, .hi = 256,
     .help = "host LoRA workers of cpu-assist (default: a quarter of the CPUs)"},
    {"assist-dtype", "auto|f32|bf16", K_SET, BAT | SRV, F(assist_dtype), .set = set_assist_dtype, .def = "auto",
     .wants = "wants auto, f32 or bf16",
     .help = "the LoRA terms cpu-assist sends back to the device: bf16 halves the bytes over the link; auto "
             "(default): bf16 for a BF16 or F16 model on a GPU, else f32 (exact)"},

    /* the backend */
    {"device", "auto|cpu|cuda|cuda:N", K_STRING, ALL, F(device),
     .help = "where the model runs (default auto: cuda where a CUDA build sees a GPU); cuda:N the N-th visible GPU "
             "(cuda: the first)"},
    {"precision", "exact|bf16|int8", K_SET, ALL, F(precision), .set = set_precision, .def = "exact",
     .wants = "wants exact, bf16 or int8",
     .help = "CPU matmuls: exact F32 products of the activations (default); bf16: against BF16 weights the "
             "activations rounded to BF16 with F32 sums, as PyTorch and vLLM run BF16 models (faster prefill and "
             "batched decode on AVX512-BF16 and AMX CPUs); int8: against quantized (GGUF) weights the activations "
             "quantized to 8 bits per 32 with integer products, as llama.cpp runs them (faster)"},
    {"quantization", "none|q8_0|q6_k|q5_k|q4_k|q5_1|q5_0|q4_1|q4_0", K_SET, ALL, F(quantization), .set = set_quantization,
     .def = "none", .wants = "wants none, q8_0, q6_k, q5_k, q4_k, q5_1, q5_0, q4_1 or q4_0",
     .help = "quantize the model's F32/F16/BF16 projection matrices at load into that GGUF block type (as vLLM's "
             "--quantization names a method; the embedding and lm_head stay as they are)"},
    {"batch-invariant", NULL, K_FLAG, ALL, F(batch_invariant),
     .help = "every sequence's logits independent of the batch and the prefix cache (bit-identical repeats; "
             "slower prefill)"},
    {"reference-kernels", NULL, K_FLAG, ALL, F(reference_kernels),
     .help = "use the plain reference kernels (slow; for checking)"},
    {"mmap", NULL, K_CONST, ALL, F(weights_mem), .value = MODEL_WEIGHTS_MMAP,
     .help = "CPU backend: use the weights in place in the file's mapping (the page cache, shared with other "
             "processes) (default: --no-mmap where the kernel offers transparent huge pages, else --mmap)"},
    {"no-mmap", NULL, K_CONST, ALL, F(weights_mem), .value = MODEL_WEIGHTS_COPY,
     .help = "CPU backend: read the weights into this process's memory in 2 MiB huge pages"},
    {"compress-weights", NULL, K_FLAG, ALL, F(compress_weights),
     .help = "CPU backend: decode of 1-4 sequences reads the BF16 weights coded losslessly in 12 bits (0.75x the "
             "bytes per token; 0.75x the weights' size more memory)"},
    {"compress-weights-only", NULL, K_FLAG, ALL, F(compress_weights_only),
     .help = "the same, keeping only the code: 0.75x the weights' memory instead of 1.75x; decode of 4-32 "
             "sequences 0.84-0.94x as fast (not on AMX CPUs: there it is --compress-weights)"},
    {"gpu-memory-fraction", "F", K_DOUBLE, BAT | SRV, F(gpu_memory_fraction), .lo = 0, .lo_open = true, .hi = 1,
     .help = "of the GPU's memory caraserve may use (0 < F <= 1, default 0.9); on a GPU the KV cache takes what "
             "the weights leave unless sized"},
    {"cuda-graphs", NULL, K_FLAG, BAT | SRV, F(cuda_graphs),
     .help = "replay decode steps as CUDA graphs (off until measured faster)"},
    {"help", NULL, K_HELP, ALL, .help = "print this help"},
};
#define N_OPTS (int)(sizeof OPTS / sizeof OPTS[0])

const char *options_cmd_name(unsigned cmd) {
    return cmd == OPT_CMD_GENERATE ? "caraserve generate" : cmd == OPT_CMD_BATCH ? "caraserve batch" : "caraserve serve";
}

/* what a bad value of T is told it wants */
static void opt_wants(const opt_t *t, char *buf, size_t len) {
    if (t->wants) snprintf(buf, len, "%s", t->wants);
    else if (t->kind == K_INT && t->hi == INT_MAX) snprintf(buf, len, "wants an integer >= %g", t->lo);
    else if (t->kind == K_INT) snprintf(buf, len, "wants an integer in [%ld, %ld]", (long)t->lo, (long)t->hi);
    else if (t->kind == K_U64) snprintf(buf, len, "wants an integer >= 0");
    else if (t->lo_open) snprintf(buf, len, "wants %g < F <= %g", t->lo, t->hi);
    else if (isinf(t->hi)) snprintf(buf, len, "must be a number >= %g", t->lo);
    else snprintf(buf, len, "must be a number from %g to %g", t->lo, t->hi);
}

static bool push(char ***list, int *n, const char *v) {
    char **nl = realloc(*list, sizeof(char *) * (size_t)(*n + 1));
    if (!nl) return false;
    *list = nl;
    return ((*list)[(*n)++] = strdup(v)) != NULL;
}

/* ARG into T's field of O; false when it is not a value T takes */
static bool opt_store(cs_options_t *o, const opt_t *t, const char *arg) {
    void *dst = (char *)o + t->off;
    char *end;
    errno = 0;
    switch (t->kind) {
    case K_FLAG: *(bool *)dst = true; return true;
    case K_CONST: *(model_weights_mem *)dst = (model_weights_mem)t->value; return true;
    case K_INT: {
        long v = strtol(arg, &end, 10);
        if (end == arg || *end || errno || v < t->lo || v > t->hi) return false;
        *(int *)dst = (int)v;
        return true;
    }
    case K_U64: {
        unsigned long long v = strtoull(arg, &end, 10);
        if (end == arg || *end) return false;
        *(unsigned long long *)dst = v;
        return true;
    }
    case K_DOUBLE:
    case K_FLOAT: {
        double v = strtod(arg, &end);
        if (end == arg || *end || !(t->lo_open ? v > t->lo : v >= t->lo) || !(v <= t->hi)) return false;
        if (t->kind == K_FLOAT) *(float *)dst = strtof(arg, NULL);
        else *(double *)dst = v;
        return true;
    }
    case K_SIZE: {
        bool ok;
        long long v = cs_parse_size(arg, &ok);
        if (!ok || v < t->lo) return false;
        *(long long *)dst = v;
        return true;
    }
    case K_STRING:
        free(*(char **)dst);
        return (*(char **)dst = strdup(arg)) != NULL;
    case K_LIST:
    case K_LIST_MANY: return push((char ***)dst, (int *)((char *)o + t->n_off), arg);
    case K_SET: return t->set(dst, arg);
    case K_CONFIG:
    case K_HELP: return true;
    }
    return false;
}

/* T given with ARG (NULL for a switch) to command CMD: stored, or false with the reason said */
static bool opt_apply(cs_options_t *o, const opt_t *t, const char *arg, unsigned cmd) {
    if (!opt_store(o, t, arg)) {
        char wants[96];
        opt_wants(t, wants, sizeof wants);
        if (t->kind == K_SIZE)
            fprintf(stderr, "%s: bad --%s '%s'%s%s%s\n", options_cmd_name(cmd), t->name, arg, t->wants ? " (" : "",
                    t->wants ? t->wants : "", t->wants ? ")" : "");
        else
            fprintf(stderr, "%s: --%s %s, got '%s'\n", options_cmd_name(cmd), t->name, wants, arg);
        return false;
    }
    if (t->seen) *(bool *)((char *)o + t->seen) = true;
    return true;
}

void options_init(cs_options_t *o) {
    memset(o, 0, sizeof *o);
    for (int i = 0; i < N_OPTS; i++)
        if (OPTS[i].def && !opt_store(o, &OPTS[i], OPTS[i].def)) CS_ASSERT(!"an option's default is not a value of it");
}

static void free_list(char **list, int n) {
    for (int i = 0; i < n; i++) free(list[i]);
    free(list);
}

void options_free(cs_options_t *o) {
    for (int i = 0; i < N_OPTS; i++) {
        const opt_t *t = &OPTS[i];
        if (t->kind == K_STRING) free(*(char **)((char *)o + t->off));
        if (t->kind == K_LIST || t->kind == K_LIST_MANY) {
            char ***list = (char ***)((char *)o + t->off);
            int *n = (int *)((char *)o + t->n_off);
            free_list(*list, *n); /* a list two options share (--lora, --lora-modules) is freed once */
            *list = NULL;
            *n = 0;
        }
    }
    memset(o, 0, sizeof *o);
}

/* WORDS[1..] as options of CMD */
static int parse_words(cs_options_t *o, unsigned cmd, int argc, char **argv) {
    struct option lopts[N_OPTS + 1];
    int n = 0;
    for (int i = 0; i < N_OPTS; i++)
        if (OPTS[i].cmds & cmd)
            lopts[n++] = (struct option){OPTS[i].name, OPTS[i].arg ? required_argument : no_argument, NULL, 256 + i};
    lopts[n] = (struct option){0, 0, 0, 0};
    /* serve stops at the first word that is no option (--lora-modules takes the words after it) */
    const char *shorts = cmd == OPT_CMD_SERVE ? "+h" : "";
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, shorts, lopts, NULL)) != -1) {
        if (c == 'h') return OPT_HELP;
        if (c < 256) return OPT_EUNKNOWN;
        const opt_t *t = &OPTS[c - 256];
        if (t->kind == K_HELP) return OPT_HELP;
        if (!opt_apply(o, t, optarg, cmd)) return OPT_EVALUE;
        if (t->kind == K_LIST_MANY)
            while (optind < argc && argv[optind][0] != '-')
                if (!opt_apply(o, t, argv[optind++], cmd)) return OPT_EVALUE;
    }
    if (optind < argc) {
        fprintf(stderr, "%s: unexpected argument '%s'\n", options_cmd_name(cmd), argv[optind]);
        return OPT_EVALUE;
    }
    return OPT_OK;
}

int options_parse(cs_options_t *o, unsigned cmd, int argc, char **argv) {
    const opt_t *config = NULL;
    for (int i = 0; i < N_OPTS && !config; i++)
        if ((OPTS[i].cmds & cmd) && OPTS[i].kind == K_CONFIG) config = &OPTS[i];
    if (!config) return parse_words(o, cmd, argc, argv);
    /* the config files' words first, then the command line's (later ones win); getopt names
     * the command in its messages */
    char **words = NULL, flag[64], prefix[64];
    int n = 0, rc = OPT_OK;
    snprintf(flag, sizeof flag, "--%s", config->name);
    snprintf(prefix, sizeof prefix, "--%s=", config->name);
    push(&words, &n, options_cmd_name(cmd));
    for (int i = 1; i < argc && rc == OPT_OK; i++) {
        const char *cf = NULL;
        if (!strcmp(argv[i], flag) && i + 1 < argc) cf = argv[i + 1];
        else if (!strncmp(argv[i], prefix, strlen(prefix))) cf = argv[i] + strlen(prefix);
        if (cf && options_read_config(cf, cmd, &words, &n)) rc = OPT_ECONFIG;
    }
    for (int i = 1; i < argc && rc == OPT_OK; i++) push(&words, &n, argv[i]);
    if (rc == OPT_OK) rc = parse_words(o, cmd, n, words);
    free_list(words, n);
    return rc;
}

/* TEXT's words in lines up to WIDTH, the first from column AT on, the others from COL; a
 * word that starts with - or ` stays on its predecessor's line (no line of the help starts
 * with a flag it does not define) */
static void print_wrapped(FILE *f, const char *text, int at, int col, int width) {
    bool first = true;
    for (const char *p = text; *p;) {
        while (*p == ' ') p++;
        int w = (int)strcspn(p, " ");
        const char *next = p + w + strspn(p + w, " ");
        int keep = w + (*next == '-' || *next == '`' ? 1 + (int)strcspn(next, " ") : 0);
        if (!first && at + 1 + keep > width) {
            fprintf(f, "\n%*s", col, "");
            at = col;
            first = true;
        }
        if (!first) at += fprintf(f, " ");
        at += fprintf(f, "%.*s", w, p);
        first = false;
        p += w;
    }
    fprintf(f, "\n");
}

void options_usage(FILE *f, unsigned cmd, const char *synopsis, const char *epilogue) {
    enum { COL = 32, WIDTH = 112 };
    fprintf(f, "%s\n\n", synopsis);
    for (int i = 0; i < N_OPTS; i++) {
        const opt_t *t = &OPTS[i];
        if (!(t->cmds & cmd)) continue;
        int at = fprintf(f, "  --%s%s%s", t->name, t->arg ? " " : "", t->arg ? t->arg : "");
        char help[1024];
        if (t->def && !strstr(t->help, "default")) snprintf(help, sizeof help, "%s (default %s)", t->help, t->def);
        else snprintf(help, sizeof help, "%s", t->help);
        at += fprintf(f, "%*s", at <= COL - 2 ? COL - at : 2, "");
        print_wrapped(f, help, at, COL, WIDTH);
    }
    if (epilogue) fprintf(f, "\n%s", epilogue);
}

/* a config file's value: blanks around it and one pair of quotes dropped */
static char *config_split(char *p, char **val) {
    *val = NULL;
    char *eq = strchr(p, '=');
    if (!eq) return p;
    *eq = 0;
    char *v = eq + 1, *ke = eq;
    while (ke > p && (ke[-1] == ' ' || ke[-1] == '\t')) *--ke = 0;
    while (*v == ' ' || *v == '\t') v++;
    size_t vl = strlen(v);
    if (vl >= 2 && ((v[0] == '"' && v[vl - 1] == '"') || (v[0] == '\'' && v[vl - 1] == '\''))) {
        v[vl - 1] = 0;
        v++;
    }
    *val = v;
    return p;
}

static const opt_t *opt_find(const char *name, unsigned cmd) {
    for (int i = 0; i < N_OPTS; i++)
        if ((OPTS[i].cmds & cmd) && !strcmp(OPTS[i].name, name)) return &OPTS[i];
    return NULL;
}

/* one 'name = value' line as words; -1 with the reason said */
static int config_line(char *p, const char *path, int lineno, unsigned cmd, char ***words, int *n) {
    const char *who = options_cmd_name(cmd);
    char *val, *key = config_split(p, &val);
    if (!strncmp(key, "--", 2)) key += 2;
    const opt_t *t = opt_find(key, cmd);
    if (!t || t->kind == K_CONFIG || t->kind == K_HELP) {
        fprintf(stderr, "%s: %s:%d: unknown option '%s'\n", who, path, lineno, key);
        return -1;
    }
    char opt[128];
    snprintf(opt, sizeof opt, "--%s", key);
    if (!t->arg) {
        if (val && (!strcasecmp(val, "false") || !strcasecmp(val, "no") || !strcmp(val, "0"))) return 0;
        if (val && *val && strcasecmp(val, "true") && strcasecmp(val, "yes") && strcmp(val, "1")) {
            fprintf(stderr, "%s: %s:%d: '%s' is true or false, got '%s'\n", who, path, lineno, key, val);
            return -1;
        }
        push(words, n, opt);
        return 0;
    }
    if (!val || !*val) {
        fprintf(stderr, "%s: %s:%d: '%s' needs a value ('%s = VALUE')\n", who, path, lineno, key, key);
        return -1;
    }
    push(words, n, opt);
    push(words, n, val);
    return 0;
}

int options_read_config(const char *path, unsigned cmd, char ***words, int *n) {
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "%s: --config %s: %s\n", options_cmd_name(cmd), path, strerror(errno));
        return -1;
    }
    char *line = NULL;
    size_t cap = 0;
    int lineno = 0, rc = 0;
    while (rc == 0 && getline(&line, &cap, f) > 0) {
        lineno++;
        char *p = line;
        while (*p == ' ' || *p == '\t') p++;
        char *end = p + strlen(p);
        while (end > p && (end[-1] == '\n' || end[-1] == '\r' || end[-1] == ' ' || end[-1] == '\t')) *--end = 0;
        if (!*p || *p == '#') continue;
        rc = config_line(p, path, lineno, cmd, words, n);
    }
    free(line);
    fclose(f);
    return rc;
}
