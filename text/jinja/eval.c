/* eval.c: global functions (range, namespace, dict, raise_exception, strftime_now, cycler,
 * joiner), macro calls, and the evaluation of expressions and execution of statements. */
#include "text/jinja/jinja_impl.h"

#include <sys/time.h>
#include <time.h>

#define MAX_RANGE 100000 /* jinja2's sandbox refuses longer range() results */

static val strftime_now(rctx *r, val fmt) {
    if (fmt.t != T_STR) rfail(r, "strftime_now() argument must be str, not %s", type_name(fmt));
    struct timeval tv;
    gettimeofday(&tv, NULL);
    struct tm tm;
    time_t sec = tv.tv_sec;
    localtime_r(&sec, &tm);
    /* Python handles %f itself; %z and %Z are empty for a naive datetime */
    sbuf f;
    sb_init(&f, &r->a, 1 << 20, false);
    for (size_t i = 0; i < fmt.u.s.n; i++) {
        char c = fmt.u.s.p[i];
        if (c == '%' && i + 1 < fmt.u.s.n) {
            char d = fmt.u.s.p[++i];
            if (d == 'f') sb_printf(&f, "%06ld", (long)tv.tv_usec);
            else if (d == 'z' || d == 'Z') continue;
            else {
                sb_putc(&f, '%');
                sb_putc(&f, d);
            }
            continue;
        }
        sb_putc(&f, c);
    }
    if (!f.n) return v_str("", 0);
    for (size_t cap = 256; cap <= (1 << 20); cap *= 4) {
        char *out = arena_alloc(&r->a, cap);
        size_t n = strftime(out, cap, f.p, &tm);
        if (n) return v_str(out, n);
    }
    return v_str("", 0);
}

static val call_func(rctx *r, int fn, const args *a) {
    val p[3];
    switch (fn) {
    case FN_RANGE: {
        if (a->nkw) rfail(r, "range() takes no keyword arguments");
        if (a->npos < 1 || a->npos > 3) rfail(r, "range expected 1 to 3 arguments, got %d", a->npos);
        int64_t x[3] = {0, 0, 1};
        for (int i = 0; i < a->npos; i++) {
            if (a->pos[i].t == T_UNDEF) undef_fail(r, a->pos[i]);
            x[i] = int_arg(r, a->pos[i], "range()");
        }
        int64_t start = a->npos == 1 ? 0 : x[0], stop = a->npos == 1 ? x[0] : x[1], step = a->npos == 3 ? x[2] : 1;
        if (step == 0) rfail(r, "range() arg 3 must not be zero");
        /* unsigned differences: the span of two int64 values fits in a uint64 */
        uint64_t n = 0;
        if (step > 0 && stop > start) n = ((uint64_t)stop - (uint64_t)start - 1) / (uint64_t)step + 1;
        if (step < 0 && start > stop) n = ((uint64_t)start - (uint64_t)stop - 1) / (0 - (uint64_t)step) + 1;
        if (n > MAX_RANGE)
            rfail(r, "Range too big. The sandbox blocks ranges larger than MAX_RANGE (%d).", MAX_RANGE);
        list *l = list_new(r, (size_t)n);
        for (uint64_t i = 0; i < n; i++) l->v[i] = v_int((int64_t)((uint64_t)start + i * (uint64_t)step));
        l->start = start;
        l->stop = stop;
        l->step = step;
        return v_list(l, LK_RANGE);
    }
    case FN_NAMESPACE: {
        dict *d = dict_from_args(r, a, "namespace");
        for (size_t i = 0; i < d->n; i++)
            if (d->k[i].t == T_STR && d->k[i].u.s.n && d->k[i].u.s.p[0] == '_')
                rfail(r, "Chat templates cannot store underscore-prefixed attributes on a namespace, but got '%.*s'. "
                      "Please rename the attribute.", (int)d->k[i].u.s.n, d->k[i].u.s.p);
        return (val){.t = T_NS, .u.d = d};
    }
    case FN_DICT: return v_dict(dict_from_args(r, a, "dict"));
    case FN_RAISE: {
        static const char *const names[] = {"message"};
        bind_args(r, "raise_exception()", a, names, 1, p);
        val msg = str_of(r, required(r, p[0], "raise_exception()", "message"));
        throw_status(&r->ec, CS_EINVAL, "%.*s", (int)(msg.u.s.n < 1000 ? msg.u.s.n : 1000), msg.u.s.p);
    }
    case FN_STRFTIME: {
        static const char *const names[] = {"format"};
        bind_args(r, "strftime_now()", a, names, 1, p);
        return strftime_now(r, required(r, p[0], "strftime_now()", "format"));
    }
    case FN_CYCLER: {
        if (a->nkw) rfail(r, "cycler() takes no keyword arguments");
        if (!a->npos) rfail(r, "at least one item has to be provided");
        struct cycler *c = arena_zalloc(&r->a, sizeof *c);
        val *items = arena_alloc(&r->a, (size_t)a->npos * sizeof *items);
        memcpy(items, a->pos, (size_t)a->npos * sizeof *items);
        c->items = items;
        c->n = (size_t)a->npos;
        return (val){.t = T_CYCLER, .u.cy = c};
    }
    case FN_JOINER: {
        static const char *const names[] = {"sep"};
        bind_args(r, "joiner()", a, names, 1, p);
        struct joiner *j = arena_zalloc(&r->a, sizeof *j);
        j->sep = opt(p[0], v_cstr(", "));
        return (val){.t = T_JOINER, .u.jn = j};
    }
    }
    rfail(r, "unknown function");
}

static val eval(rctx *r, const node *n, scope *s);

static val capture(rctx *r, node *const *body, int n, scope *s) {
    sbuf b;
    sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
    sbuf *saved = r->out;
    r->out = &b;
    exec_body(r, body, n, s);
    r->out = saved;
    return sb_val(&b);
}

static val call_macro(rctx *r, const macro *m, const args *a) {
    const node *d = m->def;
    const char *mname = m->name ? m->name : "caller";
    int np = d->nkw, line = r->line;
    enter_r(r);
    scope *s = scope_open(r, m->closure, d->uninit, d->nuninit);
    val *bound_args = arena_alloc(&r->a, (size_t)(np + 1) * sizeof *bound_args);
    for (int i = 0; i < np; i++) bound_args[i] = i < a->npos ? a->pos[i] : v_missing();
    int extra = a->npos > np ? a->npos - np : 0;
    if (extra && !(d->flags & MF_VARARGS))
        rfail(r, "macro '%s' takes not more than %d argument(s)", mname, np);
    dict *kwargs = NULL;
    val caller = v_missing();
    for (int k = 0; k < a->nkw; k++) {
        int i = 0;
        while (i < np && strcmp(d->kw[i], a->kwn[k])) i++;
        if (i < np) {
            if (bound_args[i].t != T_MISSING) rfail(r, "macro '%s' got multiple values for argument '%s'", mname, a->kwn[k]);
            bound_args[i] = a->kwv[k];
        } else if (!strcmp(a->kwn[k], "caller") && (d->flags & MF_CALLER)) {
            caller = a->kwv[k];
        } else if (d->flags & MF_KWARGS) {
            if (!kwargs) kwargs = dict_new(r, 4);
            dict_set(r, kwargs, v_cstr(a->kwn[k]), a->kwv[k]);
        } else {
            rfail(r, "macro '%s' takes no keyword argument '%s'", mname, a->kwn[k]);
        }
    }
    /* a missing parameter takes its default, evaluated inside the macro once the parameters
     * before it are bound (as jinja2 does), or is undefined */
    for (int i = 0; i < np; i++) {
        val v = bound_args[i];
        if (v.t == T_MISSING)
            v = d->w[i] ? eval(r, d->w[i], s) : v_undef(rsprintf(r, "parameter '%s' was not provided", d->kw[i]));
        scope_set(r, s, d->kw[i], v);
    }
    if (d->flags & MF_VARARGS) {
        list *l = list_new(r, (size_t)extra);
        for (int i = 0; i < extra; i++) l->v[i] = a->pos[np + i];
        scope_set(r, s, "varargs", v_list(l, LK_TUPLE));
    }
    if (d->flags & MF_KWARGS) scope_set(r, s, "kwargs", v_dict(kwargs ? kwargs : dict_new(r, 0)));
    if (d->flags & MF_CALLER) scope_set(r, s, "caller", caller.t == T_MISSING ? v_undef("No caller defined") : caller);
    val out = capture(r, d->v, d->nv, s);
    r->depth--;
    r->line = line;
    return out;
}

static val call_value(rctx *r, val f, const val *pos, int npos, const char **kwn, const val *kwv, int nkw) {
    args a = {pos, npos, kwn, kwv, nkw};
    switch (f.t) {
    case T_FUNC: return call_func(r, f.u.fn, &a);
    case T_MACRO: return call_macro(r, f.u.m, &a);
    case T_METHOD: return call_method(r, f.u.bm, &a);
    case T_JOINER:
        if (npos || nkw) rfail(r, "joiner takes no arguments");
        if (!f.u.jn->used) {
            f.u.jn->used = true;
            return v_str("", 0);
        }
        return f.u.jn->sep;
    case T_UNDEF: undef_fail(r, f);
    default: rfail(r, "'%s' object is not callable", type_name(f));
    }
}

/* ----------------------------------------------------------------- eval, exec ---- */

static void eval_args(rctx *r, const node *n, scope *s, args *a) {
    val *pos = n->nv ? arena_alloc(&r->a, (size_t)n->nv * sizeof *pos) : NULL;
    val *kwv = n->nw ? arena_alloc(&r->a, (size_t)n->nw * sizeof *kwv) : NULL;
    for (int i = 0; i < n->nv; i++) pos[i] = eval(r, n->v[i], s);
    for (int i = 0; i < n->nw; i++) kwv[i] = eval(r, n->w[i], s);
    a->pos = pos;
    a->npos = n->nv;
    a->kwn = n->kw;
    a->kwv = kwv;
    a->nkw = n->nkw;
}

/* A filter node applied to base (n->a is NULL in the filter chain of a block). */
static val eval_filter(rctx *r, const node *n, scope *s, val base) {
    val v = n->a ? (n->a->kind == E_FILTER ? eval_filter(r, n->a, s, base) : eval(r, n->a, s)) : base;
    args a;
    eval_args(r, n, s, &a);
    r->line = n->line;
    return do_filter(r, n->id, n->name, v, &a);
}

static val lookup_name(rctx *r, scope *s, const char *name) {
    val *p = scope_find(s, name);
    if (p) return *p;
    int fn = lookup_func(name);
    if (fn >= 0) return (val){.t = T_FUNC, .u.fn = fn};
    return undef_lazy(r, U_NAME, name, v_none(), 0);
}

static bool compare(rctx *r, int op, val a, val b) {
    switch (op) {
    case OP_EQ: return py_eq(r, a, b);
    case OP_NE: return !py_eq(r, a, b);
    case OP_IN: return py_in(r, a, b);
    case OP_NOTIN: return !py_in(r, a, b);
    default: return py_order(r, a, b, op);
    }
}

static val eval(rctx *r, const node *n, scope *s) {
    val out;
    r->line = n->line;
    enter_r(r);
    switch (n->kind) {
    case E_CONST: out = n->c; break;
    case E_NAME: out = lookup_name(r, s, n->name); break;
    case E_LIST:
    case E_TUPLE: {
        list *l = list_new(r, (size_t)n->nv);
        for (int i = 0; i < n->nv; i++) l->v[i] = eval(r, n->v[i], s);
        out = v_list(l, n->kind == E_LIST ? LK_LIST : LK_TUPLE);
        break;
    }
    case E_DICT: {
        dict *d = dict_new(r, (size_t)n->nv);
        for (int i = 0; i < n->nv; i++) {
            val k = eval(r, n->v[i], s);
            if (!hashable(k)) rfail(r, "unhashable type: '%s'", type_name(k));
            dict_set(r, d, k, eval(r, n->w[i], s));
        }
        out = v_dict(d);
        break;
    }
    case E_GETATTR: {
        val obj = eval(r, n->a, s);
        r->line = n->line;
        out = get_attr(r, obj, n->name, n->id);
        break;
    }
    case E_GETITEM: {
        val obj = eval(r, n->a, s), key = eval(r, n->b, s);
        r->line = n->line;
        out = get_item(r, obj, key);
        break;
    }
    case E_SLICE: {
        val obj = eval(r, n->a, s);
        val start = n->b ? eval(r, n->b, s) : v_none(), stop = n->x ? eval(r, n->x, s) : v_none();
        val step = n->y ? eval(r, n->y, s) : v_none();
        r->line = n->line;
        out = get_slice(r, obj, start, stop, step);
        break;
    }
    case E_CALL: {
        val f = eval(r, n->a, s);
        args a;
        eval_args(r, n, s, &a);
        r->line = n->line;
        out = call_value(r, f, a.pos, a.npos, a.kwn, a.kwv, a.nkw);
        break;
    }
    case E_FILTER: out = eval_filter(r, n, s, v_undef("no value")); break;
    case E_TEST: {
        val v = eval(r, n->a, s);
        args a;
        eval_args(r, n, s, &a);
        r->line = n->line;
        out = v_bool(do_test(r, n->id, n->name, v, &a));
        break;
    }
    case E_NOT: out = v_bool(!truthy(eval(r, n->a, s))); break;
    case E_NEG:
    case E_POS: {
        val v = eval(r, n->a, s);
        r->line = n->line;
        if (v.t == T_UNDEF) undef_fail(r, v);
        if (v.t == T_FLOAT) out = v_float(n->kind == E_NEG ? -v.u.f : v.u.f);
        else if (is_intlike(v)) {
            if (n->kind == E_NEG && as_int(v) == INT64_MIN) overflow(r);
            out = v_int(n->kind == E_NEG ? -as_int(v) : as_int(v));
        } else {
            rfail(r, "bad operand type for unary %c: '%s'", n->kind == E_NEG ? '-' : '+', type_name(v));
        }
        break;
    }
    case E_BIN: {
        val a = eval(r, n->a, s), b = eval(r, n->b, s);
        r->line = n->line;
        out = arith(r, n->op, a, b);
        break;
    }
    case E_AND:
        out = eval(r, n->a, s);
        if (truthy(out)) out = eval(r, n->b, s);
        break;
    case E_OR:
        out = eval(r, n->a, s);
        if (!truthy(out)) out = eval(r, n->b, s);
        break;
    case E_CONCAT: {
        sbuf b;
        sb_init(&b, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, false);
        for (int i = 0; i < n->nv; i++) put_str(r, &b, eval(r, n->v[i], s));
        out = sb_val(&b);
        break;
    }
    case E_CMP: {
        val left = eval(r, n->a, s);
        out = v_bool(true);
        for (int i = 0; i < n->nv; i++) {
            val right = eval(r, n->v[i], s);
            r->line = n->line;
            if (!compare(r, n->ops[i], left, right)) {
                out = v_bool(false);
                break;
            }
            left = right;
        }
        break;
    }
    case E_COND:
        if (truthy(eval(r, n->a, s))) out = eval(r, n->b, s);
        else if (n->x) out = eval(r, n->x, s);
        else out = v_undef(rsprintf(r, "the inline if-expression on line %d evaluated to false and no else section was defined.", n->line));
        break;
    default: rfail(r, "cannot evaluate this expression");
    }
    r->depth--;
    return out;
}

static void assign(rctx *r, const node *target, val v, scope *s) {
    switch (target->kind) {
    case E_NAME: scope_set(r, s, target->name, v); return;
    case E_TUPLE: {
        size_t n;
        const val *items = iterate(r, v, &n);
        if (n > (size_t)target->nv) rfail(r, "too many values to unpack (expected %d)", target->nv);
        if (n < (size_t)target->nv) rfail(r, "not enough values to unpack (expected %d, got %zu)", target->nv, n);
        for (int i = 0; i < target->nv; i++) assign(r, target->v[i], items[i], s);
        return;
    }
    case E_NSREF: {
        val ns = lookup_name(r, s, target->name2);
        if (ns.t != T_NS) rfail(r, "cannot assign attribute on non-namespace object");
        if (target->name[0] == '_')
            rfail(r, "Chat templates cannot store underscore-prefixed attributes on a namespace, but got '%s'. "
                  "Please rename the attribute.", target->name);
        dict_set(r, ns.u.d, v_cstr(target->name), v);
        return;
    }
    default: rfail(r, "cannot assign to this expression");
    }
}

static void emit(rctx *r, val v) { put_str(r, r->out, v); }

static int exec_for(rctx *r, const node *n, scope *s) {
    val seq = eval(r, n->b, s);
    r->line = n->line;
    size_t count;
    const val *items = iterate(r, seq, &count);
    scope *it = scope_new(r, s);
    if (n->x) { /* for x in xs if cond: filter first, so that loop.length counts what remains */
        val *kept = arena_alloc(&r->a, (count ? count : 1) * sizeof *kept);
        size_t k = 0;
        for (size_t i = 0; i < count; i++) {
            it->n = 0;
            assign(r, n->a, items[i], it);
            if (truthy(eval(r, n->x, it))) kept[k++] = items[i];
        }
        items = kept;
        count = k;
    }
    if (count == 0) return n->nw ? exec_body(r, n->w, n->nw, scope_open(r, s, n->uninit2, n->nuninit2)) : FLOW_NORMAL;
    struct loopctx *lp = arena_zalloc(&r->a, sizeof *lp);
    lp->items = items;
    lp->n = count;
    for (size_t i = 0; i < count; i++) {
        if (++r->iterations > CHAT_TEMPLATE_MAX_ITERATIONS)
            throw_limit(&r->ec, "line %d: template ran more than %ld loop iterations", r->line,
                        CHAT_TEMPLATE_MAX_ITERATIONS);
        lp->i = i;
        it->n = 0; /* a fresh scope for every iteration */
        bind_uninit(r, it, n->uninit, n->nuninit);
        scope_set(r, it, "loop", (val){.t = T_LOOP, .u.lp = lp});
        assign(r, n->a, items[i], it);
        int flow = exec_body(r, n->v, n->nv, it);
        if (flow == FLOW_BREAK) break;
    }
    return FLOW_NORMAL;
}

static int exec_stmt(rctx *r, const node *n, scope *s) {
    r->line = n->line;
    switch (n->kind) {
    case S_OUTPUT:
        for (int i = 0; i < n->nv; i++) {
            const node *x = n->v[i];
            if (x->kind == E_CONST && x->c.t == T_STR) sb_put(r->out, x->c.u.s.p, x->c.u.s.n);
            else emit(r, eval(r, x, s));
        }
        return FLOW_NORMAL;
    case S_IF:
        if (truthy(eval(r, n->a, s))) return exec_body(r, n->v, n->nv, s);
        return exec_body(r, n->w, n->nw, s);
    case S_FOR: return exec_for(r, n, s);
    case S_SET: assign(r, n->a, eval(r, n->b, s), s); return FLOW_NORMAL;
    case S_SETBLOCK: {
        val v = capture(r, n->v, n->nv, scope_open(r, s, n->uninit, n->nuninit));
        if (n->b) v = eval_filter(r, n->b, s, v);
        assign(r, n->a, v, s);
        return FLOW_NORMAL;
    }
    case S_MACRO: {
        macro *m = arena_zalloc(&r->a, sizeof *m);
        m->def = n;
        m->closure = s;
        m->name = n->name;
        scope_set(r, s, n->name, (val){.t = T_MACRO, .u.m = m});
        return FLOW_NORMAL;
    }
    case S_CALLBLOCK: {
        macro *m = arena_zalloc(&r->a, sizeof *m);
        m->def = n;
        m->closure = s;
        m->name = NULL;
        const node *call = n->a;
        val f = eval(r, call->a, s);
        args a;
        eval_args(r, call, s, &a);
        const char **kwn = arena_grow(&r->a, a.kwn, (size_t)a.nkw, (size_t)(a.nkw + 1), sizeof *kwn);
        val *kwv = arena_grow(&r->a, a.kwv, (size_t)a.nkw, (size_t)(a.nkw + 1), sizeof *kwv);
        kwn[a.nkw] = "caller";
        kwv[a.nkw] = (val){.t = T_MACRO, .u.m = m};
        r->line = n->line;
        emit(r, call_value(r, f, a.pos, a.npos, kwn, kwv, a.nkw + 1));
        return FLOW_NORMAL;
    }
    case S_FILTERBLOCK:
        emit(r, eval_filter(r, n->b, s, capture(r, n->v, n->nv, scope_open(r, s, n->uninit, n->nuninit))));
        return FLOW_NORMAL;
    case S_WITH: {
        scope *w = scope_open(r, s, n->uninit, n->nuninit);
        for (int i = 0; i < n->nkw; i++) scope_set(r, w, n->kw[i], eval(r, n->w[i], s));
        return exec_body(r, n->v, n->nv, w);
    }
    case S_SCOPE: return exec_body(r, n->v, n->nv, scope_open(r, s, n->uninit, n->nuninit));
    case S_BREAK: return FLOW_BREAK;
    case S_CONTINUE: return FLOW_CONTINUE;
    }
    rfail(r, "cannot execute this statement");
}

int exec_body(rctx *r, node *const *body, int n, scope *s) {
    enter_r(r);
    for (int i = 0; i < n; i++) {
        int flow = exec_stmt(r, body[i], s);
        if (flow != FLOW_NORMAL) {
            r->depth--;
            return flow;
        }
    }
    r->depth--;
    return FLOW_NORMAL;
}
