/* sampling.c: see sampling.h. */
#include "engine/sampling.h"

#include <math.h>
#include <stdlib.h>

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

void cs_rng_seed(cs_rng_t *r, uint64_t seed) {
    /* splitmix64 expands the seed into the xoshiro state */
    for (int i = 0; i < 4; i++) {
        uint64_t z = (seed += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        r->s[i] = z ^ (z >> 31);
    }
}

uint64_t cs_rng_next(cs_rng_t *r) {
    uint64_t *s = r->s, result = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

double cs_rng_uniform(cs_rng_t *r) { return (double)(cs_rng_next(r) >> 11) * 0x1.0p-53; }

int32_t sampling_argmax(const float *x, int n) {
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

void sampling_log_softmax(float *out, const float *x, int n) {
    float mx = x[sampling_argmax(x, n)];
    double sum = 0;
    for (int i = 0; i < n; i++) sum += exp((double)x[i] - mx);
    double lse = mx + log(sum);
    for (int i = 0; i < n; i++) out[i] = (float)((double)x[i] - lse);
}

int32_t sampling_sample(const float *x, int n, const sampling_params_t *p, cs_rng_t *rng) {
    if (p->temperature <= 0) return sampling_argmax(x, n);
    float mx = x[sampling_argmax(x, n)];
    double sum = 0;
    for (int i = 0; i < n; i++) sum += exp(((double)x[i] - mx) / p->temperature);
    double u = cs_rng_uniform(rng) * sum, acc = 0;
    for (int i = 0; i < n; i++) {
        acc += exp(((double)x[i] - mx) / p->temperature);
        if (u < acc) return i;
    }
    return sampling_argmax(x, n); /* u landed on rounding slack */
}
