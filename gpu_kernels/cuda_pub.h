/* cuda_pub.h: what the CUDA backend and its emulated twin share with the plain-C functions
 * of gpu_backend.h (cuda_pub.c): the head of their context. Private to gpu_kernels/. */
#ifndef CS_CUDA_PUB_H
#define CS_CUDA_PUB_H

#include <stddef.h>

#define CUDA_BACKEND_NAME "cuda"
#define CUDA_EMU_BACKEND_NAME "cuda-emu"

typedef struct cuda_pub {
    char desc[256];         /* device name, memory, architecture */
    size_t used;            /* bytes allocated (atomic) */
    size_t budget;          /* bytes it may allocate */
} cuda_pub_t;

#endif
