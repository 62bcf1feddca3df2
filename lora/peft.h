/* peft.h: PEFT LoRA adapters (adapter_config.json + adapter_model.safetensors) mapped onto
 * a base model's projections. Scale = lora_alpha / r (or / sqrt(r) with rsLoRA), with
 * rank_pattern / alpha_pattern overrides per module. Weights stay BF16 when a module's A and
 * B both are (the backends read BF16 LoRA weights); anything else is converted to F32. What we cannot serve exactly (DoRA, modules_to_save, embedding or
 * lm_head LoRA, bias != "none", ...) is refused with a clear message. */
#ifndef CS_PEFT_H
#define CS_PEFT_H

#include "backend/backend.h"
#include "base/common.h"
#include "base/model_config.h"

struct safetensors; /* base/safetensors.h */

typedef enum lora_target {
    LORA_Q = 0, LORA_K, LORA_V, LORA_O, LORA_GATE, LORA_UP, LORA_DOWN,
    LORA_N_TARGETS,
} lora_target;

extern const char *const lora_target_names[LORA_N_TARGETS]; /* "q_proj", ... */

typedef struct lora_module {
    int rank;           /* 0: this projection is not adapted */
    int d_in, d_out;
    float scale;        /* alpha / r, or alpha / sqrt(r) */
    cs_dtype dtype;     /* of a, b and bt: BF16 when the file's A and B both are, else F32 */
    void *a;            /* (rank, d_in)  lora_A.weight; cs_aligned_alloc(64), freed by lora_adapter_free */
    void *b;            /* (d_out, rank) lora_B.weight; same */
    void *bt;           /* (rank, d_out) B transposed, for the decode fast path (expand without
                           horizontal sums); same */
} lora_module_t;

typedef struct lora_adapter {
    char *name;             /* directory basename unless set by the caller */
    char *path;
    int n_layers;
    int max_rank;
    size_t nbytes;          /* bytes of A, B and Bᵀ held (in their dtype) */
    bool hold_bf16;         /* F32 and F16 weights rounded to BF16 (nearest even) as they are
                             * copied in: --lora-dtype bf16 */
    uint32_t host_layers;   /* layers whose weights are in (a cs_flag, read with cs_flag_load):
                             * n_layers once loaded; a load streaming in (lora_adapter_begin)
                             * raises it layer by layer, and sets LORA_HOST_FAILED (above any
                             * count) when it fails part way: what is not there stays zero */
    lora_module_t *mods;    /* [n_layers * LORA_N_TARGETS] */
    struct lora_slot *slots; /* its backend adapter slots (lora_adapter_slot), freed with it */
} lora_adapter_t;

#define LORA_HOST_FAILED 0x40000000u

/* every layer's weights are in host memory (a load streaming in has finished) */
static inline bool lora_adapter_complete(const lora_adapter_t *a) {
    return cs_flag_load(&a->host_layers) == (uint32_t)a->n_layers;
}
static inline bool lora_adapter_failed(const lora_adapter_t *a) {
    return cs_flag_load(&a->host_layers) == LORA_HOST_FAILED;
}

static inline lora_module_t *lora_adapter_module(const lora_adapter_t *a, int layer, lora_target t) {
    return &a->mods[layer * LORA_N_TARGETS + t];
}

/* Load DIR (adapter_config.json + adapter_model.safetensors) against the base config. The
 * weights are held as the file has them: BF16 stays BF16, F32 and F16 become F32; with
 * BF16 (lora_adapter_load_as), every module is held in BF16, F32 and F16 rounded to nearest
 * even (--lora-dtype bf16: half the bytes to hold and to stream per token, as vLLM holds
 * LoRA weights in a BF16 model's dtype). The functions below that take BF16 mean the same. */
int lora_adapter_load(const char *dir, const model_config_t *cfg, lora_adapter_t **out);
int lora_adapter_load_as(const char *dir, const model_config_t *cfg, bool bf16, lora_adapter_t **out);

/* The same load from files already in memory (the io_uring loader, an HTTP upload):
 * CONFIG_JSON is adapter_config.json's text (CONFIG_LEN bytes, NUL not needed) and ST the
 * opened adapter_model.safetensors; nothing is read from disk. DIR is where they came from:
 * it names the files in error messages and becomes a->path; a->name is NAME, or DIR's
 * basename when NAME is NULL. ST is only read: the caller frees it (the adapter holds its
 * own F32 copies). */
int lora_adapter_load_buffers(const char *name, const char *dir, const char *config_json,
                              size_t config_len, const struct safetensors *st,
                              const model_config_t *cfg, bool bf16, lora_adapter_t **out);

/* A load that streams in (the cold start: the io_uring loader's chunks, read in layer
 * order). lora_adapter_begin plans and checks the adapter from CONFIG_JSON and ST, of which
 * only the header is read, and allocates every module (host_layers = 0);
 * lora_adapter_layer_span gives the bytes of the file (offsets from BASE, the buffer ST was
 * opened on) that layer L's tensors take; lora_adapter_fill_layers copies layers [L0, L1)
 * from ST, whose bytes must be in by then, raising host_layers after each (L0 must be
 * host_layers: layers come in order); lora_adapter_host_fail marks a load that failed part
 * way. One thread fills; any may read host_layers. */
int lora_adapter_begin(const char *name, const char *dir, const char *config_json, size_t config_len,
                       const struct safetensors *st, const model_config_t *cfg, bool bf16, lora_adapter_t **out);
void lora_adapter_layer_span(const lora_adapter_t *a, const struct safetensors *st, const void *base, int l,
                             size_t *begin, size_t *end);
int lora_adapter_fill_layers(lora_adapter_t *a, const struct safetensors *st, int l0, int l1);
void lora_adapter_host_fail(lora_adapter_t *a);

/* Bytes of F32 A, B and Bᵀ that adapter_config.json CONFIG_JSON implies for this base model,
 * with the same checks of the config as a load: a bound on the nbytes of the adapter it
 * would load (BF16 weights take half), so a cache can reserve room before reading them. */
int lora_adapter_config_nbytes(const char *dir, const char *config_json, size_t config_len,
                               const model_config_t *cfg, size_t *nbytes);
/* What a scheduler and a cache need to know of an adapter before its weights are read. */
typedef struct lora_adapter_info {
    int n_layers;
    unsigned targets;       /* bit t set when some layer adapts target t (lora_target) */
    int n_modules;          /* (layer, target) pairs adapted */
    int max_rank, min_rank; /* over the adapted modules */
    long rank_sum;          /* Σ rank over them: the adapter's LoRA work per token is
                             * Σ rank · (d_in + d_out) */
    cs_dtype dtype;         /* BF16 when every module is held in BF16, else F32 */
    size_t nbytes;          /* exactly the nbytes a load will hold */
} lora_adapter_info_t;

/* adapter_config.json and the safetensors header(s) of DIR only (the weights' pages are not
 * touched): the same checks as lora_adapter_load short of reading the weights. */
int lora_adapter_probe(const char *dir, const model_config_t *cfg, bool bf16, lora_adapter_info_t *info);
/* The same facts of a loaded adapter. */
void lora_adapter_info(const lora_adapter_t *a, lora_adapter_info_t *info);

/* Frees the adapter and its backend slots. */
void lora_adapter_free(lora_adapter_t *a);

/* A new slot on backend BE holding the adapter's weights in their dtype; the adapter must
 * outlive it (a host-memory backend uses the weights in place). The caller frees it
 * (backend_adapter_free): the registry's device tier manages its slots this way. */
int lora_adapter_upload(const lora_adapter_t *a, backend_t *be, backend_adapter_t **slot);

/* The same as a slot streaming in, GROUP layers at a time (backend_adapter_stream); A must
 * outlive it. */
int lora_adapter_stream(const lora_adapter_t *a, backend_t *be, int group, void (*on_group)(void *), void *user,
                        backend_adapter_t **slot);

/* The adapter's own slot on backend BE (for callers without a registry): uploaded on first use (its weights in the dtype they
 * are held in; a host-memory backend uses them in place), kept until lora_adapter_free.
 * Thread-safe. */
int lora_adapter_slot(lora_adapter_t *a, backend_t *be, backend_adapter_t **slot);

/* A's or B's element I as a float, whatever the module's dtype. */
static inline float lora_module_at(const lora_module_t *m, const void *w, size_t i) {
    return m->dtype == CS_DTYPE_BF16 ? cs_bf16_to_f32(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

/* Projection shapes of the base model: d_in / d_out of each target. */
void lora_target_dims(const model_config_t *cfg, lora_target t, int *d_in, int *d_out);

#endif
