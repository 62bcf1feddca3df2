/* toolchain_check.cu: the first CUDA kernel, proving that nvcc, the runtime and the link
 * work end to end: y = a*x + y on the device, compared with the host result. */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <math.h>

#include "gpu_kernels/gpu_backend.h"

#define CUDA_CHECK(call)                                                                      \
    do {                                                                                      \
        cudaError_t err_ = (call);                                                            \
        if (err_ != cudaSuccess) {                                                            \
            snprintf(msg, msg_len, "%s:%d: %s: %s", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
            rc = -1;                                                                          \
            goto out;                                                                         \
        }                                                                                     \
    } while (0)

static __global__ void saxpy(int n, float a, const float *x, float *y) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}

extern "C" int gpu_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
    return n;
}

extern "C" int gpu_toolchain_check(int n, char *msg, int msg_len) {
    int rc = 0;
    float *hx = (float *)malloc(sizeof(float) * n), *hy = (float *)malloc(sizeof(float) * n);
    float *dx = NULL, *dy = NULL;
    if (!hx || !hy) { snprintf(msg, msg_len, "out of memory"); rc = -1; goto out; }
    for (int i = 0; i < n; i++) { hx[i] = (float)i * 0.5f; hy[i] = 1.0f - (float)i; }
    CUDA_CHECK(cudaMalloc(&dx, sizeof(float) * n));
    CUDA_CHECK(cudaMalloc(&dy, sizeof(float) * n));
    CUDA_CHECK(cudaMemcpy(dx, hx, sizeof(float) * n, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(dy, hy, sizeof(float) * n, cudaMemcpyHostToDevice));
    saxpy<<<(n + 255) / 256, 256>>>(n, 3.0f, dx, dy);
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaMemcpy(hy, dy, sizeof(float) * n, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++) {
        float want = 3.0f * ((float)i * 0.5f) + (1.0f - (float)i);
        if (fabsf(hy[i] - want) > 1e-5f * fmaxf(1.0f, fabsf(want))) {
            snprintf(msg, msg_len, "saxpy mismatch at %d: got %g, want %g", i, hy[i], want);
            rc = -2;
            goto out;
        }
    }
    snprintf(msg, msg_len, "saxpy on %d elements ok", n);
out:
    if (dx) cudaFree(dx);
    if (dy) cudaFree(dy);
    free(hx);
    free(hy);
    return rc;
}
