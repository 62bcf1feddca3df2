/* test_backend_ops.c: every op and copy of the backend interface (backend/backend.h), on
 * every backend built, against plain references computed here on the host (as ggml's
 * test-backend-ops does): the CPU backend with its fast kernels, with AVX-512 off (what an
 * AVX2 CPU runs), with AVX2 off too (plain loops), with the reference kernels, and the
 * strict test device (handles checked, copies on its copy thread over a link with a set
 * bandwidth), the CUDA backend's own sources run on the host CUDA emulator (cuda-emu,
 * always). The same source built with -DTEST_BACKEND_GPU is tests/test_backend_ops_gpu: the
 * CUDA backend on a GPU (cuda), which exits 77 (automake SKIP) without a CUDA build or a
 * visible GPU, and fails instead with CS_TEST_REQUIRE_CUDA=1 (as tests/test_gpu runs it).
 * Every backend a program tests must be there: none passes by not running. Adapter slots are
 * tested with F32 and BF16 weights, uploaded whole and streaming in (the cold start, with the
 * host-assisted get_signal / wait_add, where a backend has them).
 *
 * Tolerances, |got - ref| <= tol * (1 + |ref|):
 *   matmul, matmul_multi, lora (F32 accumulation in another order): 5e-5 for F32, BF16 and
 *   F16 weights alike (the weights widen to F32 exactly). The CUDA backends round the
 *   activations to a 16-bit weight's dtype before the GEMM (as cuBLAS takes both operands
 *   in one type); their reference rounds x the same way, and the tolerance stays 5e-5;
 *   rmsnorm, rope, attention, silu_mul: 1e-5;
 *   embed, kv_store, get_out_rows, add, copies: exact. */
#include <check.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "config.h"
#include "cpu_kernels/cpu_backend.h"
#include "cpu_kernels/kernels.h"
#include "gpu_kernels/gpu_backend.h"
#include "cpu_kernels/kernels_paged.h"
#include "engine/sampling.h"
#include "tests/testutil.h"

enum { N_BACKENDS = 8, CUDA_EMU = 6, CUDA_GPU = 7 };
#ifdef TEST_BACKEND_GPU
enum { FIRST_BACKEND = CUDA_GPU, END_BACKENDS = N_BACKENDS }; /* the GPU alone */
#else
enum { FIRST_BACKEND = 0, END_BACKENDS = CUDA_GPU };          /* every backend but the GPU */
#endif
static const char *names[N_BACKENDS] = {"cpu", "cpu-reference", "strict", "strict-slow-link", "cpu-no-avx512",
                                        "cpu-plain", "cuda-emu", "cuda"};
static backend_t *bes[N_BACKENDS];
static cs_rng_t rng;

static backend_t *make_backend(int i) {
    switch (i) {
    case 0: return cpu_backend_new(&(cpu_backend_params_t){.n_threads = 2});
    case 1: return cpu_backend_new(&(cpu_backend_params_t){.n_threads = 1, .reference = true});
    case 2: return strict_device_new(&(strict_device_params_t){.cpu = {.n_threads = 2}});
    case 4: return cpu_backend_new(&(cpu_backend_params_t){.n_threads = 2, .no_avx512 = true}); /* an AVX2 CPU's */
    case 5: return cpu_backend_new(&(cpu_backend_params_t){.n_threads = 2, .no_avx512 = true, .no_avx2 = true});
    case 3: return strict_device_new(&(strict_device_params_t){.cpu = {.n_threads = 3}, .bytes_per_s = 2e9,
                                                                .latency_us = 20});
    case CUDA_EMU: return cuda_emu_backend_new(NULL);
    case CUDA_GPU:
#ifdef CS_HAVE_CUDA
        return cuda_backend_new(NULL);
#else
        cs_error_set(CS_EUNSUPPORTED, "built without CUDA");
        return NULL;
#endif
    }
    return NULL;
}

/* a CUDA backend with params P: the emulator's, or with GPU the device's (NULL with an error
 * in a build without CUDA) */
static backend_t *cuda_with(bool gpu, const cuda_backend_params_t *p) {
    if (!gpu) return cuda_emu_backend_new(p);
#ifdef CS_HAVE_CUDA
    return cuda_backend_new(p);
#else
    cs_error_set(CS_EUNSUPPORTED, "built without CUDA");
    return NULL;
#endif
}

static backend_buf_t *up(backend_t *b, const void *host, size_t nbytes) {
    backend_buf_t *buf = backend_buf_alloc(b, nbytes);
    ck_assert_ptr_nonnull(buf);
    backend_buf_set(b, buf, 0, host, nbytes);
    return buf;
}

static float *down(backend_t *b, const backend_buf_t *buf, size_t nfloats) {
    float *h = malloc(sizeof(float) * (nfloats ? nfloats : 1));
    backend_buf_get(b, h, buf, 0, sizeof(float) * nfloats);
    return h;
}

static void close_to(const float *got, const float *want, size_t n, double tol, const char *what, int be) {
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - want[i]);
        ck_assert_msg(d <= tol * (1 + fabs(want[i])), "%s on %s: [%zu] %.9g vs %.9g", what, names[be], i, got[i],
                      want[i]);
    }
}

/* a weight of dtype dt with random values, as host F32 (the exact values) and host bytes */
typedef struct hweight {
    cs_weight_t w;      /* host, for the references */
    void *bytes;
    float *f32;
} hweight_t;

static hweight_t hweight_new(cs_dtype dt, int rows, int cols, float scale) {
    hweight_t h;
    size_t n = (size_t)rows * cols;
    h.f32 = test_randv(&rng, n, scale);
    h.bytes = malloc(n * cs_dtype_size(dt));
    if (dt == CS_DTYPE_F32) {
        memcpy(h.bytes, h.f32, n * sizeof(float));
    } else {
        for (size_t i = 0; i < n; i++) {
            uint16_t v = dt == CS_DTYPE_BF16 ? cs_f32_to_bf16(h.f32[i]) : cs_f32_to_f16(h.f32[i]);
            ((uint16_t *)h.bytes)[i] = v;
        }
        cs_to_f32(h.f32, h.bytes, dt, n); /* the exact values the kernels see */
    }
    h.w = (cs_weight_t){dt, rows, cols, h.bytes, NULL, NULL};
    return h;
}

static backend_weight_t bweight(backend_t *b, const hweight_t *h) {
    return (backend_weight_t){h->w.dtype, h->w.rows, h->w.cols,
                              up(b, h->bytes, (size_t)h->w.rows * h->w.cols * cs_dtype_size(h->w.dtype)), NULL};
}

static void hweight_free(hweight_t *h) {
    free(h->bytes);
    free(h->f32);
}

/* ---- a batch over a shuffled pool of blocks ---- */
#define BS 16
typedef struct tbatch {
    int n_seqs, T, n_blocks, n_out;
    int32_t ids[512], pos[512], slots[512], out_rows[512], blocks[256];
    backend_seq_desc_t seqs[16];
    cpu_attn_seq_t hseqs[16];   /* host views for the references */
    backend_lora_seg_desc_t lora[16];
    int n_lora;
} tbatch_t;

/* sequences with `cached` tokens already in the pools and n_new new ones; blocks are a
 * random permutation of the pool's */
static void tbatch_make(tbatch_t *t, int n_seqs, const int *cached, const int *n_new, int pool_blocks, int vocab) {
    memset(t, 0, sizeof *t);
    int perm[256];
    for (int i = 0; i < pool_blocks; i++) perm[i] = i;
    for (int i = pool_blocks - 1; i > 0; i--) {
        int j = (int)(cs_rng_next(&rng) % (uint64_t)(i + 1)), x = perm[i];
        perm[i] = perm[j];
        perm[j] = x;
    }
    int row = 0, blk = 0;
    for (int s = 0; s < n_seqs; s++) {
        int nb = (cached[s] + n_new[s] + BS - 1) / BS;
        ck_assert_int_le(blk + nb, pool_blocks);
        memcpy(t->blocks + blk, perm + blk, sizeof(int32_t) * nb);
        t->seqs[s] = (backend_seq_desc_t){row, n_new[s], cached[s], blk};
        t->hseqs[s] = (cpu_attn_seq_t){row, n_new[s], cached[s], t->blocks + blk};
        for (int i = 0; i < n_new[s]; i++, row++) {
            int p = cached[s] + i;
            t->ids[row] = (int32_t)(cs_rng_next(&rng) % (uint64_t)vocab);
            t->pos[row] = p;
            t->slots[row] = t->blocks[blk + p / BS] * BS + p % BS;
            if (i == n_new[s] - 1) t->out_rows[t->n_out++] = row;
        }
        blk += nb;
    }
    t->n_seqs = n_seqs;
    t->T = row;
    t->n_blocks = blk;
}

static backend_batch_t *tbatch_upload(backend_t *b, const tbatch_t *t, backend_batch_t *reuse) {
    backend_batch_desc_t d = {t->T, t->ids, t->pos, t->slots, t->n_seqs, t->seqs, t->n_blocks, t->blocks,
                              t->n_out, t->out_rows, t->n_lora, t->lora};
    backend_batch_t *bt = reuse;
    ck_assert_int_eq(backend_batch_upload(b, &bt, &d), CS_OK);
    return bt;
}

/* ---- matmul ---- */
/* the activations as backend b's GEMM sees them against a weight of dtype dt */
static float *gemm_x(const backend_t *b, const float *x, size_t n, cs_dtype dt) {
    float *r = malloc(sizeof(float) * (n ? n : 1));
    bool same = !backend_is_cuda(b) || dt == CS_DTYPE_F32;
    for (size_t i = 0; i < n; i++)
        r[i] = same                 ? x[i]
               : dt == CS_DTYPE_BF16 ? cs_bf16_to_f32(cs_f32_to_bf16(x[i]))
                                     : cs_f16_to_f32(cs_f32_to_f16(x[i]));
    return r;
}

START_TEST(test_matmul) {
    backend_t *b = bes[_i];
    static const cs_dtype dts[] = {CS_DTYPE_F32, CS_DTYPE_BF16, CS_DTYPE_F16};
    static const int ns[] = {1, 2, 3, 5, 8, 9, 17, 32, 33, 45, 70};
    static const int shapes[][2] = {{96, 64}, {33, 130}, {256, 300}, {7, 17}};
    for (size_t di = 0; di < 3; di++)
        for (size_t si = 0; si < 4; si++) {
            int rows = shapes[si][0], cols = shapes[si][1];
            hweight_t h = hweight_new(dts[di], rows, cols, 0.5f);
            backend_weight_t w = bweight(b, &h);
            float *bias = test_randv(&rng, (size_t)rows, 0.5f);
            backend_buf_t *bb = up(b, bias, sizeof(float) * rows);
            for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++) {
                int n = ns[ni];
                float *x = test_randv(&rng, (size_t)n * cols, 1.0f), *want = malloc(sizeof(float) * n * rows);
                backend_buf_t *bx = up(b, x, sizeof(float) * n * cols), *by = backend_buf_alloc(b, sizeof(float) * n * rows);
                float *xr = gemm_x(b, x, (size_t)n * cols, dts[di]);
                for (int with_bias = 0; with_bias < 2; with_bias++) {
                    cs_matmul_ref(want, xr, n, &h.w, with_bias ? bias : NULL);
                    backend_matmul(b, by, bx, n, &w, with_bias ? bb : NULL);
                    float *got = down(b, by, (size_t)n * rows);
                    close_to(got, want, (size_t)n * rows, 5e-5, cs_dtype_name(dts[di]), _i);
                    free(got);
                }
                free(x);
                free(xr);
                free(want);
                backend_buf_free(b, bx);
                backend_buf_free(b, by);
            }
            /* matmul_multi: three weights of one input, a bias on one */
            hweight_t h2 = hweight_new(dts[di], rows + 3, cols, 0.5f), h3 = hweight_new(dts[di], 5, cols, 0.5f);
            backend_weight_t w2 = bweight(b, &h2), w3 = bweight(b, &h3);
            for (int n = 1; n <= 40; n += 13) {
                float *x = test_randv(&rng, (size_t)n * cols, 1.0f);
                backend_buf_t *bx = up(b, x, sizeof(float) * n * cols);
                backend_buf_t *ys[3] = {backend_buf_alloc(b, sizeof(float) * n * rows),
                                        backend_buf_alloc(b, sizeof(float) * n * (rows + 3)),
                                        backend_buf_alloc(b, sizeof(float) * n * 5)};
                const backend_weight_t *ws[3] = {&w, &w2, &w3};
                const backend_buf_t *bs[3] = {NULL, NULL, bb};
                const cs_weight_t *hw[3] = {&h.w, &h2.w, &h3.w};
                const float *hb[3] = {NULL, NULL, bias};
                /* the third weight has 5 rows: its bias is the first 5 of `bias` */
                backend_matmul_multi(b, ys, bx, n, ws, bs, 3);
                float *xr = gemm_x(b, x, (size_t)n * cols, dts[di]);
                for (int k = 0; k < 3; k++) {
                    float *want = malloc(sizeof(float) * n * hw[k]->rows);
                    cs_matmul_ref(want, xr, n, hw[k], hb[k]);
                    float *got = down(b, ys[k], (size_t)n * hw[k]->rows);
                    close_to(got, want, (size_t)n * hw[k]->rows, 5e-5, "matmul_multi", _i);
                    free(got);
                    free(want);
                    backend_buf_free(b, ys[k]);
                }
                backend_buf_free(b, bx);
                free(x);
                free(xr);
            }
            backend_buf_free(b, w.buf);
            backend_buf_free(b, w2.buf);
            backend_buf_free(b, w3.buf);
            backend_buf_free(b, bb);
            free(bias);
            hweight_free(&h);
            hweight_free(&h2);
            hweight_free(&h3);
        }
}
END_TEST

/* ---- elementwise, norms, rope, embed ---- */
START_TEST(test_elementwise) {
    backend_t *b = bes[_i];
    for (int n = 1; n <= 1000; n = n * 3 + 1) {
        float *g = test_randv(&rng, (size_t)n, 4.0f), *u = test_randv(&rng, (size_t)n, 2.0f);
        float *want = malloc(sizeof(float) * n);
        backend_buf_t *bg = up(b, g, sizeof(float) * n), *bu = up(b, u, sizeof(float) * n);
        memcpy(want, g, sizeof(float) * n);
        cs_silu_mul_ref(want, u, (size_t)n);
        backend_silu_mul(b, bg, bu, (size_t)n);
        float *got = down(b, bg, (size_t)n);
        close_to(got, want, (size_t)n, 1e-5, "silu_mul", _i);
        free(got);
        for (int i = 0; i < n; i++) want[i] = u[i] + g[i];
        backend_buf_set(b, bu, 0, u, sizeof(float) * n);
        backend_buf_set(b, bg, 0, g, sizeof(float) * n);
        backend_add(b, bu, bg, (size_t)n);
        got = down(b, bu, (size_t)n);
        close_to(got, want, (size_t)n, 0, "add", _i);
        free(got);
        free(g);
        free(u);
        free(want);
        backend_buf_free(b, bg);
        backend_buf_free(b, bu);
    }
    /* rmsnorm: rows of dim, in place too */
    static const int dims[] = {16, 64, 100, 257};
    for (size_t di = 0; di < 4; di++)
        for (int n = 1; n <= 37; n += 12) {
            int dim = dims[di];
            float *x = test_randv(&rng, (size_t)n * dim, 3.0f), *wv = test_randv(&rng, (size_t)dim, 1.0f);
            float *want = malloc(sizeof(float) * n * dim);
            backend_weight_t w = {CS_DTYPE_F32, 1, dim, up(b, wv, sizeof(float) * dim), NULL};
            backend_buf_t *bx = up(b, x, sizeof(float) * n * dim), *by = backend_buf_alloc(b, sizeof(float) * n * dim);
            cs_rmsnorm_ref(want, x, n, dim, wv, 1e-6f);
            backend_rmsnorm(b, by, bx, n, dim, &w, 1e-6f);
            float *got = down(b, by, (size_t)n * dim);
            close_to(got, want, (size_t)n * dim, 1e-5, "rmsnorm", _i);
            free(got);
            backend_rmsnorm(b, bx, bx, n, dim, &w, 1e-6f);
            got = down(b, bx, (size_t)n * dim);
            close_to(got, want, (size_t)n * dim, 1e-5, "rmsnorm in place", _i);
            free(got);
            free(x);
            free(wv);
            free(want);
            backend_buf_free(b, w.buf);
            backend_buf_free(b, bx);
            backend_buf_free(b, by);
        }
}
END_TEST

START_TEST(test_rope_embed_rows) {
    backend_t *b = bes[_i];
    const int vocab = 50, H = 24, nh = 3, hd = 8;
    tbatch_t t;
    int cached[3] = {0, 21, 40}, n_new[3] = {7, 1, 12};
    tbatch_make(&t, 3, cached, n_new, 16, vocab);
    backend_batch_t *bt = tbatch_upload(b, &t, NULL);
    /* rope at the batch's positions */
    float inv[hd / 2];
    for (int i = 0; i < hd / 2; i++) inv[i] = 1.0f / powf(10000.0f, (float)(2 * i) / hd);
    backend_buf_t *binv = up(b, inv, sizeof inv);
    float *x = test_randv(&rng, (size_t)t.T * nh * hd, 1.0f), *want = malloc(sizeof(float) * t.T * nh * hd);
    memcpy(want, x, sizeof(float) * t.T * nh * hd);
    cs_rope_ref(want, t.T, nh, hd, t.pos, inv);
    backend_buf_t *bx = up(b, x, sizeof(float) * t.T * nh * hd);
    backend_rope(b, bx, nh, hd, bt, binv);
    float *got = down(b, bx, (size_t)t.T * nh * hd);
    close_to(got, want, (size_t)t.T * nh * hd, 1e-5, "rope", _i);
    free(got);
    /* embed of every dtype */
    static const cs_dtype dts[] = {CS_DTYPE_F32, CS_DTYPE_BF16, CS_DTYPE_F16};
    for (int di = 0; di < 3; di++) {
        hweight_t h = hweight_new(dts[di], vocab, H, 1.0f);
        backend_weight_t w = bweight(b, &h);
        backend_buf_t *by = backend_buf_alloc(b, sizeof(float) * t.T * H);
        backend_embed(b, by, &w, bt);
        got = down(b, by, (size_t)t.T * H);
        for (int r = 0; r < t.T; r++) close_to(got + (size_t)r * H, h.f32 + (size_t)t.ids[r] * H, (size_t)H, 0, "embed", _i);
        free(got);
        backend_buf_free(b, by);
        backend_buf_free(b, w.buf);
        hweight_free(&h);
    }
    /* kv_store scatters rows to the slots; get_out_rows gathers the output rows */
    const int row = 12, pool_rows = 16 * BS;
    float *pool0 = test_randv(&rng, (size_t)pool_rows * row, 1.0f), *src = test_randv(&rng, (size_t)t.T * row, 1.0f);
    backend_buf_t *pool = up(b, pool0, sizeof(float) * pool_rows * row), *bsrc = up(b, src, sizeof(float) * t.T * row);
    backend_kv_store(b, pool, CS_DTYPE_F32, bsrc, bt, row);
    ck_assert(backend_caps(b)->kv_dtypes >> CS_DTYPE_BF16 & 1u); /* every backend here reads BF16 pools */
    { /* a BF16 pool: each element rounded to nearest even */
        uint16_t *hb = malloc(sizeof(uint16_t) * pool_rows * row), *gb = malloc(sizeof(uint16_t) * pool_rows * row);
        for (int i = 0; i < pool_rows * row; i++) hb[i] = (uint16_t)(0x3f80 + i); /* what the store must keep */
        backend_buf_t *pb = up(b, hb, sizeof(uint16_t) * pool_rows * row);
        backend_kv_store(b, pb, CS_DTYPE_BF16, bsrc, bt, row);
        cs_kv_store_ref(hb, CS_DTYPE_BF16, src, t.slots, t.T, row);
        backend_buf_get(b, gb, pb, 0, sizeof(uint16_t) * pool_rows * row);
        for (int i = 0; i < pool_rows * row; i++)
            ck_assert_msg(gb[i] == hb[i], "kv_store BF16 [%d]: %#x, want %#x (backend %d)", i, gb[i], hb[i], _i);
        for (int r = 0; r < t.T; r++) /* and the reference is torch's rounding */
            for (int e = 0; e < row; e++)
                ck_assert_uint_eq(hb[(size_t)t.slots[r] * row + e], cs_f32_to_bf16(src[(size_t)r * row + e]));
        free(hb);
        free(gb);
        backend_buf_free(b, pb);
    }
    for (int r = 0; r < t.T; r++) memcpy(pool0 + (size_t)t.slots[r] * row, src + (size_t)r * row, sizeof(float) * row);
    got = down(b, pool, (size_t)pool_rows * row);
    close_to(got, pool0, (size_t)pool_rows * row, 0, "kv_store", _i);
    free(got);
    backend_buf_t *bo = backend_buf_alloc(b, sizeof(float) * t.n_out * row);
    backend_get_out_rows(b, bo, bsrc, bt, row);
    got = down(b, bo, (size_t)t.n_out * row);
    for (int i = 0; i < t.n_out; i++)
        close_to(got + (size_t)i * row, src + (size_t)t.out_rows[i] * row, (size_t)row, 0, "get_out_rows", _i);
    free(got);
    /* a second upload into the same batch replaces the first */
    int cached2[1] = {3}, n_new2[1] = {2};
    tbatch_t t2;
    tbatch_make(&t2, 1, cached2, n_new2, 16, vocab);
    ck_assert_ptr_eq(tbatch_upload(b, &t2, bt), bt);
    backend_get_out_rows(b, bo, bsrc, bt, row);
    got = down(b, bo, (size_t)row);
    close_to(got, src + (size_t)t2.out_rows[0] * row, (size_t)row, 0, "get_out_rows after a re-upload", _i);
    free(got);
    free(x);
    free(want);
    free(pool0);
    free(src);
    backend_buf_free(b, bx);
    backend_buf_free(b, binv);
    backend_buf_free(b, pool);
    backend_buf_free(b, bsrc);
    backend_buf_free(b, bo);
    backend_batch_free(b, bt);
}
END_TEST

/* ---- paged attention ---- */
/* attention on backend B (bes[be]'s kind); WHAT names the variant in messages */
static void check_attention(backend_t *b, int be, const char *what) {
    char m1[96], m2[96];
    snprintf(m1, sizeof m1, "attention%s", what);
    snprintf(m2, sizeof m2, "attention over BF16 pools%s", what);
    /* heads, kv heads, head_dim: up to 128 (the CUDA kernel's lanes hold 1, 2 or 4 of a head's
     * elements; the prompts span several of its 32-key tiles) */
    static const int cfgs[][3] = {{4, 4, 16}, {8, 2, 16}, {6, 1, 32}, {4, 2, 12}, {4, 2, 64}, {2, 1, 128}};
    for (size_t ci = 0; ci < sizeof cfgs / sizeof cfgs[0]; ci++)
        for (int window = 0; window <= 24; window += 24) {
            int nh = cfgs[ci][0], nkv = cfgs[ci][1], hd = cfgs[ci][2], kvd = nkv * hd;
            tbatch_t t;
            /* decode rows, a prefill chunk after a cached prefix, a fresh prompt, a block-edge */
            int cached[5] = {37, 0, 64, 5, 15}, n_new[5] = {1, 40, 23, 1, 1};
            tbatch_make(&t, 5, cached, n_new, 32, 10);
            backend_batch_t *bt = tbatch_upload(b, &t, NULL);
            size_t pool_n = (size_t)32 * BS * kvd;
            float *k = test_randv(&rng, pool_n, 1.0f), *v = test_randv(&rng, pool_n, 1.0f);
            float *q = test_randv(&rng, (size_t)t.T * nh * hd, 1.0f);
            float *want = malloc(sizeof(float) * t.T * nh * hd);
            cs_attention_paged_ref(want, q, k, v, t.hseqs, t.n_seqs, BS, nh, nkv, hd, window);
            backend_buf_t *bk = up(b, k, sizeof(float) * pool_n), *bv = up(b, v, sizeof(float) * pool_n);
            backend_buf_t *bq = up(b, q, sizeof(float) * t.T * nh * hd), *bo = backend_buf_alloc(b, sizeof(float) * t.T * nh * hd);
            ck_assert(backend_caps(b)->kv_dtypes >> CS_DTYPE_F32 & 1u);
            backend_attention(b, bo, bq, bk, bv, CS_DTYPE_F32, bt, BS, nh, nkv, hd, window);
            float *got = down(b, bo, (size_t)t.T * nh * hd);
            close_to(got, want, (size_t)t.T * nh * hd, 1e-5, m1, be);
            free(got);
            { /* the same over BF16 pools */
                uint16_t *kb = malloc(sizeof(uint16_t) * pool_n), *vb = malloc(sizeof(uint16_t) * pool_n);
                for (size_t i = 0; i < pool_n; i++) kb[i] = cs_f32_to_bf16(k[i]), vb[i] = cs_f32_to_bf16(v[i]);
                cs_attention_paged_kv_ref(want, q, kb, vb, CS_DTYPE_BF16, t.hseqs, t.n_seqs, BS, nh, nkv, hd, window);
                backend_buf_t *bkb = up(b, kb, sizeof(uint16_t) * pool_n), *bvb = up(b, vb, sizeof(uint16_t) * pool_n);
                backend_attention(b, bo, bq, bkb, bvb, CS_DTYPE_BF16, bt, BS, nh, nkv, hd, window);
                got = down(b, bo, (size_t)t.T * nh * hd);
                close_to(got, want, (size_t)t.T * nh * hd, 1e-5, m2, be);
                free(got);
                free(kb);
                free(vb);
                backend_buf_free(b, bkb);
                backend_buf_free(b, bvb);
            }
            free(k);
            free(v);
            free(q);
            free(want);
            backend_buf_free(b, bk);
            backend_buf_free(b, bv);
            backend_buf_free(b, bq);
            backend_buf_free(b, bo);
            backend_batch_free(b, bt);
        }
}

/* the CUDA backends' kernels every way: a warp per (row, head) over all its keys, the keys
 * split into ranges that are then combined (flash-decoding: 3 ranges, and 32, more than most of
 * these rows have keys, so many ranges are empty), and tiles of 16 rows sharing each tile of
 * keys (prefill's; here the tiles straddle sequences) */
START_TEST(test_attention) {
    check_attention(bes[_i], _i, "");
    if (_i != CUDA_EMU && _i != CUDA_GPU) return;
    static const int forced[4] = {-1, 3, 32, 0};
    for (int f = 0; f < 4; f++) { /* the last: query tiles (prefill's kernel) for every batch */
        cuda_backend_params_t p = {.attn_splits = f == 3 ? -1 : forced[f], .attn_tiled = f == 3 ? 1 : -1};
        backend_t *b = cuda_with(_i != CUDA_EMU, &p);
        ck_assert_msg(b != NULL, "%s", cs_error_last());
        char what[32];
        if (f == 3) snprintf(what, sizeof what, " (query tiles)");
        else snprintf(what, sizeof what, " (key ranges: %d)", forced[f]);
        check_attention(b, _i, what);
        backend_free(b);
    }
}

END_TEST

/* Long contexts on the CUDA backends: decode rows over 4096 and 32768 keys, a 3-row prefill
 * at 4k and a 20-row one at 1k, odd head counts (7 heads on 1 KV head; 6 on 3 of 80 elements;
 * 5 of 40), with and without a 1000-key window, in F32 and BF16 pools: the keys split into
 * ranges (the GPU's own choice; 16 on the emulator, which has one SM) and the query tiles
 * (which straddle the sequences here; on the first shape in F32 pools: on the emulator a
 * tile's four warps walk the 32k keys for one row) against the warp-per-row kernel and against
 * the CPU reference. F32 sums over 32768 keys in other orders: tolerance 2e-5 x (1 + |ref|). */
START_TEST(test_attention_long) {
    enum { NSEQ = 4, LBS = 16 };
    static const int cfgs[][3] = {{7, 1, 64}, {6, 3, 80}, {5, 5, 40}};
    const int cached[NSEQ] = {4095, 32767, 4090, 1000}, n_new[NSEQ] = {1, 1, 3, 20};
    cuda_backend_params_t pr = {.attn_splits = -1, .attn_tiled = -1}, ps = {.attn_splits = _i == 0 ? 16 : 0, .attn_tiled = -1};
    cuda_backend_params_t pt = {.attn_splits = -1, .attn_tiled = 1};
    backend_t *bq = cuda_with(_i != 0, &pt);
    backend_t *br = cuda_with(_i != 0, &pr);
    backend_t *bs = cuda_with(_i != 0, &ps);
    ck_assert_msg(br && bs && bq, "%s", cs_error_last());
    int nb = 0, T = 0;
    for (int s = 0; s < NSEQ; s++) nb += (cached[s] + n_new[s] + LBS - 1) / LBS, T += n_new[s];
    int32_t *table = malloc(sizeof(int32_t) * nb), *ids = calloc((size_t)T, sizeof(int32_t));
    int32_t *pos = malloc(sizeof(int32_t) * T), *slots = malloc(sizeof(int32_t) * T), out_rows[NSEQ];
    for (int i = 0; i < nb; i++) table[i] = i;
    for (int i = nb - 1; i > 0; i--) { /* the blocks shuffled through the pool */
        int j = (int)(cs_rng_next(&rng) % (uint64_t)(i + 1)), x = table[i];
        table[i] = table[j];
        table[j] = x;
    }
    backend_seq_desc_t seqs[NSEQ];
    cpu_attn_seq_t hseqs[NSEQ];
    for (int s = 0, row = 0, blk = 0; s < NSEQ; s++) {
        seqs[s] = (backend_seq_desc_t){row, n_new[s], cached[s], blk};
        hseqs[s] = (cpu_attn_seq_t){row, n_new[s], cached[s], table + blk};
        for (int i = 0; i < n_new[s]; i++, row++) {
            int p = cached[s] + i;
            pos[row] = p;
            slots[row] = table[blk + p / LBS] * LBS + p % LBS;
        }
        out_rows[s] = row - 1;
        blk += (cached[s] + n_new[s] + LBS - 1) / LBS;
    }
    backend_batch_desc_t d = {T, ids, pos, slots, NSEQ, seqs, nb, table, NSEQ, out_rows, 0, NULL};
    backend_batch_t *btr = NULL, *bts = NULL, *btq = NULL;
    ck_assert_int_eq(backend_batch_upload(br, &btr, &d), CS_OK);
    ck_assert_int_eq(backend_batch_upload(bs, &bts, &d), CS_OK);
    ck_assert_int_eq(backend_batch_upload(bq, &btq, &d), CS_OK);
    for (size_t ci = 0; ci < CS_ARRAY_LEN(cfgs); ci++)
        for (int window = 0; window <= 1000; window += 1000) {
            if (window && ci) continue; /* the window on the first shape */
            int nh = cfgs[ci][0], nkv = cfgs[ci][1], hd = cfgs[ci][2];
            size_t pool_n = (size_t)nb * LBS * nkv * hd, qn = (size_t)T * nh * hd;
            float *k = test_randv(&rng, pool_n, 1.0f), *v = test_randv(&rng, pool_n, 1.0f);
            float *q = test_randv(&rng, qn, 0.5f), *want = malloc(sizeof(float) * qn);
            uint16_t *kb = malloc(sizeof(uint16_t) * pool_n), *vb = malloc(sizeof(uint16_t) * pool_n);
            for (size_t i = 0; i < pool_n; i++) kb[i] = cs_f32_to_bf16(k[i]), vb[i] = cs_f32_to_bf16(v[i]);
            for (int bf = 0; bf < 2; bf++) {
                cs_dtype dt = bf ? CS_DTYPE_BF16 : CS_DTYPE_F32;
                const void *hk = bf ? (const void *)kb : k, *hv = bf ? (const void *)vb : v;
                size_t bytes = cs_dtype_size(dt) * pool_n;
                cs_attention_paged_kv_ref(want, q, hk, hv, dt, hseqs, NSEQ, LBS, nh, nkv, hd, window);
                float *got[3] = {NULL, NULL, NULL};
                int nw = ci == 0 && window == 0 && !bf ? 3 : 2;
                for (int w = 0; w < nw; w++) {
                    backend_t *b = w == 2 ? bq : w ? bs : br;
                    backend_buf_t *bk = up(b, hk, bytes), *bv = up(b, hv, bytes), *bqq = up(b, q, sizeof(float) * qn);
                    backend_buf_t *bo = backend_buf_alloc(b, sizeof(float) * qn);
                    backend_attention(b, bo, bqq, bk, bv, dt, w == 2 ? btq : w ? bts : btr, LBS, nh, nkv, hd, window);
                    got[w] = down(b, bo, qn);
                    backend_buf_free(b, bk), backend_buf_free(b, bv), backend_buf_free(b, bqq), backend_buf_free(b, bo);
                }
                char what[128];
                snprintf(what, sizeof what, "long attention, %d heads on %d of %d, window %d, %s, key ranges", nh, nkv,
                         hd, window, bf ? "BF16" : "F32");
                close_to(got[1], got[0], qn, 2e-5, what, _i ? CUDA_GPU : CUDA_EMU);
                close_to(got[1], want, qn, 2e-5, what, _i ? CUDA_GPU : CUDA_EMU);
                snprintf(what, sizeof what, "long attention, %d heads on %d of %d, window %d, %s, warp per row", nh, nkv,
                         hd, window, bf ? "BF16" : "F32");
                close_to(got[0], want, qn, 2e-5, what, _i ? CUDA_GPU : CUDA_EMU);
                if (got[2]) {
                    snprintf(what, sizeof what, "long attention, %d heads on %d of %d, window %d, %s, query tiles", nh,
                             nkv, hd, window, bf ? "BF16" : "F32");
                    close_to(got[2], got[0], qn, 2e-5, what, _i ? CUDA_GPU : CUDA_EMU);
                    close_to(got[2], want, qn, 2e-5, what, _i ? CUDA_GPU : CUDA_EMU);
                }
                free(got[0]);
                free(got[1]);
                free(got[2]);
            }
            free(k), free(v), free(q), free(want), free(kb), free(vb);
        }
    backend_batch_free(br, btr);
    backend_batch_free(bs, bts);
    backend_batch_free(bq, btq);
    backend_free(br);
    backend_free(bs);
    backend_free(bq);
    free(table), free(ids), free(pos), free(slots);
}
END_TEST

/* ---- grouped LoRA over adapter slots ---- */
/* a lora op's operands over batch t: x[T, d_in] and y0[T, d_out] random, on the device too */
typedef struct lora_io {
    int T, d_in, d_out;
    backend_batch_t *bt;
    float *x, *y0;
    backend_buf_t *bx, *by;
} lora_io_t;

static lora_io_t lora_io_new(backend_t *b, const tbatch_t *t, int d_in, int d_out) {
    lora_io_t io = {t->T, d_in, d_out, tbatch_upload(b, t, NULL), NULL, NULL, NULL, NULL};
    io.x = test_randv(&rng, (size_t)t->T * d_in, 1.0f);
    io.y0 = test_randv(&rng, (size_t)t->T * d_out, 1.0f);
    io.bx = up(b, io.x, sizeof(float) * t->T * d_in);
    io.by = backend_buf_alloc(b, sizeof(float) * t->T * d_out);
    return io;
}

/* a copy of y0, for the reference to add to */
static float *lora_io_y0(const lora_io_t *io) {
    float *y = malloc(sizeof(float) * io->T * io->d_out);
    memcpy(y, io->y0, sizeof(float) * io->T * io->d_out);
    return y;
}

/* y = y0, the lora op of (layer, target), y back on the host */
static float *lora_io_run(backend_t *b, lora_io_t *io, int layer, int target) {
    backend_buf_set(b, io->by, 0, io->y0, sizeof(float) * io->T * io->d_out);
    backend_lora(b, io->by, io->bx, io->bt, layer, target, io->d_in, io->d_out);
    return down(b, io->by, (size_t)io->T * io->d_out);
}

static void lora_io_free(backend_t *b, lora_io_t *io) {
    free(io->x);
    free(io->y0);
    backend_buf_free(b, io->bx);
    backend_buf_free(b, io->by);
    backend_batch_free(b, io->bt);
}

/* grouped LoRA on backend B (bes[be]'s kind) with inputs D_IN wide; WHAT names the variant */
static void check_lora(backend_t *b, int be, int d_in, const char *what) {
    enum { NL = 2, NA = 3 };
    const int d_out = 40;
    char m32[96], m16[96];
    snprintf(m32, sizeof m32, "lora f32%s", what);
    snprintf(m16, sizeof m16, "lora bf16%s", what);
    static const int ranks[NA] = {8, 1, 16};
    for (int bf16 = 0; bf16 < 2; bf16++) { /* adapter slots hold F32 and BF16 weights */
    cs_dtype dt = bf16 ? CS_DTYPE_BF16 : CS_DTYPE_F32;
    backend_lora_module_desc_t md[NA][NL * BACKEND_LORA_TARGETS];
    float *mem[NA][NL * BACKEND_LORA_TARGETS][3];
    uint16_t *mem16[NA][NL * BACKEND_LORA_TARGETS][3];
    backend_adapter_t *slot[NA];
    for (int a = 0; a < NA; a++) {
        for (int m = 0; m < NL * BACKEND_LORA_TARGETS; m++) {
            int t = m % BACKEND_LORA_TARGETS, r = (t == 2 && a == 1) ? 0 : ranks[a]; /* adapter 1 skips target 2 */
            size_t na = (size_t)r * d_in, nb = (size_t)d_out * r;
            float *A = test_randv(&rng, na, 0.3f), *B = test_randv(&rng, nb, 0.3f);
            float *Bt = malloc(sizeof(float) * (r ? r : 1) * d_out);
            uint16_t *A16 = malloc(2 * (na + 1)), *B16 = malloc(2 * (nb + 1)), *Bt16 = malloc(2 * (nb + 1));
            /* values BF16 holds exactly: one reference for both dtypes */
            for (size_t k = 0; k < na; k++) A[k] = cs_bf16_to_f32(A16[k] = cs_f32_to_bf16(A[k]));
            for (size_t k = 0; k < nb; k++) B[k] = cs_bf16_to_f32(B16[k] = cs_f32_to_bf16(B[k]));
            for (int i = 0; i < d_out; i++)
                for (int j = 0; j < r; j++) {
                    Bt[(size_t)j * d_out + i] = B[(size_t)i * r + j];
                    Bt16[(size_t)j * d_out + i] = B16[(size_t)i * r + j];
                }
            mem[a][m][0] = A;
            mem[a][m][1] = B;
            mem[a][m][2] = Bt;
            mem16[a][m][0] = A16;
            mem16[a][m][1] = B16;
            mem16[a][m][2] = Bt16;
            md[a][m] = bf16 ? (backend_lora_module_desc_t){r, d_in, d_out, 0.5f + a, dt, A16, B16, a == 2 ? NULL : Bt16}
                            : (backend_lora_module_desc_t){r, d_in, d_out, 0.5f + a, dt, A, B, a == 2 ? NULL : Bt};
        }
        backend_adapter_desc_t d = {.n_layers = NL, .mods = md[a], .host_stays = true};
        ck_assert_int_eq(backend_adapter_upload(b, &d, &slot[a]), CS_OK);
    }
    if (backend_is_strict_device(b)) { /* a BF16 slot holds half the bytes */
        size_t want = 0;
        for (int m = 0; m < NL * BACKEND_LORA_TARGETS; m++)
            want += (size_t)md[0][m].rank * (d_in + 2 * d_out) * cs_dtype_size(dt);
        ck_assert_uint_eq(backend_adapter_bytes(b, slot[0]), want);
    }
    /* rows: [0,5) adapter 0, [5,6) none, [6,9) adapter 1, [9,30) adapter 2, [30,31) adapter 0 again */
    tbatch_t t;
    int cached[5] = {0, 3, 0, 10, 2}, n_new[5] = {5, 1, 3, 21, 1};
    tbatch_make(&t, 5, cached, n_new, 16, 10);
    t.lora[0] = (backend_lora_seg_desc_t){0, 5, slot[0], INT_MAX};
    t.lora[1] = (backend_lora_seg_desc_t){6, 3, slot[1], INT_MAX};
    t.lora[2] = (backend_lora_seg_desc_t){9, 21, slot[2], INT_MAX};
    t.lora[3] = (backend_lora_seg_desc_t){30, 1, slot[0], INT_MAX};
    t.n_lora = 4;
    lora_io_t io = lora_io_new(b, &t, d_in, d_out);
    for (int layer = 0; layer < NL; layer++)
        for (int tg = 0; tg < BACKEND_LORA_TARGETS; tg++) {
            float *want = lora_io_y0(&io);
            for (int s = 0; s < t.n_lora; s++) {
                int a = s == 3 ? 0 : s, m = layer * BACKEND_LORA_TARGETS + tg;
                if (md[a][m].rank)
                    cs_lora_ref(want + (size_t)t.lora[s].row0 * d_out, io.x + (size_t)t.lora[s].row0 * d_in,
                                t.lora[s].n, mem[a][m][0], mem[a][m][1], md[a][m].rank, d_in, d_out, md[a][m].scale);
            }
            float *got = lora_io_run(b, &io, layer, tg);
            close_to(got, want, (size_t)t.T * d_out, 5e-5, bf16 ? m16 : m32, be);
            free(got);
            free(want);
        }
    lora_io_free(b, &io);
    for (int a = 0; a < NA; a++) {
        backend_adapter_free(b, slot[a]);
        for (int m = 0; m < NL * BACKEND_LORA_TARGETS; m++)
            for (int k = 0; k < 3; k++) {
                free(mem[a][m][k]);
                free(mem16[a][m][k]);
            }
    }
    }
}

/* the CUDA backends' shrink both ways: a warp per (row, rank) (the reference) and the row
 * tiles that read A once per tile (the 21-row segment spans tiles; others share a tile), with
 * inputs of 48 (part of one TILE_K chunk) and 300 columns (two whole chunks and a part) */
START_TEST(test_lora) {
    check_lora(bes[_i], _i, 48, "");
    if (_i != CUDA_EMU && _i != CUDA_GPU) return;
    for (int f = -1; f <= 1; f += 2)
        for (int d_in = 48; d_in <= 300; d_in += 252) {
            cuda_backend_params_t p = {.lora_tiled = f};
            backend_t *b = cuda_with(_i != CUDA_EMU, &p);
            ck_assert_msg(b != NULL, "%s", cs_error_last());
            char what[48];
            snprintf(what, sizeof what, " (%s shrink, d_in %d)", f > 0 ? "tiled" : "warp-per-row", d_in);
            check_lora(b, _i, d_in, what);
            backend_free(b);
        }
}
END_TEST

/* ---- copies, events, stats ---- */
START_TEST(test_copies) {
    backend_t *b = bes[_i];
    const size_t n = 100000;
    unsigned char *h = malloc(n), *back = malloc(n);
    for (size_t i = 0; i < n; i++) h[i] = (unsigned char)(i * 7 + 3);
    backend_stats_t s0, s1;
    backend_get_stats(b, &s0);
    backend_buf_t *x = backend_buf_alloc(b, n), *y = backend_buf_alloc(b, n);
    ck_assert_uint_eq(backend_buf_size(b, x), n);
    backend_buf_set(b, x, 0, h, n);
    backend_buf_copy(b, y, 100, x, 50, 1000);          /* device to device, offsets */
    backend_buf_get(b, back, y, 100, 1000);
    ck_assert_int_eq(memcmp(back, h + 50, 1000), 0);
    backend_buf_set(b, x, 17, h + 1000, 333);            /* partial set at an offset */
    backend_buf_get(b, back, x, 0, n);
    ck_assert_int_eq(memcmp(back, h, 17), 0);
    ck_assert_int_eq(memcmp(back + 17, h + 1000, 333), 0);
    ck_assert_int_eq(memcmp(back + 350, h + 350, n - 350), 0);
    /* asynchronous copies on the copy queue, in order, done when the event is */
    unsigned char *pinned = backend_host_alloc(b, n), *pinned2 = backend_host_alloc(b, n);
    for (size_t i = 0; i < n; i++) pinned[i] = (unsigned char)(i * 13 + 1);
    backend_event_t *ev = backend_event_new(b);
    ck_assert_ptr_nonnull(ev);
    backend_buf_set_async(b, y, 0, pinned, n);
    backend_buf_get_async(b, pinned2, y, 0, n);
    backend_event_record(b, ev);
    backend_event_synchronize(b, ev);
    ck_assert(backend_event_query(b, ev));
    ck_assert_int_eq(memcmp(pinned, pinned2, n), 0);
    backend_event_wait(b, ev);                          /* completed: returns */
    backend_event_free(b, ev);
    backend_get_stats(b, &s1);
    /* every backend here counts its copies */
    ck_assert_uint_eq(s1.h2d_bytes - s0.h2d_bytes, n + 333 + n);
    ck_assert_uint_eq(s1.h2d_copies - s0.h2d_copies, 3);
    ck_assert_uint_eq(s1.d2h_bytes - s0.d2h_bytes, 1000 + n + n);
    ck_assert_uint_eq(s1.d2d_bytes - s0.d2d_bytes, 1000);
    ck_assert_uint_eq(s1.allocated - s0.allocated, 2 * n);
    backend_host_free(b, pinned);
    backend_host_free(b, pinned2);
    backend_buf_free(b, x);
    backend_buf_free(b, y);
    free(h);
    free(back);
}
END_TEST

/* ---- the cold start: slots streaming in, segments with device_layers, host-assisted ops ----
 * A 3-layer adapter streamed one layer a group (on_group raises a flag the test waits on)
 * gives the lora op what the same adapter uploaded whole gives; a segment with
 * device_layers = 1 gets layer 0's term and none of the later layers'; slots freed while
 * they stream (queued or copying) go cleanly. get_signal / wait_add: a helper thread waits
 * for the rows get_signal sends (after the ops before it), computes from them, and raises
 * the flag wait_add waits on (the device waits meanwhile); the op after wait_add sees the
 * sum. Backends without the methods (the CPU backend) run the device_layers part. */
static void count_group(void *user) { cs_flag_add((uint32_t *)user, 1); }

typedef struct assist_helper {
    const float *hx;
    float *hy;
    size_t n;
    uint32_t *xflag, *done;
    int rounds;
} assist_helper_t;

static void *assist_helper_main(void *p) {
    assist_helper_t *h = p;
    for (int r = 1; r <= h->rounds; r++) {
        cs_flag_wait_geq(h->xflag, (uint32_t)r);
        struct timespec ts = {0, 2000000}; /* the device waits meanwhile */
        nanosleep(&ts, NULL);
        for (size_t i = 0; i < h->n; i++) h->hy[i] = 2 * h->hx[i] + (float)r;
        cs_flag_add(h->done, 1);
    }
    return NULL;
}

/* one cold-start adapter: NL layers of rank-RANK modules (target 2 not adapted) in dtype dt,
 * with values BF16 holds exactly so that one F32 reference (a, b) serves both dtypes */
enum { COLD_NL = 3, COLD_NM = COLD_NL * BACKEND_LORA_TARGETS, COLD_D_IN = 40, COLD_D_OUT = 24, COLD_RANK = 4 };
typedef struct cold_adapter {
    backend_lora_module_desc_t md[COLD_NM];
    float *a[COLD_NM], *b[COLD_NM]; /* the reference's F32 values */
    void *mem[COLD_NM][3];          /* the host bytes of a, b and b transposed in dt */
} cold_adapter_t;

/* N values as F32 (rounded to BF16 in place) into DST, in dt */
static void cold_store(void *dst, float *f, size_t n, cs_dtype dt) {
    for (size_t k = 0; k < n; k++) {
        uint16_t v = cs_f32_to_bf16(f[k]);
        f[k] = cs_bf16_to_f32(v);
        if (dt == CS_DTYPE_BF16) ((uint16_t *)dst)[k] = v;
        else ((float *)dst)[k] = f[k];
    }
}

static void cold_adapter_make(cold_adapter_t *c, cs_dtype dt) {
    const int d_in = COLD_D_IN, d_out = COLD_D_OUT;
    for (int m = 0; m < COLD_NM; m++) {
        int t = m % BACKEND_LORA_TARGETS, r = t == 2 ? 0 : COLD_RANK;
        size_t na = (size_t)r * d_in, nb = (size_t)d_out * r, es = cs_dtype_size(dt);
        c->a[m] = test_randv(&rng, na, 0.3f);
        c->b[m] = test_randv(&rng, nb, 0.3f);
        void *a = malloc(es * (na + 1)), *bb = malloc(es * (nb + 1)), *bt = malloc(es * (nb + 1));
        cold_store(a, c->a[m], na, dt);
        cold_store(bb, c->b[m], nb, dt);
        for (int o = 0; o < d_out; o++)
            for (int j = 0; j < r; j++)
                memcpy((char *)bt + ((size_t)j * d_out + o) * es, (char *)bb + ((size_t)o * r + j) * es, es);
        c->mem[m][0] = a;
        c->mem[m][1] = bb;
        c->mem[m][2] = bt;
        /* odd targets leave B transposed to the backend */
        c->md[m] = (backend_lora_module_desc_t){r, d_in, d_out, 0.75f, dt, a, bb, t % 2 ? NULL : bt};
    }
}

static void cold_adapter_free(cold_adapter_t *c) {
    for (int m = 0; m < COLD_NM; m++) {
        free(c->a[m]);
        free(c->b[m]);
        for (int k = 0; k < 3; k++) free(c->mem[m][k]);
    }
}

/* the slot SU uploaded whole has every layer; D streamed one layer a group (into *SS) and two
 * a group arrives whole, reporting each group; slots freed while streaming go cleanly */
static void cold_check_stream(backend_t *b, const backend_adapter_desc_t *d, backend_adapter_t *su,
                              backend_adapter_t **ss) {
    ck_assert_int_eq(backend_adapter_arrived(b, su), COLD_NL); /* uploaded: every layer */
    uint32_t groups = 0;
    ck_assert_int_eq(backend_adapter_stream(b, d, 1, count_group, &groups, ss), CS_OK);
    int a0 = backend_adapter_arrived(b, *ss);
    ck_assert_int_ge(a0, 0);
    ck_assert_int_le(a0, COLD_NL);
    cs_flag_wait_geq(&groups, COLD_NL); /* on_group runs after arrived is raised */
    ck_assert_int_eq(backend_adapter_arrived(b, *ss), COLD_NL);
    ck_assert_uint_eq(backend_adapter_bytes(b, *ss), backend_adapter_bytes(b, su));
    /* groups of 2: two reports, the last group short */
    uint32_t g2 = 0;
    backend_adapter_t *s2 = NULL;
    ck_assert_int_eq(backend_adapter_stream(b, d, 2, count_group, &g2, &s2), CS_OK);
    cs_flag_wait_geq(&g2, 2);
    ck_assert_int_eq(backend_adapter_arrived(b, s2), COLD_NL);
    backend_adapter_free(b, s2);
    ck_assert_uint_eq(__atomic_load_n(&g2, __ATOMIC_ACQUIRE), 2);
    /* freed while streaming in: the backend waits for (or drops) the copies */
    backend_adapter_t *s3 = NULL, *s4 = NULL;
    ck_assert_int_eq(backend_adapter_stream(b, d, 1, NULL, NULL, &s3), CS_OK);
    ck_assert_int_eq(backend_adapter_stream(b, d, 1, NULL, NULL, &s4), CS_OK);
    backend_adapter_free(b, s4);
    backend_adapter_free(b, s3);
}

/* rows [0,3): slot SD (streamed, or the uploaded one); [3,6): the uploaded slot SU; [6,9): SD
 * with layer 0 only on the device. Every layer's and target's lora op against the reference. */
static void cold_check_lora(backend_t *b, const cold_adapter_t *c, backend_adapter_t *sd, backend_adapter_t *su,
                            const char *what, int be) {
    const int d_in = COLD_D_IN, d_out = COLD_D_OUT;
    tbatch_t t;
    int cached[3] = {0, 4, 1}, n_new[3] = {3, 3, 3};
    tbatch_make(&t, 3, cached, n_new, 8, 10);
    t.lora[0] = (backend_lora_seg_desc_t){0, 3, sd, INT_MAX};
    t.lora[1] = (backend_lora_seg_desc_t){3, 3, su, INT_MAX};
    t.lora[2] = (backend_lora_seg_desc_t){6, 3, sd, 1};
    t.n_lora = 3;
    lora_io_t io = lora_io_new(b, &t, d_in, d_out);
    for (int layer = 0; layer < COLD_NL; layer++)
        for (int tg = 0; tg < BACKEND_LORA_TARGETS; tg++) {
            int m = layer * BACKEND_LORA_TARGETS + tg;
            const backend_lora_module_desc_t *md = &c->md[m];
            float *want = lora_io_y0(&io);
            for (int s = 0; s < t.n_lora; s++)
                if (md->rank && layer < t.lora[s].device_layers)
                    cs_lora_ref(want + (size_t)t.lora[s].row0 * d_out, io.x + (size_t)t.lora[s].row0 * d_in,
                                t.lora[s].n, c->a[m], c->b[m], md->rank, d_in, d_out, md->scale);
            float *got = lora_io_run(b, &io, layer, tg);
            close_to(got, want, (size_t)t.T * d_out, 5e-5, what, be);
            if (layer >= 1) /* the device_layers = 1 rows: untouched */
                ck_assert_int_eq(memcmp(got + 6 * d_out, io.y0 + 6 * d_out, sizeof(float) * 3 * d_out), 0);
            free(got);
            free(want);
        }
    lora_io_free(b, &io);
}

/* wait_add of BF16 terms (half the bytes over the link): each widened exactly and added in
 * F32, at an offset; the flag is up before */
static void cold_check_bf16_terms(backend_t *b, int be) {
    const size_t NY = 3000, YO = 37, N = 2500;
    float *y0 = test_randv(&rng, NY, 1.0f), *t = test_randv(&rng, N, 3.0f), *want = malloc(sizeof(float) * NY);
    backend_buf_t *by = up(b, y0, sizeof(float) * NY);
    uint16_t *h = backend_host_alloc(b, sizeof(uint16_t) * N);
    uint32_t *flag = backend_host_alloc(b, sizeof(uint32_t));
    ck_assert(h && flag);
    memcpy(want, y0, sizeof(float) * NY);
    for (size_t i = 0; i < N; i++) {
        h[i] = cs_f32_to_bf16(t[i]);
        want[YO + i] += cs_bf16_to_f32(h[i]);
    }
    cs_flag_store(flag, 5);
    backend_wait_add(b, by, sizeof(float) * YO, h, CS_DTYPE_BF16, N, flag, 5, NULL, 0);
    float *got = down(b, by, NY);
    close_to(got, want, NY, 0, "wait_add of BF16 terms", be);
    free(got);
    free(want);
    free(y0);
    free(t);
    backend_buf_free(b, by);
    backend_host_free(b, h);
    backend_host_free(b, flag);
}

/* get_signal / wait_add, two rounds: x += z; rows of x out; y += 2x + round from the host */
static void cold_check_host_assist(backend_t *b, int be) {
    const size_t NX = 25000, NY = 26000, XO = 100, YO = 700, N = 20000, ROUNDS = 2;
    float *x = test_randv(&rng, NX, 1.0f), *z = test_randv(&rng, NX, 1.0f), *y0 = test_randv(&rng, NY, 1.0f);
    backend_buf_t *bx = up(b, x, sizeof(float) * NX), *bz = up(b, z, sizeof(float) * NX), *by = up(b, y0, sizeof(float) * NY);
    backend_buf_t *by2 = backend_buf_alloc(b, sizeof(float) * NY);
    float *hx = backend_host_alloc(b, sizeof(float) * N), *hy = backend_host_alloc(b, sizeof(float) * N);
    uint32_t *flags = backend_host_alloc(b, 2 * sizeof(uint32_t));
    ck_assert(hx && hy && flags);
    flags[0] = flags[1] = 0;
    assist_helper_t h = {hx, hy, N, &flags[0], &flags[1], (int)ROUNDS};
    pthread_t th;
    ck_assert_int_eq(pthread_create(&th, NULL, assist_helper_main, &h), 0);
    float *want = malloc(sizeof(float) * NY), *xr = malloc(sizeof(float) * NX);
    memcpy(want, y0, sizeof(float) * NY);
    memcpy(xr, x, sizeof(float) * NX);
    for (uint32_t r = 1; r <= ROUNDS; r++) {
        backend_add(b, bx, bz, NX); /* before get_signal: it sends the sum */
        backend_get_signal(b, hx, bx, sizeof(float) * XO, sizeof(float) * N, &flags[0], r);
        backend_wait_add(b, by, sizeof(float) * YO, hy, CS_DTYPE_F32, N, &flags[1], r, NULL, r);
        backend_buf_copy(b, by2, 0, by, 0, sizeof(float) * NY); /* after wait_add: sees its sum */
        for (size_t i = 0; i < NX; i++) xr[i] += z[i];
        for (size_t i = 0; i < N; i++) want[YO + i] += 2 * xr[XO + i] + (float)r;
        if (r == 1) { /* the copy taken after round 1 */
            float *got = down(b, by2, NY);
            close_to(got, want, NY, 1e-6, "wait_add (round 1)", be);
            free(got);
        }
    }
    backend_synchronize(b);
    pthread_join(th, NULL);
    ck_assert_uint_eq(cs_flag_load(&flags[0]), ROUNDS);
    ck_assert_uint_eq(cs_flag_load(&flags[1]), ROUNDS);
    float *got = down(b, by2, NY);
    close_to(got, want, NY, 1e-6, "wait_add", be);
    free(got);
    got = down(b, bx, NX);
    close_to(got, xr, NX, 0, "x after the rounds", be);
    free(got);
    free(want);
    free(xr);
    free(x);
    free(z);
    free(y0);
    backend_host_free(b, hx);
    backend_host_free(b, hy);
    backend_host_free(b, flags);
    backend_buf_free(b, bx);
    backend_buf_free(b, bz);
    backend_buf_free(b, by);
    backend_buf_free(b, by2);
}

START_TEST(test_cold_start) {
    backend_t *b = bes[_i];
    for (int bf16 = 0; bf16 < 2; bf16++) {
        cold_adapter_t c;
        cold_adapter_make(&c, bf16 ? CS_DTYPE_BF16 : CS_DTYPE_F32);
        backend_adapter_desc_t d = {.n_layers = COLD_NL, .mods = c.md, .host_stays = true};
        backend_adapter_t *su = NULL, *ss = NULL;
        ck_assert_int_eq(backend_adapter_upload(b, &d, &su), CS_OK);
        if (backend_caps(b)->adapter_stream) cold_check_stream(b, &d, su, &ss);
        else ck_assert_int_eq(backend_adapter_arrived(b, su), INT_MAX);
        cold_check_lora(b, &c, ss ? ss : su, su, bf16 ? "cold lora bf16" : "cold lora f32", _i);
        backend_adapter_free(b, ss);
        backend_adapter_free(b, su);
        cold_adapter_free(&c);
    }
    if (backend_caps(b)->host_assist) {
        cold_check_host_assist(b, _i);
        cold_check_bf16_terms(b, _i);
    }
}
END_TEST

#ifndef TEST_BACKEND_GPU /* the CPU backend's and strict device's own tests */
/* ---- the strict device refuses what is not its own ---- */
START_TEST(test_strict_rejects_host_pointer) {
    backend_t *b = bes[2];
    float host[64] = {0};
    backend_buf_t *y = backend_buf_alloc(b, sizeof host);
    backend_add(b, y, (const backend_buf_t *)host, 64); /* a host pointer where a handle goes */
}
END_TEST

START_TEST(test_strict_rejects_freed_handle) {
    backend_t *b = bes[2];
    backend_buf_t *x = backend_buf_alloc(b, 256), *y = backend_buf_alloc(b, 256);
    backend_buf_free(b, x);
    backend_add(b, y, x, 64);
}
END_TEST

START_TEST(test_strict_rejects_foreign_handle) {
    backend_buf_t *x = backend_buf_alloc(bes[0], 256), *y = backend_buf_alloc(bes[2], 256); /* a CPU buffer */
    backend_add(bes[2], y, x, 64);
}
END_TEST

START_TEST(test_strict_rejects_out_of_range) {
    backend_t *b = bes[2];
    backend_buf_t *x = backend_buf_alloc(b, 256), *y = backend_buf_alloc(b, 256);
    backend_add(b, y, x, 65); /* 260 bytes of 256 */
}
END_TEST

START_TEST(test_strict_fresh_memory_is_nan) {
    backend_t *b = bes[2];
    backend_buf_t *x = backend_buf_alloc(b, 64 * sizeof(float));
    float *got = down(b, x, 64);
    for (int i = 0; i < 64; i++) ck_assert(isnan(got[i]));
    free(got);
    backend_buf_free(b, x);
}
END_TEST
#endif

/* ---- the spin deadline (the CUDA backends) ----
 * First a wait the host keeps alive under a 2 s deadline (a heartbeat every 20 ms for 2.5 s,
 * then the flag: a worker waiting for a slow disk): it ends normally, unless the beating
 * thread is held off the CPU for the whole 2 s. Then, under a 0.2 s deadline, a wait_add whose flag
 * never comes up (a host worker that died): the kernel gives up at the backend's deadline and
 * the process stops with a message naming the layer, where it would hang the device and the
 * engine. Run in a child: it must die of SIGABRT, saying both. */
struct beat {
    uint32_t *alive, *flag;
};

static void *beat_main(void *p) {
    struct beat *b = p;
    for (int i = 0; i < 125; i++) {
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
        cs_flag_add(b->alive, 1);
    }
    cs_flag_store(b->flag, 1);
    return NULL;
}

START_TEST(test_spin_deadline) {
    int fds[2];
    ck_assert_int_eq(pipe(fds), 0);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        dup2(fds[1], 1);
        dup2(fds[1], 2);
        close(fds[0]);
        cuda_backend_params_t p = {.spin_timeout_s = 0.2}, pk = {.spin_timeout_s = 2.0};
        backend_t *b = cuda_with(_i != 0, &p);
        backend_t *bk = cuda_with(_i != 0, &pk);
        if (!b || !bk) {
            printf("no backend: %s\n", cs_error_last());
            _exit(3);
        }
        enum { N = 300 };
        backend_buf_t *y = backend_buf_alloc(b, sizeof(float) * N);
        float *src = backend_host_alloc(b, sizeof(float) * N);
        uint32_t *flag = backend_host_alloc(b, sizeof(uint32_t)), *beats = backend_host_alloc(b, 2 * sizeof(uint32_t));
        memset(src, 0, sizeof(float) * N);
        beats[0] = beats[1] = 0;
        struct beat bt = {&beats[0], &beats[1]};
        pthread_t th;
        if (pthread_create(&th, NULL, beat_main, &bt)) _exit(4);
        backend_buf_t *yk = backend_buf_alloc(bk, sizeof(float) * N);
        backend_wait_add(bk, yk, 0, src, CS_DTYPE_F32, N, &beats[1], 1, &beats[0], 6);
        backend_synchronize(bk);
        pthread_join(th, NULL);
        printf("the kept-alive wait ended after %u beats\n", cs_flag_load(&beats[0]));
        fflush(stdout);
        *flag = 0;
        backend_wait_add(b, y, 0, src, CS_DTYPE_F32, N, flag, 1, NULL, 7); /* nobody raises it */
        backend_synchronize(b);
        printf("wait_add returned\n");
        _exit(0);
    }
    close(fds[1]);
    char out[8192];
    size_t len = 0;
    ssize_t k;
    while (len < sizeof out - 1 && (k = read(fds[0], out + len, sizeof out - 1 - len)) > 0) len += (size_t)k;
    out[len] = 0;
    close(fds[0]);
    int st = 0;
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    ck_assert_msg(WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT, "the child ended otherwise (status %#x): %s", st, out);
    ck_assert_msg(strstr(out, "the kept-alive wait ended after 125 beats"), "the wait kept alive did not end: %s", out);
    ck_assert_msg(!strstr(out, "layer 6"), "the wait kept alive was given up on: %s", out);
    ck_assert_msg(strstr(out, "LoRA terms of layer 7") && strstr(out, "waiting for 1"), "no message naming the layer: %s",
                  out);
}
END_TEST

/* ---- device graphs (the CUDA backends with graphs on) ----
 * Decode steps of one key (4 rows, adapters present) run through graph_begin/graph_end: the
 * first eagerly (twice when the first grew the backend's scratch), then one captured, the rest
 * replayed. Between steps the batch changes what a replay must follow: longer sequences (more
 * blocks, so the block tables move), and the adapters of the rows (the rank-32 adapter first
 * appears in step 4, after the capture, larger than any in it). Every step's attention and
 * LoRA outputs are held to the references. */
START_TEST(test_graphs) {
    /* the emulator has one SM: its decode steps get key ranges as a GPU's would (3 here) */
    backend_t *b = _i == 0 ? cuda_emu_backend_new(&(cuda_backend_params_t){.graphs = true, .attn_splits = 3})
#ifdef CS_HAVE_CUDA
                           : cuda_backend_new(&(cuda_backend_params_t){.graphs = true});
#else
                           : NULL;
#endif
    ck_assert_msg(b != NULL, "graphs on %s: %s", _i ? "cuda" : "cuda-emu", cs_error_last());
    enum { NA = 3, T = 4 };
    const int nh = 4, nkv = 2, hd = 16, kvd = nkv * hd, d_in = 40, d_out = 24, pool_blocks = 32;
    static const int ranks[NA] = {4, 8, 32};
    float *A[NA], *B[NA];
    backend_lora_module_desc_t md[NA][BACKEND_LORA_TARGETS];
    backend_adapter_t *slot[NA];
    for (int a = 0; a < NA; a++) {
        A[a] = test_randv(&rng, (size_t)ranks[a] * d_in, 0.3f);
        B[a] = test_randv(&rng, (size_t)d_out * ranks[a], 0.3f);
        for (int t = 0; t < BACKEND_LORA_TARGETS; t++)
            md[a][t] = (backend_lora_module_desc_t){t == 0 ? ranks[a] : 0, d_in, d_out, 0.5f, CS_DTYPE_F32, A[a], B[a], NULL};
        backend_adapter_desc_t d = {.n_layers = 1, .mods = md[a], .host_stays = true};
        ck_assert_int_eq(backend_adapter_upload(b, &d, &slot[a]), CS_OK);
    }
    size_t pool_n = (size_t)pool_blocks * BS * kvd;
    float *k = test_randv(&rng, pool_n, 1.0f), *v = test_randv(&rng, pool_n, 1.0f);
    backend_buf_t *bk = up(b, k, sizeof(float) * pool_n), *bv = up(b, v, sizeof(float) * pool_n);
    backend_buf_t *bq = backend_buf_alloc(b, sizeof(float) * T * nh * hd), *bo = backend_buf_alloc(b, sizeof(float) * T * nh * hd);
    backend_buf_t *bx = backend_buf_alloc(b, sizeof(float) * T * d_in), *by = backend_buf_alloc(b, sizeof(float) * T * d_out);
    backend_batch_t *bt = NULL;
    /* per step: each row's adapter (-1: none) and its cached length */
    static const int who[6][T] = {{0, 1, -1, 0}, {1, 0, 0, -1}, {0, 1, -1, 1}, {1, 1, 0, -1}, {-1, 0, 1, 2}, {2, -1, 2, 0}};
    int replays = 0;
    for (int step = 0; step < 6; step++) {
        tbatch_t t;
        int cached[T], n_new[T];
        for (int r = 0; r < T; r++) cached[r] = 5 + 9 * step + 7 * r, n_new[r] = 1;
        tbatch_make(&t, T, cached, n_new, pool_blocks, 10);
        for (int r = 0; r < T; r++) /* a segment per row with an adapter */
            if (who[step][r] >= 0) t.lora[t.n_lora++] = (backend_lora_seg_desc_t){r, 1, slot[who[step][r]], INT_MAX};
        bt = tbatch_upload(b, &t, bt);
        float *q = test_randv(&rng, (size_t)T * nh * hd, 1.0f), *x = test_randv(&rng, (size_t)T * d_in, 1.0f);
        float *y0 = test_randv(&rng, (size_t)T * d_out, 1.0f);
        /* inputs first (outside the graph), then the graph's ops */
        backend_buf_set(b, bq, 0, q, sizeof(float) * T * nh * hd);
        backend_buf_set(b, bx, 0, x, sizeof(float) * T * d_in);
        backend_buf_set(b, by, 0, y0, sizeof(float) * T * d_out);
        if (backend_graph_begin(b, 42)) {
            replays++;
        } else {
            backend_attention(b, bo, bq, bk, bv, CS_DTYPE_F32, bt, BS, nh, nkv, hd, 0);
            backend_lora(b, by, bx, bt, 0, 0, d_in, d_out);
            backend_graph_end(b);
        }
        float *want = malloc(sizeof(float) * T * nh * hd);
        cs_attention_paged_ref(want, q, k, v, t.hseqs, t.n_seqs, BS, nh, nkv, hd, 0);
        float *got = down(b, bo, (size_t)T * nh * hd);
        close_to(got, want, (size_t)T * nh * hd, 1e-5, "attention in a graph", _i ? CUDA_GPU : CUDA_EMU);
        free(got);
        free(want);
        want = malloc(sizeof(float) * T * d_out);
        memcpy(want, y0, sizeof(float) * T * d_out);
        for (int r = 0; r < T; r++)
            if (who[step][r] >= 0) {
                int a = who[step][r];
                cs_lora_ref(want + (size_t)r * d_out, x + (size_t)r * d_in, 1, A[a], B[a], ranks[a], d_in, d_out, 0.5f);
            }
        got = down(b, by, (size_t)T * d_out);
        close_to(got, want, (size_t)T * d_out, 5e-5, "lora in a graph", _i ? CUDA_GPU : CUDA_EMU);
        free(got);
        free(want);
        free(q);
        free(x);
        free(y0);
    }
    backend_stats_t st;
    backend_get_stats(b, &st);
    ck_assert_int_eq((int)st.graph_captures, 1); /* by step 2 at the latest: steps 4 and 5 are replays */
    ck_assert_int_ge(replays, 3);
    ck_assert_int_eq((int)st.graph_replays, replays);
    backend_batch_free(b, bt);
    backend_buf_free(b, bk);
    backend_buf_free(b, bv);
    backend_buf_free(b, bq);
    backend_buf_free(b, bo);
    backend_buf_free(b, bx);
    backend_buf_free(b, by);
    for (int a = 0; a < NA; a++) {
        backend_adapter_free(b, slot[a]);
        free(A[a]);
        free(B[a]);
    }
    free(k);
    free(v);
    backend_free(b);
}
END_TEST

static void setup(void) {
    cs_rng_seed(&rng, 1234);
    for (int i = FIRST_BACKEND; i < END_BACKENDS; i++) {
        bes[i] = make_backend(i);
        ck_assert_msg(bes[i] != NULL, "%s: %s", names[i], cs_error_last());
    }
}

static void teardown(void) {
    for (int i = 0; i < N_BACKENDS; i++) {
        backend_free(bes[i]);
        bes[i] = NULL;
    }
}

#ifndef TEST_BACKEND_GPU
/* weight_prepare with --compress-weights (CPU backend and strict device): a BF16 matrix is
 * coded once (a second call, as for a tied lm_head, does nothing), a matrix whose high
 * bytes are spread over more than 1% exceptions and an F32 one are left as they are, and
 * every matmul still meets the reference; without the flag nothing is coded. A weight over
 * the caller's memory is then read from the code alone (BACKEND_WEIGHT_HOST_UNUSED). */
START_TEST(test_weight_prepare) {
    cpu_backend_params_t cp = {.n_threads = 2, .compress_weights = true};
    backend_t *bs2[3] = {cpu_backend_new(&cp), strict_device_new(&(strict_device_params_t){.cpu = cp}),
                         cpu_backend_new(&(cpu_backend_params_t){.n_threads = 2})};
    bool codes = cs_cpu_has_avx512() || cs_cpu_has_avx2();
    for (int k = 0; k < 3; k++) {
        backend_t *b = bs2[k];
        ck_assert_ptr_nonnull(b);
        int rows = 200, cols = 300;
        hweight_t good = hweight_new(CS_DTYPE_BF16, rows, cols, 0.5f), spread = hweight_new(CS_DTYPE_BF16, rows, cols, 0.5f);
        hweight_t f32 = hweight_new(CS_DTYPE_F32, rows, cols, 0.5f);
        uint16_t *sp = spread.bytes; /* random finite bits: most high bytes outside any table of 15 */
        for (size_t i = 0; i < (size_t)rows * cols; i++) {
            sp[i] = (uint16_t)(cs_rng_next(&rng) & 0x3fff) | (uint16_t)((cs_rng_next(&rng) & 1) << 15);
            spread.f32[i] = cs_bf16_to_f32(sp[i]);
        }
        backend_weight_t wg = bweight(b, &good), ws = bweight(b, &spread), wf = bweight(b, &f32);
        backend_stats_t st;
        for (int twice = 0; twice < 2; twice++) {
            ck_assert_int_eq(backend_weight_prepare(b, &wg), 0);
            ck_assert_int_eq(backend_weight_prepare(b, &ws), 0);
            ck_assert_int_eq(backend_weight_prepare(b, &wf), 0);
            backend_get_stats(b, &st);
            bool coded = codes && k < 2;
            ck_assert_uint_eq(st.prepared_from, coded ? (size_t)rows * cols * 2 : 0);
            if (coded) ck_assert(st.prepared_bytes > 0 && st.prepared_bytes < st.prepared_from);
            else ck_assert_uint_eq(st.prepared_bytes, 0);
        }
        hweight_t *hs[3] = {&good, &spread, &f32};
        backend_weight_t *bw[3] = {&wg, &ws, &wf};
        float *x = test_randv(&rng, (size_t)cols, 1.0f), *want = malloc(sizeof(float) * rows);
        backend_buf_t *bx = up(b, x, sizeof(float) * cols), *by = backend_buf_alloc(b, sizeof(float) * rows);
        for (int m = 0; m < 3; m++) {
            cs_matmul_ref(want, x, 1, &hs[m]->w, NULL);
            backend_matmul(b, by, bx, 1, bw[m], NULL);
            float *got = down(b, by, (size_t)rows);
            double scale = 1e-30; /* against the sum of |terms|: the spread matrix's rows cancel */
            for (int r = 0; r < rows; r++) {
                double t = 0;
                for (int c = 0; c < cols; c++) t += fabs((double)hs[m]->f32[(size_t)r * cols + c] * x[c]);
                scale = fmax(scale, t);
            }
            for (int r = 0; r < rows; r++)
                ck_assert_msg(fabs((double)got[r] - want[r]) <= 1e-6 * scale, "backend %d matrix %d row %d: %.9g vs %.9g", k,
                              m, r, got[r], want[r]);
            free(got);
        }
        free(x);
        free(want);
        /* over the caller's memory (the model's weights in place), with
         * --compress-weights-only where it applies: the backend says so and from then on
         * reads only the code (the host bytes overwritten with NaN change nothing); with
         * --compress-weights it keeps reading them, the same bits as the BF16 path */
        for (int conly = 0; conly < 2; conly++) {
            backend_t *bh = b;
            if (conly) {
                if (k) break;
                bh = cpu_backend_new(&(cpu_backend_params_t){.n_threads = 2, .compress_weights_only = true});
            }
            size_t nb = (size_t)rows * cols * 2;
            uint16_t *host = malloc(nb);
            memcpy(host, good.bytes, nb);
            backend_weight_t wh = {CS_DTYPE_BF16, rows, cols, backend_buf_from_host(bh, host, nb), host};
            ck_assert(!wh.buf == !backend_caps(bh)->host_memory); /* the strict device offers no host buffers */
            if (!wh.buf) wh.buf = up(bh, host, nb);
            bool only = conly && codes && !cs_cpu_has_amx_bf16();
            ck_assert_int_eq(backend_weight_prepare(bh, &wh), only ? BACKEND_WEIGHT_HOST_UNUSED : 0);
            ck_assert_int_eq(backend_weight_prepare(bh, &wh), only ? BACKEND_WEIGHT_HOST_UNUSED : 0); /* coded once */
            if (only) memset(host, 0xff, nb);
            for (int n = 1; n <= 40; n += 13) { /* 1, 14, 27, 40: the GEMV, groups or tiles, decoded tiles, packed */
                float *xn = test_randv(&rng, (size_t)n * cols, 1.0f), *yr = malloc(sizeof(float) * n * rows);
                backend_buf_t *bxn = up(bh, xn, sizeof(float) * n * cols), *byh = backend_buf_alloc(bh, sizeof(float) * n * rows);
                backend_buf_t *bxg = up(b, xn, sizeof(float) * n * cols), *byg = backend_buf_alloc(b, sizeof(float) * n * rows);
                backend_matmul(bh, byh, bxn, n, &wh, NULL);
                backend_matmul(b, byg, bxg, n, &wg, NULL);
                float *gh = down(bh, byh, (size_t)n * rows), *gg = down(b, byg, (size_t)n * rows);
                cs_matmul_ref(yr, xn, n, &good.w, NULL);
                close_to(gh, yr, (size_t)n * rows, 1e-5, "weight over host memory", k);
                if (!only || n > CPU_CODE_ONLY_PASS_MAX_N) /* the same kernels: the same bits */
                    ck_assert_msg(!memcmp(gh, gg, sizeof(float) * n * rows), "backend %d, n %d, only %d: bits differ", k, n, only);
                free(gh); free(gg); free(xn); free(yr);
                backend_buf_free(bh, bxn); backend_buf_free(bh, byh); backend_buf_free(b, bxg); backend_buf_free(b, byg);
            }
            backend_buf_free(bh, wh.buf);
            free(host);
            if (conly) backend_free(bh);
        }
        backend_buf_free(b, bx);
        backend_buf_free(b, by);
        backend_buf_free(b, wg.buf);
        backend_buf_free(b, ws.buf);
        backend_buf_free(b, wf.buf);
        hweight_free(&good);
        hweight_free(&spread);
        hweight_free(&f32);
        backend_free(b);
    }
}
END_TEST
#endif

/* the op tests, each on every backend of this program */
static void add_op_tests(TCase *tc) {
    tcase_add_loop_test(tc, test_matmul, FIRST_BACKEND, END_BACKENDS);
    tcase_add_loop_test(tc, test_elementwise, FIRST_BACKEND, END_BACKENDS);
    tcase_add_loop_test(tc, test_rope_embed_rows, FIRST_BACKEND, END_BACKENDS);
    tcase_add_loop_test(tc, test_attention, FIRST_BACKEND, END_BACKENDS);
    tcase_add_loop_test(tc, test_lora, FIRST_BACKEND, END_BACKENDS);
    tcase_add_loop_test(tc, test_copies, FIRST_BACKEND, END_BACKENDS);
    tcase_add_loop_test(tc, test_cold_start, FIRST_BACKEND, END_BACKENDS);
}

#ifdef TEST_BACKEND_GPU
static bool require_cuda(void) {
    const char *v = getenv("CS_TEST_REQUIRE_CUDA");
    return v && *v && strcmp(v, "0");
}

/* the GPU's ops and graphs; without a GPU: SKIP (77), or FAIL where one is required */
int main(void) {
    backend_t *gpu = make_backend(CUDA_GPU);
    if (!gpu) {
        printf("%s: cuda: %s\n", require_cuda() ? "FAIL" : "SKIP", cs_error_last());
        return require_cuda() ? 1 : 77;
    }
    printf("cuda: %s\n", backend_name(gpu));
    backend_free(gpu);
    Suite *s = suite_create("backend_ops_gpu");
    TCase *tc = tcase_create("ops");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 600);
    add_op_tests(tc);
    tcase_add_loop_test(tc, test_graphs, 1, 2); /* cuda */
    tcase_add_loop_test(tc, test_attention_long, 1, 2);
    /* under compute-sanitizer (tools/gpu-host.sh's memcheck, synccheck) the deadline's trap is
     * an error by design: that run leaves the test out, and says so */
    if (getenv("CS_TEST_NO_TRAP")) printf("test_spin_deadline left out (CS_TEST_NO_TRAP)\n");
    else tcase_add_loop_test(tc, test_spin_deadline, 1, 2);
    suite_add_tcase(s, tc);
    return cs_check_run(s, CK_FORK) ? 1 : 0;
}
#else
int main(void) {
    Suite *s = suite_create("backend_ops");
    TCase *tc = tcase_create("ops");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 600);
    add_op_tests(tc);
    tcase_add_loop_test(tc, test_graphs, 0, 1); /* cuda-emu */
    tcase_add_loop_test(tc, test_spin_deadline, 0, 1);
    tcase_add_loop_test(tc, test_attention_long, 0, 1); /* cuda-emu */
    tcase_add_test(tc, test_weight_prepare);
    suite_add_tcase(s, tc);
    TCase *ts = tcase_create("strict");
    tcase_add_checked_fixture(ts, setup, teardown);
    tcase_add_test_raise_signal(ts, test_strict_rejects_host_pointer, SIGABRT);
    tcase_add_test_raise_signal(ts, test_strict_rejects_freed_handle, SIGABRT);
    tcase_add_test_raise_signal(ts, test_strict_rejects_foreign_handle, SIGABRT);
    tcase_add_test_raise_signal(ts, test_strict_rejects_out_of_range, SIGABRT);
    tcase_add_test(ts, test_strict_fresh_memory_is_nan);
    suite_add_tcase(s, ts);
    return cs_check_run(s, CK_FORK) ? 1 : 0;
}
#endif
