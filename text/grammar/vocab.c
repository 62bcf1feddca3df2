/* vocab.c: the vocabulary as the grammar sees it: each token's bytes (tokenizer_token_bytes)
 * and the tokens sorted by them, each with the length of the prefix it shares with the one
 * before (the mask walks them in that order; matcher.c). */
#include "text/grammar/grammar_impl.h"

#include <stdlib.h>
#include <string.h>

typedef struct skey {
    const uint8_t *b;
    uint32_t len;
    int32_t id;
} skey_t;

static int cmp_key(const void *pa, const void *pb) {
    const skey_t *a = pa, *b = pb;
    uint32_t n = a->len < b->len ? a->len : b->len;
    int c = memcmp(a->b, b->b, n);
    if (c) return c;
    if (a->len != b->len) return a->len < b->len ? -1 : 1;
    return a->id - b->id;
}

static int sort_tokens(grammar_vocab_t *v) {
    skey_t *k = malloc(sizeof *k * (size_t)(v->n ? v->n : 1));
    v->sorted = malloc(sizeof *v->sorted * (size_t)(v->n ? v->n : 1));
    v->lcp = malloc(sizeof *v->lcp * (size_t)(v->n ? v->n : 1));
    if (!k || !v->sorted || !v->lcp) {
        free(k);
        return cs_error_set(CS_ENOMEM, "out of memory");
    }
    int n = 0;
    for (int32_t t = 0; t < v->n; t++)
        if (v->len[t]) k[n++] = (skey_t){v->bytes + v->off[t], v->len[t], t};
    qsort(k, (size_t)n, sizeof *k, cmp_key);
    for (int i = 0; i < n; i++) {
        v->sorted[i] = k[i].id;
        uint32_t l = 0;
        if (i)
            while (l < k[i].len && l < k[i - 1].len && k[i].b[l] == k[i - 1].b[l]) l++;
        v->lcp[i] = (uint16_t)l;
    }
    v->n_sorted = n;
    free(k);
    return CS_OK;
}

/* token id's bytes into *b (malloc'd or static), *len; false: never allowed */
typedef bool (*bytes_fn)(const void *src, int32_t id, char **b, size_t *len, bool *owned, int *rc);

static int build(int n, bytes_fn get, const void *src, const int32_t *eos, int n_eos, grammar_vocab_t **out) {
    *out = NULL;
    grammar_vocab_t *v = calloc(1, sizeof *v);
    if (!v) return cs_error_set(CS_ENOMEM, "out of memory");
    v->n = n;
    v->off = calloc((size_t)n + 1, sizeof *v->off);
    v->len = calloc((size_t)n + 1, sizeof *v->len);
    v->eos = malloc(sizeof *v->eos * (size_t)(n_eos + 1));
    cs_buf_t all = {0};
    int rc = (!v->off || !v->len || !v->eos) ? cs_error_set(CS_ENOMEM, "out of memory") : CS_OK;
    if (rc == CS_OK && n_eos) memcpy(v->eos, eos, sizeof *eos * (size_t)n_eos);
    v->n_eos = n_eos;
    for (int32_t id = 0; id < n && rc == CS_OK; id++) {
        char *b = NULL;
        size_t len = 0;
        bool owned = false;
        if (!get(src, id, &b, &len, &owned, &rc)) continue;
        if (len > 65535) len = 0; /* no real token; never allowed */
        v->off[id] = (uint32_t)all.len;
        v->len[id] = (uint32_t)len;
        if (len > (size_t)v->max_len) v->max_len = (int)len;
        if (!cs_buf_add(&all, b, len)) rc = cs_error_set(CS_ENOMEM, "out of memory");
        if (owned) free(b);
    }
    v->bytes = (uint8_t *)all.p;
    if (rc == CS_OK) rc = sort_tokens(v);
    if (rc < 0) {
        grammar_vocab_free(v);
        return rc;
    }
    *out = v;
    return CS_OK;
}

static bool tok_bytes(const void *src, int32_t id, char **b, size_t *len, bool *owned, int *rc) {
    const tokenizer_t *t = src;
    if (!tokenizer_id_to_token(t, id) || tokenizer_is_special(t, id)) return false;
    if ((*rc = tokenizer_token_bytes(t, id, b, len)) < 0) return false;
    *owned = true;
    return true;
}

int grammar_vocab_new(const tokenizer_t *t, const int32_t *eos, int n_eos, grammar_vocab_t **out) {
    return build(tokenizer_vocab_size(t), tok_bytes, t, eos, n_eos, out);
}

typedef struct list {
    const char *const *toks;
    const size_t *lens;
} list_t;

static bool list_bytes(const void *src, int32_t id, char **b, size_t *len, bool *owned, int *rc) {
    const list_t *l = src;
    (void)rc;
    if (!l->toks[id]) return false;
    *b = (char *)l->toks[id];
    *len = l->lens[id];
    *owned = false;
    return true;
}

int grammar_vocab_from_bytes(const char *const *toks, const size_t *lens, int n, const int32_t *eos, int n_eos,
                             grammar_vocab_t **out) {
    list_t l = {toks, lens};
    return build(n, list_bytes, &l, eos, n_eos, out);
}

void grammar_vocab_free(grammar_vocab_t *v) {
    if (!v) return;
    free(v->bytes);
    free(v->off);
    free(v->len);
    free(v->sorted);
    free(v->lcp);
    free(v->eos);
    free(v);
}

int grammar_vocab_size(const grammar_vocab_t *v) { return v->n; }

const uint8_t *grammar_vocab_bytes(const grammar_vocab_t *v, int32_t id, size_t *len) {
    if (id < 0 || id >= v->n || !v->len[id]) {
        *len = 0;
        return NULL;
    }
    *len = v->len[id];
    return v->bytes + v->off[id];
}
