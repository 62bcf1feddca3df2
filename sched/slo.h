/* slo.h: the rank-aware SLO policy (`--scheduler slo`). With the iteration cost model
 * (sched/cost.h) it predicts each iteration's latency as the batch is formed, and:
 *
 *  - keeps every running sequence within its TPOT SLO: a prefill chunk (continuing or new)
 *    is cut to what still fits under the tightest TPOT bound of the batch's decode rows; TPOT
 *    being a mean, a row with an SLO of its own is bound by its budget (its next token is due
 *    SLO × tokens so far after its first), never by less than its SLO;
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
 * same number of decode rows. Until the cost model has a fit, the policy behaves as fcfs.
 *
 * Predictions are the cost model's times its drift: the ratio of measured to predicted
 * iteration times over about the last 16 steps (the model itself follows the machine over
 * thousands), so a machine that slows for a while is priced as it is now. Every TPOT bound is
 * planned to headroom (0.9) × the SLO: what a prediction misses by comes out of the rest. */
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
    double headroom;            /* the fraction of a TPOT SLO the policy plans to (0: 0.9; at most 1) */
    double (*now_ms)(void *user); /* the clock (NULL: cs_time_ms); tests script it */
    void *user;
} sched_slo_params_t;

/* NULL with a message (no cost model, out of memory); free with sched_free */
sched_t *sched_slo_new(const sched_slo_params_t *p);

/* A request's "slo" object: {"ttft_ms": X, "tpot_ms": Y}, both optional, each a number > 0
 * (null or absent: none). CS_EINVAL with cs_error_set's message for anything else (an
 * unknown key included); CS_OK otherwise, *ttft_ms / *tpot_ms set (0: none). V NULL or null:
 * CS_OK, none. */
struct json_t;
int sched_parse_slo(struct json_t *v, double *ttft_ms, double *tpot_ms);

/* Per-model SLOs (`serve --adapter-slos FILE`): a JSON object from the names requests give as
 * their model (an adapter's, or the base model's served name) to an "slo" object as above,
 * parsed by sched_parse_slo; "*" is the entry of every name without one of its own (the base
 * model's included). A bound given as null, or a whole entry null, means none: "*" does not
 * fill it in. A name nothing serves (yet) is fine: adapters loaded later find their entry. */
typedef struct sched_slo_table sched_slo_table_t;
/* CS_OK with *out, or a CS_E* code with cs_error_set's message (*out NULL): not an object, an
 * entry sched_parse_slo refuses (the message names its key), an empty name; _load also:
 * unreadable, not JSON, a name twice */
int sched_slo_table_parse(struct json_t *root, sched_slo_table_t **out);
int sched_slo_table_load(const char *path, sched_slo_table_t **out);
void sched_slo_table_free(sched_slo_table_t *t);
/* A request for model NAME: each bound the request left at 0 (none of its own) comes from
 * NAME's entry, else from "*", else stays 0 (the policy's defaults). T NULL: nothing changes.
 * Read-only: any number of threads at once. */
void sched_slo_table_apply(const sched_slo_table_t *t, const char *name, double *ttft_ms, double *tpot_ms);

#endif
