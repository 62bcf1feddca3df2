/* embed.cu: rows of the embedding table, widened to F32. */
#include "gpu_kernels/ops.cuh"

namespace CS_NS {

template <class T>
static __global__ void k_embed(float *y, const T *table, int cols, const int32_t *ids) {
    int i = blockIdx.x, c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c < cols) y[(size_t)i * cols + c] = load_f(table, (size_t)ids[i] * cols + c);
}

void op_embed(cudaStream_t st, float *y, const void *table, int dtype, int cols, const int32_t *ids, int n) {
    if (n <= 0) return;
    dim3 grid(n, (cols + 255) / 256);
    switch (dtype) {
    case DT_F32: CS_LAUNCH(k_embed<float>, grid, 256, 0, st, y, (const float *)table, cols, ids); break;
    case DT_BF16: CS_LAUNCH(k_embed<__nv_bfloat16>, grid, 256, 0, st, y, (const __nv_bfloat16 *)table, cols, ids); break;
    default: CS_LAUNCH(k_embed<__half>, grid, 256, 0, st, y, (const __half *)table, cols, ids); break;
    }
    CUDA_CHECK_LAUNCH();
}

void load_embed_kernels() {
    load_kernel(k_embed<float>);
    load_kernel(k_embed<__nv_bfloat16>);
    load_kernel(k_embed<__half>);
}

} /* namespace CS_NS */
