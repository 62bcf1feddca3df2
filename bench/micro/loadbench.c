/* loadbench.c (bench/loadbench): the adapter loader (lora/loader_uring.c) reading files the
 * size of adapters, three ways in one run, alternating within each repetition so machine
 * noise hits all alike:
 *   direct         O_DIRECT (the default): device -> buffer, the page cache untouched,
 *                  into the loader's pool of registered, reused buffers;
 *   direct_fresh   the same into a fresh buffer per file (no pool: what every load cost
 *                  before the pool, page faults and zeroing of new memory included);
 *   buffered_cold  through the page cache, each file's cached pages dropped first
 *                  (posix_fadvise DONTNEED on clean, synced files);
 *   buffered_warm  through the page cache with every page already cached (what a reload
 *                  of an evicted adapter gets when the OS kept the file).
 * Each mode has its own loader for the whole run (its pool lives across loads, sized for all
 * the files; the pool holds 8 buffers, so past --files 8 the rest get fresh ones: see
 * registered_files), loaded once untimed first. Per mode: GB/s (wall, submit to the job's callback) and the CPU time the process spent
 * per GB (the page-cache copy is CPU work O_DIRECT does not do). One JSON line on stdout.
 * In the lora layer (it drives the loader itself), built as bench/loadbench; bench/loadio.sh
 * runs it and writes bench/results/loadio-*.json.
 *
 *   bench/loadbench [--dir DIR] [--files N] [--mib M] [--reps R] [--qd Q] [--chunk-kib K] */
#include "config.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "lora/loader_uring.h"

typedef struct wait_job {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done;
    int failed, direct, registered;
    size_t bytes;
} wait_job_t;

static void on_done(void *user, lora_file_t *files, size_t n) {
    wait_job_t *w = user;
    pthread_mutex_lock(&w->mu);
    for (size_t i = 0; i < n; i++) {
        if (files[i].status != CS_OK) {
            fprintf(stderr, "loadbench: %s\n", files[i].error);
            w->failed++;
        }
        w->direct += files[i].direct;
        w->registered += files[i].registered;
        w->bytes += files[i].len;
    }
    w->done = true;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

static double clock_s(clockid_t c) {
    struct timespec t;
    clock_gettime(c, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static void drop_cache(char **paths, int n) {
    for (int i = 0; i < n; i++) {
        int fd = open(paths[i], O_RDONLY);
        if (fd < 0) continue;
        posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
        close(fd);
    }
}

/* one load of every file through L: wall seconds, process CPU seconds */
static int load_all(lora_loader_t *l, char **paths, int n, double *wall, double *cpu, int *direct, int *registered) {
    wait_job_t w = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    double c0 = clock_s(CLOCK_PROCESS_CPUTIME_ID), t0 = clock_s(CLOCK_MONOTONIC);
    if (lora_loader_submit(l, (const char *const *)paths, (size_t)n, on_done, &w) != CS_OK) {
        fprintf(stderr, "loadbench: %s\n", cs_error_last());
        return -1;
    }
    pthread_mutex_lock(&w.mu);
    while (!w.done) pthread_cond_wait(&w.cv, &w.mu);
    pthread_mutex_unlock(&w.mu);
    *wall = clock_s(CLOCK_MONOTONIC) - t0;
    *cpu = clock_s(CLOCK_PROCESS_CPUTIME_ID) - c0;
    *direct = w.direct;
    *registered = w.registered;
    return w.failed ? -1 : 0;
}

int main(int argc, char **argv) {
    const char *dir = NULL;
    int n_files = 8, mib = 64, reps = 5, qd = 16, chunk_kib = 1024;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--dir") && v) dir = argv[++i];
        else if (!strcmp(a, "--files") && v) n_files = atoi(argv[++i]);
        else if (!strcmp(a, "--mib") && v) mib = atoi(argv[++i]);
        else if (!strcmp(a, "--reps") && v) reps = atoi(argv[++i]);
        else if (!strcmp(a, "--qd") && v) qd = atoi(argv[++i]);
        else if (!strcmp(a, "--chunk-kib") && v) chunk_kib = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--dir DIR] [--files N] [--mib M] [--reps R] [--qd Q] [--chunk-kib K]\n", argv[0]);
            return 2;
        }
    }
    if (n_files < 1 || n_files > 256 || mib < 1 || reps < 1 || reps > 100 || chunk_kib < 4 || chunk_kib % 4) {
        fprintf(stderr, "loadbench: --files 1..256, --mib >= 1, --reps 1..100, --chunk-kib a multiple of 4\n");
        return 2;
    }
    char tmpl[4096];
    bool own_dir = !dir;
    if (own_dir) {
        const char *t = getenv("TMPDIR");
        snprintf(tmpl, sizeof tmpl, "%s/cs_loadbench_XXXXXX", t && *t ? t : "/tmp");
        if (!mkdtemp(tmpl)) {
            perror("loadbench: mkdtemp");
            return 1;
        }
        dir = tmpl;
    }
    /* the files: random bytes (no file system can shortcut them), synced so their pages are
     * clean and can be dropped */
    char **paths = calloc((size_t)n_files, sizeof *paths);
    size_t file_bytes = (size_t)mib << 20;
    char *buf = malloc(1 << 20);
    unsigned s = 12345;
    int rc = 1;
    lora_loader_t *ld[3] = {NULL, NULL, NULL}; /* direct + pool, direct fresh, buffered + pool */
    for (int i = 0; i < n_files && paths; i++) {
        if (!(paths[i] = malloc(strlen(dir) + 32))) goto out;
        sprintf(paths[i], "%s/adapter_%d.safetensors", dir, i);
        FILE *f = fopen(paths[i], "wb");
        if (!f || !buf) {
            perror(paths[i]);
            goto out;
        }
        for (size_t off = 0; off < file_bytes; off += 1 << 20) {
            for (int k = 0; k < (1 << 20); k += 4) {
                s = s * 1664525u + 1013904223u;
                memcpy(buf + k, &s, 4);
            }
            fwrite(buf, 1, 1 << 20, f);
        }
        fflush(f);
        fsync(fileno(f));
        fclose(f);
    }
    enum { NM = 4 };
    static const char *names[NM] = {"direct", "direct_fresh", "buffered_cold", "buffered_warm"};
    for (int k = 0; k < 3; k++) {
        size_t need = (size_t)n_files * file_bytes + ((size_t)n_files << 21);
        lora_loader_params_t lp = {.queue_depth = qd, .chunk_bytes = (size_t)chunk_kib << 10, .buffered = k == 2,
                                   .no_pool = k == 1, .pool_bytes = need};
        if (lora_loader_init(&lp, &ld[k]) != CS_OK) {
            fprintf(stderr, "loadbench: %s\n", cs_error_last());
            goto out;
        }
        double w, c;
        int d, g;
        if (load_all(ld[k], paths, n_files, &w, &c, &d, &g)) goto out; /* untimed: fills the pool */
    }
    double gbs[NM][100], cpu_per_gb[NM][100];
    int direct_files = 0, registered_files = 0;
    double total_gb = (double)file_bytes * n_files / 1e9;
    for (int r = 0; r < reps; r++) {
        for (int k = 0; k < NM; k++) {
            int m = (k + r) % NM; /* rotate the order */
            if (m <= 2) drop_cache(paths, n_files);
            lora_loader_t *l = ld[m < 3 ? m : 2];
            if (m == 3) { /* warm the page cache first */
                double w, c;
                int d, g;
                if (load_all(l, paths, n_files, &w, &c, &d, &g)) goto out;
            }
            double wall, cpu;
            int d, g;
            if (load_all(l, paths, n_files, &wall, &cpu, &d, &g)) goto out;
            if (m == 0) direct_files = d, registered_files = g;
            gbs[m][r] = total_gb / wall;
            cpu_per_gb[m][r] = cpu / total_gb;
        }
    }
    printf("{\"benchmark\": \"loadbench\", \"dir\": \"%s\", \"files\": %d, \"mib_per_file\": %d, \"reps\": %d, "
           "\"queue_depth\": %d, \"chunk_kib\": %d, \"direct_files\": %d, \"registered_files\": %d",
           own_dir ? "$TMPDIR" : dir, n_files, mib, reps, qd, chunk_kib, direct_files, registered_files);
    for (int m = 0; m < NM; m++) {
        printf(", \"%s\": {\"gb_s_runs\": [", names[m]);
        for (int r = 0; r < reps; r++) printf("%s%.3f", r ? ", " : "", gbs[m][r]);
        printf("], \"gb_s_median\": %.3f, \"cpu_s_per_gb_median\": %.4f}", median(gbs[m], reps),
               median(cpu_per_gb[m], reps));
    }
    printf("}\n");
    rc = 0;
out:
    for (int k = 0; k < 3; k++) lora_loader_free(ld[k]);
    for (int i = 0; i < n_files && paths; i++) {
        if (paths[i]) unlink(paths[i]);
        free(paths[i]);
    }
    free(paths);
    free(buf);
    if (own_dir) rmdir(dir);
    return rc;
}
