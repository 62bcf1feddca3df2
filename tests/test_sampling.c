/* test_sampling.c: the sampler. Greedy is argmax with ties to the lowest index, the RNG is
 * reproducible per seed, temperature sampling draws from softmax(logits / T) (chi-square
 * over 200k draws), and log-softmax is normalised. */
#include <check.h>
#include <math.h>

#include "engine/sampling.h"

START_TEST(test_argmax_ties) {
    float x[5] = {1, 3, 3, -1, 2};
    ck_assert_int_eq(sampling_argmax(x, 5), 1);
    sampling_params_t p = {0, 0};
    cs_rng_t r;
    cs_rng_seed(&r, 1);
    ck_assert_int_eq(sampling_sample(x, 5, &p, &r), 1);
}
END_TEST

START_TEST(test_rng_reproducible) {
    cs_rng_t a, b, c;
    cs_rng_seed(&a, 42);
    cs_rng_seed(&b, 42);
    cs_rng_seed(&c, 43);
    int same_c = 0;
    for (int i = 0; i < 1000; i++) {
        uint64_t x = cs_rng_next(&a), y = cs_rng_next(&b), z = cs_rng_next(&c);
        ck_assert_uint_eq(x, y);
        same_c += x == z;
        double u = cs_rng_uniform(&a);
        (void)cs_rng_uniform(&b);
        (void)cs_rng_uniform(&c);
        ck_assert(u >= 0 && u < 1);
    }
    ck_assert_int_lt(same_c, 2);
}
END_TEST

START_TEST(test_temperature_distribution) {
    float x[4] = {0.0f, 1.0f, 2.0f, -1.0f};
    float T = 0.7f;
    double p[4], z = 0;
    for (int i = 0; i < 4; i++) z += p[i] = exp(x[i] / T);
    for (int i = 0; i < 4; i++) p[i] /= z;
    int cnt[4] = {0};
    sampling_params_t sp = {T, 0};
    cs_rng_t r;
    cs_rng_seed(&r, 9);
    const int N = 200000;
    for (int k = 0; k < N; k++) cnt[sampling_sample(x, 4, &sp, &r)]++;
    double chi2 = 0;
    for (int i = 0; i < 4; i++) chi2 += (cnt[i] - N * p[i]) * (cnt[i] - N * p[i]) / (N * p[i]);
    /* 3 degrees of freedom: P(chi2 > 16.27) = 0.001 */
    ck_assert_msg(chi2 < 16.27, "chi2 %.2f", chi2);
}
END_TEST

START_TEST(test_log_softmax) {
    float x[3] = {1000.0f, 1001.0f, 999.0f}, out[3];
    sampling_log_softmax(out, x, 3);
    double s = 0;
    for (int i = 0; i < 3; i++) s += exp(out[i]);
    ck_assert_double_eq_tol(s, 1.0, 1e-6);
    ck_assert_float_eq_tol(out[1] - out[0], 1.0f, 1e-5);
}
END_TEST

int main(void) {
    Suite *s = suite_create("sampling");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, test_argmax_ties);
    tcase_add_test(tc, test_rng_reproducible);
    tcase_add_test(tc, test_temperature_distribution);
    tcase_add_test(tc, test_log_softmax);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
