/* backend.c: the functions of backend.h: each calls the backend's method, and where an
 * optional method is absent does what backend.h says instead. */
#include "backend/backend_impl.h"

#include <stdlib.h>

const backend_caps_t *backend_caps(const backend_t *b) { return &b->caps; }
const char *backend_name(const backend_t *b) { return b->iface->name; }
int backend_n_threads(const backend_t *b) { return b->n_threads; }
void backend_free(backend_t *b) {
    if (b) b->iface->free(b);
}

/* ---- memory ---- */
backend_buf_t *backend_buf_alloc(backend_t *b, size_t n) { return b->iface->buf_alloc(b, n); }
void backend_buf_free(backend_t *b, backend_buf_t *p) {
    if (p) b->iface->buf_free(b, p);
}
size_t backend_buf_size(backend_t *b, const backend_buf_t *p) { return b->iface->buf_size(b, p); }
backend_buf_t *backend_buf_from_host(backend_t *b, void *p, size_t n) {
    return b->iface->buf_from_host ? b->iface->buf_from_host(b, p, n) : NULL;
}
int backend_weight_prepare(backend_t *b, const backend_weight_t *w) {
    return b->iface->weight_prepare ? b->iface->weight_prepare(b, w) : 0;
}
void backend_buf_set(backend_t *b, backend_buf_t *d, size_t off, const void *s, size_t n) {
    b->iface->buf_set(b, d, off, s, n);
}
void backend_buf_get(backend_t *b, void *d, const backend_buf_t *s, size_t off, size_t n) {
    b->iface->buf_get(b, d, s, off, n);
}
void backend_buf_copy(backend_t *b, backend_buf_t *d, size_t doff, const backend_buf_t *s, size_t soff, size_t n) {
    b->iface->buf_copy(b, d, doff, s, soff, n);
}
void backend_buf_set_async(backend_t *b, backend_buf_t *d, size_t off, const void *s, size_t n) {
    if (b->iface->buf_set_async) b->iface->buf_set_async(b, d, off, s, n);
    else b->iface->buf_set(b, d, off, s, n);
}
void backend_buf_get_async(backend_t *b, void *d, const backend_buf_t *s, size_t off, size_t n) {
    if (b->iface->buf_get_async) b->iface->buf_get_async(b, d, s, off, n);
    else b->iface->buf_get(b, d, s, off, n);
}

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
void backend_event_record(backend_t *b, backend_event_t *ev) {
    if (b->iface->event_record) b->iface->event_record(b, ev);
}
void backend_event_wait(backend_t *b, backend_event_t *ev) {
    if (b->iface->event_wait) b->iface->event_wait(b, ev);
}
bool backend_event_query(backend_t *b, backend_event_t *ev) {
    return b->iface->event_query ? b->iface->event_query(b, ev) : true;
}
void backend_event_synchronize(backend_t *b, backend_event_t *ev) {
    if (b->iface->event_synchronize) b->iface->event_synchronize(b, ev);
}

/* ---- the per-forward batch and adapter slots ---- */
int backend_batch_upload(backend_t *b, backend_batch_t **batch, const backend_batch_desc_t *d) {
    return b->iface->batch_upload(b, batch, d);
}
void backend_batch_free(backend_t *b, backend_batch_t *batch) {
    if (batch) b->iface->batch_free(b, batch);
}
int backend_adapter_upload(backend_t *b, const backend_adapter_desc_t *d, backend_adapter_t **slot) {
    return b->iface->adapter_upload(b, d, slot);
}
void backend_adapter_free(backend_t *b, backend_adapter_t *slot) {
    if (slot) b->iface->adapter_free(b, slot);
}
size_t backend_adapter_bytes(backend_t *b, const backend_adapter_t *slot) { return b->iface->adapter_bytes(b, slot); }
int backend_adapter_stream(backend_t *b, const backend_adapter_desc_t *d, int group, void (*on_group)(void *),
                           void *user, backend_adapter_t **slot) {
    if (b->iface->adapter_stream) return b->iface->adapter_stream(b, d, group, on_group, user, slot);
    int rc = b->iface->adapter_upload(b, d, slot);
    if (rc == CS_OK && on_group) on_group(user);
    return rc;
}
int backend_adapter_arrived(backend_t *b, const backend_adapter_t *slot) {
    return b->iface->adapter_arrived ? b->iface->adapter_arrived(b, slot) : INT_MAX;
}
void backend_adapter_feed(backend_t *b, backend_adapter_t *slot, int n) { b->iface->adapter_feed(b, slot, n); }

/* ---- compute ---- */
void backend_embed(backend_t *b, backend_buf_t *y, const backend_weight_t *t, const backend_batch_t *bt) {
    b->iface->embed(b, y, t, bt);
}
void backend_matmul(backend_t *b, backend_buf_t *y, const backend_buf_t *x, int n, const backend_weight_t *w,
                    const backend_buf_t *bias) {
    b->iface->matmul(b, y, x, n, w, bias);
}
void backend_matmul_multi(backend_t *b, backend_buf_t *const *ys, const backend_buf_t *x, int n,
                          const backend_weight_t *const *ws, const backend_buf_t *const *biases, int count) {
    if (b->iface->matmul_multi) {
        b->iface->matmul_multi(b, ys, x, n, ws, biases, count);
        return;
    }
    for (int k = 0; k < count; k++) b->iface->matmul(b, ys[k], x, n, ws[k], biases[k]);
}
void backend_rmsnorm(backend_t *b, backend_buf_t *y, const backend_buf_t *x, int n, int dim, const backend_weight_t *w,
                     float eps) {
    b->iface->rmsnorm(b, y, x, n, dim, w, eps);
}
void backend_rope(backend_t *b, backend_buf_t *x, int nh, int hd, const backend_batch_t *bt,
                  const backend_buf_t *inv_freq) {
    b->iface->rope(b, x, nh, hd, bt, inv_freq);
}
void backend_kv_store(backend_t *b, backend_buf_t *pool, cs_dtype kv_dtype, const backend_buf_t *src,
                      const backend_batch_t *bt, int row_len) {
    b->iface->kv_store(b, pool, kv_dtype, src, bt, row_len);
}
void backend_attention(backend_t *b, backend_buf_t *out, const backend_buf_t *q, const backend_buf_t *k,
                       const backend_buf_t *v, cs_dtype kv_dtype, const backend_batch_t *bt, int bs, int nh, int nkv,
                       int hd, int window) {
    b->iface->attention(b, out, q, k, v, kv_dtype, bt, bs, nh, nkv, hd, window);
}
void backend_get_out_rows(backend_t *b, backend_buf_t *dst, const backend_buf_t *src, const backend_batch_t *bt,
                          int row_len) {
    b->iface->get_out_rows(b, dst, src, bt, row_len);
}
void backend_silu_mul(backend_t *b, backend_buf_t *g, const backend_buf_t *u, size_t n) { b->iface->silu_mul(b, g, u, n); }
void backend_add(backend_t *b, backend_buf_t *y, const backend_buf_t *x, size_t n) { b->iface->add(b, y, x, n); }
void backend_lora(backend_t *b, backend_buf_t *y, const backend_buf_t *x, const backend_batch_t *bt, int layer,
                  int target, int d_in, int d_out) {
    b->iface->lora(b, y, x, bt, layer, target, d_in, d_out);
}
void backend_get_signal(backend_t *b, void *dst, const backend_buf_t *src, size_t off, size_t n, uint32_t *flag,
                        uint32_t value) {
    b->iface->get_signal(b, dst, src, off, n, flag, value);
}
void backend_wait_add(backend_t *b, backend_buf_t *y, size_t off, const void *src, cs_dtype src_dtype, size_t n,
                      const uint32_t *flag, uint32_t value, const uint32_t *alive, int layer) {
    CS_ASSERT(src_dtype == CS_DTYPE_F32 || src_dtype == CS_DTYPE_BF16);
    b->iface->wait_add(b, y, off, src, src_dtype, n, flag, value, alive, layer);
}

bool backend_graph_begin(backend_t *b, uint64_t key) {
    return b->iface->graph_begin ? b->iface->graph_begin(b, key) : false;
}
void backend_graph_end(backend_t *b) {
    if (b->iface->graph_end) b->iface->graph_end(b);
}
void backend_graph_reset(backend_t *b) {
    if (b->iface->graph_reset) b->iface->graph_reset(b);
}
void backend_synchronize(backend_t *b) {
    if (b->iface->synchronize) b->iface->synchronize(b);
}
void backend_get_stats(backend_t *b, backend_stats_t *st) {
    memset(st, 0, sizeof *st);
    if (b->iface->get_stats) b->iface->get_stats(b, st);
}
