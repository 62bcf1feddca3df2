/* test_gpu.c: the CUDA toolchain check. Built everywhere; without a CUDA build or without
 * a GPU at run time it exits 77 (automake SKIP). On a GPU host it must pass. */
#include <stdio.h>

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
    printf("%s: %s\n", rc == 0 ? "PASS" : "FAIL", msg);
    return rc == 0 ? 0 : 1;
#else
    printf("SKIP: built without CUDA (--with-cuda)\n");
    return 77;
#endif
}
