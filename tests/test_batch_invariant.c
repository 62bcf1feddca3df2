/* test_batch_invariant.c: the CPU backend with batch_invariant set gives every row the same
 * bits whatever is computed beside it: a row of a matmul alone or among 45, with 1 or 3
 * threads; a query's paged attention in one prefill chunk, in smaller chunks or as a
 * decode row beside other sequences; a token's LoRA alone or in a segment of many. That is
 * what makes a repeated rollout give identical logprobs whatever the batch and the prefix
 * cache held (tests/test_rollout.py checks it end to end). Each result is also held to the
 * plain reference, so "invariant" cannot mean "wrong the same way". */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels/cpu_raw.h"
#include "cpu_kernels/kernels.h"
#include "cpu_kernels/kernels_paged.h"
#include "engine/sampling.h"
#include "tests/testutil.h"

static cs_rng_t rng;

/* the second pass on an AVX-512 CPU takes the AVX2 kernels, as an AVX2-only CPU would */
static bool no_avx512;

static cpu_raw_t *inv_backend(int threads) {
    return cpu_raw_new(&(cpu_backend_params_t){.n_threads = threads, .batch_invariant = true, .no_avx512 = no_avx512});
}

static cs_weight_t make_weight(int rows, int cols, cs_dtype dt, void **mem) {
    size_t n = (size_t)rows * cols;
    float *f = test_randv(&rng, n, 0.5f);
    if (dt == CS_DTYPE_F32) { *mem = f; return (cs_weight_t){dt, rows, cols, f, NULL, NULL}; }
    uint16_t *h = malloc(n * 2);
    for (size_t i = 0; i < n; i++) h[i] = dt == CS_DTYPE_BF16 ? cs_f32_to_bf16(f[i]) : cs_f32_to_f16(f[i]);
    free(f);
    *mem = h;
    return (cs_weight_t){dt, rows, cols, h, NULL, NULL};
}

START_TEST(matmul_rows_independent_of_batch) {
    static const int shapes[][2] = {{131, 576}, {37, 100}, {64, 33}, {200, 1536}};
    static const cs_dtype dts[] = {CS_DTYPE_F32, CS_DTYPE_BF16, CS_DTYPE_F16};
    enum { N = 45 };
    cpu_raw_t *b1 = inv_backend(1), *b3 = inv_backend(3);
    cpu_raw_t *plain = cpu_raw_new(&(cpu_backend_params_t){.n_threads = 3});
    for (size_t s = 0; s < CS_ARRAY_LEN(shapes); s++)
        for (size_t d = 0; d < CS_ARRAY_LEN(dts); d++) {
            int rows = shapes[s][0], cols = shapes[s][1];
            void *mem;
            cs_weight_t w = make_weight(rows, cols, dts[d], &mem);
            float *x = test_randv(&rng, (size_t)N * cols, 1.0f), *bias = test_randv(&rng, (size_t)rows, 0.1f);
            float *y = malloc(sizeof(float) * N * rows), *yr = malloc(sizeof(float) * N * rows);
            float *y1 = malloc(sizeof(float) * N * rows), *yp = malloc(sizeof(float) * N * rows);
            cpu_raw_matmul(b3, y, x, N, &w, bias);
            cs_matmul_ref(yr, x, N, &w, bias);
            float e = test_max_rel_err(y, yr, (size_t)N * rows);
            ck_assert_msg(e < 2e-6f, "invariant matmul %dx%d %s vs reference: %g", rows, cols, cs_dtype_name(dts[d]), e);
            /* each row alone, on one thread */
            for (int i = 0; i < N; i++) {
                cpu_raw_matmul(b1, y1, x + (size_t)i * cols, 1, &w, bias);
                ck_assert_msg(!memcmp(y1, y + (size_t)i * rows, sizeof(float) * rows),
                              "row %d of %dx%d %s differs alone vs in a batch of %d", i, rows, cols,
                              cs_dtype_name(dts[d]), N);
            }
            /* a slice of 7 rows starting at an odd place, and 4 rows (one whole tile) */
            cpu_raw_matmul(b1, y1, x + (size_t)5 * cols, 7, &w, bias);
            ck_assert(!memcmp(y1, y + (size_t)5 * rows, sizeof(float) * 7 * rows));
            cpu_raw_matmul(b3, y1, x + (size_t)12 * cols, 4, &w, bias);
            ck_assert(!memcmp(y1, y + (size_t)12 * rows, sizeof(float) * 4 * rows));
            /* for contrast, how many rows the default kernels change with the batch (not
             * asserted: it is whatever OpenBLAS/AMX do) */
            int differ = 0;
            cpu_raw_matmul(plain, yp, x, N, &w, bias);
            for (int i = 0; i < N; i++) {
                cpu_raw_matmul(plain, y1, x + (size_t)i * cols, 1, &w, bias);
                differ += memcmp(y1, yp + (size_t)i * rows, sizeof(float) * rows) != 0;
            }
            printf("matmul %dx%d %s: default kernels change %d of %d rows with the batch; invariant 0\n", rows, cols,
                   cs_dtype_name(dts[d]), differ, N);
            free(mem); free(x); free(bias); free(y); free(yr); free(y1); free(yp);
        }
    cpu_raw_free(b1);
    cpu_raw_free(b3);
    cpu_raw_free(plain);
}
END_TEST

/* q/k/v and gate/up in one call equal one matmul each, bit for bit, at any n */
START_TEST(matmul_multi_equals_each) {
    cpu_raw_t *b = inv_backend(2);
    void *m0, *m1, *m2;
    cs_weight_t w0 = make_weight(96, 80, CS_DTYPE_F32, &m0), w1 = make_weight(32, 80, CS_DTYPE_BF16, &m1);
    cs_weight_t w2 = make_weight(50, 80, CS_DTYPE_F32, &m2);
    const cs_weight_t *ws[3] = {&w0, &w1, &w2};
    for (int n = 1; n <= 40; n += 13) {
        float *x = test_randv(&rng, (size_t)n * 80, 1.0f);
        float *ya[3], *yb[3];
        for (int k = 0; k < 3; k++) {
            ya[k] = malloc(sizeof(float) * n * ws[k]->rows);
            yb[k] = malloc(sizeof(float) * n * ws[k]->rows);
            cpu_raw_matmul(b, yb[k], x, n, ws[k], NULL);
        }
        const float *const bs[3] = {NULL, NULL, NULL};
        cpu_raw_matmul_multi(b, ya, x, n, ws, bs, 3);
        for (int k = 0; k < 3; k++) {
            ck_assert_msg(!memcmp(ya[k], yb[k], sizeof(float) * n * ws[k]->rows), "matmul_multi weight %d, n=%d", k, n);
            free(ya[k]);
            free(yb[k]);
        }
        free(x);
    }
    free(m0); free(m1); free(m2);
    cpu_raw_free(b);
}
END_TEST

/* One sequence of L positions over a scattered block table: its queries computed as one
 * prefill chunk, as three chunks beside another sequence, and one by one as decode rows
 * must give the same bits; and the reference's values. */
static void attention_case(int nh, int nkv, int hd, int window) {
    enum { BS = 16, L = 70, OTHER = 20 };
    int kvd = nkv * hd, nb = (L + BS - 1) / BS, ob = (OTHER + BS - 1) / BS, pool = nb + ob + 2;
    int32_t perm[16];
    for (int i = 0; i < pool; i++) perm[i] = i;
    for (int i = pool - 1; i > 0; i--) {
        int j = (int)(cs_rng_next(&rng) % (uint64_t)(i + 1));
        int32_t t = perm[i]; perm[i] = perm[j]; perm[j] = t;
    }
    const int32_t *blocks = perm, *oblocks = perm + nb;
    float *k = test_randv(&rng, (size_t)pool * BS * kvd, 1.0f), *v = test_randv(&rng, (size_t)pool * BS * kvd, 1.0f);
    size_t qd = (size_t)nh * hd;
    float *q = test_randv(&rng, (size_t)L * qd, 1.0f), *oq = test_randv(&rng, (size_t)OTHER * qd, 1.0f);
    float *all = malloc(sizeof(float) * L * qd), *want = malloc(sizeof(float) * L * qd);
    float *part = malloc(sizeof(float) * (L + OTHER) * qd), *qpart = malloc(sizeof(float) * (L + OTHER) * qd);
    cpu_raw_t *b = inv_backend(3);
    cpu_attn_seq_t one = {0, L, 0, blocks};
    cpu_raw_attention_paged(b, all, q, k, v, &one, 1, BS, nh, nkv, hd, window);
    cs_attention_paged_ref(want, q, k, v, &one, 1, BS, nh, nkv, hd, window);
    float e = test_max_rel_err(all, want, (size_t)L * qd);
    ck_assert_msg(e < 2e-5f, "invariant paged attention vs reference: %g (hd %d)", e, hd);
    /* chunks [0, 30) [30, 31) [31, 70), the last beside a decode row of another sequence */
    static const int cuts[][2] = {{0, 30}, {30, 31}, {31, L}};
    for (size_t c = 0; c < CS_ARRAY_LEN(cuts); c++) {
        int p0 = cuts[c][0], n = cuts[c][1] - p0;
        memcpy(qpart, oq, sizeof(float) * qd);
        memcpy(qpart + qd, q + (size_t)p0 * qd, sizeof(float) * n * qd);
        cpu_attn_seq_t two[2] = {{0, 1, OTHER - 1, oblocks}, {1, n, p0, blocks}};
        cpu_raw_attention_paged(b, part, qpart, k, v, two, 2, BS, nh, nkv, hd, window);
        ck_assert_msg(!memcmp(part + qd, all + (size_t)p0 * qd, sizeof(float) * n * qd),
                      "chunk [%d, %d) differs from the whole prefill (hd %d window %d)", p0, p0 + n, hd, window);
    }
    for (int p = 0; p < L; p += 7) {
        cpu_attn_seq_t dec = {0, 1, p, blocks};
        cpu_raw_attention_paged(b, part, q + (size_t)p * qd, k, v, &dec, 1, BS, nh, nkv, hd, window);
        ck_assert_msg(!memcmp(part, all + (size_t)p * qd, sizeof(float) * qd), "decode row %d differs from prefill", p);
    }
    cpu_raw_free(b);
    free(k); free(v); free(q); free(oq); free(all); free(want); free(part); free(qpart);
}

START_TEST(attention_queries_independent_of_chunking) {
    attention_case(4, 2, 64, 0);  /* register path */
    attention_case(2, 1, 128, 0);
    attention_case(6, 2, 24, 0);  /* generic path */
    attention_case(4, 4, 32, 25); /* sliding window */
}
END_TEST

/* a token's LoRA delta alone equals its delta inside a 45-row segment beside another
 * adapter's, with and without B transposed */
START_TEST(lora_rows_independent_of_segment) {
    enum { N = 45, DIN = 576, DOUT = 1536 };
    cpu_raw_t *b = inv_backend(3), *b1 = inv_backend(1);
    for (int with_bt = 0; with_bt < 2; with_bt++) {
        int ranks[2] = {16, 64};
        float *a[2], *bm[2], *bt[2];
        for (int s = 0; s < 2; s++) {
            a[s] = test_randv(&rng, (size_t)ranks[s] * DIN, 0.1f);
            bm[s] = test_randv(&rng, (size_t)DOUT * ranks[s], 0.1f);
            bt[s] = malloc(sizeof(float) * DOUT * ranks[s]);
            for (int o = 0; o < DOUT; o++)
                for (int r = 0; r < ranks[s]; r++) bt[s][(size_t)r * DOUT + o] = bm[s][(size_t)o * ranks[s] + r];
        }
        cpu_lora_seg_t segs[2] = {{0, N, a[0], bm[0], ranks[0], 2.0f, with_bt ? bt[0] : NULL, CS_DTYPE_F32},
                                      {N, 3, a[1], bm[1], ranks[1], 0.5f, with_bt ? bt[1] : NULL, CS_DTYPE_F32}};
        float *x = test_randv(&rng, (size_t)(N + 3) * DIN, 1.0f), *y0 = test_randv(&rng, (size_t)(N + 3) * DOUT, 1.0f);
        float *y = malloc(sizeof(float) * (N + 3) * DOUT), *yr = malloc(sizeof(float) * (N + 3) * DOUT);
        float *y1 = malloc(sizeof(float) * DOUT);
        memcpy(y, y0, sizeof(float) * (N + 3) * DOUT);
        memcpy(yr, y0, sizeof(float) * (N + 3) * DOUT);
        cpu_raw_lora_batch(b, y, x, segs, 2, DIN, DOUT);
        for (int s = 0; s < 2; s++)
            cs_lora_ref(yr + (size_t)segs[s].row0 * DOUT, x + (size_t)segs[s].row0 * DIN, segs[s].n, a[s], bm[s], ranks[s],
                        DIN, DOUT, segs[s].scale);
        float e = test_max_rel_err(y, yr, (size_t)(N + 3) * DOUT);
        ck_assert_msg(e < 1e-6f, "invariant lora_batch vs reference: %g", e);
        for (int i = 0; i < N + 3; i++) {
            int s = i < N ? 0 : 1;
            memcpy(y1, y0 + (size_t)i * DOUT, sizeof(float) * DOUT);
            cpu_lora_seg_t g = segs[s];
            g.row0 = 0;
            g.n = 1;
            if (i % 2) cpu_raw_lora_batch(b1, y1, x + (size_t)i * DIN, &g, 1, DIN, DOUT);
            else cpu_raw_lora(b1, y1, x + (size_t)i * DIN, 1, a[s], bm[s], ranks[s], DIN, DOUT, segs[s].scale);
            /* backend_lora has no transposed B: the same bits only where the batch had none either */
            if (i % 2 || !with_bt)
                ck_assert_msg(!memcmp(y1, y + (size_t)i * DOUT, sizeof(float) * DOUT), "lora row %d (bt %d) differs alone",
                              i, with_bt);
        }
        for (int s = 0; s < 2; s++) { free(a[s]); free(bm[s]); free(bt[s]); }
        free(x); free(y0); free(y); free(yr); free(y1);
    }
    cpu_raw_free(b);
    cpu_raw_free(b1);
}
END_TEST

int main(void) {
    cs_rng_seed(&rng, 20261122);
    if (!cs_cpu_has_avx512() && !cs_cpu_has_avx2()) {
        /* without AVX-512 or AVX2 the invariant mode is the reference kernels: nothing of its own */
        printf("SKIP: neither AVX-512 nor AVX2\n");
        return 77;
    }
    Suite *s = suite_create("batch_invariant");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, matmul_rows_independent_of_batch);
    tcase_add_test(tc, matmul_multi_equals_each);
    tcase_add_test(tc, attention_queries_independent_of_chunking);
    tcase_add_test(tc, lora_rows_independent_of_segment);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_set_fork_status(sr, CK_NOFORK);
    int failed = 0;
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1 && !(cs_cpu_has_avx512() && cs_cpu_has_avx2())) break;
        no_avx512 = pass == 1;
        cpu_raw_t *probe = inv_backend(1);
        printf("kernel path: %s\n", cpu_raw_path(probe));
        cpu_raw_free(probe);
        srunner_run_all(sr, CK_NORMAL);
        failed += srunner_ntests_failed(sr);
    }
    srunner_free(sr);
    return failed ? 1 : 0;
}
