/* cpu_backend.c: the CPU kernels on host pointers (cpu_raw.h's struct cpu_raw_i, made by
 * cpu_raw_new), which cpu_device.c puts behind the backend interface. Work is split into
 * tasks over output rows (GEMM/GEMV), heads (attention) or tokens (LoRA, norms) and run on
 * the thread pool.
 * Large-n GEMMs widen a cache-sized tile of weight rows to F32 and call single-threaded
 * cblas_sgemm on it; small-n (decode) uses the AVX-512 GEMV that streams BF16 weights. */
#include "cpu_kernels/cpu_backend.h"
#include "cpu_kernels/cpu_raw.h"

#include <cblas.h>
#include <immintrin.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "cpu_kernels/kernels.h"
#include "cpu_kernels/kernels_paged.h"
#include "cpu_kernels/threadpool.h"
#include "cpu_kernels/wcode.h"
#include "base/quant.h"

#define GEMV_MAX_N 8          /* up to this many rows use the GEMV kernel (n = 1 once TILE_MAX_N takes 2..) */
#define TILE_MAX_N 32         /* 2..this many rows: the 4x4 dot tiles (cs_gemm_invariant_avx512), 1.1-2.7x
                               * the GEMV/sgemm there (F32, F16, BF16 without AMX; 2 threads) */
#define AMX_MIN_N 2           /* BF16 weights: from this many rows on, the AMX GEMM */
#define SLAB_BYTES (8u << 20) /* widened weight rows per GEMM task, per thread */
#define PACKED_ROWS 32        /* weight rows per task of the packed GEMM (AVX-512, AVX2) */
#define ATTN_QBLOCK 64        /* queries per attention GEMM task */
#define CPU_QINT8_MAX_N 32    /* --precision int8: rows of x up to which activations are quantized */

typedef void (*cs_rows_fn)(float *y, int ldy, const float *x, int n, const cs_weight_t *w, int r0, int r1);

typedef struct cpu_ctx {
    threadpool_t *pool;
    int n_threads;
    bool avx512;
    bool reference;
    bool invariant;       /* batch-invariant kernels only */
    bool no_tile;         /* CS_NO_TILE: the GEMV/sgemm for 2..TILE_MAX_N rows too (benchmarks) */
    float **scratch;      /* per thread */
    size_t *scratch_len;  /* floats */
    float *gather;        /* paged attention: one sequence's K and V made contiguous */
    bool amx;             /* AMX BF16 tiles usable (cs_cpu_has_amx_bf16) */
    int amx_terms;        /* BF16 terms of x for large n: 3 (exact) or 2 (CS_AMX_TERMS=2) */
    uint16_t *xpack;      /* matmul: x packed into BF16 tiles */
    size_t xpack_len;     /* bf16 elements */
    size_t gather_len;    /* floats */
    float *lora_t;        /* grouped LoRA: shrink results of a batch */
    size_t lora_t_len;    /* floats */
    float *lora_wide;     /* grouped LoRA, many rows: a BF16 segment's A and B widened */
    size_t lora_wide_len; /* floats */
    bool avx2;            /* AVX2 + FMA: the LoRA kernels' 8-lane path */
    bool dpbf16;          /* AVX512-BF16 GEMMs usable (cs_cpu_has_avx512_bf16) */
    bool packed;          /* large n: cs_gemm_packed_avx512/avx2, not OpenBLAS */
    cs_rows_fn split;     /* BF16 dot tiles on x packed even/odd (cs_gemm_split_avx512/avx2), */
    void (*split_pack)(float *xs, const float *x, int n, int K, int i0, int i1); /* and its packing */
    bool prec_bf16;       /* --precision bf16: x rounded to BF16 before matmuls against BF16 weights */
    bool prec_int8;       /* --precision int8: x quantized to 8 bits per 32 against quantized weights */
    int8_t *xq;           /* ... x quantized (n · cols), its scales and sums (n · cols / 32 each) */
    float *xq_d, *xq_s;
    size_t xq_len;        /* bytes of xq; xq_d and xq_s hold xq_len / 32 floats */
    bool qpack;           /* --precision int8 on packs: Q8_0/Q4_K/Q5_K/Q6_K weights repacked
                           * (cs_qpack_t, at weight_prepare) for ... */
    bool vnni;            /* ... cs_qgemv_int8_vnni (AVX512-VNNI), or cs_qgemv_int8_pack_avx2 */
    int32_t *xq_s16;      /* ... and x's sums per 16 (Q6_K), xq_len / 16 */
    cs_qpack_arena_t *qarena; /* ... the packs' memory */
    float *xround;        /* --precision bf16: x rounded, for the kernels that take F32 x */
    size_t xround_len;    /* floats */
    bool compress;        /* --compress-weights: the batch-1 GEMV reads BF16 weights coded in 12 bits */
    bool code_only;       /* --compress-weights-only: and weights may come coded only (data NULL) */
    int code_pass_max;    /* up to this many rows of x such weights go through the coded kernel */
    int wcode_max_n;      /* up to this many rows read coded weights (the rest the BF16 dot tiles):
                           * 3 with AVX-512, where 2 / 3 / 4 rows ran 1.26-1.40x / 0.98-1.19x
                           * (median 1.13x) / 0.99-1.01x the tiles' speed (kernelbench
                           * coded_rows_paired, four runs, Zen 4), 4 with AVX2 (1.20-1.27x /
                           * 1.14-1.44x / 0.95-1.25x, median 1.12x) */
    /* --compress-weights-only, a weight given coded only (cs_weight_t.data NULL): the rows a
     * task reads, decoded back to BF16 in its thread's buffer */
    void (*wdecode)(uint16_t *dst, const cs_wcode_t *code, int r0, int r1);
    uint16_t **wdec;      /* per thread */
    size_t *wdec_len;     /* bf16 elements */
    char path[56];        /* cpu_raw_path */
    /* the kernels chosen for this CPU at start-up (NULL: none of that kind, the generic path) */
    cs_rows_fn gemv;      /* 1..GEMV_MAX_N rows streaming the weights */
    cs_rows_fn tile;      /* the batch-invariant dot tiles */
    void (*convert)(float *dst, const cs_weight_t *w, int r0, int r1); /* widen for sgemm */
    void (*softmax)(float *x, int n);
    void (*silu_mul)(float *gate, const float *up, size_t n);
} cpu_ctx_t;

static cpu_ctx_t *ctx_of(cpu_raw_t *b) { return b->ctx; }

/* buf, or a new buffer in its place when it holds fewer than need elements of es bytes (64-byte
 * aligned; the contents are not kept); *len is what it holds */
static void *buf_reserve(void *buf, size_t *len, size_t need, size_t es) {
    if (*len >= need) return buf;
    free(buf);
    buf = cs_aligned_alloc(64, need * es);
    CS_ASSERT(buf);
    *len = need;
    return buf;
}

/* make every thread's scratch hold at least n floats (called before a parallel run) */
static void scratch_reserve(cpu_ctx_t *c, size_t n) {
    for (int t = 0; t < c->n_threads; t++)
        c->scratch[t] = buf_reserve(c->scratch[t], &c->scratch_len[t], n, sizeof(float));
}


/* ---- matmul ----
 *   n = 1, AVX-512: the GEMV streams the weights in their dtype (exact F32 arithmetic).
 *   BF16, AMX, n ≥ 2: x is split into BF16 terms and packed into tiles once (gemm_bf16.c),
 *     then one task per block of weight rows: up to CS_AMX_SMALL_N rows (batched decode,
 *     memory-bound) W tiles come straight from the weights; above (prefill) each task
 *     packs its weight block. x has 3 terms (exact; CS_AMX_TERMS=2 trades 2^-17 for speed).
 *   Otherwise n = 1 uses the GEMV, 2..TILE_MAX_N the 4x4 dot tiles of the batch-invariant
 *     kernel (weights read once per 4 rows of x, in their dtype; BF16 against x packed
 *     even/odd, cs_gemm_split_avx512/avx2, the next blocks' rows prefetched into L2), and
 *     larger n the packed FMA GEMM (or slabs widened to F32 for OpenBLAS sgemm).
 *   --batch-invariant (c->invariant): the dot tiles at every n.
 *   --precision bf16 (c->prec_bf16), BF16 weights: x is rounded to BF16 (round_input) and
 *     multiplied exactly, so every path computes the same products: AMX with one term,
 *     AVX512-BF16 (gemm_dpbf16.c) with one term for n ≥ 2, the others on the rounded x. */
struct mm_job {
    cpu_ctx_t *c;
    float *y;
    const float *x;
    int n;
    const cs_weight_t *w;
    const float *bias;
    int rows_per_task;
    int terms;            /* AMX, AVX512-BF16: BF16 terms of x */
    int tiles_per_task;   /* x packing: 16-row tiles per task (AMX), rows per task (the others) */
    cs_rows_fn tile;      /* the dot tiles' kernel (on x as it is, or packed for it) */
};

/* ---- weights kept only coded ----
 * With --compress-weights-only the model may release a matmul weight's BF16 bytes once coded
 * (cpu_raw_code_only): then cs_weight_t.data is NULL and .code holds the weight. The coded
 * kernel reads the code up to c->code_pass_max rows of x (in groups of up to
 * CS_WCODE_MAX_N: mm_gemv_task); every other path runs its own kernel on the task's rows
 * decoded back to BF16 (bit for bit) into the thread's buffer, a chunk of rows at a time (8
 * for the dot tiles: about 16-45 KiB, in L1 or L2 while x passes), each chunk a weight of
 * its own with y moved to its first row: the same kernel on the same values, so the same
 * bits as on the BF16 weights. Prefetching the next chunk's code into L2 before each chunk
 * did not measurably help (2816 x 1024 at 8 rows of x: 0.38-0.44 ms against 0.41). */
typedef void (*rows_fn)(void *job, float *y, int ldy, const cs_weight_t *w, int r0, int r1, int thread);

#define CODE_ONLY_TASK_BYTES (256u << 10) /* code a task of the grouped passes reads: stays in L2 */

static bool code_only(const cs_weight_t *w) { return !w->data && w->code; }

/* fn over rows [r0, r1) of w (y: the caller's, row 0 at column 0), in chunks of `chunk`
 * rows where w is coded only (0: the whole range at once) */
static void run_rows(cpu_ctx_t *c, const cs_weight_t *w, int thread, int r0, int r1, float *y, int chunk, rows_fn fn,
                     void *job) {
    if (!code_only(w)) { fn(job, y, w->rows, w, r0, r1, thread); return; }
    const cs_wcode_t *code = w->code;
    if (chunk <= 0) chunk = r1 - r0;
    size_t need = (size_t)chunk * (size_t)w->cols;
    /* this thread's own slot: no other task touches it */
    c->wdec[thread] = buf_reserve(c->wdec[thread], &c->wdec_len[thread], need, sizeof(uint16_t));
    for (int a = r0; a < r1; a += chunk) {
        int z = CS_MIN(a + chunk, r1);
        c->wdecode(c->wdec[thread], code, a, z);
        cs_weight_t view = {CS_DTYPE_BF16, z - a, w->cols, c->wdec[thread], NULL, NULL};
        fn(job, y + a, w->rows, &view, 0, z - a, thread);
    }
}

static void gemv_rows_fn(void *job, float *y, int ldy, const cs_weight_t *w, int r0, int r1, int thread) {
    struct mm_job *j = job;
    (void)thread;
    j->c->gemv(y, ldy, j->x, j->n, w, r0, r1);
}

static void mm_gemv_task(void *p, int task, int thread) {
    struct mm_job *j = p;
    const cs_weight_t *w = j->w;
    int r0 = task * j->rows_per_task, r1 = CS_MIN(r0 + j->rows_per_task, w->rows);
    if (j->n <= CS_WCODE_MAX_N) { /* the coded GEMV reads the code itself */
        j->c->gemv(j->y, w->rows, j->x, j->n, w, r0, r1);
    } else if (code_only(w) && j->n <= j->c->code_pass_max) {
        /* the coded kernel once per group of up to CS_WCODE_MAX_N rows of x (as even as they
         * go): the task's code, read from memory by the first group, is in L2 for the rest */
        int groups = (j->n + CS_WCODE_MAX_N - 1) / CS_WCODE_MAX_N, per = (j->n + groups - 1) / groups;
        for (int i0 = 0; i0 < j->n; i0 += per)
            j->c->gemv(j->y + (size_t)i0 * w->rows, w->rows, j->x + (size_t)i0 * w->cols, CS_MIN(per, j->n - i0), w, r0, r1);
    } else {
        run_rows(j->c, w, thread, r0, r1, j->y, 8, gemv_rows_fn, j);
    }
}

static void gemm_rows_fn(void *job, float *y, int ldy, const cs_weight_t *w, int r0, int r1, int thread) {
    struct mm_job *j = job;
    const float *wt;
    if (w->dtype == CS_DTYPE_F32) {
        wt = (const float *)w->data + (size_t)r0 * w->cols;
    } else {
        float *buf = j->c->scratch[thread];
        if (j->c->convert) j->c->convert(buf, w, r0, r1);
        else cs_to_f32(buf, (const uint16_t *)w->data + (size_t)r0 * w->cols, w->dtype, (size_t)(r1 - r0) * w->cols);
        wt = buf;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, j->n, r1 - r0, w->cols, 1.0f, j->x, w->cols, wt, w->cols,
                0.0f, y + r0, ldy);
}

/* OpenBLAS: a coded-only task decoded whole (sgemm's blocking may depend on the rows it is given) */
static void mm_gemm_task(void *p, int task, int thread) {
    struct mm_job *j = p;
    int r0 = task * j->rows_per_task, r1 = CS_MIN(r0 + j->rows_per_task, j->w->rows);
    run_rows(j->c, j->w, thread, r0, r1, j->y, 0, gemm_rows_fn, j);
}

static int packed_mr(const cpu_ctx_t *c) { return c->avx512 ? CS_PACKED_MR : CS_PACKED_MR_AVX2; }

static void packed_rows_fn(void *job, float *y, int ldy, const cs_weight_t *w, int r0, int r1, int thread) {
    struct mm_job *j = job;
    if (j->c->avx512)
        cs_gemm_packed_avx512(y, ldy, (const float *)j->c->xpack, j->n, w, r0, r1, j->c->scratch[thread]);
    else
        cs_gemm_packed_avx2(y, ldy, (const float *)j->c->xpack, j->n, w, r0, r1, j->c->scratch[thread]);
}

static void mm_packed_task(void *p, int task, int thread) {
    struct mm_job *j = p;
    int r0 = task * j->rows_per_task, r1 = CS_MIN(r0 + j->rows_per_task, j->w->rows);
    run_rows(j->c, j->w, thread, r0, r1, j->y, 0, packed_rows_fn, j);
}

static void mm_packed_x_task(void *p, int task, int thread) {
    struct mm_job *j = p;
    (void)thread;
    int mr = packed_mr(j->c), tiles = (j->n + mr - 1) / mr, t0 = task * j->tiles_per_task;
    cs_gemm_packed_pack_x((float *)j->c->xpack, j->x, j->n, j->w->cols, mr, t0, CS_MIN(tiles, t0 + j->tiles_per_task));
}

static void mm_pack_x_task(void *p, int task, int thread) {
    struct mm_job *j = p;
    (void)thread;
    int mt = (j->n + 31) / 32 * 2, t0 = task * j->tiles_per_task;
    cs_gemm_bf16_pack_x(j->c->xpack, j->x, j->n, j->w->cols, j->terms, t0, CS_MIN(mt, t0 + j->tiles_per_task));
}

static void mm_amx_task(void *p, int task, int thread) {
    struct mm_job *j = p;
    int r0 = task * j->rows_per_task, r1 = CS_MIN(r0 + j->rows_per_task, j->w->rows);
    CS_ASSERT(!code_only(j->w)); /* cpu_raw_code_only: never with AMX */
    cs_gemm_bf16_amx(j->y, j->w->rows, j->c->xpack, j->n, j->terms, j->w, r0, r1, (uint16_t *)j->c->scratch[thread]);
}

/* x rounded to BF16 into the context's buffer (--precision bf16) */
static const float *round_input(cpu_ctx_t *c, const float *x, size_t count) {
    c->xround = buf_reserve(c->xround, &c->xround_len, count, sizeof(float));
    if (c->avx512 && !c->reference) cs_round_bf16_avx512(c->xround, x, count);
    else if (c->avx2 && !c->reference) cs_round_bf16_avx2(c->xround, x, count);
    else cs_round_bf16_ref(c->xround, x, count);
    return c->xround;
}

static void xpack_reserve(cpu_ctx_t *c, size_t need) {
    c->xpack = buf_reserve(c->xpack, &c->xpack_len, need, sizeof(uint16_t));
}

static void mm_dp_pack_task(void *p, int task, int thread) {
    struct mm_job *j = p;
    (void)thread;
    int rows = cs_dpbf16_padded_rows(j->n), r0 = task * j->tiles_per_task;
    cs_dpbf16_pack_x(j->c->xpack, j->x, j->n, j->w->cols, j->terms, r0, CS_MIN(rows, r0 + j->tiles_per_task));
}

static void dp_rows_fn(void *job, float *y, int ldy, const cs_weight_t *w, int r0, int r1, int thread) {
    struct mm_job *j = job;
    cs_gemm_dpbf16(y, ldy, j->c->xpack, j->n, j->terms, w, r0, r1, (uint16_t *)j->c->scratch[thread]);
}

static void mm_dp_task(void *p, int task, int thread) {
    struct mm_job *j = p;
    int r0 = task * j->rows_per_task, r1 = CS_MIN(r0 + j->rows_per_task, j->w->rows);
    run_rows(j->c, j->w, thread, r0, r1, j->y, j->n <= CS_DP_SMALL_N ? 8 : 0, dp_rows_fn, j);
}

/* AVX512-BF16: x packed once (in parallel for many rows), then tasks over weight rows:
 * 64 rows for prefill (their packed tiles, 128 B per column, stay in L2 while x streams
 * past); for a few rows each task streams its rows' weights once, 64 rows up to 16 rows of
 * x (longer streams: 1.06-1.11x over 32 at n = 4..16 on a Zen 4), 32 above */
static int dp_rows_per_task(int n) { return n <= 16 || n > CS_DP_SMALL_N ? 64 : 32; }

static void mm_dpbf16(cpu_ctx_t *c, struct mm_job *j) {
    const cs_weight_t *w = j->w;
    int n = j->n, rows = cs_dpbf16_padded_rows(n);
    xpack_reserve(c, cs_dpbf16_xp_len(n, w->cols, j->terms));
    j->tiles_per_task = (rows + 2 * c->n_threads - 1) / (2 * c->n_threads); /* x rows per packing task */
    if (n <= CS_DP_SMALL_N) cs_dpbf16_pack_x(c->xpack, j->x, n, w->cols, j->terms, 0, rows);
    else threadpool_run(c->pool, (rows + j->tiles_per_task - 1) / j->tiles_per_task, mm_dp_pack_task, j);
    j->rows_per_task = dp_rows_per_task(n);
    scratch_reserve(c, (cs_dpbf16_wp_len(n, j->rows_per_task, w->cols) + 1) / 2 + 16);
    threadpool_run(c->pool, (w->rows + j->rows_per_task - 1) / j->rows_per_task, mm_dp_task, j);
}

static void mm_amx(cpu_ctx_t *c, struct mm_job *j) {
    const cs_weight_t *w = j->w;
    int n = j->n;
    /* memory-bound for few rows: exact always there (x in BF16 for --precision bf16) */
    j->terms = c->prec_bf16 ? 1 : n <= CS_AMX_SMALL_N ? 3 : c->amx_terms;
    xpack_reserve(c, cs_gemm_bf16_xp_len(n, w->cols, j->terms));
    int mt = (n + 31) / 32 * 2;
    j->tiles_per_task = CS_MAX(2, (mt + 2 * c->n_threads - 1) / (2 * c->n_threads));
    if (n <= CS_AMX_SMALL_N) cs_gemm_bf16_pack_x(c->xpack, j->x, n, w->cols, j->terms, 0, mt);
    else threadpool_run(c->pool, (mt + j->tiles_per_task - 1) / j->tiles_per_task, mm_pack_x_task, j);
    /* Small n streams each weight once: 128-row tasks, within which the next 32 rows are
     * prefetched. Large n reuses a task's packed weight block (at most 512 KiB, in L2)
     * across all of x. */
    int rows = 128;
    if (n > CS_AMX_SMALL_N) rows = CS_MAX(32, CS_MIN(64, (int)((512u << 10) / (2u * (unsigned)w->cols)) & ~31));
    int tasks = (w->rows + rows - 1) / rows;
    j->rows_per_task = rows;
    scratch_reserve(c, (cs_gemm_bf16_wp_len(n, rows, w->cols, j->terms) + 1) / 2);
    threadpool_run(c->pool, tasks, mm_amx_task, j);
}

static void tile_rows_fn(void *job, float *y, int ldy, const cs_weight_t *w, int r0, int r1, int thread) {
    struct mm_job *j = job;
    (void)thread;
    j->tile(y, ldy, j->x, j->n, w, r0, r1);
}

static void mm_invariant_task(void *p, int task, int thread) {
    struct mm_job *j = p;
    int r0 = task * j->rows_per_task, r1 = CS_MIN(r0 + j->rows_per_task, j->w->rows);
    run_rows(j->c, j->w, thread, r0, r1, j->y, 8, tile_rows_fn, j);
}

static void split_pack_task(void *p, int task, int thread) {
    struct mm_job *j = p;
    (void)thread;
    int i0 = task * j->tiles_per_task;
    j->c->split_pack((float *)j->c->xpack, j->x, j->n, j->w->cols, i0, CS_MIN(j->n, i0 + j->tiles_per_task));
}

/* the dot tiles' kernel for n rows of *x against weights of dtype dt and K columns: BF16
 * packs x even/odd into c->xpack (in the pool when there are many rows: the
 * batch-invariant prefill) and points *x at it */
static cs_rows_fn tile_kernel(cpu_ctx_t *c, const float **x, int n, int K, cs_dtype dt) {
    if (!c->split || dt != CS_DTYPE_BF16) return c->tile;
    xpack_reserve(c, 2 * cs_split_xs_len(n, K)); /* in bf16 units */
    if (n < 64) {
        c->split_pack((float *)c->xpack, *x, n, K, 0, n);
    } else {
        cs_weight_t shape = {CS_DTYPE_BF16, 0, K, NULL, NULL, NULL};
        struct mm_job pj = {c, NULL, *x, n, &shape, NULL, 0, 0, (n + 2 * c->n_threads - 1) / (2 * c->n_threads), NULL};
        threadpool_run(c->pool, (n + pj.tiles_per_task - 1) / pj.tiles_per_task, split_pack_task, &pj);
    }
    *x = (const float *)c->xpack;
    return c->split;
}

/* weight rows per task of the batch-invariant GEMM: about four tasks per thread, whole
 * 16-row blocks */
static int invariant_rows_per_task(const cpu_ctx_t *c, int rows) {
    int per = (rows + 4 * c->n_threads - 1) / (4 * c->n_threads);
    return CS_MAX(16, (per + 15) & ~15);
}

/* the dot tiles: always when batch-invariant, else for a few rows the AMX path does not take
 * (and coded weights, --compress-weights, do not: up to c->wcode_max_n rows read the code
 * through the GEMV) */
static bool use_tile(const cpu_ctx_t *c, const cs_weight_t *w, int n) {
    if (!c->tile || c->reference) return false;
    if (c->invariant) return true;
    if (w->code && n <= (code_only(w) ? c->code_pass_max : c->wcode_max_n)) return false;
    if (w->dtype == CS_DTYPE_BF16 && c->amx && n >= AMX_MIN_N) return false;
    return !c->no_tile && n >= 2 && n <= TILE_MAX_N;
}

/* the GEMV kernels over w's rows, a few rows per task (j: y, x, n, w) */
static void gemv_run(cpu_ctx_t *c, struct mm_job *j) {
    int tasks = c->n_threads * 8;
    j->rows_per_task = CS_MAX(4, (j->w->rows + tasks - 1) / tasks);
    if (code_only(j->w) && j->n > CS_WCODE_MAX_N) {
        size_t rb = (size_t)j->w->code->blocks * CS_WCODE_BLOCK_BYTES;
        j->rows_per_task = CS_MIN(j->rows_per_task, CS_MAX(4, (int)(CODE_ONLY_TASK_BYTES / rb)));
    }
    j->rows_per_task = (j->rows_per_task + 3) & ~3;
    threadpool_run(c->pool, (j->w->rows + j->rows_per_task - 1) / j->rows_per_task, mm_gemv_task, j);
}

/* y[i, r] += bias[r] for n rows of `rows` outputs (bias NULL: nothing) */
static void add_bias(float *y, int n, int rows, const float *bias) {
    if (bias)
        for (int i = 0; i < n; i++)
            for (int r = 0; r < rows; r++) y[(size_t)i * rows + r] += bias[r];
}

/* ---- block-quantized weights (GGUF's Q4_0 .. Q6_K) ----
 * Up to CS_QGEMV_MAX_N rows of x (and every n when batch-invariant: a fixed sequence per
 * output) the quantized GEMV streams the packed blocks; more rows dequantize each task's
 * weight rows to F32 in the thread's buffer for the packed FMA GEMM (or sgemm). The
 * reference kernels sum each dequantized row in double (cs_matmul_ref). */
struct qmm_job {
    cpu_ctx_t *c;
    float *y;
    const float *x;
    int n;
    const cs_weight_t *w;
    int rows_per_task;
};

/* --precision int8: x quantized once (c->xq) for up to QMM_INT8_MAX weights of one block size,
 * their row blocks in one pool dispatch (a layer's q/k/v, gate/up); rows of x in groups of up
 * to CS_QGEMV_MAX_N against the task's weight rows, which stay in cache from the first group on */
#define QMM_INT8_MAX 4
struct qmm_int8_job {
    cpu_ctx_t *c;
    float *const *ys;
    const cs_weight_t *const *ws;
    int n, count;
    int task0[QMM_INT8_MAX + 1], rows_per_task[QMM_INT8_MAX];
};

/* Q6_K weights at more rows of x than one kernel call takes: the values unpacked once per
 * task (cs_qpack_q6k_unpack), the VNNI kernel reading them for every group of rows. The
 * Q6_K kernel spends about as many instructions assembling the six bits from their two
 * planes as multiplying them; at a prefill's 128 groups of 4 rows that was done 128 times. */
static bool q6_unpacks(const cs_weight_t *w, int n) { return w->dtype == CS_DTYPE_Q6_K && n > CS_QGEMV_MAX_N; }

static void qmm_int8_task(void *p, int task, int thread) {
    struct qmm_int8_job *j = p;
    cpu_ctx_t *c = j->c;
    int k = 0;
    while (task >= j->task0[k + 1]) k++;
    const cs_weight_t *w = j->ws[k];
    float *y = j->ys[k];
    int r0 = (task - j->task0[k]) * j->rows_per_task[k], r1 = CS_MIN(r0 + j->rows_per_task[k], w->rows), g = w->cols / 32;
    int nd = w->cols / cs_quant_act_block(w->dtype);
    bool packed = c->qpack && w->pack; /* the kernels on the pack, or the AVX2 ones on the blocks */
    /* Q6_K at many rows: the task's six-bit values unpacked once for all the groups of x */
    uint8_t *u = NULL;
    if (packed && c->vnni && q6_unpacks(w, j->n)) {
        u = (uint8_t *)c->scratch[thread];
        cs_qpack_q6k_unpack(u, w->pack, r0, r1);
    }
    for (int i0 = 0; i0 < j->n; i0 += CS_QGEMV_MAX_N) {
        int m = CS_MIN(CS_QGEMV_MAX_N, j->n - i0);
        const int8_t *q = c->xq + (size_t)i0 * w->cols;
        const float *d = c->xq_d + (size_t)i0 * nd, *sm = c->xq_s + (size_t)i0 * g;
        /* Q5_K at one row: the AVX2 kernel, whose fewer steps per byte read memory faster
         * (batch-1 decode of a Q5_K_M file, Zen 4, 2 threads: 147-187 tok/s against the VNNI
         * kernel's 136-158, alternating); the two give the same bits */
        if (u)
            cs_qgemv_int8_vnni_q6u(y + (size_t)i0 * w->rows, w->rows, q, d, c->xq_s16 + (size_t)i0 * (w->cols / 16), m,
                                   w->pack, r0, r1, u);
        else if (packed && c->vnni && !(w->dtype == CS_DTYPE_Q5_K && m == 1))
            cs_qgemv_int8_vnni(y + (size_t)i0 * w->rows, w->rows, q, d, sm, c->xq_s16 + (size_t)i0 * (w->cols / 16), m,
                               w->pack, r0, r1);
        else if (packed)
            cs_qgemv_int8_pack_avx2(y + (size_t)i0 * w->rows, w->rows, q, d, sm, c->xq_s16 + (size_t)i0 * (w->cols / 16), m,
                                    w->pack, r0, r1);
        else if (c->avx2) cs_qgemv_int8_avx2(y + (size_t)i0 * w->rows, w->rows, q, d, sm, m, w, r0, r1);
        else cs_qgemv_int8_ref(y + (size_t)i0 * w->rows, w->rows, q, d, sm, m, w, r0, r1);
    }
}

/* ws[0..count) quantized, of one activation block size and one cols */
static void cpu_matmul_int8_multi(cpu_ctx_t *c, float *const *ys, const float *x, int n, const cs_weight_t *const *ws,
                                  const float *const *biases, int count) {
    CS_ASSERT(count >= 1 && count <= QMM_INT8_MAX);
    const int cols = ws[0]->cols, blk = cs_quant_act_block(ws[0]->dtype);
    size_t need = (size_t)n * cols;
    if (c->xq_len < need) {
        free(c->xq); free(c->xq_d); free(c->xq_s); free(c->xq_s16);
        c->xq = cs_aligned_alloc(64, need);
        c->xq_d = malloc(sizeof(float) * (need / 32));
        c->xq_s = malloc(sizeof(float) * (need / 32));
        c->xq_s16 = malloc(sizeof(int32_t) * (need / 16));
        CS_ASSERT(c->xq && c->xq_d && c->xq_s && c->xq_s16);
        c->xq_len = need;
    }
    if (c->avx2 && !c->reference) cs_quantize_act_avx2(c->xq, c->xq_d, c->xq_s, x, (int64_t)need, blk);
    else cs_quantize_act_ref(c->xq, c->xq_d, c->xq_s, x, (int64_t)need, blk);
    if (c->reference) { /* the definition: the exact matmul on x̂ */
        float *xh = malloc(sizeof(float) * need);
        CS_ASSERT(xh);
        for (size_t i = 0; i < need; i++) xh[i] = c->xq_d[i / (size_t)blk] * (float)c->xq[i];
        for (int k = 0; k < count; k++) cs_matmul_ref(ys[k], xh, n, ws[k], biases[k]);
        free(xh);
        return;
    }
    struct qmm_int8_job j = {c, ys, ws, n, count, {0}, {0}};
    int tasks = c->n_threads * 8;
    bool s16 = false;
    size_t unpacked = 0; /* bytes of a task's Q6_K values unpacked (q6_unpacks) */
    for (int k = 0; k < count; k++) {
        const cs_weight_t *w = ws[k];
        int rpt = CS_MAX(4, (w->rows + tasks - 1) / tasks);
        if (n > CS_QGEMV_MAX_N) rpt = CS_MIN(rpt, 16); /* cached across the groups of x */
        if (c->qpack && w->pack) { /* whole groups of CS_QPACK_ROWS */
            rpt = (rpt + CS_QPACK_ROWS - 1) / CS_QPACK_ROWS * CS_QPACK_ROWS;
            s16 |= w->dtype == CS_DTYPE_Q6_K;
            if (c->vnni && q6_unpacks(w, n))
                unpacked = CS_MAX(unpacked, (size_t)(rpt / CS_QPACK_ROWS) * cs_qpack_q6k_unpacked_bytes(w->pack));
        }
        j.rows_per_task[k] = rpt;
        j.task0[k + 1] = j.task0[k] + (w->rows + rpt - 1) / rpt;
    }
    if (s16) cs_act_sums16(c->xq_s16, c->xq, (int64_t)need);
    if (unpacked) scratch_reserve(c, (unpacked + sizeof(float) - 1) / sizeof(float));
    threadpool_run(c->pool, j.task0[count], qmm_int8_task, &j);
    for (int k = 0; k < count; k++) add_bias(ys[k], n, ws[k]->rows, biases[k]);
}

static void cpu_matmul_int8(cpu_ctx_t *c, float *y, const float *x, int n, const cs_weight_t *w, const float *bias) {
    cpu_matmul_int8_multi(c, &y, x, n, &w, &bias, 1);
}

/* --precision int8 applies to w at n rows (see cpu_matmul_quant) */
static bool int8_applies(const cpu_ctx_t *c, const cs_weight_t *w, int n) {
    return c->prec_int8 && cs_dtype_is_quant(w->dtype) &&
           (n <= CPU_QINT8_MAX_N || c->invariant || (c->qpack && w->pack));
}

static void qmm_gemv_task(void *p, int task, int thread) {
    struct qmm_job *j = p;
    const cs_weight_t *w = j->w;
    (void)thread;
    int r0 = task * j->rows_per_task, r1 = CS_MIN(r0 + j->rows_per_task, w->rows);
    for (int i0 = 0; i0 < j->n; i0 += CS_QGEMV_MAX_N) {
        int m = CS_MIN(CS_QGEMV_MAX_N, j->n - i0);
        if (j->c->avx2) cs_qgemv_rows_avx2(j->y + (size_t)i0 * w->rows, w->rows, j->x + (size_t)i0 * w->cols, m, w, r0, r1);
        else cs_qgemv_rows_ref(j->y + (size_t)i0 * w->rows, w->rows, j->x + (size_t)i0 * w->cols, m, w, r0, r1);
    }
}

static void qmm_gemm_task(void *p, int task, int thread) {
    struct qmm_job *j = p;
    cpu_ctx_t *c = j->c;
    const cs_weight_t *w = j->w;
    int r0 = task * j->rows_per_task, r1 = CS_MIN(r0 + j->rows_per_task, w->rows);
    /* the rows dequantized into the thread's wdec buffer (counted in bf16 units: 2 per float) */
    float *wf = (float *)c->wdec[thread];
    if (c->avx2) cs_qdequant_rows_avx2(wf, w, r0, r1);
    else cs_qdequant_rows_ref(wf, w, r0, r1);
    cs_weight_t view = {CS_DTYPE_F32, r1 - r0, w->cols, wf, NULL, NULL};
    if (c->packed && c->avx512)
        cs_gemm_packed_avx512(j->y + r0, w->rows, (const float *)c->xpack, j->n, &view, 0, r1 - r0, c->scratch[thread]);
    else if (c->packed)
        cs_gemm_packed_avx2(j->y + r0, w->rows, (const float *)c->xpack, j->n, &view, 0, r1 - r0, c->scratch[thread]);
    else
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, j->n, r1 - r0, w->cols, 1.0f, j->x, w->cols, wf, w->cols,
                    0.0f, j->y + r0, w->rows);
}

static void qmm_pack_x_task(void *p, int task, int thread) {
    struct qmm_job *j = p;
    (void)thread;
    int mr = packed_mr(j->c), tiles = (j->n + mr - 1) / mr, t0 = task * j->rows_per_task;
    cs_gemm_packed_pack_x((float *)j->c->xpack, j->x, j->n, j->w->cols, mr, t0, CS_MIN(tiles, t0 + j->rows_per_task));
}

static void cpu_matmul_quant(cpu_ctx_t *c, float *y, const float *x, int n, const cs_weight_t *w, const float *bias) {
    CS_ASSERT(w->cols % cs_dtype_block(w->dtype) == 0);
    /* --precision int8 up to CPU_QINT8_MAX_N rows (decode). On a repacked weight (Q8_0, Q4_K,
     * Q6_K), or batch-invariant: int8 at every n. Prefill on the packs, Zen 4, 2 threads, 512
     * tokens: AVX512-VNNI 2.4x the dequantized F32 GEMM (Q8_0, one thread); the AVX2 kernels
     * 1.43x (Q4_K_M), 1.1x (Q8_0), 1.0x (Q6_K). Other quantized types' prefill multiplies the
     * dequantized weights in F32 below, which the packed FMA GEMM does faster than the
     * unpacked int8 GEMV in groups of 4 rows (0.58-0.69x llama.cpp's int8 prefill, 0.88-1.09x
     * dequantized, Zen 4 AVX2 path). */
    if (int8_applies(c, w, n)) {
        cpu_matmul_int8(c, y, x, n, w, bias);
        return;
    }
    if (c->prec_bf16) x = round_input(c, x, (size_t)n * w->cols);
    if (c->reference) { cs_matmul_ref(y, x, n, w, bias); return; }
    struct qmm_job j = {c, y, x, n, w, 0};
    if (n <= CS_QGEMV_MAX_N || c->invariant) {
        int tasks = c->n_threads * 8;
        j.rows_per_task = CS_MAX(4, (w->rows + tasks - 1) / tasks);
        threadpool_run(c->pool, (w->rows + j.rows_per_task - 1) / j.rows_per_task, qmm_gemv_task, &j);
    } else {
        if (c->packed) {
            int mr = packed_mr(c), tiles = (n + mr - 1) / mr;
            xpack_reserve(c, 2 * cs_gemm_packed_xp_len(n, w->cols, mr)); /* in bf16 units */
            j.rows_per_task = (tiles + c->n_threads - 1) / c->n_threads; /* tiles per task here */
            threadpool_run(c->pool, (tiles + j.rows_per_task - 1) / j.rows_per_task, qmm_pack_x_task, &j);
            scratch_reserve(c, cs_gemm_packed_wp_len(PACKED_ROWS, w->cols));
        }
        j.rows_per_task = PACKED_ROWS;
        for (int t = 0; t < c->n_threads; t++) /* PACKED_ROWS rows of F32, in bf16 units */
            c->wdec[t] = buf_reserve(c->wdec[t], &c->wdec_len[t], 2 * (size_t)PACKED_ROWS * w->cols, sizeof(uint16_t));
        threadpool_run(c->pool, (w->rows + PACKED_ROWS - 1) / PACKED_ROWS, qmm_gemm_task, &j);
    }
    add_bias(y, n, w->rows, bias);
}

static void cpu_matmul(cpu_raw_t *b, float *y, const float *x, int n, const cs_weight_t *w, const float *bias) {
    cpu_ctx_t *c = ctx_of(b);
    if (cs_dtype_is_quant(w->dtype)) { cpu_matmul_quant(c, y, x, n, w, bias); return; }
    bool bf16x = c->prec_bf16 && w->dtype == CS_DTYPE_BF16;
    bool passes = code_only(w) && n <= c->code_pass_max;
    /* the BF16 kernels round x themselves as they pack it; the others take it rounded */
    bool packs = bf16x && !c->reference && !c->invariant && n >= 2 && (c->amx || c->dpbf16) && !passes;
    if (bf16x && !packs) x = round_input(c, x, (size_t)n * w->cols);
    if (c->reference || (c->invariant && !c->tile)) { cs_matmul_ref(y, x, n, w, bias); return; }
    struct mm_job j = {c, y, x, n, w, bias, 0, 0, 0, NULL};
    if (passes) {
        /* coded only, few rows: the coded kernel in groups of rows of x (mm_gemv_task), on
         * tasks of at most CODE_ONLY_TASK_BYTES of code */
        gemv_run(c, &j);
    } else if (packs && !c->amx) {
        j.terms = 1;
        mm_dpbf16(c, &j);
    } else if (use_tile(c, w, n)) {
        j.tile = tile_kernel(c, &j.x, n, w->cols, w->dtype);
        j.rows_per_task = invariant_rows_per_task(c, w->rows);
        threadpool_run(c->pool, (w->rows + j.rows_per_task - 1) / j.rows_per_task, mm_invariant_task, &j);
    } else if (w->dtype == CS_DTYPE_BF16 && c->amx && n >= AMX_MIN_N) {
        mm_amx(c, &j);
    } else if (n <= GEMV_MAX_N && c->gemv) {
        gemv_run(c, &j);
    } else if (c->packed) {
        int tiles = (n + packed_mr(c) - 1) / packed_mr(c);
        xpack_reserve(c, 2 * cs_gemm_packed_xp_len(n, w->cols, packed_mr(c))); /* in bf16 units */
        j.tiles_per_task = (tiles + c->n_threads - 1) / c->n_threads;
        threadpool_run(c->pool, (tiles + j.tiles_per_task - 1) / j.tiles_per_task, mm_packed_x_task, &j);
        j.rows_per_task = PACKED_ROWS;
        scratch_reserve(c, cs_gemm_packed_wp_len(PACKED_ROWS, w->cols));
        threadpool_run(c->pool, (w->rows + PACKED_ROWS - 1) / PACKED_ROWS, mm_packed_task, &j);
    } else {
        /* Few large slabs: every sgemm call packs all of x again, so many small tiles would
         * spend their time packing. Two slabs per thread keep uneven cores balanced. */
        int cap = (int)(SLAB_BYTES / (sizeof(float) * (size_t)w->cols));
        cap = CS_MAX(16, cap & ~15);
        int per = (w->rows + 2 * c->n_threads - 1) / (2 * c->n_threads);
        j.rows_per_task = CS_MAX(16, CS_MIN(cap, (per + 15) & ~15));
        if (w->dtype != CS_DTYPE_F32) scratch_reserve(c, (size_t)j.rows_per_task * w->cols);
        threadpool_run(c->pool, (w->rows + j.rows_per_task - 1) / j.rows_per_task, mm_gemm_task, &j);
    }
    add_bias(y, n, w->rows, bias);
}

/* several weights of one input in one pool dispatch (the decode GEMV path only: one wake-up
 * of the workers instead of one per projection) */
#define MM_MULTI_MAX 4
struct mm_multi_job {
    cpu_ctx_t *c;
    cs_rows_fn fn;        /* the dot tiles or the GEMV */
    bool gemv;
    float *const *ys;
    const float *x;
    int n, count;
    const cs_weight_t *const *ws;
    int task0[MM_MULTI_MAX + 1], rows_per_task[MM_MULTI_MAX];
};

static void multi_rows_fn(void *job, float *y, int ldy, const cs_weight_t *w, int r0, int r1, int thread) {
    struct mm_multi_job *j = job;
    (void)thread;
    j->fn(y, ldy, j->x, j->n, w, r0, r1);
}

static void mm_multi_task(void *p, int task, int thread) {
    struct mm_multi_job *j = p;
    int k = 0;
    while (task >= j->task0[k + 1]) k++;
    const cs_weight_t *w = j->ws[k];
    int r0 = (task - j->task0[k]) * j->rows_per_task[k], r1 = CS_MIN(r0 + j->rows_per_task[k], w->rows);
    /* the GEMV reads coded weights itself up to CS_WCODE_MAX_N rows of x */
    if (j->gemv && j->n <= CS_WCODE_MAX_N) j->fn(j->ys[k], w->rows, j->x, j->n, w, r0, r1);
    else run_rows(j->c, w, thread, r0, r1, j->ys[k], 8, multi_rows_fn, j);
}

static void add_biases(float *const *ys, int n, const cs_weight_t *const *ws, const float *const *biases, int count) {
    for (int k = 0; k < count; k++)
        if (biases[k])
            for (int i = 0; i < n; i++)
                for (int r = 0; r < ws[k]->rows; r++) ys[k][(size_t)i * ws[k]->rows + r] += biases[k][r];
}

/* --precision bf16, AVX512-BF16, a few rows (batched decode): x packed once for all the
 * weights, then their row blocks in one pool dispatch */
struct mm_dp_multi_job {
    cpu_ctx_t *c;
    float *const *ys;
    int n, count, rows_per_task;
    const cs_weight_t *const *ws;
    int task0[MM_MULTI_MAX + 1];
};

static void dp_multi_rows_fn(void *job, float *y, int ldy, const cs_weight_t *w, int r0, int r1, int thread) {
    struct mm_dp_multi_job *j = job;
    cs_gemm_dpbf16(y, ldy, j->c->xpack, j->n, 1, w, r0, r1, (uint16_t *)j->c->scratch[thread]);
}

static void mm_dp_multi_task(void *p, int task, int thread) {
    struct mm_dp_multi_job *j = p;
    int k = 0;
    while (task >= j->task0[k + 1]) k++;
    const cs_weight_t *w = j->ws[k];
    int r0 = (task - j->task0[k]) * j->rows_per_task, r1 = CS_MIN(r0 + j->rows_per_task, w->rows);
    run_rows(j->c, w, thread, r0, r1, j->ys[k], 8, dp_multi_rows_fn, j);
}

static void mm_dp_multi(cpu_ctx_t *c, float *const *ys, const float *x, int n, const cs_weight_t *const *ws,
                        int count) {
    int K = ws[0]->cols;
    struct mm_dp_multi_job j = {c, ys, n, count, dp_rows_per_task(n), ws, {0}};
    xpack_reserve(c, cs_dpbf16_xp_len(n, K, 1));
    cs_dpbf16_pack_x(c->xpack, x, n, K, 1, 0, cs_dpbf16_padded_rows(n));
    scratch_reserve(c, (cs_dpbf16_wp_len(n, j.rows_per_task, K) + 1) / 2 + 16);
    for (int k = 0; k < count; k++) j.task0[k + 1] = j.task0[k] + (ws[k]->rows + j.rows_per_task - 1) / j.rows_per_task;
    threadpool_run(c->pool, j.task0[count], mm_dp_multi_task, &j);
}

static void cpu_matmul_multi(cpu_raw_t *b, float *const *ys, const float *x, int n, const cs_weight_t *const *ws,
                             const float *const *biases, int count) {
    cpu_ctx_t *c = ctx_of(b);
    const float *x_in = x; /* the caller's x: cpu_matmul rounds it again into c->xround */
    bool quant = false;
    for (int k = 0; k < count; k++) quant |= cs_dtype_is_quant(ws[k]->dtype);
    if (quant) { /* int8 on all, one block size: x quantized once, one dispatch */
        bool one = count <= QMM_INT8_MAX;
        for (int k = 0; k < count && one; k++)
            one = int8_applies(c, ws[k], n) && ws[k]->cols == ws[0]->cols &&
                  cs_quant_act_block(ws[k]->dtype) == cs_quant_act_block(ws[0]->dtype);
        if (one) {
            cpu_matmul_int8_multi(c, ys, x_in, n, ws, biases, count);
            return;
        }
        for (int k = 0; k < count; k++) cpu_matmul(b, ys[k], x_in, n, ws[k], biases[k]);
        return;
    }
    bool passes = false;  /* a weight kept only coded, read in groups of rows of x: one at a time */
    for (int k = 0; k < count; k++) passes |= code_only(ws[k]) && n <= c->code_pass_max;
    if (passes && n > CS_WCODE_MAX_N) {
        for (int k = 0; k < count; k++) cpu_matmul(b, ys[k], x_in, n, ws[k], biases[k]);
        return;
    }
    if (c->prec_bf16) { /* rounded once for all (all BF16, n = 1), or one matmul at a time */
        int nb = 0;
        for (int k = 0; k < count; k++) nb += ws[k]->dtype == CS_DTYPE_BF16;
        if (nb == count && n >= 2 && n <= CS_DP_SMALL_N && count <= MM_MULTI_MAX && c->dpbf16 && !c->amx &&
            !c->reference && !c->invariant && !passes) {
            mm_dp_multi(c, ys, x, n, ws, count);
            add_biases(ys, n, ws, biases, count);
            return;
        }
        if (nb && (nb < count || n >= 2 || c->reference || c->invariant)) {
            for (int k = 0; k < count; k++) cpu_matmul(b, ys[k], x, n, ws[k], biases[k]);
            return;
        }
        if (nb) x = round_input(c, x, (size_t)n * ws[0]->cols);
    }
    bool tile = count <= MM_MULTI_MAX;
    for (int k = 0; k < count && tile; k++) tile = use_tile(c, ws[k], n);
    bool gemv = !tile && !c->reference && c->gemv && n <= GEMV_MAX_N && count <= MM_MULTI_MAX;
    for (int k = 0; k < count && gemv; k++) gemv = !(ws[k]->dtype == CS_DTYPE_BF16 && c->amx && n >= AMX_MIN_N);
    if (!gemv && !tile) {
        for (int k = 0; k < count; k++) cpu_matmul(b, ys[k], x_in, n, ws[k], biases[k]);
        return;
    }
    struct mm_multi_job j = {c, tile ? c->tile : c->gemv, !tile, ys, x, n, count, ws, {0}, {0}};
    if (tile) { /* BF16 weights take the split tiles, the others not: mixed, one at a time */
        int nb = 0;
        for (int k = 0; k < count; k++) nb += ws[k]->dtype == CS_DTYPE_BF16;
        if (c->split && nb && nb < count) {
            for (int k = 0; k < count; k++) cpu_matmul(b, ys[k], x_in, n, ws[k], biases[k]);
            return;
        }
        if (nb == count) j.fn = tile_kernel(c, &j.x, n, ws[0]->cols, CS_DTYPE_BF16);
    }
    int total_rows = 0;
    for (int k = 0; k < count; k++) total_rows += ws[k]->rows;
    int per;
    if (tile) {
        per = invariant_rows_per_task(c, total_rows);
    } else {
        per = CS_MAX(4, (total_rows + c->n_threads * 8 - 1) / (c->n_threads * 8));
        per = (per + 3) & ~3;
    }
    for (int k = 0; k < count; k++) {
        j.rows_per_task[k] = per;
        j.task0[k + 1] = j.task0[k] + (ws[k]->rows + per - 1) / per;
    }
    threadpool_run(c->pool, j.task0[count], mm_multi_task, &j);
    add_biases(ys, n, ws, biases, count);
}

/* ---- rmsnorm ---- */
struct norm_job { float *y; const float *x; int dim; const float *w; float eps; int per; int n; };

static void norm_task(void *p, int task, int thread) {
    struct norm_job *j = p;
    (void)thread;
    int i0 = task * j->per, i1 = CS_MIN(i0 + j->per, j->n);
    cs_rmsnorm_ref(j->y + (size_t)i0 * j->dim, j->x + (size_t)i0 * j->dim, i1 - i0, j->dim, j->w, j->eps);
}

static void cpu_rmsnorm(cpu_raw_t *b, float *y, const float *x, int n, int dim, const cs_weight_t *w, float eps) {
    cpu_ctx_t *c = ctx_of(b);
    CS_ASSERT(w->dtype == CS_DTYPE_F32 && w->rows * w->cols == dim);
    if (c->reference || (size_t)n * dim < 16384) { cs_rmsnorm_ref(y, x, n, dim, w->data, eps); return; }
    struct norm_job j = {y, x, dim, w->data, eps, (n + c->n_threads - 1) / c->n_threads, n};
    threadpool_run(c->pool, (n + j.per - 1) / j.per, norm_task, &j);
}

/* ---- rope ---- */
static void cpu_rope(cpu_raw_t *b, float *x, int n, int nh, int hd, const int32_t *pos, const float *inv_freq) {
    (void)b;
    int half = hd / 2;
    float cs[512], sn[512];
    CS_ASSERT(half <= 512);
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < half; j++) {
            float f = (float)pos[i] * inv_freq[j];
            cs[j] = cosf(f);
            sn[j] = sinf(f);
        }
        for (int h = 0; h < nh; h++) {
            float *v = x + ((size_t)i * nh + h) * hd;
            for (int j = 0; j < half; j++) {
                float a = v[j], bb = v[j + half];
                v[j] = a * cs[j] - bb * sn[j];
                v[j + half] = bb * cs[j] + a * sn[j];
            }
        }
    }
}

/* ---- attention ---- */
/* exp of 16 lanes: Cephes' expf polynomial on the reduced argument, scaled by 2^n
 * (max relative error ~2 ulp; exp of anything below -87.3 is 0) */
__attribute__((target("avx512f"))) static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.33654f));
    x = _mm512_min_ps(x, _mm512_set1_ps(88.72283f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3333300175E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* x[0..n) = softmax(x) in place (n >= 1) */
__attribute__((target("avx512f"))) static void softmax_avx512(float *x, int n) {
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 16 <= n; i += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(x + i));
    __mmask16 tail = (__mmask16)((1u << (n - i)) - 1);
    if (i < n) vmax = _mm512_mask_max_ps(vmax, tail, vmax, _mm512_maskz_loadu_ps(tail, x + i));
    __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 vsum = _mm512_setzero_ps();
    for (i = 0; i + 16 <= n; i += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), mx));
        _mm512_storeu_ps(x + i, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    if (i < n) {
        __m512 e = _mm512_maskz_mov_ps(tail, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, x + i), mx)));
        _mm512_mask_storeu_ps(x + i, tail, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vsum));
    for (i = 0; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), inv));
    if (i < n) _mm512_mask_storeu_ps(x + i, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, x + i), inv));
}

struct attn_job {
    cpu_ctx_t *c;
    float *out;
    const float *q, *k, *v;
    int n, pos0, nh, nkv, hd, window;
};

/* Decode (few queries): one task per (query, head); scores = K·q and out = Vᵀ·p are two
 * strided matrix-vector products over the visible keys. */
static void attn_task(void *p, int task, int thread) {
    struct attn_job *j = p;
    int h = task % j->nh, i = task / j->nh;   /* task = (query, head) */
    int group = j->nh / j->nkv, kvh = h / group, kv_dim = j->nkv * j->hd;
    float scale = 1.0f / sqrtf((float)j->hd);
    float *s = j->c->scratch[thread];
    int qpos = j->pos0 + i;
    int first = j->window > 0 && qpos - j->window + 1 > 0 ? qpos - j->window + 1 : 0;
    int L = qpos - first + 1;
    const float *qh = j->q + ((size_t)i * j->nh + h) * j->hd;
    cblas_sgemv(CblasRowMajor, CblasNoTrans, L, j->hd, scale, j->k + (size_t)first * kv_dim + kvh * j->hd, kv_dim, qh,
                1, 0.0f, s, 1);
    j->c->softmax(s, L);
    float *oh = j->out + ((size_t)i * j->nh + h) * j->hd;
    cblas_sgemv(CblasRowMajor, CblasTrans, L, j->hd, 1.0f, j->v + (size_t)first * kv_dim + kvh * j->hd, kv_dim, s, 1,
                0.0f, oh, 1);
}

/* Prefill: one task per (head, block of queries). S = Q·Kᵀ over the keys the block can
 * see, masked (causal, window) softmax per row, then O = P·V; both products are sgemm. */
static void attn_gemm_task(void *p, int task, int thread) {
    struct attn_job *j = p;
    int nblk = (j->n + ATTN_QBLOCK - 1) / ATTN_QBLOCK;
    int h = task / nblk, blk = task % nblk;
    int i0 = blk * ATTN_QBLOCK, m = CS_MIN(ATTN_QBLOCK, j->n - i0);
    int group = j->nh / j->nkv, kvh = h / group, kv_dim = j->nkv * j->hd, q_dim = j->nh * j->hd;
    int last = j->pos0 + i0 + m - 1;                 /* newest key any query here sees */
    int first = 0;
    if (j->window > 0) first = CS_MAX(0, j->pos0 + i0 - j->window + 1);
    int L = last - first + 1;
    float scale = 1.0f / sqrtf((float)j->hd);
    float *s = j->c->scratch[thread];                /* (m, L) */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, L, j->hd, scale, j->q + (size_t)i0 * q_dim + h * j->hd,
                q_dim, j->k + (size_t)first * kv_dim + kvh * j->hd, kv_dim, 0.0f, s, L);
    for (int r = 0; r < m; r++) {
        float *row = s + (size_t)r * L;
        int qpos = j->pos0 + i0 + r;
        int lo = j->window > 0 ? CS_MAX(first, qpos - j->window + 1) : first; /* visible keys [lo, qpos] */
        for (int t = first; t < lo; t++) row[t - first] = 0.0f;
        for (int t = qpos + 1; t <= last; t++) row[t - first] = 0.0f;
        j->c->softmax(row + (lo - first), qpos - lo + 1);
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, j->hd, L, 1.0f, s, L,
                j->v + (size_t)first * kv_dim + kvh * j->hd, kv_dim, 0.0f, j->out + (size_t)i0 * q_dim + h * j->hd, q_dim);
}

static void cpu_attention(cpu_raw_t *b, float *out, const float *q, const float *k, const float *v, int n, int pos0,
                          int nh, int nkv, int hd, int window) {
    cpu_ctx_t *c = ctx_of(b);
    if (c->reference || c->invariant) {
        cs_attention_ref(out, q, k, v, n, pos0, nh, nkv, hd, window);
        return;
    }
    struct attn_job j = {c, out, q, k, v, n, pos0, nh, nkv, hd, window};
    if (n >= 16) {
        scratch_reserve(c, (size_t)ATTN_QBLOCK * (size_t)(pos0 + n));
        threadpool_run(c->pool, nh * ((n + ATTN_QBLOCK - 1) / ATTN_QBLOCK), attn_gemm_task, &j);
    } else {
        scratch_reserve(c, (size_t)(pos0 + n));
        threadpool_run(c->pool, n * nh, attn_task, &j);
    }
}

/* ---- elementwise ---- */
struct ew_job { cpu_ctx_t *c; float *g; const float *u; size_t n, per; };

static void silu_task(void *p, int task, int thread) {
    struct ew_job *j = p;
    (void)thread;
    size_t i0 = (size_t)task * j->per, i1 = CS_MIN(i0 + j->per, j->n);
    j->c->silu_mul(j->g + i0, j->u + i0, i1 - i0);
}

static void cpu_silu_mul(cpu_raw_t *b, float *g, const float *u, size_t n) {
    cpu_ctx_t *c = ctx_of(b);
    if (c->reference) { cs_silu_mul_ref(g, u, n); return; }
    if (n < 16384) { c->silu_mul(g, u, n); return; }
    struct ew_job j = {c, g, u, n, (n + c->n_threads - 1) / c->n_threads};
    threadpool_run(c->pool, (int)((n + j.per - 1) / j.per), silu_task, &j);
}

static void cpu_add(cpu_raw_t *b, float *y, const float *x, size_t n) {
    (void)b;
    for (size_t i = 0; i < n; i++) y[i] += x[i];
}

/* ---- LoRA: two small GEMMs per token chunk ---- */
static void cpu_lora_batch(cpu_raw_t *b, float *y, const float *x, const cpu_lora_seg_t *segs, int n_segs, int d_in,
                           int d_out);
struct lora_job {
    cpu_ctx_t *c;
    float *y;
    const float *x, *a, *bm;
    int n, rank, d_in, d_out, per;
    float scale;
};

static void lora_task(void *p, int task, int thread) {
    struct lora_job *j = p;
    int i0 = task * j->per, m = CS_MIN(j->per, j->n - i0);
    float *t = j->c->scratch[thread]; /* (m, rank) */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, j->rank, j->d_in, 1.0f, j->x + (size_t)i0 * j->d_in,
                j->d_in, j->a, j->d_in, 0.0f, t, j->rank);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, j->d_out, j->rank, j->scale, t, j->rank, j->bm, j->rank,
                1.0f, j->y + (size_t)i0 * j->d_out, j->d_out);
}

static void cpu_lora(cpu_raw_t *b, float *y, const float *x, int n, const float *a, const float *bm, int rank, int d_in,
                     int d_out, float scale) {
    cpu_ctx_t *c = ctx_of(b);
    if (rank <= 0 || n <= 0) return;
    if (c->reference) { cs_lora_ref(y, x, n, a, bm, rank, d_in, d_out, scale); return; }
    if (c->invariant) {
        cpu_lora_seg_t g = {0, n, a, bm, rank, scale, NULL, CS_DTYPE_F32};
        cpu_lora_batch(b, y, x, &g, 1, d_in, d_out);
        return;
    }
    struct lora_job j = {c, y, x, a, bm, n, rank, d_in, d_out, (n + c->n_threads - 1) / c->n_threads, scale};
    scratch_reserve(c, (size_t)j.per * rank);
    threadpool_run(c->pool, (n + j.per - 1) / j.per, lora_task, &j);
}

/* ---- paged attention (engine/kv_cache.h layout) ---- */
/* The pools hold F32 or BF16 (a BF16 KV cache halves the bytes every decode step reads);
 * a BF16 element widens to F32 exactly (a 16-bit shift), so both run the same F32 math. */
static inline float kv_at(const void *pool, bool bf16, size_t i) {
    return bf16 ? cs_bf16_to_f32(((const uint16_t *)pool)[i]) : ((const float *)pool)[i];
}
/* 16 elements of a pool from element i on, as F32 */
__attribute__((target("avx512f"), always_inline)) static inline __m512 kv_load16(const void *pool, size_t i, bool bf16) {
    if (bf16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)pool + i))), 16));
    return _mm512_loadu_ps((const float *)pool + i);
}

/* dot and axpy over one head's row, AVX-512 when head_dim is a multiple of 16 */
__attribute__((target("avx512f"))) static float dot16(const float *a, const void *pool, size_t i, int n, bool bf16) {
    __m512 acc = _mm512_setzero_ps();
    for (int e = 0; e < n; e += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + e), kv_load16(pool, i + (size_t)e, bf16), acc);
    return _mm512_reduce_add_ps(acc);
}
__attribute__((target("avx512f"))) static void axpy16(float *y, float w, const void *pool, size_t i, int n, bool bf16) {
    __m512 vw = _mm512_set1_ps(w);
    for (int e = 0; e < n; e += 16)
        _mm512_storeu_ps(y + e, _mm512_fmadd_ps(vw, kv_load16(pool, i + (size_t)e, bf16), _mm512_loadu_ps(y + e)));
}

struct pattn_job {
    cpu_ctx_t *c;
    float *out;
    const float *q;
    const void *k, *v;  /* pools of F32, or BF16 when bf16 */
    bool bf16;
    const cpu_attn_seq_t *seqs;
    const int *task0;   /* [n_dec + 1] first task of each decode sequence */
    const int *dec;     /* indices into seqs of the decode sequences */
    int n_dec, bs, nh, nkv, hd, window;
    int hg;             /* the rows path: head ranges per query (tasks per query) */
};

#ifndef PATTN_PF_LINES
#define PATTN_PF_LINES 2 /* lines of each whole row the rows path prefetches */
#endif

/* The rows path: one task per (decode query, range of heads), walking the keys block by
 * block and row by row, each row's slice of the task's heads once, in order: a block's rows
 * are adjacent, so a task over all heads reads its blocks straight through, which the
 * hardware prefetchers follow, and the next block (elsewhere in the pool) is started into
 * L2 while this one is read. q stays in L1, the scores of all the task's heads go to s
 * ([head][key]) and the weighted values are summed in out itself (L1). The per-head loop
 * (keys in the outer loop, every head's slice of a row in turn) ran 1.86x faster than one
 * task per head on a Zen 4 (8 sequences of 144 keys on average, BF16 cache), and 1.3x
 * faster than heads four at a time in registers over each block (a head's slice of 16 rows
 * 2 KiB apart is what the per-head kernel waited on). Every head's arithmetic is the same
 * whatever the range: keys in order, one FMA chain per output lane, so a row's result does
 * not depend on how the heads were split. */
__attribute__((target("avx512f"), always_inline)) static inline void
pattn_rows_nv(float *out, float *s, const float *q, const void *k, const void *v, const int32_t *blocks, const int BS,
              int first, int last, int h0, int h1, int g, size_t kv_dim, float scale, const int NV, const bool bf16) {
    const int hd = 16 * NV, len = last - first + 1;
    const size_t esz = bf16 ? 2 : 4;
    size_t lo = (size_t)(h0 / g) * hd, hi = (size_t)((h1 - 1) / g + 1) * hd; /* the rows' slice: [lo, hi) */
    /* Two blocks ahead (a block's 16 keys take less than a DRAM round trip), each of its
     * rows' slice into L2: the first lines only where the task reads whole rows (the block
     * is then one run of memory, which the hardware prefetchers take on from there: all its
     * 512 lines, for 2 KiB rows, stalled the issue and cost 26% of this kernel), every line
     * of a narrower slice (rows kv_dim apart, which no prefetcher follows) */
    size_t slice_lines = ((hi - lo) * esz + 63) / 64;
    if (lo == 0 && hi == kv_dim) slice_lines = CS_MIN(slice_lines, (size_t)PATTN_PF_LINES);
#define PATTN_PF_BLOCK(pool, bi)                                                                            \
    for (int pt = CS_MAX(first, (bi) * BS); pt <= CS_MIN(last, (bi) * BS + BS - 1); pt++) {                  \
        const char *pr = (const char *)(pool) + (cs_paged_row(blocks, BS, pt) * kv_dim + lo) * esz;          \
        for (size_t l = 0; l < slice_lines; l++) _mm_prefetch(pr + 64 * l, _MM_HINT_T1);                    \
    }
    PATTN_PF_BLOCK(k, first / BS);
    PATTN_PF_BLOCK(k, first / BS + 1);
    for (int tb = first; tb <= last;) {
        int te = CS_MIN(last, (tb / BS + 1) * BS - 1); /* this block's keys: [tb, te] */
        PATTN_PF_BLOCK(k, tb / BS + 2);
        size_t row0 = (size_t)blocks[tb / BS] * BS + (size_t)(tb % BS); /* rows of a block are adjacent */
        for (int t = tb; t <= te; t++) { /* row by row: each row's slice read once, in order */
            size_t rb = (row0 + (size_t)(t - tb)) * kv_dim;
            for (int h = h0; h < h1; h++) {
                size_t kr = rb + (size_t)(h / g) * hd;
                const float *qh = q + (size_t)h * hd;
                __m512 d = _mm512_mul_ps(_mm512_loadu_ps(qh), kv_load16(k, kr, bf16));
#pragma GCC unroll 8
                for (int c = 1; c < NV; c++)
                    d = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c), kv_load16(k, kr + 16 * (size_t)c, bf16), d);
                s[(size_t)(h - h0) * len + (t - first)] = _mm512_reduce_add_ps(d) * scale;
            }
        }
        tb = te + 1;
    }
    PATTN_PF_BLOCK(v, first / BS);
    PATTN_PF_BLOCK(v, first / BS + 1);
    for (int h = h0; h < h1; h++) softmax_avx512(s + (size_t)(h - h0) * len, len);
    for (int tb = first; tb <= last;) {
        int te = CS_MIN(last, (tb / BS + 1) * BS - 1);
        PATTN_PF_BLOCK(v, tb / BS + 2);
        size_t row0 = (size_t)blocks[tb / BS] * BS + (size_t)(tb % BS);
        if (tb == first) memset(out + (size_t)h0 * hd, 0, sizeof(float) * (size_t)(h1 - h0) * hd);
        for (int t = tb; t <= te; t++) { /* row by row, the sums in out (L1) */
            size_t rb = (row0 + (size_t)(t - tb)) * kv_dim;
            for (int h = h0; h < h1; h++) {
                size_t vr = rb + (size_t)(h / g) * hd;
                float *oh = out + (size_t)h * hd;
                __m512 w = _mm512_set1_ps(s[(size_t)(h - h0) * len + (t - first)]);
#pragma GCC unroll 8
                for (int c = 0; c < NV; c++)
                    _mm512_storeu_ps(oh + 16 * c, _mm512_fmadd_ps(w, kv_load16(v, vr + 16 * (size_t)c, bf16),
                                                                  _mm512_loadu_ps(oh + 16 * c)));
            }
        }
        tb = te + 1;
    }
#undef PATTN_PF_BLOCK
}

/* the rows path's instances (head sizes 16·NV, pool dtype, the engine's block size as a
 * constant); false: not a common head size */
__attribute__((target("avx512f"))) static bool pattn_rows(float *out, float *s, const float *q, const void *k,
                                                          const void *v, bool bf16, const int32_t *blocks, int bs,
                                                          int first, int last, int h0, int h1, int g, size_t kv_dim,
                                                          float scale, int hd) {
#define PATTN_ROWS(NV)                                                                                              \
    do {                                                                                                            \
        if (bf16 && bs == 16) pattn_rows_nv(out, s, q, k, v, blocks, 16, first, last, h0, h1, g, kv_dim, scale, NV, true); \
        else if (bf16) pattn_rows_nv(out, s, q, k, v, blocks, bs, first, last, h0, h1, g, kv_dim, scale, NV, true);     \
        else if (bs == 16) pattn_rows_nv(out, s, q, k, v, blocks, 16, first, last, h0, h1, g, kv_dim, scale, NV, false); \
        else pattn_rows_nv(out, s, q, k, v, blocks, bs, first, last, h0, h1, g, kv_dim, scale, NV, false);               \
        return true;                                                                                                \
    } while (0)
    switch (hd) {
    case 64: PATTN_ROWS(4);
    case 128: PATTN_ROWS(8);
    case 32: PATTN_ROWS(2);
    case 16: PATTN_ROWS(1);
    default: return false;
    }
#undef PATTN_ROWS
}

/* the decode sequence of a task: index into j->dec */
static int pattn_seq_of(const struct pattn_job *j, int task) {
    int lo = 0, hi = j->n_dec - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (j->task0[mid] <= task) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* one task per (sequence, query, range of heads): the rows path */
static void pattn_rows_task(void *p, int task, int thread) {
    struct pattn_job *j = p;
    int d = pattn_seq_of(j, task);
    const cpu_attn_seq_t *sq = &j->seqs[j->dec[d]];
    int local = task - j->task0[d], i = local / j->hg, per = (j->nh + j->hg - 1) / j->hg;
    int h0 = local % j->hg * per, h1 = CS_MIN(j->nh, h0 + per);
    if (h0 >= h1) return;
    int qpos = sq->pos0 + i, first = j->window > 0 && qpos - j->window + 1 > 0 ? qpos - j->window + 1 : 0;
    size_t row = (size_t)(sq->row0 + i) * j->nh * j->hd, kv_dim = (size_t)j->nkv * j->hd;
    float scale = 1.0f / sqrtf((float)j->hd), *s = j->c->scratch[thread];
    if (!j->c->avx512) {
        cs_attn_rows_paged_avx2(j->out + row, s, j->q + row, j->k, j->v, j->bf16 ? CS_DTYPE_BF16 : CS_DTYPE_F32,
                                sq->blocks, j->bs, first, qpos, h0, h1, j->nh / j->nkv, kv_dim, scale, j->hd);
        return;
    }
    bool ok = pattn_rows(j->out + row, s, j->q + row, j->k, j->v, j->bf16, sq->blocks, j->bs, first, qpos, h0, h1,
                         j->nh / j->nkv, kv_dim, scale, j->hd);
    CS_ASSERT(ok);
}

/* one task per (sequence, query, head): the head sizes the rows paths lack */
static void pattn_task(void *p, int task, int thread) {
    struct pattn_job *j = p;
    int lo = pattn_seq_of(j, task);
    const cpu_attn_seq_t *sq = &j->seqs[j->dec[lo]];
    int local = task - j->task0[lo], i = local / j->nh, h = local % j->nh;
    int hd = j->hd, kvh = h / (j->nh / j->nkv);
    size_t kv_dim = (size_t)j->nkv * hd, off = (size_t)kvh * hd;
    int qpos = sq->pos0 + i, first = j->window > 0 && qpos - j->window + 1 > 0 ? qpos - j->window + 1 : 0;
    float scale = 1.0f / sqrtf((float)hd), *s = j->c->scratch[thread];
    const float *qh = j->q + ((size_t)(sq->row0 + i) * j->nh + h) * hd;
    float *oh = j->out + ((size_t)(sq->row0 + i) * j->nh + h) * hd;
    bool bf16 = j->bf16;
    if (!j->c->avx512) { /* AVX2, a head size not a multiple of 8 */
        for (int t = first; t <= qpos; t++) {
            size_t kr = cs_paged_row(sq->blocks, j->bs, t) * kv_dim + off;
            float d = 0;
            for (int e = 0; e < hd; e++) d += qh[e] * kv_at(j->k, bf16, kr + (size_t)e);
            s[t - first] = d * scale;
        }
        cs_softmax_avx2(s, qpos - first + 1);
        memset(oh, 0, sizeof(float) * (size_t)hd);
        for (int t = first; t <= qpos; t++) {
            size_t vr = cs_paged_row(sq->blocks, j->bs, t) * kv_dim + off;
            for (int e = 0; e < hd; e++) oh[e] += s[t - first] * kv_at(j->v, bf16, vr + (size_t)e);
        }
        return;
    }
    bool vec = hd % 16 == 0;
    for (int t = first; t <= qpos; t++) {
        size_t kr = cs_paged_row(sq->blocks, j->bs, t) * kv_dim + off;
        float d;
        if (vec) d = dot16(qh, j->k, kr, hd, bf16);
        else { d = 0; for (int e = 0; e < hd; e++) d += qh[e] * kv_at(j->k, bf16, kr + (size_t)e); }
        s[t - first] = d * scale;
    }
    softmax_avx512(s, qpos - first + 1);
    memset(oh, 0, sizeof(float) * (size_t)hd);
    for (int t = first; t <= qpos; t++) {
        size_t vr = cs_paged_row(sq->blocks, j->bs, t) * kv_dim + off;
        float w = s[t - first];
        if (vec) axpy16(oh, w, j->v, vr, hd, bf16);
        else for (int e = 0; e < hd; e++) oh[e] += w * kv_at(j->v, bf16, vr + (size_t)e);
    }
}

/* Prefill chunks (16+ queries) go through the GEMM attention: in place when the block table
 * is contiguous and the pools F32, else after gathering the sequence's keys and values (BF16
 * widened to F32 on the way); decode rows of all sequences run in one pool dispatch. */
static void cpu_attention_paged(cpu_raw_t *b, float *out, const float *q, const void *k, const void *v,
                                cs_dtype kv_dtype, const cpu_attn_seq_t *seqs, int n_seqs, int bs, int nh, int nkv,
                                int hd, int window) {
    cpu_ctx_t *c = ctx_of(b);
    CS_ASSERT(kv_dtype == CS_DTYPE_F32 || kv_dtype == CS_DTYPE_BF16);
    if (c->reference || (!c->avx512 && !c->avx2)) {
        cs_attention_paged_kv_ref(out, q, k, v, kv_dtype, seqs, n_seqs, bs, nh, nkv, hd, window);
        return;
    }
    bool bf16 = kv_dtype == CS_DTYPE_BF16;
    size_t kv_dim = (size_t)nkv * hd, q_dim = (size_t)nh * hd, esz = cs_dtype_size(kv_dtype);
    int *dec = malloc(sizeof(int) * (size_t)(2 * n_seqs + 1)), *task0 = dec + n_seqs, n_dec = 0, max_len = 0;
    CS_ASSERT(dec);
    for (int s = 0; s < n_seqs; s++) {
        const cpu_attn_seq_t *sq = &seqs[s];
        int len = sq->pos0 + sq->n, nb = (len + bs - 1) / bs;
        if (sq->n < 16 || c->invariant) { /* batch-invariant: every query alone, keys in order */
            dec[n_dec++] = s;
            max_len = CS_MAX(max_len, len);
            continue;
        }
        bool contiguous = !bf16;
        for (int i = 1; i < nb && contiguous; i++) contiguous = sq->blocks[i] == sq->blocks[0] + i;
        const float *ks, *vs;
        if (contiguous) {
            ks = (const float *)k + (size_t)sq->blocks[0] * bs * kv_dim;
            vs = (const float *)v + (size_t)sq->blocks[0] * bs * kv_dim;
        } else {
            size_t need = (size_t)len * kv_dim * 2;
            c->gather = buf_reserve(c->gather, &c->gather_len, need, sizeof(float));
            float *kg = c->gather, *vg = c->gather + (size_t)len * kv_dim;
            for (int i = 0; i < nb; i++) {
                size_t rows = (size_t)CS_MIN(bs, len - i * bs), at = (size_t)sq->blocks[i] * bs * kv_dim;
                cs_to_f32(kg + (size_t)i * bs * kv_dim, (const char *)k + at * esz, kv_dtype, rows * kv_dim);
                cs_to_f32(vg + (size_t)i * bs * kv_dim, (const char *)v + at * esz, kv_dtype, rows * kv_dim);
            }
            ks = kg;
            vs = vg;
        }
        cpu_attention(b, out + (size_t)sq->row0 * q_dim, q + (size_t)sq->row0 * q_dim, ks, vs, sq->n, sq->pos0, nh, nkv,
                      hd, window);
    }
    if (n_dec) {
        /* The rows paths (AVX-512 at the common head sizes, AVX2 at multiples of 8): all
         * heads of a query in one task when there are queries enough for the threads, else
         * the heads split so that each thread gets a few tasks. Otherwise one task per head. */
        bool rows = c->avx512 ? hd == 16 || hd == 32 || hd == 64 || hd == 128 : hd % 8 == 0;
        int queries = 0, hg = nh;
        for (int d = 0; d < n_dec; d++) queries += seqs[dec[d]].n;
        if (rows) hg = queries >= 2 * c->n_threads ? 1 : CS_MIN(nh, (2 * c->n_threads + queries - 1) / queries);
        task0[0] = 0;
        for (int d = 0; d < n_dec; d++) task0[d + 1] = task0[d] + seqs[dec[d]].n * hg;
        scratch_reserve(c, (size_t)max_len * (rows ? (size_t)(nh + hg - 1) / hg : 1));
        struct pattn_job j = {c, out, q, k, v, bf16, seqs, task0, dec, n_dec, bs, nh, nkv, hd, window, hg};
        threadpool_run(c->pool, task0[n_dec], rows ? pattn_rows_task : pattn_task, &j);
    }
    free(dec);
}

/* n floats to BF16, rounded to nearest even as cs_f32_to_bf16 (NaN kept quiet), 16 at a time */
__attribute__((target("avx512f,avx512bw,avx512vl"))) static void to_bf16_avx512(uint16_t *dst, const float *src, int n) {
    const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff), absm = _mm512_set1_epi32(0x7fffffff);
    const __m512i inf = _mm512_set1_epi32(0x7f800000), quiet = _mm512_set1_epi32(0x40);
    int i = 0;
    for (; i < n; i += 16) {
        __mmask16 m = i + 16 <= n ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        __m512i u = _mm512_castps_si512(_mm512_maskz_loadu_ps(m, src + i));
        __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
        r = _mm512_srli_epi32(r, 16);
        __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, absm), inf);
        r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), quiet));
        _mm256_mask_storeu_epi16(dst + i, m, _mm512_cvtepi32_epi16(r));
    }
}

static void cpu_kv_store(cpu_raw_t *b, void *pool, cs_dtype kv_dtype, const float *src, const int32_t *slots, int n,
                         int len) {
    cpu_ctx_t *c = ctx_of(b);
    if (kv_dtype == CS_DTYPE_BF16 && c->avx512 && !c->reference) {
        for (int i = 0; i < n; i++) to_bf16_avx512((uint16_t *)pool + (size_t)slots[i] * len, src + (size_t)i * len, len);
        return;
    }
    if (kv_dtype != CS_DTYPE_F32) {
        cs_kv_store_ref(pool, kv_dtype, src, slots, n, len);
        return;
    }
    for (int i = 0; i < n; i++)
        memcpy((float *)pool + (size_t)slots[i] * len, src + (size_t)i * len, sizeof(float) * (size_t)len);
}

static void cpu_set_rows(cpu_raw_t *b, float *dst, const float *src, const int32_t *idx, int n, int len) {
    (void)b;
    for (int i = 0; i < n; i++) memcpy(dst + (size_t)idx[i] * len, src + (size_t)i * len, sizeof(float) * (size_t)len);
}

static void cpu_get_rows(cpu_raw_t *b, float *dst, const float *src, const int32_t *idx, int n, int len) {
    (void)b;
    for (int i = 0; i < n; i++) memcpy(dst + (size_t)i * len, src + (size_t)idx[i] * len, sizeof(float) * (size_t)len);
}

/* ---- grouped LoRA over the segments of a batch ---- */
/* Few rows (decode): threads split the rank of A (shrink) and then the rows of B (expand),
 * so every adapter's A and B are read once per step, not once per thread. Many rows
 * (prefill): per segment, split by rows. */
#define LORA_BATCH_MAX_ROWS 64
#define LORA_EXPAND_COLS 256

struct lora_batch_job {
    cpu_ctx_t *c;
    float *y, *t;           /* t: (rows, max_rank) shrink results */
    const float *x;
    const cpu_lora_seg_t *segs;
    const int *task0;       /* [n_segs + 1] first task of each segment in this phase */
    int n_segs, d_in, d_out, ld_t;
};

static int lb_find(const int *task0, int n, int task) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (task0[mid] <= task) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* few rows: stream A's rows (shrink) or Bᵀ's rows (expand) once, dotting each with every x
 * (t) row (kernels_lora.c: F32 or BF16, AVX-512, AVX2 or plain). BF16 weights always take
 * these per-element kernels (sgemm needs F32). */
static cs_isa lora_isa(const cpu_ctx_t *c) { return c->avx512 ? CS_ISA_AVX512 : c->avx2 ? CS_ISA_AVX2 : CS_ISA_PLAIN; }

static bool lora_small(const struct lora_batch_job *j, const cpu_lora_seg_t *g) {
    return g->n <= CS_LORA_SMALL_M || j->c->invariant || g->dtype != CS_DTYPE_F32; /* per element: batch-invariant */
}

/* t rows of segment g, ranks [r0, r1): x rows · A[r0:r1]ᵀ */
static void lora_seg_shrink(const struct lora_batch_job *j, const cpu_lora_seg_t *g, int r0, int r1) {
    const float *x = j->x + (size_t)g->row0 * j->d_in;
    float *t = j->t + (size_t)g->row0 * j->ld_t;
    if (lora_small(j, g)) {
        size_t es = cs_dtype_size(g->dtype);
        cs_isa isa = lora_isa(j->c);
        for (int r = r0; r < r1; r++) {
            const void *ar = (const char *)g->a + (size_t)r * j->d_in * es;
            for (int i = 0; i < g->n; i++)
                t[(size_t)i * j->ld_t + r] = cs_lora_dot(x + (size_t)i * j->d_in, ar, g->dtype, j->d_in, isa);
        }
        return;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, g->n, r1 - r0, j->d_in, 1.0f, x, j->d_in,
                (const float *)g->a + (size_t)r0 * j->d_in, j->d_in, 0.0f, t + r0, j->ld_t);
}

/* y rows of segment g, outputs [c0, c1): += scale · t rows · B[c0:c1]ᵀ */
static void lora_seg_expand(const struct lora_batch_job *j, const cpu_lora_seg_t *g, int c0, int c1) {
    const float *t = j->t + (size_t)g->row0 * j->ld_t;
    float *y = j->y + (size_t)g->row0 * j->d_out;
    cs_isa isa = lora_isa(j->c);
    if (lora_small(j, g) && g->b && cs_lora_expand_b_fits(g->rank, isa)) { /* B's rows in order */
        for (int i0 = 0; i0 < g->n; i0 += CS_LORA_SMALL_M)
            cs_lora_expand_b(y + (size_t)i0 * j->d_out, j->d_out, t + (size_t)i0 * j->ld_t, j->ld_t,
                             CS_MIN(CS_LORA_SMALL_M, g->n - i0), g->b, g->dtype, g->rank, c0, c1, g->scale, isa);
        return;
    }
    if (lora_small(j, g) && g->bt) { /* streams Bᵀ's rows, 8 or 16 outputs per vector, no horizontal sums */
        for (int i0 = 0; i0 < g->n; i0 += CS_LORA_SMALL_M)
            cs_lora_expand_bt(y + (size_t)i0 * j->d_out, j->d_out, t + (size_t)i0 * j->ld_t, j->ld_t,
                              CS_MIN(CS_LORA_SMALL_M, g->n - i0), g->bt, g->dtype, g->rank, c0, c1, g->scale, isa);
        return;
    }
    if (lora_small(j, g)) {
        size_t es = cs_dtype_size(g->dtype);
        for (int c = c0; c < c1; c++) {
            const void *br = (const char *)g->b + (size_t)c * g->rank * es;
            for (int i = 0; i < g->n; i++)
                y[(size_t)i * j->d_out + c] += g->scale * cs_lora_dot(t + (size_t)i * j->ld_t, br, g->dtype, g->rank, isa);
        }
        return;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, g->n, c1 - c0, g->rank, g->scale, t, j->ld_t,
                (const float *)g->b + (size_t)c0 * g->rank, g->rank, 1.0f, y + c0, j->d_out);
}

static void lora_shrink_task(void *p, int task, int thread) {
    struct lora_batch_job *j = p;
    (void)thread;
    int s = lb_find(j->task0, j->n_segs, task), k = task - j->task0[s];
    const cpu_lora_seg_t *g = &j->segs[s];
    lora_seg_shrink(j, g, k * 8, CS_MIN(g->rank, k * 8 + 8));
}

static void lora_expand_task(void *p, int task, int thread) {
    struct lora_batch_job *j = p;
    (void)thread;
    int s = lb_find(j->task0, j->n_segs, task), k = task - j->task0[s];
    lora_seg_expand(j, &j->segs[s], k * LORA_EXPAND_COLS, CS_MIN(j->d_out, (k + 1) * LORA_EXPAND_COLS));
}

/* a whole segment in one task: with several adapters in the batch, one dispatch per
 * projection instead of two */
static void lora_seg_task(void *p, int task, int thread) {
    struct lora_batch_job *j = p;
    (void)thread;
    const cpu_lora_seg_t *g = &j->segs[task];
    lora_seg_shrink(j, g, 0, g->rank);
    lora_seg_expand(j, g, 0, j->d_out);
}

/* below this many multiply-adds a projection's LoRA runs on the calling thread, waking the
 * pool twice costs more than the work (decode of one or two rows on one adapter); not when
 * there are enough segments for one dispatch of a task each (decode with several adapters:
 * each streams its own weights from memory, which one core alone does at half the
 * bandwidth; kernelbench's 8 adapters at batch 8 cost 31% on one core, 16% split). One
 * rank-16 BF16 adapter on the 200M model's 7 projections, 12 layers, 2 threads, per step:
 * 1 row 0.17 ms inline, 0.19 split; 2 rows 0.32 / 0.28-0.33; 4 rows 0.63 / 0.46; 8 rows
 * 1.4-1.5 / 0.82-0.85 (the limit was 1 << 20, which kept 8 rows inline) */
#define LORA_INLINE_MACS (1L << 17)

static void cpu_lora_batch(cpu_raw_t *b, float *y, const float *x, const cpu_lora_seg_t *segs, int n_segs, int d_in,
                           int d_out) {
    cpu_ctx_t *c = ctx_of(b);
    int rows = 0, max_rank = 0, max_row = 0;
    long macs = 0;
    for (int i = 0; i < n_segs; i++) {
        rows += segs[i].n;
        max_rank = CS_MAX(max_rank, segs[i].rank);
        max_row = CS_MAX(max_row, segs[i].row0 + segs[i].n);
        macs += (long)segs[i].n * segs[i].rank * (d_in + d_out);
    }
    if (c->reference || (rows > LORA_BATCH_MAX_ROWS && !c->invariant)) { /* per segment, split by rows */
        for (int i = 0; i < n_segs; i++) {
            const float *a = segs[i].a, *bm = segs[i].b;
            if (segs[i].dtype != CS_DTYPE_F32) { /* widened once for all the segment's rows */
                size_t na = (size_t)segs[i].rank * d_in, nb = (size_t)segs[i].rank * d_out;
                c->lora_wide = buf_reserve(c->lora_wide, &c->lora_wide_len, na + nb, sizeof(float));
                cs_to_f32(c->lora_wide, segs[i].a, segs[i].dtype, na);
                cs_to_f32(c->lora_wide + na, segs[i].b, segs[i].dtype, nb);
                a = c->lora_wide;
                bm = c->lora_wide + na;
            }
            cpu_lora(b, y + (size_t)segs[i].row0 * d_out, x + (size_t)segs[i].row0 * d_in, segs[i].n, a, bm,
                     segs[i].rank, d_in, d_out, segs[i].scale);
        }
        return;
    }
    size_t need = (size_t)max_row * max_rank;
    c->lora_t = buf_reserve(c->lora_t, &c->lora_t_len, need, sizeof(float));
    struct lora_batch_job j = {c, y, c->lora_t, x, segs, NULL, n_segs, d_in, d_out, max_rank};
    if (macs < LORA_INLINE_MACS && n_segs < 2 * c->n_threads) {
        for (int i = 0; i < n_segs; i++) lora_seg_task(&j, i, 0);
        return;
    }
    if (n_segs >= 2 * c->n_threads) {
        threadpool_run(c->pool, n_segs, lora_seg_task, &j);
        return;
    }
    int *task0 = malloc(sizeof(int) * (size_t)(n_segs + 1));
    CS_ASSERT(task0);
    j.task0 = task0;
    task0[0] = 0;
    for (int i = 0; i < n_segs; i++) task0[i + 1] = task0[i] + (segs[i].rank + 7) / 8;
    threadpool_run(c->pool, task0[n_segs], lora_shrink_task, &j);
    int per = (d_out + LORA_EXPAND_COLS - 1) / LORA_EXPAND_COLS;
    for (int i = 0; i < n_segs; i++) task0[i + 1] = task0[i] + per;
    threadpool_run(c->pool, task0[n_segs], lora_expand_task, &j);
    free(task0);
}

static void cpu_embed(cpu_raw_t *b, float *y, const cs_weight_t *t, const int32_t *ids, int n) {
    size_t esz = cs_dtype_size(t->dtype);
    if (cs_dtype_is_quant(t->dtype)) { /* each row dequantized as the reference does */
        size_t rb = cs_dtype_row_bytes(t->dtype, t->cols);
        for (int i = 0; i < n; i++) {
            CS_ASSERT(ids[i] >= 0 && ids[i] < t->rows);
            cs_dequant_row_ref(y + (size_t)i * t->cols, (const char *)t->data + (size_t)ids[i] * rb, t->dtype, t->cols);
        }
        return;
    }
    if (code_only(t)) { /* a tied lm_head kept only coded: the rows decoded, one at a time */
        cpu_ctx_t *c = ctx_of(b);
        uint16_t *row = malloc(sizeof *row * (size_t)t->cols);
        CS_ASSERT(row);
        for (int i = 0; i < n; i++) {
            CS_ASSERT(ids[i] >= 0 && ids[i] < t->rows);
            c->wdecode(row, t->code, ids[i], ids[i] + 1);
            cs_to_f32(y + (size_t)i * t->cols, row, CS_DTYPE_BF16, (size_t)t->cols);
        }
        free(row);
        return;
    }
    for (int i = 0; i < n; i++) {
        CS_ASSERT(ids[i] >= 0 && ids[i] < t->rows);
        cs_to_f32(y + (size_t)i * t->cols, (const char *)t->data + (size_t)ids[i] * t->cols * esz, t->dtype,
                  (size_t)t->cols);
    }
}

static void cpu_free(cpu_raw_t *b) {
    cpu_ctx_t *c = ctx_of(b);
    if (c) {
        threadpool_free(c->pool);
        for (int t = 0; t < c->n_threads && c->scratch; t++) free(c->scratch[t]);
        free(c->scratch);
        free(c->scratch_len);
        for (int t = 0; t < c->n_threads && c->wdec; t++) free(c->wdec[t]);
        free(c->wdec);
        free(c->wdec_len);
        free(c->gather);
        free(c->lora_t);
        free(c->lora_wide);
        free(c->xpack);
        free(c->xround);
        free(c->xq);
        free(c->xq_d);
        free(c->xq_s);
        free(c->xq_s16);
        cs_qpack_arena_free(c->qarena);
        free(c);
    }
    free(b);
}

static const struct cpu_raw_i cpu_raw_iface = {
    .matmul = cpu_matmul,
    .matmul_multi = cpu_matmul_multi,
    .rmsnorm = cpu_rmsnorm,
    .rope = cpu_rope,
    .attention = cpu_attention,
    .attention_paged = cpu_attention_paged,
    .kv_store = cpu_kv_store,
    .set_rows = cpu_set_rows,
    .get_rows = cpu_get_rows,
    .silu_mul = cpu_silu_mul,
    .add = cpu_add,
    .lora = cpu_lora,
    .lora_batch = cpu_lora_batch,
    .embed = cpu_embed,
    .free = cpu_free,
};

cpu_raw_t *cpu_raw_new(const cpu_backend_params_t *p) {
    cpu_raw_t *b = calloc(1, sizeof *b);
    cpu_ctx_t *c = calloc(1, sizeof *c);
    if (!b || !c) goto err;
    b->iface = &cpu_raw_iface;
    b->ctx = c;
    int n = p && p->n_threads > 0 ? p->n_threads : (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (n < 1) n = 1;
    c->n_threads = b->n_threads = n;
    c->reference = p && p->reference;
    c->invariant = p && p->batch_invariant;
    c->no_tile = p && p->no_tile;
    c->avx512 = cs_cpu_has_avx512() && !(p && p->no_avx512);
    c->avx2 = cs_cpu_has_avx2() && !(p && p->no_avx2);
    c->amx = c->avx512 && !(p && p->no_amx) && cs_cpu_has_amx_bf16();
    c->dpbf16 = c->avx512 && !(p && p->no_dpbf16) && cs_cpu_has_avx512_bf16();
    c->prec_bf16 = p && p->precision_bf16;
    c->prec_int8 = p && p->precision_int8 && !c->prec_bf16;
    c->qpack = c->prec_int8 && c->avx2 && !c->reference && !(p && p->no_qpack);
    c->vnni = c->qpack && c->avx512 && !(p && p->no_vnni) && cs_cpu_has_avx512_vnni();
    c->packed = (c->avx512 || c->avx2) && !(p && p->no_packed);
    const char *base = c->reference ? "reference"
                       : c->invariant ? (c->avx512 ? "avx512" : c->avx2 ? "avx2" : "openblas")
                       : c->amx       ? "amx"
                       : c->avx512    ? (c->dpbf16 && c->prec_bf16 ? "avx512bf16" : "avx512")
                       : c->avx2      ? "avx2"
                                      : "openblas";
    /* the batch-1 GEMV's streams: few on AMD (Zen 4 reads 4 prefetched streams per core at
     * the bandwidth of a plain read, 8 at 0.76-0.85 of it), many elsewhere */
    __builtin_cpu_init();
    int streams = p && p->gemv_streams ? p->gemv_streams : __builtin_cpu_is("amd") ? 4 : 0;
    bool s4 = streams == 4 && (c->avx512 || c->avx2) && !c->reference && !c->invariant;
    /* only where the batch-1 GEMV runs (AVX-512 or AVX2, not reference, not batch-invariant) */
    c->compress = p && (p->compress_weights || p->compress_weights_only) && (c->avx512 || c->avx2) && !c->reference &&
                  !c->invariant;
    c->code_only = c->compress && p->compress_weights_only && !c->amx;
    c->code_pass_max = c->avx512 && !c->prec_bf16 ? CPU_CODE_ONLY_PASS_MAX_N : CPU_CODE_ONLY_PASS_MAX_N / 2;
    c->wcode_max_n = c->avx512 ? 3 : CS_WCODE_MAX_N;
    snprintf(c->path, sizeof c->path, "%s%s%s%s%s", base, c->invariant && !c->reference ? "+invariant" : "",
             c->prec_bf16 ? "+bf16" : c->vnni ? "+int8vnni" : c->qpack ? "+int8pack" : c->prec_int8 ? "+int8" : "", s4 ? "+gemv4" : "", c->code_only ? "+wc12only" : c->compress ? "+wc12" : "");
    if (c->avx512) {
        c->gemv = s4 ? cs_gemv_rows_avx512_s4 : cs_gemv_rows_avx512;
        c->tile = cs_gemm_invariant_avx512;
        if (!(p && p->no_split)) c->split = cs_gemm_split_avx512, c->split_pack = cs_split_pack_x_avx512;
        c->convert = cs_convert_rows_avx512;
        c->softmax = softmax_avx512;
    } else if (c->avx2) {
        c->gemv = s4 ? cs_gemv_rows_avx2_s4 : cs_gemv_rows_avx2;
        c->tile = cs_gemm_invariant_avx2;
        if (!(p && p->no_split)) c->split = cs_gemm_split_avx2, c->split_pack = cs_split_pack_x_avx2;
        c->convert = cs_convert_rows_avx2;
        c->softmax = cs_softmax_avx2;
    } else {
        c->softmax = cs_softmax_ref;
    }
    c->silu_mul = c->avx2 ? cs_silu_mul_avx2 : cs_silu_mul_ref;
    /* two terms of x are ~1.3x faster for prefill but move BF16 logprobs from ~2e-6 to
     * ~2.5e-5 against transformers (tests/test_ref_forward.py): exact by default */
    c->amx_terms = p && p->amx_terms == 2 ? 2 : 3;
    c->wdecode = c->avx512 ? cs_wcode_decode_rows_avx512 : c->avx2 ? cs_wcode_decode_rows_avx2 : cs_wcode_decode_rows_ref;
    c->scratch = calloc((size_t)n, sizeof *c->scratch);
    c->scratch_len = calloc((size_t)n, sizeof *c->scratch_len);
    c->wdec = calloc((size_t)n, sizeof *c->wdec);
    c->wdec_len = calloc((size_t)n, sizeof *c->wdec_len);
    c->pool = threadpool_new(n);
    if (!c->scratch || !c->scratch_len || !c->wdec || !c->wdec_len || !c->pool) goto err;
#ifdef HAVE_OPENBLAS_SET_NUM_THREADS
    /* our pool owns the cores; OpenBLAS runs single-threaded inside each task */
    openblas_set_num_threads(1);
#endif
    return b;
err:
    if (b && c) { b->ctx = c; cpu_free(b); return NULL; }
    free(b);
    free(c);
    cs_error_set(CS_ENOMEM, "cpu backend: out of memory");
    return NULL;
}

const char *cpu_raw_path(const cpu_raw_t *b) { return ((const cpu_ctx_t *)b->ctx)->path; }

bool cpu_raw_codes_weights(const cpu_raw_t *b) { return ((const cpu_ctx_t *)b->ctx)->compress; }

bool cpu_raw_packs_quant(const cpu_raw_t *b) { return ((const cpu_ctx_t *)b->ctx)->qpack; }

struct qpack_job {
    cs_qpack_t *p;
    const cs_weight_t *w;
};

static void qpack_task(void *p, int task, int thread) {
    struct qpack_job *j = p;
    (void)thread;
    cs_qpack_fill(j->p, j->w, task, task + 1);
}

cs_qpack_t *cpu_raw_qpack_new(cpu_raw_t *b, const cs_weight_t *w) {
    cpu_ctx_t *c = ctx_of(b);
    if (!c->qarena && !(c->qarena = cs_qpack_arena_new())) return NULL;
    cs_qpack_t *p = cs_qpack_new(w->dtype, w->rows, w->cols, c->qarena);
    if (!p) return NULL;
    struct qpack_job j = {p, w};
    threadpool_run(c->pool, w->rows / CS_QPACK_ROWS, qpack_task, &j);
    return p;
}

/* --compress-weights-only where it applies: not on AMX, whose tile kernels read the BF16
 * weights in place (not decoded per task there: no AMX CPU to test it on) */
bool cpu_raw_code_only(const cpu_raw_t *b) { return ((const cpu_ctx_t *)b->ctx)->code_only; }

/* coding a matrix on the pool: the high bytes counted in parts, then rows coded, then the
 * exceptions listed, each step over row ranges */
struct wcode_job {
    const uint16_t *w;
    cs_wcode_t *c;
    int rows, cols, rows_per_task;
    uint64_t (*hist)[256];  /* per task */
};

static void wcode_hist_task(void *p, int task, int thread) {
    struct wcode_job *j = p;
    (void)thread;
    int r0 = task * j->rows_per_task, r1 = CS_MIN(r0 + j->rows_per_task, j->rows);
    cs_wcode_hist(j->w + (size_t)r0 * j->cols, (size_t)(r1 - r0) * j->cols, j->hist[task]);
}

static void wcode_encode_task(void *p, int task, int thread) {
    struct wcode_job *j = p;
    (void)thread;
    int r0 = task * j->rows_per_task;
    cs_wcode_encode_rows(j->c, j->w, r0, CS_MIN(r0 + j->rows_per_task, j->rows));
}

static void wcode_exc_task(void *p, int task, int thread) {
    struct wcode_job *j = p;
    (void)thread;
    int r0 = task * j->rows_per_task;
    cs_wcode_fill_exc(j->c, j->w, r0, CS_MIN(r0 + j->rows_per_task, j->rows));
}

cs_wcode_t *cpu_raw_wcode_new(cpu_raw_t *b, const cs_weight_t *w) {
    cpu_ctx_t *c = ctx_of(b);
    CS_ASSERT(w->dtype == CS_DTYPE_BF16);
    struct wcode_job j = {w->data, NULL, w->rows, w->cols, 0, NULL};
    j.rows_per_task = CS_MAX(1, (int)((1u << 20) / ((unsigned)w->cols * 2u + 1u))); /* ~1 MiB of weights */
    int tasks = (w->rows + j.rows_per_task - 1) / j.rows_per_task;
    if (!(j.hist = calloc((size_t)tasks, sizeof *j.hist))) return NULL;
    threadpool_run(c->pool, tasks, wcode_hist_task, &j);
    uint64_t hist[256] = {0};
    for (int t = 0; t < tasks; t++)
        for (int k = 0; k < 256; k++) hist[k] += j.hist[t][k];
    free(j.hist);
    if (!(j.c = cs_wcode_begin(w->rows, w->cols, hist))) return NULL;
    threadpool_run(c->pool, tasks, wcode_encode_task, &j);
    if (cs_wcode_index(j.c)) {
        cs_wcode_free(j.c);
        return NULL;
    }
    if (j.c->n_exc) threadpool_run(c->pool, tasks, wcode_exc_task, &j);
    return j.c;
}
