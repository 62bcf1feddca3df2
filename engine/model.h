/* model.h: a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) loaded from a Hugging Face
 * directory onto a backend, and its forward pass with a per-sequence KV cache. LoRA is
 * applied per call (the adapter of the sequence being run). Semantics follow transformers. */
#ifndef CS_MODEL_H
#define CS_MODEL_H

#include "engine/backend.h"
#include "engine/model_config.h"
#include "lora/peft.h"

typedef struct model model_t;
typedef struct model_seq model_seq_t;

/* Validates every tensor (present, dtype F32/F16/BF16, shape); errors name the tensor. */
int model_load(const char *dir, backend_t *be, model_t **out);
void model_free(model_t *m);
const model_config_t *model_get_config(const model_t *m);
size_t model_n_params(const model_t *m);
cs_dtype model_weight_dtype(const model_t *m);

/* A sequence's KV cache with room for `capacity` tokens. */
model_seq_t *model_seq_new(model_t *m, int capacity);
void model_seq_free(model_seq_t *s);
int model_seq_len(const model_seq_t *s);
void model_seq_reset(model_seq_t *s);

/* Append n tokens to s and run them. logits (host memory) receives
 * (all_logits ? n : 1) rows of vocab_size floats: every position or the last one.
 * lora may be NULL (base model). Fails with CS_EINVAL when the cache is full or an id is
 * out of range. */
int model_forward(model_t *m, model_seq_t *s, const int32_t *ids, int n, const lora_adapter_t *lora,
                  float *logits, bool all_logits);

/* RoPE inverse frequencies (head_dim/2 values) as transformers computes them. */
void model_rope_inv_freq(const model_config_t *cfg, float *inv_freq);

#endif
