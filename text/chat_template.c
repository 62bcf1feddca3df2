/* chat_template.c: the chat-template API: parse a template once, render it per request, and
 * the messages as transformers hands them to the template. The interpreter itself is in
 * text/jinja/ (see jinja_impl.h). */
#include "text/chat_template.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "text/jinja/jinja_impl.h"

/* --------------------------------------------------------------------------- API ---- */

struct chat_template {
    arena a;
    node *root; /* an S_SCOPE holding the template's statements */
};

typedef struct parse_state {
    errctx ec;
    lexer lx;
    parser p;
} parse_state;

/* The source as jinja2 reads it, in the arena: it must be UTF-8 (Python reads it as str);
 * newlines become \n and one trailing newline is dropped. *out_len: its length. */
static char *normalize_source(errctx *ec, arena *a, const char *src, size_t len, size_t *out_len) {
    if (!src && len) throw_status(ec, CS_EINVAL, "no template source");
    for (size_t i = 0; i < len;) {
        utf8proc_int32_t c;
        utf8proc_ssize_t k = utf8proc_iterate((const utf8proc_uint8_t *)src + i, (utf8proc_ssize_t)(len - i), &c);
        if (k <= 0) throw_status(ec, CS_EINVAL, "template is not valid UTF-8 (at byte %zu)", i);
        i += (size_t)k;
    }
    char *norm = arena_alloc(a, len + 1);
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            norm[n++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n') i++;
        } else {
            norm[n++] = src[i];
        }
    }
    if (n && norm[n - 1] == '\n') n--;
    norm[n] = 0;
    *out_len = n;
    return norm;
}

int chat_template_parse(const char *src, size_t len, chat_template_t **out) {
    *out = NULL;
    chat_template_t *t = calloc(1, sizeof *t);
    parse_state *ps = calloc(1, sizeof *ps);
    if (!t || !ps) {
        free(t);
        free(ps);
        return cs_error_set(CS_ENOMEM, "out of memory");
    }
    t->a.limit = (size_t)256 << 20;
    t->a.ec = &ps->ec;
    if (setjmp(ps->ec.jb)) {
        int status = cs_error_set(ps->ec.status, "%s", ps->ec.msg);
        arena_free(&t->a);
        free(t);
        free(ps);
        return status;
    }
    lexer *lx = &ps->lx;
    lx->ec = &ps->ec;
    lx->a = &t->a;
    lx->src = normalize_source(&ps->ec, &t->a, src, len, &lx->len);
    lx->line = 1;
    lex_source(lx);
    parser *p = &ps->p;
    p->ec = &ps->ec;
    p->a = &t->a;
    p->t = lx->toks;
    t->root = new_node(p, S_SCOPE, 1);
    t->root->v = subparse(p, NULL, &t->root->nv);
    resolve_names(p, t->root);
    t->a.ec = NULL; /* the tree is complete: nothing allocates from this arena any more */
    free(ps);
    *out = t;
    return CS_OK;
}

void chat_template_free(chat_template_t *t) {
    if (!t) return;
    arena_free(&t->a);
    free(t);
}

int chat_template_render(const chat_template_t *t, const json_t *ctx, char **out, size_t *out_len) {
    *out = NULL;
    if (out_len) *out_len = 0;
    if (!t) return cs_error_set(CS_EINVAL, "no template");
    rctx *r = calloc(1, sizeof *r);
    sbuf *result = calloc(1, sizeof *result);
    if (!r || !result) {
        free(r);
        free(result);
        return cs_error_set(CS_ENOMEM, "out of memory");
    }
    r->a.limit = CHAT_TEMPLATE_MAX_MEMORY;
    r->a.ec = &r->ec;
    sb_init(result, &r->a, CHAT_TEMPLATE_MAX_OUTPUT, true);
    if (setjmp(r->ec.jb)) {
        int status = cs_error_set(r->ec.status, "%s", r->ec.msg);
        free(result->p);
        free(result);
        arena_free(&r->a);
        free(r);
        return status;
    }
    scope *vars = scope_new(r, NULL);
    if (ctx) {
        if (!json_is_object(ctx)) throw_status(&r->ec, CS_EINVAL, "the render context must be a JSON object");
        const char *key;
        json_t *value;
        json_object_foreach((json_t *)ctx, key, value)
            scope_set(r, vars, arena_strndup(&r->a, key, strlen(key)), from_json(r, value, 0));
    }
    r->out = result;
    exec_body(r, t->root->v, t->root->nv, scope_open(r, vars, t->root->uninit, t->root->nuninit));
    char *text = result->p;
    size_t n = result->n;
    if (!text) {
        text = malloc(1);
        if (!text) throw_status(&r->ec, CS_ENOMEM, "out of memory");
        text[0] = 0;
    }
    free(result);
    arena_free(&r->a);
    free(r);
    *out = text;
    if (out_len) *out_len = n;
    return CS_OK;
}

json_t *chat_template_hf_messages(const json_t *messages, bool drop_null) {
    static const char *const fields[] = {"reasoning_content", "thinking", "reasoning"};
    if (!json_is_array(messages)) return NULL;
    json_t *out = json_array();
    if (!out) return NULL;
    size_t i;
    json_t *m;
    json_array_foreach(messages, i, m) {
        if (!json_is_object(m)) {
            json_decref(out);
            return NULL;
        }
        json_t *copy = json_object();
        const char *key;
        json_t *value;
        json_t *reasoning = NULL;
        for (int f = 0; f < 3 && !reasoning; f++) {
            json_t *x = json_object_get(m, fields[f]);
            if (x && !json_is_null(x)) reasoning = x;
        }
        /* {"thinking": reasoning, **message, "reasoning_content": reasoning} */
        if (reasoning) json_object_set(copy, "thinking", reasoning);
        json_object_foreach(m, key, value) {
            if (drop_null && json_is_null(value)) continue;
            json_object_set(copy, key, value);
        }
        if (reasoning) json_object_set(copy, "reasoning_content", reasoning);
        json_array_append_new(out, copy);
    }
    return out;
}
