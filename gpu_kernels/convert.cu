/* convert.cu: F32 activations rounded to the weights' 16-bit type before a cuBLAS GEMM. */
#include "gpu_kernels/ops.cuh"

namespace CS_NS {

static __global__ void k_to_bf16(__nv_bfloat16 *dst, const float *src, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = __float2bfloat16(src[i]);
}

static __global__ void k_to_f16(__half *dst, const float *src, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = __float2half(src[i]);
}

void op_convert(cudaStream_t st, void *dst, int dtype, const float *src, size_t n) {
    if (!n) return;
    unsigned blocks = (unsigned)((n + 255) / 256);
    switch (dtype) {
    case DT_BF16: CS_LAUNCH(k_to_bf16, blocks, 256, 0, st, (__nv_bfloat16 *)dst, src, n); break;
    case DT_F16: CS_LAUNCH(k_to_f16, blocks, 256, 0, st, (__half *)dst, src, n); break;
    default: CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDeviceToDevice, st)); return;
    }
    CUDA_CHECK_LAUNCH();
}

void load_convert_kernels() {
    load_kernel(k_to_bf16);
    load_kernel(k_to_f16);
}

} /* namespace CS_NS */
