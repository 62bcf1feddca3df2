/* common.c: error strings, the thread-local last-error message, dtype tables, the
 * half-precision conversions every layer uses and the small helpers of several layers (byte
 * strings, UTF-8, JSON fields). */
#include "base/common.h"

#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>

static _Thread_local char cs_errbuf[1024];
int cs_log_verbose = 0;

const char *cs_strerror(int status) {
    switch (status) {
    case CS_OK: return "ok";
    case CS_EINVAL: return "invalid argument";
    case CS_ENOMEM: return "out of memory";
    case CS_EIO: return "I/O error";
    case CS_EFORMAT: return "malformed input";
    case CS_EUNSUPPORTED: return "unsupported";
    case CS_ENOTFOUND: return "not found";
    case CS_ESHAPE: return "shape mismatch";
    case CS_EAGAIN: return "not ready, try again";
    case CS_EBUSY: return "in use";
    default: return "unknown error";
    }
}

int cs_error_set(int status, const char *fmt, ...) {
    /* formatted aside first: callers wrap the last message ("weight X: %s", cs_error_last()) */
    char tmp[sizeof cs_errbuf];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    memcpy(cs_errbuf, tmp, sizeof tmp);
    return status;
}

const char *cs_error_last(void) { return cs_errbuf[0] ? cs_errbuf : "no error message"; }
void cs_error_clear(void) { cs_errbuf[0] = 0; }

void cs_log(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

void cs_assert_fail(const char *file, int line, const char *expr) {
    fprintf(stderr, "%s:%d: assertion failed: %s\n", file, line, expr);
    abort();
}

static const struct { const char *name; size_t size; int block; } dtype_tab[CS_DTYPE_COUNT] = {
    [CS_DTYPE_F32] = {"F32", 4, 1},  [CS_DTYPE_F16] = {"F16", 2, 1}, [CS_DTYPE_BF16] = {"BF16", 2, 1},
    [CS_DTYPE_F64] = {"F64", 8, 1},  [CS_DTYPE_I64] = {"I64", 8, 1}, [CS_DTYPE_I32] = {"I32", 4, 1},
    [CS_DTYPE_I16] = {"I16", 2, 1},  [CS_DTYPE_I8] = {"I8", 1, 1},   [CS_DTYPE_U8] = {"U8", 1, 1},
    [CS_DTYPE_BOOL] = {"BOOL", 1, 1},
    [CS_DTYPE_Q4_0] = {"Q4_0", 18, 32}, [CS_DTYPE_Q4_1] = {"Q4_1", 20, 32}, [CS_DTYPE_Q5_0] = {"Q5_0", 22, 32},
    [CS_DTYPE_Q5_1] = {"Q5_1", 24, 32}, [CS_DTYPE_Q8_0] = {"Q8_0", 34, 32}, [CS_DTYPE_Q4_K] = {"Q4_K", 144, 256},
    [CS_DTYPE_Q5_K] = {"Q5_K", 176, 256}, [CS_DTYPE_Q6_K] = {"Q6_K", 210, 256},
};

const char *cs_dtype_name(cs_dtype t) { return (unsigned)t < CS_DTYPE_COUNT ? dtype_tab[t].name : "?"; }
size_t cs_dtype_size(cs_dtype t) { return (unsigned)t < CS_DTYPE_COUNT ? dtype_tab[t].size : 0; }
int cs_dtype_block(cs_dtype t) { return (unsigned)t < CS_DTYPE_COUNT ? dtype_tab[t].block : 0; }

size_t cs_dtype_row_bytes(cs_dtype t, int64_t n) {
    int b = cs_dtype_block(t);
    if (b <= 0 || n < 0 || n % b) return 0;
    return (size_t)(n / b) * dtype_tab[t].size;
}

int cs_dtype_from_name(const char *name) {
    for (int i = 0; i < CS_DTYPE_PLAIN_COUNT; i++)
        if (strcmp(dtype_tab[i].name, name) == 0) return i;
    return -1;
}

float cs_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    union { uint32_t u; float f; } v;
    if (exp == 0) {
        if (mant == 0) { v.u = sign; return v.f; }
        float f = ldexpf((float)mant, -24); /* subnormal */
        return sign ? -f : f;
    }
    if (exp == 31) v.u = sign | 0x7f800000u | (mant << 13);
    else v.u = sign | ((exp + 112) << 23) | (mant << 13);
    return v.f;
}

uint16_t cs_f32_to_f16(float f) {
    union { uint32_t u; float f; } v = { .f = f };
    uint32_t sign = (v.u >> 16) & 0x8000, a = v.u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00);          /* NaN */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);         /* overflow -> inf */
    if (a < 0x38800000u) {                                          /* subnormal or zero */
        float r = fabsf(f) * 16777216.0f;                           /* 2^24 */
        return (uint16_t)(sign | (uint32_t)nearbyintf(r));
    }
    uint32_t mant = a & 0x7fffff, exp = (a >> 23) - 112;
    uint32_t h = (exp << 10) | (mant >> 13);
    uint32_t rem = mant & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
    return (uint16_t)(sign | h);
}

void cs_to_f32(float *dst, const void *src, cs_dtype t, size_t n) {
    switch (t) {
    case CS_DTYPE_F32: memcpy(dst, src, n * 4); break;
    case CS_DTYPE_BF16: {
        const uint16_t *s = src;
        for (size_t i = 0; i < n; i++) dst[i] = cs_bf16_to_f32(s[i]);
        break;
    }
    case CS_DTYPE_F16: {
        const uint16_t *s = src;
        for (size_t i = 0; i < n; i++) dst[i] = cs_f16_to_f32(s[i]);
        break;
    }
    default: CS_ASSERT(!"cs_to_f32: unsupported dtype");
    }
}

void *cs_aligned_alloc_uninit(size_t align, size_t size) {
    size_t sz = (size + align - 1) / align * align;
    return aligned_alloc(align, sz ? sz : align);
}

void *cs_huge_alloc(size_t n, size_t *len_out) {
    size_t huge = (size_t)2 << 20, len = (n + 4095) & ~(size_t)4095;
    char *raw = mmap(NULL, len + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return NULL;
    char *p = (char *)(((uintptr_t)raw + huge - 1) & ~(uintptr_t)(huge - 1));
    if (p > raw) munmap(raw, (size_t)(p - raw));
    if (raw + len + huge > p + len) munmap(p + len, (size_t)(raw + len + huge - (p + len)));
#ifdef MADV_HUGEPAGE
    (void)madvise(p, len, MADV_HUGEPAGE);
#endif
    *len_out = len;
    return p;
}

void cs_huge_free(void *p, size_t len) {
    if (p) munmap(p, len);
}

void *cs_aligned_alloc(size_t align, size_t size) {
    void *p = cs_aligned_alloc_uninit(align, size);
    if (p) memset(p, 0, size ? (size + align - 1) / align * align : align); /* the padding too, as before */
    return p;
}

void cs_stop_flag(pthread_mutex_t *mu, pthread_cond_t *cv, bool *flag) {
    pthread_mutex_lock(mu);
    *flag = true;
    pthread_cond_broadcast(cv);
    pthread_mutex_unlock(mu);
}

char *cs_read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) { cs_error_set(CS_EIO, "%s: %s", path, strerror(errno)); return NULL; }
    if (fseek(f, 0, SEEK_END) != 0) goto err;
    long n = ftell(f);
    if (n < 0 || fseek(f, 0, SEEK_SET) != 0) goto err;
    char *buf = malloc((size_t)n + 1);
    if (!buf) { fclose(f); cs_error_set(CS_ENOMEM, "%s: out of memory", path); return NULL; }
    if (fread(buf, 1, (size_t)n, f) != (size_t)n) { free(buf); goto err; }
    buf[n] = 0;
    fclose(f);
    if (len) *len = (size_t)n;
    return buf;
err:
    cs_error_set(CS_EIO, "%s: read failed: %s", path, strerror(errno));
    fclose(f);
    return NULL;
}

char *cs_path_join(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    char *p = malloc(a + b + 2);
    if (!p) return NULL;
    memcpy(p, dir, a);
    size_t k = a;
    if (a && dir[a - 1] != '/') p[k++] = '/';
    memcpy(p + k, name, b + 1);
    return p;
}

bool cs_file_exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0;
}

double cs_time_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

size_t cs_mem_available(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return 0;
    char line[256];
    unsigned long long kb = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) break;
    fclose(f);
    return (size_t)kb * 1024;
}

long long cs_parse_size(const char *s, bool *ok) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    double mul = 1;
    if (*end == 'K' || *end == 'k') mul = 1024.0, end++;
    else if (*end == 'M' || *end == 'm') mul = 1024.0 * 1024, end++;
    else if (*end == 'G' || *end == 'g') mul = 1024.0 * 1024 * 1024, end++;
    if (*end == 'i' && mul > 1) end++;
    if (*end == 'B' || *end == 'b') end++;
    *ok = end != s && *end == 0 && errno == 0 && v >= 0 && v * mul < 9e18;
    return (long long)(v * mul);
}

bool cs_buf_reserve(cs_buf_t *b, size_t extra) {
    if (b->len + extra + 1 <= b->cap) return true;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < b->len + extra + 1) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) return false;
    b->p = p;
    b->cap = cap;
    return true;
}

void cs_buf_free(cs_buf_t *b) {
    free(b->p);
    b->p = NULL;
    b->len = b->cap = 0;
}

bool cs_utf8_valid(const char *s, size_t n) {
    int32_t cp;
    for (size_t i = 0, k; i < n; i += k)
        if (!(k = cs_utf8_next(s + i, n - i, &cp, NULL))) return false;
    return true;
}

size_t cs_utf8_count(const char *s, size_t n) {
    size_t c = 0;
    for (size_t i = 0; i < n; i++) c += ((unsigned char)s[i] & 0xC0) != 0x80;
    return c;
}

json_t *cs_json_get(const json_t *o, const char *key) {
    json_t *v = json_object_get(o, key);
    return json_is_null(v) ? NULL : v;
}

const char *cs_json_type_name(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a real number";
    case JSON_TRUE: case JSON_FALSE: return "a boolean";
    default: return "null";
    }
}

json_t *cs_json_logprob(float v) {
    if (isnan(v)) return json_null();
    if (isinf(v)) return json_real(-9999.0);
    return json_real(v);
}

/* ---- flags ---- */
static void flag_wake(uint32_t *f) { syscall(SYS_futex, f, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0); }

void cs_flag_store(uint32_t *f, uint32_t v) {
    __atomic_store_n(f, v, __ATOMIC_RELEASE);
    flag_wake(f);
}

void cs_flag_add(uint32_t *f, uint32_t v) {
    __atomic_add_fetch(f, v, __ATOMIC_ACQ_REL);
    flag_wake(f);
}

bool cs_flag_wait_geq_for(const uint32_t *f, uint32_t v, double ms) {
    double end = cs_time_ms() + ms;
    for (;;) {
        uint32_t cur = cs_flag_load(f);
        if (cur >= v) return true;
        if (cs_time_ms() >= end) return false;
        struct timespec ts = {0, 50000}; /* as cs_flag_wait_geq: a device's store wakes nobody */
        syscall(SYS_futex, f, FUTEX_WAIT_PRIVATE, cur, &ts, NULL, 0);
    }
}

void cs_flag_wait_geq(const uint32_t *f, uint32_t v) {
    for (int i = 0; i < 2000; i++) {
        if (cs_flag_load(f) >= v) return;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }
    for (;;) {
        uint32_t cur = cs_flag_load(f);
        if (cur >= v) return;
        /* sleeps only while *f is still cur (a store in between makes it return at once); a
         * device's store wakes nobody, so the sleep is bounded: 50 us */
        struct timespec ts = {0, 50000};
        syscall(SYS_futex, f, FUTEX_WAIT_PRIVATE, cur, &ts, NULL, 0);
    }
}
