/* bench_metrics.c: request timelines -> vLLM `bench serve` metrics and caraserve-bench's own
 * (attainment, sched_ttft, breakdowns, time series), and the table, JSON, CSV and SVG outputs.
 * The definitions follow vLLM's calculate_metrics: TTFT to the first chunk with `choices`,
 * E2EL to the last, ITL the gaps between chunks pooled over requests, TPOT (E2EL - TTFT) /
 * (out - 1) for out > 1 (and 0 for goodput otherwise), numpy statistics (population std,
 * linear percentiles), zeros when there is nothing to measure. */
#include "bench/bench_metrics.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/common.h"

/* ---- per request ---- */
bool bm_request_latency(const bm_request_t *r, bm_latency_t *l) {
    memset(l, 0, sizeof *l);
    if (!r->ok || r->n_chunks < 1) return false;
    double first = r->chunk_t[0], last = r->chunk_t[r->n_chunks - 1];
    l->ttft = (first - r->t_sent) * 1000;
    l->e2el = (last - r->t_sent) * 1000;
    l->sched_ttft = (first - r->t_sched) * 1000;
    if (r->output_tokens > 1) {
        l->tpot = (l->e2el - l->ttft) / (r->output_tokens - 1);
        l->has_tpot = true;
    }
    return true;
}

static bool within(double v, double bound) { return bound < 0 || v <= bound; }

bool bm_request_good(const bm_request_t *r, const bm_slo_t *slo) {
    bm_latency_t l;
    if (!bm_request_latency(r, &l)) return false;
    return within(l.ttft, slo->ttft_ms) && within(l.tpot, slo->tpot_ms) && within(l.e2el, slo->e2el_ms);
}

/* ---- statistics ---- */
static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

double bm_percentile(const double *sorted, int n, double p) {
    if (n <= 0) return 0;
    double pos = p / 100 * (n - 1);
    int lo = (int)floor(pos);
    if (lo >= n - 1) return sorted[n - 1];
    if (lo < 0) return sorted[0];
    double frac = pos - lo;
    return sorted[lo] + (sorted[lo + 1] - sorted[lo]) * frac;
}

void bm_stat_compute(double *v, int n, const bm_opts_t *o, bm_stat_t *s) {
    memset(s, 0, sizeof *s);
    s->n = n;
    if (n <= 0) return;
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    double sum = 0;
    for (int i = 0; i < n; i++) sum += v[i];
    s->mean = sum / n;
    double ss = 0;
    for (int i = 0; i < n; i++) ss += (v[i] - s->mean) * (v[i] - s->mean);
    s->std = sqrt(ss / n);
    s->median = bm_percentile(v, n, 50);
    s->max = v[n - 1];
    for (int k = 0; k < o->n_pct; k++) s->pct[k] = bm_percentile(v, n, o->pct[k]);
}

/* ---- groups ---- */
typedef struct sel {
    enum { SEL_ALL, SEL_ADAPTER, SEL_RANK } kind;
    int value;
} sel_t;

static bool selected(const bm_request_t *r, sel_t s) {
    return s.kind == SEL_ALL || (s.kind == SEL_ADAPTER ? r->adapter == s.value : r->rank == s.value);
}

static int group_compute(const bm_request_t *reqs, int n, sel_t sel, double duration, const bm_opts_t *o,
                         bm_group_t *g) {
    int cap = 0, n_itl = 0;
    for (int i = 0; i < n; i++)
        if (selected(&reqs[i], sel)) {
            cap++;
            if (reqs[i].ok && reqs[i].n_chunks > 1 && !o->no_token_timing) n_itl += reqs[i].n_chunks - 1;
        }
    double *buf = malloc((size_t)(5 * cap + n_itl + 1) * sizeof *buf);
    if (!buf) return cs_error_set(CS_ENOMEM, "out of memory");
    double *ttft = buf, *tpot = ttft + cap, *e2el = tpot + cap, *sched = e2el + cap, *itl = sched + cap;
    int n_ok = 0, n_tpot = 0, k_itl = 0, ok_ttft = 0, ok_tpot = 0, ok_e2el = 0;
    for (int i = 0; i < n; i++) {
        const bm_request_t *r = &reqs[i];
        if (!selected(r, sel)) continue;
        g->requests++;
        bm_latency_t l;
        if (!bm_request_latency(r, &l)) {
            g->failed++;
            continue;
        }
        g->completed++;
        g->input_tokens += r->input_len;
        g->output_tokens += r->output_tokens;
        ttft[n_ok] = l.ttft;
        e2el[n_ok] = l.e2el;
        sched[n_ok] = l.sched_ttft;
        n_ok++;
        if (!o->no_token_timing) { /* a rollout's chunks are whole groups: no per-token time */
            if (l.has_tpot) tpot[n_tpot++] = l.tpot;
            for (int j = 1; j < r->n_chunks; j++) itl[k_itl++] = (r->chunk_t[j] - r->chunk_t[j - 1]) * 1000;
        }
        ok_ttft += within(l.ttft, o->slo.ttft_ms);
        ok_tpot += within(l.tpot, o->slo.tpot_ms);
        ok_e2el += within(l.e2el, o->slo.e2el_ms);
        if (o->has_slo && bm_request_good(r, &o->slo)) g->good++;
    }
    if (!o->has_slo) g->good = 0;
    bm_stat_compute(ttft, n_ok, o, &g->ttft);
    bm_stat_compute(tpot, n_tpot, o, &g->tpot);
    bm_stat_compute(itl, k_itl, o, &g->itl);
    bm_stat_compute(e2el, n_ok, o, &g->e2el);
    bm_stat_compute(sched, n_ok, o, &g->sched_ttft);
    free(buf);
    double d = duration > 0 ? duration : 1;
    g->request_throughput = g->completed / d;
    g->request_goodput = g->good / d;
    g->output_throughput = (double)g->output_tokens / d;
    g->total_token_throughput = (double)(g->input_tokens + g->output_tokens) / d;
    int denom = g->completed + g->failed;
    if (denom > 0) {
        g->attainment = o->has_slo ? (double)g->good / denom : (double)g->completed / denom;
        g->attainment_ttft = (double)ok_ttft / denom;
        g->attainment_tpot = (double)ok_tpot / denom;
        g->attainment_e2el = (double)ok_e2el / denom;
    }
    return CS_OK;
}

/* ---- peaks (vLLM) ---- */
typedef struct ev {
    double t;
    int d;
} ev_t;

static int cmp_ev(const void *a, const void *b) {
    const ev_t *x = a, *y = b;
    if (x->t != y->t) return x->t < y->t ? -1 : 1;
    return x->d - y->d; /* departures (-1) before arrivals (+1): intervals are half-open */
}

/* vLLM's calculate_metrics: over the successful requests, 1 s buckets counted from the first
 * send t0 (floor(t - t0)); output tokens go to the bucket of their chunk, and a request counts
 * as concurrent in every bucket from that of its send to that of its end, both included (so
 * requests that never overlap but fall in the same second count together, and one ending
 * exactly on a bucket's start counts in it). The exact peak in flight is ours, kept apart. */
static int peaks(const bm_request_t *reqs, int n, bm_result_t *res) {
    double t0 = INFINITY, t1 = -INFINITY;
    int n_ok = 0;
    for (int i = 0; i < n; i++) {
        const bm_request_t *r = &reqs[i];
        if (!r->ok || r->n_chunks < 1) continue;
        n_ok++;
        if (r->t_sent < t0) t0 = r->t_sent;
        if (r->chunk_t[r->n_chunks - 1] > t1) t1 = r->chunk_t[r->n_chunks - 1];
    }
    if (n_ok == 0) return CS_OK;
    if (!(t1 - t0 < 1e8)) return cs_error_set(CS_EINVAL, "requests spread over %g s", t1 - t0);
    int nb = (int)ceil(t1 - t0) + 1;
    double *tok = calloc((size_t)nb, sizeof *tok);
    int *conc = calloc((size_t)nb, sizeof *conc);
    ev_t *evs = malloc((size_t)(2 * n_ok) * sizeof *evs);
    if (!tok || !conc || !evs) {
        free(tok); free(conc); free(evs);
        return cs_error_set(CS_ENOMEM, "out of memory");
    }
    int k = 0;
    for (int i = 0; i < n; i++) {
        const bm_request_t *r = &reqs[i];
        if (!r->ok || r->n_chunks < 1) continue;
        double end = r->chunk_t[r->n_chunks - 1];
        for (int j = 0; j < r->n_chunks; j++) {
            int b = (int)(r->chunk_t[j] - t0);
            if (b >= 0 && b < nb) tok[b] += r->chunk_tokens ? r->chunk_tokens[j] : 1;
        }
        int b0 = (int)(r->t_sent - t0), b1 = (int)(end - t0);
        if (b1 > nb - 1) b1 = nb - 1;
        for (int b = b0 < 0 ? 0 : b0; b <= b1; b++) conc[b]++;
        evs[k++] = (ev_t){r->t_sent, 1};
        evs[k++] = (ev_t){end, -1};
    }
    qsort(evs, (size_t)k, sizeof *evs, cmp_ev);
    int cur = 0, peak = 0;
    for (int i = 0; i < k; i++) {
        cur += evs[i].d;
        if (cur > peak) peak = cur;
    }
    double mx = 0;
    int mc = 0;
    for (int b = 0; b < nb; b++) {
        if (tok[b] > mx) mx = tok[b];
        if (conc[b] > mc) mc = conc[b];
    }
    res->max_output_tokens_per_s = mx;
    res->max_concurrent_requests = mc;
    res->max_concurrent_requests_exact = peak;
    free(tok);
    free(conc);
    free(evs);
    return CS_OK;
}

/* ---- time series ---- */
static int bucket_of(double t, double bs, int nb) {
    int b = (int)floor(t / bs);
    return b < 0 ? 0 : b >= nb ? nb - 1 : b;
}

static int timeseries(const bm_request_t *reqs, int n, bm_result_t *res) {
    double bs = res->opts.bucket_s > 0 ? res->opts.bucket_s : 1;
    double tmax = res->duration;
    for (int i = 0; i < n; i++) {
        const bm_request_t *r = &reqs[i];
        if (r->t_sched > tmax) tmax = r->t_sched;
        if (r->t_done > tmax) tmax = r->t_done;
        if (r->n_chunks > 0 && r->chunk_t[r->n_chunks - 1] > tmax) tmax = r->chunk_t[r->n_chunks - 1];
    }
    int nb = (int)ceil(tmax / bs);
    if (nb < 1) nb = 1;
    if (nb > 10000000) return cs_error_set(CS_EINVAL, "time series of %d buckets", nb);
    bm_bucket_t *ts = calloc((size_t)nb, sizeof *ts);
    double *ttft_sum = calloc((size_t)nb, sizeof *ttft_sum);
    int *ttft_n = calloc((size_t)nb, sizeof *ttft_n);
    ev_t *evs = malloc((size_t)(2 * n + 1) * sizeof *evs);
    if (!ts || !ttft_sum || !ttft_n || !evs) {
        free(ts); free(ttft_sum); free(ttft_n); free(evs);
        return cs_error_set(CS_ENOMEM, "out of memory");
    }
    int k = 0;
    for (int b = 0; b < nb; b++) ts[b].t = b * bs;
    for (int i = 0; i < n; i++) {
        const bm_request_t *r = &reqs[i];
        int bsched = bucket_of(r->t_sched, bs, nb);
        ts[bsched].arrivals++;
        ts[bsched].slo_requests++;
        bm_latency_t l;
        bool ok = bm_request_latency(r, &l);
        if (ok) {
            ttft_sum[bsched] += l.ttft;
            ttft_n[bsched]++;
            if (res->opts.has_slo ? bm_request_good(r, &res->opts.slo) : true) ts[bsched].slo_good++;
        }
        if (r->t_done >= 0) {
            int bd = bucket_of(ok ? r->chunk_t[r->n_chunks - 1] : r->t_done, bs, nb);
            if (ok) ts[bd].completed++;
            else ts[bd].failed++;
        } else {
            ts[bsched].failed++; /* never sent */
        }
        for (int j = 0; r->ok && j < r->n_chunks; j++)
            ts[bucket_of(r->chunk_t[j], bs, nb)].output_tokens += r->chunk_tokens ? r->chunk_tokens[j] : 1;
        if (r->t_done >= 0 && r->t_sent >= 0) {
            evs[k++] = (ev_t){r->t_sent, 1};
            evs[k++] = (ev_t){r->t_done, -1};
        }
    }
    qsort(evs, (size_t)k, sizeof *evs, cmp_ev);
    int cur = 0, e = 0;
    for (int b = 0; b < nb; b++) {
        double end = (b + 1) * bs;
        int mx = cur;
        while (e < k && (evs[e].t < end || b == nb - 1)) {
            cur += evs[e++].d;
            if (cur > mx) mx = cur;
        }
        ts[b].max_concurrency = mx;
        ts[b].mean_ttft_ms = ttft_n[b] ? ttft_sum[b] / ttft_n[b] : 0;
    }
    free(ttft_sum);
    free(ttft_n);
    free(evs);
    res->ts = ts;
    res->n_buckets = nb;
    return CS_OK;
}

/* ---- the whole run ---- */
static int cmp_int(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    return x < y ? -1 : x > y;
}

static char *own_name(bm_result_t *r, const char *s) {
    char *d = strdup(s);
    if (!d) return NULL;
    r->names[r->n_names++] = d;
    return d;
}

int bm_compute(const bm_request_t *reqs, int n, double duration, const bm_opts_t *o, const char *const *adapter_names,
               const int *adapter_ranks, int n_adapters, const char *base_name, bm_result_t **out) {
    *out = NULL;
    bm_result_t *r = calloc(1, sizeof *r);
    if (!r) return cs_error_set(CS_ENOMEM, "out of memory");
    r->duration = duration;
    r->opts = *o;
    if (r->opts.bucket_s <= 0) r->opts.bucket_s = 1;
    r->tpot_bound_na = -1;
    if (r->opts.no_token_timing && r->opts.slo.tpot_ms >= 0) { /* reported as not applicable, not applied */
        r->tpot_bound_na = r->opts.slo.tpot_ms;
        r->opts.slo.tpot_ms = -1;
    }
    o = &r->opts;
    int rc = CS_OK;
    int *ranks = malloc((size_t)(n + 1) * sizeof *ranks);
    r->per_adapter = calloc((size_t)n_adapters + 1, sizeof *r->per_adapter);
    r->per_rank = calloc((size_t)n + 1, sizeof *r->per_rank);
    r->names = calloc((size_t)n + (size_t)n_adapters + 4, sizeof *r->names);
    if (!ranks || !r->per_adapter || !r->per_rank || !r->names) { rc = cs_error_set(CS_ENOMEM, "out of memory"); goto out; }
    r->all.name = "all";
    r->all.rank = -1;
    if ((rc = group_compute(reqs, n, (sel_t){SEL_ALL, 0}, duration, o, &r->all))) goto out;
    if ((rc = peaks(reqs, n, r))) goto out;
    /* per adapter: the base model (if it had requests), then every adapter, even idle ones */
    bool base_used = false;
    for (int i = 0; i < n; i++) base_used |= reqs[i].adapter < 0;
    for (int a = base_used ? -1 : 0; a < n_adapters; a++) {
        bm_group_t *g = &r->per_adapter[r->n_adapters++];
        const char *nm = a < 0 ? (base_name ? base_name : "(base)") : adapter_names[a];
        if (!(g->name = own_name(r, nm))) { rc = cs_error_set(CS_ENOMEM, "out of memory"); goto out; }
        g->rank = a < 0 ? 0 : adapter_ranks ? adapter_ranks[a] : -1;
        if ((rc = group_compute(reqs, n, (sel_t){SEL_ADAPTER, a}, duration, o, g))) goto out;
    }
    /* per rank, ascending, over the ranks requests had */
    int nr = 0;
    for (int i = 0; i < n; i++) ranks[nr++] = reqs[i].rank;
    qsort(ranks, (size_t)nr, sizeof *ranks, cmp_int);
    for (int i = 0; i < nr; i++) {
        if (i > 0 && ranks[i] == ranks[i - 1]) continue;
        bm_group_t *g = &r->per_rank[r->n_ranks++];
        char buf[64];
        if (ranks[i] == 0) snprintf(buf, sizeof buf, "base");
        else if (ranks[i] < 0) snprintf(buf, sizeof buf, "rank ?");
        else snprintf(buf, sizeof buf, "rank %d", ranks[i]);
        if (!(g->name = own_name(r, buf))) { rc = cs_error_set(CS_ENOMEM, "out of memory"); goto out; }
        g->rank = ranks[i];
        if ((rc = group_compute(reqs, n, (sel_t){SEL_RANK, ranks[i]}, duration, o, g))) goto out;
    }
    if ((rc = timeseries(reqs, n, r))) goto out;
out:
    free(ranks);
    if (rc) {
        bm_result_free(r);
        return rc;
    }
    *out = r;
    return CS_OK;
}

void bm_result_free(bm_result_t *r) {
    if (!r) return;
    for (int i = 0; i < r->n_names; i++) free(r->names[i]);
    free(r->names);
    free(r->per_adapter);
    free(r->per_rank);
    free(r->ts);
    free(r);
}

/* ---- flags ---- */
int bm_metrics_parse(const char *s, int *mask) {
    *mask = 0;
    const char *p = s;
    while (*p) {
        const char *e = strchr(p, ',');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        static const struct { const char *name; int bit; } M[] = {
            {"ttft", BM_TTFT}, {"tpot", BM_TPOT}, {"itl", BM_ITL}, {"e2el", BM_E2EL}, {"sched_ttft", BM_SCHED_TTFT}};
        int bit = 0;
        for (size_t i = 0; i < CS_ARRAY_LEN(M); i++)
            if (strlen(M[i].name) == len && !strncmp(M[i].name, p, len)) bit = M[i].bit;
        if (!bit) return cs_error_set(CS_EINVAL, "metrics '%s': each must be ttft, tpot, itl, e2el or sched_ttft", s);
        *mask |= bit;
        p += len;
        if (*p == ',') p++;
    }
    return CS_OK;
}

int bm_slo_parse(const char *s, bm_slo_t *slo) {
    const char *c = strchr(s, ':');
    char *end;
    if (!c) return cs_error_set(CS_EINVAL, "goodput '%s': expected KEY:MS with KEY ttft, tpot or e2el", s);
    errno = 0;
    double v = strtod(c + 1, &end);
    if (c[1] == 0 || *end || errno || !isfinite(v) || v < 0)
        return cs_error_set(CS_EINVAL, "goodput '%s': the value must be a number of milliseconds >= 0", s);
    size_t len = (size_t)(c - s);
    if (len == 4 && !strncmp(s, "ttft", 4)) slo->ttft_ms = v;
    else if (len == 4 && !strncmp(s, "tpot", 4)) slo->tpot_ms = v;
    else if (len == 4 && !strncmp(s, "e2el", 4)) slo->e2el_ms = v;
    else return cs_error_set(CS_EINVAL, "goodput '%s': the metric must be ttft, tpot or e2el", s);
    return CS_OK;
}

/* ---- the table ---- */
static void center(FILE *f, const char *s, char c) { /* Python's "{:c^50}" */
    int len = (int)strlen(s), pad = 50 - len, left = pad > 0 ? pad / 2 : 0, right = pad > 0 ? pad - left : 0;
    for (int i = 0; i < left; i++) fputc(c, f);
    fputs(s, f);
    for (int i = 0; i < right; i++) fputc(c, f);
    fputc('\n', f);
}

static void row_f(FILE *f, const char *label, double v) { fprintf(f, "%-40s %-10.2f\n", label, v); }
static void row_i(FILE *f, const char *label, long long v) { fprintf(f, "%-40s %-10lld\n", label, v); }

static void pct_word(double p, char *buf, size_t len) { /* vLLM: 99 -> "99", 99.9 -> "99.9" */
    if (p == floor(p)) snprintf(buf, len, "%d", (int)p);
    else snprintf(buf, len, "%g", p);
}

static void metric_rows(FILE *f, const bm_result_t *r, const bm_stat_t *s, const char *name, const char *header) {
    char label[96], pw[32];
    center(f, header, '-');
    snprintf(label, sizeof label, "Mean %s (ms):", name);
    row_f(f, label, s->mean);
    snprintf(label, sizeof label, "Median %s (ms):", name);
    row_f(f, label, s->median);
    for (int k = 0; k < r->opts.n_pct; k++) {
        pct_word(r->opts.pct[k], pw, sizeof pw);
        snprintf(label, sizeof label, "P%s %s (ms):", pw, name);
        row_f(f, label, s->pct[k]);
    }
}

static int pct_index(const bm_opts_t *o, double p) {
    for (int k = 0; k < o->n_pct; k++)
        if (o->pct[k] == p) return k;
    return -1;
}

static void breakdown(FILE *f, const bm_result_t *r, const bm_group_t *g, int n, const char *what) {
    int k99 = pct_index(&r->opts, 99);
    fprintf(f, "%-20s %5s %6s %6s %6s %9s %9s %9s %9s %7s\n", what, "rank", "reqs", "ok", "failed", "out tok/s",
            "p50 TTFT", k99 >= 0 ? "p99 TTFT" : "max TTFT", "mean TPOT", r->opts.has_slo ? "SLO %" : "ok %");
    for (int i = 0; i < n; i++) {
        char rk[16];
        if (g[i].rank > 0) snprintf(rk, sizeof rk, "%d", g[i].rank);
        else snprintf(rk, sizeof rk, "%s", g[i].rank == 0 ? "-" : "?");
        char tp[32] = "-"; /* no TPOT in rollout mode */
        if (!r->opts.no_token_timing) snprintf(tp, sizeof tp, "%.2f", g[i].tpot.mean);
        fprintf(f, "%-20.20s %5s %6d %6d %6d %9.2f %9.2f %9.2f %9s %7.2f\n", g[i].name, rk, g[i].requests,
                g[i].completed, g[i].failed, g[i].output_throughput, g[i].ttft.median,
                k99 >= 0 ? g[i].ttft.pct[k99] : g[i].ttft.max, tp, 100 * g[i].attainment);
    }
}

void bm_print_table(FILE *f, const bm_result_t *r, const bm_table_opts_t *t) {
    const bm_group_t *a = &r->all;
    center(f, " Serving Benchmark Result ", '=');
    row_i(f, "Successful requests:", a->completed);
    row_i(f, "Failed requests:", a->failed);
    if (t->max_concurrency > 0) row_i(f, "Maximum request concurrency:", t->max_concurrency);
    if (isfinite(t->request_rate)) row_f(f, "Request rate configured (RPS):", t->request_rate);
    row_f(f, "Benchmark duration (s):", r->duration);
    row_i(f, "Total input tokens:", a->input_tokens);
    row_i(f, "Total generated tokens:", a->output_tokens);
    row_f(f, "Request throughput (req/s):", a->request_throughput);
    if (r->opts.has_slo) row_f(f, "Request goodput (req/s):", a->request_goodput);
    row_f(f, "Output token throughput (tok/s):", a->output_throughput);
    row_f(f, "Peak output token throughput (tok/s):", r->max_output_tokens_per_s);
    row_f(f, "Peak concurrent requests:", r->max_concurrent_requests);
    row_i(f, "Peak requests in flight at one instant:", r->max_concurrent_requests_exact);
    row_f(f, "Total token throughput (tok/s):", a->total_token_throughput);
    if (t->metrics & BM_TTFT) metric_rows(f, r, &a->ttft, "TTFT", "Time to First Token");
    if (r->opts.no_token_timing && (t->metrics & (BM_TPOT | BM_ITL))) {
        center(f, "TPOT and ITL", '-');
        fprintf(f, "%-40s %s\n", "TPOT, ITL:", BM_NO_TOKEN_TIMING_NOTE);
    } else {
        if (t->metrics & BM_TPOT) metric_rows(f, r, &a->tpot, "TPOT", "Time per Output Token (excl. 1st token)");
        if (t->metrics & BM_ITL) metric_rows(f, r, &a->itl, "ITL", "Inter-token Latency");
    }
    if (t->metrics & BM_E2EL) metric_rows(f, r, &a->e2el, "E2EL", "End-to-end Latency");
    if (t->metrics & BM_SCHED_TTFT) metric_rows(f, r, &a->sched_ttft, "sched TTFT", "TTFT from the Scheduled Arrival");
    if (r->opts.has_slo) {
        char slo[128] = "", part[40];
        const bm_slo_t *s = &r->opts.slo;
        if (s->ttft_ms >= 0) { snprintf(part, sizeof part, "ttft<=%g ", s->ttft_ms); strcat(slo, part); }
        if (s->tpot_ms >= 0) { snprintf(part, sizeof part, "tpot<=%g ", s->tpot_ms); strcat(slo, part); }
        if (s->e2el_ms >= 0) { snprintf(part, sizeof part, "e2el<=%g ", s->e2el_ms); strcat(slo, part); }
        if (r->tpot_bound_na >= 0) { snprintf(part, sizeof part, "(tpot<=%g: n/a) ", r->tpot_bound_na); strcat(slo, part); }
        center(f, "SLO Attainment (failures are misses)", '-');
        fprintf(f, "%-40s %s\n", "SLO (ms):", slo);
        row_i(f, "Good requests:", a->good);
        row_f(f, "SLO attainment (%):", 100 * a->attainment);
        if (s->ttft_ms >= 0) row_f(f, "  TTFT attainment (%):", 100 * a->attainment_ttft);
        if (s->tpot_ms >= 0) row_f(f, "  TPOT attainment (%):", 100 * a->attainment_tpot);
        if (r->tpot_bound_na >= 0) fprintf(f, "%-40s %s\n", "  TPOT attainment (%):", "n/a (not measured in rollout mode)");
        if (s->e2el_ms >= 0) row_f(f, "  E2EL attainment (%):", 100 * a->attainment_e2el);
    }
    if (t->per_adapter && r->n_adapters > 0) {
        center(f, "Per Adapter", '-');
        breakdown(f, r, r->per_adapter, r->n_adapters, "adapter");
    }
    if (t->per_rank && r->n_ranks > 0) {
        center(f, "Per Rank", '-');
        breakdown(f, r, r->per_rank, r->n_ranks, "rank");
    }
    for (int i = 0; i < 50; i++) fputc('=', f);
    fputc('\n', f);
}

/* ---- JSON ---- */
/* the statistics' keys; null when the metric is not measured (TPOT and ITL in rollout mode) */
static void stat_json(json_t *o, const char *prefix, const char *key, const bm_stat_t *s, const bm_opts_t *op,
                      bool measured) {
    char k[96], pw[32];
    snprintf(k, sizeof k, "%smean_%s_ms", prefix, key);
    json_object_set_new(o, k, measured ? json_real(s->mean) : json_null());
    snprintf(k, sizeof k, "%smedian_%s_ms", prefix, key);
    json_object_set_new(o, k, measured ? json_real(s->median) : json_null());
    snprintf(k, sizeof k, "%sstd_%s_ms", prefix, key);
    json_object_set_new(o, k, measured ? json_real(s->std) : json_null());
    for (int i = 0; i < op->n_pct; i++) {
        pct_word(op->pct[i], pw, sizeof pw);
        snprintf(k, sizeof k, "%sp%s_%s_ms", prefix, pw, key);
        json_object_set_new(o, k, measured ? json_real(s->pct[i]) : json_null());
    }
}

/* a group's requests that completed and failed, their tokens and the request throughput */
static void group_counts_json(json_t *j, const bm_group_t *g) {
    json_object_set_new(j, "completed", json_integer(g->completed));
    json_object_set_new(j, "failed", json_integer(g->failed));
    json_object_set_new(j, "total_input_tokens", json_integer(g->input_tokens));
    json_object_set_new(j, "total_output_tokens", json_integer(g->output_tokens));
    json_object_set_new(j, "request_throughput", json_real(g->request_throughput));
}

/* the latency statistics of a group; TPOT and ITL null when the run measures no per-token time */
static void group_stats_json(json_t *j, const bm_group_t *g, const bm_opts_t *o) {
    bool tok = !o->no_token_timing;
    stat_json(j, "", "ttft", &g->ttft, o, true);
    stat_json(j, "", "tpot", &g->tpot, o, tok);
    stat_json(j, "", "itl", &g->itl, o, tok);
    stat_json(j, "", "e2el", &g->e2el, o, true);
    stat_json(j, "", "sched_ttft", &g->sched_ttft, o, true);
}

static json_t *attain_json(const bm_group_t *g, const bm_result_t *r) {
    const bm_opts_t *o = &r->opts;
    if (!o->has_slo) return json_null();
    json_t *a = json_pack("{s:f, s:i, s:i}", "all", g->attainment, "good", g->good, "requests", g->completed + g->failed);
    if (o->slo.ttft_ms >= 0) json_object_set_new(a, "ttft", json_real(g->attainment_ttft));
    if (o->slo.tpot_ms >= 0) json_object_set_new(a, "tpot", json_real(g->attainment_tpot));
    if (r->tpot_bound_na >= 0) json_object_set_new(a, "tpot", json_null()); /* given, not applicable */
    if (o->slo.e2el_ms >= 0) json_object_set_new(a, "e2el", json_real(g->attainment_e2el));
    return a;
}

static json_t *group_json(const bm_group_t *g, const bm_result_t *r, bool is_adapter) {
    const bm_opts_t *o = &r->opts;
    json_t *j = json_object();
    json_object_set_new(j, is_adapter ? "adapter" : "name", json_string(g->name));
    json_object_set_new(j, "rank", g->rank >= 0 ? json_integer(g->rank) : json_null());
    json_object_set_new(j, "requests", json_integer(g->requests));
    group_counts_json(j, g);
    json_object_set_new(j, "output_throughput", json_real(g->output_throughput));
    json_object_set_new(j, "request_goodput", o->has_slo ? json_real(g->request_goodput) : json_null());
    group_stats_json(j, g, o);
    json_object_set_new(j, "slo_attainment", attain_json(g, r));
    return j;
}

json_t *bm_result_json(const bm_result_t *r, const bm_request_t *reqs, int n, bool detailed) {
    const bm_group_t *a = &r->all;
    const bm_opts_t *o = &r->opts;
    json_t *j = json_object();
    json_object_set_new(j, "duration", json_real(r->duration));
    group_counts_json(j, a);
    json_object_set_new(j, "request_goodput", o->has_slo ? json_real(a->request_goodput) : json_null());
    json_object_set_new(j, "output_throughput", json_real(a->output_throughput));
    json_object_set_new(j, "total_token_throughput", json_real(a->total_token_throughput));
    json_object_set_new(j, "max_output_tokens_per_s", json_real(r->max_output_tokens_per_s));
    json_object_set_new(j, "max_concurrent_requests", json_integer(r->max_concurrent_requests));
    json_object_set_new(j, "max_concurrent_requests_exact", json_integer(r->max_concurrent_requests_exact));
    bool tok = !o->no_token_timing;
    group_stats_json(j, a, o);
    if (!tok) json_object_set_new(j, "tpot_itl", json_string(BM_NO_TOKEN_TIMING_NOTE));
    json_object_set_new(j, "schema_version", json_integer(1));
    json_object_set_new(j, "total_requests", json_integer(a->requests));
    json_t *slo = json_null();
    if (o->has_slo) {
        slo = json_object();
        if (o->slo.ttft_ms >= 0) json_object_set_new(slo, "ttft_ms", json_real(o->slo.ttft_ms));
        if (o->slo.tpot_ms >= 0) json_object_set_new(slo, "tpot_ms", json_real(o->slo.tpot_ms));
        if (o->slo.e2el_ms >= 0) json_object_set_new(slo, "e2el_ms", json_real(o->slo.e2el_ms));
        if (r->tpot_bound_na >= 0) {
            json_object_set_new(slo, "tpot_ms", json_real(r->tpot_bound_na));
            json_object_set_new(slo, "not_applicable", json_pack("[s]", "tpot"));
        }
    }
    json_object_set_new(j, "slo", slo);
    json_object_set_new(j, "slo_attainment", attain_json(a, r));
    json_t *pa = json_array(), *pr = json_array(), *ts = json_array();
    for (int i = 0; i < r->n_adapters; i++) json_array_append_new(pa, group_json(&r->per_adapter[i], r, true));
    for (int i = 0; i < r->n_ranks; i++) json_array_append_new(pr, group_json(&r->per_rank[i], r, false));
    for (int b = 0; b < r->n_buckets; b++) {
        const bm_bucket_t *k = &r->ts[b];
        json_t *e = json_pack("{s:f, s:i, s:i, s:i, s:I, s:i, s:i, s:f}", "t", k->t, "arrivals", k->arrivals,
                              "completed", k->completed, "failed", k->failed, "output_tokens",
                              (json_int_t)k->output_tokens, "max_concurrency", k->max_concurrency, "slo_requests",
                              k->slo_requests, "mean_ttft_ms", k->mean_ttft_ms);
        json_object_set_new(e, "slo_attainment",
                            k->slo_requests ? json_real((double)k->slo_good / k->slo_requests) : json_null());
        json_array_append_new(ts, e);
    }
    json_object_set_new(j, "per_adapter", pa);
    json_object_set_new(j, "per_rank", pr);
    json_object_set_new(j, "timeseries_bucket_s", json_real(o->bucket_s > 0 ? o->bucket_s : 1));
    json_object_set_new(j, "timeseries", ts);
    if (detailed) {
        json_t *il = json_array(), *ol = json_array(), *tt = json_array(), *itls = json_array(), *lat = json_array(),
               *st = json_array(), *qt = json_array(), *err = json_array(), *ad = json_array(), *sch = json_array();
        for (int i = 0; i < n; i++) {
            const bm_request_t *q = &reqs[i];
            bm_latency_t l;
            bool ok = bm_request_latency(q, &l);
            json_array_append_new(il, json_integer(q->input_len));
            json_array_append_new(ol, json_integer(ok ? q->output_tokens : 0));
            json_array_append_new(tt, json_real(ok ? l.ttft / 1000 : 0));
            json_t *gaps = tok ? json_array() : json_null(); /* rollout: gaps between groups are no ITLs */
            for (int k = 1; tok && ok && k < q->n_chunks; k++)
                json_array_append_new(gaps, json_real(q->chunk_t[k] - q->chunk_t[k - 1]));
            json_array_append_new(itls, gaps);
            json_array_append_new(lat, json_real(ok ? l.e2el / 1000 : 0));
            json_array_append_new(st, json_real(q->t_sent));
            json_array_append_new(sch, json_real(q->t_sched));
            json_array_append_new(qt, json_real(q->t_sent >= 0 ? q->t_sent - q->t_sched : 0));
            json_array_append_new(err, json_string(q->error ? q->error : ""));
            json_array_append_new(ad, json_integer(q->adapter));
        }
        json_object_set_new(j, "input_lens", il);
        json_object_set_new(j, "output_lens", ol);
        json_object_set_new(j, "ttfts", tt);
        json_object_set_new(j, "itls", itls);
        json_object_set_new(j, "latencies", lat);
        json_object_set_new(j, "start_times", st);
        json_object_set_new(j, "scheduled_times", sch);
        json_object_set_new(j, "queue_times", qt);
        json_object_set_new(j, "errors", err);
        json_object_set_new(j, "adapters", ad);
    }
    return j;
}

/* ---- CSV ---- */
static void csv_str(FILE *f, const char *s) {
    if (!s) return;
    bool q = strpbrk(s, ",\"\n\r") != NULL;
    if (!q) { fputs(s, f); return; }
    fputc('"', f);
    for (; *s; s++) {
        if (*s == '"') fputc('"', f);
        fputc(*s == '\n' || *s == '\r' ? ' ' : *s, f);
    }
    fputc('"', f);
}

int bm_write_requests_csv(const char *path, const bm_result_t *res, const bm_request_t *reqs, int n,
                          const char *const *adapter_names, const char *base_name) {
    FILE *f = fopen(path, "w");
    if (!f) return cs_error_set(CS_EIO, "%s: %s", path, strerror(errno));
    fputs("id,model,rank,input_len,output_len,output_tokens,t_sched,t_sent,t_first,t_last,t_done,ttft_ms,tpot_ms,"
          "e2el_ms,sched_ttft_ms,chunks,ok,good,error\n", f);
    for (int i = 0; i < n; i++) {
        const bm_request_t *q = &reqs[i];
        bm_latency_t l;
        bool ok = bm_request_latency(q, &l);
        fprintf(f, "%d,", q->id);
        csv_str(f, q->adapter >= 0 ? adapter_names[q->adapter] : base_name ? base_name : "");
        fprintf(f, ",%d,%d,%d,%d,%.6f,%.6f,", q->rank, q->input_len, q->output_len, ok ? q->output_tokens : 0,
                q->t_sched, q->t_sent);
        if (ok) fprintf(f, "%.6f,%.6f,", q->chunk_t[0], q->chunk_t[q->n_chunks - 1]);
        else fputs(",,", f);
        if (q->t_done >= 0) fprintf(f, "%.6f", q->t_done);
        fputc(',', f);
        if (ok) {
            fprintf(f, "%.3f,", l.ttft);
            if (l.has_tpot && !res->opts.no_token_timing) fprintf(f, "%.3f", l.tpot);
            fprintf(f, ",%.3f,%.3f,", l.e2el, l.sched_ttft);
        } else {
            fputs(",,,,", f);
        }
        fprintf(f, "%d,%d,%d,", q->n_chunks, ok, res->opts.has_slo ? bm_request_good(q, &res->opts.slo) : ok);
        csv_str(f, q->error);
        fputc('\n', f);
    }
    if (fclose(f) != 0) return cs_error_set(CS_EIO, "%s: write failed: %s", path, strerror(errno));
    return CS_OK;
}

/* ---- SVG ---- */
typedef struct panel {
    double x, y, w, h;             /* plot area in pixels */
    double xmin, xmax, ymin, ymax; /* data range */
} panel_t;

static const char *COLORS[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
                               "#7f7f7f", "#bcbd22"};

static void xml_str(FILE *f, const char *s) {
    for (; *s; s++) {
        switch (*s) {
        case '&': fputs("&amp;", f); break;
        case '<': fputs("&lt;", f); break;
        case '>': fputs("&gt;", f); break;
        case '"': fputs("&quot;", f); break;
        default: fputc(*s, f);
        }
    }
}

static double nice_step(double range, int ticks) {
    if (!(range > 0)) return 1;
    double raw = range / ticks, mag = pow(10, floor(log10(raw))), f = raw / mag;
    return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * mag;
}

static double px(const panel_t *p, double x) { return p->x + (x - p->xmin) / (p->xmax - p->xmin) * p->w; }
static double py(const panel_t *p, double y) { return p->y + p->h - (y - p->ymin) / (p->ymax - p->ymin) * p->h; }

static void panel_draw(FILE *f, panel_t *p, const char *title, const char *xlabel, const char *ylabel) {
    if (!(p->xmax > p->xmin)) p->xmax = p->xmin + 1;
    if (!(p->ymax > p->ymin)) p->ymax = p->ymin + 1;
    double xs = nice_step(p->xmax - p->xmin, 6), ys = nice_step(p->ymax - p->ymin, 5);
    p->xmax = p->xmin + ceil((p->xmax - p->xmin) / xs - 1e-9) * xs;
    p->ymax = p->ymin + ceil((p->ymax - p->ymin) / ys - 1e-9) * ys;
    fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"white\" stroke=\"#333\"/>\n", p->x, p->y,
            p->w, p->h);
    for (double v = p->xmin; v <= p->xmax + xs * 1e-6; v += xs) {
        double X = px(p, v);
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>\n", X, p->y, X, p->y + p->h);
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"10\" text-anchor=\"middle\">%g</text>\n", X, p->y + p->h + 13,
                fabs(v) < xs * 1e-6 ? 0 : v);
    }
    for (double v = p->ymin; v <= p->ymax + ys * 1e-6; v += ys) {
        double Y = py(p, v);
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>\n", p->x, Y, p->x + p->w, Y);
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"10\" text-anchor=\"end\">%g</text>\n", p->x - 4, Y + 3,
                fabs(v) < ys * 1e-6 ? 0 : v);
    }
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"13\" font-weight=\"bold\" text-anchor=\"middle\">", p->x + p->w / 2,
            p->y - 8);
    xml_str(f, title);
    fprintf(f, "</text>\n<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\" text-anchor=\"middle\">", p->x + p->w / 2,
            p->y + p->h + 28);
    xml_str(f, xlabel);
    fprintf(f, "</text>\n<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\" text-anchor=\"middle\" transform=\"rotate(-90 %.1f %.1f)\">",
            p->x - 38, p->y + p->h / 2, p->x - 38, p->y + p->h / 2);
    xml_str(f, ylabel);
    fputs("</text>\n", f);
}

static void polyline(FILE *f, const panel_t *p, const double *x, const double *y, int n, const char *color, bool dash) {
    if (n <= 0) return;
    fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"1.6\"%s points=\"", color,
            dash ? " stroke-dasharray=\"5,3\"" : "");
    for (int i = 0; i < n; i++) fprintf(f, "%.1f,%.1f ", px(p, x[i]), py(p, y[i]));
    fputs("\"/>\n", f);
}

/* legend entry i at the top right (top) or bottom right of the panel */
static void legend(FILE *f, const panel_t *p, int i, int n, bool top, const char *label, const char *color) {
    double X = p->x + p->w - 110, Y = top ? p->y + 14 + 13 * i : p->y + p->h - 8 - 13 * (n - 1 - i);
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" stroke-width=\"2\"/>\n", X, Y - 4, X + 16,
            Y - 4, color);
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"10\">", X + 20, Y);
    xml_str(f, label);
    fputs("</text>\n", f);
}

/* latencies (ms) of the completed requests of rank `rank` (or all) for one metric (0 TTFT, 1 TPOT, 2 E2EL) */
static int collect(const bm_request_t *reqs, int n, int rank, bool all, int which, double *out) {
    int k = 0;
    for (int i = 0; i < n; i++) {
        bm_latency_t l;
        if ((!all && reqs[i].rank != rank) || !bm_request_latency(&reqs[i], &l)) continue;
        if (which == 1 && !l.has_tpot) continue;
        out[k++] = which == 0 ? l.ttft : which == 1 ? l.tpot : l.e2el;
    }
    qsort(out, (size_t)k, sizeof *out, cmp_double);
    return k;
}

static void cdf_panel(FILE *f, panel_t *p, const bm_result_t *res, const bm_request_t *reqs, int n, int which,
                      double *buf, double *xs, double *ys) {
    static const char *names[] = {"TTFT", "TPOT", "E2EL"};
    char title[64], xl[64];
    snprintf(title, sizeof title, "%s CDF by rank", names[which]);
    snprintf(xl, sizeof xl, "%s (ms)", names[which]);
    if (which == 1 && res->opts.no_token_timing) { /* an empty panel that says why */
        p->xmin = p->ymin = 0;
        p->xmax = p->ymax = 1;
        panel_draw(f, p, "TPOT: not measured (rollout: groups arrive whole)", xl, "fraction of requests");
        return;
    }
    int m = collect(reqs, n, 0, true, which, buf);
    p->xmin = 0;
    p->xmax = m > 0 ? buf[m - 1] : 1;
    p->ymin = 0;
    p->ymax = 1;
    panel_draw(f, p, title, xl, "fraction of requests");
    int groups = res->n_ranks > 1 ? res->n_ranks : 0, shown = groups + 1 < 12 ? groups + 1 : 12;
    for (int gi = -1; gi < groups; gi++) {
        int k = collect(reqs, n, gi < 0 ? 0 : res->per_rank[gi].rank, gi < 0, which, buf);
        if (k == 0) continue;
        int pts = k < 400 ? k : 400, np = 0;
        double prev = 0;
        for (int j = 0; j < pts; j++) { /* the empirical CDF as steps, at evenly spaced ranks */
            int idx = pts == k ? j : (int)((double)j * (k - 1) / (pts - 1));
            xs[np] = buf[idx];
            ys[np++] = prev;
            xs[np] = buf[idx];
            ys[np++] = prev = (double)(idx + 1) / k;
        }
        const char *color = gi < 0 ? "#000000" : COLORS[gi % (int)CS_ARRAY_LEN(COLORS)];
        polyline(f, p, xs, ys, np, color, gi < 0);
        if (gi + 1 < shown) legend(f, p, gi + 1, shown, false, gi < 0 ? "all" : res->per_rank[gi].name, color);
    }
}

int bm_write_svg(const char *path, const bm_result_t *res, const bm_request_t *reqs, int n, const char *title) {
    FILE *f = fopen(path, "w");
    if (!f) return cs_error_set(CS_EIO, "%s: %s", path, strerror(errno));
    int cap = (n > res->n_buckets ? n : res->n_buckets) + 2;
    double *buf = malloc((size_t)cap * sizeof *buf), *xs = malloc((size_t)(2 * cap + 802) * sizeof *xs),
           *ys = malloc((size_t)(2 * cap + 802) * sizeof *ys);
    if (!buf || !xs || !ys) {
        free(buf); free(xs); free(ys);
        fclose(f);
        return cs_error_set(CS_ENOMEM, "out of memory");
    }
    const double W = 1380, H = 760, pw = 360, ph = 250;
    fprintf(f, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" "
               "height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" font-family=\"sans-serif\">\n"
               "<rect width=\"100%%\" height=\"100%%\" fill=\"#fafafa\"/>\n", W, H, W, H);
    fprintf(f, "<text x=\"20\" y=\"26\" font-size=\"16\" font-weight=\"bold\">");
    xml_str(f, title ? title : "caraserve-bench");
    fprintf(f, "</text>\n<text x=\"20\" y=\"44\" font-size=\"11\">%d requests: %d completed, %d failed in %.1f s; "
               "%.2f req/s, %.1f output tok/s",
            res->all.requests, res->all.completed, res->all.failed, res->duration, res->all.request_throughput,
            res->all.output_throughput);
    if (res->opts.has_slo) fprintf(f, "; SLO attainment %.1f%%", 100 * res->all.attainment);
    fputs("</text>\n", f);
    for (int which = 0; which < 3; which++) {
        panel_t p = {80 + which * (pw + 90), 80, pw, ph, 0, 0, 0, 0};
        cdf_panel(f, &p, res, reqs, n, which, buf, xs, ys);
    }
    /* over time: attainment of the requests scheduled in each second, output tokens/s, in flight */
    double bs = res->opts.bucket_s > 0 ? res->opts.bucket_s : 1, tmax = res->n_buckets * bs;
    panel_t pa = {80, 430, pw, ph, 0, tmax, 0, 1};
    panel_draw(f, &pa, res->opts.has_slo ? "SLO attainment over time" : "Completed share over time (no --goodput)",
               "scheduled arrival (s)", "share of requests");
    int k = 0;
    for (int b = 0; b < res->n_buckets; b++)
        if (res->ts[b].slo_requests > 0) {
            xs[k] = res->ts[b].t + bs / 2;
            ys[k++] = (double)res->ts[b].slo_good / res->ts[b].slo_requests;
        }
    polyline(f, &pa, xs, ys, k, COLORS[0], false);
    if (res->opts.has_slo) {
        xs[0] = 0;
        xs[1] = tmax;
        ys[0] = ys[1] = res->all.attainment;
        polyline(f, &pa, xs, ys, 2, "#000000", true);
        bool top = res->all.attainment < 0.5; /* out of the curves' way */
        legend(f, &pa, 0, 2, top, "per second", COLORS[0]);
        legend(f, &pa, 1, 2, top, "whole run", "#000000");
    }
    double mx = 1;
    for (int b = 0; b < res->n_buckets; b++) {
        xs[b] = res->ts[b].t + bs / 2;
        ys[b] = res->ts[b].output_tokens / bs;
        if (ys[b] > mx) mx = ys[b];
    }
    panel_t pt = {80 + pw + 90, 430, pw, ph, 0, tmax, 0, mx};
    panel_draw(f, &pt, "Output tokens per second", "time (s)", "tokens/s");
    polyline(f, &pt, xs, ys, res->n_buckets, COLORS[2], false);
    mx = 1;
    for (int b = 0; b < res->n_buckets; b++) {
        ys[b] = res->ts[b].max_concurrency;
        if (ys[b] > mx) mx = ys[b];
    }
    panel_t pc = {80 + 2 * (pw + 90), 430, pw, ph, 0, tmax, 0, mx};
    panel_draw(f, &pc, "Requests in flight (max per second)", "time (s)", "requests");
    polyline(f, &pc, xs, ys, res->n_buckets, COLORS[3], false);
    fputs("</svg>\n", f);
    free(buf);
    free(xs);
    free(ys);
    if (fclose(f) != 0) return cs_error_set(CS_EIO, "%s: write failed: %s", path, strerror(errno));
    return CS_OK;
}
