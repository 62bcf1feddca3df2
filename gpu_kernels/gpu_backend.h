/* gpu_backend.h: the CUDA backend's public header, plain C (only the .cu files of gpu_kernels/ include
 * CUDA headers). For now it exposes the toolchain check; the backend vtable follows with
 * the GPU issue. */
#ifndef CS_GPU_BACKEND_H
#define CS_GPU_BACKEND_H

#ifdef __cplusplus
extern "C" {
#endif

/* Number of CUDA devices (0 when none or no driver). */
int gpu_device_count(void);
/* Runs a saxpy kernel on n elements and checks it against the host: 0 on success, < 0 on a
 * CUDA error or a wrong result; msg gets a description. */
int gpu_toolchain_check(int n, char *msg, int msg_len);

#ifdef __cplusplus
}
#endif
#endif
