/* common.h: status codes, error messages, asserts, dtypes and small helpers shared by
 * every layer of caraserve. 0 is success, negative values are errors (libuv style);
 * the function that fails records a human-readable message with cs_error_set() that the
 * caller can print with cs_error_last(). Programming errors use CS_ASSERT and abort. */
#ifndef CS_COMMON_H
#define CS_COMMON_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

enum cs_status {
    CS_OK           =  0,
    CS_EINVAL       = -1,  /* bad argument or bad input value */
    CS_ENOMEM       = -2,
    CS_EIO          = -3,  /* open/read/mmap failed */
    CS_EFORMAT      = -4,  /* malformed file (header, JSON, tensor layout) */
    CS_EUNSUPPORTED = -5,  /* valid input we refuse to serve (architecture, DoRA, ...) */
    CS_ENOTFOUND    = -6,  /* missing file or tensor */
    CS_ESHAPE       = -7,  /* tensor shape does not match the model */
    CS_EAGAIN       = -8,  /* not ready yet (an adapter is loading): retry later */
    CS_EBUSY        = -9,  /* in use (an adapter version requests still run on) */
};

const char *cs_strerror(int status);

/* Thread-local last error message. cs_error_set returns `status` so that
 * `return cs_error_set(CS_EFORMAT, "...")` reads naturally. */
int cs_error_set(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
const char *cs_error_last(void);
void cs_error_clear(void);

void cs_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
extern int cs_log_verbose;

#define CS_ASSERT(x)                                                                    \
    do {                                                                                \
        if (!(x)) cs_assert_fail(__FILE__, __LINE__, #x);                               \
    } while (0)
__attribute__((noreturn)) void cs_assert_fail(const char *file, int line, const char *expr);

/* Tensor element types: the plain ones as safetensors names them, then the block-quantized
 * weight types of GGUF files (base/quant.h: ggml's layouts, a block of 32 or 256 elements in
 * a fixed number of bytes; a row is whole blocks). */
typedef enum cs_dtype {
    CS_DTYPE_F32 = 0,
    CS_DTYPE_F16,
    CS_DTYPE_BF16,
    CS_DTYPE_F64,
    CS_DTYPE_I64,
    CS_DTYPE_I32,
    CS_DTYPE_I16,
    CS_DTYPE_I8,
    CS_DTYPE_U8,
    CS_DTYPE_BOOL,
    CS_DTYPE_Q4_0,      /* 32 elements: an F16 scale, 4-bit values (18 bytes) */
    CS_DTYPE_Q4_1,      /* ... and an F16 minimum (20) */
    CS_DTYPE_Q5_0,      /* 5-bit values (22) */
    CS_DTYPE_Q5_1,      /* 5-bit values and a minimum (24) */
    CS_DTYPE_Q8_0,      /* 8-bit values (34) */
    CS_DTYPE_Q4_K,      /* 256 elements: 8 sub-blocks with 6-bit scales and minima (144) */
    CS_DTYPE_Q5_K,      /* the same with 5-bit values (176) */
    CS_DTYPE_Q6_K,      /* 16 sub-blocks, 8-bit scales, 6-bit values (210) */
    CS_DTYPE_COUNT,
} cs_dtype;

#define CS_DTYPE_PLAIN_COUNT CS_DTYPE_Q4_0 /* the types safetensors knows come before */

const char *cs_dtype_name(cs_dtype t);          /* "F32", "BF16", "Q4_K", ... */
int cs_dtype_from_name(const char *name);       /* a plain type's (safetensors'); -1 if unknown */
/* bytes of an element; of a block for the block-quantized types */
size_t cs_dtype_size(cs_dtype t);
static inline bool cs_dtype_is_quant(cs_dtype t) { return t >= CS_DTYPE_Q4_0 && t < CS_DTYPE_COUNT; }
/* elements in a block: 1, 32 or 256 */
int cs_dtype_block(cs_dtype t);
/* bytes of a row of n elements (n a multiple of cs_dtype_block; else 0) */
size_t cs_dtype_row_bytes(cs_dtype t, int64_t n);

static inline float cs_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = { .u = (uint32_t)h << 16 };
    return v.f;
}
/* round-to-nearest-even, as torch does */
static inline uint16_t cs_f32_to_bf16(float f) {
    union { uint32_t u; float f; } v = { .f = f };
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40); /* NaN */
    uint32_t rounding = 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)((v.u + rounding) >> 16);
}
float cs_f16_to_f32(uint16_t h);
uint16_t cs_f32_to_f16(float f);

/* Convert n elements of type t at src to float. Only F32/F16/BF16 are accepted. */
void cs_to_f32(float *dst, const void *src, cs_dtype t, size_t n);

void *cs_aligned_alloc(size_t align, size_t size); /* zero-filled; free with free() */
/* the same, not filled (for memory written before it is read); free with free() */
void *cs_aligned_alloc_uninit(size_t align, size_t size);
/* n bytes (zero-filled) in 2 MiB huge pages where the kernel offers them (weights read on
 * every decode step: fewer TLB misses): mapped from a 2 MiB boundary, the length rounded to
 * 4 KiB only (*len; a huge page for a last partial 2 MiB would hold up to 2 MiB of nothing).
 * NULL on ENOMEM; free with cs_huge_free(p, *len). */
void *cs_huge_alloc(size_t n, size_t *len);
void cs_huge_free(void *p, size_t len);
/* A worker's stop: *flag set under mu and every waiter on cv woken (then join the thread) */
void cs_stop_flag(pthread_mutex_t *mu, pthread_cond_t *cv, bool *flag);
char *cs_read_file(const char *path, size_t *len);  /* NUL-terminated; NULL + error set */
char *cs_path_join(const char *dir, const char *name); /* malloc'd */
bool cs_file_exists(const char *path);
double cs_time_ms(void);                            /* CLOCK_MONOTONIC */
size_t cs_mem_available(void);                      /* MemAvailable of /proc/meminfo in bytes, 0 if unknown */
/* "512M", "2G", "1.5GiB", "4096": bytes (suffixes K M G, powers of 1024, then an optional
 * i and B/b); *ok false on anything else or a negative or huge value */
long long cs_parse_size(const char *s, bool *ok);

/* A growable byte string, NUL-terminated once anything (even "") was added; {0} is empty.
 * cs_buf_add is inline for the tokenizer, which adds a character at a time. */
typedef struct cs_buf {
    char *p;
    size_t len, cap;
} cs_buf_t;
bool cs_buf_reserve(cs_buf_t *b, size_t extra);     /* room for extra more bytes and the NUL */
static inline bool cs_buf_add(cs_buf_t *b, const void *s, size_t n) { /* false: out of memory */
    if (b->len + n + 1 > b->cap && !cs_buf_reserve(b, n)) return false;
    if (n) memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
    return true;
}
void cs_buf_free(cs_buf_t *b);                      /* back to {0} */

/* The length of the valid UTF-8 sequence at s (n > 0 bytes there), with its code point in
 * *cp; 0 when there is none: no overlong forms, no surrogates, nothing above U+10FFFF (as
 * jansson, Go and Rust judge it). With bad set, an invalid sequence also reports the length
 * of its maximal invalid prefix (what Rust's String::from_utf8_lossy replaces by one
 * U+FFFD). Inline: the tokenizer decodes every character with it. */
static inline size_t cs_utf8_next(const char *str, size_t n, int32_t *cp, size_t *bad) {
    const uint8_t *s = (const uint8_t *)str;
    uint8_t b = s[0];
    if (b < 0x80) { *cp = b; return 1; }
    size_t need;
    uint8_t lo = 0x80, hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) need = 1;
    else if (b >= 0xE0 && b <= 0xEF) {
        need = 2;
        if (b == 0xE0) lo = 0xA0;
        if (b == 0xED) hi = 0x9F;
    } else if (b >= 0xF0 && b <= 0xF4) {
        need = 3;
        if (b == 0xF0) lo = 0x90;
        if (b == 0xF4) hi = 0x8F;
    } else {
        if (bad) *bad = 1;
        return 0;
    }
    size_t k = 1;
    if (k < n && s[k] >= lo && s[k] <= hi) {
        k++;
        while (k <= need && k < n && s[k] >= 0x80 && s[k] <= 0xBF) k++;
    }
    if (k != need + 1) {
        if (bad) *bad = k;
        return 0;
    }
    int32_t c = b & (0x3F >> need);
    for (size_t i = 1; i <= need; i++) c = (c << 6) | (s[i] & 0x3F);
    *cp = c;
    return k;
}
bool cs_utf8_valid(const char *s, size_t n);        /* every byte of s[0..n) in valid UTF-8 */
size_t cs_utf8_count(const char *s, size_t n);      /* the characters: bytes that are no continuation byte */

/* JSON (jansson's json_t, declared here without its header) */
/* o[key] when it is there and not null (an optional field left out), else NULL */
struct json_t *cs_json_get(const struct json_t *o, const char *key);
/* what V is, for messages: "an object", "an array", "a string", "an integer", "a real
 * number", "a boolean" or "null" */
const char *cs_json_type_name(const struct json_t *v);
/* a logprob as a JSON number: null for NaN; -inf has no JSON spelling, vLLM writes -9999.0 */
struct json_t *cs_json_logprob(float v);

/* Flags between threads and a device: 32-bit counters that only grow, in host memory a
 * device may also write (backend host_alloc). The waiter spins briefly, then sleeps on a
 * futex; every store or add wakes the sleepers. Release on store/add, acquire on load and
 * wait, so what the writer did before is visible after the wait. */
static inline uint32_t cs_flag_load(const uint32_t *f) { return __atomic_load_n(f, __ATOMIC_ACQUIRE); }
void cs_flag_store(uint32_t *f, uint32_t v);
void cs_flag_add(uint32_t *f, uint32_t v);
void cs_flag_wait_geq(const uint32_t *f, uint32_t v); /* until *f >= v (no wrap: counts stay below 2^31) */
bool cs_flag_wait_geq_for(const uint32_t *f, uint32_t v, double ms); /* the same for MS at most: false then */

#define CS_MIN(a, b) ((a) < (b) ? (a) : (b))

/* FNV-1a of a NUL-terminated string: the key of the name tables */
static inline uint64_t cs_hash_str(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}
#define CS_MAX(a, b) ((a) > (b) ? (a) : (b))
#define CS_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

#ifdef __cplusplus
}
#endif
#endif
