/* peft.c: load a PEFT LoRA adapter directory against a base model config. Which modules
 * are adapted, and with which rank and alpha, is decided exactly as peft 0.21 decides it
 * (target_modules list / regex / "all-linear", exclude_modules, layers_to_transform,
 * rank_pattern and alpha_pattern keys as Python regexes, run here with PCRE2). Every
 * config option or tensor that would change the math beyond x·Aᵀ·Bᵀ·scale is refused. */
#define PCRE2_CODE_UNIT_WIDTH 8
#include "lora/peft.h"

#include <ctype.h>
#include <jansson.h>
#include <math.h>
#include <pcre2.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "base/safetensors.h"

const char *const lora_target_names[LORA_N_TARGETS] = {
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
};
static const char *const target_parent[LORA_N_TARGETS] = {
    "self_attn", "self_attn", "self_attn", "self_attn", "mlp", "mlp", "mlp",
};

void lora_target_dims(const model_config_t *cfg, lora_target t, int *d_in, int *d_out) {
    int q = cfg->n_heads * cfg->head_dim, kv = cfg->n_kv_heads * cfg->head_dim;
    switch (t) {
    case LORA_Q: *d_in = cfg->hidden_size; *d_out = q; break;
    case LORA_K: case LORA_V: *d_in = cfg->hidden_size; *d_out = kv; break;
    case LORA_O: *d_in = q; *d_out = cfg->hidden_size; break;
    case LORA_GATE: case LORA_UP: *d_in = cfg->hidden_size; *d_out = cfg->intermediate_size; break;
    case LORA_DOWN: *d_in = cfg->intermediate_size; *d_out = cfg->hidden_size; break;
    default: CS_ASSERT(!"lora_target_dims: bad target");
    }
}

/* ---- Python-style regex matching through PCRE2 ---- */

enum { RE_MATCH = 0, RE_FULLMATCH = 1 };

/* re.match / re.fullmatch(pattern, subject). Returns 1, 0, or CS_EFORMAT (bad pattern,
 * message names `what`). With `idx`, the named group "idx" is parsed into *idx (-1 if unset). */
static int py_re(const char *label, const char *what, const char *pattern, const char *subject,
                 int mode, long *idx) {
    int errcode;
    PCRE2_SIZE erroff;
    uint32_t opts = PCRE2_ANCHORED | PCRE2_UTF | PCRE2_UCP | (mode == RE_FULLMATCH ? PCRE2_ENDANCHORED : 0);
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED, opts, &errcode, &erroff, NULL);
    if (!re) {
        PCRE2_UCHAR msg[160];
        pcre2_get_error_message(errcode, msg, sizeof msg);
        return cs_error_set(CS_EFORMAT, "%s: %s: bad regex '%s': %s", label, what, pattern, (char *)msg);
    }
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(re, NULL);
    if (!md) { pcre2_code_free(re); return cs_error_set(CS_ENOMEM, "%s: out of memory", label); }
    int r = pcre2_match(re, (PCRE2_SPTR)subject, strlen(subject), 0, 0, md, NULL);
    int res = r >= 0 ? 1 : 0;
    if (r < 0 && r != PCRE2_ERROR_NOMATCH)
        res = cs_error_set(CS_EFORMAT, "%s: %s: regex '%s' failed to run (%d)", label, what, pattern, r);
    if (res == 1 && idx) {
        *idx = -1;
        int g = pcre2_substring_number_from_name(re, (PCRE2_SPTR) "idx");
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        if (g > 0 && g < r && ov[2 * g] != PCRE2_UNSET) {
            long v = 0;
            for (PCRE2_SIZE i = ov[2 * g]; i < ov[2 * g + 1] && v < 100000000; i++)
                if (isdigit((unsigned char)subject[i])) v = v * 10 + (subject[i] - '0');
            *idx = v;
        }
    }
    pcre2_match_data_free(md);
    pcre2_code_free(re);
    return res;
}

/* ---- adapter_config.json ---- */

typedef struct peft_cfg {
    const char *label;         /* "<dir>/adapter_config.json" for messages */
    json_t *root;
    json_t *targets;           /* array of strings, or NULL with target_re / all_linear */
    const char *target_re;
    bool all_linear;
    json_t *exclude;           /* array, or NULL with exclude_re */
    const char *exclude_re;
    json_t *layers;            /* layers_to_transform: integer or array, NULL if unused */
    json_t *layers_pattern;    /* string or array, NULL if empty */
    json_t *rank_pattern, *alpha_pattern; /* objects or NULL */
    int r;
    double alpha;
    bool rslora;
} peft_cfg_t;

/* None, "", [] and {} are all "not set" for peft's truthiness checks */
static bool truthy(const json_t *v) {
    if (!v || json_is_null(v) || json_is_false(v)) return false;
    if (json_is_string(v)) return json_string_length(v) > 0;
    if (json_is_array(v)) return json_array_size(v) > 0;
    if (json_is_object(v)) return json_object_size(v) > 0;
    if (json_is_integer(v)) return json_integer_value(v) != 0;
    if (json_is_real(v)) return json_real_value(v) != 0;
    return true;
}

static bool is_string_array(const json_t *v) {
    if (!json_is_array(v)) return false;
    for (size_t i = 0; i < json_array_size(v); i++)
        if (!json_is_string(json_array_get(v, i))) return false;
    return true;
}

static int parse_config(const char *label, const char *text, size_t len, peft_cfg_t *c) {
    json_error_t jerr;
    memset(c, 0, sizeof *c);
    c->label = label;
    c->root = json_loadb(text, len, 0, &jerr);   /* duplicate keys: the last wins, as in Python */
    if (!c->root) return cs_error_set(CS_EFORMAT, "%s: not valid JSON: %s (line %d)", label, jerr.text, jerr.line);
    json_t *root = c->root, *v;
    if (!json_is_object(root)) return cs_error_set(CS_EFORMAT, "%s: expected a JSON object", label);

    v = cs_json_get(root, "peft_type");
    if (!v) return cs_error_set(CS_EFORMAT, "%s: missing required field 'peft_type'", label);
    if (!json_is_string(v) || strcmp(json_string_value(v), "LORA") != 0)
        return cs_error_set(CS_EUNSUPPORTED, "%s: peft_type %s%s%s is not supported (only LORA)", label,
                            json_is_string(v) ? "'" : "", json_is_string(v) ? json_string_value(v) : cs_json_type_name(v),
                            json_is_string(v) ? "'" : "");

    /* options that change the forward math or the base model: refused by name */
    static const char *const bool_refused[][2] = {
        { "use_dora", "caraserve does not yet support DoRA (use_dora)" },
        { "use_qalora", "QA-LoRA (use_qalora) is not supported" },
        { "lora_bias", "a bias on lora_B (lora_bias) is not supported" },
        { "fan_in_fan_out", "fan_in_fan_out is not supported" },
    };
    for (size_t i = 0; i < CS_ARRAY_LEN(bool_refused); i++)
        if (truthy(cs_json_get(root, bool_refused[i][0])))
            return cs_error_set(CS_EUNSUPPORTED, "%s: %s", label, bool_refused[i][1]);
    static const char *const set_refused[][2] = {
        { "alora_invocation_tokens", "activated LoRA (alora_invocation_tokens)" },
        { "velora_config", "the VeLoRA variant (velora_config)" },
        { "monteclora_config", "the MonteCLoRA variant (monteclora_config)" },
        { "use_bdlora", "block-diagonal LoRA (use_bdlora)" },
        { "arrow_config", "Arrow routing (arrow_config)" },
        { "kasa_config", "the KaSA variant (kasa_config)" },
        { "layer_replication", "layer_replication" },
    };
    for (size_t i = 0; i < CS_ARRAY_LEN(set_refused); i++)
        if (cs_json_get(root, set_refused[i][0]))
            return cs_error_set(CS_EUNSUPPORTED, "%s: %s is not supported", label, set_refused[i][1]);
    static const char *const nonempty_refused[][2] = {
        { "trainable_token_indices", "trainable_token_indices (trained embedding rows)" },
        { "target_parameters", "target_parameters (LoRA on raw parameters)" },
    };
    if (truthy(cs_json_get(root, "modules_to_save"))) /* vLLM's words */
        return cs_error_set(CS_EUNSUPPORTED, "%s: caraserve only supports modules_to_save being None (fully trained "
                            "extra modules are not LoRA)", label);
    for (size_t i = 0; i < CS_ARRAY_LEN(nonempty_refused); i++)
        if (truthy(cs_json_get(root, nonempty_refused[i][0])))
            return cs_error_set(CS_EUNSUPPORTED, "%s: %s is not supported", label, nonempty_refused[i][1]);
    v = cs_json_get(root, "bias");
    if (v && (!json_is_string(v) || strcmp(json_string_value(v), "none") != 0))
        return cs_error_set(CS_EUNSUPPORTED, "%s: Adapter bias cannot be used: bias %s%s%s (only \"none\" is supported)", label,
                            json_is_string(v) ? "'" : "", json_is_string(v) ? json_string_value(v) : cs_json_type_name(v),
                            json_is_string(v) ? "'" : "");
    /* inits that leave the adapter tied to a modified base model (unless converted on save,
     * which rewrites init_lora_weights to true) */
    v = cs_json_get(root, "init_lora_weights");
    if (json_is_string(v)) {
        const char *s = json_string_value(v);
        if (!strncmp(s, "pissa", 5) || !strcmp(s, "olora") || !strcmp(s, "corda") || !strcmp(s, "loftq") ||
            !strcmp(s, "lora_ga"))
            return cs_error_set(CS_EUNSUPPORTED,
                                "%s: init_lora_weights '%s' needs the modified base model it was trained "
                                "against (save with path_initial_model_for_weight_conversion)", label, s);
        if (!strcmp(s, "mica"))
            return cs_error_set(CS_EUNSUPPORTED, "%s: the MiCA variant (init_lora_weights 'mica') is not supported", label);
    }

    v = cs_json_get(root, "r");
    if (!v) c->r = 8;
    else if (json_is_integer(v) && json_integer_value(v) > 0 && json_integer_value(v) <= 65536) c->r = (int)json_integer_value(v);
    else return cs_error_set(CS_EFORMAT, "%s: field 'r' must be a positive integer", label);
    v = cs_json_get(root, "lora_alpha");
    if (!v) c->alpha = 8;
    else if (json_is_number(v) && isfinite(json_number_value(v))) c->alpha = json_number_value(v);
    else return cs_error_set(CS_EFORMAT, "%s: field 'lora_alpha' must be a number, got %s", label, cs_json_type_name(v));
    v = cs_json_get(root, "use_rslora");
    if (v && !json_is_boolean(v)) return cs_error_set(CS_EFORMAT, "%s: field 'use_rslora' must be a boolean", label);
    c->rslora = json_is_true(v);

    v = cs_json_get(root, "target_modules");
    if (!v) {
        /* peft's default for llama, mistral, qwen2, qwen3 */
        json_t *d = json_pack("[ss]", "q_proj", "v_proj");
        if (!d || json_object_set_new(root, "target_modules", d)) return cs_error_set(CS_ENOMEM, "out of memory");
        c->targets = d;
    } else if (json_is_string(v)) {
        if (strcasecmp(json_string_value(v), "all-linear") == 0) c->all_linear = true;
        else c->target_re = json_string_value(v);
    } else if (is_string_array(v)) {
        c->targets = v;
    } else {
        return cs_error_set(CS_EFORMAT, "%s: field 'target_modules' must be a string or a list of strings", label);
    }

    v = cs_json_get(root, "exclude_modules");
    if (v && json_is_string(v)) { if (json_string_length(v)) c->exclude_re = json_string_value(v); }
    else if (v && is_string_array(v)) { if (json_array_size(v)) c->exclude = v; }
    else if (v) return cs_error_set(CS_EFORMAT, "%s: field 'exclude_modules' must be a string or a list of strings", label);

    json_t *ltt = cs_json_get(root, "layers_to_transform"), *lp = cs_json_get(root, "layers_pattern");
    if ((c->target_re || c->all_linear) && (ltt || lp))
        return cs_error_set(CS_EFORMAT, "%s: layers_to_transform / layers_pattern cannot be used when target_modules is a string", label);
    if (truthy(lp) && !ltt)
        return cs_error_set(CS_EFORMAT, "%s: layers_pattern needs layers_to_transform", label);
    if (ltt) {
        bool ok = json_is_integer(ltt);
        if (json_is_array(ltt)) {
            ok = true;
            for (size_t i = 0; i < json_array_size(ltt); i++) ok &= json_is_integer(json_array_get(ltt, i));
        }
        if (!ok) return cs_error_set(CS_EFORMAT, "%s: field 'layers_to_transform' must be an integer or a list of integers", label);
        if (!json_is_array(ltt) || json_array_size(ltt) > 0) c->layers = ltt;
    }
    if (truthy(lp)) {
        if (!json_is_string(lp) && !is_string_array(lp))
            return cs_error_set(CS_EFORMAT, "%s: field 'layers_pattern' must be a string or a list of strings", label);
        c->layers_pattern = lp;
    }

    static const char *const pats[] = { "rank_pattern", "alpha_pattern" };
    for (int p = 0; p < 2; p++) {
        v = cs_json_get(root, pats[p]);
        if (v && !json_is_object(v))
            return cs_error_set(CS_EFORMAT, "%s: field '%s' must be an object", label, pats[p]);
        const char *k;
        json_t *pv;
        json_object_foreach(v, k, pv) {
            bool ok = p == 0 ? (json_is_integer(pv) && json_integer_value(pv) > 0 && json_integer_value(pv) <= 65536)
                             : (json_is_number(pv) && isfinite(json_number_value(pv)));
            if (!ok)
                return cs_error_set(CS_EFORMAT, "%s: %s['%s'] must be a %s", label, pats[p], k,
                                    p == 0 ? "positive integer" : "number");
        }
        if (p == 0) c->rank_pattern = v;
        else c->alpha_pattern = v;
    }
    return CS_OK;
}

static bool ends_with_dot(const char *key, const char *suffix) {
    size_t a = strlen(key), b = strlen(suffix);
    return a > b && key[a - b - 1] == '.' && strcmp(key + a - b, suffix) == 0;
}

static bool list_match(const json_t *list, const char *key) {
    for (size_t i = 0; i < json_array_size(list); i++) {
        const char *s = json_string_value(json_array_get(list, i));
        if (strcmp(key, s) == 0 || ends_with_dot(key, s)) return true;
    }
    return false;
}

/* peft's check_target_module_exists for one module name: 1 targeted, 0 not, <0 error. */
static int target_matches(const peft_cfg_t *c, const char *key, bool is_linear_proj) {
    int r;
    if (c->exclude_re) {
        if ((r = py_re(c->label, "exclude_modules", c->exclude_re, key, RE_FULLMATCH, NULL)) != 0)
            return r < 0 ? r : 0;
    } else if (c->exclude && list_match(c->exclude, key)) {
        return 0;
    }
    if (c->target_re) return py_re(c->label, "target_modules", c->target_re, key, RE_FULLMATCH, NULL);
    bool found = c->all_linear ? is_linear_proj : list_match(c->targets, key);
    if (!found || !c->layers) return found;

    long idx = -1;
    if (!c->layers_pattern) {
        if ((r = py_re(c->label, "layers_to_transform", ".*?\\.[^.]*\\.(?P<idx>\\d+)\\.", key, RE_MATCH, &idx)) < 0)
            return r;
    } else {
        size_t n = json_is_array(c->layers_pattern) ? json_array_size(c->layers_pattern) : 1;
        for (size_t i = 0; i < n; i++) {
            const char *p = json_is_array(c->layers_pattern) ? json_string_value(json_array_get(c->layers_pattern, i))
                                                             : json_string_value(c->layers_pattern);
            size_t len = strlen(p) + 64;
            char *re = malloc(len);
            if (!re) return cs_error_set(CS_ENOMEM, "out of memory");
            snprintf(re, len, "(?:^|.*?\\.)%s\\.(?P<idx>\\d+)\\.", p);
            r = py_re(c->label, "layers_pattern", re, key, RE_MATCH, &idx);
            free(re);
            if (r < 0) return r;
            if (r == 1) break;
        }
    }
    if (idx < 0) return 0;
    if (json_is_integer(c->layers)) return json_integer_value(c->layers) == idx;
    for (size_t i = 0; i < json_array_size(c->layers); i++)
        if (json_integer_value(json_array_get(c->layers, i)) == idx) return 1;
    return 0;
}

/* peft's get_pattern_key: the first key K (in file order) with re.match(r"(.*\.)?(K)$", key) */
static int pattern_lookup(const peft_cfg_t *c, const json_t *pattern, const char *what, const char *key,
                          json_t **out) {
    const char *k;
    json_t *v;
    *out = NULL;
    json_object_foreach((json_t *)pattern, k, v) {
        size_t len = strlen(k) + 16;
        char *re = malloc(len);
        if (!re) return cs_error_set(CS_ENOMEM, "out of memory");
        snprintf(re, len, "(.*\\.)?(%s)$", k);
        int r = py_re(c->label, what, re, key, RE_MATCH, NULL);
        free(re);
        if (r < 0) return r;
        if (r == 1) { *out = v; return CS_OK; }
    }
    return CS_OK;
}

/* ---- tensors ---- */

#define PREFIX "base_model.model."

static void shape_str(char *buf, size_t cap, const st_tensor_t *t) {
    size_t k = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < t->n_dims && k < cap; i++)
        k += (size_t)snprintf(buf + k, cap - k, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
    if (k < cap) snprintf(buf + k, cap - k, "]");
}

/* Parse "base_model.model.model.layers.N.<parent>.<proj>.lora_<A|B>.weight". */
static bool parse_tensor_name(const char *name, int *layer, int *target, int *ab) {
    const char *p = PREFIX "model.layers.";
    size_t pl = strlen(p);
    if (strncmp(name, p, pl) != 0) return false;
    const char *s = name + pl;
    if (!isdigit((unsigned char)*s) || (s[0] == '0' && isdigit((unsigned char)s[1]))) return false;
    long l = 0;
    while (isdigit((unsigned char)*s) && l < 1000000) l = l * 10 + (*s++ - '0');
    if (*s++ != '.') return false;
    for (int t = 0; t < LORA_N_TARGETS; t++) {
        char mod[64];
        snprintf(mod, sizeof mod, "%s.%s.", target_parent[t], lora_target_names[t]);
        size_t ml = strlen(mod);
        if (strncmp(s, mod, ml) != 0) continue;
        const char *r = s + ml;
        if (strcmp(r, "lora_A.weight") == 0) *ab = 0;
        else if (strcmp(r, "lora_B.weight") == 0) *ab = 1;
        else return false;
        *layer = (int)l;
        *target = t;
        return true;
    }
    return false;
}

static int convert(const char *dir, const st_tensor_t *t, float *dst, size_t n) {
    size_t es = cs_dtype_size(t->dtype);
    if ((uintptr_t)t->data % es == 0) {
        cs_to_f32(dst, t->data, t->dtype, n);
        return CS_OK;
    }
    void *tmp = malloc(t->nbytes ? t->nbytes : 1);   /* unaligned in the file: copy first */
    if (!tmp) return cs_error_set(CS_ENOMEM, "%s: out of memory", dir);
    memcpy(tmp, t->data, t->nbytes);
    cs_to_f32(dst, tmp, t->dtype, n);
    free(tmp);
    return CS_OK;
}

static int check_tensor(const char *dir, const safetensors_t *st, const char *name, int64_t rows,
                        int64_t cols, const char *why, const st_tensor_t **out) {
    const st_tensor_t *t = safetensors_find(st, name);
    *out = NULL;
    if (!t) return cs_error_set(CS_ENOTFOUND, "%s: missing tensor '%s'", dir, name);
    if (t->dtype != CS_DTYPE_F32 && t->dtype != CS_DTYPE_F16 && t->dtype != CS_DTYPE_BF16)
        return cs_error_set(CS_EUNSUPPORTED, "%s: tensor '%s': dtype %s is not supported (F32, F16, BF16)",
                            dir, name, cs_dtype_name(t->dtype));
    if (t->n_dims != 2 || t->shape[0] != rows || t->shape[1] != cols) {
        char got[160];
        shape_str(got, sizeof got, t);
        return cs_error_set(CS_ESHAPE, "%s: tensor '%s': expected [%lld, %lld], got %s (%s)", dir, name,
                            (long long)rows, (long long)cols, got, why);
    }
    *out = t;
    return CS_OK;
}

static char *base_name(const char *dir) {
    size_t n = strlen(dir);
    while (n > 1 && dir[n - 1] == '/') n--;
    size_t b = n;
    while (b > 0 && dir[b - 1] != '/') b--;
    if (n == b) return strdup(dir);
    return strndup(dir + b, n - b);
}

/* Decide every module of the model from adapter_config.json (TEXT, LEN bytes), the way peft
 * walks named_modules(): a new adapter with rank, scale and shape set per module, no weights
 * yet, and nbytes = the F32 A/B/Bᵀ bytes the weights would take (a bound: BF16 takes half). */
static int plan(const char *name, const char *dir, const char *text, size_t len, const model_config_t *cfg,
                lora_adapter_t **out) {
    int rc = CS_OK;
    char *cfg_path = NULL;
    peft_cfg_t pc = { 0 };
    lora_adapter_t *a = NULL;
    *out = NULL;

    if (!(cfg_path = cs_path_join(dir, "adapter_config.json"))) { rc = cs_error_set(CS_ENOMEM, "out of memory"); goto err; }
    if ((rc = parse_config(cfg_path, text, len, &pc)) != CS_OK) goto err;

    if (!(a = calloc(1, sizeof *a)) || !(a->name = name ? strdup(name) : base_name(dir)) || !(a->path = strdup(dir)) ||
        !(a->mods = calloc((size_t)cfg->n_layers * LORA_N_TARGETS, sizeof *a->mods))) {
        rc = cs_error_set(CS_ENOMEM, "%s: out of memory", dir);
        goto err;
    }
    a->n_layers = cfg->n_layers;

    /* projections get rank/alpha, anything else that matches is refused */
    static const char *const other_global[] = { "model", "model.embed_tokens", "model.layers", "model.norm",
                                                "model.rotary_emb", "lm_head" };
    static const char *const other_layer[] = { "", ".self_attn", ".mlp", ".mlp.act_fn", ".input_layernorm",
                                               ".post_attention_layernorm", ".self_attn.q_norm", ".self_attn.k_norm" };
    char key[256];
    for (size_t i = 0; i < CS_ARRAY_LEN(other_global); i++) {
        int m = target_matches(&pc, other_global[i], false);
        if (m < 0) { rc = m; goto err; }
        if (m && (!strcmp(other_global[i], "lm_head") || !strcmp(other_global[i], "model.embed_tokens"))) {
            rc = cs_error_set(CS_EUNSUPPORTED, "%s: LoRA on %s is not supported (target_modules matches it)",
                              cfg_path, other_global[i]);
            goto err;
        }
        if (m) {
            rc = cs_error_set(CS_EUNSUPPORTED, "%s: target_modules matches '%s', which is not a linear projection",
                              cfg_path, other_global[i]);
            goto err;
        }
    }
    int n_targeted = 0;
    for (int l = 0; l < cfg->n_layers; l++) {
        for (size_t i = 0; i < CS_ARRAY_LEN(other_layer); i++) {
            if (i >= 6 && !cfg->qk_norm) break;
            snprintf(key, sizeof key, "model.layers.%d%s", l, other_layer[i]);
            int m = target_matches(&pc, key, false);
            if (m < 0) { rc = m; goto err; }
            if (m) {
                rc = cs_error_set(CS_EUNSUPPORTED, "%s: target_modules matches '%s', which is not a linear projection",
                                  cfg_path, key);
                goto err;
            }
        }
        for (int t = 0; t < LORA_N_TARGETS; t++) {
            snprintf(key, sizeof key, "model.layers.%d.%s.%s", l, target_parent[t], lora_target_names[t]);
            int m = target_matches(&pc, key, true);
            if (m < 0) { rc = m; goto err; }
            lora_module_t *mod = lora_adapter_module(a, l, (lora_target)t);
            lora_target_dims(cfg, (lora_target)t, &mod->d_in, &mod->d_out);
            if (!m) continue;
            json_t *rv = NULL, *av = NULL;
            if ((pc.rank_pattern && (rc = pattern_lookup(&pc, pc.rank_pattern, "rank_pattern", key, &rv))) ||
                (pc.alpha_pattern && (rc = pattern_lookup(&pc, pc.alpha_pattern, "alpha_pattern", key, &av))))
                goto err;
            mod->rank = rv ? (int)json_integer_value(rv) : pc.r;
            double alpha = av ? json_number_value(av) : pc.alpha;
            mod->scale = (float)(pc.rslora ? alpha / sqrt((double)mod->rank) : alpha / mod->rank);
            a->nbytes += ((size_t)mod->rank * mod->d_in + 2 * (size_t)mod->d_out * mod->rank) * sizeof(float);
            a->max_rank = CS_MAX(a->max_rank, mod->rank);
            n_targeted++;
        }
    }
    if (n_targeted == 0) {
        rc = cs_error_set(CS_EFORMAT, "%s: target_modules matches no projection of the %d-layer model", cfg_path,
                          cfg->n_layers);
        goto err;
    }
    json_decref(pc.root);
    free(cfg_path);
    *out = a;
    return CS_OK;
err:
    json_decref(pc.root);
    free(cfg_path);
    lora_adapter_free(a);
    return rc;
}

/* the names of layer L's target T tensors */
static void tensor_names(int l, int t, char *na, char *nb, size_t cap) {
    snprintf(na, cap, PREFIX "model.layers.%d.%s.%s.lora_A.weight", l, target_parent[t], lora_target_names[t]);
    snprintf(nb, cap, PREFIX "model.layers.%d.%s.%s.lora_B.weight", l, target_parent[t], lora_target_names[t]);
}

/* T's N elements into DST as BF16: copied when T is BF16, else rounded to nearest even */
static int to_bf16(const char *dir, const st_tensor_t *t, uint16_t *dst, size_t n) {
    if (t->dtype == CS_DTYPE_BF16) {
        memcpy(dst, t->data, n * sizeof(uint16_t)); /* memcpy: the file's data may be unaligned */
        return CS_OK;
    }
    float *tmp = malloc(sizeof(float) * (n ? n : 1));
    if (!tmp) return cs_error_set(CS_ENOMEM, "%s: out of memory", dir);
    int rc = convert(dir, t, tmp, n);
    for (size_t i = 0; i < n && rc == CS_OK; i++) dst[i] = cs_f32_to_bf16(tmp[i]);
    free(tmp);
    return rc;
}

/* MOD's A, B and Bᵀ from tensors TA and TB (checked; MOD's memory allocated) */
static int copy_module(const char *dir, lora_module_t *mod, const st_tensor_t *ta, const st_tensor_t *tb) {
    int rc;
    size_t n_a = (size_t)mod->rank * mod->d_in, n_b = (size_t)mod->d_out * mod->rank;
    if (mod->dtype == CS_DTYPE_BF16) {
        if ((rc = to_bf16(dir, ta, mod->a, n_a)) || (rc = to_bf16(dir, tb, mod->b, n_b))) return rc;
        uint16_t *b16 = mod->b, *bt16 = mod->bt;
        for (int o = 0; o < mod->d_out; o++)
            for (int r = 0; r < mod->rank; r++) bt16[(size_t)r * mod->d_out + o] = b16[(size_t)o * mod->rank + r];
    } else {
        if ((rc = convert(dir, ta, mod->a, n_a)) || (rc = convert(dir, tb, mod->b, n_b))) return rc;
        float *b32 = mod->b, *bt32 = mod->bt;
        for (int o = 0; o < mod->d_out; o++)
            for (int r = 0; r < mod->rank; r++) bt32[(size_t)r * mod->d_out + o] = b32[(size_t)o * mod->rank + r];
    }
    return CS_OK;
}

/* 64-byte aligned, not zeroed: copy_module writes every byte (zeroing hundreds of MB first
 * cost as much as reading them from disk) */
static void *alloc_raw(size_t n) { return aligned_alloc(64, n ? (n + 63) / 64 * 64 : 64); }

static int alloc_module(const char *dir, lora_module_t *mod) {
    size_t n_a = (size_t)mod->rank * mod->d_in, n_b = (size_t)mod->d_out * mod->rank, es = cs_dtype_size(mod->dtype);
    if (!(mod->a = alloc_raw(n_a * es)) || !(mod->b = alloc_raw(n_b * es)) || !(mod->bt = alloc_raw(n_b * es)))
        return cs_error_set(CS_ENOMEM, "%s: out of memory", dir);
    return CS_OK;
}

/* Check every tensor of ST against the plan in A and set each module's dtype (BF16 kept,
 * the rest F32) and a->nbytes, the bytes the weights take; with COPY, copy them too (else
 * only the header of ST is read: lora_adapter_probe, lora_adapter_begin). */
static int fill(const char *dir, const safetensors_t *st, const model_config_t *cfg, lora_adapter_t *a, bool copy) {
    int rc;
    a->nbytes = 0;
    /* every tensor must be one we expect */
    for (size_t i = 0; i < safetensors_count(st); i++) {
        const char *name = safetensors_at(st, i)->name;
        int l, t, ab;
        if (strstr(name, "lora_magnitude_vector"))
            return cs_error_set(CS_EUNSUPPORTED, "%s: tensor '%s': caraserve does not yet support DoRA (magnitude vectors)", dir, name);
        if (strstr(name, "lora_embedding_A") || strstr(name, "lora_embedding_B"))
            return cs_error_set(CS_EUNSUPPORTED, "%s: tensor '%s': LoRA on embeddings is not supported", dir, name);
        if (strstr(name, ".lora_B.bias"))
            return cs_error_set(CS_EUNSUPPORTED, "%s: tensor '%s': a bias on lora_B (lora_bias) is not supported", dir, name);
        if (!parse_tensor_name(name, &l, &t, &ab))
            return cs_error_set(CS_EUNSUPPORTED, "%s: unexpected tensor '%s' (only lora_A/lora_B of the q/k/v/o/gate/up/down "
                                "projections are supported)", dir, name);
        if (l >= cfg->n_layers || lora_adapter_module(a, l, (lora_target)t)->rank == 0)
            return cs_error_set(CS_EFORMAT, "%s: unexpected tensor '%s': %s", dir, name,
                                l >= cfg->n_layers ? "the base model has fewer layers"
                                                   : "adapter_config.json does not target this module");
    }

    for (int l = 0; l < cfg->n_layers; l++) {
        for (int t = 0; t < LORA_N_TARGETS; t++) {
            lora_module_t *mod = lora_adapter_module(a, l, (lora_target)t);
            if (mod->rank == 0) continue;
            char na[256], nb[256], why[200];
            tensor_names(l, t, na, nb, sizeof na);
            snprintf(why, sizeof why, "rank %d from adapter_config.json, %s %d -> %d", mod->rank, lora_target_names[t],
                     mod->d_in, mod->d_out);
            const st_tensor_t *ta, *tb;
            if ((rc = check_tensor(dir, st, na, mod->rank, mod->d_in, why, &ta)) ||
                (rc = check_tensor(dir, st, nb, mod->d_out, mod->rank, why, &tb)))
                return rc;
            size_t n_a = (size_t)mod->rank * mod->d_in, n_b = (size_t)mod->d_out * mod->rank;
            /* BF16 stays BF16 (half the bytes to stream per token); F16 and mixed become F32,
             * or BF16 when the adapter is held in BF16 */
            mod->dtype = a->hold_bf16 || (ta->dtype == CS_DTYPE_BF16 && tb->dtype == CS_DTYPE_BF16) ? CS_DTYPE_BF16
                                                                                                    : CS_DTYPE_F32;
            size_t es = cs_dtype_size(mod->dtype);
            a->nbytes += (n_a + 2 * n_b) * es;
            if (!copy) continue;
            if ((rc = alloc_module(dir, mod)) || (rc = copy_module(dir, mod, ta, tb))) return rc;
        }
    }
    if (copy) a->host_layers = (uint32_t)a->n_layers;
    return CS_OK;
}

/* plan and fill: the adapter of name's config and tensors, holding BF16 copies if bf16, its
 * weights copied in if copy; on an error nothing is left allocated */
static int plan_fill(const char *name, const char *dir, const char *config_json, size_t config_len,
                     const safetensors_t *st, const model_config_t *cfg, bool bf16, bool copy, lora_adapter_t **out) {
    lora_adapter_t *a;
    int rc;
    if ((rc = plan(name, dir, config_json, config_len, cfg, &a)) != CS_OK) return rc;
    a->hold_bf16 = bf16;
    if ((rc = fill(dir, st, cfg, a, copy)) != CS_OK) {
        lora_adapter_free(a);
        return rc;
    }
    *out = a;
    return CS_OK;
}

int lora_adapter_begin(const char *name, const char *dir, const char *config_json, size_t config_len,
                       const safetensors_t *st, const model_config_t *cfg, bool bf16, lora_adapter_t **out) {
    lora_adapter_t *a;
    int rc;
    *out = NULL;
    if ((rc = plan_fill(name, dir, config_json, config_len, st, cfg, bf16, false, &a)) != CS_OK) return rc;
    /* every module's memory now (a slot made before its layers came keeps these pointers),
     * not zeroed: its pages are touched only as the layers are copied in */
    for (int i = 0; i < a->n_layers * LORA_N_TARGETS; i++)
        if (a->mods[i].rank > 0 && (rc = alloc_module(dir, &a->mods[i])) != CS_OK) goto err;
    a->host_layers = 0;
    *out = a;
    return CS_OK;
err:
    lora_adapter_free(a);
    return rc;
}

void lora_adapter_layer_span(const lora_adapter_t *a, const safetensors_t *st, const void *base, int l,
                             size_t *begin, size_t *end) {
    size_t b = SIZE_MAX, e = 0;
    for (int t = 0; t < LORA_N_TARGETS; t++) {
        if (lora_adapter_module(a, l, (lora_target)t)->rank == 0) continue;
        char na[256], nb[256];
        tensor_names(l, t, na, nb, sizeof na);
        const st_tensor_t *ts[2] = {safetensors_find(st, na), safetensors_find(st, nb)};
        for (int k = 0; k < 2; k++) {
            if (!ts[k]) continue; /* lora_adapter_begin checked them all */
            size_t off = (size_t)((const char *)ts[k]->data - (const char *)base);
            b = CS_MIN(b, off);
            e = CS_MAX(e, off + ts[k]->nbytes);
        }
    }
    *begin = b == SIZE_MAX ? 0 : b;
    *end = e;
}

int lora_adapter_fill_layers(lora_adapter_t *a, const safetensors_t *st, int l0, int l1) {
    CS_ASSERT(l0 == (int)a->host_layers && l1 <= a->n_layers);
    for (int l = l0; l < l1; l++) {
        for (int t = 0; t < LORA_N_TARGETS; t++) {
            lora_module_t *mod = lora_adapter_module(a, l, (lora_target)t);
            if (mod->rank == 0) continue;
            char na[256], nb[256];
            tensor_names(l, t, na, nb, sizeof na);
            const st_tensor_t *ta = safetensors_find(st, na), *tb = safetensors_find(st, nb);
            CS_ASSERT(ta && tb); /* lora_adapter_begin checked them against the same header */
            int rc = copy_module(a->path, mod, ta, tb);
            if (rc) return rc;
        }
        cs_flag_store(&a->host_layers, (uint32_t)(l + 1)); /* release: the layer's weights before */
    }
    return CS_OK;
}

void lora_adapter_host_fail(lora_adapter_t *a) { cs_flag_store(&a->host_layers, LORA_HOST_FAILED); }

int lora_adapter_load(const char *dir, const model_config_t *cfg, lora_adapter_t **out) {
    return lora_adapter_load_as(dir, cfg, false, out);
}

int lora_adapter_load_as(const char *dir, const model_config_t *cfg, bool bf16, lora_adapter_t **out) {
    int rc = CS_OK;
    char *cfg_path = NULL, *text = NULL;
    size_t len = 0;
    safetensors_t *st = NULL;
    lora_adapter_t *a = NULL;
    *out = NULL;

    if (!(cfg_path = cs_path_join(dir, "adapter_config.json"))) { rc = cs_error_set(CS_ENOMEM, "out of memory"); goto err; }
    if (!cs_file_exists(cfg_path)) { rc = cs_error_set(CS_ENOTFOUND, "%s: no adapter_config.json", dir); goto err; }
    if (!(text = cs_read_file(cfg_path, &len))) { rc = CS_EIO; goto err; }
    if ((rc = plan(NULL, dir, text, len, cfg, &a)) != CS_OK) goto err;
    a->hold_bf16 = bf16;

    char *st1 = cs_path_join(dir, "adapter_model.safetensors"), *st2 = cs_path_join(dir, "adapter_model.safetensors.index.json"),
         *bin = cs_path_join(dir, "adapter_model.bin");
    bool only_bin = st1 && st2 && bin && !cs_file_exists(st1) && !cs_file_exists(st2) && cs_file_exists(bin);
    free(st1);
    free(st2);
    free(bin);
    if (only_bin) {
        rc = cs_error_set(CS_EUNSUPPORTED, "%s: only adapter_model.bin (pickle) found; convert it to adapter_model.safetensors", dir);
        goto err;
    }
    if ((rc = safetensors_open_dir(dir, "adapter_model", &st)) != CS_OK) goto err;
    if ((rc = fill(dir, st, cfg, a, true)) != CS_OK) goto err;
    safetensors_free(st);
    free(text);
    free(cfg_path);
    *out = a;
    return CS_OK;
err:
    safetensors_free(st);
    free(text);
    free(cfg_path);
    lora_adapter_free(a);
    return rc;
}

int lora_adapter_load_buffers(const char *name, const char *dir, const char *config_json, size_t config_len,
                              const safetensors_t *st, const model_config_t *cfg, bool bf16, lora_adapter_t **out) {
    *out = NULL;
    return plan_fill(name, dir, config_json, config_len, st, cfg, bf16, true, out);
}

static void info_of(const lora_adapter_t *a, lora_adapter_info_t *info) {
    *info = (lora_adapter_info_t){.n_layers = a->n_layers, .max_rank = a->max_rank, .nbytes = a->nbytes};
    bool all_bf16 = true;
    for (int l = 0; l < a->n_layers; l++)
        for (int t = 0; t < LORA_N_TARGETS; t++) {
            const lora_module_t *m = lora_adapter_module(a, l, (lora_target)t);
            if (!m->rank) continue;
            info->targets |= 1u << t;
            info->n_modules++;
            info->rank_sum += m->rank;
            info->min_rank = info->min_rank ? CS_MIN(info->min_rank, m->rank) : m->rank;
            all_bf16 = all_bf16 && m->dtype == CS_DTYPE_BF16;
        }
    info->dtype = all_bf16 ? CS_DTYPE_BF16 : CS_DTYPE_F32;
}

int lora_adapter_probe(const char *dir, const model_config_t *cfg, bool bf16, lora_adapter_info_t *info) {
    int rc;
    char *cfg_path = NULL, *text = NULL;
    size_t len = 0;
    safetensors_t *st = NULL;
    lora_adapter_t *a = NULL;
    *info = (lora_adapter_info_t){0};
    if (!(cfg_path = cs_path_join(dir, "adapter_config.json"))) return cs_error_set(CS_ENOMEM, "out of memory");
    if (!cs_file_exists(cfg_path)) rc = cs_error_set(CS_ENOTFOUND, "%s: no adapter_config.json", dir);
    else if (!(text = cs_read_file(cfg_path, &len))) rc = CS_EIO;
    else if ((rc = plan(NULL, dir, text, len, cfg, &a)) == CS_OK) {
        a->hold_bf16 = bf16;
        if ((rc = safetensors_open_dir(dir, "adapter_model", &st)) == CS_OK && (rc = fill(dir, st, cfg, a, false)) == CS_OK)
            info_of(a, info);
    }
    safetensors_free(st);
    lora_adapter_free(a);
    free(text);
    free(cfg_path);
    return rc;
}

void lora_adapter_info(const lora_adapter_t *a, lora_adapter_info_t *info) { info_of(a, info); }

int lora_adapter_config_nbytes(const char *dir, const char *config_json, size_t config_len,
                               const model_config_t *cfg, size_t *nbytes) {
    lora_adapter_t *a;
    int rc = plan(NULL, dir, config_json, config_len, cfg, &a);
    *nbytes = rc == CS_OK ? a->nbytes : 0;
    lora_adapter_free(a);
    return rc;
}

/* one slot per backend the adapter ran on */
struct lora_slot {
    backend_t *be;
    backend_adapter_t *slot;
    struct lora_slot *next;
};

static pthread_mutex_t slot_mu = PTHREAD_MUTEX_INITIALIZER;

static int upload(const lora_adapter_t *a, backend_t *be, int group, void (*on_group)(void *), void *user,
                  backend_adapter_t **out) {
    int nm = a->n_layers * LORA_N_TARGETS;
    backend_lora_module_desc_t *md = calloc((size_t)(nm ? nm : 1), sizeof *md);
    if (!md) return cs_error_set(CS_ENOMEM, "out of memory");
    for (int i = 0; i < nm; i++) {
        const lora_module_t *m = &a->mods[i];
        md[i] = (backend_lora_module_desc_t){m->rank, m->d_in, m->d_out, m->scale, m->dtype, m->a, m->b, m->bt};
    }
    backend_adapter_desc_t d = {a->n_layers, md, true, false, 0};
    uint32_t host = cs_flag_load(&a->host_layers);
    if (group > 0 && host < (uint32_t)a->n_layers) { /* still streaming in from disk: fed as it comes */
        d.host_partial = true;
        d.host_ready = (int)host;
    }
    int rc = group > 0 ? backend_adapter_stream(be, &d, group, on_group, user, out) : backend_adapter_upload(be, &d, out);
    free(md);
    return rc;
}

int lora_adapter_upload(const lora_adapter_t *a, backend_t *be, backend_adapter_t **out) {
    return upload(a, be, 0, NULL, NULL, out);
}

int lora_adapter_stream(const lora_adapter_t *a, backend_t *be, int group, void (*on_group)(void *), void *user,
                        backend_adapter_t **out) {
    return upload(a, be, group > 0 ? group : 1, on_group, user, out);
}

int lora_adapter_slot(lora_adapter_t *a, backend_t *be, backend_adapter_t **out) {
    pthread_mutex_lock(&slot_mu);
    for (struct lora_slot *s = a->slots; s; s = s->next) {
        if (s->be == be) {
            *out = s->slot;
            pthread_mutex_unlock(&slot_mu);
            return CS_OK;
        }
    }
    int rc;
    struct lora_slot *s = calloc(1, sizeof *s);
    if (!s) rc = cs_error_set(CS_ENOMEM, "out of memory");
    else if ((rc = lora_adapter_upload(a, be, &s->slot)) == CS_OK) {
        s->be = be;
        s->next = a->slots;
        a->slots = s;
        *out = s->slot;
        s = NULL;
    }
    pthread_mutex_unlock(&slot_mu);
    free(s);
    return rc;
}

void lora_adapter_free(lora_adapter_t *a) {
    if (!a) return;
    for (struct lora_slot *s = a->slots, *nx; s; s = nx) {
        nx = s->next;
        backend_adapter_free(s->be, s->slot);
        free(s);
    }
    if (a->mods) {
        for (int i = 0; i < a->n_layers * LORA_N_TARGETS; i++) {
            free(a->mods[i].a);
            free(a->mods[i].b);
            free(a->mods[i].bt);
        }
    }
    free(a->mods);
    free(a->name);
    free(a->path);
    free(a);
}
