/* model_config.c: config.json -> model_config_t for Llama, Mistral, Qwen2 and Qwen3, with
 * the defaults transformers 5.23 applies per architecture when a key is absent (they differ:
 * e.g. num_key_value_heads is 8 for Mistral and 32 for Qwen2/Qwen3 when absent). RoPE is read
 * from either the legacy `rope_scaling` + `rope_theta` layout or the transformers 5
 * `rope_parameters` dict, as transformers' own standardization does. */
#include "base/model_config.h"
#include "base/gguf.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MC_MAX_DIM (1 << 20)       /* hidden, intermediate, heads * head_dim */
#define MC_MAX_VOCAB (1 << 24)
#define MC_MAX_LAYERS 4096

static const struct arch_info {
    const char *name;
    model_arch arch;
    int kv_heads_absent;    /* num_key_value_heads when the key is absent; 0 = num_attention_heads */
    int max_pos_absent;
    int head_dim_absent;    /* 0 = hidden_size / num_attention_heads */
} arch_tab[] = {
    { "LlamaForCausalLM",   MODEL_ARCH_LLAMA,   0,  2048,   0   },
    { "MistralForCausalLM", MODEL_ARCH_MISTRAL, 8,  131072, 0   },
    { "Qwen2ForCausalLM",   MODEL_ARCH_QWEN2,   32, 32768,  0   },
    { "Qwen3ForCausalLM",   MODEL_ARCH_QWEN3,   32, 32768,  128 },
};

static int get_int(const char *label, const json_t *obj, const char *key, bool required, int def,
                   int *out) {
    json_t *v = cs_json_get(obj, key);
    if (!v) {
        if (required) return cs_error_set(CS_EFORMAT, "%s: missing required field '%s'", label, key);
        *out = def;
        return CS_OK;
    }
    if (!json_is_integer(v))
        return cs_error_set(CS_EFORMAT, "%s: field '%s' must be an integer, got %s", label, key, cs_json_type_name(v));
    json_int_t x = json_integer_value(v);
    if (x < -2147483647LL || x > 2147483647LL)
        return cs_error_set(CS_EFORMAT, "%s: field '%s' = %lld is out of range", label, key, (long long)x);
    *out = (int)x;
    return CS_OK;
}

static int get_num(const char *label, const char *where, const json_t *obj, const char *key,
                   bool required, double def, double *out) {
    json_t *v = cs_json_get(obj, key);
    if (!v) {
        if (required)
            return cs_error_set(CS_EFORMAT, "%s: missing required field '%s%s'", label, where, key);
        *out = def;
        return CS_OK;
    }
    if (!json_is_number(v))
        return cs_error_set(CS_EFORMAT, "%s: field '%s%s' must be a number, got %s", label, where,
                            key, cs_json_type_name(v));
    *out = json_number_value(v);
    if (!isfinite(*out))
        return cs_error_set(CS_EFORMAT, "%s: field '%s%s' is not finite", label, where, key);
    return CS_OK;
}

static int get_bool(const char *label, const json_t *obj, const char *key, bool def, bool *out) {
    json_t *v = cs_json_get(obj, key);
    if (!v) { *out = def; return CS_OK; }
    if (!json_is_boolean(v))
        return cs_error_set(CS_EFORMAT, "%s: field '%s' must be a boolean, got %s", label, key, cs_json_type_name(v));
    *out = json_is_true(v);
    return CS_OK;
}

static int get_token_id(const char *label, const json_t *v, const char *key, int *out) {
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > 2147483647LL)
        return cs_error_set(CS_EFORMAT, "%s: field '%s' must be a non-negative integer token id", label, key);
    *out = (int)json_integer_value(v);
    return CS_OK;
}

/* RoPE: mirrors transformers' convert_rope_params_to_dict + standardize_rope_params. */
static int parse_rope(const char *label, const json_t *root, model_config_t *c) {
    json_t *rs = cs_json_get(root, "rope_scaling"), *rp = cs_json_get(root, "rope_parameters");
    if (rs && !json_is_object(rs))
        return cs_error_set(CS_EFORMAT, "%s: field 'rope_scaling' must be an object, got %s", label, cs_json_type_name(rs));
    if (rp && !json_is_object(rp))
        return cs_error_set(CS_EFORMAT, "%s: field 'rope_parameters' must be an object, got %s", label, cs_json_type_name(rp));
    /* `rope_scaling or rope_parameters`: an empty rope_scaling falls through */
    const json_t *rope = (rs && json_object_size(rs) > 0) ? rs : rp;
    const char *field = rope == rs ? "rope_scaling" : "rope_parameters";
    char where[40];
    snprintf(where, sizeof where, "%s.", field);

    if (rope && (json_is_object(json_object_get(rope, "full_attention")) ||
                 json_is_object(json_object_get(rope, "sliding_attention"))))
        return cs_error_set(CS_EUNSUPPORTED, "%s: '%s' nested per layer type is not supported", label, field);

    int rc;
    double top_theta;
    if ((rc = get_num(label, "", root, "rope_theta", false, 10000.0, &top_theta))) return rc;
    if (rope) {
        if ((rc = get_num(label, where, rope, "rope_theta", false, top_theta, &c->rope_theta))) return rc;
    } else {
        c->rope_theta = top_theta;
    }
    if (!(c->rope_theta > 0))
        return cs_error_set(CS_EFORMAT, "%s: rope_theta must be positive, got %g", label, c->rope_theta);

    double prf;
    if ((rc = get_num(label, "", root, "partial_rotary_factor", false, 1.0, &prf))) return rc;
    if (rope && (rc = get_num(label, where, rope, "partial_rotary_factor", false, prf, &prf))) return rc;
    if (prf != 1.0)
        return cs_error_set(CS_EUNSUPPORTED, "%s: partial_rotary_factor %g is not supported (only 1.0)", label, prf);

    const char *type = "default";
    if (rope) {
        json_t *t = cs_json_get(rope, "rope_type");
        if (!t) t = cs_json_get(rope, "type");
        if (t && !json_is_string(t))
            return cs_error_set(CS_EFORMAT, "%s: field '%srope_type' must be a string, got %s", label, where, cs_json_type_name(t));
        if (t) type = json_string_value(t);
    }
    c->rope_scaling = ROPE_SCALING_NONE;
    c->rope_factor = 1.0;
    c->rope_low_freq_factor = c->rope_high_freq_factor = 0.0;
    c->rope_original_max_pos = 0;
    if (strcmp(type, "default") == 0) return CS_OK;
    if (strcmp(type, "linear") == 0) {
        c->rope_scaling = ROPE_SCALING_LINEAR;
        if ((rc = get_num(label, where, rope, "factor", true, 0, &c->rope_factor))) return rc;
        if (!(c->rope_factor > 0))
            return cs_error_set(CS_EFORMAT, "%s: %sfactor must be positive", label, where);
        return CS_OK;
    }
    if (strcmp(type, "llama3") == 0) {
        c->rope_scaling = ROPE_SCALING_LLAMA3;
        if ((rc = get_num(label, where, rope, "factor", true, 0, &c->rope_factor)) ||
            (rc = get_num(label, where, rope, "low_freq_factor", true, 0, &c->rope_low_freq_factor)) ||
            (rc = get_num(label, where, rope, "high_freq_factor", true, 0, &c->rope_high_freq_factor)))
            return rc;
        /* a top-level original_max_position_embeddings wins (transformers' Phi-3 exception),
         * then the rope dict's, then max_position_embeddings */
        int orig;
        if ((rc = get_int(label, rope, "original_max_position_embeddings", false,
                          c->max_position_embeddings, &orig)) ||
            (rc = get_int(label, root, "original_max_position_embeddings", false, orig, &orig)))
            return rc;
        c->rope_original_max_pos = orig;
        if (!(c->rope_factor > 0) || !(c->rope_low_freq_factor > 0) ||
            !(c->rope_high_freq_factor > c->rope_low_freq_factor) || orig <= 0)
            return cs_error_set(CS_EFORMAT,
                                "%s: invalid llama3 %s: need factor > 0, 0 < low_freq_factor < "
                                "high_freq_factor, original_max_position_embeddings > 0",
                                label, field);
        return CS_OK;
    }
    return cs_error_set(CS_EUNSUPPORTED, "%s: rope type '%s' (%s) is not supported (default, linear, llama3)",
                        label, type, field);
}

static int parse_sliding(const char *label, const json_t *root, model_config_t *c) {
    int rc;
    c->sliding_window = 0;
    if (c->arch == MODEL_ARCH_LLAMA) return CS_OK;   /* LlamaAttention has no sliding window */

    json_t *swv = json_object_get(root, "sliding_window");
    int sw;
    if (!swv) sw = 4096;                             /* dataclass default of both configs */
    else if (json_is_null(swv)) sw = 0;
    else if ((rc = get_int(label, root, "sliding_window", true, 0, &sw))) return rc;
    if (swv && !json_is_null(swv) && sw <= 0)
        return cs_error_set(CS_EFORMAT, "%s: sliding_window must be positive or null, got %d", label, sw);

    if (c->arch == MODEL_ARCH_MISTRAL) { c->sliding_window = sw; return CS_OK; }

    /* Qwen2/Qwen3: the window applies only with use_sliding_window, and only to the layers
     * layer_types marks "sliding_attention" (computed from max_window_layers when absent) */
    bool use;
    if ((rc = get_bool(label, root, "use_sliding_window", false, &use))) return rc;
    if (!use) sw = 0;
    int n_sliding = 0;
    json_t *lt = cs_json_get(root, "layer_types");
    if (lt) {
        if (!json_is_array(lt) || json_array_size(lt) != (size_t)c->n_layers)
            return cs_error_set(CS_EFORMAT, "%s: field 'layer_types' must be an array of %d strings",
                                label, c->n_layers);
        for (size_t i = 0; i < json_array_size(lt); i++) {
            const char *s = json_string_value(json_array_get(lt, i));
            if (!s)
                return cs_error_set(CS_EFORMAT, "%s: layer_types[%zu] is not a string", label, i);
            if (strcmp(s, "sliding_attention") == 0) n_sliding++;
            else if (strcmp(s, "full_attention") != 0)
                return cs_error_set(CS_EUNSUPPORTED, "%s: layer_types[%zu] = '%s' is not supported", label, i, s);
        }
    } else {
        int mwl;
        if ((rc = get_int(label, root, "max_window_layers", false, 28, &mwl))) return rc;
        n_sliding = mwl <= 0 ? c->n_layers : mwl >= c->n_layers ? 0 : c->n_layers - mwl;
    }
    if (sw == 0 || n_sliding == 0) return CS_OK;
    if (n_sliding != c->n_layers)
        return cs_error_set(CS_EUNSUPPORTED,
                            "%s: use_sliding_window with %s makes %d of %d layers sliding-window and "
                            "the rest full attention; mixed attention is not supported",
                            label, lt ? "layer_types" : "max_window_layers", n_sliding, c->n_layers);
    c->sliding_window = sw;
    return CS_OK;
}

/* architectures[0] -> the arch's table entry */
static int parse_arch(const char *label, const json_t *root, model_config_t *c, const struct arch_info **out) {
    json_t *archs = cs_json_get(root, "architectures");
    if (!archs) return cs_error_set(CS_EFORMAT, "%s: missing required field 'architectures'", label);
    if (!json_is_array(archs) || json_array_size(archs) == 0 || !json_is_string(json_array_get(archs, 0)))
        return cs_error_set(CS_EFORMAT, "%s: field 'architectures' must be a non-empty array of strings", label);
    const char *an = json_string_value(json_array_get(archs, 0));
    const struct arch_info *ai = NULL;
    for (size_t i = 0; i < CS_ARRAY_LEN(arch_tab); i++)
        if (strcmp(an, arch_tab[i].name) == 0) ai = &arch_tab[i];
    if (!ai)
        return cs_error_set(CS_EUNSUPPORTED,
                            "%s: architecture '%s' is not supported (LlamaForCausalLM, "
                            "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)", label, an);
    c->arch = ai->arch;
    snprintf(c->arch_name, sizeof c->arch_name, "%s", ai->name);
    if (cs_json_get(root, "quantization_config"))
        return cs_error_set(CS_EUNSUPPORTED, "%s: quantized checkpoints (quantization_config) are not supported", label);
    *out = ai;
    return CS_OK;
}

/* the required sizes, each positive and within what is supported */
static int parse_sizes(const char *label, const json_t *root, model_config_t *c) {
    int rc;
    if ((rc = get_int(label, root, "vocab_size", true, 0, &c->vocab_size)) ||
        (rc = get_int(label, root, "hidden_size", true, 0, &c->hidden_size)) ||
        (rc = get_int(label, root, "intermediate_size", true, 0, &c->intermediate_size)) ||
        (rc = get_int(label, root, "num_hidden_layers", true, 0, &c->n_layers)) ||
        (rc = get_int(label, root, "num_attention_heads", true, 0, &c->n_heads)))
        return rc;
    struct { const char *k; int v, max; } pos[] = {
        { "vocab_size", c->vocab_size, MC_MAX_VOCAB }, { "hidden_size", c->hidden_size, MC_MAX_DIM },
        { "intermediate_size", c->intermediate_size, MC_MAX_DIM },
        { "num_hidden_layers", c->n_layers, MC_MAX_LAYERS }, { "num_attention_heads", c->n_heads, MC_MAX_DIM },
    };
    for (size_t i = 0; i < CS_ARRAY_LEN(pos); i++) {
        if (pos[i].v <= 0) return cs_error_set(CS_EFORMAT, "%s: field '%s' must be positive, got %d", label, pos[i].k, pos[i].v);
        if (pos[i].v > pos[i].max) return cs_error_set(CS_EUNSUPPORTED, "%s: field '%s' = %d is larger than supported (%d)", label, pos[i].k, pos[i].v, pos[i].max);
    }
    return CS_OK;
}

/* num_key_value_heads and head_dim, with the arch's defaults */
static int parse_heads(const char *label, const json_t *root, const struct arch_info *ai, model_config_t *c) {
    int rc;
    /* num_key_value_heads: absent -> the arch's dataclass default; null -> num_attention_heads */
    json_t *kv = json_object_get(root, "num_key_value_heads");
    if ((rc = get_int(label, root, "num_key_value_heads", false,
                      (!kv && ai->kv_heads_absent) ? ai->kv_heads_absent : c->n_heads, &c->n_kv_heads)))
        return rc;
    if (c->n_kv_heads <= 0 || c->n_kv_heads > c->n_heads || c->n_heads % c->n_kv_heads != 0)
        return cs_error_set(CS_EFORMAT, "%s: num_attention_heads (%d) must be a positive multiple of num_key_value_heads (%d)",
                            label, c->n_heads, c->n_kv_heads);

    /* head_dim: Llama/Mistral treat null as absent; Qwen2 reads it with getattr and Qwen3's
     * dataclass requires an int, so null there breaks transformers and is refused */
    json_t *hd = json_object_get(root, "head_dim");
    if (json_is_null(hd) && (c->arch == MODEL_ARCH_QWEN2 || c->arch == MODEL_ARCH_QWEN3))
        return cs_error_set(CS_EFORMAT, "%s: field 'head_dim' may not be null for %s", label, ai->name);
    if ((rc = get_int(label, root, "head_dim", false,
                      (!hd && ai->head_dim_absent) ? ai->head_dim_absent : c->hidden_size / c->n_heads,
                      &c->head_dim)))
        return rc;
    if (c->head_dim <= 0 || c->head_dim % 2 != 0 || (long long)c->head_dim * c->n_heads > MC_MAX_DIM)
        return cs_error_set(CS_EFORMAT, "%s: head_dim %d must be positive and even (with heads * head_dim <= %d)",
                            label, c->head_dim, MC_MAX_DIM);
    if (c->arch == MODEL_ARCH_LLAMA && c->hidden_size % c->n_heads != 0)
        return cs_error_set(CS_EFORMAT, "%s: hidden_size (%d) is not a multiple of num_attention_heads (%d)",
                            label, c->hidden_size, c->n_heads);
    return CS_OK;
}

/* max_position_embeddings, rms_norm_eps, hidden_act */
static int parse_misc(const char *label, const json_t *root, const struct arch_info *ai, model_config_t *c) {
    int rc;
    if ((rc = get_int(label, root, "max_position_embeddings", false, ai->max_pos_absent,
                      &c->max_position_embeddings)))
        return rc;
    if (c->max_position_embeddings <= 0)
        return cs_error_set(CS_EFORMAT, "%s: field 'max_position_embeddings' must be positive", label);
    double eps;
    if ((rc = get_num(label, "", root, "rms_norm_eps", false, 1e-6, &eps))) return rc;
    if (eps < 0) return cs_error_set(CS_EFORMAT, "%s: field 'rms_norm_eps' must be >= 0", label);
    c->rms_norm_eps = (float)eps;

    json_t *act = cs_json_get(root, "hidden_act");
    if (act && !json_is_string(act))
        return cs_error_set(CS_EFORMAT, "%s: field 'hidden_act' must be a string, got %s", label, cs_json_type_name(act));
    if (act && strcmp(json_string_value(act), "silu") != 0 && strcmp(json_string_value(act), "swish") != 0)
        return cs_error_set(CS_EUNSUPPORTED, "%s: hidden_act '%s' is not supported (only silu)", label,
                            json_string_value(act));
    return CS_OK;
}

/* tie_word_embeddings and the biases and norms each arch has */
static int parse_biases(const char *label, const json_t *root, model_config_t *c) {
    int rc;
    if ((rc = get_bool(label, root, "tie_word_embeddings", false, &c->tie_word_embeddings))) return rc;
    bool ab = false, mb = false;
    switch (c->arch) {
    case MODEL_ARCH_LLAMA:
        if ((rc = get_bool(label, root, "attention_bias", false, &ab)) ||
            (rc = get_bool(label, root, "mlp_bias", false, &mb)))
            return rc;
        c->attention_bias = c->o_bias = ab;
        c->mlp_bias = mb;
        break;
    case MODEL_ARCH_MISTRAL:
        break;
    case MODEL_ARCH_QWEN2:
        c->attention_bias = true;
        break;
    case MODEL_ARCH_QWEN3:
        if ((rc = get_bool(label, root, "attention_bias", false, &ab))) return rc;
        c->attention_bias = c->o_bias = ab;
        c->qk_norm = true;
        break;
    }
    return CS_OK;
}

/* dtype (transformers 5) or torch_dtype */
static int parse_dtype(const char *label, const json_t *root, model_config_t *c) {
    const char *dkey = cs_json_get(root, "dtype") ? "dtype" : "torch_dtype";
    json_t *dt = cs_json_get(root, dkey);
    c->torch_dtype = CS_DTYPE_F32;
    if (!dt) return CS_OK;
    const char *s = json_string_value(dt);
    if (!s) return cs_error_set(CS_EFORMAT, "%s: field '%s' must be a string, got %s", label, dkey, cs_json_type_name(dt));
    if (!strcmp(s, "float32") || !strcmp(s, "float")) c->torch_dtype = CS_DTYPE_F32;
    else if (!strcmp(s, "bfloat16")) c->torch_dtype = CS_DTYPE_BF16;
    else if (!strcmp(s, "float16") || !strcmp(s, "half")) c->torch_dtype = CS_DTYPE_F16;
    else return cs_error_set(CS_EUNSUPPORTED, "%s: %s '%s' is not supported (float32, bfloat16, float16)", label, dkey, s);
    return CS_OK;
}

/* bos_token_id and eos_token_id (one id or a list) */
static int parse_special_ids(const char *label, const json_t *root, model_config_t *c) {
    int rc;
    json_t *bos = cs_json_get(root, "bos_token_id"), *eos = cs_json_get(root, "eos_token_id");
    c->bos_token_id = -1;
    if (bos && (rc = get_token_id(label, bos, "bos_token_id", &c->bos_token_id))) return rc;
    c->n_eos = 0;
    if (eos && json_is_array(eos)) {
        if (json_array_size(eos) > MODEL_MAX_EOS)
            return cs_error_set(CS_EUNSUPPORTED, "%s: more than %d eos_token_id values", label, MODEL_MAX_EOS);
        for (size_t i = 0; i < json_array_size(eos); i++)
            if ((rc = get_token_id(label, json_array_get(eos, i), "eos_token_id", &c->eos_token_ids[c->n_eos++])))
                return rc;
    } else if (eos) {
        if ((rc = get_token_id(label, eos, "eos_token_id", &c->eos_token_ids[0]))) return rc;
        c->n_eos = 1;
    }
    return CS_OK;
}

/* *OUT = the JSON object of TEXT */
static int load_object(const char *label, const char *json_text, json_t **out) {
    json_error_t jerr;
    json_t *root = json_loads(json_text, 0, &jerr);   /* duplicate keys: the last wins, as in Python */
    *out = NULL;
    if (!root) return cs_error_set(CS_EFORMAT, "%s: not valid JSON: %s (line %d)", label, jerr.text, jerr.line);
    if (!json_is_object(root)) {
        json_decref(root);
        return cs_error_set(CS_EFORMAT, "%s: expected a JSON object", label);
    }
    *out = root;
    return CS_OK;
}

static int parse_impl(const char *label, const char *json_text, model_config_t *c) {
    memset(c, 0, sizeof *c);
    json_t *root;
    int rc = load_object(label, json_text, &root);
    if (rc) return rc;
    const struct arch_info *ai = NULL;
    rc = parse_arch(label, root, c, &ai);
    if (!rc) rc = parse_sizes(label, root, c);
    if (!rc) rc = parse_heads(label, root, ai, c);
    if (!rc) rc = parse_misc(label, root, ai, c);
    if (!rc) rc = parse_rope(label, root, c);
    if (!rc) rc = parse_biases(label, root, c);
    if (!rc) rc = parse_sliding(label, root, c);
    if (!rc) rc = parse_dtype(label, root, c);
    if (!rc) rc = parse_special_ids(label, root, c);
    json_decref(root);
    return rc;
}

int model_config_parse(const char *json_text, model_config_t *out) {
    return parse_impl("config.json", json_text, out);
}

int model_config_load(const char *dir, model_config_t *out) {
    char *path = cs_path_join(dir, "config.json");
    if (!path) return cs_error_set(CS_ENOMEM, "%s: out of memory", dir);
    if (!cs_file_exists(path)) {
        int rc = cs_error_set(CS_ENOTFOUND, "%s: no config.json", dir);
        free(path);
        memset(out, 0, sizeof *out);
        return rc;
    }
    char *text = cs_read_file(path, NULL);
    int rc = text ? parse_impl(path, text, out) : CS_EIO;
    free(text);
    free(path);
    return rc;
}

/* transformers' GenerationConfig defaults of the fields taken: a value equal to the default
 * is not a recommendation (GenerationConfig.to_diff_dict drops it) */
static const struct gen_field {
    const char *key;
    unsigned bit;
    bool integer;
    double def;         /* NAN: no default, any value counts */
    double lo;          /* the smallest valid value */
} gen_fields[] = {
    { "temperature",        MODEL_GEN_TEMPERATURE,        false, 1.0, 0.0 },
    { "top_p",              MODEL_GEN_TOP_P,              false, 1.0, 0.0 },
    { "top_k",              MODEL_GEN_TOP_K,              true,  50,  0.0 },
    { "min_p",              MODEL_GEN_MIN_P,              false, NAN, 0.0 },
    { "repetition_penalty", MODEL_GEN_REPETITION_PENALTY, false, 1.0, 0.0 },
    { "max_new_tokens",     MODEL_GEN_MAX_TOKENS,         true,  NAN, 1.0 },
};

static void gen_store(model_gen_defaults_t *g, unsigned bit, double x) {
    switch (bit) {
    case MODEL_GEN_TEMPERATURE: g->temperature = x; break;
    case MODEL_GEN_TOP_P: g->top_p = x; break;
    case MODEL_GEN_TOP_K: g->top_k = (int)x; break;
    case MODEL_GEN_MIN_P: g->min_p = x; break;
    case MODEL_GEN_REPETITION_PENALTY: g->repetition_penalty = x; break;
    default: g->max_tokens = (int)x; break;
    }
    g->set |= bit;
}

int model_gen_defaults_parse(const char *label, const char *json_text, model_gen_defaults_t *out) {
    memset(out, 0, sizeof *out);
    json_t *root;
    int rc = load_object(label, json_text, &root);
    if (rc) return rc;
    for (size_t i = 0; i < CS_ARRAY_LEN(gen_fields) && !rc; i++) {
        const struct gen_field *f = &gen_fields[i];
        json_t *v = json_object_get(root, f->key);
        if (!v || json_is_null(v)) continue;
        double x;
        if (f->integer) {
            int n;
            if ((rc = get_int(label, root, f->key, true, 0, &n))) break;
            x = n;
        } else if ((rc = get_num(label, "", root, f->key, true, 0, &x))) {
            break;
        }
        if (x < f->lo) {
            rc = cs_error_set(CS_EFORMAT, "%s: field '%s' must be >= %g, got %g", label, f->key, f->lo, x);
            break;
        }
        if ((f->bit == MODEL_GEN_TOP_P && !(x > 0 && x <= 1)) || (f->bit == MODEL_GEN_MIN_P && x > 1) ||
            (f->bit == MODEL_GEN_REPETITION_PENALTY && !(x > 0))) {
            rc = cs_error_set(CS_EFORMAT, "%s: field '%s' = %g is out of range", label, f->key, x);
            break;
        }
        if (isnan(f->def) || x != f->def) gen_store(out, f->bit, x);
    }
    json_decref(root);
    if (rc) memset(out, 0, sizeof *out);
    return rc;
}

int model_gen_defaults_load(const char *dir, model_gen_defaults_t *out) {
    memset(out, 0, sizeof *out);
    char *path = cs_path_join(dir, "generation_config.json");
    if (!path) return cs_error_set(CS_ENOMEM, "%s: out of memory", dir);
    int rc = CS_OK;
    if (cs_file_exists(path)) {
        char *text = cs_read_file(path, NULL);
        rc = text ? model_gen_defaults_parse(path, text, out) : CS_EIO;
        free(text);
    }
    free(path);
    return rc;
}

/* ---- GGUF metadata ----
 * A GGUF file's {arch}.* keys say what config.json says; they are translated into the
 * config.json it stands for and parsed by the same code, so every check above holds for both.
 * general.architecture "llama" (Llama and Mistral checkpoints alike) is LlamaForCausalLM,
 * "qwen2" Qwen2ForCausalLM, "qwen3" Qwen3ForCausalLM. What changes the math and has no
 * config.json equivalent here is refused by name. */
static int gguf_int_field(const gguf_t *g, json_t *o, const char *key, const char *field, bool required) {
    bool bad = false;
    int64_t v;
    if (!gguf_get_i64(g, key, &v, &bad)) {
        if (bad) return CS_EFORMAT;
        if (required) return cs_error_set(CS_EFORMAT, "%s: missing metadata key '%s'", gguf_path(g), key);
        return CS_OK;
    }
    if (v < 0 || v > INT32_MAX) return cs_error_set(CS_EFORMAT, "%s: metadata '%s' = %lld is out of range", gguf_path(g), key, (long long)v);
    json_object_set_new(o, field, json_integer(v));
    return CS_OK;
}

static int gguf_num_field(const gguf_t *g, json_t *o, const char *key, const char *field) {
    bool bad = false;
    double v;
    if (!gguf_get_f64(g, key, &v, &bad)) return bad ? CS_EFORMAT : CS_OK;
    if (!isfinite(v)) return cs_error_set(CS_EFORMAT, "%s: metadata '%s' is not a finite number", gguf_path(g), key);
    json_object_set_new(o, field, json_real(v));
    return CS_OK;
}

int model_config_from_gguf(const gguf_t *g, model_config_t *out) {
    memset(out, 0, sizeof *out);
    const char *path = gguf_path(g);
    bool bad = false;
    const char *arch = gguf_get_str(g, "general.architecture", NULL, &bad);
    if (!arch) return bad ? CS_EFORMAT : cs_error_set(CS_EFORMAT, "%s: missing metadata key 'general.architecture'", path);
    const char *hf = !strcmp(arch, "llama") ? "LlamaForCausalLM" : !strcmp(arch, "qwen2") ? "Qwen2ForCausalLM"
                   : !strcmp(arch, "qwen3") ? "Qwen3ForCausalLM" : NULL;
    if (!hf)
        return cs_error_set(CS_EUNSUPPORTED, "%s: GGUF architecture '%s' is not supported (llama, qwen2, qwen3)", path, arch);
    json_t *o = json_object();
    if (!o) return cs_error_set(CS_ENOMEM, "out of memory");
    json_object_set_new(o, "architectures", json_pack("[s]", hf));
    char key[128];
    int rc = CS_OK;
#define K(suffix) (snprintf(key, sizeof key, "%s." suffix, arch), key)
    static const struct { const char *suffix, *field; bool required; } ints[] = {
        {"embedding_length", "hidden_size", true},           {"feed_forward_length", "intermediate_size", true},
        {"block_count", "num_hidden_layers", true},           {"attention.head_count", "num_attention_heads", true},
        {"attention.head_count_kv", "num_key_value_heads", false}, {"context_length", "max_position_embeddings", false},
    };
    for (size_t i = 0; i < CS_ARRAY_LEN(ints) && !rc; i++) {
        snprintf(key, sizeof key, "%s.%s", arch, ints[i].suffix);
        rc = gguf_int_field(g, o, key, ints[i].field, ints[i].required);
    }
    /* llama.cpp's defaults where a key is absent (not transformers' per-architecture ones:
     * Qwen2's dataclass would say 32 KV heads): as many KV heads as heads, head_dim =
     * embedding_length / head_count */
    if (!rc && !json_object_get(o, "num_key_value_heads"))
        json_object_set(o, "num_key_value_heads", json_object_get(o, "num_attention_heads"));
    if (!rc) {
        json_int_t h = json_integer_value(json_object_get(o, "hidden_size")), nh = json_integer_value(json_object_get(o, "num_attention_heads"));
        if (nh > 0 && h % nh == 0) json_object_set_new(o, "head_dim", json_integer(h / nh));
    }
    /* head_dim: attention.key_length where given (Qwen3's 128 with a hidden of 1024, ...);
     * values must have the same size, as the attention here assumes */
    int64_t kl = 0, vl = 0;
    if (!rc && gguf_get_i64(g, K("attention.key_length"), &kl, &bad)) {
        if (gguf_get_i64(g, K("attention.value_length"), &vl, &bad) && vl != kl)
            rc = cs_error_set(CS_EUNSUPPORTED, "%s: attention.key_length %lld differs from value_length %lld", path,
                              (long long)kl, (long long)vl);
        else if (kl <= 0 || kl > INT32_MAX) rc = cs_error_set(CS_EFORMAT, "%s: %s.attention.key_length is out of range", path, arch);
        else json_object_set_new(o, "head_dim", json_integer(kl));
    }
    if (!rc && bad) rc = CS_EFORMAT;
    if (!rc) rc = gguf_num_field(g, o, K("attention.layer_norm_rms_epsilon"), "rms_norm_eps");
    if (!rc) rc = gguf_num_field(g, o, K("rope.freq_base"), "rope_theta");
    if (!rc && !json_object_get(o, "rope_theta")) json_object_set_new(o, "rope_theta", json_real(10000.0));
    /* RoPE scaling: linear maps onto config.json's; the rest is refused */
    const char *rs = rc ? NULL : gguf_get_str(g, K("rope.scaling.type"), NULL, &bad);
    if (!rc && bad) rc = CS_EFORMAT;
    if (!rc && rs && strcmp(rs, "none")) {
        double f = 0;
        if (strcmp(rs, "linear"))
            rc = cs_error_set(CS_EUNSUPPORTED, "%s: RoPE scaling '%s' is not supported in GGUF files (linear is)", path, rs);
        else if (!gguf_get_f64(g, K("rope.scaling.factor"), &f, &bad) || !(f >= 1))
            rc = cs_error_set(CS_EFORMAT, "%s: linear RoPE scaling needs rope.scaling.factor >= 1", path);
        else json_object_set_new(o, "rope_scaling", json_pack("{s:s, s:f}", "rope_type", "linear", "factor", f));
    }
    /* the vocabulary: the tokenizer's tokens, which the embedding must match */
    const gguf_tensor_t *emb = gguf_find_tensor(g, "token_embd.weight");
    if (!rc && !emb) rc = cs_error_set(CS_EFORMAT, "%s: no tensor token_embd.weight", path);
    if (!rc) {
        gguf_type et;
        uint64_t nt = 0;
        const void *d;
        int64_t vocab = emb->n_dims == 2 ? emb->ne[1] : -1;
        if (gguf_get_arr(g, "tokenizer.ggml.tokens", &et, &nt, &d, &bad) && (int64_t)nt != vocab)
            rc = cs_error_set(CS_EFORMAT, "%s: %llu tokens in tokenizer.ggml.tokens but token_embd.weight has %lld rows",
                              path, (unsigned long long)nt, (long long)vocab);
        else if (bad) rc = CS_EFORMAT;
        else json_object_set_new(o, "vocab_size", json_integer(vocab));
    }
    if (!rc) {
        json_object_set_new(o, "tie_word_embeddings", json_boolean(!gguf_find_tensor(g, "output.weight")));
        /* biases: Qwen2 always has them on q/k/v; Llama's attention_bias covers q/k/v/o */
        if (!strcmp(arch, "llama"))
            json_object_set_new(o, "attention_bias", json_boolean(gguf_find_tensor(g, "blk.0.attn_q.bias") != NULL));
        if (!strcmp(arch, "qwen3"))
            json_object_set_new(o, "attention_bias", json_boolean(gguf_find_tensor(g, "blk.0.attn_q.bias") != NULL));
    }
    /* special tokens: bos, and every end-of-generation id the file names */
    uint32_t id;
    if (!rc && gguf_get_u32(g, "tokenizer.ggml.bos_token_id", &id, &bad)) json_object_set_new(o, "bos_token_id", json_integer(id));
    if (!rc) {
        json_t *eos = json_array();
        static const char *const eog[] = {"tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                          "tokenizer.ggml.eom_token_id"};
        for (size_t i = 0; i < CS_ARRAY_LEN(eog); i++) {
            if (!gguf_get_u32(g, eog[i], &id, &bad)) continue;
            bool seen = false;
            for (size_t k = 0; k < json_array_size(eos); k++) seen |= json_integer_value(json_array_get(eos, k)) == id;
            if (!seen) json_array_append_new(eos, json_integer(id));
        }
        if (json_array_size(eos)) json_object_set_new(o, "eos_token_id", eos);
        else json_decref(eos);
    }
    if (!rc && bad) rc = CS_EFORMAT;
#undef K
    if (rc) { json_decref(o); return rc; }
    char *text = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (!text) return cs_error_set(CS_ENOMEM, "out of memory");
    rc = parse_impl(path, text, out);
    free(text);
    return rc;
}
