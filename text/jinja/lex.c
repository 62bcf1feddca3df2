/* lex.c: the template lexer. It mirrors jinja2/lexer.py: data between tags, {{ }} and
 * {% %} with whitespace control (-, +, trim_blocks, lstrip_blocks), {# #} comments, raw
 * blocks, and inside tags jinja2's names, strings (Python escapes), integers, floats and
 * operators. */
#include "text/jinja/jinja_impl.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

/* --------------------------------------------------------------------------- lexer ---- */

const char *const op_text[] = {
    [OP_ADD] = "+", [OP_SUB] = "-", [OP_DIV] = "/", [OP_FDIV] = "//", [OP_MUL] = "*", [OP_MOD] = "%",
    [OP_POW] = "**", [OP_TILDE] = "~", [OP_LBRACKET] = "[", [OP_RBRACKET] = "]", [OP_LPAREN] = "(",
    [OP_RPAREN] = ")", [OP_LBRACE] = "{", [OP_RBRACE] = "}", [OP_EQ] = "==", [OP_NE] = "!=", [OP_GT] = ">",
    [OP_GTEQ] = ">=", [OP_LT] = "<", [OP_LTEQ] = "<=", [OP_ASSIGN] = "=", [OP_DOT] = ".", [OP_COLON] = ":",
    [OP_PIPE] = "|", [OP_COMMA] = ",", [OP_SEMICOLON] = ";", [OP_IN] = "in", [OP_NOTIN] = "not in",
};

static int lex_line(lexer *lx, size_t pos) {
    while (lx->line_pos < pos && lx->line_pos < lx->len) {
        if (lx->src[lx->line_pos] == '\n') lx->line++;
        lx->line_pos++;
    }
    return lx->line;
}

static _Noreturn void lex_fail(lexer *lx, size_t pos, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static _Noreturn void lex_fail(lexer *lx, size_t pos, const char *fmt, ...) {
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    throw_status(lx->ec, CS_EINVAL, "line %d: %s", lex_line(lx, pos), tmp);
}

static token *lex_push(lexer *lx, uint8_t type, size_t at) {
    if (lx->ntok == lx->cap) {
        size_t cap = lx->cap ? lx->cap * 2 : 256;
        lx->toks = arena_grow(lx->a, lx->toks, lx->ntok, cap, sizeof *lx->toks);
        lx->cap = cap;
    }
    token *t = &lx->toks[lx->ntok++];
    memset(t, 0, sizeof *t);
    t->type = type;
    t->line = lex_line(lx, at);
    return t;
}

/* Bytes of the whitespace code point at pos (Python's \s), 0 if none. */
static size_t ws_at(const char *s, size_t len, size_t pos) {
    if (pos >= len) return 0;
    int32_t c;
    size_t k = utf8_dec(s + pos, len - pos, &c);
    return is_space_cp(c) ? k : 0;
}

static size_t skip_ws(const char *s, size_t len, size_t pos) {
    size_t k;
    while ((k = ws_at(s, len, pos))) pos += k;
    return pos;
}

/* Emits the text before a tag, applying "-" (strip all whitespace before the tag) or
 * lstrip_blocks (strip the indentation of a block or comment tag that starts its line). */
static void lex_data(lexer *lx, size_t start, size_t end, char sign, bool is_variable) {
    const char *s = lx->src;
    if (sign == '-') {
        while (end > start) {
            size_t k = end - 1;
            while (k > start && ((unsigned char)s[k] & 0xC0) == 0x80) k--;
            if (!ws_at(s, end, k)) break;
            end = k;
        }
    } else if (sign != '+' && !is_variable) {
        size_t l = end;
        while (l > start && s[l - 1] != '\n') l--;
        if ((l > start || lx->line_starting) && l < end && skip_ws(s, end, l) == end) end = l;
    }
    if (end > start) {
        token *t = lex_push(lx, TK_DATA, start);
        t->s = s + start;
        t->n = end - start;
    }
}

/* (\d+_)*\d+ at pos: returns the end, or 0 if there is no digit at pos. */
static size_t lex_digits(const char *s, size_t len, size_t pos, int base) {
    size_t p = pos;
    bool any = false;
    for (;;) {
        size_t q = p;
        while (q < len) {
            int c = (unsigned char)s[q];
            int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                                     : c >= 'A' && c <= 'F' ? c - 'A' + 10 : 99;
            if (d >= base) break;
            q++;
        }
        if (q == p) return any ? p - 1 : 0; /* p - 1: back before a dangling '_' */
        any = true;
        p = q;
        if (p < len && s[p] == '_') p++;
        else return p;
    }
}

static int64_t lex_int_value(lexer *lx, size_t start, size_t end, int base) {
    uint64_t v = 0;
    for (size_t i = start; i < end; i++) {
        int c = (unsigned char)lx->src[i];
        if (c == '_') continue;
        int d = c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10;
        if (v > (UINT64_MAX - (uint64_t)d) / (uint64_t)base || v * (uint64_t)base + (uint64_t)d > (uint64_t)INT64_MAX)
            lex_fail(lx, start, "integer literal too large");
        v = v * (uint64_t)base + (uint64_t)d;
    }
    return (int64_t)v;
}

/* Tries the number rules at pos (float first, as jinja2 does). Returns the end or 0. */
static size_t lex_number(lexer *lx, size_t pos) {
    const char *s = lx->src;
    size_t len = lx->len;
    if (pos >= len || s[pos] < '0' || s[pos] > '9') return 0;
    /* float: (?<!\.)(\d+_)*\d+((\.(\d+_)*\d+)?e[+\-]?(\d+_)*\d+|\.(\d+_)*\d+) */
    if (pos == 0 || s[pos - 1] != '.') {
        size_t p = lex_digits(s, len, pos, 10), frac = 0, end = 0;
        if (p < len && s[p] == '.') frac = lex_digits(s, len, p + 1, 10);
        size_t e = frac ? frac : p;
        if (e < len && (s[e] == 'e' || s[e] == 'E')) {
            size_t q = e + 1;
            if (q < len && (s[q] == '+' || s[q] == '-')) q++;
            size_t d = lex_digits(s, len, q, 10);
            if (d) end = d;
        }
        if (!end) end = frac; /* no exponent: the fraction is required */
        if (end) {
            char tmp[128];
            size_t k = 0;
            for (size_t i = pos; i < end && k + 1 < sizeof tmp; i++)
                if (s[i] != '_') tmp[k++] = s[i];
            tmp[k] = 0;
            token *t = lex_push(lx, TK_FLOAT, pos);
            t->f = strtod(tmp, NULL);
            return end;
        }
    }
    /* integer: 0b.. 0o.. 0x.. [1-9](_?\d)* 0(_?0)* */
    if (s[pos] == '0' && pos + 1 < len) {
        int c = s[pos + 1] | 0x20, base = c == 'b' ? 2 : c == 'o' ? 8 : c == 'x' ? 16 : 0;
        if (base) {
            size_t q = pos + 2;
            if (q < len && s[q] == '_') q++;
            size_t end = lex_digits(s, len, q, base);
            if (end) {
                token *t = lex_push(lx, TK_INT, pos);
                t->i = lex_int_value(lx, pos + 2, end, base);
                return end;
            }
        }
    }
    size_t end;
    if (s[pos] == '0') {
        end = pos + 1;
        for (;;) {
            if (end < len && s[end] == '0') end++;
            else if (end + 1 < len && s[end] == '_' && s[end + 1] == '0') end += 2;
            else break;
        }
    } else {
        end = lex_digits(s, len, pos, 10);
    }
    token *t = lex_push(lx, TK_INT, pos);
    t->i = lex_int_value(lx, pos, end, 10);
    return end;
}

static int hexval(int c) {
    if (c >= '0' && c <= '9') return c - '0';
    c |= 0x20;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

/* Decodes a string literal body like jinja2 does (Python's unicode-escape applied after
 * encoding non-ASCII characters with backslashreplace). */
static void lex_unescape(lexer *lx, size_t at, const char *s, size_t n, token *t) {
    sbuf b;
    sb_init(&b, lx->a, SIZE_MAX / 4, false);
    sb_reserve(&b, n);
    for (size_t i = 0; i < n;) {
        if (s[i] != '\\') {
            size_t k = 1;
            while (i + k < n && s[i + k] != '\\') k++;
            sb_put(&b, s + i, k);
            i += k;
            continue;
        }
        i++; /* the string rule guarantees a character after a backslash */
        unsigned char d = (unsigned char)s[i];
        if (d >= 0x80) {
            /* the backslash escapes the backslash of backslashreplace: keep its escape text */
            int32_t c;
            i += utf8_dec(s + i, n - i, &c);
            sb_printf(&b, c <= 0xFF ? "\\x%02x" : c <= 0xFFFF ? "\\u%04x" : "\\U%08x", (unsigned)c);
            continue;
        }
        i++;
        switch (d) {
        case '\n': break;
        case '\\': sb_putc(&b, '\\'); break;
        case '\'': sb_putc(&b, '\''); break;
        case '"': sb_putc(&b, '"'); break;
        case 'a': sb_putc(&b, 7); break;
        case 'b': sb_putc(&b, 8); break;
        case 'f': sb_putc(&b, 12); break;
        case 'n': sb_putc(&b, '\n'); break;
        case 'r': sb_putc(&b, '\r'); break;
        case 't': sb_putc(&b, '\t'); break;
        case 'v': sb_putc(&b, 11); break;
        case 'x': case 'u': case 'U': {
            int digits = d == 'x' ? 2 : d == 'u' ? 4 : 8;
            uint32_t c = 0;
            for (int k = 0; k < digits; k++) {
                int h = i < n ? hexval((unsigned char)s[i]) : -1;
                if (h < 0) lex_fail(lx, at, "truncated \\%c escape in string literal", d);
                c = c * 16 + (uint32_t)h;
                i++;
            }
            if (c > 0x10FFFF) lex_fail(lx, at, "illegal Unicode character in string literal");
            if (c >= 0xD800 && c < 0xE000) lex_fail(lx, at, "surrogate escapes in string literals are not supported");
            sb_putcp(&b, (int32_t)c);
            break;
        }
        case 'N': lex_fail(lx, at, "\\N{...} escapes in string literals are not supported");
        default:
            if (d >= '0' && d <= '7') {
                uint32_t c = d - '0';
                for (int k = 0; k < 2 && i < n && s[i] >= '0' && s[i] <= '7'; k++) c = c * 8 + (uint32_t)(s[i++] - '0');
                sb_putcp(&b, (int32_t)c);
            } else {
                sb_putc(&b, '\\');
                sb_putc(&b, (char)d);
            }
        }
    }
    t->s = b.p ? b.p : "";
    t->n = b.n;
}

static const struct {
    const char *text;
    uint8_t op;
} lex_ops[] = {
    {"//", OP_FDIV}, {"**", OP_POW}, {"==", OP_EQ}, {"!=", OP_NE}, {">=", OP_GTEQ}, {"<=", OP_LTEQ},
    {"+", OP_ADD}, {"-", OP_SUB}, {"/", OP_DIV}, {"*", OP_MUL}, {"%", OP_MOD}, {"~", OP_TILDE},
    {"[", OP_LBRACKET}, {"]", OP_RBRACKET}, {"(", OP_LPAREN}, {")", OP_RPAREN}, {"{", OP_LBRACE},
    {"}", OP_RBRACE}, {">", OP_GT}, {"<", OP_LT}, {"=", OP_ASSIGN}, {".", OP_DOT}, {":", OP_COLON},
    {"|", OP_PIPE}, {",", OP_COMMA}, {";", OP_SEMICOLON},
};

/* Lexes the inside of {% ... %} (block) or {{ ... }} (variable) up to and including its end. */
static void lex_tag(lexer *lx, bool block) {
    const char *s = lx->src;
    size_t len = lx->len;
    char stack[64];
    int depth = 0;
    while (lx->pos < len) {
        size_t pos = lx->pos;
        if (depth == 0) {
            size_t end = 0;
            if (block) {
                if (s[pos] == '+' && pos + 2 < len && s[pos + 1] == '%' && s[pos + 2] == '}') end = pos + 3;
                else if (s[pos] == '-' && pos + 2 < len && s[pos + 1] == '%' && s[pos + 2] == '}') end = skip_ws(s, len, pos + 3);
                else if (s[pos] == '%' && pos + 1 < len && s[pos + 1] == '}') end = pos + 2 + (pos + 2 < len && s[pos + 2] == '\n');
            } else {
                if (s[pos] == '-' && pos + 2 < len && s[pos + 1] == '}' && s[pos + 2] == '}') end = skip_ws(s, len, pos + 3);
                else if (s[pos] == '}' && pos + 1 < len && s[pos + 1] == '}') end = pos + 2;
            }
            if (end) {
                lex_push(lx, block ? TK_BLOCK_END : TK_VAR_END, pos);
                lx->line_starting = s[end - 1] == '\n';
                lx->pos = end;
                return;
            }
        }
        size_t k = ws_at(s, len, pos);
        if (k) {
            lx->pos = skip_ws(s, len, pos);
            continue;
        }
        size_t end = lex_number(lx, pos);
        if (end) {
            lx->pos = end;
            continue;
        }
        unsigned char c = (unsigned char)s[pos];
        if (c == '_' || ((c | 0x20) >= 'a' && (c | 0x20) <= 'z')) {
            end = pos + 1;
            while (end < len && (s[end] == '_' || (s[end] >= '0' && s[end] <= '9') ||
                                 ((s[end] | 0x20) >= 'a' && (s[end] | 0x20) <= 'z')))
                end++;
            token *t = lex_push(lx, TK_NAME, pos);
            t->s = arena_strndup(lx->a, s + pos, end - pos);
            t->n = end - pos;
            lx->pos = end;
            continue;
        }
        if (c == '\'' || c == '"') {
            size_t i = pos + 1;
            while (i < len && s[i] != (char)c) i += s[i] == '\\' ? 2 : 1;
            if (i < len) {
                token *t = lex_push(lx, TK_STRING, pos);
                lex_unescape(lx, pos, s + pos + 1, i - pos - 1, t);
                lx->pos = i + 1;
                continue;
            }
        }
        uint8_t op = 0;
        size_t oplen = 0;
        for (size_t j = 0; j < sizeof lex_ops / sizeof lex_ops[0]; j++) {
            size_t l = strlen(lex_ops[j].text);
            if (pos + l <= len && memcmp(s + pos, lex_ops[j].text, l) == 0) {
                op = lex_ops[j].op;
                oplen = l;
                break;
            }
        }
        if (!op) {
            int32_t cp;
            utf8_dec(s + pos, len - pos, &cp);
            if (cp >= 0x20 && cp < 0x7F) lex_fail(lx, pos, "unexpected char '%c'", (char)cp);
            lex_fail(lx, pos, "unexpected char U+%04X", (unsigned)cp);
        }
        if (op == OP_LPAREN || op == OP_LBRACKET || op == OP_LBRACE) {
            if (depth == (int)sizeof stack) lex_fail(lx, pos, "brackets nested too deeply");
            stack[depth++] = op == OP_LPAREN ? ')' : op == OP_LBRACKET ? ']' : '}';
        } else if (op == OP_RPAREN || op == OP_RBRACKET || op == OP_RBRACE) {
            char want = op_text[op][0];
            if (depth == 0) lex_fail(lx, pos, "unexpected '%c'", want);
            if (stack[depth - 1] != want) lex_fail(lx, pos, "unexpected '%c', expected '%c'", want, stack[depth - 1]);
            depth--;
        }
        token *t = lex_push(lx, TK_OP, pos);
        t->op = op;
        lx->pos = pos + oplen;
    }
    /* end of source inside a tag: the parser reports what it was looking for */
}

/* {%(-|+|)\s*raw\s*(?:-%}\s*|%}) at pos (which holds "{%"): returns the end, or 0. */
static size_t lex_raw_begin(lexer *lx, size_t pos, const char *word, char *sign) {
    const char *s = lx->src;
    size_t len = lx->len, p = pos + 2, wl = strlen(word);
    *sign = 0;
    if (p < len && (s[p] == '-' || s[p] == '+')) *sign = s[p++];
    p = skip_ws(s, len, p);
    if (p + wl > len || memcmp(s + p, word, wl) != 0) return 0;
    p = skip_ws(s, len, p + wl);
    if (p + 2 < len && s[p] == '-' && s[p + 1] == '%' && s[p + 2] == '}') return skip_ws(s, len, p + 3);
    if (p + 1 < len && s[p] == '%' && s[p + 1] == '}') return p + 2;
    return 0;
}

void lex_source(lexer *lx) {
    const char *s = lx->src;
    size_t len = lx->len;
    lx->line_starting = true;
    while (lx->pos < len) {
        size_t pos = lx->pos, tag = pos;
        const char *p;
        bool found = false;
        while ((p = memchr(s + tag, '{', len - tag)) != NULL) {
            tag = (size_t)(p - s);
            if (tag + 1 < len && (s[tag + 1] == '{' || s[tag + 1] == '%' || s[tag + 1] == '#')) {
                found = true;
                break;
            }
            tag++;
        }
        if (!found) {
            token *t = lex_push(lx, TK_DATA, pos);
            t->s = s + pos;
            t->n = len - pos;
            break;
        }
        char kind = s[tag + 1], sign = 0;
        if (kind == '%') {
            size_t end = lex_raw_begin(lx, tag, "raw", &sign);
            if (end) {
                lex_data(lx, pos, tag, sign, false);
                lx->line_starting = s[end - 1] == '\n';
                /* (.*?)({%(-|+|)\s*endraw\s*(?:+%}|-%}\s*|%}\n?)) */
                size_t i = end, stop = 0;
                for (; i + 1 < len; i++) {
                    if (s[i] != '{' || s[i + 1] != '%') continue;
                    size_t q = i + 2;
                    if (q < len && (s[q] == '-' || s[q] == '+')) q++;
                    q = skip_ws(s, len, q);
                    if (q + 6 > len || memcmp(s + q, "endraw", 6) != 0) continue;
                    q = skip_ws(s, len, q + 6);
                    if (q + 2 < len && s[q] == '+' && s[q + 1] == '%' && s[q + 2] == '}') stop = q + 3;
                    else if (q + 2 < len && s[q] == '-' && s[q + 1] == '%' && s[q + 2] == '}') stop = skip_ws(s, len, q + 3);
                    else if (q + 1 < len && s[q] == '%' && s[q + 1] == '}') stop = q + 2 + (q + 2 < len && s[q + 2] == '\n');
                    if (stop) break;
                }
                if (!stop) lex_fail(lx, tag, "missing end of raw directive");
                char esign = s[i + 2] == '-' || s[i + 2] == '+' ? s[i + 2] : 0;
                lex_data(lx, end, i, esign, false);
                lx->line_starting = s[stop - 1] == '\n';
                lx->pos = stop;
                continue;
            }
        }
        size_t q = tag + 2;
        if (q < len && (s[q] == '-' || s[q] == '+')) sign = s[q++];
        lex_data(lx, pos, tag, sign, kind == '{');
        lx->line_starting = false;
        if (kind == '#') {
            const char *e = NULL;
            for (size_t i = q; i + 1 < len; i++)
                if (s[i] == '#' && s[i + 1] == '}') {
                    e = s + i;
                    break;
                }
            if (!e) lex_fail(lx, tag, "missing end of comment tag");
            size_t j = (size_t)(e - s), end = j + 2;
            if (j > q && s[j - 1] == '-') end = skip_ws(s, len, end);
            else if (!(j > q && s[j - 1] == '+') && end < len && s[end] == '\n') end++;
            lx->line_starting = s[end - 1] == '\n';
            lx->pos = end;
            continue;
        }
        lex_push(lx, kind == '%' ? TK_BLOCK_BEGIN : TK_VAR_BEGIN, tag);
        lx->pos = q;
        lex_tag(lx, kind == '%');
    }
    lex_push(lx, TK_EOF, len);
}
