/* add.cu: the residual adds and the projections' biases. */
#include "gpu_kernels/ops.cuh"

namespace CS_NS {

static __global__ void k_add(float *y, const float *x, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += x[i];
}

static __global__ void k_add_bias(float *y, const float *bias, int cols) {
    int r = blockIdx.x, c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c < cols) y[(size_t)r * cols + c] += bias[c];
}

void op_add(cudaStream_t st, float *y, const float *x, size_t n) {
    if (!n) return;
    CS_LAUNCH(k_add, (unsigned)((n + 255) / 256), 256, 0, st, y, x, n);
    CUDA_CHECK_LAUNCH();
}

void op_add_bias(cudaStream_t st, float *y, const float *bias, int n, int cols) {
    if (n <= 0 || cols <= 0) return;
    CS_LAUNCH(k_add_bias, dim3(n, (cols + 255) / 256), 256, 0, st, y, bias, cols);
    CUDA_CHECK_LAUNCH();
}

void load_add_kernels() {
    load_kernel(k_add);
    load_kernel(k_add_bias);
}

} /* namespace CS_NS */
