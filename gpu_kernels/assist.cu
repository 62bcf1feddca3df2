/* assist.cu: the device side of host-assisted LoRA (the cold start): wait on the compute
 * stream for a flag in host memory that host threads raise, then add the terms they computed
 * (host memory too, read in place: pinned memory is mapped into the device's address space)
 * into a device buffer.
 *
 * Every block waits on its own: thread 0 spins on the flag (an acquire load at system scope,
 * sleeping between reads, longer and longer up to WAIT_SLEEP_MAX_NS: the reads cross PCIe,
 * beside the adapter copies), the block's barrier passes the flag's ordering on to its other
 * threads, and then the block adds its share. No block depends on another, so a grid larger
 * than the device holds at once still finishes once the flag is up.
 *
 * A spin has a deadline (%globaltimer): a flag that never comes (a host thread that died, a
 * lazily loaded kernel that waits for this one to end) would hang the device and the engine
 * with it. The host raises a heartbeat while it is still at work (a worker waiting for a slow
 * disk), which restarts the deadline. Past the deadline the kernel writes what it waited for
 * into the report (mapped host memory the backend prints from when the next CUDA call fails),
 * prints it and traps. */
#include "gpu_kernels/ops.cuh"

namespace CS_NS {

enum { WAIT_ADD_THREADS = 256, WAIT_ADD_MAX_BLOCKS = 64 };
enum { WAIT_SLEEP_MIN_NS = 500, WAIT_SLEEP_MAX_NS = 16000 };

/* *f with acquire ordering at system scope: what the host wrote before raising the flag is
 * seen by the loads after it */
#ifdef CS_CUDA_EMU
static inline uint32_t flag_acquire(const uint32_t *f) { return __atomic_load_n(f, __ATOMIC_ACQUIRE); }
static inline uint64_t globaltimer() { return globaltimer_impl(); }
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
static __device__ __forceinline__ uint64_t globaltimer() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
#endif

static __device__ __forceinline__ float widen(float v) { return v; }
static __device__ __forceinline__ float widen(__nv_bfloat16 v) { return __bfloat162float(v); }

/* T: the terms' type in host memory (F32, or BF16: half the bytes over the link) */
template <class T>
static __global__ void k_wait_add(float *y, const T *src, size_t n, const uint32_t *flag, uint32_t value,
                                  const uint32_t *alive, uint64_t timeout_ns, int layer, spin_report *report) {
    if (threadIdx.x == 0) {
        uint64_t t0 = globaltimer();
        unsigned sleep = WAIT_SLEEP_MIN_NS;
        uint32_t seen, beat = alive ? flag_acquire(alive) : 0;
        while ((seen = flag_acquire(flag)) < value) {
            if (alive && flag_acquire(alive) != beat) { /* the host is still at work: the deadline again */
                beat = flag_acquire(alive);
                t0 = globaltimer();
            }
            uint64_t waited = globaltimer() - t0;
            if (waited > timeout_ns) {
                report->layer = layer;
                report->value = value;
                report->seen = seen;
                report->waited_ns = waited;
                __threadfence_system();
                report->hit = 1;
                __threadfence_system();
                printf("caraserve: the GPU waited %.1f s for the host's LoRA terms of layer %d (flag %u, waiting for %u): "
                       "stopping\n", (double)waited * 1e-9, layer, seen, value);
                __trap();
            }
#if defined(CS_CUDA_EMU) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700)
            __nanosleep(sleep);
#endif
            if (sleep < WAIT_SLEEP_MAX_NS) sleep *= 2;
        }
    }
    __syncthreads();
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) y[i] += widen(__ldcv(src + i));
}

void op_wait_add(cudaStream_t st, float *y, const void *src, int src_dtype, size_t n, const uint32_t *flag,
                 uint32_t value, const uint32_t *alive, uint64_t timeout_ns, int layer, spin_report *report) {
    size_t blocks = (n + WAIT_ADD_THREADS - 1) / WAIT_ADD_THREADS;
    if (blocks < 1) blocks = 1; /* nothing to add: still the wait */
    if (blocks > WAIT_ADD_MAX_BLOCKS) blocks = WAIT_ADD_MAX_BLOCKS;
    if (src_dtype == DT_BF16)
        CS_LAUNCH(k_wait_add<__nv_bfloat16>, (unsigned)blocks, WAIT_ADD_THREADS, 0, st, y, (const __nv_bfloat16 *)src, n,
                  flag, value, alive, timeout_ns, layer, report);
    else
        CS_LAUNCH(k_wait_add<float>, (unsigned)blocks, WAIT_ADD_THREADS, 0, st, y, (const float *)src, n, flag, value,
                  alive, timeout_ns, layer, report);
    CUDA_CHECK_LAUNCH();
}

void load_assist_kernels() {
    load_kernel(k_wait_add<float>);
    load_kernel(k_wait_add<__nv_bfloat16>);
}

} /* namespace CS_NS */
