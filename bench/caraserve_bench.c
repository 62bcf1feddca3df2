/* caraserve_bench.c: caraserve-bench, the SLO load tester. It draws the whole schedule from one
 * seeded generator first (bench_workload), then replays it against /v1/completions (streamed
 * SSE) or /v1/rollout (NDJSON groups) of caraserve or any OpenAI-compatible server on libcurl's
 * multi interface: one thread, one event loop, CLOCK_MONOTONIC stamps for every request
 * (scheduled, sent, each chunk, done). bench_metrics turns the stamps into vLLM's metrics, our
 * SLO attainment and breakdowns, and the table, JSON, CSV and SVG. */
#include "config.h"

#include <curl/curl.h>
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "bench/bench_metrics.h"
#include "bench/bench_workload.h"
#include "base/common.h"

static const char USAGE[] =
"usage: caraserve-bench [options]\n"
"\n"
"Streams a seeded, pre-drawn schedule of requests to /v1/completions (or /v1/rollout) of\n"
"caraserve or any OpenAI-compatible server and reports vLLM `bench serve`'s metrics plus SLO\n"
"attainment, per-adapter and per-rank breakdowns and a per-second time series.\n"
"\n"
"Target:\n"
"  --base-url URL            server root (default http://127.0.0.1:8000; or --host/--port)\n"
"  --host HOST, --port PORT  the same in two parts (default 127.0.0.1, 8000)\n"
"  --endpoint PATH           /v1/completions (default, streamed SSE) or /v1/rollout (NDJSON groups)\n"
"  --api-key KEY             sends Authorization: Bearer KEY (default $OPENAI_API_KEY)\n"
"  --header K=V ...          extra HTTP headers (repeatable)\n"
"  --model NAME              the base model's name (default: the first of GET /v1/models)\n"
"  --request-timeout S       give up on a request after S seconds (default 0: never)\n"
"  --insecure                do not verify TLS certificates\n"
"\n"
"Arrivals (drawn before the run):\n"
"  --seed N                  the one seed of everything random (default 0)\n"
"  --num-prompts N           requests in the run (default 1000; with a trace: all of its rows)\n"
"  --duration S              or: every arrival in the first S seconds\n"
"  --request-rate R|inf      mean requests/s (default inf: all at t = 0)\n"
"  --arrival KIND            poisson | gamma | constant | trace (default poisson, gamma when\n"
"                            --burstiness != 1 or --cv is given, trace with --arrivals-file)\n"
"  --burstiness G            gamma shape of the gaps (1 = Poisson; < 1 burstier), as vLLM\n"
"  --cv C                    or: coefficient of variation of the gaps (shape 1/C^2), as S-LoRA\n"
"  --ramp-up-strategy linear|exponential  with --ramp-up-start-rps R0 --ramp-up-end-rps R1:\n"
"                            the rate goes from R0 to R1 over the run (instead of --request-rate)\n"
"  --ramp-up-start-rps R0, --ramp-up-end-rps R1\n"
"  --arrivals-file F         arrival times in seconds, one per line (e.g. tests/data/bench/\n"
"                            maf-arrivals-128.csv): --arrival trace\n"
"  --time-scale X            multiply trace arrival times by X (default 1)\n"
"  --max-concurrency K       at most K requests in flight; later arrivals wait (client queue)\n"
"  --num-warmups W           send W copies of the first request before the run (not measured)\n"
"\n"
"Adapters:\n"
"  --lora-modules NAME[:RANK[:WEIGHT]] ...  adapters to send requests to (repeatable)\n"
"  --num-adapters N          or: N adapters named PREFIX0 .. PREFIX<N-1>\n"
"  --adapter-prefix P        their prefix (default lora-)\n"
"  --rank-mix R:F,...        ranks of adapters given none, by share (e.g. 8:.25,16:.25,32:.25,64:.25)\n"
"  --popularity P            uniform | zipf[:THETA] | power:ALPHA | round-robin | trace (default\n"
"                            uniform; trace with --popularity-file or :WEIGHTs)\n"
"  --popularity-file F       adapter,probability rows (e.g. tests/data/bench/maf-popularity-128.csv);\n"
"                            without adapters, it names them: PREFIX + its adapter column\n"
"  --base-fraction F         share of requests to the base model (default 0; all of them without adapters)\n"
"\n"
"Lengths and prompts:\n"
"  --dataset-name D          random (default) | azure-llm (--dataset-path: the Azure LLM inference\n"
"                            trace, TIMESTAMP,ContextTokens,GeneratedTokens) | trace (--dataset-path:\n"
"                            a schedule written by --dump-schedule, replayed exactly)\n"
"  --dataset-path F          the file of azure-llm or trace\n"
"  --random-input-len N      prompt tokens (default 1024)\n"
"  --random-output-len N     output tokens (default 128)\n"
"  --random-range-ratio R    lengths uniform in [L(1-R), L(1+R)] (default 0)\n"
"  --prompt-format ids|text  token-id prompts of exact length (default) or random words\n"
"  --vocab-size V            token ids are drawn from [--token-id-min, V) (default 32000)\n"
"  --token-id-min M          (default 100: clear of special tokens)\n"
"  --ignore-eos              send ignore_eos: outputs have the drawn length (the default)\n"
"  --no-ignore-eos           let the model stop early\n"
"  --temperature T           (default 0), --top-p P, --top-k K: sampling fields sent\n"
"  --extra-body JSON         merged into every request body\n"
"  --rollout-n N             /v1/rollout: samples per group (default 4)\n"
"  --rollout-groups G        /v1/rollout: groups per request (default 1)\n"
"  --dump-schedule F         write the drawn schedule as CSV (replay: --dataset-name trace --dataset-path F)\n"
"  --dry-run                 draw (and dump) the schedule, send nothing\n"
"\n"
"Metrics and output:\n"
"  --goodput KEY:MS ...      SLO bounds, KEY ttft | tpot | e2el (e.g. --goodput ttft:500 tpot:50);\n"
"                            /v1/rollout measures no TPOT: a tpot bound there is not applicable\n"
"  --percentile-metrics L    metrics printed with percentiles (default ttft,tpot,itl,e2el; also sched_ttft)\n"
"  --metric-percentiles L    percentiles (default 99; e.g. 50,90,99)\n"
"  --per-adapter             print the per-adapter breakdown\n"
"  --per-rank                print the per-rank breakdown\n"
"  --save-result             write the JSON result (vLLM's keys plus ours)\n"
"  --save-detailed           add the per-request arrays to it\n"
"  --result-dir D            where (default .)\n"
"  --result-filename F       its name (default LABEL-RATEqps[-concurrencyK]-MODEL-DATE.json)\n"
"  --label L                 prefix of the default file name (default openai or rollout)\n"
"  --metadata K=V ...        extra keys for the JSON\n"
"  --requests-csv F          one CSV row per request (timestamps, latencies, errors)\n"
"  --plot F.svg              latency CDFs per rank, SLO attainment, throughput and concurrency over time\n"
"  --timeseries-bucket S     time series bucket in seconds (default 1)\n"
"  --no-progress             no live progress line (it is shown only when stderr is a terminal)\n"
"  -h, --help                this text;  --version: the version\n"
"\n"
"Exit status: 0 when at least one request completed, 1 when none did or an I/O error, 2 on a usage error.\n";

/* ---- options ---- */
typedef struct opts {
    const char *base_url, *host, *endpoint, *api_key, *model;
    int port;
    const char *headers[64];
    int n_headers;
    double request_timeout;
    bool insecure;
    bw_config_t wl;
    bool num_prompts_given, burstiness_given, cv_given, arrival_given, rate_given;
    double burstiness, cv;
    int max_concurrency, num_warmups;
    bw_adapter_t *adapters;
    int n_adapters;
    const char *popularity;
    bool text_prompts;
    int vocab_size, token_id_min;
    bool ignore_eos;
    double temperature, top_p;
    int top_k;
    bool top_p_given, top_k_given;
    json_t *extra_body;
    int rollout_n, rollout_groups;
    const char *dump_schedule;
    bool dry_run;
    bm_opts_t mo;
    const char *goodput[8];
    int n_goodput;
    int metrics_mask;
    bool per_adapter, per_rank;
    bool save_result, save_detailed;
    const char *result_dir, *result_filename, *label;
    const char *metadata[64];
    int n_metadata;
    const char *requests_csv, *plot;
    bool no_progress;
} opts_t;

static void usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void usage_error(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("caraserve-bench: ", stderr);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputs(" (see --help)\n", stderr);
    exit(2);
}

static double num_arg(const char *flag, const char *v, double lo, double hi) {
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (!*v || *end || errno || !(x >= lo && x <= hi)) usage_error("%s: '%s' is not a number in [%g, %g]", flag, v, lo, hi);
    return x;
}

static int int_arg(const char *flag, const char *v, long lo, long hi) {
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (!*v || *end || errno || x < lo || x > hi) usage_error("%s: '%s' is not an integer in [%ld, %ld]", flag, v, lo, hi);
    return (int)x;
}

static void opts_default(opts_t *o) {
    memset(o, 0, sizeof *o);
    bw_config_default(&o->wl);
    o->host = "127.0.0.1";
    o->port = 8000;
    o->endpoint = "/v1/completions";
    o->api_key = getenv("OPENAI_API_KEY");
    o->burstiness = 1;
    o->vocab_size = 32000;
    o->token_id_min = 100;
    o->ignore_eos = true;
    o->rollout_n = 4;
    o->rollout_groups = 1;
    o->mo.n_pct = 1;
    o->mo.pct[0] = 99;
    o->mo.slo = (bm_slo_t){-1, -1, -1};
    o->mo.bucket_s = 1;
    o->metrics_mask = BM_TTFT | BM_TPOT | BM_ITL | BM_E2EL;
    o->result_dir = ".";
}

/* the command line as a cursor: argv[i] is the flag at hand, split into its name and, for
 * --flag=value, its value */
typedef struct args {
    int argc, i;
    char **argv;
    char flag[64];
    const char *val; /* the part after '=', or NULL */
} args_t;

static void args_load(args_t *a) {
    const char *s = a->argv[a->i];
    const char *eq = strncmp(s, "--", 2) == 0 ? strchr(s, '=') : NULL;
    a->val = NULL;
    if (eq && (size_t)(eq - s) < sizeof a->flag) {
        memcpy(a->flag, s, (size_t)(eq - s));
        a->flag[eq - s] = 0;
        a->val = eq + 1;
    } else {
        snprintf(a->flag, sizeof a->flag, "%s", s);
    }
}

static bool arg_is(const args_t *a, const char *s) { return !strcmp(a->flag, s); }

/* the flag's value: after '=', or the next argument */
static const char *arg_val(args_t *a) {
    if (a->val) return a->val;
    if (a->i + 1 < a->argc) return a->argv[++a->i];
    usage_error("%s needs a value", a->flag);
}

/* the values of a many-valued flag one by one (the one after '=', or the arguments up to the
 * next --flag), NULL after the last; *k counts them, from 0 */
static const char *arg_each(args_t *a, int *k) {
    const char *v = NULL;
    if (a->val) v = *k == 0 ? a->val : NULL;
    else if (a->i + 1 < a->argc && strncmp(a->argv[a->i + 1], "--", 2)) v = a->argv[++a->i];
    if (!v && *k == 0) usage_error("%s needs at least one value", a->flag);
    (*k)++;
    return v;
}

static double num_flag(args_t *a, double lo, double hi) { return num_arg(a->flag, arg_val(a), lo, hi); }
static int int_flag(args_t *a, long lo, long hi) { return int_arg(a->flag, arg_val(a), lo, hi); }

/* the values of --header or --metadata: KEY=VALUE each, at most cap of them */
static void kv_flag(args_t *a, const char **list, int *n, int cap) {
    const char *v;
    for (int k = 0; (v = arg_each(a, &k));) {
        if (!strchr(v, '=')) usage_error("%s: '%s' is not KEY=VALUE", a->flag, v);
        if (*n == cap) usage_error("%s: too many", a->flag);
        list[(*n)++] = v;
    }
}

/* Each group's flags; false when the flag is none of them. */
static bool target_flag(args_t *a, opts_t *o) {
    if (arg_is(a, "--base-url")) o->base_url = arg_val(a);
    else if (arg_is(a, "--host")) o->host = arg_val(a);
    else if (arg_is(a, "--port")) o->port = int_flag(a, 1, 65535);
    else if (arg_is(a, "--endpoint")) o->endpoint = arg_val(a);
    else if (arg_is(a, "--api-key")) o->api_key = arg_val(a);
    else if (arg_is(a, "--header")) kv_flag(a, o->headers, &o->n_headers, (int)CS_ARRAY_LEN(o->headers));
    else if (arg_is(a, "--model")) o->model = arg_val(a);
    else if (arg_is(a, "--request-timeout")) o->request_timeout = num_flag(a, 0, 1e7);
    else if (arg_is(a, "--insecure")) o->insecure = true;
    else return false;
    return true;
}

static bool arrival_flag(args_t *a, opts_t *o) {
    bw_arrival_params_t *ar = &o->wl.arrival;
    if (arg_is(a, "--seed")) {
        const char *v = arg_val(a);
        char *end;
        errno = 0;
        o->wl.seed = strtoull(v, &end, 10);
        if (!*v || *end || errno || *v == '-') usage_error("--seed: '%s' is not a non-negative integer", v);
    } else if (arg_is(a, "--num-prompts")) { o->wl.num_prompts = int_flag(a, 1, 100000000); o->num_prompts_given = true; }
    else if (arg_is(a, "--duration")) o->wl.duration = num_flag(a, 1e-3, 1e7);
    else if (arg_is(a, "--request-rate")) {
        const char *v = arg_val(a);
        ar->rate = !strcmp(v, "inf") ? INFINITY : num_arg(a->flag, v, 1e-9, 1e9);
        o->rate_given = true;
    } else if (arg_is(a, "--arrival")) {
        const char *v = arg_val(a);
        o->arrival_given = true;
        if (!strcmp(v, "poisson")) ar->kind = BW_ARRIVAL_POISSON;
        else if (!strcmp(v, "gamma")) ar->kind = BW_ARRIVAL_GAMMA;
        else if (!strcmp(v, "constant")) ar->kind = BW_ARRIVAL_CONSTANT;
        else if (!strcmp(v, "trace")) ar->kind = BW_ARRIVAL_TRACE;
        else usage_error("--arrival: '%s' is not poisson, gamma, constant or trace", v);
    } else if (arg_is(a, "--burstiness")) { o->burstiness = num_flag(a, 1e-6, 1e6); o->burstiness_given = true; }
    else if (arg_is(a, "--cv")) { o->cv = num_flag(a, 1e-3, 1e3); o->cv_given = true; }
    else if (arg_is(a, "--ramp-up-strategy")) {
        const char *v = arg_val(a);
        if (!strcmp(v, "linear")) ar->ramp = BW_RAMP_LINEAR;
        else if (!strcmp(v, "exponential")) ar->ramp = BW_RAMP_EXPONENTIAL;
        else usage_error("--ramp-up-strategy: '%s' is not linear or exponential", v);
    } else if (arg_is(a, "--ramp-up-start-rps")) ar->ramp_start = num_flag(a, 1e-9, 1e9);
    else if (arg_is(a, "--ramp-up-end-rps")) ar->ramp_end = num_flag(a, 1e-9, 1e9);
    else if (arg_is(a, "--arrivals-file")) o->wl.arrivals_file = arg_val(a);
    else if (arg_is(a, "--time-scale")) o->wl.time_scale = num_flag(a, 1e-9, 1e9);
    else if (arg_is(a, "--max-concurrency")) o->max_concurrency = int_flag(a, 1, 1000000);
    else if (arg_is(a, "--num-warmups")) o->num_warmups = int_flag(a, 0, 1000000);
    else return false;
    return true;
}

static void add_lora_module(opts_t *o, const char *v) {
    bw_adapter_t ad;
    if (bw_adapter_parse(v, &ad)) usage_error("--lora-modules: %s", cs_error_last());
    bw_adapter_t *na = realloc(o->adapters, (size_t)(o->n_adapters + 1) * sizeof *na);
    if (!na) usage_error("out of memory");
    o->adapters = na;
    o->adapters[o->n_adapters++] = ad;
}

static bool dataset_flag(args_t *a, opts_t *o) {
    if (arg_is(a, "--lora-modules")) {
        const char *v;
        for (int k = 0; (v = arg_each(a, &k));) add_lora_module(o, v);
    } else if (arg_is(a, "--num-adapters")) o->wl.num_adapters = int_flag(a, 1, 1000000);
    else if (arg_is(a, "--adapter-prefix")) o->wl.adapter_prefix = arg_val(a);
    else if (arg_is(a, "--rank-mix")) { if (bw_rank_mix_parse(arg_val(a), &o->wl.rank_mix)) usage_error("--rank-mix: %s", cs_error_last()); }
    else if (arg_is(a, "--popularity")) { o->popularity = arg_val(a); if (bw_pop_parse(o->popularity, &o->wl.pop)) usage_error("--popularity: %s", cs_error_last()); }
    else if (arg_is(a, "--popularity-file")) o->wl.popularity_file = arg_val(a);
    else if (arg_is(a, "--base-fraction")) o->wl.base_fraction = num_flag(a, 0, 1);
    else if (arg_is(a, "--dataset-name")) {
        const char *v = arg_val(a);
        if (!strcmp(v, "random")) o->wl.dataset = BW_DATA_RANDOM;
        else if (!strcmp(v, "azure-llm")) o->wl.dataset = BW_DATA_AZURE;
        else if (!strcmp(v, "trace")) o->wl.dataset = BW_DATA_TRACE;
        else usage_error("--dataset-name: '%s' is not random, azure-llm or trace", v);
    } else if (arg_is(a, "--dataset-path")) o->wl.dataset_path = arg_val(a);
    else if (arg_is(a, "--random-input-len")) o->wl.input_len = int_flag(a, 1, 10000000);
    else if (arg_is(a, "--random-output-len")) o->wl.output_len = int_flag(a, 1, 10000000);
    else if (arg_is(a, "--random-range-ratio")) o->wl.range_ratio = num_flag(a, 0, 0.999999);
    else if (arg_is(a, "--prompt-format")) {
        const char *v = arg_val(a);
        if (!strcmp(v, "ids")) o->text_prompts = false;
        else if (!strcmp(v, "text")) o->text_prompts = true;
        else usage_error("--prompt-format: '%s' is not ids or text", v);
    } else if (arg_is(a, "--vocab-size")) o->vocab_size = int_flag(a, 2, 100000000);
    else if (arg_is(a, "--token-id-min")) o->token_id_min = int_flag(a, 0, 100000000);
    else return false;
    return true;
}

static bool sampling_flag(args_t *a, opts_t *o) {
    if (arg_is(a, "--ignore-eos")) o->ignore_eos = true;
    else if (arg_is(a, "--no-ignore-eos")) o->ignore_eos = false;
    else if (arg_is(a, "--temperature")) o->temperature = num_flag(a, 0, 100);
    else if (arg_is(a, "--top-p")) { o->top_p = num_flag(a, 0, 1); o->top_p_given = true; }
    else if (arg_is(a, "--top-k")) { o->top_k = int_flag(a, -1, 1000000); o->top_k_given = true; }
    else if (arg_is(a, "--extra-body")) {
        json_error_t je;
        json_decref(o->extra_body);
        o->extra_body = json_loads(arg_val(a), 0, &je);
        if (!json_is_object(o->extra_body)) usage_error("--extra-body: not a JSON object (%s)", je.text);
    } else if (arg_is(a, "--rollout-n")) o->rollout_n = int_flag(a, 1, 100000);
    else if (arg_is(a, "--rollout-groups")) o->rollout_groups = int_flag(a, 1, 100000);
    else return false;
    return true;
}

static void percentiles_flag(args_t *a, opts_t *o) {
    char *dup = strdup(arg_val(a)), *save = NULL;
    o->mo.n_pct = 0;
    for (char *t = strtok_r(dup, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (o->mo.n_pct == BM_MAX_PCT) usage_error("--metric-percentiles: at most %d", BM_MAX_PCT);
        o->mo.pct[o->mo.n_pct++] = num_arg(a->flag, t, 0, 100);
    }
    free(dup);
    if (o->mo.n_pct == 0) usage_error("--metric-percentiles: empty");
}

static bool output_flag(args_t *a, opts_t *o) {
    if (arg_is(a, "--dump-schedule")) o->dump_schedule = arg_val(a);
    else if (arg_is(a, "--dry-run")) o->dry_run = true;
    else if (arg_is(a, "--goodput")) {
        const char *v;
        for (int k = 0; (v = arg_each(a, &k));) {
            if (bm_slo_parse(v, &o->mo.slo)) usage_error("--goodput: %s", cs_error_last());
            o->mo.has_slo = true;
            if (o->n_goodput < (int)CS_ARRAY_LEN(o->goodput)) o->goodput[o->n_goodput++] = v;
        }
    } else if (arg_is(a, "--percentile-metrics")) { if (bm_metrics_parse(arg_val(a), &o->metrics_mask)) usage_error("--percentile-metrics: %s", cs_error_last()); }
    else if (arg_is(a, "--metric-percentiles")) percentiles_flag(a, o);
    else if (arg_is(a, "--per-adapter")) o->per_adapter = true;
    else if (arg_is(a, "--per-rank")) o->per_rank = true;
    else if (arg_is(a, "--save-result")) o->save_result = true;
    else if (arg_is(a, "--save-detailed")) o->save_detailed = true;
    else if (arg_is(a, "--result-dir")) o->result_dir = arg_val(a);
    else if (arg_is(a, "--result-filename")) o->result_filename = arg_val(a);
    else if (arg_is(a, "--label")) o->label = arg_val(a);
    else if (arg_is(a, "--metadata")) kv_flag(a, o->metadata, &o->n_metadata, (int)CS_ARRAY_LEN(o->metadata));
    else if (arg_is(a, "--requests-csv")) o->requests_csv = arg_val(a);
    else if (arg_is(a, "--plot")) o->plot = arg_val(a);
    else if (arg_is(a, "--timeseries-bucket")) o->mo.bucket_s = num_flag(a, 1e-3, 1e6);
    else if (arg_is(a, "--no-progress")) o->no_progress = true;
    else return false;
    return true;
}

/* what follows from what: the arrivals' kind and shape, the count, the popularity, and the
 * combinations of flags that contradict each other */
static void opts_derive(opts_t *o) {
    bw_arrival_params_t *ar = &o->wl.arrival;
    if (o->burstiness_given && o->cv_given) usage_error("--burstiness and --cv say the same thing: give one");
    ar->shape = o->cv_given ? 1 / (o->cv * o->cv) : o->burstiness;
    if (!o->arrival_given) {
        if (o->wl.arrivals_file) ar->kind = BW_ARRIVAL_TRACE;
        else if (o->cv_given || (o->burstiness_given && o->burstiness != 1)) ar->kind = BW_ARRIVAL_GAMMA;
    }
    if (ar->kind == BW_ARRIVAL_POISSON && (o->cv_given || o->burstiness != 1))
        usage_error("--arrival poisson has burstiness 1: use --arrival gamma");
    if (ar->ramp != BW_RAMP_NONE) {
        if (!(ar->ramp_start > 0) || !(ar->ramp_end > 0)) usage_error("--ramp-up-strategy needs --ramp-up-start-rps and --ramp-up-end-rps > 0");
        if (ar->ramp_start > ar->ramp_end) usage_error("--ramp-up-start-rps must not exceed --ramp-up-end-rps");
        if (o->rate_given && isfinite(ar->rate)) usage_error("with a ramp-up, leave --request-rate out (the ramp sets it)");
    }
    if (o->wl.arrivals_file && ar->kind != BW_ARRIVAL_TRACE) usage_error("--arrivals-file goes with --arrival trace");
    if (ar->kind == BW_ARRIVAL_TRACE && !o->wl.arrivals_file && o->wl.dataset != BW_DATA_AZURE)
        usage_error("--arrival trace needs --arrivals-file (or --dataset-name azure-llm, whose timestamps it then uses)");
    if (o->wl.duration > 0 && o->num_prompts_given) usage_error("give --num-prompts or --duration, not both");
    if (o->wl.duration > 0 || (!o->num_prompts_given && (ar->kind == BW_ARRIVAL_TRACE || o->wl.dataset == BW_DATA_AZURE)))
        o->wl.num_prompts = 0;
    if (o->wl.dataset != BW_DATA_RANDOM && !o->wl.dataset_path) usage_error("this --dataset-name needs --dataset-path");
    if (o->wl.popularity_file && !o->popularity) o->wl.pop.kind = BW_POP_TRACE;
    if (!o->popularity && !o->wl.popularity_file)
        for (int i = 0; i < o->n_adapters; i++)
            if (o->adapters[i].weight >= 0) o->wl.pop.kind = BW_POP_TRACE;
    if (o->n_adapters > 0 && o->wl.num_adapters > 0) usage_error("give --lora-modules or --num-adapters, not both");
    o->wl.adapters = o->adapters;
    o->wl.n_adapters = o->n_adapters;
    if (o->token_id_min >= o->vocab_size) usage_error("--token-id-min must be below --vocab-size");
    if (strstr(o->endpoint, "rollout") && o->mo.slo.tpot_ms >= 0 && o->mo.slo.ttft_ms < 0 && o->mo.slo.e2el_ms < 0)
        usage_error("--goodput tpot: /v1/rollout streams whole groups, so TPOT is not measured; bound ttft or e2el");
}

static void parse_args(int argc, char **argv, opts_t *o) {
    opts_default(o);
    args_t a = {.argc = argc, .argv = argv};
    for (a.i = 1; a.i < argc; a.i++) {
        args_load(&a);
        if (arg_is(&a, "-h") || arg_is(&a, "--help")) { fputs(USAGE, stdout); exit(0); }
        else if (arg_is(&a, "--version")) { printf("caraserve-bench %s\n", PACKAGE_VERSION); exit(0); }
        else if (!target_flag(&a, o) && !arrival_flag(&a, o) && !dataset_flag(&a, o) && !sampling_flag(&a, o) &&
                 !output_flag(&a, o))
            usage_error("unknown option '%s'", argv[a.i]);
    }
    opts_derive(o);
}

/* ---- the run ---- */
static double mono(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct bench bench_t;

typedef struct xfer {
    bench_t *b;
    struct xfer *prev, *next; /* the bench's list of transfers in flight */
    CURL *h;
    bm_request_t *rec;
    char *body;
    char *line;              /* the unfinished line of the stream */
    size_t line_len, line_cap;
    char *err_body;          /* the start of a non-200 answer */
    size_t err_len;
    long status;
    bool usage;              /* usage.completion_tokens seen */
    int usage_out, usage_in;
    bool summary;            /* rollout: the summary line came */
    int rollout_tokens;
    double *smp;             /* rollout: (ttft_ms, e2e_ms, output tokens) of each sample so far, as the
                              * server timed them; they join the bench's when the call succeeds */
    int n_smp, cap_smp;
    char *stream_error;
    int chunk_cap;
    char curl_err[CURL_ERROR_SIZE];
} xfer_t;

struct bench {
    opts_t *o;
    bw_schedule_t *s;
    CURLM *multi;
    struct curl_slist *headers;
    char *url;
    char base[1024];         /* the server's root */
    const char *model;
    char *model_owned;       /* the model's name from GET /v1/models */
    bool rollout;
    double t0;               /* CLOCK_MONOTONIC of the benchmark's start */
    int inflight;
    xfer_t *live;            /* transfers in flight */
    bm_request_t *recs;      /* (s->n) */
    int sent, done, failed;
    double *ttfts;           /* completed requests' TTFTs, for the progress line */
    int n_ttfts;
    /* rollout: the samples of successful calls, as the server timed them (ms from the start of
     * the call); a sample with no token (ttft_ms, e2e_ms -1) is left out of the statistics */
    double *srv_ttft, *srv_e2e, *srv_tpot;
    int n_srv, n_srv_ttft, n_srv_e2e, n_srv_tpot, n_srv_untimed, cap_srv;
    bool progress;
};

static volatile sig_atomic_t interrupted;
static void on_sigint(int sig) { (void)sig; interrupted = 1; }

static double now_rel(const bench_t *b) { return mono() - b->t0; }

static void set_error(xfer_t *x, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void set_error(xfer_t *x, const char *fmt, ...) {
    if (x->stream_error) return;
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    x->stream_error = strdup(buf);
}

static void add_chunk(xfer_t *x, double t, int tokens) {
    bm_request_t *r = x->rec;
    if (r->n_chunks == x->chunk_cap) {
        int cap = x->chunk_cap ? 2 * x->chunk_cap : 64;
        double *nt = realloc(r->chunk_t, (size_t)cap * sizeof *nt);
        if (nt) r->chunk_t = nt;
        int *nk = realloc(r->chunk_tokens, (size_t)cap * sizeof *nk);
        if (nk) r->chunk_tokens = nk;
        if (!nt || !nk) { set_error(x, "out of memory"); return; }
        x->chunk_cap = cap;
    }
    r->chunk_t[r->n_chunks] = t;
    r->chunk_tokens[r->n_chunks++] = tokens;
}

static const char *error_message(json_t *e) {
    json_t *m = json_is_object(e) ? json_object_get(e, "message") : NULL;
    return json_is_string(m) ? json_string_value(m) : json_is_string(e) ? json_string_value(e) : "error";
}

/* one line of an SSE stream (completions) or NDJSON (rollout), stamped t */
static void on_line(xfer_t *x, char *s, size_t len, double t) {
    while (len > 0 && (s[len - 1] == '\r' || s[len - 1] == ' ')) s[--len] = 0;
    if (len == 0) return;
    if (!x->b->rollout) {
        if (s[0] == ':' || strncmp(s, "event:", 6) == 0 || strncmp(s, "id:", 3) == 0 || strncmp(s, "retry:", 6) == 0)
            return;
        if (strncmp(s, "data:", 5) != 0) { set_error(x, "unexpected line in the event stream: %.80s", s); return; }
        s += 5;
        len -= 5;
        if (len > 0 && *s == ' ') { s++; len--; }
        if (len == 6 && !memcmp(s, "[DONE]", 6)) return;
    }
    json_error_t je;
    /* a token's text may be a NUL byte (<0x00>): "\u0000" is valid JSON */
    json_t *j = json_loadb(s, len, JSON_ALLOW_NUL, &je);
    if (!json_is_object(j)) {
        set_error(x, "bad JSON in the stream: %s", je.text);
        json_decref(j);
        return;
    }
    json_t *err = json_object_get(j, "error");
    if (err && !json_is_null(err)) set_error(x, "error in the stream: %s", error_message(err));
    if (!x->b->rollout) {
        json_t *ch = json_object_get(j, "choices");
        if (json_is_array(ch) && json_array_size(ch) > 0) add_chunk(x, t, 1);
        json_t *u = json_object_get(j, "usage");
        if (json_is_object(u)) {
            json_t *ct = json_object_get(u, "completion_tokens"), *pt = json_object_get(u, "prompt_tokens");
            if (json_is_integer(ct)) {
                x->usage = true;
                x->usage_out = (int)json_integer_value(ct);
            }
            if (json_is_integer(pt)) x->usage_in = (int)json_integer_value(pt);
        }
    } else {
        json_t *sum = json_object_get(j, "summary"), *samples = json_object_get(j, "samples");
        if (json_is_object(sum)) {
            x->summary = true;
            json_t *ot = json_object_get(sum, "output_tokens");
            if (json_is_integer(ot)) {
                x->usage = true;
                x->usage_out = (int)json_integer_value(ot);
            }
        } else if (json_is_array(samples)) {
            int tok = 0;
            size_t i;
            json_t *smp;
            json_array_foreach(samples, i, smp) {
                int out = (int)json_array_size(json_object_get(smp, "output_ids"));
                tok += out;
                json_t *tm = json_object_get(smp, "timing");
                if (json_is_object(tm) && x->rec->id >= 0) {
                    if (x->n_smp == x->cap_smp) {
                        int cap = x->cap_smp ? 2 * x->cap_smp : 16;
                        double *a = realloc(x->smp, (size_t)cap * 3 * sizeof *a);
                        if (!a) { set_error(x, "out of memory"); break; }
                        x->smp = a;
                        x->cap_smp = cap;
                    }
                    json_t *tt = json_object_get(tm, "ttft_ms"), *te = json_object_get(tm, "e2e_ms");
                    double *e = &x->smp[3 * x->n_smp++];
                    e[0] = json_is_number(tt) ? json_number_value(tt) : -1;
                    e[1] = json_is_number(te) ? json_number_value(te) : -1;
                    e[2] = out;
                }
                const char *fin = json_string_value(json_object_get(smp, "finish_reason"));
                if (fin && (!strcmp(fin, "abort") || !strcmp(fin, "error")))
                {
                    const char *gid = json_string_value(json_object_get(j, "group_id"));
                    set_error(x, "group %s: a sample finished with '%s'", gid ? gid : "?", fin);
                }
            }
            x->rollout_tokens += tok;
            add_chunk(x, t, tok);
        }
    }
    json_decref(j);
}

static size_t on_data(char *p, size_t sz, size_t nm, void *user) {
    xfer_t *x = user;
    size_t len = sz * nm;
    double t = now_rel(x->b);
    if (x->status == 0) curl_easy_getinfo(x->h, CURLINFO_RESPONSE_CODE, &x->status);
    if (x->status != 200) { /* keep the start of the error body for the message */
        size_t room = x->err_len < 600 ? 600 - x->err_len : 0, take = len < room ? len : room;
        if (take) {
            char *nb = realloc(x->err_body, x->err_len + take + 1);
            if (nb) {
                x->err_body = nb;
                memcpy(nb + x->err_len, p, take);
                x->err_len += take;
                nb[x->err_len] = 0;
            }
        }
        return len;
    }
    if (x->line_len + len + 1 > x->line_cap) {
        size_t cap = (x->line_len + len + 1) * 2;
        char *nl = realloc(x->line, cap);
        if (!nl) return 0; /* aborts the transfer */
        x->line = nl;
        x->line_cap = cap;
    }
    memcpy(x->line + x->line_len, p, len);
    x->line_len += len;
    size_t start = 0;
    for (size_t i = x->line_len - len; i < x->line_len; i++) {
        if (x->line[i] != '\n') continue;
        x->line[i] = 0;
        on_line(x, x->line + start, i - start, t);
        start = i + 1;
    }
    memmove(x->line, x->line + start, x->line_len - start);
    x->line_len -= start;
    return len;
}

static json_t *prompt_json(const bench_t *b, uint64_t seed, int len) {
    if (b->o->text_prompts) {
        char *txt = bw_prompt_text(seed, len);
        json_t *j = txt ? json_string(txt) : NULL;
        free(txt);
        return j;
    }
    int32_t *ids = malloc((size_t)len * sizeof *ids);
    if (!ids) return NULL;
    bw_prompt_ids(seed, len, b->o->token_id_min, b->o->vocab_size, ids);
    json_t *a = json_array();
    for (int i = 0; i < len; i++) json_array_append_new(a, json_integer(ids[i]));
    free(ids);
    return a;
}

static char *request_body(const bench_t *b, const bw_request_t *q) {
    const opts_t *o = b->o;
    const char *adapter = q->adapter >= 0 ? b->s->adapters[q->adapter].name : NULL;
    json_t *j = json_object();
    if (!b->rollout) {
        json_object_set_new(j, "model", json_string(adapter ? adapter : b->model));
        json_object_set_new(j, "prompt", prompt_json(b, q->prompt_seed, q->input_len));
        json_object_set_new(j, "max_tokens", json_integer(q->output_len));
        json_object_set_new(j, "temperature", json_real(o->temperature));
        if (o->top_p_given) json_object_set_new(j, "top_p", json_real(o->top_p));
        if (o->top_k_given) json_object_set_new(j, "top_k", json_integer(o->top_k));
        if (o->ignore_eos) json_object_set_new(j, "ignore_eos", json_true());
        json_object_set_new(j, "stream", json_true());
        json_object_set_new(j, "stream_options", json_pack("{s:b}", "include_usage", 1));
    } else {
        json_t *sp = json_pack("{s:i, s:f, s:b}", "max_tokens", q->output_len, "temperature", o->temperature,
                               "ignore_eos", o->ignore_eos);
        if (o->top_p_given) json_object_set_new(sp, "top_p", json_real(o->top_p));
        if (o->top_k_given) json_object_set_new(sp, "top_k", json_integer(o->top_k));
        if (adapter) json_object_set_new(j, "adapter", json_string(adapter));
        json_object_set_new(j, "stream", json_true());
        json_object_set_new(j, "sampling", sp);
        json_t *groups = json_array();
        for (int g = 0; g < o->rollout_groups; g++) {
            char gid[64];
            snprintf(gid, sizeof gid, "r%d-g%d", q->id, g);
            uint64_t ps = q->prompt_seed + 0x9e3779b97f4a7c15ull * (uint64_t)g;
            json_array_append_new(groups, json_pack("{s:s, s:o, s:i, s:I}", "group_id", gid, "input_ids",
                                                    prompt_json(b, ps, q->input_len), "n", o->rollout_n, "seed",
                                                    (json_int_t)((q->prompt_seed >> 33) + (uint64_t)g * 1000003u)));
        }
        json_object_set_new(j, "groups", groups);
    }
    if (o->extra_body) json_object_update(j, o->extra_body);
    char *s = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    return s;
}

/* a transfer's handle and buffers, and the transfer; NULL does nothing */
static void xfer_free(xfer_t *x) {
    if (!x) return;
    if (x->h) curl_easy_cleanup(x->h);
    free(x->body);
    free(x->line);
    free(x->err_body);
    free(x->stream_error);
    free(x->smp);
    free(x);
}

static int start_request(bench_t *b, const bw_request_t *q, bm_request_t *rec) {
    xfer_t *x = calloc(1, sizeof *x);
    if (!x) return cs_error_set(CS_ENOMEM, "out of memory");
    x->b = b;
    x->rec = rec;
    x->body = request_body(b, q);
    x->h = curl_easy_init();
    if (!x->body || !x->h) {
        xfer_free(x);
        return cs_error_set(CS_ENOMEM, "out of memory");
    }
    CURL *h = x->h;
    curl_easy_setopt(h, CURLOPT_URL, b->url);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, x->body);
    curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE, (long)strlen(x->body));
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, b->headers);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_data);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, x);
    curl_easy_setopt(h, CURLOPT_PRIVATE, x);
    curl_easy_setopt(h, CURLOPT_ERRORBUFFER, x->curl_err);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_TCP_NODELAY, 1L);
    curl_easy_setopt(h, CURLOPT_HTTP_VERSION, (long)CURL_HTTP_VERSION_1_1);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, 30000L);
    if (b->o->request_timeout > 0) curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)(b->o->request_timeout * 1000));
    if (b->o->insecure) {
        curl_easy_setopt(h, CURLOPT_SSL_VERIFYPEER, 0L);
        curl_easy_setopt(h, CURLOPT_SSL_VERIFYHOST, 0L);
    }
    rec->t_sent = now_rel(b);
    CURLMcode mc = curl_multi_add_handle(b->multi, h);
    if (mc != CURLM_OK) {
        xfer_free(x);
        return cs_error_set(CS_EIO, "curl_multi_add_handle: %s", curl_multi_strerror(mc));
    }
    b->inflight++;
    x->next = b->live;
    if (b->live) b->live->prev = x;
    b->live = x;
    return CS_OK;
}

/* a successful rollout call's samples join the server-side statistics: TTFT and E2E of the
 * samples that produced a token (the server reports -1 for the others), TPOT of those with
 * more than one, (e2e - ttft) / (out - 1) from the server's own first and last token */
static void keep_samples(bench_t *b, const xfer_t *x) {
    if (x->n_smp == 0) return;
    if (b->n_srv + x->n_smp > b->cap_srv) {
        int cap = b->cap_srv ? b->cap_srv : 256;
        while (cap < b->n_srv + x->n_smp) cap *= 2;
        double *t = realloc(b->srv_ttft, (size_t)cap * sizeof *t);
        if (t) b->srv_ttft = t;
        double *e = realloc(b->srv_e2e, (size_t)cap * sizeof *e);
        if (e) b->srv_e2e = e;
        double *p = realloc(b->srv_tpot, (size_t)cap * sizeof *p);
        if (p) b->srv_tpot = p;
        if (!t || !e || !p) return; /* out of memory: these samples go uncounted */
        b->cap_srv = cap;
    }
    for (int i = 0; i < x->n_smp; i++) {
        const double *s = &x->smp[3 * i];
        b->n_srv++;
        if (s[0] < 0 || s[1] < 0) {
            b->n_srv_untimed++;
            continue;
        }
        b->srv_ttft[b->n_srv_ttft++] = s[0];
        b->srv_e2e[b->n_srv_e2e++] = s[1];
        if (s[2] > 1) b->srv_tpot[b->n_srv_tpot++] = (s[1] - s[0]) / (s[2] - 1);
    }
}

static void record_ttft(bench_t *b, const bm_request_t *r) {
    if (!b->ttfts) return;
    bm_latency_t l;
    if (bm_request_latency(r, &l)) b->ttfts[b->n_ttfts++] = l.ttft;
}

/* a transfer ended: success needs HTTP 200, a chunk with choices (vLLM's test), no error in
 * the stream, and for rollouts the summary line; `why` (or NULL) overrides the reason */
static void finish(bench_t *b, xfer_t *x, CURLcode res, const char *why) {
    bm_request_t *r = x->rec;
    r->t_done = now_rel(b);
    if (x->status == 0) curl_easy_getinfo(x->h, CURLINFO_RESPONSE_CODE, &x->status);
    if (res == CURLE_OK && x->status == 200 && x->line_len > 0) { /* a last line without its newline */
        x->line[x->line_len] = 0;
        on_line(x, x->line, x->line_len, r->t_done);
        x->line_len = 0;
    }
    char buf[700];
    if (res != CURLE_OK) snprintf(buf, sizeof buf, "curl: %s", x->curl_err[0] ? x->curl_err : curl_easy_strerror(res));
    else if (x->status != 200) {
        const char *msg = x->err_body ? x->err_body : "";
        json_t *j = json_loads(msg, 0, NULL);
        if (j && json_object_get(j, "error")) msg = error_message(json_object_get(j, "error"));
        snprintf(buf, sizeof buf, "HTTP %ld: %s", x->status, msg);
        json_decref(j);
    } else if (x->stream_error) snprintf(buf, sizeof buf, "%s", x->stream_error);
    else if (r->n_chunks == 0) snprintf(buf, sizeof buf, "never received a chunk with choices");
    else if (b->rollout && !x->summary) snprintf(buf, sizeof buf, "the rollout stream ended before its summary");
    else buf[0] = 0;
    if (why) snprintf(buf, sizeof buf, "%s", why);
    r->ok = buf[0] == 0;
    if (!r->ok) {
        r->error = strdup(buf);
        r->output_tokens = 0;
    } else {
        r->output_tokens = x->usage ? x->usage_out : b->rollout ? x->rollout_tokens : r->n_chunks;
        if (b->o->text_prompts && x->usage_in > 0) r->input_len = x->usage_in;
        keep_samples(b, x);
    }
    if (x->prev) x->prev->next = x->next;
    else b->live = x->next;
    if (x->next) x->next->prev = x->prev;
    curl_multi_remove_handle(b->multi, x->h);
    xfer_free(x);
    b->inflight--;
}

/* drive transfers until none is running or `until` (absolute CLOCK_MONOTONIC) passes */
static void pump(bench_t *b, double until, int *n_done, int *n_failed) {
    int running;
    curl_multi_perform(b->multi, &running);
    CURLMsg *m;
    int left;
    while ((m = curl_multi_info_read(b->multi, &left))) {
        if (m->msg != CURLMSG_DONE) continue;
        xfer_t *x;
        curl_easy_getinfo(m->easy_handle, CURLINFO_PRIVATE, (char **)&x);
        bm_request_t *r = x->rec;
        finish(b, x, m->data.result, NULL);
        if (n_done) (*n_done)++;
        if (n_failed && !r->ok) (*n_failed)++;
        if (r->ok && r->id >= 0) record_ttft(b, r);
    }
    /* poll whole milliseconds (rounded down, so an arrival is not sent late), then sleep the
     * rest in slices short enough that a chunk arriving meanwhile waits little */
    double wait = until - mono();
    if (wait <= 0) return;
    if (b->inflight > 0 && wait >= 1e-3) {
        curl_multi_poll(b->multi, NULL, 0, (int)(wait * 1000), NULL);
        return;
    }
    if (b->inflight > 0 && wait > 2e-4) wait = 2e-4;
    struct timespec ts = {(time_t)wait, (long)((wait - floor(wait)) * 1e9)};
    nanosleep(&ts, NULL);
}

static int cmp_d(const void *a, const void *c) {
    double x = *(const double *)a, y = *(const double *)c;
    return x < y ? -1 : x > y;
}

static void show_progress(bench_t *b, bool last) {
    double el = now_rel(b);
    double p50 = 0;
    if (b->n_ttfts > 0) {
        double *tmp = malloc((size_t)b->n_ttfts * sizeof *tmp);
        if (tmp) {
            memcpy(tmp, b->ttfts, (size_t)b->n_ttfts * sizeof *tmp);
            qsort(tmp, (size_t)b->n_ttfts, sizeof *tmp, cmp_d);
            p50 = bm_percentile(tmp, b->n_ttfts, 50);
            free(tmp);
        }
    }
    fprintf(stderr, "\r[%7.1fs] sent %d/%d  done %d  failed %d  in flight %d  %.2f req/s  p50 TTFT %.1f ms\033[K%s",
            el, b->sent, b->s->n, b->done, b->failed, b->inflight, el > 0 ? (b->done - b->failed) / el : 0, p50,
            last ? "\n" : "");
    fflush(stderr);
}

static int run_warmups(bench_t *b) {
    int n = b->o->num_warmups;
    if (n <= 0) return 0;
    bm_request_t *w = calloc((size_t)n, sizeof *w);
    if (!w) return cs_error_set(CS_ENOMEM, "out of memory");
    fprintf(stderr, "caraserve-bench: %d warm-up request%s\n", n, n > 1 ? "s" : "");
    b->t0 = mono();
    int started = 0, done = 0, failed = 0, rc = CS_OK;
    while (done < n && !interrupted) {
        while (started < n && (b->o->max_concurrency == 0 || b->inflight < b->o->max_concurrency)) {
            w[started].id = -1;
            if ((rc = start_request(b, &b->s->req[0], &w[started]))) goto out;
            started++;
        }
        pump(b, mono() + 0.25, &done, &failed);
    }
    for (int i = 0; i < n; i++)
        if (!w[i].ok && w[i].error) {
            fprintf(stderr, "caraserve-bench: warm-up request failed: %s\n", w[i].error);
            break;
        }
out:
    while (b->live && !interrupted && rc == CS_OK) pump(b, mono() + 0.25, NULL, NULL);
    while (b->live) finish(b, b->live, CURLE_OK, "interrupted");
    for (int i = 0; i < n; i++) {
        free(w[i].chunk_t);
        free(w[i].chunk_tokens);
        free(w[i].error);
    }
    free(w);
    return rc;
}

static int run(bench_t *b) {
    int n = b->s->n, next = 0, qh = 0, qt = 0, rc = CS_OK;
    int *queue = malloc((size_t)n * sizeof *queue); /* arrived, waiting for a --max-concurrency slot */
    b->ttfts = malloc((size_t)n * sizeof *b->ttfts);
    if (!queue || !b->ttfts) { free(queue); return cs_error_set(CS_ENOMEM, "out of memory"); }
    for (int i = 0; i < n; i++) {
        bm_request_t *r = &b->recs[i];
        const bw_request_t *q = &b->s->req[i];
        r->id = q->id;
        r->adapter = q->adapter;
        r->rank = q->adapter >= 0 ? b->s->adapters[q->adapter].rank : 0;
        int groups = b->rollout ? b->o->rollout_groups : 1, per = b->rollout ? b->o->rollout_n : 1;
        r->input_len = (int)((long long)q->input_len * groups); /* main checked that these fit */
        r->output_len = (int)((long long)q->output_len * groups * per);
        r->t_sched = q->t;
        r->t_sent = r->t_done = -1;
    }
    double next_progress = 0;
    b->t0 = mono();
    while (!interrupted) {
        double now = now_rel(b);
        while (next < n && b->s->req[next].t <= now) queue[qt++] = next++;
        while (qh < qt && (b->o->max_concurrency == 0 || b->inflight < b->o->max_concurrency)) {
            int i = queue[qh++];
            if ((rc = start_request(b, &b->s->req[i], &b->recs[i]))) goto out;
            b->sent++;
        }
        if (next == n && qh == qt && b->inflight == 0) break;
        double until = next < n ? b->s->req[next].t : now + 1;
        if (b->progress) {
            if (now >= next_progress) {
                show_progress(b, false);
                next_progress = now + 0.25;
            }
            if (next_progress < until) until = next_progress;
        }
        pump(b, b->t0 + until, &b->done, &b->failed);
    }
out:
    if (interrupted || rc) { /* what is in flight or not sent yet fails */
        while (b->live) finish(b, b->live, CURLE_OK, "interrupted");
        for (int i = 0; i < n; i++) {
            bm_request_t *r = &b->recs[i];
            if (r->ok || r->error) continue;
            r->error = strdup("interrupted before it was sent");
        }
    }
    if (b->progress) show_progress(b, true);
    free(queue);
    return rc;
}

/* ---- set-up and outputs ---- */
static size_t collect_body(char *p, size_t sz, size_t nm, void *user) {
    char **buf = user;
    size_t len = sz * nm, old = *buf ? strlen(*buf) : 0;
    if (old + len > (1 << 22)) return 0;
    char *nb = realloc(*buf, old + len + 1);
    if (!nb) return 0;
    memcpy(nb + old, p, len);
    nb[old + len] = 0;
    *buf = nb;
    return len;
}

/* the base model's name: the first model GET /v1/models lists (as vLLM does) */
static char *first_model(const char *base, struct curl_slist *headers, bool insecure) {
    char url[2048], *body = NULL, *name = NULL;
    snprintf(url, sizeof url, "%s/v1/models", base);
    CURL *h = curl_easy_init();
    if (!h) return NULL;
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, collect_body);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &body);
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, 30000L);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    if (insecure) {
        curl_easy_setopt(h, CURLOPT_SSL_VERIFYPEER, 0L);
        curl_easy_setopt(h, CURLOPT_SSL_VERIFYHOST, 0L);
    }
    long status = 0;
    CURLcode res = curl_easy_perform(h);
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
    curl_easy_cleanup(h);
    if (res != CURLE_OK || status != 200 || !body) {
        fprintf(stderr, "caraserve-bench: GET %s: %s\n", url,
                res != CURLE_OK ? curl_easy_strerror(res) : status != 200 ? "not HTTP 200" : "empty answer");
        free(body);
        return NULL;
    }
    json_t *j = json_loads(body, 0, NULL);
    json_t *d = json_object_get(j, "data");
    const char *id = json_is_array(d) ? json_string_value(json_object_get(json_array_get(d, 0), "id")) : NULL;
    if (id) name = strdup(id);
    else fprintf(stderr, "caraserve-bench: GET %s: no data[0].id in the answer\n", url);
    json_decref(j);
    free(body);
    return name;
}

static const char *arrival_name(bw_arrival_kind_t k) {
    return k == BW_ARRIVAL_POISSON ? "poisson" : k == BW_ARRIVAL_GAMMA ? "gamma" : k == BW_ARRIVAL_CONSTANT ? "constant" : "trace";
}

static json_t *real_or_inf(double v) { return isfinite(v) ? json_real(v) : json_string(v > 0 ? "inf" : "-inf"); }

/* what set the arrival times: a replayed schedule, trace times, every request at t = 0, or the
 * gaps' distribution (poisson, gamma, constant; ramped when the JSON has ramp_up_* keys) */
static const char *arrival_used(const opts_t *o) {
    const bw_arrival_params_t *a = &o->wl.arrival;
    if (o->wl.dataset == BW_DATA_TRACE) return "schedule";
    if (a->kind == BW_ARRIVAL_TRACE) return "trace";
    if (a->ramp == BW_RAMP_NONE && isinf(a->rate)) return "all-at-once";
    return arrival_name(a->kind);
}

/* vLLM's request_rate key: the fixed rate used, "inf" when every request went out at t = 0, null
 * when no single rate set the arrivals (a ramp, trace times, a replayed schedule) */
static json_t *request_rate_json(const opts_t *o) {
    const bw_arrival_params_t *a = &o->wl.arrival;
    if (o->wl.dataset == BW_DATA_TRACE || a->kind == BW_ARRIVAL_TRACE || a->ramp != BW_RAMP_NONE) return json_null();
    return real_or_inf(a->rate);
}

static json_t *config_json(const bench_t *b) {
    const opts_t *o = b->o;
    const bw_config_t *w = &o->wl;
    static const char *ds[] = {"random", "azure-llm", "trace"};
    static const char *ramp[] = {NULL, "linear", "exponential"};
    json_t *c = json_object();
    json_object_set_new(c, "base_url", json_string(b->base));
    json_object_set_new(c, "url", json_string(b->url));
    json_object_set_new(c, "endpoint", json_string(o->endpoint));
    json_object_set_new(c, "model", json_string(b->model));
    json_object_set_new(c, "seed", json_integer((json_int_t)w->seed));
    json_object_set_new(c, "num_prompts", json_integer(b->s->n));
    json_object_set_new(c, "duration_s", w->duration > 0 ? json_real(w->duration) : json_null());
    json_object_set_new(c, "arrival", json_string(arrival_used(o)));
    json_object_set_new(c, "request_rate", request_rate_json(o));
    json_object_set_new(c, "burstiness", json_real(w->arrival.shape));
    json_object_set_new(c, "cv", json_real(1 / sqrt(w->arrival.shape)));
    json_object_set_new(c, "ramp_up", w->arrival.ramp == BW_RAMP_NONE ? json_null()
                        : json_pack("{s:s, s:f, s:f}", "strategy", ramp[w->arrival.ramp], "start_rps",
                                    w->arrival.ramp_start, "end_rps", w->arrival.ramp_end));
    json_object_set_new(c, "arrivals_file", w->arrivals_file ? json_string(w->arrivals_file) : json_null());
    json_object_set_new(c, "time_scale", json_real(w->time_scale));
    json_object_set_new(c, "max_concurrency", o->max_concurrency ? json_integer(o->max_concurrency) : json_null());
    json_object_set_new(c, "num_warmups", json_integer(o->num_warmups));
    json_t *ads = json_array();
    for (int i = 0; i < b->s->n_adapters; i++) {
        const bw_adapter_t *a = &b->s->adapters[i];
        json_array_append_new(ads, json_pack("{s:s, s:o, s:o}", "name", a->name, "rank",
                                             a->rank >= 0 ? json_integer(a->rank) : json_null(), "weight",
                                             a->weight >= 0 ? json_real(a->weight) : json_null()));
    }
    json_object_set_new(c, "adapters", ads);
    json_object_set_new(c, "popularity", json_string(o->popularity ? o->popularity
                                                     : w->pop.kind == BW_POP_TRACE ? "trace" : "uniform"));
    json_object_set_new(c, "popularity_file", w->popularity_file ? json_string(w->popularity_file) : json_null());
    json_object_set_new(c, "base_fraction", json_real(w->base_fraction));
    json_object_set_new(c, "dataset_name", json_string(ds[w->dataset]));
    json_object_set_new(c, "dataset_path", w->dataset_path ? json_string(w->dataset_path) : json_null());
    json_object_set_new(c, "random_input_len", json_integer(w->input_len));
    json_object_set_new(c, "random_output_len", json_integer(w->output_len));
    json_object_set_new(c, "random_range_ratio", json_real(w->range_ratio));
    json_object_set_new(c, "prompt_format", json_string(o->text_prompts ? "text" : "ids"));
    json_object_set_new(c, "vocab_size", json_integer(o->vocab_size));
    json_object_set_new(c, "token_id_min", json_integer(o->token_id_min));
    json_object_set_new(c, "ignore_eos", json_boolean(o->ignore_eos));
    json_object_set_new(c, "temperature", json_real(o->temperature));
    if (b->rollout)
        json_object_set_new(c, "rollout", json_pack("{s:i, s:i}", "n", o->rollout_n, "groups", o->rollout_groups));
    json_t *pc = json_array();
    for (int i = 0; i < o->mo.n_pct; i++) json_array_append_new(pc, json_real(o->mo.pct[i]));
    json_object_set_new(c, "metric_percentiles", pc);
    json_t *gp = json_array();
    for (int i = 0; i < o->n_goodput; i++) json_array_append_new(gp, json_string(o->goodput[i]));
    json_object_set_new(c, "goodput", gp);
    return c;
}

static char *result_path(const bench_t *b, const char *date) {
    const opts_t *o = b->o;
    char name[1024], rate[64], conc[64] = "";
    if (o->result_filename) snprintf(name, sizeof name, "%s", o->result_filename);
    else {
        const char *model = strrchr(b->model, '/') ? strrchr(b->model, '/') + 1 : b->model;
        const bw_arrival_params_t *a = &o->wl.arrival;
        if (a->ramp != BW_RAMP_NONE) snprintf(rate, sizeof rate, "ramp-up-%s-%gqps-%gqps", a->ramp == BW_RAMP_LINEAR ? "linear" : "exponential", a->ramp_start, a->ramp_end);
        else if (isinf(a->rate)) snprintf(rate, sizeof rate, "infqps");
        else snprintf(rate, sizeof rate, "%gqps", a->rate);
        if (o->max_concurrency) snprintf(conc, sizeof conc, "-concurrency%d", o->max_concurrency);
        snprintf(name, sizeof name, "%s-%s%s-%s-%s.json", o->label ? o->label : b->rollout ? "rollout" : "openai", rate,
                 conc, model, date);
    }
    if (name[0] == '/' || !o->result_dir || !strcmp(o->result_dir, ".")) return strdup(name);
    mkdir(o->result_dir, 0777);
    size_t len = strlen(o->result_dir) + strlen(name) + 2;
    char *p = malloc(len);
    if (p) snprintf(p, len, "%s/%s", o->result_dir, name);
    return p;
}

static void raise_fd_limit(void) { /* one socket per request in flight */
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
}

/* ---- main: set-up, the run, the report ---- */

/* the schedule: replayed from --dataset-name trace's file or drawn; 0, or the exit status */
static int load_schedule(bench_t *b) {
    const opts_t *o = b->o;
    if (o->wl.dataset == BW_DATA_TRACE) {
        if (bw_schedule_load(o->wl.dataset_path, &b->s)) {
            fprintf(stderr, "caraserve-bench: %s\n", cs_error_last());
            return 1;
        }
    } else {
        int rc = bw_schedule_build(&o->wl, &b->s);
        if (rc) {
            fprintf(stderr, "caraserve-bench: %s\n", cs_error_last());
            return rc == CS_EINVAL ? 2 : 1; /* a bad combination of flags, or a file */
        }
    }
    return 0;
}

/* a rollout call's tokens are counted in an int: groups x prompt, groups x n x output */
static bool rollout_fits(const bench_t *b) {
    const opts_t *o = b->o;
    for (int i = 0; i < b->s->n; i++) {
        const bw_request_t *q = &b->s->req[i];
        long long in = (long long)q->input_len * o->rollout_groups;
        long long out = (long long)q->output_len * o->rollout_groups * o->rollout_n;
        if (in > INT_MAX || out > INT_MAX) {
            fprintf(stderr, "caraserve-bench: request %d: %d groups x %d prompt tokens and %d groups x n=%d x %d "
                    "output tokens in one rollout call: more than %d; lower --rollout-groups, --rollout-n or "
                    "the lengths\n", q->id, o->rollout_groups, q->input_len, o->rollout_groups, o->rollout_n,
                    q->output_len, INT_MAX);
            return false;
        }
    }
    return true;
}

static void print_dry_run(const bw_schedule_t *s) {
    long long in = 0, out = 0;
    int base = 0;
    for (int i = 0; i < s->n; i++) {
        in += s->req[i].input_len;
        out += s->req[i].output_len;
        base += s->req[i].adapter < 0;
    }
    printf("schedule: %d requests over %.3f s, %d adapters (%d requests to the base model), %lld input and %lld "
           "output tokens\n", s->n, s->req[s->n - 1].t, s->n_adapters, base, in, out);
}

/* the schedule's checks, its dump and --dry-run: -1 to go on with the run, or the exit status */
static int prepare_schedule(bench_t *b) {
    opts_t *o = b->o;
    b->rollout = strstr(o->endpoint, "rollout") != NULL;
    o->mo.no_token_timing = b->rollout; /* one chunk per group: no per-token time to measure */
    if (b->rollout && !rollout_fits(b)) return 2;
    if (b->rollout && o->mo.slo.tpot_ms >= 0)
        fprintf(stderr, "caraserve-bench: --goodput tpot:%g does not apply to /v1/rollout (groups arrive whole, so "
                "TPOT is not measured); goodput uses the other bounds\n", o->mo.slo.tpot_ms);
    if (o->dump_schedule && bw_schedule_dump(b->s, o->dump_schedule)) {
        fprintf(stderr, "caraserve-bench: %s\n", cs_error_last());
        return 1;
    }
    if (o->dry_run) {
        print_dry_run(b->s);
        return 0;
    }
    return -1;
}

/* the server's root (b->base), the endpoint's URL and the request headers */
static void set_target(bench_t *b) {
    const opts_t *o = b->o;
    if (o->base_url) snprintf(b->base, sizeof b->base, "%s", o->base_url);
    else if (strchr(o->host, ':')) snprintf(b->base, sizeof b->base, "http://[%s]:%d", o->host, o->port); /* IPv6 */
    else snprintf(b->base, sizeof b->base, "http://%s:%d", o->host, o->port);
    size_t bl = strlen(b->base);
    while (bl > 0 && b->base[bl - 1] == '/') b->base[--bl] = 0;
    size_t ul = bl + strlen(o->endpoint) + 2;
    b->url = malloc(ul);
    snprintf(b->url, ul, "%s%s%s", b->base, o->endpoint[0] == '/' ? "" : "/", o->endpoint);
    b->headers = curl_slist_append(NULL, "Content-Type: application/json");
    b->headers = curl_slist_append(b->headers, "Expect:"); /* no 100-continue round trip for big prompts */
    char hb[2048];
    if (o->api_key && *o->api_key) {
        snprintf(hb, sizeof hb, "Authorization: Bearer %s", o->api_key);
        b->headers = curl_slist_append(b->headers, hb);
    }
    for (int i = 0; i < o->n_headers; i++) {
        const char *eq = strchr(o->headers[i], '=');
        snprintf(hb, sizeof hb, "%.*s: %s", (int)(eq - o->headers[i]), o->headers[i], eq + 1);
        b->headers = curl_slist_append(b->headers, hb);
    }
}

/* libcurl, the target, the model's name, the records and the signal handlers; 0 or -1 (said) */
static int setup(bench_t *b) {
    const opts_t *o = b->o;
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) {
        fprintf(stderr, "caraserve-bench: curl_global_init failed\n");
        return -1;
    }
    raise_fd_limit();
    set_target(b);
    b->model = o->model;
    if (!b->model) {
        if (!(b->model_owned = first_model(b->base, b->headers, o->insecure))) {
            fprintf(stderr, "caraserve-bench: give the base model's name with --model\n");
            return -1;
        }
        b->model = b->model_owned;
    }
    b->multi = curl_multi_init();
    b->recs = calloc((size_t)b->s->n, sizeof *b->recs);
    if (!b->multi || !b->recs || !b->url) { fprintf(stderr, "caraserve-bench: out of memory\n"); return -1; }
    long maxconn = o->max_concurrency > 0 ? o->max_concurrency : b->s->n;
    curl_multi_setopt(b->multi, CURLMOPT_MAXCONNECTS, maxconn < 16 ? 16L : maxconn);
    b->progress = !o->no_progress && isatty(STDERR_FILENO);
    struct sigaction sa = {0};
    sa.sa_handler = on_sigint;
    sa.sa_flags = SA_RESETHAND; /* a second Ctrl-C ends the program at once */
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    return 0;
}

/* the line that says what is about to run */
static void announce(const bench_t *b) {
    const opts_t *o = b->o;
    const bw_arrival_params_t *a = &o->wl.arrival;
    char how[1200];
    if (o->wl.dataset == BW_DATA_TRACE) snprintf(how, sizeof how, "the schedule of %s", o->wl.dataset_path);
    else if (a->kind == BW_ARRIVAL_TRACE) snprintf(how, sizeof how, "trace arrivals");
    else if (a->ramp) snprintf(how, sizeof how, "%s arrivals ramped from %g to %g/s", arrival_name(a->kind), a->ramp_start, a->ramp_end);
    else if (isinf(a->rate)) snprintf(how, sizeof how, "every request at t = 0");
    else snprintf(how, sizeof how, "%s arrivals at %g/s", arrival_name(a->kind), a->rate);
    fprintf(stderr, "caraserve-bench: %d requests to %s (model %s, %d adapters), %s%s\n", b->s->n, b->url, b->model,
            b->s->n_adapters, how, o->max_concurrency ? ", concurrency capped" : "");
}

/* the server's own per-sample timing of the rollout calls, from the start of each call */
static json_t *server_timing_json(const bench_t *b) {
    const opts_t *o = b->o;
    bm_stat_t st[3];
    static const char *what[3] = {"ttft", "e2e", "tpot"};
    bm_stat_compute(b->srv_ttft, b->n_srv_ttft, &o->mo, &st[0]);
    bm_stat_compute(b->srv_e2e, b->n_srv_e2e, &o->mo, &st[1]);
    bm_stat_compute(b->srv_tpot, b->n_srv_tpot, &o->mo, &st[2]);
    json_t *ro = json_pack("{s:i, s:i, s:i, s:i, s:i}", "n", o->rollout_n, "groups", o->rollout_groups,
                           "samples", b->n_srv, "samples_without_tokens", b->n_srv_untimed,
                           "samples_with_tpot", b->n_srv_tpot);
    for (int m = 0; m < 3; m++) {
        char key[64];
        snprintf(key, sizeof key, "mean_server_%s_ms", what[m]);
        json_object_set_new(ro, key, json_real(st[m].mean));
        snprintf(key, sizeof key, "median_server_%s_ms", what[m]);
        json_object_set_new(ro, key, json_real(st[m].median));
        for (int k = 0; k < o->mo.n_pct; k++) {
            char pw[32];
            snprintf(pw, sizeof pw, "%g", o->mo.pct[k]);
            snprintf(key, sizeof key, "p%s_server_%s_ms", pw, what[m]);
            json_object_set_new(ro, key, json_real(st[m].pct[k]));
        }
    }
    return ro;
}

/* the JSON result: bm_result_json's keys, then vLLM's run keys, ours and --metadata's */
static json_t *result_json(const bench_t *b, const bm_result_t *res, const char *date) {
    const opts_t *o = b->o;
    const bw_arrival_params_t *a = &o->wl.arrival;
    json_t *j = bm_result_json(res, b->recs, b->s->n, o->save_detailed);
    json_object_set_new(j, "date", json_string(date));
    json_object_set_new(j, "backend", json_string(b->rollout ? "caraserve-rollout" : "openai"));
    json_object_set_new(j, "label", o->label ? json_string(o->label) : json_null());
    json_object_set_new(j, "model_id", json_string(b->model));
    json_object_set_new(j, "tokenizer_id", json_null());
    json_object_set_new(j, "num_prompts", json_integer(b->s->n));
    json_object_set_new(j, "request_rate", request_rate_json(o));
    json_object_set_new(j, "arrival", json_string(arrival_used(o)));
    if (o->wl.dataset != BW_DATA_TRACE && a->kind != BW_ARRIVAL_TRACE && a->ramp) {
        json_object_set_new(j, "ramp_up_strategy", json_string(a->ramp == BW_RAMP_LINEAR ? "linear" : "exponential"));
        json_object_set_new(j, "ramp_up_start_rps", json_real(a->ramp_start));
        json_object_set_new(j, "ramp_up_end_rps", json_real(a->ramp_end));
    }
    json_object_set_new(j, "burstiness", json_real(a->shape));
    json_object_set_new(j, "max_concurrency", o->max_concurrency ? json_integer(o->max_concurrency) : json_null());
    json_object_set_new(j, "interrupted", json_boolean(interrupted));
    json_object_set_new(j, "config", config_json(b));
    if (b->rollout) json_object_set_new(j, "rollout", server_timing_json(b));
    for (int i = 0; i < o->n_metadata; i++) {
        const char *eq = strchr(o->metadata[i], '=');
        char key[256];
        snprintf(key, sizeof key, "%.*s", (int)(eq - o->metadata[i]), o->metadata[i]);
        json_object_set_new(j, key, json_string(eq + 1));
    }
    return j;
}

/* --save-result: 0, or 1 when the file could not be written */
static int save_result(const bench_t *b, const bm_result_t *res, const char *date) {
    int status = 0;
    json_t *j = result_json(b, res, date);
    char *path = result_path(b, date);
    if (!path || json_dump_file(j, path, JSON_INDENT(1) | JSON_REAL_PRECISION(10)) != 0) {
        fprintf(stderr, "caraserve-bench: could not write %s\n", path ? path : "the result");
        status = 1;
    } else {
        fprintf(stderr, "caraserve-bench: wrote %s\n", path);
    }
    free(path);
    json_decref(j);
    return status;
}

static void print_failures(const bench_t *b) {
    int shown = 0;
    for (int i = 0; i < b->s->n && shown < 10; i++)
        if (!b->recs[i].ok && b->recs[i].error) {
            if (!shown++) fprintf(stderr, "Failed requests (first 10):\n");
            fprintf(stderr, "  request %d: %s\n", b->recs[i].id, b->recs[i].error);
        }
}

/* the table on stdout, then the files asked for; *res gets the metrics (the caller frees them);
 * the exit status */
static int report(bench_t *b, double duration, bm_result_t **res) {
    const opts_t *o = b->o;
    const bw_schedule_t *s = b->s;
    const char **names = malloc((size_t)(s->n_adapters + 1) * sizeof *names);
    int *ranks = malloc((size_t)(s->n_adapters + 1) * sizeof *ranks);
    if (!names || !ranks) { free(names); free(ranks); fprintf(stderr, "caraserve-bench: out of memory\n"); return 1; }
    for (int i = 0; i < s->n_adapters; i++) {
        names[i] = s->adapters[i].name;
        ranks[i] = s->adapters[i].rank;
    }
    int rc = bm_compute(b->recs, s->n, duration, &o->mo, names, ranks, s->n_adapters, b->model, res);
    free(ranks);
    if (rc) { free(names); fprintf(stderr, "caraserve-bench: %s\n", cs_error_last()); return 1; }
    print_failures(b);
    const bw_arrival_params_t *a = &o->wl.arrival;
    bm_table_opts_t to = {o->metrics_mask, o->max_concurrency,
                          o->wl.dataset == BW_DATA_TRACE || a->kind == BW_ARRIVAL_TRACE || a->ramp ? INFINITY : a->rate,
                          o->per_adapter, o->per_rank};
    bm_print_table(stdout, *res, &to);
    fflush(stdout);
    int status = (*res)->all.completed > 0 ? 0 : 1;
    if (status) fprintf(stderr, "caraserve-bench: no request completed\n");
    char date[32];
    time_t now = time(NULL);
    strftime(date, sizeof date, "%Y%m%d-%H%M%S", localtime(&now));
    if (o->save_result && save_result(b, *res, date)) status = 1;
    if (o->requests_csv && bm_write_requests_csv(o->requests_csv, *res, b->recs, s->n, names, b->model)) {
        fprintf(stderr, "caraserve-bench: %s\n", cs_error_last());
        status = 1;
    }
    if (o->plot) {
        char title[512];
        snprintf(title, sizeof title, "caraserve-bench: %s %s (%s)", b->model, o->endpoint, date);
        if (bm_write_svg(o->plot, *res, b->recs, s->n, title)) {
            fprintf(stderr, "caraserve-bench: %s\n", cs_error_last());
            status = 1;
        }
    }
    free(names);
    return status;
}

static void bench_free(bench_t *b) {
    opts_t *o = b->o;
    if (b->recs)
        for (int i = 0; i < b->s->n; i++) {
            free(b->recs[i].chunk_t);
            free(b->recs[i].chunk_tokens);
            free(b->recs[i].error);
        }
    free(b->recs);
    free(b->ttfts);
    free(b->srv_ttft);
    free(b->srv_e2e);
    free(b->srv_tpot);
    if (b->multi) curl_multi_cleanup(b->multi);
    curl_slist_free_all(b->headers);
    free(b->url);
    free(b->model_owned);
    bw_schedule_free(b->s);
    for (int i = 0; i < o->n_adapters; i++) free(o->adapters[i].name);
    free(o->adapters);
    json_decref(o->extra_body);
}

int main(int argc, char **argv) {
    opts_t o;
    parse_args(argc, argv, &o);
    bench_t b = {.o = &o};
    bm_result_t *res = NULL;
    int status = load_schedule(&b);
    if (status) return status;
    status = prepare_schedule(&b);
    if (status < 0) {
        status = 1;
        if (setup(&b) == 0) {
            announce(&b);
            if (run_warmups(&b) || run(&b)) {
                fprintf(stderr, "caraserve-bench: %s\n", cs_error_last());
            } else {
                double duration = now_rel(&b);
                if (interrupted) fprintf(stderr, "caraserve-bench: interrupted after %.1f s; reporting what finished\n", duration);
                status = report(&b, duration, &res);
            }
        }
    }
    bm_result_free(res);
    bench_free(&b);
    curl_global_cleanup();
    return status;
}
