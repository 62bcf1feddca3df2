/* quant.h: the block-quantized weight formats of GGUF files (ggml's layouts, bit for bit),
 * their plain definitions: a row's dequantization and quantization and the dot product of a
 * quantized row with F32 activations. The CPU kernels (cpu_kernels/) are tested against
 * these; these are tested against the `gguf` Python package (GGUF's reference code).
 *
 * A row of n elements is n / block blocks back to back (cs_dtype_block: 32, or 256 for the
 * "K" types), each block a struct below. Scales are IEEE half (F16) stored little-endian;
 * widened exactly (cs_f16_to_f32), then every product in F32 in the order each function
 * says, as ggml's dequantize_row_* computes it. */
#ifndef CS_QUANT_H
#define CS_QUANT_H

#include <stdint.h>

#include "base/common.h"

#define CS_QK 32    /* elements in a block of the 32-element types */
#define CS_QK_K 256 /* ... of the K types (a super-block) */

typedef struct { uint16_t d; uint8_t qs[16]; } cs_block_q4_0;                 /* x = (q - 8) d */
typedef struct { uint16_t d, m; uint8_t qs[16]; } cs_block_q4_1;              /* x = q d + m */
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; } cs_block_q5_0;  /* x = (q - 16) d */
typedef struct { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; } cs_block_q5_1; /* x = q d + m */
typedef struct { uint16_t d; int8_t qs[32]; } cs_block_q8_0;                  /* x = q d */
/* 8 sub-blocks of 32: x = d sc_j q - dmin m_j, sc_j and m_j 6 bits packed in scales */
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } cs_block_q4_K;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; } cs_block_q5_K;
/* 16 sub-blocks of 16: x = d sc_j (q - 32), q 6 bits (low 4 in ql, high 2 in qh) */
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; } cs_block_q6_K;

_Static_assert(sizeof(cs_block_q4_0) == 18, "q4_0");
_Static_assert(sizeof(cs_block_q4_1) == 20, "q4_1");
_Static_assert(sizeof(cs_block_q5_0) == 22, "q5_0");
_Static_assert(sizeof(cs_block_q5_1) == 24, "q5_1");
_Static_assert(sizeof(cs_block_q8_0) == 34, "q8_0");
_Static_assert(sizeof(cs_block_q4_K) == 144, "q4_K");
_Static_assert(sizeof(cs_block_q5_K) == 176, "q5_K");
_Static_assert(sizeof(cs_block_q6_K) == 210, "q6_K");

/* sub-block j's (j < 8) 6-bit scale and minimum from a Q4_K/Q5_K block's 12 scale bytes */
static inline void cs_q4k_scale_min(int j, const uint8_t *s, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (uint8_t)((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
        *m = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

/* n elements (a multiple of t's block) of type t at src to F32. t: F32, F16, BF16 or one of
 * the block types. */
void cs_dequant_row_ref(float *dst, const void *src, cs_dtype t, int64_t n);

/* Quantize n floats (a multiple of t's block) into t's blocks at dst, for the block types;
 * CS_EINVAL for another type or n. Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 give ggml's
 * quantize_row_*_ref bytes (and gguf.quants.quantize's) exactly; Q4_K, Q5_K and Q6_K are our
 * least-squares quantizers (quant.c says what each minimises). No state: rows may be
 * quantized from several threads at once. */
int cs_quantize_row_ref(void *dst, const float *src, cs_dtype t, int64_t n);

/* Σ x[i] · w[i] over a row of n elements of type t (any dtype cs_dequant_row_ref takes):
 * each element dequantized as cs_dequant_row_ref gives it, the products and sum in double,
 * in element order (as cs_matmul_ref sums a plain row). */
double cs_quant_dot_ref(const void *w, cs_dtype t, const float *x, int64_t n);

#endif
