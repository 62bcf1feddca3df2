/* setup.c: see setup.h. */
#include "server/setup.h"
#include "base/gguf.h"
#include "engine/model.h"
#include "text/tokenizer.h"
#include "engine/engine.h"
#include "base/rng.h"
#include "engine/sampling.h"
#include "engine/sched.h"
#include "lora/assist.h"
#include "sched/cost.h"
#include "sched/fcfs.h"
#include "sched/slo.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "cpu_kernels/cpu_backend.h"
#include "gpu_kernels/gpu_backend.h"

static bool env_on(const char *name) {
    const char *v = getenv(name);
    return v && *v && strcmp(v, "0");
}

static double env_num(const char *name, double dflt) {
    const char *v = getenv(name);
    return v && *v ? atof(v) : dflt;
}

static bool gpu_present(void) {
#ifdef CS_HAVE_CUDA
    return gpu_device_count() > 0;
#else
    return false;
#endif
}

backend_t *setup_backend(const setup_backend_opts_t *o) {
    const char *dev = o->device && *o->device ? o->device : "auto";
    if (!strcmp(dev, "auto")) { /* the test suite pins it (CS_AUTO_DEVICE=cpu): its references are the CPU's */
        const char *pin = getenv("CS_AUTO_DEVICE");
        dev = pin && *pin ? pin : gpu_present() ? "cuda" : "cpu";
    }
    cuda_backend_params_t gp = {.device = 0, .memory_fraction = o->gpu_memory_fraction, .graphs = o->cuda_graphs};
    char cuda_dev[16];
    if (!strncmp(dev, "cuda:", 5)) { /* cuda:N, the N-th visible GPU (as torch and vLLM name it) */
        char *end = NULL;
        long n = strtol(dev + 5, &end, 10);
        if (end == dev + 5 || *end || n < 0 || n > 1023) {
            cs_error_set(CS_EINVAL, "--device %s: a GPU is cuda or cuda:N, N the device's index (0, 1, ...)", dev);
            return NULL;
        }
        gp.device = (int)n;
        snprintf(cuda_dev, sizeof cuda_dev, "cuda");
        dev = cuda_dev;
    }
    const char *test_dev = getenv("CS_TEST_DEVICE");
    if (test_dev && !strcmp(test_dev, "cuda-emu")) /* the CUDA backend's code on the host emulator */
        return cuda_emu_backend_new(&gp);
    if (!strcmp(dev, "cuda")) {
#ifdef CS_HAVE_CUDA
        if (!gpu_present()) {
            cs_error_set(CS_EUNSUPPORTED, "--device cuda: no CUDA device is visible (nvidia-smi lists none, or no driver)");
            return NULL;
        }
        backend_t *be = cuda_backend_new(&gp);
        if (!be) cs_error_set(CS_EUNSUPPORTED, "--device cuda: %s", cs_error_last());
        if (be && (o->compress_weights || o->compress_weights_only))
            fprintf(stderr, "caraserve: --compress-weights%s: a CPU backend flag, ignored on the GPU\n",
                    o->compress_weights_only ? "-only" : "");
        return be;
#else
        cs_error_set(CS_EUNSUPPORTED, "--device cuda: caraserve was built without CUDA (configure --with-cuda)");
        return NULL;
#endif
    }
    if (strcmp(dev, "cpu")) {
        cs_error_set(CS_EINVAL, "--device %s: unknown device (cpu, cuda or cuda:N)", dev);
        return NULL;
    }
    cpu_backend_params_t cp = {
        .n_threads = o->threads,
        .reference = o->reference,
        .batch_invariant = o->batch_invariant,
        .no_avx512 = env_on("CS_NO_AVX512"),
        .no_avx2 = env_on("CS_NO_AVX2"),
        .no_amx = env_on("CS_NO_AMX"),
        .no_tile = env_on("CS_NO_TILE"),
        .amx_terms = (int)env_num("CS_AMX_TERMS", 3),
        .no_dpbf16 = env_on("CS_NO_DPBF16"),
        .no_vnni = env_on("CS_NO_VNNI"),
        .no_qpack = env_on("CS_NO_QPACK"),
        .no_packed = env_on("CS_NO_PACKED"),
        .no_split = env_on("CS_NO_SPLIT"),
        .gemv_streams = (int)env_num("CS_GEMV_STREAMS", 0),
        .precision_bf16 = o->precision_bf16,
        .precision_int8 = o->precision_int8,
        .compress_weights = o->compress_weights,
        .compress_weights_only = o->compress_weights_only,
    };
    if (test_dev && *test_dev) {
        if (strcmp(test_dev, "strict")) {
            cs_error_set(CS_EINVAL, "CS_TEST_DEVICE=%s: the test devices are 'strict' and 'cuda-emu'", test_dev);
            return NULL;
        }
        strict_device_params_t sp = {cp, env_num("CS_STRICT_GBPS", 0) * 1e9, env_num("CS_STRICT_LATENCY_US", 0),
                                     env_on("CS_STRICT_LOCKSTEP"), env_on("CS_STRICT_NO_STREAM")};
        return strict_device_new(&sp);
    }
    backend_t *be = cpu_backend_new(&cp);
    /* said, not refused: the flags are hints about memory and speed, the results are the same */
    if (be && o->compress_weights_only && !strstr(cpu_backend_path(be), "+wc12only"))
        fprintf(stderr, "caraserve: --compress-weights-only: %s\n",
                strstr(cpu_backend_path(be), "+wc12")
                    ? "this CPU's AMX kernels read the BF16 weights, which stay beside the code (as --compress-weights)"
                    : "not on this kernel path (it needs AVX2 or AVX-512 kernels): the weights stay as they are");
    return be;
}

void setup_backend_describe(const backend_t *be, char *buf, size_t len) {
    if (backend_is_cuda(be)) {
        char d[300];
        cuda_backend_describe(be, d, sizeof d);
        snprintf(buf, len, "%s (%s)", backend_name(be), d);
        return;
    }
    snprintf(buf, len, "%s%s (%s kernels, %d threads)", backend_is_strict_device(be) ? "strict test device" : "",
             backend_is_strict_device(be) ? "" : backend_name(be), cpu_backend_path(be), backend_n_threads(be));
}

size_t setup_kv_bytes(backend_t *be, size_t requested, bool explicit_size) {
    if (explicit_size || !backend_is_cuda(be)) return requested;
    size_t used, budget;
    cuda_backend_memory(be, &used, &budget);
    size_t left = budget > used ? budget - used : 0, reserve = left / 10;
    if (reserve < ((size_t)512 << 20)) reserve = (size_t)512 << 20;
    size_t kv = left > reserve ? left - reserve : 0;
    cs_log("KV cache: %.2f GiB of the GPU's budget (%.2f GiB in use after the weights, %.2f GiB kept for "
           "activations and adapter slots)", kv / 1073741824.0, used / 1073741824.0, reserve / 1073741824.0);
    return kv;
}

int setup_parse_precision(const char *s) {
    if (!strcmp(s, "exact")) return 0;
    if (!strcmp(s, "bf16")) return 1;
    if (!strcmp(s, "int8")) return 2;
    return -1;
}

int setup_parse_quantization(const char *s) {
    if (!strcmp(s, "none")) return CS_DTYPE_COUNT;
    static const char *const names[] = {"q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k"};
    static const cs_dtype types[] = {CS_DTYPE_Q4_0, CS_DTYPE_Q4_1, CS_DTYPE_Q5_0, CS_DTYPE_Q5_1,
                                     CS_DTYPE_Q8_0, CS_DTYPE_Q4_K, CS_DTYPE_Q5_K, CS_DTYPE_Q6_K};
    for (size_t i = 0; i < CS_ARRAY_LEN(names); i++)
        if (!strcasecmp(s, names[i])) return types[i];
    return -1;
}

int setup_parse_lora_dtype(const char *s) {
    if (!strcmp(s, "auto")) return 0;
    if (!strcmp(s, "bf16") || !strcmp(s, "bfloat16")) return 1;
    return -1;
}

int setup_parse_kv_dtype(const char *s) {
    if (!strcmp(s, "auto")) return SETUP_KV_AUTO;
    if (!strcmp(s, "f32") || !strcmp(s, "float32")) return CS_DTYPE_F32;
    if (!strcmp(s, "bf16") || !strcmp(s, "bfloat16")) return CS_DTYPE_BF16;
    return -2;
}

cs_dtype setup_kv_dtype(const backend_t *be, int choice, bool precision_bf16, cs_dtype weights) {
    if (choice != SETUP_KV_AUTO) return (cs_dtype)choice;
    bool rounds = weights == CS_DTYPE_BF16 && (precision_bf16 || backend_is_cuda(be));
    return rounds && (backend_caps(be)->kv_dtypes >> CS_DTYPE_BF16 & 1u) ? CS_DTYPE_BF16 : CS_DTYPE_F32;
}

int setup_parse_cold_start(const char *s) {
    if (!strcmp(s, "auto")) return SCHED_COLD_DEFAULT;
    if (!strcmp(s, "cpu-assist")) return SCHED_COLD_ASSIST;
    if (!strcmp(s, "wait")) return SCHED_COLD_WAIT;
    return -1;
}

lora_assist_t *setup_assist(backend_t *be, int mode, int threads, int dtype, cs_dtype model_dtype, bool *failed) {
    *failed = false;
    if (mode == SCHED_COLD_WAIT || !backend_caps(be)->adapter_stream || !backend_caps(be)->host_assist) return NULL;
    if (threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        threads = (int)CS_MIN(8, CS_MAX(1, n / 4));
    }
    bool half = model_dtype == CS_DTYPE_BF16 || model_dtype == CS_DTYPE_F16;
    if (dtype == SETUP_ASSIST_AUTO) dtype = backend_is_cuda(be) && half ? SETUP_ASSIST_BF16 : SETUP_ASSIST_F32;
    lora_assist_params_t ap = {.n_threads = threads, .pin = backend_is_cuda(be),
                               .terms_dtype = dtype == SETUP_ASSIST_BF16 ? CS_DTYPE_BF16 : CS_DTYPE_F32};
    lora_assist_t *a = NULL;
    if (lora_assist_new(&ap, &a)) {
        *failed = true;
        return NULL;
    }
    return a;
}

sched_t *setup_scheduler(const char *name, struct cost_model *cost, double slo_headroom) {
    if (!name || !strcmp(name, "fcfs")) {
        sched_t *s = sched_fcfs_new(cost);
        if (!s) cs_error_set(CS_ENOMEM, "out of memory");
        return s;
    }
    if (!strcmp(name, "slo")) {
        if (!cost) {
            cs_error_set(CS_EINVAL, "--scheduler slo needs the cost model");
            return NULL;
        }
        return sched_slo_new(&(sched_slo_params_t){.cost = cost, .headroom = slo_headroom});
    }
    cs_error_set(CS_EINVAL, "--scheduler %s: the policies are fcfs and slo", name);
    return NULL;
}

static void profile_sink(void *user, const engine_event_t *ev) { (void)user; (void)ev; }

int setup_profile_cost_model(engine_t *e, cost_model_t *cost, const char *const *adapters, int n_adapters, int vocab,
                             int max_len, double seconds) {
    static const int sizes[] = {1, 2, 4, 8, 16, 32}, lens[] = {16, 64, 256};
    cs_rng_t rng;
    cs_rng_seed(&rng, 20261124);
    int ad_max = CS_MIN(n_adapters, 8), rounds = 0;
    engine_stats_t st0, st1;
    engine_get_stats(e, &st0);
    double t0 = cs_time_ms();
    int32_t *prompt = malloc(sizeof(int32_t) * 256 * 32);
    if (!prompt) return cs_error_set(CS_ENOMEM, "out of memory");
    while (cs_time_ms() - t0 < seconds * 1000 || rounds < 6) {
        int b = sizes[rounds % 6], len = CS_MIN(lens[(rounds / 6) % 3], CS_MAX(max_len - 16, 1));
        int n_ad = ad_max ? rounds % (ad_max + 1) : 0;
        for (int i = 0; i < b; i++) {
            int32_t *p = prompt + (size_t)i * 256;
            for (int k = 0; k < len; k++) p[k] = 3 + (int32_t)(cs_rng_uniform(&rng) * (vocab - 3)); /* no prefix hits */
            engine_request_t rq = {.prompt = p, .n_prompt = len, .max_tokens = 8, .ignore_eos = true, .n = 1,
                                   .sink = profile_sink};
            sampling_params_default(&rq.sampling);
            rq.sampling.temperature = 0;
            if (n_ad) rq.adapter = adapters[(rounds + i % n_ad) % n_adapters];
            if (engine_submit(e, &rq, NULL)) {
                free(prompt);
                return cs_error_set(CS_EINVAL, "--profile-cost-model: %s", cs_error_last());
            }
        }
        engine_run_until_idle(e);
        rounds++;
    }
    free(prompt);
    engine_get_stats(e, &st1);
    if (cost_model_fit(cost)) return cs_error_set(CS_EAGAIN, "--profile-cost-model: %s", cs_error_last());
    return (int)(st1.steps - st0.steps);
}

int setup_tokenizer(const char *model, tokenizer_t **out) {
    *out = NULL;
    if (model_path_is_gguf(model)) {
        gguf_t *g;
        if (gguf_open(model, ST_MMAP, &g)) return -1;
        int rc = gguf_find_key(g, "tokenizer.ggml.model") < 0 ? 0 : tokenizer_load_gguf(g, out) ? -1 : 0;
        gguf_free(g);
        return rc;
    }
    char *tj = cs_path_join(model, "tokenizer.json");
    bool have = tj && cs_file_exists(tj);
    free(tj);
    return have && tokenizer_load(model, out) ? -1 : 0;
}
