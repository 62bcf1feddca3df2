/* grammar_impl.h: what the files of text/grammar/ share.
 *
 * A compiled grammar is a flat array of elements. Rule r has n alternatives; alternative a
 * is the elements from alt_start[a] up to an END. An element is a byte set (the next byte
 * must be in it) or a reference to a rule. Characters are compiled to bytes: a class of code
 * points becomes a rule whose alternatives are the UTF-8 byte-range sequences covering it,
 * so a token may stop anywhere inside a character.
 *
 * A parse stack is a persistent list of positions, hash-consed in the matcher's node table:
 * node (pos, parent) says "match elements[pos..] of this alternative, then go on at parent".
 * A state is the set of stacks whose top is a byte set, plus whether the input so far can
 * end here. Advancing a byte keeps the stacks whose top set holds it, moves past it and
 * expands (a rule reference pushes each of its alternatives; an END pops). */
#ifndef CS_GRAMMAR_IMPL_H
#define CS_GRAMMAR_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "text/grammar/grammar.h"

enum { GE_END = 0, GE_BYTES, GE_RULE };

typedef struct gelem {
    uint32_t type;
    uint32_t arg;       /* GE_BYTES: a byte set; GE_RULE: a rule */
} gelem_t;

typedef struct gset {
    uint32_t w[8];      /* bit b: byte b */
} gset_t;

static inline bool gset_has(const gset_t *s, uint8_t b) { return (s->w[b >> 5] >> (b & 31)) & 1u; }

/* The token classes of one stack top (matcher.c): the top MASK_K positions of a stack (and
 * whether more lie below) decide, for most tokens, whether the token fits there whatever the
 * stack holds further down: accepted (a bit in acc) or refused (no bit); the others reach
 * below the top and are checked against the real stack each time (uncertain). */
#define MASK_K 4

#define MASK_UNION_MAX 16       /* stack tops of a state whose union is kept */
#define MASK_UNIONS 64

typedef struct mask_union {
    int n;
    int entry[MASK_UNION_MAX];  /* sorted cache indices */
    uint32_t *acc;
    uint64_t used;
} mask_union_t;

typedef struct mask_entry {
    uint32_t key[MASK_K];
    int depth;                  /* positions in key; -depth when the stack is deeper */
    uint32_t *acc;              /* [(vocab + 31) / 32] */
    int32_t *uncertain;
    int n_uncertain;
} mask_entry_t;

struct grammar {
    atomic_int refs;
    pthread_mutex_t cache_mu;   /* the token classes, made as stack tops are met */
    const struct grammar_vocab *cache_vocab;
    mask_entry_t *cache;
    int n_cache, cap_cache;
    /* the union of the accepted sets of a state's stack tops (a state of several stacks recurs:
     * inside a number, after a value), by their cache entries; emptied when an entry goes */
    struct mask_union *unions;
    int n_unions;
    uint64_t union_clock;
    uint64_t evictions;         /* entries dropped for room so far (their indices moved) */
    gelem_t *elems;
    int n_elems;
    int *alt_start;     /* [n_alts] */
    int *rule_alt0;     /* [n_rules + 1]: rule r's alternatives are alt_start[rule_alt0[r] .. rule_alt0[r+1]) */
    int n_rules, n_alts;
    gset_t *sets;
    int n_sets;
    int root;
};

struct grammar_vocab {
    int n;                      /* vocabulary size */
    uint8_t *bytes;             /* every token's bytes */
    uint32_t *off, *len;        /* [n]; len 0: never allowed (special, or no bytes) */
    int32_t *sorted;            /* the tokens with bytes, sorted by them */
    uint16_t *lcp;              /* [n_sorted]: bytes shared with the one before */
    int n_sorted, max_len;
    int32_t *eos;
    int n_eos;
};

#endif
