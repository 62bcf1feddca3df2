/* kernels.h: the CPU backend's kernels. Every *_ref function is a plain loop, the
 * readable definition; the fast paths (AVX-512, tiled BLAS) are tested against them in
 * tests/test_cpu_kernels.c. All activations F32, accumulation F32 (double where noted). */
#ifndef CS_KERNELS_H
#define CS_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "cpu_kernels/cpu_raw.h"

/* ---- reference kernels ---- */
void cs_matmul_ref(float *y, const float *x, int n, const cs_weight_t *w, const float *bias);
void cs_rmsnorm_ref(float *y, const float *x, int n, int dim, const float *w, float eps);
void cs_rope_ref(float *x, int n, int n_heads, int head_dim, const int32_t *pos, const float *inv_freq);
void cs_attention_ref(float *out, const float *q, const float *k, const float *v, int n, int pos0,
                      int n_heads, int n_kv_heads, int head_dim, int window);
void cs_silu_mul_ref(float *gate, const float *up, size_t n);
void cs_softmax_ref(float *x, int n); /* in place, n >= 1 */
void cs_round_bf16_ref(float *dst, const float *x, size_t count);
void cs_lora_ref(float *y, const float *x, int n, const float *a, const float *b, int rank, int d_in,
                 int d_out, float scale);

/* ---- few-row LoRA kernels (kernels_lora.c), F32 or BF16 weights ---- */
typedef enum cs_isa { CS_ISA_PLAIN = 0, CS_ISA_AVX2, CS_ISA_AVX512 } cs_isa;
int cs_cpu_has_avx2(void);   /* AVX2 and FMA */
void cs_cpu_name(char *buf, size_t len); /* /proc/cpuinfo's model name, "?" where there is none */
#define CS_LORA_SMALL_M 8    /* rows cs_lora_expand_bt takes at once */
/* dot(x[0 .. n), w[0 .. n)), w F32 or BF16 */
float cs_lora_dot(const float *x, const void *w, cs_dtype dt, int n, cs_isa isa);
/* y[i, c0:c1] += scale · Σ_r t[i, r] · bt[r, c0:c1] for i < n ≤ CS_LORA_SMALL_M; bt (rank, ld_y)
 * F32 or BF16, t rows ld_t apart */
void cs_lora_expand_bt(float *y, int ld_y, const float *t, int ld_t, int n, const void *bt, cs_dtype dt, int rank,
                       int c0, int c1, float scale, cs_isa isa);
/* the same from B itself (d_out, rank): B's rows in order, 16 (AVX-512) or 8 (AVX2) outputs
 * summed by one tree; its own fixed sequence per element, not the bits of cs_lora_expand_bt.
 * Only where cs_lora_expand_b_fits: rank a multiple of 16 (AVX-512) or 8 (AVX2). */
bool cs_lora_expand_b_fits(int rank, cs_isa isa);
void cs_lora_expand_b(float *y, int ld_y, const float *t, int ld_t, int n, const void *b, cs_dtype dt, int rank, int c0,
                      int c1, float scale, cs_isa isa);

/* ---- AVX-512 kernels (call only when cs_cpu_has_avx512()) ---- */
int cs_cpu_has_avx512(void);
/* y[i, r] = dot(x[i, :], w[r, :]) for rows r in [r0, r1), i < n; w of dtype BF16/F16/F32.
 * One BF16 row of x reads 8 interleaved row streams each prefetched 1 KiB ahead; the _s4
 * variant reads 4 streams 512 bytes ahead (picked on AMD CPUs: cpu_backend_params_t.gemv_streams) */
void cs_gemv_rows_avx512(float *y, int ldy, const float *x, int n, const cs_weight_t *w, int r0, int r1);
void cs_gemv_rows_avx512_s4(float *y, int ldy, const float *x, int n, const cs_weight_t *w, int r0, int r1);
/* Batch-invariant GEMM, same contract as cs_gemv_rows_avx512: each y[i, r] comes from one
 * fixed sequence of operations (16-lane FMAs over the columns in order, the tail masked,
 * one horizontal sum), so it is bit-identical whatever n, i's place or [r0, r1). */
void cs_gemm_invariant_avx512(float *y, int ldy, const float *x, int n, const cs_weight_t *w, int r0, int r1);
/* The same for BF16 weights, faster (kernels_avx512.c): x packed first by cs_split_pack_x_avx512
 * (rows [i0, i1) of x, n × K, into xs: each CS_SPLIT_B columns as their even then their odd
 * elements, zero past K; cs_split_xs_len floats, 64-byte aligned), w->dtype BF16 only. Also
 * batch-invariant (its own fixed sequence: not the same bits as cs_gemm_invariant_avx512). */
#define CS_SPLIT_B 32
size_t cs_split_xs_len(int n, int K);
void cs_split_pack_x_avx512(float *xs, const float *x, int n, int K, int i0, int i1);
void cs_gemm_split_avx512(float *y, int ldy, const float *xs, int n, const cs_weight_t *w, int r0, int r1);
/* y[i, r] for i < n, r in [r0, r1), many rows of x (prefill): x packed by
 * cs_gemm_packed_pack_x (tiles [t0, t1) of CS_PACKED_MR rows, zero past n) into xp
 * (cs_gemm_packed_xp_len floats), w's rows widened into F32 panels in wp
 * (cs_gemm_packed_wp_len(r1 - r0, cols) floats, 64-byte aligned), then a 12 × 32 FMA register
 * tile over all of K; any weight dtype */
#define CS_PACKED_MR 12
size_t cs_gemm_packed_xp_len(int n, int K, int mr);
size_t cs_gemm_packed_wp_len(int rows, int K);
void cs_gemm_packed_pack_x(float *xp, const float *x, int n, int K, int mr, int t0, int t1);
void cs_gemm_packed_avx512(float *y, int ldy, const float *xp, int n, const cs_weight_t *w, int r0, int r1, float *wp);
/* x rounded to BF16 (nearest even) and back to F32, count floats: the input of every matmul
 * against BF16 weights under --precision bf16. The plain loop is cs_round_bf16_ref. */
void cs_round_bf16_avx512(float *dst, const float *x, size_t count);
void cs_round_bf16_avx2(float *dst, const float *x, size_t count);
/* convert rows [r0, r1) of w to F32 into dst (r1 - r0, w->cols) */
void cs_convert_rows_avx512(float *dst, const cs_weight_t *w, int r0, int r1);

/* ---- AVX2+FMA kernels (kernels_avx2.c; call only when cs_cpu_has_avx2()): the AVX-512
 * kernels' contracts in 8 lanes ---- */
void cs_gemv_rows_avx2(float *y, int ldy, const float *x, int n, const cs_weight_t *w, int r0, int r1);
void cs_gemv_rows_avx2_s4(float *y, int ldy, const float *x, int n, const cs_weight_t *w, int r0, int r1);
void cs_gemm_invariant_avx2(float *y, int ldy, const float *x, int n, const cs_weight_t *w, int r0, int r1);
/* cs_gemm_split_avx512 in 8 lanes (kernels_avx2.c): x packed by cs_split_pack_x_avx2 (each 16
 * columns as their even then odd elements, rows cs_split_xs_len / n apart, zero past K), BF16
 * weights only, batch-invariant (its own fixed sequence) */
void cs_split_pack_x_avx2(float *xs, const float *x, int n, int K, int i0, int i1);
void cs_gemm_split_avx2(float *y, int ldy, const float *xs, int n, const cs_weight_t *w, int r0, int r1);
void cs_convert_rows_avx2(float *dst, const cs_weight_t *w, int r0, int r1);
/* cs_gemm_packed_avx512's contract in 8 lanes: x in tiles of CS_PACKED_MR_AVX2 rows, a 6 × 16
 * register tile, panels of 16 weight rows (wp: cs_gemm_packed_wp_len floats) */
#define CS_PACKED_MR_AVX2 6
void cs_gemm_packed_avx2(float *y, int ldy, const float *xp, int n, const cs_weight_t *w, int r0, int r1, float *wp);
void cs_softmax_avx2(float *x, int n);
void cs_silu_mul_avx2(float *gate, const float *up, size_t n);
/* one query of paged attention over heads [h0, h1) of q's row (nh heads, g query heads per
 * KV head): scores over keys [first, last] into s ((h1 - h0) · (last - first + 1) floats),
 * softmax, out_h = Σ p_t v_t into out's row (head_dim hd a multiple of 8; rows through the
 * block table; pools of kv_dtype, F32 or BF16, rows of kv_dim) */
void cs_attn_rows_paged_avx2(float *out, float *s, const float *q, const void *k, const void *v, cs_dtype kv_dtype,
                             const int32_t *blocks, int bs, int first, int last, int h0, int h1, int g, size_t kv_dim,
                             float scale, int hd);

/* ---- AMX BF16 GEMM (gemm_bf16.c; call only when cs_cpu_has_amx_bf16()) ----
 * y = x · wᵀ for a BF16 w with x split into `terms` BF16 parts (2: x's residual below
 * 2⁻¹⁶ relative; 3: exact), products accumulated in F32 on the tile unit. */
int cs_cpu_has_amx_bf16(void); /* also requests the tile-data permission from Linux */
#define CS_AMX_TILE_ELEMS 512   /* bf16 in one packed 16×32 tile */
/* bf16 elements of the packed x for n rows (mt_pad tiles of 16 rows, K padded to 32) */
static inline size_t cs_gemm_bf16_xp_len(int n, int K, int terms) {
    return (size_t)((n + 31) / 32 * 2) * (size_t)((K + 31) / 32) * (size_t)terms * CS_AMX_TILE_ELEMS;
}
#define CS_AMX_SMALL_N 32       /* up to here: memory-bound, W · xᵀ straight from the weights */
/* bf16 elements of the scratch a task over `rows` weight rows needs (weight tiles and
 * F32 partial sums) */
size_t cs_gemm_bf16_wp_len(int n, int rows, int K, int terms);
/* pack row tiles [mt0, mt1) of x (n, K) into xp (64-byte aligned); rows past n are zero.
 * Tiles go up to (n + 31) / 32 * 2. */
void cs_gemm_bf16_pack_x(uint16_t *xp, const float *x, int n, int K, int terms, int mt0, int mt1);
/* y[i, r] for i < n, r in [r0, r1); ldy in floats; wp: scratch of cs_gemm_bf16_wp_len(r1 - r0,
 * K) bf16, 64-byte aligned */
void cs_gemm_bf16_amx(float *y, int ldy, const uint16_t *xp, int n, int terms, const cs_weight_t *w, int r0,
                      int r1, uint16_t *wp);

/* ---- AVX512-BF16 GEMM (gemm_dpbf16.c; call only when cs_cpu_has_avx512_bf16()) ----
 * y = x · wᵀ for a BF16 w with x split into `terms` BF16 parts (1: x rounded to BF16, the
 * --precision bf16 mode; 2; 3: exact), products accumulated in F32 by vdpbf16ps. */
int cs_cpu_has_avx512_bf16(void);
#define CS_DP_SMALL_N 32 /* up to here: W's pairs broadcast from the weights in place, x in the lanes */
#define CS_DP_LANE_N 8   /* up to here: each row of x in 16 / np lanes (np: n to a power of two) */
/* bf16 elements of packed x for n rows, and of the weight scratch a call over `rows` rows needs */
size_t cs_dpbf16_xp_len(int n, int K, int terms);
size_t cs_dpbf16_wp_len(int n, int rows, int K);
/* pack rows [r0, r1) of x (n, K) into xp (64-byte aligned, zeroed past n where r1 reaches the
 * padded end: n to a power of two for n ≤ CS_DP_LANE_N, (n + 15) / 16 * 16 rows for n ≤
 * CS_DP_SMALL_N, else (n + 11) / 12 * 12) */
void cs_dpbf16_pack_x(uint16_t *xp, const float *x, int n, int K, int terms, int r0, int r1);
/* y[i, r] for i < n, r in [r0, r1); ldy in floats; wp: scratch of cs_dpbf16_wp_len bf16,
 * 64-byte aligned */
void cs_gemm_dpbf16(float *y, int ldy, const uint16_t *xp, int n, int terms, const cs_weight_t *w, int r0, int r1,
                    uint16_t *wp);
/* rows of packed x, with the padding */
static inline int cs_dpbf16_padded_rows(int n) {
    int np = 1;
    while (np < n) np *= 2;
    return n <= CS_DP_LANE_N ? np : n <= CS_DP_SMALL_N ? (n + 15) / 16 * 16 : (n + 11) / 12 * 12;
}


/* ---- block-quantized weights (kernels_quant.c; base/quant.h's types), F32 activations ---- */
#define CS_QGEMV_MAX_N 4
/* y[i · ldy + r] = Σ_c x[i, c] · w[r, c] for r in [r0, r1), i < n ≤ CS_QGEMV_MAX_N: each
 * weight dequantized in registers, F32 products in a fixed order per (i, r) (batch-invariant) */
void cs_qgemv_rows_avx2(float *y, int ldy, const float *x, int n, const cs_weight_t *w, int r0, int r1);
void cs_qgemv_rows_ref(float *y, int ldy, const float *x, int n, const cs_weight_t *w, int r0, int r1);
/* rows [r0, r1) of w dequantized to F32 at dst, cols apart (cs_dequant_row_ref's values up to
 * the rounding of s·q + o, fused here) */
void cs_qdequant_rows_avx2(float *dst, const cs_weight_t *w, int r0, int r1);
void cs_qdequant_rows_ref(float *dst, const cs_weight_t *w, int r0, int r1);
/* --precision int8: n elements of x (a multiple of block) quantized per block (32, or 256 against
 * the K types: cs_quant_act_block) as llama.cpp quantizes them (Q8_0 and Q8_K blocks): q = x · id
 * rounded to nearest (ties to even), id = 127 / max|x| over the block; d[b] = max|x| / 127
 * rounded to F16 per 32, 1 / id per 256; sum[g] = Σ q over each 32; x̂ = d[b] · q */
static inline int cs_quant_act_block(cs_dtype w) { return cs_dtype_block(w) == 256 ? 256 : 32; }
void cs_quantize_act_ref(int8_t *q, float *d, float *sum, const float *x, int64_t n, int block);
void cs_quantize_act_avx2(int8_t *q, float *d, float *sum, const float *x, int64_t n, int block);
/* cs_qgemv_rows_*'s contract on x quantized so for w (rows of x cols apart in q, cols / block
 * apart in d, cols / 32 in sum): y = x̂ · wᵀ with integer products, F32 sums */
void cs_qgemv_int8_avx2(float *y, int ldy, const int8_t *qx, const float *dx, const float *sx, int n,
                        const cs_weight_t *w, int r0, int r1);
void cs_qgemv_int8_ref(float *y, int ldy, const int8_t *qx, const float *dx, const float *sx, int n,
                       const cs_weight_t *w, int r0, int r1);


/* ---- --precision int8 on packs (kernels_qpack.c): Q8_0, Q4_K, Q5_K and Q6_K weights repacked 16
 * rows at a time, each row in a 32-bit lane (the layouts: kernels_qpack.c), for AVX512-VNNI
 * and for AVX2 ---- */
#define CS_QPACK_ROWS 16
#define CS_QPACK_MAX_N 4
typedef struct cs_qpack {
    cs_dtype dtype;
    int rows, cols;      /* rows a multiple of CS_QPACK_ROWS, cols of the type's blocks */
    size_t group_bytes;  /* one group of CS_QPACK_ROWS rows */
    uint8_t *data;       /* in huge pages: an arena's chunk, or its own cs_huge_alloc */
    size_t data_len;
    struct cs_qpack_chunk *chunk;
} cs_qpack_t;
/* packs carved out of shared huge-page mappings (kernels_qpack.c); thread-safe */
typedef struct cs_qpack_arena cs_qpack_arena_t;
cs_qpack_arena_t *cs_qpack_arena_new(void);
void cs_qpack_arena_free(cs_qpack_arena_t *a); /* the packs taken from it stay valid */
int cs_cpu_has_avx512_vnni(void);
bool cs_qpack_supports(cs_dtype dt, int rows, int cols);
/* NULL: not supported, or ENOMEM; arena NULL: a mapping of its own */
cs_qpack_t *cs_qpack_new(cs_dtype dt, int rows, int cols, cs_qpack_arena_t *arena);
/* groups [g0, g1) of CS_QPACK_ROWS rows of w (p's dtype and shape) into p */
void cs_qpack_fill(cs_qpack_t *p, const cs_weight_t *w, int g0, int g1);
size_t cs_qpack_bytes(const cs_qpack_t *p);
void cs_qpack_free(cs_qpack_t *p);
/* cs_qgemv_int8_*'s contract on the pack, n ≤ CS_QPACK_MAX_N, r0 and r1 whole groups (or r1 =
 * rows); s16: Σ q_x over each 16 columns (cs_act_sums16, cols / 16 apart), read for Q6_K.
 * Only where cs_cpu_has_avx512_vnni(). */
void cs_qgemv_int8_vnni(float *y, int ldy, const int8_t *qx, const float *dx, const float *sx, const int32_t *s16, int n,
                        const cs_qpack_t *p, int r0, int r1);
/* the same on AVX2 (vpmaddubsw, vpmaddwd): cs_qgemv_int8_vnni's results, bit for bit */
void cs_qgemv_int8_pack_avx2(float *y, int ldy, const int8_t *qx, const float *dx, const float *sx, const int32_t *s16,
                             int n, const cs_qpack_t *p, int r0, int r1);
void cs_act_sums16(int32_t *s16, const int8_t *q, int64_t n);
/* Q6_K at many rows of x (prefill): its groups' six-bit values unpacked once
 * (cs_qpack_q6k_unpack: the groups of rows [r0, r1), cs_qpack_q6k_unpacked_bytes each, to
 * dst) for every group of up to CS_QPACK_MAX_N rows of x, not again at each;
 * cs_qgemv_int8_vnni's results, bit for bit. Only where cs_cpu_has_avx512_vnni(). */
size_t cs_qpack_q6k_unpacked_bytes(const cs_qpack_t *p);
void cs_qpack_q6k_unpack(uint8_t *dst, const cs_qpack_t *p, int r0, int r1);
void cs_qgemv_int8_vnni_q6u(float *y, int ldy, const int8_t *qx, const float *dx, const int32_t *s16, int n,
                            const cs_qpack_t *p, int r0, int r1, const uint8_t *u);

#endif
