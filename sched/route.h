/* route.h: which replica a request goes to (`caraserve router`). A replica is seen through
 * its GET /v1/state (running and waiting sequences with their adapters' ranks, its
 * iteration cost model, sched/cost.h) plus what this router sent it since that state was
 * taken. The policies:
 *
 *  - round-robin: the next healthy replica in turn;
 *  - least-loaded: the fewest requests in flight through this router (ties: in turn);
 *  - rank-aware (CaraServe's rule, ../README "Rank-aware scheduling"):
 *        Δprefill = Pre(queue + req) − Pre(queue)      one iteration prefilling the queue
 *        Δdecode  = Dec(running + req) − Dec(running)  one decode iteration of the running set
 *        cost     = Δprefill / expected output tokens + Δdecode
 *                   (infinite when Dec(running + req) exceeds the request's TPOT SLO)
 *        score    = cost × (running + queued requests)
 *    lowest score wins; ties (an idle replica scores 0) go to the lower cost, then the fewer
 *    requests in flight, then in turn. When every replica would break the SLO, the one with
 *    the one where it would finish first takes it, Pre(queue + req) + expected output ×
 *    Dec(running + req) (its queue counts: a long one is not where a late request catches
 *    up), ties to the fewer requests: a request is never refused for its SLO. A replica
 *    whose cost model has no fit yet is priced by its load alone.
 *
 * Every policy passes over a paused replica (POST /v1/pause: it holds what it gets until
 * resumed) while some healthy replica is not paused; when all are paused, all are in.
 *
 * Pure functions over snapshots: no I/O, no locks (the router holds its own). */
#ifndef CS_SCHED_ROUTE_H
#define CS_SCHED_ROUTE_H

#include <stdbool.h>

#include "sched/cost.h"

typedef enum route_policy { ROUTE_RANK_AWARE, ROUTE_ROUND_ROBIN, ROUTE_LEAST_LOADED } route_policy;

/* "rank-aware" | "round-robin" | "least-loaded"; -1 for anything else */
int route_policy_parse(const char *s);
const char *route_policy_name(route_policy p);

/* one sequence on a replica (running or waiting) */
typedef struct route_seq {
    const char *adapter;        /* NULL: the base model */
    int rank;                   /* the adapter's max rank (0: base; < 0: unknown, priced as 0) */
    long rank_sum;
    int prefill_left;           /* prompt tokens whose KV is not computed yet */
    bool running;
} route_seq_t;

typedef struct route_replica {
    bool healthy;
    bool paused;                /* its /v1/state says so: new work waits there until resumed */
    bool fitted;                /* coef is a fit (else rank-aware prices by load alone) */
    double coef[COST_N_TERMS];  /* ms per unit of each term (cost_term_names) */
    const route_seq_t *seqs;
    int n_seqs;
    int n_requests;             /* running + queued requests (the score's load factor) */
    int in_flight;              /* requests this router has open on it */
} route_replica_t;

/* the request being placed */
typedef struct route_req {
    const char *adapter;        /* NULL: the base model */
    int rank;                   /* 0: base, < 0: unknown (priced as 0) */
    int prompt_tokens;          /* an estimate is fine (the router has no tokenizer) */
    int n;                      /* samples: rows it adds to each decode iteration */
    int expected_output;        /* tokens it is expected to generate (> 0) */
    double slo_tpot_ms;         /* 0: tpot_factor × the base model's iteration of that size */
} route_req_t;

/* What rank-aware computes for one replica (for logs, tests and /v1/state). */
typedef struct route_eval {
    double pre_queue, pre_with;  /* Pre(queue), Pre(queue + req), ms */
    double dec_running, dec_with; /* Dec(running), Dec(running + req), ms */
    double tpot_slo;             /* the TPOT bound it was held to, ms */
    double cost, score;          /* INFINITY when the SLO breaks */
} route_eval_t;

/* rank-aware's numbers for replica R (tpot_factor 0: 1.5) */
void route_evaluate(const route_replica_t *r, const route_req_t *q, double tpot_factor, route_eval_t *out);

/* The replica to send Q to, of R[0 .. n); -1 when none is healthy. *rr is the round-robin
 * cursor (kept by the caller between calls: where the turn starts). */
int route_pick(route_policy p, const route_replica_t *r, int n, const route_req_t *q, double tpot_factor,
               unsigned *rr);

#endif
