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

typedef struct vslot {
    uint32_t pos;
    int32_t parent;
    uint32_t gen;
} vslot_t;

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
    bool ambiguous;             /* a step needed more than MAX_STACKS stacks */
    bool hit;                   /* expand popped to SENTINEL (the classes of a stack top) */
    /* the (pos, parent) pairs one expansion has been at: a set stamped with a generation, so
     * that each path is followed once however many ways lead to it through nullable rules */
    vslot_t *vis;
    uint32_t vis_cap, vis_n, vis_gen;
    uint64_t spent;             /* pairs visited since the operation (a mask, an accept) began */
    struct { uint32_t pos; int32_t parent; } *work; /* expand()'s pending (pos, parent) pairs */
    int n_work, cap_work;
};

#define SENTINEL (-2)           /* below a stack top taken alone: "whatever lies further down" */
#define MAX_CACHE 512
/* the most stacks a state may hold; an ambiguous grammar ("a"?{2,31}?{2,31}...) can need
 * thousands, and its output is refused past this rather than slowing every step */
#define MAX_STACKS 256
/* the most (position, parent) pairs one expansion may visit: nested nullable repeats
 * ("a"{2,31}???{4,31}???...) can reach millions before any byte is read */
#define VISIT_MAX (1 << 16)
/* ... and one mask or accept in all its expansions: past it the grammar is refused as too
 * ambiguous (a real grammar's first mask over a 150k vocabulary visits far fewer) */
#define SPENT_MAX ((uint64_t)1 << 24)

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

/* a new expansion: forget the pairs visited */
static void visit_reset(grammar_matcher_t *m) {
    m->vis_n = 0;
    if (++m->vis_gen == 0) { /* wrapped: clear the stamps */
        if (m->vis) memset(m->vis, 0, sizeof *m->vis * m->vis_cap);
        m->vis_gen = 1;
    }
}

/* 1: (pos, parent) is new to this expansion (now marked), 0: visited, -1: out of memory,
 * -2: the expansion has visited VISIT_MAX pairs (a grammar ambiguous past any use) */
static int visit(grammar_matcher_t *m, uint32_t pos, int32_t parent) {
    if (m->vis_n >= VISIT_MAX || ++m->spent > SPENT_MAX) return -2;
    if ((m->vis_n + 1) * 2 > m->vis_cap) {
        uint32_t nc = m->vis_cap ? m->vis_cap * 2 : 256;
        vslot_t *nv = calloc(nc, sizeof *nv), *old = m->vis;
        if (!nv) return -1;
        uint32_t oc = m->vis_cap;
        m->vis = nv;
        m->vis_cap = nc;
        for (uint32_t i = 0; i < oc; i++) {
            vslot_t e = old[i];
            if (e.gen != m->vis_gen) continue;
            uint32_t h = hnode(e.pos, e.parent) & (nc - 1);
            while (m->vis[h].gen == m->vis_gen) h = (h + 1) & (nc - 1);
            m->vis[h] = e;
        }
        free(old);
    }
    uint32_t h = hnode(pos, parent) & (m->vis_cap - 1);
    while (m->vis[h].gen == m->vis_gen) {
        if (m->vis[h].pos == pos && m->vis[h].parent == parent) return 0;
        h = (h + 1) & (m->vis_cap - 1);
    }
    m->vis[h].pos = pos;
    m->vis[h].parent = parent;
    m->vis[h].gen = m->vis_gen;
    m->vis_n++;
    return 1;
}

static bool work_push(grammar_matcher_t *m, uint32_t pos, int32_t parent) {
    if (m->n_work == m->cap_work) {
        int nc = m->cap_work ? m->cap_work * 2 : 64;
        void *nw = realloc(m->work, sizeof *m->work * (size_t)nc);
        if (!nw) return false;
        m->work = nw;
        m->cap_work = nc;
    }
    m->work[m->n_work].pos = pos;
    m->work[m->n_work++].parent = parent;
    return true;
}

/* Put element pos on top of stack parent and expand until byte sets are on top: those
 * stacks go to the pool; reaching the bottom sets *accept. A work list, not recursion: rules
 * may nest as deep as a grammar makes them (x????...). */
static bool expand(grammar_matcher_t *m, uint32_t pos, int32_t parent, bool *accept) {
    const grammar_t *g = m->g;
    int base = m->n_work;
    for (;;) { /* follow (pos, parent); the other alternatives of a rule wait in the work list */
        gelem_t e = g->elems[pos];
        bool next = false; /* this path has ended: take the next waiting one */
        if (e.type == GE_BYTES) { /* ends the path at once, so a repeat is harmless: not recorded */
            int32_t id = intern(m, pos, parent);
            if (id < 0 || !pool_push(m, id)) return m->n_work = base, false;
            next = true;
        } else {
            int v = visit(m, pos, parent);
            if (v == -2) m->ambiguous = true;
            if (v < 0) return m->n_work = base, false;
            if (!v) {
                next = true; /* followed already */
            } else if (e.type == GE_END) {
                if (parent == SENTINEL) {
                    m->hit = true;
                    next = true;
                } else if (parent < 0) {
                    *accept = true;
                    next = true;
                } else {
                    pos = m->nodes[parent].pos;
                    parent = m->nodes[parent].parent;
                }
            } else {
                int32_t np = parent; /* the return address; none when the rule ends the alternative */
                if (g->elems[pos + 1].type != GE_END && (np = intern(m, pos + 1, parent)) < 0)
                    return m->n_work = base, false;
                int a0 = g->rule_alt0[e.arg], a1 = g->rule_alt0[e.arg + 1];
                for (int a = a1 - 1; a > a0; a--)
                    if (!work_push(m, (uint32_t)g->alt_start[a], np)) return m->n_work = base, false;
                pos = (uint32_t)g->alt_start[a0];
                parent = np;
            }
        }
        if (next) {
            if (m->n_work == base) return true;
            m->n_work--;
            pos = m->work[m->n_work].pos;
            parent = m->work[m->n_work].parent;
        }
    }
}

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* sort and deduplicate pool[off..n_pool) */
static void uniq(grammar_matcher_t *m, int off) {
    int n = m->n_pool - off;
    if (n < 2) return;
    int32_t *p = m->pool + off;
    if (n > 32) { /* an ambiguous grammar can hold many stacks at once */
        qsort(p, (size_t)n, sizeof *p, cmp_i32);
    } else {
        for (int i = 1; i < n; i++) { /* insertion sort: most states hold a few stacks */
            int32_t v = p[i];
            int j = i;
            while (j > 0 && p[j - 1] > v) { p[j] = p[j - 1]; j--; }
            p[j] = v;
        }
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
        visit_reset(m);
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
    visit_reset(m);
    for (int a = g->rule_alt0[g->root]; a < g->rule_alt0[g->root + 1]; a++)
        if (!expand(m, (uint32_t)g->alt_start[a], -1, &acc)) {
            if (!m->ambiguous) goto fail;
            m->n_pool = 0; /* too ambiguous to start: a matcher that accepts nothing */
            acc = false;
            break;
        }
    uniq(m, 0);
    m->accept = acc;
    m->cur = malloc(sizeof *m->cur * (size_t)(m->n_pool + 1));
    if (!m->cur) goto fail;
    if (m->n_pool) memcpy(m->cur, m->pool, sizeof *m->cur * (size_t)m->n_pool);
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
    free(m->vis);
    free(m->work);
    free(m);
}

bool grammar_matcher_accept_bytes(grammar_matcher_t *m, const uint8_t *b, size_t n) {
    if (m->ended) return n == 0;
    if (m->ambiguous) return false;
    m->spent = 0;
    int mark = m->n_nodes;
    m->n_pool = 0;
    for (int i = 0; i < m->n_cur; i++)
        if (!pool_push(m, m->cur[i])) return false;
    int off = 0, cnt = m->n_cur;
    bool acc = m->accept;
    for (size_t i = 0; i < n; i++) {
        int noff = m->n_pool, c = cnt ? advance(m, off, cnt, b[i], &acc) : 0;
        if (c > MAX_STACKS) m->ambiguous = true; /* too many parses at once: refused, not slow */
        if (c < 0 || (c == 0 && !acc) || (cnt == 0) || c > MAX_STACKS) {
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
    if (cnt) memcpy(m->cur, m->pool + off, sizeof *m->cur * (size_t)cnt);
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

bool grammar_matcher_too_ambiguous(const grammar_matcher_t *m) { return m->ambiguous; }

bool grammar_matcher_done(const grammar_matcher_t *m) { return m->ended || (m->accept && m->n_cur == 0); }

static void mask_eos(const grammar_matcher_t *m, const grammar_vocab_t *v, uint32_t *mask) {
    if (!m->accept || m->ended) return;
    for (int i = 0; i < v->n_eos; i++)
        if (v->eos[i] >= 0 && v->eos[i] < v->n) mask[v->eos[i] >> 5] |= 1u << (v->eos[i] & 31);
}

/* ---- the token classes of a stack top ---- */
/* the top MASK_K positions of stack s into key: their count, negative when more lie below */
static int stack_key(const grammar_matcher_t *m, int32_t s, uint32_t *key) {
    int d = 0;
    int32_t k = s;
    while (k >= 0 && d < MASK_K) {
        key[d++] = m->nodes[k].pos;
        k = m->nodes[k].parent;
    }
    return k >= 0 ? -d : d;
}

typedef struct walk {
    int *off, *cnt;
    bool *acc, *anyhit, *hitat;
} walk_t;

/* Classify every token from the stack top alone (top: its copy over SENTINEL, or over the
 * real bottom when the stack is no deeper): accepted whatever lies below (a bit in en->acc),
 * refused, or uncertain (a path reached below the top before the token's end). The walk
 * goes through the vocabulary sorted by bytes, as the plain mask would. */
static int classify(grammar_matcher_t *m, const grammar_vocab_t *v, int32_t top, mask_entry_t *en) {
    int depth = v->max_len + 2, cap_u = 0, rc = CS_OK;
    walk_t w = {malloc(sizeof(int) * (size_t)depth), malloc(sizeof(int) * (size_t)depth), calloc((size_t)depth, 1),
                calloc((size_t)depth, 1), calloc((size_t)depth, 1)};
    en->acc = calloc((size_t)(v->n + 31) / 32, sizeof(uint32_t));
    if (!w.off || !w.cnt || !w.acc || !w.anyhit || !w.hitat || !en->acc) { rc = CS_ENOMEM; goto out; }
    m->n_pool = 0;
    if (!pool_push(m, top)) { rc = CS_ENOMEM; goto out; }
    w.off[0] = 0;
    w.cnt[0] = 1;
    int valid = 0;
    for (int i = 0; i < v->n_sorted; i++) {
        int32_t t = v->sorted[i];
        const uint8_t *b = v->bytes + v->off[t];
        int len = (int)v->len[t], d = v->lcp[i] < valid ? v->lcp[i] : valid;
        m->n_pool = w.off[d] + w.cnt[d];
        while (d < len && w.cnt[d] > 0) {
            bool acc = false;
            m->hit = false;
            int noff = m->n_pool, c = advance(m, w.off[d], w.cnt[d], b[d], &acc);
            if (c < 0) { rc = CS_ENOMEM; goto out; }
            w.off[d + 1] = noff;
            w.cnt[d + 1] = c;
            w.acc[d + 1] = acc;
            w.hitat[d + 1] = m->hit;
            w.anyhit[d + 1] = w.anyhit[d] || m->hit;
            d++;
        }
        valid = d;
        int cls = d == len && (w.cnt[len] > 0 || w.hitat[len] || w.acc[len]) ? 1 : w.anyhit[d] ? 2 : 0;
        for (;;) {
            if (cls == 1) en->acc[t >> 5] |= 1u << (t & 31);
            else if (cls == 2) {
                if (en->n_uncertain == cap_u) {
                    cap_u = cap_u ? cap_u * 2 : 64;
                    int32_t *nu = realloc(en->uncertain, sizeof *nu * (size_t)cap_u);
                    if (!nu) { rc = CS_ENOMEM; goto out; }
                    en->uncertain = nu;
                }
                en->uncertain[en->n_uncertain++] = t;
            }
            /* a dead prefix: every longer token under it shares its class */
            if (d == len || i + 1 >= v->n_sorted || v->lcp[i + 1] < d) break;
            t = v->sorted[++i];
        }
    }
out:
    free(w.off);
    free(w.cnt);
    free(w.acc);
    free(w.anyhit);
    free(w.hitat);
    return rc;
}

static void drop_unions(grammar_t *g) {
    for (int i = 0; i < g->n_unions; i++) free(g->unions[i].acc);
    g->n_unions = 0;
}

/* the classes of stack s's top, from the grammar's cache or made now (under its lock) */
static const mask_entry_t *classes_of(grammar_matcher_t *m, const grammar_vocab_t *v, int32_t s) {
    grammar_t *g = (grammar_t *)m->g;
    mask_entry_t key = {.depth = 0};
    key.depth = stack_key(m, s, key.key);
    int n = key.depth < 0 ? -key.depth : key.depth;
    if (g->cache_vocab != v) { /* made for another vocabulary: start over */
        for (int i = 0; i < g->n_cache; i++) {
            free(g->cache[i].acc);
            free(g->cache[i].uncertain);
        }
        g->n_cache = 0;
        g->cache_vocab = v;
        drop_unions(g);
    }
    for (int i = 0; i < g->n_cache; i++)
        if (g->cache[i].depth == key.depth && !memcmp(g->cache[i].key, key.key, sizeof(uint32_t) * (size_t)n))
            return &g->cache[i];
    int32_t top = key.depth < 0 ? SENTINEL : -1; /* a copy of the top over SENTINEL */
    for (int i = n - 1; i >= 0 && top != -3; i--)
        if ((top = intern(m, key.key[i], top)) < 0) top = -3;
    if (top == -3 || classify(m, v, top, &key)) {
        free(key.acc);
        free(key.uncertain);
        return NULL;
    }
    if (g->n_cache == MAX_CACHE) { /* full: the oldest goes (and every union, whose indices move) */
        drop_unions(g);
        g->evictions++;
        free(g->cache[0].acc);
        free(g->cache[0].uncertain);
        memmove(g->cache, g->cache + 1, sizeof *g->cache * (size_t)(--g->n_cache));
    }
    if (g->n_cache == g->cap_cache) {
        int nc = g->cap_cache ? g->cap_cache * 2 : 16;
        mask_entry_t *ne = realloc(g->cache, sizeof *ne * (size_t)nc);
        if (!ne) {
            free(key.acc);
            free(key.uncertain);
            return NULL;
        }
        g->cache = ne;
        g->cap_cache = nc;
    }
    g->cache[g->n_cache] = key;
    return &g->cache[g->n_cache++];
}

/* token t's bytes from stack s alone */
static bool fits(grammar_matcher_t *m, const grammar_vocab_t *v, int32_t s, int32_t t) {
    m->n_pool = 0;
    if (!pool_push(m, s)) return false;
    int off = 0, cnt = 1;
    bool acc = false;
    for (uint32_t i = 0; i < v->len[t]; i++) {
        if (!cnt) return false;
        int noff = m->n_pool, c = advance(m, off, cnt, v->bytes[v->off[t] + i], &acc);
        if (c < 0 || (c == 0 && !acc)) return false;
        off = noff;
        cnt = c;
    }
    return true;
}

static int cmp_int(const void *a, const void *b) { return *(const int *)a - *(const int *)b; }

/* the accepted sets of entries idx[0..n) (sorted) ORed, from the grammar's unions when kept */
static const uint32_t *union_of(grammar_t *g, const int *idx, int n, int words) {
    for (int i = 0; i < g->n_unions; i++)
        if (g->unions[i].n == n && !memcmp(g->unions[i].entry, idx, sizeof(int) * (size_t)n)) {
            g->unions[i].used = ++g->union_clock;
            return g->unions[i].acc;
        }
    uint32_t *acc = malloc(sizeof *acc * (size_t)words);
    if (!acc) return NULL;
    memcpy(acc, g->cache[idx[0]].acc, sizeof *acc * (size_t)words);
    for (int k = 1; k < n; k++)
        for (int w = 0; w < words; w++) acc[w] |= g->cache[idx[k]].acc[w];
    if (!g->unions && !(g->unions = calloc(MASK_UNIONS, sizeof *g->unions))) {
        free(acc);
        return NULL;
    }
    int u = g->n_unions < MASK_UNIONS ? g->n_unions++ : 0;
    for (int i = 1; g->n_unions == MASK_UNIONS && i < MASK_UNIONS; i++)
        if (g->unions[i].used < g->unions[u].used) u = i;
    if (u < g->n_unions && g->unions[u].acc && g->n_unions == MASK_UNIONS) free(g->unions[u].acc);
    g->unions[u].n = n;
    memcpy(g->unions[u].entry, idx, sizeof(int) * (size_t)n);
    g->unions[u].acc = acc;
    g->unions[u].used = ++g->union_clock;
    return acc;
}

void grammar_matcher_mask(grammar_matcher_t *m, const grammar_vocab_t *v, uint32_t *mask) {
    int words = (v->n + 31) / 32;
    m->spent = 0;
    if (m->ambiguous) { /* refused: nothing may follow */
        memset(mask, 0, sizeof *mask * (size_t)words);
        return;
    }
    if (m->ended || !m->n_cur) {
        memset(mask, 0, sizeof *mask * (size_t)words);
        if (!m->ended) mask_eos(m, v, mask);
        return;
    }
    int mark = m->n_nodes;
    grammar_t *g = (grammar_t *)m->g;
    int idx[MASK_UNION_MAX], n = 0;
    bool whole = m->n_cur <= MASK_UNION_MAX;
    pthread_mutex_lock(&g->cache_mu);
    uint64_t ev = g->evictions;
    /* the entries first (making one may move the others), then their union */
    for (int k = 0; k < m->n_cur && whole; k++) {
        const mask_entry_t *en = classes_of(m, v, m->cur[k]);
        if (!en) { m->oom = true; whole = false; break; }
        idx[n++] = (int)(en - g->cache);
    }
    const uint32_t *acc = NULL;
    if (whole && g->evictions == ev) { /* (an eviction moved the indices: the slow way then) */
        for (int k = 0; k < n; k++) idx[k] = (int)(classes_of(m, v, m->cur[k]) - g->cache); /* after any growth */
        qsort(idx, (size_t)n, sizeof *idx, cmp_int);
        int u = 0;
        for (int k = 0; k < n; k++) /* two stacks with one top: one entry */
            if (!u || idx[u - 1] != idx[k]) idx[u++] = idx[k];
        acc = u == 1 ? g->cache[idx[0]].acc : union_of(g, idx, u, words);
    }
    if (acc) {
        memcpy(mask, acc, sizeof *mask * (size_t)words);
    } else { /* many stacks (or no memory for a union): OR them one by one */
        memset(mask, 0, sizeof *mask * (size_t)words);
        for (int k = 0; k < m->n_cur; k++) {
            const mask_entry_t *en = classes_of(m, v, m->cur[k]);
            if (!en) { m->oom = true; break; }
            for (int w = 0; w < words; w++) mask[w] |= en->acc[w];
        }
    }
    for (int k = 0; k < m->n_cur; k++) { /* the tokens that reach below a top: on the real stack */
        const mask_entry_t *en = classes_of(m, v, m->cur[k]);
        for (int i = 0; en && i < en->n_uncertain; i++) {
            int32_t t = en->uncertain[i];
            if (!(mask[t >> 5] >> (t & 31) & 1) && fits(m, v, m->cur[k], t)) mask[t >> 5] |= 1u << (t & 31);
        }
    }
    pthread_mutex_unlock(&g->cache_mu);
    rollback(m, mark);
    mask_eos(m, v, mask);
    if (m->ambiguous) memset(mask, 0, sizeof *mask * (size_t)words); /* it ran past SPENT_MAX */
}

void grammar_matcher_mask_ref(grammar_matcher_t *m, const grammar_vocab_t *v, uint32_t *mask) {
    memset(mask, 0, sizeof *mask * (size_t)((v->n + 31) / 32));
    m->spent = 0;
    if (m->ended || m->ambiguous) return;
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
    if (m->ambiguous) memset(mask, 0, sizeof *mask * (size_t)((v->n + 31) / 32)); /* past SPENT_MAX */
}
