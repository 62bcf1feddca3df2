/* tokenizer.c: Hugging Face tokenizer.json BPE tokenizers (byte-level like Llama 3 / Qwen /
 * GPT-2, and SentencePiece-style with byte fallback like Llama 2 / Mistral). Each stage of
 * the `tokenizers` library (added-token split, normalizers, pre-tokenizers, BPE merges,
 * post-processors, decoders) is mirrored step by step so ids and text match it byte for
 * byte; a component a file names that is not implemented here is refused at load.
 * Also the incremental detokenizer used for streaming. */
#include "text/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <jansson.h>
#include <pcre2.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

/* ======================================================================================
 * Growable buffers
 * ==================================================================================== */

static int tok_oom(void) { return cs_error_set(CS_ENOMEM, "tokenizer: out of memory"); }

/* Byte string (base/common.h); the tokenizer's adds report CS_ENOMEM. */
typedef cs_buf_t sbuf;

static int sbuf_put(sbuf *b, const void *s, size_t n) { return cs_buf_add(b, s, n) ? CS_OK : tok_oom(); }

static int utf8_encode(int32_t c, char *o) {
    if (c < 0x80) { o[0] = (char)c; return 1; }
    if (c < 0x800) { o[0] = (char)(0xC0 | (c >> 6)); o[1] = (char)(0x80 | (c & 0x3F)); return 2; }
    if (c < 0x10000) {
        o[0] = (char)(0xE0 | (c >> 12));
        o[1] = (char)(0x80 | ((c >> 6) & 0x3F));
        o[2] = (char)(0x80 | (c & 0x3F));
        return 3;
    }
    o[0] = (char)(0xF0 | (c >> 18));
    o[1] = (char)(0x80 | ((c >> 12) & 0x3F));
    o[2] = (char)(0x80 | ((c >> 6) & 0x3F));
    o[3] = (char)(0x80 | (c & 0x3F));
    return 4;
}

static int sbuf_put_cp(sbuf *b, int32_t c) {
    char tmp[4];
    return sbuf_put(b, tmp, (size_t)utf8_encode(c, tmp));
}

/* Typed vectors share one grow routine. */
static int vec_grow(void **p, size_t *cap, size_t elem, size_t need) {
    if (need <= *cap) return CS_OK;
    size_t c = *cap ? *cap : 8;
    while (c < need) c *= 2;
    void *np = realloc(*p, c * elem);
    if (!np) return tok_oom();
    *p = np;
    *cap = c;
    return CS_OK;
}
#define VEC_RESERVE(v, need) vec_grow((void **)&(v)->p, &(v)->cap, sizeof *(v)->p, (need))
#define VEC_PUSH(v, x) \
    (VEC_RESERVE((v), (v)->n + 1) < 0 ? CS_ENOMEM : ((v)->p[(v)->n++] = (x), CS_OK))

typedef struct { int32_t *p; size_t n, cap; } i32vec;

/* A list of strings stored back to back in one buffer (decoder token lists). */
typedef struct strvec {
    sbuf buf;
    size_t *off, *len;
    size_t n, cap;
} strvec;

static int strvec_add(strvec *v, const char *s, size_t n) {
    if (v->n == v->cap) {
        size_t c = v->cap ? v->cap * 2 : 16;
        size_t *o = realloc(v->off, c * sizeof *o);
        if (!o) return tok_oom();
        v->off = o;
        size_t *l = realloc(v->len, c * sizeof *l);
        if (!l) return tok_oom();
        v->len = l;
        v->cap = c;
    }
    v->off[v->n] = v->buf.len;
    v->len[v->n] = n;
    if (sbuf_put(&v->buf, s, n) < 0) return CS_ENOMEM;
    v->n++;
    return CS_OK;
}
/* Start a new element and then append to it with sbuf_put(&v->buf, ...), closing with
 * strvec_close. */
static int strvec_open(strvec *v) { return strvec_add(v, "", 0); }
static void strvec_close(strvec *v) { v->len[v->n - 1] = v->buf.len - v->off[v->n - 1]; }
static const char *strvec_at(const strvec *v, size_t i) { return v->buf.p + v->off[i]; }
static void strvec_reset(strvec *v) {
    v->n = 0;
    v->buf.len = 0;
}
static void strvec_free(strvec *v) {
    cs_buf_free(&v->buf);
    free(v->off);
    free(v->len);
    memset(v, 0, sizeof *v);
}

/* ======================================================================================
 * UTF-8 and Unicode helpers
 * ==================================================================================== */

/* Decode one code point from valid UTF-8. */
static int32_t utf8_cp(const char *s, size_t n, size_t *len) {
    int32_t cp = 0xFFFD;
    size_t k = cs_utf8_next(s, n, &cp, NULL);
    *len = k ? k : 1;
    return cp;
}

/* String::from_utf8_lossy. */
static int utf8_lossy_append(sbuf *out, const char *s, size_t n) {
    size_t i = 0, run = 0;
    int32_t cp;
    while (i < n) {
        size_t bad = 1;
        size_t k = cs_utf8_next(s + i, n - i, &cp, &bad);
        if (k) { i += k; continue; }
        if (sbuf_put(out, s + run, i - run) < 0 || sbuf_put(out, "\xEF\xBF\xBD", 3) < 0)
            return CS_ENOMEM;
        i += bad;
        run = i;
    }
    return n > run ? sbuf_put(out, s + run, n - run) : CS_OK; /* (s may be NULL when n is 0) */
}

/* The tokenizers library takes its Unicode data from several places, each of its own
 * Unicode version: Oniguruma (regex \p{L}, \p{N}: Unicode 16), Rust's std (is_numeric,
 * to_lowercase, is_whitespace: Unicode 16/17), unicode_categories (Punctuation: older) and
 * unicode-normalization-alignments (normalization, StripAccents: Unicode 9). utf8proc 2.8 is
 * Unicode 15 and PCRE2 10.42 Unicode 14. The tables below are the differences, found by
 * probing tokenizers 0.23 on every code point (tests/test_ref_tokenizer.py checks them all). */
#define ONIG_EXTRA_L "\\x{1C89}-\\x{1C8A}\\x{A7CB}-\\x{A7CD}\\x{A7DA}-\\x{A7DC}\\x{105C0}-\\x{105F3}\\x{10D4A}-\\x{10D65}\\x{10D6F}-\\x{10D85}\\x{10EC2}-\\x{10EC4}\\x{1123F}-\\x{11240}\\x{11380}-\\x{11389}\\x{1138B}\\x{1138E}\\x{11390}-\\x{113B5}\\x{113B7}\\x{113D1}\\x{113D3}\\x{11BC0}-\\x{11BE0}\\x{11F02}\\x{11F04}-\\x{11F10}\\x{11F12}-\\x{11F33}\\x{1342F}\\x{13441}-\\x{13446}\\x{13460}-\\x{143FA}\\x{16100}-\\x{1611D}\\x{16D40}-\\x{16D6C}\\x{18CFF}\\x{1B132}\\x{1B155}\\x{1DF25}-\\x{1DF2A}\\x{1E030}-\\x{1E06D}\\x{1E4D0}-\\x{1E4EB}\\x{1E5D0}-\\x{1E5ED}\\x{1E5F0}\\x{2B739}\\x{2EBF0}-\\x{2EE5D}\\x{31350}-\\x{323AF}"
#define ONIG_EXTRA_N "\\x{10D40}-\\x{10D49}\\x{116D0}-\\x{116E3}\\x{11BF0}-\\x{11BF9}\\x{11F50}-\\x{11F59}\\x{16130}-\\x{16139}\\x{16D70}-\\x{16D79}\\x{1CCF0}-\\x{1CCF9}\\x{1D2C0}-\\x{1D2D3}\\x{1E4F0}-\\x{1E4F9}\\x{1E5F1}-\\x{1E5FA}"
static const int32_t RUST_NUMERIC_EXTRA[][2] = {
    {0x10D40, 0x10D49}, {0x116D0, 0x116E3}, {0x11BF0, 0x11BF9}, {0x11DE0, 0x11DE9}, {0x16130, 0x16139},
    {0x16D70, 0x16D79}, {0x16FF4, 0x16FF6}, {0x1CCF0, 0x1CCF9}, {0x1E5F1, 0x1E5FA},
};
static const int32_t REF_PUNCT_EXTRA[][2] = {
    {0x166D, 0x166D}, {0x111C9, 0x111C9},
};
static const int32_t REF_PUNCT_MISSING[][2] = {
    {0x61D, 0x61D}, {0x9FD, 0x9FD}, {0xA76, 0xA76}, {0xC77, 0xC77}, {0xC84, 0xC84},
    {0x1B7D, 0x1B7E}, {0x2E43, 0x2E4F}, {0x2E52, 0x2E5D}, {0x10EAD, 0x10EAD}, {0x10F55, 0x10F59},
    {0x10F86, 0x10F89}, {0x1144B, 0x1144F}, {0x1145A, 0x1145B}, {0x1145D, 0x1145D}, {0x11660, 0x1166C},
    {0x116B9, 0x116B9}, {0x1183B, 0x1183B}, {0x11944, 0x11946}, {0x119E2, 0x119E2}, {0x11A3F, 0x11A46},
    {0x11A9A, 0x11A9C}, {0x11A9E, 0x11AA2}, {0x11B00, 0x11B09}, {0x11C41, 0x11C45}, {0x11C70, 0x11C71},
    {0x11EF7, 0x11EF8}, {0x11F43, 0x11F4F}, {0x11FFF, 0x11FFF}, {0x12FF1, 0x12FF2}, {0x16E97, 0x16E9A},
    {0x16FE2, 0x16FE2}, {0x1E95E, 0x1E95F},
};
static const int32_t REF_MARK_EXTRA[][2] = {
    {0x1CF2, 0x1CF3},
};
static const int32_t REF_MARK_MISSING[][2] = {
    {0x7FD, 0x7FD}, {0x898, 0x89F}, {0x8CA, 0x8D3}, {0x9FE, 0x9FE}, {0xAFA, 0xAFF},
    {0xB55, 0xB55}, {0xC04, 0xC04}, {0xC3C, 0xC3C}, {0xCF3, 0xCF3}, {0xD00, 0xD00},
    {0xD3B, 0xD3C}, {0xD81, 0xD81}, {0xEBA, 0xEBA}, {0xECE, 0xECE}, {0x1715, 0x1715},
    {0x180F, 0x180F}, {0x1ABF, 0x1ACE}, {0x1CF7, 0x1CF7}, {0x1DF6, 0x1DFA}, {0xA82C, 0xA82C},
    {0xA8FF, 0xA8FF}, {0x10D24, 0x10D27}, {0x10EAB, 0x10EAC}, {0x10EFD, 0x10EFF}, {0x10F46, 0x10F50},
    {0x10F82, 0x10F85}, {0x11070, 0x11070}, {0x11073, 0x11074}, {0x110C2, 0x110C2}, {0x11145, 0x11146},
    {0x111C9, 0x111C9}, {0x111CE, 0x111CF}, {0x11241, 0x11241}, {0x1133B, 0x1133B}, {0x1145E, 0x1145E},
    {0x1182C, 0x1183A}, {0x11930, 0x11935}, {0x11937, 0x11938}, {0x1193B, 0x1193E}, {0x11940, 0x11940},
    {0x11942, 0x11943}, {0x119D1, 0x119D7}, {0x119DA, 0x119E0}, {0x119E4, 0x119E4}, {0x11A01, 0x11A0A},
    {0x11A33, 0x11A39}, {0x11A3B, 0x11A3E}, {0x11A47, 0x11A47}, {0x11A51, 0x11A5B}, {0x11A8A, 0x11A99},
    {0x11D31, 0x11D36}, {0x11D3A, 0x11D3A}, {0x11D3C, 0x11D3D}, {0x11D3F, 0x11D45}, {0x11D47, 0x11D47},
    {0x11D8A, 0x11D8E}, {0x11D90, 0x11D91}, {0x11D93, 0x11D97}, {0x11EF3, 0x11EF6}, {0x11F00, 0x11F01},
    {0x11F03, 0x11F03}, {0x11F34, 0x11F3A}, {0x11F3E, 0x11F42}, {0x13440, 0x13440}, {0x13447, 0x13455},
    {0x16F4F, 0x16F4F}, {0x16F7F, 0x16F87}, {0x16FE4, 0x16FE4}, {0x16FF0, 0x16FF1}, {0x1CF00, 0x1CF2D},
    {0x1CF30, 0x1CF46}, {0x1E08F, 0x1E08F}, {0x1E130, 0x1E136}, {0x1E2AE, 0x1E2AE}, {0x1E2EC, 0x1E2EF},
    {0x1E4EC, 0x1E4EF},
};
/* Rust's char::to_lowercase where utf8proc's simple mapping differs (cased letters of
 * Unicode 16 and 17): ranges [first, last] mapped by +delta, or to one code point. */
static const int32_t RUST_LOWER_EXTRA[][3] = {
    {0x1C89, 0x1C89, 1}, {0xA7CC, 0xA7CC, 1}, {0xA7CE, 0xA7CE, 1}, {0xA7D2, 0xA7D2, 1},
    {0xA7D4, 0xA7D4, 1}, {0xA7DA, 0xA7DA, 1}, {0x10D50, 0x10D65, 0x20}, {0x16EA0, 0x16EB8, 0x1B},
};

static bool in_ranges(const int32_t (*r)[2], size_t n, int32_t c) {
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (c < r[mid][0]) hi = mid;
        else if (c > r[mid][1]) lo = mid + 1;
        else return true;
    }
    return false;
}
#define IN_TABLE(t, c) in_ranges((t), CS_ARRAY_LEN(t), (c))

/* Rust char::is_whitespace / the Unicode White_Space property. */
static bool uni_is_space(int32_t c) {
    return (c >= 9 && c <= 13) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
           c == 0x205F || c == 0x3000;
}

static int uni_cat(int32_t c) { return (int)utf8proc_category(c); }

/* Rust char::is_numeric: Nd, Nl, No. */
static bool uni_is_numeric(int32_t c) {
    int k = uni_cat(c);
    return k == UTF8PROC_CATEGORY_ND || k == UTF8PROC_CATEGORY_NL || k == UTF8PROC_CATEGORY_NO ||
           IN_TABLE(RUST_NUMERIC_EXTRA, c);
}

/* is_ascii_punctuation || general category P*. */
static bool uni_is_punct(int32_t c) {
    if (c < 0x80) return (c >= 0x21 && c <= 0x2F) || (c >= 0x3A && c <= 0x40) ||
                         (c >= 0x5B && c <= 0x60) || (c >= 0x7B && c <= 0x7E);
    int k = uni_cat(c);
    if (k >= UTF8PROC_CATEGORY_PC && k <= UTF8PROC_CATEGORY_PO) return !IN_TABLE(REF_PUNCT_MISSING, c);
    return IN_TABLE(REF_PUNCT_EXTRA, c);
}

/* The regex crate's Unicode \w: Alphabetic, M, Nd, Pc, Join_Control (Alphabetic is
 * approximated by L, Nl and the circled letters). */
static bool uni_is_word(int32_t c) {
    int k = uni_cat(c);
    if (k >= UTF8PROC_CATEGORY_LU && k <= UTF8PROC_CATEGORY_ME) return true; /* L*, M* */
    if (k == UTF8PROC_CATEGORY_ND || k == UTF8PROC_CATEGORY_NL || k == UTF8PROC_CATEGORY_PC)
        return true;
    return c == 0x200C || c == 0x200D || (c >= 0x24B6 && c <= 0x24E9) ||
           (c >= 0x1F130 && c <= 0x1F149) || (c >= 0x1F150 && c <= 0x1F169) ||
           (c >= 0x1F170 && c <= 0x1F189);
}

/* General category M as StripAccents sees it (Unicode 9). */
static bool uni_is_mark(int32_t c) {
    int k = uni_cat(c);
    if (k == UTF8PROC_CATEGORY_MN || k == UTF8PROC_CATEGORY_MC || k == UTF8PROC_CATEGORY_ME)
        return !IN_TABLE(REF_MARK_MISSING, c);
    return IN_TABLE(REF_MARK_EXTRA, c);
}

static int32_t uni_tolower(int32_t c) {
    for (size_t i = 0; i < CS_ARRAY_LEN(RUST_LOWER_EXTRA); i++)
        if (c >= RUST_LOWER_EXTRA[i][0] && c <= RUST_LOWER_EXTRA[i][1]) return c + RUST_LOWER_EXTRA[i][2];
    if (c == 0xA7CB) return 0x264;
    if (c == 0xA7DC) return 0x19B;
    return utf8proc_tolower(c);
}

/* GPT-2 byte <-> unicode table (tokenizers' bytes_char). */
static int32_t g_byte_to_cp[256];
static int16_t g_cp_to_byte[324];
static pthread_once_t g_bytes_once = PTHREAD_ONCE_INIT;

static void bytes_table_init(void) {
    bool direct[256] = {false};
    for (int b = '!'; b <= '~'; b++) direct[b] = true;
    for (int b = 0xA1; b <= 0xAC; b++) direct[b] = true;
    for (int b = 0xAE; b <= 0xFF; b++) direct[b] = true;
    int n = 0;
    for (int i = 0; i < 324; i++) g_cp_to_byte[i] = -1;
    for (int b = 0; b < 256; b++) {
        g_byte_to_cp[b] = direct[b] ? b : 256 + n++;
        g_cp_to_byte[g_byte_to_cp[b]] = (int16_t)b;
    }
}

/* ======================================================================================
 * Hash maps: string -> id (vocab, added tokens), pair -> merge, word -> ids (cache)
 * ==================================================================================== */

static uint64_t hash_bytes(const void *p, size_t n) {
    const uint8_t *s = p;
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0xC2B2AE3D27D4EB4Full);
    while (n >= 8) {
        uint64_t k;
        memcpy(&k, s, 8);
        h = (h ^ k) * 0xFF51AFD7ED558CCDull;
        h ^= h >> 32;
        s += 8;
        n -= 8;
    }
    uint64_t k = 0;
    memcpy(&k, s, n);
    h = (h ^ k) * 0xC4CEB9FE1A85EC53ull;
    h ^= h >> 29;
    h *= 0xFF51AFD7ED558CCDull;
    h ^= h >> 32;
    return h;
}

typedef struct { const char *key; uint32_t len; int32_t val; } strmap_ent;
typedef struct { strmap_ent *e; size_t cap, n; } strmap; /* keys are not owned */

static int strmap_put(strmap *m, const char *key, size_t len, int32_t val);

static int strmap_grow(strmap *m) {
    size_t cap = m->cap ? m->cap * 2 : 64;
    strmap_ent *old = m->e;
    size_t oldcap = m->cap;
    m->e = calloc(cap, sizeof *m->e);
    if (!m->e) { m->e = old; return tok_oom(); }
    m->cap = cap;
    m->n = 0;
    for (size_t i = 0; i < oldcap; i++)
        if (old[i].key) strmap_put(m, old[i].key, old[i].len, old[i].val);
    free(old);
    return CS_OK;
}

/* Inserts or overwrites. */
static int strmap_put(strmap *m, const char *key, size_t len, int32_t val) {
    if ((m->n + 1) * 2 > m->cap && strmap_grow(m) < 0) return CS_ENOMEM;
    size_t mask = m->cap - 1, i = hash_bytes(key, len) & mask;
    while (m->e[i].key) {
        if (m->e[i].len == len && memcmp(m->e[i].key, key, len) == 0) {
            m->e[i].val = val;
            return CS_OK;
        }
        i = (i + 1) & mask;
    }
    m->e[i] = (strmap_ent){key, (uint32_t)len, val};
    m->n++;
    return CS_OK;
}

static int32_t strmap_get(const strmap *m, const char *key, size_t len) {
    if (!m->cap) return -1;
    size_t mask = m->cap - 1, i = hash_bytes(key, len) & mask;
    while (m->e[i].key) {
        if (m->e[i].len == len && memcmp(m->e[i].key, key, len) == 0) return m->e[i].val;
        i = (i + 1) & mask;
    }
    return -1;
}

/* (left id, right id) -> (rank, merged id) */
typedef struct { uint64_t key; uint32_t rank; int32_t new_id; } pair_ent;
typedef struct { pair_ent *e; size_t cap, n; } pairmap;
#define PAIR_EMPTY UINT64_MAX

static uint64_t pair_key(int32_t a, int32_t b) { return ((uint64_t)(uint32_t)a << 32) | (uint32_t)b; }
static size_t pair_hash(uint64_t k) {
    k ^= k >> 33;
    k *= 0xFF51AFD7ED558CCDull;
    k ^= k >> 33;
    return (size_t)k;
}

static int pairmap_init(pairmap *m, size_t expect) {
    size_t cap = 64;
    while (cap < expect * 2) cap *= 2;
    m->e = malloc(cap * sizeof *m->e);
    if (!m->e) return tok_oom();
    for (size_t i = 0; i < cap; i++) m->e[i].key = PAIR_EMPTY;
    m->cap = cap;
    m->n = 0;
    return CS_OK;
}

/* Later merges overwrite earlier ones for the same pair, as collecting into a HashMap does. */
static void pairmap_put(pairmap *m, uint64_t key, uint32_t rank, int32_t new_id) {
    size_t mask = m->cap - 1, i = pair_hash(key) & mask;
    while (m->e[i].key != PAIR_EMPTY && m->e[i].key != key) i = (i + 1) & mask;
    if (m->e[i].key == PAIR_EMPTY) m->n++;
    m->e[i] = (pair_ent){key, rank, new_id};
}

static const pair_ent *pairmap_get(const pairmap *m, int32_t a, int32_t b) {
    if (!m->cap) return NULL;
    uint64_t key = pair_key(a, b);
    size_t mask = m->cap - 1, i = pair_hash(key) & mask;
    while (m->e[i].key != PAIR_EMPTY) {
        if (m->e[i].key == key) return &m->e[i];
        i = (i + 1) & mask;
    }
    return NULL;
}

/* Word cache: pre-token string -> ids. Bounded; emptied when full. Guarded by a mutex
 * because encode takes a const tokenizer and may run on several threads. */
#define CACHE_CAP 32768 /* slots; at most half are used */
#define CACHE_MAX_WORD 256
typedef struct { char *key; uint32_t len, n_ids; int32_t *ids; } cache_ent;

/* ======================================================================================
 * Regex (PCRE2) and literal patterns
 * ==================================================================================== */

typedef struct tok_regex {
    pcre2_code *code;  /* NULL for a literal pattern */
    char *lit;         /* literal (Split/Replace with a String pattern) */
    size_t lit_len;
} tok_regex;

typedef struct { size_t s, e; bool m; } mspan; /* [s,e), m = is a match */
typedef struct { mspan *p; size_t n, cap; } mspanvec;

/* Per-call scratch shared by the stages of one encode or decode. */
typedef struct scratch {
    pcre2_match_data *md;
    mspanvec ms, ms2;
    bool raw_bytes;     /* decode: bytes as they are, not made valid UTF-8 (tokenizer_token_bytes) */
} scratch;

/* White_Space as an explicit class: Oniguruma's \s (PCRE2's also has U+180E). */
#define ONIG_SPACE_CLASS "\\t\\n\\x{0B}\\f\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}" \
                         "\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}"
#define ONIG_WORD_CLASS "\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\x{200C}\\x{200D}" ONIG_EXTRA_L

/* Rewrite an Oniguruma (Ruby syntax) pattern for PCRE2 where the two disagree: \s, \w and
 * \h. */
static char *regex_translate(const char *pat) {
    sbuf o = {0};
    bool in_class = false;
    size_t n = strlen(pat);
    for (size_t i = 0; i < n; i++) {
        char c = pat[i];
        int rc = 0;
        if (c == '\\' && i + 1 < n && (pat[i + 1] == 'p' || pat[i + 1] == 'P')) {
            /* \p{L} / \p{N} (or \pL / \pN) get the letters and numbers Oniguruma knows */
            bool neg = pat[i + 1] == 'P';
            const char *q = pat + i + 2, *extra = NULL;
            size_t len = 0;
            if (strncmp(q, "{L}", 3) == 0 || strncmp(q, "{N}", 3) == 0) len = 3;
            else if (*q == 'L' || *q == 'N') len = 1;
            if (len) extra = q[len == 3 ? 1 : 0] == 'L' ? ONIG_EXTRA_L : ONIG_EXTRA_N;
            if (extra && !(neg && in_class)) {
                char prop[8];
                snprintf(prop, sizeof prop, "\\p{%c}", q[len == 3 ? 1 : 0]);
                if (!in_class) rc |= sbuf_put(&o, neg ? "[^" : "[", neg ? 2 : 1);
                rc |= sbuf_put(&o, prop, strlen(prop));
                rc |= sbuf_put(&o, extra, strlen(extra));
                if (!in_class) rc |= sbuf_put(&o, "]", 1);
                i += 1 + len;
            } else {
                rc |= sbuf_put(&o, pat + i, 2);
                i += 1;
            }
        } else if (c == '\\' && i + 1 < n) {
            char d = pat[++i];
            const char *rep = NULL, *neg = NULL;
            switch (d) {
            case 's': rep = ONIG_SPACE_CLASS; break;
            case 'S': neg = ONIG_SPACE_CLASS; break;
            case 'w': rep = ONIG_WORD_CLASS; break;
            case 'W': neg = ONIG_WORD_CLASS; break;
            case 'h': rep = "0-9a-fA-F"; break;
            case 'H': neg = "0-9a-fA-F"; break;
            default: break;
            }
            if (rep) {
                if (!in_class) rc |= sbuf_put(&o, "[", 1);
                rc |= sbuf_put(&o, rep, strlen(rep));
                if (!in_class) rc |= sbuf_put(&o, "]", 1);
            } else if (neg && !in_class) {
                rc |= sbuf_put(&o, "[^", 2);
                rc |= sbuf_put(&o, neg, strlen(neg));
                rc |= sbuf_put(&o, "]", 1);
            } else {
                char tmp[2] = {'\\', d};
                rc |= sbuf_put(&o, tmp, 2);
            }
        } else {
            if (!in_class && c == '[') {
                in_class = true;
                rc |= sbuf_put(&o, &c, 1);
                /* a ']' right after '[' or '[^' is literal */
                if (i + 1 < n && pat[i + 1] == '^') rc |= sbuf_put(&o, &pat[++i], 1);
                if (i + 1 < n && pat[i + 1] == ']') rc |= sbuf_put(&o, &pat[++i], 1);
                if (rc) break;
                continue;
            }
            if (in_class && c == ']') in_class = false;
            rc |= sbuf_put(&o, &c, 1);
        }
        if (rc) {
            cs_buf_free(&o);
            return NULL;
        }
    }
    if (!o.p && sbuf_put(&o, "", 0) < 0) return NULL;
    return o.p;
}

static int regex_compile(tok_regex *re, const char *pattern, bool literal, const char *what) {
    memset(re, 0, sizeof *re);
    if (pattern[0] == 0) return cs_error_set(CS_EUNSUPPORTED, "tokenizer: %s: empty pattern", what);
    if (literal) {
        re->lit = strdup(pattern);
        if (!re->lit) return tok_oom();
        re->lit_len = strlen(pattern);
        return CS_OK;
    }
    char *tr = regex_translate(pattern);
    if (!tr) return tok_oom();
    int err;
    PCRE2_SIZE eoff;
    re->code = pcre2_compile((PCRE2_SPTR)tr, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &err,
                             &eoff, NULL);
    free(tr);
    if (!re->code) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        return cs_error_set(CS_EUNSUPPORTED, "tokenizer: %s: regex '%s' rejected: %s", what,
                            pattern, (const char *)msg);
    }
    pcre2_jit_compile(re->code, PCRE2_JIT_COMPLETE); /* optional; interpreter otherwise */
    return CS_OK;
}

static void regex_free(tok_regex *re) {
    if (re->code) pcre2_code_free(re->code);
    free(re->lit);
    memset(re, 0, sizeof *re);
}

/* All non-overlapping matches in s[0..n), as tokenizers' Pattern::find_matches: the whole
 * string is covered by (span, is_match) pieces. Empty matches follow the onig iterator: an
 * empty match right after the previous match is skipped. */
static int regex_find(const tok_regex *re, const char *s, size_t n, scratch *sc, mspanvec *out) {
    out->n = 0;
    if (n == 0) return VEC_PUSH(out, ((mspan){0, 0, false}));
    size_t prev = 0, pos = 0;
    bool have_last = false;
    size_t last_end = 0;
    uint32_t opts = 0;
    while (pos <= n) {
        size_t ms, me;
        if (re->lit) {
            const char *hit = NULL;
            size_t i = pos;
            while (i + re->lit_len <= n) {
                const char *f = memchr(s + i, re->lit[0], n - re->lit_len + 1 - i);
                if (!f) break;
                if (memcmp(f, re->lit, re->lit_len) == 0) { hit = f; break; }
                i = (size_t)(f - s) + 1;
            }
            if (!hit) break;
            ms = (size_t)(hit - s);
            me = ms + re->lit_len;
        } else {
            if (!sc->md && !(sc->md = pcre2_match_data_create(1, NULL))) return tok_oom();
            int rc = pcre2_match(re->code, (PCRE2_SPTR)s, n, pos, opts, sc->md, NULL);
            if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
                rc = pcre2_match(re->code, (PCRE2_SPTR)s, n, pos, opts | PCRE2_NO_JIT, sc->md,
                                 NULL);
            if (rc == PCRE2_ERROR_NOMATCH) break;
            if (rc < 0) {
                PCRE2_UCHAR msg[256];
                pcre2_get_error_message(rc, msg, sizeof msg);
                return cs_error_set(CS_EINVAL, "tokenizer: regex match failed: %s",
                                    (const char *)msg);
            }
            PCRE2_SIZE *ov = pcre2_get_ovector_pointer(sc->md);
            ms = ov[0];
            me = ov[1];
            opts = PCRE2_NO_UTF_CHECK;
        }
        if (ms == me) {
            size_t adv = 1;
            if (me < n) utf8_cp(s + me, n - me, &adv);
            pos = me + adv;
            if (have_last && last_end == me) continue;
        } else {
            pos = me;
        }
        have_last = true;
        last_end = me;
        if (prev != ms && VEC_PUSH(out, ((mspan){prev, ms, false})) < 0) return CS_ENOMEM;
        if (VEC_PUSH(out, ((mspan){ms, me, true})) < 0) return CS_ENOMEM;
        prev = me;
    }
    if (prev != n && VEC_PUSH(out, ((mspan){prev, n, false})) < 0) return CS_ENOMEM;
    return CS_OK;
}

/* Pattern for a char predicate: every matching char is its own match. */
typedef bool (*char_pred)(int32_t c, int32_t arg);
static bool pred_eq(int32_t c, int32_t arg) { return c == arg; }
static bool pred_numeric(int32_t c, int32_t arg) { (void)arg; return uni_is_numeric(c); }
static bool pred_space(int32_t c, int32_t arg) { (void)arg; return uni_is_space(c); }
static bool pred_punct(int32_t c, int32_t arg) { (void)arg; return uni_is_punct(c); }

static int char_find(char_pred pred, int32_t arg, const char *s, size_t n, mspanvec *out) {
    out->n = 0;
    if (n == 0) return VEC_PUSH(out, ((mspan){0, 0, false}));
    size_t last = 0;
    for (size_t i = 0; i < n;) {
        size_t k;
        int32_t c = utf8_cp(s + i, n - i, &k);
        if (pred(c, arg)) {
            if (last < i && VEC_PUSH(out, ((mspan){last, i, false})) < 0) return CS_ENOMEM;
            if (VEC_PUSH(out, ((mspan){i, i + k, true})) < 0) return CS_ENOMEM;
            last = i + k;
        }
        i += k;
    }
    if (n > last && VEC_PUSH(out, ((mspan){last, n, false})) < 0) return CS_ENOMEM;
    return CS_OK;
}

/* ======================================================================================
 * Components as parsed from tokenizer.json
 * ==================================================================================== */

enum split_behavior { B_REMOVED, B_ISOLATED, B_MERGED_PREV, B_MERGED_NEXT, B_CONTIGUOUS };
enum prepend_scheme { PS_ALWAYS, PS_FIRST, PS_NEVER };

enum norm_type {
    NORM_SEQUENCE, NORM_NFC, NORM_NFD, NORM_NFKC, NORM_NFKD, NORM_LOWERCASE, NORM_PREPEND,
    NORM_REPLACE, NORM_STRIP, NORM_STRIP_ACCENTS, NORM_BYTELEVEL,
};
typedef struct normalizer {
    int type;
    struct normalizer **kids;
    size_t n_kids;
    char *str; /* Prepend text / Replace content */
    size_t str_len;
    tok_regex re; /* Replace pattern */
    bool left, right;
} normalizer;

enum pretok_type {
    PT_SEQUENCE, PT_SPLIT, PT_BYTELEVEL, PT_METASPACE, PT_DIGITS, PT_WHITESPACE,
    PT_WHITESPACE_SPLIT, PT_PUNCTUATION,
};
typedef struct pretok {
    int type;
    struct pretok **kids;
    size_t n_kids;
    tok_regex re; /* Split pattern, ByteLevel's GPT-2 regex, Whitespace's regex */
    int behavior;
    bool invert, add_prefix_space, use_regex, split, individual_digits;
    int32_t repl_cp; /* Metaspace */
    char repl[4];
    size_t repl_len;
    int prepend_scheme;
} pretok;

enum post_type { PP_TEMPLATE, PP_BYTELEVEL, PP_SEQUENCE, PP_ROBERTA, PP_BERT };
typedef struct { bool is_seq; int32_t *ids; size_t n_ids; } tmpl_piece;
typedef struct postproc {
    int type;
    struct postproc **kids;
    size_t n_kids;
    tmpl_piece *pieces; /* TemplateProcessing "single" */
    size_t n_pieces;
    int32_t cls_id, sep_id; /* Roberta / Bert */
} postproc;

enum dec_type {
    DEC_SEQUENCE, DEC_BYTELEVEL, DEC_METASPACE, DEC_REPLACE, DEC_BYTEFALLBACK, DEC_FUSE, DEC_STRIP,
};
typedef struct decoder {
    int type;
    struct decoder **kids;
    size_t n_kids;
    tok_regex re;   /* Replace */
    char *content;  /* Replace */
    size_t content_len;
    int32_t cp;     /* Strip content / Metaspace replacement */
    size_t start, stop;
    int prepend_scheme;
} decoder;

typedef struct added_tok {
    int32_t id;
    char *content, *norm; /* norm: normalized form when normalized=true and it differs */
    size_t len, norm_len;
    bool special, lstrip, rstrip, normalized, single_word;
} added_tok;

/* Byte trie over added-token patterns; leftmost-longest matching. */
typedef struct { int32_t child, sibling, value; uint8_t byte; } trie_node;
typedef struct { trie_node *p; size_t n, cap; bool first[256]; } trie;

enum { IDF_SPECIAL = 1, IDF_BYTE = 2 };

struct tokenizer {
    /* BPE model */
    strmap vocab;
    char **vocab_r; /* id -> model token (owned), size n_vocab_r */
    uint32_t *vocab_r_len;
    size_t n_vocab_r, vocab_count;
    struct { char **p; size_t n, cap; } extra_keys; /* vocab strings sharing an id */
    pairmap merges;
    char *unk_token;
    int32_t unk_id;
    bool fuse_unk, byte_fallback, ignore_merges;
    char *cont_prefix, *eow_suffix; /* NULL when absent */
    size_t cont_prefix_len, eow_suffix_len;
    int32_t byte_ids[256];
    /* added vocabulary */
    added_tok *added; /* one per id */
    size_t n_added;
    strmap added_map;
    trie trie_raw, trie_norm;
    /* per id: the string decode starts from, and flags */
    size_t n_ids;
    const char **dec_str;
    uint32_t *dec_len;
    uint8_t *id_flags;
    /* pipeline */
    normalizer *norm;
    pretok *pre;
    postproc *post;
    decoder *dec;
    bool dec_bytefallback, stream_hold;
    /* tokenizer_config.json */
    int32_t bos_id;
    int32_t *eos_ids;
    size_t n_eos;
    char *chat_template;
    bool add_bos, add_eos;
    /* word cache */
    pthread_mutex_t cache_mu;
    cache_ent *cache;
    size_t cache_n;
};

static void normalizer_free(normalizer *n) {
    if (!n) return;
    for (size_t i = 0; i < n->n_kids; i++) normalizer_free(n->kids[i]);
    free(n->kids);
    free(n->str);
    regex_free(&n->re);
    free(n);
}

static void pretok_free(pretok *p) {
    if (!p) return;
    for (size_t i = 0; i < p->n_kids; i++) pretok_free(p->kids[i]);
    free(p->kids);
    regex_free(&p->re);
    free(p);
}

static void postproc_free(postproc *p) {
    if (!p) return;
    for (size_t i = 0; i < p->n_kids; i++) postproc_free(p->kids[i]);
    free(p->kids);
    for (size_t i = 0; i < p->n_pieces; i++) free(p->pieces[i].ids);
    free(p->pieces);
    free(p);
}

static void decoder_free(decoder *d) {
    if (!d) return;
    for (size_t i = 0; i < d->n_kids; i++) decoder_free(d->kids[i]);
    free(d->kids);
    regex_free(&d->re);
    free(d->content);
    free(d);
}

/* ---------------------------------------------------------------- JSON helpers ---- */

static const char *j_str(json_t *o, const char *key) {
    json_t *v = json_object_get(o, key);
    return json_is_string(v) ? json_string_value(v) : NULL;
}

static bool j_bool(json_t *o, const char *key, bool dflt) {
    json_t *v = json_object_get(o, key);
    return json_is_boolean(v) ? json_is_true(v) : dflt;
}

/* A single character given as a JSON string. */
static int j_char(json_t *o, const char *key, const char *what, int32_t *cp) {
    json_t *v = json_object_get(o, key);
    if (!json_is_string(v))
        return cs_error_set(CS_EFORMAT, "tokenizer.json: %s: '%s' must be a string", what, key);
    const char *s = json_string_value(v);
    size_t n = json_string_length(v), k;
    if (n == 0) return cs_error_set(CS_EFORMAT, "tokenizer.json: %s: empty '%s'", what, key);
    *cp = utf8_cp(s, n, &k);
    if (k != n)
        return cs_error_set(CS_EFORMAT, "tokenizer.json: %s: '%s' must be one character", what,
                            key);
    return CS_OK;
}

/* {"String": s} or {"Regex": r} */
static int j_pattern(json_t *o, const char *what, tok_regex *re) {
    json_t *p = json_object_get(o, "pattern");
    const char *s;
    if ((s = j_str(p, "String"))) return regex_compile(re, s, true, what);
    if ((s = j_str(p, "Regex"))) return regex_compile(re, s, false, what);
    return cs_error_set(CS_EFORMAT, "tokenizer.json: %s: pattern must be {String|Regex}", what);
}

static int j_behavior(json_t *o, const char *what, int dflt, int *out) {
    const char *b = j_str(o, "behavior");
    if (!b) {
        if (dflt < 0)
            return cs_error_set(CS_EFORMAT, "tokenizer.json: %s: missing 'behavior'", what);
        *out = dflt;
        return CS_OK;
    }
    static const char *names[] = {"Removed", "Isolated", "MergedWithPrevious", "MergedWithNext",
                                  "Contiguous"};
    for (int i = 0; i < 5; i++)
        if (strcmp(b, names[i]) == 0) {
            *out = i;
            return CS_OK;
        }
    return cs_error_set(CS_EUNSUPPORTED, "tokenizer.json: %s: unknown split behavior '%s'", what,
                        b);
}

/* Metaspace's prepend_scheme / legacy add_prefix_space, as its deserializer. */
static int j_prepend_scheme(json_t *o, int *out) {
    const char *s = j_str(o, "prepend_scheme");
    int ps = PS_ALWAYS;
    if (s) {
        if (strcmp(s, "always") == 0) ps = PS_ALWAYS;
        else if (strcmp(s, "first") == 0) ps = PS_FIRST;
        else if (strcmp(s, "never") == 0) ps = PS_NEVER;
        else
            return cs_error_set(CS_EUNSUPPORTED, "tokenizer.json: Metaspace: unknown "
                                "prepend_scheme '%s'", s);
    }
    json_t *aps = json_object_get(o, "add_prefix_space");
    if (json_is_false(aps)) {
        if (ps != PS_NEVER)
            return cs_error_set(CS_EFORMAT, "tokenizer.json: Metaspace: add_prefix_space does "
                                "not match declared prepend_scheme");
        ps = PS_NEVER;
    }
    *out = ps;
    return CS_OK;
}

static const char *j_type(json_t *o) { return j_str(o, "type"); }

#define COMPONENT_CHECK(o, what)                                                           \
    do {                                                                                   \
        if (!json_is_object(o) || !j_type(o))                                              \
            return cs_error_set(CS_EFORMAT, "tokenizer.json: %s must be an object with a " \
                                "\"type\"", what);                                         \
    } while (0)

/* A Sequence component x: its kids, each parsed with parse, from the list o[key]. On failure
 * sets rc and jumps to err (the caller frees x with its kids). */
#define PARSE_SEQUENCE(x, o, key, what, parse)                                                 \
    do {                                                                                       \
        json_t *arr_ = json_object_get(o, key);                                                \
        if (!json_is_array(arr_)) {                                                            \
            rc = cs_error_set(CS_EFORMAT, "tokenizer.json: %s Sequence without list", what);   \
            goto err;                                                                          \
        }                                                                                      \
        (x)->kids = calloc(json_array_size(arr_) + 1, sizeof *(x)->kids);                      \
        if (!(x)->kids) {                                                                      \
            rc = tok_oom();                                                                    \
            goto err;                                                                          \
        }                                                                                      \
        for (size_t i_ = 0; i_ < json_array_size(arr_); i_++) {                                \
            if ((rc = parse(json_array_get(arr_, i_), &(x)->kids[i_])) < 0) goto err;          \
            (x)->n_kids++;                                                                     \
        }                                                                                      \
    } while (0)

/* Unicode normalization as the tokenizers library does it. Its tables (the crate
 * unicode-normalization-alignments) are Unicode 9.0: marks added later have combining
 * class 0 there and later (compatibility) decompositions do not exist. So decomposition,
 * canonical ordering and composition are done here with utf8proc's data restricted to what
 * those tables know. REF_MARKS: the ranges of marks they know (classes from utf8proc);
 * REF_NEW_DECOMP: code points whose decompositions they lack. Both were found by probing
 * tokenizers' NFD/NFKD on every code point utf8proc 2.8 knows. */
static const int32_t REF_MARKS[][2] = {
    {0x300, 0x33F}, {0x342, 0x342}, {0x345, 0x36F}, {0x483, 0x487}, {0x591, 0x5C7},
    {0x610, 0x670}, {0x6D6, 0x74A}, {0x7EB, 0x7F3}, {0x816, 0x85B}, {0x8D4, 0x954},
    {0x9BC, 0x9CD}, {0xA3C, 0xA4D}, {0xABC, 0xACD}, {0xB3C, 0xB4D}, {0xBCD, 0xBCD},
    {0xC4D, 0xC56}, {0xCBC, 0xCCD}, {0xD4D, 0xD4D}, {0xDCA, 0xDCA}, {0xE38, 0xE4B},
    {0xEB8, 0xEB9}, {0xEC8, 0xECB}, {0xF18, 0xFC6}, {0x1037, 0x103A}, {0x108D, 0x108D},
    {0x135D, 0x135F}, {0x1714, 0x1714}, {0x1734, 0x1734}, {0x17D2, 0x17DD}, {0x18A9, 0x18A9},
    {0x1939, 0x193B}, {0x1A17, 0x1A18}, {0x1A60, 0x1ABD}, {0x1B34, 0x1BF3}, {0x1C37, 0x1C37},
    {0x1CD0, 0x1CF9}, {0x1DC0, 0x1DF5}, {0x1DFB, 0x1DFF}, {0x20D0, 0x20F0}, {0x2CEF, 0x2CF1},
    {0x2D7F, 0x2D7F}, {0x2DE0, 0x2DFF}, {0x302A, 0x302F}, {0x3099, 0x309A}, {0xA66F, 0xA69F},
    {0xA6F0, 0xA6F1}, {0xA806, 0xA806}, {0xA8C4, 0xA953}, {0xA9B3, 0xA9C0}, {0xAAB0, 0xAAF6},
    {0xABED, 0xABED}, {0xFB1E, 0xFB1E}, {0xFE20, 0xFE2F}, {0x101FD, 0x101FD},
    {0x102E0, 0x102E0}, {0x10376, 0x1037A}, {0x10A0D, 0x10A3F}, {0x10AE5, 0x10AE6},
    {0x11046, 0x11046}, {0x1107F, 0x110BA}, {0x11100, 0x11173}, {0x111C0, 0x111CA},
    {0x11235, 0x11236}, {0x112E9, 0x112EA}, {0x1133C, 0x11374}, {0x11442, 0x11446},
    {0x114C2, 0x114C3}, {0x115BF, 0x115C0}, {0x1163F, 0x1163F}, {0x116B6, 0x116B7},
    {0x1172B, 0x1172B}, {0x11C3F, 0x11C3F}, {0x16AF0, 0x16B36}, {0x1BC9E, 0x1BC9E},
    {0x1D165, 0x1D1AD}, {0x1D242, 0x1D244}, {0x1E000, 0x1E02A}, {0x1E8D0, 0x1E8D6},
    {0x1E944, 0x1E94A},
};
static const int32_t REF_NEW_DECOMP[][2] = {
    {0x32FF, 0x32FF}, {0xA7F2, 0xA7F4}, {0xAB69, 0xAB69}, {0x10781, 0x10785},
    {0x10787, 0x107B0}, {0x107B2, 0x107BA}, {0x11938, 0x11938}, {0x1E030, 0x1E06D},
    {0x1F16C, 0x1F16C}, {0x1FBF0, 0x1FBF9},
};


static int ref_ccc(int32_t c) {
    if (c < 0x300 || !in_ranges(REF_MARKS, CS_ARRAY_LEN(REF_MARKS), c)) return 0;
    return utf8proc_get_property(c)->combining_class;
}

/* NFC / NFD / NFKC / NFKD of valid UTF-8 s into out. */
static int unicode_normalize(int type, const char *s, size_t n, sbuf *out) {
    bool compat = type == NORM_NFKC || type == NORM_NFKD;
    bool compose = type == NORM_NFC || type == NORM_NFKC;
    /* fast path: below U+00A0 nothing decomposes, below U+0300 nothing changes under NFC */
    int32_t stable = type == NORM_NFC ? 0x300 : 0xA0;
    size_t i0 = 0, k0;
    while (i0 < n && utf8_cp(s + i0, n - i0, &k0) < stable) i0 += k0;
    if (i0 == n) return sbuf_put(out, s, n);
    i32vec cp = {0};
    struct { uint8_t *p; size_t n, cap; } cc = {0};
    int rc = CS_OK;
    /* 1. decompose */
    for (size_t i = 0; i < n && rc == CS_OK;) {
        size_t k;
        int32_t c = utf8_cp(s + i, n - i, &k), d[32];
        i += k;
        utf8proc_ssize_t m = 1;
        d[0] = c;
        if (c >= 0xA0 && !in_ranges(REF_NEW_DECOMP, CS_ARRAY_LEN(REF_NEW_DECOMP), c)) {
            int last = 0;
            m = utf8proc_decompose_char(c, d, 32, (utf8proc_option_t)(UTF8PROC_DECOMPOSE |
                                        (compat ? UTF8PROC_COMPAT : 0)), &last);
            if (m < 1 || m > 32) { m = 1; d[0] = c; }
        }
        if ((rc = VEC_RESERVE(&cp, cp.n + (size_t)m)) < 0 || (rc = VEC_RESERVE(&cc, cp.n + (size_t)m)) < 0)
            break;
        for (utf8proc_ssize_t j = 0; j < m; j++) {
            cp.p[cp.n++] = d[j];
            cc.p[cc.n++] = (uint8_t)ref_ccc(d[j]);
        }
    }
    /* 2. canonical ordering: stable sort of each run of non-starters by class */
    for (size_t i = 1; i < cp.n && rc == CS_OK; i++) {
        uint8_t k = cc.p[i];
        if (k == 0) continue;
        int32_t c = cp.p[i];
        size_t j = i;
        while (j > 0 && cc.p[j - 1] > k) {
            cp.p[j] = cp.p[j - 1];
            cc.p[j] = cc.p[j - 1];
            j--;
        }
        cp.p[j] = c;
        cc.p[j] = k;
    }
    /* 3. compose, cutting the text before every character utf8proc would treat otherwise:
     * marks that are starters for tokenizers, and U+11930 (it composes into U+11938) */
    size_t w = 0;
    if (rc == CS_OK && compose) {
        size_t seg = 0;
        for (size_t i = 0; i <= cp.n; i++) {
            bool cut = i == cp.n;
            if (!cut) {
                int32_t c = cp.p[i];
                cut = (cc.p[i] == 0 && utf8proc_get_property(c)->combining_class != 0) || c == 0x11930;
            }
            if (!cut) continue;
            if (i > seg) {
                utf8proc_ssize_t m = utf8proc_normalize_utf32(cp.p + seg, (utf8proc_ssize_t)(i - seg),
                                                              (utf8proc_option_t)(UTF8PROC_COMPOSE | UTF8PROC_STABLE));
                if (m < 0) m = (utf8proc_ssize_t)(i - seg);
                memmove(cp.p + w, cp.p + seg, (size_t)m * sizeof *cp.p);
                w += (size_t)m;
            }
            if (i < cp.n) cp.p[w++] = cp.p[i];
            seg = i + 1;
        }
    } else {
        w = cp.n;
    }
    for (size_t i = 0; i < w && rc == CS_OK; i++) rc = sbuf_put_cp(out, cp.p[i]);
    if (rc == CS_OK) rc = sbuf_put(out, "", 0);
    free(cp.p);
    free(cc.p);
    return rc;
}

/* ---------------------------------------------------------------- normalizers ---- */

static int parse_normalizer(json_t *o, normalizer **out) {
    COMPONENT_CHECK(o, "normalizer");
    const char *ty = j_type(o);
    normalizer *n = calloc(1, sizeof *n);
    if (!n) return tok_oom();
    int rc = CS_OK;
    if (strcmp(ty, "Sequence") == 0) {
        n->type = NORM_SEQUENCE;
        PARSE_SEQUENCE(n, o, "normalizers", "normalizer", parse_normalizer);
    } else if (strcmp(ty, "NFC") == 0) n->type = NORM_NFC;
    else if (strcmp(ty, "NFD") == 0) n->type = NORM_NFD;
    else if (strcmp(ty, "NFKC") == 0) n->type = NORM_NFKC;
    else if (strcmp(ty, "NFKD") == 0) n->type = NORM_NFKD;
    else if (strcmp(ty, "Lowercase") == 0) n->type = NORM_LOWERCASE;
    else if (strcmp(ty, "StripAccents") == 0) n->type = NORM_STRIP_ACCENTS;
    else if (strcmp(ty, "ByteLevel") == 0) n->type = NORM_BYTELEVEL;
    else if (strcmp(ty, "Strip") == 0) {
        n->type = NORM_STRIP;
        n->left = j_bool(o, "strip_left", true);
        n->right = j_bool(o, "strip_right", true);
    } else if (strcmp(ty, "Prepend") == 0) {
        n->type = NORM_PREPEND;
        const char *s = j_str(o, "prepend");
        if (!s) { rc = cs_error_set(CS_EFORMAT, "tokenizer.json: Prepend without 'prepend'"); goto err; }
        if (!(n->str = strdup(s))) { rc = tok_oom(); goto err; }
        n->str_len = strlen(s);
    } else if (strcmp(ty, "Replace") == 0) {
        n->type = NORM_REPLACE;
        const char *s = j_str(o, "content");
        if (!s) { rc = cs_error_set(CS_EFORMAT, "tokenizer.json: Replace without 'content'"); goto err; }
        if (!(n->str = strdup(s))) { rc = tok_oom(); goto err; }
        n->str_len = strlen(s);
        if ((rc = j_pattern(o, "Replace normalizer", &n->re)) < 0) goto err;
    } else {
        rc = cs_error_set(CS_EUNSUPPORTED, "tokenizer.json: unsupported normalizer type '%s'", ty);
        goto err;
    }
    *out = n;
    return CS_OK;
err:
    normalizer_free(n);
    return rc;
}

/* Replace every match of re in s by content. */
static int replace_all(const tok_regex *re, const char *content, size_t clen, const char *s,
                       size_t n, scratch *sc, sbuf *out) {
    if (regex_find(re, s, n, sc, &sc->ms2) < 0) return CS_ENOMEM;
    for (size_t i = 0; i < sc->ms2.n; i++) {
        mspan m = sc->ms2.p[i];
        if (m.m ? sbuf_put(out, content, clen) : sbuf_put(out, s + m.s, m.e - m.s)) return CS_ENOMEM;
    }
    return CS_OK;
}

/* Normalize s into out (out is overwritten). *at0 is cleared when the first char no longer
 * maps to the original offset 0 (left strip). */
static int normalize(const normalizer *nm, const char *s, size_t n, scratch *sc, sbuf *out,
                     bool *at0) {
    out->len = 0;
    int rc = CS_OK;
    switch (nm->type) {
    case NORM_SEQUENCE: {
        sbuf cur = {0}, nxt = {0};
        if (sbuf_put(&cur, s, n) < 0) return CS_ENOMEM;
        for (size_t i = 0; i < nm->n_kids && rc == CS_OK; i++) {
            rc = normalize(nm->kids[i], cur.p, cur.len, sc, &nxt, at0);
            sbuf t = cur;
            cur = nxt;
            nxt = t;
        }
        if (rc == CS_OK) rc = sbuf_put(out, cur.p, cur.len);
        cs_buf_free(&cur);
        cs_buf_free(&nxt);
        return rc;
    }
    case NORM_NFC: case NORM_NFD: case NORM_NFKC: case NORM_NFKD:
        return unicode_normalize(nm->type, s, n, out);
    case NORM_LOWERCASE:
        for (size_t i = 0; i < n && rc == CS_OK;) {
            size_t k;
            int32_t c = utf8_cp(s + i, n - i, &k);
            if (c == 0x130) rc = sbuf_put(out, "i\xCC\x87", 3); /* the one multi-char mapping */
            else rc = sbuf_put_cp(out, uni_tolower(c));
            i += k;
        }
        return rc == CS_OK ? sbuf_put(out, "", 0) : rc;
    case NORM_STRIP_ACCENTS:
        for (size_t i = 0; i < n && rc == CS_OK;) {
            size_t k;
            int32_t c = utf8_cp(s + i, n - i, &k);
            if (!uni_is_mark(c)) rc = sbuf_put(out, s + i, k);
            i += k;
        }
        return rc == CS_OK ? sbuf_put(out, "", 0) : rc;
    case NORM_BYTELEVEL:
        pthread_once(&g_bytes_once, bytes_table_init);
        for (size_t i = 0; i < n && rc == CS_OK; i++)
            rc = sbuf_put_cp(out, g_byte_to_cp[(uint8_t)s[i]]);
        return rc == CS_OK ? sbuf_put(out, "", 0) : rc;
    case NORM_STRIP: {
        size_t a = 0, b = n, k;
        if (nm->left)
            while (a < b && uni_is_space(utf8_cp(s + a, b - a, &k))) a += k;
        if (nm->right)
            while (b > a) {
                size_t j = b - 1;
                while (j > a && ((uint8_t)s[j] & 0xC0) == 0x80) j--;
                if (!uni_is_space(utf8_cp(s + j, b - j, &k))) break;
                b = j;
            }
        if (a > 0) *at0 = false;
        return sbuf_put(out, s + a, b - a);
    }
    case NORM_PREPEND:
        if (n && sbuf_put(out, nm->str, nm->str_len) < 0) return CS_ENOMEM;
        return sbuf_put(out, s, n);
    case NORM_REPLACE:
        if (replace_all(&nm->re, nm->str, nm->str_len, s, n, sc, out) < 0) return CS_ENOMEM;
        return sbuf_put(out, "", 0);
    }
    return CS_EINVAL;
}

/* ---------------------------------------------------------------- pre-tokenizers ---- */

#define GPT2_REGEX "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"
#define WHITESPACE_REGEX "\\w+|[^\\w\\s]+"

static int parse_pretok(json_t *o, pretok **out) {
    COMPONENT_CHECK(o, "pre_tokenizer");
    const char *ty = j_type(o);
    pretok *p = calloc(1, sizeof *p);
    if (!p) return tok_oom();
    int rc = CS_OK;
    if (strcmp(ty, "Sequence") == 0) {
        p->type = PT_SEQUENCE;
        PARSE_SEQUENCE(p, o, "pretokenizers", "pre_tokenizer", parse_pretok);
    } else if (strcmp(ty, "Split") == 0) {
        p->type = PT_SPLIT;
        if ((rc = j_pattern(o, "Split pre_tokenizer", &p->re)) < 0) goto err;
        if ((rc = j_behavior(o, "Split pre_tokenizer", -1, &p->behavior)) < 0) goto err;
        p->invert = j_bool(o, "invert", false);
    } else if (strcmp(ty, "ByteLevel") == 0) {
        p->type = PT_BYTELEVEL;
        p->add_prefix_space = j_bool(o, "add_prefix_space", true);
        p->use_regex = j_bool(o, "use_regex", true);
        if (p->use_regex && (rc = regex_compile(&p->re, GPT2_REGEX, false, "ByteLevel")) < 0) goto err;
    } else if (strcmp(ty, "Metaspace") == 0) {
        p->type = PT_METASPACE;
        if ((rc = j_char(o, "replacement", "Metaspace", &p->repl_cp)) < 0) goto err;
        p->repl_len = (size_t)utf8_encode(p->repl_cp, p->repl);
        if ((rc = j_prepend_scheme(o, &p->prepend_scheme)) < 0) goto err;
        p->split = j_bool(o, "split", true);
    } else if (strcmp(ty, "Digits") == 0) {
        p->type = PT_DIGITS;
        p->individual_digits = j_bool(o, "individual_digits", false);
    } else if (strcmp(ty, "Whitespace") == 0) {
        p->type = PT_WHITESPACE;
        if ((rc = regex_compile(&p->re, WHITESPACE_REGEX, false, "Whitespace")) < 0) goto err;
    } else if (strcmp(ty, "WhitespaceSplit") == 0) {
        p->type = PT_WHITESPACE_SPLIT;
    } else if (strcmp(ty, "Punctuation") == 0) {
        p->type = PT_PUNCTUATION;
        if ((rc = j_behavior(o, "Punctuation", B_ISOLATED, &p->behavior)) < 0) goto err;
    } else {
        rc = cs_error_set(CS_EUNSUPPORTED, "tokenizer.json: unsupported pre_tokenizer type '%s'", ty);
        goto err;
    }
    *out = p;
    return CS_OK;
err:
    pretok_free(p);
    return rc;
}

/* Pieces of text flowing through the pre-tokenizers. at0: the piece starts at offset 0 of
 * the original input (Metaspace's prepend_scheme "first"). */
typedef struct { size_t off, len; bool at0; } pretok_piece;
typedef struct { sbuf buf; pretok_piece *p; size_t n, cap; } piecelist;

static int pieces_add(piecelist *pl, const char *s, size_t n, bool at0) {
    if (n == 0) return CS_OK; /* empty splits are dropped */
    if (VEC_PUSH(pl, ((pretok_piece){pl->buf.len, n, at0})) < 0) return CS_ENOMEM;
    return sbuf_put(&pl->buf, s, n);
}
static void pieces_reset(piecelist *pl) { pl->n = 0; pl->buf.len = 0; }
static void pieces_free(piecelist *pl) { cs_buf_free(&pl->buf); free(pl->p); memset(pl, 0, sizeof *pl); }

/* NormalizedString::split: turn (span, is_match) into pieces per the behavior. */
static int split_apply(const char *s, bool at0, mspanvec *m, int behavior, bool invert,
                       piecelist *out) {
    if (invert)
        for (size_t i = 0; i < m->n; i++) m->p[i].m = !m->p[i].m;
    /* after this, m holds (span, remove) */
    size_t k = 0;
    switch (behavior) {
    case B_ISOLATED:
        for (size_t i = 0; i < m->n; i++) m->p[i].m = false;
        k = m->n;
        break;
    case B_REMOVED:
        k = m->n;
        break;
    case B_CONTIGUOUS: {
        bool prev = false;
        for (size_t i = 0; i < m->n; i++) {
            bool is = m->p[i].m;
            if (is == prev && k > 0) m->p[k - 1].e = m->p[i].e;
            else m->p[k++] = (mspan){m->p[i].s, m->p[i].e, false};
            prev = is;
        }
        break;
    }
    case B_MERGED_PREV: {
        bool prev = false;
        for (size_t i = 0; i < m->n; i++) {
            bool is = m->p[i].m;
            if (is && !prev && k > 0) m->p[k - 1].e = m->p[i].e;
            else m->p[k++] = (mspan){m->p[i].s, m->p[i].e, false};
            prev = is;
        }
        break;
    }
    case B_MERGED_NEXT: {
        /* fold from the right, written back from the end of the array */
        bool prev = false;
        size_t w = m->n;
        for (size_t i = m->n; i-- > 0;) {
            bool is = m->p[i].m;
            if (is && !prev && w < m->n) m->p[w].s = m->p[i].s;
            else m->p[--w] = (mspan){m->p[i].s, m->p[i].e, false};
            prev = is;
        }
        memmove(m->p, m->p + w, (m->n - w) * sizeof *m->p);
        k = m->n - w;
        break;
    }
    }
    for (size_t i = 0; i < k; i++) {
        if (m->p[i].m) continue;
        if (pieces_add(out, s + m->p[i].s, m->p[i].e - m->p[i].s, at0 && m->p[i].s == 0) < 0)
            return CS_ENOMEM;
    }
    return CS_OK;
}

static int bytelevel_map(const char *s, size_t n, sbuf *out) {
    pthread_once(&g_bytes_once, bytes_table_init);
    for (size_t i = 0; i < n; i++)
        if (sbuf_put_cp(out, g_byte_to_cp[(uint8_t)s[i]]) < 0) return CS_ENOMEM;
    return CS_OK;
}

static int pretokenize(const pretok *pt, piecelist *in, piecelist *out, scratch *sc) {
    pieces_reset(out);
    int rc = CS_OK;
    if (pt->type == PT_SEQUENCE) {
        piecelist x = {0}, y = {0};
        piecelist *cur = in, *nxt = &x;
        for (size_t i = 0; i < pt->n_kids && rc == CS_OK; i++) {
            rc = pretokenize(pt->kids[i], cur, nxt, sc);
            cur = nxt;
            nxt = cur == &x ? &y : &x;
        }
        for (size_t i = 0; i < cur->n && rc == CS_OK; i++)
            rc = pieces_add(out, cur->buf.p + cur->p[i].off, cur->p[i].len, cur->p[i].at0);
        pieces_free(&x);
        pieces_free(&y);
        return rc;
    }
    sbuf t = {0}, t2 = {0};
    for (size_t pi = 0; pi < in->n && rc == CS_OK; pi++) {
        const char *s = in->buf.p + in->p[pi].off;
        size_t n = in->p[pi].len;
        bool at0 = in->p[pi].at0;
        switch (pt->type) {
        case PT_SPLIT:
            if ((rc = regex_find(&pt->re, s, n, sc, &sc->ms)) == CS_OK)
                rc = split_apply(s, at0, &sc->ms, pt->behavior, pt->invert, out);
            break;
        case PT_WHITESPACE:
            if ((rc = regex_find(&pt->re, s, n, sc, &sc->ms)) == CS_OK)
                rc = split_apply(s, at0, &sc->ms, B_REMOVED, true, out);
            break;
        case PT_DIGITS:
            if ((rc = char_find(pred_numeric, 0, s, n, &sc->ms)) == CS_OK)
                rc = split_apply(s, at0, &sc->ms, pt->individual_digits ? B_ISOLATED : B_CONTIGUOUS,
                                 false, out);
            break;
        case PT_WHITESPACE_SPLIT:
            if ((rc = char_find(pred_space, 0, s, n, &sc->ms)) == CS_OK)
                rc = split_apply(s, at0, &sc->ms, B_REMOVED, false, out);
            break;
        case PT_PUNCTUATION:
            if ((rc = char_find(pred_punct, 0, s, n, &sc->ms)) == CS_OK)
                rc = split_apply(s, at0, &sc->ms, pt->behavior, false, out);
            break;
        case PT_BYTELEVEL: {
            t.len = 0;
            if (pt->add_prefix_space && s[0] != ' ') rc |= sbuf_put(&t, " ", 1);
            rc |= sbuf_put(&t, s, n);
            if (rc) break;
            if (!pt->use_regex) {
                t2.len = 0;
                if ((rc = bytelevel_map(t.p, t.len, &t2)) == CS_OK) rc = pieces_add(out, t2.p, t2.len, at0);
                break;
            }
            if ((rc = regex_find(&pt->re, t.p, t.len, sc, &sc->ms)) < 0) break;
            for (size_t i = 0; i < sc->ms.n && rc == CS_OK; i++) {
                mspan m = sc->ms.p[i];
                t2.len = 0;
                if ((rc = bytelevel_map(t.p + m.s, m.e - m.s, &t2)) == CS_OK)
                    rc = pieces_add(out, t2.p, t2.len, at0 && m.s == 0);
            }
            break;
        }
        case PT_METASPACE: {
            t.len = 0;
            bool starts = false;
            for (size_t i = 0; i < n && rc == CS_OK; i++) {
                if (s[i] == ' ') rc = sbuf_put(&t, pt->repl, pt->repl_len);
                else rc = sbuf_put(&t, s + i, 1);
            }
            if (rc) break;
            starts = t.len >= pt->repl_len && memcmp(t.p, pt->repl, pt->repl_len) == 0;
            bool prepend = !starts && (pt->prepend_scheme == PS_ALWAYS ||
                                       (pt->prepend_scheme == PS_FIRST && at0));
            t2.len = 0;
            if (prepend) rc |= sbuf_put(&t2, pt->repl, pt->repl_len);
            rc |= sbuf_put(&t2, t.p, t.len);
            if (rc) break;
            if (!pt->split) { rc = pieces_add(out, t2.p, t2.len, at0); break; }
            if ((rc = char_find(pred_eq, pt->repl_cp, t2.p, t2.len, &sc->ms)) == CS_OK)
                rc = split_apply(t2.p, at0, &sc->ms, B_MERGED_NEXT, false, out);
            break;
        }
        }
    }
    cs_buf_free(&t);
    cs_buf_free(&t2);
    return rc;
}

/* ---------------------------------------------------------------- post-processors ---- */

static int special_ids_lookup(json_t *specials, const char *name, tmpl_piece *pc) {
    json_t *st = json_object_get(specials, name);
    json_t *ids = json_object_get(st, "ids");
    if (!json_is_array(ids))
        return cs_error_set(CS_EFORMAT, "tokenizer.json: TemplateProcessing: special token "
                            "'%s' missing from special_tokens", name);
    pc->n_ids = json_array_size(ids);
    pc->ids = calloc(pc->n_ids + 1, sizeof *pc->ids);
    if (!pc->ids) return tok_oom();
    for (size_t i = 0; i < pc->n_ids; i++) {
        json_t *v = json_array_get(ids, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX)
            return cs_error_set(CS_EFORMAT, "tokenizer.json: TemplateProcessing: bad id for '%s'",
                                name);
        pc->ids[i] = (int32_t)json_integer_value(v);
    }
    return CS_OK;
}

/* [token, id] pairs of Roberta/Bert processors */
static int j_tok_id(json_t *o, const char *key, int32_t *id) {
    json_t *v = json_object_get(o, key);
    json_t *i = json_array_get(v, 1);
    if (!json_is_integer(i) || json_integer_value(i) < 0 || json_integer_value(i) > INT32_MAX)
        return cs_error_set(CS_EFORMAT, "tokenizer.json: post_processor '%s' must be [token, id]",
                            key);
    *id = (int32_t)json_integer_value(i);
    return CS_OK;
}

static int parse_postproc(json_t *o, postproc **out) {
    COMPONENT_CHECK(o, "post_processor");
    const char *ty = j_type(o);
    postproc *p = calloc(1, sizeof *p);
    if (!p) return tok_oom();
    int rc = CS_OK;
    if (strcmp(ty, "Sequence") == 0) {
        p->type = PP_SEQUENCE;
        PARSE_SEQUENCE(p, o, "processors", "post_processor", parse_postproc);
    } else if (strcmp(ty, "ByteLevel") == 0) {
        p->type = PP_BYTELEVEL; /* only trims offsets */
    } else if (strcmp(ty, "RobertaProcessing") == 0 || strcmp(ty, "BertProcessing") == 0) {
        p->type = ty[0] == 'R' ? PP_ROBERTA : PP_BERT;
        if ((rc = j_tok_id(o, "cls", &p->cls_id)) < 0 || (rc = j_tok_id(o, "sep", &p->sep_id)) < 0)
            goto err;
    } else if (strcmp(ty, "TemplateProcessing") == 0) {
        p->type = PP_TEMPLATE;
        json_t *single = json_object_get(o, "single");
        json_t *specials = json_object_get(o, "special_tokens");
        if (!json_is_array(single)) {
            rc = cs_error_set(CS_EFORMAT, "tokenizer.json: TemplateProcessing without 'single'");
            goto err;
        }
        p->pieces = calloc(json_array_size(single) + 1, sizeof *p->pieces);
        if (!p->pieces) { rc = tok_oom(); goto err; }
        for (size_t i = 0; i < json_array_size(single); i++) {
            json_t *it = json_array_get(single, i);
            json_t *seq = json_object_get(it, "Sequence"), *sp = json_object_get(it, "SpecialToken");
            tmpl_piece *pc = &p->pieces[p->n_pieces++];
            if (seq) {
                const char *id = j_str(seq, "id");
                if (!id || strcmp(id, "A") != 0) {
                    rc = cs_error_set(CS_EUNSUPPORTED, "tokenizer.json: TemplateProcessing single "
                                      "template may only use sequence A");
                    goto err;
                }
                pc->is_seq = true;
            } else if (sp && j_str(sp, "id")) {
                if ((rc = special_ids_lookup(specials, j_str(sp, "id"), pc)) < 0) goto err;
            } else {
                rc = cs_error_set(CS_EFORMAT, "tokenizer.json: TemplateProcessing: bad template "
                                  "piece %zu", i);
                goto err;
            }
        }
    } else {
        rc = cs_error_set(CS_EUNSUPPORTED, "tokenizer.json: unsupported post_processor type '%s'", ty);
        goto err;
    }
    *out = p;
    return CS_OK;
err:
    postproc_free(p);
    return rc;
}

/* Apply to ids (in place via a second vector). */
static int postprocess(const postproc *p, i32vec *ids, bool add_special) {
    if (!add_special || p->type == PP_BYTELEVEL) return CS_OK;
    if (p->type == PP_SEQUENCE) {
        for (size_t i = 0; i < p->n_kids; i++)
            if (postprocess(p->kids[i], ids, add_special) < 0) return CS_ENOMEM;
        return CS_OK;
    }
    i32vec o = {0};
    int rc = CS_OK;
    if (p->type == PP_TEMPLATE) {
        for (size_t i = 0; i < p->n_pieces && rc == CS_OK; i++) {
            const tmpl_piece *pc = &p->pieces[i];
            const int32_t *src = pc->is_seq ? ids->p : pc->ids;
            size_t n = pc->is_seq ? ids->n : pc->n_ids;
            if ((rc = VEC_RESERVE(&o, o.n + n)) == CS_OK && n) {
                memcpy(o.p + o.n, src, n * sizeof *src);
                o.n += n;
            }
        }
    } else { /* Roberta / Bert: cls A sep */
        rc = VEC_RESERVE(&o, ids->n + 2);
        if (rc == CS_OK) {
            o.p[o.n++] = p->cls_id;
            if (ids->n) memcpy(o.p + o.n, ids->p, ids->n * sizeof *ids->p);
            o.n += ids->n;
            o.p[o.n++] = p->sep_id;
        }
    }
    if (rc < 0) { free(o.p); return rc; }
    free(ids->p);
    *ids = o;
    return CS_OK;
}

/* ---------------------------------------------------------------- decoders ---- */

static int parse_decoder(json_t *o, decoder **out) {
    COMPONENT_CHECK(o, "decoder");
    const char *ty = j_type(o);
    decoder *d = calloc(1, sizeof *d);
    if (!d) return tok_oom();
    int rc = CS_OK;
    if (strcmp(ty, "Sequence") == 0) {
        d->type = DEC_SEQUENCE;
        PARSE_SEQUENCE(d, o, "decoders", "decoder", parse_decoder);
    } else if (strcmp(ty, "ByteLevel") == 0) d->type = DEC_BYTELEVEL;
    else if (strcmp(ty, "ByteFallback") == 0) d->type = DEC_BYTEFALLBACK;
    else if (strcmp(ty, "Fuse") == 0) d->type = DEC_FUSE;
    else if (strcmp(ty, "Metaspace") == 0) {
        d->type = DEC_METASPACE;
        if ((rc = j_char(o, "replacement", "Metaspace decoder", &d->cp)) < 0) goto err;
        if ((rc = j_prepend_scheme(o, &d->prepend_scheme)) < 0) goto err;
    } else if (strcmp(ty, "Replace") == 0) {
        d->type = DEC_REPLACE;
        const char *s = j_str(o, "content");
        if (!s) { rc = cs_error_set(CS_EFORMAT, "tokenizer.json: Replace decoder without 'content'"); goto err; }
        if (!(d->content = strdup(s))) { rc = tok_oom(); goto err; }
        d->content_len = strlen(s);
        if ((rc = j_pattern(o, "Replace decoder", &d->re)) < 0) goto err;
    } else if (strcmp(ty, "Strip") == 0) {
        d->type = DEC_STRIP;
        if ((rc = j_char(o, "content", "Strip decoder", &d->cp)) < 0) goto err;
        json_t *a = json_object_get(o, "start"), *b = json_object_get(o, "stop");
        if (!json_is_integer(a) || !json_is_integer(b) || json_integer_value(a) < 0 ||
            json_integer_value(b) < 0) {
            rc = cs_error_set(CS_EFORMAT, "tokenizer.json: Strip decoder needs start/stop");
            goto err;
        }
        d->start = (size_t)json_integer_value(a);
        d->stop = (size_t)json_integer_value(b);
    } else {
        rc = cs_error_set(CS_EUNSUPPORTED, "tokenizer.json: unsupported decoder type '%s'", ty);
        goto err;
    }
    *out = d;
    return CS_OK;
err:
    decoder_free(d);
    return rc;
}

/* Where a list of decoder elements sits in the whole decode. Streaming decodes only a tail
 * of the ids; these flags make that tail decode exactly as it would inside the full list.
 * gidx0: element 0 is (part of) the global element 0. partial0: element 0 is the tail of a
 * global element that began earlier (after a fusing step). */
typedef struct { bool gidx0, partial0; } decpos;

static bool is_byte_token(const char *s, size_t n, uint8_t *byte) {
    if (n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>') return false;
    /* u8::from_str_radix(&s[3..5], 16): two hex digits, or '+' and one */
    int v = 0;
    for (int i = 3; i < 5; i++) {
        char c = s[i];
        int d;
        if (c >= '0' && c <= '9') d = c - '0';
        else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
        else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
        else if (c == '+' && i == 3) continue;
        else return false;
        v = v * 16 + d;
    }
    *byte = (uint8_t)v;
    return true;
}

static int bytefallback_flush(strvec *out, sbuf *bytes, bool raw) {
    if (!bytes->len) return CS_OK;
    int rc = CS_OK;
    if (raw || cs_utf8_valid(bytes->p, bytes->len)) rc = strvec_add(out, bytes->p, bytes->len);
    else
        for (size_t i = 0; i < bytes->len && rc == CS_OK; i++) rc = strvec_add(out, "\xEF\xBF\xBD", 3);
    bytes->len = 0;
    return rc;
}

/* One decoder over the element list in -> out. */
static int decode_step(const decoder *d, strvec *in, strvec *out, decpos *pos, scratch *sc) {
    strvec_reset(out);
    int rc = CS_OK;
    switch (d->type) {
    case DEC_SEQUENCE: {
        strvec x = {0}, y = {0};
        strvec *cur = in, *nxt = &x;
        for (size_t i = 0; i < d->n_kids && rc == CS_OK; i++) {
            rc = decode_step(d->kids[i], cur, nxt, pos, sc);
            cur = nxt;
            nxt = cur == &x ? &y : &x;
        }
        for (size_t i = 0; i < cur->n && rc == CS_OK; i++) rc = strvec_add(out, strvec_at(cur, i), cur->len[i]);
        strvec_free(&x);
        strvec_free(&y);
        return rc;
    }
    case DEC_FUSE:
        if ((rc = strvec_open(out)) < 0) return rc;
        for (size_t i = 0; i < in->n && rc == CS_OK; i++) rc = sbuf_put(&out->buf, strvec_at(in, i), in->len[i]);
        strvec_close(out);
        pos->partial0 = pos->partial0 || !pos->gidx0;
        pos->gidx0 = true;
        return rc;
    case DEC_BYTELEVEL: {
        pthread_once(&g_bytes_once, bytes_table_init);
        sbuf bytes = {0};
        for (size_t i = 0; i < in->n && rc == CS_OK; i++) {
            const char *s = strvec_at(in, i);
            size_t n = in->len[i], mark = bytes.len;
            bool all = true;
            for (size_t j = 0; j < n && rc == CS_OK;) {
                size_t k;
                int32_t c = utf8_cp(s + j, n - j, &k);
                if (c >= 324 || g_cp_to_byte[c] < 0) { all = false; break; }
                char b = (char)g_cp_to_byte[c];
                rc = sbuf_put(&bytes, &b, 1);
                j += k;
            }
            if (rc == CS_OK && !all) {
                bytes.len = mark;
                rc = sbuf_put(&bytes, s, n);
            }
        }
        if (rc == CS_OK && (rc = strvec_open(out)) == CS_OK) {
            rc = sc->raw_bytes ? sbuf_put(&out->buf, bytes.p ? bytes.p : "", bytes.len)
                               : utf8_lossy_append(&out->buf, bytes.p, bytes.len);
            strvec_close(out);
        }
        cs_buf_free(&bytes);
        pos->partial0 = pos->partial0 || !pos->gidx0;
        pos->gidx0 = true;
        return rc;
    }
    case DEC_METASPACE:
        for (size_t i = 0; i < in->n && rc == CS_OK; i++) {
            const char *s = strvec_at(in, i);
            size_t n = in->len[i];
            bool first = i == 0 && pos->gidx0;
            if ((rc = strvec_open(out)) < 0) break;
            for (size_t j = 0; j < n && rc == CS_OK;) {
                size_t k;
                int32_t c = utf8_cp(s + j, n - j, &k);
                if (c == d->cp) {
                    if (!(first && d->prepend_scheme != PS_NEVER)) rc = sbuf_put(&out->buf, " ", 1);
                } else {
                    rc = sbuf_put(&out->buf, s + j, k);
                }
                j += k;
            }
            strvec_close(out);
        }
        return rc;
    case DEC_REPLACE: {
        sbuf t = {0};
        for (size_t i = 0; i < in->n && rc == CS_OK; i++) {
            t.len = 0;
            if ((rc = replace_all(&d->re, d->content, d->content_len, strvec_at(in, i), in->len[i], sc,
                                  &t)) == CS_OK)
                rc = strvec_add(out, t.p ? t.p : "", t.len);
        }
        cs_buf_free(&t);
        return rc;
    }
    case DEC_BYTEFALLBACK: {
        sbuf bytes = {0};
        for (size_t i = 0; i < in->n && rc == CS_OK; i++) {
            uint8_t b;
            bool partial = i == 0 && pos->partial0;
            if (!partial && is_byte_token(strvec_at(in, i), in->len[i], &b)) {
                rc = sbuf_put(&bytes, &b, 1);
            } else {
                if ((rc = bytefallback_flush(out, &bytes, sc->raw_bytes)) == CS_OK)
                    rc = strvec_add(out, strvec_at(in, i), in->len[i]);
            }
        }
        if (rc == CS_OK) rc = bytefallback_flush(out, &bytes, sc->raw_bytes);
        cs_buf_free(&bytes);
        return rc;
    }
    case DEC_STRIP:
        for (size_t i = 0; i < in->n && rc == CS_OK; i++) {
            const char *s = strvec_at(in, i);
            size_t n = in->len[i], a = 0, b = n, k;
            if (!(i == 0 && pos->partial0))
                for (size_t c = 0; c < d->start && a < n; c++) {
                    if (utf8_cp(s + a, n - a, &k) != d->cp) break;
                    a += k;
                }
            for (size_t c = 0; c < d->stop && b > a; c++) {
                size_t j = b - 1;
                while (j > a && ((uint8_t)s[j] & 0xC0) == 0x80) j--;
                if (utf8_cp(s + j, b - j, &k) != d->cp) break;
                b = j;
            }
            rc = strvec_add(out, s + a, b - a);
        }
        return rc;
    }
    return CS_EINVAL;
}

/* ======================================================================================
 * Added tokens
 * ==================================================================================== */

static int trie_new_node(trie *t, uint8_t byte) {
    if (VEC_PUSH(t, ((trie_node){-1, -1, -1, byte})) < 0) return CS_ENOMEM;
    return (int)(t->n - 1);
}

static int trie_insert(trie *t, const char *s, size_t n, int32_t value) {
    if (t->n == 0 && trie_new_node(t, 0) < 0) return CS_ENOMEM;
    int32_t node = 0;
    for (size_t i = 0; i < n; i++) {
        uint8_t b = (uint8_t)s[i];
        int32_t c = t->p[node].child;
        while (c >= 0 && t->p[c].byte != b) c = t->p[c].sibling;
        if (c < 0) {
            int nn = trie_new_node(t, b);
            if (nn < 0) return CS_ENOMEM;
            c = nn;
            t->p[c].sibling = t->p[node].child;
            t->p[node].child = c;
        }
        node = c;
    }
    t->p[node].value = value;
    if (n) t->first[(uint8_t)s[0]] = true;
    return CS_OK;
}

/* Longest pattern starting at s[i]; returns its end or 0, *value its id. */
static size_t trie_longest(const trie *t, const char *s, size_t n, size_t i, int32_t *value) {
    int32_t node = 0;
    size_t best = 0;
    for (size_t j = i; j < n; j++) {
        int32_t c = t->p[node].child;
        while (c >= 0 && t->p[c].byte != (uint8_t)s[j]) c = t->p[c].sibling;
        if (c < 0) break;
        node = c;
        if (t->p[node].value >= 0) {
            best = j + 1;
            *value = t->p[node].value;
        }
    }
    return best;
}

typedef struct { size_t s, e; int32_t id; } seg; /* id -1: plain text */
typedef struct { seg *p; size_t n, cap; } segvec;

static bool ends_with_word(const char *s, size_t n) {
    if (n == 0) return false;
    size_t j = n - 1, k;
    while (j > 0 && ((uint8_t)s[j] & 0xC0) == 0x80) j--;
    return uni_is_word(utf8_cp(s + j, n - j, &k));
}

static bool starts_with_word(const char *s, size_t n) {
    size_t k;
    return n > 0 && uni_is_word(utf8_cp(s, n, &k));
}

static const added_tok *added_by_id(const tokenizer_t *t, int32_t id) {
    size_t lo = 0, hi = t->n_added; /* t->added is sorted by id */
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (t->added[mid].id == id) return &t->added[mid];
        if (t->added[mid].id < id) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}

/* AddedVocabulary::find_matches: split s on added tokens (leftmost-longest), honouring
 * single_word / lstrip / rstrip. */
static int split_added(const tokenizer_t *t, const trie *tr, const char *s, size_t n, segvec *out) {
    out->n = 0;
    if (tr->n == 0) return n ? VEC_PUSH(out, ((seg){0, n, -1})) : CS_OK;
    size_t start_offset = 0, i = 0;
    while (i < n) {
        if (!tr->first[(uint8_t)s[i]]) { i++; continue; }
        int32_t id = -1;
        size_t end = trie_longest(tr, s, n, i, &id);
        if (!end) { i++; continue; }
        size_t start = i, stop = end;
        i = end; /* the automaton resumes after the raw match */
        const added_tok *a = added_by_id(t, id);
        if (a->single_word) {
            bool start_space = start == 0 || !ends_with_word(s, start);
            bool stop_space = stop == n || !starts_with_word(s + stop, n - stop);
            if (!start_space || !stop_space) continue;
        }
        if (a->lstrip) {
            size_t ns = start, k;
            while (ns > 0) {
                size_t j = ns - 1;
                while (j > 0 && ((uint8_t)s[j] & 0xC0) == 0x80) j--;
                if (!uni_is_space(utf8_cp(s + j, ns - j, &k))) break;
                ns = j;
            }
            start = CS_MAX(ns, start_offset);
        }
        if (a->rstrip) {
            size_t k;
            while (stop < n && uni_is_space(utf8_cp(s + stop, n - stop, &k))) stop += k;
        }
        if (start_offset < start && VEC_PUSH(out, ((seg){start_offset, start, -1})) < 0) return CS_ENOMEM;
        if (VEC_PUSH(out, ((seg){start, stop, id})) < 0) return CS_ENOMEM;
        start_offset = stop;
    }
    if (start_offset < n && VEC_PUSH(out, ((seg){start_offset, n, -1})) < 0) return CS_ENOMEM;
    return CS_OK;
}

/* ======================================================================================
 * BPE model
 * ==================================================================================== */

typedef struct { int32_t id, prev, next; uint32_t len; } bpe_sym;
typedef struct { uint32_t rank, pos; int32_t new_id; } bpe_merge;

static bool merge_less(bpe_merge a, bpe_merge b) {
    return a.rank != b.rank ? a.rank < b.rank : a.pos < b.pos;
}

typedef struct { bpe_merge *p; size_t n, cap; } mergeheap;

static int heap_push(mergeheap *h, bpe_merge m) {
    if (VEC_PUSH(h, m) < 0) return CS_ENOMEM;
    size_t i = h->n - 1;
    while (i > 0) {
        size_t par = (i - 1) / 2;
        if (!merge_less(h->p[i], h->p[par])) break;
        bpe_merge t = h->p[i];
        h->p[i] = h->p[par];
        h->p[par] = t;
        i = par;
    }
    return CS_OK;
}

static bpe_merge heap_pop(mergeheap *h) {
    bpe_merge top = h->p[0];
    h->p[0] = h->p[--h->n];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < h->n && merge_less(h->p[l], h->p[m])) m = l;
        if (r < h->n && merge_less(h->p[r], h->p[m])) m = r;
        if (m == i) break;
        bpe_merge t = h->p[i];
        h->p[i] = h->p[m];
        h->p[m] = t;
        i = m;
    }
    return top;
}

typedef struct { bpe_sym *p; size_t n, cap; } symvec;

typedef struct bpe_scratch {
    symvec syms;
    mergeheap heap;
    sbuf tmp;
} bpe_scratch;

static int word_add(symvec *w, int32_t id, size_t len) {
    int32_t n = (int32_t)w->n;
    if (n > 0) w->p[n - 1].next = n;
    return VEC_PUSH(w, ((bpe_sym){id, n - 1, -1, (uint32_t)len}));
}

/* BPE::merge_word + Word::merge_all. */
static int bpe_merge_word(const tokenizer_t *t, const char *w, size_t n, bpe_scratch *sc, i32vec *out) {
    symvec *syms = &sc->syms;
    syms->n = 0;
    int32_t unk_id = -1;
    size_t unk_len = 0;
    bool have_unk = false;
    for (size_t i = 0; i < n;) {
        size_t k;
        utf8_cp(w + i, n - i, &k);
        bool first = i == 0, last = i + k >= n;
        const char *s = w + i;
        size_t sl = k;
        if ((!first && t->cont_prefix) || (last && t->eow_suffix)) {
            sc->tmp.len = 0;
            int rc = CS_OK;
            if (!first && t->cont_prefix) rc |= sbuf_put(&sc->tmp, t->cont_prefix, t->cont_prefix_len);
            rc |= sbuf_put(&sc->tmp, w + i, k);
            if (last && t->eow_suffix) rc |= sbuf_put(&sc->tmp, t->eow_suffix, t->eow_suffix_len);
            if (rc) return CS_ENOMEM;
            s = sc->tmp.p;
            sl = sc->tmp.len;
        }
        int32_t id = strmap_get(&t->vocab, s, sl);
        if (id >= 0) {
            if (have_unk) {
                if (word_add(syms, unk_id, unk_len) < 0) return CS_ENOMEM;
                have_unk = false;
            }
            if (word_add(syms, id, k) < 0) return CS_ENOMEM;
        } else {
            bool done = false;
            if (t->byte_fallback) {
                bool all = true;
                for (size_t b = 0; b < sl; b++)
                    if (t->byte_ids[(uint8_t)s[b]] < 0) { all = false; break; }
                if (all) {
                    for (size_t b = 0; b < sl; b++)
                        if (word_add(syms, t->byte_ids[(uint8_t)s[b]], 1) < 0) return CS_ENOMEM;
                    done = true;
                }
            }
            if (!done && t->unk_token) {
                if (t->unk_id < 0)
                    return cs_error_set(CS_EFORMAT, "tokenizer: unk_token '%s' is not in the vocab",
                                        t->unk_token);
                if (have_unk && t->fuse_unk) {
                    unk_len += k;
                } else {
                    if (have_unk && word_add(syms, unk_id, unk_len) < 0) return CS_ENOMEM;
                    unk_id = t->unk_id;
                    unk_len = k;
                    have_unk = true;
                }
            }
        }
        i += k;
    }
    if (have_unk && word_add(syms, unk_id, unk_len) < 0) return CS_ENOMEM;

    /* merge_all: lowest rank first, leftmost among equals */
    mergeheap *h = &sc->heap;
    h->n = 0;
    for (size_t i = 0; i + 1 < syms->n; i++) {
        const pair_ent *m = pairmap_get(&t->merges, syms->p[i].id, syms->p[i + 1].id);
        if (m && heap_push(h, (bpe_merge){m->rank, (uint32_t)i, m->new_id}) < 0) return CS_ENOMEM;
    }
    bpe_sym *sy = syms->p;
    while (h->n) {
        bpe_merge top = heap_pop(h);
        bpe_sym *cur = &sy[top.pos];
        if (cur->len == 0 || cur->next == -1) continue;
        bpe_sym right = sy[cur->next];
        const pair_ent *m = pairmap_get(&t->merges, cur->id, right.id);
        if (!m || m->new_id != top.new_id) continue;
        int32_t next_pos = cur->next;
        cur->id = top.new_id;
        cur->len += right.len;
        cur->next = right.next;
        sy[next_pos].len = 0;
        if (right.next > -1 && (size_t)right.next < syms->n) sy[right.next].prev = (int32_t)top.pos;
        if (cur->prev >= 0) {
            const pair_ent *pm = pairmap_get(&t->merges, sy[cur->prev].id, cur->id);
            if (pm && heap_push(h, (bpe_merge){pm->rank, (uint32_t)cur->prev, pm->new_id}) < 0)
                return CS_ENOMEM;
            cur = &sy[top.pos];
        }
        if (cur->next >= 0 && (size_t)cur->next < syms->n) {
            const pair_ent *nm = pairmap_get(&t->merges, cur->id, sy[cur->next].id);
            if (nm && heap_push(h, (bpe_merge){nm->rank, top.pos, nm->new_id}) < 0) return CS_ENOMEM;
        }
    }
    for (size_t i = 0; i < syms->n; i++)
        if (sy[i].len && VEC_PUSH(out, sy[i].id) < 0) return CS_ENOMEM;
    return CS_OK;
}

static bool cache_get(tokenizer_t *t, const char *w, size_t n, i32vec *out, int *rc) {
    bool hit = false;
    *rc = CS_OK;
    pthread_mutex_lock(&t->cache_mu);
    if (t->cache) {
        size_t i = hash_bytes(w, n) & (CACHE_CAP - 1);
        while (t->cache[i].key) {
            cache_ent *e = &t->cache[i];
            if (e->len == n && memcmp(e->key, w, n) == 0) {
                /* a word can map to no ids (bytes the vocabulary lacks): nothing to copy */
                if (e->n_ids && (*rc = VEC_RESERVE(out, out->n + e->n_ids)) == CS_OK) {
                    memcpy(out->p + out->n, e->ids, e->n_ids * sizeof *e->ids);
                    out->n += e->n_ids;
                }
                hit = true;
                break;
            }
            i = (i + 1) & (CACHE_CAP - 1);
        }
    }
    pthread_mutex_unlock(&t->cache_mu);
    return hit;
}

static void cache_clear_locked(tokenizer_t *t) {
    for (size_t i = 0; i < CACHE_CAP; i++)
        if (t->cache[i].key) {
            free(t->cache[i].key);
            free(t->cache[i].ids);
            t->cache[i].key = NULL;
        }
    t->cache_n = 0;
}

/* Best effort: a failed allocation just skips caching. */
static void cache_put(tokenizer_t *t, const char *w, size_t n, const int32_t *ids, size_t n_ids) {
    pthread_mutex_lock(&t->cache_mu);
    if (!t->cache) t->cache = calloc(CACHE_CAP, sizeof *t->cache);
    if (t->cache) {
        if (t->cache_n >= CACHE_CAP / 2) cache_clear_locked(t);
        size_t i = hash_bytes(w, n) & (CACHE_CAP - 1);
        while (t->cache[i].key && !(t->cache[i].len == n && memcmp(t->cache[i].key, w, n) == 0))
            i = (i + 1) & (CACHE_CAP - 1);
        if (!t->cache[i].key) {
            char *k = malloc(n + 1);
            int32_t *v = malloc((n_ids ? n_ids : 1) * sizeof *v);
            if (k && v) {
                memcpy(k, w, n);
                if (n_ids) memcpy(v, ids, n_ids * sizeof *v);
                t->cache[i] = (cache_ent){k, (uint32_t)n, (uint32_t)n_ids, v};
                t->cache_n++;
            } else {
                free(k);
                free(v);
            }
        }
    }
    pthread_mutex_unlock(&t->cache_mu);
}

/* BPE::tokenize for one pre-token. */
static int bpe_tokenize(const tokenizer_t *tc, const char *w, size_t n, bpe_scratch *sc, i32vec *out) {
    tokenizer_t *t = (tokenizer_t *)tc; /* only the mutex-guarded cache is written */
    if (n == 0) return CS_OK;
    if (t->ignore_merges) {
        int32_t id = strmap_get(&t->vocab, w, n);
        if (id >= 0) return VEC_PUSH(out, id);
    }
    int rc;
    bool cacheable = n < CACHE_MAX_WORD;
    if (cacheable && cache_get(t, w, n, out, &rc)) return rc;
    size_t before = out->n;
    if ((rc = bpe_merge_word(t, w, n, sc, out)) < 0) return rc;
    if (cacheable) cache_put(t, w, n, out->n > before ? out->p + before : NULL, out->n - before);
    return CS_OK;
}

/* ======================================================================================
 * Encode
 * ==================================================================================== */

/* The match data is made on first use: most decodes never run a regex. */
static int scratch_init(scratch *sc) {
    memset(sc, 0, sizeof *sc);
    return CS_OK;
}

static void scratch_free(scratch *sc) {
    if (sc->md) pcre2_match_data_free(sc->md);
    free(sc->ms.p);
    free(sc->ms2.p);
}

/* Normalized text of one segment -> pre-tokenize -> BPE. */
static int encode_text(const tokenizer_t *t, const char *s, size_t n, bool at0, scratch *sc,
                       bpe_scratch *bs, piecelist *pa, piecelist *pb, i32vec *ids) {
    pieces_reset(pa);
    int rc = pieces_add(pa, s, n, at0);
    if (rc < 0) return rc;
    piecelist *words = pa;
    if (t->pre) {
        if ((rc = pretokenize(t->pre, pa, pb, sc)) < 0) return rc;
        words = pb;
    }
    for (size_t i = 0; i < words->n; i++)
        if ((rc = bpe_tokenize(t, words->buf.p + words->p[i].off, words->p[i].len, bs, ids)) < 0)
            return rc;
    return CS_OK;
}

int tokenizer_encode(const tokenizer_t *t, const char *text, size_t len, bool add_special,
                     int32_t **ids_out, size_t *n_out) {
    if (!t || (!text && len) || !ids_out || !n_out)
        return cs_error_set(CS_EINVAL, "tokenizer_encode: bad arguments");
    *ids_out = NULL;
    *n_out = 0;
    if (!cs_utf8_valid(text, len))
        return cs_error_set(CS_EINVAL, "tokenizer_encode: text is not valid UTF-8");
    scratch sc;
    bpe_scratch bs = {0};
    segvec raw = {0}, nsegs = {0};
    piecelist pa = {0}, pb = {0};
    sbuf norm = {0};
    i32vec ids = {0};
    int rc = scratch_init(&sc);
    if (rc < 0) return rc;
    if ((rc = split_added(t, &t->trie_raw, text, len, &raw)) < 0) goto out;
    for (size_t i = 0; i < raw.n; i++) {
        seg g = raw.p[i];
        if (g.id >= 0) {
            if ((rc = VEC_PUSH(&ids, g.id)) < 0) goto out;
            continue;
        }
        if (g.e <= g.s) continue;
        bool at0 = g.s == 0;
        const char *s = text + g.s;
        size_t n = g.e - g.s;
        if (t->norm) {
            if ((rc = normalize(t->norm, s, n, &sc, &norm, &at0)) < 0) goto out;
            s = norm.p ? norm.p : "";
            n = norm.len;
        }
        if ((rc = split_added(t, &t->trie_norm, s, n, &nsegs)) < 0) goto out;
        for (size_t j = 0; j < nsegs.n; j++) {
            seg h = nsegs.p[j];
            if (h.id >= 0) rc = VEC_PUSH(&ids, h.id);
            else if (h.e > h.s)
                rc = encode_text(t, s + h.s, h.e - h.s, at0 && h.s == 0, &sc, &bs, &pa, &pb, &ids);
            if (rc < 0) goto out;
        }
    }
    if (t->post && (rc = postprocess(t->post, &ids, add_special)) < 0) goto out;
    *ids_out = ids.p ? ids.p : malloc(sizeof(int32_t));
    if (!*ids_out) { rc = tok_oom(); goto out; }
    *n_out = ids.n;
    ids.p = NULL;
out:
    free(ids.p);
    free(raw.p);
    free(nsegs.p);
    pieces_free(&pa);
    pieces_free(&pb);
    cs_buf_free(&norm);
    free(bs.syms.p);
    free(bs.heap.p);
    cs_buf_free(&bs.tmp);
    scratch_free(&sc);
    return rc;
}

/* ======================================================================================
 * Decode
 * ==================================================================================== */

static bool id_survives(const tokenizer_t *t, int32_t id, bool skip_special) {
    if (id < 0 || (size_t)id >= t->n_ids || !t->dec_str[id]) return false;
    return !(skip_special && (t->id_flags[id] & IDF_SPECIAL));
}

/* Decode ids, positioned at `pos` inside a longer list (see decpos). */
static int decode_ids_raw(const tokenizer_t *t, const int32_t *ids, size_t n, bool skip_special,
                          decpos pos, bool raw, sbuf *out) {
    strvec a = {0}, b = {0};
    scratch sc;
    int rc = scratch_init(&sc);
    if (rc < 0) return rc;
    sc.raw_bytes = raw;
    for (size_t i = 0; i < n && rc == CS_OK; i++)
        if (id_survives(t, ids[i], skip_special))
            rc = strvec_add(&a, t->dec_str[ids[i]], t->dec_len[ids[i]]);
    if (rc == CS_OK) {
        if (t->dec) {
            if ((rc = decode_step(t->dec, &a, &b, &pos, &sc)) == CS_OK)
                for (size_t i = 0; i < b.n && rc == CS_OK; i++)
                    rc = sbuf_put(out, strvec_at(&b, i), b.len[i]);
        } else { /* tokens.join(" ") */
            for (size_t i = 0; i < a.n && rc == CS_OK; i++) {
                if (i > 0 || !pos.gidx0) rc = sbuf_put(out, " ", 1);
                if (rc == CS_OK) rc = sbuf_put(out, strvec_at(&a, i), a.len[i]);
            }
        }
    }
    if (rc == CS_OK) rc = sbuf_put(out, "", 0);
    strvec_free(&a);
    strvec_free(&b);
    scratch_free(&sc);
    return rc;
}

static int decode_ids(const tokenizer_t *t, const int32_t *ids, size_t n, bool skip_special,
                      decpos pos, sbuf *out) {
    return decode_ids_raw(t, ids, n, skip_special, pos, false, out);
}

int tokenizer_token_bytes(const tokenizer_t *t, int32_t id, char **out, size_t *out_len) {
    if (!t || !out || id < 0 || id >= tokenizer_vocab_size(t))
        return cs_error_set(CS_EINVAL, "tokenizer_token_bytes: bad arguments");
    sbuf s = {0};
    /* as the tail of a longer sequence: a leading space is kept, nothing is stripped */
    int rc = decode_ids_raw(t, &id, 1, false, (decpos){false, false}, true, &s);
    if (rc < 0) {
        cs_buf_free(&s);
        return rc;
    }
    *out = s.p;
    *out_len = s.len;
    return CS_OK;
}

int tokenizer_decode(const tokenizer_t *t, const int32_t *ids, size_t n, bool skip_special,
                     char **out, size_t *out_len) {
    if (!t || (!ids && n) || !out)
        return cs_error_set(CS_EINVAL, "tokenizer_decode: bad arguments");
    sbuf s = {0};
    int rc = decode_ids(t, ids, n, skip_special, (decpos){true, false}, &s);
    if (rc < 0) {
        cs_buf_free(&s);
        return rc;
    }
    *out = s.p;
    if (out_len) *out_len = s.len;
    return CS_OK;
}

/* ======================================================================================
 * Incremental detokenization
 *
 * The prefix/read-offset scheme of vLLM and TGI, made exact. The stream keeps the ids
 * pushed since text was last emitted (`pending`; the read offset). On each push it decodes
 * them as the tail of the whole sequence (decpos: after a first element, so Strip and
 * Metaspace do not treat them as the start) and emits that text when it is final: not
 * empty, not ending in U+FFFD (an incomplete UTF-8 sequence) and, with a ByteFallback
 * decoder, not ending in a <0xXX> token (a later byte can turn the whole run into U+FFFDs).
 * A decoder that strips the end (Strip with stop > 0) holds everything until the flush.
 * Since the tail decodes to exactly the matching suffix of the full decode, the pieces
 * concatenate to tokenizer_decode(all ids); no earlier context needs re-decoding.
 * ==================================================================================== */

struct tokenizer_stream {
    const tokenizer_t *t;
    bool skip_special;
    bool emitted; /* text, hence a surviving token, lies before the pending ids */
    i32vec pending;
};

tokenizer_stream_t *tokenizer_stream_new(const tokenizer_t *t, bool skip_special) {
    if (!t) {
        cs_error_set(CS_EINVAL, "tokenizer_stream_new: NULL tokenizer");
        return NULL;
    }
    tokenizer_stream_t *s = calloc(1, sizeof *s);
    if (!s) {
        tok_oom();
        return NULL;
    }
    s->t = t;
    s->skip_special = skip_special;
    return s;
}

static int stream_out(sbuf *b, char **piece, size_t *piece_len) {
    if (!b->p && sbuf_put(b, "", 0) < 0) return CS_ENOMEM;
    *piece = b->p;
    if (piece_len) *piece_len = b->len;
    return CS_OK;
}

int tokenizer_stream_push(tokenizer_stream_t *s, int32_t id, char **piece, size_t *piece_len) {
    if (!s || !piece) return cs_error_set(CS_EINVAL, "tokenizer_stream_push: bad arguments");
    *piece = NULL;
    if (piece_len) *piece_len = 0;
    const tokenizer_t *t = s->t;
    int rc = VEC_PUSH(&s->pending, id);
    if (rc < 0) return rc;
    sbuf text = {0};
    bool final = !t->stream_hold;
    if (final && t->dec_bytefallback) {
        /* the last surviving token must not be a byte token */
        for (size_t i = s->pending.n; i-- > 0;) {
            int32_t x = s->pending.p[i];
            if (!id_survives(t, x, s->skip_special)) continue;
            if (t->id_flags[x] & IDF_BYTE) final = false;
            break;
        }
    }
    if (final) {
        if ((rc = decode_ids(t, s->pending.p, s->pending.n, s->skip_special,
                             (decpos){!s->emitted, false}, &text)) < 0)
            goto err;
        if (text.len == 0 || (text.len >= 3 && memcmp(text.p + text.len - 3, "\xEF\xBF\xBD", 3) == 0))
            final = false;
    }
    if (final) {
        s->pending.n = 0;
        s->emitted = true;
    } else {
        text.len = 0;
        if (text.p) text.p[0] = 0;
        /* ids that decode to nothing anywhere (skipped specials, unknown ids) need not wait */
        bool any = false;
        for (size_t i = 0; i < s->pending.n && !any; i++) any = id_survives(t, s->pending.p[i], s->skip_special);
        if (!any) s->pending.n = 0;
    }
    if ((rc = stream_out(&text, piece, piece_len)) < 0) goto err;
    return CS_OK;
err:
    cs_buf_free(&text);
    return rc;
}

int tokenizer_stream_flush(tokenizer_stream_t *s, char **piece, size_t *piece_len) {
    if (!s || !piece) return cs_error_set(CS_EINVAL, "tokenizer_stream_flush: bad arguments");
    *piece = NULL;
    if (piece_len) *piece_len = 0;
    sbuf text = {0};
    int rc = decode_ids(s->t, s->pending.p, s->pending.n, s->skip_special,
                        (decpos){!s->emitted, false}, &text);
    if (rc == CS_OK) rc = stream_out(&text, piece, piece_len);
    if (rc < 0) {
        cs_buf_free(&text);
        return rc;
    }
    for (size_t i = 0; i < s->pending.n; i++)
        if (id_survives(s->t, s->pending.p[i], s->skip_special)) s->emitted = true;
    s->pending.n = 0;
    return CS_OK;
}

void tokenizer_stream_free(tokenizer_stream_t *s) {
    if (!s) return;
    free(s->pending.p);
    free(s);
}

/* ======================================================================================
 * Loading
 * ==================================================================================== */

static int load_model(tokenizer_t *t, json_t *m) {
    if (!json_is_object(m)) return cs_error_set(CS_EFORMAT, "tokenizer.json: missing \"model\"");
    const char *ty = j_type(m);
    if (ty ? strcmp(ty, "BPE") != 0 : !json_object_get(m, "merges"))
        return cs_error_set(CS_EUNSUPPORTED, "tokenizer.json: unsupported model type '%s' (only "
                            "BPE)", ty ? ty : "(untyped)");
    json_t *dropout = json_object_get(m, "dropout");
    if (json_is_number(dropout) && json_number_value(dropout) != 0.0)
        return cs_error_set(CS_EUNSUPPORTED, "tokenizer.json: BPE dropout is not supported");
    json_t *vocab = json_object_get(m, "vocab"), *merges = json_object_get(m, "merges");
    if (!json_is_object(vocab) || !json_is_array(merges))
        return cs_error_set(CS_EFORMAT, "tokenizer.json: BPE model needs vocab and merges");

    const char *key;
    json_t *val;
    int64_t max_id = -1;
    json_object_foreach(vocab, key, val) {
        if (!json_is_integer(val) || json_integer_value(val) < 0 || json_integer_value(val) >= INT32_MAX)
            return cs_error_set(CS_EFORMAT, "tokenizer.json: vocab entry '%s' has a bad id", key);
        max_id = CS_MAX(max_id, json_integer_value(val));
    }
    /* the id tables are indexed by id: a vocabulary is dense (0..n-1, its gaps a few), and one
     * id of 1.7e9 among 18 tokens would ask for 14 GB (found by fuzz_tokenizer_json) */
    if (max_id >= 2 * (int64_t)json_object_size(vocab) + 65536)
        return cs_error_set(CS_EFORMAT, "tokenizer.json: vocab ids are sparse: id %lld among %zu tokens",
                            (long long)max_id, json_object_size(vocab));
    t->n_vocab_r = (size_t)(max_id + 1);
    t->vocab_r = calloc(t->n_vocab_r + 1, sizeof *t->vocab_r);
    t->vocab_r_len = calloc(t->n_vocab_r + 1, sizeof *t->vocab_r_len);
    if (!t->vocab_r || !t->vocab_r_len) return tok_oom();
    json_object_foreach(vocab, key, val) {
        int32_t id = (int32_t)json_integer_value(val);
        size_t n = strlen(key);
        char *s = malloc(n + 1);
        if (!s) return tok_oom();
        memcpy(s, key, n + 1);
        if (!t->vocab_r[id]) {
            t->vocab_r[id] = s;
            t->vocab_r_len[id] = (uint32_t)n;
        } else if (VEC_PUSH(&t->extra_keys, s) < 0) { /* a second string for the same id */
            free(s);
            return CS_ENOMEM;
        }
        if (strmap_put(&t->vocab, s, n, id) < 0) return CS_ENOMEM;
        t->vocab_count++;
    }

    const char *s;
    if ((s = j_str(m, "unk_token"))) {
        if (!(t->unk_token = strdup(s))) return tok_oom();
        t->unk_id = strmap_get(&t->vocab, s, strlen(s));
    }
    if ((s = j_str(m, "continuing_subword_prefix"))) {
        if (!(t->cont_prefix = strdup(s))) return tok_oom();
        t->cont_prefix_len = strlen(s);
    }
    if ((s = j_str(m, "end_of_word_suffix"))) {
        if (!(t->eow_suffix = strdup(s))) return tok_oom();
        t->eow_suffix_len = strlen(s);
    }
    t->fuse_unk = j_bool(m, "fuse_unk", false);
    t->byte_fallback = j_bool(m, "byte_fallback", false);
    t->ignore_merges = j_bool(m, "ignore_merges", false);
    for (int b = 0; b < 256; b++) {
        char code[8];
        snprintf(code, sizeof code, "<0x%02X>", b);
        t->byte_ids[b] = strmap_get(&t->vocab, code, 6);
    }

    size_t nm = json_array_size(merges);
    if (pairmap_init(&t->merges, nm) < 0) return CS_ENOMEM;
    sbuf buf = {0};
    int rc = CS_OK;
    uint32_t rank = 0;
    for (size_t i = 0; i < nm && rc == CS_OK; i++) {
        json_t *e = json_array_get(merges, i);
        const char *a, *b;
        size_t la, lb;
        char *sp = NULL;
        if (json_is_string(e)) {
            const char *line = json_string_value(e);
            if (strncmp(line, "#version", 8) == 0) continue;
            sp = strchr(line, ' ');
            if (!sp || strchr(sp + 1, ' ')) {
                rc = cs_error_set(CS_EFORMAT, "tokenizer.json: merge %u ('%s') is not 'a b'", rank + 1, line);
                break;
            }
            a = line;
            la = (size_t)(sp - line);
            b = sp + 1;
            lb = strlen(b);
        } else if (json_is_array(e) && json_array_size(e) == 2 && json_is_string(json_array_get(e, 0)) &&
                   json_is_string(json_array_get(e, 1))) {
            a = json_string_value(json_array_get(e, 0));
            la = json_string_length(json_array_get(e, 0));
            b = json_string_value(json_array_get(e, 1));
            lb = json_string_length(json_array_get(e, 1));
        } else {
            rc = cs_error_set(CS_EFORMAT, "tokenizer.json: merge %zu is neither 'a b' nor [a, b]", i);
            break;
        }
        int32_t ia = strmap_get(&t->vocab, a, la), ib = strmap_get(&t->vocab, b, lb);
        size_t pl = t->cont_prefix ? t->cont_prefix_len : 0;
        if (ia < 0 || ib < 0 || lb < pl) {
            rc = cs_error_set(CS_EFORMAT, "tokenizer.json: merge %u refers to a token missing from "
                              "the vocab ('%.*s')", rank, (int)(ia < 0 ? la : lb), ia < 0 ? a : b);
            break;
        }
        buf.len = 0;
        if (sbuf_put(&buf, a, la) < 0 || sbuf_put(&buf, b + pl, lb - pl) < 0) { rc = CS_ENOMEM; break; }
        int32_t nid = strmap_get(&t->vocab, buf.p, buf.len);
        if (nid < 0) {
            rc = cs_error_set(CS_EFORMAT, "tokenizer.json: merged token '%s' missing from the vocab",
                              buf.p);
            break;
        }
        pairmap_put(&t->merges, pair_key(ia, ib), rank++, nid);
    }
    cs_buf_free(&buf);
    return rc;
}

static int added_cmp(const void *a, const void *b) {
    int32_t x = ((const added_tok *)a)->id, y = ((const added_tok *)b)->id;
    return (x > y) - (x < y);
}

/* AddedVocabulary::add_tokens over the file's added_tokens, then the two tries. */
static int load_added(tokenizer_t *t, json_t *arr) {
    if (!arr || json_is_null(arr)) return CS_OK;
    if (!json_is_array(arr)) return cs_error_set(CS_EFORMAT, "tokenizer.json: added_tokens must be a list");
    size_t n = json_array_size(arr);
    t->added = calloc(n + 1, sizeof *t->added);
    if (!t->added) return tok_oom();
    int32_t next_id = (int32_t)t->vocab_count;
    scratch sc;
    int rc = scratch_init(&sc);
    if (rc < 0) return rc;
    for (size_t i = 0; i < n && rc == CS_OK; i++) {
        json_t *o = json_array_get(arr, i);
        json_t *c = json_object_get(o, "content");
        if (!json_is_string(c)) {
            rc = cs_error_set(CS_EFORMAT, "tokenizer.json: added token %zu has no content", i);
            break;
        }
        const char *content = json_string_value(c);
        size_t len = json_string_length(c);
        if (len == 0) continue;
        added_tok a = {0};
        a.special = j_bool(o, "special", false);
        a.single_word = j_bool(o, "single_word", false);
        a.lstrip = j_bool(o, "lstrip", false);
        a.rstrip = j_bool(o, "rstrip", false);
        a.normalized = j_bool(o, "normalized", !a.special);
        int32_t id = strmap_get(&t->added_map, content, len);
        bool seen = id >= 0;
        if (id < 0) id = strmap_get(&t->vocab, content, len);
        if (id < 0) id = next_id++;
        a.id = id;
        if (!(a.content = malloc(len + 1))) { rc = tok_oom(); break; }
        memcpy(a.content, content, len + 1);
        a.len = len;
        if (a.normalized && t->norm) {
            sbuf nb = {0};
            bool at0 = true;
            rc = normalize(t->norm, content, len, &sc, &nb, &at0);
            if (rc == CS_OK && (nb.len != len || memcmp(nb.p, content, len) != 0)) {
                a.norm = nb.p;
                a.norm_len = nb.len;
            } else {
                cs_buf_free(&nb);
            }
        }
        /* a token with the same id replaces the earlier one (added_tokens_map_r.insert) */
        size_t j = seen ? 0 : t->n_added;
        while (j < t->n_added && t->added[j].id != id) j++;
        if (j < t->n_added) {
            free(t->added[j].content);
            free(t->added[j].norm);
        } else {
            t->n_added++;
        }
        t->added[j] = a;
        /* keys point into the JSON document while loading; rebuilt below */
        if (rc == CS_OK) rc = strmap_put(&t->added_map, content, len, id);
    }
    scratch_free(&sc);
    if (rc < 0) return rc;
    qsort(t->added, t->n_added, sizeof *t->added, added_cmp);
    /* rebuild added_map with keys owned by the added tokens */
    free(t->added_map.e);
    memset(&t->added_map, 0, sizeof t->added_map);
    for (size_t k = 0; k < t->n_added; k++) {
        added_tok *a = &t->added[k];
        if (strmap_put(&t->added_map, a->content, a->len, a->id) < 0) return CS_ENOMEM;
        if (a->normalized) {
            const char *p = a->norm ? a->norm : a->content;
            size_t pl = a->norm ? a->norm_len : a->len;
            if (pl && trie_insert(&t->trie_norm, p, pl, a->id) < 0) return CS_ENOMEM;
        } else if (trie_insert(&t->trie_raw, a->content, a->len, a->id) < 0) {
            return CS_ENOMEM;
        }
    }
    return CS_OK;
}

static bool decoder_has(const decoder *d, int type) {
    if (!d) return false;
    if (d->type == type) return true;
    for (size_t i = 0; i < d->n_kids; i++)
        if (decoder_has(d->kids[i], type)) return true;
    return false;
}

static bool decoder_strips_end(const decoder *d) {
    if (!d) return false;
    if (d->type == DEC_STRIP && d->stop > 0) return true;
    for (size_t i = 0; i < d->n_kids; i++)
        if (decoder_strips_end(d->kids[i])) return true;
    return false;
}

/* Per-id decode strings and flags. */
/* every id a post-processor adds is a token of the vocabulary (the engine refuses others,
 * and a decode could not say what they are) */
static int check_post_id(const tokenizer_t *t, int32_t id) {
    if (id >= 0 && (size_t)id < t->n_ids && t->dec_str[id]) return CS_OK;
    return cs_error_set(CS_EFORMAT, "tokenizer.json: the post_processor adds token id %d, which is not in the "
                        "vocabulary or added_tokens", id);
}

static int check_post_ids(const tokenizer_t *t, const postproc *p) {
    int rc;
    if (!p) return CS_OK;
    for (size_t i = 0; i < p->n_kids; i++)
        if ((rc = check_post_ids(t, p->kids[i])) < 0) return rc;
    for (size_t i = 0; i < p->n_pieces; i++)
        for (size_t k = 0; k < p->pieces[i].n_ids; k++)
            if ((rc = check_post_id(t, p->pieces[i].ids[k])) < 0) return rc;
    if ((p->type == PP_ROBERTA || p->type == PP_BERT) &&
        ((rc = check_post_id(t, p->cls_id)) < 0 || (rc = check_post_id(t, p->sep_id)) < 0))
        return rc;
    return CS_OK;
}

static int build_id_tables(tokenizer_t *t) {
    size_t n = t->n_vocab_r;
    for (size_t i = 0; i < t->n_added; i++) n = CS_MAX(n, (size_t)t->added[i].id + 1);
    t->n_ids = n;
    t->dec_str = calloc(n + 1, sizeof *t->dec_str);
    t->dec_len = calloc(n + 1, sizeof *t->dec_len);
    t->id_flags = calloc(n + 1, 1);
    if (!t->dec_str || !t->dec_len || !t->id_flags) return tok_oom();
    strmap specials = {0};
    for (size_t i = 0; i < t->n_added; i++)
        if (t->added[i].special && strmap_put(&specials, t->added[i].content, t->added[i].len, 1) < 0) {
            free(specials.e);
            return CS_ENOMEM;
        }
    for (size_t id = 0; id < t->n_vocab_r; id++) {
        t->dec_str[id] = t->vocab_r[id];
        t->dec_len[id] = t->vocab_r_len[id];
    }
    for (size_t i = 0; i < t->n_added; i++) {
        const added_tok *a = &t->added[i];
        t->dec_str[a->id] = a->norm ? a->norm : a->content;
        t->dec_len[a->id] = (uint32_t)(a->norm ? a->norm_len : a->len);
    }
    for (size_t id = 0; id < n; id++) {
        if (!t->dec_str[id]) continue;
        uint8_t b;
        if (strmap_get(&specials, t->dec_str[id], t->dec_len[id]) >= 0) t->id_flags[id] |= IDF_SPECIAL;
        if (is_byte_token(t->dec_str[id], t->dec_len[id], &b)) t->id_flags[id] |= IDF_BYTE;
    }
    free(specials.e);
    t->dec_bytefallback = decoder_has(t->dec, DEC_BYTEFALLBACK);
    t->stream_hold = decoder_strips_end(t->dec);
    return CS_OK;
}

/* bos_token / eos_token: "text" or {"content": "text"} */
static const char *config_token(json_t *cfg, const char *key) {
    json_t *v = json_object_get(cfg, key);
    if (json_is_string(v)) return json_string_value(v);
    if (json_is_object(v)) return j_str(v, "content");
    return NULL;
}

static int add_eos(tokenizer_t *t, int32_t id) {
    for (size_t i = 0; i < t->n_eos; i++)
        if (t->eos_ids[i] == id) return CS_OK;
    int32_t *p = realloc(t->eos_ids, (t->n_eos + 1) * sizeof *p);
    if (!p) return tok_oom();
    t->eos_ids = p;
    t->eos_ids[t->n_eos++] = id;
    return CS_OK;
}

/* tokenizer_config.json's tree (label names it in messages): bos/eos, add_*_token, chat_template */
static int load_config_tree(tokenizer_t *t, const char *label, json_t *cfg) {
    if (!json_is_object(cfg)) return cs_error_set(CS_EFORMAT, "%s: not a JSON object", label);
    int rc = CS_OK;
    const char *bos = config_token(cfg, "bos_token"), *eos = config_token(cfg, "eos_token");
    if (bos) t->bos_id = tokenizer_token_to_id(t, bos);
    if (eos) {
        int32_t id = tokenizer_token_to_id(t, eos);
        if (id >= 0 && (rc = add_eos(t, id)) < 0) return rc;
    }
    t->add_bos = j_bool(cfg, "add_bos_token", false);
    t->add_eos = j_bool(cfg, "add_eos_token", false);
    json_t *ct = json_object_get(cfg, "chat_template");
    const char *tmpl = NULL;
    if (json_is_string(ct)) {
        tmpl = json_string_value(ct);
    } else if (json_is_array(ct)) {
        for (size_t i = 0; i < json_array_size(ct); i++) {
            json_t *e = json_array_get(ct, i);
            const char *name = j_str(e, "name");
            if (name && strcmp(name, "default") == 0) tmpl = j_str(e, "template");
        }
    }
    if (tmpl && !(t->chat_template = strdup(tmpl))) rc = tok_oom();
    return rc;
}

static int load_config(tokenizer_t *t, const char *path) {
    json_error_t jerr;
    /* model_max_length is often 1e30 written as an integer: read numbers as reals */
    json_t *cfg = json_load_file(path, JSON_DECODE_INT_AS_REAL, &jerr);
    if (!cfg)
        return cs_error_set(CS_EFORMAT, "%s:%d: bad JSON: %s", path, jerr.line, jerr.text);
    int rc = load_config_tree(t, path, cfg);
    json_decref(cfg);
    return rc;
}

/* generation_config.json's eos_token_id (int or list): the ids that end generation. */
static int load_generation_tree(tokenizer_t *t, json_t *cfg) {
    json_t *e = json_object_get(cfg, "eos_token_id");
    int rc = CS_OK;
    size_t n = json_is_array(e) ? json_array_size(e) : 1;
    for (size_t i = 0; i < n && rc == CS_OK; i++) {
        json_t *v = json_is_array(e) ? json_array_get(e, i) : e;
        if (json_is_number(v) && json_number_value(v) >= 0 && json_number_value(v) < INT32_MAX)
            rc = add_eos(t, (int32_t)json_number_value(v));
    }
    return rc;
}

static int load_generation_config(tokenizer_t *t, const char *path) {
    json_error_t jerr;
    json_t *cfg = json_load_file(path, JSON_DECODE_INT_AS_REAL, &jerr);
    if (!cfg) return cs_error_set(CS_EFORMAT, "%s:%d: bad JSON: %s", path, jerr.line, jerr.text);
    int rc = load_generation_tree(t, cfg);
    json_decref(cfg);
    return rc;
}

/* From the tokenizer.json tree root (label names it in messages); with own_root, root is
 * released here, as soon as it has been read (a large vocabulary's tree is most of the memory). */
static int load_tree(const char *label, json_t *root, bool own_root, tokenizer_t **out) {
    pthread_once(&g_bytes_once, bytes_table_init);
    tokenizer_t *t = calloc(1, sizeof *t);
    int rc = CS_OK;
    if (!t) {
        if (own_root) json_decref(root);
        return tok_oom();
    }
    pthread_mutex_init(&t->cache_mu, NULL);
    t->unk_id = -1;
    t->bos_id = -1;
    if (!json_is_object(root)) {
        rc = cs_error_set(CS_EFORMAT, "%s: not a JSON object", label);
        goto err;
    }
    const char *ver = j_str(root, "version");
    if (ver && strcmp(ver, "1.0") != 0) {
        rc = cs_error_set(CS_EUNSUPPORTED, "%s: unknown tokenizer version '%s'", label, ver);
        goto err;
    }
    json_t *o;
    if ((o = json_object_get(root, "truncation")) && !json_is_null(o))
        cs_log("tokenizer: %s: ignoring \"truncation\" (the server checks lengths itself)", label);
    if ((o = json_object_get(root, "padding")) && !json_is_null(o))
        cs_log("tokenizer: %s: ignoring \"padding\"", label);
    if ((o = json_object_get(root, "normalizer")) && !json_is_null(o) && (rc = parse_normalizer(o, &t->norm)) < 0)
        goto err;
    if ((o = json_object_get(root, "pre_tokenizer")) && !json_is_null(o) && (rc = parse_pretok(o, &t->pre)) < 0)
        goto err;
    if ((o = json_object_get(root, "post_processor")) && !json_is_null(o) &&
        (rc = parse_postproc(o, &t->post)) < 0)
        goto err;
    if ((o = json_object_get(root, "decoder")) && !json_is_null(o) && (rc = parse_decoder(o, &t->dec)) < 0)
        goto err;
    if ((rc = load_model(t, json_object_get(root, "model"))) < 0) goto err;
    if ((rc = load_added(t, json_object_get(root, "added_tokens"))) < 0) goto err;
    if ((rc = build_id_tables(t)) < 0 || (rc = check_post_ids(t, t->post)) < 0) goto err;
    if (own_root) json_decref(root);
    *out = t;
    return CS_OK;
err:
    if (own_root) json_decref(root);
    tokenizer_free(t);
    return rc;
}

int tokenizer_load_json(const char *label, json_t *root, json_t *config, json_t *generation,
                        tokenizer_t **out) {
    if (!label || !root || !out) return cs_error_set(CS_EINVAL, "tokenizer_load_json: bad arguments");
    *out = NULL;
    int rc = load_tree(label, root, false, out);
    if (rc == CS_OK && config) rc = load_config_tree(*out, label, config);
    if (rc == CS_OK && generation) rc = load_generation_tree(*out, generation);
    if (rc < 0 && *out) {
        tokenizer_free(*out);
        *out = NULL;
    }
    return rc;
}

int tokenizer_load_files(const char *json_path, const char *config_path, tokenizer_t **out) {
    if (!json_path || !out) return cs_error_set(CS_EINVAL, "tokenizer_load_files: bad arguments");
    *out = NULL;
    json_error_t jerr;
    json_t *root = json_load_file(json_path, JSON_ALLOW_NUL, &jerr);
    if (!root) {
        if (!cs_file_exists(json_path))
            return cs_error_set(CS_ENOTFOUND, "%s: no such file", json_path);
        return cs_error_set(CS_EFORMAT, "%s:%d:%d: bad JSON: %s", json_path, jerr.line, jerr.column,
                            jerr.text);
    }
    int rc = load_tree(json_path, root, true, out);
    if (rc == CS_OK && config_path && (rc = load_config(*out, config_path)) < 0) {
        tokenizer_free(*out);
        *out = NULL;
    }
    return rc;
}

int tokenizer_load(const char *dir, tokenizer_t **out) {
    if (!dir || !out) return cs_error_set(CS_EINVAL, "tokenizer_load: bad arguments");
    char *jp = cs_path_join(dir, "tokenizer.json");
    char *cp = cs_path_join(dir, "tokenizer_config.json");
    char *gp = cs_path_join(dir, "generation_config.json");
    char *tp = cs_path_join(dir, "chat_template.jinja");
    int rc;
    if (!jp || !cp || !gp || !tp) {
        rc = tok_oom();
        goto out;
    }
    if (!cs_file_exists(jp)) {
        rc = cs_error_set(CS_ENOTFOUND, "%s: no such file", jp);
        goto out;
    }
    rc = tokenizer_load_files(jp, cs_file_exists(cp) ? cp : NULL, out);
    if (rc == CS_OK && cs_file_exists(gp)) rc = load_generation_config(*out, gp);
    if (rc == CS_OK && !(*out)->chat_template && cs_file_exists(tp)) {
        size_t len;
        char *s = cs_read_file(tp, &len);
        if (!s) rc = CS_EIO;
        else (*out)->chat_template = s;
    }
    if (rc < 0 && *out) {
        tokenizer_free(*out);
        *out = NULL;
    }
out:
    free(jp);
    free(cp);
    free(gp);
    free(tp);
    return rc;
}

void tokenizer_free(tokenizer_t *t) {
    if (!t) return;
    for (size_t i = 0; i < t->n_vocab_r; i++) free(t->vocab_r[i]);
    for (size_t i = 0; i < t->extra_keys.n; i++) free(t->extra_keys.p[i]);
    free(t->extra_keys.p);
    free(t->vocab_r);
    free(t->vocab_r_len);
    free(t->vocab.e);
    free(t->merges.e);
    free(t->unk_token);
    free(t->cont_prefix);
    free(t->eow_suffix);
    for (size_t i = 0; i < t->n_added; i++) {
        free(t->added[i].content);
        free(t->added[i].norm);
    }
    free(t->added);
    free(t->added_map.e);
    free(t->trie_raw.p);
    free(t->trie_norm.p);
    free(t->dec_str);
    free(t->dec_len);
    free(t->id_flags);
    normalizer_free(t->norm);
    pretok_free(t->pre);
    postproc_free(t->post);
    decoder_free(t->dec);
    free(t->eos_ids);
    free(t->chat_template);
    if (t->cache) {
        cache_clear_locked(t);
        free(t->cache);
    }
    pthread_mutex_destroy(&t->cache_mu);
    free(t);
}

/* ======================================================================================
 * Accessors
 * ==================================================================================== */

int tokenizer_vocab_size(const tokenizer_t *t) { return t ? (int)t->n_ids : 0; }

const char *tokenizer_id_to_token(const tokenizer_t *t, int32_t id) {
    if (!t || id < 0 || (size_t)id >= t->n_ids) return NULL;
    const added_tok *a = added_by_id(t, id);
    if (a) return a->content;
    return (size_t)id < t->n_vocab_r ? t->vocab_r[id] : NULL;
}

int32_t tokenizer_token_to_id(const tokenizer_t *t, const char *token) {
    if (!t || !token) return -1;
    size_t n = strlen(token);
    int32_t id = strmap_get(&t->added_map, token, n);
    return id >= 0 ? id : strmap_get(&t->vocab, token, n);
}

bool tokenizer_is_special(const tokenizer_t *t, int32_t id) {
    if (!t) return false;
    const added_tok *a = added_by_id(t, id);
    return a && a->special;
}

int32_t tokenizer_bos_id(const tokenizer_t *t) { return t ? t->bos_id : -1; }

int tokenizer_eos_ids(const tokenizer_t *t, const int32_t **ids) {
    if (!t) return 0;
    if (ids) *ids = t->eos_ids;
    return (int)t->n_eos;
}

const char *tokenizer_chat_template(const tokenizer_t *t) { return t ? t->chat_template : NULL; }
