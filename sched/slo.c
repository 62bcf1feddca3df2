/* slo.c: the rank-aware SLO policy (slo.h). The engine asks, in order, order_running, chunk
 * for each running sequence, order_waiting, chunk for each waiting one it can hold (and
 * pass_blocked when it could not hold one after all); the policy keeps the composition of
 * the iteration being formed and prices every addition with the cost model. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sched/cost.h"
#include "sched/slo.h"

#define MAX_ADAPTERS 256 /* distinct adapters tracked in one iteration (beyond: priced as new) */
#define REFIT_EVERY 32
#define DRIFT_ALPHA (1.0 / 16) /* the drift follows about the last 16 steps */
#define DRIFT_MIN 0.5
#define DRIFT_MAX 4.0

typedef struct slo {
    sched_t s;              /* first: a sched_t * is a slo_t * */
    sched_slo_params_t p;
    long steps;
    double now;
    bool fitted;            /* the cost model had a fit when this iteration began */
    double drift;           /* measured / predicted over the last steps (1: none) */
    cost_fit_t fit;         /* ... that fit */
    /* the iteration being formed */
    sched_step_t cur;
    const char *names[MAX_ADAPTERS];
    int n_names;
    double min_explicit;    /* the tightest explicit TPOT SLO among its decode rows (INFINITY) */
    bool has_default;       /* a decode row without one: the default SLO applies */
    /* the last waiting sequence added, undone by pass_blocked */
    sched_step_t undo_cur;
    int undo_names;
    double undo_min;
    bool undo_default;
} slo_t;

static double now_ms(const slo_t *q) { return q->p.now_ms ? q->p.now_ms(q->p.user) : cs_time_ms(); }

/* the cost model's prediction, scaled by the drift of the last steps: the model follows the
 * machine over thousands of steps, the drift over a few dozen (a neighbour's burst on a
 * shared host, a frequency change) */
static double predict(const slo_t *q, const sched_step_t *st) { return q->drift * cost_model_predict(q->p.cost, st); }

/* the base model alone with DECODE rows: what the default TPOT SLO is a factor of */
static double base_ms(const slo_t *q, int decode) {
    sched_step_t st = {.decode_rows = CS_MAX(decode, 1), .n_seqs = CS_MAX(decode, 1)};
    return predict(q, &st);
}

/* the TPOT bound of an iteration with this composition (INFINITY: no decode row) */
static double bound(const slo_t *q, const sched_step_t *st, double min_explicit, bool has_default) {
    double b = min_explicit;
    if (has_default) b = CS_MIN(b, q->p.headroom * q->p.tpot_factor * base_ms(q, st->decode_rows));
    return b;
}

static bool in_batch(const slo_t *q, const char *adapter) {
    for (int i = 0; i < q->n_names; i++)
        if (!strcmp(q->names[i], adapter)) return true;
    return false;
}

/* cur with C more rows of V (decode: C == 1) */
static sched_step_t with(const slo_t *q, const sched_view_t *v, int c, bool decode) {
    sched_step_t st = q->cur;
    st.n_seqs++;
    if (decode) st.decode_rows++;
    else st.prefill_tokens += c;
    if (v->adapter) {
        int rank = v->lora_known ? v->lora.max_rank : 0;
        if (!in_batch(q, v->adapter)) {
            st.n_adapters++;
            st.rank_sum += rank;
        }
        st.max_rank = CS_MAX(st.max_rank, rank);
        st.row_rank_sum += (long)c * rank;
    }
    return st;
}

/* How long this iteration may take for V's TPOT SLO of its own to hold. TPOT is the mean
 * time between a request's tokens after its first, so what matters is the budget: its next
 * token is due SLO × n_generated after its first one; time it has banked (iterations faster
 * than its SLO) may go to a longer iteration (a prefill chunk). Never less than the SLO
 * itself: a request already behind is not saved by holding everyone else back. The policy
 * plans to headroom × the SLO: what the prediction misses by comes out of the rest. */
static double row_bound(const slo_t *q, const sched_view_t *v) {
    double slo = q->p.headroom * v->slo_tpot_ms, b = slo;
    if (v->t_first_ms > 0 && v->n_generated > 0) b = CS_MAX(b, slo * v->n_generated - (q->now - v->t_first_ms));
    return b;
}

static void add(slo_t *q, const sched_view_t *v, int c, bool decode) {
    q->cur = with(q, v, c, decode);
    if (v->adapter && !in_batch(q, v->adapter) && q->n_names < MAX_ADAPTERS) q->names[q->n_names++] = v->adapter;
    if (decode) {
        if (v->slo_tpot_ms > 0) q->min_explicit = CS_MIN(q->min_explicit, row_bound(q, v));
        else q->has_default = true;
    }
}

static bool is_decode(const sched_view_t *v) { return v->n_generated > 0 && v->n_tokens - v->n_computed == 1; }

/* does the iteration still meet its TPOT bound with C rows of V added? V's own SLO joins
 * the bound once it decodes; a prefill row does not decode this iteration */
static bool fits(const slo_t *q, const sched_view_t *v, int c, bool decode) {
    sched_step_t st = with(q, v, c, decode);
    double me = q->min_explicit;
    bool hd = q->has_default;
    if (decode) {
        if (v->slo_tpot_ms > 0) me = CS_MIN(me, row_bound(q, v));
        else hd = true;
    }
    double b = bound(q, &st, me, hd);
    return !isfinite(b) || predict(q, &st) <= b;
}

/* the largest prefill chunk in [lo, max] that fits (binary search: the cost grows with it);
 * 0 when not even lo does */
static int largest_fit(const slo_t *q, const sched_view_t *v, int lo, int max) {
    if (fits(q, v, max, false)) return max;
    if (!fits(q, v, lo, false)) return 0;
    int good = lo, bad = max;
    while (bad - good > 1) {
        int mid = good + (bad - good) / 2;
        if (fits(q, v, mid, false)) good = mid;
        else bad = mid;
    }
    return good;
}

static double deadline(const slo_t *q, const sched_view_t *v) {
    return v->t_submit_ms + (v->slo_ttft_ms > 0 ? v->slo_ttft_ms : q->p.default_ttft_ms);
}

static bool starving(const slo_t *q, const sched_view_t *v) { return q->now - deadline(q, v) > q->p.starve_ms; }

/* the predicted time of V's remaining prompt alone (fixed and prefill terms) */
static double prefill_ms(const slo_t *q, const sched_view_t *v) {
    return q->drift * (q->fit.coef[0] + q->fit.coef[1] * (v->n_tokens - v->n_computed));
}

/* a request with a TTFT SLO of its own that would miss it by waiting one more iteration: the
 * predicted time of this one and of its own prefill is all the slack it has left */
static bool urgent(const slo_t *q, const sched_view_t *v) {
    if (v->slo_ttft_ms <= 0) return false;
    return deadline(q, v) - q->now <= predict(q, &q->cur) + 2 * prefill_ms(q, v);
}

/* ---- the vtable ---- */
static void order_running(sched_t *s, const sched_view_t *v, int n, int *perm) {
    slo_t *q = (slo_t *)s;
    /* a new iteration */
    memset(&q->cur, 0, sizeof q->cur);
    q->n_names = 0;
    q->min_explicit = INFINITY;
    q->has_default = false;
    q->now = now_ms(q);
    cost_model_get(q->p.cost, &q->fit);
    q->fitted = q->fit.fitted;
    /* decode rows first (they are owed a token each), then prefill chunks; in admission
     * order within each */
    int k = 0;
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < n; i++)
            if (is_decode(&v[i]) == (pass == 0)) perm[k++] = i;
    for (int i = 1; i < n; i++) /* admission order within each group (insertion sort, stable) */
        for (int j = i; j > 0 && is_decode(&v[perm[j]]) == is_decode(&v[perm[j - 1]]) &&
                        v[perm[j]].admit_order < v[perm[j - 1]].admit_order; j--) {
            int t = perm[j]; perm[j] = perm[j - 1]; perm[j - 1] = t;
        }
}

static const sched_view_t *sort_v;
static const slo_t *sort_q;

static double slack_key(const slo_t *q, const sched_view_t *v) {
    if (v->admitted_once) return -INFINITY; /* preempted: it held a place already */
    return deadline(q, v) - q->now - prefill_ms(q, v);
}

static int by_slack(const void *a, const void *b) {
    int i = *(const int *)a, j = *(const int *)b;
    double ki = slack_key(sort_q, &sort_v[i]), kj = slack_key(sort_q, &sort_v[j]);
    if (ki != kj) return ki < kj ? -1 : 1;
    return (i > j) - (i < j); /* queue order among equals */
}

static void order_waiting(sched_t *s, const sched_view_t *v, int n, int *perm) {
    slo_t *q = (slo_t *)s;
    for (int i = 0; i < n; i++) perm[i] = i;
    if (!q->fitted) return; /* fcfs until the cost model can price anything */
    if (n < 2) return;      /* nothing to order (and perm may be NULL: qsort must not see it) */
    sort_v = v; /* engine thread only: qsort has no context argument */
    sort_q = q;
    qsort(perm, (size_t)n, sizeof *perm, by_slack);
}

static int chunk(sched_t *s, const sched_view_t *v, int max) {
    slo_t *q = (slo_t *)s;
    bool decode = v->running && is_decode(v);
    int c = max;
    if (q->fitted && !decode && !(!v->running && (starving(q, v) || urgent(q, v)))) {
        int lo = CS_MIN(q->p.min_chunk, max);
        c = largest_fit(q, v, lo, max);
        if (c == 0 && v->running) c = lo; /* a running prefill always moves on */
    }
    if (c > 0) {
        if (!v->running) { /* pass_blocked may take it back */
            q->undo_cur = q->cur;
            q->undo_names = q->n_names;
            q->undo_min = q->min_explicit;
            q->undo_default = q->has_default;
        }
        add(q, v, decode ? 1 : c, decode);
    }
    return c;
}

static bool pass_blocked(sched_t *s, const sched_view_t *v) {
    slo_t *q = (slo_t *)s;
    q->cur = q->undo_cur; /* it was not admitted after all */
    q->n_names = q->undo_names;
    q->min_explicit = q->undo_min;
    q->has_default = q->undo_default;
    return !(q->fitted && starving(q, v)); /* behind a starving one, nobody passes */
}

static int victim(sched_t *s, const sched_view_t *v, int n) {
    (void)s;
    int best = 0;
    for (int i = 1; i < n; i++) {
        bool si = v[i].slo_tpot_ms > 0 || v[i].slo_ttft_ms > 0, sb = v[best].slo_tpot_ms > 0 || v[best].slo_ttft_ms > 0;
        if (si != sb) {
            if (!si) best = i; /* no SLO of its own: the most slack */
            continue;
        }
        if (v[i].admit_order > v[best].admit_order) best = i;
    }
    return best;
}

static void feedback(sched_t *s, const sched_step_t *st) {
    slo_t *q = (slo_t *)s;
    double model = cost_model_predict(q->p.cost, st);
    if (model > 0 && st->forward_ms > 0) {
        double r = CS_MIN(CS_MAX(st->forward_ms / model, DRIFT_MIN), DRIFT_MAX);
        q->drift += DRIFT_ALPHA * (r - q->drift);
    }
    cost_model_observe(q->p.cost, st);
    if (++q->steps % REFIT_EVERY == 0) cost_model_fit(q->p.cost);
}

static void slo_free(sched_t *s) { free(s); }

static const struct sched_i slo_iface = {
    .name = "slo",
    .order_running = order_running,
    .order_waiting = order_waiting,
    .chunk = chunk,
    .pass_blocked = pass_blocked,
    .victim = victim,
    .feedback = feedback,
    .free = slo_free,
};

sched_t *sched_slo_new(const sched_slo_params_t *p) {
    if (!p || !p->cost) {
        cs_error_set(CS_EINVAL, "the slo policy needs a cost model");
        return NULL;
    }
    slo_t *q = calloc(1, sizeof *q);
    if (!q) {
        cs_error_set(CS_ENOMEM, "out of memory");
        return NULL;
    }
    q->s.iface = &slo_iface;
    q->p = *p;
    if (q->p.tpot_factor <= 0) q->p.tpot_factor = 1.5;
    if (q->p.default_ttft_ms <= 0) q->p.default_ttft_ms = 10000;
    if (q->p.starve_ms <= 0) q->p.starve_ms = 2000;
    if (q->p.min_chunk <= 0) q->p.min_chunk = 16;
    if (!(q->p.headroom > 0 && q->p.headroom <= 1)) q->p.headroom = 0.9;
    q->drift = 1;
    q->min_explicit = INFINITY;
    return &q->s;
}

int sched_parse_slo(json_t *v, double *ttft_ms, double *tpot_ms) {
    *ttft_ms = *tpot_ms = 0;
    if (!v || json_is_null(v)) return CS_OK;
    if (!json_is_object(v)) return cs_error_set(CS_EINVAL, "'slo' must be an object {\"ttft_ms\": X, \"tpot_ms\": Y}");
    const char *k;
    json_t *x;
    json_object_foreach(v, k, x) {
        double *out = !strcmp(k, "ttft_ms") ? ttft_ms : !strcmp(k, "tpot_ms") ? tpot_ms : NULL;
        if (!out) return cs_error_set(CS_EINVAL, "slo.%s: unknown (slo has ttft_ms and tpot_ms)", k);
        if (json_is_null(x)) continue;
        if (!json_is_number(x) || !(json_number_value(x) > 0) || !isfinite(json_number_value(x)))
            return cs_error_set(CS_EINVAL, "slo.%s must be a number of milliseconds > 0", k);
        *out = json_number_value(x);
    }
    return CS_OK;
}

/* ---- per-model SLOs (serve --adapter-slos FILE) ---- */
/* each bound: > 0 the value, 0 not given (the next level decides), < 0 null (none, and "*"
 * does not fill it in) */
typedef struct slo_entry {
    char *name;
    double ttft_ms, tpot_ms;
} slo_entry_t;

struct sched_slo_table {
    slo_entry_t *e;         /* sorted by name */
    int n;
    bool has_star;
    slo_entry_t star;       /* "*" (its nulls count as not given) */
};

static int entry_cmp(const void *a, const void *b) {
    return strcmp(((const slo_entry_t *)a)->name, ((const slo_entry_t *)b)->name);
}

void sched_slo_table_free(sched_slo_table_t *t) {
    if (!t) return;
    for (int i = 0; i < t->n; i++) free(t->e[i].name);
    free(t->e);
    free(t);
}

/* one entry: sched_parse_slo's rules, then a key given as null (or the whole entry null) is
 * "none" rather than "not given" */
static int parse_entry(const char *name, json_t *v, slo_entry_t *out) {
    if (sched_parse_slo(v, &out->ttft_ms, &out->tpot_ms)) return cs_error_set(CS_EINVAL, "\"%s\": %s", name, cs_error_last());
    if (json_is_null(v) || json_is_null(json_object_get(v, "ttft_ms"))) out->ttft_ms = -1;
    if (json_is_null(v) || json_is_null(json_object_get(v, "tpot_ms"))) out->tpot_ms = -1;
    return CS_OK;
}

int sched_slo_table_parse(json_t *root, sched_slo_table_t **out) {
    *out = NULL;
    if (!json_is_object(root))
        return cs_error_set(CS_EINVAL, "must be a JSON object {\"NAME\": {\"ttft_ms\": X, \"tpot_ms\": Y}, ..., \"*\": {...}}");
    sched_slo_table_t *t = calloc(1, sizeof *t);
    size_t cap = json_object_size(root);
    if (!t || !(t->e = calloc(cap ? cap : 1, sizeof *t->e))) {
        free(t);
        return cs_error_set(CS_ENOMEM, "out of memory");
    }
    const char *k;
    json_t *v;
    int rc = CS_OK;
    json_object_foreach(root, k, v) {
        slo_entry_t en = {0};
        if ((rc = parse_entry(k, v, &en))) goto fail;
        if (!strcmp(k, "*")) {
            t->has_star = true;
            t->star = en;
            continue;
        }
        if (!*k) {
            rc = cs_error_set(CS_EINVAL, "\"\": an empty name (name an adapter, the base model, or \"*\")");
            goto fail;
        }
        if (!(en.name = strdup(k))) {
            rc = cs_error_set(CS_ENOMEM, "out of memory");
            goto fail;
        }
        t->e[t->n++] = en;
    }
    qsort(t->e, (size_t)t->n, sizeof *t->e, entry_cmp);
    *out = t;
    return CS_OK;
fail:
    sched_slo_table_free(t);
    return rc;
}

int sched_slo_table_load(const char *path, sched_slo_table_t **out) {
    json_error_t je;
    *out = NULL;
    /* a duplicate name is a mistake in the file, not a second thought: refused */
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        if (je.line > 0) return cs_error_set(CS_EFORMAT, "not valid JSON: %s (line %d, column %d)", je.text, je.line, je.column);
        return cs_error_set(CS_EIO, "%s", je.text);
    }
    int rc = sched_slo_table_parse(root, out);
    json_decref(root);
    return rc;
}

static double pick(double own, double entry, double star) {
    if (own > 0) return own;
    if (entry > 0) return entry;
    if (entry < 0) return 0;
    return star > 0 ? star : 0;
}

void sched_slo_table_apply(const sched_slo_table_t *t, const char *name, double *ttft_ms, double *tpot_ms) {
    if (!t) return;
    slo_entry_t key = {.name = (char *)name}, none = {0};
    const slo_entry_t *en = name && t->n ? bsearch(&key, t->e, (size_t)t->n, sizeof *t->e, entry_cmp) : NULL;
    if (!en) en = &none;
    const slo_entry_t *star = t->has_star ? &t->star : &none;
    *ttft_ms = pick(*ttft_ms, en->ttft_ms, star->ttft_ms);
    *tpot_ms = pick(*tpot_ms, en->tpot_ms, star->tpot_ms);
}
