/* cuda_emu.h: the subset of CUDA that gpu_kernels/ uses, emulated on the host, so that the
 * CUDA backend's own sources (kernels, launches, memory, streams, cuBLAS calls) compile with
 * g++ and run in `make check` on machines without a GPU (as HIP-CPU does for HIP).
 *
 * What it models: a kernel launch runs every block of the grid in turn; the threads of a
 * block run as fibers on the calling thread, switching at __syncthreads() and at warp
 * shuffles, so barriers, shared memory and warp reductions behave as on the device (a
 * barrier not reached by every live thread of its block or warp aborts with a message).
 * Device memory is host memory behind a byte budget (CS_CUDA_EMU_MEM_MB, default 1024);
 * streams execute at once, in order, so every copy is complete when it returns and events
 * are complete when recorded. cuBLAS's GEMM converts its operands to F32 and calls OpenBLAS.
 *
 * What it cannot model: timing, races between streams, the real runtime's error cases,
 * and cuBLAS's own arithmetic. Those need a GPU (tests/test_gpu.c, test_backend_ops). */
#ifndef CS_CUDA_EMU_H
#define CS_CUDA_EMU_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

namespace cs_cuda_emu {

/* ---- types ---- */
struct uint3 { unsigned x, y, z; };
struct alignas(16) float4 { float x, y, z, w; };  /* 16-byte vector loads */
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

/* ---- the thread being run ---- */
struct emu_thread {
    uint3 tid;
    int linear;             /* threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z) */
};
struct emu_grid {
    uint3 block_idx;
    uint3 block_dim, grid_dim;
};
/* the running fiber's thread and its launch, behind calls: the kernels' objects never
 * address the emulator's thread-local variables themselves (under the sanitizers, an
 * inlined access to another object's thread_local read a null address inside a fiber) */
emu_thread *cur_thread();
emu_grid *cur_grid();

void syncthreads();
/* the warp's lanes exchange 8 bytes each; returns lane src's */
uint64_t warp_exchange(uint64_t v, int src_lane);

template <class T> static inline T shfl_cast(uint64_t u) { T t; memcpy(&t, &u, sizeof t); return t; }
template <class T> static inline uint64_t shfl_bits(T t) { uint64_t u = 0; memcpy(&u, &t, sizeof t); return u; }
template <class T> static inline T shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    (void)mask;
    int lane = cur_thread()->linear & 31;
    int src = lane ^ lane_mask;
    if ((src & ~(width - 1)) != (lane & ~(width - 1))) src = lane; /* outside its segment: its own */
    return shfl_cast<T>(warp_exchange(shfl_bits(v), src));
}
template <class T> static inline T shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
    (void)mask;
    int lane = cur_thread()->linear & 31;
    int src = (lane & ~(width - 1)) + (src_lane & (width - 1));
    return shfl_cast<T>(warp_exchange(shfl_bits(v), src));
}
template <class T> static inline T shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    (void)mask;
    int lane = cur_thread()->linear & 31;
    int src = lane + (int)delta;
    if ((src & ~(width - 1)) != (lane & ~(width - 1))) src = lane;
    return shfl_cast<T>(warp_exchange(shfl_bits(v), src));
}

/* ---- launches ---- */
typedef struct emu_stream *cudaStream_t;
typedef void (*emu_body_fn)(void *);
void launch_impl(dim3 grid, dim3 block, size_t smem, cudaStream_t s, emu_body_fn fn, void *arg);
/* a launch of KERNEL on stream s: the launch is refused (cudaGetLastError's
 * cudaErrorInvalidResourceHandle, nothing runs) when s belongs to another device than the
 * calling thread's current one, as the runtime refuses it; a kernel launched before it was
 * loaded (cudaFuncGetAttributes) counts as a lazy load */
bool launch_check(const void *kernel, cudaStream_t s);
/* a stream being captured into a graph records work instead of running it (a copy of the
 * closure, run and deleted by the graph) */
bool stream_capturing(cudaStream_t s);
void capture_launch(cudaStream_t s, dim3 grid, dim3 block, size_t smem, emu_body_fn fn, void *obj, emu_body_fn del);
/* the launch's dynamic shared memory (its smem bytes, one buffer for the block being run):
 * kernels take it through CS_DYN_SMEM. Static __shared__ arrays are thread_local here, and
 * static TLS is reserved in every thread of the process, so large ones go this way. */
void *dynamic_smem();
template <class F> static void launch_trampoline(void *p) { (*(F *)p)(); }
template <class F> static void launch_delete(void *p) { delete (F *)p; }
template <class F> static inline void launch(const void *kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t s, F f) {
    if (!launch_check(kernel, s)) return;
    if (stream_capturing(s)) capture_launch(s, grid, block, smem, launch_trampoline<F>, new F(f), launch_delete<F>);
    else launch_impl(grid, block, smem, s, launch_trampoline<F>, &f);
}

/* ---- 16-bit floats ---- */
struct __nv_bfloat16 { uint16_t x; };
struct __half { uint16_t x; };
static inline float __bfloat162float(__nv_bfloat16 h) {
    uint32_t u = (uint32_t)h.x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline __nv_bfloat16 __float2bfloat16(float f) { /* round to nearest even, NaN kept */
    uint32_t u;
    memcpy(&u, &f, 4);
    __nv_bfloat16 h;
    if ((u & 0x7fffffffu) > 0x7f800000u) h.x = (uint16_t)((u >> 16) | 0x40);
    else h.x = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return h;
}
float half2float_impl(uint16_t h);
uint16_t float2half_impl(float f);
static inline float __half2float(__half h) { return half2float_impl(h.x); }
static inline __half __float2half(float f) { __half h; h.x = float2half_impl(f); return h; }

/* ---- the runtime ---- */
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorMemoryAllocation = 2,
                   cudaErrorNoDevice = 100, cudaErrorInvalidDevice = 101, cudaErrorInvalidResourceHandle = 400,
                   cudaErrorNotReady = 600 };
enum cudaMemcpyKind { cudaMemcpyHostToHost = 0, cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2,
                      cudaMemcpyDeviceToDevice = 3, cudaMemcpyDefault = 4 };
typedef struct emu_event *cudaEvent_t;
typedef struct emu_graph *cudaGraph_t;
typedef struct emu_graph *cudaGraphExec_t;
enum { cudaStreamNonBlocking = 1, cudaEventBlockingSync = 1, cudaEventDisableTiming = 2, cudaHostAllocDefault = 0 };
enum cudaStreamCaptureMode { cudaStreamCaptureModeGlobal = 0, cudaStreamCaptureModeThreadLocal = 1,
                             cudaStreamCaptureModeRelaxed = 2 };
struct cudaDeviceProp {
    char name[256];
    size_t totalGlobalMem;
    int multiProcessorCount, major, minor, memoryBusWidth, memoryClockRate;
    int unifiedAddressing;
};

const char *cudaGetErrorString(cudaError_t e);
cudaError_t cudaGetLastError();
cudaError_t cudaGetDeviceCount(int *n);
/* CS_CUDA_EMU_DEVICES (1-8, default 1) devices; the current one is the calling thread's (0
 * until it sets one), as in the runtime. Streams, events and cuBLAS handles belong to the
 * device current when they were made. */
cudaError_t cudaSetDevice(int d);
cudaError_t cudaGetDevice(int *d);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int d);
cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total_b);
cudaError_t cudaMalloc(void **p, size_t n);
template <class T> static inline cudaError_t cudaMalloc(T **p, size_t n) { return cudaMalloc((void **)p, n); }
cudaError_t cudaFree(void *p);
cudaError_t cudaMallocHost(void **p, size_t n);
/* loads the kernel's module (kernels load lazily at first launch otherwise) */
struct cudaFuncAttributes { int maxThreadsPerBlock, numRegs; size_t sharedSizeBytes; };
cudaError_t func_get_attributes(cudaFuncAttributes *a, const void *kernel);
template <class T> static inline cudaError_t cudaFuncGetAttributes(cudaFuncAttributes *a, T *kernel) {
    return func_get_attributes(a, (const void *)kernel);
}
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, cudaMemcpyKind k);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind k, cudaStream_t s);
cudaError_t cudaMemsetAsync(void *dst, int v, size_t n, cudaStream_t s);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaEventQuery(cudaEvent_t e);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaDeviceSynchronize();
/* a host function in stream order: called at issue (streams execute at once), recorded by a
 * capture (a host node) */
typedef void (*cudaHostFn_t)(void *user);
cudaError_t cudaLaunchHostFunc(cudaStream_t s, cudaHostFn_t fn, void *user);
/* graphs: a capture records the stream's launches, copies, memsets, GEMMs and host functions
 * in order; an instantiated graph replays them on launch. Capturing anything else is refused
 * (abort). */
cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *e, cudaGraph_t g, unsigned long long flags);
cudaError_t cudaGraphLaunch(cudaGraphExec_t e, cudaStream_t s);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t e);
cudaError_t cudaGraphDestroy(cudaGraph_t g);

/* ---- cuBLAS: the GEMM ---- */
typedef struct emu_cublas *cublasHandle_t;
enum cublasStatus_t { CUBLAS_STATUS_SUCCESS = 0, CUBLAS_STATUS_NOT_INITIALIZED = 1, CUBLAS_STATUS_ALLOC_FAILED = 3,
                      CUBLAS_STATUS_INVALID_VALUE = 7, CUBLAS_STATUS_EXECUTION_FAILED = 13,
                      CUBLAS_STATUS_NOT_SUPPORTED = 15 };
enum cublasOperation_t { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 };
enum cudaDataType { CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14 };
enum cublasComputeType_t { CUBLAS_COMPUTE_32F = 68 };
enum cublasGemmAlgo_t { CUBLAS_GEMM_DEFAULT = -1 };
cublasStatus_t cublasCreate(cublasHandle_t *h);
cublasStatus_t cublasDestroy(cublasHandle_t h);
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s);
cublasStatus_t cublasSetWorkspace(cublasHandle_t h, void *ws, size_t bytes);
const char *cublasGetStatusString(cublasStatus_t s);
cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                            const void *alpha, const void *A, cudaDataType at, int lda, const void *B, cudaDataType bt,
                            int ldb, const void *beta, void *C, cudaDataType ct, int ldc, cublasComputeType_t compute,
                            cublasGemmAlgo_t algo);

/* __nanosleep: the calling thread sleeps (a kernel spinning on host memory waits for other threads) */
void nanosleep_impl(unsigned ns);
/* %globaltimer: nanoseconds of CLOCK_MONOTONIC */
uint64_t globaltimer_impl();
/* __trap(): the kernel stops with an error, here the process (its message printed before) */
[[noreturn]] void trap_impl();

/* how many launches and block-fibers ran (tests check that work went through the emulator) */
struct emu_counters { uint64_t launches, blocks, threads, switches, graph_launches; };
emu_counters counters();

} /* namespace cs_cuda_emu */

/* ---- the CUDA C++ keywords and built-ins ---- */
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static thread_local
#define threadIdx (cs_cuda_emu::cur_thread()->tid)
#define blockIdx (cs_cuda_emu::cur_grid()->block_idx)
#define blockDim (cs_cuda_emu::cur_grid()->block_dim)
#define gridDim (cs_cuda_emu::cur_grid()->grid_dim)
#define warpSize 32
#define __syncthreads() cs_cuda_emu::syncthreads()
#define __shfl_xor_sync cs_cuda_emu::shfl_xor_sync
#define __shfl_sync cs_cuda_emu::shfl_sync
#define __shfl_down_sync cs_cuda_emu::shfl_down_sync
#define __ldg(p) (*(p))
#define __ldcv(p) (*(p))
#define __nanosleep(ns) cs_cuda_emu::nanosleep_impl(ns)
#define __trap() cs_cuda_emu::trap_impl()
#define __threadfence_system() __atomic_thread_fence(__ATOMIC_SEQ_CST)
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }

#endif
