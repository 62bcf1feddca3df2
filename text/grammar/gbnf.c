/* gbnf.c: GBNF text -> a compiled grammar (grammar_impl.h). A recursive-descent parser in
 * the shape of llama.cpp's (newlines end a rule outside parentheses; a group, a repetition
 * and a multi-byte character class each become a rule of their own), then the checks (every
 * referenced rule defined, "root" present, no left recursion) and the flattening. */
#include "text/grammar/grammar_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ELEMS (1 << 22) /* x{1000}{1000} and the like stop here */
#define MAX_CP 0x10FFFFu

typedef struct balt {
    gelem_t *s;
    int n, cap;
} balt_t;

typedef struct brule {
    char *name;             /* NULL: a group, repetition or class made while parsing `owner` */
    int owner;
    balt_t *alts;
    int n_alts, cap_alts;
    bool defined;
    int ref_line, ref_col;  /* where it was first named */
} brule_t;

typedef struct crange {
    uint32_t lo, hi;
} crange_t;

typedef struct ccache {     /* a character class already made into a symbol */
    crange_t *r;
    int n;
    gelem_t sym;
} ccache_t;

typedef struct build {
    brule_t *rules;
    int n_rules, cap_rules;
    gset_t *sets;
    int n_sets, cap_sets;
    ccache_t *cc;
    int n_cc, cap_cc;
    long total;
    const char *src, *p, *end, *line_start;
    int line;
    int cur;                /* the named rule being parsed */
    bool failed;
    int rc;                 /* with failed: CS_EINVAL or CS_ENOMEM */
} build_t;

static int grow(void **p, int *cap, int need, size_t elem) {
    if (need <= *cap) return 0;
    int nc = *cap ? *cap * 2 : 8;
    while (nc < need) nc *= 2;
    void *np = realloc(*p, (size_t)nc * elem);
    if (!np) return -1;
    *p = np;
    *cap = nc;
    return 0;
}

static bool failf(build_t *B, const char *fmt, const char *what) {
    if (!B->failed) {
        B->failed = true;
        B->rc = CS_EINVAL;
        cs_error_set(CS_EINVAL, "grammar: %s%s (line %d, column %d)", fmt, what ? what : "", B->line,
                     (int)(B->p - B->line_start) + 1);
    }
    return false;
}

static bool oom(build_t *B) {
    if (!B->failed) {
        B->failed = true;
        B->rc = CS_ENOMEM;
        cs_error_set(CS_ENOMEM, "out of memory");
    }
    return false;
}

/* ---- building ---- */
static int new_rule(build_t *B, const char *name, size_t len) {
    if (grow((void **)&B->rules, &B->cap_rules, B->n_rules + 1, sizeof(brule_t))) return -1;
    brule_t *r = &B->rules[B->n_rules];
    memset(r, 0, sizeof *r);
    r->owner = B->cur;
    r->ref_line = B->line;
    r->ref_col = (int)(B->p - B->line_start) + 1;
    if (name) {
        if (!(r->name = malloc(len + 1))) return -1;
        memcpy(r->name, name, len);
        r->name[len] = 0;
    }
    return B->n_rules++;
}

static int rule_named(build_t *B, const char *name, size_t len) {
    for (int i = 0; i < B->n_rules; i++)
        if (B->rules[i].name && strlen(B->rules[i].name) == len && !memcmp(B->rules[i].name, name, len)) return i;
    return new_rule(B, name, len);
}

static int new_alt(build_t *B, int r) {
    brule_t *R = &B->rules[r];
    if (grow((void **)&R->alts, &R->cap_alts, R->n_alts + 1, sizeof(balt_t))) return -1;
    memset(&R->alts[R->n_alts], 0, sizeof(balt_t));
    return R->n_alts++;
}

static bool push(build_t *B, int r, int a, gelem_t s) {
    balt_t *A = &B->rules[r].alts[a];
    if (++B->total > MAX_ELEMS) return failf(B, "the grammar is too large", NULL);
    if (grow((void **)&A->s, &A->cap, A->n + 1, sizeof(gelem_t))) return oom(B);
    A->s[A->n++] = s;
    return true;
}

static int set_id(build_t *B, const gset_t *s) {
    for (int i = 0; i < B->n_sets; i++)
        if (!memcmp(&B->sets[i], s, sizeof *s)) return i;
    if (grow((void **)&B->sets, &B->cap_sets, B->n_sets + 1, sizeof(gset_t))) return -1;
    B->sets[B->n_sets] = *s;
    return B->n_sets++;
}

static gelem_t byte_range(build_t *B, uint8_t lo, uint8_t hi) {
    gset_t s = {{0}};
    for (int b = lo; b <= hi; b++) s.w[b >> 5] |= 1u << (b & 31);
    int id = set_id(B, &s);
    if (id < 0) oom(B);
    return (gelem_t){GE_BYTES, id < 0 ? 0 : (uint32_t)id};
}

static int utf8_len(uint32_t c) { return c < 0x80 ? 1 : c < 0x800 ? 2 : c < 0x10000 ? 3 : 4; }

static int utf8_enc(uint32_t c, uint8_t *b) {
    if (c < 0x80) { b[0] = (uint8_t)c; return 1; }
    if (c < 0x800) { b[0] = (uint8_t)(0xC0 | c >> 6); b[1] = (uint8_t)(0x80 | (c & 63)); return 2; }
    if (c < 0x10000) {
        b[0] = (uint8_t)(0xE0 | c >> 12);
        b[1] = (uint8_t)(0x80 | ((c >> 6) & 63));
        b[2] = (uint8_t)(0x80 | (c & 63));
        return 3;
    }
    b[0] = (uint8_t)(0xF0 | c >> 18);
    b[1] = (uint8_t)(0x80 | ((c >> 12) & 63));
    b[2] = (uint8_t)(0x80 | ((c >> 6) & 63));
    b[3] = (uint8_t)(0x80 | (c & 63));
    return 4;
}

/* the code points lo..hi (one UTF-8 length, no surrogates) as alternatives of byte ranges
 * in rule r (the split of RE2 and the utf8-ranges crate) */
static bool utf8_alts(build_t *B, int r, uint32_t lo, uint32_t hi) {
    static const uint32_t lim[] = {0x7F, 0x7FF, 0xFFFF};
    for (int k = 0; k < 3; k++)
        if (lo <= lim[k] && hi > lim[k]) return utf8_alts(B, r, lo, lim[k]) && utf8_alts(B, r, lim[k] + 1, hi);
    int n = utf8_len(lo);
    for (int i = 1; i < n; i++) {
        uint32_t m = (1u << (6 * i)) - 1;
        if ((lo & ~m) != (hi & ~m)) {
            if (lo & m) return utf8_alts(B, r, lo, lo | m) && utf8_alts(B, r, (lo | m) + 1, hi);
            if ((hi & m) != m) return utf8_alts(B, r, lo, (hi & ~m) - 1) && utf8_alts(B, r, hi & ~m, hi);
        }
    }
    uint8_t a[4], b[4];
    utf8_enc(lo, a);
    utf8_enc(hi, b);
    int alt = new_alt(B, r);
    if (alt < 0) return oom(B);
    for (int k = 0; k < n; k++)
        if (!push(B, r, alt, byte_range(B, a[k], b[k]))) return false;
    return true;
}

static int cmp_range(const void *pa, const void *pb) {
    const crange_t *a = pa, *b = pb;
    return a->lo < b->lo ? -1 : a->lo > b->lo;
}

/* sorted, merged, negated when asked, without the surrogates (no UTF-8 encodes them): into
 * out (room for 2n + 2); returns the count, -1 when out of memory */
static int normalize(crange_t *r, int n, bool negate, crange_t *out) {
    if (n > 1) qsort(r, (size_t)n, sizeof *r, cmp_range);
    crange_t *t = malloc(sizeof *t * (size_t)(2 * n + 2));
    if (!t) return -1;
    int m = 0;
    for (int i = 0; i < n; i++) {
        if (m && r[i].lo <= t[m - 1].hi + 1) {
            if (r[i].hi > t[m - 1].hi) t[m - 1].hi = r[i].hi;
        } else {
            t[m++] = r[i];
        }
    }
    if (negate) {
        int k = 0;
        uint32_t next = 0;
        for (int i = 0; i < m; i++) {
            if (t[i].lo > next) out[k++] = (crange_t){next, t[i].lo - 1};
            next = t[i].hi + 1;
        }
        if (next <= MAX_CP) out[k++] = (crange_t){next, MAX_CP};
        memcpy(t, out, sizeof *t * (size_t)k);
        m = k;
    }
    int k = 0; /* cut D800-DFFF out (one merged range at most holds them) */
    for (int i = 0; i < m; i++) {
        crange_t x = t[i];
        if (x.hi < 0xD800 || x.lo > 0xDFFF) { out[k++] = x; continue; }
        if (x.lo < 0xD800) out[k++] = (crange_t){x.lo, 0xD7FF};
        if (x.hi > 0xDFFF) out[k++] = (crange_t){0xE000, x.hi};
    }
    free(t);
    return k;
}

/* a class (normalized) as one symbol: a byte set when it is all ASCII, else a rule */
static bool class_symbol(build_t *B, crange_t *r, int n, gelem_t *sym) {
    for (int i = 0; i < B->n_cc; i++)
        if (B->cc[i].n == n && !memcmp(B->cc[i].r, r, sizeof *r * (size_t)n)) {
            *sym = B->cc[i].sym;
            return true;
        }
    if (n == 0) return failf(B, "an empty character class matches nothing", NULL);
    gset_t ascii = {{0}};
    bool wide = false, any_ascii = false;
    for (int i = 0; i < n; i++) {
        for (uint32_t c = r[i].lo; c <= r[i].hi && c < 0x80; c++) {
            ascii.w[c >> 5] |= 1u << (c & 31);
            any_ascii = true;
        }
        wide |= r[i].hi >= 0x80;
    }
    if (!wide) {
        int id = set_id(B, &ascii);
        if (id < 0) return oom(B);
        *sym = (gelem_t){GE_BYTES, (uint32_t)id};
    } else {
        int rr = new_rule(B, NULL, 0);
        if (rr < 0) return oom(B);
        if (any_ascii) {
            int id = set_id(B, &ascii), alt = new_alt(B, rr);
            if (id < 0 || alt < 0) return oom(B);
            if (!push(B, rr, alt, (gelem_t){GE_BYTES, (uint32_t)id})) return false;
        }
        for (int i = 0; i < n; i++)
            if (r[i].hi >= 0x80 && !utf8_alts(B, rr, r[i].lo < 0x80 ? 0x80 : r[i].lo, r[i].hi)) return false;
        *sym = (gelem_t){GE_RULE, (uint32_t)rr};
    }
    if (grow((void **)&B->cc, &B->cap_cc, B->n_cc + 1, sizeof(ccache_t))) return oom(B);
    ccache_t *c = &B->cc[B->n_cc];
    if (!(c->r = malloc(sizeof *r * (size_t)n))) return oom(B);
    memcpy(c->r, r, sizeof *r * (size_t)n);
    c->n = n;
    c->sym = *sym;
    B->n_cc++;
    return true;
}

/* x{min,max} (max -1: unbounded) of the symbols [start, n) of alternative a of rule r */
static bool repeat(build_t *B, int r, int a, int start, long min, long max) {
    balt_t *A = &B->rules[r].alts[a];
    int cnt = A->n - start;
    if (cnt <= 0) return true; /* "" repeated is still nothing */
    gelem_t x = A->s[start];
    if (cnt > 1) { /* a literal of several bytes: its own rule */
        int xr = new_rule(B, NULL, 0), xa;
        if (xr < 0 || (xa = new_alt(B, xr)) < 0) return oom(B);
        A = &B->rules[r].alts[a];
        for (int i = start; i < A->n; i++)
            if (!push(B, xr, xa, B->rules[r].alts[a].s[i])) return false;
        x = (gelem_t){GE_RULE, (uint32_t)xr};
    }
    B->rules[r].alts[a].n = start;
    for (long i = 0; i < min; i++)
        if (!push(B, r, a, x)) return false;
    if (max == min) return true;
    int tail;
    if (max < 0) { /* S ::= x S | "" */
        int s = new_rule(B, NULL, 0), a1, a2;
        if (s < 0 || (a1 = new_alt(B, s)) < 0 || (a2 = new_alt(B, s)) < 0) return oom(B);
        (void)a2;
        if (!push(B, s, a1, x) || !push(B, s, a1, (gelem_t){GE_RULE, (uint32_t)s})) return false;
        tail = s;
    } else { /* O_1 ::= x | "" ; O_k ::= x O_{k-1} | "" */
        tail = -1;
        for (long k = 0; k < max - min; k++) {
            int o = new_rule(B, NULL, 0), a1;
            if (o < 0 || (a1 = new_alt(B, o)) < 0 || new_alt(B, o) < 0) return oom(B);
            if (!push(B, o, a1, x)) return false;
            if (tail >= 0 && !push(B, o, a1, (gelem_t){GE_RULE, (uint32_t)tail})) return false;
            tail = o;
        }
    }
    return push(B, r, a, (gelem_t){GE_RULE, (uint32_t)tail});
}

/* ---- parsing ---- */
static bool word_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_' ||
           c == '.';
}

static void skip_space(build_t *B, bool newlines) {
    while (B->p < B->end) {
        char c = *B->p;
        if (c == ' ' || c == '\t') B->p++;
        else if (c == '#') while (B->p < B->end && *B->p != '\n' && *B->p != '\r') B->p++;
        else if (newlines && (c == '\n' || c == '\r')) {
            if (c == '\n') { B->line++; B->line_start = B->p + 1; }
            B->p++;
        } else break;
    }
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* one character of a literal or class, escapes decoded: its code point, or -1 */
static long parse_char(build_t *B) {
    if (B->p >= B->end) return failf(B, "unexpected end of the grammar", NULL), -1;
    unsigned char c = (unsigned char)*B->p;
    if (c == '\\') {
        if (++B->p >= B->end) return failf(B, "unexpected end after \\", NULL), -1;
        char e = *B->p++;
        int nd = e == 'x' ? 2 : e == 'u' ? 4 : e == 'U' ? 8 : 0;
        if (nd) {
            long v = 0;
            for (int i = 0; i < nd; i++) {
                int h = B->p < B->end ? hexval(*B->p) : -1;
                if (h < 0) return failf(B, "expecting hex digits in an escape", NULL), -1;
                v = v * 16 + h;
                B->p++;
            }
            if (v > (long)MAX_CP) return failf(B, "escape beyond U+10FFFF", NULL), -1;
            return v;
        }
        switch (e) {
        case 'n': return '\n';
        case 'r': return '\r';
        case 't': return '\t';
        case 'f': return '\f';
        case 'v': return '\v';
        case '0': return 0;
        case '\\': case '"': case '\'': case '[': case ']': case '-': case '^': case '/': return e;
        }
        B->p--;
        return failf(B, "unknown escape", NULL), -1;
    }
    int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (!n || B->p + n > B->end) return failf(B, "invalid UTF-8", NULL), -1;
    long v = n == 1 ? c : n == 2 ? (c & 31) : n == 3 ? (c & 15) : (c & 7);
    for (int i = 1; i < n; i++) {
        unsigned char d = (unsigned char)B->p[i];
        if ((d & 0xC0) != 0x80) return failf(B, "invalid UTF-8", NULL), -1;
        v = v << 6 | (d & 63);
    }
    B->p += n;
    return v;
}

static bool parse_literal(build_t *B, int r, int a) {
    B->p++; /* the opening quote */
    while (B->p < B->end && *B->p != '"') {
        if (*B->p == '\n') return failf(B, "a literal runs past the end of the line", NULL);
        long c = parse_char(B);
        if (c < 0) return false;
        uint8_t b[4];
        int n = utf8_enc((uint32_t)c, b);
        for (int i = 0; i < n; i++)
            if (!push(B, r, a, byte_range(B, b[i], b[i]))) return false;
    }
    if (B->p >= B->end) return failf(B, "unterminated literal", NULL);
    B->p++;
    return true;
}

static bool parse_class(build_t *B, gelem_t *sym) {
    B->p++; /* [ */
    bool neg = B->p < B->end && *B->p == '^';
    if (neg) B->p++;
    crange_t *r = NULL;
    int n = 0, cap = 0;
    bool ok = true;
    while (ok && B->p < B->end && *B->p != ']' && *B->p != '\n') {
        long lo = parse_char(B), hi = lo;
        if (lo >= 0 && B->p + 1 < B->end && *B->p == '-' && B->p[1] != ']' && B->p[1] != '\n') {
            B->p++;
            hi = parse_char(B);
            if (hi >= 0 && hi < lo) ok = failf(B, "a class range goes backwards", NULL);
        }
        if (lo < 0 || hi < 0) ok = false;
        else if (grow((void **)&r, &cap, n + 1, sizeof *r)) ok = oom(B);
        else r[n++] = (crange_t){(uint32_t)lo, (uint32_t)hi};
    }
    if (ok && (B->p >= B->end || *B->p == '\n')) ok = failf(B, "unterminated character class", NULL);
    if (ok) {
        B->p++;
        crange_t *norm = malloc(sizeof *norm * (size_t)(2 * n + 2));
        if (!norm) ok = oom(B);
        else {
            int m = normalize(r, n, neg, norm);
            ok = m < 0 ? oom(B) : class_symbol(B, norm, m, sym);
            free(norm);
        }
    }
    free(r);
    return ok;
}

static bool parse_alternates(build_t *B, int r, bool nested);

static bool parse_count(build_t *B, long *v) {
    if (B->p >= B->end || *B->p < '0' || *B->p > '9') return failf(B, "expecting a number in { }", NULL);
    *v = 0;
    while (B->p < B->end && *B->p >= '0' && *B->p <= '9') {
        *v = *v * 10 + (*B->p++ - '0');
        if (*v > 100000) return failf(B, "a repetition count is too large", NULL);
    }
    return true;
}

static bool parse_sequence(build_t *B, int r, int a, bool nested) {
    int atom = -1;
    while (!B->failed && B->p < B->end) {
        char c = *B->p;
        int n = B->rules[r].alts[a].n;
        if (c == '"') {
            atom = n;
            if (!parse_literal(B, r, a)) return false;
        } else if (c == '[' || c == '.') {
            atom = n;
            gelem_t sym;
            if (c == '.') {
                B->p++;
                crange_t all = {0, MAX_CP}, norm[4];
                int m = normalize(&all, 1, false, norm);
                if (m < 0) return oom(B);
                if (!class_symbol(B, norm, m, &sym)) return false;
            } else if (!parse_class(B, &sym)) {
                return false;
            }
            if (!push(B, r, a, sym)) return false;
        } else if (word_char(c)) {
            const char *s = B->p;
            while (B->p < B->end && word_char(*B->p)) B->p++;
            int ref = rule_named(B, s, (size_t)(B->p - s));
            if (ref < 0) return oom(B);
            atom = n;
            if (!push(B, r, a, (gelem_t){GE_RULE, (uint32_t)ref})) return false;
        } else if (c == '(') {
            B->p++;
            skip_space(B, true);
            int g = new_rule(B, NULL, 0);
            if (g < 0) return oom(B);
            if (!parse_alternates(B, g, true)) return false;
            if (B->p >= B->end || *B->p != ')') return failf(B, "expecting ')'", NULL);
            B->p++;
            atom = B->rules[r].alts[a].n;
            if (!push(B, r, a, (gelem_t){GE_RULE, (uint32_t)g})) return false;
        } else if (c == '*' || c == '+' || c == '?' || c == '{') {
            if (atom < 0) return failf(B, "a repetition must follow something", NULL);
            long min = c == '+', max = c == '?' ? 1 : -1;
            B->p++;
            if (c == '{') {
                if (!parse_count(B, &min)) return false;
                max = min;
                if (B->p < B->end && *B->p == ',') {
                    B->p++;
                    max = -1;
                    if (B->p < B->end && *B->p != '}' && !parse_count(B, &max)) return false;
                }
                if (B->p >= B->end || *B->p != '}') return failf(B, "expecting '}'", NULL);
                B->p++;
                if (max >= 0 && max < min) return failf(B, "{m,n} with n below m", NULL);
            }
            if (!repeat(B, r, a, atom, min, max)) return false;
        } else {
            break;
        }
        skip_space(B, nested);
    }
    return !B->failed;
}

static bool parse_alternates(build_t *B, int r, bool nested) {
    for (;;) {
        int a = new_alt(B, r);
        if (a < 0) return oom(B);
        if (!parse_sequence(B, r, a, nested)) return false;
        if (B->p >= B->end || *B->p != '|') return true;
        B->p++;
        skip_space(B, true);
    }
}

static bool parse_rules(build_t *B) {
    skip_space(B, true);
    while (B->p < B->end) {
        const char *s = B->p;
        while (B->p < B->end && word_char(*B->p)) B->p++;
        if (B->p == s) return failf(B, "expecting a rule name", NULL);
        int r = rule_named(B, s, (size_t)(B->p - s));
        if (r < 0) return oom(B);
        if (B->rules[r].defined) return failf(B, "a rule is defined twice: ", B->rules[r].name);
        B->rules[r].defined = true;
        B->cur = r;
        skip_space(B, false);
        if (B->end - B->p < 3 || memcmp(B->p, "::=", 3)) return failf(B, "expecting '::='", NULL);
        B->p += 3;
        skip_space(B, true);
        if (!parse_alternates(B, r, false)) return false;
        skip_space(B, false);
        if (B->p < B->end && *B->p != '\n' && *B->p != '\r') return failf(B, "expecting the end of the line", NULL);
        skip_space(B, true);
    }
    return true;
}

/* ---- checks and flattening ---- */
static const char *rule_label(const build_t *B, int r) {
    while (!B->rules[r].name) r = B->rules[r].owner;
    return B->rules[r].name;
}

/* Left recursion. Rule u "starts with" v when an alternative of u refers to v after nothing
 * but nullable elements; the edge is a tail when that reference ends the alternative (the
 * matcher then expands v on the same stack, and an expansion met again on the same stack is
 * skipped). A cycle of tail edges only (x* with a nullable x) is harmless; a cycle through any
 * other edge pushes a return address each time round: it would never end. */
static bool reaches(build_t *B, const bool *nullable, int from, int to, uint8_t *seen) {
    if (from == to) return true;
    if (seen[from]) return false;
    seen[from] = 1;
    brule_t *R = &B->rules[from];
    for (int a = 0; a < R->n_alts; a++)
        for (int i = 0; i < R->alts[a].n; i++) {
            gelem_t s = R->alts[a].s[i];
            if (s.type != GE_RULE) break;
            if (reaches(B, nullable, (int)s.arg, to, seen)) return true;
            if (!nullable[s.arg]) break;
        }
    return false;
}

static bool no_left_recursion(build_t *B, const bool *nullable) {
    uint8_t *seen = malloc((size_t)B->n_rules);
    if (!seen) return cs_error_set(CS_ENOMEM, "out of memory"), false;
    for (int r = 0; r < B->n_rules; r++) {
        brule_t *R = &B->rules[r];
        for (int a = 0; a < R->n_alts; a++)
            for (int i = 0; i < R->alts[a].n; i++) {
                gelem_t s = R->alts[a].s[i];
                if (s.type != GE_RULE) break;
                bool tail = i == R->alts[a].n - 1;
                memset(seen, 0, (size_t)B->n_rules);
                if (!tail && reaches(B, nullable, (int)s.arg, r, seen)) {
                    cs_error_set(CS_EINVAL, "grammar: rule '%s' is left-recursive (it can reach itself before "
                                            "matching a byte)", rule_label(B, r));
                    free(seen);
                    return false;
                }
                if (!nullable[s.arg]) break;
            }
    }
    free(seen);
    return true;
}

static int check(build_t *B, int *root) {
    *root = -1;
    for (int r = 0; r < B->n_rules; r++) {
        if (B->rules[r].name && !B->rules[r].defined)
            return cs_error_set(CS_EINVAL, "grammar: undefined rule '%s' (line %d, column %d)", B->rules[r].name,
                                B->rules[r].ref_line, B->rules[r].ref_col);
        if (B->rules[r].name && !strcmp(B->rules[r].name, "root")) *root = r;
    }
    if (*root < 0) return cs_error_set(CS_EINVAL, "grammar: no rule named 'root'");
    bool *nullable = calloc((size_t)B->n_rules, sizeof(bool));
    if (!nullable) return cs_error_set(CS_ENOMEM, "out of memory");
    for (bool changed = true; changed;) {
        changed = false;
        for (int r = 0; r < B->n_rules; r++) {
            if (nullable[r]) continue;
            for (int a = 0; a < B->rules[r].n_alts && !nullable[r]; a++) {
                bool all = true;
                for (int i = 0; i < B->rules[r].alts[a].n && all; i++) {
                    gelem_t s = B->rules[r].alts[a].s[i];
                    all = s.type == GE_RULE && nullable[s.arg];
                }
                if (all) nullable[r] = changed = true;
            }
        }
    }
    int rc = no_left_recursion(B, nullable) ? CS_OK : CS_EINVAL;
    free(nullable);
    return rc;
}

static int flatten(build_t *B, int root, grammar_t **out) {
    grammar_t *g = calloc(1, sizeof *g);
    if (!g) return cs_error_set(CS_ENOMEM, "out of memory");
    atomic_init(&g->refs, 1);
    pthread_mutex_init(&g->cache_mu, NULL);
    int n_alts = 0, n_elems = 0;
    for (int r = 0; r < B->n_rules; r++) {
        n_alts += B->rules[r].n_alts;
        for (int a = 0; a < B->rules[r].n_alts; a++) n_elems += B->rules[r].alts[a].n + 1;
    }
    g->elems = malloc(sizeof(gelem_t) * (size_t)(n_elems + 1));
    g->alt_start = malloc(sizeof(int) * (size_t)(n_alts + 1));
    g->rule_alt0 = malloc(sizeof(int) * (size_t)(B->n_rules + 1));
    g->sets = malloc(sizeof(gset_t) * (size_t)(B->n_sets + 1));
    if (!g->elems || !g->alt_start || !g->rule_alt0 || !g->sets) {
        grammar_unref(g);
        return cs_error_set(CS_ENOMEM, "out of memory");
    }
    int e = 0, k = 0;
    for (int r = 0; r < B->n_rules; r++) {
        g->rule_alt0[r] = k;
        for (int a = 0; a < B->rules[r].n_alts; a++) {
            g->alt_start[k++] = e;
            if (B->rules[r].alts[a].n)
                memcpy(g->elems + e, B->rules[r].alts[a].s, sizeof(gelem_t) * (size_t)B->rules[r].alts[a].n);
            e += B->rules[r].alts[a].n;
            g->elems[e++] = (gelem_t){GE_END, 0};
        }
    }
    g->rule_alt0[B->n_rules] = k;
    if (B->n_sets) memcpy(g->sets, B->sets, sizeof(gset_t) * (size_t)B->n_sets);
    g->n_elems = e;
    g->n_alts = k;
    g->n_rules = B->n_rules;
    g->n_sets = B->n_sets;
    g->root = root;
    *out = g;
    return CS_OK;
}

static void build_free(build_t *B) {
    for (int r = 0; r < B->n_rules; r++) {
        for (int a = 0; a < B->rules[r].n_alts; a++) free(B->rules[r].alts[a].s);
        free(B->rules[r].alts);
        free(B->rules[r].name);
    }
    for (int i = 0; i < B->n_cc; i++) free(B->cc[i].r);
    free(B->cc);
    free(B->rules);
    free(B->sets);
}

int grammar_compile(const char *gbnf, size_t len, grammar_t **out) {
    *out = NULL;
    build_t B = {.src = gbnf, .p = gbnf, .end = gbnf + len, .line_start = gbnf, .line = 1};
    int rc, root;
    if (!parse_rules(&B)) rc = B.rc;
    else if ((rc = check(&B, &root)) == CS_OK) rc = flatten(&B, root, out);
    build_free(&B);
    return rc;
}

grammar_t *grammar_ref(grammar_t *g) {
    if (g) atomic_fetch_add(&g->refs, 1);
    return g;
}

void grammar_unref(grammar_t *g) {
    if (!g || atomic_fetch_sub(&g->refs, 1) != 1) return;
    for (int i = 0; i < g->n_cache; i++) {
        free(g->cache[i].acc);
        free(g->cache[i].uncertain);
    }
    free(g->cache);
    for (int i = 0; i < g->n_unions; i++) free(g->unions[i].acc);
    free(g->unions);
    pthread_mutex_destroy(&g->cache_mu);
    free(g->elems);
    free(g->alt_start);
    free(g->rule_alt0);
    free(g->sets);
    free(g);
}

int grammar_n_rules(const grammar_t *g) { return g->n_rules; }
