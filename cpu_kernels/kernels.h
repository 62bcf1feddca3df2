/* kernels.h: the CPU backend's kernels. Every *_ref function is a plain loop, the
 * readable definition; the fast paths (AVX-512, tiled BLAS) are tested against them in
 * tests/test_cpu_kernels.c. All activations F32, accumulation F32 (double where noted). */
#ifndef CS_KERNELS_H
#define CS_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "engine/backend.h"

/* ---- reference kernels ---- */
void cs_matmul_ref(float *y, const float *x, int n, const cs_weight_t *w, const float *bias);
void cs_rmsnorm_ref(float *y, const float *x, int n, int dim, const float *w, float eps);
void cs_rope_ref(float *x, int n, int n_heads, int head_dim, const int32_t *pos, const float *inv_freq);
void cs_attention_ref(float *out, const float *q, const float *k, const float *v, int n, int pos0,
                      int n_heads, int n_kv_heads, int head_dim, int window);
void cs_silu_mul_ref(float *gate, const float *up, size_t n);
void cs_lora_ref(float *y, const float *x, int n, const float *a, const float *b, int rank, int d_in,
                 int d_out, float scale);

/* ---- AVX-512 kernels (call only when cs_cpu_has_avx512()) ---- */
int cs_cpu_has_avx512(void);
/* y[i, r] = dot(x[i, :], w[r, :]) for rows r in [r0, r1), i < n; w of dtype BF16/F16/F32 */
void cs_gemv_rows_avx512(float *y, int ldy, const float *x, int n, const cs_weight_t *w, int r0, int r1);
/* convert rows [r0, r1) of w to F32 into dst (r1 - r0, w->cols) */
void cs_convert_rows_avx512(float *dst, const cs_weight_t *w, int r0, int r1);

#endif
