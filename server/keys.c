/* keys.c: the keyring of keys.h. A ring is two arrays in key file order, the SHA-256
 * digests of the keys and their grants; checking a key hashes it and compares the digest
 * with every stored one, so neither the time nor the memory touched depends on which key
 * matched. SHA-256 is the plain FIPS 180-4 one below (the only hash the server needs). */
#include "server/keys.h"

#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "base/common.h"

#define KEY_MIN_LEN 8

struct keyring {
    int refs;               /* atomic */
    int n;                  /* keys; 0: open (everyone is admin) */
    uint8_t (*digest)[32];  /* (n, 32) SHA-256 of each key */
    key_grant_t *grant;     /* (n) */
};

static char open_name[] = "anyone (no API key)";
static const key_grant_t open_grant = {.role = KEY_ADMIN, .name = open_name};

/* ---- SHA-256 (FIPS 180-4, section 6.2) ---- */
static const uint32_t sha256_k[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

static uint32_t ror32(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

/* H updated with the 64-byte block P */
static void sha256_block(uint32_t h[8], const uint8_t *p) {
    uint32_t w[64];
    for (int i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = ror32(w[i - 15], 7) ^ ror32(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ror32(w[i - 2], 17) ^ ror32(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = hh + (ror32(e, 6) ^ ror32(e, 11) ^ ror32(e, 25)) + ((e & f) ^ (~e & g)) + sha256_k[i] + w[i];
        uint32_t t2 = (ror32(a, 2) ^ ror32(a, 13) ^ ror32(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        hh = g;
        g = f;
        f = e;
        e = d + t1;
        d = c;
        c = b;
        b = a;
        a = t1 + t2;
    }
    h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += hh;
}

void keys_sha256(const void *data, size_t n, uint8_t out[32]) {
    uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    const uint8_t *p = data;
    size_t left = n;
    for (; left >= 64; p += 64, left -= 64) sha256_block(h, p);
    /* the padding: 0x80, zeros, the length in bits (big-endian) at the end of the last block */
    uint8_t tail[128] = {0};
    if (left) memcpy(tail, p, left);
    tail[left] = 0x80;
    size_t tn = left + 9 <= 64 ? 64 : 128;
    uint64_t bits = (uint64_t)n * 8;
    for (int i = 0; i < 8; i++) tail[tn - 1 - i] = (uint8_t)(bits >> (8 * i));
    for (size_t i = 0; i < tn; i += 64) sha256_block(h, tail + i);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(h[i] >> 24);
        out[4 * i + 1] = (uint8_t)(h[i] >> 16);
        out[4 * i + 2] = (uint8_t)(h[i] >> 8);
        out[4 * i + 3] = (uint8_t)h[i];
    }
}

/* ---- rings ---- */
static void ring_free(keyring_t *r) {
    if (!r) return;
    for (int i = 0; r->grant && i < r->n; i++) {
        for (int j = 0; j < r->grant[i].n_patterns; j++) free(r->grant[i].patterns[j]);
        free(r->grant[i].patterns);
        free(r->grant[i].name);
    }
    free(r->grant);
    free(r->digest);
    free(r);
}

/* Records a load error: STATUS with the message FMT, after "LABEL: " when there is a label
 * (the file's path); returns STATUS. */
__attribute__((format(printf, 3, 4))) static int fail(const char *label, int status, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return cs_error_set(status, "%s%s%s", label ? label : "", label ? ": " : "", msg);
}

static const char *const entry_fields[] = {"key", "role", "adapters", "push", "base", "name"};

/* *OUT from keys[I].FIELD of the entry E when it is there (else left as it is) */
static int get_flag(const char *label, json_t *e, int i, const char *field, bool *out) {
    json_t *v = cs_json_get(e, field);
    if (!v) return CS_OK;
    if (!json_is_boolean(v))
        return fail(label, CS_EFORMAT, "keys[%d].%s: expected true or false, not %s", i, field, cs_json_type_name(v));
    *out = json_is_true(v);
    return CS_OK;
}

/* *G and DIGEST from keys[I], the entry E */
static int parse_entry(const char *label, json_t *e, int i, key_grant_t *g, uint8_t digest[32]) {
    if (!json_is_object(e)) return fail(label, CS_EFORMAT, "keys[%d]: expected an object, not %s", i, cs_json_type_name(e));
    const char *field;
    json_t *v;
    json_object_foreach(e, field, v) {
        size_t k = 0;
        while (k < CS_ARRAY_LEN(entry_fields) && strcmp(field, entry_fields[k])) k++;
        if (k == CS_ARRAY_LEN(entry_fields))
            return fail(label, CS_EFORMAT, "keys[%d].%s: unknown field (known: key, role, adapters, push, base, name)", i,
                        field);
    }

    /* the key itself: hashed, never kept (and never put in a message) */
    if (!(v = cs_json_get(e, "key"))) return fail(label, CS_EFORMAT, "keys[%d].key: missing", i);
    if (!json_is_string(v))
        return fail(label, CS_EFORMAT, "keys[%d].key: expected a string, not %s", i, cs_json_type_name(v));
    const char *key = json_string_value(v);
    size_t len = json_string_length(v);
    if (len == 0) return fail(label, CS_EFORMAT, "keys[%d].key: empty", i);
    if (len < KEY_MIN_LEN) return fail(label, CS_EFORMAT, "keys[%d].key: shorter than %d characters", i, KEY_MIN_LEN);
    for (size_t k = 0; k < len; k++)
        if ((unsigned char)key[k] < 0x21 || (unsigned char)key[k] > 0x7e)
            return fail(label, CS_EFORMAT,
                        "keys[%d].key: a space, control or non-ASCII character (a Bearer token is visible ASCII)", i);
    keys_sha256(key, len, digest);

    if (!(v = cs_json_get(e, "role"))) return fail(label, CS_EFORMAT, "keys[%d].role: missing (\"admin\" or \"tenant\")", i);
    if (!json_is_string(v))
        return fail(label, CS_EFORMAT, "keys[%d].role: expected a string, not %s", i, cs_json_type_name(v));
    if (!strcmp(json_string_value(v), "admin")) g->role = KEY_ADMIN;
    else if (!strcmp(json_string_value(v), "tenant")) g->role = KEY_TENANT;
    else return fail(label, CS_EFORMAT, "keys[%d].role: '%s': expected \"admin\" or \"tenant\"", i, json_string_value(v));

    if ((v = cs_json_get(e, "name"))) {
        if (!json_is_string(v))
            return fail(label, CS_EFORMAT, "keys[%d].name: expected a string, not %s", i, cs_json_type_name(v));
        if (!json_string_value(v)[0]) return fail(label, CS_EFORMAT, "keys[%d].name: empty", i);
        g->name = strdup(json_string_value(v));
    } else {
        char buf[32];
        snprintf(buf, sizeof buf, "key %d", i);
        g->name = strdup(buf);
    }
    if (!g->name) return fail(label, CS_ENOMEM, "out of memory");

    static const char *const tenant_fields[] = {"adapters", "push", "base"};
    if (g->role == KEY_ADMIN) {
        for (size_t k = 0; k < CS_ARRAY_LEN(tenant_fields); k++)
            if (cs_json_get(e, tenant_fields[k]))
                return fail(label, CS_EFORMAT, "keys[%d].%s: not for an admin key (it may do everything)", i,
                            tenant_fields[k]);
        return CS_OK;
    }
    int rc;
    if ((rc = get_flag(label, e, i, "push", &g->push)) || (rc = get_flag(label, e, i, "base", &g->base))) return rc;
    if (!(v = cs_json_get(e, "adapters"))) return CS_OK;
    if (!json_is_array(v))
        return fail(label, CS_EFORMAT, "keys[%d].adapters: expected an array of names, not %s", i, cs_json_type_name(v));
    size_t n = json_array_size(v);
    if (n > 1u << 20) return fail(label, CS_EFORMAT, "keys[%d].adapters: more than %u names", i, 1u << 20);
    if (!(g->patterns = calloc(n ? n : 1, sizeof *g->patterns))) return fail(label, CS_ENOMEM, "out of memory");
    for (size_t j = 0; j < n; j++) {
        json_t *p = json_array_get(v, j);
        if (!json_is_string(p))
            return fail(label, CS_EFORMAT, "keys[%d].adapters[%zu]: expected a string, not %s", i, j, cs_json_type_name(p));
        const char *s = json_string_value(p);
        if (!s[0]) return fail(label, CS_EFORMAT, "keys[%d].adapters[%zu]: empty", i, j);
        const char *star = strchr(s, '*');
        if (star && star[1]) return fail(label, CS_EFORMAT, "keys[%d].adapters[%zu]: '*' only at the end of a name", i, j);
        if (!(g->patterns[j] = strdup(s))) return fail(label, CS_ENOMEM, "out of memory");
        g->n_patterns++;
    }
    return CS_OK;
}

/* the ring of the key file TEXT[0..len); LABEL (the path, or NULL) starts every message */
static keyring_t *parse_ring(const char *label, const char *text, size_t len) {
    keyring_t *r = NULL;
    json_error_t je;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);  /* a \u0000 in a string is refused too */
    if (!root) {
        fail(label, CS_EFORMAT, "not valid JSON: %s (line %d)", je.text, je.line);
        goto err;
    }
    if (!json_is_object(root)) {
        fail(label, CS_EFORMAT, "expected a JSON object {\"keys\": [...]}, not %s", cs_json_type_name(root));
        goto err;
    }
    const char *field;
    json_t *v;
    json_object_foreach(root, field, v) {
        if (strcmp(field, "keys")) {
            fail(label, CS_EFORMAT, "%s: unknown field (a key file has only \"keys\")", field);
            goto err;
        }
    }
    json_t *keys = cs_json_get(root, "keys");
    if (!keys) {
        fail(label, CS_EFORMAT, "keys: missing");
        goto err;
    }
    if (!json_is_array(keys)) {
        fail(label, CS_EFORMAT, "keys: expected an array, not %s", cs_json_type_name(keys));
        goto err;
    }
    size_t n = json_array_size(keys);
    if (n == 0) {
        /* an empty list would read as "open" to keyring_open(): refuse it instead */
        fail(label, CS_EFORMAT, "keys: empty (to let everyone in, give no key file)");
        goto err;
    }
    if (n > 1u << 20) {
        fail(label, CS_EFORMAT, "keys: more than %u keys", 1u << 20);
        goto err;
    }
    if (!(r = calloc(1, sizeof *r)) || !(r->digest = calloc(n, sizeof *r->digest)) ||
        !(r->grant = calloc(n, sizeof *r->grant))) {
        fail(label, CS_ENOMEM, "out of memory");
        goto err;
    }
    r->n = (int)n;
    for (int i = 0; i < r->n; i++) {
        if (parse_entry(label, json_array_get(keys, (size_t)i), i, &r->grant[i], r->digest[i])) goto err;
        for (int j = 0; j < i; j++)
            if (!memcmp(r->digest[i], r->digest[j], sizeof r->digest[i])) {
                fail(label, CS_EFORMAT, "keys[%d].key: the same key as keys[%d]", i, j);
                goto err;
            }
    }
    json_decref(root);
    r->refs = 1;
    return r;
err:
    json_decref(root);
    ring_free(r);
    return NULL;
}

keyring_t *keyring_load(const char *path) {
    CS_ASSERT(path);
    size_t len;
    char *text = cs_read_file(path, &len);  /* its message starts with the path */
    if (!text) return NULL;
    keyring_t *r = parse_ring(path, text, len);
    free(text);
    return r;
}

keyring_t *keyring_parse(const char *json_text) {
    CS_ASSERT(json_text);
    return parse_ring(NULL, json_text, strlen(json_text));
}

keyring_t *keyring_single(const char *admin_key) {
    keyring_t *r = calloc(1, sizeof *r);
    if (!r) goto oom;
    r->refs = 1;
    if (!admin_key || !admin_key[0]) return r;
    if (!(r->digest = calloc(1, sizeof *r->digest)) || !(r->grant = calloc(1, sizeof *r->grant))) goto oom;
    r->n = 1;
    keys_sha256(admin_key, strlen(admin_key), r->digest[0]);
    r->grant[0].role = KEY_ADMIN;
    if (!(r->grant[0].name = strdup("--api-key"))) goto oom;
    return r;
oom:
    ring_free(r);
    cs_error_set(CS_ENOMEM, "out of memory");
    return NULL;
}

bool keyring_open(const keyring_t *r) {
    CS_ASSERT(r);
    return r->n == 0;
}

int keyring_count(const keyring_t *r) {
    CS_ASSERT(r);
    return r->n;
}

bool keyring_has_tenants(const keyring_t *r) {
    for (int i = 0; r && i < r->n; i++)
        if (r->grant[i].role == KEY_TENANT) return true;
    return false;
}

void keyring_ref(keyring_t *r) {
    if (!r) return;
    int before = __atomic_fetch_add(&r->refs, 1, __ATOMIC_RELAXED);
    CS_ASSERT(before > 0);
}

void keyring_unref(keyring_t *r) {
    if (!r) return;
    int after = __atomic_sub_fetch(&r->refs, 1, __ATOMIC_ACQ_REL);
    CS_ASSERT(after >= 0);
    if (after == 0) ring_free(r);
}

/* the key of a "Bearer KEY" header value, NULL without one */
static const char *bearer_key(const char *h) {
    if (!h || strncasecmp(h, "Bearer ", 7) != 0) return NULL;
    h += 7;
    while (*h == ' ') h++;
    return h;
}

const key_grant_t *keyring_check(const keyring_t *r, const char *authorization) {
    CS_ASSERT(r);
    if (r->n == 0) return &open_grant;
    const char *key = bearer_key(authorization);
    if (!key) return NULL;
    uint8_t d[32];
    keys_sha256(key, strlen(key), d);
    /* every digest compared in full; the match (digests are distinct: at most one) is
     * selected with masks, not branches */
    uint32_t found = 0;  /* its index + 1 */
    for (int i = 0; i < r->n; i++) {
        uint32_t diff = 0;
        for (int j = 0; j < 32; j++) diff |= (uint32_t)(r->digest[i][j] ^ d[j]);
        uint32_t eq = (diff - 1) >> 31;  /* 1 exactly when diff == 0 (diff <= 255) */
        found |= (0u - eq) & (uint32_t)(i + 1);
    }
    return found ? &r->grant[found - 1] : NULL;
}

bool key_may_use(const key_grant_t *g, const char *adapter) {
    if (!g || !adapter) return false;
    if (g->role == KEY_ADMIN) return true;
    for (int i = 0; i < g->n_patterns; i++) {
        const char *p = g->patterns[i];
        size_t n = strlen(p);
        if (p[n - 1] == '*' ? !strncmp(adapter, p, n - 1) : !strcmp(adapter, p)) return true;
    }
    return false;
}

bool key_is_admin(const key_grant_t *g) { return g && g->role == KEY_ADMIN; }
