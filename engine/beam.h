/* beam.h: beam search over the engine (engine/beam.c), as vLLM defines it. engine_submit
 * hands a request with beam_search here; only engine.c includes this header. */
#ifndef CS_BEAM_H
#define CS_BEAM_H

#include "engine/engine.h"

/* the widest beam: each step asks for 2 * width alternatives */
#define BEAM_MAX_WIDTH (SAMPLING_MAX_LOGPROBS / 2)

typedef struct beam_set beam_set_t;

typedef struct beam_env {
    const tokenizer_t *tokenizer;   /* may be NULL: events carry no text */
    const int32_t *eos;             /* the engine's EOS ids */
    int n_eos;
} beam_env_t;

beam_set_t *beam_set_new(void);
/* Aborts every search still running and waits for its thread (the engine thread must still
 * run: the searches' step requests end through it). */
void beam_set_free(beam_set_t *bs);
/* Start a search of rq (validated by the caller; max_tokens resolved, >= 1) under id on a
 * thread of its own. Its sink is called from that thread (and, for prompt_logprobs, from
 * the engine thread). */
int beam_start(beam_set_t *bs, engine_t *e, const beam_env_t *env, const engine_request_t *rq, uint64_t id);
/* true when id is a search of bs (it then ends as aborted at its next step) */
bool beam_abort(beam_set_t *bs, uint64_t id);

#endif
