/* testutil.h: helpers the Check suites share: random inputs from a test's own generator,
 * error measures between a result and its reference, and running a suite. All static
 * inline; include after <check.h>. */
#ifndef CS_TESTUTIL_H
#define CS_TESTUTIL_H

#include <check.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>

#include "base/rng.h"

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

/* runs every test of S (in this process with nofork, as a debugger wants) and frees it:
 * the number that failed */
static inline int test_run(Suite *s, bool nofork) {
    SRunner *sr = srunner_create(s);
    if (nofork) srunner_set_fork_status(sr, CK_NOFORK);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed;
}

#endif
