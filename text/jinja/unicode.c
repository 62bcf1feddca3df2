/* unicode.c: the code point properties and case mappings Python's str methods use (isspace,
 * splitlines, isalpha ..., upper/lower/title with SpecialCasing and the final sigma), on
 * utf8proc's tables. */
#include "text/jinja/jinja_impl.h"


/* ------------------------------------------------------------------------- unicode ---- */

/* Decodes one code point; invalid bytes decode as themselves (inputs are valid UTF-8:
 * template sources are checked and jansson checks JSON strings). */
size_t utf8_dec(const char *s, size_t n, int32_t *cp) {
    utf8proc_int32_t c;
    utf8proc_ssize_t k = utf8proc_iterate((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, &c);
    if (k <= 0) {
        *cp = (unsigned char)s[0];
        return 1;
    }
    *cp = c;
    return (size_t)k;
}

static size_t utf8_enc(int32_t cp, char *out) {
    utf8proc_ssize_t k = utf8proc_encode_char(cp, (utf8proc_uint8_t *)out);
    if (k <= 0) {
        out[0] = '?';
        return 1;
    }
    return (size_t)k;
}

void sb_putcp(sbuf *b, int32_t cp) {
    char tmp[4];
    sb_put(b, tmp, utf8_enc(cp, tmp));
}

/* Byte offset of code point index i (i <= number of code points). */
size_t utf8_off(const char *s, size_t n, size_t i) {
    size_t off = 0;
    while (i > 0 && off < n) {
        off++;
        while (off < n && ((unsigned char)s[off] & 0xC0) == 0x80) off++;
        i--;
    }
    return off;
}

/* Python's str.isspace() (and the \s of its regular expressions). */
bool is_space_cp(int32_t c) {
    if (c < 0x80) return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20);
    return c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 ||
           c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

/* Python's str.splitlines() boundaries (\r\n is handled by the caller). */
bool is_linebreak_cp(int32_t c) {
    return c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D || c == 0x1E || c == 0x85 ||
           c == 0x2028 || c == 0x2029;
}

bool is_cased_cp(int32_t c) {
    int k = ucat(c);
    return k == UTF8PROC_CATEGORY_LU || k == UTF8PROC_CATEGORY_LL || k == UTF8PROC_CATEGORY_LT;
}

static bool is_case_ignorable_cp(int32_t c) {
    int k = ucat(c);
    return k == UTF8PROC_CATEGORY_MN || k == UTF8PROC_CATEGORY_ME || k == UTF8PROC_CATEGORY_CF ||
           k == UTF8PROC_CATEGORY_LM || k == UTF8PROC_CATEGORY_SK || c == '\'' || c == '.' || c == ':' ||
           c == 0xB7 || c == 0x2019;
}

bool is_alpha_cp(int32_t c) {
    int k = ucat(c);
    return k >= UTF8PROC_CATEGORY_LU && k <= UTF8PROC_CATEGORY_LO;
}

bool is_numeric_cp(int32_t c) {
    int k = ucat(c);
    return k == UTF8PROC_CATEGORY_ND || k == UTF8PROC_CATEGORY_NL || k == UTF8PROC_CATEGORY_NO;
}

/* Python's str.isprintable() for repr(): not Cc Cf Cs Co Cn Zl Zp, not Zs except ' '. */
bool is_printable_cp(int32_t c) {
    if (c == ' ') return true;
    int k = ucat(c);
    return !(k == UTF8PROC_CATEGORY_CC || k == UTF8PROC_CATEGORY_CF || k == UTF8PROC_CATEGORY_CS ||
             k == UTF8PROC_CATEGORY_CO || k == UTF8PROC_CATEGORY_CN || k == UTF8PROC_CATEGORY_ZL ||
             k == UTF8PROC_CATEGORY_ZP || k == UTF8PROC_CATEGORY_ZS);
}

/* Python's full case mappings where they map one code point to several (SpecialCasing);
 * single code point mappings are utf8proc's, which agree with Python's. */
struct special_case {
    int32_t cp;
    const char *to;
};

static const struct special_case special_upper[] = {
    {0x00df, "\x53\x53"}, {0x0149, "\xca\xbc\x4e"}, {0x01f0, "\x4a\xcc\x8c"},
    {0x0390, "\xce\x99\xcc\x88\xcc\x81"}, {0x03b0, "\xce\xa5\xcc\x88\xcc\x81"},
    {0x0587, "\xd4\xb5\xd5\x92"}, {0x1e96, "\x48\xcc\xb1"}, {0x1e97, "\x54\xcc\x88"},
    {0x1e98, "\x57\xcc\x8a"}, {0x1e99, "\x59\xcc\x8a"}, {0x1e9a, "\x41\xca\xbe"},
    {0x1f50, "\xce\xa5\xcc\x93"}, {0x1f52, "\xce\xa5\xcc\x93\xcc\x80"},
    {0x1f54, "\xce\xa5\xcc\x93\xcc\x81"}, {0x1f56, "\xce\xa5\xcc\x93\xcd\x82"},
    {0x1f80, "\xe1\xbc\x88\xce\x99"}, {0x1f81, "\xe1\xbc\x89\xce\x99"},
    {0x1f82, "\xe1\xbc\x8a\xce\x99"}, {0x1f83, "\xe1\xbc\x8b\xce\x99"},
    {0x1f84, "\xe1\xbc\x8c\xce\x99"}, {0x1f85, "\xe1\xbc\x8d\xce\x99"},
    {0x1f86, "\xe1\xbc\x8e\xce\x99"}, {0x1f87, "\xe1\xbc\x8f\xce\x99"},
    {0x1f88, "\xe1\xbc\x88\xce\x99"}, {0x1f89, "\xe1\xbc\x89\xce\x99"},
    {0x1f8a, "\xe1\xbc\x8a\xce\x99"}, {0x1f8b, "\xe1\xbc\x8b\xce\x99"},
    {0x1f8c, "\xe1\xbc\x8c\xce\x99"}, {0x1f8d, "\xe1\xbc\x8d\xce\x99"},
    {0x1f8e, "\xe1\xbc\x8e\xce\x99"}, {0x1f8f, "\xe1\xbc\x8f\xce\x99"},
    {0x1f90, "\xe1\xbc\xa8\xce\x99"}, {0x1f91, "\xe1\xbc\xa9\xce\x99"},
    {0x1f92, "\xe1\xbc\xaa\xce\x99"}, {0x1f93, "\xe1\xbc\xab\xce\x99"},
    {0x1f94, "\xe1\xbc\xac\xce\x99"}, {0x1f95, "\xe1\xbc\xad\xce\x99"},
    {0x1f96, "\xe1\xbc\xae\xce\x99"}, {0x1f97, "\xe1\xbc\xaf\xce\x99"},
    {0x1f98, "\xe1\xbc\xa8\xce\x99"}, {0x1f99, "\xe1\xbc\xa9\xce\x99"},
    {0x1f9a, "\xe1\xbc\xaa\xce\x99"}, {0x1f9b, "\xe1\xbc\xab\xce\x99"},
    {0x1f9c, "\xe1\xbc\xac\xce\x99"}, {0x1f9d, "\xe1\xbc\xad\xce\x99"},
    {0x1f9e, "\xe1\xbc\xae\xce\x99"}, {0x1f9f, "\xe1\xbc\xaf\xce\x99"},
    {0x1fa0, "\xe1\xbd\xa8\xce\x99"}, {0x1fa1, "\xe1\xbd\xa9\xce\x99"},
    {0x1fa2, "\xe1\xbd\xaa\xce\x99"}, {0x1fa3, "\xe1\xbd\xab\xce\x99"},
    {0x1fa4, "\xe1\xbd\xac\xce\x99"}, {0x1fa5, "\xe1\xbd\xad\xce\x99"},
    {0x1fa6, "\xe1\xbd\xae\xce\x99"}, {0x1fa7, "\xe1\xbd\xaf\xce\x99"},
    {0x1fa8, "\xe1\xbd\xa8\xce\x99"}, {0x1fa9, "\xe1\xbd\xa9\xce\x99"},
    {0x1faa, "\xe1\xbd\xaa\xce\x99"}, {0x1fab, "\xe1\xbd\xab\xce\x99"},
    {0x1fac, "\xe1\xbd\xac\xce\x99"}, {0x1fad, "\xe1\xbd\xad\xce\x99"},
    {0x1fae, "\xe1\xbd\xae\xce\x99"}, {0x1faf, "\xe1\xbd\xaf\xce\x99"},
    {0x1fb2, "\xe1\xbe\xba\xce\x99"}, {0x1fb3, "\xce\x91\xce\x99"}, {0x1fb4, "\xce\x86\xce\x99"},
    {0x1fb6, "\xce\x91\xcd\x82"}, {0x1fb7, "\xce\x91\xcd\x82\xce\x99"},
    {0x1fbc, "\xce\x91\xce\x99"}, {0x1fc2, "\xe1\xbf\x8a\xce\x99"}, {0x1fc3, "\xce\x97\xce\x99"},
    {0x1fc4, "\xce\x89\xce\x99"}, {0x1fc6, "\xce\x97\xcd\x82"},
    {0x1fc7, "\xce\x97\xcd\x82\xce\x99"}, {0x1fcc, "\xce\x97\xce\x99"},
    {0x1fd2, "\xce\x99\xcc\x88\xcc\x80"}, {0x1fd3, "\xce\x99\xcc\x88\xcc\x81"},
    {0x1fd6, "\xce\x99\xcd\x82"}, {0x1fd7, "\xce\x99\xcc\x88\xcd\x82"},
    {0x1fe2, "\xce\xa5\xcc\x88\xcc\x80"}, {0x1fe3, "\xce\xa5\xcc\x88\xcc\x81"},
    {0x1fe4, "\xce\xa1\xcc\x93"}, {0x1fe6, "\xce\xa5\xcd\x82"},
    {0x1fe7, "\xce\xa5\xcc\x88\xcd\x82"}, {0x1ff2, "\xe1\xbf\xba\xce\x99"},
    {0x1ff3, "\xce\xa9\xce\x99"}, {0x1ff4, "\xce\x8f\xce\x99"}, {0x1ff6, "\xce\xa9\xcd\x82"},
    {0x1ff7, "\xce\xa9\xcd\x82\xce\x99"}, {0x1ffc, "\xce\xa9\xce\x99"}, {0xfb00, "\x46\x46"},
    {0xfb01, "\x46\x49"}, {0xfb02, "\x46\x4c"}, {0xfb03, "\x46\x46\x49"}, {0xfb04, "\x46\x46\x4c"},
    {0xfb05, "\x53\x54"}, {0xfb06, "\x53\x54"}, {0xfb13, "\xd5\x84\xd5\x86"},
    {0xfb14, "\xd5\x84\xd4\xb5"}, {0xfb15, "\xd5\x84\xd4\xbb"}, {0xfb16, "\xd5\x8e\xd5\x86"},
    {0xfb17, "\xd5\x84\xd4\xbd"},
};

static const struct special_case special_title[] = {
    {0x00df, "\x53\x73"}, {0x0149, "\xca\xbc\x4e"}, {0x01f0, "\x4a\xcc\x8c"},
    {0x0390, "\xce\x99\xcc\x88\xcc\x81"}, {0x03b0, "\xce\xa5\xcc\x88\xcc\x81"},
    {0x0587, "\xd4\xb5\xd6\x82"}, {0x1e96, "\x48\xcc\xb1"}, {0x1e97, "\x54\xcc\x88"},
    {0x1e98, "\x57\xcc\x8a"}, {0x1e99, "\x59\xcc\x8a"}, {0x1e9a, "\x41\xca\xbe"},
    {0x1f50, "\xce\xa5\xcc\x93"}, {0x1f52, "\xce\xa5\xcc\x93\xcc\x80"},
    {0x1f54, "\xce\xa5\xcc\x93\xcc\x81"}, {0x1f56, "\xce\xa5\xcc\x93\xcd\x82"},
    {0x1fb2, "\xe1\xbe\xba\xcd\x85"}, {0x1fb4, "\xce\x86\xcd\x85"}, {0x1fb6, "\xce\x91\xcd\x82"},
    {0x1fb7, "\xce\x91\xcd\x82\xcd\x85"}, {0x1fc2, "\xe1\xbf\x8a\xcd\x85"},
    {0x1fc4, "\xce\x89\xcd\x85"}, {0x1fc6, "\xce\x97\xcd\x82"},
    {0x1fc7, "\xce\x97\xcd\x82\xcd\x85"}, {0x1fd2, "\xce\x99\xcc\x88\xcc\x80"},
    {0x1fd3, "\xce\x99\xcc\x88\xcc\x81"}, {0x1fd6, "\xce\x99\xcd\x82"},
    {0x1fd7, "\xce\x99\xcc\x88\xcd\x82"}, {0x1fe2, "\xce\xa5\xcc\x88\xcc\x80"},
    {0x1fe3, "\xce\xa5\xcc\x88\xcc\x81"}, {0x1fe4, "\xce\xa1\xcc\x93"},
    {0x1fe6, "\xce\xa5\xcd\x82"}, {0x1fe7, "\xce\xa5\xcc\x88\xcd\x82"},
    {0x1ff2, "\xe1\xbf\xba\xcd\x85"}, {0x1ff4, "\xce\x8f\xcd\x85"}, {0x1ff6, "\xce\xa9\xcd\x82"},
    {0x1ff7, "\xce\xa9\xcd\x82\xcd\x85"}, {0xfb00, "\x46\x66"}, {0xfb01, "\x46\x69"},
    {0xfb02, "\x46\x6c"}, {0xfb03, "\x46\x66\x69"}, {0xfb04, "\x46\x66\x6c"}, {0xfb05, "\x53\x74"},
    {0xfb06, "\x53\x74"}, {0xfb13, "\xd5\x84\xd5\xb6"}, {0xfb14, "\xd5\x84\xd5\xa5"},
    {0xfb15, "\xd5\x84\xd5\xab"}, {0xfb16, "\xd5\x8e\xd5\xb6"}, {0xfb17, "\xd5\x84\xd5\xad"},
};

static const struct special_case special_lower[] = {
    {0x0130, "\x69\xcc\x87"},
};

static const char *special_lookup(const struct special_case *t, size_t n, int32_t cp) {
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (t[mid].cp == cp) return t[mid].to;
        if (t[mid].cp < cp) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}

void put_case(sbuf *b, int32_t c, int mode) {
    const char *sp = NULL;
    int32_t m = c;
    switch (mode) {
    case CASE_UPPER:
        sp = special_lookup(special_upper, sizeof special_upper / sizeof special_upper[0], c);
        m = utf8proc_toupper(c);
        break;
    case CASE_LOWER:
        sp = special_lookup(special_lower, sizeof special_lower / sizeof special_lower[0], c);
        m = utf8proc_tolower(c);
        break;
    default:
        sp = special_lookup(special_title, sizeof special_title / sizeof special_title[0], c);
        m = utf8proc_totitle(c);
        break;
    }
    if (sp) sb_puts(b, sp);
    else sb_putcp(b, m);
}

/* Lowercases the code point at s[i] (of n bytes) with Python's final-sigma rule. */
void put_lower_at(sbuf *b, const char *s, size_t n, size_t i, int32_t c) {
    if (c != 0x3A3) {
        put_case(b, c, CASE_LOWER);
        return;
    }
    bool before = false, after = false;
    size_t j = i;
    while (j > 0) {
        size_t k = j - 1;
        while (k > 0 && ((unsigned char)s[k] & 0xC0) == 0x80) k--;
        int32_t p;
        utf8_dec(s + k, n - k, &p);
        j = k;
        if (is_case_ignorable_cp(p)) continue;
        before = is_cased_cp(p);
        break;
    }
    int32_t me;
    j = i + utf8_dec(s + i, n - i, &me);
    while (j < n) {
        int32_t q;
        j += utf8_dec(s + j, n - j, &q);
        if (is_case_ignorable_cp(q)) continue;
        after = is_cased_cp(q);
        break;
    }
    sb_putcp(b, before && !after ? 0x3C2 : 0x3C3);
}
