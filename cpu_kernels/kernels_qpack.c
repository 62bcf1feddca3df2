/* kernels_qpack.c: --precision int8 over quantized weights repacked 16 rows at a time
 * (cs_qpack_t, kernels.h), on AVX512-VNNI and on AVX2.
 *
 * vpdpbusd multiplies 4 unsigned bytes by 4 signed bytes and adds the 4 products to a 32-bit
 * lane. The pack puts each row of a group of 16 in its own lane: 64 bytes hold 4 columns
 * (4 bytes, or 8 nibbles) of 16 rows, so one vpdpbusd whose signed operand is x's 4 quantized
 * columns broadcast from memory advances 16 dot products by 4 columns, with no horizontal
 * sums; the blocks' scales come as vectors over the 16 rows. The weights are the unsigned
 * operand: Q8_0's q + 128 (its offset taken off against x's sums per 32), Q4_K's nibbles,
 * Q6_K's six bits (its -32 likewise, against sums per 16). The integer parts are exact; the
 * scales are applied in F32 per block (Q8_0) or super-block (the K types, whose sub-block
 * scales multiply in integers): what cs_qgemv_int8_ref computes, up to F32 rounding.
 *
 * Group layouts (per block of the type, the blocks of a group in column order; a group is
 * 16 rows x cols, cs_qpack_t.group_bytes):
 *   Q8_0 (pairs of 32-column blocks, 1088 bytes): d[2][16] (F16); q[2][8][16][4]: word k
 *     of row r = columns 4k..4k+3 of the block, each q + 128 (an odd last block: a pair
 *     whose second half is unused).
 *   Q4_K (256 columns, 2368 bytes): d[16], dmin[16] (F16); sc[8][16], m[8][16] (6-bit, one
 *     byte each); qs[4][8][16][4]: the original qs bytes 32p + 4k .. + 3 of row r (low
 *     nibbles columns 64p + 4k + i, high nibbles 64p + 32 + 4k + i).
 *   Q5_K (256 columns, 2880 bytes): Q4_K's layout with qh[8][16][4] before qs: qh bytes
 *     4k .. + 3 of row r (bit j of byte i: the fifth bit of column 32j + 4k + i), which every
 *     sub-block reads (ahead of qs in memory, so the prefetches ahead bring them in time).
 *   Q6_K (256 columns, 3392 bytes): d[16] (F16), 32 unused; sc[16][16] (signed); ql[2][2][8][16][4]:
 *     ql bytes 64h + 32t + 4k .. + 3 (low nibbles columns 128h + 32t + 4k + i, high
 *     128h + 32(t + 2) + 4k + i); qh[2][8][16][4]: qh bytes 32h + 4k .. + 3 (bits 2t, 2t + 1
 *     of byte i: quarter t, column 128h + 32t + 4k + i).
 * Each is the type's own bytes per row (34, 144, 176, 210 per block) rearranged, with every
 * 64-byte vector aligned; Q4_K's 12 scale bytes become 16, Q6_K's block gains 2 bytes a row. */
#include <immintrin.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <string.h>

#include "base/quant.h"
#include "cpu_kernels/kernels.h"

#define G CS_QPACK_ROWS
/* bytes of one group's six-bit values unpacked (cs_qpack_q6k_unpack): 64 per step, 4 steps
 * of 8 in each half of each 256-column block */
#define Q6U_GROUP(cols) ((size_t)(cols) / 256 * 4096)
_Static_assert(CS_QGEMV_MAX_N <= CS_QPACK_MAX_N, "the backend hands the int8 kernels up to CS_QGEMV_MAX_N rows");

static size_t pack_block_bytes(cs_dtype dt) {
    switch (dt) {
    case CS_DTYPE_Q8_0: return 544; /* half of a pair */
    case CS_DTYPE_Q4_K: return 64 + 256 + 2048;
    case CS_DTYPE_Q5_K: return 64 + 256 + 2048 + 512;
    case CS_DTYPE_Q6_K: return 64 + 256 + 2048 + 1024;
    default: return 0;
    }
}

int cs_cpu_has_avx512_vnni(void) {
    __builtin_cpu_init();
    return cs_cpu_has_avx512() && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
}

bool cs_qpack_supports(cs_dtype dt, int rows, int cols) {
    return pack_block_bytes(dt) && rows > 0 && rows % G == 0 && cols > 0 && cols % cs_dtype_block(dt) == 0;
}

/* ---- the arena ----
 * A model's packs are carved one after another out of large mappings in huge pages: a
 * matrix's pack alone would get huge pages only for its whole 2 MiB (a 1024 x 1024 Q8_0
 * matrix, 1.1 MB, none), and reading packs from 4 KiB pages measured 0.8x the AVX2 kernels on
 * the weights (in huge pages) at batch 1, two threads. A chunk is unmapped when its last pack
 * is freed and the arena has moved on (base-weight pushes free the old packs); the arena's
 * current chunk then starts over; untouched parts of a mapping cost nothing. */
#define QPACK_CHUNK ((size_t)256 << 20)

struct cs_qpack_chunk {
    uint8_t *base;
    size_t len, used;
    int refs;                    /* live packs, and the arena while it allocates from it */
    struct cs_qpack_arena *from; /* that arena (NULL once it is freed) */
};

struct cs_qpack_arena {
    struct cs_qpack_chunk *cur;
};

/* every arena's and chunk's counts and links: packs come and go at model loads only */
static pthread_mutex_t arena_mu = PTHREAD_MUTEX_INITIALIZER;

/* under arena_mu. The arena's current chunk, its last pack freed, starts over: its touched
 * pages are given back (a model's packs freed, e.g. by a weight update or sleep, leave no
 * resident chunk behind), and the next model's packs fill it from the start. */
static void chunk_unref_locked(struct cs_qpack_chunk *c) {
    if (!c) return;
    if (--c->refs == 0) {
        cs_huge_free(c->base, c->len);
        free(c);
    } else if (c->refs == 1 && c->from && c->from->cur == c && c->used) {
        (void)madvise(c->base, c->len, MADV_DONTNEED);
        c->used = 0;
    }
}

static void chunk_unref(struct cs_qpack_chunk *c) {
    pthread_mutex_lock(&arena_mu);
    chunk_unref_locked(c);
    pthread_mutex_unlock(&arena_mu);
}

cs_qpack_arena_t *cs_qpack_arena_new(void) { return calloc(1, sizeof(cs_qpack_arena_t)); }

void cs_qpack_arena_free(cs_qpack_arena_t *a) {
    if (!a) return;
    pthread_mutex_lock(&arena_mu);
    if (a->cur) a->cur->from = NULL;
    chunk_unref_locked(a->cur);
    pthread_mutex_unlock(&arena_mu);
    free(a);
}

/* n bytes, 64-aligned, from the arena's chunk (a new one when it is full) */
static uint8_t *arena_take(cs_qpack_arena_t *a, size_t n, struct cs_qpack_chunk **from) {
    n = (n + 63) & ~(size_t)63;
    pthread_mutex_lock(&arena_mu);
    if (!a->cur || a->cur->len - a->cur->used < n) {
        struct cs_qpack_chunk *c = calloc(1, sizeof *c);
        size_t want = n > QPACK_CHUNK ? n : QPACK_CHUNK;
        if (c && !(c->base = cs_huge_alloc(want, &c->len))) {
            free(c);
            c = NULL;
        }
        if (!c) {
            pthread_mutex_unlock(&arena_mu);
            return NULL;
        }
        c->refs = 1;
        c->from = a;
        if (a->cur) a->cur->from = NULL;
        chunk_unref_locked(a->cur);
        a->cur = c;
    }
    uint8_t *p = a->cur->base + a->cur->used;
    a->cur->used += n;
    a->cur->refs++;
    *from = a->cur;
    pthread_mutex_unlock(&arena_mu);
    return p;
}

cs_qpack_t *cs_qpack_new(cs_dtype dt, int rows, int cols, cs_qpack_arena_t *arena) {
    if (!cs_qpack_supports(dt, rows, cols)) return NULL;
    cs_qpack_t *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->dtype = dt;
    p->rows = rows;
    p->cols = cols;
    int nb = cols / cs_dtype_block(dt);
    p->group_bytes = (size_t)(dt == CS_DTYPE_Q8_0 ? (nb + 1) / 2 * 2 : nb) * pack_block_bytes(dt);
    size_t n = p->group_bytes * (size_t)(rows / G);
    p->data = arena ? arena_take(arena, n, &p->chunk) : cs_huge_alloc(n, &p->data_len);
    if (!p->data) {
        free(p);
        return NULL;
    }
    return p;
}

void cs_qpack_free(cs_qpack_t *p) {
    if (!p) return;
    if (p->chunk) chunk_unref(p->chunk);
    else cs_huge_free(p->data, p->data_len);
    free(p);
}

size_t cs_qpack_bytes(const cs_qpack_t *p) { return p ? p->group_bytes * (size_t)(p->rows / G) : 0; }

/* groups [g0, g1) of w (its dtype, rows and cols those of p) rearranged into p */
void cs_qpack_fill(cs_qpack_t *p, const cs_weight_t *w, int g0, int g1) {
    const cs_dtype dt = p->dtype;
    const int nb = p->cols / cs_dtype_block(dt);
    const size_t bsz = cs_dtype_size(dt), rb = (size_t)nb * bsz, pb = pack_block_bytes(dt);
    for (int g = g0; g < g1; g++)
        for (int b = 0; b < nb; b++) {
            uint8_t *o = p->data + (size_t)g * p->group_bytes + (size_t)b * pb;
            uint8_t *od = o, *oq = o + 32; /* Q8_0: the pair's scales, then its quants */
            if (dt == CS_DTYPE_Q8_0) {
                o = p->data + (size_t)g * p->group_bytes + (size_t)(b / 2) * 1088;
                od = o + 32 * (b & 1);
                oq = o + 64 + 512 * (b & 1);
            }
            for (int r = 0; r < G; r++) {
                const uint8_t *blk = (const uint8_t *)w->data + (size_t)(G * g + r) * rb + (size_t)b * bsz;
                if (dt == CS_DTYPE_Q8_0) {
                    const cs_block_q8_0 *k = (const void *)blk;
                    memcpy(od + 2 * r, &k->d, 2);
                    for (int c = 0; c < 32; c++) oq[(c / 4 * G + r) * 4 + c % 4] = (uint8_t)(k->qs[c] ^ 0x80);
                } else if (dt == CS_DTYPE_Q4_K) {
                    const cs_block_q4_K *k = (const void *)blk;
                    memcpy(o + 2 * r, &k->d, 2);
                    memcpy(o + 32 + 2 * r, &k->dmin, 2);
                    for (int j = 0; j < 8; j++) cs_q4k_scale_min(j, k->scales, o + 64 + j * G + r, o + 192 + j * G + r);
                    for (int q = 0; q < 128; q++) /* byte q = 32p + 4k + i */
                        o[320 + ((q / 4) * G + r) * 4 + q % 4] = k->qs[q];
                } else if (dt == CS_DTYPE_Q5_K) {
                    const cs_block_q5_K *k = (const void *)blk;
                    memcpy(o + 2 * r, &k->d, 2);
                    memcpy(o + 32 + 2 * r, &k->dmin, 2);
                    for (int j = 0; j < 8; j++) cs_q4k_scale_min(j, k->scales, o + 64 + j * G + r, o + 192 + j * G + r);
                    for (int q = 0; q < 32; q++) o[320 + ((q / 4) * G + r) * 4 + q % 4] = k->qh[q];
                    for (int q = 0; q < 128; q++) o[832 + ((q / 4) * G + r) * 4 + q % 4] = k->qs[q];
                } else {
                    const cs_block_q6_K *k = (const void *)blk;
                    memcpy(o + 2 * r, &k->d, 2);
                    memset(o + 32 + 2 * r, 0, 2);
                    for (int j = 0; j < 16; j++) o[64 + j * G + r] = (uint8_t)k->scales[j];
                    for (int q = 0; q < 128; q++) /* byte q = 64h + 32t + 4k + i: word index q / 4 */
                        o[320 + ((q / 4) * G + r) * 4 + q % 4] = k->ql[q];
                    for (int q = 0; q < 64; q++) o[2368 + ((q / 4) * G + r) * 4 + q % 4] = k->qh[q];
                }
            }
        }
}

/* ---- the kernels ---- */
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,f16c,fma")))
#define INLINE static inline __attribute__((always_inline))

/* x's 4 quantized columns at p, in every lane (the compiler folds it into vpdpbusd's {1to16}) */
VNNI INLINE __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

VNNI INLINE __m512 f16x16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

/* Software prefetch QPACK_AHEAD bytes ahead, spread over a block's steps: a block's vectors
 * are read out of address order (scales, then quants by sub-block), which the hardware
 * prefetchers follow too late for one core's consumption (Q6_K at one thread: half the AVX2
 * kernel's speed without); step s of `steps` fetches the lines of its share of the block. */
#define QPACK_AHEAD 3072
#ifndef Q5_AHEAD
#define Q5_AHEAD 12288
#endif
INLINE void prefetch_step_at(const uint8_t *blk, size_t bytes, int s, int steps, size_t ahead) {
    size_t a = bytes * (size_t)s / (size_t)steps, z = bytes * (size_t)(s + 1) / (size_t)steps;
    for (size_t o = a & ~(size_t)63; o < z; o += 64) _mm_prefetch((const char *)blk + ahead + o, _MM_HINT_T0);
}
INLINE void prefetch_step(const uint8_t *blk, size_t bytes, int s, int steps) {
    prefetch_step_at(blk, bytes, s, steps, QPACK_AHEAD);
}

VNNI INLINE void q8_0_t(float *y, int ldy, const int8_t *qx, const float *dx, const float *sx, const int n,
                        const cs_qpack_t *p, int g0, int g1) {
    const int nb = p->cols / 32;
    for (int g = g0; g < g1; g++) {
        const uint8_t *base = p->data + (size_t)g * p->group_bytes;
        __m512 acc[CS_QPACK_MAX_N];
#pragma GCC unroll 4
        for (int i = 0; i < n; i++) acc[i] = _mm512_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const uint8_t *o = base + (size_t)(b / 2) * 1088, *od = o + 32 * (b & 1), *oq = o + 64 + 512 * (b & 1);
            /* up to 2 rows of x: a second chain of sums for the odd k (vpdpbusd's latency) */
            __m512i s[CS_QPACK_MAX_N], s2[CS_QPACK_MAX_N];
#pragma GCC unroll 4
            for (int i = 0; i < n; i++) {
                s[i] = _mm512_set1_epi32(-128 * (int)sx[(size_t)i * nb + b]);
                s2[i] = _mm512_setzero_si512();
            }
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) {
                prefetch_step(o, 1088, 8 * (b & 1) + k, 16); /* the pair, over its two blocks' steps */
                __m512i wv = _mm512_load_si512((const void *)(oq + 64 * k));
#pragma GCC unroll 4
                for (int i = 0; i < n; i++) {
                    __m512i xv = bcast4(qx + (size_t)i * p->cols + 32 * (size_t)b + 4 * k);
                    if (n <= 2 && (k & 1)) s2[i] = _mm512_dpbusd_epi32(s2[i], wv, xv);
                    else s[i] = _mm512_dpbusd_epi32(s[i], wv, xv);
                }
            }
#pragma GCC unroll 4
            for (int i = 0; i < n && n <= 2; i++) s[i] = _mm512_add_epi32(s[i], s2[i]);
            __m512 d = f16x16(od);
#pragma GCC unroll 4
            for (int i = 0; i < n; i++)
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]), _mm512_mul_ps(d, _mm512_set1_ps(dx[(size_t)i * nb + b])), acc[i]);
        }
#pragma GCC unroll 4
        for (int i = 0; i < n; i++) _mm512_storeu_ps(y + (size_t)i * ldy + (size_t)G * g, acc[i]);
    }
}

/* Q4_K, and Q5_K (q5: the fifth bits from qh, bit 2pr of a byte for the low nibbles'
 * column, 2pr + 1 for the high nibbles') */
VNNI INLINE void q4_k_t(float *y, int ldy, const int8_t *qx, const float *dx, const float *sx, const bool q5,
                        const int n, const cs_qpack_t *p, int g0, int g1) {
    const int nb = p->cols / 256, groups = p->cols / 32;
    const size_t bb = q5 ? 2880 : 2368, qs0 = q5 ? 832 : 320; /* Q5_K: qh at 320 */
    const __m512i lo4 = _mm512_set1_epi8(0x0F), one = _mm512_set1_epi8(1);
    for (int g = g0; g < g1; g++) {
        const uint8_t *base = p->data + (size_t)g * p->group_bytes;
        __m512 acc[CS_QPACK_MAX_N];
#pragma GCC unroll 4
        for (int i = 0; i < n; i++) acc[i] = _mm512_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const uint8_t *o = base + (size_t)b * bb;
            __m512i isum[CS_QPACK_MAX_N];
#pragma GCC unroll 4
            for (int i = 0; i < n; i++) isum[i] = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int pr = 0; pr < 4; pr++) {
                /* one row of x: second chains for the odd k (vpdpbusd's latency) */
                __m512i a0[CS_QPACK_MAX_N], a1[CS_QPACK_MAX_N], b0[CS_QPACK_MAX_N], b1[CS_QPACK_MAX_N];
#pragma GCC unroll 4
                for (int i = 0; i < n; i++) a0[i] = a1[i] = b0[i] = b1[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
                for (int k = 0; k < 8; k++) {
                    prefetch_step_at(o, bb, 8 * pr + k, 32, q5 ? Q5_AHEAD : QPACK_AHEAD);
                    __m512i v = _mm512_load_si512((const void *)(o + qs0 + 64 * (8 * pr + k)));
                    __m512i l = _mm512_and_si512(v, lo4), h = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
                    if (q5) {
                        __m512i hv = _mm512_load_si512((const void *)(o + 320 + 64 * k));
                        l = _mm512_or_si512(l, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hv, 2 * pr), one), 4));
                        h = _mm512_or_si512(h, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hv, 2 * pr + 1), one), 4));
                    }
#pragma GCC unroll 4
                    for (int i = 0; i < n; i++) {
                        const int8_t *xi = qx + (size_t)i * p->cols + 256 * (size_t)b + 64 * pr + 4 * k;
                        if (n == 1 && (k & 1)) {
                            b0[i] = _mm512_dpbusd_epi32(b0[i], l, bcast4(xi));
                            b1[i] = _mm512_dpbusd_epi32(b1[i], h, bcast4(xi + 32));
                        } else {
                            a0[i] = _mm512_dpbusd_epi32(a0[i], l, bcast4(xi));
                            a1[i] = _mm512_dpbusd_epi32(a1[i], h, bcast4(xi + 32));
                        }
                    }
                }
                if (n == 1) a0[0] = _mm512_add_epi32(a0[0], b0[0]), a1[0] = _mm512_add_epi32(a1[0], b1[0]);
                __m512i s0 = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(o + 64 + 32 * pr)));
                __m512i s1 = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(o + 64 + 32 * pr + 16)));
#pragma GCC unroll 4
                for (int i = 0; i < n; i++)
                    isum[i] = _mm512_add_epi32(isum[i], _mm512_add_epi32(_mm512_mullo_epi32(a0[i], s0), _mm512_mullo_epi32(a1[i], s1)));
            }
            /* Σ_j m_j Σ x over sub-block j, in F32 (the sums of x per 32 are F32 already) */
            __m512 msum[CS_QPACK_MAX_N];
#pragma GCC unroll 4
            for (int i = 0; i < n; i++) msum[i] = _mm512_setzero_ps();
            for (int j = 0; j < 8; j++) {
                __m512 m = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(o + 192 + 16 * j))));
#pragma GCC unroll 4
                for (int i = 0; i < n; i++)
                    msum[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[(size_t)i * groups + 8 * (size_t)b + j]), msum[i]);
            }
            __m512 d = f16x16(o), dmin = f16x16(o + 32);
#pragma GCC unroll 4
            for (int i = 0; i < n; i++) {
                __m512 dd = _mm512_set1_ps(dx[(size_t)i * nb + b]);
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), _mm512_mul_ps(d, dd), acc[i]);
                acc[i] = _mm512_fnmadd_ps(msum[i], _mm512_mul_ps(dmin, dd), acc[i]);
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < n; i++) _mm512_storeu_ps(y + (size_t)i * ldy + (size_t)G * g, acc[i]);
    }
}

/* the four vectors of six-bit values (0..63) of step k of half h of the block at o: columns
 * 128h + 32t + 4k .. + 3 of the 16 rows, t < 4 */
VNNI INLINE void q6_k_quads(__m512i q[4], const uint8_t *o, int h, int k, __m512i lo4, __m512i b45) {
    __m512i l0 = _mm512_load_si512((const void *)(o + 320 + 64 * (16 * h + k)));
    __m512i l1 = _mm512_load_si512((const void *)(o + 320 + 64 * (16 * h + 8 + k)));
    __m512i qh = _mm512_load_si512((const void *)(o + 2368 + 64 * (8 * h + k)));
    q[0] = _mm512_or_si512(_mm512_and_si512(l0, lo4), _mm512_and_si512(_mm512_slli_epi16(qh, 4), b45));
    q[1] = _mm512_or_si512(_mm512_and_si512(l1, lo4), _mm512_and_si512(_mm512_slli_epi16(qh, 2), b45));
    q[2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l0, 4), lo4), _mm512_and_si512(qh, b45));
    q[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1, 4), lo4), _mm512_and_si512(_mm512_srli_epi16(qh, 2), b45));
}

/* s16: Σ q_x over each 16 columns, per row of x (cols / 16 apart); unp: the six-bit values
 * come from u (cs_qpack_q6k_unpack of groups g0 ..), not from the pack */
VNNI INLINE void q6_k_t(float *y, int ldy, const int8_t *qx, const float *dx, const int32_t *s16, const bool unp,
                        const uint8_t *u, const int n, const cs_qpack_t *p, int g0, int g1) {
    const int nb = p->cols / 256, n16 = p->cols / 16;
    const __m512i lo4 = _mm512_set1_epi8(0x0F), b45 = _mm512_set1_epi8(0x30);
    for (int g = g0; g < g1; g++) {
        const uint8_t *base = p->data + (size_t)g * p->group_bytes;
        __m512 acc[CS_QPACK_MAX_N];
#pragma GCC unroll 4
        for (int i = 0; i < n; i++) acc[i] = _mm512_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const uint8_t *o = base + (size_t)b * 3392;
            __m512i isum[CS_QPACK_MAX_N];
#pragma GCC unroll 4
            for (int i = 0; i < n; i++) isum[i] = _mm512_setzero_si512();
            for (int h = 0; h < 2; h++)
                for (int kh = 0; kh < 2; kh++) { /* columns 128h + 32t + 16kh .. + 15: sub-block 8h + 2t + kh */
                    __m512i a[4][CS_QPACK_MAX_N];
#pragma GCC unroll 4
                    for (int t = 0; t < 4; t++)
#pragma GCC unroll 4
                        for (int i = 0; i < n; i++) a[t][i] = _mm512_setzero_si512();
#pragma GCC unroll 4
                    for (int k = 4 * kh; k < 4 * kh + 4; k++) {
                        __m512i q[4];
                        if (unp) {
                            const uint8_t *uq = u + (size_t)(g - g0) * Q6U_GROUP(p->cols) + (((size_t)b * 2 + h) * 8 + k) * 256;
#pragma GCC unroll 4
                            for (int t = 0; t < 4; t++) q[t] = _mm512_loadu_si512((const void *)(uq + 64 * t));
                        } else {
                            prefetch_step(o, 3392, 8 * h + k, 16);
                            q6_k_quads(q, o, h, k, lo4, b45);
                        }
#pragma GCC unroll 4
                        for (int t = 0; t < 4; t++)
#pragma GCC unroll 4
                            for (int i = 0; i < n; i++)
                                a[t][i] = _mm512_dpbusd_epi32(a[t][i], q[t],
                                                              bcast4(qx + (size_t)i * p->cols + 256 * (size_t)b + 128 * h + 32 * t + 4 * k));
                    }
#pragma GCC unroll 4
                    for (int t = 0; t < 4; t++) {
                        int j = 8 * h + 2 * t + kh;
                        __m512i sc = _mm512_cvtepi8_epi32(_mm_load_si128((const __m128i *)(o + 64 + 16 * j)));
#pragma GCC unroll 4
                        for (int i = 0; i < n; i++) {
                            __m512i v = _mm512_sub_epi32(a[t][i], _mm512_set1_epi32(32 * s16[(size_t)i * n16 + 16 * (size_t)b + j]));
                            isum[i] = _mm512_add_epi32(isum[i], _mm512_mullo_epi32(v, sc));
                        }
                    }
                }
            __m512 d = f16x16(o);
#pragma GCC unroll 4
            for (int i = 0; i < n; i++)
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), _mm512_mul_ps(d, _mm512_set1_ps(dx[(size_t)i * nb + b])), acc[i]);
        }
#pragma GCC unroll 4
        for (int i = 0; i < n; i++) _mm512_storeu_ps(y + (size_t)i * ldy + (size_t)G * g, acc[i]);
    }
}

#define PER_N(F, ...)                                                                                                  \
    switch (n) {                                                                                                       \
    case 1: F(__VA_ARGS__, 1, p, g0, g1); break;                                                                      \
    case 2: F(__VA_ARGS__, 2, p, g0, g1); break;                                                                      \
    case 3: F(__VA_ARGS__, 3, p, g0, g1); break;                                                                      \
    default: F(__VA_ARGS__, 4, p, g0, g1); break;                                                                     \
    }

VNNI static void q8_0_n(float *y, int ldy, const int8_t *qx, const float *dx, const float *sx, int n, const cs_qpack_t *p,
                        int g0, int g1) {
    PER_N(q8_0_t, y, ldy, qx, dx, sx)
}
VNNI static void q4_k_n(float *y, int ldy, const int8_t *qx, const float *dx, const float *sx, int n, const cs_qpack_t *p,
                        int g0, int g1) {
    PER_N(q4_k_t, y, ldy, qx, dx, sx, false)
}
VNNI static void q5_k_n(float *y, int ldy, const int8_t *qx, const float *dx, const float *sx, int n, const cs_qpack_t *p,
                        int g0, int g1) {
    PER_N(q4_k_t, y, ldy, qx, dx, sx, true)
}
VNNI static void q6_k_n(float *y, int ldy, const int8_t *qx, const float *dx, const int32_t *s16, int n,
                        const cs_qpack_t *p, int g0, int g1) {
    PER_N(q6_k_t, y, ldy, qx, dx, s16, false, NULL)
}
VNNI static void q6_k_un(float *y, int ldy, const int8_t *qx, const float *dx, const int32_t *s16, const uint8_t *u, int n,
                         const cs_qpack_t *p, int g0, int g1) {
    PER_N(q6_k_t, y, ldy, qx, dx, s16, true, u)
}
#undef PER_N

void cs_qgemv_int8_vnni(float *y, int ldy, const int8_t *qx, const float *dx, const float *sx, const int32_t *s16, int n,
                        const cs_qpack_t *p, int r0, int r1) {
    CS_ASSERT(n >= 1 && n <= CS_QPACK_MAX_N && r0 % G == 0 && (r1 % G == 0 || r1 == p->rows) && r1 <= p->rows);
    int g0 = r0 / G, g1 = r1 / G;
    switch (p->dtype) {
    case CS_DTYPE_Q8_0: q8_0_n(y, ldy, qx, dx, sx, n, p, g0, g1); break;
    case CS_DTYPE_Q4_K: q4_k_n(y, ldy, qx, dx, sx, n, p, g0, g1); break;
    case CS_DTYPE_Q5_K: q5_k_n(y, ldy, qx, dx, sx, n, p, g0, g1); break;
    case CS_DTYPE_Q6_K: CS_ASSERT(s16); q6_k_n(y, ldy, qx, dx, s16, n, p, g0, g1); break;
    default: CS_ASSERT(!"packed dtype");
    }
}

size_t cs_qpack_q6k_unpacked_bytes(const cs_qpack_t *p) { return Q6U_GROUP(p->cols); }

VNNI void cs_qpack_q6k_unpack(uint8_t *dst, const cs_qpack_t *p, int r0, int r1) {
    CS_ASSERT(p->dtype == CS_DTYPE_Q6_K && r0 % G == 0 && (r1 % G == 0 || r1 == p->rows) && r1 <= p->rows);
    const __m512i lo4 = _mm512_set1_epi8(0x0F), b45 = _mm512_set1_epi8(0x30);
    for (int g = r0 / G; g < (r1 + G - 1) / G; g++) {
        const uint8_t *base = p->data + (size_t)g * p->group_bytes;
        for (int b = 0; b < p->cols / 256; b++)
            for (int h = 0; h < 2; h++)
                for (int k = 0; k < 8; k++) {
                    __m512i q[4];
                    q6_k_quads(q, base + (size_t)b * 3392, h, k, lo4, b45);
                    for (int t = 0; t < 4; t++) _mm512_storeu_si512((void *)(dst + 64 * t), q[t]);
                    dst += 256;
                }
    }
}

void cs_qgemv_int8_vnni_q6u(float *y, int ldy, const int8_t *qx, const float *dx, const int32_t *s16, int n,
                            const cs_qpack_t *p, int r0, int r1, const uint8_t *u) {
    CS_ASSERT(p->dtype == CS_DTYPE_Q6_K && n >= 1 && n <= CS_QPACK_MAX_N && r0 % G == 0 &&
              (r1 % G == 0 || r1 == p->rows) && r1 <= p->rows && s16 && u);
    q6_k_un(y, ldy, qx, dx, s16, u, n, p, r0 / G, (r1 + G - 1) / G);
}

void cs_act_sums16(int32_t *s16, const int8_t *q, int64_t n) {
    for (int64_t g = 0; g < n / 16; g++) {
        int s = 0;
        for (int j = 0; j < 16; j++) s += q[16 * g + j];
        s16[g] = s;
    }
}

/* ---- the same packs on AVX2 (no VNNI) ----
 * A 64-byte vector of a pack is two 32-byte halves: rows 0-7, then rows 8-15. Each block is
 * read half by half (the second half from L1). vpmaddubsw multiplies the unsigned weight bytes
 * by x's signed bytes and adds pairs into 16 bits; vpmaddwd then adds the pairs into 32 bits,
 * times the sub-block's integer scale where the type has one (a 32-bit lane holds the scale
 * in both 16-bit halves), so a lane gets what vpdpbusd (times the scale) gives it. The pairs
 * stay below 2^15: Q4_K's nibbles and Q6_K's six bits as they are (2 · 63 · 127 at most);
 * Q8_0's bytes back to signed q, as |q| against x with q's sign (2 · 128 · 127). Every
 * integer is the VNNI kernel's, and the F32 steps are its steps in its order: the results are
 * cs_qgemv_int8_vnni's, bit for bit. */
#define PAVX2 __attribute__((target("avx2,fma,f16c")))

PAVX2 INLINE __m256i bcast4y(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

PAVX2 INLINE __m256 f16x8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* 8 unsigned bytes at p (one per row), each as a 16-bit pair (s, s) in its 32-bit lane */
PAVX2 INLINE __m256i scale_pairs_u8(const uint8_t *p) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_or_si256(v, _mm256_slli_epi32(v, 16));
}

PAVX2 INLINE __m256i dot_u8s8(__m256i wu, __m256i xs, __m256i pairs) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(wu, xs), pairs);
}

#define PREFETCH_HALF(hf, ...) \
    do {                       \
        if ((hf) == 0) prefetch_step(__VA_ARGS__); \
    } while (0)

PAVX2 INLINE void q8_0_a2(float *y, int ldy, const int8_t *qx, const float *dx, const int n, const cs_qpack_t *p, int g0,
                          int g1) {
    const int nb = p->cols / 32;
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    for (int g = g0; g < g1; g++) {
        const uint8_t *base = p->data + (size_t)g * p->group_bytes;
        __m256 acc[2][CS_QPACK_MAX_N];
        for (int hf = 0; hf < 2; hf++)
#pragma GCC unroll 4
            for (int i = 0; i < n; i++) acc[hf][i] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const uint8_t *o = base + (size_t)(b / 2) * 1088, *od = o + 32 * (b & 1), *oq = o + 64 + 512 * (b & 1);
            for (int hf = 0; hf < 2; hf++) {
                __m256i s[CS_QPACK_MAX_N];
#pragma GCC unroll 4
                for (int i = 0; i < n; i++) s[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
                for (int k = 0; k < 8; k++) {
                    PREFETCH_HALF(hf, o, 1088, 8 * (b & 1) + k, 16);
                    __m256i wq = _mm256_xor_si256(_mm256_load_si256((const __m256i *)(oq + 64 * k + 32 * hf)), flip);
                    __m256i wa = _mm256_sign_epi8(wq, wq); /* |q| (-128 stays 0x80: 128 unsigned) */
#pragma GCC unroll 4
                    for (int i = 0; i < n; i++) {
                        __m256i xv = _mm256_sign_epi8(bcast4y(qx + (size_t)i * p->cols + 32 * (size_t)b + 4 * k), wq);
                        s[i] = _mm256_add_epi32(s[i], dot_u8s8(wa, xv, ones));
                    }
                }
                __m256 d = f16x8(od + 16 * hf);
#pragma GCC unroll 4
                for (int i = 0; i < n; i++)
                    acc[hf][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i]),
                                                 _mm256_mul_ps(d, _mm256_set1_ps(dx[(size_t)i * nb + b])), acc[hf][i]);
            }
        }
        for (int hf = 0; hf < 2; hf++)
#pragma GCC unroll 4
            for (int i = 0; i < n; i++) _mm256_storeu_ps(y + (size_t)i * ldy + (size_t)G * g + 8 * hf, acc[hf][i]);
    }
}

PAVX2 INLINE void q4_k_a2(float *y, int ldy, const int8_t *qx, const float *dx, const float *sx, const bool q5,
                          const int n, const cs_qpack_t *p, int g0, int g1) {
    const int nb = p->cols / 256, groups = p->cols / 32;
    const size_t bb = q5 ? 2880 : 2368, qs0 = q5 ? 832 : 320; /* Q5_K: qh at 320 */
    const __m256i lo4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    for (int g = g0; g < g1; g++) {
        const uint8_t *base = p->data + (size_t)g * p->group_bytes;
        __m256 acc[2][CS_QPACK_MAX_N];
        for (int hf = 0; hf < 2; hf++)
#pragma GCC unroll 4
            for (int i = 0; i < n; i++) acc[hf][i] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const uint8_t *o = base + (size_t)b * bb;
            for (int hf = 0; hf < 2; hf++) {
                __m256i isum[CS_QPACK_MAX_N];
#pragma GCC unroll 4
                for (int i = 0; i < n; i++) isum[i] = _mm256_setzero_si256();
#pragma GCC unroll 4
                for (int pr = 0; pr < 4; pr++) { /* sub-blocks 2pr (low nibbles) and 2pr + 1 (high) */
                    __m256i s0 = scale_pairs_u8(o + 64 + 32 * pr + 8 * hf), s1 = scale_pairs_u8(o + 64 + 32 * pr + 16 + 8 * hf);
                    /* a sub-block's 8 steps add in 16 bits (8 · 2 · 15 · 127 < 2^15), then one vpmaddwd;
                     * Q5_K's 4 steps at a time (4 · 2 · 31 · 127) */
                    __m256i pl[CS_QPACK_MAX_N], ph[CS_QPACK_MAX_N];
#pragma GCC unroll 4
                    for (int i = 0; i < n; i++) pl[i] = ph[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
                    for (int k = 0; k < 8; k++) {
                        PREFETCH_HALF(hf, o, bb, 8 * pr + k, 32);
                        __m256i v = _mm256_load_si256((const __m256i *)(o + qs0 + 64 * (8 * pr + k) + 32 * hf));
                        __m256i l = _mm256_and_si256(v, lo4), h = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
                        if (q5) {
                            __m256i hv = _mm256_load_si256((const __m256i *)(o + 320 + 64 * k + 32 * hf));
                            l = _mm256_or_si256(l, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hv, 2 * pr), one), 4));
                            h = _mm256_or_si256(h, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hv, 2 * pr + 1), one), 4));
                        }
#pragma GCC unroll 4
                        for (int i = 0; i < n; i++) {
                            const int8_t *xi = qx + (size_t)i * p->cols + 256 * (size_t)b + 64 * pr + 4 * k;
                            pl[i] = _mm256_add_epi16(pl[i], _mm256_maddubs_epi16(l, bcast4y(xi)));
                            ph[i] = _mm256_add_epi16(ph[i], _mm256_maddubs_epi16(h, bcast4y(xi + 32)));
                        }
                        if (q5 && k == 3) {
#pragma GCC unroll 4
                            for (int i = 0; i < n; i++) {
                                isum[i] = _mm256_add_epi32(isum[i], _mm256_add_epi32(_mm256_madd_epi16(pl[i], s0), _mm256_madd_epi16(ph[i], s1)));
                                pl[i] = ph[i] = _mm256_setzero_si256();
                            }
                        }
                    }
#pragma GCC unroll 4
                    for (int i = 0; i < n; i++)
                        isum[i] = _mm256_add_epi32(isum[i], _mm256_add_epi32(_mm256_madd_epi16(pl[i], s0), _mm256_madd_epi16(ph[i], s1)));
                }
                __m256 msum[CS_QPACK_MAX_N];
#pragma GCC unroll 4
                for (int i = 0; i < n; i++) msum[i] = _mm256_setzero_ps();
                for (int j = 0; j < 8; j++) {
                    __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(o + 192 + 16 * j + 8 * hf))));
#pragma GCC unroll 4
                    for (int i = 0; i < n; i++)
                        msum[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[(size_t)i * groups + 8 * (size_t)b + j]), msum[i]);
                }
                __m256 d = f16x8(o + 16 * hf), dmin = f16x8(o + 32 + 16 * hf);
#pragma GCC unroll 4
                for (int i = 0; i < n; i++) {
                    __m256 dd = _mm256_set1_ps(dx[(size_t)i * nb + b]);
                    acc[hf][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), _mm256_mul_ps(d, dd), acc[hf][i]);
                    acc[hf][i] = _mm256_fnmadd_ps(msum[i], _mm256_mul_ps(dmin, dd), acc[hf][i]);
                }
            }
        }
        for (int hf = 0; hf < 2; hf++)
#pragma GCC unroll 4
            for (int i = 0; i < n; i++) _mm256_storeu_ps(y + (size_t)i * ldy + (size_t)G * g + 8 * hf, acc[hf][i]);
    }
}

/* Q6_K: a quarter's six bits at a time (sixteen registers hold four rows of x's sums and
 * not much more); the -32 of the six bits comes off once per block, as Σ_j sc_j Σ q_x over
 * sub-block j, from the scales alone */
PAVX2 INLINE void q6_k_a2(float *y, int ldy, const int8_t *qx, const float *dx, const int32_t *s16, const int n,
                          const cs_qpack_t *p, int g0, int g1) {
    const int nb = p->cols / 256, n16 = p->cols / 16;
    const __m256i lo4 = _mm256_set1_epi8(0x0F), b45 = _mm256_set1_epi8(0x30);
    for (int g = g0; g < g1; g++) {
        const uint8_t *base = p->data + (size_t)g * p->group_bytes;
        __m256 acc[2][CS_QPACK_MAX_N];
        for (int hf = 0; hf < 2; hf++)
#pragma GCC unroll 4
            for (int i = 0; i < n; i++) acc[hf][i] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const uint8_t *o = base + (size_t)b * 3392;
            for (int hf = 0; hf < 2; hf++) {
                __m256i isum[CS_QPACK_MAX_N], off[CS_QPACK_MAX_N];
#pragma GCC unroll 4
                for (int i = 0; i < n; i++) isum[i] = _mm256_setzero_si256();
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++)
#pragma GCC unroll 4
                    for (int t = 0; t < 4; t++) /* columns 128h + 32t .. + 31: sub-blocks 8h + 2t, + 1 */
#pragma GCC unroll 2
                        for (int kh = 0; kh < 2; kh++) {
                            __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(o + 64 + 16 * (8 * h + 2 * t + kh) + 8 * hf)));
                            __m256i sc = _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v, 16));
#pragma GCC unroll 2
                            for (int k = 4 * kh; k < 4 * kh + 4; k += 2) { /* two steps' pairs add in 16 bits (2 · 2 · 63 · 127) */
                                __m256i q[2];
#pragma GCC unroll 2
                                for (int e = 0; e < 2; e++) {
                                    PREFETCH_HALF(hf, o, 3392, 32 * h + 8 * t + k + e, 64);
                                    __m256i l = _mm256_load_si256((const __m256i *)(o + 320 + 64 * (16 * h + 8 * (t & 1) + k + e) + 32 * hf));
                                    __m256i qh = _mm256_load_si256((const __m256i *)(o + 2368 + 64 * (8 * h + k + e) + 32 * hf));
                                    if (t >= 2) l = _mm256_srli_epi16(l, 4);
                                    qh = t == 0 ? _mm256_slli_epi16(qh, 4) : t == 1 ? _mm256_slli_epi16(qh, 2) : t == 3 ? _mm256_srli_epi16(qh, 2) : qh;
                                    q[e] = _mm256_or_si256(_mm256_and_si256(l, lo4), _mm256_and_si256(qh, b45));
                                }
#pragma GCC unroll 4
                                for (int i = 0; i < n; i++) {
                                    const int8_t *xi = qx + (size_t)i * p->cols + 256 * (size_t)b + 128 * h + 32 * t + 4 * k;
                                    __m256i pr = _mm256_add_epi16(_mm256_maddubs_epi16(q[0], bcast4y(xi)), _mm256_maddubs_epi16(q[1], bcast4y(xi + 4)));
                                    isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(pr, sc));
                                }
                            }
                        }
#pragma GCC unroll 4
                for (int i = 0; i < n; i++) off[i] = _mm256_setzero_si256();
                for (int j = 0; j < 16; j++) {
                    __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(o + 64 + 16 * j + 8 * hf)));
#pragma GCC unroll 4
                    for (int i = 0; i < n; i++)
                        off[i] = _mm256_add_epi32(off[i], _mm256_mullo_epi32(v, _mm256_set1_epi32(s16[(size_t)i * n16 + 16 * (size_t)b + j])));
                }
                __m256 d = f16x8(o + 16 * hf);
#pragma GCC unroll 4
                for (int i = 0; i < n; i++) {
                    __m256i v = _mm256_sub_epi32(isum[i], _mm256_slli_epi32(off[i], 5));
                    acc[hf][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_mul_ps(d, _mm256_set1_ps(dx[(size_t)i * nb + b])),
                                                 acc[hf][i]);
                }
            }
        }
        for (int hf = 0; hf < 2; hf++)
#pragma GCC unroll 4
            for (int i = 0; i < n; i++) _mm256_storeu_ps(y + (size_t)i * ldy + (size_t)G * g + 8 * hf, acc[hf][i]);
    }
}
#undef PREFETCH_HALF

#define PER_N(F, ...)                                                                                                  \
    switch (n) {                                                                                                       \
    case 1: F(__VA_ARGS__, 1, p, g0, g1); break;                                                                      \
    case 2: F(__VA_ARGS__, 2, p, g0, g1); break;                                                                      \
    case 3: F(__VA_ARGS__, 3, p, g0, g1); break;                                                                      \
    default: F(__VA_ARGS__, 4, p, g0, g1); break;                                                                     \
    }

PAVX2 static void q8_0_a2n(float *y, int ldy, const int8_t *qx, const float *dx, int n, const cs_qpack_t *p, int g0, int g1) {
    PER_N(q8_0_a2, y, ldy, qx, dx)
}
PAVX2 static void q4_k_a2n(float *y, int ldy, const int8_t *qx, const float *dx, const float *sx, int n,
                           const cs_qpack_t *p, int g0, int g1) {
    PER_N(q4_k_a2, y, ldy, qx, dx, sx, false)
}
PAVX2 static void q5_k_a2n(float *y, int ldy, const int8_t *qx, const float *dx, const float *sx, int n,
                           const cs_qpack_t *p, int g0, int g1) {
    PER_N(q4_k_a2, y, ldy, qx, dx, sx, true)
}
PAVX2 static void q6_k_a2n(float *y, int ldy, const int8_t *qx, const float *dx, const int32_t *s16, int n,
                           const cs_qpack_t *p, int g0, int g1) {
    PER_N(q6_k_a2, y, ldy, qx, dx, s16)
}
#undef PER_N

void cs_qgemv_int8_pack_avx2(float *y, int ldy, const int8_t *qx, const float *dx, const float *sx, const int32_t *s16,
                             int n, const cs_qpack_t *p, int r0, int r1) {
    CS_ASSERT(n >= 1 && n <= CS_QPACK_MAX_N && r0 % G == 0 && (r1 % G == 0 || r1 == p->rows) && r1 <= p->rows);
    int g0 = r0 / G, g1 = r1 / G;
    switch (p->dtype) {
    case CS_DTYPE_Q8_0: q8_0_a2n(y, ldy, qx, dx, n, p, g0, g1); break;
    case CS_DTYPE_Q4_K: q4_k_a2n(y, ldy, qx, dx, sx, n, p, g0, g1); break;
    case CS_DTYPE_Q5_K: q5_k_a2n(y, ldy, qx, dx, sx, n, p, g0, g1); break;
    case CS_DTYPE_Q6_K: CS_ASSERT(s16); q6_k_a2n(y, ldy, qx, dx, s16, n, p, g0, g1); break;
    default: CS_ASSERT(!"packed dtype");
    }
}
