/* gpubench.c (the program bench/gpubench): bench/gpu.sh's yardsticks on the GPU, as one JSON object on stdout: the
 * read bandwidth (GB/s) and cuBLAS's BF16 GEMM throughput (TFLOP/s) on a Llama-2-7B layer's
 * prefill shapes at 512 and 2048 tokens (q/k/v/o 4096x4096, gate/up 11008x4096, down
 * 4096x11008), summed over a layer's seven GEMMs as the model runs them.
 *   bench/gpubench [--bytes N] [--reps N] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_kernels/gpu_backend.h"

int gpu_bench_read_bandwidth(size_t bytes, int reps, double *gbps, char *name, int name_len);
int gpu_bench_gemm(int m, int n, int k, int reps, double *tflops);

int main(int argc, char **argv) {
    size_t bytes = (size_t)4 << 30;
    int reps = 20;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--bytes")) bytes = strtoull(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--reps")) reps = atoi(argv[i + 1]);
    }
    if (gpu_device_count() <= 0) {
        fprintf(stderr, "gpubench: no GPU visible\n");
        return 77;
    }
    char name[256];
    double gbps;
    if (gpu_bench_read_bandwidth(bytes, reps, &gbps, name, sizeof name)) {
        fprintf(stderr, "gpubench: the bandwidth run failed\n");
        return 1;
    }
    static const int shapes[][2] = {{4096, 4096}, {4096, 4096}, {4096, 4096}, {4096, 4096},
                                    {11008, 4096}, {11008, 4096}, {4096, 11008}}; /* (out, in) */
    printf("{\"device\": \"%s\", \"read_gbps\": %.1f, \"gemm\": [", name, gbps);
    static const int tokens[] = {512, 2048};
    for (int t = 0; t < 2; t++) {
        double flops = 0, secs = 0;
        for (int s = 0; s < 7; s++) {
            double tf;
            if (gpu_bench_gemm(shapes[s][0], tokens[t], shapes[s][1], reps, &tf)) {
                fprintf(stderr, "gpubench: the GEMM run failed\n");
                return 1;
            }
            double f = 2.0 * shapes[s][0] * shapes[s][1] * tokens[t];
            flops += f;
            secs += f / (tf * 1e12);
        }
        printf("%s{\"tokens\": %d, \"tflops\": %.2f, \"layer_ms\": %.4f}", t ? ", " : "", tokens[t], flops / secs / 1e12,
               secs * 1e3);
    }
    printf("]}\n");
    return 0;
}
