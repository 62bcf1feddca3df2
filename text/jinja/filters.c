/* filters.c: argument binding for calls, and jinja2's filters and tests (the generator
 * filters among them run lazily, see lazy_filter). */
#include "text/jinja/jinja_impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

/* ------------------------------------------------------------------------- calls ---- */

/* Binds a call's arguments to the named parameters; unset ones are T_MISSING. */
void bind_args(rctx *r, const char *what, const args *a, const char *const *params, int np, val *out) {
    for (int i = 0; i < np; i++) out[i] = v_missing();
    if (a->npos > np)
        rfail(r, "%s takes at most %d argument%s (%d given)", what, np, np == 1 ? "" : "s", a->npos);
    for (int i = 0; i < a->npos; i++) out[i] = a->pos[i];
    for (int k = 0; k < a->nkw; k++) {
        int i = 0;
        while (i < np && strcmp(params[i], a->kwn[k])) i++;
        if (i == np) rfail(r, "%s got an unexpected keyword argument '%s'", what, a->kwn[k]);
        if (out[i].t != T_MISSING) rfail(r, "%s got multiple values for argument '%s'", what, a->kwn[k]);
        out[i] = a->kwv[k];
    }
}

val required(rctx *r, val v, const char *what, const char *param) {
    if (v.t == T_MISSING) rfail(r, "%s is missing the required argument '%s'", what, param);
    return v;
}

int64_t int_arg(rctx *r, val v, const char *what) {
    if (!is_intlike(v)) rfail(r, "%s: '%s' object cannot be interpreted as an integer", what, type_name(v));
    return as_int(v);
}

void dict_set(rctx *r, dict *d, val k, val v) {
    long i = dict_find(r, d, k);
    if (i >= 0) {
        d->v[i] = v;
        return;
    }
    if (d->n == d->cap) {
        size_t cap = d->cap ? d->cap * 2 : 4;
        d->k = arena_grow(&r->a, d->k, d->n, cap, sizeof *d->k);
        d->v = arena_grow(&r->a, d->v, d->n, cap, sizeof *d->v);
        d->cap = cap;
    }
    d->k[d->n] = k;
    d->v[d->n++] = v;
}

static val lower_if_str(rctx *r, val v) { return v.t == T_STR ? str_case(r, v, M_LOWER) : v; }

/* jinja2's make_attrgetter: "a.b.0" looks up item by item (digits as integers) */
typedef struct getter {
    val *parts;
    int nparts;
    val dflt;
    bool lower;
} getter;

static getter make_getter(rctx *r, val attribute, bool lower, val dflt) {
    getter g = {.dflt = dflt, .lower = lower};
    if (attribute.t == T_MISSING || attribute.t == T_NONE) return g;
    if (attribute.t != T_STR) {
        g.parts = arena_alloc(&r->a, sizeof *g.parts);
        g.parts[0] = attribute;
        g.nparts = 1;
        return g;
    }
    const char *p = attribute.u.s.p;
    size_t n = attribute.u.s.n, count = 1;
    for (size_t i = 0; i < n; i++) count += p[i] == '.';
    g.parts = arena_alloc(&r->a, count * sizeof *g.parts);
    size_t a = 0;
    for (size_t i = 0; i <= n; i++) {
        if (i < n && p[i] != '.') continue;
        bool digits = i > a;
        for (size_t j = a; j < i; j++) digits = digits && p[j] >= '0' && p[j] <= '9';
        g.parts[g.nparts++] = digits ? v_int(strtoll(p + a, NULL, 10)) : v_str(p + a, i - a);
        a = i + 1;
    }
    return g;
}

static val get_path(rctx *r, const getter *g, val item) {
    for (int i = 0; i < g->nparts; i++) {
        item = get_item(r, item, g->parts[i]);
        if (g->dflt.t != T_MISSING && g->dflt.t != T_NONE && item.t == T_UNDEF) item = g->dflt;
    }
    return g->lower ? lower_if_str(r, item) : item;
}

/* Stable merge sort of items by keys (Python's sorted()). */
static void sort_by_keys(rctx *r, val *items, val *keys, size_t n, bool reverse) {
    if (n < 2) return;
    size_t *idx = arena_alloc(&r->a, n * sizeof *idx), *tmp = arena_alloc(&r->a, n * sizeof *tmp);
    for (size_t i = 0; i < n; i++) idx[i] = i;
    for (size_t width = 1; width < n; width *= 2) {
        for (size_t lo = 0; lo < n; lo += 2 * width) {
            size_t mid = lo + width < n ? lo + width : n, hi = lo + 2 * width < n ? lo + 2 * width : n;
            size_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi) {
                bool take_right = reverse ? py_less(r, keys[idx[i]], keys[idx[j]]) : py_less(r, keys[idx[j]], keys[idx[i]]);
                tmp[k++] = take_right ? idx[j++] : idx[i++];
            }
            while (i < mid) tmp[k++] = idx[i++];
            while (j < hi) tmp[k++] = idx[j++];
        }
        memcpy(idx, tmp, n * sizeof *idx);
    }
    val *sorted = arena_alloc(&r->a, n * sizeof *sorted);
    for (size_t i = 0; i < n; i++) sorted[i] = items[idx[i]];
    memcpy(items, sorted, n * sizeof *items);
}

/* Python's float(str): returns false on ValueError */
static bool parse_py_float(const char *p, size_t n, double *out) {
    size_t a = 0, e = n;
    while (a < e) {
        int32_t c;
        size_t k = utf8_dec(p + a, e - a, &c);
        if (!is_space_cp(c)) break;
        a += k;
    }
    while (e > a) {
        size_t k = prev_cp(p, e);
        int32_t c;
        utf8_dec(p + k, e - k, &c);
        if (!is_space_cp(c)) break;
        e = k;
    }
    char tmp[512];
    size_t k = 0, i = a;
    if (e - a >= sizeof tmp) return false;
    if (i < e && (p[i] == '+' || p[i] == '-')) tmp[k++] = p[i++];
    const char *words[] = {"inf", "infinity", "nan"};
    for (int w = 0; w < 3; w++)
        if (e - i == strlen(words[w]) && !strncasecmp(p + i, words[w], e - i)) {
            memcpy(tmp + k, words[w], e - i);
            tmp[k + e - i] = 0;
            *out = strtod(tmp, NULL);
            return true;
        }
    bool digits = false, prev_digit = false;
    int part = 0; /* 0 mantissa, 1 fraction, 2 exponent */
    for (; i < e; i++) {
        char c = p[i];
        if (c >= '0' && c <= '9') {
            tmp[k++] = c;
            if (part < 2) digits = true;
            prev_digit = true;
            continue;
        }
        if (c == '_' && prev_digit && i + 1 < e && p[i + 1] >= '0' && p[i + 1] <= '9') {
            prev_digit = false;
            continue;
        }
        prev_digit = false;
        if (c == '.' && part == 0) part = 1;
        else if ((c == 'e' || c == 'E') && part < 2 && digits) {
            part = 2;
            if (i + 1 < e && (p[i + 1] == '+' || p[i + 1] == '-')) tmp[k++] = c, c = p[++i];
            else {
                tmp[k++] = c;
                if (!(i + 1 < e && p[i + 1] >= '0' && p[i + 1] <= '9')) return false;
                continue;
            }
            if (!(i + 1 < e && p[i + 1] >= '0' && p[i + 1] <= '9')) return false;
        } else return false;
        tmp[k++] = c;
    }
    if (!digits) return false;
    tmp[k] = 0;
    *out = strtod(tmp, NULL);
    return true;
}

/* Python's int(str, base): 0 ok, -1 ValueError, -2 too large */
static int parse_py_int(const char *p, size_t n, int64_t base, int64_t *out) {
    size_t a = 0, e = n;
    while (a < e && is_space_cp((unsigned char)p[a])) a++;
    while (e > a && is_space_cp((unsigned char)p[e - 1])) e--;
    if (base != 0 && (base < 2 || base > 36)) return -1;
    bool neg = false;
    if (a < e && (p[a] == '+' || p[a] == '-')) neg = p[a++] == '-';
    bool prefixed = false;
    if (e - a >= 2 && p[a] == '0') {
        int c = p[a + 1] | 0x20, pb = c == 'x' ? 16 : c == 'o' ? 8 : c == 'b' ? 2 : 0;
        if (pb && (base == 0 || base == pb)) {
            base = pb;
            a += 2;
            prefixed = true;
        }
    }
    if (base == 0) {
        base = 10;
        /* base 0 refuses leading zeros in a non-zero decimal */
        bool zeros = a < e && p[a] == '0';
        for (size_t i = a; i < e && zeros; i++) zeros = p[i] == '0' || p[i] == '_';
        if (a < e && p[a] == '0' && !zeros) return -1;
    }
    uint64_t v = 0;
    bool any = false, prev_digit = prefixed;
    for (size_t i = a; i < e; i++) {
        int c = (unsigned char)p[i];
        if (c == '_') {
            if (!prev_digit || i + 1 >= e || p[i + 1] == '_') return -1;
            prev_digit = false;
            continue;
        }
        int d = c >= '0' && c <= '9' ? c - '0' : (c | 0x20) >= 'a' && (c | 0x20) <= 'z' ? (c | 0x20) - 'a' + 10 : 99;
        if (d >= base) return -1;
        if (v > ((uint64_t)INT64_MAX + 1 - (uint64_t)d) / (uint64_t)base) return -2;
        v = v * (uint64_t)base + (uint64_t)d;
        any = prev_digit = true;
    }
    if (!any) return -1;
    if (!neg && v > (uint64_t)INT64_MAX) return -2;
    *out = neg ? (int64_t)(0 - v) : (int64_t)v;
    return 0;
}

static val float_to_int(rctx *r, double x) {
    if (isnan(x)) rfail(r, "cannot convert float NaN to integer");
    if (isinf(x)) rfail(r, "cannot convert float infinity to integer");
    if (x >= 9223372036854775808.0 || x < -9223372036854775808.0) overflow(r);
    return v_int((int64_t)x);
}

/* The generator filters (select, map, unique, items, batch, slice ...) write what they yield
 * to *out as they go: if they fail, lazy_filter keeps the items before the failure. */

/* select, reject, selectattr, rejectattr */
static void select_reject(rctx *r, val value, const args *a, bool reject, bool attr, list **out) {
    if (!truthy(value)) return;
    getter g = {0};
    int off = 0;
    if (attr) {
        if (a->npos < 1) rfail(r, "missing parameter for attribute name");
        g = make_getter(r, a->pos[0], false, v_missing());
        off = 1;
    }
    int tid = -1;
    const char *tname = NULL;
    if (a->npos > off) {
        if (a->pos[off].t != T_STR) rfail(r, "test name must be a string");
        tname = arena_strndup(&r->a, a->pos[off].u.s.p, a->pos[off].u.s.n);
        tid = lookup_test(tname);
        if (tid < 0) rfail(r, "no test named '%s'", tname);
    }
    args targs = {a->pos + off + 1, a->npos > off ? a->npos - off - 1 : 0, a->kwn, a->kwv, a->nkw};
    size_t n;
    const val *items = iterate(r, value, &n);
    list *l = *out = list_new(r, n);
    l->n = 0;
    for (size_t i = 0; i < n; i++) {
        val x = attr ? get_path(r, &g, items[i]) : items[i];
        bool ok = tid >= 0 ? do_test(r, tid, tname, x, &targs) : truthy(x);
        if (ok != reject) l->v[l->n++] = items[i];
    }
}

static void filter_map(rctx *r, val value, const args *a, list **out) {
    if (!truthy(value)) return;
    size_t n;
    const val *items;
    if (a->npos == 0 && a->nkw > 0) {
        val attribute = v_missing(), dflt = v_none();
        for (int k = 0; k < a->nkw; k++) {
            if (!strcmp(a->kwn[k], "attribute")) attribute = a->kwv[k];
            else if (!strcmp(a->kwn[k], "default")) dflt = a->kwv[k];
            else rfail(r, "unexpected keyword argument '%s'", a->kwn[k]);
        }
        if (attribute.t == T_MISSING) rfail(r, "map requires a filter argument");
        getter g = make_getter(r, attribute, false, dflt);
        items = iterate(r, value, &n);
        list *l = *out = list_new(r, n);
        l->n = 0;
        for (size_t i = 0; i < n; i++) l->v[l->n++] = get_path(r, &g, items[i]);
        return;
    }
    if (a->npos == 0) rfail(r, "map requires a filter argument");
    if (a->pos[0].t != T_STR) rfail(r, "map's filter name must be a string");
    const char *fname = arena_strndup(&r->a, a->pos[0].u.s.p, a->pos[0].u.s.n);
    int fid = lookup_filter(fname);
    if (fid < 0) rfail(r, "no filter named '%s'", fname);
    args fargs = {a->pos + 1, a->npos - 1, a->kwn, a->kwv, a->nkw};
    items = iterate(r, value, &n);
    list *l = *out = list_new(r, n);
    l->n = 0;
    for (size_t i = 0; i < n; i++) {
        val x = do_filter(r, fid, fname, items[i], &fargs);
        l->v[l->n++] = x;
    }
}

static void gen_filter(rctx *r, int fid, const char *fname, val v, const args *a, list **out);

/* Python generators run only when consumed, so an error inside one (a bad argument, an item
 * that fails) surfaces only then. The items are computed now; a template error is kept in
 * the iterator, with the items before it, and raised when something consumes that far. */
static val lazy_filter(rctx *r, int fid, const char *fname, val v, const args *a) {
    iterobj *it = arena_zalloc(&r->a, sizeof *it);
    it->l = list_new(r, 0);
    jmp_buf saved;
    memcpy(saved, r->ec.jb, sizeof saved);
    int depth = r->depth, line = r->line;
    sbuf *out = r->out;
    if (setjmp(r->ec.jb) == 0) {
        gen_filter(r, fid, fname, v, a, &it->l);
    } else {
        if (r->ec.fatal) {
            memcpy(r->ec.jb, saved, sizeof saved);
            longjmp(r->ec.jb, 1);
        }
        it->err = arena_strndup(&r->a, r->ec.msg, strlen(r->ec.msg));
        r->depth = depth;
        r->line = line;
        r->out = out;
    }
    memcpy(r->ec.jb, saved, sizeof saved);
    return (val){.t = T_ITER, .u.it = it};
}

static val filter_indent(rctx *r, val s, val width, val first, val blank) {
    if (s.t == T_UNDEF) undef_fail(r, s);
    if (s.t != T_STR) rfail(r, "unsupported operand type(s) for +=: '%s' and 'str'", type_name(s));
    sbuf ind;
    sb_init(&ind, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    if (width.t == T_STR) sb_put(&ind, width.u.s.p, width.u.s.n);
    else
        for (int64_t i = int_arg(r, opt(width, v_int(4)), "indent"); i > 0; i--) sb_putc(&ind, ' ');
    sbuf tmp;
    sb_init(&tmp, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    sb_put(&tmp, s.u.s.p, s.u.s.n);
    sb_putc(&tmp, '\n');
    val lines = str_splitlines(r, sb_val(&tmp), false);
    sbuf b;
    sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    if (truthy(first)) sb_put(&b, ind.p, ind.n);
    const list *l = lines.u.l;
    for (size_t i = 0; i < l->n; i++) {
        if (i) {
            sb_putc(&b, '\n');
            if (truthy(blank) || l->v[i].u.s.n) sb_put(&b, ind.p, ind.n);
        }
        sb_put(&b, l->v[i].u.s.p, l->v[i].u.s.n);
    }
    return out_str(&b, s.k);
}

static val filter_round(rctx *r, val v, val vprec, val vmethod) {
    int64_t prec = int_arg(r, opt(vprec, v_int(0)), "round");
    val method = opt(vmethod, v_cstr("common"));
    bool common = method.t == T_STR && method.u.s.n == 6 && !memcmp(method.u.s.p, "common", 6);
    bool ceil_ = method.t == T_STR && method.u.s.n == 4 && !memcmp(method.u.s.p, "ceil", 4);
    bool floor_ = method.t == T_STR && method.u.s.n == 5 && !memcmp(method.u.s.p, "floor", 5);
    if (!common && !ceil_ && !floor_) rfail(r, "method must be common, ceil or floor");
    if (v.t == T_UNDEF) undef_fail(r, v);
    if (!is_num(v)) rfail(r, "type %s doesn't define __round__ method", type_name(v));
    if (common) {
        if (is_intlike(v)) {
            int64_t x = as_int(v);
            if (prec >= 0) return v_int(x);
            double m = pow(10.0, (double)-prec), q = (double)x / m, rq = nearbyint(q);
            return v_int((int64_t)(rq * m));
        }
        double x = v.u.f;
        if (!isfinite(x) || prec > 300) return v_float(x);
        if (prec >= 0) {
            char tmp[400];
            snprintf(tmp, sizeof tmp, "%.*f", (int)prec, x);
            return v_float(strtod(tmp, NULL));
        }
        double m = pow(10.0, (double)-prec);
        return v_float(nearbyint(x / m) * m);
    }
    val scale = prec >= 0 ? num_op(r, OP_POW, v_int(10), v_int(prec)) : v_float(pow(10.0, (double)prec));
    val x = num_op(r, OP_MUL, v, scale);
    val y = is_intlike(x) ? x : float_to_int(r, ceil_ ? ceil(x.u.f) : floor(x.u.f));
    return num_op(r, OP_DIV, y, scale);
}

static val filter_tojson(rctx *r, val v, const val *p) {
    json_opts o = {.ensure_ascii = truthy(opt(p[0], v_bool(false))), .sort_keys = truthy(opt(p[3], v_bool(false)))};
    val indent = opt(p[1], v_none()), seps = opt(p[2], v_none());
    if (indent.t != T_NONE) {
        if (indent.t != T_STR && !is_intlike(indent)) rfail(r, "tojson: indent must be an integer or a string");
        o.indent_set = true;
        o.indent = indent;
    }
    o.item_sep = o.indent_set ? "," : ", ";
    o.key_sep = ": ";
    if (seps.t != T_NONE) {
        if (seps.t != T_LIST || seps.u.l->n != 2 || seps.u.l->v[0].t != T_STR || seps.u.l->v[1].t != T_STR)
            rfail(r, "tojson: separators must be a pair of strings");
        o.item_sep = seps.u.l->v[0].u.s.p;
        o.item_sep_n = seps.u.l->v[0].u.s.n;
        o.key_sep = seps.u.l->v[1].u.s.p;
        o.key_sep_n = seps.u.l->v[1].u.s.n;
    } else {
        o.item_sep_n = strlen(o.item_sep);
        o.key_sep_n = strlen(o.key_sep);
    }
    sbuf b;
    sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    json_put(r, &b, v, &o, 0);
    return sb_val(&b);
}

static val min_max(rctx *r, val value, const val *p, bool max) {
    size_t n;
    const val *items = iterate(r, value, &n);
    if (n == 0) return v_undef("No aggregated item, sequence was empty.");
    getter g = make_getter(r, opt(p[1], v_none()), !truthy(opt(p[0], v_bool(false))), v_missing());
    size_t best = 0;
    val best_key = get_path(r, &g, items[0]);
    for (size_t i = 1; i < n; i++) {
        val k = get_path(r, &g, items[i]);
        if (max ? py_less(r, best_key, k) : py_less(r, k, best_key)) {
            best = i;
            best_key = k;
        }
    }
    return items[best];
}

static val filter_sort(rctx *r, val value, const val *p) {
    bool reverse = truthy(opt(p[0], v_bool(false))), lower = !truthy(opt(p[1], v_bool(false)));
    val attribute = opt(p[2], v_none());
    list *l = to_list(r, value);
    val *keys = arena_alloc(&r->a, (l->n ? l->n : 1) * sizeof *keys);
    /* make_multi_attrgetter: the key is a list, one item per comma-separated attribute */
    int nattr = 1;
    getter gs[16];
    if (attribute.t == T_STR) {
        const char *s = attribute.u.s.p;
        size_t n = attribute.u.s.n, a = 0;
        nattr = 0;
        for (size_t i = 0; i <= n; i++)
            if (i == n || s[i] == ',') {
                if (nattr == 16) rfail(r, "sort: too many attributes");
                gs[nattr++] = make_getter(r, v_str(s + a, i - a), lower, v_missing());
                a = i + 1;
            }
    } else {
        gs[0] = make_getter(r, attribute, lower, v_missing());
    }
    for (size_t i = 0; i < l->n; i++) {
        list *k = list_new(r, (size_t)nattr);
        for (int j = 0; j < nattr; j++) k->v[j] = get_path(r, &gs[j], l->v[i]);
        keys[i] = v_list(k, LK_LIST);
    }
    sort_by_keys(r, l->v, keys, l->n, reverse);
    return v_list(l, LK_LIST);
}

static val filter_truncate(rctx *r, val s, const val *p) {
    int64_t length = int_arg(r, opt(p[0], v_int(255)), "truncate");
    bool killwords = truthy(opt(p[1], v_bool(false)));
    val end = opt(p[2], v_cstr("..."));
    int64_t leeway = int_arg(r, opt(p[3], v_int(5)), "truncate");
    if (end.t != T_STR) rfail(r, "truncate: end must be a string");
    int64_t endlen = (int64_t)cs_utf8_count(end.u.s.p, end.u.s.n);
    if (length < endlen) rfail(r, "expected length >= %" PRId64 ", got %" PRId64, endlen, length);
    if (leeway < 0) rfail(r, "expected leeway >= 0, got %" PRId64, leeway);
    if (py_len(r, s) <= length + leeway) return s; /* anything with a length comes back as it is */
    if (s.t != T_STR) rfail(r, "'%s' object has no attribute 'rsplit'", type_name(s));
    val head = get_slice(r, s, v_none(), v_int(length - endlen), v_none());
    if (!killwords) head = str_split(r, head, v_cstr(" "), v_int(1), true).u.l->v[0];
    return arith(r, OP_ADD, head, end);
}

static val filter_wordcount(rctx *r, val v) {
    val s = str_of(r, v);
    int64_t words = 0;
    bool in_word = false;
    for (size_t i = 0; i < s.u.s.n;) {
        int32_t c;
        i += utf8_dec(s.u.s.p + i, s.u.s.n - i, &c);
        bool w = c == '_' || is_alpha_cp(c) || is_numeric_cp(c);
        if (w && !in_word) words++;
        in_word = w;
    }
    return v_int(words);
}

static val reversed_iter(rctx *r, const val *items, size_t n) {
    list *l = list_new(r, n);
    for (size_t i = 0; i < n; i++) l->v[i] = items[n - 1 - i];
    return v_iter(r, l);
}

/* One filter call; p holds the arguments bound to the parameters its table entry names. */
typedef struct fcall {
    int fid;
    const char *fname;
    const args *a;
    char what[64];
    val p[6];
} fcall;

/* filter_defs: a filter's function, with the parameters bound before it runs (np < 0: none,
 * the function takes the arguments itself); a generator also has the function that yields
 * its items, run by lazy_filter */
typedef val (*filter_fn)(rctx *r, val v, const fcall *c);
typedef void (*gen_fn)(rctx *r, val v, const fcall *c, list **out);
struct filter_def {
    filter_fn fn;
    gen_fn gen;
    int np;
    const char *params[4];
};
static val f_abs(rctx *r, val v, const fcall *c) {
    (void)c;
    if (v.t == T_UNDEF) undef_fail(r, v);
    if (v.t == T_FLOAT) return v_float(fabs(v.u.f));
    if (!is_intlike(v)) rfail(r, "bad operand type for abs(): '%s'", type_name(v));
    if (as_int(v) == INT64_MIN) overflow(r);
    return v_int(llabs(as_int(v)));
}

static val f_attr(rctx *r, val v, const fcall *c) {
    val name = required(r, c->p[0], c->what, "name");
    if (v.t == T_UNDEF) undef_fail(r, v);
    if (name.t != T_STR) rfail(r, "attribute name must be a string");
    const char *nm = arena_strndup(&r->a, name.u.s.p, name.u.s.n);
    bool found;
    val x = attr_only(r, v, nm, lookup_attr(nm), &found);
    return found ? x : no_attr(r, v, nm);
}

/* the generators: a call with bad arguments fails at once, the rest when consumed */
static val f_lazy(rctx *r, val v, const fcall *c) {
    if (c->fid == F_BATCH || c->fid == F_SLICE)
        required(r, c->p[0], c->what, c->fid == F_BATCH ? "linecount" : "slices");
    return lazy_filter(r, c->fid, c->fname, v, c->a);
}

static val f_case(rctx *r, val v, const fcall *c) {
    int mode = c->fid == F_LOWER ? M_LOWER : c->fid == F_UPPER ? M_UPPER : M_CAPITALIZE;
    return str_case(r, soft_str(r, v), mode);
}

static val f_center(rctx *r, val v, const fcall *c) {
    val s = soft_str(r, v);
    sbuf b;
    sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    put_padded(&b, s, int_arg(r, opt(c->p[0], v_int(80)), c->what), '^', " ", 1);
    return out_str(&b, s.k);
}

static val f_default(rctx *r, val v, const fcall *c) {
    (void)r;
    if (v.t == T_UNDEF || (truthy(opt(c->p[1], v_bool(false))) && !truthy(v))) return opt(c->p[0], v_str("", 0));
    return v;
}

static val f_dictsort(rctx *r, val v, const fcall *c) {
    const val *p = c->p;
    if (v.t == T_UNDEF) undef_fail(r, v);
    if (v.t != T_DICT) rfail(r, "dictsort needs a dict, not %s", type_name(v));
    val by = opt(p[1], v_cstr("key"));
    int pos;
    if (by.t == T_STR && by.u.s.n == 3 && !memcmp(by.u.s.p, "key", 3)) pos = 0;
    else if (by.t == T_STR && by.u.s.n == 5 && !memcmp(by.u.s.p, "value", 5)) pos = 1;
    else rfail(r, "You can only sort by either \"key\" or \"value\"");
    bool lower = !truthy(opt(p[0], v_bool(false)));
    const dict *d = v.u.d;
    list *l = list_new(r, d->n);
    val *keys = arena_alloc(&r->a, (d->n ? d->n : 1) * sizeof *keys);
    for (size_t i = 0; i < d->n; i++) {
        l->v[i] = v_tuple2(r, d->k[i], d->v[i]);
        keys[i] = pos ? d->v[i] : d->k[i];
        if (lower) keys[i] = lower_if_str(r, keys[i]);
    }
    sort_by_keys(r, l->v, keys, l->n, truthy(opt(p[2], v_bool(false))));
    return v_list(l, LK_LIST);
}

static val f_escape(rctx *r, val v, const fcall *c) {
    (void)c;
    return html_escape(r, v);
}

static val f_forceescape(rctx *r, val v, const fcall *c) {
    (void)c;
    val s = str_of(r, v);
    s.k = 0;
    return html_escape(r, s);
}

static val f_first(rctx *r, val v, const fcall *c) {
    (void)c;
    if (v.t == T_ITER) {
        iterobj *it = v.u.it;
        if (it->pos < it->l->n) return it->l->v[it->pos++];
        if (it->err) throw_status(&r->ec, CS_EINVAL, "%s", it->err);
    } else {
        size_t n;
        const val *items = iterate(r, v, &n);
        if (n) return items[0];
    }
    return v_undef("No first item, sequence was empty.");
}

static val f_float(rctx *r, val v, const fcall *c) {
    val dflt = opt(c->p[0], v_float(0.0));
    if (v.t == T_UNDEF) undef_fail(r, v);
    if (is_num(v)) return v_float(as_float(v));
    double x;
    if (v.t == T_STR && parse_py_float(v.u.s.p, v.u.s.n, &x)) return v_float(x);
    return dflt;
}

static val f_format(rctx *r, val v, const fcall *c) {
    const args *a = c->a;
    if (a->npos && a->nkw) rfail(r, "can't handle positional and keyword arguments at the same time");
    val s = soft_str(r, v), fargs;
    if (a->nkw) {
        dict *d = dict_new(r, (size_t)a->nkw);
        for (int k = 0; k < a->nkw; k++) dict_set(r, d, v_cstr(a->kwn[k]), a->kwv[k]);
        fargs = v_dict(d);
    } else {
        list *l = list_new(r, (size_t)a->npos);
        for (int k = 0; k < a->npos; k++) l->v[k] = a->pos[k];
        fargs = v_list(l, LK_TUPLE);
    }
    return percent_format(r, s, fargs);
}

static val f_indent(rctx *r, val v, const fcall *c) { return filter_indent(r, v, c->p[0], c->p[1], c->p[2]); }

static val f_int(rctx *r, val v, const fcall *c) {
    val dflt = opt(c->p[0], v_int(0));
    int64_t base = int_arg(r, opt(c->p[1], v_int(10)), c->what), x;
    if (v.t == T_UNDEF) undef_fail(r, v);
    if (is_intlike(v)) return v_int(as_int(v));
    if (v.t == T_FLOAT) return float_to_int(r, v.u.f);
    if (v.t != T_STR) return dflt;
    int rc = parse_py_int(v.u.s.p, v.u.s.n, base, &x);
    if (rc == 0) return v_int(x);
    if (rc == -2) overflow(r);
    double f;
    if (parse_py_float(v.u.s.p, v.u.s.n, &f) && isfinite(f)) return float_to_int(r, f);
    return dflt;
}

static val f_join(rctx *r, val v, const fcall *c) {
    val sep = str_of(r, opt(c->p[0], v_str("", 0)));
    getter g = make_getter(r, opt(c->p[1], v_none()), false, v_missing());
    size_t n;
    const val *items = iterate(r, v, &n);
    sbuf b;
    sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    for (size_t i = 0; i < n; i++) {
        if (i) sb_put(&b, sep.u.s.p, sep.u.s.n);
        put_str(r, &b, get_path(r, &g, items[i]));
    }
    return sb_val(&b);
}

static val f_last(rctx *r, val v, const fcall *c) {
    (void)c;
    if (v.t == T_ITER) rfail(r, "'generator' object is not reversible");
    if (v.t == T_STR || v.t == T_LIST || v.t == T_DICT || v.t == T_UNDEF) {
        size_t n;
        const val *items = iterate(r, v, &n);
        if (n) return items[n - 1];
        return v_undef("No last item, sequence was empty.");
    }
    rfail(r, "'%s' object is not reversible", type_name(v));
}

static val f_length(rctx *r, val v, const fcall *c) {
    (void)c;
    return v_int(py_len(r, v));
}

static val f_list(rctx *r, val v, const fcall *c) {
    (void)c;
    return v_list(to_list(r, v), LK_LIST);
}

static val f_min_max(rctx *r, val v, const fcall *c) { return min_max(r, v, c->p, c->fid == F_MAX); }

static val f_replace(rctx *r, val v, const fcall *c) {
    const val *p = c->p;
    val s = str_of(r, v), old = str_of(r, required(r, p[0], c->what, "old"));
    val rep = str_of(r, required(r, p[1], c->what, "new"));
    val count = opt(p[2], v_none());
    s.k = 0;
    return str_replace(r, s, old, rep, count.t == T_NONE ? -1 : int_arg(r, count, c->what));
}

static val f_reverse(rctx *r, val v, const fcall *c) {
    (void)c;
    if (v.t == T_STR) return get_slice(r, v, v_none(), v_none(), v_int(-1));
    if (v.t == T_ITER) {
        list *l = to_list(r, v);
        list *out = list_new(r, l->n);
        for (size_t i = 0; i < l->n; i++) out->v[i] = l->v[l->n - 1 - i];
        return v_list(out, LK_LIST);
    }
    if (v.t == T_LIST || v.t == T_DICT || v.t == T_UNDEF) {
        size_t n;
        const val *items = iterate(r, v, &n);
        return reversed_iter(r, items, n);
    }
    rfail(r, "argument must be iterable");
}

static val f_round(rctx *r, val v, const fcall *c) { return filter_round(r, v, c->p[0], c->p[1]); }

static val f_safe(rctx *r, val v, const fcall *c) {
    (void)c;
    return v_markup(str_of(r, v));
}

static val f_sort(rctx *r, val v, const fcall *c) { return filter_sort(r, v, c->p); }

static val f_string(rctx *r, val v, const fcall *c) {
    (void)c;
    return soft_str(r, v);
}

static val f_sum(rctx *r, val v, const fcall *c) {
    val acc = opt(c->p[1], v_int(0));
    if (acc.t == T_STR) rfail(r, "sum() can't sum strings [use ''.join(seq) instead]");
    getter g = make_getter(r, opt(c->p[0], v_none()), false, v_missing());
    size_t n;
    const val *items = iterate(r, v, &n);
    for (size_t i = 0; i < n; i++) acc = arith(r, OP_ADD, acc, get_path(r, &g, items[i]));
    return acc;
}

static val f_title(rctx *r, val v, const fcall *c) {
    (void)c;
    return jinja_title(r, soft_str(r, v));
}

static val f_tojson(rctx *r, val v, const fcall *c) { return filter_tojson(r, v, c->p); }
static val f_trim(rctx *r, val v, const fcall *c) { return str_strip(r, soft_str(r, v), opt(c->p[0], v_none()), 3); }
static val f_truncate(rctx *r, val v, const fcall *c) { return filter_truncate(r, v, c->p); }

static val f_wordcount(rctx *r, val v, const fcall *c) {
    (void)c;
    return filter_wordcount(r, v);
}

/* The generator filters, run by lazy_filter: what they yield goes to *out as it comes. */
static void g_map(rctx *r, val v, const fcall *c, list **out) { filter_map(r, v, c->a, out); }

static void g_select_reject(rctx *r, val v, const fcall *c, list **out) {
    int fid = c->fid;
    select_reject(r, v, c->a, fid == F_REJECT || fid == F_REJECTATTR, fid == F_SELECTATTR || fid == F_REJECTATTR,
                  out);
}

static void g_items(rctx *r, val v, const fcall *c, list **out) {
    (void)c;
    if (v.t == T_UNDEF) return;
    if (v.t != T_DICT) rfail(r, "Can only get item pairs from a mapping.");
    list *l = *out = list_new(r, v.u.d->n);
    for (size_t i = 0; i < l->n; i++) l->v[i] = v_tuple2(r, v.u.d->k[i], v.u.d->v[i]);
}

static void g_batch(rctx *r, val v, const fcall *c, list **out) {
    int64_t count = int_arg(r, required(r, c->p[0], c->what, "linecount"), c->what);
    if (count < 1) rfail(r, "batch: linecount must be at least 1");
    val fill = opt(c->p[1], v_none());
    size_t n;
    const val *items = iterate(r, v, &n);
    size_t nb = (n + (size_t)count - 1) / (size_t)count;
    list *l = *out = list_new(r, nb);
    for (size_t i = 0; i < nb; i++) {
        size_t len = n - i * (size_t)count < (size_t)count ? n - i * (size_t)count : (size_t)count;
        size_t full = fill.t != T_NONE ? (size_t)count : len;
        list *batch = list_new(r, full);
        for (size_t j = 0; j < full; j++) batch->v[j] = j < len ? items[i * (size_t)count + j] : fill;
        l->v[i] = v_list(batch, LK_LIST);
    }
}

static void g_slice(rctx *r, val v, const fcall *c, list **out) {
    int64_t slices = int_arg(r, required(r, c->p[0], c->what, "slices"), c->what);
    if (slices < 1) rfail(r, "slice: slices must be at least 1");
    val fill = opt(c->p[1], v_none());
    list *seq = to_list(r, v);
    size_t length = seq->n, per = length / (size_t)slices, extra = length % (size_t)slices, offset = 0;
    list *l = *out = list_new(r, (size_t)slices);
    for (size_t k = 0; k < (size_t)slices; k++) {
        size_t start = offset + k * per;
        if (k < extra) offset++;
        size_t end = offset + (k + 1) * per;
        bool pad = fill.t != T_NONE && k >= extra;
        list *part = list_new(r, end - start + pad);
        for (size_t j = start; j < end; j++) part->v[j - start] = seq->v[j];
        if (pad) part->v[end - start] = fill;
        l->v[k] = v_list(part, LK_LIST);
    }
}

static void g_unique(rctx *r, val v, const fcall *c, list **out) {
    getter g = make_getter(r, opt(c->p[1], v_none()), !truthy(opt(c->p[0], v_bool(false))), v_missing());
    size_t n;
    const val *items = iterate(r, v, &n);
    list *l = *out = list_new(r, n), *seen = list_new(r, n);
    l->n = seen->n = 0;
    for (size_t i = 0; i < n; i++) {
        val k = get_path(r, &g, items[i]);
        if (!hashable(k)) rfail(r, "unhashable type: '%s'", type_name(k));
        if (list_contains(r, seen, k)) continue;
        seen->v[seen->n++] = k;
        l->v[l->n++] = items[i];
    }
}

static const struct filter_def filter_defs[] = {
    [F_ABS] = {f_abs, NULL, 0, {NULL}},
    [F_ATTR] = {f_attr, NULL, 1, {"name"}},
    [F_BATCH] = {f_lazy, g_batch, 2, {"linecount", "fill_with"}},
    [F_CAPITALIZE] = {f_case, NULL, 0, {NULL}},
    [F_CENTER] = {f_center, NULL, 1, {"width"}},
    [F_DEFAULT] = {f_default, NULL, 2, {"default_value", "boolean"}},
    [F_DICTSORT] = {f_dictsort, NULL, 3, {"case_sensitive", "by", "reverse"}},
    [F_ESCAPE] = {f_escape, NULL, 0, {NULL}},
    [F_FIRST] = {f_first, NULL, 0, {NULL}},
    [F_FLOAT] = {f_float, NULL, 1, {"default"}},
    [F_FORCEESCAPE] = {f_forceescape, NULL, 0, {NULL}},
    [F_FORMAT] = {f_format, NULL, -1, {NULL}},
    [F_INDENT] = {f_indent, NULL, 3, {"width", "first", "blank"}},
    [F_INT] = {f_int, NULL, 2, {"default", "base"}},
    [F_ITEMS] = {f_lazy, g_items, 0, {NULL}},
    [F_JOIN] = {f_join, NULL, 2, {"d", "attribute"}},
    [F_LAST] = {f_last, NULL, 0, {NULL}},
    [F_LENGTH] = {f_length, NULL, 0, {NULL}},
    [F_LIST] = {f_list, NULL, 0, {NULL}},
    [F_LOWER] = {f_case, NULL, 0, {NULL}},
    [F_MAP] = {f_lazy, g_map, -1, {NULL}},
    [F_MAX] = {f_min_max, NULL, 2, {"case_sensitive", "attribute"}},
    [F_MIN] = {f_min_max, NULL, 2, {"case_sensitive", "attribute"}},
    [F_REJECT] = {f_lazy, g_select_reject, -1, {NULL}},
    [F_REJECTATTR] = {f_lazy, g_select_reject, -1, {NULL}},
    [F_REPLACE] = {f_replace, NULL, 3, {"old", "new", "count"}},
    [F_REVERSE] = {f_reverse, NULL, 0, {NULL}},
    [F_ROUND] = {f_round, NULL, 2, {"precision", "method"}},
    [F_SAFE] = {f_safe, NULL, 0, {NULL}},
    [F_SELECT] = {f_lazy, g_select_reject, -1, {NULL}},
    [F_SELECTATTR] = {f_lazy, g_select_reject, -1, {NULL}},
    [F_SLICE] = {f_lazy, g_slice, 2, {"slices", "fill_with"}},
    [F_SORT] = {f_sort, NULL, 3, {"reverse", "case_sensitive", "attribute"}},
    [F_STRING] = {f_string, NULL, 0, {NULL}},
    [F_SUM] = {f_sum, NULL, 2, {"attribute", "start"}},
    [F_TITLE] = {f_title, NULL, 0, {NULL}},
    [F_TOJSON] = {f_tojson, NULL, 4, {"ensure_ascii", "indent", "separators", "sort_keys"}},
    [F_TRIM] = {f_trim, NULL, 1, {"chars"}},
    [F_TRUNCATE] = {f_truncate, NULL, 4, {"length", "killwords", "end", "leeway"}},
    [F_UNIQUE] = {f_lazy, g_unique, 2, {"case_sensitive", "attribute"}},
    [F_UPPER] = {f_case, NULL, 0, {NULL}},
    [F_WORDCOUNT] = {f_wordcount, NULL, 0, {NULL}},
};

static void fcall_init(rctx *r, fcall *c, int fid, const char *fname, const args *a) {
    c->fid = fid;
    c->fname = fname;
    c->a = a;
    snprintf(c->what, sizeof c->what, "filter '%s'", fname);
    const struct filter_def *d = &filter_defs[fid];
    if (d->np >= 0) bind_args(r, c->what, a, d->params, d->np, c->p);
}

val do_filter(rctx *r, int fid, const char *fname, val v, const args *a) {
    if (fid < 0 || fid >= (int)(sizeof filter_defs / sizeof filter_defs[0]) || !filter_defs[fid].fn)
        rfail(r, "filter '%s' is not implemented", fname);
    fcall c;
    fcall_init(r, &c, fid, fname, a);
    return filter_defs[fid].fn(r, v, &c);
}

static void gen_filter(rctx *r, int fid, const char *fname, val v, const args *a, list **out) {
    if (!filter_defs[fid].gen) rfail(r, "filter '%s' is not a generator", fname);
    fcall c;
    fcall_init(r, &c, fid, fname, a);
    filter_defs[fid].gen(r, v, &c, out);
}

bool do_test(rctx *r, int tid, const char *tname, val v, const args *a) {
    val p[1];
    char what[64];
    snprintf(what, sizeof what, "test '%s'", tname);
    static const char *const one[] = {"other"};
    bool one_arg = tid == X_DIVISIBLEBY || tid == X_SAMEAS || tid >= X_IN;
    bind_args(r, what, a, one, one_arg ? 1 : 0, p);
    switch (tid) {
    case X_ODD: return py_eq(r, arith(r, OP_MOD, v, v_int(2)), v_int(1));
    case X_EVEN: return py_eq(r, arith(r, OP_MOD, v, v_int(2)), v_int(0));
    case X_DIVISIBLEBY: return py_eq(r, arith(r, OP_MOD, v, required(r, p[0], what, "num")), v_int(0));
    case X_DEFINED: return v.t != T_UNDEF;
    case X_UNDEFINED: return v.t == T_UNDEF;
    case X_FILTER: {
        if (v.t != T_STR) return false;
        const char *s = arena_strndup(&r->a, v.u.s.p, v.u.s.n);
        return lookup_filter(s) >= 0 || is_unsupported_filter(s);
    }
    case X_TEST: return v.t == T_STR && lookup_test(arena_strndup(&r->a, v.u.s.p, v.u.s.n)) >= 0;
    case X_NONE: return v.t == T_NONE;
    case X_BOOLEAN: return v.t == T_BOOL;
    case X_FALSE: return v.t == T_BOOL && !v.u.b;
    case X_TRUE: return v.t == T_BOOL && v.u.b;
    case X_INTEGER: return v.t == T_INT;
    case X_FLOAT: return v.t == T_FLOAT;
    case X_NUMBER: return is_num(v);
    case X_LOWER: return str_pred(str_of(r, v), M_ISLOWER);
    case X_UPPER: return str_pred(str_of(r, v), M_ISUPPER);
    case X_STRING: return v.t == T_STR;
    case X_MAPPING: return v.t == T_DICT;
    case X_SEQUENCE:
        return v.t == T_STR || v.t == T_DICT || v.t == T_UNDEF || (v.t == T_LIST && v.k <= LK_RANGE);
    case X_ITERABLE: return v.t == T_STR || v.t == T_LIST || v.t == T_DICT || v.t == T_UNDEF || v.t == T_ITER || v.t == T_LOOP;
    case X_CALLABLE:
        return v.t == T_MACRO || v.t == T_FUNC || v.t == T_METHOD || v.t == T_UNDEF || v.t == T_LOOP || v.t == T_JOINER;
    case X_SAMEAS: {
        val o = required(r, p[0], what, "other");
        if (v.t != o.t) return false;
        if (v.t == T_NONE || v.t == T_UNDEF) return v.t == T_NONE || v.u.msg == o.u.msg;
        if (v.t == T_BOOL) return v.u.b == o.u.b;
        if (v.t == T_INT) return v.u.i == o.u.i && v.u.i >= -5 && v.u.i <= 256; /* CPython's small ints */
        if (v.t == T_STR) return v.u.s.p == o.u.s.p && v.u.s.n == o.u.s.n;
        if (v.t == T_FLOAT) return false;
        return v.u.l == o.u.l;
    }
    case X_ESCAPED: return v.t == T_STR && v.k;
    case X_IN: return py_in(r, v, required(r, p[0], what, "seq"));
    case X_EQ: return py_eq(r, v, required(r, p[0], what, "other"));
    case X_NE: return !py_eq(r, v, required(r, p[0], what, "other"));
    case X_GT: return py_order(r, v, required(r, p[0], what, "other"), OP_GT);
    case X_GE: return py_order(r, v, required(r, p[0], what, "other"), OP_GTEQ);
    case X_LT: return py_order(r, v, required(r, p[0], what, "other"), OP_LT);
    case X_LE: return py_order(r, v, required(r, p[0], what, "other"), OP_LTEQ);
    }
    rfail(r, "test '%s' is not implemented", tname);
}
