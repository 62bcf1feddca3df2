/* engine.h: the serving engine. Requests (token ids + sampling parameters + an adapter
 * name) go in from any thread; one engine thread runs the step loop: each iteration takes
 * the running sequences' decode rows and chunks of prefills (within a token budget), runs
 * them as one batch on the backend over the paged KV cache, samples, and hands each new
 * token to the request's sink. Requests join and leave every iteration; an abort takes
 * effect at the next one. When KV blocks run out new work waits, then the newest running
 * sequence is preempted and later recomputed (its prefix blocks usually still cached).
 * Adapters come from a lora_registry: a request whose adapter is still loading waits
 * without holding up the batch. */
#ifndef CS_ENGINE_H
#define CS_ENGINE_H

#include "engine/model.h"
#include "engine/sampling.h"
#include "text/tokenizer.h"
#include "lora/registry.h"

typedef struct engine engine_t;

typedef struct engine_params {
    model_t *model;
    const tokenizer_t *tokenizer;   /* may be NULL: no text, no stop strings */
    lora_registry_t *loras;         /* may be NULL: base model only */
    size_t kv_cache_bytes;          /* KV budget (required) */
    cs_dtype kv_cache_dtype;        /* of the KV pools: F32 (0, the default); see kv_cache_params_t */
    int max_num_seqs;               /* running sequences per iteration (0: 256) */
    int max_num_batched_tokens;     /* tokens per iteration (0: 2048) */
    int max_model_len;              /* 0: max_position_embeddings, capped by the KV cache */
    size_t logits_keep_bytes;       /* the logits buffers of a step over this (and over what
                                     * max_num_seqs rows need) are freed after it (0: 64 MB) */
    bool no_prefix_caching;
    /* The base weights are versioned (engine_update_base): model is version 1, labelled
     * weight_version (NULL: "default"), loaded from model_dir (NULL: not known; an in-place
     * update that fails part way then cannot go back to it). With own_model the engine frees
     * every version's weights, model included; without, model stays the caller's. */
    bool own_model;
    const char *weight_version;
    const char *model_dir;
    const int32_t *eos_ids;         /* NULL: the tokenizer's */
    int n_eos;
    struct sched *sched;            /* the scheduling policy (engine/sched.h; sched/ makes them):
                                     * required, the caller's, must outlive the engine */
    int cold_start;                 /* a request whose adapter slot is still streaming in
                                     * (SCHED_COLD_*, the policy may choose per request): AUTO (0)
                                     * assists where the model can (model_set_assist), else waits;
                                     * ASSIST runs its layers not yet there on the host; WAIT keeps
                                     * it waiting until the slot is complete */
} engine_params_t;

typedef enum engine_finish {
    ENGINE_FINISH_NONE = 0,
    ENGINE_FINISH_STOP,     /* EOS, a stop token id or a stop string */
    ENGINE_FINISH_LENGTH,   /* max_tokens or the model's context */
    ENGINE_FINISH_ABORT,
    ENGINE_FINISH_ERROR,
} engine_finish;

extern const char *const engine_finish_names[]; /* "", "stop", "length", "abort", "error" */

/* One event per sample per iteration that produced something: a new token (with its
 * logprobs and the text that became final), and/or the end of the sample. Pointers are
 * valid during the sink call only. */
typedef struct engine_event {
    uint64_t request_id;
    int index;                  /* sample 0 .. n-1 */
    bool has_token;
    int32_t token;
    float logprob;              /* when the request asked for logprobs */
    float kept_logmass;         /* processed logprobs: the log of the mass truncation kept (sample_out_t) */
    int n_top;
    const int32_t *top_ids;     /* [n_top], by logprob desc */
    const float *top_logprobs;
    const char *text;           /* new final text (may be empty); UTF-8 */
    size_t text_len;
    engine_finish finish;       /* NONE while running */
    int error;                  /* CS_* with ENGINE_FINISH_ERROR */
    const char *error_msg;
    int n_prompt_tokens;
    int n_cached_tokens;        /* prompt tokens whose KV came from the prefix cache */
    int n_generated;            /* tokens of this sample so far */
    int adapter_version;        /* 0: base model */
    int base_version;           /* the base weights' version that made this token */
    bool request_done;          /* the last event of the whole request */
    double queue_ms;            /* submit to first scheduled (0 before that) */
    /* Once per request that asked for prompt_logprobs, in an event of its own (index 0, no
     * token) before its first token: [n_prompt_tokens] raw logprobs of the prompt tokens
     * given the ones before (entry 0 is NAN: nothing precedes it), and prompt_n_top
     * alternatives per position ([n_prompt_tokens * prompt_n_top], row 0 unused). */
    const float *prompt_logprobs;
    const int32_t *prompt_ranks;    /* [n_prompt_tokens] vLLM's rank of each (entry 0 unused) */
    int prompt_n_top;
    const int32_t *prompt_top_ids;
    const float *prompt_top_logprobs;
} engine_event_t;

/* Called on the engine thread; must not block and must not call engine_* except
 * engine_abort. */
typedef void (*engine_sink_fn)(void *user, const engine_event_t *ev);

typedef struct engine_request {
    const int32_t *prompt;
    int n_prompt;
    const char *adapter;            /* NULL or "": the base model */
    int adapter_version;            /* 0: the active version, and engine_follow_active may move
                                       the request to a newer one; > 0: exactly this kept
                                       version (pinned) */
    int base_version;               /* 0: the active base weights (and an update's apply may move
                                       the request to newer ones); > 0: exactly this version,
                                       which must still be held (engine_base_versions) */
    sampling_params_t sampling;     /* sample i uses seed + i */
    int n;                          /* samples (default 1 when 0) */
    int max_tokens;                 /* < 0: up to the context length; 0 only with
                                       prompt_logprobs (the prompt is scored, nothing sampled) */
    int min_tokens;                 /* EOS and stop tokens are banned until this many */
    int n_resumed;                  /* the last n_resumed prompt tokens are this sample's own
                                       earlier output (a resumed partial rollout, n = 1): they
                                       count as output for the penalties and the sampler's
                                       random stream skips their draws */
    const char *const *stop;        /* stop strings (not included in the text) */
    int n_stop;
    const int32_t *stop_token_ids;
    int n_stop_token_ids;
    bool ignore_eos;
    bool keep_special_text;         /* include special tokens in the text */
    bool prompt_logprobs;           /* logprobs of the prompt tokens (echo); its prompt is
                                       then computed in full, not taken from the prefix cache */
    int prompt_top_logprobs;        /* 0..20 alternatives per prompt position */
    double slo_ttft_ms, slo_tpot_ms; /* the request's latency SLOs (0: none): the policy sees them */
    /* Beam search as vLLM defines it (engine/beam.c): n beams (1 .. 10), the best n returned as
     * samples 0 .. n-1, ranked by cum_logprob / (prompt + output tokens)^length_penalty. It
     * takes no stop strings or ids, no allowed ids or logit bias, no penalties, no min_tokens;
     * the other sampling knobs do not change it (its logprobs are the raw ones). It needs the
     * engine thread (engine_start), and its sink is called from a thread of its own. */
    bool beam_search;
    float length_penalty;
    /* Structured output: only tokens that keep the output in this grammar are sampled (EOS
     * where it can end); the request ends with "stop" once the grammar is complete. The engine
     * holds its own reference (grammar_ref). Needs the tokenizer. */
    struct grammar *grammar;
    bool grammar_gated;             /* the grammar applies only after token grammar_gate_id (a
                                       reasoning model's </think>): the thinking is unconstrained */
    int32_t grammar_gate_id;
    engine_sink_fn sink;
    void *user;
} engine_request_t;

typedef struct engine_stats {
    int n_waiting, n_running;       /* sequences */
    int n_requests;
    kv_cache_stats_t kv;
    uint64_t steps, prefill_tokens, decode_tokens, preemptions, requests_done;
    uint64_t cached_prompt_tokens, prompt_tokens;
    double busy_ms;                 /* time spent in steps that ran a batch */
    double decode_only_ms;          /* ... of which steps with decode rows only */
    uint64_t decode_only_tokens;
    /* the cold start: requests that found their adapter's slot still streaming in, of them
     * those that ran host-assisted and those that waited for it; the model's per-layer counts */
    uint64_t cold_starts, cold_assisted, cold_waited;
    uint64_t cold_forwards, cold_host_layers, cold_device_layers, cold_host_rows;
    uint64_t cold_disk_waits;       /* requests whose adapter still streamed in from disk while
                                     * others ran: they waited for the whole file */
    uint64_t cold_pinned_allocs;    /* pinned host buffers made for host-assisted LoRA (at the
                                     * start, for the largest batch; more only if one grew) */
    uint64_t cold_auto_assist, cold_auto_wait; /* cold requests --cold-start auto's byte model
                                     * (lora_cold_cost) sent each way */
    uint64_t logits_releases;       /* steps whose logits buffers were given back (many rows) */
} engine_stats_t;

/* One sequence as GET /v1/state shows it: published by the engine thread after every
 * iteration, plus the requests submitted since (not yet taken in: waiting, n_computed 0). */
typedef struct engine_seq_info {
    uint64_t req_id;
    int index;                      /* sample index */
    bool running;
    double t_submit_ms;             /* cs_time_ms() */
    double slo_ttft_ms, slo_tpot_ms; /* the request's own (0: none) */
    int n_prompt, n_computed, n_generated, max_tokens;
    int rank;                       /* the adapter's max rank; 0: base model; -1: not known yet */
    long rank_sum;                  /* its Σ rank over modules (0 when not known) */
    char adapter[96];               /* "" for the base model (truncated past 95 bytes) */
} engine_seq_info_t;

int engine_new(const engine_params_t *p, engine_t **out);
/* Aborts whatever is left (sinks get ENGINE_FINISH_ABORT), stops the thread, frees. */
void engine_free(engine_t *e);
int engine_max_model_len(const engine_t *e);

/* Validate and queue a request (everything is copied). Errors (CS_EINVAL with a message:
 * empty prompt, id out of range, too long for the context, bad n/logprobs/stop, unknown
 * adapter CS_ENOTFOUND) are returned here and the sink is never called. */
int engine_submit(engine_t *e, const engine_request_t *r, uint64_t *id);
/* Submit n requests at once: all are validated first (on an error nothing is queued and
 * *failed, if not NULL, is the index of the bad one), then they reach the engine together,
 * in one iteration's intake, so their batch does not depend on thread timing. */
int engine_submit_batch(engine_t *e, const engine_request_t *rqs, int n, uint64_t *ids, int *failed);
/* Abort a request (any thread): it ends with ENGINE_FINISH_ABORT at the next iteration.
 * CS_ENOTFOUND when it is not (or no longer) known. */
int engine_abort(engine_t *e, uint64_t id);

/* Run the step loop on a thread of its own. */
int engine_start(engine_t *e);
/* Or drive it from the caller: one iteration (returns the number of sequences it ran,
 * 0 when nothing was runnable), or iterations until no request is left. */
int engine_step(engine_t *e);
void engine_run_until_idle(engine_t *e);

/* Pausing (a trainer updating weights): NO_ADMIT runs what has started (new requests wait),
 * HOLD runs nothing (every sequence keeps its KV blocks and sampler state, and goes on from
 * there after RUN). Aborts are taken in every mode. With the engine thread running, setting
 * HOLD returns once the iteration under way has ended: no token is produced after it returns
 * (and engine_get_stats then shows the held state) until RUN or NO_ADMIT. */
typedef enum engine_pause_mode { ENGINE_RUN = 0, ENGINE_PAUSE_NO_ADMIT, ENGINE_PAUSE_HOLD } engine_pause_mode;
void engine_set_pause(engine_t *e, engine_pause_mode mode);
/* Empty the prefix cache (kv_prefix_flush) on the engine thread, paused or not, and return
 * once it is done: the number of cached blocks freed. Running sequences keep their blocks;
 * a later request recomputes what it would have found. */
int engine_flush_prefix_cache(engine_t *e);
/* A new version of adapter NAME became active and the requests in flight on an older one
 * should go on with it (apply=pause_keep): at the next iteration boundary (paused or not)
 * every unpinned request holding an older version of NAME swaps to the active one, keeping
 * its KV cache and sampler state; its later tokens come from the new weights and its events
 * report the new adapter_version. Its blocks stop going to the prefix cache (they mix
 * versions). Waits for the swap up to timeout_ms: returns the number of requests moved, or
 * CS_EAGAIN when the active version is still loading (the swap happens once it is loaded),
 * or CS_EINVAL without the engine thread (engine_start). */
int engine_follow_active(engine_t *e, const char *name, int timeout_ms);

/* ---- base-weight versions ----
 * What an update does to the requests in flight on older weights (their apply): NEXT_REQUEST
 * lets them finish on the weights they started on, ABORT_INFLIGHT ends them (abort),
 * PAUSE_KEEP moves them to the new weights at the next iteration boundary, keeping their KV
 * cache and sampler state (their events report the new base_version from there; their
 * blocks stop going to the prefix cache). Pinned requests (engine_request_t.base_version)
 * keep their version in every mode, except one replaced in place: they end with an error. */
typedef enum engine_apply { ENGINE_APPLY_NEXT_REQUEST = 0, ENGINE_APPLY_ABORT_INFLIGHT, ENGINE_APPLY_PAUSE_KEEP } engine_apply;

#define ENGINE_LABEL_MAX 128

typedef struct engine_base_update {
    /* Beside: MODEL holds the new weights, loaded by the caller on the engine's backend while
     * the engine ran; the engine owns it from the call on (also when it fails). In place (model
     * NULL): the engine thread frees the active weights and loads DIR (how) in their place, the
     * iterations stopping meanwhile; the requests on the old weights move to the new ones
     * (ABORT_INFLIGHT: abort) since the old are gone. Needs own_model. */
    model_t *model;
    const char *dir;                /* where the weights come from (required) */
    model_weights_mem how;
    const char *label;              /* the version's name (SGLang's weight_version); NULL: its number */
    engine_apply apply;
    int keep_versions;              /* versions kept for pinned requests, the new one included (0: 1);
                                     * older ones go once no request holds them */
} engine_base_update_t;

typedef struct engine_base_result {
    int version;                    /* the new version's number */
    bool in_place;
    int moved, aborted;             /* requests moved to the new weights / aborted */
    double pause_ms;                /* iterations stopped for the swap (in place: the whole load) */
} engine_base_result_t;

/* Make the weights of U the active base version: checked first (model_probe, then
 * model_config_compatible against the served ones: CS_ESHAPE naming the first difference,
 * CS_ENOTFOUND, CS_EFORMAT, ... and nothing changed), then swapped in at an iteration
 * boundary. Returns once done (the engine thread's work; without it, done here). An in-place
 * load that fails part way goes back to the old weights from model_dir (the requests moved
 * to the new version fail). */
int engine_update_base(engine_t *e, const engine_base_update_t *u, engine_base_result_t *res);

typedef struct engine_base_info {
    int version;
    char label[ENGINE_LABEL_MAX];
    char dir[512];
    int requests;                   /* requests holding it */
    bool active, kept;
} engine_base_info_t;
/* The base versions held, newest (the active one) first: up to max into out; returns how
 * many there are. */
int engine_base_versions(engine_t *e, engine_base_info_t *out, int max);
/* The active version's name becomes LABEL (SGLang's /update_weight_version). */
void engine_base_relabel(engine_t *e, const char *label);
/* VERSION's name into buf (its number once it is no longer held) */
void engine_base_label(engine_t *e, int version, char *buf, size_t n);

/* ---- sleep (vLLM's /sleep and /wake_up) ----
 * Level 1 gives the KV cache's memory back: every running sequence is preempted first (it
 * recomputes its KV after the wake-up, its sampler state kept) and the prefix cache goes.
 * Level 2 also frees the base weights (every version held; each is loaded again from its
 * directory at the wake-up; needs own_model). Level 0 does nothing here (the caller pauses).
 * Nothing runs while asleep (requests wait; aborts are taken); base updates are refused
 * (CS_EBUSY). Returns once done. */
int engine_sleep(engine_t *e, int level);
/* Give back what sleep freed: the weights and/or the KV cache. Asleep until both are back. */
int engine_wake_up(engine_t *e, bool weights, bool kv);
bool engine_sleeping(engine_t *e);

void engine_get_stats(engine_t *e, engine_stats_t *st);
/* A copy of the sequences (*out, free() it; *n of them): running first, then waiting. */
int engine_get_state(engine_t *e, engine_seq_info_t **out, int *n);
/* Wake the engine (any thread): e.g. from the adapter registry's on_loaded callback. */
void engine_wake(engine_t *e);

#endif
