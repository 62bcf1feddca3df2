/* fcfs.h: first come, first served (the engine's policy before the seam, unchanged): running
 * sequences take their chunks in admission order, waiting ones are admitted in queue order
 * (preempted ones first, at the front), each runs as many tokens as the budget allows,
 * admission stops at the first sequence the cache cannot hold (head of line), and the most
 * recently admitted running sequence is preempted first. */
#ifndef CS_SCHED_FCFS_H
#define CS_SCHED_FCFS_H

#include "engine/sched.h"

struct cost_model;

/* COST (optional, the caller's; it must outlive the policy) learns from every step's
 * feedback and is refitted every 32 steps, whatever the policy (sched/cost.h). NULL when
 * out of memory; free with sched_free. */
sched_t *sched_fcfs_new(struct cost_model *cost);

#endif
