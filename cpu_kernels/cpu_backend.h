/* cpu_backend.h: the CPU backend (always built). OpenBLAS single-threaded GEMMs on tiles,
 * parallelised by our own pool so one threading model owns the cores; AVX-512 GEMV for
 * decode with BF16/F16 weights widened in registers; plain reference kernels otherwise. */
#ifndef CS_CPU_BACKEND_H
#define CS_CPU_BACKEND_H

#include "engine/backend.h"

typedef struct cpu_backend_params {
    int n_threads;      /* 0: number of online CPUs */
    bool reference;     /* use the plain reference kernels only (tests, debugging) */
    bool batch_invariant; /* every row's result independent of the batch around it (slower
                           * prefill; see cpu_backend.c) */
} cpu_backend_params_t;

backend_t *cpu_backend_new(const cpu_backend_params_t *p);

#endif
