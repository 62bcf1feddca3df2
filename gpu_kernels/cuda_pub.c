/* cuda_pub.c: gpu_backend.h's functions that both CUDA backends answer the same way (plain
 * C, built in every configuration). */
#include "gpu_kernels/gpu_backend.h"

#include <stdio.h>
#include <string.h>

#include "backend/backend_impl.h"
#include "gpu_kernels/cuda_pub.h"

bool backend_is_cuda(const backend_t *b) {
    return b && (!strcmp(b->iface->name, CUDA_BACKEND_NAME) || !strcmp(b->iface->name, CUDA_EMU_BACKEND_NAME));
}

void cuda_backend_memory(const backend_t *b, size_t *used, size_t *budget) {
    const cuda_pub_t *p = b->ctx;
    *used = __atomic_load_n(&p->used, __ATOMIC_RELAXED);
    *budget = p->budget;
}

void cuda_backend_describe(const backend_t *b, char *buf, size_t len) {
    const cuda_pub_t *p = b->ctx;
    snprintf(buf, len, "%s", p->desc);
}
