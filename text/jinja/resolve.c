/* resolve.c: jinja2's compile-time name resolution, reproduced so that a name is undefined
 * exactly where jinja2's generated code would find it undefined. */
#include "text/jinja/jinja_impl.h"


/* --------------------------------------------------------- jinja2's name resolution ---- */

/* jinja2 decides at compile time where each name lives (jinja2/idtracking.py). Looking names
 * up through the chain of scopes at run time agrees with it except in one case: a name whose
 * first mention in a scope is an unconditional assignment starts that scope as undefined,
 * even when an enclosing scope or the context has it. So in
 *     {% for m in messages %}{{ x }}{% endfor %}{% set x = 1 %}
 * the loop prints nothing although x was passed in. This pass replays jinja2's analysis and
 * records those names on the node that opens each scope; the evaluator binds them to
 * undefined when it enters the scope. */

enum { LOAD_PARAM, LOAD_RESOLVE, LOAD_ALIAS, LOAD_UNDEF };

typedef struct symref {
    const char *name;
    int load;
} symref;

typedef struct symtab {
    struct symtab *parent;
    symref *refs;
    int nrefs, caprefs;
    const char **stores;
    int nstores, capstores;
} symtab;

static int sym_index(const symtab *st, const char *name) {
    for (int i = 0; i < st->nrefs; i++)
        if (!strcmp(st->refs[i].name, name)) return i;
    return -1;
}

static bool sym_find(const symtab *st, const char *name) {
    for (; st; st = st->parent)
        if (sym_index(st, name) >= 0) return true;
    return false;
}

static bool sym_stored(const symtab *st, const char *name) {
    for (int i = 0; i < st->nstores; i++)
        if (!strcmp(st->stores[i], name)) return true;
    return false;
}

static void sym_define(parser *p, symtab *st, const char *name, int load) {
    int i = sym_index(st, name);
    if (i >= 0) {
        st->refs[i].load = load;
        return;
    }
    if (st->nrefs == st->caprefs) {
        int cap = st->caprefs ? st->caprefs * 2 : 8;
        st->refs = arena_grow(p->a, st->refs, (size_t)st->nrefs, (size_t)cap, sizeof *st->refs);
        st->caprefs = cap;
    }
    st->refs[st->nrefs++] = (symref){name, load};
}

static void sym_add_store(parser *p, symtab *st, const char *name) {
    if (sym_stored(st, name)) return;
    if (st->nstores == st->capstores) {
        int cap = st->capstores ? st->capstores * 2 : 8;
        st->stores = arena_grow(p->a, st->stores, (size_t)st->nstores, (size_t)cap, sizeof *st->stores);
        st->capstores = cap;
    }
    st->stores[st->nstores++] = name;
}

static void sym_load(parser *p, symtab *st, const char *name) {
    if (!sym_find(st, name)) sym_define(p, st, name, LOAD_RESOLVE);
}

static void sym_store(parser *p, symtab *st, const char *name) {
    sym_add_store(p, st, name);
    if (sym_index(st, name) >= 0) return;
    sym_define(p, st, name, st->parent && sym_find(st->parent, name) ? LOAD_ALIAS : LOAD_UNDEF);
}

static void sym_param(parser *p, symtab *st, const char *name) {
    sym_add_store(p, st, name);
    sym_define(p, st, name, LOAD_PARAM);
}

static symtab *sym_copy(parser *p, const symtab *st) {
    symtab *c = arena_zalloc(p->a, sizeof *c);
    c->parent = st->parent;
    for (int i = 0; i < st->nrefs; i++) sym_define(p, c, st->refs[i].name, st->refs[i].load);
    for (int i = 0; i < st->nstores; i++) sym_add_store(p, c, st->stores[i]);
    return c;
}

static void sym_stmts(parser *p, symtab *st, node *const *body, int n);

static void sym_expr(parser *p, symtab *st, const node *n) {
    if (!n) return;
    if (n->kind == E_NAME) sym_load(p, st, n->name);
    if (n->kind == E_NSREF) sym_load(p, st, n->name2);
    sym_expr(p, st, n->a);
    sym_expr(p, st, n->b);
    sym_expr(p, st, n->x);
    sym_expr(p, st, n->y);
    for (int i = 0; i < n->nv; i++) sym_expr(p, st, n->v[i]);
    for (int i = 0; i < n->nw; i++) sym_expr(p, st, n->w[i]);
}

static void sym_target(parser *p, symtab *st, const node *t, bool param) {
    if (t->kind == E_NAME) {
        if (param) sym_param(p, st, t->name);
        else sym_store(p, st, t->name);
    } else if (t->kind == E_NSREF) {
        sym_load(p, st, t->name2);
    } else {
        for (int i = 0; i < t->nv; i++) sym_target(p, st, t->v[i], param);
    }
}

/* Symbols.branch_update: merges the branches of an If into st. A name assigned in a branch
 * (and not before in this scope) is read from outside until an assignment runs. */
static void sym_branch_update(parser *p, symtab *st, symtab *const *br, int nbr) {
    int cap = 0;
    for (int k = 0; k < nbr; k++) cap += br[k]->nstores;
    const char **names = cap ? arena_alloc(p->a, (size_t)cap * sizeof *names) : NULL;
    int nnames = 0;
    for (int k = 0; k < nbr; k++)
        for (int i = 0; i < br[k]->nstores; i++)
            if (!sym_stored(st, br[k]->stores[i])) names[nnames++] = br[k]->stores[i];
    for (int k = 0; k < nbr; k++) {
        for (int i = 0; i < br[k]->nrefs; i++) sym_define(p, st, br[k]->refs[i].name, br[k]->refs[i].load);
        for (int i = 0; i < br[k]->nstores; i++) sym_add_store(p, st, br[k]->stores[i]);
    }
    for (int j = 0; j < nnames; j++)
        sym_define(p, st, names[j], st->parent && sym_find(st->parent, names[j]) ? LOAD_ALIAS : LOAD_RESOLVE);
}

static bool is_elif(const node *n) { return n->nw == 1 && n->w[0]->kind == S_IF && (n->w[0]->flags & IF_ELIF); }

/* FrameSymbolVisitor.visit_If: the test, then the body, the elifs (each an If of its own with
 * a test and a body, all visited in one copy) and the else, each in a copy of the symbols */
static void sym_if(parser *p, symtab *st, const node *n, bool single) {
    sym_expr(p, st, n->a);
    symtab *br[3];
    br[0] = sym_copy(p, st);
    sym_stmts(p, br[0], n->v, n->nv);
    br[1] = sym_copy(p, st);
    br[2] = sym_copy(p, st);
    if (!single) {
        const node *last = n;
        while (is_elif(last)) {
            last = last->w[0];
            sym_if(p, br[1], last, true);
        }
        sym_stmts(p, br[2], last->w, last->nw);
    }
    sym_branch_update(p, st, br, 3);
}

/* jinja2's FrameSymbolVisitor: what a statement does to the names of its own scope */
static void sym_stmts(parser *p, symtab *st, node *const *body, int n) {
    for (int i = 0; i < n; i++) {
        const node *s = body[i];
        switch (s->kind) {
        case S_OUTPUT:
            for (int k = 0; k < s->nv; k++) sym_expr(p, st, s->v[k]);
            break;
        case S_SET:
            sym_expr(p, st, s->b);
            sym_target(p, st, s->a, false);
            break;
        case S_SETBLOCK: sym_target(p, st, s->a, false); break;
        case S_IF: sym_if(p, st, s, false); break;
        case S_FOR: sym_expr(p, st, s->b); break;
        case S_MACRO: sym_store(p, st, s->name); break;
        case S_CALLBLOCK: sym_expr(p, st, s->a); break;
        case S_FILTERBLOCK: sym_expr(p, st, s->b); break;
        case S_WITH:
            for (int k = 0; k < s->nw; k++) sym_expr(p, st, s->w[k]);
            break;
        default: break;
        }
    }
}

static void analyze_children(parser *p, symtab *st, node *const *body, int n);

/* Analyzes the scope a node opens (its parameters, then its body) and those inside it. */
static void analyze_frame(parser *p, symtab *parent, node *owner, node *const *body, int n, bool else_block) {
    symtab *st = arena_zalloc(p->a, sizeof *st);
    st->parent = parent;
    if (owner && owner->kind == S_FOR && !else_block) {
        sym_target(p, st, owner->a, true);
        sym_param(p, st, "loop");
    }
    if (owner && (owner->kind == S_MACRO || owner->kind == S_CALLBLOCK)) {
        for (int i = 0; i < owner->nkw; i++) sym_param(p, st, owner->kw[i]);
        if (owner->flags & MF_CALLER) sym_param(p, st, "caller");
        if (owner->flags & MF_VARARGS) sym_param(p, st, "varargs");
        if (owner->flags & MF_KWARGS) sym_param(p, st, "kwargs");
        for (int i = 0; i < owner->nw; i++) sym_expr(p, st, owner->w[i]);
    }
    if (owner && owner->kind == S_WITH)
        for (int i = 0; i < owner->nkw; i++) sym_param(p, st, owner->kw[i]);
    sym_stmts(p, st, body, n);
    int count = 0;
    for (int i = 0; i < st->nrefs; i++) count += st->refs[i].load == LOAD_UNDEF;
    const char **names = count ? arena_alloc(p->a, (size_t)count * sizeof *names) : NULL;
    count = 0;
    for (int i = 0; i < st->nrefs; i++)
        if (st->refs[i].load == LOAD_UNDEF) names[count++] = st->refs[i].name;
    if (else_block) {
        owner->uninit2 = names;
        owner->nuninit2 = count;
    } else {
        owner->uninit = names;
        owner->nuninit = count;
    }
    analyze_children(p, st, body, n);
}

static void analyze_children(parser *p, symtab *st, node *const *body, int n) {
    for (int i = 0; i < n; i++) {
        node *s = body[i];
        switch (s->kind) {
        case S_IF:
            analyze_children(p, st, s->v, s->nv);
            analyze_children(p, st, s->w, s->nw);
            break;
        case S_FOR:
            analyze_frame(p, st, s, s->v, s->nv, false);
            if (s->nw) analyze_frame(p, st, s, s->w, s->nw, true);
            break;
        case S_MACRO:
        case S_CALLBLOCK:
        case S_SETBLOCK:
        case S_FILTERBLOCK:
        case S_WITH:
        case S_SCOPE: analyze_frame(p, st, s, s->v, s->nv, false); break;
        default: break;
        }
    }
}

/* A call of a plain name must be a global function, a macro of the template, a joiner
 * kept in a variable, or caller() inside a macro. */
static void check_calls(parser *p) {
    for (int i = 0; i < p->calls.n; i++) {
        const node *c = p->calls.v[i];
        const char *name = c->a->name;
        if (lookup_func(name) >= 0 || !strcmp(name, "caller")) continue;
        bool ok = false;
        for (int j = 0; j < p->defs.n && !ok; j++) {
            const node *d = p->defs.v[j];
            ok = d->kind == S_MACRO ? !strcmp(d->name, name) : !strcmp(d->a->name, name);
        }
        if (ok) continue;
        if (!strcmp(name, "loop")) pfail(p, c->line, "recursive loop calls are not supported");
        if (!strcmp(name, "lipsum")) pfail(p, c->line, "function 'lipsum' is not supported");
        pfail(p, c->line, "unknown function '%s'", name);
    }
}

/* Checks the template's calls, then resolves its names (root: the S_SCOPE of its statements). */
void resolve_names(parser *p, node *root) {
    check_calls(p);
    analyze_frame(p, NULL, root, root->v, root->nv, false);
}
