/* cuda_common.cuh: what every .cu file of gpu_kernels/ includes. The same sources build two
 * ways: with nvcc for the GPU (namespace cs_cuda), and with g++ against the host emulator
 * (cuda_emu.h, namespace cs_cuda_emu) so `make check` runs them everywhere. Kernels are
 * launched with CS_LAUNCH, never with <<<>>> directly (the emulator is plain C++). */
#ifndef CS_CUDA_COMMON_CUH
#define CS_CUDA_COMMON_CUH

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#ifdef CS_CUDA_EMU
#include "gpu_kernels/cuda_emu.h"
#define CS_NS cs_cuda_emu
using namespace cs_cuda_emu; /* the runtime's names, as <cuda_runtime.h> gives them */
#define CS_LAUNCH(kernel, grid, block, smem, stream, ...) \
    cs_cuda_emu::launch((const void *)(kernel), (grid), (block), (smem), (stream), [=]() { kernel(__VA_ARGS__); })
/* T *name: the launch's dynamic shared memory (CS_LAUNCH's smem bytes) */
#define CS_DYN_SMEM(T, name) T *name = (T *)cs_cuda_emu::dynamic_smem()
#else
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define CS_NS cs_cuda
#define CS_LAUNCH(kernel, grid, block, smem, stream, ...) kernel<<<(grid), (block), (smem), (stream)>>>(__VA_ARGS__)
#define CS_DYN_SMEM(T, name)                                  \
    extern __shared__ __align__(16) unsigned char cs_dyn_smem_[]; \
    T *name = (T *)cs_dyn_smem_
#endif

namespace CS_NS {

/* a failed CUDA call on a path with no way to report it (a kernel launch, a copy the caller
 * cannot fail): print where and abort, as ggml-cuda does */
[[noreturn]] void cuda_fatal(const char *call, const char *err, const char *file, int line);

#define CUDA_CHECK(call)                                                                      \
    do {                                                                                      \
        cudaError_t err_ = (call);                                                            \
        if (err_ != cudaSuccess) cuda_fatal(#call, cudaGetErrorString(err_), __FILE__, __LINE__); \
    } while (0)
#define CUBLAS_CHECK(call)                                                                     \
    do {                                                                                       \
        cublasStatus_t st_ = (call);                                                           \
        if (st_ != CUBLAS_STATUS_SUCCESS) cuda_fatal(#call, cublasGetStatusString(st_), __FILE__, __LINE__); \
    } while (0)
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

/* a kernel's module loaded now (ops.cuh's load_*_kernels) */
template <class T> static inline void load_kernel(T *kernel) {
    cudaFuncAttributes a;
    CUDA_CHECK(cudaFuncGetAttributes(&a, kernel));
}

/* dtypes of weights as the kernels see them (base/common.h's cs_dtype values) */
enum { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2 };

static __device__ __forceinline__ float load_f(const float *p, size_t i) { return p[i]; }
static __device__ __forceinline__ float load_f(const __nv_bfloat16 *p, size_t i) { return __bfloat162float(p[i]); }
static __device__ __forceinline__ float load_f(const __half *p, size_t i) { return __half2float(p[i]); }

static __device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
static __device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
/* the sum over a block of blockDim.x (a multiple of 32, at most 1024) threads, in every
 * thread; the block's threads must all call it */
static __device__ __forceinline__ float block_sum(float v) {
    __shared__ float part[32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads(); /* part[] may still be read by a previous call */
    if (lane == 0) part[w] = v;
    __syncthreads();
    v = lane < nw ? part[lane] : 0.0f;
    return warp_sum(v);
}

} /* namespace CS_NS */
#endif
