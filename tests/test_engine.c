/* test_engine.c: the step loop driven one iteration at a time on a tiny model written by
 * caraserve-mkmodel: a request whose adapter is still loading waits while others run in the
 * same iteration; an abort ends its request at the next iteration and returns every KV block;
 * a tiny KV budget forces preemption and still finishes everything with no block leaked;
 * every sample of n gets its tokens and exactly one finish, the request exactly one
 * request_done; beam search on the engine thread. (Exact logprobs against transformers are in test_ref_engine.py.) */
#include <check.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cpu_kernels/cpu_backend.h"
#include "engine/engine.h"
#include "engine/sched.h"
#include "sched/fcfs.h"
#include "testutil.h"

static char dir[] = "/tmp/cs_test_engine_XXXXXX";
static char model_dir[512], adapter_dir[512], model2_dir[512], wide_dir[512], cut_dir[512];
static backend_t *be;
static model_t *model;
static sched_t *fcfs;

typedef struct rec {
    int tokens[8];      /* per sample */
    int finishes[8];
    engine_finish last[8];
    int done;
    int events;
} rec_t;

static void sink(void *user, const engine_event_t *ev) {
    rec_t *r = user;
    r->events++;
    if (ev->has_token) r->tokens[ev->index]++;
    if (ev->finish != ENGINE_FINISH_NONE) {
        r->finishes[ev->index]++;
        r->last[ev->index] = ev->finish;
    }
    if (ev->request_done) r->done++;
}

static void wake(void *user) {
    engine_t **e = user;
    if (*e) engine_wake(*e);
}

static engine_request_t req(const int32_t *prompt, int n_prompt, int max_tokens, rec_t *r) {
    engine_request_t q = {.prompt = prompt, .n_prompt = n_prompt, .max_tokens = max_tokens, .ignore_eos = true,
                          .sink = sink, .user = r};
    sampling_params_default(&q.sampling);
    q.sampling.temperature = 0;
    return q;
}

static size_t kv_bytes_for_tokens(int tokens) {
    const model_config_t *c = model_get_config(model);
    return (size_t)(tokens / KV_BLOCK_SIZE) * kv_cache_block_bytes(c->n_layers, c->n_kv_heads * c->head_dim, CS_DTYPE_F32);
}

/* a new engine on the suite's model with fcfs and a KV cache of KV_TOKENS tokens (F32), the
 * rest of its parameters from EP; a failure fails the test */
static engine_t *engine_with(engine_params_t ep, int kv_tokens) {
    ep.sched = fcfs;
    ep.model = model;
    ep.kv_cache_bytes = kv_bytes_for_tokens(kv_tokens);
    engine_t *e = NULL;
    ck_assert_int_eq(engine_new(&ep, &e), CS_OK);
    return e;
}

/* E's stats, every KV block of which is free or cached: none leaked */
static engine_stats_t stats_no_leak(engine_t *e) {
    engine_stats_t st;
    engine_get_stats(e, &st);
    ck_assert_int_eq(st.kv.n_free + st.kv.n_cached, st.kv.n_blocks);
    return st;
}

/* p[i] = FIRST + i for i < n: a prompt of distinct ids */
static void ramp(int32_t *p, int n, int first) {
    for (int i = 0; i < n; i++) p[i] = first + i;
}

START_TEST(loading_adapter_does_not_block) {
    engine_t *e = NULL;
    lora_registry_t *reg;
    lora_registry_params_t lp = {.cfg = model_get_config(model), .on_loaded = wake, .user = &e};
    ck_assert_int_eq(lora_registry_new(&lp, &reg), CS_OK);
    ck_assert_int_eq(lora_registry_add(reg, "a", adapter_dir, NULL), CS_OK);
    engine_params_t ep = {.sched = fcfs, .model = model, .loras = reg, .kv_cache_bytes = kv_bytes_for_tokens(1024)};
    ck_assert_int_eq(engine_new(&ep, &e), CS_OK);
    int32_t p[5] = {3, 4, 5, 6, 7};
    rec_t ra = {0}, rb = {0};
    engine_request_t qa = req(p, 5, 4, &ra), qb = req(p, 5, 4, &rb);
    qa.adapter = "a";
    ck_assert_int_eq(engine_submit(e, &qa, NULL), CS_OK);
    ck_assert_int_eq(engine_submit(e, &qb, NULL), CS_OK);
    ck_assert_int_eq(engine_step(e), 1);      /* the base request runs; the adapter is loading */
    ck_assert_int_eq(rb.tokens[0], 1);
    ck_assert_int_eq(ra.events, 0);
    engine_run_until_idle(e);
    ck_assert_int_eq(ra.tokens[0], 4);
    ck_assert_int_eq(rb.tokens[0], 4);
    ck_assert_int_eq(ra.done + rb.done, 2);
    /* an unknown adapter is refused at submit, not later */
    qa.adapter = "nope";
    ck_assert_int_eq(engine_submit(e, &qa, NULL), CS_ENOTFOUND);
    engine_free(e);
    lora_registry_free(reg);
}
END_TEST

START_TEST(abort_within_one_iteration) {
    engine_t *e = engine_with((engine_params_t){0}, 512);
    int32_t p[40];
    ramp(p, 40, 3);
    rec_t r1 = {0}, r2 = {0};
    engine_request_t q1 = req(p, 40, 200, &r1), q2 = req(p + 1, 30, 5, &r2);
    uint64_t id1;
    ck_assert_int_eq(engine_submit(e, &q1, &id1), CS_OK);
    ck_assert_int_eq(engine_submit(e, &q2, NULL), CS_OK);
    for (int i = 0; i < 3; i++) engine_step(e);
    int before = r1.tokens[0];
    ck_assert_int_eq(engine_abort(e, id1), CS_OK);
    engine_step(e);
    ck_assert_int_eq(r1.finishes[0], 1);
    ck_assert_int_eq(r1.last[0], ENGINE_FINISH_ABORT);
    ck_assert_int_eq(r1.tokens[0], before);  /* nothing after the abort */
    ck_assert_int_eq(r1.done, 1);
    engine_run_until_idle(e);
    ck_assert_int_eq(r2.tokens[0], 5);
    ck_assert_int_eq(r2.last[0], ENGINE_FINISH_LENGTH);
    ck_assert_int_eq(engine_abort(e, id1), CS_OK); /* already gone: harmless */
    engine_step(e);
    ck_assert_int_eq(r1.finishes[0], 1);
    engine_stats_t st = stats_no_leak(e);
    ck_assert_int_eq(st.n_running + st.n_waiting, 0);
    engine_free(e);
}
END_TEST

START_TEST(preemption_no_leak) {
    engine_t *e = engine_with((engine_params_t){.max_model_len = 160}, 160);
    enum { N = 6 };
    int32_t p[N][60];
    rec_t r[N];
    memset(r, 0, sizeof r);
    for (int k = 0; k < N; k++) {
        for (int i = 0; i < 60; i++) p[k][i] = 3 + (i * 7 + k * 13) % 190;
        engine_request_t q = req(p[k], 60, 90, &r[k]);
        q.n = k == 2 ? 3 : 1;  /* a request of 3 samples among them */
        q.sampling.temperature = k == 2 ? 0.8f : 0;
        q.sampling.seed = 9;
        q.sampling.has_seed = true;
        ck_assert_int_eq(engine_submit(e, &q, NULL), CS_OK);
    }
    engine_run_until_idle(e);
    for (int k = 0; k < N; k++) {
        int n = k == 2 ? 3 : 1;
        for (int s = 0; s < n; s++) {
            ck_assert_int_eq(r[k].tokens[s], 90);
            ck_assert_int_eq(r[k].finishes[s], 1);
            ck_assert_int_eq(r[k].last[s], ENGINE_FINISH_LENGTH);
        }
        ck_assert_int_eq(r[k].done, 1);
    }
    ck_assert_int_gt(stats_no_leak(e).preemptions, 0);
    engine_free(e);
}
END_TEST

/* n samples share the prompt's full blocks; only the partial last block is copied */
START_TEST(samples_share_prompt_blocks) {
    engine_t *e = engine_with((engine_params_t){0}, 1024);
    int32_t p[40];
    ramp(p, 40, 3);
    rec_t r = {0};
    engine_request_t q = req(p, 40, 3, &r);
    q.n = 4;
    q.sampling.temperature = 1;
    ck_assert_int_eq(engine_submit(e, &q, NULL), CS_OK);
    ck_assert_int_eq(engine_step(e), 1);   /* the prompt, the fork, 4 first tokens */
    for (int i = 0; i < 4; i++) ck_assert_int_eq(r.tokens[i], 1);
    engine_stats_t st;
    engine_get_stats(e, &st);
    /* 40 tokens = 2 full blocks + 8: shared 2, plus 4 partial blocks (1 + 3 copies) */
    ck_assert_int_eq(st.kv.n_blocks - st.kv.n_free - st.kv.n_cached, 6);
    ck_assert_int_eq(st.n_running, 4);
    engine_run_until_idle(e);
    for (int i = 0; i < 4; i++) ck_assert_int_eq(r.tokens[i], 3);
    ck_assert_int_eq(r.done, 1);
    engine_free(e);
}
END_TEST

START_TEST(submit_validation) {
    engine_t *e = engine_with((engine_params_t){.max_num_seqs = 4}, 64);
    ck_assert_int_eq(engine_max_model_len(e), 64);
    int32_t p[70] = {0};
    rec_t r = {0};
    engine_request_t q = req(p, 70, 1, &r);
    ck_assert_int_eq(engine_submit(e, &q, NULL), CS_EINVAL);     /* prompt longer than the context */
    q = req(p, 10, 60, &r);
    ck_assert_int_eq(engine_submit(e, &q, NULL), CS_EINVAL);     /* prompt + max_tokens too long */
    q = req(p, 10, 5, &r);
    q.n = 5;
    ck_assert_int_eq(engine_submit(e, &q, NULL), CS_EINVAL);     /* n > max_num_seqs */
    q = req(p, 0, 5, &r);
    ck_assert_int_eq(engine_submit(e, &q, NULL), CS_EINVAL);     /* empty */
    p[3] = 100000;
    q = req(p, 10, 5, &r);
    ck_assert_int_eq(engine_submit(e, &q, NULL), CS_EINVAL);     /* id out of range */
    p[3] = 0;
    q = req(p, 10, -1, &r);                                       /* max_tokens: up to the context */
    ck_assert_int_eq(engine_submit(e, &q, NULL), CS_OK);
    engine_run_until_idle(e);
    ck_assert_int_eq(r.tokens[0], 54);
    ck_assert_int_eq(r.events, 54);
    /* a batch with one bad request queues nothing and names it; a good batch runs whole */
    rec_t rb[3];
    memset(rb, 0, sizeof rb);
    engine_request_t qs[3] = {req(p, 5, 3, &rb[0]), req(p, 70, 3, &rb[1]), req(p, 6, 3, &rb[2])};
    uint64_t ids[3] = {0};
    int bad = -1;
    ck_assert_int_eq(engine_submit_batch(e, qs, 3, ids, &bad), CS_EINVAL);
    ck_assert_int_eq(bad, 1);
    engine_run_until_idle(e);
    ck_assert_int_eq(rb[0].events + rb[2].events, 0);
    qs[1] = req(p, 7, 3, &rb[1]);
    ck_assert_int_eq(engine_submit_batch(e, qs, 3, ids, &bad), CS_OK);
    ck_assert(ids[0] && ids[1] == ids[0] + 1 && ids[2] == ids[1] + 1);
    ck_assert_int_eq(engine_step(e), 3);     /* all three in the first iteration */
    engine_run_until_idle(e);
    for (int i = 0; i < 3; i++) ck_assert_int_eq(rb[i].tokens[0], 3);
    engine_free(e);
}
END_TEST

/* the engine on its own thread, fed and aborted from this one (as the HTTP server does) */
typedef struct trec { pthread_mutex_t mu; int done, tokens; engine_finish fin; } trec_t;

static void tsink(void *user, const engine_event_t *ev) {
    trec_t *r = user;
    pthread_mutex_lock(&r->mu);
    if (ev->has_token) r->tokens++;
    if (ev->finish != ENGINE_FINISH_NONE) r->fin = ev->finish;
    if (ev->request_done) r->done++;
    pthread_mutex_unlock(&r->mu);
}

static int trec_done(trec_t *r) {
    pthread_mutex_lock(&r->mu);
    int d = r->done;
    pthread_mutex_unlock(&r->mu);
    return d;
}

START_TEST(engine_thread) {
    engine_t *e = engine_with((engine_params_t){0}, 1024);
    ck_assert_int_eq(engine_start(e), CS_OK);
    int32_t p[8] = {3, 4, 5, 6, 7, 8, 9, 10};
    enum { N = 12 };
    trec_t r[N];
    uint64_t ids[N];
    for (int k = 0; k < N; k++) {
        memset(&r[k], 0, sizeof r[k]);
        pthread_mutex_init(&r[k].mu, NULL);
        engine_request_t q = {0};
        sampling_params_default(&q.sampling);
        q.prompt = p;
        q.n_prompt = 8 - k % 4;
        q.max_tokens = k == 0 ? 900 : 20;
        q.ignore_eos = true;
        q.sink = tsink;
        q.user = &r[k];
        ck_assert_int_eq(engine_submit(e, &q, &ids[k]), CS_OK);
    }
    ck_assert_int_eq(engine_abort(e, ids[0]), CS_OK);
    for (int k = 0; k < N; k++) {
        for (int spin = 0; spin < 24000 && !trec_done(&r[k]); spin++) usleep(5000);
        ck_assert_int_eq(trec_done(&r[k]), 1);
        ck_assert_int_eq(r[k].fin, k == 0 ? ENGINE_FINISH_ABORT : ENGINE_FINISH_LENGTH);
        if (k) ck_assert_int_eq(r[k].tokens, 20);
    }
    engine_stats_t st;
    for (int spin = 0; spin < 24000; spin++) { /* stats are published after the step */
        engine_get_stats(e, &st);
        if (st.n_requests == 0) break;
        usleep(5000);
    }
    ck_assert_int_eq(st.n_requests, 0);
    engine_free(e);
    for (int k = 0; k < N; k++) pthread_mutex_destroy(&r[k].mu);
}
END_TEST


/* prompt logprobs (echo): computed chunk by chunk (300 tokens > the 128-row chunk), equal to
 * log_softmax of a whole-prompt reference forward; a second identical request (whose blocks
 * are in the prefix cache) gets the same values; max_tokens 0 scores without sampling */
typedef struct plp_rec {
    float lp[400];
    int32_t top[400 * 3];
    int got, tokens, finish;
    engine_finish fin;
    bool done;
} plp_rec_t;

static void plp_sink(void *user, const engine_event_t *ev) {
    plp_rec_t *r = user;
    if (ev->prompt_logprobs) {
        r->got++;
        ck_assert_int_eq(r->tokens, 0);   /* before any token */
        ck_assert_int_eq(ev->prompt_n_top, 3);
        memcpy(r->lp, ev->prompt_logprobs, sizeof(float) * (size_t)ev->n_prompt_tokens);
        memcpy(r->top, ev->prompt_top_ids, sizeof(int32_t) * 3 * (size_t)ev->n_prompt_tokens);
    }
    if (ev->has_token) r->tokens++;
    if (ev->finish) { r->finish++; r->fin = ev->finish; }
    if (ev->request_done) r->done = true;
}

/* _i == 1: the logits buffers are given back after every step with more rows than a decode
 * step's max_num_seqs (4): each 128-row chunk allocates them anew, with the same results.
 * _i == 2: BF16 KV pools, in the engine and in the single sequence it is held against */
START_TEST(prompt_logprobs) {
    enum { N = 300 };
    int32_t p[N];
    for (int i = 0; i < N; i++) p[i] = (i * 37 + 11) % 200;
    const int V = model_get_config(model)->vocab_size;
    float *ref = malloc(sizeof(float) * (size_t)N * V), *lsm = malloc(sizeof(float) * (size_t)V);
    cs_dtype kvt = _i == 2 ? CS_DTYPE_BF16 : CS_DTYPE_F32;
    model_seq_t *ms = model_seq_new(model, 512, kvt);
    ck_assert_int_eq(model_forward(model, ms, p, N, NULL, ref, true), CS_OK);
    engine_params_t ep = {.kv_cache_dtype = kvt};
    if (_i == 1) {
        ep.logits_keep_bytes = 1;
        ep.max_num_seqs = 4;
    }
    engine_t *e = engine_with(ep, 2048);
    for (int round = 0; round < 3; round++) {
        plp_rec_t r = {0};
        engine_request_t q = req(p, N, round == 2 ? 0 : 2, NULL);
        q.sink = plp_sink;
        q.user = &r;
        q.prompt_logprobs = true;
        q.prompt_top_logprobs = 3;
        ck_assert_int_eq(engine_submit(e, &q, NULL), CS_OK);
        engine_run_until_idle(e);
        ck_assert(r.done);
        ck_assert_int_eq(r.got, 1);
        ck_assert_int_eq(r.finish, 1);
        ck_assert_int_eq(r.tokens, round == 2 ? 0 : 2);
        ck_assert(round < 2 || r.fin == ENGINE_FINISH_LENGTH);
        ck_assert(isnan(r.lp[0]));
        for (int t = 1; t < N; t++) {
            sampling_log_softmax(lsm, ref + (size_t)(t - 1) * V, V);
            ck_assert_msg(fabsf(r.lp[t] - lsm[p[t]]) < 1e-4f, "pos %d: %f vs %f", t, r.lp[t], lsm[p[t]]);
            ck_assert_int_eq(r.top[t * 3], sampling_argmax(ref + (size_t)(t - 1) * V, V));
        }
    }
    engine_stats_t st = stats_no_leak(e);
    if (_i == 1) ck_assert_uint_ge(st.logits_releases, 3); /* 3 chunks of round 0 at least */
    else ck_assert_uint_eq(st.logits_releases, 0);
    ck_assert_int_eq(st.kv.dtype, kvt);
    engine_free(e);
    model_seq_free(ms);
    free(ref);
    free(lsm);
}
END_TEST

/* beam search (engine/beam.c) on the engine thread: width 1 is greedy; every beam's token
 * logprobs are the ones a scoring request (prompt logprobs of prompt + beam) gives; the beams
 * come ranked by cumulative logprob, distinct; an abort while the engine holds ends every
 * beam as aborted with one request_done; what a search cannot take is refused */
enum { BW = 4, BT = 6 };
typedef struct brec {
    pthread_mutex_t mu;
    int32_t tok[BW][BT];
    float lp[BW][BT];
    int n[BW], fin[BW], done;
    engine_finish last[BW];
    float plp[64];
    bool got_plp;
} brec_t;

static void bsink(void *user, const engine_event_t *ev) {
    brec_t *r = user;
    pthread_mutex_lock(&r->mu);
    if (ev->prompt_logprobs) {
        memcpy(r->plp, ev->prompt_logprobs, sizeof(float) * (size_t)CS_MIN(ev->n_prompt_tokens, 64));
        r->got_plp = true;
    }
    if (ev->has_token && r->n[ev->index] < BT) {
        r->tok[ev->index][r->n[ev->index]] = ev->token;
        r->lp[ev->index][r->n[ev->index]++] = ev->logprob;
    }
    if (ev->finish) { r->fin[ev->index]++; r->last[ev->index] = ev->finish; }
    if (ev->request_done) r->done++;
    pthread_mutex_unlock(&r->mu);
}

static int brec_done(brec_t *r) {
    pthread_mutex_lock(&r->mu);
    int d = r->done;
    pthread_mutex_unlock(&r->mu);
    return d;
}

static void brec_wait(brec_t *r) {
    for (int spin = 0; spin < 24000 && !brec_done(r); spin++) usleep(5000);
    ck_assert_int_eq(brec_done(r), 1);
}

static engine_request_t beam_req(const int32_t *p, int n, int width, brec_t *r) {
    engine_request_t q = req(p, n, BT, NULL);
    q.beam_search = true;
    q.n = width;
    q.length_penalty = 1;
    q.sampling.logprobs = 0;
    q.sink = bsink;
    q.user = r;
    return q;
}

START_TEST(beam_search) {
    engine_t *e = engine_with((engine_params_t){0}, 2048);
    int32_t p[5] = {3, 17, 42, 9, 100};
    brec_t r = {.done = 0};
    pthread_mutex_init(&r.mu, NULL);
    engine_request_t q = beam_req(p, 5, BW, &r);
    ck_assert_int_eq(engine_submit(e, &q, NULL), CS_EINVAL); /* no engine thread */
    ck_assert_int_eq(engine_start(e), CS_OK);
    q.n = BW + 7;
    ck_assert_int_eq(engine_submit(e, &q, NULL), CS_EINVAL);
    q.n = BW;
    const char *stop[] = {"x"};
    q.stop = stop;
    q.n_stop = 1;
    ck_assert_int_eq(engine_submit(e, &q, NULL), CS_EINVAL);
    q.n_stop = 0;
    q.sampling.repetition_penalty = 1.2f;
    ck_assert_int_eq(engine_submit(e, &q, NULL), CS_EINVAL);
    q.sampling.repetition_penalty = 1;
    q.prompt_logprobs = true;
    ck_assert_int_eq(engine_submit(e, &q, NULL), CS_OK);
    brec_wait(&r);
    ck_assert(r.got_plp);
    double prev = INFINITY;
    for (int b = 0; b < BW; b++) {
        ck_assert_int_eq(r.n[b], BT);
        ck_assert_int_eq(r.fin[b], 1);
        ck_assert_int_eq(r.last[b], ENGINE_FINISH_LENGTH);
        double cum = 0;
        for (int t = 0; t < BT; t++) cum += r.lp[b][t];
        ck_assert_msg(cum <= prev + 1e-6, "beam %d: %f after %f", b, cum, prev);
        prev = cum;
        for (int c = 0; c < b; c++) ck_assert(memcmp(r.tok[b], r.tok[c], sizeof r.tok[b]));
        /* its logprobs, scored by the engine as a prompt */
        int32_t full[5 + BT];
        memcpy(full, p, sizeof p);
        memcpy(full + 5, r.tok[b], sizeof r.tok[b]);
        brec_t s = {.done = 0};
        pthread_mutex_init(&s.mu, NULL);
        engine_request_t sq = req(full, 5 + BT, 1, NULL);
        sq.sink = bsink;
        sq.user = &s;
        sq.prompt_logprobs = true;
        ck_assert_int_eq(engine_submit(e, &sq, NULL), CS_OK);
        brec_wait(&s);
        for (int t = 0; t < BT; t++)
            ck_assert_msg(fabsf(s.plp[5 + t] - r.lp[b][t]) < 1e-4f, "beam %d token %d: %f vs %f", b, t, s.plp[5 + t],
                          r.lp[b][t]);
        pthread_mutex_destroy(&s.mu);
    }
    /* width 1 is greedy */
    brec_t g = {.done = 0}, one = {.done = 0};
    pthread_mutex_init(&g.mu, NULL);
    pthread_mutex_init(&one.mu, NULL);
    engine_request_t gq = req(p, 5, BT, NULL);
    gq.sink = bsink;
    gq.user = &g;
    ck_assert_int_eq(engine_submit(e, &gq, NULL), CS_OK);
    engine_request_t oq = beam_req(p, 5, 1, &one);
    ck_assert_int_eq(engine_submit(e, &oq, NULL), CS_OK);
    brec_wait(&g);
    brec_wait(&one);
    ck_assert_int_eq(one.n[0], BT);
    ck_assert_mem_eq(g.tok[0], one.tok[0], sizeof g.tok[0]);
    /* aborted while nothing runs: every beam ends aborted, once */
    brec_t a = {.done = 0};
    pthread_mutex_init(&a.mu, NULL);
    engine_set_pause(e, ENGINE_PAUSE_HOLD);
    engine_request_t aq = beam_req(p, 5, 3, &a);
    uint64_t id = 0;
    ck_assert_int_eq(engine_submit(e, &aq, &id), CS_OK);
    ck_assert_int_eq(engine_abort(e, id), CS_OK);
    engine_set_pause(e, ENGINE_RUN);
    brec_wait(&a);
    for (int b = 0; b < 3; b++) {
        ck_assert_int_eq(a.fin[b], 1);
        ck_assert_int_eq(a.last[b], ENGINE_FINISH_ABORT);
        ck_assert_int_eq(a.n[b], 0);
    }
    /* one still running when the engine is freed: it ends (aborted or done), once */
    brec_t f = {.done = 0};
    pthread_mutex_init(&f.mu, NULL);
    engine_request_t fq = beam_req(p, 5, 2, &f);
    ck_assert_int_eq(engine_submit(e, &fq, NULL), CS_OK);
    engine_free(e);
    ck_assert_int_eq(f.done, 1);
    pthread_mutex_destroy(&r.mu);
    pthread_mutex_destroy(&g.mu);
    pthread_mutex_destroy(&one.mu);
    pthread_mutex_destroy(&a.mu);
    pthread_mutex_destroy(&f.mu);
}
END_TEST

static void setup_files(void) {
    if (!mkdtemp(dir)) { perror("mkdtemp"); exit(1); }
    const char *bd = getenv("CS_BUILDDIR");
    char mk[600], cmd[8192];
    snprintf(mk, sizeof mk, "%s/caraserve-mkmodel", bd ? bd : ".");
    snprintf(model_dir, sizeof model_dir, "%s/m", dir);
    snprintf(adapter_dir, sizeof adapter_dir, "%s/a", dir);
    snprintf(cmd, sizeof cmd,
             "'%s' model --out '%s' --hidden 64 --layers 2 --heads 4 --kv-heads 2 --intermediate 96 --vocab 200 "
             "--max-pos 1024 >/dev/null && '%s' adapter --model '%s' --out '%s' --rank 8 --std 0.1 >/dev/null",
             mk, model_dir, mk, model_dir, adapter_dir);
    if (system(cmd) != 0) { fprintf(stderr, "test_engine: %s failed\n", cmd); exit(1); }
    /* base-weight updates: the same shapes with other weights, a wider model, and the other
     * weights with their file cut short */
    snprintf(model2_dir, sizeof model2_dir, "%s/m2", dir);
    snprintf(wide_dir, sizeof wide_dir, "%s/wide", dir);
    snprintf(cut_dir, sizeof cut_dir, "%s/cut", dir);
    snprintf(cmd, sizeof cmd,
             "'%s' model --out '%s' --hidden 64 --layers 2 --heads 4 --kv-heads 2 --intermediate 96 --vocab 200 "
             "--max-pos 1024 --seed 7 --init-std 0.2 >/dev/null && "
             "'%s' model --out '%s' --hidden 64 --layers 2 --heads 4 --kv-heads 2 --intermediate 128 --vocab 200 "
             "--max-pos 1024 >/dev/null && mkdir '%s' && cp '%s'/config.json '%s'/ && "
             "head -c 50000 '%s'/model.safetensors > '%s'/model.safetensors",
             mk, model2_dir, mk, wide_dir, cut_dir, model2_dir, cut_dir, model2_dir, cut_dir);
    if (system(cmd) != 0) { fprintf(stderr, "test_engine: %s failed\n", cmd); exit(1); }
}


/* ---- the policy seam: the engine obeys what a policy decides ---- */
static int lifo_steps, lifo_prefill, lifo_decode, lifo_seqs_max;
static void lifo_running(sched_t *s, const sched_view_t *v, int n, int *perm) {
    (void)s; (void)v;
    for (int i = 0; i < n; i++) perm[i] = i;
}
static void lifo_waiting(sched_t *s, const sched_view_t *v, int n, int *perm) { /* newest first */
    (void)s;
    for (int i = 0; i < n; i++) perm[i] = i;
    for (int i = 1; i < n; i++) /* by submission time, latest first (ids break ties) */
        for (int j = i; j > 0 && (v[perm[j]].req_id > v[perm[j - 1]].req_id); j--) {
            int t = perm[j]; perm[j] = perm[j - 1]; perm[j - 1] = t;
        }
}
static int lifo_chunk(sched_t *s, const sched_view_t *v, int max) { (void)s; (void)v; return CS_MIN(max, 4); }
static bool lifo_pass(sched_t *s, const sched_view_t *v) { (void)s; (void)v; return true; }
static int lifo_victim(sched_t *s, const sched_view_t *v, int n) { (void)s; (void)v; (void)n; return 0; }
static void lifo_feedback(sched_t *s, const sched_step_t *st) {
    (void)s;
    lifo_steps++;
    lifo_prefill += st->prefill_tokens;
    lifo_decode += st->decode_rows;
    lifo_seqs_max = CS_MAX(lifo_seqs_max, st->n_seqs);
    ck_assert(st->forward_ms >= 0);
}
static void lifo_free(sched_t *s) { (void)s; }
static const struct sched_i lifo_iface = {"lifo", lifo_running, lifo_waiting, lifo_chunk, lifo_pass, lifo_victim, NULL,
                                          lifo_feedback, lifo_free};

START_TEST(policy_decides) {
    engine_t *e = NULL;
    engine_params_t ep0 = {.model = model, .kv_cache_bytes = kv_bytes_for_tokens(512)};
    ck_assert_int_eq(engine_new(&ep0, &e), CS_EINVAL); /* no policy: refused */
    sched_t lifo = {&lifo_iface, NULL};
    engine_params_t ep = {.sched = &lifo, .model = model, .kv_cache_bytes = kv_bytes_for_tokens(512), .max_num_seqs = 1};
    ck_assert_int_eq(engine_new(&ep, &e), CS_OK);
    int32_t p[3][10];
    rec_t r[3];
    memset(r, 0, sizeof r);
    uint64_t id[3];
    for (int k = 0; k < 3; k++) {
        ramp(p[k], 10, 3 + 10 * k);
        engine_request_t q = req(p[k], 10, 2, &r[k]);
        ck_assert_int_eq(engine_submit(e, &q, &id[k]), CS_OK);
    }
    /* one sequence at a time, the newest first, 4 tokens per step: the third request's
     * prompt takes 3 steps (4 + 4 + 2) and gives its first token; the others wait */
    for (int i = 0; i < 3; i++) ck_assert_int_gt(engine_step(e), 0);
    ck_assert_int_eq(r[2].tokens[0], 1);
    ck_assert_int_eq(r[0].tokens[0] + r[1].tokens[0], 0);
    ck_assert_int_eq(lifo_prefill, 10);
    ck_assert_int_eq(lifo_steps, 3);
    while (r[0].done + r[1].done + r[2].done < 3) ck_assert_int_ge(engine_step(e), 0);
    ck_assert_int_eq(lifo_seqs_max, 1);
    ck_assert_int_eq(lifo_prefill, 30);
    ck_assert_int_eq(lifo_decode, 3); /* the second token of each */
    for (int k = 0; k < 3; k++) {
        ck_assert_int_eq(r[k].tokens[0], 2);
        ck_assert_int_eq(r[k].last[0], ENGINE_FINISH_LENGTH);
    }
    engine_free(e);
}
END_TEST

/* the engine's very first step runs only part of a prompt (no logits wanted): it used to
 * fail the request ("forward pass failed") when the logits buffer was still empty */
START_TEST(first_step_prefill_chunk) {
    engine_t *e = engine_with((engine_params_t){.max_num_batched_tokens = 8}, 512);
    int32_t p[20];
    ramp(p, 20, 5);
    rec_t r = {0};
    engine_request_t q = req(p, 20, 3, &r);
    ck_assert_int_eq(engine_submit(e, &q, NULL), CS_OK);
    while (!r.done) ck_assert_int_gt(engine_step(e), 0);
    ck_assert_int_eq(r.last[0], ENGINE_FINISH_LENGTH);
    ck_assert_int_eq(r.tokens[0], 3);
    engine_free(e);
}
END_TEST

/* ---- base-weight versions ---- */
typedef struct vrec {
    int32_t tok[64];
    float lp[64];
    int base[64];       /* each token's base_version */
    int n;
    engine_finish fin;
    bool done;
} vrec_t;

static void vsink(void *user, const engine_event_t *ev) {
    vrec_t *r = user;
    if (ev->has_token && r->n < 64) {
        r->tok[r->n] = ev->token;
        r->lp[r->n] = ev->logprob;
        r->base[r->n++] = ev->base_version;
    }
    if (ev->finish != ENGINE_FINISH_NONE) r->fin = ev->finish;
    if (ev->request_done) r->done = true;
}

static engine_request_t vreq(const int32_t *p, int n, int max_tokens, vrec_t *r) {
    engine_request_t q = {.prompt = p, .n_prompt = n, .max_tokens = max_tokens, .ignore_eos = true, .sink = vsink,
                          .user = r};
    sampling_params_default(&q.sampling);
    q.sampling.temperature = 0;
    q.sampling.logprobs = 0;
    return q;
}

/* REF: the tokens and logprobs of P on a fresh engine over DIR, alone */
static void fresh_run(const char *d, const int32_t *p, int n, int max_tokens, vrec_t *ref) {
    model_t *m = NULL;
    ck_assert_int_eq(model_load(d, be, &m), CS_OK);
    engine_params_t ep = {.sched = fcfs, .model = m, .own_model = true, .kv_cache_bytes = kv_bytes_for_tokens(512)};
    engine_t *e = NULL;
    ck_assert_int_eq(engine_new(&ep, &e), CS_OK);
    engine_request_t q = vreq(p, n, max_tokens, ref);
    ck_assert_int_eq(engine_submit(e, &q, NULL), CS_OK);
    while (!ref->done) engine_step(e);
    engine_free(e);
}

static void same_output(const vrec_t *a, const vrec_t *b) {
    ck_assert_int_eq(a->n, b->n);
    for (int i = 0; i < a->n; i++) {
        ck_assert_int_eq(a->tok[i], b->tok[i]);
        ck_assert_msg(a->lp[i] == b->lp[i], "token %d: logprob %.9g, fresh %.9g", i, a->lp[i], b->lp[i]);
    }
}

static int n_versions(engine_t *e, int *active) {
    engine_base_info_t bi[8];
    int n = engine_base_versions(e, bi, 8);
    *active = bi[0].version;
    return n;
}

/* an engine that owns its own copy of the suite's model, loaded from model_dir (base updates
 * and sleep free it) */
static engine_t *owned_engine(void) {
    model_t *m = NULL;
    ck_assert_int_eq(model_load(model_dir, be, &m), CS_OK);
    engine_params_t ep = {.sched = fcfs, .model = m, .own_model = true, .model_dir = model_dir,
                          .kv_cache_bytes = kv_bytes_for_tokens(512)};
    engine_t *e = NULL;
    ck_assert_int_eq(engine_new(&ep, &e), CS_OK);
    return e;
}

/* beside and in place; next_request, pause_keep and pinned versions; refusals change nothing */
START_TEST(base_update) {
    engine_t *e = owned_engine();
    int32_t p[12], p2[12];
    ramp(p, 12, 20);
    ramp(p2, 12, 40);
    vrec_t a = {0}, a_ref = {0}, b = {0}, b_ref = {0}, c = {0}, d = {0};
    fresh_run(model_dir, p, 12, 30, &a_ref);
    fresh_run(model2_dir, p2, 12, 20, &b_ref);

    /* A runs; the new weights arrive beside (next_request): A ends on version 1, B runs on 2 */
    engine_request_t qa = vreq(p, 12, 30, &a);
    ck_assert_int_eq(engine_submit(e, &qa, NULL), CS_OK);
    for (int i = 0; i < 5; i++) engine_step(e);
    int active = 0;
    engine_base_result_t res;
    /* refused, nothing changed, A unharmed: another shape, a cut file, no directory */
    const char *bad[] = {wide_dir, cut_dir, "/nonexistent/weights"};
    const char *why[] = {"intermediate_size: 96 in the served model, 128 in the new one", "exceed", "nonexistent"};
    for (int k = 0; k < 3; k++) {
        engine_base_update_t u = {.dir = bad[k], .apply = ENGINE_APPLY_PAUSE_KEEP};
        ck_assert_int_ne(engine_update_base(e, &u, &res), CS_OK);
        ck_assert_msg(strstr(cs_error_last(), why[k]), "%s: %s", bad[k], cs_error_last());
        ck_assert_int_eq(n_versions(e, &active), 1);
        ck_assert_int_eq(active, 1);
    }
    model_t *m2 = NULL;
    ck_assert_int_eq(model_load(model2_dir, be, &m2), CS_OK);
    engine_base_update_t u = {.model = m2, .dir = model2_dir, .label = "step-1", .keep_versions = 2};
    ck_assert_int_eq(engine_update_base(e, &u, &res), CS_OK);
    ck_assert_int_eq(res.version, 2);
    ck_assert(!res.in_place);
    ck_assert_int_eq(res.moved + res.aborted, 0);
    engine_request_t qb = vreq(p2, 12, 20, &b);
    ck_assert_int_eq(engine_submit(e, &qb, NULL), CS_OK);
    while (!a.done || !b.done) engine_step(e);
    same_output(&a, &a_ref); /* A finished on the weights it started on */
    same_output(&b, &b_ref); /* B ran on the new ones, as a fresh engine over them does */
    for (int i = 0; i < a.n; i++) ck_assert_int_eq(a.base[i], 1);
    for (int i = 0; i < b.n; i++) ck_assert_int_eq(b.base[i], 2);

    /* version 1 is kept (keep_versions 2): a request pinned to it runs on the old weights */
    vrec_t a2 = {0};
    engine_request_t qa2 = vreq(p, 12, 30, &a2);
    qa2.base_version = 1;
    ck_assert_int_eq(engine_submit(e, &qa2, NULL), CS_OK);
    while (!a2.done) engine_step(e);
    same_output(&a2, &a_ref);

    /* in place with pause_keep: C, running on 2, goes on with version 3 from some token on;
     * a pinned request on 2 ends with an error (its weights are gone) */
    engine_request_t qc = vreq(p2, 12, 20, &c), qd = vreq(p2, 12, 20, &d);
    qd.base_version = 2;
    ck_assert_int_eq(engine_submit(e, &qc, NULL), CS_OK);
    ck_assert_int_eq(engine_submit(e, &qd, NULL), CS_OK);
    for (int i = 0; i < 4; i++) engine_step(e);
    int before = c.n;
    ck_assert_int_gt(before, 0);
    engine_base_update_t ui = {.dir = model_dir, .apply = ENGINE_APPLY_PAUSE_KEEP};
    ck_assert_int_eq(engine_update_base(e, &ui, &res), CS_OK);
    ck_assert(res.in_place);
    ck_assert_int_eq(res.version, 3);
    ck_assert_int_eq(res.moved, 1);
    ck_assert(d.done);
    ck_assert_int_eq(d.fin, ENGINE_FINISH_ERROR);
    while (!c.done) engine_step(e);
    ck_assert_int_eq(c.n, 20);
    for (int i = 0; i < c.n; i++) ck_assert_int_eq(c.base[i], i < before ? 2 : 3);
    engine_base_info_t bi[4];
    int nv = engine_base_versions(e, bi, 4);
    ck_assert_int_eq(bi[0].version, 3);
    ck_assert_str_eq(bi[0].label, "3");
    for (int i = 1; i < nv; i++) ck_assert_int_ne(bi[i].version, 2); /* replaced in place */
    /* version 3 is the first weights again: the same output as at first */
    vrec_t a3 = {0};
    engine_request_t qa3 = vreq(p, 12, 30, &a3);
    ck_assert_int_eq(engine_submit(e, &qa3, NULL), CS_OK);
    while (!a3.done) engine_step(e);
    same_output(&a3, &a_ref);
    stats_no_leak(e);
    engine_free(e);
}
END_TEST

/* sleep levels 1 and 2 in the middle of a request: nothing runs asleep, the KV memory (and the
 * weights) go and come back, and the request goes on to the tokens of an undisturbed run */
START_TEST(sleep_wake) {
    engine_t *e = owned_engine();
    int32_t p[12];
    ramp(p, 12, 30);
    vrec_t a = {0}, ref = {0};
    fresh_run(model_dir, p, 12, 30, &ref);
    engine_request_t q = vreq(p, 12, 30, &a);
    ck_assert_int_eq(engine_submit(e, &q, NULL), CS_OK);
    for (int i = 0; i < 5; i++) engine_step(e);
    for (int level = 1; level <= 2; level++) {
        int before = a.n;
        ck_assert_int_eq(engine_sleep(e, level), CS_OK);
        ck_assert(engine_sleeping(e));
        engine_base_update_t u = {.dir = model2_dir};
        engine_base_result_t res;
        ck_assert_int_eq(engine_update_base(e, &u, &res), CS_EBUSY); /* asleep: refused */
        for (int i = 0; i < 3; i++) ck_assert_int_eq(engine_step(e), 0);
        engine_stats_t st;
        engine_get_stats(e, &st);
        ck_assert_int_eq(st.kv.n_blocks, 0); /* the memory is given back */
        ck_assert_int_eq(a.n, before);
        if (level == 2) { /* the KV back without the weights: still asleep */
            ck_assert_int_eq(engine_wake_up(e, false, true), CS_OK);
            ck_assert(engine_sleeping(e));
            ck_assert_int_eq(engine_step(e), 0);
        }
        ck_assert_int_eq(engine_wake_up(e, true, true), CS_OK);
        ck_assert(!engine_sleeping(e));
        for (int i = 0; i < 5; i++) engine_step(e);
        ck_assert_int_gt(a.n, before);
    }
    while (!a.done) engine_step(e);
    ck_assert_int_eq(a.n, ref.n);
    for (int i = 0; i < a.n; i++) { /* recomputed KV: the same tokens, logprobs to rounding */
        ck_assert_int_eq(a.tok[i], ref.tok[i]);
        ck_assert_msg(fabsf(a.lp[i] - ref.lp[i]) < 1e-4f, "token %d: %g vs %g", i, a.lp[i], ref.lp[i]);
    }
    stats_no_leak(e);
    engine_free(e);
}
END_TEST

int main(void) {
    setup_files();
    be = cpu_backend_new(&(cpu_backend_params_t){.n_threads = 2});
    fcfs = sched_fcfs_new(NULL);
    if (model_load(model_dir, be, &model)) { fprintf(stderr, "test_engine: %s\n", cs_error_last()); return 1; }
    Suite *s = suite_create("engine");
    const TTest *const tests[] = {
        loading_adapter_does_not_block, abort_within_one_iteration, preemption_no_leak,
        samples_share_prompt_blocks, submit_validation, engine_thread,
    };
    const TTest *const more[] = {policy_decides, first_step_prefill_chunk, beam_search, base_update, sleep_wake};
    TCase *tc = cs_tcase(s, "core", tests, CS_ARRAY_LEN(tests), 0);
    tcase_add_loop_test(tc, prompt_logprobs, 0, 3);
    cs_tcase_add_tests(tc, more, CS_ARRAY_LEN(more));
    int nf = cs_check_run(s, CK_NOFORK);
    model_free(model);
    sched_free(fcfs);
    backend_free(be);
    sampling_scratch_free();
    if (cs_rmtree(dir)) nf++;
    return nf ? 1 : 0;
}
