/* bench.cu: what bench/gpu.sh measures the backend against, on the same GPU in the same run:
 * the device's read bandwidth (a kernel summing a buffer far larger than L2, as decode
 * reads its weights) and cuBLAS's own GEMM throughput on the prefill's shapes (BF16 in,
 * F32 out, F32 accumulation: the backend's matmul). The operands are random, as weights and
 * activations are: on zeros the tensor cores switch fewer bits, draw less power and hold
 * higher clocks, which overstates the peak the backend is set against. CUDA builds only;
 * not emulated. */
#include "gpu_kernels/cuda_common.cuh"

#include "gpu_kernels/gpu_backend.h"

namespace CS_NS {

static __global__ void k_read(const float4 *p, size_t n, float *out) {
    float s = 0.0f;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float4 v = p[i];
        s += v.x + v.y + v.z + v.w;
    }
    s = warp_sum(s);
    if ((threadIdx.x & 31) == 0 && s == 12345.678f) *out = s; /* keeps the loads; (almost) never true */
}

/* p[i] = a value in [-1, 1) from a hash of i and seed */
static __device__ __forceinline__ float hash_unit(size_t i, uint32_t seed) {
    uint32_t h = (uint32_t)i * 2654435761u ^ (uint32_t)(i >> 32) * 40503u ^ seed * 0x9e3779b9u;
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    h *= 0x846ca68bu;
    h ^= h >> 16;
    return (float)(h >> 8) * (2.0f / 16777216.0f) - 1.0f;
}
static __global__ void k_fill_bf16(__nv_bfloat16 *p, size_t n, uint32_t seed) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = __float2bfloat16(hash_unit(i, seed));
}
static __global__ void k_fill_f32(float *p, size_t n, uint32_t seed) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = hash_unit(i, seed);
}

} /* namespace CS_NS */

using namespace CS_NS;

/* the milliseconds from event a (recorded) to now on stream 0; destroys both events */
static float elapsed_ms(cudaEvent_t a, cudaEvent_t b) {
    CUDA_CHECK(cudaEventRecord(b, 0));
    CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    return ms;
}

extern "C" int gpu_bench_read_bandwidth(size_t bytes, int reps, double *gbps, char *name, int name_len) {
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return -1;
    snprintf(name, (size_t)name_len, "%s", prop.name);
    float4 *buf = NULL;
    float *out = NULL;
    if (cudaMalloc(&buf, bytes) != cudaSuccess || cudaMalloc(&out, sizeof(float)) != cudaSuccess) return -1;
    CS_LAUNCH(k_fill_f32, 1024, 256, 0, 0, (float *)buf, bytes / sizeof(float), 1u);
    CUDA_CHECK_LAUNCH();
    size_t n = bytes / sizeof(float4);
    int blocks = prop.multiProcessorCount * 8;
    cudaEvent_t a, b;
    CUDA_CHECK(cudaEventCreate(&a));
    CUDA_CHECK(cudaEventCreate(&b));
    CS_LAUNCH(k_read, blocks, 512, 0, 0, buf, n, out); /* warm */
    CUDA_CHECK(cudaEventRecord(a, 0));
    for (int r = 0; r < reps; r++) CS_LAUNCH(k_read, blocks, 512, 0, 0, buf, n, out);
    float ms = elapsed_ms(a, b);
    *gbps = (double)bytes * reps / (ms * 1e-3) / 1e9;
    cudaFree(buf);
    cudaFree(out);
    return 0;
}

extern "C" int gpu_bench_gemm(int m, int n, int k, int reps, double *tflops) {
    void *A = NULL, *B = NULL, *C = NULL;
    if (cudaMalloc(&A, (size_t)m * k * 2) != cudaSuccess || cudaMalloc(&B, (size_t)k * n * 2) != cudaSuccess ||
        cudaMalloc(&C, (size_t)m * n * 4) != cudaSuccess)
        return -1;
    CS_LAUNCH(k_fill_bf16, 1024, 256, 0, 0, (__nv_bfloat16 *)A, (size_t)m * k, 2u);
    CS_LAUNCH(k_fill_bf16, 1024, 256, 0, 0, (__nv_bfloat16 *)B, (size_t)k * n, 3u);
    CUDA_CHECK_LAUNCH();
    cublasHandle_t h;
    CUBLAS_CHECK(cublasCreate(&h));
    const float one = 1.0f, zero = 0.0f;
    cudaEvent_t a, b;
    CUDA_CHECK(cudaEventCreate(&a));
    CUDA_CHECK(cudaEventCreate(&b));
    /* the backend's call: y[n, m] = x[n, k] · wᵀ with w (m, k) row-major */
    for (int r = 0; r <= reps; r++) {
        if (r == 1) CUDA_CHECK(cudaEventRecord(a, 0));
        CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, A, CUDA_R_16BF, k, B, CUDA_R_16BF, k, &zero,
                                  C, CUDA_R_32F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
    float ms = elapsed_ms(a, b);
    *tflops = 2.0 * m * n * (double)k * reps / (ms * 1e-3) / 1e12;
    cublasDestroy(h);
    cudaFree(A);
    cudaFree(B);
    cudaFree(C);
    return 0;
}
