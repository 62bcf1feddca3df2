/* gpu_backend.h: the CUDA backend's public header, plain C (only the .cu files of
 * gpu_kernels/ include CUDA headers).
 *
 * The backend (backend.cu over the kernels in the other .cu files) implements
 * backend/backend.h on one GPU: weights, the KV pools, adapter slots and activations in
 * device memory under a budget (a fraction of the GPU's memory), cuBLAS GEMMs with F32
 * accumulation (activations rounded to the weights' BF16/F16 on the way in; F32 weights
 * stay F32), paged attention and grouped LoRA kernels, a compute stream and a copy stream.
 *
 * The same sources are always built a second time against a host emulation of CUDA
 * (cuda_emu.h): cuda_emu_backend_new runs the backend's own code, kernels included, on the
 * CPU so the test suite checks it on machines without a GPU. It is a test device, slow by
 * design, and not offered as a user's --device. */
#ifndef CS_GPU_BACKEND_H
#define CS_GPU_BACKEND_H

#include "backend/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cuda_backend_params {
    int device;             /* CUDA device index */
    double memory_fraction; /* of the device's memory the backend may allocate (0: 0.90) */
    bool graphs;            /* record decode steps as CUDA graphs and replay them (--cuda-graphs) */
    double spin_timeout_s;  /* a kernel waiting on the host (the cold start's wait_add) gives up
                             * after this long and stops the process with a message naming the
                             * layer, where it would hang (0: CS_CUDA_SPIN_TIMEOUT_S, else 60) */
    int attn_splits;        /* attention's key ranges per row (flash-decoding): 0 as many as fill
                             * the GPU when rows x heads do not (1 .. 32), -1 never (a warp per
                             * row and head over all its keys), N always N (tests) */
    int lora_tiled;         /* the LoRA shrink's row tiles: 0 above 16 rows, -1 never, 1 always (tests) */
    int attn_tiled;         /* attention's query tiles: 0 from 32 rows, -1 never, 1 always (tests) */
} cuda_backend_params_t;

/* NULL with cs_error_last() set when no device, no driver or no memory */
backend_t *cuda_backend_new(const cuda_backend_params_t *p);
backend_t *cuda_emu_backend_new(const cuda_backend_params_t *p);

/* the host emulation's counters, for tests: launches (kernels and GEMMs) per device, those
 * refused because another device was current, kernels first loaded by a launch (not at
 * backend creation), kernels loaded */
enum { CUDA_EMU_MAX_DEVICES = 8 };
typedef struct cuda_emu_stats {
    uint64_t launches_on[CUDA_EMU_MAX_DEVICES];
    uint64_t wrong_device, lazy_loads, kernels_loaded;
} cuda_emu_stats_t;
void cuda_emu_get_stats(cuda_emu_stats_t *st);

/* true for either of the two */
bool backend_is_cuda(const backend_t *b);
/* bytes the backend has allocated and may allocate in all (the budget) */
void cuda_backend_memory(const backend_t *b, size_t *used, size_t *budget);
/* "NVIDIA H100 80GB HBM3, 79.1 GiB, sm_90" */
void cuda_backend_describe(const backend_t *b, char *buf, size_t len);

/* Number of CUDA devices (0 when none or no driver). CUDA builds only. */
int gpu_device_count(void);
/* Runs a saxpy kernel on n elements and checks it against the host: 0 on success, < 0 on a
 * CUDA error or a wrong result; msg gets a description. CUDA builds only. */
int gpu_toolchain_check(int n, char *msg, int msg_len);

#ifdef __cplusplus
}
#endif
#endif
