/* test_stop.c: the stop-string matcher against a byte-by-byte reference. Every way of
 * splitting several texts into one, two or byte-sized deltas must emit the same text and
 * report the same stop; the held-back text is exactly the longest suffix that is a proper
 * prefix of a stop; overlapping stops, a stop that is a prefix of another, a stop at the
 * very start, multibyte UTF-8, flush, and the validation of the strings. */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "text/stop.h"
#include "testutil.h"

/* Reference: read the text byte by byte; the first end position where some stop ends wins
 * (the longest one there, then the lowest index). Returns the emitted length; *stop the
 * index or -1. */
static size_t ref_stop(const char *const *stops, int n, const char *text, size_t len, int *stop) {
    for (size_t e = 1; e <= len; e++) {
        int best = -1;
        for (int i = 0; i < n; i++) {
            size_t l = strlen(stops[i]);
            if (l <= e && memcmp(text + e - l, stops[i], l) == 0 && (best < 0 || l > strlen(stops[best])))
                best = i;
        }
        if (best >= 0) {
            *stop = best;
            return e - strlen(stops[best]);
        }
    }
    *stop = -1;
    return len;
}

/* Reference held-back length after seeing text[0..len) without a match. */
static size_t ref_held(const char *const *stops, int n, const char *text, size_t len) {
    for (size_t h = len; h > 0; h--)
        for (int i = 0; i < n; i++)
            if (strlen(stops[i]) > h && memcmp(stops[i], text + len - h, h) == 0) return h;
    return 0;
}

/* Feeds text split at the given cut positions; checks the result against the reference. */
static void check_split(const char *const *stops, int n, const char *text, const size_t *cuts, int ncuts) {
    size_t len = strlen(text), pos = 0;
    int want_stop;
    size_t want_len = ref_stop(stops, n, text, len, &want_stop);
    stop_matcher_t *m = stop_matcher_new(stops, n);
    ck_assert_ptr_nonnull(m);
    char out[1024];
    size_t olen = 0;
    int got_stop = -1;
    for (int c = 0; c <= ncuts; c++) {
        size_t end = c < ncuts ? cuts[c] : len;
        stop_result_t r;
        int rc = stop_matcher_feed(m, text + pos, end - pos, &r);
        ck_assert_int_ge(rc, 0);
        ck_assert_uint_le(olen + r.len, sizeof out);
        memcpy(out + olen, r.text, r.len);
        olen += r.len;
        /* never emits what the final answer does not have */
        ck_assert_uint_le(olen, want_len);
        ck_assert(memcmp(out, text, olen) == 0);
        pos = end;
        if (rc == 1) {
            got_stop = r.stop;
            break;
        }
        /* everything that cannot start a stop has been released */
        ck_assert_uint_eq(stop_matcher_held(m), ref_held(stops, n, text, pos));
        ck_assert_uint_eq(olen + stop_matcher_held(m), pos);
    }
    stop_result_t r;
    int rc = stop_matcher_flush(m, &r);
    ck_assert_int_eq(rc, got_stop >= 0);
    memcpy(out + olen, r.text, r.len);
    olen += r.len;
    ck_assert_msg(olen == want_len && memcmp(out, text, olen) == 0, "text '%s': emitted %zu bytes, want %zu",
                  text, olen, want_len);
    ck_assert_int_eq(got_stop, want_stop);
    stop_matcher_free(m);
}

/* every one- and two-cut split, and byte by byte */
static void check_all_splits(const char *const *stops, int n, const char *text) {
    size_t len = strlen(text);
    check_split(stops, n, text, NULL, 0);
    for (size_t a = 0; a <= len; a++) {
        check_split(stops, n, text, &a, 1);
        for (size_t b = a; b <= len; b++) check_split(stops, n, text, (size_t[]){a, b}, 2);
    }
    size_t cuts[256];
    for (size_t i = 0; i < len; i++) cuts[i] = i + 1;
    check_split(stops, n, text, cuts, (int)len);
}

START_TEST(test_basic_cross_boundary) {
    const char *s1[] = {"\n\n"};
    check_all_splits(s1, 1, "hello\nworld\n\nbye");
    check_all_splits(s1, 1, "no double newline\n");
    const char *s2[] = {"END"};
    check_all_splits(s2, 1, "the EN EE ENDING");
    check_all_splits(s2, 1, "ENEND");
    check_all_splits(s2, 1, "E");
    const char *s3[] = {"aab"};
    check_all_splits(s3, 1, "aaaab");
    check_all_splits(s3, 1, "aaaa");
}
END_TEST

START_TEST(test_overlapping_and_prefix) {
    const char *ov[] = {"abc", "bcd"};
    check_all_splits(ov, 2, "xxabcd");
    check_all_splits(ov, 2, "xxbcd");
    const char *pre[] = {"abc", "ab"};  /* "ab" ends first */
    check_all_splits(pre, 2, "zzabc");
    const char *inner[] = {"abcd", "bc"};
    check_all_splits(inner, 2, "abcd");
    const char *same_end[] = {"c", "abc"}; /* same end: the longer one */
    check_all_splits(same_end, 2, "xabc");
    int stop;
    ck_assert_uint_eq(ref_stop(same_end, 2, "xabc", 4, &stop), 1);
    ck_assert_int_eq(stop, 1);
    const char *many[] = {"</s>", "<|im_end|>", "\nUser:", "###", "Observation"};
    check_all_splits(many, 5, "answer: 42<|im_e");
    check_all_splits(many, 5, "step ## one\nUser said <|im_end|> more");
    check_all_splits(many, 5, "Observ Observation");
}
END_TEST

/* feeds DELTA (its strlen bytes) to M: the call must return RC and release LEN bytes */
static stop_result_t feed(stop_matcher_t *m, const char *delta, int rc, size_t len) {
    stop_result_t r;
    int got = stop_matcher_feed(m, delta, strlen(delta), &r);
    ck_assert_msg(got == rc && r.len == len, "feeding [%s]: %d releasing %zu bytes, want %d releasing %zu", delta, got,
                  r.len, rc, len);
    return r;
}

/* flushes M: the call must return RC and release LEN bytes */
static stop_result_t flush(stop_matcher_t *m, int rc, size_t len) {
    stop_result_t r;
    int got = stop_matcher_flush(m, &r);
    ck_assert_msg(got == rc && r.len == len, "flush: %d releasing %zu bytes, want %d releasing %zu", got, r.len, rc, len);
    return r;
}

START_TEST(test_stop_at_start) {
    const char *s[] = {"STOP"};
    check_all_splits(s, 1, "STOP and more");
    stop_matcher_t *m = stop_matcher_new(s, 1);
    ck_assert_int_eq(feed(m, "STOP", 1, 0).stop, 0);
    /* after a match: nothing more, ever */
    feed(m, "xyz", 1, 0);
    flush(m, 1, 0);
    stop_matcher_free(m);
}
END_TEST

START_TEST(test_utf8) {
    const char *s[] = {"。", "é!", "😀"};
    check_all_splits(s, 3, "你好。世界");
    check_all_splits(s, 3, "café!x");
    check_all_splits(s, 3, "caféé smile 😀 done");
    check_all_splits(s, 3, "no stop: é é ü");
    /* deltas that are whole characters: the release point is a character boundary */
    stop_matcher_t *m = stop_matcher_new(s, 3);
    feed(m, "caf", 0, 3);
    feed(m, "é", 0, 0); /* "é" may start "é!" */
    stop_result_t r = feed(m, "?", 0, 3);
    ck_assert(memcmp(r.text, "é?", 3) == 0);
    stop_matcher_free(m);
}
END_TEST

START_TEST(test_flush) {
    const char *s[] = {"END"};
    stop_matcher_t *m = stop_matcher_new(s, 1);
    stop_result_t r = feed(m, "hello E", 0, 6);
    ck_assert(memcmp(r.text, "hello ", 6) == 0);
    ck_assert_uint_eq(stop_matcher_held(m), 1);
    feed(m, "N", 0, 0);
    r = flush(m, 0, 2);
    ck_assert(memcmp(r.text, "EN", 2) == 0);
    ck_assert_int_eq(r.stop, -1);
    ck_assert_uint_eq(stop_matcher_held(m), 0);
    stop_matcher_free(m);
    /* no stops: everything passes straight through, even an empty delta */
    m = stop_matcher_new(NULL, 0);
    feed(m, "", 0, 0);
    feed(m, "abc", 0, 3);
    flush(m, 0, 0);
    stop_matcher_free(m);
}
END_TEST

START_TEST(test_long_delta_and_max_len) {
    /* a 256-byte stop arriving one byte at a time inside a long text, and a big delta */
    char stop[STOP_MAX_LEN + 1], text[2048];
    for (int i = 0; i < STOP_MAX_LEN; i++) stop[i] = (char)('a' + i % 7);
    stop[STOP_MAX_LEN] = 0;
    memset(text, 'a', 600);
    memcpy(text + 600, stop, STOP_MAX_LEN);
    strcpy(text + 600 + STOP_MAX_LEN, "tail");
    const char *s[] = {stop, "zz"};
    size_t len = strlen(text), cuts[2048];
    for (size_t i = 0; i < len; i++) cuts[i] = i + 1;
    stop_matcher_t *m = stop_matcher_new(s, 2);
    ck_assert_ptr_nonnull(m);
    size_t emitted = 0, pos = 0;
    stop_result_t r;
    int rc = 0;
    for (size_t c = 0; c < len && rc == 0; c++) {
        rc = stop_matcher_feed(m, text + pos, cuts[c] - pos, &r);
        emitted += r.len;
        pos = cuts[c];
        ck_assert_uint_lt(stop_matcher_held(m), STOP_MAX_LEN);
    }
    ck_assert_int_eq(rc, 1);
    ck_assert_int_eq(r.stop, 0);
    ck_assert_uint_eq(emitted, 600);
    stop_matcher_free(m);
    m = stop_matcher_new(s, 2);
    ck_assert_int_eq(stop_matcher_feed(m, text, len, &r), 1);
    ck_assert_uint_eq(r.len, 600);
    stop_matcher_free(m);
}
END_TEST

START_TEST(test_validation) {
    char long_stop[STOP_MAX_LEN + 2];
    memset(long_stop, 'x', STOP_MAX_LEN + 1);
    long_stop[STOP_MAX_LEN + 1] = 0;
    const char *too_long[] = {"ok", long_stop};
    ck_assert_ptr_null(stop_matcher_new(too_long, 2));
    ck_assert_int_eq(stop_strings_validate(too_long, 2), CS_EINVAL);
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "limit"));
    long_stop[STOP_MAX_LEN] = 0; /* exactly the limit is fine */
    ck_assert_int_eq(stop_strings_validate(too_long, 2), CS_OK);
    const char *empty[] = {""};
    ck_assert_ptr_null(stop_matcher_new(empty, 1));
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "empty"));
    const char *null_s[] = {NULL};
    ck_assert_int_eq(stop_strings_validate(null_s, 1), CS_EINVAL);
    const char *bad_utf8[] = {"\xa9x"};
    ck_assert_int_eq(stop_strings_validate(bad_utf8, 1), CS_EINVAL);
    const char *trunc_utf8[] = {"\xc3"};
    ck_assert_int_eq(stop_strings_validate(trunc_utf8, 1), CS_EINVAL);
    const char *many[STOP_MAX_STRINGS + 1];
    for (int i = 0; i <= STOP_MAX_STRINGS; i++) many[i] = "x";
    ck_assert_int_eq(stop_strings_validate(many, STOP_MAX_STRINGS), CS_OK);
    ck_assert_int_eq(stop_strings_validate(many, STOP_MAX_STRINGS + 1), CS_EINVAL);
    stop_matcher_free(NULL);
}
END_TEST

int main(void) {
    const TTest *const tests[] = {
        test_basic_cross_boundary, test_overlapping_and_prefix, test_stop_at_start, test_utf8, test_flush,
        test_long_delta_and_max_len, test_validation,
    };
    return cs_check_main("stop", tests, CS_ARRAY_LEN(tests), 0, CK_FORK);
}
