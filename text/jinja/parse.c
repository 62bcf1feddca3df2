/* parse.c: the recursive-descent parser from tokens to the tree, following the grammar of
 * jinja2/parser.py, and the tables of the filters, tests, functions and methods the
 * interpreter knows (an unknown one fails the parse with its line number). */
#include "text/jinja/jinja_impl.h"

#include <stdarg.h>
#include <stdio.h>

#define MAX_PARSE_DEPTH 200 /* nesting of expressions and blocks in the source */

/* ---------------------------------------------------------- filters, tests, methods ---- */

struct name_id {
    const char *name;
    int id;
};

static const struct name_id filter_names[] = {
    {"abs", F_ABS}, {"attr", F_ATTR}, {"batch", F_BATCH}, {"capitalize", F_CAPITALIZE}, {"center", F_CENTER},
    {"count", F_LENGTH}, {"d", F_DEFAULT}, {"default", F_DEFAULT}, {"dictsort", F_DICTSORT}, {"e", F_ESCAPE},
    {"escape", F_ESCAPE}, {"first", F_FIRST}, {"float", F_FLOAT}, {"forceescape", F_FORCEESCAPE},
    {"format", F_FORMAT}, {"indent", F_INDENT}, {"int", F_INT}, {"items", F_ITEMS},
    {"join", F_JOIN}, {"last", F_LAST}, {"length", F_LENGTH}, {"list", F_LIST}, {"lower", F_LOWER},
    {"map", F_MAP}, {"max", F_MAX}, {"min", F_MIN}, {"reject", F_REJECT}, {"rejectattr", F_REJECTATTR},
    {"replace", F_REPLACE}, {"reverse", F_REVERSE}, {"round", F_ROUND}, {"safe", F_SAFE}, {"select", F_SELECT},
    {"selectattr", F_SELECTATTR}, {"slice", F_SLICE}, {"sort", F_SORT}, {"string", F_STRING}, {"sum", F_SUM},
    {"title", F_TITLE}, {"tojson", F_TOJSON}, {"trim", F_TRIM}, {"truncate", F_TRUNCATE}, {"unique", F_UNIQUE},
    {"upper", F_UPPER}, {"wordcount", F_WORDCOUNT},
};

/* jinja2 filters this interpreter refuses (random, HTML-only, or unused by chat templates) */
static const char *const unsupported_filters[] = {
    "filesizeformat", "groupby", "pprint", "random", "striptags", "urlencode", "urlize", "wordwrap", "xmlattr",
};

static const struct name_id test_names[] = {
    {"odd", X_ODD}, {"even", X_EVEN}, {"divisibleby", X_DIVISIBLEBY}, {"defined", X_DEFINED},
    {"undefined", X_UNDEFINED}, {"filter", X_FILTER}, {"test", X_TEST}, {"none", X_NONE}, {"boolean", X_BOOLEAN},
    {"false", X_FALSE}, {"true", X_TRUE}, {"integer", X_INTEGER}, {"float", X_FLOAT}, {"lower", X_LOWER},
    {"upper", X_UPPER}, {"string", X_STRING}, {"mapping", X_MAPPING}, {"number", X_NUMBER},
    {"sequence", X_SEQUENCE}, {"iterable", X_ITERABLE}, {"callable", X_CALLABLE}, {"sameas", X_SAMEAS},
    {"escaped", X_ESCAPED}, {"in", X_IN}, {"==", X_EQ}, {"eq", X_EQ}, {"equalto", X_EQ}, {"!=", X_NE},
    {"ne", X_NE}, {">", X_GT}, {"gt", X_GT}, {"greaterthan", X_GT}, {"ge", X_GE}, {">=", X_GE}, {"<", X_LT},
    {"lt", X_LT}, {"lessthan", X_LT}, {"<=", X_LE}, {"le", X_LE},
};

static const char *const func_names[] = {
    [FN_RANGE] = "range", [FN_NAMESPACE] = "namespace", [FN_DICT] = "dict", [FN_RAISE] = "raise_exception",
    [FN_STRFTIME] = "strftime_now", [FN_CYCLER] = "cycler", [FN_JOINER] = "joiner",
};

const char *const method_names[A_COUNT_] = {
    [M_STRIP] = "strip", [M_LSTRIP] = "lstrip", [M_RSTRIP] = "rstrip", [M_SPLIT] = "split",
    [M_RSPLIT] = "rsplit", [M_SPLITLINES] = "splitlines", [M_STARTSWITH] = "startswith",
    [M_ENDSWITH] = "endswith", [M_UPPER] = "upper", [M_LOWER] = "lower", [M_TITLE] = "title",
    [M_CAPITALIZE] = "capitalize", [M_REPLACE] = "replace", [M_FIND] = "find", [M_RFIND] = "rfind",
    [M_INDEX] = "index", [M_RINDEX] = "rindex", [M_COUNT] = "count", [M_JOIN] = "join", [M_FORMAT] = "format",
    [M_CENTER] = "center", [M_LJUST] = "ljust", [M_RJUST] = "rjust", [M_ZFILL] = "zfill",
    [M_PARTITION] = "partition", [M_RPARTITION] = "rpartition", [M_REMOVEPREFIX] = "removeprefix",
    [M_REMOVESUFFIX] = "removesuffix", [M_ISDIGIT] = "isdigit", [M_ISALPHA] = "isalpha", [M_ISALNUM] = "isalnum",
    [M_ISSPACE] = "isspace", [M_ISLOWER] = "islower", [M_ISUPPER] = "isupper", [M_ISNUMERIC] = "isnumeric",
    [M_ISDECIMAL] = "isdecimal", [M_ITEMS] = "items", [M_KEYS] = "keys", [M_VALUES] = "values", [M_GET] = "get",
    [M_COPY] = "copy", [M_POP] = "pop", [M_POPITEM] = "popitem", [M_SETDEFAULT] = "setdefault",
    [M_UPDATE] = "update", [M_CLEAR] = "clear", [M_APPEND] = "append", [M_EXTEND] = "extend",
    [M_INSERT] = "insert", [M_REMOVE] = "remove", [M_REVERSE] = "reverse", [M_SORT] = "sort",
    [M_CYCLE] = "cycle", [M_CHANGED] = "changed", [M_NEXT] = "next", [M_RESET] = "reset",
    [A_INDEX] = "index", [A_INDEX0] = "index0", [A_REVINDEX] = "revindex", [A_REVINDEX0] = "revindex0",
    [A_FIRST] = "first", [A_LAST] = "last", [A_LENGTH] = "length", [A_DEPTH] = "depth", [A_DEPTH0] = "depth0",
    [A_PREVITEM] = "previtem", [A_NEXTITEM] = "nextitem", [A_START] = "start", [A_STOP] = "stop",
    [A_STEP] = "step", [A_CURRENT] = "current",
};

#define COUNT_OF(t) (sizeof(t) / sizeof((t)[0]))

/* The id of name in table t of n entries, -1 if none. */
static int lookup_id(const struct name_id *t, size_t n, const char *name) {
    for (size_t i = 0; i < n; i++)
        if (strcmp(t[i].name, name) == 0) return t[i].id;
    return -1;
}

/* The index of name in names (n of them), -1 if none. */
static int lookup_index(const char *const *names, size_t n, const char *name) {
    for (size_t i = 0; i < n; i++)
        if (strcmp(names[i], name) == 0) return (int)i;
    return -1;
}

int lookup_filter(const char *name) { return lookup_id(filter_names, COUNT_OF(filter_names), name); }

/* A jinja2 filter the interpreter knows but refuses. */
bool is_unsupported_filter(const char *name) {
    return lookup_index(unsupported_filters, COUNT_OF(unsupported_filters), name) >= 0;
}

int lookup_test(const char *name) { return lookup_id(test_names, COUNT_OF(test_names), name); }
int lookup_func(const char *name) { return lookup_index(func_names, COUNT_OF(func_names), name); }

/* A method or one of the other attributes the interpreter knows (loop.index, ...); -1 if
 * none. "index" is both list.index() and loop.index: the method id is returned. */
int lookup_attr(const char *name) { return lookup_index(method_names, A_COUNT_, name); }

/* -------------------------------------------------------------------------- parser ---- */

_Noreturn void pfail(parser *p, int line, const char *fmt, ...) {
    char tmp[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    throw_status(p->ec, CS_EINVAL, "line %d: %s", line, tmp);
}

static void nv_push(parser *p, nvec *v, node *x) {
    if (v->n == v->cap) {
        int cap = v->cap ? v->cap * 2 : 8;
        v->v = arena_grow(p->a, v->v, (size_t)v->n, (size_t)cap, sizeof *v->v);
        v->cap = cap;
    }
    v->v[v->n++] = x;
}

/* Appends name to a growable array of names (*n used of *cap); returns the array. */
static const char **push_name(parser *p, const char **names, int *n, int *cap, const char *name) {
    if (*n == *cap) {
        *cap = *cap ? *cap * 2 : 4;
        names = arena_grow(p->a, names, (size_t)*n, (size_t)*cap, sizeof *names);
    }
    names[(*n)++] = name;
    return names;
}

node *new_node(parser *p, int kind, int line) {
    node *n = arena_zalloc(p->a, sizeof *n);
    n->kind = (uint8_t)kind;
    n->line = line;
    return n;
}

static token *cur(parser *p) { return &p->t[p->i]; }

static token *peek(parser *p) { return p->t[p->i].type == TK_EOF ? &p->t[p->i] : &p->t[p->i + 1]; }

static void advance(parser *p) {
    if (p->t[p->i].type != TK_EOF) p->i++;
}

static bool is_name(const token *t, const char *s) { return t->type == TK_NAME && strcmp(t->s, s) == 0; }

static bool is_op(const token *t, int op) { return t->type == TK_OP && t->op == op; }

static const char *describe(const token *t) {
    switch (t->type) {
    case TK_EOF: return "end of template";
    case TK_DATA: return "template data";
    case TK_VAR_BEGIN: return "begin of print statement";
    case TK_VAR_END: return "end of print statement";
    case TK_BLOCK_BEGIN: return "begin of statement block";
    case TK_BLOCK_END: return "end of statement block";
    case TK_NAME: return t->s;
    case TK_STRING: return "string";
    case TK_INT: return "integer";
    case TK_FLOAT: return "float";
    default: return op_text[t->op];
    }
}

static void expect_op(parser *p, int op) {
    if (!is_op(cur(p), op)) pfail(p, cur(p)->line, "expected '%s', got '%s'", op_text[op], describe(cur(p)));
    advance(p);
}

static token *expect_name(parser *p) {
    token *t = cur(p);
    if (t->type != TK_NAME) pfail(p, t->line, "expected a name, got '%s'", describe(t));
    advance(p);
    return t;
}

static void expect_kw(parser *p, const char *kw) {
    if (!is_name(cur(p), kw)) pfail(p, cur(p)->line, "expected '%s', got '%s'", kw, describe(cur(p)));
    advance(p);
}

static void expect_type(parser *p, int type, const char *what) {
    if (cur(p)->type != type) pfail(p, cur(p)->line, "expected %s, got '%s'", what, describe(cur(p)));
    advance(p);
}

static void enter(parser *p) {
    if (++p->depth > MAX_PARSE_DEPTH) pfail(p, cur(p)->line, "template nested too deeply");
}

static node *parse_expression(parser *p, bool with_condexpr);

static node *parse_primary(parser *p, bool with_namespace);

static node *parse_postfix(parser *p, node *n);

static node *parse_filter(parser *p, node *n, bool start_inline);

static node **parse_statements(parser *p, const char *const *ends, bool drop, int *count);

static bool is_tuple_end(parser *p, const char *extra) {
    token *t = cur(p);
    if (t->type == TK_VAR_END || t->type == TK_BLOCK_END || is_op(t, OP_RPAREN)) return true;
    return extra && is_name(t, extra);
}

static node *parse_tuple(parser *p, bool simplified, bool with_condexpr, const char *extra, bool explicit_parens,
                         bool with_namespace) {
    int line = cur(p)->line;
    nvec items = {0};
    bool is_tuple = false;
    for (;;) {
        if (items.n) expect_op(p, OP_COMMA);
        if (is_tuple_end(p, extra)) break;
        nv_push(p, &items, simplified ? parse_primary(p, with_namespace) : parse_expression(p, with_condexpr));
        if (is_op(cur(p), OP_COMMA)) is_tuple = true;
        else break;
    }
    if (!is_tuple) {
        if (items.n) return items.v[0];
        if (!explicit_parens) pfail(p, cur(p)->line, "expected an expression, got '%s'", describe(cur(p)));
    }
    node *n = new_node(p, E_TUPLE, line);
    n->v = items.v;
    n->nv = items.n;
    return n;
}

static void parse_call_args(parser *p, node *n) {
    int line = cur(p)->line;
    expect_op(p, OP_LPAREN);
    nvec items = {0}, kwv = {0};
    const char **kw = NULL;
    int nkw = 0, capkw = 0;
    bool comma = false;
    while (!is_op(cur(p), OP_RPAREN)) {
        if (comma) {
            expect_op(p, OP_COMMA);
            if (is_op(cur(p), OP_RPAREN)) break;
        }
        if (is_op(cur(p), OP_MUL) || is_op(cur(p), OP_POW))
            pfail(p, cur(p)->line, "*args and **kwargs in calls are not supported");
        if (cur(p)->type == TK_NAME && is_op(peek(p), OP_ASSIGN)) {
            const char *key = cur(p)->s;
            advance(p);
            advance(p);
            kw = push_name(p, kw, &nkw, &capkw, key);
            nv_push(p, &kwv, parse_expression(p, true));
        } else {
            if (nkw) pfail(p, line, "invalid syntax for function call expression");
            nv_push(p, &items, parse_expression(p, true));
        }
        comma = true;
    }
    expect_op(p, OP_RPAREN);
    n->v = items.v;
    n->nv = items.n;
    n->kw = kw;
    n->nkw = nkw;
    n->w = kwv.v;
    n->nw = kwv.n;
}

static node *parse_call(parser *p, node *callee) {
    node *n = new_node(p, E_CALL, cur(p)->line);
    n->a = callee;
    parse_call_args(p, n);
    if (callee->kind == E_NAME) {
        nv_push(p, &p->calls, n);
    } else if (callee->kind == E_GETATTR) {
        if (callee->id < 0 || callee->id >= M_COUNT_) pfail(p, n->line, "unknown method '%s'", callee->name);
    } else {
        pfail(p, n->line, "calling this kind of expression is not supported");
    }
    return n;
}

static node *parse_subscribed(parser *p) {
    int line = cur(p)->line;
    node *start = NULL, *stop = NULL, *step = NULL;
    if (is_op(cur(p), OP_COLON)) {
        advance(p);
    } else {
        node *e = parse_expression(p, true);
        if (!is_op(cur(p), OP_COLON)) return e;
        advance(p);
        start = e;
    }
    if (!is_op(cur(p), OP_COLON) && !is_op(cur(p), OP_RBRACKET) && !is_op(cur(p), OP_COMMA))
        stop = parse_expression(p, true);
    if (is_op(cur(p), OP_COLON)) {
        advance(p);
        if (!is_op(cur(p), OP_RBRACKET) && !is_op(cur(p), OP_COMMA)) step = parse_expression(p, true);
    }
    node *n = new_node(p, E_SLICE, line);
    n->b = start;
    n->x = stop;
    n->y = step;
    return n;
}

static node *parse_subscript(parser *p, node *obj) {
    token *t = cur(p);
    int line = t->line;
    advance(p);
    if (t->type == TK_OP && t->op == OP_DOT) {
        token *a = cur(p);
        advance(p);
        if (a->type == TK_NAME) {
            node *n = new_node(p, E_GETATTR, line);
            n->a = obj;
            n->name = a->s;
            n->id = lookup_attr(a->s);
            return n;
        }
        if (a->type != TK_INT) pfail(p, a->line, "expected name or number");
        node *n = new_node(p, E_GETITEM, line);
        n->a = obj;
        n->b = new_node(p, E_CONST, line);
        n->b->c = v_int(a->i);
        return n;
    }
    nvec items = {0};
    while (!is_op(cur(p), OP_RBRACKET)) {
        if (items.n) expect_op(p, OP_COMMA);
        nv_push(p, &items, parse_subscribed(p));
    }
    expect_op(p, OP_RBRACKET);
    if (items.n == 1 && items.v[0]->kind == E_SLICE) {
        items.v[0]->a = obj;
        return items.v[0];
    }
    node *n = new_node(p, E_GETITEM, line);
    n->a = obj;
    if (items.n == 1) {
        n->b = items.v[0];
    } else {
        for (int i = 0; i < items.n; i++)
            if (items.v[i]->kind == E_SLICE) pfail(p, line, "multi-dimensional slices are not supported");
        n->b = new_node(p, E_TUPLE, line);
        n->b->v = items.v;
        n->b->nv = items.n;
    }
    return n;
}

static node *parse_postfix(parser *p, node *n) {
    for (;;) {
        if (is_op(cur(p), OP_DOT) || is_op(cur(p), OP_LBRACKET)) n = parse_subscript(p, n);
        else if (is_op(cur(p), OP_LPAREN)) n = parse_call(p, n);
        else return n;
    }
}

static const char *dotted_name(parser *p, const char *name) {
    while (is_op(cur(p), OP_DOT)) {
        advance(p);
        const char *part = expect_name(p)->s;
        size_t l1 = strlen(name), l2 = strlen(part);
        char *s = arena_alloc(p->a, l1 + l2 + 2);
        memcpy(s, name, l1);
        s[l1] = '.';
        memcpy(s + l1 + 1, part, l2 + 1);
        name = s;
    }
    return name;
}

static node *parse_filter(parser *p, node *n, bool start_inline) {
    while (is_op(cur(p), OP_PIPE) || start_inline) {
        if (!start_inline) advance(p);
        token *t = expect_name(p);
        const char *name = dotted_name(p, t->s);
        int id = lookup_filter(name);
        if (id < 0) {
            if (is_unsupported_filter(name)) pfail(p, t->line, "filter '%s' is not supported", name);
            pfail(p, t->line, "no filter named '%s'", name);
        }
        node *f = new_node(p, E_FILTER, t->line);
        f->a = n;
        f->name = name;
        f->id = id;
        if (is_op(cur(p), OP_LPAREN)) parse_call_args(p, f);
        n = f;
        start_inline = false;
    }
    return n;
}

static node *parse_test(parser *p, node *n) {
    int line = cur(p)->line;
    advance(p); /* is */
    bool negated = false;
    if (is_name(cur(p), "not")) {
        advance(p);
        negated = true;
    }
    token *t = expect_name(p);
    const char *name = dotted_name(p, t->s);
    int id = lookup_test(name);
    if (id < 0) pfail(p, t->line, "no test named '%s'", name);
    node *x = new_node(p, E_TEST, line);
    x->a = n;
    x->name = name;
    x->id = id;
    token *c = cur(p);
    if (is_op(c, OP_LPAREN)) {
        parse_call_args(p, x);
    } else if ((c->type == TK_NAME || c->type == TK_STRING || c->type == TK_INT || c->type == TK_FLOAT ||
                is_op(c, OP_LBRACKET) || is_op(c, OP_LBRACE)) &&
               !is_name(c, "else") && !is_name(c, "or") && !is_name(c, "and")) {
        if (is_name(c, "is")) pfail(p, c->line, "you cannot chain multiple tests with is");
        node *arg = parse_postfix(p, parse_primary(p, false));
        x->v = arena_alloc(p->a, sizeof *x->v);
        x->v[0] = arg;
        x->nv = 1;
    }
    if (negated) {
        node *nn = new_node(p, E_NOT, line);
        nn->a = x;
        return nn;
    }
    return x;
}

static node *parse_filter_expr(parser *p, node *n) {
    for (;;) {
        if (is_op(cur(p), OP_PIPE)) n = parse_filter(p, n, false);
        else if (is_name(cur(p), "is")) n = parse_test(p, n);
        else if (is_op(cur(p), OP_LPAREN)) n = parse_call(p, n);
        else return n;
    }
}

static node *parse_primary(parser *p, bool with_namespace) {
    token *t = cur(p);
    node *n;
    enter(p);
    switch (t->type) {
    case TK_NAME:
        advance(p);
        n = new_node(p, E_CONST, t->line);
        if (!strcmp(t->s, "true") || !strcmp(t->s, "True")) n->c = v_bool(true);
        else if (!strcmp(t->s, "false") || !strcmp(t->s, "False")) n->c = v_bool(false);
        else if (!strcmp(t->s, "none") || !strcmp(t->s, "None")) n->c = v_none();
        else if (with_namespace && is_op(cur(p), OP_DOT)) {
            advance(p);
            n->kind = E_NSREF;
            n->name2 = t->s;
            n->name = expect_name(p)->s;
        } else {
            n->kind = E_NAME;
            n->name = t->s;
        }
        break;
    case TK_STRING: {
        sbuf b;
        sb_init(&b, p->a, SIZE_MAX / 4, false);
        n = new_node(p, E_CONST, t->line);
        while (cur(p)->type == TK_STRING) {
            sb_put(&b, cur(p)->s, cur(p)->n);
            advance(p);
        }
        n->c = v_str(b.p ? b.p : "", b.n);
        break;
    }
    case TK_INT:
    case TK_FLOAT:
        advance(p);
        n = new_node(p, E_CONST, t->line);
        n->c = t->type == TK_INT ? v_int(t->i) : v_float(t->f);
        break;
    case TK_OP:
        if (t->op == OP_LPAREN) {
            advance(p);
            n = parse_tuple(p, false, true, NULL, true, false);
            expect_op(p, OP_RPAREN);
            break;
        }
        if (t->op == OP_LBRACKET) {
            advance(p);
            nvec items = {0};
            while (!is_op(cur(p), OP_RBRACKET)) {
                if (items.n) expect_op(p, OP_COMMA);
                if (is_op(cur(p), OP_RBRACKET)) break;
                nv_push(p, &items, parse_expression(p, true));
            }
            expect_op(p, OP_RBRACKET);
            n = new_node(p, E_LIST, t->line);
            n->v = items.v;
            n->nv = items.n;
            break;
        }
        if (t->op == OP_LBRACE) {
            advance(p);
            nvec keys = {0}, vals = {0};
            while (!is_op(cur(p), OP_RBRACE)) {
                if (keys.n) expect_op(p, OP_COMMA);
                if (is_op(cur(p), OP_RBRACE)) break;
                nv_push(p, &keys, parse_expression(p, true));
                expect_op(p, OP_COLON);
                nv_push(p, &vals, parse_expression(p, true));
            }
            expect_op(p, OP_RBRACE);
            n = new_node(p, E_DICT, t->line);
            n->v = keys.v;
            n->nv = keys.n;
            n->w = vals.v;
            n->nw = vals.n;
            break;
        }
        /* fall through */
    default:
        pfail(p, t->line, "unexpected '%s'", describe(t));
    }
    p->depth--;
    return n;
}

static node *parse_unary(parser *p, bool with_filter) {
    token *t = cur(p);
    node *n;
    enter(p);
    if (is_op(t, OP_SUB) || is_op(t, OP_ADD)) {
        advance(p);
        n = new_node(p, t->op == OP_SUB ? E_NEG : E_POS, t->line);
        n->a = parse_unary(p, false);
    } else {
        n = parse_primary(p, false);
    }
    n = parse_postfix(p, n);
    if (with_filter) n = parse_filter_expr(p, n);
    p->depth--;
    return n;
}

static node *binop(parser *p, int kind, int op, int line, node *a, node *b) {
    node *n = new_node(p, kind, line);
    n->op = (uint8_t)op;
    n->a = a;
    n->b = b;
    return n;
}

/* operand (op operand)*, left-associative: the operators of one level are the name word or,
 * without one, the operator tokens ops (ended by OP_NONE) */
static node *parse_left_assoc(parser *p, node *(*operand)(parser *), int kind, const char *word, const int *ops) {
    node *left = operand(p);
    for (;;) {
        token *t = cur(p);
        int op = OP_NONE;
        if (word) {
            if (!is_name(t, word)) return left;
        } else {
            for (int i = 0; ops[i] != OP_NONE && op == OP_NONE; i++)
                if (is_op(t, ops[i])) op = ops[i];
            if (op == OP_NONE) return left;
        }
        advance(p);
        left = binop(p, kind, op, t->line, left, operand(p));
    }
}

static node *parse_unary_filtered(parser *p) { return parse_unary(p, true); }

static node *parse_pow(parser *p) {
    static const int ops[] = {OP_POW, OP_NONE};
    return parse_left_assoc(p, parse_unary_filtered, E_BIN, NULL, ops);
}

static node *parse_math2(parser *p) {
    static const int ops[] = {OP_MUL, OP_DIV, OP_FDIV, OP_MOD, OP_NONE};
    return parse_left_assoc(p, parse_pow, E_BIN, NULL, ops);
}

static node *parse_concat(parser *p) {
    node *first = parse_math2(p);
    if (!is_op(cur(p), OP_TILDE)) return first;
    nvec items = {0};
    nv_push(p, &items, first);
    int line = cur(p)->line;
    while (is_op(cur(p), OP_TILDE)) {
        advance(p);
        nv_push(p, &items, parse_math2(p));
    }
    node *n = new_node(p, E_CONCAT, line);
    n->v = items.v;
    n->nv = items.n;
    return n;
}

static node *parse_math1(parser *p) {
    static const int ops[] = {OP_ADD, OP_SUB, OP_NONE};
    return parse_left_assoc(p, parse_concat, E_BIN, NULL, ops);
}

static node *parse_compare(parser *p) {
    int line = cur(p)->line;
    node *expr = parse_math1(p);
    nvec operands = {0};
    uint8_t ops[64];
    int nops = 0;
    for (;;) {
        token *t = cur(p);
        int op;
        if (t->type == TK_OP && (t->op == OP_EQ || t->op == OP_NE || t->op == OP_LT || t->op == OP_LTEQ ||
                                 t->op == OP_GT || t->op == OP_GTEQ)) {
            op = t->op;
            advance(p);
        } else if (is_name(t, "in")) {
            op = OP_IN;
            advance(p);
        } else if (is_name(t, "not") && is_name(peek(p), "in")) {
            op = OP_NOTIN;
            advance(p);
            advance(p);
        } else {
            break;
        }
        if (nops == (int)sizeof ops) pfail(p, t->line, "too many chained comparisons");
        ops[nops++] = (uint8_t)op;
        nv_push(p, &operands, parse_math1(p));
    }
    if (!nops) return expr;
    node *n = new_node(p, E_CMP, line);
    n->a = expr;
    n->v = operands.v;
    n->nv = operands.n;
    n->ops = arena_alloc(p->a, (size_t)nops);
    memcpy(n->ops, ops, (size_t)nops);
    return n;
}

static node *parse_not(parser *p) {
    if (is_name(cur(p), "not")) {
        int line = cur(p)->line;
        advance(p);
        enter(p);
        node *n = new_node(p, E_NOT, line);
        n->a = parse_not(p);
        p->depth--;
        return n;
    }
    return parse_compare(p);
}

static node *parse_and(parser *p) { return parse_left_assoc(p, parse_not, E_AND, "and", NULL); }
static node *parse_or(parser *p) { return parse_left_assoc(p, parse_and, E_OR, "or", NULL); }

static node *parse_condexpr(parser *p) {
    node *e1 = parse_or(p);
    while (is_name(cur(p), "if")) {
        int line = cur(p)->line;
        advance(p);
        node *n = new_node(p, E_COND, line);
        n->a = parse_or(p);
        n->b = e1;
        if (is_name(cur(p), "else")) {
            advance(p);
            enter(p);
            n->x = parse_condexpr(p);
            p->depth--;
        }
        e1 = n;
    }
    return e1;
}

static node *parse_expression(parser *p, bool with_condexpr) {
    enter(p);
    node *n = with_condexpr ? parse_condexpr(p) : parse_or(p);
    p->depth--;
    return n;
}

static bool can_assign(const node *n) {
    if (n->kind == E_NAME || n->kind == E_NSREF) return true;
    if (n->kind != E_TUPLE) return false;
    for (int i = 0; i < n->nv; i++)
        if (!can_assign(n->v[i])) return false;
    return true;
}

static node *parse_assign_target(parser *p, const char *extra, bool with_namespace) {
    int line = cur(p)->line;
    node *t = parse_tuple(p, true, true, extra, false, with_namespace);
    if (!can_assign(t)) pfail(p, line, "can't assign to this expression");
    return t;
}

static void parse_signature(parser *p, node *n) {
    const char **names = NULL;
    nvec defaults = {0};
    int count = 0, cap = 0;
    bool have_default = false;
    expect_op(p, OP_LPAREN);
    while (!is_op(cur(p), OP_RPAREN)) {
        if (count) expect_op(p, OP_COMMA);
        token *t = expect_name(p);
        node *d = NULL;
        if (is_op(cur(p), OP_ASSIGN)) {
            advance(p);
            d = parse_expression(p, true);
            have_default = true;
        } else if (have_default) {
            pfail(p, t->line, "non-default argument follows default argument");
        }
        names = push_name(p, names, &count, &cap, t->s);
        nv_push(p, &defaults, d);
    }
    expect_op(p, OP_RPAREN);
    n->kw = names;
    n->nkw = count;
    n->w = defaults.v;
    n->nw = defaults.n;
}

/* Calls fn on every node of the tree under n. */
static void walk(const node *n, void (*fn)(const node *, void *), void *ud) {
    if (!n) return;
    fn(n, ud);
    walk(n->a, fn, ud);
    walk(n->b, fn, ud);
    walk(n->x, fn, ud);
    walk(n->y, fn, ud);
    for (int i = 0; i < n->nv; i++) walk(n->v[i], fn, ud);
    for (int i = 0; i < n->nw; i++) walk(n->w[i], fn, ud);
}

static void find_macro_names(const node *n, void *ud) {
    uint8_t *flags = ud;
    if (n->kind != E_NAME) return;
    if (!strcmp(n->name, "caller")) *flags |= MF_CALLER;
    else if (!strcmp(n->name, "varargs")) *flags |= MF_VARARGS;
    else if (!strcmp(n->name, "kwargs")) *flags |= MF_KWARGS;
}

static void set_macro_flags(node *n) {
    uint8_t flags = 0;
    for (int i = 0; i < n->nv; i++) walk(n->v[i], find_macro_names, &flags);
    n->flags = flags;
}

/* The body of a block tag up to its one end tag, which is dropped. */
static node **parse_body(parser *p, const char *end, int *count) {
    const char *const ends[] = {end, NULL};
    return parse_statements(p, ends, true, count);
}

/* The body of a macro or a call block: break and continue there do not reach an enclosing loop. */
static void parse_macro_body(parser *p, node *n, const char *end) {
    int loops = p->loops;
    p->loops = 0;
    n->v = parse_body(p, end, &n->nv);
    p->loops = loops;
    set_macro_flags(n);
}

/* The statements below parse a tag's rest, the tag name consumed. */
static node *parse_if(parser *p, int line, const char *tag) {
    (void)tag;
    node *result = new_node(p, S_IF, line), *cur_if = result;
    for (;;) {
        cur_if->a = parse_tuple(p, false, false, NULL, false, false);
        static const char *const ends[] = {"elif", "else", "endif", NULL};
        cur_if->v = parse_statements(p, ends, false, &cur_if->nv);
        token *e = cur(p);
        advance(p);
        if (is_name(e, "elif")) {
            node *next_if = new_node(p, S_IF, e->line);
            next_if->flags = IF_ELIF;
            cur_if->w = arena_alloc(p->a, sizeof *cur_if->w);
            cur_if->w[0] = next_if;
            cur_if->nw = 1;
            cur_if = next_if;
            continue;
        }
        if (is_name(e, "else")) cur_if->w = parse_body(p, "endif", &cur_if->nw);
        return result;
    }
}

static node *parse_for(parser *p, int line, const char *tag) {
    (void)tag;
    node *n = new_node(p, S_FOR, line);
    n->a = parse_assign_target(p, "in", false);
    expect_kw(p, "in");
    n->b = parse_tuple(p, false, false, "recursive", false, false);
    if (is_name(cur(p), "if")) {
        advance(p);
        n->x = parse_expression(p, true);
    }
    if (is_name(cur(p), "recursive")) pfail(p, cur(p)->line, "recursive for loops are not supported");
    static const char *const ends[] = {"endfor", "else", NULL};
    p->loops++;
    n->v = parse_statements(p, ends, false, &n->nv);
    p->loops--;
    token *e = cur(p);
    advance(p);
    if (is_name(e, "else")) n->w = parse_body(p, "endfor", &n->nw);
    return n;
}

static node *parse_set(parser *p, int line, const char *tag) {
    (void)tag;
    node *n, *target = parse_assign_target(p, NULL, true);
    if (is_op(cur(p), OP_ASSIGN)) {
        advance(p);
        n = new_node(p, S_SET, line);
        n->a = target;
        n->b = parse_tuple(p, false, true, NULL, false, false);
        if (target->kind == E_NAME && n->b->kind == E_CALL && n->b->a->kind == E_NAME &&
            !strcmp(n->b->a->name, "joiner"))
            nv_push(p, &p->defs, n);
    } else {
        n = new_node(p, S_SETBLOCK, line);
        n->a = target;
        n->b = parse_filter(p, NULL, false);
        n->v = parse_body(p, "endset", &n->nv);
    }
    return n;
}

static node *parse_macro(parser *p, int line, const char *tag) {
    (void)tag;
    node *n = new_node(p, S_MACRO, line);
    n->name = expect_name(p)->s;
    parse_signature(p, n);
    parse_macro_body(p, n, "endmacro");
    nv_push(p, &p->defs, n);
    return n;
}

static node *parse_callblock(parser *p, int line, const char *tag) {
    (void)tag;
    node *n = new_node(p, S_CALLBLOCK, line);
    if (is_op(cur(p), OP_LPAREN)) parse_signature(p, n);
    n->a = parse_expression(p, true);
    if (n->a->kind != E_CALL) pfail(p, line, "expected call");
    parse_macro_body(p, n, "endcall");
    return n;
}

static node *parse_filterblock(parser *p, int line, const char *tag) {
    (void)tag;
    node *n = new_node(p, S_FILTERBLOCK, line);
    n->b = parse_filter(p, NULL, true);
    n->v = parse_body(p, "endfilter", &n->nv);
    return n;
}

static node *parse_with(parser *p, int line, const char *tag) {
    (void)tag;
    node *n = new_node(p, S_WITH, line);
    nvec vals = {0};
    int cap = 0;
    while (cur(p)->type != TK_BLOCK_END) {
        if (n->nkw) expect_op(p, OP_COMMA);
        node *target = parse_assign_target(p, NULL, false);
        if (target->kind != E_NAME) pfail(p, line, "only plain names are supported as with targets");
        expect_op(p, OP_ASSIGN);
        n->kw = push_name(p, n->kw, &n->nkw, &cap, target->name);
        nv_push(p, &vals, parse_expression(p, true));
    }
    n->w = vals.v;
    n->nw = vals.n;
    n->v = parse_body(p, "endwith", &n->nv);
    return n;
}

static node *parse_print(parser *p, int line, const char *tag) {
    (void)tag;
    node *n = new_node(p, S_OUTPUT, line);
    nvec items = {0};
    while (cur(p)->type != TK_BLOCK_END) {
        if (items.n) expect_op(p, OP_COMMA);
        nv_push(p, &items, parse_expression(p, true));
    }
    n->v = items.v;
    n->nv = items.n;
    return n;
}

static node *parse_loop_control(parser *p, int line, const char *tag) {
    if (!p->loops) pfail(p, line, "'%s' outside of a loop", tag);
    return new_node(p, tag[0] == 'b' ? S_BREAK : S_CONTINUE, line);
}

static node *parse_generation(parser *p, int line, const char *tag) {
    (void)tag;
    node *n = new_node(p, S_SCOPE, line);
    n->v = parse_body(p, "endgeneration", &n->nv);
    return n;
}

static const struct {
    const char *tag;
    node *(*parse)(parser *p, int line, const char *tag); /* NULL: a jinja2 tag refused here */
} statement_tags[] = {
    {"if", parse_if}, {"for", parse_for}, {"set", parse_set}, {"macro", parse_macro},
    {"call", parse_callblock}, {"filter", parse_filterblock}, {"with", parse_with}, {"print", parse_print},
    {"break", parse_loop_control}, {"continue", parse_loop_control}, {"generation", parse_generation},
    {"block", NULL}, {"extends", NULL}, {"include", NULL}, {"import", NULL}, {"from", NULL}, {"autoescape", NULL},
};

static node *parse_statement(parser *p) {
    token *t = cur(p);
    int line = t->line;
    if (t->type != TK_NAME) pfail(p, line, "tag name expected");
    const char *tag = t->s;
    enter(p);
    for (size_t i = 0; i < sizeof statement_tags / sizeof statement_tags[0]; i++) {
        if (strcmp(tag, statement_tags[i].tag)) continue;
        if (!statement_tags[i].parse) pfail(p, line, "tag '%s' is not supported", tag);
        advance(p);
        node *n = statement_tags[i].parse(p, line, tag);
        p->depth--;
        return n;
    }
    pfail(p, line, "unknown tag '%s'", tag);
}

/* Parses statements and text up to a block whose tag is one of ends (NULL: end of source),
 * leaving that tag name as the current token. */
node **subparse(parser *p, const char *const *ends, int *count) {
    nvec body = {0}, data = {0};
    enter(p);
    for (;;) {
        token *t = cur(p);
        if (t->type == TK_EOF) break;
        if (t->type == TK_DATA) {
            node *d = new_node(p, E_CONST, t->line);
            d->c = v_str(t->s, t->n);
            nv_push(p, &data, d);
            advance(p);
        } else if (t->type == TK_VAR_BEGIN) {
            advance(p);
            nv_push(p, &data, parse_tuple(p, false, true, NULL, false, false));
            expect_type(p, TK_VAR_END, "end of print statement");
        } else if (t->type == TK_BLOCK_BEGIN) {
            if (data.n) {
                node *o = new_node(p, S_OUTPUT, data.v[0]->line);
                o->v = data.v;
                o->nv = data.n;
                nv_push(p, &body, o);
                memset(&data, 0, sizeof data);
            }
            advance(p);
            if (ends && cur(p)->type == TK_NAME)
                for (int i = 0; ends[i]; i++)
                    if (!strcmp(cur(p)->s, ends[i])) goto done;
            nv_push(p, &body, parse_statement(p));
            expect_type(p, TK_BLOCK_END, "end of statement block");
        } else {
            pfail(p, t->line, "unexpected '%s'", describe(t));
        }
    }
    if (data.n) {
        node *o = new_node(p, S_OUTPUT, data.v[0]->line);
        o->v = data.v;
        o->nv = data.n;
        nv_push(p, &body, o);
    }
done:
    p->depth--;
    *count = body.n;
    return body.v;
}

static node **parse_statements(parser *p, const char *const *ends, bool drop, int *count) {
    if (is_op(cur(p), OP_COLON)) advance(p);
    expect_type(p, TK_BLOCK_END, "end of statement block");
    node **body = subparse(p, ends, count);
    if (cur(p)->type == TK_EOF) {
        char want[128] = "";
        for (int i = 0; ends[i]; i++) {
            size_t l = strlen(want);
            snprintf(want + l, sizeof want - l, "%s'%s'", i ? " or " : "", ends[i]);
        }
        pfail(p, cur(p)->line, "unexpected end of template, expected %s", want);
    }
    if (drop) advance(p);
    return body;
}
