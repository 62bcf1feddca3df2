/* mkmodel.c: caraserve-mkmodel writes small Hugging Face model directories (config.json in
 * the exact form transformers 5.23 saves, generation_config.json, model.safetensors or
 * shards + index) and PEFT LoRA adapters (adapter_config.json as peft 0.21 saves it,
 * adapter_model.safetensors), with seeded random weights, for tests and the demo.
 * `inspect` prints what caraserve's own loaders make of a model / adapter, as JSON. */
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/common.h"
#include "base/model_config.h"
#include "base/safetensors.h"
#include "lora/peft.h"

#define TRANSFORMERS_VERSION "5.23.0"
#define PEFT_VERSION "0.21.2"

static const char *prog = "caraserve-mkmodel";

static void usage(FILE *f) {
    fprintf(f,
        "usage: %s model --out DIR [options]     write a random HF model directory\n"
        "       %s adapter --model DIR --out DIR [options]  write a random PEFT LoRA adapter\n"
        "       %s inspect --model DIR [--adapter DIR]      print what caraserve loads, as JSON\n"
        "\n"
        "model options:\n"
        "  --arch llama|mistral|qwen2|qwen3   (llama)\n"
        "  --hidden N (1024)  --layers N (12)  --heads N (16)  --kv-heads N (= heads)\n"
        "  --head-dim N (hidden/heads)  --intermediate N (2816)  --vocab N (32000, or the tokenizer's)\n"
        "  --dtype f32|bf16|f16 (f32)  --tied  --seed N (0)  --init-std X (0.02)\n"
        "  --tokenizer DIR      copy tokenizer.json, tokenizer_config.json, special_tokens_map.json\n"
        "  --rope-theta X (10000)  --rope-scaling llama3:FACTOR:LOW:HIGH:ORIGMAX | linear:FACTOR\n"
        "  --max-pos N (4096)  --rms-eps X (1e-6)  --shards N (1: model.safetensors)\n"
        "adapter options:\n"
        "  --rank N (8)  --alpha X (16)  --targets q,k,v,o,gate,up,down (all)  --rslora\n"
        "  --seed N (0)  --dtype f32|bf16|f16 (f32)  --std X (0.02)\n",
        prog, prog, prog);
}

static int fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: ", prog);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return 1;
}

static bool parse_long(const char *s, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return false;
    *out = v;
    return true;
}

static bool parse_double(const char *s, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v)) return false;
    *out = v;
    return true;
}

static int parse_dtype(const char *s, cs_dtype *out) {
    if (!strcmp(s, "f32")) *out = CS_DTYPE_F32;
    else if (!strcmp(s, "bf16")) *out = CS_DTYPE_BF16;
    else if (!strcmp(s, "f16")) *out = CS_DTYPE_F16;
    else return -1;
    return 0;
}

static const char *torch_dtype_name(cs_dtype t) {
    return t == CS_DTYPE_BF16 ? "bfloat16" : t == CS_DTYPE_F16 ? "float16" : "float32";
}

static int mkdir_p(const char *path) {
    char buf[PATH_MAX];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf) return -1;
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(buf, 0755) != 0 && errno != EEXIST) return -1;
        *p = '/';
    }
    if (mkdir(buf, 0755) != 0 && errno != EEXIST) return -1;
    return 0;
}

/* ---- seeded PRNG: splitmix64 seeds xoshiro256**, Box-Muller for normals ---- */

typedef struct rng { uint64_t s[4]; bool has_spare; double spare; } rng_t;

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t fnv1a(const char *s) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
    return h;
}

/* one independent stream per tensor name, so values do not depend on order or sharding */
static void rng_seed(rng_t *r, uint64_t seed, const char *name) {
    uint64_t x = seed ^ fnv1a(name);
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&x);
    r->has_spare = false;
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t rng_next(rng_t *r) {
    uint64_t *s = r->s, res = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0]; s[3] ^= s[1]; s[1] ^= s[2]; s[0] ^= s[3]; s[2] ^= t; s[3] = rotl(s[3], 45);
    return res;
}

static double rng_uniform(rng_t *r) { return ((rng_next(r) >> 11) + 0.5) * 0x1.0p-53; } /* (0,1) */

static double rng_normal(rng_t *r) {
    if (r->has_spare) { r->has_spare = false; return r->spare; }
    double u = rng_uniform(r), v = rng_uniform(r), m = sqrt(-2.0 * log(u));
    r->spare = m * sin(2 * M_PI * v);
    r->has_spare = true;
    return m * cos(2 * M_PI * v);
}

/* ---- tensor lists ---- */

enum init_kind { INIT_NORMAL, INIT_NORM_WEIGHT, INIT_BIAS };

typedef struct gen_tensor {
    char name[160];
    int n_dims;
    int64_t shape[2];
    enum init_kind kind;
    double std;
} gen_tensor_t;

typedef struct gen_list {
    gen_tensor_t *t;
    size_t n, cap;
} gen_list_t;

static int gen_add(gen_list_t *l, enum init_kind kind, double std, int64_t d0, int64_t d1, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));
static int gen_add(gen_list_t *l, enum init_kind kind, double std, int64_t d0, int64_t d1, const char *fmt, ...) {
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 64;
        gen_tensor_t *t = realloc(l->t, cap * sizeof *t);
        if (!t) return -1;
        l->t = t;
        l->cap = cap;
    }
    gen_tensor_t *t = &l->t[l->n++];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t->name, sizeof t->name, fmt, ap);
    va_end(ap);
    t->kind = kind;
    t->std = std;
    t->shape[0] = d0;
    t->shape[1] = d1;
    t->n_dims = d1 > 0 ? 2 : 1;
    return 0;
}

static int gen_cmp(const void *a, const void *b) {
    return strcmp(((const gen_tensor_t *)a)->name, ((const gen_tensor_t *)b)->name);
}

typedef struct fill_ctx {
    const gen_tensor_t *t;     /* indexed by the writer's i through `map` */
    const size_t *map;
    cs_dtype dtype;
    uint64_t seed;
} fill_ctx_t;

static int fill_tensor(void *user, size_t i, void *buf, size_t nbytes) {
    const fill_ctx_t *c = user;
    const gen_tensor_t *t = &c->t[c->map ? c->map[i] : i];
    size_t n = nbytes / cs_dtype_size(c->dtype);
    rng_t r;
    rng_seed(&r, c->seed, t->name);
    for (size_t k = 0; k < n; k++) {
        double x = rng_normal(&r) * t->std;
        if (t->kind == INIT_NORM_WEIGHT) x += 1.0;
        float f = (float)x;
        switch (c->dtype) {
        case CS_DTYPE_F32: ((float *)buf)[k] = f; break;
        case CS_DTYPE_BF16: ((uint16_t *)buf)[k] = cs_f32_to_bf16(f); break;
        case CS_DTYPE_F16: ((uint16_t *)buf)[k] = cs_f32_to_f16(f); break;
        default: CS_ASSERT(!"fill_tensor: dtype");
        }
    }
    return CS_OK;
}

static void to_write(const gen_tensor_t *g, cs_dtype dt, st_write_tensor_t *w) {
    memset(w, 0, sizeof *w);
    w->name = g->name;
    w->dtype = dt;
    w->n_dims = g->n_dims;
    w->shape[0] = g->shape[0];
    w->shape[1] = g->shape[1];
}

static size_t gen_numel(const gen_tensor_t *g) {
    return (size_t)g->shape[0] * (g->n_dims == 2 ? (size_t)g->shape[1] : 1);
}

/* ---- JSON output ---- */

/* shortest of 15/17 significant digits that round-trips every real in the document */
static bool reals_roundtrip15(const json_t *v) {
    if (json_is_real(v)) {
        char buf[64];
        snprintf(buf, sizeof buf, "%.15g", json_real_value(v));
        return strtod(buf, NULL) == json_real_value(v);
    }
    const char *k;
    json_t *x;
    size_t i;
    if (json_is_object(v)) json_object_foreach((json_t *)v, k, x) if (!reals_roundtrip15(x)) return false;
    if (json_is_array(v)) json_array_foreach(v, i, x) if (!reals_roundtrip15(x)) return false;
    return true;
}

static int write_json(const char *dir, const char *name, json_t *doc) {
    char *path = cs_path_join(dir, name);
    size_t flags = JSON_INDENT(2) | JSON_SORT_KEYS | JSON_REAL_PRECISION(reals_roundtrip15(doc) ? 15 : 17);
    char *s = json_dumps(doc, flags);
    FILE *f = path ? fopen(path, "w") : NULL;
    int rc = 0;
    if (!s || !f || fputs(s, f) == EOF || fputc('\n', f) == EOF) rc = -1;
    if (f && fclose(f) != 0) rc = -1;
    if (rc) fail("%s: %s", path ? path : name, strerror(errno));
    free(s);
    free(path);
    return rc;
}

static int copy_file(const char *src, const char *dst) {
    size_t len;
    char *buf = cs_read_file(src, &len);
    if (!buf) return fail("%s", cs_error_last());
    FILE *f = fopen(dst, "wb");
    int rc = (!f || fwrite(buf, 1, len, f) != len) ? -1 : 0;
    if (f && fclose(f) != 0) rc = -1;
    free(buf);
    if (rc) return fail("%s: %s", dst, strerror(errno));
    return 0;
}

/* ---- tokenizer ---- */

static int token_id(json_t *tok, const char *content) {
    json_t *added = json_object_get(tok, "added_tokens"), *v;
    size_t i;
    json_array_foreach(added, i, v) {
        const char *c = json_string_value(json_object_get(v, "content"));
        if (c && !strcmp(c, content) && json_is_integer(json_object_get(v, "id")))
            return (int)json_integer_value(json_object_get(v, "id"));
    }
    json_t *id = json_object_get(json_object_get(json_object_get(tok, "model"), "vocab"), content);
    return json_is_integer(id) ? (int)json_integer_value(id) : -1;
}

/* vocab size (max id + 1) and bos / eos ids of the tokenizer in dir */
static int read_tokenizer(const char *dir, int *vocab, int *bos, int *eos) {
    char *p = cs_path_join(dir, "tokenizer.json");
    json_error_t jerr;
    json_t *tok = json_load_file(p, 0, &jerr);
    if (!tok) {
        fail("%s: %s", p, jerr.text);
        free(p);
        return -1;
    }
    free(p);
    long max = -1;
    const char *k;
    json_t *v;
    size_t i;
    json_object_foreach(json_object_get(json_object_get(tok, "model"), "vocab"), k, v)
        if (json_is_integer(v) && json_integer_value(v) > max) max = (long)json_integer_value(v);
    json_array_foreach(json_object_get(tok, "added_tokens"), i, v) {
        json_t *id = json_object_get(v, "id");
        if (json_is_integer(id) && json_integer_value(id) > max) max = (long)json_integer_value(id);
    }
    if (max < 0) {
        json_decref(tok);
        return fail("%s/tokenizer.json: no model.vocab or added_tokens with ids", dir);
    }
    *vocab = (int)max + 1;
    *bos = *eos = -1;
    p = cs_path_join(dir, "tokenizer_config.json");
    json_t *tc = NULL;
    if (cs_file_exists(p)) {
        /* model_max_length is often 1e30 written as an integer: read integers as reals */
        tc = json_load_file(p, JSON_DECODE_INT_AS_REAL, &jerr);
        if (!tc) {
            fail("%s: %s", p, jerr.text);
            free(p);
            json_decref(tok);
            return -1;
        }
    }
    free(p);
    static const char *const keys[2] = { "bos_token", "eos_token" };
    int *outs[2] = { bos, eos };
    for (int j = 0; tc && j < 2; j++) {
        json_t *t = json_object_get(tc, keys[j]);
        const char *c = json_is_string(t) ? json_string_value(t) : json_string_value(json_object_get(t, "content"));
        if (c) *outs[j] = token_id(tok, c);
    }
    json_decref(tc);
    json_decref(tok);
    return 0;
}

/* ---- model ---- */

typedef struct model_opts {
    const char *out, *tokenizer, *rope_scaling;
    int arch;
    long hidden, layers, heads, kv_heads, head_dim, intermediate, vocab, max_pos, shards;
    cs_dtype dtype;
    bool tied;
    unsigned long long seed;
    double rope_theta, rms_eps, init_std;
} model_opts_t;

static const char *const arch_flags[] = { "llama", "mistral", "qwen2", "qwen3" };
static const char *const arch_classes[] = { "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM" };

static json_t *token_json(int n, const int *ids) {
    if (n == 0) return json_null();
    if (n == 1) return json_integer(ids[0]);
    json_t *a = json_array();
    for (int i = 0; i < n; i++) json_array_append_new(a, json_integer(ids[i]));
    return a;
}

/* config.json with exactly the keys transformers 5.23 writes for this architecture */
static json_t *build_config(const model_opts_t *o, int bos, int eos) {
    json_t *c = json_object();
    int a = o->arch;
    bool qwen = a == MODEL_ARCH_QWEN2 || a == MODEL_ARCH_QWEN3;
    json_object_set_new(c, "architectures", json_pack("[s]", arch_classes[a]));
    json_object_set_new(c, "model_type", json_string(arch_flags[a]));
    json_object_set_new(c, "attention_dropout", json_real(0.0));
    json_object_set_new(c, "bos_token_id", bos >= 0 ? json_integer(bos) : json_null());
    json_object_set_new(c, "eos_token_id", eos >= 0 ? json_integer(eos) : json_null());
    json_object_set_new(c, "dtype", json_string(torch_dtype_name(o->dtype)));
    if (a != MODEL_ARCH_QWEN2 || o->head_dim != o->hidden / o->heads)
        json_object_set_new(c, "head_dim", json_integer(o->head_dim));
    json_object_set_new(c, "hidden_act", json_string("silu"));
    json_object_set_new(c, "hidden_size", json_integer(o->hidden));
    json_object_set_new(c, "initializer_range", json_real(o->init_std));
    json_object_set_new(c, "intermediate_size", json_integer(o->intermediate));
    json_object_set_new(c, "max_position_embeddings", json_integer(o->max_pos));
    json_object_set_new(c, "num_attention_heads", json_integer(o->heads));
    json_object_set_new(c, "num_hidden_layers", json_integer(o->layers));
    json_object_set_new(c, "num_key_value_heads", json_integer(o->kv_heads));
    json_object_set_new(c, "pad_token_id", json_null());
    json_object_set_new(c, "rms_norm_eps", json_real(o->rms_eps));
    json_object_set_new(c, "tie_word_embeddings", json_boolean(o->tied));
    json_object_set_new(c, "transformers_version", json_string(TRANSFORMERS_VERSION));
    json_object_set_new(c, "use_cache", json_true());
    json_object_set_new(c, "vocab_size", json_integer(o->vocab));

    json_t *rope = json_object();
    json_object_set_new(rope, "rope_theta", json_real(o->rope_theta));
    json_object_set_new(rope, "rope_type", json_string("default"));
    if (o->rope_scaling) {
        double f = 0, lo = 0, hi = 0;
        long orig = 0;
        char extra;
        if (sscanf(o->rope_scaling, "llama3:%lf:%lf:%lf:%ld%c", &f, &lo, &hi, &orig, &extra) == 4) {
            json_object_set_new(rope, "rope_type", json_string("llama3"));
            json_object_set_new(rope, "factor", json_real(f));
            json_object_set_new(rope, "low_freq_factor", json_real(lo));
            json_object_set_new(rope, "high_freq_factor", json_real(hi));
            json_object_set_new(rope, "original_max_position_embeddings", json_integer(orig));
        } else if (sscanf(o->rope_scaling, "linear:%lf%c", &f, &extra) == 1) {
            json_object_set_new(rope, "rope_type", json_string("linear"));
            json_object_set_new(rope, "factor", json_real(f));
        } else {
            json_decref(rope);
            json_decref(c);
            fail("--rope-scaling: expected llama3:FACTOR:LOW:HIGH:ORIGMAX or linear:FACTOR, got '%s'", o->rope_scaling);
            return NULL;
        }
    }
    json_object_set_new(c, "rope_parameters", rope);

    if (a == MODEL_ARCH_LLAMA) {
        json_object_set_new(c, "attention_bias", json_false());
        json_object_set_new(c, "mlp_bias", json_false());
        json_object_set_new(c, "pretraining_tp", json_integer(1));
    }
    if (a == MODEL_ARCH_QWEN3) json_object_set_new(c, "attention_bias", json_false());
    if (a == MODEL_ARCH_MISTRAL || qwen) json_object_set_new(c, "sliding_window", json_null());
    if (qwen) {
        json_t *lt = json_array();
        for (long i = 0; i < o->layers; i++) json_array_append_new(lt, json_string("full_attention"));
        json_object_set_new(c, "layer_types", lt);
        json_object_set_new(c, "max_window_layers", json_integer(o->layers));
        json_object_set_new(c, "use_sliding_window", json_false());
    }
    return c;
}

/* a linear layer of layer i: its weight (d0 x d1, INIT_NORMAL) and, if bias, its bias (d0,
 * INIT_BIAS), model.layers.<i>.<name>.weight and .bias; the list sorts them by name later */
static int gen_proj(gen_list_t *l, double std, int64_t d0, int64_t d1, bool bias, int i, const char *name) {
    int e = gen_add(l, INIT_NORMAL, std, d0, d1, "model.layers.%d.%s.weight", i, name);
    if (bias) e |= gen_add(l, INIT_BIAS, std, d0, 0, "model.layers.%d.%s.bias", i, name);
    return e;
}

static int build_model_tensors(const model_config_t *mc, double std, gen_list_t *l) {
    int64_t h = mc->hidden_size, q = (int64_t)mc->n_heads * mc->head_dim, kv = (int64_t)mc->n_kv_heads * mc->head_dim;
    int64_t inter = mc->intermediate_size;
    const double norm_std = 0.1;
    int e = 0;
    e |= gen_add(l, INIT_NORMAL, std, mc->vocab_size, h, "model.embed_tokens.weight");
    if (!mc->tie_word_embeddings) e |= gen_add(l, INIT_NORMAL, std, mc->vocab_size, h, "lm_head.weight");
    e |= gen_add(l, INIT_NORM_WEIGHT, norm_std, h, 0, "model.norm.weight");
    for (int i = 0; i < mc->n_layers; i++) {
        const char *p = "model.layers";
        e |= gen_add(l, INIT_NORM_WEIGHT, norm_std, h, 0, "%s.%d.input_layernorm.weight", p, i);
        e |= gen_add(l, INIT_NORM_WEIGHT, norm_std, h, 0, "%s.%d.post_attention_layernorm.weight", p, i);
        e |= gen_proj(l, std, q, h, mc->attention_bias, i, "self_attn.q_proj");
        e |= gen_proj(l, std, kv, h, mc->attention_bias, i, "self_attn.k_proj");
        e |= gen_proj(l, std, kv, h, mc->attention_bias, i, "self_attn.v_proj");
        e |= gen_proj(l, std, h, q, mc->o_bias, i, "self_attn.o_proj");
        if (mc->qk_norm) {
            e |= gen_add(l, INIT_NORM_WEIGHT, norm_std, mc->head_dim, 0, "%s.%d.self_attn.q_norm.weight", p, i);
            e |= gen_add(l, INIT_NORM_WEIGHT, norm_std, mc->head_dim, 0, "%s.%d.self_attn.k_norm.weight", p, i);
        }
        e |= gen_proj(l, std, inter, h, mc->mlp_bias, i, "mlp.gate_proj");
        e |= gen_proj(l, std, inter, h, mc->mlp_bias, i, "mlp.up_proj");
        e |= gen_proj(l, std, h, inter, mc->mlp_bias, i, "mlp.down_proj");
    }
    if (e) return -1;
    qsort(l->t, l->n, sizeof *l->t, gen_cmp);
    return 0;
}

static const char *const pt_meta[] = { "format", "pt", NULL };

/* ---- tensors generated ahead of the writer ----
 * Each tensor has its own random stream (seeded by its name), so tensors can be generated
 * in any order and on any thread with the same bytes. Worker threads fill the tensors ahead
 * of the one the writer asks for (at most `window` of them and AHEAD_MAX_BYTES in flight);
 * the writer's fill copies the finished one. A 7B-shaped model takes seconds, not minutes.
 * A worker that cannot allocate leaves the tensor to the writer, which generates it itself. */

#define AHEAD_MAX_BYTES ((size_t)2 << 30)
#define AHEAD_MAX_THREADS 16

typedef struct ahead {
    fill_ctx_t *fc;
    size_t n, next, consumed, window, inflight;
    size_t *nbytes;
    void **buf;
    unsigned char *state;      /* 0 not started, 1 being made, 2 ready (buf may be NULL) */
    bool stop;
    pthread_mutex_t mu;
    pthread_cond_t cv;
} ahead_t;

static void *ahead_worker(void *arg) {
    ahead_t *a = arg;
    pthread_mutex_lock(&a->mu);
    for (;;) {
        while (!a->stop && a->next < a->n &&
               (a->next >= a->consumed + a->window ||
                (a->inflight > 0 && a->inflight + a->nbytes[a->next] > AHEAD_MAX_BYTES)))
            pthread_cond_wait(&a->cv, &a->mu);
        if (a->stop || a->next >= a->n) break;
        size_t i = a->next++, nb = a->nbytes[i];
        a->state[i] = 1;
        a->inflight += nb;
        pthread_mutex_unlock(&a->mu);
        void *b = malloc(nb ? nb : 1);
        if (b && fill_tensor(a->fc, i, b, nb) != CS_OK) { free(b); b = NULL; }
        pthread_mutex_lock(&a->mu);
        a->buf[i] = b;
        a->state[i] = 2;
        if (!b) a->inflight -= nb;
        pthread_cond_broadcast(&a->cv);
    }
    pthread_mutex_unlock(&a->mu);
    return NULL;
}

static int ahead_fill(void *user, size_t i, void *buf, size_t nbytes) {
    ahead_t *a = user;
    pthread_mutex_lock(&a->mu);
    while (a->state[i] != 2 && a->state[i] != 0) pthread_cond_wait(&a->cv, &a->mu);
    void *b = a->state[i] == 2 ? a->buf[i] : NULL;
    if (a->state[i] == 0 && a->next == i) a->next++;   /* not started: the writer makes it */
    a->buf[i] = NULL;
    pthread_mutex_unlock(&a->mu);
    int rc = CS_OK;
    if (b) memcpy(buf, b, nbytes);
    else rc = fill_tensor(a->fc, i, buf, nbytes);
    free(b);
    pthread_mutex_lock(&a->mu);
    if (b) a->inflight -= a->nbytes[i];
    a->consumed = i + 1;
    pthread_cond_broadcast(&a->cv);
    pthread_mutex_unlock(&a->mu);
    return rc;
}

/* safetensors_write_cb with the tensors made ahead on the machine's cores */
static int write_tensors(const char *path, const st_write_tensor_t *w, size_t n, fill_ctx_t *fc) {
    const char *env = getenv("CS_MKMODEL_THREADS");   /* tests: the same bytes at any count */
    long cpus = env && *env ? strtol(env, NULL, 10) : sysconf(_SC_NPROCESSORS_ONLN);
    int nth = cpus < 1 ? 1 : cpus > AHEAD_MAX_THREADS ? AHEAD_MAX_THREADS : (int)cpus;
    ahead_t a = { .fc = fc, .n = n, .window = 2 * (size_t)nth };
    a.nbytes = calloc(n, sizeof *a.nbytes);
    a.buf = calloc(n, sizeof *a.buf);
    a.state = calloc(n, 1);
    pthread_t th[AHEAD_MAX_THREADS];
    int started = 0, rc;
    size_t total = 0;
    bool ok = a.nbytes && a.buf && a.state;
    for (size_t i = 0; ok && i < n; i++) total += a.nbytes[i] = safetensors_nbytes(w[i].dtype, w[i].n_dims, w[i].shape, &ok);
    if (!ok || nth < 2 || n < 2 || total < ((size_t)8 << 20)) {   /* small: one thread, as before */
        rc = safetensors_write_cb(path, w, n, pt_meta, fill_tensor, fc);
        goto done;
    }
    pthread_mutex_init(&a.mu, NULL);
    pthread_cond_init(&a.cv, NULL);
    for (; started < nth; started++)
        if (pthread_create(&th[started], NULL, ahead_worker, &a)) break;
    rc = safetensors_write_cb(path, w, n, pt_meta, ahead_fill, &a);
    pthread_mutex_lock(&a.mu);
    a.stop = true;
    pthread_cond_broadcast(&a.cv);
    pthread_mutex_unlock(&a.mu);
    for (int k = 0; k < started; k++) pthread_join(th[k], NULL);
    pthread_cond_destroy(&a.cv);
    pthread_mutex_destroy(&a.mu);
    for (size_t i = 0; i < n; i++) free(a.buf[i]);   /* left by a write that stopped early */
done:
    free(a.nbytes);
    free(a.buf);
    free(a.state);
    return rc;
}

static int write_weights(const char *out, const gen_list_t *l, cs_dtype dt, uint64_t seed, long shards,
                         size_t *total_bytes) {
    size_t total = 0, n = l->n;
    for (size_t i = 0; i < n; i++) total += gen_numel(&l->t[i]) * cs_dtype_size(dt);
    *total_bytes = total;
    st_write_tensor_t *w = calloc(n, sizeof *w);
    size_t *shard_of = calloc(n, sizeof *shard_of), *map = calloc(n, sizeof *map);
    int rc = -1;
    if (!w || !shard_of || !map) { fail("out of memory"); goto done; }
    if (shards <= 1) {
        for (size_t i = 0; i < n; i++) to_write(&l->t[i], dt, &w[i]);
        fill_ctx_t fc = { l->t, NULL, dt, seed };
        char *path = cs_path_join(out, "model.safetensors");
        int r = write_tensors(path, w, n, &fc);
        free(path);
        if (r) { fail("%s", cs_error_last()); goto done; }
        rc = 0;
        goto done;
    }
    if ((size_t)shards > n) { fail("--shards %ld: the model has only %zu tensors", shards, n); goto done; }
    /* contiguous groups of roughly equal bytes, none empty */
    size_t k = 0, in_k = 0, cum = 0;
    for (size_t i = 0; i < n; i++) {
        if (in_k > 0 && k < (size_t)shards - 1 &&
            (cum >= total / (size_t)shards * (k + 1) || n - i <= (size_t)shards - 1 - k)) {
            k++;
            in_k = 0;
        }
        shard_of[i] = k;
        cum += gen_numel(&l->t[i]) * cs_dtype_size(dt);
        in_k++;
    }
    json_t *index = json_object(), *wm = json_object();
    size_t params = 0;
    for (size_t i = 0; i < n; i++) params += gen_numel(&l->t[i]);
    json_object_set_new(index, "metadata", json_pack("{s:I,s:I}", "total_parameters", (json_int_t)params,
                                                     "total_size", (json_int_t)total));
    json_object_set_new(index, "weight_map", wm);
    for (long s = 0; s < shards; s++) {
        char fname[64];
        snprintf(fname, sizeof fname, "model-%05ld-of-%05ld.safetensors", s + 1, shards);
        size_t m = 0;
        for (size_t i = 0; i < n; i++) {
            if (shard_of[i] != (size_t)s) continue;
            to_write(&l->t[i], dt, &w[m]);
            map[m++] = i;
            json_object_set_new(wm, l->t[i].name, json_string(fname));
        }
        fill_ctx_t fc = { l->t, map, dt, seed };
        char *path = cs_path_join(out, fname);
        int r = write_tensors(path, w, m, &fc);
        free(path);
        if (r) { fail("%s", cs_error_last()); json_decref(index); goto done; }
    }
    rc = write_json(out, "model.safetensors.index.json", index);
    json_decref(index);
done:
    free(w);
    free(shard_of);
    free(map);
    return rc;
}

static int cmd_model(int argc, char **argv) {
    model_opts_t o = {
        .arch = MODEL_ARCH_LLAMA, .hidden = 1024, .layers = 12, .heads = 16, .kv_heads = -1, .head_dim = -1,
        .intermediate = 2816, .vocab = -1, .max_pos = 4096, .shards = 1, .dtype = CS_DTYPE_F32,
        .rope_theta = 10000.0, .rms_eps = 1e-6, .init_std = 0.02,
    };
    static const struct option lo[] = {
        { "out", 1, 0, 'o' }, { "arch", 1, 0, 'a' }, { "hidden", 1, 0, 'H' }, { "layers", 1, 0, 'L' },
        { "heads", 1, 0, 'n' }, { "kv-heads", 1, 0, 'k' }, { "head-dim", 1, 0, 'd' },
        { "intermediate", 1, 0, 'I' }, { "vocab", 1, 0, 'V' }, { "dtype", 1, 0, 't' }, { "tied", 0, 0, 'T' },
        { "seed", 1, 0, 's' }, { "tokenizer", 1, 0, 'z' }, { "rope-theta", 1, 0, 'r' },
        { "rope-scaling", 1, 0, 'R' }, { "max-pos", 1, 0, 'm' }, { "rms-eps", 1, 0, 'e' },
        { "init-std", 1, 0, 'S' }, { "shards", 1, 0, 'N' }, { "help", 0, 0, 'h' }, { 0, 0, 0, 0 },
    };
    int c, li = 0;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", lo, &li)) != -1) {
        bool ok = true;
        long tmp;
        switch (c) {
        case 'o': o.out = optarg; break;
        case 'a':
            o.arch = -1;
            for (int i = 0; i < 4; i++) if (!strcmp(optarg, arch_flags[i])) o.arch = i;
            ok = o.arch >= 0;
            break;
        case 'H': ok = parse_long(optarg, 1, 1 << 20, &o.hidden); break;
        case 'L': ok = parse_long(optarg, 1, 4096, &o.layers); break;
        case 'n': ok = parse_long(optarg, 1, 1 << 16, &o.heads); break;
        case 'k': ok = parse_long(optarg, 1, 1 << 16, &o.kv_heads); break;
        case 'd': ok = parse_long(optarg, 2, 1 << 16, &o.head_dim); break;
        case 'I': ok = parse_long(optarg, 1, 1 << 20, &o.intermediate); break;
        case 'V': ok = parse_long(optarg, 1, 1 << 24, &o.vocab); break;
        case 't': ok = parse_dtype(optarg, &o.dtype) == 0; break;
        case 'T': o.tied = true; break;
        case 's': ok = parse_long(optarg, 0, LONG_MAX, &tmp); o.seed = (unsigned long long)tmp; break;
        case 'z': o.tokenizer = optarg; break;
        case 'r': ok = parse_double(optarg, &o.rope_theta) && o.rope_theta > 0; break;
        case 'R': o.rope_scaling = optarg; break;
        case 'm': ok = parse_long(optarg, 1, INT_MAX, &o.max_pos); break;
        case 'e': ok = parse_double(optarg, &o.rms_eps) && o.rms_eps >= 0; break;
        case 'S': ok = parse_double(optarg, &o.init_std) && o.init_std >= 0; break;
        case 'N': ok = parse_long(optarg, 1, 99999, &o.shards); break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
        if (!ok) {
            fail("bad value '%s' for --%s", optarg, lo[li].name);
            usage(stderr);
            return 2;
        }
    }
    if (optind < argc) { fail("unexpected argument '%s'", argv[optind]); usage(stderr); return 2; }
    if (!o.out) { fail("model: --out DIR is required"); usage(stderr); return 2; }
    if (o.kv_heads < 0) o.kv_heads = o.heads;
    if (o.head_dim < 0) {
        if (o.hidden % o.heads) return fail("--hidden %ld is not a multiple of --heads %ld (give --head-dim)", o.hidden, o.heads);
        o.head_dim = o.hidden / o.heads;
    }

    int bos = -1, eos = -1, tok_vocab = 0;
    if (o.arch == MODEL_ARCH_LLAMA || o.arch == MODEL_ARCH_MISTRAL) bos = 1, eos = 2; /* transformers' defaults */
    if (o.tokenizer && read_tokenizer(o.tokenizer, &tok_vocab, &bos, &eos)) return 1;
    if (o.vocab < 0) o.vocab = o.tokenizer ? tok_vocab : 32000;
    if (o.tokenizer && o.vocab < tok_vocab)
        return fail("--vocab %ld is smaller than the tokenizer's vocabulary (%d ids)", o.vocab, tok_vocab);

    json_t *cfg = build_config(&o, bos, eos);
    if (!cfg) return 2;
    /* validate with the engine's own parser: what we write, caraserve must accept */
    char *text = json_dumps(cfg, JSON_SORT_KEYS);
    model_config_t mc;
    int prc = text ? model_config_parse(text, &mc) : CS_ENOMEM;
    free(text);
    if (prc) { json_decref(cfg); return fail("invalid model: %s", cs_error_last()); }

    gen_list_t l = { 0 };
    int rc = 1;
    size_t bytes = 0, params = 0;
    if (mkdir_p(o.out)) { fail("%s: %s", o.out, strerror(errno)); goto done; }
    if (build_model_tensors(&mc, o.init_std, &l)) { fail("out of memory"); goto done; }
    if (write_json(o.out, "config.json", cfg)) goto done;
    json_t *gen = json_object();
    json_object_set_new(gen, "_from_model_config", json_true());
    if (bos >= 0) json_object_set_new(gen, "bos_token_id", json_integer(bos));
    if (eos >= 0) json_object_set_new(gen, "eos_token_id", token_json(1, &eos));
    json_object_set_new(gen, "output_attentions", json_false());
    json_object_set_new(gen, "output_hidden_states", json_false());
    json_object_set_new(gen, "transformers_version", json_string(TRANSFORMERS_VERSION));
    json_object_set_new(gen, "use_cache", json_true());
    int gr = write_json(o.out, "generation_config.json", gen);
    json_decref(gen);
    if (gr) goto done;
    if (write_weights(o.out, &l, o.dtype, o.seed, o.shards, &bytes)) goto done;
    for (size_t i = 0; i < l.n; i++) params += gen_numel(&l.t[i]);
    if (o.tokenizer) {
        static const char *const files[] = { "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json" };
        for (size_t i = 0; i < 3; i++) {
            char *src = cs_path_join(o.tokenizer, files[i]), *dst = cs_path_join(o.out, files[i]);
            int cr = (i == 0 || cs_file_exists(src)) ? copy_file(src, dst) : 0;
            free(src);
            free(dst);
            if (cr) goto done;
        }
    }
    printf("%s: %s, %d layers, hidden %d, %zu params, %zu bytes (%s)%s%s\n", o.out, mc.arch_name, mc.n_layers,
           mc.hidden_size, params, bytes, torch_dtype_name(o.dtype), o.tied ? ", tied" : "",
           o.shards > 1 ? ", sharded" : "");
    rc = 0;
done:
    free(l.t);
    json_decref(cfg);
    return rc;
}

/* ---- adapter ---- */

static int cmd_adapter(int argc, char **argv) {
    const char *model = NULL, *out = NULL, *targets = "q,k,v,o,gate,up,down";
    long rank = 8;
    double alpha = 16, std = 0.02;
    bool rslora = false;
    unsigned long long seed = 0;
    cs_dtype dt = CS_DTYPE_F32;
    static const struct option lo[] = {
        { "model", 1, 0, 'M' }, { "out", 1, 0, 'o' }, { "rank", 1, 0, 'r' }, { "alpha", 1, 0, 'a' },
        { "targets", 1, 0, 'T' }, { "rslora", 0, 0, 'R' }, { "seed", 1, 0, 's' }, { "dtype", 1, 0, 't' },
        { "std", 1, 0, 'S' }, { "help", 0, 0, 'h' }, { 0, 0, 0, 0 },
    };
    int c, li = 0;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", lo, &li)) != -1) {
        bool ok = true;
        long tmp;
        switch (c) {
        case 'M': model = optarg; break;
        case 'o': out = optarg; break;
        case 'r': ok = parse_long(optarg, 1, 65536, &rank); break;
        case 'a': ok = parse_double(optarg, &alpha); break;
        case 'T': targets = optarg; break;
        case 'R': rslora = true; break;
        case 's': ok = parse_long(optarg, 0, LONG_MAX, &tmp); seed = (unsigned long long)tmp; break;
        case 't': ok = parse_dtype(optarg, &dt) == 0; break;
        case 'S': ok = parse_double(optarg, &std) && std >= 0; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
        if (!ok) { fail("bad value '%s' for --%s", optarg, lo[li].name); usage(stderr); return 2; }
    }
    if (optind < argc) { fail("unexpected argument '%s'", argv[optind]); usage(stderr); return 2; }
    if (!model || !out) { fail("adapter: --model DIR and --out DIR are required"); usage(stderr); return 2; }

    model_config_t mc;
    if (model_config_load(model, &mc)) return fail("%s", cs_error_last());

    bool on[LORA_N_TARGETS] = { 0 };
    char *list = strdup(targets);
    if (!list) return fail("out of memory");
    for (char *save = NULL, *t = strtok_r(list, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        int found = -1;
        for (int i = 0; i < LORA_N_TARGETS; i++) {
            size_t sl = strlen(lora_target_names[i]) - 5; /* without "_proj" */
            if (!strcmp(t, lora_target_names[i]) || (strlen(t) == sl && !strncmp(t, lora_target_names[i], sl)))
                found = i;
        }
        if (found < 0) {
            fail("--targets: unknown target '%s' (q, k, v, o, gate, up, down)", t);
            free(list);
            return 1;
        }
        on[found] = true;
    }
    free(list);

    json_t *cfg = json_object(), *tm = json_array();
    for (int i = 0; i < LORA_N_TARGETS; i++) if (on[i]) json_array_append_new(tm, json_string(lora_target_names[i]));
    if (json_array_size(tm) == 0) { json_decref(tm); json_decref(cfg); return fail("--targets: empty"); }
    char *abs = realpath(model, NULL);
    static const char *const nulls[] = {
        "alora_invocation_tokens", "arrow_config", "auto_mapping", "corda_config", "eva_config", "exclude_modules",
        "kasa_config", "lora_ga_config", "layer_replication", "layers_pattern", "layers_to_transform",
        "megatron_config", "modules_to_save", "monteclora_config", "revision", "target_parameters",
        "trainable_token_indices", "use_bdlora", "velora_config",
    };
    for (size_t i = 0; i < CS_ARRAY_LEN(nulls); i++) json_object_set_new(cfg, nulls[i], json_null());
    json_object_set_new(cfg, "alpha_pattern", json_object());
    json_object_set_new(cfg, "rank_pattern", json_object());
    json_object_set_new(cfg, "loftq_config", json_object());
    json_object_set_new(cfg, "base_model_name_or_path", json_string(abs ? abs : model));
    free(abs);
    json_object_set_new(cfg, "bias", json_string("none"));
    json_object_set_new(cfg, "ensure_weight_tying", json_false());
    json_object_set_new(cfg, "fan_in_fan_out", json_false());
    json_object_set_new(cfg, "inference_mode", json_true());
    json_object_set_new(cfg, "init_lora_weights", json_true());
    json_object_set_new(cfg, "lora_alpha", alpha == floor(alpha) && fabs(alpha) < 1e15 ? json_integer((json_int_t)alpha)
                                                                                     : json_real(alpha));
    json_object_set_new(cfg, "lora_bias", json_false());
    json_object_set_new(cfg, "lora_dropout", json_real(0.0));
    json_object_set_new(cfg, "megatron_core", json_string("megatron.core"));
    json_object_set_new(cfg, "peft_type", json_string("LORA"));
    json_object_set_new(cfg, "peft_version", json_string(PEFT_VERSION));
    json_object_set_new(cfg, "qalora_group_size", json_integer(16));
    json_object_set_new(cfg, "r", json_integer(rank));
    json_object_set_new(cfg, "target_modules", tm);
    json_object_set_new(cfg, "task_type", json_string("CAUSAL_LM"));
    json_object_set_new(cfg, "use_dora", json_false());
    json_object_set_new(cfg, "use_qalora", json_false());
    json_object_set_new(cfg, "use_rslora", json_boolean(rslora));

    gen_list_t l = { 0 };
    st_write_tensor_t *w = NULL;
    int rc = 1;
    for (int i = 0; i < mc.n_layers; i++) {
        for (int t = 0; t < LORA_N_TARGETS; t++) {
            if (!on[t]) continue;
            int din, dout;
            lora_target_dims(&mc, (lora_target)t, &din, &dout);
            const char *par = t < LORA_GATE ? "self_attn" : "mlp";
            if (gen_add(&l, INIT_NORMAL, std, rank, din, "base_model.model.model.layers.%d.%s.%s.lora_A.weight", i, par,
                        lora_target_names[t]) ||
                gen_add(&l, INIT_NORMAL, std, dout, rank, "base_model.model.model.layers.%d.%s.%s.lora_B.weight", i, par,
                        lora_target_names[t])) {
                fail("out of memory");
                goto done;
            }
        }
    }
    qsort(l.t, l.n, sizeof *l.t, gen_cmp);
    if (mkdir_p(out)) { fail("%s: %s", out, strerror(errno)); goto done; }
    if (write_json(out, "adapter_config.json", cfg)) goto done;
    if (!(w = calloc(l.n, sizeof *w))) { fail("out of memory"); goto done; }
    size_t params = 0, bytes = 0;
    for (size_t i = 0; i < l.n; i++) {
        to_write(&l.t[i], dt, &w[i]);
        params += gen_numel(&l.t[i]);
    }
    bytes = params * cs_dtype_size(dt);
    fill_ctx_t fc = { l.t, NULL, dt, seed };
    char *path = cs_path_join(out, "adapter_model.safetensors");
    int r = write_tensors(path, w, l.n, &fc);
    free(path);
    if (r) { fail("%s", cs_error_last()); goto done; }
    printf("%s: LoRA r=%ld alpha=%g%s on %zu modules of %s, %zu params, %zu bytes (%s)\n", out, rank, alpha,
           rslora ? " rslora" : "", l.n / 2, mc.arch_name, params, bytes, torch_dtype_name(dt));
    rc = 0;
done:
    free(w);
    free(l.t);
    json_decref(cfg);
    return rc;
}

/* ---- inspect ---- */

static int cmd_inspect(int argc, char **argv) {
    const char *model = NULL, *adapter = NULL;
    static const struct option lo[] = {
        { "model", 1, 0, 'M' }, { "adapter", 1, 0, 'A' }, { "help", 0, 0, 'h' }, { 0, 0, 0, 0 },
    };
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (c) {
        case 'M': model = optarg; break;
        case 'A': adapter = optarg; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (!model || optind < argc) { fail("inspect: --model DIR is required"); usage(stderr); return 2; }
    model_config_t mc;
    if (model_config_load(model, &mc)) return fail("%s", cs_error_last());
    static const char *const rope_names[] = { "none", "llama3", "linear" };
    json_t *o = json_pack("{s:s,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:f,s:f,s:s,s:f,s:f,s:f,s:i,s:b,s:b,s:b,s:b,s:b,s:i,s:s,s:i}",
                          "arch", mc.arch_name, "vocab_size", mc.vocab_size, "hidden_size", mc.hidden_size,
                          "intermediate_size", mc.intermediate_size, "n_layers", mc.n_layers, "n_heads", mc.n_heads,
                          "n_kv_heads", mc.n_kv_heads, "head_dim", mc.head_dim, "max_position_embeddings",
                          mc.max_position_embeddings, "rms_norm_eps", (double)mc.rms_norm_eps, "rope_theta", mc.rope_theta,
                          "rope_scaling", rope_names[mc.rope_scaling], "rope_factor", mc.rope_factor,
                          "rope_low_freq_factor", mc.rope_low_freq_factor, "rope_high_freq_factor",
                          mc.rope_high_freq_factor, "rope_original_max_pos", mc.rope_original_max_pos,
                          "tie_word_embeddings", mc.tie_word_embeddings, "attention_bias", mc.attention_bias,
                          "o_bias", mc.o_bias, "mlp_bias", mc.mlp_bias, "qk_norm", mc.qk_norm, "sliding_window",
                          mc.sliding_window, "torch_dtype", cs_dtype_name(mc.torch_dtype), "bos_token_id", mc.bos_token_id);
    json_t *eos = json_array();
    for (int i = 0; i < mc.n_eos; i++) json_array_append_new(eos, json_integer(mc.eos_token_ids[i]));
    json_object_set_new(o, "eos_token_ids", eos);
    safetensors_t *st = NULL;
    if (safetensors_open_dir(model, "model", &st) == CS_OK) {
        json_object_set_new(o, "n_tensors", json_integer((json_int_t)safetensors_count(st)));
        safetensors_free(st);
    } else {
        json_object_set_new(o, "weights_error", json_string(cs_error_last()));
    }
    if (adapter) {
        lora_adapter_t *a;
        if (lora_adapter_load(adapter, &mc, &a)) { json_decref(o); return fail("%s", cs_error_last()); }
        json_t *mods = json_array();
        for (int l = 0; l < a->n_layers; l++) {
            for (int t = 0; t < LORA_N_TARGETS; t++) {
                const lora_module_t *m = lora_adapter_module(a, l, (lora_target)t);
                if (!m->rank) continue;
                double sa = 0, sb = 0;
                for (size_t i = 0; i < (size_t)m->rank * m->d_in; i++) sa += lora_module_at(m, m->a, i);
                for (size_t i = 0; i < (size_t)m->d_out * m->rank; i++) sb += lora_module_at(m, m->b, i);
                json_array_append_new(mods, json_pack("{s:s,s:i,s:i,s:f,s:i,s:i,s:f,s:f}", "module", lora_target_names[t],
                                                      "layer", l, "rank", m->rank, "scale", (double)m->scale, "d_in",
                                                      m->d_in, "d_out", m->d_out, "a_sum", sa, "b_sum", sb));
            }
        }
        json_object_set_new(o, "adapter", json_pack("{s:s,s:i,s:I,s:o}", "name", a->name, "max_rank", a->max_rank,
                                                     "nbytes", (json_int_t)a->nbytes, "modules", mods));
        lora_adapter_free(a);
    }
    char *s = json_dumps(o, JSON_INDENT(1) | JSON_SORT_KEYS);
    puts(s ? s : "{}");
    free(s);
    json_decref(o);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    static char name_model[] = "caraserve-mkmodel model", name_adapter[] = "caraserve-mkmodel adapter",
                name_inspect[] = "caraserve-mkmodel inspect";   /* getopt's messages start with argv[0] */
    if (!strcmp(argv[1], "model")) { argv[1] = name_model; return cmd_model(argc - 1, argv + 1); }
    if (!strcmp(argv[1], "adapter")) { argv[1] = name_adapter; return cmd_adapter(argc - 1, argv + 1); }
    if (!strcmp(argv[1], "inspect")) { argv[1] = name_inspect; return cmd_inspect(argc - 1, argv + 1); }
    fail("unknown command '%s'", argv[1]);
    usage(stderr);
    return 2;
}
