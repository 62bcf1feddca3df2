/* kernels_avx2.c: AVX2+FMA fast paths of the CPU backend, for CPUs without AVX-512 (AMD
 * Zen 1-3, Intel before Skylake-X, client cores) and for AVX-512 CPUs run with CS_NO_AVX512.
 * Same contracts as kernels_avx512.c in 8 lanes: weights stay in their file dtype
 * (BF16/F16/F32) and are widened in registers, products and sums are F32. Compiled with
 * target attributes, called only after cs_cpu_has_avx2(); each is tested against its
 * reference in kernels_ref.c (tests/test_cpu_kernels.c). */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "cpu_kernels/kernels.h"
#include "cpu_kernels/wcode.h"
#include "cpu_kernels/kernels_paged.h"
#include "cpu_kernels/simd.h"

#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))

/* 8 weights from element i on, widened to F32 */
AVX2 INLINE __m256 load8(const void *base, size_t i, cs_dtype dt) {
    if (dt == CS_DTYPE_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    if (dt == CS_DTYPE_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i)));
    return _mm256_loadu_ps((const float *)base + i);
}

/* the last k < 8 weights from element i on, the other lanes 0 */
AVX2 INLINE __m256 load8_tail(const void *base, size_t i, int k, cs_dtype dt) {
    if (dt == CS_DTYPE_F32) {
        float t[8] = {0};
        memcpy(t, (const float *)base + i, sizeof(float) * (size_t)k);
        return _mm256_loadu_ps(t);
    }
    uint16_t t[8] = {0};
    memcpy(t, (const uint16_t *)base + i, sizeof(uint16_t) * (size_t)k);
    return load8(t, 0, dt);
}

AVX2 INLINE __m256 loadx_tail(const float *x, int k) {
    float t[8] = {0};
    memcpy(t, x, sizeof(float) * (size_t)k);
    return _mm256_loadu_ps(t);
}

/* the same fixed order for every accumulator: (lanes 0-3 + lanes 4-7), then pairs */
AVX2 INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* the vector operations of kernels_simd.h's shared loops, in 8 lanes */
typedef __m256 vf_t;
#define VF_LANES 8
AVX2 INLINE vf_t vf_zero(void) { return _mm256_setzero_ps(); }
AVX2 INLINE vf_t vf_add(vf_t a, vf_t b) { return _mm256_add_ps(a, b); }
AVX2 INLINE vf_t vf_fmadd(vf_t a, vf_t b, vf_t c) { return _mm256_fmadd_ps(a, b, c); }
AVX2 INLINE vf_t vf_bcast(const float *p) { return _mm256_broadcast_ss(p); }
AVX2 INLINE vf_t vf_load(const float *p) { return _mm256_load_ps(p); }
AVX2 INLINE float vf_hsum(vf_t v) { return hsum8(v); }

/* ---- the batch-1 GEMV on 12-bit coded BF16 weights (wcode.h): kernels_avx512.c's in two
 * 256-bit halves per block; half h of vector m holds columns 16m + 8h .. 16m + 8h + 7 ---- */
typedef __m256i wcode_tbl_t;
AVX2 INLINE wcode_tbl_t wcode_table(const cs_wcode_t *c) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)c->table));
}

AVX2 INLINE void wcode_half(const uint8_t *blk, __m256i codes, __m256i tbl, __m256 f[4]) {
    __m256i lo = _mm256_loadu_si256((const __m256i *)blk);
    __m256i hi = _mm256_shuffle_epi8(tbl, codes);
    __m256i u0 = _mm256_unpacklo_epi8(lo, hi), u1 = _mm256_unpackhi_epi8(lo, hi), z = _mm256_setzero_si256();
    f[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, u0));
    f[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, u0));
    f[2] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, u1));
    f[3] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, u1));
}

/* half h's codes: the low nibbles of the block's 32 code bytes, or the high ones */
AVX2 INLINE __m256i wcode_codes(__m256i nbv, int h) {
    const __m256i m0f = _mm256_set1_epi8(0x0f);
    return _mm256_and_si256(h ? _mm256_srli_epi16(nbv, 4) : nbv, m0f);
}

/* block b of a row decoded: f[h][m] is half h of vector m */
AVX2 INLINE void wcode_decode(const uint8_t *row, int b, __m256i tbl, __m256 f[2][4]) {
    __m256i nbv = _mm256_loadu_si256((const __m256i *)(row + cs_wcode_codes_at(b)));
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) wcode_half(row + cs_wcode_lo_at(b) + 32 * h, wcode_codes(nbv, h), tbl, f[h]);
}

/* block b of a row times x's block xb: a0 takes vectors 0 and 2 of each half, a1 1 and 3 */
AVX2 INLINE void wcode_fma2(const uint8_t *row, int b, __m256i tbl, const float *xb, __m256 *a0, __m256 *a1) {
    __m256 f[2][4];
    wcode_decode(row, b, tbl, f);
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        *a0 = _mm256_fmadd_ps(f[h][0], _mm256_loadu_ps(xb + 8 * h), *a0);
        *a1 = _mm256_fmadd_ps(f[h][1], _mm256_loadu_ps(xb + 16 + 8 * h), *a1);
        *a0 = _mm256_fmadd_ps(f[h][2], _mm256_loadu_ps(xb + 32 + 8 * h), *a0);
        *a1 = _mm256_fmadd_ps(f[h][3], _mm256_loadu_ps(xb + 48 + 8 * h), *a1);
    }
}

/* the same for NX rows of x, one accumulator each */
AVX2 INLINE void wcode_fma_n(const uint8_t *row, int b, __m256i tbl, const float *const *xb, __m256 *a, const int NX) {
    __m256 f[2][4];
    wcode_decode(row, b, tbl, f);
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++)
#pragma GCC unroll 4
        for (int i = 0; i < NX; i++)
#pragma GCC unroll 4
            for (int m = 0; m < 4; m++) a[i] = _mm256_fmadd_ps(f[h][m], _mm256_loadu_ps(xb[i] + 16 * m + 8 * h), a[i]);
}

/* the packed GEMM's shape (kernels_simd.h's packed_gemm): panels of 16 weight rows, tiles of
 * 6 rows of x, K in chunks of 128 (as kernels_avx512.c's PK_KC: accuracy and L1) */
#define PK_MR CS_PACKED_MR_AVX2
#define PK_NR 16
#define PK_KC 128
AVX2 INLINE void packed_panel(float *panel, const void *w, int K, int r0, int cols, cs_dtype dt);
AVX2 static void packed_rows(float *y, int ldy, const float *xt, int k0, int k1, const float *panel, int m, int cols);

/* the shared loops, compiled for this file's ISA */
#define KS_TARGET AVX2
#include "cpu_kernels/kernels_simd.h"

/* ---- dot tiles (batch-invariant) ----
 * y[i, r] = dot(x[i, :], w[r, :]): one 8-lane accumulator per element, FMAs over the
 * columns in order, the tail zero-padded (0·0 adds nothing), one fixed horizontal sum.
 * Every element is made by the same operations whatever the tile shape, the tile's place
 * or the task's rows, so the result does not depend on the batch around a row.
 * Weight rows go in blocks of TB_ROWS; a block is widened to F32 TB_KC columns at a time
 * (exact, so it changes no bit) into a buffer in L1 that all the block's x rows then read:
 * the widening is paid once per block, not once per 4 rows of x. Tiles are 4 x rows × 3
 * weight rows: 12 accumulators, 3 weights and x fill the 16 registers, enough independent
 * FMAs to cover their latency. Accumulators live in memory between column chunks. */
#define TB_ROWS 6    /* weight rows per block */
#define TB_KC 256    /* columns widened at a time */
#define TB_XROWS 32  /* x rows per pass over a block */

/* acc[i][rr + r] += x row i · w row r (F32, ldw apart) over len columns, the last len % 8
 * read zero-padded; i < M, r < R */
AVX2 INLINE void tile_chunk(__m256 (*acc)[TB_ROWS], int rr, const float *x, int ldx, const float *wf, size_t ldw,
                            int len, const int M, const int R) {
    __m256 a[4][3];
#pragma GCC unroll 4
    for (int i = 0; i < M; i++)
#pragma GCC unroll 3
        for (int r = 0; r < R; r++) a[i][r] = acc[i][rr + r];
    int c = 0;
    for (; c + 8 <= len; c += 8) {
        __m256 wv[3];
#pragma GCC unroll 3
        for (int r = 0; r < R; r++) wv[r] = _mm256_loadu_ps(wf + (size_t)r * ldw + c);
#pragma GCC unroll 4
        for (int i = 0; i < M; i++) {
            __m256 xv = _mm256_loadu_ps(x + (size_t)i * ldx + c);
#pragma GCC unroll 3
            for (int r = 0; r < R; r++) a[i][r] = _mm256_fmadd_ps(wv[r], xv, a[i][r]);
        }
    }
    if (c < len) {
        __m256 wv[3];
#pragma GCC unroll 3
        for (int r = 0; r < R; r++) wv[r] = loadx_tail(wf + (size_t)r * ldw + c, len - c);
#pragma GCC unroll 4
        for (int i = 0; i < M; i++) {
            __m256 xv = loadx_tail(x + (size_t)i * ldx + c, len - c);
#pragma GCC unroll 3
            for (int r = 0; r < R; r++) a[i][r] = _mm256_fmadd_ps(wv[r], xv, a[i][r]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < M; i++)
#pragma GCC unroll 3
        for (int r = 0; r < R; r++) acc[i][rr + r] = a[i][r];
}

/* the nx x rows against rows [rr, rr + R) of the block */
AVX2 INLINE void tile_rows(__m256 (*acc)[TB_ROWS], const float *x, int cols, int nx, const float *wf, size_t ldw,
                           int len, int rr, const int R) {
    int i = 0;
    for (; i + 4 <= nx; i += 4) tile_chunk(acc + i, rr, x + (size_t)i * cols, cols, wf + (size_t)rr * ldw, ldw, len, 4, R);
    for (; i + 2 <= nx; i += 2) tile_chunk(acc + i, rr, x + (size_t)i * cols, cols, wf + (size_t)rr * ldw, ldw, len, 2, R);
    for (; i < nx; i++) tile_chunk(acc + i, rr, x + (size_t)i * cols, cols, wf + (size_t)rr * ldw, ldw, len, 1, R);
}

AVX2 INLINE void gemm_tiles_impl(float *y, int ldy, const float *x, int n, const void *w, int cols, int r0, int r1,
                                 cs_dtype dt) {
    __attribute__((aligned(32))) float wbuf[TB_ROWS * TB_KC];
    __m256 acc[TB_XROWS][TB_ROWS];
    for (int rb = r0; rb < r1; rb += TB_ROWS) {
        int nr = r1 - rb < TB_ROWS ? r1 - rb : TB_ROWS;
        for (int ib = 0; ib < n; ib += TB_XROWS) {
            int nx = n - ib < TB_XROWS ? n - ib : TB_XROWS;
            const float *xb = x + (size_t)ib * cols;
            for (int i = 0; i < nx; i++)
                for (int r = 0; r < nr; r++) acc[i][r] = _mm256_setzero_ps();
            for (int kc = 0; kc < cols; kc += TB_KC) {
                int len = cols - kc < TB_KC ? cols - kc : TB_KC;
                const float *wf;
                size_t ldw;
                if (dt == CS_DTYPE_F32) {
                    wf = (const float *)w + (size_t)rb * cols + kc;
                    ldw = (size_t)cols;
                } else {
                    for (int r = 0; r < nr; r++) {
                        const uint16_t *src = (const uint16_t *)w + (size_t)(rb + r) * cols + kc;
                        float *dst = wbuf + r * TB_KC;
                        /* the same columns of the next block's rows are fetched while this
                         * block computes: one block of latency hidden */
                        const char *next = (const char *)(src + (size_t)TB_ROWS * cols);
                        bool pf = rb + TB_ROWS < r1;
                        int c = 0;
                        for (; c + 8 <= len; c += 8) {
                            if (pf && (c & 31) == 0) _mm_prefetch(next + 2 * c, _MM_HINT_T1);
                            _mm256_store_ps(dst + c, load8(src, (size_t)c, dt));
                        }
                        for (; c < len; c++) dst[c] = dt == CS_DTYPE_BF16 ? cs_bf16_to_f32(src[c]) : cs_f16_to_f32(src[c]);
                    }
                    wf = wbuf;
                    ldw = TB_KC;
                }
                int rr = 0;
                for (; rr + 3 <= nr; rr += 3) tile_rows(acc, xb + kc, cols, nx, wf, ldw, len, rr, 3);
                for (; rr < nr; rr++) tile_rows(acc, xb + kc, cols, nx, wf, ldw, len, rr, 1);
            }
            for (int i = 0; i < nx; i++)
                for (int r = 0; r < nr; r++) y[(size_t)(ib + i) * ldy + rb + r] = hsum8(acc[i][r]);
        }
    }
}

AVX2 void cs_gemm_invariant_avx2(float *y, int ldy, const float *x, int n, const cs_weight_t *w, int r0, int r1) {
    switch (w->dtype) {
    case CS_DTYPE_BF16: gemm_tiles_impl(y, ldy, x, n, w->data, w->cols, r0, r1, CS_DTYPE_BF16); break;
    case CS_DTYPE_F16: gemm_tiles_impl(y, ldy, x, n, w->data, w->cols, r0, r1, CS_DTYPE_F16); break;
    default: gemm_tiles_impl(y, ldy, x, n, w->data, w->cols, r0, r1, CS_DTYPE_F32); break;
    }
}


/* ---- the split dot tiles (BF16 weights): kernels_avx512.c's cs_gemm_split_avx512 in 8 lanes ----
 * x packed once per matmul, each 16 columns as their 8 even then 8 odd elements (rows
 * cs_split_xs_len's stride apart, zero past K); a 32-byte load of a weight row's 16 BF16
 * widened by a shift (the even ones) and two shifts (the odd ones: no mask register). Each
 * y[i, r] is one 8-lane accumulator, an FMA of the even then the odd half per 16 columns,
 * summed by a transposing tree (cs_reduce8_avx2) that pairs every accumulator's lanes the
 * same way whatever its place: one fixed sequence of operations per y[i, r], whatever the
 * tile (batch-invariant).
 *
 * The tiles keep 10 accumulators in the 16 registers where they can. With 8 (the 4 × 2 tile)
 * the FMA chains only just cover the FMA's latency (2 ports × 4 cycles), and GCC folded x's
 * loads into the FMAs (one load per FMA), which cost more than the registers they saved.
 * All 7 projections of the 200M model's layers, Zen 4 (FMA peak 117 GFLOP/s a core), the
 * same bits as before: one thread n = 32 75 -> 86-89 GFLOP/s, n = 8 62 -> 69-71, n = 5 47 ->
 * 62, n = 2 34 -> 41-44; two threads (from DRAM) n = 32 and 16 1.08-1.10x, n = 8 0.96-1.04x;
 * `caraserve batch` at batch 32 1.08x (bench/ab.sh, CS_NO_AVX512=1).
 * - x rows in groups of 5 and 4 (tile_xw: each x row's halves loaded once into registers,
 *   pinned there, against 2 weight rows' widened halves: 10 or 8 accumulators), 3 where n
 *   leaves no other way;
 * - a group of 2 x rows against 5 weight rows, 1 against 10 (tile_wx: the x rows' halves in
 *   registers, each weight row widened once and used at once).
 * Weight rows go in blocks of 10 (a whole number of tiles of 2, 5 and 10); the first x group
 * starts the rows two blocks ahead on their way into L2. */
#define SPLIT2_ROW_BLOCK 10

AVX2 void cs_split_pack_x_avx2(float *xs, const float *x, int n, int K, int i0, int i1) {
    size_t kp = split_kp(K);
    (void)n;
    for (int i = i0; i < i1; i++) {
        const float *src = x + (size_t)i * K;
        float *dst = xs + (size_t)i * kp;
        int c = 0;
        for (; c < K; c += 16) {
            __m256 x0, x1;
            if (c + 16 <= K) {
                x0 = _mm256_loadu_ps(src + c);
                x1 = _mm256_loadu_ps(src + c + 8);
            } else {
                x0 = loadx_tail(src + c, K - c < 8 ? K - c : 8);
                x1 = K - c > 8 ? loadx_tail(src + c + 8, K - c - 8) : _mm256_setzero_ps();
            }
            /* shuffle leaves the 64-bit pairs (0 2)(8 10)(4 6)(12 14): the permute orders them */
            _mm256_store_ps(dst + c, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(x0, x1, 0x88)), 0xd8)));
            _mm256_store_ps(dst + c + 8, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(x0, x1, 0xdd)), 0xd8)));
        }
        for (; (size_t)c < kp; c += 8) _mm256_store_ps(dst + c, _mm256_setzero_ps());
    }
}

/* cs_round_bf16_avx512's rounding 8 at a time: nearest even, a NaN kept a quiet NaN */
AVX2 void cs_round_bf16_avx2(float *dst, const float *x, size_t count) {
    size_t c8 = count & ~(size_t)7;
    const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff), hi = _mm256_set1_epi32((int)0xffff0000u);
    const __m256i quiet = _mm256_set1_epi32(0x00400000);
    for (size_t c = 0; c < c8; c += 8) {
        __m256 v = _mm256_loadu_ps(x + c);
        __m256i u = _mm256_castps_si256(v);
        __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
        __m256i r = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(lsb, half)), hi);
        __m256i q = _mm256_or_si256(_mm256_and_si256(u, hi), quiet);
        __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
        _mm256_storeu_ps(dst + c, _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(q), nan));
    }
    cs_round_bf16_ref(dst + c8, x + c8, count - c8);
}

/* the odd BF16 of each 32-bit pair as F32 */
AVX2 INLINE __m256 split_odd(__m256i v) { return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u))); }

/* a weight row's 16 columns at c, zero past the row (as x is) */
AVX2 INLINE __m256i split_load_w(const uint16_t *w, int c, int cols) {
    if (c + 16 <= cols) return _mm256_loadu_si256((const __m256i *)(w + c));
    uint16_t t[16] = {0};
    memcpy(t, w + c, sizeof(uint16_t) * (size_t)(cols - c));
    return _mm256_loadu_si256((const __m256i *)t);
}

/* the R weight rows at pf (a later block's) on their way into L2: a line each per 32 columns */
AVX2 INLINE void split_prefetch(const uint16_t *pf, const int R, int cols, int c) {
    if (!pf || (c & 31)) return;
#pragma GCC unroll 10
    for (int r = 0; r < R; r++) _mm_prefetch((const char *)(pf + (size_t)r * cols + c), _MM_HINT_T1);
}

/* the M × R sums (lane R·i + r of a[]) into y[i, r] */
AVX2 INLINE void split_store(float *y, int ldy, const __m256 *a, const int M, const int R) {
    __attribute__((aligned(32))) float out[16];
    __m256 b[16];
#pragma GCC unroll 16
    for (int k = 0; k < 16; k++) b[k] = k < M * R ? a[k] : _mm256_setzero_ps();
    _mm256_store_ps(out, cs_reduce8_avx2(b));
    if (M * R > 8) _mm256_store_ps(out + 8, cs_reduce8_avx2(b + 8));
#pragma GCC unroll 5
    for (int i = 0; i < M; i++)
#pragma GCC unroll 10
        for (int r = 0; r < R; r++) y[(size_t)i * ldy + r] = out[R * i + r];
}

/* y[i, r] for i < M ≤ 5, r < R ≤ 2: the R weight rows widened first, then each x row */
AVX2 INLINE void tile_xw(float *y, int ldy, const float *xs, size_t kp, const uint16_t *w, int cols, const int M,
                         const int R, const uint16_t *pf) {
    __m256 a[10];
#pragma GCC unroll 10
    for (int k = 0; k < M * R; k++) a[k] = _mm256_setzero_ps();
    for (int c = 0; c < cols; c += 16) {
        __m256 we[2], wo[2];
        split_prefetch(pf, R, cols, c);
#pragma GCC unroll 2
        for (int r = 0; r < R; r++) {
            __m256i v = split_load_w(w + (size_t)r * cols, c, cols);
            we[r] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            wo[r] = split_odd(v);
        }
#pragma GCC unroll 5
        for (int i = 0; i < M; i++) {
            __m256 xe = _mm256_load_ps(xs + (size_t)i * kp + c), xo = _mm256_load_ps(xs + (size_t)i * kp + c + 8);
            __asm__("" : "+x"(xe), "+x"(xo)); /* in registers: not a load folded into each FMA */
#pragma GCC unroll 2
            for (int r = 0; r < R; r++) {
                a[R * i + r] = _mm256_fmadd_ps(we[r], xe, a[R * i + r]);
                a[R * i + r] = _mm256_fmadd_ps(wo[r], xo, a[R * i + r]);
            }
        }
    }
    split_store(y, ldy, a, M, R);
}

/* y[i, r] for i < M ≤ 2, r < R ≤ 10: the x rows' halves in registers, then each weight row */
AVX2 INLINE void tile_wx(float *y, int ldy, const float *xs, size_t kp, const uint16_t *w, int cols, const int M,
                         const int R, const uint16_t *pf) {
    __m256 a[10];
#pragma GCC unroll 10
    for (int k = 0; k < M * R; k++) a[k] = _mm256_setzero_ps();
    for (int c = 0; c < cols; c += 16) {
        __m256 xe[2], xo[2];
        split_prefetch(pf, R, cols, c);
#pragma GCC unroll 2
        for (int i = 0; i < M; i++) xe[i] = _mm256_load_ps(xs + (size_t)i * kp + c), xo[i] = _mm256_load_ps(xs + (size_t)i * kp + c + 8);
#pragma GCC unroll 10
        for (int r = 0; r < R; r++) {
            __m256i v = split_load_w(w + (size_t)r * cols, c, cols);
            __m256 t = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
#pragma GCC unroll 2
            for (int i = 0; i < M; i++) a[R * i + r] = _mm256_fmadd_ps(t, xe[i], a[R * i + r]);
            t = split_odd(v);
#pragma GCC unroll 2
            for (int i = 0; i < M; i++) a[R * i + r] = _mm256_fmadd_ps(t, xo[i], a[R * i + r]);
        }
    }
    split_store(y, ldy, a, M, R);
}

/* weight rows [rb, re) of a block in tiles of R rows, the rest one at a time */
#define SPLIT2_ROWS(tile, M, R)                                                                              \
    do {                                                                                                     \
        int r = rb;                                                                                          \
        for (; r + (R) <= re; r += (R)) {                                                                    \
            const uint16_t *p = pf && r + 2 * SPLIT2_ROW_BLOCK + (R) <= r1 ? w + (size_t)(r + 2 * SPLIT2_ROW_BLOCK) * cols : NULL; \
            tile(y + r, ldy, xs, kp, w + (size_t)r * cols, cols, M, R, p);                                  \
        }                                                                                                    \
        for (; r < re; r++) tile(y + r, ldy, xs, kp, w + (size_t)r * cols, cols, M, 1, NULL);              \
    } while (0)

static AVX2 void split2_rows(float *y, int ldy, const float *xs, size_t kp, const uint16_t *w, int cols, int rb,
                             int re, int r1, bool pf, int M) {
    switch (M) {
    case 5: SPLIT2_ROWS(tile_xw, 5, 2); break;
    case 4: SPLIT2_ROWS(tile_xw, 4, 2); break;
    case 3: SPLIT2_ROWS(tile_xw, 3, 2); break;
    case 2: SPLIT2_ROWS(tile_wx, 2, 5); break;
    default: SPLIT2_ROWS(tile_wx, 1, 10); break;
    }
}

/* the next group of x rows out of m left: 5 or 4 while what remains can still be cut into 5s
 * and 4s (0, 4, 5, 8, 9, 10, 12 and up), else the rest (1, 2, 3) or 4 */
static int split2_group(int m) {
    if (m <= 3) return m;
    int r = m - 5;
    bool five = r == 0 || r == 4 || r == 5 || r >= 8;
    return five ? 5 : 4;
}

AVX2 void cs_gemm_split_avx2(float *y, int ldy, const float *xs, int n, const cs_weight_t *w, int r0, int r1) {
    const uint16_t *wd = w->data;
    int cols = w->cols;
    size_t kp = split_kp(cols);
    for (int rb = r0; rb < r1; rb += SPLIT2_ROW_BLOCK) {
        int re = rb + SPLIT2_ROW_BLOCK < r1 ? rb + SPLIT2_ROW_BLOCK : r1;
        for (int i = 0, m; i < n; i += m) {
            m = split2_group(n - i);
            split2_rows(y + (size_t)i * ldy, ldy, xs + i * kp, kp, wd, cols, rb, re, r1, i == 0, m);
        }
    }
}
/* ---- GEMV: one x row against BF16 weights, memory-bound ----
 * S rows at a time taken from that many separate stretches of [r0, r1), so the loads form as
 * many sequential streams, each prefetched PF bytes ahead. A 32-byte load holds 16 bf16: a
 * shift makes the even elements F32, a mask the odd ones, and they meet x's even and odd
 * elements, deinterleaved once per 16 columns for all the streams. Two tunings, picked per
 * CPU at start-up: 6 streams 768 bytes ahead (the Intel Xeon it was measured on) and 4
 * streams 512 ahead (1.16-1.27x faster on an AMD EPYC, Zen 4; see kernels_avx512.c). */
AVX2 INLINE void gemv_bf16_streams(float *y, const float *x, const uint16_t *w, int cols, int r0, int r1, const int S,
                                   const int PF) {
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    int c16 = cols & ~15;
    int per = (r1 - r0) / S;
    size_t stride = (size_t)per * cols; /* between streams, in bf16 */
    for (int g = 0; g < per; g++) {
        const uint16_t *p = w + (size_t)(r0 + g) * cols;
        __m256 acc[8];
#pragma GCC unroll 8
        for (int s = 0; s < S; s++) acc[s] = _mm256_setzero_ps();
        for (int c = 0; c < c16; c += 16) {
            __m256 x0 = _mm256_loadu_ps(x + c), x1 = _mm256_loadu_ps(x + c + 8);
            /* shuffle leaves the 64-bit pairs (0 2)(8 10)(4 6)(12 14): the permute orders them */
            __m256 xe = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(x0, x1, 0x88)), 0xd8));
            __m256 xo = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(x0, x1, 0xdd)), 0xd8));
#pragma GCC unroll 8
            for (int s = 0; s < S; s++) {
                _mm_prefetch((const char *)(p + s * stride + c) + PF, _MM_HINT_T0);
                __m256i v = _mm256_loadu_si256((const __m256i *)(p + s * stride + c));
                acc[s] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), xe, acc[s]);
                acc[s] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v, hi)), xo, acc[s]);
            }
        }
        for (int c = c16; c < cols; c += 8) { /* the last < 16 columns, 8 lanes at a time */
            int k = cols - c < 8 ? cols - c : 8;
            __m256 xv = loadx_tail(x + c, k);
#pragma GCC unroll 8
            for (int s = 0; s < S; s++)
                acc[s] = _mm256_fmadd_ps(load8_tail(p + s * stride, (size_t)c, k, CS_DTYPE_BF16), xv, acc[s]);
        }
#pragma GCC unroll 8
        for (int s = 0; s < S; s++) y[r0 + s * per + g] = hsum8(acc[s]);
    }
    /* the rows left over */
    int done = per * S;
    if (done < r1 - r0) gemm_tiles_impl(y, 0, x, 1, w, cols, r0 + done, r1, CS_DTYPE_BF16);
}

/* rows back to BF16 (cs_wcode_decode_rows_ref): half h of a block unpacks, in 128-bit lane
 * L, columns 16m + 8h + 4L + e at word 4m + e (low unpack, m < 2; high, m - 2), so group m's 16
 * columns are the same 64-bit quarter of both lanes of both halves: one 64-bit unpack and
 * one permutation each */
AVX2 void cs_wcode_decode_rows_avx2(uint16_t *dst, const cs_wcode_t *c, int r0, int r1) {
    __m256i tbl = wcode_table(c);
    int K = c->cols, full = K / CS_WCODE_BLOCK;
    size_t rb = (size_t)c->blocks * CS_WCODE_BLOCK_BYTES;
    for (int r = r0; r < r1; r++) {
        const uint8_t *row = c->data + (size_t)r * rb;
        uint16_t *d = dst + (size_t)(r - r0) * (size_t)K;
        for (int b = 0; b * CS_WCODE_BLOCK < K; b++) {
            const uint8_t *blk = row + cs_wcode_lo_at(b);
            __m256i nbv = _mm256_loadu_si256((const __m256i *)(row + cs_wcode_codes_at(b))), u[2][2], g[4];
            for (int h = 0; h < 2; h++) {
                __m256i lo = _mm256_loadu_si256((const __m256i *)(blk + 32 * h));
                __m256i hi = _mm256_shuffle_epi8(tbl, wcode_codes(nbv, h));
                u[h][0] = _mm256_unpacklo_epi8(lo, hi);
                u[h][1] = _mm256_unpackhi_epi8(lo, hi);
            }
            for (int q = 0; q < 2; q++) {
                g[2 * q] = _mm256_permute4x64_epi64(_mm256_unpacklo_epi64(u[0][q], u[1][q]), _MM_SHUFFLE(3, 1, 2, 0));
                g[2 * q + 1] = _mm256_permute4x64_epi64(_mm256_unpackhi_epi64(u[0][q], u[1][q]), _MM_SHUFFLE(3, 1, 2, 0));
            }
            uint16_t *o = d + (size_t)b * CS_WCODE_BLOCK;
            if (b < full) {
                for (int m = 0; m < 4; m++) _mm256_storeu_si256((__m256i *)(o + 16 * m), g[m]);
            } else {
                uint16_t t[CS_WCODE_BLOCK] __attribute__((aligned(32)));
                for (int m = 0; m < 4; m++) _mm256_store_si256((__m256i *)(t + 16 * m), g[m]);
                memcpy(o, t, sizeof(uint16_t) * (size_t)(K - b * CS_WCODE_BLOCK));
            }
        }
        cs_wcode_put_exceptions(c, r, d);
    }
}

AVX2 void cs_wcode_gemv_avx2(float *y, const float *x, const cs_wcode_t *c, int r0, int r1, int streams) {
    wcode_gemv(y, x, c, r0, r1, streams, 6, 1152);
}

AVX2 void cs_wcode_rows_avx2(float *y, int ldy, const float *x, int n, const cs_wcode_t *c, int r0, int r1, int streams) {
    if (n == 1) cs_wcode_gemv_avx2(y, x, c, r0, r1, streams);
    else wcode_rows_n(y, ldy, x, n, c, r0, r1);
}

/* y[i, r] = dot(x[i, :], w[r, :]) for r in [r0, r1), i < n: one BF16 row streams, the rest
 * go through the dot tiles (each weight row read once per 4 rows of x); coded weights
 * (--compress-weights) up to CS_WCODE_MAX_N rows through the coded kernels */
AVX2 INLINE void gemv_rows(float *y, int ldy, const float *x, int n, const cs_weight_t *w, int r0, int r1, const int S,
                           const int PF) {
    if (w->code && n <= CS_WCODE_MAX_N) cs_wcode_rows_avx2(y, ldy, x, n, w->code, r0, r1, S);
    else if (n == 1 && w->dtype == CS_DTYPE_BF16) gemv_bf16_streams(y, x, w->data, w->cols, r0, r1, S, PF);
    else cs_gemm_invariant_avx2(y, ldy, x, n, w, r0, r1);
}
AVX2 void cs_gemv_rows_avx2(float *y, int ldy, const float *x, int n, const cs_weight_t *w, int r0, int r1) {
    gemv_rows(y, ldy, x, n, w, r0, r1, 6, 768);
}
AVX2 void cs_gemv_rows_avx2_s4(float *y, int ldy, const float *x, int n, const cs_weight_t *w, int r0, int r1) {
    gemv_rows(y, ldy, x, n, w, r0, r1, 4, 512);
}

/* ---- packed GEMM (prefill): kernels_avx512.c's in 8 lanes: panels of 16 weight rows
 * (panel[k][0..16), widened once per task), x in tiles of 6 rows (xp[tile][k][6]), a 6 × 16
 * register tile (12 accumulators, two weight vectors, one broadcast) over K in chunks ---- */
AVX2 INLINE void packed_tile(float *y, int ldy, const float *xt, int k0, int k1, const float *panel, const int M,
                             int cols) {
    __m256 acc[PK_MR][2];
    packed_tile_sum(acc, xt, k0, k1, panel, M);
#pragma GCC unroll 6
    for (int m = 0; m < M; m++) {
        float *yr = y + (size_t)m * ldy;
        if (cols == PK_NR) {
            if (k0) {
                acc[m][0] = _mm256_add_ps(_mm256_loadu_ps(yr), acc[m][0]);
                acc[m][1] = _mm256_add_ps(_mm256_loadu_ps(yr + 8), acc[m][1]);
            }
            _mm256_storeu_ps(yr, acc[m][0]);
            _mm256_storeu_ps(yr + 8, acc[m][1]);
        } else {
            float t[PK_NR];
            _mm256_storeu_ps(t, acc[m][0]);
            _mm256_storeu_ps(t + 8, acc[m][1]);
            for (int i = 0; i < cols; i++) yr[i] = k0 ? yr[i] + t[i] : t[i];
        }
    }
}

/* rows [r0, r0 + cols) widened and laid down the panel, 8 columns at a time; zero past cols */
AVX2 INLINE void packed_panel(float *panel, const void *w, int K, int r0, int cols, cs_dtype dt) {
    for (int i = 0; i < PK_NR; i++) {
        if (i >= cols) {
            for (int k = 0; k < K; k++) panel[(size_t)k * PK_NR + i] = 0;
            continue;
        }
        size_t base = (size_t)(r0 + i) * K;
        int k = 0;
        for (; k + 8 <= K; k += 8) {
            float t[8];
            _mm256_storeu_ps(t, load8(w, base + k, dt));
            for (int j = 0; j < 8; j++) panel[(size_t)(k + j) * PK_NR + i] = t[j];
        }
        if (k < K) {
            float t[8];
            _mm256_storeu_ps(t, load8_tail(w, base + k, K - k, dt));
            for (int j = 0; j < K - k; j++) panel[(size_t)(k + j) * PK_NR + i] = t[j];
        }
    }
}

#define P2_CASE(M) case M: packed_tile(y, ldy, xt, k0, k1, panel, M, cols); break

AVX2 static void packed_rows(float *y, int ldy, const float *xt, int k0, int k1, const float *panel, int m, int cols) {
    switch (m) {
        P2_CASE(1); P2_CASE(2); P2_CASE(3); P2_CASE(4); P2_CASE(5);
        default: P2_CASE(6);
    }
}

AVX2 void cs_gemm_packed_avx2(float *y, int ldy, const float *xp, int n, const cs_weight_t *w, int r0, int r1, float *wp) {
    packed_gemm(y, ldy, xp, n, w, r0, r1, wp);
}

/* ---- widening for the sgemm path ---- */
AVX2 INLINE void convert_impl(float *dst, const void *w, size_t i0, size_t count, cs_dtype dt) {
    size_t c = 0;
    for (; c + 16 <= count; c += 16) {
        _mm256_storeu_ps(dst + c, load8(w, i0 + c, dt));
        _mm256_storeu_ps(dst + c + 8, load8(w, i0 + c + 8, dt));
    }
    for (; c + 8 <= count; c += 8) _mm256_storeu_ps(dst + c, load8(w, i0 + c, dt));
    for (; c < count; c++)
        dst[c] = dt == CS_DTYPE_BF16 ? cs_bf16_to_f32(((const uint16_t *)w)[i0 + c])
                                     : cs_f16_to_f32(((const uint16_t *)w)[i0 + c]);
}

AVX2 void cs_convert_rows_avx2(float *dst, const cs_weight_t *w, int r0, int r1) {
    size_t i0 = (size_t)r0 * w->cols, count = (size_t)(r1 - r0) * w->cols;
    if (w->dtype == CS_DTYPE_BF16) convert_impl(dst, w->data, i0, count, CS_DTYPE_BF16);
    else if (w->dtype == CS_DTYPE_F16) convert_impl(dst, w->data, i0, count, CS_DTYPE_F16);
    else memcpy(dst, (const float *)w->data + i0, count * sizeof(float));
}

/* ---- softmax ---- */
/* exp of 8 lanes: Cephes' expf polynomial on the reduced argument, scaled by 2^n built in
 * the exponent bits (max relative error ~2 ulp; anything below -87.3 gives 0, anything above 88
 * is taken as 88). The same polynomial as the AVX-512 exp16. */
AVX2 INLINE __m256 exp8(__m256 x) {
    __m256 below = _mm256_cmp_ps(x, _mm256_set1_ps(-87.33654f), _CMP_LT_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.33654f));
    x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3333300175E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* 2^n for n in [-126, 127]: the biased exponent in place */
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(below, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* gate[i] = silu(gate[i]) · up[i] = gate / (1 + e^-gate) · up */
AVX2 void cs_silu_mul_avx2(float *gate, const float *up, size_t n) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 sg = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g))));
        _mm256_storeu_ps(gate + i, _mm256_mul_ps(sg, _mm256_loadu_ps(up + i)));
    }
    if (i < n) cs_silu_mul_ref(gate + i, up + i, n - i);
}

AVX2 void cs_softmax_avx2(float *x, int n) {
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 8 <= n; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(x + i));
    float mx = -INFINITY;
    {
        float t[8];
        _mm256_storeu_ps(t, vmax);
        for (int k = 0; k < 8; k++) mx = t[k] > mx ? t[k] : mx;
        for (int k = i; k < n; k++) mx = x[k] > mx ? x[k] : mx;
    }
    __m256 vm = _mm256_set1_ps(mx), vsum = _mm256_setzero_ps();
    for (i = 0; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
        _mm256_storeu_ps(x + i, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    if (i < n) {
        int k = n - i;
        float t[8] = {0};
        memcpy(t, x + i, sizeof(float) * (size_t)k);
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(t), vm));
        _mm256_storeu_ps(t, e);
        for (int q = k; q < 8; q++) t[q] = 0;
        memcpy(x + i, t, sizeof(float) * (size_t)k);
        vsum = _mm256_add_ps(vsum, _mm256_loadu_ps(t));
    }
    __m256 inv = _mm256_set1_ps(1.0f / hsum8(vsum));
    for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
    float s = _mm256_cvtss_f32(inv);
    for (; i < n; i++) x[i] *= s;
}

/* ---- one query of paged attention, heads [h0, h1) ----
 * As the AVX-512 rows path (cpu_backend.c): the keys block by block and row by row, each
 * row's slice of the heads once, in order (a block's rows are adjacent, so the reads stream);
 * s[(h - h0) · len + t - first] = scale · q_h·k_t, softmax per head, out_h = Σ p_t v_t summed
 * in out itself. Key and value rows found through the block table; head_dim a multiple of 8;
 * BF16 pools widened to F32 as loaded. Each head's arithmetic is the same whatever the range. */
AVX2 INLINE __m256 kv_load8(const void *pool, size_t i, bool bf16) {
    if (bf16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)pool + i))), 16));
    return _mm256_loadu_ps((const float *)pool + i);
}

AVX2 INLINE void attn_rows_paged(float *out, float *s, const float *q, const void *k, const void *v, const bool bf16,
                                 const int32_t *blocks, int bs, int first, int last, int h0, int h1, int g,
                                 size_t kv_dim, float scale, int hd) {
    const int len = last - first + 1;
    const size_t esz = bf16 ? 2 : 4, lo = (size_t)(h0 / g) * hd, hi = (size_t)((h1 - 1) / g + 1) * hd;
    /* two blocks ahead into L2 (the blocks are scattered in the pool): the first two lines
     * of each row where the task reads whole rows (the hardware prefetchers take a block on
     * from there), every line of a narrower slice */
    size_t lines = ((hi - lo) * esz + 63) / 64;
    if (lo == 0 && hi == kv_dim && lines > 2) lines = 2;
#define ROWS_PF(pool, bi)                                                                                  \
    for (int pt = CS_MAX(first, (bi) * bs); pt <= CS_MIN(last, (bi) * bs + bs - 1); pt++) {                  \
        const char *pr = (const char *)(pool) + (cs_paged_row(blocks, bs, pt) * kv_dim + lo) * esz;         \
        for (size_t l = 0; l < lines; l++) _mm_prefetch(pr + 64 * l, _MM_HINT_T1);                          \
    }
    ROWS_PF(k, first / bs);
    ROWS_PF(k, first / bs + 1);
    for (int tb = first; tb <= last;) {
        int te = CS_MIN(last, (tb / bs + 1) * bs - 1);
        ROWS_PF(k, tb / bs + 2);
        size_t row0 = (size_t)blocks[tb / bs] * (size_t)bs + (size_t)(tb % bs);
        for (int t = tb; t <= te; t++) {
            size_t rb = (row0 + (size_t)(t - tb)) * kv_dim;
            for (int h = h0; h < h1; h++) {
                size_t kr = rb + (size_t)(h / g) * hd;
                const float *qh = q + (size_t)h * hd;
                __m256 d0 = _mm256_setzero_ps(), d1 = _mm256_setzero_ps();
                int e = 0;
                for (; e + 16 <= hd; e += 16) {
                    d0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + e), kv_load8(k, kr + (size_t)e, bf16), d0);
                    d1 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + e + 8), kv_load8(k, kr + (size_t)e + 8, bf16), d1);
                }
                if (e < hd) d0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + e), kv_load8(k, kr + (size_t)e, bf16), d0);
                s[(size_t)(h - h0) * len + (t - first)] = hsum8(_mm256_add_ps(d0, d1)) * scale;
            }
        }
        tb = te + 1;
    }
    ROWS_PF(v, first / bs);
    ROWS_PF(v, first / bs + 1);
    for (int h = h0; h < h1; h++) cs_softmax_avx2(s + (size_t)(h - h0) * len, len);
    memset(out + (size_t)h0 * hd, 0, sizeof(float) * (size_t)(h1 - h0) * hd);
    for (int tb = first; tb <= last;) {
        int te = CS_MIN(last, (tb / bs + 1) * bs - 1);
        ROWS_PF(v, tb / bs + 2);
        size_t row0 = (size_t)blocks[tb / bs] * (size_t)bs + (size_t)(tb % bs);
        for (int t = tb; t <= te; t++) {
            size_t rb = (row0 + (size_t)(t - tb)) * kv_dim;
            for (int h = h0; h < h1; h++) {
                size_t vr = rb + (size_t)(h / g) * hd;
                float *oh = out + (size_t)h * hd;
                __m256 w = _mm256_set1_ps(s[(size_t)(h - h0) * len + (t - first)]);
                for (int c = 0; c < hd; c += 8)
                    _mm256_storeu_ps(oh + c, _mm256_fmadd_ps(w, kv_load8(v, vr + (size_t)c, bf16), _mm256_loadu_ps(oh + c)));
            }
        }
        tb = te + 1;
    }
#undef ROWS_PF
}

AVX2 void cs_attn_rows_paged_avx2(float *out, float *s, const float *q, const void *k, const void *v, cs_dtype kv_dtype,
                                  const int32_t *blocks, int bs, int first, int last, int h0, int h1, int g,
                                  size_t kv_dim, float scale, int hd) {
    if (kv_dtype == CS_DTYPE_BF16) attn_rows_paged(out, s, q, k, v, true, blocks, bs, first, last, h0, h1, g, kv_dim, scale, hd);
    else attn_rows_paged(out, s, q, k, v, false, blocks, bs, first, last, h0, h1, g, kv_dim, scale, hd);
}
