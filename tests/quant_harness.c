/* quant_harness.c: base/quant.c from the command line, so that tests/test_quant_ref.py can
 * compare it with the `gguf` Python package byte for byte.
 *   quant_harness dequant TYPE N   < N/block blocks of TYPE  > N little-endian F32
 *   quant_harness quantize TYPE N  < N little-endian F32     > N/block blocks of TYPE
 *   quant_harness dot TYPE N       < N/block blocks, then N F32 > the dot as %.17g
 * TYPE by name: "Q4_K", "F16", ... (dequant and dot take the plain F32, F16 and BF16 too). */
#include "base/quant.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int type_by_name(const char *name) {
    for (int t = 0; t < CS_DTYPE_COUNT; t++)
        if (strcmp(cs_dtype_name((cs_dtype)t), name) == 0) return t;
    return -1;
}

static void *read_exact(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p || fread(p, 1, n, stdin) != n) {
        fprintf(stderr, "quant_harness: short input (wanted %zu bytes)\n", n);
        exit(2);
    }
    return p;
}

static void write_exact(const void *p, size_t n) {
    if (fwrite(p, 1, n, stdout) != n || fflush(stdout) != 0) {
        fprintf(stderr, "quant_harness: write failed\n");
        exit(2);
    }
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: quant_harness dequant|quantize|dot TYPE N\n");
        return 2;
    }
    int t = type_by_name(argv[2]);
    char *end;
    long long n = strtoll(argv[3], &end, 10);
    if (t < 0 || *end || n < 0) {
        fprintf(stderr, "quant_harness: bad type '%s' or count '%s'\n", argv[2], argv[3]);
        return 2;
    }
    bool plain = t == CS_DTYPE_F32 || t == CS_DTYPE_F16 || t == CS_DTYPE_BF16;
    size_t rb = cs_dtype_row_bytes((cs_dtype)t, n);
    if ((!plain && !cs_dtype_is_quant((cs_dtype)t)) || (n > 0 && rb == 0)) {
        fprintf(stderr, "quant_harness: %s cannot hold %lld values\n", argv[2], n);
        return 2;
    }
    if (strcmp(argv[1], "dequant") == 0) {
        void *in = read_exact(rb);
        float *out = malloc(sizeof(float) * (size_t)(n ? n : 1));
        cs_dequant_row_ref(out, in, (cs_dtype)t, n);
        write_exact(out, sizeof(float) * (size_t)n);
        free(in);
        free(out);
    } else if (strcmp(argv[1], "quantize") == 0) {
        float *in = read_exact(sizeof(float) * (size_t)n);
        void *out = malloc(rb ? rb : 1);
        if (cs_quantize_row_ref(out, in, (cs_dtype)t, n) != CS_OK) {
            fprintf(stderr, "quant_harness: %s\n", cs_error_last());
            return 1;
        }
        write_exact(out, rb);
        free(in);
        free(out);
    } else if (strcmp(argv[1], "dot") == 0) {
        void *w = read_exact(rb);
        float *x = read_exact(sizeof(float) * (size_t)n);
        printf("%.17g\n", cs_quant_dot_ref(w, (cs_dtype)t, x, n));
        free(w);
        free(x);
    } else {
        fprintf(stderr, "quant_harness: unknown command '%s'\n", argv[1]);
        return 2;
    }
    return 0;
}
