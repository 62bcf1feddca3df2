/* api_stats.c: every adapter's statistics, and the bounded `adapter` label of /metrics.
 *
 * A server with thousands of adapters cannot give each its own series: a scrape would grow
 * with every adapter ever used. So each adapter's counts are kept here, exactly, for GET
 * /v1/adapters/{name}/stats, and in /metrics only the base model and the --metrics-max-adapters
 * adapters most requested over the last five minutes have series of their own; the rest
 * are summed under adapter="_other". A scrape first chooses that set again: an adapter that
 * leaves it has its series folded into "_other" (metric_fold: the totals never change, and
 * "_other" only grows), one that enters it starts series of its own from then on. Until the
 * set is full an adapter gets its own series at its first request. Every update of a series
 * with an adapter label goes through here, under one lock, so the set never changes between
 * choosing a label and using it. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "server/api_internal.h"

#define WINDOW_SLOTS 5          /* the window: five slots of a minute */
#define SLOT_SECONDS 60
#define MAX_REASONS 6           /* finish reasons counted per adapter (the rest: "other") */
#define OTHER "_other"

typedef struct astat {
    struct astat *hnext;
    char *name;
    bool own;                   /* has series of its own in /metrics */
    bool base;                  /* the base model: always its own series */
    uint64_t requests, prompt_tokens, gen_tokens;
    struct { char name[16]; uint64_t n; } fin[MAX_REASONS];
    double ttft_sum, itl_sum, e2e_sum, queue_sum;
    uint64_t ttft_n, itl_n;
    uint64_t slo_requests, slo_met;
    uint64_t loads, transfers;
    double load_sum, transfer_sum;
    double first_s, last_s;     /* wall-clock seconds of the first and the last request */
    uint32_t win[WINDOW_SLOTS]; /* requests finished in each slot's minute */
    int64_t win_min[WINDOW_SLOTS];
} astat_t;

struct adapter_stats {
    pthread_mutex_t mu;
    astat_t **table;
    size_t cap, n;
    int max_own, n_own;         /* adapters (not the base) with series of their own */
    uint64_t folds;             /* adapters whose series were folded into "_other" */
};


int astats_init(server_t *s) {
    adapter_stats_t *st = calloc(1, sizeof *st);
    if (!st || !(st->table = calloc(64, sizeof *st->table))) {
        free(st);
        return cs_error_set(CS_ENOMEM, "out of memory");
    }
    st->cap = 64;
    st->max_own = s->cfg.metrics_max_adapters;
    pthread_mutex_init(&st->mu, NULL);
    s->astats = st;
    return CS_OK;
}

void astats_free(server_t *s) {
    adapter_stats_t *st = s->astats;
    if (!st) return;
    for (size_t i = 0; i < st->cap; i++)
        for (astat_t *a = st->table[i], *nx; a; a = nx) {
            nx = a->hnext;
            free(a->name);
            free(a);
        }
    free(st->table);
    pthread_mutex_destroy(&st->mu);
    free(st);
    s->astats = NULL;
}

static astat_t *lookup(adapter_stats_t *st, const char *name) {
    for (astat_t *a = st->table[cs_hash_str(name) & (st->cap - 1)]; a; a = a->hnext)
        if (!strcmp(a->name, name)) return a;
    return NULL;
}

/* NAME's entry, made at its first use (NULL: out of memory); under st->mu */
static astat_t *get(server_t *s, const char *name) {
    adapter_stats_t *st = s->astats;
    astat_t *a = lookup(st, name);
    if (a) return a;
    if (st->n + 1 > st->cap / 2) {
        size_t cap = st->cap * 2;
        astat_t **t = calloc(cap, sizeof *t);
        if (!t) return NULL;
        for (size_t i = 0; i < st->cap; i++)
            for (astat_t *x = st->table[i], *nx; x; x = nx) {
                nx = x->hnext;
                size_t k = cs_hash_str(x->name) & (cap - 1);
                x->hnext = t[k];
                t[k] = x;
            }
        free(st->table);
        st->table = t;
        st->cap = cap;
    }
    if (!(a = calloc(1, sizeof *a)) || !(a->name = strdup(name))) {
        free(a);
        return NULL;
    }
    a->base = !strcmp(name, s->model_name);
    a->own = a->base;
    a->first_s = (double)time(NULL);
    size_t k = cs_hash_str(name) & (st->cap - 1);
    a->hnext = st->table[k];
    st->table[k] = a;
    st->n++;
    return a;
}

/* the label A's series go under; an adapter takes a free place in the set at once */
static const char *label(adapter_stats_t *st, astat_t *a) {
    if (!a) return OTHER;
    if (!a->own && st->n_own < st->max_own) {
        a->own = true;
        st->n_own++;
    }
    return a->own ? a->name : OTHER;
}

static uint32_t window_count(const astat_t *a, int64_t now_min) {
    uint32_t n = 0;
    for (int i = 0; i < WINDOW_SLOTS; i++)
        if (a->win_min[i] > now_min - WINDOW_SLOTS) n += a->win[i];
    return n;
}

void astats_token(server_t *s, const char *name, double ttft_s, double itl_s) {
    adapter_stats_t *st = s->astats;
    server_metrics_t *m = &s->m;
    pthread_mutex_lock(&st->mu);
    astat_t *a = get(s, name);
    const char *lab[] = {label(st, a)};
    if (ttft_s >= 0) {
        metric_observe(m->a_ttft, lab, ttft_s);
        if (a) a->ttft_sum += ttft_s, a->ttft_n++;
    }
    if (itl_s >= 0) {
        metric_observe(m->a_itl, lab, itl_s);
        if (a) a->itl_sum += itl_s, a->itl_n++;
    }
    metric_inc(m->gen_tokens, lab, 1);
    if (a) a->gen_tokens++;
    pthread_mutex_unlock(&st->mu);
    if (ttft_s >= 0) metric_observe(m->ttft, NULL, ttft_s);
    if (itl_s >= 0) metric_observe(m->itl, NULL, itl_s);
}

void astats_done(server_t *s, const char *name, int n_prompt, const char *finish, double e2e_s, double queue_s) {
    adapter_stats_t *st = s->astats;
    server_metrics_t *m = &s->m;
    time_t now = time(NULL);
    pthread_mutex_lock(&st->mu);
    astat_t *a = get(s, name);
    const char *lab[] = {label(st, a)}, *rl[] = {lab[0], finish};
    metric_observe(m->a_e2e, lab, e2e_s);
    metric_inc(m->prompt_tokens, lab, n_prompt);
    metric_inc(m->success, rl, 1);
    if (a) {
        a->requests++;
        a->prompt_tokens += (uint64_t)n_prompt;
        a->e2e_sum += e2e_s;
        a->queue_sum += queue_s;
        int i = 0;
        while (i < MAX_REASONS - 1 && a->fin[i].name[0] && strcmp(a->fin[i].name, finish)) i++;
        if (!a->fin[i].name[0]) snprintf(a->fin[i].name, sizeof a->fin[i].name, "%s", finish);
        else if (strcmp(a->fin[i].name, finish)) snprintf(a->fin[i].name, sizeof a->fin[i].name, "other");
        a->fin[i].n++;
        int64_t min = (int64_t)now / SLOT_SECONDS;
        int k = (int)(min % WINDOW_SLOTS);
        if (a->win_min[k] != min) a->win_min[k] = min, a->win[k] = 0;
        a->win[k]++;
        a->last_s = (double)now;
    }
    pthread_mutex_unlock(&st->mu);
    metric_observe(m->e2e, NULL, e2e_s);
    metric_observe(m->queue, NULL, queue_s);
}

void astats_slo(server_t *s, const char *name, const char *adapter, bool met) {
    char rank[16] = "0";
    lora_adapter_info_t info;
    if (adapter && s->reg && lora_registry_info(s->reg, adapter, 0, &info) == CS_OK)
        snprintf(rank, sizeof rank, "%d", info.max_rank);
    adapter_stats_t *st = s->astats;
    pthread_mutex_lock(&st->mu);
    astat_t *a = get(s, name);
    const char *lab[] = {label(st, a), rank};
    metric_inc(s->m.slo_requests, lab, 1);
    if (met) metric_inc(s->m.slo_met, lab, 1);
    if (a) a->slo_requests++, a->slo_met += met;
    pthread_mutex_unlock(&st->mu);
}

void astats_load(server_t *s, const char *name, double seconds, bool transfer) {
    adapter_stats_t *st = s->astats;
    pthread_mutex_lock(&st->mu);
    astat_t *a = get(s, name);
    if (a && transfer) a->transfers++, a->transfer_sum += seconds;
    else if (a) a->loads++, a->load_sum += seconds;
    pthread_mutex_unlock(&st->mu);
    metric_observe(transfer ? s->m.lora_transfer : s->m.lora_load, NULL, seconds);
}

/* the families with an adapter label */
static void fold(server_t *s, const char *name) {
    server_metrics_t *m = &s->m;
    metric_t *fams[] = {m->a_ttft, m->a_itl, m->a_e2e, m->prompt_tokens, m->gen_tokens, m->success,
                        m->slo_requests, m->slo_met};
    for (size_t i = 0; i < sizeof fams / sizeof fams[0]; i++) metric_fold(fams[i], "adapter", name, OTHER);
}

typedef struct { astat_t *a; uint32_t recent; } ranked_t;

static int by_recent(const void *x, const void *y) {
    const ranked_t *a = x, *b = y;
    if (a->recent != b->recent) return a->recent > b->recent ? -1 : 1;
    if (a->a->own != b->a->own) return a->a->own ? -1 : 1; /* a tie keeps the set as it is */
    return strcmp(a->a->name, b->a->name);
}

void astats_rebalance(server_t *s) {
    adapter_stats_t *st = s->astats;
    int64_t now_min = (int64_t)time(NULL) / SLOT_SECONDS;
    pthread_mutex_lock(&st->mu);
    ranked_t *r = malloc((st->n ? st->n : 1) * sizeof *r);
    size_t n = 0;
    for (size_t i = 0; r && i < st->cap; i++)
        for (astat_t *a = st->table[i]; a; a = a->hnext)
            if (!a->base) r[n++] = (ranked_t){a, window_count(a, now_min)};
    if (r) {
        qsort(r, n, sizeof *r, by_recent);
        /* the first max_own keep or take a place: one outside gets in only with more
         * requests in the window than one inside (the tie-break keeps the set) */
        for (size_t i = (size_t)(st->max_own > 0 ? st->max_own : 0); i < n; i++)
            if (r[i].a->own) {
                fold(s, r[i].a->name);
                r[i].a->own = false;
                st->n_own--;
                st->folds++;
            }
        for (size_t i = 0; i < n && (int)i < st->max_own; i++)
            if (!r[i].a->own && r[i].recent > 0) {
                r[i].a->own = true;
                st->n_own++;
            }
    }
    free(r);
    double own = st->n_own, other = (double)n - own;
    uint64_t folds = st->folds;
    pthread_mutex_unlock(&st->mu);
    metric_set(s->m.adapter_series, (const char *[]){"own"}, own);
    metric_set(s->m.adapter_series, (const char *[]){"other"}, other);
    pthread_mutex_lock(&s->m.mu); /* a concurrent scrape may have applied a newer count already */
    if (folds > s->m.last_adapter_folds) {
        metric_inc(s->m.adapter_folds, NULL, (double)(folds - s->m.last_adapter_folds));
        s->m.last_adapter_folds = folds;
    }
    pthread_mutex_unlock(&s->m.mu);
}

/* one adapter's statistics as JSON (NULL: out of memory); under st->mu */
static json_t *stats_json(const astat_t *a, int64_t now_min) {
    json_t *fin = json_object();
    for (int i = 0; i < MAX_REASONS && a->fin[i].name[0]; i++)
        json_object_set_new(fin, a->fin[i].name, json_integer((json_int_t)a->fin[i].n));
    return json_pack("{s:s, s:I, s:o, s:I, s:I, s:{s:I, s:f, s:I, s:f, s:f, s:f}, s:{s:I, s:I}, "
                     "s:{s:I, s:f, s:I, s:f}, s:I, s:b, s:f, s:f}",
                     "id", a->name, "requests", (json_int_t)a->requests, "finish_reasons", fin, "prompt_tokens",
                     (json_int_t)a->prompt_tokens, "generation_tokens", (json_int_t)a->gen_tokens, "latency",
                     "ttft_count", (json_int_t)a->ttft_n, "ttft_sum_seconds", a->ttft_sum, "itl_count",
                     (json_int_t)a->itl_n, "itl_sum_seconds", a->itl_sum, "e2e_sum_seconds", a->e2e_sum,
                     "queue_sum_seconds", a->queue_sum, "slo", "requests", (json_int_t)a->slo_requests, "attained",
                     (json_int_t)a->slo_met, "loads", "from_disk", (json_int_t)a->loads, "from_disk_sum_seconds",
                     a->load_sum, "to_device", (json_int_t)a->transfers, "to_device_sum_seconds", a->transfer_sum,
                     "requests_last_5m", (json_int_t)window_count(a, now_min), "own_series", a->own,
                     "first_seen", a->first_s, "last_request", a->last_s);
}

json_t *astats_get(server_t *s, const char *name, bool known) {
    adapter_stats_t *st = s->astats;
    int64_t now_min = (int64_t)time(NULL) / SLOT_SECONDS;
    astat_t zero = {.name = (char *)name};
    pthread_mutex_lock(&st->mu);
    const astat_t *a = lookup(st, name);
    if (!a && known) a = &zero; /* served, never asked for */
    json_t *o = a ? stats_json(a, now_min) : NULL;
    pthread_mutex_unlock(&st->mu);
    return o;
}

/* GET /v1/adapters/{name}/stats: the counts /metrics may sum under "_other", for one model
 * (an adapter the request's key may use, or the base model) */
enum MHD_Result api_adapter_stats(server_t *s, conn_t *cn, struct MHD_Connection *c, const char *name) {
    bool base = !strcmp(name, s->model_name);
    bool known = false;
    if (api_may_use(cn, base ? NULL : name)) {
        pthread_mutex_lock(&s->mu);
        served_adapter_t *a = base ? NULL : adapter_find(s, name);
        known = base || (a && !a->unloading);
        pthread_mutex_unlock(&s->mu);
    }
    /* an adapter unloaded since keeps its counts: they are in /metrics' totals */
    json_t *o = api_may_use(cn, base ? NULL : name) ? astats_get(s, name, known) : NULL;
    if (!o) return http_error(c, 404, NULL, "adapter '%s' does not exist", name);
    return http_json(c, 200, o);
}
