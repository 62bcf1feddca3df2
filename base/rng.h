/* rng.h: the project's one random generator, xoshiro256** seeded by splitmix64. The engine
 * seeds sample i of a request with seed + i; caraserve-bench draws its schedules from it. */
#ifndef CS_RNG_H
#define CS_RNG_H

#include "base/common.h"

typedef struct cs_rng { uint64_t s[4]; } cs_rng_t;

void cs_rng_seed(cs_rng_t *r, uint64_t seed);
uint64_t cs_rng_next(cs_rng_t *r);
double cs_rng_uniform(cs_rng_t *r);     /* [0, 1) with 53 random bits */

#endif
