/* sampling.h: turning logits into the next token, with vLLM's sampling parameters (users
 * switch from vLLM, so its V1 sampler is the spec): penalties, temperature, min-p, top-k,
 * top-p, a seeded xoshiro256** generator per sequence (a seed reproduces its tokens whatever
 * else runs), and raw or processed logprobs with the top-N alternatives.
 *
 * Order of processing for one token (vLLM V1 Sampler.forward / sample / TopKTopPSampler):
 *   0. raw logprobs (if requested, mode RAW): log_softmax(model logits), before anything else
 *   1. allowed_token_ids: every other token -> -inf; banned tokens (the engine's min_tokens:
 *      EOS and stop_token_ids) -> -inf; logit_bias added (vLLM's logits processors, in
 *      that order, before the penalties)
 *   2. penalties, in this order, in float as vLLM does:
 *        repetition (token in prompt OR output): x > 0 ? x * (1/r) : x * r
 *        frequency  (output only):               x -= frequency_penalty * count
 *        presence   (output only):               x -= presence_penalty * (count > 0)
 *   -- greedy (temperature == 0) stops here: argmax, ties to the lowest id; processed
 *      logprobs = log_softmax after step 2; no RNG draw --
 *   3. temperature: x /= T (0 < T < 0.01 is raised to 0.01, as vLLM does)
 *   4. min_p: p = softmax(x); x_i = -inf where p_i < min_p * max(p)
 *   5. top_k: x_i = -inf where x_i < the k-th largest x (ties with the k-th are all kept)
 *   6. top_p: in order (x desc, id asc), token r is kept iff the probability mass of the
 *      tokens before it is < top_p (the smallest prefix with mass >= top_p; the top token
 *      is always kept); softmax over the survivors of 4 and 5
 *   7. sample from softmax(x) with exactly ONE uniform u from the sequence's RNG, by inverse
 *      CDF over the kept tokens in increasing id order: the first id whose cumulative
 *      (double) probability exceeds u. processed logprobs = log_softmax(x) after step 6,
 *      masked tokens -inf; with them, the log of the mass steps 4-6 kept (kept_logmass).
 * Why inverse CDF in id order: one draw per token keeps the RNG stream aligned token by
 * token (sample i of a request is reproducible from seed + i alone), and walking ids in
 * order needs no sort, so plain temperature sampling stays O(vocab). vLLM's exponential race
 * (probs / Exp(1), argmax) would cost a vocab of draws and logs per token.
 *
 * Cost per token: O(vocab) for greedy and plain temperature sampling. top-k and top-p are
 * O(vocab) too: the survivors are bucketed by distance below the max (2048 buckets over 40
 * nats, monotone in the value), a count (top-k) or mass (top-p) histogram finds the bucket
 * where the cut falls, and only that bucket is quickselected (top-k) or sorted (top-p); a
 * full sort happens only when nearly every token lands in the cut's bucket.
 *
 * Memory: a sampler holds only sparse per-sequence state (an open-addressing hash map of the
 * tokens seen, none when no penalty is active); the vocab-sized working arrays are per
 * thread scratch, reused by every sampler of that thread. The engine runs all sampling on
 * one thread; a thread that sampled calls sampling_scratch_free() before it exits. */
#ifndef CS_SAMPLING_H
#define CS_SAMPLING_H

#include "base/common.h"
#include "base/rng.h"

/* ---- parameters ---- */
#define SAMPLING_MAX_LOGPROBS 20

typedef enum sampling_logprobs_mode {
    SAMPLING_LOGPROBS_RAW = 0,       /* log_softmax of the model's logits (vLLM raw_logprobs) */
    SAMPLING_LOGPROBS_PROCESSED,     /* after penalties, temperature, masks (processed_logprobs) */
} sampling_logprobs_mode;

typedef struct sampling_params {
    float temperature;        /* >= 0; 0: greedy (below 1e-5 counts as 0, as vLLM) */
    float top_p;              /* (0, 1]; 1: off */
    int top_k;                /* >= 1; 0 or -1: off */
    float min_p;              /* [0, 1]; 0: off */
    float repetition_penalty; /* > 0; 1: off. Prompt and output tokens */
    float presence_penalty;   /* [-2, 2]; 0: off. Output tokens only */
    float frequency_penalty;  /* [-2, 2]; 0: off. Output tokens only */
    bool has_seed;            /* false: each sequence gets a random seed */
    uint64_t seed;
    int logprobs;             /* -1: none; 0..SAMPLING_MAX_LOGPROBS: the sampled token's
                                 logprob plus that many top alternatives */
    sampling_logprobs_mode logprobs_mode;
    /* vLLM's allowed_token_ids (n_allowed > 0: every other token is masked) and OpenAI's
     * logit_bias (bias[i] added to token bias_ids[i]'s logit), both applied in step 1. Borrowed:
     * sampler_new copies them, and so does engine_submit. */
    const int32_t *allowed_ids;
    int n_allowed;
    const int32_t *bias_ids;
    const float *bias;
    int n_bias;
} sampling_params_t;

/* vLLM's defaults: temperature 1, every other knob off, no seed, no logprobs, raw mode. */
void sampling_params_default(sampling_params_t *p);
/* CS_EINVAL with a message (for an HTTP 400) when a value is out of range. */
int sampling_params_validate(const sampling_params_t *p);
/* The same for the token ids of allowed_token_ids and logit_bias, against the vocabulary
 * (vLLM's wording). */
int sampling_params_validate_ids(const sampling_params_t *p, int vocab);
/* One malloc'd block holding copies of src's allowed_token_ids and logit_bias arrays, dst's
 * pointers set into it (src == dst is fine); free the block with free(). NULL if out of memory. */
void *sampling_lists_copy(const sampling_params_t *src, sampling_params_t *dst);
/* The seed of sample `index` (0-based, the n of a request): seed + index, or a fresh
 * random seed when the request has none. */
uint64_t sampling_seed_for(const sampling_params_t *p, int index);

/* ---- per-sequence sampler ---- */
typedef struct sample_logprob {
    int32_t id;
    float logprob;            /* may be -INFINITY in processed mode (a masked token) */
} sample_logprob_t;

typedef struct sample_out {
    int32_t token;
    /* The fields below are filled only when params.logprobs >= 0, in the mode requested. */
    float logprob;            /* of token */
    int rank;                 /* vLLM's rank: how many tokens have logprob >= token's (>= 1) */
    int n_top;                /* == params.logprobs (capped at vocab) */
    sample_logprob_t top[SAMPLING_MAX_LOGPROBS]; /* logprob desc, ties by id asc */
    /* processed mode: log of the probability mass min-p, top-k and top-p kept, measured in
     * softmax(x) after steps 1-3 (0 when nothing was cut, and for greedy). A processed logprob
     * is renormalised over the kept tokens: log_softmax(x after step 3)[token] = logprob +
     * kept_logmass, the trainer's logprob at that temperature (with the same penalties). */
    float kept_logmass;
} sample_out_t;

typedef struct sampler sampler_t;

/* prompt: the sequence's prompt ids (only kept, sparsely, when repetition_penalty != 1; ids
 * outside [0, vocab) are ignored). seed: see sampling_seed_for. NULL + error on invalid
 * params or no memory. */
sampler_t *sampler_new(const sampling_params_t *p, int vocab, const int32_t *prompt,
                       int n_prompt, uint64_t seed);
void sampler_free(sampler_t *s);
/* Records an output token (the penalties' counts). Call once per generated token. */
void sampler_accept(sampler_t *s, int32_t token);
/* Continue a sample that already produced tokens[0 .. n) (a resumed partial rollout): they
 * count as output for the penalties, and the random stream moves past the draws they took,
 * so the continuation is what the uninterrupted sample would have drawn. */
void sampler_resume(sampler_t *s, const int32_t *tokens, int n);
/* Draws the next token from logits (vocab floats, not modified). banned ids (may be NULL)
 * are -inf before anything else. out may be NULL. Returns the token, or CS_EINVAL when no
 * token is left (everything banned or masked). Does not call sampler_accept. */
int32_t sampler_sample(sampler_t *s, const float *logits, const int32_t *banned, int n_banned,
                       sample_out_t *out);
/* The processed logits steps 1..6 produce (for greedy: after step 2), without drawing:
 * out_logits gets vocab floats, masked tokens -inf. For tests and debugging. */
void sampler_process(sampler_t *s, const float *logits, const int32_t *banned, int n_banned,
                     float *out_logits);

/* Frees this thread's vocab-sized scratch (call before a sampling thread exits). */
void sampling_scratch_free(void);

/* ---- plain helpers ---- */
/* index of the largest logit; ties go to the lowest index (as torch.argmax) */
int32_t sampling_argmax(const float *logits, int n);
/* Stateless convenience for the CLI: greedy when temperature < 1e-5, else plain
 * temperature sampling (one uniform, inverse CDF in id order); other knobs ignored. */
int32_t sampling_sample(const float *logits, int n, const sampling_params_t *p, cs_rng_t *rng);
/* Logprobs of token under log_softmax(logits) (no sampling params): out->token, logprob,
 * rank and the top n_top (<= SAMPLING_MAX_LOGPROBS). For prompt logprobs. */
void sampling_logprobs_of(const float *logits, int n, int32_t token, int n_top, sample_out_t *out);
/* out[i] = logits[i] - logsumexp(logits) (double accumulation; -inf entries stay -inf) */
void sampling_log_softmax(float *out, const float *logits, int n);

#endif
