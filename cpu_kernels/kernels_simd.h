/* kernels_simd.h: the loops kernels_avx2.c and kernels_avx512.c share, written once over the
 * vector operations each file defines before it includes this header, with KS_TARGET its
 * target attribute (so each compiles them for its ISA and inlines them into its kernels;
 * an attribute on every function, as clang wants, not a pragma):
 *   vf_t                 an F32 vector of VF_LANES lanes
 *   vf_zero, vf_add, vf_fmadd, vf_bcast (one float from memory), vf_load (aligned), vf_hsum (the file's fixed sum)
 *   wcode_tbl_t, wcode_table(c)               the code table in a register
 *   wcode_fma2(row, b, tbl, xb, a0, a1)       block b of a coded row times x's block, into
 *                                             the two accumulators in the file's order
 *   wcode_fma_n(row, b, tbl, xb, a, NX)       the same for NX rows of x, one accumulator each
 *   PK_MR, PK_NR, PK_KC, packed_panel, packed_rows    the packed GEMM's tile and panels
 * Each loop does in both files what it did in each alone: the same operations in the same
 * order, so the same bits. */
#ifndef CS_KERNELS_SIMD_H
#define CS_KERNELS_SIMD_H

#include "cpu_kernels/kernels.h"
#include "cpu_kernels/wcode.h"

#ifndef KS_TARGET
#error "define KS_TARGET (the including file's __attribute__((target(...)))) before kernels_simd.h"
#endif
#define KS_INLINE static inline __attribute__((always_inline)) KS_TARGET

/* rows of x packed by the split kernels: K to a whole number of CS_SPLIT_B columns */
KS_INLINE size_t split_kp(int K) { return (size_t)(K + CS_SPLIT_B - 1) / CS_SPLIT_B * CS_SPLIT_B; }

/* ---- the coded-weight GEMV (wcode.h): rows [r0, r1) as S interleaved streams, each
 * prefetched PF bytes ahead in both its low bytes and its codes (0: no software prefetch) ---- */
typedef struct wcode_walk {
    int nb, full; /* blocks a row, whole blocks of x */
    int per;      /* rows a stream */
    size_t rb;    /* bytes a row */
    size_t stride; /* bytes between streams */
} wcode_walk_t;

KS_INLINE wcode_walk_t wcode_walk(const cs_wcode_t *c, int r0, int r1, int S) {
    wcode_walk_t k = {.nb = c->blocks, .full = c->cols / CS_WCODE_BLOCK, .per = (r1 - r0) / S};
    k.rb = (size_t)k.nb * CS_WCODE_BLOCK_BYTES;
    k.stride = (size_t)k.per * k.rb;
    return k;
}

/* x's columns past the whole blocks (NX rows, c->cols apart) into xt, zeros after */
KS_INLINE void wcode_x_tail(float (*xt)[2 * CS_WCODE_BLOCK], const float *x, const cs_wcode_t *c, const int NX) {
    int full = c->cols / CS_WCODE_BLOCK;
    size_t K = (size_t)c->cols;
    for (int i = 0; i < NX; i++)
        for (int k = full * CS_WCODE_BLOCK; k < c->cols; k++) xt[i][k - full * CS_WCODE_BLOCK] = x[i * K + (size_t)k];
}

/* block b of x's row: in place, or its copy in xt past the whole blocks */
KS_INLINE const float *wcode_x_block(const float *x, const float *xt, int b, int full) {
    return b < full ? x + (size_t)b * CS_WCODE_BLOCK : xt + (size_t)(b - full) * CS_WCODE_BLOCK;
}

KS_INLINE void wcode_prefetch(const uint8_t *row, int b, const int PF) {
    if (!PF) return;
    _mm_prefetch((const char *)row + cs_wcode_lo_at(b) + PF, _MM_HINT_T0);
    _mm_prefetch((const char *)row + cs_wcode_codes_at(b) + PF, _MM_HINT_T0);
}

/* one row of x: two accumulators a stream, added and summed once */
KS_INLINE int wcode_streams(float *y, const float *x, const cs_wcode_t *c, int r0, int r1, const int S, const int PF) {
    wcode_tbl_t tbl = wcode_table(c);
    wcode_walk_t k = wcode_walk(c, r0, r1, S);
    float xt[1][2 * CS_WCODE_BLOCK] __attribute__((aligned(4 * VF_LANES))) = {{0}};
    wcode_x_tail(xt, x, c, 1);
    for (int g = 0; g < k.per; g++) {
        const uint8_t *p = c->data + (size_t)(r0 + g) * k.rb;
        vf_t a0[8], a1[8];
#pragma GCC unroll 8
        for (int s = 0; s < S; s++) a0[s] = a1[s] = vf_zero();
        for (int b = 0; b < k.nb; b++) {
            const float *xb = wcode_x_block(x, xt[0], b, k.full);
#pragma GCC unroll 8
            for (int s = 0; s < S; s++) {
                const uint8_t *row = p + s * k.stride;
                wcode_prefetch(row, b, PF);
                wcode_fma2(row, b, tbl, xb, &a0[s], &a1[s]);
            }
        }
#pragma GCC unroll 8
        for (int s = 0; s < S; s++) {
            int r = r0 + s * k.per + g;
            y[r] = vf_hsum(vf_add(a0[s], a1[s])) + cs_wcode_exceptions(c, r, x);
        }
    }
    return r0 + k.per * S; /* the caller takes the rows left over */
}

/* NX rows of x (2..CS_WCODE_MAX_N, c->cols apart; y's rows ldy apart): each block decoded
 * once for all of them, one accumulator per stream and row */
KS_INLINE int wcode_streams_n(float *y, int ldy, const float *x, const cs_wcode_t *c, int r0, int r1, const int S,
                              const int PF, const int NX) {
    wcode_tbl_t tbl = wcode_table(c);
    wcode_walk_t k = wcode_walk(c, r0, r1, S);
    size_t K = (size_t)c->cols;
    float xt[CS_WCODE_MAX_N][2 * CS_WCODE_BLOCK] __attribute__((aligned(4 * VF_LANES))) = {{0}};
    wcode_x_tail(xt, x, c, NX);
    for (int g = 0; g < k.per; g++) {
        const uint8_t *p = c->data + (size_t)(r0 + g) * k.rb;
        vf_t a[8][CS_WCODE_MAX_N];
#pragma GCC unroll 8
        for (int s = 0; s < S; s++)
#pragma GCC unroll 4
            for (int i = 0; i < NX; i++) a[s][i] = vf_zero();
        for (int b = 0; b < k.nb; b++) {
            const float *xb[CS_WCODE_MAX_N];
#pragma GCC unroll 4
            for (int i = 0; i < NX; i++) xb[i] = wcode_x_block(x + i * K, xt[i], b, k.full);
#pragma GCC unroll 8
            for (int s = 0; s < S; s++) {
                const uint8_t *row = p + s * k.stride;
                wcode_prefetch(row, b, PF);
                wcode_fma_n(row, b, tbl, xb, a[s], NX);
            }
        }
#pragma GCC unroll 8
        for (int s = 0; s < S; s++) {
            int r = r0 + s * k.per + g;
#pragma GCC unroll 4
            for (int i = 0; i < NX; i++) y[(size_t)i * ldy + r] = vf_hsum(a[s][i]) + cs_wcode_exceptions(c, r, x + i * K);
        }
    }
    return r0 + k.per * S;
}

/* one row of x: `wide` streams PF_wide bytes ahead where more than 4 are asked for (else 2,
 * 384 ahead), the rows left over one stream without prefetch */
KS_INLINE void wcode_gemv(float *y, const float *x, const cs_wcode_t *c, int r0, int r1, int streams, const int wide,
                          const int PF_wide) {
    int done = streams <= 4 ? wcode_streams(y, x, c, r0, r1, 2, 384) : wcode_streams(y, x, c, r0, r1, wide, PF_wide);
    wcode_streams(y, x, c, done, r1, 1, 0);
}

KS_INLINE void wcode_rows_nx(float *y, int ldy, const float *x, const cs_wcode_t *c, int r0, int r1, const int NX) {
    int done = wcode_streams_n(y, ldy, x, c, r0, r1, 2, 384, NX);
    wcode_streams_n(y, ldy, x, c, done, r1, 1, 0, NX);
}

/* n rows of x (2..CS_WCODE_MAX_N): 2 streams 384 bytes ahead, the rest one stream */
KS_INLINE void wcode_rows_n(float *y, int ldy, const float *x, int n, const cs_wcode_t *c, int r0, int r1) {
    CS_ASSERT(n >= 2 && n <= CS_WCODE_MAX_N);
    switch (n) {
    case 2: wcode_rows_nx(y, ldy, x, c, r0, r1, 2); break;
    case 3: wcode_rows_nx(y, ldy, x, c, r0, r1, 3); break;
    default: wcode_rows_nx(y, ldy, x, c, r0, r1, 4); break;
    }
}

/* ---- packed GEMM (prefill): panels of PK_NR weight rows, tiles of PK_MR rows of x ---- */
/* acc[m][h] = Σ_k xt[k][m] · panel[k][h · VF_LANES ..] over [k0, k1), m < M */
KS_INLINE void packed_tile_sum(vf_t (*acc)[2], const float *xt, int k0, int k1, const float *panel, const int M) {
#pragma GCC unroll 12
    for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = vf_zero();
    for (int k = k0; k < k1; k++) {
        vf_t b0 = vf_load(panel + (size_t)k * PK_NR), b1 = vf_load(panel + (size_t)k * PK_NR + VF_LANES);
#pragma GCC unroll 12
        for (int m = 0; m < M; m++) {
            vf_t a = vf_bcast(xt + (size_t)k * PK_MR + m);
            acc[m][0] = vf_fmadd(a, b0, acc[m][0]);
            acc[m][1] = vf_fmadd(a, b1, acc[m][1]);
        }
    }
}

/* y[i, r] for i < n, r in [r0, r1): the task's rows widened into panels in wp, then K in
 * chunks of PK_KC, the first chunk stored into y, the others added */
KS_INLINE void packed_gemm(float *y, int ldy, const float *xp, int n, const cs_weight_t *w, int r0, int r1, float *wp) {
    int K = w->cols;
    for (int c = r0; c < r1; c += PK_NR) {
        int cols = r1 - c < PK_NR ? r1 - c : PK_NR;
        float *panel = wp + (size_t)(c - r0) * K;
        switch (w->dtype) {
        case CS_DTYPE_BF16: packed_panel(panel, w->data, K, c, cols, CS_DTYPE_BF16); break;
        case CS_DTYPE_F16: packed_panel(panel, w->data, K, c, cols, CS_DTYPE_F16); break;
        default: packed_panel(panel, w->data, K, c, cols, CS_DTYPE_F32); break;
        }
        for (int k0 = 0; k0 < K; k0 += PK_KC) {
            int k1 = K - k0 < PK_KC ? K : k0 + PK_KC;
            for (int m0 = 0; m0 < n; m0 += PK_MR)
                packed_rows(y + (size_t)m0 * ldy + c, ldy, xp + (size_t)m0 * K, k0, k1, panel,
                            n - m0 < PK_MR ? n - m0 : PK_MR, cols);
        }
    }
}

#endif
