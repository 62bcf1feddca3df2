/* lark.c: the Lark grammar form (what vLLM's guided_grammar and structured_outputs.grammar
 * take besides GBNF) translated to GBNF. Rules (lowercase) and terminals (UPPERCASE), `?` and
 * `!` rule prefixes, priorities, `-> alias`, "literals" (with the i flag), "a".."z" ranges,
 * /regular expressions/ (Python re, through regex.c), ( ) groups, [ ] optionals, ? * + and
 * ~ n / ~ n..m (and {n,m}) repeats, `|` on continuation lines, // comments, %import of the
 * common terminals, and %ignore: the ignored terminals may stand before the first token and
 * after any token of a rule (not inside a terminal), which is what Lark's lexer does. A rule
 * that starts with itself (expr: expr "+" term | term) is rewritten without the left
 * recursion. The start rule is `start`.
 *
 * Refused with the construct and its line: templates, %declare, %override, %extend, imports
 * other than common, regex flags, a rule inside a terminal. Priorities choose between parses
 * in Lark and do not change which texts match, so they are read and dropped.
 *
 * The common terminals are given their intended languages: ESCAPED_STRING is a double-quoted
 * string with backslash escapes and no newline, C_COMMENT ends at the first star-slash. */
#include "text/grammar/grammar.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_TOKENS (1 << 20)
#define MAX_DEPTH 200

typedef enum { K_NAME, K_STRING, K_REGEX, K_NUM, K_OP, K_NL, K_DIRECTIVE, K_END } kind_t;

typedef struct tok {
    kind_t k;
    const char *s; /* the token's text (a string with its quotes, a regex with its slashes) */
    size_t n;
    int line;
} tok_t;

typedef struct lark {
    const char *src;
    size_t len;
    tok_t *t;
    int n_t, cap_t, i;
    cs_buf_t out;
    bool failed, ignore, in_term;
    int depth;
    const char *cur; /* the rule being translated, for the left-recursion rewrite */
    size_t cur_n;
    /* names defined and used, for the undefined-name message */
    char **defs;
    int n_defs, cap_defs;
} lark_t;

static bool lfail(lark_t *L, int line, const char *fmt, ...) {
    if (L->failed) return false;
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    cs_error_set(CS_EINVAL, "Lark grammar: %s (line %d)", msg, line);
    L->failed = true;
    return false;
}

static void put(lark_t *L, const char *s) { cs_buf_add(&L->out, s, strlen(s)); }
static void putn(lark_t *L, const char *s, size_t n) { cs_buf_add(&L->out, s, n); }

static bool is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
static bool is_name_char(char c) { return is_name_start(c) || (c >= '0' && c <= '9'); }

static bool add_tok(lark_t *L, kind_t k, const char *s, size_t n, int line) {
    if (L->n_t == MAX_TOKENS) return lfail(L, line, "too long");
    if (L->n_t == L->cap_t) {
        int cap = L->cap_t ? L->cap_t * 2 : 256;
        tok_t *t = realloc(L->t, sizeof *t * (size_t)cap);
        if (!t) return lfail(L, line, "out of memory");
        L->t = t;
        L->cap_t = cap;
    }
    L->t[L->n_t++] = (tok_t){k, s, n, line};
    return true;
}

/* Tokens; a newline followed (past blank and comment lines) by `|` continues the statement. */
static bool lex(lark_t *L) {
    const char *p = L->src, *e = L->src + L->len;
    int line = 1;
    while (p < e) {
        char c = *p;
        if (c == ' ' || c == '\t' || c == '\r') { p++; continue; }
        if (c == '/' && p + 1 < e && p[1] == '/') {
            while (p < e && *p != '\n') p++;
            continue;
        }
        if (c == '\n') {
            line++;
            p++;
            const char *q = p;
            int l2 = line;
            for (;;) { /* a continuation? */
                while (q < e && (*q == ' ' || *q == '\t' || *q == '\r')) q++;
                if (q + 1 < e && q[0] == '/' && q[1] == '/') while (q < e && *q != '\n') q++;
                if (q < e && *q == '\n') { q++; l2++; continue; }
                break;
            }
            if (q < e && *q == '|') {
                p = q;
                line = l2;
                continue;
            }
            if (L->n_t && L->t[L->n_t - 1].k != K_NL && !add_tok(L, K_NL, p - 1, 1, line - 1)) return false;
            continue;
        }
        const char *s = p;
        if (c == '"') {
            p++;
            while (p < e && *p != '"' && *p != '\n') p += (*p == '\\' && p + 1 < e) ? 2 : 1;
            if (p >= e || *p != '"') return lfail(L, line, "a string runs past the end of the line");
            p++;
            if (p < e && *p == 'i') p++;
            if (!add_tok(L, K_STRING, s, (size_t)(p - s), line)) return false;
        } else if (c == '/') {
            p++;
            while (p < e && *p != '/' && *p != '\n') p += (*p == '\\' && p + 1 < e) ? 2 : 1;
            if (p >= e || *p != '/') return lfail(L, line, "a regular expression runs past the end of the line");
            p++;
            while (p < e && strchr("imslux", *p) && *p) p++;
            if (!add_tok(L, K_REGEX, s, (size_t)(p - s), line)) return false;
        } else if (is_name_start(c)) {
            while (p < e && is_name_char(*p)) p++;
            if (!add_tok(L, K_NAME, s, (size_t)(p - s), line)) return false;
        } else if (c >= '0' && c <= '9') {
            while (p < e && *p >= '0' && *p <= '9') p++;
            if (!add_tok(L, K_NUM, s, (size_t)(p - s), line)) return false;
        } else if (c == '%') {
            p++;
            while (p < e && is_name_char(*p)) p++;
            if (!add_tok(L, K_DIRECTIVE, s, (size_t)(p - s), line)) return false;
        } else if ((c == '-' && p + 1 < e && p[1] == '>') || (c == '.' && p + 1 < e && p[1] == '.')) {
            p += 2;
            if (!add_tok(L, K_OP, s, 2, line)) return false;
        } else if (strchr(":|()[]?*+~.,{}!", c)) {
            p++;
            if (!add_tok(L, K_OP, s, 1, line)) return false;
        } else {
            return lfail(L, line, "unexpected character '%c'", c);
        }
    }
    if (L->n_t && L->t[L->n_t - 1].k != K_NL && !add_tok(L, K_NL, e, 0, line)) return false;
    return add_tok(L, K_END, e, 0, line);
}

static tok_t *peek(lark_t *L) { return &L->t[L->i]; }
static bool is_op(const tok_t *t, const char *op) { return t->k == K_OP && t->n == strlen(op) && !memcmp(t->s, op, t->n); }
static bool is_term_name(const char *s, size_t n) { /* an UPPERCASE name (a leading _ allowed) */
    size_t i = 0;
    while (i < n && s[i] == '_') i++;
    return i < n && s[i] >= 'A' && s[i] <= 'Z';
}

/* a Lark name in GBNF: the same, but "root" (GBNF's start) becomes lark-root */
static void put_name(lark_t *L, const char *s, size_t n) {
    if (n == 4 && !memcmp(s, "root", 4)) put(L, "lark-root");
    else putn(L, s, n);
}

static void put_cp(lark_t *L, uint32_t c) {
    char b[16];
    if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\') snprintf(b, sizeof b, "%c", (char)c);
    else if (c < 0x100) snprintf(b, sizeof b, "\\x%02X", c);
    else if (c < 0x10000) snprintf(b, sizeof b, "\\u%04X", c);
    else snprintf(b, sizeof b, "\\U%08X", c);
    put(L, b);
}

static void put_class_cp(lark_t *L, uint32_t c) {
    char b[16];
    if (c >= 0x20 && c < 0x7f && !strchr("\\]^-[\"", (int)c)) snprintf(b, sizeof b, "%c", (char)c);
    else if (c < 0x100) snprintf(b, sizeof b, "\\x%02X", c);
    else if (c < 0x10000) snprintf(b, sizeof b, "\\u%04X", c);
    else snprintf(b, sizeof b, "\\U%08X", c);
    put(L, b);
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* The code points of a string token ("..." as Python reads the literal). Returns the count,
 * -1 on a bad escape or bad UTF-8. */
static int decode(lark_t *L, const tok_t *t, uint32_t *cp, int cap, bool *icase) {
    const char *p = t->s + 1, *e = t->s + t->n - 1;
    *icase = false;
    if (e[0] == 'i') {
        *icase = true;
        e--;
    }
    int n = 0;
    while (p < e) {
        if (n == cap) return lfail(L, t->line, "a string longer than %d characters", cap), -1;
        unsigned char c = (unsigned char)*p;
        if (c == '\\' && p + 1 < e) {
            char x = p[1];
            p += 2;
            const char *simple = "\\\\\"\"''n\nt\tr\rf\fv\va\ab\b";
            const char *f = NULL;
            for (const char *q = simple; *q; q += 2)
                if (*q == x) { f = q; break; }
            if (f) { cp[n++] = (unsigned char)f[1]; continue; }
            int digits = x == 'x' ? 2 : x == 'u' ? 4 : x == 'U' ? 8 : 0;
            if (digits) {
                uint32_t v = 0;
                for (int k = 0; k < digits; k++, p++) {
                    int h = p < e ? hexval(*p) : -1;
                    if (h < 0) return lfail(L, t->line, "\\%c needs %d hex digits", x, digits), -1;
                    v = v * 16 + (uint32_t)h;
                }
                if (v > 0x10FFFF) return lfail(L, t->line, "a code point above U+10FFFF"), -1;
                cp[n++] = v;
                continue;
            }
            if (x >= '0' && x <= '7') { /* octal, up to three digits */
                uint32_t v = (uint32_t)(x - '0');
                for (int k = 0; k < 2 && p < e && *p >= '0' && *p <= '7'; k++, p++) v = v * 8 + (uint32_t)(*p - '0');
                cp[n++] = v;
                continue;
            }
            if (x == 'N') return lfail(L, t->line, "\\N{...} escapes are not supported"), -1;
            cp[n++] = '\\'; /* Python keeps an unknown escape as it is */
            if (n == cap) return lfail(L, t->line, "a string longer than %d characters", cap), -1;
            p--;
            continue;
        }
        int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        if (!len || p + len > e) return lfail(L, t->line, "a string that is not UTF-8"), -1;
        uint32_t v = len == 1 ? c : (uint32_t)(c & (0x7F >> len));
        for (int k = 1; k < len; k++) {
            if (((unsigned char)p[k] & 0xC0) != 0x80) return lfail(L, t->line, "a string that is not UTF-8"), -1;
            v = (v << 6) | ((unsigned char)p[k] & 0x3F);
        }
        if (v > 0x10FFFF) return lfail(L, t->line, "a string that is not UTF-8"), -1;
        cp[n++] = v;
        p += len;
    }
    return n;
}

/* a string literal as GBNF: "abc", or with the i flag [aA] [bB] "c" per character */
static bool put_string(lark_t *L, const tok_t *t) {
    uint32_t cp[4096];
    bool icase;
    int n = decode(L, t, cp, 4096, &icase);
    if (n < 0) return false;
    if (!icase || n == 0) {
        put(L, "\"");
        for (int k = 0; k < n; k++) put_cp(L, cp[k]);
        put(L, "\"");
        return true;
    }
    put(L, "(");
    for (int k = 0; k < n; k++) {
        uint32_t c = cp[k];
        if (c >= 0x80) return lfail(L, t->line, "the i flag on a string with characters beyond ASCII");
        put(L, " ");
        if ((c | 0x20) >= 'a' && (c | 0x20) <= 'z') {
            char b[8];
            snprintf(b, sizeof b, "[%c%c]", (char)(c | 0x20), (char)(c & ~0x20u));
            put(L, b);
        } else {
            put(L, "\"");
            put_cp(L, c);
            put(L, "\"");
        }
    }
    put(L, " )");
    return true;
}

static bool put_regex(lark_t *L, const tok_t *t) {
    const char *end = t->s + t->n;
    while (end[-1] != '/') end--;
    if (end != t->s + t->n)
        return lfail(L, t->line, "regular expression flags (/.../%.*s) are not supported", (int)(t->s + t->n - end), end);
    /* \/ is / inside the slashes; Python's re reads \/ as / too */
    char *g = NULL;
    if (grammar_regex_to_gbnf(t->s + 1, t->n - 2, &g)) {
        char msg[200];
        snprintf(msg, sizeof msg, "%s", cs_error_last());
        return lfail(L, t->line, "%.*s: %s", (int)(t->n > 60 ? 60 : t->n), t->s, msg);
    }
    const char *body = strstr(g, "::= ") + 4;
    put(L, "(");
    putn(L, body, strlen(body) - 1);
    put(L, ")");
    free(g);
    return true;
}

static bool alts(lark_t *L);

/* an atom with its repeat, in GBNF; in a rule under %ignore each token is followed by the
 * ignored terminals */
static bool item(lark_t *L) {
    tok_t *t = peek(L);
    bool tokenish = true; /* a terminal-level atom: gets the trailing ignore in a rule */
    size_t mark = L->out.len;
    if (++L->depth > MAX_DEPTH) return lfail(L, t->line, "nested too deeply");
    if (t->k == K_NAME) {
        L->i++;
        bool term = is_term_name(t->s, t->n);
        if (L->in_term && !term)
            return lfail(L, t->line, "the terminal uses the rule '%.*s' (terminals may use only terminals)", (int)t->n, t->s);
        if (is_op(peek(L), "{") && L->t[L->i + 1].k != K_NUM) /* name{args}: a template */
            return lfail(L, t->line, "templates are not supported");
        put_name(L, t->s, t->n);
        tokenish = term;
    } else if (t->k == K_STRING) {
        L->i++;
        if (is_op(peek(L), "..")) {
            L->i++;
            tok_t *u = peek(L);
            if (u->k != K_STRING) return lfail(L, u->line, "expecting a string after '..'");
            L->i++;
            uint32_t a[2], b[2];
            bool ia, ib;
            int na = decode(L, t, a, 2, &ia), nb = decode(L, u, b, 2, &ib);
            if (na < 0 || nb < 0) return false;
            if (na != 1 || nb != 1 || ia || ib) return lfail(L, t->line, "a range needs two one-character strings");
            if (a[0] > b[0]) return lfail(L, t->line, "a range that runs backwards");
            put(L, "[");
            put_class_cp(L, a[0]);
            put(L, "-");
            put_class_cp(L, b[0]);
            put(L, "]");
        } else if (!put_string(L, t)) {
            return false;
        }
    } else if (t->k == K_REGEX) {
        L->i++;
        if (!put_regex(L, t)) return false;
    } else if (is_op(t, "(") || is_op(t, "[")) {
        bool opt = is_op(t, "[");
        L->i++;
        put(L, "(");
        if (!alts(L)) return false;
        if (!is_op(peek(L), opt ? "]" : ")")) return lfail(L, peek(L)->line, "expecting '%s'", opt ? "]" : ")");
        L->i++;
        put(L, opt ? ")?" : ")");
        tokenish = false;
    } else {
        return lfail(L, t->line, "unexpected '%.*s'", (int)(t->n ? t->n : 3), t->n ? t->s : "end");
    }
    bool ign = tokenish && L->ignore && !L->in_term;
    tok_t *q = peek(L);
    const char *rep = NULL;
    char buf[48];
    if (is_op(q, "?") || is_op(q, "*") || is_op(q, "+")) {
        rep = q->s[0] == '?' ? "?" : q->s[0] == '*' ? "*" : "+";
        L->i++;
    } else if (is_op(q, "~") || is_op(q, "{")) {
        bool brace = is_op(q, "{");
        L->i++;
        tok_t *a = peek(L);
        if (a->k != K_NUM) return lfail(L, a->line, "expecting a number after '%s'", brace ? "{" : "~");
        L->i++;
        long lo = strtol(a->s, NULL, 10), hi = lo;
        if ((!brace && is_op(peek(L), "..")) || (brace && is_op(peek(L), ","))) {
            L->i++;
            tok_t *b = peek(L);
            if (brace && is_op(b, "}")) hi = -1;
            else if (b->k != K_NUM) return lfail(L, b->line, "expecting a number");
            else {
                L->i++;
                hi = strtol(b->s, NULL, 10);
            }
        }
        if (brace) {
            if (!is_op(peek(L), "}")) return lfail(L, peek(L)->line, "expecting '}'");
            L->i++;
        }
        if (hi >= 0 && hi < lo) return lfail(L, a->line, "a repeat whose maximum is below its minimum");
        if (hi < 0) snprintf(buf, sizeof buf, "{%ld,}", lo);
        else if (hi == lo) snprintf(buf, sizeof buf, "{%ld}", lo);
        else snprintf(buf, sizeof buf, "{%ld,%ld}", lo, hi);
        rep = buf;
    }
    if (ign || rep) { /* wrap what was written: ( atom lark-ign )rep */
        size_t n = L->out.len - mark;
        char *atom = malloc(n + 1);
        if (!atom) return lfail(L, t->line, "out of memory");
        memcpy(atom, L->out.p + mark, n);
        atom[n] = 0;
        L->out.len = mark;
        if (ign && rep) put(L, "(");
        put(L, atom);
        if (ign) put(L, " lark-ign");
        if (ign && rep) put(L, ")");
        if (rep) put(L, rep);
        free(atom);
    }
    L->depth--;
    return true;
}

static bool at_seq_end(lark_t *L) {
    tok_t *t = peek(L);
    return t->k == K_NL || t->k == K_END || is_op(t, "|") || is_op(t, ")") || is_op(t, "]") || is_op(t, "->");
}

static bool seq(lark_t *L) {
    bool any = false;
    while (!at_seq_end(L)) {
        if (any) put(L, " ");
        if (!item(L)) return false;
        any = true;
    }
    if (is_op(peek(L), "->")) { /* an alias names the tree node: nothing to match */
        L->i++;
        if (peek(L)->k != K_NAME) return lfail(L, peek(L)->line, "expecting a name after '->'");
        L->i++;
    }
    if (!any) put(L, "\"\"");
    return true;
}

static bool alts(lark_t *L) {
    if (!seq(L)) return false;
    while (is_op(peek(L), "|")) {
        L->i++;
        put(L, " | ");
        if (!seq(L)) return false;
    }
    return true;
}

/* the common terminals (lark/grammars/common.lark) by their intended languages */
static const struct { const char *name, *gbnf; } COMMON[] = {
    {"DIGIT", "[0-9]"},
    {"HEXDIGIT", "[a-fA-F0-9]"},
    {"INT", "[0-9]+"},
    {"SIGNED_INT", "[+-]? [0-9]+"},
    {"DECIMAL", "[0-9]+ \".\" [0-9]* | \".\" [0-9]+"},
    {"FLOAT", "[0-9]+ [eE] [+-]? [0-9]+ | ([0-9]+ \".\" [0-9]* | \".\" [0-9]+) ([eE] [+-]? [0-9]+)?"},
    {"SIGNED_FLOAT", "[+-]? ([0-9]+ [eE] [+-]? [0-9]+ | ([0-9]+ \".\" [0-9]* | \".\" [0-9]+) ([eE] [+-]? [0-9]+)?)"},
    {"NUMBER", "[0-9]+ ([eE] [+-]? [0-9]+)? | ([0-9]+ \".\" [0-9]* | \".\" [0-9]+) ([eE] [+-]? [0-9]+)?"},
    {"SIGNED_NUMBER", "[+-]? ([0-9]+ ([eE] [+-]? [0-9]+)? | ([0-9]+ \".\" [0-9]* | \".\" [0-9]+) ([eE] [+-]? [0-9]+)?)"},
    {"ESCAPED_STRING", "\"\\\"\" ([^\"\\\\\\n] | \"\\\\\" [^\\n])* \"\\\"\""},
    {"LCASE_LETTER", "[a-z]"},
    {"UCASE_LETTER", "[A-Z]"},
    {"LETTER", "[a-zA-Z]"},
    {"WORD", "[a-zA-Z]+"},
    {"CNAME", "[_a-zA-Z] [_a-zA-Z0-9]*"},
    {"WS_INLINE", "[ \\t]+"},
    {"WS", "[ \\t\\f\\r\\n]+"},
    {"CR", "\"\\r\""},
    {"LF", "\"\\n\""},
    {"NEWLINE", "(\"\\r\"? \"\\n\")+"},
    {"C_COMMENT", "\"/*\" ([^*] | \"*\"+ [^*/])* \"*\"+ \"/\""},
    {"CPP_COMMENT", "\"//\" [^\\n]*"},
    {"SH_COMMENT", "\"#\" [^\\n]*"},
    {"SQL_COMMENT", "\"--\" [^\\n]*"},
};

static bool defined(lark_t *L, const char *s, size_t n) {
    for (int k = 0; k < L->n_defs; k++)
        if (strlen(L->defs[k]) == n && !memcmp(L->defs[k], s, n)) return true;
    return false;
}

static bool define(lark_t *L, const char *s, size_t n, int line) {
    if (defined(L, s, n)) return lfail(L, line, "'%.*s' is defined twice", (int)n, s);
    if (L->n_defs == L->cap_defs) {
        int cap = L->cap_defs ? L->cap_defs * 2 : 32;
        char **d = realloc(L->defs, sizeof *d * (size_t)cap);
        if (!d) return lfail(L, line, "out of memory");
        L->defs = d;
        L->cap_defs = cap;
    }
    if (!(L->defs[L->n_defs] = strndup(s, n))) return lfail(L, line, "out of memory");
    L->n_defs++;
    return true;
}

static void skip_statement(lark_t *L) {
    while (peek(L)->k != K_NL && peek(L)->k != K_END) L->i++;
    if (peek(L)->k == K_NL) L->i++;
}

/* %import common.NAME [-> ALIAS] | %import common (A, B, ...) */
static bool import(lark_t *L, int line) {
    tok_t *m = peek(L);
    if (m->k != K_NAME || m->n != 6 || memcmp(m->s, "common", 6))
        return lfail(L, line, "only %%import common.NAME is supported");
    L->i++;
    const char *names[64];
    size_t lens[64];
    int n = 0;
    if (is_op(peek(L), ".")) {
        L->i++;
        if (peek(L)->k != K_NAME) return lfail(L, line, "expecting a name after 'common.'");
        names[n] = peek(L)->s;
        lens[n++] = peek(L)->n;
        L->i++;
    } else if (is_op(peek(L), "(")) {
        L->i++;
        while (peek(L)->k == K_NAME && n < 64) {
            names[n] = peek(L)->s;
            lens[n++] = peek(L)->n;
            L->i++;
            if (is_op(peek(L), ",")) L->i++;
        }
        if (!is_op(peek(L), ")")) return lfail(L, line, "expecting ')' after the imported names");
        L->i++;
    } else {
        return lfail(L, line, "expecting '.' or '(' after %%import common");
    }
    const char *alias = NULL;
    size_t alias_n = 0;
    if (is_op(peek(L), "->")) {
        L->i++;
        if (peek(L)->k != K_NAME || n != 1) return lfail(L, line, "expecting one name after '->'");
        alias = peek(L)->s;
        alias_n = peek(L)->n;
        L->i++;
    }
    if (peek(L)->k != K_NL && peek(L)->k != K_END) return lfail(L, line, "unexpected text after the import");
    for (int k = 0; k < n; k++) {
        int c = -1;
        for (int j = 0; j < (int)CS_ARRAY_LEN(COMMON); j++)
            if (strlen(COMMON[j].name) == lens[k] && !memcmp(COMMON[j].name, names[k], lens[k])) c = j;
        if (c < 0) return lfail(L, line, "common.%.*s is not a terminal of common", (int)lens[k], names[k]);
        const char *as = alias ? alias : names[k];
        size_t as_n = alias ? alias_n : lens[k];
        if (!define(L, as, as_n, line)) return false;
        put_name(L, as, as_n);
        put(L, " ::= ");
        put(L, COMMON[c].gbnf);
        put(L, "\n");
    }
    return true;
}

/* names used but not defined (definitions, aliases and imports aside) */
static bool check_refs(lark_t *L) {
    bool import = false;
    for (int k = 0; k < L->n_t; k++) {
        tok_t *t = &L->t[k], *prev = k ? &L->t[k - 1] : NULL;
        if (t->k == K_DIRECTIVE) import = t->n == 7 && !memcmp(t->s, "%import", 7);
        if (t->k == K_NL) import = false;
        if (t->k != K_NAME || import) continue;
        if (!prev || prev->k == K_NL) continue; /* a definition */
        if ((is_op(prev, "?") || is_op(prev, "!")) && (k < 2 || L->t[k - 2].k == K_NL)) continue;
        if (is_op(prev, "->")) continue;
        if (!defined(L, t->s, t->n)) return lfail(L, t->line, "'%.*s' is used but not defined", (int)t->n, t->s);
    }
    return true;
}

/* rule NAME: alternatives, with a direct left recursion (NAME: NAME x | y) rewritten as
 * NAME: (y) (x)* */
static bool rule(lark_t *L, const tok_t *name) {
    size_t mark = L->out.len;
    cs_buf_t rec = {0}, base = {0};
    bool ok = true;
    for (;;) {
        tok_t *t = peek(L);
        bool self = !L->in_term && t->k == K_NAME && t->n == name->n && !memcmp(t->s, name->s, t->n);
        if (self) {
            tok_t *q = &L->t[L->i + 1];
            if (is_op(q, "?") || is_op(q, "*") || is_op(q, "+") || is_op(q, "~") || is_op(q, "{")) self = false;
        }
        if (self) L->i++;
        size_t at = L->out.len;
        if (!seq(L)) { ok = false; break; }
        cs_buf_t *dst = self ? &rec : &base;
        if (dst->len) cs_buf_add(dst, " | ", 3);
        cs_buf_add(dst, L->out.p + at, L->out.len - at);
        L->out.len = at;
        if (!is_op(peek(L), "|")) break;
        L->i++;
    }
    if (ok && rec.len && !base.len) ok = lfail(L, name->line, "every alternative of '%.*s' starts with itself", (int)name->n, name->s);
    if (ok) {
        L->out.len = mark;
        put(L, "(");
        putn(L, base.p, base.len);
        put(L, ")");
        if (rec.len) {
            put(L, " (");
            putn(L, rec.p, rec.len);
            put(L, ")*");
        }
    }
    free(rec.p);
    free(base.p);
    return ok;
}

/* the name token of the next rule or terminal definition (past a ? or !), directives
 * skipped; NULL at the end */
static tok_t *next_definition(lark_t *L) {
    while (peek(L)->k == K_DIRECTIVE) skip_statement(L);
    if (peek(L)->k == K_END) return NULL;
    if (is_op(peek(L), "?") || is_op(peek(L), "!")) L->i++;
    return peek(L);
}

int grammar_lark_to_gbnf(const char *src, size_t len, char **gbnf) {
    *gbnf = NULL;
    lark_t L0 = {.src = src, .len = len}, *L = &L0;
    bool ok = lex(L);
    /* pass 1: the directives (%ignore must be known before any rule is written) */
    cs_buf_t ign = {0};
    for (L->i = 0; ok && peek(L)->k != K_END;) {
        tok_t *t = peek(L);
        if (t->k != K_DIRECTIVE) {
            skip_statement(L);
            continue;
        }
        L->i++;
        if (t->n == 7 && !memcmp(t->s, "%ignore", 7)) {
            L->in_term = true;
            size_t at = L->out.len;
            ok = alts(L);
            if (ok && peek(L)->k != K_NL && peek(L)->k != K_END) ok = lfail(L, t->line, "unexpected text after %%ignore");
            if (ok) {
                if (ign.len) cs_buf_add(&ign, " | ", 3);
                cs_buf_add(&ign, L->out.p + at, L->out.len - at);
            }
            L->out.len = at;
            L->in_term = false;
        } else if (t->n == 7 && !memcmp(t->s, "%import", 7)) {
            ok = import(L, t->line);
        } else {
            ok = lfail(L, t->line, "%.*s is not supported", (int)t->n, t->s);
        }
        if (ok) skip_statement(L);
    }
    L->ignore = ign.len > 0;
    /* the definitions' names, then pass 2: the rules and terminals */
    L->i = 0;
    for (tok_t *t; ok && (t = next_definition(L));) {
        if (t->k != K_NAME) ok = lfail(L, t->line, "expecting a rule or terminal name");
        else if (is_op(&L->t[L->i + 1], "{")) ok = lfail(L, t->line, "templates are not supported");
        else ok = define(L, t->s, t->n, t->line);
        skip_statement(L);
    }
    if (ok) ok = check_refs(L);
    bool has_start = ok && defined(L, "start", 5), has_root = ok && defined(L, "root", 4);
    if (ok && !has_start && !has_root) ok = lfail(L, 1, "no rule named 'start'");
    if (ok && has_start && has_root) ok = lfail(L, 1, "both 'start' and 'root' are defined; the start rule is 'start'");
    if (ok) {
        put(L, L->ignore ? "root ::= lark-ign " : "root ::= ");
        put(L, has_start ? "start\n" : "lark-root\n");
        if (L->ignore) {
            put(L, "lark-ign ::= (");
            putn(L, ign.p, ign.len);
            put(L, ")*\n");
        }
    }
    L->i = 0;
    for (tok_t *t; ok && (t = next_definition(L));) {
        L->i++;
        L->in_term = is_term_name(t->s, t->n);
        if (is_op(peek(L), ".")) { /* a priority */
            L->i++;
            if (is_op(peek(L), "-") || peek(L)->k == K_NUM) L->i++;
            else {
                ok = lfail(L, t->line, "expecting a number after '.'");
                break;
            }
        }
        if (!is_op(peek(L), ":")) {
            ok = lfail(L, t->line, "expecting ':' after '%.*s'", (int)t->n, t->s);
            break;
        }
        L->i++;
        put_name(L, t->s, t->n);
        put(L, " ::= ");
        ok = rule(L, t);
        if (ok && peek(L)->k != K_NL && peek(L)->k != K_END)
            ok = lfail(L, peek(L)->line, "unexpected '%.*s'", (int)peek(L)->n, peek(L)->s);
        put(L, "\n");
        skip_statement(L);
    }
    for (int k = 0; k < L->n_defs; k++) free(L->defs[k]);
    free(L->defs);
    free(L->t);
    free(ign.p);
    if (ok && !cs_buf_add(&L->out, "", 1)) ok = lfail(L, 1, "out of memory");
    if (!ok) {
        free(L->out.p);
        return L->failed ? CS_EINVAL : cs_error_set(CS_ENOMEM, "out of memory");
    }
    *gbnf = L->out.p;
    return CS_OK;
}

bool grammar_is_lark(const char *src, size_t len) {
    /* GBNF defines rules with ::=; Lark with ':' (vLLM tells them apart the same way) */
    for (size_t i = 0; i + 2 < len; i++)
        if (src[i] == ':' && src[i + 1] == ':' && src[i + 2] == '=') return false;
    return true;
}
