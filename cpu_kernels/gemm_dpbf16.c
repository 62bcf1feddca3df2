/* gemm_dpbf16.c: y = x · Wᵀ for BF16 weights with AVX512-BF16's vdpbf16ps (AMD Zen 4 and
 * later, Intel Cooper Lake and Sapphire Rapids): each of 16 F32 lanes adds two BF16
 * products, 32 multiply-adds per instruction where an F32 FMA does 16. The F32 activations
 * are split into `terms` BF16 parts (vnni.h): one term is x rounded to BF16 (--precision
 * bf16), three are exact to the F32 rounding of x (1.5x the instructions of F32 FMAs on
 * widened weights, so the exact default does not use it on these CPUs). Two shapes:
 *
 *   large n (prefill): each call packs its block of weight rows into VNNI tiles (vnni.h);
 *     x is packed once per matmul in row tiles of DP_MR rows, pairs of one row adjacent;
 *     a DP_MR × 32 register tile (24 accumulators) runs over K in chunks of DP_KC pairs,
 *     broadcasting x's pairs against two vectors of 16 weight rows' pairs.
 *   small n (≤ CS_DP_SMALL_N, batched decode, memory-bound): Wᵀ runs the other way, x's
 *     pairs in the lanes (16 rows of x per vector, VNNI order) and each weight row's pairs
 *     broadcast straight from the row-major weights, DP_SR rows at once as separate
 *     streams, each over all of K before the next DP_SR rows: the weights are read once,
 *     in place, with no packing.
 *   n ≤ CS_DP_LANE_N: the same, but 16 rows of x would leave lanes empty (half of them at
 *     n = 8), so x's rows are padded to a power of two np and each takes J = 16 / np
 *     adjacent lanes holding J consecutive pairs of it; a weight row's J consecutive pairs
 *     are one broadcast (8, 16, 32 or 64 bytes), so lane q·J + j meets pair p + j of both.
 *     The J lanes of a row are added at the end. Every lane does work at any n.
 *
 * Products of BF16 values are exact in F32 and the sums are F32 (vdpbf16ps flushes
 * denormal inputs and results to zero, as BF16 hardware does; x's lowest term is 2⁻¹⁶ of
 * x, far above that range for any activation a model produces). The reference is
 * cs_matmul_ref on x rounded to BF16 (one term) or on x itself (three). */
#include <immintrin.h>
#include <string.h>

#include "cpu_kernels/kernels.h"
#include "cpu_kernels/vnni.h"

#define DPBF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define INLINE static inline __attribute__((always_inline))

#define DP_MR 12 /* x rows of the large kernel's register tile */
#define DP_SR 8  /* weight rows (streams) of the small kernel */
#ifndef DP_KC
#define DP_KC 64 /* pairs of K per pass: both kernels' sums are chains of at most 64 pairs
                  * (x terms) added into y chunk by chunk, as a blocked BLAS sums (one chain
                  * over all of K loses accuracy as K grows) */
#endif

int cs_cpu_has_avx512_bf16(void) {
    __builtin_cpu_init();
    return cs_cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
}

/* lanes per row of x in the lane kernel: 16 / np, np = n rounded up to a power of two */
static int lane_j(int n) {
    int np = 1;
    while (np < n) np *= 2;
    return 16 / np;
}

/* pairs per row of packed x (K padded to whole 32-column tiles, as the weight tiles are) */
static int kpairs(int K) { return (K + 31) / 32 * 16; }

size_t cs_dpbf16_xp_len(int n, int K, int terms) {
    size_t kp = (size_t)kpairs(K);
    if (n <= CS_DP_LANE_N) return kp * (size_t)(16 / lane_j(n)) * (size_t)terms * 2; /* kp · np pairs */
    if (n <= CS_DP_SMALL_N) return (size_t)(n + 15) / 16 * kp * (size_t)terms * 32; /* bf16 elements */
    return (size_t)((n + DP_MR - 1) / DP_MR) * kp * DP_MR * (size_t)terms * 2;
}

size_t cs_dpbf16_wp_len(int n, int rows, int K) {
    if (n <= CS_DP_SMALL_N) return 0; /* the small kernels keep their partial sums in registers */
    return (size_t)(rows + 31) / 32 * 2 * (size_t)((K + 31) / 32) * VNNI_TILE_ELEMS;
}

/* Packed x, large n: row tiles of DP_MR rows; within one, for each pair p, the DP_MR rows'
 * terms: uint32 at ((tile · KP + p) · DP_MR + m) · terms + t. Small n: groups of 16 rows;
 * uint32 at ((t · G + g) · KP + p) · 16 + m for group g of G, row m of it. n ≤
 * CS_DP_LANE_N: uint32 at (t · KP / J + p / J) · 16 + m · J + p % J. Rows past n and
 * columns past K are zero. */
DPBF16 void cs_dpbf16_pack_x(uint16_t *xp, const float *x, int n, int K, int terms, int r0, int r1) {
    int kp_n = kpairs(K), kb_n = kp_n / 16;
    uint32_t *xq = (uint32_t *)xp;
    bool small = n <= CS_DP_SMALL_N, lanes = n <= CS_DP_LANE_N;
    int groups = (n + 15) / 16, J = lanes ? lane_j(n) : 1;
    if (small && !lanes && r0 % 16 == 0 && (r1 - r0) % 16 == 0) {
        /* whole groups of 16 rows: each 32-column block of the 16 rows split, then turned
         * (16 × 16 pairs) so that each pair's 16 rows are one aligned store */
        for (int m0 = r0; m0 < r1; m0 += 16)
            for (int kb = 0; kb < kb_n; kb++) {
                __m512i r[3][16];
                int left = K - kb * 32;
                __mmask16 m0k = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
                __mmask16 m1k = left >= 32 ? 0xffff : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
                for (int i = 0; i < 16; i++) {
                    __m512i v[3];
                    if (m0 + i < n) {
                        const float *src = x + (size_t)(m0 + i) * K + kb * 32;
                        vnni_split32(v, _mm512_maskz_loadu_ps(m0k, src), _mm512_maskz_loadu_ps(m1k, src + 16), terms);
                    } else {
                        for (int t = 0; t < terms; t++) v[t] = _mm512_setzero_si512();
                    }
                    for (int t = 0; t < terms; t++) r[t][i] = v[t];
                }
                for (int t = 0; t < terms; t++) {
                    vnni_transpose16(r[t]);
                    for (int p = 0; p < 16; p++)
                        _mm512_store_si512(xq + (((size_t)t * groups + m0 / 16) * kp_n + (size_t)kb * 16 + p) * 16, r[t][p]);
                }
            }
        return;
    }
    if (!small && terms == 1) {
        /* whole tiles of DP_MR rows inside [r0, r1): each 32-column block of the tile's rows
         * split, then turned so that each pair's DP_MR rows are one store; the rows around
         * them one at a time, below */
        int a = (r0 + DP_MR - 1) / DP_MR * DP_MR, e = r1 / DP_MR * DP_MR;
        if (a < e) {
            for (int m0 = a; m0 < e; m0 += DP_MR)
                for (int kb = 0; kb < kb_n; kb++) {
                    __m512i r[16];
                    int left = K - kb * 32;
                    __mmask16 m0k = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
                    __mmask16 m1k = left >= 32 ? 0xffff : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
                    for (int i = 0; i < 16; i++) {
                        if (i < DP_MR && m0 + i < n) {
                            const float *src = x + (size_t)(m0 + i) * K + kb * 32;
                            vnni_split32(&r[i], _mm512_maskz_loadu_ps(m0k, src), _mm512_maskz_loadu_ps(m1k, src + 16), 1);
                        } else {
                            r[i] = _mm512_setzero_si512();
                        }
                    }
                    vnni_transpose16(r);
                    for (int p = 0; p < 16; p++)
                        _mm512_mask_storeu_epi32(xq + (((size_t)(m0 / DP_MR) * kp_n + (size_t)kb * 16 + p) * DP_MR),
                                                 (__mmask16)((1u << DP_MR) - 1), r[p]);
                }
            if (r0 < a) cs_dpbf16_pack_x(xp, x, n, K, terms, r0, a);
            if (e < r1) cs_dpbf16_pack_x(xp, x, n, K, terms, e, r1);
            return;
        }
    }
    size_t idx[16]; /* where pair p of a 16-pair block goes, from the block's place */
    for (int p = 0; p < 16; p++)
        idx[p] = lanes ? (size_t)(p / J * 16 + p % J) : small ? (size_t)p * 16 : (size_t)p * DP_MR * (size_t)terms;
    for (int m = r0; m < r1; m++)
        for (int kb = 0; kb < kb_n; kb++) {
            __m512i v[3];
            if (m < n) {
                const float *src = x + (size_t)m * K + kb * 32;
                int left = K - kb * 32;
                __mmask16 m0 = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
                __mmask16 m1 = left >= 32 ? 0xffff : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
                vnni_split32(v, _mm512_maskz_loadu_ps(m0, src), _mm512_maskz_loadu_ps(m1, src + 16), terms);
            } else {
                for (int t = 0; t < terms; t++) v[t] = _mm512_setzero_si512();
            }
            for (int t = 0; t < terms; t++) {
                uint32_t pairs[16] __attribute__((aligned(64)));
                _mm512_store_si512(pairs, v[t]);
                size_t kp = (size_t)kb * 16, at;
                if (lanes) at = ((size_t)t * (kp_n / J) + kp / J) * 16 + (size_t)m * J;
                else if (small) at = (((size_t)t * groups + m / 16) * kp_n + kp) * 16 + m % 16;
                else at = (((size_t)(m / DP_MR) * kp_n + kp) * DP_MR + m % DP_MR) * terms + t;
                for (int p = 0; p < 16; p++) xq[at + idx[p]] = pairs[p];
            }
        }
}

DPBF16 INLINE __m512bh as_bh(__m512i v) { return (__m512bh)v; }

/* a pair of bf16 at any alignment */
INLINE uint32_t pair_at(const uint16_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* the large kernel's register tile: rows [0, M) of an x tile against 32 weight rows (two
 * 16-row groups w0, w1 of VNNI lines, one line per pair); y rows ldy apart, columns clipped
 * to cols (≤ 32) */
DPBF16 INLINE void tile_large(float *y, int ldy, const uint32_t *xt, const uint16_t *w0, const uint16_t *w1, int p0,
                              int p1, const int M, const int T, int cols) {
    __m512 acc[DP_MR][2];
#pragma GCC unroll 12
    for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int p = p0; p < p1; p++) {
        __m512i b0 = _mm512_load_si512(w0 + (size_t)p * 32), b1 = _mm512_load_si512(w1 + (size_t)p * 32);
        const uint32_t *xk = xt + (size_t)p * DP_MR * T;
#pragma GCC unroll 12
        for (int m = 0; m < M; m++)
#pragma GCC unroll 3
            for (int t = 0; t < T; t++) {
                __m512i a = _mm512_set1_epi32((int)xk[m * T + t]);
                acc[m][0] = _mm512_dpbf16_ps(acc[m][0], as_bh(a), as_bh(b0));
                acc[m][1] = _mm512_dpbf16_ps(acc[m][1], as_bh(a), as_bh(b1));
            }
    }
    __mmask16 c0 = cols >= 16 ? 0xffff : (__mmask16)((1u << cols) - 1);
    __mmask16 c1 = cols >= 32 ? 0xffff : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
#pragma GCC unroll 12
    for (int m = 0; m < M; m++) {
        float *yr = y + (size_t)m * ldy;
        if (p0) { /* a later chunk of K: add to the sums so far */
            acc[m][0] = _mm512_add_ps(_mm512_maskz_loadu_ps(c0, yr), acc[m][0]);
            acc[m][1] = _mm512_add_ps(_mm512_maskz_loadu_ps(c1, yr + 16), acc[m][1]);
        }
        _mm512_mask_storeu_ps(yr, c0, acc[m][0]);
        _mm512_mask_storeu_ps(yr + 16, c1, acc[m][1]);
    }
}

#define LARGE_CASE(M, T) case M: tile_large(y, ldy, xt, w0, w1, p0, p1, M, T, cols); break
#define LARGE_ALL(T)                                                                                                 \
    switch (m) {                                                                                                     \
        LARGE_CASE(1, T); LARGE_CASE(2, T); LARGE_CASE(3, T); LARGE_CASE(4, T); LARGE_CASE(5, T); LARGE_CASE(6, T); \
        LARGE_CASE(7, T); LARGE_CASE(8, T); LARGE_CASE(9, T); LARGE_CASE(10, T); LARGE_CASE(11, T);              \
        default: LARGE_CASE(12, T);                                                                                \
    }

DPBF16 static void large_tile(float *y, int ldy, const uint32_t *xt, const uint16_t *w0, const uint16_t *w1, int p0,
                              int p1, int m, int terms, int cols) {
    if (terms == 1) { LARGE_ALL(1) }
    else if (terms == 2) { LARGE_ALL(2) }
    else { LARGE_ALL(3) }
}

/* Prefetch of the small and lane kernels, measured on a Zen 4 (1 thread, 32- to 128-row
 * tasks): each row's line one tile ahead into L2 (T0, or shorter distances, ran 1.1-1.5x
 * slower at n ≤ 16, where the weights' bytes bound the kernel). A tile of rows from
 * separate stretches (streams, wstride > K) fetches the next row of each stream, K bf16 on;
 * a tile of adjacent rows the same row of the next tile, DP_SR rows on. */
INLINE size_t tile_pf(int K, size_t wstride) { return (wstride == (size_t)K ? (size_t)DP_SR : 1u) * (size_t)K * 2; }

/* the small kernel: R weight rows (pairs broadcast from the row-major weights at wr[r],
 * wstride bf16 apart, their sums ystride apart in y; uint32 per pair, K / 2 whole pairs,
 * then one half pair when K is odd) against G groups of 16 x rows, over all of K in chunks
 * of DP_KC pairs (each chunk's chain added to the chunks' before it); y[m][r] for m < n */
DPBF16 INLINE void tile_small(float *y, int ldy, int ystride, const uint32_t *xq, int groups, int kp_n,
                              const uint16_t *w, size_t wstride, int K, const int R, const int G, const int T, int n) {
    __m512 acc[DP_SR][2], tot[DP_SR][2];
    const uint16_t *wr[DP_SR];
    int full = K / 2;
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        wr[r] = w + (size_t)r * wstride;
#pragma GCC unroll 2
        for (int g = 0; g < G; g++) tot[r][g] = _mm512_setzero_ps();
    }
    for (int p0 = 0; p0 < full || p0 == 0; p0 += DP_KC) {
        int p1 = CS_MIN(full, p0 + DP_KC);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
#pragma GCC unroll 2
            for (int g = 0; g < G; g++) acc[r][g] = _mm512_setzero_ps();
        for (int p = p0; p < p1; p++) {
            __m512i xv[3][2];
#pragma GCC unroll 3
            for (int t = 0; t < T; t++)
#pragma GCC unroll 2
                for (int g = 0; g < G; g++)
                    xv[t][g] = _mm512_load_si512(xq + (((size_t)t * groups + g) * kp_n + p) * 16);
            if ((p & 15) == 0) {
                size_t off = (size_t)p * 4 + tile_pf(K, wstride);
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) _mm_prefetch((const char *)wr[r] + off, _MM_HINT_T1);
            }
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                __m512i a = _mm512_set1_epi32((int)pair_at(wr[r] + 2 * p));
#pragma GCC unroll 3
                for (int t = 0; t < T; t++)
#pragma GCC unroll 2
                    for (int g = 0; g < G; g++) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], as_bh(a), as_bh(xv[t][g]));
            }
        }
        if ((K & 1) && p1 >= full) { /* the last column alone: its partner in x is zero, so pair it with 0 */
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                __m512i a = _mm512_set1_epi32((int)(uint32_t)wr[r][K - 1]);
#pragma GCC unroll 3
                for (int t = 0; t < T; t++)
#pragma GCC unroll 2
                    for (int g = 0; g < G; g++)
                        acc[r][g] = _mm512_dpbf16_ps(
                            acc[r][g], as_bh(a), as_bh(_mm512_load_si512(xq + (((size_t)t * groups + g) * kp_n + full) * 16)));
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
#pragma GCC unroll 2
            for (int g = 0; g < G; g++) tot[r][g] = p0 ? _mm512_add_ps(tot[r][g], acc[r][g]) : acc[r][g];
    }
    float tmp[DP_SR][32] __attribute__((aligned(64)));
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int g = 0; g < G; g++) _mm512_store_ps(&tmp[r][g * 16], tot[r][g]);
    if (G == 2 && ystride == 1) {
        /* y's rows are ldy apart (4 KiB for a 1024-row weight: one L1 set for all 32), so
         * each row of x gets its R sums in one store, not R scalar ones: 1.19-1.27x on
         * 1024-row weights at n = 32 (Zen 4). At n ≤ 16 the gathers cost more than the
         * conflicts. */
        const __m256i idx = _mm256_setr_epi32(0, 32, 64, 96, 128, 160, 192, 224);
        const __mmask8 rm = (__mmask8)((1u << R) - 1);
        for (int i = 0; i < n; i++)
            _mm256_mask_storeu_ps(y + (size_t)i * ldy, rm,
                                  _mm256_mmask_i32gather_ps(_mm256_setzero_ps(), rm, idx, &tmp[0][i], 4));
        return;
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        for (int i = 0; i < n; i++) y[(size_t)i * ldy + (size_t)r * ystride] = tmp[r][i];
}

/* J consecutive pairs of a weight row in every J lanes: clipped to `elems` bf16 (the row's
 * end; past it, zeros, never a load of the next row's or past the matrix) when elems < 2J */
DPBF16 INLINE __m512i bcast_pairs(const uint16_t *p, const int J, int elems) {
    if (elems >= 2 * J) {
        if (J == 2) {
            long long v;
            memcpy(&v, p, sizeof v);
            return _mm512_set1_epi64(v);
        }
        if (J == 4) return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)p));
        if (J == 8) return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p));
        return _mm512_loadu_si512(p);
    }
    __m512i v = _mm512_maskz_loadu_epi16((__mmask32)((1ull << elems) - 1), p);
    if (J == 2) return _mm512_broadcastq_epi64(_mm512_castsi512_si128(v));
    if (J == 4) return _mm512_broadcast_i32x4(_mm512_castsi512_si128(v));
    if (J == 8) return _mm512_broadcast_i64x4(_mm512_castsi512_si256(v));
    return v;
}

/* the lane kernel: R weight rows, wstride bf16 apart (their sums ystride apart in y),
 * against x's n rows in J lanes each, over all of K in chunks of DP_KC pairs (each chunk's
 * chain added to the chunks' before it, in registers); y[m][r] for m < n */
DPBF16 INLINE void tile_lanes(float *y, int ldy, int ystride, const uint32_t *xq, int kp_n, const uint16_t *w,
                              size_t wstride, int K, const int R, const int J, const int T, int n) {
    __m512 acc[DP_SR], tot[DP_SR];
    const uint16_t *wr[DP_SR];
    int steps = kp_n / J, kq = (K + 1) / 2; /* pairs with a column of w in them */
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        wr[r] = w + (size_t)r * wstride;
        tot[r] = _mm512_setzero_ps();
    }
    for (int p0 = 0; p0 == 0 || p0 < kq; p0 += DP_KC) {
        int p1 = CS_MIN(kq, p0 + DP_KC), p = p0;
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
        for (; p < p1 && 2 * (p + J) <= K; p += J) { /* whole steps inside the row */
            __m512i xv[3];
#pragma GCC unroll 3
            for (int t = 0; t < T; t++) xv[t] = _mm512_load_si512(xq + ((size_t)t * steps + p / J) * 16);
            if ((p & 15) == 0) { /* as tile_small */
                size_t off = (size_t)p * 4 + tile_pf(K, wstride);
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) _mm_prefetch((const char *)wr[r] + off, _MM_HINT_T1);
            }
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                __m512i a = bcast_pairs(wr[r] + 2 * p, J, 2 * J);
#pragma GCC unroll 3
                for (int t = 0; t < T; t++) acc[r] = _mm512_dpbf16_ps(acc[r], as_bh(a), as_bh(xv[t]));
            }
        }
        if (p < p1) { /* the step over the row's end: its columns, then zeros */
            __m512i xv[3];
#pragma GCC unroll 3
            for (int t = 0; t < T; t++) xv[t] = _mm512_load_si512(xq + ((size_t)t * steps + p / J) * 16);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                __m512i a = bcast_pairs(wr[r] + 2 * p, J, K - 2 * p);
#pragma GCC unroll 3
                for (int t = 0; t < T; t++) acc[r] = _mm512_dpbf16_ps(acc[r], as_bh(a), as_bh(xv[t]));
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) tot[r] = p0 ? _mm512_add_ps(tot[r], acc[r]) : acc[r];
    }
    float tmp[DP_SR][16] __attribute__((aligned(64)));
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) _mm512_store_ps(tmp[r], tot[r]);
    for (int m = 0; m < n; m++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            float v = tmp[r][m * J];
            for (int j = 1; j < J; j++) v += tmp[r][m * J + j];
            y[(size_t)m * ldy + (size_t)r * ystride] = v;
        }
}

/* rows [r0, r1): DP_SR rows at a time from DP_SR separate stretches, so that each stream
 * reads on sequentially (as the GEMV's), then the rows left over as one tile */
DPBF16 INLINE void lane_tiles(float *y, int ldy, const uint32_t *xq, int kp_n, const uint16_t *w, int K, int r0,
                              int r1, const int J, const int T, int n) {
    int per = (r1 - r0) / DP_SR, r = r0 + per * DP_SR;
    for (int g = 0; g < per; g++)
        tile_lanes(y + r0 + g, ldy, per, xq, kp_n, w + (size_t)(r0 + g) * K, (size_t)per * K, K, DP_SR, J, T, n);
    y += r;
    w += (size_t)r * K;
    switch (r1 - r) {
    case 0: break;
#define LANES_LEFT(R) case R: tile_lanes(y, ldy, 1, xq, kp_n, w, (size_t)K, K, R, J, T, n); break
    LANES_LEFT(1); LANES_LEFT(2); LANES_LEFT(3); LANES_LEFT(4); LANES_LEFT(5); LANES_LEFT(6); default: LANES_LEFT(7);
#undef LANES_LEFT
    }
}

#define LANES_T(J)                                                                                    \
    if (terms == 1) lane_tiles(y, ldy, xq, kp_n, w, K, r0, r1, J, 1, n);                              \
    else if (terms == 2) lane_tiles(y, ldy, xq, kp_n, w, K, r0, r1, J, 2, n);                         \
    else lane_tiles(y, ldy, xq, kp_n, w, K, r0, r1, J, 3, n)

DPBF16 static void lane_rows(float *y, int ldy, const uint32_t *xq, int kp_n, const uint16_t *w, int K, int r0,
                             int r1, int terms, int n) {
    switch (lane_j(n)) {
    case 2: LANES_T(2); break;
    case 4: LANES_T(4); break;
    case 8: LANES_T(8); break;
    default: LANES_T(16); break;
    }
}
#undef LANES_T

/* rows [r0, r1) in tiles of DP_SR: one group of x (n ≤ 16, memory-bound) takes them from
 * DP_SR streams, as the lane kernel; two (compute-bound) keep adjacent rows, so that y's
 * stores can take each row of x's sums at once */
DPBF16 INLINE void small_tiles(float *y, int ldy, const uint32_t *xq, int groups, int kp_n, const uint16_t *w, int K,
                               int r0, int r1, const int G, const int T, int n) {
    int per = G == 1 ? (r1 - r0) / DP_SR : 0, r = r0 + per * DP_SR;
    for (int g = 0; g < per; g++)
        tile_small(y + r0 + g, ldy, per, xq, groups, kp_n, w + (size_t)(r0 + g) * K, (size_t)per * K, K, DP_SR, G, T, n);
    for (; r + DP_SR <= r1; r += DP_SR)
        tile_small(y + r, ldy, 1, xq, groups, kp_n, w + (size_t)r * K, (size_t)K, K, DP_SR, G, T, n);
    y += r;
    w += (size_t)r * K;
    switch (r1 - r) {
    case 0: break;
#define SMALL_LEFT(R) case R: tile_small(y, ldy, 1, xq, groups, kp_n, w, (size_t)K, K, R, G, T, n); break
    SMALL_LEFT(1); SMALL_LEFT(2); SMALL_LEFT(3); SMALL_LEFT(4); SMALL_LEFT(5); SMALL_LEFT(6); default: SMALL_LEFT(7);
#undef SMALL_LEFT
    }
}

#define SMALL_T(G)                                                                                    \
    if (terms == 1) small_tiles(y, ldy, xq, groups, kp_n, w, K, r0, r1, G, 1, n);                     \
    else if (terms == 2) small_tiles(y, ldy, xq, groups, kp_n, w, K, r0, r1, G, 2, n);                \
    else small_tiles(y, ldy, xq, groups, kp_n, w, K, r0, r1, G, 3, n)

DPBF16 static void small_rows(float *y, int ldy, const uint32_t *xq, int kp_n, const uint16_t *w, int K, int r0,
                              int r1, int terms, int n) {
    int groups = (n + 15) / 16;
    if (groups == 1) { SMALL_T(1); }
    else { SMALL_T(2); }
}
#undef SMALL_T

DPBF16 void cs_gemm_dpbf16(float *y, int ldy, const uint16_t *xp, int n, int terms, const cs_weight_t *w, int r0,
                           int r1, uint16_t *wp) {
    int K = w->cols, kp_n = kpairs(K);
    if (n <= CS_DP_LANE_N) {
        lane_rows(y, ldy, (const uint32_t *)xp, kp_n, (const uint16_t *)w->data, K, r0, r1, terms, n);
        return;
    }
    if (n <= CS_DP_SMALL_N) {
        /* each tile of DP_SR rows streams its rows over all of K, chunk by chunk (DP_KC pairs,
         * each chunk's sums added to the ones before, as a blocked BLAS sums), with x from
         * L2. Chunks outermost instead (the chunk of x in L1 while every tile passes over
         * it) gives the same bits and ran 1.024-1.044x slower on a Zen 4 (paired, n = 8,
         * 16, 32): the weights are the stream that matters. */
        small_rows(y, ldy, (const uint32_t *)xp, kp_n, (const uint16_t *)w->data, K, r0, r1, terms, n);
        return;
    }
    int kb_n = kp_n / 16, nt = (r1 - r0 + 31) / 32 * 2;
    vnni_pack_w(wp, w, r0, nt, 0, kb_n);
    size_t group = (size_t)kb_n * VNNI_TILE_ELEMS; /* bf16 of one 16-row group's tiles */
    const uint32_t *xq = (const uint32_t *)xp;
    for (int j = 0; j < nt; j += 2) {
        const uint16_t *w0 = wp + (size_t)j * group, *w1 = w0 + group;
        int c = r0 + j * 16, cols = CS_MIN(32, r1 - c);
        for (int p0 = 0; p0 < kp_n; p0 += DP_KC)
            for (int m0 = 0; m0 < n; m0 += DP_MR)
                large_tile(y + (size_t)m0 * ldy + c, ldy, xq + (size_t)(m0 / DP_MR) * kp_n * DP_MR * terms, w0, w1, p0,
                           CS_MIN(kp_n, p0 + DP_KC), CS_MIN(DP_MR, n - m0), terms, cols);
    }
}
