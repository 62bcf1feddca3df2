/* test_bench_metrics.c: caraserve-bench's metric definitions (bench/bench_metrics.c) on
 * synthetic timelines with answers worked out by hand: TTFT/E2EL/sched_ttft of one request,
 * TPOT with one output token (left out of TPOT, counted as 0 for goodput), ITL pooled over
 * requests (not averaged per request), numpy's percentiles and population std, goodput and SLO
 * attainment with failures as misses, vLLM's peaks (1 s buckets of tokens and of concurrent
 * requests from the first successful send) and our exact peak in flight, rollout mode (no TPOT
 * or ITL, a TPOT bound not applicable), per-adapter and per-rank breakdowns that add up, the
 * per-second time series, and the table, JSON, CSV and SVG outputs. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench_metrics.h"
#include "base/common.h"
#include "testutil.h"

#define TOL 1e-9

static bm_opts_t opts(void) {
    bm_opts_t o = {0};
    o.n_pct = 3;
    o.pct[0] = 50;
    o.pct[1] = 90;
    o.pct[2] = 99;
    o.slo = (bm_slo_t){-1, -1, -1};
    o.bucket_s = 1;
    return o;
}

/* a completed request: sent at `sent`, chunks at the given times (seconds) */
static bm_request_t done_req(int id, int adapter, int rank, double sched, double sent, int n, const double *chunks,
                             int out) {
    bm_request_t r = {0};
    r.id = id;
    r.adapter = adapter;
    r.rank = rank;
    r.input_len = 10;
    r.output_len = out;
    r.output_tokens = out;
    r.t_sched = sched;
    r.t_sent = sent;
    r.n_chunks = n;
    r.chunk_t = malloc((size_t)n * sizeof *r.chunk_t);
    r.chunk_tokens = malloc((size_t)n * sizeof *r.chunk_tokens);
    for (int i = 0; i < n; i++) {
        r.chunk_t[i] = chunks[i];
        r.chunk_tokens[i] = 1;
    }
    r.t_done = n ? chunks[n - 1] + 0.001 : sent;
    r.ok = true;
    return r;
}

static bm_request_t failed_req(int id, int adapter, int rank, double sched, double sent, double done) {
    bm_request_t r = {0};
    r.id = id;
    r.adapter = adapter;
    r.rank = rank;
    r.input_len = 10;
    r.output_len = 5;
    r.t_sched = sched;
    r.t_sent = sent;
    r.t_done = done;
    r.error = strdup("HTTP 500: boom");
    return r;
}

static void free_reqs(bm_request_t *r, int n) {
    for (int i = 0; i < n; i++) {
        free(r[i].chunk_t);
        free(r[i].chunk_tokens);
        free(r[i].error);
    }
}

static bm_result_t *compute(bm_request_t *r, int n, double duration, const bm_opts_t *o) {
    static const char *names[] = {"a0", "a1", "a2"};
    static const int ranks[] = {8, 16, 16};
    bm_result_t *res;
    ck_assert_int_eq(bm_compute(r, n, duration, o, names, ranks, 3, "base", &res), CS_OK);
    return res;
}

START_TEST(one_request) {
    double ch[] = {1.1, 1.15, 1.2, 1.3};
    bm_request_t r = done_req(0, 0, 8, 0.5, 1.0, 4, ch, 4);
    bm_latency_t l;
    ck_assert(bm_request_latency(&r, &l));
    ck_assert_double_eq_tol(l.ttft, 100, TOL);        /* first chunk - sent */
    ck_assert_double_eq_tol(l.e2el, 300, TOL);        /* last chunk - sent */
    ck_assert_double_eq_tol(l.tpot, 200.0 / 3, TOL);  /* (E2EL - TTFT) / (out - 1) */
    ck_assert_double_eq_tol(l.sched_ttft, 600, TOL);  /* first chunk - scheduled arrival */
    ck_assert(l.has_tpot);
    bm_opts_t o = opts();
    bm_result_t *res = compute(&r, 1, 2.0, &o);
    const bm_group_t *a = &res->all;
    ck_assert_int_eq(a->completed, 1);
    ck_assert_int_eq(a->failed, 0);
    ck_assert_double_eq_tol(a->ttft.mean, 100, TOL);
    ck_assert_double_eq_tol(a->e2el.median, 300, TOL);
    ck_assert_double_eq_tol(a->tpot.mean, 200.0 / 3, TOL);
    ck_assert_double_eq_tol(a->sched_ttft.mean, 600, TOL);
    ck_assert_int_eq(a->itl.n, 3); /* gaps 50, 50, 100 */
    ck_assert_double_eq_tol(a->itl.mean, 200.0 / 3, TOL);
    ck_assert_double_eq_tol(a->itl.median, 50, TOL);
    ck_assert_double_eq_tol(a->itl.pct[2], 99, TOL); /* numpy: 50 + (100 - 50) * 0.98 */
    ck_assert_double_eq_tol(a->request_throughput, 0.5, TOL);
    ck_assert_double_eq_tol(a->output_throughput, 2, TOL);
    ck_assert_double_eq_tol(a->total_token_throughput, 7, TOL);
    ck_assert_int_eq(a->input_tokens, 10);
    ck_assert_int_eq(a->output_tokens, 4);
    bm_result_free(res);
    free_reqs(&r, 1);
}
END_TEST

START_TEST(tpot_with_one_output_token) {
    double c1[] = {0.2}, c2[] = {0.3, 0.5}; /* the second: one token, then a chunk that only finishes */
    bm_request_t r[2] = {done_req(0, 0, 8, 0, 0, 1, c1, 1), done_req(1, 0, 8, 0, 0.1, 2, c2, 1)};
    bm_latency_t l;
    ck_assert(bm_request_latency(&r[0], &l));
    ck_assert(!l.has_tpot);
    ck_assert_double_eq(l.tpot, 0);
    bm_opts_t o = opts();
    bm_result_t *res = compute(r, 2, 1, &o);
    ck_assert_int_eq(res->all.tpot.n, 0); /* out = 1 is left out of TPOT ... */
    ck_assert_double_eq(res->all.tpot.mean, 0);
    ck_assert_int_eq(res->all.itl.n, 1);  /* ... but its chunk gaps are ITLs */
    ck_assert_double_eq_tol(res->all.itl.mean, 200, TOL);
    bm_result_free(res);
    /* ... and counts as TPOT 0 for goodput: good under any TPOT bound */
    o.has_slo = true;
    o.slo.tpot_ms = 1;
    ck_assert(bm_request_good(&r[0], &o.slo));
    res = compute(r, 2, 1, &o);
    ck_assert_int_eq(res->all.good, 2);
    ck_assert_double_eq_tol(res->all.attainment, 1, TOL);
    bm_result_free(res);
    o.slo.ttft_ms = 150; /* TTFTs 200 and 200 */
    res = compute(r, 2, 1, &o);
    ck_assert_int_eq(res->all.good, 0);
    bm_result_free(res);
    free_reqs(r, 2);
}
END_TEST

START_TEST(itl_pooled) {
    double c1[] = {0.10, 0.11, 0.13}, c2[] = {0.20, 0.23};
    bm_request_t r[2] = {done_req(0, 0, 8, 0, 0, 3, c1, 3), done_req(1, 1, 16, 0, 0, 2, c2, 2)};
    bm_opts_t o = opts();
    bm_result_t *res = compute(r, 2, 1, &o);
    /* gaps 10, 20 and 30: pooled mean 20 (the mean of per-request means would be 22.5) */
    ck_assert_int_eq(res->all.itl.n, 3);
    ck_assert_double_eq_tol(res->all.itl.mean, 20, 1e-6);
    ck_assert_double_eq_tol(res->all.itl.median, 20, 1e-6);
    ck_assert_double_eq_tol(res->all.itl.std, sqrt(200.0 / 3), 1e-6);
    /* TPOT per request: (130 - 100) / 2 = 15 and (230 - 200) / 1 = 30 */
    ck_assert_double_eq_tol(res->all.tpot.mean, 22.5, 1e-6);
    bm_result_free(res);
    free_reqs(r, 2);
}
END_TEST

START_TEST(numpy_statistics) {
    bm_opts_t o = opts();
    o.n_pct = 5;
    double p[] = {0, 25, 50, 99, 100};
    memcpy(o.pct, p, sizeof p);
    double v[] = {4, 1, 3, 2};
    bm_stat_t s;
    bm_stat_compute(v, 4, &o, &s);
    ck_assert_double_eq_tol(s.mean, 2.5, TOL);
    ck_assert_double_eq_tol(s.median, 2.5, TOL);
    ck_assert_double_eq_tol(s.std, sqrt(1.25), TOL); /* population std, numpy's default */
    ck_assert_double_eq_tol(s.pct[0], 1, TOL);
    ck_assert_double_eq_tol(s.pct[1], 1.75, TOL);
    ck_assert_double_eq_tol(s.pct[2], 2.5, TOL);
    ck_assert_double_eq_tol(s.pct[3], 3.97, TOL);
    ck_assert_double_eq_tol(s.pct[4], 4, TOL);
    ck_assert_double_eq_tol(s.max, 4, TOL);
    double one[] = {5};
    bm_stat_compute(one, 1, &o, &s);
    ck_assert_double_eq(s.pct[3], 5);
    ck_assert_double_eq(s.std, 0);
    bm_stat_compute(NULL, 0, &o, &s); /* vLLM: np.mean(x or 0) gives 0 */
    ck_assert_double_eq(s.mean, 0);
    ck_assert_double_eq(s.pct[3], 0);
    ck_assert_int_eq(s.n, 0);
    double w[] = {10, 20, 30, 40, 50, 60, 70, 80, 90, 100};
    ck_assert_double_eq_tol(bm_percentile(w, 10, 90), 91, TOL);
    ck_assert_double_eq_tol(bm_percentile(w, 10, 99.9), 99.91, TOL);
}
END_TEST

START_TEST(goodput_counts_failures) {
    /* A good; B within TTFT, over TPOT; C failed; D good. SLO ttft 500, tpot 50 */
    double ca[] = {1.1, 1.12, 1.14}, cb[] = {2.1, 2.2, 2.3}, cd[] = {3.2, 3.21};
    bm_request_t r[4] = {done_req(0, 0, 8, 1, 1, 3, ca, 3), done_req(1, 1, 16, 2, 2, 3, cb, 3),
                         failed_req(2, 1, 16, 2.5, 2.5, 2.6), done_req(3, -1, 0, 3, 3, 2, cd, 2)};
    bm_opts_t o = opts();
    o.has_slo = true;
    ck_assert_int_eq(bm_slo_parse("ttft:500", &o.slo), CS_OK);
    ck_assert_int_eq(bm_slo_parse("tpot:50", &o.slo), CS_OK);
    bm_result_t *res = compute(r, 4, 10, &o);
    const bm_group_t *a = &res->all;
    ck_assert_int_eq(a->requests, 4);
    ck_assert_int_eq(a->completed, 3);
    ck_assert_int_eq(a->failed, 1);
    ck_assert_int_eq(a->good, 2);
    ck_assert_double_eq_tol(a->request_goodput, 0.2, TOL);  /* vLLM: good / duration */
    ck_assert_double_eq_tol(a->attainment, 0.5, TOL);       /* good / (completed + failed) */
    ck_assert_double_eq_tol(a->attainment_ttft, 0.75, TOL); /* the failure misses every metric */
    ck_assert_double_eq_tol(a->attainment_tpot, 0.5, TOL);
    ck_assert_double_eq_tol(a->attainment_e2el, 0.75, TOL); /* no E2EL bound: every completed one */
    ck_assert_int_eq(a->output_tokens, 8);                  /* failures add no tokens, as vLLM */
    ck_assert_int_eq(a->input_tokens, 30);
    /* per adapter: the base model first, named, then every adapter (a2 had none) */
    ck_assert_int_eq(res->n_adapters, 4);
    ck_assert_str_eq(res->per_adapter[0].name, "base");
    ck_assert_int_eq(res->per_adapter[0].rank, 0);
    ck_assert_str_eq(res->per_adapter[2].name, "a1");
    ck_assert_int_eq(res->per_adapter[2].requests, 2);
    ck_assert_int_eq(res->per_adapter[2].failed, 1);
    ck_assert_double_eq_tol(res->per_adapter[2].attainment, 0, TOL);
    ck_assert_int_eq(res->per_adapter[3].requests, 0);
    int sum_req = 0, sum_ok = 0, sum_fail = 0, sum_good = 0;
    for (int i = 0; i < res->n_adapters; i++) {
        sum_req += res->per_adapter[i].requests;
        sum_ok += res->per_adapter[i].completed;
        sum_fail += res->per_adapter[i].failed;
        sum_good += res->per_adapter[i].good;
    }
    ck_assert_int_eq(sum_req, 4);
    ck_assert_int_eq(sum_ok, 3);
    ck_assert_int_eq(sum_fail, 1);
    ck_assert_int_eq(sum_good, 2);
    /* per rank: base (0), 8, 16 in that order, adding up too */
    ck_assert_int_eq(res->n_ranks, 3);
    ck_assert_int_eq(res->per_rank[0].rank, 0);
    ck_assert_int_eq(res->per_rank[1].rank, 8);
    ck_assert_int_eq(res->per_rank[2].rank, 16);
    ck_assert_str_eq(res->per_rank[2].name, "rank 16");
    ck_assert_int_eq(res->per_rank[2].requests, 2);
    ck_assert_int_eq(res->per_rank[0].completed + res->per_rank[1].completed + res->per_rank[2].completed, 3);
    bm_result_free(res);
    /* without --goodput: no goodput, attainment is the completed share */
    o = opts();
    res = compute(r, 4, 10, &o);
    ck_assert_int_eq(res->all.good, 0);
    ck_assert_double_eq_tol(res->all.attainment, 0.75, TOL);
    bm_result_free(res);
    free_reqs(r, 4);
}
END_TEST

/* every one of PARTS[0..n) is in TEXT; WHAT names TEXT in a failure */
static void expect_parts(const char *what, const char *text, const char *const *parts, size_t n) {
    for (size_t i = 0; i < n; i++) ck_assert_msg(strstr(text, parts[i]) != NULL, "%s lacks [%s]", what, parts[i]);
}

/* The peaks of R[0..n) over DURATION seconds with the default options: vLLM's concurrent
 * requests CONC, ours at one instant EXACT and, unless TOKENS_PER_S < 0, vLLM's output tokens
 * per second; WHAT names the case in a failure. */
static void expect_peaks(const char *what, bm_request_t *r, int n, double duration, int conc, int exact,
                         double tokens_per_s) {
    bm_opts_t o = opts();
    bm_result_t *res = compute(r, n, duration, &o);
    ck_assert_msg(res->max_concurrent_requests == conc, "%s: max_concurrent_requests %d, want %d", what,
                  res->max_concurrent_requests, conc);
    ck_assert_msg(res->max_concurrent_requests_exact == exact, "%s: max_concurrent_requests_exact %d, want %d", what,
                  res->max_concurrent_requests_exact, exact);
    if (tokens_per_s >= 0)
        ck_assert_msg(res->max_output_tokens_per_s == tokens_per_s, "%s: max_output_tokens_per_s %g, want %g", what,
                      res->max_output_tokens_per_s, tokens_per_s);
    bm_result_free(res);
}

START_TEST(peaks_as_vllm) {
    /* r0 [0, 1.2), r1 [1.2, 1.7), r2 [0.1, 0.2), r3 [1.75, 1.9); the failure counts nowhere.
     * vLLM's buckets from the first successful send (0): a request counts in every second from
     * that of its send to that of its end, both included: second 0 has r0 and r2, second 1 has
     * r0, r1 and r3 -> 3, although at most two (r0 and r2) are ever in flight at one instant
     * (touching half-open intervals do not overlap). Chunks per second: [0.2, 0.5, 0.6] -> 3,
     * [1.2, 1.5, 1.7] and r3's 1.8, 1.9 -> 5. */
    double c0[] = {0.5, 0.6, 1.2}, c1[] = {1.5, 1.7}, c2[] = {0.2}, c3[] = {1.8, 1.9};
    bm_request_t r[5] = {done_req(0, 0, 8, 0, 0, 3, c0, 3), done_req(1, 0, 8, 1.2, 1.2, 2, c1, 2),
                         done_req(2, 0, 8, 0.1, 0.1, 1, c2, 1), done_req(3, 0, 8, 1.75, 1.75, 2, c3, 2),
                         failed_req(4, 0, 8, 0.3, 0.3, 0.9)};
    expect_peaks("r0-r4", r, 5, 2, 3, 2, 5);
    /* r0 and r1 alone touch at 1.2: both in second 1, never two at once; tokens [0.5, 0.6] and
     * [1.2, 1.5, 1.7] */
    expect_peaks("r0, r1", r, 2, 2, 2, 1, 3);
    free_reqs(r, 5);

    /* [0, 0.4) and [0.5, 0.9): one after the other, in the same second -> 2 (exact: 1) */
    double d0[] = {0.2, 0.4}, d1[] = {0.7, 0.9};
    bm_request_t q[2] = {done_req(0, 0, 8, 0, 0, 2, d0, 2), done_req(1, 0, 8, 0.5, 0.5, 2, d1, 2)};
    expect_peaks("one after the other", q, 2, 1, 2, 1, -1);
    free_reqs(q, 2);

    /* the seconds count from the first successful send, not from 0: [0.6, 0.9) and [1.1, 1.4)
     * are 0.0-0.3 and 0.5-0.8 after it, one bucket -> 2 (whole seconds of the clock would give 1) */
    double e0[] = {0.9}, e1[] = {1.4};
    bm_request_t u[3] = {done_req(0, 0, 8, 0.6, 0.6, 1, e0, 1), done_req(1, 0, 8, 1.1, 1.1, 1, e1, 1),
                         failed_req(2, 0, 8, 0, 0, 0.05)};
    expect_peaks("from the first successful send", u, 3, 2, 2, 1, -1);
    free_reqs(u, 3);

    /* an end exactly on a bucket's start counts in it: [0, 1) and [1, 1.5) -> 2 (exact: 1);
     * [0, 0.5) and [1.5, 2): seconds 0 and 1 -> 1 */
    double f0[] = {0.5, 1.0}, f1[] = {1.2, 1.5}, g0[] = {0.5}, g1[] = {2.0};
    bm_request_t v[2] = {done_req(0, 0, 8, 0, 0, 2, f0, 2), done_req(1, 0, 8, 1, 1, 2, f1, 2)};
    expect_peaks("an end on a bucket's start", v, 2, 2, 2, 1, -1);
    free_reqs(v, 2);
    bm_request_t w[2] = {done_req(0, 0, 8, 0, 0, 1, g0, 1), done_req(1, 0, 8, 1.5, 1.5, 1, g1, 1)};
    expect_peaks("seconds 0 and 1", w, 2, 2, 1, 1, -1);
    free_reqs(w, 2);
}
END_TEST

/* rollout mode: a chunk is a whole group, so TPOT and ITL are not measured; a TPOT bound is
 * reported as not applicable instead of passing, and goodput uses the other bounds */
START_TEST(rollout_no_token_timing) {
    /* two calls of 2 groups: r0 groups at 0.5 and 0.6 (10 tokens), r1 at 1.5 and 3.0; r2 failed */
    double c0[] = {0.5, 0.6}, c1[] = {1.5, 3.0};
    bm_request_t r[3] = {done_req(0, 0, 8, 0, 0, 2, c0, 10), done_req(1, 1, 16, 1, 1, 2, c1, 10),
                         failed_req(2, 1, 16, 1, 1, 1.1)};
    for (int i = 0; i < 2; i++) r[i].chunk_tokens[0] = r[i].chunk_tokens[1] = 5;
    bm_opts_t o = opts();
    o.no_token_timing = true;
    o.has_slo = true;
    o.slo.tpot_ms = 0.001; /* would fail every request if it were measured, pass all if TPOT were 0 */
    o.slo.e2el_ms = 1000;  /* E2ELs 600 and 2000 */
    bm_result_t *res = compute(r, 3, 4, &o);
    const bm_group_t *a = &res->all;
    ck_assert_int_eq(a->completed, 2);
    ck_assert_int_eq(a->tpot.n, 0);
    ck_assert_int_eq(a->itl.n, 0);
    ck_assert_double_eq_tol(a->ttft.mean, 500, 1e-6);
    ck_assert_int_eq(a->good, 1);                          /* r0 alone meets the E2EL bound */
    ck_assert_double_eq_tol(a->attainment, 1.0 / 3, TOL);
    ck_assert_double_eq_tol(res->tpot_bound_na, 0.001, TOL);
    ck_assert_double_lt(res->opts.slo.tpot_ms, 0);         /* not applied */
    ck_assert_double_eq(res->max_output_tokens_per_s, 10); /* group tokens per second: 10 in second 0 */
    json_t *j = bm_result_json(res, r, 3, true);
    ck_assert(json_is_null(json_object_get(j, "mean_tpot_ms")));
    ck_assert(json_is_null(json_object_get(j, "p99_tpot_ms")));
    ck_assert(json_is_null(json_object_get(j, "median_itl_ms")));
    ck_assert(json_is_real(json_object_get(j, "mean_ttft_ms")));
    ck_assert_str_eq(json_string_value(json_object_get(j, "tpot_itl")), BM_NO_TOKEN_TIMING_NOTE);
    json_t *att = json_object_get(j, "slo_attainment"), *slo = json_object_get(j, "slo");
    ck_assert(json_is_null(json_object_get(att, "tpot")));
    ck_assert_ptr_nonnull(json_object_get(att, "tpot")); /* present, null */
    ck_assert_double_eq_tol(json_real_value(json_object_get(att, "e2el")), 1.0 / 3, TOL);
    ck_assert_double_eq_tol(json_real_value(json_object_get(slo, "tpot_ms")), 0.001, TOL);
    ck_assert_str_eq(json_string_value(json_array_get(json_object_get(slo, "not_applicable"), 0)), "tpot");
    ck_assert(json_is_null(json_array_get(json_object_get(j, "itls"), 0)));
    json_t *pa = json_array_get(json_object_get(j, "per_adapter"), 0);
    ck_assert(json_is_null(json_object_get(pa, "mean_tpot_ms")));
    ck_assert(json_is_null(json_object_get(json_object_get(pa, "slo_attainment"), "tpot")));
    json_decref(j);
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    bm_table_opts_t t = {BM_TTFT | BM_TPOT | BM_ITL | BM_E2EL, 0, INFINITY, true, false};
    bm_print_table(f, res, &t);
    fclose(f);
    ck_assert_ptr_null(strstr(buf, "Mean TPOT"));
    ck_assert_ptr_null(strstr(buf, "Mean ITL"));
    ck_assert_ptr_nonnull(strstr(buf, "\nTPOT, ITL:                               " BM_NO_TOKEN_TIMING_NOTE "\n"));
    ck_assert_ptr_nonnull(strstr(buf, "\n  TPOT attainment (%):                   n/a"));
    ck_assert_ptr_nonnull(strstr(buf, "(tpot<=0.001: n/a)"));
    free(buf);
    bm_result_free(res);
    /* the same timelines as completions: the bound applies (TPOTs 100/9 and 1500/9 ms) */
    o.no_token_timing = false;
    res = compute(r, 3, 4, &o);
    ck_assert_int_eq(res->all.good, 0);
    ck_assert_int_eq(res->all.tpot.n, 2);
    ck_assert_double_lt(res->tpot_bound_na, 0);
    bm_result_free(res);
    free_reqs(r, 3);
}
END_TEST

START_TEST(time_series) {
    double c0[] = {0.5, 0.9}, c1[] = {1.5, 2.5}, c2[] = {2.2};
    bm_request_t r[4] = {done_req(0, 0, 8, 0.1, 0.1, 2, c0, 2), done_req(1, 0, 8, 0.2, 1.0, 2, c1, 2),
                         done_req(2, 1, 16, 1.5, 1.5, 1, c2, 1), failed_req(3, 1, 16, 1.6, 1.6, 1.7)};
    bm_opts_t o = opts();
    o.has_slo = true;
    o.slo.ttft_ms = 600; /* TTFTs: 400, 500, 700 */
    bm_result_t *res = compute(r, 4, 2.6, &o);
    ck_assert_int_eq(res->n_buckets, 3);
    const bm_bucket_t *b = res->ts;
    ck_assert_int_eq(b[0].arrivals, 2);
    ck_assert_int_eq(b[1].arrivals, 2);
    ck_assert_int_eq(b[2].arrivals, 0);
    ck_assert_int_eq(b[0].completed, 1); /* r0 done at 0.9; r1 at 2.5; r2 at 2.2 */
    ck_assert_int_eq(b[2].completed, 2);
    ck_assert_int_eq(b[1].failed, 1);
    ck_assert_int_eq(b[0].output_tokens, 2);
    ck_assert_int_eq(b[1].output_tokens, 1);
    ck_assert_int_eq(b[2].output_tokens, 2);
    ck_assert_int_eq(b[0].max_concurrency, 1); /* r0 [0.1, 0.901); r1 from 1.0 */
    ck_assert_int_eq(b[1].max_concurrency, 3); /* r1, r2 [1.5, 2.201), r3 [1.6, 1.7) */
    ck_assert_int_eq(b[2].max_concurrency, 2);
    ck_assert_int_eq(b[0].slo_requests, 2);    /* scheduled in second 0: r0 good, r1 good */
    ck_assert_int_eq(b[0].slo_good, 2);
    ck_assert_int_eq(b[1].slo_requests, 2);    /* second 1: r2 over the TTFT bound, r3 failed */
    ck_assert_int_eq(b[1].slo_good, 0);
    ck_assert_double_eq_tol(b[0].mean_ttft_ms, 450, 1e-6);
    bm_result_free(res);
    free_reqs(r, 4);
}
END_TEST

START_TEST(outputs) {
    double c0[] = {0.5, 0.6, 0.7}, c1[] = {1.2, 1.4};
    bm_request_t r[3] = {done_req(0, 0, 8, 0, 0.1, 3, c0, 3), done_req(1, -1, 0, 1, 1, 2, c1, 2),
                         failed_req(2, 1, 16, 1.5, 1.5, 1.6)};
    bm_opts_t o = opts();
    o.has_slo = true;
    o.slo.e2el_ms = 1000;
    bm_result_t *res = compute(r, 3, 2, &o);
    /* JSON: vLLM's keys and ours */
    json_t *j = bm_result_json(res, r, 3, true);
    static const char *keys[] = {"duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                                 "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
                                 "max_output_tokens_per_s", "max_concurrent_requests", "max_concurrent_requests_exact",
                                 "mean_ttft_ms", "median_ttft_ms",
                                 "std_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p90_itl_ms", "mean_e2el_ms",
                                 "mean_sched_ttft_ms", "schema_version", "slo", "slo_attainment", "per_adapter",
                                 "per_rank", "timeseries", "input_lens", "output_lens", "ttfts", "itls", "latencies",
                                 "start_times", "errors"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        ck_assert_msg(json_object_get(j, keys[i]) != NULL, "no key %s", keys[i]);
    ck_assert_int_eq(json_integer_value(json_object_get(j, "completed")), 2);
    ck_assert_int_eq(json_integer_value(json_object_get(j, "failed")), 1);
    ck_assert_double_eq_tol(json_real_value(json_object_get(j, "mean_ttft_ms")), 300, 1e-6); /* 400 and 200 */
    ck_assert_double_eq_tol(json_real_value(json_object_get(json_object_get(j, "slo"), "e2el_ms")), 1000, TOL);
    ck_assert_double_eq_tol(json_real_value(json_object_get(json_object_get(j, "slo_attainment"), "all")), 2.0 / 3, TOL);
    ck_assert_int_eq(json_array_size(json_object_get(j, "per_adapter")), 4);
    ck_assert_int_eq(json_array_size(json_object_get(j, "ttfts")), 3);
    ck_assert_int_eq(json_array_size(json_array_get(json_object_get(j, "itls"), 0)), 2);
    ck_assert_str_eq(json_string_value(json_array_get(json_object_get(j, "errors"), 2)), "HTTP 500: boom");
    json_decref(j);
    o.has_slo = false;
    bm_result_t *r2 = compute(r, 3, 2, &o);
    j = bm_result_json(r2, r, 3, false);
    ck_assert(json_is_null(json_object_get(j, "request_goodput"))); /* vLLM: None without --goodput */
    ck_assert_ptr_null(json_object_get(j, "ttfts"));
    json_decref(j);
    bm_result_free(r2);

    /* the table: vLLM's layout */
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    bm_table_opts_t t = {BM_TTFT | BM_TPOT | BM_ITL | BM_E2EL, 4, 2.0, true, true};
    bm_print_table(f, res, &t);
    fclose(f);
    static const char *const table[] = {
        "============ Serving Benchmark Result ============\n",
        "\nSuccessful requests:                     2         \n",
        "\nFailed requests:                         1         \n",
        "\nMaximum request concurrency:             4         \n",
        "\nRequest rate configured (RPS):           2.00      \n",
        "\nRequest throughput (req/s):              1.00      \n",
        /* r0 [0.1, 0.7) and r1 [1, 1.4) both touch the first second after 0.1: vLLM says 2 */
        "\nPeak concurrent requests:                2.00      \n",
        "\nPeak requests in flight at one instant:  1         \n",
        "\n---------------Time to First Token----------------\n",
        "\n-----Time per Output Token (excl. 1st token)------\n",
        "\nMean TTFT (ms):                          300.00    \n",
        "\nP99 TTFT (ms):                           ",
        "\nSLO attainment (%):                      66.67     \n",
        "\na0 ",
        "\nrank 16 ",
        "\n==================================================\n",
    };
    expect_parts("the table", buf, table, CS_ARRAY_LEN(table));
    free(buf);

    char dir[] = "/tmp/cs_bench_m_XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(dir));
    char csv[128], svg[128];
    snprintf(csv, sizeof csv, "%s/r.csv", dir);
    snprintf(svg, sizeof svg, "%s/p.svg", dir);
    static const char *names[] = {"a0", "a1", "a2"};
    ck_assert_int_eq(bm_write_requests_csv(csv, res, r, 3, names, "base"), CS_OK);
    ck_assert_int_eq(bm_write_svg(svg, res, r, 3, "test <plot> & co"), CS_OK);
    size_t n;
    char *text = cs_read_file(csv, &n);
    ck_assert_ptr_nonnull(text);
    int lines = 0;
    for (char *p = text; *p; p++) lines += *p == '\n';
    ck_assert_int_eq(lines, 4);
    ck_assert_ptr_nonnull(strstr(text, "\n1,base,0,10,2,2,"));
    ck_assert_ptr_nonnull(strstr(text, ",0,0,HTTP 500: boom\n"));
    free(text);
    text = cs_read_file(svg, &n);
    ck_assert_ptr_nonnull(text);
    ck_assert(strncmp(text, "<?xml", 5) == 0);
    static const char *const svg_parts[] = {"</svg>\n", "TTFT CDF by rank", "SLO attainment over time",
                                            "test &lt;plot&gt; &amp; co", "<polyline"};
    expect_parts("the SVG", text, svg_parts, CS_ARRAY_LEN(svg_parts));
    free(text);
    remove(csv);
    remove(svg);
    remove(dir);
    bm_result_free(res);
    free_reqs(r, 3);
}
END_TEST

START_TEST(flag_parsing) {
    int m;
    ck_assert_int_eq(bm_metrics_parse("ttft,e2el", &m), CS_OK);
    ck_assert_int_eq(m, BM_TTFT | BM_E2EL);
    ck_assert_int_eq(bm_metrics_parse("ttft,foo", &m), CS_EINVAL);
    bm_slo_t s = {-1, -1, -1};
    ck_assert_int_eq(bm_slo_parse("e2el:2500.5", &s), CS_OK);
    ck_assert_double_eq(s.e2el_ms, 2500.5);
    ck_assert_double_lt(s.ttft_ms, 0);
    ck_assert_int_eq(bm_slo_parse("ttft", &s), CS_EINVAL);
    ck_assert_int_eq(bm_slo_parse("ttft:-1", &s), CS_EINVAL);
    ck_assert_int_eq(bm_slo_parse("itl:5", &s), CS_EINVAL);
    ck_assert_int_eq(bm_slo_parse("tpot:", &s), CS_EINVAL);
}
END_TEST

int main(void) {
    const TTest *const tests[] = {
        one_request, tpot_with_one_output_token, itl_pooled, numpy_statistics, goodput_counts_failures,
        peaks_as_vllm, rollout_no_token_timing, time_series, outputs, flag_parsing,
    };
    return cs_check_main("bench_metrics", tests, CS_ARRAY_LEN(tests), 0, CK_FORK);
}
