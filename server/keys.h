/* keys.h: per-tenant API keys. A keyring maps each key the server accepts to a grant: an
 * admin key may do everything, a tenant key may use the adapters its patterns name (and
 * push versions of them, and use the base model, when allowed). The ring is read from a key
 * file that tools write, or made from the one --api-key; it keeps only the SHA-256 digests
 * of the keys, and finding a key costs the same whichever key (if any) matches.
 *
 * The key file (JSON):
 *   {"keys": [{"key": "sk-...", "role": "admin"},
 *             {"key": "...", "role": "tenant", "adapters": ["acme-*", "shared-summarizer"],
 *              "push": true, "base": false, "name": "acme"}]}
 *   key       required: at least 8 visible ASCII characters (no spaces), each key once
 *   role      required: "admin" (everything) or "tenant"
 *   adapters  tenant: adapter names, or prefixes "name-*" ('*' only as the last character;
 *             "*" alone is every adapter); default none
 *   push      tenant: may push and delete versions of its adapters; default false
 *   base      tenant: may use the base model without an adapter; default false
 *   name      a label for logs; default "key N" (N the entry's index)
 * A field set to null counts as left out. Anything else is an error whose message names the
 * entry and field ("keys[2].adapters[1]: '*' only at the end of a name"): an unknown field,
 * a field of the wrong type, adapters/push/base on an admin key, a file without keys. A
 * tenant without adapters or base is valid (it may do nothing). */
#ifndef CS_SERVER_KEYS_H
#define CS_SERVER_KEYS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum { KEY_ADMIN, KEY_TENANT } key_role_t;

/* What one key may do. Owned by its ring. */
typedef struct key_grant {
    key_role_t role;
    bool push, base;        /* tenant: push/delete versions of its adapters; use the base model */
    int n_patterns;
    char **patterns;        /* (n_patterns) "name" exact or "prefix*" */
    char *name;             /* for logs */
} key_grant_t;

/* Immutable once made; reference counted (atomically), so a reload can swap rings while
 * requests still check against the old one. */
typedef struct keyring keyring_t;

/* A ring with one reference, or NULL with cs_error_last() set: the message says why
 * (keyring_load's starts with the path). */
keyring_t *keyring_load(const char *path);
keyring_t *keyring_parse(const char *json_text);
/* One admin key (--api-key), any non-empty string; NULL or "": an open ring, which lets
 * everyone in as admin. NULL only when out of memory. */
keyring_t *keyring_single(const char *admin_key);

bool keyring_open(const keyring_t *r);          /* true when it admits anyone (no keys) */
void keyring_ref(keyring_t *r);                 /* NULL-safe */
void keyring_unref(keyring_t *r);               /* NULL-safe; the last one frees the ring */
int keyring_count(const keyring_t *r);          /* the keys; 0 for an open ring */
/* some key is a tenant's: then the routes open to anyone without tenants (/metrics, whose
 * adapter labels name tenants' adapters) need an admin key */
bool keyring_has_tenants(const keyring_t *r);

/* The grant of the key in an Authorization header value ("Bearer KEY", the scheme in any
 * case, spaces after it skipped); NULL when the header (may be NULL) has no Bearer key or
 * the key is unknown. For an open ring: a static admin grant, whatever the header. The time
 * it takes does not depend on which key matched: the SHA-256 digest of the presented key is
 * compared with every stored digest, with no early exit. The grant is valid as long as the
 * caller holds a reference to R. */
const key_grant_t *keyring_check(const keyring_t *r, const char *authorization);

/* admin: true; tenant: one of its patterns matches ADAPTER (exactly, or "prefix*" by
 * prefix: "acme-*" matches "acme-x" but not "acme"); NULL G or ADAPTER: false */
bool key_may_use(const key_grant_t *g, const char *adapter);
bool key_is_admin(const key_grant_t *g);        /* NULL: false */

/* The SHA-256 digest (FIPS 180-4) of data[0..n); exported for its test vectors. */
void keys_sha256(const void *data, size_t n, uint8_t out[32]);

#endif
