/* kernels_ref.c: plain reference kernels, written for clarity (llama2.c style). They
 * define what the fast paths must compute and are what tests compare against. They follow
 * transformers' Llama math: RMSNorm in F32, rotate-half RoPE, softmax(QKᵀ/√d)V. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels/kernels.h"
#include "base/quant.h"

static float weight_at(const cs_weight_t *w, size_t i) {
    switch (w->dtype) {
    case CS_DTYPE_F32: return ((const float *)w->data)[i];
    case CS_DTYPE_BF16: return cs_bf16_to_f32(((const uint16_t *)w->data)[i]);
    case CS_DTYPE_F16: return cs_f16_to_f32(((const uint16_t *)w->data)[i]);
    default: CS_ASSERT(!"weight dtype");
    }
    return 0;
}

void cs_matmul_ref(float *y, const float *x, int n, const cs_weight_t *w, const float *bias) {
    if (cs_dtype_is_quant(w->dtype)) { /* each element dequantized, the sum in double in column order */
        size_t rb = cs_dtype_row_bytes(w->dtype, w->cols);
        for (int i = 0; i < n; i++)
            for (int r = 0; r < w->rows; r++)
                y[(size_t)i * w->rows + r] =
                    (float)cs_quant_dot_ref((const char *)w->data + (size_t)r * rb, w->dtype, x + (size_t)i * w->cols, w->cols) +
                    (bias ? bias[r] : 0.0f);
        return;
    }
    for (int i = 0; i < n; i++)
        for (int r = 0; r < w->rows; r++) {
            double acc = 0;
            for (int c = 0; c < w->cols; c++)
                acc += (double)x[(size_t)i * w->cols + c] * weight_at(w, (size_t)r * w->cols + c);
            y[(size_t)i * w->rows + r] = (float)acc + (bias ? bias[r] : 0.0f);
        }
}

void cs_round_bf16_ref(float *dst, const float *x, size_t count) {
    for (size_t i = 0; i < count; i++) dst[i] = cs_bf16_to_f32(cs_f32_to_bf16(x[i]));
}

void cs_rmsnorm_ref(float *y, const float *x, int n, int dim, const float *w, float eps) {
    for (int i = 0; i < n; i++) {
        const float *xi = x + (size_t)i * dim;
        float *yi = y + (size_t)i * dim;
        double ss = 0;
        for (int j = 0; j < dim; j++) ss += (double)xi[j] * xi[j];
        float inv = 1.0f / sqrtf((float)(ss / dim) + eps);
        for (int j = 0; j < dim; j++) yi[j] = w[j] * (xi[j] * inv);
    }
}

void cs_rope_ref(float *x, int n, int n_heads, int head_dim, const int32_t *pos, const float *inv_freq) {
    int half = head_dim / 2;
    for (int i = 0; i < n; i++)
        for (int h = 0; h < n_heads; h++) {
            float *v = x + ((size_t)i * n_heads + h) * head_dim;
            for (int j = 0; j < half; j++) {
                float f = (float)pos[i] * inv_freq[j];
                float c = cosf(f), s = sinf(f);
                float a = v[j], b = v[j + half];
                v[j] = a * c - b * s;
                v[j + half] = b * c + a * s;
            }
        }
}

void cs_attention_ref(float *out, const float *q, const float *k, const float *v, int n, int pos0,
                      int n_heads, int n_kv_heads, int head_dim, int window) {
    int group = n_heads / n_kv_heads, kv_dim = n_kv_heads * head_dim;
    float scale = 1.0f / sqrtf((float)head_dim);
    int n_keys = pos0 + n;
    float *p = malloc(sizeof(float) * (size_t)n_keys);
    CS_ASSERT(p);
    for (int i = 0; i < n; i++) {
        int qpos = pos0 + i;
        int first = window > 0 && qpos - window + 1 > 0 ? qpos - window + 1 : 0;
        for (int h = 0; h < n_heads; h++) {
            const float *qh = q + ((size_t)i * n_heads + h) * head_dim;
            int kvh = h / group;
            float mx = -INFINITY;
            for (int j = first; j <= qpos; j++) {
                const float *kj = k + (size_t)j * kv_dim + kvh * head_dim;
                float s = 0;
                for (int d = 0; d < head_dim; d++) s += qh[d] * kj[d];
                p[j] = s * scale;
                if (p[j] > mx) mx = p[j];
            }
            double sum = 0;
            for (int j = first; j <= qpos; j++) { p[j] = expf(p[j] - mx); sum += p[j]; }
            float *oh = out + ((size_t)i * n_heads + h) * head_dim;
            for (int d = 0; d < head_dim; d++) oh[d] = 0;
            for (int j = first; j <= qpos; j++) {
                const float *vj = v + (size_t)j * kv_dim + kvh * head_dim;
                float pj = (float)(p[j] / sum);
                for (int d = 0; d < head_dim; d++) oh[d] += pj * vj[d];
            }
        }
    }
    free(p);
}

void cs_softmax_ref(float *x, int n) {
    float mx = -INFINITY;
    for (int i = 0; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    double sum = 0;
    for (int i = 0; i < n; i++) { x[i] = expf(x[i] - mx); sum += x[i]; }
    for (int i = 0; i < n; i++) x[i] = (float)(x[i] / sum);
}

void cs_silu_mul_ref(float *gate, const float *up, size_t n) {
    for (size_t i = 0; i < n; i++) {
        float g = gate[i];
        gate[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

void cs_lora_ref(float *y, const float *x, int n, const float *a, const float *b, int rank, int d_in,
                 int d_out, float scale) {
    float *t = malloc(sizeof(float) * (size_t)(rank > 0 ? rank : 1));
    CS_ASSERT(t);
    for (int i = 0; i < n; i++) {
        for (int r = 0; r < rank; r++) {
            double acc = 0;
            for (int c = 0; c < d_in; c++) acc += (double)x[(size_t)i * d_in + c] * a[(size_t)r * d_in + c];
            t[r] = (float)acc;
        }
        for (int o = 0; o < d_out; o++) {
            double acc = 0;
            for (int r = 0; r < rank; r++) acc += (double)t[r] * b[(size_t)o * rank + r];
            y[(size_t)i * d_out + o] += scale * (float)acc;
        }
    }
    free(t);
}
