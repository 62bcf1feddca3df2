/* rollout.h: the rollout batch behind POST /v1/rollout (../shared/ROLLOUT.md): groups of
 * token-id prompts, n samples per group sharing the prompt's KV blocks (one engine request
 * with n samples), seed + i per sample, per-token logprobs (raw or processed), the adapter
 * version of every sample, server-side over-provisioning (target_groups: the rest are
 * aborted and come back with their partial tokens) and continue_from (a partial sample
 * resumed: its output re-sent after the prompt).
 *
 * Transport-agnostic: the HTTP side (routes.c) hands in the parsed request and gets one
 * JSON object per finished group, then the summary, through an emit callback that runs on
 * the engine thread. */
#ifndef CS_ROLLOUT_H
#define CS_ROLLOUT_H

#include <jansson.h>
#include <stdbool.h>

#include "engine/engine.h"

typedef struct rollout rollout_t;

/* Called on the engine thread (or the caller's, for groups that fail at submission): line
 * is a group result or, with last, the summary {"summary": {...}}; the callee owns it. */
typedef void (*rollout_emit_fn)(void *user, json_t *line, bool last);

/* Optional taps for the server's metrics, called on the engine thread with the rollout's lock
 * held (must be cheap): a sampled token (ttft_s >= 0 on the group's first token, else
 * itl_s >= 0 since the sample's previous one), and a finished group (its prompt tokens, the
 * finish reason of its last sample, arrival to last token, queue time). slo, after the
 * rollout's lock is released: a finished group that had an SLO (its own or its model's), and
 * whether it met it (a first token, TTFT from the batch's start and every sample's TPOT within
 * the bounds). adapter is NULL for the base model. */
typedef struct rollout_observer {
    void (*token)(void *user, const char *adapter, double ttft_s, double itl_s);
    void (*done)(void *user, const char *adapter, int n_prompt, const char *finish, double e2e_s, double queue_s);
    void (*slo)(void *user, const char *adapter, bool met);
    void *user;
} rollout_observer_t;

typedef struct rollout_limits {
    int max_samples;            /* sum of n over the groups */
    int max_logprobs;           /* top-k alternatives per token */
    const char *base_name;      /* the base model's served name ("adapter" may name it) */
    int vocab;                  /* token ids must be below it */
    rollout_observer_t obs;     /* optional metrics taps */
    const struct sched_slo_table *slos; /* per-model SLOs (sched/slo.h) for what the request leaves unset; NULL: none */
    /* structured output: a "structured_outputs" object (vLLM's form: json, regex, choice,
     * grammar, json_object, whitespace_pattern) to a compiled grammar (*g, a reference), or
     * CS_EINVAL with cs_error_set's message; NULL: refused */
    int (*compile)(void *user, json_t *spec, struct grammar **g);
    void *compile_user;
    /* "tool_calls": true decodes each sample and parses its tool calls in this format
     * (text/tool_calls.h; 0: refused), with this tokenizer (NULL: refused) */
    const struct tokenizer *tok;
    int tool_format;
    /* every group's model before anything is submitted (NAME NULL: the base model): CS_OK to
     * go on, else a CS_E* code with cs_error_set's message (CS_ENOTFOUND: answered as the
     * engine answers an unknown adapter). It may register NAME first. NULL: none. */
    int (*adapter_check)(void *user, const char *name);
    void *adapter_user;
} rollout_limits_t;

/* A rollout request: the parsed JSON body (../shared/ROLLOUT.md), the server's limits, and
 * where its lines go. param is set on a refusal: the field it is about (NULL: none). */
typedef struct rollout_request {
    json_t *body;
    const rollout_limits_t *lim;
    rollout_emit_fn emit;       /* rollout_start only */
    void *user;
    const char *param;
} rollout_request_t;

/* Validate rq and submit every group: CS_OK and *out until rollout_release. On a bad request
 * CS_EINVAL (an adapter the engine does not know: CS_ENOTFOUND; CS_ENOMEM) with cs_error_set's
 * message and rq->param, nothing submitted, emit never called. */
int rollout_start(engine_t *e, rollout_request_t *rq, rollout_t **out);
/* The same checks as rollout_start short of the engine's own (adapters, lengths), nothing
 * submitted: CS_OK, or the error as there (the fuzz target's entry). */
int rollout_validate(rollout_request_t *rq);
/* Abort every sample still running (the client went away, or /v1/rollout/abort); they are
 * returned with finish_reason "abort" and their partial tokens. Any thread. */
void rollout_abort(rollout_t *r);
/* The caller is done with r (after the last emit, or after rollout_abort when it no longer
 * wants the lines): freed once the engine is done with it too. */
void rollout_release(rollout_t *r);
/* Abort the running groups whose group_id is in group_ids (a JSON list); returns how many. */
int rollout_abort_groups(rollout_t *r, json_t *group_ids);
/* Abort the running groups of ADAPTER that follow its active version (pinned ones go on) */
int rollout_abort_adapter(rollout_t *r, const char *adapter);
const char *rollout_batch_id(const rollout_t *r);   /* NULL when the request had none */

#endif
