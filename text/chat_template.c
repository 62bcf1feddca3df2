/* chat_template.c: a Jinja2-subset interpreter for Hugging Face chat templates.
 *
 * transformers renders a model's chat template with jinja2 (an ImmutableSandboxedEnvironment
 * with trim_blocks, lstrip_blocks and the loopcontrols extension) to build the prompt, and
 * the server must produce the same bytes. This file has three parts that follow jinja2 3.1
 * closely: a lexer that mirrors jinja2's regular expressions and whitespace control, a
 * recursive-descent parser to a tree (the grammar of jinja2/parser.py), and an evaluator with
 * Python value semantics: truthiness, str() and repr(), int/float arithmetic, code-point
 * strings, the sandbox's attribute rules and the filters, tests and methods templates use.
 * Two jinja2 behaviours are reproduced on purpose: its compile-time name resolution (see
 * analyze_frame) and the laziness of generator filters (see lazy_filter). What the
 * interpreter does not implement is refused at parse time with the line number.
 *
 * Known differences, all on inputs no real template has: a value Python would print with its
 * memory address (a method, a generator) is an error; integers are 64-bit (overflow is an
 * error, Python would go on with big integers); recursion stops at CHAT_TEMPLATE_MAX_DEPTH
 * rather than at Python's stack limit; jinja2 folds constant expressions when compiling, so
 * a nonsense like {{ 0[:2] }} prints nothing there and is an error here.
 *
 * Memory: the tree lives in the template's arena and is never written after parsing, so
 * renders may run concurrently. A render allocates all its values from its own arena, which
 * is freed at once; errors therefore unwind with longjmp (as in Lua) without leaking. */
#include "text/chat_template.h"

#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <utf8proc.h>

#define MAX_PARSE_DEPTH 200      /* nesting of expressions and blocks in the source */
#define MAX_RANGE       100000   /* jinja2's sandbox refuses longer range() results */
#define ARENA_CHUNK     ((size_t)64 << 10)

/* ------------------------------------------------------------------ errors, memory ---- */

typedef struct errctx {
    jmp_buf jb;
    int status;
    bool fatal; /* a limit or out of memory: never deferred (see lazy_filter) */
    char msg[1024];
} errctx;

static _Noreturn void throw_status(errctx *ec, int status, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static _Noreturn void throw_status(errctx *ec, int status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ec->msg, sizeof ec->msg, fmt, ap);
    va_end(ap);
    ec->status = status;
    ec->fatal = status != CS_EINVAL;
    longjmp(ec->jb, 1);
}

/* A guard against runaway templates tripped: the render stops whatever it was doing. */
static _Noreturn void throw_limit(errctx *ec, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static _Noreturn void throw_limit(errctx *ec, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ec->msg, sizeof ec->msg, fmt, ap);
    va_end(ap);
    ec->status = CS_EINVAL;
    ec->fatal = true;
    longjmp(ec->jb, 1);
}

typedef struct chunk {
    struct chunk *next;
    size_t cap, used;
    max_align_t data[];
} chunk;

typedef struct arena {
    chunk *head;
    size_t total, limit;
    errctx *ec;
} arena;

static void *arena_alloc(arena *a, size_t n) {
    n = (n + 15) & ~(size_t)15;
    chunk *c = a->head;
    if (!c || c->cap - c->used < n) {
        size_t cap = n > ARENA_CHUNK ? n : ARENA_CHUNK;
        if (a->total + cap > a->limit)
            throw_limit(a->ec, "template used more than %zu MiB of memory", a->limit >> 20);
        c = malloc(sizeof *c + cap);
        if (!c) throw_status(a->ec, CS_ENOMEM, "out of memory");
        c->cap = cap;
        c->used = 0;
        a->total += cap;
        /* a big block goes behind the current chunk so that the chunk keeps serving small ones */
        if (a->head && n == cap) {
            c->next = a->head->next;
            a->head->next = c;
        } else {
            c->next = a->head;
            a->head = c;
        }
    }
    void *p = (char *)c->data + c->used;
    c->used += n;
    return p;
}

static void *arena_zalloc(arena *a, size_t n) {
    void *p = arena_alloc(a, n);
    memset(p, 0, n);
    return p;
}

static void arena_free(arena *a) {
    chunk *c = a->head;
    while (c) {
        chunk *next = c->next;
        free(c);
        c = next;
    }
    a->head = NULL;
    a->total = 0;
}

static char *arena_strndup(arena *a, const char *s, size_t n) {
    char *p = arena_alloc(a, n + 1);
    memcpy(p, s, n);
    p[n] = 0;
    return p;
}

/* Growable byte buffer. Buffers of a render grow inside its arena (the waste is bounded by the
 * doubling); the final output grows with realloc (heap = true) and is handed to the caller. */
typedef struct sbuf {
    char *p;
    size_t n, cap, limit;
    bool heap;
    arena *a;
} sbuf;

static void sb_init(sbuf *b, arena *a, size_t limit, bool heap) {
    memset(b, 0, sizeof *b);
    b->a = a;
    b->limit = limit;
    b->heap = heap;
}

static void sb_reserve(sbuf *b, size_t extra) {
    /* the limit before the room: a buffer that grew by doubling has room past it */
    if (b->n + extra > b->limit)
        throw_limit(b->a->ec, "rendered text is longer than %zu MiB", b->limit >> 20);
    if (b->n + extra + 1 <= b->cap) return;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < b->n + extra + 1) cap *= 2;
    if (b->heap) {
        char *p = realloc(b->p, cap);
        if (!p) throw_status(b->a->ec, CS_ENOMEM, "out of memory");
        b->p = p;
    } else {
        char *p = arena_alloc(b->a, cap);
        if (b->n) memcpy(p, b->p, b->n);
        b->p = p;
    }
    b->cap = cap;
}

static void sb_put(sbuf *b, const char *s, size_t n) {
    if (!n) return;
    sb_reserve(b, n);
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

static void sb_puts(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }
static void sb_putc(sbuf *b, char c) { sb_put(b, &c, 1); }

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...) {
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n < sizeof tmp) {
        sb_put(b, tmp, (size_t)n);
        return;
    }
    sb_reserve(b, (size_t)n);
    va_start(ap, fmt);
    vsnprintf(b->p + b->n, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->n += (size_t)n;
}

/* ------------------------------------------------------------------------- unicode ---- */

/* Decodes one code point; invalid bytes decode as themselves (inputs are valid UTF-8:
 * template sources are checked and jansson checks JSON strings). */
static size_t utf8_dec(const char *s, size_t n, int32_t *cp) {
    utf8proc_int32_t c;
    utf8proc_ssize_t k = utf8proc_iterate((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, &c);
    if (k <= 0) {
        *cp = (unsigned char)s[0];
        return 1;
    }
    *cp = c;
    return (size_t)k;
}

static size_t utf8_enc(int32_t cp, char *out) {
    utf8proc_ssize_t k = utf8proc_encode_char(cp, (utf8proc_uint8_t *)out);
    if (k <= 0) {
        out[0] = '?';
        return 1;
    }
    return (size_t)k;
}

static void sb_putcp(sbuf *b, int32_t cp) {
    char tmp[4];
    sb_put(b, tmp, utf8_enc(cp, tmp));
}

/* Byte offset of code point index i (i <= number of code points). */
static size_t utf8_off(const char *s, size_t n, size_t i) {
    size_t off = 0;
    while (i > 0 && off < n) {
        off++;
        while (off < n && ((unsigned char)s[off] & 0xC0) == 0x80) off++;
        i--;
    }
    return off;
}

/* Python's str.isspace() (and the \s of its regular expressions). */
static bool is_space_cp(int32_t c) {
    if (c < 0x80) return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20);
    return c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 ||
           c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

/* Python's str.splitlines() boundaries (\r\n is handled by the caller). */
static bool is_linebreak_cp(int32_t c) {
    return c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D || c == 0x1E || c == 0x85 ||
           c == 0x2028 || c == 0x2029;
}

static int ucat(int32_t c) { return (int)utf8proc_category(c); }

static bool is_cased_cp(int32_t c) {
    int k = ucat(c);
    return k == UTF8PROC_CATEGORY_LU || k == UTF8PROC_CATEGORY_LL || k == UTF8PROC_CATEGORY_LT;
}

static bool is_case_ignorable_cp(int32_t c) {
    int k = ucat(c);
    return k == UTF8PROC_CATEGORY_MN || k == UTF8PROC_CATEGORY_ME || k == UTF8PROC_CATEGORY_CF ||
           k == UTF8PROC_CATEGORY_LM || k == UTF8PROC_CATEGORY_SK || c == '\'' || c == '.' || c == ':' ||
           c == 0xB7 || c == 0x2019;
}

static bool is_alpha_cp(int32_t c) {
    int k = ucat(c);
    return k >= UTF8PROC_CATEGORY_LU && k <= UTF8PROC_CATEGORY_LO;
}

static bool is_decimal_cp(int32_t c) { return ucat(c) == UTF8PROC_CATEGORY_ND; }

static bool is_numeric_cp(int32_t c) {
    int k = ucat(c);
    return k == UTF8PROC_CATEGORY_ND || k == UTF8PROC_CATEGORY_NL || k == UTF8PROC_CATEGORY_NO;
}

/* Python's str.isprintable() for repr(): not Cc Cf Cs Co Cn Zl Zp, not Zs except ' '. */
static bool is_printable_cp(int32_t c) {
    if (c == ' ') return true;
    int k = ucat(c);
    return !(k == UTF8PROC_CATEGORY_CC || k == UTF8PROC_CATEGORY_CF || k == UTF8PROC_CATEGORY_CS ||
             k == UTF8PROC_CATEGORY_CO || k == UTF8PROC_CATEGORY_CN || k == UTF8PROC_CATEGORY_ZL ||
             k == UTF8PROC_CATEGORY_ZP || k == UTF8PROC_CATEGORY_ZS);
}

/* Python's full case mappings where they map one code point to several (SpecialCasing);
 * single code point mappings are utf8proc's, which agree with Python's. */
struct special_case {
    int32_t cp;
    const char *to;
};
static const struct special_case special_upper[] = {
    {0x00df, "\x53\x53"}, {0x0149, "\xca\xbc\x4e"}, {0x01f0, "\x4a\xcc\x8c"},
    {0x0390, "\xce\x99\xcc\x88\xcc\x81"}, {0x03b0, "\xce\xa5\xcc\x88\xcc\x81"},
    {0x0587, "\xd4\xb5\xd5\x92"}, {0x1e96, "\x48\xcc\xb1"}, {0x1e97, "\x54\xcc\x88"},
    {0x1e98, "\x57\xcc\x8a"}, {0x1e99, "\x59\xcc\x8a"}, {0x1e9a, "\x41\xca\xbe"},
    {0x1f50, "\xce\xa5\xcc\x93"}, {0x1f52, "\xce\xa5\xcc\x93\xcc\x80"},
    {0x1f54, "\xce\xa5\xcc\x93\xcc\x81"}, {0x1f56, "\xce\xa5\xcc\x93\xcd\x82"},
    {0x1f80, "\xe1\xbc\x88\xce\x99"}, {0x1f81, "\xe1\xbc\x89\xce\x99"},
    {0x1f82, "\xe1\xbc\x8a\xce\x99"}, {0x1f83, "\xe1\xbc\x8b\xce\x99"},
    {0x1f84, "\xe1\xbc\x8c\xce\x99"}, {0x1f85, "\xe1\xbc\x8d\xce\x99"},
    {0x1f86, "\xe1\xbc\x8e\xce\x99"}, {0x1f87, "\xe1\xbc\x8f\xce\x99"},
    {0x1f88, "\xe1\xbc\x88\xce\x99"}, {0x1f89, "\xe1\xbc\x89\xce\x99"},
    {0x1f8a, "\xe1\xbc\x8a\xce\x99"}, {0x1f8b, "\xe1\xbc\x8b\xce\x99"},
    {0x1f8c, "\xe1\xbc\x8c\xce\x99"}, {0x1f8d, "\xe1\xbc\x8d\xce\x99"},
    {0x1f8e, "\xe1\xbc\x8e\xce\x99"}, {0x1f8f, "\xe1\xbc\x8f\xce\x99"},
    {0x1f90, "\xe1\xbc\xa8\xce\x99"}, {0x1f91, "\xe1\xbc\xa9\xce\x99"},
    {0x1f92, "\xe1\xbc\xaa\xce\x99"}, {0x1f93, "\xe1\xbc\xab\xce\x99"},
    {0x1f94, "\xe1\xbc\xac\xce\x99"}, {0x1f95, "\xe1\xbc\xad\xce\x99"},
    {0x1f96, "\xe1\xbc\xae\xce\x99"}, {0x1f97, "\xe1\xbc\xaf\xce\x99"},
    {0x1f98, "\xe1\xbc\xa8\xce\x99"}, {0x1f99, "\xe1\xbc\xa9\xce\x99"},
    {0x1f9a, "\xe1\xbc\xaa\xce\x99"}, {0x1f9b, "\xe1\xbc\xab\xce\x99"},
    {0x1f9c, "\xe1\xbc\xac\xce\x99"}, {0x1f9d, "\xe1\xbc\xad\xce\x99"},
    {0x1f9e, "\xe1\xbc\xae\xce\x99"}, {0x1f9f, "\xe1\xbc\xaf\xce\x99"},
    {0x1fa0, "\xe1\xbd\xa8\xce\x99"}, {0x1fa1, "\xe1\xbd\xa9\xce\x99"},
    {0x1fa2, "\xe1\xbd\xaa\xce\x99"}, {0x1fa3, "\xe1\xbd\xab\xce\x99"},
    {0x1fa4, "\xe1\xbd\xac\xce\x99"}, {0x1fa5, "\xe1\xbd\xad\xce\x99"},
    {0x1fa6, "\xe1\xbd\xae\xce\x99"}, {0x1fa7, "\xe1\xbd\xaf\xce\x99"},
    {0x1fa8, "\xe1\xbd\xa8\xce\x99"}, {0x1fa9, "\xe1\xbd\xa9\xce\x99"},
    {0x1faa, "\xe1\xbd\xaa\xce\x99"}, {0x1fab, "\xe1\xbd\xab\xce\x99"},
    {0x1fac, "\xe1\xbd\xac\xce\x99"}, {0x1fad, "\xe1\xbd\xad\xce\x99"},
    {0x1fae, "\xe1\xbd\xae\xce\x99"}, {0x1faf, "\xe1\xbd\xaf\xce\x99"},
    {0x1fb2, "\xe1\xbe\xba\xce\x99"}, {0x1fb3, "\xce\x91\xce\x99"}, {0x1fb4, "\xce\x86\xce\x99"},
    {0x1fb6, "\xce\x91\xcd\x82"}, {0x1fb7, "\xce\x91\xcd\x82\xce\x99"},
    {0x1fbc, "\xce\x91\xce\x99"}, {0x1fc2, "\xe1\xbf\x8a\xce\x99"}, {0x1fc3, "\xce\x97\xce\x99"},
    {0x1fc4, "\xce\x89\xce\x99"}, {0x1fc6, "\xce\x97\xcd\x82"},
    {0x1fc7, "\xce\x97\xcd\x82\xce\x99"}, {0x1fcc, "\xce\x97\xce\x99"},
    {0x1fd2, "\xce\x99\xcc\x88\xcc\x80"}, {0x1fd3, "\xce\x99\xcc\x88\xcc\x81"},
    {0x1fd6, "\xce\x99\xcd\x82"}, {0x1fd7, "\xce\x99\xcc\x88\xcd\x82"},
    {0x1fe2, "\xce\xa5\xcc\x88\xcc\x80"}, {0x1fe3, "\xce\xa5\xcc\x88\xcc\x81"},
    {0x1fe4, "\xce\xa1\xcc\x93"}, {0x1fe6, "\xce\xa5\xcd\x82"},
    {0x1fe7, "\xce\xa5\xcc\x88\xcd\x82"}, {0x1ff2, "\xe1\xbf\xba\xce\x99"},
    {0x1ff3, "\xce\xa9\xce\x99"}, {0x1ff4, "\xce\x8f\xce\x99"}, {0x1ff6, "\xce\xa9\xcd\x82"},
    {0x1ff7, "\xce\xa9\xcd\x82\xce\x99"}, {0x1ffc, "\xce\xa9\xce\x99"}, {0xfb00, "\x46\x46"},
    {0xfb01, "\x46\x49"}, {0xfb02, "\x46\x4c"}, {0xfb03, "\x46\x46\x49"}, {0xfb04, "\x46\x46\x4c"},
    {0xfb05, "\x53\x54"}, {0xfb06, "\x53\x54"}, {0xfb13, "\xd5\x84\xd5\x86"},
    {0xfb14, "\xd5\x84\xd4\xb5"}, {0xfb15, "\xd5\x84\xd4\xbb"}, {0xfb16, "\xd5\x8e\xd5\x86"},
    {0xfb17, "\xd5\x84\xd4\xbd"},
};
static const struct special_case special_title[] = {
    {0x00df, "\x53\x73"}, {0x0149, "\xca\xbc\x4e"}, {0x01f0, "\x4a\xcc\x8c"},
    {0x0390, "\xce\x99\xcc\x88\xcc\x81"}, {0x03b0, "\xce\xa5\xcc\x88\xcc\x81"},
    {0x0587, "\xd4\xb5\xd6\x82"}, {0x1e96, "\x48\xcc\xb1"}, {0x1e97, "\x54\xcc\x88"},
    {0x1e98, "\x57\xcc\x8a"}, {0x1e99, "\x59\xcc\x8a"}, {0x1e9a, "\x41\xca\xbe"},
    {0x1f50, "\xce\xa5\xcc\x93"}, {0x1f52, "\xce\xa5\xcc\x93\xcc\x80"},
    {0x1f54, "\xce\xa5\xcc\x93\xcc\x81"}, {0x1f56, "\xce\xa5\xcc\x93\xcd\x82"},
    {0x1fb2, "\xe1\xbe\xba\xcd\x85"}, {0x1fb4, "\xce\x86\xcd\x85"}, {0x1fb6, "\xce\x91\xcd\x82"},
    {0x1fb7, "\xce\x91\xcd\x82\xcd\x85"}, {0x1fc2, "\xe1\xbf\x8a\xcd\x85"},
    {0x1fc4, "\xce\x89\xcd\x85"}, {0x1fc6, "\xce\x97\xcd\x82"},
    {0x1fc7, "\xce\x97\xcd\x82\xcd\x85"}, {0x1fd2, "\xce\x99\xcc\x88\xcc\x80"},
    {0x1fd3, "\xce\x99\xcc\x88\xcc\x81"}, {0x1fd6, "\xce\x99\xcd\x82"},
    {0x1fd7, "\xce\x99\xcc\x88\xcd\x82"}, {0x1fe2, "\xce\xa5\xcc\x88\xcc\x80"},
    {0x1fe3, "\xce\xa5\xcc\x88\xcc\x81"}, {0x1fe4, "\xce\xa1\xcc\x93"},
    {0x1fe6, "\xce\xa5\xcd\x82"}, {0x1fe7, "\xce\xa5\xcc\x88\xcd\x82"},
    {0x1ff2, "\xe1\xbf\xba\xcd\x85"}, {0x1ff4, "\xce\x8f\xcd\x85"}, {0x1ff6, "\xce\xa9\xcd\x82"},
    {0x1ff7, "\xce\xa9\xcd\x82\xcd\x85"}, {0xfb00, "\x46\x66"}, {0xfb01, "\x46\x69"},
    {0xfb02, "\x46\x6c"}, {0xfb03, "\x46\x66\x69"}, {0xfb04, "\x46\x66\x6c"}, {0xfb05, "\x53\x74"},
    {0xfb06, "\x53\x74"}, {0xfb13, "\xd5\x84\xd5\xb6"}, {0xfb14, "\xd5\x84\xd5\xa5"},
    {0xfb15, "\xd5\x84\xd5\xab"}, {0xfb16, "\xd5\x8e\xd5\xb6"}, {0xfb17, "\xd5\x84\xd5\xad"},
};
static const struct special_case special_lower[] = {
    {0x0130, "\x69\xcc\x87"},
};

static const char *special_lookup(const struct special_case *t, size_t n, int32_t cp) {
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (t[mid].cp == cp) return t[mid].to;
        if (t[mid].cp < cp) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}

enum { CASE_UPPER, CASE_LOWER, CASE_TITLE };

static void put_case(sbuf *b, int32_t c, int mode) {
    const char *sp = NULL;
    int32_t m = c;
    switch (mode) {
    case CASE_UPPER:
        sp = special_lookup(special_upper, sizeof special_upper / sizeof special_upper[0], c);
        m = utf8proc_toupper(c);
        break;
    case CASE_LOWER:
        sp = special_lookup(special_lower, sizeof special_lower / sizeof special_lower[0], c);
        m = utf8proc_tolower(c);
        break;
    default:
        sp = special_lookup(special_title, sizeof special_title / sizeof special_title[0], c);
        m = utf8proc_totitle(c);
        break;
    }
    if (sp) sb_puts(b, sp);
    else sb_putcp(b, m);
}

/* Lowercases the code point at s[i] (of n bytes) with Python's final-sigma rule. */
static void put_lower_at(sbuf *b, const char *s, size_t n, size_t i, int32_t c) {
    if (c != 0x3A3) {
        put_case(b, c, CASE_LOWER);
        return;
    }
    bool before = false, after = false;
    size_t j = i;
    while (j > 0) {
        size_t k = j - 1;
        while (k > 0 && ((unsigned char)s[k] & 0xC0) == 0x80) k--;
        int32_t p;
        utf8_dec(s + k, n - k, &p);
        j = k;
        if (is_case_ignorable_cp(p)) continue;
        before = is_cased_cp(p);
        break;
    }
    int32_t me;
    j = i + utf8_dec(s + i, n - i, &me);
    while (j < n) {
        int32_t q;
        j += utf8_dec(s + j, n - j, &q);
        if (is_case_ignorable_cp(q)) continue;
        after = is_cased_cp(q);
        break;
    }
    sb_putcp(b, before && !after ? 0x3C2 : 0x3C3);
}

/* -------------------------------------------------------------------------- values ---- */

/* A value is a small tagged union passed by value; containers point into the render arena.
 * Lists, tuples, dicts and strings are immutable (the sandbox forbids mutation); only a
 * namespace's attributes, an iterator's position and loop/cycler state change. */
enum vtype {
    T_MISSING = 0, /* internal: an argument that was not given */
    T_UNDEF,       /* jinja2 Undefined (k: UK_MSG, UK_UNSAFE or UK_LAZY) */
    T_NONE,
    T_BOOL,
    T_INT,
    T_FLOAT,
    T_STR,    /* k = 1: markupsafe.Markup */
    T_LIST,   /* k = list kind */
    T_DICT,
    T_NS,     /* namespace() */
    T_MACRO,
    T_FUNC,   /* a global function: range, namespace, dict, ... */
    T_METHOD, /* a bound method of a str, dict, list, loop or cycler */
    T_LOOP,   /* the loop variable */
    T_ITER,   /* a generator or iterator (select, map, reverse, items ...) */
    T_CYCLER,
    T_JOINER,
};

enum { LK_LIST, LK_TUPLE, LK_RANGE, LK_KEYS, LK_VALUES, LK_ITEMS };

typedef struct val val;
typedef struct node node;
typedef struct scope scope;

typedef struct list {
    size_t n;
    val *v;
    int64_t start, stop, step; /* LK_RANGE: for repr() */
} list;

typedef struct dict {
    size_t n, cap;
    val *k, *v;
} dict;

typedef struct iterobj {
    list *l;
    size_t pos;
    const char *err; /* raised when consumed past l (a generator that failed there) */
} iterobj;

typedef struct macro {
    const node *def; /* S_MACRO or S_CALLBLOCK (its body is the caller) */
    scope *closure;
    const char *name;
} macro;

struct bound;
struct loopctx;
struct cycler;
struct joiner;
struct undef_info;

/* T_UNDEF: what its k says about u */
enum {
    UK_MSG,    /* u.msg: the message to give when it is used */
    UK_UNSAFE, /* u.msg: a sandbox SecurityError in waiting */
    UK_LAZY,   /* u.ud: what was looked up, the message is written only if it is used */
};

struct val {
    uint8_t t, k;
    union {
        bool b;
        int64_t i;
        double f;
        struct {
            const char *p;
            size_t n;
        } s;
        list *l;
        dict *d;
        macro *m;
        struct bound *bm;
        struct loopctx *lp;
        iterobj *it;
        struct cycler *cy;
        struct joiner *jn;
        const char *msg; /* T_UNDEF */
        struct undef_info *ud;
        int fn;          /* T_FUNC */
    } u;
};

struct bound {
    val self;
    int mid;
};

enum { U_NAME, U_ATTR, U_ELEM };

struct undef_info {
    int kind;
    const char *name; /* U_NAME, U_ATTR */
    val obj;          /* U_ATTR, U_ELEM */
    int64_t index;    /* U_ELEM */
};

struct loopctx {
    const val *items;
    size_t n, i;
    val last_changed;
    bool changed_set;
};

struct cycler {
    const val *items;
    size_t n, pos;
};

struct joiner {
    val sep;
    bool used;
};

static val v_missing(void) { return (val){.t = T_MISSING}; }
static val v_none(void) { return (val){.t = T_NONE}; }
static val v_bool(bool b) { return (val){.t = T_BOOL, .u.b = b}; }
static val v_int(int64_t i) { return (val){.t = T_INT, .u.i = i}; }
static val v_float(double f) { return (val){.t = T_FLOAT, .u.f = f}; }
static val v_str(const char *p, size_t n) { return (val){.t = T_STR, .u.s = {p, n}}; }
static val v_undef(const char *msg) { return (val){.t = T_UNDEF, .u.msg = msg}; }

/* ---------------------------------------------------------------------------- tree ---- */

enum nkind {
    /* statements */
    S_OUTPUT,      /* v: items (E_CONST data or expressions) */
    S_IF,          /* a: test, v: body, w: else (an elif is an S_IF alone in w) */
    S_FOR,         /* a: target, b: iterable, x: filter condition, v: body, w: else */
    S_SET,         /* a: target (E_NAME, E_TUPLE, E_NSREF), b: value */
    S_SETBLOCK,    /* a: target, b: filter chain or NULL, v: body */
    S_MACRO,       /* name, kw: parameters, w: defaults (NULL: none), v: body, flags */
    S_CALLBLOCK,   /* a: the call, kw/w: caller's parameters and defaults, v: caller body */
    S_FILTERBLOCK, /* b: filter chain, v: body */
    S_WITH,        /* kw: names, w: values, v: body */
    S_BREAK,
    S_CONTINUE,
    S_SCOPE, /* {% generation %}: v: body in a new scope */
    /* expressions */
    E_CONST,  /* c */
    E_NAME,   /* name */
    E_NSREF,  /* name2.name, as an assignment target */
    E_LIST,   /* v */
    E_TUPLE,  /* v */
    E_DICT,   /* v: keys, w: values */
    E_GETATTR, /* a.name */
    E_GETITEM, /* a[b] */
    E_SLICE,   /* a[b:x:y], each of b, x, y may be NULL */
    E_CALL,    /* a(v..., kw=w...) */
    E_FILTER,  /* a|name(v..., kw=w...); a is NULL in filter chains of blocks */
    E_TEST,    /* a is name(v..., kw=w...) */
    E_NOT,
    E_NEG,
    E_POS,
    E_BIN, /* a op b */
    E_AND,
    E_OR,
    E_CONCAT, /* v joined with ~ */
    E_CMP,    /* a ops[0] v[0] ops[1] v[1] ... */
    E_COND,   /* b if a else x (x may be NULL) */
};

/* S_MACRO / S_CALLBLOCK flags: the body refers to these names; S_IF: made by an elif */
enum { MF_CALLER = 1, MF_VARARGS = 2, MF_KWARGS = 4, IF_ELIF = 8 };

struct node {
    uint8_t kind, op, flags;
    int line;
    int id; /* filter / test id */
    const char *name, *name2;
    val c;
    node *a, *b, *x, *y;
    node **v, **w;
    int nv, nw;
    const char **kw;
    int nkw;
    uint8_t *ops;
    /* names jinja2 starts as undefined in the scope this node opens (its body; for S_FOR
     * also uninit2 for the else block), see analyze_frame */
    const char **uninit, **uninit2;
    int nuninit, nuninit2;
};

/* --------------------------------------------------------------------------- lexer ---- */

enum tk { TK_EOF, TK_DATA, TK_VAR_BEGIN, TK_VAR_END, TK_BLOCK_BEGIN, TK_BLOCK_END, TK_NAME, TK_STRING, TK_INT, TK_FLOAT, TK_OP };

enum op {
    OP_NONE,
    OP_ADD, OP_SUB, OP_DIV, OP_FDIV, OP_MUL, OP_MOD, OP_POW, OP_TILDE,
    OP_LBRACKET, OP_RBRACKET, OP_LPAREN, OP_RPAREN, OP_LBRACE, OP_RBRACE,
    OP_EQ, OP_NE, OP_GT, OP_GTEQ, OP_LT, OP_LTEQ,
    OP_ASSIGN, OP_DOT, OP_COLON, OP_PIPE, OP_COMMA, OP_SEMICOLON,
    /* comparison operators that are names */
    OP_IN, OP_NOTIN,
};

static const char *const op_text[] = {
    [OP_ADD] = "+", [OP_SUB] = "-", [OP_DIV] = "/", [OP_FDIV] = "//", [OP_MUL] = "*", [OP_MOD] = "%",
    [OP_POW] = "**", [OP_TILDE] = "~", [OP_LBRACKET] = "[", [OP_RBRACKET] = "]", [OP_LPAREN] = "(",
    [OP_RPAREN] = ")", [OP_LBRACE] = "{", [OP_RBRACE] = "}", [OP_EQ] = "==", [OP_NE] = "!=", [OP_GT] = ">",
    [OP_GTEQ] = ">=", [OP_LT] = "<", [OP_LTEQ] = "<=", [OP_ASSIGN] = "=", [OP_DOT] = ".", [OP_COLON] = ":",
    [OP_PIPE] = "|", [OP_COMMA] = ",", [OP_SEMICOLON] = ";", [OP_IN] = "in", [OP_NOTIN] = "not in",
};

typedef struct token {
    uint8_t type, op;
    int line;
    const char *s; /* TK_DATA, TK_NAME, TK_STRING: decoded text */
    size_t n;
    int64_t i;
    double f;
} token;

typedef struct lexer {
    errctx *ec;
    arena *a;
    const char *src; /* newlines normalized to \n, one trailing newline dropped */
    size_t len, pos;
    bool line_starting;
    size_t line_pos; /* line counting cursor */
    int line;
    token *toks;
    size_t ntok, cap;
} lexer;

static int lex_line(lexer *lx, size_t pos) {
    while (lx->line_pos < pos && lx->line_pos < lx->len) {
        if (lx->src[lx->line_pos] == '\n') lx->line++;
        lx->line_pos++;
    }
    return lx->line;
}

static _Noreturn void lex_fail(lexer *lx, size_t pos, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static _Noreturn void lex_fail(lexer *lx, size_t pos, const char *fmt, ...) {
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    throw_status(lx->ec, CS_EINVAL, "line %d: %s", lex_line(lx, pos), tmp);
}

static token *lex_push(lexer *lx, uint8_t type, size_t at) {
    if (lx->ntok == lx->cap) {
        size_t cap = lx->cap ? lx->cap * 2 : 256;
        token *t = arena_alloc(lx->a, cap * sizeof *t);
        if (lx->ntok) memcpy(t, lx->toks, lx->ntok * sizeof *t);
        lx->toks = t;
        lx->cap = cap;
    }
    token *t = &lx->toks[lx->ntok++];
    memset(t, 0, sizeof *t);
    t->type = type;
    t->line = lex_line(lx, at);
    return t;
}

/* Bytes of the whitespace code point at pos (Python's \s), 0 if none. */
static size_t ws_at(const char *s, size_t len, size_t pos) {
    if (pos >= len) return 0;
    int32_t c;
    size_t k = utf8_dec(s + pos, len - pos, &c);
    return is_space_cp(c) ? k : 0;
}

static size_t skip_ws(const char *s, size_t len, size_t pos) {
    size_t k;
    while ((k = ws_at(s, len, pos))) pos += k;
    return pos;
}

/* Emits the text before a tag, applying "-" (strip all whitespace before the tag) or
 * lstrip_blocks (strip the indentation of a block or comment tag that starts its line). */
static void lex_data(lexer *lx, size_t start, size_t end, char sign, bool is_variable) {
    const char *s = lx->src;
    if (sign == '-') {
        while (end > start) {
            size_t k = end - 1;
            while (k > start && ((unsigned char)s[k] & 0xC0) == 0x80) k--;
            if (!ws_at(s, end, k)) break;
            end = k;
        }
    } else if (sign != '+' && !is_variable) {
        size_t l = end;
        while (l > start && s[l - 1] != '\n') l--;
        if ((l > start || lx->line_starting) && l < end && skip_ws(s, end, l) == end) end = l;
    }
    if (end > start) {
        token *t = lex_push(lx, TK_DATA, start);
        t->s = s + start;
        t->n = end - start;
    }
}

/* (\d+_)*\d+ at pos: returns the end, or 0 if there is no digit at pos. */
static size_t lex_digits(const char *s, size_t len, size_t pos, int base) {
    size_t p = pos;
    bool any = false;
    for (;;) {
        size_t q = p;
        while (q < len) {
            int c = (unsigned char)s[q];
            int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                                     : c >= 'A' && c <= 'F' ? c - 'A' + 10 : 99;
            if (d >= base) break;
            q++;
        }
        if (q == p) return any ? p - 1 : 0; /* p - 1: back before a dangling '_' */
        any = true;
        p = q;
        if (p < len && s[p] == '_') p++;
        else return p;
    }
}

static int64_t lex_int_value(lexer *lx, size_t start, size_t end, int base) {
    uint64_t v = 0;
    for (size_t i = start; i < end; i++) {
        int c = (unsigned char)lx->src[i];
        if (c == '_') continue;
        int d = c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10;
        if (v > (UINT64_MAX - (uint64_t)d) / (uint64_t)base || v * (uint64_t)base + (uint64_t)d > (uint64_t)INT64_MAX)
            lex_fail(lx, start, "integer literal too large");
        v = v * (uint64_t)base + (uint64_t)d;
    }
    return (int64_t)v;
}

/* Tries the number rules at pos (float first, as jinja2 does). Returns the end or 0. */
static size_t lex_number(lexer *lx, size_t pos) {
    const char *s = lx->src;
    size_t len = lx->len;
    if (pos >= len || s[pos] < '0' || s[pos] > '9') return 0;
    /* float: (?<!\.)(\d+_)*\d+((\.(\d+_)*\d+)?e[+\-]?(\d+_)*\d+|\.(\d+_)*\d+) */
    if (pos == 0 || s[pos - 1] != '.') {
        size_t p = lex_digits(s, len, pos, 10), frac = 0, end = 0;
        if (p < len && s[p] == '.') frac = lex_digits(s, len, p + 1, 10);
        size_t e = frac ? frac : p;
        if (e < len && (s[e] == 'e' || s[e] == 'E')) {
            size_t q = e + 1;
            if (q < len && (s[q] == '+' || s[q] == '-')) q++;
            size_t d = lex_digits(s, len, q, 10);
            if (d) end = d;
        }
        if (!end) end = frac; /* no exponent: the fraction is required */
        if (end) {
            char tmp[128];
            size_t k = 0;
            for (size_t i = pos; i < end && k + 1 < sizeof tmp; i++)
                if (s[i] != '_') tmp[k++] = s[i];
            tmp[k] = 0;
            token *t = lex_push(lx, TK_FLOAT, pos);
            t->f = strtod(tmp, NULL);
            return end;
        }
    }
    /* integer: 0b.. 0o.. 0x.. [1-9](_?\d)* 0(_?0)* */
    if (s[pos] == '0' && pos + 1 < len) {
        int c = s[pos + 1] | 0x20, base = c == 'b' ? 2 : c == 'o' ? 8 : c == 'x' ? 16 : 0;
        if (base) {
            size_t q = pos + 2;
            if (q < len && s[q] == '_') q++;
            size_t end = lex_digits(s, len, q, base);
            if (end) {
                token *t = lex_push(lx, TK_INT, pos);
                t->i = lex_int_value(lx, pos + 2, end, base);
                return end;
            }
        }
    }
    size_t end;
    if (s[pos] == '0') {
        end = pos + 1;
        for (;;) {
            if (end < len && s[end] == '0') end++;
            else if (end + 1 < len && s[end] == '_' && s[end + 1] == '0') end += 2;
            else break;
        }
    } else {
        end = lex_digits(s, len, pos, 10);
    }
    token *t = lex_push(lx, TK_INT, pos);
    t->i = lex_int_value(lx, pos, end, 10);
    return end;
}

static int hexval(int c) {
    if (c >= '0' && c <= '9') return c - '0';
    c |= 0x20;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

/* Decodes a string literal body like jinja2 does (Python's unicode-escape applied after
 * encoding non-ASCII characters with backslashreplace). */
static void lex_unescape(lexer *lx, size_t at, const char *s, size_t n, token *t) {
    sbuf b;
    sb_init(&b, lx->a, SIZE_MAX / 4, false);
    sb_reserve(&b, n);
    for (size_t i = 0; i < n;) {
        if (s[i] != '\\') {
            size_t k = 1;
            while (i + k < n && s[i + k] != '\\') k++;
            sb_put(&b, s + i, k);
            i += k;
            continue;
        }
        i++; /* the string rule guarantees a character after a backslash */
        unsigned char d = (unsigned char)s[i];
        if (d >= 0x80) {
            /* the backslash escapes the backslash of backslashreplace: keep its escape text */
            int32_t c;
            i += utf8_dec(s + i, n - i, &c);
            sb_printf(&b, c <= 0xFF ? "\\x%02x" : c <= 0xFFFF ? "\\u%04x" : "\\U%08x", (unsigned)c);
            continue;
        }
        i++;
        switch (d) {
        case '\n': break;
        case '\\': sb_putc(&b, '\\'); break;
        case '\'': sb_putc(&b, '\''); break;
        case '"': sb_putc(&b, '"'); break;
        case 'a': sb_putc(&b, 7); break;
        case 'b': sb_putc(&b, 8); break;
        case 'f': sb_putc(&b, 12); break;
        case 'n': sb_putc(&b, '\n'); break;
        case 'r': sb_putc(&b, '\r'); break;
        case 't': sb_putc(&b, '\t'); break;
        case 'v': sb_putc(&b, 11); break;
        case 'x': case 'u': case 'U': {
            int digits = d == 'x' ? 2 : d == 'u' ? 4 : 8;
            uint32_t c = 0;
            for (int k = 0; k < digits; k++) {
                int h = i < n ? hexval((unsigned char)s[i]) : -1;
                if (h < 0) lex_fail(lx, at, "truncated \\%c escape in string literal", d);
                c = c * 16 + (uint32_t)h;
                i++;
            }
            if (c > 0x10FFFF) lex_fail(lx, at, "illegal Unicode character in string literal");
            if (c >= 0xD800 && c < 0xE000) lex_fail(lx, at, "surrogate escapes in string literals are not supported");
            sb_putcp(&b, (int32_t)c);
            break;
        }
        case 'N': lex_fail(lx, at, "\\N{...} escapes in string literals are not supported");
        default:
            if (d >= '0' && d <= '7') {
                uint32_t c = d - '0';
                for (int k = 0; k < 2 && i < n && s[i] >= '0' && s[i] <= '7'; k++) c = c * 8 + (uint32_t)(s[i++] - '0');
                sb_putcp(&b, (int32_t)c);
            } else {
                sb_putc(&b, '\\');
                sb_putc(&b, (char)d);
            }
        }
    }
    t->s = b.p ? b.p : "";
    t->n = b.n;
}

static const struct {
    const char *text;
    uint8_t op;
} lex_ops[] = {
    {"//", OP_FDIV}, {"**", OP_POW}, {"==", OP_EQ}, {"!=", OP_NE}, {">=", OP_GTEQ}, {"<=", OP_LTEQ},
    {"+", OP_ADD}, {"-", OP_SUB}, {"/", OP_DIV}, {"*", OP_MUL}, {"%", OP_MOD}, {"~", OP_TILDE},
    {"[", OP_LBRACKET}, {"]", OP_RBRACKET}, {"(", OP_LPAREN}, {")", OP_RPAREN}, {"{", OP_LBRACE},
    {"}", OP_RBRACE}, {">", OP_GT}, {"<", OP_LT}, {"=", OP_ASSIGN}, {".", OP_DOT}, {":", OP_COLON},
    {"|", OP_PIPE}, {",", OP_COMMA}, {";", OP_SEMICOLON},
};

/* Lexes the inside of {% ... %} (block) or {{ ... }} (variable) up to and including its end. */
static void lex_tag(lexer *lx, bool block) {
    const char *s = lx->src;
    size_t len = lx->len;
    char stack[64];
    int depth = 0;
    while (lx->pos < len) {
        size_t pos = lx->pos;
        if (depth == 0) {
            size_t end = 0;
            if (block) {
                if (s[pos] == '+' && pos + 2 < len && s[pos + 1] == '%' && s[pos + 2] == '}') end = pos + 3;
                else if (s[pos] == '-' && pos + 2 < len && s[pos + 1] == '%' && s[pos + 2] == '}') end = skip_ws(s, len, pos + 3);
                else if (s[pos] == '%' && pos + 1 < len && s[pos + 1] == '}') end = pos + 2 + (pos + 2 < len && s[pos + 2] == '\n');
            } else {
                if (s[pos] == '-' && pos + 2 < len && s[pos + 1] == '}' && s[pos + 2] == '}') end = skip_ws(s, len, pos + 3);
                else if (s[pos] == '}' && pos + 1 < len && s[pos + 1] == '}') end = pos + 2;
            }
            if (end) {
                lex_push(lx, block ? TK_BLOCK_END : TK_VAR_END, pos);
                lx->line_starting = s[end - 1] == '\n';
                lx->pos = end;
                return;
            }
        }
        size_t k = ws_at(s, len, pos);
        if (k) {
            lx->pos = skip_ws(s, len, pos);
            continue;
        }
        size_t end = lex_number(lx, pos);
        if (end) {
            lx->pos = end;
            continue;
        }
        unsigned char c = (unsigned char)s[pos];
        if (c == '_' || ((c | 0x20) >= 'a' && (c | 0x20) <= 'z')) {
            end = pos + 1;
            while (end < len && (s[end] == '_' || (s[end] >= '0' && s[end] <= '9') ||
                                 ((s[end] | 0x20) >= 'a' && (s[end] | 0x20) <= 'z')))
                end++;
            token *t = lex_push(lx, TK_NAME, pos);
            t->s = arena_strndup(lx->a, s + pos, end - pos);
            t->n = end - pos;
            lx->pos = end;
            continue;
        }
        if (c == '\'' || c == '"') {
            size_t i = pos + 1;
            while (i < len && s[i] != (char)c) i += s[i] == '\\' ? 2 : 1;
            if (i < len) {
                token *t = lex_push(lx, TK_STRING, pos);
                lex_unescape(lx, pos, s + pos + 1, i - pos - 1, t);
                lx->pos = i + 1;
                continue;
            }
        }
        uint8_t op = 0;
        size_t oplen = 0;
        for (size_t j = 0; j < sizeof lex_ops / sizeof lex_ops[0]; j++) {
            size_t l = strlen(lex_ops[j].text);
            if (pos + l <= len && memcmp(s + pos, lex_ops[j].text, l) == 0) {
                op = lex_ops[j].op;
                oplen = l;
                break;
            }
        }
        if (!op) {
            int32_t cp;
            utf8_dec(s + pos, len - pos, &cp);
            if (cp >= 0x20 && cp < 0x7F) lex_fail(lx, pos, "unexpected char '%c'", (char)cp);
            lex_fail(lx, pos, "unexpected char U+%04X", (unsigned)cp);
        }
        if (op == OP_LPAREN || op == OP_LBRACKET || op == OP_LBRACE) {
            if (depth == (int)sizeof stack) lex_fail(lx, pos, "brackets nested too deeply");
            stack[depth++] = op == OP_LPAREN ? ')' : op == OP_LBRACKET ? ']' : '}';
        } else if (op == OP_RPAREN || op == OP_RBRACKET || op == OP_RBRACE) {
            char want = op_text[op][0];
            if (depth == 0) lex_fail(lx, pos, "unexpected '%c'", want);
            if (stack[depth - 1] != want) lex_fail(lx, pos, "unexpected '%c', expected '%c'", want, stack[depth - 1]);
            depth--;
        }
        token *t = lex_push(lx, TK_OP, pos);
        t->op = op;
        lx->pos = pos + oplen;
    }
    /* end of source inside a tag: the parser reports what it was looking for */
}

/* {%(-|+|)\s*raw\s*(?:-%}\s*|%}) at pos (which holds "{%"): returns the end, or 0. */
static size_t lex_raw_begin(lexer *lx, size_t pos, const char *word, char *sign) {
    const char *s = lx->src;
    size_t len = lx->len, p = pos + 2, wl = strlen(word);
    *sign = 0;
    if (p < len && (s[p] == '-' || s[p] == '+')) *sign = s[p++];
    p = skip_ws(s, len, p);
    if (p + wl > len || memcmp(s + p, word, wl) != 0) return 0;
    p = skip_ws(s, len, p + wl);
    if (p + 2 < len && s[p] == '-' && s[p + 1] == '%' && s[p + 2] == '}') return skip_ws(s, len, p + 3);
    if (p + 1 < len && s[p] == '%' && s[p + 1] == '}') return p + 2;
    return 0;
}

static void lex_source(lexer *lx) {
    const char *s = lx->src;
    size_t len = lx->len;
    lx->line_starting = true;
    while (lx->pos < len) {
        size_t pos = lx->pos, tag = pos;
        const char *p;
        bool found = false;
        while ((p = memchr(s + tag, '{', len - tag)) != NULL) {
            tag = (size_t)(p - s);
            if (tag + 1 < len && (s[tag + 1] == '{' || s[tag + 1] == '%' || s[tag + 1] == '#')) {
                found = true;
                break;
            }
            tag++;
        }
        if (!found) {
            token *t = lex_push(lx, TK_DATA, pos);
            t->s = s + pos;
            t->n = len - pos;
            break;
        }
        char kind = s[tag + 1], sign = 0;
        if (kind == '%') {
            size_t end = lex_raw_begin(lx, tag, "raw", &sign);
            if (end) {
                lex_data(lx, pos, tag, sign, false);
                lx->line_starting = s[end - 1] == '\n';
                /* (.*?)({%(-|+|)\s*endraw\s*(?:+%}|-%}\s*|%}\n?)) */
                size_t i = end, stop = 0;
                for (; i + 1 < len; i++) {
                    if (s[i] != '{' || s[i + 1] != '%') continue;
                    size_t q = i + 2;
                    if (q < len && (s[q] == '-' || s[q] == '+')) q++;
                    q = skip_ws(s, len, q);
                    if (q + 6 > len || memcmp(s + q, "endraw", 6) != 0) continue;
                    q = skip_ws(s, len, q + 6);
                    if (q + 2 < len && s[q] == '+' && s[q + 1] == '%' && s[q + 2] == '}') stop = q + 3;
                    else if (q + 2 < len && s[q] == '-' && s[q + 1] == '%' && s[q + 2] == '}') stop = skip_ws(s, len, q + 3);
                    else if (q + 1 < len && s[q] == '%' && s[q + 1] == '}') stop = q + 2 + (q + 2 < len && s[q + 2] == '\n');
                    if (stop) break;
                }
                if (!stop) lex_fail(lx, tag, "missing end of raw directive");
                char esign = s[i + 2] == '-' || s[i + 2] == '+' ? s[i + 2] : 0;
                lex_data(lx, end, i, esign, false);
                lx->line_starting = s[stop - 1] == '\n';
                lx->pos = stop;
                continue;
            }
        }
        size_t q = tag + 2;
        if (q < len && (s[q] == '-' || s[q] == '+')) sign = s[q++];
        lex_data(lx, pos, tag, sign, kind == '{');
        lx->line_starting = false;
        if (kind == '#') {
            const char *e = NULL;
            for (size_t i = q; i + 1 < len; i++)
                if (s[i] == '#' && s[i + 1] == '}') {
                    e = s + i;
                    break;
                }
            if (!e) lex_fail(lx, tag, "missing end of comment tag");
            size_t j = (size_t)(e - s), end = j + 2;
            if (j > q && s[j - 1] == '-') end = skip_ws(s, len, end);
            else if (!(j > q && s[j - 1] == '+') && end < len && s[end] == '\n') end++;
            lx->line_starting = s[end - 1] == '\n';
            lx->pos = end;
            continue;
        }
        lex_push(lx, kind == '%' ? TK_BLOCK_BEGIN : TK_VAR_BEGIN, tag);
        lx->pos = q;
        lex_tag(lx, kind == '%');
    }
    lex_push(lx, TK_EOF, len);
}

/* ---------------------------------------------------------- filters, tests, methods ---- */

enum filter_id {
    F_ABS, F_ATTR, F_BATCH, F_CAPITALIZE, F_CENTER, F_DEFAULT, F_DICTSORT, F_ESCAPE, F_FIRST, F_FLOAT,
    F_FORCEESCAPE, F_FORMAT, F_INDENT, F_INT, F_ITEMS, F_JOIN, F_LAST, F_LENGTH, F_LIST, F_LOWER,
    F_MAP, F_MAX, F_MIN, F_REJECT, F_REJECTATTR, F_REPLACE, F_REVERSE, F_ROUND, F_SAFE, F_SELECT, F_SELECTATTR,
    F_SLICE, F_SORT, F_STRING, F_SUM, F_TITLE, F_TOJSON, F_TRIM, F_TRUNCATE, F_UNIQUE, F_UPPER, F_WORDCOUNT,
};

static const struct {
    const char *name;
    int id;
} filter_names[] = {
    {"abs", F_ABS}, {"attr", F_ATTR}, {"batch", F_BATCH}, {"capitalize", F_CAPITALIZE}, {"center", F_CENTER},
    {"count", F_LENGTH}, {"d", F_DEFAULT}, {"default", F_DEFAULT}, {"dictsort", F_DICTSORT}, {"e", F_ESCAPE},
    {"escape", F_ESCAPE}, {"first", F_FIRST}, {"float", F_FLOAT}, {"forceescape", F_FORCEESCAPE},
    {"format", F_FORMAT}, {"indent", F_INDENT}, {"int", F_INT}, {"items", F_ITEMS},
    {"join", F_JOIN}, {"last", F_LAST}, {"length", F_LENGTH}, {"list", F_LIST}, {"lower", F_LOWER},
    {"map", F_MAP}, {"max", F_MAX}, {"min", F_MIN}, {"reject", F_REJECT}, {"rejectattr", F_REJECTATTR},
    {"replace", F_REPLACE}, {"reverse", F_REVERSE}, {"round", F_ROUND}, {"safe", F_SAFE}, {"select", F_SELECT},
    {"selectattr", F_SELECTATTR}, {"slice", F_SLICE}, {"sort", F_SORT}, {"string", F_STRING}, {"sum", F_SUM},
    {"title", F_TITLE}, {"tojson", F_TOJSON}, {"trim", F_TRIM}, {"truncate", F_TRUNCATE}, {"unique", F_UNIQUE},
    {"upper", F_UPPER}, {"wordcount", F_WORDCOUNT},
};

/* jinja2 filters this interpreter refuses (random, HTML-only, or unused by chat templates) */
static const char *const unsupported_filters[] = {
    "filesizeformat", "groupby", "pprint", "random", "striptags", "urlencode", "urlize", "wordwrap", "xmlattr",
};

enum test_id {
    X_ODD, X_EVEN, X_DIVISIBLEBY, X_DEFINED, X_UNDEFINED, X_FILTER, X_TEST, X_NONE, X_BOOLEAN, X_FALSE, X_TRUE,
    X_INTEGER, X_FLOAT, X_LOWER, X_UPPER, X_STRING, X_MAPPING, X_NUMBER, X_SEQUENCE, X_ITERABLE, X_CALLABLE,
    X_SAMEAS, X_ESCAPED, X_IN, X_EQ, X_NE, X_GT, X_GE, X_LT, X_LE,
};

static const struct {
    const char *name;
    int id;
} test_names[] = {
    {"odd", X_ODD}, {"even", X_EVEN}, {"divisibleby", X_DIVISIBLEBY}, {"defined", X_DEFINED},
    {"undefined", X_UNDEFINED}, {"filter", X_FILTER}, {"test", X_TEST}, {"none", X_NONE}, {"boolean", X_BOOLEAN},
    {"false", X_FALSE}, {"true", X_TRUE}, {"integer", X_INTEGER}, {"float", X_FLOAT}, {"lower", X_LOWER},
    {"upper", X_UPPER}, {"string", X_STRING}, {"mapping", X_MAPPING}, {"number", X_NUMBER},
    {"sequence", X_SEQUENCE}, {"iterable", X_ITERABLE}, {"callable", X_CALLABLE}, {"sameas", X_SAMEAS},
    {"escaped", X_ESCAPED}, {"in", X_IN}, {"==", X_EQ}, {"eq", X_EQ}, {"equalto", X_EQ}, {"!=", X_NE},
    {"ne", X_NE}, {">", X_GT}, {"gt", X_GT}, {"greaterthan", X_GT}, {"ge", X_GE}, {">=", X_GE}, {"<", X_LT},
    {"lt", X_LT}, {"lessthan", X_LT}, {"<=", X_LE}, {"le", X_LE},
};

enum func_id { FN_RANGE, FN_NAMESPACE, FN_DICT, FN_RAISE, FN_STRFTIME, FN_CYCLER, FN_JOINER };

static const char *const func_names[] = {
    [FN_RANGE] = "range", [FN_NAMESPACE] = "namespace", [FN_DICT] = "dict", [FN_RAISE] = "raise_exception",
    [FN_STRFTIME] = "strftime_now", [FN_CYCLER] = "cycler", [FN_JOINER] = "joiner",
};

enum method_id {
    /* str */
    M_STRIP, M_LSTRIP, M_RSTRIP, M_SPLIT, M_RSPLIT, M_SPLITLINES, M_STARTSWITH, M_ENDSWITH, M_UPPER, M_LOWER,
    M_TITLE, M_CAPITALIZE, M_REPLACE, M_FIND, M_RFIND, M_INDEX, M_RINDEX, M_COUNT, M_JOIN, M_FORMAT, M_CENTER,
    M_LJUST, M_RJUST, M_ZFILL, M_PARTITION, M_RPARTITION, M_REMOVEPREFIX, M_REMOVESUFFIX, M_ISDIGIT, M_ISALPHA,
    M_ISALNUM, M_ISSPACE, M_ISLOWER, M_ISUPPER, M_ISNUMERIC, M_ISDECIMAL,
    /* dict */
    M_ITEMS, M_KEYS, M_VALUES, M_GET, M_COPY, M_POP, M_POPITEM, M_SETDEFAULT, M_UPDATE, M_CLEAR,
    /* list (and M_POP, M_CLEAR, M_INDEX, M_COUNT, M_COPY) */
    M_APPEND, M_EXTEND, M_INSERT, M_REMOVE, M_REVERSE, M_SORT,
    /* loop, cycler */
    M_CYCLE, M_CHANGED, M_NEXT, M_RESET,
    M_COUNT_,
    /* attributes that are not methods: of the loop, of a range, of a cycler */
    A_INDEX = M_COUNT_, A_INDEX0, A_REVINDEX, A_REVINDEX0, A_FIRST, A_LAST, A_LENGTH, A_DEPTH, A_DEPTH0,
    A_PREVITEM, A_NEXTITEM, A_START, A_STOP, A_STEP, A_CURRENT,
    A_COUNT_,
};

static const char *const method_names[A_COUNT_] = {
    [M_STRIP] = "strip", [M_LSTRIP] = "lstrip", [M_RSTRIP] = "rstrip", [M_SPLIT] = "split",
    [M_RSPLIT] = "rsplit", [M_SPLITLINES] = "splitlines", [M_STARTSWITH] = "startswith",
    [M_ENDSWITH] = "endswith", [M_UPPER] = "upper", [M_LOWER] = "lower", [M_TITLE] = "title",
    [M_CAPITALIZE] = "capitalize", [M_REPLACE] = "replace", [M_FIND] = "find", [M_RFIND] = "rfind",
    [M_INDEX] = "index", [M_RINDEX] = "rindex", [M_COUNT] = "count", [M_JOIN] = "join", [M_FORMAT] = "format",
    [M_CENTER] = "center", [M_LJUST] = "ljust", [M_RJUST] = "rjust", [M_ZFILL] = "zfill",
    [M_PARTITION] = "partition", [M_RPARTITION] = "rpartition", [M_REMOVEPREFIX] = "removeprefix",
    [M_REMOVESUFFIX] = "removesuffix", [M_ISDIGIT] = "isdigit", [M_ISALPHA] = "isalpha", [M_ISALNUM] = "isalnum",
    [M_ISSPACE] = "isspace", [M_ISLOWER] = "islower", [M_ISUPPER] = "isupper", [M_ISNUMERIC] = "isnumeric",
    [M_ISDECIMAL] = "isdecimal", [M_ITEMS] = "items", [M_KEYS] = "keys", [M_VALUES] = "values", [M_GET] = "get",
    [M_COPY] = "copy", [M_POP] = "pop", [M_POPITEM] = "popitem", [M_SETDEFAULT] = "setdefault",
    [M_UPDATE] = "update", [M_CLEAR] = "clear", [M_APPEND] = "append", [M_EXTEND] = "extend",
    [M_INSERT] = "insert", [M_REMOVE] = "remove", [M_REVERSE] = "reverse", [M_SORT] = "sort",
    [M_CYCLE] = "cycle", [M_CHANGED] = "changed", [M_NEXT] = "next", [M_RESET] = "reset",
    [A_INDEX] = "index", [A_INDEX0] = "index0", [A_REVINDEX] = "revindex", [A_REVINDEX0] = "revindex0",
    [A_FIRST] = "first", [A_LAST] = "last", [A_LENGTH] = "length", [A_DEPTH] = "depth", [A_DEPTH0] = "depth0",
    [A_PREVITEM] = "previtem", [A_NEXTITEM] = "nextitem", [A_START] = "start", [A_STOP] = "stop",
    [A_STEP] = "step", [A_CURRENT] = "current",
};

static int lookup_filter(const char *name) {
    for (size_t i = 0; i < sizeof filter_names / sizeof filter_names[0]; i++)
        if (strcmp(filter_names[i].name, name) == 0) return filter_names[i].id;
    return -1;
}

static int lookup_test(const char *name) {
    for (size_t i = 0; i < sizeof test_names / sizeof test_names[0]; i++)
        if (strcmp(test_names[i].name, name) == 0) return test_names[i].id;
    return -1;
}

static int lookup_func(const char *name) {
    for (size_t i = 0; i < sizeof func_names / sizeof func_names[0]; i++)
        if (strcmp(func_names[i], name) == 0) return (int)i;
    return -1;
}

/* A method or one of the other attributes the interpreter knows (loop.index, ...); -1 if
 * none. "index" is both list.index() and loop.index: the method id is returned. */
static int lookup_attr(const char *name) {
    for (int i = 0; i < A_COUNT_; i++)
        if (strcmp(method_names[i], name) == 0) return i;
    return -1;
}

/* -------------------------------------------------------------------------- parser ---- */

typedef struct nvec {
    node **v;
    int n, cap;
} nvec;

typedef struct parser {
    errctx *ec;
    arena *a;
    token *t;
    size_t i;
    int depth;
    int loops;  /* enclosing for loops, for break/continue */
    nvec calls; /* calls of a plain name, checked once all macros are known */
    nvec defs;  /* macro definitions and "set x = joiner(...)" */
} parser;

static _Noreturn void pfail(parser *p, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static _Noreturn void pfail(parser *p, int line, const char *fmt, ...) {
    char tmp[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    throw_status(p->ec, CS_EINVAL, "line %d: %s", line, tmp);
}

static void nv_push(parser *p, nvec *v, node *x) {
    if (v->n == v->cap) {
        int cap = v->cap ? v->cap * 2 : 8;
        node **nv = arena_alloc(p->a, (size_t)cap * sizeof *nv);
        if (v->n) memcpy(nv, v->v, (size_t)v->n * sizeof *nv);
        v->v = nv;
        v->cap = cap;
    }
    v->v[v->n++] = x;
}

static node *new_node(parser *p, int kind, int line) {
    node *n = arena_zalloc(p->a, sizeof *n);
    n->kind = (uint8_t)kind;
    n->line = line;
    return n;
}

static token *cur(parser *p) { return &p->t[p->i]; }
static token *peek(parser *p) { return p->t[p->i].type == TK_EOF ? &p->t[p->i] : &p->t[p->i + 1]; }
static void advance(parser *p) {
    if (p->t[p->i].type != TK_EOF) p->i++;
}
static bool is_name(const token *t, const char *s) { return t->type == TK_NAME && strcmp(t->s, s) == 0; }
static bool is_op(const token *t, int op) { return t->type == TK_OP && t->op == op; }

static const char *describe(const token *t) {
    switch (t->type) {
    case TK_EOF: return "end of template";
    case TK_DATA: return "template data";
    case TK_VAR_BEGIN: return "begin of print statement";
    case TK_VAR_END: return "end of print statement";
    case TK_BLOCK_BEGIN: return "begin of statement block";
    case TK_BLOCK_END: return "end of statement block";
    case TK_NAME: return t->s;
    case TK_STRING: return "string";
    case TK_INT: return "integer";
    case TK_FLOAT: return "float";
    default: return op_text[t->op];
    }
}

static void expect_op(parser *p, int op) {
    if (!is_op(cur(p), op)) pfail(p, cur(p)->line, "expected '%s', got '%s'", op_text[op], describe(cur(p)));
    advance(p);
}

static token *expect_name(parser *p) {
    token *t = cur(p);
    if (t->type != TK_NAME) pfail(p, t->line, "expected a name, got '%s'", describe(t));
    advance(p);
    return t;
}

static void expect_kw(parser *p, const char *kw) {
    if (!is_name(cur(p), kw)) pfail(p, cur(p)->line, "expected '%s', got '%s'", kw, describe(cur(p)));
    advance(p);
}

static void expect_type(parser *p, int type, const char *what) {
    if (cur(p)->type != type) pfail(p, cur(p)->line, "expected %s, got '%s'", what, describe(cur(p)));
    advance(p);
}

static void enter(parser *p) {
    if (++p->depth > MAX_PARSE_DEPTH) pfail(p, cur(p)->line, "template nested too deeply");
}

static node *parse_expression(parser *p, bool with_condexpr);
static node *parse_primary(parser *p, bool with_namespace);
static node *parse_postfix(parser *p, node *n);
static node *parse_filter(parser *p, node *n, bool start_inline);
static node **parse_statements(parser *p, const char *const *ends, bool drop, int *count);

static bool is_tuple_end(parser *p, const char *extra) {
    token *t = cur(p);
    if (t->type == TK_VAR_END || t->type == TK_BLOCK_END || is_op(t, OP_RPAREN)) return true;
    return extra && is_name(t, extra);
}

static node *parse_tuple(parser *p, bool simplified, bool with_condexpr, const char *extra, bool explicit_parens,
                         bool with_namespace) {
    int line = cur(p)->line;
    nvec items = {0};
    bool is_tuple = false;
    for (;;) {
        if (items.n) expect_op(p, OP_COMMA);
        if (is_tuple_end(p, extra)) break;
        nv_push(p, &items, simplified ? parse_primary(p, with_namespace) : parse_expression(p, with_condexpr));
        if (is_op(cur(p), OP_COMMA)) is_tuple = true;
        else break;
    }
    if (!is_tuple) {
        if (items.n) return items.v[0];
        if (!explicit_parens) pfail(p, cur(p)->line, "expected an expression, got '%s'", describe(cur(p)));
    }
    node *n = new_node(p, E_TUPLE, line);
    n->v = items.v;
    n->nv = items.n;
    return n;
}

static void parse_call_args(parser *p, node *n) {
    int line = cur(p)->line;
    expect_op(p, OP_LPAREN);
    nvec args = {0}, kwv = {0};
    const char **kw = NULL;
    int nkw = 0, capkw = 0;
    bool comma = false;
    while (!is_op(cur(p), OP_RPAREN)) {
        if (comma) {
            expect_op(p, OP_COMMA);
            if (is_op(cur(p), OP_RPAREN)) break;
        }
        if (is_op(cur(p), OP_MUL) || is_op(cur(p), OP_POW))
            pfail(p, cur(p)->line, "*args and **kwargs in calls are not supported");
        if (cur(p)->type == TK_NAME && is_op(peek(p), OP_ASSIGN)) {
            const char *key = cur(p)->s;
            advance(p);
            advance(p);
            if (nkw == capkw) {
                capkw = capkw ? capkw * 2 : 4;
                const char **k2 = arena_alloc(p->a, (size_t)capkw * sizeof *k2);
                if (nkw) memcpy(k2, kw, (size_t)nkw * sizeof *k2);
                kw = k2;
            }
            kw[nkw++] = key;
            nv_push(p, &kwv, parse_expression(p, true));
        } else {
            if (nkw) pfail(p, line, "invalid syntax for function call expression");
            nv_push(p, &args, parse_expression(p, true));
        }
        comma = true;
    }
    expect_op(p, OP_RPAREN);
    n->v = args.v;
    n->nv = args.n;
    n->kw = kw;
    n->nkw = nkw;
    n->w = kwv.v;
    n->nw = kwv.n;
}

static node *parse_call(parser *p, node *callee) {
    node *n = new_node(p, E_CALL, cur(p)->line);
    n->a = callee;
    parse_call_args(p, n);
    if (callee->kind == E_NAME) {
        nv_push(p, &p->calls, n);
    } else if (callee->kind == E_GETATTR) {
        if (callee->id < 0 || callee->id >= M_COUNT_) pfail(p, n->line, "unknown method '%s'", callee->name);
    } else {
        pfail(p, n->line, "calling this kind of expression is not supported");
    }
    return n;
}

static node *parse_subscribed(parser *p) {
    int line = cur(p)->line;
    node *start = NULL, *stop = NULL, *step = NULL;
    if (is_op(cur(p), OP_COLON)) {
        advance(p);
    } else {
        node *e = parse_expression(p, true);
        if (!is_op(cur(p), OP_COLON)) return e;
        advance(p);
        start = e;
    }
    if (!is_op(cur(p), OP_COLON) && !is_op(cur(p), OP_RBRACKET) && !is_op(cur(p), OP_COMMA))
        stop = parse_expression(p, true);
    if (is_op(cur(p), OP_COLON)) {
        advance(p);
        if (!is_op(cur(p), OP_RBRACKET) && !is_op(cur(p), OP_COMMA)) step = parse_expression(p, true);
    }
    node *n = new_node(p, E_SLICE, line);
    n->b = start;
    n->x = stop;
    n->y = step;
    return n;
}

static node *parse_subscript(parser *p, node *obj) {
    token *t = cur(p);
    int line = t->line;
    advance(p);
    if (t->type == TK_OP && t->op == OP_DOT) {
        token *a = cur(p);
        advance(p);
        if (a->type == TK_NAME) {
            node *n = new_node(p, E_GETATTR, line);
            n->a = obj;
            n->name = a->s;
            n->id = lookup_attr(a->s);
            return n;
        }
        if (a->type != TK_INT) pfail(p, a->line, "expected name or number");
        node *n = new_node(p, E_GETITEM, line);
        n->a = obj;
        n->b = new_node(p, E_CONST, line);
        n->b->c = v_int(a->i);
        return n;
    }
    nvec args = {0};
    while (!is_op(cur(p), OP_RBRACKET)) {
        if (args.n) expect_op(p, OP_COMMA);
        nv_push(p, &args, parse_subscribed(p));
    }
    expect_op(p, OP_RBRACKET);
    if (args.n == 1 && args.v[0]->kind == E_SLICE) {
        args.v[0]->a = obj;
        return args.v[0];
    }
    node *n = new_node(p, E_GETITEM, line);
    n->a = obj;
    if (args.n == 1) {
        n->b = args.v[0];
    } else {
        for (int i = 0; i < args.n; i++)
            if (args.v[i]->kind == E_SLICE) pfail(p, line, "multi-dimensional slices are not supported");
        n->b = new_node(p, E_TUPLE, line);
        n->b->v = args.v;
        n->b->nv = args.n;
    }
    return n;
}

static node *parse_postfix(parser *p, node *n) {
    for (;;) {
        if (is_op(cur(p), OP_DOT) || is_op(cur(p), OP_LBRACKET)) n = parse_subscript(p, n);
        else if (is_op(cur(p), OP_LPAREN)) n = parse_call(p, n);
        else return n;
    }
}

static const char *dotted_name(parser *p, const char *name) {
    while (is_op(cur(p), OP_DOT)) {
        advance(p);
        const char *part = expect_name(p)->s;
        size_t l1 = strlen(name), l2 = strlen(part);
        char *s = arena_alloc(p->a, l1 + l2 + 2);
        memcpy(s, name, l1);
        s[l1] = '.';
        memcpy(s + l1 + 1, part, l2 + 1);
        name = s;
    }
    return name;
}

static node *parse_filter(parser *p, node *n, bool start_inline) {
    while (is_op(cur(p), OP_PIPE) || start_inline) {
        if (!start_inline) advance(p);
        token *t = expect_name(p);
        const char *name = dotted_name(p, t->s);
        int id = lookup_filter(name);
        if (id < 0) {
            for (size_t i = 0; i < sizeof unsupported_filters / sizeof unsupported_filters[0]; i++)
                if (strcmp(unsupported_filters[i], name) == 0) pfail(p, t->line, "filter '%s' is not supported", name);
            pfail(p, t->line, "no filter named '%s'", name);
        }
        node *f = new_node(p, E_FILTER, t->line);
        f->a = n;
        f->name = name;
        f->id = id;
        if (is_op(cur(p), OP_LPAREN)) parse_call_args(p, f);
        n = f;
        start_inline = false;
    }
    return n;
}

static node *parse_test(parser *p, node *n) {
    int line = cur(p)->line;
    advance(p); /* is */
    bool negated = false;
    if (is_name(cur(p), "not")) {
        advance(p);
        negated = true;
    }
    token *t = expect_name(p);
    const char *name = dotted_name(p, t->s);
    int id = lookup_test(name);
    if (id < 0) pfail(p, t->line, "no test named '%s'", name);
    node *x = new_node(p, E_TEST, line);
    x->a = n;
    x->name = name;
    x->id = id;
    token *c = cur(p);
    if (is_op(c, OP_LPAREN)) {
        parse_call_args(p, x);
    } else if ((c->type == TK_NAME || c->type == TK_STRING || c->type == TK_INT || c->type == TK_FLOAT ||
                is_op(c, OP_LBRACKET) || is_op(c, OP_LBRACE)) &&
               !is_name(c, "else") && !is_name(c, "or") && !is_name(c, "and")) {
        if (is_name(c, "is")) pfail(p, c->line, "you cannot chain multiple tests with is");
        node *arg = parse_postfix(p, parse_primary(p, false));
        x->v = arena_alloc(p->a, sizeof *x->v);
        x->v[0] = arg;
        x->nv = 1;
    }
    if (negated) {
        node *nn = new_node(p, E_NOT, line);
        nn->a = x;
        return nn;
    }
    return x;
}

static node *parse_filter_expr(parser *p, node *n) {
    for (;;) {
        if (is_op(cur(p), OP_PIPE)) n = parse_filter(p, n, false);
        else if (is_name(cur(p), "is")) n = parse_test(p, n);
        else if (is_op(cur(p), OP_LPAREN)) n = parse_call(p, n);
        else return n;
    }
}

static node *parse_primary(parser *p, bool with_namespace) {
    token *t = cur(p);
    node *n;
    enter(p);
    switch (t->type) {
    case TK_NAME:
        advance(p);
        n = new_node(p, E_CONST, t->line);
        if (!strcmp(t->s, "true") || !strcmp(t->s, "True")) n->c = v_bool(true);
        else if (!strcmp(t->s, "false") || !strcmp(t->s, "False")) n->c = v_bool(false);
        else if (!strcmp(t->s, "none") || !strcmp(t->s, "None")) n->c = v_none();
        else if (with_namespace && is_op(cur(p), OP_DOT)) {
            advance(p);
            n->kind = E_NSREF;
            n->name2 = t->s;
            n->name = expect_name(p)->s;
        } else {
            n->kind = E_NAME;
            n->name = t->s;
        }
        break;
    case TK_STRING: {
        sbuf b;
        sb_init(&b, p->a, SIZE_MAX / 4, false);
        n = new_node(p, E_CONST, t->line);
        while (cur(p)->type == TK_STRING) {
            sb_put(&b, cur(p)->s, cur(p)->n);
            advance(p);
        }
        n->c = v_str(b.p ? b.p : "", b.n);
        break;
    }
    case TK_INT:
    case TK_FLOAT:
        advance(p);
        n = new_node(p, E_CONST, t->line);
        n->c = t->type == TK_INT ? v_int(t->i) : v_float(t->f);
        break;
    case TK_OP:
        if (t->op == OP_LPAREN) {
            advance(p);
            n = parse_tuple(p, false, true, NULL, true, false);
            expect_op(p, OP_RPAREN);
            break;
        }
        if (t->op == OP_LBRACKET) {
            advance(p);
            nvec items = {0};
            while (!is_op(cur(p), OP_RBRACKET)) {
                if (items.n) expect_op(p, OP_COMMA);
                if (is_op(cur(p), OP_RBRACKET)) break;
                nv_push(p, &items, parse_expression(p, true));
            }
            expect_op(p, OP_RBRACKET);
            n = new_node(p, E_LIST, t->line);
            n->v = items.v;
            n->nv = items.n;
            break;
        }
        if (t->op == OP_LBRACE) {
            advance(p);
            nvec keys = {0}, vals = {0};
            while (!is_op(cur(p), OP_RBRACE)) {
                if (keys.n) expect_op(p, OP_COMMA);
                if (is_op(cur(p), OP_RBRACE)) break;
                nv_push(p, &keys, parse_expression(p, true));
                expect_op(p, OP_COLON);
                nv_push(p, &vals, parse_expression(p, true));
            }
            expect_op(p, OP_RBRACE);
            n = new_node(p, E_DICT, t->line);
            n->v = keys.v;
            n->nv = keys.n;
            n->w = vals.v;
            n->nw = vals.n;
            break;
        }
        /* fall through */
    default:
        pfail(p, t->line, "unexpected '%s'", describe(t));
    }
    p->depth--;
    return n;
}

static node *parse_unary(parser *p, bool with_filter) {
    token *t = cur(p);
    node *n;
    enter(p);
    if (is_op(t, OP_SUB) || is_op(t, OP_ADD)) {
        advance(p);
        n = new_node(p, t->op == OP_SUB ? E_NEG : E_POS, t->line);
        n->a = parse_unary(p, false);
    } else {
        n = parse_primary(p, false);
    }
    n = parse_postfix(p, n);
    if (with_filter) n = parse_filter_expr(p, n);
    p->depth--;
    return n;
}

static node *binop(parser *p, int kind, int op, int line, node *a, node *b) {
    node *n = new_node(p, kind, line);
    n->op = (uint8_t)op;
    n->a = a;
    n->b = b;
    return n;
}

static node *parse_pow(parser *p) {
    node *left = parse_unary(p, true);
    while (is_op(cur(p), OP_POW)) {
        int line = cur(p)->line;
        advance(p);
        left = binop(p, E_BIN, OP_POW, line, left, parse_unary(p, true));
    }
    return left;
}

static node *parse_math2(parser *p) {
    node *left = parse_pow(p);
    for (;;) {
        token *t = cur(p);
        if (!(is_op(t, OP_MUL) || is_op(t, OP_DIV) || is_op(t, OP_FDIV) || is_op(t, OP_MOD))) return left;
        advance(p);
        left = binop(p, E_BIN, t->op, t->line, left, parse_pow(p));
    }
}

static node *parse_concat(parser *p) {
    node *first = parse_math2(p);
    if (!is_op(cur(p), OP_TILDE)) return first;
    nvec args = {0};
    nv_push(p, &args, first);
    int line = cur(p)->line;
    while (is_op(cur(p), OP_TILDE)) {
        advance(p);
        nv_push(p, &args, parse_math2(p));
    }
    node *n = new_node(p, E_CONCAT, line);
    n->v = args.v;
    n->nv = args.n;
    return n;
}

static node *parse_math1(parser *p) {
    node *left = parse_concat(p);
    for (;;) {
        token *t = cur(p);
        if (!(is_op(t, OP_ADD) || is_op(t, OP_SUB))) return left;
        advance(p);
        left = binop(p, E_BIN, t->op, t->line, left, parse_concat(p));
    }
}

static node *parse_compare(parser *p) {
    int line = cur(p)->line;
    node *expr = parse_math1(p);
    nvec operands = {0};
    uint8_t ops[64];
    int nops = 0;
    for (;;) {
        token *t = cur(p);
        int op;
        if (t->type == TK_OP && (t->op == OP_EQ || t->op == OP_NE || t->op == OP_LT || t->op == OP_LTEQ ||
                                 t->op == OP_GT || t->op == OP_GTEQ)) {
            op = t->op;
            advance(p);
        } else if (is_name(t, "in")) {
            op = OP_IN;
            advance(p);
        } else if (is_name(t, "not") && is_name(peek(p), "in")) {
            op = OP_NOTIN;
            advance(p);
            advance(p);
        } else {
            break;
        }
        if (nops == (int)sizeof ops) pfail(p, t->line, "too many chained comparisons");
        ops[nops++] = (uint8_t)op;
        nv_push(p, &operands, parse_math1(p));
    }
    if (!nops) return expr;
    node *n = new_node(p, E_CMP, line);
    n->a = expr;
    n->v = operands.v;
    n->nv = operands.n;
    n->ops = arena_alloc(p->a, (size_t)nops);
    memcpy(n->ops, ops, (size_t)nops);
    return n;
}

static node *parse_not(parser *p) {
    if (is_name(cur(p), "not")) {
        int line = cur(p)->line;
        advance(p);
        enter(p);
        node *n = new_node(p, E_NOT, line);
        n->a = parse_not(p);
        p->depth--;
        return n;
    }
    return parse_compare(p);
}

static node *parse_and(parser *p) {
    node *left = parse_not(p);
    while (is_name(cur(p), "and")) {
        int line = cur(p)->line;
        advance(p);
        left = binop(p, E_AND, 0, line, left, parse_not(p));
    }
    return left;
}

static node *parse_or(parser *p) {
    node *left = parse_and(p);
    while (is_name(cur(p), "or")) {
        int line = cur(p)->line;
        advance(p);
        left = binop(p, E_OR, 0, line, left, parse_and(p));
    }
    return left;
}

static node *parse_condexpr(parser *p) {
    node *e1 = parse_or(p);
    while (is_name(cur(p), "if")) {
        int line = cur(p)->line;
        advance(p);
        node *n = new_node(p, E_COND, line);
        n->a = parse_or(p);
        n->b = e1;
        if (is_name(cur(p), "else")) {
            advance(p);
            enter(p);
            n->x = parse_condexpr(p);
            p->depth--;
        }
        e1 = n;
    }
    return e1;
}

static node *parse_expression(parser *p, bool with_condexpr) {
    enter(p);
    node *n = with_condexpr ? parse_condexpr(p) : parse_or(p);
    p->depth--;
    return n;
}

static bool can_assign(const node *n) {
    if (n->kind == E_NAME || n->kind == E_NSREF) return true;
    if (n->kind != E_TUPLE) return false;
    for (int i = 0; i < n->nv; i++)
        if (!can_assign(n->v[i])) return false;
    return true;
}

static node *parse_assign_target(parser *p, const char *extra, bool with_namespace) {
    int line = cur(p)->line;
    node *t = parse_tuple(p, true, true, extra, false, with_namespace);
    if (!can_assign(t)) pfail(p, line, "can't assign to this expression");
    return t;
}

static void parse_signature(parser *p, node *n) {
    const char **names = NULL;
    nvec defaults = {0};
    int count = 0, cap = 0;
    bool have_default = false;
    expect_op(p, OP_LPAREN);
    while (!is_op(cur(p), OP_RPAREN)) {
        if (count) expect_op(p, OP_COMMA);
        token *t = expect_name(p);
        node *d = NULL;
        if (is_op(cur(p), OP_ASSIGN)) {
            advance(p);
            d = parse_expression(p, true);
            have_default = true;
        } else if (have_default) {
            pfail(p, t->line, "non-default argument follows default argument");
        }
        if (count == cap) {
            cap = cap ? cap * 2 : 4;
            const char **n2 = arena_alloc(p->a, (size_t)cap * sizeof *n2);
            if (count) memcpy(n2, names, (size_t)count * sizeof *n2);
            names = n2;
        }
        names[count++] = t->s;
        nv_push(p, &defaults, d);
    }
    expect_op(p, OP_RPAREN);
    n->kw = names;
    n->nkw = count;
    n->w = defaults.v;
    n->nw = defaults.n;
}

/* Calls fn on every node of the tree under n. */
static void walk(const node *n, void (*fn)(const node *, void *), void *ud) {
    if (!n) return;
    fn(n, ud);
    walk(n->a, fn, ud);
    walk(n->b, fn, ud);
    walk(n->x, fn, ud);
    walk(n->y, fn, ud);
    for (int i = 0; i < n->nv; i++) walk(n->v[i], fn, ud);
    for (int i = 0; i < n->nw; i++) walk(n->w[i], fn, ud);
}

static void find_macro_names(const node *n, void *ud) {
    uint8_t *flags = ud;
    if (n->kind != E_NAME) return;
    if (!strcmp(n->name, "caller")) *flags |= MF_CALLER;
    else if (!strcmp(n->name, "varargs")) *flags |= MF_VARARGS;
    else if (!strcmp(n->name, "kwargs")) *flags |= MF_KWARGS;
}

static void set_macro_flags(node *n) {
    uint8_t flags = 0;
    for (int i = 0; i < n->nv; i++) walk(n->v[i], find_macro_names, &flags);
    n->flags = flags;
}

static node *parse_statement(parser *p) {
    token *t = cur(p);
    int line = t->line;
    if (t->type != TK_NAME) pfail(p, line, "tag name expected");
    const char *tag = t->s;
    node *n;
    enter(p);
    if (!strcmp(tag, "if")) {
        advance(p);
        node *result = new_node(p, S_IF, line), *cur_if = result;
        for (;;) {
            cur_if->a = parse_tuple(p, false, false, NULL, false, false);
            static const char *const ends[] = {"elif", "else", "endif", NULL};
            cur_if->v = parse_statements(p, ends, false, &cur_if->nv);
            token *e = cur(p);
            advance(p);
            if (is_name(e, "elif")) {
                node *next_if = new_node(p, S_IF, e->line);
                next_if->flags = IF_ELIF;
                cur_if->w = arena_alloc(p->a, sizeof *cur_if->w);
                cur_if->w[0] = next_if;
                cur_if->nw = 1;
                cur_if = next_if;
                continue;
            }
            if (is_name(e, "else")) {
                static const char *const endif[] = {"endif", NULL};
                cur_if->w = parse_statements(p, endif, true, &cur_if->nw);
            }
            break;
        }
        n = result;
    } else if (!strcmp(tag, "for")) {
        advance(p);
        n = new_node(p, S_FOR, line);
        n->a = parse_assign_target(p, "in", false);
        expect_kw(p, "in");
        n->b = parse_tuple(p, false, false, "recursive", false, false);
        if (is_name(cur(p), "if")) {
            advance(p);
            n->x = parse_expression(p, true);
        }
        if (is_name(cur(p), "recursive")) pfail(p, cur(p)->line, "recursive for loops are not supported");
        static const char *const ends[] = {"endfor", "else", NULL};
        p->loops++;
        n->v = parse_statements(p, ends, false, &n->nv);
        p->loops--;
        token *e = cur(p);
        advance(p);
        if (is_name(e, "else")) {
            static const char *const endfor[] = {"endfor", NULL};
            n->w = parse_statements(p, endfor, true, &n->nw);
        }
    } else if (!strcmp(tag, "set")) {
        advance(p);
        node *target = parse_assign_target(p, NULL, true);
        if (is_op(cur(p), OP_ASSIGN)) {
            advance(p);
            n = new_node(p, S_SET, line);
            n->a = target;
            n->b = parse_tuple(p, false, true, NULL, false, false);
            if (target->kind == E_NAME && n->b->kind == E_CALL && n->b->a->kind == E_NAME &&
                !strcmp(n->b->a->name, "joiner"))
                nv_push(p, &p->defs, n);
        } else {
            n = new_node(p, S_SETBLOCK, line);
            n->a = target;
            n->b = parse_filter(p, NULL, false);
            static const char *const ends[] = {"endset", NULL};
            n->v = parse_statements(p, ends, true, &n->nv);
        }
    } else if (!strcmp(tag, "macro")) {
        advance(p);
        n = new_node(p, S_MACRO, line);
        n->name = expect_name(p)->s;
        parse_signature(p, n);
        static const char *const ends[] = {"endmacro", NULL};
        int loops = p->loops;
        p->loops = 0;
        n->v = parse_statements(p, ends, true, &n->nv);
        p->loops = loops;
        set_macro_flags(n);
        nv_push(p, &p->defs, n);
    } else if (!strcmp(tag, "call")) {
        advance(p);
        n = new_node(p, S_CALLBLOCK, line);
        if (is_op(cur(p), OP_LPAREN)) parse_signature(p, n);
        n->a = parse_expression(p, true);
        if (n->a->kind != E_CALL) pfail(p, line, "expected call");
        static const char *const ends[] = {"endcall", NULL};
        int loops = p->loops;
        p->loops = 0;
        n->v = parse_statements(p, ends, true, &n->nv);
        p->loops = loops;
        set_macro_flags(n);
    } else if (!strcmp(tag, "filter")) {
        advance(p);
        n = new_node(p, S_FILTERBLOCK, line);
        n->b = parse_filter(p, NULL, true);
        static const char *const ends[] = {"endfilter", NULL};
        n->v = parse_statements(p, ends, true, &n->nv);
    } else if (!strcmp(tag, "with")) {
        advance(p);
        n = new_node(p, S_WITH, line);
        nvec vals = {0};
        int cap = 0;
        while (cur(p)->type != TK_BLOCK_END) {
            if (n->nkw) expect_op(p, OP_COMMA);
            node *target = parse_assign_target(p, NULL, false);
            if (target->kind != E_NAME) pfail(p, line, "only plain names are supported as with targets");
            expect_op(p, OP_ASSIGN);
            if (n->nkw == cap) {
                cap = cap ? cap * 2 : 4;
                const char **k2 = arena_alloc(p->a, (size_t)cap * sizeof *k2);
                if (n->nkw) memcpy(k2, n->kw, (size_t)n->nkw * sizeof *k2);
                n->kw = k2;
            }
            n->kw[n->nkw++] = target->name;
            nv_push(p, &vals, parse_expression(p, true));
        }
        n->w = vals.v;
        n->nw = vals.n;
        static const char *const ends[] = {"endwith", NULL};
        n->v = parse_statements(p, ends, true, &n->nv);
    } else if (!strcmp(tag, "print")) {
        advance(p);
        n = new_node(p, S_OUTPUT, line);
        nvec items = {0};
        while (cur(p)->type != TK_BLOCK_END) {
            if (items.n) expect_op(p, OP_COMMA);
            nv_push(p, &items, parse_expression(p, true));
        }
        n->v = items.v;
        n->nv = items.n;
    } else if (!strcmp(tag, "break") || !strcmp(tag, "continue")) {
        advance(p);
        if (!p->loops) pfail(p, line, "'%s' outside of a loop", tag);
        n = new_node(p, tag[0] == 'b' ? S_BREAK : S_CONTINUE, line);
    } else if (!strcmp(tag, "generation")) {
        advance(p);
        n = new_node(p, S_SCOPE, line);
        static const char *const ends[] = {"endgeneration", NULL};
        n->v = parse_statements(p, ends, true, &n->nv);
    } else if (!strcmp(tag, "block") || !strcmp(tag, "extends") || !strcmp(tag, "include") ||
               !strcmp(tag, "import") || !strcmp(tag, "from") || !strcmp(tag, "autoescape")) {
        pfail(p, line, "tag '%s' is not supported", tag);
    } else {
        pfail(p, line, "unknown tag '%s'", tag);
    }
    p->depth--;
    return n;
}

/* Parses statements and text up to a block whose tag is one of ends (NULL: end of source),
 * leaving that tag name as the current token. */
static node **subparse(parser *p, const char *const *ends, int *count) {
    nvec body = {0}, data = {0};
    enter(p);
    for (;;) {
        token *t = cur(p);
        if (t->type == TK_EOF) break;
        if (t->type == TK_DATA) {
            node *d = new_node(p, E_CONST, t->line);
            d->c = v_str(t->s, t->n);
            nv_push(p, &data, d);
            advance(p);
        } else if (t->type == TK_VAR_BEGIN) {
            advance(p);
            nv_push(p, &data, parse_tuple(p, false, true, NULL, false, false));
            expect_type(p, TK_VAR_END, "end of print statement");
        } else if (t->type == TK_BLOCK_BEGIN) {
            if (data.n) {
                node *o = new_node(p, S_OUTPUT, data.v[0]->line);
                o->v = data.v;
                o->nv = data.n;
                nv_push(p, &body, o);
                memset(&data, 0, sizeof data);
            }
            advance(p);
            if (ends && cur(p)->type == TK_NAME)
                for (int i = 0; ends[i]; i++)
                    if (!strcmp(cur(p)->s, ends[i])) goto done;
            nv_push(p, &body, parse_statement(p));
            expect_type(p, TK_BLOCK_END, "end of statement block");
        } else {
            pfail(p, t->line, "unexpected '%s'", describe(t));
        }
    }
    if (data.n) {
        node *o = new_node(p, S_OUTPUT, data.v[0]->line);
        o->v = data.v;
        o->nv = data.n;
        nv_push(p, &body, o);
    }
done:
    p->depth--;
    *count = body.n;
    return body.v;
}

static node **parse_statements(parser *p, const char *const *ends, bool drop, int *count) {
    if (is_op(cur(p), OP_COLON)) advance(p);
    expect_type(p, TK_BLOCK_END, "end of statement block");
    node **body = subparse(p, ends, count);
    if (cur(p)->type == TK_EOF) {
        char want[128] = "";
        for (int i = 0; ends[i]; i++) {
            size_t l = strlen(want);
            snprintf(want + l, sizeof want - l, "%s'%s'", i ? " or " : "", ends[i]);
        }
        pfail(p, cur(p)->line, "unexpected end of template, expected %s", want);
    }
    if (drop) advance(p);
    return body;
}

/* --------------------------------------------------------- jinja2's name resolution ---- */

/* jinja2 decides at compile time where each name lives (jinja2/idtracking.py). Looking names
 * up through the chain of scopes at run time agrees with it except in one case: a name whose
 * first mention in a scope is an unconditional assignment starts that scope as undefined,
 * even when an enclosing scope or the context has it. So in
 *     {% for m in messages %}{{ x }}{% endfor %}{% set x = 1 %}
 * the loop prints nothing although x was passed in. This pass replays jinja2's analysis and
 * records those names on the node that opens each scope; the evaluator binds them to
 * undefined when it enters the scope. */

enum { LOAD_PARAM, LOAD_RESOLVE, LOAD_ALIAS, LOAD_UNDEF };

typedef struct symref {
    const char *name;
    int load;
} symref;

typedef struct symtab {
    struct symtab *parent;
    symref *refs;
    int nrefs, caprefs;
    const char **stores;
    int nstores, capstores;
} symtab;

static int sym_index(const symtab *st, const char *name) {
    for (int i = 0; i < st->nrefs; i++)
        if (!strcmp(st->refs[i].name, name)) return i;
    return -1;
}

static bool sym_find(const symtab *st, const char *name) {
    for (; st; st = st->parent)
        if (sym_index(st, name) >= 0) return true;
    return false;
}

static bool sym_stored(const symtab *st, const char *name) {
    for (int i = 0; i < st->nstores; i++)
        if (!strcmp(st->stores[i], name)) return true;
    return false;
}

static void sym_define(parser *p, symtab *st, const char *name, int load) {
    int i = sym_index(st, name);
    if (i >= 0) {
        st->refs[i].load = load;
        return;
    }
    if (st->nrefs == st->caprefs) {
        int cap = st->caprefs ? st->caprefs * 2 : 8;
        symref *r = arena_alloc(p->a, (size_t)cap * sizeof *r);
        if (st->nrefs) memcpy(r, st->refs, (size_t)st->nrefs * sizeof *r);
        st->refs = r;
        st->caprefs = cap;
    }
    st->refs[st->nrefs++] = (symref){name, load};
}

static void sym_add_store(parser *p, symtab *st, const char *name) {
    if (sym_stored(st, name)) return;
    if (st->nstores == st->capstores) {
        int cap = st->capstores ? st->capstores * 2 : 8;
        const char **s2 = arena_alloc(p->a, (size_t)cap * sizeof *s2);
        if (st->nstores) memcpy(s2, st->stores, (size_t)st->nstores * sizeof *s2);
        st->stores = s2;
        st->capstores = cap;
    }
    st->stores[st->nstores++] = name;
}

static void sym_load(parser *p, symtab *st, const char *name) {
    if (!sym_find(st, name)) sym_define(p, st, name, LOAD_RESOLVE);
}

static void sym_store(parser *p, symtab *st, const char *name) {
    sym_add_store(p, st, name);
    if (sym_index(st, name) >= 0) return;
    sym_define(p, st, name, st->parent && sym_find(st->parent, name) ? LOAD_ALIAS : LOAD_UNDEF);
}

static void sym_param(parser *p, symtab *st, const char *name) {
    sym_add_store(p, st, name);
    sym_define(p, st, name, LOAD_PARAM);
}

static symtab *sym_copy(parser *p, const symtab *st) {
    symtab *c = arena_zalloc(p->a, sizeof *c);
    c->parent = st->parent;
    for (int i = 0; i < st->nrefs; i++) sym_define(p, c, st->refs[i].name, st->refs[i].load);
    for (int i = 0; i < st->nstores; i++) sym_add_store(p, c, st->stores[i]);
    return c;
}

static void sym_stmts(parser *p, symtab *st, node *const *body, int n);

static void sym_expr(parser *p, symtab *st, const node *n) {
    if (!n) return;
    if (n->kind == E_NAME) sym_load(p, st, n->name);
    if (n->kind == E_NSREF) sym_load(p, st, n->name2);
    sym_expr(p, st, n->a);
    sym_expr(p, st, n->b);
    sym_expr(p, st, n->x);
    sym_expr(p, st, n->y);
    for (int i = 0; i < n->nv; i++) sym_expr(p, st, n->v[i]);
    for (int i = 0; i < n->nw; i++) sym_expr(p, st, n->w[i]);
}

static void sym_target(parser *p, symtab *st, const node *t, bool param) {
    if (t->kind == E_NAME) {
        if (param) sym_param(p, st, t->name);
        else sym_store(p, st, t->name);
    } else if (t->kind == E_NSREF) {
        sym_load(p, st, t->name2);
    } else {
        for (int i = 0; i < t->nv; i++) sym_target(p, st, t->v[i], param);
    }
}

/* Symbols.branch_update: merges the branches of an If into st. A name assigned in a branch
 * (and not before in this scope) is read from outside until an assignment runs. */
static void sym_branch_update(parser *p, symtab *st, symtab *const *br, int nbr) {
    int cap = 0;
    for (int k = 0; k < nbr; k++) cap += br[k]->nstores;
    const char **names = cap ? arena_alloc(p->a, (size_t)cap * sizeof *names) : NULL;
    int nnames = 0;
    for (int k = 0; k < nbr; k++)
        for (int i = 0; i < br[k]->nstores; i++)
            if (!sym_stored(st, br[k]->stores[i])) names[nnames++] = br[k]->stores[i];
    for (int k = 0; k < nbr; k++) {
        for (int i = 0; i < br[k]->nrefs; i++) sym_define(p, st, br[k]->refs[i].name, br[k]->refs[i].load);
        for (int i = 0; i < br[k]->nstores; i++) sym_add_store(p, st, br[k]->stores[i]);
    }
    for (int j = 0; j < nnames; j++)
        sym_define(p, st, names[j], st->parent && sym_find(st->parent, names[j]) ? LOAD_ALIAS : LOAD_RESOLVE);
}

static bool is_elif(const node *n) { return n->nw == 1 && n->w[0]->kind == S_IF && (n->w[0]->flags & IF_ELIF); }

/* FrameSymbolVisitor.visit_If: the test, then the body, the elifs (each an If of its own with
 * a test and a body, all visited in one copy) and the else, each in a copy of the symbols */
static void sym_if(parser *p, symtab *st, const node *n, bool single) {
    sym_expr(p, st, n->a);
    symtab *br[3];
    br[0] = sym_copy(p, st);
    sym_stmts(p, br[0], n->v, n->nv);
    br[1] = sym_copy(p, st);
    br[2] = sym_copy(p, st);
    if (!single) {
        const node *last = n;
        while (is_elif(last)) {
            last = last->w[0];
            sym_if(p, br[1], last, true);
        }
        sym_stmts(p, br[2], last->w, last->nw);
    }
    sym_branch_update(p, st, br, 3);
}

/* jinja2's FrameSymbolVisitor: what a statement does to the names of its own scope */
static void sym_stmts(parser *p, symtab *st, node *const *body, int n) {
    for (int i = 0; i < n; i++) {
        const node *s = body[i];
        switch (s->kind) {
        case S_OUTPUT:
            for (int k = 0; k < s->nv; k++) sym_expr(p, st, s->v[k]);
            break;
        case S_SET:
            sym_expr(p, st, s->b);
            sym_target(p, st, s->a, false);
            break;
        case S_SETBLOCK: sym_target(p, st, s->a, false); break;
        case S_IF: sym_if(p, st, s, false); break;
        case S_FOR: sym_expr(p, st, s->b); break;
        case S_MACRO: sym_store(p, st, s->name); break;
        case S_CALLBLOCK: sym_expr(p, st, s->a); break;
        case S_FILTERBLOCK: sym_expr(p, st, s->b); break;
        case S_WITH:
            for (int k = 0; k < s->nw; k++) sym_expr(p, st, s->w[k]);
            break;
        default: break;
        }
    }
}

static void analyze_children(parser *p, symtab *st, node *const *body, int n);

/* Analyzes the scope a node opens (its parameters, then its body) and those inside it. */
static void analyze_frame(parser *p, symtab *parent, node *owner, node *const *body, int n, bool else_block) {
    symtab *st = arena_zalloc(p->a, sizeof *st);
    st->parent = parent;
    if (owner && owner->kind == S_FOR && !else_block) {
        sym_target(p, st, owner->a, true);
        sym_param(p, st, "loop");
    }
    if (owner && (owner->kind == S_MACRO || owner->kind == S_CALLBLOCK)) {
        for (int i = 0; i < owner->nkw; i++) sym_param(p, st, owner->kw[i]);
        if (owner->flags & MF_CALLER) sym_param(p, st, "caller");
        if (owner->flags & MF_VARARGS) sym_param(p, st, "varargs");
        if (owner->flags & MF_KWARGS) sym_param(p, st, "kwargs");
        for (int i = 0; i < owner->nw; i++) sym_expr(p, st, owner->w[i]);
    }
    if (owner && owner->kind == S_WITH)
        for (int i = 0; i < owner->nkw; i++) sym_param(p, st, owner->kw[i]);
    sym_stmts(p, st, body, n);
    int count = 0;
    for (int i = 0; i < st->nrefs; i++) count += st->refs[i].load == LOAD_UNDEF;
    const char **names = count ? arena_alloc(p->a, (size_t)count * sizeof *names) : NULL;
    count = 0;
    for (int i = 0; i < st->nrefs; i++)
        if (st->refs[i].load == LOAD_UNDEF) names[count++] = st->refs[i].name;
    if (else_block) {
        owner->uninit2 = names;
        owner->nuninit2 = count;
    } else {
        owner->uninit = names;
        owner->nuninit = count;
    }
    analyze_children(p, st, body, n);
}

static void analyze_children(parser *p, symtab *st, node *const *body, int n) {
    for (int i = 0; i < n; i++) {
        node *s = body[i];
        switch (s->kind) {
        case S_IF:
            analyze_children(p, st, s->v, s->nv);
            analyze_children(p, st, s->w, s->nw);
            break;
        case S_FOR:
            analyze_frame(p, st, s, s->v, s->nv, false);
            if (s->nw) analyze_frame(p, st, s, s->w, s->nw, true);
            break;
        case S_MACRO:
        case S_CALLBLOCK:
        case S_SETBLOCK:
        case S_FILTERBLOCK:
        case S_WITH:
        case S_SCOPE: analyze_frame(p, st, s, s->v, s->nv, false); break;
        default: break;
        }
    }
}

/* A call of a plain name must be a global function, a macro of the template, a joiner
 * kept in a variable, or caller() inside a macro. */
static void check_calls(parser *p) {
    for (int i = 0; i < p->calls.n; i++) {
        const node *c = p->calls.v[i];
        const char *name = c->a->name;
        if (lookup_func(name) >= 0 || !strcmp(name, "caller")) continue;
        bool ok = false;
        for (int j = 0; j < p->defs.n && !ok; j++) {
            const node *d = p->defs.v[j];
            ok = d->kind == S_MACRO ? !strcmp(d->name, name) : !strcmp(d->a->name, name);
        }
        if (ok) continue;
        if (!strcmp(name, "loop")) pfail(p, c->line, "recursive loop calls are not supported");
        if (!strcmp(name, "lipsum")) pfail(p, c->line, "function 'lipsum' is not supported");
        pfail(p, c->line, "unknown function '%s'", name);
    }
}

/* ---------------------------------------------------------------------- evaluation ---- */

struct scope {
    scope *parent;
    size_t n, cap;
    const char **names;
    val *vals;
};

typedef struct rctx {
    errctx ec;
    arena a;
    sbuf *out;
    int depth;
    long iterations;
    int line; /* of the node being evaluated, for messages */
} rctx;

enum { FLOW_NORMAL, FLOW_BREAK, FLOW_CONTINUE };

static _Noreturn void rfail(rctx *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static _Noreturn void rfail(rctx *r, const char *fmt, ...) {
    char tmp[900];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    throw_status(&r->ec, CS_EINVAL, "line %d: %s", r->line, tmp);
}

static void enter_r(rctx *r) {
    if (++r->depth > CHAT_TEMPLATE_MAX_DEPTH)
        throw_limit(&r->ec, "line %d: template nested or recursed deeper than %d evaluation levels", r->line,
                    CHAT_TEMPLATE_MAX_DEPTH);
}

static scope *scope_new(rctx *r, scope *parent) {
    scope *s = arena_zalloc(&r->a, sizeof *s);
    s->parent = parent;
    return s;
}

static val *scope_find(scope *s, const char *name) {
    for (; s; s = s->parent)
        for (size_t i = s->n; i-- > 0;)
            if (!strcmp(s->names[i], name)) return &s->vals[i];
    return NULL;
}

static void scope_set(rctx *r, scope *s, const char *name, val v) {
    for (size_t i = 0; i < s->n; i++)
        if (!strcmp(s->names[i], name)) {
            s->vals[i] = v;
            return;
        }
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 4;
        const char **names = arena_alloc(&r->a, cap * sizeof *names);
        val *vals = arena_alloc(&r->a, cap * sizeof *vals);
        if (s->n) {
            memcpy(names, s->names, s->n * sizeof *names);
            memcpy(vals, s->vals, s->n * sizeof *vals);
        }
        s->names = names;
        s->vals = vals;
        s->cap = cap;
    }
    s->names[s->n] = name;
    s->vals[s->n++] = v;
}

/* Binds the names jinja2 starts as undefined in a new scope (see analyze_frame). */
static val undef_lazy(rctx *r, int kind, const char *name, val obj, int64_t index);

static void bind_uninit(rctx *r, scope *s, const char *const *names, int n) {
    for (int i = 0; i < n; i++) scope_set(r, s, names[i], undef_lazy(r, U_NAME, names[i], v_none(), 0));
}

static scope *scope_open(rctx *r, scope *parent, const char *const *uninit, int nuninit) {
    scope *s = scope_new(r, parent);
    bind_uninit(r, s, uninit, nuninit);
    return s;
}

static val mk_str(rctx *r, const char *p, size_t n) { return v_str(arena_strndup(&r->a, p, n), n); }
static val sb_val(const sbuf *b) { return v_str(b->p ? b->p : "", b->n); }
static val v_cstr(const char *s) { return v_str(s, strlen(s)); }
static val v_markup(val s) {
    s.k = 1;
    return s;
}

static list *list_new(rctx *r, size_t n) {
    list *l = arena_zalloc(&r->a, sizeof *l);
    l->n = n;
    l->v = n ? arena_zalloc(&r->a, n * sizeof *l->v) : NULL;
    return l;
}

static val v_list(list *l, int kind) { return (val){.t = T_LIST, .k = (uint8_t)kind, .u.l = l}; }

static val v_tuple2(rctx *r, val a, val b) {
    list *l = list_new(r, 2);
    l->v[0] = a;
    l->v[1] = b;
    return v_list(l, LK_TUPLE);
}

static dict *dict_new(rctx *r, size_t cap) {
    dict *d = arena_zalloc(&r->a, sizeof *d);
    d->cap = cap;
    if (cap) {
        d->k = arena_alloc(&r->a, cap * sizeof *d->k);
        d->v = arena_alloc(&r->a, cap * sizeof *d->v);
    }
    return d;
}

static val v_dict(dict *d) { return (val){.t = T_DICT, .u.d = d}; }

static val v_iter(rctx *r, list *l) {
    iterobj *it = arena_zalloc(&r->a, sizeof *it);
    it->l = l;
    return (val){.t = T_ITER, .u.it = it};
}

static bool is_num(val v) { return v.t == T_BOOL || v.t == T_INT || v.t == T_FLOAT; }
static bool is_intlike(val v) { return v.t == T_BOOL || v.t == T_INT; }
static int64_t as_int(val v) { return v.t == T_BOOL ? (int64_t)v.u.b : v.u.i; }
static double as_float(val v) { return v.t == T_FLOAT ? v.u.f : (double)as_int(v); }

static const char *type_name(val v) {
    switch (v.t) {
    case T_UNDEF: return "Undefined";
    case T_NONE: return "NoneType";
    case T_BOOL: return "bool";
    case T_INT: return "int";
    case T_FLOAT: return "float";
    case T_STR: return v.k ? "Markup" : "str";
    case T_LIST:
        switch (v.k) {
        case LK_TUPLE: return "tuple";
        case LK_RANGE: return "range";
        case LK_KEYS: return "dict_keys";
        case LK_VALUES: return "dict_values";
        case LK_ITEMS: return "dict_items";
        default: return "list";
        }
    case T_DICT: return "dict";
    case T_NS: return "Namespace";
    case T_MACRO: return "Macro";
    case T_FUNC: return "function";
    case T_METHOD: return "builtin_function_or_method";
    case T_LOOP: return "LoopContext";
    case T_ITER: return "generator";
    case T_CYCLER: return "Cycler";
    case T_JOINER: return "Joiner";
    default: return "object";
    }
}

/* jinja2's object_type_repr, for messages about undefined attributes */
static const char *obj_desc(rctx *r, val v) {
    if (v.t == T_NONE) return "None";
    char tmp[64];
    snprintf(tmp, sizeof tmp, "%s object", type_name(v));
    return arena_strndup(&r->a, tmp, strlen(tmp));
}

static const char *rsprintf(rctx *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static const char *rsprintf(rctx *r, const char *fmt, ...) {
    char tmp[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    return arena_strndup(&r->a, tmp, strlen(tmp));
}

static _Noreturn void undef_fail(rctx *r, val v) {
    if (v.k == UK_LAZY) {
        const struct undef_info *u = v.u.ud;
        if (u->kind == U_NAME) rfail(r, "'%s' is undefined", u->name);
        if (u->kind == U_ATTR) rfail(r, "'%s' has no attribute '%s'", obj_desc(r, u->obj), u->name);
        rfail(r, "'%s' has no element %" PRId64, obj_desc(r, u->obj), u->index);
    }
    rfail(r, "%s", v.u.msg ? v.u.msg : "undefined value");
}

static val undef_lazy(rctx *r, int kind, const char *name, val obj, int64_t index) {
    struct undef_info *u = arena_alloc(&r->a, sizeof *u);
    u->kind = kind;
    u->name = name;
    u->obj = obj;
    u->index = index;
    return (val){.t = T_UNDEF, .k = UK_LAZY, .u.ud = u};
}

static bool truthy(val v) {
    switch (v.t) {
    case T_UNDEF:
    case T_NONE:
    case T_MISSING: return false;
    case T_BOOL: return v.u.b;
    case T_INT: return v.u.i != 0;
    case T_FLOAT: return v.u.f != 0.0;
    case T_STR: return v.u.s.n != 0;
    case T_LIST: return v.u.l->n != 0;
    case T_DICT:
    case T_NS: return v.u.d->n != 0 || v.t == T_NS;
    case T_LOOP: return v.u.lp->n != 0;
    default: return true;
    }
}

/* Python's float.__repr__: the shortest digits that read back exactly, in fixed notation
 * when the decimal exponent is in [-4, 16), else as d.ddde+XX. */
static void fmt_float(double d, char *out, size_t outlen) {
    if (isnan(d)) {
        snprintf(out, outlen, "nan");
        return;
    }
    if (isinf(d)) {
        snprintf(out, outlen, d < 0 ? "-inf" : "inf");
        return;
    }
    if (d == 0) {
        snprintf(out, outlen, signbit(d) ? "-0.0" : "0.0");
        return;
    }
    char tmp[64];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*e", prec - 1, d);
        if (strtod(tmp, NULL) == d) break;
    }
    char digits[32];
    int nd = 0, exp10 = 0;
    bool neg = tmp[0] == '-';
    const char *c = tmp + neg;
    for (; *c && *c != 'e'; c++)
        if (*c >= '0' && *c <= '9') digits[nd++] = *c;
    if (*c == 'e') exp10 = atoi(c + 1);
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    digits[nd] = 0;
    int decpt = exp10 + 1;
    /* at most 26 characters: the callers' 64-byte buffers hold them */
    char *o = out;
    if (neg) *o++ = '-';
    if (decpt > -4 && decpt <= 16) {
        if (decpt <= 0) {
            *o++ = '0';
            *o++ = '.';
            for (int i = 0; i < -decpt; i++) *o++ = '0';
            memcpy(o, digits, (size_t)nd);
            o += nd;
        } else if (decpt >= nd) {
            memcpy(o, digits, (size_t)nd);
            o += nd;
            for (int i = nd; i < decpt; i++) *o++ = '0';
            *o++ = '.';
            *o++ = '0';
        } else {
            memcpy(o, digits, (size_t)decpt);
            o += decpt;
            *o++ = '.';
            memcpy(o, digits + decpt, (size_t)(nd - decpt));
            o += nd - decpt;
        }
        *o = 0;
    } else {
        *o++ = digits[0];
        if (nd > 1) {
            *o++ = '.';
            memcpy(o, digits + 1, (size_t)(nd - 1));
            o += nd - 1;
        }
        snprintf(o, outlen - (size_t)(o - out), "e%c%02d", decpt - 1 < 0 ? '-' : '+', abs(decpt - 1));
    }
}

static void put_repr(rctx *r, sbuf *b, val v);

static void put_pystr_repr(sbuf *b, const char *p, size_t n) {
    bool sq = memchr(p, '\'', n) != NULL, dq = memchr(p, '"', n) != NULL;
    char q = sq && !dq ? '"' : '\'';
    sb_putc(b, q);
    for (size_t i = 0; i < n;) {
        int32_t c;
        size_t k = utf8_dec(p + i, n - i, &c);
        if (c == q || c == '\\') {
            sb_putc(b, '\\');
            sb_putc(b, (char)c);
        } else if (c == '\t') sb_puts(b, "\\t");
        else if (c == '\n') sb_puts(b, "\\n");
        else if (c == '\r') sb_puts(b, "\\r");
        else if (c < 0x20 || c == 0x7F) sb_printf(b, "\\x%02x", (unsigned)c);
        else if (c < 0x7F || is_printable_cp(c)) sb_put(b, p + i, k);
        else if (c <= 0xFF) sb_printf(b, "\\x%02x", (unsigned)c);
        else if (c <= 0xFFFF) sb_printf(b, "\\u%04x", (unsigned)c);
        else sb_printf(b, "\\U%08x", (unsigned)c);
        i += k;
    }
    sb_putc(b, q);
}

/* str(v) appended to b */
static void put_str(rctx *r, sbuf *b, val v) {
    char tmp[64];
    switch (v.t) {
    case T_UNDEF:
    case T_MISSING: return;
    case T_NONE: sb_puts(b, "None"); return;
    case T_BOOL: sb_puts(b, v.u.b ? "True" : "False"); return;
    case T_INT: sb_printf(b, "%" PRId64, v.u.i); return;
    case T_FLOAT:
        fmt_float(v.u.f, tmp, sizeof tmp);
        sb_puts(b, tmp);
        return;
    case T_STR: sb_put(b, v.u.s.p, v.u.s.n); return;
    default: put_repr(r, b, v);
    }
}

static void put_items_repr(rctx *r, sbuf *b, const list *l) {
    for (size_t i = 0; i < l->n; i++) {
        if (i) sb_puts(b, ", ");
        put_repr(r, b, l->v[i]);
    }
}

static void put_dict_repr(rctx *r, sbuf *b, const dict *d) {
    sb_putc(b, '{');
    for (size_t i = 0; i < d->n; i++) {
        if (i) sb_puts(b, ", ");
        put_repr(r, b, d->k[i]);
        sb_puts(b, ": ");
        put_repr(r, b, d->v[i]);
    }
    sb_putc(b, '}');
}

/* repr(v) appended to b */
static void put_repr(rctx *r, sbuf *b, val v) {
    enter_r(r);
    switch (v.t) {
    case T_UNDEF: sb_puts(b, "Undefined"); break;
    case T_STR:
        if (v.k) sb_puts(b, "Markup(");
        put_pystr_repr(b, v.u.s.p, v.u.s.n);
        if (v.k) sb_putc(b, ')');
        break;
    case T_LIST: {
        const list *l = v.u.l;
        switch (v.k) {
        case LK_TUPLE:
            sb_putc(b, '(');
            put_items_repr(r, b, l);
            if (l->n == 1) sb_putc(b, ',');
            sb_putc(b, ')');
            break;
        case LK_RANGE:
            if (l->step == 1) sb_printf(b, "range(%" PRId64 ", %" PRId64 ")", l->start, l->stop);
            else sb_printf(b, "range(%" PRId64 ", %" PRId64 ", %" PRId64 ")", l->start, l->stop, l->step);
            break;
        case LK_LIST:
            sb_putc(b, '[');
            put_items_repr(r, b, l);
            sb_putc(b, ']');
            break;
        default:
            sb_puts(b, type_name(v));
            sb_puts(b, "([");
            put_items_repr(r, b, l);
            sb_puts(b, "])");
        }
        break;
    }
    case T_DICT: put_dict_repr(r, b, v.u.d); break;
    case T_NS:
        sb_puts(b, "<Namespace ");
        put_dict_repr(r, b, v.u.d);
        sb_putc(b, '>');
        break;
    case T_MACRO:
        if (v.u.m->name) sb_printf(b, "<Macro '%s'>", v.u.m->name);
        else sb_puts(b, "<Macro anonymous>"); /* the caller of a call block */
        break;
    case T_LOOP: sb_printf(b, "<LoopContext %zu/%zu>", v.u.lp->i + 1, v.u.lp->n); break;
    case T_FUNC:
    case T_METHOD:
    case T_ITER:
    case T_CYCLER:
    case T_JOINER:
        rfail(r, "cannot turn a %s into text (Python would print its memory address)", type_name(v));
    default: put_str(r, b, v);
    }
    r->depth--;
}

static val str_of(rctx *r, val v) {
    if (v.t == T_STR) return v;
    sbuf b;
    sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    put_str(r, &b, v);
    return sb_val(&b);
}

/* soft_str: str(v) but a Markup stays Markup */
static val soft_str(rctx *r, val v) { return v.t == T_STR ? v : str_of(r, v); }

/* markupsafe.escape */
static val html_escape(rctx *r, val v) {
    if (v.t == T_STR && v.k) return v;
    val s = str_of(r, v);
    sbuf b;
    sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    sb_reserve(&b, s.u.s.n);
    for (size_t i = 0; i < s.u.s.n; i++) {
        char c = s.u.s.p[i];
        switch (c) {
        case '&': sb_puts(&b, "&amp;"); break;
        case '<': sb_puts(&b, "&lt;"); break;
        case '>': sb_puts(&b, "&gt;"); break;
        case '\'': sb_puts(&b, "&#39;"); break;
        case '"': sb_puts(&b, "&#34;"); break;
        default: sb_putc(&b, c);
        }
    }
    return v_markup(sb_val(&b));
}

/* --------------------------------------------------------------- equality, order ---- */

static bool py_eq(rctx *r, val a, val b);

static bool hashable(val v) {
    if (v.t == T_DICT) return false;
    if (v.t == T_LIST) {
        if (v.k == LK_RANGE) return true;
        if (v.k != LK_TUPLE) return false;
        for (size_t i = 0; i < v.u.l->n; i++)
            if (!hashable(v.u.l->v[i])) return false;
    }
    return true;
}

static long dict_find(rctx *r, const dict *d, val key) {
    if (key.t == T_STR) {
        for (size_t i = 0; i < d->n; i++)
            if (d->k[i].t == T_STR && d->k[i].u.s.n == key.u.s.n && !memcmp(d->k[i].u.s.p, key.u.s.p, key.u.s.n))
                return (long)i;
        return -1;
    }
    for (size_t i = 0; i < d->n; i++)
        if (py_eq(r, d->k[i], key)) return (long)i;
    return -1;
}

static bool list_contains(rctx *r, const list *l, val x) {
    for (size_t i = 0; i < l->n; i++)
        if (py_eq(r, l->v[i], x)) return true;
    return false;
}

static bool py_eq(rctx *r, val a, val b) {
    if (is_num(a) && is_num(b)) {
        if (is_intlike(a) && is_intlike(b)) return as_int(a) == as_int(b);
        return as_float(a) == as_float(b);
    }
    if (a.t != b.t) return false;
    switch (a.t) {
    case T_UNDEF:
    case T_NONE: return true;
    case T_STR: return a.u.s.n == b.u.s.n && !memcmp(a.u.s.p, b.u.s.p, a.u.s.n);
    case T_LIST: {
        const list *x = a.u.l, *y = b.u.l;
        if (a.k != b.k) return false;
        if (a.k == LK_VALUES) return x == y;
        if (x->n != y->n) return false;
        enter_r(r);
        bool eq = true;
        if (a.k == LK_KEYS || a.k == LK_ITEMS) {
            for (size_t i = 0; i < x->n && eq; i++) eq = list_contains(r, y, x->v[i]);
        } else {
            for (size_t i = 0; i < x->n && eq; i++) eq = py_eq(r, x->v[i], y->v[i]);
        }
        r->depth--;
        return eq;
    }
    case T_DICT: {
        const dict *x = a.u.d, *y = b.u.d;
        if (x->n != y->n) return false;
        enter_r(r);
        bool eq = true;
        for (size_t i = 0; i < x->n && eq; i++) {
            long j = dict_find(r, y, x->k[i]);
            eq = j >= 0 && py_eq(r, x->v[i], y->v[j]);
        }
        r->depth--;
        return eq;
    }
    default: return a.u.l == b.u.l; /* identity of the pointer in the union */
    }
}

static const char *cmp_text(int op) { return op_text[op]; }

/* Python's a < b (etc.); op is OP_LT, OP_LTEQ, OP_GT or OP_GTEQ */
static bool py_order(rctx *r, val a, val b, int op) {
    if (a.t == T_UNDEF) undef_fail(r, a);
    if (b.t == T_UNDEF) undef_fail(r, b);
    int c;
    if (is_num(a) && is_num(b)) {
        if (is_intlike(a) && is_intlike(b)) {
            int64_t x = as_int(a), y = as_int(b);
            c = x < y ? -1 : x > y;
        } else {
            double x = as_float(a), y = as_float(b);
            if (isnan(x) || isnan(y)) return false;
            c = x < y ? -1 : x > y;
        }
    } else if (a.t == T_STR && b.t == T_STR) {
        size_t n = a.u.s.n < b.u.s.n ? a.u.s.n : b.u.s.n;
        c = memcmp(a.u.s.p, b.u.s.p, n);
        if (c == 0) c = a.u.s.n < b.u.s.n ? -1 : a.u.s.n > b.u.s.n;
    } else if (a.t == T_LIST && b.t == T_LIST && a.k == b.k && (a.k == LK_LIST || a.k == LK_TUPLE)) {
        const list *x = a.u.l, *y = b.u.l;
        size_t i = 0;
        while (i < x->n && i < y->n && py_eq(r, x->v[i], y->v[i])) i++;
        if (i < x->n && i < y->n) return py_order(r, x->v[i], y->v[i], op);
        c = x->n < y->n ? -1 : x->n > y->n;
    } else {
        rfail(r, "'%s' not supported between instances of '%s' and '%s'", cmp_text(op), type_name(a), type_name(b));
    }
    switch (op) {
    case OP_LT: return c < 0;
    case OP_LTEQ: return c <= 0;
    case OP_GT: return c > 0;
    default: return c >= 0;
    }
}

/* For sorting: a < b with Python semantics */
static bool py_less(rctx *r, val a, val b) { return py_order(r, a, b, OP_LT); }

/* ------------------------------------------------------------------------ json.dumps ---- */

typedef struct json_opts {
    bool ensure_ascii, sort_keys, indent_set;
    val indent; /* int or str */
    const char *item_sep, *key_sep;
    size_t item_sep_n, key_sep_n;
} json_opts;

static void json_put_str(sbuf *b, const char *p, size_t n, bool ascii) {
    sb_putc(b, '"');
    for (size_t i = 0; i < n;) {
        int32_t c;
        size_t k = utf8_dec(p + i, n - i, &c);
        switch (c) {
        case '"': sb_puts(b, "\\\""); break;
        case '\\': sb_puts(b, "\\\\"); break;
        case '\n': sb_puts(b, "\\n"); break;
        case '\r': sb_puts(b, "\\r"); break;
        case '\t': sb_puts(b, "\\t"); break;
        case '\b': sb_puts(b, "\\b"); break;
        case '\f': sb_puts(b, "\\f"); break;
        default:
            if (c < 0x20 || (ascii && c >= 0x7F)) {
                if (c > 0xFFFF) {
                    int32_t v = c - 0x10000;
                    sb_printf(b, "\\u%04x\\u%04x", (unsigned)(0xD800 | (v >> 10)), (unsigned)(0xDC00 | (v & 0x3FF)));
                } else {
                    sb_printf(b, "\\u%04x", (unsigned)c);
                }
            } else {
                sb_put(b, p + i, k);
            }
        }
        i += k;
    }
    sb_putc(b, '"');
}

static void json_newline(sbuf *b, const json_opts *o, int level) {
    sb_putc(b, '\n');
    if (o->indent.t == T_STR) {
        for (int i = 0; i < level; i++) sb_put(b, o->indent.u.s.p, o->indent.u.s.n);
    } else {
        int64_t w = as_int(o->indent);
        for (int64_t i = 0; i < w * level; i++) sb_putc(b, ' ');
    }
}

static void json_put(rctx *r, sbuf *b, val v, const json_opts *o, int level);

/* json.dumps turns keys that are not strings into strings */
static val json_key(rctx *r, val k) {
    char tmp[64];
    switch (k.t) {
    case T_STR: return k;
    case T_BOOL: return v_cstr(k.u.b ? "true" : "false");
    case T_NONE: return v_cstr("null");
    case T_INT: return str_of(r, k);
    case T_FLOAT:
        if (isnan(k.u.f)) return v_cstr("NaN");
        if (isinf(k.u.f)) return v_cstr(k.u.f < 0 ? "-Infinity" : "Infinity");
        fmt_float(k.u.f, tmp, sizeof tmp);
        return mk_str(r, tmp, strlen(tmp));
    default: rfail(r, "keys must be str, int, float, bool or None, not %s", type_name(k));
    }
}

static void json_put(rctx *r, sbuf *b, val v, const json_opts *o, int level) {
    char tmp[64];
    enter_r(r);
    switch (v.t) {
    case T_NONE: sb_puts(b, "null"); break;
    case T_BOOL: sb_puts(b, v.u.b ? "true" : "false"); break;
    case T_INT: sb_printf(b, "%" PRId64, v.u.i); break;
    case T_FLOAT:
        if (isnan(v.u.f)) sb_puts(b, "NaN");
        else if (isinf(v.u.f)) sb_puts(b, v.u.f < 0 ? "-Infinity" : "Infinity");
        else {
            fmt_float(v.u.f, tmp, sizeof tmp);
            sb_puts(b, tmp);
        }
        break;
    case T_STR: json_put_str(b, v.u.s.p, v.u.s.n, o->ensure_ascii); break;
    case T_LIST:
        if (v.k != LK_LIST && v.k != LK_TUPLE) rfail(r, "Object of type %s is not JSON serializable", type_name(v));
        if (v.u.l->n == 0) {
            sb_puts(b, "[]");
            break;
        }
        sb_putc(b, '[');
        for (size_t i = 0; i < v.u.l->n; i++) {
            if (i) sb_put(b, o->item_sep, o->item_sep_n);
            if (o->indent_set) json_newline(b, o, level + 1);
            json_put(r, b, v.u.l->v[i], o, level + 1);
        }
        if (o->indent_set) json_newline(b, o, level);
        sb_putc(b, ']');
        break;
    case T_DICT: {
        const dict *d = v.u.d;
        if (d->n == 0) {
            sb_puts(b, "{}");
            break;
        }
        size_t *order = arena_alloc(&r->a, d->n * sizeof *order);
        for (size_t i = 0; i < d->n; i++) order[i] = i;
        if (o->sort_keys) /* insertion sort: stable, and dicts are small */
            for (size_t i = 1; i < d->n; i++)
                for (size_t j = i; j > 0 && py_less(r, d->k[order[j]], d->k[order[j - 1]]); j--) {
                    size_t t = order[j];
                    order[j] = order[j - 1];
                    order[j - 1] = t;
                }
        sb_putc(b, '{');
        for (size_t i = 0; i < d->n; i++) {
            if (i) sb_put(b, o->item_sep, o->item_sep_n);
            if (o->indent_set) json_newline(b, o, level + 1);
            val k = json_key(r, d->k[order[i]]);
            json_put_str(b, k.u.s.p, k.u.s.n, o->ensure_ascii);
            sb_put(b, o->key_sep, o->key_sep_n);
            json_put(r, b, d->v[order[i]], o, level + 1);
        }
        if (o->indent_set) json_newline(b, o, level);
        sb_putc(b, '}');
        break;
    }
    default: rfail(r, "Object of type %s is not JSON serializable", type_name(v));
    }
    r->depth--;
}

/* ----------------------------------------------------------------- conversions ---- */

static val from_json(rctx *r, const json_t *j, int depth) {
    if (depth > CHAT_TEMPLATE_MAX_DEPTH) rfail(r, "input nested deeper than %d levels", CHAT_TEMPLATE_MAX_DEPTH);
    switch (json_typeof(j)) {
    case JSON_NULL: return v_none();
    case JSON_TRUE: return v_bool(true);
    case JSON_FALSE: return v_bool(false);
    case JSON_INTEGER: return v_int((int64_t)json_integer_value(j));
    case JSON_REAL: return v_float(json_real_value(j));
    case JSON_STRING: return v_str(json_string_value(j), json_string_length(j));
    case JSON_ARRAY: {
        list *l = list_new(r, json_array_size(j));
        for (size_t i = 0; i < l->n; i++) l->v[i] = from_json(r, json_array_get(j, i), depth + 1);
        return v_list(l, LK_LIST);
    }
    case JSON_OBJECT: {
        dict *d = dict_new(r, json_object_size(j));
        const char *key;
        json_t *value;
        json_object_foreach((json_t *)j, key, value) {
            d->k[d->n] = v_str(key, strlen(key));
            d->v[d->n++] = from_json(r, value, depth + 1);
        }
        return v_dict(d);
    }
    }
    return v_none();
}

/* The items of an iterable (an iterator is consumed). */
static const val *iterate(rctx *r, val v, size_t *n) {
    switch (v.t) {
    case T_LIST:
        *n = v.u.l->n;
        return v.u.l->v;
    case T_DICT:
        *n = v.u.d->n;
        return v.u.d->k;
    case T_UNDEF:
        *n = 0;
        return NULL;
    case T_ITER: {
        iterobj *it = v.u.it;
        *n = it->l->n - it->pos;
        const val *items = it->l->v ? it->l->v + it->pos : NULL; /* an empty list may have no array */
        it->pos = it->l->n;
        if (it->err) throw_status(&r->ec, CS_EINVAL, "%s", it->err);
        return items;
    }
    case T_STR: {
        size_t count = cs_utf8_count(v.u.s.p, v.u.s.n), off = 0;
        val *items = arena_alloc(&r->a, (count ? count : 1) * sizeof *items);
        for (size_t i = 0; i < count; i++) {
            int32_t c;
            size_t k = utf8_dec(v.u.s.p + off, v.u.s.n - off, &c);
            items[i] = v_str(v.u.s.p + off, k); /* iterating a Markup gives plain strings */
            off += k;
        }
        *n = count;
        return items;
    }
    default: rfail(r, "'%s' object is not iterable", type_name(v));
    }
}

static list *to_list(rctx *r, val v) {
    size_t n;
    const val *items = iterate(r, v, &n);
    list *l = list_new(r, n);
    if (n) memcpy(l->v, items, n * sizeof *items);
    return l;
}

static int64_t py_len(rctx *r, val v) {
    switch (v.t) {
    case T_STR: return (int64_t)cs_utf8_count(v.u.s.p, v.u.s.n);
    case T_LIST: return (int64_t)v.u.l->n;
    case T_DICT: return (int64_t)v.u.d->n;
    case T_UNDEF: return 0;
    case T_LOOP: return (int64_t)v.u.lp->n;
    default: rfail(r, "object of type '%s' has no len()", type_name(v));
    }
}

static bool py_in(rctx *r, val item, val seq) {
    switch (seq.t) {
    case T_STR: {
        if (item.t != T_STR) rfail(r, "'in <string>' requires string as left operand, not %s", type_name(item));
        if (item.u.s.n == 0) return true;
        for (size_t i = 0; i + item.u.s.n <= seq.u.s.n; i++)
            if (!memcmp(seq.u.s.p + i, item.u.s.p, item.u.s.n)) return true;
        return false;
    }
    case T_LIST: return list_contains(r, seq.u.l, item);
    case T_DICT:
        if (!hashable(item)) rfail(r, "unhashable type: '%s'", type_name(item));
        return dict_find(r, seq.u.d, item) >= 0;
    case T_UNDEF: return false;
    case T_ITER: {
        iterobj *it = seq.u.it;
        while (it->pos < it->l->n)
            if (py_eq(r, it->l->v[it->pos++], item)) return true;
        if (it->err) throw_status(&r->ec, CS_EINVAL, "%s", it->err);
        return false;
    }
    default: rfail(r, "argument of type '%s' is not iterable", type_name(seq));
    }
}

/* ------------------------------------------------------------ attributes, items ---- */

static bool method_of_str(int m) { return m >= M_STRIP && m <= M_ISDECIMAL; }
static bool method_of_dict(int m) { return m >= M_ITEMS && m <= M_CLEAR; }
static bool method_of_list(int m) {
    return m == M_POP || m == M_CLEAR || m == M_INDEX || m == M_COUNT || m == M_COPY || (m >= M_APPEND && m <= M_SORT);
}
static bool method_mutates(int m) {
    return m == M_POP || m == M_POPITEM || m == M_SETDEFAULT || m == M_UPDATE || m == M_CLEAR ||
           (m >= M_APPEND && m <= M_SORT);
}

static val bound(rctx *r, val self, int mid) {
    struct bound *b = arena_alloc(&r->a, sizeof *b);
    b->self = self;
    b->mid = mid;
    return (val){.t = T_METHOD, .u.bm = b};
}

static val unsafe_attr(rctx *r, val obj, const char *name) {
    val u = v_undef(rsprintf(r, "access to attribute '%s' of '%s' object is unsafe.", name, type_name(obj)));
    u.k = UK_UNSAFE;
    return u;
}

static val loop_attr(struct loopctx *lp, int aid, bool *found) {
    *found = true;
    int64_t i = (int64_t)lp->i, n = (int64_t)lp->n;
    switch (aid) {
    case M_INDEX: /* "index" is also list.index() */
    case A_INDEX: return v_int(i + 1);
    case A_INDEX0: return v_int(i);
    case A_REVINDEX: return v_int(n - i);
    case A_REVINDEX0: return v_int(n - i - 1);
    case A_FIRST: return v_bool(i == 0);
    case A_LAST: return v_bool(i == n - 1);
    case A_LENGTH: return v_int(n);
    case A_DEPTH: return v_int(1);
    case A_DEPTH0: return v_int(0);
    case A_PREVITEM: return i > 0 ? lp->items[i - 1] : v_undef("there is no previous item");
    case A_NEXTITEM: return i + 1 < n ? lp->items[i + 1] : v_undef("there is no next item");
    }
    *found = false;
    return v_missing();
}

/* The Python attribute name of obj (a method, a namespace attribute, a loop property), as
 * the sandbox sees it; aid is lookup_attr(name); *found is false when there is none. */
static val attr_only(rctx *r, val obj, const char *name, int aid, bool *found) {
    *found = true;
    int mid = aid < M_COUNT_ ? aid : -1;
    switch (obj.t) {
    case T_STR:
        if (mid >= 0 && method_of_str(mid)) return bound(r, obj, mid);
        break;
    case T_DICT:
        if (mid >= 0 && method_of_dict(mid)) return method_mutates(mid) ? unsafe_attr(r, obj, name) : bound(r, obj, mid);
        break;
    case T_LIST:
        if (obj.k == LK_LIST && mid >= 0 && method_of_list(mid))
            return method_mutates(mid) ? unsafe_attr(r, obj, name) : bound(r, obj, mid);
        if ((obj.k == LK_TUPLE || obj.k == LK_RANGE) && (mid == M_INDEX || mid == M_COUNT)) return bound(r, obj, mid);
        if (obj.k == LK_RANGE) {
            if (aid == A_START) return v_int(obj.u.l->start);
            if (aid == A_STOP) return v_int(obj.u.l->stop);
            if (aid == A_STEP) return v_int(obj.u.l->step);
        }
        break;
    case T_NS: {
        long i = dict_find(r, obj.u.d, v_cstr(name));
        if (i >= 0) return obj.u.d->v[i];
        break;
    }
    case T_LOOP: {
        if (mid == M_CYCLE || mid == M_CHANGED) return bound(r, obj, mid);
        val v = loop_attr(obj.u.lp, aid, found);
        if (*found) return v;
        *found = true;
        break;
    }
    case T_CYCLER:
        if (mid == M_NEXT || mid == M_RESET) return bound(r, obj, mid);
        if (aid == A_CURRENT) return obj.u.cy->items[obj.u.cy->pos];
        break;
    default: break;
    }
    if (name[0] == '_' && name[1] == '_' && obj.t != T_NS) return unsafe_attr(r, obj, name); /* Python internals */
    *found = false;
    return v_missing();
}

static val no_attr(rctx *r, val obj, const char *name) { return undef_lazy(r, U_ATTR, name, obj, 0); }

/* obj.name: the attribute first, then obj["name"] (jinja2's sandboxed getattr) */
static val get_attr(rctx *r, val obj, const char *name, int aid) {
    if (obj.t == T_UNDEF) undef_fail(r, obj);
    bool found;
    val v = attr_only(r, obj, name, aid, &found);
    if (found) return v;
    if (obj.t == T_DICT) {
        long i = dict_find(r, obj.u.d, v_cstr(name));
        if (i >= 0) return obj.u.d->v[i];
    }
    return no_attr(r, obj, name);
}

static bool index_of(val key, int64_t n, int64_t *idx) {
    if (!is_intlike(key)) return false;
    int64_t i = as_int(key);
    if (i < 0) i += n;
    if (i < 0 || i >= n) return false;
    *idx = i;
    return true;
}

/* obj[key]: the item first, then the attribute named key (jinja2's sandboxed getitem) */
static val get_item(rctx *r, val obj, val key) {
    int64_t i;
    switch (obj.t) {
    case T_UNDEF: undef_fail(r, obj);
    case T_DICT:
        if (hashable(key)) {
            long j = dict_find(r, obj.u.d, key);
            if (j >= 0) return obj.u.d->v[j];
        }
        break;
    case T_LIST:
        if (obj.k <= LK_RANGE && index_of(key, (int64_t)obj.u.l->n, &i)) return obj.u.l->v[i];
        if (obj.k <= LK_RANGE && is_intlike(key))
            return undef_lazy(r, U_ELEM, NULL, obj, as_int(key));
        break;
    case T_STR:
        if (index_of(key, (int64_t)cs_utf8_count(obj.u.s.p, obj.u.s.n), &i)) {
            size_t off = utf8_off(obj.u.s.p, obj.u.s.n, (size_t)i);
            int32_t c;
            val ch = v_str(obj.u.s.p + off, utf8_dec(obj.u.s.p + off, obj.u.s.n - off, &c));
            ch.k = obj.k;
            return ch;
        }
        break;
    default: break;
    }
    if (key.t == T_STR) {
        bool found;
        const char *name = arena_strndup(&r->a, key.u.s.p, key.u.s.n);
        val v = attr_only(r, obj, name, lookup_attr(name), &found);
        if (found) return v;
        return no_attr(r, obj, name);
    }
    sbuf b;
    sb_init(&b, &r->a, 1 << 20, false);
    put_repr(r, &b, key);
    return v_undef(rsprintf(r, "'%s' has no element %s", obj_desc(r, obj), b.p ? b.p : ""));
}

/* Python's slice.indices(): fills start/stop/step and returns the number of items */
static int64_t slice_indices(rctx *r, val vstart, val vstop, val vstep, int64_t len, int64_t *start, int64_t *stop,
                             int64_t *step) {
    *step = vstep.t == T_NONE || vstep.t == T_MISSING ? 1 : as_int(vstep);
    if (*step == 0) rfail(r, "slice step cannot be zero");
    int64_t lower = *step < 0 ? -1 : 0, upper = *step < 0 ? len - 1 : len;
    int64_t bounds[2];
    val given[2] = {vstart, vstop};
    for (int k = 0; k < 2; k++) {
        if (given[k].t == T_NONE || given[k].t == T_MISSING) {
            bounds[k] = (k == 0) == (*step < 0) ? upper : lower;
            continue;
        }
        int64_t x = as_int(given[k]);
        if (x < 0) {
            x += len;
            if (x < lower) x = lower;
        } else if (x > upper) {
            x = upper;
        }
        bounds[k] = x;
    }
    *start = bounds[0];
    *stop = bounds[1];
    if (*step > 0) return *stop > *start ? (*stop - *start - 1) / *step + 1 : 0;
    return *start > *stop ? (*start - *stop - 1) / (-*step) + 1 : 0;
}

/* obj[start:stop:step]: jinja2 compiles slices to plain Python subscripts (the sandbox's
 * getitem is bypassed), so slicing anything but a sequence is an error, not undefined */
static val get_slice(rctx *r, val obj, val vstart, val vstop, val vstep) {
    if (obj.t == T_UNDEF) undef_fail(r, obj);
    if (obj.t != T_STR && !(obj.t == T_LIST && obj.k <= LK_RANGE))
        rfail(r, "'%s' object is not subscriptable", type_name(obj));
    val parts[3] = {vstart, vstop, vstep};
    for (int k = 0; k < 3; k++)
        if (parts[k].t != T_NONE && parts[k].t != T_MISSING && !is_intlike(parts[k]))
            rfail(r, "slice indices must be integers or None");
    int64_t start, stop, step, count;
    if (obj.t == T_STR) {
        const char *p = obj.u.s.p;
        size_t n = obj.u.s.n, cps = cs_utf8_count(p, n);
        count = slice_indices(r, vstart, vstop, vstep, (int64_t)cps, &start, &stop, &step);
        sbuf b;
        sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
        if (step == 1) {
            size_t a = utf8_off(p, n, (size_t)start), e = utf8_off(p, n, (size_t)(start + count));
            sb_put(&b, p + a, e - a);
        } else {
            size_t *offs = arena_alloc(&r->a, (cps + 1) * sizeof *offs), off = 0;
            for (size_t i = 0; i <= cps; i++) {
                offs[i] = off;
                if (i < cps) {
                    int32_t c;
                    off += utf8_dec(p + off, n - off, &c);
                }
            }
            for (int64_t i = 0, j = start; i < count; i++, j += step)
                sb_put(&b, p + offs[j], offs[j + 1] - offs[j]);
        }
        val out = sb_val(&b);
        out.k = obj.k;
        return out;
    }
    if (obj.t == T_LIST && obj.k <= LK_RANGE) {
        const list *l = obj.u.l;
        count = slice_indices(r, vstart, vstop, vstep, (int64_t)l->n, &start, &stop, &step);
        list *out = list_new(r, (size_t)count);
        for (int64_t i = 0, j = start; i < count; i++, j += step) out->v[i] = l->v[j];
        if (obj.k == LK_RANGE) {
            out->start = l->start + start * l->step;
            out->stop = l->start + stop * l->step;
            out->step = l->step * step;
        }
        return v_list(out, obj.k);
    }
    rfail(r, "'%s' object is not subscriptable", type_name(obj));
}

/* ---------------------------------------------------------------------- arithmetic ---- */

static _Noreturn void overflow(rctx *r) { rfail(r, "integer result does not fit in 64 bits"); }

static val num_op(rctx *r, int op, val a, val b) {
    if (is_intlike(a) && is_intlike(b)) {
        int64_t x = as_int(a), y = as_int(b), z;
        switch (op) {
        case OP_ADD:
            if (__builtin_add_overflow(x, y, &z)) overflow(r);
            return v_int(z);
        case OP_SUB:
            if (__builtin_sub_overflow(x, y, &z)) overflow(r);
            return v_int(z);
        case OP_MUL:
            if (__builtin_mul_overflow(x, y, &z)) overflow(r);
            return v_int(z);
        case OP_DIV:
            if (y == 0) rfail(r, "division by zero");
            return v_float((double)x / (double)y);
        case OP_FDIV:
        case OP_MOD:
            if (y == 0) rfail(r, "integer division or modulo by zero");
            if (x == INT64_MIN && y == -1) {
                if (op == OP_MOD) return v_int(0);
                overflow(r);
            }
            if (op == OP_FDIV) {
                z = x / y;
                if (x % y != 0 && ((x < 0) != (y < 0))) z--;
            } else {
                z = x % y;
                if (z != 0 && ((z < 0) != (y < 0))) z += y;
            }
            return v_int(z);
        case OP_POW: {
            if (y < 0) {
                if (x == 0) rfail(r, "0.0 cannot be raised to a negative power");
                return v_float(pow((double)x, (double)y));
            }
            int64_t result = 1, base = x;
            while (y > 0) {
                if (y & 1)
                    if (__builtin_mul_overflow(result, base, &result)) overflow(r);
                y >>= 1;
                if (y && __builtin_mul_overflow(base, base, &base)) overflow(r);
            }
            return v_int(result);
        }
        }
    }
    double x = as_float(a), y = as_float(b);
    switch (op) {
    case OP_ADD: return v_float(x + y);
    case OP_SUB: return v_float(x - y);
    case OP_MUL: return v_float(x * y);
    case OP_DIV:
        if (y == 0) rfail(r, "float division by zero");
        return v_float(x / y);
    case OP_FDIV:
    case OP_MOD: {
        if (y == 0) rfail(r, op == OP_MOD ? "float modulo" : "float floor division by zero");
        /* CPython's float divmod */
        double mod = fmod(x, y), div = (x - mod) / y, fdiv;
        if (mod) {
            if ((y < 0) != (mod < 0)) {
                mod += y;
                div -= 1.0;
            }
        } else {
            mod = copysign(0.0, y);
        }
        if (div) {
            fdiv = floor(div);
            if (div - fdiv > 0.5) fdiv += 1.0;
        } else {
            fdiv = copysign(0.0, x / y);
        }
        return v_float(op == OP_MOD ? mod : fdiv);
    }
    case OP_POW:
        if (x == 0 && y < 0) rfail(r, "0.0 cannot be raised to a negative power");
        if (x < 0 && y != floor(y)) rfail(r, "a negative number to a fractional power is complex");
        {
            double z = pow(x, y);
            if (isinf(z) && isfinite(x) && isfinite(y)) rfail(r, "numerical result out of range");
            return v_float(z);
        }
    }
    rfail(r, "bad operator");
}

static val repeat(rctx *r, val seq, int64_t times) {
    if (times < 0) times = 0;
    /* an empty sequence stays empty: no loop of TIMES turns ('' * 2**62 spun for ever; found
     * by fuzz_chat_template as a slow unit) */
    if (seq.t == T_STR ? seq.u.s.n == 0 : seq.u.l->n == 0) times = 0;
    if (seq.t == T_STR) {
        if (seq.u.s.n && (uint64_t)times > CHAT_TEMPLATE_MAX_OUTPUT / seq.u.s.n)
            rfail(r, "string repetition result is too long");
        sbuf b;
        sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
        for (int64_t i = 0; i < times; i++) sb_put(&b, seq.u.s.p, seq.u.s.n);
        val v = sb_val(&b);
        v.k = seq.k;
        return v;
    }
    const list *l = seq.u.l;
    if (l->n && (uint64_t)times > (CHAT_TEMPLATE_MAX_MEMORY / sizeof(val)) / l->n) rfail(r, "list repetition result is too long");
    list *out = list_new(r, l->n * (size_t)times);
    for (int64_t i = 0; i < times; i++)
        if (l->n) memcpy(out->v + (size_t)i * l->n, l->v, l->n * sizeof *l->v);
    return v_list(out, seq.k);
}

static val percent_format(rctx *r, val fmt, val args);

static val arith(rctx *r, int op, val a, val b) {
    if (a.t == T_UNDEF) undef_fail(r, a);
    if (b.t == T_UNDEF) undef_fail(r, b);
    if (is_num(a) && is_num(b)) return num_op(r, op, a, b);
    switch (op) {
    case OP_ADD:
        if (a.t == T_STR && b.t == T_STR) {
            bool markup = a.k || b.k;
            if (markup) {
                a = html_escape(r, a); /* a Markup stays as it is */
                b = html_escape(r, b);
            }
            sbuf s;
            sb_init(&s, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
            sb_reserve(&s, a.u.s.n + b.u.s.n);
            sb_put(&s, a.u.s.p, a.u.s.n);
            sb_put(&s, b.u.s.p, b.u.s.n);
            val v = sb_val(&s);
            v.k = markup;
            return v;
        }
        if (a.t == T_LIST && b.t == T_LIST && a.k == b.k && (a.k == LK_LIST || a.k == LK_TUPLE)) {
            list *l = list_new(r, a.u.l->n + b.u.l->n);
            if (a.u.l->n) memcpy(l->v, a.u.l->v, a.u.l->n * sizeof(val));
            if (b.u.l->n) memcpy(l->v + a.u.l->n, b.u.l->v, b.u.l->n * sizeof(val));
            return v_list(l, a.k);
        }
        break;
    case OP_MUL: {
        val seq = a, times = b;
        if (is_intlike(a)) {
            seq = b;
            times = a;
        }
        if (is_intlike(times) && (seq.t == T_STR || (seq.t == T_LIST && (seq.k == LK_LIST || seq.k == LK_TUPLE))))
            return repeat(r, seq, as_int(times));
        break;
    }
    case OP_MOD:
        if (a.t == T_STR) return percent_format(r, a, b);
        break;
    default: break;
    }
    rfail(r, "unsupported operand type(s) for %s: '%s' and '%s'", op_text[op], type_name(a), type_name(b));
}

/* Pads text to width code points the way str.ljust/rjust/center do. */
static void put_padded(sbuf *b, val s, int64_t width, char align, const char *fill, size_t filln) {
    int64_t len = (int64_t)cs_utf8_count(s.u.s.p, s.u.s.n), pad = width > len ? width - len : 0, left = 0;
    if (align == '>') left = pad;
    else if (align == '^') left = pad / 2 + (pad & width & 1); /* CPython's str.center */
    for (int64_t i = 0; i < left; i++) sb_put(b, fill, filln);
    sb_put(b, s.u.s.p, s.u.s.n);
    for (int64_t i = left; i < pad; i++) sb_put(b, fill, filln);
}

/* Python's printf-style "fmt % args" for the common conversions (s r d i f e g x o c %). */
static val percent_format(rctx *r, val fmt, val args) {
    const val *items = &args;
    size_t n = 1, used = 0;
    const dict *map = NULL;
    if (args.t == T_LIST && args.k == LK_TUPLE) {
        items = args.u.l->v;
        n = args.u.l->n;
    } else if (args.t == T_DICT) {
        map = args.u.d;
    }
    sbuf b;
    sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    const char *p = fmt.u.s.p, *end = p + fmt.u.s.n;
    while (p < end) {
        if (*p != '%') {
            const char *q = memchr(p, '%', (size_t)(end - p));
            if (!q) q = end;
            sb_put(&b, p, (size_t)(q - p));
            p = q;
            continue;
        }
        p++;
        if (p >= end) rfail(r, "incomplete format");
        val arg = v_missing();
        if (*p == '(') {
            const char *q = memchr(p, ')', (size_t)(end - p));
            if (!q) rfail(r, "incomplete format key");
            if (!map) rfail(r, "format requires a mapping");
            long i = dict_find(r, map, v_str(p + 1, (size_t)(q - p - 1)));
            if (i < 0) rfail(r, "format key '%.*s' not found", (int)(q - p - 1), p + 1);
            arg = map->v[i];
            p = q + 1;
        }
        char flags[8];
        int nf = 0;
        while (p < end && strchr("-+ #0", *p) && nf < 7) flags[nf++] = *p++;
        flags[nf] = 0;
        int width = -1, prec = -1;
        if (p < end && *p == '*') rfail(r, "'*' widths in format strings are not supported");
        if (p < end && *p >= '0' && *p <= '9') {
            width = 0;
            while (p < end && *p >= '0' && *p <= '9') {
                width = width * 10 + (*p++ - '0');
                if (width > (int)CHAT_TEMPLATE_MAX_OUTPUT) rfail(r, "format width is too large");
            }
        }
        if (p < end && *p == '.') {
            p++;
            prec = 0;
            while (p < end && *p >= '0' && *p <= '9') {
                prec = prec * 10 + (*p++ - '0');
                if (prec > (int)CHAT_TEMPLATE_MAX_OUTPUT) rfail(r, "format precision is too large");
            }
        }
        while (p < end && (*p == 'h' || *p == 'l' || *p == 'L')) p++;
        if (p >= end) rfail(r, "incomplete format");
        char conv = *p++;
        if (conv == '%') {
            sb_putc(&b, '%');
            continue;
        }
        if (arg.t == T_MISSING) {
            if (used >= n) rfail(r, "not enough arguments for format string");
            arg = items[used++];
        }
        char spec[32];
        switch (conv) {
        case 's':
        case 'r':
        case 'a': {
            sbuf t;
            sb_init(&t, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
            if (conv == 's') put_str(r, &t, fmt.k ? html_escape(r, arg) : arg);
            else put_repr(r, &t, arg);
            val s = sb_val(&t);
            if (prec >= 0) s.u.s.n = utf8_off(s.u.s.p, s.u.s.n, (size_t)prec);
            put_padded(&b, s, width, strchr(flags, '-') ? '<' : '>', " ", 1);
            break;
        }
        case 'd': case 'i': case 'u': case 'x': case 'X': case 'o': case 'c': {
            int64_t x;
            if (is_intlike(arg)) x = as_int(arg);
            else if (arg.t == T_FLOAT && conv != 'c' && conv != 'x' && conv != 'X' && conv != 'o') {
                if (!isfinite(arg.u.f) || fabs(arg.u.f) >= 9.2e18) rfail(r, "cannot convert float to integer");
                x = (int64_t)arg.u.f;
            } else {
                rfail(r, "%%%c format: a number is required, not %s", conv, type_name(arg));
            }
            if (conv == 'c') {
                sb_putcp(&b, (int32_t)x);
                break;
            }
            char c = conv == 'i' || conv == 'u' ? 'd' : conv;
            if (c == 'd') snprintf(spec, sizeof spec, "%%%s%s%s%s", flags, width >= 0 ? "*" : "", prec >= 0 ? ".*" : "", "lld");
            else snprintf(spec, sizeof spec, "%%%s%s%sll%c", flags, width >= 0 ? "*" : "", prec >= 0 ? ".*" : "", c);
            bool neg = x < 0 && c != 'd';
            unsigned long long ux = neg ? (unsigned long long)(-(x + 1)) + 1 : (unsigned long long)x;
            if (neg) sb_putc(&b, '-'); /* Python prints -0x.., C would print two's complement */
            if (c == 'd') {
                if (width >= 0 && prec >= 0) sb_printf(&b, spec, width, prec, (long long)x);
                else if (width >= 0) sb_printf(&b, spec, width, (long long)x);
                else if (prec >= 0) sb_printf(&b, spec, prec, (long long)x);
                else sb_printf(&b, spec, (long long)x);
            } else {
                if (width >= 0 && prec >= 0) sb_printf(&b, spec, width, prec, ux);
                else if (width >= 0) sb_printf(&b, spec, width, ux);
                else if (prec >= 0) sb_printf(&b, spec, prec, ux);
                else sb_printf(&b, spec, ux);
            }
            break;
        }
        case 'f': case 'F': case 'e': case 'E': case 'g': case 'G': {
            if (!is_num(arg)) rfail(r, "must be real number, not %s", type_name(arg));
            double x = as_float(arg);
            snprintf(spec, sizeof spec, "%%%s%s.*%c", flags, width >= 0 ? "*" : "", conv);
            if (prec < 0) prec = 6;
            if (width >= 0) sb_printf(&b, spec, width, prec, x);
            else sb_printf(&b, spec, prec, x);
            break;
        }
        default: rfail(r, "unsupported format character '%c'", conv);
        }
    }
    /* a tuple must be used up; a single value too unless it is a mapping (Python treats lists
     * and dicts as mappings here) */
    bool tuple = args.t == T_LIST && args.k == LK_TUPLE, mapping = !tuple && (args.t == T_DICT || args.t == T_LIST);
    if ((tuple && used < n) || (!tuple && !mapping && used == 0))
        rfail(r, "not all arguments converted during string formatting");
    val out = sb_val(&b);
    out.k = fmt.k;
    return out;
}

/* ---------------------------------------------------------------------- str methods ---- */

static val out_str(sbuf *b, bool markup) {
    val v = sb_val(b);
    v.k = markup;
    return v;
}

static bool in_chars(val chars, int32_t c) {
    if (chars.t != T_STR) return is_space_cp(c);
    for (size_t i = 0; i < chars.u.s.n;) {
        int32_t d;
        i += utf8_dec(chars.u.s.p + i, chars.u.s.n - i, &d);
        if (d == c) return true;
    }
    return false;
}

/* mode: 1 strips the left, 2 the right, 3 both */
static val str_strip(rctx *r, val s, val chars, int mode) {
    if (chars.t != T_STR && chars.t != T_NONE && chars.t != T_MISSING)
        rfail(r, "strip arg must be None or str, not %s", type_name(chars));
    const char *p = s.u.s.p;
    size_t a = 0, e = s.u.s.n;
    if (mode & 1)
        while (a < e) {
            int32_t c;
            size_t k = utf8_dec(p + a, e - a, &c);
            if (!in_chars(chars, c)) break;
            a += k;
        }
    if (mode & 2)
        while (e > a) {
            size_t k = e - 1;
            while (k > a && ((unsigned char)p[k] & 0xC0) == 0x80) k--;
            int32_t c;
            utf8_dec(p + k, e - k, &c);
            if (!in_chars(chars, c)) break;
            e = k;
        }
    val v = v_str(p + a, e - a);
    v.k = s.k;
    return v;
}

static size_t next_ws(const char *p, size_t n, size_t i, bool want_ws) {
    while (i < n) {
        int32_t c;
        size_t k = utf8_dec(p + i, n - i, &c);
        if (is_space_cp(c) == want_ws) return i;
        i += k;
    }
    return n;
}

static size_t prev_cp(const char *p, size_t i) {
    size_t k = i - 1;
    while (k > 0 && ((unsigned char)p[k] & 0xC0) == 0x80) k--;
    return k;
}

static void push_val(rctx *r, val **items, size_t *n, size_t *cap, val v) {
    if (*n == *cap) {
        size_t c = *cap ? *cap * 2 : 8;
        val *x = arena_alloc(&r->a, c * sizeof *x);
        if (*n) memcpy(x, *items, *n * sizeof *x);
        *items = x;
        *cap = c;
    }
    (*items)[(*n)++] = v;
}

static val make_list(rctx *r, val *items, size_t n, int kind) {
    list *l = arena_zalloc(&r->a, sizeof *l);
    l->n = n;
    l->v = items;
    return v_list(l, kind);
}

/* Appends s[a:e] (byte offsets) to a split's pieces; a piece of a Markup is a Markup. */
static void push_piece(rctx *r, val **items, size_t *n, size_t *cap, val s, size_t a, size_t e) {
    val piece = v_str(s.u.s.p + a, e - a);
    piece.k = s.k;
    push_val(r, items, n, cap, piece);
}

static val str_split(rctx *r, val s, val sep, val vmax, bool right) {
    const char *p = s.u.s.p;
    size_t n = s.u.s.n, count = 0, cap = 0;
    val *items = NULL;
    int64_t maxsplit = vmax.t == T_MISSING || vmax.t == T_NONE ? -1 : as_int(vmax);
    if (vmax.t != T_MISSING && vmax.t != T_NONE && !is_intlike(vmax)) rfail(r, "maxsplit must be an integer");
    if (maxsplit < 0) maxsplit = INT64_MAX;
    if (sep.t == T_MISSING || sep.t == T_NONE) {
        if (!right) {
            size_t i = next_ws(p, n, 0, false);
            while (i < n) {
                if (maxsplit-- == 0) {
                    push_piece(r, &items, &count, &cap, s, i, n); /* the remainder keeps its trailing whitespace */
                    break;
                }
                size_t e = next_ws(p, n, i, true);
                push_piece(r, &items, &count, &cap, s, i, e);
                i = next_ws(p, n, e, false);
            }
        } else {
            size_t e = n;
            for (;;) {
                while (e > 0) {
                    size_t k = prev_cp(p, e);
                    int32_t c;
                    utf8_dec(p + k, n - k, &c);
                    if (!is_space_cp(c)) break;
                    e = k;
                }
                if (e == 0) break;
                if (maxsplit-- == 0) {
                    push_piece(r, &items, &count, &cap, s, 0, e);
                    break;
                }
                size_t a = e;
                while (a > 0) {
                    size_t k = prev_cp(p, a);
                    int32_t c;
                    utf8_dec(p + k, n - k, &c);
                    if (is_space_cp(c)) break;
                    a = k;
                }
                push_piece(r, &items, &count, &cap, s, a, e);
                e = a;
            }
            for (size_t i = 0; i < count / 2; i++) {
                val t = items[i];
                items[i] = items[count - 1 - i];
                items[count - 1 - i] = t;
            }
        }
    } else {
        if (sep.t != T_STR) rfail(r, "must be str or None, not %s", type_name(sep));
        const char *q = sep.u.s.p;
        size_t m = sep.u.s.n;
        if (m == 0) rfail(r, "empty separator");
        if (!right) {
            size_t a = 0, i = 0;
            while (i + m <= n && maxsplit > 0) {
                if (!memcmp(p + i, q, m)) {
                    push_piece(r, &items, &count, &cap, s, a, i);
                    i += m;
                    a = i;
                    maxsplit--;
                } else {
                    i++;
                }
            }
            push_piece(r, &items, &count, &cap, s, a, n);
        } else {
            size_t e = n, i = n;
            while (i >= m && maxsplit > 0) {
                if (!memcmp(p + i - m, q, m)) {
                    push_piece(r, &items, &count, &cap, s, i, e);
                    i -= m;
                    e = i;
                    maxsplit--;
                } else {
                    i--;
                }
            }
            push_piece(r, &items, &count, &cap, s, 0, e);
            for (size_t k = 0; k < count / 2; k++) {
                val t = items[k];
                items[k] = items[count - 1 - k];
                items[count - 1 - k] = t;
            }
        }
    }
    return make_list(r, items, count, LK_LIST);
}

static val str_splitlines(rctx *r, val s, bool keepends) {
    const char *p = s.u.s.p;
    size_t n = s.u.s.n, count = 0, cap = 0, a = 0, i = 0;
    val *items = NULL;
    while (i < n) {
        int32_t c;
        size_t k = utf8_dec(p + i, n - i, &c);
        if (!is_linebreak_cp(c)) {
            i += k;
            continue;
        }
        size_t e = i + k;
        if (c == '\r' && e < n && p[e] == '\n') e++;
        val piece = v_str(p + a, (keepends ? e : i) - a);
        piece.k = s.k;
        push_val(r, &items, &count, &cap, piece);
        a = i = e;
    }
    if (a < n) {
        val piece = v_str(p + a, n - a);
        piece.k = s.k;
        push_val(r, &items, &count, &cap, piece);
    }
    return make_list(r, items, count, LK_LIST);
}

/* upper, lower, capitalize and Python's str.title() */
static val str_case(rctx *r, val s, int mode) {
    const char *p = s.u.s.p;
    size_t n = s.u.s.n;
    sbuf b;
    sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    sb_reserve(&b, n);
    bool prev_cased = false, first = true;
    for (size_t i = 0; i < n;) {
        int32_t c;
        size_t k = utf8_dec(p + i, n - i, &c);
        switch (mode) {
        case M_UPPER: put_case(&b, c, CASE_UPPER); break;
        case M_LOWER: put_lower_at(&b, p, n, i, c); break;
        case M_CAPITALIZE:
            if (first) put_case(&b, c, CASE_TITLE);
            else put_lower_at(&b, p, n, i, c);
            break;
        default: /* M_TITLE */
            if (prev_cased) put_lower_at(&b, p, n, i, c);
            else put_case(&b, c, CASE_TITLE);
            prev_cased = is_cased_cp(c);
        }
        first = false;
        i += k;
    }
    return out_str(&b, s.k);
}

/* jinja2's title filter: upper-cases the first letter of every word ([-\s({\[<]+ split) */
static val jinja_title(rctx *r, val s) {
    const char *p = s.u.s.p;
    size_t n = s.u.s.n;
    sbuf b;
    sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    bool word_start = true;
    for (size_t i = 0; i < n;) {
        int32_t c;
        size_t k = utf8_dec(p + i, n - i, &c);
        bool sep = c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || is_space_cp(c);
        if (sep) {
            sb_put(&b, p + i, k);
            word_start = true;
        } else if (word_start) {
            put_case(&b, c, CASE_UPPER);
            word_start = false;
        } else {
            put_lower_at(&b, p, n, i, c);
        }
        i += k;
    }
    return out_str(&b, s.k);
}

static val str_replace(rctx *r, val s, val old, val rep, int64_t count) {
    if (old.t != T_STR || rep.t != T_STR) rfail(r, "replace() arguments must be str");
    const char *p = s.u.s.p, *o = old.u.s.p;
    size_t n = s.u.s.n, m = old.u.s.n;
    if (count < 0) count = INT64_MAX;
    sbuf b;
    sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    if (m == 0) {
        size_t i = 0;
        while (count > 0) {
            sb_put(&b, rep.u.s.p, rep.u.s.n);
            count--;
            if (i >= n) break;
            int32_t c;
            size_t k = utf8_dec(p + i, n - i, &c);
            sb_put(&b, p + i, k);
            i += k;
        }
        if (i < n) sb_put(&b, p + i, n - i);
        return out_str(&b, s.k);
    }
    size_t i = 0, a = 0;
    while (i + m <= n && count > 0) {
        if (!memcmp(p + i, o, m)) {
            sb_put(&b, p + a, i - a);
            sb_put(&b, rep.u.s.p, rep.u.s.n);
            i += m;
            a = i;
            count--;
        } else {
            i++;
        }
    }
    sb_put(&b, p + a, n - a);
    return out_str(&b, s.k);
}

/* Python's index adjustment for find(sub, start, end) and friends (code points) */
static void adjust_range(val vstart, val vend, int64_t len, int64_t *start, int64_t *end) {
    *start = vstart.t == T_MISSING || vstart.t == T_NONE ? 0 : as_int(vstart);
    *end = vend.t == T_MISSING || vend.t == T_NONE ? len : as_int(vend);
    if (*end > len) *end = len;
    else if (*end < 0 && (*end += len) < 0) *end = 0;
    if (*start < 0 && (*start += len) < 0) *start = 0;
}

/* find / rfind / count: returns the code point index (or the count), -1 if not found */
static int64_t str_search(rctx *r, val s, val sub, val vstart, val vend, int mode) {
    if (sub.t != T_STR) rfail(r, "must be str, not %s", type_name(sub));
    const char *p = s.u.s.p;
    size_t n = s.u.s.n, m = sub.u.s.n;
    int64_t len = (int64_t)cs_utf8_count(p, n), start, end;
    adjust_range(vstart, vend, len, &start, &end);
    if (start > len || (end - start < (int64_t)cs_utf8_count(sub.u.s.p, m) && !(m == 0 && start <= end))) {
        return mode == M_COUNT ? 0 : -1;
    }
    if (end < start) return mode == M_COUNT ? 0 : -1;
    size_t bs = utf8_off(p, n, (size_t)start), be = utf8_off(p, n, (size_t)end);
    if (mode == M_COUNT) {
        if (m == 0) return end - start + 1;
        int64_t k = 0;
        for (size_t i = bs; i + m <= be;) {
            if (!memcmp(p + i, sub.u.s.p, m)) {
                k++;
                i += m;
            } else {
                i++;
            }
        }
        return k;
    }
    if (mode == M_FIND) {
        for (size_t i = bs; i + m <= be; i++)
            if (!memcmp(p + i, sub.u.s.p, m)) return (int64_t)cs_utf8_count(p, i);
        return -1;
    }
    for (size_t i = be - m + 1; i-- > bs;)
        if (i + m <= be && !memcmp(p + i, sub.u.s.p, m)) return (int64_t)cs_utf8_count(p, i);
    return -1;
}

static bool str_affix(rctx *r, val s, val affix, val vstart, val vend, bool suffix) {
    if (affix.t == T_LIST && affix.k == LK_TUPLE) {
        for (size_t i = 0; i < affix.u.l->n; i++)
            if (str_affix(r, s, affix.u.l->v[i], vstart, vend, suffix)) return true;
        return false;
    }
    if (affix.t != T_STR)
        rfail(r, "%s first arg must be str or a tuple of str, not %s", suffix ? "endswith" : "startswith", type_name(affix));
    const char *p = s.u.s.p;
    size_t n = s.u.s.n, m = affix.u.s.n;
    int64_t len = (int64_t)cs_utf8_count(p, n), start, end;
    adjust_range(vstart, vend, len, &start, &end);
    if (start > len) return false;
    if (end < start) return false;
    size_t bs = utf8_off(p, n, (size_t)start), be = utf8_off(p, n, (size_t)end);
    if (be - bs < m) return false;
    return !memcmp(suffix ? p + be - m : p + bs, affix.u.s.p, m);
}

static bool str_pred(val s, int mode) {
    const char *p = s.u.s.p;
    size_t n = s.u.s.n;
    if (n == 0) return false;
    bool any_cased = false;
    for (size_t i = 0; i < n;) {
        int32_t c;
        i += utf8_dec(p + i, n - i, &c);
        switch (mode) {
        case M_ISDIGIT:
        case M_ISDECIMAL:
            if (!is_decimal_cp(c)) return false;
            break;
        case M_ISNUMERIC:
            if (!is_numeric_cp(c)) return false;
            break;
        case M_ISALPHA:
            if (!is_alpha_cp(c)) return false;
            break;
        case M_ISALNUM:
            if (!is_alpha_cp(c) && !is_numeric_cp(c)) return false;
            break;
        case M_ISSPACE:
            if (!is_space_cp(c)) return false;
            break;
        case M_ISLOWER:
            if (ucat(c) == UTF8PROC_CATEGORY_LU || ucat(c) == UTF8PROC_CATEGORY_LT) return false;
            if (ucat(c) == UTF8PROC_CATEGORY_LL) any_cased = true;
            break;
        case M_ISUPPER:
            if (ucat(c) == UTF8PROC_CATEGORY_LL || ucat(c) == UTF8PROC_CATEGORY_LT) return false;
            if (ucat(c) == UTF8PROC_CATEGORY_LU) any_cased = true;
            break;
        }
    }
    return mode == M_ISLOWER || mode == M_ISUPPER ? any_cased : true;
}

static val str_join(rctx *r, val sep, val iterable) {
    size_t n;
    const val *items = iterate(r, iterable, &n);
    sbuf b;
    sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    for (size_t i = 0; i < n; i++) {
        if (items[i].t != T_STR) rfail(r, "sequence item %zu: expected str instance, %s found", i, type_name(items[i]));
        if (i) sb_put(&b, sep.u.s.p, sep.u.s.n);
        val it = sep.k ? html_escape(r, items[i]) : items[i];
        sb_put(&b, it.u.s.p, it.u.s.n);
    }
    return out_str(&b, sep.k);
}

static val call_value(rctx *r, val f, const val *pos, int npos, const char **kwn, const val *kwv, int nkw);

/* format(value, spec) for the common specs: [[fill]align][sign][0][width][,|_][.precision][type] */
static void format_spec(rctx *r, sbuf *b, val v, const char *spec, size_t sn) {
    if (sn == 0) {
        put_str(r, b, v);
        return;
    }
    char fill[5] = " ", align = 0, sign = '-', type = 0, group = 0;
    size_t filln = 1, i = 0;
    bool zero = false;
    int64_t width = -1, prec = -1;
    int32_t c0;
    size_t k0 = utf8_dec(spec, sn, &c0);
    if (k0 < sn && strchr("<>^=", spec[k0])) {
        memcpy(fill, spec, k0);
        fill[k0] = 0;
        filln = k0;
        align = spec[k0];
        i = k0 + 1;
    } else if (strchr("<>^=", spec[0])) {
        align = spec[0];
        i = 1;
    }
    if (i < sn && strchr("+- ", spec[i])) sign = spec[i++];
    if (i < sn && spec[i] == '0') {
        zero = true;
        i++;
    }
    if (i < sn && spec[i] >= '0' && spec[i] <= '9') {
        width = 0;
        while (i < sn && spec[i] >= '0' && spec[i] <= '9') {
            width = width * 10 + (spec[i++] - '0');
            if (width > (int)CHAT_TEMPLATE_MAX_OUTPUT) rfail(r, "format width is too large");
        }
    }
    if (i < sn && (spec[i] == ',' || spec[i] == '_')) group = spec[i++];
    if (i < sn && spec[i] == '.') {
        i++;
        prec = 0;
        while (i < sn && spec[i] >= '0' && spec[i] <= '9') {
            prec = prec * 10 + (spec[i++] - '0');
            if (prec > (int)CHAT_TEMPLATE_MAX_OUTPUT) rfail(r, "format precision is too large");
        }
    }
    if (i < sn) type = spec[i++];
    if (i != sn || group) rfail(r, "format spec '%.*s' is not supported", (int)sn, spec);
    sbuf t;
    sb_init(&t, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    bool numeric = is_num(v) && type != 's';
    if (!numeric) {
        if (type && type != 's') rfail(r, "format spec '%.*s' is not supported for %s", (int)sn, spec, type_name(v));
        val s = str_of(r, v);
        if (prec >= 0) s.u.s.n = utf8_off(s.u.s.p, s.u.s.n, (size_t)prec);
        put_padded(b, s, width, align ? align : '<', fill, filln);
        return;
    }
    char cfmt[16];
    if (!type && is_intlike(v)) type = 'd';
    if (!type) rfail(r, "format spec '%.*s' is not supported for floats without a type", (int)sn, spec);
    if (type == 'd' || type == 'x' || type == 'X' || type == 'o' || type == 'b') {
        if (!is_intlike(v)) rfail(r, "unknown format code '%c' for object of type 'float'", type);
        int64_t x = as_int(v);
        if (type == 'd') sb_printf(&t, "%" PRId64, x < 0 ? -x : x);
        else if (type == 'b') {
            uint64_t ux = x < 0 ? (uint64_t)(-(x + 1)) + 1 : (uint64_t)x;
            char bits[65];
            int nb = 0;
            do bits[nb++] = (char)('0' + (ux & 1)); while (ux >>= 1);
            while (nb) sb_putc(&t, bits[--nb]);
        } else {
            snprintf(cfmt, sizeof cfmt, "%%ll%c", type);
            sb_printf(&t, cfmt, x < 0 ? (unsigned long long)(-(x + 1)) + 1 : (unsigned long long)x);
        }
        if (x < 0) sign = '!';
    } else if (strchr("fFeEgG%", type)) {
        double x = as_float(v);
        if (type == '%') x *= 100;
        snprintf(cfmt, sizeof cfmt, "%%.*%c", type == '%' ? 'f' : type);
        sb_printf(&t, cfmt, (int)(prec < 0 ? 6 : prec), fabs(x));
        if (type == '%') sb_putc(&t, '%');
        if (signbit(x)) sign = '!';
    } else {
        rfail(r, "format spec '%.*s' is not supported", (int)sn, spec);
    }
    const char *sgn = sign == '!' ? "-" : sign == '+' ? "+" : sign == ' ' ? " " : "";
    val digits = sb_val(&t);
    if (zero && !align) {
        align = '=';
        fill[0] = '0';
        fill[1] = 0;
        filln = 1;
    }
    if (align == '=') {
        sb_puts(b, sgn);
        int64_t w = width - (int64_t)strlen(sgn);
        put_padded(b, digits, w, '>', fill, filln);
        return;
    }
    sbuf u;
    sb_init(&u, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    sb_puts(&u, sgn);
    sb_put(&u, digits.u.s.p, digits.u.s.n);
    put_padded(b, sb_val(&u), width, align ? align : '>', fill, filln);
}

/* str.format() with jinja2's sandboxed field lookup */
static val str_format(rctx *r, val s, const val *pos, int npos, const char **kwn, const val *kwv, int nkw) {
    const char *p = s.u.s.p, *end = p + s.u.s.n;
    sbuf b;
    sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    int auto_idx = 0;
    while (p < end) {
        if (*p == '{' && p + 1 < end && p[1] == '{') {
            sb_putc(&b, '{');
            p += 2;
            continue;
        }
        if (*p == '}') {
            if (p + 1 < end && p[1] == '}') {
                sb_putc(&b, '}');
                p += 2;
                continue;
            }
            rfail(r, "single '}' encountered in format string");
        }
        if (*p != '{') {
            sb_putc(&b, *p++);
            continue;
        }
        const char *q = ++p;
        int depth = 0;
        while (q < end && (*q != '}' || depth)) {
            if (*q == '{') depth++;
            if (*q == '}') depth--;
            if (*q == '[') {
                while (q < end && *q != ']') q++;
            }
            q++;
        }
        if (q >= end) rfail(r, "expected '}' before end of string");
        /* field: name(.attr|[key])* [!conv] [:spec] */
        const char *f = p, *fe = p;
        while (fe < q && *fe != '.' && *fe != '[' && *fe != '!' && *fe != ':') fe++;
        val obj;
        if (fe == f) {
            if (auto_idx >= npos) rfail(r, "Replacement index %d out of range for positional args tuple", auto_idx);
            obj = pos[auto_idx++];
        } else if (*f >= '0' && *f <= '9') {
            int idx = atoi(f);
            if (idx >= npos) rfail(r, "Replacement index %d out of range for positional args tuple", idx);
            obj = pos[idx];
        } else {
            int i = 0;
            while (i < nkw && (strlen(kwn[i]) != (size_t)(fe - f) || memcmp(kwn[i], f, (size_t)(fe - f)))) i++;
            if (i == nkw) rfail(r, "format field '%.*s' was not given", (int)(fe - f), f);
            obj = kwv[i];
        }
        p = fe;
        while (p < q && (*p == '.' || *p == '[')) {
            if (*p == '.') {
                const char *a = ++p;
                while (p < q && *p != '.' && *p != '[' && *p != '!' && *p != ':') p++;
                const char *name = arena_strndup(&r->a, a, (size_t)(p - a));
                obj = get_attr(r, obj, name, lookup_attr(name));
            } else {
                const char *a = ++p;
                while (p < q && *p != ']') p++;
                bool digits = p > a;
                for (const char *c = a; c < p; c++) digits = digits && *c >= '0' && *c <= '9';
                val key = digits ? v_int(atoll(a)) : mk_str(r, a, (size_t)(p - a));
                obj = get_item(r, obj, key);
                p++;
            }
        }
        char conv = 0;
        if (p < q && *p == '!') {
            conv = p[1];
            p += 2;
        }
        const char *spec = p < q && *p == ':' ? p + 1 : q;
        if (memchr(spec, '{', (size_t)(q - spec))) rfail(r, "nested format specs are not supported");
        if (conv == 'r' || conv == 'a') {
            sbuf t;
            sb_init(&t, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
            put_repr(r, &t, obj);
            obj = sb_val(&t);
        } else if (conv == 's') {
            obj = str_of(r, obj);
        } else if (conv) {
            rfail(r, "unknown conversion specifier %c", conv);
        }
        if (s.k) obj = html_escape(r, obj);
        format_spec(r, &b, obj, spec, (size_t)(q - spec));
        p = q + 1;
    }
    return out_str(&b, s.k);
}

/* ------------------------------------------------------------------------- calls ---- */

typedef struct args {
    const val *pos;
    int npos;
    const char **kwn;
    const val *kwv;
    int nkw;
} args;

/* Binds a call's arguments to the named parameters; unset ones are T_MISSING. */
static void bind_args(rctx *r, const char *what, const args *a, const char *const *params, int np, val *out) {
    for (int i = 0; i < np; i++) out[i] = v_missing();
    if (a->npos > np)
        rfail(r, "%s takes at most %d argument%s (%d given)", what, np, np == 1 ? "" : "s", a->npos);
    for (int i = 0; i < a->npos; i++) out[i] = a->pos[i];
    for (int k = 0; k < a->nkw; k++) {
        int i = 0;
        while (i < np && strcmp(params[i], a->kwn[k])) i++;
        if (i == np) rfail(r, "%s got an unexpected keyword argument '%s'", what, a->kwn[k]);
        if (out[i].t != T_MISSING) rfail(r, "%s got multiple values for argument '%s'", what, a->kwn[k]);
        out[i] = a->kwv[k];
    }
}

static val required(rctx *r, val v, const char *what, const char *param) {
    if (v.t == T_MISSING) rfail(r, "%s is missing the required argument '%s'", what, param);
    return v;
}

static val opt(val v, val dflt) { return v.t == T_MISSING ? dflt : v; }

static int64_t int_arg(rctx *r, val v, const char *what) {
    if (!is_intlike(v)) rfail(r, "%s: '%s' object cannot be interpreted as an integer", what, type_name(v));
    return as_int(v);
}

static void dict_set(rctx *r, dict *d, val k, val v) {
    long i = dict_find(r, d, k);
    if (i >= 0) {
        d->v[i] = v;
        return;
    }
    if (d->n == d->cap) {
        size_t cap = d->cap ? d->cap * 2 : 4;
        val *nk = arena_alloc(&r->a, cap * sizeof *nk), *nv = arena_alloc(&r->a, cap * sizeof *nv);
        if (d->n) {
            memcpy(nk, d->k, d->n * sizeof *nk);
            memcpy(nv, d->v, d->n * sizeof *nv);
        }
        d->k = nk;
        d->v = nv;
        d->cap = cap;
    }
    d->k[d->n] = k;
    d->v[d->n++] = v;
}

static val lower_if_str(rctx *r, val v) { return v.t == T_STR ? str_case(r, v, M_LOWER) : v; }

/* jinja2's make_attrgetter: "a.b.0" looks up item by item (digits as integers) */
typedef struct getter {
    val *parts;
    int nparts;
    val dflt;
    bool lower;
} getter;

static getter make_getter(rctx *r, val attribute, bool lower, val dflt) {
    getter g = {.dflt = dflt, .lower = lower};
    if (attribute.t == T_MISSING || attribute.t == T_NONE) return g;
    if (attribute.t != T_STR) {
        g.parts = arena_alloc(&r->a, sizeof *g.parts);
        g.parts[0] = attribute;
        g.nparts = 1;
        return g;
    }
    const char *p = attribute.u.s.p;
    size_t n = attribute.u.s.n, count = 1;
    for (size_t i = 0; i < n; i++) count += p[i] == '.';
    g.parts = arena_alloc(&r->a, count * sizeof *g.parts);
    size_t a = 0;
    for (size_t i = 0; i <= n; i++) {
        if (i < n && p[i] != '.') continue;
        bool digits = i > a;
        for (size_t j = a; j < i; j++) digits = digits && p[j] >= '0' && p[j] <= '9';
        g.parts[g.nparts++] = digits ? v_int(strtoll(p + a, NULL, 10)) : v_str(p + a, i - a);
        a = i + 1;
    }
    return g;
}

static val get_path(rctx *r, const getter *g, val item) {
    for (int i = 0; i < g->nparts; i++) {
        item = get_item(r, item, g->parts[i]);
        if (g->dflt.t != T_MISSING && g->dflt.t != T_NONE && item.t == T_UNDEF) item = g->dflt;
    }
    return g->lower ? lower_if_str(r, item) : item;
}

/* Stable merge sort of items by keys (Python's sorted()). */
static void sort_by_keys(rctx *r, val *items, val *keys, size_t n, bool reverse) {
    if (n < 2) return;
    size_t *idx = arena_alloc(&r->a, n * sizeof *idx), *tmp = arena_alloc(&r->a, n * sizeof *tmp);
    for (size_t i = 0; i < n; i++) idx[i] = i;
    for (size_t width = 1; width < n; width *= 2) {
        for (size_t lo = 0; lo < n; lo += 2 * width) {
            size_t mid = lo + width < n ? lo + width : n, hi = lo + 2 * width < n ? lo + 2 * width : n;
            size_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi) {
                bool take_right = reverse ? py_less(r, keys[idx[i]], keys[idx[j]]) : py_less(r, keys[idx[j]], keys[idx[i]]);
                tmp[k++] = take_right ? idx[j++] : idx[i++];
            }
            while (i < mid) tmp[k++] = idx[i++];
            while (j < hi) tmp[k++] = idx[j++];
        }
        memcpy(idx, tmp, n * sizeof *idx);
    }
    val *sorted = arena_alloc(&r->a, n * sizeof *sorted);
    for (size_t i = 0; i < n; i++) sorted[i] = items[idx[i]];
    memcpy(items, sorted, n * sizeof *items);
}

/* Python's float(str): returns false on ValueError */
static bool parse_py_float(const char *p, size_t n, double *out) {
    size_t a = 0, e = n;
    while (a < e) {
        int32_t c;
        size_t k = utf8_dec(p + a, e - a, &c);
        if (!is_space_cp(c)) break;
        a += k;
    }
    while (e > a) {
        size_t k = prev_cp(p, e);
        int32_t c;
        utf8_dec(p + k, e - k, &c);
        if (!is_space_cp(c)) break;
        e = k;
    }
    char tmp[512];
    size_t k = 0, i = a;
    if (e - a >= sizeof tmp) return false;
    if (i < e && (p[i] == '+' || p[i] == '-')) tmp[k++] = p[i++];
    const char *words[] = {"inf", "infinity", "nan"};
    for (int w = 0; w < 3; w++)
        if (e - i == strlen(words[w]) && !strncasecmp(p + i, words[w], e - i)) {
            memcpy(tmp + k, words[w], e - i);
            tmp[k + e - i] = 0;
            *out = strtod(tmp, NULL);
            return true;
        }
    bool digits = false, prev_digit = false;
    int part = 0; /* 0 mantissa, 1 fraction, 2 exponent */
    for (; i < e; i++) {
        char c = p[i];
        if (c >= '0' && c <= '9') {
            tmp[k++] = c;
            if (part < 2) digits = true;
            prev_digit = true;
            continue;
        }
        if (c == '_' && prev_digit && i + 1 < e && p[i + 1] >= '0' && p[i + 1] <= '9') {
            prev_digit = false;
            continue;
        }
        prev_digit = false;
        if (c == '.' && part == 0) part = 1;
        else if ((c == 'e' || c == 'E') && part < 2 && digits) {
            part = 2;
            if (i + 1 < e && (p[i + 1] == '+' || p[i + 1] == '-')) tmp[k++] = c, c = p[++i];
            else {
                tmp[k++] = c;
                if (!(i + 1 < e && p[i + 1] >= '0' && p[i + 1] <= '9')) return false;
                continue;
            }
            if (!(i + 1 < e && p[i + 1] >= '0' && p[i + 1] <= '9')) return false;
        } else return false;
        tmp[k++] = c;
    }
    if (!digits) return false;
    tmp[k] = 0;
    *out = strtod(tmp, NULL);
    return true;
}

/* Python's int(str, base): 0 ok, -1 ValueError, -2 too large */
static int parse_py_int(const char *p, size_t n, int64_t base, int64_t *out) {
    size_t a = 0, e = n;
    while (a < e && is_space_cp((unsigned char)p[a])) a++;
    while (e > a && is_space_cp((unsigned char)p[e - 1])) e--;
    if (base != 0 && (base < 2 || base > 36)) return -1;
    bool neg = false;
    if (a < e && (p[a] == '+' || p[a] == '-')) neg = p[a++] == '-';
    bool prefixed = false;
    if (e - a >= 2 && p[a] == '0') {
        int c = p[a + 1] | 0x20, pb = c == 'x' ? 16 : c == 'o' ? 8 : c == 'b' ? 2 : 0;
        if (pb && (base == 0 || base == pb)) {
            base = pb;
            a += 2;
            prefixed = true;
        }
    }
    if (base == 0) {
        base = 10;
        /* base 0 refuses leading zeros in a non-zero decimal */
        bool zeros = a < e && p[a] == '0';
        for (size_t i = a; i < e && zeros; i++) zeros = p[i] == '0' || p[i] == '_';
        if (a < e && p[a] == '0' && !zeros) return -1;
    }
    uint64_t v = 0;
    bool any = false, prev_digit = prefixed;
    for (size_t i = a; i < e; i++) {
        int c = (unsigned char)p[i];
        if (c == '_') {
            if (!prev_digit || i + 1 >= e || p[i + 1] == '_') return -1;
            prev_digit = false;
            continue;
        }
        int d = c >= '0' && c <= '9' ? c - '0' : (c | 0x20) >= 'a' && (c | 0x20) <= 'z' ? (c | 0x20) - 'a' + 10 : 99;
        if (d >= base) return -1;
        if (v > ((uint64_t)INT64_MAX + 1 - (uint64_t)d) / (uint64_t)base) return -2;
        v = v * (uint64_t)base + (uint64_t)d;
        any = prev_digit = true;
    }
    if (!any) return -1;
    if (!neg && v > (uint64_t)INT64_MAX) return -2;
    *out = neg ? (int64_t)(0 - v) : (int64_t)v;
    return 0;
}

static val float_to_int(rctx *r, double x) {
    if (isnan(x)) rfail(r, "cannot convert float NaN to integer");
    if (isinf(x)) rfail(r, "cannot convert float infinity to integer");
    if (x >= 9223372036854775808.0 || x < -9223372036854775808.0) overflow(r);
    return v_int((int64_t)x);
}

static bool do_test(rctx *r, int tid, const char *tname, val v, const args *a);
static val do_filter(rctx *r, int fid, const char *fname, val v, const args *a);

/* The generator filters (select, map, unique, items, batch, slice ...) write what they yield
 * to *out as they go: if they fail, lazy_filter keeps the items before the failure. */

/* select, reject, selectattr, rejectattr */
static void select_reject(rctx *r, val value, const args *a, bool reject, bool attr, list **out) {
    if (!truthy(value)) return;
    getter g = {0};
    int off = 0;
    if (attr) {
        if (a->npos < 1) rfail(r, "missing parameter for attribute name");
        g = make_getter(r, a->pos[0], false, v_missing());
        off = 1;
    }
    int tid = -1;
    const char *tname = NULL;
    if (a->npos > off) {
        if (a->pos[off].t != T_STR) rfail(r, "test name must be a string");
        tname = arena_strndup(&r->a, a->pos[off].u.s.p, a->pos[off].u.s.n);
        tid = lookup_test(tname);
        if (tid < 0) rfail(r, "no test named '%s'", tname);
    }
    args targs = {a->pos + off + 1, a->npos > off ? a->npos - off - 1 : 0, a->kwn, a->kwv, a->nkw};
    size_t n;
    const val *items = iterate(r, value, &n);
    list *l = *out = list_new(r, n);
    l->n = 0;
    for (size_t i = 0; i < n; i++) {
        val x = attr ? get_path(r, &g, items[i]) : items[i];
        bool ok = tid >= 0 ? do_test(r, tid, tname, x, &targs) : truthy(x);
        if (ok != reject) l->v[l->n++] = items[i];
    }
}

static void filter_map(rctx *r, val value, const args *a, list **out) {
    if (!truthy(value)) return;
    size_t n;
    const val *items;
    if (a->npos == 0 && a->nkw > 0) {
        val attribute = v_missing(), dflt = v_none();
        for (int k = 0; k < a->nkw; k++) {
            if (!strcmp(a->kwn[k], "attribute")) attribute = a->kwv[k];
            else if (!strcmp(a->kwn[k], "default")) dflt = a->kwv[k];
            else rfail(r, "unexpected keyword argument '%s'", a->kwn[k]);
        }
        if (attribute.t == T_MISSING) rfail(r, "map requires a filter argument");
        getter g = make_getter(r, attribute, false, dflt);
        items = iterate(r, value, &n);
        list *l = *out = list_new(r, n);
        l->n = 0;
        for (size_t i = 0; i < n; i++) l->v[l->n++] = get_path(r, &g, items[i]);
        return;
    }
    if (a->npos == 0) rfail(r, "map requires a filter argument");
    if (a->pos[0].t != T_STR) rfail(r, "map's filter name must be a string");
    const char *fname = arena_strndup(&r->a, a->pos[0].u.s.p, a->pos[0].u.s.n);
    int fid = lookup_filter(fname);
    if (fid < 0) rfail(r, "no filter named '%s'", fname);
    args fargs = {a->pos + 1, a->npos - 1, a->kwn, a->kwv, a->nkw};
    items = iterate(r, value, &n);
    list *l = *out = list_new(r, n);
    l->n = 0;
    for (size_t i = 0; i < n; i++) {
        val x = do_filter(r, fid, fname, items[i], &fargs);
        l->v[l->n++] = x;
    }
}

static void gen_filter(rctx *r, int fid, const char *fname, val v, const args *a, list **out);

/* Python generators run only when consumed, so an error inside one (a bad argument, an item
 * that fails) surfaces only then. The items are computed now; a template error is kept in
 * the iterator, with the items before it, and raised when something consumes that far. */
static val lazy_filter(rctx *r, int fid, const char *fname, val v, const args *a) {
    iterobj *it = arena_zalloc(&r->a, sizeof *it);
    it->l = list_new(r, 0);
    jmp_buf saved;
    memcpy(saved, r->ec.jb, sizeof saved);
    int depth = r->depth, line = r->line;
    sbuf *out = r->out;
    if (setjmp(r->ec.jb) == 0) {
        gen_filter(r, fid, fname, v, a, &it->l);
    } else {
        if (r->ec.fatal) {
            memcpy(r->ec.jb, saved, sizeof saved);
            longjmp(r->ec.jb, 1);
        }
        it->err = arena_strndup(&r->a, r->ec.msg, strlen(r->ec.msg));
        r->depth = depth;
        r->line = line;
        r->out = out;
    }
    memcpy(r->ec.jb, saved, sizeof saved);
    return (val){.t = T_ITER, .u.it = it};
}

static val filter_indent(rctx *r, val s, val width, val first, val blank) {
    if (s.t == T_UNDEF) undef_fail(r, s);
    if (s.t != T_STR) rfail(r, "unsupported operand type(s) for +=: '%s' and 'str'", type_name(s));
    sbuf ind;
    sb_init(&ind, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    if (width.t == T_STR) sb_put(&ind, width.u.s.p, width.u.s.n);
    else
        for (int64_t i = int_arg(r, opt(width, v_int(4)), "indent"); i > 0; i--) sb_putc(&ind, ' ');
    sbuf tmp;
    sb_init(&tmp, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    sb_put(&tmp, s.u.s.p, s.u.s.n);
    sb_putc(&tmp, '\n');
    val lines = str_splitlines(r, sb_val(&tmp), false);
    sbuf b;
    sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    if (truthy(first)) sb_put(&b, ind.p, ind.n);
    const list *l = lines.u.l;
    for (size_t i = 0; i < l->n; i++) {
        if (i) {
            sb_putc(&b, '\n');
            if (truthy(blank) || l->v[i].u.s.n) sb_put(&b, ind.p, ind.n);
        }
        sb_put(&b, l->v[i].u.s.p, l->v[i].u.s.n);
    }
    return out_str(&b, s.k);
}

static val filter_round(rctx *r, val v, val vprec, val vmethod) {
    int64_t prec = int_arg(r, opt(vprec, v_int(0)), "round");
    val method = opt(vmethod, v_cstr("common"));
    bool common = method.t == T_STR && method.u.s.n == 6 && !memcmp(method.u.s.p, "common", 6);
    bool ceil_ = method.t == T_STR && method.u.s.n == 4 && !memcmp(method.u.s.p, "ceil", 4);
    bool floor_ = method.t == T_STR && method.u.s.n == 5 && !memcmp(method.u.s.p, "floor", 5);
    if (!common && !ceil_ && !floor_) rfail(r, "method must be common, ceil or floor");
    if (v.t == T_UNDEF) undef_fail(r, v);
    if (!is_num(v)) rfail(r, "type %s doesn't define __round__ method", type_name(v));
    if (common) {
        if (is_intlike(v)) {
            int64_t x = as_int(v);
            if (prec >= 0) return v_int(x);
            double m = pow(10.0, (double)-prec), q = (double)x / m, rq = nearbyint(q);
            return v_int((int64_t)(rq * m));
        }
        double x = v.u.f;
        if (!isfinite(x) || prec > 300) return v_float(x);
        if (prec >= 0) {
            char tmp[400];
            snprintf(tmp, sizeof tmp, "%.*f", (int)prec, x);
            return v_float(strtod(tmp, NULL));
        }
        double m = pow(10.0, (double)-prec);
        return v_float(nearbyint(x / m) * m);
    }
    val scale = prec >= 0 ? num_op(r, OP_POW, v_int(10), v_int(prec)) : v_float(pow(10.0, (double)prec));
    val x = num_op(r, OP_MUL, v, scale);
    val y = is_intlike(x) ? x : float_to_int(r, ceil_ ? ceil(x.u.f) : floor(x.u.f));
    return num_op(r, OP_DIV, y, scale);
}

static val filter_tojson(rctx *r, val v, const val *p) {
    json_opts o = {.ensure_ascii = truthy(opt(p[0], v_bool(false))), .sort_keys = truthy(opt(p[3], v_bool(false)))};
    val indent = opt(p[1], v_none()), seps = opt(p[2], v_none());
    if (indent.t != T_NONE) {
        if (indent.t != T_STR && !is_intlike(indent)) rfail(r, "tojson: indent must be an integer or a string");
        o.indent_set = true;
        o.indent = indent;
    }
    o.item_sep = o.indent_set ? "," : ", ";
    o.key_sep = ": ";
    if (seps.t != T_NONE) {
        if (seps.t != T_LIST || seps.u.l->n != 2 || seps.u.l->v[0].t != T_STR || seps.u.l->v[1].t != T_STR)
            rfail(r, "tojson: separators must be a pair of strings");
        o.item_sep = seps.u.l->v[0].u.s.p;
        o.item_sep_n = seps.u.l->v[0].u.s.n;
        o.key_sep = seps.u.l->v[1].u.s.p;
        o.key_sep_n = seps.u.l->v[1].u.s.n;
    } else {
        o.item_sep_n = strlen(o.item_sep);
        o.key_sep_n = strlen(o.key_sep);
    }
    sbuf b;
    sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    json_put(r, &b, v, &o, 0);
    return sb_val(&b);
}

static val min_max(rctx *r, val value, const val *p, bool max) {
    size_t n;
    const val *items = iterate(r, value, &n);
    if (n == 0) return v_undef("No aggregated item, sequence was empty.");
    getter g = make_getter(r, opt(p[1], v_none()), !truthy(opt(p[0], v_bool(false))), v_missing());
    size_t best = 0;
    val best_key = get_path(r, &g, items[0]);
    for (size_t i = 1; i < n; i++) {
        val k = get_path(r, &g, items[i]);
        if (max ? py_less(r, best_key, k) : py_less(r, k, best_key)) {
            best = i;
            best_key = k;
        }
    }
    return items[best];
}

static val filter_sort(rctx *r, val value, const val *p) {
    bool reverse = truthy(opt(p[0], v_bool(false))), lower = !truthy(opt(p[1], v_bool(false)));
    val attribute = opt(p[2], v_none());
    list *l = to_list(r, value);
    val *keys = arena_alloc(&r->a, (l->n ? l->n : 1) * sizeof *keys);
    /* make_multi_attrgetter: the key is a list, one item per comma-separated attribute */
    int nattr = 1;
    getter gs[16];
    if (attribute.t == T_STR) {
        const char *s = attribute.u.s.p;
        size_t n = attribute.u.s.n, a = 0;
        nattr = 0;
        for (size_t i = 0; i <= n; i++)
            if (i == n || s[i] == ',') {
                if (nattr == 16) rfail(r, "sort: too many attributes");
                gs[nattr++] = make_getter(r, v_str(s + a, i - a), lower, v_missing());
                a = i + 1;
            }
    } else {
        gs[0] = make_getter(r, attribute, lower, v_missing());
    }
    for (size_t i = 0; i < l->n; i++) {
        list *k = list_new(r, (size_t)nattr);
        for (int j = 0; j < nattr; j++) k->v[j] = get_path(r, &gs[j], l->v[i]);
        keys[i] = v_list(k, LK_LIST);
    }
    sort_by_keys(r, l->v, keys, l->n, reverse);
    return v_list(l, LK_LIST);
}

static val filter_truncate(rctx *r, val s, const val *p) {
    int64_t length = int_arg(r, opt(p[0], v_int(255)), "truncate");
    bool killwords = truthy(opt(p[1], v_bool(false)));
    val end = opt(p[2], v_cstr("..."));
    int64_t leeway = int_arg(r, opt(p[3], v_int(5)), "truncate");
    if (end.t != T_STR) rfail(r, "truncate: end must be a string");
    int64_t endlen = (int64_t)cs_utf8_count(end.u.s.p, end.u.s.n);
    if (length < endlen) rfail(r, "expected length >= %" PRId64 ", got %" PRId64, endlen, length);
    if (leeway < 0) rfail(r, "expected leeway >= 0, got %" PRId64, leeway);
    if (py_len(r, s) <= length + leeway) return s; /* anything with a length comes back as it is */
    if (s.t != T_STR) rfail(r, "'%s' object has no attribute 'rsplit'", type_name(s));
    val head = get_slice(r, s, v_none(), v_int(length - endlen), v_none());
    if (!killwords) head = str_split(r, head, v_cstr(" "), v_int(1), true).u.l->v[0];
    return arith(r, OP_ADD, head, end);
}

static val filter_wordcount(rctx *r, val v) {
    val s = str_of(r, v);
    int64_t words = 0;
    bool in_word = false;
    for (size_t i = 0; i < s.u.s.n;) {
        int32_t c;
        i += utf8_dec(s.u.s.p + i, s.u.s.n - i, &c);
        bool w = c == '_' || is_alpha_cp(c) || is_numeric_cp(c);
        if (w && !in_word) words++;
        in_word = w;
    }
    return v_int(words);
}

static val reversed_iter(rctx *r, const val *items, size_t n) {
    list *l = list_new(r, n);
    for (size_t i = 0; i < n; i++) l->v[i] = items[n - 1 - i];
    return v_iter(r, l);
}

static const char *const P_NONE[] = {NULL};

static val do_filter(rctx *r, int fid, const char *fname, val v, const args *a) {
    val p[6];
    char what[64];
    snprintf(what, sizeof what, "filter '%s'", fname);
#define BIND(...)                                                                  \
    do {                                                                           \
        static const char *const names_[] = {__VA_ARGS__};                         \
        bind_args(r, what, a, names_, (int)(sizeof names_ / sizeof names_[0]), p); \
    } while (0)
#define NOARGS() bind_args(r, what, a, P_NONE, 0, p)
    switch (fid) {
    case F_ABS:
        NOARGS();
        if (v.t == T_UNDEF) undef_fail(r, v);
        if (v.t == T_FLOAT) return v_float(fabs(v.u.f));
        if (!is_intlike(v)) rfail(r, "bad operand type for abs(): '%s'", type_name(v));
        if (as_int(v) == INT64_MIN) overflow(r);
        return v_int(llabs(as_int(v)));
    case F_ATTR: {
        BIND("name");
        val name = required(r, p[0], what, "name");
        if (v.t == T_UNDEF) undef_fail(r, v);
        if (name.t != T_STR) rfail(r, "attribute name must be a string");
        const char *nm = arena_strndup(&r->a, name.u.s.p, name.u.s.n);
        bool found;
        val x = attr_only(r, v, nm, lookup_attr(nm), &found);
        return found ? x : no_attr(r, v, nm);
    }
    /* generators: a call with bad arguments fails at once, the rest when consumed */
    case F_BATCH:
        BIND("linecount", "fill_with");
        required(r, p[0], what, "linecount");
        return lazy_filter(r, fid, fname, v, a);
    case F_SLICE:
        BIND("slices", "fill_with");
        required(r, p[0], what, "slices");
        return lazy_filter(r, fid, fname, v, a);
    case F_UNIQUE: BIND("case_sensitive", "attribute"); return lazy_filter(r, fid, fname, v, a);
    case F_ITEMS: NOARGS(); return lazy_filter(r, fid, fname, v, a);
    case F_MAP:
    case F_REJECT:
    case F_SELECT:
    case F_REJECTATTR:
    case F_SELECTATTR: return lazy_filter(r, fid, fname, v, a);
    case F_CAPITALIZE: NOARGS(); return str_case(r, soft_str(r, v), M_CAPITALIZE);
    case F_CENTER: {
        BIND("width");
        val s = soft_str(r, v);
        sbuf b;
        sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
        put_padded(&b, s, int_arg(r, opt(p[0], v_int(80)), what), '^', " ", 1);
        return out_str(&b, s.k);
    }
    case F_DEFAULT:
        BIND("default_value", "boolean");
        if (v.t == T_UNDEF || (truthy(opt(p[1], v_bool(false))) && !truthy(v))) return opt(p[0], v_str("", 0));
        return v;
    case F_DICTSORT: {
        BIND("case_sensitive", "by", "reverse");
        if (v.t == T_UNDEF) undef_fail(r, v);
        if (v.t != T_DICT) rfail(r, "dictsort needs a dict, not %s", type_name(v));
        val by = opt(p[1], v_cstr("key"));
        int pos;
        if (by.t == T_STR && by.u.s.n == 3 && !memcmp(by.u.s.p, "key", 3)) pos = 0;
        else if (by.t == T_STR && by.u.s.n == 5 && !memcmp(by.u.s.p, "value", 5)) pos = 1;
        else rfail(r, "You can only sort by either \"key\" or \"value\"");
        bool lower = !truthy(opt(p[0], v_bool(false)));
        const dict *d = v.u.d;
        list *l = list_new(r, d->n);
        val *keys = arena_alloc(&r->a, (d->n ? d->n : 1) * sizeof *keys);
        for (size_t i = 0; i < d->n; i++) {
            l->v[i] = v_tuple2(r, d->k[i], d->v[i]);
            keys[i] = pos ? d->v[i] : d->k[i];
            if (lower) keys[i] = lower_if_str(r, keys[i]);
        }
        sort_by_keys(r, l->v, keys, l->n, truthy(opt(p[2], v_bool(false))));
        return v_list(l, LK_LIST);
    }
    case F_ESCAPE: NOARGS(); return html_escape(r, v);
    case F_FORCEESCAPE: {
        NOARGS();
        val s = str_of(r, v);
        s.k = 0;
        return html_escape(r, s);
    }
    case F_FIRST: {
        NOARGS();
        if (v.t == T_ITER) {
            iterobj *it = v.u.it;
            if (it->pos < it->l->n) return it->l->v[it->pos++];
            if (it->err) throw_status(&r->ec, CS_EINVAL, "%s", it->err);
        } else {
            size_t n;
            const val *items = iterate(r, v, &n);
            if (n) return items[0];
        }
        return v_undef("No first item, sequence was empty.");
    }
    case F_FLOAT: {
        BIND("default");
        val dflt = opt(p[0], v_float(0.0));
        if (v.t == T_UNDEF) undef_fail(r, v);
        if (is_num(v)) return v_float(as_float(v));
        double x;
        if (v.t == T_STR && parse_py_float(v.u.s.p, v.u.s.n, &x)) return v_float(x);
        return dflt;
    }
    case F_FORMAT: {
        if (a->npos && a->nkw) rfail(r, "can't handle positional and keyword arguments at the same time");
        val s = soft_str(r, v), fargs;
        if (a->nkw) {
            dict *d = dict_new(r, (size_t)a->nkw);
            for (int k = 0; k < a->nkw; k++) dict_set(r, d, v_cstr(a->kwn[k]), a->kwv[k]);
            fargs = v_dict(d);
        } else {
            list *l = list_new(r, (size_t)a->npos);
            for (int k = 0; k < a->npos; k++) l->v[k] = a->pos[k];
            fargs = v_list(l, LK_TUPLE);
        }
        return percent_format(r, s, fargs);
    }
    case F_INDENT: BIND("width", "first", "blank"); return filter_indent(r, v, p[0], p[1], p[2]);
    case F_INT: {
        BIND("default", "base");
        val dflt = opt(p[0], v_int(0));
        int64_t base = int_arg(r, opt(p[1], v_int(10)), what), x;
        if (v.t == T_UNDEF) undef_fail(r, v);
        if (is_intlike(v)) return v_int(as_int(v));
        if (v.t == T_FLOAT) return float_to_int(r, v.u.f);
        if (v.t != T_STR) return dflt;
        int rc = parse_py_int(v.u.s.p, v.u.s.n, base, &x);
        if (rc == 0) return v_int(x);
        if (rc == -2) overflow(r);
        double f;
        if (parse_py_float(v.u.s.p, v.u.s.n, &f) && isfinite(f)) return float_to_int(r, f);
        return dflt;
    }
    case F_JOIN: {
        BIND("d", "attribute");
        val sep = str_of(r, opt(p[0], v_str("", 0)));
        getter g = make_getter(r, opt(p[1], v_none()), false, v_missing());
        size_t n;
        const val *items = iterate(r, v, &n);
        sbuf b;
        sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
        for (size_t i = 0; i < n; i++) {
            if (i) sb_put(&b, sep.u.s.p, sep.u.s.n);
            put_str(r, &b, get_path(r, &g, items[i]));
        }
        return sb_val(&b);
    }
    case F_LAST: {
        NOARGS();
        if (v.t == T_ITER) rfail(r, "'generator' object is not reversible");
        if (v.t == T_STR || v.t == T_LIST || v.t == T_DICT || v.t == T_UNDEF) {
            size_t n;
            const val *items = iterate(r, v, &n);
            if (n) return items[n - 1];
            return v_undef("No last item, sequence was empty.");
        }
        rfail(r, "'%s' object is not reversible", type_name(v));
    }
    case F_LENGTH: NOARGS(); return v_int(py_len(r, v));
    case F_LIST: NOARGS(); return v_list(to_list(r, v), LK_LIST);
    case F_LOWER: NOARGS(); return str_case(r, soft_str(r, v), M_LOWER);
    case F_UPPER: NOARGS(); return str_case(r, soft_str(r, v), M_UPPER);
    case F_MAX:
    case F_MIN: BIND("case_sensitive", "attribute"); return min_max(r, v, p, fid == F_MAX);
    case F_REPLACE: {
        BIND("old", "new", "count");
        val s = str_of(r, v), old = str_of(r, required(r, p[0], what, "old")), rep = str_of(r, required(r, p[1], what, "new"));
        val count = opt(p[2], v_none());
        s.k = 0;
        return str_replace(r, s, old, rep, count.t == T_NONE ? -1 : int_arg(r, count, what));
    }
    case F_REVERSE: {
        NOARGS();
        if (v.t == T_STR) return get_slice(r, v, v_none(), v_none(), v_int(-1));
        if (v.t == T_ITER) {
            list *l = to_list(r, v);
            list *out = list_new(r, l->n);
            for (size_t i = 0; i < l->n; i++) out->v[i] = l->v[l->n - 1 - i];
            return v_list(out, LK_LIST);
        }
        if (v.t == T_LIST || v.t == T_DICT || v.t == T_UNDEF) {
            size_t n;
            const val *items = iterate(r, v, &n);
            return reversed_iter(r, items, n);
        }
        rfail(r, "argument must be iterable");
    }
    case F_ROUND: BIND("precision", "method"); return filter_round(r, v, p[0], p[1]);
    case F_SAFE: NOARGS(); return v_markup(str_of(r, v));
    case F_SORT: BIND("reverse", "case_sensitive", "attribute"); return filter_sort(r, v, p);
    case F_STRING: NOARGS(); return soft_str(r, v);
    case F_SUM: {
        BIND("attribute", "start");
        val acc = opt(p[1], v_int(0));
        if (acc.t == T_STR) rfail(r, "sum() can't sum strings [use ''.join(seq) instead]");
        getter g = make_getter(r, opt(p[0], v_none()), false, v_missing());
        size_t n;
        const val *items = iterate(r, v, &n);
        for (size_t i = 0; i < n; i++) acc = arith(r, OP_ADD, acc, get_path(r, &g, items[i]));
        return acc;
    }
    case F_TITLE: NOARGS(); return jinja_title(r, soft_str(r, v));
    case F_TOJSON: BIND("ensure_ascii", "indent", "separators", "sort_keys"); return filter_tojson(r, v, p);
    case F_TRIM: BIND("chars"); return str_strip(r, soft_str(r, v), opt(p[0], v_none()), 3);
    case F_TRUNCATE: BIND("length", "killwords", "end", "leeway"); return filter_truncate(r, v, p);
    case F_WORDCOUNT: NOARGS(); return filter_wordcount(r, v);
    }
#undef BIND
#undef NOARGS
    rfail(r, "filter '%s' is not implemented", fname);
}

/* The generator filters, run by lazy_filter: what they yield goes to *out as it comes. */
static void gen_filter(rctx *r, int fid, const char *fname, val v, const args *a, list **out) {
    val p[2];
    char what[64];
    snprintf(what, sizeof what, "filter '%s'", fname);
#define BIND(...)                                                                  \
    do {                                                                           \
        static const char *const names_[] = {__VA_ARGS__};                         \
        bind_args(r, what, a, names_, (int)(sizeof names_ / sizeof names_[0]), p); \
    } while (0)
    switch (fid) {
    case F_MAP: filter_map(r, v, a, out); return;
    case F_REJECT: select_reject(r, v, a, true, false, out); return;
    case F_SELECT: select_reject(r, v, a, false, false, out); return;
    case F_REJECTATTR: select_reject(r, v, a, true, true, out); return;
    case F_SELECTATTR: select_reject(r, v, a, false, true, out); return;
    case F_ITEMS: {
        bind_args(r, what, a, P_NONE, 0, p);
        if (v.t == T_UNDEF) return;
        if (v.t != T_DICT) rfail(r, "Can only get item pairs from a mapping.");
        list *l = *out = list_new(r, v.u.d->n);
        for (size_t i = 0; i < l->n; i++) l->v[i] = v_tuple2(r, v.u.d->k[i], v.u.d->v[i]);
        return;
    }
    case F_BATCH: {
        BIND("linecount", "fill_with");
        int64_t count = int_arg(r, required(r, p[0], what, "linecount"), what);
        if (count < 1) rfail(r, "batch: linecount must be at least 1");
        val fill = opt(p[1], v_none());
        size_t n;
        const val *items = iterate(r, v, &n);
        size_t nb = (n + (size_t)count - 1) / (size_t)count;
        list *l = *out = list_new(r, nb);
        for (size_t i = 0; i < nb; i++) {
            size_t len = n - i * (size_t)count < (size_t)count ? n - i * (size_t)count : (size_t)count;
            size_t full = fill.t != T_NONE ? (size_t)count : len;
            list *batch = list_new(r, full);
            for (size_t j = 0; j < full; j++) batch->v[j] = j < len ? items[i * (size_t)count + j] : fill;
            l->v[i] = v_list(batch, LK_LIST);
        }
        return;
    }
    case F_SLICE: {
        BIND("slices", "fill_with");
        int64_t slices = int_arg(r, required(r, p[0], what, "slices"), what);
        if (slices < 1) rfail(r, "slice: slices must be at least 1");
        val fill = opt(p[1], v_none());
        list *seq = to_list(r, v);
        size_t length = seq->n, per = length / (size_t)slices, extra = length % (size_t)slices, offset = 0;
        list *l = *out = list_new(r, (size_t)slices);
        for (size_t k = 0; k < (size_t)slices; k++) {
            size_t start = offset + k * per;
            if (k < extra) offset++;
            size_t end = offset + (k + 1) * per;
            bool pad = fill.t != T_NONE && k >= extra;
            list *part = list_new(r, end - start + pad);
            for (size_t j = start; j < end; j++) part->v[j - start] = seq->v[j];
            if (pad) part->v[end - start] = fill;
            l->v[k] = v_list(part, LK_LIST);
        }
        return;
    }
    case F_UNIQUE: {
        BIND("case_sensitive", "attribute");
        getter g = make_getter(r, opt(p[1], v_none()), !truthy(opt(p[0], v_bool(false))), v_missing());
        size_t n;
        const val *items = iterate(r, v, &n);
        list *l = *out = list_new(r, n), *seen = list_new(r, n);
        l->n = seen->n = 0;
        for (size_t i = 0; i < n; i++) {
            val k = get_path(r, &g, items[i]);
            if (!hashable(k)) rfail(r, "unhashable type: '%s'", type_name(k));
            if (list_contains(r, seen, k)) continue;
            seen->v[seen->n++] = k;
            l->v[l->n++] = items[i];
        }
        return;
    }
    }
#undef BIND
    rfail(r, "filter '%s' is not a generator", fname);
}

static bool do_test(rctx *r, int tid, const char *tname, val v, const args *a) {
    val p[1];
    char what[64];
    snprintf(what, sizeof what, "test '%s'", tname);
    static const char *const one[] = {"other"};
    bool one_arg = tid == X_DIVISIBLEBY || tid == X_SAMEAS || tid >= X_IN;
    bind_args(r, what, a, one, one_arg ? 1 : 0, p);
    switch (tid) {
    case X_ODD: return py_eq(r, arith(r, OP_MOD, v, v_int(2)), v_int(1));
    case X_EVEN: return py_eq(r, arith(r, OP_MOD, v, v_int(2)), v_int(0));
    case X_DIVISIBLEBY: return py_eq(r, arith(r, OP_MOD, v, required(r, p[0], what, "num")), v_int(0));
    case X_DEFINED: return v.t != T_UNDEF;
    case X_UNDEFINED: return v.t == T_UNDEF;
    case X_FILTER: {
        if (v.t != T_STR) return false;
        const char *s = arena_strndup(&r->a, v.u.s.p, v.u.s.n);
        if (lookup_filter(s) >= 0) return true;
        for (size_t i = 0; i < sizeof unsupported_filters / sizeof unsupported_filters[0]; i++)
            if (!strcmp(unsupported_filters[i], s)) return true;
        return false;
    }
    case X_TEST: return v.t == T_STR && lookup_test(arena_strndup(&r->a, v.u.s.p, v.u.s.n)) >= 0;
    case X_NONE: return v.t == T_NONE;
    case X_BOOLEAN: return v.t == T_BOOL;
    case X_FALSE: return v.t == T_BOOL && !v.u.b;
    case X_TRUE: return v.t == T_BOOL && v.u.b;
    case X_INTEGER: return v.t == T_INT;
    case X_FLOAT: return v.t == T_FLOAT;
    case X_NUMBER: return is_num(v);
    case X_LOWER: return str_pred(str_of(r, v), M_ISLOWER);
    case X_UPPER: return str_pred(str_of(r, v), M_ISUPPER);
    case X_STRING: return v.t == T_STR;
    case X_MAPPING: return v.t == T_DICT;
    case X_SEQUENCE:
        return v.t == T_STR || v.t == T_DICT || v.t == T_UNDEF || (v.t == T_LIST && v.k <= LK_RANGE);
    case X_ITERABLE: return v.t == T_STR || v.t == T_LIST || v.t == T_DICT || v.t == T_UNDEF || v.t == T_ITER || v.t == T_LOOP;
    case X_CALLABLE:
        return v.t == T_MACRO || v.t == T_FUNC || v.t == T_METHOD || v.t == T_UNDEF || v.t == T_LOOP || v.t == T_JOINER;
    case X_SAMEAS: {
        val o = required(r, p[0], what, "other");
        if (v.t != o.t) return false;
        if (v.t == T_NONE || v.t == T_UNDEF) return v.t == T_NONE || v.u.msg == o.u.msg;
        if (v.t == T_BOOL) return v.u.b == o.u.b;
        if (v.t == T_INT) return v.u.i == o.u.i && v.u.i >= -5 && v.u.i <= 256; /* CPython's small ints */
        if (v.t == T_STR) return v.u.s.p == o.u.s.p && v.u.s.n == o.u.s.n;
        if (v.t == T_FLOAT) return false;
        return v.u.l == o.u.l;
    }
    case X_ESCAPED: return v.t == T_STR && v.k;
    case X_IN: return py_in(r, v, required(r, p[0], what, "seq"));
    case X_EQ: return py_eq(r, v, required(r, p[0], what, "other"));
    case X_NE: return !py_eq(r, v, required(r, p[0], what, "other"));
    case X_GT: return py_order(r, v, required(r, p[0], what, "other"), OP_GT);
    case X_GE: return py_order(r, v, required(r, p[0], what, "other"), OP_GTEQ);
    case X_LT: return py_order(r, v, required(r, p[0], what, "other"), OP_LT);
    case X_LE: return py_order(r, v, required(r, p[0], what, "other"), OP_LTEQ);
    }
    rfail(r, "test '%s' is not implemented", tname);
}

static val view(rctx *r, const dict *d, int kind) {
    list *l = list_new(r, d->n);
    for (size_t i = 0; i < d->n; i++)
        l->v[i] = kind == LK_KEYS ? d->k[i] : kind == LK_VALUES ? d->v[i] : v_tuple2(r, d->k[i], d->v[i]);
    return v_list(l, kind);
}

static val pad_method(rctx *r, val s, const val *p, char align, const char *what) {
    int64_t width = int_arg(r, required(r, p[0], what, "width"), what);
    val fill = opt(p[1], v_cstr(" "));
    if (fill.t != T_STR || cs_utf8_count(fill.u.s.p, fill.u.s.n) != 1)
        rfail(r, "The fill character must be exactly one character long");
    sbuf b;
    sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    put_padded(&b, s, width, align, fill.u.s.p, fill.u.s.n);
    return out_str(&b, s.k);
}

static val call_method(rctx *r, const struct bound *bm, const args *a) {
    val self = bm->self, p[3];
    int mid = bm->mid;
    char what[64];
    snprintf(what, sizeof what, "%s.%s()", type_name(self), method_names[mid]);
#define BIND(...)                                                                  \
    do {                                                                           \
        static const char *const names_[] = {__VA_ARGS__};                         \
        bind_args(r, what, a, names_, (int)(sizeof names_ / sizeof names_[0]), p); \
    } while (0)
#define NOARGS() bind_args(r, what, a, P_NONE, 0, p)
    switch (mid) {
    case M_STRIP: BIND("chars"); return str_strip(r, self, p[0], 3);
    case M_LSTRIP: BIND("chars"); return str_strip(r, self, p[0], 1);
    case M_RSTRIP: BIND("chars"); return str_strip(r, self, p[0], 2);
    case M_SPLIT: BIND("sep", "maxsplit"); return str_split(r, self, p[0], p[1], false);
    case M_RSPLIT: BIND("sep", "maxsplit"); return str_split(r, self, p[0], p[1], true);
    case M_SPLITLINES: BIND("keepends"); return str_splitlines(r, self, truthy(opt(p[0], v_bool(false))));
    case M_STARTSWITH:
    case M_ENDSWITH:
        BIND("prefix", "start", "end");
        return v_bool(str_affix(r, self, required(r, p[0], what, "prefix"), p[1], p[2], mid == M_ENDSWITH));
    case M_UPPER:
    case M_LOWER:
    case M_TITLE:
    case M_CAPITALIZE: NOARGS(); return str_case(r, self, mid);
    case M_REPLACE: {
        BIND("old", "new", "count");
        val old = required(r, p[0], what, "old"), rep = required(r, p[1], what, "new");
        if (self.k) { /* Markup escapes its arguments */
            old = html_escape(r, old);
            rep = html_escape(r, rep);
        }
        return str_replace(r, self, old, rep, int_arg(r, opt(p[2], v_int(-1)), what));
    }
    case M_FIND:
    case M_RFIND:
    case M_INDEX:
    case M_RINDEX:
    case M_COUNT:
        if (self.t != T_STR) {
            BIND("value", "start", "stop");
            val x = required(r, p[0], what, "value");
            const list *l = self.u.l;
            if (mid == M_COUNT) {
                int64_t k = 0;
                for (size_t i = 0; i < l->n; i++) k += py_eq(r, l->v[i], x);
                return v_int(k);
            }
            int64_t start, end;
            adjust_range(p[1], p[2], (int64_t)l->n, &start, &end);
            for (int64_t i = start; i < end; i++)
                if (py_eq(r, l->v[i], x)) return v_int(i);
            rfail(r, "%s.index(x): x not in %s", type_name(self), type_name(self));
        } else {
            BIND("sub", "start", "end");
            int mode = mid == M_RFIND || mid == M_RINDEX ? M_RFIND : mid == M_COUNT ? M_COUNT : M_FIND;
            int64_t k = str_search(r, self, required(r, p[0], what, "sub"), p[1], p[2], mode);
            if (k < 0 && (mid == M_INDEX || mid == M_RINDEX)) rfail(r, "substring not found");
            return v_int(k);
        }
    case M_JOIN: BIND("iterable"); return str_join(r, self, required(r, p[0], what, "iterable"));
    case M_FORMAT: return str_format(r, self, a->pos, a->npos, a->kwn, a->kwv, a->nkw);
    case M_CENTER: BIND("width", "fillchar"); return pad_method(r, self, p, '^', what);
    case M_LJUST: BIND("width", "fillchar"); return pad_method(r, self, p, '<', what);
    case M_RJUST: BIND("width", "fillchar"); return pad_method(r, self, p, '>', what);
    case M_ZFILL: {
        BIND("width");
        int64_t width = int_arg(r, required(r, p[0], what, "width"), what), len = py_len(r, self);
        sbuf b;
        sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
        size_t skip = self.u.s.n && (self.u.s.p[0] == '+' || self.u.s.p[0] == '-');
        sb_put(&b, self.u.s.p, skip);
        for (int64_t i = len; i < width; i++) sb_putc(&b, '0');
        sb_put(&b, self.u.s.p + skip, self.u.s.n - skip);
        return out_str(&b, self.k);
    }
    case M_PARTITION:
    case M_RPARTITION: {
        BIND("sep");
        val sep = required(r, p[0], what, "sep");
        if (sep.t != T_STR) rfail(r, "must be str, not %s", type_name(sep));
        if (!sep.u.s.n) rfail(r, "empty separator");
        int64_t at = str_search(r, self, sep, v_missing(), v_missing(), mid == M_PARTITION ? M_FIND : M_RFIND);
        list *l = list_new(r, 3);
        val empty = v_str("", 0);
        empty.k = self.k;
        if (at < 0) {
            l->v[0] = mid == M_PARTITION ? self : empty;
            l->v[1] = empty;
            l->v[2] = mid == M_PARTITION ? empty : self;
        } else {
            size_t off = utf8_off(self.u.s.p, self.u.s.n, (size_t)at);
            l->v[0] = v_str(self.u.s.p, off);
            l->v[1] = sep;
            l->v[2] = v_str(self.u.s.p + off + sep.u.s.n, self.u.s.n - off - sep.u.s.n);
            for (int i = 0; i < 3; i++) l->v[i].k = self.k;
        }
        return v_list(l, LK_TUPLE);
    }
    case M_REMOVEPREFIX:
    case M_REMOVESUFFIX: {
        BIND("affix");
        val x = required(r, p[0], what, "affix");
        if (x.t != T_STR) rfail(r, "must be str, not %s", type_name(x));
        if (x.u.s.n <= self.u.s.n) {
            if (mid == M_REMOVEPREFIX && !memcmp(self.u.s.p, x.u.s.p, x.u.s.n)) {
                self.u.s.p += x.u.s.n;
                self.u.s.n -= x.u.s.n;
            } else if (mid == M_REMOVESUFFIX && !memcmp(self.u.s.p + self.u.s.n - x.u.s.n, x.u.s.p, x.u.s.n)) {
                self.u.s.n -= x.u.s.n;
            }
        }
        return self;
    }
    case M_ISDIGIT:
    case M_ISALPHA:
    case M_ISALNUM:
    case M_ISSPACE:
    case M_ISLOWER:
    case M_ISUPPER:
    case M_ISNUMERIC:
    case M_ISDECIMAL: NOARGS(); return v_bool(str_pred(self, mid));
    case M_ITEMS: NOARGS(); return view(r, self.u.d, LK_ITEMS);
    case M_KEYS: NOARGS(); return view(r, self.u.d, LK_KEYS);
    case M_VALUES: NOARGS(); return view(r, self.u.d, LK_VALUES);
    case M_GET: {
        BIND("key", "default");
        val key = required(r, p[0], what, "key");
        if (!hashable(key)) rfail(r, "unhashable type: '%s'", type_name(key));
        long i = dict_find(r, self.u.d, key);
        return i >= 0 ? self.u.d->v[i] : opt(p[1], v_none());
    }
    case M_COPY:
        NOARGS();
        if (self.t == T_DICT) {
            dict *d = dict_new(r, self.u.d->n);
            for (size_t i = 0; i < self.u.d->n; i++) dict_set(r, d, self.u.d->k[i], self.u.d->v[i]);
            return v_dict(d);
        } else {
            list *l = list_new(r, self.u.l->n);
            if (l->n) memcpy(l->v, self.u.l->v, l->n * sizeof *l->v);
            return v_list(l, LK_LIST);
        }
    case M_CYCLE:
        if (a->nkw) rfail(r, "loop.cycle() takes no keyword arguments");
        if (!a->npos) rfail(r, "no items for cycling given");
        return a->pos[self.u.lp->i % (size_t)a->npos];
    case M_CHANGED: {
        if (a->nkw) rfail(r, "loop.changed() takes no keyword arguments");
        list *l = list_new(r, (size_t)a->npos);
        for (int i = 0; i < a->npos; i++) l->v[i] = a->pos[i];
        val now = v_list(l, LK_TUPLE);
        struct loopctx *lp = self.u.lp;
        if (lp->changed_set && py_eq(r, lp->last_changed, now)) return v_bool(false);
        lp->last_changed = now;
        lp->changed_set = true;
        return v_bool(true);
    }
    case M_NEXT: {
        NOARGS();
        struct cycler *c = self.u.cy;
        val v = c->items[c->pos];
        c->pos = (c->pos + 1) % c->n;
        return v;
    }
    case M_RESET: NOARGS(); self.u.cy->pos = 0; return v_none();
    }
#undef BIND
#undef NOARGS
    rfail(r, "method %s is not implemented", what);
}

/* dict(*args, **kwargs) as used by namespace() and dict() */
static dict *dict_from_args(rctx *r, const args *a, const char *what) {
    if (a->npos > 1) rfail(r, "%s expected at most 1 argument, got %d", what, a->npos);
    dict *d = dict_new(r, 4);
    if (a->npos == 1) {
        val src = a->pos[0];
        if (src.t == T_DICT) {
            for (size_t i = 0; i < src.u.d->n; i++) dict_set(r, d, src.u.d->k[i], src.u.d->v[i]);
        } else {
            size_t n;
            const val *items = iterate(r, src, &n);
            for (size_t i = 0; i < n; i++) {
                size_t m;
                const val *pair = iterate(r, items[i], &m);
                if (m != 2) rfail(r, "dictionary update sequence element #%zu has length %zu; 2 is required", i, m);
                if (!hashable(pair[0])) rfail(r, "unhashable type: '%s'", type_name(pair[0]));
                dict_set(r, d, pair[0], pair[1]);
            }
        }
    }
    for (int k = 0; k < a->nkw; k++) dict_set(r, d, v_cstr(a->kwn[k]), a->kwv[k]);
    return d;
}

static val strftime_now(rctx *r, val fmt) {
    if (fmt.t != T_STR) rfail(r, "strftime_now() argument must be str, not %s", type_name(fmt));
    struct timeval tv;
    gettimeofday(&tv, NULL);
    struct tm tm;
    time_t sec = tv.tv_sec;
    localtime_r(&sec, &tm);
    /* Python handles %f itself; %z and %Z are empty for a naive datetime */
    sbuf f;
    sb_init(&f, &r->a, 1 << 20, false);
    for (size_t i = 0; i < fmt.u.s.n; i++) {
        char c = fmt.u.s.p[i];
        if (c == '%' && i + 1 < fmt.u.s.n) {
            char d = fmt.u.s.p[++i];
            if (d == 'f') sb_printf(&f, "%06ld", (long)tv.tv_usec);
            else if (d == 'z' || d == 'Z') continue;
            else {
                sb_putc(&f, '%');
                sb_putc(&f, d);
            }
            continue;
        }
        sb_putc(&f, c);
    }
    if (!f.n) return v_str("", 0);
    for (size_t cap = 256; cap <= (1 << 20); cap *= 4) {
        char *out = arena_alloc(&r->a, cap);
        size_t n = strftime(out, cap, f.p, &tm);
        if (n) return v_str(out, n);
    }
    return v_str("", 0);
}

static val call_func(rctx *r, int fn, const args *a) {
    val p[3];
    switch (fn) {
    case FN_RANGE: {
        if (a->nkw) rfail(r, "range() takes no keyword arguments");
        if (a->npos < 1 || a->npos > 3) rfail(r, "range expected 1 to 3 arguments, got %d", a->npos);
        int64_t x[3] = {0, 0, 1};
        for (int i = 0; i < a->npos; i++) {
            if (a->pos[i].t == T_UNDEF) undef_fail(r, a->pos[i]);
            x[i] = int_arg(r, a->pos[i], "range()");
        }
        int64_t start = a->npos == 1 ? 0 : x[0], stop = a->npos == 1 ? x[0] : x[1], step = a->npos == 3 ? x[2] : 1;
        if (step == 0) rfail(r, "range() arg 3 must not be zero");
        /* unsigned differences: the span of two int64 values fits in a uint64 */
        uint64_t n = 0;
        if (step > 0 && stop > start) n = ((uint64_t)stop - (uint64_t)start - 1) / (uint64_t)step + 1;
        if (step < 0 && start > stop) n = ((uint64_t)start - (uint64_t)stop - 1) / (0 - (uint64_t)step) + 1;
        if (n > MAX_RANGE)
            rfail(r, "Range too big. The sandbox blocks ranges larger than MAX_RANGE (%d).", MAX_RANGE);
        list *l = list_new(r, (size_t)n);
        for (uint64_t i = 0; i < n; i++) l->v[i] = v_int((int64_t)((uint64_t)start + i * (uint64_t)step));
        l->start = start;
        l->stop = stop;
        l->step = step;
        return v_list(l, LK_RANGE);
    }
    case FN_NAMESPACE: {
        dict *d = dict_from_args(r, a, "namespace");
        for (size_t i = 0; i < d->n; i++)
            if (d->k[i].t == T_STR && d->k[i].u.s.n && d->k[i].u.s.p[0] == '_')
                rfail(r, "Chat templates cannot store underscore-prefixed attributes on a namespace, but got '%.*s'. "
                      "Please rename the attribute.", (int)d->k[i].u.s.n, d->k[i].u.s.p);
        return (val){.t = T_NS, .u.d = d};
    }
    case FN_DICT: return v_dict(dict_from_args(r, a, "dict"));
    case FN_RAISE: {
        static const char *const names[] = {"message"};
        bind_args(r, "raise_exception()", a, names, 1, p);
        val msg = str_of(r, required(r, p[0], "raise_exception()", "message"));
        throw_status(&r->ec, CS_EINVAL, "%.*s", (int)(msg.u.s.n < 1000 ? msg.u.s.n : 1000), msg.u.s.p);
    }
    case FN_STRFTIME: {
        static const char *const names[] = {"format"};
        bind_args(r, "strftime_now()", a, names, 1, p);
        return strftime_now(r, required(r, p[0], "strftime_now()", "format"));
    }
    case FN_CYCLER: {
        if (a->nkw) rfail(r, "cycler() takes no keyword arguments");
        if (!a->npos) rfail(r, "at least one item has to be provided");
        struct cycler *c = arena_zalloc(&r->a, sizeof *c);
        val *items = arena_alloc(&r->a, (size_t)a->npos * sizeof *items);
        memcpy(items, a->pos, (size_t)a->npos * sizeof *items);
        c->items = items;
        c->n = (size_t)a->npos;
        return (val){.t = T_CYCLER, .u.cy = c};
    }
    case FN_JOINER: {
        static const char *const names[] = {"sep"};
        bind_args(r, "joiner()", a, names, 1, p);
        struct joiner *j = arena_zalloc(&r->a, sizeof *j);
        j->sep = opt(p[0], v_cstr(", "));
        return (val){.t = T_JOINER, .u.jn = j};
    }
    }
    rfail(r, "unknown function");
}

static int exec_body(rctx *r, node *const *body, int n, scope *s);
static val eval(rctx *r, const node *n, scope *s);

static val capture(rctx *r, node *const *body, int n, scope *s) {
    sbuf b;
    sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    sbuf *saved = r->out;
    r->out = &b;
    exec_body(r, body, n, s);
    r->out = saved;
    return sb_val(&b);
}

static val call_macro(rctx *r, const macro *m, const args *a) {
    const node *d = m->def;
    const char *mname = m->name ? m->name : "caller";
    int np = d->nkw, line = r->line;
    enter_r(r);
    scope *s = scope_open(r, m->closure, d->uninit, d->nuninit);
    val *bound_args = arena_alloc(&r->a, (size_t)(np + 1) * sizeof *bound_args);
    for (int i = 0; i < np; i++) bound_args[i] = i < a->npos ? a->pos[i] : v_missing();
    int extra = a->npos > np ? a->npos - np : 0;
    if (extra && !(d->flags & MF_VARARGS))
        rfail(r, "macro '%s' takes not more than %d argument(s)", mname, np);
    dict *kwargs = NULL;
    val caller = v_missing();
    for (int k = 0; k < a->nkw; k++) {
        int i = 0;
        while (i < np && strcmp(d->kw[i], a->kwn[k])) i++;
        if (i < np) {
            if (bound_args[i].t != T_MISSING) rfail(r, "macro '%s' got multiple values for argument '%s'", mname, a->kwn[k]);
            bound_args[i] = a->kwv[k];
        } else if (!strcmp(a->kwn[k], "caller") && (d->flags & MF_CALLER)) {
            caller = a->kwv[k];
        } else if (d->flags & MF_KWARGS) {
            if (!kwargs) kwargs = dict_new(r, 4);
            dict_set(r, kwargs, v_cstr(a->kwn[k]), a->kwv[k]);
        } else {
            rfail(r, "macro '%s' takes no keyword argument '%s'", mname, a->kwn[k]);
        }
    }
    /* a missing parameter takes its default, evaluated inside the macro once the parameters
     * before it are bound (as jinja2 does), or is undefined */
    for (int i = 0; i < np; i++) {
        val v = bound_args[i];
        if (v.t == T_MISSING)
            v = d->w[i] ? eval(r, d->w[i], s) : v_undef(rsprintf(r, "parameter '%s' was not provided", d->kw[i]));
        scope_set(r, s, d->kw[i], v);
    }
    if (d->flags & MF_VARARGS) {
        list *l = list_new(r, (size_t)extra);
        for (int i = 0; i < extra; i++) l->v[i] = a->pos[np + i];
        scope_set(r, s, "varargs", v_list(l, LK_TUPLE));
    }
    if (d->flags & MF_KWARGS) scope_set(r, s, "kwargs", v_dict(kwargs ? kwargs : dict_new(r, 0)));
    if (d->flags & MF_CALLER) scope_set(r, s, "caller", caller.t == T_MISSING ? v_undef("No caller defined") : caller);
    val out = capture(r, d->v, d->nv, s);
    r->depth--;
    r->line = line;
    return out;
}

static val call_value(rctx *r, val f, const val *pos, int npos, const char **kwn, const val *kwv, int nkw) {
    args a = {pos, npos, kwn, kwv, nkw};
    switch (f.t) {
    case T_FUNC: return call_func(r, f.u.fn, &a);
    case T_MACRO: return call_macro(r, f.u.m, &a);
    case T_METHOD: return call_method(r, f.u.bm, &a);
    case T_JOINER:
        if (npos || nkw) rfail(r, "joiner takes no arguments");
        if (!f.u.jn->used) {
            f.u.jn->used = true;
            return v_str("", 0);
        }
        return f.u.jn->sep;
    case T_UNDEF: undef_fail(r, f);
    default: rfail(r, "'%s' object is not callable", type_name(f));
    }
}

/* ----------------------------------------------------------------- eval, exec ---- */

static void eval_args(rctx *r, const node *n, scope *s, args *a) {
    val *pos = n->nv ? arena_alloc(&r->a, (size_t)n->nv * sizeof *pos) : NULL;
    val *kwv = n->nw ? arena_alloc(&r->a, (size_t)n->nw * sizeof *kwv) : NULL;
    for (int i = 0; i < n->nv; i++) pos[i] = eval(r, n->v[i], s);
    for (int i = 0; i < n->nw; i++) kwv[i] = eval(r, n->w[i], s);
    a->pos = pos;
    a->npos = n->nv;
    a->kwn = n->kw;
    a->kwv = kwv;
    a->nkw = n->nkw;
}

/* A filter node applied to base (n->a is NULL in the filter chain of a block). */
static val eval_filter(rctx *r, const node *n, scope *s, val base) {
    val v = n->a ? (n->a->kind == E_FILTER ? eval_filter(r, n->a, s, base) : eval(r, n->a, s)) : base;
    args a;
    eval_args(r, n, s, &a);
    r->line = n->line;
    return do_filter(r, n->id, n->name, v, &a);
}

static val lookup_name(rctx *r, scope *s, const char *name) {
    val *p = scope_find(s, name);
    if (p) return *p;
    int fn = lookup_func(name);
    if (fn >= 0) return (val){.t = T_FUNC, .u.fn = fn};
    return undef_lazy(r, U_NAME, name, v_none(), 0);
}

static bool compare(rctx *r, int op, val a, val b) {
    switch (op) {
    case OP_EQ: return py_eq(r, a, b);
    case OP_NE: return !py_eq(r, a, b);
    case OP_IN: return py_in(r, a, b);
    case OP_NOTIN: return !py_in(r, a, b);
    default: return py_order(r, a, b, op);
    }
}

static val eval(rctx *r, const node *n, scope *s) {
    val out;
    r->line = n->line;
    enter_r(r);
    switch (n->kind) {
    case E_CONST: out = n->c; break;
    case E_NAME: out = lookup_name(r, s, n->name); break;
    case E_LIST:
    case E_TUPLE: {
        list *l = list_new(r, (size_t)n->nv);
        for (int i = 0; i < n->nv; i++) l->v[i] = eval(r, n->v[i], s);
        out = v_list(l, n->kind == E_LIST ? LK_LIST : LK_TUPLE);
        break;
    }
    case E_DICT: {
        dict *d = dict_new(r, (size_t)n->nv);
        for (int i = 0; i < n->nv; i++) {
            val k = eval(r, n->v[i], s);
            if (!hashable(k)) rfail(r, "unhashable type: '%s'", type_name(k));
            dict_set(r, d, k, eval(r, n->w[i], s));
        }
        out = v_dict(d);
        break;
    }
    case E_GETATTR: {
        val obj = eval(r, n->a, s);
        r->line = n->line;
        out = get_attr(r, obj, n->name, n->id);
        break;
    }
    case E_GETITEM: {
        val obj = eval(r, n->a, s), key = eval(r, n->b, s);
        r->line = n->line;
        out = get_item(r, obj, key);
        break;
    }
    case E_SLICE: {
        val obj = eval(r, n->a, s);
        val start = n->b ? eval(r, n->b, s) : v_none(), stop = n->x ? eval(r, n->x, s) : v_none();
        val step = n->y ? eval(r, n->y, s) : v_none();
        r->line = n->line;
        out = get_slice(r, obj, start, stop, step);
        break;
    }
    case E_CALL: {
        val f = eval(r, n->a, s);
        args a;
        eval_args(r, n, s, &a);
        r->line = n->line;
        out = call_value(r, f, a.pos, a.npos, a.kwn, a.kwv, a.nkw);
        break;
    }
    case E_FILTER: out = eval_filter(r, n, s, v_undef("no value")); break;
    case E_TEST: {
        val v = eval(r, n->a, s);
        args a;
        eval_args(r, n, s, &a);
        r->line = n->line;
        out = v_bool(do_test(r, n->id, n->name, v, &a));
        break;
    }
    case E_NOT: out = v_bool(!truthy(eval(r, n->a, s))); break;
    case E_NEG:
    case E_POS: {
        val v = eval(r, n->a, s);
        r->line = n->line;
        if (v.t == T_UNDEF) undef_fail(r, v);
        if (v.t == T_FLOAT) out = v_float(n->kind == E_NEG ? -v.u.f : v.u.f);
        else if (is_intlike(v)) {
            if (n->kind == E_NEG && as_int(v) == INT64_MIN) overflow(r);
            out = v_int(n->kind == E_NEG ? -as_int(v) : as_int(v));
        } else {
            rfail(r, "bad operand type for unary %c: '%s'", n->kind == E_NEG ? '-' : '+', type_name(v));
        }
        break;
    }
    case E_BIN: {
        val a = eval(r, n->a, s), b = eval(r, n->b, s);
        r->line = n->line;
        out = arith(r, n->op, a, b);
        break;
    }
    case E_AND:
        out = eval(r, n->a, s);
        if (truthy(out)) out = eval(r, n->b, s);
        break;
    case E_OR:
        out = eval(r, n->a, s);
        if (!truthy(out)) out = eval(r, n->b, s);
        break;
    case E_CONCAT: {
        sbuf b;
        sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
        for (int i = 0; i < n->nv; i++) put_str(r, &b, eval(r, n->v[i], s));
        out = sb_val(&b);
        break;
    }
    case E_CMP: {
        val left = eval(r, n->a, s);
        out = v_bool(true);
        for (int i = 0; i < n->nv; i++) {
            val right = eval(r, n->v[i], s);
            r->line = n->line;
            if (!compare(r, n->ops[i], left, right)) {
                out = v_bool(false);
                break;
            }
            left = right;
        }
        break;
    }
    case E_COND:
        if (truthy(eval(r, n->a, s))) out = eval(r, n->b, s);
        else if (n->x) out = eval(r, n->x, s);
        else out = v_undef(rsprintf(r, "the inline if-expression on line %d evaluated to false and no else section was defined.", n->line));
        break;
    default: rfail(r, "cannot evaluate this expression");
    }
    r->depth--;
    return out;
}

static void assign(rctx *r, const node *target, val v, scope *s) {
    switch (target->kind) {
    case E_NAME: scope_set(r, s, target->name, v); return;
    case E_TUPLE: {
        size_t n;
        const val *items = iterate(r, v, &n);
        if (n > (size_t)target->nv) rfail(r, "too many values to unpack (expected %d)", target->nv);
        if (n < (size_t)target->nv) rfail(r, "not enough values to unpack (expected %d, got %zu)", target->nv, n);
        for (int i = 0; i < target->nv; i++) assign(r, target->v[i], items[i], s);
        return;
    }
    case E_NSREF: {
        val ns = lookup_name(r, s, target->name2);
        if (ns.t != T_NS) rfail(r, "cannot assign attribute on non-namespace object");
        if (target->name[0] == '_')
            rfail(r, "Chat templates cannot store underscore-prefixed attributes on a namespace, but got '%s'. "
                  "Please rename the attribute.", target->name);
        dict_set(r, ns.u.d, v_cstr(target->name), v);
        return;
    }
    default: rfail(r, "cannot assign to this expression");
    }
}

static void emit(rctx *r, val v) { put_str(r, r->out, v); }

static int exec_for(rctx *r, const node *n, scope *s) {
    val seq = eval(r, n->b, s);
    r->line = n->line;
    size_t count;
    const val *items = iterate(r, seq, &count);
    scope *it = scope_new(r, s);
    if (n->x) { /* for x in xs if cond: filter first, so that loop.length counts what remains */
        val *kept = arena_alloc(&r->a, (count ? count : 1) * sizeof *kept);
        size_t k = 0;
        for (size_t i = 0; i < count; i++) {
            it->n = 0;
            assign(r, n->a, items[i], it);
            if (truthy(eval(r, n->x, it))) kept[k++] = items[i];
        }
        items = kept;
        count = k;
    }
    if (count == 0) return n->nw ? exec_body(r, n->w, n->nw, scope_open(r, s, n->uninit2, n->nuninit2)) : FLOW_NORMAL;
    struct loopctx *lp = arena_zalloc(&r->a, sizeof *lp);
    lp->items = items;
    lp->n = count;
    for (size_t i = 0; i < count; i++) {
        if (++r->iterations > CHAT_TEMPLATE_MAX_ITERATIONS)
            throw_limit(&r->ec, "line %d: template ran more than %ld loop iterations", r->line,
                        CHAT_TEMPLATE_MAX_ITERATIONS);
        lp->i = i;
        it->n = 0; /* a fresh scope for every iteration */
        bind_uninit(r, it, n->uninit, n->nuninit);
        scope_set(r, it, "loop", (val){.t = T_LOOP, .u.lp = lp});
        assign(r, n->a, items[i], it);
        int flow = exec_body(r, n->v, n->nv, it);
        if (flow == FLOW_BREAK) break;
    }
    return FLOW_NORMAL;
}

static int exec_stmt(rctx *r, const node *n, scope *s) {
    r->line = n->line;
    switch (n->kind) {
    case S_OUTPUT:
        for (int i = 0; i < n->nv; i++) {
            const node *x = n->v[i];
            if (x->kind == E_CONST && x->c.t == T_STR) sb_put(r->out, x->c.u.s.p, x->c.u.s.n);
            else emit(r, eval(r, x, s));
        }
        return FLOW_NORMAL;
    case S_IF:
        if (truthy(eval(r, n->a, s))) return exec_body(r, n->v, n->nv, s);
        return exec_body(r, n->w, n->nw, s);
    case S_FOR: return exec_for(r, n, s);
    case S_SET: assign(r, n->a, eval(r, n->b, s), s); return FLOW_NORMAL;
    case S_SETBLOCK: {
        val v = capture(r, n->v, n->nv, scope_open(r, s, n->uninit, n->nuninit));
        if (n->b) v = eval_filter(r, n->b, s, v);
        assign(r, n->a, v, s);
        return FLOW_NORMAL;
    }
    case S_MACRO: {
        macro *m = arena_zalloc(&r->a, sizeof *m);
        m->def = n;
        m->closure = s;
        m->name = n->name;
        scope_set(r, s, n->name, (val){.t = T_MACRO, .u.m = m});
        return FLOW_NORMAL;
    }
    case S_CALLBLOCK: {
        macro *m = arena_zalloc(&r->a, sizeof *m);
        m->def = n;
        m->closure = s;
        m->name = NULL;
        const node *call = n->a;
        val f = eval(r, call->a, s);
        args a;
        eval_args(r, call, s, &a);
        const char **kwn = arena_alloc(&r->a, (size_t)(a.nkw + 1) * sizeof *kwn);
        val *kwv = arena_alloc(&r->a, (size_t)(a.nkw + 1) * sizeof *kwv);
        if (a.nkw) {
            memcpy(kwn, a.kwn, (size_t)a.nkw * sizeof *kwn);
            memcpy(kwv, a.kwv, (size_t)a.nkw * sizeof *kwv);
        }
        kwn[a.nkw] = "caller";
        kwv[a.nkw] = (val){.t = T_MACRO, .u.m = m};
        r->line = n->line;
        emit(r, call_value(r, f, a.pos, a.npos, kwn, kwv, a.nkw + 1));
        return FLOW_NORMAL;
    }
    case S_FILTERBLOCK:
        emit(r, eval_filter(r, n->b, s, capture(r, n->v, n->nv, scope_open(r, s, n->uninit, n->nuninit))));
        return FLOW_NORMAL;
    case S_WITH: {
        scope *w = scope_open(r, s, n->uninit, n->nuninit);
        for (int i = 0; i < n->nkw; i++) scope_set(r, w, n->kw[i], eval(r, n->w[i], s));
        return exec_body(r, n->v, n->nv, w);
    }
    case S_SCOPE: return exec_body(r, n->v, n->nv, scope_open(r, s, n->uninit, n->nuninit));
    case S_BREAK: return FLOW_BREAK;
    case S_CONTINUE: return FLOW_CONTINUE;
    }
    rfail(r, "cannot execute this statement");
}

static int exec_body(rctx *r, node *const *body, int n, scope *s) {
    enter_r(r);
    for (int i = 0; i < n; i++) {
        int flow = exec_stmt(r, body[i], s);
        if (flow != FLOW_NORMAL) {
            r->depth--;
            return flow;
        }
    }
    r->depth--;
    return FLOW_NORMAL;
}

/* --------------------------------------------------------------------------- API ---- */

struct chat_template {
    arena a;
    node *root; /* an S_SCOPE holding the template's statements */
};

static void set_err(char *err, size_t errlen, const char *msg) {
    if (err && errlen) snprintf(err, errlen, "%s", msg);
}

typedef struct parse_state {
    errctx ec;
    lexer lx;
    parser p;
} parse_state;

int chat_template_parse(const char *src, size_t len, chat_template_t **out, char *err, size_t errlen) {
    *out = NULL;
    chat_template_t *t = calloc(1, sizeof *t);
    parse_state *ps = calloc(1, sizeof *ps);
    if (!t || !ps) {
        free(t);
        free(ps);
        set_err(err, errlen, "out of memory");
        return CS_ENOMEM;
    }
    t->a.limit = (size_t)256 << 20;
    t->a.ec = &ps->ec;
    if (setjmp(ps->ec.jb)) {
        int status = ps->ec.status;
        set_err(err, errlen, ps->ec.msg);
        arena_free(&t->a);
        free(t);
        free(ps);
        return status;
    }
    if (!src && len) throw_status(&ps->ec, CS_EINVAL, "no template source");
    /* the source must be UTF-8 (Python reads it as str); newlines become \n and one trailing
     * newline is dropped, as jinja2 does */
    for (size_t i = 0; i < len;) {
        utf8proc_int32_t c;
        utf8proc_ssize_t k = utf8proc_iterate((const utf8proc_uint8_t *)src + i, (utf8proc_ssize_t)(len - i), &c);
        if (k <= 0) throw_status(&ps->ec, CS_EINVAL, "template is not valid UTF-8 (at byte %zu)", i);
        i += (size_t)k;
    }
    char *norm = arena_alloc(&t->a, len + 1);
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            norm[n++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n') i++;
        } else {
            norm[n++] = src[i];
        }
    }
    if (n && norm[n - 1] == '\n') n--;
    norm[n] = 0;
    lexer *lx = &ps->lx;
    lx->ec = &ps->ec;
    lx->a = &t->a;
    lx->src = norm;
    lx->len = n;
    lx->line = 1;
    lex_source(lx);
    parser *p = &ps->p;
    p->ec = &ps->ec;
    p->a = &t->a;
    p->t = lx->toks;
    t->root = new_node(p, S_SCOPE, 1);
    t->root->v = subparse(p, NULL, &t->root->nv);
    check_calls(p);
    analyze_frame(p, NULL, t->root, t->root->v, t->root->nv, false);
    t->a.ec = NULL; /* the tree is complete: nothing allocates from this arena any more */
    free(ps);
    *out = t;
    return CS_OK;
}

void chat_template_free(chat_template_t *t) {
    if (!t) return;
    arena_free(&t->a);
    free(t);
}

int chat_template_render(const chat_template_t *t, const json_t *ctx, char **out, size_t *out_len, char *err,
                         size_t errlen) {
    *out = NULL;
    if (out_len) *out_len = 0;
    if (!t) {
        set_err(err, errlen, "no template");
        return CS_EINVAL;
    }
    rctx *r = calloc(1, sizeof *r);
    sbuf *result = calloc(1, sizeof *result);
    if (!r || !result) {
        free(r);
        free(result);
        set_err(err, errlen, "out of memory");
        return CS_ENOMEM;
    }
    r->a.limit = CHAT_TEMPLATE_MAX_MEMORY;
    r->a.ec = &r->ec;
    sb_init(result, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, true);
    if (setjmp(r->ec.jb)) {
        int status = r->ec.status;
        set_err(err, errlen, r->ec.msg);
        free(result->p);
        free(result);
        arena_free(&r->a);
        free(r);
        return status;
    }
    scope *vars = scope_new(r, NULL);
    if (ctx) {
        if (!json_is_object(ctx)) throw_status(&r->ec, CS_EINVAL, "the render context must be a JSON object");
        const char *key;
        json_t *value;
        json_object_foreach((json_t *)ctx, key, value)
            scope_set(r, vars, arena_strndup(&r->a, key, strlen(key)), from_json(r, value, 0));
    }
    r->out = result;
    exec_body(r, t->root->v, t->root->nv, scope_open(r, vars, t->root->uninit, t->root->nuninit));
    char *text = result->p;
    size_t n = result->n;
    if (!text) {
        text = malloc(1);
        if (!text) throw_status(&r->ec, CS_ENOMEM, "out of memory");
        text[0] = 0;
    }
    free(result);
    arena_free(&r->a);
    free(r);
    *out = text;
    if (out_len) *out_len = n;
    return CS_OK;
}

json_t *chat_template_hf_messages(const json_t *messages, bool drop_null) {
    static const char *const fields[] = {"reasoning_content", "thinking", "reasoning"};
    if (!json_is_array(messages)) return NULL;
    json_t *out = json_array();
    if (!out) return NULL;
    size_t i;
    json_t *m;
    json_array_foreach(messages, i, m) {
        if (!json_is_object(m)) {
            json_decref(out);
            return NULL;
        }
        json_t *copy = json_object();
        const char *key;
        json_t *value;
        json_t *reasoning = NULL;
        for (int f = 0; f < 3 && !reasoning; f++) {
            json_t *x = json_object_get(m, fields[f]);
            if (x && !json_is_null(x)) reasoning = x;
        }
        /* {"thinking": reasoning, **message, "reasoning_content": reasoning} */
        if (reasoning) json_object_set(copy, "thinking", reasoning);
        json_object_foreach(m, key, value) {
            if (drop_null && json_is_null(value)) continue;
            json_object_set(copy, key, value);
        }
        if (reasoning) json_object_set(copy, "reasoning_content", reasoning);
        json_array_append_new(out, copy);
    }
    return out;
}
