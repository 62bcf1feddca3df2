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

#define K_ATTENTION(NJ) k_attention<NJ, KT> /* one macro argument for CS_LAUNCH */
template <typename KT>
static void launch(cudaStream_t st, float *out, const float *q, const KT *k, const KT *v, const attn_seq *seqs,
                   const int32_t *row_seq, const int32_t *blocks, int n_tokens, int bs, int nh, int nkv, int hd,
                   int window) {
    dim3 grid(n_tokens, (nh + ATTN_WARPS - 1) / ATTN_WARPS);
    float scale = 1.0f / sqrtf((float)hd);
    if (hd <= 32) CS_LAUNCH(K_ATTENTION(1), grid, 32 * ATTN_WARPS, 0, st, out, q, k, v, seqs, row_seq, blocks, bs, nh, nkv, hd, window, scale);
    else if (hd <= 64) CS_LAUNCH(K_ATTENTION(2), grid, 32 * ATTN_WARPS, 0, st, out, q, k, v, seqs, row_seq, blocks, bs, nh, nkv, hd, window, scale);
    else if (hd <= 128) CS_LAUNCH(K_ATTENTION(4), grid, 32 * ATTN_WARPS, 0, st, out, q, k, v, seqs, row_seq, blocks, bs, nh, nkv, hd, window, scale);
    else CS_LAUNCH(K_ATTENTION(8), grid, 32 * ATTN_WARPS, 0, st, out, q, k, v, seqs, row_seq, blocks, bs, nh, nkv, hd, window, scale);
}

void op_attention(cudaStream_t st, float *out, const float *q, const void *k, const void *v, int kv_dtype,
                  const attn_seq *seqs, const int32_t *row_seq, const int32_t *blocks, int n_tokens, int bs, int nh,
                  int nkv, int hd, int window) {
    if (n_tokens <= 0) return;
    if (kv_dtype == DT_BF16)
        launch(st, out, q, (const __nv_bfloat16 *)k, (const __nv_bfloat16 *)v, seqs, row_seq, blocks, n_tokens, bs, nh, nkv,
               hd, window);
    else launch(st, out, q, (const float *)k, (const float *)v, seqs, row_seq, blocks, n_tokens, bs, nh, nkv, hd, window);
    CUDA_CHECK_LAUNCH();
}
#undef K_ATTENTION

void load_attention_kernels() {
    load_kernel(k_attention<1, float>);
    load_kernel(k_attention<2, float>);
    load_kernel(k_attention<4, float>);
    load_kernel(k_attention<8, float>);
    load_kernel(k_attention<1, __nv_bfloat16>);
    load_kernel(k_attention<2, __nv_bfloat16>);
    load_kernel(k_attention<4, __nv_bfloat16>);
    load_kernel(k_attention<8, __nv_bfloat16>);
}

} /* namespace CS_NS */
