/* lora.cu: grouped LoRA for many adapters in one launch (SGMV for prefill segments, BGMV
 * for decode rows: here one kernel pair serves both, rows finding their adapter through
 * the batch's row -> segment map).
 *
 * shrink: a warp per (row, rank index): the dot product of the row of x with a row of A,
 *         read coalesced, reduced across the warp; ranks past the row's own are skipped.
 *         Many rows (prefill): a block per tile of TILE_ROWS rows (and SHRINK_WARPS ranks)
 *         stages the tile's x in shared memory TILE_K columns at a time, and each warp reads
 *         its row of A once per tile for all the tile's rows of one adapter (a tile that
 *         straddles segments takes them in turn): A is read n / TILE_ROWS times, not n. The
 *         warp-per-row kernel stays the reference it is tested against.
 * expand: a thread per output column: the row's rank values sit in shared memory, and the
 *         transposed B (rank, d_out) is read coalesced across the threads. */
#include "gpu_kernels/ops.cuh"

namespace CS_NS {

enum { SHRINK_WARPS = 8, EXPAND_THREADS = 256, TILE_ROWS = 8, TILE_K = 128 };

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

/* the tile's rows in MASK (one adapter's) against A's row r, TILE_K columns of x at a time
 * from shared memory; every thread of the block calls it (its barriers), warps past the rank
 * with active false */
template <class T>
static __device__ __forceinline__ void tile_dots(float (*xs)[TILE_K], float *acc, const float *x, int r0, unsigned mask,
                                                 int d_in, const T *ar, bool active, int lane) {
    for (int k0 = 0; k0 < d_in; k0 += TILE_K) {
        __syncthreads(); /* the last chunk's reads are done */
        for (int i = threadIdx.x; i < TILE_ROWS * TILE_K; i += blockDim.x) {
            int row = i / TILE_K, k = i % TILE_K;
            xs[row][k] = (mask >> row & 1u) && k0 + k < d_in ? x[(size_t)(r0 + row) * d_in + k0 + k] : 0.0f;
        }
        __syncthreads();
        if (!active) continue;
        for (int k = lane; k < TILE_K && k0 + k < d_in; k += 32) {
            float a = load_f(ar, (size_t)(k0 + k));
#pragma unroll
            for (int row = 0; row < TILE_ROWS; row++) acc[row] += xs[row][k] * a;
        }
    }
}

static __global__ void k_lora_shrink_tiled(float *t, int ld_t, const float *x, int d_in, const int32_t *row_seg,
                                           const lora_seg *segs, int mod, int n_tokens) {
    CS_DYN_SMEM(float, sm); /* xs[TILE_ROWS][TILE_K] */
    float (*xs)[TILE_K] = (float (*)[TILE_K])sm;
    int r0 = blockIdx.x * TILE_ROWS, lane = threadIdx.x & 31;
    int r = blockIdx.y * SHRINK_WARPS + (threadIdx.x >> 5);
    int nr = n_tokens - r0 < TILE_ROWS ? n_tokens - r0 : TILE_ROWS;
    unsigned done = 0;
    for (int i = 0; i < nr; i++) { /* each adapter of the tile in turn (the same for every thread) */
        if (done >> i & 1u) continue;
        int sg = row_seg[r0 + i];
        unsigned mask = 0;
        for (int j = i; j < nr; j++)
            if (row_seg[r0 + j] == sg) mask |= 1u << j;
        done |= mask;
        if (sg < 0 || mod / LORA_TARGETS >= segs[sg].device_layers) continue; /* none, or the host adds it */
        const lora_mod m = segs[sg].mods[mod];
        bool active = r < m.rank; /* the same for the whole warp */
        float acc[TILE_ROWS];
#pragma unroll
        for (int row = 0; row < TILE_ROWS; row++) acc[row] = 0.0f;
        switch (m.dtype) {
        case DT_F32: tile_dots(xs, acc, x, r0, mask, d_in, (const float *)m.a + (size_t)(active ? r : 0) * d_in, active, lane); break;
        case DT_BF16: tile_dots(xs, acc, x, r0, mask, d_in, (const __nv_bfloat16 *)m.a + (size_t)(active ? r : 0) * d_in, active, lane); break;
        default: tile_dots(xs, acc, x, r0, mask, d_in, (const __half *)m.a + (size_t)(active ? r : 0) * d_in, active, lane); break;
        }
#pragma unroll
        for (int row = 0; row < TILE_ROWS; row++) {
            if (!(mask >> row & 1u)) continue;
            float s = warp_sum(acc[row]);
            if (active && lane == 0) t[(size_t)(r0 + row) * ld_t + r] = m.scale * s;
        }
    }
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
                    const lora_seg *segs, int mod, int n_tokens, int max_rank, bool tiled) {
    if (n_tokens <= 0 || max_rank <= 0) return;
    if (tiled) {
        dim3 grid((n_tokens + TILE_ROWS - 1) / TILE_ROWS, (max_rank + SHRINK_WARPS - 1) / SHRINK_WARPS);
        CS_LAUNCH(k_lora_shrink_tiled, grid, 32 * SHRINK_WARPS, sizeof(float) * TILE_ROWS * TILE_K, st, t, ld_t, x, d_in,
                  row_seg, segs, mod, n_tokens);
    } else {
        dim3 grid(n_tokens, (max_rank + SHRINK_WARPS - 1) / SHRINK_WARPS);
        CS_LAUNCH(k_lora_shrink, grid, 32 * SHRINK_WARPS, 0, st, t, ld_t, x, d_in, row_seg, segs, mod);
    }
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
    load_kernel(k_lora_shrink_tiled);
    load_kernel(k_lora_expand);
}

} /* namespace CS_NS */
