/* sampling.h: turning logits into the next token. A seeded xoshiro256** generator per
 * request (so a seed reproduces its tokens whatever else runs), greedy argmax, temperature
 * sampling, and log-softmax computed in double. */
#ifndef CS_SAMPLING_H
#define CS_SAMPLING_H

#include "engine/common.h"

typedef struct cs_rng { uint64_t s[4]; } cs_rng_t;

void cs_rng_seed(cs_rng_t *r, uint64_t seed);
uint64_t cs_rng_next(cs_rng_t *r);
double cs_rng_uniform(cs_rng_t *r);     /* [0, 1) with 53 random bits */

typedef struct sampling_params {
    float temperature;      /* 0: greedy */
    uint64_t seed;
} sampling_params_t;

/* index of the largest logit; ties go to the lowest index (as torch.argmax) */
int32_t sampling_argmax(const float *logits, int n);
/* draw one token; greedy when temperature <= 0 */
int32_t sampling_sample(const float *logits, int n, const sampling_params_t *p, cs_rng_t *rng);
/* out[i] = logits[i] - logsumexp(logits) (double accumulation) */
void sampling_log_softmax(float *out, const float *logits, int n);

#endif
