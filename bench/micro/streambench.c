/* streambench.c (bench/streambench): how soon a request may start on an adapter that is on
 * disk only, with the registry streaming the file in layer by layer (stream_host, what
 * `serve` does on a GPU or the strict device) against reading it whole first (what it did
 * before, and what the CPU backend still does). One registry per mode, on a stand-in
 * device that can take a host copy still coming in (no slot is ever made: the host side is
 * what is timed), living across the loads as a server's does (its loader's pool of read buffers
 * too); each load is a new version of the adapter (as a trainer pushes them), modes
 * alternating, the file's cached pages dropped first (posix_fadvise DONTNEED; the loader
 * reads O_DIRECT where it can anyway):
 *   handed_ms          first acquire (the load starts) -> acquire answers CS_OK;
 *   layer_ms[k]        -> layer k's weights are in host memory (first, middle, last layer);
 *   complete_ms        -> the load finished (state resident).
 * Whole-file mode hands the adapter out only at the end, so all its times are one. One JSON
 * line on stdout: medians per mode. bench/diskstream.sh runs it and writes
 * bench/results/diskstream-*.json.
 *
 *   bench/streambench --model DIR --adapter DIR [--reps R] */
#include "config.h"

#include <fcntl.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/backend_impl.h"
#include "base/model_config.h"
#include "lora/registry.h"

enum { MAX_REPS = 64 };

/* the stand-in device: what the registry asks of one to stream from disk (backend_caps: adapter_feed);
 * none of it is called, as no slot is acquired */
static int null_stream(backend_t *b, const backend_adapter_desc_t *d, int group, void (*on_group)(void *), void *user,
                       backend_adapter_t **slot) {
    (void)b, (void)d, (void)group, (void)on_group, (void)user, (void)slot;
    return cs_error_set(CS_EUNSUPPORTED, "streambench: no slots");
}
static void null_feed(backend_t *b, backend_adapter_t *slot, int n) { (void)b, (void)slot, (void)n; }
static const struct backend_i null_iface = {.name = "null", .adapter_stream = null_stream, .adapter_feed = null_feed};

static void drop_cache(const char *dir) {
    char *p = cs_path_join(dir, "adapter_model.safetensors");
    int fd = p ? open(p, O_RDONLY) : -1;
    if (fd >= 0) {
        fdatasync(fd);
        posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
        close(fd);
    }
    free(p);
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

typedef struct run_times { double handed, layer[3], complete; } run_times_t;

/* one load of ADAPTER as a new version of "a" in R (whose loader, and its pool of read
 * buffers, lives across loads as a server's does) */
static int one(lora_registry_t *r, const char *adapter, run_times_t *t) {
    drop_cache(adapter);
    int rc = lora_registry_add(r, "a", adapter, NULL);
    lora_ref_t *ref = NULL;
    double t0 = cs_time_ms();
    if (rc == CS_OK)
        while ((rc = lora_registry_acquire(r, "a", &ref)) == CS_EAGAIN) usleep(50);
    if (rc) {
        fprintf(stderr, "streambench: %s\n", cs_error_last());
        return -1;
    }
    t->handed = cs_time_ms() - t0;
    int n = ref->adapter->n_layers, at[3] = {0, n / 2, n - 1};
    for (int k = 0; k < 3; k++) {
        /* a spin, not a futex wait: the wake-up latency is not the disk's */
        while (cs_flag_load(&ref->adapter->host_layers) <= (uint32_t)at[k]) {}
        if (lora_adapter_failed(ref->adapter)) {
            fprintf(stderr, "streambench: the load failed: %s\n",
                    lora_registry_ref_failed(r, ref) ? cs_error_last() : "?");
            lora_registry_release(r, ref);
            return -1;
        }
        t->layer[k] = cs_time_ms() - t0;
    }
    lora_state st = LORA_LOADING;
    while (lora_registry_state(r, "a", &st, NULL) == CS_OK && st == LORA_LOADING) usleep(20);
    t->complete = cs_time_ms() - t0;
    lora_registry_release(r, ref); /* an older version: freed */
    return st == LORA_RESIDENT ? 0 : -1;
}

int main(int argc, char **argv) {
    const char *model = NULL, *adapter = NULL;
    int reps = 5;
    static const struct option opts[] = {
        {"model", 1, 0, 'm'}, {"adapter", 1, 0, 'a'}, {"reps", 1, 0, 'r'}, {0, 0, 0, 0},
    };
    for (int c; (c = getopt_long(argc, argv, "", opts, NULL)) != -1;) {
        if (c == 'm') model = optarg;
        else if (c == 'a') adapter = optarg;
        else if (c == 'r') reps = atoi(optarg);
        else return 2;
    }
    if (!model || !adapter || reps < 1 || reps > MAX_REPS) {
        fprintf(stderr, "usage: streambench --model DIR --adapter DIR [--reps 1..%d]\n", MAX_REPS);
        return 2;
    }
    model_config_t cfg;
    if (model_config_load(model, &cfg)) {
        fprintf(stderr, "streambench: %s\n", cs_error_last());
        return 1;
    }
    backend_t null_dev = {.iface = &null_iface, .caps = {.adapter_stream = true, .adapter_feed = true}};
    backend_t *dev = &null_dev;
    run_times_t t[2][MAX_REPS];
    lora_registry_t *reg[2];
    for (int m = 0; m < 2; m++) {
        lora_registry_params_t p = {.cfg = &cfg, .device = dev, .stream_group = 1, .stream_host = m == 1};
        if (lora_registry_new(&p, &reg[m])) {
            fprintf(stderr, "streambench: %s\n", cs_error_last());
            return 1;
        }
    }
    for (int i = -1; i < reps; i++) { /* one untimed round first */
        for (int k = 0; k < 2; k++) {
            int m = (i + k + 2) % 2; /* alternating which goes first */
            run_times_t x;
            if (one(reg[m], adapter, &x)) return 1;
            if (i >= 0) t[m][i] = x;
        }
    }
    for (int m = 0; m < 2; m++) lora_registry_free(reg[m]);
    lora_adapter_info_t info;
    {
        lora_registry_params_t p = {.cfg = &cfg};
        lora_registry_t *r;
        if (lora_registry_new(&p, &r) || lora_registry_add(r, "a", adapter, NULL) ||
            lora_registry_info(r, "a", 0, &info))
            return 1;
        lora_registry_free(r);
    }
    printf("{\"layers\": %d, \"max_rank\": %d, \"adapter_bytes\": %zu, \"reps\": %d", info.n_layers, info.max_rank,
           info.nbytes, reps);
    static const char *const names[2] = {"whole", "stream"};
    for (int m = 0; m < 2; m++) {
        double v[MAX_REPS];
        printf(", \"%s\": {", names[m]);
        for (int i = 0; i < reps; i++) v[i] = t[m][i].handed;
        printf("\"handed_ms\": %.3f", median(v, reps));
        static const char *const ln[3] = {"first", "middle", "last"};
        for (int k = 0; k < 3; k++) {
            for (int i = 0; i < reps; i++) v[i] = t[m][i].layer[k];
            printf(", \"layer_%s_ms\": %.3f", ln[k], median(v, reps));
        }
        for (int i = 0; i < reps; i++) v[i] = t[m][i].complete;
        printf(", \"complete_ms\": %.3f}", median(v, reps));
    }
    printf("}\n");
    return 0;
}
