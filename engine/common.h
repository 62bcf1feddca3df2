/* common.h: status codes, error messages, asserts, dtypes and small helpers shared by
 * every layer of caraserve. 0 is success, negative values are errors (libuv style);
 * the function that fails records a human-readable message with cs_error_set() that the
 * caller can print with cs_error_last(). Programming errors use CS_ASSERT and abort. */
#ifndef CS_COMMON_H
#define CS_COMMON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

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
_Noreturn void cs_assert_fail(const char *file, int line, const char *expr);

/* Tensor element types, as safetensors names them. */
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
    CS_DTYPE_COUNT,
} cs_dtype;

const char *cs_dtype_name(cs_dtype t);          /* "F32", "BF16", ... */
int cs_dtype_from_name(const char *name);       /* -1 if unknown */
size_t cs_dtype_size(cs_dtype t);

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
char *cs_read_file(const char *path, size_t *len);  /* NUL-terminated; NULL + error set */
char *cs_path_join(const char *dir, const char *name); /* malloc'd */
bool cs_file_exists(const char *path);
double cs_time_ms(void);                            /* CLOCK_MONOTONIC */
size_t cs_mem_available(void);                      /* MemAvailable of /proc/meminfo in bytes, 0 if unknown */
/* "512M", "2G", "1.5GiB", "4096": bytes (suffixes K M G, powers of 1024, then an optional
 * i and B/b); *ok false on anything else or a negative or huge value */
long long cs_parse_size(const char *s, bool *ok);

#define CS_MIN(a, b) ((a) < (b) ? (a) : (b))
#define CS_MAX(a, b) ((a) > (b) ? (a) : (b))
#define CS_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

#endif
