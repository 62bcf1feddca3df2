/* bench_workload.c: the seeded generator, arrival processes, popularity and rank mixes,
 * lengths, and the CSV readers and writers behind caraserve-bench's schedule. Every random
 * draw of a run comes from one root generator: each part (ranks, arrivals, adapters, lengths,
 * prompts) takes a child seeded from it, so changing the popularity leaves the arrival times
 * of a seed where they were. */
#include "bench/bench_workload.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/common.h"

/* ---- generator ---- */
void bw_rng_seed(bw_rng_t *r, uint64_t seed) { cs_rng_seed(r, seed); }

void bw_rng_split(bw_rng_t *r, bw_rng_t *child) { bw_rng_seed(child, bw_rng_next(r)); }

uint64_t bw_rng_next(bw_rng_t *r) { return cs_rng_next(r); }

double bw_rng_uniform(bw_rng_t *r) { return cs_rng_uniform(r); }

uint64_t bw_rng_below(bw_rng_t *r, uint64_t n) {
    CS_ASSERT(n > 0);
    uint64_t threshold = (0 - n) % n; /* values below it would make the low residues likelier */
    for (;;) {
        uint64_t x = bw_rng_next(r);
        if (x >= threshold) return x % n;
    }
}

double bw_rng_normal(bw_rng_t *r) {
    for (;;) { /* Marsaglia's polar method, one value per accepted pair */
        double u = 2 * bw_rng_uniform(r) - 1, v = 2 * bw_rng_uniform(r) - 1;
        double s = u * u + v * v;
        if (s > 0 && s < 1) return u * sqrt(-2 * log(s) / s);
    }
}

double bw_rng_gamma(bw_rng_t *r, double shape, double scale) {
    CS_ASSERT(shape > 0 && scale > 0);
    if (shape < 1) { /* boost: Gamma(a) = Gamma(a + 1) * U^(1/a) */
        double u = 1 - bw_rng_uniform(r); /* (0, 1] */
        return bw_rng_gamma(r, shape + 1, scale) * pow(u, 1 / shape);
    }
    double d = shape - 1.0 / 3, c = 1 / sqrt(9 * d);
    for (;;) {
        double x = bw_rng_normal(r), v = 1 + c * x;
        if (v <= 0) continue;
        v = v * v * v;
        double u = 1 - bw_rng_uniform(r);
        if (u < 1 - 0.0331 * x * x * x * x) return d * v * scale;
        if (log(u) < 0.5 * x * x + d * (1 - v + log(v))) return d * v * scale;
    }
}

/* ---- arrivals ---- */
static double rate_at(const bw_arrival_params_t *p, double progress) {
    if (p->ramp == BW_RAMP_LINEAR) return p->ramp_start + (p->ramp_end - p->ramp_start) * progress;
    if (p->ramp == BW_RAMP_EXPONENTIAL) return p->ramp_start * pow(p->ramp_end / p->ramp_start, progress);
    return p->rate;
}

static double gap(const bw_arrival_params_t *p, bw_rng_t *rng, double rate) {
    if (isinf(rate)) return 0;
    switch (p->kind) {
    case BW_ARRIVAL_POISSON: return bw_rng_gamma(rng, 1, 1 / rate);
    case BW_ARRIVAL_GAMMA: return bw_rng_gamma(rng, p->shape, 1 / (rate * p->shape));
    default: return 1 / rate;
    }
}

int bw_arrivals_generate(const bw_arrival_params_t *p, bw_rng_t *rng, int n, double duration, double **times,
                         int *n_out) {
    *times = NULL;
    *n_out = 0;
    if (p->kind == BW_ARRIVAL_TRACE) return cs_error_set(CS_EINVAL, "trace arrivals are read, not generated");
    if (p->ramp != BW_RAMP_NONE) {
        if (!(p->ramp_start > 0) || !(p->ramp_end > 0) || !isfinite(p->ramp_start) || !isfinite(p->ramp_end))
            return cs_error_set(CS_EINVAL, "ramp-up rates must be finite and > 0");
    } else if (!(p->rate > 0)) {
        return cs_error_set(CS_EINVAL, "the request rate must be > 0 (or inf)");
    }
    if (p->kind == BW_ARRIVAL_GAMMA && !(p->shape > 0 && isfinite(p->shape)))
        return cs_error_set(CS_EINVAL, "the gamma shape (burstiness) must be finite and > 0");
    bool dur_mode = duration > 0;
    if (!dur_mode && n <= 0) return cs_error_set(CS_EINVAL, "need a number of requests or a duration");
    if (dur_mode && p->ramp == BW_RAMP_NONE && isinf(p->rate))
        return cs_error_set(CS_EINVAL, "a duration needs a finite request rate (inf sends every request at once)");
    int cap = dur_mode ? (n > 0 ? n : 1 << 20) : n, len = 0;
    double *t = malloc((size_t)(dur_mode ? 1024 : cap) * sizeof *t);
    if (!t) return cs_error_set(CS_ENOMEM, "out of memory");
    int alloc = dur_mode ? 1024 : cap;
    double now = 0;
    for (int i = 0; i < cap; i++) {
        double progress = dur_mode ? now / duration : (double)i / (n > 1 ? n - 1 : 1);
        now += gap(p, rng, rate_at(p, progress));
        if (dur_mode && now >= duration) break;
        if (len == alloc) {
            alloc *= 2;
            double *nt = realloc(t, (size_t)alloc * sizeof *t);
            if (!nt) { free(t); return cs_error_set(CS_ENOMEM, "out of memory"); }
            t = nt;
        }
        t[len++] = now;
    }
    if (dur_mode && len == cap && n <= 0) {
        free(t);
        return cs_error_set(CS_EINVAL, "more than %d arrivals in %g s: lower the rate or give --num-prompts", cap,
                            duration);
    }
    /* vLLM closes the 1-2% gap between the sum of random gaps and n / rate the same way */
    if (!dur_mode && p->normalize && p->ramp == BW_RAMP_NONE && isfinite(p->rate) && len > 0 && t[len - 1] > 0) {
        double f = (len / p->rate) / t[len - 1];
        for (int i = 0; i < len; i++) t[i] *= f;
    }
    *times = t;
    *n_out = len;
    return CS_OK;
}

/* ---- popularity ---- */
static bool parse_double(const char *s, double *v) {
    if (!s || !*s) return false;
    char *end;
    errno = 0;
    *v = strtod(s, &end);
    while (*end && isspace((unsigned char)*end)) end++;
    return !*end && errno == 0 && isfinite(*v);
}

static bool parse_int(const char *s, long long lo, long long hi, int *v) {
    if (!s || !*s) return false;
    char *end;
    errno = 0;
    long long x = strtoll(s, &end, 10);
    while (*end && isspace((unsigned char)*end)) end++;
    if (*end || errno || x < lo || x > hi) return false;
    *v = (int)x;
    return true;
}

int bw_pop_parse(const char *s, bw_pop_spec_t *out) {
    const char *colon = strchr(s, ':');
    size_t len = colon ? (size_t)(colon - s) : strlen(s);
    out->param = 0;
    if (len == 7 && !strncmp(s, "uniform", len) && !colon) out->kind = BW_POP_UNIFORM;
    else if (len == 11 && !strncmp(s, "round-robin", len) && !colon) out->kind = BW_POP_ROUND_ROBIN;
    else if (len == 5 && !strncmp(s, "trace", len) && !colon) out->kind = BW_POP_TRACE;
    else if ((len == 4 && !strncmp(s, "zipf", len)) || (len == 5 && !strncmp(s, "power", len))) {
        out->kind = len == 4 ? BW_POP_ZIPF : BW_POP_POWER;
        out->param = 1.0; /* zipf: theta 1 (the classic); power: alpha must be given */
        if (out->kind == BW_POP_POWER && !colon)
            return cs_error_set(CS_EINVAL, "popularity '%s': power needs its exponent, e.g. power:0.5", s);
        if (colon && (!parse_double(colon + 1, &out->param) || !(out->param > 0)))
            return cs_error_set(CS_EINVAL, "popularity '%s': the parameter after ':' must be a number > 0", s);
    } else {
        return cs_error_set(CS_EINVAL, "popularity '%s': expected uniform, zipf:THETA, power:ALPHA, round-robin or trace",
                            s);
    }
    return CS_OK;
}

int bw_pop_weights(const bw_pop_spec_t *p, int n, double *w) {
    if (n <= 0) return cs_error_set(CS_EINVAL, "no adapters");
    double sum = 0;
    for (int i = 0; i < n; i++) {
        switch (p->kind) {
        case BW_POP_UNIFORM: w[i] = 1; break;
        case BW_POP_ZIPF: w[i] = pow(i + 1.0, -p->param); break;
        /* P(floor(N X) = i) for X with CDF x^alpha on [0, 1] */
        case BW_POP_POWER: w[i] = pow((i + 1.0) / n, p->param) - pow((double)i / n, p->param); break;
        default: return cs_error_set(CS_EINVAL, "this popularity has no closed-form weights");
        }
        sum += w[i];
    }
    for (int i = 0; i < n; i++) w[i] /= sum;
    return CS_OK;
}

int bw_sampler_init(bw_sampler_t *s, const double *w, int n) {
    s->n = 0;
    s->cdf = NULL;
    if (n <= 0) return cs_error_set(CS_EINVAL, "no weights");
    double sum = 0;
    for (int i = 0; i < n; i++) {
        if (!(w[i] >= 0) || !isfinite(w[i])) return cs_error_set(CS_EINVAL, "weight %d is not a finite number >= 0", i);
        sum += w[i];
    }
    if (!(sum > 0)) return cs_error_set(CS_EINVAL, "the weights sum to 0");
    s->cdf = malloc((size_t)n * sizeof *s->cdf);
    if (!s->cdf) return cs_error_set(CS_ENOMEM, "out of memory");
    double acc = 0;
    for (int i = 0; i < n; i++) {
        acc += w[i];
        s->cdf[i] = acc / sum;
    }
    s->cdf[n - 1] = 1;
    s->n = n;
    return CS_OK;
}

int bw_sampler_draw(const bw_sampler_t *s, bw_rng_t *r) {
    double u = bw_rng_uniform(r);
    int lo = 0, hi = s->n - 1; /* the first i with u < cdf[i] */
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (u < s->cdf[mid]) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

void bw_sampler_free(bw_sampler_t *s) {
    if (!s) return;
    free(s->cdf);
    s->cdf = NULL;
    s->n = 0;
}

/* ---- ranks ---- */
int bw_rank_mix_parse(const char *s, bw_rank_mix_t *m) {
    memset(m, 0, sizeof *m);
    char *dup = strdup(s), *save = NULL;
    if (!dup) return cs_error_set(CS_ENOMEM, "out of memory");
    double sum = 0;
    int rc = CS_OK;
    for (char *tok = strtok_r(dup, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (m->n == BW_MAX_RANKS) { rc = cs_error_set(CS_EINVAL, "rank mix '%s': more than %d ranks", s, BW_MAX_RANKS); break; }
        char *colon = strchr(tok, ':');
        if (colon) *colon = 0;
        double f = 1;
        if (!parse_int(tok, 1, 1 << 16, &m->rank[m->n]) || (colon && (!parse_double(colon + 1, &f) || f < 0))) {
            rc = cs_error_set(CS_EINVAL, "rank mix '%s': expected RANK:FRACTION,... (RANK a positive integer, FRACTION >= 0)", s);
            break;
        }
        for (int i = 0; i < m->n; i++)
            if (m->rank[i] == m->rank[m->n]) { rc = cs_error_set(CS_EINVAL, "rank mix '%s': rank %d twice", s, m->rank[i]); }
        if (rc) break;
        m->frac[m->n++] = f;
        sum += f;
    }
    free(dup);
    if (!rc && m->n == 0) rc = cs_error_set(CS_EINVAL, "rank mix '%s' is empty", s);
    if (!rc && !(sum > 0)) rc = cs_error_set(CS_EINVAL, "rank mix '%s': the fractions sum to 0", s);
    if (rc) { m->n = 0; return rc; }
    for (int i = 0; i < m->n; i++) m->frac[i] /= sum;
    return CS_OK;
}

int bw_rank_mix_assign(const bw_rank_mix_t *m, int n, bw_rng_t *rng, int *ranks) {
    if (m->n <= 0) return cs_error_set(CS_EINVAL, "empty rank mix");
    int count[BW_MAX_RANKS], given = 0;
    double rem[BW_MAX_RANKS];
    for (int k = 0; k < m->n; k++) {
        double q = m->frac[k] * n;
        count[k] = (int)floor(q);
        rem[k] = q - count[k];
        given += count[k];
    }
    while (given < n) { /* largest remainders first; ties to the earlier rank of the mix */
        int best = 0;
        for (int k = 1; k < m->n; k++)
            if (rem[k] > rem[best]) best = k;
        count[best]++;
        rem[best] = -1;
        given++;
    }
    int j = 0;
    for (int k = 0; k < m->n; k++)
        for (int c = 0; c < count[k]; c++) ranks[j++] = m->rank[k];
    for (int i = n - 1; i > 0; i--) { /* Fisher-Yates */
        int k = (int)bw_rng_below(rng, (uint64_t)i + 1);
        int t = ranks[i];
        ranks[i] = ranks[k];
        ranks[k] = t;
    }
    return CS_OK;
}

int bw_adapter_parse(const char *s, bw_adapter_t *a) {
    a->name = NULL;
    a->rank = -1;
    a->weight = -1;
    const char *c1 = strchr(s, ':');
    size_t len = c1 ? (size_t)(c1 - s) : strlen(s);
    if (len == 0) return cs_error_set(CS_EINVAL, "adapter '%s': empty name", s);
    if (c1) {
        const char *c2 = strchr(c1 + 1, ':');
        char buf[64];
        size_t rl = c2 ? (size_t)(c2 - c1 - 1) : strlen(c1 + 1);
        if (rl >= sizeof buf) return cs_error_set(CS_EINVAL, "adapter '%s': bad rank", s);
        memcpy(buf, c1 + 1, rl);
        buf[rl] = 0;
        if (!parse_int(buf, 1, 1 << 16, &a->rank))
            return cs_error_set(CS_EINVAL, "adapter '%s': expected NAME[:RANK[:WEIGHT]] with RANK a positive integer", s);
        if (c2 && (!parse_double(c2 + 1, &a->weight) || a->weight < 0))
            return cs_error_set(CS_EINVAL, "adapter '%s': WEIGHT must be a number >= 0", s);
    }
    a->name = strndup(s, len);
    if (!a->name) return cs_error_set(CS_ENOMEM, "out of memory");
    return CS_OK;
}

/* ---- CSV reading ---- */
typedef struct csv {
    FILE *f;
    const char *path;
    int line;
    char *buf;
    size_t cap;
    char *field[16];
    int nf;
} csv_t;

/* the next non-empty, non-comment line split at commas (fields trimmed, quotes dropped); 1 when
 * there is one, 0 at the end, negative on error */
static int csv_next(csv_t *c) {
    for (;;) {
        ssize_t got = getline(&c->buf, &c->cap, c->f);
        if (got < 0) return ferror(c->f) ? cs_error_set(CS_EIO, "%s: read error", c->path) : 0;
        c->line++;
        char *s = c->buf;
        while (got > 0 && (s[got - 1] == '\n' || s[got - 1] == '\r')) s[--got] = 0;
        while (*s && isspace((unsigned char)*s)) s++;
        if (!*s || *s == '#') continue;
        c->nf = 0;
        for (char *p = s;;) {
            char *comma = strchr(p, ',');
            if (comma) *comma = 0;
            while (*p && isspace((unsigned char)*p)) p++;
            char *e = p + strlen(p);
            while (e > p && isspace((unsigned char)e[-1])) *--e = 0;
            if (e - p >= 2 && *p == '"' && e[-1] == '"') { e[-1] = 0; p++; }
            if (c->nf == (int)CS_ARRAY_LEN(c->field))
                return cs_error_set(CS_EFORMAT, "%s:%d: more than %d fields", c->path, c->line, (int)CS_ARRAY_LEN(c->field));
            c->field[c->nf++] = p;
            if (!comma) break;
            p = comma + 1;
        }
        return 1;
    }
}

static int csv_open(csv_t *c, const char *path) {
    memset(c, 0, sizeof *c);
    c->path = path;
    c->f = fopen(path, "r");
    if (!c->f) return cs_error_set(CS_EIO, "%s: %s", path, strerror(errno));
    return CS_OK;
}

static void csv_close(csv_t *c) {
    if (c->f) fclose(c->f);
    free(c->buf);
}

#define CSV_BAD(c, ...) cs_error_set(CS_EFORMAT, "%s:%d: %s", (c)->path, (c)->line, csv_msg(__VA_ARGS__))
/* room for element len of the array *p, which has room for *cap, doubling from first */
static int grow(void **p, int *cap, int len, size_t elem, int first) {
    if (len < *cap) return CS_OK;
    int nc = *cap ? 2 * *cap : first;
    void *np = realloc(*p, (size_t)nc * elem);
    if (!np) return cs_error_set(CS_ENOMEM, "out of memory");
    *p = np;
    *cap = nc;
    return CS_OK;
}

static const char *csv_msg(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static const char *csv_msg(const char *fmt, ...) {
    static _Thread_local char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return buf;
}

/* days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's days_from_civil) */
static long long days_from_civil(long long y, unsigned m, unsigned d) {
    y -= m <= 2;
    long long era = (y >= 0 ? y : y - 399) / 400;
    unsigned yoe = (unsigned)(y - era * 400);
    unsigned doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
    unsigned doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    return era * 146097 + (long long)doe - 719468;
}

/* "2023-11-16 18:15:46.6805900" (or with 'T', or a trailing 'Z') or plain seconds */
static bool parse_timestamp(const char *s, double *t) {
    if (parse_double(s, t)) return true;
    int y, mo, d, h, mi, n = 0;
    double sec;
    if (sscanf(s, "%4d-%2d-%2d%*1[ T]%2d:%2d:%lf%n", &y, &mo, &d, &h, &mi, &sec, &n) != 6) return false;
    const char *rest = s + n;
    if (*rest == 'Z') rest++;
    if (*rest || mo < 1 || mo > 12 || d < 1 || d > 31 || h < 0 || h > 23 || mi < 0 || mi > 59 || sec < 0 || sec >= 61)
        return false;
    *t = (double)days_from_civil(y, (unsigned)mo, (unsigned)d) * 86400.0 + h * 3600.0 + mi * 60.0 + sec;
    return true;
}

int bw_trace_load_azure(const char *path, bw_trace_row_t **rows, int *n) {
    *rows = NULL;
    *n = 0;
    csv_t c;
    int rc = csv_open(&c, path);
    if (rc) return rc;
    int col_t = -1, col_in = -1, col_out = -1, len = 0, cap = 0;
    bw_trace_row_t *r = NULL;
    double t0 = 0, prev = 0;
    rc = csv_next(&c);
    if (rc == 0) rc = cs_error_set(CS_EFORMAT, "%s: empty file (expected a TIMESTAMP,ContextTokens,GeneratedTokens header)", path);
    if (rc < 0) goto err;
    for (int i = 0; i < c.nf; i++) {
        if (!strcasecmp(c.field[i], "TIMESTAMP")) col_t = i;
        else if (!strcasecmp(c.field[i], "ContextTokens")) col_in = i;
        else if (!strcasecmp(c.field[i], "GeneratedTokens")) col_out = i;
    }
    if (col_t < 0 || col_in < 0 || col_out < 0) {
        rc = CSV_BAD(&c, "expected a header with TIMESTAMP, ContextTokens and GeneratedTokens (the Azure LLM inference "
                         "trace format)");
        goto err;
    }
    int nf = c.nf;
    while ((rc = csv_next(&c)) == 1) {
        if (c.nf != nf) { rc = CSV_BAD(&c, "%d fields, the header has %d", c.nf, nf); goto err; }
        bw_trace_row_t row;
        if (!parse_timestamp(c.field[col_t], &row.t)) {
            rc = CSV_BAD(&c, "bad TIMESTAMP '%s' (expected YYYY-MM-DD HH:MM:SS[.fraction] or seconds)", c.field[col_t]);
            goto err;
        }
        if (!parse_int(c.field[col_in], 1, 1 << 30, &row.input_len)) {
            rc = CSV_BAD(&c, "ContextTokens '%s' is not a positive integer", c.field[col_in]);
            goto err;
        }
        if (!parse_int(c.field[col_out], 1, 1 << 30, &row.output_len)) {
            rc = CSV_BAD(&c, "GeneratedTokens '%s' is not a positive integer", c.field[col_out]);
            goto err;
        }
        if (len == 0) t0 = prev = row.t;
        if (row.t < prev) { rc = CSV_BAD(&c, "TIMESTAMP goes backwards (%s)", c.field[col_t]); goto err; }
        prev = row.t;
        row.t -= t0;
        if ((rc = grow((void **)&r, &cap, len, sizeof *r, 256))) goto err;
        r[len++] = row;
    }
    if (rc < 0) goto err;
    if (len == 0) { rc = cs_error_set(CS_EFORMAT, "%s: no rows after the header", path); goto err; }
    csv_close(&c);
    *rows = r;
    *n = len;
    return CS_OK;
err:
    csv_close(&c);
    free(r);
    return rc;
}

int bw_arrivals_load(const char *path, double **times, int *n) {
    *times = NULL;
    *n = 0;
    csv_t c;
    int rc = csv_open(&c, path);
    if (rc) return rc;
    double *t = NULL, prev = 0;
    int len = 0, cap = 0;
    while ((rc = csv_next(&c)) == 1) {
        double v;
        if (c.nf != 1) { rc = CSV_BAD(&c, "%d fields, expected one arrival time in seconds", c.nf); goto err; }
        if (!parse_double(c.field[0], &v)) {
            if (len == 0 && c.line == 1) continue; /* a header */
            rc = CSV_BAD(&c, "'%s' is not a number of seconds", c.field[0]);
            goto err;
        }
        if (v < 0) { rc = CSV_BAD(&c, "negative arrival time %s", c.field[0]); goto err; }
        if (len > 0 && v < prev) { rc = CSV_BAD(&c, "arrival time %s goes backwards", c.field[0]); goto err; }
        prev = v;
        if ((rc = grow((void **)&t, &cap, len, sizeof *t, 256))) goto err;
        t[len++] = v;
    }
    if (rc < 0) goto err;
    if (len == 0) { rc = cs_error_set(CS_EFORMAT, "%s: no arrival times", path); goto err; }
    csv_close(&c);
    *times = t;
    *n = len;
    return CS_OK;
err:
    csv_close(&c);
    free(t);
    return rc;
}

int bw_popularity_load(const char *path, char ***names, double **prob, int *n) {
    *names = NULL;
    *prob = NULL;
    *n = 0;
    csv_t c;
    int rc = csv_open(&c, path);
    if (rc) return rc;
    char **nm = NULL;
    double *p = NULL, sum = 0;
    int len = 0, cap = 0, cap_p = 0;
    while ((rc = csv_next(&c)) == 1) {
        double v;
        if (c.nf != 2) { rc = CSV_BAD(&c, "%d fields, expected adapter,probability", c.nf); goto err; }
        if (!parse_double(c.field[1], &v)) {
            if (len == 0 && c.line == 1) continue; /* a header */
            rc = CSV_BAD(&c, "probability '%s' is not a number", c.field[1]);
            goto err;
        }
        if (v < 0) { rc = CSV_BAD(&c, "negative probability %s", c.field[1]); goto err; }
        if (!*c.field[0]) { rc = CSV_BAD(&c, "empty adapter name"); goto err; }
        for (int i = 0; i < len; i++)
            if (!strcmp(nm[i], c.field[0])) { rc = CSV_BAD(&c, "adapter '%s' listed twice", c.field[0]); goto err; }
        if ((rc = grow((void **)&nm, &cap, len, sizeof *nm, 128))) goto err;
        if ((rc = grow((void **)&p, &cap_p, len, sizeof *p, 128))) goto err;
        nm[len] = strdup(c.field[0]);
        if (!nm[len]) { rc = cs_error_set(CS_ENOMEM, "out of memory"); goto err; }
        p[len++] = v;
        sum += v;
    }
    if (rc < 0) goto err;
    if (len == 0) { rc = cs_error_set(CS_EFORMAT, "%s: no adapters", path); goto err; }
    if (!(sum > 0)) { rc = cs_error_set(CS_EFORMAT, "%s: the probabilities sum to 0", path); goto err; }
    for (int i = 0; i < len; i++) p[i] /= sum;
    csv_close(&c);
    *names = nm;
    *prob = p;
    *n = len;
    return CS_OK;
err:
    csv_close(&c);
    for (int i = 0; i < len; i++) free(nm[i]);
    free(nm);
    free(p);
    return rc;
}

/* ---- the schedule ---- */
void bw_config_default(bw_config_t *c) {
    memset(c, 0, sizeof *c);
    c->num_prompts = 1000;
    c->arrival.kind = BW_ARRIVAL_POISSON;
    c->arrival.rate = INFINITY;
    c->arrival.shape = 1;
    c->arrival.normalize = true;
    c->time_scale = 1;
    c->adapter_prefix = "lora-";
    c->pop.kind = BW_POP_UNIFORM;
    c->dataset = BW_DATA_RANDOM;
    c->input_len = 1024;
    c->output_len = 128;
}

void bw_schedule_free(bw_schedule_t *s) {
    if (!s) return;
    for (int i = 0; i < s->n_adapters; i++) free(s->adapters[i].name);
    free(s->adapters);
    free(s->req);
    free(s);
}

static int add_adapter(bw_schedule_t *s, const char *name, int rank, double weight) {
    bw_adapter_t *na = realloc(s->adapters, (size_t)(s->n_adapters + 1) * sizeof *na);
    if (!na) return cs_error_set(CS_ENOMEM, "out of memory");
    s->adapters = na;
    bw_adapter_t *a = &s->adapters[s->n_adapters];
    a->name = strdup(name);
    if (!a->name) return cs_error_set(CS_ENOMEM, "out of memory");
    a->rank = rank;
    a->weight = weight;
    s->n_adapters++;
    return CS_OK;
}

/* the adapters and their popularity weights (w: n_adapters, malloc'd; NULL for round-robin) */
static int build_adapters(const bw_config_t *c, bw_rng_t *rng_ranks, bw_schedule_t *s, double **w_out) {
    int rc = CS_OK;
    char **pn = NULL;
    double *pp = NULL, *w = NULL;
    int np = 0;
    *w_out = NULL;
    if (c->popularity_file) {
        if ((rc = bw_popularity_load(c->popularity_file, &pn, &pp, &np))) return rc;
    }
    char name[512];
    if (c->n_adapters > 0) {
        for (int i = 0; i < c->n_adapters && !rc; i++)
            rc = add_adapter(s, c->adapters[i].name, c->adapters[i].rank, c->adapters[i].weight);
    } else if (c->num_adapters > 0) {
        for (int i = 0; i < c->num_adapters && !rc; i++) {
            snprintf(name, sizeof name, "%s%d", c->adapter_prefix, i);
            rc = add_adapter(s, name, -1, -1);
        }
    } else if (np > 0) { /* the popularity file names them */
        for (int i = 0; i < np && !rc; i++) {
            snprintf(name, sizeof name, "%s%s", c->adapter_prefix, pn[i]);
            rc = add_adapter(s, name, -1, -1);
        }
    }
    if (rc) goto out;
    int n = s->n_adapters;
    if (n > 0 && c->rank_mix.n > 0) { /* the mix gives the ranks nobody gave */
        int *ranks = malloc((size_t)n * sizeof *ranks);
        if (!ranks) { rc = cs_error_set(CS_ENOMEM, "out of memory"); goto out; }
        rc = bw_rank_mix_assign(&c->rank_mix, n, rng_ranks, ranks);
        for (int i = 0; i < n && !rc; i++)
            if (s->adapters[i].rank < 0) s->adapters[i].rank = ranks[i];
        free(ranks);
        if (rc) goto out;
    }
    if (n == 0) goto out;
    if (c->pop.kind == BW_POP_ROUND_ROBIN) goto out;
    w = calloc((size_t)n, sizeof *w);
    if (!w) { rc = cs_error_set(CS_ENOMEM, "out of memory"); goto out; }
    bool any_weight = false;
    for (int i = 0; i < n; i++) any_weight |= s->adapters[i].weight >= 0;
    if (c->pop.kind == BW_POP_TRACE) {
        if (np > 0) { /* match the file's rows to the adapters: by name, or a number as an index */
            for (int k = 0; k < np; k++) {
                int idx = -1;
                for (int i = 0; i < n && idx < 0; i++) {
                    const char *an = s->adapters[i].name;
                    size_t pl = strlen(c->adapter_prefix);
                    if (!strcmp(an, pn[k]) || (!strncmp(an, c->adapter_prefix, pl) && !strcmp(an + pl, pn[k]))) idx = i;
                }
                if (idx < 0 && !parse_int(pn[k], 0, n - 1, &idx)) idx = -1;
                if (idx < 0) {
                    rc = cs_error_set(CS_EINVAL, "%s: adapter '%s' is not one of the %d adapters", c->popularity_file,
                                      pn[k], n);
                    goto out;
                }
                w[idx] += pp[k];
            }
        } else if (any_weight) {
            for (int i = 0; i < n; i++) {
                if (s->adapters[i].weight < 0) {
                    rc = cs_error_set(CS_EINVAL, "adapter '%s' has no :WEIGHT (give every adapter one, or none)",
                                      s->adapters[i].name);
                    goto out;
                }
                w[i] = s->adapters[i].weight;
            }
        } else {
            rc = cs_error_set(CS_EINVAL, "--popularity trace needs --popularity-file or NAME:RANK:WEIGHT adapters");
            goto out;
        }
        for (int i = 0; i < n; i++) s->adapters[i].weight = w[i];
    } else {
        if ((rc = bw_pop_weights(&c->pop, n, w))) goto out;
    }
    *w_out = w;
    w = NULL;
out:
    for (int i = 0; i < np; i++) free(pn[i]);
    free(pn);
    free(pp);
    free(w);
    return rc;
}

static int draw_len(bw_rng_t *r, int len, double ratio) {
    int lo = (int)floor(len * (1 - ratio)), hi = (int)ceil(len * (1 + ratio));
    if (lo < 1) lo = 1;
    if (hi < lo) hi = lo;
    return lo + (int)bw_rng_below(r, (uint64_t)(hi - lo) + 1);
}

int bw_schedule_build(const bw_config_t *c, bw_schedule_t **out) {
    *out = NULL;
    if (c->dataset == BW_DATA_TRACE) return cs_error_set(CS_EINVAL, "a dumped schedule is loaded, not built");
    if (!(c->base_fraction >= 0 && c->base_fraction <= 1)) return cs_error_set(CS_EINVAL, "--base-fraction must be in [0, 1]");
    if (c->dataset == BW_DATA_RANDOM && (c->input_len < 1 || c->output_len < 1))
        return cs_error_set(CS_EINVAL, "input and output lengths must be >= 1");
    if (!(c->range_ratio >= 0 && c->range_ratio < 1)) return cs_error_set(CS_EINVAL, "--random-range-ratio must be in [0, 1)");
    if (!(c->time_scale > 0)) return cs_error_set(CS_EINVAL, "--time-scale must be > 0");
    bw_schedule_t *s = calloc(1, sizeof *s);
    if (!s) return cs_error_set(CS_ENOMEM, "out of memory");
    bw_rng_t root, r_ranks, r_arr, r_adapter, r_len, r_prompt;
    bw_rng_seed(&root, c->seed);
    bw_rng_split(&root, &r_ranks);
    bw_rng_split(&root, &r_arr);
    bw_rng_split(&root, &r_adapter);
    bw_rng_split(&root, &r_len);
    bw_rng_split(&root, &r_prompt);
    double *w = NULL, *times = NULL;
    bw_trace_row_t *rows = NULL;
    int n_rows = 0, n = 0, rc;
    bw_sampler_t sampler = {0};
    if ((rc = build_adapters(c, &r_ranks, s, &w))) goto err;
    if (c->dataset == BW_DATA_AZURE) {
        if (!c->dataset_path) { rc = cs_error_set(CS_EINVAL, "--dataset-name azure-llm needs --dataset-path"); goto err; }
        if ((rc = bw_trace_load_azure(c->dataset_path, &rows, &n_rows))) goto err;
    }
    /* arrival times */
    if (c->arrival.kind == BW_ARRIVAL_TRACE) {
        int nt = 0;
        if (c->arrivals_file) {
            if ((rc = bw_arrivals_load(c->arrivals_file, &times, &nt))) goto err;
        } else if (rows) {
            times = malloc((size_t)n_rows * sizeof *times);
            if (!times) { rc = cs_error_set(CS_ENOMEM, "out of memory"); goto err; }
            for (int i = 0; i < n_rows; i++) times[i] = rows[i].t;
            nt = n_rows;
        } else {
            rc = cs_error_set(CS_EINVAL, "trace arrivals need --arrivals-file or --dataset-name azure-llm");
            goto err;
        }
        for (int i = 0; i < nt; i++) {
            times[i] *= c->time_scale;
            if (c->duration > 0 ? times[i] < c->duration : true) n = i + 1;
        }
        if (c->num_prompts > 0 && c->num_prompts < n) n = c->num_prompts;
    } else {
        int want = c->num_prompts;
        if (c->duration <= 0 && want <= 0 && rows) want = n_rows;
        if ((rc = bw_arrivals_generate(&c->arrival, &r_arr, want, c->duration, &times, &n))) goto err;
    }
    if (n <= 0) { rc = cs_error_set(CS_EINVAL, "the schedule is empty (no arrival in the duration)"); goto err; }
    s->req = calloc((size_t)n, sizeof *s->req);
    if (!s->req) { rc = cs_error_set(CS_ENOMEM, "out of memory"); goto err; }
    if (w && (rc = bw_sampler_init(&sampler, w, s->n_adapters))) goto err;
    int rr = 0;
    for (int i = 0; i < n; i++) {
        bw_request_t *q = &s->req[i];
        q->id = i;
        q->t = times[i];
        q->adapter = -1;
        if (s->n_adapters > 0) {
            bool base = c->base_fraction > 0 && bw_rng_uniform(&r_adapter) < c->base_fraction;
            if (!base) q->adapter = c->pop.kind == BW_POP_ROUND_ROBIN ? rr++ % s->n_adapters : bw_sampler_draw(&sampler, &r_adapter);
        }
        if (rows) {
            q->input_len = rows[i % n_rows].input_len;
            q->output_len = rows[i % n_rows].output_len;
        } else {
            q->input_len = draw_len(&r_len, c->input_len, c->range_ratio);
            q->output_len = draw_len(&r_len, c->output_len, c->range_ratio);
        }
        q->prompt_seed = bw_rng_next(&r_prompt);
    }
    s->n = n;
    bw_sampler_free(&sampler);
    free(w);
    free(times);
    free(rows);
    *out = s;
    return CS_OK;
err:
    bw_sampler_free(&sampler);
    free(w);
    free(times);
    free(rows);
    bw_schedule_free(s);
    return rc;
}

static const char *SCHED_HEADER = "id,arrival_s,model,rank,input_len,output_len,prompt_seed";

int bw_schedule_dump(const bw_schedule_t *s, const char *path) {
    FILE *f = fopen(path, "w");
    if (!f) return cs_error_set(CS_EIO, "%s: %s", path, strerror(errno));
    fprintf(f, "# caraserve-bench schedule: %d requests, %d adapters (model empty: the base model)\n%s\n", s->n,
            s->n_adapters, SCHED_HEADER);
    for (int i = 0; i < s->n; i++) {
        const bw_request_t *q = &s->req[i];
        const bw_adapter_t *a = q->adapter >= 0 ? &s->adapters[q->adapter] : NULL;
        fprintf(f, "%d,%.9f,%s,%d,%d,%d,%llu\n", q->id, q->t, a ? a->name : "", a ? a->rank : 0, q->input_len,
                q->output_len, (unsigned long long)q->prompt_seed);
    }
    if (fclose(f) != 0) return cs_error_set(CS_EIO, "%s: write failed: %s", path, strerror(errno));
    return CS_OK;
}

int bw_schedule_load(const char *path, bw_schedule_t **out) {
    *out = NULL;
    csv_t c;
    int rc = csv_open(&c, path);
    if (rc) return rc;
    bw_schedule_t *s = calloc(1, sizeof *s);
    if (!s) { csv_close(&c); return cs_error_set(CS_ENOMEM, "out of memory"); }
    int cap = 0;
    double prev = 0;
    rc = csv_next(&c);
    if (rc == 0) rc = cs_error_set(CS_EFORMAT, "%s: empty file (expected the header %s)", path, SCHED_HEADER);
    if (rc < 0) goto err;
    {
        static const char *want[] = {"id", "arrival_s", "model", "rank", "input_len", "output_len", "prompt_seed"};
        bool ok = c.nf == 7;
        for (int i = 0; ok && i < 7; i++) ok = !strcmp(c.field[i], want[i]);
        if (!ok) { rc = CSV_BAD(&c, "expected the header %s (a schedule written by --dump-schedule)", SCHED_HEADER); goto err; }
    }
    while ((rc = csv_next(&c)) == 1) {
        if (c.nf != 7) { rc = CSV_BAD(&c, "%d fields, expected 7", c.nf); goto err; }
        bw_request_t q = {0};
        int rank;
        char *end;
        if (!parse_int(c.field[0], 0, 1 << 30, &q.id)) { rc = CSV_BAD(&c, "bad id '%s'", c.field[0]); goto err; }
        if (!parse_double(c.field[1], &q.t) || q.t < 0) { rc = CSV_BAD(&c, "bad arrival_s '%s'", c.field[1]); goto err; }
        if (s->n > 0 && q.t < prev) { rc = CSV_BAD(&c, "arrival_s %s goes backwards", c.field[1]); goto err; }
        prev = q.t;
        if (!parse_int(c.field[3], -1, 1 << 16, &rank)) { rc = CSV_BAD(&c, "bad rank '%s'", c.field[3]); goto err; }
        if (!parse_int(c.field[4], 1, 1 << 30, &q.input_len)) { rc = CSV_BAD(&c, "input_len '%s' is not a positive integer", c.field[4]); goto err; }
        if (!parse_int(c.field[5], 1, 1 << 30, &q.output_len)) { rc = CSV_BAD(&c, "output_len '%s' is not a positive integer", c.field[5]); goto err; }
        errno = 0;
        q.prompt_seed = strtoull(c.field[6], &end, 10);
        if (!*c.field[6] || *end || errno || c.field[6][0] == '-') { rc = CSV_BAD(&c, "bad prompt_seed '%s'", c.field[6]); goto err; }
        q.adapter = -1;
        if (*c.field[2]) {
            for (int i = 0; i < s->n_adapters && q.adapter < 0; i++)
                if (!strcmp(s->adapters[i].name, c.field[2])) q.adapter = i;
            if (q.adapter < 0) {
                if ((rc = add_adapter(s, c.field[2], rank, -1))) goto err;
                q.adapter = s->n_adapters - 1;
            } else if (s->adapters[q.adapter].rank != rank) {
                rc = CSV_BAD(&c, "adapter '%s' has rank %d here and %d before", c.field[2], rank, s->adapters[q.adapter].rank);
                goto err;
            }
        }
        if ((rc = grow((void **)&s->req, &cap, s->n, sizeof *s->req, 256))) goto err;
        s->req[s->n++] = q;
    }
    if (rc < 0) goto err;
    if (s->n == 0) { rc = cs_error_set(CS_EFORMAT, "%s: no requests", path); goto err; }
    csv_close(&c);
    *out = s;
    return CS_OK;
err:
    csv_close(&c);
    bw_schedule_free(s);
    return rc;
}

void bw_prompt_ids(uint64_t seed, int len, int lo, int hi, int32_t *out) {
    CS_ASSERT(hi > lo);
    bw_rng_t r;
    bw_rng_seed(&r, seed);
    for (int i = 0; i < len; i++) out[i] = lo + (int32_t)bw_rng_below(&r, (uint64_t)(hi - lo));
}

char *bw_prompt_text(uint64_t seed, int len) {
    static const char *words[] = {
        "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not",
        "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "had", "they", "you", "were",
        "their", "one", "all", "we", "can", "her", "has", "there", "been", "if", "more", "when", "will", "would",
        "who", "so", "no", "time", "river", "light", "stone", "market", "winter", "garden", "letter", "engine",
        "music", "window", "question", "number", "city", "paper", "story",
    };
    bw_rng_t r;
    bw_rng_seed(&r, seed);
    size_t cap = (size_t)len * 10 + 1, used = 0;
    char *s = malloc(cap);
    if (!s) return NULL;
    s[0] = 0;
    for (int i = 0; i < len; i++) {
        const char *w = words[bw_rng_below(&r, CS_ARRAY_LEN(words))];
        size_t wl = strlen(w);
        if (used + wl + 2 > cap) {
            cap = 2 * cap + wl + 2;
            char *ns = realloc(s, cap);
            if (!ns) { free(s); return NULL; }
            s = ns;
        }
        if (i) s[used++] = ' ';
        memcpy(s + used, w, wl);
        used += wl;
        s[used] = 0;
    }
    return s;
}

double bw_chi2_critical(int df, double z) {
    double k = df, a = 2.0 / (9 * k);
    double x = 1 - a + z * sqrt(a);
    return k * x * x * x;
}
