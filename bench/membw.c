/* membw.c: multi-threaded memory read bandwidth, the roofline for batch-1 decode (every
 * token streams all weights once). Each thread reads its own contiguous share of a buffer
 * much larger than the last-level cache with wide loads, in two patterns: one sequential
 * stream per thread, and 8 interleaved streams per thread with software prefetch (as the
 * GEMV reads; AVX-512 or AVX2 loads, CS_NO_AVX512 for the latter; on this kind of machine a single stream per core leaves bandwidth unused).
 * The best and median of several passes are printed as JSON; read_gb_s_* is the better
 * pattern, the roofline.
 *
 *   bench/membw [--threads N] [--mib SIZE] [--reps R]     (defaults: all CPUs, 1024, 10) */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define AVX512 __attribute__((target("avx512f")))
#define AVX2 __attribute__((target("avx2")))
#endif

struct share {
    const uint64_t *p;
    size_t n;            /* uint64 words */
    uint64_t sink;
    pthread_barrier_t *bar;
    int reps;
    double *secs;        /* per pass, written by thread 0 */
    int isa;             /* 2: AVX-512 loads, 1: AVX2, 0: scalar */
    int streams;         /* 1, or 8 interleaved with prefetch (vector loads only) */
};

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

#if defined(__x86_64__)
/* 256 bytes per iteration, four independent accumulators */
AVX512 static uint64_t read_avx512(const uint64_t *p, size_t n) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        a0 = _mm512_xor_si512(a0, _mm512_load_si512(p + i));
        a1 = _mm512_xor_si512(a1, _mm512_load_si512(p + i + 8));
        a2 = _mm512_xor_si512(a2, _mm512_load_si512(p + i + 16));
        a3 = _mm512_xor_si512(a3, _mm512_load_si512(p + i + 24));
    }
    a0 = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
    uint64_t s = (uint64_t)_mm512_reduce_add_epi64(a0);
    for (; i < n; i++) s ^= p[i];
    return s;
}

/* 8 streams over the eighths of [p, p + n), 64 bytes of each in turn, prefetched ahead */
AVX512 static uint64_t read_streams(const uint64_t *p, size_t n) {
    size_t q = n / 8 & ~(size_t)7;
    __m512i a = _mm512_setzero_si512();
    for (size_t i = 0; i < q; i += 8)
        for (int s = 0; s < 8; s++) {
            _mm_prefetch((const char *)(p + s * q + i) + 1024, _MM_HINT_T0);
            a = _mm512_xor_si512(a, _mm512_load_si512(p + s * q + i));
        }
    uint64_t r = (uint64_t)_mm512_reduce_add_epi64(a);
    for (size_t i = 8 * q; i < n; i++) r ^= p[i];
    return r;
}
/* the same two patterns with 32-byte AVX2 loads */
AVX2 static uint64_t read_avx2(const uint64_t *p, size_t n) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        a0 = _mm256_xor_si256(a0, _mm256_load_si256((const __m256i *)(p + i)));
        a1 = _mm256_xor_si256(a1, _mm256_load_si256((const __m256i *)(p + i + 4)));
        a2 = _mm256_xor_si256(a2, _mm256_load_si256((const __m256i *)(p + i + 8)));
        a3 = _mm256_xor_si256(a3, _mm256_load_si256((const __m256i *)(p + i + 12)));
    }
    a0 = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
    uint64_t t[4];
    _mm256_storeu_si256((__m256i *)t, a0);
    uint64_t s = t[0] ^ t[1] ^ t[2] ^ t[3];
    for (; i < n; i++) s ^= p[i];
    return s;
}
AVX2 static uint64_t read_streams_avx2(const uint64_t *p, size_t n) {
    size_t q = n / 8 & ~(size_t)7;
    __m256i a = _mm256_setzero_si256(), b = a;
    for (size_t i = 0; i < q; i += 8)
        for (int s = 0; s < 8; s++) {
            _mm_prefetch((const char *)(p + s * q + i) + 1024, _MM_HINT_T0);
            a = _mm256_xor_si256(a, _mm256_load_si256((const __m256i *)(p + s * q + i)));
            b = _mm256_xor_si256(b, _mm256_load_si256((const __m256i *)(p + s * q + i + 4)));
        }
    uint64_t t[4];
    _mm256_storeu_si256((__m256i *)t, _mm256_xor_si256(a, b));
    uint64_t r = t[0] ^ t[1] ^ t[2] ^ t[3];
    for (size_t i = 8 * q; i < n; i++) r ^= p[i];
    return r;
}
#endif
static uint64_t read_plain(const uint64_t *p, size_t n) {
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    size_t i = 0;
    for (; i + 4 <= n; i += 4) { s0 ^= p[i]; s1 ^= p[i + 1]; s2 ^= p[i + 2]; s3 ^= p[i + 3]; }
    for (; i < n; i++) s0 ^= p[i];
    return s0 ^ s1 ^ s2 ^ s3;
}

static void *worker(void *arg) {
    struct share *s = arg;
    for (int r = 0; r < s->reps; r++) {
        pthread_barrier_wait(s->bar);
        double t0 = now();
#if defined(__x86_64__)
        if (s->isa == 2) s->sink ^= s->streams > 1 ? read_streams(s->p, s->n) : read_avx512(s->p, s->n);
        else if (s->isa == 1) s->sink ^= s->streams > 1 ? read_streams_avx2(s->p, s->n) : read_avx2(s->p, s->n);
        else s->sink ^= read_plain(s->p, s->n);
#else
        s->sink ^= read_plain(s->p, s->n);
#endif
        pthread_barrier_wait(s->bar);
        if (s->secs) s->secs[r] = now() - t0;
    }
    return NULL;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* GB/s of `threads` threads reading `bytes`, best and median over reps */
static void measure(const uint64_t *buf, size_t bytes, int threads, int reps, int isa, int streams, double *best,
                    double *med) {
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, (unsigned)threads);
    struct share *sh = calloc((size_t)threads, sizeof *sh);
    pthread_t *tid = calloc((size_t)threads, sizeof *tid);
    double *secs = calloc((size_t)reps, sizeof *secs);
    if (!sh || !tid || !secs) { fprintf(stderr, "membw: out of memory\n"); exit(1); }
    size_t words = bytes / 8, per = (words / (size_t)threads) & ~(size_t)31;
    for (int t = 0; t < threads; t++) {
        sh[t] = (struct share){buf + per * (size_t)t, t == threads - 1 ? words - per * (size_t)t : per, 0, &bar, reps,
                               t == 0 ? secs : NULL, isa, streams};
        if (t > 0) pthread_create(&tid[t], NULL, worker, &sh[t]);
    }
    worker(&sh[0]);
    uint64_t sink = 0;
    for (int t = 1; t < threads; t++) pthread_join(tid[t], NULL);
    for (int t = 0; t < threads; t++) sink ^= sh[t].sink;
    qsort(secs, (size_t)reps, sizeof *secs, cmp_double);
    *best = (double)bytes / secs[0] * 1e-9;
    *med = (double)bytes / secs[reps / 2] * 1e-9;
    if (sink == 42) fputc(' ', stderr); /* keep the reads */
    pthread_barrier_destroy(&bar);
    free(sh); free(tid); free(secs);
}

int main(int argc, char **argv) {
    int threads = (int)sysconf(_SC_NPROCESSORS_ONLN), reps = 10;
    size_t mib = 1024;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--mib") && i + 1 < argc) mib = (size_t)atol(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else { fprintf(stderr, "usage: %s [--threads N] [--mib SIZE] [--reps R]\n", argv[0]); return 2; }
    }
    if (threads < 1 || reps < 1 || mib < 1) { fprintf(stderr, "membw: bad argument\n"); return 2; }
    size_t bytes = mib << 20;
    uint64_t *buf = aligned_alloc(4096, bytes);
    if (!buf) { fprintf(stderr, "membw: cannot allocate %zu MiB\n", mib); return 1; }
    for (size_t i = 0; i < bytes / 8; i++) buf[i] = i * 0x9e3779b97f4a7c15ull; /* fault in every page */
    int isa = 0;
#if defined(__x86_64__)
    __builtin_cpu_init();
    isa = __builtin_cpu_supports("avx512f") && !getenv("CS_NO_AVX512") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
#endif
    double best[2], med[2], best1, med1;
    for (int k = 0; k < 2; k++) measure(buf, bytes, threads, reps, isa, k ? 8 : 1, &best[k], &med[k]);
    measure(buf, bytes, 1, reps, isa, isa ? 8 : 1, &best1, &med1);
    int b = isa && best[1] > best[0];
    printf("{\"benchmark\": \"membw\", \"threads\": %d, \"mib\": %zu, \"reps\": %d, \"loads\": \"%s\", "
           "\"read_gb_s_best\": %.2f, \"read_gb_s_median\": %.2f, "
           "\"one_stream_gb_s_best\": %.2f, \"eight_streams_gb_s_best\": %.2f, "
           "\"one_thread_gb_s_best\": %.2f, \"one_thread_gb_s_median\": %.2f}\n",
           threads, mib, reps, isa == 2 ? "avx512" : isa ? "avx2" : "scalar", best[b], med[b], best[0], isa ? best[1] : 0.0, best1,
           med1);
    free(buf);
    return 0;
}
