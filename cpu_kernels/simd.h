/* simd.h: small AVX-512 helpers shared by the kernel files. Header-only: the functions inline
 * into their callers' target attributes. */
#ifndef CS_SIMD_H
#define CS_SIMD_H

#include <immintrin.h>

#define SIMD_TARGET __attribute__((target("avx512f")))
#define SIMD_INLINE static inline __attribute__((always_inline))

/* a[0..16) summed across their lanes at once, lane o of the result taking a[o]'s sum: a
 * transposing tree (45 instructions where 16 horizontal sums take about 130). Every vector's
 * lanes are paired the same way (l with l+8, then l+4, l+2, l+1), so a sum does not depend
 * on the vector's place or on the others: batch-invariant. */
/* the tree's last three levels, on s[0..8): quarters paired across each two vectors (lane l
 * with l+4 of their 256-bit halves), then lanes l with l+2, then l with l+1; the same
 * pairing for every vector */
SIMD_TARGET SIMD_INLINE __m512 cs_reduce16_tail_avx512(const __m512 *s) {
    __m512 t[4], v[2];
#pragma GCC unroll 4
    for (int m = 0; m < 4; m++) /* + lane l+4 */
        t[m] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * m], s[2 * m + 1], 0x88),
                             _mm512_shuffle_f32x4(s[2 * m], s[2 * m + 1], 0xdd));
#pragma GCC unroll 2
    for (int m = 0; m < 2; m++) /* + lane l+2 */
        v[m] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * m], t[2 * m + 1], 0x44),
                             _mm512_shuffle_ps(t[2 * m], t[2 * m + 1], 0xee));
    /* + lane l+1 */
    return _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xdd));
}

SIMD_TARGET SIMD_INLINE __m512 cs_reduce16_avx512(const __m512 *a) {
    __m512 s[8];
    /* level 1 pairs the vectors whose sums end in lanes o and o+4 (the tree's last levels
     * leave quarter q holding the vectors 4q .. 4q+3 in order) */
#pragma GCC unroll 8
    for (int m = 0; m < 8; m++) {
        int p = (2 * m) % 4 * 4 + (2 * m) / 4, q = (2 * m + 1) % 4 * 4 + (2 * m + 1) / 4;
        s[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[p], a[q], 0x44), _mm512_shuffle_f32x4(a[p], a[q], 0xee));
    }
    return cs_reduce16_tail_avx512(s);
}

/* the same in 8 lanes (AVX2): a[0..8) summed, lane o taking a[o]'s sum, every vector's lanes
 * paired l with l+4, then l+2, l+1 */
__attribute__((target("avx2"))) SIMD_INLINE __m256 cs_reduce8_avx2(const __m256 *a) {
    __m256 s[4], t[2];
    /* the tree's last levels leave lane 4h + q holding the vector at position 2q + h: place
     * vector o at position (o % 4) * 2 + o / 4 */
#pragma GCC unroll 4
    for (int m = 0; m < 4; m++) { /* lane l + lane l+4 */
        int p = (2 * m) % 2 * 4 + (2 * m) / 2, q = (2 * m + 1) % 2 * 4 + (2 * m + 1) / 2;
        s[m] = _mm256_add_ps(_mm256_permute2f128_ps(a[p], a[q], 0x20), _mm256_permute2f128_ps(a[p], a[q], 0x31));
    }
#pragma GCC unroll 2
    for (int m = 0; m < 2; m++) /* + lane l+2 */
        t[m] = _mm256_add_ps(_mm256_shuffle_ps(s[2 * m], s[2 * m + 1], 0x44), _mm256_shuffle_ps(s[2 * m], s[2 * m + 1], 0xee));
    return _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], 0x88), _mm256_shuffle_ps(t[0], t[1], 0xdd)); /* + lane l+1 */
}

#endif
