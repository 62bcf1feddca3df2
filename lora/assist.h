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
} lora_assist_params_t;

enum { LORA_ASSIST_MODS = 3 }; /* modules sharing one input (q/k/v; gate/up) */

typedef struct lora_assist_job {
    const float *x;         /* n rows of ld_x floats (host), valid once *x_flag >= x_value */
    int n, ld_x;
    int n_mods;
    const lora_module_t *mods[LORA_ASSIST_MODS];
    float *y[LORA_ASSIST_MODS];   /* n rows of mods[k]->d_out floats (host): := the LoRA term */
    const uint32_t *x_flag;
    uint32_t x_value;
    const uint32_t *w_flag; /* optional: the modules' weights are in host memory once *w_flag >=
                             * w_value (an adapter streaming in from disk: &host_layers, layer
                             * + 1); LORA_HOST_FAILED there makes the terms zeros */
    uint32_t w_value;
    uint32_t *done;         /* each part adds 1 when its rows are written */
} lora_assist_job_t;

int lora_assist_new(const lora_assist_params_t *p, lora_assist_t **out);
/* Waits for the jobs queued (their flags must come), then stops the workers. NULL: nothing. */
void lora_assist_free(lora_assist_t *a);
int lora_assist_threads(const lora_assist_t *a);

/* Queue JOB (copied); returns the parts it was split into (1 ..), which *done will be raised
 * by, or CS_ENOMEM. Never blocks on the job's flag. */
int lora_assist_submit(lora_assist_t *a, const lora_assist_job_t *job);

typedef struct lora_assist_stats {
    uint64_t jobs, parts, rows;   /* module rows: a job of 3 modules over 10 rows counts 30 */
    double busy_ms;               /* workers' compute time, summed */
    double wait_ms;               /* workers' time waiting for the device's input flag */
} lora_assist_stats_t;
void lora_assist_get_stats(lora_assist_t *a, lora_assist_stats_t *st);

/* The term itself, on the calling thread (the workers' kernel; tests hold it to a plain
 * loop): Y[n, d_out] := scale · (X[n, ld_x] · Aᵀ) · Bᵀ; SCRATCH holds rank * (n + d_in + d_out)
 * floats. */
void lora_assist_term(float *y, const float *x, int n, int ld_x, const lora_module_t *m, float *scratch);

#endif
