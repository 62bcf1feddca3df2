/* cmd_batch.c: `caraserve batch`: runs a file of JSON-lines requests through the serving
 * engine (continuous batching, paged KV, prefix cache, many adapters) and prints one JSON
 * line per request with every sample's tokens, logprobs, text and finish reason. It is
 * how tests and bench/engine.sh drive the engine without HTTP. --sequential runs each
 * request alone (to compare with the batched run). */
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cpu_kernels/cpu_backend.h"
#include "server/setup.h"
#include "engine/engine.h"
#include "engine/sched.h"
#include "sched/cost.h"
#include "sched/slo.h"
#include "lora/assist.h"
#include "lora/registry.h"
#include "server/commands.h"

/* a "Key:   N kB" line of /proc/self/status in bytes (0 where there is none: not Linux) */
static size_t proc_status_bytes(const char *key) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return 0;
    char line[256];
    size_t v = 0, klen = strlen(key);
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, key, klen)) {
            v = (size_t)strtoull(line + klen, NULL, 10) * 1024;
            break;
        }
    fclose(f);
    return v;
}

static void usage_batch(FILE *f) {
    fprintf(f,
            "usage: caraserve batch --model DIR [--lora NAME=DIR ...] [--requests FILE] [options]\n"
            "\n"
            "  --model DIR                 Hugging Face model directory\n"
            "  --lora NAME=DIR             serve the PEFT adapter in DIR as NAME (repeatable)\n"
            "  --requests FILE             JSON lines, one request each (default: stdin)\n"
            "  --threads N                 CPU threads (default: all online CPUs)\n"
            "  --kv-cache-bytes N          KV cache budget, suffixes K M G (default 1G)\n"
            "  --kv-cache-dtype auto|f32|bf16  the KV cache's element type (default auto: bf16 under\n"
            "                              --precision bf16 where the backend reads it, else f32)\n"
            "  --kv-cache-fraction F       KV cache budget as a fraction of available memory (0 < F <= 0.9)\n"
            "  --lora-dtype auto|bf16      adapters held as their files have them (default; F32 stays F32,\n"
            "                              exact against peft), or in BF16, F32 rounded when read (half the\n"
            "                              bytes held and streamed per token, as vLLM's --lora-dtype)\n"
            "  --max-num-seqs N            running sequences per iteration (default 256)\n"
            "  --max-num-batched-tokens N  tokens per iteration (default 2048)\n"
            "  --max-model-len N           context length (default: the model's, capped by the KV cache)\n"
            "  --max-cpu-loras N           adapters resident in host memory (default: unbounded)\n"
            "  --max-loras N               adapters in device slots at once (default: unbounded)\n"
            "  --scheduler fcfs            the scheduling policy (default fcfs)\n"
            "  --cost-model-out FILE       write the iteration cost model fitted on this run (JSON)\n"
            "  --lora-cache-bytes N        host memory for adapters, suffixes K M G (default: unbounded)\n"
            "  --lora-io direct|buffered   adapter files read with O_DIRECT (default) or through the page cache\n"
            "  --no-prefix-caching         do not reuse KV blocks across requests\n"
            "  --sequential                run each request alone, one after the other\n"
            "  --stats                     print engine statistics (JSON) to stderr at the end\n"
            "  --batch-invariant           each sequence's results independent of the batch (bit-identical)\n"
            "  --precision exact|bf16      CPU matmuls against BF16 weights: exact (default), or on activations\n"
            "                              rounded to BF16 with F32 sums (faster on AVX512-BF16/AMX CPUs)\n"
            "  --reference-kernels         use the plain reference kernels\n"
            "  --mmap, --no-mmap           CPU backend: use the weights in place in the file's mapping (the\n"
            "                              page cache, shared with other processes), or read them into this\n"
            "                              process's memory in 2 MiB huge pages (default: --no-mmap where the\n"
            "                              kernel offers transparent huge pages, else --mmap)\n"
            "  --compress-weights          CPU backend: decode of 1-4 sequences reads the BF16 weights coded\n"
            "                              losslessly in 12 bits (0.75x the bytes per token; 0.75x the weights'\n"
            "                              size more memory)\n"
            "  --compress-weights-only     the same, keeping only the code: 0.75x the weights' memory instead\n"
            "                              of 1.75x; decode of 4-32 sequences 0.84-0.94x as fast (not on AMX\n"
            "                              CPUs: there it is --compress-weights)\n"
            "  --device auto|cpu|cuda      where the model runs (default auto: cuda where a GPU is visible)\n"
            "  --gpu-memory-fraction F     of the GPU's memory caraserve may use (0 < F <= 1, default 0.9);\n"
            "                              on a GPU the KV cache takes what the weights leave unless sized\n"
            "  --cuda-graphs               replay decode steps as CUDA graphs (off until measured faster)\n"
            "  --cold-start MODE           a request whose adapter is still streaming to the device: auto\n"
            "                              (default: cpu-assist where the device can), cpu-assist (its LoRA\n"
            "                              from host workers for the layers not there yet), wait\n"
            "  --assist-threads N          host LoRA workers of cpu-assist (default: a quarter of the CPUs)\n"
            "  --timings                   each output line gains ttft_ms and e2e_ms (from its submission)\n"
            "  --preload-adapters          load every --lora adapter before the first request (a batch\n"
            "                              that does not depend on load times)\n"
            "\n"
            "A request line: {\"prompt_ids\": [1, 2], or \"prompt\": \"text\", \"adapter\": \"NAME\",\n"
            "  \"max_tokens\", \"min_tokens\", \"n\", \"temperature\", \"top_k\", \"top_p\", \"min_p\",\n"
            "  \"repetition_penalty\", \"presence_penalty\", \"frequency_penalty\", \"seed\", \"stop\": [..],\n"
            "  \"stop_token_ids\": [..], \"ignore_eos\", \"logprobs\": K, \"logprobs_mode\": \"raw\"|\"processed\",\n"
            "  \"abort_after\": K (abort once sample 0 has K tokens; for tests), \"id\": anything}\n"
            "A control line {\"add_adapter\": {\"name\": N, \"dir\": D}} registers a new version of N when\n"
            "it is reached (with --sequential: after the requests before it have finished).\n");
}

typedef struct sample_res {
    json_t *tokens, *logprobs, *top;
    char *text;
    size_t text_len, text_cap;
    const char *finish;
    char *error;
} sample_res_t;

typedef struct job {
    json_t *in;              /* the request line */
    engine_request_t rq;
    int32_t *prompt;
    char **stops;
    int32_t *stop_ids;
    uint64_t id;
    int n;
    sample_res_t *samples;
    int prompt_tokens, cached_tokens, adapter_version;
    bool done, submitted;
    char *submit_error;
    int abort_after;
    bool abort_sent;
    bool control;            /* {"add_adapter": {"name", "dir"}}: registers (a new version) in order */
    int control_version;
    engine_t *engine;
    double t_submit, t_first, t_done; /* cs_time_ms(): --timings */
} job_t;

static bool g_timings; /* --timings: each line gains ttft_ms and e2e_ms */

static void sink(void *user, const engine_event_t *ev) {
    job_t *j = user;
    if (ev->index < 0 || ev->index >= j->n) return;
    sample_res_t *s = &j->samples[ev->index];
    j->prompt_tokens = ev->n_prompt_tokens;
    j->cached_tokens = ev->n_cached_tokens;
    j->adapter_version = ev->adapter_version;
    if (ev->has_token) {
        if (j->t_first == 0) j->t_first = cs_time_ms();
        json_array_append_new(s->tokens, json_integer(ev->token));
        if (j->rq.sampling.logprobs >= 0) {
            json_array_append_new(s->logprobs, isfinite(ev->logprob) ? json_real(ev->logprob) : json_null());
            json_t *alts = json_array();
            for (int i = 0; i < ev->n_top; i++)
                json_array_append_new(alts, json_pack("[i,o]", ev->top_ids[i],
                                                      isfinite(ev->top_logprobs[i]) ? json_real(ev->top_logprobs[i]) : json_null()));
            json_array_append_new(s->top, alts);
        }
    }
    if (ev->text_len) {
        if (s->text_len + ev->text_len + 1 > s->text_cap) {
            size_t nc = (s->text_len + ev->text_len + 1) * 2;
            char *nt = realloc(s->text, nc);
            if (nt) { s->text = nt; s->text_cap = nc; }
        }
        if (s->text_len + ev->text_len + 1 <= s->text_cap) {
            memcpy(s->text + s->text_len, ev->text, ev->text_len);
            s->text_len += ev->text_len;
            s->text[s->text_len] = 0;
        }
    }
    if (ev->finish != ENGINE_FINISH_NONE) {
        s->finish = engine_finish_names[ev->finish];
        if (ev->error_msg) s->error = strdup(ev->error_msg);
    }
    if (ev->request_done) {
        j->done = true;
        j->t_done = cs_time_ms();
    }
    if (j->abort_after > 0 && !j->abort_sent && ev->index == 0 && ev->n_generated >= j->abort_after &&
        ev->finish == ENGINE_FINISH_NONE) {
        engine_abort(j->engine, j->id);
        j->abort_sent = true;
    }
}

static int parse_int_opt(const char *name, const char *s, int lo, int *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (end == s || *end || errno || v < lo || v > INT32_MAX) {
        fprintf(stderr, "caraserve batch: %s must be an integer >= %d\n", name, lo);
        return -1;
    }
    *out = (int)v;
    return 0;
}

static int json_int_array(json_t *a, int32_t **out, int *n, const char *what, char *err, size_t errlen) {
    if (!json_is_array(a)) { snprintf(err, errlen, "%s must be an array of integers", what); return -1; }
    size_t k = json_array_size(a);
    int32_t *v = malloc(sizeof(int32_t) * (k ? k : 1));
    for (size_t i = 0; i < k; i++) {
        json_t *x = json_array_get(a, i);
        if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) > INT32_MAX) {
            snprintf(err, errlen, "%s[%zu] is not a token id", what, i);
            free(v);
            return -1;
        }
        v[i] = (int32_t)json_integer_value(x);
    }
    *out = v;
    *n = (int)k;
    return 0;
}

/* fill j->rq from the JSON line; returns -1 with err set on a bad field */
static int job_parse(job_t *j, const tokenizer_t *tok, char *err, size_t errlen) {
    json_t *o = j->in;
    engine_request_t *rq = &j->rq;
    memset(rq, 0, sizeof *rq);
    sampling_params_default(&rq->sampling);
    rq->max_tokens = 16;
    json_t *v;
    if ((v = json_object_get(o, "prompt_ids"))) {
        if (json_int_array(v, &j->prompt, &rq->n_prompt, "prompt_ids", err, errlen)) return -1;
    } else if ((v = json_object_get(o, "prompt"))) {
        if (!json_is_string(v)) { snprintf(err, errlen, "prompt must be a string"); return -1; }
        if (!tok) { snprintf(err, errlen, "the model has no tokenizer.json: give prompt_ids"); return -1; }
        size_t n;
        if (tokenizer_encode(tok, json_string_value(v), json_string_length(v), true, &j->prompt, &n)) {
            snprintf(err, errlen, "tokenize: %s", cs_error_last());
            return -1;
        }
        rq->n_prompt = (int)n;
    } else {
        snprintf(err, errlen, "a request needs prompt_ids or prompt");
        return -1;
    }
    rq->prompt = j->prompt;
    if ((v = json_object_get(o, "adapter")) && !json_is_null(v)) {
        if (!json_is_string(v)) { snprintf(err, errlen, "adapter must be a string"); return -1; }
        rq->adapter = json_string_value(v);
    }
#define INT_FIELD(name, dst)                                                                   \
    if ((v = json_object_get(o, name)) && !json_is_null(v)) {                                 \
        if (!json_is_integer(v)) { snprintf(err, errlen, name " must be an integer"); return -1; } \
        dst = (int)json_integer_value(v);                                                      \
    }
#define NUM_FIELD(name, dst)                                                                   \
    if ((v = json_object_get(o, name)) && !json_is_null(v)) {                                 \
        if (!json_is_number(v)) { snprintf(err, errlen, name " must be a number"); return -1; } \
        dst = (float)json_number_value(v);                                                     \
    }
    INT_FIELD("max_tokens", rq->max_tokens);
    INT_FIELD("min_tokens", rq->min_tokens);
    INT_FIELD("n", rq->n);
    INT_FIELD("top_k", rq->sampling.top_k);
    INT_FIELD("logprobs", rq->sampling.logprobs);
    INT_FIELD("abort_after", j->abort_after);
    NUM_FIELD("temperature", rq->sampling.temperature);
    NUM_FIELD("top_p", rq->sampling.top_p);
    NUM_FIELD("min_p", rq->sampling.min_p);
    NUM_FIELD("repetition_penalty", rq->sampling.repetition_penalty);
    NUM_FIELD("presence_penalty", rq->sampling.presence_penalty);
    NUM_FIELD("frequency_penalty", rq->sampling.frequency_penalty);
#undef INT_FIELD
#undef NUM_FIELD
    if ((v = json_object_get(o, "seed")) && !json_is_null(v)) {
        if (!json_is_integer(v)) { snprintf(err, errlen, "seed must be an integer"); return -1; }
        rq->sampling.seed = (uint64_t)json_integer_value(v);
        rq->sampling.has_seed = true;
    }
    if ((v = json_object_get(o, "logprobs_mode")) && !json_is_null(v)) {
        const char *m = json_string_value(v);
        if (m && !strcmp(m, "raw")) rq->sampling.logprobs_mode = SAMPLING_LOGPROBS_RAW;
        else if (m && !strcmp(m, "processed")) rq->sampling.logprobs_mode = SAMPLING_LOGPROBS_PROCESSED;
        else { snprintf(err, errlen, "logprobs_mode must be \"raw\" or \"processed\""); return -1; }
    }
    if ((v = json_object_get(o, "ignore_eos"))) rq->ignore_eos = json_is_true(v);
    if (sched_parse_slo(json_object_get(o, "slo"), &rq->slo_ttft_ms, &rq->slo_tpot_ms, err, errlen)) return -1;
    if ((v = json_object_get(o, "stop")) && !json_is_null(v)) {
        if (json_is_string(v)) {
            j->stops = calloc(1, sizeof(char *));
            j->stops[0] = strdup(json_string_value(v));
            rq->n_stop = 1;
        } else if (json_is_array(v)) {
            size_t k = json_array_size(v);
            j->stops = calloc(k ? k : 1, sizeof(char *));
            for (size_t i = 0; i < k; i++) {
                const char *s = json_string_value(json_array_get(v, i));
                if (!s) { snprintf(err, errlen, "stop[%zu] must be a string", i); return -1; }
                j->stops[i] = strdup(s);
                rq->n_stop = (int)i + 1;
            }
        } else {
            snprintf(err, errlen, "stop must be a string or an array of strings");
            return -1;
        }
        rq->stop = (const char *const *)j->stops;
    }
    if ((v = json_object_get(o, "stop_token_ids")) && !json_is_null(v)) {
        if (json_int_array(v, &j->stop_ids, &rq->n_stop_token_ids, "stop_token_ids", err, errlen)) return -1;
        rq->stop_token_ids = j->stop_ids;
    }
    j->n = rq->n > 0 ? rq->n : 1;
    return 0;
}

static json_t *job_result(job_t *j) {
    json_t *o = json_object();
    json_t *id = json_object_get(j->in, "id");
    if (id) json_object_set(o, "id", id);
    if (j->submit_error) {
        json_object_set_new(o, "error", json_string(j->submit_error));
        return o;
    }
    if (j->control) {
        json_object_set(o, "add_adapter", json_object_get(json_object_get(j->in, "add_adapter"), "name"));
        json_object_set_new(o, "version", json_integer(j->control_version));
        return o;
    }
    json_object_set_new(o, "prompt_tokens", json_integer(j->prompt_tokens));
    json_object_set_new(o, "cached_tokens", json_integer(j->cached_tokens));
    json_object_set_new(o, "adapter_version", json_integer(j->adapter_version));
    json_t *arr = json_array();
    for (int i = 0; i < j->n; i++) {
        sample_res_t *s = &j->samples[i];
        json_t *so = json_object();
        json_object_set_new(so, "index", json_integer(i));
        json_object_set(so, "tokens", s->tokens);
        if (j->rq.sampling.logprobs >= 0) {
            json_object_set(so, "logprobs", s->logprobs);
            json_object_set(so, "top_logprobs", s->top);
        }
        json_object_set_new(so, "text", json_stringn(s->text ? s->text : "", s->text_len));
        json_object_set_new(so, "finish_reason", s->finish ? json_string(s->finish) : json_null());
        if (s->error) json_object_set_new(so, "error", json_string(s->error));
        json_array_append_new(arr, so);
    }
    json_object_set_new(o, "samples", arr);
    if (g_timings) {
        json_object_set_new(o, "ttft_ms", j->t_first > 0 ? json_real(j->t_first - j->t_submit) : json_null());
        json_object_set_new(o, "e2e_ms", j->t_done > 0 ? json_real(j->t_done - j->t_submit) : json_null());
    }
    return o;
}

static void job_free(job_t *j) {
    json_decref(j->in);
    free(j->prompt);
    if (j->stops)
        for (int i = 0; i < j->rq.n_stop; i++) free(j->stops[i]);
    free(j->stops);
    free(j->stop_ids);
    for (int i = 0; j->samples && i < j->n; i++) {
        json_decref(j->samples[i].tokens);
        json_decref(j->samples[i].logprobs);
        json_decref(j->samples[i].top);
        free(j->samples[i].text);
        free(j->samples[i].error);
    }
    free(j->samples);
    free(j->submit_error);
}

static void submit_job(engine_t *e, job_t *j) {
    j->engine = e;
    j->samples = calloc((size_t)j->n, sizeof *j->samples);
    for (int i = 0; i < j->n; i++) {
        j->samples[i].tokens = json_array();
        j->samples[i].logprobs = json_array();
        j->samples[i].top = json_array();
    }
    j->rq.sink = sink;
    j->rq.user = j;
    j->t_submit = cs_time_ms();
    if (engine_submit(e, &j->rq, &j->id)) j->submit_error = strdup(cs_error_last());
    else j->submitted = true;
}

/* the registry's on_loaded (loader and copy threads): the engine pointer is set and cleared
 * under this lock, so a load finishing around engine_new or engine_free never sees a
 * half-made or freed engine */
static pthread_mutex_t wake_mu = PTHREAD_MUTEX_INITIALIZER;

static void wake_engine(void *user) {
    engine_t **ep = user;
    pthread_mutex_lock(&wake_mu);
    if (*ep) engine_wake(*ep);
    pthread_mutex_unlock(&wake_mu);
}

static void set_engine(engine_t **ep, engine_t *e) {
    pthread_mutex_lock(&wake_mu);
    *ep = e;
    pthread_mutex_unlock(&wake_mu);
}

int cmd_batch(int argc, char **argv) {
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},
        {"lora", required_argument, 0, 'l'},
        {"requests", required_argument, 0, 'r'},
        {"threads", required_argument, 0, 'T'},
        {"kv-cache-bytes", required_argument, 0, 'k'},
        {"kv-cache-dtype", required_argument, 0, 'K'},
        {"kv-cache-fraction", required_argument, 0, 'f'},
        {"lora-dtype", required_argument, 0, 'D'},
        {"max-num-seqs", required_argument, 0, 's'},
        {"max-num-batched-tokens", required_argument, 0, 'b'},
        {"max-model-len", required_argument, 0, 'L'},
        {"max-cpu-loras", required_argument, 0, 'c'},
        {"max-loras", required_argument, 0, 'X'},
        {"scheduler", required_argument, 0, 'Y'},
        {"cost-model-out", required_argument, 0, 'Z'},
        {"lora-cache-bytes", required_argument, 0, 'C'},
        {"lora-io", required_argument, 0, 'J'},
        {"no-prefix-caching", no_argument, 0, 'P'},
        {"sequential", no_argument, 0, 'Q'},
        {"stats", no_argument, 0, 'S'},
        {"reference-kernels", no_argument, 0, 'R'},
        {"mmap", no_argument, 0, 'u'},
        {"no-mmap", no_argument, 0, 'U'},
        {"compress-weights", no_argument, 0, 0x101},
        {"compress-weights-only", no_argument, 0, 0x102},
        {"batch-invariant", no_argument, 0, 'I'},
        {"precision", required_argument, 0, 'q'},
        {"device", required_argument, 0, 'V'},
        {"gpu-memory-fraction", required_argument, 0, 'G'},
        {"cuda-graphs", no_argument, 0, 'g'},
        {"preload-adapters", no_argument, 0, 'W'},
        {"cold-start", required_argument, 0, 'O'},
        {"timings", no_argument, 0, 'M'},
        {"assist-threads", required_argument, 0, 'A'},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    const char *model_dir = NULL, *req_path = NULL, *device = NULL;
    const char **lora_specs = calloc((size_t)argc + 1, sizeof(char *));
    int n_loras = 0, threads = 0, max_seqs = 0, max_tokens_batch = 0, max_model_len = 0, max_cpu_loras = 0, max_loras = 0;
    const char *scheduler = NULL, *cost_out = NULL;
    long long kv_bytes = 1LL << 30, lora_bytes = 0;
    bool kv_explicit = false, cuda_graphs = false;
    double gpu_fraction = 0;
    bool no_prefix = false, buffered_io = false, sequential = false, stats = false, reference = false, invariant = false, ok;
    model_weights_mem weights_mem = MODEL_WEIGHTS_AUTO;
    bool bf16 = false, compress = false, compress_only = false;
    bool preload = false;
    int c, status = 1, cold_mode = SCHED_COLD_DEFAULT, assist_threads = 0, kv_choice = SETUP_KV_AUTO, lora_dtype = 0;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'm': model_dir = optarg; break;
        case 'l': lora_specs[n_loras++] = optarg; break;
        case 'r': req_path = optarg; break;
        case 'T': if (parse_int_opt("--threads", optarg, 1, &threads)) goto usage_err; break;
        case 's': if (parse_int_opt("--max-num-seqs", optarg, 1, &max_seqs)) goto usage_err; break;
        case 'b': if (parse_int_opt("--max-num-batched-tokens", optarg, 1, &max_tokens_batch)) goto usage_err; break;
        case 'L': if (parse_int_opt("--max-model-len", optarg, 2, &max_model_len)) goto usage_err; break;
        case 'c': if (parse_int_opt("--max-cpu-loras", optarg, 1, &max_cpu_loras)) goto usage_err; break;
        case 'X': if (parse_int_opt("--max-loras", optarg, 1, &max_loras)) goto usage_err; break;
        case 'Y': scheduler = optarg; break;
        case 'Z': cost_out = optarg; break;
        case 'k':
            kv_bytes = cs_parse_size(optarg, &ok);
            if (!ok || kv_bytes <= 0) { fprintf(stderr, "caraserve batch: --kv-cache-bytes: bad size '%s'\n", optarg); goto usage_err; }
            kv_explicit = true;
            break;
        case 'K':
            if ((kv_choice = setup_parse_kv_dtype(optarg)) == -2) {
                fprintf(stderr, "caraserve batch: --kv-cache-dtype wants auto, f32 or bf16, got '%s'\n", optarg);
                goto usage_err;
            }
            break;
        case 'D':
            if ((lora_dtype = setup_parse_lora_dtype(optarg)) < 0) {
                fprintf(stderr, "caraserve batch: --lora-dtype wants auto or bf16, got '%s'\n", optarg);
                goto usage_err;
            }
            break;
        case 'f': {
            char *end;
            double fr = strtod(optarg, &end);
            if (*end || !(fr > 0 && fr <= 0.9)) { fprintf(stderr, "caraserve batch: --kv-cache-fraction must be in (0, 0.9]\n"); goto usage_err; }
            size_t avail = cs_mem_available();
            if (!avail) { fprintf(stderr, "caraserve batch: cannot read MemAvailable from /proc/meminfo; use --kv-cache-bytes\n"); goto usage_err; }
            kv_bytes = (long long)(fr * (double)avail);
            kv_explicit = true;
            break;
        }
        case 'G':
            if (!setup_parse_gpu_fraction(optarg, &gpu_fraction)) {
                fprintf(stderr, "caraserve batch: --gpu-memory-fraction wants 0 < F <= 1, got '%s'\n", optarg);
                goto usage_err;
            }
            break;
        case 'C':
            lora_bytes = cs_parse_size(optarg, &ok);
            if (!ok || lora_bytes <= 0) { fprintf(stderr, "caraserve batch: --lora-cache-bytes: bad size '%s'\n", optarg); goto usage_err; }
            break;
        case 'J':
            if (strcmp(optarg, "direct") && strcmp(optarg, "buffered")) {
                fprintf(stderr, "caraserve batch: --lora-io wants direct or buffered, got '%s'\n", optarg);
                goto usage_err;
            }
            buffered_io = !strcmp(optarg, "buffered");
            break;
        case 'P': no_prefix = true; break;
        case 'Q': sequential = true; break;
        case 'S': stats = true; break;
        case 'R': reference = true; break;
        case 'u': weights_mem = MODEL_WEIGHTS_MMAP; break;
        case 'U': weights_mem = MODEL_WEIGHTS_COPY; break;
        case 0x101: compress = true; break;
        case 0x102: compress_only = true; break;
        case 'I': invariant = true; break;
        case 'q': {
            int prec = setup_parse_precision(optarg);
            if (prec < 0) { fprintf(stderr, "caraserve batch: --precision wants exact or bf16, got '%s'\n", optarg); goto usage_err; }
            bf16 = prec == 1;
            break;
        }
        case 'V': device = optarg; break;
        case 'g': cuda_graphs = true; break;
        case 'W': preload = true; break;
        case 'M': g_timings = true; break;
        case 'O':
            if ((cold_mode = setup_parse_cold_start(optarg)) < 0) {
                fprintf(stderr, "caraserve batch: --cold-start wants auto, cpu-assist or wait, got '%s'\n", optarg);
                goto usage_err;
            }
            break;
        case 'A': if (parse_int_opt("--assist-threads", optarg, 1, &assist_threads)) goto usage_err; break;
        case 'h': usage_batch(stdout); free(lora_specs); return 0;
        default: goto usage_err;
        }
    }
    if (optind < argc) { fprintf(stderr, "caraserve batch: unexpected argument '%s'\n", argv[optind]); goto usage_err; }
    if (!model_dir) { fprintf(stderr, "caraserve batch: --model DIR is required\n"); goto usage_err; }
    for (int i = 0; i < n_loras; i++)
        if (!strchr(lora_specs[i], '=') || lora_specs[i][0] == '=') {
            fprintf(stderr, "caraserve batch: --lora wants NAME=DIR, got '%s'\n", lora_specs[i]);
            goto usage_err;
        }

    backend_t *be = NULL;
    sched_t *sched = NULL;
    cost_model_t *cost = NULL;
    model_t *model = NULL;
    tokenizer_t *tok = NULL;
    lora_registry_t *reg = NULL;
    lora_assist_t *assist = NULL;
    engine_t *engine = NULL;
    job_t *jobs = NULL;
    int n_jobs = 0, cap_jobs = 0;
    FILE *in = stdin;

    if (req_path && strcmp(req_path, "-") && !(in = fopen(req_path, "r"))) {
        fprintf(stderr, "caraserve batch: %s: %s\n", req_path, strerror(errno));
        goto out;
    }
    be = setup_backend(&(setup_backend_opts_t){.device = device, .threads = threads, .reference = reference,
                                               .batch_invariant = invariant, .precision_bf16 = bf16,
                                               .compress_weights = compress, .compress_weights_only = compress_only,
                                               .gpu_memory_fraction = gpu_fraction,
                                               .cuda_graphs = cuda_graphs});
    if (!be) { fprintf(stderr, "caraserve: %s\n", cs_error_last()); goto out; }
    if (model_load_how(model_dir, be, weights_mem, &model)) {
        fprintf(stderr, "caraserve: %s: %s\n", model_dir, cs_error_last());
        goto out;
    }
    char *tj = cs_path_join(model_dir, "tokenizer.json");
    bool have_tok = tj && cs_file_exists(tj);
    free(tj);
    if (have_tok && tokenizer_load(model_dir, &tok)) { fprintf(stderr, "caraserve: %s: %s\n", model_dir, cs_error_last()); goto out; }
    const model_config_t *cfg = model_get_config(model);
    bool assist_failed;
    assist = setup_assist(be, cold_mode, assist_threads, &assist_failed);
    if (assist_failed) { fprintf(stderr, "caraserve: %s\n", cs_error_last()); goto out; }
    model_set_assist(model, assist);
    lora_registry_params_t lp = {.cfg = cfg, .buffered_io = buffered_io, .hold_bf16 = lora_dtype == 1,
                                 .cache_bytes = (size_t)lora_bytes, .max_loras = max_cpu_loras,
                                 .device = be, .device_slots = max_loras, .on_loaded = wake_engine, .user = &engine,
                                 .stream_group = 1, .stream_host = true};
    if (lora_registry_new(&lp, &reg)) { fprintf(stderr, "caraserve: %s\n", cs_error_last()); goto out; }
    for (int i = 0; i < n_loras; i++) {
        char *name = strdup(lora_specs[i]);
        char *eq = strchr(name, '=');
        *eq = 0;
        int ver;
        int rc = lora_registry_add(reg, name, eq + 1, &ver);
        if (rc) fprintf(stderr, "caraserve: adapter %s: %s\n", name, cs_error_last());
        /* --preload-adapters: resident before the first request, so which requests share an
         * iteration does not depend on how fast the loads were (a reproducible batch) */
        for (lora_ref_t *ref = NULL; !rc && preload;) {
            rc = lora_registry_acquire(reg, name, &ref);
            if (rc == CS_OK && !lora_adapter_complete(ref->adapter)) {
                lora_registry_release(reg, ref); /* still streaming in from disk (or failed: said next) */
                ref = NULL;
                rc = CS_EAGAIN;
            }
            if (rc == CS_EAGAIN) { rc = 0; usleep(1000); continue; }
            if (rc) fprintf(stderr, "caraserve: adapter %s: %s\n", name, cs_error_last());
            else lora_registry_release(reg, ref);
            break;
        }
        free(name);
        if (rc) goto out;
    }
    const int32_t *eos = cfg->n_eos ? cfg->eos_token_ids : NULL;
    if (!(cost = cost_model_new(1)) || !(sched = setup_scheduler(scheduler, cost, 0))) { fprintf(stderr, "caraserve: %s\n", cs_error_last()); goto out; }
    engine_params_t ep = {.model = model, .tokenizer = tok, .loras = reg,
                          .kv_cache_bytes = setup_kv_bytes(be, (size_t)kv_bytes, kv_explicit), .sched = sched,
                          .max_num_seqs = max_seqs, .max_num_batched_tokens = max_tokens_batch,
                          .max_model_len = max_model_len, .no_prefix_caching = no_prefix, .cold_start = cold_mode,
                          .kv_cache_dtype = setup_kv_dtype(be, kv_choice, bf16, model_weight_dtype(model))};
    if (!tok && eos) { ep.eos_ids = eos; ep.n_eos = cfg->n_eos; }
    {
        engine_t *made = NULL;
        if (engine_new(&ep, &made)) { fprintf(stderr, "caraserve: %s\n", cs_error_last()); goto out; }
        set_engine(&engine, made);
    }

    /* read every request first */
    char *line = NULL;
    size_t lcap = 0;
    ssize_t len;
    int lineno = 0;
    while ((len = getline(&line, &lcap, in)) > 0) {
        lineno++;
        bool blank = true;
        for (ssize_t i = 0; i < len && blank; i++) blank = line[i] == ' ' || line[i] == '\n' || line[i] == '\t' || line[i] == '\r';
        if (blank) continue;
        if (n_jobs == cap_jobs) {
            cap_jobs = cap_jobs ? cap_jobs * 2 : 64;
            jobs = realloc(jobs, sizeof *jobs * (size_t)cap_jobs);
        }
        job_t *j = &jobs[n_jobs++];
        memset(j, 0, sizeof *j);
        json_error_t jerr;
        j->in = json_loadb(line, (size_t)len, 0, &jerr);
        char err[512];
        if (!j->in || !json_is_object(j->in)) {
            snprintf(err, sizeof err, "line %d: not a JSON object (%s)", lineno, j->in ? "wrong type" : jerr.text);
            json_decref(j->in);
            j->in = json_object();
            j->submit_error = strdup(err);
            continue;
        }
        json_t *add = json_object_get(j->in, "add_adapter");
        if (add) {
            j->control = true;
            if (!json_is_string(json_object_get(add, "name")) || !json_is_string(json_object_get(add, "dir")))
                j->submit_error = strdup("add_adapter needs {\"name\": ..., \"dir\": ...}");
            continue;
        }
        if (job_parse(j, tok, err, sizeof err)) {
            char full[600];
            snprintf(full, sizeof full, "line %d: %s", lineno, err);
            j->submit_error = strdup(full);
        }
    }
    free(line);

    double t0 = cs_time_ms();
    for (int i = 0; i < n_jobs; i++) {
        if (jobs[i].submit_error) continue;
        if (jobs[i].control) {
            json_t *add = json_object_get(jobs[i].in, "add_adapter");
            if (lora_registry_add(reg, json_string_value(json_object_get(add, "name")),
                                  json_string_value(json_object_get(add, "dir")), &jobs[i].control_version))
                jobs[i].submit_error = strdup(cs_error_last());
            continue;
        }
        submit_job(engine, &jobs[i]);
        if (sequential) engine_run_until_idle(engine);
    }
    if (!sequential) engine_run_until_idle(engine);
    double wall = cs_time_ms() - t0;

    for (int i = 0; i < n_jobs; i++) {
        json_t *r = job_result(&jobs[i]);
        char *s = json_dumps(r, JSON_COMPACT);
        printf("%s\n", s);
        free(s);
        json_decref(r);
    }
    int cfit = cost_model_fit(cost); /* the whole run's steps */
    if (cost_out) {
        if (cfit) fprintf(stderr, "caraserve batch: --cost-model-out: %s\n", cs_error_last());
        else if (cost_model_save(cost, cost_out)) fprintf(stderr, "caraserve batch: %s\n", cs_error_last());
    }
    if (stats) {
        char cm[640] = "null";
        cost_fit_t cf;
        cost_model_get(cost, &cf);
        if (cf.fitted) {
            int o = snprintf(cm, sizeof cm, "{\"r2\": %.6f, \"heldout_mape\": %.6f, \"n_fit\": %ld, \"n_heldout\": %ld, "
                             "\"terms_ms\": {", cf.r2, isfinite(cf.heldout_mape) ? cf.heldout_mape : -1.0, cf.n_fit,
                             cf.n_heldout);
            for (int i = 0; i < COST_N_TERMS && o < (int)sizeof cm; i++)
                o += snprintf(cm + o, sizeof cm - (size_t)o, "%s\"%s\": %.6g", i ? ", " : "", cost_term_names[i], cf.coef[i]);
            if (o < (int)sizeof cm) snprintf(cm + o, sizeof cm - (size_t)o, "}}");
        }
        engine_stats_t st;
        engine_get_stats(engine, &st);
        lora_registry_stats_t ls;
        lora_registry_stats(reg, &ls);
        backend_stats_t bs;
        backend_get_stats(be, &bs);
        size_t huge = 0, copied = model_weights_copied(model, &huge);
        fprintf(stderr,
                "{\"wall_ms\": %.3f, \"steps\": %llu, \"prefill_tokens\": %llu, \"decode_tokens\": %llu, "
                "\"busy_ms\": %.3f, \"decode_only_ms\": %.3f, \"decode_only_tokens\": %llu, \"preemptions\": %llu, "
                "\"prompt_tokens\": %llu, \"cached_prompt_tokens\": %llu, \"kv_blocks\": %d, \"kv_free\": %d, "
                "\"kv_cached\": %d, \"kv_dtype\": \"%s\", \"prefix_lookups\": %llu, \"prefix_hits\": %llu, \"lora_loads\": %llu, \"lora_loads_direct\": %llu, "
                "\"lora_evictions\": %llu, \"lora_load_failures\": %llu, \"lora_device_uploads\": %llu, "
                "\"lora_device_evictions\": %llu, \"lora_device_waits\": %llu, \"threads\": %d, "
                "\"weights\": {\"memory\": \"%s\", \"copied_bytes\": %zu, \"huge_page_bytes\": %zu, "
                "\"coded_bytes\": %zu, \"coded_from_bytes\": %zu, \"coded_exceptions\": %llu, \"released_bytes\": %zu}, \"backend\": {\"name\": \"%s\", "
                "\"kernels\": \"%s\", \"h2d_bytes\": %llu, \"d2h_bytes\": %llu, \"d2d_bytes\": %llu, \"h2d_copies\": %llu, "
                "\"d2h_copies\": %llu, \"d2d_copies\": %llu, \"batch_uploads\": %llu, \"allocated\": %zu, "
                "\"graph_captures\": %llu, \"graph_replays\": %llu}, "
                "\"cold_start\": {\"requests\": %llu, \"assisted\": %llu, \"waited\": %llu, \"forwards\": %llu, "
                "\"host_layers\": %llu, \"device_layers\": %llu, \"host_rows\": %llu, \"streams\": %llu, "
                "\"stream_ms\": %.3f, \"assist_threads\": %d, \"host_streams\": %llu, \"partial_acquires\": %llu, \"disk_waits\": %llu}, "
                "\"scheduler\": \"%s\", \"cost_model\": %s, \"rss_bytes\": %zu, \"peak_rss_bytes\": %zu}\n",
                wall, (unsigned long long)st.steps, (unsigned long long)st.prefill_tokens,
                (unsigned long long)st.decode_tokens, st.busy_ms, st.decode_only_ms,
                (unsigned long long)st.decode_only_tokens, (unsigned long long)st.preemptions,
                (unsigned long long)st.prompt_tokens, (unsigned long long)st.cached_prompt_tokens, st.kv.n_blocks,
                st.kv.n_free, st.kv.n_cached, cs_dtype_name(st.kv.dtype), (unsigned long long)st.kv.lookups, (unsigned long long)st.kv.hits,
                (unsigned long long)ls.loads, (unsigned long long)ls.loads_direct, (unsigned long long)ls.evictions, (unsigned long long)ls.load_failures,
                (unsigned long long)ls.device_uploads, (unsigned long long)ls.device_evictions,
                (unsigned long long)ls.device_waits, backend_n_threads(be), copied ? "copy" : "mmap", copied, huge, bs.prepared_bytes, bs.prepared_from,
                (unsigned long long)bs.prepared_exceptions, model_weights_released(model), backend_name(be), cpu_backend_path(be), (unsigned long long)bs.h2d_bytes,
                (unsigned long long)bs.d2h_bytes, (unsigned long long)bs.d2d_bytes, (unsigned long long)bs.h2d_copies,
                (unsigned long long)bs.d2h_copies, (unsigned long long)bs.d2d_copies, (unsigned long long)bs.batch_uploads,
                bs.allocated, (unsigned long long)bs.graph_captures, (unsigned long long)bs.graph_replays,
                (unsigned long long)st.cold_starts, (unsigned long long)st.cold_assisted,
                (unsigned long long)st.cold_waited, (unsigned long long)st.cold_forwards,
                (unsigned long long)st.cold_host_layers, (unsigned long long)st.cold_device_layers,
                (unsigned long long)st.cold_host_rows, (unsigned long long)ls.device_streams, ls.device_stream_ms,
                assist ? lora_assist_threads(assist) : 0, (unsigned long long)ls.host_streams,
                (unsigned long long)ls.partial_acquires, (unsigned long long)st.cold_disk_waits, sched_name(sched), cm,
                proc_status_bytes("VmRSS:"), proc_status_bytes("VmHWM:"));
    }
    status = 0;
    for (int i = 0; i < n_jobs; i++)
        if (jobs[i].submitted && !jobs[i].done) {
            fprintf(stderr, "caraserve batch: request %d did not finish\n", i);
            status = 1;
        }
out:
    {
        engine_t *dying = engine;
        set_engine(&engine, NULL);
        engine_free(dying);
    }
    sched_free(sched);
    cost_model_free(cost);
    for (int i = 0; i < n_jobs; i++) job_free(&jobs[i]);
    free(jobs);
    lora_registry_free(reg);
    lora_assist_free(assist);
    tokenizer_free(tok);
    model_free(model);
    backend_free(be);
    if (in && in != stdin) fclose(in);
    free(lora_specs);
    return status;
usage_err:
    usage_batch(stderr);
    free(lora_specs);
    return 2;
}
