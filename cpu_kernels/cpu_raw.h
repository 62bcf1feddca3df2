/* cpu_raw.h: the CPU kernels behind the backend interface, on host pointers (implemented in
 * cpu_backend.c). The CPU backend and the strict test device (cpu_device.c) both resolve
 * their buffer handles to host memory and call these; the kernel tests and bench/micro's
 * kernelbench call them directly. Not part of the backend interface: nothing outside
 * cpu_kernels/, tests/ and bench/micro/ includes it. */
#ifndef CS_CPU_RAW_H
#define CS_CPU_RAW_H

#include "cpu_kernels/cpu_backend.h"
#include "base/common.h"

/* a weight in host memory */
typedef struct cs_weight {
    cs_dtype dtype;     /* F32, BF16, F16, or a block type of base/quant.h (matmuls, embed) */
    int rows, cols;     /* (out, in) for matrices; rows = 1 for vectors */
    const void *data;
    /* optional: the same BF16 matrix coded in 12 bits (wcode.h, --compress-weights), which
     * the batch-1 GEMV reads instead of data; every other kernel reads data */
    const struct cs_wcode *code;
    /* optional: a Q8_0/Q4_K/Q5_K/Q6_K matrix repacked for the int8 kernels (AVX512-VNNI, AVX2)
     * (kernels.h cs_qpack_t, --precision int8), which those read instead of data */
    const struct cs_qpack *pack;
} cs_weight_t;

typedef struct cpu_attn_seq {
    int row0, n, pos0;
    const int32_t *blocks;  /* block table covering positions [0, pos0 + n) */
} cpu_attn_seq_t;

typedef struct cpu_lora_seg {
    int row0, n;
    const void *a, *b;      /* (rank, d_in), (d_out, rank) */
    int rank;
    float scale;
    const void *bt;         /* optional: b transposed, (rank, d_out) */
    cs_dtype dtype;         /* of a, b, bt: F32 or BF16 */
} cpu_lora_seg_t;

typedef struct cpu_raw cpu_raw_t;

struct cpu_raw_i {
    /* y[n, w.rows] = x[n, w.cols] · wᵀ (+ bias[w.rows], may be NULL) */
    void (*matmul)(cpu_raw_t *b, float *y, const float *x, int n, const cs_weight_t *w, const float *bias);
    /* ys[k] = x · ws[k]ᵀ (+ biases[k]), k < count */
    void (*matmul_multi)(cpu_raw_t *b, float *const *ys, const float *x, int n, const cs_weight_t *const *ws,
                         const float *const *biases, int count);
    void (*rmsnorm)(cpu_raw_t *b, float *y, const float *x, int n, int dim, const cs_weight_t *w, float eps);
    void (*rope)(cpu_raw_t *b, float *x, int n, int n_heads, int head_dim, const int32_t *pos, const float *inv_freq);
    /* contiguous causal attention over k/v[0 .. pos0 + n) */
    void (*attention)(cpu_raw_t *b, float *out, const float *q, const float *k, const float *v, int n, int pos0,
                      int n_heads, int n_kv_heads, int head_dim, int window);
    /* over paged pools of kv_dtype (F32 or BF16) */
    void (*attention_paged)(cpu_raw_t *b, float *out, const float *q, const void *k, const void *v, cs_dtype kv_dtype,
                            const cpu_attn_seq_t *seqs, int n_seqs, int block_size, int n_heads, int n_kv_heads,
                            int head_dim, int window);
    /* pool row slots[i] = src row i, stored as kv_dtype (BF16: rounded to nearest even) */
    void (*kv_store)(cpu_raw_t *b, void *pool, cs_dtype kv_dtype, const float *src, const int32_t *slots, int n,
                     int row_len);
    void (*set_rows)(cpu_raw_t *b, float *dst, const float *src, const int32_t *idx, int n, int row_len);
    void (*get_rows)(cpu_raw_t *b, float *dst, const float *src, const int32_t *idx, int n, int row_len);
    void (*silu_mul)(cpu_raw_t *b, float *gate, const float *up, size_t n);
    void (*add)(cpu_raw_t *b, float *y, const float *x, size_t n);
    void (*lora)(cpu_raw_t *b, float *y, const float *x, int n, const float *a, const float *bm, int rank, int d_in,
                 int d_out, float scale);
    void (*lora_batch)(cpu_raw_t *b, float *y, const float *x, const cpu_lora_seg_t *segs, int n_segs, int d_in,
                       int d_out);
    void (*embed)(cpu_raw_t *b, float *y, const cs_weight_t *table, const int32_t *ids, int n);
    void (*free)(cpu_raw_t *b);
};

struct cpu_raw {
    const struct cpu_raw_i *iface;
    void *ctx;
    int n_threads;
};

/* the CPU kernels with these switches (n_threads 0: every online CPU); NULL on ENOMEM */
cpu_raw_t *cpu_raw_new(const cpu_backend_params_t *p);
/* the kernel path it chose, for benchmarks and --stats ("amx", "avx512", "avx2", "reference") */
const char *cpu_raw_path(const cpu_raw_t *b);

/* --compress-weights where it applies (the batch-1 GEMV runs): cpu_raw_wcode_new codes a
 * BF16 matrix on the pool (NULL on ENOMEM), to hang on cs_weight_t.code */
bool cpu_raw_codes_weights(const cpu_raw_t *b);
/* --compress-weights-only where it applies: a weight may then be given with data NULL and
 * its code, which every matmul path reads (see CPU_CODE_ONLY_PASS_MAX_N) */
bool cpu_raw_code_only(const cpu_raw_t *b);
/* Up to this many rows of x (AVX-512, exact; half as many on AVX2 and with --precision
 * bf16), a weight kept only coded goes through the coded kernel once per group of up to
 * CS_WCODE_MAX_N rows, the task's code in L2 for the groups after the first, rather than
 * through its rows decoded for the BF16 kernels. bench/kernelbench code_only_paired (Zen 4,
 * 2 threads, against the BF16 weights without the flag): AVX-512 at 5 / 8 / 12 / 16 rows
 * 0.90-0.97 / 0.94 / 0.90-0.92 / 0.89-0.93x in groups, 0.65 / 0.65 / 0.73 / 0.77x decoded;
 * AVX2 0.82-0.88x in groups at 5-8 against 0.64-0.76x, decoded ahead from 12 (0.78-0.88x
 * against 0.75-0.84x); --precision bf16 likewise at 5-8 (0.64-0.81x against 0.57x), decoded
 * from 16 (0.64x against 0.56x). Above it, the same kernels as on the BF16 weights, so the
 * same bits. */
#define CPU_CODE_ONLY_PASS_MAX_N 16
struct cs_wcode *cpu_raw_wcode_new(cpu_raw_t *b, const cs_weight_t *w);
/* --precision int8 (AVX512-VNNI or AVX2): Q8_0, Q4_K, Q5_K and Q6_K weights of whole groups of 16 rows are
 * repacked (cpu_raw_qpack_new, on the pool; NULL on ENOMEM) to hang on cs_weight_t.pack; the
 * weight's own bytes stay, for the other paths */
bool cpu_raw_packs_quant(const cpu_raw_t *b);
struct cs_qpack *cpu_raw_qpack_new(cpu_raw_t *b, const cs_weight_t *w);

static inline void cpu_raw_free(cpu_raw_t *b) { if (b) b->iface->free(b); }
static inline void cpu_raw_matmul(cpu_raw_t *b, float *y, const float *x, int n, const cs_weight_t *w, const float *bias) {
    b->iface->matmul(b, y, x, n, w, bias);
}
static inline void cpu_raw_matmul_multi(cpu_raw_t *b, float *const *ys, const float *x, int n,
                                        const cs_weight_t *const *ws, const float *const *biases, int count) {
    b->iface->matmul_multi(b, ys, x, n, ws, biases, count);
}
static inline void cpu_raw_rmsnorm(cpu_raw_t *b, float *y, const float *x, int n, int dim, const cs_weight_t *w, float eps) {
    b->iface->rmsnorm(b, y, x, n, dim, w, eps);
}
static inline void cpu_raw_rope(cpu_raw_t *b, float *x, int n, int nh, int hd, const int32_t *pos, const float *inv_freq) {
    b->iface->rope(b, x, n, nh, hd, pos, inv_freq);
}
static inline void cpu_raw_attention(cpu_raw_t *b, float *out, const float *q, const float *k, const float *v, int n,
                                     int pos0, int nh, int nkv, int hd, int window) {
    b->iface->attention(b, out, q, k, v, n, pos0, nh, nkv, hd, window);
}
static inline void cpu_raw_attention_paged(cpu_raw_t *b, float *out, const float *q, const float *k, const float *v,
                                           const cpu_attn_seq_t *seqs, int n_seqs, int bs, int nh, int nkv, int hd,
                                           int window) {
    b->iface->attention_paged(b, out, q, k, v, CS_DTYPE_F32, seqs, n_seqs, bs, nh, nkv, hd, window);
}
static inline void cpu_raw_attention_paged_kv(cpu_raw_t *b, float *out, const float *q, const void *k, const void *v,
                                              cs_dtype kv_dtype, const cpu_attn_seq_t *seqs, int n_seqs, int bs, int nh,
                                              int nkv, int hd, int window) {
    b->iface->attention_paged(b, out, q, k, v, kv_dtype, seqs, n_seqs, bs, nh, nkv, hd, window);
}
static inline void cpu_raw_kv_store(cpu_raw_t *b, void *pool, cs_dtype kv_dtype, const float *src, const int32_t *slots,
                                    int n, int row_len) {
    b->iface->kv_store(b, pool, kv_dtype, src, slots, n, row_len);
}
static inline void cpu_raw_set_rows(cpu_raw_t *b, float *dst, const float *src, const int32_t *idx, int n, int len) {
    b->iface->set_rows(b, dst, src, idx, n, len);
}
static inline void cpu_raw_get_rows(cpu_raw_t *b, float *dst, const float *src, const int32_t *idx, int n, int len) {
    b->iface->get_rows(b, dst, src, idx, n, len);
}
static inline void cpu_raw_silu_mul(cpu_raw_t *b, float *g, const float *u, size_t n) { b->iface->silu_mul(b, g, u, n); }
static inline void cpu_raw_add(cpu_raw_t *b, float *y, const float *x, size_t n) { b->iface->add(b, y, x, n); }
static inline void cpu_raw_lora(cpu_raw_t *b, float *y, const float *x, int n, const float *a, const float *bm, int rank,
                                int d_in, int d_out, float scale) {
    b->iface->lora(b, y, x, n, a, bm, rank, d_in, d_out, scale);
}
static inline void cpu_raw_lora_batch(cpu_raw_t *b, float *y, const float *x, const cpu_lora_seg_t *segs, int n_segs,
                                      int d_in, int d_out) {
    b->iface->lora_batch(b, y, x, segs, n_segs, d_in, d_out);
}
static inline void cpu_raw_embed(cpu_raw_t *b, float *y, const cs_weight_t *t, const int32_t *ids, int n) {
    b->iface->embed(b, y, t, ids, n);
}

#endif
