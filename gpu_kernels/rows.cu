/* rows.cu: row scatter (new keys and values into their KV pages) and gather (the rows whose
 * logits are wanted). */
#include "gpu_kernels/ops.cuh"

namespace CS_NS {

static __device__ __forceinline__ void store_f(float *p, size_t i, float x) { p[i] = x; }
static __device__ __forceinline__ void store_f(__nv_bfloat16 *p, size_t i, float x) { p[i] = __float2bfloat16(x); }

template <typename T>
static __global__ void k_set_rows(T *dst, const float *src, const int32_t *idx, int len) {
    int i = blockIdx.x, c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c < len) store_f(dst, (size_t)idx[i] * len + c, src[(size_t)i * len + c]);
}

static __global__ void k_get_rows(float *dst, const float *src, const int32_t *idx, int len) {
    int i = blockIdx.x, c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c < len) dst[(size_t)i * len + c] = src[(size_t)idx[i] * len + c];
}

void op_set_rows(cudaStream_t st, void *dst, int dtype, const float *src, const int32_t *idx, int n, int len) {
    if (n <= 0 || len <= 0) return;
    if (dtype == DT_BF16)
        CS_LAUNCH(k_set_rows<__nv_bfloat16>, dim3(n, (len + 255) / 256), 256, 0, st, (__nv_bfloat16 *)dst, src, idx, len);
    else CS_LAUNCH(k_set_rows<float>, dim3(n, (len + 255) / 256), 256, 0, st, (float *)dst, src, idx, len);
    CUDA_CHECK_LAUNCH();
}

void op_get_rows(cudaStream_t st, float *dst, const float *src, const int32_t *idx, int n, int len) {
    if (n <= 0 || len <= 0) return;
    CS_LAUNCH(k_get_rows, dim3(n, (len + 255) / 256), 256, 0, st, dst, src, idx, len);
    CUDA_CHECK_LAUNCH();
}

void load_rows_kernels() {
    load_kernel(k_set_rows<__nv_bfloat16>);
    load_kernel(k_set_rows<float>);
    load_kernel(k_get_rows);
}

} /* namespace CS_NS */
