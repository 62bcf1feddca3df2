/* sched.h: the scheduling policy seam. The engine's step (engine/engine.c) owns the
 * mechanism: KV blocks, device slots, the sequence cap, the token budget, preemption and the
 * forward pass. Every choice among what those allow is the policy's, asked through this
 * vtable (as the backend is asked through backend.h): in which order running sequences take
 * their chunks and waiting ones are offered admission, how many tokens each runs now, whether
 * admission goes on past a sequence that did not fit, which running sequence is preempted
 * when the cache is short. After each forward the policy is told the batch's composition
 * and the measured time. Policies live in sched/ (a layer above the engine); the engine
 * never includes them: the builder makes one and passes it in engine_params_t.
 *
 * The policy sees read-only views, rebuilt every step; it must not keep pointers into them.
 * All calls come from the engine thread. */
#ifndef CS_ENGINE_SCHED_H
#define CS_ENGINE_SCHED_H

#include <stdbool.h>
#include <stdint.h>

#include "lora/peft.h"

typedef struct sched sched_t;

typedef enum sched_tier {
    SCHED_TIER_BASE = 0,    /* no adapter */
    SCHED_TIER_UNKNOWN,     /* an adapter not acquired yet (on disk, loading, or not probed) */
    SCHED_TIER_HOST,        /* in host memory */
    SCHED_TIER_DEVICE,      /* in a device slot */
} sched_tier;

/* One sequence, as the policy sees it. */
typedef struct sched_view {
    uint64_t req_id;
    int index;              /* sample index within its request */
    bool running;           /* in the running set (else waiting: new or preempted) */
    bool admitted_once;     /* ran before (a preempted sequence, a fork's sample) */
    uint64_t admit_order;   /* larger: admitted later */
    double t_submit_ms;     /* cs_time_ms() at submission */
    double t_first_ms;      /* cs_time_ms() of its first generated token (0: none yet) */
    double slo_ttft_ms, slo_tpot_ms; /* the request's SLOs; 0: none */
    int n_prompt;           /* prompt tokens */
    int n_tokens;           /* prompt + generated so far */
    int n_computed;         /* tokens whose KV is in the cache */
    int n_generated;
    int max_tokens;
    int n;                  /* samples of its request */
    const char *adapter;    /* NULL: the base model */
    bool lora_known;        /* lora holds the adapter's shape (probed at registration) */
    lora_adapter_info_t lora;
    sched_tier tier;
} sched_view_t;

/* What a request does whose adapter slot is still streaming in (the cold start). */
enum { SCHED_COLD_DEFAULT = 0, SCHED_COLD_ASSIST, SCHED_COLD_WAIT };

/* One forward pass, after it ran. */
typedef struct sched_step {
    int n_seqs;             /* sequences in the batch */
    int prefill_tokens;     /* rows that were prompt (or recomputed) tokens */
    int decode_rows;        /* rows that were one new token of a generating sequence */
    int n_adapters;         /* distinct adapters in the batch */
    long rank_sum;          /* Σ over them of their max rank */
    int max_rank;
    long row_rank_sum;      /* Σ over the batch's rows of their adapter's max rank (0: base) */
    double forward_ms;      /* the step's measured time */
} sched_step_t;

struct sched_i {
    const char *name;
    /* perm[0 .. n) := the order in which the running sequences V take their chunks (a
     * permutation of 0 .. n-1). */
    void (*order_running)(sched_t *s, const sched_view_t *v, int n, int *perm);
    /* perm[0 .. n) := the order in which the waiting sequences V are offered admission. */
    void (*order_waiting)(sched_t *s, const sched_view_t *v, int n, int *perm);
    /* Tokens of V to run this iteration, 1 .. max (max: the budget left and what V has to
     * compute); 0: not this iteration. */
    int (*chunk)(sched_t *s, const sched_view_t *v, int max);
    /* V could not be admitted (no KV room): offer admission to the sequences after it (true)
     * or stop admitting this iteration (false: head-of-line, first come first served). */
    bool (*pass_blocked)(sched_t *s, const sched_view_t *v);
    /* The cache is short: which running sequence of V[0 .. n) to preempt (an index). */
    int (*victim)(sched_t *s, const sched_view_t *v, int n);
    /* optional: SCHED_COLD_* for V, whose adapter's slot is still streaming in (DEFAULT: the
     * engine's --cold-start) */
    int (*cold_start)(sched_t *s, const sched_view_t *v);
    /* optional: after every forward pass */
    void (*feedback)(sched_t *s, const sched_step_t *st);
    void (*free)(sched_t *s);
};

struct sched {
    const struct sched_i *iface;
    void *ctx;
};

static inline const char *sched_name(const sched_t *s) { return s->iface->name; }
static inline void sched_free(sched_t *s) { if (s) s->iface->free(s); }

#endif
