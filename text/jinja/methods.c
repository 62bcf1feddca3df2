/* methods.c: the methods of str (split, strip, format, ...), dict, list, loop and cycler
 * values, with Python's semantics on code points. */
#include "text/jinja/jinja_impl.h"

#include <math.h>
#include <stdio.h>

/* ---------------------------------------------------------------------- str methods ---- */

val out_str(sbuf *b, bool markup) {
    val v = sb_val(b);
    v.k = markup;
    return v;
}

static bool in_chars(val chars, int32_t c) {
    if (chars.t != T_STR) return is_space_cp(c);
    for (size_t i = 0; i < chars.u.s.n;) {
        int32_t d;
        i += utf8_dec(chars.u.s.p + i, chars.u.s.n - i, &d);
        if (d == c) return true;
    }
    return false;
}

/* mode: 1 strips the left, 2 the right, 3 both */
val str_strip(rctx *r, val s, val chars, int mode) {
    if (chars.t != T_STR && chars.t != T_NONE && chars.t != T_MISSING)
        rfail(r, "strip arg must be None or str, not %s", type_name(chars));
    const char *p = s.u.s.p;
    size_t a = 0, e = s.u.s.n;
    if (mode & 1)
        while (a < e) {
            int32_t c;
            size_t k = utf8_dec(p + a, e - a, &c);
            if (!in_chars(chars, c)) break;
            a += k;
        }
    if (mode & 2)
        while (e > a) {
            size_t k = e - 1;
            while (k > a && ((unsigned char)p[k] & 0xC0) == 0x80) k--;
            int32_t c;
            utf8_dec(p + k, e - k, &c);
            if (!in_chars(chars, c)) break;
            e = k;
        }
    val v = v_str(p + a, e - a);
    v.k = s.k;
    return v;
}

static size_t next_ws(const char *p, size_t n, size_t i, bool want_ws) {
    while (i < n) {
        int32_t c;
        size_t k = utf8_dec(p + i, n - i, &c);
        if (is_space_cp(c) == want_ws) return i;
        i += k;
    }
    return n;
}

size_t prev_cp(const char *p, size_t i) {
    size_t k = i - 1;
    while (k > 0 && ((unsigned char)p[k] & 0xC0) == 0x80) k--;
    return k;
}

static void push_val(rctx *r, val **items, size_t *n, size_t *cap, val v) {
    if (*n == *cap) {
        size_t c = *cap ? *cap * 2 : 8;
        *items = arena_grow(&r->a, *items, *n, c, sizeof **items);
        *cap = c;
    }
    (*items)[(*n)++] = v;
}

static val make_list(rctx *r, val *items, size_t n, int kind) {
    list *l = arena_zalloc(&r->a, sizeof *l);
    l->n = n;
    l->v = items;
    return v_list(l, kind);
}

/* Appends s[a:e] (byte offsets) to a split's pieces; a piece of a Markup is a Markup. */
static void push_piece(rctx *r, val **items, size_t *n, size_t *cap, val s, size_t a, size_t e) {
    val piece = v_str(s.u.s.p + a, e - a);
    piece.k = s.k;
    push_val(r, items, n, cap, piece);
}

val str_split(rctx *r, val s, val sep, val vmax, bool right) {
    const char *p = s.u.s.p;
    size_t n = s.u.s.n, count = 0, cap = 0;
    val *items = NULL;
    int64_t maxsplit = vmax.t == T_MISSING || vmax.t == T_NONE ? -1 : as_int(vmax);
    if (vmax.t != T_MISSING && vmax.t != T_NONE && !is_intlike(vmax)) rfail(r, "maxsplit must be an integer");
    if (maxsplit < 0) maxsplit = INT64_MAX;
    if (sep.t == T_MISSING || sep.t == T_NONE) {
        if (!right) {
            size_t i = next_ws(p, n, 0, false);
            while (i < n) {
                if (maxsplit-- == 0) {
                    push_piece(r, &items, &count, &cap, s, i, n); /* the remainder keeps its trailing whitespace */
                    break;
                }
                size_t e = next_ws(p, n, i, true);
                push_piece(r, &items, &count, &cap, s, i, e);
                i = next_ws(p, n, e, false);
            }
        } else {
            size_t e = n;
            for (;;) {
                while (e > 0) {
                    size_t k = prev_cp(p, e);
                    int32_t c;
                    utf8_dec(p + k, n - k, &c);
                    if (!is_space_cp(c)) break;
                    e = k;
                }
                if (e == 0) break;
                if (maxsplit-- == 0) {
                    push_piece(r, &items, &count, &cap, s, 0, e);
                    break;
                }
                size_t a = e;
                while (a > 0) {
                    size_t k = prev_cp(p, a);
                    int32_t c;
                    utf8_dec(p + k, n - k, &c);
                    if (is_space_cp(c)) break;
                    a = k;
                }
                push_piece(r, &items, &count, &cap, s, a, e);
                e = a;
            }
            for (size_t i = 0; i < count / 2; i++) {
                val t = items[i];
                items[i] = items[count - 1 - i];
                items[count - 1 - i] = t;
            }
        }
    } else {
        if (sep.t != T_STR) rfail(r, "must be str or None, not %s", type_name(sep));
        const char *q = sep.u.s.p;
        size_t m = sep.u.s.n;
        if (m == 0) rfail(r, "empty separator");
        if (!right) {
            size_t a = 0, i = 0;
            while (i + m <= n && maxsplit > 0) {
                if (!memcmp(p + i, q, m)) {
                    push_piece(r, &items, &count, &cap, s, a, i);
                    i += m;
                    a = i;
                    maxsplit--;
                } else {
                    i++;
                }
            }
            push_piece(r, &items, &count, &cap, s, a, n);
        } else {
            size_t e = n, i = n;
            while (i >= m && maxsplit > 0) {
                if (!memcmp(p + i - m, q, m)) {
                    push_piece(r, &items, &count, &cap, s, i, e);
                    i -= m;
                    e = i;
                    maxsplit--;
                } else {
                    i--;
                }
            }
            push_piece(r, &items, &count, &cap, s, 0, e);
            for (size_t k = 0; k < count / 2; k++) {
                val t = items[k];
                items[k] = items[count - 1 - k];
                items[count - 1 - k] = t;
            }
        }
    }
    return make_list(r, items, count, LK_LIST);
}

val str_splitlines(rctx *r, val s, bool keepends) {
    const char *p = s.u.s.p;
    size_t n = s.u.s.n, count = 0, cap = 0, a = 0, i = 0;
    val *items = NULL;
    while (i < n) {
        int32_t c;
        size_t k = utf8_dec(p + i, n - i, &c);
        if (!is_linebreak_cp(c)) {
            i += k;
            continue;
        }
        size_t e = i + k;
        if (c == '\r' && e < n && p[e] == '\n') e++;
        val piece = v_str(p + a, (keepends ? e : i) - a);
        piece.k = s.k;
        push_val(r, &items, &count, &cap, piece);
        a = i = e;
    }
    if (a < n) {
        val piece = v_str(p + a, n - a);
        piece.k = s.k;
        push_val(r, &items, &count, &cap, piece);
    }
    return make_list(r, items, count, LK_LIST);
}

/* upper, lower, capitalize and Python's str.title() */
val str_case(rctx *r, val s, int mode) {
    const char *p = s.u.s.p;
    size_t n = s.u.s.n;
    sbuf b;
    sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    sb_reserve(&b, n);
    bool prev_cased = false, first = true;
    for (size_t i = 0; i < n;) {
        int32_t c;
        size_t k = utf8_dec(p + i, n - i, &c);
        switch (mode) {
        case M_UPPER: put_case(&b, c, CASE_UPPER); break;
        case M_LOWER: put_lower_at(&b, p, n, i, c); break;
        case M_CAPITALIZE:
            if (first) put_case(&b, c, CASE_TITLE);
            else put_lower_at(&b, p, n, i, c);
            break;
        default: /* M_TITLE */
            if (prev_cased) put_lower_at(&b, p, n, i, c);
            else put_case(&b, c, CASE_TITLE);
            prev_cased = is_cased_cp(c);
        }
        first = false;
        i += k;
    }
    return out_str(&b, s.k);
}

/* jinja2's title filter: upper-cases the first letter of every word ([-\s({\[<]+ split) */
val jinja_title(rctx *r, val s) {
    const char *p = s.u.s.p;
    size_t n = s.u.s.n;
    sbuf b;
    sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    bool word_start = true;
    for (size_t i = 0; i < n;) {
        int32_t c;
        size_t k = utf8_dec(p + i, n - i, &c);
        bool sep = c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || is_space_cp(c);
        if (sep) {
            sb_put(&b, p + i, k);
            word_start = true;
        } else if (word_start) {
            put_case(&b, c, CASE_UPPER);
            word_start = false;
        } else {
            put_lower_at(&b, p, n, i, c);
        }
        i += k;
    }
    return out_str(&b, s.k);
}

val str_replace(rctx *r, val s, val old, val rep, int64_t count) {
    if (old.t != T_STR || rep.t != T_STR) rfail(r, "replace() arguments must be str");
    const char *p = s.u.s.p, *o = old.u.s.p;
    size_t n = s.u.s.n, m = old.u.s.n;
    if (count < 0) count = INT64_MAX;
    sbuf b;
    sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    if (m == 0) {
        size_t i = 0;
        while (count > 0) {
            sb_put(&b, rep.u.s.p, rep.u.s.n);
            count--;
            if (i >= n) break;
            int32_t c;
            size_t k = utf8_dec(p + i, n - i, &c);
            sb_put(&b, p + i, k);
            i += k;
        }
        if (i < n) sb_put(&b, p + i, n - i);
        return out_str(&b, s.k);
    }
    size_t i = 0, a = 0;
    while (i + m <= n && count > 0) {
        if (!memcmp(p + i, o, m)) {
            sb_put(&b, p + a, i - a);
            sb_put(&b, rep.u.s.p, rep.u.s.n);
            i += m;
            a = i;
            count--;
        } else {
            i++;
        }
    }
    sb_put(&b, p + a, n - a);
    return out_str(&b, s.k);
}

/* Python's index adjustment for find(sub, start, end) and friends (code points) */
static void adjust_range(val vstart, val vend, int64_t len, int64_t *start, int64_t *end) {
    *start = vstart.t == T_MISSING || vstart.t == T_NONE ? 0 : as_int(vstart);
    *end = vend.t == T_MISSING || vend.t == T_NONE ? len : as_int(vend);
    if (*end > len) *end = len;
    else if (*end < 0 && (*end += len) < 0) *end = 0;
    if (*start < 0 && (*start += len) < 0) *start = 0;
}

/* find / rfind / count: returns the code point index (or the count), -1 if not found */
static int64_t str_search(rctx *r, val s, val sub, val vstart, val vend, int mode) {
    if (sub.t != T_STR) rfail(r, "must be str, not %s", type_name(sub));
    const char *p = s.u.s.p;
    size_t n = s.u.s.n, m = sub.u.s.n;
    int64_t len = (int64_t)cs_utf8_count(p, n), start, end;
    adjust_range(vstart, vend, len, &start, &end);
    if (start > len || (end - start < (int64_t)cs_utf8_count(sub.u.s.p, m) && !(m == 0 && start <= end))) {
        return mode == M_COUNT ? 0 : -1;
    }
    if (end < start) return mode == M_COUNT ? 0 : -1;
    size_t bs = utf8_off(p, n, (size_t)start), be = utf8_off(p, n, (size_t)end);
    if (mode == M_COUNT) {
        if (m == 0) return end - start + 1;
        int64_t k = 0;
        for (size_t i = bs; i + m <= be;) {
            if (!memcmp(p + i, sub.u.s.p, m)) {
                k++;
                i += m;
            } else {
                i++;
            }
        }
        return k;
    }
    if (mode == M_FIND) {
        for (size_t i = bs; i + m <= be; i++)
            if (!memcmp(p + i, sub.u.s.p, m)) return (int64_t)cs_utf8_count(p, i);
        return -1;
    }
    for (size_t i = be - m + 1; i-- > bs;)
        if (i + m <= be && !memcmp(p + i, sub.u.s.p, m)) return (int64_t)cs_utf8_count(p, i);
    return -1;
}

static bool str_affix(rctx *r, val s, val affix, val vstart, val vend, bool suffix) {
    if (affix.t == T_LIST && affix.k == LK_TUPLE) {
        for (size_t i = 0; i < affix.u.l->n; i++)
            if (str_affix(r, s, affix.u.l->v[i], vstart, vend, suffix)) return true;
        return false;
    }
    if (affix.t != T_STR)
        rfail(r, "%s first arg must be str or a tuple of str, not %s", suffix ? "endswith" : "startswith", type_name(affix));
    const char *p = s.u.s.p;
    size_t n = s.u.s.n, m = affix.u.s.n;
    int64_t len = (int64_t)cs_utf8_count(p, n), start, end;
    adjust_range(vstart, vend, len, &start, &end);
    if (start > len) return false;
    if (end < start) return false;
    size_t bs = utf8_off(p, n, (size_t)start), be = utf8_off(p, n, (size_t)end);
    if (be - bs < m) return false;
    return !memcmp(suffix ? p + be - m : p + bs, affix.u.s.p, m);
}

bool str_pred(val s, int mode) {
    const char *p = s.u.s.p;
    size_t n = s.u.s.n;
    if (n == 0) return false;
    bool any_cased = false;
    for (size_t i = 0; i < n;) {
        int32_t c;
        i += utf8_dec(p + i, n - i, &c);
        switch (mode) {
        case M_ISDIGIT:
        case M_ISDECIMAL:
            if (!is_decimal_cp(c)) return false;
            break;
        case M_ISNUMERIC:
            if (!is_numeric_cp(c)) return false;
            break;
        case M_ISALPHA:
            if (!is_alpha_cp(c)) return false;
            break;
        case M_ISALNUM:
            if (!is_alpha_cp(c) && !is_numeric_cp(c)) return false;
            break;
        case M_ISSPACE:
            if (!is_space_cp(c)) return false;
            break;
        case M_ISLOWER:
            if (ucat(c) == UTF8PROC_CATEGORY_LU || ucat(c) == UTF8PROC_CATEGORY_LT) return false;
            if (ucat(c) == UTF8PROC_CATEGORY_LL) any_cased = true;
            break;
        case M_ISUPPER:
            if (ucat(c) == UTF8PROC_CATEGORY_LL || ucat(c) == UTF8PROC_CATEGORY_LT) return false;
            if (ucat(c) == UTF8PROC_CATEGORY_LU) any_cased = true;
            break;
        }
    }
    return mode == M_ISLOWER || mode == M_ISUPPER ? any_cased : true;
}

static val str_join(rctx *r, val sep, val iterable) {
    size_t n;
    const val *items = iterate(r, iterable, &n);
    sbuf b;
    sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    for (size_t i = 0; i < n; i++) {
        if (items[i].t != T_STR) rfail(r, "sequence item %zu: expected str instance, %s found", i, type_name(items[i]));
        if (i) sb_put(&b, sep.u.s.p, sep.u.s.n);
        val it = sep.k ? html_escape(r, items[i]) : items[i];
        sb_put(&b, it.u.s.p, it.u.s.n);
    }
    return out_str(&b, sep.k);
}

/* format(value, spec) for the common specs: [[fill]align][sign][0][width][,|_][.precision][type] */
static void format_spec(rctx *r, sbuf *b, val v, const char *spec, size_t sn) {
    if (sn == 0) {
        put_str(r, b, v);
        return;
    }
    char fill[5] = " ", align = 0, sign = '-', type = 0, group = 0;
    size_t filln = 1, i = 0;
    bool zero = false;
    int64_t width = -1, prec = -1;
    int32_t c0;
    size_t k0 = utf8_dec(spec, sn, &c0);
    if (k0 < sn && strchr("<>^=", spec[k0])) {
        memcpy(fill, spec, k0);
        fill[k0] = 0;
        filln = k0;
        align = spec[k0];
        i = k0 + 1;
    } else if (strchr("<>^=", spec[0])) {
        align = spec[0];
        i = 1;
    }
    if (i < sn && strchr("+- ", spec[i])) sign = spec[i++];
    if (i < sn && spec[i] == '0') {
        zero = true;
        i++;
    }
    if (i < sn && spec[i] >= '0' && spec[i] <= '9') {
        width = 0;
        while (i < sn && spec[i] >= '0' && spec[i] <= '9') {
            width = width * 10 + (spec[i++] - '0');
            if (width > (int)CHAT_TEMPLATE_MAX_OUTPUT) rfail(r, "format width is too large");
        }
    }
    if (i < sn && (spec[i] == ',' || spec[i] == '_')) group = spec[i++];
    if (i < sn && spec[i] == '.') {
        i++;
        prec = 0;
        while (i < sn && spec[i] >= '0' && spec[i] <= '9') {
            prec = prec * 10 + (spec[i++] - '0');
            if (prec > (int)CHAT_TEMPLATE_MAX_OUTPUT) rfail(r, "format precision is too large");
        }
    }
    if (i < sn) type = spec[i++];
    if (i != sn || group) rfail(r, "format spec '%.*s' is not supported", (int)sn, spec);
    sbuf t;
    sb_init(&t, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    bool numeric = is_num(v) && type != 's';
    if (!numeric) {
        if (type && type != 's') rfail(r, "format spec '%.*s' is not supported for %s", (int)sn, spec, type_name(v));
        val s = str_of(r, v);
        if (prec >= 0) s.u.s.n = utf8_off(s.u.s.p, s.u.s.n, (size_t)prec);
        put_padded(b, s, width, align ? align : '<', fill, filln);
        return;
    }
    char cfmt[16];
    if (!type && is_intlike(v)) type = 'd';
    if (!type) rfail(r, "format spec '%.*s' is not supported for floats without a type", (int)sn, spec);
    if (type == 'd' || type == 'x' || type == 'X' || type == 'o' || type == 'b') {
        if (!is_intlike(v)) rfail(r, "unknown format code '%c' for object of type 'float'", type);
        int64_t x = as_int(v);
        if (type == 'd') sb_printf(&t, "%" PRId64, x < 0 ? -x : x);
        else if (type == 'b') {
            uint64_t ux = x < 0 ? (uint64_t)(-(x + 1)) + 1 : (uint64_t)x;
            char bits[65];
            int nb = 0;
            do bits[nb++] = (char)('0' + (ux & 1)); while (ux >>= 1);
            while (nb) sb_putc(&t, bits[--nb]);
        } else {
            snprintf(cfmt, sizeof cfmt, "%%ll%c", type);
            sb_printf(&t, cfmt, x < 0 ? (unsigned long long)(-(x + 1)) + 1 : (unsigned long long)x);
        }
        if (x < 0) sign = '!';
    } else if (strchr("fFeEgG%", type)) {
        double x = as_float(v);
        if (type == '%') x *= 100;
        snprintf(cfmt, sizeof cfmt, "%%.*%c", type == '%' ? 'f' : type);
        sb_printf(&t, cfmt, (int)(prec < 0 ? 6 : prec), fabs(x));
        if (type == '%') sb_putc(&t, '%');
        if (signbit(x)) sign = '!';
    } else {
        rfail(r, "format spec '%.*s' is not supported", (int)sn, spec);
    }
    const char *sgn = sign == '!' ? "-" : sign == '+' ? "+" : sign == ' ' ? " " : "";
    val digits = sb_val(&t);
    if (zero && !align) {
        align = '=';
        fill[0] = '0';
        fill[1] = 0;
        filln = 1;
    }
    if (align == '=') {
        sb_puts(b, sgn);
        int64_t w = width - (int64_t)strlen(sgn);
        put_padded(b, digits, w, '>', fill, filln);
        return;
    }
    sbuf u;
    sb_init(&u, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    sb_puts(&u, sgn);
    sb_put(&u, digits.u.s.p, digits.u.s.n);
    put_padded(b, sb_val(&u), width, align ? align : '>', fill, filln);
}

/* str.format() with jinja2's sandboxed field lookup */
static val str_format(rctx *r, val s, const val *pos, int npos, const char **kwn, const val *kwv, int nkw) {
    const char *p = s.u.s.p, *end = p + s.u.s.n;
    sbuf b;
    sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    int auto_idx = 0;
    while (p < end) {
        if (*p == '{' && p + 1 < end && p[1] == '{') {
            sb_putc(&b, '{');
            p += 2;
            continue;
        }
        if (*p == '}') {
            if (p + 1 < end && p[1] == '}') {
                sb_putc(&b, '}');
                p += 2;
                continue;
            }
            rfail(r, "single '}' encountered in format string");
        }
        if (*p != '{') {
            sb_putc(&b, *p++);
            continue;
        }
        const char *q = ++p;
        int depth = 0;
        while (q < end && (*q != '}' || depth)) {
            if (*q == '{') depth++;
            if (*q == '}') depth--;
            if (*q == '[') {
                while (q < end && *q != ']') q++;
            }
            q++;
        }
        if (q >= end) rfail(r, "expected '}' before end of string");
        /* field: name(.attr|[key])* [!conv] [:spec] */
        const char *f = p, *fe = p;
        while (fe < q && *fe != '.' && *fe != '[' && *fe != '!' && *fe != ':') fe++;
        val obj;
        if (fe == f) {
            if (auto_idx >= npos) rfail(r, "Replacement index %d out of range for positional args tuple", auto_idx);
            obj = pos[auto_idx++];
        } else if (*f >= '0' && *f <= '9') {
            int idx = atoi(f);
            if (idx >= npos) rfail(r, "Replacement index %d out of range for positional args tuple", idx);
            obj = pos[idx];
        } else {
            int i = 0;
            while (i < nkw && (strlen(kwn[i]) != (size_t)(fe - f) || memcmp(kwn[i], f, (size_t)(fe - f)))) i++;
            if (i == nkw) rfail(r, "format field '%.*s' was not given", (int)(fe - f), f);
            obj = kwv[i];
        }
        p = fe;
        while (p < q && (*p == '.' || *p == '[')) {
            if (*p == '.') {
                const char *a = ++p;
                while (p < q && *p != '.' && *p != '[' && *p != '!' && *p != ':') p++;
                const char *name = arena_strndup(&r->a, a, (size_t)(p - a));
                obj = get_attr(r, obj, name, lookup_attr(name));
            } else {
                const char *a = ++p;
                while (p < q && *p != ']') p++;
                bool digits = p > a;
                for (const char *c = a; c < p; c++) digits = digits && *c >= '0' && *c <= '9';
                val key = digits ? v_int(atoll(a)) : mk_str(r, a, (size_t)(p - a));
                obj = get_item(r, obj, key);
                p++;
            }
        }
        char conv = 0;
        if (p < q && *p == '!') {
            conv = p[1];
            p += 2;
        }
        const char *spec = p < q && *p == ':' ? p + 1 : q;
        if (memchr(spec, '{', (size_t)(q - spec))) rfail(r, "nested format specs are not supported");
        if (conv == 'r' || conv == 'a') {
            sbuf t;
            sb_init(&t, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
            put_repr(r, &t, obj);
            obj = sb_val(&t);
        } else if (conv == 's') {
            obj = str_of(r, obj);
        } else if (conv) {
            rfail(r, "unknown conversion specifier %c", conv);
        }
        if (s.k) obj = html_escape(r, obj);
        format_spec(r, &b, obj, spec, (size_t)(q - spec));
        p = q + 1;
    }
    return out_str(&b, s.k);
}

/* One method call; p holds the arguments bound to the parameters its table entry names. */
typedef struct mcall {
    int mid;
    const args *a;
    char what[64];
    val p[3];
} mcall;

/* method_defs: a method's function, with the parameters bound before it runs (np < 0: none,
 * the function takes the arguments itself) */
typedef val (*method_fn)(rctx *r, val self, mcall *c);
struct method_def {
    method_fn fn;
    int np;
    const char *params[3];
};

static val m_strip(rctx *r, val self, mcall *c) {
    return str_strip(r, self, c->p[0], c->mid == M_STRIP ? 3 : c->mid == M_LSTRIP ? 1 : 2);
}

static val m_split(rctx *r, val self, mcall *c) { return str_split(r, self, c->p[0], c->p[1], c->mid == M_RSPLIT); }

static val m_splitlines(rctx *r, val self, mcall *c) {
    return str_splitlines(r, self, truthy(opt(c->p[0], v_bool(false))));
}

static val m_affix(rctx *r, val self, mcall *c) {
    val affix = required(r, c->p[0], c->what, "prefix");
    return v_bool(str_affix(r, self, affix, c->p[1], c->p[2], c->mid == M_ENDSWITH));
}

static val m_case(rctx *r, val self, mcall *c) { return str_case(r, self, c->mid); }

static val m_replace(rctx *r, val self, mcall *c) {
    val old = required(r, c->p[0], c->what, "old"), rep = required(r, c->p[1], c->what, "new");
    if (self.k) { /* Markup escapes its arguments */
        old = html_escape(r, old);
        rep = html_escape(r, rep);
    }
    return str_replace(r, self, old, rep, int_arg(r, opt(c->p[2], v_int(-1)), c->what));
}

/* find, rfind, index, rindex, count: of a str, or index and count of a list or tuple */
static val m_search(rctx *r, val self, mcall *c) {
    val *p = c->p;
    int mid = c->mid;
    if (self.t != T_STR) {
        static const char *const params[] = {"value", "start", "stop"};
        bind_args(r, c->what, c->a, params, 3, p);
        val x = required(r, p[0], c->what, "value");
        const list *l = self.u.l;
        if (mid == M_COUNT) {
            int64_t k = 0;
            for (size_t i = 0; i < l->n; i++) k += py_eq(r, l->v[i], x);
            return v_int(k);
        }
        int64_t start, end;
        adjust_range(p[1], p[2], (int64_t)l->n, &start, &end);
        for (int64_t i = start; i < end; i++)
            if (py_eq(r, l->v[i], x)) return v_int(i);
        rfail(r, "%s.index(x): x not in %s", type_name(self), type_name(self));
    }
    static const char *const params[] = {"sub", "start", "end"};
    bind_args(r, c->what, c->a, params, 3, p);
    int mode = mid == M_RFIND || mid == M_RINDEX ? M_RFIND : mid == M_COUNT ? M_COUNT : M_FIND;
    int64_t k = str_search(r, self, required(r, p[0], c->what, "sub"), p[1], p[2], mode);
    if (k < 0 && (mid == M_INDEX || mid == M_RINDEX)) rfail(r, "substring not found");
    return v_int(k);
}

static val m_join(rctx *r, val self, mcall *c) { return str_join(r, self, required(r, c->p[0], c->what, "iterable")); }

static val m_format(rctx *r, val self, mcall *c) {
    const args *a = c->a;
    return str_format(r, self, a->pos, a->npos, a->kwn, a->kwv, a->nkw);
}

static val m_pad(rctx *r, val self, mcall *c) {
    char align = c->mid == M_CENTER ? '^' : c->mid == M_LJUST ? '<' : '>';
    int64_t width = int_arg(r, required(r, c->p[0], c->what, "width"), c->what);
    val fill = opt(c->p[1], v_cstr(" "));
    if (fill.t != T_STR || cs_utf8_count(fill.u.s.p, fill.u.s.n) != 1)
        rfail(r, "The fill character must be exactly one character long");
    sbuf b;
    sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    put_padded(&b, self, width, align, fill.u.s.p, fill.u.s.n);
    return out_str(&b, self.k);
}

static val m_zfill(rctx *r, val self, mcall *c) {
    int64_t width = int_arg(r, required(r, c->p[0], c->what, "width"), c->what), len = py_len(r, self);
    sbuf b;
    sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    size_t skip = self.u.s.n && (self.u.s.p[0] == '+' || self.u.s.p[0] == '-');
    sb_put(&b, self.u.s.p, skip);
    for (int64_t i = len; i < width; i++) sb_putc(&b, '0');
    sb_put(&b, self.u.s.p + skip, self.u.s.n - skip);
    return out_str(&b, self.k);
}

static val m_partition(rctx *r, val self, mcall *c) {
    bool first = c->mid == M_PARTITION;
    val sep = required(r, c->p[0], c->what, "sep");
    if (sep.t != T_STR) rfail(r, "must be str, not %s", type_name(sep));
    if (!sep.u.s.n) rfail(r, "empty separator");
    int64_t at = str_search(r, self, sep, v_missing(), v_missing(), first ? M_FIND : M_RFIND);
    list *l = list_new(r, 3);
    val empty = v_str("", 0);
    empty.k = self.k;
    if (at < 0) {
        l->v[0] = first ? self : empty;
        l->v[1] = empty;
        l->v[2] = first ? empty : self;
    } else {
        size_t off = utf8_off(self.u.s.p, self.u.s.n, (size_t)at);
        l->v[0] = v_str(self.u.s.p, off);
        l->v[1] = sep;
        l->v[2] = v_str(self.u.s.p + off + sep.u.s.n, self.u.s.n - off - sep.u.s.n);
        for (int i = 0; i < 3; i++) l->v[i].k = self.k;
    }
    return v_list(l, LK_TUPLE);
}

static val m_removeaffix(rctx *r, val self, mcall *c) {
    val x = required(r, c->p[0], c->what, "affix");
    if (x.t != T_STR) rfail(r, "must be str, not %s", type_name(x));
    if (x.u.s.n <= self.u.s.n) {
        if (c->mid == M_REMOVEPREFIX && !memcmp(self.u.s.p, x.u.s.p, x.u.s.n)) {
            self.u.s.p += x.u.s.n;
            self.u.s.n -= x.u.s.n;
        } else if (c->mid == M_REMOVESUFFIX && !memcmp(self.u.s.p + self.u.s.n - x.u.s.n, x.u.s.p, x.u.s.n)) {
            self.u.s.n -= x.u.s.n;
        }
    }
    return self;
}

static val m_pred(rctx *r, val self, mcall *c) {
    (void)r;
    return v_bool(str_pred(self, c->mid));
}

/* items(), keys(), values() of a dict */
static val m_view(rctx *r, val self, mcall *c) {
    const dict *d = self.u.d;
    int kind = c->mid == M_ITEMS ? LK_ITEMS : c->mid == M_KEYS ? LK_KEYS : LK_VALUES;
    list *l = list_new(r, d->n);
    for (size_t i = 0; i < d->n; i++)
        l->v[i] = kind == LK_KEYS ? d->k[i] : kind == LK_VALUES ? d->v[i] : v_tuple2(r, d->k[i], d->v[i]);
    return v_list(l, kind);
}

static val m_get(rctx *r, val self, mcall *c) {
    val key = required(r, c->p[0], c->what, "key");
    if (!hashable(key)) rfail(r, "unhashable type: '%s'", type_name(key));
    long i = dict_find(r, self.u.d, key);
    return i >= 0 ? self.u.d->v[i] : opt(c->p[1], v_none());
}

static val m_copy(rctx *r, val self, mcall *c) {
    (void)c;
    if (self.t == T_DICT) {
        dict *d = dict_new(r, self.u.d->n);
        for (size_t i = 0; i < self.u.d->n; i++) dict_set(r, d, self.u.d->k[i], self.u.d->v[i]);
        return v_dict(d);
    }
    list *l = list_new(r, self.u.l->n);
    if (l->n) memcpy(l->v, self.u.l->v, l->n * sizeof *l->v);
    return v_list(l, LK_LIST);
}

static val m_cycle(rctx *r, val self, mcall *c) {
    const args *a = c->a;
    if (a->nkw) rfail(r, "loop.cycle() takes no keyword arguments");
    if (!a->npos) rfail(r, "no items for cycling given");
    return a->pos[self.u.lp->i % (size_t)a->npos];
}

static val m_changed(rctx *r, val self, mcall *c) {
    const args *a = c->a;
    if (a->nkw) rfail(r, "loop.changed() takes no keyword arguments");
    list *l = list_new(r, (size_t)a->npos);
    for (int i = 0; i < a->npos; i++) l->v[i] = a->pos[i];
    val now = v_list(l, LK_TUPLE);
    struct loopctx *lp = self.u.lp;
    if (lp->changed_set && py_eq(r, lp->last_changed, now)) return v_bool(false);
    lp->last_changed = now;
    lp->changed_set = true;
    return v_bool(true);
}

static val m_next(rctx *r, val self, mcall *c) {
    (void)r;
    (void)c;
    struct cycler *cy = self.u.cy;
    val v = cy->items[cy->pos];
    cy->pos = (cy->pos + 1) % cy->n;
    return v;
}

static val m_reset(rctx *r, val self, mcall *c) {
    (void)r;
    (void)c;
    self.u.cy->pos = 0;
    return v_none();
}

static const struct method_def method_defs[M_COUNT_] = {
    [M_STRIP] = {m_strip, 1, {"chars"}},
    [M_LSTRIP] = {m_strip, 1, {"chars"}},
    [M_RSTRIP] = {m_strip, 1, {"chars"}},
    [M_SPLIT] = {m_split, 2, {"sep", "maxsplit"}},
    [M_RSPLIT] = {m_split, 2, {"sep", "maxsplit"}},
    [M_SPLITLINES] = {m_splitlines, 1, {"keepends"}},
    [M_STARTSWITH] = {m_affix, 3, {"prefix", "start", "end"}},
    [M_ENDSWITH] = {m_affix, 3, {"prefix", "start", "end"}},
    [M_UPPER] = {m_case, 0, {NULL}},
    [M_LOWER] = {m_case, 0, {NULL}},
    [M_TITLE] = {m_case, 0, {NULL}},
    [M_CAPITALIZE] = {m_case, 0, {NULL}},
    [M_REPLACE] = {m_replace, 3, {"old", "new", "count"}},
    [M_FIND] = {m_search, -1, {NULL}},
    [M_RFIND] = {m_search, -1, {NULL}},
    [M_INDEX] = {m_search, -1, {NULL}},
    [M_RINDEX] = {m_search, -1, {NULL}},
    [M_COUNT] = {m_search, -1, {NULL}},
    [M_JOIN] = {m_join, 1, {"iterable"}},
    [M_FORMAT] = {m_format, -1, {NULL}},
    [M_CENTER] = {m_pad, 2, {"width", "fillchar"}},
    [M_LJUST] = {m_pad, 2, {"width", "fillchar"}},
    [M_RJUST] = {m_pad, 2, {"width", "fillchar"}},
    [M_ZFILL] = {m_zfill, 1, {"width"}},
    [M_PARTITION] = {m_partition, 1, {"sep"}},
    [M_RPARTITION] = {m_partition, 1, {"sep"}},
    [M_REMOVEPREFIX] = {m_removeaffix, 1, {"affix"}},
    [M_REMOVESUFFIX] = {m_removeaffix, 1, {"affix"}},
    [M_ISDIGIT] = {m_pred, 0, {NULL}},
    [M_ISALPHA] = {m_pred, 0, {NULL}},
    [M_ISALNUM] = {m_pred, 0, {NULL}},
    [M_ISSPACE] = {m_pred, 0, {NULL}},
    [M_ISLOWER] = {m_pred, 0, {NULL}},
    [M_ISUPPER] = {m_pred, 0, {NULL}},
    [M_ISNUMERIC] = {m_pred, 0, {NULL}},
    [M_ISDECIMAL] = {m_pred, 0, {NULL}},
    [M_ITEMS] = {m_view, 0, {NULL}},
    [M_KEYS] = {m_view, 0, {NULL}},
    [M_VALUES] = {m_view, 0, {NULL}},
    [M_GET] = {m_get, 2, {"key", "default"}},
    [M_COPY] = {m_copy, 0, {NULL}},
    [M_CYCLE] = {m_cycle, -1, {NULL}},
    [M_CHANGED] = {m_changed, -1, {NULL}},
    [M_NEXT] = {m_next, 0, {NULL}},
    [M_RESET] = {m_reset, 0, {NULL}},
};

val call_method(rctx *r, const struct bound *bm, const args *a) {
    mcall c = {.mid = bm->mid, .a = a};
    snprintf(c.what, sizeof c.what, "%s.%s()", type_name(bm->self), method_names[c.mid]);
    const struct method_def *d = c.mid >= 0 && c.mid < M_COUNT_ ? &method_defs[c.mid] : NULL;
    if (!d || !d->fn) rfail(r, "method %s is not implemented", c.what);
    if (d->np >= 0) bind_args(r, c.what, a, d->params, d->np, c.p);
    return d->fn(r, bm->self, &c);
}

/* dict(*args, **kwargs) as used by namespace() and dict() */
dict *dict_from_args(rctx *r, const args *a, const char *what) {
    if (a->npos > 1) rfail(r, "%s expected at most 1 argument, got %d", what, a->npos);
    dict *d = dict_new(r, 4);
    if (a->npos == 1) {
        val src = a->pos[0];
        if (src.t == T_DICT) {
            for (size_t i = 0; i < src.u.d->n; i++) dict_set(r, d, src.u.d->k[i], src.u.d->v[i]);
        } else {
            size_t n;
            const val *items = iterate(r, src, &n);
            for (size_t i = 0; i < n; i++) {
                size_t m;
                const val *pair = iterate(r, items[i], &m);
                if (m != 2) rfail(r, "dictionary update sequence element #%zu has length %zu; 2 is required", i, m);
                if (!hashable(pair[0])) rfail(r, "unhashable type: '%s'", type_name(pair[0]));
                dict_set(r, d, pair[0], pair[1]);
            }
        }
    }
    for (int k = 0; k < a->nkw; k++) dict_set(r, d, v_cstr(a->kwn[k]), a->kwv[k]);
    return d;
}
