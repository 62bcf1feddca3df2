/* route.c: see route.h. */
#include "sched/route.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

int route_policy_parse(const char *s) {
    if (!s) return -1;
    if (!strcmp(s, "rank-aware")) return ROUTE_RANK_AWARE;
    if (!strcmp(s, "round-robin")) return ROUTE_ROUND_ROBIN;
    if (!strcmp(s, "least-loaded")) return ROUTE_LEAST_LOADED;
    return -1;
}

const char *route_policy_name(route_policy p) {
    switch (p) {
    case ROUTE_RANK_AWARE: return "rank-aware";
    case ROUTE_ROUND_ROBIN: return "round-robin";
    case ROUTE_LEAST_LOADED: return "least-loaded";
    }
    return "?";
}

static bool same_adapter(const char *a, const char *b) {
    if (!a || !b) return a == b;
    return !strcmp(a, b);
}

/* An iteration being composed: rows and the distinct adapters among them. */
typedef struct comp {
    sched_step_t st;
    const char **names;         /* distinct adapters so far */
    int n_names, cap;
} comp_t;

static void comp_add(comp_t *c, const char *adapter, int rank, int rows, bool prefill) {
    if (rows <= 0) return;
    if (rank < 0) rank = 0;
    c->st.n_seqs++;
    if (prefill) c->st.prefill_tokens += rows;
    else c->st.decode_rows += rows;
    c->st.row_rank_sum += (long)rank * rows;
    if (!adapter) return;
    for (int i = 0; i < c->n_names; i++)
        if (same_adapter(c->names[i], adapter)) return;
    if (c->n_names < c->cap) c->names[c->n_names++] = adapter;
    c->st.n_adapters++;
    c->st.rank_sum += rank;
    if (rank > c->st.max_rank) c->st.max_rank = rank;
}

static double predict(const double coef[COST_N_TERMS], const sched_step_t *st) {
    if (st->n_seqs == 0) return 0; /* no iteration at all */
    double x[COST_N_TERMS], t = 0;
    cost_terms(st, x);
    for (int i = 0; i < COST_N_TERMS; i++) t += coef[i] * x[i];
    return t;
}

void route_evaluate(const route_replica_t *r, const route_req_t *q, double tpot_factor, route_eval_t *out) {
    if (tpot_factor <= 0) tpot_factor = 1.5;
    int cap = r->n_seqs + 1;
    const char **names = malloc(sizeof *names * (size_t)cap);
    comp_t pre = {.names = names, .cap = names ? cap : 0};
    /* the queue's prefill: what waits, and the rest of running sequences' chunked prompts */
    for (int i = 0; i < r->n_seqs; i++) {
        const route_seq_t *s = &r->seqs[i];
        comp_add(&pre, s->adapter, s->rank, s->prefill_left, true);
    }
    out->pre_queue = predict(r->coef, &pre.st);
    comp_add(&pre, q->adapter, q->rank, q->prompt_tokens > 0 ? q->prompt_tokens : 1, true);
    out->pre_with = predict(r->coef, &pre.st);

    /* one decode iteration of the running set, then with the request's rows in it */
    comp_t dec = {.names = names, .cap = names ? cap : 0};
    comp_t base = {0}; /* the same rows on the base model alone: the default TPOT bound */
    for (int i = 0; i < r->n_seqs; i++) {
        const route_seq_t *s = &r->seqs[i];
        if (!s->running) continue;
        comp_add(&dec, s->adapter, s->rank, 1, false);
        comp_add(&base, NULL, 0, 1, false);
    }
    out->dec_running = predict(r->coef, &dec.st);
    int rows = q->n > 0 ? q->n : 1;
    comp_add(&dec, q->adapter, q->rank, rows, false);
    comp_add(&base, NULL, 0, rows, false);
    out->dec_with = predict(r->coef, &dec.st);
    free(names);

    out->tpot_slo = q->slo_tpot_ms > 0 ? q->slo_tpot_ms : tpot_factor * predict(r->coef, &base.st);
    int expect = q->expected_output > 0 ? q->expected_output : 1;
    out->cost = (out->pre_with - out->pre_queue) / expect + (out->dec_with - out->dec_running);
    if (out->dec_with > out->tpot_slo) out->cost = INFINITY;
    out->score = out->cost * r->n_requests;
}

/* what a request would wait for there when every replica breaks the SLO: the queue's
 * prefill with its own, then its expected output at the decode iteration's pace */
static double finish_ms(const route_eval_t *e, const route_req_t *q) {
    return e->pre_with + (q->expected_output > 0 ? q->expected_output : 1) * e->dec_with;
}

/* the first eligible replica at or after *rr that minimises key(); ties go in turn */
int route_pick(route_policy p, const route_replica_t *r, int n, const route_req_t *q, double tpot_factor,
               unsigned *rr) {
    int best = -1;
    double b_score = 0, b_cost = 0, b_fin = 0;
    int b_load = 0, b_req = 0;
    bool any_finite = false, any_open = false;
    if (n <= 0) return -1;
    for (int i = 0; i < n; i++) any_open |= r[i].healthy && !r[i].paused;
    bool *ok = calloc((size_t)n, sizeof *ok);
    if (!ok) return -1;
    for (int i = 0; i < n; i++) ok[i] = r[i].healthy && (!r[i].paused || !any_open);
    route_eval_t *ev = p == ROUTE_RANK_AWARE ? calloc((size_t)n, sizeof *ev) : NULL;
    if (p == ROUTE_RANK_AWARE && ev) {
        for (int i = 0; i < n; i++) {
            if (!ok[i]) continue;
            if (r[i].fitted) route_evaluate(&r[i], q, tpot_factor, &ev[i]);
            else ev[i] = (route_eval_t){.cost = 0, .score = 0}; /* load alone decides */
            if (isfinite(ev[i].cost)) any_finite = true;
        }
    }
    for (int k = 0; k < n; k++) {
        int i = (int)((*rr + (unsigned)k) % (unsigned)n);
        if (!ok[i]) continue;
        if (best < 0) {
            best = i;
            if (ev) b_score = ev[i].score, b_cost = ev[i].cost, b_fin = finish_ms(&ev[i], q);
            b_load = r[i].in_flight;
            b_req = r[i].n_requests;
            if (p == ROUTE_ROUND_ROBIN) break;
            continue;
        }
        bool better = false;
        if (p == ROUTE_LEAST_LOADED || !ev) {
            better = r[i].in_flight < b_load;
        } else if (any_finite) {
            const route_eval_t *e = &ev[i];
            if (!isfinite(e->cost)) better = false;
            else if (!isfinite(b_cost)) better = true;
            else if (e->score != b_score) better = e->score < b_score;
            else if (e->cost != b_cost) better = e->cost < b_cost;
            else better = r[i].in_flight < b_load;
        } else { /* every replica breaks the SLO: where it would finish first */
            double fin = finish_ms(&ev[i], q);
            if (fin != b_fin) better = fin < b_fin;
            else if (r[i].n_requests != b_req) better = r[i].n_requests < b_req;
            else better = r[i].in_flight < b_load;
        }
        if (better) {
            best = i;
            if (ev) b_score = ev[i].score, b_cost = ev[i].cost, b_fin = finish_ms(&ev[i], q);
            b_load = r[i].in_flight;
            b_req = r[i].n_requests;
        }
    }
    free(ev);
    free(ok);
    if (best >= 0) *rr = (unsigned)(best + 1) % (unsigned)n;
    return best;
}
