/* ops.c: attribute and item access under the sandbox's rules, slices, and arithmetic with
 * Python's int/float semantics, including printf-style "fmt % args". */
#include "text/jinja/jinja_impl.h"

#include <math.h>
#include <stdio.h>

/* ------------------------------------------------------------ attributes, items ---- */

static bool method_of_str(int m) { return m >= M_STRIP && m <= M_ISDECIMAL; }

static bool method_of_dict(int m) { return m >= M_ITEMS && m <= M_CLEAR; }

static bool method_of_list(int m) {
    return m == M_POP || m == M_CLEAR || m == M_INDEX || m == M_COUNT || m == M_COPY || (m >= M_APPEND && m <= M_SORT);
}

static bool method_mutates(int m) {
    return m == M_POP || m == M_POPITEM || m == M_SETDEFAULT || m == M_UPDATE || m == M_CLEAR ||
           (m >= M_APPEND && m <= M_SORT);
}

val bound(rctx *r, val self, int mid) {
    struct bound *b = arena_alloc(&r->a, sizeof *b);
    b->self = self;
    b->mid = mid;
    return (val){.t = T_METHOD, .u.bm = b};
}

static val unsafe_attr(rctx *r, val obj, const char *name) {
    val u = v_undef(rsprintf(r, "access to attribute '%s' of '%s' object is unsafe.", name, type_name(obj)));
    u.k = UK_UNSAFE;
    return u;
}

static val loop_attr(struct loopctx *lp, int aid, bool *found) {
    *found = true;
    int64_t i = (int64_t)lp->i, n = (int64_t)lp->n;
    switch (aid) {
    case M_INDEX: /* "index" is also list.index() */
    case A_INDEX: return v_int(i + 1);
    case A_INDEX0: return v_int(i);
    case A_REVINDEX: return v_int(n - i);
    case A_REVINDEX0: return v_int(n - i - 1);
    case A_FIRST: return v_bool(i == 0);
    case A_LAST: return v_bool(i == n - 1);
    case A_LENGTH: return v_int(n);
    case A_DEPTH: return v_int(1);
    case A_DEPTH0: return v_int(0);
    case A_PREVITEM: return i > 0 ? lp->items[i - 1] : v_undef("there is no previous item");
    case A_NEXTITEM: return i + 1 < n ? lp->items[i + 1] : v_undef("there is no next item");
    }
    *found = false;
    return v_missing();
}

/* The Python attribute name of obj (a method, a namespace attribute, a loop property), as
 * the sandbox sees it; aid is lookup_attr(name); *found is false when there is none. */
val attr_only(rctx *r, val obj, const char *name, int aid, bool *found) {
    *found = true;
    int mid = aid < M_COUNT_ ? aid : -1;
    switch (obj.t) {
    case T_STR:
        if (mid >= 0 && method_of_str(mid)) return bound(r, obj, mid);
        break;
    case T_DICT:
        if (mid >= 0 && method_of_dict(mid)) return method_mutates(mid) ? unsafe_attr(r, obj, name) : bound(r, obj, mid);
        break;
    case T_LIST:
        if (obj.k == LK_LIST && mid >= 0 && method_of_list(mid))
            return method_mutates(mid) ? unsafe_attr(r, obj, name) : bound(r, obj, mid);
        if ((obj.k == LK_TUPLE || obj.k == LK_RANGE) && (mid == M_INDEX || mid == M_COUNT)) return bound(r, obj, mid);
        if (obj.k == LK_RANGE) {
            if (aid == A_START) return v_int(obj.u.l->start);
            if (aid == A_STOP) return v_int(obj.u.l->stop);
            if (aid == A_STEP) return v_int(obj.u.l->step);
        }
        break;
    case T_NS: {
        long i = dict_find(r, obj.u.d, v_cstr(name));
        if (i >= 0) return obj.u.d->v[i];
        break;
    }
    case T_LOOP: {
        if (mid == M_CYCLE || mid == M_CHANGED) return bound(r, obj, mid);
        val v = loop_attr(obj.u.lp, aid, found);
        if (*found) return v;
        *found = true;
        break;
    }
    case T_CYCLER:
        if (mid == M_NEXT || mid == M_RESET) return bound(r, obj, mid);
        if (aid == A_CURRENT) return obj.u.cy->items[obj.u.cy->pos];
        break;
    default: break;
    }
    if (name[0] == '_' && name[1] == '_' && obj.t != T_NS) return unsafe_attr(r, obj, name); /* Python internals */
    *found = false;
    return v_missing();
}

/* obj.name: the attribute first, then obj["name"] (jinja2's sandboxed getattr) */
val get_attr(rctx *r, val obj, const char *name, int aid) {
    if (obj.t == T_UNDEF) undef_fail(r, obj);
    bool found;
    val v = attr_only(r, obj, name, aid, &found);
    if (found) return v;
    if (obj.t == T_DICT) {
        long i = dict_find(r, obj.u.d, v_cstr(name));
        if (i >= 0) return obj.u.d->v[i];
    }
    return no_attr(r, obj, name);
}

static bool index_of(val key, int64_t n, int64_t *idx) {
    if (!is_intlike(key)) return false;
    int64_t i = as_int(key);
    if (i < 0) i += n;
    if (i < 0 || i >= n) return false;
    *idx = i;
    return true;
}

/* obj[key]: the item first, then the attribute named key (jinja2's sandboxed getitem) */
val get_item(rctx *r, val obj, val key) {
    int64_t i;
    switch (obj.t) {
    case T_UNDEF: undef_fail(r, obj);
    case T_DICT:
        if (hashable(key)) {
            long j = dict_find(r, obj.u.d, key);
            if (j >= 0) return obj.u.d->v[j];
        }
        break;
    case T_LIST:
        if (obj.k <= LK_RANGE && index_of(key, (int64_t)obj.u.l->n, &i)) return obj.u.l->v[i];
        if (obj.k <= LK_RANGE && is_intlike(key))
            return undef_lazy(r, U_ELEM, NULL, obj, as_int(key));
        break;
    case T_STR:
        if (index_of(key, (int64_t)cs_utf8_count(obj.u.s.p, obj.u.s.n), &i)) {
            size_t off = utf8_off(obj.u.s.p, obj.u.s.n, (size_t)i);
            int32_t c;
            val ch = v_str(obj.u.s.p + off, utf8_dec(obj.u.s.p + off, obj.u.s.n - off, &c));
            ch.k = obj.k;
            return ch;
        }
        break;
    default: break;
    }
    if (key.t == T_STR) {
        bool found;
        const char *name = arena_strndup(&r->a, key.u.s.p, key.u.s.n);
        val v = attr_only(r, obj, name, lookup_attr(name), &found);
        if (found) return v;
        return no_attr(r, obj, name);
    }
    sbuf b;
    sb_init(&b, &r->a, 1 << 20, false);
    put_repr(r, &b, key);
    return v_undef(rsprintf(r, "'%s' has no element %s", obj_desc(r, obj), b.p ? b.p : ""));
}

/* Python's slice.indices(): fills start/stop/step and returns the number of items */
static int64_t slice_indices(rctx *r, val vstart, val vstop, val vstep, int64_t len, int64_t *start, int64_t *stop,
                             int64_t *step) {
    *step = vstep.t == T_NONE || vstep.t == T_MISSING ? 1 : as_int(vstep);
    if (*step == 0) rfail(r, "slice step cannot be zero");
    int64_t lower = *step < 0 ? -1 : 0, upper = *step < 0 ? len - 1 : len;
    int64_t bounds[2];
    val given[2] = {vstart, vstop};
    for (int k = 0; k < 2; k++) {
        if (given[k].t == T_NONE || given[k].t == T_MISSING) {
            bounds[k] = (k == 0) == (*step < 0) ? upper : lower;
            continue;
        }
        int64_t x = as_int(given[k]);
        if (x < 0) {
            x += len;
            if (x < lower) x = lower;
        } else if (x > upper) {
            x = upper;
        }
        bounds[k] = x;
    }
    *start = bounds[0];
    *stop = bounds[1];
    if (*step > 0) return *stop > *start ? (*stop - *start - 1) / *step + 1 : 0;
    return *start > *stop ? (*start - *stop - 1) / (-*step) + 1 : 0;
}

/* obj[start:stop:step]: jinja2 compiles slices to plain Python subscripts (the sandbox's
 * getitem is bypassed), so slicing anything but a sequence is an error, not undefined */
val get_slice(rctx *r, val obj, val vstart, val vstop, val vstep) {
    if (obj.t == T_UNDEF) undef_fail(r, obj);
    if (obj.t != T_STR && !(obj.t == T_LIST && obj.k <= LK_RANGE))
        rfail(r, "'%s' object is not subscriptable", type_name(obj));
    val parts[3] = {vstart, vstop, vstep};
    for (int k = 0; k < 3; k++)
        if (parts[k].t != T_NONE && parts[k].t != T_MISSING && !is_intlike(parts[k]))
            rfail(r, "slice indices must be integers or None");
    int64_t start, stop, step, count;
    if (obj.t == T_STR) {
        const char *p = obj.u.s.p;
        size_t n = obj.u.s.n, cps = cs_utf8_count(p, n);
        count = slice_indices(r, vstart, vstop, vstep, (int64_t)cps, &start, &stop, &step);
        sbuf b;
        sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
        if (step == 1) {
            size_t a = utf8_off(p, n, (size_t)start), e = utf8_off(p, n, (size_t)(start + count));
            sb_put(&b, p + a, e - a);
        } else {
            size_t *offs = arena_alloc(&r->a, (cps + 1) * sizeof *offs), off = 0;
            for (size_t i = 0; i <= cps; i++) {
                offs[i] = off;
                if (i < cps) {
                    int32_t c;
                    off += utf8_dec(p + off, n - off, &c);
                }
            }
            for (int64_t i = 0, j = start; i < count; i++, j += step)
                sb_put(&b, p + offs[j], offs[j + 1] - offs[j]);
        }
        val out = sb_val(&b);
        out.k = obj.k;
        return out;
    }
    if (obj.t == T_LIST && obj.k <= LK_RANGE) {
        const list *l = obj.u.l;
        count = slice_indices(r, vstart, vstop, vstep, (int64_t)l->n, &start, &stop, &step);
        list *out = list_new(r, (size_t)count);
        for (int64_t i = 0, j = start; i < count; i++, j += step) out->v[i] = l->v[j];
        if (obj.k == LK_RANGE) {
            out->start = l->start + start * l->step;
            out->stop = l->start + stop * l->step;
            out->step = l->step * step;
        }
        return v_list(out, obj.k);
    }
    rfail(r, "'%s' object is not subscriptable", type_name(obj));
}

/* ---------------------------------------------------------------------- arithmetic ---- */

val num_op(rctx *r, int op, val a, val b) {
    if (is_intlike(a) && is_intlike(b)) {
        int64_t x = as_int(a), y = as_int(b), z;
        switch (op) {
        case OP_ADD:
            if (__builtin_add_overflow(x, y, &z)) overflow(r);
            return v_int(z);
        case OP_SUB:
            if (__builtin_sub_overflow(x, y, &z)) overflow(r);
            return v_int(z);
        case OP_MUL:
            if (__builtin_mul_overflow(x, y, &z)) overflow(r);
            return v_int(z);
        case OP_DIV:
            if (y == 0) rfail(r, "division by zero");
            return v_float((double)x / (double)y);
        case OP_FDIV:
        case OP_MOD:
            if (y == 0) rfail(r, "integer division or modulo by zero");
            if (x == INT64_MIN && y == -1) {
                if (op == OP_MOD) return v_int(0);
                overflow(r);
            }
            if (op == OP_FDIV) {
                z = x / y;
                if (x % y != 0 && ((x < 0) != (y < 0))) z--;
            } else {
                z = x % y;
                if (z != 0 && ((z < 0) != (y < 0))) z += y;
            }
            return v_int(z);
        case OP_POW: {
            if (y < 0) {
                if (x == 0) rfail(r, "0.0 cannot be raised to a negative power");
                return v_float(pow((double)x, (double)y));
            }
            int64_t result = 1, base = x;
            while (y > 0) {
                if (y & 1)
                    if (__builtin_mul_overflow(result, base, &result)) overflow(r);
                y >>= 1;
                if (y && __builtin_mul_overflow(base, base, &base)) overflow(r);
            }
            return v_int(result);
        }
        }
    }
    double x = as_float(a), y = as_float(b);
    switch (op) {
    case OP_ADD: return v_float(x + y);
    case OP_SUB: return v_float(x - y);
    case OP_MUL: return v_float(x * y);
    case OP_DIV:
        if (y == 0) rfail(r, "float division by zero");
        return v_float(x / y);
    case OP_FDIV:
    case OP_MOD: {
        if (y == 0) rfail(r, op == OP_MOD ? "float modulo" : "float floor division by zero");
        /* CPython's float divmod */
        double mod = fmod(x, y), div = (x - mod) / y, fdiv;
        if (mod) {
            if ((y < 0) != (mod < 0)) {
                mod += y;
                div -= 1.0;
            }
        } else {
            mod = copysign(0.0, y);
        }
        if (div) {
            fdiv = floor(div);
            if (div - fdiv > 0.5) fdiv += 1.0;
        } else {
            fdiv = copysign(0.0, x / y);
        }
        return v_float(op == OP_MOD ? mod : fdiv);
    }
    case OP_POW:
        if (x == 0 && y < 0) rfail(r, "0.0 cannot be raised to a negative power");
        if (x < 0 && y != floor(y)) rfail(r, "a negative number to a fractional power is complex");
        {
            double z = pow(x, y);
            if (isinf(z) && isfinite(x) && isfinite(y)) rfail(r, "numerical result out of range");
            return v_float(z);
        }
    }
    rfail(r, "bad operator");
}

static val repeat(rctx *r, val seq, int64_t times) {
    if (times < 0) times = 0;
    /* an empty sequence stays empty: no loop of TIMES turns ('' * 2**62 spun for ever; found
     * by fuzz_chat_template as a slow unit) */
    if (seq.t == T_STR ? seq.u.s.n == 0 : seq.u.l->n == 0) times = 0;
    if (seq.t == T_STR) {
        if (seq.u.s.n && (uint64_t)times > CHAT_TEMPLATE_MAX_OUTPUT / seq.u.s.n)
            rfail(r, "string repetition result is too long");
        sbuf b;
        sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
        for (int64_t i = 0; i < times; i++) sb_put(&b, seq.u.s.p, seq.u.s.n);
        val v = sb_val(&b);
        v.k = seq.k;
        return v;
    }
    const list *l = seq.u.l;
    if (l->n && (uint64_t)times > (CHAT_TEMPLATE_MAX_MEMORY / sizeof(val)) / l->n) rfail(r, "list repetition result is too long");
    list *out = list_new(r, l->n * (size_t)times);
    for (int64_t i = 0; i < times; i++)
        if (l->n) memcpy(out->v + (size_t)i * l->n, l->v, l->n * sizeof *l->v);
    return v_list(out, seq.k);
}

val arith(rctx *r, int op, val a, val b) {
    if (a.t == T_UNDEF) undef_fail(r, a);
    if (b.t == T_UNDEF) undef_fail(r, b);
    if (is_num(a) && is_num(b)) return num_op(r, op, a, b);
    switch (op) {
    case OP_ADD:
        if (a.t == T_STR && b.t == T_STR) {
            bool markup = a.k || b.k;
            if (markup) {
                a = html_escape(r, a); /* a Markup stays as it is */
                b = html_escape(r, b);
            }
            sbuf s;
            sb_init(&s, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
            sb_reserve(&s, a.u.s.n + b.u.s.n);
            sb_put(&s, a.u.s.p, a.u.s.n);
            sb_put(&s, b.u.s.p, b.u.s.n);
            val v = sb_val(&s);
            v.k = markup;
            return v;
        }
        if (a.t == T_LIST && b.t == T_LIST && a.k == b.k && (a.k == LK_LIST || a.k == LK_TUPLE)) {
            list *l = list_new(r, a.u.l->n + b.u.l->n);
            if (a.u.l->n) memcpy(l->v, a.u.l->v, a.u.l->n * sizeof(val));
            if (b.u.l->n) memcpy(l->v + a.u.l->n, b.u.l->v, b.u.l->n * sizeof(val));
            return v_list(l, a.k);
        }
        break;
    case OP_MUL: {
        val seq = a, times = b;
        if (is_intlike(a)) {
            seq = b;
            times = a;
        }
        if (is_intlike(times) && (seq.t == T_STR || (seq.t == T_LIST && (seq.k == LK_LIST || seq.k == LK_TUPLE))))
            return repeat(r, seq, as_int(times));
        break;
    }
    case OP_MOD:
        if (a.t == T_STR) return percent_format(r, a, b);
        break;
    default: break;
    }
    rfail(r, "unsupported operand type(s) for %s: '%s' and '%s'", op_text[op], type_name(a), type_name(b));
}

/* Pads text to width code points the way str.ljust/rjust/center do. */
void put_padded(sbuf *b, val s, int64_t width, char align, const char *fill, size_t filln) {
    int64_t len = (int64_t)cs_utf8_count(s.u.s.p, s.u.s.n), pad = width > len ? width - len : 0, left = 0;
    if (align == '>') left = pad;
    else if (align == '^') left = pad / 2 + (pad & width & 1); /* CPython's str.center */
    for (int64_t i = 0; i < left; i++) sb_put(b, fill, filln);
    sb_put(b, s.u.s.p, s.u.s.n);
    for (int64_t i = left; i < pad; i++) sb_put(b, fill, filln);
}

/* One conversion of printf-style formatting: %[(key)][flags][width][.precision]conv */
typedef struct pct_spec {
    char flags[8];
    int width, prec; /* -1: not given */
    char conv;
} pct_spec;

/* Parses the flags, width, precision and conversion after a '%' (and its key); returns the end. */
static const char *pct_parse(rctx *r, const char *p, const char *end, pct_spec *sp) {
    int nf = 0;
    while (p < end && strchr("-+ #0", *p) && nf < 7) sp->flags[nf++] = *p++;
    sp->flags[nf] = 0;
    sp->width = sp->prec = -1;
    if (p < end && *p == '*') rfail(r, "'*' widths in format strings are not supported");
    if (p < end && *p >= '0' && *p <= '9') {
        sp->width = 0;
        while (p < end && *p >= '0' && *p <= '9') {
            sp->width = sp->width * 10 + (*p++ - '0');
            if (sp->width > (int)CHAT_TEMPLATE_MAX_OUTPUT) rfail(r, "format width is too large");
        }
    }
    if (p < end && *p == '.') {
        p++;
        sp->prec = 0;
        while (p < end && *p >= '0' && *p <= '9') {
            sp->prec = sp->prec * 10 + (*p++ - '0');
            if (sp->prec > (int)CHAT_TEMPLATE_MAX_OUTPUT) rfail(r, "format precision is too large");
        }
    }
    while (p < end && (*p == 'h' || *p == 'l' || *p == 'L')) p++;
    if (p >= end) rfail(r, "incomplete format");
    sp->conv = *p++;
    return p;
}

/* The C format of sp for C's conversion conv with length modifier len, precision prec. */
static void pct_c_format(const pct_spec *sp, const char *len, char conv, int prec, char *out, size_t n) {
    int k = snprintf(out, n, "%%%s", sp->flags);
    if (sp->width >= 0) k += snprintf(out + k, n - (size_t)k, "%d", sp->width);
    if (prec >= 0) k += snprintf(out + k, n - (size_t)k, ".%d", prec);
    snprintf(out + k, n - (size_t)k, "%s%c", len, conv);
}

/* %s %r %a: str() (escaped in a Markup format) or repr(), cut to the precision, padded */
static void pct_put_str(rctx *r, sbuf *b, const pct_spec *sp, val arg, bool markup) {
    sbuf t;
    sb_init(&t, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    if (sp->conv == 's') put_str(r, &t, markup ? html_escape(r, arg) : arg);
    else put_repr(r, &t, arg);
    val s = sb_val(&t);
    if (sp->prec >= 0) s.u.s.n = utf8_off(s.u.s.p, s.u.s.n, (size_t)sp->prec);
    put_padded(b, s, sp->width, strchr(sp->flags, '-') ? '<' : '>', " ", 1);
}

/* %d %i %u %x %X %o %c */
static void pct_put_int(rctx *r, sbuf *b, const pct_spec *sp, val arg) {
    char conv = sp->conv, spec[48];
    int64_t x;
    if (is_intlike(arg)) x = as_int(arg);
    else if (arg.t == T_FLOAT && conv != 'c' && conv != 'x' && conv != 'X' && conv != 'o') {
        if (!isfinite(arg.u.f) || fabs(arg.u.f) >= 9.2e18) rfail(r, "cannot convert float to integer");
        x = (int64_t)arg.u.f;
    } else {
        rfail(r, "%%%c format: a number is required, not %s", conv, type_name(arg));
    }
    if (conv == 'c') {
        sb_putcp(b, (int32_t)x);
        return;
    }
    char c = conv == 'i' || conv == 'u' ? 'd' : conv;
    pct_c_format(sp, "ll", c, sp->prec, spec, sizeof spec);
    if (c == 'd') {
        sb_printf(b, spec, (long long)x);
        return;
    }
    bool neg = x < 0;
    unsigned long long ux = neg ? (unsigned long long)(-(x + 1)) + 1 : (unsigned long long)x;
    if (neg) sb_putc(b, '-'); /* Python prints -0x.., C would print two's complement */
    sb_printf(b, spec, ux);
}

/* %f %F %e %E %g %G */
static void pct_put_float(rctx *r, sbuf *b, const pct_spec *sp, val arg) {
    if (!is_num(arg)) rfail(r, "must be real number, not %s", type_name(arg));
    char spec[48];
    pct_c_format(sp, "", sp->conv, sp->prec < 0 ? 6 : sp->prec, spec, sizeof spec);
    sb_printf(b, spec, as_float(arg));
}

/* Python's printf-style "fmt % args" for the common conversions (s r d i f e g x o c %). */
val percent_format(rctx *r, val fmt, val fargs) {
    const val *items = &fargs;
    size_t n = 1, used = 0;
    const dict *map = NULL;
    if (fargs.t == T_LIST && fargs.k == LK_TUPLE) {
        items = fargs.u.l->v;
        n = fargs.u.l->n;
    } else if (fargs.t == T_DICT) {
        map = fargs.u.d;
    }
    sbuf b;
    sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    const char *p = fmt.u.s.p, *end = p + fmt.u.s.n;
    while (p < end) {
        if (*p != '%') {
            const char *q = memchr(p, '%', (size_t)(end - p));
            if (!q) q = end;
            sb_put(&b, p, (size_t)(q - p));
            p = q;
            continue;
        }
        p++;
        if (p >= end) rfail(r, "incomplete format");
        val arg = v_missing();
        if (*p == '(') {
            const char *q = memchr(p, ')', (size_t)(end - p));
            if (!q) rfail(r, "incomplete format key");
            if (!map) rfail(r, "format requires a mapping");
            long i = dict_find(r, map, v_str(p + 1, (size_t)(q - p - 1)));
            if (i < 0) rfail(r, "format key '%.*s' not found", (int)(q - p - 1), p + 1);
            arg = map->v[i];
            p = q + 1;
        }
        pct_spec sp;
        p = pct_parse(r, p, end, &sp);
        if (sp.conv == '%') {
            sb_putc(&b, '%');
            continue;
        }
        if (arg.t == T_MISSING) {
            if (used >= n) rfail(r, "not enough arguments for format string");
            arg = items[used++];
        }
        switch (sp.conv) {
        case 's': case 'r': case 'a': pct_put_str(r, &b, &sp, arg, fmt.k); break;
        case 'd': case 'i': case 'u': case 'x': case 'X': case 'o': case 'c': pct_put_int(r, &b, &sp, arg); break;
        case 'f': case 'F': case 'e': case 'E': case 'g': case 'G': pct_put_float(r, &b, &sp, arg); break;
        default: rfail(r, "unsupported format character '%c'", sp.conv);
        }
    }
    /* a tuple must be used up; a single value too unless it is a mapping (Python treats lists
     * and dicts as mappings here) */
    bool tuple = fargs.t == T_LIST && fargs.k == LK_TUPLE, mapping = !tuple && (fargs.t == T_DICT || fargs.t == T_LIST);
    if ((tuple && used < n) || (!tuple && !mapping && used == 0))
        rfail(r, "not all arguments converted during string formatting");
    val out = sb_val(&b);
    out.k = fmt.k;
    return out;
}
