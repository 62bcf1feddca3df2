/* cuda_emu.cc: see cuda_emu.h. The fibers switch with a few instructions of x86-64 assembly
 * (callee-saved registers and the stack pointer), annotated for AddressSanitizer. */
#include "gpu_kernels/cuda_emu.h"

#include <cblas.h>
#include "gpu_kernels/gpu_backend.h"
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#else
#define EMU_ASAN 0
#endif

#if !defined(__x86_64__)
#error "the CUDA emulator's fibers are written for x86-64"
#endif

/* void emu_switch(void **save_sp, void *new_sp): save this context's callee-saved registers
 * on its stack and its stack pointer in *save_sp, then resume the context saved at new_sp */
extern "C" void cs_emu_switch(void **save_sp, void *new_sp);
__asm__(".text\n"
        ".globl cs_emu_switch\n"
        ".type cs_emu_switch,@function\n"
        "cs_emu_switch:\n"
        "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
        "  movq %rsp, (%rdi)\n"
        "  movq %rsi, %rsp\n"
        "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
        "  ret\n"
        ".size cs_emu_switch,.-cs_emu_switch\n"
        ".section .note.GNU-stack,\"\",@progbits\n"
        ".text\n");

namespace cs_cuda_emu {

static thread_local emu_thread *emu_cur_thread;
static thread_local emu_grid emu_cur_grid;
emu_thread *cur_thread() { return emu_cur_thread; }
emu_grid *cur_grid() { return &emu_cur_grid; }

static void fatal(const char *what) {
    fprintf(stderr, "CUDA emulator: %s\n", what);
    abort();
}

/* ---- fibers ---- */
enum { ST_READY, ST_BLOCK_WAIT, ST_WARP_WAIT, ST_DONE };
enum { STACK_BYTES = 128 * 1024, MAX_THREADS = 1024 };

struct fiber {
    emu_thread t;
    void *sp;
    char *stack;            /* [STACK_BYTES], from the pool */
    int state;
    unsigned wait_gen;
};

struct block_run {
    fiber *f;
    int n, alive;
    int bar_count;
    unsigned bar_gen;
    int warp_count[MAX_THREADS / 32], warp_alive[MAX_THREADS / 32];
    unsigned warp_gen[MAX_THREADS / 32];
    uint64_t slots[MAX_THREADS];
    void *sched_sp;         /* the launching thread's context */
    void *smem;             /* the launch's dynamic shared memory (reused by its blocks in turn) */
    emu_body_fn fn;
    void *arg;
#if EMU_ASAN
    const void *sched_bottom;
    size_t sched_size;
#endif
};

static thread_local block_run *run;
static thread_local char *stack_pool;   /* MAX_THREADS stacks, made on first use */
static thread_local fiber fibers[MAX_THREADS];
static emu_counters n_done;             /* relaxed atomics: for tests only */
#define CS_EMU_MIN(a, b) ((a) < (b) ? (a) : (b))
#define COUNT(field, v) __atomic_add_fetch(&n_done.field, (v), __ATOMIC_RELAXED)

static void to_sched(fiber *f, bool finished) {
    block_run *r = run;
#if EMU_ASAN
    void *fake = NULL;
    __sanitizer_start_switch_fiber(finished ? NULL : &fake, r->sched_bottom, r->sched_size);
#else
    (void)finished;
#endif
    cs_emu_switch(&f->sp, r->sched_sp);
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, &r->sched_bottom, &r->sched_size);
#endif
}

static void fiber_main() {
    block_run *r = run;
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(NULL, &r->sched_bottom, &r->sched_size);
#endif
    fiber *f = (fiber *)((char *)emu_cur_thread - offsetof(fiber, t));
    r->fn(r->arg);
    f->state = ST_DONE;
    r->alive--;
    int w = f->t.linear / 32;
    r->warp_alive[w]--;
    /* those waiting are now all that live: release them */
    if (r->bar_count && r->bar_count == r->alive) r->bar_count = 0, r->bar_gen++;
    if (r->warp_count[w] && r->warp_count[w] == r->warp_alive[w]) r->warp_count[w] = 0, r->warp_gen[w]++;
    to_sched(f, true);
    fatal("a finished fiber was resumed");
}

static void *fiber_init_sp(char *stack) {
    uintptr_t top = ((uintptr_t)(stack + STACK_BYTES)) & ~(uintptr_t)15;
    void **sp = (void **)top;
    *--sp = NULL;                   /* alignment: the entry sees rsp % 16 == 8, as after a call */
    *--sp = (void *)fiber_main;     /* cs_emu_switch's ret goes here */
    for (int i = 0; i < 6; i++) *--sp = NULL; /* rbp rbx r12 r13 r14 r15 */
    return sp;
}

static void resume(fiber *f) {
    block_run *r = run;
    emu_cur_thread = &f->t;
    COUNT(switches, 1);
#if EMU_ASAN
    void *fake = NULL;
    __sanitizer_start_switch_fiber(&fake, f->stack, STACK_BYTES);
#endif
    cs_emu_switch(&r->sched_sp, f->sp);
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, NULL, NULL);
#endif
}

static void run_block(block_run *r, dim3 block) {
    int n = r->n;
    for (int i = 0; i < n; i++) {
        fiber *f = &r->f[i];
        f->t.linear = i;
        f->t.tid = uint3{(unsigned)i % block.x, ((unsigned)i / block.x) % block.y, (unsigned)i / (block.x * block.y)};
        f->stack = stack_pool + (size_t)i * STACK_BYTES;
        f->sp = fiber_init_sp(f->stack);
        f->state = ST_READY;
    }
    r->alive = n;
    r->bar_count = 0;
    for (int w = 0; w < (n + 31) / 32; w++) {
        r->warp_count[w] = 0;
        r->warp_alive[w] = CS_EMU_MIN(32, n - 32 * w);
    }
    while (r->alive > 0) {
        bool progressed = false;
        for (int i = 0; i < n; i++) {
            fiber *f = &r->f[i];
            if (f->state == ST_DONE) continue;
            if (f->state == ST_BLOCK_WAIT && f->wait_gen == r->bar_gen) continue;
            if (f->state == ST_WARP_WAIT && f->wait_gen == r->warp_gen[i / 32]) continue;
            f->state = ST_READY;
            resume(f);
            progressed = true;
        }
        if (!progressed) fatal("deadlock: a barrier that not every live thread of its block or warp reaches");
    }
}

void syncthreads() {
    block_run *r = run;
    fiber *f = (fiber *)((char *)emu_cur_thread - offsetof(fiber, t));
    if (++r->bar_count == r->alive) { /* the last to arrive releases the others */
        r->bar_count = 0;
        r->bar_gen++;
        return;
    }
    f->state = ST_BLOCK_WAIT;
    f->wait_gen = r->bar_gen;
    to_sched(f, false);
    emu_cur_thread = &f->t;
}

static void warp_barrier(fiber *f) {
    block_run *r = run;
    int w = f->t.linear / 32;
    if (++r->warp_count[w] == r->warp_alive[w]) {
        r->warp_count[w] = 0;
        r->warp_gen[w]++;
        return;
    }
    f->state = ST_WARP_WAIT;
    f->wait_gen = r->warp_gen[w];
    to_sched(f, false);
    emu_cur_thread = &f->t;
}

uint64_t warp_exchange(uint64_t v, int src_lane) {
    block_run *r = run;
    fiber *f = (fiber *)((char *)emu_cur_thread - offsetof(fiber, t));
    int base = f->t.linear & ~31;
    r->slots[f->t.linear] = v;
    warp_barrier(f);                /* every lane has written */
    if (base + src_lane >= r->n) fatal("a shuffle reads a lane outside the block");
    uint64_t got = r->slots[base + src_lane];
    warp_barrier(f);                /* every lane has read before the slots are reused */
    return got;
}

void *dynamic_smem() {
    if (!run || !run->smem) fatal("CS_DYN_SMEM in a launch without dynamic shared memory");
    return run->smem;
}

void launch_impl(dim3 grid, dim3 block, size_t smem, cudaStream_t s, emu_body_fn fn, void *arg) {
    (void)s;
    unsigned nt = block.x * block.y * block.z;
    if (nt == 0 || nt > MAX_THREADS) fatal("a launch with 0 or more than 1024 threads per block");
    if (grid.x == 0 || grid.y == 0 || grid.z == 0) fatal("a launch with an empty grid");
    if (grid.y > 65535 || grid.z > 65535) fatal("a launch with gridDim.y or .z over 65535");
    if (!stack_pool) {
        void *p = mmap(NULL, (size_t)MAX_THREADS * STACK_BYTES, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) fatal("cannot map the fibers' stacks");
        stack_pool = (char *)p;
    }
    if (run) fatal("a kernel launched from inside a kernel");
    block_run *r = (block_run *)calloc(1, sizeof *r);
    if (!r) fatal("out of memory");
    r->f = fibers;
    r->n = (int)nt;
    if (smem > 227 * 1024) fatal("a launch with more than 227 KiB of dynamic shared memory");
    if (smem && !(r->smem = malloc(smem))) fatal("out of memory");
    if (smem) memset(r->smem, 0xff, smem); /* not zeroed on a GPU either */
    r->fn = fn;
    r->arg = arg;
    run = r;
    emu_thread *saved = emu_cur_thread;
    emu_cur_grid.block_dim = uint3{block.x, block.y, block.z};
    emu_cur_grid.grid_dim = uint3{grid.x, grid.y, grid.z};
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                emu_cur_grid.block_idx = uint3{x, y, z};
                run_block(r, block);
                COUNT(blocks, 1);
            }
    COUNT(launches, 1);
    COUNT(threads, (uint64_t)nt * grid.x * grid.y * grid.z);
    emu_cur_thread = saved;
    run = NULL;
    free(r->smem);
    free(r);
}

/* ---- devices and kernel loading ---- */
enum { MAX_DEVICES = 8, MAX_KERNELS = 1024 };
static thread_local int cur_dev;            /* the calling thread's current device */
static thread_local cudaError_t last_error; /* cudaGetLastError's */
static uint64_t launches_on[MAX_DEVICES];   /* relaxed atomics */
static uint64_t lazy_loads, wrong_device;
static pthread_mutex_t kernels_mu = PTHREAD_MUTEX_INITIALIZER;
static const void *kernels[MAX_KERNELS];    /* loaded, under kernels_mu */
static int n_kernels;

static int device_count() {
    const char *e = getenv("CS_CUDA_EMU_DEVICES");
    int n = e ? atoi(e) : 1;
    return n < 1 ? 1 : n > MAX_DEVICES ? MAX_DEVICES : n;
}

/* true when KERNEL was loaded before; loads it now either way */
static bool kernel_load(const void *kernel) {
    pthread_mutex_lock(&kernels_mu);
    bool had = false;
    for (int i = 0; i < n_kernels && !had; i++) had = kernels[i] == kernel;
    if (!had) {
        if (n_kernels == MAX_KERNELS) fatal("more than 1024 kernels");
        kernels[n_kernels++] = kernel;
    }
    pthread_mutex_unlock(&kernels_mu);
    return had;
}

static int stream_device(cudaStream_t s);

bool launch_check(const void *kernel, cudaStream_t s) {
    if (stream_device(s) != cur_dev) { /* the runtime refuses it: nothing runs */
        last_error = cudaErrorInvalidResourceHandle;
        __atomic_add_fetch(&wrong_device, 1, __ATOMIC_RELAXED);
        return false;
    }
    __atomic_add_fetch(&launches_on[cur_dev], 1, __ATOMIC_RELAXED);
    if (!kernel_load(kernel)) __atomic_add_fetch(&lazy_loads, 1, __ATOMIC_RELAXED);
    return true;
}

cudaError_t func_get_attributes(cudaFuncAttributes *a, const void *kernel) {
    if (!a || !kernel) return cudaErrorInvalidValue;
    kernel_load(kernel);
    a->maxThreadsPerBlock = MAX_THREADS;
    a->numRegs = 32;
    a->sharedSizeBytes = 0;
    return cudaSuccess;
}

emu_counters counters() {
    emu_counters c;
    c.launches = __atomic_load_n(&n_done.launches, __ATOMIC_RELAXED);
    c.blocks = __atomic_load_n(&n_done.blocks, __ATOMIC_RELAXED);
    c.threads = __atomic_load_n(&n_done.threads, __ATOMIC_RELAXED);
    c.switches = __atomic_load_n(&n_done.switches, __ATOMIC_RELAXED);
    c.graph_launches = __atomic_load_n(&n_done.graph_launches, __ATOMIC_RELAXED);
    return c;
}

/* ---- F16 ---- */
float half2float_impl(uint16_t h) {
    uint32_t s = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 0x1f, m = h & 0x3ff, u;
    if (e == 0x1f) u = s | 0x7f800000u | (m << 13);
    else if (e) u = s | ((e + 112) << 23) | (m << 13);
    else if (!m) u = s;
    else { /* subnormal */
        int sh = 0;
        while (!(m & 0x400)) m <<= 1, sh++;
        u = s | ((uint32_t)(113 - sh) << 23) | ((m & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t float2half_impl(float f) { /* round to nearest even */
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t s = (u >> 16) & 0x8000, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(s | 0x7e00);          /* NaN */
    if (a >= 0x477ff000u) return (uint16_t)(s | 0x7c00);         /* overflow (and inf) */
    if (a < 0x38800000u) {                                       /* subnormal or zero */
        if (a < 0x33000000u) return (uint16_t)s;
        uint32_t m = (a & 0x7fffff) | 0x800000;
        int sh = 126 - (int)(a >> 23);                           /* 14 .. 24 */
        uint32_t q = m >> sh, rem = m & ((1u << sh) - 1), half = 1u << (sh - 1);
        if (rem > half || (rem == half && (q & 1))) q++;
        return (uint16_t)(s | q);
    }
    uint32_t q = ((a - 0x38000000u) >> 13), rem = a & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (q & 1))) q++;
    return (uint16_t)(s | q);
}

/* ---- the runtime ---- */
struct graph_op {
    int kind;               /* 0 launch, 1 memcpy, 2 memset, 3 a closure (a GEMM) */
    dim3 grid, block;
    emu_body_fn fn, del;
    void *obj;
    void *dst;
    const void *src;
    size_t n;
    int v;
};
struct emu_graph {          /* a captured graph, or an instantiated one (which takes the ops over) */
    graph_op *ops;
    int n, cap;
};
struct emu_stream { emu_graph *capture; int device; };
static int stream_device(cudaStream_t s) { return s ? s->device : cur_dev; } /* NULL: the current device's */

static size_t mem_budget() {
    static size_t b;
    if (!b) {
        const char *e = getenv("CS_CUDA_EMU_MEM_MB");
        b = (size_t)(e && atol(e) > 0 ? atol(e) : 1024) << 20;
    }
    return b;
}
static size_t mem_used;     /* under the allocator's own lock: emulated allocations are rare */
struct alloc_hdr { size_t n; size_t pad[7]; }; /* keeps the memory 64-byte aligned */

const char *cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    }
    return "unknown error";
}
cudaError_t cudaGetLastError() {
    cudaError_t e = last_error;
    last_error = cudaSuccess;
    return e;
}
cudaError_t cudaGetDeviceCount(int *n) { *n = device_count(); return cudaSuccess; }
cudaError_t cudaSetDevice(int d) {
    if (d < 0 || d >= device_count()) return cudaErrorInvalidDevice;
    cur_dev = d;
    return cudaSuccess;
}
cudaError_t cudaGetDevice(int *d) { *d = cur_dev; return cudaSuccess; }
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int d) {
    if (d < 0 || d >= device_count()) return cudaErrorInvalidDevice;
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "CUDA emulator (host) %d", d);
    p->totalGlobalMem = mem_budget();
    p->multiProcessorCount = 1;
    p->major = 9;
    p->unifiedAddressing = 1;
    return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total_b) {
    size_t used = __atomic_load_n(&mem_used, __ATOMIC_RELAXED);
    *total_b = mem_budget();
    *free_b = used < *total_b ? *total_b - used : 0;
    return cudaSuccess;
}
cudaError_t cudaMalloc(void **p, size_t n) {
    *p = NULL;
    size_t used = __atomic_add_fetch(&mem_used, n, __ATOMIC_RELAXED);
    if (used > mem_budget()) {
        __atomic_sub_fetch(&mem_used, n, __ATOMIC_RELAXED);
        return cudaErrorMemoryAllocation;
    }
    alloc_hdr *h = NULL;
    if (posix_memalign((void **)&h, 64, sizeof *h + (n ? n : 1))) {
        __atomic_sub_fetch(&mem_used, n, __ATOMIC_RELAXED);
        return cudaErrorMemoryAllocation;
    }
    h->n = n;
    memset(h + 1, 0xff, n); /* NaN-ish garbage: device memory is not zeroed */
    *p = h + 1;
    return cudaSuccess;
}
cudaError_t cudaFree(void *p) {
    if (!p) return cudaSuccess;
    alloc_hdr *h = (alloc_hdr *)p - 1;
    __atomic_sub_fetch(&mem_used, h->n, __ATOMIC_RELAXED);
    free(h);
    return cudaSuccess;
}
cudaError_t cudaMallocHost(void **p, size_t n) {
    return posix_memalign(p, 4096, n ? n : 1) ? cudaErrorMemoryAllocation : cudaSuccess;
}
cudaError_t cudaFreeHost(void *p) { free(p); return cudaSuccess; }
cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, cudaMemcpyKind k) {
    (void)k;
    if (n) memmove(dst, src, n);
    return cudaSuccess;
}
struct emu_event { int device; };
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags) {
    (void)flags;
    *s = (cudaStream_t)calloc(1, sizeof(emu_stream));
    if (!*s) return cudaErrorMemoryAllocation;
    (*s)->device = cur_dev;
    return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) { free(s); return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
    if (stream_capturing(s)) fatal("cudaStreamSynchronize on a stream being captured");
    return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags) {
    (void)e, (void)flags;
    if (stream_capturing(s)) fatal("an event waited for on a stream being captured");
    return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags) {
    (void)flags;
    *e = (cudaEvent_t)calloc(1, sizeof(emu_event));
    if (!*e) return cudaErrorMemoryAllocation;
    (*e)->device = cur_dev;
    return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) { free(e); return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
    if (stream_capturing(s)) fatal("an event recorded on a stream being captured");
    if (e->device != stream_device(s)) return cudaErrorInvalidResourceHandle; /* as the runtime */
    return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t e) { (void)e; return cudaSuccess; }
cudaError_t cudaEventSynchronize(cudaEvent_t e) { (void)e; return cudaSuccess; }
cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }

void nanosleep_impl(unsigned ns) {
    struct timespec ts = {0, (long)(ns < 1000000 ? ns : 1000000)};
    nanosleep(&ts, NULL);
}

uint64_t globaltimer_impl() {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

void trap_impl() {
    fflush(stdout);
    fprintf(stderr, "CUDA emulator: __trap() in a kernel\n");
    abort();
}

/* ---- graphs ---- */

static void graph_push(cudaStream_t s, const graph_op &op) {
    emu_graph *g = s->capture;
    if (g->n == g->cap) {
        g->cap = g->cap ? 2 * g->cap : 64;
        g->ops = (graph_op *)realloc(g->ops, sizeof *g->ops * (size_t)g->cap);
        if (!g->ops) fatal("out of memory");
    }
    g->ops[g->n++] = op;
}

bool stream_capturing(cudaStream_t s) { return s && s->capture; }

void capture_launch(cudaStream_t s, dim3 grid, dim3 block, size_t smem, emu_body_fn fn, void *obj, emu_body_fn del) {
    graph_op op = {};
    op.kind = 0, op.grid = grid, op.block = block, op.fn = fn, op.obj = obj, op.del = del, op.n = smem;
    graph_push(s, op);
}

static void capture_closure(cudaStream_t s, emu_body_fn fn, void *obj, emu_body_fn del) {
    graph_op op = {};
    op.kind = 3, op.fn = fn, op.obj = obj, op.del = del;
    graph_push(s, op);
}

cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode) {
    (void)mode;
    if (!s || s->capture) return cudaErrorInvalidValue;
    s->capture = (emu_graph *)calloc(1, sizeof(emu_graph));
    return s->capture ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g) {
    if (!s || !s->capture) return cudaErrorInvalidValue;
    *g = s->capture;
    s->capture = NULL;
    return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *e, cudaGraph_t g, unsigned long long flags) {
    (void)flags;
    emu_graph *x = (emu_graph *)calloc(1, sizeof(emu_graph));
    if (!x) return cudaErrorMemoryAllocation;
    *x = *g; /* the exec owns the ops from here: the graph may be destroyed first, as in CUDA */
    g->ops = NULL;
    g->n = g->cap = 0;
    *e = x;
    return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t e, cudaStream_t s) {
    if (stream_capturing(s)) fatal("a graph launched into a capture");
    for (int i = 0; i < e->n; i++) {
        const graph_op &op = e->ops[i];
        switch (op.kind) {
        case 0: launch_impl(op.grid, op.block, op.n, s, op.fn, op.obj); break;
        case 1: memmove(op.dst, op.src, op.n); break;
        case 2: memset(op.dst, op.v, op.n); break;
        default: op.fn(op.obj); break;
        }
    }
    COUNT(graph_launches, 1);
    return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t g);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t e) { return cudaGraphDestroy(e); }
cudaError_t cudaGraphDestroy(cudaGraph_t g) {
    if (!g) return cudaSuccess;
    for (int i = 0; i < g->n; i++)
        if (g->ops[i].del) g->ops[i].del(g->ops[i].obj);
    free(g->ops);
    free(g);
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind k, cudaStream_t s) {
    if (stream_capturing(s)) {
        graph_op op = {};
        op.kind = 1, op.dst = dst, op.src = src, op.n = n;
        graph_push(s, op);
        return cudaSuccess;
    }
    return cudaMemcpy(dst, src, n, k);
}
cudaError_t cudaLaunchHostFunc(cudaStream_t s, cudaHostFn_t fn, void *user) {
    if (!fn) return cudaErrorInvalidValue;
    if (stream_capturing(s)) {
        capture_closure(s, fn, user, NULL); /* a host node: the graph runs it at each launch */
        return cudaSuccess;
    }
    fn(user);
    return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void *dst, int v, size_t n, cudaStream_t s) {
    if (stream_capturing(s)) {
        graph_op op = {};
        op.kind = 2, op.dst = dst, op.v = v, op.n = n;
        graph_push(s, op);
        return cudaSuccess;
    }
    memset(dst, v, n);
    return cudaSuccess;
}

/* ---- cuBLAS ---- */
struct emu_cublas { cudaStream_t s; int device; };
cublasStatus_t cublasCreate(cublasHandle_t *h) {
    *h = (cublasHandle_t)calloc(1, sizeof(emu_cublas));
    if (!*h) return CUBLAS_STATUS_ALLOC_FAILED;
    (*h)->device = cur_dev; /* a handle works on the device current when it was made */
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy(cublasHandle_t h) { free(h); return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s) { h->s = s; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSetWorkspace(cublasHandle_t h, void *ws, size_t bytes) {
    (void)h, (void)ws, (void)bytes;
    return CUBLAS_STATUS_SUCCESS;
}
const char *cublasGetStatusString(cublasStatus_t s) {
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    }
    return "CUBLAS_STATUS_UNKNOWN";
}

/* a column-major matrix of rows x cols (leading dimension ld) of type t, as F32 */
static float *widen(const void *p, cudaDataType t, int rows, int cols, int ld) {
    float *o = (float *)malloc(sizeof(float) * (size_t)rows * cols + 1);
    if (!o) return NULL;
    for (int c = 0; c < cols; c++)
        for (int r = 0; r < rows; r++) {
            size_t i = (size_t)c * ld + r;
            float v;
            switch (t) {
            case CUDA_R_32F: v = ((const float *)p)[i]; break;
            case CUDA_R_16BF: v = __bfloat162float(((const __nv_bfloat16 *)p)[i]); break;
            default: v = __half2float(((const __half *)p)[i]); break;
            }
            o[(size_t)c * rows + r] = v;
        }
    return o;
}

static cublasStatus_t gemm_now(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, float alpha,
                               const void *A, cudaDataType at, int lda, const void *B, cudaDataType bt, int ldb,
                               float beta, void *C, int ldc);
struct gemm_args {
    cublasOperation_t ta, tb;
    int m, n, k, lda, ldb, ldc;
    float alpha, beta;
    const void *A, *B;
    void *C;
    cudaDataType at, bt;
};
static void gemm_run(void *p) {
    gemm_args *g = (gemm_args *)p;
    gemm_now(g->ta, g->tb, g->m, g->n, g->k, g->alpha, g->A, g->at, g->lda, g->B, g->bt, g->ldb, g->beta, g->C, g->ldc);
}
static void gemm_del(void *p) { free(p); }

cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                            const void *alpha, const void *A, cudaDataType at, int lda, const void *B, cudaDataType bt,
                            int ldb, const void *beta, void *C, cudaDataType ct, int ldc, cublasComputeType_t compute,
                            cublasGemmAlgo_t algo) {
    (void)algo;
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (compute != CUBLAS_COMPUTE_32F || ct != CUDA_R_32F || at != bt) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (m < 0 || n < 0 || k < 0) return CUBLAS_STATUS_INVALID_VALUE;
    /* its kernels go to the handle's device, on its stream: with another device current the
     * launch fails */
    if (h->device != cur_dev || stream_device(h->s) != cur_dev) {
        __atomic_add_fetch(&wrong_device, 1, __ATOMIC_RELAXED);
        return CUBLAS_STATUS_EXECUTION_FAILED;
    }
    __atomic_add_fetch(&launches_on[cur_dev], 1, __ATOMIC_RELAXED);
    if (stream_capturing(h->s)) {
        gemm_args *g = (gemm_args *)malloc(sizeof *g);
        if (!g) return CUBLAS_STATUS_ALLOC_FAILED;
        *g = gemm_args{ta, tb, m, n, k, lda, ldb, ldc, *(const float *)alpha, *(const float *)beta, A, B, C, at, bt};
        capture_closure(h->s, gemm_run, g, gemm_del);
        return CUBLAS_STATUS_SUCCESS;
    }
    return gemm_now(ta, tb, m, n, k, *(const float *)alpha, A, at, lda, B, bt, ldb, *(const float *)beta, C, ldc);
}

static cublasStatus_t gemm_now(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, float alpha,
                               const void *A, cudaDataType at, int lda, const void *B, cudaDataType bt, int ldb,
                               float beta, void *C, int ldc) {
    if (!m || !n) return CUBLAS_STATUS_SUCCESS;
    int ar = ta == CUBLAS_OP_N ? m : k, ac = ta == CUBLAS_OP_N ? k : m;
    int br = tb == CUBLAS_OP_N ? k : n, bc = tb == CUBLAS_OP_N ? n : k;
    if (lda < (ar > 1 ? ar : 1) || ldb < (br > 1 ? br : 1) || ldc < (m > 1 ? m : 1)) return CUBLAS_STATUS_INVALID_VALUE;
    float *a = widen(A, at, ar, ac, lda), *b = widen(B, bt, br, bc, ldb);
    if (!a || !b) {
        free(a);
        free(b);
        return CUBLAS_STATUS_ALLOC_FAILED;
    }
    cblas_sgemm(CblasColMajor, ta == CUBLAS_OP_N ? CblasNoTrans : CblasTrans, tb == CUBLAS_OP_N ? CblasNoTrans : CblasTrans,
                m, n, k, alpha, a, ar > 1 ? ar : 1, b, br > 1 ? br : 1, beta, (float *)C, ldc);
    free(a);
    free(b);
    return CUBLAS_STATUS_SUCCESS;
}

} /* namespace cs_cuda_emu */

extern "C" void cuda_emu_get_stats(cuda_emu_stats_t *st) {
    using namespace cs_cuda_emu;
    memset(st, 0, sizeof *st);
    for (int d = 0; d < CUDA_EMU_MAX_DEVICES && d < MAX_DEVICES; d++)
        st->launches_on[d] = __atomic_load_n(&launches_on[d], __ATOMIC_RELAXED);
    st->wrong_device = __atomic_load_n(&wrong_device, __ATOMIC_RELAXED);
    st->lazy_loads = __atomic_load_n(&lazy_loads, __ATOMIC_RELAXED);
    pthread_mutex_lock(&kernels_mu);
    st->kernels_loaded = (uint64_t)n_kernels;
    pthread_mutex_unlock(&kernels_mu);
}
