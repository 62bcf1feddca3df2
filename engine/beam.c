/* beam.c: beam search as vLLM defines it (its OpenAI server's beam_search), driven over the
 * engine's own requests. A search runs on a thread of its own. Each step submits one request
 * per live beam, together (engine_submit_batch): the prompt plus the beam's tokens, one token,
 * greedy, with the raw logprobs of its top 2 * width tokens; the prefix cache holds what the
 * beams share, so a step computes little more than the tokens past the last full block. Every
 * live beam's 2 * width alternatives become candidates scored by cumulative logprob: one that
 * is EOS (unless ignore_eos) ends its beam, which joins the finished ones without the EOS
 * token; the best width of the others are the next step's beams. After max_tokens steps (or
 * when no beam is left) the finished and the live beams are ranked by
 *     cum_logprob / (prompt + output tokens) ^ length_penalty
 * and the best width of them are replayed to the request's sink as samples 0 .. width-1,
 * token by token with their logprobs and alternatives, as a sampled request's events come.
 * Ties keep the order vLLM's stable sorts keep: earlier beam first, then the better rank. */
#include "engine/beam.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

typedef struct bnode {          /* one token of a beam; beams share their prefixes */
    int parent;                 /* -1: the prompt */
    int depth;                  /* output tokens up to this one */
    int32_t tok;
    float lp;
    int top, n_top;             /* its step's alternatives in the top arena */
} bnode_t;

typedef struct hyp {            /* a beam, live or finished */
    int node;                   /* its last token (-1: none) */
    double cum;                 /* sum of its logprobs (and of the EOS that ended it) */
    double score;               /* in the final ranking */
    int order;                  /* ties keep this order (a stable sort's) */
    bool eos;                   /* ended by EOS */
    /* a candidate not yet a node: */
    int32_t tok;
    float lp;
    int top, n_top;
} hyp_t;

typedef struct step_res {
    bool has_token;
    int n_top;
    int32_t ids[SAMPLING_MAX_LOGPROBS];
    float lps[SAMPLING_MAX_LOGPROBS];
} step_res_t;

typedef struct beam beam_t;
typedef struct slot {
    beam_t *b;
    int i;
} slot_t;

struct beam {
    beam_set_t *bs;
    engine_t *e;
    beam_env_t env;
    uint64_t id;
    engine_request_t rq;        /* the caller's (prompt copied) */
    int width, n_lp, n_user_top;
    pthread_t th;
    bool finished;              /* under bs->mu: the thread is done (join it) */
    beam_t *next;
    /* shared with the step sinks, under mu */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool aborted;
    int pending, step;
    step_res_t res[BEAM_MAX_WIDTH];
    slot_t slots[BEAM_MAX_WIDTH];
    int err;
    char *err_msg;
    int n_cached;
    double queue_ms;
    int adapter_version;
    /* the driver's */
    bnode_t *nodes;
    int n_nodes, cap_nodes;
    int32_t *top_ids;
    float *top_lps;
    int n_tops, cap_top_ids, cap_top_lps;
    hyp_t live[BEAM_MAX_WIDTH];
    int n_live;
    hyp_t *fin;                 /* finished beams, then (at the end) every beam ranked */
    int n_fin, cap_fin;
    hyp_t *cand;
    int cap_cand;
    int32_t *buf;               /* the step's prompts */
    size_t cap_buf;
};

struct beam_set {
    pthread_mutex_t mu;
    beam_t *head;
};

static int grow(void **p, int *cap, int need, size_t elem) {
    if (need <= *cap) return CS_OK;
    int nc = *cap ? *cap * 2 : 64;
    while (nc < need) nc *= 2;
    void *np = realloc(*p, (size_t)nc * elem);
    if (!np) return cs_error_set(CS_ENOMEM, "out of memory");
    *p = np;
    *cap = nc;
    return CS_OK;
}

static bool is_eos(const beam_t *b, int32_t t) {
    for (int i = 0; i < b->env.n_eos; i++)
        if (b->env.eos[i] == t) return true;
    return false;
}

/* ---- a step's requests (their sinks run on the engine thread) ---- */
static void step_sink(void *user, const engine_event_t *ev) {
    slot_t *sl = user;
    beam_t *b = sl->b;
    /* b->step was set before the step's requests went in (the engine's mutex orders it); the
     * caller's sink runs outside b->mu (it may hold its own lock while it aborts) */
    bool first = b->step == 0;
    if (first && ev->prompt_logprobs && b->rq.sink) { /* the caller asked for them: passed on */
        engine_event_t pe = *ev;
        pe.request_id = b->id;
        pe.index = 0;
        pe.has_token = false;
        pe.finish = ENGINE_FINISH_NONE;
        pe.request_done = false;
        pe.n_top = 0;
        pe.text = "";
        pe.text_len = 0;
        b->rq.sink(b->rq.user, &pe);
    }
    pthread_mutex_lock(&b->mu);
    step_res_t *r = &b->res[sl->i];
    if (ev->has_token) {
        r->has_token = true;
        r->n_top = ev->n_top < SAMPLING_MAX_LOGPROBS ? ev->n_top : SAMPLING_MAX_LOGPROBS;
        if (r->n_top > 0) {
            memcpy(r->ids, ev->top_ids, sizeof(int32_t) * (size_t)r->n_top);
            memcpy(r->lps, ev->top_logprobs, sizeof(float) * (size_t)r->n_top);
        }
    }
    if (first) {
        b->n_cached = ev->n_cached_tokens;
        b->queue_ms = ev->queue_ms;
    }
    b->adapter_version = ev->adapter_version;
    if (ev->finish == ENGINE_FINISH_ERROR && !b->err) {
        b->err = ev->error ? ev->error : CS_EINVAL;
        free(b->err_msg);
        b->err_msg = strdup(ev->error_msg ? ev->error_msg : cs_strerror(b->err));
    }
    if (ev->request_done && --b->pending == 0) pthread_cond_signal(&b->cv);
    pthread_mutex_unlock(&b->mu);
}

/* the output tokens of node (oldest first) into out[depth] */
static void path_of(const beam_t *b, int node, int32_t *out) {
    for (int k = node; k >= 0; k = b->nodes[k].parent) out[b->nodes[k].depth - 1] = b->nodes[k].tok;
}

/* Run one step over the live beams: CS_OK with b->res filled, or ABORT/ERROR in *fin. */
static int run_step(beam_t *b, int step, engine_finish *fin) {
    size_t len = (size_t)b->rq.n_prompt + (size_t)step;
    if ((size_t)b->n_live * len > b->cap_buf) {
        int32_t *nb = realloc(b->buf, sizeof(int32_t) * (size_t)b->n_live * len);
        if (!nb) {
            b->err = cs_error_set(CS_ENOMEM, "out of memory");
            *fin = ENGINE_FINISH_ERROR;
            return b->err;
        }
        b->buf = nb;
        b->cap_buf = (size_t)b->n_live * len;
    }
    engine_request_t rqs[BEAM_MAX_WIDTH];
    for (int i = 0; i < b->n_live; i++) {
        int32_t *p = b->buf + (size_t)i * len;
        memcpy(p, b->rq.prompt, sizeof(int32_t) * (size_t)b->rq.n_prompt);
        path_of(b, b->live[i].node, p + b->rq.n_prompt);
        engine_request_t *q = &rqs[i];
        memset(q, 0, sizeof *q);
        q->prompt = p;
        q->n_prompt = (int)len;
        q->adapter = b->rq.adapter;
        q->adapter_version = b->rq.adapter_version;
        sampling_params_default(&q->sampling);
        q->sampling.temperature = 0;
        q->sampling.logprobs = b->n_lp;
        q->sampling.logprobs_mode = SAMPLING_LOGPROBS_RAW;
        q->n = 1;
        q->max_tokens = 1;
        q->ignore_eos = true;
        q->prompt_logprobs = step == 0 && b->rq.prompt_logprobs;
        q->prompt_top_logprobs = b->rq.prompt_top_logprobs;
        q->sink = step_sink;
        q->user = &b->slots[i];
    }
    pthread_mutex_lock(&b->mu);
    b->step = step;
    b->pending = b->n_live;
    memset(b->res, 0, sizeof b->res);
    bool aborted = b->aborted;
    pthread_mutex_unlock(&b->mu);
    if (aborted) {
        *fin = ENGINE_FINISH_ABORT;
        return CS_EINVAL;
    }
    uint64_t ids[BEAM_MAX_WIDTH];
    int rc = engine_submit_batch(b->e, rqs, b->n_live, ids, NULL);
    if (rc) { /* e.g. the adapter was unloaded since: the message says so */
        b->err = rc;
        b->err_msg = strdup(cs_error_last());
        *fin = ENGINE_FINISH_ERROR;
        return rc;
    }
    bool abort_sent = false;
    pthread_mutex_lock(&b->mu);
    while (b->pending > 0) {
        if (b->aborted && !abort_sent) {
            pthread_mutex_unlock(&b->mu);
            for (int i = 0; i < b->n_live; i++) engine_abort(b->e, ids[i]);
            abort_sent = true;
            pthread_mutex_lock(&b->mu);
            continue;
        }
        pthread_cond_wait(&b->cv, &b->mu);
    }
    aborted = b->aborted;
    int err = b->err;
    bool complete = true;
    for (int i = 0; i < b->n_live; i++) complete &= b->res[i].has_token;
    pthread_mutex_unlock(&b->mu);
    if (err) *fin = ENGINE_FINISH_ERROR;
    else if (aborted || !complete) *fin = ENGINE_FINISH_ABORT;
    else return CS_OK;
    return CS_EINVAL;
}

static int cmp_cum(const void *pa, const void *pb) {
    const hyp_t *a = pa, *b = pb;
    if (a->cum != b->cum) return a->cum > b->cum ? -1 : 1;
    return a->order - b->order;
}

/* The step's candidates: EOS ones end their beams, the best width of the rest go on. */
static int expand(beam_t *b) {
    int nc = 0, order = 0;
    if (grow((void **)&b->cand, &b->cap_cand, b->n_live * 2 * b->width, sizeof(hyp_t))) return CS_ENOMEM;
    for (int i = 0; i < b->n_live; i++) {
        const step_res_t *r = &b->res[i];
        const hyp_t *h = &b->live[i];
        int keep = r->n_top < b->n_user_top ? r->n_top : b->n_user_top;
        if (grow((void **)&b->top_ids, &b->cap_top_ids, b->n_tops + keep, sizeof(int32_t)) ||
            grow((void **)&b->top_lps, &b->cap_top_lps, b->n_tops + keep, sizeof(float)))
            return CS_ENOMEM;
        int top = b->n_tops;
        if (keep > 0) {
            memcpy(b->top_ids + top, r->ids, sizeof(int32_t) * (size_t)keep);
            memcpy(b->top_lps + top, r->lps, sizeof(float) * (size_t)keep);
        }
        b->n_tops += keep;
        int m = r->n_top < 2 * b->width ? r->n_top : 2 * b->width;
        for (int j = 0; j < m; j++) {
            hyp_t c = {.node = h->node, .cum = h->cum + r->lps[j], .order = order++, .tok = r->ids[j],
                       .lp = r->lps[j], .top = top, .n_top = keep};
            if (!b->rq.ignore_eos && is_eos(b, c.tok)) {
                c.eos = true;
                if (grow((void **)&b->fin, &b->cap_fin, b->n_fin + 1, sizeof(hyp_t))) return CS_ENOMEM;
                b->fin[b->n_fin++] = c;
            } else {
                b->cand[nc++] = c;
            }
        }
    }
    if (nc > 1) qsort(b->cand, (size_t)nc, sizeof(hyp_t), cmp_cum);
    b->n_live = nc < b->width ? nc : b->width;
    for (int i = 0; i < b->n_live; i++) {
        const hyp_t *c = &b->cand[i];
        if (grow((void **)&b->nodes, &b->cap_nodes, b->n_nodes + 1, sizeof(bnode_t))) return CS_ENOMEM;
        int depth = c->node < 0 ? 1 : b->nodes[c->node].depth + 1;
        b->nodes[b->n_nodes] = (bnode_t){c->node, depth, c->tok, c->lp, c->top, c->n_top};
        b->live[i] = (hyp_t){.node = b->n_nodes++, .cum = c->cum, .order = i};
    }
    return CS_OK;
}

static int depth_of(const beam_t *b, const hyp_t *h) { return h->node < 0 ? 0 : b->nodes[h->node].depth; }

static int cmp_score(const void *pa, const void *pb) {
    const hyp_t *a = pa, *b = pb;
    if (a->score != b->score) return a->score > b->score ? -1 : 1;
    return a->order - b->order;
}

/* the finished beams, then the live ones, ranked by score (ties: that order) into b->fin */
static int rank_all(beam_t *b) {
    if (grow((void **)&b->fin, &b->cap_fin, b->n_fin + b->n_live, sizeof(hyp_t))) return CS_ENOMEM;
    if (b->n_live) memcpy(b->fin + b->n_fin, b->live, sizeof(hyp_t) * (size_t)b->n_live);
    b->n_fin += b->n_live;
    for (int i = 0; i < b->n_fin; i++) {
        hyp_t *h = &b->fin[i];
        h->order = i;
        h->score = h->cum / pow((double)(b->rq.n_prompt + depth_of(b, h)), b->rq.length_penalty);
    }
    if (b->n_fin > 1) qsort(b->fin, (size_t)b->n_fin, sizeof(hyp_t), cmp_score);
    return CS_OK;
}

static void emit(beam_t *b, engine_event_t *ev) {
    ev->request_id = b->id;
    ev->n_prompt_tokens = b->rq.n_prompt;
    ev->n_cached_tokens = b->n_cached;
    ev->adapter_version = b->adapter_version;
    ev->queue_ms = b->queue_ms;
    if (b->rq.sink) b->rq.sink(b->rq.user, ev);
}

/* sample i: beam h's tokens, one event each, the last one with its finish */
static void replay_one(beam_t *b, int i, const hyp_t *h, bool last) {
    int n = h ? depth_of(b, h) : 0;
    int32_t *nodes = malloc(sizeof(int32_t) * (size_t)(n ? n : 1));
    tokenizer_stream_t *ds = b->env.tokenizer ? tokenizer_stream_new(b->env.tokenizer, !b->rq.keep_special_text) : NULL;
    if (nodes)
        for (int k = h ? h->node : -1, d = n; k >= 0; k = b->nodes[k].parent) nodes[--d] = k;
    engine_finish fin = h && h->eos ? ENGINE_FINISH_STOP : ENGINE_FINISH_LENGTH;
    for (int j = 0; j < n && nodes; j++) {
        const bnode_t *nd = &b->nodes[nodes[j]];
        char *piece = NULL, *tail = NULL;
        size_t plen = 0, tlen = 0;
        if (ds && tokenizer_stream_push(ds, nd->tok, &piece, &plen)) plen = 0;
        if (ds && j == n - 1 && tokenizer_stream_flush(ds, &tail, &tlen)) tlen = 0;
        char *text = malloc(plen + tlen + 1);
        size_t tl = 0;
        if (text) {
            if (plen) memcpy(text, piece, plen);
            if (tlen) memcpy(text + plen, tail, tlen);
            tl = plen + tlen;
            text[tl] = 0;
        }
        engine_event_t ev = {.index = i, .has_token = true, .token = nd->tok, .logprob = nd->lp, .n_top = nd->n_top,
                             .top_ids = b->top_ids + nd->top, .top_logprobs = b->top_lps + nd->top,
                             .text = text ? text : "", .text_len = tl, .n_generated = j + 1};
        if (j == n - 1) {
            ev.finish = fin;
            ev.request_done = last;
        }
        emit(b, &ev);
        free(text);
        free(piece);
        free(tail);
    }
    if (n == 0 || !nodes) {
        engine_event_t ev = {.index = i, .text = "", .finish = fin, .request_done = last};
        emit(b, &ev);
    }
    free(nodes);
    tokenizer_stream_free(ds);
}

static void *beam_main(void *arg) {
    beam_t *b = arg;
    engine_finish fin = ENGINE_FINISH_NONE;
    b->live[0] = (hyp_t){.node = -1};
    b->n_live = 1;
    for (int step = 0; step < b->rq.max_tokens && b->n_live > 0; step++) {
        if (run_step(b, step, &fin)) break;
        int rc = expand(b);
        if (rc) {
            b->err = rc;
            fin = ENGINE_FINISH_ERROR;
            break;
        }
    }
    if (fin == ENGINE_FINISH_NONE && (b->err = rank_all(b))) fin = ENGINE_FINISH_ERROR;
    for (int i = 0; i < b->width; i++) {
        bool last = i == b->width - 1;
        if (fin != ENGINE_FINISH_NONE) {
            engine_event_t ev = {.index = i, .text = "", .finish = fin, .request_done = last};
            if (fin == ENGINE_FINISH_ERROR) {
                ev.error = b->err;
                ev.error_msg = b->err_msg ? b->err_msg : cs_strerror(b->err);
            }
            emit(b, &ev);
        } else {
            replay_one(b, i, i < b->n_fin ? &b->fin[i] : NULL, last);
        }
    }
    pthread_mutex_lock(&b->bs->mu);
    b->finished = true;
    pthread_mutex_unlock(&b->bs->mu);
    return NULL;
}

/* ---- the set ---- */
static void beam_free(beam_t *b) {
    free((void *)b->rq.prompt);
    free((void *)b->rq.adapter);
    free(b->err_msg);
    free(b->nodes);
    free(b->top_ids);
    free(b->top_lps);
    free(b->fin);
    free(b->cand);
    free(b->buf);
    pthread_mutex_destroy(&b->mu);
    pthread_cond_destroy(&b->cv);
    free(b);
}

beam_set_t *beam_set_new(void) {
    beam_set_t *bs = calloc(1, sizeof *bs);
    if (bs) pthread_mutex_init(&bs->mu, NULL);
    return bs;
}

/* under bs->mu: join and free the searches that are over */
static void reap(beam_set_t *bs, bool all) {
    for (beam_t **pp = &bs->head; *pp;) {
        beam_t *b = *pp;
        if (!all && !b->finished) {
            pp = &b->next;
            continue;
        }
        *pp = b->next;
        pthread_mutex_unlock(&bs->mu); /* the thread takes bs->mu as it ends */
        pthread_join(b->th, NULL);
        beam_free(b);
        pthread_mutex_lock(&bs->mu);
        pp = &bs->head; /* the list may have changed */
    }
}

void beam_set_free(beam_set_t *bs) {
    if (!bs) return;
    pthread_mutex_lock(&bs->mu);
    for (beam_t *b = bs->head; b; b = b->next) {
        pthread_mutex_lock(&b->mu);
        b->aborted = true;
        pthread_cond_signal(&b->cv);
        pthread_mutex_unlock(&b->mu);
    }
    reap(bs, true);
    pthread_mutex_unlock(&bs->mu);
    pthread_mutex_destroy(&bs->mu);
    free(bs);
}

int beam_start(beam_set_t *bs, engine_t *e, const beam_env_t *env, const engine_request_t *rq, uint64_t id) {
    beam_t *b = calloc(1, sizeof *b);
    if (!b) return cs_error_set(CS_ENOMEM, "out of memory");
    pthread_mutex_init(&b->mu, NULL);
    pthread_cond_init(&b->cv, NULL);
    b->bs = bs;
    b->e = e;
    b->env = *env;
    b->id = id;
    b->rq = *rq;
    b->rq.stop = NULL;
    b->rq.n_stop = 0;
    b->rq.stop_token_ids = NULL;
    b->rq.n_stop_token_ids = 0;
    b->rq.sampling.allowed_ids = b->rq.sampling.bias_ids = NULL;
    b->rq.sampling.bias = NULL;
    b->rq.sampling.n_allowed = b->rq.sampling.n_bias = 0;
    b->width = rq->n > 0 ? rq->n : 1;
    b->n_user_top = rq->sampling.logprobs > 0 ? rq->sampling.logprobs : 0;
    b->n_lp = 2 * b->width > b->n_user_top ? 2 * b->width : b->n_user_top;
    for (int i = 0; i < BEAM_MAX_WIDTH; i++) b->slots[i] = (slot_t){b, i};
    int32_t *prompt = malloc(sizeof(int32_t) * (size_t)rq->n_prompt);
    char *adapter = rq->adapter && rq->adapter[0] ? strdup(rq->adapter) : NULL;
    b->rq.prompt = prompt;
    b->rq.adapter = adapter;
    if (!prompt || (rq->adapter && rq->adapter[0] && !adapter)) {
        beam_free(b);
        return cs_error_set(CS_ENOMEM, "out of memory");
    }
    memcpy(prompt, rq->prompt, sizeof(int32_t) * (size_t)rq->n_prompt);
    pthread_mutex_lock(&bs->mu);
    reap(bs, false);
    if (pthread_create(&b->th, NULL, beam_main, b)) {
        pthread_mutex_unlock(&bs->mu);
        beam_free(b);
        return cs_error_set(CS_ENOMEM, "cannot start a beam search thread");
    }
    b->next = bs->head;
    bs->head = b;
    pthread_mutex_unlock(&bs->mu);
    return CS_OK;
}

bool beam_abort(beam_set_t *bs, uint64_t id) {
    bool found = false;
    pthread_mutex_lock(&bs->mu);
    for (beam_t *b = bs->head; b; b = b->next)
        if (b->id == id) {
            pthread_mutex_lock(&b->mu);
            b->aborted = true;
            pthread_cond_signal(&b->cv);
            pthread_mutex_unlock(&b->mu);
            found = !b->finished;
            break;
        }
    pthread_mutex_unlock(&bs->mu);
    return found;
}
