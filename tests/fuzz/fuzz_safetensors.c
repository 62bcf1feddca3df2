/* fuzz_safetensors.c: the safetensors header parser (base/safetensors.c) on any bytes.
 * What it accepts must be what it promises: every tensor's bytes inside the buffer, its
 * byte size dtype x shape, names unique and found again by name. */
#include <string.h>

#include "base/safetensors.h"
#include "tests/fuzz/fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    void *buf = malloc(size ? size : 1);
    if (!buf) return 0;
    if (size) memcpy(buf, data, size);
    safetensors_t *st = NULL;
    if (safetensors_open_buffer("fuzz.safetensors", buf, size, true, &st) != CS_OK) return 0;
    fuzz_accepted++;
    const uint8_t *lo = buf, *hi = lo + size;
    size_t n = safetensors_count(st);
    for (size_t i = 0; i < n; i++) {
        const st_tensor_t *t = safetensors_at(st, i);
        FUZZ_CHECK(t && t->name, "tensor %zu has no name", i);
        FUZZ_CHECK(t->n_dims >= 0 && t->n_dims <= ST_MAX_DIMS, "%s: %d dims", t->name, t->n_dims);
        bool ok = true;
        size_t nb = safetensors_nbytes(t->dtype, t->n_dims, t->shape, &ok);
        FUZZ_CHECK(ok && nb == t->nbytes, "%s: %zu bytes for its shape, %zu given", t->name, nb, t->nbytes);
        const uint8_t *p = t->data;
        FUZZ_CHECK(t->nbytes == 0 || (p >= lo && p <= hi && t->nbytes <= (size_t)(hi - p)),
                   "%s: its bytes are outside the buffer", t->name);
        volatile uint8_t sink = 0;
        if (t->nbytes) sink ^= p[0] ^ p[t->nbytes - 1];
        (void)sink;
        FUZZ_CHECK(safetensors_find(st, t->name) == t, "%s: not found by its name", t->name);
    }
    (void)safetensors_metadata(st, "format");
    safetensors_free(st);
    return 0;
}
