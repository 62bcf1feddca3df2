/* test_cpu_batch_ops.c: the batch-level backend ops against their plain references: paged
 * attention over shuffled block tables (decode rows and prefill chunks of many sequences in
 * one call, GQA, sliding window, contiguous and scattered tables), grouped LoRA over
 * segments of different adapters and ranks, and row scatter/gather. The fast CPU backend
 * must agree with the reference backend (and with cs_attention_paged_ref / cs_lora_ref). */
#include <check.h>
#include <stdio.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels/cpu_raw.h"
#include "cpu_kernels/kernels.h"
#include "cpu_kernels/kernels_paged.h"
#include "engine/sampling.h"
#include "tests/testutil.h"

static cpu_raw_t *fast, *ref;
/* the kernel variants: the fastest this CPU has, AVX-512 off (an AVX2 CPU's), AVX2 off too
 * (plain loops), batch-invariant */
static const cpu_backend_params_t lora_variants[] = {
    {.n_threads = 2}, {.n_threads = 2, .no_avx512 = true}, {.n_threads = 2, .no_avx512 = true, .no_avx2 = true},
    {.n_threads = 2, .batch_invariant = true},
};
static const char *const lora_variant_names[] = {"fastest", "no-avx512", "plain", "invariant"};
static cs_rng_t rng;

/* max |a - b| over max |b|: the error relative to the output's scale */
static float max_scaled_err(const float *a, const float *b, size_t n) {
    float scale = 0;
    for (size_t i = 0; i < n; i++) scale = fmaxf(scale, fabsf(b[i]));
    return test_max_abs_diff(a, b, n) / (scale > 0 ? scale : 1);
}

static float max_rel_err(const float *a, const float *b, size_t n) {
    float worst = 0;
    for (size_t i = 0; i < n; i++) {
        float d = fabsf(a[i] - b[i]) / (1.0f + fabsf(b[i]));
        if (!(d <= worst)) worst = d;  /* NaN counts */
    }
    return worst;
}

/* n_seqs sequences with the given new-token counts and cached lengths, blocks drawn from a
 * shuffled pool (scattered) or laid out in order (contiguous), pools of kvt (F32 or BF16) */
static void run_paged_kv(int n_seqs, const int *n_new, const int *cached, int nh, int nkv, int hd, int window,
                         bool contiguous, cs_dtype kvt) {
    enum { BS = 16 };
    int kvd = nkv * hd, total_rows = 0, total_blocks = 0;
    for (int s = 0; s < n_seqs; s++) {
        total_rows += n_new[s];
        total_blocks += (cached[s] + n_new[s] + BS - 1) / BS;
    }
    int pool_blocks = total_blocks + 3;
    int32_t *perm = malloc(sizeof(int32_t) * pool_blocks);
    for (int i = 0; i < pool_blocks; i++) perm[i] = i;
    if (!contiguous)
        for (int i = pool_blocks - 1; i > 0; i--) {
            int j = (int)(cs_rng_next(&rng) % (uint64_t)(i + 1));
            int32_t t = perm[i]; perm[i] = perm[j]; perm[j] = t;
        }
    size_t pool_n = (size_t)pool_blocks * BS * kvd;
    float *k = test_randv(&rng, pool_n, 1.0f), *v = test_randv(&rng, pool_n, 1.0f);
    /* BF16 pools hold k and v rounded; k and v become what they hold (for the contiguous check) */
    uint16_t *kb = malloc(pool_n * 2), *vb = malloc(pool_n * 2);
    if (kvt == CS_DTYPE_BF16)
        for (size_t i = 0; i < pool_n; i++) {
            kb[i] = cs_f32_to_bf16(k[i]), vb[i] = cs_f32_to_bf16(v[i]);
            k[i] = cs_bf16_to_f32(kb[i]), v[i] = cs_bf16_to_f32(vb[i]);
        }
    const void *kp = kvt == CS_DTYPE_BF16 ? (const void *)kb : k, *vp = kvt == CS_DTYPE_BF16 ? (const void *)vb : v;
    float *q = test_randv(&rng, (size_t)total_rows * nh * hd, 1.0f);
    float *o1 = calloc((size_t)total_rows * nh * hd, sizeof(float)), *o2 = calloc((size_t)total_rows * nh * hd, sizeof(float));
    float *o3 = calloc((size_t)total_rows * nh * hd, sizeof(float));
    cpu_attn_seq_t *seqs = malloc(sizeof *seqs * n_seqs);
    int row = 0, next_block = 0;
    for (int s = 0; s < n_seqs; s++) {
        int nb = (cached[s] + n_new[s] + BS - 1) / BS;
        seqs[s] = (cpu_attn_seq_t){row, n_new[s], cached[s], perm + next_block};
        row += n_new[s];
        next_block += nb;
    }
    cpu_raw_attention_paged_kv(fast, o1, q, kp, vp, kvt, seqs, n_seqs, BS, nh, nkv, hd, window);
    cpu_raw_attention_paged_kv(ref, o2, q, kp, vp, kvt, seqs, n_seqs, BS, nh, nkv, hd, window);
    cs_attention_paged_kv_ref(o3, q, kp, vp, kvt, seqs, n_seqs, BS, nh, nkv, hd, window);
    size_t n = (size_t)total_rows * nh * hd;
    float e = max_rel_err(o1, o3, n);
    ck_assert_msg(e < 2e-5f, "paged attention: fast vs reference %g (seqs %d, nh %d nkv %d hd %d window %d %s, %s pools)", e,
                  n_seqs, nh, nkv, hd, window, contiguous ? "contiguous" : "scattered", cs_dtype_name(kvt));
    ck_assert_msg(max_rel_err(o2, o3, n) == 0, "the reference backend is not the reference kernel");
    /* against the contiguous-cache attention of each sequence: the paging itself is right */
    for (int s = 0; s < n_seqs; s++) {
        int len = cached[s] + n_new[s];
        float *kc = malloc(sizeof(float) * (size_t)len * kvd), *vc = malloc(sizeof(float) * (size_t)len * kvd);
        for (int p = 0; p < len; p++) {
            memcpy(kc + (size_t)p * kvd, k + cs_paged_row(seqs[s].blocks, BS, p) * kvd, sizeof(float) * kvd);
            memcpy(vc + (size_t)p * kvd, v + cs_paged_row(seqs[s].blocks, BS, p) * kvd, sizeof(float) * kvd);
        }
        float *oc = malloc(sizeof(float) * (size_t)n_new[s] * nh * hd);
        cs_attention_ref(oc, q + (size_t)seqs[s].row0 * nh * hd, kc, vc, n_new[s], cached[s], nh, nkv, hd, window);
        float es = max_rel_err(o3 + (size_t)seqs[s].row0 * nh * hd, oc, (size_t)n_new[s] * nh * hd);
        ck_assert_msg(es < 1e-6f, "paged reference vs contiguous reference: %g", es);
        free(kc);
        free(vc);
        free(oc);
    }
    free(perm); free(k); free(v); free(kb); free(vb); free(q); free(o1); free(o2); free(o3); free(seqs);
}

/* every case on F32 pools and on BF16 pools */
static void run_paged(int n_seqs, const int *n_new, const int *cached, int nh, int nkv, int hd, int window, bool contiguous) {
    run_paged_kv(n_seqs, n_new, cached, nh, nkv, hd, window, contiguous, CS_DTYPE_F32);
    run_paged_kv(n_seqs, n_new, cached, nh, nkv, hd, window, contiguous, CS_DTYPE_BF16);
}

/* _i: the kernel variant (lora_variants) */
START_TEST(paged_attention_decode_batch) {
    cpu_raw_t *saved = fast;
    fast = cpu_raw_new(&lora_variants[_i]);
    int n_new[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1}, cached[9] = {0, 1, 15, 16, 17, 40, 100, 255, 7};
    run_paged(9, n_new, cached, 4, 2, 16, 0, false);
    run_paged(9, n_new, cached, 6, 2, 24, 0, false);   /* head_dim not a multiple of 16 */
    run_paged(9, n_new, cached, 4, 4, 32, 33, false);  /* sliding window */
    run_paged(9, n_new, cached, 4, 1, 64, 0, true);
    run_paged(9, n_new, cached, 2, 1, 128, 0, false);
    run_paged(9, n_new, cached, 2, 2, 48, 0, false);   /* multiple of 16, no register path */
    run_paged(9, n_new, cached, 2, 2, 12, 0, false);   /* not a multiple of 8: the plain loops */
    cpu_raw_free(fast);
    fast = saved;
}
END_TEST

START_TEST(paged_attention_mixed) {
    cpu_raw_t *saved = fast;
    fast = cpu_raw_new(&lora_variants[_i]);
    /* prefill chunks (some continuing after a cached prefix) beside decode rows */
    int n_new[6] = {40, 1, 16, 3, 70, 1}, cached[6] = {0, 30, 32, 5, 17, 0};
    run_paged(6, n_new, cached, 4, 2, 16, 0, false);
    run_paged(6, n_new, cached, 4, 2, 16, 0, true);
    run_paged(6, n_new, cached, 8, 2, 32, 20, false);
    int one[1] = {130}, none[1] = {0};
    run_paged(1, one, none, 4, 4, 16, 0, true);
    run_paged(1, one, none, 4, 4, 16, 0, false);
    cpu_raw_free(fast);
    fast = saved;
}
END_TEST

/* every path of the grouped LoRA: inline (little work), one task per segment (several
 * adapters), shrink/expand split across threads (one or two adapters), GEMM segments
 * (9..64 rows), per-segment row split (many rows); F32 and BF16 weights; on the fastest
 * kernels this CPU has, then with AVX-512 off (an AVX2 CPU's), with AVX2 off too (plain
 * loops), and batch-invariant. _i = variant * 2 + (BF16). */

START_TEST(lora_batch_segments) {
    cpu_raw_t *be = cpu_raw_new(&lora_variants[_i / 2]);
    cs_dtype dt = _i % 2 ? CS_DTYPE_BF16 : CS_DTYPE_F32;
    static const struct { int d_in, d_out, n_segs, big_rows; } trials[] = {
        {96, 80, 5, 7}, {96, 80, 5, 20}, {96, 80, 5, 70}, {93, 77, 5, 9},
        {1000, 1500, 5, 7}, {1000, 1500, 5, 20}, {1000, 1500, 1, 7}, {1000, 1500, 2, 20}, {1000, 700, 2, 3},
    };
    for (size_t trial = 0; trial < sizeof trials / sizeof trials[0]; trial++) {
        int d_in = trials[trial].d_in, d_out = trials[trial].d_out, n_segs = trials[trial].n_segs, total = 0;
        int ranks[5] = {8, 16, 32, 64, 4}, rows[5] = {1, 3, 1, 2, 7};
        rows[n_segs - 1] = trials[trial].big_rows;
        cpu_lora_seg_t segs[5];
        float *a[5], *b[5], *bt[5];
        uint16_t *a16[5], *b16[5], *bt16[5];
        for (int i = 0; i < n_segs; i++) {
            size_t na = (size_t)ranks[i] * d_in, nb = (size_t)d_out * ranks[i];
            a[i] = test_randv(&rng, na, 1.0f);
            b[i] = test_randv(&rng, nb, 1.0f);
            bt[i] = malloc(sizeof(float) * nb);
            a16[i] = malloc(2 * na);
            b16[i] = malloc(2 * nb);
            bt16[i] = malloc(2 * nb);
            /* values BF16 holds exactly, so both dtypes have one truth */
            for (size_t k = 0; k < na; k++) a[i][k] = cs_bf16_to_f32(a16[i][k] = cs_f32_to_bf16(a[i][k]));
            for (size_t k = 0; k < nb; k++) b[i][k] = cs_bf16_to_f32(b16[i][k] = cs_f32_to_bf16(b[i][k]));
            for (int o = 0; o < d_out; o++)
                for (int r = 0; r < ranks[i]; r++) {
                    bt[i][(size_t)r * d_out + o] = b[i][(size_t)o * ranks[i] + r];
                    bt16[i][(size_t)r * d_out + o] = b16[i][(size_t)o * ranks[i] + r];
                }
            /* with and without the transposed copy (its fast path and the one over B) */
            bool with_bt = (trial + i) % 2;
            segs[i] = dt == CS_DTYPE_BF16
                          ? (cpu_lora_seg_t){total + (i == 1 ? 1 : 0), rows[i], a16[i], b16[i], ranks[i], 0.5f + i,
                                             with_bt ? bt16[i] : NULL, dt}
                          : (cpu_lora_seg_t){total + (i == 1 ? 1 : 0), rows[i], a[i], b[i], ranks[i], 0.5f + i,
                                             with_bt ? bt[i] : NULL, dt};
            total = segs[i].row0 + rows[i];
        }
        float *x = test_randv(&rng, (size_t)total * d_in, 1.0f), *y0 = test_randv(&rng, (size_t)total * d_out, 1.0f);
        float *y1 = malloc(sizeof(float) * (size_t)total * d_out), *y2 = malloc(sizeof(float) * (size_t)total * d_out);
        memcpy(y1, y0, sizeof(float) * (size_t)total * d_out);
        memcpy(y2, y0, sizeof(float) * (size_t)total * d_out);
        cpu_raw_lora_batch(be, y1, x, segs, n_segs, d_in, d_out);
        /* the truth in double (float references differ from it by their own rounding at K = 1000) */
        for (int i = 0; i < n_segs; i++)
            for (int r = 0; r < segs[i].n; r++) {
                const float *xr = x + (size_t)(segs[i].row0 + r) * d_in;
                double t[64];
                for (int k = 0; k < ranks[i]; k++) {
                    t[k] = 0;
                    for (int e = 0; e < d_in; e++) t[k] += (double)xr[e] * a[i][(size_t)k * d_in + e];
                }
                for (int o = 0; o < d_out; o++) {
                    double acc = 0;
                    for (int k = 0; k < ranks[i]; k++) acc += t[k] * b[i][(size_t)o * ranks[i] + k];
                    y2[(size_t)(segs[i].row0 + r) * d_out + o] += (float)(segs[i].scale * acc);
                }
            }
        float e = max_scaled_err(y1, y2, (size_t)total * d_out);
        /* and the plain float reference is as close */
        memcpy(y1, y0, sizeof(float) * (size_t)total * d_out);
        for (int i = 0; i < n_segs; i++)
            cs_lora_ref(y1 + (size_t)segs[i].row0 * d_out, x + (size_t)segs[i].row0 * d_in, segs[i].n, a[i], b[i], ranks[i],
                        d_in, d_out, segs[i].scale);
        float er = max_scaled_err(y1, y2, (size_t)total * d_out);
        /* both at the level of float rounding (~1e-7 of the output's scale) */
        fprintf(stderr, "lora_batch %s %s trial %zu: fast %.2e, cs_lora_ref %.2e (max |err| / max |y|)\n",
                lora_variant_names[_i / 2], cs_dtype_name(dt), trial, e, er);
        ck_assert_msg(e < 1e-6f, "lora_batch %s %s trial %zu: %g (reference %g)", lora_variant_names[_i / 2],
                      cs_dtype_name(dt), trial, e, er);
        ck_assert_msg(er < 1e-6f, "cs_lora_ref trial %zu: %g", trial, er);
        memcpy(y1, y0, sizeof(float) * (size_t)total * d_out);
        cpu_raw_lora_batch(be, y1, x, segs, n_segs, d_in, d_out);
        if (n_segs > 1) /* the row between segments 0 and 1 belongs to no segment: untouched */
            for (int c = 0; c < d_out; c++) ck_assert(y1[(size_t)rows[0] * d_out + c] == y0[(size_t)rows[0] * d_out + c]);
        for (int i = 0; i < n_segs; i++) {
            free(a[i]); free(b[i]); free(bt[i]);
            free(a16[i]); free(b16[i]); free(bt16[i]);
        }
        free(x); free(y0); free(y1); free(y2);
    }
    cpu_raw_free(be);
}
END_TEST

/* projections of one input in one call (q/k/v, gate/up) equal matmul per weight */
START_TEST(matmul_multi_equals_each) {
    static const int ns[] = {1, 3, 8, 20};
    static const cs_dtype dts[] = {CS_DTYPE_BF16, CS_DTYPE_F32, CS_DTYPE_F16};
    int rows[3] = {64, 24, 40}, cols = 48;
    for (size_t di = 0; di < 3; di++)
        for (size_t ni = 0; ni < 4; ni++) {
            int n = ns[ni];
            cs_weight_t w[3];
            void *data[3];
            float *bias[3], *y[3], *yr[3];
            for (int k = 0; k < 3; k++) {
                float *f = test_randv(&rng, (size_t)rows[k] * cols, 1.0f);
                size_t esz = cs_dtype_size(dts[di]);
                data[k] = malloc(esz * (size_t)rows[k] * cols);
                for (size_t e = 0; e < (size_t)rows[k] * cols; e++) {
                    if (dts[di] == CS_DTYPE_BF16) ((uint16_t *)data[k])[e] = cs_f32_to_bf16(f[e]);
                    else if (dts[di] == CS_DTYPE_F16) ((uint16_t *)data[k])[e] = cs_f32_to_f16(f[e]);
                    else ((float *)data[k])[e] = f[e];
                }
                free(f);
                w[k] = (cs_weight_t){dts[di], rows[k], cols, data[k], NULL, NULL};
                bias[k] = k == 1 ? NULL : test_randv(&rng, (size_t)rows[k], 1.0f);
                y[k] = malloc(sizeof(float) * (size_t)n * rows[k]);
                yr[k] = malloc(sizeof(float) * (size_t)n * rows[k]);
            }
            float *x = test_randv(&rng, (size_t)n * cols, 1.0f);
            float *const ys[3] = {y[0], y[1], y[2]};
            const cs_weight_t *const ws[3] = {&w[0], &w[1], &w[2]};
            const float *const bs[3] = {bias[0], bias[1], bias[2]};
            cpu_raw_matmul_multi(fast, ys, x, n, ws, bs, 3);
            for (int k = 0; k < 3; k++) {
                cs_matmul_ref(yr[k], x, n, &w[k], bias[k]);
                float e = max_rel_err(y[k], yr[k], (size_t)n * rows[k]);
                ck_assert_msg(e < 2e-6f, "matmul_multi dtype %d n %d weight %d: %g", (int)dts[di], n, k, e);
                free(data[k]); free(bias[k]); free(y[k]); free(yr[k]);
            }
            free(x);
        }
}
END_TEST

START_TEST(rows_scatter_gather) {
    float *src = test_randv(&rng, 5 * 7, 1.0f), dst[10 * 7] = {0}, back[5 * 7];
    int32_t idx[5] = {9, 0, 4, 2, 7};
    cpu_raw_set_rows(fast, dst, src, idx, 5, 7);
    cpu_raw_get_rows(fast, back, dst, idx, 5, 7);
    ck_assert(memcmp(back, src, sizeof back) == 0);
    ck_assert(dst[7 * 1] == 0 && dst[7 * 3] == 0);
    free(src);
}
END_TEST

/* KV rows into a BF16 pool: bit for bit torch's rounding (cs_f32_to_bf16) on every kernel
 * variant, for rows of whole vectors and tails, with ties, NaN, infinities, -0, denormals and
 * values that round up to infinity */
START_TEST(kv_store_bf16) {
    cpu_raw_t *b = cpu_raw_new(&lora_variants[_i]);
    static const uint32_t special[] = {0x3f808000u, 0x3f818000u, 0x7fc00001u, 0xff800001u, 0x7f800000u, 0xff800000u,
                                       0x80000000u, 0x00000001u, 0x807fffffu, 0x7f7fffffu, 0x3f80ffffu, 0xbf80c000u};
    for (int len = 1; len <= 49; len += 12) {
        enum { N = 3, ROWS = 5 };
        float *src = test_randv(&rng, (size_t)N * len, 1.0f);
        for (size_t i = 0; i < CS_ARRAY_LEN(special) && i < (size_t)N * len; i++)
            memcpy(&src[(i * 7) % ((size_t)N * len)], &special[i], 4);
        int32_t slots[N] = {4, 0, 2};
        uint16_t got[ROWS * 49], want[ROWS * 49];
        for (int i = 0; i < ROWS * 49; i++) got[i] = want[i] = (uint16_t)(0x1234 + i);
        cpu_raw_kv_store(b, got, CS_DTYPE_BF16, src, slots, N, len);
        for (int i = 0; i < N; i++)
            for (int e = 0; e < len; e++) want[(size_t)slots[i] * len + e] = cs_f32_to_bf16(src[(size_t)i * len + e]);
        for (int i = 0; i < ROWS * len; i++)
            ck_assert_msg(got[i] == want[i], "%s: len %d [%d]: %#06x, want %#06x", lora_variant_names[_i], len, i, got[i],
                          want[i]);
        uint16_t viaref[ROWS * 49];
        for (int i = 0; i < ROWS * 49; i++) viaref[i] = (uint16_t)(0x1234 + i);
        cs_kv_store_ref(viaref, CS_DTYPE_BF16, src, slots, N, len);
        ck_assert(!memcmp(viaref, want, sizeof want));
        free(src);
    }
    cpu_raw_free(b);
}
END_TEST

int main(void) {
    cs_rng_seed(&rng, 42);
    fast = cpu_raw_new(&(cpu_backend_params_t){.n_threads = 2});
    ref = cpu_raw_new(&(cpu_backend_params_t){.n_threads = 1, .reference = true});
    Suite *s = suite_create("backend_ops");
    TCase *tc = tcase_create("core");
    tcase_add_loop_test(tc, paged_attention_decode_batch, 0, (int)CS_ARRAY_LEN(lora_variants));
    tcase_add_loop_test(tc, paged_attention_mixed, 0, (int)CS_ARRAY_LEN(lora_variants));
    tcase_add_loop_test(tc, lora_batch_segments, 0, 2 * (int)(sizeof lora_variants / sizeof lora_variants[0]));
    tcase_add_test(tc, matmul_multi_equals_each);
    tcase_add_test(tc, rows_scatter_gather);
    tcase_add_loop_test(tc, kv_store_bf16, 0, (int)CS_ARRAY_LEN(lora_variants));
    suite_add_tcase(s, tc);
    int nf = cs_check_run(s, CK_NOFORK);
    cpu_raw_free(fast);
    cpu_raw_free(ref);
    return nf ? 1 : 0;
}
