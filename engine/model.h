/* model.h: a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) loaded from a Hugging Face
 * directory onto a backend, and its forward pass with a per-sequence KV cache. LoRA is
 * applied per call (the adapter of the sequence being run). Semantics follow transformers. */
#ifndef CS_MODEL_H
#define CS_MODEL_H

#include "backend/backend.h"
#include "engine/kv_cache.h"
#include "base/model_config.h"
#include "lora/peft.h"

typedef struct model model_t;
typedef struct model_seq model_seq_t;

/* Validates every tensor (present, dtype F32/F16/BF16, shape); errors name the tensor. DIR
 * is a Hugging Face directory (config.json, safetensors) or a GGUF file (model_path_is_gguf):
 * its metadata gives the config, its tensors keep their types (the block-quantized ones of
 * base/quant.h where the backend takes them, caps.quant_weights; norms and biases widened
 * to F32 as always). */
int model_load(const char *dir, backend_t *be, model_t **out);
/* PATH names a GGUF file (ends in .gguf and is not a directory) */
bool model_path_is_gguf(const char *path);
/* --quantization: every model this process loads from here on has its F32/F16/BF16 projection
 * matrices (q, k, v, o, gate, up, down; not the embedding or lm_head) quantized at load to T, one
 * of base/quant.h's block types, on THREADS threads (0: 1), by cs_quantize_row_ref. A matrix
 * whose rows are not whole blocks of T takes the 32-element type llama.cpp falls back to (Q4_K
 * -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0), or stays as it is where rows are not whole blocks of 32
 * either. CS_DTYPE_COUNT (the default): none. A setting of the process, so that the base weights
 * an RL trainer pushes later are quantized as the first ones were. */
void model_set_load_quantization(cs_dtype t, int threads);
cs_dtype model_load_quantization(void);
/* Where the weights live on a backend that uses host memory in place (the CPU backend):
 * AUTO reads them into the process's memory in 2 MiB pages where the kernel offers
 * transparent huge pages, else maps them; MMAP maps them (the page cache, shared with other
 * processes, 4 KiB pages); COPY reads them in whatever the kernel offers. A backend with its
 * own memory always maps the file and copies from there. model_load is AUTO. */
typedef enum { MODEL_WEIGHTS_AUTO, MODEL_WEIGHTS_MMAP, MODEL_WEIGHTS_COPY } model_weights_mem;
int model_load_how(const char *dir, backend_t *be, model_weights_mem how, model_t **out);
/* bytes of the weights' files read into the process's memory (0: mapped); *huge (may be
 * NULL): of those, in transparent huge pages */
size_t model_weights_copied(const model_t *m, size_t *huge);
/* bytes of those weights given back after loading: matmul weights the backend keeps in a
 * form of its own that serves every op (the CPU backend's --compress-weights) */
size_t model_weights_released(const model_t *m);
void model_free(model_t *m);
/* Check DIR as model_load would (config.json, every tensor's presence, dtype and shape, the
 * files' sizes against their headers) without loading anything: *cfg gets its config. */
int model_probe(const char *dir, model_config_t *cfg);
/* CS_OK when weights of config B can replace those of A (same architecture, every shape and
 * every field that changes the math); else CS_ESHAPE and WHY names the first difference. */
int model_config_compatible(const model_config_t *a, const model_config_t *b, char *why, size_t n);
const model_config_t *model_get_config(const model_t *m);
size_t model_n_params(const model_t *m);
cs_dtype model_weight_dtype(const model_t *m);
backend_t *model_backend(const model_t *m);

/* A sequence's KV cache with room for `capacity` tokens. */
model_seq_t *model_seq_new(model_t *m, int capacity, cs_dtype kv_dtype);
void model_seq_free(model_seq_t *s);
void model_seq_reset(model_seq_t *s);

/* Append n tokens to s and run them. logits (host memory) receives
 * (all_logits ? n : 1) rows of vocab_size floats: every position or the last one.
 * lora may be NULL (base model). Fails with CS_EINVAL when the cache is full or an id is
 * out of range. */
int model_forward(model_t *m, model_seq_t *s, const int32_t *ids, int n, const lora_adapter_t *lora,
                  float *logits, bool all_logits);

/* One sequence's part of a batch: n tokens at positions pos0 .. pos0 + n - 1, its KV for
 * [0, pos0) already in the cache through `blocks`, which must also cover the new positions.
 * n_logits: 0 (none), 1 (the last token) or n (every token). */
typedef struct model_batch_seq {
    const int32_t *ids;
    int n, pos0;
    const int32_t *blocks;
    const lora_adapter_t *lora;     /* NULL: base model */
    int n_logits;
    backend_adapter_t *slot;        /* lora's device slot (the registry's device tier); NULL:
                                     * the adapter's own slot (lora_adapter_slot) */
} model_batch_seq_t;

/* Run a batch of sequences in one pass: the base GEMMs once over every row, LoRA grouped
 * by runs of consecutive sequences with the same adapter (put them next to each other),
 * attention per sequence over the paged cache. logits receives the requested rows in
 * batch order (vocab_size floats each, host memory). */
int model_forward_batch(model_t *m, kv_cache_t *kv, const model_batch_seq_t *seqs, int n_seqs, float *logits);
/* Give back the buffer of output logits when it holds more than KEEP_ROWS rows (a step that
 * returned the logits of many prompt rows); the next forward allocates what it needs. */
void model_release_logits(model_t *m, int keep_rows);

/* The cold start: rows whose adapter slot is still streaming in (backend_adapter_stream)
 * take the LoRA term of the layers not yet there from the host workers POOL (lora/assist.h)
 * over the backend's get_signal / wait_add; layers that arrived run on the device. Without
 * a pool (or a backend without host-assisted ops) a forward waits for such a slot to fill.
 * POOL must outlive the model's use of it; NULL turns it off. */
struct lora_assist;
void model_set_assist(model_t *m, struct lora_assist *pool);
/* the cold start's pinned host buffers made now for batches of up to ROWS tokens (the engine:
 * its max_num_batched_tokens), not by the first cold request; nothing where the model cannot
 * assist. A later forward with more cold rows grows them. */
int model_assist_reserve(model_t *m, int rows);
bool model_can_assist(const model_t *m); /* a pool, and a backend with host-assisted ops */
struct lora_assist *model_assist(const model_t *m); /* the pool model_set_assist gave (NULL: none) */

typedef struct model_cold_stats {
    uint64_t forwards;          /* forwards with at least one slot still streaming in */
    uint64_t host_layers;       /* (adapter segment, layer) pairs whose LoRA ran on the host */
    uint64_t device_layers;     /* ... and on the device, in those forwards */
    uint64_t host_rows;         /* Σ rows x host layers */
    uint64_t waits;             /* forwards that waited for a slot (no pool) */
    uint64_t pinned_allocs;     /* pinned host buffers made for it (model_assist_reserve, growth) */
} model_cold_stats_t;
void model_get_cold_stats(const model_t *m, model_cold_stats_t *st);

/* RoPE inverse frequencies (head_dim/2 values) as transformers computes them. */
void model_rope_inv_freq(const model_config_t *cfg, float *inv_freq);

#endif
