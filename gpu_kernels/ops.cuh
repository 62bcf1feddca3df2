/* ops.cuh: the kernels' launchers, one op per .cu file (ggml-cuda's layout). Pointers are
 * device memory; every launcher queues its work on stream st and returns. The plain
 * references they are tested against are the CPU backend's (tests/test_backend_ops.c). */
#ifndef CS_CUDA_OPS_CUH
#define CS_CUDA_OPS_CUH

#include "gpu_kernels/cuda_common.cuh"

namespace CS_NS {

/* embed.cu: y[i, :] = table[ids[i], :] as F32 (table F32, F16 or BF16) */
void op_embed(cudaStream_t st, float *y, const void *table, int dtype, int cols, const int32_t *ids, int n);

/* rows.cu: dst[idx[i], :] = src[i, :] (KV writes into pages; dst of dtype F32, or BF16
 * rounded to nearest even) and dst[i, :] = src[idx[i], :] */
void op_set_rows(cudaStream_t st, void *dst, int dtype, const float *src, const int32_t *idx, int n, int len);
void op_get_rows(cudaStream_t st, float *dst, const float *src, const int32_t *idx, int n, int len);

/* convert.cu: dst[i] = src[i] rounded to dtype (F16 or BF16; F32 copies) */
void op_convert(cudaStream_t st, void *dst, int dtype, const float *src, size_t n);

/* add.cu: y[i] += x[i]; y[r, c] += bias[c] for n rows of cols */
void op_add(cudaStream_t st, float *y, const float *x, size_t n);
void op_add_bias(cudaStream_t st, float *y, const float *bias, int n, int cols);

/* silu_mul.cu: g[i] = silu(g[i]) * u[i] */
void op_silu_mul(cudaStream_t st, float *g, const float *u, size_t n);

/* rmsnorm.cu: y[i, :] = x[i, :] / sqrt(mean(x[i, :]²) + eps) * w (y may be x) */
void op_rmsnorm(cudaStream_t st, float *y, const float *x, int n, int dim, const float *w, float eps);

/* rope.cu: rotate-half RoPE in place on x[n, nh, hd] at positions pos[n] */
void op_rope(cudaStream_t st, float *x, int n, int nh, int hd, const int32_t *pos, const float *inv_freq);

/* attention.cu: paged attention over the batch's sequences (backend/backend.h's attention),
 * pools of kv_dtype (DT_F32 or DT_BF16). splits <= 1: a warp per (row, head) over all its keys
 * (the reference); splits > 1: each row's keys in that many ranges, then combined
 * (flash-decoding), with part holding attention_part_floats of scratch; tiled (splits <= 1,
 * head_dim <= 128): tiles of 16 rows share each tile of keys in shared memory (prefill). */
struct attn_seq { int32_t row0, n, pos0, blk0; };
void op_attention(cudaStream_t st, float *out, const float *q, const void *k, const void *v, int kv_dtype,
                  const attn_seq *seqs,
                  const int32_t *row_seq, const int32_t *blocks, int n_tokens, int bs, int nh, int nkv, int hd,
                  int window, int splits, bool tiled, float *part);
size_t attention_part_floats(int n_tokens, int nh, int hd, int splits);

/* lora.cu: grouped LoRA. A slot keeps a table of modules on the device, one per (layer,
 * target); a batch names, per LoRA segment, its slot's table, and per row its segment (-1:
 * none). shrink: t[row, r] = scale · x[row, :] · a[r, :] for r < the row's rank;
 * expand: y[row, :] += t[row, :rank] · bt[:rank, :]. One row per sequence in decode (BGMV)
 * or a run of rows of one adapter in prefill (SGMV): the same launch serves both, several
 * adapters of different ranks (up to LORA_MAX_RANK) in one launch. */
enum { LORA_MAX_RANK = 256, LORA_TARGETS = 7 }; /* LORA_TARGETS: BACKEND_LORA_TARGETS, modules per layer */
struct lora_mod {
    const void *a;      /* (rank, d_in) */
    const void *bt;     /* (rank, d_out): B transposed */
    int32_t rank, dtype;
    float scale;
    int32_t pad;
};
struct lora_seg {
    int32_t row0, n;
    const lora_mod *mods; /* the slot's table on the device */
    int32_t device_layers; /* layers below this are added here; the rest by the host (cold start) */
    int32_t pad;
};
/* tiled: the row tiles' kernel (prefill), else a warp per (row, rank) (the reference) */
void op_lora_shrink(cudaStream_t st, float *t, int ld_t, const float *x, int d_in, const int32_t *row_seg,
                    const lora_seg *segs, int mod, int n_tokens, int max_rank, bool tiled);
void op_lora_expand(cudaStream_t st, float *y, int d_out, const float *t, int ld_t, const int32_t *row_seg,
                    const lora_seg *segs, int mod, int n_tokens, int max_rank);

/* assist.cu: wait until *flag >= value (host memory that host threads raise: the cold
 * start's host-assisted LoRA), then y[i] += src[i] for i < n, src in host memory (pinned:
 * mapped into the device's address space) of src_dtype (DT_F32 or DT_BF16). The stream stops at it until the flag is up, or
 * for timeout_ns at most without a change of *alive (host memory the host raises while at
 * work; NULL: none): then the kernel fills *report (mapped host memory), prints it and traps,
 * and the next CUDA call fails. */
struct spin_report {
    volatile uint32_t hit; /* 1 once a wait gave up */
    int32_t layer;
    uint32_t value, seen;  /* waited for, last read */
    uint64_t waited_ns;
};
void op_wait_add(cudaStream_t st, float *y, const void *src, int src_dtype, size_t n, const uint32_t *flag,
                 uint32_t value, const uint32_t *alive, uint64_t timeout_ns, int layer, spin_report *report);

/* every kernel of each file loaded now (cudaFuncGetAttributes), not lazily at its first
 * launch: a first launch may wait for the device to go idle, and the device may be waiting
 * for the host (op_wait_add) */
void load_embed_kernels();
void load_rows_kernels();
void load_convert_kernels();
void load_add_kernels();
void load_silu_mul_kernels();
void load_rmsnorm_kernels();
void load_rope_kernels();
void load_attention_kernels();
void load_lora_kernels();
void load_assist_kernels();

} /* namespace CS_NS */
#endif
