/* test_bench_workload.c: caraserve-bench's workload generators (bench/bench_workload.c). Rates
 * and burstiness (the gaps' coefficient of variation) over 100k draws, popularity and rank
 * shares by chi-square tests, exact rank apportioning, reproducibility by seed, the dumped
 * schedule round trip, and the CSV readers rejecting bad rows with "file:line: reason". Every
 * statistical test uses a fixed seed, so it passes or fails the same way every time; the
 * tolerances are 4-5 standard errors wide, and each chi-square test is paired with a wrong
 * distribution it must reject, so the test has power. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench/bench_workload.h"
#include "base/common.h"
#include "testutil.h"

#define N_DRAWS 100000

static char tmpdir[256];

static const char *srcdir(void) {
    const char *s = getenv("CS_SRCDIR");
    return s && *s ? s : ".";
}

static char *data_path(const char *name) {
    static char buf[4][1024];
    static int k;
    char *p = buf[k++ % 4];
    snprintf(p, 1024, "%s/tests/data/bench/%s", srcdir(), name);
    return p;
}

/* writes text to a fresh file in the test's directory */
static const char *write_tmp(const char *name, const char *text) {
    static char buf[8][512];
    static int k;
    char *p = buf[k++ % 8];
    snprintf(p, 512, "%s/%s", tmpdir, name);
    FILE *f = fopen(p, "w");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    fclose(f);
    return p;
}

static void gap_stats(const double *t, int n, double *mean, double *cv) {
    double s = 0, ss = 0, prev = 0;
    for (int i = 0; i < n; i++) {
        double g = t[i] - prev;
        prev = t[i];
        s += g;
        ss += g * g;
    }
    *mean = s / n;
    double var = ss / n - *mean * *mean;
    *cv = sqrt(var) / *mean;
}

/* Pearson's chi-square of counts against probabilities, bins with expected counts below 5
 * pooled into one; *df gets the degrees of freedom */
static double chi_square(const long *count, const double *p, int k, long n, int *df) {
    double chi = 0, pool_o = 0, pool_e = 0;
    int bins = 0;
    for (int i = 0; i < k; i++) {
        double e = p[i] * n;
        if (e < 5) {
            pool_o += count[i];
            pool_e += e;
            continue;
        }
        chi += (count[i] - e) * (count[i] - e) / e;
        bins++;
    }
    if (pool_e > 0) {
        chi += (pool_o - pool_e) * (pool_o - pool_e) / pool_e;
        bins++;
    }
    *df = bins - 1;
    return chi;
}

#define Z_999 3.09 /* the normal quantile of p = 0.999 */

START_TEST(rng_reproducible) {
    bw_rng_t a, b, c;
    bw_rng_seed(&a, 42);
    bw_rng_seed(&b, 42);
    bw_rng_seed(&c, 43);
    int differ = 0;
    for (int i = 0; i < 1000; i++) {
        uint64_t x = bw_rng_next(&a), y = bw_rng_next(&b), z = bw_rng_next(&c);
        ck_assert_uint_eq(x, y);
        differ += x != z;
    }
    ck_assert_int_gt(differ, 990);
    double s = 0;
    for (int i = 0; i < N_DRAWS; i++) {
        double u = bw_rng_uniform(&a);
        ck_assert(u >= 0 && u < 1);
        s += u;
    }
    ck_assert_double_eq_tol(s / N_DRAWS, 0.5, 0.005); /* SE 0.0009 */
    long cnt[7] = {0};
    for (int i = 0; i < 70000; i++) cnt[bw_rng_below(&a, 7)]++;
    double p[7];
    for (int i = 0; i < 7; i++) p[i] = 1.0 / 7;
    int df;
    ck_assert_double_lt(chi_square(cnt, p, 7, 70000, &df), bw_chi2_critical(df, Z_999));
    /* the Wilson-Hilferty quantile is close to the table value: chi2(10) at 0.999 is 29.59 */
    ck_assert_double_eq_tol(bw_chi2_critical(10, Z_999), 29.59, 0.2);
}
END_TEST

START_TEST(gamma_moments) {
    static const double shapes[] = {0.1, 0.5, 1, 2.5, 9};
    bw_rng_t r;
    bw_rng_seed(&r, 7);
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        double a = shapes[k], scale = 2, s = 0, ss = 0;
        for (int i = 0; i < N_DRAWS; i++) {
            double x = bw_rng_gamma(&r, a, scale);
            ck_assert(x >= 0);
            s += x;
            ss += x * x;
        }
        double mean = s / N_DRAWS, var = ss / N_DRAWS - mean * mean;
        /* mean a*scale (SE sqrt(a)*scale/sqrt(n)), variance a*scale^2 */
        ck_assert_msg(fabs(mean / (a * scale) - 1) < 5 / sqrt(a * N_DRAWS), "shape %g: mean %g", a, mean);
        ck_assert_msg(fabs(var / (a * scale * scale) - 1) < 0.06, "shape %g: variance %g", a, var);
    }
}
END_TEST

static void check_process(bw_arrival_kind_t kind, double shape, double want_cv, double cv_tol) {
    bw_arrival_params_t p = {.kind = kind, .rate = 10, .shape = shape};
    bw_rng_t r;
    bw_rng_seed(&r, 1234);
    double *t;
    int n;
    ck_assert_int_eq(bw_arrivals_generate(&p, &r, N_DRAWS, 0, &t, &n), CS_OK);
    ck_assert_int_eq(n, N_DRAWS);
    for (int i = 1; i < n; i++) ck_assert(t[i] >= t[i - 1]);
    double mean, cv;
    gap_stats(t, n, &mean, &cv);
    /* the mean gap is 1/rate; its relative SE is cv/sqrt(n) (1% at cv 3) */
    ck_assert_msg(fabs(mean * p.rate - 1) < 5 * want_cv / sqrt(N_DRAWS) + 1e-6, "kind %d shape %g: rate %g", kind,
                  shape, 1 / mean);
    ck_assert_msg(fabs(cv - want_cv) <= cv_tol, "kind %d shape %g: cv %g, want %g", kind, shape, cv, want_cv);
    free(t);
}

START_TEST(arrival_rate_and_burstiness) {
    check_process(BW_ARRIVAL_POISSON, 1, 1, 0.02);          /* exponential gaps: cv 1 */
    check_process(BW_ARRIVAL_GAMMA, 0.25, 2, 0.08);         /* vLLM burstiness 0.25: cv 1/sqrt(0.25) */
    check_process(BW_ARRIVAL_GAMMA, 4, 0.5, 0.01);          /* burstiness 4: cv 0.5 */
    check_process(BW_ARRIVAL_GAMMA, 1.0 / 9, 3, 0.15);      /* S-LoRA --cv 3: shape 1/cv^2 */
    check_process(BW_ARRIVAL_CONSTANT, 1, 0, 1e-4);         /* constant: no variation (rounding aside) */
}
END_TEST

START_TEST(arrival_modes) {
    bw_rng_t r;
    double *t;
    int n;
    /* vLLM's normalization: the last of n arrivals lands at n / rate */
    bw_arrival_params_t p = {.kind = BW_ARRIVAL_GAMMA, .rate = 5, .shape = 0.5, .normalize = true};
    bw_rng_seed(&r, 3);
    ck_assert_int_eq(bw_arrivals_generate(&p, &r, 1000, 0, &t, &n), CS_OK);
    ck_assert_double_eq_tol(t[n - 1], 200, 1e-9);
    free(t);
    /* constant: exactly k / rate, the first after one gap (as vLLM) */
    p = (bw_arrival_params_t){.kind = BW_ARRIVAL_CONSTANT, .rate = 4};
    ck_assert_int_eq(bw_arrivals_generate(&p, &r, 8, 0, &t, &n), CS_OK);
    for (int i = 0; i < n; i++) ck_assert_double_eq_tol(t[i], (i + 1) / 4.0, 1e-12);
    free(t);
    /* infinite rate: everything at 0 */
    p = (bw_arrival_params_t){.kind = BW_ARRIVAL_POISSON, .rate = INFINITY};
    ck_assert_int_eq(bw_arrivals_generate(&p, &r, 50, 0, &t, &n), CS_OK);
    ck_assert_int_eq(n, 50);
    for (int i = 0; i < n; i++) ck_assert(t[i] == 0);
    free(t);
    /* duration mode: a Poisson count with mean rate * duration (SD 316 at 100k) */
    p = (bw_arrival_params_t){.kind = BW_ARRIVAL_POISSON, .rate = 50};
    bw_rng_seed(&r, 11);
    ck_assert_int_eq(bw_arrivals_generate(&p, &r, 0, 2000, &t, &n), CS_OK);
    ck_assert_int_lt(abs(n - 100000), 1600);
    ck_assert(t[n - 1] < 2000);
    free(t);
    ck_assert_int_eq(bw_arrivals_generate(&p, &r, 0, 0, &t, &n), CS_EINVAL); /* neither count nor duration */
    p.rate = INFINITY;
    ck_assert_int_eq(bw_arrivals_generate(&p, &r, 0, 10, &t, &n), CS_EINVAL); /* infinite rate for a duration */
    p = (bw_arrival_params_t){.kind = BW_ARRIVAL_GAMMA, .rate = 1, .shape = 0};
    ck_assert_int_eq(bw_arrivals_generate(&p, &r, 10, 0, &t, &n), CS_EINVAL);
}
END_TEST

/* each gap scaled by the rate it was drawn at averages 1; the ramp ends 100x faster */
static void check_ramp(bw_ramp_t ramp) {
    bw_arrival_params_t p = {.kind = BW_ARRIVAL_POISSON, .ramp = ramp, .ramp_start = 1, .ramp_end = 100};
    bw_rng_t r;
    bw_rng_seed(&r, 5);
    double *t;
    int n;
    ck_assert_int_eq(bw_arrivals_generate(&p, &r, N_DRAWS, 0, &t, &n), CS_OK);
    double s = 0, prev = 0, early = 0, late = 0;
    for (int i = 0; i < n; i++) {
        double prog = (double)i / (n - 1);
        double rate = ramp == BW_RAMP_LINEAR ? 1 + 99 * prog : pow(100, prog);
        double g = t[i] - prev;
        prev = t[i];
        s += g * rate;
        if (i < n / 10) early += g;
        if (i >= n - n / 10) late += g;
    }
    ck_assert_double_eq_tol(s / n, 1, 5 / sqrt(N_DRAWS));
    ck_assert_double_gt(early, 5 * late);
    free(t);
}

START_TEST(ramp_up) {
    check_ramp(BW_RAMP_LINEAR);
    check_ramp(BW_RAMP_EXPONENTIAL);
}
END_TEST

static bw_config_t cfg(int n_adapters, const char *pop) {
    bw_config_t c;
    bw_config_default(&c);
    c.seed = 99;
    c.num_prompts = N_DRAWS;
    c.num_adapters = n_adapters;
    c.input_len = 16;
    c.output_len = 8;
    if (pop) ck_assert_int_eq(bw_pop_parse(pop, &c.pop), CS_OK);
    return c;
}

/* the schedule's adapter counts against p, which must pass, and against q, which must not */
static void check_shares(const bw_schedule_t *s, const double *p, const double *q, int k, const char *what) {
    long *cnt = calloc((size_t)k, sizeof *cnt);
    for (int i = 0; i < s->n; i++) {
        ck_assert(s->req[i].adapter >= 0 && s->req[i].adapter < k);
        cnt[s->req[i].adapter]++;
    }
    int df;
    double chi = chi_square(cnt, p, k, s->n, &df);
    ck_assert_msg(chi < bw_chi2_critical(df, Z_999), "%s: chi-square %g over %d df (critical %g)", what, chi, df,
                  bw_chi2_critical(df, Z_999));
    if (q) {
        double chi_q = chi_square(cnt, q, k, s->n, &df);
        ck_assert_msg(chi_q > bw_chi2_critical(df, Z_999), "%s: the wrong distribution passes too (%g)", what, chi_q);
    }
    free(cnt);
}

START_TEST(popularity_distributions) {
    enum { K = 20 };
    double uni[K], zipf[K], power[K];
    bw_pop_spec_t sp;
    ck_assert_int_eq(bw_pop_parse("uniform", &sp), CS_OK);
    ck_assert_int_eq(bw_pop_weights(&sp, K, uni), CS_OK);
    ck_assert_int_eq(bw_pop_parse("zipf:1.1", &sp), CS_OK);
    ck_assert_int_eq(bw_pop_weights(&sp, K, zipf), CS_OK);
    double zs = 0;
    for (int i = 0; i < K; i++) zs += pow(i + 1, -1.1);
    for (int i = 0; i < K; i++) ck_assert_double_eq_tol(zipf[i], pow(i + 1, -1.1) / zs, 1e-12);
    ck_assert_int_eq(bw_pop_parse("power:0.3", &sp), CS_OK);
    ck_assert_int_eq(bw_pop_weights(&sp, K, power), CS_OK);
    /* S-LoRA: floor(N * X), X with CDF x^alpha: P(i) = ((i+1)/N)^a - (i/N)^a */
    for (int i = 0; i < K; i++) ck_assert_double_eq_tol(power[i], pow((i + 1.0) / K, 0.3) - pow((double)i / K, 0.3), 1e-12);
    ck_assert_double_gt(power[0], power[1]);

    bw_schedule_t *s;
    bw_config_t c = cfg(K, "uniform");
    ck_assert_int_eq(bw_schedule_build(&c, &s), CS_OK);
    ck_assert_int_eq(s->n, N_DRAWS);
    check_shares(s, uni, zipf, K, "uniform");
    bw_schedule_free(s);
    c = cfg(K, "zipf:1.1");
    ck_assert_int_eq(bw_schedule_build(&c, &s), CS_OK);
    check_shares(s, zipf, uni, K, "zipf:1.1");
    bw_schedule_free(s);
    c = cfg(K, "power:0.3");
    ck_assert_int_eq(bw_schedule_build(&c, &s), CS_OK);
    check_shares(s, power, zipf, K, "power:0.3");
    bw_schedule_free(s);
    /* round-robin: exactly i mod N */
    c = cfg(7, "round-robin");
    c.num_prompts = 50;
    ck_assert_int_eq(bw_schedule_build(&c, &s), CS_OK);
    for (int i = 0; i < s->n; i++) ck_assert_int_eq(s->req[i].adapter, i % 7);
    bw_schedule_free(s);
}
END_TEST

START_TEST(popularity_file_and_weights) {
    /* CaraServe's measured popularity over 128 adapters, named by the file */
    char **names;
    double *p;
    int k;
    ck_assert_int_eq(bw_popularity_load(data_path("maf-popularity-128.csv"), &names, &p, &k), CS_OK);
    ck_assert_int_eq(k, 128);
    double sum = 0, top = 0;
    for (int i = 0; i < k; i++) {
        sum += p[i];
        if (p[i] > top) top = p[i];
    }
    ck_assert_double_eq_tol(sum, 1, 1e-9);
    ck_assert_double_eq_tol(top, 0.140, 0.001); /* docs/benchmarks.md: the top adapter's 14.0% */
    bw_config_t c = cfg(0, "trace");
    c.popularity_file = data_path("maf-popularity-128.csv");
    c.adapter_prefix = "maf-";
    bw_schedule_t *s;
    ck_assert_int_eq(bw_schedule_build(&c, &s), CS_OK);
    ck_assert_int_eq(s->n_adapters, 128);
    ck_assert_str_eq(s->adapters[5].name, "maf-5");
    double uni[128];
    for (int i = 0; i < 128; i++) uni[i] = 1.0 / 128;
    check_shares(s, p, uni, 128, "maf-popularity-128");
    bw_schedule_free(s);
    /* the file's rows matched to --num-adapters by index */
    c = cfg(128, "trace");
    c.popularity_file = data_path("maf-popularity-128.csv");
    ck_assert_int_eq(bw_schedule_build(&c, &s), CS_OK);
    ck_assert_str_eq(s->adapters[0].name, "lora-0");
    check_shares(s, p, uni, 128, "maf-popularity-128 by index");
    bw_schedule_free(s);
    c.num_adapters = 4; /* rows name adapters that do not exist */
    ck_assert_int_eq(bw_schedule_build(&c, &s), CS_EINVAL);
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "is not one of the 4 adapters"));
    for (int i = 0; i < k; i++) free(names[i]);
    free(names);
    free(p);
    /* NAME:RANK:WEIGHT */
    bw_adapter_t ad[3];
    ck_assert_int_eq(bw_adapter_parse("a:8:3", &ad[0]), CS_OK);
    ck_assert_int_eq(bw_adapter_parse("b:16:1", &ad[1]), CS_OK);
    ck_assert_int_eq(bw_adapter_parse("c:64:0", &ad[2]), CS_OK);
    ck_assert_str_eq(ad[0].name, "a");
    ck_assert_int_eq(ad[1].rank, 16);
    ck_assert_double_eq(ad[0].weight, 3);
    c = cfg(0, "trace");
    c.adapters = ad;
    c.n_adapters = 3;
    ck_assert_int_eq(bw_schedule_build(&c, &s), CS_OK);
    double w[3] = {0.75, 0.25, 0}, wrong[3] = {0.5, 0.5, 0};
    check_shares(s, w, wrong, 3, "weights 3:1:0");
    bw_schedule_free(s);
    for (int i = 0; i < 3; i++) free(ad[i].name);
}
END_TEST

START_TEST(base_fraction) {
    bw_config_t c = cfg(10, "uniform");
    c.base_fraction = 0.2;
    bw_schedule_t *s;
    ck_assert_int_eq(bw_schedule_build(&c, &s), CS_OK);
    int base = 0;
    for (int i = 0; i < s->n; i++) base += s->req[i].adapter < 0;
    ck_assert_double_eq_tol((double)base / s->n, 0.2, 0.005); /* SE 0.0013 */
    bw_schedule_free(s);
    c = cfg(0, NULL); /* no adapters: everything goes to the base model */
    c.num_prompts = 100;
    ck_assert_int_eq(bw_schedule_build(&c, &s), CS_OK);
    for (int i = 0; i < s->n; i++) ck_assert_int_eq(s->req[i].adapter, -1);
    bw_schedule_free(s);
}
END_TEST

static void count_ranks(const int *ranks, int n, int rank, int want) {
    int c = 0;
    for (int i = 0; i < n; i++) c += ranks[i] == rank;
    ck_assert_msg(c == want, "rank %d: %d adapters, want %d", rank, c, want);
}

START_TEST(rank_mix) {
    bw_rank_mix_t m;
    bw_rng_t r;
    bw_rng_seed(&r, 1);
    int ranks[1000], again[1000];
    ck_assert_int_eq(bw_rank_mix_parse("8:.25,16:.25,32:.25,64:.25", &m), CS_OK);
    ck_assert_int_eq(m.n, 4);
    ck_assert_int_eq(bw_rank_mix_assign(&m, 1000, &r, ranks), CS_OK);
    for (int k = 8; k <= 64; k *= 2) count_ranks(ranks, 1000, k, 250);
    int sorted = 1;
    for (int i = 1; i < 1000; i++) sorted &= ranks[i] >= ranks[i - 1];
    ck_assert(!sorted); /* shuffled: rank does not follow the popularity order */
    bw_rng_seed(&r, 1);
    ck_assert_int_eq(bw_rank_mix_assign(&m, 1000, &r, again), CS_OK);
    ck_assert_mem_eq(ranks, again, sizeof ranks);
    ck_assert_int_eq(bw_rank_mix_parse("8:1,16:1,64:1", &m), CS_OK); /* normalized */
    ck_assert_int_eq(bw_rank_mix_assign(&m, 3, &r, ranks), CS_OK);
    count_ranks(ranks, 3, 8, 1);
    count_ranks(ranks, 3, 16, 1);
    count_ranks(ranks, 3, 64, 1);
    ck_assert_int_eq(bw_rank_mix_parse("8:.5,16:.3,64:.2", &m), CS_OK);
    ck_assert_int_eq(bw_rank_mix_assign(&m, 10, &r, ranks), CS_OK);
    count_ranks(ranks, 10, 8, 5);
    count_ranks(ranks, 10, 16, 3);
    count_ranks(ranks, 10, 64, 2);
    ck_assert_int_eq(bw_rank_mix_parse("8:.5,16:.5", &m), CS_OK); /* 3.5 / 3.5: the tie to the first */
    ck_assert_int_eq(bw_rank_mix_assign(&m, 7, &r, ranks), CS_OK);
    count_ranks(ranks, 7, 8, 4);
    count_ranks(ranks, 7, 16, 3);
    ck_assert_int_eq(bw_rank_mix_parse("16", &m), CS_OK);
    ck_assert_int_eq(m.rank[0], 16);
    ck_assert_int_eq(bw_rank_mix_parse("8:.5,x:.5", &m), CS_EINVAL);
    ck_assert_int_eq(bw_rank_mix_parse("8:-1", &m), CS_EINVAL);
    ck_assert_int_eq(bw_rank_mix_parse("8:.5,8:.5", &m), CS_EINVAL);
    ck_assert_int_eq(bw_rank_mix_parse("8:0", &m), CS_EINVAL);

    /* through the schedule: requests per rank follow the mix under uniform popularity */
    bw_config_t c = cfg(100, "uniform");
    ck_assert_int_eq(bw_rank_mix_parse("8:.4,16:.3,32:.2,64:.1", &c.rank_mix), CS_OK);
    bw_schedule_t *s;
    ck_assert_int_eq(bw_schedule_build(&c, &s), CS_OK);
    long cnt[4] = {0};
    for (int i = 0; i < s->n; i++) {
        int rk = s->adapters[s->req[i].adapter].rank;
        cnt[rk == 8 ? 0 : rk == 16 ? 1 : rk == 32 ? 2 : 3]++;
    }
    double want[4] = {.4, .3, .2, .1}, wrong[4] = {.25, .25, .25, .25};
    int df;
    ck_assert_double_lt(chi_square(cnt, want, 4, s->n, &df), bw_chi2_critical(df, Z_999));
    ck_assert_double_gt(chi_square(cnt, wrong, 4, s->n, &df), bw_chi2_critical(df, Z_999));
    bw_schedule_free(s);
}
END_TEST

static void assert_same(const bw_schedule_t *a, const bw_schedule_t *b, double ttol) {
    ck_assert_int_eq(a->n, b->n);
    ck_assert_int_eq(a->n_adapters, b->n_adapters);
    for (int i = 0; i < a->n_adapters; i++) {
        ck_assert_str_eq(a->adapters[i].name, b->adapters[i].name);
        ck_assert_int_eq(a->adapters[i].rank, b->adapters[i].rank);
    }
    for (int i = 0; i < a->n; i++) {
        const bw_request_t *x = &a->req[i], *y = &b->req[i];
        ck_assert_int_eq(x->id, y->id);
        ck_assert(fabs(x->t - y->t) <= ttol);
        ck_assert_int_eq(x->adapter, y->adapter);
        ck_assert_int_eq(x->input_len, y->input_len);
        ck_assert_int_eq(x->output_len, y->output_len);
        ck_assert_uint_eq(x->prompt_seed, y->prompt_seed);
    }
}

START_TEST(reproducible_by_seed) {
    bw_config_t c = cfg(16, "zipf:1.0");
    c.num_prompts = 5000;
    c.arrival.rate = 20;
    c.arrival.kind = BW_ARRIVAL_GAMMA;
    c.arrival.shape = 0.5;
    c.base_fraction = 0.1;
    c.range_ratio = 0.5;
    c.input_len = 200;
    c.output_len = 100;
    ck_assert_int_eq(bw_rank_mix_parse("8:.5,64:.5", &c.rank_mix), CS_OK);
    bw_schedule_t *a, *b, *d, *e;
    ck_assert_int_eq(bw_schedule_build(&c, &a), CS_OK);
    ck_assert_int_eq(bw_schedule_build(&c, &b), CS_OK);
    assert_same(a, b, 0);
    /* lengths within [L(1-r), L(1+r)], as vLLM's random dataset */
    double in_sum = 0;
    for (int i = 0; i < a->n; i++) {
        ck_assert(a->req[i].input_len >= 100 && a->req[i].input_len <= 300);
        ck_assert(a->req[i].output_len >= 50 && a->req[i].output_len <= 150);
        in_sum += a->req[i].input_len;
    }
    ck_assert_double_eq_tol(in_sum / a->n, 200, 3); /* SE 0.8 */
    /* another seed, another schedule */
    c.seed = 100;
    ck_assert_int_eq(bw_schedule_build(&c, &d), CS_OK);
    int same_t = 0;
    for (int i = 0; i < a->n; i++) same_t += a->req[i].t == d->req[i].t;
    ck_assert_int_lt(same_t, 5);
    /* the parts draw from generators of their own: another popularity keeps the arrivals */
    c.seed = 99;
    ck_assert_int_eq(bw_pop_parse("uniform", &c.pop), CS_OK);
    ck_assert_int_eq(bw_schedule_build(&c, &e), CS_OK);
    int moved = 0;
    for (int i = 0; i < a->n; i++) {
        moved += a->req[i].t != e->req[i].t || a->req[i].input_len != e->req[i].input_len;
    }
    ck_assert_int_eq(moved, 0);
    /* dump and load: the same schedule (times to 1e-9 s) */
    char path[512];
    snprintf(path, sizeof path, "%s/sched.csv", tmpdir);
    ck_assert_int_eq(bw_schedule_dump(a, path), CS_OK);
    bw_schedule_t *l;
    ck_assert_int_eq(bw_schedule_load(path, &l), CS_OK);
    /* adapters come back in order of first use, so compare by name */
    ck_assert_int_eq(l->n, a->n);
    for (int i = 0; i < a->n; i++) {
        ck_assert_double_eq_tol(l->req[i].t, a->req[i].t, 1e-9);
        ck_assert_int_eq(l->req[i].input_len, a->req[i].input_len);
        ck_assert_int_eq(l->req[i].output_len, a->req[i].output_len);
        ck_assert_uint_eq(l->req[i].prompt_seed, a->req[i].prompt_seed);
        ck_assert_int_eq(l->req[i].adapter < 0, a->req[i].adapter < 0);
        if (a->req[i].adapter >= 0) {
            ck_assert_str_eq(l->adapters[l->req[i].adapter].name, a->adapters[a->req[i].adapter].name);
            ck_assert_int_eq(l->adapters[l->req[i].adapter].rank, a->adapters[a->req[i].adapter].rank);
        }
    }
    /* dumping the loaded schedule gives the same file */
    char path2[512];
    snprintf(path2, sizeof path2, "%s/sched2.csv", tmpdir);
    ck_assert_int_eq(bw_schedule_dump(l, path2), CS_OK);
    bw_schedule_t *l2;
    ck_assert_int_eq(bw_schedule_load(path2, &l2), CS_OK);
    assert_same(l, l2, 0);
    bw_schedule_free(a);
    bw_schedule_free(b);
    bw_schedule_free(d);
    bw_schedule_free(e);
    bw_schedule_free(l);
    bw_schedule_free(l2);
}
END_TEST

START_TEST(prompts) {
    int32_t a[300], b[300], c[300];
    bw_prompt_ids(77, 300, 100, 32000, a);
    bw_prompt_ids(77, 300, 100, 32000, b);
    bw_prompt_ids(78, 300, 100, 32000, c);
    ck_assert_mem_eq(a, b, sizeof a);
    int same = 0;
    for (int i = 0; i < 300; i++) {
        ck_assert(a[i] >= 100 && a[i] < 32000);
        same += a[i] == c[i];
    }
    ck_assert_int_lt(same, 5);
    int32_t tiny[1000];
    bw_prompt_ids(1, 1000, 5, 7, tiny); /* both ends of a small range are reached, nothing outside */
    int seen[2] = {0};
    for (int i = 0; i < 1000; i++) {
        ck_assert(tiny[i] == 5 || tiny[i] == 6);
        seen[tiny[i] - 5] = 1;
    }
    ck_assert(seen[0] && seen[1]);
    char *t = bw_prompt_text(3, 40);
    int words = 1;
    for (char *p = t; *p; p++) words += *p == ' ';
    ck_assert_int_eq(words, 40);
    free(t);
}
END_TEST

START_TEST(azure_trace) {
    bw_trace_row_t *rows;
    int n;
    ck_assert_int_eq(bw_trace_load_azure(data_path("azure-llm-sample.csv"), &rows, &n), CS_OK);
    ck_assert_int_eq(n, 12);
    ck_assert_double_eq(rows[0].t, 0);
    ck_assert_double_eq_tol(rows[1].t, 4.314579, 1e-6);
    ck_assert_double_eq_tol(rows[11].t, 23.445489, 1e-6);
    ck_assert_int_eq(rows[2].input_len, 879);
    ck_assert_int_eq(rows[2].output_len, 47);
    free(rows);
    /* across midnight and a month end, columns in another order, seconds as numbers */
    const char *p = write_tmp("cross.csv", "GeneratedTokens,TIMESTAMP,ContextTokens\n"
                                           "5,2024-02-29 23:59:59.5,10\n"
                                           "6,2024-03-01T00:00:01Z,11\n");
    ck_assert_int_eq(bw_trace_load_azure(p, &rows, &n), CS_OK);
    ck_assert_int_eq(n, 2);
    ck_assert_double_eq_tol(rows[1].t, 1.5, 1e-9);
    ck_assert_int_eq(rows[1].input_len, 11);
    ck_assert_int_eq(rows[1].output_len, 6);
    free(rows);
    p = write_tmp("secs.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n10.5,3,4\n12,3,4\n");
    ck_assert_int_eq(bw_trace_load_azure(p, &rows, &n), CS_OK);
    ck_assert_double_eq_tol(rows[1].t, 1.5, 1e-12);
    free(rows);

    /* through the schedule: lengths and arrival times from the trace, scaled */
    bw_config_t c = cfg(0, NULL);
    c.dataset = BW_DATA_AZURE;
    c.dataset_path = data_path("azure-llm-sample.csv");
    c.arrival.kind = BW_ARRIVAL_TRACE;
    c.num_prompts = 0;
    c.time_scale = 0.5;
    bw_schedule_t *s;
    ck_assert_int_eq(bw_schedule_build(&c, &s), CS_OK);
    ck_assert_int_eq(s->n, 12);
    ck_assert_double_eq_tol(s->req[1].t, 4.314579 / 2, 1e-6);
    ck_assert_int_eq(s->req[6].input_len, 1313);
    ck_assert_int_eq(s->req[6].output_len, 56);
    bw_schedule_free(s);
    c.duration = 5; /* only what arrives in the first 5 s (scaled): rows 0-2; row 3 is at 5.43 s */
    ck_assert_int_eq(bw_schedule_build(&c, &s), CS_OK);
    ck_assert_int_eq(s->n, 3);
    bw_schedule_free(s);
    /* trace lengths with generated arrivals: the rows are reused in a cycle */
    c.duration = 0;
    c.arrival.kind = BW_ARRIVAL_POISSON;
    c.arrival.rate = 10;
    c.num_prompts = 30;
    ck_assert_int_eq(bw_schedule_build(&c, &s), CS_OK);
    ck_assert_int_eq(s->n, 30);
    ck_assert_int_eq(s->req[14].input_len, 879);
    bw_schedule_free(s);
}
END_TEST

/* the file must be refused with "path:line: <reason>" */
static void bad(int (*load)(const char *), const char *name, const char *text, int line, const char *reason) {
    const char *p = write_tmp(name, text);
    int rc = load(p);
    ck_assert_msg(rc == CS_EFORMAT, "%s: rc %d (%s)", name, rc, cs_error_last());
    char want[700];
    snprintf(want, sizeof want, "%s:%d: ", p, line);
    const char *msg = cs_error_last();
    ck_assert_msg(strncmp(msg, want, strlen(want)) == 0, "%s: message '%s' does not start with '%s'", name, msg, want);
    ck_assert_msg(strstr(msg, reason) != NULL, "%s: message '%s' does not say '%s'", name, msg, reason);
}

static int load_azure(const char *p) {
    bw_trace_row_t *r = NULL;
    int n, rc = bw_trace_load_azure(p, &r, &n);
    free(r);
    return rc;
}

static int load_arrivals(const char *p) {
    double *t = NULL;
    int n, rc = bw_arrivals_load(p, &t, &n);
    free(t);
    return rc;
}

static int load_popularity(const char *p) {
    char **names = NULL;
    double *pr = NULL;
    int n, rc = bw_popularity_load(p, &names, &pr, &n);
    for (int i = 0; rc == 0 && i < n; i++) free(names[i]);
    free(names);
    free(pr);
    return rc;
}

static int load_schedule(const char *p) {
    bw_schedule_t *s = NULL;
    int rc = bw_schedule_load(p, &s);
    bw_schedule_free(s);
    return rc;
}

#define HDR "TIMESTAMP,ContextTokens,GeneratedTokens\n"
#define ROW "2023-11-16 18:15:46.6805900,374,44\n"

START_TEST(bad_rows_rejected) {
    bad(load_azure, "a1.csv", "time,in,out\n1,2,3\n", 1, "expected a header with TIMESTAMP");
    bad(load_azure, "a2.csv", HDR ROW "2023-13-16 18:15:47,10,10\n", 3, "bad TIMESTAMP '2023-13-16 18:15:47'");
    bad(load_azure, "a3.csv", HDR "\n# a comment\n" ROW "2023-11-16 18:15:47,abc,10\n", 5,
        "ContextTokens 'abc' is not a positive integer");
    bad(load_azure, "a4.csv", HDR ROW "2023-11-16 18:15:47,10,0\n", 3, "GeneratedTokens '0' is not a positive integer");
    bad(load_azure, "a5.csv", HDR ROW "2023-11-16 18:15:47,10\n", 3, "2 fields, the header has 3");
    bad(load_azure, "a6.csv", HDR ROW "2023-11-16 18:15:40,10,10\n", 3, "TIMESTAMP goes backwards");
    bad(load_azure, "a7.csv", HDR ROW "2023-11-16 18:15:47,10,-3\n", 3, "GeneratedTokens '-3'");
    bad(load_azure, "a8.csv", HDR "2023-11-16 25:00:00,10,3\n", 2, "bad TIMESTAMP");
    bad(load_azure, "a9.csv", HDR ROW "2023-11-16 18:15:47,1.5,3\n", 3, "ContextTokens '1.5'");
    ck_assert_int_eq(load_azure(write_tmp("a10.csv", "")), CS_EFORMAT);
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "empty file"));
    ck_assert_int_eq(load_azure(write_tmp("a11.csv", HDR)), CS_EFORMAT);
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "no rows after the header"));
    ck_assert_int_eq(load_azure("/nonexistent/trace.csv"), CS_EIO);
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "/nonexistent/trace.csv: "));

    bad(load_arrivals, "r1.csv", "arrival_s\n0.5\nsoon\n", 3, "'soon' is not a number of seconds");
    bad(load_arrivals, "r2.csv", "arrival_s\n0.5\n-1\n", 3, "negative arrival time -1");
    bad(load_arrivals, "r3.csv", "1\n2\n1.5\n", 3, "arrival time 1.5 goes backwards");
    bad(load_arrivals, "r4.csv", "arrival_s\n1,2\n", 2, "2 fields");
    double *t;
    int n;
    ck_assert_int_eq(bw_arrivals_load(data_path("maf-arrivals-128.csv"), &t, &n), CS_OK);
    ck_assert_int_eq(n, 434);
    ck_assert_double_eq(t[0], 0.25);
    ck_assert_double_eq(t[n - 1], 288);
    free(t);

    bad(load_popularity, "p1.csv", "adapter,probability\n0,0.5\n1,-0.1\n", 3, "negative probability -0.1");
    bad(load_popularity, "p2.csv", "adapter,probability\n0,0.5\n1,0.2,7\n", 3, "3 fields, expected adapter,probability");
    bad(load_popularity, "p3.csv", "adapter,probability\n0,0.5\n0,0.5\n", 3, "adapter '0' listed twice");
    bad(load_popularity, "p4.csv", "adapter,probability\n0,0.5\n1,lots\n", 3, "probability 'lots' is not a number");
    ck_assert_int_eq(load_popularity(write_tmp("p5.csv", "a,0\nb,0\n")), CS_EFORMAT);
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "sum to 0"));

    bad(load_schedule, "s1.csv", "id,t\n", 1, "expected the header id,arrival_s,model,rank,input_len,output_len,prompt_seed");
    bad(load_schedule, "s2.csv", "id,arrival_s,model,rank,input_len,output_len,prompt_seed\n0,0.5,a,8,10,0,1\n", 2,
        "output_len '0' is not a positive integer");
    bad(load_schedule, "s3.csv",
        "# comment\nid,arrival_s,model,rank,input_len,output_len,prompt_seed\n0,0.5,a,8,10,5,1\n1,0.6,a,16,10,5,2\n", 4,
        "adapter 'a' has rank 16 here and 8 before");
    bad(load_schedule, "s4.csv", "id,arrival_s,model,rank,input_len,output_len,prompt_seed\n0,0.5,,0,10,5,1\n1,0.4,,0,10,5,2\n",
        3, "arrival_s 0.4 goes backwards");
    bad(load_schedule, "s5.csv", "id,arrival_s,model,rank,input_len,output_len,prompt_seed\n0,0.5,,0,10,5,-1\n", 2,
        "bad prompt_seed '-1'");
}
END_TEST

START_TEST(spec_parsing) {
    bw_pop_spec_t p;
    ck_assert_int_eq(bw_pop_parse("zipf", &p), CS_OK);
    ck_assert_int_eq(p.kind, BW_POP_ZIPF);
    ck_assert_double_eq(p.param, 1.0);
    ck_assert_int_eq(bw_pop_parse("zipf:0.8", &p), CS_OK);
    ck_assert_double_eq(p.param, 0.8);
    ck_assert_int_eq(bw_pop_parse("round-robin", &p), CS_OK);
    ck_assert_int_eq(p.kind, BW_POP_ROUND_ROBIN);
    ck_assert_int_eq(bw_pop_parse("power", &p), CS_EINVAL);
    ck_assert_int_eq(bw_pop_parse("zipf:-1", &p), CS_EINVAL);
    ck_assert_int_eq(bw_pop_parse("zipf:x", &p), CS_EINVAL);
    ck_assert_int_eq(bw_pop_parse("gaussian", &p), CS_EINVAL);
    ck_assert_int_eq(bw_pop_parse("uniform:2", &p), CS_EINVAL);
    bw_adapter_t a;
    ck_assert_int_eq(bw_adapter_parse("sql-lora", &a), CS_OK);
    ck_assert_str_eq(a.name, "sql-lora");
    ck_assert_int_eq(a.rank, -1);
    ck_assert(a.weight < 0);
    free(a.name);
    ck_assert_int_eq(bw_adapter_parse("x:0", &a), CS_EINVAL);
    ck_assert_int_eq(bw_adapter_parse("x:8:-2", &a), CS_EINVAL);
    ck_assert_int_eq(bw_adapter_parse(":8", &a), CS_EINVAL);
    /* a schedule refuses what cannot be built */
    bw_config_t c = cfg(3, "trace"); /* trace popularity without a file or weights */
    bw_schedule_t *s;
    ck_assert_int_eq(bw_schedule_build(&c, &s), CS_EINVAL);
    c = cfg(3, NULL);
    c.base_fraction = 1.5;
    ck_assert_int_eq(bw_schedule_build(&c, &s), CS_EINVAL);
    c = cfg(3, NULL);
    c.arrival.kind = BW_ARRIVAL_TRACE; /* trace arrivals without a file */
    ck_assert_int_eq(bw_schedule_build(&c, &s), CS_EINVAL);
}
END_TEST

int main(void) {
    snprintf(tmpdir, sizeof tmpdir, "/tmp/cs_bench_wl_XXXXXX");
    if (!mkdtemp(tmpdir)) return 1;
    const TTest *const tests[] = {
        rng_reproducible, gamma_moments, arrival_rate_and_burstiness, arrival_modes, ramp_up,
        popularity_distributions, popularity_file_and_weights, base_fraction, rank_mix, reproducible_by_seed,
        prompts, azure_trace, bad_rows_rejected, spec_parsing,
    };
    int rc = cs_check_main("bench_workload", tests, CS_ARRAY_LEN(tests), 120, CK_FORK);
    if (cs_rmtree(tmpdir) != 0) fprintf(stderr, "could not remove %s\n", tmpdir);
    return rc;
}
