/* bench_workload.h: caraserve-bench's workload, drawn entirely before the run from one seeded
 * generator (xoshiro256** seeded through splitmix64): arrival times (Poisson, gamma, constant,
 * ramp-up, trace replay), adapter popularity (uniform, zipf, S-LoRA's power law, round-robin,
 * measured), rank mixes, prompt/output lengths, and the CSV files that feed or record it (the
 * Azure LLM inference trace, arrival and popularity files, the dumped schedule). Errors follow
 * base/common.h: negative CS_E* codes with a "file:line: reason" message in cs_error_last(). */
#ifndef CS_BENCH_WORKLOAD_H
#define CS_BENCH_WORKLOAD_H

#include <stdbool.h>
#include <stdint.h>

#include "base/rng.h"

/* ---- the generator: the engine's xoshiro256** (cs_rng_t), with the draws a schedule needs ---- */
typedef cs_rng_t bw_rng_t;

void bw_rng_seed(bw_rng_t *r, uint64_t seed);
/* a generator of its own for one part of the workload, seeded from r */
void bw_rng_split(bw_rng_t *r, bw_rng_t *child);
uint64_t bw_rng_next(bw_rng_t *r);
double bw_rng_uniform(bw_rng_t *r);                   /* [0, 1) with 53 random bits */
uint64_t bw_rng_below(bw_rng_t *r, uint64_t n);       /* [0, n), unbiased; n > 0 */
double bw_rng_normal(bw_rng_t *r);                    /* standard normal */
double bw_rng_gamma(bw_rng_t *r, double shape, double scale); /* Marsaglia-Tsang; shape, scale > 0 */

/* ---- arrivals ---- */
typedef enum bw_arrival_kind {
    BW_ARRIVAL_POISSON,  /* exponential gaps */
    BW_ARRIVAL_GAMMA,    /* gamma gaps of shape `shape` (vLLM's burstiness; 1/cv^2), mean 1/rate */
    BW_ARRIVAL_CONSTANT, /* gaps of exactly 1/rate */
    BW_ARRIVAL_TRACE,    /* times read from a file */
} bw_arrival_kind_t;

typedef enum bw_ramp { BW_RAMP_NONE, BW_RAMP_LINEAR, BW_RAMP_EXPONENTIAL } bw_ramp_t;

typedef struct bw_arrival_params {
    bw_arrival_kind_t kind;
    double rate;                   /* requests/s; INFINITY sends everything at t = 0 */
    double shape;                  /* gamma shape (1 = Poisson) */
    bw_ramp_t ramp;                /* the rate goes from ramp_start to ramp_end (requests/s) */
    double ramp_start, ramp_end;
    bool normalize;                /* vLLM: rescale so that the last of n arrivals is at n / rate */
} bw_arrival_params_t;

/* Arrival times in seconds from the start, non-decreasing, the first after one gap (as vLLM).
 * Count mode (duration <= 0): exactly n. Duration mode: every arrival before `duration` (n caps
 * the count when > 0). *times is malloc'd. Trace arrivals are not generated here. */
int bw_arrivals_generate(const bw_arrival_params_t *p, bw_rng_t *rng, int n, double duration, double **times,
                         int *n_out);

/* ---- adapter popularity and ranks ---- */
typedef enum bw_pop_kind {
    BW_POP_UNIFORM,     /* every adapter alike */
    BW_POP_ZIPF,        /* p_i ~ 1 / (i + 1)^theta */
    BW_POP_POWER,       /* S-LoRA: adapter = floor(N * X), X ~ numpy.random.power(alpha) */
    BW_POP_ROUND_ROBIN, /* request i -> adapter i mod N */
    BW_POP_TRACE,       /* measured shares (--popularity-file, or NAME:RANK:WEIGHT) */
} bw_pop_kind_t;

typedef struct bw_pop_spec {
    bw_pop_kind_t kind;
    double param; /* theta (zipf), alpha (power) */
} bw_pop_spec_t;

/* "uniform", "zipf:1.2", "power:0.5", "round-robin", "trace" */
int bw_pop_parse(const char *s, bw_pop_spec_t *out);
/* the share of each of n adapters (they sum to 1); not for round-robin or trace */
int bw_pop_weights(const bw_pop_spec_t *p, int n, double *w);

/* draws an index with probability proportional to its weight (binary search on the CDF) */
typedef struct bw_sampler {
    int n;
    double *cdf; /* (n) normalized, cdf[n-1] = 1 */
} bw_sampler_t;

int bw_sampler_init(bw_sampler_t *s, const double *w, int n);
int bw_sampler_draw(const bw_sampler_t *s, bw_rng_t *r);
void bw_sampler_free(bw_sampler_t *s);

#define BW_MAX_RANKS 32
typedef struct bw_rank_mix {
    int n;
    int rank[BW_MAX_RANKS];
    double frac[BW_MAX_RANKS]; /* normalized to sum 1 */
} bw_rank_mix_t;

/* "8:.25,16:.25,32:.25,64:.25" (fractions are normalized; a bare "16" is 16:1) */
int bw_rank_mix_parse(const char *s, bw_rank_mix_t *m);
/* ranks of n adapters: the mix's shares apportioned by largest remainder (exact counts),
 * then shuffled with rng so that rank does not follow popularity order */
int bw_rank_mix_assign(const bw_rank_mix_t *m, int n, bw_rng_t *rng, int *ranks);

typedef struct bw_adapter {
    char *name;
    int rank;      /* -1: not known */
    double weight; /* popularity weight; < 0: none given */
} bw_adapter_t;

/* "NAME[:RANK[:WEIGHT]]" into a (a->name malloc'd) */
int bw_adapter_parse(const char *s, bw_adapter_t *a);

/* ---- files ---- */
typedef struct bw_trace_row {
    double t;          /* seconds from the first row */
    int input_len;     /* ContextTokens */
    int output_len;    /* GeneratedTokens */
} bw_trace_row_t;

/* The Azure LLM inference trace: a header naming TIMESTAMP, ContextTokens, GeneratedTokens
 * (any order, any case), TIMESTAMP as "YYYY-MM-DD HH:MM:SS[.fraction]" or seconds. */
int bw_trace_load_azure(const char *path, bw_trace_row_t **rows, int *n);
/* One arrival time in seconds per line (an optional header such as `arrival_s`), non-decreasing. */
int bw_arrivals_load(const char *path, double **times, int *n);
/* `adapter,probability` rows (optional header); probabilities >= 0 with a positive sum. */
int bw_popularity_load(const char *path, char ***names, double **prob, int *n);

/* ---- the schedule ---- */
typedef struct bw_request {
    int id;
    double t;              /* scheduled arrival, seconds from the start */
    int adapter;           /* index into the schedule's adapters; -1: the base model */
    int input_len;         /* prompt tokens */
    int output_len;        /* max_tokens (all of them with ignore_eos) */
    uint64_t prompt_seed;  /* the prompt's token ids come from this (bw_prompt_ids) */
} bw_request_t;

typedef struct bw_schedule {
    int n_adapters;
    bw_adapter_t *adapters; /* (n_adapters) */
    int n;
    bw_request_t *req;      /* (n) in arrival order */
} bw_schedule_t;

typedef enum bw_dataset { BW_DATA_RANDOM, BW_DATA_AZURE, BW_DATA_TRACE } bw_dataset_t;

typedef struct bw_config {
    uint64_t seed;
    int num_prompts;          /* count mode; 0 in duration mode (or: all trace rows) */
    double duration;          /* > 0: duration mode */
    bw_arrival_params_t arrival;
    const char *arrivals_file;
    double time_scale;        /* trace times are multiplied by this (default 1) */
    /* adapters: explicit ones, or num_adapters named adapter_prefix + i, or the popularity file's */
    const bw_adapter_t *adapters;
    int n_adapters;
    int num_adapters;
    const char *adapter_prefix;
    bw_rank_mix_t rank_mix;   /* n = 0: none */
    bw_pop_spec_t pop;
    const char *popularity_file;
    double base_fraction;     /* share of requests to the base model */
    /* lengths */
    bw_dataset_t dataset;
    const char *dataset_path;
    int input_len, output_len;
    double range_ratio;
} bw_config_t;

void bw_config_default(bw_config_t *c);
/* random and azure-llm datasets; a dumped schedule is read with bw_schedule_load */
int bw_schedule_build(const bw_config_t *c, bw_schedule_t **out);
void bw_schedule_free(bw_schedule_t *s);
/* CSV: id,arrival_s,model,rank,input_len,output_len,prompt_seed (model empty: the base model) */
int bw_schedule_dump(const bw_schedule_t *s, const char *path);
int bw_schedule_load(const char *path, bw_schedule_t **out);

/* a request's prompt: len token ids uniform in [lo, hi), the same for the same seed */
void bw_prompt_ids(uint64_t seed, int len, int lo, int hi, int32_t *out);
/* or a text prompt of len words from a fixed list (malloc'd) */
char *bw_prompt_text(uint64_t seed, int len);

/* helpers the tests use too */
double bw_chi2_critical(int df, double z); /* Wilson-Hilferty: the chi-square quantile at normal quantile z */

#endif
