/* model.c: loads a Llama-family checkpoint (see model.h) and runs its forward pass on a
 * backend. Matrices stay in their file dtype (BF16 stays BF16) and, on a host-memory
 * backend, stay in the mmap; norms and biases are widened to F32 at load. */
#include "engine/model.h"

#include <math.h>
#include <stdio.h>
#include <time.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <pthread.h>

#include "base/quant.h"

#include <stdatomic.h>

#include "base/gguf.h"
#include "base/safetensors.h"
#include "lora/assist.h"

typedef struct layer_w {
    backend_weight_t attn_norm, ffn_norm;  /* (1, hidden) F32 */
    backend_weight_t q_norm, k_norm;       /* (1, head_dim) F32, Qwen3 */
    backend_weight_t wq, wk, wv, wo;       /* (out, in) */
    backend_weight_t w_gate, w_up, w_down;
    backend_buf_t *bq, *bk, *bv, *bo;      /* biases (F32), NULL when absent */
    backend_buf_t *b_gate, *b_up, *b_down;
} layer_w_t;

struct model {
    model_config_t cfg;
    backend_t *be;
    safetensors_t *st;           /* a Hugging Face directory's weights, or */
    gguf_t *gg;                  /* a GGUF file's, with */
    st_tensor_t *gt;             /* its tensors under the Hugging Face names (gguf_tensors) */
    size_t n_gt;
    backend_weight_t embed;      /* (vocab, hidden) */
    backend_weight_t lm_head;    /* (vocab, hidden), == embed when tied */
    backend_weight_t final_norm;
    layer_w_t *layers;
    float *inv_freq;        /* host, head_dim/2 */
    backend_buf_t *inv_freq_buf;
    void **owned;           /* backend buffers to free */
    size_t n_owned, cap_owned;
    void **host_owned;      /* host copies of misaligned tensors */
    size_t n_host, cap_host;
    size_t n_params;
    cs_dtype wdtype;
    /* activations, grown on demand (backend memory) */
    int act_cap;
    backend_buf_t *x, *xb, *xb2, *q, *kb, *vb, *att, *hb, *hb2, *logits_buf;
    /* the batch description, packed here and uploaded once per forward */
    int32_t *pos, *ids, *slots, *out_rows;   /* per batch row */
    backend_seq_desc_t *aseqs;
    backend_lora_seg_desc_t *lsegs;
    int32_t *blocks;                         /* the block tables, flattened */
    int blocks_cap;
    backend_batch_t *batch;
    int seq_cap, logits_cap;
    /* the cold start (model_set_assist): segments whose slot is still streaming in */
    lora_assist_t *assist;
    struct cold_seg *cold;
    int n_cold, cold_cap;
    float *hx, *hy;              /* pinned host rows: layer inputs out, LoRA terms back (F32 or
                                  * BF16: lora_assist_terms_dtype) */
    size_t hx_cap, hy_cap;       /* floats (hy: the terms' bytes over 4) */
    uint32_t *flags;             /* 3 per cold segment: input there, parts done, heartbeat */
    int flags_cap;
    model_cold_stats_t cold_st;
    uint64_t graph_kv;              /* kv_cache_id of the cache the recorded graphs write */
    bool probe;                     /* model_probe: tensors checked, nothing loaded */
    uint64_t uid;                   /* its number: in its graphs' keys */
};

/* Models of one base in two versions share a backend, and a recorded graph names its model's
 * buffers: a graph's key carries the model's number (unique in the process), so one model
 * never replays another's. */
static _Atomic uint64_t model_count;

typedef struct cold_seg {
    int row0, n;
    int device_layers;           /* layers [0, device_layers) run on the device this forward */
    const lora_adapter_t *ad;
    float *hx;                   /* its rows of m->hx */
    char *hy;                    /* ... of m->hy, of the terms' dtype */
    uint32_t *xflag, *done, *alive; /* alive: the workers' heartbeat (wait_add's deadline) */
    uint32_t xval, dval;
    bool started;                /* a job of the current group is out */
} cold_seg_t;

struct model_seq {
    model_t *m;
    int capacity;
    int len;
    kv_cache_t *kv;         /* private, ceil(capacity / KV_BLOCK_SIZE) blocks */
    int32_t *blocks;        /* identity block table */
};

const model_config_t *model_get_config(const model_t *m) { return &m->cfg; }
size_t model_n_params(const model_t *m) { return m->n_params; }
cs_dtype model_weight_dtype(const model_t *m) { return m->wdtype; }
backend_t *model_backend(const model_t *m) { return m->be; }

/* append p to a growable pointer list (the buffers a model frees); CS_ENOMEM leaves p
 * with the caller */
static int ptr_list_push(void ***list, size_t *n, size_t *cap, void *p) {
    if (!p) return cs_error_set(CS_ENOMEM, "out of memory");
    if (*n == *cap) {
        size_t nc = *cap ? *cap * 2 : 64;
        void **nl = realloc(*list, nc * sizeof *nl);
        if (!nl) return cs_error_set(CS_ENOMEM, "out of memory");
        *list = nl;
        *cap = nc;
    }
    (*list)[(*n)++] = p;
    return CS_OK;
}

/* backend buffer owned by the model */
static int own(model_t *m, backend_buf_t *p) {
    int rc = ptr_list_push(&m->owned, &m->n_owned, &m->cap_owned, p);
    if (rc && p) backend_buf_free(m->be, p);
    return rc;
}

/* host copy owned by the model */
static int own_host(model_t *m, void *p) {
    int rc = ptr_list_push(&m->host_owned, &m->n_host, &m->cap_host, p);
    if (rc) free(p);
    return rc;
}

static const char *shape_str(char *buf, size_t len, const int64_t *s, int nd) {
    size_t k = 0;
    k += snprintf(buf + k, len - k, "[");
    for (int i = 0; i < nd && k < len; i++) k += snprintf(buf + k, len - k, "%s%lld", i ? ", " : "", (long long)s[i]);
    if (k < len) snprintf(buf + k, len - k, "]");
    return buf;
}

/* Look up `name`, check dtype and shape (rows, cols; rows == 0 means a vector of cols). */
/* GGUF's tensor names and Hugging Face's ("blk.3.attn_q.weight", "model.layers.3.self_attn.q_proj.weight") */
static const char *const name_top[][2] = {
    {"token_embd.weight", "model.embed_tokens.weight"}, {"output_norm.weight", "model.norm.weight"},
    {"output.weight", "lm_head.weight"}};
static const char *const name_blk[][2] = {
    {"attn_norm.weight", "input_layernorm.weight"},    {"ffn_norm.weight", "post_attention_layernorm.weight"},
    {"attn_q.weight", "self_attn.q_proj.weight"},      {"attn_k.weight", "self_attn.k_proj.weight"},
    {"attn_v.weight", "self_attn.v_proj.weight"},      {"attn_output.weight", "self_attn.o_proj.weight"},
    {"attn_q.bias", "self_attn.q_proj.bias"},          {"attn_k.bias", "self_attn.k_proj.bias"},
    {"attn_v.bias", "self_attn.v_proj.bias"},          {"attn_output.bias", "self_attn.o_proj.bias"},
    {"attn_q_norm.weight", "self_attn.q_norm.weight"}, {"attn_k_norm.weight", "self_attn.k_norm.weight"},
    {"ffn_gate.weight", "mlp.gate_proj.weight"},       {"ffn_up.weight", "mlp.up_proj.weight"},
    {"ffn_down.weight", "mlp.down_proj.weight"}};

/* NAME from one naming into the other (to_hf: GGUF -> HF) in BUF; a name with no counterpart
 * stays itself (a GGUF tensor then refused as unexpected) */
static const char *rename_tensor(const char *name, bool to_hf, char *buf, size_t len) {
    int from = to_hf ? 0 : 1, to = 1 - from;
    for (size_t i = 0; i < CS_ARRAY_LEN(name_top); i++)
        if (!strcmp(name, name_top[i][from])) return name_top[i][to];
    int l, off = 0;
    if ((to_hf ? sscanf(name, "blk.%d.%n", &l, &off) : sscanf(name, "model.layers.%d.%n", &l, &off)) == 1 && off > 0 && l >= 0)
        for (size_t i = 0; i < CS_ARRAY_LEN(name_blk); i++)
            if (!strcmp(name + off, name_blk[i][from])) {
                snprintf(buf, len, to_hf ? "model.layers.%d.%s" : "blk.%d.%s", l, name_blk[i][to]);
                return buf;
            }
    return name;
}

static size_t n_tensors(const model_t *m) { return m->gg ? m->n_gt : safetensors_count(m->st); }
static const st_tensor_t *tensor_at(const model_t *m, size_t i) { return m->gg ? &m->gt[i] : safetensors_at(m->st, i); }

static const st_tensor_t *find_tensor(const model_t *m, const char *name) {
    if (!m->gg) return safetensors_find(m->st, name);
    for (size_t i = 0; i < m->n_gt; i++)
        if (!strcmp(m->gt[i].name, name)) return &m->gt[i];
    return NULL;
}

/* a GGUF tensor's name in the file, for messages ("" for safetensors) */
static const char *file_name_of(const model_t *m, const st_tensor_t *t) {
    return m->gg ? gguf_tensor_at(m->gg, (size_t)(t - m->gt))->name : "";
}

static int get_tensor(model_t *m, const char *name, int rows, int cols, const st_tensor_t **out) {
    const st_tensor_t *t = find_tensor(m, name);
    char gn[256];
    if (!t && m->gg)
        return cs_error_set(CS_ENOTFOUND, "%s: missing tensor '%s' (%s)", gguf_path(m->gg),
                            rename_tensor(name, false, gn, sizeof gn), name);
    if (!t) return cs_error_set(CS_ENOTFOUND, "missing tensor '%s'", name);
    if (m->gg && t->dtype == CS_DTYPE_COUNT)
        return cs_error_set(CS_EUNSUPPORTED, "tensor '%s' (%s): GGUF type %s is not supported (F32, F16, BF16, Q4_0, "
                            "Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K are)", file_name_of(m, t), name,
                            gguf_tensor_at(m->gg, (size_t)(t - m->gt))->type_name);
    bool quant = cs_dtype_is_quant(t->dtype);
    if (quant && !rows)
        return cs_error_set(CS_EUNSUPPORTED, "tensor '%s' (%s): a vector quantized as %s (norms and biases must be "
                            "F32, F16 or BF16)", file_name_of(m, t), name, cs_dtype_name(t->dtype));
    if (quant && !m->probe && !backend_caps(m->be)->quant_weights)
        return cs_error_set(CS_EUNSUPPORTED, "tensor '%s': %s weights are not supported on the %s backend", name,
                            cs_dtype_name(t->dtype), backend_name(m->be));
    if (t->dtype != CS_DTYPE_F32 && t->dtype != CS_DTYPE_BF16 && t->dtype != CS_DTYPE_F16 && !quant)
        return cs_error_set(CS_EUNSUPPORTED, "tensor '%s': dtype %s not supported (F32, BF16, F16 are)", name,
                            cs_dtype_name(t->dtype));
    int64_t want[2] = {rows, cols};
    int want_nd = rows ? 2 : 1;
    const int64_t *w = rows ? want : want + 1;
    bool ok = t->n_dims == want_nd;
    for (int i = 0; ok && i < want_nd; i++) ok = t->shape[i] == w[i];
    if (!ok) {
        char a[96], b[96];
        return cs_error_set(CS_ESHAPE, "tensor '%s': expected shape %s, got %s", name, shape_str(a, sizeof a, w, want_nd),
                            shape_str(b, sizeof b, t->shape, t->n_dims));
    }
    *out = t;
    return CS_OK;
}

/* ---- --quantization ---- */
static _Atomic int load_quant = CS_DTYPE_COUNT, load_quant_threads = 1;

void model_set_load_quantization(cs_dtype t, int threads) {
    atomic_store(&load_quant, cs_dtype_is_quant(t) ? (int)t : CS_DTYPE_COUNT);
    atomic_store(&load_quant_threads, threads > 0 ? threads : 1);
}

cs_dtype model_load_quantization(void) { return (cs_dtype)atomic_load(&load_quant); }

/* the type a matrix of COLS columns is quantized to under --quantization Q (CS_DTYPE_COUNT: kept) */
static cs_dtype quant_target(cs_dtype q, int cols) {
    if (cols % cs_dtype_block(q) == 0) return q;
    cs_dtype f = q == CS_DTYPE_Q4_K ? CS_DTYPE_Q5_0 : q == CS_DTYPE_Q5_K ? CS_DTYPE_Q5_1 : q == CS_DTYPE_Q6_K ? CS_DTYPE_Q8_0 : q;
    return cols % cs_dtype_block(f) == 0 ? f : CS_DTYPE_COUNT;
}

typedef struct quant_part {
    const st_tensor_t *t;
    cs_dtype to;
    int cols, r0, r1;
    uint8_t *dst;
    int rc;
} quant_part_t;

static void *quant_rows(void *arg) {
    quant_part_t *p = arg;
    size_t es = cs_dtype_size(p->t->dtype), rb = cs_dtype_row_bytes(p->to, p->cols);
    float *row = malloc(sizeof(float) * (size_t)p->cols);
    void *src = malloc(es * (size_t)p->cols); /* the mapping may be misaligned for the dtype */
    if (!row || !src) p->rc = CS_ENOMEM;
    for (int r = p->r0; r < p->r1 && !p->rc; r++) {
        memcpy(src, (const uint8_t *)p->t->data + (size_t)r * p->cols * es, es * (size_t)p->cols);
        cs_to_f32(row, src, p->t->dtype, (size_t)p->cols);
        p->rc = cs_quantize_row_ref(p->dst + (size_t)r * rb, row, p->to, p->cols);
    }
    free(row);
    free(src);
    return NULL;
}

/* *T quantized to TO in host memory the model owns (*t then describes that copy) */
static int quantize_tensor(model_t *m, st_tensor_t *q, const st_tensor_t *t, int rows, int cols, cs_dtype to) {
    size_t nbytes = (size_t)rows * cs_dtype_row_bytes(to, cols);
    uint8_t *dst = cs_aligned_alloc(64, nbytes);
    if (!dst) return cs_error_set(CS_ENOMEM, "tensor '%s': out of memory quantizing it", t->name);
    int rc = own_host(m, dst);
    if (rc) return rc;
    enum { MAXT = 64 };
    int n = CS_MAX(1, CS_MIN(CS_MIN(atomic_load(&load_quant_threads), MAXT), rows));
    quant_part_t parts[MAXT];
    pthread_t tid[MAXT];
    bool started[MAXT] = {false};
    for (int i = 0; i < n; i++) {
        parts[i] = (quant_part_t){t, to, cols, (int)((int64_t)rows * i / n), (int)((int64_t)rows * (i + 1) / n), dst, 0};
        started[i] = i > 0 && pthread_create(&tid[i], NULL, quant_rows, &parts[i]) == 0;
    }
    for (int i = 0; i < n; i++)
        if (!started[i]) quant_rows(&parts[i]);
    for (int i = 1; i < n; i++)
        if (started[i]) pthread_join(tid[i], NULL);
    for (int i = 0; i < n; i++)
        if (parts[i].rc) return cs_error_set(parts[i].rc, "tensor '%s': quantizing it to %s failed", t->name, cs_dtype_name(to));
    *q = *t;
    q->dtype = to;
    q->data = dst;
    q->nbytes = nbytes;
    return CS_OK;
}

static int load_matrix_as(model_t *m, const char *name, int rows, int cols, backend_weight_t *w, bool quantizable);

static int load_matrix(model_t *m, const char *name, int rows, int cols, backend_weight_t *w) {
    return load_matrix_as(m, name, rows, cols, w, false);
}

/* a projection: quantized at load under --quantization */
static int load_proj(model_t *m, const char *name, int rows, int cols, backend_weight_t *w) {
    return load_matrix_as(m, name, rows, cols, w, true);
}

static int load_matrix_as(model_t *m, const char *name, int rows, int cols, backend_weight_t *w, bool quantizable) {
    const st_tensor_t *t;
    int rc = get_tensor(m, name, rows, cols, &t);
    if (rc || m->probe) return rc;
    cs_dtype q = model_load_quantization();
    st_tensor_t qt;
    if (quantizable && cs_dtype_is_quant(q) && !cs_dtype_is_quant(t->dtype) && (q = quant_target(q, cols)) != CS_DTYPE_COUNT) {
        if (!backend_caps(m->be)->quant_weights)
            return cs_error_set(CS_EUNSUPPORTED, "--quantization %s: quantized weights are not supported on the %s backend",
                                cs_dtype_name(model_load_quantization()), backend_name(m->be));
        if ((rc = quantize_tensor(m, &qt, t, rows, cols, q))) return rc;
        if (m->st) (void)safetensors_release(m->st, t->data, t->nbytes); /* the file's bytes: not read again */
        t = &qt;
    }
    w->dtype = t->dtype;
    w->rows = rows;
    w->cols = cols;
    /* blocks hold F16 scales: element alignment for them is 2 bytes */
    bool aligned = (uintptr_t)t->data % (cs_dtype_is_quant(t->dtype) ? 2 : cs_dtype_size(t->dtype)) == 0;
    if (backend_caps(m->be)->host_memory) {
        /* used in place in the mmap; safetensors does not promise element alignment, so a
         * misaligned tensor is copied rather than misread */
        void *p = (void *)t->data;
        if (!aligned) {
            p = cs_aligned_alloc(64, t->nbytes);
            if ((rc = own_host(m, p))) return rc;
            memcpy(p, t->data, t->nbytes);
        }
        if ((rc = own(m, w->buf = backend_buf_from_host(m->be, p, t->nbytes)))) return rc;
        w->host = p;
    } else {
        if (!(w->buf = backend_buf_alloc(m->be, t->nbytes)))
            return cs_error_set(CS_ENOMEM, "weight %s (%zu bytes): %s", name, t->nbytes, cs_error_last());
        if ((rc = own(m, w->buf))) return rc;
        backend_buf_set(m->be, w->buf, 0, t->data, t->nbytes);
    }
    m->n_params += (size_t)rows * cols;
    return CS_OK;
}

/* vectors (norms, biases) are widened to F32 */
static int load_vector(model_t *m, const char *name, int n, backend_buf_t **out) {
    const st_tensor_t *t;
    int rc = get_tensor(m, name, 0, n, &t);
    if (rc || m->probe) return rc;
    float *h = malloc(sizeof(float) * (size_t)n);
    void *src = malloc(t->nbytes); /* the mapping may be misaligned for the dtype */
    if (!h || !src) { free(h); free(src); return cs_error_set(CS_ENOMEM, "out of memory"); }
    memcpy(src, t->data, t->nbytes);
    cs_to_f32(h, src, t->dtype, (size_t)n);
    free(src);
    backend_buf_t *d = backend_buf_alloc(m->be, sizeof(float) * (size_t)n);
    if (!d) { free(h); return cs_error_set(CS_ENOMEM, "weight %s: %s", name, cs_error_last()); }
    if ((rc = own(m, d))) { free(h); return rc; }
    backend_buf_set(m->be, d, 0, h, sizeof(float) * (size_t)n);
    free(h);
    *out = d;
    m->n_params += (size_t)n;
    return CS_OK;
}

static int load_norm(model_t *m, const char *name, int n, backend_weight_t *w) {
    backend_buf_t *d = NULL;
    int rc = load_vector(m, name, n, &d);
    if (rc) return rc;
    *w = (backend_weight_t){CS_DTYPE_F32, 1, n, d, NULL};
    return CS_OK;
}

void model_rope_inv_freq(const model_config_t *c, float *inv) {
    int hd = c->head_dim;
    for (int i = 0; i < hd / 2; i++) {
        float e = (float)(2 * i) / (float)hd;
        inv[i] = 1.0f / powf((float)c->rope_theta, e);
    }
    if (c->rope_scaling == ROPE_SCALING_LINEAR) {
        for (int i = 0; i < hd / 2; i++) inv[i] = inv[i] / (float)c->rope_factor;
    } else if (c->rope_scaling == ROPE_SCALING_LLAMA3) {
        /* transformers' _compute_llama3_parameters, in float32 */
        float factor = (float)c->rope_factor, lo = (float)c->rope_low_freq_factor, hi = (float)c->rope_high_freq_factor;
        float old = (float)c->rope_original_max_pos;
        float lo_wl = old / lo, hi_wl = old / hi;
        for (int i = 0; i < hd / 2; i++) {
            float f = inv[i];
            float wl = 2.0f * (float)M_PI / f;
            float scaled = wl > lo_wl ? f / factor : f;
            if (!(wl < hi_wl) && !(wl > lo_wl)) {
                float smooth = (old / wl - lo) / (hi - lo);
                scaled = (1.0f - smooth) * scaled / factor + smooth * scaled;
            }
            inv[i] = scaled;
        }
    }
}

/* A GGUF's per-frequency RoPE factors (rope_freqs.weight: what llama.cpp's converter writes for
 * Llama 3.1-style scaling, rope_scaling "llama3" folded into one factor per frequency):
 * llama.cpp divides each frequency by its factor, so inv_freq[i] /= factor[i]. inv NULL:
 * only checked (a probe refuses a bad tensor as a load does). */
static int gguf_rope_factors(model_t *m, float *inv, int half) {
    const st_tensor_t *t = find_tensor(m, "rope_freqs.weight");
    if (!t) return CS_OK;
    if (t->dtype != CS_DTYPE_F32 || t->n_dims != 1 || t->shape[0] != half)
        return cs_error_set(CS_EFORMAT, "rope_freqs.weight must be F32 of %d elements (head_dim / 2), not %s of %lld", half,
                            cs_dtype_name(t->dtype), (long long)(t->n_dims ? t->shape[0] : 0));
    for (int i = 0; i < half; i++) {
        float f;
        memcpy(&f, (const char *)t->data + sizeof(float) * (size_t)i, sizeof f); /* the file's alignment may be 1 */
        if (!(f > 0) || !isfinite(f))
            return cs_error_set(CS_EFORMAT, "rope_freqs.weight[%d] = %g: factors must be finite and > 0", i, (double)f);
        if (inv) inv[i] /= f;
    }
    return CS_OK;
}

static bool tensor_expected(const model_t *m, const char *name) {
    /* buffers some checkpoints carry that do not change the math */
    if (strstr(name, "rotary_emb.inv_freq")) return true;
    if (m->gg && strcmp(name, "rope_freqs.weight") == 0) return true; /* read by gguf_rope_factors */
    if (m->cfg.tie_word_embeddings && strcmp(name, "lm_head.weight") == 0) return true;
    return false;
}

static int prepare_weight(model_t *m, const backend_weight_t *w) {
    /* a quantized weight may gain a form of the backend's own (the VNNI int8 pack) beside its
     * bytes, which stay (other paths read them); a GGUF model's other weights stay as they are */
    bool keep = m->gg || cs_dtype_is_quant(w->dtype);
    if (keep && !cs_dtype_is_quant(w->dtype)) return CS_OK;
    int rc = backend_weight_prepare(m->be, w);
    if (rc < 0) return rc;
    if (keep) return CS_OK;
    if (rc == BACKEND_WEIGHT_HOST_UNUSED && w->host)
        (void)safetensors_release(m->st, w->host, (size_t)w->rows * w->cols * cs_dtype_size(w->dtype));
    return CS_OK;
}

size_t model_weights_released(const model_t *m) { return m->st ? safetensors_released_bytes(m->st) : 0; }

int model_load(const char *dir, backend_t *be, model_t **out) { return model_load_how(dir, be, MODEL_WEIGHTS_AUTO, out); }

size_t model_weights_copied(const model_t *m, size_t *huge) {
    return m->gg ? gguf_copied_bytes(m->gg, huge) : safetensors_copied_bytes(m->st, huge);
}

static int load(const char *dir, backend_t *be, model_weights_mem how, bool probe, model_t **out);

bool model_path_is_gguf(const char *path) {
    size_t n = strlen(path);
    struct stat sb;
    return n > 5 && !strcasecmp(path + n - 5, ".gguf") && !(stat(path, &sb) == 0 && S_ISDIR(sb.st_mode));
}

/* A "llama" GGUF's Q and K rows are permuted per head for interleaved-pair RoPE (llama.cpp's
 * converter: Hugging Face row h·hd + s·hd/2 + i is stored at h·hd + 2i + s). Rows are whole
 * blocks, so the rotate-half order comes back by moving rows: a host copy in HF order. */
static int unpermute_rows(model_t *m, st_tensor_t *t, int n_heads) {
    int64_t rows = t->shape[0], cols = t->n_dims == 2 ? t->shape[1] : 1;
    size_t rb = t->n_dims == 2 ? cs_dtype_row_bytes(t->dtype, cols) : cs_dtype_size(t->dtype);
    if (n_heads <= 0 || rows % n_heads || (rows / n_heads) % 2 || rb == 0)
        return cs_error_set(CS_ESHAPE, "tensor '%s': %lld rows do not split into %d heads of even size", t->name,
                            (long long)rows, n_heads);
    int64_t hd = rows / n_heads;
    uint8_t *p = cs_aligned_alloc(64, (size_t)rows * rb);
    if (!p) return cs_error_set(CS_ENOMEM, "out of memory");
    int rc = own_host(m, p);
    if (rc) return rc;
    for (int64_t h = 0; h < n_heads; h++)
        for (int64_t s = 0; s < 2; s++)
            for (int64_t i = 0; i < hd / 2; i++)
                memcpy(p + (size_t)(h * hd + s * hd / 2 + i) * rb, (const uint8_t *)t->data + (size_t)(h * hd + 2 * i + s) * rb, rb);
    t->data = p;
    return CS_OK;
}

/* m->gt: the GGUF's tensors as safetensors would have them (Hugging Face names and shapes,
 * rows in HF order) */
static int gguf_tensors(model_t *m) {
    size_t n = gguf_n_tensors(m->gg);
    m->gt = calloc(n ? n : 1, sizeof *m->gt);
    if (!m->gt) return cs_error_set(CS_ENOMEM, "out of memory");
    bool llama = m->cfg.arch == MODEL_ARCH_LLAMA;
    for (size_t i = 0; i < n; i++) {
        const gguf_tensor_t *g = gguf_tensor_at(m->gg, i);
        st_tensor_t *t = &m->gt[m->n_gt];
        char buf[256];
        if (!(t->name = strdup(rename_tensor(g->name, true, buf, sizeof buf)))) return cs_error_set(CS_ENOMEM, "out of memory");
        m->n_gt++;
        t->dtype = g->dtype;
        t->n_dims = g->n_dims;
        for (int d = 0; d < g->n_dims; d++) t->shape[d] = g->ne[g->n_dims - 1 - d];
        t->data = g->data;
        t->nbytes = g->nbytes;
        /* (a quantized vector is refused by get_tensor: not moved here) */
        if (llama && !m->probe && t->dtype != CS_DTYPE_COUNT && (t->n_dims == 2 || (t->n_dims == 1 && !cs_dtype_is_quant(t->dtype)))) {
            int rc = CS_OK;
            bool q = strstr(g->name, ".attn_q.") != NULL, k = strstr(g->name, ".attn_k.") != NULL;
            if (q || k) rc = unpermute_rows(m, t, q ? m->cfg.n_heads : m->cfg.n_kv_heads);
            if (rc) return rc;
        }
    }
    /* two file names for one tensor ("blk.1." and "blk.01.", or a literal "lm_head.weight"
     * beside "output.weight") would leave one of them silently unused */
    for (size_t i = 0; i < m->n_gt; i++)
        for (size_t j = i + 1; j < m->n_gt; j++)
            if (!strcmp(m->gt[i].name, m->gt[j].name))
                return cs_error_set(CS_EFORMAT, "%s: tensors '%s' and '%s' are both %s", gguf_path(m->gg),
                                    gguf_tensor_at(m->gg, i)->name, gguf_tensor_at(m->gg, j)->name, m->gt[i].name);
    return CS_OK;
}

int model_load_how(const char *dir, backend_t *be, model_weights_mem how, model_t **out) {
    return load(dir, be, how, false, out);
}

int model_probe(const char *dir, model_config_t *cfg) {
    model_t *m = NULL;
    int rc = load(dir, NULL, MODEL_WEIGHTS_MMAP, true, &m);
    if (!rc) *cfg = m->cfg;
    model_free(m);
    return rc;
}

/* two configs' fields that shape the weights or change the math, in config.json's names */
int model_config_compatible(const model_config_t *a, const model_config_t *b, char *why, size_t n) {
#define SAME(f, name, fmt)                                                                                        \
    if (a->f != b->f) {                                                                                            \
        snprintf(why, n, name ": " fmt " in the served model, " fmt " in the new one", a->f, b->f);                \
        return CS_ESHAPE;                                                                                          \
    }
    if (strcmp(a->arch_name, b->arch_name)) {
        snprintf(why, n, "architectures: %s in the served model, %s in the new one", a->arch_name, b->arch_name);
        return CS_ESHAPE;
    }
    SAME(vocab_size, "vocab_size", "%d")
    SAME(hidden_size, "hidden_size", "%d")
    SAME(intermediate_size, "intermediate_size", "%d")
    SAME(n_layers, "num_hidden_layers", "%d")
    SAME(n_heads, "num_attention_heads", "%d")
    SAME(n_kv_heads, "num_key_value_heads", "%d")
    SAME(head_dim, "head_dim", "%d")
    SAME(tie_word_embeddings, "tie_word_embeddings", "%d")
    SAME(attention_bias, "attention_bias", "%d")
    SAME(o_bias, "o_proj bias", "%d")
    SAME(mlp_bias, "mlp_bias", "%d")
    SAME(qk_norm, "q/k norm", "%d")
    SAME(sliding_window, "sliding_window", "%d")
    SAME(rms_norm_eps, "rms_norm_eps", "%g")
    SAME(rope_theta, "rope_theta", "%g")
    SAME(rope_scaling, "rope_scaling type", "%d")
    SAME(rope_factor, "rope_scaling.factor", "%g")
    SAME(rope_low_freq_factor, "rope_scaling.low_freq_factor", "%g")
    SAME(rope_high_freq_factor, "rope_scaling.high_freq_factor", "%g")
    SAME(rope_original_max_pos, "rope_scaling.original_max_position_embeddings", "%d")
#undef SAME
    return CS_OK;
}

struct lora_assist *model_assist(const model_t *m) { return m->assist; }

static int load(const char *dir, backend_t *be, model_weights_mem how, bool probe, model_t **out) {
    *out = NULL;
    model_t *m = calloc(1, sizeof *m);
    if (!m) return cs_error_set(CS_ENOMEM, "out of memory");
    m->be = be;
    m->probe = probe;
    m->uid = atomic_fetch_add(&model_count, 1) + 1;
    /* a backend that reads the weights in place in host memory streams them at every decode
     * step: there they go into huge pages (auto: where the kernel offers them). A device
     * backend copies them once to its memory: the mapping is enough. */
    bool copy = !probe && backend_caps(be)->host_memory &&
                (how == MODEL_WEIGHTS_COPY || (how == MODEL_WEIGHTS_AUTO && safetensors_huge_pages_offered()));
    int rc;
    if (model_path_is_gguf(dir)) {
        if ((rc = gguf_open(dir, copy ? ST_COPY_HUGE : ST_MMAP, &m->gg)) || (rc = model_config_from_gguf(m->gg, &m->cfg)) ||
            (rc = gguf_tensors(m)))
            goto err;
    } else {
        if ((rc = model_config_load(dir, &m->cfg))) goto err;
        if ((rc = safetensors_open_dir_how(dir, "model", copy ? ST_COPY_HUGE : ST_MMAP, &m->st))) goto err;
    }
    const model_config_t *c = &m->cfg;
    int H = c->hidden_size, I = c->intermediate_size, hd = c->head_dim;
    int qd = c->n_heads * hd, kvd = c->n_kv_heads * hd;
    char name[256];
    size_t n_used = 0;
    if ((rc = load_matrix(m, "model.embed_tokens.weight", c->vocab_size, H, &m->embed))) goto err;
    m->wdtype = m->embed.dtype;
    n_used++;
    if (c->tie_word_embeddings) {
        m->lm_head = m->embed;
    } else {
        if ((rc = load_matrix(m, "lm_head.weight", c->vocab_size, H, &m->lm_head))) goto err;
        n_used++;
    }
    if ((rc = load_norm(m, "model.norm.weight", H, &m->final_norm))) goto err;
    n_used++;
    m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
    if (!m->layers) { rc = cs_error_set(CS_ENOMEM, "out of memory"); goto err; }
#define L(fmt) (snprintf(name, sizeof name, "model.layers.%d." fmt, l), n_used++, name)
    for (int l = 0; l < c->n_layers; l++) {
        layer_w_t *w = &m->layers[l];
        if ((rc = load_norm(m, L("input_layernorm.weight"), H, &w->attn_norm))) goto err;
        if ((rc = load_norm(m, L("post_attention_layernorm.weight"), H, &w->ffn_norm))) goto err;
        if ((rc = load_proj(m, L("self_attn.q_proj.weight"), qd, H, &w->wq))) goto err;
        if ((rc = load_proj(m, L("self_attn.k_proj.weight"), kvd, H, &w->wk))) goto err;
        if ((rc = load_proj(m, L("self_attn.v_proj.weight"), kvd, H, &w->wv))) goto err;
        if ((rc = load_proj(m, L("self_attn.o_proj.weight"), H, qd, &w->wo))) goto err;
        if ((rc = load_proj(m, L("mlp.gate_proj.weight"), I, H, &w->w_gate))) goto err;
        if ((rc = load_proj(m, L("mlp.up_proj.weight"), I, H, &w->w_up))) goto err;
        if ((rc = load_proj(m, L("mlp.down_proj.weight"), H, I, &w->w_down))) goto err;
        if (c->attention_bias) {
            if ((rc = load_vector(m, L("self_attn.q_proj.bias"), qd, &w->bq))) goto err;
            if ((rc = load_vector(m, L("self_attn.k_proj.bias"), kvd, &w->bk))) goto err;
            if ((rc = load_vector(m, L("self_attn.v_proj.bias"), kvd, &w->bv))) goto err;
        }
        if (c->o_bias && (rc = load_vector(m, L("self_attn.o_proj.bias"), H, &w->bo))) goto err;
        if (c->mlp_bias) {
            if ((rc = load_vector(m, L("mlp.gate_proj.bias"), I, &w->b_gate))) goto err;
            if ((rc = load_vector(m, L("mlp.up_proj.bias"), I, &w->b_up))) goto err;
            if ((rc = load_vector(m, L("mlp.down_proj.bias"), H, &w->b_down))) goto err;
        }
        if (c->qk_norm) {
            if ((rc = load_norm(m, L("self_attn.q_norm.weight"), hd, &w->q_norm))) goto err;
            if ((rc = load_norm(m, L("self_attn.k_norm.weight"), hd, &w->k_norm))) goto err;
        }
    }
#undef L
    /* the matmul weights, all loaded: the backend may keep a form of its own beside each,
     * and where that form serves every op, the bytes in the file's memory are given back */
    if (m->gg && (rc = gguf_rope_factors(m, NULL, hd / 2))) goto err; /* before any repacking, and in a probe */
    if (!probe && (rc = prepare_weight(m, &m->lm_head))) goto err;
    for (int l = 0; !probe && l < c->n_layers; l++) {
        layer_w_t *w = &m->layers[l];
        const backend_weight_t *ws[] = {&w->wq, &w->wk, &w->wv, &w->wo, &w->w_gate, &w->w_up, &w->w_down};
        for (size_t k = 0; k < sizeof ws / sizeof ws[0]; k++)
            if ((rc = prepare_weight(m, ws[k]))) goto err;
    }
    /* a tensor we did not use would be silently ignored math: refuse it */
    size_t n_all = n_tensors(m);
    if (n_all > n_used) {
        for (size_t i = 0; i < n_all; i++) {
            const st_tensor_t *t = tensor_at(m, i);
            if (tensor_expected(m, t->name)) continue;
            bool used = strcmp(t->name, "model.embed_tokens.weight") == 0 || strcmp(t->name, "lm_head.weight") == 0 ||
                        strcmp(t->name, "model.norm.weight") == 0;
            int l;
            char rest[200];
            if (!used && sscanf(t->name, "model.layers.%d.%199s", &l, rest) == 2 && l >= 0 && l < c->n_layers) {
                static const char *const known[] = {
                    "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                    "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"};
                for (size_t k = 0; k < CS_ARRAY_LEN(known) && !used; k++) used = strcmp(rest, known[k]) == 0;
                if (!used && c->attention_bias)
                    used = !strcmp(rest, "self_attn.q_proj.bias") || !strcmp(rest, "self_attn.k_proj.bias") ||
                           !strcmp(rest, "self_attn.v_proj.bias");
                if (!used && c->o_bias) used = !strcmp(rest, "self_attn.o_proj.bias");
                if (!used && c->mlp_bias)
                    used = !strcmp(rest, "mlp.gate_proj.bias") || !strcmp(rest, "mlp.up_proj.bias") ||
                           !strcmp(rest, "mlp.down_proj.bias");
                if (!used && c->qk_norm) used = !strcmp(rest, "self_attn.q_norm.weight") || !strcmp(rest, "self_attn.k_norm.weight");
            }
            if (!used) {
                rc = cs_error_set(CS_EUNSUPPORTED, "unexpected tensor '%s' for %s (%s does not account for it)",
                                  t->name, c->arch_name, m->gg ? "its metadata" : "config.json");
                goto err;
            }
        }
    }
    if (probe) {
        *out = m;
        return CS_OK;
    }
    m->inv_freq = malloc(sizeof(float) * (size_t)(hd / 2));
    if (!m->inv_freq) { rc = cs_error_set(CS_ENOMEM, "out of memory"); goto err; }
    model_rope_inv_freq(c, m->inv_freq);
    if (m->gg && (rc = gguf_rope_factors(m, m->inv_freq, hd / 2))) goto err;
    if (!(m->inv_freq_buf = backend_buf_alloc(be, sizeof(float) * (size_t)(hd / 2)))) {
        rc = cs_error_set(CS_ENOMEM, "rotary frequencies: %s", cs_error_last());
        goto err;
    }
    if ((rc = own(m, m->inv_freq_buf))) goto err;
    backend_buf_set(be, m->inv_freq_buf, 0, m->inv_freq, sizeof(float) * (size_t)(hd / 2));
    *out = m;
    return CS_OK;
err:
    model_free(m);
    return rc;
}

static void free_acts(model_t *m) {
    backend_buf_t **bufs[] = {&m->x, &m->xb, &m->xb2, &m->q, &m->kb, &m->vb, &m->att, &m->hb, &m->hb2};
    for (size_t i = 0; i < CS_ARRAY_LEN(bufs); i++) { backend_buf_free(m->be, *bufs[i]); *bufs[i] = NULL; }
    free(m->pos);
    free(m->ids);
    free(m->slots);
    free(m->out_rows);
    m->pos = m->ids = m->slots = m->out_rows = NULL;
    m->act_cap = 0;
}

void model_free(model_t *m) {
    if (!m) return;
    if (m->be) {
        free_acts(m);
        backend_host_free(m->be, m->hx);
        backend_host_free(m->be, m->hy);
        backend_host_free(m->be, m->flags);
        backend_batch_free(m->be, m->batch);
        backend_buf_free(m->be, m->logits_buf);
        for (size_t i = 0; i < m->n_owned; i++) backend_buf_free(m->be, m->owned[i]);
        backend_graph_reset(m->be); /* graphs this model recorded name the buffers just freed */
    }
    free(m->cold);
    free(m->aseqs);
    free(m->lsegs);
    free(m->blocks);
    free(m->owned);
    for (size_t i = 0; i < m->n_host; i++) free(m->host_owned[i]);
    free(m->host_owned);
    free(m->layers);
    free(m->inv_freq);
    safetensors_free(m->st);
    gguf_free(m->gg);
    if (m->gt)
        for (size_t i = 0; i < m->n_gt; i++) free((char *)m->gt[i].name);
    free(m->gt);
    free(m);
}

static int ensure_acts(model_t *m, int n, int n_seqs) {
    if (n_seqs > m->seq_cap) {
        free(m->aseqs);
        free(m->lsegs);
        m->aseqs = malloc(sizeof *m->aseqs * (size_t)n_seqs);
        m->lsegs = malloc(sizeof *m->lsegs * (size_t)n_seqs);
        if (!m->aseqs || !m->lsegs) { m->seq_cap = 0; return cs_error_set(CS_ENOMEM, "out of memory"); }
        m->seq_cap = n_seqs;
    }
    if (n <= m->act_cap) return CS_OK;
    backend_graph_reset(m->be); /* recorded graphs name the buffers about to go */
    free_acts(m);
    const model_config_t *c = &m->cfg;
    size_t H = (size_t)c->hidden_size, qd = (size_t)c->n_heads * c->head_dim, kvd = (size_t)c->n_kv_heads * c->head_dim;
    m->x = backend_buf_alloc(m->be, sizeof(float) * n * H);
    m->xb = backend_buf_alloc(m->be, sizeof(float) * n * CS_MAX(H, qd));
    m->xb2 = backend_buf_alloc(m->be, sizeof(float) * n * H);
    m->q = backend_buf_alloc(m->be, sizeof(float) * n * qd);
    m->kb = backend_buf_alloc(m->be, sizeof(float) * n * kvd);
    m->vb = backend_buf_alloc(m->be, sizeof(float) * n * kvd);
    m->att = backend_buf_alloc(m->be, sizeof(float) * n * qd);
    m->hb = backend_buf_alloc(m->be, sizeof(float) * n * c->intermediate_size);
    m->hb2 = backend_buf_alloc(m->be, sizeof(float) * n * c->intermediate_size);
    m->pos = malloc(sizeof(int32_t) * n);
    m->ids = malloc(sizeof(int32_t) * n);
    m->slots = malloc(sizeof(int32_t) * n);
    m->out_rows = malloc(sizeof(int32_t) * n);
    if (!m->x || !m->xb || !m->xb2 || !m->q || !m->kb || !m->vb || !m->att || !m->hb || !m->hb2 ||
        !m->pos || !m->ids || !m->slots || !m->out_rows) {
        free_acts(m);
        return cs_error_set(CS_ENOMEM, "activations of %d tokens: %s", n, cs_error_last());
    }
    m->act_cap = n;
    return CS_OK;
}

/* ---- single sequence (generate, tests): a private paged cache with an identity table ---- */
model_seq_t *model_seq_new(model_t *m, int capacity, cs_dtype kv_dtype) {
    model_seq_t *s = calloc(1, sizeof *s);
    if (!s) { cs_error_set(CS_ENOMEM, "out of memory"); return NULL; }
    s->m = m;
    s->capacity = capacity;
    int nb = (capacity + KV_BLOCK_SIZE - 1) / KV_BLOCK_SIZE;
    kv_cache_params_t kp = {m->cfg.n_layers, m->cfg.n_kv_heads * m->cfg.head_dim,
                            (size_t)nb * kv_cache_block_bytes(m->cfg.n_layers, m->cfg.n_kv_heads * m->cfg.head_dim, kv_dtype),
                            kv_dtype};
    s->blocks = malloc(sizeof(int32_t) * (size_t)(nb ? nb : 1));
    int rc = s->blocks ? kv_cache_new(m->be, &kp, &s->kv) : CS_ENOMEM;
    if (rc) {
        char msg[400]; /* cs_error_set may not read the buffer it writes */
        snprintf(msg, sizeof msg, "%s", s->blocks ? cs_error_last() : "out of memory");
        model_seq_free(s);
        cs_error_set(rc, "KV cache of %d tokens: %s", capacity, msg);
        return NULL;
    }
    for (int i = 0; i < nb; i++) s->blocks[i] = kv_block_alloc(s->kv);
    return s;
}

void model_seq_free(model_seq_t *s) {
    if (!s) return;
    kv_cache_free(s->kv);
    free(s->blocks);
    free(s);
}

void model_seq_reset(model_seq_t *s) { s->len = 0; }

int model_forward(model_t *m, model_seq_t *s, const int32_t *ids, int n, const lora_adapter_t *lora, float *logits,
                  bool all_logits) {
    if (n <= 0) return cs_error_set(CS_EINVAL, "no tokens to run");
    if (s->len + n > s->capacity)
        return cs_error_set(CS_EINVAL, "sequence of %d tokens exceeds its KV cache capacity %d", s->len + n, s->capacity);
    model_batch_seq_t bs = {ids, n, s->len, s->blocks, lora, all_logits ? n : 1, NULL};
    int rc = model_forward_batch(m, s->kv, &bs, 1, logits);
    if (rc == CS_OK) s->len += n;
    return rc;
}

/* ---- the batched forward pass ---- */
/* The adapter slot of each run of consecutive sequences sharing an adapter, as LoRA
 * segments of the batch (the backend groups them: one shrink/expand pair per adapter and
 * projection, whatever the batch mixes). */
static int lora_segments(model_t *m, const model_batch_seq_t *seqs, int n_seqs, int *n_segs) {
    int r0 = 0, ns = 0;
    for (int i = 0; i < n_seqs;) {
        const lora_adapter_t *a = seqs[i].lora;
        backend_adapter_t *slot = seqs[i].slot;
        int rows = 0, j = i;
        for (; j < n_seqs && seqs[j].lora == a && seqs[j].slot == slot; j++) rows += seqs[j].n;
        if (a) {
            int rc = slot ? CS_OK : lora_adapter_slot((lora_adapter_t *)a, m->be, &slot);
            if (rc) return rc;
            int arrived = backend_adapter_arrived(m->be, slot);
            if (arrived < a->n_layers && !(m->assist && backend_caps(m->be)->host_assist)) {
                m->cold_st.waits++; /* nobody to assist: wait for the slot (the engine's wait mode keeps this rare) */
                while ((arrived = backend_adapter_arrived(m->be, slot)) < a->n_layers) {
                    if (lora_adapter_failed(a)) /* it will not come */
                        return cs_error_set(CS_EIO, "adapter '%s': its weights failed to load", a->name);
                    struct timespec ts = {0, 100000};
                    nanosleep(&ts, NULL);
                }
            }
            int dl = arrived >= a->n_layers ? INT_MAX : arrived;
            if (dl != INT_MAX) {
                if (m->n_cold == m->cold_cap) {
                    int nc = m->cold_cap ? 2 * m->cold_cap : 4;
                    cold_seg_t *p = realloc(m->cold, sizeof *p * (size_t)nc);
                    if (!p) return cs_error_set(CS_ENOMEM, "out of memory");
                    m->cold = p;
                    m->cold_cap = nc;
                }
                m->cold[m->n_cold++] = (cold_seg_t){.row0 = r0, .n = rows, .device_layers = dl, .ad = a};
            }
            m->lsegs[ns++] = (backend_lora_seg_desc_t){r0, rows, slot, dl};
        }
        r0 += rows;
        i = j;
    }
    *n_segs = ns;
    return CS_OK;
}

/* host room for the cold segments' rows: inputs (up to max(H, qd, I) wide), terms (up to
 * the widest group of outputs sharing an input), two flags each. Pinned memory: pinning
 * hundreds of MB takes milliseconds, so it is made once for the largest batch
 * (model_assist_reserve, at the engine's start) and, should a forward need more, grown by
 * doubling. */
static void cold_widths(const model_t *m, size_t *win, size_t *wout) {
    const model_config_t *c = &m->cfg;
    size_t H = (size_t)c->hidden_size, qd = (size_t)c->n_heads * c->head_dim, kvd = (size_t)c->n_kv_heads * c->head_dim;
    size_t I = (size_t)c->intermediate_size;
    *win = CS_MAX(CS_MAX(H, qd), I);
    *wout = CS_MAX(CS_MAX(qd + 2 * kvd, 2 * I), H);
}

static void *cold_grow(model_t *m, void *p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap && p) return p;
    size_t n = CS_MAX(need, 2 * *cap);
    backend_host_free(m->be, p);
    p = backend_host_alloc(m->be, elem * n);
    *cap = p ? n : 0;
    m->cold_st.pinned_allocs++;
    return p;
}

static int cold_reserve(model_t *m, size_t rows, int segs) {
    size_t win, wout, fc = (size_t)m->flags_cap;
    cold_widths(m, &win, &wout);
    m->hx = cold_grow(m, m->hx, &m->hx_cap, rows * win, sizeof(float));
    size_t ts = cs_dtype_size(lora_assist_terms_dtype(m->assist)); /* the terms: F32 or BF16 */
    m->hy = cold_grow(m, m->hy, &m->hy_cap, (rows * wout * ts + sizeof(float) - 1) / sizeof(float), sizeof(float));
    m->flags = cold_grow(m, m->flags, &fc, 3 * (size_t)segs, sizeof(uint32_t));
    m->flags_cap = (int)fc;
    if (!m->hx || !m->hy || !m->flags) return cs_error_set(CS_ENOMEM, "pinned host memory for the cold start's %zu rows", rows);
    return CS_OK;
}

int model_assist_reserve(model_t *m, int rows) {
    if (!model_can_assist(m) || rows <= 0) return CS_OK;
    return cold_reserve(m, (size_t)rows, 64);
}

static int cold_prepare(model_t *m) {
    size_t win, wout, rows = 0;
    cold_widths(m, &win, &wout);
    for (int i = 0; i < m->n_cold; i++) rows += (size_t)m->cold[i].n;
    int rc = cold_reserve(m, rows, m->n_cold);
    if (rc) return rc;
    /* the last forward ended synchronized, every flag waited for: they start again at 0 */
    memset(m->flags, 0, sizeof(uint32_t) * 3 * (size_t)m->n_cold);
    size_t r = 0;
    for (int i = 0; i < m->n_cold; i++) {
        cold_seg_t *cs = &m->cold[i];
        cs->hx = m->hx + r * win;
        cs->hy = (char *)m->hy + r * wout * cs_dtype_size(lora_assist_terms_dtype(m->assist));
        cs->xflag = m->flags + 3 * i;
        cs->done = m->flags + 3 * i + 1;
        cs->alive = m->flags + 3 * i + 2;
        cs->xval = cs->dval = 0;
        r += (size_t)cs->n;
    }
    return CS_OK;
}

/* A cold segment's LoRA terms of layer L for targets TS (sharing input X, DIN wide) from the
 * host: the rows go out (get_signal) and the workers start; cold_finish adds what they
 * return into YS. Returns false when the segment runs this layer on the device or adapts
 * none of TS here. */
static bool cold_start_job(model_t *m, cold_seg_t *cs, int l, const lora_target *ts, int nt, const backend_buf_t *x,
                           int din) {
    if (l < cs->device_layers) return false;
    cs_dtype ydt = lora_assist_terms_dtype(m->assist);
    lora_assist_job_t j = {.x = cs->hx, .n = cs->n, .ld_x = din, .x_flag = cs->xflag, .x_value = cs->xval + 1,
                           .done = cs->done, .alive = cs->alive, .y_dtype = ydt};
    uint32_t host = cs_flag_load(&cs->ad->host_layers);
    if (host <= (uint32_t)l || host == LORA_HOST_FAILED) { /* still streaming in from disk (or failed:
                                                            * the workers write zeros) */
        j.w_flag = &cs->ad->host_layers;
        j.w_value = (uint32_t)l + 1;
    }
    size_t yo = 0;
    for (int k = 0; k < nt; k++) {
        const lora_module_t *md = lora_adapter_module(cs->ad, l, ts[k]);
        if (md->rank <= 0) continue;
        j.mods[j.n_mods] = md;
        j.y[j.n_mods++] = cs->hy + yo * cs_dtype_size(ydt);
        yo += (size_t)cs->n * md->d_out;
    }
    if (!j.n_mods) return false;
    int parts = lora_assist_submit(m->assist, &j);
    CS_ASSERT(parts > 0); /* a few bytes of queue: out of memory here is fatal */
    cs->xval++;
    cs->dval += (uint32_t)parts;
    backend_get_signal(m->be, cs->hx, x, sizeof(float) * (size_t)cs->row0 * din, sizeof(float) * (size_t)cs->n * din,
                       cs->xflag, cs->xval);
    return true;
}

static void cold_finish(model_t *m, cold_seg_t *cs, int l, const lora_target *ts, int nt, backend_buf_t *const *ys) {
    cs_dtype ydt = lora_assist_terms_dtype(m->assist);
    size_t yo = 0;
    for (int k = 0; k < nt; k++) {
        const lora_module_t *md = lora_adapter_module(cs->ad, l, ts[k]);
        if (md->rank <= 0) continue;
        backend_wait_add(m->be, ys[k], sizeof(float) * (size_t)cs->row0 * md->d_out, cs->hy + yo * cs_dtype_size(ydt),
                         ydt, (size_t)cs->n * md->d_out, cs->done, cs->dval, cs->alive, l);
        yo += (size_t)cs->n * md->d_out;
    }
}

/* the host side of a group of targets for every cold segment: before the base GEMM starts
 * the copies out, after it (and the device's LoRA) adds the terms back */
static void cold_begin(model_t *m, int l, const lora_target *ts, int nt, const backend_buf_t *x, int din) {
    for (int i = 0; i < m->n_cold; i++) m->cold[i].started = cold_start_job(m, &m->cold[i], l, ts, nt, x, din);
}

static void cold_end(model_t *m, int l, const lora_target *ts, int nt, backend_buf_t *const *ys) {
    for (int i = 0; i < m->n_cold; i++)
        if (m->cold[i].started) cold_finish(m, &m->cold[i], l, ts, nt, ys);
}

void model_set_assist(model_t *m, lora_assist_t *pool) { m->assist = pool; }
bool model_can_assist(const model_t *m) { return m->assist && backend_caps(m->be)->host_assist; }
void model_get_cold_stats(const model_t *m, model_cold_stats_t *st) { *st = m->cold_st; }

static void apply_lora(model_t *m, backend_buf_t *y, const backend_buf_t *x, int n_segs, int layer, lora_target t) {
    if (!n_segs) return;
    int d_in, d_out;
    lora_target_dims(&m->cfg, t, &d_in, &d_out);
    backend_lora(m->be, y, x, m->batch, layer, (int)t, d_in, d_out);
}

/* the forward's ops on the uploaded batch: embeddings, the layers, the final norm and the
 * logits of the output rows (into m->logits_buf) */
static void forward_ops(model_t *m, kv_cache_t *kv, int T, int n_out, int n_segs) {
    const model_config_t *c = &m->cfg;
    backend_t *be = m->be;
    const backend_batch_t *bt = m->batch;
    cs_dtype kvt = kv_cache_dtype(kv);
    int H = c->hidden_size, I = c->intermediate_size, hd = c->head_dim, nh = c->n_heads, nkv = c->n_kv_heads;
    int kvd = nkv * hd;
    backend_embed(be, m->x, &m->embed, bt);
    for (int l = 0; l < c->n_layers; l++) {
        const layer_w_t *w = &m->layers[l];
        backend_buf_t *kc = kv_cache_k(kv, l), *vc = kv_cache_v(kv, l);
        for (int i = 0; i < m->n_cold; i++) { /* which path each streaming slot takes at this layer */
            if (l < m->cold[i].device_layers) {
                m->cold_st.device_layers++;
            } else {
                m->cold_st.host_layers++;
                m->cold_st.host_rows += (uint64_t)m->cold[i].n;
            }
        }
        backend_rmsnorm(be, m->xb, m->x, T, H, &w->attn_norm, c->rms_norm_eps);
        {
            /* the cold rows leave for the host right after the norm, so the host's LoRA
             * overlaps the base GEMMs; the terms come back after them */
            static const lora_target qkv[3] = {LORA_Q, LORA_K, LORA_V};
            backend_buf_t *const ys[3] = {m->q, m->kb, m->vb};
            const backend_weight_t *const ws[3] = {&w->wq, &w->wk, &w->wv};
            const backend_buf_t *const bs[3] = {w->bq, w->bk, w->bv};
            if (m->n_cold) cold_begin(m, l, qkv, 3, m->xb, H);
            backend_matmul_multi(be, ys, m->xb, T, ws, bs, 3);
            apply_lora(m, m->q, m->xb, n_segs, l, LORA_Q);
            apply_lora(m, m->kb, m->xb, n_segs, l, LORA_K);
            apply_lora(m, m->vb, m->xb, n_segs, l, LORA_V);
            if (m->n_cold) cold_end(m, l, qkv, 3, ys);
        }
        if (c->qk_norm) {
            backend_rmsnorm(be, m->q, m->q, T * nh, hd, &w->q_norm, c->rms_norm_eps);
            backend_rmsnorm(be, m->kb, m->kb, T * nkv, hd, &w->k_norm, c->rms_norm_eps);
        }
        backend_rope(be, m->q, nh, hd, bt, m->inv_freq_buf);
        backend_rope(be, m->kb, nkv, hd, bt, m->inv_freq_buf);
        backend_kv_store(be, kc, kvt, m->kb, bt, kvd);
        backend_kv_store(be, vc, kvt, m->vb, bt, kvd);
        backend_attention(be, m->att, m->q, kc, vc, kvt, bt, KV_BLOCK_SIZE, nh, nkv, hd, c->sliding_window);
        {
            static const lora_target o[1] = {LORA_O};
            backend_buf_t *const ys[1] = {m->xb2};
            if (m->n_cold) cold_begin(m, l, o, 1, m->att, nh * hd);
            backend_matmul(be, m->xb2, m->att, T, &w->wo, w->bo);
            apply_lora(m, m->xb2, m->att, n_segs, l, LORA_O);
            if (m->n_cold) cold_end(m, l, o, 1, ys);
        }
        backend_add(be, m->x, m->xb2, (size_t)T * H);

        backend_rmsnorm(be, m->xb, m->x, T, H, &w->ffn_norm, c->rms_norm_eps);
        {
            static const lora_target gu[2] = {LORA_GATE, LORA_UP};
            backend_buf_t *const ys[2] = {m->hb, m->hb2};
            const backend_weight_t *const ws[2] = {&w->w_gate, &w->w_up};
            const backend_buf_t *const bs[2] = {w->b_gate, w->b_up};
            if (m->n_cold) cold_begin(m, l, gu, 2, m->xb, H);
            backend_matmul_multi(be, ys, m->xb, T, ws, bs, 2);
            apply_lora(m, m->hb, m->xb, n_segs, l, LORA_GATE);
            apply_lora(m, m->hb2, m->xb, n_segs, l, LORA_UP);
            if (m->n_cold) cold_end(m, l, gu, 2, ys);
        }
        backend_silu_mul(be, m->hb, m->hb2, (size_t)T * I);
        {
            static const lora_target dn[1] = {LORA_DOWN};
            backend_buf_t *const ys[1] = {m->xb2};
            if (m->n_cold) cold_begin(m, l, dn, 1, m->hb, I);
            backend_matmul(be, m->xb2, m->hb, T, &w->w_down, w->b_down);
            apply_lora(m, m->xb2, m->hb, n_segs, l, LORA_DOWN);
            if (m->n_cold) cold_end(m, l, dn, 1, ys);
        }
        backend_add(be, m->x, m->xb2, (size_t)T * H);
    }
    if (n_out > 0) {
        backend_get_out_rows(be, m->xb2, m->x, bt, H);
        backend_rmsnorm(be, m->xb, m->xb2, n_out, H, &m->final_norm, c->rms_norm_eps);
        backend_matmul(be, m->logits_buf, m->xb, n_out, &m->lm_head, NULL);
    }
}

void model_release_logits(model_t *m, int keep_rows) {
    if (m->logits_cap <= keep_rows) return;
    backend_graph_reset(m->be); /* recorded graphs name the buffer about to go */
    backend_buf_free(m->be, m->logits_buf);
    m->logits_buf = NULL;
    m->logits_cap = 0;
}

int model_forward_batch(model_t *m, kv_cache_t *kv, const model_batch_seq_t *seqs, int n_seqs, float *logits) {
    const model_config_t *c = &m->cfg;
    backend_t *be = m->be;
    int T = 0, n_out = 0, n_blocks = 0;
    if (n_seqs <= 0) return cs_error_set(CS_EINVAL, "empty batch");
    for (int s = 0; s < n_seqs; s++) {
        const model_batch_seq_t *q = &seqs[s];
        if (q->n <= 0 || q->pos0 < 0) return cs_error_set(CS_EINVAL, "batch entry %d: no tokens to run", s);
        if (q->n_logits != 0 && q->n_logits != 1 && q->n_logits != q->n)
            return cs_error_set(CS_EINVAL, "batch entry %d: n_logits must be 0, 1 or n", s);
        if (q->lora && q->lora->n_layers != c->n_layers)
            return cs_error_set(CS_EINVAL, "adapter '%s' has %d layers, the model %d", q->lora->name, q->lora->n_layers,
                                c->n_layers);
        for (int i = 0; i < q->n; i++)
            if (q->ids[i] < 0 || q->ids[i] >= c->vocab_size)
                return cs_error_set(CS_EINVAL, "token id %d out of range [0, %d)", q->ids[i], c->vocab_size);
        T += q->n;
        n_out += q->n_logits;
        n_blocks += (q->pos0 + q->n + KV_BLOCK_SIZE - 1) / KV_BLOCK_SIZE;
    }
    int rc = ensure_acts(m, T, n_seqs);
    if (rc) return rc;
    if (n_blocks > m->blocks_cap) {
        free(m->blocks);
        if (!(m->blocks = malloc(sizeof(int32_t) * (size_t)n_blocks))) {
            m->blocks_cap = 0;
            return cs_error_set(CS_ENOMEM, "out of memory");
        }
        m->blocks_cap = n_blocks;
    }
    int row = 0, o = 0, blk = 0;
    for (int s = 0; s < n_seqs; s++) {
        const model_batch_seq_t *q = &seqs[s];
        int nb = (q->pos0 + q->n + KV_BLOCK_SIZE - 1) / KV_BLOCK_SIZE;
        m->aseqs[s] = (backend_seq_desc_t){row, q->n, q->pos0, blk};
        memcpy(m->blocks + blk, q->blocks, sizeof(int32_t) * (size_t)nb);
        blk += nb;
        for (int i = 0; i < q->n; i++, row++) {
            int p = q->pos0 + i;
            m->ids[row] = q->ids[i];
            m->pos[row] = p;
            m->slots[row] = q->blocks[p / KV_BLOCK_SIZE] * KV_BLOCK_SIZE + p % KV_BLOCK_SIZE;
            if (i >= q->n - q->n_logits) m->out_rows[o++] = row;
        }
    }
    int n_segs = 0;
    m->n_cold = 0;
    if ((rc = lora_segments(m, seqs, n_seqs, &n_segs))) return rc;
    if (m->n_cold) {
        if ((rc = cold_prepare(m))) return rc;
        m->cold_st.forwards++;
    }
    backend_batch_desc_t desc = {T, m->ids, m->pos, m->slots, n_seqs, m->aseqs, n_blocks, m->blocks, n_out, m->out_rows,
                                 n_segs, m->lsegs};
    if ((rc = backend_batch_upload(be, &m->batch, &desc))) return rc;
    if (n_out > m->logits_cap) {
        backend_graph_reset(be); /* recorded graphs name the buffer about to go */
        backend_buf_free(be, m->logits_buf);
        m->logits_buf = backend_buf_alloc(be, sizeof(float) * (size_t)n_out * c->vocab_size);
        m->logits_cap = m->logits_buf ? n_out : 0;
        if (!m->logits_buf) return cs_error_set(CS_ENOMEM, "%d rows of logits: %s", n_out, cs_error_last());
    }
    /* a decode step (one token and its logits per sequence) has launches fixed by its batch
     * size and whether adapters take part: a backend with device graphs replays it */
    bool decode_only = n_out == T && T == n_seqs;
    uint64_t gkey = (m->uid << 40) | ((uint64_t)T << 1) | (n_segs > 0);
    if (m->n_cold) decode_only = false; /* host-assisted ops are not a graph's */
    if (decode_only && kv_cache_id(kv) != m->graph_kv) { /* graphs of another cache name its pools */
        if (m->graph_kv) backend_graph_reset(be);
        m->graph_kv = kv_cache_id(kv);
    }
    if (!decode_only || !backend_graph_begin(be, gkey)) {
        forward_ops(m, kv, T, n_out, n_segs);
        if (decode_only) backend_graph_end(be);
    }
    if (n_out > 0) backend_buf_get(be, logits, m->logits_buf, 0, sizeof(float) * (size_t)n_out * c->vocab_size);
    backend_synchronize(be);
    return CS_OK;
}
