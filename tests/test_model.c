/* test_model.c: the forward pass on small checkpoints written here: prefill of a whole
 * prompt equals token-by-token decode through the KV cache, the fast kernels equal the
 * reference kernels, LoRA changes the output exactly as the explicit merged weight would,
 * and broken checkpoints (missing tensor, wrong shape, bad dtype, unexpected tensor) fail
 * with an error naming the tensor. (transformers is the reference in test_ref_forward.py.) */
#include <check.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cpu_kernels/cpu_backend.h"
#include "gpu_kernels/gpu_backend.h"
#include "engine/model.h"
#include "base/safetensors.h"
#include "engine/sampling.h"
#include "tests/testutil.h"

enum { HID = 64, LAYERS = 2, HEADS = 4, KVH = 2, HD = 16, INTER = 96, VOCAB = 50 };

typedef struct { char *name; int nd; int64_t shape[2]; float *f; } tw_t;

static cs_rng_t rng;
static bool misalign; /* write a 3-byte U8 buffer first so every later tensor sits at an odd address */
static char tmpl[] = "/tmp/cs_test_model_XXXXXX";
static char *root;

static float *randv(size_t n, float scale, float offset) {
    float *v = test_randv(&rng, n, scale);
    for (size_t i = 0; i < n; i++) v[i] += offset;
    return v;
}

/* writes a llama (or qwen3 with qk norm) checkpoint; skip names a tensor to leave out,
 * bad_shape names one to write with a wrong shape, extra adds an unexpected tensor */
static char *write_model(const char *sub, const char *arch, cs_dtype dt, const char *skip, const char *bad_shape,
                         const char *extra) {
    char *dir = cs_path_join(root, sub);
    mkdir(dir, 0755);
    bool qwen3 = !strcmp(arch, "Qwen3ForCausalLM");
    char cfg[1024];
    snprintf(cfg, sizeof cfg,
             "{\"architectures\": [\"%s\"], \"model_type\": \"%s\", \"hidden_size\": %d, \"intermediate_size\": %d,"
             " \"num_hidden_layers\": %d, \"num_attention_heads\": %d, \"num_key_value_heads\": %d, \"head_dim\": %d,"
             " \"vocab_size\": %d, \"rms_norm_eps\": 1e-6, \"rope_theta\": 10000.0, \"max_position_embeddings\": 256,"
             " \"hidden_act\": \"silu\", \"tie_word_embeddings\": false, \"torch_dtype\": \"%s\","
             " \"bos_token_id\": 1, \"eos_token_id\": 2}",
             arch, qwen3 ? "qwen3" : "llama", HID, INTER, LAYERS, HEADS, KVH, HD, VOCAB,
             dt == CS_DTYPE_BF16 ? "bfloat16" : "float32");
    char *p = cs_path_join(dir, "config.json");
    FILE *f = fopen(p, "w");
    fputs(cfg, f);
    fclose(f);
    free(p);
    tw_t t[64];
    int n = 0;
#define ADD(nm, r, c, sc, off)                                                                           \
    do {                                                                                                 \
        t[n].name = strdup(nm);                                                                          \
        t[n].nd = (r) ? 2 : 1;                                                                           \
        t[n].shape[0] = (r) ? (r) : (c);                                                                 \
        t[n].shape[1] = (c);                                                                             \
        t[n].f = randv((size_t)((r) ? (r) : 1) * (c), sc, off);                                          \
        n++;                                                                                             \
    } while (0)
    ADD("model.embed_tokens.weight", VOCAB, HID, 0.5f, 0);
    ADD("lm_head.weight", VOCAB, HID, 0.2f, 0);
    ADD("model.norm.weight", 0, HID, 0.2f, 1);
    char nm[128];
    for (int l = 0; l < LAYERS; l++) {
#define L(s) (snprintf(nm, sizeof nm, "model.layers.%d.%s", l, s), nm)
        ADD(L("input_layernorm.weight"), 0, HID, 0.2f, 1);
        ADD(L("post_attention_layernorm.weight"), 0, HID, 0.2f, 1);
        ADD(L("self_attn.q_proj.weight"), HEADS * HD, HID, 0.15f, 0);
        ADD(L("self_attn.k_proj.weight"), KVH * HD, HID, 0.15f, 0);
        ADD(L("self_attn.v_proj.weight"), KVH * HD, HID, 0.15f, 0);
        ADD(L("self_attn.o_proj.weight"), HID, HEADS * HD, 0.15f, 0);
        ADD(L("mlp.gate_proj.weight"), INTER, HID, 0.15f, 0);
        ADD(L("mlp.up_proj.weight"), INTER, HID, 0.15f, 0);
        ADD(L("mlp.down_proj.weight"), HID, INTER, 0.15f, 0);
        if (qwen3) {
            ADD(L("self_attn.q_norm.weight"), 0, HD, 0.2f, 1);
            ADD(L("self_attn.k_norm.weight"), 0, HD, 0.2f, 1);
        }
#undef L
    }
    if (extra) ADD(extra, 0, 4, 1, 0);
#undef ADD
    st_write_tensor_t wt[65];
    void *bufs[65];
    int k = 0;
    static const uint8_t odd[3] = {1, 2, 3};
    if (misalign) {
        wt[k] = (st_write_tensor_t){.name = "model.layers.0.self_attn.rotary_emb.inv_freq", .dtype = CS_DTYPE_U8,
                                    .n_dims = 1, .shape = {3}, .data = odd};
        bufs[k++] = NULL;
    }
    for (int i = 0; i < n; i++) {
        if (skip && !strcmp(t[i].name, skip)) continue;
        size_t cnt = (size_t)t[i].shape[0] * (t[i].nd == 2 ? t[i].shape[1] : 1);
        wt[k] = (st_write_tensor_t){.name = t[i].name, .dtype = dt, .n_dims = t[i].nd};
        wt[k].shape[0] = t[i].shape[0];
        wt[k].shape[1] = t[i].shape[1];
        if (bad_shape && !strcmp(t[i].name, bad_shape)) wt[k].shape[0] = t[i].shape[0] / 2, cnt /= 2;
        if (dt == CS_DTYPE_BF16) {
            uint16_t *h = malloc(cnt * 2);
            for (size_t j = 0; j < cnt; j++) h[j] = cs_f32_to_bf16(t[i].f[j]);
            bufs[k] = h;
        } else {
            bufs[k] = NULL;
        }
        wt[k].data = bufs[k] ? bufs[k] : (void *)t[i].f;
        k++;
    }
    p = cs_path_join(dir, "model.safetensors");
    ck_assert_int_eq(safetensors_write(p, wt, (size_t)k, NULL), 0);
    free(p);
    for (int i = 0; i < k; i++) free(bufs[i]);
    (void)odd;
    for (int i = 0; i < n; i++) { free(t[i].name); free(t[i].f); }
    return dir;
}

static void check_prefill_equals_decode(const char *arch, cs_dtype dt) {
    char sub[64];
    snprintf(sub, sizeof sub, "m_%s_%d", arch, dt);
    char *dir = write_model(sub, arch, dt, NULL, NULL, NULL);
    backend_t *fast = cpu_backend_new(&(cpu_backend_params_t){.n_threads = 2});
    backend_t *ref = cpu_backend_new(&(cpu_backend_params_t){.n_threads = 1, .reference = true});
    model_t *mf, *mr;
    ck_assert_msg(model_load(dir, fast, &mf) == 0, "%s", cs_error_last());
    ck_assert_msg(model_load(dir, ref, &mr) == 0, "%s", cs_error_last());
    enum { N = 23 };
    int32_t ids[N];
    for (int i = 0; i < N; i++) ids[i] = (int32_t)(cs_rng_next(&rng) % VOCAB);
    float *all = malloc(sizeof(float) * N * VOCAB), *allr = malloc(sizeof(float) * N * VOCAB);
    float *one = malloc(sizeof(float) * VOCAB);
    model_seq_t *s = model_seq_new(mf, N, CS_DTYPE_F32), *sr = model_seq_new(mr, N, CS_DTYPE_F32);
    ck_assert_int_eq(model_forward(mf, s, ids, N, NULL, all, true), 0);
    ck_assert_int_eq(model_forward(mr, sr, ids, N, NULL, allr, true), 0);
    ck_assert_msg(test_max_abs_diff(all, allr, (size_t)N * VOCAB) < 1e-4f, "fast vs reference kernels differ");
    /* the same prompt fed as a 5-token prefill then one token at a time */
    model_seq_reset(s);
    float *chunk = malloc(sizeof(float) * 5 * VOCAB);
    ck_assert_int_eq(model_forward(mf, s, ids, 5, NULL, chunk, true), 0);
    ck_assert(test_max_abs_diff(chunk, all, 5 * VOCAB) < 1e-4f);
    for (int i = 5; i < N; i++) {
        ck_assert_int_eq(model_forward(mf, s, &ids[i], 1, NULL, one, false), 0);
        float d = test_max_abs_diff(one, all + (size_t)i * VOCAB, VOCAB);
        ck_assert_msg(d < 1e-4f, "%s pos %d: decode differs from prefill by %g", arch, i, d);
    }
    /* the cache is full now */
    ck_assert_int_eq(model_forward(mf, s, ids, 1, NULL, one, false), CS_EINVAL);
    int32_t bad = VOCAB;
    model_seq_reset(s);
    ck_assert_int_eq(model_forward(mf, s, &bad, 1, NULL, one, false), CS_EINVAL);
    free(all); free(allr); free(one); free(chunk);
    model_seq_free(s); model_seq_free(sr);
    model_free(mf); model_free(mr);
    backend_free(fast); backend_free(ref);
    free(dir);
}

START_TEST(test_llama_f32) { check_prefill_equals_decode("LlamaForCausalLM", CS_DTYPE_F32); }
END_TEST

/* safetensors does not align tensors to their element size; such files are valid */
START_TEST(test_misaligned_tensors) {
    cs_rng_t saved = rng;
    char *a = write_model("aligned", "LlamaForCausalLM", CS_DTYPE_BF16, NULL, NULL, NULL);
    rng = saved;
    misalign = true;
    char *b = write_model("misaligned", "LlamaForCausalLM", CS_DTYPE_BF16, NULL, NULL, NULL);
    misalign = false;
    backend_t *be = cpu_backend_new(&(cpu_backend_params_t){.n_threads = 2});
    model_t *ma, *mb;
    ck_assert_msg(model_load(a, be, &ma) == 0, "%s", cs_error_last());
    ck_assert_msg(model_load(b, be, &mb) == 0, "%s", cs_error_last());
    int32_t ids[9] = {3, 1, 4, 1, 5, 9, 2, 6, 5};
    float la[9 * VOCAB], lb[9 * VOCAB];
    model_seq_t *sa = model_seq_new(ma, 9, CS_DTYPE_F32), *sb = model_seq_new(mb, 9, CS_DTYPE_F32);
    ck_assert_int_eq(model_forward(ma, sa, ids, 9, NULL, la, true), 0);
    ck_assert_int_eq(model_forward(mb, sb, ids, 9, NULL, lb, true), 0);
    ck_assert_float_eq(test_max_abs_diff(la, lb, 9 * VOCAB), 0.0f);
    model_seq_free(sa); model_seq_free(sb);
    model_free(ma); model_free(mb);
    backend_free(be);
    free(a); free(b);
}
END_TEST
/* the weights read into the process's memory (--no-mmap) or used in the file's mapping
 * (--mmap): the same bytes, so the same logits bit for bit; only the copy counts copied bytes */
START_TEST(test_weights_memory) {
    char *dir = write_model("wmem", "LlamaForCausalLM", CS_DTYPE_BF16, NULL, NULL, NULL);
    backend_t *be = cpu_backend_new(&(cpu_backend_params_t){.n_threads = 2});
    model_t *mm, *mc;
    ck_assert_msg(model_load_how(dir, be, MODEL_WEIGHTS_MMAP, &mm) == 0, "%s", cs_error_last());
    ck_assert_msg(model_load_how(dir, be, MODEL_WEIGHTS_COPY, &mc) == 0, "%s", cs_error_last());
    char *file = cs_path_join(dir, "model.safetensors");
    struct stat sb;
    ck_assert_int_eq(stat(file, &sb), 0);
    size_t huge = 1, copied = model_weights_copied(mm, &huge);
    ck_assert_uint_eq(copied, 0);
    ck_assert_uint_eq(huge, 0);
    copied = model_weights_copied(mc, &huge);
    ck_assert_uint_eq(copied, (size_t)sb.st_size);
    ck_assert_uint_le(huge, copied);
    int32_t ids[9] = {3, 1, 4, 1, 5, 9, 2, 6, 5};
    float lm[9 * VOCAB], lc[9 * VOCAB];
    model_seq_t *sm = model_seq_new(mm, 9, CS_DTYPE_F32), *sc = model_seq_new(mc, 9, CS_DTYPE_F32);
    ck_assert_int_eq(model_forward(mm, sm, ids, 9, NULL, lm, true), 0);
    ck_assert_int_eq(model_forward(mc, sc, ids, 9, NULL, lc, true), 0);
    ck_assert_int_eq(memcmp(lm, lc, sizeof lm), 0);
    model_seq_free(sm); model_seq_free(sc);
    model_free(mm); model_free(mc);
    backend_free(be);
    free(file); free(dir);
}
END_TEST
START_TEST(test_llama_bf16) { check_prefill_equals_decode("LlamaForCausalLM", CS_DTYPE_BF16); }
END_TEST
START_TEST(test_qwen3_f32) { check_prefill_equals_decode("Qwen3ForCausalLM", CS_DTYPE_F32); }
END_TEST

/* Recorded device graphs name one KV cache's pools. Two sequences of one model (two caches),
 * decoded in turn on the CUDA backend's code (the emulator) with graphs on, give what each
 * gives on the same backend without graphs: a graph recorded for one cache is never replayed
 * on the other (that wrote and read the first cache's pools). */
START_TEST(test_graphs_two_caches) {
    char *dir = write_model("m_graphs", "LlamaForCausalLM", CS_DTYPE_F32, NULL, NULL, NULL);
    backend_t *bg = cuda_emu_backend_new(&(cuda_backend_params_t){.graphs = true});
    backend_t *bp = cuda_emu_backend_new(&(cuda_backend_params_t){.graphs = false});
    ck_assert_msg(bg && bp, "%s", cs_error_last());
    model_t *mg, *mp;
    ck_assert_msg(model_load(dir, bg, &mg) == 0, "%s", cs_error_last());
    ck_assert_msg(model_load(dir, bp, &mp) == 0, "%s", cs_error_last());
    enum { N = 20, STEPS = 6 };
    model_seq_t *sg[2] = {model_seq_new(mg, N, CS_DTYPE_F32), model_seq_new(mg, N, CS_DTYPE_F32)};
    model_seq_t *sp[2] = {model_seq_new(mp, N, CS_DTYPE_F32), model_seq_new(mp, N, CS_DTYPE_F32)};
    float *lg = malloc(sizeof(float) * 8 * VOCAB), *lp = malloc(sizeof(float) * 8 * VOCAB);
    int32_t ids[2][8];
    for (int k = 0; k < 2; k++) {
        for (int i = 0; i < 8; i++) ids[k][i] = (int32_t)(cs_rng_next(&rng) % VOCAB);
        int n = k ? 8 : 5;   /* other prompt lengths: the caches' contents differ */
        ck_assert_int_eq(model_forward(mg, sg[k], ids[k], n, NULL, lg, false), 0);
        ck_assert_int_eq(model_forward(mp, sp[k], ids[k], n, NULL, lp, false), 0);
    }
    /* runs of steps on one sequence (a graph is recorded on a key's second step and replayed
     * from its third), then the other, then back */
    static const int order[] = {0, 1, 0};
    int done[2] = {0, 0};
    for (int r = 0; r < 3; r++) {
        int k = order[r];
        for (int j = 0; j < STEPS / 2 + 1 && done[k] < 8; j++) {
            int32_t t = ids[k][done[k]++];
            ck_assert_int_eq(model_forward(mg, sg[k], &t, 1, NULL, lg, false), 0);
            ck_assert_int_eq(model_forward(mp, sp[k], &t, 1, NULL, lp, false), 0);
            float d = test_max_abs_diff(lg, lp, VOCAB);
            ck_assert_msg(d < 1e-5f, "sequence %d, step %d: with graphs %g away from without", k, done[k], d);
        }
    }
    backend_stats_t st;
    backend_get_stats(bg, &st);
    ck_assert_msg(st.graph_replays > 0, "no graph was replayed: the test does not test graphs");
    free(lg);
    free(lp);
    for (int k = 0; k < 2; k++) { model_seq_free(sg[k]); model_seq_free(sp[k]); }
    model_free(mg);
    model_free(mp);
    backend_free(bg);
    backend_free(bp);
    free(dir);
}
END_TEST

/* Two models on one backend (two versions of the base weights) decoded in turn with graphs
 * on give what each gives without graphs: a graph one recorded is never replayed for the
 * other (that ran the first one's weights). */
START_TEST(test_graphs_two_models) {
    char *da = write_model("m_graphs_a", "LlamaForCausalLM", CS_DTYPE_F32, NULL, NULL, NULL);
    char *db = write_model("m_graphs_b", "LlamaForCausalLM", CS_DTYPE_F32, NULL, NULL, NULL);
    backend_t *bg = cuda_emu_backend_new(&(cuda_backend_params_t){.graphs = true});
    backend_t *bp = cuda_emu_backend_new(&(cuda_backend_params_t){.graphs = false});
    ck_assert_msg(bg && bp, "%s", cs_error_last());
    model_t *mg[2], *mp[2];
    for (int k = 0; k < 2; k++) {
        ck_assert_msg(model_load(k ? db : da, bg, &mg[k]) == 0, "%s", cs_error_last());
        ck_assert_msg(model_load(k ? db : da, bp, &mp[k]) == 0, "%s", cs_error_last());
    }
    model_seq_t *sg[2], *sp[2];
    float *lg = malloc(sizeof(float) * VOCAB), *lp = malloc(sizeof(float) * VOCAB);
    int32_t ids[12];
    for (int i = 0; i < 12; i++) ids[i] = (int32_t)(cs_rng_next(&rng) % VOCAB);
    for (int k = 0; k < 2; k++) { /* the same prompt: only the weights differ */
        sg[k] = model_seq_new(mg[k], 20, CS_DTYPE_F32);
        sp[k] = model_seq_new(mp[k], 20, CS_DTYPE_F32);
        ck_assert_int_eq(model_forward(mg[k], sg[k], ids, 4, NULL, lg, false), 0);
        ck_assert_int_eq(model_forward(mp[k], sp[k], ids, 4, NULL, lp, false), 0);
    }
    float apart = 0, *prev = malloc(sizeof(float) * VOCAB);
    for (int step = 4; step < 12; step++)
        for (int k = 0; k < 2; k++) { /* one token of each model in turn, the same batch shape */
            ck_assert_int_eq(model_forward(mg[k], sg[k], &ids[step], 1, NULL, lg, false), 0);
            ck_assert_int_eq(model_forward(mp[k], sp[k], &ids[step], 1, NULL, lp, false), 0);
            float d = test_max_abs_diff(lg, lp, VOCAB);
            ck_assert_msg(d < 1e-5f, "model %d, step %d: with graphs %g away from without", k, step, d);
            if (k == 1) apart = fmaxf(apart, test_max_abs_diff(lp, prev, VOCAB)); /* the same tokens, other weights */
            memcpy(prev, lp, sizeof(float) * VOCAB);
        }
    free(prev);
    ck_assert_msg(apart > 1e-3f, "the two models give the same logits (%g): the test cannot tell them apart", apart);
    backend_stats_t st;
    backend_get_stats(bg, &st);
    ck_assert_msg(st.graph_replays > 0, "no graph was replayed: the test does not test graphs");
    free(lg);
    free(lp);
    for (int k = 0; k < 2; k++) {
        model_seq_free(sg[k]);
        model_seq_free(sp[k]);
        model_free(mg[k]);
        model_free(mp[k]);
    }
    backend_free(bg);
    backend_free(bp);
    free(da);
    free(db);
}
END_TEST

static void expect_load_error(const char *sub, const char *skip, const char *bad_shape, const char *extra, int code,
                              const char *must_contain) {
    char *dir = write_model(sub, "LlamaForCausalLM", CS_DTYPE_F32, skip, bad_shape, extra);
    backend_t *be = cpu_backend_new(&(cpu_backend_params_t){.n_threads = 1});
    model_t *m = NULL;
    int rc = model_load(dir, be, &m);
    ck_assert_int_eq(rc, code);
    ck_assert_ptr_null(m);
    ck_assert_msg(strstr(cs_error_last(), must_contain), "error '%s' lacks '%s'", cs_error_last(), must_contain);
    backend_free(be);
    free(dir);
}

/* The CUDA backend on a second device (the emulator with CS_CUDA_EMU_DEVICES=2), created on
 * this thread and run, as the engine runs it, from another thread that never chose a device
 * (its current one is 0; the runtime refuses a launch on another device's stream): prefill
 * and decode with graphs give what device 0 gives, every launch and GEMM went to device 1,
 * none was refused, and no kernel was first loaded by a launch (all at creation: a lazy load
 * may wait for the device to go idle while a wait_add spins). */
struct dev_run {
    model_t *m;
    model_seq_t *s;
    const int32_t *ids;
    float *logits;      /* [5 + STEPS] rows of VOCAB: the prompt's last, then each step's */
    int rc;
};
enum { DEV_STEPS = 4 };

static void *dev_run_main(void *p) {
    struct dev_run *r = p;
    r->rc = model_forward(r->m, r->s, r->ids, 5, NULL, r->logits, false);
    for (int i = 0; i < DEV_STEPS && !r->rc; i++)
        r->rc = model_forward(r->m, r->s, &r->ids[5 + i], 1, NULL, r->logits + (size_t)(1 + i) * VOCAB, false);
    return NULL;
}

START_TEST(test_cuda_second_device) {
    setenv("CS_CUDA_EMU_DEVICES", "2", 1);
    char *dir = write_model("m_device", "LlamaForCausalLM", CS_DTYPE_F32, NULL, NULL, NULL);
    backend_t *b0 = cuda_emu_backend_new(&(cuda_backend_params_t){.device = 0, .graphs = true});
    backend_t *b1 = cuda_emu_backend_new(&(cuda_backend_params_t){.device = 1, .graphs = true});
    ck_assert_msg(b0 && b1, "%s", cs_error_last());
    model_t *m0, *m1;
    ck_assert_msg(model_load(dir, b0, &m0) == 0, "%s", cs_error_last());
    ck_assert_msg(model_load(dir, b1, &m1) == 0, "%s", cs_error_last());
    int32_t ids[5 + DEV_STEPS];
    for (int i = 0; i < 5 + DEV_STEPS; i++) ids[i] = (int32_t)(cs_rng_next(&rng) % VOCAB);
    size_t nl = (size_t)(1 + DEV_STEPS) * VOCAB;
    struct dev_run r0 = {m0, model_seq_new(m0, 16, CS_DTYPE_F32), ids, malloc(sizeof(float) * nl), -1};
    struct dev_run r1 = {m1, model_seq_new(m1, 16, CS_DTYPE_F32), ids, malloc(sizeof(float) * nl), -1};
    dev_run_main(&r0); /* device 0 from this thread */
    ck_assert_msg(r0.rc == 0, "%s", cs_error_last());
    cuda_emu_stats_t a, z;
    cuda_emu_get_stats(&a);
    pthread_t th;
    ck_assert_int_eq(pthread_create(&th, NULL, dev_run_main, &r1), 0);
    pthread_join(th, NULL);
    ck_assert_msg(r1.rc == 0, "%s", cs_error_last());
    cuda_emu_get_stats(&z);
    ck_assert_msg(z.wrong_device == a.wrong_device, "%llu launches refused: another device was current",
                  (unsigned long long)(z.wrong_device - a.wrong_device));
    ck_assert_msg(z.launches_on[0] == a.launches_on[0], "%llu launches went to device 0",
                  (unsigned long long)(z.launches_on[0] - a.launches_on[0]));
    ck_assert_msg(z.launches_on[1] - a.launches_on[1] >= 20, "only %llu launches on device 1",
                  (unsigned long long)(z.launches_on[1] - a.launches_on[1]));
    ck_assert_msg(z.lazy_loads == 0, "%llu kernels were loaded by their first launch, not at creation",
                  (unsigned long long)z.lazy_loads);
    ck_assert_uint_gt(z.kernels_loaded, 10);
    float d = test_max_abs_diff(r0.logits, r1.logits, nl);
    ck_assert_msg(d == 0.0f, "device 1 gives logits %g away from device 0's", d);
    backend_stats_t st;
    backend_get_stats(b1, &st);
    ck_assert_msg(st.graph_replays > 0, "no graph was replayed on device 1");
    free(r0.logits);
    free(r1.logits);
    model_seq_free(r0.s);
    model_seq_free(r1.s);
    model_free(m0);
    model_free(m1);
    backend_free(b0);
    backend_free(b1);
    free(dir);
}
END_TEST

START_TEST(test_missing_tensor) {
    expect_load_error("miss", "model.layers.1.mlp.up_proj.weight", NULL, NULL, CS_ENOTFOUND,
                      "model.layers.1.mlp.up_proj.weight");
}
END_TEST
START_TEST(test_wrong_shape) {
    expect_load_error("shape", NULL, "model.layers.0.self_attn.k_proj.weight", NULL, CS_ESHAPE, "expected shape [32, 64], got [16, 64]");
}
END_TEST
START_TEST(test_unexpected_tensor) {
    expect_load_error("extra", NULL, NULL, "model.layers.0.self_attn.q_proj.bias", CS_EUNSUPPORTED,
                      "model.layers.0.self_attn.q_proj.bias");
}
END_TEST

int main(void) {
    cs_rng_seed(&rng, 42);
    root = mkdtemp(tmpl);
    if (!root) return 99;
    Suite *s = suite_create("model");
    const TTest *const tests[] = {
        test_llama_f32, test_llama_bf16, test_misaligned_tensors, test_weights_memory, test_qwen3_f32,
        test_graphs_two_caches, test_graphs_two_models, test_cuda_second_device, test_missing_tensor, test_wrong_shape, test_unexpected_tensor
    };
    cs_tcase(s, "forward", tests, CS_ARRAY_LEN(tests), 120);
    int failed = cs_check_run(s, CK_FORK);
    if (cs_rmtree(root)) fprintf(stderr, "could not remove %s\n", root);
    return failed ? 1 : 0;
}
