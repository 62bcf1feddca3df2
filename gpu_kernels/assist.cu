/* assist.cu: the device side of host-assisted LoRA (the cold start): wait on the compute
 * stream for a flag in host memory that host threads raise, then add the terms they computed
 * (host memory too, read in place: pinned memory is mapped into the device's address space)
 * into a device buffer.
 *
 * Every block waits on its own: thread 0 spins on the flag (an acquire load at system scope,
 * sleeping between reads), the block's barrier passes the flag's ordering on to its other
 * threads, and then the block adds its share. No block depends on another, so a grid larger
 * than the device holds at once still finishes once the flag is up. */
#include "gpu_kernels/ops.cuh"

namespace CS_NS {

enum { WAIT_ADD_THREADS = 256, WAIT_ADD_MAX_BLOCKS = 64 };

/* *f with acquire ordering at system scope: what the host wrote before raising the flag is
 * seen by the loads after it */
#ifdef CS_CUDA_EMU
static inline uint32_t flag_acquire(const uint32_t *f) { return __atomic_load_n(f, __ATOMIC_ACQUIRE); }
#else
static __device__ __forceinline__ uint32_t flag_acquire(const uint32_t *f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700
    uint32_t v = *(const volatile uint32_t *)f;
    __threadfence_system();
    return v;
#else
    uint32_t v;
    asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(v) : "l"(f) : "memory");
    return v;
#endif
}
#endif

static __global__ void k_wait_add(float *y, const float *src, size_t n, const uint32_t *flag, uint32_t value) {
    if (threadIdx.x == 0) {
        while (flag_acquire(flag) < value) {
#if defined(CS_CUDA_EMU) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700)
            __nanosleep(2000);
#endif
        }
    }
    __syncthreads();
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) y[i] += __ldcv(src + i);
}

void op_wait_add(cudaStream_t st, float *y, const float *src, size_t n, const uint32_t *flag, uint32_t value) {
    size_t blocks = (n + WAIT_ADD_THREADS - 1) / WAIT_ADD_THREADS;
    if (blocks < 1) blocks = 1; /* nothing to add: still the wait */
    if (blocks > WAIT_ADD_MAX_BLOCKS) blocks = WAIT_ADD_MAX_BLOCKS;
    CS_LAUNCH(k_wait_add, (unsigned)blocks, WAIT_ADD_THREADS, 0, st, y, src, n, flag, value);
    CUDA_CHECK_LAUNCH();
}

} /* namespace CS_NS */
