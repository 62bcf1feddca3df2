/* cpu_backend.h: how the CPU backend (always built) and the strict test device are made, with
 * their parameters; both are backend_t's (backend/backend.h), built in cpu_device.c over the
 * kernels of cpu_backend.c (cpu_raw.h): OpenBLAS single-threaded GEMMs on tiles, parallelised
 * by our own pool so one threading model owns the cores; AVX-512 or AVX2 GEMV and dot tiles
 * for decode with BF16/F16 weights widened in registers; AMX for BF16 prefill where the CPU
 * has it; plain reference kernels otherwise. */
#ifndef CS_CPU_BACKEND_H
#define CS_CPU_BACKEND_H

#include "backend/backend.h"

typedef struct cpu_backend_params {
    int n_threads;      /* 0: number of online CPUs */
    bool reference;     /* use the plain reference kernels only (tests, debugging) */
    bool batch_invariant; /* every row's result independent of the batch around it (slower
                           * prefill; see cpu_backend.c) */
    /* kernel switches for checking and benchmarking (the server maps CS_NO_AVX512,
     * CS_NO_AVX2, CS_NO_AMX, CS_NO_TILE and CS_AMX_TERMS onto them) */
    bool no_avx512;     /* no AVX-512 kernels: what an AVX2-only CPU runs */
    bool no_avx2;       /* no AVX2 kernels either (the LoRA kernels' plain loops) */
    bool no_amx;        /* no AMX GEMMs */
    bool no_tile;       /* 2-32 rows of a non-AMX matmul to the GEMV/sgemm, not the dot tiles */
    int amx_terms;      /* BF16 terms of the activations in AMX GEMMs: 3 (default, exact) or 2 */
    bool no_dpbf16;     /* no AVX512-BF16 GEMMs (CS_NO_DPBF16): --precision bf16 on F32 FMAs */
    bool no_vnni;       /* no AVX512-VNNI int8 kernels (CS_NO_VNNI): --precision int8 on AVX2's */
    bool no_qpack;      /* --precision int8 on the weights' own blocks (CS_NO_QPACK), not repacked */
    bool no_packed;     /* prefill GEMMs through OpenBLAS sgemm (CS_NO_PACKED), not the packed FMA
                         * kernels (AVX-512, AVX2) */
    bool no_split;      /* BF16 dot tiles (2-32 rows; every n when batch-invariant) on x in column
                         * order (CS_NO_SPLIT), not on x packed even/odd (cs_gemm_split_avx512) */
    int gemv_streams;   /* the batch-1 BF16 GEMV's interleaved row streams (CS_GEMV_STREAMS): 0
                         * picks by CPU (4 on AMD, where they read 1.2-1.3x faster; 8 with
                         * AVX-512 and 6 with AVX2 elsewhere), 4 or the ISA's wide count forces */
    /* --precision bf16: every matmul against BF16 weights takes x rounded to BF16 (round to
     * nearest even), products exact and sums F32, as PyTorch and vLLM run a BF16 model's
     * GEMMs; on AMX and AVX512-BF16 CPUs that is one BF16 term where the exact default needs
     * three. Everything else (norms, attention, LoRA, F32/F16 weights) stays F32. */
    bool precision_bf16;
    /* --precision int8: matmuls of up to 32 rows of x (decode batches; every n when batch-
     * invariant) against block-quantized weights (base/quant.h) take x quantized to 8 bits per
     * 32 elements, per 256 against the K types (cs_quantize_act_ref: llama.cpp's Q8_0 and Q8_K
     * blocks, rounded to nearest even) and multiply the integers exactly, the sums and scales in F32, as
     * llama.cpp runs a quantized model (about a third of the instructions per weight of F32
     * FMAs); more rows (prefill) and other weights keep the exact F32 products. */
    bool precision_int8;
    /* --compress-weights: each BF16 matmul weight is also held coded in 12 bits, losslessly
     * (wcode.h), and the batch-1 GEMV reads that: 0.75x the bytes per decode step, 0.75x the
     * weights' size more memory. Where the GEMV runs (AVX-512 or AVX2; not --reference-kernels
     * or --batch-invariant), else ignored. */
    bool compress_weights;
    /* --compress-weights-only: the same, and the code is all that is kept (implies
     * compress_weights): a weight's BF16 bytes over the caller's memory may be released once
     * coded (backend_weight_prepare says so), 0.75x the weights' memory. Batches of up to
     * 4 rows read the code as before; 5-16 rows read it once per group of up to 4, and more
     * decode each task's rows back to BF16 for the BF16 kernels (see cpu_raw.h). Not on AMX
     * CPUs (their tile kernels read the BF16 weights: there it is compress_weights). */
    bool compress_weights_only;
} cpu_backend_params_t;

backend_t *cpu_backend_new(const cpu_backend_params_t *p);
/* the kernel path the CPU backend chose at start-up: "amx" (AMX BF16 GEMMs, AVX-512 for the
 * rest), "avx512", "avx512bf16" (--precision bf16 on vdpbf16ps), "avx2" (AVX2+FMA GEMV, dot
 * tiles, softmax and paged attention, OpenBLAS sgemm for prefill), "openblas" (plain loops
 * beside OpenBLAS), "reference", each with "+invariant" in batch-invariant mode, "+bf16"
 * with --precision bf16 and "+int8" with --precision int8, "+gemv4" where the decode GEMV reads 4 row streams (AMD CPUs) and
 * "+wc12" where it reads weights coded in 12 bits (--compress-weights);
 * "?" for another backend */
const char *cpu_backend_path(const backend_t *b);

/* The strict test device (tests only; the builder offers it when CS_TEST_DEVICE=strict is
 * set, never as a user flag): its buffers are its own allocations behind handles, filled
 * with NaN when allocated; every handle an op or copy receives is checked to be one of its
 * live handles and every range to lie inside it (a host pointer, a stale handle or a
 * handle of another backend aborts with a message); host<->device copies run on its own
 * copy thread at a set bandwidth and latency, asynchronous ones overlapping the ops, with
 * events; it counts bytes and copies (backend_get_stats). The ops are the CPU kernels. */
typedef struct strict_device_params {
    cpu_backend_params_t cpu;
    double bytes_per_s;     /* copy bandwidth; 0: unlimited */
    double latency_us;      /* per copy */
    bool lockstep;          /* an adapter slot streaming in advances one layer group per
                             * adapter_arrived call, landed before it answers: the cold start's
                             * layer-by-layer switch without depending on thread timing (tests) */
    bool no_stream;         /* no streaming slots, no host-assisted ops: slots are uploaded whole
                             * (a device without the cold start's methods) */
} strict_device_params_t;

backend_t *strict_device_new(const strict_device_params_t *p);
bool backend_is_strict_device(const backend_t *b);

#endif
