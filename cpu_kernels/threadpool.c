/* threadpool.c: see threadpool.h. One generation counter wakes the workers; tasks are
 * claimed with an atomic counter so uneven tasks balance themselves. */
#include "cpu_kernels/threadpool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "engine/common.h"

#define SPIN_ITERS 20000

struct threadpool {
    int n;                      /* threads including the caller */
    pthread_t *threads;
    pthread_mutex_t mu;
    pthread_cond_t wake;
    pthread_cond_t done_cv;
    atomic_uint gen;            /* bumped for each run */
    atomic_int next_task;
    atomic_int pending;         /* workers still inside the current run */
    atomic_int sleepers;
    int n_tasks;
    threadpool_fn fn;
    void *ctx;
    atomic_bool stop;
};

struct worker_arg { threadpool_t *tp; int id; };

static void run_tasks(threadpool_t *tp, int id) {
    for (;;) {
        int t = atomic_fetch_add(&tp->next_task, 1);
        if (t >= tp->n_tasks) break;
        tp->fn(tp->ctx, t, id);
    }
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void *worker_main(void *p) {
    struct worker_arg *wa = p;
    threadpool_t *tp = wa->tp;
    int id = wa->id;
    free(wa);
    unsigned seen = 0; /* the generation at creation: a run may start before we do */
    for (;;) {
        int spins = 0;
        while (atomic_load_explicit(&tp->gen, memory_order_acquire) == seen && !atomic_load(&tp->stop)) {
            if (++spins < SPIN_ITERS) { cpu_relax(); continue; }
            pthread_mutex_lock(&tp->mu);
            atomic_fetch_add(&tp->sleepers, 1);
            while (atomic_load(&tp->gen) == seen && !atomic_load(&tp->stop)) pthread_cond_wait(&tp->wake, &tp->mu);
            atomic_fetch_sub(&tp->sleepers, 1);
            pthread_mutex_unlock(&tp->mu);
        }
        if (atomic_load(&tp->stop)) return NULL;
        seen = atomic_load(&tp->gen);
        run_tasks(tp, id);
        if (atomic_fetch_sub_explicit(&tp->pending, 1, memory_order_acq_rel) == 1) {
            pthread_mutex_lock(&tp->mu);
            pthread_cond_signal(&tp->done_cv);
            pthread_mutex_unlock(&tp->mu);
        }
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

int threadpool_size(const threadpool_t *tp) { return tp ? tp->n : 1; }

void threadpool_run(threadpool_t *tp, int n_tasks, threadpool_fn fn, void *ctx) {
    if (n_tasks <= 0) return;
    if (!tp || tp->n == 1 || n_tasks == 1) {
        for (int t = 0; t < n_tasks; t++) fn(ctx, t, 0);
        return;
    }
    tp->fn = fn;
    tp->ctx = ctx;
    tp->n_tasks = n_tasks;
    atomic_store(&tp->next_task, 0);
    atomic_store(&tp->pending, tp->n - 1);
    pthread_mutex_lock(&tp->mu);
    atomic_fetch_add_explicit(&tp->gen, 1, memory_order_release);
    if (atomic_load(&tp->sleepers) > 0) pthread_cond_broadcast(&tp->wake);
    pthread_mutex_unlock(&tp->mu);
    run_tasks(tp, 0);
    int spins = 0;
    while (atomic_load_explicit(&tp->pending, memory_order_acquire) > 0) {
        if (++spins < SPIN_ITERS) { cpu_relax(); continue; }
        pthread_mutex_lock(&tp->mu);
        while (atomic_load(&tp->pending) > 0) pthread_cond_wait(&tp->done_cv, &tp->mu);
        pthread_mutex_unlock(&tp->mu);
    }
}
