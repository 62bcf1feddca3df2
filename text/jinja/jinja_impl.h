/* jinja_impl.h: what the pieces of the chat-template interpreter share (the .c files of text/jinja/);
 * included only by text/chat_template.c and text/jinja/.
 *
 * transformers renders a model's chat template with jinja2 (an ImmutableSandboxedEnvironment
 * with trim_blocks, lstrip_blocks and the loopcontrols extension) to build the prompt, and
 * the server must produce the same bytes. The interpreter follows jinja2 3.1 closely: a
 * lexer that mirrors jinja2's regular expressions and whitespace control (lex.c), a
 * recursive-descent parser to a tree (the grammar of jinja2/parser.py, parse.c), and an
 * evaluator with Python value semantics: truthiness, str() and repr(), int/float arithmetic,
 * code-point strings, the sandbox's attribute rules and the filters, tests and methods
 * templates use (value.c, ops.c, methods.c, filters.c, eval.c). Two jinja2 behaviours are
 * reproduced on purpose: its compile-time name resolution (resolve.c) and the laziness of
 * generator filters (see lazy_filter). What the interpreter does not implement is refused at
 * parse time with the line number.
 *
 * Known differences, all on inputs no real template has: a value Python would print with its
 * memory address (a method, a generator) is an error; integers are 64-bit (overflow is an
 * error, Python would go on with big integers); recursion stops at CHAT_TEMPLATE_MAX_DEPTH
 * rather than at Python's stack limit; jinja2 folds constant expressions when compiling, so
 * a nonsense like {{ 0[:2] }} prints nothing there and is an error here.
 *
 * Memory: the tree lives in the template's arena and is never written after parsing, so
 * renders may run concurrently. A render allocates all its values from its own arena, which
 * is freed at once; errors therefore unwind with longjmp (as in Lua) without leaking. */
#ifndef CS_JINJA_IMPL_H
#define CS_JINJA_IMPL_H

#include <jansson.h>
#include <setjmp.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <utf8proc.h>

#include "text/chat_template.h"

/* -------------------------------------------------------- errors, memory (arena.c) ---- */

typedef struct errctx {
    jmp_buf jb;
    int status;
    bool fatal; /* a limit or out of memory: never deferred (see lazy_filter) */
    char msg[1024];
} errctx;

typedef struct chunk {
    struct chunk *next;
    size_t cap, used;
    max_align_t data[];
} chunk;

typedef struct arena {
    chunk *head;
    size_t total, limit;
    errctx *ec;
} arena;

/* Growable byte buffer. Buffers of a render grow inside its arena (the waste is bounded by the
 * doubling); the final output grows with realloc (heap = true) and is handed to the caller. */
typedef struct sbuf {
    char *p;
    size_t n, cap, limit;
    bool heap;
    arena *a;
} sbuf;

/* ------------------------------------------------------------- unicode (unicode.c) ---- */

enum { CASE_UPPER, CASE_LOWER, CASE_TITLE };

/* -------------------------------------------------------------------------- values ---- */

/* A value is a small tagged union passed by value; containers point into the render arena.
 * Lists, tuples, dicts and strings are immutable (the sandbox forbids mutation); only a
 * namespace's attributes, an iterator's position and loop/cycler state change. */
enum vtype {
    T_MISSING = 0, /* internal: an argument that was not given */
    T_UNDEF,       /* jinja2 Undefined (k: UK_MSG, UK_UNSAFE or UK_LAZY) */
    T_NONE,
    T_BOOL,
    T_INT,
    T_FLOAT,
    T_STR,    /* k = 1: markupsafe.Markup */
    T_LIST,   /* k = list kind */
    T_DICT,
    T_NS,     /* namespace() */
    T_MACRO,
    T_FUNC,   /* a global function: range, namespace, dict, ... */
    T_METHOD, /* a bound method of a str, dict, list, loop or cycler */
    T_LOOP,   /* the loop variable */
    T_ITER,   /* a generator or iterator (select, map, reverse, items ...) */
    T_CYCLER,
    T_JOINER,
};

enum { LK_LIST, LK_TUPLE, LK_RANGE, LK_KEYS, LK_VALUES, LK_ITEMS };

typedef struct val val;

typedef struct node node;

typedef struct scope scope;

typedef struct list {
    size_t n;
    val *v;
    int64_t start, stop, step; /* LK_RANGE: for repr() */
} list;

typedef struct dict {
    size_t n, cap;
    val *k, *v;
} dict;

typedef struct iterobj {
    list *l;
    size_t pos;
    const char *err; /* raised when consumed past l (a generator that failed there) */
} iterobj;

typedef struct macro {
    const node *def; /* S_MACRO or S_CALLBLOCK (its body is the caller) */
    scope *closure;
    const char *name;
} macro;

struct bound;

struct loopctx;

struct cycler;

struct joiner;

struct undef_info;

/* T_UNDEF: what its k says about u */
enum {
    UK_MSG,    /* u.msg: the message to give when it is used */
    UK_UNSAFE, /* u.msg: a sandbox SecurityError in waiting */
    UK_LAZY,   /* u.ud: what was looked up, the message is written only if it is used */
};

struct val {
    uint8_t t, k;
    union {
        bool b;
        int64_t i;
        double f;
        struct {
            const char *p;
            size_t n;
        } s;
        list *l;
        dict *d;
        macro *m;
        struct bound *bm;
        struct loopctx *lp;
        iterobj *it;
        struct cycler *cy;
        struct joiner *jn;
        const char *msg; /* T_UNDEF */
        struct undef_info *ud;
        int fn;          /* T_FUNC */
    } u;
};

struct bound {
    val self;
    int mid;
};

enum { U_NAME, U_ATTR, U_ELEM };

struct undef_info {
    int kind;
    const char *name; /* U_NAME, U_ATTR */
    val obj;          /* U_ATTR, U_ELEM */
    int64_t index;    /* U_ELEM */
};

struct loopctx {
    const val *items;
    size_t n, i;
    val last_changed;
    bool changed_set;
};

struct cycler {
    const val *items;
    size_t n, pos;
};

struct joiner {
    val sep;
    bool used;
};

/* ---------------------------------------------------------------------------- tree ---- */

enum nkind {
    /* statements */
    S_OUTPUT,      /* v: items (E_CONST data or expressions) */
    S_IF,          /* a: test, v: body, w: else (an elif is an S_IF alone in w) */
    S_FOR,         /* a: target, b: iterable, x: filter condition, v: body, w: else */
    S_SET,         /* a: target (E_NAME, E_TUPLE, E_NSREF), b: value */
    S_SETBLOCK,    /* a: target, b: filter chain or NULL, v: body */
    S_MACRO,       /* name, kw: parameters, w: defaults (NULL: none), v: body, flags */
    S_CALLBLOCK,   /* a: the call, kw/w: caller's parameters and defaults, v: caller body */
    S_FILTERBLOCK, /* b: filter chain, v: body */
    S_WITH,        /* kw: names, w: values, v: body */
    S_BREAK,
    S_CONTINUE,
    S_SCOPE, /* {% generation %}: v: body in a new scope */
    /* expressions */
    E_CONST,  /* c */
    E_NAME,   /* name */
    E_NSREF,  /* name2.name, as an assignment target */
    E_LIST,   /* v */
    E_TUPLE,  /* v */
    E_DICT,   /* v: keys, w: values */
    E_GETATTR, /* a.name */
    E_GETITEM, /* a[b] */
    E_SLICE,   /* a[b:x:y], each of b, x, y may be NULL */
    E_CALL,    /* a(v..., kw=w...) */
    E_FILTER,  /* a|name(v..., kw=w...); a is NULL in filter chains of blocks */
    E_TEST,    /* a is name(v..., kw=w...) */
    E_NOT,
    E_NEG,
    E_POS,
    E_BIN, /* a op b */
    E_AND,
    E_OR,
    E_CONCAT, /* v joined with ~ */
    E_CMP,    /* a ops[0] v[0] ops[1] v[1] ... */
    E_COND,   /* b if a else x (x may be NULL) */
};

/* S_MACRO / S_CALLBLOCK flags: the body refers to these names; S_IF: made by an elif */
enum { MF_CALLER = 1, MF_VARARGS = 2, MF_KWARGS = 4, IF_ELIF = 8 };

struct node {
    uint8_t kind, op, flags;
    int line;
    int id; /* filter / test id */
    const char *name, *name2;
    val c;
    node *a, *b, *x, *y;
    node **v, **w;
    int nv, nw;
    const char **kw;
    int nkw;
    uint8_t *ops;
    /* names jinja2 starts as undefined in the scope this node opens (its body; for S_FOR
     * also uninit2 for the else block), see analyze_frame */
    const char **uninit, **uninit2;
    int nuninit, nuninit2;
};

/* ------------------------------------------------------------------- lexer (lex.c) ---- */

enum tk { TK_EOF, TK_DATA, TK_VAR_BEGIN, TK_VAR_END, TK_BLOCK_BEGIN, TK_BLOCK_END, TK_NAME, TK_STRING, TK_INT, TK_FLOAT, TK_OP };

enum op {
    OP_NONE,
    OP_ADD, OP_SUB, OP_DIV, OP_FDIV, OP_MUL, OP_MOD, OP_POW, OP_TILDE,
    OP_LBRACKET, OP_RBRACKET, OP_LPAREN, OP_RPAREN, OP_LBRACE, OP_RBRACE,
    OP_EQ, OP_NE, OP_GT, OP_GTEQ, OP_LT, OP_LTEQ,
    OP_ASSIGN, OP_DOT, OP_COLON, OP_PIPE, OP_COMMA, OP_SEMICOLON,
    /* comparison operators that are names */
    OP_IN, OP_NOTIN,
};

typedef struct token {
    uint8_t type, op;
    int line;
    const char *s; /* TK_DATA, TK_NAME, TK_STRING: decoded text */
    size_t n;
    int64_t i;
    double f;
} token;

typedef struct lexer {
    errctx *ec;
    arena *a;
    const char *src; /* newlines normalized to \n, one trailing newline dropped */
    size_t len, pos;
    bool line_starting;
    size_t line_pos; /* line counting cursor */
    int line;
    token *toks;
    size_t ntok, cap;
} lexer;

/* ---------------------------------------------- filters, tests, functions, methods ---- */

enum filter_id {
    F_ABS, F_ATTR, F_BATCH, F_CAPITALIZE, F_CENTER, F_DEFAULT, F_DICTSORT, F_ESCAPE, F_FIRST, F_FLOAT,
    F_FORCEESCAPE, F_FORMAT, F_INDENT, F_INT, F_ITEMS, F_JOIN, F_LAST, F_LENGTH, F_LIST, F_LOWER,
    F_MAP, F_MAX, F_MIN, F_REJECT, F_REJECTATTR, F_REPLACE, F_REVERSE, F_ROUND, F_SAFE, F_SELECT, F_SELECTATTR,
    F_SLICE, F_SORT, F_STRING, F_SUM, F_TITLE, F_TOJSON, F_TRIM, F_TRUNCATE, F_UNIQUE, F_UPPER, F_WORDCOUNT,
};

enum test_id {
    X_ODD, X_EVEN, X_DIVISIBLEBY, X_DEFINED, X_UNDEFINED, X_FILTER, X_TEST, X_NONE, X_BOOLEAN, X_FALSE, X_TRUE,
    X_INTEGER, X_FLOAT, X_LOWER, X_UPPER, X_STRING, X_MAPPING, X_NUMBER, X_SEQUENCE, X_ITERABLE, X_CALLABLE,
    X_SAMEAS, X_ESCAPED, X_IN, X_EQ, X_NE, X_GT, X_GE, X_LT, X_LE,
};

enum func_id { FN_RANGE, FN_NAMESPACE, FN_DICT, FN_RAISE, FN_STRFTIME, FN_CYCLER, FN_JOINER };

enum method_id {
    /* str */
    M_STRIP, M_LSTRIP, M_RSTRIP, M_SPLIT, M_RSPLIT, M_SPLITLINES, M_STARTSWITH, M_ENDSWITH, M_UPPER, M_LOWER,
    M_TITLE, M_CAPITALIZE, M_REPLACE, M_FIND, M_RFIND, M_INDEX, M_RINDEX, M_COUNT, M_JOIN, M_FORMAT, M_CENTER,
    M_LJUST, M_RJUST, M_ZFILL, M_PARTITION, M_RPARTITION, M_REMOVEPREFIX, M_REMOVESUFFIX, M_ISDIGIT, M_ISALPHA,
    M_ISALNUM, M_ISSPACE, M_ISLOWER, M_ISUPPER, M_ISNUMERIC, M_ISDECIMAL,
    /* dict */
    M_ITEMS, M_KEYS, M_VALUES, M_GET, M_COPY, M_POP, M_POPITEM, M_SETDEFAULT, M_UPDATE, M_CLEAR,
    /* list (and M_POP, M_CLEAR, M_INDEX, M_COUNT, M_COPY) */
    M_APPEND, M_EXTEND, M_INSERT, M_REMOVE, M_REVERSE, M_SORT,
    /* loop, cycler */
    M_CYCLE, M_CHANGED, M_NEXT, M_RESET,
    M_COUNT_,
    /* attributes that are not methods: of the loop, of a range, of a cycler */
    A_INDEX = M_COUNT_, A_INDEX0, A_REVINDEX, A_REVINDEX0, A_FIRST, A_LAST, A_LENGTH, A_DEPTH, A_DEPTH0,
    A_PREVITEM, A_NEXTITEM, A_START, A_STOP, A_STEP, A_CURRENT,
    A_COUNT_,
};

/* ----------------------------------------------------- parser (parse.c, resolve.c) ---- */

typedef struct nvec {
    node **v;
    int n, cap;
} nvec;

typedef struct parser {
    errctx *ec;
    arena *a;
    token *t;
    size_t i;
    int depth;
    int loops;  /* enclosing for loops, for break/continue */
    nvec calls; /* calls of a plain name, checked once all macros are known */
    nvec defs;  /* macro definitions and "set x = joiner(...)" */
} parser;

/* ---------------------------------------------------------------------- evaluation ---- */

struct scope {
    scope *parent;
    size_t n, cap;
    const char **names;
    val *vals;
};

typedef struct rctx {
    errctx ec;
    arena a;
    sbuf *out;
    int depth;
    long iterations;
    int line; /* of the node being evaluated, for messages */
} rctx;

enum { FLOW_NORMAL, FLOW_BREAK, FLOW_CONTINUE };

typedef struct json_opts {
    bool ensure_ascii, sort_keys, indent_set;
    val indent; /* int or str */
    const char *item_sep, *key_sep;
    size_t item_sep_n, key_sep_n;
} json_opts;

typedef struct args {
    const val *pos;
    int npos;
    const char **kwn;
    const val *kwv;
    int nkw;
} args;

/* ---------------------------------------- functions, by the file that defines them ---- */

/* arena.c */
_Noreturn void throw_status(errctx *ec, int status, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
_Noreturn void throw_limit(errctx *ec, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void *arena_alloc(arena *a, size_t n);
void *arena_zalloc(arena *a, size_t n);
void arena_free(arena *a);
void *arena_grow(arena *a, const void *old, size_t n, size_t cap, size_t elem);
char *arena_strndup(arena *a, const char *s, size_t n);
void sb_init(sbuf *b, arena *a, size_t limit, bool heap);
void sb_reserve(sbuf *b, size_t extra);
void sb_put(sbuf *b, const char *s, size_t n);
void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* unicode.c */
size_t utf8_dec(const char *s, size_t n, int32_t *cp);
void sb_putcp(sbuf *b, int32_t cp);
size_t utf8_off(const char *s, size_t n, size_t i);
bool is_space_cp(int32_t c);
bool is_linebreak_cp(int32_t c);
bool is_cased_cp(int32_t c);
bool is_alpha_cp(int32_t c);
bool is_numeric_cp(int32_t c);
bool is_printable_cp(int32_t c);
void put_case(sbuf *b, int32_t c, int mode);
void put_lower_at(sbuf *b, const char *s, size_t n, size_t i, int32_t c);

/* lex.c */
extern const char *const op_text[];
void lex_source(lexer *lx);

/* parse.c */
extern const char *const method_names[A_COUNT_];
int lookup_filter(const char *name);
bool is_unsupported_filter(const char *name);
int lookup_test(const char *name);
int lookup_func(const char *name);
int lookup_attr(const char *name);
_Noreturn void pfail(parser *p, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
node *new_node(parser *p, int kind, int line);
node **subparse(parser *p, const char *const *ends, int *count);

/* resolve.c */
void resolve_names(parser *p, node *root);

/* value.c */
_Noreturn void rfail(rctx *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void enter_r(rctx *r);
scope *scope_new(rctx *r, scope *parent);
val *scope_find(scope *s, const char *name);
void scope_set(rctx *r, scope *s, const char *name, val v);
val undef_lazy(rctx *r, int kind, const char *name, val obj, int64_t index);
void bind_uninit(rctx *r, scope *s, const char *const *names, int n);
scope *scope_open(rctx *r, scope *parent, const char *const *uninit, int nuninit);
list *list_new(rctx *r, size_t n);
val v_tuple2(rctx *r, val a, val b);
dict *dict_new(rctx *r, size_t cap);
val v_iter(rctx *r, list *l);
const char *type_name(val v);
const char *obj_desc(rctx *r, val v);
const char *rsprintf(rctx *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
_Noreturn void undef_fail(rctx *r, val v);
bool truthy(val v);
void put_repr(rctx *r, sbuf *b, val v);
void put_str(rctx *r, sbuf *b, val v);
val str_of(rctx *r, val v);
val html_escape(rctx *r, val v);
bool py_eq(rctx *r, val a, val b);
bool hashable(val v);
long dict_find(rctx *r, const dict *d, val key);
bool list_contains(rctx *r, const list *l, val x);
bool py_order(rctx *r, val a, val b, int op);
void json_put(rctx *r, sbuf *b, val v, const json_opts *o, int level);
val from_json(rctx *r, const json_t *j, int depth);
const val *iterate(rctx *r, val v, size_t *n);
list *to_list(rctx *r, val v);
int64_t py_len(rctx *r, val v);
bool py_in(rctx *r, val item, val seq);

/* ops.c */
val bound(rctx *r, val self, int mid);
val attr_only(rctx *r, val obj, const char *name, int aid, bool *found);
val get_attr(rctx *r, val obj, const char *name, int aid);
val get_item(rctx *r, val obj, val key);
val get_slice(rctx *r, val obj, val vstart, val vstop, val vstep);
val num_op(rctx *r, int op, val a, val b);
val percent_format(rctx *r, val fmt, val fargs);
val arith(rctx *r, int op, val a, val b);
void put_padded(sbuf *b, val s, int64_t width, char align, const char *fill, size_t filln);

/* methods.c */
val out_str(sbuf *b, bool markup);
val str_strip(rctx *r, val s, val chars, int mode);
size_t prev_cp(const char *p, size_t i);
val str_split(rctx *r, val s, val sep, val vmax, bool right);
val str_splitlines(rctx *r, val s, bool keepends);
val str_case(rctx *r, val s, int mode);
val jinja_title(rctx *r, val s);
val str_replace(rctx *r, val s, val old, val rep, int64_t count);
bool str_pred(val s, int mode);

/* filters.c */
void bind_args(rctx *r, const char *what, const args *a, const char *const *params, int np, val *out);
val required(rctx *r, val v, const char *what, const char *param);
int64_t int_arg(rctx *r, val v, const char *what);
void dict_set(rctx *r, dict *d, val k, val v);
bool do_test(rctx *r, int tid, const char *tname, val v, const args *a);
val do_filter(rctx *r, int fid, const char *fname, val v, const args *a);

/* methods.c */
val call_method(rctx *r, const struct bound *bm, const args *a);
dict *dict_from_args(rctx *r, const args *a, const char *what);

/* eval.c */
int exec_body(rctx *r, node *const *body, int n, scope *s);

/* small helpers inlined where they are used */

static inline void sb_puts(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }

static inline void sb_putc(sbuf *b, char c) { sb_put(b, &c, 1); }

static inline int ucat(int32_t c) { return (int)utf8proc_category(c); }

static inline bool is_decimal_cp(int32_t c) { return ucat(c) == UTF8PROC_CATEGORY_ND; }

static inline val v_missing(void) { return (val){.t = T_MISSING}; }

static inline val v_none(void) { return (val){.t = T_NONE}; }

static inline val v_bool(bool b) { return (val){.t = T_BOOL, .u.b = b}; }

static inline val v_int(int64_t i) { return (val){.t = T_INT, .u.i = i}; }

static inline val v_float(double f) { return (val){.t = T_FLOAT, .u.f = f}; }

static inline val v_str(const char *p, size_t n) { return (val){.t = T_STR, .u.s = {p, n}}; }

static inline val v_undef(const char *msg) { return (val){.t = T_UNDEF, .u.msg = msg}; }

static inline val mk_str(rctx *r, const char *p, size_t n) { return v_str(arena_strndup(&r->a, p, n), n); }

static inline val sb_val(const sbuf *b) { return v_str(b->p ? b->p : "", b->n); }

static inline val v_cstr(const char *s) { return v_str(s, strlen(s)); }

static inline val v_markup(val s) {
    s.k = 1;
    return s;
}

static inline val v_list(list *l, int kind) { return (val){.t = T_LIST, .k = (uint8_t)kind, .u.l = l}; }

static inline val v_dict(dict *d) { return (val){.t = T_DICT, .u.d = d}; }

static inline bool is_num(val v) { return v.t == T_BOOL || v.t == T_INT || v.t == T_FLOAT; }

static inline bool is_intlike(val v) { return v.t == T_BOOL || v.t == T_INT; }

static inline int64_t as_int(val v) { return v.t == T_BOOL ? (int64_t)v.u.b : v.u.i; }

static inline double as_float(val v) { return v.t == T_FLOAT ? v.u.f : (double)as_int(v); }

/* soft_str: str(v) but a Markup stays Markup */
static inline val soft_str(rctx *r, val v) { return v.t == T_STR ? v : str_of(r, v); }

/* For sorting: a < b with Python semantics */
static inline bool py_less(rctx *r, val a, val b) { return py_order(r, a, b, OP_LT); }

static inline val no_attr(rctx *r, val obj, const char *name) { return undef_lazy(r, U_ATTR, name, obj, 0); }

static inline _Noreturn void overflow(rctx *r) { rfail(r, "integer result does not fit in 64 bits"); }

static inline val opt(val v, val dflt) { return v.t == T_MISSING ? dflt : v; }

#endif
