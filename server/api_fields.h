/* api_fields.h: the request-field inventory. Every field that OpenAI's API reference, vLLM's
 * protocol and SGLang's io_struct define for the generation and tokenizer routes, each
 * marked honoured or refused. The routes call api_fields_refuse first: a refused field with
 * a value other than its neutral one is a 400 naming it (no field is dropped silently).
 * The honoured ones are read by their routes; each row carries a value the route must
 * refuse with a 400 naming the field, which tests/test_api_fields.py sends to prove the
 * parser reads it. `caraserve fields` prints the table (docs/api-fields.md is its output). */
#ifndef CS_API_FIELDS_H
#define CS_API_FIELDS_H

#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>

typedef enum api_endpoint {
    EP_COMPLETIONS = 1u << 0, /* POST /v1/completions */
    EP_CHAT = 1u << 1,        /* POST /v1/chat/completions */
    EP_TOKENIZE = 1u << 2,    /* POST /tokenize */
    EP_DETOKENIZE = 1u << 3,  /* POST /detokenize */
    EP_GENERATE = 1u << 4,    /* POST /generate (SGLang) */
    EP_ROLLOUT = 1u << 5,     /* POST /v1/rollout */
} api_endpoint;

typedef struct api_field {
    const char *name;       /* a dotted path for nested fields: "stream_options.include_usage" */
    unsigned endpoints;     /* api_endpoint bits */
    bool honoured;
    const char *origin;     /* who defines it: OpenAI, vLLM, SGLang, caraserve */
    const char *neutral;    /* refused: JSON values (';'-separated) taken as "not asked"; null always is */
    const char *bad;        /* honoured: a JSON object merged into a valid request that the route
                               refuses with a 400 naming the field (NULL: none can be) */
    const char *note;       /* what it does, or why it is refused */
} api_field_t;

extern const api_field_t api_fields[];
extern const int api_n_fields;

/* The first refused field of endpoint ep that body b sets: 1 with *field, *why filled, or 0. */
int api_fields_refused(unsigned ep, const json_t *b, const api_field_t **field);
/* The table as Markdown (docs/api-fields.md) or JSON (a list of objects). */
void api_fields_print(FILE *f, bool json);

#endif
