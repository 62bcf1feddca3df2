/* wcode.h: BF16 weights coded losslessly in 12 bits (--compress-weights), for the batch-1
 * GEMV, which is a read of every weight per token and so runs at the speed of memory.
 *
 * A BF16 number is a high byte (sign and the exponent's top 7 bits) and a low byte (the
 * exponent's last bit and 7 mantissa bits). Trained and random weights alike use few high
 * bytes: in each matrix the 15 most common cover all but 0.004-0.04% of the weights (the
 * bench model's random init; SmolLM2's trained weights, 0.11% in its worst matrix). So each
 * weight keeps its low byte and trades its high byte for a 4-bit code into the matrix's
 * table of 15 high bytes; code 15 stands for the high byte 0x00 (zero and the tiny values).
 * A weight whose high byte is in neither is an exception: coded as +0.0 and listed with
 * its row, column and value, added after the row's dot product. Decoding gives back every
 * bit: 1.5 bytes a weight instead of 2, the same products (their sum rounded in another
 * order than the BF16 GEMV's). An exception meets x[col] as 0 · x[col] in the vector sum, so
 * an infinite x there gives NaN where the BF16 GEMV gives ±Inf.
 *
 * Layout: each row is cs_wcode_t.blocks blocks of 64 columns (zero past cols; blocks even),
 * a block 64 low bytes and 32 code bytes (byte q: the code of position q in its low nibble,
 * of position q + 32 in its high nibble). Blocks go in pairs of 192 bytes, three cache
 * lines: the two blocks' low bytes, then their codes, so that no load crosses a line (a
 * row starts on one: 96-byte blocks back to back split every other 64-byte load in two,
 * and read 0.66-0.77 of the bandwidth). Column c = 16m + 4k + e of a block
 * (m, k < 4, e < 4) sits at position 16k + 4m + e: the order in which the 128-bit lanes of
 * the byte and word unpacks (low byte with high byte, then zero with the word) hand out
 * F32 values, so a 512-bit decode yields columns 16m .. 16m + 15 in vector m, and a 256-bit
 * decode of half h columns 16m + 8h .. 16m + 8h + 7. The plain definition is
 * cs_wcode_decode_row_ref; the kernels are tested against it. */
#ifndef CS_WCODE_H
#define CS_WCODE_H

#include <stddef.h>
#include <stdint.h>

#define CS_WCODE_BLOCK 64       /* columns in a block */
#define CS_WCODE_BLOCK_BYTES 96 /* bytes of a block */
#define CS_WCODE_PAIR_BYTES 192 /* bytes of a pair of blocks */
#define CS_WCODE_ESC 15         /* the code of the high byte 0x00 (and of exceptions, as +0.0) */

typedef struct cs_wcode {
    int rows, cols, blocks;     /* blocks of 64 columns a row, even */
    uint8_t table[16];          /* high byte of each code; table[CS_WCODE_ESC] = 0 */
    uint8_t *data;              /* rows · blocks · 96 bytes, 64-byte aligned */
    uint32_t *exc_row;          /* rows + 1: row r's exceptions are [exc_row[r], exc_row[r + 1]) */
    uint32_t *exc_col;          /* their columns */
    float *exc_val;             /* their values */
    size_t n_exc;
    size_t data_bytes;          /* of data (mapped in 2 MiB huge pages where the kernel offers them) */
} cs_wcode_t;

/* the position of column c (< 64) within its block */
static inline int cs_wcode_pos(int c) { return 16 * ((c >> 2) & 3) + 4 * (c >> 4) + (c & 3); }
/* row r's start, and block b's low bytes and codes from it */
static inline const uint8_t *cs_wcode_row(const cs_wcode_t *c, int r) {
    return c->data + (size_t)r * (size_t)c->blocks * CS_WCODE_BLOCK_BYTES;
}
static inline size_t cs_wcode_lo_at(int b) { return (size_t)(b >> 1) * CS_WCODE_PAIR_BYTES + (size_t)(b & 1) * 64; }
static inline size_t cs_wcode_codes_at(int b) { return (size_t)(b >> 1) * CS_WCODE_PAIR_BYTES + 128 + (size_t)(b & 1) * 32; }

/* Coding a matrix w (rows, cols) of BF16, in steps a caller may spread over threads:
 *   cs_wcode_hist over all of w (per part, summed) -> cs_wcode_begin (the table, the data)
 *   -> cs_wcode_encode_rows over all rows (row ranges in any order, in parallel)
 *   -> cs_wcode_index (the exception index) -> cs_wcode_fill_exc over all rows (parallel).
 * cs_wcode_new does it all in the calling thread. NULL on ENOMEM. */
void cs_wcode_hist(const uint16_t *w, size_t n, uint64_t hist[256]);
cs_wcode_t *cs_wcode_begin(int rows, int cols, const uint64_t hist[256]);
void cs_wcode_encode_rows(cs_wcode_t *c, const uint16_t *w, int r0, int r1); /* counts exceptions too */
int cs_wcode_index(cs_wcode_t *c);                                           /* 0, or -1 on ENOMEM */
void cs_wcode_fill_exc(cs_wcode_t *c, const uint16_t *w, int r0, int r1);
cs_wcode_t *cs_wcode_new(const uint16_t *w, int rows, int cols);
void cs_wcode_free(cs_wcode_t *c);
/* bytes the coded matrix holds (data and exceptions) */
size_t cs_wcode_bytes(const cs_wcode_t *c);

/* ---- the plain definitions ---- */
/* row r back to BF16: out[0 .. cols) */
void cs_wcode_decode_row_ref(const cs_wcode_t *c, int r, uint16_t *out);
/* rows [r0, r1) back to BF16, row after row (cols apart) at dst */
void cs_wcode_decode_rows_ref(uint16_t *dst, const cs_wcode_t *c, int r0, int r1);
/* y[r] = dot(x, row r) for r in [r0, r1): each row decoded, then summed in column order in
 * double, as cs_matmul_ref sums the BF16 matrix (the same bits) */
void cs_wcode_gemv_ref(float *y, const float *x, const cs_wcode_t *c, int r0, int r1);

/* row r's exceptions written into its decoded BF16 row (out[0 .. cols)) */
static inline void cs_wcode_put_exceptions(const cs_wcode_t *c, int r, uint16_t *out) {
    for (uint32_t k = c->exc_row[r]; k < c->exc_row[r + 1]; k++) {
        union { float f; uint32_t u; } v = {.f = c->exc_val[k]};
        out[c->exc_col[k]] = (uint16_t)(v.u >> 16);
    }
}

/* Σ value · x[column] over row r's exceptions: what the kernels add to the row's sum */
static inline float cs_wcode_exceptions(const cs_wcode_t *c, int r, const float *x) {
    float s = 0;
    for (uint32_t k = c->exc_row[r]; k < c->exc_row[r + 1]; k++) s += c->exc_val[k] * x[c->exc_col[k]];
    return s;
}

/* ---- the kernels: S interleaved row streams, as cs_gemv_rows_* (kernels_avx512.c,
 * kernels_avx2.c; call only where the CPU has the ISA) ---- */
void cs_wcode_gemv_avx512(float *y, const float *x, const cs_wcode_t *c, int r0, int r1, int streams);
void cs_wcode_gemv_avx2(float *y, const float *x, const cs_wcode_t *c, int r0, int r1, int streams);
/* n rows of x (1 ≤ n ≤ CS_WCODE_MAX_N, cols apart) at once, each block decoded once for all:
 * y[i · ldy + r] for r in [r0, r1). The CPU backend takes these for decode batches this small
 * (memory-bound; larger ones read the BF16 weights in its dot tiles). */
#define CS_WCODE_MAX_N 4
void cs_wcode_rows_avx512(float *y, int ldy, const float *x, int n, const cs_wcode_t *c, int r0, int r1, int streams);
void cs_wcode_rows_avx2(float *y, int ldy, const float *x, int n, const cs_wcode_t *c, int r0, int r1, int streams);
/* cs_wcode_decode_rows_ref's contract: what the CPU backend's batch kernels read, a task's
 * rows at a time, where the model kept only the code (its BF16 bytes released) */
void cs_wcode_decode_rows_avx512(uint16_t *dst, const cs_wcode_t *c, int r0, int r1);
void cs_wcode_decode_rows_avx2(uint16_t *dst, const cs_wcode_t *c, int r0, int r1);

#endif
