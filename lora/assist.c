/* assist.c: see assist.h. */
#define _GNU_SOURCE
#include "lora/assist.h"

#include <cblas.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct part {
    lora_assist_job_t job;  /* the job, with x, n and y[] narrowed to the part's rows */
    struct part *next;
} part_t;

struct lora_assist {
    lora_assist_params_t p;
    pthread_t *threads;
    int n_started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    part_t *head, *tail;
    bool stopping;
    lora_assist_stats_t st; /* under mu */
};

void lora_assist_term(float *y, const float *x, int n, int ld_x, const lora_module_t *m, float *scratch) {
    int r = m->rank, din = m->d_in, dout = m->d_out;
    float *t = scratch, *a = t + (size_t)r * n, *b = a + (size_t)r * din;
    const float *pa = m->a, *pb = m->b;
    if (m->dtype == CS_DTYPE_BF16) { /* widened: the device's kernels widen them the same way */
        cs_to_f32(a, m->a, CS_DTYPE_BF16, (size_t)r * din);
        cs_to_f32(b, m->b, CS_DTYPE_BF16, (size_t)r * dout);
        pa = a;
        pb = b;
    }
    /* t = x · Aᵀ (n, r); y = scale · t · Bᵀ (n, d_out), B (d_out, r) */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, r, din, 1.0f, x, ld_x, pa, din, 0.0f, t, r);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, dout, r, m->scale, t, r, pb, r, 0.0f, y, dout);
}

static void *worker_main(void *arg) {
    lora_assist_t *a = arg;
    float *scratch = NULL;
    size_t scap = 0;
    pthread_mutex_lock(&a->mu);
    for (;;) {
        while (!a->head && !a->stopping) pthread_cond_wait(&a->cv, &a->mu);
        if (!a->head) break;
        part_t *pt = a->head;
        a->head = pt->next;
        if (!a->head) a->tail = NULL;
        pthread_mutex_unlock(&a->mu);
        lora_assist_job_t *j = &pt->job;
        double t0 = cs_time_ms();
        cs_flag_wait_geq(j->x_flag, j->x_value);
        bool failed = false;
        if (j->w_flag) { /* the layer's weights, streaming in from disk: a heartbeat meanwhile */
            while (!cs_flag_wait_geq_for(j->w_flag, j->w_value, LORA_ASSIST_BEAT_MS))
                if (j->alive) cs_flag_add(j->alive, 1);
            failed = cs_flag_load(j->w_flag) == LORA_HOST_FAILED;
        }
        double t1 = cs_time_ms();
        for (int k = 0; k < j->n_mods; k++) {
            const lora_module_t *m = j->mods[k];
            size_t ny = (size_t)j->n * m->d_out;
            bool bf16 = j->y_dtype == CS_DTYPE_BF16;
            if (failed) { /* they never came: zeros (the engine fails the requests that used them) */
                memset(j->y[k], 0, cs_dtype_size(j->y_dtype) * ny);
                continue;
            }
            size_t need = (size_t)m->rank * ((size_t)j->n + m->d_in + m->d_out) + (bf16 ? ny : 0);
            if (need > scap) {
                free(scratch);
                scap = need + need / 4;
                scratch = malloc(sizeof(float) * scap);
                CS_ASSERT(scratch); /* a few rank-sized rows: out of memory here is fatal */
            }
            if (!bf16) {
                lora_assist_term(j->y[k], j->x, j->n, j->ld_x, m, scratch);
                continue;
            }
            float *yf = scratch + (need - ny); /* F32 first, then rounded: half the bytes to the device */
            lora_assist_term(yf, j->x, j->n, j->ld_x, m, scratch);
            uint16_t *yo = j->y[k];
            for (size_t i = 0; i < ny; i++) yo[i] = cs_f32_to_bf16(yf[i]);
        }
        double t2 = cs_time_ms();
        pthread_mutex_lock(&a->mu); /* counted before the part is reported done */
        a->st.parts++;
        a->st.rows += (uint64_t)j->n * j->n_mods;
        a->st.busy_ms += t2 - t1;
        a->st.wait_ms += t1 - t0;
        pthread_mutex_unlock(&a->mu);
        cs_flag_add(j->done, 1);
        free(pt);
        pthread_mutex_lock(&a->mu);
    }
    pthread_mutex_unlock(&a->mu);
    free(scratch);
    return NULL;
}

int lora_assist_new(const lora_assist_params_t *p, lora_assist_t **out) {
    *out = NULL;
    lora_assist_t *a = calloc(1, sizeof *a);
    if (!a) return cs_error_set(CS_ENOMEM, "out of memory");
    a->p = *p;
    if (a->p.n_threads <= 0) a->p.n_threads = 1;
    if (a->p.terms_dtype != CS_DTYPE_BF16) a->p.terms_dtype = CS_DTYPE_F32;
    pthread_mutex_init(&a->mu, NULL);
    pthread_cond_init(&a->cv, NULL);
    if (!(a->threads = calloc((size_t)a->p.n_threads, sizeof *a->threads))) {
        lora_assist_free(a);
        return cs_error_set(CS_ENOMEM, "out of memory");
    }
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    for (int i = 0; i < a->p.n_threads; i++) {
        if (pthread_create(&a->threads[i], NULL, worker_main, a)) {
            lora_assist_free(a);
            return cs_error_set(CS_ENOMEM, "host LoRA workers: cannot start thread %d", i);
        }
        a->n_started++;
        if (a->p.pin && ncpu > 0) { /* from the last core down: the CPU backend's pool starts at 0 */
            cpu_set_t set;
            CPU_ZERO(&set);
            CPU_SET((int)((ncpu - 1 - i % ncpu + ncpu) % ncpu), &set);
            pthread_setaffinity_np(a->threads[i], sizeof set, &set); /* best effort: a cpuset may forbid it */
        }
    }
    *out = a;
    return CS_OK;
}

void lora_assist_free(lora_assist_t *a) {
    if (!a) return;
    cs_stop_flag(&a->mu, &a->cv, &a->stopping);
    for (int i = 0; i < a->n_started; i++) pthread_join(a->threads[i], NULL);
    CS_ASSERT(!a->head);
    free(a->threads);
    pthread_mutex_destroy(&a->mu);
    pthread_cond_destroy(&a->cv);
    free(a);
}

int lora_assist_threads(const lora_assist_t *a) { return a->p.n_threads; }
cs_dtype lora_assist_terms_dtype(const lora_assist_t *a) { return a->p.terms_dtype; }

int lora_assist_submit(lora_assist_t *a, const lora_assist_job_t *job) {
    int n = job->n, parts = CS_MIN(a->p.n_threads, CS_MAX(n, 1));
    if (a->p.max_rows > 0) parts = CS_MAX(parts, (n + a->p.max_rows - 1) / a->p.max_rows);
    part_t *first = NULL, *last = NULL;
    for (int i = 0; i < parts; i++) {
        int r0 = (int)((long)n * i / parts), r1 = (int)((long)n * (i + 1) / parts);
        part_t *pt = malloc(sizeof *pt);
        if (!pt) {
            while (first) { part_t *nx = first->next; free(first); first = nx; }
            return cs_error_set(CS_ENOMEM, "out of memory");
        }
        pt->job = *job;
        pt->job.x = job->x + (size_t)r0 * job->ld_x;
        pt->job.n = r1 - r0;
        size_t es = cs_dtype_size(job->y_dtype);
        for (int k = 0; k < job->n_mods; k++) pt->job.y[k] = (char *)job->y[k] + es * (size_t)r0 * job->mods[k]->d_out;
        pt->next = NULL;
        if (last) last->next = pt;
        else first = pt;
        last = pt;
    }
    pthread_mutex_lock(&a->mu);
    if (a->tail) a->tail->next = first;
    else a->head = first;
    a->tail = last;
    a->st.jobs++;
    pthread_cond_broadcast(&a->cv);
    pthread_mutex_unlock(&a->mu);
    return parts;
}

void lora_cold_cost(const lora_adapter_t *a, int arrived, int rows, cs_dtype terms, lora_cold_cost_t *c) {
    /* the group of each target: the projections sharing one input */
    static const int group[LORA_N_TARGETS] = {0, 0, 0, 1, 2, 2, 3};
    size_t ts = cs_dtype_size(terms);
    c->assist_bytes = c->wait_bytes = 0;
    for (int l = CS_MAX(arrived, 0); l < a->n_layers; l++) {
        int din[4] = {0, 0, 0, 0};
        for (int t = 0; t < LORA_N_TARGETS; t++) {
            const lora_module_t *m = lora_adapter_module(a, l, (lora_target)t);
            if (m->rank <= 0) continue;
            din[group[t]] = m->d_in;
            c->assist_bytes += (uint64_t)rows * m->d_out * ts;
            c->wait_bytes += (uint64_t)m->rank * (m->d_in + m->d_out) * cs_dtype_size(m->dtype);
        }
        for (int g = 0; g < 4; g++) c->assist_bytes += (uint64_t)rows * din[g] * sizeof(float);
    }
}

void lora_assist_get_stats(lora_assist_t *a, lora_assist_stats_t *st) {
    pthread_mutex_lock(&a->mu);
    *st = a->st;
    pthread_mutex_unlock(&a->mu);
}
