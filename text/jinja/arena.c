/* arena.c: the interpreter's errors and memory: errors unwind with longjmp to the parse or
 * render that set the errctx; values live in an arena freed at once (with a limit on its size),
 * and text grows in sbufs, which also enforce the limit on rendered output. */
#include "text/jinja/jinja_impl.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#define ARENA_CHUNK ((size_t)64 << 10)

/* ------------------------------------------------------------------ errors, memory ---- */

/* the message of fmt and ap into ec, then the unwind to ec's setjmp */
static _Noreturn void vthrow(errctx *ec, int status, bool fatal, const char *fmt, va_list ap) {
    vsnprintf(ec->msg, sizeof ec->msg, fmt, ap);
    ec->status = status;
    ec->fatal = fatal;
    longjmp(ec->jb, 1);
}

_Noreturn void throw_status(errctx *ec, int status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vthrow(ec, status, status != CS_EINVAL, fmt, ap);
}

_Noreturn void throw_limit(errctx *ec, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vthrow(ec, CS_EINVAL, true, fmt, ap);
}

void *arena_alloc(arena *a, size_t n) {
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

void *arena_zalloc(arena *a, size_t n) {
    void *p = arena_alloc(a, n);
    memset(p, 0, n);
    return p;
}

void arena_free(arena *a) {
    chunk *c = a->head;
    while (c) {
        chunk *next = c->next;
        free(c);
        c = next;
    }
    a->head = NULL;
    a->total = 0;
}

/* A new array of cap elements of size elem holding the first n of old. */
void *arena_grow(arena *a, const void *old, size_t n, size_t cap, size_t elem) {
    void *p = arena_alloc(a, cap * elem);
    if (n) memcpy(p, old, n * elem);
    return p;
}

char *arena_strndup(arena *a, const char *s, size_t n) {
    char *p = arena_alloc(a, n + 1);
    memcpy(p, s, n);
    p[n] = 0;
    return p;
}

void sb_init(sbuf *b, arena *a, size_t limit, bool heap) {
    memset(b, 0, sizeof *b);
    b->a = a;
    b->limit = limit;
    b->heap = heap;
}

void sb_reserve(sbuf *b, size_t extra) {
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
        b->p = arena_grow(b->a, b->p, b->n, cap, 1);
    }
    b->cap = cap;
}

void sb_put(sbuf *b, const char *s, size_t n) {
    if (!n) return;
    sb_reserve(b, n);
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

void sb_printf(sbuf *b, const char *fmt, ...) {
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
