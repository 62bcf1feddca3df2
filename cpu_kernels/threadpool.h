/* threadpool.h: a fixed pool of worker threads for the CPU backend. threadpool_run hands
 * out task indices 0..n_tasks-1 to the workers and the calling thread and returns when all
 * are done. Workers spin briefly between runs (decode issues many short ops) and then sleep. */
#ifndef CS_THREADPOOL_H
#define CS_THREADPOOL_H

typedef struct threadpool threadpool_t;
typedef void (*threadpool_fn)(void *ctx, int task, int thread);

threadpool_t *threadpool_new(int n_threads); /* n_threads includes the caller */
void threadpool_free(threadpool_t *tp);
void threadpool_run(threadpool_t *tp, int n_tasks, threadpool_fn fn, void *ctx);

#endif
