/* rope.cu: rotate-half rotary embeddings, one thread per (row, head, pair). The angle is
 * formed as the CPU forms it (float position times float inverse frequency) and its sine
 * and cosine taken in full precision. Llama-3's scaling lives in inv_freq. */
#include "gpu_kernels/ops.cuh"

namespace CS_NS {

static __global__ void k_rope(float *x, int n, int nh, int hd, const int32_t *pos, const float *inv_freq) {
    int half = hd / 2;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x, total = (size_t)n * nh * half;
    if (i >= total) return;
    int j = (int)(i % half);
    size_t rh = i / half; /* row * nh + head */
    int row = (int)(rh / nh);
    float f = (float)pos[row] * inv_freq[j], s, c;
    sincosf(f, &s, &c);
    float *v = x + rh * hd;
    float a = v[j], b = v[j + half];
    v[j] = a * c - b * s;
    v[j + half] = b * c + a * s;
}

void op_rope(cudaStream_t st, float *x, int n, int nh, int hd, const int32_t *pos, const float *inv_freq) {
    size_t total = (size_t)n * nh * (hd / 2);
    if (!total) return;
    CS_LAUNCH(k_rope, (unsigned)((total + 255) / 256), 256, 0, st, x, n, nh, hd, pos, inv_freq);
    CUDA_CHECK_LAUNCH();
}

void load_rope_kernels() {
    load_kernel(k_rope);
}

} /* namespace CS_NS */
