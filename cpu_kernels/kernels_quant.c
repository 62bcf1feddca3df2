/* kernels_quant.c: matmuls against block-quantized weights (GGUF's Q4_0 .. Q6_K, base/quant.h)
 * with F32 activations: each weight is dequantized in registers to the F32 value
 * cs_dequant_row_ref gives it (up to one rounding: s·q + o fused where the reference rounds
 * s·q first) and multiplied in F32, so a quantized model computes what an F32 model with the
 * dequantized weights computes (the `exact` precision). The GEMV streams the packed blocks
 * once for up to CS_QGEMV_MAX_N rows of x (decode: memory-bound, 4.5-8.5 bits a weight);
 * larger batches dequantize a task's weight rows to F32 (cs_qdequant_rows_*) for the packed
 * GEMM (compute-bound: the dequantization is paid once per weight row for all rows of x).
 *
 * Every block type is decoded 32 elements at a time into 32 signed bytes q, a scale for
 * each half (two where Q6_K's 16-element sub-blocks differ) and an offset o: w = s·q + o. */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/quant.h"
#include "cpu_kernels/kernels.h"

#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))

/* the 32 elements [32k, 32k + 32) of a block: q, the scales of elements 0-15 and 16-31, o */
typedef struct chunk {
    __m256i q;
    float s0, s1, o;
} chunk_t;

/* per block: what every chunk of it needs (the K types' 8 or 16 sub-block scales) */
typedef struct blk_state {
    float s[16], o[8];
} blk_state_t;

static inline int blk_chunks(cs_dtype dt) { return cs_dtype_block(dt) / 32; }

/* an F16 scale widened exactly (F16C: the same value as cs_f16_to_f32, subnormals included) */
AVX2 INLINE float h2f(uint16_t h) { return _cvtsh_ss(h); }

AVX2 INLINE __m256i nibbles32(__m128i qs) { /* 16 bytes: low nibbles, then high nibbles */
    __m128i m = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), m), _mm_and_si128(qs, m));
}

/* byte j of the result: 0x10 where bit j of h is set */
AVX2 INLINE __m256i bits32(uint32_t h) {
    __m256i v = _mm256_set1_epi32((int)h);
    /* byte j takes byte j / 8 of h */
    __m256i idx = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
    v = _mm256_shuffle_epi8(v, idx);
    __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

AVX2 INLINE void blk_setup(cs_dtype dt, const uint8_t *b, blk_state_t *st) {
    if (dt == CS_DTYPE_Q4_K || dt == CS_DTYPE_Q5_K) {
        const cs_block_q4_K *k = (const void *)b; /* Q5_K begins the same way */
        float d = h2f(k->d), dmin = h2f(k->dmin);
        for (int j = 0; j < 8; j++) {
            uint8_t sc, m;
            cs_q4k_scale_min(j, k->scales, &sc, &m);
            st->s[j] = d * sc;
            st->o[j] = -(dmin * m);
        }
    } else if (dt == CS_DTYPE_Q6_K) {
        const cs_block_q6_K *k = (const void *)b;
        float d = h2f(k->d);
        for (int j = 0; j < 16; j++) st->s[j] = d * k->scales[j];
    }
}

AVX2 INLINE chunk_t blk_chunk(cs_dtype dt, const uint8_t *b, int c, const blk_state_t *st) {
    chunk_t r;
    switch (dt) {
    case CS_DTYPE_Q4_0: {
        const cs_block_q4_0 *k = (const void *)b;
        r.q = _mm256_sub_epi8(nibbles32(_mm_loadu_si128((const __m128i *)k->qs)), _mm256_set1_epi8(8));
        r.s0 = r.s1 = h2f(k->d);
        r.o = 0;
        break;
    }
    case CS_DTYPE_Q4_1: {
        const cs_block_q4_1 *k = (const void *)b;
        r.q = nibbles32(_mm_loadu_si128((const __m128i *)k->qs));
        r.s0 = r.s1 = h2f(k->d);
        r.o = h2f(k->m);
        break;
    }
    case CS_DTYPE_Q5_0: {
        const cs_block_q5_0 *k = (const void *)b;
        uint32_t h;
        memcpy(&h, k->qh, 4);
        r.q = _mm256_or_si256(nibbles32(_mm_loadu_si128((const __m128i *)k->qs)), bits32(h));
        r.q = _mm256_sub_epi8(r.q, _mm256_set1_epi8(16));
        r.s0 = r.s1 = h2f(k->d);
        r.o = 0;
        break;
    }
    case CS_DTYPE_Q5_1: {
        const cs_block_q5_1 *k = (const void *)b;
        uint32_t h;
        memcpy(&h, k->qh, 4);
        r.q = _mm256_or_si256(nibbles32(_mm_loadu_si128((const __m128i *)k->qs)), bits32(h));
        r.s0 = r.s1 = h2f(k->d);
        r.o = h2f(k->m);
        break;
    }
    case CS_DTYPE_Q8_0: {
        const cs_block_q8_0 *k = (const void *)b;
        r.q = _mm256_loadu_si256((const __m256i *)k->qs);
        r.s0 = r.s1 = h2f(k->d);
        r.o = 0;
        break;
    }
    case CS_DTYPE_Q4_K: { /* sub-block c: the low (c even) or high nibbles of qs[32 (c / 2) ..] */
        const cs_block_q4_K *k = (const void *)b;
        __m256i v = _mm256_loadu_si256((const __m256i *)(k->qs + 32 * (c >> 1)));
        if (c & 1) v = _mm256_srli_epi16(v, 4);
        r.q = _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
        r.s0 = r.s1 = st->s[c];
        r.o = st->o[c];
        break;
    }
    case CS_DTYPE_Q5_K: { /* ... and the fifth bit: bit c of qh[l] */
        const cs_block_q5_K *k = (const void *)b;
        __m256i v = _mm256_loadu_si256((const __m256i *)(k->qs + 32 * (c >> 1)));
        if (c & 1) v = _mm256_srli_epi16(v, 4);
        __m256i h = _mm256_loadu_si256((const __m256i *)k->qh);
        h = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(c)), _mm256_set1_epi8(1));
        r.q = _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi8(0x0F)), _mm256_slli_epi16(h, 4));
        r.s0 = r.s1 = st->s[c];
        r.o = st->o[c];
        break;
    }
    case CS_DTYPE_Q6_K: { /* half c / 4 of the block, quarter t = c % 4 of it */
        const cs_block_q6_K *k = (const void *)b;
        int h = c >> 2, t = c & 3;
        __m256i l = _mm256_loadu_si256((const __m256i *)(k->ql + 64 * h + 32 * (t & 1)));
        if (t & 2) l = _mm256_srli_epi16(l, 4);
        l = _mm256_and_si256(l, _mm256_set1_epi8(0x0F));
        __m256i hb = _mm256_loadu_si256((const __m256i *)(k->qh + 32 * h));
        hb = _mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(2 * t)), _mm256_set1_epi8(3));
        r.q = _mm256_sub_epi8(_mm256_or_si256(l, _mm256_slli_epi16(hb, 4)), _mm256_set1_epi8(32));
        r.s0 = st->s[8 * h + 2 * t];
        r.s1 = st->s[8 * h + 2 * t + 1];
        r.o = 0;
        break;
    }
    default:
        r.q = _mm256_setzero_si256();
        r.s0 = r.s1 = r.o = 0;
    }
    return r;
}

/* the chunk's 32 weights as four vectors of 8 F32 */
AVX2 INLINE void chunk_f32(const chunk_t *k, __m256 w[4]) {
    __m128i lo = _mm256_castsi256_si128(k->q), hi = _mm256_extracti128_si256(k->q, 1);
    __m256 s0 = _mm256_set1_ps(k->s0), s1 = _mm256_set1_ps(k->s1), o = _mm256_set1_ps(k->o);
    w[0] = _mm256_fmadd_ps(s0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), o);
    w[1] = _mm256_fmadd_ps(s0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), o);
    w[2] = _mm256_fmadd_ps(s1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), o);
    w[3] = _mm256_fmadd_ps(s1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), o);
}

AVX2 INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* the 32 signed bytes of a chunk as four vectors of 8 F32 (exact: |q| < 2^7) */
AVX2 INLINE void q_f32(__m256i q, __m256 f[4]) {
    __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    f[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    f[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

static inline bool has_offset(cs_dtype dt) {
    return dt == CS_DTYPE_Q4_1 || dt == CS_DTYPE_Q5_1 || dt == CS_DTYPE_Q4_K || dt == CS_DTYPE_Q5_K;
}

/* Rows [r0, r1) of w against n ≤ CS_QGEMV_MAX_N rows of x. Σ_j (s q_j + o) x_j is taken as
 * s · Σ q_j x_j + o · Σ x_j: per 8 weights a widening, a conversion and one FMA, the scale once
 * per 16 or 32 and the offset against x's sums per 32 (computed once per call). */
AVX2 INLINE void qgemv_t(float *y, int ldy, const float *x, const int n, const cs_weight_t *w, int r0, int r1, cs_dtype dt) {
    const int nb = w->cols / cs_dtype_block(dt), nc = blk_chunks(dt), groups = w->cols / 32;
    const size_t bsz = cs_dtype_size(dt), rb = (size_t)nb * bsz;
    float xsum_buf[CS_QGEMV_MAX_N * 512], *xsum = NULL;
    if (has_offset(dt)) { /* Σ x over each 32 columns, per row of x */
        xsum = (size_t)n * groups <= CS_ARRAY_LEN(xsum_buf) ? xsum_buf : malloc(sizeof(float) * (size_t)n * groups);
        CS_ASSERT(xsum);
        for (int i = 0; i < n; i++)
            for (int g = 0; g < groups; g++) {
                const float *xg = x + (size_t)i * w->cols + 32 * (size_t)g;
                __m256 v = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xg), _mm256_loadu_ps(xg + 8)),
                                         _mm256_add_ps(_mm256_loadu_ps(xg + 16), _mm256_loadu_ps(xg + 24)));
                xsum[(size_t)i * groups + g] = hsum8(v);
            }
    }
    for (int r = r0; r < r1; r++) {
        const uint8_t *row = (const uint8_t *)w->data + (size_t)r * rb;
        __m256 acc[CS_QGEMV_MAX_N];
        float off[CS_QGEMV_MAX_N];
        for (int i = 0; i < n; i++) { acc[i] = _mm256_setzero_ps(); off[i] = 0; }
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = row + (size_t)b * bsz;
            blk_state_t st;
            blk_setup(dt, blk, &st);
#pragma GCC unroll 8
            for (int c = 0; c < nc; c++) { /* unrolled: the chunk's shifts become constants */
                chunk_t k = blk_chunk(dt, blk, c, &st);
                __m256 f[4];
                q_f32(k.q, f);
                const size_t g = (size_t)b * nc + (size_t)c, col = 32 * g;
                __m256 s0 = _mm256_set1_ps(k.s0), s1 = _mm256_set1_ps(k.s1);
                for (int i = 0; i < n; i++) {
                    const float *xi = x + (size_t)i * w->cols + col;
                    __m256 a0 = _mm256_mul_ps(f[0], _mm256_loadu_ps(xi));
                    __m256 a1 = _mm256_mul_ps(f[2], _mm256_loadu_ps(xi + 16));
                    a0 = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xi + 8), a0);
                    a1 = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xi + 24), a1);
                    acc[i] = _mm256_fmadd_ps(s0, a0, acc[i]);
                    acc[i] = _mm256_fmadd_ps(s1, a1, acc[i]);
                    if (has_offset(dt)) off[i] += k.o * xsum[(size_t)i * groups + g];
                }
            }
        }
        for (int i = 0; i < n; i++) y[(size_t)i * ldy + r] = hsum8(acc[i]) + off[i];
    }
    if (xsum && xsum != xsum_buf) free(xsum);
}

/* rows [r0, r1) dequantized to F32, cols apart */
AVX2 INLINE void qdequant_t(float *dst, const cs_weight_t *w, int r0, int r1, cs_dtype dt) {
    const int nb = w->cols / cs_dtype_block(dt), nc = blk_chunks(dt);
    const size_t bsz = cs_dtype_size(dt), rb = (size_t)nb * bsz;
    for (int r = r0; r < r1; r++) {
        const uint8_t *row = (const uint8_t *)w->data + (size_t)r * rb;
        float *o = dst + (size_t)(r - r0) * w->cols;
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = row + (size_t)b * bsz;
            blk_state_t st;
            blk_setup(dt, blk, &st);
            for (int c = 0; c < nc; c++) {
                chunk_t k = blk_chunk(dt, blk, c, &st);
                __m256 wv[4];
                chunk_f32(&k, wv);
                float *p = o + (size_t)b * cs_dtype_block(dt) + 32 * (size_t)c;
                for (int v = 0; v < 4; v++) _mm256_storeu_ps(p + 8 * v, wv[v]);
            }
        }
    }
}

/* one instance per type and per n (a constant n keeps the weights in registers across x's rows) */
#define PER_TYPE(F, T)                                                                                                 \
    AVX2 static void qgemv_##T(float *y, int ldy, const float *x, int n, const cs_weight_t *w, int r0, int r1) {   \
        switch (n) {                                                                                                   \
        case 1: qgemv_t(y, ldy, x, 1, w, r0, r1, CS_DTYPE_##T); break;                                                \
        case 2: qgemv_t(y, ldy, x, 2, w, r0, r1, CS_DTYPE_##T); break;                                                \
        case 3: qgemv_t(y, ldy, x, 3, w, r0, r1, CS_DTYPE_##T); break;                                                \
        default: qgemv_t(y, ldy, x, 4, w, r0, r1, CS_DTYPE_##T); break;                                               \
        }                                                                                                              \
    }                                                                                                                  \
    AVX2 static void qdeq_##T(float *dst, const cs_weight_t *w, int r0, int r1) { qdequant_t(dst, w, r0, r1, CS_DTYPE_##T); }
PER_TYPE(, Q4_0)
PER_TYPE(, Q4_1)
PER_TYPE(, Q5_0)
PER_TYPE(, Q5_1)
PER_TYPE(, Q8_0)
PER_TYPE(, Q4_K)
PER_TYPE(, Q5_K)
PER_TYPE(, Q6_K)
#undef PER_TYPE

void cs_qgemv_rows_avx2(float *y, int ldy, const float *x, int n, const cs_weight_t *w, int r0, int r1) {
    CS_ASSERT(n >= 1 && n <= CS_QGEMV_MAX_N);
    switch (w->dtype) {
    case CS_DTYPE_Q4_0: qgemv_Q4_0(y, ldy, x, n, w, r0, r1); break;
    case CS_DTYPE_Q4_1: qgemv_Q4_1(y, ldy, x, n, w, r0, r1); break;
    case CS_DTYPE_Q5_0: qgemv_Q5_0(y, ldy, x, n, w, r0, r1); break;
    case CS_DTYPE_Q5_1: qgemv_Q5_1(y, ldy, x, n, w, r0, r1); break;
    case CS_DTYPE_Q8_0: qgemv_Q8_0(y, ldy, x, n, w, r0, r1); break;
    case CS_DTYPE_Q4_K: qgemv_Q4_K(y, ldy, x, n, w, r0, r1); break;
    case CS_DTYPE_Q5_K: qgemv_Q5_K(y, ldy, x, n, w, r0, r1); break;
    case CS_DTYPE_Q6_K: qgemv_Q6_K(y, ldy, x, n, w, r0, r1); break;
    default: CS_ASSERT(!"quantized dtype");
    }
}

void cs_qdequant_rows_avx2(float *dst, const cs_weight_t *w, int r0, int r1) {
    switch (w->dtype) {
    case CS_DTYPE_Q4_0: qdeq_Q4_0(dst, w, r0, r1); break;
    case CS_DTYPE_Q4_1: qdeq_Q4_1(dst, w, r0, r1); break;
    case CS_DTYPE_Q5_0: qdeq_Q5_0(dst, w, r0, r1); break;
    case CS_DTYPE_Q5_1: qdeq_Q5_1(dst, w, r0, r1); break;
    case CS_DTYPE_Q8_0: qdeq_Q8_0(dst, w, r0, r1); break;
    case CS_DTYPE_Q4_K: qdeq_Q4_K(dst, w, r0, r1); break;
    case CS_DTYPE_Q5_K: qdeq_Q5_K(dst, w, r0, r1); break;
    case CS_DTYPE_Q6_K: qdeq_Q6_K(dst, w, r0, r1); break;
    default: CS_ASSERT(!"quantized dtype");
    }
}

void cs_qdequant_rows_ref(float *dst, const cs_weight_t *w, int r0, int r1) {
    size_t rb = cs_dtype_row_bytes(w->dtype, w->cols);
    for (int r = r0; r < r1; r++)
        cs_dequant_row_ref(dst + (size_t)(r - r0) * w->cols, (const char *)w->data + (size_t)r * rb, w->dtype, w->cols);
}

/* the plain GEMV: each row dequantized (cs_dequant_row_ref), then F32 products summed in
 * column order; what the batch-invariant mode runs without AVX2 */
void cs_qgemv_rows_ref(float *y, int ldy, const float *x, int n, const cs_weight_t *w, int r0, int r1) {
    size_t rb = cs_dtype_row_bytes(w->dtype, w->cols);
    float *row = malloc(sizeof(float) * (size_t)w->cols);
    CS_ASSERT(row);
    for (int r = r0; r < r1; r++) {
        cs_dequant_row_ref(row, (const char *)w->data + (size_t)r * rb, w->dtype, w->cols);
        for (int i = 0; i < n; i++) {
            const float *xi = x + (size_t)i * w->cols;
            float s = 0;
            for (int c = 0; c < w->cols; c++) s += xi[c] * row[c];
            y[(size_t)i * ldy + r] = s;
        }
    }
    free(row);
}

/* ---- --precision int8: 8-bit activations, integer products ----
 * x is quantized per 32 elements (cs_quantize_act_ref); a chunk's dot is then Σ q_w q_x in
 * integers (vpmaddubsw pairs, vpmaddwd to 32 bits: exact, |q_w| <= 128 and |q_x| <= 127 keep
 * every pair sum below 2^15), scaled by s · d_x in F32, the offset o · d_x · Σ q_x beside. That
 * is, exactly up to F32 rounding, the exact matmul on x̂ = d_x q_x (what the tests hold it to). */

/* the block's scale as llama.cpp holds it, so the products are the ones it multiplies: Q8_0/Q8_1
 * blocks of 32 keep max|x| / 127 in F16, Q8_K blocks of 256 keep 1 / (127 / max|x|) in F32 */
static float act_scale(float amax, float id, int block) {
    if (amax == 0) return 0;
    return block == 32 ? cs_f16_to_f32(cs_f32_to_f16(amax / 127.0f)) : 1.0f / id;
}

void cs_quantize_act_ref(int8_t *q, float *d, float *sum, const float *x, int64_t n, int block) {
    for (int64_t b = 0; b < n / block; b++) {
        const float *xb = x + (int64_t)block * b;
        float amax = 0;
        for (int j = 0; j < block; j++) amax = fmaxf(amax, fabsf(xb[j]));
        float id = amax > 0 ? 127.0f / amax : 0.0f;
        for (int g = 0; g < block / 32; g++) {
            int s = 0;
            for (int j = 32 * g; j < 32 * g + 32; j++) {
                int v = (int)nearbyintf(xb[j] * id); /* nearest, ties to even: the SIMD conversion's rounding */
                v = v > 127 ? 127 : v < -127 ? -127 : v;
                q[(int64_t)block * b + j] = (int8_t)v;
                s += v;
            }
            sum[b * (block / 32) + g] = (float)s;
        }
        d[b] = act_scale(amax, id, block);
    }
}

/* 32 elements of x times id, rounded to the nearest (even) int8, and their sum */
AVX2 INLINE void act_group(int8_t *q, float *sum, const float *xg, float id) {
    __m256 v[4];
    for (int k = 0; k < 4; k++) v[k] = _mm256_loadu_ps(xg + 8 * k);
    __m256 idv = _mm256_set1_ps(id);
    __m256i i32[4];
    for (int k = 0; k < 4; k++) i32[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], idv)); /* nearest even */
    /* pack 32 int32 to 32 int8 in element order (the packs interleave the 128-bit lanes) */
    __m256i a = _mm256_packs_epi32(i32[0], i32[1]), b = _mm256_packs_epi32(i32[2], i32[3]);
    __m256i p = _mm256_packs_epi16(a, b);
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    p = _mm256_max_epi8(p, _mm256_set1_epi8(-127));
    _mm256_storeu_si256((__m256i *)q, p);
    __m256i s16 = _mm256_maddubs_epi16(_mm256_set1_epi8(1), p);
    __m256i s32 = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    *sum = (float)_mm_cvtsi128_si32(t);
}

AVX2 void cs_quantize_act_avx2(int8_t *q, float *d, float *sum, const float *x, int64_t n, int block) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < n / block; b++) {
        const float *xb = x + (int64_t)block * b;
        __m256 m = _mm256_setzero_ps();
        for (int j = 0; j < block; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + j)));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        float amax = _mm_cvtss_f32(h), id = amax > 0 ? 127.0f / amax : 0.0f;
        d[b] = act_scale(amax, id, block);
        for (int g = 0; g < block / 32; g++)
            act_group(q + (int64_t)block * b + 32 * g, sum + b * (block / 32) + g, xb + 32 * g, id);
    }
}

/* the weights' q (signed, or unsigned 0..31 where the type has an offset) against x's q: 8
 * int32 lanes, lanes 0-3 from elements 0-15, 4-7 from 16-31 */
AVX2 INLINE __m256i idot32(__m256i qw, __m256i qx, bool unsig) {
    __m256i p = unsig ? _mm256_maddubs_epi16(qw, qx)
                      : _mm256_maddubs_epi16(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(qx, qw));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

#define QPREFETCH 1536 /* bytes ahead of the block being read that the int8 GEMVs prefetch */

AVX2 INLINE void qgemv_int8_t(float *y, int ldy, const int8_t *qx, const float *dx, const float *sx, const int n,
                              const cs_weight_t *w, int r0, int r1, cs_dtype dt) {
    const int nb = w->cols / cs_dtype_block(dt), nc = blk_chunks(dt), groups = w->cols / 32;
    const size_t bsz = cs_dtype_size(dt), rb = (size_t)nb * bsz;
    const bool unsig = has_offset(dt);
    for (int r = r0; r < r1; r++) {
        const uint8_t *row = (const uint8_t *)w->data + (size_t)r * rb;
        __m256 acc[CS_QGEMV_MAX_N];
        float off[CS_QGEMV_MAX_N];
        for (int i = 0; i < n; i++) { acc[i] = _mm256_setzero_ps(); off[i] = 0; }
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = row + (size_t)b * bsz;
            if ((b & 1) == 0) _mm_prefetch((const char *)blk + QPREFETCH, _MM_HINT_T0);
            blk_state_t st;
            blk_setup(dt, blk, &st);
#pragma GCC unroll 8
            for (int c = 0; c < nc; c++) {
                chunk_t k = blk_chunk(dt, blk, c, &st);
                const size_t g = (size_t)b * nc + (size_t)c;
                __m256 s = _mm256_setr_m128(_mm_set1_ps(k.s0), _mm_set1_ps(k.s1));
                for (int i = 0; i < n; i++) {
                    const size_t gi = (size_t)i * groups + g;
                    __m256i q = _mm256_loadu_si256((const __m256i *)(qx + 32 * gi));
                    __m256 f = _mm256_cvtepi32_ps(idot32(k.q, q, unsig));
                    acc[i] = _mm256_fmadd_ps(f, _mm256_mul_ps(s, _mm256_set1_ps(dx[gi])), acc[i]);
                    if (unsig) off[i] += k.o * dx[gi] * sx[gi];
                }
            }
        }
        for (int i = 0; i < n; i++) y[(size_t)i * ldy + r] = hsum8(acc[i]) + off[i];
    }
}

/* The K types against x quantized per 256 (one scale a super-block, as llama.cpp's Q8_K): a
 * super-block's sub-block dots are summed in integers with their integer scales (vpmaddwd),
 * then scaled once by d_w · d_x in F32; Q4_K/Q5_K's minima come off as
 * dmin · d_x · Σ_j m_j Σ q_x over sub-block j. Every integer sum stays below 2^24. */
AVX2 INLINE void qgemv_int8_k_t(float *y, int ldy, const int8_t *qx, const float *dx, const float *sx, const int n,
                                const cs_weight_t *w, int r0, int r1, cs_dtype dt) {
    const int nb = w->cols / CS_QK_K, groups = w->cols / 32;
    const size_t bsz = cs_dtype_size(dt), rb = (size_t)nb * bsz;
    const bool q6 = dt == CS_DTYPE_Q6_K;
    for (int r = r0; r < r1; r++) {
        const uint8_t *row = (const uint8_t *)w->data + (size_t)r * rb;
        __m256 acc[CS_QGEMV_MAX_N], offv[CS_QGEMV_MAX_N];
        for (int i = 0; i < n; i++) acc[i] = offv[i] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = row + (size_t)b * bsz;
            for (size_t o = 0; o < bsz; o += 64) _mm_prefetch((const char *)blk + QPREFETCH + o, _MM_HINT_T0);
            int16_t sc[16]; /* Q6_K: its 16 scales */
            __m256i sc16 = _mm256_setzero_si256(); /* Q4_K/Q5_K: the 8 scales as int16, in both halves */
            uint64_t mn = 0;
            float d, dmin = 0;
            if (q6) {
                const cs_block_q6_K *k = (const void *)blk;
                for (int j = 0; j < 16; j++) sc[j] = k->scales[j];
                d = h2f(k->d);
            } else {
                /* cs_q4k_scale_min for all j at once, on 32-bit words of the 12 scale bytes */
                const cs_block_q4_K *k = (const void *)blk;
                uint32_t a, bw, cw;
                memcpy(&a, k->scales, 4);
                memcpy(&bw, k->scales + 4, 4);
                memcpy(&cw, k->scales + 8, 4);
                uint32_t s_lo = a & 0x3f3f3f3fu, m_lo = bw & 0x3f3f3f3fu;
                uint32_t s_hi = (cw & 0x0f0f0f0fu) | (((a >> 6) & 0x03030303u) << 4);
                uint32_t m_hi = ((cw >> 4) & 0x0f0f0f0fu) | (((bw >> 6) & 0x03030303u) << 4);
                __m128i s8 = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)s_hi, (int)s_lo));
                sc16 = _mm256_set_m128i(s8, s8);
                mn = (uint64_t)m_hi << 32 | m_lo;
                d = h2f(k->d);
                dmin = h2f(k->dmin);
            }
            __m256i sumi[CS_QGEMV_MAX_N];
            for (int i = 0; i < n; i++) sumi[i] = _mm256_setzero_si256();
            blk_state_t st = {{0}, {0}}; /* the chunks' float scales go unused here */
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++) {
                chunk_t k = blk_chunk(dt, blk, c, &st);
                /* sub-block c's scale in every int16 lane (Q6_K: its two 16-element halves') */
                __m256i scv = q6 ? _mm256_setr_m128i(_mm_set1_epi16(sc[2 * c]), _mm_set1_epi16(sc[2 * c + 1]))
                                 : _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((short)(0x0100 + 0x0202 * c)));
                __m256i qa = q6 ? _mm256_sign_epi8(k.q, k.q) : k.q;
                for (int i = 0; i < n; i++) {
                    __m256i q = _mm256_loadu_si256((const __m256i *)(qx + (size_t)i * w->cols + (size_t)CS_QK_K * b + 32 * c));
                    __m256i p = _mm256_maddubs_epi16(qa, q6 ? _mm256_sign_epi8(q, k.q) : q);
                    sumi[i] = _mm256_add_epi32(sumi[i], _mm256_madd_epi16(p, scv));
                }
            }
            /* the minima in lanes (a scalar sum here is a chain of dependent adds) */
            __m256 mv = q6 ? _mm256_setzero_ps() : _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn)));
            for (int i = 0; i < n; i++) {
                float dd = dx[(size_t)i * nb + b];
                acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(d * dd), _mm256_cvtepi32_ps(sumi[i]), acc[i]);
                if (!q6)
                    offv[i] = _mm256_fmadd_ps(_mm256_set1_ps(dmin * dd),
                                              _mm256_mul_ps(mv, _mm256_loadu_ps(sx + (size_t)i * groups + 8 * (size_t)b)), offv[i]);
            }
        }
        for (int i = 0; i < n; i++) y[(size_t)i * ldy + r] = hsum8(_mm256_sub_ps(acc[i], offv[i]));
    }
}

#define PER_TYPE_I8(T)                                                                                                 \
    AVX2 static void qgemv_i8_##T(float *y, int ldy, const int8_t *qx, const float *dx, const float *sx, int n,       \
                                  const cs_weight_t *w, int r0, int r1) {                                              \
        if (cs_dtype_block(CS_DTYPE_##T) == CS_QK_K) {                                                                 \
            switch (n) {                                                                                               \
            case 1: qgemv_int8_k_t(y, ldy, qx, dx, sx, 1, w, r0, r1, CS_DTYPE_##T); break;                            \
            case 2: qgemv_int8_k_t(y, ldy, qx, dx, sx, 2, w, r0, r1, CS_DTYPE_##T); break;                            \
            case 3: qgemv_int8_k_t(y, ldy, qx, dx, sx, 3, w, r0, r1, CS_DTYPE_##T); break;                            \
            default: qgemv_int8_k_t(y, ldy, qx, dx, sx, 4, w, r0, r1, CS_DTYPE_##T); break;                           \
            }                                                                                                          \
            return;                                                                                                    \
        }                                                                                                              \
        switch (n) {                                                                                                   \
        case 1: qgemv_int8_t(y, ldy, qx, dx, sx, 1, w, r0, r1, CS_DTYPE_##T); break;                                  \
        case 2: qgemv_int8_t(y, ldy, qx, dx, sx, 2, w, r0, r1, CS_DTYPE_##T); break;                                  \
        case 3: qgemv_int8_t(y, ldy, qx, dx, sx, 3, w, r0, r1, CS_DTYPE_##T); break;                                  \
        default: qgemv_int8_t(y, ldy, qx, dx, sx, 4, w, r0, r1, CS_DTYPE_##T); break;                                 \
        }                                                                                                              \
    }
PER_TYPE_I8(Q4_0)
PER_TYPE_I8(Q4_1)
PER_TYPE_I8(Q5_0)
PER_TYPE_I8(Q5_1)
PER_TYPE_I8(Q8_0)
PER_TYPE_I8(Q4_K)
PER_TYPE_I8(Q5_K)
PER_TYPE_I8(Q6_K)
#undef PER_TYPE_I8

void cs_qgemv_int8_avx2(float *y, int ldy, const int8_t *qx, const float *dx, const float *sx, int n,
                        const cs_weight_t *w, int r0, int r1) {
    CS_ASSERT(n >= 1 && n <= CS_QGEMV_MAX_N);
    switch (w->dtype) {
    case CS_DTYPE_Q4_0: qgemv_i8_Q4_0(y, ldy, qx, dx, sx, n, w, r0, r1); break;
    case CS_DTYPE_Q4_1: qgemv_i8_Q4_1(y, ldy, qx, dx, sx, n, w, r0, r1); break;
    case CS_DTYPE_Q5_0: qgemv_i8_Q5_0(y, ldy, qx, dx, sx, n, w, r0, r1); break;
    case CS_DTYPE_Q5_1: qgemv_i8_Q5_1(y, ldy, qx, dx, sx, n, w, r0, r1); break;
    case CS_DTYPE_Q8_0: qgemv_i8_Q8_0(y, ldy, qx, dx, sx, n, w, r0, r1); break;
    case CS_DTYPE_Q4_K: qgemv_i8_Q4_K(y, ldy, qx, dx, sx, n, w, r0, r1); break;
    case CS_DTYPE_Q5_K: qgemv_i8_Q5_K(y, ldy, qx, dx, sx, n, w, r0, r1); break;
    case CS_DTYPE_Q6_K: qgemv_i8_Q6_K(y, ldy, qx, dx, sx, n, w, r0, r1); break;
    default: CS_ASSERT(!"quantized dtype");
    }
}

/* the plain loop: x̂ = d_x q_x, then each row dequantized and summed in F32 in column order */
void cs_qgemv_int8_ref(float *y, int ldy, const int8_t *qx, const float *dx, const float *sx, int n,
                       const cs_weight_t *w, int r0, int r1) {
    (void)sx;
    size_t rb = cs_dtype_row_bytes(w->dtype, w->cols);
    float *row = malloc(sizeof(float) * (size_t)w->cols);
    CS_ASSERT(row);
    for (int r = r0; r < r1; r++) {
        cs_dequant_row_ref(row, (const char *)w->data + (size_t)r * rb, w->dtype, w->cols);
        for (int i = 0; i < n; i++) {
            float s = 0;
            for (int c = 0; c < w->cols; c++) {
                size_t at = (size_t)i * w->cols + (size_t)c;
                s += dx[at / (size_t)cs_quant_act_block(w->dtype)] * (float)qx[at] * row[c];
            }
            y[(size_t)i * ldy + r] = s;
        }
    }
    free(row);
}
