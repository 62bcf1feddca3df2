/* gemm_bf16.c: y = x · Wᵀ for BF16 weights on Intel AMX, exact to F32 rounding of x.
 * Weights are exactly BF16; the F32 activations are split into BF16 terms
 * x = x₁ + x₂ (+ x₃) and every term is multiplied on the tile unit with F32
 * accumulation: two terms leave x's residual below 2⁻¹⁶ relative, three represent all 24
 * bits of an F32 mantissa. x is packed once per call into 16×32 tiles. Large n (prefill):
 * x is the A operand, each task packs its block of weight rows into VNNI tiles (B) and
 * walks 2×2 blocks of 16×16 F32 accumulator tiles over K in L1-sized chunks. Small n
 * (batched decode, memory-bound): W · xᵀ with W tiles loaded straight from the weights as
 * A and x in VNNI tiles as B, the next rows prefetched. The reference is cs_matmul_ref. */
#include <immintrin.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>

#include "cpu_kernels/kernels.h"
#include "cpu_kernels/vnni.h"

#define AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq")))
#define INLINE static inline __attribute__((always_inline))

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define TILE_ELEMS VNNI_TILE_ELEMS

int cs_cpu_has_amx_bf16(void) {
    static int cached = -1;
    if (cached >= 0) return cached;
    int ok = 0;
#if defined(__x86_64__)
    unsigned a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    bool tile = d >> 24 & 1, bf16 = d >> 22 & 1, avx512 = b >> 16 & 1 && b >> 30 & 1;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
    bool osxsave = c >> 27 & 1;
    if (tile && bf16 && avx512 && osxsave) {
        unsigned lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        /* XTILECFG and XTILEDATA state enabled by the OS; then ask for the tile data
         * permission, once per process (Linux ≥ 5.16) */
        if ((lo >> 17 & 3) == 3 && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0) ok = 1;
    }
#endif
    cached = ok;
    return ok;
}

#if defined(__x86_64__)

struct tilecfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* tiles 0-3: C (16×16 F32), 4-5: A (x, 16×32 bf16), 6-7: B (w, 16 pairs × 16 × 2 bf16) */
AMX static void tile_config(void) {
    struct tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
    _tile_loadconfig(&cfg);
}

/* 32 floats -> `terms` rows of 32 bf16 whose sum is x (to 2⁻¹⁶ relative, or exactly) */
AMX INLINE void split_store(uint16_t *dst, __m512 x0, __m512 x1, int terms) {
    __m512i v[3];
    vnni_split32(v, x0, x1, terms);
    for (int t = 0; t < terms; t++) _mm512_store_si512(dst + t * TILE_ELEMS, v[t]);
}

AMX void cs_gemm_bf16_pack_x(uint16_t *xp, const float *x, int n, int K, int terms, int mt0, int mt1) {
    int kb_n = (K + 31) / 32;
    for (int mt = mt0; mt < mt1; mt++)
        for (int r = 0; r < 16; r++) {
            int m = mt * 16 + r;
            for (int kb = 0; kb < kb_n; kb++) {
                uint16_t *dst = xp + ((size_t)(mt * kb_n + kb) * terms) * TILE_ELEMS + r * 32;
                if (m >= n) {
                    for (int t = 0; t < terms; t++) memset(dst + t * TILE_ELEMS, 0, 64);
                    continue;
                }
                const float *src = x + (size_t)m * K + kb * 32;
                int left = K - kb * 32;
                __mmask16 m0 = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
                __mmask16 m1 = left >= 32 ? 0xffff : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
                split_store(dst, _mm512_maskz_loadu_ps(m0, src), _mm512_maskz_loadu_ps(m1, src + 16), terms);
            }
        }
    /* small n: x is the B operand of W · xᵀ, in VNNI order (row i of a tile holds the pairs
     * (x[m][2i], x[m][2i+1]) of its 16 rows m) */
    if (n <= CS_AMX_SMALL_N)
        for (size_t t = (size_t)mt0 * kb_n * terms; t < (size_t)mt1 * kb_n * terms; t++) {
            uint16_t *tile = xp + t * TILE_ELEMS;
            __m512i r[16];
            for (int i = 0; i < 16; i++) r[i] = _mm512_load_si512(tile + i * 32);
            vnni_transpose16(r);
            for (int i = 0; i < 16; i++) _mm512_store_si512(tile + i * 32, r[i]);
        }
}

/* C tile (16 m × 16 n, F32 at tmp) into y rows [m0, m0+16) cols [n0, n0+16), clipped */
INLINE void store_clipped(float *y, int ldy, const float *tmp, int m0, int n, int n0, int r1) {
    int mm = CS_MIN(16, n - m0), nn = CS_MIN(16, r1 - n0);
    for (int i = 0; i < mm; i++) memcpy(y + (size_t)(m0 + i) * ldy + n0, tmp + i * 16, sizeof(float) * (size_t)nn);
}

/* k blocks per chunk for large n: a chunk of a 2-tile row pair of x (all terms) stays in L1
 * while the task's weight tiles for the chunk stream from L2 */
static int chunk_kb(int n, int terms, int kb_n) {
    if (n <= CS_AMX_SMALL_N) return kb_n;
    return terms == 3 ? 5 : 8;
}

size_t cs_gemm_bf16_wp_len(int n, int rows, int K, int terms) {
    if (n <= CS_AMX_SMALL_N) return 2 * TILE_ELEMS; /* zero-padded edge tiles */ /* two slots of a tile pair */
    int kb_n = (K + 31) / 32, kc = chunk_kb(n, terms, kb_n);
    size_t nt = (size_t)(rows + 31) / 32 * 2, mt = (size_t)(n + 31) / 32 * 2;
    size_t cbuf = kc < kb_n ? mt * nt * 256 * 2 : 0; /* F32 partial sums, in bf16 units */
    return nt * (size_t)kb_n * TILE_ELEMS + cbuf;
}

#define TDP(c, a, b) _tile_dpbf16ps(c, a, b)

#define SMALL_PREFETCH_KB 2

/* one 16-row × 32-column tile of w at (n0, kb) as the A operand: straight from the weights
 * when it lies inside them, else through a zero-padded copy */
AMX INLINE void load_w_tile(const cs_weight_t *w, int n0, int kb, uint16_t *pad, const uint16_t **src, int *stride) {
    int K = w->cols;
    const uint16_t *base = (const uint16_t *)w->data + (size_t)n0 * K + kb * 32;
    if (n0 + 16 <= w->rows && kb * 32 + 32 <= K) { *src = base; *stride = K * 2; return; }
    int left = K - kb * 32, valid = CS_MAX(0, CS_MIN(16, w->rows - n0));
    __mmask32 mk = left >= 32 ? 0xffffffffu : (__mmask32)((1u << left) - 1);
    for (int i = 0; i < 16; i++)
        _mm512_store_si512(pad + i * 32, i < valid ? _mm512_maskz_loadu_epi16(mk, base + (size_t)i * K) : _mm512_setzero_si512());
    *src = pad;
    *stride = 64;
}

/* C tile (16 weight rows × 16 x rows, F32 at tmp) into y, transposed and clipped */
INLINE void store_transposed(float *y, int ldy, const float *tmp, int m0, int n, int n0, int r1) {
    int mm = CS_MIN(16, n - m0), nn = CS_MIN(16, r1 - n0);
    for (int j = 0; j < mm; j++)
        for (int i = 0; i < nn; i++) y[(size_t)(m0 + j) * ldy + n0 + i] = tmp[i * 16 + j];
}

/* n ≤ CS_AMX_SMALL_N, memory-bound: C = W · xᵀ with W tiles loaded straight from the
 * weights (no packing; the next 32 rows, one contiguous stretch, are prefetched into L2 in
 * order meanwhile) and x in VNNI tiles; 2 weight-row tiles × 1 or 2 x-row tiles */
AMX static void gemm_small(float *y, int ldy, const uint16_t *xp, int n, int terms, const cs_weight_t *w, int r0,
                           int r1, uint16_t *pad) {
    int kb_n = (w->cols + 31) / 32, mt = (n + 15) / 16;
    size_t xs = (size_t)terms * TILE_ELEMS;
    float tmp[4][256] __attribute__((aligned(64)));
    tile_config();
    for (int n0 = r0; n0 < r1; n0 += 32) {
        const char *next = (const char *)((const uint16_t *)w->data + (size_t)(n0 + 32) * w->cols);
        size_t next_bytes = n0 + 32 < r1 ? (size_t)CS_MIN(32, r1 - n0 - 32) * w->cols * 2 : 0;
        size_t slice = (next_bytes / (size_t)kb_n + 63) & ~(size_t)63;
        for (int mp = 0; mp < mt; mp += 2) {
            bool two = mp + 1 < mt;
            const uint16_t *xa = xp + (size_t)mp * kb_n * xs, *xb = xa + (size_t)kb_n * xs;
            _tile_zero(0); _tile_zero(1);
            if (two) { _tile_zero(2); _tile_zero(3); }
            for (int kb = 0; kb < kb_n; kb++) {
                if (mp == 0)
                    for (size_t o = (size_t)kb * slice; o < CS_MIN(next_bytes, (size_t)(kb + 1) * slice); o += 64)
                        _mm_prefetch(next + o, _MM_HINT_T1);
                if (kb + SMALL_PREFETCH_KB < kb_n) /* the weight tiles a few k blocks on, into L1 */
                    for (int i = 0; i < CS_MIN(32, w->rows - n0); i++)
                        _mm_prefetch((const char *)((const uint16_t *)w->data + (size_t)(n0 + i) * w->cols +
                                                    (kb + SMALL_PREFETCH_KB) * 32), _MM_HINT_T0);
                const uint16_t *a0, *a1;
                int s0, s1;
                load_w_tile(w, n0, kb, pad, &a0, &s0);
                load_w_tile(w, n0 + 16, kb, pad + TILE_ELEMS, &a1, &s1);
                _tile_loadd(4, a0, s0);
                _tile_loadd(5, a1, s1);
                for (int t = 0; t < terms; t++) {
                    _tile_loadd(6, xa + kb * xs + t * TILE_ELEMS, 64);
                    TDP(0, 4, 6); TDP(1, 5, 6);
                    if (two) {
                        _tile_loadd(7, xb + kb * xs + t * TILE_ELEMS, 64);
                        TDP(2, 4, 7); TDP(3, 5, 7);
                    }
                }
            }
            int m0 = mp * 16;
            _tile_stored(0, tmp[0], 64); _tile_stored(1, tmp[1], 64);
            if (two) { _tile_stored(2, tmp[2], 64); _tile_stored(3, tmp[3], 64); }
            store_transposed(y, ldy, tmp[0], m0, n, n0, r1);
            if (n0 + 16 < r1) store_transposed(y, ldy, tmp[1], m0, n, n0 + 16, r1);
            if (two) {
                store_transposed(y, ldy, tmp[2], m0 + 16, n, n0, r1);
                if (n0 + 16 < r1) store_transposed(y, ldy, tmp[3], m0 + 16, n, n0 + 16, r1);
            }
        }
    }
    _tile_release();
}

AMX void cs_gemm_bf16_amx(float *y, int ldy, const uint16_t *xp, int n, int terms, const cs_weight_t *w, int r0,
                          int r1, uint16_t *wp) {
    if (n <= CS_AMX_SMALL_N) { gemm_small(y, ldy, xp, n, terms, w, r0, r1, wp); return; }
    int kb_n = (w->cols + 31) / 32, kc = chunk_kb(n, terms, kb_n);
    int nt = ((r1 - r0 + 31) / 32) * 2, mt = ((n + 31) / 32) * 2;
    size_t xs = (size_t)terms * TILE_ELEMS; /* bf16 between k blocks of one x tile row */
    float *cbuf = (float *)(wp + (size_t)nt * kb_n * TILE_ELEMS); /* [mt/2][nt/2][4][256] */
    float tmp[4][256] __attribute__((aligned(64)));
    vnni_pack_w(wp, w, r0, nt, 0, kb_n);
    tile_config();
    for (int kb0 = 0; kb0 < kb_n; kb0 += kc) {
        int kb1 = CS_MIN(kb_n, kb0 + kc), nk = kb1 - kb0;
        bool first = kb0 == 0, last = kb1 == kb_n;
        for (int mp = 0; mp < mt; mp += 2) {
            const uint16_t *xa = xp + ((size_t)mp * kb_n + kb0) * xs, *xb = xa + (size_t)kb_n * xs;
            for (int np = 0; np < nt; np += 2) {
                const uint16_t *wa = wp + ((size_t)np * kb_n + kb0) * TILE_ELEMS, *wb = wa + (size_t)kb_n * TILE_ELEMS;
                float *cb = cbuf + ((size_t)(mp / 2) * (nt / 2) + np / 2) * 4 * 256;
                if (first) {
                    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                } else {
                    _tile_loadd(0, cb, 64); _tile_loadd(1, cb + 256, 64);
                    _tile_loadd(2, cb + 512, 64); _tile_loadd(3, cb + 768, 64);
                }
                for (int kb = 0; kb < nk; kb++) {
                    _tile_loadd(6, wa + (size_t)kb * TILE_ELEMS, 64);
                    _tile_loadd(7, wb + (size_t)kb * TILE_ELEMS, 64);
                    for (int t = 0; t < terms; t++) {
                        _tile_loadd(4, xa + kb * xs + t * TILE_ELEMS, 64);
                        _tile_loadd(5, xb + kb * xs + t * TILE_ELEMS, 64);
                        TDP(0, 4, 6); TDP(1, 4, 7); TDP(2, 5, 6); TDP(3, 5, 7);
                    }
                }
                if (!last) {
                    _tile_stored(0, cb, 64); _tile_stored(1, cb + 256, 64);
                    _tile_stored(2, cb + 512, 64); _tile_stored(3, cb + 768, 64);
                    continue;
                }
                int m0 = mp * 16, n0 = r0 + np * 16;
                if (m0 + 32 <= n && n0 + 32 <= r1) {
                    float *yc = y + (size_t)m0 * ldy + n0;
                    _tile_stored(0, yc, ldy * 4);
                    _tile_stored(1, yc + 16, ldy * 4);
                    _tile_stored(2, yc + (size_t)16 * ldy, ldy * 4);
                    _tile_stored(3, yc + (size_t)16 * ldy + 16, ldy * 4);
                } else {
                    _tile_stored(0, tmp[0], 64); _tile_stored(1, tmp[1], 64);
                    _tile_stored(2, tmp[2], 64); _tile_stored(3, tmp[3], 64);
                    if (m0 < n && n0 < r1) store_clipped(y, ldy, tmp[0], m0, n, n0, r1);
                    if (m0 < n && n0 + 16 < r1) store_clipped(y, ldy, tmp[1], m0, n, n0 + 16, r1);
                    if (m0 + 16 < n && n0 < r1) store_clipped(y, ldy, tmp[2], m0 + 16, n, n0, r1);
                    if (m0 + 16 < n && n0 + 16 < r1) store_clipped(y, ldy, tmp[3], m0 + 16, n, n0 + 16, r1);
                }
            }
        }
    }
    _tile_release();
}

#else /* not x86-64: never called, cs_cpu_has_amx_bf16() is 0 */
void cs_gemm_bf16_pack_x(uint16_t *xp, const float *x, int n, int K, int terms, int mt0, int mt1) {
    (void)xp; (void)x; (void)n; (void)K; (void)terms; (void)mt0; (void)mt1;
    CS_ASSERT(!"no AMX");
}
void cs_gemm_bf16_amx(float *y, int ldy, const uint16_t *xp, int n, int terms, const cs_weight_t *w, int r0,
                      int r1, uint16_t *wp) {
    (void)y; (void)ldy; (void)xp; (void)n; (void)terms; (void)w; (void)r0; (void)r1; (void)wp;
    CS_ASSERT(!"no AMX");
}
#endif
