/* kv_cache.c: see kv_cache.h. Block metadata lives in parallel arrays; the free list is a
 * stack, the evictable (cached, unreferenced) blocks a doubly linked LRU list, and the
 * prefix table a chained hash over block ids. */
#include "engine/kv_cache.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct block_meta {
    int32_t ref;
    bool hashed;                    /* published in the prefix table */
    int32_t lru_prev, lru_next;     /* evictable list links (-1 ends) */
    int32_t hnext;                  /* hash bucket chain */
    uint64_t hash, parent;
    int32_t tokens[KV_BLOCK_SIZE];
} block_meta_t;

struct kv_cache {
    backend_t *be;
    int n_layers, kv_dim, n_blocks;
    cs_dtype dtype;
    backend_buf_t **k, **v;         /* [n_layers] pools each, one allocation at k */
    block_meta_t *meta;             /* [n_blocks]; the block tables below share its allocation */
    int32_t *free_stack;            /* [n_blocks] */
    int n_free;
    int32_t lru_head, lru_tail;     /* head = least recently released */
    int n_cached;
    int32_t *buckets;               /* [n_buckets] heads, -1 empty */
    uint32_t bucket_mask;
    uint64_t lookups, hits, evictions;
    uint64_t id;
};

size_t kv_cache_block_bytes(int n_layers, int kv_dim, cs_dtype dtype) {
    return (size_t)2 * n_layers * KV_BLOCK_SIZE * (size_t)kv_dim * cs_dtype_size(dtype);
}

int kv_cache_new(backend_t *be, const kv_cache_params_t *p, kv_cache_t **out) {
    *out = NULL;
    if (p->n_layers <= 0 || p->kv_dim <= 0) return cs_error_set(CS_EINVAL, "kv cache: bad shape");
    unsigned kv_dtypes = backend_caps(be)->kv_dtypes;
    if (!(kv_dtypes >> (unsigned)p->dtype & 1u)) {
        char can[64] = "";
        for (int t = 0; t < CS_DTYPE_COUNT; t++)
            if (kv_dtypes >> (unsigned)t & 1u)
                snprintf(can + strlen(can), sizeof can - strlen(can), "%s%s", can[0] ? ", " : "", cs_dtype_name((cs_dtype)t));
        return cs_error_set(CS_EUNSUPPORTED, "a %s KV cache: the %s backend's attention reads %s pools only",
                            cs_dtype_name(p->dtype), backend_name(be), can);
    }
    size_t bb = kv_cache_block_bytes(p->n_layers, p->kv_dim, p->dtype);
    size_t nb = p->bytes / bb;
    if (nb < 1)
        return cs_error_set(CS_EINVAL, "KV cache budget of %zu bytes holds no block (one block of %d tokens takes %zu bytes)",
                            p->bytes, KV_BLOCK_SIZE, bb);
    if (nb > INT32_MAX / KV_BLOCK_SIZE) nb = INT32_MAX / KV_BLOCK_SIZE;
    kv_cache_t *kv = calloc(1, sizeof *kv);
    if (!kv) return cs_error_set(CS_ENOMEM, "out of memory");
    static uint64_t next_id;
    kv->id = __atomic_add_fetch(&next_id, 1, __ATOMIC_RELAXED);
    kv->be = be;
    kv->n_layers = p->n_layers;
    kv->kv_dim = p->kv_dim;
    kv->dtype = p->dtype;
    kv->n_blocks = (int)nb;
    kv->k = calloc(2 * (size_t)p->n_layers, sizeof *kv->k);
    uint32_t nbk = 16;
    while (nbk < 2 * nb) nbk <<= 1;
    kv->meta = calloc(1, nb * sizeof *kv->meta + (nb + nbk) * sizeof(int32_t));
    if (!kv->k || !kv->meta) goto oom;
    kv->v = kv->k + p->n_layers;
    kv->free_stack = (int32_t *)(kv->meta + nb);
    kv->buckets = kv->free_stack + nb;
    kv->bucket_mask = nbk - 1;
    size_t pool = nb * KV_BLOCK_SIZE * (size_t)p->kv_dim * cs_dtype_size(p->dtype);
    cs_error_clear(); /* a failed allocation below says why, or nothing (host memory) */
    for (int l = 0; l < p->n_layers; l++) {
        kv->k[l] = backend_buf_alloc(be, pool);
        kv->v[l] = backend_buf_alloc(be, pool);
        if (!kv->k[l] || !kv->v[l]) goto oom;
    }
    for (uint32_t i = 0; i < nbk; i++) kv->buckets[i] = -1;
    /* the stack pops low block ids first */
    for (size_t i = 0; i < nb; i++) kv->free_stack[i] = (int32_t)(nb - 1 - i);
    kv->n_free = (int)nb;
    for (size_t i = 0; i < nb; i++) kv->meta[i].lru_prev = kv->meta[i].lru_next = kv->meta[i].hnext = -1;
    kv->lru_head = kv->lru_tail = -1;
    *out = kv;
    return CS_OK;
oom: {
    char why[320];
    const char *last = cs_error_last();
    snprintf(why, sizeof why, "%s", strcmp(last, "no error message") ? last : "out of memory");
    kv_cache_free(kv);
    return cs_error_set(CS_ENOMEM, "a KV cache of %zu blocks (%zu bytes) does not fit: %s", nb, nb * bb, why);
}
}

void kv_cache_free(kv_cache_t *kv) {
    if (!kv) return;
    for (int l = 0; kv->k && l < 2 * kv->n_layers; l++) backend_buf_free(kv->be, kv->k[l]); /* k then v */
    free(kv->k);
    free(kv->meta);
    free(kv);
}

int kv_cache_n_blocks(const kv_cache_t *kv) { return kv->n_blocks; }
uint64_t kv_cache_id(const kv_cache_t *kv) { return kv->id; }
int kv_cache_n_available(const kv_cache_t *kv) { return kv->n_free + kv->n_cached; }
backend_buf_t *kv_cache_k(kv_cache_t *kv, int layer) { return kv->k[layer]; }
backend_buf_t *kv_cache_v(kv_cache_t *kv, int layer) { return kv->v[layer]; }
cs_dtype kv_cache_dtype(const kv_cache_t *kv) { return kv->dtype; }

void kv_cache_get_stats(const kv_cache_t *kv, kv_cache_stats_t *st) {
    st->n_blocks = kv->n_blocks;
    st->n_free = kv->n_free;
    st->n_cached = kv->n_cached;
    st->lookups = kv->lookups;
    st->hits = kv->hits;
    st->evictions = kv->evictions;
    st->dtype = kv->dtype;
}

/* ---- LRU of evictable blocks ---- */
static void lru_remove(kv_cache_t *kv, int32_t b) {
    block_meta_t *m = &kv->meta[b];
    if (m->lru_prev >= 0) kv->meta[m->lru_prev].lru_next = m->lru_next; else kv->lru_head = m->lru_next;
    if (m->lru_next >= 0) kv->meta[m->lru_next].lru_prev = m->lru_prev; else kv->lru_tail = m->lru_prev;
    m->lru_prev = m->lru_next = -1;
    kv->n_cached--;
}

static void lru_push_tail(kv_cache_t *kv, int32_t b) {
    block_meta_t *m = &kv->meta[b];
    m->lru_next = -1;
    m->lru_prev = kv->lru_tail;
    if (kv->lru_tail >= 0) kv->meta[kv->lru_tail].lru_next = b; else kv->lru_head = b;
    kv->lru_tail = b;
    kv->n_cached++;
}

/* ---- prefix table ---- */
static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

uint64_t kv_hash_root(const char *adapter, int version) {
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a over the name, then mixed with the version */
    for (const unsigned char *p = (const unsigned char *)(adapter ? adapter : ""); *p; p++) h = (h ^ *p) * 0x100000001b3ull;
    return mix64(h ^ mix64((uint64_t)(uint32_t)version + 0x9e3779b97f4a7c15ull) ^ (adapter ? 1 : 0));
}

uint64_t kv_hash_block(uint64_t parent, const int32_t *tokens) {
    uint64_t h = mix64(parent + 0x9e3779b97f4a7c15ull);
    for (int i = 0; i < KV_BLOCK_SIZE; i++) h = mix64(h ^ ((uint64_t)(uint32_t)tokens[i] + 0x632be59bd9b4e019ull * (uint64_t)(i + 1)));
    return h;
}

static void table_remove(kv_cache_t *kv, int32_t b) {
    block_meta_t *m = &kv->meta[b];
    int32_t *pp = &kv->buckets[m->hash & kv->bucket_mask];
    while (*pp >= 0 && *pp != b) pp = &kv->meta[*pp].hnext;
    CS_ASSERT(*pp == b);
    *pp = m->hnext;
    m->hnext = -1;
    m->hashed = false;
}

static int32_t table_find(const kv_cache_t *kv, uint64_t parent, const int32_t *tokens) {
    uint64_t h = kv_hash_block(parent, tokens);
    for (int32_t b = kv->buckets[h & kv->bucket_mask]; b >= 0; b = kv->meta[b].hnext) {
        const block_meta_t *m = &kv->meta[b];
        if (m->hash == h && m->parent == parent && !memcmp(m->tokens, tokens, sizeof m->tokens)) return b;
    }
    return -1;
}

int32_t kv_block_alloc(kv_cache_t *kv) {
    int32_t b;
    if (kv->n_free > 0) {
        b = kv->free_stack[--kv->n_free];
    } else if (kv->lru_head >= 0) {
        b = kv->lru_head;
        lru_remove(kv, b);
        table_remove(kv, b);
        kv->evictions++;
    } else {
        return -1;
    }
    CS_ASSERT(kv->meta[b].ref == 0);
    kv->meta[b].ref = 1;
    return b;
}

void kv_block_ref(kv_cache_t *kv, int32_t b) {
    CS_ASSERT(b >= 0 && b < kv->n_blocks && kv->meta[b].ref > 0);
    kv->meta[b].ref++;
}

void kv_block_unref(kv_cache_t *kv, int32_t b) {
    CS_ASSERT(b >= 0 && b < kv->n_blocks && kv->meta[b].ref > 0);
    block_meta_t *m = &kv->meta[b];
    if (--m->ref > 0) return;
    if (m->hashed) lru_push_tail(kv, b);
    else kv->free_stack[kv->n_free++] = b;
}

int kv_block_refcount(const kv_cache_t *kv, int32_t b) { return kv->meta[b].ref; }

void kv_block_copy(kv_cache_t *kv, int32_t dst, int32_t src, int n_tokens) {
    CS_ASSERT(n_tokens >= 0 && n_tokens <= KV_BLOCK_SIZE);
    size_t row = (size_t)kv->kv_dim * cs_dtype_size(kv->dtype), bytes = row * (size_t)n_tokens;
    if (!bytes || dst == src) return;
    size_t d = (size_t)dst * KV_BLOCK_SIZE * row, s = (size_t)src * KV_BLOCK_SIZE * row;
    for (int l = 0; l < kv->n_layers; l++) {
        backend_buf_copy(kv->be, kv->k[l], d, kv->k[l], s, bytes);
        backend_buf_copy(kv->be, kv->v[l], d, kv->v[l], s, bytes);
    }
}

int32_t kv_prefix_lookup(kv_cache_t *kv, uint64_t parent, const int32_t *tokens) {
    kv->lookups++;
    int32_t b = table_find(kv, parent, tokens);
    if (b < 0) return -1;
    kv->hits++;
    block_meta_t *m = &kv->meta[b];
    if (m->ref == 0) lru_remove(kv, b);
    m->ref++;
    return b;
}

void kv_prefix_publish(kv_cache_t *kv, int32_t b, uint64_t parent, const int32_t *tokens) {
    block_meta_t *m = &kv->meta[b];
    CS_ASSERT(m->ref > 0);
    if (m->hashed || table_find(kv, parent, tokens) >= 0) return;
    m->hash = kv_hash_block(parent, tokens);
    m->parent = parent;
    memcpy(m->tokens, tokens, sizeof m->tokens);
    int32_t *head = &kv->buckets[m->hash & kv->bucket_mask];
    m->hnext = *head;
    *head = b;
    m->hashed = true;
}


int kv_prefix_flush(kv_cache_t *kv) {
    int dropped = 0;
    while (kv->lru_head >= 0) { /* the evictable ones: free */
        int32_t b = kv->lru_head;
        lru_remove(kv, b);
        table_remove(kv, b);
        kv->free_stack[kv->n_free++] = b;
        dropped++;
    }
    for (int32_t b = 0; b < kv->n_blocks; b++) /* the ones in use: unpublished, freed when released */
        if (kv->meta[b].hashed) table_remove(kv, b);
    return dropped;
}
