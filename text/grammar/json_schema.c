/* json_schema.c: JSON Schema -> GBNF (grammar.h). Each schema becomes a GBNF expression, its
 * parts rules of their own; what every schema shares (any value, strings, numbers) is emitted
 * once. JSON is compact unless a whitespace pattern is given.
 *
 * Enforced exactly: type (one or a list), properties with required (in the schema's order,
 * optional ones may be left out), additionalProperties (false, true, a schema; when a schema
 * has properties and leaves it out, no other keys, as xgrammar's strict mode and OpenAI's
 * strict schemas have it), enum, const, anyOf, oneOf (as anyOf: the output matches at least
 * one; that it matches only one is not checked), allOf of object schemas (merged), $ref to
 * "#", "#/$defs/..." or "#/definitions/..." (recursion too), items, prefixItems, minItems,
 * maxItems, minLength, maxLength, pattern (a regular expression, in full, as JSON Schema's
 * ECMA patterns that also read as Python's), format (date, time, date-time with a zone
 * offset as RFC 3339 wants, uuid, email, ipv4), minimum, maximum and the exclusive ones on
 * integers. The annotations pydantic and OpenAI write are accepted. Anything else is refused
 * with the keyword's JSON pointer. Known narrowings (outputs stay valid, some valid texts are
 * never produced): February has 28 days, no leap seconds, an extra key may repeat a named one
 * only when additionalProperties allows any key. */
#include "text/grammar/grammar.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_CHAIN 256 /* minItems/maxItems/minLength/maxLength beyond which a count is refused */

typedef struct jref {
    char *ref;
    char name[24];
} jref_t;

typedef struct js {
    cs_buf_t rules;
    const json_t *root;
    bool ws;                    /* a whitespace rule between tokens */
    unsigned used;              /* the shared rules emitted */
    int n_rules;
    jref_t *refs;
    int n_refs, cap_refs;
    char *err_path;
    bool failed;
    int depth;
} js_t;

enum { U_VALUE = 1, U_STRING = 2, U_NUMBER = 4, U_INTEGER = 8, U_CHAR = 16 };

static bool jfail(js_t *J, const char *path, const char *key, const char *fmt, const char *what) {
    if (J->failed) return false;
    J->failed = true;
    char p[1024];
    snprintf(p, sizeof p, "%s%s%s", path, key ? "/" : "", key ? key : "");
    J->err_path = strdup(p);
    cs_error_set(CS_EINVAL, fmt, what ? what : "");
    return false;
}

static void add(js_t *J, const char *s) { cs_buf_add(&J->rules, s, strlen(s)); }

/* a string onto a buffer (with a NUL kept only where "" is given on purpose: S(b, "") adds none) */
#define S(b, lit) cs_buf_add((b), (lit), strlen(lit))
/* the NUL that makes a buffer's bytes a C string (counted in its len) */
#define Z(b) cs_buf_add((b), "", 1)

/* a fresh rule name into name */
static void new_rule(js_t *J, char *name, size_t cap) { snprintf(name, cap, "s%d", J->n_rules++); }

static void rule(js_t *J, const char *name, const char *expr) {
    add(J, name);
    add(J, " ::= ");
    add(J, expr);
    add(J, "\n");
}

/* a GBNF literal of bytes (UTF-8 kept; quotes, backslashes and controls escaped) */
static void lit(cs_buf_t *b, const char *s, size_t n) {
    S(b, "\"");
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        char e[8];
        if (c == '"' || c == '\\') snprintf(e, sizeof e, "\\%c", c);
        else if (c < 0x20 || c == 0x7f) snprintf(e, sizeof e, "\\x%02X", c);
        else snprintf(e, sizeof e, "%c", c);
        cs_buf_add(b, e, strlen(e));
    }
    S(b, "\"");
}

static const char *WS(js_t *J) { return J->ws ? " js-ws " : " "; }

static void use(js_t *J, unsigned what) {
    if ((what & U_VALUE) && !(J->used & U_VALUE)) {
        J->used |= U_VALUE;
        char b[512];
        snprintf(b, sizeof b,
                 "js-value ::= js-object | js-array | js-string | js-number | \"true\" | \"false\" | \"null\"\n"
                 "js-object ::= \"{\"%s( js-string%s\":\"%sjs-value%s( \",\"%sjs-string%s\":\"%sjs-value%s)* )? \"}\"\n"
                 "js-array ::= \"[\"%s( js-value%s( \",\"%sjs-value%s)* )? \"]\"\n",
                 WS(J), WS(J), WS(J), WS(J), WS(J), WS(J), WS(J), WS(J), WS(J), WS(J), WS(J), WS(J));
        add(J, b);
        what |= U_STRING | U_NUMBER;
    }
    if ((what & (U_STRING | U_CHAR)) && !(J->used & U_CHAR)) {
        J->used |= U_CHAR;
        add(J, "js-char ::= [^\"\\\\\\x00-\\x1F] | \"\\\\\" ([\"\\\\/bfnrt] | \"u\" [0-9a-fA-F]{4})\n");
    }
    if ((what & U_STRING) && !(J->used & U_STRING)) {
        J->used |= U_STRING;
        add(J, "js-string ::= \"\\\"\" js-char* \"\\\"\"\n");
    }
    if ((what & U_NUMBER) && !(J->used & U_NUMBER)) {
        J->used |= U_NUMBER;
        add(J, "js-number ::= \"-\"? (\"0\" | [1-9] [0-9]*) (\".\" [0-9]+)? ([eE] [-+]? [0-9]+)?\n");
    }
    if ((what & U_INTEGER) && !(J->used & U_INTEGER)) {
        J->used |= U_INTEGER;
        add(J, "js-integer ::= \"-\"? (\"0\" | [1-9] [0-9]*)\n");
    }
}

static bool gen(js_t *J, const json_t *s, const char *path, cs_buf_t *out);

/* ---- integers in a range ---- */
/* same-length decimal strings lo..hi (digits only) as an alternation into b */
static void same_len(cs_buf_t *b, const char *lo, const char *hi, size_t n) {
    if (n == 0) { S(b, "\"\""); return; }
    char t[64];
    if (n == 1) {
        snprintf(t, sizeof t, "[%c-%c]", lo[0], hi[0]);
        cs_buf_add(b, t, strlen(t));
        return;
    }
    if (lo[0] == hi[0]) {
        snprintf(t, sizeof t, "\"%c\" ", lo[0]);
        cs_buf_add(b, t, strlen(t));
        same_len(b, lo + 1, hi + 1, n - 1);
        return;
    }
    bool lo_zero = strspn(lo + 1, "0") == n - 1, hi_nine = strspn(hi + 1, "9") == n - 1;
    if (lo_zero && hi_nine) {
        snprintf(t, sizeof t, "[%c-%c] [0-9]{%zu}", lo[0], hi[0], n - 1);
        cs_buf_add(b, t, strlen(t));
        return;
    }
    char nines[32], zeros[32];
    memset(nines, '9', n - 1);
    memset(zeros, '0', n - 1);
    S(b, "(");
    snprintf(t, sizeof t, "\"%c\" ", lo[0]);
    cs_buf_add(b, t, strlen(t));
    same_len(b, lo + 1, nines, n - 1);
    if (lo[0] + 1 <= hi[0] - 1) {
        snprintf(t, sizeof t, " | [%c-%c] [0-9]{%zu}", lo[0] + 1, hi[0] - 1, n - 1);
        cs_buf_add(b, t, strlen(t));
    }
    snprintf(t, sizeof t, " | \"%c\" ", hi[0]);
    cs_buf_add(b, t, strlen(t));
    same_len(b, zeros, hi + 1, n - 1);
    S(b, ")");
}

/* the non-negative integers a..b (b < 0: no bound), no leading zeros, as alternatives into buf */
static void nonneg(cs_buf_t *buf, long long a, long long b) {
    char sa[32], sb[32];
    int la = snprintf(sa, sizeof sa, "%lld", a);
    bool first = true;
    for (int L = la; b < 0 ? L <= la : L <= (int)snprintf(sb, sizeof sb, "%lld", b); L++) {
        long long lo = L == la ? a : (long long)pow(10, L - 1);
        long long top = (long long)pow(10, L) - 1, hi = b >= 0 && b < top ? b : top;
        if (lo > hi) continue;
        char x[32], y[32];
        snprintf(x, sizeof x, "%lld", lo);
        snprintf(y, sizeof y, "%lld", hi);
        if (!first) S(buf, " | ");
        first = false;
        same_len(buf, x, y, (size_t)L);
    }
    if (b < 0) { /* more digits than a, any */
        char t[48];
        snprintf(t, sizeof t, "%s[1-9] [0-9]{%d,}", first ? "" : " | ", la);
        cs_buf_add(buf, t, strlen(t));
    }
}

static bool int_bound(js_t *J, const json_t *s, const char *path, const char *key, bool upper, bool *has, long long *v) {
    const json_t *x = json_object_get(s, key);
    const char *ex = upper ? "exclusiveMaximum" : "exclusiveMinimum";
    const json_t *e = json_object_get(s, ex);
    if (json_is_number(e)) { /* draft 6+: a number */
        double d = json_number_value(e);
        long long k = upper ? (long long)ceil(d) - 1 : (long long)floor(d) + 1;
        if (!*has || (upper ? k < *v : k > *v)) *v = k;
        *has = true;
    } else if (e && !json_is_boolean(e)) {
        return jfail(J, path, ex, "%s must be a number", ex);
    }
    if (!x) return true;
    if (!json_is_number(x)) return jfail(J, path, key, "%s must be a number", key);
    double d = json_number_value(x);
    if (fabs(d) > 9e15) return jfail(J, path, key, "%s is out of range", key);
    long long k = upper ? (long long)floor(d) : (long long)ceil(d);
    if (json_is_true(e)) k += upper ? -1 : 1; /* draft 4: a boolean */
    if (!*has || (upper ? k < *v : k > *v)) *v = k;
    *has = true;
    return true;
}

static bool gen_integer(js_t *J, const json_t *s, const char *path, cs_buf_t *out) {
    bool hlo = false, hhi = false;
    long long lo = 0, hi = 0;
    if (!int_bound(J, s, path, "minimum", false, &hlo, &lo) || !int_bound(J, s, path, "maximum", true, &hhi, &hi))
        return false;
    if (!hlo && !hhi) {
        use(J, U_INTEGER);
        S(out, "js-integer");
        return true;
    }
    if (hlo && hhi && lo > hi) return jfail(J, path, "minimum", "%sno integer lies between minimum and maximum", NULL);
    cs_buf_t b = {0};
    bool any = false;
    if (!hlo || lo < 0) { /* the negative part: -(max(1, -hi) .. -lo) */
        long long a = hhi && hi < 0 ? -hi : 1, z = hlo ? -lo : -1;
        S(&b, "\"-\" (");
        nonneg(&b, a, z);
        S(&b, ")");
        any = true;
    }
    if (!hhi || hi >= 0) {
        if (any) S(&b, " | ");
        S(&b, "(");
        nonneg(&b, hlo && lo > 0 ? lo : 0, hhi ? hi : -1);
        S(&b, ")");
    }
    Z(&b);
    char name[24];
    new_rule(J, name, sizeof name);
    rule(J, name, b.p);
    free(b.p);
    cs_buf_add(out, name, strlen(name));
    return true;
}

/* ---- strings ---- */
static const char *format_expr(const char *f) {
#define DATE "[0-9]{4} \"-\" (\"0\" [13578] \"-\" d31 | \"1\" [02] \"-\" d31 | \"0\" [469] \"-\" d30 | \"11-\" d30 | \"02-\" d28)"
#define TIME "([01] [0-9] | \"2\" [0-3]) \":\" [0-5] [0-9] \":\" [0-5] [0-9] (\".\" [0-9]+)? (\"Z\" | [+-] ([01] [0-9] | \"2\" [0-3]) \":\" [0-5] [0-9])"
    if (!strcmp(f, "date")) return DATE;
    if (!strcmp(f, "time")) return TIME;
    if (!strcmp(f, "date-time")) return DATE " \"T\" " TIME;
    if (!strcmp(f, "uuid")) return "[0-9a-f]{8} \"-\" [0-9a-f]{4} \"-\" [0-9a-f]{4} \"-\" [0-9a-f]{4} \"-\" [0-9a-f]{12}";
    if (!strcmp(f, "email")) return "[a-zA-Z0-9._%+-]{1,64} \"@\" [a-zA-Z0-9] [a-zA-Z0-9-]{0,62} (\".\" [a-zA-Z0-9] [a-zA-Z0-9-]{0,62})+";
    if (!strcmp(f, "ipv4")) return "octet \".\" octet \".\" octet \".\" octet";
    return NULL;
#undef DATE
#undef TIME
}

static bool count(js_t *J, const json_t *s, const char *path, const char *key, long *v) {
    const json_t *x = json_object_get(s, key);
    if (!x) return true;
    double d = json_is_integer(x) ? (double)json_integer_value(x) : json_is_real(x) ? json_real_value(x) : -1;
    if (d < 0 || d != floor(d)) return jfail(J, path, key, "%s must be a non-negative integer", key); /* 2.0 is one */
    if (d > MAX_CHAIN && strcmp(key, "minLength") && strcmp(key, "minItems")) {
        *v = -1; /* a bound that high: none */
        return true;
    }
    if (d > MAX_CHAIN) return jfail(J, path, key, "%s above 256 is not supported", key);
    *v = (long)d;
    return true;
}

static bool gen_string(js_t *J, const json_t *s, const char *path, cs_buf_t *out) {
    const json_t *pat = json_object_get(s, "pattern"), *fmt = json_object_get(s, "format");
    long mn = 0, mx = -1;
    if (!count(J, s, path, "minLength", &mn) || !count(J, s, path, "maxLength", &mx)) return false;
    bool counted = json_object_get(s, "minLength") || json_object_get(s, "maxLength");
    if (pat && fmt) return jfail(J, path, "pattern", "%spattern together with format is not supported", NULL);
    if (fmt) {
        const char *e = json_is_string(fmt) ? format_expr(json_string_value(fmt)) : NULL;
        if (!e) return jfail(J, path, "format", "format '%s' is not supported", json_is_string(fmt) ? json_string_value(fmt) : "?");
        if (counted) return jfail(J, path, "format", "%sformat together with minLength or maxLength is not supported", NULL);
        if (strstr(e, "d31") && !(J->used & 64)) {
            J->used |= 64;
            add(J, "d31 ::= \"0\" [1-9] | [12] [0-9] | \"3\" [01]\nd30 ::= \"0\" [1-9] | [12] [0-9] | \"30\"\n"
                   "d28 ::= \"0\" [1-9] | \"1\" [0-9] | \"2\" [0-8]\n");
        }
        if (strstr(e, "octet") && !(J->used & 128)) {
            J->used |= 128;
            add(J, "octet ::= \"25\" [0-5] | \"2\" [0-4] [0-9] | \"1\" [0-9] [0-9] | [1-9] [0-9] | [0-9]\n");
        }
        S(out, "\"\\\"\" ");
        cs_buf_add(out, e, strlen(e));
        S(out, " \"\\\"\"");
        return true;
    }
    if (pat) {
        if (!json_is_string(pat)) return jfail(J, path, "pattern", "%spattern must be a string", NULL);
        if (counted) return jfail(J, path, "pattern", "%spattern together with minLength or maxLength is not supported", NULL);
        char *g = NULL;
        if (grammar_json_pattern_to_gbnf(json_string_value(pat), json_string_length(pat), &g)) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", cs_error_last());
            return jfail(J, path, "pattern", "%s", msg);
        }
        const char *e = strstr(g, "::= ");
        S(out, "\"\\\"\" (");
        cs_buf_add(out, e + 4, strlen(e + 4) - 1); /* without its newline */
        S(out, ") \"\\\"\"");
        free(g);
        return true;
    }
    if (!counted) {
        use(J, U_STRING);
        S(out, "js-string");
        return true;
    }
    if (mx >= 0 && mx < mn) return jfail(J, path, "maxLength", "%smaxLength is below minLength", NULL);
    use(J, U_CHAR);
    char t[64];
    if (mx < 0) snprintf(t, sizeof t, "\"\\\"\" js-char{%ld,} \"\\\"\"", mn);
    else snprintf(t, sizeof t, "\"\\\"\" js-char{%ld,%ld} \"\\\"\"", mn, mx);
    cs_buf_add(out, t, strlen(t));
    return true;
}

/* ---- arrays ---- */
/* a list's items x after a comma each, repeated rep ("*", "{0,n}"); with first, the list
 * may begin here: ( x (, x)rep )?. x may be any length. */
static void more_items(js_t *J, cs_buf_t *b, const char *x, const char *rep, bool first) {
    if (first) {
        S(b, "( ");
        S(b, x);
        S(b, " ");
    }
    S(b, "(\",\"");
    S(b, WS(J));
    S(b, x);
    S(b, ")");
    S(b, rep);
    if (first) S(b, " )?");
}

static bool gen_array(js_t *J, const json_t *s, const char *path, cs_buf_t *out) {
    const json_t *items = json_object_get(s, "items"), *prefix = json_object_get(s, "prefixItems");
    long mn = 0, mx = -1;
    if (!count(J, s, path, "minItems", &mn) || !count(J, s, path, "maxItems", &mx)) return false;
    if (prefix && !json_is_array(prefix)) return jfail(J, path, "prefixItems", "%sprefixItems must be a list", NULL);
    if (items && !json_is_object(items) && !json_is_boolean(items))
        return jfail(J, path, "items", "%sitems must be a schema", NULL);
    size_t k = json_array_size(prefix);
    bool rest = !json_is_false(items);
    if (!rest && (mx < 0 || (size_t)mx > k)) mx = (long)k;
    if (mx >= 0 && mx < mn) return jfail(J, path, "maxItems", "%smaxItems is below minItems", NULL);
    if ((long)k > MAX_CHAIN) return jfail(J, path, "prefixItems", "%smore than 256 prefixItems", NULL);
    /* each element's expression */
    cs_buf_t rest_e = {0};
    char p[1024];
    if (rest) {
        snprintf(p, sizeof p, "%s/items", path);
        if (!items || json_is_true(items)) {
            use(J, U_VALUE);
            S(&rest_e, "js-value");
        } else if (!gen(J, items, p, &rest_e)) {
            free(rest_e.p);
            return false;
        }
    }
    Z(&rest_e);
    /* R_i: the elements from i on, each after a comma but the first */
    long chain = (long)k > mn ? (long)k : mn;
    if (mx >= 0 && chain > mx) chain = mx;
    char next[24] = "", name[24];
    cs_buf_t b = {0};
    /* the tail after the chain: unbounded rest, or optional ones up to mx */
    if (mx < 0 || mx > chain) {
        if (!rest) next[0] = 0;
        else {
            new_rule(J, next, sizeof next);
            b.len = 0;
            char t[32] = "*";
            if (mx >= 0) snprintf(t, sizeof t, "{0,%ld}", chain == 0 ? mx - 1 : mx - chain);
            more_items(J, &b, rest_e.p, t, chain == 0);
            Z(&b);
            rule(J, next, b.p);
        }
    }
    for (long i = chain - 1; i >= 0; i--) {
        cs_buf_t e = {0};
        if ((size_t)i < k) {
            snprintf(p, sizeof p, "%s/prefixItems/%ld", path, i);
            if (!gen(J, json_array_get(prefix, (size_t)i), p, &e)) {
                free(e.p);
                free(b.p);
                free(rest_e.p);
                return false;
            }
        } else {
            cs_buf_add(&e, rest_e.p, strlen(rest_e.p));
        }
        Z(&e);
        new_rule(J, name, sizeof name);
        b.len = 0;
        char t[128];
        if (i) snprintf(t, sizeof t, "\",\"%s", WS(J));
        else t[0] = 0;
        cs_buf_add(&b, t, strlen(t));
        cs_buf_add(&b, e.p, strlen(e.p));
        if (next[0]) {
            S(&b, " ");
            cs_buf_add(&b, next, strlen(next));
        }
        if (i >= mn) S(&b, " | \"\"");
        Z(&b);
        rule(J, name, b.p);
        free(e.p);
        snprintf(next, sizeof next, "%s", name);
    }
    char t[96];
    snprintf(t, sizeof t, "\"[\"%s%s%s\"]\"", WS(J), next[0] ? next : "", next[0] ? WS(J) : "");
    cs_buf_add(out, t, strlen(t));
    free(b.p);
    free(rest_e.p);
    return true;
}

/* ---- objects ---- */
static bool gen_object(js_t *J, const json_t *s, const char *path, cs_buf_t *out) {
    const json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required");
    const json_t *ap = json_object_get(s, "additionalProperties");
    if (props && !json_is_object(props)) return jfail(J, path, "properties", "%sproperties must be an object", NULL);
    if (req && !json_is_array(req)) return jfail(J, path, "required", "%srequired must be a list of names", NULL);
    if (ap && !json_is_boolean(ap) && !json_is_object(ap))
        return jfail(J, path, "additionalProperties", "%sadditionalProperties must be a boolean or a schema", NULL);
    size_t n = json_object_size(props), i = 0;
    size_t k;
    const json_t *r;
    json_array_foreach(req, k, r) {
        if (!json_is_string(r)) return jfail(J, path, "required", "%srequired must be a list of names", NULL);
        const json_t *ps = json_object_get(props, json_string_value(r));
        if (!ps)
            return jfail(J, path, "required", "required property '%s' is not in properties", json_string_value(r));
        if (json_is_false(ps))
            return jfail(J, path, "required", "required property '%s' has the schema false", json_string_value(r));
    }
    if (!n && !ap) { /* any object */
        use(J, U_VALUE);
        S(out, "js-object");
        return true;
    }
    /* kv_i and whether it is required */
    char **kv = calloc(n + 1, sizeof *kv);
    bool *must = calloc(n + 1, sizeof *must);
    const char *key;
    const json_t *ps;
    bool ok = kv && must;
    json_object_foreach((json_t *)props, key, ps) {
        if (!ok) break;
        if (json_is_false(ps)) { /* a property that must not be there: never written */
            n--;
            continue;
        }
        cs_buf_t b = {0};
        lit(&b, "\"", 0);
        b.len = 0;
        json_t *ks = json_string(key);
        char *kj = json_dumps(ks, JSON_ENCODE_ANY);
        json_decref(ks);
        lit(&b, kj, strlen(kj));
        free(kj);
        char t[64];
        snprintf(t, sizeof t, "%s\":\"%s", WS(J), WS(J));
        cs_buf_add(&b, t, strlen(t));
        char p[1024];
        snprintf(p, sizeof p, "%s/properties/%s", path, key);
        ok = gen(J, ps, p, &b);
        Z(&b);
        kv[i] = b.p;
        json_array_foreach(req, k, r) if (!strcmp(json_string_value(r), key)) must[i] = true;
        i++;
    }
    /* extra keys: their kv */
    cs_buf_t extra = {0};
    if (ok && ap && !json_is_false(ap)) {
        use(J, U_STRING);
        char t[64];
        snprintf(t, sizeof t, "js-string%s\":\"%s", WS(J), WS(J));
        cs_buf_add(&extra, t, strlen(t));
        char p[1024];
        snprintf(p, sizeof p, "%s/additionalProperties", path);
        if (json_is_true(ap)) {
            use(J, U_VALUE);
            S(&extra, "js-value");
        } else {
            ok = gen(J, ap, p, &extra);
        }
    }
    Z(&extra);
    /* T_i_c: the properties from i on; c: one went before (a comma first) */
    char names[2][24], prev[2][24];
    cs_buf_t b = {0};
    for (long j = (long)n; ok && j >= 0; j--) {
        for (int c = 0; c < 2; c++) {
            new_rule(J, names[c], sizeof names[c]);
            b.len = 0;
            if (j == (long)n) {
                if (extra.len > 1) {
                    more_items(J, &b, extra.p, "*", !c);
                } else {
                    S(&b, "\"\"");
                }
            } else {
                char t[64];
                snprintf(t, sizeof t, "%s", c ? "\",\" " : "");
                cs_buf_add(&b, t, strlen(t));
                if (c && J->ws) S(&b, "js-ws ");
                cs_buf_add(&b, kv[j], strlen(kv[j]));
                snprintf(t, sizeof t, " %s", prev[1]);
                cs_buf_add(&b, t, strlen(t));
                if (!must[j]) {
                    snprintf(t, sizeof t, " | %s", prev[c]);
                    cs_buf_add(&b, t, strlen(t));
                }
            }
            Z(&b);
            rule(J, names[c], b.p);
        }
        memcpy(prev, names, sizeof prev);
    }
    if (ok) {
        char t[96];
        snprintf(t, sizeof t, "\"{\"%s%s%s\"}\"", WS(J), prev[0], WS(J));
        cs_buf_add(out, t, strlen(t));
    }
    for (size_t x = 0; kv && x < n; x++) free(kv[x]);
    free(kv);
    free(must);
    free(b.p);
    free(extra.p);
    return ok;
}

/* ---- the keywords ---- */
static const char *const ANNOT[] = {"title", "description", "default", "examples", "$schema", "$id", "$comment",
                                    "deprecated", "readOnly", "writeOnly", "$defs", "definitions", NULL};
static const char *const KNOWN[] = {"type", "properties", "required", "additionalProperties", "enum", "const", "anyOf",
                                    "oneOf", "allOf", "$ref", "items", "prefixItems", "minItems", "maxItems",
                                    "minLength", "maxLength", "pattern", "format", "minimum", "maximum",
                                    "exclusiveMinimum", "exclusiveMaximum", NULL};

static bool in_list(const char *const *l, const char *k) {
    for (; *l; l++)
        if (!strcmp(*l, k)) return true;
    return false;
}

/* a JSON value as a GBNF literal of its compact text */
static void value_lit(cs_buf_t *out, const json_t *v) {
    char *t = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    lit(out, t ? t : "null", t ? strlen(t) : 4);
    free(t);
}

static bool type_ok(const json_t *v, const char *ty) {
    if (!strcmp(ty, "string")) return json_is_string(v);
    if (!strcmp(ty, "integer")) return json_is_integer(v) || (json_is_real(v) && json_real_value(v) == floor(json_real_value(v)));
    if (!strcmp(ty, "number")) return json_is_number(v);
    if (!strcmp(ty, "boolean")) return json_is_boolean(v);
    if (!strcmp(ty, "null")) return json_is_null(v);
    if (!strcmp(ty, "object")) return json_is_object(v);
    if (!strcmp(ty, "array")) return json_is_array(v);
    return false;
}

static int hexd(char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

/* the schema a $ref names: a JSON pointer into the root */
static const json_t *resolve(js_t *J, const char *ref, const char *path) {
    if (ref[0] != '#') return jfail(J, path, "$ref", "$ref '%s' is not supported (only references inside the schema)", ref), NULL;
    const json_t *x = J->root;
    const char *p = ref + 1;
    while (*p == '/') {
        const char *e = strchr(p + 1, '/');
        size_t len = e ? (size_t)(e - p - 1) : strlen(p + 1);
        char seg[256];
        if (len >= sizeof seg) return jfail(J, path, "$ref", "$ref '%s' cannot be resolved", ref), NULL;
        size_t o = 0;
        for (size_t i = 0; i < len; i++) { /* ~1 is /, ~0 is ~; %XX a byte (a URI fragment) */
            char c = p[1 + i];
            if (c == '%' && i + 2 < len && hexd(p[2 + i]) >= 0 && hexd(p[3 + i]) >= 0) {
                c = (char)(hexd(p[2 + i]) * 16 + hexd(p[3 + i]));
                i += 2;
            }
            if (c == '~' && i + 1 < len && (p[2 + i] == '0' || p[2 + i] == '1')) {
                seg[o++] = p[2 + i] == '1' ? '/' : '~';
                i++;
            } else {
                seg[o++] = c;
            }
        }
        seg[o] = 0;
        x = json_is_array(x) ? json_array_get(x, (size_t)atol(seg)) : json_object_get(x, seg);
        if (!x) return jfail(J, path, "$ref", "$ref '%s' cannot be resolved", ref), NULL;
        p += 1 + len;
    }
    if (*p) return jfail(J, path, "$ref", "$ref '%s' cannot be resolved", ref), NULL;
    return x;
}

static bool gen_ref(js_t *J, const char *ref, const char *path, cs_buf_t *out) {
    for (int i = 0; i < J->n_refs; i++)
        if (!strcmp(J->refs[i].ref, ref)) {
            cs_buf_add(out, J->refs[i].name, strlen(J->refs[i].name));
            return true;
        }
    const json_t *t = resolve(J, ref, path);
    if (!t) return false;
    if (J->n_refs == J->cap_refs) {
        int nc = J->cap_refs ? J->cap_refs * 2 : 8;
        jref_t *nr = realloc(J->refs, sizeof *nr * (size_t)nc);
        if (!nr) return jfail(J, path, NULL, "out of memory%s", NULL);
        J->refs = nr;
        J->cap_refs = nc;
    }
    jref_t *jr = &J->refs[J->n_refs++];
    jr->ref = strdup(ref);
    new_rule(J, jr->name, sizeof jr->name);
    char name[24];
    snprintf(name, sizeof name, "%s", jr->name); /* J->refs may move */
    cs_buf_t b = {0};
    bool ok = gen(J, t, ref, &b);
    Z(&b);
    if (ok) rule(J, name, b.p);
    free(b.p);
    cs_buf_add(out, name, strlen(name));
    return ok;
}

/* allOf: one part, or object parts merged (properties, required, additionalProperties) */
static bool gen_allof(js_t *J, const json_t *s, const json_t *all, const char *path, cs_buf_t *out) {
    json_t *m = json_deep_copy(s);
    json_object_del(m, "allOf");
    size_t i;
    const json_t *part;
    bool ok = json_is_array(all) && json_array_size(all);
    /* additionalProperties sees only the properties of its own schema: merged, it would see
     * all, so it may stand only in the one schema that holds properties (or in none) */
    int with_props = json_object_get(s, "properties") != NULL, with_ap = json_object_get(s, "additionalProperties") != NULL;
    bool ap_alone = with_ap && !with_props; /* an additionalProperties without its own properties */
    json_array_foreach(all, i, part) {
        if (!ok) break;
        const json_t *p = part;
        if (json_is_true(p)) continue;
        if (!json_is_object(p)) {
            char pp[1024];
            snprintf(pp, sizeof pp, "%s/allOf/%zu", path, i);
            json_decref(m);
            return jfail(J, pp, NULL, "%sa schema must be an object (false matches nothing)", NULL);
        }
        if (json_is_string(json_object_get(p, "$ref"))) {
            char pp[1024];
            snprintf(pp, sizeof pp, "%s/allOf/%zu", path, i);
            if (!(p = resolve(J, json_string_value(json_object_get(p, "$ref")), pp))) ok = false;
        }
        if (!p) break;
        bool pp_ = json_object_get(p, "properties") != NULL, pa_ = json_object_get(p, "additionalProperties") != NULL;
        with_props += pp_;
        with_ap += pa_;
        ap_alone = ap_alone || (pa_ && !pp_);
        const char *k;
        json_t *v;
        json_object_foreach((json_t *)p, k, v) {
            if (!ok) break;
            if (in_list(ANNOT, k) || !strcmp(k, "$ref")) continue;
            if (!strcmp(k, "properties")) {
                json_t *mp = json_object_get(m, "properties");
                if (!mp) json_object_set_new(m, "properties", mp = json_object());
                json_object_update(mp, v);
            } else if (!strcmp(k, "required")) {
                json_t *mr = json_object_get(m, "required");
                if (!mr) json_object_set_new(m, "required", mr = json_array());
                json_array_extend(mr, v);
            } else if (!strcmp(k, "type") || !strcmp(k, "additionalProperties")) {
                json_t *have = json_object_get(m, k);
                if (have && !json_equal(have, v) && !strcmp(k, "type")) ok = false;
                json_object_set(m, k, v);
            } else {
                ok = false;
            }
        }
    }
    /* additionalProperties sees only its own schema's properties: merged, it would see all */
    if (ok && with_ap && (with_props > 1 || with_ap > 1 || (ap_alone && with_props))) ok = false;
    if (!ok) {
        json_decref(m);
        return J->failed ? false : jfail(J, path, "allOf", "%sallOf is supported for object schemas that merge", NULL);
    }
    bool r = gen(J, m, path, out);
    json_decref(m);
    return r;
}

/* the JSON types a schema's values may have, as bits (a $ref followed; unknown: all) */
enum { T_NULL = 1, T_BOOL = 2, T_INT = 4, T_FRAC = 8, T_STRING = 16, T_ARRAY = 32, T_OBJECT = 64, T_ALL = 127 };
static unsigned type_bits_of(const char *t) {
    return !strcmp(t, "null") ? T_NULL : !strcmp(t, "boolean") ? T_BOOL : !strcmp(t, "integer") ? T_INT
         : !strcmp(t, "number") ? T_INT | T_FRAC : !strcmp(t, "string") ? T_STRING : !strcmp(t, "array") ? T_ARRAY
         : !strcmp(t, "object") ? T_OBJECT : T_ALL;
}
static unsigned value_bits(const json_t *v) {
    return json_is_null(v) ? T_NULL : json_is_boolean(v) ? T_BOOL : json_is_integer(v) ? T_INT
         : json_is_real(v) ? (json_real_value(v) == floor(json_real_value(v)) ? T_INT : T_FRAC)
         : json_is_string(v) ? T_STRING : json_is_array(v) ? T_ARRAY : T_OBJECT;
}
static const json_t *deref(js_t *J, const json_t *s) {
    for (int hops = 0; hops < 16 && json_is_object(s) && json_is_string(json_object_get(s, "$ref")); hops++) {
        const char *ref = json_string_value(json_object_get(s, "$ref"));
        bool was = J->failed;
        const json_t *t = resolve(J, ref, "#");
        if (!t) { /* leave the error to gen() */
            J->failed = was;
            return NULL;
        }
        s = t;
    }
    return s;
}
static unsigned types_of(js_t *J, const json_t *s) {
    s = deref(J, s);
    if (!json_is_object(s)) return json_is_false(s) ? 0 : T_ALL;
    const json_t *ty = json_object_get(s, "type"), *en = json_object_get(s, "enum"), *c = json_object_get(s, "const");
    if (c) return value_bits(c);
    if (json_is_array(en)) {
        unsigned b = 0;
        size_t i;
        const json_t *x;
        json_array_foreach(en, i, x) b |= value_bits(x);
        return b;
    }
    if (json_is_string(ty)) return type_bits_of(json_string_value(ty));
    if (json_is_array(ty)) {
        unsigned b = 0;
        size_t i;
        const json_t *x;
        json_array_foreach(ty, i, x) b |= json_is_string(x) ? type_bits_of(json_string_value(x)) : T_ALL;
        return b;
    }
    return T_ALL;
}
/* the values of a const/enum schema (NULL: not one) */
static json_t *values_of(js_t *J, const json_t *s) {
    s = deref(J, s);
    if (!json_is_object(s)) return NULL;
    if (json_object_get(s, "const")) return json_pack("[O]", json_object_get(s, "const"));
    if (json_is_array(json_object_get(s, "enum"))) return json_incref(json_object_get(s, "enum"));
    return NULL;
}
static bool values_disjoint(const json_t *a, const json_t *b) {
    size_t i, j;
    const json_t *x, *y;
    json_array_foreach(a, i, x) json_array_foreach(b, j, y) {
        if (json_equal(x, y)) return false;
        /* 1 and 1.0 are one value in JSON Schema; arrays or objects that may hold such
         * numbers are taken as overlapping */
        if (json_is_number(x) && json_is_number(y) && json_number_value(x) == json_number_value(y)) return false;
        if ((json_is_array(x) || json_is_object(x)) && json_typeof(x) == json_typeof(y)) return false; /* could be equal */
    }
    return true;
}
/* two schemas no value can satisfy both of: different types, different constants, or objects
 * that both require a property whose constants differ (a discriminator) */
static bool pair_disjoint(js_t *J, const json_t *a, const json_t *b) {
    if (json_is_false(a) || json_is_false(b)) return true;
    if (!(types_of(J, a) & types_of(J, b))) return true;
    json_t *va = values_of(J, a), *vb = values_of(J, b);
    bool d = va && vb && values_disjoint(va, vb);
    json_decref(va);
    json_decref(vb);
    if (d) return true;
    a = deref(J, a);
    b = deref(J, b);
    const json_t *pa = json_object_get(a, "properties"), *pb = json_object_get(b, "properties");
    const json_t *ra = json_object_get(a, "required"), *rb = json_object_get(b, "required");
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)pa, k, v) {
        bool in_a = false, in_b = false;
        size_t i;
        const json_t *r;
        json_array_foreach(ra, i, r) in_a = in_a || (json_is_string(r) && !strcmp(json_string_value(r), k));
        json_array_foreach(rb, i, r) in_b = in_b || (json_is_string(r) && !strcmp(json_string_value(r), k));
        const json_t *w = json_object_get(pb, k);
        if (!in_a || !in_b || !w) continue;
        json_t *x = values_of(J, v), *y = values_of(J, w);
        d = x && y && values_disjoint(x, y);
        json_decref(x);
        json_decref(y);
        if (d) return true;
    }
    return false;
}
static bool disjoint(js_t *J, const json_t *list) {
    for (size_t i = 0; i < json_array_size(list); i++)
        for (size_t j = i + 1; j < json_array_size(list); j++)
            if (!pair_disjoint(J, json_array_get(list, i), json_array_get(list, j))) return false;
    return true;
}

static bool gen_any(js_t *J, const json_t *s, const char *key, const char *path, cs_buf_t *out) {
    const json_t *list = json_object_get(s, key);
    if (!json_is_array(list) || !json_array_size(list)) return jfail(J, path, key, "%s must be a non-empty list", key);
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)s, k, v) if (strcmp(k, key) && !in_list(ANNOT, k))
        return jfail(J, path, k, "'%s' beside anyOf/oneOf is not supported (put it in each alternative)", k);
    if (!strcmp(key, "oneOf") && !disjoint(J, list))
        return jfail(J, path, key, "%soneOf whose alternatives may overlap is not supported (exactly one must match: "
                     "give each a different type, const or enum, or a const property both require; or use anyOf)", NULL);
    S(out, "(");
    size_t i, n = 0;
    const json_t *alt;
    json_array_foreach(list, i, alt) {
        if (json_is_false(alt)) continue; /* matches nothing */
        if (n++) S(out, " | ");
        char p[1024];
        snprintf(p, sizeof p, "%s/%s/%zu", path, key, i);
        if (!gen(J, alt, p, out)) return false;
    }
    S(out, ")");
    return n ? true : jfail(J, path, key, "%severy alternative is false: nothing matches", NULL);
}

static bool gen_type(js_t *J, const json_t *s, const char *ty, const char *path, cs_buf_t *out) {
    if (!strcmp(ty, "object")) return gen_object(J, s, path, out);
    if (!strcmp(ty, "array")) return gen_array(J, s, path, out);
    if (!strcmp(ty, "string")) return gen_string(J, s, path, out);
    if (!strcmp(ty, "integer")) return gen_integer(J, s, path, out);
    if (!strcmp(ty, "number")) {
        if (json_object_get(s, "minimum") || json_object_get(s, "maximum") || json_object_get(s, "exclusiveMinimum") ||
            json_object_get(s, "exclusiveMaximum"))
            return jfail(J, path, json_object_get(s, "minimum") ? "minimum" : json_object_get(s, "maximum") ? "maximum"
                                  : json_object_get(s, "exclusiveMinimum") ? "exclusiveMinimum" : "exclusiveMaximum",
                         "%sminimum and maximum are supported on integers only", NULL);
        use(J, U_NUMBER);
        S(out, "js-number");
        return true;
    }
    if (!strcmp(ty, "boolean")) { S(out, "(\"true\" | \"false\")"); return true; }
    if (!strcmp(ty, "null")) { S(out, "\"null\""); return true; }
    return jfail(J, path, "type", "type '%s' is not a JSON Schema type", ty);
}

/* the types an untyped schema's keywords speak of: 1 object, 2 array, 4 string, 8 number */
static unsigned implied(const json_t *s) {
    static const char *const KW[4][5] = {{"properties", "additionalProperties", "required", NULL},
                                         {"items", "prefixItems", "minItems", "maxItems", NULL},
                                         {"pattern", "format", "minLength", "maxLength", NULL},
                                         {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", NULL}};
    unsigned m = 0;
    for (int t = 0; t < 4; t++)
        for (int k = 0; KW[t][k]; k++)
            if (json_object_get(s, KW[t][k])) m |= 1u << t;
    return m;
}

static bool gen(js_t *J, const json_t *s, const char *path, cs_buf_t *out) {
    if (J->failed) return false;
    if (json_is_true(s) || (json_is_object(s) && !json_object_size(s))) {
        use(J, U_VALUE);
        S(out, "js-value");
        return true;
    }
    if (!json_is_object(s)) return jfail(J, path, NULL, "%sa schema must be an object (false matches nothing)", NULL);
    if (++J->depth > 64) return jfail(J, path, NULL, "%sschemas nested too deeply", NULL);
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)s, k, v) if (!in_list(ANNOT, k) && !in_list(KNOWN, k)) {
        J->depth--;
        return jfail(J, path, k, "JSON Schema keyword '%s' is not supported", k);
    }
    bool ok;
    const json_t *ty = json_object_get(s, "type"), *en = json_object_get(s, "enum"), *c = json_object_get(s, "const");
    if (json_object_get(s, "$ref")) {
        const json_t *r = json_object_get(s, "$ref");
        json_object_foreach((json_t *)s, k, v) if (strcmp(k, "$ref") && !in_list(ANNOT, k)) {
            J->depth--;
            return jfail(J, path, k, "'%s' beside $ref is not supported", k);
        }
        ok = json_is_string(r) ? gen_ref(J, json_string_value(r), path, out) : jfail(J, path, "$ref", "%s$ref must be a string", NULL);
    } else if (json_object_get(s, "allOf")) {
        ok = gen_allof(J, s, json_object_get(s, "allOf"), path, out);
    } else if (json_object_get(s, "anyOf")) {
        ok = gen_any(J, s, "anyOf", path, out);
    } else if (json_object_get(s, "oneOf")) {
        ok = gen_any(J, s, "oneOf", path, out);
    } else if (c || en) {
        json_object_foreach((json_t *)s, k, v) if (strcmp(k, "type") && strcmp(k, "enum") && strcmp(k, "const") &&
                                                   !in_list(ANNOT, k)) {
            J->depth--; /* the values would have to be checked against it */
            return jfail(J, path, k, "'%s' beside enum or const is not supported", k);
        }
        if (en && !json_is_array(en)) {
            ok = jfail(J, path, "enum", "%senum must be a list", NULL);
        } else {
            S(out, "(");
            size_t i, n = 0;
            const json_t *x;
            json_t *one = c ? json_pack("[O]", c) : NULL;
            json_array_foreach(c ? one : en, i, x) {
                bool fits = !json_is_string(ty) || type_ok(x, json_string_value(ty));
                if (!fits) continue;
                if (n++) S(out, " | ");
                value_lit(out, x);
            }
            json_decref(one);
            S(out, ")");
            ok = n ? true : jfail(J, path, c ? "const" : "enum", "%sno value of enum or const has the schema's type", NULL);
        }
    } else if (json_is_string(ty)) {
        ok = gen_type(J, s, json_string_value(ty), path, out);
    } else if (json_is_array(ty)) {
        S(out, "(");
        size_t i;
        const json_t *t;
        ok = json_array_size(ty) > 0;
        json_array_foreach(ty, i, t) {
            if (!ok) break;
            if (i) S(out, " | ");
            ok = json_is_string(t) ? gen_type(J, s, json_string_value(t), path, out)
                                   : jfail(J, path, "type", "%stype must be a name or a list of names", NULL);
        }
        if (!json_array_size(ty)) ok = jfail(J, path, "type", "%stype must not be an empty list", NULL);
        S(out, ")");
    } else if (ty) {
        ok = jfail(J, path, "type", "%stype must be a name or a list of names", NULL);
    } else if (implied(s)) {
        /* no type, but keywords of some types: values of those types, each held to them (a
         * value of another type would pass them untested; it is not produced) */
        unsigned im = implied(s);
        static const char *const NAMES[] = {"object", "array", "string", "number"};
        int n = 0;
        ok = true;
        S(out, "(");
        for (int t = 0; t < 4 && ok; t++)
            if (im >> t & 1) {
                if (n++) S(out, " | ");
                ok = gen_type(J, s, NAMES[t], path, out);
            }
        S(out, ")");
    } else {
        use(J, U_VALUE);
        S(out, "js-value");
        ok = true;
    }
    J->depth--;
    return ok;
}

int grammar_json_schema_to_gbnf(const json_t *schema, const char *ws, char **gbnf, char **err_path) {
    *gbnf = NULL;
    if (err_path) *err_path = NULL;
    js_t J = {.root = schema};
    cs_buf_t root = {0};
    if (ws && *ws) {
        char *w = NULL;
        if (grammar_regex_to_gbnf(ws, strlen(ws), &w)) {
            char msg[512];
            snprintf(msg, sizeof msg, "whitespace_pattern: %s", cs_error_last());
            return cs_error_set(CS_EINVAL, "%s", msg);
        }
        add(&J, "js-ws");
        add(&J, strstr(w, " ::= "));
        free(w);
        J.ws = true;
    }
    bool ok;
    if (!schema) { /* json_object mode */
        use(&J, U_VALUE);
        S(&root, "js-object");
        ok = true;
    } else {
        ok = gen(&J, schema, "#", &root);
    }
    int rc = CS_OK;
    if (!ok) {
        rc = CS_EINVAL;
        if (err_path) *err_path = J.err_path;
        else free(J.err_path);
    } else {
        cs_buf_t all = {0};
        S(&all, "root ::= ");
        cs_buf_add(&all, root.p, root.len);
        S(&all, "\n");
        cs_buf_add(&all, J.rules.p ? J.rules.p : "", J.rules.len);
        if (!Z(&all)) rc = cs_error_set(CS_ENOMEM, "out of memory");
        else *gbnf = all.p;
        grammar_t *g = NULL;
        if (rc == CS_OK && J.n_refs && grammar_compile(all.p, all.len - 1, &g) == CS_EINVAL &&
            strstr(cs_error_last(), "left-recursive")) { /* {"$ref": "#"}, {"anyOf": [{"$ref": "#"}, ...]} */
            free(all.p);
            *gbnf = NULL;
            if (err_path) *err_path = strdup("#/$ref");
            rc = cs_error_set(CS_EINVAL, "a $ref reaches itself before any object or array: the schema "
                                         "matches nothing it does not first match (recursion must go through an "
                                         "object's property or an array's items)");
        }
        grammar_unref(g);
    }
    for (int i = 0; i < J.n_refs; i++) free(J.refs[i].ref);
    free(J.refs);
    free(J.rules.p);
    free(root.p);
    return rc;
}
