/* stop.c: see stop.h. The pending text (held-back suffix + new delta) is at most
 * STOP_MAX_LEN - 1 bytes plus one delta, so plain memmem and memcmp scans are enough. */
#include "config.h" /* _GNU_SOURCE: memmem */

#include "text/stop.h"

#include <stdlib.h>
#include <string.h>

struct stop_matcher {
    int n;
    char *stops[STOP_MAX_STRINGS];
    size_t lens[STOP_MAX_STRINGS];
    size_t max_len;
    bool first_byte[256];   /* bytes that start some stop string */
    char *buf;              /* buf[0..released) was returned by the last call, then held */
    size_t len, released, cap;
    int matched;            /* -1 until a stop string matched */
};

int stop_strings_validate(const char *const *stops, int n) {
    if (n < 0 || n > STOP_MAX_STRINGS)
        return cs_error_set(CS_EINVAL, "at most %d stop strings, got %d", STOP_MAX_STRINGS, n);
    for (int i = 0; i < n; i++) {
        if (!stops[i]) return cs_error_set(CS_EINVAL, "stop string %d is null", i);
        size_t l = strlen(stops[i]);
        if (l == 0) return cs_error_set(CS_EINVAL, "stop string %d is empty", i);
        if (l > STOP_MAX_LEN)
            return cs_error_set(CS_EINVAL, "stop string %d is %zu bytes, the limit is %d", i, l, STOP_MAX_LEN);
        if (!cs_utf8_valid(stops[i], l))
            return cs_error_set(CS_EINVAL, "stop string %d is not valid UTF-8", i);
    }
    return CS_OK;
}

stop_matcher_t *stop_matcher_new(const char *const *stops, int n) {
    if (stop_strings_validate(stops, n)) return NULL;
    stop_matcher_t *m = calloc(1, sizeof *m);
    if (!m) goto err;
    m->matched = -1;
    for (int i = 0; i < n; i++) {
        m->stops[i] = strdup(stops[i]);
        if (!m->stops[i]) goto err;
        m->n++;
        m->lens[i] = strlen(stops[i]);
        m->max_len = CS_MAX(m->max_len, m->lens[i]);
        m->first_byte[(unsigned char)stops[i][0]] = true;
    }
    return m;
err:
    stop_matcher_free(m);
    cs_error_set(CS_ENOMEM, "stop matcher: out of memory");
    return NULL;
}

void stop_matcher_free(stop_matcher_t *m) {
    if (!m) return;
    for (int i = 0; i < m->n; i++) free(m->stops[i]);
    free(m->buf);
    free(m);
}

size_t stop_matcher_held(const stop_matcher_t *m) { return m->len - m->released; }

/* Drops what the last call returned, leaving the held-back bytes at the front. */
static void compact(stop_matcher_t *m) {
    if (!m->released) return;
    memmove(m->buf, m->buf + m->released, m->len - m->released);
    m->len -= m->released;
    m->released = 0;
}

/* Length of the longest suffix of buf[0..len) that is a proper prefix of a stop string. */
static size_t held_suffix(const stop_matcher_t *m) {
    size_t longest = m->max_len ? m->max_len - 1 : 0;
    for (size_t h = CS_MIN(m->len, longest); h > 0; h--) {
        const char *suf = m->buf + m->len - h;
        if (!m->first_byte[(unsigned char)suf[0]]) continue;
        for (int i = 0; i < m->n; i++)
            if (m->lens[i] > h && memcmp(m->stops[i], suf, h) == 0) return h;
    }
    return 0;
}

int stop_matcher_feed(stop_matcher_t *m, const char *delta, size_t len, stop_result_t *out) {
    compact(m);
    *out = (stop_result_t){m->buf ? m->buf : "", 0, m->matched};
    if (m->matched >= 0) return 1;
    if (m->len + len > m->cap) {
        size_t cap = CS_MAX(m->cap * 2, m->len + len);
        cap = CS_MAX(cap, 64);
        char *nb = realloc(m->buf, cap);
        if (!nb) return cs_error_set(CS_ENOMEM, "stop matcher: out of memory");
        m->buf = nb;
        m->cap = cap;
    }
    if (len) memcpy(m->buf + m->len, delta, len);
    m->len += len;
    if (m->buf) out->text = m->buf;

    /* the match that completes first: earliest end, then longest, then lowest index */
    size_t best_end = SIZE_MAX, best_start = 0;
    for (int i = 0; i < m->n; i++) {
        if (m->lens[i] > m->len) continue;
        const char *p = memmem(m->buf, m->len, m->stops[i], m->lens[i]);
        if (!p) continue;
        size_t start = (size_t)(p - m->buf), end = start + m->lens[i];
        if (end < best_end || (end == best_end && start < best_start)) {
            best_end = end;
            best_start = start;
            m->matched = i;
        }
    }
    if (m->matched >= 0) {
        out->len = best_start;
        out->stop = m->matched;
        m->released = m->len; /* nothing after the match is ever emitted */
        return 1;
    }
    out->len = m->len - held_suffix(m);
    m->released = out->len;
    return 0;
}

int stop_matcher_flush(stop_matcher_t *m, stop_result_t *out) {
    compact(m);
    *out = (stop_result_t){m->buf ? m->buf : "", 0, m->matched};
    if (m->matched >= 0) return 1;
    out->len = m->len;
    m->released = m->len;
    return 0;
}
