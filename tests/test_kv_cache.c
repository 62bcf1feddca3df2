/* test_kv_cache.c: the paged KV cache's block accounting and prefix cache: allocation until
 * exhaustion, refcounts, free vs cached (evictable) blocks, LRU eviction order, lookups that
 * compare tokens and parents (not only hashes), copy-on-write copies, and a randomized
 * model-checked run against a simple shadow of what each block should be. */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels/cpu_backend.h"
#include "engine/kv_cache.h"
#include "engine/sampling.h"
#include "testutil.h"

static backend_t *be;

static kv_cache_t *make_dt(int n_blocks, cs_dtype dt) {
    kv_cache_params_t p = {2, 8, (size_t)n_blocks * kv_cache_block_bytes(2, 8, dt) + 100, dt};
    kv_cache_t *kv;
    ck_assert_int_eq(kv_cache_new(be, &p, &kv), CS_OK);
    ck_assert_int_eq(kv_cache_n_blocks(kv), n_blocks);
    return kv;
}

static kv_cache_t *make(int n_blocks) { return make_dt(n_blocks, CS_DTYPE_F32); }

static void fill_tokens(int32_t *t, int seed) {
    for (int i = 0; i < KV_BLOCK_SIZE; i++) t[i] = seed * 100 + i;
}

START_TEST(budget_and_exhaustion) {
    kv_cache_params_t p = {2, 8, kv_cache_block_bytes(2, 8, CS_DTYPE_F32) - 1, CS_DTYPE_F32};
    kv_cache_t *kv;
    ck_assert_int_eq(kv_cache_new(be, &p, &kv), CS_EINVAL);
    ck_assert_ptr_null(kv);
    /* a KV dtype the backend's attention does not read is refused, not misread */
    kv_cache_params_t pb = {2, 8, 4 * kv_cache_block_bytes(2, 8, CS_DTYPE_F16), CS_DTYPE_F16};
    ck_assert_int_eq(kv_cache_new(be, &pb, &kv), CS_EUNSUPPORTED);
    ck_assert_ptr_null(kv);
    ck_assert_msg(strstr(cs_error_last(), "F32, BF16"), "the refusal names what the backend reads: %s", cs_error_last());
    /* BF16 pools: a block takes half the bytes, so a budget holds twice the blocks */
    ck_assert_uint_eq(kv_cache_block_bytes(2, 8, CS_DTYPE_BF16) * 2, kv_cache_block_bytes(2, 8, CS_DTYPE_F32));
    kv = make_dt(8, CS_DTYPE_BF16);
    ck_assert_int_eq(kv_cache_dtype(kv), CS_DTYPE_BF16);
    ck_assert_uint_eq(backend_buf_size(be, kv_cache_k(kv, 1)), (size_t)8 * KV_BLOCK_SIZE * 8 * 2);
    kv_cache_free(kv);
    kv = make(4);
    int32_t b[4];
    for (int i = 0; i < 4; i++) {
        b[i] = kv_block_alloc(kv);
        ck_assert_int_ge(b[i], 0);
        for (int j = 0; j < i; j++) ck_assert_int_ne(b[i], b[j]);
    }
    ck_assert_int_eq(kv_block_alloc(kv), -1);
    ck_assert_int_eq(kv_cache_n_available(kv), 0);
    kv_block_ref(kv, b[1]);
    kv_block_unref(kv, b[1]);
    ck_assert_int_eq(kv_cache_n_available(kv), 0);
    kv_block_unref(kv, b[1]);
    ck_assert_int_eq(kv_cache_n_available(kv), 1);
    ck_assert_int_eq(kv_block_alloc(kv), b[1]);
    kv_cache_free(kv);
}
END_TEST

START_TEST(prefix_publish_lookup_evict) {
    kv_cache_t *kv = make(3);
    int32_t t0[KV_BLOCK_SIZE], t1[KV_BLOCK_SIZE];
    fill_tokens(t0, 1);
    fill_tokens(t1, 2);
    uint64_t root = kv_hash_root("a", 1), root2 = kv_hash_root("a", 2), root3 = kv_hash_root("b", 1);
    ck_assert(root != root2 && root != root3 && root != kv_hash_root(NULL, 0));
    int32_t b0 = kv_block_alloc(kv), b1 = kv_block_alloc(kv);
    kv_prefix_publish(kv, b0, root, t0);
    uint64_t h0 = kv_hash_block(root, t0);
    kv_prefix_publish(kv, b1, h0, t1);
    /* found while referenced: the refcount grows */
    ck_assert_int_eq(kv_prefix_lookup(kv, root, t0), b0);
    ck_assert_int_eq(kv_block_refcount(kv, b0), 2);
    kv_block_unref(kv, b0);
    /* other adapter / version / tokens / parent: misses */
    ck_assert_int_eq(kv_prefix_lookup(kv, root2, t0), -1);
    ck_assert_int_eq(kv_prefix_lookup(kv, root3, t0), -1);
    ck_assert_int_eq(kv_prefix_lookup(kv, root, t1), -1);
    ck_assert_int_eq(kv_prefix_lookup(kv, root, t0) >= 0, 1);
    kv_block_unref(kv, b0);
    /* released (chain end first, as the engine does): cached, still found */
    kv_block_unref(kv, b1);
    kv_block_unref(kv, b0);
    ck_assert_int_eq(kv_cache_n_available(kv), 3);
    kv_cache_stats_t st;
    kv_cache_get_stats(kv, &st);
    ck_assert_int_eq(st.n_cached, 2);
    ck_assert_int_eq(st.n_free, 1);
    ck_assert_int_eq(kv_prefix_lookup(kv, root, t0), b0);  /* leaves the LRU */
    kv_block_unref(kv, b0);                                  /* now the most recent */
    /* allocation takes the free block, then evicts the least recently released (b1) */
    int32_t x = kv_block_alloc(kv);
    ck_assert(x != b0 && x != b1);
    ck_assert_int_eq(kv_block_alloc(kv), b1);
    ck_assert_int_eq(kv_prefix_lookup(kv, h0, t1), -1);    /* evicted: gone from the table */
    ck_assert_int_eq(kv_prefix_lookup(kv, root, t0), b0);
    kv_cache_get_stats(kv, &st);
    ck_assert_int_eq(st.evictions, 1);
    ck_assert_int_eq(kv_block_alloc(kv), -1);
    /* publishing an equal block twice keeps the first; the duplicate frees normally */
    kv_block_unref(kv, x);
    int32_t dup = kv_block_alloc(kv);
    kv_prefix_publish(kv, dup, root, t0);
    kv_block_unref(kv, dup);
    kv_cache_get_stats(kv, &st);
    ck_assert_int_eq(st.n_free, 1);
    ck_assert_int_eq(kv_prefix_lookup(kv, root, t0), b0);
    kv_cache_free(kv);
}
END_TEST

/* flush: evictable blocks free at once, blocks in use unpublished and freed on release;
 * lookups miss until blocks are published again */
START_TEST(prefix_flush) {
    kv_cache_t *kv = make(4);
    int32_t t0[KV_BLOCK_SIZE], t1[KV_BLOCK_SIZE];
    fill_tokens(t0, 1);
    fill_tokens(t1, 2);
    uint64_t root = kv_hash_root("a", 1), h0 = kv_hash_block(root, t0);
    int32_t b0 = kv_block_alloc(kv), b1 = kv_block_alloc(kv);
    kv_prefix_publish(kv, b0, root, t0);
    kv_prefix_publish(kv, b1, h0, t1);
    kv_block_unref(kv, b1); /* b1 evictable, b0 in use */
    kv_cache_stats_t st;
    kv_cache_get_stats(kv, &st);
    ck_assert_int_eq(st.n_cached, 1);
    ck_assert_int_eq(kv_prefix_flush(kv), 1);
    kv_cache_get_stats(kv, &st);
    ck_assert_int_eq(st.n_cached, 0);
    ck_assert_int_eq(st.n_free, 3);
    ck_assert_int_eq(kv_prefix_lookup(kv, root, t0), -1);
    ck_assert_int_eq(kv_prefix_lookup(kv, h0, t1), -1);
    ck_assert_int_eq(kv_block_refcount(kv, b0), 1);
    kv_block_unref(kv, b0); /* unpublished: straight to the free list, not the LRU */
    kv_cache_get_stats(kv, &st);
    ck_assert_int_eq(st.n_free, 4);
    ck_assert_int_eq(st.n_cached, 0);
    /* published again after the flush: found again */
    int32_t b = kv_block_alloc(kv);
    kv_prefix_publish(kv, b, root, t0);
    kv_block_unref(kv, b);
    ck_assert_int_eq(kv_prefix_lookup(kv, root, t0), b);
    kv_block_unref(kv, b);
    ck_assert_int_eq(kv_prefix_flush(kv), 1);
    ck_assert_int_eq(kv_cache_n_available(kv), 4);
    kv_cache_free(kv);
}
END_TEST

START_TEST(copy_partial_block) {
    /* on the CPU backend and on the strict test device (the copy goes through buf_copy), in
     * F32 and BF16 pools: exactly the first rows' bytes move */
    backend_t *strict = strict_device_new(&(strict_device_params_t){.cpu = {.n_threads = 1}});
    backend_t *bes[2] = {be, strict};
    static const cs_dtype dts[2] = {CS_DTYPE_F32, CS_DTYPE_BF16};
    size_t d2d_want = 0;
    for (int di = 0; di < 2; di++)
        for (int bi = 0; bi < 2; bi++) {
            size_t esz = cs_dtype_size(dts[di]), row = 8 * esz, pool = (size_t)2 * KV_BLOCK_SIZE * row; /* bytes */
            backend_t *saved = be;
            be = bes[bi];
            kv_cache_t *kv = make_dt(2, dts[di]);
            be = saved;
            int32_t a = kv_block_alloc(kv), b = kv_block_alloc(kv);
            unsigned char *k = malloc(pool), *v = malloc(pool);
            for (int l = 0; l < 2; l++) {
                memset(k, 7, pool);
                memset(v, 7, pool);
                for (size_t i = 0; i < KV_BLOCK_SIZE * row; i++) {
                    k[(size_t)a * KV_BLOCK_SIZE * row + i] = (unsigned char)(l * 100 + i);
                    v[(size_t)a * KV_BLOCK_SIZE * row + i] = (unsigned char)(255 - l * 100 - i);
                }
                backend_buf_set(bes[bi], kv_cache_k(kv, l), 0, k, pool);
                backend_buf_set(bes[bi], kv_cache_v(kv, l), 0, v, pool);
            }
            kv_block_copy(kv, b, a, 5);
            if (bi == 1) d2d_want += 2 * 2 * 5 * row; /* 2 layers, k and v, 5 rows */
            for (int l = 0; l < 2; l++) {
                backend_buf_get(bes[bi], k, kv_cache_k(kv, l), 0, pool);
                backend_buf_get(bes[bi], v, kv_cache_v(kv, l), 0, pool);
                for (size_t i = 0; i < 5 * row; i++) {
                    ck_assert_uint_eq(k[(size_t)b * KV_BLOCK_SIZE * row + i], (unsigned char)(l * 100 + i));
                    ck_assert_uint_eq(v[(size_t)b * KV_BLOCK_SIZE * row + i], (unsigned char)(255 - l * 100 - i));
                }
                ck_assert_uint_eq(k[(size_t)b * KV_BLOCK_SIZE * row + 5 * row], 7); /* rows past n untouched */
                ck_assert_uint_eq(v[(size_t)b * KV_BLOCK_SIZE * row + 5 * row], 7);
            }
            free(k);
            free(v);
            kv_cache_free(kv);
        }
    backend_stats_t st;
    backend_get_stats(strict, &st);
    ck_assert_uint_eq(st.d2d_bytes, d2d_want);
    backend_free(strict);
}
END_TEST

/* random operations against a shadow model: refcounts, availability and lookups agree */
START_TEST(randomized_shadow) {
    enum { NB = 24 };
    kv_cache_t *kv = make(NB);
    int ref[NB] = {0};
    int key[NB];      /* published key (a small int) or -1 */
    int32_t toks[KV_BLOCK_SIZE];
    for (int i = 0; i < NB; i++) key[i] = -1;
    cs_rng_t r;
    cs_rng_seed(&r, 5);
    uint64_t root = kv_hash_root("x", 1);
    for (int step = 0; step < 20000; step++) {
        int op = (int)(cs_rng_next(&r) % 4);
        if (op == 0) {
            int32_t b = kv_block_alloc(kv);
            int avail = 0;
            for (int i = 0; i < NB; i++) avail += ref[i] == 0;
            if (b < 0) { ck_assert_int_eq(avail, 0); continue; }
            ck_assert_int_eq(ref[b], 0);
            ref[b] = 1;
            key[b] = -1; /* evicted or fresh: no longer published */
        } else if (op == 1) {
            int b = (int)(cs_rng_next(&r) % NB);
            if (ref[b] > 0) { kv_block_unref(kv, b); ref[b]--; }
        } else if (op == 2) {
            int b = (int)(cs_rng_next(&r) % NB), k = (int)(cs_rng_next(&r) % 40);
            bool taken = false;
            for (int i = 0; i < NB; i++) taken |= key[i] == k;
            if (ref[b] > 0 && key[b] < 0 && !taken) {
                fill_tokens(toks, k);
                kv_prefix_publish(kv, b, root, toks);
                key[b] = k;
            }
        } else {
            int k = (int)(cs_rng_next(&r) % 40);
            fill_tokens(toks, k);
            int32_t b = kv_prefix_lookup(kv, root, toks);
            int want = -1;
            for (int i = 0; i < NB; i++)
                if (key[i] == k) want = i;
            ck_assert_int_eq(b, want);
            if (b >= 0) ref[b]++;
        }
        int avail = 0;
        for (int i = 0; i < NB; i++) {
            avail += ref[i] == 0;
            ck_assert_int_eq(kv_block_refcount(kv, i), ref[i]);
        }
        ck_assert_int_eq(kv_cache_n_available(kv), avail);
    }
    kv_cache_free(kv);
}
END_TEST

int main(void) {
    be = cpu_backend_new(&(cpu_backend_params_t){.n_threads = 1});
    const TTest *const tests[] = {
        budget_and_exhaustion, prefix_publish_lookup_evict, prefix_flush, copy_partial_block, randomized_shadow,
    };
    int rc = cs_check_main("kv_cache", tests, CS_ARRAY_LEN(tests), 0, CK_NOFORK);
    backend_free(be);
    return rc;
}
