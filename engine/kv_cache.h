/* kv_cache.h: the paged KV cache and its prefix cache. Keys and values of every layer live
 * in pools of fixed-size blocks (KV_BLOCK_SIZE tokens); a sequence owns a block table that
 * maps its positions to blocks. Blocks are refcounted: a full block can be shared by many
 * sequences (n samples of one prompt, requests with the same prefix). A full block is
 * keyed by a hash chain over (adapter name + version, token ids): when its last user
 * lets go it stays in the table, evictable in LRU order, until its memory is needed.
 * Owned by the engine thread: no locking. */
#ifndef CS_KV_CACHE_H
#define CS_KV_CACHE_H

#include "backend/backend.h"

#define KV_BLOCK_SIZE 16

typedef struct kv_cache kv_cache_t;

typedef struct kv_cache_params {
    int n_layers;
    int kv_dim;          /* n_kv_heads * head_dim */
    size_t bytes;        /* budget for K and V of all layers; rounded down to whole blocks */
    cs_dtype dtype;      /* of the pools: F32 (the default, 0), or BF16 (half the bytes; K and V
                          * rounded as a BF16 model's are) where the backend reads it
                          * (backend_caps: kv_dtypes), else CS_EUNSUPPORTED */
} kv_cache_params_t;

typedef struct kv_cache_stats {
    int n_blocks;        /* total */
    int n_free;          /* never-hashed or evicted blocks ready for use */
    int n_cached;        /* unreferenced blocks kept for the prefix cache (evictable) */
    uint64_t lookups;    /* full-block prefix lookups */
    uint64_t hits;       /* ... that found a block */
    uint64_t evictions;  /* cached blocks reused for new data */
    cs_dtype dtype;      /* of the pools */
} kv_cache_stats_t;

/* bytes of K + V one block takes over all layers, in pools of dtype */
size_t kv_cache_block_bytes(int n_layers, int kv_dim, cs_dtype dtype);
/* Fails with CS_EINVAL when the budget holds fewer than 1 block, CS_ENOMEM when the backend
 * cannot allocate it. */
int kv_cache_new(backend_t *be, const kv_cache_params_t *p, kv_cache_t **out);
void kv_cache_free(kv_cache_t *kv);

int kv_cache_n_blocks(const kv_cache_t *kv);
/* unique to this cache for the process (never reused, unlike its address): a replayed
 * device graph names one cache's pools */
uint64_t kv_cache_id(const kv_cache_t *kv);
/* blocks obtainable right now by kv_block_alloc (free + evictable cached) */
int kv_cache_n_available(const kv_cache_t *kv);
void kv_cache_get_stats(const kv_cache_t *kv, kv_cache_stats_t *st);
/* pools of layer l, backend buffers of [n_blocks][KV_BLOCK_SIZE][kv_dim] elements of the
 * cache's dtype; position p of a sequence is row (table[p / KV_BLOCK_SIZE] * KV_BLOCK_SIZE
 * + p % KV_BLOCK_SIZE) */
backend_buf_t *kv_cache_k(kv_cache_t *kv, int layer);
backend_buf_t *kv_cache_v(kv_cache_t *kv, int layer);
cs_dtype kv_cache_dtype(const kv_cache_t *kv);

/* A block with refcount 1, or -1 when none is free and none is evictable. Takes the free
 * list first, then evicts the least recently released cached block. */
int32_t kv_block_alloc(kv_cache_t *kv);
void kv_block_ref(kv_cache_t *kv, int32_t b);
/* Drop one reference; at zero a hashed block becomes evictable (most recent), an unhashed
 * one goes back to the free list. */
void kv_block_unref(kv_cache_t *kv, int32_t b);
int kv_block_refcount(const kv_cache_t *kv, int32_t b);
/* Copy the first n_tokens rows of src into dst in every layer (copy-on-write of a partial
 * block shared by n samples), on the backend (buf_copy). */
void kv_block_copy(kv_cache_t *kv, int32_t dst, int32_t src, int n_tokens);

/* ---- prefix cache ---- */
/* The root of a hash chain: what the KV depends on besides the tokens (adapter + version). */
uint64_t kv_hash_root(const char *adapter, int version);
/* hash of a full block of KV_BLOCK_SIZE tokens following a block (or root) of hash parent */
uint64_t kv_hash_block(uint64_t parent, const int32_t *tokens);
/* Find the full block with this (parent, tokens); on a hit it gains a reference (leaving
 * the evictable list if it was there) and is returned; -1 on a miss. Tokens and parent are
 * compared, not only the 64-bit hash. Counts a lookup. */
int32_t kv_prefix_lookup(kv_cache_t *kv, uint64_t parent, const int32_t *tokens);
/* Publish block b (full, KV written, referenced) under (parent, tokens). If an equal block
 * is already published, b stays private (and is freed normally). */
void kv_prefix_publish(kv_cache_t *kv, int32_t b, uint64_t parent, const int32_t *tokens);
/* Empty the prefix cache: evictable blocks become free, blocks in use are unpublished (and
 * freed when released); later lookups miss until blocks are published again. Returns the
 * number of evictable blocks freed. */
int kv_prefix_flush(kv_cache_t *kv);

#endif
