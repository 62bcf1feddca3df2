/* cost.c: the iteration cost model (cost.h): weighted normal equations kept as sufficient
 * statistics, solved with non-negative coefficients by an active set (a term whose
 * coefficient comes out negative is fixed at 0 and the rest refitted), a ring of held-out
 * steps for the honest error. */
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "sched/cost.h"

const char *const cost_term_names[COST_N_TERMS] = {"fixed", "prefill_tokens", "decode_rows", "adapter_rank_sum",
                                                   "rows_x_max_rank", "row_rank_sum"};

#define HELDOUT_EVERY 5
#define HELDOUT_RING 256

struct cost_model {
    pthread_mutex_t mu;     /* the engine thread feeds it, HTTP threads read it */
    double forget;
    double A[COST_N_TERMS][COST_N_TERMS]; /* Σ w x xᵀ */
    double b[COST_N_TERMS];               /* Σ w x y */
    double yy, sy, sw;                    /* Σ w y², Σ w y, Σ w */
    long n_obs, n_fit;
    double hx[HELDOUT_RING][COST_N_TERMS], hy[HELDOUT_RING];
    int h_n, h_next;
    cost_fit_t fit;
};

void cost_terms(const sched_step_t *st, double x[COST_N_TERMS]) {
    x[0] = 1;
    x[1] = st->prefill_tokens;
    x[2] = st->decode_rows;
    x[3] = (double)st->rank_sum;
    x[4] = (double)(st->prefill_tokens + st->decode_rows) * st->max_rank;
    x[5] = (double)st->row_rank_sum;
}

cost_model_t *cost_model_new(double forget) {
    cost_model_t *m = calloc(1, sizeof *m);
    if (!m) return NULL;
    m->forget = forget > 0 && forget <= 1 ? forget : 1;
    pthread_mutex_init(&m->mu, NULL);
    return m;
}

void cost_model_free(cost_model_t *m) {
    if (!m) return;
    pthread_mutex_destroy(&m->mu);
    free(m);
}

static void observe_locked(cost_model_t *m, const sched_step_t *st) {
    double x[COST_N_TERMS], y = st->forward_ms;
    if (!(y >= 0) || !isfinite(y)) return;
    cost_terms(st, x);
    if (++m->n_obs % HELDOUT_EVERY == 0) {
        memcpy(m->hx[m->h_next], x, sizeof x);
        m->hy[m->h_next] = y;
        m->h_next = (m->h_next + 1) % HELDOUT_RING;
        if (m->h_n < HELDOUT_RING) m->h_n++;
        return;
    }
    double f = m->forget;
    for (int i = 0; i < COST_N_TERMS; i++) {
        for (int j = 0; j < COST_N_TERMS; j++) m->A[i][j] = f * m->A[i][j] + x[i] * x[j];
        m->b[i] = f * m->b[i] + x[i] * y;
    }
    m->yy = f * m->yy + y * y;
    m->sy = f * m->sy + y;
    m->sw = f * m->sw + 1;
    m->n_fit++;
}

void cost_model_observe(cost_model_t *m, const sched_step_t *st) {
    pthread_mutex_lock(&m->mu);
    observe_locked(m, st);
    pthread_mutex_unlock(&m->mu);
}

/* solve M z = r (n × n, in place) by Gaussian elimination with partial pivoting; false when
 * singular */
static bool solve(int n, double M[COST_N_TERMS][COST_N_TERMS], double *r) {
    for (int c = 0; c < n; c++) {
        int p = c;
        for (int i = c + 1; i < n; i++)
            if (fabs(M[i][c]) > fabs(M[p][c])) p = i;
        if (fabs(M[p][c]) < 1e-300) return false;
        if (p != c) {
            for (int j = 0; j < n; j++) {
                double t = M[c][j]; M[c][j] = M[p][j]; M[p][j] = t;
            }
            double t = r[c]; r[c] = r[p]; r[p] = t;
        }
        for (int i = c + 1; i < n; i++) {
            double f = M[i][c] / M[c][c];
            for (int j = c; j < n; j++) M[i][j] -= f * M[c][j];
            r[i] -= f * r[c];
        }
    }
    for (int i = n - 1; i >= 0; i--) {
        double s = r[i];
        for (int j = i + 1; j < n; j++) s -= M[i][j] * r[j];
        r[i] = s / M[i][i];
    }
    return true;
}

static double predict_x(const double *coef, const double *x) {
    double t = 0;
    for (int i = 0; i < COST_N_TERMS; i++) t += coef[i] * x[i];
    return t;
}

static int fit_locked(cost_model_t *m) {
    if (m->n_fit < COST_N_TERMS) return cs_error_set(CS_EAGAIN, "cost model: %ld steps, %d needed", m->n_fit, COST_N_TERMS);
    bool active[COST_N_TERMS];
    for (int i = 0; i < COST_N_TERMS; i++) active[i] = m->A[i][i] > 0; /* a term never seen says nothing */
    double coef[COST_N_TERMS];
    for (;;) {
        int idx[COST_N_TERMS], n = 0;
        for (int i = 0; i < COST_N_TERMS; i++)
            if (active[i]) idx[n++] = i;
        double M[COST_N_TERMS][COST_N_TERMS], r[COST_N_TERMS];
        for (int i = 0; i < n; i++) {
            for (int j = 0; j < n; j++) M[i][j] = m->A[idx[i]][idx[j]];
            M[i][i] *= 1 + 1e-9; /* a whisper of ridge, relative: collinear terms stay solvable */
            r[i] = m->b[idx[i]];
        }
        memset(coef, 0, sizeof coef);
        if (n && !solve(n, M, r)) return cs_error_set(CS_EINVAL, "cost model: the terms are degenerate");
        int worst = -1;
        for (int i = 0; i < n; i++) {
            coef[idx[i]] = r[i];
            if (r[i] < 0 && (worst < 0 || r[i] < coef[worst])) worst = idx[i];
        }
        if (worst < 0) break;
        active[worst] = false; /* fixed at 0: refit the rest */
    }
    cost_fit_t f = {.n_fit = m->n_fit, .fitted = true};
    memcpy(f.coef, coef, sizeof coef);
    /* R² from the sufficient statistics */
    double sse = m->yy, sst = m->yy - m->sy * m->sy / m->sw;
    for (int i = 0; i < COST_N_TERMS; i++) {
        sse -= 2 * coef[i] * m->b[i];
        for (int j = 0; j < COST_N_TERMS; j++) sse += coef[i] * m->A[i][j] * coef[j];
    }
    f.r2 = sst > 0 ? 1 - CS_MAX(sse, 0.0) / sst : 0;
    double err = 0;
    long nh = 0;
    for (int k = 0; k < m->h_n; k++) {
        if (m->hy[k] <= 0) continue;
        err += fabs(predict_x(coef, m->hx[k]) - m->hy[k]) / m->hy[k];
        nh++;
    }
    f.heldout_mape = nh ? err / (double)nh : NAN;
    f.n_heldout = nh;
    m->fit = f;
    return CS_OK;
}

int cost_model_fit(cost_model_t *m) {
    pthread_mutex_lock(&m->mu);
    int rc = fit_locked(m);
    pthread_mutex_unlock(&m->mu);
    return rc;
}

double cost_model_predict(const cost_model_t *m, const sched_step_t *st) {
    cost_fit_t f;
    cost_model_get(m, &f);
    if (!f.fitted) return 0;
    double x[COST_N_TERMS];
    cost_terms(st, x);
    return predict_x(f.coef, x);
}

void cost_model_get(const cost_model_t *m, cost_fit_t *out) {
    pthread_mutex_lock((pthread_mutex_t *)&m->mu);
    *out = m->fit;
    pthread_mutex_unlock((pthread_mutex_t *)&m->mu);
}

void cost_model_set(cost_model_t *m, const cost_fit_t *fit) {
    pthread_mutex_lock(&m->mu);
    m->fit = *fit;
    m->fit.fitted = true;
    pthread_mutex_unlock(&m->mu);
}

int cost_model_save(const cost_model_t *m, const char *path) {
    cost_fit_t f;
    cost_model_get(m, &f);
    json_t *terms = json_object();
    for (int i = 0; i < COST_N_TERMS; i++) json_object_set_new(terms, cost_term_names[i], json_real(f.coef[i]));
    json_t *o = json_pack("{s:o, s:f, s:f, s:I, s:I}", "terms", terms, "r2", f.r2, "heldout_mape",
                          isfinite(f.heldout_mape) ? f.heldout_mape : -1.0, "n_fit", (json_int_t)f.n_fit,
                          "n_heldout", (json_int_t)f.n_heldout);
    int rc = o && json_dump_file(o, path, JSON_INDENT(2)) == 0 ? CS_OK : cs_error_set(CS_EIO, "%s: cannot write", path);
    json_decref(o);
    return rc;
}

int cost_model_load(cost_model_t *m, const char *path) {
    json_error_t je;
    json_t *o = json_load_file(path, 0, &je);
    if (!o) return cs_error_set(CS_EFORMAT, "%s: line %d: %s", path, je.line, je.text);
    json_t *terms = json_object_get(o, "terms");
    cost_fit_t f = {.fitted = true};
    int rc = CS_OK;
    for (int i = 0; i < COST_N_TERMS && rc == CS_OK; i++) {
        json_t *v = json_object_get(terms, cost_term_names[i]);
        if (!json_is_number(v) || json_number_value(v) < 0)
            rc = cs_error_set(CS_EFORMAT, "%s: terms.%s: a number >= 0 (ms per unit) is needed", path, cost_term_names[i]);
        else f.coef[i] = json_number_value(v);
    }
    if (rc == CS_OK) {
        f.r2 = json_number_value(json_object_get(o, "r2"));
        f.heldout_mape = json_number_value(json_object_get(o, "heldout_mape"));
        f.n_fit = (long)json_integer_value(json_object_get(o, "n_fit"));
        f.n_heldout = (long)json_integer_value(json_object_get(o, "n_heldout"));
        cost_model_set(m, &f);
    }
    json_decref(o);
    return rc;
}
