/* test_quant.c: base/quant.c on its own: hand-built blocks of every type decode to the values
 * the format defines, each quantizer stays within its error bound on random rows and on
 * zero, constant, outlier and tiny rows, the K quantizers beat a plain min/max quantizer,
 * cs_quant_dot_ref is the double dot of the decoded row, and bad requests are refused.
 * Bit-equality with the `gguf` package is tests/test_quant_ref.py's job. */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/quant.h"
#include "base/rng.h"
#include "testutil.h"

#define F16_ONE 0x3C00  /* 1.0 */
#define F16_HALF 0x3800 /* 0.5 */
#define F16_MINUS_HALF 0xB800
#define F16_QUARTER 0x3400 /* 0.25 */
#define F16_MINUS_ONE 0xBC00

static const cs_dtype block_types[] = {
    CS_DTYPE_Q4_0, CS_DTYPE_Q4_1, CS_DTYPE_Q5_0, CS_DTYPE_Q5_1,
    CS_DTYPE_Q8_0, CS_DTYPE_Q4_K, CS_DTYPE_Q5_K, CS_DTYPE_Q6_K,
};

/* n samples of N(0, scale²), Box-Muller over the test's own generator */
static float *gauss_row(cs_rng_t *rng, int64_t n, float scale) {
    float *v = malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) {
        double u1 = 1.0 - cs_rng_uniform(rng), u2 = cs_rng_uniform(rng);
        v[i] = (float)(sqrt(-2 * log(u1)) * cos(2 * M_PI * u2)) * scale;
    }
    return v;
}

/* quantize x to t and decode it again into y (n values) */
static void round_trip(cs_dtype t, const float *x, float *y, int64_t n) {
    void *q = malloc(cs_dtype_row_bytes(t, n));
    ck_assert_int_eq(cs_quantize_row_ref(q, x, t, n), CS_OK);
    cs_dequant_row_ref(y, q, t, n);
    free(q);
}

/* ||x - y|| / ||x|| */
static double rel_rms(const float *x, const float *y, int64_t n) {
    double e = 0, s = 0;
    for (int64_t i = 0; i < n; i++) {
        e += ((double)x[i] - y[i]) * ((double)x[i] - y[i]);
        s += (double)x[i] * x[i];
    }
    return sqrt(e / s);
}

/* ------------------------------------------------------------ known blocks ---- */

START_TEST(known_q4_0) {
    /* block 0: d = 1, nibbles 0..15 in the low halves and 15..0 in the high: x = q - 8
     * block 1: d = -0.5, the same bytes */
    cs_block_q4_0 b[2];
    for (int k = 0; k < 2; k++) {
        b[k].d = k ? F16_MINUS_HALF : F16_ONE;
        for (int j = 0; j < 16; j++) b[k].qs[j] = (uint8_t)(j | (15 - j) << 4);
    }
    float y[64];
    cs_dequant_row_ref(y, b, CS_DTYPE_Q4_0, 64);
    for (int j = 0; j < 16; j++) {
        ck_assert_float_eq(y[j], (float)(j - 8));
        ck_assert_float_eq(y[16 + j], (float)(7 - j));
        ck_assert_float_eq(y[32 + j], -0.5f * (float)(j - 8));
        ck_assert_float_eq(y[48 + j], -0.5f * (float)(7 - j));
    }
}
END_TEST

START_TEST(known_q4_1) {
    cs_block_q4_1 b = {.d = F16_HALF, .m = F16_MINUS_ONE};
    for (int j = 0; j < 16; j++) b.qs[j] = (uint8_t)(j | (15 - j) << 4);
    float y[32];
    cs_dequant_row_ref(y, &b, CS_DTYPE_Q4_1, 32);
    for (int j = 0; j < 16; j++) {
        ck_assert_float_eq(y[j], 0.5f * (float)j - 1);
        ck_assert_float_eq(y[16 + j], 0.5f * (float)(15 - j) - 1);
    }
}
END_TEST

/* Q5's fifth bits: element j's at bit j of the little-endian qh */
START_TEST(known_q5) {
    const uint32_t qh = 0xA5C3F00Fu;
    cs_block_q5_0 b0 = {.d = F16_ONE};
    cs_block_q5_1 b1 = {.d = F16_QUARTER, .m = F16_MINUS_HALF};
    for (int k = 0; k < 4; k++) b0.qh[k] = b1.qh[k] = (uint8_t)(qh >> (8 * k));
    for (int j = 0; j < 16; j++) b0.qs[j] = b1.qs[j] = (uint8_t)((j * 7 % 16) | (j * 3 % 16) << 4);
    float y0[32], y1[32];
    cs_dequant_row_ref(y0, &b0, CS_DTYPE_Q5_0, 32);
    cs_dequant_row_ref(y1, &b1, CS_DTYPE_Q5_1, 32);
    for (int e = 0; e < 32; e++) {
        int lo = e < 16 ? (e * 7 % 16) : ((e - 16) * 3 % 16);
        int q = lo | (int)((qh >> e) & 1) << 4;
        ck_assert_float_eq(y0[e], (float)(q - 16));
        ck_assert_float_eq(y1[e], 0.25f * (float)q - 0.5f);
    }
}
END_TEST

START_TEST(known_q8_0) {
    cs_block_q8_0 b[2] = {{.d = F16_QUARTER}, {.d = F16_MINUS_ONE}};
    for (int j = 0; j < 32; j++) b[0].qs[j] = b[1].qs[j] = (int8_t)(j * 8 - 128);
    b[1].qs[5] = 127;
    float y[64];
    cs_dequant_row_ref(y, b, CS_DTYPE_Q8_0, 64);
    for (int j = 0; j < 32; j++) {
        ck_assert_float_eq(y[j], 0.25f * (float)(j * 8 - 128));
        ck_assert_float_eq(y[32 + j], j == 5 ? -127.0f : -(float)(j * 8 - 128));
    }
}
END_TEST

/* Q4_K/Q5_K scale bytes from 6-bit sc[8] and m[8], by the layout's table (bytes 0-3: sc0-3
 * and the top bits of sc4-7; 4-7: m0-3 and the top bits of m4-7; 8-11: the low nibbles of
 * sc4-7 and m4-7), written out independently of quant.c's packer */
static void pack_k_scales(const uint8_t *sc, const uint8_t *m, uint8_t *s) {
    for (int j = 0; j < 4; j++) {
        s[j] = (uint8_t)(sc[j] | (sc[j + 4] >> 4) << 6);
        s[j + 4] = (uint8_t)(m[j] | (m[j + 4] >> 4) << 6);
        s[j + 8] = (uint8_t)((sc[j + 4] & 0xF) | (m[j + 4] & 0xF) << 4);
    }
}

static const uint8_t k_sc[8] = {1, 2, 40, 63, 17, 33, 48, 63}; /* both packings, top bits set */
static const uint8_t k_m[8] = {0, 5, 63, 16, 31, 32, 47, 62};

START_TEST(known_q4_K) {
    cs_block_q4_K b = {.d = F16_HALF, .dmin = F16_QUARTER};
    pack_k_scales(k_sc, k_m, b.scales);
    for (int j = 0; j < 8; j++) {
        uint8_t sc, m;
        cs_q4k_scale_min(j, b.scales, &sc, &m);
        ck_assert_uint_eq(sc, k_sc[j]);
        ck_assert_uint_eq(m, k_m[j]);
    }
    for (int i = 0; i < 128; i++) b.qs[i] = (uint8_t)(i * 37 + 11);
    float y[256];
    cs_dequant_row_ref(y, &b, CS_DTYPE_Q4_K, 256);
    /* element e: sub-block j = e / 32, byte 32 (j / 2) + e % 32, high nibble for odd j */
    for (int e = 0; e < 256; e++) {
        int j = e / 32;
        uint8_t byte = b.qs[32 * (j / 2) + e % 32];
        int q = j % 2 ? byte >> 4 : byte & 0xF;
        ck_assert_float_eq(y[e], 0.5f * k_sc[j] * (float)q - 0.25f * k_m[j]);
    }
}
END_TEST

START_TEST(known_q5_K) {
    cs_block_q5_K b = {.d = F16_QUARTER, .dmin = F16_ONE};
    pack_k_scales(k_sc, k_m, b.scales);
    for (int i = 0; i < 128; i++) b.qs[i] = (uint8_t)(i * 91 + 3);
    for (int l = 0; l < 32; l++) b.qh[l] = (uint8_t)(l * 29 + 101);
    float y[256];
    cs_dequant_row_ref(y, &b, CS_DTYPE_Q5_K, 256);
    for (int e = 0; e < 256; e++) {
        int j = e / 32, l = e % 32;
        uint8_t byte = b.qs[32 * (j / 2) + l];
        int q = (j % 2 ? byte >> 4 : byte & 0xF) | ((b.qh[l] >> j) & 1) << 4;
        ck_assert_float_eq(y[e], 0.25f * k_sc[j] * (float)q - 1.0f * k_m[j]);
    }
}
END_TEST

START_TEST(known_q6_K) {
    static const int8_t sc[16] = {-128, -1, 127, 1, -64, 33, 0, -7, 5, 100, -100, 2, -2, 64, -127, 9};
    cs_block_q6_K b = {.d = F16_HALF};
    memcpy(b.scales, sc, 16);
    for (int i = 0; i < 128; i++) b.ql[i] = (uint8_t)(i * 53 + 7);
    for (int i = 0; i < 64; i++) b.qh[i] = (uint8_t)(i * 71 + 13);
    b.ql[0] = 0; b.qh[0] = 0;       /* element 0: q = -32 */
    b.ql[1] = 0xFF; b.qh[1] = 0xFF; /* elements 1, 33, 65, 97: q = 31 */
    b.ql[33] = 0xFF;
    float y[256];
    cs_dequant_row_ref(y, &b, CS_DTYPE_Q6_K, 256);
    /* element e: half h, r = e % 128, group g = r / 32 (0..3), l = r % 32: the low nibble in
     * ql[64h + l + 32 (g & 1)] (high nibble for g >= 2), the top bits at qh[32h + l] >> 2g,
     * scale sc[8h + r / 16] */
    for (int e = 0; e < 256; e++) {
        int h = e / 128, r = e % 128, g = r / 32, l = r % 32;
        uint8_t lb = b.ql[64 * h + l + 32 * (g & 1)];
        int q = ((g >= 2 ? lb >> 4 : lb & 0xF) | ((b.qh[32 * h + l] >> (2 * g)) & 3) << 4) - 32;
        ck_assert_msg(y[e] == 0.5f * sc[8 * h + r / 16] * (float)q, "element %d: %g", e, y[e]);
    }
    ck_assert_float_eq(y[0], 0.5f * -128 * -32);
    ck_assert_float_eq(y[1], 0.5f * -128 * 31);
    ck_assert_float_eq(y[33], 0.5f * 127 * 31);
}
END_TEST

START_TEST(plain_types) {
    const float f[4] = {1.5f, -0.0f, 3e-5f, 65504};
    const uint16_t h[4] = {0x3E00, 0x8000, 0x0001, 0x7BFF}; /* 1.5, -0, 2^-24, 65504 */
    const uint16_t bf[4] = {0x3FC0, 0x8000, 0x0001, 0x7F7F};
    float y[4];
    cs_dequant_row_ref(y, f, CS_DTYPE_F32, 4);
    ck_assert_mem_eq(y, f, sizeof f);
    cs_dequant_row_ref(y, h, CS_DTYPE_F16, 4);
    ck_assert_float_eq(y[0], 1.5f);
    ck_assert(y[1] == 0 && signbit(y[1]));
    ck_assert_float_eq(y[2], ldexpf(1, -24));
    ck_assert_float_eq(y[3], 65504);
    cs_dequant_row_ref(y, bf, CS_DTYPE_BF16, 4);
    for (int i = 0; i < 4; i++) ck_assert_float_eq(y[i], cs_bf16_to_f32(bf[i]));
    ck_assert_float_eq(y[0], 1.5f);
}
END_TEST

/* a row of several blocks decodes as its blocks one at a time */
START_TEST(rows_of_blocks) {
    cs_rng_t rng;
    cs_rng_seed(&rng, 7);
    for (size_t k = 0; k < CS_ARRAY_LEN(block_types); k++) {
        cs_dtype t = block_types[k];
        const int64_t qk = cs_dtype_block(t), nb = 5, n = nb * qk;
        const size_t bs = cs_dtype_size(t);
        uint8_t *raw = malloc(bs * nb);
        for (size_t i = 0; i < bs * nb; i++) raw[i] = (uint8_t)cs_rng_next(&rng);
        for (int64_t i = 0; i < nb; i++) { /* finite scales: F16 ±[2^-8, 2^8) */
            uint8_t *blk = raw + i * bs;
            size_t off = t == CS_DTYPE_Q6_K ? 208 : 0;
            uint16_t d = (uint16_t)(0x1C00 + cs_rng_next(&rng) % 0x4000) | (i & 1 ? 0x8000 : 0);
            memcpy(blk + off, &d, 2);
            if (t == CS_DTYPE_Q4_1 || t == CS_DTYPE_Q5_1 || t == CS_DTYPE_Q4_K || t == CS_DTYPE_Q5_K)
                memcpy(blk + 2, &d, 2);
        }
        float *row = malloc(sizeof(float) * n), one[CS_QK_K];
        cs_dequant_row_ref(row, raw, t, n);
        for (int64_t i = 0; i < nb; i++) {
            cs_dequant_row_ref(one, raw + i * bs, t, qk);
            ck_assert_mem_eq(row + i * qk, one, sizeof(float) * qk);
            for (int64_t e = 0; e < qk; e++) ck_assert(isfinite(one[e]));
        }
        free(row);
        free(raw);
    }
}
END_TEST

/* ------------------------------------------------ quantizers: error bounds ---- */

/* The 32-element quantizers on Gaussian rows of 4096 at scales 1e-3 to 1e3. With the block's
 * F32 scale d (ggml's formula) and the F16 d16 (and m16) stored, every value is within
 *   Q8_0: |d|/2 + 127 |d - d16|         (q = round(x/d), |q| <= 127)
 *   Q4_0: |d|/2 + 8 |d - d16|, but |d| for x/d > 7.5 (the top level 16 is clamped to 15)
 *   Q5_0: |d|/2 + 16 |d - d16|, but |d| for x/d > 15.5
 *   Q4_1: d/2 + 15 |d - d16| + |min - m16|
 *   Q5_1: d/2 + 31 |d - d16| + |min - m16|
 * plus 1e-6 of the block's largest |x| for the F32 rounding on the way. */
START_TEST(legacy_error_bounds) {
    cs_rng_t rng;
    cs_rng_seed(&rng, 11);
    const int64_t n = 4096;
    float *y = malloc(sizeof(float) * n);
    static const cs_dtype types[] = {CS_DTYPE_Q8_0, CS_DTYPE_Q4_0, CS_DTYPE_Q5_0, CS_DTYPE_Q4_1, CS_DTYPE_Q5_1};
    for (size_t k = 0; k < CS_ARRAY_LEN(types); k++) {
        for (int sc = -3; sc <= 3; sc++) {
            cs_dtype t = types[k];
            float *x = gauss_row(&rng, n, powf(10, (float)sc));
            uint8_t *q = malloc(cs_dtype_row_bytes(t, n));
            ck_assert_int_eq(cs_quantize_row_ref(q, x, t, n), CS_OK);
            cs_dequant_row_ref(y, q, t, n);
            for (int64_t b = 0; b < n / 32; b++) {
                const float *xb = x + 32 * b, *yb = y + 32 * b;
                const uint8_t *blk = q + b * cs_dtype_size(t);
                float amax = 0, max = 0, mn = xb[0], mx = xb[0];
                for (int j = 0; j < 32; j++) {
                    if (fabsf(xb[j]) > amax) { amax = fabsf(xb[j]); max = xb[j]; }
                    mn = fminf(mn, xb[j]);
                    mx = fmaxf(mx, xb[j]);
                }
                uint16_t h[2];
                memcpy(h, blk, 4);
                float d16 = cs_f16_to_f32(h[0]), m16 = cs_f16_to_f32(h[1]);
                for (int j = 0; j < 32; j++) {
                    double d, bound;
                    switch (t) {
                    case CS_DTYPE_Q8_0: d = amax / 127.0f; bound = fabs(d) / 2 + 127 * fabs(d - d16); break;
                    case CS_DTYPE_Q4_0:
                        d = max / -8.0f;
                        bound = (xb[j] / d > 7.5 ? fabs(d) : fabs(d) / 2) + 8 * fabs(d - d16);
                        break;
                    case CS_DTYPE_Q5_0:
                        d = max / -16.0f;
                        bound = (xb[j] / d > 15.5 ? fabs(d) : fabs(d) / 2) + 16 * fabs(d - d16);
                        break;
                    case CS_DTYPE_Q4_1: d = (mx - mn) / 15.0f; bound = d / 2 + 15 * fabs(d - d16) + fabs(mn - m16); break;
                    default: d = (mx - mn) / 31.0f; bound = d / 2 + 31 * fabs(d - d16) + fabs(mn - m16); break;
                    }
                    bound += 1e-6 * amax;
                    ck_assert_msg(fabs((double)xb[j] - yb[j]) <= bound, "%s 1e%d block %lld element %d: %g -> %g, bound %g",
                                  cs_dtype_name(t), sc, (long long)b, j, xb[j], yb[j], bound);
                }
            }
            free(q);
            free(x);
        }
    }
    free(y);
}
END_TEST

/* The error a plain min/max quantizer makes, with float scales (nothing rounded to F16 or
 * 6 bits, so it has that advantage over the format): Q4_K/Q5_K: per sub-block of 32,
 * levels spaced (max - min) / nmax from min; Q6_K: per 16, x/s rounded with s = max|x| / 31. */
static double naive_rel_rms(cs_dtype t, const float *x, int64_t n) {
    int sub = t == CS_DTYPE_Q6_K ? 16 : 32, nmax = t == CS_DTYPE_Q4_K ? 15 : 31;
    double e = 0, s = 0;
    for (int64_t b = 0; b < n; b += sub) {
        float mn = x[b], mx = x[b], amax = 0;
        for (int j = 0; j < sub; j++) {
            mn = fminf(mn, x[b + j]);
            mx = fmaxf(mx, x[b + j]);
            amax = fmaxf(amax, fabsf(x[b + j]));
        }
        for (int j = 0; j < sub; j++) {
            double v = x[b + j], y;
            if (t == CS_DTYPE_Q6_K) {
                double st = amax / 31.0;
                y = st > 0 ? st * nearbyint(v / st) : 0;
            } else {
                double st = (mx - mn) / (double)nmax;
                y = st > 0 ? mn + st * nearbyint((v - mn) / st) : mn;
            }
            e += (v - y) * (v - y);
            s += v * v;
        }
    }
    return sqrt(e / s);
}

/* The K quantizers on Gaussian rows of 4096 at scales 1e-3, 1 and 1e3. Bounds on the relative
 * RMS error ||x - y|| / ||x||, about 15% above the worst measured (seed 13, 21 rows a type:
 * at most 0.0723 for Q4_K, 0.0366 for Q5_K, 0.0180 for Q6_K; means 0.0711, 0.0357, 0.0173);
 * and on every row at most the min/max quantizer's error (its means: 0.0779, 0.0381, 0.0193). */
START_TEST(k_error_bounds) {
    static const struct { cs_dtype t; double bound; } cases[] = {
        {CS_DTYPE_Q4_K, 0.085}, {CS_DTYPE_Q5_K, 0.043}, {CS_DTYPE_Q6_K, 0.021},
    };
    cs_rng_t rng;
    cs_rng_seed(&rng, 13);
    const int64_t n = 4096;
    float *y = malloc(sizeof(float) * n);
    for (size_t k = 0; k < CS_ARRAY_LEN(cases); k++) {
        double worst = 0, sum = 0, naive_sum = 0;
        for (int r = 0; r < 21; r++) {
            float *x = gauss_row(&rng, n, powf(10, (float)(r % 3 - 1) * 3));
            round_trip(cases[k].t, x, y, n);
            double err = rel_rms(x, y, n), naive = naive_rel_rms(cases[k].t, x, n);
            ck_assert_msg(err < cases[k].bound, "%s row %d: relative RMS error %.4f >= %.3f", cs_dtype_name(cases[k].t), r,
                          err, cases[k].bound);
            ck_assert_msg(err <= naive, "%s row %d: %.4f, worse than min/max's %.4f", cs_dtype_name(cases[k].t), r, err, naive);
            worst = fmax(worst, err);
            sum += err;
            naive_sum += naive;
            free(x);
        }
        fprintf(stderr, "%s: relative RMS error mean %.4f max %.4f (bound %.3f); min/max quantizer mean %.4f\n",
                cs_dtype_name(cases[k].t), sum / 21, worst, cases[k].bound, naive_sum / 21);
    }
    free(y);
}
END_TEST

/* Zero rows decode to zeros; constant rows (magnitudes 1e-3 to 1e3) to the constant within
 * 2^-8 of it (measured at most 2.2e-3: the scales are F16, subnormal ones for the small
 * constants, times 6- or 8-bit integers for the K types); one huge value among small ones
 * comes back within 1% and nothing turns NaN or infinite; rows of tiny values stay finite. */
START_TEST(special_rows) {
    const int64_t n = 512;
    float x[512], y[512];
    cs_rng_t rng;
    cs_rng_seed(&rng, 17);
    for (size_t k = 0; k < CS_ARRAY_LEN(block_types); k++) {
        cs_dtype t = block_types[k];
        memset(x, 0, sizeof x);
        round_trip(t, x, y, n);
        for (int i = 0; i < n; i++) ck_assert_msg(y[i] == 0, "%s zero row: %g", cs_dtype_name(t), y[i]);

        static const float consts[] = {0.37f, -2.5f, 1000.0f, -1e-3f, 1e-3f, 7.0f, 0.05f, -0.01f};
        for (size_t c = 0; c < CS_ARRAY_LEN(consts); c++) {
            for (int i = 0; i < n; i++) x[i] = consts[c];
            round_trip(t, x, y, n);
            for (int i = 0; i < n; i++)
                ck_assert_msg(fabsf(y[i] - consts[c]) <= fabsf(consts[c]) * 0x1p-8f, "%s constant %g: %g",
                              cs_dtype_name(t), consts[c], y[i]);
        }

        float *g = gauss_row(&rng, n, 1);
        memcpy(x, g, sizeof x);
        free(g);
        x[300] = 1e4f;
        x[45] = -3e3f;
        round_trip(t, x, y, n);
        for (int i = 0; i < n; i++) ck_assert_msg(isfinite(y[i]), "%s outlier row: element %d %g", cs_dtype_name(t), i, y[i]);
        ck_assert_msg(fabsf(y[300] - 1e4f) <= 100, "%s outlier: %g", cs_dtype_name(t), y[300]);
        ck_assert_msg(fabsf(y[45] + 3e3f) <= 30, "%s outlier: %g", cs_dtype_name(t), y[45]);

        g = gauss_row(&rng, n, 1e-7f);
        round_trip(t, g, y, n);
        for (int i = 0; i < n; i++) ck_assert(isfinite(y[i]) && fabsf(y[i]) < 1e-5f);
        free(g);
    }
}
END_TEST

/* NaN and infinities in a row: what they decode to is not specified (as in ggml), but every
 * quantizer takes them without a crash or an undefined conversion (run under UBSan), and the
 * blocks of finite values beside them are untouched. */
START_TEST(nonfinite_input) {
    const int64_t n = 512;
    float x[512], y[512], z[512];
    cs_rng_t rng;
    cs_rng_seed(&rng, 29);
    float *g = gauss_row(&rng, n, 1);
    for (size_t k = 0; k < CS_ARRAY_LEN(block_types); k++) {
        cs_dtype t = block_types[k];
        memcpy(x, g, sizeof x);
        round_trip(t, x, z, n);
        x[3] = NAN;
        x[40] = INFINITY;
        x[41] = -INFINITY;
        round_trip(t, x, y, n);
        /* the second K super-block, or the 32-element blocks from 64 on, saw no NaN */
        ck_assert_mem_eq(y + 256, z + 256, sizeof(float) * 256);
    }
    free(g);
}
END_TEST

/* Re-quantizing a decoded row gives the same bytes for the five 32-element types (scales
 * 1e-3 to 1e3; not for scales whose F16 underflows to zero): the extreme values decode to
 * the grid's ends exactly (q d16 and m16), so the scale found again rounds to the same F16
 * and every decoded q d16 (+ m16) scales back to q within F32 rounding, which the truncation
 * after the + 0.5 (Q8_0: the rounding) removes. The K quantizers refit their scales and
 * re-quantize to different bytes in 0.1% (Q4_K) to 20% (Q6_K) of blocks; not checked. */
START_TEST(requantize_idempotent) {
    static const cs_dtype types[] = {CS_DTYPE_Q8_0, CS_DTYPE_Q4_0, CS_DTYPE_Q5_0, CS_DTYPE_Q4_1, CS_DTYPE_Q5_1};
    cs_rng_t rng;
    cs_rng_seed(&rng, 19);
    const int64_t n = 8192;
    float *y = malloc(sizeof(float) * n);
    for (size_t k = 0; k < CS_ARRAY_LEN(types); k++) {
        cs_dtype t = types[k];
        size_t rb = cs_dtype_row_bytes(t, n);
        uint8_t *q1 = malloc(rb), *q2 = malloc(rb);
        for (int sc = -3; sc <= 3; sc++) {
            float *x = gauss_row(&rng, n, powf(10, (float)sc));
            ck_assert_int_eq(cs_quantize_row_ref(q1, x, t, n), CS_OK);
            cs_dequant_row_ref(y, q1, t, n);
            ck_assert_int_eq(cs_quantize_row_ref(q2, y, t, n), CS_OK);
            ck_assert_msg(memcmp(q1, q2, rb) == 0, "%s at 1e%d: re-quantized bytes differ", cs_dtype_name(t), sc);
            free(x);
        }
        free(q1);
        free(q2);
    }
    free(y);
}
END_TEST

/* cs_quant_dot_ref is the double dot of the decoded row, summed in element order, exactly
 * (rows that end inside the 256-element chunk it decodes at a time included) */
START_TEST(dot_is_decoded_dot) {
    cs_rng_t rng;
    cs_rng_seed(&rng, 23);
    static const cs_dtype types[] = {
        CS_DTYPE_Q4_0, CS_DTYPE_Q4_1, CS_DTYPE_Q5_0, CS_DTYPE_Q5_1, CS_DTYPE_Q8_0,
        CS_DTYPE_Q4_K, CS_DTYPE_Q5_K, CS_DTYPE_Q6_K, CS_DTYPE_F32, CS_DTYPE_F16, CS_DTYPE_BF16,
    };
    for (size_t k = 0; k < CS_ARRAY_LEN(types); k++) {
        cs_dtype t = types[k];
        const int64_t n = cs_dtype_block(t) == 256 ? 768 : cs_dtype_block(t) == 32 ? 800 : 301;
        float *w = gauss_row(&rng, n, 1), *a = gauss_row(&rng, n, 1), *y = malloc(sizeof(float) * n);
        void *raw = malloc(cs_dtype_row_bytes(t, n));
        if (cs_dtype_is_quant(t)) {
            ck_assert_int_eq(cs_quantize_row_ref(raw, w, t, n), CS_OK);
        } else {
            for (int64_t i = 0; i < n; i++) {
                if (t == CS_DTYPE_F32) ((float *)raw)[i] = w[i];
                else if (t == CS_DTYPE_F16) ((uint16_t *)raw)[i] = cs_f32_to_f16(w[i]);
                else ((uint16_t *)raw)[i] = cs_f32_to_bf16(w[i]);
            }
        }
        cs_dequant_row_ref(y, raw, t, n);
        double want = 0;
        for (int64_t i = 0; i < n; i++) want += (double)a[i] * (double)y[i];
        ck_assert_msg(cs_quant_dot_ref(raw, t, a, n) == want, "%s", cs_dtype_name(t));
        ck_assert(cs_quant_dot_ref(raw, t, a, 0) == 0);
        free(raw);
        free(w);
        free(a);
        free(y);
    }
}
END_TEST

START_TEST(quantize_refuses) {
    float x[512] = {0};
    uint8_t out[1024];
    cs_error_clear();
    ck_assert_int_eq(cs_quantize_row_ref(out, x, CS_DTYPE_Q4_0, 33), CS_EINVAL);
    ck_assert_msg(strstr(cs_error_last(), "Q4_0"), "%s", cs_error_last());
    ck_assert_int_eq(cs_quantize_row_ref(out, x, CS_DTYPE_Q4_K, 288), CS_EINVAL);
    ck_assert_int_eq(cs_quantize_row_ref(out, x, CS_DTYPE_Q6_K, 32), CS_EINVAL);
    ck_assert_int_eq(cs_quantize_row_ref(out, x, CS_DTYPE_Q8_0, -32), CS_EINVAL);
    static const cs_dtype plain[] = {CS_DTYPE_F32, CS_DTYPE_F16, CS_DTYPE_BF16, CS_DTYPE_I8, CS_DTYPE_COUNT};
    for (size_t k = 0; k < CS_ARRAY_LEN(plain); k++)
        ck_assert_int_eq(cs_quantize_row_ref(out, x, plain[k], 32), CS_EINVAL);
    ck_assert_msg(strstr(cs_error_last(), "not a block type"), "%s", cs_error_last());
    /* nothing to do is not an error, and writes nothing */
    memset(out, 0xAB, sizeof out);
    for (size_t k = 0; k < CS_ARRAY_LEN(block_types); k++)
        ck_assert_int_eq(cs_quantize_row_ref(out, x, block_types[k], 0), CS_OK);
    ck_assert_uint_eq(out[0], 0xAB);
}
END_TEST

int main(void) {
    const TTest *const tests[] = {
        known_q4_0, known_q4_1, known_q5, known_q8_0, known_q4_K, known_q5_K, known_q6_K, plain_types,
        rows_of_blocks, legacy_error_bounds, k_error_bounds, special_rows, nonfinite_input, requantize_idempotent,
        dot_is_decoded_dot, quantize_refuses,
    };
    return cs_check_main("quant", tests, CS_ARRAY_LEN(tests), 0, CK_FORK);
}
