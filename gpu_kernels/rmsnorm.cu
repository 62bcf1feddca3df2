/* rmsnorm.cu: one block per row; the sum of squares in F32 over the block, then the scale.
 * Qwen3's q/k norms are the same op over rows of one head. */
#include "gpu_kernels/ops.cuh"

namespace CS_NS {

static __global__ void k_rmsnorm(float *y, const float *x, int dim, const float *w, float eps) {
    const float *xr = x + (size_t)blockIdx.x * dim;
    float *yr = y + (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) ss += xr[j] * xr[j];
    ss = block_sum(ss);
    float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int j = threadIdx.x; j < dim; j += blockDim.x) yr[j] = w[j] * (xr[j] * inv);
}

void op_rmsnorm(cudaStream_t st, float *y, const float *x, int n, int dim, const float *w, float eps) {
    if (n <= 0) return;
    int threads = dim >= 1024 ? 256 : dim >= 256 ? 128 : 32;
    CS_LAUNCH(k_rmsnorm, (unsigned)n, threads, 0, st, y, x, dim, w, eps);
    CUDA_CHECK_LAUNCH();
}

void load_rmsnorm_kernels() {
    load_kernel(k_rmsnorm);
}

} /* namespace CS_NS */
