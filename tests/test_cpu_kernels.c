/* test_cpu_kernels.c: every CPU fast path against its plain reference (kernels_ref.c), on
 * odd shapes (tails, GQA, sliding window, n on both sides of the GEMV/GEMM switch) and all
 * weight dtypes. The backend runs with 1 and with 3 threads. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels/cpu_raw.h"
#include "cpu_kernels/kernels.h"
#include "cpu_kernels/kernels_paged.h"
#include "cpu_kernels/threadpool.h"
#include "cpu_kernels/wcode.h"
#include "base/quant.h"

#include <stdatomic.h>
#include "engine/sampling.h"
#include "tests/testutil.h"

static cs_rng_t rng;

/* weight of the given dtype with values rounded to that dtype */
static cs_weight_t make_weight(int rows, int cols, cs_dtype dt, void **mem) {
    size_t n = (size_t)rows * cols;
    float *f = test_randv(&rng, n, 0.5f);
    void *d;
    if (dt == CS_DTYPE_F32) d = f;
    else {
        uint16_t *h = malloc(n * 2);
        for (size_t i = 0; i < n; i++) h[i] = dt == CS_DTYPE_BF16 ? cs_f32_to_bf16(f[i]) : cs_f32_to_f16(f[i]);
        free(f);
        d = h;
    }
    *mem = d;
    return (cs_weight_t){dt, rows, cols, d, NULL, NULL};
}

static cpu_raw_t *be_for(int threads) { return cpu_raw_new(&(cpu_backend_params_t){.n_threads = threads}); }

START_TEST(test_matmul_vs_ref) {
    static const int shapes[][3] = {{1, 64, 64}, {1, 37, 53}, {3, 100, 96}, {4, 17, 33}, {8, 64, 1024},
                                    {9, 130, 70}, {33, 256, 200}, {64, 48, 16}, {40, 70, 1000}};
    static const cs_dtype dts[] = {CS_DTYPE_F32, CS_DTYPE_BF16, CS_DTYPE_F16};
    for (int th = 1; th <= 3; th += 2) {
        cpu_raw_t *be = be_for(th);
        for (size_t s = 0; s < CS_ARRAY_LEN(shapes); s++)
            for (size_t d = 0; d < CS_ARRAY_LEN(dts); d++) {
                int n = shapes[s][0], rows = shapes[s][1], cols = shapes[s][2];
                void *mem;
                cs_weight_t w = make_weight(rows, cols, dts[d], &mem);
                float *x = test_randv(&rng, (size_t)n * cols, 1.0f), *bias = test_randv(&rng, (size_t)rows, 0.1f);
                float *y = malloc(sizeof(float) * n * rows), *yr = malloc(sizeof(float) * n * rows);
                for (int use_bias = 0; use_bias < 2; use_bias++) {
                    cpu_raw_matmul(be, y, x, n, &w, use_bias ? bias : NULL);
                    cs_matmul_ref(yr, x, n, &w, use_bias ? bias : NULL);
                    float e = test_max_rel_err(y, yr, (size_t)n * rows);
                    ck_assert_msg(e < 1e-5f, "matmul n=%d %dx%d %s threads=%d: rel err %g", n, rows, cols,
                                  cs_dtype_name(dts[d]), th, e);
                }
                free(mem); free(x); free(bias); free(y); free(yr);
            }
        cpu_raw_free(be);
    }
}
END_TEST

/* every n from 1 to 70 (GEMV, AMX with 3 and with 2 terms of x, OpenBLAS) on random shapes
 * with rows and cols that are and are not multiples of 8/16/32, all dtypes, with and without
 * bias. The worst error of each path is printed: exact paths (F32 arithmetic, or BF16 x in
 * three terms, the default) sit near 1e-7; two BF16 terms (CS_AMX_TERMS=2, above
 * CS_AMX_SMALL_N rows) leave x's residual below 2^-16 relative. */
START_TEST(test_matmul_sweep) {
    static const cs_dtype dts[] = {CS_DTYPE_F32, CS_DTYPE_BF16, CS_DTYPE_F16};
    static const int dims[] = {1, 5, 16, 31, 32, 33, 48, 64, 67, 100, 128, 131};
    /* the kernels this CPU has, the AVX2 ones (packed GEMM in 8 lanes), OpenBLAS for prefill */
    static const cpu_backend_params_t variants[] = {{.n_threads = 3}, {.n_threads = 3, .no_avx512 = true},
                                                    {.n_threads = 3, .no_packed = true},
                                                    {.n_threads = 3, .gemv_streams = 4},
                                                    {.n_threads = 3, .gemv_streams = 8},
                                                    {.n_threads = 3, .no_avx512 = true, .gemv_streams = 4},
                                                    {.n_threads = 3, .no_split = true}};
    for (size_t v = 0; v < CS_ARRAY_LEN(variants); v++) {
        float worst[3][2] = {{0}};  /* [dtype][n <= CS_AMX_SMALL_N, n > CS_AMX_SMALL_N] */
        cpu_raw_t *be = cpu_raw_new(&variants[v]);
        for (int n = 1; n <= 70; n++)
            for (size_t d = 0; d < CS_ARRAY_LEN(dts); d++) {
                int rows = dims[cs_rng_next(&rng) % CS_ARRAY_LEN(dims)] + (int)(cs_rng_next(&rng) % 3);
                int cols = dims[cs_rng_next(&rng) % CS_ARRAY_LEN(dims)] + (int)(cs_rng_next(&rng) % 40);
                void *mem;
                cs_weight_t w = make_weight(rows, cols, dts[d], &mem);
                float *x = test_randv(&rng, (size_t)n * cols, 1.0f);
                float *bias = n % 2 ? test_randv(&rng, (size_t)rows, 0.1f) : NULL;
                float *y = malloc(sizeof(float) * n * rows), *yr = malloc(sizeof(float) * n * rows);
                cpu_raw_matmul(be, y, x, n, &w, bias);
                cs_matmul_ref(yr, x, n, &w, bias);
                float e = test_max_rel_err(y, yr, (size_t)n * rows);
                bool big = n > CS_AMX_SMALL_N;
                worst[d][big] = fmaxf(worst[d][big], e);
                /* BF16 with two terms of x (CS_AMX_TERMS=2): ~2^-17 relative per element, 3e-6 seen */
                ck_assert_msg(e < (dts[d] == CS_DTYPE_BF16 && big && getenv("CS_AMX_TERMS") ? 5e-6f : 2e-6f), "matmul n=%d %dx%d %s: rel err %g", n,
                              rows, cols, cs_dtype_name(dts[d]), e);
                free(mem); free(x); free(bias); free(y); free(yr);
            }
        for (size_t d = 0; d < CS_ARRAY_LEN(dts); d++)
            printf("matmul sweep %s %s: max rel err %.3g (n <= %d), %.3g (n > %d)\n", cpu_raw_path(be), cs_dtype_name(dts[d]),
                   worst[d][0], CS_AMX_SMALL_N, worst[d][1], CS_AMX_SMALL_N);
        cpu_raw_free(be);
    }
}
END_TEST

/* the AMX kernel itself, both term counts, on shapes with every kind of tail; skipped
 * where the CPU has no AMX */
START_TEST(test_gemm_bf16_amx) {
    if (!cs_cpu_has_amx_bf16()) return;
    static const int shapes[][3] = {{2, 16, 32}, {17, 33, 31}, {32, 64, 64}, {70, 100, 333}, {130, 96, 1000}};
    for (size_t s = 0; s < CS_ARRAY_LEN(shapes); s++)
        for (int terms = 2; terms <= 3; terms++) {
            int n = shapes[s][0], rows = shapes[s][1], cols = shapes[s][2];
            void *mem;
            cs_weight_t w = make_weight(rows, cols, CS_DTYPE_BF16, &mem);
            float *x = test_randv(&rng, (size_t)n * cols, 1.0f);
            float *y = malloc(sizeof(float) * n * rows), *yr = malloc(sizeof(float) * n * rows);
            uint16_t *xp = cs_aligned_alloc(64, 2 * cs_gemm_bf16_xp_len(n, cols, terms));
            uint16_t *wp = cs_aligned_alloc(64, 2 * cs_gemm_bf16_wp_len(n, rows, cols, terms));
            cs_gemm_bf16_pack_x(xp, x, n, cols, terms, 0, (n + 31) / 32 * 2);
            /* two calls over a split of the rows, as two tasks would */
            int half = rows / 2;
            cs_gemm_bf16_amx(y, rows, xp, n, terms, &w, 0, half, wp);
            cs_gemm_bf16_amx(y, rows, xp, n, terms, &w, half, rows, wp);
            cs_matmul_ref(yr, x, n, &w, NULL);
            float e = test_max_rel_err(y, yr, (size_t)n * rows);
            printf("amx n=%d %dx%d terms=%d: max rel err %.3g\n", n, rows, cols, terms, e);
            ck_assert_msg(e < (terms == 3 ? 1e-6f : 5e-6f), "amx n=%d %dx%d terms=%d: rel err %g", n, rows, cols, terms, e);
            free(mem); free(x); free(y); free(yr); free(xp); free(wp);
        }
}
END_TEST

/* the AVX512-BF16 kernel itself (skipped where the CPU lacks it): one term against the
 * reference on x rounded to BF16, two and three against x itself, small n (x in the lanes)
 * and large n (packed weights), every kind of tail, rows split into two calls at an odd row */
START_TEST(test_gemm_dpbf16) {
    if (!cs_cpu_has_avx512_bf16()) return;
    static const int shapes[][3] = {{2, 16, 32}, {5, 9, 7}, {16, 33, 64}, {17, 40, 31}, {32, 64, 64}, {33, 100, 333},
                                    {40, 31, 2}, {70, 100, 333}, {130, 96, 1000}, {8, 40, 1001}, {32, 24, 2816},
                                    /* the lane kernel (n ≤ 8): every J, the row's end inside a step */
                                    {1, 17, 45}, {1, 9, 64}, {2, 5, 33}, {3, 20, 130}, {4, 33, 66}, {4, 8, 5},
                                    {6, 8, 3}, {7, 50, 1024}, {8, 19, 2}, {8, 64, 160},
                                    /* one group of 16 (rows from streams) with an odd K */
                                    {12, 40, 31}, {16, 37, 123}};
    for (size_t s = 0; s < CS_ARRAY_LEN(shapes); s++)
        for (int terms = 1; terms <= 3; terms++) {
            int n = shapes[s][0], rows = shapes[s][1], cols = shapes[s][2];
            void *mem;
            cs_weight_t w = make_weight(rows, cols, CS_DTYPE_BF16, &mem);
            float *x = test_randv(&rng, (size_t)n * cols, 1.0f), *xr = malloc(sizeof(float) * n * cols);
            float *y = malloc(sizeof(float) * n * rows), *yr = malloc(sizeof(float) * n * rows);
            uint16_t *xp = cs_aligned_alloc(64, 2 * cs_dpbf16_xp_len(n, cols, terms));
            uint16_t *wp = cs_aligned_alloc(64, 2 * cs_dpbf16_wp_len(n, rows, cols) + 64);
            int padded = cs_dpbf16_padded_rows(n), half = rows / 2 | 1;
            /* packed in two calls, as two tasks would */
            cs_dpbf16_pack_x(xp, x, n, cols, terms, 0, padded / 2);
            cs_dpbf16_pack_x(xp, x, n, cols, terms, padded / 2, padded);
            { /* the same bytes packed row by row (the plain path) and in one call (whole groups
               * of 16 rows go through a transpose) */
                size_t len = 2 * cs_dpbf16_xp_len(n, cols, terms);
                uint16_t *xa = cs_aligned_alloc(64, len), *xb = cs_aligned_alloc(64, len);
                memset(xa, 0xff, len);
                memset(xb, 0xff, len);
                cs_dpbf16_pack_x(xa, x, n, cols, terms, 0, padded);
                for (int r = 0; r < padded; r++) cs_dpbf16_pack_x(xb, x, n, cols, terms, r, r + 1);
                ck_assert_msg(!memcmp(xa, xb, len), "dpbf16 pack n=%d cols=%d terms=%d: paths differ", n, cols, terms);
                free(xa); free(xb);
            }
            cs_gemm_dpbf16(y, rows, xp, n, terms, &w, 0, CS_MIN(half, rows), wp);
            if (half < rows) cs_gemm_dpbf16(y, rows, xp, n, terms, &w, half, rows, wp);
            if (terms == 1) cs_round_bf16_ref(xr, x, (size_t)n * cols);
            else memcpy(xr, x, sizeof(float) * n * cols);
            cs_matmul_ref(yr, xr, n, &w, NULL);
            float e = test_max_rel_err(y, yr, (size_t)n * rows);
            printf("dpbf16 n=%d %dx%d terms=%d: max rel err %.3g\n", n, rows, cols, terms, e);
            ck_assert_msg(e < (terms == 2 ? 5e-6f : 1e-6f), "dpbf16 n=%d %dx%d terms=%d: rel err %g", n, rows, cols,
                          terms, e);
            free(mem); free(x); free(xr); free(y); free(yr); free(xp); free(wp);
        }
}
END_TEST

/* --precision bf16: every backend variant (the kernels this CPU has, AVX512-BF16 switched
 * off, AVX2, plain loops, batch-invariant, reference) against the reference on x rounded to
 * BF16 for BF16 weights and on x itself for F32/F16 weights, n on both sides of every
 * switch, through matmul and matmul_multi */
START_TEST(test_matmul_precision_bf16) {
    static const cpu_backend_params_t variants[] = {
        {.n_threads = 3, .precision_bf16 = true},
        {.n_threads = 2, .precision_bf16 = true, .no_dpbf16 = true},
        {.n_threads = 2, .precision_bf16 = true, .no_amx = true},
        {.n_threads = 2, .precision_bf16 = true, .no_avx512 = true},
        {.n_threads = 2, .precision_bf16 = true, .no_avx512 = true, .no_avx2 = true},
        {.n_threads = 2, .precision_bf16 = true, .batch_invariant = true},
        {.n_threads = 1, .precision_bf16 = true, .reference = true},
    };
    static const cs_dtype dts[] = {CS_DTYPE_BF16, CS_DTYPE_F32, CS_DTYPE_F16};
    static const int ns[] = {1, 2, 7, 16, 17, 32, 33, 45, 64, 100};
    for (size_t v = 0; v < CS_ARRAY_LEN(variants); v++) {
        cpu_raw_t *be = cpu_raw_new(&variants[v]);
        float worst = 0;
        for (size_t k = 0; k < CS_ARRAY_LEN(ns); k++)
            for (size_t d = 0; d < CS_ARRAY_LEN(dts); d++) {
                int n = ns[k], rows = 40 + (int)(cs_rng_next(&rng) % 90), cols = 30 + (int)(cs_rng_next(&rng) % 300);
                void *mem, *mem2;
                cs_weight_t w = make_weight(rows, cols, dts[d], &mem), w2 = make_weight(rows / 2, cols, dts[d], &mem2);
                float *x = test_randv(&rng, (size_t)n * cols, 1.0f), *xr = malloc(sizeof(float) * n * cols);
                float *y = malloc(sizeof(float) * n * rows), *yr = malloc(sizeof(float) * n * rows);
                float *y2 = malloc(sizeof(float) * n * rows), *yr2 = malloc(sizeof(float) * n * rows);
                if (dts[d] == CS_DTYPE_BF16) cs_round_bf16_ref(xr, x, (size_t)n * cols);
                else memcpy(xr, x, sizeof(float) * n * cols);
                cpu_raw_matmul(be, y, x, n, &w, NULL);
                cs_matmul_ref(yr, xr, n, &w, NULL);
                float e = test_max_rel_err(y, yr, (size_t)n * rows);
                const cs_weight_t *ws[2] = {&w, &w2};
                float *ys[2] = {y, y2};
                float *bias2 = test_randv(&rng, (size_t)(rows / 2), 1.0f); /* one of the two with a bias */
                const float *bs[2] = {NULL, bias2};
                cpu_raw_matmul_multi(be, ys, x, n, ws, bs, 2);
                cs_matmul_ref(yr2, xr, n, &w2, bias2);
                e = fmaxf(e, fmaxf(test_max_rel_err(y, yr, (size_t)n * rows),
                                   test_max_rel_err(y2, yr2, (size_t)n * (rows / 2))));
                worst = fmaxf(worst, e);
                ck_assert_msg(e < 2e-6f, "precision bf16 (%s) n=%d %dx%d %s: rel err %g", cpu_raw_path(be), n, rows,
                              cols, cs_dtype_name(dts[d]), e);
                free(mem); free(mem2); free(x); free(xr); free(y); free(yr); free(y2); free(yr2); free(bias2);
            }
        printf("precision bf16 %s: max rel err %.3g\n", cpu_raw_path(be), worst);
        cpu_raw_free(be);
    }
    /* the rounding itself: the AVX-512 and AVX2 loops equal the plain one, ties to even included */
    for (int isa = 0; isa < 2; isa++) {
        if (isa == 0 ? !cs_cpu_has_avx512() : !cs_cpu_has_avx2()) continue;
        size_t count = 1003; /* a tail for both vector widths */
        float *x = test_randv(&rng, count, 3.0f), *a = malloc(count * sizeof(float)), *b = malloc(count * sizeof(float));
        x[0] = cs_bf16_to_f32(0x3f81) + ldexpf(1, -8);   /* halfway (the ulp is 2^-7), odd below: rounds up */
        x[1] = cs_bf16_to_f32(0x3f80) + ldexpf(1, -8);   /* halfway, even below: stays */
        uint32_t nans[3] = {0x7fffffffu, 0xffffffffu, 0x7f800001u};     /* NaNs that a carry would wreck */
        for (int k = 0; k < 3; k++) memcpy(&x[2 + k], &nans[k], 4);
        /* Inf, -Inf, the largest finite values (round up to ±Inf), a denormal, -0 in the vectors */
        uint32_t edge[7] = {0x7f800000u, 0xff800000u, 0x7f7fffffu, 0xff7fffffu, 0x00018000u, 0x80000000u, 0x3f808000u};
        for (int k = 0; k < 7; k++) memcpy(&x[5 + k], &edge[k], 4);
        memcpy(&x[count - 1], &nans[0], 4); /* and in the tail */
        x[count - 2] = x[0];
        if (isa == 0) cs_round_bf16_avx512(a, x, count);
        else cs_round_bf16_avx2(a, x, count);
        cs_round_bf16_ref(b, x, count);
        ck_assert(!memcmp(a, b, count * sizeof(float)));
        ck_assert_float_eq(a[0], cs_bf16_to_f32(0x3f82));
        ck_assert_float_eq(a[1], cs_bf16_to_f32(0x3f80));
        for (int k = 0; k < 3; k++) ck_assert(isnan(a[2 + k]));
        free(x); free(a); free(b);
    }
}
END_TEST

START_TEST(test_attention_vs_ref) {
    static const int cfg[][6] = {
        /* n, pos0, heads, kv heads, head_dim, window */
        {1, 0, 4, 4, 64, 0}, {1, 37, 8, 2, 64, 0}, {19, 0, 6, 3, 32, 0}, {5, 11, 4, 1, 48, 0},
        {40, 0, 4, 2, 64, 8}, {1, 70, 4, 4, 16, 16}, {64, 3, 2, 2, 128, 0},
        /* the GEMM path (n >= 16): several query blocks, a cache prefix, windows */
        {150, 0, 4, 2, 64, 0}, {70, 33, 8, 2, 32, 0}, {130, 5, 4, 4, 16, 20}, {16, 100, 2, 1, 64, 50},
        {200, 0, 3, 3, 24, 64}};
    cpu_raw_t *be = be_for(3);
    for (size_t c = 0; c < CS_ARRAY_LEN(cfg); c++) {
        int n = cfg[c][0], pos0 = cfg[c][1], nh = cfg[c][2], nkv = cfg[c][3], hd = cfg[c][4], win = cfg[c][5];
        size_t L = (size_t)(pos0 + n);
        float *q = test_randv(&rng, (size_t)n * nh * hd, 1.0f), *k = test_randv(&rng, L * nkv * hd, 1.0f);
        float *v = test_randv(&rng, L * nkv * hd, 1.0f);
        float *o = malloc(sizeof(float) * n * nh * hd), *orf = malloc(sizeof(float) * n * nh * hd);
        cpu_raw_attention(be, o, q, k, v, n, pos0, nh, nkv, hd, win);
        cs_attention_ref(orf, q, k, v, n, pos0, nh, nkv, hd, win);
        float e = test_max_rel_err(o, orf, (size_t)n * nh * hd);
        ck_assert_msg(e < 1e-5f, "attention case %zu: rel err %g", c, e);
        free(q); free(k); free(v); free(o); free(orf);
    }
    cpu_raw_free(be);
}
END_TEST

/* the reference attention itself against a direct softmax computed in double */
START_TEST(test_attention_ref_definition) {
    int n = 3, nh = 2, nkv = 1, hd = 4;
    float *q = test_randv(&rng, (size_t)n * nh * hd, 1.0f), *k = test_randv(&rng, (size_t)n * nkv * hd, 1.0f);
    float *v = test_randv(&rng, (size_t)n * nkv * hd, 1.0f);
    float o[3 * 2 * 4];
    cs_attention_ref(o, q, k, v, n, 0, nh, nkv, hd, 0);
    for (int i = 0; i < n; i++)
        for (int h = 0; h < nh; h++) {
            double s[3], mx = -1e30, sum = 0;
            for (int j = 0; j <= i; j++) {
                double d = 0;
                for (int t = 0; t < hd; t++) d += (double)q[(i * nh + h) * hd + t] * k[j * hd + t];
                s[j] = d / 2.0; /* sqrt(4) */
                if (s[j] > mx) mx = s[j];
            }
            for (int j = 0; j <= i; j++) { s[j] = exp(s[j] - mx); sum += s[j]; }
            for (int t = 0; t < hd; t++) {
                double want = 0;
                for (int j = 0; j <= i; j++) want += s[j] / sum * v[j * hd + t];
                ck_assert_double_eq_tol(o[(i * nh + h) * hd + t], want, 1e-5);
            }
        }
    free(q); free(k); free(v);
}
END_TEST

START_TEST(test_lora_vs_ref) {
    cpu_raw_t *be = be_for(3);
    static const int cfg[][4] = {{1, 8, 64, 96}, {7, 16, 100, 40}, {33, 64, 128, 128}, {2, 1, 5, 3}};
    for (size_t c = 0; c < CS_ARRAY_LEN(cfg); c++) {
        int n = cfg[c][0], r = cfg[c][1], din = cfg[c][2], dout = cfg[c][3];
        float *x = test_randv(&rng, (size_t)n * din, 1), *a = test_randv(&rng, (size_t)r * din, 0.3f);
        float *b = test_randv(&rng, (size_t)dout * r, 0.3f);
        float *y = test_randv(&rng, (size_t)n * dout, 1), *yr = malloc(sizeof(float) * n * dout);
        memcpy(yr, y, sizeof(float) * n * dout);
        cpu_raw_lora(be, y, x, n, a, b, r, din, dout, 1.5f);
        cs_lora_ref(yr, x, n, a, b, r, din, dout, 1.5f);
        float e = test_max_rel_err(y, yr, (size_t)n * dout);
        ck_assert_msg(e < 1e-5f, "lora case %zu: rel err %g", c, e);
        free(x); free(a); free(b); free(y); free(yr);
    }
    cpu_raw_free(be);
}
END_TEST

START_TEST(test_norm_rope_silu) {
    cpu_raw_t *be = be_for(3);
    int n = 70, dim = 320;
    float *x = test_randv(&rng, (size_t)n * dim, 2), *w = test_randv(&rng, (size_t)dim, 1);
    float *y = malloc(sizeof(float) * n * dim), *yr = malloc(sizeof(float) * n * dim);
    cs_weight_t nw = {CS_DTYPE_F32, 1, dim, w, NULL, NULL};
    cpu_raw_rmsnorm(be, y, x, n, dim, &nw, 1e-6f);
    cs_rmsnorm_ref(yr, x, n, dim, w, 1e-6f);
    ck_assert_float_lt(test_max_rel_err(y, yr, (size_t)n * dim), 1e-6f);
    /* RoPE: rotation preserves the norm of each (j, j + half) pair and position 0 is identity */
    int nh = 5, hd = 64;
    float inv[32];
    for (int j = 0; j < 32; j++) inv[j] = 1.0f / powf(10000.0f, (float)(2 * j) / hd);
    int32_t pos[70];
    for (int i = 0; i < n; i++) pos[i] = i * 3;
    float *r1 = test_randv(&rng, (size_t)n * nh * hd, 1), *r2 = malloc(sizeof(float) * n * nh * hd);
    memcpy(r2, r1, sizeof(float) * n * nh * hd);
    cpu_raw_rope(be, r1, n, nh, hd, pos, inv);
    cs_rope_ref(r2, n, nh, hd, pos, inv);
    ck_assert_float_lt(test_max_rel_err(r1, r2, (size_t)n * nh * hd), 1e-6f);
    /* the backend's SwiGLU (AVX2 where the CPU has it) against the plain loop, with gates
     * out to where e^-g overflows and underflows */
    size_t ns = 20011;
    float *g1 = test_randv(&rng, ns, 30), *g2 = malloc(sizeof(float) * ns), *u1 = test_randv(&rng, ns, 2);
    g1[5] = -120.0f; g1[6] = 120.0f; g1[7] = 0.0f;
    memcpy(g2, g1, sizeof(float) * ns);
    cpu_raw_silu_mul(be, g1, u1, ns);
    cs_silu_mul_ref(g2, u1, ns);
    for (size_t i = 0; i < ns; i++)
        ck_assert_msg(fabsf(g1[i] - g2[i]) <= 4e-7f * fabsf(g2[i]) + 1e-30f, "silu [%zu]: %g vs %g", i, g1[i], g2[i]);
    free(g1); free(g2); free(u1);
    float g[3] = {0, 1, -2}, u[3] = {1, 2, 3};
    cs_silu_mul_ref(g, u, 3);
    ck_assert_float_eq_tol(g[0], 0, 1e-7);
    ck_assert_float_eq_tol(g[1], 2 * (1 / (1 + expf(-1))), 1e-6);
    ck_assert_float_eq_tol(g[2], 3 * (-2 / (1 + expf(2))), 1e-6);
    free(x); free(w); free(y); free(yr); free(r1); free(r2);
    cpu_raw_free(be);
}
END_TEST

/* every task of every run executes exactly once, over many short back-to-back runs (the
 * decode pattern), whatever the pool size */
struct tp_job { atomic_int *hits; int run; };
static void tp_task(void *p, int task, int thread) {
    struct tp_job *j = p;
    (void)thread;
    atomic_fetch_add(&j->hits[task], j->run);
}

START_TEST(test_threadpool_exactly_once) {
    for (int n = 1; n <= 4; n++) {
        threadpool_t *tp = threadpool_new(n);
        ck_assert_ptr_nonnull(tp);
        atomic_int hits[64];
        for (int run = 1; run <= 20000; run++) {
            int tasks = 1 + (int)(cs_rng_next(&rng) % 40);
            for (int t = 0; t < tasks; t++) atomic_store(&hits[t], 0);
            struct tp_job j = {hits, run};
            threadpool_run(tp, tasks, tp_task, &j);
            for (int t = 0; t < tasks; t++)
                ck_assert_msg(atomic_load(&hits[t]) == run, "pool %d run %d task %d: %d", n, run, t, atomic_load(&hits[t]));
        }
        threadpool_free(tp);
    }
}
END_TEST

/* the batch-1 BF16 GEMV in both tunings (8 or 6 row streams, and 4), called directly on row
 * ranges that leave 0 to S-1 rows over for the one-row loop, with every column tail, against
 * the plain reference. Skipped for an ISA the CPU lacks. */
START_TEST(test_gemv_streams) {
    static const int rowss[] = {1, 3, 4, 5, 7, 8, 9, 13, 31, 33, 100, 257};
    static const int colss[] = {1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 1031};
    typedef void (*rows_fn)(float *, int, const float *, int, const cs_weight_t *, int, int);
    struct { const char *name; rows_fn fn; bool ok; } fns[] = {
        {"avx512", cs_gemv_rows_avx512, cs_cpu_has_avx512()}, {"avx512_s4", cs_gemv_rows_avx512_s4, cs_cpu_has_avx512()},
        {"avx2", cs_gemv_rows_avx2, cs_cpu_has_avx2()}, {"avx2_s4", cs_gemv_rows_avx2_s4, cs_cpu_has_avx2()}};
    for (size_t f = 0; f < CS_ARRAY_LEN(fns); f++) {
        if (!fns[f].ok) continue;
        float worst = 0;
        for (size_t ri = 0; ri < CS_ARRAY_LEN(rowss); ri++)
            for (size_t ci = 0; ci < CS_ARRAY_LEN(colss); ci++) {
                int rows = rowss[ri], cols = colss[ci];
                void *mem;
                cs_weight_t w = make_weight(rows, cols, CS_DTYPE_BF16, &mem);
                float *x = test_randv(&rng, (size_t)cols, 1.0f), *y = malloc(sizeof(float) * rows);
                float *yr = malloc(sizeof(float) * rows);
                int a = (int)(cs_rng_next(&rng) % (unsigned)(rows + 1)), b = a + (int)(cs_rng_next(&rng) % (unsigned)(rows - a + 1));
                fns[f].fn(y, rows, x, 1, &w, 0, a); /* three ranges, as three tasks would take them */
                fns[f].fn(y, rows, x, 1, &w, a, b);
                fns[f].fn(y, rows, x, 1, &w, b, rows);
                cs_matmul_ref(yr, x, 1, &w, NULL);
                /* against the sum of |terms| (a lone row's sum may cancel to near 0) */
                float scale = 1e-30f, e = 0;
                for (int r = 0; r < rows; r++) {
                    float t = 0;
                    for (int c = 0; c < cols; c++) t += fabsf(cs_bf16_to_f32(((const uint16_t *)w.data)[(size_t)r * cols + c]) * x[c]);
                    scale = fmaxf(scale, t);
                }
                for (int r = 0; r < rows; r++) e = fmaxf(e, fabsf(y[r] - yr[r]) / scale);
                worst = fmaxf(worst, e);
                ck_assert_msg(e < 1e-6f, "gemv %s %dx%d (ranges 0-%d-%d-%d): error %g of the sum of |terms|", fns[f].name,
                              rows, cols, a, b, rows, e);
                free(mem); free(x); free(y); free(yr);
            }
        printf("gemv %s: max error %.3g of the sum of |terms|\n", fns[f].name, worst);
    }
}
END_TEST

/* BF16 matrices for the 12-bit coding: kind 0 weights of N(0, 0.5)-like spread (few high
 * bytes), 1 any finite bits (every high byte but NaN/Inf's: exceptions everywhere), 2 a mix
 * of few high bytes with specials sprinkled in (+0, -0, tiny values of high byte 0x00,
 * Inf, NaN, huge), 3 all zero */
static uint16_t *wcode_matrix(int rows, int cols, int kind) {
    size_t n = (size_t)rows * cols;
    uint16_t *h = malloc(n * 2 + 2);
    static const uint16_t special[] = {0x0000, 0x8000, 0x0001, 0x007f, 0x7f80, 0xff80, 0x7fc1, 0x7f7f, 0xc2f7, 0x3f80};
    for (size_t i = 0; i < n; i++) {
        uint32_t r = (uint32_t)cs_rng_next(&rng);
        if (kind == 3) h[i] = 0;
        else if (kind == 1) { h[i] = (uint16_t)r; if ((h[i] & 0x7f80) == 0x7f80) h[i] ^= 0x0100; }
        else if (kind == 2 && r % 7 == 0) h[i] = special[(r >> 8) % CS_ARRAY_LEN(special)];
        else h[i] = cs_f32_to_bf16((float)(cs_rng_uniform(&rng) * 2 - 1) * 0.5f);
    }
    return h;
}

/* every bit back: the plain decode, the threaded coder against the one-thread one, and
 * where the exceptions sit */
START_TEST(test_wcode_roundtrip) {
    static const int rowss[] = {1, 2, 5, 33, 130};
    static const int colss[] = {1, 3, 17, 63, 64, 65, 127, 130, 1000};
    cpu_raw_t *be = be_for(3);
    size_t total = 0, exc = 0;
    for (int kind = 0; kind < 4; kind++)
        for (size_t ri = 0; ri < CS_ARRAY_LEN(rowss); ri++)
            for (size_t ci = 0; ci < CS_ARRAY_LEN(colss); ci++) {
                int rows = rowss[ri], cols = colss[ci];
                uint16_t *w = wcode_matrix(rows, cols, kind), *back = malloc(sizeof *back * (size_t)cols);
                cs_wcode_t *c = cs_wcode_new(w, rows, cols);
                ck_assert_ptr_nonnull(c);
                ck_assert_int_eq(c->blocks, (cols + 127) / 128 * 2);
                ck_assert_int_eq(c->table[CS_WCODE_ESC], 0);
                for (int r = 0; r < rows; r++) {
                    cs_wcode_decode_row_ref(c, r, back);
                    for (int col = 0; col < cols; col++)
                        ck_assert_msg(back[col] == w[(size_t)r * cols + col], "kind %d %dx%d: [%d,%d] %04x back as %04x", kind,
                                      rows, cols, r, col, w[(size_t)r * cols + col], back[col]);
                }
                /* the row-range decoders (the batch kernels' input where only the code is kept),
                 * on ranges as tasks take them, each beside a guard that must stay untouched */
                {
                    typedef void (*dec_fn)(uint16_t *, const cs_wcode_t *, int, int);
                    struct { const char *name; dec_fn fn; bool ok; } decs[] = {
                        {"ref", cs_wcode_decode_rows_ref, true},
                        {"avx512", cs_wcode_decode_rows_avx512, cs_cpu_has_avx512()},
                        {"avx2", cs_wcode_decode_rows_avx2, cs_cpu_has_avx2()}};
                    int cuts[][2] = {{0, rows}, {rows / 3, rows - rows / 4}, {rows - 1, rows}};
                    uint16_t *d = malloc(sizeof *d * ((size_t)rows * cols + 8));
                    for (size_t f = 0; f < CS_ARRAY_LEN(decs); f++) {
                        if (!decs[f].ok) continue;
                        for (size_t k = 0; k < CS_ARRAY_LEN(cuts); k++) {
                            int a = cuts[k][0], z = cuts[k][1];
                            size_t len = (size_t)(z - a) * cols;
                            for (size_t i = 0; i < len + 8; i++) d[i] = 0xabcd;
                            decs[f].fn(d, c, a, z);
                            ck_assert_msg(!memcmp(d, w + (size_t)a * cols, sizeof *d * len),
                                          "decode_rows %s kind %d %dx%d rows [%d, %d)", decs[f].name, kind, rows, cols, a, z);
                            for (size_t i = len; i < len + 8; i++) ck_assert_uint_eq(d[i], 0xabcd);
                        }
                    }
                    free(d);
                }
                /* an exception is a weight whose high byte is neither in the table nor 0x00 */
                size_t want = 0;
                for (size_t i = 0; i < (size_t)rows * cols; i++) {
                    int hb = w[i] >> 8;
                    bool in = hb == 0;
                    for (int k = 0; k < CS_WCODE_ESC; k++) in |= c->table[k] && c->table[k] == hb;
                    want += !in;
                }
                ck_assert_uint_eq(c->n_exc, want);
                if (kind == 0 && rows * cols >= 64 * 33) ck_assert_uint_lt(c->n_exc, (size_t)rows * cols / 100);
                if (kind == 3) ck_assert_uint_eq(c->n_exc, 0);
                cs_weight_t wt = {CS_DTYPE_BF16, rows, cols, w, NULL, NULL};
                cs_wcode_t *t = cpu_raw_wcode_new(be, &wt);
                ck_assert_ptr_nonnull(t);
                ck_assert_mem_eq(t->table, c->table, 16);
                ck_assert_uint_eq(t->n_exc, c->n_exc);
                ck_assert(!memcmp(t->data, c->data, (size_t)rows * c->blocks * CS_WCODE_BLOCK_BYTES));
                ck_assert(!memcmp(t->exc_row, c->exc_row, sizeof(uint32_t) * ((size_t)rows + 1)));
                if (c->n_exc) {
                    ck_assert(!memcmp(t->exc_col, c->exc_col, sizeof(uint32_t) * c->n_exc));
                    ck_assert(!memcmp(t->exc_val, c->exc_val, sizeof(float) * c->n_exc));
                }
                total += (size_t)rows * cols;
                exc += c->n_exc;
                cs_wcode_free(t);
                cs_wcode_free(c);
                free(w); free(back);
            }
    cpu_raw_free(be);
    printf("wcode: %zu weights coded and decoded bit for bit, %zu exceptions\n", total, exc);
}
END_TEST

/* the coded GEMV kernels (both stream counts) against the plain coded GEMV and against the
 * BF16 reference matmul on the same weights, on row ranges as tasks take them; and through
 * the backend (cs_weight_t.code at n = 1) against the backend on the plain weights */
START_TEST(test_wcode_gemv) {
    static const int rowss[] = {1, 3, 4, 5, 8, 9, 31, 33, 100};
    static const int colss[] = {1, 15, 63, 64, 65, 100, 130, 1031};
    typedef void (*gemv_fn)(float *, const float *, const cs_wcode_t *, int, int, int);
    struct { const char *name; gemv_fn fn; int streams; bool ok; } fns[] = {
        {"avx512_s4", cs_wcode_gemv_avx512, 4, cs_cpu_has_avx512()}, {"avx512_s8", cs_wcode_gemv_avx512, 8, cs_cpu_has_avx512()},
        {"avx2_s4", cs_wcode_gemv_avx2, 4, cs_cpu_has_avx2()}, {"avx2_s6", cs_wcode_gemv_avx2, 6, cs_cpu_has_avx2()}};
    float worst[CS_ARRAY_LEN(fns)] = {0};
    for (int kind = 0; kind < 3; kind += 2)
        for (size_t ri = 0; ri < CS_ARRAY_LEN(rowss); ri++)
            for (size_t ci = 0; ci < CS_ARRAY_LEN(colss); ci++) {
                int rows = rowss[ri], cols = colss[ci];
                uint16_t *w = wcode_matrix(rows, cols, kind);
                if (kind == 2) /* no Inf, NaN or huge values: they make the sums Inf or NaN */
                    for (size_t i = 0; i < (size_t)rows * cols; i++)
                        if ((w[i] & 0x7f80) >= 0x7000) w[i] = 0x3f80;
                cs_wcode_t *c = cs_wcode_new(w, rows, cols);
                cs_weight_t wt = {CS_DTYPE_BF16, rows, cols, w, NULL, NULL};
                float *x = test_randv(&rng, (size_t)cols, 1.0f), *y = malloc(sizeof(float) * rows);
                float *yr = malloc(sizeof(float) * rows);
                float *yc = malloc(sizeof(float) * rows);
                cs_matmul_ref(yr, x, 1, &wt, NULL);
                cs_wcode_gemv_ref(yc, x, c, 0, rows);
                float scale = 1e-30f;
                for (int r = 0; r < rows; r++) {
                    float t = 0;
                    for (int col = 0; col < cols; col++) t += fabsf(cs_bf16_to_f32(w[(size_t)r * cols + col]) * x[col]);
                    scale = fmaxf(scale, t);
                }
                for (int r = 0; r < rows; r++) /* the plain coded GEMV is the reference's own sum */
                    ck_assert_msg(yc[r] == yr[r], "wcode ref %dx%d row %d: %g vs %g", rows, cols, r, yc[r], yr[r]);
                for (size_t f = 0; f < CS_ARRAY_LEN(fns); f++) {
                    if (!fns[f].ok) continue;
                    int a = (int)(cs_rng_next(&rng) % (unsigned)(rows + 1)), b = a + (int)(cs_rng_next(&rng) % (unsigned)(rows - a + 1));
                    for (int r = 0; r < rows; r++) y[r] = NAN;
                    fns[f].fn(y, x, c, 0, a, fns[f].streams);
                    fns[f].fn(y, x, c, a, b, fns[f].streams);
                    fns[f].fn(y, x, c, b, rows, fns[f].streams);
                    for (int r = 0; r < rows; r++) { /* a NaN (a row not written) fails too */
                        float e = fabsf(y[r] - yr[r]) / scale;
                        ck_assert_msg(e < 1e-6f, "wcode gemv %s kind %d %dx%d (ranges 0-%d-%d-%d) row %d: error %g of the sum of |terms|",
                                      fns[f].name, kind, rows, cols, a, b, rows, r, e);
                        worst[f] = fmaxf(worst[f], e);
                    }
                }
                cs_wcode_free(c);
                free(w); free(x); free(y); free(yr); free(yc);
            }
    for (size_t f = 0; f < CS_ARRAY_LEN(fns); f++)
        if (fns[f].ok) printf("wcode gemv %s: max error %.3g of the sum of |terms|\n", fns[f].name, worst[f]);
    /* 2..CS_WCODE_MAX_N rows of x at once, against the reference row by row */
    typedef void (*rows_fn)(float *, int, const float *, int, const cs_wcode_t *, int, int, int);
    struct { const char *name; rows_fn fn; int streams; bool ok; } rfs[] = {
        {"avx512", cs_wcode_rows_avx512, 4, cs_cpu_has_avx512()}, {"avx512_s8", cs_wcode_rows_avx512, 8, cs_cpu_has_avx512()},
        {"avx2", cs_wcode_rows_avx2, 4, cs_cpu_has_avx2()}, {"avx2_s6", cs_wcode_rows_avx2, 6, cs_cpu_has_avx2()}};
    float rworst = 0;
    for (size_t ri = 0; ri < CS_ARRAY_LEN(rowss); ri++)
        for (size_t ci = 0; ci < CS_ARRAY_LEN(colss); ci++) {
            int rows = rowss[ri], cols = colss[ci];
            uint16_t *w = wcode_matrix(rows, cols, 2);
            for (size_t i = 0; i < (size_t)rows * cols; i++)
                if ((w[i] & 0x7f80) >= 0x7000) w[i] = 0x3f80;
            cs_wcode_t *c = cs_wcode_new(w, rows, cols);
            cs_weight_t wt = {CS_DTYPE_BF16, rows, cols, w, NULL, NULL};
            for (int n = 2; n <= CS_WCODE_MAX_N; n++) {
                int ldy = rows + 3; /* y's rows apart by more than rows */
                float *x = test_randv(&rng, (size_t)n * cols, 1.0f), *y = malloc(sizeof(float) * n * ldy);
                float *yr = malloc(sizeof(float) * n * rows);
                cs_matmul_ref(yr, x, n, &wt, NULL);
                for (size_t f = 0; f < CS_ARRAY_LEN(rfs); f++) {
                    if (!rfs[f].ok) continue;
                    int a = (int)(cs_rng_next(&rng) % (unsigned)(rows + 1));
                    for (int i = 0; i < n * ldy; i++) y[i] = NAN;
                    rfs[f].fn(y, ldy, x, n, c, 0, a, rfs[f].streams);
                    rfs[f].fn(y, ldy, x, n, c, a, rows, rfs[f].streams);
                    for (int i = 0; i < n; i++) {
                        float scale = 1e-30f;
                        for (int r = 0; r < rows; r++) {
                            float t = 0;
                            for (int col = 0; col < cols; col++)
                                t += fabsf(cs_bf16_to_f32(w[(size_t)r * cols + col]) * x[(size_t)i * cols + col]);
                            scale = fmaxf(scale, t);
                        }
                        for (int r = 0; r < rows; r++) {
                            float e = fabsf(y[(size_t)i * ldy + r] - yr[(size_t)i * rows + r]) / scale;
                            ck_assert_msg(e < 1e-6f, "wcode rows %s n %d %dx%d (0-%d-%d) x row %d, row %d: error %g", rfs[f].name,
                                          n, rows, cols, a, rows, i, r, e);
                            rworst = fmaxf(rworst, e);
                        }
                        for (int r = rows; r < ldy; r++) ck_assert(isnan(y[(size_t)i * ldy + r])); /* nothing past rows */
                    }
                }
                free(x); free(y); free(yr);
            }
            cs_wcode_free(c);
            free(w);
        }
    printf("wcode rows, 2..%d rows of x: max error %.3g of the sum of |terms|\n", CS_WCODE_MAX_N, rworst);
    /* through the backend: with --compress-weights up to 3 rows (AVX-512) or 4 (AVX2) read
     * the code, more the BF16 (the same bits as without the flag) */
    for (int th = 1; th <= 3; th += 2) {
        cpu_raw_t *plain = be_for(th), *coded = cpu_raw_new(&(cpu_backend_params_t){.n_threads = th, .compress_weights = true});
        ck_assert(cpu_raw_codes_weights(coded) == (cs_cpu_has_avx512() || cs_cpu_has_avx2()));
        ck_assert(!cpu_raw_codes_weights(plain));
        if (!cpu_raw_codes_weights(coded)) { cpu_raw_free(plain); cpu_raw_free(coded); continue; }
        ck_assert_ptr_nonnull(strstr(cpu_raw_path(coded), "+wc12"));
        int rows = 300, cols = 1000;
        uint16_t *w = wcode_matrix(rows, cols, 2);
        for (size_t i = 0; i < (size_t)rows * cols; i++)
            if ((w[i] & 0x7f80) >= 0x7000) w[i] = 0x3f80;
        cs_weight_t wt = {CS_DTYPE_BF16, rows, cols, w, NULL, NULL};
        cs_weight_t wc = wt;
        wc.code = cpu_raw_wcode_new(coded, &wt);
        ck_assert_ptr_nonnull(wc.code);
        for (int n = 1; n <= CS_WCODE_MAX_N + 1; n++) {
            float *x = test_randv(&rng, (size_t)n * cols, 1.0f), *y = malloc(sizeof(float) * n * rows);
            float *yp = malloc(sizeof(float) * n * rows);
            float *yr = malloc(sizeof(float) * n * rows);
            cpu_raw_matmul(coded, y, x, n, &wc, NULL);
            cpu_raw_matmul(plain, yp, x, n, &wt, NULL);
            cs_matmul_ref(yr, x, n, &wt, NULL);
            float e = test_max_rel_err(y, yr, (size_t)n * rows);
            ck_assert_msg(e < 2e-6f, "backend %d threads, n %d: coded vs reference %g", th, n, e);
            if (n > (cs_cpu_has_avx512() ? 3 : CS_WCODE_MAX_N)) /* the dot tiles on the BF16 weights: the same bits */
                ck_assert(!memcmp(y, yp, sizeof(float) * n * rows));
            free(x); free(y); free(yp); free(yr);
        }
        cs_wcode_free((cs_wcode_t *)wc.code);
        free(w);
        cpu_raw_free(plain);
        cpu_raw_free(coded);
    }
}
END_TEST

/* within 1e-6 of the sum of |terms| of each row, as the other kernel tests */
static bool code_only_close(const float *y, const float *yr, const float *x, const uint16_t *w, int n, int rows, int cols) {
    for (int i = 0; i < n; i++)
        for (int r = 0; r < rows; r++) {
            double t = 1e-30;
            for (int c = 0; c < cols; c++) t += fabs((double)cs_bf16_to_f32(w[(size_t)r * cols + c]) * x[(size_t)i * cols + c]);
            if (fabs((double)y[(size_t)i * rows + r] - yr[(size_t)i * rows + r]) > 1e-6 * t) {
                fprintf(stderr, "row %d col %d: %.9g vs %.9g (sum |terms| %g)\n", i, r, y[(size_t)i * rows + r], yr[(size_t)i * rows + r], t);
                return false;
            }
        }
    return true;
}

/* Weights kept only coded (cs_weight_t.data NULL, as after the model released the BF16
 * bytes): through the backend with --compress-weights, every path (the GEMV and coded rows,
 * in groups up to CPU_CODE_ONLY_PASS_MAX_N rows; above, each task's rows decoded for the dot
 * tiles, the packed GEMM, OpenBLAS, the AVX512-BF16 GEMMs of --precision bf16, the AVX2
 * kernels, no split, no tiles) meets the reference (on x rounded to BF16 for --precision
 * bf16), and above the groups gives the same bits as the same backend on the BF16 weights,
 * at every n from 1 to past the tiles, for matmul and matmul_multi, threads 1 and 3; and
 * embed decodes the table's rows */
START_TEST(test_wcode_code_only) {
    if (!cs_cpu_has_avx2()) return; /* --compress-weights applies to the AVX2 / AVX-512 paths only */
    struct { const char *name; cpu_backend_params_t p; } vs[] = {
        {"default", {.compress_weights_only = true}},
        {"bf16", {.compress_weights_only = true, .precision_bf16 = true}},
        {"no_avx512", {.compress_weights_only = true, .no_avx512 = true}},
        {"no_avx512_bf16", {.compress_weights_only = true, .no_avx512 = true, .precision_bf16 = true}},
        {"no_split", {.compress_weights_only = true, .no_split = true}},
        {"no_tile", {.compress_weights_only = true, .no_tile = true}},
        {"no_packed", {.compress_weights_only = true, .no_packed = true}},
        {"no_dpbf16", {.compress_weights_only = true, .no_dpbf16 = true, .precision_bf16 = true}},
    };
    static const int ns[] = {1, 2, 3, 4, 5, 7, 8, 9, 16, 31, 32, 33, 50, 100};
    static const int shapes[][2] = {{300, 1000}, {97, 65}, {130, 2050}};
    size_t checked = 0;
    for (size_t v = 0; v < CS_ARRAY_LEN(vs); v++)
        for (int th = 1; th <= 3; th += 2) {
            cpu_backend_params_t p = vs[v].p;
            p.n_threads = th;
            cpu_raw_t *be = cpu_raw_new(&p);
            ck_assert_ptr_nonnull(be);
            ck_assert(cpu_raw_codes_weights(be));
            if (!cpu_raw_code_only(be)) { /* AMX */
                ck_assert(cs_cpu_has_amx_bf16() && !p.no_avx512);
                cpu_raw_free(be);
                continue;
            }
            for (size_t s = 0; s < CS_ARRAY_LEN(shapes); s++) {
                int rows = shapes[s][0], cols = shapes[s][1];
                uint16_t *w = wcode_matrix(rows, cols, 0), *w2 = wcode_matrix(rows / 2 + 1, cols, 0);
                for (size_t i = 0; i < (size_t)rows * cols; i += 997) /* rare high bytes (tiny values): exceptions */
                    w[i] = (uint16_t)((0x20 + (i / 997) % 20) << 8 | 0x11);
                cs_weight_t wt = {CS_DTYPE_BF16, rows, cols, w, NULL, NULL}, wt2 = {CS_DTYPE_BF16, rows / 2 + 1, cols, w2, NULL, NULL};
                cs_weight_t wc = {CS_DTYPE_BF16, rows, cols, NULL, cpu_raw_wcode_new(be, &wt), NULL};
                cs_weight_t wc2 = {CS_DTYPE_BF16, rows / 2 + 1, cols, NULL, cpu_raw_wcode_new(be, &wt2), NULL};
                ck_assert(wc.code && wc2.code);
                if (rows * cols >= 100000) ck_assert_uint_gt(wc.code->n_exc, 0); /* written back too */
                cs_weight_t wb = wt, wb2 = wt2; /* the same weights, BF16 beside the code */
                wb.code = wc.code;
                wb2.code = wc2.code;
                for (size_t k = 0; k < CS_ARRAY_LEN(ns); k++) {
                    int n = ns[k];
                    size_t ny = (size_t)n * rows, ny2 = (size_t)n * wt2.rows;
                    float *x = test_randv(&rng, (size_t)n * cols, 1.0f), *y = malloc(sizeof(float) * ny);
                    float *yb = malloc(sizeof(float) * ny);
                    float *y2 = malloc(sizeof(float) * ny2), *yb2 = malloc(sizeof(float) * ny2);
                    /* the reference: x as the kernels take it (rounded for --precision bf16) */
                    float *xr = malloc(sizeof(float) * n * cols), *yr = malloc(sizeof(float) * ny),
                          *yr2 = malloc(sizeof(float) * ny2);
                    if (p.precision_bf16) cs_round_bf16_ref(xr, x, (size_t)n * cols);
                    else memcpy(xr, x, sizeof(float) * n * cols);
                    cs_matmul_ref(yr, xr, n, &wt, NULL);
                    cs_matmul_ref(yr2, xr, n, &wt2, NULL);
                    for (int multi = 0; multi < 2; multi++) {
                        if (!multi) {
                            cpu_raw_matmul(be, y, x, n, &wc, NULL);
                            cpu_raw_matmul(be, yb, x, n, &wb, NULL);
                        } else {
                            const cs_weight_t *mc[2] = {&wc, &wc2}, *mb[2] = {&wb, &wb2};
                            float *yc[2] = {y, y2}, *ybb[2] = {yb, yb2};
                            cpu_raw_matmul_multi(be, yc, x, n, mc, (const float *const[]){NULL, NULL}, 2);
                            cpu_raw_matmul_multi(be, ybb, x, n, mb, (const float *const[]){NULL, NULL}, 2);
                            ck_assert_msg(code_only_close(y2, yr2, xr, w2, n, wt2.rows, cols), "%s, %d threads, %dx%d, n %d: multi, second",
                                          vs[v].name, th, rows, cols, n);
                            if (n > CPU_CODE_ONLY_PASS_MAX_N) ck_assert(!memcmp(y2, yb2, sizeof(float) * ny2));
                        }
                        ck_assert_msg(code_only_close(y, yr, xr, w, n, rows, cols), "%s, %d threads, %dx%d, n %d, multi %d: off the reference",
                                      vs[v].name, th, rows, cols, n, multi);
                        /* above the coded kernel's groups, the BF16 path's own kernels: its bits */
                        if (n > CPU_CODE_ONLY_PASS_MAX_N)
                            ck_assert_msg(!memcmp(y, yb, sizeof(float) * ny), "%s, %d threads, %dx%d, n %d, multi %d: bits differ",
                                          vs[v].name, th, rows, cols, n, multi);
                        checked++;
                    }
                    free(xr); free(yr); free(yr2);
                    free(x); free(y); free(yb); free(y2); free(yb2);
                }
                int32_t ids[] = {0, rows - 1, rows / 2, 0};
                float *e = malloc(sizeof(float) * 4 * cols), *eb = malloc(sizeof(float) * 4 * cols);
                cpu_raw_embed(be, e, &wc, ids, 4);
                cpu_raw_embed(be, eb, &wt, ids, 4);
                ck_assert(!memcmp(e, eb, sizeof(float) * 4 * cols));
                free(e); free(eb);
                cs_wcode_free((cs_wcode_t *)wc.code);
                cs_wcode_free((cs_wcode_t *)wc2.code);
                free(w); free(w2);
            }
            cpu_raw_free(be);
        }
    printf("wcode, weights kept only coded: %zu matmuls within 1e-6 of the reference, those above %d rows of x "
           "bit-identical to the BF16 weights'\n", checked, CPU_CODE_ONLY_PASS_MAX_N);
}
END_TEST

/* the split dot tiles called directly, AVX-512 and AVX2: x's packing against a plain loop
 * (even then odd elements of each 32 or 16 columns, zero past K), y against the reference
 * for n 1..40, every tail of K and of the tiles, the weight rows split over two calls (tasks)
 * and blocks that prefetch the next ones; and batch invariance: a row alone, or any split of
 * the weight rows, gives the same bits. Each ISA skipped where the CPU lacks it. */
START_TEST(test_split_tiles) {
    static const int colss[] = {1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 257, 1030};
    static const struct {
        const char *name;
        int b; /* columns per even/odd block */
        void (*pack)(float *, const float *, int, int, int, int);
        void (*tile)(float *, int, const float *, int, const cs_weight_t *, int, int);
    } isas[] = {{"avx512", 32, cs_split_pack_x_avx512, cs_gemm_split_avx512},
                {"avx2", 16, cs_split_pack_x_avx2, cs_gemm_split_avx2}};
    for (size_t v = 0; v < CS_ARRAY_LEN(isas); v++) {
        if (v == 0 ? !cs_cpu_has_avx512() : !cs_cpu_has_avx2()) continue;
        int hb = isas[v].b / 2;
        float worst = 0;
        for (int n = 1; n <= 40; n += (n < 9 ? 1 : 5))
            for (size_t ci = 0; ci < CS_ARRAY_LEN(colss); ci++) {
                int rows = 1 + (int)(cs_rng_next(&rng) % 70), cols = colss[ci];
                size_t kp = (size_t)(cols + CS_SPLIT_B - 1) / CS_SPLIT_B * CS_SPLIT_B;
                void *mem;
                cs_weight_t w = make_weight(rows, cols, CS_DTYPE_BF16, &mem);
                float *x = test_randv(&rng, (size_t)n * cols, 1.0f);
                ck_assert_uint_eq(cs_split_xs_len(n, cols), (size_t)n * kp);
                float *xs = cs_aligned_alloc(64, sizeof(float) * cs_split_xs_len(n, cols));
                memset(xs, 0xff, sizeof(float) * cs_split_xs_len(n, cols)); /* NaN: every place must be written */
                isas[v].pack(xs, x, n, cols, 0, n / 2);
                isas[v].pack(xs, x, n, cols, n / 2, n);
                for (int i = 0; i < n; i++)
                    for (size_t k = 0; k < kp; k++) {
                        size_t b = k / (size_t)isas[v].b * (size_t)isas[v].b, j = k - b;
                        size_t src = b + (j < (size_t)hb ? 2 * j : 2 * (j - (size_t)hb) + 1);
                        float want = src < (size_t)cols ? x[(size_t)i * cols + src] : 0.0f;
                        ck_assert_msg(!memcmp(&xs[(size_t)i * kp + k], &want, sizeof want),
                                      "%s split pack n=%d K=%d: row %d col %zu", isas[v].name, n, cols, i, k);
                    }
                float *y = malloc(sizeof(float) * n * rows), *y2 = malloc(sizeof(float) * n * rows);
                float *yr = malloc(sizeof(float) * n * rows), *one = malloc(sizeof(float) * rows);
                isas[v].tile(y, rows, xs, n, &w, 0, rows);
                int split = (int)(cs_rng_next(&rng) % (unsigned)(rows + 1));
                isas[v].tile(y2, rows, xs, n, &w, 0, split);
                isas[v].tile(y2, rows, xs, n, &w, split, rows);
                cs_matmul_ref(yr, x, n, &w, NULL);
                float e = test_max_rel_err(y, yr, (size_t)n * rows);
                worst = fmaxf(worst, e);
                ck_assert_msg(e < 2e-6f, "%s split tiles n=%d %dx%d: rel err %g", isas[v].name, n, rows, cols, e);
                ck_assert_msg(!memcmp(y, y2, sizeof(float) * n * rows), "%s split tiles n=%d %dx%d: rows split at %d differ",
                              isas[v].name, n, rows, cols, split);
                int i = (int)(cs_rng_next(&rng) % (unsigned)n);
                isas[v].tile(one, rows, xs + (size_t)i * kp, 1, &w, 0, rows);
                ck_assert_msg(!memcmp(one, y + (size_t)i * rows, sizeof(float) * rows),
                              "%s split tiles n=%d %dx%d: row %d differs alone", isas[v].name, n, rows, cols, i);
                free(mem); free(x); free(xs); free(y); free(y2); free(yr); free(one);
            }
        printf("%s split dot tiles: max rel err %.3g\n", isas[v].name, worst);
    }
}
END_TEST

/* the AVX2 kernels called directly (an AVX-512 CPU runs them too): GEMV and dot tiles for
 * every n up to 40 over row ranges that split the 6-stream GEMV into leftovers, columns with
 * every tail; widening; softmax against the plain one (values down to exp underflow);
 * paged attention of one head against the paged reference. Skipped without AVX2. */
START_TEST(test_avx2_kernels) {
    if (!cs_cpu_has_avx2()) return;
    static const cs_dtype dts[] = {CS_DTYPE_F32, CS_DTYPE_BF16, CS_DTYPE_F16};
    static const int colss[] = {1, 7, 8, 15, 16, 17, 33, 100, 257};
    float worst = 0;
    for (int n = 1; n <= 40; n += (n < 9 ? 1 : 7))
        for (size_t d = 0; d < CS_ARRAY_LEN(dts); d++)
            for (size_t ci = 0; ci < CS_ARRAY_LEN(colss); ci++) {
                int rows = 13 + (int)(cs_rng_next(&rng) % 40), cols = colss[ci];
                void *mem;
                cs_weight_t w = make_weight(rows, cols, dts[d], &mem);
                float *x = test_randv(&rng, (size_t)n * cols, 1.0f);
                float *y = malloc(sizeof(float) * n * rows), *yt = malloc(sizeof(float) * n * rows);
                float *yr = malloc(sizeof(float) * n * rows);
                int split = rows / 3; /* two calls, as two tasks would make them */
                cs_gemv_rows_avx2(y, rows, x, n, &w, 0, split);
                cs_gemv_rows_avx2(y, rows, x, n, &w, split, rows);
                cs_gemm_invariant_avx2(yt, rows, x, n, &w, 0, rows);
                cs_matmul_ref(yr, x, n, &w, NULL);
                float e = fmaxf(test_max_rel_err(y, yr, (size_t)n * rows), test_max_rel_err(yt, yr, (size_t)n * rows));
                worst = fmaxf(worst, e);
                ck_assert_msg(e < 2e-6f, "avx2 gemv/tiles n=%d %dx%d %s: rel err %g", n, rows, cols,
                              cs_dtype_name(dts[d]), e);
                /* the tiles are batch-invariant: row i alone gives the same bits */
                int i = n - 1;
                float *one = malloc(sizeof(float) * rows);
                cs_gemm_invariant_avx2(one, rows, x + (size_t)i * cols, 1, &w, 0, rows);
                ck_assert_msg(memcmp(one, yt + (size_t)i * rows, sizeof(float) * rows) == 0,
                              "avx2 tiles n=%d %dx%d %s: row %d differs alone", n, rows, cols, cs_dtype_name(dts[d]), i);
                if (dts[d] != CS_DTYPE_F32) {
                    float *wf = malloc(sizeof(float) * rows * cols), *wr = malloc(sizeof(float) * rows * cols);
                    cs_convert_rows_avx2(wf, &w, 1, rows);
                    cs_to_f32(wr, (const uint16_t *)w.data + cols, w.dtype, (size_t)(rows - 1) * cols);
                    ck_assert(memcmp(wf, wr, sizeof(float) * (size_t)(rows - 1) * cols) == 0);
                    free(wf); free(wr);
                }
                free(one); free(mem); free(x); free(y); free(yt); free(yr);
            }
    printf("avx2 gemv and dot tiles: max rel err %.3g\n", worst);
    for (int n = 1; n <= 300; n += 13) {
        float *a = test_randv(&rng, (size_t)n, 40.0f), *b = malloc(sizeof(float) * n);
        if (n > 5) a[3] = -200.0f; /* exp underflows to 0 */
        memcpy(b, a, sizeof(float) * n);
        cs_softmax_avx2(a, n);
        cs_softmax_ref(b, n);
        for (int i = 0; i < n; i++) ck_assert_msg(fabsf(a[i] - b[i]) <= 2e-6f * fmaxf(b[i], 1e-30f) + 1e-37f,
                                                  "softmax n=%d [%d]: %g vs %g", n, i, a[i], b[i]);
        free(a); free(b);
    }
    static const int hds[] = {8, 64, 72, 128};
    for (size_t h = 0; h < CS_ARRAY_LEN(hds) * 2; h++) { /* F32 pools, then BF16 */
        int hd = hds[h % CS_ARRAY_LEN(hds)], bs = 16, len = 53, nkv = 2, nb = (len + bs - 1) / bs;
        cs_dtype kvt = h < CS_ARRAY_LEN(hds) ? CS_DTYPE_F32 : CS_DTYPE_BF16;
        int32_t blocks[4] = {3, 0, 2, 1}; /* out of order on purpose */
        size_t kv_dim = (size_t)nkv * hd, pool = (size_t)4 * bs * kv_dim;
        float *k = test_randv(&rng, pool, 1.0f), *v = test_randv(&rng, pool, 1.0f);
        uint16_t *kb = malloc(pool * 2), *vb = malloc(pool * 2);
        for (size_t i = 0; i < pool; i++) kb[i] = cs_f32_to_bf16(k[i]), vb[i] = cs_f32_to_bf16(v[i]);
        const void *kp = kvt == CS_DTYPE_BF16 ? (const void *)kb : k, *vp = kvt == CS_DTYPE_BF16 ? (const void *)vb : v;
        float *q = test_randv(&rng, (size_t)2 * hd, 1.0f), *o = malloc(sizeof(float) * 2 * hd);
        float *orf = malloc(sizeof(float) * 2 * hd);
        float s[2 * 64], *o1 = malloc(sizeof(float) * 2 * hd);
        /* both heads in one call, and one head per call (a query's heads split over tasks):
         * the same bits */
        cs_attn_rows_paged_avx2(o, s, q, kp, vp, kvt, blocks, bs, 0, len - 1, 0, 2, 1, kv_dim, 1.0f / sqrtf((float)hd), hd);
        for (int head = 0; head < 2; head++)
            cs_attn_rows_paged_avx2(o1, s, q, kp, vp, kvt, blocks, bs, 0, len - 1, head, head + 1, 1, kv_dim,
                                    1.0f / sqrtf((float)hd), hd);
        ck_assert(!memcmp(o, o1, sizeof(float) * 2 * hd));
        cpu_attn_seq_t sq = {.row0 = 0, .n = 1, .pos0 = len - 1, .blocks = blocks};
        cs_attention_paged_kv_ref(orf, q, kp, vp, kvt, &sq, 1, bs, 2, nkv, hd, 0);
        float e = test_max_rel_err(o, orf, (size_t)2 * hd);
        ck_assert_msg(e < 1e-5f, "avx2 paged rows hd=%d (%d blocks, %s pools): rel err %g", hd, nb, cs_dtype_name(kvt), e);
        free(o1);
        free(k); free(v); free(kb); free(vb); free(q); free(o); free(orf);
    }
}
END_TEST

START_TEST(test_half_conversions) {
    /* round-to-nearest-even at the tie, and exact round trips */
    ck_assert_uint_eq(cs_f32_to_bf16(1.0f), 0x3f80);
    union { uint32_t u; float f; } t = {.u = 0x3f808000u}; /* exactly halfway, even below */
    ck_assert_uint_eq(cs_f32_to_bf16(t.f), 0x3f80);
    t.u = 0x3f818000u; /* halfway, odd below: rounds up */
    ck_assert_uint_eq(cs_f32_to_bf16(t.f), 0x3f82);
    for (int i = 0; i < 65536; i++) {
        float f = cs_f16_to_f32((uint16_t)i);
        if (isnan(f)) continue;
        ck_assert_uint_eq(cs_f32_to_f16(f), (uint16_t)i);
    }
    ck_assert_float_eq(cs_f16_to_f32(0x3c00), 1.0f);
    ck_assert_float_eq(cs_f16_to_f32(0x0001), ldexpf(1, -24));
}
END_TEST


/* ---- block-quantized weights ---- */
static const cs_dtype qtypes[] = {CS_DTYPE_Q4_0, CS_DTYPE_Q4_1, CS_DTYPE_Q5_0, CS_DTYPE_Q5_1,
                                  CS_DTYPE_Q8_0, CS_DTYPE_Q4_K, CS_DTYPE_Q5_K, CS_DTYPE_Q6_K};

/* rows x cols of type dt: random bytes, every F16 field a finite value of about `scale` (signs
 * mixed; the K types' d and dmin positive as the quantizers write them, though nothing here
 * depends on it) */
static cs_weight_t make_qweight(int rows, int cols, cs_dtype dt, float scale, void **mem) {
    size_t rb = cs_dtype_row_bytes(dt, cols), nb = (size_t)rows * cols / cs_dtype_block(dt), bs = cs_dtype_size(dt);
    uint8_t *p = malloc((size_t)rows * rb);
    for (size_t i = 0; i < (size_t)rows * rb; i++) p[i] = (uint8_t)cs_rng_next(&rng);
    for (size_t b = 0; b < nb; b++) {
        uint8_t *blk = p + b * bs;
        uint16_t h[2] = {cs_f32_to_f16(scale * (cs_rng_uniform(&rng) - 0.3f)),
                         cs_f32_to_f16(scale * (cs_rng_uniform(&rng) - 0.5f))};
        switch (dt) {
        case CS_DTYPE_Q4_1: case CS_DTYPE_Q5_1: memcpy(blk, h, 4); break;
        case CS_DTYPE_Q4_K: case CS_DTYPE_Q5_K:
            h[0] = cs_f32_to_f16(scale / 32 * cs_rng_uniform(&rng));
            h[1] = cs_f32_to_f16(scale / 32 * cs_rng_uniform(&rng));
            memcpy(blk, h, 4);
            break;
        case CS_DTYPE_Q6_K: h[0] = cs_f32_to_f16(scale / 64 * (cs_rng_uniform(&rng) - 0.5f)); memcpy(blk + 208, h, 2); break;
        default: memcpy(blk, h, 2); break;
        }
    }
    *mem = p;
    return (cs_weight_t){dt, rows, cols, p, NULL, NULL};
}

/* the AVX2 decode against cs_dequant_row_ref: the same values, up to the fused s*q + o (one
 * rounding where the reference has two) for the types with an offset */
START_TEST(test_quant_dequant) {
    if (!cs_cpu_has_avx2()) { printf("SKIP: no AVX2\n"); return; }
    for (size_t t = 0; t < CS_ARRAY_LEN(qtypes); t++) {
        cs_dtype dt = qtypes[t];
        int rows = 5, cols = 2 * 256;
        void *mem;
        cs_weight_t w = make_qweight(rows, cols, dt, 0.7f, &mem);
        float *a = malloc(sizeof(float) * rows * cols), *b = malloc(sizeof(float) * rows * cols);
        cs_qdequant_rows_avx2(a, &w, 1, rows);
        cs_qdequant_rows_ref(b, &w, 1, rows);
        bool offset = dt == CS_DTYPE_Q4_1 || dt == CS_DTYPE_Q5_1 || dt == CS_DTYPE_Q4_K || dt == CS_DTYPE_Q5_K;
        float mx = 0;
        for (int i = 0; i < (rows - 1) * cols; i++) mx = fmaxf(mx, fabsf(b[i]));
        for (int i = 0; i < (rows - 1) * cols; i++) {
            if (!offset) ck_assert_msg(a[i] == b[i], "%s element %d: %g, reference %g", cs_dtype_name(dt), i, a[i], b[i]);
            else ck_assert_msg(fabsf(a[i] - b[i]) <= 2.4e-7f * mx, "%s element %d: %g, reference %g", cs_dtype_name(dt), i, a[i], b[i]);
        }
        free(a); free(b); free(mem);
    }
}
END_TEST

/* the matmul on quantized weights through every path (the GEMV up to CS_QGEMV_MAX_N rows and
 * in batch-invariant mode, the dequantized packed GEMM above, the reference kernels), 1 and 3
 * threads, against the reference (each row dequantized, sums in double) */
START_TEST(test_quant_matmul) {
    static const int shapes[][3] = {{1, 64, 256}, {2, 37, 512}, {3, 7, 256}, {4, 130, 256}, {5, 40, 512},
                                    {9, 33, 256}, {33, 70, 768}};
    cpu_raw_t *bes[] = {be_for(1), be_for(3), cpu_raw_new(&(cpu_backend_params_t){.n_threads = 2, .no_avx2 = true, .no_avx512 = true}),
                        cpu_raw_new(&(cpu_backend_params_t){.n_threads = 2, .reference = true})};
    const char *names[] = {"1 thread", "3 threads", "plain", "reference"};
    for (size_t k = 0; k < CS_ARRAY_LEN(bes); k++)
        for (size_t t = 0; t < CS_ARRAY_LEN(qtypes); t++)
            for (size_t s = 0; s < CS_ARRAY_LEN(shapes); s++) {
                int n = shapes[s][0], rows = shapes[s][1], cols = shapes[s][2];
                void *mem;
                cs_weight_t w = make_qweight(rows, cols, qtypes[t], 0.05f, &mem);
                float *x = test_randv(&rng, (size_t)n * cols, 1.0f), *bias = test_randv(&rng, (size_t)rows, 0.1f);
                float *y = malloc(sizeof(float) * n * rows), *yr = malloc(sizeof(float) * n * rows);
                cpu_raw_matmul(bes[k], y, x, n, &w, bias);
                cs_matmul_ref(yr, x, n, &w, bias);
                float e = test_max_rel_err(y, yr, (size_t)n * rows);
                ck_assert_msg(e < 1e-5f, "%s %s n=%d %dx%d: rel err %g", names[k], cs_dtype_name(qtypes[t]), n, rows, cols, e);
                free(mem); free(x); free(bias); free(y); free(yr);
            }
    for (size_t k = 0; k < CS_ARRAY_LEN(bes); k++) cpu_raw_free(bes[k]);
}
END_TEST

/* batch-invariant mode: a row of x gives the same bits alone and inside a batch of any size;
 * --precision bf16: x rounded to BF16 first, as for BF16 weights */
START_TEST(test_quant_invariant_bf16) {
    cpu_raw_t *inv = cpu_raw_new(&(cpu_backend_params_t){.n_threads = 3, .batch_invariant = true});
    cpu_raw_t *pb = cpu_raw_new(&(cpu_backend_params_t){.n_threads = 2, .precision_bf16 = true});
    for (size_t t = 0; t < CS_ARRAY_LEN(qtypes); t++) {
        int rows = 45, cols = 512, n = 11;
        void *mem;
        cs_weight_t w = make_qweight(rows, cols, qtypes[t], 0.05f, &mem);
        float *x = test_randv(&rng, (size_t)n * cols, 1.0f);
        float *y = malloc(sizeof(float) * n * rows), *y1 = malloc(sizeof(float) * rows), *yr = malloc(sizeof(float) * n * rows);
        cpu_raw_matmul(inv, y, x, n, &w, NULL);
        for (int i = 0; i < n; i += 5) {
            cpu_raw_matmul(inv, y1, x + (size_t)i * cols, 1, &w, NULL);
            ck_assert_msg(!memcmp(y1, y + (size_t)i * rows, sizeof(float) * rows), "%s: row %d of %d differs alone",
                          cs_dtype_name(qtypes[t]), i, n);
        }
        cpu_raw_matmul(pb, y, x, n, &w, NULL);
        float *xr = malloc(sizeof(float) * n * cols);
        cs_round_bf16_ref(xr, x, (size_t)n * cols);
        cs_matmul_ref(yr, xr, n, &w, NULL);
        ck_assert_msg(test_max_rel_err(y, yr, (size_t)n * rows) < 1e-5f, "%s --precision bf16", cs_dtype_name(qtypes[t]));
        free(mem); free(x); free(y); free(y1); free(yr); free(xr);
    }
    cpu_raw_free(inv);
    cpu_raw_free(pb);
}
END_TEST

/* an embedding row of a quantized table is its reference dequantization, bit for bit */
START_TEST(test_quant_embed) {
    cpu_raw_t *be = be_for(2);
    for (size_t t = 0; t < CS_ARRAY_LEN(qtypes); t++) {
        int rows = 20, cols = 256;
        void *mem;
        cs_weight_t w = make_qweight(rows, cols, qtypes[t], 0.5f, &mem);
        int32_t ids[3] = {19, 0, 7};
        float *y = malloc(sizeof(float) * 3 * cols), *r = malloc(sizeof(float) * cols);
        cpu_raw_embed(be, y, &w, ids, 3);
        for (int i = 0; i < 3; i++) {
            cs_dequant_row_ref(r, (const uint8_t *)w.data + (size_t)ids[i] * cs_dtype_row_bytes(w.dtype, cols), w.dtype, cols);
            ck_assert(!memcmp(r, y + (size_t)i * cols, sizeof(float) * cols));
        }
        free(mem); free(y); free(r);
    }
    cpu_raw_free(be);
}
END_TEST


/* --precision int8: the activations' quantization (AVX2 = reference, bit for bit), and the
 * matmul on quantized weights = the exact matmul on x̂ (the dequantized 8-bit activations) up to
 * F32 rounding, on every path and thread count, up to 32 rows of x (every n batch-invariant,
 * where a row's result does not depend on its batch); above, the exact matmul on x itself */
START_TEST(test_quant_int8) {
    if (cs_cpu_has_avx2()) {
        int n = 32 * 40;
        float *x = test_randv(&rng, (size_t)n, 3.0f), d[40], d2[40], s[40], s2[40];
        for (int i = 0; i < 32; i++) x[i] = 0;               /* a zero block */
        for (int i = 32; i < 64; i++) x[i] = (float)(i - 48) * 0.5f; /* a block of halves, its max exact */
        x[40] = 8.0f;
        int8_t q[32 * 40], q2[32 * 40];
        for (int blk = 32; blk <= 256; blk *= 8) {
            memset(d, 0, sizeof d), memset(d2, 0, sizeof d2);
            cs_quantize_act_ref(q, d, s, x, blk == 32 ? n : 32 * 32, blk);
            cs_quantize_act_avx2(q2, d2, s2, x, blk == 32 ? n : 32 * 32, blk);
            int nq = blk == 32 ? n : 32 * 32;
            ck_assert(!memcmp(q, q2, (size_t)nq) && !memcmp(d, d2, sizeof d) && !memcmp(s, s2, sizeof(float) * nq / 32));
            /* the scales llama.cpp's activation blocks carry: Q8_0's F16 max/127, Q8_K's 1/(127/max) */
            for (int b = 0; b < nq / blk; b++) {
                float amax = 0;
                for (int j = 0; j < blk; j++) amax = fmaxf(amax, fabsf(x[b * blk + j]));
                float want = amax == 0 ? 0 : blk == 32 ? cs_f16_to_f32(cs_f32_to_f16(amax / 127)) : 1 / (127 / amax);
                ck_assert_msg(d[b] == want, "block %d of %d: scale %.9g, llama.cpp's %.9g", b, blk, d[b], want);
                for (int j = 0; j < blk; j++)
                    ck_assert_int_eq(q[b * blk + j], (int)nearbyintf(x[b * blk + j] * (amax ? 127 / amax : 0)));
            }
        }
        free(x);
    }
    static const int shapes[][3] = {{1, 64, 256}, {3, 37, 512}, {4, 130, 256}, {9, 40, 512}, {32, 33, 256}, {33, 70, 768}};
    cpu_backend_params_t ps[] = {{.n_threads = 1, .precision_int8 = true}, {.n_threads = 3, .precision_int8 = true},
                                 {.n_threads = 2, .precision_int8 = true, .no_avx2 = true, .no_avx512 = true},
                                 {.n_threads = 2, .precision_int8 = true, .reference = true},
                                 {.n_threads = 2, .precision_int8 = true, .batch_invariant = true}};
    for (size_t k = 0; k < CS_ARRAY_LEN(ps); k++) {
        cpu_raw_t *be = cpu_raw_new(&ps[k]);
        for (size_t t = 0; t < CS_ARRAY_LEN(qtypes); t++)
            for (size_t sh = 0; sh < CS_ARRAY_LEN(shapes); sh++) {
                int n = shapes[sh][0], rows = shapes[sh][1], cols = shapes[sh][2];
                void *mem;
                cs_weight_t w = make_qweight(rows, cols, qtypes[t], 0.05f, &mem);
                float *x = test_randv(&rng, (size_t)n * cols, 1.0f), *bias = test_randv(&rng, (size_t)rows, 0.1f);
                float *y = malloc(sizeof(float) * n * rows), *yr = malloc(sizeof(float) * n * rows);
                float *xh = malloc(sizeof(float) * n * cols), *d = malloc(sizeof(float) * n * cols / 32);
                float *sm = malloc(sizeof(float) * n * cols / 32);
                int8_t *q = malloc((size_t)n * cols);
                int blk = cs_quant_act_block(qtypes[t]);
                bool q8 = n <= 32 || ps[k].batch_invariant;
                cs_quantize_act_ref(q, d, sm, x, (int64_t)n * cols, blk);
                for (int i = 0; i < n * cols; i++) xh[i] = q8 ? d[i / blk] * (float)q[i] : x[i];
                cpu_raw_matmul(be, y, x, n, &w, bias);
                cs_matmul_ref(yr, xh, n, &w, bias);
                float e = test_max_rel_err(y, yr, (size_t)n * rows);
                ck_assert_msg(e < 1e-5f, "int8 params %zu %s n=%d %dx%d: rel err %g", k, cs_dtype_name(qtypes[t]), n, rows,
                              cols, e);
                if (n > 1 && q8 && !ps[k].reference) { /* row 0 alone: the same bits */
                    cpu_raw_matmul(be, yr, x, 1, &w, bias);
                    ck_assert_msg(!memcmp(yr, y, sizeof(float) * rows), "int8 %s: row 0 differs alone", cs_dtype_name(qtypes[t]));
                }
                free(mem); free(x); free(bias); free(y); free(yr); free(xh); free(d); free(sm); free(q);
            }
        cpu_raw_free(be);
    }
}
END_TEST

/* the pack's kernels alone on rows [r0, r1): the AVX2 one against cs_qgemv_int8_ref and, where
 * the CPU has AVX512-VNNI, against the VNNI one bit for bit (and that one against the loop) */
static void check_qpack_kernels(const cs_qpack_t *pk, const cs_weight_t *w, const int8_t *q, const float *d,
                                const float *sm, const int32_t *s16, int m, int r0, int r1, const char *what) {
    int rows = w->rows;
    float *y = calloc((size_t)m * rows, sizeof(float)), *yv = calloc((size_t)m * rows, sizeof(float));
    float *yr = calloc((size_t)m * rows, sizeof(float));
    cs_qgemv_int8_pack_avx2(y, rows, q, d, sm, s16, m, pk, r0, r1);
    cs_qgemv_int8_ref(yr, rows, q, d, sm, m, w, r0, r1);
    bool vnni = cs_cpu_has_avx512_vnni();
    if (vnni) cs_qgemv_int8_vnni(yv, rows, q, d, sm, s16, m, pk, r0, r1);
    for (int i = 0; i < m; i++) {
        size_t at = (size_t)i * rows + r0;
        float e = test_max_rel_err(y + at, yr + at, (size_t)(r1 - r0));
        ck_assert_msg(e < 1e-5f, "%s: pack kernel (AVX2) %s n=%d rows %d-%d: rel err %g", what, cs_dtype_name(w->dtype), m,
                      r0, r1, e);
        if (vnni) {
            ck_assert_msg(!memcmp(y + at, yv + at, sizeof(float) * (size_t)(r1 - r0)),
                          "%s: pack kernels %s n=%d rows %d-%d: AVX2 and VNNI differ", what, cs_dtype_name(w->dtype), m, r0, r1);
            e = test_max_rel_err(yv + at, yr + at, (size_t)(r1 - r0));
            ck_assert_msg(e < 1e-5f, "%s: pack kernel (VNNI) %s n=%d rows %d-%d: rel err %g", what, cs_dtype_name(w->dtype),
                          m, r0, r1, e);
        }
    }
    if (vnni && w->dtype == CS_DTYPE_Q6_K) { /* the six-bit values unpacked once: the same bits */
        size_t ub = cs_qpack_q6k_unpacked_bytes(pk) * (size_t)((r1 - r0 + CS_QPACK_ROWS - 1) / CS_QPACK_ROWS);
        uint8_t *u = aligned_alloc(64, (ub + 63) / 64 * 64);
        float *yu = calloc((size_t)m * rows, sizeof(float));
        cs_qpack_q6k_unpack(u, pk, r0, r1);
        cs_qgemv_int8_vnni_q6u(yu, rows, q, d, s16, m, pk, r0, r1, u);
        for (int i = 0; i < m; i++)
            ck_assert_msg(!memcmp(yu + (size_t)i * rows + r0, yv + (size_t)i * rows + r0, sizeof(float) * (size_t)(r1 - r0)),
                          "%s: Q6_K unpacked n=%d rows %d-%d: not the VNNI kernel's bits", what, m, r0, r1);
        free(u); free(yu);
    }
    free(y); free(yv); free(yr);
}

/* --precision int8 on packs: the repacked Q8_0/Q4_K/Q5_K/Q6_K weights (cs_qpack_t) against the
 * exact matmul on the quantized x, through the backend (tasks of whole groups of 16 rows, x in
 * groups of 4; the VNNI kernels where the CPU has them, and the AVX2 ones) and the kernels
 * alone against cs_qgemv_int8_ref and each other */
START_TEST(test_quant_int8_pack) {
    if (!cs_cpu_has_avx2()) {
        fprintf(stderr, "SKIP test_quant_int8_pack: this CPU has no AVX2\n");
        return;
    }
    static const cs_dtype types[] = {CS_DTYPE_Q8_0, CS_DTYPE_Q4_K, CS_DTYPE_Q5_K, CS_DTYPE_Q6_K};
    static const int shapes[][3] = {{1, 16, 256}, {2, 32, 512}, {3, 48, 768}, {4, 64, 256}, {5, 16, 1280},
                                    {9, 80, 512}, {33, 48, 256}, {1, 32, 32}, {2, 16, 96}, {6, 144, 2816}};
    cpu_backend_params_t ps[] = {{.n_threads = 1, .precision_int8 = true}, {.n_threads = 3, .precision_int8 = true},
                                 {.n_threads = 2, .precision_int8 = true, .batch_invariant = true},
                                 {.n_threads = 2, .precision_int8 = true, .no_vnni = true},
                                 {.n_threads = 1, .precision_int8 = true, .no_avx512 = true}};
    for (size_t k = 0; k < CS_ARRAY_LEN(ps); k++) {
        cpu_raw_t *be = cpu_raw_new(&ps[k]);
        ck_assert(cpu_raw_packs_quant(be));
        for (size_t t = 0; t < CS_ARRAY_LEN(types); t++)
            for (size_t sh = 0; sh < CS_ARRAY_LEN(shapes); sh++) {
                int n = shapes[sh][0], rows = shapes[sh][1], cols = shapes[sh][2];
                if (cols % cs_dtype_block(types[t])) continue;
                void *mem;
                cs_weight_t w = make_qweight(rows, cols, types[t], 0.05f, &mem);
                cs_qpack_t *pk = cpu_raw_qpack_new(be, &w);
                ck_assert(pk && cs_qpack_bytes(pk) >= (size_t)rows * cs_dtype_row_bytes(types[t], cols));
                w.pack = pk;
                cs_qpack_t *own = cs_qpack_new(types[t], rows, cols, NULL); /* outside an arena: the same bytes */
                ck_assert(own);
                cs_qpack_fill(own, &w, 0, rows / CS_QPACK_ROWS);
                ck_assert(!memcmp(own->data, pk->data, cs_qpack_bytes(pk)));
                cs_qpack_free(own);
                float *x = test_randv(&rng, (size_t)n * cols, 1.0f), *bias = test_randv(&rng, (size_t)rows, 0.1f);
                x[0] = 0; /* a zero column, and a whole zero block of x in the last row */
                for (int c = 0; c < cs_quant_act_block(types[t]); c++) x[(size_t)(n - 1) * cols + c] = 0;
                float *y = malloc(sizeof(float) * n * rows), *yr = malloc(sizeof(float) * n * rows);
                float *xh = malloc(sizeof(float) * n * cols), *d = malloc(sizeof(float) * n * cols / 32);
                float *sm = malloc(sizeof(float) * n * cols / 32);
                int32_t *s16 = malloc(sizeof(int32_t) * n * cols / 16);
                int8_t *q = malloc((size_t)n * cols);
                int blk = cs_quant_act_block(types[t]);
                bool q8 = true; /* with the pack, at every n (prefill too) */
                cs_quantize_act_ref(q, d, sm, x, (int64_t)n * cols, blk);
                for (int i = 0; i < n * cols; i++) xh[i] = q8 ? d[i / blk] * (float)q[i] : x[i];
                cpu_raw_matmul(be, y, x, n, &w, bias);
                cs_matmul_ref(yr, xh, n, &w, bias);
                float e = test_max_rel_err(y, yr, (size_t)n * rows);
                ck_assert_msg(e < 1e-5f, "pack params %zu %s n=%d %dx%d: rel err %g", k, cs_dtype_name(types[t]), n, rows,
                              cols, e);
                if (n > 1 && q8) { /* row 0 alone: the same bits */
                    cpu_raw_matmul(be, yr, x, 1, &w, bias);
                    ck_assert_msg(!memcmp(yr, y, sizeof(float) * rows), "pack %s: row 0 differs alone", cs_dtype_name(types[t]));
                }
                /* the kernels alone, on every other group */
                int m = CS_MIN(n, CS_QPACK_MAX_N);
                cs_act_sums16(s16, q, (int64_t)m * cols);
                for (int r0 = 0; r0 < rows; r0 += 2 * CS_QPACK_ROWS)
                    check_qpack_kernels(pk, &w, q, d, sm, s16, m, r0, CS_MIN(rows, r0 + CS_QPACK_ROWS), "random");
                cs_qpack_free(pk);
                free(mem); free(x); free(bias); free(y); free(yr); free(xh); free(d); free(sm); free(s16); free(q);
            }
        cpu_raw_free(be);
    }
    /* the arena: packs one after another; all freed, its chunk starts over; a pack outlives the
     * backend (its chunk with it) */
    {
        cpu_backend_params_t on = {.n_threads = 2, .precision_int8 = true};
        cpu_raw_t *be = cpu_raw_new(&on);
        void *mem;
        cs_weight_t w = make_qweight(32, 256, CS_DTYPE_Q4_K, 0.05f, &mem);
        cs_qpack_t *a = cpu_raw_qpack_new(be, &w), *b = cpu_raw_qpack_new(be, &w);
        ck_assert(a && b && b->data == a->data + cs_qpack_bytes(a));
        uint8_t *first = a->data;
        cs_qpack_free(a);
        cs_qpack_free(b);
        a = cpu_raw_qpack_new(be, &w);
        ck_assert(a && a->data == first);
        b = cs_qpack_new(CS_DTYPE_Q4_K, 32, 256, NULL);
        cs_qpack_fill(b, &w, 0, 2);
        cpu_raw_free(be);
        ck_assert(!memcmp(a->data, b->data, cs_qpack_bytes(a)));
        cs_qpack_free(a);
        cs_qpack_free(b);
        free(mem);
    }
    /* the extremes: every weight at its largest magnitude (Q8_0's q all -128, Q4_K's nibbles
     * all 15, Q5_K's five bits all 31, Q6_K's six bits all 63 and its scales -128) against x at
     * +-127 in every column: the 16-bit sums at their bounds (2 * 128 * 127 for Q8_0's pairs,
     * 4 * 2 * 31 * 127 for Q5_K's four steps), which any offset in the unsigned operand, or
     * one step more, would overflow */
    for (size_t t = 0; t < CS_ARRAY_LEN(types); t++) {
        int rows = 32, cols = 512, n = 4;
        void *mem;
        cs_weight_t w = make_qweight(rows, cols, types[t], 0.05f, &mem);
        size_t bs = cs_dtype_size(types[t]), nb = (size_t)rows * cols / cs_dtype_block(types[t]);
        for (size_t b = 0; b < nb; b++) {
            uint8_t *blk = (uint8_t *)mem + b * bs;
            if (types[t] == CS_DTYPE_Q8_0) memset(blk + 2, 0x80, 32);
            else if (types[t] == CS_DTYPE_Q4_K) memset(blk + 16, 0xFF, 128);
            else if (types[t] == CS_DTYPE_Q5_K) memset(blk + 16, 0xFF, 32 + 128);
            else memset(blk, 0xFF, 192), memset(blk + 192, 0x80, 16);
        }
        cs_qpack_t *pk = cs_qpack_new(types[t], rows, cols, NULL);
        ck_assert(pk);
        cs_qpack_fill(pk, &w, 0, rows / CS_QPACK_ROWS);
        float *x = malloc(sizeof(float) * n * cols), *d = malloc(sizeof(float) * n * cols / 32);
        float *sm = malloc(sizeof(float) * n * cols / 32);
        int32_t *s16 = malloc(sizeof(int32_t) * n * cols / 16);
        int8_t *q = malloc((size_t)n * cols);
        for (int i = 0; i < n * cols; i++) x[i] = i / cols == 1 ? -1.0f : i / cols == 2 && i % 3 ? -1.0f : 1.0f;
        cs_quantize_act_ref(q, d, sm, x, (int64_t)n * cols, cs_quant_act_block(types[t]));
        cs_act_sums16(s16, q, (int64_t)n * cols);
        check_qpack_kernels(pk, &w, q, d, sm, s16, n, 0, rows, "extremes");
        cs_qpack_free(pk);
        free(mem); free(x); free(d); free(sm); free(s16); free(q);
    }
    cpu_backend_params_t off = {.n_threads = 1, .precision_int8 = true, .no_qpack = true};
    cpu_raw_t *be = cpu_raw_new(&off);
    ck_assert(!cpu_raw_packs_quant(be));
    cpu_raw_free(be);
    cpu_backend_params_t avx2 = {.n_threads = 1, .precision_int8 = true, .no_vnni = true};
    be = cpu_raw_new(&avx2);
    ck_assert(cpu_raw_packs_quant(be));
    cpu_raw_free(be);
    ck_assert(!cs_qpack_supports(CS_DTYPE_Q8_0, 20, 64) && !cs_qpack_supports(CS_DTYPE_Q4_0, 16, 64) &&
              !cs_qpack_supports(CS_DTYPE_Q4_K, 16, 128) && cs_qpack_supports(CS_DTYPE_Q6_K, 32, 512) &&
              cs_qpack_supports(CS_DTYPE_Q5_K, 16, 256) && !cs_qpack_supports(CS_DTYPE_Q5_0, 16, 256));
}
END_TEST

/* --precision int8, several quantized weights at once (a layer's q/k/v, gate/up): x quantized
 * once, one dispatch; the same bits as one matmul at a time, whichever kernels run (the VNNI
 * pack where the CPU has it, AVX2, the reference) and with a mix of block sizes (then each
 * on its own) */
START_TEST(test_quant_int8_multi) {
    cpu_backend_params_t ps[] = {{.n_threads = 2, .precision_int8 = true},
                                 {.n_threads = 2, .precision_int8 = true, .no_vnni = true},
                                 {.n_threads = 2, .precision_int8 = true, .reference = true},
                                 {.n_threads = 3, .precision_int8 = true, .batch_invariant = true}};
    static const cs_dtype sets[][3] = {{CS_DTYPE_Q4_K, CS_DTYPE_Q6_K, CS_DTYPE_Q4_K},
                                       {CS_DTYPE_Q8_0, CS_DTYPE_Q4_0, CS_DTYPE_Q8_0},
                                       {CS_DTYPE_Q8_0, CS_DTYPE_Q6_K, CS_DTYPE_Q5_1}};
    static const int rows[3] = {64, 32, 48}, ns[] = {1, 3, 8, 40};
    const int cols = 512;
    for (size_t k = 0; k < CS_ARRAY_LEN(ps); k++) {
        cpu_raw_t *be = cpu_raw_new(&ps[k]);
        for (size_t st = 0; st < CS_ARRAY_LEN(sets); st++)
            for (size_t ni = 0; ni < CS_ARRAY_LEN(ns); ni++) {
                int n = ns[ni];
                void *mem[3];
                cs_weight_t w[3];
                cs_qpack_t *pk[3] = {NULL, NULL, NULL};
                float *y[3], *y1[3], *bias[3];
                for (int m = 0; m < 3; m++) {
                    w[m] = make_qweight(rows[m], cols, sets[st][m], 0.05f, &mem[m]);
                    if (cpu_raw_packs_quant(be) && cs_qpack_supports(w[m].dtype, w[m].rows, w[m].cols))
                        w[m].pack = pk[m] = cpu_raw_qpack_new(be, &w[m]);
                    y[m] = malloc(sizeof(float) * n * rows[m]);
                    y1[m] = malloc(sizeof(float) * n * rows[m]);
                    bias[m] = m == 1 ? test_randv(&rng, (size_t)rows[m], 0.1f) : NULL;
                }
                float *x = test_randv(&rng, (size_t)n * cols, 1.0f);
                const cs_weight_t *ws[3] = {&w[0], &w[1], &w[2]};
                const float *bs[3] = {bias[0], bias[1], bias[2]};
                cpu_raw_matmul_multi(be, y, x, n, ws, bs, 3);
                for (int m = 0; m < 3; m++) {
                    cpu_raw_matmul(be, y1[m], x, n, &w[m], bias[m]);
                    ck_assert_msg(!memcmp(y[m], y1[m], sizeof(float) * n * rows[m]), "int8 multi params %zu set %zu n=%d: weight %d differs",
                                  k, st, n, m);
                }
                for (int m = 0; m < 3; m++) {
                    cs_qpack_free(pk[m]);
                    free(mem[m]); free(y[m]); free(y1[m]); free(bias[m]);
                }
                free(x);
            }
        cpu_raw_free(be);
    }
}
END_TEST

int main(void) {
    cs_rng_seed(&rng, 1234);
    const TTest *const tests[] = {
        test_matmul_vs_ref, test_matmul_sweep, test_gemm_bf16_amx, test_gemm_dpbf16,
        test_matmul_precision_bf16, test_attention_vs_ref, test_attention_ref_definition, test_lora_vs_ref,
        test_norm_rope_silu, test_gemv_streams, test_wcode_roundtrip, test_wcode_gemv, test_wcode_code_only,
        test_split_tiles, test_avx2_kernels, test_half_conversions, test_threadpool_exactly_once,
        test_quant_dequant, test_quant_matmul, test_quant_invariant_bf16, test_quant_embed, test_quant_int8,
        test_quant_int8_pack, test_quant_int8_multi
    };
    return cs_check_main("cpu_kernels", tests, CS_ARRAY_LEN(tests), 120, CK_FORK);
}
