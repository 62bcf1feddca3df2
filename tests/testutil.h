/* testutil.h: what every Check suite in tests/ does around its tests. A file lists its
 * tests in one array (START_TEST(name) declares `static const TTest *name`, so the array is
 * an automatic one inside a function), cs_tcase() turns it into a test case in that order,
 * and cs_check_run() runs the suite and returns the number of failed tests; cs_check_main()
 * does both for a file with one test case "core" and returns its exit status (their _fixture
 * forms run a setup and a teardown around each test); cs_test_mkdtemp() makes the temporary
 * directory a suite writes its files in and cs_rmtree() removes it. Beside them: the tiny base model the LoRA suites share, random
 * inputs from a test's own generator and error measures between a result and its reference. */
#ifndef CS_TESTUTIL_H
#define CS_TESTUTIL_H

#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* A passing assertion sends nothing to the runner. Check's ck_assert_* (and the typed forms
 * built on ck_assert_msg) mark every one that passes: its file and line go to the parent
 * process as a message, the place the parent names if the test then crashes. The suites'
 * per-element loops make that millions of messages; under ASan the parent unpacked them with
 * the runtime's byte-at-a-time memmove, a third of test_backend_ops' time there. A crash still
 * names its test (and ASan/UBSan print its stack); mark_point() still marks. */
#undef ck_assert_msg
#define ck_assert_msg(expr, ...) \
    ((expr) ? (void)0 : _ck_assert_failed(__FILE__, __LINE__, "Assertion '" #expr "' failed", ##__VA_ARGS__))

#include "base/common.h" /* CS_ARRAY_LEN */
#include "base/model_config.h"
#include "base/rng.h"

/* Adds tests[0..n) to TC in order. */
static inline void cs_tcase_add_tests(TCase *tc, const TTest *const *tests, size_t n) {
    for (size_t i = 0; i < n; i++) tcase_add_test(tc, tests[i]);
}

/* A test case NAME in S holding tests[0..n) in order; TIMEOUT in seconds, 0 for Check's
 * default (CK_DEFAULT_TIMEOUT). Fixtures and more tests can still be added to the result. */
static inline TCase *cs_tcase(Suite *s, const char *name, const TTest *const *tests, size_t n, double timeout) {
    TCase *tc = tcase_create(name);
    if (timeout > 0) tcase_set_timeout(tc, timeout);
    cs_tcase_add_tests(tc, tests, n);
    suite_add_tcase(s, tc);
    return tc;
}

/* Runs S with CK_NORMAL output and frees the runner; returns the number of failed tests.
 * FORK: CK_FORK leaves Check's default (a child per test unless CK_FORK=no in the
 * environment), CK_NOFORK runs every test in this process. */
static inline int cs_check_run(Suite *s, enum fork_status fork) {
    SRunner *sr = srunner_create(s);
    if (fork == CK_NOFORK) srunner_set_fork_status(sr, CK_NOFORK);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed;
}

/* cs_tcase() with SETUP and TEARDOWN run around each of its tests (a checked fixture: in the
 * test's own process when Check forks) */
static inline TCase *cs_tcase_fixture(Suite *s, const char *name, const TTest *const *tests, size_t n,
                                      double timeout, SFun setup, SFun teardown) {
    TCase *tc = cs_tcase(s, name, tests, n, timeout);
    tcase_add_checked_fixture(tc, setup, teardown);
    return tc;
}

/* Suite SUITE with the one test case "core" of tests[0..n), run as cs_check_run() does;
 * returns 0 if all passed, 1 otherwise. */
static inline int cs_check_main(const char *suite, const TTest *const *tests, size_t n, double timeout,
                                enum fork_status fork) {
    Suite *s = suite_create(suite);
    cs_tcase(s, "core", tests, n, timeout);
    return cs_check_run(s, fork) ? 1 : 0;
}

/* cs_check_main() with SETUP and TEARDOWN around each test, as cs_tcase_fixture() adds them */
static inline int cs_check_main_fixture(const char *suite, const TTest *const *tests, size_t n, double timeout,
                                        enum fork_status fork, SFun setup, SFun teardown) {
    Suite *s = suite_create(suite);
    cs_tcase_fixture(s, "core", tests, n, timeout, setup, teardown);
    return cs_check_run(s, fork) ? 1 : 0;
}

/* Removes PATH and, if it is a directory, everything below it, as `rm -rf` does (symbolic
 * links are removed, not followed); 0 if nothing is left, -1 if something could not go. */
static inline int cs_rmtree(const char *path) {
    struct stat st;
    if (lstat(path, &st) != 0) return errno == ENOENT ? 0 : -1;
    if (!S_ISDIR(st.st_mode)) return unlink(path) == 0 ? 0 : -1;
    int rc = 0;
    DIR *d = opendir(path);
    if (!d) return -1;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char p[4096];
        if (snprintf(p, sizeof p, "%s/%s", path, e->d_name) >= (int)sizeof p || cs_rmtree(p) != 0) rc = -1;
    }
    closedir(d);
    return rmdir(path) == 0 ? rc : -1;
}

/* The tiny Llama base model the LoRA suites build adapters for: hidden 64, 4 heads x 16
 * (q 64), 2 kv heads (k/v 32), intermediate 96, CS_TEST_TINY_LLAMA_LAYERS layers. */
#define CS_TEST_TINY_LLAMA_LAYERS 3
#define CS_TEST_TINY_LLAMA_JSON                                                                \
    "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 100, \"hidden_size\": 64, "   \
    "\"intermediate_size\": 96, \"num_hidden_layers\": 3, \"num_attention_heads\": 4, "        \
    "\"num_key_value_heads\": 2}"

/* Creates a fresh directory /tmp/cs_test_TAG_XXXXXX and writes its path to DIR (SIZE bytes);
 * a failure fails the calling test. */
static inline void cs_test_mkdtemp(char *dir, size_t size, const char *tag) {
    snprintf(dir, size, "/tmp/cs_test_%s_XXXXXX", tag);
    ck_assert_ptr_nonnull(mkdtemp(dir));
}

/* What a LoRA suite's fixture sets up: a fresh directory as cs_test_mkdtemp() makes it, and
 * the tiny Llama base model's config in BASE; a failure fails the calling test. */
static inline void cs_test_lora_setup(char *dir, size_t size, const char *tag, model_config_t *base) {
    cs_test_mkdtemp(dir, size, tag);
    ck_assert_int_eq(model_config_parse(CS_TEST_TINY_LLAMA_JSON, base), CS_OK);
}

/* n values uniform in [-scale, scale), one cs_rng_uniform(rng) each, in order; never NULL
 * for n = 0 */
static inline float *test_randv(cs_rng_t *rng, size_t n, float scale) {
    float *v = malloc(sizeof(float) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) v[i] = (float)(cs_rng_uniform(rng) * 2 - 1) * scale;
    return v;
}

/* max |a - b| (a NaN counts as the largest) */
static inline float test_max_abs_diff(const float *a, const float *b, size_t n) {
    float mx = 0;
    for (size_t i = 0; i < n; i++) {
        float d = fabsf(a[i] - b[i]);
        if (!(d <= mx)) mx = d;
    }
    return mx;
}

/* max |a - b| over max(|b|, 1e-3): the error relative to the reference's scale (a NaN counts
 * as the largest) */
static inline float test_max_rel_err(const float *a, const float *b, size_t n) {
    float ref = 1e-3f;
    for (size_t i = 0; i < n; i++) ref = fmaxf(ref, fabsf(b[i]));
    return test_max_abs_diff(a, b, n) / ref;
}

#endif
