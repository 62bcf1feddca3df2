/* quant.c: the plain definitions of GGUF's block formats. Dequantization and the 32-element
 * quantizers are bit for bit those of ggml (ggml-quants.c) and of the `gguf` Python package;
 * the K-type quantizers are ours, in the manner of ggml's: a least-squares search for each
 * sub-block's scale (and minimum), then the scales themselves quantized per super-block.
 * Everything here is written for clarity; the CPU kernels are the fast versions. */
#include "base/quant.h"

#include <math.h>
#include <string.h>

/* ggml and gguf compute a*b + c as a product rounded to F32, then a sum rounded to F32.
 * Decoding cannot depend on that: its products are exact (an F16 scale's 11 significant
 * bits times a 6-bit scale and a 5-bit level, or an 8-bit one, fit F32's 24) or, for Q6_K,
 * one exact product rounded once whatever the order. The quantizers' x*id + 8.5 can: a fused
 * multiply-add, which -march=haswell and later let the compiler emit, rounds once and now
 * and then truncates to another level than gguf's. */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

/* The block structs' F16 fields and Q5's 32-bit qh are little-endian in the file; like the
 * rest of caraserve, this file assumes a little-endian host. Blocks are copied in and out
 * with memcpy so that a row may start at any address. */

/* v rounded to the nearest integer (ties to even) and clamped to [lo, hi] (|lo|, |hi| < 2^22).
 * Clamping first in float keeps the conversion defined for any input, NaN included (it
 * lands on lo); the rounding is ggml's: adding 1.5 * 2^23 leaves the integer in the low
 * mantissa bits, which is much faster than nearbyintf, a library call on plain x86-64, and
 * the K quantizers call this a few hundred times a value. */
static inline int round_clamp(float v, int lo, int hi) {
    v = v > (float)lo ? v : (float)lo; /* not fmaxf/fminf: library calls too */
    v = v < (float)hi ? v : (float)hi;
    union { float f; int32_t i; } u = { .f = v + 12582912.0f };
    return (u.i & 0x007fffff) - 0x00400000;
}

/* ------------------------------------------------------------------ dequantization ---- */

static void dequant_q4_0(float *y, const cs_block_q4_0 *b) {
    const float d = cs_f16_to_f32(b->d);
    for (int j = 0; j < CS_QK / 2; j++) {
        y[j] = (float)((b->qs[j] & 0xF) - 8) * d;
        y[j + CS_QK / 2] = (float)((b->qs[j] >> 4) - 8) * d;
    }
}

static void dequant_q4_1(float *y, const cs_block_q4_1 *b) {
    const float d = cs_f16_to_f32(b->d), m = cs_f16_to_f32(b->m);
    for (int j = 0; j < CS_QK / 2; j++) {
        y[j] = (float)(b->qs[j] & 0xF) * d + m;
        y[j + CS_QK / 2] = (float)(b->qs[j] >> 4) * d + m;
    }
}

static uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void dequant_q5_0(float *y, const cs_block_q5_0 *b) {
    const float d = cs_f16_to_f32(b->d);
    const uint32_t qh = le32(b->qh);
    for (int j = 0; j < CS_QK / 2; j++) {
        int q0 = (int)((b->qs[j] & 0xF) | ((qh >> j) & 1) << 4);
        int q1 = (int)((b->qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4);
        y[j] = (float)(q0 - 16) * d;
        y[j + CS_QK / 2] = (float)(q1 - 16) * d;
    }
}

static void dequant_q5_1(float *y, const cs_block_q5_1 *b) {
    const float d = cs_f16_to_f32(b->d), m = cs_f16_to_f32(b->m);
    const uint32_t qh = le32(b->qh);
    for (int j = 0; j < CS_QK / 2; j++) {
        int q0 = (int)((b->qs[j] & 0xF) | ((qh >> j) & 1) << 4);
        int q1 = (int)((b->qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4);
        y[j] = (float)q0 * d + m;
        y[j + CS_QK / 2] = (float)q1 * d + m;
    }
}

static void dequant_q8_0(float *y, const cs_block_q8_0 *b) {
    const float d = cs_f16_to_f32(b->d);
    for (int j = 0; j < CS_QK; j++) y[j] = (float)b->qs[j] * d;
}

/* Q4_K and Q5_K: four chunks of 64, each two sub-blocks of 32 sharing the bytes q[0..32):
 * the low nibbles are the first sub-block, the high nibbles the second. For Q5_K, qh[l]
 * holds the fifth bit of element l of every sub-block j at bit j. */
static void dequant_qk_affine(float *y, uint16_t d16, uint16_t dmin16, const uint8_t *scales,
                              const uint8_t *qh, const uint8_t *qs) {
    const float d = cs_f16_to_f32(d16), dmin = cs_f16_to_f32(dmin16);
    for (int c = 0; c < 4; c++) {
        const uint8_t *q = qs + 32 * c;
        uint8_t sc1, m1, sc2, m2;
        cs_q4k_scale_min(2 * c, scales, &sc1, &m1);
        cs_q4k_scale_min(2 * c + 1, scales, &sc2, &m2);
        const float d1 = d * (float)sc1, dm1 = dmin * (float)m1;
        const float d2 = d * (float)sc2, dm2 = dmin * (float)m2;
        for (int l = 0; l < 32; l++) {
            int lo = q[l] & 0xF, hi = q[l] >> 4;
            if (qh) {
                lo |= ((qh[l] >> (2 * c)) & 1) << 4;
                hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
            }
            y[64 * c + l] = d1 * (float)lo - dm1;
            y[64 * c + 32 + l] = d2 * (float)hi - dm2;
        }
    }
}

/* Q6_K: two halves of 128. In a half, ql[l] holds elements l (low nibble) and l + 64 (high),
 * ql[l + 32] elements l + 32 and l + 96, and qh[l] the top two bits of l, l + 32, l + 64,
 * l + 96 at bits 0, 2, 4, 6. Sub-block of 16 k has scale sc[k]. Each value is
 * (d * sc) * q as ggml and gguf compute it; d * (sc * q) is the same number, since d * sc
 * and sc * q are exact and either way the one rounding is of the exact product. */
static void dequant_q6_K(float *y, const cs_block_q6_K *b) {
    const float d = cs_f16_to_f32(b->d);
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = b->ql + 64 * h, *qh = b->qh + 32 * h;
        const int8_t *sc = b->scales + 8 * h;
        float *yh = y + 128 * h;
        for (int l = 0; l < 32; l++) {
            int is = l / 16;
            int q1 = (int)((ql[l] & 0xF) | ((qh[l] >> 0) & 3) << 4) - 32;
            int q2 = (int)((ql[l + 32] & 0xF) | ((qh[l] >> 2) & 3) << 4) - 32;
            int q3 = (int)((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32;
            int q4 = (int)((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32;
            yh[l] = d * (float)sc[is] * (float)q1;
            yh[l + 32] = d * (float)sc[is + 2] * (float)q2;
            yh[l + 64] = d * (float)sc[is + 4] * (float)q3;
            yh[l + 96] = d * (float)sc[is + 6] * (float)q4;
        }
    }
}

/* one block of t at src to block(t) floats at y */
static void dequant_block(float *y, const uint8_t *src, cs_dtype t) {
    union {
        cs_block_q4_0 q4_0; cs_block_q4_1 q4_1; cs_block_q5_0 q5_0; cs_block_q5_1 q5_1;
        cs_block_q8_0 q8_0; cs_block_q4_K q4_K; cs_block_q5_K q5_K; cs_block_q6_K q6_K;
    } b;
    memcpy(&b, src, cs_dtype_size(t));
    switch (t) {
    case CS_DTYPE_Q4_0: dequant_q4_0(y, &b.q4_0); break;
    case CS_DTYPE_Q4_1: dequant_q4_1(y, &b.q4_1); break;
    case CS_DTYPE_Q5_0: dequant_q5_0(y, &b.q5_0); break;
    case CS_DTYPE_Q5_1: dequant_q5_1(y, &b.q5_1); break;
    case CS_DTYPE_Q8_0: dequant_q8_0(y, &b.q8_0); break;
    case CS_DTYPE_Q4_K: dequant_qk_affine(y, b.q4_K.d, b.q4_K.dmin, b.q4_K.scales, NULL, b.q4_K.qs); break;
    case CS_DTYPE_Q5_K:
        dequant_qk_affine(y, b.q5_K.d, b.q5_K.dmin, b.q5_K.scales, b.q5_K.qh, b.q5_K.qs);
        break;
    case CS_DTYPE_Q6_K: dequant_q6_K(y, &b.q6_K); break;
    default: CS_ASSERT(!"dequant_block: not a block type");
    }
}

void cs_dequant_row_ref(float *dst, const void *src, cs_dtype t, int64_t n) {
    const uint8_t *s = src;
    switch (t) {
    case CS_DTYPE_F32: memcpy(dst, src, (size_t)n * sizeof(float)); return;
    case CS_DTYPE_F16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, s + 2 * i, 2);
            dst[i] = cs_f16_to_f32(h);
        }
        return;
    case CS_DTYPE_BF16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, s + 2 * i, 2);
            dst[i] = cs_bf16_to_f32(h);
        }
        return;
    default: break;
    }
    CS_ASSERT(cs_dtype_is_quant(t));
    const int64_t qk = cs_dtype_block(t);
    const size_t bs = cs_dtype_size(t);
    CS_ASSERT(n >= 0 && n % qk == 0);
    for (int64_t i = 0; i < n / qk; i++) dequant_block(dst + i * qk, s + (size_t)i * bs, t);
}

double cs_quant_dot_ref(const void *w, cs_dtype t, const float *x, int64_t n) {
    /* a chunk of 256 (a whole number of blocks of every type) at a time */
    float tmp[CS_QK_K];
    double sum = 0;
    for (int64_t i = 0; i < n; i += CS_QK_K) {
        int64_t m = n - i < CS_QK_K ? n - i : CS_QK_K;
        cs_dequant_row_ref(tmp, (const uint8_t *)w + cs_dtype_row_bytes(t, i), t, m);
        for (int64_t k = 0; k < m; k++) sum += (double)x[i + k] * (double)tmp[k];
    }
    return sum;
}

/* ---------------------------------------------- quantization, the 32-element types ---- */

/* These are ggml's quantize_row_*_ref step for step (the `gguf` package computes the same in
 * numpy): the scale from the block's extreme values, its reciprocal in F32, every value
 * scaled, offset and truncated (Q8_0: rounded). The clamps before each conversion change
 * nothing for finite input; they keep a NaN from reaching a float-to-int conversion. */

/* Q4_0 and Q5_0: d = (the value of largest magnitude) / -(levels/2), so that value lands on
 * level 0; q = trunc(x/d + levels/2 + 0.5), at most levels-1. */
static float quant_symmetric(const float *x, int half, uint8_t *q) {
    float amax = 0, max = 0;
    for (int j = 0; j < CS_QK; j++) {
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    }
    const float d = max / (float)-half;
    const float id = d != 0 ? 1.0f / d : 0.0f;
    const float off = (float)half + 0.5f;
    for (int j = 0; j < CS_QK; j++)
        q[j] = (uint8_t)fminf((float)(2 * half - 1), fmaxf(0.0f, truncf(x[j] * id + off)));
    return d;
}

/* Q4_1 and Q5_1: d = (max - min) / (levels - 1), m = min; q = trunc((x - min)/d + 0.5). */
static float quant_affine(const float *x, int nmax, uint8_t *q, float *min_out) {
    float min = x[0], max = x[0];
    for (int j = 1; j < CS_QK; j++) {
        if (x[j] < min) min = x[j];
        if (x[j] > max) max = x[j];
    }
    const float d = (max - min) / (float)nmax;
    const float id = d != 0 ? 1.0f / d : 0.0f;
    for (int j = 0; j < CS_QK; j++)
        q[j] = (uint8_t)fminf((float)nmax, fmaxf(0.0f, truncf((x[j] - min) * id + 0.5f)));
    *min_out = min;
    return d;
}

/* 32 levels q[] of 5 bits into Q5's qs (low 4 bits, element j and j + 16 in byte j) and qh
 * (the fifth bit of element j at bit j, little-endian) */
static void pack_q5(const uint8_t *q, uint8_t *qs, uint8_t *qh) {
    uint32_t h = 0;
    for (int j = 0; j < CS_QK / 2; j++) {
        qs[j] = (uint8_t)((q[j] & 0xF) | (q[j + 16] & 0xF) << 4);
        h |= (uint32_t)(q[j] >> 4) << j | (uint32_t)(q[j + 16] >> 4) << (j + 16);
    }
    for (int k = 0; k < 4; k++) qh[k] = (uint8_t)(h >> (8 * k));
}

static void quant_q4_0(const float *x, void *dst) {
    cs_block_q4_0 b;
    uint8_t q[CS_QK];
    b.d = cs_f32_to_f16(quant_symmetric(x, 8, q));
    for (int j = 0; j < CS_QK / 2; j++) b.qs[j] = (uint8_t)(q[j] | q[j + 16] << 4);
    memcpy(dst, &b, sizeof b);
}

static void quant_q4_1(const float *x, void *dst) {
    cs_block_q4_1 b;
    uint8_t q[CS_QK];
    float min;
    b.d = cs_f32_to_f16(quant_affine(x, 15, q, &min));
    b.m = cs_f32_to_f16(min);
    for (int j = 0; j < CS_QK / 2; j++) b.qs[j] = (uint8_t)(q[j] | q[j + 16] << 4);
    memcpy(dst, &b, sizeof b);
}

static void quant_q5_0(const float *x, void *dst) {
    cs_block_q5_0 b;
    uint8_t q[CS_QK];
    b.d = cs_f32_to_f16(quant_symmetric(x, 16, q));
    pack_q5(q, b.qs, b.qh);
    memcpy(dst, &b, sizeof b);
}

static void quant_q5_1(const float *x, void *dst) {
    cs_block_q5_1 b;
    uint8_t q[CS_QK];
    float min;
    b.d = cs_f32_to_f16(quant_affine(x, 31, q, &min));
    b.m = cs_f32_to_f16(min);
    pack_q5(q, b.qs, b.qh);
    memcpy(dst, &b, sizeof b);
}

/* Q8_0: d = max|x| / 127, q = round(x/d) with ties away from zero (C's roundf) */
static void quant_q8_0(const float *x, void *dst) {
    cs_block_q8_0 b;
    float amax = 0;
    for (int j = 0; j < CS_QK; j++) amax = fmaxf(amax, fabsf(x[j]));
    const float d = amax / 127.0f;
    const float id = d != 0 ? 1.0f / d : 0.0f;
    b.d = cs_f32_to_f16(d);
    for (int j = 0; j < CS_QK; j++) b.qs[j] = (int8_t)fminf(127.0f, fmaxf(-127.0f, roundf(x[j] * id)));
    memcpy(dst, &b, sizeof b);
}

/* ---------------------------------------------------- quantization, the K types ---- */

/* Fits n values x with weights w by x ≈ s q - m, q an integer in [0, nmax], s ≥ 0, m ≥ 0
 * (the grid's lowest point -m is at most 0, as the format's unsigned minima require), and
 * returns s, sets *m and q. It minimises the weighted squared error Σ w (s q - m - x)²
 * approximately: for each of a few grids around the one spanning [min(x, 0), max(x)] (steps
 * of (range)/(nmax + δ), δ from -1 to 1 by 0.1) every x is rounded to its nearest grid point,
 * and for those levels the best s and m solve the weighted 2x2 normal equations (m pinned to
 * 0 when the fit wants it negative); the candidate with the least error is kept, then
 * refined by rounding to its own grid and refitting while that lowers the error. */
static float fit_affine(int n, int nmax, const float *x, const float *w, uint8_t *q, float *m_out) {
    float min = x[0], max = x[0];
    double sw = 0, swx = 0, swx2 = 0;
    for (int i = 0; i < n; i++) {
        min = x[i] < min ? x[i] : min;
        max = x[i] > max ? x[i] : max;
        sw += w[i];
        swx += (double)w[i] * x[i];
        swx2 += (double)w[i] * x[i] * x[i];
    }
    if (min > 0) min = 0;
    if (!(max > min)) { /* constant and not positive (or NaN): the minimum alone says it */
        memset(q, 0, (size_t)n);
        *m_out = -min;
        return 0;
    }
    uint8_t cand[CS_QK];
    CS_ASSERT(n <= CS_QK);
    double best_err = INFINITY;
    float best_s = 0, best_m = 0;
    /* Candidate grids first, then refinement rounds using the best fit's own grid. */
    for (int step = -10, refine = 0; step <= 10 || refine < 4; step++) {
        float is, off;
        if (step <= 10) {
            is = ((float)nmax + 0.1f * (float)step) / (max - min);
            off = -min;
        } else {
            if (best_s <= 0) break;
            is = 1.0f / best_s;
            off = best_m;
            refine++;
        }
        double sl = 0, sl2 = 0, sxl = 0;
        for (int i = 0; i < n; i++) {
            int l = round_clamp(is * (x[i] + off), 0, nmax);
            cand[i] = (uint8_t)l;
            sl += (double)w[i] * l;
            sl2 += (double)w[i] * l * l;
            sxl += (double)w[i] * l * x[i];
        }
        double det = sw * sl2 - sl * sl;
        double s, m;
        if (det > 0) {
            s = (sw * sxl - swx * sl) / det;
            m = (sl * sxl - sl2 * swx) / det; /* x ≈ s q - m */
            if (m < 0) {
                m = 0;
                s = sxl / sl2;
            }
        } else if (sl2 > 0) { /* one level used: a pure scale */
            m = 0;
            s = sxl / sl2;
        } else {
            continue;
        }
        if (s < 0) continue;
        /* Σ w (s l - m - x)², expanded into the sums at hand */
        double err = s * s * sl2 + m * m * sw + swx2 - 2 * s * m * sl - 2 * s * sxl + 2 * m * swx;
        if (err < best_err) {
            best_err = err;
            best_s = (float)s;
            best_m = (float)m;
            memcpy(q, cand, (size_t)n);
        } else if (step > 10) {
            break; /* refinement stopped helping */
        }
    }
    if (best_err == INFINITY) { /* cannot happen for finite x: max > min puts two levels apart */
        memset(q, 0, (size_t)n);
        *m_out = -min;
        return 0;
    }
    *m_out = best_m;
    return best_s;
}

/* The two F16 values either side of v (both the nearest one when v is one), finite: a v
 * beyond F16's range gets its largest value. The K quantizers try both for a super-block
 * scale, because their scales are often F16 subnormals (Q6_K's d is one whenever a block's
 * largest value is under 0.25, as in most LLM weights), where the nearest F16 can be a few
 * percent off. */
static void f16_bracket(float v, uint16_t h[2]) {
    h[0] = cs_f32_to_f16(v);
    if ((h[0] & 0x7fff) >= 0x7c00) h[0] = (uint16_t)((h[0] & 0x8000) | 0x7bff);
    float r = cs_f16_to_f32(h[0]);
    h[1] = h[0];
    if (fabsf(r) < fabsf(v) && (h[0] & 0x7fff) < 0x7bff) h[1] = (uint16_t)(h[0] + 1); /* a step outward */
    else if (fabsf(r) > fabsf(v) && (h[0] & 0x7fff) > 0) h[1] = (uint16_t)(h[0] - 1);
}

/* For Q4_K/Q5_K with super-block scales d16 and dmin16: the 6-bit sub-block scales ls and
 * minima lm nearest s[] and m[], every value's level L on the grid they give, and the
 * weighted squared error Σ w (d ls L - dmin lm - x)² of the result. */
static double qk_affine_levels(const float *x, const float *w, int nmax, const float *s, const float *m,
                               uint16_t d16, uint16_t dmin16, uint8_t *ls, uint8_t *lm, uint8_t *L) {
    const float d = cs_f16_to_f32(d16), dmin = cs_f16_to_f32(dmin16);
    double err = 0;
    for (int j = 0; j < 8; j++) {
        ls[j] = (uint8_t)(d > 0 ? round_clamp(s[j] / d, 0, 63) : 0);
        lm[j] = (uint8_t)(dmin > 0 ? round_clamp(m[j] / dmin, 0, 63) : 0);
        const float dj = d * (float)ls[j], mj = dmin * (float)lm[j], idj = dj > 0 ? 1 / dj : 0;
        for (int l = 0; l < 32; l++) {
            const int i = 32 * j + l;
            L[i] = (uint8_t)round_clamp((x[i] + mj) * idj, 0, nmax);
            double e = (double)dj * L[i] - mj - x[i];
            err += w[i] * e * e;
        }
    }
    return err;
}

/* Q4_K (qh NULL) and Q5_K: each sub-block of 32 fitted by fit_affine with weights
 * rms(sub-block) + |x| (ggml's choice: a little more care for the large values, which carry
 * most of a matmul's output); the eight scales and eight minima then quantized to 6 bits
 * against the super-block's d = max scale / 63 and dmin = max minimum / 63, each F16 value
 * either side of those tried, keeping the pair whose grids (every value re-rounded to the
 * grid its quantized scale and minimum give) have the least weighted squared error. */
static void quant_qk_affine(const float *x, int nmax, uint16_t *d_out, uint16_t *dmin_out,
                            uint8_t *scales, uint8_t *qh, uint8_t *qs) {
    float s[8], m[8], w[CS_QK_K];
    uint8_t L[CS_QK_K], ls[8], lm[8];
    float max_s = 0, max_m = 0;
    for (int j = 0; j < 8; j++) {
        const float *xs = x + 32 * j;
        float sum2 = 0;
        for (int l = 0; l < 32; l++) sum2 += xs[l] * xs[l];
        const float rms = sqrtf(sum2 / 32);
        for (int l = 0; l < 32; l++) w[32 * j + l] = rms + fabsf(xs[l]);
        s[j] = fit_affine(32, nmax, xs, w + 32 * j, L + 32 * j, &m[j]);
        max_s = fmaxf(max_s, s[j]);
        max_m = fmaxf(max_m, m[j]);
    }
    uint16_t dc[2], mc[2];
    f16_bracket(max_s / 63, dc);
    f16_bracket(max_m / 63, mc);
    double best = INFINITY;
    int bi = 0, bj = 0;
    for (int i = 0; i < 2; i++) {
        for (int j = 0; j < 2; j++) {
            if ((i && dc[1] == dc[0]) || (j && mc[1] == mc[0])) continue;
            uint8_t ls1[8], lm1[8], L1[CS_QK_K];
            double err = qk_affine_levels(x, w, nmax, s, m, dc[i], mc[j], ls1, lm1, L1);
            if (err < best || (i == 0 && j == 0)) { /* the first always: err is NaN for NaN x */
                best = err;
                bi = i;
                bj = j;
                memcpy(ls, ls1, 8);
                memcpy(lm, lm1, 8);
                memcpy(L, L1, CS_QK_K);
            }
        }
    }
    memset(scales, 0, 12);
    for (int j = 0; j < 8; j++) { /* the inverse of cs_q4k_scale_min */
        if (j < 4) {
            scales[j] |= ls[j];
            scales[j + 4] |= lm[j];
        } else {
            scales[j + 4] = (uint8_t)((ls[j] & 0xF) | (lm[j] & 0xF) << 4);
            scales[j - 4] |= (uint8_t)((ls[j] >> 4) << 6);
            scales[j] |= (uint8_t)((lm[j] >> 4) << 6);
        }
    }
    if (qh) memset(qh, 0, 32);
    for (int c = 0; c < 4; c++) {
        const uint8_t *a = L + 64 * c, *b = L + 64 * c + 32;
        for (int l = 0; l < 32; l++) {
            qs[32 * c + l] = (uint8_t)((a[l] & 0xF) | (b[l] & 0xF) << 4);
            if (qh) qh[l] |= (uint8_t)((a[l] >> 4) << (2 * c) | (b[l] >> 4) << (2 * c + 1));
        }
    }
    *d_out = dc[bi];
    *dmin_out = mc[bj];
}

/* Fits 16 values by x ≈ s q, q an integer in [-32, 31], and returns s (q in q[] offset by
 * 32). It minimises Σ (s q - x)² approximately: s is tried so that the value of largest
 * magnitude lands on -32 ± δ (δ from -0.9 to 0.9 by 0.1; -32, not 31, because the negative
 * side has the extra level), for each the values are rounded and s set to its least-squares
 * value Σ x q / Σ q², and the best candidate is refined by rounding to its own grid and
 * refitting while that lowers the error. */
static float fit_symmetric16(const float *x, uint8_t *q) {
    float amax = 0, max = 0;
    for (int i = 0; i < 16; i++) {
        if (amax < fabsf(x[i])) {
            amax = fabsf(x[i]);
            max = x[i];
        }
    }
    memset(q, 32, 16);
    if (!(amax > 0)) return 0;
    double sx2 = 0;
    for (int i = 0; i < 16; i++) sx2 += (double)x[i] * x[i];
    int cand[16];
    double best_err = INFINITY;
    float best_s = 0;
    for (int step = -9, refine = 0; step <= 9 || refine < 4; step++) {
        float is;
        if (step <= 9) {
            is = -(32.0f + 0.1f * (float)step) / max;
        } else {
            if (best_s == 0) break;
            is = 1.0f / best_s;
            refine++;
        }
        double sxl = 0, sl2 = 0;
        for (int i = 0; i < 16; i++) {
            cand[i] = round_clamp(is * x[i], -32, 31);
            sxl += (double)x[i] * cand[i];
            sl2 += (double)cand[i] * cand[i];
        }
        if (!(sl2 > 0)) continue;
        double err = sx2 - sxl * sxl / sl2; /* Σ (s q - x)² at s = sxl / sl2 */
        if (err < best_err) {
            best_err = err;
            best_s = (float)(sxl / sl2);
            for (int i = 0; i < 16; i++) q[i] = (uint8_t)(cand[i] + 32);
        } else if (step > 9) {
            break;
        }
    }
    return best_s;
}

/* For Q6_K with super-block scale d16: the signed 8-bit sub-block scales sc nearest s[],
 * every value's level L (offset by 32) on the grid they give, and the squared error. */
static double q6k_levels(const float *x, const float *s, uint16_t d16, int8_t *sc, uint8_t *L) {
    const float d = cs_f16_to_f32(d16);
    double err = 0;
    for (int j = 0; j < 16; j++) {
        sc[j] = (int8_t)(d != 0 ? round_clamp(s[j] / d, -128, 127) : 0);
        const float dj = d * (float)sc[j], idj = dj != 0 ? 1 / dj : 0;
        for (int l = 0; l < 16; l++) {
            const int i = 16 * j + l;
            int q = round_clamp(x[i] * idj, -32, 31);
            L[i] = (uint8_t)(q + 32);
            double e = (double)dj * q - x[i];
            err += e * e;
        }
    }
    return err;
}

/* Q6_K: each sub-block of 16 fitted by fit_symmetric16; the 16 scales quantized to signed
 * 8 bits against d = -(the scale of largest magnitude) / 128, so that scale is -128, each
 * F16 value either side of that d tried, keeping the one whose grids (every value re-rounded
 * to the grid its quantized scale gives) have the least squared error. */
static void quant_q6_K(const float *x, void *dst) {
    cs_block_q6_K b;
    uint8_t L[CS_QK_K];
    float s[16], max_s = 0, amax_s = 0;
    for (int j = 0; j < 16; j++) {
        s[j] = fit_symmetric16(x + 16 * j, L + 16 * j);
        if (fabsf(s[j]) > amax_s) {
            amax_s = fabsf(s[j]);
            max_s = s[j];
        }
    }
    uint16_t dc[2];
    f16_bracket(max_s / -128, dc);
    b.d = dc[0];
    double err = q6k_levels(x, s, dc[0], b.scales, L);
    if (dc[1] != dc[0]) {
        int8_t sc1[16];
        uint8_t L1[CS_QK_K];
        if (q6k_levels(x, s, dc[1], sc1, L1) < err) {
            b.d = dc[1];
            memcpy(b.scales, sc1, 16);
            memcpy(L, L1, CS_QK_K);
        }
    }
    for (int h = 0; h < 2; h++) {
        const uint8_t *Lh = L + 128 * h;
        uint8_t *ql = b.ql + 64 * h, *qh = b.qh + 32 * h;
        for (int l = 0; l < 32; l++) {
            ql[l] = (uint8_t)((Lh[l] & 0xF) | (Lh[l + 64] & 0xF) << 4);
            ql[l + 32] = (uint8_t)((Lh[l + 32] & 0xF) | (Lh[l + 96] & 0xF) << 4);
            qh[l] = (uint8_t)((Lh[l] >> 4) | (Lh[l + 32] >> 4) << 2 | (Lh[l + 64] >> 4) << 4 |
                              (Lh[l + 96] >> 4) << 6);
        }
    }
    memcpy(dst, &b, sizeof b);
}

static void quant_q4_K(const float *x, void *dst) {
    cs_block_q4_K b;
    quant_qk_affine(x, 15, &b.d, &b.dmin, b.scales, NULL, b.qs);
    memcpy(dst, &b, sizeof b);
}

static void quant_q5_K(const float *x, void *dst) {
    cs_block_q5_K b;
    quant_qk_affine(x, 31, &b.d, &b.dmin, b.scales, b.qh, b.qs);
    memcpy(dst, &b, sizeof b);
}

int cs_quantize_row_ref(void *dst, const float *src, cs_dtype t, int64_t n) {
    void (*quant)(const float *, void *);
    switch (t) {
    case CS_DTYPE_Q4_0: quant = quant_q4_0; break;
    case CS_DTYPE_Q4_1: quant = quant_q4_1; break;
    case CS_DTYPE_Q5_0: quant = quant_q5_0; break;
    case CS_DTYPE_Q5_1: quant = quant_q5_1; break;
    case CS_DTYPE_Q8_0: quant = quant_q8_0; break;
    case CS_DTYPE_Q4_K: quant = quant_q4_K; break;
    case CS_DTYPE_Q5_K: quant = quant_q5_K; break;
    case CS_DTYPE_Q6_K: quant = quant_q6_K; break;
    default: return cs_error_set(CS_EINVAL, "cannot quantize to %s: not a block type", cs_dtype_name(t));
    }
    const int64_t qk = cs_dtype_block(t);
    if (n < 0 || n % qk)
        return cs_error_set(CS_EINVAL, "cannot quantize %lld values to %s: not a multiple of its block of %lld",
                            (long long)n, cs_dtype_name(t), (long long)qk);
    const size_t bs = cs_dtype_size(t);
    for (int64_t i = 0; i < n / qk; i++) quant(src + i * qk, (uint8_t *)dst + (size_t)i * bs);
    return CS_OK;
}
