/* api_resolve.c: adapters found by name. --lora-resolve DIR: a request for a model that is
 * not registered but names DIR/<model>, a PEFT adapter, registers it then and runs on it (its
 * weights then load as any adapter's: the io_uring loader, the host and device tiers). The
 * first request for a name registers it; the ones that come meanwhile wait for that and do
 * not read the files again. --lora-modules-dir DIR: every adapter directory of DIR at start.
 *
 * A name is looked up only as one path component (no '/', not "." or "..", no leading '.'),
 * the path must pass the --lora-root checks (no symlink out), and every way a name can fail
 * answers the same 404 as a name that was never there: what is on disk is not told. */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "server/api_internal.h"

/* a name being registered: the first request does it, later ones wait on s->cv */
typedef struct resolving {
    char *name;
    int refs;                   /* the registering request and the waiting ones */
    int waiting;                /* requests waiting for it */
    bool done;
    int rc;                     /* CS_OK: registered */
    struct resolving *next;
} resolving_t;

static resolving_t **find(server_t *s, const char *name) {
    resolving_t **pp = &s->resolving;
    while (*pp && strcmp((*pp)->name, name)) pp = &(*pp)->next;
    return pp;
}

static void put(resolving_t *r) { /* under s->mu */
    if (--r->refs) return;
    free(r->name);
    free(r);
}

/* a name that can only mean one entry of a directory */
static bool lookup_name(const char *name) {
    return valid_adapter_name(name) && name[0] != '.' && !strchr(name, '\\');
}

/* CS_OK when some --lora-resolve directory holds NAME as an adapter that fits the base model
 * (registered now); else CS_ENOTFOUND, and a directory that is there but refused is logged */
static int register_from_dirs(server_t *s, const char *name) {
    for (int i = 0; i < s->n_resolve_dirs; i++) {
        char *path = cs_path_join(s->resolve_dirs[i], name), *real = NULL;
        perr_t e = {0};
        struct stat st;
        if (!path) return CS_ENOMEM;
        if (stat(path, &st) || !S_ISDIR(st.st_mode)) {
            free(path);
            continue;
        }
        int status = lora_path_check(s, path, &real, &e);
        if (!status) status = server_add_adapter_ex(s, name, real, false, true, &e) ? 400 : 0;
        pthread_mutex_lock(&s->mu);
        served_adapter_t *a = adapter_find(s, name);
        bool there = a && !a->unloading;
        pthread_mutex_unlock(&s->mu);
        if (status && there) { /* registered by a load or an upload meanwhile: not a refusal */
            free(real);
            free(path);
            return CS_OK;
        }
        free(real);
        if (!status) {
            free(path);
            fprintf(stderr, "caraserve: adapter '%s' registered from %s on its first request\n", name,
                    s->resolve_dirs[i]);
            return CS_OK;
        }
        fprintf(stderr, "caraserve: --lora-resolve %s: '%s' is refused: %s\n", s->resolve_dirs[i], name, e.msg);
        free(path);
    }
    return CS_ENOTFOUND;
}

/* for tests: CARASERVE_TEST_RESOLVE_GATE=NAME:N makes the request registering NAME wait (at
 * most 30 s) until N requests in all ask for it, so that "they come meanwhile" is a state a
 * test makes, not a race */
static int test_gate(const char *name) {
    const char *g = getenv("CARASERVE_TEST_RESOLVE_GATE"), *colon = g ? strrchr(g, ':') : NULL;
    if (!colon || (size_t)(colon - g) != strlen(name) || strncmp(g, name, (size_t)(colon - g))) return 0;
    return atoi(colon + 1);
}

int server_resolve_adapter(server_t *s, const char *name) {
    if (!s->n_resolve_dirs || !lookup_name(name)) return CS_ENOTFOUND;
    pthread_mutex_lock(&s->mu);
    served_adapter_t *a = adapter_find(s, name);
    if (a) { /* registered meanwhile (an unloading one is not brought back) */
        bool ok = !a->unloading;
        pthread_mutex_unlock(&s->mu);
        return ok ? CS_OK : CS_ENOTFOUND;
    }
    resolving_t **pp = find(s, name), *r = *pp;
    if (r) { /* another request registers it: wait for the outcome */
        r->refs++;
        r->waiting++;
        pthread_cond_broadcast(&s->cv);
        while (!r->done) pthread_cond_wait(&s->cv, &s->mu);
        int rc = r->rc;
        put(r);
        pthread_mutex_unlock(&s->mu);
        return rc;
    }
    r = calloc(1, sizeof *r);
    if (!r || !(r->name = strdup(name))) {
        free(r);
        pthread_mutex_unlock(&s->mu);
        return CS_ENOMEM;
    }
    r->refs = 1;
    r->next = s->resolving;
    s->resolving = r;
    int gate = test_gate(name);
    if (gate > 1) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += 30;
        while (r->waiting + 1 < gate && pthread_cond_timedwait(&s->cv, &s->mu, &until) == 0) {}
    }
    pthread_mutex_unlock(&s->mu);
    int rc = register_from_dirs(s, name);
    pthread_mutex_lock(&s->mu);
    r->rc = rc;
    r->done = true;
    *find(s, name) = r->next;
    if (rc) s->n_resolve_failed++;
    else s->n_resolved++;
    pthread_cond_broadcast(&s->cv);
    put(r);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

int server_modules_dir(server_t *s, const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return cs_error_set(CS_ENOTFOUND, "--lora-modules-dir %s: %s", dir, strerror(errno));
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.') continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 256;
            char **nn = realloc(names, cap * sizeof *nn);
            if (!nn) break;
            names = nn;
        }
        if (!(names[n] = strdup(de->d_name))) break;
        n++;
    }
    closedir(d);
    qsort(names, n, sizeof *names, cmp_str); /* the order /v1/models lists them in */
    double t0 = cs_time_ms();
    int added = 0, refused = 0;
    for (size_t i = 0; i < n; i++) {
        char *path = cs_path_join(dir, names[i]), *cfg = path ? cs_path_join(path, "adapter_config.json") : NULL;
        if (cfg && cs_file_exists(cfg)) {
            perr_t e = {0};
            char *real = realpath(path, NULL);
            if (!real || !valid_adapter_name(names[i]) || server_add_adapter_ex(s, names[i], real, false, true, &e)) {
                fprintf(stderr, "caraserve serve: --lora-modules-dir %s: '%s' is skipped: %s\n", dir, names[i],
                        !real ? strerror(errno) : e.msg[0] ? e.msg : "not a name an adapter may have");
                refused++;
            } else {
                added++;
            }
            free(real);
        }
        free(cfg);
        free(path);
        free(names[i]);
    }
    free(names);
    fprintf(stderr, "caraserve: --lora-modules-dir %s: %d adapters registered in %.2f s%s\n", dir, added,
            (cs_time_ms() - t0) / 1000, refused ? " (some skipped: see above)" : "");
    return added;
}
