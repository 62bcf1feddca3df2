/* vnni.h: the BF16 pair layout shared by the AMX (gemm_bf16.c) and AVX512-BF16
 * (gemm_dpbf16.c) GEMMs. Both multiply pairs of BF16 values, so weights are packed in
 * VNNI order: a "tile" of 16 weight rows × 32 columns is stored as 16 lines of 32 bf16,
 * line i holding the pairs (w[r][2i], w[r][2i+1]) of the 16 rows r in order. F32
 * activations are split into BF16 terms x = x₁ + x₂ (+ x₃), each rounded to nearest even:
 * one term is x rounded to BF16, two leave a residual below 2⁻¹⁶ relative, three represent
 * all 24 bits of an F32 mantissa. Header-only: the functions inline into their callers'
 * target attributes. */
#ifndef CS_VNNI_H
#define CS_VNNI_H

#include <immintrin.h>
#include <stdint.h>

#include "cpu_kernels/kernels.h"

#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define VNNI_INLINE static inline __attribute__((always_inline))
#define VNNI_TILE_ELEMS 512 /* bf16 in one 16×32 tile (1 KiB) */

/* bf16 bits of f rounded to nearest even, in the low half of each lane; a NaN stays a quiet
 * NaN (as cs_f32_to_bf16) */
VNNI_TARGET VNNI_INLINE __m512i vnni_round_bf16(__m512 f) {
    __m512i u = _mm512_castps_si512(f);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    return _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}

/* 32 floats -> `terms` vectors of 32 bf16 in order whose sum is x (see above); dst[t]
 * gets term t */
VNNI_TARGET VNNI_INLINE void vnni_split32(__m512i *dst, __m512 x0, __m512 x1, int terms) {
    /* packus interleaves the 128-bit lanes of its two inputs; this restores the order */
    const __m512i fix = _mm512_set_epi64(7, 5, 3, 1, 6, 4, 2, 0);
    for (int t = 0; t < terms; t++) {
        __m512i h0 = vnni_round_bf16(x0), h1 = vnni_round_bf16(x1);
        dst[t] = _mm512_permutexvar_epi64(fix, _mm512_packus_epi32(h0, h1));
        x0 = _mm512_sub_ps(x0, _mm512_castsi512_ps(_mm512_slli_epi32(h0, 16)));
        x1 = _mm512_sub_ps(x1, _mm512_castsi512_ps(_mm512_slli_epi32(h1, 16)));
    }
}

/* 16×16 transpose of 32-bit elements in r[0..15] */
VNNI_TARGET VNNI_INLINE void vnni_transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* r[4q + j] now holds, in each 128-bit lane L, column (4L + j) entries of rows 4q..4q+3
     * of the lane-L block; combine lanes across quads */
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

#define VNNI_PACK_PREFETCH_KB 8 /* weight rows are read this many 64-byte lines ahead */

/* weight rows [r0, r0 + 16·nt) (zero past w->rows), k blocks [kb0, kb1) of 32 columns (zero
 * past K), into VNNI tiles [nt][kb1 - kb0] at wp (64-byte aligned) */
VNNI_TARGET VNNI_INLINE void vnni_pack_w(uint16_t *wp, const cs_weight_t *w, int r0, int nt, int kb0, int kb1) {
    int K = w->cols;
    const uint16_t *base = w->data;
    for (int j = 0; j < nt; j++) {
        int n0 = r0 + j * 16;
        int valid = CS_MAX(0, CS_MIN(16, w->rows - n0));
        for (int kb = kb0; kb < kb1; kb++) {
            int left = K - kb * 32;
            __mmask32 mk = left >= 32 ? 0xffffffffu : (__mmask32)((1u << left) - 1);
            __m512i r[16];
            for (int i = 0; i < 16; i++) {
                const uint16_t *src = base + (size_t)(n0 + i) * K + kb * 32;
                if (i < valid && (kb + VNNI_PACK_PREFETCH_KB) * 32 < K)
                    _mm_prefetch((const char *)(src + VNNI_PACK_PREFETCH_KB * 32), _MM_HINT_T0);
                r[i] = i < valid ? _mm512_maskz_loadu_epi16(mk, src) : _mm512_setzero_si512();
            }
            vnni_transpose16(r);
            uint16_t *dst = wp + ((size_t)j * (kb1 - kb0) + kb - kb0) * VNNI_TILE_ELEMS;
            for (int i = 0; i < 16; i++) _mm512_store_si512(dst + i * 32, r[i]);
        }
    }
}

#endif
