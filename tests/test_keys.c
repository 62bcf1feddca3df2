/* test_keys.c: the keyring of server/keys.h. SHA-256 against the FIPS 180-2 / NIST
 * vectors; valid key files and every error with its message; adapter patterns (exact,
 * prefix, "*"); Bearer parsing; reference counting; --api-key rings; loading from a file. */
#include <check.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/common.h"
#include "server/keys.h"
#include "testutil.h"

/* S with every ' made ", so that key files read as JSON in the source (one at a time) */
static const char *dq(const char *s) {
    static char buf[4096];
    size_t n = strlen(s);
    ck_assert_uint_lt(n, sizeof buf);
    for (size_t i = 0; i <= n; i++) buf[i] = s[i] == '\'' ? '"' : s[i];
    return buf;
}

static void hex(const uint8_t d[32], char out[65]) {
    for (int i = 0; i < 32; i++) snprintf(out + 2 * i, 3, "%02x", d[i]);
}

static void expect_sha256(const void *data, size_t n, const char *want) {
    uint8_t d[32];
    char got[65];
    keys_sha256(data, n, d);
    hex(d, got);
    ck_assert_msg(!strcmp(got, want), "sha256 of %zu bytes: %s, want %s", n, got, want);
}

START_TEST(test_sha256_vectors) {
    expect_sha256("abc", 3, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    expect_sha256("", 0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    expect_sha256(NULL, 0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    /* 448 bits: the padding needs a second block */
    const char *m448 = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
    expect_sha256(m448, strlen(m448), "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
    const char *m896 = "abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopqrsmnopqrstnopqrstu";
    expect_sha256(m896, strlen(m896), "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
    /* one million 'a' */
    size_t n = 1000000;
    char *a = malloc(n);
    ck_assert_ptr_nonnull(a);
    memset(a, 'a', n);
    expect_sha256(a, n, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
    /* lengths around the block and padding boundaries (sha256sum's answers) */
    expect_sha256(a, 55, "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318");
    expect_sha256(a, 56, "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a");
    expect_sha256(a, 63, "7d3e74a05d7db15bce4ad9ec0658ea98e3f06eeecf16b4c6fff2da457ddc2f34");
    expect_sha256(a, 64, "ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb");
    free(a);
}
END_TEST

#define ADMIN_KEY "sk-admin-0123456789"
#define ACME_KEY "sk-acme-abcdefgh"
#define BOB_KEY "sk-bob-zyxwvuts"

static const char *const example =
    "{'keys': [{'key': '" ADMIN_KEY "', 'role': 'admin'},"
    " {'key': '" ACME_KEY "', 'role': 'tenant', 'adapters': ['acme-*', 'shared-summarizer'],"
    "  'push': true, 'base': false, 'name': 'acme'},"
    " {'key': '" BOB_KEY "', 'role': 'tenant', 'base': true, 'push': null}]}";

START_TEST(test_parse_valid) {
    keyring_t *r = keyring_parse(dq(example));
    ck_assert_msg(r, "%s", cs_error_last());
    ck_assert_int_eq(keyring_count(r), 3);
    ck_assert(!keyring_open(r));

    const key_grant_t *g = keyring_check(r, "Bearer " ADMIN_KEY);
    ck_assert_ptr_nonnull(g);
    ck_assert(key_is_admin(g));
    ck_assert_str_eq(g->name, "key 0");
    ck_assert_int_eq(g->n_patterns, 0);

    g = keyring_check(r, "Bearer " ACME_KEY);
    ck_assert_ptr_nonnull(g);
    ck_assert(!key_is_admin(g));
    ck_assert_int_eq(g->role, KEY_TENANT);
    ck_assert_str_eq(g->name, "acme");
    ck_assert(g->push);
    ck_assert(!g->base);
    ck_assert_int_eq(g->n_patterns, 2);
    ck_assert_str_eq(g->patterns[0], "acme-*");
    ck_assert_str_eq(g->patterns[1], "shared-summarizer");

    g = keyring_check(r, "Bearer " BOB_KEY);
    ck_assert_ptr_nonnull(g);
    ck_assert_str_eq(g->name, "key 2");
    ck_assert(!g->push); /* null: left out */
    ck_assert(g->base);
    ck_assert_int_eq(g->n_patterns, 0);
    ck_assert(!key_may_use(g, "acme-x"));
    keyring_unref(r);

    /* a tenant that may do nothing; an empty adapter list; an admin with nulls */
    r = keyring_parse(dq("{'keys': [{'key': 'nothing-at-all', 'role': 'tenant', 'adapters': []},"
                         " {'key': 'admin-with-nulls', 'role': 'admin', 'adapters': null, 'push': null}]}"));
    ck_assert_msg(r, "%s", cs_error_last());
    ck_assert_int_eq(keyring_count(r), 2);
    g = keyring_check(r, "Bearer nothing-at-all");
    ck_assert_ptr_nonnull(g);
    ck_assert(!g->push && !g->base && g->n_patterns == 0);
    ck_assert(!key_may_use(g, "anything"));
    ck_assert(key_is_admin(keyring_check(r, "Bearer admin-with-nulls")));
    keyring_unref(r);
}
END_TEST

/* TEXT (quotes as dq() takes them) is refused with a message containing WANT */
static void expect_error(const char *text, const char *want) {
    keyring_t *r = keyring_parse(dq(text));
    ck_assert_msg(!r, "accepted: %s", text);
    const char *got = cs_error_last();
    ck_assert_msg(strstr(got, want), "%s:\n got  '%s'\n want '%s'", text, got, want);
}

#define T0 "{'key': 'sk-tenant-0', 'role': 'tenant'"
#define T1 "{'key': 'sk-tenant-1', 'role': 'tenant'"
#define A0 "{'key': 'sk-admin-00', 'role': 'admin'"

START_TEST(test_errors) {
    static const struct {
        const char *text, *want;
    } cases[] = {
        {"not json", "not valid JSON"},
        {"[]", "expected a JSON object {\"keys\": [...]}, not an array"},
        {"{}", "keys: missing"},
        {"{'keys': null}", "keys: missing"},
        {"{'keys': {}}", "keys: expected an array, not an object"},
        {"{'keys': []}", "keys: empty"},
        {"{'keys': [" A0 "}], 'version': 1}", "version: unknown field"},
        {"{'keys': ['sk-aaaaaaaa']}", "keys[0]: expected an object, not a string"},
        {"{'keys': [" A0 "}, " T0 ", 'adaptors': ['x']}]}", "keys[1].adaptors: unknown field"},
        {"{'keys': [{'role': 'admin'}]}", "keys[0].key: missing"},
        {"{'keys': [{'key': null, 'role': 'admin'}]}", "keys[0].key: missing"},
        {"{'keys': [{'key': 12345678, 'role': 'admin'}]}", "keys[0].key: expected a string, not an integer"},
        {"{'keys': [{'key': '', 'role': 'admin'}]}", "keys[0].key: empty"},
        {"{'keys': [{'key': 'sk-1234', 'role': 'admin'}]}", "keys[0].key: shorter than 8 characters"},
        {"{'keys': [{'key': 'sk-has space', 'role': 'admin'}]}", "keys[0].key: a space, control or non-ASCII"},
        {"{'keys': [{'key': 'sk-tab\\there', 'role': 'admin'}]}", "keys[0].key: a space, control or non-ASCII"},
        {"{'keys': [{'key': 'sk-\\u00e9t\\u00e9-key', 'role': 'admin'}]}", "keys[0].key: a space, control or non-ASCII"},
        {"{'keys': [{'key': 'sk-nul\\u0000-key', 'role': 'admin'}]}", "\\u0000 is not allowed"},
        {"{'keys': [" A0 "}, " T0 "}, " T0 "}]}", "keys[2].key: the same key as keys[1]"},
        {"{'keys': [{'key': 'sk-admin-00'}]}", "keys[0].role: missing"},
        {"{'keys': [{'key': 'sk-admin-00', 'role': 'root'}]}", "keys[0].role: 'root': expected \"admin\" or \"tenant\""},
        {"{'keys': [{'key': 'sk-admin-00', 'role': 1}]}", "keys[0].role: expected a string, not an integer"},
        {"{'keys': [" A0 ", 'adapters': ['x']}]}", "keys[0].adapters: not for an admin key"},
        {"{'keys': [" A0 ", 'push': false}]}", "keys[0].push: not for an admin key"},
        {"{'keys': [" A0 ", 'base': true}]}", "keys[0].base: not for an admin key"},
        {"{'keys': [" A0 "}, " T0 ", 'push': 'yes'}]}", "keys[1].push: expected true or false, not a string"},
        {"{'keys': [" A0 "}, " T0 ", 'base': 1}]}", "keys[1].base: expected true or false, not an integer"},
        {"{'keys': [" T0 ", 'adapters': 'acme-*'}]}", "keys[0].adapters: expected an array of names, not a string"},
        {"{'keys': [" T0 ", 'adapters': ['ok', 3]}]}", "keys[0].adapters[1]: expected a string, not an integer"},
        {"{'keys': [" T0 ", 'adapters': ['ok', null]}]}", "keys[0].adapters[1]: expected a string, not null"},
        {"{'keys': [" T0 ", 'adapters': ['ok', '']}]}", "keys[0].adapters[1]: empty"},
        {"{'keys': [" T0 ", 'adapters': ['a*b']}]}", "keys[0].adapters[0]: '*' only at the end of a name"},
        {"{'keys': [" T0 ", 'adapters': ['**']}]}", "keys[0].adapters[0]: '*' only at the end of a name"},
        {"{'keys': [" A0 "}, " T0 "}, " T1 ", 'adapters': ['ok', '*-x']}]}",
         "keys[2].adapters[1]: '*' only at the end of a name"},
        {"{'keys': [" T0 ", 'adapters': ['ok\\u0000*']}]}", "\\u0000 is not allowed"},
        {"{'keys': [" A0 ", 'name': 5}]}", "keys[0].name: expected a string, not an integer"},
        {"{'keys': [" A0 ", 'name': ''}]}", "keys[0].name: empty"},
        {"{'keys': [" A0 ", 'role': 'tenant'}]}", "duplicate object key"},
    };
    for (size_t i = 0; i < CS_ARRAY_LEN(cases); i++) expect_error(cases[i].text, cases[i].want);

    /* a message never shows a key */
    keyring_t *r = keyring_parse(dq("{'keys': [" T0 "}, " T0 "}]}"));
    ck_assert_ptr_null(r);
    ck_assert_ptr_null(strstr(cs_error_last(), "sk-tenant-0"));
    r = keyring_parse(dq("{'keys': [{'key': 'sk-12', 'role': 'admin'}]}"));
    ck_assert_ptr_null(r);
    ck_assert_ptr_null(strstr(cs_error_last(), "sk-12"));
}
END_TEST

START_TEST(test_patterns) {
    keyring_t *r = keyring_parse(
        dq("{'keys': [{'key': 'sk-tenant-0', 'role': 'tenant', 'adapters': ['acme-*', 'shared-summarizer']},"
           " {'key': 'sk-tenant-1', 'role': 'tenant', 'adapters': ['*']}," A0 "}]}"));
    ck_assert_msg(r, "%s", cs_error_last());
    const key_grant_t *t = keyring_check(r, "Bearer sk-tenant-0");
    ck_assert_ptr_nonnull(t);
    ck_assert(key_may_use(t, "acme-summarizer"));
    ck_assert(key_may_use(t, "acme-"));              /* '*' may match nothing */
    ck_assert(key_may_use(t, "acme-a/b"));
    ck_assert(!key_may_use(t, "acme"));              /* the prefix is "acme-" */
    ck_assert(!key_may_use(t, "Acme-x"));            /* case matters */
    ck_assert(!key_may_use(t, "xacme-x"));
    ck_assert(key_may_use(t, "shared-summarizer"));  /* exact */
    ck_assert(!key_may_use(t, "shared-summarizer2"));
    ck_assert(!key_may_use(t, "shared-summarize"));
    ck_assert(!key_may_use(t, ""));
    ck_assert(!key_may_use(t, NULL));

    const key_grant_t *all = keyring_check(r, "Bearer sk-tenant-1");
    ck_assert_ptr_nonnull(all);
    ck_assert(!key_is_admin(all));
    ck_assert(key_may_use(all, "anything"));         /* "*" alone: every adapter */
    ck_assert(key_may_use(all, ""));

    const key_grant_t *admin = keyring_check(r, "Bearer sk-admin-00");
    ck_assert(key_is_admin(admin));
    ck_assert(key_may_use(admin, "whatever"));
    ck_assert(!key_may_use(NULL, "acme-x"));
    ck_assert(!key_is_admin(NULL));
    keyring_unref(r);
}
END_TEST

START_TEST(test_bearer) {
    keyring_t *r = keyring_parse(dq(example));
    ck_assert_msg(r, "%s", cs_error_last());
    const key_grant_t *acme = keyring_check(r, "Bearer " ACME_KEY);
    ck_assert_ptr_nonnull(acme);
    ck_assert_ptr_eq(keyring_check(r, "bearer " ACME_KEY), acme);     /* the scheme in any case */
    ck_assert_ptr_eq(keyring_check(r, "BEARER " ACME_KEY), acme);
    ck_assert_ptr_eq(keyring_check(r, "bEaReR    " ACME_KEY), acme);  /* spaces skipped */
    ck_assert_ptr_null(keyring_check(r, ACME_KEY));                    /* no scheme */
    ck_assert_ptr_null(keyring_check(r, "Basic " ACME_KEY));
    ck_assert_ptr_null(keyring_check(r, "Bearer" ACME_KEY));
    ck_assert_ptr_null(keyring_check(r, "Bearer"));
    ck_assert_ptr_null(keyring_check(r, "Bearer "));
    ck_assert_ptr_null(keyring_check(r, ""));
    ck_assert_ptr_null(keyring_check(r, NULL));
    ck_assert_ptr_null(keyring_check(r, "Bearer sk-acme-abcdefgX"));   /* wrong key */
    ck_assert_ptr_null(keyring_check(r, "Bearer " ACME_KEY "x"));
    ck_assert_ptr_null(keyring_check(r, "Bearer sk-acme-abcdefg"));
    ck_assert_ptr_null(keyring_check(r, "Bearer SK-ACME-ABCDEFGH"));   /* keys are case-sensitive */
    ck_assert_ptr_null(keyring_check(r, "Bearer " ACME_KEY " "));
    keyring_unref(r);
}
END_TEST

struct ref_arg {
    keyring_t *r;
    int ok;
};

static void *ref_thread(void *p) {
    struct ref_arg *a = p;
    for (int i = 0; i < 100000; i++) {
        keyring_ref(a->r);
        a->ok += keyring_check(a->r, "Bearer " BOB_KEY) != NULL;
        keyring_unref(a->r);
    }
    return NULL;
}

START_TEST(test_refcount) {
    keyring_ref(NULL);
    keyring_unref(NULL);
    keyring_t *r = keyring_parse(dq(example));
    ck_assert_msg(r, "%s", cs_error_last());
    keyring_ref(r);
    keyring_ref(r);
    keyring_unref(r);
    keyring_unref(r);
    /* still alive: one reference left */
    ck_assert_ptr_nonnull(keyring_check(r, "Bearer " ADMIN_KEY));

    /* references taken and dropped on several threads at once */
    pthread_t th[4];
    struct ref_arg args[4];
    for (int i = 0; i < 4; i++) {
        args[i] = (struct ref_arg){r, 0};
        ck_assert_int_eq(pthread_create(&th[i], NULL, ref_thread, &args[i]), 0);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        ck_assert_int_eq(args[i].ok, 100000);
    }
    ck_assert_int_eq(keyring_count(r), 3);
    keyring_unref(r); /* the last: frees (ASan's leak check sees it) */
}
END_TEST

START_TEST(test_single) {
    keyring_t *r = keyring_single("secret");  /* --api-key takes short keys too */
    ck_assert_ptr_nonnull(r);
    ck_assert(!keyring_open(r));
    ck_assert_int_eq(keyring_count(r), 1);
    const key_grant_t *g = keyring_check(r, "Bearer secret");
    ck_assert_ptr_nonnull(g);
    ck_assert(key_is_admin(g));
    ck_assert_str_eq(g->name, "--api-key");
    ck_assert_ptr_null(keyring_check(r, "Bearer secreT"));
    ck_assert_ptr_null(keyring_check(r, "Bearer secret2"));
    ck_assert_ptr_null(keyring_check(r, NULL));
    keyring_unref(r);

    /* no key: open, everyone is admin whatever they send */
    const char *none[] = {NULL, ""};
    for (int i = 0; i < 2; i++) {
        r = keyring_single(none[i]);
        ck_assert_ptr_nonnull(r);
        ck_assert(keyring_open(r));
        ck_assert_int_eq(keyring_count(r), 0);
        const char *headers[] = {NULL, "", "Bearer anything", "Basic x"};
        for (size_t k = 0; k < CS_ARRAY_LEN(headers); k++) {
            g = keyring_check(r, headers[k]);
            ck_assert_ptr_nonnull(g);
            ck_assert(key_is_admin(g));
            ck_assert(key_may_use(g, "any-adapter"));
        }
        keyring_unref(r);
    }
}
END_TEST

static void write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    ck_assert_int_eq(fputs(text, f) >= 0, 1);
    ck_assert_int_eq(fclose(f), 0);
}

START_TEST(test_load) {
    char dir[256], path[512];
    cs_test_mkdtemp(dir, sizeof dir, "keys");
    snprintf(path, sizeof path, "%s/keys.json", dir);

    write_file(path, dq(example));
    keyring_t *r = keyring_load(path);
    ck_assert_msg(r, "%s", cs_error_last());
    ck_assert_int_eq(keyring_count(r), 3);
    ck_assert_str_eq(keyring_check(r, "Bearer " ACME_KEY)->name, "acme");
    keyring_unref(r);

    /* an error in the file: the message starts with its path */
    write_file(path, dq("{'keys': [" T0 ", 'adapters': ['a*b']}]}"));
    ck_assert_ptr_null(keyring_load(path));
    char want[640];
    snprintf(want, sizeof want, "%s: keys[0].adapters[0]: '*' only at the end of a name", path);
    ck_assert_str_eq(cs_error_last(), want);

    /* not JSON, or cut short */
    write_file(path, "{\"keys\": [");
    ck_assert_ptr_null(keyring_load(path));
    ck_assert_msg(strstr(cs_error_last(), path) && strstr(cs_error_last(), "not valid JSON"), "%s", cs_error_last());

    /* a missing file: the message names it */
    snprintf(path, sizeof path, "%s/missing.json", dir);
    ck_assert_ptr_null(keyring_load(path));
    ck_assert_msg(strstr(cs_error_last(), path), "%s", cs_error_last());
    ck_assert_int_eq(cs_rmtree(dir), 0);
}
END_TEST

int main(void) {
    const TTest *const tests[] = {
        test_sha256_vectors, test_parse_valid, test_errors, test_patterns,
        test_bearer, test_refcount, test_single, test_load,
    };
    return cs_check_main("keys", tests, CS_ARRAY_LEN(tests), 0, CK_FORK);
}
