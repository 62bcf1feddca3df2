/* kernels_avx512.c: AVX-512 fast paths of the CPU backend. Weights stay in their file
 * dtype (BF16/F16/F32) and are widened to F32 in registers; accumulation is F32 with
 * independent accumulators. Compiled with target attributes, called only after
 * cs_cpu_has_avx512(); each has a reference in kernels_ref.c it is tested against. */
#include <immintrin.h>
#include <math.h>

#include "cpu_kernels/kernels.h"
#include "cpu_kernels/simd.h"
#include "cpu_kernels/vnni.h"
#include "cpu_kernels/wcode.h"

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))

int cs_cpu_has_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

AVX512 INLINE __m512 load16(const void *base, size_t i, cs_dtype dt) {
    if (dt == CS_DTYPE_BF16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    if (dt == CS_DTYPE_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i)));
    return _mm512_loadu_ps((const float *)base + i);
}

INLINE float scalar_at(const void *base, size_t i, cs_dtype dt) {
    if (dt == CS_DTYPE_BF16) return cs_bf16_to_f32(((const uint16_t *)base)[i]);
    if (dt == CS_DTYPE_F16) return cs_f16_to_f32(((const uint16_t *)base)[i]);
    return ((const float *)base)[i];
}

/* four rows at a time against one x vector */
AVX512 INLINE void gemv_impl(float *y, int ldy, const float *x, int n, const void *w, int cols, int r0, int r1,
                             cs_dtype dt) {
    int c16 = cols & ~15;
    for (int i = 0; i < n; i++) {
        const float *xi = x + (size_t)i * cols;
        float *yi = y + (size_t)i * ldy;
        int r = r0;
        for (; r + 4 <= r1; r += 4) {
            size_t b0 = (size_t)r * cols, b1 = b0 + cols, b2 = b1 + cols, b3 = b2 + cols;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int c = 0; c < c16; c += 16) {
                __m512 xv = _mm512_loadu_ps(xi + c);
                a0 = _mm512_fmadd_ps(load16(w, b0 + c, dt), xv, a0);
                a1 = _mm512_fmadd_ps(load16(w, b1 + c, dt), xv, a1);
                a2 = _mm512_fmadd_ps(load16(w, b2 + c, dt), xv, a2);
                a3 = _mm512_fmadd_ps(load16(w, b3 + c, dt), xv, a3);
            }
            float s0 = _mm512_reduce_add_ps(a0), s1 = _mm512_reduce_add_ps(a1);
            float s2 = _mm512_reduce_add_ps(a2), s3 = _mm512_reduce_add_ps(a3);
            for (int c = c16; c < cols; c++) {
                s0 += scalar_at(w, b0 + c, dt) * xi[c];
                s1 += scalar_at(w, b1 + c, dt) * xi[c];
                s2 += scalar_at(w, b2 + c, dt) * xi[c];
                s3 += scalar_at(w, b3 + c, dt) * xi[c];
            }
            yi[r] = s0; yi[r + 1] = s1; yi[r + 2] = s2; yi[r + 3] = s3;
        }
        for (; r < r1; r++) {
            size_t b0 = (size_t)r * cols;
            __m512 a0 = _mm512_setzero_ps();
            for (int c = 0; c < c16; c += 16) a0 = _mm512_fmadd_ps(load16(w, b0 + c, dt), _mm512_loadu_ps(xi + c), a0);
            float s0 = _mm512_reduce_add_ps(a0);
            for (int c = c16; c < cols; c++) s0 += scalar_at(w, b0 + c, dt) * xi[c];
            yi[r] = s0;
        }
    }
}

/* n in 2..4: each weight row is read once for all x vectors */
AVX512 INLINE void gemv_multi_impl(float *y, int ldy, const float *x, int n, const void *w, int cols, int r0,
                                   int r1, cs_dtype dt) {
    int c16 = cols & ~15;
    for (int r = r0; r < r1; r++) {
        size_t b = (size_t)r * cols;
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int c = 0; c < c16; c += 16) {
            __m512 wv = load16(w, b + c, dt);
            for (int i = 0; i < n; i++) acc[i] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + (size_t)i * cols + c), acc[i]);
        }
        for (int i = 0; i < n; i++) {
            float s = _mm512_reduce_add_ps(acc[i]);
            for (int c = c16; c < cols; c++) s += scalar_at(w, b + c, dt) * x[(size_t)i * cols + c];
            y[(size_t)i * ldy + r] = s;
        }
    }
}

/* One x vector against BF16 rows, memory-bound: S rows at a time taken from S separate
 * stretches of [r0, r1), so the loads form that many sequential streams (one stream per
 * thread leaves DRAM bandwidth unused on some CPUs), each prefetched PF bytes ahead. A
 * 64-byte load holds 32 bf16; their even and odd elements become F32 by a shift and a mask
 * and meet x's even and odd elements. Two tunings, picked per CPU at start-up
 * (cpu_backend.c): 8 streams 1024 bytes ahead (measured on an Intel Xeon with AMX), and 4
 * streams 512 bytes ahead, which reads 1.14-1.32x faster than the first on an AMD EPYC
 * (Zen 4) and matches a plain read of the same bytes there (bench/kernelbench's
 * gemv_paired, bench/results/kernels-*.json). */
AVX512 INLINE __m512 bf16_even(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
AVX512 INLINE __m512 bf16_odd(__m512i v) {
    return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
}

AVX512 INLINE void gemv_bf16_streams(float *y, const float *x, const uint16_t *w, int cols, int r0, int r1, const int S,
                                     const int PF) {
    const __m512i ev = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i od = _mm512_add_epi32(ev, _mm512_set1_epi32(1));
    int c32 = cols & ~31, tail = cols - c32;
    __mmask32 tm = (__mmask32)((1ull << tail) - 1);
    __mmask16 t0 = (__mmask16)(tail >= 16 ? 0xffff : (1u << tail) - 1);
    __mmask16 t1 = (__mmask16)(tail > 16 ? (1u << (tail - 16)) - 1 : 0);
    int per = (r1 - r0) / S;
    size_t stride = (size_t)per * cols; /* between streams, in bf16 */
    for (int g = 0; g < per; g++) {
        const uint16_t *p = w + (size_t)(r0 + g) * cols;
        __m512 acc[8];
#pragma GCC unroll 8
        for (int s = 0; s < S; s++) acc[s] = _mm512_setzero_ps();
        for (int c = 0; c < c32; c += 32) {
            __m512 x0 = _mm512_loadu_ps(x + c), x1 = _mm512_loadu_ps(x + c + 16);
            __m512 xe = _mm512_permutex2var_ps(x0, ev, x1), xo = _mm512_permutex2var_ps(x0, od, x1);
#pragma GCC unroll 8
            for (int s = 0; s < S; s++) {
                _mm_prefetch((const char *)(p + s * stride + c) + PF, _MM_HINT_T0);
                __m512i v = _mm512_loadu_si512(p + s * stride + c);
                acc[s] = _mm512_fmadd_ps(bf16_even(v), xe, acc[s]);
                acc[s] = _mm512_fmadd_ps(bf16_odd(v), xo, acc[s]);
            }
        }
        if (tail) {
            __m512 x0 = _mm512_maskz_loadu_ps(t0, x + c32), x1 = _mm512_maskz_loadu_ps(t1, x + c32 + 16);
            __m512 xe = _mm512_permutex2var_ps(x0, ev, x1), xo = _mm512_permutex2var_ps(x0, od, x1);
#pragma GCC unroll 8
            for (int s = 0; s < S; s++) {
                __m512i v = _mm512_maskz_loadu_epi16(tm, p + s * stride + c32);
                acc[s] = _mm512_fmadd_ps(bf16_even(v), xe, acc[s]);
                acc[s] = _mm512_fmadd_ps(bf16_odd(v), xo, acc[s]);
            }
        }
#pragma GCC unroll 8
        for (int s = 0; s < S; s++) y[r0 + s * per + g] = _mm512_reduce_add_ps(acc[s]);
    }
    /* the rows left over: a plain one-row loop */
    if (per * S < r1 - r0) gemv_impl(y, 0, x, 1, w, cols, r0 + per * S, r1, CS_DTYPE_BF16);
}

/* the vector operations of kernels_simd.h's shared loops, in 16 lanes */
typedef __m512 vf_t;
#define VF_LANES 16
AVX512 INLINE vf_t vf_zero(void) { return _mm512_setzero_ps(); }
AVX512 INLINE vf_t vf_add(vf_t a, vf_t b) { return _mm512_add_ps(a, b); }
AVX512 INLINE vf_t vf_fmadd(vf_t a, vf_t b, vf_t c) { return _mm512_fmadd_ps(a, b, c); }
AVX512 INLINE vf_t vf_bcast(const float *p) { return _mm512_set1_ps(*p); }
AVX512 INLINE vf_t vf_load(const float *p) { return _mm512_load_ps(p); }
AVX512 INLINE float vf_hsum(vf_t v) { return _mm512_reduce_add_ps(v); }

/* ---- the batch-1 GEMV on 12-bit coded BF16 weights (wcode.h) ----
 * A block's 64 low bytes and 32 code bytes become four F32 vectors: the codes' nibbles go
 * through the table by one byte shuffle, the byte unpacks pair each low byte with its high
 * byte, and the word unpacks with zero place the pairs at the top of F32 lanes. The column
 * order of the format makes vector m columns 16m .. 16m + 15. Exceptions are added after
 * the row's sum. Streams as gemv_bf16_streams, each prefetched PF bytes ahead in both its
 * low bytes and its codes (0: no software prefetch). Where the BF16 GEMV reads 4 streams
 * (AMD), this one reads 2, 384 bytes ahead: 1.33-1.37x the BF16 GEMV's speed in three
 * kernelbench runs on an AMD EPYC (Zen 4), 2 threads, against 1.15-1.29x for 4 streams
 * without prefetch and 1.23-1.29x for 2 streams 768 ahead (1 thread: 1.39-1.51x against
 * 1.13-1.36x); elsewhere 8 streams 1536 bytes ahead, as the BF16 GEMV's wide tuning (not
 * measured on an Intel CPU). */
typedef __m512i wcode_tbl_t;
AVX512 INLINE wcode_tbl_t wcode_table(const cs_wcode_t *c) {
    return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)c->table));
}

AVX512 INLINE void wcode_block(const uint8_t *lo_p, const uint8_t *code_p, __m512i tbl, __m512 f[4]) {
    const __m256i m0f = _mm256_set1_epi8(0x0f);
    __m512i lo = _mm512_loadu_si512(lo_p);
    __m256i nb = _mm256_loadu_si256((const __m256i *)code_p);
    __m512i codes = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(nb, m0f)),
                                       _mm256_and_si256(_mm256_srli_epi16(nb, 4), m0f), 1);
    __m512i hi = _mm512_shuffle_epi8(tbl, codes);
    __m512i u0 = _mm512_unpacklo_epi8(lo, hi), u1 = _mm512_unpackhi_epi8(lo, hi), z = _mm512_setzero_si512();
    f[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, u0));
    f[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, u0));
    f[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, u1));
    f[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, u1));
}

/* block b of a row times x's block xb: a0 takes vectors 0 and 2, a1 1 and 3 */
AVX512 INLINE void wcode_fma2(const uint8_t *row, int b, __m512i tbl, const float *xb, __m512 *a0, __m512 *a1) {
    __m512 f[4];
    wcode_block(row + cs_wcode_lo_at(b), row + cs_wcode_codes_at(b), tbl, f);
    *a0 = _mm512_fmadd_ps(f[0], _mm512_loadu_ps(xb), *a0);
    *a1 = _mm512_fmadd_ps(f[1], _mm512_loadu_ps(xb + 16), *a1);
    *a0 = _mm512_fmadd_ps(f[2], _mm512_loadu_ps(xb + 32), *a0);
    *a1 = _mm512_fmadd_ps(f[3], _mm512_loadu_ps(xb + 48), *a1);
}

/* the same for NX rows of x, one accumulator each */
AVX512 INLINE void wcode_fma_n(const uint8_t *row, int b, __m512i tbl, const float *const *xb, __m512 *a, const int NX) {
    __m512 f[4];
    wcode_block(row + cs_wcode_lo_at(b), row + cs_wcode_codes_at(b), tbl, f);
#pragma GCC unroll 4
    for (int i = 0; i < NX; i++)
#pragma GCC unroll 4
        for (int m = 0; m < 4; m++) a[i] = _mm512_fmadd_ps(f[m], _mm512_loadu_ps(xb[i] + 16 * m), a[i]);
}

/* ---- packed GEMM (prefill) ----
 * y = x · Wᵀ in F32 FMAs for many rows of x: the task's weight rows are widened once into
 * panels of 32 rows, k-major (panel[k][0..32), 128 bytes per k, zero past the last row), then
 * a 12 × 32 register tile (24 accumulators) runs over all of K for each 12 rows of x,
 * broadcasting x from its packed copy (12 rows interleaved: xp[tile][k][12], packed once
 * per matmul) and loading two vectors of the panel per k, K in chunks of PK_KC. Every
 * y[i, r] is a sum, in order, of F32 FMA chains over the chunks (as a blocked BLAS
 * computes it). */
#define PK_MR 12
#define PK_NR 32
#define PK_KC 128 /* columns of K per pass: the panel's chunk (16 KiB) stays in L1 while every
                   * tile of x passes, and each sum is a chain of at most 128 FMAs added into y
                   * chunk by chunk (one chain over all of K loses accuracy as K grows: the real
                   * SmolLM2 weights' logprobs moved from 6.5e-5 to 1.2e-4 off float64) */
AVX512 INLINE void packed_panel(float *dst, const void *w, int cols, int r0, int nrows, cs_dtype dt);
AVX512 static void packed_rows(float *y, int ldy, const float *xt, int k0, int k1, const float *panel, int m, int cols);

/* the shared loops, compiled for this file's ISA */
#define KS_TARGET AVX512
#include "cpu_kernels/kernels_simd.h"

AVX512 void cs_wcode_gemv_avx512(float *y, const float *x, const cs_wcode_t *c, int r0, int r1, int streams) {
    wcode_gemv(y, x, c, r0, r1, streams, 8, 1536);
}

AVX512 void cs_wcode_rows_avx512(float *y, int ldy, const float *x, int n, const cs_wcode_t *c, int r0, int r1,
                                 int streams) {
    if (n == 1) cs_wcode_gemv_avx512(y, x, c, r0, r1, streams);
    else wcode_rows_n(y, ldy, x, n, c, r0, r1);
}

/* rows back to BF16 (wcode.h: cs_wcode_decode_rows_ref): a block's byte unpacks give the
 * words of positions 16L .. 16L + 7 (low) and 16L + 8 .. 16L + 15 (high) in 128-bit lane L,
 * i.e. columns 16m + 4L + e at word 8L + 4m + e (m < 2, and m - 2 for the high); one word
 * permutation puts each half in column order */
AVX512 void cs_wcode_decode_rows_avx512(uint16_t *dst, const cs_wcode_t *c, int r0, int r1) {
    const __m256i m0f = _mm256_set1_epi8(0x0f);
    __m512i tbl = wcode_table(c);
    uint16_t ix[32];
    for (int j = 0; j < 32; j++) ix[j] = (uint16_t)(8 * ((j >> 2) & 3) + 4 * (j >> 4) + (j & 3));
    __m512i idx = _mm512_loadu_si512(ix);
    int K = c->cols, full = K / CS_WCODE_BLOCK;
    size_t rb = (size_t)c->blocks * CS_WCODE_BLOCK_BYTES;
    for (int r = r0; r < r1; r++) {
        const uint8_t *row = c->data + (size_t)r * rb;
        uint16_t *d = dst + (size_t)(r - r0) * (size_t)K;
        for (int b = 0; b * CS_WCODE_BLOCK < K; b++) {
            __m512i lo = _mm512_loadu_si512(row + cs_wcode_lo_at(b));
            __m256i nb = _mm256_loadu_si256((const __m256i *)(row + cs_wcode_codes_at(b)));
            __m512i codes = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(nb, m0f)),
                                               _mm256_and_si256(_mm256_srli_epi16(nb, 4), m0f), 1);
            __m512i hi = _mm512_shuffle_epi8(tbl, codes);
            __m512i v0 = _mm512_permutexvar_epi16(idx, _mm512_unpacklo_epi8(lo, hi));
            __m512i v1 = _mm512_permutexvar_epi16(idx, _mm512_unpackhi_epi8(lo, hi));
            uint16_t *o = d + (size_t)b * CS_WCODE_BLOCK;
            if (b < full) {
                _mm512_storeu_si512(o, v0);
                _mm512_storeu_si512(o + 32, v1);
            } else {
                int left = K - b * CS_WCODE_BLOCK; /* 1 .. 63 */
                _mm512_mask_storeu_epi16(o, left >= 32 ? 0xffffffffu : (__mmask32)((1u << left) - 1), v0);
                if (left > 32) _mm512_mask_storeu_epi16(o + 32, (__mmask32)((1u << (left - 32)) - 1), v1);
            }
        }
        cs_wcode_put_exceptions(c, r, d);
    }
}

AVX512 INLINE void gemv_rows(float *y, int ldy, const float *x, int n, const cs_weight_t *w, int r0, int r1,
                             const int S, const int PF) {
    if (w->code && n <= CS_WCODE_MAX_N) { cs_wcode_rows_avx512(y, ldy, x, n, w->code, r0, r1, S); return; }
    if (n == 1 && w->dtype == CS_DTYPE_BF16) { gemv_bf16_streams(y, x, w->data, w->cols, r0, r1, S, PF); return; }
    for (int i0 = 0; i0 < n; i0 += 4) {
        int m = n - i0 < 4 ? n - i0 : 4;
        const float *xi = x + (size_t)i0 * w->cols;
        float *yi = y + (size_t)i0 * ldy;
        if (m == 1) {
            switch (w->dtype) {
            case CS_DTYPE_BF16: gemv_impl(yi, ldy, xi, 1, w->data, w->cols, r0, r1, CS_DTYPE_BF16); break;
            case CS_DTYPE_F16: gemv_impl(yi, ldy, xi, 1, w->data, w->cols, r0, r1, CS_DTYPE_F16); break;
            default: gemv_impl(yi, ldy, xi, 1, w->data, w->cols, r0, r1, CS_DTYPE_F32); break;
            }
        } else {
            switch (w->dtype) {
            case CS_DTYPE_BF16: gemv_multi_impl(yi, ldy, xi, m, w->data, w->cols, r0, r1, CS_DTYPE_BF16); break;
            case CS_DTYPE_F16: gemv_multi_impl(yi, ldy, xi, m, w->data, w->cols, r0, r1, CS_DTYPE_F16); break;
            default: gemv_multi_impl(yi, ldy, xi, m, w->data, w->cols, r0, r1, CS_DTYPE_F32); break;
            }
        }
    }
}

AVX512 void cs_gemv_rows_avx512(float *y, int ldy, const float *x, int n, const cs_weight_t *w, int r0, int r1) {
    gemv_rows(y, ldy, x, n, w, r0, r1, 8, 1024);
}
AVX512 void cs_gemv_rows_avx512_s4(float *y, int ldy, const float *x, int n, const cs_weight_t *w, int r0, int r1) {
    gemv_rows(y, ldy, x, n, w, r0, r1, 4, 512);
}

/* ---- batch-invariant GEMM ----
 * Every element y[i, r] is made by the same operations in the same order, whatever else is
 * computed beside it: one 16-lane accumulator, FMAs over the columns in order (the last 16
 * masked, the masked lanes adding 0·0), then _mm512_reduce_add_ps. So a row's result does
 * not depend on how many rows x has, where the row sits, or which weight rows a task got:
 * a prompt gives the same bits alone, in any batch, cold or with its prefix cached.
 * Tiles of 4 x rows × 4 weight rows share their loads; edges run the same sequence with
 * fewer rows. */
AVX512 INLINE __m512 load16_masked(const void *base, size_t i, __mmask16 m, cs_dtype dt) {
    if (dt == CS_DTYPE_BF16) {
        __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)base + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    if (dt == CS_DTYPE_F16) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)base + i));
    return _mm512_maskz_loadu_ps(m, (const float *)base + i);
}

/* y[i, r] for i < M, r < R (M, R ≤ 4): x rows ldx apart, w rows at w + r · cols; pf ≥ 0: the
 * same columns of the rows from w0 + pf on (R of them) start on their way into L2 */
AVX512 INLINE void dot_tile(float *y, int ldy, const float *x, int ldx, const void *w, size_t w0, int cols, const int M,
                            const int R, cs_dtype dt, long pf) {
    size_t es = dt == CS_DTYPE_F32 ? 4 : 2;
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int i = 0; i < M; i++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) acc[i][r] = _mm512_setzero_ps();
    int c = 0;
    for (; c + 16 <= cols; c += 16) {
        __m512 wv[4];
        if (pf >= 0 && (es == 4 || (c & 31) == 0)) /* a line: 16 F32 or 32 BF16/F16 */
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                _mm_prefetch((const char *)w + (w0 + (size_t)pf + (size_t)r * cols + c) * es, _MM_HINT_T1);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) wv[r] = load16(w, w0 + (size_t)r * cols + c, dt);
#pragma GCC unroll 4
        for (int i = 0; i < M; i++) {
            __m512 xv = _mm512_loadu_ps(x + (size_t)i * ldx + c);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) acc[i][r] = _mm512_fmadd_ps(wv[r], xv, acc[i][r]);
        }
    }
    if (c < cols) {
        __mmask16 m = (__mmask16)((1u << (cols - c)) - 1);
        __m512 wv[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) wv[r] = load16_masked(w, w0 + (size_t)r * cols + c, m, dt);
#pragma GCC unroll 4
        for (int i = 0; i < M; i++) {
            __m512 xv = _mm512_maskz_loadu_ps(m, x + (size_t)i * ldx + c);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) acc[i][r] = _mm512_fmadd_ps(wv[r], xv, acc[i][r]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < M; i++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) y[(size_t)i * ldy + r] = _mm512_reduce_add_ps(acc[i][r]);
}

#define INV_ROW_BLOCK 8 /* weight rows kept in cache while all of x passes */

/* the first tiles of x start the rows two blocks ahead on their way into L2 (as the split
 * tiles do: 1.3-1.8x from DRAM at 4-32 rows of x) */
AVX512 INLINE void gemm_invariant_impl(float *y, int ldy, const float *x, int n, const void *w, int cols, int r0,
                                       int r1, cs_dtype dt) {
    const long ahead = 2L * INV_ROW_BLOCK * cols;
    for (int rb = r0; rb < r1; rb += INV_ROW_BLOCK) {
        int re = rb + INV_ROW_BLOCK < r1 ? rb + INV_ROW_BLOCK : r1;
        int i = 0;
        for (; i + 4 <= n; i += 4) {
            const float *xi = x + (size_t)i * cols;
            float *yi = y + (size_t)i * ldy;
            int r = rb;
            for (; r + 4 <= re; r += 4)
                dot_tile(yi + r, ldy, xi, cols, w, (size_t)r * cols, cols, 4, 4, dt,
                         i == 0 && r + 2 * INV_ROW_BLOCK + 4 <= r1 ? ahead : -1);
            for (; r < re; r++) dot_tile(yi + r, ldy, xi, cols, w, (size_t)r * cols, cols, 4, 1, dt, -1);
        }
        for (; i < n; i++) {
            const float *xi = x + (size_t)i * cols;
            float *yi = y + (size_t)i * ldy;
            int r = rb;
            for (; r + 4 <= re; r += 4)
                dot_tile(yi + r, ldy, xi, cols, w, (size_t)r * cols, cols, 1, 4, dt,
                         i == 0 && r + 2 * INV_ROW_BLOCK + 4 <= r1 ? ahead : -1);
            for (; r < re; r++) dot_tile(yi + r, ldy, xi, cols, w, (size_t)r * cols, cols, 1, 1, dt, -1);
        }
    }
}

AVX512 void cs_gemm_invariant_avx512(float *y, int ldy, const float *x, int n, const cs_weight_t *w, int r0, int r1) {
    switch (w->dtype) {
    case CS_DTYPE_BF16: gemm_invariant_impl(y, ldy, x, n, w->data, w->cols, r0, r1, CS_DTYPE_BF16); break;
    case CS_DTYPE_F16: gemm_invariant_impl(y, ldy, x, n, w->data, w->cols, r0, r1, CS_DTYPE_F16); break;
    default: gemm_invariant_impl(y, ldy, x, n, w->data, w->cols, r0, r1, CS_DTYPE_F32); break;
    }
}


/* ---- the dot tiles for BF16 weights (batched decode, exact; --batch-invariant at every n) ----
 * x is packed once per matmul (cs_split_pack_x_avx512): each 32 columns of a row as their 16
 * even elements, then their 16 odd ones, zero past K. Then one 64-byte load of a weight row
 * gives its 32 BF16 as two F32 vectors with no shuffle: a shift makes the even elements, a
 * mask the odd ones, and they meet x's even and odd halves. (Widening 16 BF16 in column order
 * costs a zero-extending shuffle and a shift per 16, on the ports the FMAs share.) Tiles of 4
 * x rows × 4 weight rows, 16 accumulators; each accumulator takes, per 32 columns, the even
 * FMA then the odd one. At the end the 16 accumulators are summed into one vector by
 * cs_reduce16_avx512's transposing tree, which pairs every accumulator's lanes the same way,
 * whichever place it has in the tile and whether the tile is full or not. So each y[i, r] is
 * one fixed sequence of operations, bit-identical whatever n, i's place or [r0, r1). */
#define SPLIT_ROW_BLOCK 8 /* weight rows kept in cache while all of x passes */

size_t cs_split_xs_len(int n, int K) { return (size_t)n * (size_t)((K + CS_SPLIT_B - 1) / CS_SPLIT_B * CS_SPLIT_B); }

AVX512 void cs_split_pack_x_avx512(float *xs, const float *x, int n, int K, int i0, int i1) {
    const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i io = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    size_t kp = split_kp(K);
    (void)n;
    for (int i = i0; i < i1; i++) {
        const float *src = x + (size_t)i * K;
        float *dst = xs + (size_t)i * kp;
        for (int c = 0; c < K; c += 32) {
            int left = K - c;
            __mmask16 m0 = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
            __mmask16 m1 = left >= 32 ? 0xffff : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
            __m512 a = _mm512_maskz_loadu_ps(m0, src + c), b = _mm512_maskz_loadu_ps(m1, src + c + 16);
            _mm512_store_ps(dst + c, _mm512_permutex2var_ps(a, ie, b));
            _mm512_store_ps(dst + c + 16, _mm512_permutex2var_ps(a, io, b));
        }
    }
}

/* y[i, r] for i < M, r < R (M, R ≤ 4): packed x rows kp apart, w rows at w + r · cols */
AVX512 INLINE void split_tile(float *y, int ldy, const float *xs, size_t kp, const uint16_t *w, int cols, const int M,
                              const int R, const uint16_t *pf) {
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    __m512 acc[16];
#pragma GCC unroll 16
    for (int k = 0; k < 16; k++) acc[k] = _mm512_setzero_ps();
    for (int c = 0; c < cols; c += 32) {
        __m512 we[4], wo[4];
        if (pf)
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) _mm_prefetch((const char *)(pf + (size_t)r * cols + c), _MM_HINT_T1);
        if (c + 32 <= cols) {
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                __m512i v = _mm512_loadu_si512(w + (size_t)r * cols + c);
                we[r] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
                wo[r] = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
            }
        } else { /* the last columns: zero past the row, as x is */
            __mmask32 m = (__mmask32)((1ull << (cols - c)) - 1);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                __m512i v = _mm512_maskz_loadu_epi16(m, w + (size_t)r * cols + c);
                we[r] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
                wo[r] = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < M; i++) {
            __m512 xe = _mm512_load_ps(xs + (size_t)i * kp + c), xo = _mm512_load_ps(xs + (size_t)i * kp + c + 16);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                acc[4 * i + r] = _mm512_fmadd_ps(we[r], xe, acc[4 * i + r]);
                acc[4 * i + r] = _mm512_fmadd_ps(wo[r], xo, acc[4 * i + r]);
            }
        }
    }
    __m512 s = cs_reduce16_avx512(acc); /* lane 4i + r: y[i, r] */
    __mmask8 rm = (__mmask8)((1u << R) - 1);
    _mm_mask_storeu_ps(y, rm, _mm512_extractf32x4_ps(s, 0));
    if (M > 1) _mm_mask_storeu_ps(y + (size_t)ldy, rm, _mm512_extractf32x4_ps(s, 1));
    if (M > 2) _mm_mask_storeu_ps(y + 2 * (size_t)ldy, rm, _mm512_extractf32x4_ps(s, 2));
    if (M > 3) _mm_mask_storeu_ps(y + 3 * (size_t)ldy, rm, _mm512_extractf32x4_ps(s, 3));
}

/* the tiles of x rows [i, i + M) against weight rows [rb, re); pf: the first tiles of x
 * start the same rows of the next block (up to r1) on their way into L1 */
AVX512 INLINE void split_rows(float *y, int ldy, const float *xs, size_t kp, const uint16_t *w, int cols, int rb,
                              int re, int r1, bool pf, const int M) {
    int r = rb;
    for (; r + 4 <= re; r += 4) {
        const uint16_t *p = pf && r + 2 * SPLIT_ROW_BLOCK + 4 <= r1 ? w + (size_t)(r + 2 * SPLIT_ROW_BLOCK) * cols : NULL;
        split_tile(y + r, ldy, xs, kp, w + (size_t)r * cols, cols, M, 4, p);
    }
    switch (re - r) {
    case 3: split_tile(y + r, ldy, xs, kp, w + (size_t)r * cols, cols, M, 3, NULL); break;
    case 2: split_tile(y + r, ldy, xs, kp, w + (size_t)r * cols, cols, M, 2, NULL); break;
    case 1: split_tile(y + r, ldy, xs, kp, w + (size_t)r * cols, cols, M, 1, NULL); break;
    default: break;
    }
}

AVX512 void cs_gemm_split_avx512(float *y, int ldy, const float *xs, int n, const cs_weight_t *w, int r0, int r1) {
    const uint16_t *wd = w->data;
    int cols = w->cols;
    size_t kp = split_kp(cols);
    for (int rb = r0; rb < r1; rb += SPLIT_ROW_BLOCK) {
        int re = rb + SPLIT_ROW_BLOCK < r1 ? rb + SPLIT_ROW_BLOCK : r1;
        int i = 0;
        for (; i + 4 <= n; i += 4)
            split_rows(y + (size_t)i * ldy, ldy, xs + i * kp, kp, wd, cols, rb, re, r1, i == 0, 4);
        switch (n - i) {
        case 3: split_rows(y + (size_t)i * ldy, ldy, xs + i * kp, kp, wd, cols, rb, re, r1, i == 0, 3); break;
        case 2: split_rows(y + (size_t)i * ldy, ldy, xs + i * kp, kp, wd, cols, rb, re, r1, i == 0, 2); break;
        case 1: split_rows(y + (size_t)i * ldy, ldy, xs + i * kp, kp, wd, cols, rb, re, r1, i == 0, 1); break;
        default: break;
        }
    }
}
size_t cs_gemm_packed_wp_len(int rows, int K) { return (size_t)(rows + PK_NR - 1) / PK_NR * PK_NR * (size_t)K; }
size_t cs_gemm_packed_xp_len(int n, int K, int mr) { return (size_t)(n + mr - 1) / mr * mr * (size_t)K; }

void cs_gemm_packed_pack_x(float *xp, const float *x, int n, int K, int mr, int t0, int t1) {
    for (int t = t0; t < t1; t++) {
        float *dst = xp + (size_t)t * mr * K;
        for (int m = 0; m < mr; m++) {
            int row = t * mr + m;
            if (row >= n) {
                for (int k = 0; k < K; k++) dst[(size_t)k * mr + m] = 0;
                continue;
            }
            const float *src = x + (size_t)row * K;
            for (int k = 0; k < K; k++) dst[(size_t)k * mr + m] = src[k];
        }
    }
}

AVX512 INLINE void packed_panel(float *dst, const void *w, int cols, int r0, int nrows, cs_dtype dt) {
    /* 16 rows × 16 columns at a time, transposed in registers */
    for (int h = 0; h < 2; h++) {
        int rb = h * 16, valid = nrows - rb;
        if (valid > 16) valid = 16;
        for (int c = 0; c < cols; c += 16) {
            int cc = cols - c < 16 ? cols - c : 16;
            __mmask16 m = (__mmask16)((1u << cc) - 1);
            __m512i r[16];
            for (int i = 0; i < 16; i++)
                r[i] = i < valid ? _mm512_castps_si512(load16_masked(w, (size_t)(r0 + rb + i) * cols + c, m, dt))
                                 : _mm512_setzero_si512();
            vnni_transpose16(r);
            for (int k = 0; k < cc; k++) _mm512_store_si512(dst + (size_t)(c + k) * PK_NR + rb, r[k]);
        }
    }
}

/* the register tile over columns [k0, k1) of K; the first chunk stores into y, the others
 * add their partial sums to it */
AVX512 INLINE void packed_tile(float *y, int ldy, const float *xt, int k0, int k1, const float *panel, const int M,
                               int cols) {
    __m512 acc[PK_MR][2];
    packed_tile_sum(acc, xt, k0, k1, panel, M);
    __mmask16 c0 = cols >= 16 ? 0xffff : (__mmask16)((1u << cols) - 1);
    __mmask16 c1 = cols >= 32 ? 0xffff : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
#pragma GCC unroll 12
    for (int m = 0; m < M; m++) {
        float *yr = y + (size_t)m * ldy;
        if (k0) {
            acc[m][0] = _mm512_add_ps(_mm512_maskz_loadu_ps(c0, yr), acc[m][0]);
            acc[m][1] = _mm512_add_ps(_mm512_maskz_loadu_ps(c1, yr + 16), acc[m][1]);
        }
        _mm512_mask_storeu_ps(yr, c0, acc[m][0]);
        _mm512_mask_storeu_ps(yr + 16, c1, acc[m][1]);
    }
}

#define PK_CASE(M) case M: packed_tile(y, ldy, xt, k0, k1, panel, M, cols); break

AVX512 static void packed_rows(float *y, int ldy, const float *xt, int k0, int k1, const float *panel, int m, int cols) {
    switch (m) {
        PK_CASE(1); PK_CASE(2); PK_CASE(3); PK_CASE(4); PK_CASE(5); PK_CASE(6);
        PK_CASE(7); PK_CASE(8); PK_CASE(9); PK_CASE(10); PK_CASE(11);
        default: PK_CASE(12);
    }
}

AVX512 void cs_gemm_packed_avx512(float *y, int ldy, const float *xp, int n, const cs_weight_t *w, int r0, int r1,
                                  float *wp) {
    packed_gemm(y, ldy, xp, n, w, r0, r1, wp);
}

AVX512 void cs_round_bf16_avx512(float *dst, const float *x, size_t count) {
    size_t c16 = count & ~(size_t)15;
    const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff), hi = _mm512_set1_epi32((int)0xffff0000u);
    for (size_t c = 0; c < c16; c += 16) {
        __m512 v = _mm512_loadu_ps(x + c);
        __m512i u = _mm512_castps_si512(v);
        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
        __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(lsb, half)), hi);
        /* a NaN stays a (quiet) NaN, as cs_f32_to_bf16 keeps it */
        __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        r = _mm512_mask_or_epi32(r, nan, _mm512_and_si512(u, hi), _mm512_set1_epi32(0x00400000));
        _mm512_storeu_ps(dst + c, _mm512_castsi512_ps(r));
    }
    cs_round_bf16_ref(dst + c16, x + c16, count - c16);
}

AVX512 INLINE void convert_impl(float *dst, const void *w, size_t i0, size_t count, cs_dtype dt) {
    size_t c16 = count & ~(size_t)15;
    for (size_t c = 0; c < c16; c += 16) _mm512_storeu_ps(dst + c, load16(w, i0 + c, dt));
    for (size_t c = c16; c < count; c++) dst[c] = scalar_at(w, i0 + c, dt);
}

AVX512 void cs_convert_rows_avx512(float *dst, const cs_weight_t *w, int r0, int r1) {
    size_t i0 = (size_t)r0 * w->cols, count = (size_t)(r1 - r0) * w->cols;
    if (w->dtype == CS_DTYPE_BF16) convert_impl(dst, w->data, i0, count, CS_DTYPE_BF16);
    else if (w->dtype == CS_DTYPE_F16) convert_impl(dst, w->data, i0, count, CS_DTYPE_F16);
    else convert_impl(dst, w->data, i0, count, CS_DTYPE_F32);
}
