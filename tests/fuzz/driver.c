/* driver.c: runs a fuzz target without libFuzzer (any compiler; make check, the ASan build):
 *   fuzz_TARGET [-mutations=N] [-seed=S] FILE|DIR...
 * every input named (a directory: each file in it, in name order), then N inputs mutated from
 * them (bit flips, interesting bytes, inserted, deleted, repeated and spliced ranges) from a
 * fixed seed, so a run is the same on every machine. A crash or a failed FUZZ_CHECK leaves
 * the input that caused it in ./fuzz-crash-TARGET (written from the signal handler) and
 * kills the run; the exit status is nonzero. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tests/fuzz/fuzz.h"

__attribute__((weak)) int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    return 0;
}

typedef struct {
    uint8_t *p;
    size_t n;
} input_t;

static input_t *corpus;
static size_t n_corpus, cap_corpus;
static const uint8_t *volatile cur;
static volatile size_t cur_n;
static char crash_path[300];

static void on_crash(int sig) {
    int fd = open(crash_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
        size_t off = 0;
        while (cur && off < cur_n) {
            ssize_t w = write(fd, cur + off, cur_n - off);
            if (w <= 0) break;
            off += (size_t)w;
        }
        close(fd);
    }
    static const char msg[] = "fuzz driver: the input that crashed is in ";
    if (write(2, msg, sizeof msg - 1) < 0 || write(2, crash_path, strlen(crash_path)) < 0 || write(2, "\n", 1) < 0) {}
    signal(sig, SIG_DFL);
    raise(sig);
}

static void add_input(uint8_t *p, size_t n) {
    if (n_corpus == cap_corpus) {
        cap_corpus = cap_corpus ? 2 * cap_corpus : 64;
        corpus = realloc(corpus, cap_corpus * sizeof *corpus);
        if (!corpus) abort();
    }
    corpus[n_corpus++] = (input_t){p, n};
}

static bool read_all(const char *path, uint8_t **out, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return false;
    size_t cap = 4096, len = 0;
    uint8_t *b = malloc(cap);
    size_t r;
    while (b && (r = fread(b + len, 1, cap - len, f)) > 0) {
        len += r;
        if (len == cap) b = realloc(b, cap *= 2);
    }
    fclose(f);
    if (!b) return false;
    *out = b;
    *n = len;
    return true;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static void run_one(const uint8_t *p, size_t n) {
    cur = p;
    cur_n = n;
    LLVMFuzzerTestOneInput(p, n);
    cur = NULL;
}

static void add_path(const char *path) {
    struct stat st;
    if (stat(path, &st)) {
        fprintf(stderr, "fuzz driver: %s: %s\n", path, strerror(errno));
        exit(2);
    }
    if (!S_ISDIR(st.st_mode)) {
        uint8_t *b;
        size_t n;
        if (!read_all(path, &b, &n)) {
            fprintf(stderr, "fuzz driver: cannot read %s\n", path);
            exit(2);
        }
        add_input(b, n);
        return;
    }
    DIR *d = opendir(path);
    if (!d) return;
    char **names = NULL;
    size_t nn = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.') continue;
        names = realloc(names, (nn + 1) * sizeof *names);
        names[nn++] = strdup(de->d_name);
    }
    closedir(d);
    qsort(names, nn, sizeof *names, cmp_str);
    for (size_t i = 0; i < nn; i++) {
        char sub[4096];
        snprintf(sub, sizeof sub, "%s/%s", path, names[i]);
        add_path(sub);
        free(names[i]);
    }
    free(names);
}

/* xorshift64*: the same sequence everywhere */
static uint64_t rng_state;
static uint64_t rnd(void) {
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 2685821657736338717ULL;
}
static size_t below(size_t n) { return n ? (size_t)(rnd() % n) : 0; }

static size_t mutate(uint8_t *b, size_t n, size_t cap) {
    static const uint8_t interesting[] = {0, 1, 0x7f, 0x80, 0xff, '"', '\\', '{', '}', '[', ']', ',', ':', '0', '9',
                                          '-', 'e', '.', ' ', '\n', '%', '<', '>', 0xc3, 0xe2, 0xf0};
    switch (rnd() % 7) {
    case 0: /* flip a bit */
        if (n) b[below(n)] ^= (uint8_t)(1u << (rnd() % 8));
        break;
    case 1: /* an interesting byte */
        if (n) b[below(n)] = interesting[below(sizeof interesting)];
        break;
    case 2: { /* insert random bytes */
        size_t k = 1 + below(8);
        if (n + k > cap) break;
        size_t at = below(n + 1);
        memmove(b + at + k, b + at, n - at);
        for (size_t i = 0; i < k; i++) b[at + i] = (uint8_t)rnd();
        n += k;
        break;
    }
    case 3: { /* delete a range */
        if (!n) break;
        size_t at = below(n), k = 1 + below(n - at < 16 ? n - at : 16);
        memmove(b + at, b + at + k, n - at - k);
        n -= k;
        break;
    }
    case 4: { /* repeat a range */
        if (!n) break;
        size_t at = below(n), k = 1 + below(n - at < 32 ? n - at : 32);
        if (n + k > cap) break;
        size_t to = below(n + 1);
        uint8_t tmp[32];
        memcpy(tmp, b + at, k);
        memmove(b + to + k, b + to, n - to);
        memcpy(b + to, tmp, k);
        n += k;
        break;
    }
    case 5: { /* splice in a range of another input */
        const input_t *o = &corpus[below(n_corpus)];
        if (!o->n) break;
        size_t at = below(o->n), k = 1 + below(o->n - at < 64 ? o->n - at : 64);
        if (n + k > cap) break;
        size_t to = below(n + 1);
        memmove(b + to + k, b + to, n - to);
        memcpy(b + to, o->p + at, k);
        n += k;
        break;
    }
    default: /* truncate */
        if (n) n = below(n + 1);
        break;
    }
    return n;
}

int main(int argc, char **argv) {
    long mutations = 0;
    uint64_t seed = 1;
    const char *name = strrchr(argv[0], '/');
    name = name ? name + 1 : argv[0];
    snprintf(crash_path, sizeof crash_path, "fuzz-crash-%s", name);
    LLVMFuzzerInitialize(&argc, &argv);
    for (int i = 1; i < argc; i++) {
        if (!strncmp(argv[i], "-mutations=", 11)) mutations = atol(argv[i] + 11);
        else if (!strncmp(argv[i], "-seed=", 6)) seed = strtoull(argv[i] + 6, NULL, 10);
        else if (argv[i][0] == '-') continue; /* libFuzzer's flags mean nothing here */
        else add_path(argv[i]);
    }
    int sigs[] = {SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL};
    for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++) signal(sigs[i], on_crash);
    for (size_t i = 0; i < n_corpus; i++) run_one(corpus[i].p, corpus[i].n);
    long seeds_accepted = fuzz_accepted;
    if (!n_corpus && mutations) add_input(calloc(1, 1), 0);
    rng_state = seed * 0x9E3779B97F4A7C15ULL + 1;
    size_t cap = 1 << 16;
    uint8_t *buf = malloc(cap);
    for (long m = 0; m < mutations; m++) {
        const input_t *src = &corpus[below(n_corpus)];
        size_t n = src->n < cap ? src->n : cap;
        memcpy(buf, src->p, n);
        int k = 1 + (int)below(4);
        for (int i = 0; i < k; i++) n = mutate(buf, n, cap);
        /* a copy of exactly n bytes, so ASan sees a read past the input */
        uint8_t *in = malloc(n ? n : 1);
        memcpy(in, buf, n);
        run_one(in, n);
        free(in);
    }
    free(buf);
    for (size_t i = 0; i < n_corpus; i++) free(corpus[i].p);
    free(corpus);
    long seeds_ok = seeds_accepted;
    fprintf(stderr, "%s: %zu inputs (%ld accepted) and %ld mutations (%ld accepted): no crash\n", name, n_corpus,
            seeds_ok, mutations, fuzz_accepted - seeds_ok);
    return 0;
}
