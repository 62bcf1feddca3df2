/* stop.h: stop strings over a streamed completion. The matcher sees each incremental UTF-8
 * delta of a sequence's text, releases what can no longer be the start of a stop string,
 * holds back a suffix that is a proper prefix of one, and reports a match even when it
 * spans deltas ("\n" + "\n" for "\n\n"). As in vLLM (without include_stop_str_in_output)
 * the emitted text ends right before the stop string and nothing after it is emitted.
 *
 * Which match: the one that completes first when the text is read byte by byte (the
 * earliest END; at equal ends the longest, then the lowest index). This is what a per-token
 * check finds and it does not depend on how the text is split into deltas: "ab"+"c" and
 * "abc" both stop at "b" for stops {"abc", "b"}. Per sequence, one thread at a time. */
#ifndef CS_STOP_H
#define CS_STOP_H

#include "base/common.h"

#define STOP_MAX_STRINGS 16
#define STOP_MAX_LEN 256    /* bytes */

typedef struct stop_matcher stop_matcher_t;

typedef struct stop_result {
    const char *text;       /* never NULL: the bytes safe to emit now (held-back text, then new
                               text); valid until the next call on the matcher */
    size_t len;
    int stop;               /* -1, or the index of the stop string that matched */
} stop_result_t;

/* CS_EINVAL with a message if n > STOP_MAX_STRINGS or a string is NULL, empty, longer than
 * STOP_MAX_LEN bytes or not valid UTF-8. */
int stop_strings_validate(const char *const *stops, int n);
/* Copies the strings. NULL with the error set (stop_strings_validate's, or no memory).
 * n == 0 gives a matcher that passes everything through. */
stop_matcher_t *stop_matcher_new(const char *const *stops, int n);
void stop_matcher_free(stop_matcher_t *m);

/* Feeds the next delta. Returns 1 when a stop string has matched (in this call: out holds
 * the text up to the match; in an earlier one: out->len is 0), 0 when not, CS_ENOMEM. */
int stop_matcher_feed(stop_matcher_t *m, const char *delta, size_t len, stop_result_t *out);
/* End of the sequence without a stop (length, EOS): releases the held-back text. Returns
 * like stop_matcher_feed. */
int stop_matcher_flush(stop_matcher_t *m, stop_result_t *out);
/* Bytes currently held back. */
size_t stop_matcher_held(const stop_matcher_t *m);

#endif
