/* test_model_config.c: config.json parsing for each architecture, transformers 5.23's
 * per-architecture defaults, both RoPE layouts (rope_parameters and legacy rope_scaling),
 * and refusals that must name what they refuse (architecture, rope type, activation,
 * mixed sliding window, missing or mistyped fields). */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/model_config.h"
#include "testutil.h"

/* What transformers 5.23 save_pretrained writes for a tiny Llama with llama3 rope scaling. */
static const char *llama3_hf =
    "{\n"
    "  \"architectures\": [\"LlamaForCausalLM\"],\n"
    "  \"attention_bias\": false, \"attention_dropout\": 0.0, \"bos_token_id\": 128000,\n"
    "  \"dtype\": \"bfloat16\", \"eos_token_id\": [128001, 128008, 128009], \"head_dim\": 16,\n"
    "  \"hidden_act\": \"silu\", \"hidden_size\": 64, \"initializer_range\": 0.02,\n"
    "  \"intermediate_size\": 128, \"max_position_embeddings\": 131072, \"mlp_bias\": false,\n"
    "  \"model_type\": \"llama\", \"num_attention_heads\": 4, \"num_hidden_layers\": 2,\n"
    "  \"num_key_value_heads\": 2, \"pad_token_id\": null, \"pretraining_tp\": 1,\n"
    "  \"rms_norm_eps\": 1e-05,\n"
    "  \"rope_parameters\": {\"factor\": 8.0, \"high_freq_factor\": 4.0, \"low_freq_factor\": 1.0,\n"
    "    \"original_max_position_embeddings\": 8192, \"rope_theta\": 500000.0, \"rope_type\": \"llama3\"},\n"
    "  \"tie_word_embeddings\": true, \"transformers_version\": \"5.23.0\", \"use_cache\": true,\n"
    "  \"vocab_size\": 128256\n"
    "}\n";

/* minimal config of an architecture plus extra "key": value members */
static char *cfg(const char *arch, const char *extra) {
    static char buf[4096];
    snprintf(buf, sizeof buf,
             "{\"architectures\": [\"%s\"], \"vocab_size\": 1000, \"hidden_size\": 64, "
             "\"intermediate_size\": 96, \"num_hidden_layers\": 2, \"num_attention_heads\": 4%s%s}",
             arch, extra && *extra ? ", " : "", extra ? extra : "");
    return buf;
}

static void expect_err(const char *json, int want, const char *needle) {
    model_config_t c;
    cs_error_clear();
    int rc = model_config_parse(json, &c);
    ck_assert_msg(rc == want, "got %d (%s), want %d for %s", rc, cs_error_last(), want, json);
    if (needle)
        ck_assert_msg(strstr(cs_error_last(), needle) != NULL, "message '%s' lacks '%s'", cs_error_last(), needle);
}

/* a minimal config of ARCH with EXTRA members that is refused with RC and a message
 * containing NEEDLE */
typedef struct refusal {
    const char *arch, *extra;
    int rc;
    const char *needle;
} refusal;

static void expect_refusals(const refusal *c, size_t n) {
    for (size_t i = 0; i < n; i++) expect_err(cfg(c[i].arch, c[i].extra), c[i].rc, c[i].needle);
}

static model_config_t ok(const char *json) {
    model_config_t c;
    int rc = model_config_parse(json, &c);
    ck_assert_msg(rc == CS_OK, "%s: %s", json, cs_error_last());
    return c;
}

START_TEST(test_llama_hf_llama3) {
    model_config_t c = ok(llama3_hf);
    ck_assert_int_eq(c.arch, MODEL_ARCH_LLAMA);
    ck_assert_str_eq(c.arch_name, "LlamaForCausalLM");
    ck_assert_int_eq(c.vocab_size, 128256);
    ck_assert_int_eq(c.hidden_size, 64);
    ck_assert_int_eq(c.intermediate_size, 128);
    ck_assert_int_eq(c.n_layers, 2);
    ck_assert_int_eq(c.n_heads, 4);
    ck_assert_int_eq(c.n_kv_heads, 2);
    ck_assert_int_eq(c.head_dim, 16);
    ck_assert_int_eq(c.max_position_embeddings, 131072);
    ck_assert_float_eq_tol(c.rms_norm_eps, 1e-5f, 1e-12f);
    ck_assert_double_eq(c.rope_theta, 500000.0);
    ck_assert_int_eq(c.rope_scaling, ROPE_SCALING_LLAMA3);
    ck_assert_double_eq(c.rope_factor, 8.0);
    ck_assert_double_eq(c.rope_low_freq_factor, 1.0);
    ck_assert_double_eq(c.rope_high_freq_factor, 4.0);
    ck_assert_int_eq(c.rope_original_max_pos, 8192);
    ck_assert(c.tie_word_embeddings);
    ck_assert(!c.attention_bias && !c.o_bias && !c.mlp_bias && !c.qk_norm);
    ck_assert_int_eq(c.sliding_window, 0);
    ck_assert_int_eq(c.torch_dtype, CS_DTYPE_BF16);
    ck_assert_int_eq(c.bos_token_id, 128000);
    ck_assert_int_eq(c.n_eos, 3);
    ck_assert_int_eq(c.eos_token_ids[2], 128009);
}
END_TEST

START_TEST(test_llama_defaults) {
    model_config_t c = ok(cfg("LlamaForCausalLM", NULL));
    ck_assert_int_eq(c.n_kv_heads, 4);          /* = heads */
    ck_assert_int_eq(c.head_dim, 16);           /* hidden / heads */
    ck_assert_int_eq(c.max_position_embeddings, 2048);
    ck_assert_float_eq_tol(c.rms_norm_eps, 1e-6f, 1e-12f);
    ck_assert_double_eq(c.rope_theta, 10000.0);
    ck_assert_int_eq(c.rope_scaling, ROPE_SCALING_NONE);
    ck_assert(!c.tie_word_embeddings);
    ck_assert_int_eq(c.torch_dtype, CS_DTYPE_F32);
    ck_assert_int_eq(c.bos_token_id, -1);
    ck_assert_int_eq(c.n_eos, 0);
    c = ok(cfg("LlamaForCausalLM", "\"attention_bias\": true, \"mlp_bias\": true, \"head_dim\": null, "
                                   "\"num_key_value_heads\": null, \"sliding_window\": 128, \"torch_dtype\": \"float16\", "
                                   "\"eos_token_id\": 7, \"bos_token_id\": null"));
    ck_assert(c.attention_bias && c.o_bias && c.mlp_bias);
    ck_assert_int_eq(c.head_dim, 16);
    ck_assert_int_eq(c.n_kv_heads, 4);
    ck_assert_int_eq(c.sliding_window, 0);      /* LlamaAttention ignores it */
    ck_assert_int_eq(c.torch_dtype, CS_DTYPE_F16);
    ck_assert_int_eq(c.n_eos, 1);
    ck_assert_int_eq(c.eos_token_ids[0], 7);
}
END_TEST

START_TEST(test_gqa) {
    model_config_t c = ok(cfg("LlamaForCausalLM", "\"num_key_value_heads\": 1, \"head_dim\": 32"));
    ck_assert_int_eq(c.n_kv_heads, 1);
    ck_assert_int_eq(c.head_dim, 32);
    static const refusal bad[] = {
        {"LlamaForCausalLM", "\"num_key_value_heads\": 3", CS_EFORMAT, "num_key_value_heads"},
        {"LlamaForCausalLM", "\"num_key_value_heads\": 8", CS_EFORMAT, "num_key_value_heads"},
        {"LlamaForCausalLM", "\"num_key_value_heads\": 0", CS_EFORMAT, "num_key_value_heads"},
        {"LlamaForCausalLM", "\"head_dim\": 15", CS_EFORMAT, "head_dim"},
    };
    expect_refusals(bad, CS_ARRAY_LEN(bad));
}
END_TEST

START_TEST(test_mistral) {
    /* absent num_key_value_heads is 8 and absent sliding_window 4096 in MistralConfig */
    model_config_t c = ok("{\"architectures\": [\"MistralForCausalLM\"], \"vocab_size\": 1000, \"hidden_size\": 64, "
                          "\"intermediate_size\": 96, \"num_hidden_layers\": 2, \"num_attention_heads\": 8}");
    ck_assert_int_eq(c.arch, MODEL_ARCH_MISTRAL);
    ck_assert_int_eq(c.n_kv_heads, 8);
    ck_assert_int_eq(c.head_dim, 8);
    ck_assert_int_eq(c.sliding_window, 4096);
    ck_assert_int_eq(c.max_position_embeddings, 131072);
    ck_assert(!c.attention_bias && !c.o_bias && !c.mlp_bias);
    c = ok(cfg("MistralForCausalLM", "\"num_key_value_heads\": 2, \"sliding_window\": null, \"attention_bias\": true"));
    ck_assert_int_eq(c.sliding_window, 0);
    ck_assert(!c.attention_bias);
    c = ok(cfg("MistralForCausalLM", "\"num_key_value_heads\": 2, \"sliding_window\": 256"));
    ck_assert_int_eq(c.sliding_window, 256);
    expect_err(cfg("MistralForCausalLM", "\"num_key_value_heads\": 2, \"sliding_window\": 0"), CS_EFORMAT, "sliding_window");
}
END_TEST

START_TEST(test_qwen2) {
    model_config_t c = ok(cfg("Qwen2ForCausalLM", "\"num_key_value_heads\": 2, \"sliding_window\": 4096, "
                                                  "\"use_sliding_window\": false, \"max_window_layers\": 1"));
    ck_assert_int_eq(c.arch, MODEL_ARCH_QWEN2);
    ck_assert(c.attention_bias);
    ck_assert(!c.o_bias && !c.mlp_bias && !c.qk_norm);
    ck_assert_int_eq(c.sliding_window, 0);
    ck_assert_int_eq(c.max_position_embeddings, 32768);
    ck_assert_int_eq(c.head_dim, 16);
    /* Qwen2Config's dataclass default is 32 when the key is absent (null means = heads) */
    expect_err(cfg("Qwen2ForCausalLM", NULL), CS_EFORMAT, "num_key_value_heads");
    c = ok("{\"architectures\": [\"Qwen2ForCausalLM\"], \"vocab_size\": 1000, \"hidden_size\": 128, "
           "\"intermediate_size\": 96, \"num_hidden_layers\": 2, \"num_attention_heads\": 32}");
    ck_assert_int_eq(c.n_kv_heads, 32);
    c = ok(cfg("Qwen2ForCausalLM", "\"num_key_value_heads\": null"));
    ck_assert_int_eq(c.n_kv_heads, 4);
    c = ok(cfg("Qwen2ForCausalLM", "\"num_key_value_heads\": 2, \"head_dim\": 32"));
    ck_assert_int_eq(c.head_dim, 32);
    expect_err(cfg("Qwen2ForCausalLM", "\"num_key_value_heads\": 2, \"head_dim\": null"), CS_EFORMAT, "head_dim");
}
END_TEST

START_TEST(test_qwen2_sliding) {
    /* each config: the window it parses to, or the error it is refused with and a part of the
     * message */
    static const struct { const char *extra; int rc, window; const char *needle; } cases[] = {
        /* all layers slide (max_window_layers 0): allowed */
        {"\"num_key_value_heads\": 2, \"use_sliding_window\": true, \"sliding_window\": 64, \"max_window_layers\": 0",
         CS_OK, 64, NULL},
        /* max_window_layers >= layers: no layer slides */
        {"\"num_key_value_heads\": 2, \"use_sliding_window\": true, \"sliding_window\": 64, \"max_window_layers\": 28",
         CS_OK, 0, NULL},
        /* some layers sliding, others not: refused by name */
        {"\"num_key_value_heads\": 2, \"use_sliding_window\": true, \"sliding_window\": 64, \"max_window_layers\": 1",
         CS_EUNSUPPORTED, 0, "max_window_layers"},
        /* explicit layer_types wins over max_window_layers */
        {"\"num_key_value_heads\": 2, \"use_sliding_window\": true, \"sliding_window\": 64, \"max_window_layers\": 28, "
         "\"layer_types\": [\"full_attention\", \"sliding_attention\"]",
         CS_EUNSUPPORTED, 0, "layer_types"},
        {"\"num_key_value_heads\": 2, \"use_sliding_window\": true, \"sliding_window\": 32, "
         "\"layer_types\": [\"sliding_attention\", \"sliding_attention\"]",
         CS_OK, 32, NULL},
        /* layer_types without use_sliding_window: the window is None, all layers are full */
        {"\"num_key_value_heads\": 2, \"sliding_window\": 32, "
         "\"layer_types\": [\"full_attention\", \"sliding_attention\"]",
         CS_OK, 0, NULL},
        {"\"num_key_value_heads\": 2, \"layer_types\": [\"full_attention\"]", CS_EFORMAT, 0, "layer_types"},
        {"\"num_key_value_heads\": 2, \"layer_types\": [\"full_attention\", \"chunked_attention\"]", CS_EUNSUPPORTED, 0,
         "chunked_attention"},
    };
    for (size_t i = 0; i < CS_ARRAY_LEN(cases); i++) {
        const char *json = cfg("Qwen2ForCausalLM", cases[i].extra);
        if (cases[i].rc != CS_OK) {
            expect_err(json, cases[i].rc, cases[i].needle);
            continue;
        }
        model_config_t c = ok(json);
        ck_assert_msg(c.sliding_window == cases[i].window, "%s: sliding_window %d, want %d", json, c.sliding_window,
                      cases[i].window);
    }
}
END_TEST

START_TEST(test_qwen3) {
    model_config_t c = ok(cfg("Qwen3ForCausalLM", "\"num_key_value_heads\": 2, \"head_dim\": 32, "
                                                  "\"tie_word_embeddings\": true, \"rope_theta\": 1000000, "
                                                  "\"rope_scaling\": null, \"torch_dtype\": \"bfloat16\", "
                                                  "\"eos_token_id\": 151645, \"bos_token_id\": 151643"));
    ck_assert_int_eq(c.arch, MODEL_ARCH_QWEN3);
    ck_assert(c.qk_norm);
    ck_assert(!c.attention_bias && !c.o_bias);
    ck_assert_int_eq(c.head_dim, 32);
    ck_assert(c.tie_word_embeddings);
    ck_assert_double_eq(c.rope_theta, 1e6);
    ck_assert_int_eq(c.rope_scaling, ROPE_SCALING_NONE);
    ck_assert_int_eq(c.torch_dtype, CS_DTYPE_BF16);
    ck_assert_int_eq(c.bos_token_id, 151643);
    /* Qwen3Config: head_dim defaults to 128, not hidden / heads; attention_bias covers o_proj */
    c = ok(cfg("Qwen3ForCausalLM", "\"num_key_value_heads\": 2, \"attention_bias\": true"));
    ck_assert_int_eq(c.head_dim, 128);
    ck_assert(c.attention_bias && c.o_bias);
    expect_err(cfg("Qwen3ForCausalLM", "\"num_key_value_heads\": 2, \"head_dim\": null"), CS_EFORMAT, "head_dim");
}
END_TEST

START_TEST(test_rope_layouts) {
    /* legacy: rope_scaling + top-level rope_theta, "type" instead of "rope_type" */
    model_config_t c = ok(cfg("LlamaForCausalLM", "\"rope_theta\": 500000.0, \"max_position_embeddings\": 4096, "
                                                  "\"rope_scaling\": {\"type\": \"llama3\", \"factor\": 8.0, "
                                                  "\"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0}"));
    ck_assert_int_eq(c.rope_scaling, ROPE_SCALING_LLAMA3);
    ck_assert_double_eq(c.rope_theta, 500000.0);
    ck_assert_int_eq(c.rope_original_max_pos, 4096);      /* defaults to max_position_embeddings */
    /* top-level original_max_position_embeddings wins */
    c = ok(cfg("LlamaForCausalLM", "\"original_max_position_embeddings\": 2048, \"rope_parameters\": "
                                   "{\"rope_type\": \"llama3\", \"factor\": 8, \"low_freq_factor\": 1, "
                                   "\"high_freq_factor\": 4, \"original_max_position_embeddings\": 8192}"));
    ck_assert_int_eq(c.rope_original_max_pos, 2048);
    ck_assert_double_eq(c.rope_theta, 10000.0);
    /* rope_parameters' theta wins over a top-level one */
    c = ok(cfg("LlamaForCausalLM", "\"rope_theta\": 5.0, \"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 7.0}"));
    ck_assert_double_eq(c.rope_theta, 7.0);
    ck_assert_int_eq(c.rope_scaling, ROPE_SCALING_NONE);
    /* an empty rope_scaling falls through to rope_parameters */
    c = ok(cfg("LlamaForCausalLM", "\"rope_scaling\": {}, \"rope_parameters\": {\"rope_type\": \"linear\", \"factor\": 2.0}"));
    ck_assert_int_eq(c.rope_scaling, ROPE_SCALING_LINEAR);
    ck_assert_double_eq(c.rope_factor, 2.0);
    c = ok(cfg("MistralForCausalLM", "\"num_key_value_heads\": 2, \"rope_scaling\": {\"rope_type\": \"linear\", \"factor\": 4}"));
    ck_assert_int_eq(c.rope_scaling, ROPE_SCALING_LINEAR);
    ck_assert_double_eq(c.rope_factor, 4.0);
    c = ok(cfg("LlamaForCausalLM", "\"rope_parameters\": {\"rope_theta\": 123.0}"));
    ck_assert_double_eq(c.rope_theta, 123.0);
    ck_assert_int_eq(c.rope_scaling, ROPE_SCALING_NONE);
}
END_TEST

START_TEST(test_rope_refused) {
    static const char *const types[] = { "dynamic", "yarn", "longrope", "ntk", "proportional" };
    for (size_t i = 0; i < CS_ARRAY_LEN(types); i++) {
        char extra[256];
        snprintf(extra, sizeof extra, "\"rope_scaling\": {\"rope_type\": \"%s\", \"factor\": 2.0}", types[i]);
        expect_err(cfg("LlamaForCausalLM", extra), CS_EUNSUPPORTED, types[i]);
        snprintf(extra, sizeof extra, "\"num_key_value_heads\": 2, \"rope_parameters\": {\"type\": \"%s\", \"factor\": 2.0}", types[i]);
        expect_err(cfg("Qwen3ForCausalLM", extra), CS_EUNSUPPORTED, types[i]);
    }
    static const refusal bad[] = {
        {"LlamaForCausalLM", "\"rope_scaling\": {\"rope_type\": \"linear\"}", CS_EFORMAT, "factor"},
        {"LlamaForCausalLM", "\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8, \"low_freq_factor\": 1}",
         CS_EFORMAT, "high_freq_factor"},
        {"LlamaForCausalLM",
         "\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8, \"low_freq_factor\": 4, "
         "\"high_freq_factor\": 4}",
         CS_EFORMAT, "llama3"},
        {"LlamaForCausalLM", "\"partial_rotary_factor\": 0.5", CS_EUNSUPPORTED, "partial_rotary_factor"},
        {"LlamaForCausalLM", "\"rope_parameters\": {\"full_attention\": {\"rope_type\": \"default\"}}", CS_EUNSUPPORTED,
         "rope_parameters"},
        {"LlamaForCausalLM", "\"rope_theta\": 0", CS_EFORMAT, "rope_theta"},
        {"LlamaForCausalLM", "\"rope_scaling\": \"llama3\"", CS_EFORMAT, "rope_scaling"},
    };
    expect_refusals(bad, CS_ARRAY_LEN(bad));
}
END_TEST

START_TEST(test_refusals) {
    static const refusal bad[] = {
        {"GPT2LMHeadModel", NULL, CS_EUNSUPPORTED, "GPT2LMHeadModel"},
        {"Gemma3ForCausalLM", NULL, CS_EUNSUPPORTED, "Gemma3ForCausalLM"},
        {"LlamaForCausalLM", "\"hidden_act\": \"gelu\"", CS_EUNSUPPORTED, "gelu"},
        {"LlamaForCausalLM", "\"hidden_act\": 3", CS_EFORMAT, "hidden_act"},
        {"LlamaForCausalLM", "\"quantization_config\": {\"quant_method\": \"gptq\"}", CS_EUNSUPPORTED,
         "quantization_config"},
        {"LlamaForCausalLM", "\"dtype\": \"float64\"", CS_EUNSUPPORTED, "float64"},
        {"LlamaForCausalLM", "\"torch_dtype\": \"int8\"", CS_EUNSUPPORTED, "int8"},
        {"LlamaForCausalLM", "\"eos_token_id\": [1,2,3,4,5,6,7,8,9]", CS_EUNSUPPORTED, "eos_token_id"},
        {"LlamaForCausalLM", "\"eos_token_id\": \"</s>\"", CS_EFORMAT, "eos_token_id"},
        {"LlamaForCausalLM", "\"bos_token_id\": -3", CS_EFORMAT, "bos_token_id"},
    };
    expect_refusals(bad, CS_ARRAY_LEN(bad));
    model_config_t c = ok(cfg("LlamaForCausalLM", "\"hidden_act\": \"swish\""));
    ck_assert_int_eq(c.arch, MODEL_ARCH_LLAMA);
}
END_TEST

START_TEST(test_missing_and_types) {
    static const char *const req[] = { "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                       "num_attention_heads" };
    for (size_t i = 0; i < CS_ARRAY_LEN(req); i++) {
        /* drop one field from the minimal config */
        char buf[4096];
        snprintf(buf, sizeof buf, "%s", cfg("LlamaForCausalLM", NULL));
        char *p = strstr(buf, req[i]);
        ck_assert_ptr_nonnull(p);
        memcpy(p, "zzzz", 4);       /* renames the key */
        expect_err(buf, CS_EFORMAT, req[i]);
    }
    expect_err("{\"vocab_size\": 10}", CS_EFORMAT, "architectures");
    expect_err("{\"architectures\": []}", CS_EFORMAT, "architectures");
    expect_err("{\"architectures\": \"LlamaForCausalLM\"}", CS_EFORMAT, "architectures");
    expect_err("[1]", CS_EFORMAT, NULL);
    expect_err("{\"architectures\": [\"LlamaForCausalLM\"", CS_EFORMAT, "JSON");
    expect_err("", CS_EFORMAT, NULL);
    expect_err(cfg("LlamaForCausalLM", "\"rms_norm_eps\": \"1e-6\""), CS_EFORMAT, "rms_norm_eps");
    expect_err(cfg("LlamaForCausalLM", "\"tie_word_embeddings\": 1"), CS_EFORMAT, "tie_word_embeddings");
    expect_err(cfg("LlamaForCausalLM", "\"max_position_embeddings\": 4096.5"), CS_EFORMAT, "max_position_embeddings");
    expect_err(cfg("LlamaForCausalLM", "\"max_position_embeddings\": 0"), CS_EFORMAT, "max_position_embeddings");
    expect_err("{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 1000, \"hidden_size\": \"64\", "
               "\"intermediate_size\": 96, \"num_hidden_layers\": 2, \"num_attention_heads\": 4}",
               CS_EFORMAT, "hidden_size");
    expect_err("{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 1000, \"hidden_size\": 64, "
               "\"intermediate_size\": -96, \"num_hidden_layers\": 2, \"num_attention_heads\": 4}",
               CS_EFORMAT, "intermediate_size");
    expect_err("{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 1000, \"hidden_size\": 64, "
               "\"intermediate_size\": 96, \"num_hidden_layers\": 99999999999, \"num_attention_heads\": 4}",
               CS_EFORMAT, "num_hidden_layers");
    expect_err("{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 1000, \"hidden_size\": 64, "
               "\"intermediate_size\": 96, \"num_hidden_layers\": 100000, \"num_attention_heads\": 4}",
               CS_EUNSUPPORTED, "num_hidden_layers");
    model_config_t c = ok(cfg("LlamaForCausalLM", "\"vocab_size\": 5"));   /* duplicate key: the last wins */
    ck_assert_int_eq(c.vocab_size, 5);
    /* Llama requires hidden_size % num_attention_heads == 0 (transformers validates it) */
    expect_err("{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 1000, \"hidden_size\": 66, "
               "\"intermediate_size\": 96, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"head_dim\": 16}",
               CS_EFORMAT, "hidden_size");
}
END_TEST

START_TEST(test_load_dir) {
    char dir[] = "/tmp/cs_test_mc_XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(dir));
    model_config_t c;
    ck_assert_int_eq(model_config_load(dir, &c), CS_ENOTFOUND);
    ck_assert_ptr_nonnull(strstr(cs_error_last(), dir));
    char path[256];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    fputs(cfg("LlamaForCausalLM", "\"hidden_act\": \"relu\""), f);
    fclose(f);
    ck_assert_int_eq(model_config_load(dir, &c), CS_EUNSUPPORTED);
    ck_assert_ptr_nonnull(strstr(cs_error_last(), path));
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "relu"));
    f = fopen(path, "w");
    fputs(llama3_hf, f);
    fclose(f);
    ck_assert_int_eq(model_config_load(dir, &c), CS_OK);
    ck_assert_int_eq(c.vocab_size, 128256);
    unlink(path);
    rmdir(dir);
}
END_TEST

/* corrupted configs: a status, never a crash */
START_TEST(test_no_crash_on_corruption) {
    size_t n = strlen(llama3_hf);
    char *buf = malloc(n + 1);
    uint64_t x = 99;
    for (int iter = 0; iter < 5000; iter++) {
        memcpy(buf, llama3_hf, n + 1);
        for (int k = 0; k < 1 + iter % 3; k++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            buf[(x >> 33) % n] = "0123456789{}[]\",:-.eE \"xnul"[(x >> 20) % 27];
        }
        model_config_t c;
        int rc = model_config_parse(buf, &c);
        ck_assert(rc == CS_OK || rc == CS_EFORMAT || rc == CS_EUNSUPPORTED);
        if (rc == CS_OK) ck_assert(c.n_heads % c.n_kv_heads == 0 && c.head_dim > 0);
    }
    free(buf);
}
END_TEST

/* generation_config.json: the fields that differ from transformers' GenerationConfig
 * defaults become the model's sampling defaults (as vLLM's --generation-config auto) */
START_TEST(test_gen_defaults) {
    model_gen_defaults_t g;
    /* SmolLM2's recommended sampling, with what transformers writes beside it */
    ck_assert_int_eq(model_gen_defaults_parse("g", "{\"bos_token_id\": 1, \"eos_token_id\": 2, \"temperature\": 0.2,"
                                                   " \"top_p\": 0.9, \"do_sample\": true}", &g), CS_OK);
    ck_assert_uint_eq(g.set, MODEL_GEN_TEMPERATURE | MODEL_GEN_TOP_P);
    ck_assert(g.temperature == 0.2 && g.top_p == 0.9);
    /* values equal to transformers' defaults are no recommendation; null is absent */
    ck_assert_int_eq(model_gen_defaults_parse("g", "{\"temperature\": 1.0, \"top_p\": 1, \"top_k\": 50,"
                                                   " \"repetition_penalty\": 1.0, \"min_p\": null}", &g), CS_OK);
    ck_assert_uint_eq(g.set, 0);
    ck_assert_int_eq(model_gen_defaults_parse("g", "{\"top_k\": 20, \"min_p\": 0.0, \"repetition_penalty\": 1.1,"
                                                   " \"max_new_tokens\": 64}", &g), CS_OK);
    ck_assert_uint_eq(g.set, MODEL_GEN_TOP_K | MODEL_GEN_MIN_P | MODEL_GEN_REPETITION_PENALTY | MODEL_GEN_MAX_TOKENS);
    ck_assert(g.top_k == 20 && g.min_p == 0.0 && g.repetition_penalty == 1.1 && g.max_tokens == 64);
    /* wrong types and ranges are refused by name, leaving no defaults */
    ck_assert_int_eq(model_gen_defaults_parse("g", "{\"temperature\": \"hot\"}", &g), CS_EFORMAT);
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "'temperature'"));
    ck_assert_uint_eq(g.set, 0);
    ck_assert_int_eq(model_gen_defaults_parse("g", "{\"top_k\": 2.5}", &g), CS_EFORMAT);
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "'top_k'"));
    ck_assert_int_eq(model_gen_defaults_parse("g", "{\"max_new_tokens\": 0}", &g), CS_EFORMAT);
    ck_assert_int_eq(model_gen_defaults_parse("g", "{\"top_p\": -0.5}", &g), CS_EFORMAT);
    ck_assert_int_eq(model_gen_defaults_parse("g", "{\"top_p\": 0}", &g), CS_EFORMAT);
    ck_assert_int_eq(model_gen_defaults_parse("g", "{\"min_p\": 1.5}", &g), CS_EFORMAT);
    ck_assert_int_eq(model_gen_defaults_parse("g", "{\"repetition_penalty\": 0}", &g), CS_EFORMAT);
    ck_assert_int_eq(model_gen_defaults_parse("g", "[1]", &g), CS_EFORMAT);
    ck_assert_int_eq(model_gen_defaults_parse("g", "{", &g), CS_EFORMAT);
    /* a directory without the file has no defaults */
    char dir[] = "/tmp/cs_gencfg_XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(dir));
    g.set = 99;
    ck_assert_int_eq(model_gen_defaults_load(dir, &g), CS_OK);
    ck_assert_uint_eq(g.set, 0);
    char path[128];
    snprintf(path, sizeof path, "%s/generation_config.json", dir);
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fputs("{\"temperature\": 0.6, \"top_p\": 0.95, \"top_k\": 20}\n", f);
    fclose(f);
    ck_assert_int_eq(model_gen_defaults_load(dir, &g), CS_OK);
    ck_assert_uint_eq(g.set, MODEL_GEN_TEMPERATURE | MODEL_GEN_TOP_P | MODEL_GEN_TOP_K);
    ck_assert(g.temperature == 0.6 && g.top_p == 0.95 && g.top_k == 20);
    unlink(path);
    rmdir(dir);
}
END_TEST

int main(void) {
    const TTest *const tests[] = {
        test_llama_hf_llama3, test_llama_defaults, test_gqa, test_mistral, test_qwen2, test_qwen2_sliding,
        test_qwen3, test_rope_layouts, test_rope_refused, test_refusals, test_missing_and_types,
        test_load_dir, test_no_crash_on_corruption, test_gen_defaults,
    };
    return cs_check_main("model_config", tests, CS_ARRAY_LEN(tests), 0, CK_FORK);
}
