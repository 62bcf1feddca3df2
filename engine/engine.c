/* engine.c: see engine.h. The engine thread owns every sequence, the KV cache and the
 * batch; other threads reach it only through the inbox (new requests, aborts) under a
 * mutex. A request with n samples runs its prompt once; when the prompt's last token has
 * been computed it forks into n sequences that share the prompt's full blocks (the
 * partial last block is copied), each with its own sampler seeded seed + i. */
#include "engine/engine.h"
#include "engine/beam.h"
#include "engine/sched.h"

#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "lora/assist.h"
#include "text/grammar/grammar.h"
#include "text/stop.h"

const char *const engine_finish_names[] = {"", "stop", "length", "abort", "error"};

typedef enum seq_state { SEQ_WAITING, SEQ_RUNNING, SEQ_DONE } seq_state;

#define LOGITS_KEEP_BYTES ((size_t)64 << 20) /* engine_params_t.logits_keep_bytes */

typedef struct req req_t;

typedef struct seq {
    req_t *req;
    int index;
    seq_state state;
    int32_t *tokens;            /* prompt + generated */
    int n_tokens, cap_tokens;
    int n_computed;             /* tokens whose KV is in the cache */
    int32_t *blocks;
    int n_blocks, cap_blocks;
    int n_hashed;               /* leading full blocks that are in the prefix table chain */
    uint64_t chain;             /* hash chain value after block n_hashed - 1 (root when 0) */
    int n_generated;
    bool admitted_once;
    uint64_t admit_order;       /* newest admitted = largest: preempted first */
    double t_first;             /* now_ms() of its first generated token (0: none yet) */
    sampler_t *sampler;
    grammar_matcher_t *gm;      /* the request's grammar (structured output) */
    bool gm_waiting;            /* grammar_gated and its gate token not generated yet */
    stop_matcher_t *stop;
    tokenizer_stream_t *detok;
    /* the adapter's device slot while running (lora_registry_device_acquire on dref, the
     * request's host reference at the time): never held while waiting or preempted */
    lora_ref_t *dref;
    backend_adapter_t *dslot;
    bool dwait;                 /* this iteration: running, but no slot was free */
    struct seq *prev, *next;    /* in the waiting or running list */
} seq_t;

/* a version of the base weights (engine_update_base) */
typedef struct base_ver {
    int version;
    char label[ENGINE_LABEL_MAX];
    char *dir;                  /* where its weights came from (NULL: not known) */
    model_t *model;             /* NULL only while an in-place update loads it */
    bool owned;                 /* the engine frees model */
    int refs;                   /* under mu: requests holding it */
    bool kept;                  /* under mu: among the versions kept (the active one is) */
    struct base_ver *next;      /* newest first: the head is active */
} base_ver_t;

struct req {
    uint64_t id;
    engine_request_t p;         /* deep copy; p.prompt, p.stop, ... owned */
    char *adapter;              /* NULL: base */
    lora_ref_t *lora;
    lora_pin_t *pin;            /* a pinned version, held from submission (lora_registry_pin) */
    lora_registry_t *loras;     /* for the unpin in req_free */
    struct engine *eng;         /* for the base's release in req_free */
    base_ver_t *base;           /* the base weights it runs on, held (refs) */
    int adapter_version;
    bool adapter_ready;
    bool lora_known;            /* lora_info holds the adapter's shape (lora_registry_info) */
    bool cold_counted, cold_assisted, cold_waited; /* the cold start (engine_stats_t), once each */
    int cold_auto;              /* --cold-start auto's byte model: SCHED_COLD_* chosen once (0: not yet) */
    bool disk_waited;           /* waited for its adapter's file (engine_stats_t.cold_disk_waits) */
    lora_adapter_info_t lora_info;
    bool no_publish;            /* moved to a newer version mid-way (engine_follow_active): its
                                 * blocks mix versions, so none more go to the prefix cache */
    uint64_t root;              /* prefix hash chain root */
    int n;
    seq_t **seqs;               /* [n]; only [0] exists until the fork */
    bool forked;
    int n_live;                 /* sequences not yet done */
    int n_cached;
    bool aborted;
    /* prompt logprobs (p.prompt_logprobs): filled chunk by chunk during seq 0's prefill */
    void *lists;                /* p.sampling's allowed ids and logit bias (sampling_lists_copy) */
    float *plp;                 /* [n_prompt] */
    int32_t *plp_rank;          /* [n_prompt] vLLM's rank of each prompt token */
    int32_t *plp_ids;           /* [n_prompt * p.prompt_top_logprobs] */
    float *plp_lps;
    bool plp_done;
    double t_submit, t_admit;   /* cs_time_ms(): submitted, first scheduled (0: not yet) */
    req_t *hnext;               /* id table chain */
    req_t *inext;               /* inbox link */
};

typedef struct seq_list { seq_t *head, *tail; int n; } seq_list_t;

/* an engine_follow_active call waiting for the engine thread */
typedef struct follow {
    char *name;
    bool done, abandoned;       /* abandoned: its caller timed out; the engine frees it */
    int moved;
    struct follow *next;
} follow_t;

/* an engine_update_base call waiting for the engine thread */
typedef enum job_op { JOB_UPDATE = 0, JOB_SLEEP, JOB_WAKE } job_op;

typedef struct base_job {
    job_op op;
    int level;                  /* JOB_SLEEP */
    bool weights, kv;           /* JOB_WAKE: what comes back */
    engine_base_update_t u;     /* dir and label: copies */
    bool done;
    int rc;
    char err[512];
    engine_base_result_t res;
    struct base_job *next;
} base_job_t;

#define REQ_BUCKETS 1024

struct engine {
    bool step_partial;          /* this step runs a request on an adapter still streaming in from disk */
    bool step_others;           /* ... or others (seq_device: never both) */
    engine_params_t p;
    model_t *model;             /* the active base version's (NULL: it failed to load) */
    backend_t *be;
    const model_config_t *cfg;  /* &mcfg: every version's shapes */
    model_config_t mcfg;
    kv_cache_t *kv;
    int max_model_len, vocab;
    int32_t *eos;
    int n_eos;

    seq_list_t waiting, running;
    /* the policy's views of one step (engine/sched.h) and the sequences behind them */
    sched_view_t *views;
    seq_t **vseqs;
    uint64_t *vids;             /* request ids of waiting views: a failure may free others */
    int *perm;
    int views_cap;
    req_t *reqs[REQ_BUCKETS];   /* engine-thread view of live requests */
    uint64_t admit_counter;

    /* batch scratch */
    model_batch_seq_t *batch;
    seq_t **batch_seq;
    int *batch_chunk;
    int batch_cap;
    float *logits;
    size_t logits_cap;      /* floats; a buffer over LOGITS_KEEP_BYTES is freed after its step */
    int32_t *banned;
    float *lp_scratch;
    /* structured output: the vocabulary as bytes (made on the first request with a grammar,
     * under vocab_mu), a token mask and the masked logits of one row */
    grammar_vocab_t *gvocab;
    pthread_mutex_t vocab_mu;
    uint32_t *gmask;
    float *glogits;

    /* shared with other threads */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    req_t *inbox_head, *inbox_tail;
    uint64_t *aborts;
    int n_aborts, cap_aborts;
    uint64_t next_id;
    bool stop_thread, thread_started, wake;
    pthread_t thread;
    engine_stats_t stats;       /* published copy, under mu */
    engine_seq_info_t *pub;     /* published sequences (engine_get_state), under mu */
    int n_pub, cap_pub;
    engine_seq_info_t *pub_work; /* the engine thread's next copy, swapped with pub */
    int cap_pub_work;
    engine_stats_t st;          /* engine thread's working copy */
    int n_live_requests;        /* submitted and not done (under mu) */
    engine_pause_mode pause;    /* under mu */
    uint64_t pause_gen;         /* under mu: engine_set_pause calls so far */
    uint64_t pause_seen;        /* under mu: the pause_gen the engine thread last acted on */
    pthread_cond_t pause_cv;    /* pause_seen (or flush_seen) moved */
    uint64_t flush_gen, flush_seen; /* under mu: engine_flush_prefix_cache calls, and those done */
    int flush_dropped;          /* under mu: blocks the last flush freed */
    follow_t *follows;          /* under mu: pending engine_follow_active calls */
    beam_set_t *beams;          /* the beam searches (their own lock) */
    base_ver_t *bases;          /* under mu (changed only by the engine thread): newest first */
    int base_last;              /* the newest version number handed out */
    base_job_t *base_jobs;      /* under mu: pending engine_update_base, engine_sleep, engine_wake_up calls */
    /* asleep (engine_sleep): the KV cache's memory given back (kv NULL), the weights freed;
     * the engine thread's, and copied under mu for engine_sleeping */
    bool kv_gone, weights_gone;
    bool sleeping_pub;          /* under mu */
    kv_cache_params_t kvp;      /* to make the cache again */
    struct lora_assist *assist; /* the weights' cold-start pool, to give them again */
    model_cold_stats_t cold_gone; /* the cold-start counts of base versions freed */
    pthread_cond_t follow_cv;
};

/* ---- helpers ---- */
static void list_push_back(seq_list_t *l, seq_t *s) {
    s->next = NULL;
    s->prev = l->tail;
    if (l->tail) l->tail->next = s; else l->head = s;
    l->tail = s;
    l->n++;
}

static void list_push_front(seq_list_t *l, seq_t *s) {
    s->prev = NULL;
    s->next = l->head;
    if (l->head) l->head->prev = s; else l->tail = s;
    l->head = s;
    l->n++;
}

static void list_remove(seq_list_t *l, seq_t *s) {
    if (s->prev) s->prev->next = s->next; else l->head = s->next;
    if (s->next) s->next->prev = s->prev; else l->tail = s->prev;
    s->prev = s->next = NULL;
    l->n--;
}

static double now_ms(void) { return cs_time_ms(); }

static int grow(void **p, int *cap, int need, size_t elem) {
    if (need <= *cap) return CS_OK;
    int nc = *cap ? *cap : 16;
    while (nc < need) nc *= 2;
    void *np = realloc(*p, (size_t)nc * elem);
    if (!np) return cs_error_set(CS_ENOMEM, "out of memory");
    *p = np;
    *cap = nc;
    return CS_OK;
}

static bool is_eos(const engine_t *e, int32_t t) {
    for (int i = 0; i < e->n_eos; i++)
        if (e->eos[i] == t) return true;
    return false;
}

static bool in_list(const int32_t *l, int n, int32_t t) {
    for (int i = 0; i < n; i++)
        if (l[i] == t) return true;
    return false;
}

/* ---- requests ---- */
static void req_table_add(engine_t *e, req_t *r) {
    req_t **b = &e->reqs[r->id % REQ_BUCKETS];
    r->hnext = *b;
    *b = r;
}

static req_t *req_table_find(engine_t *e, uint64_t id) {
    for (req_t *r = e->reqs[id % REQ_BUCKETS]; r; r = r->hnext)
        if (r->id == id) return r;
    return NULL;
}

static void req_table_remove(engine_t *e, req_t *r) {
    req_t **pp = &e->reqs[r->id % REQ_BUCKETS];
    while (*pp && *pp != r) pp = &(*pp)->hnext;
    if (*pp) *pp = r->hnext;
}

static void seq_free(seq_t *s) {
    if (!s) return;
    free(s->tokens);
    free(s->blocks);
    sampler_free(s->sampler);
    grammar_matcher_free(s->gm);
    stop_matcher_free(s->stop);
    tokenizer_stream_free(s->detok);
    free(s);
}

static void base_unref(engine_t *e, base_ver_t *b) {
    pthread_mutex_lock(&e->mu);
    b->refs--; /* a version nobody holds and nobody keeps is freed by the engine thread (bases_reap) */
    pthread_mutex_unlock(&e->mu);
}

/* the root of R's prefix chain: its adapter and version, and its base version (the first
 * one's chains are the adapter's alone) */
static uint64_t req_root(const req_t *r) {
    uint64_t h = kv_hash_root(r->adapter, r->adapter_version);
    int bv = r->base ? r->base->version : 1;
    return bv == 1 ? h : h ^ (0x9e3779b97f4a7c15ull * (uint64_t)(uint32_t)bv + 0xbf58476d1ce4e5b9ull);
}

/* R's prefix chain starts again from its root (nothing of it computed yet) */
static void req_rechain(req_t *r) {
    r->root = req_root(r);
    for (int i = 0; i < r->n; i++)
        if (r->seqs[i]) r->seqs[i]->chain = r->root;
}

static void req_free(req_t *r) {
    if (!r) return;
    if (r->pin) lora_registry_unpin(r->loras, r->pin);
    if (r->base) base_unref(r->eng, r->base);
    if (r->seqs)
        for (int i = 0; i < r->n; i++) seq_free(r->seqs[i]);
    free(r->seqs);
    free((void *)r->p.prompt);
    if (r->p.stop)
        for (int i = 0; i < r->p.n_stop; i++) free((void *)r->p.stop[i]);
    free((void *)r->p.stop);
    free((void *)r->p.stop_token_ids);
    free(r->lists);
    grammar_unref(r->p.grammar);
    free(r->adapter);
    free(r->plp);
    free(r->plp_rank);
    free(r->plp_ids);
    free(r->plp_lps);
    free(r);
}

static seq_t *seq_new(engine_t *e, req_t *r, int index, const int32_t *tokens, int n_tokens) {
    seq_t *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->req = r;
    s->index = index;
    s->cap_tokens = n_tokens + 16;
    s->tokens = malloc(sizeof(int32_t) * (size_t)s->cap_tokens);
    if (!s->tokens) goto err;
    memcpy(s->tokens, tokens, sizeof(int32_t) * (size_t)n_tokens);
    s->n_tokens = n_tokens;
    s->chain = r->root;
    int np = r->p.n_prompt - r->p.n_resumed; /* the resumed tail counts as output */
    s->sampler = sampler_new(&r->p.sampling, e->vocab, r->p.prompt, np, sampling_seed_for(&r->p.sampling, index));
    if (!s->sampler) goto err;
    sampler_resume(s->sampler, r->p.prompt + np, r->p.n_resumed);
    if (r->p.n_stop > 0 && !(s->stop = stop_matcher_new(r->p.stop, r->p.n_stop))) goto err;
    if (r->p.grammar && !(s->gm = grammar_matcher_new(r->p.grammar))) goto err;
    s->gm_waiting = s->gm && r->p.grammar_gated;
    for (int i = np; s->gm && i < r->p.n_prompt; i++) { /* a resumed sample's output so far */
        if (s->gm_waiting) s->gm_waiting = r->p.prompt[i] != r->p.grammar_gate_id;
        else if (!grammar_matcher_accept_token(s->gm, e->gvocab, r->p.prompt[i])) goto err;
    }
    if (e->p.tokenizer && !(s->detok = tokenizer_stream_new(e->p.tokenizer, !r->p.keep_special_text))) goto err;
    return s;
err:
    seq_free(s);
    return NULL;
}

/* ---- KV blocks of a sequence ---- */
static void seq_release_blocks(engine_t *e, seq_t *s) {
    /* newest blocks first, so they are the first evicted of this chain */
    for (int i = s->n_blocks - 1; i >= 0; i--) kv_block_unref(e->kv, s->blocks[i]);
    s->n_blocks = 0;
    s->n_computed = 0;
    s->n_hashed = 0;
    s->chain = s->req->root;
}

/* make the block table cover positions [0, upto); false when the cache has no block */
static bool seq_reserve(engine_t *e, seq_t *s, int upto) {
    int need = (upto + KV_BLOCK_SIZE - 1) / KV_BLOCK_SIZE;
    if (grow((void **)&s->blocks, &s->cap_blocks, need, sizeof(int32_t))) return false;
    while (s->n_blocks < need) {
        int32_t b = kv_block_alloc(e->kv);
        if (b < 0) return false;
        s->blocks[s->n_blocks++] = b;
    }
    return true;
}

/* take the longest cached prefix of full blocks (at least one token is left to compute) */
static void seq_match_prefix(engine_t *e, seq_t *s) {
    if (e->p.no_prefix_caching || s->n_blocks > 0 || s->req->no_publish) return; /* mixed versions: recompute */
    if (s->req->p.prompt_logprobs && !s->req->plp_done) return; /* every prompt row's logits are wanted */
    int full = (s->n_tokens - 1) / KV_BLOCK_SIZE;
    if (grow((void **)&s->blocks, &s->cap_blocks, full + 1, sizeof(int32_t))) return;
    for (int i = 0; i < full; i++) {
        const int32_t *t = s->tokens + (size_t)i * KV_BLOCK_SIZE;
        int32_t b = kv_prefix_lookup(e->kv, s->chain, t);
        if (b < 0) break;
        s->blocks[s->n_blocks++] = b;
        s->chain = kv_hash_block(s->chain, t);
        s->n_hashed++;
    }
    s->n_computed = s->n_blocks * KV_BLOCK_SIZE;
}

/* publish the blocks that became full */
static void seq_publish(engine_t *e, seq_t *s) {
    if (e->p.no_prefix_caching || s->req->no_publish) return;
    while ((s->n_hashed + 1) * KV_BLOCK_SIZE <= s->n_computed) {
        const int32_t *t = s->tokens + (size_t)s->n_hashed * KV_BLOCK_SIZE;
        kv_prefix_publish(e->kv, s->blocks[s->n_hashed], s->chain, t);
        s->chain = kv_hash_block(s->chain, t);
        s->n_hashed++;
    }
}

/* ---- events ---- */
static void emit(engine_t *e, req_t *r, int index, int n_generated, const sample_out_t *so, bool has_token,
                 const char *text, size_t text_len, engine_finish fin, int err, const char *msg, bool done) {
    (void)e;
    int32_t ids[SAMPLING_MAX_LOGPROBS];
    float lps[SAMPLING_MAX_LOGPROBS];
    engine_event_t ev = {0};
    ev.request_id = r->id;
    ev.index = index;
    ev.has_token = has_token;
    if (has_token && so) {
        ev.token = so->token;
        if (r->p.sampling.logprobs >= 0) {
            ev.logprob = so->logprob;
            ev.kept_logmass = so->kept_logmass;
            ev.n_top = so->n_top;
            for (int i = 0; i < so->n_top; i++) { ids[i] = so->top[i].id; lps[i] = so->top[i].logprob; }
            ev.top_ids = ids;
            ev.top_logprobs = lps;
        }
    }
    ev.text = text ? text : "";
    ev.text_len = text ? text_len : 0;
    ev.finish = fin;
    ev.error = err;
    ev.error_msg = msg;
    ev.n_prompt_tokens = r->p.n_prompt;
    ev.n_cached_tokens = r->n_cached;
    ev.n_generated = n_generated;
    ev.adapter_version = r->adapter_version;
    ev.base_version = r->base ? r->base->version : 1;
    ev.queue_ms = r->t_admit > 0 ? r->t_admit - r->t_submit : 0;
    ev.request_done = done;
    if (r->p.sink) r->p.sink(r->p.user, &ev);
}

static void req_done(engine_t *e, req_t *r) {
    if (r->lora) lora_registry_release(e->p.loras, r->lora);
    r->lora = NULL;
    req_table_remove(e, r);
    req_free(r);
    e->st.requests_done++;
    pthread_mutex_lock(&e->mu);
    e->n_live_requests--;
    pthread_mutex_unlock(&e->mu);
}

/* S stops running (preempted, finished, moved to another version): its slot may go */
static void seq_device_drop(engine_t *e, seq_t *s) {
    if (!s->dref) return;
    lora_registry_device_release(e->p.loras, s->dref);
    s->dref = NULL;
    s->dslot = NULL;
}

/* End sequence s (removing it from its list) and, with its last sequence, the request
 * (freed: do not touch r afterwards when this returns true). Ending seq 0 of a request
 * of n samples that has not forked yet ends every sample. */
static bool seq_finish(engine_t *e, seq_t *s, engine_finish fin, int err, const char *msg, const sample_out_t *so,
                       bool has_token, const char *text, size_t text_len) {
    req_t *r = s->req;
    seq_device_drop(e, s);
    if (s->state == SEQ_WAITING) list_remove(&e->waiting, s);
    else if (s->state == SEQ_RUNNING) list_remove(&e->running, s);
    s->state = SEQ_DONE;
    seq_release_blocks(e, s);
    if (!r->forked)
        for (int i = 1; i < r->n; i++) emit(e, r, i, 0, NULL, false, NULL, 0, fin, err, msg, false);
    bool done = --r->n_live == 0;
    emit(e, r, s->index, s->n_generated, so, has_token, text, text_len, fin, err, msg, done);
    if (done) req_done(e, r);
    return done;
}

static void req_fail(engine_t *e, req_t *r, engine_finish fin, int err, const char *msg) {
    int n = r->forked ? r->n : 1;
    for (int i = 0; i < n; i++) {
        seq_t *s = r->seqs[i];
        if (!s || s->state == SEQ_DONE) continue;
        if (seq_finish(e, s, fin, err, msg, NULL, false, NULL, 0)) return;
    }
}

/* R's adapter failed part way in from disk (lora_adapter_failed): R fails with the load's
 * error; the adapter's other requests find it too, and the rest go on */
static void req_fail_adapter(engine_t *e, req_t *r) {
    char msg[1024];
    int rc = lora_registry_ref_failed(e->p.loras, r->lora);
    if (!rc) rc = cs_error_set(CS_EIO, "adapter '%s': its weights failed to load", r->adapter);
    snprintf(msg, sizeof msg, "%s", cs_error_last());
    req_fail(e, r, ENGINE_FINISH_ERROR, rc, msg);
}

/* ---- inbox ---- */
static void take_inbox(engine_t *e) {
    pthread_mutex_lock(&e->mu);
    req_t *in = e->inbox_head;
    e->inbox_head = e->inbox_tail = NULL;
    uint64_t *ab = NULL;
    int n_ab = e->n_aborts;
    if (n_ab) {
        ab = malloc(sizeof *ab * (size_t)n_ab);
        if (ab) memcpy(ab, e->aborts, sizeof *ab * (size_t)n_ab);
        e->n_aborts = 0;
    }
    e->wake = false;
    pthread_mutex_unlock(&e->mu);
    for (req_t *r = in, *nx; r; r = nx) {
        nx = r->inext;
        req_table_add(e, r);
        seq_t *s = r->seqs[0];
        s->state = SEQ_WAITING;
        list_push_back(&e->waiting, s);
    }
    for (int i = 0; ab && i < n_ab; i++) {
        req_t *r = req_table_find(e, ab[i]);
        if (r) req_fail(e, r, ENGINE_FINISH_ABORT, 0, NULL);
    }
    free(ab);
}

/* ---- device slots ---- */
static void view_fill(engine_t *e, seq_t *s, sched_view_t *v);

/* the cold-start mode of S, whose slot has ARRIVED of its layers: the policy's choice, else
 * --cold-start; assisting only where the model can. auto: the byte model (lora_cold_cost),
 * once per request, on its rows still to compute: a long prompt waits for the slot rather
 * than send its rows over the link the slot streams over, a short one is assisted */
static int cold_mode(engine_t *e, seq_t *s, int arrived) {
    req_t *r = s->req;
    int m = e->p.cold_start;
    if (e->p.sched->iface->cold_start) {
        sched_view_t v;
        view_fill(e, s, &v);
        int pm = e->p.sched->iface->cold_start(e->p.sched, &v);
        if (pm != SCHED_COLD_DEFAULT) m = pm;
    }
    model_t *bm = r->base->model;
    bool can = bm && model_can_assist(bm);
    if (m == SCHED_COLD_DEFAULT && can) {
        if (!r->cold_auto) {
            lora_cold_cost_t c;
            lora_cold_cost(r->lora->adapter, arrived, CS_MAX(1, s->n_tokens - s->n_computed),
                           lora_assist_terms_dtype(model_assist(bm)), &c);
            r->cold_auto = lora_cold_prefer_assist(&c) ? SCHED_COLD_ASSIST : SCHED_COLD_WAIT;
            if (r->cold_auto == SCHED_COLD_ASSIST) e->st.cold_auto_assist++;
            else e->st.cold_auto_wait++;
        }
        m = r->cold_auto;
    }
    if (m == SCHED_COLD_DEFAULT) m = can ? SCHED_COLD_ASSIST : SCHED_COLD_WAIT;
    if (m == SCHED_COLD_ASSIST && !can) m = SCHED_COLD_WAIT;
    return m;
}
/* S's adapter in a device slot for this iteration: true when it has it (or needs none);
 * false when every slot is in use by running sequences (it waits) or on an error (the
 * request has failed: *failed). */
static bool seq_slot(engine_t *e, seq_t *s, bool *failed);

static bool seq_device(engine_t *e, seq_t *s, bool *failed) {
    req_t *r = s->req;
    *failed = false;
    if (r->lora && e->p.loras && lora_adapter_failed(r->lora->adapter)) { /* failed part way in from disk */
        req_fail_adapter(e, r);
        *failed = true;
        return false;
    }
    bool partial = r->lora && e->p.loras && !lora_adapter_complete(r->lora->adapter);
    if (partial && (e->running.n > (s->state == SEQ_RUNNING) || e->step_others)) {
        /* its adapter still streams in from disk: a forward with it would run its missing
         * layers at the disk's pace, and everyone in the batch would wait with it. It starts
         * early only on an otherwise idle engine, alone in its forwards; else it waits for
         * the whole file, as before (the load's end wakes the engine) */
        if (!r->disk_waited) {
            r->disk_waited = true;
            e->st.cold_disk_waits++;
        }
        return false;
    }
    if (!partial && e->step_partial) return false; /* this step runs a half-read adapter alone */
    if (!seq_slot(e, s, failed)) return false;
    if (partial) e->step_partial = true;
    else e->step_others = true;
    return true;
}

/* a request whose adapter could not be made usable fails with the registry's reason */
static void req_fail_load(engine_t *e, req_t *r, int rc) {
    char msg[512];
    snprintf(msg, sizeof msg, "adapter '%s': %s", r->adapter, cs_error_last());
    req_fail(e, r, ENGINE_FINISH_ERROR, rc, msg);
}

/* the slot part of seq_device */
static bool seq_slot(engine_t *e, seq_t *s, bool *failed) {
    req_t *r = s->req;
    if (!r->lora || s->dref == r->lora || !e->p.loras) return true;
    CS_ASSERT(!s->dref);
    int rc = lora_registry_device_acquire(e->p.loras, r->lora, &s->dslot);
    if (rc == CS_EAGAIN) return false;
    if (rc) {
        req_fail_load(e, r, rc);
        *failed = true;
        return false;
    }
    s->dref = r->lora;
    int arrived = lora_registry_device_arrived(e->p.loras, r->lora, s->dslot);
    if (arrived < r->lora->adapter->n_layers) {
        /* the slot is still streaming in: the cold start */
        if (!r->cold_counted) {
            r->cold_counted = true;
            e->st.cold_starts++;
        }
        if (cold_mode(e, s, arrived) == SCHED_COLD_WAIT) { /* until it is complete (each group wakes us) */
            seq_device_drop(e, s);
            if (!r->cold_waited) {
                r->cold_waited = true;
                e->st.cold_waited++;
            }
            return false;
        }
        if (!r->cold_assisted) {
            r->cold_assisted = true;
            e->st.cold_assisted++;
        }
    }
    return true;
}

/* ---- preemption ---- */
static void preempt(engine_t *e, seq_t *s) {
    seq_device_drop(e, s);
    list_remove(&e->running, s);
    seq_release_blocks(e, s);
    s->state = SEQ_WAITING;
    list_push_front(&e->waiting, s);
    e->st.preemptions++;
}

/* ---- the policy's views (engine/sched.h) ---- */
static void view_fill(engine_t *e, seq_t *s, sched_view_t *v) {
    req_t *r = s->req;
    if (r->adapter && !r->lora_known && e->p.loras)
        r->lora_known = lora_registry_info(e->p.loras, r->adapter, r->p.adapter_version, &r->lora_info) == CS_OK;
    *v = (sched_view_t){
        .req_id = r->id, .index = s->index, .running = s->state == SEQ_RUNNING, .admitted_once = s->admitted_once,
        .admit_order = s->admit_order, .t_submit_ms = r->t_submit, .t_first_ms = s->t_first, .slo_ttft_ms = r->p.slo_ttft_ms,
        .slo_tpot_ms = r->p.slo_tpot_ms, .n_prompt = r->p.n_prompt, .n_tokens = s->n_tokens,
        .n_computed = s->n_computed, .n_generated = s->n_generated, .max_tokens = r->p.max_tokens, .n = r->n,
        .adapter = r->adapter, .lora_known = r->lora_known, .lora = r->lora_info,
        .tier = !r->adapter ? SCHED_TIER_BASE : s->dref ? SCHED_TIER_DEVICE : r->lora ? SCHED_TIER_HOST
                                                                                       : SCHED_TIER_UNKNOWN};
}

static bool views_reserve(engine_t *e, int n) {
    if (n <= e->views_cap) return true;
    int cap = CS_MAX(n, 2 * e->views_cap);
    sched_view_t *v = realloc(e->views, sizeof *v * (size_t)cap);
    if (v) e->views = v;
    seq_t **q = realloc(e->vseqs, sizeof *q * (size_t)cap);
    if (q) e->vseqs = q;
    uint64_t *ids = realloc(e->vids, sizeof *ids * (size_t)cap);
    if (ids) e->vids = ids;
    int *pm = realloc(e->perm, sizeof *pm * (size_t)cap);
    if (pm) e->perm = pm;
    if (!v || !q || !ids || !pm) return false;
    e->views_cap = cap;
    return true;
}

/* views of the sequences of list L into e->views/vseqs/vids, numbered in list order */
static int views_of(engine_t *e, const seq_list_t *l) {
    CS_ASSERT(views_reserve(e, l->n)); /* a few dozen bytes per sequence */
    int n = 0;
    for (seq_t *s = l->head; s; s = s->next, n++) {
        view_fill(e, s, &e->views[n]);
        e->vseqs[n] = s;
        e->vids[n] = s->req->id;
    }
    return n;
}

/* the permutation a policy hands back must be one: anything else is a bug in it */
static void check_perm(const int *perm, int n, const char *what) {
    unsigned char seen[512];
    unsigned char *m = n <= (int)sizeof seen ? seen : calloc((size_t)n, 1);
    CS_ASSERT(m);
    memset(m, 0, (size_t)n);
    for (int i = 0; i < n; i++) {
        if (perm[i] < 0 || perm[i] >= n || m[perm[i]]) {
            fprintf(stderr, "caraserve: scheduling policy: %s is not a permutation of %d sequences\n", what, n);
            abort();
        }
        m[perm[i]] = 1;
    }
    if (m != seen) free(m);
}

static int views_running(engine_t *e) {
    int n = views_of(e, &e->running);
    e->p.sched->iface->order_running(e->p.sched, e->views, n, e->perm);
    check_perm(e->perm, n, "order_running");
    return n;
}

static int views_waiting(engine_t *e) {
    int n = views_of(e, &e->waiting);
    e->p.sched->iface->order_waiting(e->p.sched, e->views, n, e->perm);
    check_perm(e->perm, n, "order_waiting");
    return n;
}

/* the running sequence the policy preempts (its own views: the caller's may be stale) */
static seq_t *pick_victim(engine_t *e) {
    sched_view_t *v = malloc(sizeof *v * (size_t)(e->running.n ? e->running.n : 1));
    seq_t **q = malloc(sizeof *q * (size_t)(e->running.n ? e->running.n : 1));
    CS_ASSERT(v && q);
    int n = 0;
    for (seq_t *s = e->running.head; s; s = s->next, n++) {
        view_fill(e, s, &v[n]);
        q[n] = s;
    }
    CS_ASSERT(n > 0);
    int k = e->p.sched->iface->victim(e->p.sched, v, n);
    if (k < 0 || k >= n) {
        fprintf(stderr, "caraserve: scheduling policy: victim %d of %d running sequences\n", k, n);
        abort();
    }
    seq_t *s = q[k];
    free(v);
    free(q);
    return s;
}

/* ---- forking n samples ---- */
static int req_fork(engine_t *e, req_t *r) {
    seq_t *p = r->seqs[0];
    r->forked = true;
    for (int i = 1; i < r->n; i++) {
        seq_t *c = seq_new(e, r, i, p->tokens, p->n_tokens);
        if (!c) return cs_error_set(CS_ENOMEM, "out of memory forking sample %d", i);
        r->seqs[i] = c;
        r->n_live++;
        int full = p->n_computed / KV_BLOCK_SIZE, part = p->n_computed % KV_BLOCK_SIZE;
        if (grow((void **)&c->blocks, &c->cap_blocks, full + 1, sizeof(int32_t)))
            return cs_error_set(CS_ENOMEM, "out of memory");
        for (int b = 0; b < full; b++) {
            kv_block_ref(e->kv, p->blocks[b]);
            c->blocks[c->n_blocks++] = p->blocks[b];
        }
        c->n_computed = full * KV_BLOCK_SIZE;
        c->n_hashed = CS_MIN(p->n_hashed, full);
        c->chain = r->root;
        for (int b = 0; b < c->n_hashed; b++) c->chain = kv_hash_block(c->chain, c->tokens + (size_t)b * KV_BLOCK_SIZE);
        if (part) {
            int32_t nb = kv_block_alloc(e->kv);
            if (nb >= 0) {
                kv_block_copy(e->kv, nb, p->blocks[full], part);
                c->blocks[c->n_blocks++] = nb;
                c->n_computed = p->n_computed;
            }
        }
        c->admit_order = ++e->admit_counter;
        c->admitted_once = true;
        if (c->n_computed == p->n_computed) {
            c->state = SEQ_RUNNING;
            list_push_back(&e->running, c);
        } else {
            /* no block for the copy: it recomputes its partial block later (and samples
             * from its own logits then) */
            c->state = SEQ_WAITING;
            list_push_front(&e->waiting, c);
        }
    }
    return CS_OK;
}

/* ---- one sampled token ---- */
/* logits with every token the grammar does not allow at -inf (EOS only where it can end,
 * and not with ignore_eos), in e->glogits; NULL when out of memory */
static const float *grammar_masked(engine_t *e, seq_t *s, const float *logits) {
    int words = (e->vocab + 31) / 32;
    if (!e->gmask && !(e->gmask = calloc((size_t)words + (size_t)(grammar_vocab_size(e->gvocab) + 31) / 32, 4)))
        return NULL;
    if (!e->glogits && !(e->glogits = malloc(sizeof(float) * (size_t)e->vocab))) return NULL;
    memset(e->gmask, 0, sizeof(uint32_t) * (size_t)words);
    grammar_matcher_mask(s->gm, e->gvocab, e->gmask);
    if (s->req->p.ignore_eos)
        for (int i = 0; i < e->n_eos; i++) e->gmask[e->eos[i] >> 5] &= ~(1u << (e->eos[i] & 31));
    int nv = CS_MIN(e->vocab, grammar_vocab_size(e->gvocab));
    for (int w = 0; w * 32 < e->vocab; w++) { /* a word at a time: most are all masked */
        int t0 = w * 32, n = CS_MIN(32, e->vocab - t0);
        uint32_t bits = t0 < nv ? e->gmask[w] : 0;
        if (t0 < nv && nv - t0 < 32) bits &= (1u << (nv - t0)) - 1; /* past the tokenizer's vocabulary */
        if (!bits) {
            for (int k = 0; k < n; k++) e->glogits[t0 + k] = -INFINITY;
        } else {
            for (int k = 0; k < n; k++) e->glogits[t0 + k] = bits >> k & 1 ? logits[t0 + k] : -INFINITY;
        }
    }
    return e->glogits;
}

static void seq_sample(engine_t *e, seq_t *s, const float *logits) {
    req_t *r = s->req;
    const engine_request_t *p = &r->p;
    int n_banned = 0;
    if (s->n_generated < p->min_tokens) {
        if (!p->ignore_eos)
            for (int i = 0; i < e->n_eos; i++) e->banned[n_banned++] = e->eos[i];
        for (int i = 0; i < p->n_stop_token_ids; i++) e->banned[n_banned++] = p->stop_token_ids[i];
    }
    bool constrained = s->gm && !s->gm_waiting;
    if (constrained) logits = grammar_masked(e, s, logits);
    sample_out_t so;
    int32_t tok = logits ? sampler_sample(s->sampler, logits, e->banned, n_banned, &so) : CS_ENOMEM;
    if (tok >= 0 && constrained && !grammar_matcher_accept_token(s->gm, e->gvocab, tok)) tok = CS_EINVAL;
    if (tok >= 0 && s->gm_waiting && tok == p->grammar_gate_id) s->gm_waiting = false; /* the grammar from here */
    if (tok < 0) {
        const char *why = constrained && grammar_matcher_too_ambiguous(s->gm)
                              ? "the grammar allows over 256 parses of the output at once; make it less ambiguous"
                              : "no token can be sampled (all banned or masked)";
        seq_finish(e, s, ENGINE_FINISH_ERROR, CS_EINVAL, why, NULL, false, NULL, 0);
        return;
    }
    sampler_accept(s->sampler, tok);
    if (grow((void **)&s->tokens, &s->cap_tokens, s->n_tokens + 1, sizeof(int32_t))) {
        seq_finish(e, s, ENGINE_FINISH_ERROR, CS_ENOMEM, "out of memory", NULL, false, NULL, 0);
        return;
    }
    s->tokens[s->n_tokens++] = tok;
    if (++s->n_generated == 1) s->t_first = now_ms();

    engine_finish fin = ENGINE_FINISH_NONE;
    if (in_list(p->stop_token_ids, p->n_stop_token_ids, tok) || (!p->ignore_eos && is_eos(e, tok)) ||
        (constrained && grammar_matcher_done(s->gm))) /* the grammar is complete: nothing can follow */
        fin = ENGINE_FINISH_STOP;

    /* text: detokenize, then hold back what could start a stop string */
    char *piece = NULL, *tail = NULL;
    size_t plen = 0, tlen = 0;
    if (s->detok) {
        if (tokenizer_stream_push(s->detok, tok, &piece, &plen)) plen = 0;
        if (fin != ENGINE_FINISH_NONE || s->n_generated >= p->max_tokens || s->n_tokens >= e->max_model_len)
            if (tokenizer_stream_flush(s->detok, &tail, &tlen)) tlen = 0;
    }
    size_t total = plen + tlen;
    char *text = malloc(total + 1);
    if (!text) total = 0;
    else {
        if (plen) memcpy(text, piece, plen);
        if (tlen) memcpy(text + plen, tail, tlen);
        text[total] = 0;
    }
    free(piece);
    free(tail);
    size_t emit_len = total;
    bool stop_hit = false;
    if (s->stop && text && s->n_generated >= p->min_tokens) {
        /* the matcher releases what can no longer start a stop string */
        stop_result_t res;
        int m = stop_matcher_feed(s->stop, text, total, &res);
        if (m >= 0) {
            char *nt = malloc(res.len + 1);
            if (nt) {
                memcpy(nt, res.text, res.len);
                nt[res.len] = 0;
                free(text);
                text = nt;
                emit_len = res.len;
            }
            if (m == 1) { fin = ENGINE_FINISH_STOP; stop_hit = true; }
        }
    } else if (s->stop && text && stop_matcher_held(s->stop)) {
        /* below min_tokens: stop strings do not count yet, but text held earlier goes first */
        stop_result_t res;
        if (stop_matcher_flush(s->stop, &res) >= 0 && res.len) {
            char *nt = malloc(res.len + total + 1);
            if (nt) {
                memcpy(nt, res.text, res.len);
                memcpy(nt + res.len, text, total);
                nt[res.len + total] = 0;
                free(text);
                text = nt;
                emit_len = res.len + total;
            }
        }
    }
    if (fin == ENGINE_FINISH_NONE && (s->n_generated >= p->max_tokens || s->n_tokens >= e->max_model_len))
        fin = ENGINE_FINISH_LENGTH;
    if (fin != ENGINE_FINISH_NONE && !stop_hit && s->stop && text) {
        /* release what the matcher held back */
        stop_result_t res;
        if (stop_matcher_flush(s->stop, &res) == 0 && res.len) {
            char *nt = realloc(text, emit_len + res.len + 1);
            if (nt) {
                text = nt;
                memcpy(text + emit_len, res.text, res.len);
                emit_len += res.len;
                text[emit_len] = 0;
            }
        }
    }
    if (fin != ENGINE_FINISH_NONE) seq_finish(e, s, fin, 0, NULL, &so, true, text, emit_len);
    else emit(e, r, s->index, s->n_generated, &so, true, text, emit_len, ENGINE_FINISH_NONE, 0, NULL, false);
    free(text);
}

/* ---- prompt logprobs ---- */
#define PLP_MAX_CHUNK 128   /* prompt rows per iteration when all their logits are kept */

static bool wants_plp(const seq_t *s) { return s->req->p.prompt_logprobs && !s->req->plp_done && s->index == 0; }

/* rows [0, c) of logits are positions pos0.. of seq s's prompt: each predicts the next */
static void plp_fill(engine_t *e, seq_t *s, int pos0, int c, const float *logits) {
    req_t *r = s->req;
    int k = r->p.prompt_top_logprobs;
    sample_out_t so;
    for (int j = 0; j < c; j++) {
        int t = pos0 + j + 1;
        if (t >= r->p.n_prompt) break;
        sampling_logprobs_of(logits + (size_t)j * e->vocab, e->vocab, r->p.prompt[t], k, &so);
        r->plp[t] = so.logprob;
        r->plp_rank[t] = so.rank;
        for (int i = 0; i < k; i++) {
            r->plp_ids[(size_t)t * k + i] = i < so.n_top ? so.top[i].id : -1;
            r->plp_lps[(size_t)t * k + i] = i < so.n_top ? so.top[i].logprob : -INFINITY;
        }
    }
}

static void plp_emit(engine_t *e, req_t *r) {
    (void)e;
    r->plp_done = true;
    engine_event_t ev = {0};
    ev.request_id = r->id;
    ev.text = "";
    ev.n_prompt_tokens = r->p.n_prompt;
    ev.n_cached_tokens = r->n_cached;
    ev.adapter_version = r->adapter_version;
    ev.queue_ms = r->t_admit > 0 ? r->t_admit - r->t_submit : 0;
    ev.prompt_logprobs = r->plp;
    ev.prompt_ranks = r->plp_rank;
    ev.prompt_n_top = r->p.prompt_top_logprobs;
    ev.prompt_top_ids = r->plp_ids;
    ev.prompt_top_logprobs = r->plp_lps;
    if (r->p.sink) r->p.sink(r->p.user, &ev);
}

/* ---- the step ---- */
static bool batch_add(engine_t *e, int *nb, seq_t *s, int chunk) {
    if (grow((void **)&e->batch, &e->batch_cap, *nb + 1, sizeof *e->batch)) return false;
    int cap = e->batch_cap;
    e->batch_seq = realloc(e->batch_seq, sizeof *e->batch_seq * (size_t)cap);
    e->batch_chunk = realloc(e->batch_chunk, sizeof *e->batch_chunk * (size_t)cap);
    CS_ASSERT(e->batch_seq && e->batch_chunk);
    e->batch_seq[*nb] = s;
    e->batch_chunk[*nb] = chunk;
    (*nb)++;
    return true;
}

/* adapter of a waiting request: CS_OK when usable, CS_EAGAIN while loading, else error */
static int req_adapter(engine_t *e, req_t *r) {
    if (r->adapter_ready) return CS_OK;
    if (!r->adapter) { r->adapter_ready = true; return CS_OK; }
    if (!e->p.loras) return cs_error_set(CS_ENOTFOUND, "no adapters are served (unknown adapter '%s')", r->adapter);
    int rc = r->pin ? lora_registry_acquire_pinned(e->p.loras, r->pin, &r->lora)
                    : lora_registry_acquire(e->p.loras, r->adapter, &r->lora);
    if (rc) return rc;
    r->adapter_version = r->lora->version;
    req_rechain(r);
    r->adapter_ready = true;
    return CS_OK;
}

/* ---- publishing stats, threads ---- */
static void seq_info_fill(engine_t *e, const req_t *r, const seq_t *s, engine_seq_info_t *o) {
    (void)e;
    *o = (engine_seq_info_t){.req_id = r->id, .index = s ? s->index : 0, .running = s && s->state == SEQ_RUNNING,
                             .t_submit_ms = r->t_submit, .slo_ttft_ms = r->p.slo_ttft_ms,
                             .slo_tpot_ms = r->p.slo_tpot_ms, .n_prompt = r->p.n_prompt,
                             .n_computed = s ? s->n_computed : 0, .n_generated = s ? s->n_generated : 0,
                             .max_tokens = r->p.max_tokens, .rank = r->adapter ? -1 : 0};
    if (r->adapter) {
        snprintf(o->adapter, sizeof o->adapter, "%s", r->adapter);
        if (r->lora_known) {
            o->rank = r->lora_info.max_rank;
            o->rank_sum = r->lora_info.rank_sum;
        }
    }
}

/* the cold start's pinned buffers of model M made now, for the largest batch: a cold request
 * then pins nothing on its way (made by the first one instead should this fail) */
static void assist_reserve(engine_t *e, model_t *m) {
    if (model_assist_reserve(m, e->p.max_num_batched_tokens))
        fprintf(stderr, "caraserve: %s: the first cold request makes them\n", cs_error_last());
}

static void publish_stats(engine_t *e) {
    model_cold_stats_t cs = e->cold_gone;
    for (base_ver_t *b = e->bases; b; b = b->next) { /* this thread changes the list: no lock to read it */
        model_cold_stats_t one = {0};
        if (b->model) model_get_cold_stats(b->model, &one);
        cs.forwards += one.forwards;
        cs.host_layers += one.host_layers;
        cs.device_layers += one.device_layers;
        cs.host_rows += one.host_rows;
        cs.pinned_allocs += one.pinned_allocs;
    }
    e->st.cold_pinned_allocs = cs.pinned_allocs;
    e->st.cold_forwards = cs.forwards;
    e->st.cold_host_layers = cs.host_layers;
    e->st.cold_device_layers = cs.device_layers;
    e->st.cold_host_rows = cs.host_rows;
    e->st.n_waiting = e->waiting.n;
    e->st.n_running = e->running.n;
    if (e->kv) kv_cache_get_stats(e->kv, &e->st.kv);
    else e->st.kv = (kv_cache_stats_t){.dtype = e->kvp.dtype}; /* asleep: no memory held */
    /* the sequences, built outside the lock into the spare buffer */
    int n = e->running.n + e->waiting.n;
    if (n > e->cap_pub_work) {
        int cap = CS_MAX(n, 2 * e->cap_pub_work);
        engine_seq_info_t *w = realloc(e->pub_work, sizeof *w * (size_t)cap);
        if (w) { e->pub_work = w; e->cap_pub_work = cap; }
    }
    int k = 0;
    if (n <= e->cap_pub_work) {
        for (const seq_list_t *l = &e->running;; l = &e->waiting) {
            for (seq_t *s = l->head; s; s = s->next) seq_info_fill(e, s->req, s, &e->pub_work[k++]);
            if (l == &e->waiting) break;
        }
    }
    pthread_mutex_lock(&e->mu);
    e->st.n_requests = e->n_live_requests;
    e->stats = e->st;
    engine_seq_info_t *t = e->pub;
    int tc = e->cap_pub;
    e->pub = e->pub_work;
    e->cap_pub = e->cap_pub_work;
    e->n_pub = k;
    e->pub_work = t;
    e->cap_pub_work = tc;
    pthread_mutex_unlock(&e->mu);
}

/* Move the unpinned requests of adapter NAME that hold an older version onto the active
 * one: CS_EAGAIN while it is loading, else the number moved (or an error). Between
 * iterations, so every sequence's KV and sampler state go on as they are. */
static int follow_active(engine_t *e, const char *name) {
    lora_ref_t *cur = NULL;
    int rc = lora_registry_acquire(e->p.loras, name, &cur);
    if (rc) return rc;
    if (!lora_adapter_complete(cur->adapter)) { /* still streaming in from disk: running requests
                                                  * move only onto a whole one (decode must not
                                                  * wait for the disk); its load's end wakes us */
        rc = cs_error_set(CS_EAGAIN, "adapter '%s' version %d is loading", name, cur->version);
        lora_registry_release(e->p.loras, cur);
        return rc;
    }
    int moved = 0;
    for (int b = 0; b < REQ_BUCKETS; b++)
        for (req_t *r = e->reqs[b]; r; r = r->hnext) {
            if (!r->adapter || strcmp(r->adapter, name) || r->p.adapter_version || !r->lora ||
                r->lora->version == cur->version)
                continue;
            lora_ref_t *nr = NULL;
            if (lora_registry_acquire_version(e->p.loras, name, cur->version, &nr)) continue;
            for (int i = 0; i < r->n; i++) /* the old version's slot: the next step takes the new one's */
                if (r->seqs[i]) seq_device_drop(e, r->seqs[i]);
            lora_registry_release(e->p.loras, r->lora);
            r->lora = nr;
            r->adapter_version = nr->version;
            bool started = false; /* any KV computed (or matched) under the old version? */
            for (int i = 0; i < r->n; i++)
                if (r->seqs[i] && (r->seqs[i]->n_computed > 0 || r->seqs[i]->n_blocks > 0)) started = true;
            if (started) {
                r->no_publish = true;
            } else { /* nothing of the old version in it: it is simply a request of the new one */
                req_rechain(r);
            }
            moved++;
        }
    lora_registry_release(e->p.loras, cur);
    return moved;
}

static void take_follows(engine_t *e) {
    pthread_mutex_lock(&e->mu);
    for (follow_t **pp = &e->follows; *pp;) {
        follow_t *f = *pp;
        int rc = e->p.loras ? follow_active(e, f->name) : cs_error_set(CS_ENOTFOUND, "no adapters");
        if (rc == CS_EAGAIN) { pp = &f->next; continue; } /* loading: on_loaded wakes us again */
        *pp = f->next;
        f->moved = rc > 0 ? rc : 0;
        f->done = true;
        if (f->abandoned) {
            free(f->name);
            free(f);
        }
    }
    pthread_cond_broadcast(&e->follow_cv);
    pthread_mutex_unlock(&e->mu);
}

/* the batch order of two requests' adapters (NULL: the base model, first) */
static int adapter_order(const lora_ref_t *a, const lora_ref_t *b) {
    if (!a || !b) return (a != NULL) - (b != NULL);
    int c = strcmp(a->name, b->name);
    return c ? c : (a->version > b->version) - (a->version < b->version);
}

/* ---- base-weight versions (engine thread) ---- */
/* free the versions nobody keeps or holds */
static void bases_reap(engine_t *e) {
    base_ver_t *dead = NULL;
    pthread_mutex_lock(&e->mu);
    for (base_ver_t **pp = &e->bases; *pp;) {
        base_ver_t *b = *pp;
        if (b->kept || b->refs > 0 || b == e->bases) { pp = &b->next; continue; }
        *pp = b->next;
        b->next = dead;
        dead = b;
    }
    pthread_mutex_unlock(&e->mu);
    for (base_ver_t *b = dead, *nx; b; b = nx) {
        nx = b->next;
        if (b->model) {
            model_cold_stats_t one;
            model_get_cold_stats(b->model, &one);
            e->cold_gone.forwards += one.forwards;
            e->cold_gone.host_layers += one.host_layers;
            e->cold_gone.device_layers += one.device_layers;
            e->cold_gone.host_rows += one.host_rows;
            e->cold_gone.pinned_allocs += one.pinned_allocs;
            if (b->owned) model_free(b->model);
        }
        free(b->dir);
        free(b);
    }
}

/* R (unpinned, on another version) goes on with the weights of NB from the next iteration */
static void req_move_base(engine_t *e, req_t *r, base_ver_t *nb) {
    base_ver_t *old = r->base;
    pthread_mutex_lock(&e->mu);
    nb->refs++;
    old->refs--;
    pthread_mutex_unlock(&e->mu);
    r->base = nb;
    bool started = false; /* any KV computed (or matched) under the old weights? */
    for (int i = 0; i < r->n; i++)
        if (r->seqs[i] && (r->seqs[i]->n_computed > 0 || r->seqs[i]->n_blocks > 0)) started = true;
    if (started) r->no_publish = true;
    else req_rechain(r);
}

/* The requests on versions other than NB after an update (ONLY: just those on that one):
 * moved, aborted or left as APPLY says; a pinned one on ONLY (replaced in place) ends. */
static void bases_apply(engine_t *e, base_ver_t *nb, const base_ver_t *only, engine_apply apply, base_job_t *j) {
    for (int b = 0; b < REQ_BUCKETS; b++)
        for (req_t *r = e->reqs[b], *nx; r; r = nx) {
            nx = r->hnext;
            if (r->base == nb || (only && r->base != only)) continue;
            if (r->p.base_version) {
                if (only)
                    req_fail(e, r, ENGINE_FINISH_ERROR, CS_ENOTFOUND,
                             "its base version was replaced in place by an update of the weights");
                continue;
            }
            if (apply == ENGINE_APPLY_ABORT_INFLIGHT) {
                req_fail(e, r, ENGINE_FINISH_ABORT, 0, NULL);
                j->res.aborted++;
            } else if (apply == ENGINE_APPLY_PAUSE_KEEP || only) {
                req_move_base(e, r, nb);
                j->res.moved++;
            }
        }
}

/* the newest KEEP versions are kept (held ones stay until released) */
static void bases_keep(engine_t *e, int keep) {
    pthread_mutex_lock(&e->mu);
    int k = 0;
    for (base_ver_t *b = e->bases; b; b = b->next) b->kept = k++ < CS_MAX(keep, 1);
    pthread_mutex_unlock(&e->mu);
}

static base_ver_t *base_new(engine_t *e, model_t *m, const char *dir, const char *label, bool owned) {
    base_ver_t *b = calloc(1, sizeof *b);
    if (!b) return NULL;
    b->version = ++e->base_last;
    if (label && label[0]) snprintf(b->label, sizeof b->label, "%s", label);
    else snprintf(b->label, sizeof b->label, "%d", b->version);
    b->dir = dir ? strdup(dir) : NULL;
    b->model = m;
    b->owned = owned;
    b->kept = true;
    return b;
}

/* J's new weights become the active version */
static void base_job_run(engine_t *e, base_job_t *j) {
    double t0 = now_ms();
    base_ver_t *old = e->bases;
    const engine_base_update_t *u = &j->u;
    base_ver_t *nb = base_new(e, u->model, u->dir, u->label, true);
    if (!nb) {
        model_free(u->model);
        j->rc = cs_error_set(CS_ENOMEM, "out of memory");
        snprintf(j->err, sizeof j->err, "%s", cs_error_last());
        return;
    }
    struct lora_assist *assist = old->model ? model_assist(old->model) : NULL;
    pthread_mutex_lock(&e->mu); /* from here on new requests take the new version */
    nb->next = e->bases;
    e->bases = nb;
    pthread_mutex_unlock(&e->mu);
    j->res.version = nb->version;
    j->res.in_place = u->model == NULL;
    if (u->model) { /* beside: the old weights stay for the requests that hold them */
        model_set_assist(nb->model, assist);
        assist_reserve(e, nb->model);
        e->model = nb->model;
        if (u->apply != ENGINE_APPLY_NEXT_REQUEST) bases_apply(e, nb, NULL, u->apply, j);
    } else { /* in place: every request on the old weights leaves them, then they go */
        take_inbox(e); /* requests submitted before the switch hold the old version too */
        bases_apply(e, nb, old, u->apply, j);
        int old_version = old->version;
        char old_label[ENGINE_LABEL_MAX];
        memcpy(old_label, old->label, sizeof old_label);
        char *old_dir = old->dir ? strdup(old->dir) : NULL;
        pthread_mutex_lock(&e->mu);
        old->kept = false; /* nobody holds it now: freed here */
        pthread_mutex_unlock(&e->mu);
        e->model = NULL;
        bases_reap(e);
        int rc = model_load_how(u->dir, e->be, u->how, &nb->model);
        if (rc) { /* part way (the files changed since they were checked): the old weights
                   * again, from where they came, under their own version */
            j->rc = rc;
            snprintf(j->err, sizeof j->err, "%s", cs_error_last());
            pthread_mutex_lock(&e->mu);
            nb->version = old_version;
            memcpy(nb->label, old_label, sizeof nb->label);
            free(nb->dir);
            nb->dir = old_dir;
            old_dir = NULL;
            e->base_last--;
            pthread_mutex_unlock(&e->mu);
            if (!nb->dir || model_load_how(nb->dir, e->be, u->how, &nb->model))
                fprintf(stderr, "engine: the base weights could not be loaded again after a failed update: %s\n",
                        cs_error_last());
        }
        free(old_dir);
        if (nb->model) {
            model_set_assist(nb->model, assist);
            e->model = nb->model;
        }
    }
    bases_keep(e, u->keep_versions);
    bases_reap(e);
    j->res.pause_ms = now_ms() - t0;
}

/* ---- sleep (engine thread) ---- */
static void sleep_run(engine_t *e, base_job_t *j) {
    if (j->level >= 1 && !e->kv_gone) { /* every sequence gives its blocks back: it recomputes later */
        while (e->running.head) preempt(e, e->running.head);
        for (seq_t *s = e->waiting.head; s; s = s->next)
            if (s->n_blocks) seq_release_blocks(e, s);
        kv_prefix_flush(e->kv);
        kv_cache_free(e->kv);
        e->kv = NULL;
        e->kv_gone = true;
    }
    if (j->level >= 2 && !e->weights_gone) {
        for (base_ver_t *b = e->bases; b; b = b->next) {
            if (!b->owned || !b->model) continue;
            if (!e->assist) e->assist = model_assist(b->model);
            model_free(b->model);
            b->model = NULL;
        }
        e->model = NULL;
        e->weights_gone = true;
    }
}

static void wake_run(engine_t *e, base_job_t *j) {
    if (j->weights && e->weights_gone) {
        for (base_ver_t *b = e->bases; b; b = b->next) {
            if (b->model) continue;
            if (!b->dir) {
                j->rc = cs_error_set(CS_EINVAL, "base version %d's weights came from no directory", b->version);
            } else if ((j->rc = model_load_how(b->dir, e->be, MODEL_WEIGHTS_AUTO, &b->model)) == CS_OK) {
                model_set_assist(b->model, e->assist);
                assist_reserve(e, b->model);
                continue;
            }
            snprintf(j->err, sizeof j->err, "%s", cs_error_last());
            return;
        }
        e->model = e->bases->model;
        e->weights_gone = false;
    }
    if (j->kv && e->kv_gone) {
        if ((j->rc = kv_cache_new(e->be, &e->kvp, &e->kv))) {
            snprintf(j->err, sizeof j->err, "%s", cs_error_last());
            return;
        }
        e->kv_gone = false;
    }
}

static void job_run(engine_t *e, base_job_t *j) {
    if (j->op == JOB_UPDATE && (e->weights_gone || e->kv_gone)) {
        model_free(j->u.model);
        j->rc = cs_error_set(CS_EBUSY, "the engine is asleep: wake it up before updating its weights");
        snprintf(j->err, sizeof j->err, "%s", cs_error_last());
    } else if (j->op == JOB_UPDATE) {
        base_job_run(e, j);
    } else if (j->op == JOB_SLEEP) {
        sleep_run(e, j);
    } else {
        wake_run(e, j);
    }
    if (j->op != JOB_UPDATE) publish_stats(e); /* the caller, back, sees the KV cache gone or there */
    pthread_mutex_lock(&e->mu);
    e->sleeping_pub = e->kv_gone || e->weights_gone;
    pthread_mutex_unlock(&e->mu);
}

/* the batch order of two requests: by base version (each version's rows run as a forward of
 * their own), then by adapter */
static int batch_order(const req_t *a, const req_t *b) {
    int va = a->base->version, vb = b->base->version;
    return va != vb ? (va > vb) - (va < vb) : adapter_order(a->lora, b->lora);
}

/* A step's start: the inbox (aborts are taken even while paused), the newest pause mode
 * (whatever this step does obeys it) and the versions followed. */
static engine_pause_mode step_begin(engine_t *e) {
    take_inbox(e);
    pthread_mutex_lock(&e->mu);
    engine_pause_mode pause = e->pause;
    bool follows = e->follows != NULL;
    if (e->pause_seen != e->pause_gen) {
        e->pause_seen = e->pause_gen;
        pthread_cond_broadcast(&e->pause_cv);
    }
    if (e->flush_seen != e->flush_gen) { /* the KV cache is this thread's: flushed here */
        e->flush_dropped = e->kv ? kv_prefix_flush(e->kv) : 0;
        e->flush_seen = e->flush_gen;
        pthread_cond_broadcast(&e->pause_cv);
    }
    base_job_t *jobs = e->base_jobs;
    e->base_jobs = NULL;
    pthread_mutex_unlock(&e->mu);
    if (follows) take_follows(e); /* paused or not */
    for (base_job_t *j = jobs, *nx; j; j = nx) { /* paused or not */
        nx = j->next;
        job_run(e, j);
        pthread_mutex_lock(&e->mu); /* j is its caller's again once done */
        j->done = true;
        pthread_cond_broadcast(&e->follow_cv);
        pthread_mutex_unlock(&e->mu);
    }
    if (e->bases->next) bases_reap(e); /* older versions whose last request ended */
    return pause;
}

/* 0. running sequences without their adapter's device slot (a fork's new samples, a move to
 * another version) take it now; with every slot in use they sit this one out */
static void step_device_slots(engine_t *e) {
    e->step_partial = e->step_others = false;
    for (seq_t *s = e->running.head; s;) {
        bool failed;
        s->dwait = !seq_device(e, s, &failed);
        s = failed ? e->running.head : s->next; /* its request (and maybe s->next) is gone */
    }
}

/* drop VICTIM from the NB rows batched so far, if it is there, giving its tokens back */
static void batch_drop(engine_t *e, int *nb, int *budget, const seq_t *victim) {
    for (int i = 0; i < *nb; i++)
        if (e->batch_seq[i] == victim) {
            *budget += e->batch_chunk[i];
            memmove(e->batch_seq + i, e->batch_seq + i + 1, sizeof *e->batch_seq * (size_t)(*nb - i - 1));
            memmove(e->batch_chunk + i, e->batch_chunk + i + 1, sizeof *e->batch_chunk * (size_t)(*nb - i - 1));
            (*nb)--;
            return;
        }
}

/* 1. running sequences, in the policy's order: decode rows and continuing prefill chunks of
 * the sizes it chooses; when the cache is short, it names the victim. True when any
 * sequence was preempted. */
static bool step_running(engine_t *e, int *nb, int *budget) {
    bool preempted = false;
    int nv = views_running(e);
    for (int k = 0; k < nv && *budget > 0; k++) {
        seq_t *s = e->vseqs[e->perm[k]];
        if (s->state != SEQ_RUNNING || s->dwait) continue; /* preempted as a victim meanwhile */
        int max = CS_MIN(s->n_tokens - s->n_computed, *budget);
        if (max <= 0) continue;
        if (wants_plp(s)) max = CS_MIN(max, PLP_MAX_CHUNK);
        int chunk = CS_MIN(e->p.sched->iface->chunk(e->p.sched, &e->views[e->perm[k]], max), max);
        if (chunk <= 0) continue;
        bool self_preempted = false;
        while (!seq_reserve(e, s, s->n_computed + chunk)) {
            seq_t *victim = pick_victim(e);
            if (victim == s) { preempt(e, s); self_preempted = true; break; }
            batch_drop(e, nb, budget, victim); /* a victim already in this batch */
            preempt(e, victim);
            preempted = true;
        }
        if (self_preempted) { preempted = true; continue; }
        batch_add(e, nb, s, chunk);
        *budget -= chunk;
    }
    return preempted;
}

/* a waiting sequence admitted: the request's first admission is counted, the sequence
 * runs from now on */
static void admit(engine_t *e, req_t *r, seq_t *s, bool first) {
    if (first) {
        s->admitted_once = true;
        if (r->t_admit == 0) r->t_admit = now_ms();
        if (s->index == 0) {
            r->n_cached = s->n_computed;
            e->st.cached_prompt_tokens += (uint64_t)s->n_computed;
            e->st.prompt_tokens += (uint64_t)r->p.n_prompt;
        }
    }
    list_remove(&e->waiting, s);
    s->state = SEQ_RUNNING;
    s->admit_order = ++e->admit_counter;
    list_push_back(&e->running, s);
}

/* 2. waiting sequences in the policy's order, while the budget, the sequence cap and the
 * cache allow (the caller skips this after a preemption: the cache is short) */
static void step_waiting(engine_t *e, int *nb, int *budget, engine_pause_mode pause) {
    int n_running = e->running.n;
    int nv = views_waiting(e);
    for (int k = 0; k < nv && *budget > 0; k++) {
        int vi = e->perm[k];
        req_t *r = req_table_find(e, e->vids[vi]); /* a failure below frees its request's sequences */
        seq_t *s = r ? e->vseqs[vi] : NULL;
        if (!s || s->state != SEQ_WAITING) continue;
        int want = r->forked ? 1 : r->n;
        if (n_running + want > e->p.max_num_seqs) break;
        if (pause == ENGINE_PAUSE_NO_ADMIT && !s->admitted_once) continue; /* only preempted ones come back */
        int rc = req_adapter(e, r);
        if (rc == CS_EAGAIN) continue;  /* loading: let others pass */
        if (rc) {
            req_fail_load(e, r, rc);
            continue;
        }
        bool first = !s->admitted_once;
        seq_match_prefix(e, s);
        int max = CS_MIN(s->n_tokens - s->n_computed, *budget);
        if (wants_plp(s)) max = CS_MIN(max, PLP_MAX_CHUNK);
        view_fill(e, s, &e->views[vi]); /* the prefix match changed what it has to compute */
        int chunk = CS_MIN(e->p.sched->iface->chunk(e->p.sched, &e->views[vi], max), max);
        if (chunk <= 0) {
            seq_release_blocks(e, s);
            continue;
        }
        /* keep a little headroom for the running sequences' next tokens */
        int avail = kv_cache_n_available(e->kv);
        int need = (s->n_computed + chunk + KV_BLOCK_SIZE - 1) / KV_BLOCK_SIZE - s->n_blocks;
        int watermark = e->running.n ? CS_MAX(1, kv_cache_n_blocks(e->kv) / 100) : 0;
        if (need + watermark > avail || !seq_reserve(e, s, s->n_computed + chunk)) {
            seq_release_blocks(e, s);   /* matched blocks go back to the cache */
            if (e->p.sched->iface->pass_blocked(e->p.sched, &e->views[vi])) continue;
            break;
        }
        bool failed;
        if (!seq_device(e, s, &failed)) { /* every device slot runs other adapters: let others pass */
            if (!failed) seq_release_blocks(e, s); /* failed: its request is gone */
            continue;
        }
        admit(e, r, s, first);
        n_running += want;
        batch_add(e, nb, s, chunk);
        *budget -= chunk;
    }
}

/* start loading the adapters of the next waiting requests now, so the loads overlap this
 * iteration (only those still on disk: no reference is taken for the others) */
static void step_load_ahead(engine_t *e) {
    int ahead = 0;
    for (seq_t *s = e->waiting.head, *nx; s && ahead < 16 && e->p.loras; s = nx) {
        nx = s->next;
        req_t *r = s->req;
        if (r->adapter_ready || !r->adapter) continue;
        ahead++;
        lora_state st;
        if (lora_registry_state(e->p.loras, r->adapter, &st, NULL) == CS_OK && st == LORA_ON_DISK) {
            int rc = req_adapter(e, r);
            if (rc && rc != CS_EAGAIN) req_fail_load(e, r, rc);
        }
    }
}

/* 3. the batch, with sequences of one adapter next to each other: an insertion sort (stable)
 * by adapter name and version, the base model first. Not by the adapter's address: that
 * differs from run to run, and a row's place in the batch changes its last bits (the kernels
 * group rows), so a repeated run would not repeat its logprobs. */
static void step_sort(engine_t *e, int nb) {
    for (int i = 1; i < nb; i++) {
        seq_t *s = e->batch_seq[i];
        int c = e->batch_chunk[i], j = i;
        while (j > 0) {
            seq_t *pj = e->batch_seq[j - 1];
            if (batch_order(pj->req, s->req) <= 0) break;
            e->batch_seq[j] = pj;
            e->batch_chunk[j] = e->batch_chunk[j - 1];
            j--;
        }
        e->batch_seq[j] = s;
        e->batch_chunk[j] = c;
    }
}

/* The model's rows of the sorted batch and the policy's feedback on it: how many rows want
 * logits; *n_tok the tokens, *decode_only whether every row decodes one token. */
static int step_rows(engine_t *e, int nb, sched_step_t *fb, int *n_tok, bool *decode_only) {
    int n_logits = 0;
    *n_tok = 0;
    *decode_only = true;
    *fb = (sched_step_t){.n_seqs = nb};
    for (int i = 0; i < nb; i++) {
        seq_t *s = e->batch_seq[i];
        int c = e->batch_chunk[i];
        bool last = s->n_computed + c == s->n_tokens;
        int nl = wants_plp(s) ? c : last ? 1 : 0;
        e->batch[i] = (model_batch_seq_t){s->tokens + s->n_computed, c, s->n_computed, s->blocks,
                                          s->req->lora ? s->req->lora->adapter : NULL, nl, s->dslot};
        n_logits += nl;
        *n_tok += c;
        bool decode = c == 1 && last && s->n_generated > 0;
        if (!decode) *decode_only = false;
        if (decode) fb->decode_rows++;
        else fb->prefill_tokens += c;
        if (e->batch[i].lora && s->req->lora_known) fb->row_rank_sum += (long)c * s->req->lora_info.max_rank;
        /* the batch is sorted by adapter: a new one starts where the adapter changes */
        if (e->batch[i].lora && (i == 0 || e->batch[i - 1].lora != e->batch[i].lora)) {
            int rank = s->req->lora_known ? s->req->lora_info.max_rank : 0;
            fb->n_adapters++;
            fb->rank_sum += rank;
            fb->max_rank = CS_MAX(fb->max_rank, rank);
        }
    }
    return n_logits;
}

/* The forward pass of the batch's NB rows into e->logits; on failure every request of the
 * batch fails and the error code is returned. */
static int step_forward(engine_t *e, int nb, int n_logits) {
    /* at least one row: a batch of prefill chunks only wants none, and malloc(0) may be NULL
     * (the engine's first step, a prompt longer than the token budget, failed on that) */
    size_t need = (size_t)CS_MAX(n_logits, 1) * e->vocab;
    if (need > e->logits_cap) {
        free(e->logits);
        e->logits = malloc(sizeof(float) * need);
        e->logits_cap = e->logits ? need : 0;
    }
    int rc = e->logits ? CS_OK : cs_error_set(CS_ENOMEM, "out of memory for %d rows of logits", n_logits);
    /* a forward per base version (the batch is sorted by it), each into its rows of logits */
    for (int i = 0, off = 0; !rc && i < nb;) {
        model_t *m = e->batch_seq[i]->req->base->model;
        int j = i, nl = 0;
        while (j < nb && e->batch_seq[j]->req->base->model == m) nl += e->batch[j++].n_logits;
        rc = m ? model_forward_batch(m, e->kv, e->batch + i, j - i, e->logits + (size_t)off * e->vocab)
               : cs_error_set(CS_EIO, "base version %d has no weights (its load failed)", e->batch_seq[i]->req->base->version);
        off += nl;
        i = j;
    }
    if (rc) {
        char msg[512];
        snprintf(msg, sizeof msg, "forward pass failed: %s", cs_error_last());
        for (int i = 0; i < nb; i++) {
            req_t *r = e->batch_seq[i]->req;
            if (req_table_find(e, r->id)) req_fail(e, r, ENGINE_FINISH_ERROR, rc, msg);
        }
    }
    return rc;
}

/* the last row of a prompt or a decode: the first of n samples forks the others, which all
 * draw from these logits; any other row draws its own token */
static void step_draw(engine_t *e, seq_t *s, const float *lg) {
    req_t *r = s->req;
    if (!r->forked && r->n > 1 && s == r->seqs[0]) {
        if (req_fork(e, r)) {
            req_fail(e, r, ENGINE_FINISH_ERROR, CS_ENOMEM, cs_error_last());
            return;
        }
        /* every sample with its KV in place draws from these logits */
        int n = r->n;
        uint64_t rid = r->id;
        for (int k = 0; k < n && req_table_find(e, rid); k++) {
            seq_t *c2 = r->seqs[k];
            if (c2 && c2->state == SEQ_RUNNING && c2->n_computed == c2->n_tokens) seq_sample(e, c2, lg);
        }
    } else {
        seq_sample(e, s, lg);
    }
}

/* 4. bookkeeping and sampling. A row whose adapter failed part way in from disk ran with
 * zeros for the layers that never came: its request's id goes to *BAD (malloc'd, *N_BAD
 * of them) and fails after the loop, nothing of it kept (blocks, tokens). */
static void step_sample(engine_t *e, int nb, uint64_t **bad, int *n_bad) {
    int row = 0;
    for (int i = 0; i < nb; i++) {
        seq_t *s = e->batch_seq[i];
        int c = e->batch_chunk[i];
        int nl = e->batch[i].n_logits;
        if (e->batch[i].lora && lora_adapter_failed(e->batch[i].lora)) {
            uint64_t *nbad = realloc(*bad, sizeof **bad * (size_t)(*n_bad + 1));
            CS_ASSERT(nbad); /* a few ids: out of memory here is fatal */
            *bad = nbad;
            (*bad)[(*n_bad)++] = s->req->id;
            row += nl;
            continue;
        }
        bool last = s->n_computed + c == s->n_tokens;
        if (c == 1 && last && s->n_generated > 0) e->st.decode_tokens++;
        else e->st.prefill_tokens += (uint64_t)c;
        req_t *r = s->req;
        if (wants_plp(s)) {
            plp_fill(e, s, s->n_computed, c, e->logits + (size_t)row * e->vocab);
            if (last) plp_emit(e, r);
            if (last && r->p.max_tokens == 0) { /* echo only: nothing to generate */
                s->n_computed += c;
                seq_publish(e, s);
                row += nl;
                seq_finish(e, s, ENGINE_FINISH_LENGTH, 0, NULL, NULL, false, NULL, 0);
                continue;
            }
        }
        s->n_computed += c;
        seq_publish(e, s);
        row += nl;
        if (last) step_draw(e, s, e->logits + (size_t)(row - 1) * e->vocab);
    }
}

/* The step's end: large logits go back to the system, the policy's feedback, the counters,
 * and the requests whose adapter failed part way in fail. */
static void step_end(engine_t *e, sched_step_t *fb, double t0, bool decode_only, int n_tok, uint64_t *bad,
                     int n_bad) {
    /* the logits of many rows (echo or prompt logprobs of long prompts: up to the token
     * budget x vocab floats, 262 MB at 2048 x 32000) go back to the system after their step;
     * what a decode step of max_num_seqs rows needs (or 64 MB) stays */
    size_t keep_floats = CS_MAX(e->p.logits_keep_bytes / sizeof(float), (size_t)e->p.max_num_seqs * e->vocab);
    if (e->logits_cap > keep_floats) {
        free(e->logits);
        e->logits = NULL;
        e->logits_cap = 0;
        for (base_ver_t *b = e->bases; b; b = b->next) /* this thread changes the list: no lock to read it */
            if (b->model) model_release_logits(b->model, (int)CS_MIN(keep_floats / (size_t)e->vocab, (size_t)INT_MAX));
        e->st.logits_releases++;
    }
    double dt = now_ms() - t0;
    fb->forward_ms = dt;
    if (e->p.sched->iface->feedback) e->p.sched->iface->feedback(e->p.sched, fb);
    e->st.steps++;
    e->st.busy_ms += dt;
    if (decode_only) {
        e->st.decode_only_ms += dt;
        e->st.decode_only_tokens += (uint64_t)n_tok;
    }
    for (int i = 0; i < n_bad; i++) {
        req_t *r = req_table_find(e, bad[i]);
        if (r) req_fail_adapter(e, r);
    }
}

/* One iteration: choose the batch (running sequences first, then waiting ones), run it,
 * sample. Returns how many sequences ran. */
static int step(engine_t *e) {
    engine_pause_mode pause = step_begin(e);
    if (pause == ENGINE_PAUSE_HOLD || e->kv_gone || e->weights_gone) return 0; /* held, or asleep */
    double t0 = now_ms();
    int budget = e->p.max_num_batched_tokens, nb = 0;
    step_device_slots(e);
    bool preempted = step_running(e, &nb, &budget);
    if (!preempted) step_waiting(e, &nb, &budget, pause);
    step_load_ahead(e);
    if (nb == 0) return 0;

    step_sort(e, nb);
    sched_step_t fb;
    int n_tok;
    bool decode_only;
    int n_logits = step_rows(e, nb, &fb, &n_tok, &decode_only);
    if (step_forward(e, nb, n_logits)) return nb;
    uint64_t *bad = NULL;
    int n_bad = 0;
    step_sample(e, nb, &bad, &n_bad);
    step_end(e, &fb, t0, decode_only, n_tok, bad, n_bad);
    free(bad);
    return nb;
}

int engine_step(engine_t *e) {
    int ran = step(e);
    publish_stats(e);
    return ran;
}

static bool has_work(engine_t *e) { return e->waiting.n > 0 || e->running.n > 0; }

/* sleep until something may have changed (a submit, an abort, an adapter load) */
static void wait_for_work(engine_t *e, int timeout_ms) {
    pthread_mutex_lock(&e->mu);
    if (!e->wake && !e->stop_thread && !e->inbox_head && !e->n_aborts) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += (long)timeout_ms * 1000000L;
        ts.tv_sec += ts.tv_nsec / 1000000000L;
        ts.tv_nsec %= 1000000000L;
        pthread_cond_timedwait(&e->cv, &e->mu, &ts);
    }
    e->wake = false;
    pthread_mutex_unlock(&e->mu);
}

static void *engine_thread(void *arg) {
    engine_t *e = arg;
    for (;;) {
        pthread_mutex_lock(&e->mu);
        bool stop = e->stop_thread;
        pthread_mutex_unlock(&e->mu);
        if (stop) break;
        int ran = engine_step(e);
        pthread_mutex_lock(&e->mu);
        bool follows = e->follows != NULL; /* waiting for an adapter load: poll */
        pthread_mutex_unlock(&e->mu);
        if (ran == 0) wait_for_work(e, has_work(e) || follows ? 20 : 1000);
    }
    pthread_mutex_lock(&e->mu); /* nobody will move requests any more: answer the callers */
    for (follow_t *f = e->follows, *nx; f; f = nx) {
        nx = f->next;
        f->done = true;
        if (f->abandoned) {
            free(f->name);
            free(f);
        }
    }
    e->follows = NULL;
    for (base_job_t *j = e->base_jobs; j; j = j->next) { /* never run: refused */
        model_free(j->u.model);
        j->rc = CS_EINVAL;
        snprintf(j->err, sizeof j->err, "the engine stopped before the update");
        j->done = true;
    }
    e->base_jobs = NULL;
    pthread_cond_broadcast(&e->follow_cv);
    pthread_cond_broadcast(&e->pause_cv); /* engine_set_pause does not wait for a stopped thread */
    pthread_mutex_unlock(&e->mu);
    sampling_scratch_free();
    return NULL;
}

void engine_run_until_idle(engine_t *e) {
    for (;;) {
        int ran = engine_step(e);
        pthread_mutex_lock(&e->mu);
        bool pending = e->inbox_head != NULL || e->n_aborts > 0;
        pthread_mutex_unlock(&e->mu);
        if (ran == 0 && !has_work(e) && !pending) break;
        if (ran == 0) wait_for_work(e, 20);
    }
}

int engine_start(engine_t *e) {
    if (e->thread_started) return CS_OK;
    if (pthread_create(&e->thread, NULL, engine_thread, e)) return cs_error_set(CS_ENOMEM, "cannot start the engine thread");
    e->thread_started = true;
    return CS_OK;
}

static void on_adapter_loaded(void *user) {
    engine_t *e = user;
    pthread_mutex_lock(&e->mu);
    e->wake = true;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

void engine_wake(engine_t *e) { on_adapter_loaded(e); }

/* ---- construction ---- */
int engine_new(const engine_params_t *p, engine_t **out) {
    *out = NULL;
    if (!p->model) return cs_error_set(CS_EINVAL, "engine: no model");
    if (!p->sched) return cs_error_set(CS_EINVAL, "engine: no scheduling policy (engine_params_t.sched)");
    engine_t *e = calloc(1, sizeof *e);
    if (!e) return cs_error_set(CS_ENOMEM, "out of memory");
    e->p = *p;
    e->model = p->model;
    e->be = model_backend(p->model);
    e->mcfg = *model_get_config(p->model);
    e->cfg = &e->mcfg;
    if (!(e->bases = base_new(e, p->model, p->model_dir, p->weight_version ? p->weight_version : "default", p->own_model))) {
        free(e);
        return cs_error_set(CS_ENOMEM, "out of memory");
    }
    e->vocab = e->cfg->vocab_size;
    if (e->p.max_num_seqs <= 0) e->p.max_num_seqs = 256;
    if (e->p.logits_keep_bytes == 0) e->p.logits_keep_bytes = LOGITS_KEEP_BYTES;
    if (e->p.max_num_batched_tokens <= 0) e->p.max_num_batched_tokens = 2048;
    assist_reserve(e, p->model);
    pthread_mutex_init(&e->mu, NULL);
    pthread_mutex_init(&e->vocab_mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    pthread_cond_init(&e->follow_cv, NULL);
    pthread_cond_init(&e->pause_cv, NULL);
    e->next_id = 1;
    int rc;
    kv_cache_params_t kp = {e->cfg->n_layers, e->cfg->n_kv_heads * e->cfg->head_dim, p->kv_cache_bytes, p->kv_cache_dtype};
    e->kvp = kp;
    if ((rc = kv_cache_new(model_backend(p->model), &kp, &e->kv))) goto err;
    int cap_tokens = kv_cache_n_blocks(e->kv) * KV_BLOCK_SIZE;
    e->max_model_len = p->max_model_len > 0 ? p->max_model_len
                                            : (e->cfg->max_position_embeddings > 0 ? e->cfg->max_position_embeddings : cap_tokens);
    if (e->max_model_len > cap_tokens) e->max_model_len = cap_tokens;
    /* EOS ids */
    const int32_t *eos = p->eos_ids;
    int n_eos = p->n_eos;
    if (!eos && p->tokenizer) n_eos = tokenizer_eos_ids(p->tokenizer, &eos);
    e->eos = malloc(sizeof(int32_t) * (size_t)(n_eos + 1));
    e->banned = malloc(sizeof(int32_t) * (size_t)(n_eos + 256 + 1));
    if (!e->eos || !e->banned) { rc = cs_error_set(CS_ENOMEM, "out of memory"); goto err; }
    if (n_eos) memcpy(e->eos, eos, sizeof(int32_t) * (size_t)n_eos);
    e->n_eos = n_eos;
    if (!(e->beams = beam_set_new())) { rc = cs_error_set(CS_ENOMEM, "out of memory"); goto err; }
    *out = e;
    return CS_OK;
err:
    engine_free(e);
    return rc;
}

int engine_max_model_len(const engine_t *e) { return e->max_model_len; }

void engine_free(engine_t *e) {
    if (!e) return;
    beam_set_free(e->beams); /* before the thread: their steps end through it */
    if (e->thread_started) {
        cs_stop_flag(&e->mu, &e->cv, &e->stop_thread);
        pthread_join(e->thread, NULL);
    }
    {
        take_inbox(e);
        for (int b = 0; b < REQ_BUCKETS; b++)
            while (e->reqs[b]) req_fail(e, e->reqs[b], ENGINE_FINISH_ABORT, 0, NULL);
    }
    kv_cache_free(e->kv);
    free(e->eos);
    free(e->banned);
    grammar_vocab_free(e->gvocab);
    free(e->gmask);
    free(e->glogits);
    pthread_mutex_destroy(&e->vocab_mu);
    free(e->batch);
    free(e->batch_seq);
    free(e->batch_chunk);
    free(e->views);
    free(e->pub);
    free(e->pub_work);
    free(e->vseqs);
    free(e->vids);
    free(e->perm);
    free(e->logits);
    free(e->aborts);
    free(e->lp_scratch);
    for (follow_t *f = e->follows, *nx; f; f = nx) { /* abandoned ones (callers gone) */
        nx = f->next;
        free(f->name);
        free(f);
    }
    for (base_ver_t *b = e->bases, *nx; b; b = nx) { /* every request is gone */
        nx = b->next;
        if (b->owned) model_free(b->model);
        free(b->dir);
        free(b);
    }
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->cv);
    pthread_cond_destroy(&e->follow_cv);
    pthread_cond_destroy(&e->pause_cv);
    free(e);
}

/* ---- submission (any thread) ---- */
static char *dupstr(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

/* VERSION (0: the active one) held for a request: refs */
static int base_acquire(engine_t *e, int version, base_ver_t **out) {
    pthread_mutex_lock(&e->mu);
    base_ver_t *b = e->bases;
    while (version && b && b->version != version) b = b->next;
    if (b) b->refs++;
    char held[256] = "";
    size_t k = 0;
    for (base_ver_t *o = e->bases; !b && o && k < sizeof held - 16; o = o->next)
        k += (size_t)snprintf(held + k, sizeof held - k, "%s%d", k ? ", " : "", o->version);
    pthread_mutex_unlock(&e->mu);
    *out = b;
    return b ? CS_OK : cs_error_set(CS_ENOTFOUND, "base version %d is not held (held: %s)", version, held);
}

/* the vocabulary as bytes for structured output, made once (any thread) */
static int grammar_vocab_ready(engine_t *e) {
    if (!e->p.tokenizer) return cs_error_set(CS_EINVAL, "structured output needs the model's tokenizer");
    pthread_mutex_lock(&e->vocab_mu);
    int rc = e->gvocab ? CS_OK : grammar_vocab_new(e->p.tokenizer, e->eos, e->n_eos, &e->gvocab);
    pthread_mutex_unlock(&e->vocab_mu);
    return rc;
}

/* validate and copy one request (not queued yet) */
static int prepare(engine_t *e, const engine_request_t *rq, req_t **out) {
    *out = NULL;
    int n = rq->n > 0 ? rq->n : 1;
    if (rq->n < 0) return cs_error_set(CS_EINVAL, "n must be at least 1");
    if (n > e->p.max_num_seqs)
        return cs_error_set(CS_EINVAL, "n = %d exceeds the server's max_num_seqs (%d)", n, e->p.max_num_seqs);
    if (!rq->prompt || rq->n_prompt <= 0) return cs_error_set(CS_EINVAL, "the prompt is empty");
    for (int i = 0; i < rq->n_prompt; i++)
        if (rq->prompt[i] < 0 || rq->prompt[i] >= e->vocab)
            return cs_error_set(CS_EINVAL, "prompt token id %d (position %d) is out of range [0, %d)", rq->prompt[i], i,
                                e->vocab);
    if (rq->n_prompt >= e->max_model_len)
        return cs_error_set(CS_EINVAL,
                            "this model's maximum context length is %d tokens, but the prompt has %d tokens (at least "
                            "one must be left to generate)",
                            e->max_model_len, rq->n_prompt);
    int max_tokens = rq->max_tokens < 0 ? e->max_model_len - rq->n_prompt : rq->max_tokens;
    if (max_tokens < 1 && !(max_tokens == 0 && rq->prompt_logprobs))
        return cs_error_set(CS_EINVAL, "max_tokens must be at least 1 (0 only with prompt logprobs, as echo)");
    if ((long)rq->n_prompt + max_tokens > e->max_model_len)
        return cs_error_set(CS_EINVAL,
                            "this model's maximum context length is %d tokens, but %d were requested (%d in the prompt, "
                            "%d for the completion); reduce the prompt or max_tokens",
                            e->max_model_len, rq->n_prompt + max_tokens, rq->n_prompt, max_tokens);
    if (rq->min_tokens < 0 || rq->min_tokens > max_tokens)
        return cs_error_set(CS_EINVAL, "min_tokens must be between 0 and max_tokens (%d)", max_tokens);
    int rc = sampling_params_validate(&rq->sampling);
    if (rc || (rc = sampling_params_validate_ids(&rq->sampling, e->vocab))) return rc;
    if (rq->prompt_logprobs && (rq->prompt_top_logprobs < 0 || rq->prompt_top_logprobs > SAMPLING_MAX_LOGPROBS))
        return cs_error_set(CS_EINVAL, "prompt_logprobs must be between 0 and %d", SAMPLING_MAX_LOGPROBS);
    if (rq->n_stop < 0) return cs_error_set(CS_EINVAL, "negative number of stop strings");
    if (rq->n_stop > 0 && !e->p.tokenizer) return cs_error_set(CS_EINVAL, "stop strings need a tokenizer");
    if (rq->n_stop > 0 && (rc = stop_strings_validate(rq->stop, rq->n_stop))) return rc;
    if (rq->n_stop_token_ids < 0 || rq->n_stop_token_ids > 256) return cs_error_set(CS_EINVAL, "at most 256 stop_token_ids");
    for (int i = 0; i < rq->n_stop_token_ids; i++)
        if (rq->stop_token_ids[i] < 0 || rq->stop_token_ids[i] >= e->vocab)
            return cs_error_set(CS_EINVAL, "stop_token_ids: %d is out of range [0, %d)", rq->stop_token_ids[i], e->vocab);
    if (rq->grammar && (rc = grammar_vocab_ready(e))) return rc;
    if (rq->grammar && rq->n_resumed > 0 && !rq->grammar_gated) { /* its output so far must follow the grammar */
        grammar_matcher_t *gm = grammar_matcher_new(rq->grammar);
        bool ok = gm != NULL;
        for (int i = rq->n_prompt - rq->n_resumed; ok && i < rq->n_prompt; i++)
            ok = grammar_matcher_accept_token(gm, e->gvocab, rq->prompt[i]);
        grammar_matcher_free(gm);
        if (!ok) return cs_error_set(CS_EINVAL, "the output to continue does not follow the request's grammar");
    }
    const char *adapter = rq->adapter && rq->adapter[0] ? rq->adapter : NULL;
    if (rq->n_resumed < 0 || rq->n_resumed >= rq->n_prompt || (rq->n_resumed && n != 1))
        return cs_error_set(CS_EINVAL, "n_resumed must be below the prompt length, with n = 1");
    if (rq->adapter_version < 0) return cs_error_set(CS_EINVAL, "adapter versions start at 1");
    if (rq->base_version < 0) return cs_error_set(CS_EINVAL, "base versions start at 1");
    if (rq->adapter_version && !adapter) return cs_error_set(CS_EINVAL, "a version needs an adapter");
    if (adapter) {
        if (!e->p.loras) return cs_error_set(CS_ENOTFOUND, "adapter '%s' does not exist (no adapters are served)", adapter);
        lora_state st;
        int ver;
        if (lora_registry_state(e->p.loras, adapter, &st, &ver))
            return cs_error_set(CS_ENOTFOUND, "adapter '%s' does not exist", adapter);
    }

    req_t *r = calloc(1, sizeof *r);
    if (!r) return cs_error_set(CS_ENOMEM, "out of memory");
    r->p = *rq;
    grammar_ref(r->p.grammar); /* req_free drops it */
    r->p.n = n;
    r->p.max_tokens = max_tokens;
    r->n = n;
    r->p.prompt = NULL;
    r->p.stop = NULL;
    r->p.stop_token_ids = NULL;
    if ((rq->sampling.n_allowed || rq->sampling.n_bias) && !(r->lists = sampling_lists_copy(&rq->sampling, &r->p.sampling)))
        goto oom;
    int32_t *prompt = malloc(sizeof(int32_t) * (size_t)rq->n_prompt);
    char **stops = rq->n_stop ? calloc((size_t)rq->n_stop, sizeof(char *)) : NULL;
    int32_t *stids = rq->n_stop_token_ids ? malloc(sizeof(int32_t) * (size_t)rq->n_stop_token_ids) : NULL;
    r->seqs = calloc((size_t)n, sizeof *r->seqs);
    r->p.prompt = prompt;
    r->p.stop = (const char *const *)stops;
    r->p.stop_token_ids = stids;
    if (!prompt || (rq->n_stop && !stops) || (rq->n_stop_token_ids && !stids) || !r->seqs) goto oom;
    memcpy(prompt, rq->prompt, sizeof(int32_t) * (size_t)rq->n_prompt);
    for (int i = 0; i < rq->n_stop; i++)
        if (!(stops[i] = dupstr(rq->stop[i]))) goto oom;
    if (stids) memcpy(stids, rq->stop_token_ids, sizeof(int32_t) * (size_t)rq->n_stop_token_ids);
    if (adapter && !(r->adapter = dupstr(adapter))) goto oom;
    if (rq->adapter_version) { /* held from now on: an upload or a DELETE cannot drop it */
        r->loras = e->p.loras;
        int prc = lora_registry_pin(e->p.loras, adapter, rq->adapter_version, &r->pin);
        if (prc) {
            req_free(r);
            return prc; /* the message names the kept versions */
        }
    }
    r->eng = e;
    int brc = base_acquire(e, rq->base_version, &r->base);
    if (brc) {
        req_free(r);
        return brc;
    }
    if (rq->prompt_logprobs) {
        size_t np = (size_t)rq->n_prompt, k = (size_t)rq->prompt_top_logprobs;
        r->plp = malloc(sizeof(float) * np);
        r->plp_rank = calloc(np, sizeof(int32_t));
        r->plp_ids = k ? malloc(sizeof(int32_t) * np * k) : NULL;
        r->plp_lps = k ? malloc(sizeof(float) * np * k) : NULL;
        if (!r->plp || !r->plp_rank || (k && (!r->plp_ids || !r->plp_lps))) goto oom;
        for (size_t i = 0; i < np; i++) r->plp[i] = NAN;
        for (size_t i = 0; k && i < np * k; i++) { r->plp_ids[i] = -1; r->plp_lps[i] = NAN; }
    }
    r->root = req_root(r);
    r->n_live = 1;
    r->t_submit = now_ms();
    if (!(r->seqs[0] = seq_new(e, r, 0, prompt, rq->n_prompt))) goto oom;
    if (!r->p.sampling.has_seed) {
        /* one random seed for the request so samples are seed + i of it */
        r->p.sampling.seed = sampling_seed_for(&r->p.sampling, 0);
        r->p.sampling.has_seed = true;
    }

    *out = r;
    return CS_OK;
oom:
    req_free(r);
    return cs_error_set(CS_ENOMEM, "out of memory");
}

/* under e->mu */
static void enqueue(engine_t *e, req_t *r) {
    r->id = e->next_id++;
    if (e->inbox_tail) e->inbox_tail->inext = r; else e->inbox_head = r;
    e->inbox_tail = r;
    e->n_live_requests++;
}

/* A beam search: its own checks, then every other one a request's gets; it runs on a thread. */
static int submit_beam(engine_t *e, const engine_request_t *rq, uint64_t *id) {
    const sampling_params_t *sp = &rq->sampling;
    if (rq->n < 0 || rq->n > BEAM_MAX_WIDTH)
        return cs_error_set(CS_EINVAL, "beam search takes n (the beam width) from 1 to %d", BEAM_MAX_WIDTH);
    if (rq->n_stop || rq->n_stop_token_ids) return cs_error_set(CS_EINVAL, "beam search takes no stop strings or ids");
    if (sp->n_allowed || sp->n_bias) return cs_error_set(CS_EINVAL, "beam search takes no allowed_token_ids or logit_bias");
    if (sp->repetition_penalty != 1 || sp->presence_penalty != 0 || sp->frequency_penalty != 0)
        return cs_error_set(CS_EINVAL, "beam search takes no repetition, presence or frequency penalty");
    if (rq->min_tokens || rq->n_resumed) return cs_error_set(CS_EINVAL, "beam search takes no min_tokens");
    if (rq->grammar) return cs_error_set(CS_EINVAL, "beam search takes no structured output constraint");
    if (!isfinite(rq->length_penalty)) return cs_error_set(CS_EINVAL, "length_penalty must be a finite number");
    engine_request_t one = *rq;
    one.beam_search = false;
    one.n = 1;
    req_t *r;
    int rc = prepare(e, &one, &r); /* the prompt, the lengths, the adapter, the sampling values */
    if (rc) return rc;
    one.max_tokens = r->p.max_tokens;
    one.n = rq->n > 0 ? rq->n : 1;
    req_free(r);
    pthread_mutex_lock(&e->mu);
    bool running = e->thread_started && !e->stop_thread;
    uint64_t bid = e->next_id++;
    pthread_mutex_unlock(&e->mu);
    if (!running) return cs_error_set(CS_EINVAL, "beam search needs the engine thread");
    beam_env_t env = {e->p.tokenizer, e->eos, e->n_eos};
    if ((rc = beam_start(e->beams, e, &env, &one, bid))) return rc;
    if (id) *id = bid;
    return CS_OK;
}

int engine_submit(engine_t *e, const engine_request_t *rq, uint64_t *id) {
    if (rq->beam_search) return submit_beam(e, rq, id);
    req_t *r;
    int rc = prepare(e, rq, &r);
    if (rc) return rc;
    pthread_mutex_lock(&e->mu);
    enqueue(e, r);
    if (id) *id = r->id;
    e->wake = true;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    return CS_OK;
}

int engine_submit_batch(engine_t *e, const engine_request_t *rqs, int n, uint64_t *ids, int *failed) {
    for (int i = 0; i < n; i++)
        if (rqs[i].beam_search) {
            if (failed) *failed = i;
            return cs_error_set(CS_EINVAL, "a beam search is submitted on its own (engine_submit)");
        }
    req_t **rs = calloc((size_t)(n > 0 ? n : 1), sizeof *rs);
    if (!rs) return cs_error_set(CS_ENOMEM, "out of memory");
    for (int i = 0; i < n; i++) {
        int rc = prepare(e, &rqs[i], &rs[i]);
        if (rc) {
            for (int k = 0; k < i; k++) req_free(rs[k]);
            free(rs);
            if (failed) *failed = i;
            return rc;
        }
    }
    pthread_mutex_lock(&e->mu);
    for (int i = 0; i < n; i++) {
        enqueue(e, rs[i]);
        if (ids) ids[i] = rs[i]->id; /* before the unlock: the sinks may run right after it */
    }
    e->wake = true;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    free(rs);
    return CS_OK;
}

int engine_abort(engine_t *e, uint64_t id) {
    if (beam_abort(e->beams, id)) return CS_OK;
    pthread_mutex_lock(&e->mu);
    if (id == 0 || id >= e->next_id) {
        pthread_mutex_unlock(&e->mu);
        return cs_error_set(CS_ENOTFOUND, "no request %llu", (unsigned long long)id);
    }
    if (e->n_aborts == e->cap_aborts) {
        int nc = e->cap_aborts ? e->cap_aborts * 2 : 16;
        uint64_t *na = realloc(e->aborts, sizeof *na * (size_t)nc);
        if (!na) { pthread_mutex_unlock(&e->mu); return cs_error_set(CS_ENOMEM, "out of memory"); }
        e->aborts = na;
        e->cap_aborts = nc;
    }
    e->aborts[e->n_aborts++] = id;
    e->wake = true;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    return CS_OK;
}

int engine_follow_active(engine_t *e, const char *name, int timeout_ms) {
    follow_t *f = calloc(1, sizeof *f);
    if (!f || !(f->name = dupstr(name))) {
        free(f);
        return cs_error_set(CS_ENOMEM, "out of memory");
    }
    pthread_mutex_lock(&e->mu);
    if (!e->thread_started || e->stop_thread) {
        pthread_mutex_unlock(&e->mu);
        free(f->name);
        free(f);
        return cs_error_set(CS_EINVAL, "the engine thread is not running");
    }
    f->next = e->follows;
    e->follows = f;
    e->wake = true;
    pthread_cond_signal(&e->cv);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += timeout_ms / 1000;
    ts.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    ts.tv_sec += ts.tv_nsec / 1000000000L;
    ts.tv_nsec %= 1000000000L;
    while (!f->done)
        if (pthread_cond_timedwait(&e->follow_cv, &e->mu, &ts)) break;
    int rc;
    if (f->done) {
        rc = f->moved;
        free(f->name);
        free(f);
    } else {
        f->abandoned = true;
        rc = cs_error_set(CS_EAGAIN, "adapter '%s': the active version is still loading; running requests move "
                                     "to it once it is loaded", name);
    }
    pthread_mutex_unlock(&e->mu);
    return rc;
}

void engine_set_pause(engine_t *e, engine_pause_mode mode) {
    pthread_mutex_lock(&e->mu);
    e->pause = mode;
    uint64_t gen = ++e->pause_gen;
    e->wake = true;
    pthread_cond_signal(&e->cv);
    /* HOLD returns once the iteration under way (if any) is over: nothing runs after this */
    while (mode == ENGINE_PAUSE_HOLD && e->thread_started && !e->stop_thread && e->pause_seen < gen)
        pthread_cond_wait(&e->pause_cv, &e->mu);
    pthread_mutex_unlock(&e->mu);
}

int engine_flush_prefix_cache(engine_t *e) {
    pthread_mutex_lock(&e->mu);
    int n;
    if (!e->thread_started || e->stop_thread) { /* the caller drives the engine */
        n = e->kv ? kv_prefix_flush(e->kv) : 0;
    } else {
        uint64_t gen = ++e->flush_gen;
        e->wake = true;
        pthread_cond_signal(&e->cv);
        while (e->thread_started && !e->stop_thread && e->flush_seen < gen) pthread_cond_wait(&e->pause_cv, &e->mu);
        n = e->flush_dropped;
    }
    pthread_mutex_unlock(&e->mu);
    return n;
}

/* J to the engine thread, and back once done (without the thread: run here) */
static int job_wait(engine_t *e, base_job_t *j) {
    pthread_mutex_lock(&e->mu);
    bool threaded = e->thread_started && !e->stop_thread;
    if (threaded) {
        base_job_t **pp = &e->base_jobs;
        while (*pp) pp = &(*pp)->next;
        *pp = j;
        e->wake = true;
        pthread_cond_signal(&e->cv);
        while (!j->done) pthread_cond_wait(&e->follow_cv, &e->mu);
    }
    pthread_mutex_unlock(&e->mu);
    if (!threaded) job_run(e, j); /* the caller drives the steps: this is their thread */
    if (j->rc) cs_error_set(j->rc, "%s", j->err);
    return j->rc;
}

int engine_sleep(engine_t *e, int level) {
    if (level < 0 || level > 2) return cs_error_set(CS_EINVAL, "sleep levels are 0, 1 and 2");
    if (level == 2 && !e->p.own_model) return cs_error_set(CS_EINVAL, "sleep level 2 needs an engine that owns its weights");
    base_job_t j = {.op = JOB_SLEEP, .level = level};
    return level ? job_wait(e, &j) : CS_OK;
}

int engine_wake_up(engine_t *e, bool weights, bool kv) {
    base_job_t j = {.op = JOB_WAKE, .weights = weights, .kv = kv};
    return job_wait(e, &j);
}

bool engine_sleeping(engine_t *e) {
    pthread_mutex_lock(&e->mu);
    bool s = e->sleeping_pub;
    pthread_mutex_unlock(&e->mu);
    return s;
}

int engine_update_base(engine_t *e, const engine_base_update_t *u, engine_base_result_t *res) {
    *res = (engine_base_result_t){0};
    model_config_t nc;
    char why[320];
    int rc = CS_OK;
    if (!u->dir || !u->dir[0]) rc = cs_error_set(CS_EINVAL, "an update names the directory of its weights");
    else if (u->model && model_backend(u->model) != e->be)
        rc = cs_error_set(CS_EINVAL, "the new weights are on another backend");
    else if (!u->model && !e->p.own_model)
        rc = cs_error_set(CS_EINVAL, "an in-place update needs an engine that owns its weights (own_model)");
    else if (u->model) nc = *model_get_config(u->model);
    else rc = model_probe(u->dir, &nc);
    if (!rc && model_config_compatible(e->cfg, &nc, why, sizeof why))
        rc = cs_error_set(CS_ESHAPE, "%s cannot replace the served weights: %s", u->dir, why);
    if (!rc && u->label && strlen(u->label) >= ENGINE_LABEL_MAX)
        rc = cs_error_set(CS_EINVAL, "a weight version's name has at most %d bytes", ENGINE_LABEL_MAX - 1);
    base_job_t *j = rc ? NULL : calloc(1, sizeof *j);
    if (!rc && !j) rc = cs_error_set(CS_ENOMEM, "out of memory");
    if (rc) {
        model_free(u->model);
        return rc;
    }
    j->u = *u; /* the caller's strings live until this returns */
    rc = job_wait(e, j);
    *res = j->res;
    free(j);
    return rc;
}

int engine_base_versions(engine_t *e, engine_base_info_t *out, int max) {
    int n = 0;
    pthread_mutex_lock(&e->mu);
    for (base_ver_t *b = e->bases; b; b = b->next, n++) {
        if (n >= max) continue;
        engine_base_info_t *o = &out[n];
        o->version = b->version;
        memcpy(o->label, b->label, sizeof o->label);
        snprintf(o->dir, sizeof o->dir, "%s", b->dir ? b->dir : "");
        o->requests = b->refs;
        o->active = b == e->bases;
        o->kept = b->kept;
    }
    pthread_mutex_unlock(&e->mu);
    return n;
}

void engine_base_relabel(engine_t *e, const char *label) {
    pthread_mutex_lock(&e->mu);
    snprintf(e->bases->label, sizeof e->bases->label, "%s", label);
    pthread_mutex_unlock(&e->mu);
}

void engine_base_label(engine_t *e, int version, char *buf, size_t n) {
    pthread_mutex_lock(&e->mu);
    base_ver_t *b = e->bases;
    while (b && b->version != version) b = b->next;
    if (b) snprintf(buf, n, "%s", b->label);
    else snprintf(buf, n, "%d", version);
    pthread_mutex_unlock(&e->mu);
}

void engine_get_stats(engine_t *e, engine_stats_t *st) {
    pthread_mutex_lock(&e->mu);
    *st = e->stats;
    pthread_mutex_unlock(&e->mu);
}

int engine_get_state(engine_t *e, engine_seq_info_t **out, int *n) {
    *out = NULL;
    *n = 0;
    pthread_mutex_lock(&e->mu);
    int m = e->n_pub;
    for (req_t *r = e->inbox_head; r; r = r->inext) m++;
    engine_seq_info_t *o = malloc(sizeof *o * (size_t)(m ? m : 1));
    if (!o) {
        pthread_mutex_unlock(&e->mu);
        return cs_error_set(CS_ENOMEM, "out of memory");
    }
    if (e->n_pub) memcpy(o, e->pub, sizeof *o * (size_t)e->n_pub);
    int k = e->n_pub;
    for (req_t *r = e->inbox_head; r; r = r->inext) seq_info_fill(e, r, NULL, &o[k++]);
    pthread_mutex_unlock(&e->mu);
    *out = o;
    *n = k;
    return CS_OK;
}
