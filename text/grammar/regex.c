/* regex.c: regular expressions (Python's re syntax, matched in full as re.fullmatch does) and
 * choices, translated to GBNF. A regular expression maps onto GBNF almost node for node:
 * literals, classes (built here as code-point ranges, so \d, \w, \s and their negations
 * combine inside a class), groups, alternation and the quantifiers; lazy quantifiers match
 * the same strings in full and are taken as greedy. \d, \w and \s have their ASCII meaning
 * ([0-9], [A-Za-z0-9_], [ \t\n\r\f\v]): Python's str patterns give them Unicode's, which no
 * constrained output needs. What a translation cannot express exactly is refused with the
 * construct and its offset: backreferences, lookaround, inline flags, word boundaries,
 * anchors other than ^ and \A at the start and $ and \Z at the end, possessive quantifiers. */
#include "text/grammar/grammar.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_CP 0x10FFFFu
#define MAX_COUNT 1000

typedef struct rx {
    const char *s;
    size_t n, i;
    cs_buf_t out;
    int depth;
    bool failed;
    bool json;      /* the matched text is the inside of a JSON string: " \ and controls escaped */
} rx_t;

typedef struct rset {
    uint32_t lo[256], hi[256];
    int n;
} rset_t;

static bool rfail(rx_t *r, const char *what) {
    if (!r->failed) cs_error_set(CS_EINVAL, "regex: %s (at %zu)", what, r->i);
    r->failed = true;
    return false;
}

static void put(rx_t *r, const char *s) { cs_buf_add(&r->out, s, strlen(s)); }

/* a code point inside a GBNF literal or class */
static void put_cp(rx_t *r, uint32_t c, bool in_class) {
    char b[16];
    if (c >= 0x20 && c < 0x7f && !strchr(in_class ? "\\]^-[\"" : "\\\"", (int)c)) snprintf(b, sizeof b, "%c", (char)c);
    else if (c < 0x100) snprintf(b, sizeof b, "\\x%02X", c);
    else if (c < 0x10000) snprintf(b, sizeof b, "\\u%04X", c);
    else snprintf(b, sizeof b, "\\U%08X", c);
    put(r, b);
}

static bool set_add(rx_t *r, rset_t *s, uint32_t lo, uint32_t hi) {
    if (s->n == 256) return rfail(r, "a character class with too many ranges");
    s->lo[s->n] = lo;
    s->hi[s->n++] = hi;
    return true;
}

static void set_sort(rset_t *s) { /* sort and merge */
    for (int i = 1; i < s->n; i++)
        for (int j = i; j > 0 && s->lo[j - 1] > s->lo[j]; j--) {
            uint32_t a = s->lo[j], b = s->hi[j];
            s->lo[j] = s->lo[j - 1];
            s->hi[j] = s->hi[j - 1];
            s->lo[j - 1] = a;
            s->hi[j - 1] = b;
        }
    int m = 0;
    for (int i = 0; i < s->n; i++) {
        if (m && s->lo[i] <= s->hi[m - 1] + 1) {
            if (s->hi[i] > s->hi[m - 1]) s->hi[m - 1] = s->hi[i];
        } else {
            s->lo[m] = s->lo[i];
            s->hi[m++] = s->hi[i];
        }
    }
    s->n = m;
}

static bool set_negate(rx_t *r, rset_t *s) {
    set_sort(s);
    rset_t t = {.n = 0};
    uint32_t next = 0;
    for (int i = 0; i < s->n; i++) {
        if (s->lo[i] > next && !set_add(r, &t, next, s->lo[i] - 1)) return false;
        next = s->hi[i] + 1;
    }
    if (next <= MAX_CP && !set_add(r, &t, next, MAX_CP)) return false;
    *s = t;
    return true;
}

/* \d \w \s (and negated) into s */
static bool add_shorthand(rx_t *r, rset_t *s, char c) {
    rset_t t = {.n = 0};
    char lc = (char)(c | 0x20);
    if (lc == 'd') set_add(r, &t, '0', '9');
    else if (lc == 'w') {
        set_add(r, &t, '0', '9');
        set_add(r, &t, 'A', 'Z');
        set_add(r, &t, 'a', 'z');
        set_add(r, &t, '_', '_');
    } else {
        set_add(r, &t, '\t', '\r'); /* \t \n \v \f \r */
        set_add(r, &t, ' ', ' ');
    }
    if (c != lc && !set_negate(r, &t)) return false;
    for (int i = 0; i < t.n; i++)
        if (!set_add(r, s, t.lo[i], t.hi[i])) return false;
    return true;
}

/* a character as the GBNF literal of its text: itself, or inside a JSON string its escape */
static void put_char_lit(rx_t *r, uint32_t c) {
    if (r->json && (c < 0x20 || c == '"' || c == '\\')) {
        char e[16];
        const char *named = c == '"' ? "\\\\\\\"" : c == '\\' ? "\\\\\\\\" : c == '\n' ? "\\\\n" : c == '\t' ? "\\\\t"
                          : c == '\r' ? "\\\\r" : c == '\b' ? "\\\\b" : c == '\f' ? "\\\\f" : NULL;
        if (named) snprintf(e, sizeof e, "\"%s\"", named);
        else snprintf(e, sizeof e, "\"\\\\u%04X\"", c);
        put(r, e);
        return;
    }
    put(r, "\"");
    put_cp(r, c, false);
    put(r, "\"");
}

static void put_ranges(rx_t *r, const rset_t *s) {
    put(r, "[");
    for (int i = 0; i < s->n; i++) {
        put_cp(r, s->lo[i], true);
        if (s->hi[i] > s->lo[i]) {
            put(r, "-");
            put_cp(r, s->hi[i], true);
        }
    }
    put(r, "]");
}

static void put_set(rx_t *r, rset_t *s) {
    set_sort(s);
    if (r->json) { /* the class less " \ and controls, and those as their escapes */
        rset_t plain = {.n = 0};
        uint32_t esc[40];
        int ne = 0;
        for (int i = 0; i < s->n; i++)
            for (uint32_t c = s->lo[i]; c <= s->hi[i] && c < 0x80; c++)
                if (c < 0x20 || c == '"' || c == '\\') esc[ne++] = c;
        rset_t cut = {.n = 3, .lo = {0, '"', '\\'}, .hi = {0x1F, '"', '\\'}};
        for (int i = 0; i < s->n; i++) { /* s minus cut */
            uint32_t lo = s->lo[i], hi = s->hi[i];
            for (int k = 0; k < cut.n && lo <= hi; k++) {
                if (cut.hi[k] < lo || cut.lo[k] > hi) continue;
                if (cut.lo[k] > lo) set_add(r, &plain, lo, cut.lo[k] - 1);
                lo = cut.hi[k] + 1;
            }
            if (lo <= hi) set_add(r, &plain, lo, hi);
        }
        put(r, "(");
        if (plain.n) put_ranges(r, &plain);
        for (int k = 0; k < ne; k++) {
            if (plain.n || k) put(r, " | ");
            put_char_lit(r, esc[k]);
        }
        put(r, ")");
        return;
    }
    put_ranges(r, s);
}

static int hexv(char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

/* one UTF-8 character at r->i */
static long utf8_at(rx_t *r) {
    unsigned char c = (unsigned char)r->s[r->i];
    int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (!n || r->i + (size_t)n > r->n) return rfail(r, "invalid UTF-8"), -1;
    long v = n == 1 ? c : n == 2 ? (c & 31) : n == 3 ? (c & 15) : (c & 7);
    for (int k = 1; k < n; k++) {
        unsigned char d = (unsigned char)r->s[r->i + (size_t)k];
        if ((d & 0xC0) != 0x80) return rfail(r, "invalid UTF-8"), -1;
        v = v << 6 | (d & 63);
    }
    if (v > (long)MAX_CP) return rfail(r, "invalid UTF-8"), -1; /* F5..F7 lead bytes */
    r->i += (size_t)n;
    return v;
}

/* An escape after '\\' (r->i at the letter): a code point (>= 0), or -2 with a shorthand class
 * added to s (when s is given), or -1 on an error. */
static long escape(rx_t *r, rset_t *s, bool in_class) {
    if (r->i >= r->n) return rfail(r, "a pattern ending in \\"), -1;
    char c = r->s[r->i++];
    int nd = c == 'x' ? 2 : c == 'u' ? 4 : c == 'U' ? 8 : 0;
    if (nd) {
        long v = 0;
        for (int k = 0; k < nd; k++) {
            int h = r->i < r->n ? hexv(r->s[r->i]) : -1;
            if (h < 0) return rfail(r, "a bad \\x, \\u or \\U escape"), -1;
            v = v * 16 + h;
            r->i++;
        }
        if (v > (long)MAX_CP) return rfail(r, "an escape beyond U+10FFFF"), -1;
        return v;
    }
    switch (c) {
    case 'n': return '\n';
    case 't': return '\t';
    case 'r': return '\r';
    case 'f': return '\f';
    case 'v': return '\v';
    case 'a': return 7;
    case '0': return 0;
    case 'd': case 'D': case 'w': case 'W': case 's': case 'S':
        if (!s) return rfail(r, "internal: a shorthand without a class"), -1;
        return add_shorthand(r, s, c) ? -2 : -1;
    case 'b': return in_class ? 8 : (rfail(r, "word boundaries (\\b) are not supported"), -1);
    case 'B': return rfail(r, "word boundaries (\\B) are not supported"), -1;
    case 'p': case 'P': return rfail(r, "Unicode property classes (\\p) are not supported"), -1;
    }
    if (c >= '1' && c <= '9') return rfail(r, "backreferences are not supported"), -1;
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return rfail(r, "an unknown escape"), -1;
    r->i--;
    return utf8_at(r); /* an escaped punctuation character: itself */
}

static bool parse_class(rx_t *r) {
    r->i++; /* [ */
    rset_t s = {.n = 0};
    bool neg = r->i < r->n && r->s[r->i] == '^';
    if (neg) r->i++;
    bool first = true;
    while (r->i < r->n && (r->s[r->i] != ']' || first)) {
        first = false;
        long lo;
        if (r->s[r->i] == '\\') {
            r->i++;
            lo = escape(r, &s, true);
        } else if (r->s[r->i] == '[' && r->i + 1 < r->n && r->s[r->i + 1] == ':') {
            return rfail(r, "POSIX classes ([:alpha:]) are not supported");
        } else {
            lo = utf8_at(r);
        }
        if (lo == -1) return false;
        if (lo == -2) continue;
        long hi = lo;
        if (r->i + 1 < r->n && r->s[r->i] == '-' && r->s[r->i + 1] != ']') {
            r->i++;
            if (r->s[r->i] == '\\') {
                r->i++;
                hi = escape(r, NULL, true);
            } else {
                hi = utf8_at(r);
            }
            if (hi < 0) return hi == -1 ? false : rfail(r, "a class range ending in a shorthand");
            if (hi < lo) return rfail(r, "a class range goes backwards");
        }
        if (!set_add(r, &s, (uint32_t)lo, (uint32_t)hi)) return false;
    }
    if (r->i >= r->n) return rfail(r, "an unterminated character class");
    r->i++;
    if (neg && !set_negate(r, &s)) return false;
    if (!s.n) return rfail(r, "a character class that matches nothing");
    put_set(r, &s);
    return true;
}

static bool parse_alt(rx_t *r);

static bool parse_count(rx_t *r, long *v) {
    if (r->i >= r->n || r->s[r->i] < '0' || r->s[r->i] > '9') return false;
    *v = 0;
    while (r->i < r->n && r->s[r->i] >= '0' && r->s[r->i] <= '9') {
        *v = *v * 10 + (r->s[r->i++] - '0');
        if (*v > MAX_COUNT) return rfail(r, "a repetition count above 1000");
    }
    return true;
}

/* a quantifier after an atom (written out at out[atom..]), if one follows */
static bool quantifier(rx_t *r, size_t atom) {
    if (r->i >= r->n) return true;
    char c = r->s[r->i];
    char q[48] = "";
    if (c == '*' || c == '+' || c == '?') {
        snprintf(q, sizeof q, "%c", c);
        r->i++;
    } else if (c == '{') {
        size_t save = r->i;
        long m, n = -1;
        r->i++;
        if (r->i < r->n && r->s[r->i] == ',') {
            m = 0; /* {,n}: Python's {0,n} */
        } else if (!parse_count(r, &m)) {
            if (r->failed) return false;
            r->i = save; /* not a quantifier: a literal '{' */
            return true;
        }
        if (r->i < r->n && r->s[r->i] == ',') {
            r->i++;
            if (r->i < r->n && r->s[r->i] != '}' && !parse_count(r, &n)) return r->failed ? false : rfail(r, "a bad {m,n}");
        } else {
            n = m;
        }
        if (r->i >= r->n || r->s[r->i] != '}') return rfail(r, "a bad {m,n}");
        r->i++;
        if (n >= 0 && n < m) return rfail(r, "{m,n} with n below m");
        if (n < 0) snprintf(q, sizeof q, "{%ld,}", m);
        else if (n == m) snprintf(q, sizeof q, "{%ld}", m);
        else snprintf(q, sizeof q, "{%ld,%ld}", m, n);
    } else {
        return true;
    }
    if (r->i < r->n && r->s[r->i] == '?') r->i++; /* lazy: the same strings in full */
    else if (r->i < r->n && r->s[r->i] == '+') return rfail(r, "possessive quantifiers are not supported");
    if (r->i < r->n && strchr("*+?", r->s[r->i])) return rfail(r, "a quantifier follows a quantifier");
    /* the atom in parentheses, then the operator */
    size_t len = r->out.len - atom;
    char *copy = malloc(len + 1);
    if (!copy) return rfail(r, "out of memory");
    memcpy(copy, r->out.p + atom, len);
    r->out.len = atom;
    put(r, "(");
    cs_buf_add(&r->out, copy, len);
    put(r, ")");
    put(r, q);
    free(copy);
    return true;
}

static bool parse_group(rx_t *r) {
    r->i++; /* ( */
    if (r->i < r->n && r->s[r->i] == '?') {
        const char *g = r->s + r->i;
        size_t left = r->n - r->i;
        if (left >= 2 && g[1] == ':') r->i += 2;
        else if (left >= 3 && g[1] == 'P' && g[2] == '<') {
            const char *e = memchr(g, '>', left);
            if (!e) return rfail(r, "an unterminated group name");
            r->i += (size_t)(e - g) + 1;
        } else if (left >= 2 && (g[1] == '=' || g[1] == '!')) return rfail(r, "lookahead is not supported");
        else if (left >= 3 && g[1] == '<' && (g[2] == '=' || g[2] == '!')) return rfail(r, "lookbehind is not supported");
        else if (left >= 3 && g[1] == 'P' && g[2] == '=') return rfail(r, "backreferences are not supported");
        else if (left >= 2 && g[1] == '#') return rfail(r, "comments (?#...) are not supported");
        else if (left >= 2 && g[1] == '(') return rfail(r, "conditional groups are not supported");
        else return rfail(r, "inline flags and other (? groups are not supported");
    }
    if (++r->depth > 200) return rfail(r, "groups nested too deeply");
    put(r, "(");
    if (!parse_alt(r)) return false;
    if (r->i >= r->n || r->s[r->i] != ')') return rfail(r, "an unbalanced parenthesis");
    r->i++;
    r->depth--;
    put(r, ")");
    return true;
}

static bool parse_seq(rx_t *r) {
    bool any = false;
    while (r->i < r->n && r->s[r->i] != '|' && r->s[r->i] != ')') {
        size_t atom = r->out.len;
        if (any) put(r, " ");
        atom = r->out.len;
        char c = r->s[r->i];
        if (c == '(') {
            if (!parse_group(r)) return false;
        } else if (c == '[') {
            if (!parse_class(r)) return false;
        } else if (c == '.') {
            r->i++;
            rset_t dot = {.n = 2, .lo = {0, '\n' + 1}, .hi = {'\n' - 1, MAX_CP}};
            put_set(r, &dot);
        } else if (c == '^' || c == '$') {
            bool start = c == '^' && r->i == 0, end = c == '$' && r->i + 1 == r->n;
            if (!start && !end) return rfail(r, "anchors (^ and $) are supported only at the ends");
            r->i++;
            if (any) r->out.len--; /* the space */
            continue;
        } else if (c == '*' || c == '+' || c == '?') {
            return rfail(r, "nothing to repeat");
        } else if (c == '\\') {
            if (r->i + 1 < r->n && (r->s[r->i + 1] == 'A' || r->s[r->i + 1] == 'Z')) {
                bool ok = r->s[r->i + 1] == 'A' ? r->i == 0 : r->i + 2 == r->n;
                if (!ok) return rfail(r, "anchors (\\A, \\Z) are supported only at the ends");
                r->i += 2;
                if (any) r->out.len--;
                continue;
            }
            r->i++;
            rset_t s = {.n = 0};
            long cp = escape(r, &s, false);
            if (cp == -1) return false;
            if (cp == -2) put_set(r, &s);
            else put_char_lit(r, (uint32_t)cp);
        } else {
            long cp = utf8_at(r);
            if (cp < 0) return false;
            put_char_lit(r, (uint32_t)cp);
        }
        if (!quantifier(r, atom)) return false;
        any = true;
    }
    if (!any) put(r, "\"\"");
    return true;
}

static bool parse_alt(rx_t *r) {
    if (!parse_seq(r)) return false;
    while (r->i < r->n && r->s[r->i] == '|') {
        r->i++;
        put(r, " | ");
        if (!parse_seq(r)) return false;
    }
    return true;
}

static int to_gbnf(const char *re, size_t len, bool json, char **gbnf) {
    *gbnf = NULL;
    rx_t r = {.s = re, .n = len, .json = json};
    put(&r, "root ::= ");
    bool ok = parse_alt(&r);
    if (ok && r.i < r.n) ok = rfail(&r, "an unbalanced parenthesis");
    if (!ok || !cs_buf_add(&r.out, "\n", 2)) {
        free(r.out.p);
        return r.failed ? CS_EINVAL : cs_error_set(CS_ENOMEM, "out of memory");
    }
    *gbnf = r.out.p;
    return CS_OK;
}

int grammar_regex_to_gbnf(const char *re, size_t len, char **gbnf) { return to_gbnf(re, len, false, gbnf); }

int grammar_json_pattern_to_gbnf(const char *re, size_t len, char **gbnf) { return to_gbnf(re, len, true, gbnf); }

int grammar_choice_to_gbnf(const char *const *choices, int n, char **gbnf) {
    *gbnf = NULL;
    if (n <= 0) return cs_error_set(CS_EINVAL, "choice: the list is empty");
    rx_t r = {.s = "", .n = 0};
    put(&r, "root ::= ");
    for (int k = 0; k < n; k++) {
        if (k) put(&r, " | ");
        put(&r, "\"");
        r.s = choices[k];
        r.n = strlen(choices[k]);
        r.i = 0;
        while (r.i < r.n) {
            long cp = utf8_at(&r);
            if (cp < 0) {
                free(r.out.p);
                return CS_EINVAL;
            }
            put_cp(&r, (uint32_t)cp, false);
        }
        put(&r, "\"");
    }
    if (!cs_buf_add(&r.out, "\n", 2)) {
        free(r.out.p);
        return cs_error_set(CS_ENOMEM, "out of memory");
    }
    *gbnf = r.out.p;
    return CS_OK;
}
