/* chat_template.h: Hugging Face chat templates (a subset of Jinja2) rendered in C so that the
 * server builds exactly the prompt transformers' apply_chat_template would build.
 *
 * A template is parsed once (at start-up) into an immutable tree; anything the interpreter
 * does not implement (an unknown tag, filter, test, method or function) fails the parse with
 * its line number, so a template is either rendered exactly like jinja2 would or refused.
 * Rendering a parsed template is thread-safe: concurrent renders share nothing mutable. */
#ifndef CS_CHAT_TEMPLATE_H
#define CS_CHAT_TEMPLATE_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "base/common.h"

/* Guards against runaway templates; exceeding one is a render error. */
#define CHAT_TEMPLATE_MAX_OUTPUT     ((size_t)64 << 20)   /* bytes of rendered text */
#define CHAT_TEMPLATE_MAX_MEMORY     ((size_t)512 << 20)  /* bytes of values one render may allocate */
#define CHAT_TEMPLATE_MAX_DEPTH      1000                 /* nested evaluation steps: about 250 levels of
                                                             * macro recursion (jinja2 allows ~150), under
                                                             * 2 MiB of C stack */
#define CHAT_TEMPLATE_MAX_ITERATIONS 10000000L            /* loop iterations, all loops of a render */

typedef struct chat_template chat_template_t;

/* Parse a template; on failure returns CS_EINVAL (CS_ENOMEM when out of memory) and sets the
 * message, with the line number, for cs_error_last() (base/common.h). */
int chat_template_parse(const char *src, size_t len, chat_template_t **out);
void chat_template_free(chat_template_t *t);

/* Render with a context object: keys become the template's variables (messages,
 * add_generation_prompt, bos_token, eos_token, tools, any chat_template_kwargs). Output
 * malloc'd, NUL-terminated. On failure (raise_exception, a type error, a limit) returns
 * CS_EINVAL (CS_ENOMEM when out of memory) and sets the message for cs_error_last().
 *
 * transformers always passes tools and documents (None when absent) and
 * add_generation_prompt; pass them as null / false to match it exactly ("tools is defined"
 * is true there even without tools). */
int chat_template_render(const chat_template_t *t, const json_t *ctx, char **out, size_t *out_len);

/* The messages as transformers hands them to the template: a new array of new objects where
 * reasoning given as "reasoning_content", "thinking" or "reasoning" is also stored under
 * "thinking" (first) and "reasoning_content" (render_jinja_template does this), and with
 * drop_null, keys whose value is null are removed first (apply_chat_template does this).
 * Returns NULL if messages is not an array of objects. */
json_t *chat_template_hf_messages(const json_t *messages, bool drop_null);

#endif
