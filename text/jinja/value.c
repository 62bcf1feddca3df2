/* value.c: render-time values and scopes: constructors, Python truthiness, str() and repr(),
 * equality and ordering, json.dumps (tojson), conversion from JSON and iteration. */
#include "text/jinja/jinja_impl.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

/* ---------------------------------------------------------------------- evaluation ---- */

_Noreturn void rfail(rctx *r, const char *fmt, ...) {
    char tmp[900];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    throw_status(&r->ec, CS_EINVAL, "line %d: %s", r->line, tmp);
}

void enter_r(rctx *r) {
    if (++r->depth > CHAT_TEMPLATE_MAX_DEPTH)
        throw_limit(&r->ec, "line %d: template nested or recursed deeper than %d evaluation levels", r->line,
                    CHAT_TEMPLATE_MAX_DEPTH);
}

scope *scope_new(rctx *r, scope *parent) {
    scope *s = arena_zalloc(&r->a, sizeof *s);
    s->parent = parent;
    return s;
}

val *scope_find(scope *s, const char *name) {
    for (; s; s = s->parent)
        for (size_t i = s->n; i-- > 0;)
            if (!strcmp(s->names[i], name)) return &s->vals[i];
    return NULL;
}

void scope_set(rctx *r, scope *s, const char *name, val v) {
    for (size_t i = 0; i < s->n; i++)
        if (!strcmp(s->names[i], name)) {
            s->vals[i] = v;
            return;
        }
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 4;
        s->names = arena_grow(&r->a, s->names, s->n, cap, sizeof *s->names);
        s->vals = arena_grow(&r->a, s->vals, s->n, cap, sizeof *s->vals);
        s->cap = cap;
    }
    s->names[s->n] = name;
    s->vals[s->n++] = v;
}

void bind_uninit(rctx *r, scope *s, const char *const *names, int n) {
    for (int i = 0; i < n; i++) scope_set(r, s, names[i], undef_lazy(r, U_NAME, names[i], v_none(), 0));
}

scope *scope_open(rctx *r, scope *parent, const char *const *uninit, int nuninit) {
    scope *s = scope_new(r, parent);
    bind_uninit(r, s, uninit, nuninit);
    return s;
}

list *list_new(rctx *r, size_t n) {
    list *l = arena_zalloc(&r->a, sizeof *l);
    l->n = n;
    l->v = n ? arena_zalloc(&r->a, n * sizeof *l->v) : NULL;
    return l;
}

val v_tuple2(rctx *r, val a, val b) {
    list *l = list_new(r, 2);
    l->v[0] = a;
    l->v[1] = b;
    return v_list(l, LK_TUPLE);
}

dict *dict_new(rctx *r, size_t cap) {
    dict *d = arena_zalloc(&r->a, sizeof *d);
    d->cap = cap;
    if (cap) {
        d->k = arena_alloc(&r->a, cap * sizeof *d->k);
        d->v = arena_alloc(&r->a, cap * sizeof *d->v);
    }
    return d;
}

val v_iter(rctx *r, list *l) {
    iterobj *it = arena_zalloc(&r->a, sizeof *it);
    it->l = l;
    return (val){.t = T_ITER, .u.it = it};
}

const char *type_name(val v) {
    switch (v.t) {
    case T_UNDEF: return "Undefined";
    case T_NONE: return "NoneType";
    case T_BOOL: return "bool";
    case T_INT: return "int";
    case T_FLOAT: return "float";
    case T_STR: return v.k ? "Markup" : "str";
    case T_LIST:
        switch (v.k) {
        case LK_TUPLE: return "tuple";
        case LK_RANGE: return "range";
        case LK_KEYS: return "dict_keys";
        case LK_VALUES: return "dict_values";
        case LK_ITEMS: return "dict_items";
        default: return "list";
        }
    case T_DICT: return "dict";
    case T_NS: return "Namespace";
    case T_MACRO: return "Macro";
    case T_FUNC: return "function";
    case T_METHOD: return "builtin_function_or_method";
    case T_LOOP: return "LoopContext";
    case T_ITER: return "generator";
    case T_CYCLER: return "Cycler";
    case T_JOINER: return "Joiner";
    default: return "object";
    }
}

/* jinja2's object_type_repr, for messages about undefined attributes */
const char *obj_desc(rctx *r, val v) {
    if (v.t == T_NONE) return "None";
    char tmp[64];
    snprintf(tmp, sizeof tmp, "%s object", type_name(v));
    return arena_strndup(&r->a, tmp, strlen(tmp));
}

const char *rsprintf(rctx *r, const char *fmt, ...) {
    char tmp[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    return arena_strndup(&r->a, tmp, strlen(tmp));
}

_Noreturn void undef_fail(rctx *r, val v) {
    if (v.k == UK_LAZY) {
        const struct undef_info *u = v.u.ud;
        if (u->kind == U_NAME) rfail(r, "'%s' is undefined", u->name);
        if (u->kind == U_ATTR) rfail(r, "'%s' has no attribute '%s'", obj_desc(r, u->obj), u->name);
        rfail(r, "'%s' has no element %" PRId64, obj_desc(r, u->obj), u->index);
    }
    rfail(r, "%s", v.u.msg ? v.u.msg : "undefined value");
}

val undef_lazy(rctx *r, int kind, const char *name, val obj, int64_t index) {
    struct undef_info *u = arena_alloc(&r->a, sizeof *u);
    u->kind = kind;
    u->name = name;
    u->obj = obj;
    u->index = index;
    return (val){.t = T_UNDEF, .k = UK_LAZY, .u.ud = u};
}

bool truthy(val v) {
    switch (v.t) {
    case T_UNDEF:
    case T_NONE:
    case T_MISSING: return false;
    case T_BOOL: return v.u.b;
    case T_INT: return v.u.i != 0;
    case T_FLOAT: return v.u.f != 0.0;
    case T_STR: return v.u.s.n != 0;
    case T_LIST: return v.u.l->n != 0;
    case T_DICT:
    case T_NS: return v.u.d->n != 0 || v.t == T_NS;
    case T_LOOP: return v.u.lp->n != 0;
    default: return true;
    }
}

/* Python's float.__repr__: the shortest digits that read back exactly, in fixed notation
 * when the decimal exponent is in [-4, 16), else as d.ddde+XX. */
static void fmt_float(double d, char *out, size_t outlen) {
    if (isnan(d)) {
        snprintf(out, outlen, "nan");
        return;
    }
    if (isinf(d)) {
        snprintf(out, outlen, d < 0 ? "-inf" : "inf");
        return;
    }
    if (d == 0) {
        snprintf(out, outlen, signbit(d) ? "-0.0" : "0.0");
        return;
    }
    char tmp[64];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*e", prec - 1, d);
        if (strtod(tmp, NULL) == d) break;
    }
    char digits[32];
    int nd = 0, exp10 = 0;
    bool neg = tmp[0] == '-';
    const char *c = tmp + neg;
    for (; *c && *c != 'e'; c++)
        if (*c >= '0' && *c <= '9') digits[nd++] = *c;
    if (*c == 'e') exp10 = atoi(c + 1);
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    digits[nd] = 0;
    int decpt = exp10 + 1;
    /* at most 26 characters: the callers' 64-byte buffers hold them */
    char *o = out;
    if (neg) *o++ = '-';
    if (decpt > -4 && decpt <= 16) {
        if (decpt <= 0) {
            *o++ = '0';
            *o++ = '.';
            for (int i = 0; i < -decpt; i++) *o++ = '0';
            memcpy(o, digits, (size_t)nd);
            o += nd;
        } else if (decpt >= nd) {
            memcpy(o, digits, (size_t)nd);
            o += nd;
            for (int i = nd; i < decpt; i++) *o++ = '0';
            *o++ = '.';
            *o++ = '0';
        } else {
            memcpy(o, digits, (size_t)decpt);
            o += decpt;
            *o++ = '.';
            memcpy(o, digits + decpt, (size_t)(nd - decpt));
            o += nd - decpt;
        }
        *o = 0;
    } else {
        *o++ = digits[0];
        if (nd > 1) {
            *o++ = '.';
            memcpy(o, digits + 1, (size_t)(nd - 1));
            o += nd - 1;
        }
        snprintf(o, outlen - (size_t)(o - out), "e%c%02d", decpt - 1 < 0 ? '-' : '+', abs(decpt - 1));
    }
}

static void put_pystr_repr(sbuf *b, const char *p, size_t n) {
    bool sq = memchr(p, '\'', n) != NULL, dq = memchr(p, '"', n) != NULL;
    char q = sq && !dq ? '"' : '\'';
    sb_putc(b, q);
    for (size_t i = 0; i < n;) {
        int32_t c;
        size_t k = utf8_dec(p + i, n - i, &c);
        if (c == q || c == '\\') {
            sb_putc(b, '\\');
            sb_putc(b, (char)c);
        } else if (c == '\t') sb_puts(b, "\\t");
        else if (c == '\n') sb_puts(b, "\\n");
        else if (c == '\r') sb_puts(b, "\\r");
        else if (c < 0x20 || c == 0x7F) sb_printf(b, "\\x%02x", (unsigned)c);
        else if (c < 0x7F || is_printable_cp(c)) sb_put(b, p + i, k);
        else if (c <= 0xFF) sb_printf(b, "\\x%02x", (unsigned)c);
        else if (c <= 0xFFFF) sb_printf(b, "\\u%04x", (unsigned)c);
        else sb_printf(b, "\\U%08x", (unsigned)c);
        i += k;
    }
    sb_putc(b, q);
}

/* str(v) appended to b */
void put_str(rctx *r, sbuf *b, val v) {
    char tmp[64];
    switch (v.t) {
    case T_UNDEF:
    case T_MISSING: return;
    case T_NONE: sb_puts(b, "None"); return;
    case T_BOOL: sb_puts(b, v.u.b ? "True" : "False"); return;
    case T_INT: sb_printf(b, "%" PRId64, v.u.i); return;
    case T_FLOAT:
        fmt_float(v.u.f, tmp, sizeof tmp);
        sb_puts(b, tmp);
        return;
    case T_STR: sb_put(b, v.u.s.p, v.u.s.n); return;
    default: put_repr(r, b, v);
    }
}

static void put_items_repr(rctx *r, sbuf *b, const list *l) {
    for (size_t i = 0; i < l->n; i++) {
        if (i) sb_puts(b, ", ");
        put_repr(r, b, l->v[i]);
    }
}

static void put_dict_repr(rctx *r, sbuf *b, const dict *d) {
    sb_putc(b, '{');
    for (size_t i = 0; i < d->n; i++) {
        if (i) sb_puts(b, ", ");
        put_repr(r, b, d->k[i]);
        sb_puts(b, ": ");
        put_repr(r, b, d->v[i]);
    }
    sb_putc(b, '}');
}

/* repr(v) appended to b */
void put_repr(rctx *r, sbuf *b, val v) {
    enter_r(r);
    switch (v.t) {
    case T_UNDEF: sb_puts(b, "Undefined"); break;
    case T_STR:
        if (v.k) sb_puts(b, "Markup(");
        put_pystr_repr(b, v.u.s.p, v.u.s.n);
        if (v.k) sb_putc(b, ')');
        break;
    case T_LIST: {
        const list *l = v.u.l;
        switch (v.k) {
        case LK_TUPLE:
            sb_putc(b, '(');
            put_items_repr(r, b, l);
            if (l->n == 1) sb_putc(b, ',');
            sb_putc(b, ')');
            break;
        case LK_RANGE:
            if (l->step == 1) sb_printf(b, "range(%" PRId64 ", %" PRId64 ")", l->start, l->stop);
            else sb_printf(b, "range(%" PRId64 ", %" PRId64 ", %" PRId64 ")", l->start, l->stop, l->step);
            break;
        case LK_LIST:
            sb_putc(b, '[');
            put_items_repr(r, b, l);
            sb_putc(b, ']');
            break;
        default:
            sb_puts(b, type_name(v));
            sb_puts(b, "([");
            put_items_repr(r, b, l);
            sb_puts(b, "])");
        }
        break;
    }
    case T_DICT: put_dict_repr(r, b, v.u.d); break;
    case T_NS:
        sb_puts(b, "<Namespace ");
        put_dict_repr(r, b, v.u.d);
        sb_putc(b, '>');
        break;
    case T_MACRO:
        if (v.u.m->name) sb_printf(b, "<Macro '%s'>", v.u.m->name);
        else sb_puts(b, "<Macro anonymous>"); /* the caller of a call block */
        break;
    case T_LOOP: sb_printf(b, "<LoopContext %zu/%zu>", v.u.lp->i + 1, v.u.lp->n); break;
    case T_FUNC:
    case T_METHOD:
    case T_ITER:
    case T_CYCLER:
    case T_JOINER:
        rfail(r, "cannot turn a %s into text (Python would print its memory address)", type_name(v));
    default: put_str(r, b, v);
    }
    r->depth--;
}

val str_of(rctx *r, val v) {
    if (v.t == T_STR) return v;
    sbuf b;
    sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    put_str(r, &b, v);
    return sb_val(&b);
}

/* markupsafe.escape */
val html_escape(rctx *r, val v) {
    if (v.t == T_STR && v.k) return v;
    val s = str_of(r, v);
    sbuf b;
    sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    sb_reserve(&b, s.u.s.n);
    for (size_t i = 0; i < s.u.s.n; i++) {
        char c = s.u.s.p[i];
        switch (c) {
        case '&': sb_puts(&b, "&amp;"); break;
        case '<': sb_puts(&b, "&lt;"); break;
        case '>': sb_puts(&b, "&gt;"); break;
        case '\'': sb_puts(&b, "&#39;"); break;
        case '"': sb_puts(&b, "&#34;"); break;
        default: sb_putc(&b, c);
        }
    }
    return v_markup(sb_val(&b));
}

/* --------------------------------------------------------------- equality, order ---- */

bool hashable(val v) {
    if (v.t == T_DICT) return false;
    if (v.t == T_LIST) {
        if (v.k == LK_RANGE) return true;
        if (v.k != LK_TUPLE) return false;
        for (size_t i = 0; i < v.u.l->n; i++)
            if (!hashable(v.u.l->v[i])) return false;
    }
    return true;
}

long dict_find(rctx *r, const dict *d, val key) {
    if (key.t == T_STR) {
        for (size_t i = 0; i < d->n; i++)
            if (d->k[i].t == T_STR && d->k[i].u.s.n == key.u.s.n && !memcmp(d->k[i].u.s.p, key.u.s.p, key.u.s.n))
                return (long)i;
        return -1;
    }
    for (size_t i = 0; i < d->n; i++)
        if (py_eq(r, d->k[i], key)) return (long)i;
    return -1;
}

bool list_contains(rctx *r, const list *l, val x) {
    for (size_t i = 0; i < l->n; i++)
        if (py_eq(r, l->v[i], x)) return true;
    return false;
}

bool py_eq(rctx *r, val a, val b) {
    if (is_num(a) && is_num(b)) {
        if (is_intlike(a) && is_intlike(b)) return as_int(a) == as_int(b);
        return as_float(a) == as_float(b);
    }
    if (a.t != b.t) return false;
    switch (a.t) {
    case T_UNDEF:
    case T_NONE: return true;
    case T_STR: return a.u.s.n == b.u.s.n && !memcmp(a.u.s.p, b.u.s.p, a.u.s.n);
    case T_LIST: {
        const list *x = a.u.l, *y = b.u.l;
        if (a.k != b.k) return false;
        if (a.k == LK_VALUES) return x == y;
        if (x->n != y->n) return false;
        enter_r(r);
        bool eq = true;
        if (a.k == LK_KEYS || a.k == LK_ITEMS) {
            for (size_t i = 0; i < x->n && eq; i++) eq = list_contains(r, y, x->v[i]);
        } else {
            for (size_t i = 0; i < x->n && eq; i++) eq = py_eq(r, x->v[i], y->v[i]);
        }
        r->depth--;
        return eq;
    }
    case T_DICT: {
        const dict *x = a.u.d, *y = b.u.d;
        if (x->n != y->n) return false;
        enter_r(r);
        bool eq = true;
        for (size_t i = 0; i < x->n && eq; i++) {
            long j = dict_find(r, y, x->k[i]);
            eq = j >= 0 && py_eq(r, x->v[i], y->v[j]);
        }
        r->depth--;
        return eq;
    }
    default: return a.u.l == b.u.l; /* identity of the pointer in the union */
    }
}

static const char *cmp_text(int op) { return op_text[op]; }

/* Python's a < b (etc.); op is OP_LT, OP_LTEQ, OP_GT or OP_GTEQ */
bool py_order(rctx *r, val a, val b, int op) {
    if (a.t == T_UNDEF) undef_fail(r, a);
    if (b.t == T_UNDEF) undef_fail(r, b);
    int c;
    if (is_num(a) && is_num(b)) {
        if (is_intlike(a) && is_intlike(b)) {
            int64_t x = as_int(a), y = as_int(b);
            c = x < y ? -1 : x > y;
        } else {
            double x = as_float(a), y = as_float(b);
            if (isnan(x) || isnan(y)) return false;
            c = x < y ? -1 : x > y;
        }
    } else if (a.t == T_STR && b.t == T_STR) {
        size_t n = a.u.s.n < b.u.s.n ? a.u.s.n : b.u.s.n;
        c = memcmp(a.u.s.p, b.u.s.p, n);
        if (c == 0) c = a.u.s.n < b.u.s.n ? -1 : a.u.s.n > b.u.s.n;
    } else if (a.t == T_LIST && b.t == T_LIST && a.k == b.k && (a.k == LK_LIST || a.k == LK_TUPLE)) {
        const list *x = a.u.l, *y = b.u.l;
        size_t i = 0;
        while (i < x->n && i < y->n && py_eq(r, x->v[i], y->v[i])) i++;
        if (i < x->n && i < y->n) return py_order(r, x->v[i], y->v[i], op);
        c = x->n < y->n ? -1 : x->n > y->n;
    } else {
        rfail(r, "'%s' not supported between instances of '%s' and '%s'", cmp_text(op), type_name(a), type_name(b));
    }
    switch (op) {
    case OP_LT: return c < 0;
    case OP_LTEQ: return c <= 0;
    case OP_GT: return c > 0;
    default: return c >= 0;
    }
}

/* ------------------------------------------------------------------------ json.dumps ---- */

static void json_put_str(sbuf *b, const char *p, size_t n, bool ascii) {
    sb_putc(b, '"');
    for (size_t i = 0; i < n;) {
        int32_t c;
        size_t k = utf8_dec(p + i, n - i, &c);
        switch (c) {
        case '"': sb_puts(b, "\\\""); break;
        case '\\': sb_puts(b, "\\\\"); break;
        case '\n': sb_puts(b, "\\n"); break;
        case '\r': sb_puts(b, "\\r"); break;
        case '\t': sb_puts(b, "\\t"); break;
        case '\b': sb_puts(b, "\\b"); break;
        case '\f': sb_puts(b, "\\f"); break;
        default:
            if (c < 0x20 || (ascii && c >= 0x7F)) {
                if (c > 0xFFFF) {
                    int32_t v = c - 0x10000;
                    sb_printf(b, "\\u%04x\\u%04x", (unsigned)(0xD800 | (v >> 10)), (unsigned)(0xDC00 | (v & 0x3FF)));
                } else {
                    sb_printf(b, "\\u%04x", (unsigned)c);
                }
            } else {
                sb_put(b, p + i, k);
            }
        }
        i += k;
    }
    sb_putc(b, '"');
}

static void json_newline(sbuf *b, const json_opts *o, int level) {
    sb_putc(b, '\n');
    if (o->indent.t == T_STR) {
        for (int i = 0; i < level; i++) sb_put(b, o->indent.u.s.p, o->indent.u.s.n);
    } else {
        int64_t w = as_int(o->indent);
        for (int64_t i = 0; i < w * level; i++) sb_putc(b, ' ');
    }
}

/* json.dumps turns keys that are not strings into strings */
static val json_key(rctx *r, val k) {
    char tmp[64];
    switch (k.t) {
    case T_STR: return k;
    case T_BOOL: return v_cstr(k.u.b ? "true" : "false");
    case T_NONE: return v_cstr("null");
    case T_INT: return str_of(r, k);
    case T_FLOAT:
        if (isnan(k.u.f)) return v_cstr("NaN");
        if (isinf(k.u.f)) return v_cstr(k.u.f < 0 ? "-Infinity" : "Infinity");
        fmt_float(k.u.f, tmp, sizeof tmp);
        return mk_str(r, tmp, strlen(tmp));
    default: rfail(r, "keys must be str, int, float, bool or None, not %s", type_name(k));
    }
}

void json_put(rctx *r, sbuf *b, val v, const json_opts *o, int level) {
    char tmp[64];
    enter_r(r);
    switch (v.t) {
    case T_NONE: sb_puts(b, "null"); break;
    case T_BOOL: sb_puts(b, v.u.b ? "true" : "false"); break;
    case T_INT: sb_printf(b, "%" PRId64, v.u.i); break;
    case T_FLOAT:
        if (isnan(v.u.f)) sb_puts(b, "NaN");
        else if (isinf(v.u.f)) sb_puts(b, v.u.f < 0 ? "-Infinity" : "Infinity");
        else {
            fmt_float(v.u.f, tmp, sizeof tmp);
            sb_puts(b, tmp);
        }
        break;
    case T_STR: json_put_str(b, v.u.s.p, v.u.s.n, o->ensure_ascii); break;
    case T_LIST:
        if (v.k != LK_LIST && v.k != LK_TUPLE) rfail(r, "Object of type %s is not JSON serializable", type_name(v));
        if (v.u.l->n == 0) {
            sb_puts(b, "[]");
            break;
        }
        sb_putc(b, '[');
        for (size_t i = 0; i < v.u.l->n; i++) {
            if (i) sb_put(b, o->item_sep, o->item_sep_n);
            if (o->indent_set) json_newline(b, o, level + 1);
            json_put(r, b, v.u.l->v[i], o, level + 1);
        }
        if (o->indent_set) json_newline(b, o, level);
        sb_putc(b, ']');
        break;
    case T_DICT: {
        const dict *d = v.u.d;
        if (d->n == 0) {
            sb_puts(b, "{}");
            break;
        }
        size_t *order = arena_alloc(&r->a, d->n * sizeof *order);
        for (size_t i = 0; i < d->n; i++) order[i] = i;
        if (o->sort_keys) /* insertion sort: stable, and dicts are small */
            for (size_t i = 1; i < d->n; i++)
                for (size_t j = i; j > 0 && py_less(r, d->k[order[j]], d->k[order[j - 1]]); j--) {
                    size_t t = order[j];
                    order[j] = order[j - 1];
                    order[j - 1] = t;
                }
        sb_putc(b, '{');
        for (size_t i = 0; i < d->n; i++) {
            if (i) sb_put(b, o->item_sep, o->item_sep_n);
            if (o->indent_set) json_newline(b, o, level + 1);
            val k = json_key(r, d->k[order[i]]);
            json_put_str(b, k.u.s.p, k.u.s.n, o->ensure_ascii);
            sb_put(b, o->key_sep, o->key_sep_n);
            json_put(r, b, d->v[order[i]], o, level + 1);
        }
        if (o->indent_set) json_newline(b, o, level);
        sb_putc(b, '}');
        break;
    }
    default: rfail(r, "Object of type %s is not JSON serializable", type_name(v));
    }
    r->depth--;
}

/* ----------------------------------------------------------------- conversions ---- */

val from_json(rctx *r, const json_t *j, int depth) {
    if (depth > CHAT_TEMPLATE_MAX_DEPTH) rfail(r, "input nested deeper than %d levels", CHAT_TEMPLATE_MAX_DEPTH);
    switch (json_typeof(j)) {
    case JSON_NULL: return v_none();
    case JSON_TRUE: return v_bool(true);
    case JSON_FALSE: return v_bool(false);
    case JSON_INTEGER: return v_int((int64_t)json_integer_value(j));
    case JSON_REAL: return v_float(json_real_value(j));
    case JSON_STRING: return v_str(json_string_value(j), json_string_length(j));
    case JSON_ARRAY: {
        list *l = list_new(r, json_array_size(j));
        for (size_t i = 0; i < l->n; i++) l->v[i] = from_json(r, json_array_get(j, i), depth + 1);
        return v_list(l, LK_LIST);
    }
    case JSON_OBJECT: {
        dict *d = dict_new(r, json_object_size(j));
        const char *key;
        json_t *value;
        json_object_foreach((json_t *)j, key, value) {
            d->k[d->n] = v_str(key, strlen(key));
            d->v[d->n++] = from_json(r, value, depth + 1);
        }
        return v_dict(d);
    }
    }
    return v_none();
}

/* The items of an iterable (an iterator is consumed). */
const val *iterate(rctx *r, val v, size_t *n) {
    switch (v.t) {
    case T_LIST:
        *n = v.u.l->n;
        return v.u.l->v;
    case T_DICT:
        *n = v.u.d->n;
        return v.u.d->k;
    case T_UNDEF:
        *n = 0;
        return NULL;
    case T_ITER: {
        iterobj *it = v.u.it;
        *n = it->l->n - it->pos;
        const val *items = it->l->v ? it->l->v + it->pos : NULL; /* an empty list may have no array */
        it->pos = it->l->n;
        if (it->err) throw_status(&r->ec, CS_EINVAL, "%s", it->err);
        return items;
    }
    case T_STR: {
        size_t count = cs_utf8_count(v.u.s.p, v.u.s.n), off = 0;
        val *items = arena_alloc(&r->a, (count ? count : 1) * sizeof *items);
        for (size_t i = 0; i < count; i++) {
            int32_t c;
            size_t k = utf8_dec(v.u.s.p + off, v.u.s.n - off, &c);
            items[i] = v_str(v.u.s.p + off, k); /* iterating a Markup gives plain strings */
            off += k;
        }
        *n = count;
        return items;
    }
    default: rfail(r, "'%s' object is not iterable", type_name(v));
    }
}

list *to_list(rctx *r, val v) {
    size_t n;
    const val *items = iterate(r, v, &n);
    list *l = list_new(r, n);
    if (n) memcpy(l->v, items, n * sizeof *items);
    return l;
}

int64_t py_len(rctx *r, val v) {
    switch (v.t) {
    case T_STR: return (int64_t)cs_utf8_count(v.u.s.p, v.u.s.n);
    case T_LIST: return (int64_t)v.u.l->n;
    case T_DICT: return (int64_t)v.u.d->n;
    case T_UNDEF: return 0;
    case T_LOOP: return (int64_t)v.u.lp->n;
    default: rfail(r, "object of type '%s' has no len()", type_name(v));
    }
}

bool py_in(rctx *r, val item, val seq) {
    switch (seq.t) {
    case T_STR: {
        if (item.t != T_STR) rfail(r, "'in <string>' requires string as left operand, not %s", type_name(item));
        if (item.u.s.n == 0) return true;
        for (size_t i = 0; i + item.u.s.n <= seq.u.s.n; i++)
            if (!memcmp(seq.u.s.p + i, item.u.s.p, item.u.s.n)) return true;
        return false;
    }
    case T_LIST: return list_contains(r, seq.u.l, item);
    case T_DICT:
        if (!hashable(item)) rfail(r, "unhashable type: '%s'", type_name(item));
        return dict_find(r, seq.u.d, item) >= 0;
    case T_UNDEF: return false;
    case T_ITER: {
        iterobj *it = seq.u.it;
        while (it->pos < it->l->n)
            if (py_eq(r, it->l->v[it->pos++], item)) return true;
        if (it->err) throw_status(&r->ec, CS_EINVAL, "%s", it->err);
        return false;
    }
    default: rfail(r, "argument of type '%s' is not iterable", type_name(seq));
    }
}
