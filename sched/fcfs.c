/* fcfs.c: first come, first served (fcfs.h). The engine hands over its lists in their order
 * (running: admission order; waiting: the queue, preempted sequences at its front), so the
 * identity permutation is that order. */
#include <stdlib.h>

#include "sched/cost.h"
#include "sched/fcfs.h"

#define REFIT_EVERY 32

typedef struct fcfs {
    sched_t s;              /* first: a sched_t * is a fcfs_t * */
    cost_model_t *cost;
    long steps;
} fcfs_t;

static void identity(sched_t *s, const sched_view_t *v, int n, int *perm) {
    (void)s;
    (void)v;
    for (int i = 0; i < n; i++) perm[i] = i;
}

static int chunk_all(sched_t *s, const sched_view_t *v, int max) {
    (void)s;
    (void)v;
    return max;
}

static bool head_of_line(sched_t *s, const sched_view_t *v) {
    (void)s;
    (void)v;
    return false;
}

/* the most recently admitted */
static int newest(sched_t *s, const sched_view_t *v, int n) {
    (void)s;
    int best = 0;
    for (int i = 1; i < n; i++)
        if (v[i].admit_order > v[best].admit_order) best = i;
    return best;
}

/* the cost model learns from every step */
static void learn(sched_t *s, const sched_step_t *st) {
    fcfs_t *f = (fcfs_t *)s;
    if (!f->cost) return;
    cost_model_observe(f->cost, st);
    if (++f->steps % REFIT_EVERY == 0) cost_model_fit(f->cost); /* CS_EAGAIN early on: fine */
}

static void fcfs_free(sched_t *s) { free(s); }

static const struct sched_i fcfs_iface = {
    .name = "fcfs",
    .order_running = identity,
    .order_waiting = identity,
    .chunk = chunk_all,
    .pass_blocked = head_of_line,
    .victim = newest,
    .feedback = learn,
    .free = fcfs_free,
};

sched_t *sched_fcfs_new(struct cost_model *cost) {
    fcfs_t *f = calloc(1, sizeof *f);
    if (!f) return NULL;
    f->s.iface = &fcfs_iface;
    f->cost = cost;
    return &f->s;
}
