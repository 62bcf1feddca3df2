/* assist.h: the host LoRA workers of the cold start (CaraServe's CPU-assisted prefill).
 *
 * While an adapter's layers stream to its device slot, the LoRA term of a row whose layer
 * has not arrived is computed here, from the adapter's host copy: the device copies the
 * layer's input rows to pinned host memory and then raises a flag (backend get_signal); a
 * worker waiting on that flag computes scale · (x · Aᵀ) · Bᵀ with OpenBLAS, writes it to
 * host memory and counts its part done; the device waits for the count and adds the result
 * (backend wait_add). The workers are a pool of their own (not the CPU backend's), each
 * pinned to a core when asked; a job's rows are split over them, at most max_rows a part.
 * Jobs start in submission order; a worker blocks only on its job's flag. */
#ifndef CS_LORA_ASSIST_H
#define CS_LORA_ASSIST_H

#include "base/common.h"
#include "lora/peft.h"

typedef struct lora_assist lora_assist_t;

typedef struct lora_assist_params {
    int n_threads;          /* workers; 0: 1 */
    bool pin;               /* pin worker i to CPU (ncpu - 1 - i) */
    int max_rows;           /* rows of a job one worker takes at most per part; 0: an equal split */
    cs_dtype terms_dtype;   /* of the terms the engine asks for (lora_assist_terms_dtype): F32 or BF16 */
} lora_assist_params_t;

enum { LORA_ASSIST_MODS = 3 }; /* modules sharing one input (q/k/v; gate/up) */
enum { LORA_ASSIST_BEAT_MS = 100 };

typedef struct lora_assist_job {
    const float *x;         /* n rows of ld_x floats (host), valid once *x_flag >= x_value */
    int n, ld_x;
    int n_mods;
    const lora_module_t *mods[LORA_ASSIST_MODS];
    void *y[LORA_ASSIST_MODS];    /* n rows of mods[k]->d_out values (host): := the LoRA term */
    cs_dtype y_dtype;             /* of y: F32, or BF16 (computed in F32, rounded to nearest even) */
    const uint32_t *x_flag;
    uint32_t x_value;
    const uint32_t *w_flag; /* optional: the modules' weights are in host memory once *w_flag >=
                             * w_value (an adapter streaming in from disk: &host_layers, layer
                             * + 1); LORA_HOST_FAILED there makes the terms zeros */
    uint32_t w_value;
    uint32_t *done;         /* each part adds 1 when its rows are written */
    uint32_t *alive;        /* optional: raised every LORA_ASSIST_BEAT_MS while a worker waits for
                             * w_flag (the disk), so a device waiting on done with a deadline
                             * knows the host is still at work */
} lora_assist_job_t;

int lora_assist_new(const lora_assist_params_t *p, lora_assist_t **out);
/* Waits for the jobs queued (their flags must come), then stops the workers. NULL: nothing. */
void lora_assist_free(lora_assist_t *a);
int lora_assist_threads(const lora_assist_t *a);
cs_dtype lora_assist_terms_dtype(const lora_assist_t *a);

/* Queue JOB (copied); returns the parts it was split into (1 ..), which *done will be raised
 * by, or CS_ENOMEM. Never blocks on the job's flag. */
int lora_assist_submit(lora_assist_t *a, const lora_assist_job_t *job);

typedef struct lora_assist_stats {
    uint64_t jobs, parts, rows;   /* module rows: a job of 3 modules over 10 rows counts 30 */
    double busy_ms;               /* workers' compute time, summed */
    double wait_ms;               /* workers' time waiting for the device's input flag */
} lora_assist_stats_t;
void lora_assist_get_stats(lora_assist_t *a, lora_assist_stats_t *st);

/* The byte model of the cold start (--cold-start auto): what the link to the device carries
 * for a request of ROWS rows whose adapter A has ARRIVED of its layers in its device slot.
 * cpu-assist sends, for every layer not there, each adapted group's input rows out (q/k/v
 * share one, then o, gate/up, down; F32) and every adapted projection's terms back (TERMS:
 * F32 or BF16); wait streams the rest of the slot first (A and Bᵀ of every module, in the
 * adapter's dtype), and then runs with no host traffic. Both go over the same link, so the
 * fewer bytes finish first: a long prompt waits (its rows outweigh the adapter), a short one
 * is assisted. */
typedef struct lora_cold_cost {
    uint64_t assist_bytes, wait_bytes;
} lora_cold_cost_t;
void lora_cold_cost(const lora_adapter_t *a, int arrived, int rows, cs_dtype terms, lora_cold_cost_t *c);
static inline bool lora_cold_prefer_assist(const lora_cold_cost_t *c) { return c->assist_bytes <= c->wait_bytes; }

/* The term itself, on the calling thread (the workers' kernel; tests hold it to a plain
 * loop): Y[n, d_out] := scale · (X[n, ld_x] · Aᵀ) · Bᵀ; SCRATCH holds rank * (n + d_in + d_out)
 * floats. */
void lora_assist_term(float *y, const float *x, int n, int ld_x, const lora_module_t *m, float *scratch);

#endif
