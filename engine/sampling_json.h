/* sampling_json.h: a request's sampling fields, JSON -> sampling_params_t and the engine
 * request's limits, parsed in one place for every caller (as llama.cpp's server reads a
 * completion with params_from_json_cmpl): /v1/completions and /v1/chat/completions
 * (server/api_openai.c), /v1/rollout's "sampling" object and, translated to it, SGLang's
 * /generate sampling_params (rollout_api/rollout.c, rollout_api/routes.c), and the JSON lines
 * of `caraserve batch` (server/cmd_batch.c).
 *
 * The fields and how each caller takes them (null is absent everywhere; "-": not read):
 *
 *   field                    OpenAI (completions/chat)      rollout "sampling"       batch line
 *   temperature, min_p,      number in its range            number                   number
 *     presence_penalty,      ([0,100], [0,1], [-2,2],
 *     frequency_penalty        [-2,2])
 *   top_p                    number in (0, 1]               number                   number
 *   repetition_penalty       number in (0, 100]             number                   number
 *   top_k                    integer in [-1, 2^30]          integer (int32)          integer
 *   seed                     integer                        - (each group's own)     integer
 *   max_tokens               >= 0, <= the context;          >= 1; default -1         integer; default 16
 *                            completions default 16, chat
 *                            -1 (max_completion_tokens
 *                            first)
 *   min_tokens               integer in [0, 2^30]           >= 0                     integer
 *   ignore_eos               true or false                  true or false            true, else false
 *   stop                     <= 64 non-empty strings        <= 64 strings            strings
 *   stop_token_ids           <= 256 ids below the vocab     ids below the vocab      ids below 2^31
 *   allowed_token_ids        non-empty list of ids below    -                        -
 *                            the vocab
 *   logit_bias               {"id": bias in [-100, 100]},   -                        -
 *                            ids below the vocab
 *   logprobs                 completions: integer in        true | false |           integer, plus
 *                            [0, max]; chat: true/false     {"mode", "top_k"};       "logprobs_mode":
 *                            plus top_logprobs in [0, max]  default 0 (on, no top)   "raw" | "processed"
 *
 * Integers: OpenAI takes 5.0 as 5 (as pydantic does), the rollout too (then within int32);
 * a batch line wants JSON integers. The values the rollout and batch do not range-check here
 * are checked by sampling_params_validate (the rollout right after, batch at submission).
 * Messages name a field as 'top_k' (OpenAI), sampling.top_k (rollout) or top_k (batch); the
 * parameter an error reports is the field (OpenAI) or "sampling" (rollout). */
#ifndef CS_SAMPLING_JSON_H
#define CS_SAMPLING_JSON_H

#include <jansson.h>

#include "base/model_config.h"
#include "engine/sampling.h"

typedef enum sampling_json_style {
    SAMPLING_JSON_OPENAI,   /* top-level OpenAI/vLLM fields, each range checked here */
    SAMPLING_JSON_ROLLOUT,  /* /v1/rollout's "sampling" object */
    SAMPLING_JSON_BATCH,    /* a `caraserve batch` line: types checked, values at submission */
} sampling_json_style;

typedef enum sampling_json_logprobs {
    SAMPLING_JSON_LOGPROBS_COUNT,      /* "logprobs": N alternatives (completions); default -1 (none) */
    SAMPLING_JSON_LOGPROBS_COUNT_MODE, /* the same plus "logprobs_mode": "raw" | "processed" (batch) */
    SAMPLING_JSON_LOGPROBS_CHAT,       /* "logprobs": true | false, "top_logprobs": N (chat) */
    SAMPLING_JSON_LOGPROBS_OBJECT,     /* "logprobs": true | false | {"mode", "top_k"}; default on (rollout) */
} sampling_json_logprobs;

typedef struct sampling_json_opts {
    sampling_json_style style;
    sampling_json_logprobs logprobs;
    int max_logprobs;            /* the most top alternatives (not checked in batch style) */
    int max_tokens_default;      /* when the request has none (< 0: up to the context) */
    bool max_completion_tokens;  /* chat: "max_completion_tokens" before "max_tokens" */
    int max_model_len;           /* OpenAI: max_tokens above it refused */
    int vocab;                   /* stop_token_ids below it; 0: below 2^31 */
    bool seed;                   /* reads "seed" */
    /* the model's recommended sampling (generation_config.json, --generation-config auto):
     * what temperature, top_p, top_k, min_p, repetition_penalty and (where the default is up
     * to the context) max_tokens are when the request leaves them out; NULL: vLLM's defaults */
    const model_gen_defaults_t *defaults;
} sampling_json_opts_t;

typedef struct sampling_json {
    sampling_params_t sampling;
    int max_tokens, min_tokens;
    bool ignore_eos;
    const char **stop;           /* n_stop strings of the JSON (alive as long as it); malloc'd,
                                    not NULL when the request has "stop" (even an empty list) */
    int n_stop;
    int32_t *stop_ids;           /* malloc'd, not NULL when the request has "stop_token_ids" */
    int n_stop_ids;
    void *lists;                 /* malloc'd: sampling's allowed ids and logit bias point into it
                                    (OpenAI style only) */
    const char *param;           /* after an error: the parameter it is about (NULL: none) */
} sampling_json_t;

/* Reads the sampling fields of object o (NULL: every default) into *out. CS_OK, or CS_EINVAL
 * (CS_ENOMEM) with cs_error_set's message and out->param; out is to be freed with
 * sampling_json_free either way. sampling_params_validate is left to the caller. */
int sampling_params_from_json(const json_t *o, const sampling_json_opts_t *opt, sampling_json_t *out);
/* Frees out's stop and stop_ids (the ones a caller took over are NULL); NULL does nothing. */
void sampling_json_free(sampling_json_t *out);

#endif
