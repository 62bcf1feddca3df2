/* cost.h: the cost model of one engine iteration: its latency from the batch's composition,
 * linear in a few terms CaraServe measured to matter (docs/design/scheduler.md):
 *
 *   t = c0                      fixed per iteration (the pool's wake-ups, norms, sampling)
 *     + c1 · prefill tokens     base GEMMs, compute-bound
 *     + c2 · decode rows        base GEMV rows (the weights stream once: small per row)
 *     + c3 · Σ_adapters rank    every distinct adapter streams its own weights (MBGMV's Σ rank,
 *                               the CPU's bytes)
 *     + c4 · rows · max rank    BGMV pads every row to the batch's largest rank (GPU)
 *     + c5 · Σ_rows rank        each row's own LoRA work
 *
 * fitted by least squares with non-negative coefficients (a term that does not help is
 * dropped: set to 0, never negative, so predictions stay monotone in the load), from the
 * engine's step feedback (sched_step_t), with optional exponential forgetting so it follows
 * a machine whose speed drifts. Every fifth step is held out of the fit: the error on those
 * is the model's honest error. Saved and loaded as JSON. */
#ifndef CS_SCHED_COST_H
#define CS_SCHED_COST_H

#include "engine/sched.h"

enum { COST_N_TERMS = 6 };
extern const char *const cost_term_names[COST_N_TERMS]; /* "fixed", "prefill_tokens", ... */

typedef struct cost_model cost_model_t;

typedef struct cost_fit {
    double coef[COST_N_TERMS];  /* ms per unit of each term */
    double r2;                  /* on the steps it was fitted on (weighted) */
    double heldout_mape;        /* mean |predicted - measured| / measured on held-out steps */
    long n_fit, n_heldout;      /* steps behind the fit and the held-out error */
    bool fitted;
} cost_fit_t;

/* the terms of a step (cost_term_names order) */
void cost_terms(const sched_step_t *st, double x[COST_N_TERMS]);

/* FORGET in (0, 1]: each new step multiplies the weight of the older ones by it (1: none).
 * NULL when out of memory. */
cost_model_t *cost_model_new(double forget);
void cost_model_free(cost_model_t *m);
/* One step's composition and measured time (st->forward_ms). */
void cost_model_observe(cost_model_t *m, const sched_step_t *st);
/* Refit from what was observed: CS_EAGAIN with fewer steps than terms. */
int cost_model_fit(cost_model_t *m);
/* Predicted milliseconds of an iteration of composition ST (fitted or loaded; 0 before). */
double cost_model_predict(const cost_model_t *m, const sched_step_t *st);
void cost_model_get(const cost_model_t *m, cost_fit_t *out);
/* Set the coefficients (a file, a test); the fit statistics become those given. */
void cost_model_set(cost_model_t *m, const cost_fit_t *fit);
/* JSON: {"terms": {name: coef, ...}, "r2": , "heldout_mape": , "n_fit": , "n_heldout": } */
int cost_model_save(const cost_model_t *m, const char *path);
int cost_model_load(cost_model_t *m, const char *path);

#endif
