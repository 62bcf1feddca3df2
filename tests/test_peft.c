/* test_peft.c: the host LoRA term of the cold start (lora/assist.h: its kernel against a
 * plain loop, F32 and BF16; the worker pool gated by a flag, its parts counted). And PEFT LoRA adapter loading against an in-memory base config: scale (plain
 * and rsLoRA), rank_pattern / alpha_pattern key matching as peft does it, target_modules as
 * list / regex / all-linear, layers_to_transform, exclude_modules, and refusals (DoRA,
 * modules_to_save, lm_head / embeddings, wrong shapes naming both shapes, missing tensors). */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <pthread.h>

#include "base/safetensors.h"
#include "lora/assist.h"
#include "lora/peft.h"
#include "testutil.h"

static char dir[256];
static model_config_t base;

#define N_LAYERS CS_TEST_TINY_LLAMA_LAYERS

static void setup(void) { cs_test_lora_setup(dir, sizeof dir, "peft", &base); }

static void teardown(void) { cs_rmtree(dir); }

/* ---- building adapter files ---- */

#define TB_MAX 128
typedef struct tb {
    st_write_tensor_t t[TB_MAX];
    char names[TB_MAX][160];
    void *bufs[TB_MAX];
    int n;
} tb_t;

/* exactly representable in BF16 and F16 */
static float val(int seed, size_t i) { return (float)seed * 0.25f + (float)((int)(i % 64) - 32) * 0.125f; }

static void tb_add(tb_t *b, const char *name, cs_dtype dt, int64_t d0, int64_t d1, int seed) {
    ck_assert_int_lt(b->n, TB_MAX);
    size_t n = (size_t)d0 * (size_t)d1;
    void *buf = malloc(n * cs_dtype_size(dt) + 1);
    for (size_t i = 0; i < n; i++) {
        float v = val(seed, i);
        if (dt == CS_DTYPE_F32) ((float *)buf)[i] = v;
        else if (dt == CS_DTYPE_BF16) ((uint16_t *)buf)[i] = cs_f32_to_bf16(v);
        else if (dt == CS_DTYPE_F16) ((uint16_t *)buf)[i] = cs_f32_to_f16(v);
        else if (dt == CS_DTYPE_F64) ((double *)buf)[i] = v;
    }
    snprintf(b->names[b->n], sizeof b->names[b->n], "%s", name);
    b->t[b->n] = (st_write_tensor_t){ .name = b->names[b->n], .dtype = dt, .n_dims = 2, .shape = { d0, d1 }, .data = buf };
    b->bufs[b->n++] = buf;
}

static const char *parent(int t) { return t < LORA_GATE ? "self_attn" : "mlp"; }

static void tensor_name(char *buf, size_t cap, int layer, int t, char ab) {
    snprintf(buf, cap, "base_model.model.model.layers.%d.%s.%s.lora_%c.weight", layer, parent(t), lora_target_names[t], ab);
}

static int seed_of(int layer, int t, int ab) { return layer * 7 + t + ab; }

/* A [rank, d_in] and B [d_out, rank] of the base model */
static void tb_lora(tb_t *b, int layer, int t, int rank, cs_dtype dt) {
    int din, dout;
    lora_target_dims(&base, (lora_target)t, &din, &dout);
    char n[160];
    tensor_name(n, sizeof n, layer, t, 'A');
    tb_add(b, n, dt, rank, din, seed_of(layer, t, 0));
    tensor_name(n, sizeof n, layer, t, 'B');
    tb_add(b, n, dt, dout, rank, seed_of(layer, t, 1));
}

/* every layer, the targets in mask, rank r */
static void tb_all(tb_t *b, unsigned mask, int r, cs_dtype dt) {
    for (int l = 0; l < N_LAYERS; l++)
        for (int t = 0; t < LORA_N_TARGETS; t++)
            if (mask & (1u << t)) tb_lora(b, l, t, r, dt);
}

static void tb_write(tb_t *b, const char *file) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s", dir, file);
    const char *meta[] = { "format", "pt", NULL };
    ck_assert_int_eq(safetensors_write(p, b->t, (size_t)b->n, meta), CS_OK);
    for (int i = 0; i < b->n; i++) free(b->bufs[i]);
    b->n = 0;
}

static void write_file(const char *file, const char *text) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s", dir, file);
    FILE *f = fopen(p, "w");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    fclose(f);
}

#define ALL_TARGETS "[\"q_proj\", \"k_proj\", \"v_proj\", \"o_proj\", \"gate_proj\", \"up_proj\", \"down_proj\"]"
#define ALL_MASK 0x7fu

/* adapter_model.safetensors of every target of every layer at rank R in F32 */
static void write_all_targets(int r) {
    tb_t b = { 0 };
    tb_all(&b, ALL_MASK, r, CS_DTYPE_F32);
    tb_write(&b, "adapter_model.safetensors");
}

static void write_cfg(const char *fmt_extra) {
    char buf[4096];
    snprintf(buf, sizeof buf, "{\"peft_type\": \"LORA\", \"task_type\": \"CAUSAL_LM\", \"bias\": \"none\", %s}", fmt_extra);
    write_file("adapter_config.json", buf);
}

static char *read_cfg(void) {
    char p[512];
    size_t len;
    snprintf(p, sizeof p, "%s/adapter_config.json", dir);
    char *t = cs_read_file(p, &len);
    ck_assert_ptr_nonnull(t);
    return t;
}

static lora_adapter_t *load_ok(void) {
    lora_adapter_t *a = NULL;
    int rc = lora_adapter_load(dir, &base, &a);
    ck_assert_msg(rc == CS_OK, "load: %d %s", rc, cs_error_last());
    ck_assert_ptr_nonnull(a);
    return a;
}

/* The load must fail with WANT and a message containing NEEDLE; a failure names the needle and
 * the config. */
static void load_fail(int want, const char *needle) {
    lora_adapter_t *a = (lora_adapter_t *)0x1;
    cs_error_clear();
    int rc = lora_adapter_load(dir, &base, &a);
    ck_assert_msg(rc == want, "got %d (%s), want %d ('%s'), config %s", rc, cs_error_last(), want,
                  needle ? needle : "", read_cfg());
    ck_assert_ptr_null(a);
    if (needle)
        ck_assert_msg(strstr(cs_error_last(), needle) != NULL, "message '%s' lacks '%s', config %s", cs_error_last(),
                      needle, read_cfg());
}

static void check_mod(const lora_adapter_t *a, int layer, int t, int rank, double scale) {
    const lora_module_t *m = lora_adapter_module(a, layer, (lora_target)t);
    ck_assert_msg(m->rank == rank, "layer %d %s: rank %d, want %d", layer, lora_target_names[t], m->rank, rank);
    int din, dout;
    lora_target_dims(&base, (lora_target)t, &din, &dout);
    ck_assert_int_eq(m->d_in, din);
    ck_assert_int_eq(m->d_out, dout);
    if (!rank) {
        ck_assert_ptr_null(m->a);
        return;
    }
    ck_assert_msg(fabs(m->scale - scale) < 1e-6, "layer %d %s: scale %g, want %g", layer, lora_target_names[t],
                  (double)m->scale, scale);
    for (size_t i = 0; i < (size_t)rank * din; i += 7) ck_assert_float_eq(lora_module_at(m, m->a, i), val(seed_of(layer, t, 0), i));
    for (size_t i = 0; i < (size_t)dout * rank; i += 5) ck_assert_float_eq(lora_module_at(m, m->b, i), val(seed_of(layer, t, 1), i));
    ck_assert_float_eq(lora_module_at(m, m->b, (size_t)dout * rank - 1), val(seed_of(layer, t, 1), (size_t)dout * rank - 1));
}

/* ---- tests ---- */

START_TEST(test_target_dims) {
    model_config_t q3; /* Qwen3: q and o are heads x head_dim 32 = 128 wide */
    ck_assert_int_eq(model_config_parse("{\"architectures\": [\"Qwen3ForCausalLM\"], \"vocab_size\": 10, "
                                        "\"hidden_size\": 64, \"intermediate_size\": 96, \"num_hidden_layers\": 1, "
                                        "\"num_attention_heads\": 4, \"num_key_value_heads\": 1, \"head_dim\": 32}", &q3), CS_OK);
    static const struct { bool qwen3; lora_target t; int din, dout; } cases[] = {
        {false, LORA_Q, 64, 64},    {false, LORA_K, 64, 32},  {false, LORA_V, 64, 32}, {false, LORA_O, 64, 64},
        {false, LORA_GATE, 64, 96}, {false, LORA_UP, 64, 96}, {false, LORA_DOWN, 96, 64},
        {true, LORA_Q, 64, 128},    {true, LORA_K, 64, 32},   {true, LORA_O, 128, 64},
    };
    for (size_t i = 0; i < CS_ARRAY_LEN(cases); i++) {
        int din, dout;
        lora_target_dims(cases[i].qwen3 ? &q3 : &base, cases[i].t, &din, &dout);
        ck_assert_msg(din == cases[i].din && dout == cases[i].dout, "%s %s: %d -> %d, want %d -> %d",
                      cases[i].qwen3 ? "qwen3" : "llama", lora_target_names[cases[i].t], din, dout, cases[i].din,
                      cases[i].dout);
    }
    ck_assert_str_eq(lora_target_names[LORA_DOWN], "down_proj");
}
END_TEST

START_TEST(test_all_targets) {
    write_all_targets(8);
    write_cfg("\"r\": 8, \"lora_alpha\": 16, \"target_modules\": " ALL_TARGETS ", \"use_rslora\": false, "
              "\"use_dora\": false, \"modules_to_save\": null, \"rank_pattern\": {}, \"alpha_pattern\": {}, "
              "\"lora_dropout\": 0.05, \"fan_in_fan_out\": false, \"init_lora_weights\": true, "
              "\"layers_to_transform\": null, \"layers_pattern\": null, \"exclude_modules\": null");
    lora_adapter_t *a = load_ok();
    ck_assert_int_eq(a->n_layers, N_LAYERS);
    ck_assert_int_eq(a->max_rank, 8);
    size_t want = 0;
    for (int l = 0; l < N_LAYERS; l++)
        for (int t = 0; t < LORA_N_TARGETS; t++) {
            check_mod(a, l, t, 8, 2.0);
            int din, dout;
            lora_target_dims(&base, (lora_target)t, &din, &dout);
            want += (size_t)8 * (din + 2 * dout) * sizeof(float);   /* A, B and Bᵀ */
            const lora_module_t *m = lora_adapter_module(a, l, (lora_target)t);
            for (int o = 0; o < dout; o++)
                for (int r = 0; r < 8; r++)
                    ck_assert(((float *)m->bt)[(size_t)r * dout + o] == ((float *)m->b)[(size_t)o * 8 + r]);
        }
    ck_assert_uint_eq(a->nbytes, want);
    ck_assert_str_eq(a->path, dir);
    ck_assert_str_eq(a->name, strrchr(dir, '/') + 1);
    lora_adapter_free(a);
    lora_adapter_free(NULL);
    /* trailing slash: same name */
    char d2[300];
    snprintf(d2, sizeof d2, "%s/", dir);
    ck_assert_int_eq(lora_adapter_load(d2, &base, &a), CS_OK);
    ck_assert_str_eq(a->name, strrchr(dir, '/') + 1);
    lora_adapter_free(a);
}
END_TEST

START_TEST(test_rslora) {
    write_all_targets(4);
    write_cfg("\"r\": 4, \"lora_alpha\": 8, \"target_modules\": " ALL_TARGETS ", \"use_rslora\": true");
    lora_adapter_t *a = load_ok();
    check_mod(a, 0, LORA_Q, 4, 4.0);        /* 8 / sqrt(4) */
    check_mod(a, 2, LORA_DOWN, 4, 4.0);
    lora_adapter_free(a);
    write_cfg("\"r\": 4, \"lora_alpha\": 6.5, \"target_modules\": " ALL_TARGETS);
    a = load_ok();
    check_mod(a, 1, LORA_UP, 4, 6.5 / 4);
    lora_adapter_free(a);
}
END_TEST

START_TEST(test_rank_alpha_pattern) {
    /* peft's get_pattern_key: first key K in file order with re.match(r"(.*\.)?(K)$", name) */
    int ranks[N_LAYERS][LORA_N_TARGETS];
    for (int l = 0; l < N_LAYERS; l++)
        for (int t = 0; t < LORA_N_TARGETS; t++) ranks[l][t] = 8;
    for (int l = 0; l < N_LAYERS; l++) ranks[l][LORA_Q] = 4;
    ranks[1][LORA_V] = 2;
    ranks[2][LORA_GATE] = ranks[2][LORA_UP] = ranks[2][LORA_DOWN] = 6;
    tb_t b = { 0 };
    for (int l = 0; l < N_LAYERS; l++)
        for (int t = 0; t < LORA_N_TARGETS; t++) tb_lora(&b, l, t, ranks[l][t], CS_DTYPE_F32);
    tb_write(&b, "adapter_model.safetensors");
    write_cfg("\"r\": 8, \"lora_alpha\": 16, \"target_modules\": " ALL_TARGETS ", "
              "\"rank_pattern\": {\"q_proj\": 4, \"self_attn.q_proj\": 5, \"model.layers.1.self_attn.v_proj\": 2, "
              "\"layers\\\\.2\\\\.mlp\\\\..*\": 6, \"roj\": 99, \"layers.0.k\": 99}, "
              "\"alpha_pattern\": {\"v_proj\": 32, \"down_proj\": 3, \"model.layers.1.self_attn.v_proj\": 1}");
    lora_adapter_t *a = load_ok();
    for (int l = 0; l < N_LAYERS; l++) {
        check_mod(a, l, LORA_Q, 4, 16.0 / 4);
        check_mod(a, l, LORA_K, 8, 2.0);
        check_mod(a, l, LORA_V, ranks[l][LORA_V], 32.0 / ranks[l][LORA_V]);   /* "v_proj" listed first wins */
        check_mod(a, l, LORA_O, 8, 2.0);
        check_mod(a, l, LORA_GATE, ranks[l][LORA_GATE], 16.0 / ranks[l][LORA_GATE]);
        check_mod(a, l, LORA_DOWN, ranks[l][LORA_DOWN], 3.0 / ranks[l][LORA_DOWN]);
    }
    ck_assert_int_eq(a->max_rank, 8);
    lora_adapter_free(a);
    /* rsLoRA uses each module's own rank */
    write_cfg("\"r\": 8, \"lora_alpha\": 16, \"use_rslora\": true, \"target_modules\": " ALL_TARGETS ", "
              "\"rank_pattern\": {\"q_proj\": 4, \"model.layers.1.self_attn.v_proj\": 2, \"layers\\\\.2\\\\.mlp\\\\..*\": 6}");
    a = load_ok();
    check_mod(a, 0, LORA_Q, 4, 16.0 / 2);
    check_mod(a, 1, LORA_V, 2, 16.0 / sqrt(2.0));
    check_mod(a, 2, LORA_UP, 6, 16.0 / sqrt(6.0));
    check_mod(a, 0, LORA_UP, 8, 16.0 / sqrt(8.0));
    lora_adapter_free(a);
}
END_TEST

START_TEST(test_partial_targets) {
    tb_t b = { 0 };
    tb_all(&b, (1u << LORA_Q) | (1u << LORA_V), 8, CS_DTYPE_F32);
    tb_write(&b, "adapter_model.safetensors");
    write_cfg("\"r\": 8, \"lora_alpha\": 8, \"target_modules\": [\"v_proj\", \"q_proj\"]");
    lora_adapter_t *a = load_ok();
    for (int l = 0; l < N_LAYERS; l++)
        for (int t = 0; t < LORA_N_TARGETS; t++) check_mod(a, l, t, (t == LORA_Q || t == LORA_V) ? 8 : 0, 1.0);
    lora_adapter_free(a);
    /* no target_modules: peft's default for these architectures is q_proj, v_proj */
    write_cfg("\"r\": 8, \"lora_alpha\": 8");
    a = load_ok();
    check_mod(a, 1, LORA_V, 8, 1.0);
    check_mod(a, 1, LORA_K, 0, 0);
    lora_adapter_free(a);
    /* full module names also match, as do dotted suffixes */
    write_cfg("\"r\": 8, \"lora_alpha\": 8, \"target_modules\": [\"self_attn.q_proj\", \"model.layers.0.self_attn.v_proj\", "
              "\"model.layers.1.self_attn.v_proj\", \"layers.2.self_attn.v_proj\"]");
    a = load_ok();
    check_mod(a, 2, LORA_V, 8, 1.0);
    lora_adapter_free(a);
}
END_TEST

START_TEST(test_target_regex_and_all_linear) {
    tb_t b = { 0 };
    for (int l = 0; l < N_LAYERS; l += 2) {
        tb_lora(&b, l, LORA_Q, 8, CS_DTYPE_F32);
        tb_lora(&b, l, LORA_K, 8, CS_DTYPE_F32);
    }
    tb_write(&b, "adapter_model.safetensors");
    /* a string is re.fullmatch'ed against each module name */
    write_cfg("\"r\": 8, \"lora_alpha\": 16, \"target_modules\": \".*\\\\.layers\\\\.[02]\\\\.self_attn\\\\.(q|k)_proj\"");
    lora_adapter_t *a = load_ok();
    for (int l = 0; l < N_LAYERS; l++)
        for (int t = 0; t < LORA_N_TARGETS; t++)
            check_mod(a, l, t, (l != 1 && (t == LORA_Q || t == LORA_K)) ? 8 : 0, 2.0);
    lora_adapter_free(a);
    /* fullmatch, not search: a suffix alone matches nothing */
    write_cfg("\"r\": 8, \"lora_alpha\": 16, \"target_modules\": \"q_proj\"");
    load_fail(CS_EFORMAT, "matches no projection");

    write_all_targets(8);
    write_cfg("\"r\": 8, \"lora_alpha\": 16, \"target_modules\": \"ALL-LINEAR\"");
    a = load_ok();
    for (int t = 0; t < LORA_N_TARGETS; t++) check_mod(a, 1, t, 8, 2.0);
    lora_adapter_free(a);
}
END_TEST

START_TEST(test_layers_to_transform) {
    tb_t b = { 0 };
    for (int t = 0; t < LORA_N_TARGETS; t++) tb_lora(&b, 1, t, 8, CS_DTYPE_F32);
    tb_write(&b, "adapter_model.safetensors");
    write_cfg("\"r\": 8, \"lora_alpha\": 16, \"target_modules\": " ALL_TARGETS ", \"layers_to_transform\": [1]");
    lora_adapter_t *a = load_ok();
    for (int l = 0; l < N_LAYERS; l++) check_mod(a, l, LORA_O, l == 1 ? 8 : 0, 2.0);
    lora_adapter_free(a);
    write_cfg("\"r\": 8, \"lora_alpha\": 16, \"target_modules\": " ALL_TARGETS ", \"layers_to_transform\": 1, "
              "\"layers_pattern\": \"layers\"");
    a = load_ok();
    check_mod(a, 1, LORA_DOWN, 8, 2.0);
    check_mod(a, 0, LORA_DOWN, 0, 0);
    lora_adapter_free(a);
    write_cfg("\"r\": 8, \"lora_alpha\": 16, \"target_modules\": " ALL_TARGETS ", \"layers_to_transform\": [1], "
              "\"layers_pattern\": [\"h\", \"layers\"]");
    a = load_ok();
    check_mod(a, 1, LORA_GATE, 8, 2.0);
    lora_adapter_free(a);
    write_cfg("\"r\": 8, \"lora_alpha\": 16, \"target_modules\": " ALL_TARGETS ", \"layers_to_transform\": [1], "
              "\"layers_pattern\": \"h\"");
    load_fail(CS_EFORMAT, "matches no projection");
    write_cfg("\"r\": 8, \"lora_alpha\": 16, \"target_modules\": \".*proj\", \"layers_to_transform\": [1]");
    load_fail(CS_EFORMAT, "layers_to_transform");
    write_cfg("\"r\": 8, \"lora_alpha\": 16, \"target_modules\": \"all-linear\", \"layers_to_transform\": [1]");
    load_fail(CS_EFORMAT, "layers_to_transform");
    write_cfg("\"r\": 8, \"lora_alpha\": 16, \"target_modules\": " ALL_TARGETS ", \"layers_pattern\": \"layers\"");
    load_fail(CS_EFORMAT, "layers_pattern");
    /* layers 0 and 2 are targeted but absent from the file */
    write_cfg("\"r\": 8, \"lora_alpha\": 16, \"target_modules\": " ALL_TARGETS ", \"layers_to_transform\": [0, 1]");
    load_fail(CS_ENOTFOUND, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight");
}
END_TEST

START_TEST(test_exclude_modules) {
    tb_t b = { 0 };
    for (int l = 0; l < N_LAYERS; l++)
        for (int t = 0; t < LORA_N_TARGETS; t++)
            if (t != LORA_DOWN && !(l == 0 && t == LORA_Q)) tb_lora(&b, l, t, 8, CS_DTYPE_F32);
    tb_write(&b, "adapter_model.safetensors");
    write_cfg("\"r\": 8, \"lora_alpha\": 16, \"target_modules\": \"all-linear\", "
              "\"exclude_modules\": [\"down_proj\", \"model.layers.0.self_attn.q_proj\"]");
    lora_adapter_t *a = load_ok();
    check_mod(a, 0, LORA_Q, 0, 0);
    check_mod(a, 1, LORA_Q, 8, 2.0);
    for (int l = 0; l < N_LAYERS; l++) check_mod(a, l, LORA_DOWN, 0, 0);
    lora_adapter_free(a);
    tb_all(&b, 0x0fu, 8, CS_DTYPE_F32);
    tb_write(&b, "adapter_model.safetensors");
    write_cfg("\"r\": 8, \"lora_alpha\": 16, \"target_modules\": " ALL_TARGETS ", \"exclude_modules\": \".*mlp.*\"");
    a = load_ok();
    check_mod(a, 2, LORA_GATE, 0, 0);
    check_mod(a, 2, LORA_O, 8, 2.0);
    lora_adapter_free(a);
}
END_TEST

START_TEST(test_config_refusals) {
    write_all_targets(8);
    static const struct { const char *extra; int rc; const char *needle; } cases[] = {
        { "\"use_dora\": true", CS_EUNSUPPORTED, "DoRA" },
        { "\"modules_to_save\": [\"lm_head\"]", CS_EUNSUPPORTED, "modules_to_save" },
        { "\"bias\": \"all\"", CS_EUNSUPPORTED, "bias" },
        { "\"bias\": \"lora_only\"", CS_EUNSUPPORTED, "lora_only" },
        { "\"fan_in_fan_out\": true", CS_EUNSUPPORTED, "fan_in_fan_out" },
        { "\"lora_bias\": true", CS_EUNSUPPORTED, "lora_bias" },
        { "\"use_qalora\": true", CS_EUNSUPPORTED, "use_qalora" },
        { "\"alora_invocation_tokens\": [1, 2]", CS_EUNSUPPORTED, "alora_invocation_tokens" },
        { "\"velora_config\": {}", CS_EUNSUPPORTED, "velora_config" },
        { "\"use_bdlora\": {\"nblocks\": 2}", CS_EUNSUPPORTED, "use_bdlora" },
        { "\"kasa_config\": {}", CS_EUNSUPPORTED, "kasa_config" },
        { "\"layer_replication\": [[0, 2]]", CS_EUNSUPPORTED, "layer_replication" },
        { "\"trainable_token_indices\": [5]", CS_EUNSUPPORTED, "trainable_token_indices" },
        { "\"target_parameters\": [\"mlp.experts.down_proj\"]", CS_EUNSUPPORTED, "target_parameters" },
        { "\"init_lora_weights\": \"pissa_niter_4\"", CS_EUNSUPPORTED, "pissa" },
        { "\"init_lora_weights\": \"olora\"", CS_EUNSUPPORTED, "olora" },
        { "\"init_lora_weights\": \"mica\"", CS_EUNSUPPORTED, "mica" },
        { "\"r\": 0", CS_EFORMAT, "'r'" },
        { "\"r\": 2.5", CS_EFORMAT, "'r'" },
        { "\"lora_alpha\": \"16\"", CS_EFORMAT, "lora_alpha" },
        { "\"rank_pattern\": {\"q_proj\": 0}", CS_EFORMAT, "rank_pattern" },
        { "\"rank_pattern\": {\"(q_proj\": 4}", CS_EFORMAT, "rank_pattern" },
        { "\"alpha_pattern\": [1]", CS_EFORMAT, "alpha_pattern" },
        { "\"exclude_modules\": 5", CS_EFORMAT, "exclude_modules" },
    };
    for (size_t i = 0; i < CS_ARRAY_LEN(cases); i++) {
        char extra[512];
        snprintf(extra, sizeof extra, "\"r\": 8, \"lora_alpha\": 16, \"target_modules\": " ALL_TARGETS ", %s", cases[i].extra);
        write_cfg(extra);   /* a repeated key (r, bias, ...) overrides: the last wins, as in Python */
        load_fail(cases[i].rc, cases[i].needle);
    }
    /* target_modules naming lm_head, embed_tokens, a norm, or nothing linear; configs that are
     * not LoRA or not JSON */
    static const struct { const char *targets, *config; int rc; const char *needle; } bad[] = {
        { "[\"q_proj\", \"lm_head\"]", NULL, CS_EUNSUPPORTED, "lm_head" },
        { "[\"embed_tokens\", \"v_proj\"]", NULL, CS_EUNSUPPORTED, "embed_tokens" },
        { "[\"q_proj\", \"input_layernorm\"]", NULL, CS_EUNSUPPORTED, "input_layernorm" },
        { "\".*\"", NULL, CS_EUNSUPPORTED, "not a linear projection" },
        { "[\"c_attn\"]", NULL, CS_EFORMAT, "matches no projection" },
        { "5", NULL, CS_EFORMAT, "target_modules" },
        { "\"(\"", NULL, CS_EFORMAT, "regex" },
        { NULL, "{\"peft_type\": \"IA3\", \"target_modules\": [\"q_proj\"]}", CS_EUNSUPPORTED, "IA3" },
        { NULL, "{\"r\": 8}", CS_EFORMAT, "peft_type" },
        { NULL, "{\"peft_type\": \"LORA\", ", CS_EFORMAT, "adapter_config.json" },
    };
    for (size_t i = 0; i < CS_ARRAY_LEN(bad); i++) {
        if (bad[i].targets) {
            char extra[512];
            snprintf(extra, sizeof extra, "\"r\": 8, \"lora_alpha\": 16, \"target_modules\": %s", bad[i].targets);
            write_cfg(extra);
        } else {
            write_file("adapter_config.json", bad[i].config);
        }
        load_fail(bad[i].rc, bad[i].needle);
    }
    /* options that do not change the math are accepted */
    write_cfg("\"r\": 8, \"lora_alpha\": 16, \"target_modules\": " ALL_TARGETS ", \"modules_to_save\": [], "
              "\"init_lora_weights\": \"gaussian\", \"loftq_config\": {}, \"megatron_config\": null, "
              "\"use_dora\": false, \"lora_bias\": false, \"layers_pattern\": \"\", \"exclude_modules\": [], "
              "\"some_future_key\": 1");
    lora_adapter_free(load_ok());
}
END_TEST

START_TEST(test_refused_tensors) {
    write_cfg("\"r\": 8, \"lora_alpha\": 16, \"target_modules\": [\"q_proj\"]");
    /* the file: the targets in mask of every layer, and one more tensor [d0, d1] unless NULL;
     * what the load is refused with */
    static const struct {
        unsigned mask;
        const char *extra;
        int64_t d0, d1;
        int rc;
        const char *needle;
    } cases[] = {
        { 1u << LORA_Q, "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", 1, 64,
          CS_EUNSUPPORTED, "DoRA" },
        { 1u << LORA_Q, "base_model.model.model.embed_tokens.lora_embedding_A", 8, 100, CS_EUNSUPPORTED,
          "embeddings" },
        { 1u << LORA_Q, "base_model.model.lm_head.weight", 100, 64, CS_EUNSUPPORTED,
          "'base_model.model.lm_head.weight'" },
        { 1u << LORA_Q, "base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias", 1, 64, CS_EUNSUPPORTED,
          "lora_bias" },
        /* tensors of a module the config does not target, or of a layer the model lacks */
        { (1u << LORA_Q) | (1u << LORA_K), NULL, 0, 0, CS_EFORMAT,
          "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight" },
        { 1u << LORA_Q, "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight", 8, 64, CS_EFORMAT,
          "fewer layers" },
        /* adapter-name-qualified keys are not what peft saves */
        { 0, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", 8, 64, CS_EUNSUPPORTED,
          "lora_A.default.weight" },
    };
    for (size_t i = 0; i < CS_ARRAY_LEN(cases); i++) {
        tb_t b = { 0 };
        tb_all(&b, cases[i].mask, 8, CS_DTYPE_F32);
        if (cases[i].extra) tb_add(&b, cases[i].extra, CS_DTYPE_F32, cases[i].d0, cases[i].d1, 0);
        tb_write(&b, "adapter_model.safetensors");
        load_fail(cases[i].rc, cases[i].needle);
    }
}
END_TEST

START_TEST(test_wrong_shapes) {
    write_cfg("\"r\": 8, \"lora_alpha\": 16, \"target_modules\": [\"q_proj\", \"k_proj\"]");
    tb_t b = { 0 };
    /* k_proj of one layer in a wrong shape, the other tensors right: layer, A and B shapes,
     * part of the message */
    static const struct {
        int layer;
        int64_t a[2], b[2];
        const char *msg;
    } bad_k[] = {
        /* k_proj of layer 1 built for a model with hidden 32 */
        {1, {8, 32}, {32, 8},
         "tensor 'base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight': expected [8, 64], got [8, 32]"},
        /* B too wide for k (out 32) */
        {2, {8, 64}, {64, 8}, "expected [32, 8], got [64, 8]"},
    };
    for (size_t i = 0; i < CS_ARRAY_LEN(bad_k); i++) {
        for (int l = 0; l < N_LAYERS; l++) {
            tb_lora(&b, l, LORA_Q, 8, CS_DTYPE_F32);
            if (l != bad_k[i].layer) tb_lora(&b, l, LORA_K, 8, CS_DTYPE_F32);
        }
        char n[160];
        tensor_name(n, sizeof n, bad_k[i].layer, LORA_K, 'A');
        tb_add(&b, n, CS_DTYPE_F32, bad_k[i].a[0], bad_k[i].a[1], 0);
        tensor_name(n, sizeof n, bad_k[i].layer, LORA_K, 'B');
        tb_add(&b, n, CS_DTYPE_F32, bad_k[i].b[0], bad_k[i].b[1], 0);
        tb_write(&b, "adapter_model.safetensors");
        load_fail(CS_ESHAPE, bad_k[i].msg);
    }

    /* rank in the file differs from adapter_config.json */
    tb_all(&b, (1u << LORA_Q) | (1u << LORA_K), 4, CS_DTYPE_F32);
    tb_write(&b, "adapter_model.safetensors");
    load_fail(CS_ESHAPE, "expected [8, 64], got [4, 64]");

    /* A and B disagree on the rank */
    for (int l = 0; l < N_LAYERS; l++) tb_lora(&b, l, LORA_K, 8, CS_DTYPE_F32);
    for (int l = 0; l < N_LAYERS; l++) {
        char n[160];
        tensor_name(n, sizeof n, l, LORA_Q, 'A');
        tb_add(&b, n, CS_DTYPE_F32, 8, 64, 0);
        tensor_name(n, sizeof n, l, LORA_Q, 'B');
        tb_add(&b, n, CS_DTYPE_F32, 64, 4, 0);
    }
    tb_write(&b, "adapter_model.safetensors");
    load_fail(CS_ESHAPE, "expected [64, 8], got [64, 4]");
}
END_TEST

START_TEST(test_missing_tensor) {
    write_cfg("\"r\": 8, \"lora_alpha\": 16, \"target_modules\": " ALL_TARGETS);
    tb_t b = { 0 };
    for (int l = 0; l < N_LAYERS; l++)
        for (int t = 0; t < LORA_N_TARGETS; t++) {
            if (l == 2 && t == LORA_V) {
                char n[160];
                tensor_name(n, sizeof n, l, t, 'A');
                tb_add(&b, n, CS_DTYPE_F32, 8, 64, 0);
                continue;
            }
            tb_lora(&b, l, t, 8, CS_DTYPE_F32);
        }
    tb_write(&b, "adapter_model.safetensors");
    load_fail(CS_ENOTFOUND, "missing tensor 'base_model.model.model.layers.2.self_attn.v_proj.lora_B.weight'");
}
END_TEST

START_TEST(test_dtypes) {
    write_cfg("\"r\": 8, \"lora_alpha\": 16, \"target_modules\": " ALL_TARGETS);
    static const cs_dtype dts[] = { CS_DTYPE_BF16, CS_DTYPE_F16 };
    for (size_t i = 0; i < 2; i++) {
        tb_t b = { 0 };
        tb_all(&b, ALL_MASK, 8, dts[i]);
        tb_write(&b, "adapter_model.safetensors");
        lora_adapter_t *a = load_ok();
        /* BF16 stays BF16 (half the bytes); F16 is widened to F32 */
        cs_dtype held = dts[i] == CS_DTYPE_BF16 ? CS_DTYPE_BF16 : CS_DTYPE_F32;
        size_t want = 0;
        for (int l = 0; l < N_LAYERS; l++)
            for (int t = 0; t < LORA_N_TARGETS; t++) {
                check_mod(a, l, t, 8, 2.0);
                const lora_module_t *m = lora_adapter_module(a, l, (lora_target)t);
                ck_assert_int_eq(m->dtype, held);
                want += (size_t)8 * (m->d_in + 2 * m->d_out) * cs_dtype_size(held);
                for (int o = 0; o < m->d_out; o++)
                    for (int r = 0; r < 8; r++)
                        ck_assert(lora_module_at(m, m->bt, (size_t)r * m->d_out + o) ==
                                  lora_module_at(m, m->b, (size_t)o * 8 + r));
            }
        ck_assert_uint_eq(a->nbytes, want);
        size_t bound = 0; /* what a cache reserves before reading the weights: the F32 bytes */
        char *cfg_text = read_cfg();
        ck_assert_int_eq(lora_adapter_config_nbytes(dir, cfg_text, strlen(cfg_text), &base, &bound), CS_OK);
        free(cfg_text);
        ck_assert_uint_eq(bound, held == CS_DTYPE_BF16 ? 2 * want : want);
        lora_adapter_free(a);
    }
    { /* A in BF16, B in F32: the module is held in F32 */
        tb_t b = { 0 };
        tb_lora(&b, 0, LORA_Q, 8, CS_DTYPE_BF16);
        b.t[1].dtype = CS_DTYPE_F32;
        float *bf = calloc((size_t)b.t[1].shape[0] * b.t[1].shape[1], sizeof(float));
        for (size_t i = 0; i < (size_t)b.t[1].shape[0] * b.t[1].shape[1]; i++) bf[i] = val(seed_of(0, LORA_Q, 1), i);
        b.t[1].data = bf;
        write_cfg("\"r\": 8, \"lora_alpha\": 16, \"target_modules\": [\"q_proj\"], \"layers_to_transform\": [0]");
        tb_write(&b, "adapter_model.safetensors");
        free(bf);
        lora_adapter_t *a = load_ok();
        ck_assert_int_eq(lora_adapter_module(a, 0, LORA_Q)->dtype, CS_DTYPE_F32);
        check_mod(a, 0, LORA_Q, 8, 2.0);
        lora_adapter_free(a);
        write_cfg("\"r\": 8, \"lora_alpha\": 16, \"target_modules\": " ALL_TARGETS);
    }
    tb_t b = { 0 };
    tb_all(&b, ALL_MASK, 8, CS_DTYPE_F32);
    b.t[3].dtype = CS_DTYPE_F64;   /* same element count, twice the bytes */
    void *big = calloc((size_t)b.t[3].shape[0] * b.t[3].shape[1], 8);
    b.t[3].data = big;
    tb_write(&b, "adapter_model.safetensors");
    free(big);
    load_fail(CS_EUNSUPPORTED, "F64");
}
END_TEST

START_TEST(test_sharded_and_files) {
    write_cfg("\"r\": 8, \"lora_alpha\": 16, \"target_modules\": [\"q_proj\", \"v_proj\"]");
    lora_adapter_t *a;
    /* neither safetensors file */
    load_fail(CS_ENOTFOUND, "adapter_model.safetensors");
    write_file("adapter_model.bin", "PK");
    load_fail(CS_EUNSUPPORTED, "adapter_model.bin");
    tb_t b = { 0 };
    for (int l = 0; l < N_LAYERS; l++) tb_lora(&b, l, LORA_Q, 8, CS_DTYPE_BF16);
    tb_write(&b, "adapter_model-00001-of-00002.safetensors");
    for (int l = 0; l < N_LAYERS; l++) tb_lora(&b, l, LORA_V, 8, CS_DTYPE_F32);
    tb_write(&b, "adapter_model-00002-of-00002.safetensors");
    char idx[4096] = "{\"metadata\": {}, \"weight_map\": {";
    for (int l = 0; l < N_LAYERS; l++)
        for (int t = 0; t < LORA_N_TARGETS; t += 2)
            for (char ab = 'A'; ab <= 'B'; ab++) {
                if (t != LORA_Q && t != LORA_V) continue;
                char n[160], e[300];
                tensor_name(n, sizeof n, l, t, ab);
                snprintf(e, sizeof e, "%s\"%s\": \"adapter_model-0000%d-of-00002.safetensors\"",
                         idx[strlen(idx) - 1] == '{' ? "" : ", ", n, t == LORA_Q ? 1 : 2);
                strcat(idx, e);
            }
    strcat(idx, "}}");
    write_file("adapter_model.safetensors.index.json", idx);
    a = load_ok();
    check_mod(a, 2, LORA_Q, 8, 2.0);
    check_mod(a, 2, LORA_V, 8, 2.0);
    lora_adapter_free(a);
    /* no adapter_config.json */
    char p[512];
    snprintf(p, sizeof p, "%s/adapter_config.json", dir);
    unlink(p);
    load_fail(CS_ENOTFOUND, "adapter_config.json");
    load_fail(CS_ENOTFOUND, dir);
}
END_TEST

/* ---- lora/assist.h ---- */
static void plain_term(float *y, const float *x, int n, int ld, const lora_module_t *m) {
    for (int i = 0; i < n; i++)
        for (int o = 0; o < m->d_out; o++) {
            double acc = 0;
            for (int r = 0; r < m->rank; r++) {
                double t = 0;
                for (int k = 0; k < m->d_in; k++)
                    t += (double)x[(size_t)i * ld + k] * lora_module_at(m, m->a, (size_t)r * m->d_in + k);
                acc += t * lora_module_at(m, m->b, (size_t)o * m->rank + r);
            }
            y[(size_t)i * m->d_out + o] = (float)(m->scale * acc);
        }
}

static lora_module_t make_mod(int rank, int din, int dout, cs_dtype dt, unsigned seed) {
    lora_module_t m = {rank, din, dout, 0.75f, dt, NULL, NULL, NULL};
    size_t es = cs_dtype_size(dt);
    m.a = cs_aligned_alloc(64, es * (size_t)rank * din);
    m.b = cs_aligned_alloc(64, es * (size_t)rank * dout);
    for (size_t i = 0; i < (size_t)rank * din + (size_t)rank * dout; i++) {
        seed = seed * 1103515245u + 12345u;
        float v = ((float)(seed >> 8 & 0xffff) / 65536.0f - 0.5f);
        bool in_a = i < (size_t)rank * din;
        size_t j = in_a ? i : i - (size_t)rank * din;
        void *w = in_a ? m.a : m.b;
        if (dt == CS_DTYPE_BF16) ((uint16_t *)w)[j] = cs_f32_to_bf16(v);
        else ((float *)w)[j] = v;
    }
    return m;
}

START_TEST(test_assist_term) {
    const cs_dtype dts[2] = {CS_DTYPE_F32, CS_DTYPE_BF16};
    for (int d = 0; d < 2; d++) {
        lora_module_t m = make_mod(8, 40, 24, dts[d], 7u + (unsigned)d);
        int n = 5, ld = 48; /* rows of a wider activation buffer */
        float x[5 * 48], y[5 * 24], want[5 * 24];
        for (int i = 0; i < n * ld; i++) x[i] = (float)((i * 37) % 101) / 50.0f - 1.0f;
        float *scratch = malloc(sizeof(float) * (size_t)m.rank * (n + m.d_in + m.d_out));
        lora_assist_term(y, x, n, ld, &m, scratch);
        plain_term(want, x, n, ld, &m);
        for (int i = 0; i < n * m.d_out; i++)
            ck_assert_msg(fabsf(y[i] - want[i]) <= 1e-5f * (1.0f + fabsf(want[i])), "%s term %d: %g vs %g",
                          cs_dtype_name(dts[d]), i, y[i], want[i]);
        free(scratch);
        free(m.a);
        free(m.b);
    }
}
END_TEST

/* the pool: jobs queued before their flag is raised wait for it; each part adds one to done */
START_TEST(test_assist_pool) {
    lora_assist_t *a;
    ck_assert_int_eq(lora_assist_new(&(lora_assist_params_t){.n_threads = 3, .max_rows = 4}, &a), CS_OK);
    lora_module_t q = make_mod(4, 32, 16, CS_DTYPE_F32, 3), v = make_mod(16, 32, 8, CS_DTYPE_BF16, 5);
    enum { N = 11 };
    static float x[N * 32], yq[N * 16], yv[N * 8], wq[N * 16], wv[N * 8];
    for (int i = 0; i < N * 32; i++) x[i] = (float)((i * 13) % 29) / 14.0f - 1.0f;
    uint32_t xflag = 0, done = 0;
    lora_assist_job_t j = {.x = x, .n = N, .ld_x = 32, .n_mods = 2, .mods = {&q, &v}, .y = {yq, yv},
                           .x_flag = &xflag, .x_value = 1, .done = &done};
    int parts = lora_assist_submit(a, &j);
    ck_assert_int_eq(parts, 3); /* 11 rows, at most 4 a part */
    ck_assert_uint_eq(cs_flag_load(&done), 0); /* nobody starts before the flag */
    cs_flag_store(&xflag, 1);
    cs_flag_wait_geq(&done, (uint32_t)parts);
    plain_term(wq, x, N, 32, &q);
    plain_term(wv, x, N, 32, &v);
    for (int i = 0; i < N * 16; i++) ck_assert(fabsf(yq[i] - wq[i]) <= 1e-5f * (1.0f + fabsf(wq[i])));
    for (int i = 0; i < N * 8; i++) ck_assert(fabsf(yv[i] - wv[i]) <= 1e-5f * (1.0f + fabsf(wv[i])));
    lora_assist_stats_t st;
    lora_assist_get_stats(a, &st);
    ck_assert_uint_eq(st.jobs, 1);
    ck_assert_uint_eq(st.parts, 3);
    ck_assert_uint_eq(st.rows, 2 * N);
    /* BF16 terms: the F32 terms rounded to nearest even, each part's rows in place */
    static uint16_t hq[N * 16], hv[N * 8];
    lora_assist_job_t jb = {.x = x, .n = N, .ld_x = 32, .n_mods = 2, .mods = {&q, &v}, .y = {hq, hv},
                            .y_dtype = CS_DTYPE_BF16, .x_flag = &xflag, .x_value = 1, .done = &done};
    parts = lora_assist_submit(a, &jb);
    cs_flag_wait_geq(&done, 3 + (uint32_t)parts);
    for (int i = 0; i < N * 16; i++) ck_assert_uint_eq(hq[i], cs_f32_to_bf16(yq[i]));
    for (int i = 0; i < N * 8; i++) ck_assert_uint_eq(hv[i], cs_f32_to_bf16(yv[i]));
    lora_assist_free(a);
    free(q.a), free(q.b), free(v.a), free(v.b);
}
END_TEST

/* The cold start's byte model on a table of ranks and prompt lengths, on Llama-2-7B's shapes
 * (H 4096, 32 heads of 128, I 11008; 4 layers of 32 stand in, the totals scale): the bytes
 * each way against sums written out here, and the choice: cpu-assist while the rows' inputs
 * and terms cost the link fewer bytes than the rest of the adapter, wait after. At rank 64
 * on all 7 projections (F32, as peft saves it) a layer's slot is 20.0 MB and a row costs
 * 263.2 KB with F32 terms, 178.2 KB with BF16 ones: the crossover is at 75.95 and 112.18
 * rows; rank 16 on q and v alone: 1.05 MB a layer, 32.8 KB a row with BF16 terms, 32 rows. */
START_TEST(test_cold_cost) {
    enum { L = 4, H = 4096, KV = 4096, I = 11008 };
    static const int din[LORA_N_TARGETS] = {H, H, H, H, H, H, I}, dout[LORA_N_TARGETS] = {H, KV, KV, H, I, I, H};
    static const struct { int rank; cs_dtype dt; bool qv_only; int arrived, rows; cs_dtype terms; bool assist; } table[] = {
        {64, CS_DTYPE_F32, false, 0, 1, CS_DTYPE_F32, true},
        {64, CS_DTYPE_F32, false, 0, 75, CS_DTYPE_F32, true},
        {64, CS_DTYPE_F32, false, 0, 76, CS_DTYPE_F32, false},
        {64, CS_DTYPE_F32, false, 0, 112, CS_DTYPE_BF16, true},
        {64, CS_DTYPE_F32, false, 0, 113, CS_DTYPE_BF16, false},
        {64, CS_DTYPE_F32, false, 0, 2048, CS_DTYPE_BF16, false},
        {64, CS_DTYPE_F32, false, 3, 76, CS_DTYPE_F32, false}, /* one layer left: the same per layer */
        {8, CS_DTYPE_BF16, false, 0, 4, CS_DTYPE_F32, true},
        {8, CS_DTYPE_BF16, false, 0, 5, CS_DTYPE_F32, false},
        {16, CS_DTYPE_BF16, false, 0, 14, CS_DTYPE_BF16, true},
        {16, CS_DTYPE_BF16, false, 0, 15, CS_DTYPE_BF16, false},
        {16, CS_DTYPE_F32, true, 0, 32, CS_DTYPE_BF16, true},  /* q and v only: one input group */
        {16, CS_DTYPE_F32, true, 0, 33, CS_DTYPE_BF16, false},
        {16, CS_DTYPE_F32, true, 0, 2048, CS_DTYPE_F32, false},
        {64, CS_DTYPE_F32, false, L, 2048, CS_DTYPE_F32, true}, /* all there: nothing either way */
    };
    lora_module_t mods[L * LORA_N_TARGETS];
    lora_adapter_t a = {.n_layers = L, .mods = mods};
    for (size_t k = 0; k < CS_ARRAY_LEN(table); k++) {
        uint64_t want_wait = 0, want_assist = 0;
        size_t es = cs_dtype_size(table[k].dt), ts = cs_dtype_size(table[k].terms);
        for (int l = 0; l < L; l++) {
            for (int t = 0; t < LORA_N_TARGETS; t++) {
                bool on = !table[k].qv_only || t == LORA_Q || t == LORA_V;
                mods[l * LORA_N_TARGETS + t] = (lora_module_t){on ? table[k].rank : 0, din[t], dout[t], 1.0f,
                                                               table[k].dt, NULL, NULL, NULL};
                if (!on || l < table[k].arrived) continue;
                want_wait += (uint64_t)table[k].rank * (din[t] + dout[t]) * es;
                want_assist += (uint64_t)table[k].rows * dout[t] * ts;
            }
            if (l < table[k].arrived) continue;
            /* inputs out: q/k/v's (H), o's (H), gate/up's (H), down's (I), each once */
            uint64_t in = table[k].qv_only ? H : (uint64_t)H + H + H + I;
            want_assist += (uint64_t)table[k].rows * in * 4;
        }
        lora_cold_cost_t c;
        lora_cold_cost(&a, table[k].arrived, table[k].rows, table[k].terms, &c);
        ck_assert_msg(c.wait_bytes == want_wait && c.assist_bytes == want_assist,
                      "row %zu: wait %llu assist %llu, want %llu %llu", k, (unsigned long long)c.wait_bytes,
                      (unsigned long long)c.assist_bytes, (unsigned long long)want_wait, (unsigned long long)want_assist);
        ck_assert_msg(lora_cold_prefer_assist(&c) == table[k].assist, "row %zu (rank %d, %d rows): %s", k,
                      table[k].rank, table[k].rows, lora_cold_prefer_assist(&c) ? "cpu-assist" : "wait");
    }
}
END_TEST

int main(void) {
    Suite *s = suite_create("peft");
    const TTest *const core[] = {
        test_target_dims, test_all_targets, test_rslora, test_rank_alpha_pattern, test_partial_targets,
        test_target_regex_and_all_linear, test_layers_to_transform, test_exclude_modules,
        test_config_refusals, test_refused_tensors, test_wrong_shapes, test_missing_tensor, test_dtypes,
        test_sharded_and_files,
    };
    cs_tcase_fixture(s, "core", core, CS_ARRAY_LEN(core), 0, setup, teardown);
    const TTest *const assist[] = {test_assist_term, test_assist_pool, test_cold_cost};
    cs_tcase(s, "assist", assist, CS_ARRAY_LEN(assist), 0);
    return cs_check_run(s, CK_FORK) ? EXIT_FAILURE : EXIT_SUCCESS;
}
