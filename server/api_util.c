/* api_util.c: the small helpers the endpoint files share (api_internal.h): JSON strings
 * from bytes that may not be valid UTF-8, and the list of served adapters with the requests
 * pinning them. (Request errors, perr_t, are http.c's.) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/api_internal.h"
#include "server/keys.h"

/* ---- JSON strings ---- */
/* The bytes as they are when they are valid UTF-8, else a character at a time, judged as
 * jansson judges them (cs_utf8_next). */
json_t *jstr(const char *s, size_t n) {
    json_t *j = json_stringn(s, n);
    if (j) return j;
    cs_buf_t b = {0};
    int32_t cp;
    for (size_t i = 0, k; i < n; i += k) {
        k = cs_utf8_next(s + i, n - i, &cp, NULL);
        if (k) {
            cs_buf_add(&b, s + i, k);
        } else {
            cs_buf_add(&b, "\xEF\xBF\xBD", 3);
            k = 1;
        }
    }
    j = json_stringn(b.p ? b.p : "", b.len);
    free(b.p);
    return j;
}

/* ---- stream frames ---- */
bool api_frame(cs_buf_t *out, const json_t *o, bool ndjson) {
    char *s = json_dumps(o, JSON_COMPACT);
    if (!s) return false;
    bool ok = (ndjson || cs_buf_add(out, "data: ", 6)) && cs_buf_add(out, s, strlen(s)) &&
              cs_buf_add(out, ndjson ? "\n" : "\n\n", ndjson ? 1 : 2);
    free(s);
    return ok;
}

/* ---- served adapters ---- */

served_adapter_t *adapter_find(server_t *s, const char *name) {
    if (!s->index_cap) return NULL;
    for (served_adapter_t *a = s->index[cs_hash_str(name) & (s->index_cap - 1)]; a; a = a->hnext)
        if (!strcmp(a->name, name)) return a;
    return NULL;
}

bool adapter_insert(server_t *s, served_adapter_t *a) {
    if (s->n_adapters + 1 > s->index_cap / 2) { /* load factor at most 1/2 */
        size_t cap = s->index_cap ? s->index_cap * 2 : 64;
        served_adapter_t **t = calloc(cap, sizeof *t);
        if (!t) return false;
        for (size_t i = 0; i < s->index_cap; i++)
            for (served_adapter_t *x = s->index[i], *nx; x; x = nx) {
                nx = x->hnext;
                size_t k = cs_hash_str(x->name) & (cap - 1);
                x->hnext = t[k];
                t[k] = x;
            }
        free(s->index);
        s->index = t;
        s->index_cap = cap;
    }
    size_t k = cs_hash_str(a->name) & (s->index_cap - 1);
    a->hnext = s->index[k];
    s->index[k] = a;
    a->next = s->adapters;
    s->adapters = a;
    s->n_adapters++;
    return true;
}

served_adapter_t *adapter_add(server_t *s, const char *name) {
    served_adapter_t *a = calloc(1, sizeof *a);
    if (a && (a->name = strdup(name)) && adapter_insert(s, a)) return a;
    if (a) free(a->name);
    free(a);
    return NULL;
}

void adapter_unlink(server_t *s, served_adapter_t *a) {
    served_adapter_t **pp = &s->adapters;
    while (*pp != a) pp = &(*pp)->next;
    *pp = a->next;
    pp = &s->index[cs_hash_str(a->name) & (s->index_cap - 1)];
    while (*pp != a) pp = &(*pp)->hnext;
    *pp = a->hnext;
    s->n_adapters--;
}

void adapter_free(served_adapter_t *a) {
    free(a->name);
    free(a->path);
    free(a->waiters);
    free(a);
}

/* The last in-flight request of an adapter being unloaded takes it away and wakes the
 * unload requests waiting for that. */
void adapter_unpin(server_t *s, served_adapter_t *a) {
    if (!a) return;
    served_adapter_t *gone = NULL;
    pthread_mutex_lock(&s->mu);
    if (--a->in_flight == 0 && a->unloading) {
        lora_registry_remove(s->reg, a->name);
        adapter_unlink(s, a);
        gone = a;
    }
    pthread_mutex_unlock(&s->mu);
    if (!gone) return;
    for (int i = 0; i < gone->n_waiters; i++) MHD_resume_connection(gone->waiters[i]); /* suspended until now */
    adapter_free(gone);
}

bool valid_adapter_name(const char *n) {
    if (!n[0] || strlen(n) > 256 || !strcmp(n, "_other") || !strcmp(n, ".") || !strcmp(n, "..")) return false;
    for (const char *p = n; *p; p++)
        if ((unsigned char)*p < 0x20 || *p == '/') return false;
    return true;
}

bool api_may_use(const conn_t *cn, const char *name) {
    const key_grant_t *g = cn ? cn->who : NULL;
    if (!g || key_is_admin(g)) return true;
    return name ? key_may_use(g, name) : g->base;
}

bool api_is_admin(const conn_t *cn) { return !cn || !cn->who || key_is_admin(cn->who); }
