/* test_lora_registry.c: the host tier of adapters. The io_uring loader on its own (chunked
 * reads of odd sizes, many jobs at once, missing files); the registry: load -> acquire ->
 * resident, 50 adapters through a cache of 5 (by count, by bytes) with every acquired
 * adapter equal to lora_adapter_load's, held adapters never evicted (a 6th waits for a
 * release), corrupt adapters failing only themselves, versions, remove, threads acquiring
 * and re-adding at once, and freeing with loads in flight. */
#include "config.h" /* _GNU_SOURCE: rand_r */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "base/safetensors.h"
#include "lora/loader_uring.h"
#include "cpu_kernels/cpu_backend.h"
#include "lora/registry.h"
#include "testutil.h"

static char root[256];
static model_config_t base;

#define N_LAYERS CS_TEST_TINY_LLAMA_LAYERS

static void setup(void) { cs_test_lora_setup(root, sizeof root, "lreg", &base); }

static void teardown(void) { cs_rmtree(root); }

/* ---- adapters on disk ---- */

static const int targets[] = { LORA_Q, LORA_V, LORA_DOWN };
static const char *parent(int t) { return t < LORA_GATE ? "self_attn" : "mlp"; }

/* exactly representable in BF16 */
static float val(int seed, size_t i) { return (float)(seed % 97) * 0.25f + (float)((int)(i % 64) - 32) * 0.125f; }

/* the dtype of every adapter written from now on; -1: BF16 for odd seeds, F32 for even */
static int adapters_dtype = -1;

/* root/NAME: q, v, down of every layer at RANK (tensors written with rank TRANK), weights
 * from SEED; BF16 for odd seeds (or adapters_dtype). Returns the directory (static buffer). */
static const char *write_adapter_shape(const char *name, int rank, int trank, int seed) {
    static char d[512];
    snprintf(d, sizeof d, "%s/%s", root, name);
    mkdir(d, 0755);
    char p[600];
    snprintf(p, sizeof p, "%s/adapter_config.json", d);
    FILE *f = fopen(p, "w");
    ck_assert_ptr_nonnull(f);
    fprintf(f, "{\"peft_type\": \"LORA\", \"r\": %d, \"lora_alpha\": %d, \"bias\": \"none\", "
               "\"target_modules\": [\"q_proj\", \"v_proj\", \"down_proj\"]}", rank, 2 * rank + seed % 5);
    fclose(f);

    enum { NT = N_LAYERS * 3 * 2 };
    st_write_tensor_t t[NT];
    char names[NT][160];
    void *bufs[NT];
    cs_dtype dt = adapters_dtype >= 0 ? (cs_dtype)adapters_dtype : seed % 2 ? CS_DTYPE_BF16 : CS_DTYPE_F32;
    int n = 0;
    for (int l = 0; l < N_LAYERS; l++)
        for (size_t k = 0; k < CS_ARRAY_LEN(targets); k++) {
            int tg = targets[k], din, dout;
            lora_target_dims(&base, (lora_target)tg, &din, &dout);
            for (int ab = 0; ab < 2; ab++) {
                int64_t d0 = ab ? dout : trank, d1 = ab ? trank : din;
                size_t cnt = (size_t)d0 * (size_t)d1;
                void *buf = malloc(cnt * 4 + 1);
                for (size_t i = 0; i < cnt; i++) {
                    float v = val(seed + l * 7 + tg * 3 + ab, i);
                    if (dt == CS_DTYPE_F32) ((float *)buf)[i] = v;
                    else ((uint16_t *)buf)[i] = cs_f32_to_bf16(v);
                }
                snprintf(names[n], sizeof names[n], "base_model.model.model.layers.%d.%s.%s.lora_%c.weight", l,
                         parent(tg), lora_target_names[tg], ab ? 'B' : 'A');
                t[n] = (st_write_tensor_t){ .name = names[n], .dtype = dt, .n_dims = 2, .shape = { d0, d1 }, .data = buf };
                bufs[n++] = buf;
            }
        }
    snprintf(p, sizeof p, "%s/adapter_model.safetensors", d);
    const char *meta[] = { "format", "pt", NULL };
    ck_assert_int_eq(safetensors_write(p, t, (size_t)n, meta), CS_OK);
    for (int i = 0; i < n; i++) free(bufs[i]);
    return d;
}

static const char *write_adapter(const char *name, int rank, int seed) {
    return write_adapter_shape(name, rank, rank, seed);
}

static lora_adapter_t *load_ref(const char *dir) {
    lora_adapter_t *a = NULL;
    int rc = lora_adapter_load(dir, &base, &a);
    ck_assert_msg(rc == CS_OK, "lora_adapter_load(%s): %s", dir, cs_error_last());
    return a;
}

/* 1 if equal (weights bit for bit) */
static int adapters_equal(const lora_adapter_t *x, const lora_adapter_t *y) {
    if (!x || !y || x->n_layers != y->n_layers || x->nbytes != y->nbytes || x->max_rank != y->max_rank) return 0;
    for (int i = 0; i < x->n_layers * LORA_N_TARGETS; i++) {
        const lora_module_t *a = &x->mods[i], *b = &y->mods[i];
        if (a->rank != b->rank || a->d_in != b->d_in || a->d_out != b->d_out || a->scale != b->scale || a->dtype != b->dtype)
            return 0;
        if (!a->rank) continue;
        size_t es = cs_dtype_size(a->dtype);
        if (memcmp(a->a, b->a, (size_t)a->rank * a->d_in * es) || memcmp(a->b, b->b, (size_t)a->d_out * a->rank * es))
            return 0;
    }
    return 1;
}

/* ---- waiting for on_loaded ---- */

static pthread_mutex_t ev_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t ev_cond = PTHREAD_COND_INITIALIZER;
static uint64_t ev_count;
static lora_registry_t *ev_reg;        /* checked from on_loaded */
static int ev_max_resident;
static size_t ev_max_bytes;

static void on_loaded(void *user) {
    (void)user;
    lora_registry_stats_t st;
    pthread_mutex_lock(&ev_mu);
    lora_registry_t *r = ev_reg;
    pthread_mutex_unlock(&ev_mu);
    if (r) lora_registry_stats(r, &st);
    pthread_mutex_lock(&ev_mu);
    if (r) {
        ev_max_resident = CS_MAX(ev_max_resident, st.n_resident);
        ev_max_bytes = CS_MAX(ev_max_bytes, st.bytes_resident);
    }
    ev_count++;
    pthread_cond_broadcast(&ev_cond);
    pthread_mutex_unlock(&ev_mu);
}

static uint64_t ev_now(void) {
    pthread_mutex_lock(&ev_mu);
    uint64_t c = ev_count;
    pthread_mutex_unlock(&ev_mu);
    return c;
}

/* wait until ev_count != seen or MS pass; 0 on timeout */
static int ev_wait(uint64_t seen, int ms) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += ms / 1000;
    ts.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
    pthread_mutex_lock(&ev_mu);
    while (ev_count == seen)
        if (pthread_cond_timedwait(&ev_cond, &ev_mu, &ts) == ETIMEDOUT) break;
    int changed = ev_count != seen;
    pthread_mutex_unlock(&ev_mu);
    return changed;
}

static lora_registry_t *reg_new_ex(size_t cache_bytes, int max_loras, double fresh_ms) {
    lora_registry_params_t p = { .cfg = &base, .cache_bytes = cache_bytes, .max_loras = max_loras,
                                 .on_loaded = on_loaded, .user = NULL, .fresh_ms = fresh_ms };
    lora_registry_t *r = NULL;
    int rc = lora_registry_new(&p, &r);
    ck_assert_msg(rc == CS_OK, "lora_registry_new: %s", cs_error_last());
    pthread_mutex_lock(&ev_mu);
    ev_reg = r;
    ev_max_resident = 0;
    ev_max_bytes = 0;
    pthread_mutex_unlock(&ev_mu);
    return r;
}

static lora_registry_t *reg_new(size_t cache_bytes, int max_loras) { return reg_new_ex(cache_bytes, max_loras, 0); }

static void reg_free(lora_registry_t *r) {
    pthread_mutex_lock(&ev_mu);
    ev_reg = NULL;
    pthread_mutex_unlock(&ev_mu);
    lora_registry_free(r);
}

/* acquire, waiting on on_loaded while CS_EAGAIN; the final status (30 s at most) */
static int acquire_wait(lora_registry_t *r, const char *name, lora_ref_t **out) {
    double t0 = cs_time_ms();
    for (;;) {
        uint64_t seen = ev_now();
        int rc = lora_registry_acquire(r, name, out);
        if (rc != CS_EAGAIN) return rc;
        ck_assert_ptr_null(*out);
        ck_assert_msg(cs_time_ms() - t0 < 120000, "acquire '%s': still CS_EAGAIN after 120 s", name);
        ev_wait(seen, 200);
    }
}

static lora_ref_t *acquire_ok(lora_registry_t *r, const char *name) {
    lora_ref_t *ref = NULL;
    int rc = acquire_wait(r, name, &ref);
    ck_assert_msg(rc == CS_OK, "acquire '%s': %d %s", name, rc, cs_error_last());
    ck_assert_ptr_nonnull(ref);
    ck_assert_str_eq(ref->name, name);
    return ref;
}

static lora_state state_of(lora_registry_t *r, const char *name) {
    lora_state st;
    ck_assert_int_eq(lora_registry_state(r, name, &st, NULL), CS_OK);
    return st;
}

static lora_registry_stats_t stats(lora_registry_t *r) {
    lora_registry_stats_t st;
    lora_registry_stats(r, &st);
    return st;
}

/* wait until no load is in flight (loads waiting for room would wait forever: not used then) */
static void settle(lora_registry_t *r) {
    double t0 = cs_time_ms();
    while (stats(r).n_loading > 0) {
        ck_assert_msg(cs_time_ms() - t0 < 120000, "loads did not finish");
        usleep(1000);
    }
}

/* ---- the loader on its own ---- */

typedef struct got {
    pthread_mutex_t mu;
    int jobs;
    struct { char path[256]; void *data; size_t len; bool direct, registered; int status; char error[384];
             const void *seen; bool bytes_ok; } f[256];
    int n;
    bool borrow;            /* leave the buffers to the loader: check the bytes in the callback */
} got_t;

static unsigned char pattern(size_t file, size_t i);

static void got_done(void *user, lora_file_t *files, size_t n) {
    got_t *g = user;
    pthread_mutex_lock(&g->mu);
    for (size_t i = 0; i < n && g->n < 256; i++, g->n++) {
        snprintf(g->f[g->n].path, sizeof g->f[g->n].path, "%s", files[i].path);
        g->f[g->n].seen = files[i].data;
        if (g->borrow) { /* files named .../pN hold pattern(N, ...) */
            const unsigned char *d = files[i].data;
            size_t id = (size_t)atoi(strrchr(files[i].path, '/') + 2);
            bool ok = d != NULL && d[files[i].len] == 0;
            for (size_t k = 0; ok && k < files[i].len; k++) ok = d[k] == pattern(id, k);
            g->f[g->n].bytes_ok = ok;
        } else {
            g->f[g->n].data = files[i].data;
            files[i].data = NULL;
        }
        g->f[g->n].len = files[i].len;
        g->f[g->n].direct = files[i].direct;
        g->f[g->n].registered = files[i].registered;
        g->f[g->n].status = files[i].status;
        snprintf(g->f[g->n].error, sizeof g->f[g->n].error, "%s", files[i].error);
    }
    g->jobs++;
    pthread_mutex_unlock(&g->mu);
}

static void got_wait(got_t *g, int jobs) {
    double t0 = cs_time_ms();
    for (;;) {
        pthread_mutex_lock(&g->mu);
        int j = g->jobs;
        pthread_mutex_unlock(&g->mu);
        if (j >= jobs) return;
        ck_assert_msg(cs_time_ms() - t0 < 120000, "loader: %d of %d jobs done after 120 s", j, jobs);
        usleep(1000);
    }
}

static unsigned char pattern(size_t file, size_t i) { return (unsigned char)(file * 31 + i * 7 + (i >> 12)); }

static void write_pattern(const char *path, size_t file, size_t len) {
    FILE *f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    for (size_t i = 0; i < len; i++) fputc(pattern(file, i), f);
    fclose(f);
}

static void check_got(const got_t *g, int k, size_t file, size_t len) {
    ck_assert_msg(g->f[k].status == CS_OK, "%s: %s", g->f[k].path, g->f[k].error);
    ck_assert_uint_eq(g->f[k].len, len);
    ck_assert_ptr_nonnull(g->f[k].data);
    ck_assert_uint_eq((uintptr_t)g->f[k].data % LORA_LOADER_ALIGN, 0);
    const unsigned char *d = g->f[k].data;
    for (size_t i = 0; i < len; i++)
        if (d[i] != pattern(file, i)) ck_abort_msg("%s: byte %zu is %u, want %u", g->f[k].path, i, d[i], pattern(file, i));
    ck_assert_uint_eq(d[len], 0);
}

START_TEST(test_loader_files) {
    /* 4 KiB chunks, 4 in flight: sizes around the chunk edges and a many-chunk file */
    static const size_t sizes[] = { 0, 1, 4095, 4096, 4097, 3 * 4096 + 5, 300001 };
    enum { NS = CS_ARRAY_LEN(sizes) };
    char paths[NS + 2][300];
    const char *pp[NS + 2];
    for (size_t i = 0; i < NS; i++) {
        snprintf(paths[i], sizeof paths[i], "%s/f%zu", root, i);
        write_pattern(paths[i], i, sizes[i]);
        pp[i] = paths[i];
    }
    snprintf(paths[NS], sizeof paths[NS], "%s/missing", root);
    snprintf(paths[NS + 1], sizeof paths[NS + 1], "%s", root); /* a directory */
    pp[NS] = paths[NS];
    pp[NS + 1] = paths[NS + 1];

    /* does this file system take O_DIRECT? (ext4, xfs, tmpfs since Linux 6.6 do) */
    int probe = open(paths[NS - 1], O_RDONLY | O_DIRECT);
    bool fs_direct = probe >= 0;
    if (probe >= 0) close(probe);
    got_t *g = calloc(1, sizeof *g);
    pthread_mutex_init(&g->mu, NULL);
    lora_loader_params_t lp;
    lora_loader_t *l;
    /* O_DIRECT (the default), the page cache, and the three ways a file system refuses
     * O_DIRECT: at openat, at every read, or with a short read at an unaligned offset; the
     * same bytes each way */
    for (int mode = 0; mode < 5; mode++) {
    lp = (lora_loader_params_t){ .queue_depth = 4, .chunk_bytes = 4096, .buffered = mode == 1,
                                 .test_refuse_direct = mode >= 2 ? mode - 1 : 0 };
    ck_assert_int_eq(lora_loader_init(&lp, &l), CS_OK);
    g->n = g->jobs = 0;
    ck_assert_int_eq(lora_loader_submit(l, pp, 4, got_done, g), CS_OK);          /* files 0..3 */
    ck_assert_int_eq(lora_loader_submit(l, pp + 4, NS - 4 + 2, got_done, g), CS_OK); /* 4.., missing, dir */
    got_wait(g, 2);
    ck_assert_int_eq(g->n, NS + 2);
    for (int k = 0; k < g->n; k++) {
        size_t i = 0;
        while (strcmp(paths[i], g->f[k].path) != 0) i++;
        if (i < NS) {
            check_got(g, k, i, sizes[i]);
            /* direct when the file system takes it and nothing refused: a refusal at reads
             * only shows on a file that has any (more than 1 byte for the short one) */
            bool want = fs_direct && (mode == 0 || (mode == 3 && sizes[i] == 0) || (mode == 4 && sizes[i] <= 1));
            ck_assert_msg(g->f[k].direct == want, "mode %d, %zu bytes: direct %d, want %d", mode, sizes[i],
                          g->f[k].direct, want);
        } else if (i == NS) {
            ck_assert_int_eq(g->f[k].status, CS_ENOTFOUND);
            ck_assert_msg(strstr(g->f[k].error, "missing") && strstr(g->f[k].error, "openat") &&
                          strstr(g->f[k].error, "loader_uring.c:"), "message: %s", g->f[k].error);
            ck_assert_ptr_null(g->f[k].data);
        } else {
            ck_assert_int_eq(g->f[k].status, CS_EIO);
            ck_assert_msg(strstr(g->f[k].error, "regular"), "message: %s", g->f[k].error);
        }
        free(g->f[k].data);
    }
    lora_loader_free(l);
    }

    /* a file system that refuses O_DIRECT at openat for real: procfs (its files statx as empty) */
    lp = (lora_loader_params_t){ .queue_depth = 4, .chunk_bytes = 4096 };
    ck_assert_int_eq(lora_loader_init(&lp, &l), CS_OK);
    g->n = g->jobs = 0;
    const char *proc[1] = { "/proc/self/status" };
    ck_assert_int_eq(lora_loader_submit(l, proc, 1, got_done, g), CS_OK);
    got_wait(g, 1);
    ck_assert_msg(g->f[0].status == CS_OK, "%s", g->f[0].error);
    ck_assert(!g->f[0].direct);
    free(g->f[0].data);
    lora_loader_free(l);

    /* bad parameters are refused */
    lp.chunk_bytes = 1000;
    ck_assert_int_eq(lora_loader_init(&lp, &l), CS_EINVAL);
    pthread_mutex_destroy(&g->mu);
    free(g);
}
END_TEST

/* A streamed file (lora_loader_submit_stream): each chunk reported once, its bytes in when
 * reported; the order a first callback asks for is the order of the rest (one read in
 * flight: deterministic); a file that shrinks part way fails after the chunks that came. */
typedef struct streamed_got {
    size_t order[64];
    int n;
    bool reorder;           /* the first callback asks for odd chunks from the top down */
    bool bytes_ok;
    int done;
    int status;
    char error[400];
    const char *shrink;     /* truncate this file to 0 at the first callback */
} streamed_got_t;

static void sg_chunk(void *user, lora_file_t *f, size_t index, size_t chunk) {
    streamed_got_t *g = user;
    ck_assert_int_lt(g->n, 64);
    g->order[g->n++] = index;
    const unsigned char *d = f->data;
    for (size_t i = index * chunk; i < f->len && i < (index + 1) * chunk; i++)
        if (d[i] != pattern(7, i)) g->bytes_ok = false;
    if (g->n == 1 && g->reorder) {
        size_t want[8], k = 0;
        size_t nc = (f->len + chunk - 1) / chunk;
        for (size_t c = nc - 1; c > 0 && k < 8; c--)
            if (c % 2) want[k++] = c;
        ck_assert_int_eq(lora_loader_reorder(f, want, k), CS_OK);
    }
    if (g->n == 1 && g->shrink) ck_assert_int_eq(truncate(g->shrink, 0), 0);
}

static void sg_done(void *user, lora_file_t *files, size_t n) {
    streamed_got_t *g = user;
    ck_assert_uint_eq(n, 1);
    g->status = files[0].status;
    snprintf(g->error, sizeof g->error, "%s", files[0].error);
    __atomic_store_n(&g->done, 1, __ATOMIC_RELEASE);
}

START_TEST(test_loader_stream) {
    char path[300];
    snprintf(path, sizeof path, "%s/streamed", root);
    size_t len = 10 * 4096 + 123; /* 11 chunks */
    write_pattern(path, 7, len);
    lora_loader_params_t lp = { .queue_depth = 1, .chunk_bytes = 4096 };
    lora_loader_t *l;
    ck_assert_int_eq(lora_loader_init(&lp, &l), CS_OK);
    for (int mode = 0; mode < 2; mode++) {
        streamed_got_t g = { .reorder = mode == 1, .bytes_ok = true };
        ck_assert_int_eq(lora_loader_submit_stream(l, path, sg_chunk, sg_done, &g), CS_OK);
        double t0 = cs_time_ms();
        while (!__atomic_load_n(&g.done, __ATOMIC_ACQUIRE)) {
            ck_assert_msg(cs_time_ms() - t0 < 120000, "streamed load not done after 120 s");
            usleep(1000);
        }
        ck_assert_msg(g.status == CS_OK, "%s", g.error);
        ck_assert(g.bytes_ok);
        ck_assert_int_eq(g.n, 11);
        static const size_t in_order[11] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
        static const size_t asked[11] = {0, 9, 7, 5, 3, 1, 2, 4, 6, 8, 10};
        for (int i = 0; i < 11; i++) ck_assert_uint_eq(g.order[i], mode ? asked[i] : in_order[i]);
    }
    /* the file shrinks after its first chunk: the load fails, naming it; no chunk past the
     * end is reported */
    streamed_got_t g = { .bytes_ok = true, .shrink = path };
    ck_assert_int_eq(lora_loader_submit_stream(l, path, sg_chunk, sg_done, &g), CS_OK);
    double t0 = cs_time_ms();
    while (!__atomic_load_n(&g.done, __ATOMIC_ACQUIRE)) {
        ck_assert_msg(cs_time_ms() - t0 < 120000, "streamed load not done after 120 s");
        usleep(1000);
    }
    ck_assert_int_eq(g.status, CS_EIO);
    ck_assert_msg(strstr(g.error, "streamed"), "message: %s", g.error);
    ck_assert_int_eq(g.n, 1);
    lora_loader_free(l);
}
END_TEST

/* The pool: files from 2 MiB up are read into registered buffers the loader reuses once a
 * callback has returned without taking them; a taken one leaves the pool (the taker frees it);
 * a file larger than the pool gets a buffer of its own. Every load checked byte for byte. */
static void load_one(lora_loader_t *l, got_t *g, const char *path) {
    g->n = g->jobs = 0;
    ck_assert_int_eq(lora_loader_submit(l, &path, 1, got_done, g), CS_OK);
    got_wait(g, 1);
    ck_assert_msg(g->f[0].status == CS_OK, "%s", g->f[0].error);
}

START_TEST(test_loader_pool) {
    enum { NP = 3 };
    static const size_t sizes[NP] = { 5u << 20, (3u << 20) + 7, 9u << 20 }; /* p0 p1 p2 */
    char paths[NP][300];
    for (int i = 0; i < NP; i++) {
        snprintf(paths[i], sizeof paths[i], "%s/p%d", root, i);
        write_pattern(paths[i], (size_t)i, sizes[i]);
    }
    /* registering buffers needs RLIMIT_MEMLOCK room (or CAP_IPC_LOCK): expected where there is */
    struct rlimit ml;
    bool can_register = geteuid() == 0 || (getrlimit(RLIMIT_MEMLOCK, &ml) == 0 && ml.rlim_cur >= (64u << 20));
    lora_loader_params_t lp = { .queue_depth = 4, .chunk_bytes = 1 << 20, .pool_bytes = 8u << 20 };
    lora_loader_t *l;
    ck_assert_int_eq(lora_loader_init(&lp, &l), CS_OK);
    got_t *g = calloc(1, sizeof *g);
    pthread_mutex_init(&g->mu, NULL);
    g->borrow = true;
    load_one(l, g, paths[0]);       /* 5 MiB: a new 6 MiB pool buffer */
    const void *first = g->f[0].seen;
    ck_assert(g->f[0].bytes_ok);
    ck_assert(!can_register || g->f[0].registered);
    load_one(l, g, paths[1]);       /* 3 MiB: fits the idle one, reused */
    ck_assert(g->f[0].bytes_ok);
    ck_assert_ptr_eq(g->f[0].seen, first);
    ck_assert(!can_register || g->f[0].registered);
    load_one(l, g, paths[0]);       /* and again, the NUL and padding restored after the shorter file */
    ck_assert(g->f[0].bytes_ok);
    ck_assert_ptr_eq(g->f[0].seen, first);
    load_one(l, g, paths[2]);       /* 9 MiB > the 8 MiB pool: a buffer of its own */
    ck_assert(g->f[0].bytes_ok);
    ck_assert(!g->f[0].registered);
    ck_assert_ptr_ne(g->f[0].seen, first);
    load_one(l, g, paths[1]);       /* ... and the pool was not emptied for it */
    ck_assert(g->f[0].bytes_ok);
    ck_assert_ptr_eq(g->f[0].seen, first);
    /* a callback that takes the pooled buffer owns it (freed below; ASan would see a double
     * free), and the next load gets a new pool buffer */
    g->borrow = false;
    load_one(l, g, paths[0]);
    ck_assert_ptr_eq(g->f[0].data, first);
    check_got(g, 0, 0, sizes[0]);
    free(g->f[0].data);
    g->borrow = true;
    load_one(l, g, paths[1]);
    ck_assert(g->f[0].bytes_ok);
    ck_assert(!can_register || g->f[0].registered);
    /* both files of one job at once: 6 + 4 MiB of buffers do not fit the 8 MiB pool (the idle
     * 4 MiB one goes for a 6 MiB one), so the second file gets a buffer of its own */
    g->n = g->jobs = 0;
    const char *two[2] = { paths[0], paths[1] };
    ck_assert_int_eq(lora_loader_submit(l, two, 2, got_done, g), CS_OK);
    got_wait(g, 1);
    ck_assert(g->f[0].status == CS_OK && g->f[1].status == CS_OK && g->f[0].bytes_ok && g->f[1].bytes_ok);
    ck_assert_ptr_ne(g->f[0].seen, g->f[1].seen);
    lora_loader_free(l);
    /* no pool: every buffer its own, never registered */
    lp.no_pool = true;
    ck_assert_int_eq(lora_loader_init(&lp, &l), CS_OK);
    load_one(l, g, paths[0]);
    ck_assert(g->f[0].bytes_ok && !g->f[0].registered);
    lora_loader_free(l);
    pthread_mutex_destroy(&g->mu);
    free(g);
}
END_TEST

START_TEST(test_loader_many_jobs) {
    /* 60 jobs of 3 files queued at once through 8 operations in flight */
    enum { NJ = 60, NF = 3 };
    char paths[NJ * NF][300];
    for (int i = 0; i < NJ * NF; i++) {
        snprintf(paths[i], sizeof paths[i], "%s/m%d", root, i);
        write_pattern(paths[i], (size_t)i, (size_t)(i * 977 % 20000));
    }
    lora_loader_params_t lp = { .queue_depth = 8, .chunk_bytes = 8192 };
    lora_loader_t *l;
    ck_assert_int_eq(lora_loader_init(&lp, &l), CS_OK);
    got_t *g = calloc(1, sizeof *g);
    pthread_mutex_init(&g->mu, NULL);
    for (int j = 0; j < NJ; j++) {
        const char *pp[NF];
        for (int k = 0; k < NF; k++) pp[k] = paths[j * NF + k];
        ck_assert_int_eq(lora_loader_submit(l, pp, NF, got_done, g), CS_OK);
    }
    got_wait(g, NJ);
    ck_assert_int_eq(g->n, NJ * NF);
    for (int k = 0; k < g->n; k++) {
        int i = atoi(strrchr(g->f[k].path, '/') + 2);
        check_got(g, k, (size_t)i, (size_t)(i * 977 % 20000));
        free(g->f[k].data);
    }
    /* a job left queued at free still gets its callback, with an error */
    g->n = 0;
    g->jobs = 0;
    const char *pp[1] = { paths[0] };
    for (int j = 0; j < 20; j++) ck_assert_int_eq(lora_loader_submit(l, pp, 1, got_done, g), CS_OK);
    lora_loader_free(l);
    ck_assert_int_eq(g->jobs, 20);
    for (int k = 0; k < g->n; k++) {
        if (g->f[k].status == CS_OK) check_got(g, k, 0, 0);
        else ck_assert_int_eq(g->f[k].status, CS_EIO);
        free(g->f[k].data);
    }
    pthread_mutex_destroy(&g->mu);
    free(g);
}
END_TEST

/* ---- the registry ---- */

START_TEST(test_basic) {
    const char *d = write_adapter("a0", 4, 10);
    lora_adapter_t *want = load_ref(d);
    lora_registry_t *r = reg_new(0, 0);
    lora_ref_t *ref = (lora_ref_t *)0x1;
    ck_assert_int_eq(lora_registry_acquire(r, "a0", &ref), CS_ENOTFOUND);
    ck_assert_ptr_null(ref);
    ck_assert(strstr(cs_error_last(), "a0") != NULL);
    int v = 0;
    ck_assert_int_eq(lora_registry_add(r, "a0", d, &v), CS_OK);
    ck_assert_int_eq(v, 1);
    ck_assert_int_eq(lora_registry_add(r, "", d, &v), CS_EINVAL);
    lora_state st;
    ck_assert_int_eq(lora_registry_state(r, "a0", &st, &v), CS_OK);
    ck_assert_int_eq(st, LORA_ON_DISK);
    ck_assert_int_eq(v, 1);
    ck_assert_str_eq(lora_state_name(st), "on_disk");

    uint64_t seen = ev_now();
    ck_assert_int_eq(lora_registry_acquire(r, "a0", &ref), CS_EAGAIN);   /* starts the load */
    ck_assert_ptr_null(ref);
    ck_assert(state_of(r, "a0") == LORA_LOADING || state_of(r, "a0") == LORA_RESIDENT);
    ck_assert_msg(ev_wait(seen, 120000), "on_loaded never called");
    ck_assert_int_eq(state_of(r, "a0"), LORA_RESIDENT);
    ck_assert_int_eq(lora_registry_acquire(r, "a0", &ref), CS_OK);
    ck_assert(adapters_equal(ref->adapter, want));
    ck_assert_int_eq(ref->version, 1);
    ck_assert_str_eq(ref->name, "a0");
    ck_assert_str_eq(ref->adapter->name, "a0");
    lora_ref_t *ref2 = acquire_ok(r, "a0");
    ck_assert_ptr_eq(ref2->adapter, ref->adapter);
    lora_registry_stats_t s = stats(r);
    ck_assert_int_eq(s.n_registered, 1);
    ck_assert_int_eq(s.n_resident, 1);
    ck_assert_int_eq(s.n_loading, 0);
    ck_assert_uint_eq(s.bytes_resident, want->nbytes);
    ck_assert_uint_eq(s.loads, 1);
    ck_assert_uint_eq(s.misses, 1);
    ck_assert_uint_eq(s.hits, 2);
    ck_assert_uint_eq(s.load_failures, 0);
    lora_registry_release(r, ref);
    lora_registry_release(r, ref2);
    ck_assert_int_eq(state_of(r, "a0"), LORA_RESIDENT);   /* stays cached */
    reg_free(r);
    lora_adapter_free(want);
}
END_TEST

/* the host cache resists a scan: with room for two, "hot" asked for twice and "once" once,
 * a third adapter evicts "once" although "hot" was released longer ago (plain LRU would
 * evict "hot"); with only adapters asked for again left, the least recently released goes */
START_TEST(test_scan_resistant) {
    const char *names[] = {"hot", "once", "new", "newer"};
    lora_registry_t *r = reg_new(0, 2);
    for (int i = 0; i < 4; i++) {
        int v = 0;
        ck_assert_int_eq(lora_registry_add(r, names[i], write_adapter(names[i], 4, 20 + i), &v), CS_OK);
    }
    lora_registry_release(r, acquire_ok(r, "hot"));
    lora_registry_release(r, acquire_ok(r, "hot"));   /* used twice */
    lora_registry_release(r, acquire_ok(r, "once"));  /* used once, released after hot */
    lora_registry_release(r, acquire_ok(r, "new"));
    ck_assert_int_eq(state_of(r, "hot"), LORA_RESIDENT);
    ck_assert_int_eq(state_of(r, "once"), LORA_ON_DISK);
    lora_registry_release(r, acquire_ok(r, "new"));   /* now both cached ones were used twice */
    lora_registry_release(r, acquire_ok(r, "newer"));
    ck_assert_int_eq(state_of(r, "hot"), LORA_ON_DISK); /* the least recently released of them */
    ck_assert_int_eq(state_of(r, "new"), LORA_RESIDENT);
    ck_assert_uint_eq(stats(r).evictions, 2);
    reg_free(r);
}
END_TEST

enum { N_MANY = 50, BOUND = 5 };

/* 50 adapters through a cache of 5, acquires spread over all of them, up to 3 held at once
 * and bursts that queue several loads together. */
static void run_many(size_t cache_bytes, int max_loras) {
    lora_adapter_t *want[N_MANY];
    char names[N_MANY][16];
    for (int i = 0; i < N_MANY; i++) {
        snprintf(names[i], sizeof names[i], "m%02d", i);
        want[i] = load_ref(write_adapter(names[i], 4, 100 + i));
    }
    lora_registry_t *r = reg_new(cache_bytes, max_loras);
    for (int i = 0; i < N_MANY; i++) ck_assert_int_eq(lora_registry_add(r, names[i], want[i]->path, NULL), CS_OK);

    lora_ref_t *held[3] = { 0 };
    int held_idx[3] = { 0 };
    unsigned seed = 12345;
    for (int step = 0; step < 300; step++) {
        if (step % 25 == 0) {
            /* a burst: several loads queued at once, most of them waiting for room; then
             * taken as an engine would: every pending one retried when on_loaded fires */
            for (int k = 0; k < 8; k++) {
                lora_ref_t *x = NULL;
                int rc = lora_registry_acquire(r, names[(step + k * 7) % N_MANY], &x);
                ck_assert_msg(rc == CS_OK || rc == CS_EAGAIN, "burst: %d %s", rc, cs_error_last());
                if (x) lora_registry_release(r, x);
            }
            bool done[8] = { 0 };
            double t0 = cs_time_ms();
            for (int left = 8; left > 0;) {
                uint64_t seen = ev_now();
                for (int k = 0; k < 8; k++) {
                    int j = (step + k * 7) % N_MANY;
                    lora_ref_t *x = NULL;
                    if (done[k]) continue;
                    int rc = lora_registry_acquire(r, names[j], &x);
                    if (rc == CS_EAGAIN) continue;
                    ck_assert_msg(rc == CS_OK, "burst %s: %d %s", names[j], rc, cs_error_last());
                    ck_assert(adapters_equal(x->adapter, want[j]));
                    lora_registry_release(r, x);
                    done[k] = true;
                    left--;
                }
                ck_assert_msg(cs_time_ms() - t0 < 120000, "burst at step %d: %d not loaded after 120 s", step, left);
                if (left) ev_wait(seen, 200);
            }
        }
        seed = seed * 1103515245u + 12345u;
        int i = (int)((seed >> 8) % N_MANY);
        int slot = step % 3;
        if (held[slot]) {
            ck_assert(adapters_equal(held[slot]->adapter, want[held_idx[slot]]));  /* not evicted under us */
            lora_registry_release(r, held[slot]);
            held[slot] = NULL;
        }
        lora_ref_t *ref = acquire_ok(r, names[i]);
        ck_assert_msg(adapters_equal(ref->adapter, want[i]), "step %d: %s differs from lora_adapter_load", step, names[i]);
        ck_assert_int_eq(ref->version, 1);
        held[slot] = ref;
        held_idx[slot] = i;
        lora_registry_stats_t s = stats(r);
        ck_assert_int_le(s.n_resident, BOUND);
        if (cache_bytes) ck_assert_uint_le(s.bytes_resident, cache_bytes);
    }
    for (int k = 0; k < 3; k++) lora_registry_release(r, held[k]);
    settle(r);
    lora_registry_stats_t s = stats(r);
    ck_assert_int_le(s.n_resident, BOUND);
    ck_assert_int_eq(s.n_registered, N_MANY);
    ck_assert_uint_gt(s.evictions, 40);
    ck_assert_uint_ge(s.loads, N_MANY);
    ck_assert_uint_gt(s.hits, 0);
    ck_assert_uint_eq(s.load_failures, 0);
    pthread_mutex_lock(&ev_mu);
    ck_assert_int_le(ev_max_resident, BOUND);
    ck_assert_int_ge(ev_max_resident, 3);
    if (cache_bytes) ck_assert_uint_le(ev_max_bytes, cache_bytes);
    pthread_mutex_unlock(&ev_mu);
    reg_free(r);
    for (int i = 0; i < N_MANY; i++) lora_adapter_free(want[i]);
}

START_TEST(test_many_by_count) { run_many(0, BOUND); }
END_TEST

/* Writes every adapter from now on in F32, all one size, so that a bound in bytes counts
 * adapters; returns that size. */
static size_t f32_adapters(void) {
    adapters_dtype = CS_DTYPE_F32;
    lora_adapter_t *a = load_ref(write_adapter("size", 4, 1));
    size_t one = a->nbytes;
    lora_adapter_free(a);
    return one;
}

START_TEST(test_many_by_bytes) {
    size_t one = f32_adapters();
    run_many(BOUND * one + one / 2, 0);
    adapters_dtype = -1;
}
END_TEST

/* The host cache counts what is held: a BF16 adapter half an F32 one, known exactly at
 * registration (the probe reads only the config and the safetensors header). */
START_TEST(test_bytes_by_dtype) {
    adapters_dtype = CS_DTYPE_F32;
    lora_adapter_t *f = load_ref(write_adapter("f32", 4, 300));
    adapters_dtype = CS_DTYPE_BF16;
    lora_adapter_t *h[3];
    char hn[3][8];
    for (int i = 0; i < 3; i++) {
        snprintf(hn[i], sizeof hn[i], "h%d", i);
        h[i] = load_ref(write_adapter(hn[i], 4, 301 + i));
    }
    adapters_dtype = -1;
    ck_assert_uint_eq(2 * h[0]->nbytes, f->nbytes);
    lora_registry_t *r = reg_new(f->nbytes + 2 * h[0]->nbytes, 0); /* room for f32 + two bf16 */
    ck_assert_int_eq(lora_registry_add(r, "f32", f->path, NULL), CS_OK);
    for (int i = 0; i < 3; i++) ck_assert_int_eq(lora_registry_add(r, hn[i], h[i]->path, NULL), CS_OK);
    /* known before any load */
    lora_adapter_info_t info;
    ck_assert_int_eq(lora_registry_info(r, "h1", 0, &info), CS_OK);
    ck_assert_int_eq(state_of(r, "h1"), LORA_ON_DISK);
    ck_assert_uint_eq(info.nbytes, h[1]->nbytes);
    ck_assert_int_eq(info.dtype, CS_DTYPE_BF16);
    ck_assert_int_eq(info.max_rank, 4);
    ck_assert_int_eq(info.min_rank, 4);
    ck_assert_uint_eq(info.targets, (1u << LORA_Q) | (1u << LORA_V) | (1u << LORA_DOWN));
    ck_assert_int_eq(info.n_modules, N_LAYERS * 3);
    ck_assert_int_eq(info.rank_sum, 4L * N_LAYERS * 3);
    ck_assert_int_eq(lora_registry_info(r, "f32", 0, &info), CS_OK);
    ck_assert_int_eq(info.dtype, CS_DTYPE_F32);
    ck_assert_uint_eq(info.nbytes, f->nbytes);
    ck_assert_int_eq(lora_registry_info(r, "nope", 0, &info), CS_ENOTFOUND);

    lora_ref_t *rf = acquire_ok(r, "f32"), *r0 = acquire_ok(r, "h0"), *r1 = acquire_ok(r, "h1");
    ck_assert(adapters_equal(r0->adapter, h[0]) && adapters_equal(rf->adapter, f));
    lora_registry_stats_t st = stats(r);
    ck_assert_int_eq(st.n_resident, 3);
    ck_assert_uint_eq(st.bytes_resident, f->nbytes + 2 * h[0]->nbytes); /* exactly full */
    lora_ref_t *x = NULL;
    ck_assert_int_eq(lora_registry_acquire(r, "h2", &x), CS_EAGAIN); /* everything held: waits */
    lora_registry_release(r, r1);
    lora_ref_t *r2 = acquire_ok(r, "h2");
    ck_assert(adapters_equal(r2->adapter, h[2]));
    ck_assert_int_eq(state_of(r, "h1"), LORA_ON_DISK);
    st = stats(r);
    ck_assert_uint_eq(st.bytes_resident, f->nbytes + 2 * h[0]->nbytes);
    ck_assert_uint_eq(st.evictions, 1);
    lora_registry_release(r, rf);
    lora_registry_release(r, r0);
    lora_registry_release(r, r2);
    reg_free(r);
    lora_adapter_free(f);
    for (int i = 0; i < 3; i++) lora_adapter_free(h[i]);
}
END_TEST

/* hold 5, ask for a 6th: CS_EAGAIN (and nothing held is evicted) until a release */
static void run_pinned(size_t cache_bytes, int max_loras) {
    lora_adapter_t *want[7];
    char names[7][16];
    for (int i = 0; i < 7; i++) {
        snprintf(names[i], sizeof names[i], "p%d", i);
        want[i] = load_ref(write_adapter(names[i], 4, 200 + i));
    }
    lora_registry_t *r = reg_new(cache_bytes, max_loras);
    for (int i = 0; i < 7; i++) ck_assert_int_eq(lora_registry_add(r, names[i], want[i]->path, NULL), CS_OK);
    lora_ref_t *held[5];
    for (int i = 0; i < 5; i++) held[i] = acquire_ok(r, names[i]);

    lora_ref_t *x = NULL;
    ck_assert_int_eq(lora_registry_acquire(r, "p5", &x), CS_EAGAIN);
    for (int k = 0; k < 10; k++) {
        usleep(20000);
        ck_assert_int_eq(lora_registry_acquire(r, "p5", &x), CS_EAGAIN);
        ck_assert_ptr_null(x);
    }
    ck_assert_int_eq(state_of(r, "p5"), LORA_LOADING);
    lora_registry_stats_t s = stats(r);
    ck_assert_int_eq(s.n_resident, 5);
    ck_assert_int_eq(s.n_loading, 1);
    ck_assert_uint_eq(s.evictions, 0);
    for (int i = 0; i < 5; i++) {
        ck_assert_int_eq(state_of(r, names[i]), LORA_RESIDENT);
        ck_assert(adapters_equal(held[i]->adapter, want[i]));
    }
    /* a second waiter queues behind the first */
    ck_assert_int_eq(lora_registry_acquire(r, "p6", &x), CS_EAGAIN);

    lora_registry_release(r, held[2]);
    lora_ref_t *r5 = acquire_ok(r, "p5");
    ck_assert(adapters_equal(r5->adapter, want[5]));
    ck_assert_int_eq(state_of(r, "p2"), LORA_ON_DISK);   /* the released one made room */
    ck_assert_uint_eq(stats(r).evictions, 1);
    ck_assert_int_eq(state_of(r, "p6"), LORA_LOADING);   /* still no room for it */
    ck_assert_int_eq(lora_registry_acquire(r, "p6", &x), CS_EAGAIN);
    for (int i = 0; i < 5; i++)
        if (i != 2) ck_assert(adapters_equal(held[i]->adapter, want[i]));

    lora_registry_release(r, r5);
    lora_ref_t *r6 = acquire_ok(r, "p6");
    ck_assert(adapters_equal(r6->adapter, want[6]));
    ck_assert_int_eq(state_of(r, "p5"), LORA_ON_DISK);
    s = stats(r);
    ck_assert_int_eq(s.n_resident, 5);
    ck_assert_int_eq(s.n_loading, 0);
    lora_registry_release(r, r6);
    for (int i = 0; i < 5; i++)
        if (i != 2) lora_registry_release(r, held[i]);
    /* everything is evictable again: p2 comes back */
    lora_ref_t *r2 = acquire_ok(r, "p2");
    ck_assert(adapters_equal(r2->adapter, want[2]));
    lora_registry_release(r, r2);
    pthread_mutex_lock(&ev_mu);
    ck_assert_int_le(ev_max_resident, 5);
    pthread_mutex_unlock(&ev_mu);
    reg_free(r);
    for (int i = 0; i < 7; i++) lora_adapter_free(want[i]);
}

START_TEST(test_pinned_by_count) { run_pinned(0, 5); }
END_TEST

START_TEST(test_pinned_by_bytes) {
    size_t one = f32_adapters();
    run_pinned(5 * one + one - 1, 0);
    adapters_dtype = -1;
}
END_TEST

static void truncate_file(const char *dir, const char *file, double frac) {
    char p[600];
    snprintf(p, sizeof p, "%s/%s", dir, file);
    struct stat sb;
    ck_assert_int_eq(stat(p, &sb), 0);
    ck_assert_int_eq(truncate(p, (off_t)((double)sb.st_size * frac)), 0);
}

static void expect_fail(lora_registry_t *r, const char *name, int code, const char *file) {
    lora_ref_t *ref = NULL;
    int rc = acquire_wait(r, name, &ref);
    ck_assert_msg(rc == code, "%s: got %d (%s), want %d", name, rc, cs_error_last(), code);
    ck_assert_ptr_null(ref);
    char q[64];
    snprintf(q, sizeof q, "adapter '%s'", name);
    ck_assert_msg(strstr(cs_error_last(), q) && strstr(cs_error_last(), file), "%s: message '%s' lacks '%s' or '%s'",
                  name, cs_error_last(), q, file);
    ck_assert_int_eq(state_of(r, name), LORA_FAILED);
}

START_TEST(test_corrupt) {
    lora_adapter_t *g0 = load_ref(write_adapter("good0", 4, 300));
    lora_adapter_t *g1 = load_ref(write_adapter("good1", 2, 301));
    const char *d = write_adapter("trunc", 4, 302);
    truncate_file(d, "adapter_model.safetensors", 0.6);
    d = write_adapter("badjson", 4, 303);
    char p[600];
    snprintf(p, sizeof p, "%s/adapter_config.json", d);
    FILE *f = fopen(p, "w");
    fputs("{\"peft_type\": \"LORA\", \"r\": 4,", f);
    fclose(f);
    write_adapter_shape("shape", 4, 3, 304);
    write_adapter("hdr", 4, 305);
    snprintf(p, sizeof p, "%s/hdr", root);
    truncate_file(p, "adapter_model.safetensors", 0.0);

    lora_registry_t *r = reg_new(0, 3);
    static const char *const all[] = { "good0", "trunc", "badjson", "good1", "shape", "hdr", "missing" };
    for (size_t i = 0; i < CS_ARRAY_LEN(all); i++) {
        snprintf(p, sizeof p, "%s/%s", root, all[i]);
        ck_assert_int_eq(lora_registry_add(r, all[i], p, NULL), CS_OK);
    }
    lora_ref_t *x;
    for (size_t i = 0; i < CS_ARRAY_LEN(all); i++) {   /* all queued together */
        int rc = lora_registry_acquire(r, all[i], &x);
        ck_assert_int_eq(rc, CS_EAGAIN);
    }
    expect_fail(r, "trunc", CS_EFORMAT, "adapter_model.safetensors");
    expect_fail(r, "badjson", CS_EFORMAT, "adapter_config.json");
    expect_fail(r, "shape", CS_ESHAPE, "lora_A.weight");
    expect_fail(r, "hdr", CS_EFORMAT, "adapter_model.safetensors");
    expect_fail(r, "missing", CS_ENOTFOUND, "adapter_config.json");
    lora_ref_t *a = acquire_ok(r, "good0"), *b = acquire_ok(r, "good1");
    ck_assert(adapters_equal(a->adapter, g0));
    ck_assert(adapters_equal(b->adapter, g1));
    /* the errors match lora_adapter_load's */
    lora_adapter_t *t = NULL;
    snprintf(p, sizeof p, "%s/shape", root);
    ck_assert_int_eq(lora_adapter_load(p, &base, &t), CS_ESHAPE);
    snprintf(p, sizeof p, "%s/trunc", root);
    ck_assert_int_eq(lora_adapter_load(p, &base, &t), CS_EFORMAT);

    /* failed stays failed, without new loads; failures took no room */
    lora_registry_stats_t s = stats(r);
    ck_assert_uint_eq(s.load_failures, 5);
    ck_assert_int_eq(s.n_resident, 2);
    expect_fail(r, "trunc", CS_EFORMAT, "adapter_model.safetensors");
    ck_assert_uint_eq(stats(r).misses, s.misses);
    ck_assert_uint_eq(stats(r).load_failures, 5);

    /* fixed on disk and re-added: loads */
    d = write_adapter("trunc", 4, 302);
    lora_adapter_t *tw = load_ref(d);
    int v;
    ck_assert_int_eq(lora_registry_add(r, "trunc", d, &v), CS_OK);
    ck_assert_int_eq(v, 2);
    lora_ref_t *c = acquire_ok(r, "trunc");
    ck_assert(adapters_equal(c->adapter, tw));
    ck_assert_int_eq(c->version, 2);
    lora_registry_release(r, a);
    lora_registry_release(r, b);
    lora_registry_release(r, c);
    reg_free(r);

    /* an adapter larger than the whole cache fails clearly */
    r = reg_new(g0->nbytes - 1, 0);
    ck_assert_int_eq(lora_registry_add(r, "big", g0->path, NULL), CS_OK);
    ck_assert_int_eq(lora_registry_add(r, "small", g1->path, NULL), CS_OK);
    lora_ref_t *y = NULL;
    ck_assert_int_eq(acquire_wait(r, "big", &y), CS_ENOMEM);
    ck_assert_msg(strstr(cs_error_last(), "more than the whole host cache") && strstr(cs_error_last(), "big"),
                  "message: %s", cs_error_last());
    y = acquire_ok(r, "small");
    lora_registry_release(r, y);
    reg_free(r);
    lora_adapter_free(g0);
    lora_adapter_free(g1);
    lora_adapter_free(tw);
}
END_TEST

START_TEST(test_versions) {
    lora_adapter_t *wa = load_ref(write_adapter("va", 4, 400));
    lora_adapter_t *wb = load_ref(write_adapter("vb", 2, 401));
    lora_registry_t *r = reg_new(0, 0);
    int v;
    ck_assert_int_eq(lora_registry_add(r, "v", wa->path, &v), CS_OK);
    ck_assert_int_eq(v, 1);
    lora_ref_t *r1 = acquire_ok(r, "v");
    ck_assert(adapters_equal(r1->adapter, wa));
    ck_assert_int_eq(r1->version, 1);

    ck_assert_int_eq(lora_registry_add(r, "v", wb->path, &v), CS_OK);
    ck_assert_int_eq(v, 2);
    lora_state st;
    ck_assert_int_eq(lora_registry_state(r, "v", &st, &v), CS_OK);
    ck_assert_int_eq(st, LORA_ON_DISK);
    ck_assert_int_eq(v, 2);
    lora_ref_t *r2 = acquire_ok(r, "v");
    ck_assert_int_eq(r2->version, 2);
    ck_assert(adapters_equal(r2->adapter, wb));
    ck_assert(adapters_equal(r1->adapter, wa));    /* the old holder keeps the old weights */
    ck_assert_int_eq(r1->version, 1);
    ck_assert_int_eq(stats(r).n_resident, 2);
    ck_assert_int_eq(stats(r).n_registered, 1);
    lora_registry_release(r, r1);                  /* old version freed */
    lora_registry_stats_t s = stats(r);
    ck_assert_int_eq(s.n_resident, 1);
    ck_assert_uint_eq(s.bytes_resident, wb->nbytes);
    lora_registry_release(r, r2);

    /* re-added while loading: the first load is dropped, the new version wins */
    ck_assert_int_eq(lora_registry_add(r, "w", wa->path, NULL), CS_OK);
    lora_ref_t *x;
    ck_assert_int_eq(lora_registry_acquire(r, "w", &x), CS_EAGAIN);
    ck_assert_int_eq(lora_registry_add(r, "w", wb->path, &v), CS_OK);
    ck_assert_int_eq(v, 2);
    lora_ref_t *w = acquire_ok(r, "w");
    ck_assert_int_eq(w->version, 2);
    ck_assert(adapters_equal(w->adapter, wb));
    lora_registry_release(r, w);
    settle(r);
    ck_assert_int_eq(stats(r).n_resident, 2);       /* v v2, w v2 */

    /* re-added while resident and unheld: the old copy goes at once */
    ck_assert_int_eq(lora_registry_add(r, "w", wa->path, &v), CS_OK);
    ck_assert_int_eq(v, 3);
    ck_assert_int_eq(stats(r).n_resident, 1);
    w = acquire_ok(r, "w");
    ck_assert(adapters_equal(w->adapter, wa));
    lora_registry_release(r, w);
    reg_free(r);
    lora_adapter_free(wa);
    lora_adapter_free(wb);
}
END_TEST

START_TEST(test_remove) {
    lora_adapter_t *wa = load_ref(write_adapter("ra", 4, 500));
    lora_registry_t *r = reg_new(0, 0);
    ck_assert_int_eq(lora_registry_add(r, "x", wa->path, NULL), CS_OK);
    lora_ref_t *h = acquire_ok(r, "x");
    ck_assert_int_eq(lora_registry_remove(r, "x"), CS_OK);
    lora_ref_t *x = NULL;
    ck_assert_int_eq(lora_registry_acquire(r, "x", &x), CS_ENOTFOUND);
    ck_assert_int_eq(lora_registry_state(r, "x", NULL, NULL), CS_ENOTFOUND);
    ck_assert_int_eq(lora_registry_remove(r, "x"), CS_ENOTFOUND);
    ck_assert_int_eq(stats(r).n_registered, 0);
    ck_assert(adapters_equal(h->adapter, wa));     /* still valid while held */
    ck_assert_int_eq(stats(r).n_resident, 1);
    lora_registry_release(r, h);
    ck_assert_int_eq(stats(r).n_resident, 0);
    ck_assert_uint_eq(stats(r).bytes_resident, 0);
    int v;
    ck_assert_int_eq(lora_registry_add(r, "x", wa->path, &v), CS_OK);
    ck_assert_int_eq(v, 2);                         /* versions never repeat */
    /* removed while loading */
    ck_assert_int_eq(lora_registry_acquire(r, "x", &x), CS_EAGAIN);
    ck_assert_int_eq(lora_registry_remove(r, "x"), CS_OK);
    settle(r);
    ck_assert_int_eq(stats(r).n_resident, 0);
    reg_free(r);
    lora_adapter_free(wa);
}
END_TEST

/* ---- threads ---- */

enum { C_NAMES = 12, C_WORKERS = 4, C_ITERS = 150, C_READDS = 40 };

typedef struct conc {
    lora_registry_t *r;
    lora_adapter_t *wa[C_NAMES], *wb[C_NAMES];
    char names[C_NAMES][16];
    pthread_mutex_t mu;
    int errors;
    char first[512];
    int ok;
} conc_t;

static void conc_err(conc_t *c, const char *fmt, const char *name, int rc) {
    pthread_mutex_lock(&c->mu);
    if (c->errors++ == 0) snprintf(c->first, sizeof c->first, fmt, name, rc, cs_error_last());
    pthread_mutex_unlock(&c->mu);
}

static void *worker(void *arg) {
    conc_t *c = ((void **)arg)[0];
    unsigned seed = (unsigned)(uintptr_t)((void **)arg)[1];
    for (int it = 0; it < C_ITERS; it++) {
        int i = (int)(rand_r(&seed) % C_NAMES);
        lora_ref_t *ref = NULL;
        double t0 = cs_time_ms();
        int rc;
        for (;;) {
            uint64_t seen = ev_now();
            rc = lora_registry_acquire(c->r, c->names[i], &ref);
            if (rc != CS_EAGAIN || cs_time_ms() - t0 > 120000) break;
            ev_wait(seen, 50);
        }
        if (rc != CS_OK) {
            conc_err(c, "acquire %s: %d %s", c->names[i], rc);
            return NULL;
        }
        const lora_adapter_t *want = ref->version % 2 ? c->wa[i] : c->wb[i];
        if (strcmp(ref->name, c->names[i]) != 0 || !adapters_equal(ref->adapter, want))
            conc_err(c, "%s version %d: wrong weights", c->names[i], ref->version);
        if (rand_r(&seed) % 4 == 0) sched_yield();
        lora_registry_release(c->r, ref);
        pthread_mutex_lock(&c->mu);
        c->ok++;
        pthread_mutex_unlock(&c->mu);
    }
    return NULL;
}

static void *readder(void *arg) {
    conc_t *c = arg;
    int ver[C_NAMES];
    for (int i = 0; i < C_NAMES; i++) ver[i] = 1;
    for (int k = 0; k < C_READDS; k++) {
        int i = (k * 5) % C_NAMES, v;
        /* odd versions are the A weights, even ones B */
        int rc = lora_registry_add(c->r, c->names[i], (ver[i] + 1) % 2 ? c->wa[i]->path : c->wb[i]->path, &v);
        if (rc != CS_OK || v != ver[i] + 1) conc_err(c, "re-add %s: %d %s", c->names[i], rc);
        ver[i] = v;
        usleep(2000);
    }
    return NULL;
}

START_TEST(test_concurrent) {
    conc_t *c = calloc(1, sizeof *c);
    pthread_mutex_init(&c->mu, NULL);
    for (int i = 0; i < C_NAMES; i++) {
        snprintf(c->names[i], sizeof c->names[i], "c%d", i);
        char n[32];
        snprintf(n, sizeof n, "ca%d", i);
        c->wa[i] = load_ref(write_adapter(n, 2 + i % 3, 600 + i));
        snprintf(n, sizeof n, "cb%d", i);
        c->wb[i] = load_ref(write_adapter(n, 3, 700 + i));
    }
    c->r = reg_new(0, C_WORKERS);
    for (int i = 0; i < C_NAMES; i++) ck_assert_int_eq(lora_registry_add(c->r, c->names[i], c->wa[i]->path, NULL), CS_OK);
    pthread_t th[C_WORKERS + 1];
    void *args[C_WORKERS][2];
    for (int w = 0; w < C_WORKERS; w++) {
        args[w][0] = c;
        args[w][1] = (void *)(uintptr_t)(w * 7919 + 1);
        ck_assert_int_eq(pthread_create(&th[w], NULL, worker, args[w]), 0);
    }
    ck_assert_int_eq(pthread_create(&th[C_WORKERS], NULL, readder, c), 0);
    for (int w = 0; w <= C_WORKERS; w++) pthread_join(th[w], NULL);
    ck_assert_msg(c->errors == 0, "%d errors, first: %s", c->errors, c->first);
    ck_assert_int_eq(c->ok, C_WORKERS * C_ITERS);
    settle(c->r);
    lora_registry_stats_t s = stats(c->r);
    ck_assert_int_le(s.n_resident, C_WORKERS);
    ck_assert_int_eq(s.n_registered, C_NAMES);
    ck_assert_uint_eq(s.load_failures, 0);
    pthread_mutex_lock(&ev_mu);
    ck_assert_int_le(ev_max_resident, C_WORKERS);
    pthread_mutex_unlock(&ev_mu);
    reg_free(c->r);
    for (int i = 0; i < C_NAMES; i++) {
        lora_adapter_free(c->wa[i]);
        lora_adapter_free(c->wb[i]);
    }
    pthread_mutex_destroy(&c->mu);
    free(c);
}
END_TEST

START_TEST(test_fresh_grace) {
    /* one slot, two loads: the first, once loaded, is kept for its requester for a while
     * (so the second cannot evict it before it is taken), but not forever if nobody comes.
     * The states are made, not timed: a grace of an hour for the first half (nothing can end
     * it but the requester), a short one for the second (only the timer can end it). */
    lora_adapter_t *wa = load_ref(write_adapter("ga", 4, 900)), *wb = load_ref(write_adapter("gb", 4, 901));
    lora_registry_t *r = reg_new_ex(0, 1, 3600e3);
    ck_assert_int_eq(lora_registry_add(r, "a", wa->path, NULL), CS_OK);
    ck_assert_int_eq(lora_registry_add(r, "b", wb->path, NULL), CS_OK);
    lora_ref_t *x;
    ck_assert_int_eq(lora_registry_acquire(r, "a", &x), CS_EAGAIN);
    double t0 = cs_time_ms();
    while (state_of(r, "a") != LORA_RESIDENT) {
        ck_assert_msg(cs_time_ms() - t0 < 120000, "a never loaded");
        usleep(1000);
    }
    ck_assert_int_eq(lora_registry_acquire(r, "b", &x), CS_EAGAIN);
    usleep(50000); /* room for a wrong eviction to show (a correct registry makes none) */
    ck_assert_int_eq(state_of(r, "a"), LORA_RESIDENT);   /* not evicted for b during a's grace */
    ck_assert_int_eq(state_of(r, "b"), LORA_LOADING);    /* b waits for room */
    ck_assert_uint_eq(stats(r).evictions, 0);
    x = acquire_ok(r, "a");                               /* the requester takes it ... */
    ck_assert(adapters_equal(x->adapter, wa));
    ck_assert_int_eq(state_of(r, "b"), LORA_LOADING);    /* ... and holds it: b still waits */
    lora_registry_release(r, x);
    /* taken once, an adapter is an ordinary LRU entry again: the waiter evicts it at once
     * (with an hour's grace, only that lets b in before acquire_ok's bound) */
    x = acquire_ok(r, "b");
    ck_assert(adapters_equal(x->adapter, wb));
    ck_assert_int_eq(state_of(r, "a"), LORA_ON_DISK);
    lora_registry_release(r, x);
    reg_free(r);

    /* nobody comes for a: when its (short) grace ends, the timer lets b evict it */
    r = reg_new_ex(0, 1, 50);
    ck_assert_int_eq(lora_registry_add(r, "a", wa->path, NULL), CS_OK);
    ck_assert_int_eq(lora_registry_add(r, "b", wb->path, NULL), CS_OK);
    ck_assert_int_eq(lora_registry_acquire(r, "a", &x), CS_EAGAIN);
    t0 = cs_time_ms();
    while (state_of(r, "a") != LORA_RESIDENT) {
        ck_assert_msg(cs_time_ms() - t0 < 120000, "a never loaded");
        usleep(1000);
    }
    x = acquire_ok(r, "b");                               /* a's grace ends, b takes the slot */
    ck_assert(adapters_equal(x->adapter, wb));
    ck_assert_int_eq(state_of(r, "a"), LORA_ON_DISK);
    ck_assert_uint_eq(stats(r).evictions, 1);
    lora_registry_release(r, x);
    ck_assert_int_eq(stats(r).n_resident, 1);
    reg_free(r);
    lora_adapter_free(wa);
    lora_adapter_free(wb);
}
END_TEST

START_TEST(test_free_while_loading) {
    /* loads in flight, loads waiting for room, old versions loading: all dropped cleanly */
    lora_registry_t *r = reg_new(0, 2);
    char names[10][16];
    for (int i = 0; i < 10; i++) {
        snprintf(names[i], sizeof names[i], "f%d", i);
        const char *d = write_adapter(names[i], 4, 800 + i);
        ck_assert_int_eq(lora_registry_add(r, names[i], d, NULL), CS_OK);
    }
    lora_ref_t *x;
    for (int i = 0; i < 10; i++) ck_assert_int_eq(lora_registry_acquire(r, names[i], &x), CS_EAGAIN);
    char d[300];
    snprintf(d, sizeof d, "%s/f0", root);
    ck_assert_int_eq(lora_registry_add(r, "f1", d, NULL), CS_OK);
    reg_free(r);
}
END_TEST

/* keep_versions, staged versions, pinning and deleting: an acquire by version gets exactly
 * those weights; versions beyond keep_versions go once unheld; the active version and held
 * ones cannot be deleted; a dropped version is reported to on_dropped once freed. */
static int dropped[16], n_dropped;
static void on_dropped(void *user, const char *name, int version, const char *dir) {
    (void)user; (void)dir;
    ck_assert_str_eq(name, "k");
    if (n_dropped < 16) dropped[n_dropped++] = version;
}

static lora_ref_t *acquire_version_ok(lora_registry_t *r, const char *name, int version) {
    lora_ref_t *ref = NULL;
    double t0 = cs_time_ms();
    for (;;) {
        uint64_t seen = ev_now();
        int rc = lora_registry_acquire_version(r, name, version, &ref);
        if (rc == CS_OK) break;
        ck_assert_msg(rc == CS_EAGAIN, "acquire %s v%d: %s", name, version, cs_error_last());
        ck_assert(cs_time_ms() - t0 < 120000);
        ev_wait(seen, 200);
    }
    if (version) ck_assert_int_eq(ref->version, version);
    return ref;
}

START_TEST(test_kept_versions) {
    const char *d[6];
    lora_adapter_t *want[6];
    char nm[16];
    for (int i = 1; i <= 5; i++) {
        snprintf(nm, sizeof nm, "kv%d", i);
        d[i] = strdup(write_adapter(nm, 4, 200 + i));
        want[i] = load_ref(d[i]);
    }
    lora_registry_params_t p = { .cfg = &base, .on_loaded = on_loaded, .on_dropped = on_dropped };
    lora_registry_t *r = NULL;
    ck_assert_int_eq(lora_registry_new(&p, &r), CS_OK);
    n_dropped = 0;
    int v;
    ck_assert_int_eq(lora_registry_add_ex(r, "k", d[1], 1, false, 0, &v), CS_EINVAL); /* first must be active */
    ck_assert_int_eq(lora_registry_add_ex(r, "k", d[1], 1, true, 3, &v), CS_OK);
    ck_assert_int_eq(lora_registry_add_ex(r, "k", d[2], 2, true, 0, &v), CS_OK);
    ck_assert_int_eq(lora_registry_add_ex(r, "k", d[3], 3, false, 0, &v), CS_OK);  /* staged */
    lora_version_info_t vi[8];
    ck_assert_int_eq(lora_registry_versions(r, "k", vi, 8), 3);
    ck_assert(vi[0].version == 1 && !vi[0].active && vi[1].version == 2 && vi[1].active && vi[2].version == 3 && !vi[2].active);
    lora_ref_t *a = acquire_version_ok(r, "k", 0), *b = acquire_version_ok(r, "k", 1), *c = acquire_version_ok(r, "k", 3);
    ck_assert_int_eq(a->version, 2);
    ck_assert(adapters_equal(a->adapter, want[2]) && adapters_equal(b->adapter, want[1]) && adapters_equal(c->adapter, want[3]));
    ck_assert_int_eq(lora_registry_remove_version(r, "k", 2), CS_EBUSY);     /* active */
    ck_assert_int_eq(lora_registry_remove_version(r, "k", 1), CS_EBUSY);     /* held */
    ck_assert(strstr(cs_error_last(), "in use") != NULL);
    ck_assert_int_eq(lora_registry_remove_version(r, "k", 9), CS_ENOTFOUND);
    ck_assert_int_eq(lora_registry_activate(r, "k", 3, 0, NULL, 0), CS_OK);
    int cur;
    ck_assert_int_eq(lora_registry_state(r, "k", NULL, &cur), CS_OK);
    ck_assert_int_eq(cur, 3);
    /* a fourth version with keep 3: version 1 (oldest, not active) is dropped but still held */
    ck_assert_int_eq(lora_registry_add_ex(r, "k", d[4], 4, true, 0, &v), CS_OK);
    ck_assert_int_eq(lora_registry_versions(r, "k", vi, 8), 3);
    ck_assert(vi[0].version == 2 && vi[2].version == 4 && vi[2].active);
    lora_ref_t *x = NULL;
    ck_assert_int_eq(lora_registry_acquire_version(r, "k", 1, &x), CS_ENOTFOUND);
    ck_assert(strstr(cs_error_last(), "kept versions: 2, 3, 4") != NULL);
    ck_assert(adapters_equal(b->adapter, want[1]));   /* the holder keeps its weights */
    ck_assert_int_eq(n_dropped, 0);
    lora_registry_release(r, b);
    ck_assert_int_eq(n_dropped, 1);
    ck_assert_int_eq(dropped[0], 1);
    /* keep 1 from now on: 2 and 3 go (3 once released), 5 is active */
    ck_assert_int_eq(lora_registry_add_ex(r, "k", d[5], 5, true, 1, &v), CS_OK);
    ck_assert_int_eq(lora_registry_versions(r, "k", vi, 8), 1);
    ck_assert_int_eq(vi[0].version, 5);
    lora_registry_release(r, a);
    lora_registry_release(r, c);
    ck_assert_int_eq(n_dropped, 4);                   /* 1, then 2, 3 and 4 */
    lora_ref_t *e = acquire_version_ok(r, "k", 5);
    ck_assert(adapters_equal(e->adapter, want[5]));
    lora_registry_release(r, e);
    /* a pinned request holds its version before it acquires it: keep_versions passes over it
     * and DELETE is refused until it is unpinned */
    lora_pin_t *pin = NULL;
    ck_assert_int_eq(lora_registry_pin(r, "k", 4, &pin), CS_ENOTFOUND);
    ck_assert_int_eq(lora_registry_pin(r, "k", 5, &pin), CS_OK);
    ck_assert_int_eq(lora_registry_add_ex(r, "k", d[1], 6, true, 0, &v), CS_OK);
    ck_assert_int_eq(lora_registry_versions(r, "k", vi, 8), 2);
    ck_assert_int_eq(lora_registry_remove_version(r, "k", 5), CS_EBUSY);
    lora_ref_t *pr = NULL;
    double t0 = cs_time_ms();
    int prc;
    while ((prc = lora_registry_acquire_pinned(r, pin, &pr)) == CS_EAGAIN) {
        ck_assert(cs_time_ms() - t0 < 120000);
        usleep(1000);
    }
    ck_assert_int_eq(prc, CS_OK);
    ck_assert(pr->version == 5 && adapters_equal(pr->adapter, want[5]));
    lora_registry_release(r, pr);
    lora_registry_unpin(r, pin);
    ck_assert_int_eq(n_dropped, 4);
    ck_assert_int_eq(lora_registry_remove_version(r, "k", 5), CS_OK);
    ck_assert_int_eq(n_dropped, 5);
    ck_assert_int_eq(lora_registry_remove(r, "k"), CS_OK);
    ck_assert_int_eq(n_dropped, 6);
    lora_registry_free(r);
    for (int i = 1; i <= 5; i++) { lora_adapter_free(want[i]); free((void *)d[i]); }
}
END_TEST


/* ---- the device tier ---- */
static lora_registry_t *reg_new_device(backend_t *dev, size_t cache_bytes, int max_loras, size_t device_bytes,
                                       int device_slots) {
    lora_registry_params_t p = { .cfg = &base, .cache_bytes = cache_bytes, .max_loras = max_loras,
                                 .on_loaded = on_loaded, .device = dev, .device_bytes = device_bytes,
                                 .device_slots = device_slots };
    lora_registry_t *r = NULL;
    ck_assert_msg(lora_registry_new(&p, &r) == CS_OK, "lora_registry_new: %s", cs_error_last());
    pthread_mutex_lock(&ev_mu);
    ev_reg = r;
    pthread_mutex_unlock(&ev_mu);
    return r;
}

static bool on_device(lora_registry_t *r, const char *name) {
    lora_version_info_t v[4];
    ck_assert_int_eq(lora_registry_versions(r, name, v, 4), 1);
    return v[0].on_device;
}

/* Slots have their own budget, LRU and references: a request holds a device reference only
 * while it runs, so a slot nobody runs on is evicted for one that is wanted, one in use never
 * is (CS_EAGAIN instead), and the host copy is not freed before its slot. On the strict
 * device: the slot's bytes crossed the link, and the slot holds the adapter's weights. */
START_TEST(test_device_tier) {
    backend_t *dev = strict_device_new(&(strict_device_params_t){.cpu = {.n_threads = 1}});
    ck_assert_ptr_nonnull(dev);
    const char *names[4] = {"d0", "d1", "d2", "d3"};
    lora_adapter_t *want[4];
    for (int i = 0; i < 4; i++) want[i] = load_ref(write_adapter(names[i], 4, 400 + i)); /* F32 and BF16 */
    /* host: 3 adapters; device: 2 slots */
    lora_registry_t *r = reg_new_device(dev, 0, 3, 0, 2);
    for (int i = 0; i < 4; i++) ck_assert_int_eq(lora_registry_add(r, names[i], want[i]->path, NULL), CS_OK);
    lora_ref_t *h[4] = {0};
    for (int i = 0; i < 3; i++) h[i] = acquire_ok(r, names[i]);
    ck_assert(!on_device(r, "d0"));

    backend_stats_t b0, b1;
    backend_get_stats(dev, &b0);
    backend_adapter_t *s0, *s1, *s2, *x;
    ck_assert_int_eq(lora_registry_device_acquire(r, h[0], &s0), CS_OK);
    ck_assert_ptr_nonnull(s0);
    backend_get_stats(dev, &b1);
    ck_assert_uint_eq(b1.h2d_bytes - b0.h2d_bytes, want[0]->nbytes); /* A, B, Bᵀ in their dtype */
    ck_assert_uint_eq(backend_adapter_bytes(dev, s0), want[0]->nbytes);
    ck_assert(on_device(r, "d0"));
    ck_assert_int_eq(lora_registry_device_acquire(r, h[0], &x), CS_OK); /* a second sequence: the same slot */
    ck_assert_ptr_eq(x, s0);
    ck_assert_int_eq(lora_registry_device_acquire(r, h[1], &s1), CS_OK);
    lora_registry_stats_t st = stats(r);
    ck_assert_int_eq(st.n_device, 2);
    ck_assert_uint_eq(st.device_bytes, want[0]->nbytes + want[1]->nbytes);
    ck_assert_uint_eq(st.device_uploads, 2);
    ck_assert_uint_eq(st.device_hits, 1);
    lora_version_info_t v;
    ck_assert_int_eq(lora_registry_versions(r, "d0", &v, 1), 1);
    ck_assert_int_eq(v.device_refs, 2);

    /* both slots run: the third waits, nothing is evicted */
    ck_assert_int_eq(lora_registry_device_acquire(r, h[2], &s2), CS_EAGAIN);
    ck_assert_ptr_null(s2);
    ck_assert(on_device(r, "d0") && on_device(r, "d1"));
    ck_assert_uint_eq(stats(r).device_evictions, 0);
    ck_assert_uint_eq(stats(r).device_waits, 1);
    /* d0's sequences stop running (preempted, finished): its slot goes to d2, d1's stays */
    lora_registry_device_release(r, h[0]);
    ck_assert_int_eq(lora_registry_device_acquire(r, h[2], &s2), CS_EAGAIN); /* one still runs on d0 */
    lora_registry_device_release(r, h[0]);
    ck_assert(on_device(r, "d0")); /* kept until the room is wanted */
    ck_assert_int_eq(lora_registry_device_acquire(r, h[2], &s2), CS_OK);
    ck_assert(!on_device(r, "d0") && on_device(r, "d1") && on_device(r, "d2"));
    st = stats(r);
    ck_assert_uint_eq(st.device_evictions, 1);
    ck_assert_int_eq(st.n_device, 2);
    ck_assert_int_eq(st.n_resident, 3); /* the host copy of d0 stays */
    ck_assert_int_eq(state_of(r, "d0"), LORA_RESIDENT);

    /* the host tier evicts d1 (slot unused, host unreferenced) for d3: its slot goes first */
    lora_registry_device_release(r, h[1]);
    lora_registry_release(r, h[1]);
    h[1] = NULL;
    h[3] = acquire_ok(r, "d3");
    ck_assert_int_eq(state_of(r, "d1"), LORA_ON_DISK);
    st = stats(r);
    ck_assert_int_eq(st.n_device, 1);
    ck_assert_uint_eq(st.device_bytes, want[2]->nbytes);
    lora_registry_device_release(r, h[2]);
    for (int i = 0; i < 4; i++) lora_registry_release(r, h[i]);
    reg_free(r);

    /* a byte budget of the BF16 adapter's bytes: the F32 one (twice that) is refused */
    ck_assert_uint_eq(want[0]->nbytes, 2 * want[1]->nbytes); /* seed 400: F32, 401: BF16 */
    r = reg_new_device(dev, 0, 0, want[1]->nbytes, 0);
    for (int i = 0; i < 2; i++) ck_assert_int_eq(lora_registry_add(r, names[i], want[i]->path, NULL), CS_OK);
    lora_ref_t *a0 = acquire_ok(r, "d0"), *a1 = acquire_ok(r, "d1");
    ck_assert_int_eq(lora_registry_device_acquire(r, a0, &x), CS_ENOMEM);
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "device adapter budget"));
    ck_assert_int_eq(lora_registry_device_acquire(r, a1, &x), CS_OK);
    ck_assert_ptr_nonnull(x);
    lora_registry_device_release(r, a1);
    lora_registry_release(r, a0);
    lora_registry_release(r, a1);
    reg_free(r);
    backend_free(dev);
    for (int i = 0; i < 4; i++) lora_adapter_free(want[i]);
}
END_TEST

/* stream_host: an adapter file read chunk by chunk (4 KiB, CS_FAULT_LOAD_CHUNK) is handed
 * out once its header is in, its layers following; the test hold (CS_FAULT_HOLD_*) stops the
 * reads after 5 chunks (layer 0 of 3 complete) until a gate file goes, so the states below
 * are the loader's and not thread timing's. The device slot (lockstep) takes layers as they
 * are fed; every byte ends equal to lora_adapter_load's. A file truncated while held fails
 * its holder (lora_adapter_failed, lora_registry_ref_failed naming the file) and nobody else. */
static bool modules_equal_upto(const lora_adapter_t *x, const lora_adapter_t *y, int layers) {
    for (int l = 0; l < layers; l++)
        for (int t = 0; t < LORA_N_TARGETS; t++) {
            const lora_module_t *a = lora_adapter_module(x, l, (lora_target)t), *b = lora_adapter_module(y, l, (lora_target)t);
            if (a->rank != b->rank || a->dtype != b->dtype) return false;
            if (!a->rank) continue;
            size_t es = cs_dtype_size(a->dtype), na = (size_t)a->rank * a->d_in * es, nb = (size_t)a->rank * a->d_out * es;
            if (memcmp(a->a, b->a, na) || memcmp(a->b, b->b, nb) || memcmp(a->bt, b->bt, nb)) return false;
        }
    return true;
}

START_TEST(test_stream_host) {
    char gate[300];
    snprintf(gate, sizeof gate, "%s/gate", root);
    setenv("CS_FAULT_LOAD_CHUNK", "4096", 1);
    setenv("CS_FAULT_HOLD_PATH", "/hold_", 1);
    setenv("CS_FAULT_HOLD_CHUNKS", "5", 1);
    setenv("CS_FAULT_HOLD_WHILE", gate, 1);
    backend_t *dev = strict_device_new(&(strict_device_params_t){.cpu = {.n_threads = 1}, .lockstep = true});
    ck_assert_ptr_nonnull(dev);
    lora_registry_params_t p = { .cfg = &base, .on_loaded = on_loaded, .device = dev, .stream_group = 1,
                                 .stream_host = true };
    lora_registry_t *r = NULL;
    ck_assert_int_eq(lora_registry_new(&p, &r), CS_OK);
    pthread_mutex_lock(&ev_mu);
    ev_reg = r;
    pthread_mutex_unlock(&ev_mu);
    unsetenv("CS_FAULT_LOAD_CHUNK");
    unsetenv("CS_FAULT_HOLD_PATH");
    unsetenv("CS_FAULT_HOLD_CHUNKS");
    unsetenv("CS_FAULT_HOLD_WHILE");

    lora_adapter_t *want = load_ref(write_adapter("hold_a", 8, 402)); /* F32: 12 KiB a layer */
    FILE *gf = fopen(gate, "w");
    ck_assert_ptr_nonnull(gf);
    fclose(gf);
    ck_assert_int_eq(lora_registry_add(r, "hold_a", want->path, NULL), CS_OK);
    lora_ref_t *h = acquire_ok(r, "hold_a");          /* its header is in: handed out loading */
    ck_assert_int_eq(state_of(r, "hold_a"), LORA_LOADING);
    cs_flag_wait_geq(&h->adapter->host_layers, 1);
    ck_assert_uint_eq(cs_flag_load(&h->adapter->host_layers), 1); /* held: layer 1 is not all in */
    ck_assert(!lora_adapter_complete(h->adapter) && !lora_adapter_failed(h->adapter));
    ck_assert(modules_equal_upto(h->adapter, want, 1));
    backend_adapter_t *slot;
    ck_assert_int_eq(lora_registry_device_acquire(r, h, &slot), CS_OK);
    ck_assert_int_eq(lora_registry_device_arrived(r, h, slot), 1); /* lockstep: a group a call, as fed */
    ck_assert_int_eq(lora_registry_device_arrived(r, h, slot), 1);
    lora_registry_stats_t st = stats(r);
    ck_assert_uint_eq(st.partial_acquires, 1);
    ck_assert_uint_eq(st.host_streams, 1);
    ck_assert_int_eq(st.n_loading, 1);

    ck_assert_int_eq(unlink(gate), 0);                 /* the disk goes on */
    cs_flag_wait_geq(&h->adapter->host_layers, N_LAYERS);
    ck_assert(lora_adapter_complete(h->adapter));
    ck_assert(modules_equal_upto(h->adapter, want, N_LAYERS));
    settle(r); /* the load's end: every layer was fed to the slot before it */
    ck_assert_int_eq(lora_registry_device_arrived(r, h, slot), 2);
    ck_assert_int_eq(lora_registry_device_arrived(r, h, slot), 3);
    ck_assert_int_eq(state_of(r, "hold_a"), LORA_RESIDENT);
    ck_assert_uint_eq(stats(r).loads, 1);
    ck_assert_int_eq(lora_registry_ref_failed(r, h), CS_OK);
    lora_registry_device_release(r, h);
    lora_registry_release(r, h);
    lora_ref_t *again = acquire_ok(r, "hold_a");       /* a hit now */
    ck_assert(lora_adapter_complete(again->adapter));
    lora_registry_release(r, again);

    /* truncated while held: its holder fails with the load's error, the registry goes on */
    const char *bdir = write_adapter("hold_b", 8, 404);
    gf = fopen(gate, "w");
    ck_assert_ptr_nonnull(gf);
    fclose(gf);
    ck_assert_int_eq(lora_registry_add(r, "hold_b", bdir, NULL), CS_OK);
    h = acquire_ok(r, "hold_b");
    cs_flag_wait_geq(&h->adapter->host_layers, 1);
    ck_assert_int_eq(lora_registry_device_acquire(r, h, &slot), CS_OK);
    char st_path[600];
    snprintf(st_path, sizeof st_path, "%s/adapter_model.safetensors", bdir);
    ck_assert_int_eq(truncate(st_path, 5 * 4096 + 100), 0); /* inside layer 1 */
    ck_assert_int_eq(unlink(gate), 0);
    cs_flag_wait_geq(&h->adapter->host_layers, LORA_HOST_FAILED);
    ck_assert(lora_adapter_failed(h->adapter));
    settle(r);
    ck_assert_int_eq(state_of(r, "hold_b"), LORA_FAILED);
    ck_assert_int_eq(lora_registry_ref_failed(r, h), CS_EIO);
    ck_assert_msg(strstr(cs_error_last(), "hold_b") && strstr(cs_error_last(), "adapter_model.safetensors"),
                  "message: %s", cs_error_last());
    lora_registry_device_release(r, h);
    lora_registry_release(r, h);                       /* the part that came goes */
    st = stats(r);
    ck_assert_uint_eq(st.load_failures, 1);
    ck_assert_int_eq(st.n_device, 1);                  /* hold_a's slot only */
    h = acquire_ok(r, "hold_a");                       /* the other adapter is unharmed */
    ck_assert(modules_equal_upto(h->adapter, want, N_LAYERS));
    lora_registry_release(r, h);
    reg_free(r);
    backend_free(dev);
    lora_adapter_free(want);
}
END_TEST

int main(void) {
    Suite *s = suite_create("lora_registry");
    const TTest *const loader[] = {
        test_loader_files, test_loader_many_jobs, test_loader_pool, test_loader_stream,
    };
    cs_tcase_fixture(s, "loader", loader, CS_ARRAY_LEN(loader), 120, setup, teardown);
    const TTest *const registry[] = {
        test_basic, test_scan_resistant, test_many_by_count, test_many_by_bytes, test_bytes_by_dtype, test_device_tier,
        test_stream_host, test_pinned_by_count, test_pinned_by_bytes, test_corrupt, test_versions,
        test_kept_versions, test_remove, test_concurrent, test_fresh_grace, test_free_while_loading,
    };
    cs_tcase_fixture(s, "registry", registry, CS_ARRAY_LEN(registry), 300, setup, teardown);
    return cs_check_run(s, CK_FORK) ? EXIT_FAILURE : EXIT_SUCCESS;
}
