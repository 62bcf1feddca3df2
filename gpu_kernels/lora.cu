/* lora.cu: grouped LoRA for many adapters in one launch (SGMV for prefill segments, BGMV
 * for decode rows: here one kernel pair serves both, rows finding their adapter through
 * the batch's row -> segment map).
 *
 * shrink: a warp per (row, rank index): the dot product of the row of x with a row of A,
 *         read coalesced, reduced across the warp; ranks past the row's own are skipped.
 * expand: a thread per output column: the row's rank values sit in shared memory, and the
 *         transposed B (rank, d_out) is read coalesced across the threads. */
#include "gpu_kernels/ops.cuh"

namespace CS_NS {

enum { SHRINK_WARPS = 8, EXPAND_THREADS = 256 };

template <class T>
static __device__ __forceinline__ float row_dot(const float *x, const T *a, int d_in, int lane) {
    float s = 0.0f;
    for (int e = lane; e < d_in; e += 32) s += x[e] * load_f(a, (size_t)e);
    return warp_sum(s);
}

static __global__ void k_lora_shrink(float *t, int ld_t, const float *x, int d_in, const int32_t *row_seg,
                                     const lora_seg *segs, int mod) {
    int row = blockIdx.x, lane = threadIdx.x & 31;
    int r = blockIdx.y * SHRINK_WARPS + (threadIdx.x >> 5);
    int sg = row_seg[row];
    if (sg < 0 || mod / LORA_TARGETS >= segs[sg].device_layers) return; /* the host adds it */
    const lora_mod m = segs[sg].mods[mod];
    if (r >= m.rank) return;
    const float *xr = x + (size_t)row * d_in;
    float s;
    switch (m.dtype) {
    case DT_F32: s = row_dot(xr, (const float *)m.a + (size_t)r * d_in, d_in, lane); break;
    case DT_BF16: s = row_dot(xr, (const __nv_bfloat16 *)m.a + (size_t)r * d_in, d_in, lane); break;
    default: s = row_dot(xr, (const __half *)m.a + (size_t)r * d_in, d_in, lane); break;
    }
    if (lane == 0) t[(size_t)row * ld_t + r] = m.scale * s;
}

template <class T>
static __device__ __forceinline__ float col_dot(const float *tr, const T *bt, int rank, int d_out, int c) {
    float s = 0.0f;
    for (int r = 0; r < rank; r++) s += tr[r] * load_f(bt, (size_t)r * d_out + c);
    return s;
}

static __global__ void k_lora_expand(float *y, int d_out, const float *t, int ld_t, const int32_t *row_seg,
                                     const lora_seg *segs, int mod) {
    __shared__ float tr[LORA_MAX_RANK];
    int row = blockIdx.x, c = blockIdx.y * EXPAND_THREADS + threadIdx.x;
    int sg = row_seg[row];
    if (sg < 0 || mod / LORA_TARGETS >= segs[sg].device_layers) return; /* the whole block leaves */
    const lora_mod m = segs[sg].mods[mod];
    if (m.rank <= 0) return;
    for (int r = threadIdx.x; r < m.rank; r += EXPAND_THREADS) tr[r] = t[(size_t)row * ld_t + r];
    __syncthreads();
    if (c >= d_out) return;
    float s;
    switch (m.dtype) {
    case DT_F32: s = col_dot(tr, (const float *)m.bt, m.rank, d_out, c); break;
    case DT_BF16: s = col_dot(tr, (const __nv_bfloat16 *)m.bt, m.rank, d_out, c); break;
    default: s = col_dot(tr, (const __half *)m.bt, m.rank, d_out, c); break;
    }
    y[(size_t)row * d_out + c] += s;
}

void op_lora_shrink(cudaStream_t st, float *t, int ld_t, const float *x, int d_in, const int32_t *row_seg,
                    const lora_seg *segs, int mod, int n_tokens, int max_rank) {
    if (n_tokens <= 0 || max_rank <= 0) return;
    dim3 grid(n_tokens, (max_rank + SHRINK_WARPS - 1) / SHRINK_WARPS);
    CS_LAUNCH(k_lora_shrink, grid, 32 * SHRINK_WARPS, 0, st, t, ld_t, x, d_in, row_seg, segs, mod);
    CUDA_CHECK_LAUNCH();
}

void op_lora_expand(cudaStream_t st, float *y, int d_out, const float *t, int ld_t, const int32_t *row_seg,
                    const lora_seg *segs, int mod, int n_tokens, int max_rank) {
    if (n_tokens <= 0 || max_rank <= 0) return;
    dim3 grid(n_tokens, (d_out + EXPAND_THREADS - 1) / EXPAND_THREADS);
    CS_LAUNCH(k_lora_expand, grid, EXPAND_THREADS, 0, st, y, d_out, t, ld_t, row_seg, segs, mod);
    CUDA_CHECK_LAUNCH();
}

void load_lora_kernels() {
    load_kernel(k_lora_shrink);
    load_kernel(k_lora_expand);
}

} /* namespace CS_NS */
