/* test_metrics.c: the Prometheus registry. Counters, gauges, histograms and summaries with
 * and without labels rendered to exact text; cumulative buckets; escaping and invalid UTF-8;
 * numbers that read back exactly; remove; folding a label value into another; registration
 * errors; several threads updating (and folding) while one renders (the sums must be exact);
 * and a representative registry checked by `promtool check metrics` when promtool is on
 * PATH. */
#include <check.h>
#include <locale.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/common.h"
#include "server/metrics.h"
#include "testutil.h"

static char *render(metrics_t *m) {
    size_t len = 0;
    char *s = metrics_render(m, &len);
    ck_assert_ptr_nonnull(s);
    ck_assert_uint_eq(len, strlen(s));
    return s;
}

/* M renders exactly as WANT */
static void expect_render(metrics_t *m, const char *want) {
    char *s = render(m);
    ck_assert_str_eq(s, want);
    free(s);
}

/* The value of the sample line that starts with `series ` (the full name and label set);
 * fails the test if there is not exactly one. */
static double sample(const char *text, const char *series) {
    size_t n = strlen(series);
    const char *found = NULL;
    for (const char *line = text; *line;) {
        const char *eol = strchr(line, '\n');
        ck_assert_msg(eol, "unterminated last line");
        if ((size_t)(eol - line) > n && !strncmp(line, series, n) && line[n] == ' ') {
            ck_assert_msg(!found, "series %s twice", series);
            found = line + n + 1;
        }
        line = eol + 1;
    }
    ck_assert_msg(found, "no series %s in:\n%s", series, text);
    char *end;
    double v = strtod(found, &end);
    ck_assert_msg(end > found && *end == '\n', "bad value for %s", series);
    return v;
}

static int count_lines_with(const char *text, const char *needle) {
    int n = 0;
    for (const char *p = text; (p = strstr(p, needle)); p++) n++;
    return n;
}

START_TEST(test_counter_gauge_no_labels) {
    metrics_t *m = metrics_new();
    ck_assert_ptr_nonnull(m);
    metric_t *c = metrics_counter(m, "caraserve_prompt_tokens", "Prompt tokens processed.", NULL);
    metric_t *c2 = metrics_counter(m, "caraserve_requests_total", "Requests.", NULL);
    metric_t *g = metrics_gauge(m, "caraserve_num_requests_running", "Requests running.", NULL);
    ck_assert_ptr_nonnull(c);
    ck_assert_ptr_nonnull(c2);
    ck_assert_ptr_nonnull(g);
    /* exposed at 0 before the first update; "_total" added once */
    expect_render(m, "# HELP caraserve_prompt_tokens_total Prompt tokens processed.\n"
                  "# TYPE caraserve_prompt_tokens_total counter\n"
                  "caraserve_prompt_tokens_total 0\n"
                  "# HELP caraserve_requests_total Requests.\n"
                  "# TYPE caraserve_requests_total counter\n"
                  "caraserve_requests_total 0\n"
                  "# HELP caraserve_num_requests_running Requests running.\n"
                  "# TYPE caraserve_num_requests_running gauge\n"
                  "caraserve_num_requests_running 0\n");
    metric_inc(c, NULL, 3);
    metric_inc(c, NULL, 0.5);
    metric_inc(c2, NULL, 1);
    metric_set(g, NULL, 7);
    metric_inc(g, NULL, -2);
    char *s = render(m);
    ck_assert(sample(s, "caraserve_prompt_tokens_total") == 3.5);
    ck_assert(sample(s, "caraserve_requests_total") == 1);
    ck_assert(sample(s, "caraserve_num_requests_running") == 5);
    ck_assert_ptr_nonnull(strstr(s, "caraserve_num_requests_running 5\n"));
    free(s);
    metrics_free(m);
    metrics_free(NULL);
}
END_TEST

START_TEST(test_labels) {
    metrics_t *m = metrics_new();
    const char *names[] = {"adapter", "finished_reason", NULL};
    metric_t *c = metrics_counter(m, "caraserve_request_success", "Finished requests.", names);
    ck_assert_ptr_nonnull(c);
    /* no series yet: HELP and TYPE only */
    expect_render(m, "# HELP caraserve_request_success_total Finished requests.\n"
                  "# TYPE caraserve_request_success_total counter\n");
    metric_inc(c, (const char *[]){"r16", "stop"}, 1);
    metric_inc(c, (const char *[]){"base", "length"}, 2);
    metric_inc(c, (const char *[]){"r16", "stop"}, 4);
    metric_inc(c, (const char *[]){"r16", "length"}, 1);
    /* the hash separates values: ("ab","c") is not ("a","bc") */
    metric_inc(c, (const char *[]){"ab", "c"}, 1);
    metric_inc(c, (const char *[]){"a", "bc"}, 2);
    expect_render(m, "# HELP caraserve_request_success_total Finished requests.\n"
                  "# TYPE caraserve_request_success_total counter\n"
                  "caraserve_request_success_total{adapter=\"r16\",finished_reason=\"stop\"} 5\n"
                  "caraserve_request_success_total{adapter=\"base\",finished_reason=\"length\"} 2\n"
                  "caraserve_request_success_total{adapter=\"r16\",finished_reason=\"length\"} 1\n"
                  "caraserve_request_success_total{adapter=\"ab\",finished_reason=\"c\"} 1\n"
                  "caraserve_request_success_total{adapter=\"a\",finished_reason=\"bc\"} 2\n");

    /* many series: the hash table grows, every one still found */
    metric_t *g = metrics_gauge(m, "caraserve_lora_adapter_rank", "Rank of each loaded adapter.",
                                (const char *[]){"adapter", NULL});
    char name[32];
    for (int i = 0; i < 1000; i++) {
        snprintf(name, sizeof name, "adapter-%d", i);
        metric_set(g, (const char *[]){name}, i);
    }
    for (int i = 0; i < 1000; i++) {
        snprintf(name, sizeof name, "adapter-%d", i);
        metric_inc(g, (const char *[]){name}, 0.5);
    }
    char *s = render(m);
    for (int i = 0; i < 1000; i++) {
        char series[64];
        snprintf(series, sizeof series, "caraserve_lora_adapter_rank{adapter=\"adapter-%d\"}", i);
        ck_assert(sample(s, series) == i + 0.5);
    }
    /* creation order */
    ck_assert(strstr(s, "\"adapter-9\"") < strstr(s, "\"adapter-10\""));
    free(s);
    metrics_free(m);
}
END_TEST

START_TEST(test_histogram) {
    metrics_t *m = metrics_new();
    const double b[] = {0.005, 0.01, 0.5, 1, 2.5};
    metric_t *h = metrics_histogram(m, "caraserve_time_to_first_token_seconds", "Time to first token.", NULL, b, 5);
    ck_assert_ptr_nonnull(h);
    expect_render(m, "# HELP caraserve_time_to_first_token_seconds Time to first token.\n"
                  "# TYPE caraserve_time_to_first_token_seconds histogram\n"
                  "caraserve_time_to_first_token_seconds_bucket{le=\"0.005\"} 0\n"
                  "caraserve_time_to_first_token_seconds_bucket{le=\"0.01\"} 0\n"
                  "caraserve_time_to_first_token_seconds_bucket{le=\"0.5\"} 0\n"
                  "caraserve_time_to_first_token_seconds_bucket{le=\"1\"} 0\n"
                  "caraserve_time_to_first_token_seconds_bucket{le=\"2.5\"} 0\n"
                  "caraserve_time_to_first_token_seconds_bucket{le=\"+Inf\"} 0\n"
                  "caraserve_time_to_first_token_seconds_sum 0\n"
                  "caraserve_time_to_first_token_seconds_count 0\n");
    /* bounds are inclusive (le); above every bound only +Inf counts it */
    const double obs[] = {0.001, 0.005, 0.0050001, 0.25, 1, 1, 2.5, 3, 100};
    double sum = 0;
    for (size_t i = 0; i < sizeof obs / sizeof *obs; i++) {
        metric_observe(h, NULL, obs[i]);
        sum += obs[i];
    }
    char *s = render(m);
    ck_assert(sample(s, "caraserve_time_to_first_token_seconds_sum") == sum);
    ck_assert(sample(s, "caraserve_time_to_first_token_seconds_count") == 9);
    *strstr(s, "caraserve_time_to_first_token_seconds_sum ") = 0;
    ck_assert_str_eq(s, "# HELP caraserve_time_to_first_token_seconds Time to first token.\n"
                        "# TYPE caraserve_time_to_first_token_seconds histogram\n"
                        "caraserve_time_to_first_token_seconds_bucket{le=\"0.005\"} 2\n"
                        "caraserve_time_to_first_token_seconds_bucket{le=\"0.01\"} 3\n"
                        "caraserve_time_to_first_token_seconds_bucket{le=\"0.5\"} 4\n"
                        "caraserve_time_to_first_token_seconds_bucket{le=\"1\"} 6\n"
                        "caraserve_time_to_first_token_seconds_bucket{le=\"2.5\"} 7\n"
                        "caraserve_time_to_first_token_seconds_bucket{le=\"+Inf\"} 9\n");
    free(s);

    /* with labels; a trailing +Inf bound is accepted and not doubled; no bounds at all */
    const double b2[] = {1, 2, INFINITY};
    const char *names[] = {"adapter", NULL};
    metric_t *h2 = metrics_histogram(m, "caraserve_request_prompt_tokens", "Prompt length.", names, b2, 3);
    metric_t *h3 = metrics_histogram(m, "caraserve_request_wait_seconds", "Wait.", NULL, NULL, 0);
    ck_assert_ptr_nonnull(h2);
    ck_assert_ptr_nonnull(h3);
    metric_observe(h2, (const char *[]){"x"}, 2);
    metric_observe(h2, (const char *[]){"y"}, 0);
    metric_observe(h2, (const char *[]){"x"}, 7);
    metric_observe(h3, NULL, 0.25);
    s = render(m);
    const char *want2 = "# HELP caraserve_request_prompt_tokens Prompt length.\n"
                        "# TYPE caraserve_request_prompt_tokens histogram\n"
                        "caraserve_request_prompt_tokens_bucket{adapter=\"x\",le=\"1\"} 0\n"
                        "caraserve_request_prompt_tokens_bucket{adapter=\"x\",le=\"2\"} 1\n"
                        "caraserve_request_prompt_tokens_bucket{adapter=\"x\",le=\"+Inf\"} 2\n"
                        "caraserve_request_prompt_tokens_sum{adapter=\"x\"} 9\n"
                        "caraserve_request_prompt_tokens_count{adapter=\"x\"} 2\n"
                        "caraserve_request_prompt_tokens_bucket{adapter=\"y\",le=\"1\"} 1\n"
                        "caraserve_request_prompt_tokens_bucket{adapter=\"y\",le=\"2\"} 1\n"
                        "caraserve_request_prompt_tokens_bucket{adapter=\"y\",le=\"+Inf\"} 1\n"
                        "caraserve_request_prompt_tokens_sum{adapter=\"y\"} 0\n"
                        "caraserve_request_prompt_tokens_count{adapter=\"y\"} 1\n"
                        "# HELP caraserve_request_wait_seconds Wait.\n"
                        "# TYPE caraserve_request_wait_seconds histogram\n"
                        "caraserve_request_wait_seconds_bucket{le=\"+Inf\"} 1\n"
                        "caraserve_request_wait_seconds_sum 0.25\n"
                        "caraserve_request_wait_seconds_count 1\n";
    ck_assert_ptr_nonnull(strstr(s, want2));
    ck_assert_str_eq(strstr(s, want2), want2);
    free(s);

    /* NaN counts (only in +Inf) and poisons the sum, as in the Go client */
    metric_observe(h3, NULL, NAN);
    s = render(m);
    ck_assert_ptr_nonnull(strstr(s, "caraserve_request_wait_seconds_bucket{le=\"+Inf\"} 2\n"
                                    "caraserve_request_wait_seconds_sum NaN\n"
                                    "caraserve_request_wait_seconds_count 2\n"));
    free(s);
    metrics_free(m);
}
END_TEST

/* Random observations: every bucket is the number of observations <= its bound, the
 * buckets never decrease, +Inf equals the count. */
START_TEST(test_histogram_cumulative) {
    metrics_t *m = metrics_new();
    const double b[] = {0.1, 0.2, 0.4, 0.8, 1.6, 3.2};
    metric_t *h = metrics_histogram(m, "x_seconds", "X.", NULL, b, 6);
    int want[6] = {0}, n = 5000;
    unsigned seed = 12345;
    double sum = 0;
    for (int i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        double v = (double)(seed >> 8 & 0xffff) / 16384.0; /* [0, 4), multiples of 2^-14 */
        metric_observe(h, NULL, v);
        sum += v;
        for (int k = 0; k < 6; k++) want[k] += v <= b[k];
    }
    char *s = render(m);
    double prev = 0;
    for (int k = 0; k < 6; k++) {
        char series[64];
        snprintf(series, sizeof series, "x_seconds_bucket{le=\"%g\"}", b[k]);
        double got = sample(s, series);
        ck_assert_msg(got == want[k], "%s: %g, want %d", series, got, want[k]);
        ck_assert(got >= prev);
        prev = got;
    }
    ck_assert(sample(s, "x_seconds_bucket{le=\"+Inf\"}") == n);
    ck_assert(sample(s, "x_seconds_count") == n);
    ck_assert(sample(s, "x_seconds_sum") == sum); /* exact: all terms are dyadic */
    free(s);
    metrics_free(m);
}
END_TEST

START_TEST(test_escaping) {
    metrics_t *m = metrics_new();
    metric_t *g = metrics_gauge(m, "caraserve_info", "Help with \\ backslash,\nnewline and \"quotes\".",
                                (const char *[]){"name", NULL});
    static const char *const names[] = {
        "a\\b\"c\nd",
        "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80", /* valid UTF-8 kept */
        "bad\xff" "x\xc3",                              /* invalid: U+FFFD */
        "\xc0\xaf\xed\xa0\x80",                         /* overlong '/', a surrogate */
        "",
    };
    for (int i = 0; i < (int)CS_ARRAY_LEN(names); i++) metric_set(g, &names[i], i + 1);
    expect_render(m, "# HELP caraserve_info Help with \\\\ backslash,\\nnewline and \"quotes\".\n"
                  "# TYPE caraserve_info gauge\n"
                  "caraserve_info{name=\"a\\\\b\\\"c\\nd\"} 1\n"
                  "caraserve_info{name=\"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80\"} 2\n"
                  "caraserve_info{name=\"bad\xef\xbf\xbdx\xef\xbf\xbd\"} 3\n"
                  "caraserve_info{name=\"\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\"} 4\n"
                  "caraserve_info{name=\"\"} 5\n");
    metrics_free(m);
}
END_TEST

/* Every value reads back as the same double; special values as Prometheus spells them; a
 * locale with a decimal comma does not leak into the output. */
START_TEST(test_numbers) {
    metrics_t *m = metrics_new();
    metric_t *g = metrics_gauge(m, "v", "V.", (const char *[]){"i", NULL});
    const double vals[] = {0, 1, -1, 0.1, 1.0 / 3, 2.5, 1e-300, 4.9406564584124654e-324, 1e300, 1.7976931348623157e308,
                           123456789012345678.0, -0.000123, 9007199254740993.0};
    int n = sizeof vals / sizeof *vals;
    char lbl[16];
    for (int i = 0; i < n; i++) {
        snprintf(lbl, sizeof lbl, "%d", i);
        metric_set(g, (const char *[]){lbl}, vals[i]);
    }
    static const struct { const char *name; double v; } special[] = {
        {"nan", NAN}, {"inf", INFINITY}, {"-inf", -INFINITY}};
    for (int i = 0; i < 3; i++) metric_set(g, &special[i].name, special[i].v);
    const char *comma = NULL;
    const char *locales[] = {"de_DE.UTF-8", "fr_FR.UTF-8", "de_DE", "fr_FR", NULL};
    for (int i = 0; locales[i] && !comma; i++) comma = setlocale(LC_NUMERIC, locales[i]);
    if (!comma) fprintf(stderr, "test_numbers: no decimal-comma locale installed, checking in C only\n");
    char *s = render(m);
    setlocale(LC_NUMERIC, "C");
    for (int i = 0; i < n; i++) {
        char series[32];
        snprintf(series, sizeof series, "v{i=\"%d\"}", i);
        ck_assert_msg(sample(s, series) == vals[i], "%s: %.17g", series, vals[i]);
    }
    static const char *const lines[] = {"v{i=\"0\"} 0\n",     "v{i=\"3\"} 0.1\n",    "v{i=\"5\"} 2.5\n",
                                        "v{i=\"nan\"} NaN\n", "v{i=\"inf\"} +Inf\n", "v{i=\"-inf\"} -Inf\n"};
    for (size_t i = 0; i < CS_ARRAY_LEN(lines); i++) ck_assert_msg(strstr(s, lines[i]), "no line %s", lines[i]);
    ck_assert_int_eq(count_lines_with(s, ","), 0);
    free(s);
    metrics_free(m);
}
END_TEST

START_TEST(test_remove) {
    metrics_t *m = metrics_new();
    metric_t *g = metrics_gauge(m, "caraserve_lora_loaded", "Loaded adapters.", (const char *[]){"adapter", NULL});
    metric_t *h = metrics_histogram(m, "h_seconds", "H.", (const char *[]){"adapter", NULL}, (const double[]){1}, 1);
    static const char *const adapters[] = {"a", "b", "c"};
    for (int i = 0; i < 3; i++) metric_set(g, &adapters[i], 1);
    metric_observe(h, (const char *[]){"a"}, 0.5);
    metric_remove(g, (const char *[]){"b"});
    metric_remove(g, (const char *[]){"nope"}); /* no-op */
    metric_remove(h, (const char *[]){"a"});
    expect_render(m, "# HELP caraserve_lora_loaded Loaded adapters.\n"
                  "# TYPE caraserve_lora_loaded gauge\n"
                  "caraserve_lora_loaded{adapter=\"a\"} 1\n"
                  "caraserve_lora_loaded{adapter=\"c\"} 1\n"
                  "# HELP h_seconds H.\n"
                  "# TYPE h_seconds histogram\n");
    /* re-created from zero, at the end */
    metric_inc(g, (const char *[]){"b"}, 2);
    metric_remove(g, (const char *[]){"a"});
    metric_remove(g, (const char *[]){"a"});
    expect_render(m, "# HELP caraserve_lora_loaded Loaded adapters.\n"
                  "# TYPE caraserve_lora_loaded gauge\n"
                  "caraserve_lora_loaded{adapter=\"c\"} 1\n"
                  "caraserve_lora_loaded{adapter=\"b\"} 2\n"
                  "# HELP h_seconds H.\n"
                  "# TYPE h_seconds histogram\n");
    /* many removes and re-adds keep the table consistent */
    char name[16];
    for (int round = 0; round < 3; round++) {
        for (int i = 0; i < 200; i++) {
            snprintf(name, sizeof name, "x%d", i);
            metric_inc(g, (const char *[]){name}, 1);
        }
        for (int i = 0; i < 200; i += 2) {
            snprintf(name, sizeof name, "x%d", i);
            metric_remove(g, (const char *[]){name});
        }
    }
    char *s = render(m);
    for (int i = 0; i < 200; i++) {
        char series[48];
        snprintf(series, sizeof series, "caraserve_lora_loaded{adapter=\"x%d\"} ", i);
        ck_assert_int_eq(count_lines_with(s, series), i % 2 ? 1 : 0);
        if (i % 2) ck_assert_ptr_nonnull(strstr(s, strcat(series, "3\n")));
    }
    free(s);
    /* a family without labels can be removed too, and comes back on the next update */
    metric_t *c = metrics_counter(m, "c", "C.", NULL);
    metric_inc(c, NULL, 1);
    metric_remove(c, NULL);
    s = render(m);
    ck_assert_ptr_null(strstr(s, "\nc_total "));
    free(s);
    metric_inc(c, NULL, 1);
    s = render(m);
    ck_assert(sample(s, "c_total") == 1);
    free(s);
    metrics_free(m);
}
END_TEST

START_TEST(test_registration_errors) {
    metrics_t *m = metrics_new();
    const char *none[] = {NULL};
    ck_assert_ptr_nonnull(metrics_counter(m, "ok", "Ok.", none));
    ck_assert_ptr_null(metrics_counter(m, "ok_total", "Again.", NULL)); /* the same exposed name */
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "already registered"));
    ck_assert_ptr_null(metrics_gauge(m, "ok_total", "Again.", NULL));
    ck_assert_ptr_nonnull(metrics_gauge(m, "ok", "A gauge may be called ok.", NULL));
    ck_assert_ptr_nonnull(metrics_gauge(m, "vllm:style", "Colons are valid.", NULL));
    ck_assert_ptr_null(metrics_gauge(m, "9lives", "X.", NULL));
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "invalid metric name"));
    ck_assert_ptr_null(metrics_gauge(m, "", "X.", NULL));
    ck_assert_ptr_null(metrics_gauge(m, NULL, "X.", NULL));
    ck_assert_ptr_null(metrics_gauge(m, "a-b", "X.", NULL));
    ck_assert_ptr_null(metrics_gauge(m, "a b", "X.", NULL));
    ck_assert_ptr_null(metrics_gauge(m, "nohelp", NULL, NULL));
    ck_assert_ptr_null(metrics_gauge(m, "g1", "X.", (const char *[]){"a:b", NULL}));
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "label"));
    ck_assert_ptr_null(metrics_gauge(m, "g2", "X.", (const char *[]){"__name", NULL}));
    ck_assert_ptr_null(metrics_gauge(m, "g3", "X.", (const char *[]){"1a", NULL}));
    ck_assert_ptr_null(metrics_gauge(m, "g4", "X.", (const char *[]){"a", "b", "a", NULL}));
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "twice"));
    ck_assert_ptr_nonnull(metrics_gauge(m, "g5", "le is fine outside histograms.", (const char *[]){"le", NULL}));
    const char *many[METRICS_MAX_LABELS + 2];
    char names[METRICS_MAX_LABELS + 1][8];
    for (int i = 0; i <= METRICS_MAX_LABELS; i++) {
        snprintf(names[i], sizeof names[i], "l%d", i);
        many[i] = names[i];
    }
    many[METRICS_MAX_LABELS + 1] = NULL;
    ck_assert_ptr_null(metrics_gauge(m, "g6", "X.", many));
    many[METRICS_MAX_LABELS] = NULL;
    ck_assert_ptr_nonnull(metrics_gauge(m, "g6", "X.", many));

    const double b[] = {1, 2, 2};
    ck_assert_ptr_null(metrics_histogram(m, "h1", "X.", (const char *[]){"le", NULL}, b, 2));
    ck_assert_ptr_null(metrics_histogram(m, "h2", "X.", NULL, b, 3));
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "increasing"));
    ck_assert_ptr_null(metrics_histogram(m, "h3", "X.", NULL, (const double[]){2, 1}, 2));
    ck_assert_ptr_null(metrics_histogram(m, "h4", "X.", NULL, (const double[]){NAN}, 1));
    ck_assert_ptr_null(metrics_histogram(m, "h5", "X.", NULL, (const double[]){-INFINITY, 1}, 2));
    ck_assert_ptr_null(metrics_histogram(m, "h6", "X.", NULL, b, -1));
    ck_assert_ptr_null(metrics_histogram(m, "h7", "X.", NULL, NULL, 2));
    double big[METRICS_MAX_BUCKETS + 1];
    for (int i = 0; i <= METRICS_MAX_BUCKETS; i++) big[i] = i;
    ck_assert_ptr_null(metrics_histogram(m, "h8", "X.", NULL, big, METRICS_MAX_BUCKETS + 1));
    ck_assert_ptr_nonnull(metrics_histogram(m, "h8", "X.", NULL, big, METRICS_MAX_BUCKETS));
    ck_assert_ptr_nonnull(metrics_histogram(m, "h9", "Negative bounds.", NULL, (const double[]){-1, 0}, 2));

    /* the failures registered nothing */
    char *s = render(m);
    ck_assert_int_eq(count_lines_with(s, "# TYPE "), 7);
    free(s);
    metrics_free(m);
}
END_TEST

START_TEST(test_summary) {
    metrics_t *m = metrics_new();
    metric_t *s0 = metrics_summary(m, "caraserve_request_queue_seconds", "Time in the queue.", NULL);
    metric_t *s1 = metrics_summary(m, "caraserve_lora_swap_seconds", "Adapter swap time.",
                                   (const char *[]){"adapter", NULL});
    ck_assert_ptr_nonnull(s0);
    ck_assert_ptr_nonnull(s1);
    expect_render(m, "# HELP caraserve_request_queue_seconds Time in the queue.\n"
                  "# TYPE caraserve_request_queue_seconds summary\n"
                  "caraserve_request_queue_seconds_sum 0\n"
                  "caraserve_request_queue_seconds_count 0\n"
                  "# HELP caraserve_lora_swap_seconds Adapter swap time.\n"
                  "# TYPE caraserve_lora_swap_seconds summary\n");
    metric_observe(s0, NULL, 0.25);
    metric_observe(s0, NULL, 1.5);
    metric_observe(s0, NULL, 1e9); /* no bound: anything counts */
    metric_observe(s1, (const char *[]){"r8"}, 0.5);
    metric_observe(s1, (const char *[]){"r16"}, 2);
    metric_observe(s1, (const char *[]){"r8"}, 0.125);
    expect_render(m, "# HELP caraserve_request_queue_seconds Time in the queue.\n"
                  "# TYPE caraserve_request_queue_seconds summary\n"
                  "caraserve_request_queue_seconds_sum 1000000001.75\n"
                  "caraserve_request_queue_seconds_count 3\n"
                  "# HELP caraserve_lora_swap_seconds Adapter swap time.\n"
                  "# TYPE caraserve_lora_swap_seconds summary\n"
                  "caraserve_lora_swap_seconds_sum{adapter=\"r8\"} 0.625\n"
                  "caraserve_lora_swap_seconds_count{adapter=\"r8\"} 2\n"
                  "caraserve_lora_swap_seconds_sum{adapter=\"r16\"} 2\n"
                  "caraserve_lora_swap_seconds_count{adapter=\"r16\"} 1\n");
    ck_assert_uint_eq(metric_series_count(s0), 1);
    ck_assert_uint_eq(metric_series_count(s1), 2);
    /* "quantile" is reserved, "le" is not */
    ck_assert_ptr_null(metrics_summary(m, "x", "X.", (const char *[]){"quantile", NULL}));
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "reserved"));
    ck_assert_ptr_nonnull(metrics_summary(m, "y", "Y.", (const char *[]){"le", NULL}));
    metrics_free(m);
}
END_TEST

/* The sum of every sample of FAMILY (lines starting with `family{` or `family `). */
static double family_total(const char *text, const char *family) {
    size_t n = strlen(family);
    double total = 0;
    for (const char *line = text; *line;) {
        const char *eol = strchr(line, '\n');
        ck_assert(eol);
        if (!strncmp(line, family, n) && (line[n] == '{' || line[n] == ' ')) {
            const char *v = eol;
            while (v > line && v[-1] != ' ') v--;
            total += strtod(v, NULL);
        }
        line = eol + 1;
    }
    return total;
}

START_TEST(test_fold_counter) {
    metrics_t *m = metrics_new();
    metric_t *c = metrics_counter(m, "caraserve_request_success", "Finished requests.",
                                  (const char *[]){"adapter", "finished_reason", NULL});
    metric_inc(c, (const char *[]){"a", "stop"}, 1);
    metric_inc(c, (const char *[]){"b", "stop"}, 2);
    metric_inc(c, (const char *[]){"a", "length"}, 4);
    metric_inc(c, (const char *[]){"_other", "stop"}, 8);
    metric_inc(c, (const char *[]){"c", "abort"}, 16);
    ck_assert_uint_eq(metric_series_count(c), 5);
    char *s = render(m);
    double before = family_total(s, "caraserve_request_success_total");
    free(s);
    ck_assert(before == 31);

    /* a: (a,stop) into the existing (_other,stop); (a,length) creates (_other,length) at the end */
    metric_fold(c, "adapter", "a", "_other");
    ck_assert_uint_eq(metric_series_count(c), 4);
    expect_render(m, "# HELP caraserve_request_success_total Finished requests.\n"
                  "# TYPE caraserve_request_success_total counter\n"
                  "caraserve_request_success_total{adapter=\"b\",finished_reason=\"stop\"} 2\n"
                  "caraserve_request_success_total{adapter=\"_other\",finished_reason=\"stop\"} 9\n"
                  "caraserve_request_success_total{adapter=\"c\",finished_reason=\"abort\"} 16\n"
                  "caraserve_request_success_total{adapter=\"_other\",finished_reason=\"length\"} 4\n");
    /* no match, unknown label, from == to, the other label: as asked */
    metric_fold(c, "adapter", "a", "_other");
    metric_fold(c, "model", "b", "_other");
    metric_fold(c, "adapter", "b", "b");
    ck_assert_uint_eq(metric_series_count(c), 4);
    metric_fold(c, "finished_reason", "length", "stop");
    ck_assert_uint_eq(metric_series_count(c), 3);
    expect_render(m, "# HELP caraserve_request_success_total Finished requests.\n"
                  "# TYPE caraserve_request_success_total counter\n"
                  "caraserve_request_success_total{adapter=\"b\",finished_reason=\"stop\"} 2\n"
                  "caraserve_request_success_total{adapter=\"_other\",finished_reason=\"stop\"} 13\n"
                  "caraserve_request_success_total{adapter=\"c\",finished_reason=\"abort\"} 16\n");
    /* c: no (_other,abort) yet; then every adapter is folded */
    metric_fold(c, "adapter", "c", "_other");
    metric_fold(c, "adapter", "b", "_other");
    ck_assert_uint_eq(metric_series_count(c), 2);
    expect_render(m, "# HELP caraserve_request_success_total Finished requests.\n"
                  "# TYPE caraserve_request_success_total counter\n"
                  "caraserve_request_success_total{adapter=\"_other\",finished_reason=\"stop\"} 15\n"
                  "caraserve_request_success_total{adapter=\"_other\",finished_reason=\"abort\"} 16\n");
    s = render(m);
    ck_assert(family_total(s, "caraserve_request_success_total") == before);
    free(s);
    /* a folded value comes back as a new series from zero, and updates still find every series */
    metric_inc(c, (const char *[]){"a", "stop"}, 1);
    metric_inc(c, (const char *[]){"_other", "stop"}, 1);
    s = render(m);
    ck_assert(sample(s, "caraserve_request_success_total{adapter=\"a\",finished_reason=\"stop\"}") == 1);
    ck_assert(sample(s, "caraserve_request_success_total{adapter=\"_other\",finished_reason=\"stop\"}") == 16);
    free(s);

    /* many series folded at once: the hash table stays consistent */
    metric_t *g = metrics_gauge(m, "running", "Requests running.", (const char *[]){"adapter", "kind", NULL});
    char name[16];
    for (int i = 0; i < 300; i++) {
        snprintf(name, sizeof name, "x%d", i % 100);
        metric_inc(g, (const char *[]){name, i < 100 ? "p" : i < 200 ? "q" : "r"}, 1);
    }
    for (int i = 1; i < 100; i++) {
        snprintf(name, sizeof name, "x%d", i);
        metric_fold(g, "adapter", name, "x0");
    }
    ck_assert_uint_eq(metric_series_count(g), 3);
    metric_inc(g, (const char *[]){"x0", "q"}, 0.5);
    s = render(m);
    ck_assert(sample(s, "running{adapter=\"x0\",kind=\"p\"}") == 100);
    ck_assert(sample(s, "running{adapter=\"x0\",kind=\"q\"}") == 100.5);
    ck_assert(sample(s, "running{adapter=\"x0\",kind=\"r\"}") == 100);
    free(s);

    /* a family without labels: no-op */
    metric_t *n = metrics_counter(m, "n", "N.", NULL);
    metric_inc(n, NULL, 3);
    metric_fold(n, "adapter", "a", "b");
    ck_assert_uint_eq(metric_series_count(n), 1);
    s = render(m);
    ck_assert(sample(s, "n_total") == 3);
    free(s);
    metrics_free(m);
}
END_TEST

START_TEST(test_fold_histogram_summary) {
    metrics_t *m = metrics_new();
    const char *names[] = {"adapter", "phase", NULL};
    metric_t *h = metrics_histogram(m, "h_seconds", "H.", names, (const double[]){1, 2}, 2);
    metric_t *sm = metrics_summary(m, "s_seconds", "S.", names);
    /* a: 0.5, 1.5, 3; b: 0.25, 2; _other: 1 */
    const struct { const char *a; double v; } obs[] = {{"a", 0.5}, {"b", 0.25}, {"a", 1.5}, {"_other", 1},
                                                       {"b", 2},   {"a", 3}};
    for (size_t i = 0; i < CS_ARRAY_LEN(obs); i++) {
        metric_observe(h, (const char *[]){obs[i].a, "decode"}, obs[i].v);
        metric_observe(sm, (const char *[]){obs[i].a, "decode"}, obs[i].v);
    }
    metric_observe(h, (const char *[]){"a", "prefill"}, 0.75);
    metric_observe(sm, (const char *[]){"a", "prefill"}, 0.75);
    char *s = render(m);
    double sum_h = family_total(s, "h_seconds_sum"), cnt_h = family_total(s, "h_seconds_count");
    double buckets_h = family_total(s, "h_seconds_bucket");
    double sum_s = family_total(s, "s_seconds_sum"), cnt_s = family_total(s, "s_seconds_count");
    free(s);

    metric_fold(h, "adapter", "a", "_other");
    metric_fold(sm, "adapter", "a", "_other");
    ck_assert_uint_eq(metric_series_count(h), 3);
    ck_assert_uint_eq(metric_series_count(sm), 3);
    expect_render(m, "# HELP h_seconds H.\n"
                  "# TYPE h_seconds histogram\n"
                  "h_seconds_bucket{adapter=\"b\",phase=\"decode\",le=\"1\"} 1\n"
                  "h_seconds_bucket{adapter=\"b\",phase=\"decode\",le=\"2\"} 2\n"
                  "h_seconds_bucket{adapter=\"b\",phase=\"decode\",le=\"+Inf\"} 2\n"
                  "h_seconds_sum{adapter=\"b\",phase=\"decode\"} 2.25\n"
                  "h_seconds_count{adapter=\"b\",phase=\"decode\"} 2\n"
                  "h_seconds_bucket{adapter=\"_other\",phase=\"decode\",le=\"1\"} 2\n"
                  "h_seconds_bucket{adapter=\"_other\",phase=\"decode\",le=\"2\"} 3\n"
                  "h_seconds_bucket{adapter=\"_other\",phase=\"decode\",le=\"+Inf\"} 4\n"
                  "h_seconds_sum{adapter=\"_other\",phase=\"decode\"} 6\n"
                  "h_seconds_count{adapter=\"_other\",phase=\"decode\"} 4\n"
                  "h_seconds_bucket{adapter=\"_other\",phase=\"prefill\",le=\"1\"} 1\n"
                  "h_seconds_bucket{adapter=\"_other\",phase=\"prefill\",le=\"2\"} 1\n"
                  "h_seconds_bucket{adapter=\"_other\",phase=\"prefill\",le=\"+Inf\"} 1\n"
                  "h_seconds_sum{adapter=\"_other\",phase=\"prefill\"} 0.75\n"
                  "h_seconds_count{adapter=\"_other\",phase=\"prefill\"} 1\n"
                  "# HELP s_seconds S.\n"
                  "# TYPE s_seconds summary\n"
                  "s_seconds_sum{adapter=\"b\",phase=\"decode\"} 2.25\n"
                  "s_seconds_count{adapter=\"b\",phase=\"decode\"} 2\n"
                  "s_seconds_sum{adapter=\"_other\",phase=\"decode\"} 6\n"
                  "s_seconds_count{adapter=\"_other\",phase=\"decode\"} 4\n"
                  "s_seconds_sum{adapter=\"_other\",phase=\"prefill\"} 0.75\n"
                  "s_seconds_count{adapter=\"_other\",phase=\"prefill\"} 1\n");
    s = render(m);
    ck_assert(family_total(s, "h_seconds_sum") == sum_h);
    ck_assert(family_total(s, "h_seconds_count") == cnt_h);
    ck_assert(family_total(s, "h_seconds_bucket") == buckets_h);
    ck_assert(family_total(s, "s_seconds_sum") == sum_s);
    ck_assert(family_total(s, "s_seconds_count") == cnt_s);
    free(s);
    /* the merged series goes on counting into the right buckets */
    metric_observe(h, (const char *[]){"_other", "prefill"}, 1.5);
    s = render(m);
    ck_assert(sample(s, "h_seconds_bucket{adapter=\"_other\",phase=\"prefill\",le=\"1\"}") == 1);
    ck_assert(sample(s, "h_seconds_bucket{adapter=\"_other\",phase=\"prefill\",le=\"2\"}") == 2);
    ck_assert(sample(s, "h_seconds_count{adapter=\"_other\",phase=\"prefill\"}") == 2);
    free(s);
    metrics_free(m);
}
END_TEST

/* programming errors abort */
START_TEST(test_negative_counter_aborts) {
    metrics_t *m = metrics_new();
    metric_inc(metrics_counter(m, "c", "C.", NULL), NULL, -1);
}
END_TEST

START_TEST(test_wrong_kind_aborts) {
    metrics_t *m = metrics_new();
    metric_observe(metrics_gauge(m, "g", "G.", NULL), NULL, 1);
}
END_TEST

START_TEST(test_summary_set_aborts) {
    metrics_t *m = metrics_new();
    metric_set(metrics_summary(m, "s", "S.", NULL), NULL, 1);
}
END_TEST

START_TEST(test_missing_labels_abort) {
    metrics_t *m = metrics_new();
    metric_inc(metrics_gauge(m, "g", "G.", (const char *[]){"a", NULL}), NULL, 1);
}
END_TEST

/* ---- several threads ---- */

#define N_THREADS 8
#define N_ITERS 20000

typedef struct shared {
    metric_t *c, *g, *h, *adapters;
    int id;
} shared_t;

static void *worker(void *arg) {
    shared_t *sh = arg;
    const char *who[] = {sh->id % 2 ? "odd" : "even"};
    char own[16];
    snprintf(own, sizeof own, "t%d", sh->id);
    for (int i = 0; i < N_ITERS; i++) {
        metric_inc(sh->c, who, 1);
        metric_inc(sh->g, NULL, 1);
        metric_observe(sh->h, NULL, (i % 4) * 0.25);
        metric_inc(sh->g, NULL, -1);
        /* series created and removed while others update and render */
        if (i % 100 == 0) metric_set(sh->adapters, (const char *[]){own}, i);
        if (i % 100 == 50) metric_remove(sh->adapters, (const char *[]){own});
    }
    metric_set(sh->adapters, (const char *[]){own}, 1);
    return NULL;
}

static atomic_int stop_render;

static void *renderer(void *arg) {
    metrics_t *m = arg;
    int n = 0;
    do {
        char *s = metrics_render(m, NULL);
        ck_assert_ptr_nonnull(s);
        /* every snapshot of a histogram is consistent: +Inf bucket == count */
        double inf = sample(s, "ops_seconds_bucket{le=\"+Inf\"}"), cnt = sample(s, "ops_seconds_count");
        ck_assert(inf == cnt);
        free(s);
        n++;
    } while (!atomic_load(&stop_render));
    return (void *)(long)n;
}

START_TEST(test_concurrent) {
    metrics_t *m = metrics_new();
    shared_t sh[N_THREADS];
    metric_t *c = metrics_counter(m, "ops", "Ops.", (const char *[]){"parity", NULL});
    metric_t *g = metrics_gauge(m, "in_flight", "In flight.", NULL);
    metric_t *h = metrics_histogram(m, "ops_seconds", "Op time.", NULL, (const double[]){0.1, 0.3, 0.6}, 3);
    metric_t *a = metrics_gauge(m, "adapter_loaded", "Per thread.", (const char *[]){"thread", NULL});
    pthread_t t[N_THREADS], r;
    atomic_store(&stop_render, 0);
    ck_assert_int_eq(pthread_create(&r, NULL, renderer, m), 0);
    for (int i = 0; i < N_THREADS; i++) {
        sh[i] = (shared_t){.c = c, .g = g, .h = h, .adapters = a, .id = i};
        ck_assert_int_eq(pthread_create(&t[i], NULL, worker, &sh[i]), 0);
    }
    for (int i = 0; i < N_THREADS; i++) pthread_join(t[i], NULL);
    atomic_store(&stop_render, 1);
    void *renders;
    pthread_join(r, &renders);
    ck_assert_int_gt((int)(long)renders, 0);
    char *s = render(m);
    double per = (double)N_THREADS / 2 * N_ITERS;
    ck_assert(sample(s, "ops_total{parity=\"even\"}") == per);
    ck_assert(sample(s, "ops_total{parity=\"odd\"}") == per);
    ck_assert(sample(s, "in_flight") == 0);
    double n = (double)N_THREADS * N_ITERS;
    ck_assert(sample(s, "ops_seconds_bucket{le=\"0.1\"}") == n / 4);
    ck_assert(sample(s, "ops_seconds_bucket{le=\"0.3\"}") == n / 2);
    ck_assert(sample(s, "ops_seconds_bucket{le=\"0.6\"}") == n * 3 / 4);
    ck_assert(sample(s, "ops_seconds_bucket{le=\"+Inf\"}") == n);
    ck_assert(sample(s, "ops_seconds_count") == n);
    ck_assert(sample(s, "ops_seconds_sum") == n / 4 * (0 + 0.25 + 0.5 + 0.75));
    for (int i = 0; i < N_THREADS; i++) {
        char series[48];
        snprintf(series, sizeof series, "adapter_loaded{thread=\"t%d\"}", i);
        ck_assert(sample(s, series) == 1);
    }
    free(s);
    metrics_free(m);
}
END_TEST

/* Workers count into per-thread adapters while one thread folds them into "_other": every
 * render sees each request exactly once (the totals never go down, the +Inf buckets add up
 * to the count), and nothing is lost at the end. */
typedef struct fold_shared {
    metric_t *c, *h;
    int id;
} fold_shared_t;

static void *fold_worker(void *arg) {
    fold_shared_t *sh = arg;
    char own[16];
    snprintf(own, sizeof own, "t%d", sh->id);
    for (int i = 0; i < N_ITERS; i++) {
        metric_inc(sh->c, (const char *[]){own, i % 3 ? "stop" : "length"}, 1);
        metric_observe(sh->h, (const char *[]){own}, (i % 4) * 0.25);
    }
    return NULL;
}

static atomic_int stop_fold;

static void *folder(void *arg) {
    fold_shared_t *sh = arg;
    char name[16];
    for (int round = 0; !atomic_load(&stop_fold); round++) {
        snprintf(name, sizeof name, "t%d", round % N_THREADS);
        metric_fold(sh->c, "adapter", name, "_other");
        metric_fold(sh->h, "adapter", name, "_other");
    }
    return NULL;
}

static void *fold_renderer(void *arg) {
    metrics_t *m = arg;
    double last = 0, last_count = 0;
    int n = 0;
    do {
        char *s = metrics_render(m, NULL);
        ck_assert_ptr_nonnull(s);
        double total = family_total(s, "req_total");
        ck_assert_msg(total >= last, "total went from %g to %g", last, total);
        last = total;
        double count = family_total(s, "lat_seconds_count"), inf = 0;
        ck_assert_msg(count >= last_count, "count went from %g to %g", last_count, count);
        last_count = count;
        for (const char *p = s; (p = strstr(p, "le=\"+Inf\"} ")); p++) inf += strtod(p + 11, NULL);
        ck_assert(inf == count);
        free(s);
        n++;
    } while (!atomic_load(&stop_render));
    return (void *)(long)n;
}

START_TEST(test_concurrent_fold) {
    metrics_t *m = metrics_new();
    metric_t *c = metrics_counter(m, "req", "Requests.", (const char *[]){"adapter", "finished_reason", NULL});
    metric_t *h = metrics_histogram(m, "lat_seconds", "Latency.", (const char *[]){"adapter", NULL},
                                    (const double[]){0.1, 0.6}, 2);
    fold_shared_t sh[N_THREADS], fsh = {.c = c, .h = h};
    pthread_t t[N_THREADS], r, fo;
    atomic_store(&stop_render, 0);
    atomic_store(&stop_fold, 0);
    ck_assert_int_eq(pthread_create(&r, NULL, fold_renderer, m), 0);
    ck_assert_int_eq(pthread_create(&fo, NULL, folder, &fsh), 0);
    for (int i = 0; i < N_THREADS; i++) {
        sh[i] = (fold_shared_t){.c = c, .h = h, .id = i};
        ck_assert_int_eq(pthread_create(&t[i], NULL, fold_worker, &sh[i]), 0);
    }
    for (int i = 0; i < N_THREADS; i++) pthread_join(t[i], NULL);
    atomic_store(&stop_fold, 1);
    pthread_join(fo, NULL);
    atomic_store(&stop_render, 1);
    void *renders;
    pthread_join(r, &renders);
    ck_assert_int_gt((int)(long)renders, 0);
    char *s = render(m);
    double n = (double)N_THREADS * N_ITERS;
    ck_assert(family_total(s, "req_total") == n);
    ck_assert(family_total(s, "lat_seconds_count") == n);
    ck_assert(family_total(s, "lat_seconds_sum") == n / 4 * (0 + 0.25 + 0.5 + 0.75));
    free(s);
    /* everything left folds into two counter series and one histogram series */
    for (int i = 0; i < N_THREADS; i++) {
        char name[16];
        snprintf(name, sizeof name, "t%d", i);
        metric_fold(c, "adapter", name, "_other");
        metric_fold(h, "adapter", name, "_other");
    }
    ck_assert_uint_eq(metric_series_count(c), 2);
    ck_assert_uint_eq(metric_series_count(h), 1);
    s = render(m);
    ck_assert(sample(s, "lat_seconds_count{adapter=\"_other\"}") == n);
    ck_assert(sample(s, "lat_seconds_bucket{adapter=\"_other\",le=\"0.1\"}") == n / 4);
    ck_assert(sample(s, "lat_seconds_bucket{adapter=\"_other\",le=\"0.6\"}") == n * 3 / 4);
    ck_assert(sample(s, "req_total{adapter=\"_other\",finished_reason=\"stop\"}") +
                  sample(s, "req_total{adapter=\"_other\",finished_reason=\"length\"}") == n);
    free(s);
    metrics_free(m);
}
END_TEST

/* ---- promtool ---- */

static bool on_path(const char *prog) {
    const char *path = getenv("PATH");
    char buf[4096];
    while (path && *path) {
        size_t n = strcspn(path, ":");
        snprintf(buf, sizeof buf, "%.*s/%s", (int)n, path, prog);
        if (n && access(buf, X_OK) == 0) return true;
        path += n + (path[n] == ':');
    }
    return false;
}

/* A registry like the server's: every kind, with and without labels, escaping, a folded
 * label. prefix is
 * "caraserve_" or "caraserve:". */
static metrics_t *representative(const char *prefix) {
    metrics_t *m = metrics_new();
    char name[128];
#define NAME(s) (snprintf(name, sizeof name, "%s%s", prefix, s), name)
    const char *adapter[] = {"adapter", NULL};
    metric_t *prompt = metrics_counter(m, NAME("prompt_tokens"), "Number of prefill tokens processed.", adapter);
    metric_t *gen = metrics_counter(m, NAME("generation_tokens_total"), "Number of generated tokens.", NULL);
    metric_t *ok = metrics_counter(m, NAME("request_success"), "Finished requests by reason.",
                                   (const char *[]){"adapter", "finished_reason", NULL});
    metric_t *running = metrics_gauge(m, NAME("num_requests_running"), "Requests in the running batch.", NULL);
    metric_t *kv = metrics_gauge(m, NAME("kv_cache_usage_perc"), "KV cache usage, 1 means 100 percent.", NULL);
    metric_t *loaded = metrics_gauge(m, NAME("lora_adapter_loaded"),
                                     "1 per loaded adapter, with its rank.\nEscapes \\ too.",
                                     (const char *[]){"adapter", "rank", NULL});
    const double ttft_b[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10};
    metric_t *ttft = metrics_histogram(m, NAME("time_to_first_token_seconds"), "Time to first token.", adapter,
                                       ttft_b, 16);
    const double tok_b[] = {1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000};
    metric_t *plen = metrics_histogram(m, NAME("request_prompt_tokens"), "Prompt length of requests.", NULL,
                                       tok_b, 13);
    metric_t *empty = metrics_histogram(m, NAME("lora_load_seconds"), "Adapter load time.", adapter,
                                        (const double[]){0.01, 0.1, 1}, 3);
    metric_t *queue = metrics_summary(m, NAME("request_queue_seconds"), "Time in the queue.", adapter);
    metric_t *wait = metrics_summary(m, NAME("scheduler_wait_seconds"), "Scheduler wait.", NULL);
#undef NAME
    ck_assert(prompt && gen && ok && running && kv && loaded && ttft && plen && empty && queue && wait);
    const char *names[] = {"", "demo-r8", "demo \"r16\"\\x\nnew", "caf\xc3\xa9", "bad\xff"};
    for (int i = 0; i < 5; i++) {
        const char *a[] = {names[i]};
        metric_inc(prompt, a, 100 * i + 7);
        metric_inc(ok, (const char *[]){names[i], i % 2 ? "length" : "stop"}, i + 1);
        metric_set(loaded, (const char *[]){names[i], "16"}, 1);
        for (int k = 0; k < 50; k++) metric_observe(ttft, a, 0.003 * k * (i + 1));
        metric_observe(queue, a, 0.01 * i);
    }
    metric_fold(ok, "adapter", "demo-r8", "_other");
    metric_fold(ttft, "adapter", "demo-r8", "_other");
    metric_fold(queue, "adapter", "demo-r8", "_other");
    metric_observe(wait, NULL, 0.5);
    metric_remove(loaded, (const char *[]){"demo-r8", "16"});
    metric_inc(gen, NULL, 12345);
    metric_set(running, NULL, 3);
    metric_set(kv, NULL, 1.0 / 3);
    for (int k = 0; k < 100; k++) metric_observe(plen, NULL, k * k);
    return m;
}

/* Runs promtool check metrics on the rendered registry; returns its exit status, its
 * output in out. */
static int promtool_check(metrics_t *m, char *out, size_t cap) {
    char path[] = "/tmp/test_metrics.XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    size_t len;
    char *s = metrics_render(m, &len);
    ck_assert_ptr_nonnull(s);
    ck_assert_int_eq(write(fd, s, len), (ssize_t)len);
    close(fd);
    free(s);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "promtool check metrics < %s 2>&1", path);
    FILE *p = popen(cmd, "r");
    ck_assert_ptr_nonnull(p);
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = 0;
    int st = pclose(p);
    unlink(path);
    return st;
}

START_TEST(test_promtool) {
    if (!on_path("promtool")) {
        fprintf(stderr, "test_promtool: SKIP, promtool not on PATH (Debian: apt-get install prometheus)\n");
        return;
    }
    char out[16384];
    metrics_t *m = representative("caraserve_");
    int st = promtool_check(m, out, sizeof out);
    if (st != 0 || out[0]) {
        char *s = metrics_render(m, NULL);
        ck_abort_msg("promtool check metrics: status %d, output:\n%s\non:\n%s", st, out, s);
    }
    metrics_free(m);

    /* With vLLM-style "prefix:" names the only complaint is the colon itself */
    m = representative("caraserve:");
    promtool_check(m, out, sizeof out);
    int lines = 0;
    for (char *line = strtok(out, "\n"); line; line = strtok(NULL, "\n"), lines++)
        ck_assert_msg(strstr(line, "metric names should not contain ':'"), "promtool: %s", line);
    ck_assert_int_eq(lines, 10); /* one per family with samples (not the empty histogram) */
    metrics_free(m);
}
END_TEST

int main(void) {
    Suite *s = suite_create("metrics");
    const TTest *const tests[] = {
        test_counter_gauge_no_labels, test_labels, test_histogram, test_histogram_cumulative, test_escaping,
        test_numbers, test_remove, test_summary, test_fold_counter, test_fold_histogram_summary,
        test_registration_errors, test_concurrent, test_concurrent_fold, test_promtool,
    };
    TCase *tc = cs_tcase(s, "core", tests, CS_ARRAY_LEN(tests), 0);
    /* aborting tests need a forked child each */
    const char *fork_env = getenv("CK_FORK");
    if (!fork_env || strcmp(fork_env, "no") != 0) {
        tcase_add_test_raise_signal(tc, test_negative_counter_aborts, SIGABRT);
        tcase_add_test_raise_signal(tc, test_wrong_kind_aborts, SIGABRT);
        tcase_add_test_raise_signal(tc, test_summary_set_aborts, SIGABRT);
        tcase_add_test_raise_signal(tc, test_missing_labels_abort, SIGABRT);
    }
    return cs_check_run(s, CK_FORK) ? 1 : 0;
}
