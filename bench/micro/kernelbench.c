/* bench/micro/kernelbench.c (built as bench/kernelbench): the CPU backend's matmul kernels
 * alone, on the seven projections of one layer of the bench model (hidden 1024, intermediate
 * 2816, BF16 weights; L such layers, 4 by
 * default, so they do not fit the last-level cache as one would), at the row counts
 * of decode (1, 8, 32) and prefill (512): GFLOP/s and weight GB/s, best of R repetitions
 * (the best is what the machine can do; noise only ever slows a run), for the kernels the
 * backend picks and for each switch of cpu_backend_params_t that changes them. Beside them,
 * the compute roofline: fused multiply-adds per second of all threads on independent
 * registers (8 lanes with AVX2, 16 with AVX-512), and vdpbf16ps's where the CPU has it
 * (64 flops an instruction: the --precision bf16 kernels' roofline). And the LoRA of a decode batch of 8 rows,
 * each on its own rank-16 BF16 adapter (all seven projections), against the base matmuls
 * of the same rows: lora_ms / base_ms is the adapters' cost at the kernel level. Prints one
 * JSON object. Last, the batch-1 GEMV's two tunings (8 or 6 interleaved row streams, and 4:
 * cpu_backend_params_t.gemv_streams) in alternation, round by round, so the machine's
 * swings in bandwidth hit both alike: median GB/s of each and the median of the per-round
 * ratios.
 *
 *   bench/kernelbench [--threads N] [--reps R] [--hidden H] [--inter I] [--layers L]
 *                                                            (2, 30, 1024, 2816, 4)
 *   bench/kernelbench --peak [--threads N]    the compute rooflines alone (bench/engine.sh) */
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cpu_kernels/cpu_raw.h"
#include "cpu_kernels/kernels.h"
#include "cpu_kernels/wcode.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ---- FMA peak ---- */
#define PEAK_ITERS 20000000L
/* the peak loop: ten accumulators a[i] of vector type T (set to i by SET1), each updated
 * independently by STEP (an expression of a[i]) PEAK_ITERS times, so no instruction waits for
 * another's result; then summed with ADD into s */
#define PEAK_LOOP(T, SET1, ADD, STEP)                                  \
    T a[10];                                                           \
    for (int i = 0; i < 10; i++) a[i] = SET1((float)i);                \
    for (long it = 0; it < PEAK_ITERS; it++)                           \
        _Pragma("GCC unroll 10") for (int i = 0; i < 10; i++) a[i] = STEP; \
    T s = a[0];                                                        \
    for (int i = 1; i < 10; i++) s = ADD(s, a[i])

__attribute__((target("avx2,fma"))) static void *fma_avx2(void *arg) {
    __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
    PEAK_LOOP(__m256, _mm256_set1_ps, _mm256_add_ps, _mm256_fmadd_ps(a[i], m, c));
    float t[8];
    _mm256_storeu_ps(t, s);
    *(float *)arg = t[0];
    return NULL;
}
__attribute__((target("avx512f"))) static void *fma_avx512(void *arg) {
    __m512 m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
    PEAK_LOOP(__m512, _mm512_set1_ps, _mm512_add_ps, _mm512_fmadd_ps(a[i], m, c));
    *(float *)arg = _mm512_reduce_add_ps(s);
    return NULL;
}

/* vdpbf16ps on independent registers: 32 multiply-adds (64 flops) per instruction */
__attribute__((target("avx512f,avx512bf16"))) static void *dp_bf16(void *arg) {
    __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = (__m512bh)_mm512_set1_epi32(0x3f803f81);
    PEAK_LOOP(__m512, _mm512_set1_ps, _mm512_add_ps, _mm512_dpbf16_ps(a[i], x, y));
    *(float *)arg = _mm512_reduce_add_ps(s);
    return NULL;
}

/* GFLOP/s of `threads` threads running a peak loop: FMA (2 per lane; 8 or 16 lanes) or
 * vdpbf16ps (flops 0: 64 per instruction) */
static double run_peak(int threads, void *(*fn)(void *), int flops) {
    pthread_t *tid = calloc((size_t)threads, sizeof *tid);
    float *sink = calloc((size_t)threads, sizeof *sink);
    double t0 = now();
    for (int t = 0; t < threads; t++) pthread_create(&tid[t], NULL, fn, &sink[t]);
    for (int t = 0; t < threads; t++) pthread_join(tid[t], NULL);
    double secs = now() - t0;
    if (sink[0] == 42.0f) fputc(' ', stderr);
    free(tid);
    free(sink);
    return (double)threads * PEAK_ITERS * 10 * flops / secs * 1e-9;
}
static double fma_peak(int threads, bool avx512) {
    return run_peak(threads, avx512 ? fma_avx512 : fma_avx2, (avx512 ? 16 : 8) * 2);
}
/* the compute rooflines, each the best of 5 runs of its loop: a run is ~30 ms, and a single
 * one read 102 and 135 GFLOP/s on a CPU whose best is 233 for both (its clock comes up late) */
static void peaks(int threads, double *pk, double *pk512, double *pkdp) {
    *pk = *pk512 = *pkdp = 0;
    for (int i = 0; i < 5; i++) {
        double a = cs_cpu_has_avx2() ? fma_peak(threads, false) : 0;
        double b = cs_cpu_has_avx512() ? fma_peak(threads, true) : 0;
        double c = cs_cpu_has_avx512_bf16() ? run_peak(threads, dp_bf16, 64) : 0;
        *pk = a > *pk ? a : *pk;
        *pk512 = b > *pk512 ? b : *pk512;
        *pkdp = c > *pkdp ? c : *pkdp;
    }
}
/* --peak: only the rooflines, as one JSON line for bench scripts */
static int peak_only(int threads) {
    double pk, pk512, pkdp;
    peaks(threads, &pk, &pk512, &pkdp);
    char cpu[128];
    cs_cpu_name(cpu, sizeof cpu);
    printf("{\"benchmark\": \"peak\", \"cpu\": \"%s\", \"threads\": %d, \"fma_peak_gflops_avx2\": %.1f, "
           "\"fma_peak_gflops_avx512\": %.1f, \"dpbf16_peak_gflops\": %.1f}\n",
           cpu, threads, pk, pk512, pkdp);
    return 0;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* the median over `rounds` alternating rounds (after one warm-up) of time(base) / time(other):
 * each round runs the `count` weights of wa on backend a, then those of wb on backend b */
static double paired_median(cpu_raw_t *a, const cs_weight_t *wa, cpu_raw_t *b, const cs_weight_t *wb, int count, float *y,
                            const float *x, int n, int rounds) {
    double *ratio = malloc(sizeof(double) * (size_t)rounds);
    for (int it = 0; it <= rounds; it++) {
        double t0 = now();
        for (int p = 0; p < count; p++) cpu_raw_matmul(a, y, x, n, &wa[p], NULL);
        double t1 = now();
        for (int p = 0; p < count; p++) cpu_raw_matmul(b, y, x, n, &wb[p], NULL);
        double t2 = now();
        if (it) ratio[it - 1] = (t1 - t0) / (t2 - t1);
    }
    qsort(ratio, (size_t)rounds, sizeof *ratio, cmp_double);
    double med = ratio[rounds / 2];
    free(ratio);
    return med;
}

/* ---- the matmuls ---- */
typedef struct { const char *name; int rows, cols; } proj_t;

static float *randv(size_t n) {
    float *v = malloc(n * sizeof *v);
    uint32_t s = 12345;
    for (size_t i = 0; i < n; i++) {
        s = s * 1664525u + 1013904223u;
        v[i] = ((float)(s >> 8) / 16777216.0f - 0.5f) * 0.1f;
    }
    return v;
}

/* the run's set-up: the arguments, the L layers' BF16 weights (NP projections each) and the
 * activations */
enum { NP = 7 };
typedef struct kb {
    int threads, reps, hidden, inter, layers;
    proj_t projs[NP];
    cs_weight_t *w; /* (layers * NP) */
    size_t wbytes, params;
    float *x, *y;   /* (512, max(hidden, inter)) */
} kb_t;

/* 0, or the exit status of a usage error */
static int parse_args(int argc, char **argv, kb_t *k, bool *peak) {
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc) k->threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--peak")) *peak = true;
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) k->reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--hidden") && i + 1 < argc) k->hidden = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--inter") && i + 1 < argc) k->inter = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--layers") && i + 1 < argc) k->layers = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--threads N] [--reps R] [--hidden H] [--inter I] [--layers L] | --peak [--threads N]\n", argv[0]);
            return 2;
        }
    }
    if (k->threads < 1 || k->reps < 1 || k->hidden < 8 || k->inter < 8 || k->layers < 1 || k->layers > 64) { fprintf(stderr, "kernelbench: bad argument\n"); return 2; }
    return 0;
}

static void kb_setup(kb_t *k) {
    int hidden = k->hidden, inter = k->inter;
    proj_t projs[NP] = {{"q", hidden, hidden}, {"k", hidden, hidden}, {"v", hidden, hidden}, {"o", hidden, hidden},
                        {"gate", inter, hidden}, {"up", inter, hidden}, {"down", hidden, inter}};
    memcpy(k->projs, projs, sizeof projs);
    k->w = calloc((size_t)(NP * k->layers), sizeof *k->w);
    for (int p = 0; p < NP * k->layers; p++) {
        size_t n = (size_t)projs[p % NP].rows * projs[p % NP].cols;
        float *f = randv(n);
        uint16_t *h = malloc(n * 2);
        for (size_t i = 0; i < n; i++) h[i] = cs_f32_to_bf16(f[i]);
        free(f);
        k->w[p] = (cs_weight_t){CS_DTYPE_BF16, projs[p % NP].rows, projs[p % NP].cols, h, NULL, NULL};
        k->wbytes += n * 2;
        k->params += n;
    }
    int max_n = 512;
    k->x = randv((size_t)max_n * (size_t)(inter > hidden ? inter : hidden));
    k->y = malloc(sizeof(float) * (size_t)max_n * (size_t)(inter > hidden ? inter : hidden));
}

/* the JSON's head: the machine, the shapes and the compute rooflines */
static void print_header(const kb_t *k) {
    char cpu[128];
    cs_cpu_name(cpu, sizeof cpu);
    printf("{\"benchmark\": \"kernels\", \"cpu\": \"%s\", \"threads\": %d, \"hidden\": %d, \"inter\": %d, \"layers\": %d, "
           "\"weights\": \"BF16\", \"avx2\": %s, \"avx512\": %s, \"avx512_bf16\": %s, \"amx\": %s,\n",
           cpu, k->threads, k->hidden, k->inter, k->layers, cs_cpu_has_avx2() ? "true" : "false",
           cs_cpu_has_avx512() ? "true" : "false", cs_cpu_has_avx512_bf16() ? "true" : "false",
           cs_cpu_has_amx_bf16() ? "true" : "false");
    double pk, pk512, pkdp;
    peaks(k->threads, &pk, &pk512, &pkdp);
    printf(" \"fma_peak_gflops_avx2\": %.1f, \"fma_peak_gflops_avx512\": %.1f, \"dpbf16_peak_gflops\": %.1f,\n \"runs\": [\n",
           pk, pk512, pkdp);
}

/* "runs": every layer's matmuls at 1, 8, 32 and 512 rows, best of R, for each backend switch */
static void run_variants(const kb_t *k) {
    int threads = k->threads;
    struct { const char *name; cpu_backend_params_t p; } variants[] = {
        {"default", {.n_threads = threads}},
        {"no_tile", {.n_threads = threads, .no_tile = true}},
        {"no_packed", {.n_threads = threads, .no_packed = true}},
        {"no_split", {.n_threads = threads, .no_split = true}},
        {"bf16", {.n_threads = threads, .precision_bf16 = true}},
        {"no_avx512", {.n_threads = threads, .no_avx512 = true}},
        {"invariant", {.n_threads = threads, .batch_invariant = true}},
    };
    static const int ns[] = {1, 8, 32, 512};
    bool first = true;
    for (size_t v = 0; v < sizeof variants / sizeof variants[0]; v++) {
        if (!strcmp(variants[v].name, "no_avx512") && !cs_cpu_has_avx512()) continue;
        cpu_raw_t *be = cpu_raw_new(&variants[v].p);
        for (size_t j = 0; j < sizeof ns / sizeof ns[0]; j++) {
            int n = ns[j];
            int r = n >= 512 ? (k->reps + 19) / 20 : k->reps;
            double best = 1e30;
            for (int it = 0; it <= r; it++) { /* the first pass warms caches and scratch */
                double t0 = now();
                for (int p = 0; p < NP * k->layers; p++) cpu_raw_matmul(be, k->y, k->x, n, &k->w[p], NULL);
                double t = now() - t0;
                if (it && t < best) best = t;
            }
            double gflops = 2.0 * (double)k->params * n / best * 1e-9;
            printf("%s  {\"variant\": \"%s\", \"path\": \"%s\", \"n\": %d, \"ms\": %.3f, \"gflops\": %.1f, "
                   "\"weight_gb_s\": %.1f}",
                   first ? "" : ",\n", variants[v].name, cpu_raw_path(be), n, best * 1e3, gflops,
                   (double)k->wbytes / best * 1e-9);
            first = false;
            fflush(stdout);
        }
        cpu_raw_free(be);
    }
    printf("\n ]");
}

/* the batch-1 GEMV's tunings, each against its base: the ISA's wide tuning, or (_wc12: the
 * weights coded in 12 bits, --compress-weights) the same tuning on the BF16 weights */
typedef struct { const char *name; cpu_backend_params_t p; bool ok; int base; } gemv_variant_t;
enum { NG = 6 };

/* "gemv_paired": each round runs every tuning once, in turn */
static void gemv_paired(const kb_t *k, const gemv_variant_t *gv, cpu_raw_t *const *gb, const cs_weight_t *wc,
                        size_t coded, int rounds) {
    double *t = calloc((size_t)NG * rounds, sizeof *t);
    for (int it = 0; it <= rounds; it++)
        for (int g = 0; g < NG; g++) {
            if (!gb[g]) continue;
            const cs_weight_t *wg = gv[g].p.compress_weights ? wc : k->w;
            double t0 = now();
            for (int p = 0; p < NP * k->layers; p++) cpu_raw_matmul(gb[g], k->y, k->x, 1, &wg[p], NULL);
            if (it) t[g * rounds + it - 1] = now() - t0; /* round 0 warms up */
        }
    printf(",\n  \"gemv_coded_bytes\": %zu, \"gemv_paired\": [", coded);
    bool first_g = true;
    for (int g = 0; g < NG; g++) {
        if (!gb[g]) continue;
        int base = gv[g].base;
        double *ratio = malloc(sizeof(double) * rounds), *tt = malloc(sizeof(double) * rounds);
        for (int r = 0; r < rounds; r++) { ratio[r] = t[base * rounds + r] / t[g * rounds + r]; tt[r] = t[g * rounds + r]; }
        qsort(ratio, (size_t)rounds, sizeof *ratio, cmp_double);
        qsort(tt, (size_t)rounds, sizeof *tt, cmp_double);
        /* weight_gb_s: the BF16 bytes' worth; read_gb_s: the bytes read (the coded ones for _wc12) */
        double wb = (double)k->wbytes, rb = gv[g].p.compress_weights ? (double)coded : wb;
        printf("%s\n   {\"variant\": \"%s\", \"path\": \"%s\", \"rounds\": %d, \"weight_gb_s_median\": %.1f, "
               "\"weight_gb_s_best\": %.1f, \"read_gb_s_median\": %.1f, \"speed_vs_%s_median\": %.3f}",
               first_g ? "" : ",", gv[g].name, cpu_raw_path(gb[g]), rounds, wb / tt[rounds / 2] * 1e-9,
               wb / tt[0] * 1e-9, rb / tt[rounds / 2] * 1e-9, gv[base].name, ratio[rounds / 2]);
        free(ratio);
        free(tt);
        first_g = false;
    }
    printf("]");
    free(t);
}

/* "coded_rows_paired": 2..CS_WCODE_MAX_N rows, the coded rows kernel against the BF16 dot tiles */
static void coded_rows_paired(const kb_t *k, cpu_raw_t *const *gb, const cs_weight_t *wc, int rounds) {
    printf(",\n  \"coded_rows_paired\": [");
    bool first_r = true;
    for (int isa = 0; isa < 2; isa++) {
        cpu_raw_t *pb = gb[isa ? 4 : 1], *cb = gb[isa ? 5 : 2];
        if (!pb || !cb) continue;
        for (int n = 2; n <= CS_WCODE_MAX_N; n++) {
            double med = paired_median(pb, k->w, cb, wc, NP * k->layers, k->y, k->x, n, rounds);
            printf("%s\n   {\"isa\": \"%s\", \"n\": %d, \"rounds\": %d, \"coded_speed_vs_bf16_tiles_median\": %.3f}",
                   first_r ? "" : ",", isa ? "avx2" : "avx512", n, rounds, med);
            first_r = false;
        }
    }
    printf("]");
}

/* "code_only_paired": --compress-weights-only (the weights kept only coded, data NULL, as after
 * the model released the BF16 bytes) against no flag (the BF16 weights), at the sizes the other
 * kernels take: the coded kernel up to 4 rows, then in groups of up to 4 rows (to
 * CPU_CODE_ONLY_PASS_MAX_N), then each task's rows decoded for the dot tiles, the packed GEMM
 * (prefill) or, with --precision bf16, the AVX512-BF16 GEMMs */
static void code_only_paired(const kb_t *k, cpu_raw_t *const *gb, const cs_weight_t *wc, int rounds) {
    int threads = k->threads;
    printf(",\n  \"code_only_paired\": [");
    bool first_c = true;
    for (int isa = 0; isa < 3; isa++) {
        cpu_raw_t *pb = isa == 2 ? NULL : gb[isa ? 4 : 1];
        if (isa == 2 && gb[1] && cs_cpu_has_avx512_bf16())
            pb = cpu_raw_new(&(cpu_backend_params_t){.n_threads = threads, .gemv_streams = 4, .precision_bf16 = true});
        if (!pb) continue;
        cpu_raw_t *cb = cpu_raw_new(&(cpu_backend_params_t){.n_threads = threads, .gemv_streams = 4, .no_avx512 = isa == 1,
                                                            .precision_bf16 = isa == 2, .compress_weights_only = true});
        cs_weight_t *wo = calloc((size_t)NP * k->layers, sizeof *wo);
        for (int p = 0; p < NP * k->layers; p++) {
            wo[p] = wc[p];
            if (wo[p].code && cpu_raw_code_only(cb)) wo[p].data = NULL;
        }
        static const int cns[] = {2, 4, 5, 8, 12, 16, 24, 32, 128, 512};
        for (size_t j = 0; j < sizeof cns / sizeof cns[0]; j++) {
            int n = cns[j], rr = n >= 128 ? (rounds + 9) / 10 + 2 : rounds;
            double med = paired_median(pb, k->w, cb, wo, NP * k->layers, k->y, k->x, n, rr);
            printf("%s\n   {\"path\": \"%s\", \"base_path\": \"%s\", \"code_only\": %s, \"n\": %d, \"rounds\": %d, "
                   "\"speed_vs_bf16_median\": %.3f}",
                   first_c ? "" : ",", cpu_raw_path(cb), cpu_raw_path(pb), cpu_raw_code_only(cb) ? "true" : "false", n, rr,
                   med);
            first_c = false;
        }
        free(wo);
        cpu_raw_free(cb);
        if (isa == 2) cpu_raw_free(pb);
    }
    printf("]");
}

/* the GEMV tunings and the coded weights' kernels, paired round by round */
static void run_gemv_tunings(const kb_t *k) {
    int threads = k->threads;
    bool avx512 = cs_cpu_has_avx512();
    gemv_variant_t gv[NG] = {
        {"avx512_streams8", {.n_threads = threads, .gemv_streams = 8}, avx512, 0},
        {"avx512_streams4", {.n_threads = threads, .gemv_streams = 4}, avx512, 0},
        {"avx512_streams4_wc12", {.n_threads = threads, .gemv_streams = 4, .compress_weights = true}, avx512, 1},
        {"avx2_streams6", {.n_threads = threads, .no_avx512 = true, .gemv_streams = 6}, cs_cpu_has_avx2(), 3},
        {"avx2_streams4", {.n_threads = threads, .no_avx512 = true, .gemv_streams = 4}, cs_cpu_has_avx2(), 3},
        {"avx2_streams4_wc12", {.n_threads = threads, .no_avx512 = true, .gemv_streams = 4, .compress_weights = true},
         cs_cpu_has_avx2(), 4},
    };
    int rounds = k->reps < 5 ? 5 : k->reps;
    cpu_raw_t *gb[NG];
    for (int g = 0; g < NG; g++) gb[g] = gv[g].ok ? cpu_raw_new(&gv[g].p) : NULL;
    cs_weight_t *wc = calloc((size_t)NP * k->layers, sizeof *wc);
    size_t coded = 0;
    for (int p = 0; p < NP * k->layers; p++) {
        wc[p] = k->w[p];
        wc[p].code = gb[3] ? cpu_raw_wcode_new(gb[3], &k->w[p]) : NULL;
        coded += wc[p].code ? cs_wcode_bytes(wc[p].code) : 0;
    }
    gemv_paired(k, gv, gb, wc, coded, rounds);
    coded_rows_paired(k, gb, wc, rounds);
    code_only_paired(k, gb, wc, rounds);
    for (int p = 0; p < NP * k->layers; p++) cs_wcode_free((cs_wcode_t *)wc[p].code);
    free(wc);
    for (int g = 0; g < NG; g++) cpu_raw_free(gb[g]);
}

/* LoRA: 8 rows, 8 adapters (distinct weights per adapter, layer and projection), against the
 * base matmuls of the same rows; the JSON's last key */
enum { LN = 8, RANK = 16 };
static void run_lora(const kb_t *k) {
    size_t nseg = (size_t)NP * k->layers * LN;
    cpu_lora_seg_t *segs = calloc(nseg, sizeof *segs);
    for (size_t s = 0; s < nseg; s++) {
        const proj_t *pj = &k->projs[(s / LN) % NP];
        size_t na = (size_t)RANK * pj->cols, nb = (size_t)RANK * pj->rows;
        float *fa = randv(na), *fb = randv(nb);
        uint16_t *a = malloc(na * 2), *b = malloc(nb * 2), *bt = malloc(nb * 2);
        for (size_t i = 0; i < na; i++) a[i] = cs_f32_to_bf16(fa[i]);
        for (int o = 0; o < pj->rows; o++)
            for (int r = 0; r < RANK; r++) {
                b[(size_t)o * RANK + r] = cs_f32_to_bf16(fb[(size_t)o * RANK + r]);
                bt[(size_t)r * pj->rows + o] = b[(size_t)o * RANK + r];
            }
        free(fa); free(fb);
        segs[s] = (cpu_lora_seg_t){(int)(s % LN), 1, a, b, RANK, 2.0f, bt, CS_DTYPE_BF16};
    }
    cpu_raw_t *be = cpu_raw_new(&(cpu_backend_params_t){.n_threads = k->threads});
    const cs_weight_t *w = k->w;
    double base = 1e30, lora = 1e30;
    for (int it = 0; it <= k->reps; it++) {
        double t0 = now();
        for (int p = 0; p < NP * k->layers; p++) cpu_raw_matmul(be, k->y, k->x, LN, &w[p], NULL);
        double t1 = now();
        for (int p = 0; p < NP * k->layers; p++)
            cpu_raw_lora_batch(be, k->y, k->x, &segs[(size_t)p * LN], LN, w[p].cols, w[p].rows);
        double t2 = now();
        if (it && t1 - t0 < base) base = t1 - t0;
        if (it && t2 - t1 < lora) lora = t2 - t1;
    }
    printf(",\n \"lora_batch8_8_adapters\": {\"rank\": %d, \"dtype\": \"BF16\", \"base_ms\": %.3f, \"lora_ms\": %.3f, "
           "\"cost\": %.3f}\n}\n", RANK, base * 1e3, lora * 1e3, lora / base);
    cpu_raw_free(be);
    for (size_t s = 0; s < nseg; s++) { free((void *)segs[s].a); free((void *)segs[s].b); free((void *)segs[s].bt); }
    free(segs);
}

static void kb_free(kb_t *k) {
    for (int p = 0; p < NP * k->layers; p++) free((void *)k->w[p].data);
    free(k->w);
    free(k->x);
    free(k->y);
}

int main(int argc, char **argv) {
    kb_t k = {.threads = 2, .reps = 30, .hidden = 1024, .inter = 2816, .layers = 4};
    bool peak = false;
    int rc = parse_args(argc, argv, &k, &peak);
    if (rc) return rc;
    if (peak) return peak_only(k.threads);
    kb_setup(&k);
    print_header(&k);
    run_variants(&k);
    run_gemv_tunings(&k);
    run_lora(&k);
    kb_free(&k);
    return 0;
}
