/* slo.h: the rank-aware SLO policy (`--scheduler slo`). With the iteration cost model
 * (sched/cost.h) it predicts each iteration's latency as the batch is formed, and:
 *
 *  - keeps every running sequence within its TPOT SLO: a prefill chunk (continuing or new)
 *    is cut to what still fits under the tightest TPOT SLO of the batch's decode rows;
 *  - offers admission by slack: preempted sequences first, then by deadline (submission +
 *    TTFT SLO, or + default_ttft_ms without one) minus the predicted time of its prefill;
 *  - does not admit a request whose adapter (a new distinct adapter: its Σ rank, the rows
 *    padded to a larger max rank) or prompt would push the iteration past that SLO, while
 *    others that fit go ahead: requests of an adapter already in the batch cost no new
 *    adapter term, so they group by themselves;
 *  - preempts, when it must, the running sequence with the most slack (no SLO of its own
 *    first, then the most recently admitted);
 *  - admits, whatever the prediction, a request with a TTFT SLO of its own that would miss
 *    it by waiting one more iteration (its deadline is nearer than this iteration and twice
 *    its own prefill): a TTFT it can still meet outweighs one slower iteration for others;
 *  - starves nobody: a sequence that has waited starve_ms past its deadline is admitted
 *    whatever the prediction, and admission stops behind it while it does not fit.
 *
 * A request's TPOT SLO is its own (`slo.tpot_ms`), else tpot_factor (1.5, CaraServe's
 * definition) times the predicted time of an iteration of the base model alone with the
 * same number of decode rows. Until the cost model has a fit, the policy behaves as fcfs. */
#ifndef CS_SCHED_SLO_H
#define CS_SCHED_SLO_H

#include "engine/sched.h"

struct cost_model;

typedef struct sched_slo_params {
    struct cost_model *cost;    /* required: the caller's, learns from every step */
    double tpot_factor;         /* default TPOT SLO over the base model's (0: 1.5) */
    double default_ttft_ms;     /* the deadline of a request without a TTFT SLO (0: 10000) */
    double starve_ms;           /* how long past its deadline a sequence may be held back (0: 2000) */
    int min_chunk;              /* a prefill chunk is never cut below this (0: 16) */
    double (*now_ms)(void *user); /* the clock (NULL: cs_time_ms); tests script it */
    void *user;
} sched_slo_params_t;

/* NULL with a message (no cost model, out of memory); free with sched_free */
sched_t *sched_slo_new(const sched_slo_params_t *p);

/* A request's "slo" object: {"ttft_ms": X, "tpot_ms": Y}, both optional, each a number > 0
 * (null or absent: none). -1 with a message in ERR for anything else (an unknown key
 * included); 0 otherwise, *ttft_ms / *tpot_ms set (0: none). V NULL or null: 0, none. */
struct json_t;
int sched_parse_slo(struct json_t *v, double *ttft_ms, double *tpot_ms, char *err, size_t errlen);

#endif
