/* matcher.c: a sequence's place in a compiled grammar, advanced a byte at a time over
 * hash-consed parse stacks (grammar_impl.h), and the token masks.
 *
 * The mask walks the vocabulary sorted by bytes (vocab.c): a token shares its first lcp
 * bytes with the one before, so the states of those bytes are kept and only the rest is
 * advanced; when a prefix leaves the grammar every token that starts with it is skipped.
 * The stacks made while walking are dropped afterwards (the node table rolls back: new nodes
 * always go to the head of their hash chain, so removing them newest first restores it). */
#include "text/grammar/grammar_impl.h"

#include <stdlib.h>
#include <string.h>


typedef struct gnode {
    uint32_t pos;               /* the element this stack matches next */
    int32_t parent;             /* the stack below (-1: none) */
    int32_t next;               /* hash chain */
} gnode_t;

struct grammar_matcher {
    const grammar_t *g;
    gnode_t *nodes;
    int n_nodes, cap_nodes;
    int32_t *bucket;
    uint32_t n_bucket;          /* a power of 2, at least n_nodes */
    int32_t *cur;               /* the state: stacks topped by a byte set, sorted */
    int n_cur, cap_cur;
    bool accept;                /* the input so far is a complete sentence */
    bool ended;                 /* an EOS was accepted */
    int32_t *pool;              /* states being computed (advance, the mask walk) */
    int n_pool, cap_pool;
    bool oom;
};

#define COMPACT_NODES (1 << 16)

static uint32_t hnode(uint32_t pos, int32_t parent) {
    uint64_t x = ((uint64_t)pos << 32 | (uint32_t)parent) * 0x9E3779B97F4A7C15ull;
    return (uint32_t)(x >> 32);
}

static bool rehash(grammar_matcher_t *m, uint32_t nb) {
    int32_t *b = malloc(sizeof *b * nb);
    if (!b) return false;
    memset(b, 0xff, sizeof *b * nb);
    for (int i = 0; i < m->n_nodes; i++) { /* in id order: a chain's head is its newest node */
        uint32_t h = hnode(m->nodes[i].pos, m->nodes[i].parent) & (nb - 1);
        m->nodes[i].next = b[h];
        b[h] = i;
    }
    free(m->bucket);
    m->bucket = b;
    m->n_bucket = nb;
    return true;
}

static int32_t intern(grammar_matcher_t *m, uint32_t pos, int32_t parent) {
    uint32_t h = hnode(pos, parent) & (m->n_bucket - 1);
    for (int32_t i = m->bucket[h]; i >= 0; i = m->nodes[i].next)
        if (m->nodes[i].pos == pos && m->nodes[i].parent == parent) return i;
    if (m->n_nodes == m->cap_nodes) {
        int nc = m->cap_nodes * 2;
        gnode_t *nn = realloc(m->nodes, sizeof *nn * (size_t)nc);
        if (!nn) return -1;
        m->nodes = nn;
        m->cap_nodes = nc;
    }
    if ((uint32_t)m->n_nodes >= m->n_bucket) {
        if (!rehash(m, m->n_bucket * 2)) return -1;
        h = hnode(pos, parent) & (m->n_bucket - 1);
    }
    m->nodes[m->n_nodes] = (gnode_t){pos, parent, m->bucket[h]};
    m->bucket[h] = m->n_nodes;
    return m->n_nodes++;
}

/* drop the nodes made since mark (newest first: each is its chain's head) */
static void rollback(grammar_matcher_t *m, int mark) {
    for (int i = m->n_nodes - 1; i >= mark; i--)
        m->bucket[hnode(m->nodes[i].pos, m->nodes[i].parent) & (m->n_bucket - 1)] = m->nodes[i].next;
    m->n_nodes = mark;
}

static bool pool_push(grammar_matcher_t *m, int32_t v) {
    if (m->n_pool == m->cap_pool) {
        int nc = m->cap_pool ? m->cap_pool * 2 : 256;
        int32_t *np = realloc(m->pool, sizeof *np * (size_t)nc);
        if (!np) return false;
        m->pool = np;
        m->cap_pool = nc;
    }
    m->pool[m->n_pool++] = v;
    return true;
}

/* Put element pos on top of stack parent and expand until byte sets are on top: those
 * stacks go to the pool; reaching the bottom sets *accept. */
static bool expand(grammar_matcher_t *m, uint32_t pos, int32_t parent, bool *accept) {
    const grammar_t *g = m->g;
    for (;;) {
        gelem_t e = g->elems[pos];
        if (e.type == GE_END) {
            if (parent < 0) {
                *accept = true;
                return true;
            }
            pos = m->nodes[parent].pos;
            parent = m->nodes[parent].parent;
            continue;
        }
        if (e.type == GE_BYTES) {
            int32_t id = intern(m, pos, parent);
            return id >= 0 && pool_push(m, id);
        }
        int32_t np = parent; /* the return address; none when the rule ends the alternative */
        if (g->elems[pos + 1].type != GE_END && (np = intern(m, pos + 1, parent)) < 0) return false;
        for (int a = g->rule_alt0[e.arg]; a < g->rule_alt0[e.arg + 1]; a++)
            if (!expand(m, (uint32_t)g->alt_start[a], np, accept)) return false;
        return true;
    }
}

/* sort and deduplicate pool[off..n_pool) */
static void uniq(grammar_matcher_t *m, int off) {
    int32_t *p = m->pool + off;
    int n = m->n_pool - off;
    for (int i = 1; i < n; i++) { /* insertion sort: states hold a few stacks */
        int32_t v = p[i];
        int j = i;
        while (j > 0 && p[j - 1] > v) { p[j] = p[j - 1]; j--; }
        p[j] = v;
    }
    int k = 0;
    for (int i = 0; i < n; i++)
        if (!k || p[k - 1] != p[i]) p[k++] = p[i];
    m->n_pool = off + k;
}

/* The state pool[off..off+n) advanced by byte b, appended to the pool: its size (-1: out of
 * memory), *accept whether it can end there. */
static int advance(grammar_matcher_t *m, int off, int n, uint8_t b, bool *accept) {
    const grammar_t *g = m->g;
    int out = m->n_pool;
    *accept = false;
    for (int i = 0; i < n; i++) {
        const gnode_t *s = &m->nodes[m->pool[off + i]];
        if (!gset_has(&g->sets[g->elems[s->pos].arg], b)) continue;
        if (!expand(m, s->pos + 1, s->parent, accept)) return -1;
    }
    uniq(m, out);
    return m->n_pool - out;
}

/* keep the nodes the state reaches (the table otherwise grows with the output) */
static void compact(grammar_matcher_t *m) {
    int32_t *map = malloc(sizeof *map * (size_t)m->n_nodes);
    if (!map) return;
    memset(map, 0xff, sizeof *map * (size_t)m->n_nodes);
    for (int i = 0; i < m->n_cur; i++)
        for (int32_t k = m->cur[i]; k >= 0 && map[k] == -1; k = m->nodes[k].parent) map[k] = 0;
    int n = 0;
    for (int i = 0; i < m->n_nodes; i++) /* parents precede their children: one pass renumbers */
        if (map[i] == 0) {
            gnode_t x = m->nodes[i];
            map[i] = n;
            m->nodes[n++] = (gnode_t){x.pos, x.parent < 0 ? -1 : map[x.parent], -1};
        }
    for (int i = 0; i < m->n_cur; i++) m->cur[i] = map[m->cur[i]];
    m->n_nodes = n;
    free(map);
    rehash(m, m->n_bucket); /* same size: cannot fail to fit */
}

grammar_matcher_t *grammar_matcher_new(const grammar_t *g) {
    grammar_matcher_t *m = calloc(1, sizeof *m);
    if (!m) return NULL;
    m->g = g;
    m->cap_nodes = 256;
    m->nodes = malloc(sizeof *m->nodes * (size_t)m->cap_nodes);
    if (!m->nodes || !rehash(m, 256)) goto fail;
    bool acc = false;
    for (int a = g->rule_alt0[g->root]; a < g->rule_alt0[g->root + 1]; a++)
        if (!expand(m, (uint32_t)g->alt_start[a], -1, &acc)) goto fail;
    uniq(m, 0);
    m->accept = acc;
    m->cur = malloc(sizeof *m->cur * (size_t)(m->n_pool + 1));
    if (!m->cur) goto fail;
    memcpy(m->cur, m->pool, sizeof *m->cur * (size_t)m->n_pool);
    m->n_cur = m->cap_cur = m->n_pool;
    return m;
fail:
    grammar_matcher_free(m);
    return NULL;
}

void grammar_matcher_free(grammar_matcher_t *m) {
    if (!m) return;
    free(m->nodes);
    free(m->bucket);
    free(m->cur);
    free(m->pool);
    free(m);
}

bool grammar_matcher_accept_bytes(grammar_matcher_t *m, const uint8_t *b, size_t n) {
    if (m->ended) return n == 0;
    int mark = m->n_nodes;
    m->n_pool = 0;
    for (int i = 0; i < m->n_cur; i++)
        if (!pool_push(m, m->cur[i])) return false;
    int off = 0, cnt = m->n_cur;
    bool acc = m->accept;
    for (size_t i = 0; i < n; i++) {
        int noff = m->n_pool, c = cnt ? advance(m, off, cnt, b[i], &acc) : 0;
        if (c < 0 || (c == 0 && !acc) || (cnt == 0)) {
            rollback(m, mark);
            return false;
        }
        off = noff;
        cnt = c;
    }
    if (cnt > m->cap_cur) {
        int32_t *nc = realloc(m->cur, sizeof *nc * (size_t)cnt);
        if (!nc) {
            rollback(m, mark);
            return false;
        }
        m->cur = nc;
        m->cap_cur = cnt;
    }
    memcpy(m->cur, m->pool + off, sizeof *m->cur * (size_t)cnt);
    m->n_cur = cnt;
    m->accept = acc;
    if (m->n_nodes > COMPACT_NODES) compact(m);
    return true;
}

static bool is_eos(const grammar_vocab_t *v, int32_t id) {
    for (int i = 0; i < v->n_eos; i++)
        if (v->eos[i] == id) return true;
    return false;
}

bool grammar_matcher_accept_token(grammar_matcher_t *m, const grammar_vocab_t *v, int32_t id) {
    if (m->ended || id < 0 || id >= v->n) return false;
    if (is_eos(v, id)) {
        if (!m->accept) return false;
        m->ended = true;
        m->n_cur = 0;
        return true;
    }
    if (v->len[id] == 0) return false; /* special, or no bytes */
    return grammar_matcher_accept_bytes(m, v->bytes + v->off[id], v->len[id]);
}

bool grammar_matcher_can_end(const grammar_matcher_t *m) { return m->accept && !m->ended; }

bool grammar_matcher_done(const grammar_matcher_t *m) { return m->ended || (m->accept && m->n_cur == 0); }

static void mask_eos(const grammar_matcher_t *m, const grammar_vocab_t *v, uint32_t *mask) {
    if (!m->accept || m->ended) return;
    for (int i = 0; i < v->n_eos; i++)
        if (v->eos[i] >= 0 && v->eos[i] < v->n) mask[v->eos[i] >> 5] |= 1u << (v->eos[i] & 31);
}

void grammar_matcher_mask(grammar_matcher_t *m, const grammar_vocab_t *v, uint32_t *mask) {
    memset(mask, 0, sizeof *mask * (size_t)((v->n + 31) / 32));
    if (m->ended) return;
    int mark = m->n_nodes;
    int depth = v->max_len + 1;
    int *st_off = malloc(sizeof(int) * 2 * (size_t)depth);
    if (!st_off) { m->oom = true; return; }
    int *st_cnt = st_off + depth;
    m->n_pool = 0;
    for (int i = 0; i < m->n_cur; i++)
        if (!pool_push(m, m->cur[i])) { m->oom = true; goto out; }
    st_off[0] = 0;
    st_cnt[0] = m->n_cur;
    int valid = 0;
    for (int i = 0; i < v->n_sorted; i++) {
        int32_t t = v->sorted[i];
        const uint8_t *b = v->bytes + v->off[t];
        int len = (int)v->len[t], d = v->lcp[i] < valid ? v->lcp[i] : valid;
        m->n_pool = st_off[d] + st_cnt[d];
        bool ok = true;
        while (d < len) {
            bool acc = false;
            int noff = m->n_pool, c = st_cnt[d] ? advance(m, st_off[d], st_cnt[d], b[d], &acc) : 0;
            if (c < 0) { m->oom = true; goto out; }
            if (c == 0 && !acc) { /* this prefix leaves the grammar (or the grammar ended before it) */
                ok = false;
                break;
            }
            st_off[d + 1] = noff;
            st_cnt[d + 1] = c;
            d++;
        }
        if (ok) {
            mask[t >> 5] |= 1u << (t & 31);
        } else if (d < len) {
            while (i + 1 < v->n_sorted && v->lcp[i + 1] > d) i++; /* they all start with the bad prefix */
        }
        valid = d;
    }
    mask_eos(m, v, mask);
out:
    free(st_off);
    rollback(m, mark);
}

void grammar_matcher_mask_ref(grammar_matcher_t *m, const grammar_vocab_t *v, uint32_t *mask) {
    memset(mask, 0, sizeof *mask * (size_t)((v->n + 31) / 32));
    if (m->ended) return;
    for (int32_t t = 0; t < v->n; t++) {
        if (v->len[t] == 0) continue;
        int mark = m->n_nodes;
        m->n_pool = 0;
        bool ok = true, acc = m->accept;
        for (int i = 0; i < m->n_cur && ok; i++) ok = pool_push(m, m->cur[i]);
        int off = 0, cnt = m->n_cur;
        for (uint32_t i = 0; i < v->len[t] && ok; i++) {
            int noff = m->n_pool, c = cnt ? advance(m, off, cnt, v->bytes[v->off[t] + i], &acc) : 0;
            ok = c > 0 || (c == 0 && cnt && acc);
            off = noff;
            cnt = c;
        }
        if (ok) mask[t >> 5] |= 1u << (t & 31);
        rollback(m, mark);
    }
    mask_eos(m, v, mask);
}
