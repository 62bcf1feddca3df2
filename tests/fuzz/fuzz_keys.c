/* fuzz_keys.c: the API key file (server/keys.c, keyring_parse) on any bytes. A refusal must
 * say why; an accepted ring is checked against the input read again with jansson: every key
 * of keys[i] finds the grant of entry i (role, flags, name, patterns as written), a tenant's
 * key_may_use agrees with a plain reference matcher on names made from the patterns, and
 * keys that are not in the file, or headers without a Bearer key, find nothing. */
#include <jansson.h>
#include <stdbool.h>
#include <string.h>

#include "base/common.h"
#include "server/keys.h"
#include "tests/fuzz/fuzz.h"

#define MAX_PROBES 64

static bool has_message(void) { return strcmp(cs_error_last(), "no error message") != 0 && cs_error_last()[0]; }

/* keys.h's rule: "prefix*" by prefix (a '*' is only ever last), anything else exactly */
static bool ref_match(const char *pattern, const char *name) {
    size_t n = strlen(pattern);
    if (n > 0 && pattern[n - 1] == '*') return strncmp(name, pattern, n - 1) == 0;
    return strcmp(name, pattern) == 0;
}

/* the reference answer for entry E (a tenant the parser accepted): one of its adapters matches */
static bool ref_may_use(json_t *e, const char *name) {
    json_t *a = json_object_get(e, "adapters");
    size_t j;
    json_t *p;
    json_array_foreach(a, j, p) if (ref_match(json_string_value(p), name)) return true;
    return false;
}

/* field F of entry E as keys.h reads it: a missing field or null is DEF */
static bool flag_of(json_t *e, const char *f, bool def) {
    json_t *v = json_object_get(e, f);
    return json_is_boolean(v) ? json_is_true(v) : def;
}

static char *header(const char *scheme, const char *key, const char *tail) {
    size_t n = strlen(scheme) + strlen(key) + strlen(tail) + 1;
    char *h = malloc(n);
    if (!h) abort();
    snprintf(h, n, "%s%s%s", scheme, key, tail);
    return h;
}

static void add_probe(char **probes, int *n, const char *s, size_t len, const char *suffix) {
    if (*n >= MAX_PROBES) return;
    size_t sl = strlen(suffix);
    char *p = malloc(len + sl + 1);
    if (!p) abort();
    memcpy(p, s, len);
    memcpy(p + len, suffix, sl + 1);
    probes[(*n)++] = p;
}

/* names to ask key_may_use about, made from PATTERN: itself, one byte shorter, one longer and,
 * for "prefix*", the prefix alone and with one more byte */
static void probes_of(char **probes, int *n, const char *pattern) {
    size_t len = strlen(pattern);
    add_probe(probes, n, pattern, len, "");
    add_probe(probes, n, pattern, len, "x");
    if (len > 0) add_probe(probes, n, pattern, len - 1, "");
    if (len > 0 && pattern[len - 1] == '*') {
        add_probe(probes, n, pattern, len - 1, "-a");
        if (len > 1) add_probe(probes, n, pattern, len - 2, "");
    }
}

/* true when KEY is the key of an entry of KEYS */
static bool in_file(json_t *keys, const char *key) {
    size_t i;
    json_t *e;
    json_array_foreach(keys, i, e) {
        json_t *k = json_object_get(e, "key");
        if (json_is_string(k) && !strcmp(json_string_value(k), key)) return true;
    }
    return false;
}

static void check_ring(keyring_t *ring, const char *text) {
    /* the parser read TEXT with these flags: what it accepted parses again */
    json_t *root = json_loads(text, JSON_REJECT_DUPLICATES, NULL);
    FUZZ_CHECK(root, "an accepted key file is not JSON");
    json_t *keys = json_object_get(root, "keys");
    FUZZ_CHECK(json_is_object(root) && json_is_array(keys), "an accepted key file without a keys array");
    int n = keyring_count(ring);
    FUZZ_CHECK(n >= 1, "an accepted ring with %d keys", n);
    FUZZ_CHECK((size_t)n == json_array_size(keys), "%d keys in the ring, %zu in the file", n, json_array_size(keys));
    FUZZ_CHECK(!keyring_open(ring), "an accepted key file makes an open ring");

    /* the probe names: from every pattern in the file (bounded) and a few fixed ones */
    char *probes[MAX_PROBES];
    int n_probes = 0;
    add_probe(probes, &n_probes, "", 0, "");
    add_probe(probes, &n_probes, "acme", 4, "");
    size_t i, j;
    json_t *e, *p;
    json_array_foreach(keys, i, e) {
        json_array_foreach(json_object_get(e, "adapters"), j, p) {
            if (json_is_string(p)) probes_of(probes, &n_probes, json_string_value(p));
        }
    }

    json_array_foreach(keys, i, e) {
        json_t *kv = json_object_get(e, "key");
        FUZZ_CHECK(json_is_string(kv), "keys[%zu].key accepted but not a string", i);
        const char *key = json_string_value(kv);
        char *h = header("Bearer ", key, "");
        const key_grant_t *g = keyring_check(ring, h);
        free(h);
        FUZZ_CHECK(g, "keys[%zu]: its own key is not found", i);
        /* the scheme in any case, spaces after it skipped: the same grant */
        h = header("bEARER   ", key, "");
        FUZZ_CHECK(keyring_check(ring, h) == g, "keys[%zu]: 'bEARER   KEY' finds another grant", i);
        free(h);
        /* a key has no spaces, so one after it is another key (in the file or not) */
        h = header("Bearer ", key, " ");
        FUZZ_CHECK(!keyring_check(ring, h), "keys[%zu]: the key with a space after it is found", i);
        free(h);
        /* no Bearer scheme: nothing */
        h = header("Basic ", key, "");
        FUZZ_CHECK(!keyring_check(ring, h), "keys[%zu]: 'Basic KEY' is found", i);
        free(h);

        const char *role = json_string_value(json_object_get(e, "role"));
        FUZZ_CHECK(role && (!strcmp(role, "admin") || !strcmp(role, "tenant")), "keys[%zu].role accepted: '%s'", i,
                   role ? role : "(not a string)");
        bool admin = !strcmp(role, "admin");
        FUZZ_CHECK(g->role == (admin ? KEY_ADMIN : KEY_TENANT), "keys[%zu]: role %d for '%s'", i, (int)g->role, role);
        FUZZ_CHECK(key_is_admin(g) == admin, "keys[%zu]: key_is_admin is %d for '%s'", i, key_is_admin(g), role);

        /* the name: as written, or "key N" */
        json_t *nv = json_object_get(e, "name");
        char def[32];
        snprintf(def, sizeof def, "key %zu", i);
        const char *want = json_is_string(nv) ? json_string_value(nv) : def;
        FUZZ_CHECK(g->name && !strcmp(g->name, want), "keys[%zu]: the grant's name is '%s', not '%s'", i,
                   g->name ? g->name : "(null)", want);

        if (admin) {
            FUZZ_CHECK(g->n_patterns == 0 && !g->push && !g->base, "keys[%zu]: an admin with tenant fields", i);
            for (int k = 0; k < n_probes; k++)
                FUZZ_CHECK(key_may_use(g, probes[k]), "keys[%zu]: the admin may not use '%s'", i, probes[k]);
            continue;
        }
        FUZZ_CHECK(g->push == flag_of(e, "push", false), "keys[%zu]: push %d", i, g->push);
        FUZZ_CHECK(g->base == flag_of(e, "base", false), "keys[%zu]: base %d", i, g->base);
        json_t *a = json_object_get(e, "adapters");
        size_t na = json_is_array(a) ? json_array_size(a) : 0;
        FUZZ_CHECK(json_is_array(a) || json_is_null(a) || !a, "keys[%zu].adapters accepted: not an array", i);
        FUZZ_CHECK(g->n_patterns >= 0 && (size_t)g->n_patterns == na, "keys[%zu]: %d patterns, %zu in the file", i,
                   g->n_patterns, na);
        for (size_t k = 0; k < na; k++) {
            const char *s = json_string_value(json_array_get(a, k));
            FUZZ_CHECK(s && s[0] && !strcmp(g->patterns[k], s), "keys[%zu].adapters[%zu]: '%s' kept as '%s'", i, k,
                       s ? s : "(not a string)", g->patterns[k]);
            const char *star = strchr(s, '*');
            FUZZ_CHECK(!star || !star[1], "keys[%zu].adapters[%zu]: '%s' accepted with '*' inside", i, k, s);
        }
        for (int k = 0; k < n_probes; k++) {
            bool want_use = ref_may_use(e, probes[k]);
            FUZZ_CHECK(key_may_use(g, probes[k]) == want_use, "keys[%zu]: key_may_use('%s') is %d, the reference %d", i,
                       probes[k], !want_use, want_use);
        }
        FUZZ_CHECK(!key_may_use(g, NULL), "keys[%zu]: key_may_use(NULL)", i);
    }

    /* keys that are not in the file, and headers without a key, find nothing */
    const char *first = json_string_value(json_object_get(json_array_get(keys, 0), "key"));
    char absent[64] = "sk-not-in-this-file-0";
    for (int t = 0; t < 8 && in_file(keys, absent); t++) snprintf(absent, sizeof absent, "sk-not-in-this-file-%d", t + 1);
    if (!in_file(keys, absent)) {
        char *h = header("Bearer ", absent, "");
        FUZZ_CHECK(!keyring_check(ring, h), "'%s', not in the file, is found", absent);
        free(h);
    }
    char *longer = header("", first, "x");
    if (!in_file(keys, longer)) {
        char *h = header("Bearer ", longer, "");
        FUZZ_CHECK(!keyring_check(ring, h), "keys[0] with one more byte, not in the file, is found");
        free(h);
    }
    free(longer);
    FUZZ_CHECK(!keyring_check(ring, NULL), "a NULL header finds a grant");
    FUZZ_CHECK(!keyring_check(ring, ""), "an empty header finds a grant");
    FUZZ_CHECK(!keyring_check(ring, "Bearer "), "'Bearer ' finds a grant");
    FUZZ_CHECK(!keyring_check(ring, first), "keys[0] without 'Bearer ' finds a grant");

    for (int k = 0; k < n_probes; k++) free(probes[k]);
    json_decref(root);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *text = fuzz_cstr(data, size); /* (keyring_parse reads up to the first NUL) */
    cs_error_clear();
    keyring_t *ring = keyring_parse(text);
    if (!ring) {
        FUZZ_CHECK(has_message(), "a refusal without a message");
        free(text);
        return 0;
    }
    fuzz_accepted++;
    check_ring(ring, text);
    /* a second reference: the ring lives until the last one goes (ASan: no leak, no use after free) */
    keyring_ref(ring);
    keyring_unref(ring);
    FUZZ_CHECK(keyring_count(ring) >= 1, "the ring changed after a ref/unref pair");
    keyring_unref(ring);
    free(text);
    return 0;
}
