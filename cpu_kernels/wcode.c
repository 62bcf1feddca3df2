/* wcode.c: coding BF16 matrices in 12 bits, losslessly (the format: wcode.h), and the
 * plain decode and GEMV the kernels are tested against. */
#include "cpu_kernels/wcode.h"

#include <stdlib.h>
#include <string.h>

#include "base/common.h"

void cs_wcode_hist(const uint16_t *w, size_t n, uint64_t hist[256]) {
    uint32_t h[4][256] = {{0}}; /* four tables: no stall on runs of one high byte */
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        h[0][w[i] >> 8]++; h[1][w[i + 1] >> 8]++; h[2][w[i + 2] >> 8]++; h[3][w[i + 3] >> 8]++;
        if ((i & 0xffffff) == 0xfffffc) /* before a uint32 count could wrap */
            for (int k = 0; k < 256; k++) {
                hist[k] += (uint64_t)h[0][k] + h[1][k] + h[2][k] + h[3][k];
                h[0][k] = h[1][k] = h[2][k] = h[3][k] = 0;
            }
    }
    for (; i < n; i++) h[0][w[i] >> 8]++;
    for (int k = 0; k < 256; k++) hist[k] += (uint64_t)h[0][k] + h[1][k] + h[2][k] + h[3][k];
}

cs_wcode_t *cs_wcode_begin(int rows, int cols, const uint64_t hist[256]) {
    cs_wcode_t *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->rows = rows;
    c->cols = cols;
    c->blocks = (cols + 2 * CS_WCODE_BLOCK - 1) / (2 * CS_WCODE_BLOCK) * 2;
    /* the 15 most common high bytes other than 0x00, the most common first (ties: the
     * smaller byte), then 0x00; a byte no weight has is not taken */
    bool taken[256] = {false};
    taken[0] = true;
    int n = 0;
    for (; n < CS_WCODE_ESC; n++) {
        int best = -1;
        for (int b = 1; b < 256; b++)
            if (!taken[b] && hist[b] && (best < 0 || hist[b] > hist[best])) best = b;
        if (best < 0) break;
        taken[best] = true;
        c->table[n] = (uint8_t)best;
    }
    for (; n < 16; n++) c->table[n] = 0; /* unused codes decode to 0x00 too */
    c->exc_row = calloc((size_t)rows + 1, sizeof *c->exc_row);
    size_t bytes = (size_t)rows * c->blocks * CS_WCODE_BLOCK_BYTES;
    c->data = bytes ? cs_huge_alloc(bytes, &c->data_bytes) : NULL;
    if (!c->exc_row || (bytes && !c->data)) {
        cs_wcode_free(c);
        return NULL;
    }
    return c;
}

/* code of each high byte: its index in the table, CS_WCODE_ESC for 0x00, -1 for none */
static void inverse(const cs_wcode_t *c, int8_t inv[256]) {
    memset(inv, -1, 256);
    inv[0] = CS_WCODE_ESC;
    for (int k = 0; k < CS_WCODE_ESC; k++)
        if (c->table[k]) inv[c->table[k]] = (int8_t)k;
}

void cs_wcode_encode_rows(cs_wcode_t *c, const uint16_t *w, int r0, int r1) {
    int8_t inv[256];
    inverse(c, inv);
    for (int r = r0; r < r1; r++) {
        const uint16_t *row = w + (size_t)r * c->cols;
        uint8_t *base = (uint8_t *)cs_wcode_row(c, r);
        uint32_t exc = 0;
        for (int b = 0; b < c->blocks; b++) {
            uint8_t *lo_p = base + cs_wcode_lo_at(b), *code_p = base + cs_wcode_codes_at(b);
            memset(code_p, 0, CS_WCODE_BLOCK_BYTES - CS_WCODE_BLOCK);
            for (int j = 0; j < CS_WCODE_BLOCK; j++) {
                int col = b * CS_WCODE_BLOCK + j, p = cs_wcode_pos(j);
                uint16_t v = col < c->cols ? row[col] : 0;
                int code = inv[v >> 8];
                uint8_t lo = (uint8_t)v;
                if (code < 0) { code = CS_WCODE_ESC; lo = 0; exc++; }
                lo_p[p] = lo;
                code_p[p & 31] |= (uint8_t)(code << (p < 32 ? 0 : 4));
            }
        }
        c->exc_row[r + 1] = exc; /* a count until cs_wcode_index */
    }
}

int cs_wcode_index(cs_wcode_t *c) {
    for (int r = 0; r < c->rows; r++) c->exc_row[r + 1] += c->exc_row[r];
    c->n_exc = c->exc_row[c->rows];
    if (!c->n_exc) return 0;
    c->exc_col = malloc(c->n_exc * sizeof *c->exc_col);
    c->exc_val = malloc(c->n_exc * sizeof *c->exc_val);
    return c->exc_col && c->exc_val ? 0 : -1;
}

void cs_wcode_fill_exc(cs_wcode_t *c, const uint16_t *w, int r0, int r1) {
    int8_t inv[256];
    inverse(c, inv);
    for (int r = r0; r < r1; r++) {
        uint32_t k = c->exc_row[r];
        if (k == c->exc_row[r + 1]) continue;
        const uint16_t *row = w + (size_t)r * c->cols;
        for (int col = 0; col < c->cols; col++)
            if (inv[row[col] >> 8] < 0) {
                c->exc_col[k] = (uint32_t)col;
                c->exc_val[k++] = cs_bf16_to_f32(row[col]);
            }
        CS_ASSERT(k == c->exc_row[r + 1]);
    }
}

cs_wcode_t *cs_wcode_new(const uint16_t *w, int rows, int cols) {
    uint64_t hist[256] = {0};
    cs_wcode_hist(w, (size_t)rows * cols, hist);
    cs_wcode_t *c = cs_wcode_begin(rows, cols, hist);
    if (!c) return NULL;
    cs_wcode_encode_rows(c, w, 0, rows);
    if (cs_wcode_index(c)) {
        cs_wcode_free(c);
        return NULL;
    }
    cs_wcode_fill_exc(c, w, 0, rows);
    return c;
}

void cs_wcode_free(cs_wcode_t *c) {
    if (!c) return;
    cs_huge_free(c->data, c->data_bytes);
    free(c->exc_row);
    free(c->exc_col);
    free(c->exc_val);
    free(c);
}

size_t cs_wcode_bytes(const cs_wcode_t *c) {
    return (size_t)c->rows * c->blocks * CS_WCODE_BLOCK_BYTES + ((size_t)c->rows + 1) * sizeof(uint32_t) +
           c->n_exc * (sizeof(uint32_t) + sizeof(float));
}

void cs_wcode_decode_row_ref(const cs_wcode_t *c, int r, uint16_t *out) {
    const uint8_t *base = cs_wcode_row(c, r);
    for (int b = 0; b < c->blocks; b++) {
        const uint8_t *lo_p = base + cs_wcode_lo_at(b), *code_p = base + cs_wcode_codes_at(b);
        for (int j = 0; j < CS_WCODE_BLOCK && b * CS_WCODE_BLOCK + j < c->cols; j++) {
            int p = cs_wcode_pos(j);
            int code = (code_p[p & 31] >> (p < 32 ? 0 : 4)) & 15;
            out[b * CS_WCODE_BLOCK + j] = (uint16_t)(c->table[code] << 8 | lo_p[p]);
        }
    }
    cs_wcode_put_exceptions(c, r, out);
}

void cs_wcode_decode_rows_ref(uint16_t *dst, const cs_wcode_t *c, int r0, int r1) {
    for (int r = r0; r < r1; r++) cs_wcode_decode_row_ref(c, r, dst + (size_t)(r - r0) * (size_t)c->cols);
}

void cs_wcode_gemv_ref(float *y, const float *x, const cs_wcode_t *c, int r0, int r1) {
    uint16_t *row = malloc(sizeof *row * (size_t)(c->cols ? c->cols : 1));
    CS_ASSERT(row);
    for (int r = r0; r < r1; r++) {
        cs_wcode_decode_row_ref(c, r, row);
        double s = 0; /* as cs_matmul_ref sums */
        for (int col = 0; col < c->cols; col++) s += (double)x[col] * cs_bf16_to_f32(row[col]);
        y[r] = (float)s;
    }
    free(row);
}
