/* silu_mul.cu: the MLP's gate: silu(g) · u, in place on g. */
#include "gpu_kernels/ops.cuh"

namespace CS_NS {

static __global__ void k_silu_mul(float *g, const float *u, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float x = g[i];
        g[i] = x / (1.0f + expf(-x)) * u[i];
    }
}

void op_silu_mul(cudaStream_t st, float *g, const float *u, size_t n) {
    if (!n) return;
    CS_LAUNCH(k_silu_mul, (unsigned)((n + 255) / 256), 256, 0, st, g, u, n);
    CUDA_CHECK_LAUNCH();
}

void load_silu_mul_kernels() {
    load_kernel(k_silu_mul);
}

} /* namespace CS_NS */
