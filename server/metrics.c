/* metrics.c: the Prometheus registry of metrics.h. A family keeps its series in a chained
 * hash table keyed by the label values (for updates) and in an array in creation order (for
 * rendering), both under the family's mutex. Rendering formats numbers in the C locale
 * whatever the process locale is, and replaces invalid UTF-8 so that a scrape never fails
 * to parse. */
#include "server/metrics.h"

#include <locale.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/common.h"

typedef enum metric_kind { METRIC_COUNTER, METRIC_GAUGE, METRIC_HISTOGRAM, METRIC_SUMMARY } metric_kind;

static const char *const kind_names[] = {"counter", "gauge", "histogram", "summary"};

typedef struct series {
    struct series *hnext;   /* hash chain */
    uint64_t hash;
    double value;           /* counter or gauge value; histogram, summary: the sum */
    uint64_t *counts;       /* histogram: (n_buckets + 1) per-bucket counts, not cumulative;
                               the last one is above every bound; summary: (1) the count */
    char *values[];         /* (n_labels) label values, stored after the counts */
} series_t;

struct metric {
    struct metric *next;    /* registration order */
    metric_kind kind;
    char *name;             /* as exposed: a counter's ends in "_total" */
    char *help;
    int n_labels;
    char *label_names[METRICS_MAX_LABELS];
    int n_buckets;          /* 0 for a summary: its one count is a histogram's +Inf bucket */
    double *bounds;         /* (n_buckets) upper bounds, strictly increasing, finite */

    pthread_mutex_t lock;   /* guards everything below */
    series_t **table;       /* (table_size) chains; table_size is a power of two */
    size_t table_size;
    series_t **order;       /* (n_series) in creation order */
    size_t n_series, order_cap;
};

struct metrics {
    pthread_mutex_t lock;   /* guards the family list */
    metric_t *first, *last;
    locale_t c_locale;      /* for number formatting in metrics_render */
};

/* ---- registry ---- */

metrics_t *metrics_new(void) {
    metrics_t *m = calloc(1, sizeof *m);
    if (!m) goto err;
    m->c_locale = newlocale(LC_NUMERIC_MASK, "C", (locale_t)0);
    if (m->c_locale == (locale_t)0) goto err;
    pthread_mutex_init(&m->lock, NULL);
    return m;
err:
    free(m);
    cs_error_set(CS_ENOMEM, "metrics: out of memory");
    return NULL;
}

static void family_free(metric_t *f) {
    if (!f) return;
    for (size_t i = 0; i < f->n_series; i++) free(f->order[i]);
    free(f->order);
    free(f->table);
    for (int i = 0; i < f->n_labels; i++) free(f->label_names[i]);
    free(f->bounds);
    free(f->name);
    free(f->help);
    pthread_mutex_destroy(&f->lock);
    free(f);
}

void metrics_free(metrics_t *m) {
    if (!m) return;
    for (metric_t *f = m->first, *next; f; f = next) {
        next = f->next;
        family_free(f);
    }
    freelocale(m->c_locale);
    pthread_mutex_destroy(&m->lock);
    free(m);
}

static bool valid_name(const char *s, bool colon) {
    if (!s || !*s) return false;
    for (const char *p = s; *p; p++) {
        char c = *p;
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (colon && c == ':') ||
                  (p > s && c >= '0' && c <= '9');
        if (!ok) return false;
    }
    return true;
}

static bool ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

static metric_t *find_family(metrics_t *m, const char *name) {
    for (metric_t *f = m->first; f; f = f->next)
        if (strcmp(f->name, name) == 0) return f;
    return NULL;
}

static series_t *series_get(metric_t *f, const char *const *label_values, bool create);

static metric_t *family_register(metrics_t *m, metric_kind kind, const char *name, const char *help,
                                 const char *const *label_names, const double *buckets, int n_buckets) {
    CS_ASSERT(m);
    metric_t *f = NULL;
    if (!valid_name(name, true)) {
        cs_error_set(CS_EINVAL, "metrics: invalid metric name '%s'", name ? name : "(null)");
        return NULL;
    }
    if (!help) {
        cs_error_set(CS_EINVAL, "metrics: %s: no help text", name);
        return NULL;
    }
    int n_labels = 0;
    for (; label_names && label_names[n_labels]; n_labels++) {
        const char *l = label_names[n_labels];
        if (n_labels == METRICS_MAX_LABELS) {
            cs_error_set(CS_EINVAL, "metrics: %s: more than %d labels", name, METRICS_MAX_LABELS);
            return NULL;
        }
        if (!valid_name(l, false) || strncmp(l, "__", 2) == 0 || (kind == METRIC_HISTOGRAM && !strcmp(l, "le")) ||
            (kind == METRIC_SUMMARY && !strcmp(l, "quantile"))) {
            cs_error_set(CS_EINVAL, "metrics: %s: invalid or reserved label name '%s'", name, l);
            return NULL;
        }
        for (int j = 0; j < n_labels; j++)
            if (strcmp(label_names[j], l) == 0) {
                cs_error_set(CS_EINVAL, "metrics: %s: label '%s' given twice", name, l);
                return NULL;
            }
    }
    if (kind == METRIC_HISTOGRAM) {
        if (n_buckets > 0 && buckets && isinf(buckets[n_buckets - 1]) && buckets[n_buckets - 1] > 0) n_buckets--;
        if (n_buckets < 0 || n_buckets > METRICS_MAX_BUCKETS || (n_buckets > 0 && !buckets)) {
            cs_error_set(CS_EINVAL, "metrics: %s: %d buckets (at most %d)", name, n_buckets, METRICS_MAX_BUCKETS);
            return NULL;
        }
        for (int i = 0; i < n_buckets; i++)
            if (!isfinite(buckets[i]) || (i > 0 && !(buckets[i] > buckets[i - 1]))) {
                cs_error_set(CS_EINVAL, "metrics: %s: bucket bounds must be finite and strictly increasing", name);
                return NULL;
            }
    }

    f = calloc(1, sizeof *f);
    if (!f) goto oom;
    pthread_mutex_init(&f->lock, NULL);
    f->kind = kind;
    size_t nlen = strlen(name);
    bool add_total = kind == METRIC_COUNTER && !ends_with(name, "_total");
    f->name = malloc(nlen + (add_total ? 6 : 0) + 1);
    f->help = strdup(help);
    if (!f->name || !f->help) goto oom;
    memcpy(f->name, name, nlen + 1);
    if (add_total) memcpy(f->name + nlen, "_total", 7);
    for (int i = 0; i < n_labels; i++) {
        f->label_names[i] = strdup(label_names[i]);
        if (!f->label_names[i]) goto oom;
        f->n_labels = i + 1;
    }
    if (kind == METRIC_HISTOGRAM && n_buckets > 0) {
        f->bounds = malloc((size_t)n_buckets * sizeof *f->bounds);
        if (!f->bounds) goto oom;
        memcpy(f->bounds, buckets, (size_t)n_buckets * sizeof *f->bounds);
        f->n_buckets = n_buckets;
    }
    f->table_size = 16;
    f->table = calloc(f->table_size, sizeof *f->table);
    if (!f->table) goto oom;
    /* a family without labels is exposed (at 0) from the start */
    if (n_labels == 0 && !series_get(f, NULL, true)) goto oom;

    pthread_mutex_lock(&m->lock);
    if (find_family(m, f->name)) {
        pthread_mutex_unlock(&m->lock);
        cs_error_set(CS_EINVAL, "metrics: '%s' is already registered", f->name);
        family_free(f);
        return NULL;
    }
    if (m->last) m->last->next = f;
    else m->first = f;
    m->last = f;
    pthread_mutex_unlock(&m->lock);
    return f;
oom:
    family_free(f);
    cs_error_set(CS_ENOMEM, "metrics: %s: out of memory", name);
    return NULL;
}

metric_t *metrics_counter(metrics_t *m, const char *name, const char *help, const char *const *label_names) {
    return family_register(m, METRIC_COUNTER, name, help, label_names, NULL, 0);
}

metric_t *metrics_gauge(metrics_t *m, const char *name, const char *help, const char *const *label_names) {
    return family_register(m, METRIC_GAUGE, name, help, label_names, NULL, 0);
}

metric_t *metrics_histogram(metrics_t *m, const char *name, const char *help, const char *const *label_names,
                            const double *buckets, int n_buckets) {
    return family_register(m, METRIC_HISTOGRAM, name, help, label_names, buckets, n_buckets);
}

metric_t *metrics_summary(metrics_t *m, const char *name, const char *help, const char *const *label_names) {
    return family_register(m, METRIC_SUMMARY, name, help, label_names, NULL, 0);
}

/* ---- series ---- */

/* per-series counts: a histogram's buckets, a summary's count */
static size_t n_counts(const metric_t *f) {
    return f->kind == METRIC_HISTOGRAM || f->kind == METRIC_SUMMARY ? (size_t)f->n_buckets + 1 : 0;
}

/* FNV-1a over the values, each with its terminating NUL so that ("ab","c") != ("a","bc") */
static uint64_t labels_hash(const metric_t *f, const char *const *label_values) {
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < f->n_labels; i++) {
        const unsigned char *p = (const unsigned char *)label_values[i];
        do {
            h ^= *p;
            h *= 1099511628211ull;
        } while (*p++);
    }
    return h;
}

static bool labels_equal(const metric_t *f, const series_t *s, const char *const *label_values) {
    for (int i = 0; i < f->n_labels; i++)
        if (strcmp(s->values[i], label_values[i]) != 0) return false;
    return true;
}

static void check_labels(const metric_t *f, const char *const *label_values) {
    CS_ASSERT(f->n_labels == 0 || label_values);
    for (int i = 0; i < f->n_labels; i++) CS_ASSERT(label_values[i]);
}

/* Doubles the hash table; on no memory keeps the old one (longer chains, still correct). */
static void table_grow(metric_t *f) {
    size_t size = f->table_size * 2;
    series_t **t = calloc(size, sizeof *t);
    if (!t) return;
    for (size_t i = 0; i < f->table_size; i++)
        for (series_t *s = f->table[i], *next; s; s = next) {
            next = s->hnext;
            s->hnext = t[s->hash & (size - 1)];
            t[s->hash & (size - 1)] = s;
        }
    free(f->table);
    f->table = t;
    f->table_size = size;
}

/* The series for these label values; with create, made when missing (NULL if no memory).
 * Called with f->lock held (or before f is published). */
static series_t *series_get(metric_t *f, const char *const *label_values, bool create) {
    uint64_t h = labels_hash(f, label_values);
    for (series_t *s = f->table[h & (f->table_size - 1)]; s; s = s->hnext)
        if (s->hash == h && labels_equal(f, s, label_values)) return s;
    if (!create) return NULL;

    if (f->n_series == f->order_cap) {
        size_t cap = f->order_cap ? f->order_cap * 2 : 8;
        series_t **o = realloc(f->order, cap * sizeof *o);
        if (!o) return NULL;
        f->order = o;
        f->order_cap = cap;
    }
    /* one allocation: the struct, the value pointers, the counts (8-aligned), the strings */
    size_t counts_off = sizeof(series_t) + (size_t)f->n_labels * sizeof(char *);
    counts_off = (counts_off + 7) & ~(size_t)7;
    size_t nc = n_counts(f);
    size_t strings_off = counts_off + nc * sizeof(uint64_t), size = strings_off;
    for (int i = 0; i < f->n_labels; i++) size += strlen(label_values[i]) + 1;
    series_t *s = calloc(1, size);
    if (!s) return NULL;
    s->hash = h;
    if (nc) s->counts = (uint64_t *)((char *)s + counts_off);
    char *p = (char *)s + strings_off;
    for (int i = 0; i < f->n_labels; i++) {
        size_t l = strlen(label_values[i]) + 1;
        memcpy(p, label_values[i], l);
        s->values[i] = p;
        p += l;
    }
    if (f->n_series >= f->table_size) table_grow(f);
    s->hnext = f->table[h & (f->table_size - 1)];
    f->table[h & (f->table_size - 1)] = s;
    f->order[f->n_series++] = s;
    return s;
}

void metric_inc(metric_t *f, const char *const *label_values, double v) {
    CS_ASSERT(f && (f->kind == METRIC_GAUGE || (f->kind == METRIC_COUNTER && v >= 0)));
    check_labels(f, label_values);
    pthread_mutex_lock(&f->lock);
    series_t *s = series_get(f, label_values, true);
    if (s) s->value += v;
    pthread_mutex_unlock(&f->lock);
}

void metric_set(metric_t *f, const char *const *label_values, double v) {
    CS_ASSERT(f && f->kind == METRIC_GAUGE);
    check_labels(f, label_values);
    pthread_mutex_lock(&f->lock);
    series_t *s = series_get(f, label_values, true);
    if (s) s->value = v;
    pthread_mutex_unlock(&f->lock);
}

void metric_observe(metric_t *f, const char *const *label_values, double v) {
    CS_ASSERT(f && (f->kind == METRIC_HISTOGRAM || f->kind == METRIC_SUMMARY));
    check_labels(f, label_values);
    /* the first bucket with v <= bound; NaN and values above every bound go to the last (a
     * summary's only one) */
    int lo = 0, hi = f->n_buckets;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (v <= f->bounds[mid]) hi = mid;
        else lo = mid + 1;
    }
    pthread_mutex_lock(&f->lock);
    series_t *s = series_get(f, label_values, true);
    if (s) {
        s->counts[lo]++;
        s->value += v;
    }
    pthread_mutex_unlock(&f->lock);
}

/* Takes s out of its hash chain (not out of the order array). With f->lock held. */
static void series_unhash(metric_t *f, series_t *s) {
    series_t **pp = &f->table[s->hash & (f->table_size - 1)];
    while (*pp != s) pp = &(*pp)->hnext;
    *pp = s->hnext;
}

void metric_remove(metric_t *f, const char *const *label_values) {
    CS_ASSERT(f);
    check_labels(f, label_values);
    pthread_mutex_lock(&f->lock);
    series_t *s = series_get(f, label_values, false);
    if (s) {
        series_unhash(f, s);
        size_t i = 0;
        while (f->order[i] != s) i++;
        memmove(&f->order[i], &f->order[i + 1], (f->n_series - i - 1) * sizeof *f->order);
        f->n_series--;
        free(s);
    }
    pthread_mutex_unlock(&f->lock);
}

void metric_fold(metric_t *f, const char *label_name, const char *from, const char *to) {
    CS_ASSERT(f && label_name && from && to);
    int li = 0;
    while (li < f->n_labels && strcmp(f->label_names[li], label_name) != 0) li++;
    if (li == f->n_labels || strcmp(from, to) == 0) return;
    size_t nc = n_counts(f);
    pthread_mutex_lock(&f->lock);
    /* One pass over the creation order, compacting it in place: order[0..w) is kept,
     * order[i..n_series) is still to look at. A target created here is appended at the end
     * and is looked at too, but its value is `to`, so it stays. */
    size_t w = 0;
    for (size_t i = 0; i < f->n_series; i++) {
        series_t *s = f->order[i], *dst = NULL;
        if (strcmp(s->values[li], from) == 0) {
            const char *values[METRICS_MAX_LABELS];
            for (int k = 0; k < f->n_labels; k++) values[k] = s->values[k];
            values[li] = to;
            dst = series_get(f, values, true); /* may append to f->order */
        }
        if (!dst) { /* not folded, or no memory for the target: kept as it is */
            f->order[w++] = s;
            continue;
        }
        dst->value += s->value;
        for (size_t k = 0; k < nc; k++) dst->counts[k] += s->counts[k];
        series_unhash(f, s);
        free(s);
    }
    f->n_series = w;
    pthread_mutex_unlock(&f->lock);
}

size_t metric_series_count(metric_t *f) {
    CS_ASSERT(f);
    pthread_mutex_lock(&f->lock);
    size_t n = f->n_series;
    pthread_mutex_unlock(&f->lock);
    return n;
}

/* ---- rendering ---- */

/* the text so far (base/common.h's byte string); after a failed allocation nothing more is
 * added, and the render fails */
typedef struct sbuf {
    cs_buf_t b;
    bool oom;
} sbuf_t;

static void sb_put(sbuf_t *b, const char *s, size_t n) {
    if (!b->oom && !cs_buf_add(&b->b, s, n)) b->oom = true;
}

static void sb_puts(sbuf_t *b, const char *s) { sb_put(b, s, strlen(s)); }

/* Escapes backslash and newline (and '"' in label values); invalid UTF-8 becomes U+FFFD. */
static void sb_escaped(sbuf_t *b, const char *s, bool quote) {
    const char *p = s, *end = s + strlen(s);
    int32_t cp;
    while (*p) {
        const char *run = p;
        size_t n;
        while (*p && *p != '\\' && *p != '\n' && !(quote && *p == '"') &&
               (n = cs_utf8_next(p, (size_t)(end - p), &cp, NULL)) > 0)
            p += n;
        sb_put(b, run, (size_t)(p - run));
        if (!*p) break;
        if (*p == '\\') sb_puts(b, "\\\\");
        else if (*p == '\n') sb_puts(b, "\\n");
        else if (*p == '"') sb_puts(b, "\\\"");
        else sb_puts(b, "\xef\xbf\xbd");
        p++;
    }
}

/* Shortest of %.15g..%.17g that reads back as the same double; Prometheus's spellings of
 * the special values. Uses the current (C) locale. */
static void sb_double(sbuf_t *b, double v) {
    char s[40];
    if (isnan(v)) snprintf(s, sizeof s, "NaN");
    else if (isinf(v)) snprintf(s, sizeof s, v > 0 ? "+Inf" : "-Inf");
    else
        for (int prec = 15; prec <= 17; prec++) {
            snprintf(s, sizeof s, "%.*g", prec, v);
            if (strtod(s, NULL) == v) break;
        }
    sb_puts(b, s);
}

static void sb_u64(sbuf_t *b, uint64_t v) {
    char s[24];
    snprintf(s, sizeof s, "%llu", (unsigned long long)v);
    sb_puts(b, s);
}

/* `name{a="x",b="y"` without the closing brace (nothing after the name without labels) */
static void sb_series_head(sbuf_t *b, const metric_t *f, const series_t *s, const char *suffix) {
    sb_puts(b, f->name);
    sb_puts(b, suffix);
    for (int i = 0; i < f->n_labels; i++) {
        sb_puts(b, i ? "," : "{");
        sb_puts(b, f->label_names[i]);
        sb_puts(b, "=\"");
        sb_escaped(b, s->values[i], true);
        sb_puts(b, "\"");
    }
}

static void render_family(sbuf_t *b, metric_t *f) {
    sb_puts(b, "# HELP ");
    sb_puts(b, f->name);
    sb_puts(b, " ");
    sb_escaped(b, f->help, false);
    sb_puts(b, "\n# TYPE ");
    sb_puts(b, f->name);
    sb_puts(b, " ");
    sb_puts(b, kind_names[f->kind]);
    sb_puts(b, "\n");
    pthread_mutex_lock(&f->lock);
    for (size_t i = 0; i < f->n_series; i++) {
        const series_t *s = f->order[i];
        if (f->kind == METRIC_COUNTER || f->kind == METRIC_GAUGE) {
            sb_series_head(b, f, s, "");
            sb_puts(b, f->n_labels ? "} " : " ");
            sb_double(b, s->value);
            sb_puts(b, "\n");
            continue;
        }
        uint64_t cum = 0;
        for (int k = 0; k <= f->n_buckets; k++) {
            cum += s->counts[k];
            if (f->kind == METRIC_SUMMARY) continue; /* no quantiles, no buckets */
            sb_series_head(b, f, s, "_bucket");
            sb_puts(b, f->n_labels ? ",le=\"" : "{le=\"");
            if (k < f->n_buckets) sb_double(b, f->bounds[k]);
            else sb_puts(b, "+Inf");
            sb_puts(b, "\"} ");
            sb_u64(b, cum);
            sb_puts(b, "\n");
        }
        sb_series_head(b, f, s, "_sum");
        sb_puts(b, f->n_labels ? "} " : " ");
        sb_double(b, s->value);
        sb_puts(b, "\n");
        sb_series_head(b, f, s, "_count");
        sb_puts(b, f->n_labels ? "} " : " ");
        sb_u64(b, cum);
        sb_puts(b, "\n");
    }
    pthread_mutex_unlock(&f->lock);
}

char *metrics_render(metrics_t *m, size_t *len) {
    CS_ASSERT(m);
    sbuf_t b = {0};
    sb_put(&b, "", 0); /* an empty registry renders as "" */
    locale_t old = uselocale(m->c_locale);
    pthread_mutex_lock(&m->lock);
    for (metric_t *f = m->first; f; f = f->next) render_family(&b, f);
    pthread_mutex_unlock(&m->lock);
    uselocale(old);
    if (b.oom) {
        cs_buf_free(&b.b);
        cs_error_set(CS_ENOMEM, "metrics: out of memory rendering");
        return NULL;
    }
    if (len) *len = b.b.len;
    return b.b.p;
}
