/* threadpool.c: see threadpool.h. A run is published as a new generation in one atomic
 * word (generation | task count | next task); workers claim tasks with a compare-and-swap
 * on that word, so a worker that wakes late can never claim a task of a newer run. The caller
 * returns as soon as every task is done: a worker whose vCPU was descheduled does not hold
 * up the run (every decode op is a run). Run parameters live in two alternating slots; a
 * slot is only rewritten two runs later, when all of its tasks have completed. */
#include "cpu_kernels/threadpool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#include "base/common.h"

#define SPIN_ITERS 20000

struct run_slot {
    threadpool_fn fn;
    void *ctx;
};

/* the work word: generation (24 bits) | task count (20 bits) | next task (20 bits) */
#define TASK_BITS 20
#define TASK_MASK ((1u << TASK_BITS) - 1)
#define GEN_MASK 0xffffffu
static inline uint32_t gen_of(uint64_t w) { return (uint32_t)(w >> (2 * TASK_BITS)); }
static inline uint32_t ntasks_of(uint64_t w) { return (uint32_t)(w >> TASK_BITS) & TASK_MASK; }
static inline uint32_t next_of(uint64_t w) { return (uint32_t)w & TASK_MASK; }

struct threadpool {
    int n;                      /* threads including the caller */
    pthread_t *threads;
    pthread_mutex_t mu;
    pthread_cond_t wake;        /* workers: a new generation */
    pthread_cond_t done_cv;     /* caller: all tasks done */
    _Atomic uint64_t work;      /* see gen_of / ntasks_of / next_of */
    struct run_slot slot[2];    /* parameters of generation g in slot[g & 1] */
    atomic_uint done;           /* tasks of the current run finished */
    atomic_int sleepers;
    atomic_bool caller_sleeping;
    atomic_bool stop;
};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Claim and run tasks of generation `gen` until none is left or a newer run started. */
static void run_tasks(threadpool_t *tp, uint32_t gen, int thread) {
    uint64_t w = atomic_load_explicit(&tp->work, memory_order_acquire);
    for (;;) {
        if (gen_of(w) != gen) return;
        uint32_t t = next_of(w), n_tasks = ntasks_of(w);
        if (t >= n_tasks) return;
        if (!atomic_compare_exchange_weak_explicit(&tp->work, &w, w + 1, memory_order_acq_rel, memory_order_acquire))
            continue; /* w was reloaded */
        /* task t of this generation is ours and not done, so the caller is still inside this
         * run and the slot cannot be rewritten under us */
        const struct run_slot *s = &tp->slot[gen & 1];
        s->fn(s->ctx, (int)t, thread);
        if (atomic_fetch_add(&tp->done, 1) + 1 == n_tasks && atomic_load(&tp->caller_sleeping)) {
            pthread_mutex_lock(&tp->mu);
            pthread_cond_signal(&tp->done_cv);
            pthread_mutex_unlock(&tp->mu);
        }
        w = atomic_load_explicit(&tp->work, memory_order_acquire);
    }
}

struct worker_arg { threadpool_t *tp; int id; };

static void *worker_main(void *p) {
    struct worker_arg *wa = p;
    threadpool_t *tp = wa->tp;
    int id = wa->id;
    free(wa);
    uint32_t seen = 0; /* the generation at creation: a run may start before we do */
    for (;;) {
        int spins = 0;
        uint32_t g;
        while ((g = gen_of(atomic_load_explicit(&tp->work, memory_order_acquire))) == seen && !atomic_load(&tp->stop)) {
            if (++spins < SPIN_ITERS) { cpu_relax(); continue; }
            pthread_mutex_lock(&tp->mu);
            atomic_fetch_add(&tp->sleepers, 1);
            while (gen_of(atomic_load(&tp->work)) == seen && !atomic_load(&tp->stop)) pthread_cond_wait(&tp->wake, &tp->mu);
            atomic_fetch_sub(&tp->sleepers, 1);
            pthread_mutex_unlock(&tp->mu);
        }
        if (atomic_load(&tp->stop)) return NULL;
        seen = g;
        run_tasks(tp, g, id);
    }
}

threadpool_t *threadpool_new(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    threadpool_t *tp = calloc(1, sizeof *tp);
    if (!tp) return NULL;
    tp->n = n_threads;
    pthread_mutex_init(&tp->mu, NULL);
    pthread_cond_init(&tp->wake, NULL);
    pthread_cond_init(&tp->done_cv, NULL);
    tp->threads = calloc((size_t)n_threads, sizeof *tp->threads);
    if (!tp->threads) goto err;
    for (int i = 1; i < n_threads; i++) {
        struct worker_arg *wa = malloc(sizeof *wa);
        if (!wa) goto err;
        *wa = (struct worker_arg){tp, i};
        if (pthread_create(&tp->threads[i], NULL, worker_main, wa) != 0) { free(wa); tp->n = i; goto err; }
    }
    return tp;
err:
    threadpool_free(tp);
    return NULL;
}

void threadpool_free(threadpool_t *tp) {
    if (!tp) return;
    pthread_mutex_lock(&tp->mu);
    atomic_store(&tp->stop, true);
    pthread_cond_broadcast(&tp->wake);
    pthread_mutex_unlock(&tp->mu);
    for (int i = 1; i < tp->n; i++)
        if (tp->threads && tp->threads[i]) pthread_join(tp->threads[i], NULL);
    free(tp->threads);
    pthread_mutex_destroy(&tp->mu);
    pthread_cond_destroy(&tp->wake);
    pthread_cond_destroy(&tp->done_cv);
    free(tp);
}


void threadpool_run(threadpool_t *tp, int n_tasks, threadpool_fn fn, void *ctx) {
    if (n_tasks <= 0) return;
    if (!tp || tp->n == 1 || n_tasks == 1) {
        for (int t = 0; t < n_tasks; t++) fn(ctx, t, 0);
        return;
    }
    CS_ASSERT((unsigned)n_tasks <= TASK_MASK);
    uint32_t gen = (gen_of(atomic_load(&tp->work)) + 1) & GEN_MASK;
    /* slot gen & 1 last served generation gen - 2, whose tasks all completed */
    tp->slot[gen & 1] = (struct run_slot){fn, ctx};
    atomic_store(&tp->done, 0);
    pthread_mutex_lock(&tp->mu);
    atomic_store(&tp->work, (uint64_t)gen << (2 * TASK_BITS) | (uint64_t)n_tasks << TASK_BITS);
    if (atomic_load(&tp->sleepers) > 0) pthread_cond_broadcast(&tp->wake);
    pthread_mutex_unlock(&tp->mu);
    run_tasks(tp, gen, 0);
    int spins = 0;
    while (atomic_load_explicit(&tp->done, memory_order_acquire) < (unsigned)n_tasks) {
        if (++spins < SPIN_ITERS) { cpu_relax(); continue; }
        pthread_mutex_lock(&tp->mu);
        atomic_store(&tp->caller_sleeping, true);
        while (atomic_load(&tp->done) < (unsigned)n_tasks) pthread_cond_wait(&tp->done_cv, &tp->mu);
        atomic_store(&tp->caller_sleeping, false);
        pthread_mutex_unlock(&tp->mu);
    }
}
