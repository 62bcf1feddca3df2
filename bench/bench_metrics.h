/* bench_metrics.h: caraserve-bench's request timelines turned into vLLM `bench serve`'s
 * metrics (TTFT, TPOT, ITL, E2EL with mean/median/std/percentiles, throughputs, peaks,
 * goodput) plus ours (SLO attainment with failures as misses, sched_ttft, per-adapter and
 * per-rank breakdowns, a per-second time series), and their outputs: the human table, the
 * --save-result JSON, the per-request CSV and the SVG plot. Nothing here touches the network,
 * so the definitions are tested on synthetic timelines. Times are seconds from the start of
 * the benchmark; reported latencies are milliseconds, as vLLM's. */
#ifndef CS_BENCH_METRICS_H
#define CS_BENCH_METRICS_H

#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>

/* What one request did (filled by the event loop; a test fills it by hand). */
typedef struct bm_request {
    int id;
    int adapter;          /* index into the run's adapters; -1: the base model */
    int rank;             /* 0 for the base model, -1 when not known */
    int input_len;        /* prompt tokens sent */
    int output_len;       /* output tokens asked for */
    int output_tokens;    /* received: usage.completion_tokens, else one per chunk */
    double t_sched;       /* scheduled arrival */
    double t_sent;        /* handed to the connection (after any --max-concurrency wait) */
    double t_done;        /* the transfer ended (success or not); < 0: never sent */
    int n_chunks;         /* streamed chunks carrying `choices` (rollout: group lines) */
    double *chunk_t;      /* (n_chunks) their arrival times; chunk_t[0] is the first token */
    int *chunk_tokens;    /* (n_chunks) tokens in each (1 per completions chunk, as vLLM counts) */
    bool ok;
    char *error;          /* why it failed (NULL when ok) */
} bm_request_t;

#define BM_MAX_PCT 16
/* what the table and the JSON (`tpot_itl`) say when TPOT and ITL are not measured */
#define BM_NO_TOKEN_TIMING_NOTE "not measured in rollout mode: groups arrive whole"

typedef struct bm_slo {
    double ttft_ms, tpot_ms, e2el_ms; /* < 0: no bound on that metric */
} bm_slo_t;

typedef struct bm_opts {
    int n_pct;
    double pct[BM_MAX_PCT]; /* e.g. 50, 90, 99 */
    bm_slo_t slo;
    bool has_slo;           /* --goodput given */
    double bucket_s;        /* time series bucket (default 1 s) */
    bool no_token_timing;   /* chunks are whole groups (rollout): TPOT and ITL are not measured and
                             * a TPOT bound does not apply (it is left out of goodput and attainment) */
} bm_opts_t;

typedef struct bm_stat {
    int n;                  /* samples */
    double mean, median, std, max;
    double pct[BM_MAX_PCT]; /* at bm_opts_t.pct */
} bm_stat_t;

/* one row of the breakdowns, and the whole run */
typedef struct bm_group {
    const char *name;       /* adapter name, "rank 16", "all" (not owned) */
    int rank;
    int requests, completed, failed, good;
    long long input_tokens, output_tokens;           /* of completed requests, as vLLM */
    double request_throughput, output_throughput, total_token_throughput, request_goodput;
    bm_stat_t ttft, tpot, itl, e2el, sched_ttft;     /* ms */
    /* good / (completed + failed), and the same per metric alone; 0 with no requests */
    double attainment, attainment_ttft, attainment_tpot, attainment_e2el;
} bm_group_t;

typedef struct bm_bucket {
    double t;               /* bucket start (s from the benchmark start) */
    int arrivals;           /* scheduled in this bucket */
    int completed, failed;  /* finished in this bucket */
    long long output_tokens;/* chunks' tokens that arrived in this bucket */
    int max_concurrency;    /* most requests in flight at once during it */
    int slo_requests, slo_good; /* of the requests scheduled in this bucket */
    double mean_ttft_ms;    /* of the completed requests scheduled in it; 0 if none */
} bm_bucket_t;

typedef struct bm_result {
    double duration;
    bm_opts_t opts;
    bm_group_t all;
    double max_output_tokens_per_s; /* vLLM: 1 s buckets from the first successful send */
    /* vLLM: 1 s buckets b from the first successful send t0; a successful request counts in
     * every b with floor(sent - t0) <= b <= floor(sent + e2el - t0); the fullest bucket */
    int max_concurrent_requests;
    /* ours: the most successful requests in flight at one instant (sweep over [sent, sent + e2el)) */
    int max_concurrent_requests_exact;
    int n_adapters;
    bm_group_t *per_adapter;        /* base model first (when it had requests), then the adapters */
    int n_ranks;
    bm_group_t *per_rank;           /* ascending rank */
    int n_buckets;
    bm_bucket_t *ts;
    double tpot_bound_na;           /* no_token_timing: the TPOT bound given, not applied (< 0: none) */
    char **names;                   /* owned names of the groups */
    int n_names;
} bm_result_t;

/* per-request derived latencies in ms; false when the request did not complete */
typedef struct bm_latency {
    double ttft, tpot, e2el, sched_ttft; /* tpot 0 when output_tokens <= 1 (vLLM: counts as 0 for goodput) */
    bool has_tpot;                       /* output_tokens > 1: part of the TPOT statistics */
} bm_latency_t;

bool bm_request_latency(const bm_request_t *r, bm_latency_t *l);
/* completed and within every bound of the SLO (bm_compute drops a TPOT bound under no_token_timing) */
bool bm_request_good(const bm_request_t *r, const bm_slo_t *slo);

/* numpy's default (linear) percentile of sorted values; 0 for n = 0 */
double bm_percentile(const double *sorted, int n, double p);
/* sorts v in place; numpy's mean, median, population std and percentiles; zeros for n = 0 (vLLM: `or 0`) */
void bm_stat_compute(double *v, int n, const bm_opts_t *o, bm_stat_t *s);

/* adapter_names[i] / adapter_ranks[i] describe adapter i; base_name names the base model */
int bm_compute(const bm_request_t *reqs, int n, double duration, const bm_opts_t *o, const char *const *adapter_names,
               const int *adapter_ranks, int n_adapters, const char *base_name, bm_result_t **out);
void bm_result_free(bm_result_t *r);

/* "ttft,tpot,itl,e2el" as bits */
enum { BM_TTFT = 1, BM_TPOT = 2, BM_ITL = 4, BM_E2EL = 8, BM_SCHED_TTFT = 16 };
int bm_metrics_parse(const char *s, int *mask);
/* "ttft:500 tpot:50" pieces, one at a time */
int bm_slo_parse(const char *s, bm_slo_t *slo);

typedef struct bm_table_opts {
    int metrics;               /* BM_* bits printed with percentiles */
    int max_concurrency;       /* 0: none (the line is left out, as vLLM does) */
    double request_rate;       /* INFINITY: left out */
    bool per_adapter, per_rank;
} bm_table_opts_t;

/* vLLM's table ("{:<40} {:<10.2f}" rows), then the SLO block and the breakdowns */
void bm_print_table(FILE *f, const bm_result_t *r, const bm_table_opts_t *t);
/* vLLM's result keys plus ours; with detailed, the per-request arrays */
json_t *bm_result_json(const bm_result_t *r, const bm_request_t *reqs, int n, bool detailed);
int bm_write_requests_csv(const char *path, const bm_result_t *res, const bm_request_t *reqs, int n,
                          const char *const *adapter_names, const char *base_name);
/* latency CDFs per rank and SLO attainment / throughput over time, drawn as SVG */
int bm_write_svg(const char *path, const bm_result_t *res, const bm_request_t *reqs, int n, const char *title);

#endif
