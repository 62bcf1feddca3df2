/* test_gpu.c: the CUDA backend on a GPU. Built everywhere; without a CUDA build or without a
 * GPU at run time it exits 77 (automake SKIP). On a GPU host it must pass:
 *   1. the toolchain check (a saxpy kernel against the host);
 *   2. tests/test_backend_ops_gpu with CS_TEST_REQUIRE_CUDA=1: every op of the CUDA backend
 *      on the GPU against the plain references, as on every other backend (its tolerances);
 *   3. tests/test_cuda_emu.py and tests/test_gpu_ref.py with CS_TEST_CUDA_DEVICE=cuda: the
 *      engine end to end on the GPU against the CPU backend (F32 models: same tokens,
 *      logprobs within 2e-5) and against transformers + peft in bfloat16 on the same GPU. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#ifdef CS_HAVE_CUDA
#include "gpu_kernels/gpu_backend.h"
#endif

int main(void) {
#ifdef CS_HAVE_CUDA
    if (gpu_device_count() == 0) {
        printf("SKIP: CUDA backend built but no GPU visible\n");
        return 77;
    }
    char msg[256];
    int rc = gpu_toolchain_check(1 << 20, msg, sizeof msg);
    printf("%s: toolchain: %s\n", rc == 0 ? "PASS" : "FAIL", msg);
    if (rc) return 1;
    const char *bd = getenv("CS_BUILDDIR"), *sd = getenv("CS_SRCDIR"), *py = getenv("PYTHON");
    if (!bd || !sd) {
        printf("FAIL: CS_BUILDDIR and CS_SRCDIR must name the build and source trees (make check sets them)\n");
        return 1;
    }
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "CS_TEST_REQUIRE_CUDA=1 '%s/tests/test_backend_ops_gpu'", bd);
    printf("running %s\n", cmd);
    fflush(stdout);
    if (system(cmd) != 0) {
        printf("FAIL: the CUDA backend's ops\n");
        return 1;
    }
    if (py && *py) {
        static const char *const scripts[] = {"test_cuda_emu.py", "test_gpu_ref.py"};
        for (int i = 0; i < 2; i++) {
            snprintf(cmd, sizeof cmd, "CS_TEST_CUDA_DEVICE=cuda '%s' '%s/tests/%s'", py, sd, scripts[i]);
            printf("running %s\n", cmd);
            fflush(stdout);
            if (system(cmd) != 0) {
                printf("FAIL: the engine on the GPU (%s)\n", scripts[i]);
                return 1;
            }
        }
    } else {
        printf("note: PYTHON unset: the end-to-end check on the GPU did not run\n");
    }
    printf("PASS: the CUDA backend on the GPU\n");
    return 0;
#else
    printf("SKIP: built without CUDA (--with-cuda)\n");
    return 77;
#endif
}
