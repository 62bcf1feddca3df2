/* kernels_lora.c: the few-row LoRA kernels (decode), on F32 or BF16 adapter weights, in
 * three widths: plain C, AVX2+FMA (8 lanes) and AVX-512 (16 lanes). BF16 is widened in
 * registers (a shift), so a BF16 adapter streams half the bytes of an F32 one for the same
 * math. Every output element is computed the same way whatever the batch around it (one dot
 * per element; lanes accumulate in a fixed order), which keeps them batch-invariant. Tails
 * use fmaf in the same order as a lane, so a column gives the same bits on either side of a
 * vector boundary. Tested against cs_lora_ref (tests/test_backend_ops.c). */
#include <immintrin.h>
#include <math.h>

#include <stdio.h>
#include <string.h>

#include "cpu_kernels/kernels.h"
#include "cpu_kernels/simd.h"

#define AVX2 __attribute__((target("avx2,fma")))
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define INLINE static inline __attribute__((always_inline))

int cs_cpu_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

void cs_cpu_name(char *buf, size_t len) {
    snprintf(buf, len, "?");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return;
    char line[1024];
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "model name", 10) && strchr(line, ':')) {
            snprintf(buf, len, "%s", strchr(line, ':') + 2);
            buf[strcspn(buf, "\n")] = 0;
            break;
        }
    fclose(f);
}

static inline float w_at(const void *w, cs_dtype dt, size_t i) {
    return dt == CS_DTYPE_BF16 ? cs_bf16_to_f32(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

/* ---- dot(x, w[0 .. n)) ---- */
/* eight partial sums: shorter rounding chains than one running sum, and vectorisable */
static float dot_plain(const float *x, const void *w, cs_dtype dt, int n) {
    float acc[8] = {0};
    int e = 0;
    for (; e + 8 <= n; e += 8)
        for (int k = 0; k < 8; k++) acc[k] += x[e + k] * w_at(w, dt, (size_t)(e + k));
    float d = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; e < n; e++) d += x[e] * w_at(w, dt, (size_t)e);
    return d;
}

AVX2 INLINE __m256 load8(const void *w, cs_dtype dt, size_t i) {
    if (dt == CS_DTYPE_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)w + i);
}

AVX2 static float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

AVX2 static float dot_avx2(const float *x, const void *w, cs_dtype dt, int n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int e = 0;
    for (; e + 16 <= n; e += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + e), load8(w, dt, (size_t)e), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + e + 8), load8(w, dt, (size_t)e + 8), a1);
    }
    for (; e + 8 <= n; e += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + e), load8(w, dt, (size_t)e), a0);
    float d = hsum8(_mm256_add_ps(a0, a1)), t = 0;
    for (; e < n; e++) t = fmaf(x[e], w_at(w, dt, (size_t)e), t);
    return d + t;
}

AVX512 INLINE __m512 load16(const void *w, cs_dtype dt, size_t i) {
    if (dt == CS_DTYPE_BF16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)w + i);
}

AVX512 INLINE __m512 load16_masked(const void *w, cs_dtype dt, size_t i, __mmask16 m) {
    if (dt == CS_DTYPE_BF16) {
        __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)w + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(m, (const float *)w + i);
}

/* four accumulators (one FMA chain over a 1024-column row waited on each FMA's latency),
 * added in a fixed order: a row's dot does not depend on anything beside it */
AVX512 static float dot_avx512(const float *x, const void *w, cs_dtype dt, int n) {
    __m512 acc = _mm512_setzero_ps(), a1 = acc, a2 = acc, a3 = acc;
    int e = 0;
    for (; e + 64 <= n; e += 64) {
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + e), load16(w, dt, (size_t)e), acc);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + e + 16), load16(w, dt, (size_t)e + 16), a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(x + e + 32), load16(w, dt, (size_t)e + 32), a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(x + e + 48), load16(w, dt, (size_t)e + 48), a3);
    }
    acc = _mm512_add_ps(_mm512_add_ps(acc, a1), _mm512_add_ps(a2, a3));
    for (; e + 16 <= n; e += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + e), load16(w, dt, (size_t)e), acc);
    if (e < n) {
        __mmask16 m = (__mmask16)((1u << (n - e)) - 1);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + e), load16_masked(w, dt, (size_t)e, m), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

float cs_lora_dot(const float *x, const void *w, cs_dtype dt, int n, cs_isa isa) {
    switch (isa) {
    case CS_ISA_AVX512: return dot_avx512(x, w, dt, n);
    case CS_ISA_AVX2: return dot_avx2(x, w, dt, n);
    default: return dot_plain(x, w, dt, n);
    }
}

/* ---- y[i, c0:c1] += scale · Σ_r t[i, r] · bt[r, c0:c1], i < n ≤ CS_LORA_SMALL_M ---- */
/* one column, as a lane computes it */
static inline void expand_col(float *y, int ld_y, const float *t, int ld_t, int n, const void *bt, cs_dtype dt,
                              int rank, int c, float scale) {
    for (int i = 0; i < n; i++) {
        float acc = 0;
        for (int r = 0; r < rank; r++) acc = fmaf(t[(size_t)i * ld_t + r], w_at(bt, dt, (size_t)r * ld_y + c), acc);
        y[(size_t)i * ld_y + c] = fmaf(scale, acc, y[(size_t)i * ld_y + c]);
    }
}

static void expand_plain(float *y, int ld_y, const float *t, int ld_t, int n, const void *bt, cs_dtype dt, int rank,
                         int c0, int c1, float scale) {
    for (int c = c0; c < c1; c++) expand_col(y, ld_y, t, ld_t, n, bt, dt, rank, c, scale);
}

AVX2 static void expand_avx2(float *y, int ld_y, const float *t, int ld_t, int n, const void *bt, cs_dtype dt,
                             int rank, int c0, int c1, float scale) {
    __m256 vs = _mm256_set1_ps(scale);
    int c = c0;
    if (n == 1) { /* decode: four column groups at once, four independent FMA chains */
        for (; c + 32 <= c1; c += 32) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int r = 0; r < rank; r++) {
                __m256 tr = _mm256_set1_ps(t[r]);
                size_t o = (size_t)r * ld_y + c;
                a0 = _mm256_fmadd_ps(tr, load8(bt, dt, o), a0);
                a1 = _mm256_fmadd_ps(tr, load8(bt, dt, o + 8), a1);
                a2 = _mm256_fmadd_ps(tr, load8(bt, dt, o + 16), a2);
                a3 = _mm256_fmadd_ps(tr, load8(bt, dt, o + 24), a3);
            }
            _mm256_storeu_ps(y + c, _mm256_fmadd_ps(vs, a0, _mm256_loadu_ps(y + c)));
            _mm256_storeu_ps(y + c + 8, _mm256_fmadd_ps(vs, a1, _mm256_loadu_ps(y + c + 8)));
            _mm256_storeu_ps(y + c + 16, _mm256_fmadd_ps(vs, a2, _mm256_loadu_ps(y + c + 16)));
            _mm256_storeu_ps(y + c + 24, _mm256_fmadd_ps(vs, a3, _mm256_loadu_ps(y + c + 24)));
        }
    }
    for (; c + 8 <= c1; c += 8) {
        __m256 acc[CS_LORA_SMALL_M];
        for (int i = 0; i < n; i++) acc[i] = _mm256_setzero_ps();
        for (int r = 0; r < rank; r++) {
            __m256 b = load8(bt, dt, (size_t)r * ld_y + c);
            for (int i = 0; i < n; i++) acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(t[(size_t)i * ld_t + r]), b, acc[i]);
        }
        for (int i = 0; i < n; i++) {
            float *yi = y + (size_t)i * ld_y + c;
            _mm256_storeu_ps(yi, _mm256_fmadd_ps(vs, acc[i], _mm256_loadu_ps(yi)));
        }
    }
    for (; c < c1; c++) expand_col(y, ld_y, t, ld_t, n, bt, dt, rank, c, scale);
}

AVX512 static void expand_avx512(float *y, int ld_y, const float *t, int ld_t, int n, const void *bt, cs_dtype dt,
                                 int rank, int c0, int c1, float scale) {
    __m512 vs = _mm512_set1_ps(scale);
    int c = c0;
    if (n == 1) { /* decode: four column groups at once, four independent FMA chains (each
                   * column's sum is the same chain as below) */
        for (; c + 64 <= c1; c += 64) {
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int r = 0; r < rank; r++) {
                __m512 tr = _mm512_set1_ps(t[r]);
                size_t o = (size_t)r * ld_y + c;
                a0 = _mm512_fmadd_ps(tr, load16(bt, dt, o), a0);
                a1 = _mm512_fmadd_ps(tr, load16(bt, dt, o + 16), a1);
                a2 = _mm512_fmadd_ps(tr, load16(bt, dt, o + 32), a2);
                a3 = _mm512_fmadd_ps(tr, load16(bt, dt, o + 48), a3);
            }
            _mm512_storeu_ps(y + c, _mm512_fmadd_ps(vs, a0, _mm512_loadu_ps(y + c)));
            _mm512_storeu_ps(y + c + 16, _mm512_fmadd_ps(vs, a1, _mm512_loadu_ps(y + c + 16)));
            _mm512_storeu_ps(y + c + 32, _mm512_fmadd_ps(vs, a2, _mm512_loadu_ps(y + c + 32)));
            _mm512_storeu_ps(y + c + 48, _mm512_fmadd_ps(vs, a3, _mm512_loadu_ps(y + c + 48)));
        }
    }
    for (; c < c1; c += 16) {
        __mmask16 m = c + 16 <= c1 ? (__mmask16)0xffff : (__mmask16)((1u << (c1 - c)) - 1);
        __m512 acc[CS_LORA_SMALL_M];
        for (int i = 0; i < n; i++) acc[i] = _mm512_setzero_ps();
        for (int r = 0; r < rank; r++) {
            __m512 b = load16_masked(bt, dt, (size_t)r * ld_y + c, m);
            for (int i = 0; i < n; i++) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(t[(size_t)i * ld_t + r]), b, acc[i]);
        }
        for (int i = 0; i < n; i++) {
            float *yi = y + (size_t)i * ld_y + c;
            _mm512_mask_storeu_ps(yi, m, _mm512_fmadd_ps(vs, acc[i], _mm512_maskz_loadu_ps(m, yi)));
        }
    }
}

/* y[i, c] += scale · dot(t[i, :rank], b[c, :rank]) for c in [c0, c1), rank a multiple of 16:
 * B's rows read in order, one stream (Bᵀ's rows, read a column group at a time, are rank
 * streams of 128 bytes a visit, which the prefetchers do not run ahead of: 1.45x the time
 * for the same bytes), each output's products in one vector (a chain of FMAs over rank / 16
 * steps), 16 outputs summed at once by cs_reduce16_avx512's tree. Each y[i, c] is the same
 * sequence whatever n and c's place. */
AVX512 static void expand_b_avx512(float *y, int ld_y, const float *t, int ld_t, int n, const void *b, cs_dtype dt,
                                   int rank, int c0, int c1, float scale) {
    __m512 vs = _mm512_set1_ps(scale);
    for (int c = c0; c < c1; c += 16) {
        int m = c1 - c < 16 ? c1 - c : 16;
        __mmask16 mk = (__mmask16)((1u << m) - 1);
        for (int i = 0; i < n; i++) {
            const float *ti = t + (size_t)i * ld_t;
            __m512 acc[16];
#pragma GCC unroll 16
            for (int o = 0; o < 16; o++) {
                if (o >= m) { acc[o] = _mm512_setzero_ps(); continue; }
                size_t row = (size_t)(c + o) * rank;
                acc[o] = _mm512_mul_ps(_mm512_loadu_ps(ti), load16(b, dt, row));
                for (int j = 16; j < rank; j += 16) acc[o] = _mm512_fmadd_ps(_mm512_loadu_ps(ti + j), load16(b, dt, row + j), acc[o]);
            }
            float *yi = y + (size_t)i * ld_y + c;
            _mm512_mask_storeu_ps(yi, mk, _mm512_fmadd_ps(vs, cs_reduce16_avx512(acc), _mm512_maskz_loadu_ps(mk, yi)));
        }
    }
}

/* rank 16, BF16: one 64-byte load holds two outputs' rows of B (16 BF16 each), widened by a
 * shift (the even ranks) and a mask (the odd ranks) against t's even and odd elements, so
 * each half of a product vector is one output's 8 partial sums. The 16 outputs of 8 such
 * vectors are summed by one tree within the halves (lane l with l+4, then l+2, l+1: the same
 * pairing for every output, so still batch-invariant), half the loads and fewer than half
 * the shuffles of expand_b_avx512's. */
AVX512 static void expand_b16_avx512(float *y, int ld_y, const float *t, int ld_t, int n, const uint16_t *b, int c0,
                                     int c1, float scale) {
    const __m512 vs = _mm512_set1_ps(scale);
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14);
    const __m512i io = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 1, 3, 5, 7, 9, 11, 13, 15);
    /* the tree leaves output 4e + q in lane 4q + e */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    __m512 te[CS_LORA_SMALL_M], to[CS_LORA_SMALL_M]; /* each row's even and odd ranks, twice over */
    for (int i = 0; i < n; i++) {
        __m512 ti = _mm512_loadu_ps(t + (size_t)i * ld_t);
        te[i] = _mm512_permutexvar_ps(ie, ti);
        to[i] = _mm512_permutexvar_ps(io, ti);
    }
    for (int c = c0; c < c1; c += 16) {
        int m = c1 - c < 16 ? c1 - c : 16;
        __mmask16 mk = (__mmask16)((1u << m) - 1);
        __m512i w[8];
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) { /* rows c + 2j, c + 2j + 1; zero past c1 */
            int e = (m - 2 * j) * 16;
            if (e >= 32) w[j] = _mm512_loadu_si512(b + (size_t)(c + 2 * j) * 16);
            else if (e > 0) w[j] = _mm512_maskz_loadu_epi16((__mmask32)((1ull << e) - 1), b + (size_t)(c + 2 * j) * 16);
            else w[j] = _mm512_setzero_si512();
        }
        for (int i = 0; i < n; i++) {
            __m512 p[8];
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++)
                p[j] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(w[j], hi)), to[i],
                                       _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(w[j], 16)), te[i]));
            __m512 r = cs_reduce16_tail_avx512(p); /* lane l + l+4 of each half, then l+2, l+1 */
            float *yi = y + (size_t)i * ld_y + c;
            _mm512_mask_storeu_ps(yi, mk, _mm512_fmadd_ps(vs, _mm512_permutexvar_ps(order, r), _mm512_maskz_loadu_ps(mk, yi)));
        }
    }
}

/* the same in 8 lanes: rank a multiple of 8, 8 outputs a tree */
AVX2 static void expand_b_avx2(float *y, int ld_y, const float *t, int ld_t, int n, const void *b, cs_dtype dt, int rank,
                               int c0, int c1, float scale) {
    __m256 vs = _mm256_set1_ps(scale);
    for (int c = c0; c < c1; c += 8) {
        int m = c1 - c < 8 ? c1 - c : 8;
        for (int i = 0; i < n; i++) {
            const float *ti = t + (size_t)i * ld_t;
            __m256 acc[8];
#pragma GCC unroll 8
            for (int o = 0; o < 8; o++) {
                if (o >= m) { acc[o] = _mm256_setzero_ps(); continue; }
                size_t row = (size_t)(c + o) * rank;
                acc[o] = _mm256_mul_ps(_mm256_loadu_ps(ti), load8(b, dt, row));
                for (int j = 8; j < rank; j += 8) acc[o] = _mm256_fmadd_ps(_mm256_loadu_ps(ti + j), load8(b, dt, row + j), acc[o]);
            }
            float *yi = y + (size_t)i * ld_y + c;
            if (m == 8) {
                _mm256_storeu_ps(yi, _mm256_fmadd_ps(vs, cs_reduce8_avx2(acc), _mm256_loadu_ps(yi)));
            } else { /* fmaf rounds once, as the lanes' FMA does */
                __attribute__((aligned(32))) float sum[8];
                _mm256_store_ps(sum, cs_reduce8_avx2(acc));
                for (int o = 0; o < m; o++) yi[o] = fmaf(scale, sum[o], yi[o]);
            }
        }
    }
}

bool cs_lora_expand_b_fits(int rank, cs_isa isa) {
    return isa == CS_ISA_AVX512 ? rank % 16 == 0 : isa == CS_ISA_AVX2 && rank % 8 == 0;
}

void cs_lora_expand_b(float *y, int ld_y, const float *t, int ld_t, int n, const void *b, cs_dtype dt, int rank, int c0,
                      int c1, float scale, cs_isa isa) {
    CS_ASSERT(n <= CS_LORA_SMALL_M && cs_lora_expand_b_fits(rank, isa));
    if (isa == CS_ISA_AVX512 && rank == 16 && dt == CS_DTYPE_BF16)
        expand_b16_avx512(y, ld_y, t, ld_t, n, b, c0, c1, scale);
    else if (isa == CS_ISA_AVX512) expand_b_avx512(y, ld_y, t, ld_t, n, b, dt, rank, c0, c1, scale);
    else expand_b_avx2(y, ld_y, t, ld_t, n, b, dt, rank, c0, c1, scale);
}

void cs_lora_expand_bt(float *y, int ld_y, const float *t, int ld_t, int n, const void *bt, cs_dtype dt, int rank,
                       int c0, int c1, float scale, cs_isa isa) {
    CS_ASSERT(n <= CS_LORA_SMALL_M);
    switch (isa) {
    case CS_ISA_AVX512: expand_avx512(y, ld_y, t, ld_t, n, bt, dt, rank, c0, c1, scale); break;
    case CS_ISA_AVX2: expand_avx2(y, ld_y, t, ld_t, n, bt, dt, rank, c0, c1, scale); break;
    default: expand_plain(y, ld_y, t, ld_t, n, bt, dt, rank, c0, c1, scale); break;
    }
}
