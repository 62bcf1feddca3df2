/* backend.c: the fallbacks of backend.h's optional methods that need a body. */
#include "backend/backend.h"

#include <stdlib.h>

void *backend_host_alloc(backend_t *b, size_t n) {
    if (b->iface->host_alloc) return b->iface->host_alloc(b, n);
    return cs_aligned_alloc(64, n);
}

void backend_host_free(backend_t *b, void *p) {
    if (!p) return;
    if (b->iface->host_free) b->iface->host_free(b, p);
    else free(p);
}

/* without events every copy was synchronous: one shared token that is always complete */
static char completed_event;

backend_event_t *backend_event_new(backend_t *b) {
    if (b->iface->event_new) return b->iface->event_new(b);
    return (backend_event_t *)&completed_event;
}

void backend_event_free(backend_t *b, backend_event_t *ev) {
    if (ev && b->iface->event_free) b->iface->event_free(b, ev);
}
