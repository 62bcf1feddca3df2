/* model_config.h: the subset of a Hugging Face config.json that defines a Llama-family
 * decoder (Llama, Mistral, Qwen2, Qwen3). Anything that would change the math and that we
 * do not implement is refused by name rather than ignored. */
#ifndef CS_MODEL_CONFIG_H
#define CS_MODEL_CONFIG_H

#include "base/common.h"

typedef enum model_arch {
    MODEL_ARCH_LLAMA = 0,   /* LlamaForCausalLM */
    MODEL_ARCH_MISTRAL,     /* MistralForCausalLM */
    MODEL_ARCH_QWEN2,       /* Qwen2ForCausalLM: bias on q/k/v */
    MODEL_ARCH_QWEN3,       /* Qwen3ForCausalLM: RMSNorm on q and k per head */
} model_arch;

typedef enum rope_scaling_kind {
    ROPE_SCALING_NONE = 0,
    ROPE_SCALING_LLAMA3,
    ROPE_SCALING_LINEAR,
} rope_scaling_kind;

#define MODEL_MAX_EOS 8

typedef struct model_config {
    model_arch arch;
    char arch_name[64];
    int vocab_size;
    int hidden_size;
    int intermediate_size;
    int n_layers;
    int n_heads;
    int n_kv_heads;
    int head_dim;           /* config head_dim, else hidden_size / n_heads (Qwen3: 128) */
    int max_position_embeddings;
    float rms_norm_eps;
    double rope_theta;
    rope_scaling_kind rope_scaling;
    double rope_factor;             /* llama3, linear */
    double rope_low_freq_factor;    /* llama3 */
    double rope_high_freq_factor;   /* llama3 */
    int rope_original_max_pos;      /* llama3 original_max_position_embeddings */
    bool tie_word_embeddings;
    bool attention_bias;            /* q/k/v bias (Qwen2 always; Llama attention_bias) */
    bool o_bias;                    /* o_proj bias (Llama attention_bias) */
    bool mlp_bias;                  /* Llama mlp_bias */
    bool qk_norm;                   /* Qwen3 */
    int sliding_window;             /* 0 = full attention; else every layer slides (mixed
                                     * full/sliding layer_types are refused at parse) */
    cs_dtype torch_dtype;           /* declared dtype (F32 if absent) */
    int bos_token_id;               /* -1 if absent */
    int eos_token_ids[MODEL_MAX_EOS];
    int n_eos;
} model_config_t;

/* Parse config.json text / load DIR/config.json. Errors name the field. */
int model_config_parse(const char *json_text, model_config_t *out);
int model_config_load(const char *dir, model_config_t *out);
/* The config a GGUF file's metadata describes ({arch}.* keys, the tokenizer's size and special
 * ids, tensors present), checked as config.json is. Errors name the file and the key. */
struct gguf;
int model_config_from_gguf(const struct gguf *g, model_config_t *out);

/* The sampling defaults a model's generation_config.json recommends, taken as vLLM's
 * `--generation-config auto` takes them: of temperature, top_p, top_k, min_p,
 * repetition_penalty and max_new_tokens, those whose value differs from transformers'
 * GenerationConfig defaults (1.0, 1.0, 50, none, 1.0, none). A request's own values win. */
enum {
    MODEL_GEN_TEMPERATURE = 1 << 0,
    MODEL_GEN_TOP_P = 1 << 1,
    MODEL_GEN_TOP_K = 1 << 2,
    MODEL_GEN_MIN_P = 1 << 3,
    MODEL_GEN_REPETITION_PENALTY = 1 << 4,
    MODEL_GEN_MAX_TOKENS = 1 << 5,
};
typedef struct model_gen_defaults {
    unsigned set;                   /* MODEL_GEN_* bits: the fields below that hold a value */
    double temperature, top_p, min_p, repetition_penalty;
    int top_k;
    int max_tokens;                 /* max_new_tokens */
} model_gen_defaults_t;

/* Parse generation_config.json text (LABEL names it in errors) / load DIR's, where a model
 * without the file has no defaults (CS_OK, set = 0). Errors name the field. */
int model_gen_defaults_parse(const char *label, const char *json_text, model_gen_defaults_t *out);
int model_gen_defaults_load(const char *dir, model_gen_defaults_t *out);

#endif
