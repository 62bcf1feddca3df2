/* attention.cu: paged attention for prefill (causal, chunked, over a cached prefix) and
 * decode (GQA, block tables), one kernel for both. A warp owns one (query row, head) and
 * walks the visible keys 32 at a time: each lane scores one key of the tile (its whole head
 * row against the query, which every lane reads from the same addresses: one broadcast
 * load), the tile's max and sum take one warp reduction each for an online softmax (running
 * max and sum, rescaled accumulator) in F32, and then the lanes, holding the head_dim split
 * 32 ways, add each key's value row weighted by its probability (one shuffle per key). No
 * dependent chain of shuffles and exponentials per key, as a warp reduction of every score
 * would make, and no score vector is stored. Four warps of a block take four heads of one
 * row. The pools are F32 or BF16 (KT), read as F32. */
#include "gpu_kernels/ops.cuh"

namespace CS_NS {

enum { ATTN_WARPS = 4 };

/* NJ: head_dim / 32 rounded up (1, 2, 4 or 8: head_dim up to 256) */
template <int NJ, typename KT>
static __global__ void k_attention(float *out, const float *q, const KT *k, const KT *v, const attn_seq *seqs,
                                   const int32_t *row_seq, const int32_t *blocks, int bs, int nh, int nkv, int hd,
                                   int window, float scale) {
    int row = blockIdx.x, lane = threadIdx.x & 31;
    int h = blockIdx.y * ATTN_WARPS + (threadIdx.x >> 5);
    if (h >= nh) return;
    const attn_seq sq = seqs[row_seq[row]];
    int qpos = sq.pos0 + (row - sq.row0);
    int first = window > 0 && qpos - window + 1 > 0 ? qpos - window + 1 : 0;
    int kvh = h / (nh / nkv);
    size_t kv_dim = (size_t)nkv * hd, off = (size_t)kvh * hd;
    const float *qh = q + ((size_t)row * nh + h) * hd;
    const int32_t *table = blocks + sq.blk0;
    float acc[NJ];
#pragma unroll
    for (int j = 0; j < NJ; j++) acc[j] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    for (int t0 = first; t0 <= qpos; t0 += 32) {
        int t = t0 + lane, nk = qpos - t0 + 1 < 32 ? qpos - t0 + 1 : 32;
        float s = -INFINITY;
        if (lane < nk) { /* this lane's key: its score, four partial sums over the head */
            const KT *kr = k + ((size_t)table[t / bs] * bs + t % bs) * kv_dim + off;
            float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
            int e = 0;
            for (; e + 4 <= hd; e += 4) {
                d0 += qh[e] * load_f(kr, e);
                d1 += qh[e + 1] * load_f(kr, e + 1);
                d2 += qh[e + 2] * load_f(kr, e + 2);
                d3 += qh[e + 3] * load_f(kr, e + 3);
            }
            for (; e < hd; e++) d0 += qh[e] * load_f(kr, e);
            s = ((d0 + d1) + (d2 + d3)) * scale;
        }
        float mn = fmaxf(m, warp_max(s)); /* finite: lane 0's key is visible */
        float corr = expf(m - mn), p = lane < nk ? expf(s - mn) : 0.0f;
        l = l * corr + warp_sum(p);
#pragma unroll
        for (int j = 0; j < NJ; j++) acc[j] *= corr;
        for (int i = 0; i < nk; i++) { /* the tile's values, in key order */
            float pi = __shfl_sync(0xffffffffu, p, i);
            int ti = t0 + i;
            const KT *vr = v + ((size_t)table[ti / bs] * bs + ti % bs) * kv_dim + off;
#pragma unroll
            for (int j = 0; j < NJ; j++) {
                int e = lane + 32 * j;
                if (e < hd) acc[j] += pi * load_f(vr, e);
            }
        }
        m = mn;
    }
    float inv = 1.0f / l;
    float *oh = out + ((size_t)row * nh + h) * hd;
#pragma unroll
    for (int j = 0; j < NJ; j++) {
        int e = lane + 32 * j;
        if (e < hd) oh[e] = acc[j] * inv;
    }
}

/* ---- split keys (flash-decoding) ----
 * A decode step has few rows: one warp per (row, head) walks every key, and a batch of a few
 * rows at 32 heads launches a handful of blocks on a GPU of 132 SMs. Here the visible keys of
 * each row are split into `splits` ranges (z of the grid) of equal length, each a block of
 * ATTN_WARPS heads as above, whose warp leaves its range's running max, sum and unnormalised
 * accumulator in part; k_attn_combine then merges a row's ranges per head (rescaled to their
 * common max). The split count depends on the batch's rows and heads alone (not on sequence
 * lengths), so a captured graph replays for longer sequences too. Key rows are read with
 * 16-byte loads where the head's size and the pool's dtype allow it. */
struct attn_part_ptrs {
    float *ml;  /* [rows][nh][splits][2]: max, sum */
    float *acc; /* [rows][nh][splits][hd] */
};

/* q · k over hd elements: 16-byte loads where they line up (F32 hd % 4, BF16 hd % 8) */
static __device__ __forceinline__ float key_dot(const float *q, const float *k, int hd) {
    float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
    int e = 0;
    if ((hd & 3) == 0) {
        const float4 *k4 = (const float4 *)k, *q4 = (const float4 *)q;
        for (; e + 4 <= hd; e += 4) {
            float4 kv = k4[e >> 2], qv = q4[e >> 2];
            d0 += qv.x * kv.x;
            d1 += qv.y * kv.y;
            d2 += qv.z * kv.z;
            d3 += qv.w * kv.w;
        }
    }
    for (; e < hd; e++) d0 += q[e] * k[e];
    return (d0 + d1) + (d2 + d3);
}
static __device__ __forceinline__ float key_dot(const float *q, const __nv_bfloat16 *k, int hd) {
    float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
    int e = 0;
    if ((hd & 7) == 0) {
        const uint4 *k8 = (const uint4 *)k;
        for (; e + 8 <= hd; e += 8) {
            uint4 w = k8[e >> 3];
            const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int j = 0; j < 4; j++) { /* two BF16 in each word: low then high */
                __nv_bfloat16 lo, hi;
                uint16_t l16 = (uint16_t)(u[j] & 0xffffu), h16 = (uint16_t)(u[j] >> 16);
                memcpy(&lo, &l16, 2);
                memcpy(&hi, &h16, 2);
                float a = q[e + 2 * j] * __bfloat162float(lo), b = q[e + 2 * j + 1] * __bfloat162float(hi);
                if (j & 1) d1 += a, d3 += b;
                else d0 += a, d2 += b;
            }
        }
    }
    for (; e < hd; e++) d0 += q[e] * __bfloat162float(k[e]);
    return (d0 + d1) + (d2 + d3);
}

template <int NJ, typename KT>
static __global__ void k_attention_split(attn_part_ptrs part, const float *q, const KT *k, const KT *v,
                                         const attn_seq *seqs, const int32_t *row_seq, const int32_t *blocks, int bs,
                                         int nh, int nkv, int hd, int window, float scale, int splits) {
    int row = blockIdx.x, lane = threadIdx.x & 31, z = blockIdx.z;
    int h = blockIdx.y * ATTN_WARPS + (threadIdx.x >> 5);
    if (h >= nh) return;
    const attn_seq sq = seqs[row_seq[row]];
    int qpos = sq.pos0 + (row - sq.row0);
    int first = window > 0 && qpos - window + 1 > 0 ? qpos - window + 1 : 0;
    int span = qpos - first + 1, chunk = (span + splits - 1) / splits;
    int lo = first + z * chunk, hi = lo + chunk - 1 < qpos ? lo + chunk - 1 : qpos; /* [lo, hi] */
    int kvh = h / (nh / nkv);
    size_t kv_dim = (size_t)nkv * hd, off = (size_t)kvh * hd;
    const float *qh = q + ((size_t)row * nh + h) * hd;
    const int32_t *table = blocks + sq.blk0;
    float acc[NJ];
#pragma unroll
    for (int j = 0; j < NJ; j++) acc[j] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    for (int t0 = lo; t0 <= hi; t0 += 32) {
        int t = t0 + lane, nk = hi - t0 + 1 < 32 ? hi - t0 + 1 : 32;
        float s = -INFINITY;
        if (lane < nk) s = key_dot(qh, k + ((size_t)table[t / bs] * bs + t % bs) * kv_dim + off, hd) * scale;
        float mn = fmaxf(m, warp_max(s)); /* finite: lane 0's key is in the range */
        float corr = expf(m - mn), p = lane < nk ? expf(s - mn) : 0.0f;
        l = l * corr + warp_sum(p);
#pragma unroll
        for (int j = 0; j < NJ; j++) acc[j] *= corr;
        for (int i = 0; i < nk; i++) {
            float pi = __shfl_sync(0xffffffffu, p, i);
            int ti = t0 + i;
            const KT *vr = v + ((size_t)table[ti / bs] * bs + ti % bs) * kv_dim + off;
#pragma unroll
            for (int j = 0; j < NJ; j++) {
                int e = lane + 32 * j;
                if (e < hd) acc[j] += pi * load_f(vr, e);
            }
        }
        m = mn;
    }
    size_t pi = ((size_t)row * nh + h) * splits + z; /* an empty range leaves m = -inf, l = 0 */
    if (lane == 0) {
        part.ml[2 * pi] = m;
        part.ml[2 * pi + 1] = l;
    }
#pragma unroll
    for (int j = 0; j < NJ; j++) {
        int e = lane + 32 * j;
        if (e < hd) part.acc[pi * hd + e] = acc[j];
    }
}

/* a warp per (row, head): the ranges' accumulators rescaled to their common max, summed, over
 * the summed normalisers */
template <int NJ>
static __global__ void k_attn_combine(float *out, attn_part_ptrs part, int nh, int hd, int splits) {
    int row = blockIdx.x, lane = threadIdx.x & 31, h = blockIdx.y * ATTN_WARPS + (threadIdx.x >> 5);
    if (h >= nh) return;
    size_t p0 = ((size_t)row * nh + h) * splits;
    float M = -INFINITY;
    for (int z = 0; z < splits; z++) M = fmaxf(M, part.ml[2 * (p0 + z)]);
    float L = 0.0f, acc[NJ];
#pragma unroll
    for (int j = 0; j < NJ; j++) acc[j] = 0.0f;
    for (int z = 0; z < splits; z++) {
        float mz = part.ml[2 * (p0 + z)];
        if (mz == -INFINITY) continue; /* an empty range */
        float w = expf(mz - M);
        L += part.ml[2 * (p0 + z) + 1] * w;
#pragma unroll
        for (int j = 0; j < NJ; j++) {
            int e = lane + 32 * j;
            if (e < hd) acc[j] += part.acc[(p0 + z) * hd + e] * w;
        }
    }
    float inv = 1.0f / L;
    float *oh = out + ((size_t)row * nh + h) * hd;
#pragma unroll
    for (int j = 0; j < NJ; j++) {
        int e = lane + 32 * j;
        if (e < hd) oh[e] = acc[j] * inv;
    }
}

/* ---- query tiles (prefill) ----
 * Many rows: a block per (tile of QT_ROWS consecutive rows, head) stages each tile of 32 keys
 * and their values in shared memory once (widened to F32; rows padded by one float so the
 * lanes' column reads fall in distinct banks) and its four warps score QT_ROWS / 4 rows each
 * against it, the same online softmax per row as above: a key row is read from memory once
 * per tile of rows rather than once per row. A tile that straddles sequences takes them in
 * turn (keys in the union of their rows' visible ranges, each row masked to its own). Heads
 * up to QT_MAX_HD. */
enum { QT_ROWS = 16, QT_KEYS = 32, QT_MAX_HD = 128 };
static const size_t QT_SMEM = sizeof(float) * 2 * QT_KEYS * (QT_MAX_HD + 1); /* 33 KB: dynamic (under 48) */

template <int NJ, typename KT>
static __global__ void k_attention_tiled(float *out, const float *q, const KT *k, const KT *v, const attn_seq *seqs,
                                         const int32_t *row_seq, const int32_t *blocks, int n_tokens, int bs, int nh,
                                         int nkv, int hd, int window, float scale) {
    CS_DYN_SMEM(float, sm); /* ks[QT_KEYS][QT_MAX_HD + 1], then vs the same */
    float (*ks)[QT_MAX_HD + 1] = (float (*)[QT_MAX_HD + 1])sm, (*vs)[QT_MAX_HD + 1] = ks + QT_KEYS;
    const int RW = QT_ROWS / ATTN_WARPS; /* rows per warp */
    int r0 = blockIdx.x * QT_ROWS, h = blockIdx.y, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int nr = n_tokens - r0 < QT_ROWS ? n_tokens - r0 : QT_ROWS;
    int kvh = h / (nh / nkv);
    size_t kv_dim = (size_t)nkv * hd, off = (size_t)kvh * hd;
    unsigned done = 0;
    for (int i0 = 0; i0 < nr; i0++) { /* each sequence of the tile in turn (the same for every thread) */
        if (done >> i0 & 1u) continue;
        int sid = row_seq[r0 + i0];
        const attn_seq sq = seqs[sid];
        unsigned mask = 0;
        int lo = 0x7fffffff, hi = -1;
        for (int j = i0; j < nr; j++) {
            if (row_seq[r0 + j] != sid) continue;
            mask |= 1u << j;
            int qp = sq.pos0 + (r0 + j - sq.row0), f = window > 0 && qp - window + 1 > 0 ? qp - window + 1 : 0;
            lo = f < lo ? f : lo;
            hi = qp > hi ? qp : hi;
        }
        done |= mask;
        const int32_t *table = blocks + sq.blk0;
        float m[RW], l[RW], acc[RW][NJ];
        int qpos[RW], first[RW];
        bool mine[RW];
#pragma unroll
        for (int a = 0; a < RW; a++) {
            int j = w * RW + a; /* the tile's row this warp's a-th is */
            mine[a] = j < nr && (mask >> j & 1u);
            qpos[a] = sq.pos0 + (r0 + j - sq.row0);
            first[a] = window > 0 && qpos[a] - window + 1 > 0 ? qpos[a] - window + 1 : 0;
            m[a] = -INFINITY;
            l[a] = 0.0f;
#pragma unroll
            for (int jj = 0; jj < NJ; jj++) acc[a][jj] = 0.0f;
        }
        for (int t0 = lo; t0 <= hi; t0 += QT_KEYS) {
            int nk = hi - t0 + 1 < QT_KEYS ? hi - t0 + 1 : QT_KEYS;
            __syncthreads(); /* the last tile's reads are done */
            for (int i = threadIdx.x; i < nk * hd; i += blockDim.x) {
                int key = i / hd, e = i % hd, t = t0 + key;
                size_t at = ((size_t)table[t / bs] * bs + t % bs) * kv_dim + off + e;
                ks[key][e] = load_f(k, at);
                vs[key][e] = load_f(v, at);
            }
            __syncthreads();
#pragma unroll
            for (int a = 0; a < RW; a++) {
                if (!mine[a]) continue; /* the same for the whole warp */
                const float *qh = q + ((size_t)(r0 + w * RW + a) * nh + h) * hd;
                int t = t0 + lane;
                bool vis = lane < nk && t >= first[a] && t <= qpos[a];
                float s = -INFINITY;
                if (vis) {
                    float d0 = 0.0f, d1 = 0.0f;
                    int e = 0;
                    for (; e + 2 <= hd; e += 2) {
                        d0 += qh[e] * ks[lane][e];
                        d1 += qh[e + 1] * ks[lane][e + 1];
                    }
                    for (; e < hd; e++) d0 += qh[e] * ks[lane][e];
                    s = (d0 + d1) * scale;
                }
                float tmax = warp_max(s);
                if (tmax == -INFINITY) continue; /* none of this tile's keys is visible to the row */
                float mn = fmaxf(m[a], tmax);
                float corr = expf(m[a] - mn), p = vis ? expf(s - mn) : 0.0f;
                l[a] = l[a] * corr + warp_sum(p);
#pragma unroll
                for (int jj = 0; jj < NJ; jj++) acc[a][jj] *= corr;
                for (int i = 0; i < nk; i++) {
                    float pi = __shfl_sync(0xffffffffu, p, i);
#pragma unroll
                    for (int jj = 0; jj < NJ; jj++) {
                        int e = lane + 32 * jj;
                        if (e < hd) acc[a][jj] += pi * vs[i][e];
                    }
                }
                m[a] = mn;
            }
        }
#pragma unroll
        for (int a = 0; a < RW; a++) {
            if (!mine[a]) continue;
            float inv = 1.0f / l[a];
            float *oh = out + ((size_t)(r0 + w * RW + a) * nh + h) * hd;
#pragma unroll
            for (int jj = 0; jj < NJ; jj++) {
                int e = lane + 32 * jj;
                if (e < hd) oh[e] = acc[a][jj] * inv;
            }
        }
    }
}

#define K_ATTENTION(NJ) k_attention<NJ, KT> /* one macro argument for CS_LAUNCH */
#define K_SPLIT(NJ) k_attention_split<NJ, KT>
#define K_TILED(NJ) k_attention_tiled<NJ, KT>
template <typename KT>
static void launch(cudaStream_t st, float *out, const float *q, const KT *k, const KT *v, const attn_seq *seqs,
                   const int32_t *row_seq, const int32_t *blocks, int n_tokens, int bs, int nh, int nkv, int hd,
                   int window, int splits, bool tiled, float *part) {
    dim3 grid(n_tokens, (nh + ATTN_WARPS - 1) / ATTN_WARPS);
    float scale = 1.0f / sqrtf((float)hd);
    if (tiled && splits <= 1 && hd <= QT_MAX_HD) {
        dim3 tg((n_tokens + QT_ROWS - 1) / QT_ROWS, nh);
        if (hd <= 32) CS_LAUNCH(K_TILED(1), tg, 32 * ATTN_WARPS, QT_SMEM, st, out, q, k, v, seqs, row_seq, blocks, n_tokens, bs, nh, nkv, hd, window, scale);
        else if (hd <= 64) CS_LAUNCH(K_TILED(2), tg, 32 * ATTN_WARPS, QT_SMEM, st, out, q, k, v, seqs, row_seq, blocks, n_tokens, bs, nh, nkv, hd, window, scale);
        else CS_LAUNCH(K_TILED(4), tg, 32 * ATTN_WARPS, QT_SMEM, st, out, q, k, v, seqs, row_seq, blocks, n_tokens, bs, nh, nkv, hd, window, scale);
        return;
    }
    if (splits > 1) {
        attn_part_ptrs pp = {part, part + (size_t)2 * n_tokens * nh * splits};
        dim3 sg(n_tokens, grid.y, splits);
        if (hd <= 32) CS_LAUNCH(K_SPLIT(1), sg, 32 * ATTN_WARPS, 0, st, pp, q, k, v, seqs, row_seq, blocks, bs, nh, nkv, hd, window, scale, splits);
        else if (hd <= 64) CS_LAUNCH(K_SPLIT(2), sg, 32 * ATTN_WARPS, 0, st, pp, q, k, v, seqs, row_seq, blocks, bs, nh, nkv, hd, window, scale, splits);
        else if (hd <= 128) CS_LAUNCH(K_SPLIT(4), sg, 32 * ATTN_WARPS, 0, st, pp, q, k, v, seqs, row_seq, blocks, bs, nh, nkv, hd, window, scale, splits);
        else CS_LAUNCH(K_SPLIT(8), sg, 32 * ATTN_WARPS, 0, st, pp, q, k, v, seqs, row_seq, blocks, bs, nh, nkv, hd, window, scale, splits);
        CUDA_CHECK_LAUNCH();
        if (hd <= 32) CS_LAUNCH(k_attn_combine<1>, grid, 32 * ATTN_WARPS, 0, st, out, pp, nh, hd, splits);
        else if (hd <= 64) CS_LAUNCH(k_attn_combine<2>, grid, 32 * ATTN_WARPS, 0, st, out, pp, nh, hd, splits);
        else if (hd <= 128) CS_LAUNCH(k_attn_combine<4>, grid, 32 * ATTN_WARPS, 0, st, out, pp, nh, hd, splits);
        else CS_LAUNCH(k_attn_combine<8>, grid, 32 * ATTN_WARPS, 0, st, out, pp, nh, hd, splits);
        return;
    }
    if (hd <= 32) CS_LAUNCH(K_ATTENTION(1), grid, 32 * ATTN_WARPS, 0, st, out, q, k, v, seqs, row_seq, blocks, bs, nh, nkv, hd, window, scale);
    else if (hd <= 64) CS_LAUNCH(K_ATTENTION(2), grid, 32 * ATTN_WARPS, 0, st, out, q, k, v, seqs, row_seq, blocks, bs, nh, nkv, hd, window, scale);
    else if (hd <= 128) CS_LAUNCH(K_ATTENTION(4), grid, 32 * ATTN_WARPS, 0, st, out, q, k, v, seqs, row_seq, blocks, bs, nh, nkv, hd, window, scale);
    else CS_LAUNCH(K_ATTENTION(8), grid, 32 * ATTN_WARPS, 0, st, out, q, k, v, seqs, row_seq, blocks, bs, nh, nkv, hd, window, scale);
}

size_t attention_part_floats(int n_tokens, int nh, int hd, int splits) {
    return splits > 1 ? (size_t)n_tokens * nh * splits * (hd + 2) : 0;
}

void op_attention(cudaStream_t st, float *out, const float *q, const void *k, const void *v, int kv_dtype,
                  const attn_seq *seqs, const int32_t *row_seq, const int32_t *blocks, int n_tokens, int bs, int nh,
                  int nkv, int hd, int window, int splits, bool tiled, float *part) {
    if (n_tokens <= 0) return;
    if (kv_dtype == DT_BF16)
        launch(st, out, q, (const __nv_bfloat16 *)k, (const __nv_bfloat16 *)v, seqs, row_seq, blocks, n_tokens, bs, nh, nkv,
               hd, window, splits, tiled, part);
    else
        launch(st, out, q, (const float *)k, (const float *)v, seqs, row_seq, blocks, n_tokens, bs, nh, nkv, hd, window,
               splits, tiled, part);
    CUDA_CHECK_LAUNCH();
}
#undef K_ATTENTION
#undef K_SPLIT
#undef K_TILED

template <typename KT> static void load_for() {
    load_kernel(k_attention<1, KT>);
    load_kernel(k_attention<2, KT>);
    load_kernel(k_attention<4, KT>);
    load_kernel(k_attention<8, KT>);
    load_kernel(k_attention_split<1, KT>);
    load_kernel(k_attention_split<2, KT>);
    load_kernel(k_attention_split<4, KT>);
    load_kernel(k_attention_split<8, KT>);
    load_kernel(k_attention_tiled<1, KT>);
    load_kernel(k_attention_tiled<2, KT>);
    load_kernel(k_attention_tiled<4, KT>);
}

void load_attention_kernels() {
    load_for<float>();
    load_for<__nv_bfloat16>();
    load_kernel(k_attn_combine<1>);
    load_kernel(k_attn_combine<2>);
    load_kernel(k_attn_combine<4>);
    load_kernel(k_attn_combine<8>);
}

} /* namespace CS_NS */
