/* setup.h: the one place that builds the backend for `generate`, `batch` and `serve`
 * (and names it for their messages). Flags come in the options; the environment switches
 * of the CPU kernels (CS_NO_AVX512, CS_NO_AVX2, CS_NO_AMX, CS_NO_DPBF16, CS_NO_VNNI, CS_NO_PACKED, CS_NO_TILE,
 * CS_AMX_TERMS, CS_GEMV_STREAMS) and the tests'
 * CS_TEST_DEVICE=strict (CS_STRICT_GBPS, CS_STRICT_LATENCY_US,
 * CS_STRICT_LOCKSTEP, CS_STRICT_NO_STREAM) or =cuda-emu (the CUDA
 * backend's own code on the host emulator), and CS_AUTO_DEVICE (what --device auto means;
 * make check sets cpu so a GPU host runs the CPU-exact suite unless a test names cuda) are
 * read here and nowhere else. */
#ifndef CS_SETUP_H
#define CS_SETUP_H

#include "backend/backend.h"

typedef struct setup_backend_opts {
    const char *device;     /* "cpu", "cuda" or "auto" (NULL: auto: cuda where a GPU is visible) */
    double gpu_memory_fraction; /* cuda: of the GPU's memory it may allocate (0: 0.90) */
    bool cuda_graphs;       /* cuda: replay decode steps as CUDA graphs (--cuda-graphs) */
    int threads;            /* 0: every online CPU */
    bool reference;         /* --reference-kernels */
    bool batch_invariant;   /* --batch-invariant */
    bool precision_bf16;    /* --precision bf16 (CPU backend; cpu_backend_params_t.precision_bf16) */
    bool precision_int8;    /* --precision int8 (CPU backend; cpu_backend_params_t.precision_int8) */
    bool compress_weights;  /* --compress-weights (CPU backend; cpu_backend_params_t.compress_weights) */
    bool compress_weights_only; /* --compress-weights-only (cpu_backend_params_t.compress_weights_only) */
} setup_backend_opts_t;

/* NULL with cs_error_last() set: an unknown device, cuda where it cannot run, no memory */
backend_t *setup_backend(const setup_backend_opts_t *o);
/* "cpu (avx512, 2 threads)", "strict test device (...)": for --stats and start-up lines */
void setup_backend_describe(const backend_t *be, char *buf, size_t len);

/* The KV cache budget: REQUESTED when EXPLICIT (a flag gave it) or the backend is not a GPU;
 * on a GPU without a flag, what its memory budget leaves after the weights, less a reserve
 * for activations and adapter slots (10%, at least 512 MiB), as vLLM sizes its KV cache. */
size_t setup_kv_bytes(backend_t *be, size_t requested, bool explicit_size);

/* --precision's value: "exact" 0, "bf16" 1, anything else -1 */
int setup_parse_precision(const char *s);

/* --cold-start's value: "auto", "cpu-assist" or "wait" as SCHED_COLD_* (engine/sched.h);
 * -1 for anything else */
int setup_parse_cold_start(const char *s);
/* --kv-cache-dtype: "auto" (SETUP_KV_AUTO), "f32", "bf16" (their cs_dtype); -2 for anything
 * else. setup_kv_dtype resolves auto: BF16 where the matmuls already round the activations to
 * BF16 (BF16 WEIGHTS under --precision bf16, or on the CUDA backend) and the backend's
 * attention reads BF16 pools: a BF16 model's K and V, as vLLM's "auto" keeps them; else F32. */
#define SETUP_KV_AUTO (-1)
/* --lora-dtype: "auto" (0: adapters held as their files have them: BF16 stays BF16, F32 and
 * F16 become F32, the LoRA exact against peft) or "bf16"/"bfloat16" (1: every adapter held in
 * BF16, F32 and F16 rounded to nearest even when it is read: half the bytes held and
 * streamed per token, as vLLM holds LoRA weights in a BF16 model's dtype); -1 for anything
 * else */
int setup_parse_lora_dtype(const char *s);
/* --quantization: none -> CS_DTYPE_COUNT, q8_0 ... q6_k -> their cs_dtype; -1 if unknown */
int setup_parse_quantization(const char *s);
int setup_parse_kv_dtype(const char *s);
cs_dtype setup_kv_dtype(const backend_t *be, int choice, bool precision_bf16, cs_dtype weights);

/* The model's tokenizer: a GGUF file's own (its tokenizer.ggml.* metadata), or a directory's
 * tokenizer.json (with tokenizer_config.json). 0 with *out NULL where the model has none
 * (prompts then come as token ids); -1 with cs_error set when it has one that fails to load. */
struct tokenizer;
int setup_tokenizer(const char *model, struct tokenizer **out);
/* The host LoRA workers of the cold start (lora/assist.h) for backend BE under MODE: NULL
 * with no error where they have nothing to do (a backend that cannot stream adapter slots
 * or assist, or MODE wait); THREADS 0: a quarter of the CPUs (1 .. 8). Pinned to cores on
 * a GPU (the CPU kernels would share them otherwise). NULL with an error: cannot start. */
/* DTYPE (SETUP_ASSIST_*): of the terms the workers send back; AUTO: BF16 for a model of
 * 16-bit weights (MODEL_DTYPE) on a GPU, else F32. */
enum { SETUP_ASSIST_AUTO = 0, SETUP_ASSIST_F32, SETUP_ASSIST_BF16 };
struct lora_assist;
struct lora_assist *setup_assist(backend_t *be, int mode, int threads, int dtype, cs_dtype model_dtype, bool *failed);

/* The scheduling policy NAME names (NULL: the default, fcfs), with COST (sched/cost.h; may
 * be NULL) learning from its steps; NULL with a message for an unknown one. Free with
 * sched_free after the engine. */
struct cost_model;
struct sched *setup_scheduler(const char *name, struct cost_model *cost, double slo_headroom);

/* --profile-cost-model: for about SECONDS, run synthetic batches through ENGINE (not yet
 * started: this drives it from the caller) to teach COST (fed by the policy's step feedback)
 * the iteration's cost: batches of 1 to 32 sequences, prompts of 16 to 256 random tokens, 8
 * new tokens each, over 0 to 8 distinct adapters of ADAPTERS (so their ranks), then fit it.
 * Returns the steps run, or an error. */
struct engine;
int setup_profile_cost_model(struct engine *engine, struct cost_model *cost, const char *const *adapters,
                             int n_adapters, int vocab, int max_len, double seconds);

#endif
