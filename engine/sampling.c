/* sampling.c: see sampling.h for the semantics and the order of the steps. The per-sequence
 * state is a sparse hash map of seen tokens; the vocab-sized arrays are thread-local scratch. */
#include "engine/sampling.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define SAMPLING_EPS 1e-5f  /* below: greedy (vLLM _SAMPLING_EPS) */
#define MIN_TEMP 1e-2f      /* vLLM raises 0 < T < 0.01 to 0.01 (_MAX_TEMP) */

/* ---- parameters ---- */

void sampling_params_default(sampling_params_t *p) {
    *p = (sampling_params_t){
        .temperature = 1.0f,
        .top_p = 1.0f,
        .top_k = 0,
        .min_p = 0.0f,
        .repetition_penalty = 1.0f,
        .presence_penalty = 0.0f,
        .frequency_penalty = 0.0f,
        .has_seed = false,
        .seed = 0,
        .logprobs = -1,
        .logprobs_mode = SAMPLING_LOGPROBS_RAW,
    };
}

int sampling_params_validate(const sampling_params_t *p) {
    /* the messages follow vLLM's SamplingParams._verify_args */
    if (!(p->temperature >= 0) || isinf(p->temperature))
        return cs_error_set(CS_EINVAL, "temperature must be non-negative, got %g", p->temperature);
    if (!(p->top_p > 0 && p->top_p <= 1))
        return cs_error_set(CS_EINVAL, "top_p must be in (0, 1], got %g", p->top_p);
    if (p->top_k < -1)
        return cs_error_set(CS_EINVAL, "top_k must be 0 or -1 (disable), or at least 1, got %d", p->top_k);
    if (!(p->min_p >= 0 && p->min_p <= 1))
        return cs_error_set(CS_EINVAL, "min_p must be in [0, 1], got %g", p->min_p);
    if (!(p->repetition_penalty > 0) || isinf(p->repetition_penalty))
        return cs_error_set(CS_EINVAL, "repetition_penalty must be greater than zero, got %g",
                            p->repetition_penalty);
    if (!(p->presence_penalty >= -2 && p->presence_penalty <= 2))
        return cs_error_set(CS_EINVAL, "presence_penalty must be in [-2, 2], got %g", p->presence_penalty);
    if (!(p->frequency_penalty >= -2 && p->frequency_penalty <= 2))
        return cs_error_set(CS_EINVAL, "frequency_penalty must be in [-2, 2], got %g", p->frequency_penalty);
    if (p->logprobs < -1 || p->logprobs > SAMPLING_MAX_LOGPROBS)
        return cs_error_set(CS_EINVAL, "logprobs must be in [0, %d], got %d", SAMPLING_MAX_LOGPROBS,
                            p->logprobs);
    if (p->logprobs_mode != SAMPLING_LOGPROBS_RAW && p->logprobs_mode != SAMPLING_LOGPROBS_PROCESSED)
        return cs_error_set(CS_EINVAL, "unknown logprobs mode %d", (int)p->logprobs_mode);
    if (p->n_allowed < 0 || (p->n_allowed && !p->allowed_ids) || p->n_bias < 0 || (p->n_bias && (!p->bias_ids || !p->bias)))
        return cs_error_set(CS_EINVAL, "bad allowed_token_ids or logit_bias arrays");
    for (int i = 0; i < p->n_bias; i++)
        if (!(p->bias[i] >= -100 && p->bias[i] <= 100))
            return cs_error_set(CS_EINVAL, "logit_bias values must be between -100 and 100, got %g for token %d",
                                p->bias[i], p->bias_ids[i]);
    return CS_OK;
}

int sampling_params_validate_ids(const sampling_params_t *p, int vocab) {
    for (int i = 0; i < p->n_allowed; i++)
        if (p->allowed_ids[i] < 0 || p->allowed_ids[i] >= vocab)
            return cs_error_set(CS_EINVAL, "allowed_token_ids contains out-of-vocab token id %d (vocabulary size: %d)",
                                p->allowed_ids[i], vocab);
    for (int i = 0; i < p->n_bias; i++)
        if (p->bias_ids[i] < 0 || p->bias_ids[i] >= vocab)
            return cs_error_set(CS_EINVAL, "token_id(s) [%d] in logit_bias contain out-of-vocab token ids. Vocabulary size: %d",
                                p->bias_ids[i], vocab);
    return CS_OK;
}

void *sampling_lists_copy(const sampling_params_t *src, sampling_params_t *dst) {
    size_t na = (size_t)src->n_allowed, nb = (size_t)src->n_bias;
    char *block = malloc(sizeof(int32_t) * (na + nb) + sizeof(float) * nb + 1);
    if (!block) return NULL;
    int32_t *allowed = (int32_t *)block, *bias_ids = allowed + na;
    float *bias = (float *)(bias_ids + nb);
    if (na) memcpy(allowed, src->allowed_ids, sizeof(int32_t) * na);
    if (nb) memcpy(bias_ids, src->bias_ids, sizeof(int32_t) * nb);
    if (nb) memcpy(bias, src->bias, sizeof(float) * nb);
    dst->allowed_ids = na ? allowed : NULL;
    dst->bias_ids = nb ? bias_ids : NULL;
    dst->bias = nb ? bias : NULL;
    return block;
}

uint64_t sampling_seed_for(const sampling_params_t *p, int index) {
    if (p->has_seed) return p->seed + (uint64_t)index;
    uint64_t s;
    if (getentropy(&s, sizeof s) == 0) return s;
    static _Atomic uint64_t counter;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return ((uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec) ^
           (++counter * 0x9e3779b97f4a7c15ull);
}

static bool is_greedy(const sampling_params_t *p) { return p->temperature < SAMPLING_EPS; }

/* ---- thread-local scratch ---- */

typedef struct cand { float v; int32_t id; } cand_t;

static _Thread_local struct {
    float *x;      /* (vocab) processed logits */
    float *e;      /* (vocab) exp(x - max) */
    cand_t *c;     /* (vocab) surviving candidates, for top-k / top-p */
    size_t cap;
    double lse;    /* process(): log-sum-exp of x after the temperature, before min-p/top-k/top-p */
} tl;

void sampling_scratch_free(void) {
    free(tl.x);
    free(tl.e);
    free(tl.c);
    memset(&tl, 0, sizeof tl);
}

static void scratch_reserve(int n) {
    if ((size_t)n <= tl.cap) return;
    sampling_scratch_free();
    tl.x = malloc(sizeof(float) * (size_t)n);
    tl.e = malloc(sizeof(float) * (size_t)n);
    tl.c = malloc(sizeof(cand_t) * (size_t)n);
    CS_ASSERT(tl.x && tl.e && tl.c); /* a few MB for the largest vocabularies */
    tl.cap = (size_t)n;
}

/* ---- sparse token counts: open addressing, linear probing ---- */

#define IN_PROMPT 0x80000000u
typedef struct slot { int32_t key; uint32_t val; } slot_t; /* key -1: empty; val: flag | count */

struct sampler {
    sampling_params_t p;
    int vocab;
    cs_rng_t rng;
    bool track_prompt, track_output;
    slot_t *slots;
    uint32_t cap, used;     /* cap is a power of two, used <= cap / 2 */
    void *lists;            /* the sampler's own copy of p's allowed ids (sorted, distinct) and
                               logit bias (sampling_lists_copy), p pointing into it */
    float *kept;            /* [p.n_allowed] scratch for the allowed ids' values */
};

static inline uint32_t hash32(int32_t k) { return (uint32_t)k * 0x9e3779b1u; }

static slot_t *map_find(sampler_t *s, int32_t key, bool insert) {
    if (insert && (s->used + 1) * 2 > s->cap) {
        uint32_t ncap = s->cap ? s->cap * 2 : 16;
        slot_t *ns = malloc(sizeof(slot_t) * ncap);
        if (!ns) return NULL;
        for (uint32_t i = 0; i < ncap; i++) ns[i].key = -1;
        for (uint32_t i = 0; i < s->cap; i++) {
            if (s->slots[i].key < 0) continue;
            uint32_t h = hash32(s->slots[i].key) & (ncap - 1);
            while (ns[h].key >= 0) h = (h + 1) & (ncap - 1);
            ns[h] = s->slots[i];
        }
        free(s->slots);
        s->slots = ns;
        s->cap = ncap;
    }
    if (!s->cap) return NULL;
    uint32_t h = hash32(key) & (s->cap - 1);
    while (s->slots[h].key >= 0) {
        if (s->slots[h].key == key) return &s->slots[h];
        h = (h + 1) & (s->cap - 1);
    }
    if (!insert) return NULL;
    s->slots[h] = (slot_t){key, 0};
    s->used++;
    return &s->slots[h];
}

static int id_cmp(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

sampler_t *sampler_new(const sampling_params_t *p, int vocab, const int32_t *prompt, int n_prompt,
                       uint64_t seed) {
    if (sampling_params_validate(p)) return NULL;
    if (vocab <= 0) {
        cs_error_set(CS_EINVAL, "sampler: vocab %d", vocab);
        return NULL;
    }
    sampler_t *s = calloc(1, sizeof *s);
    if (!s) goto err;
    s->p = *p;
    s->vocab = vocab;
    if (sampling_params_validate_ids(p, vocab)) {
        free(s);
        return NULL;
    }
    if ((p->n_allowed || p->n_bias) && !(s->lists = sampling_lists_copy(p, &s->p))) goto err;
    if (p->n_allowed) {
        int32_t *allowed = (int32_t *)s->p.allowed_ids;
        if (!(s->kept = malloc(sizeof(float) * (size_t)p->n_allowed))) goto err;
        qsort(allowed, (size_t)p->n_allowed, sizeof(int32_t), id_cmp);
        int n = 0;
        for (int i = 0; i < p->n_allowed; i++)
            if (!n || allowed[i] != allowed[n - 1]) allowed[n++] = allowed[i];
        s->p.n_allowed = n;
    }
    cs_rng_seed(&s->rng, seed);
    s->track_prompt = p->repetition_penalty != 1.0f;
    s->track_output = s->track_prompt || p->presence_penalty != 0.0f || p->frequency_penalty != 0.0f;
    for (int i = 0; s->track_prompt && i < n_prompt; i++) {
        if (prompt[i] < 0 || prompt[i] >= vocab) continue;
        slot_t *sl = map_find(s, prompt[i], true);
        if (!sl) goto err;
        sl->val |= IN_PROMPT;
    }
    return s;
err:
    sampler_free(s);
    cs_error_set(CS_ENOMEM, "sampler: out of memory");
    return NULL;
}

void sampler_free(sampler_t *s) {
    if (!s) return;
    free(s->lists);
    free(s->kept);
    free(s->slots);
    free(s);
}


void sampler_accept(sampler_t *s, int32_t token) {
    if (!s->track_output || token < 0 || token >= s->vocab) return;
    slot_t *sl = map_find(s, token, true);
    CS_ASSERT(sl); /* a few bytes per distinct output token */
    if ((sl->val & ~IN_PROMPT) != ~IN_PROMPT) sl->val++;
}

/* ---- the steps ---- */

int32_t sampling_argmax(const float *x, int n) {
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

static float max_of(const float *x, int n) {
    float m = -INFINITY;
    for (int i = 0; i < n; i++)
        if (x[i] > m) m = x[i];
    return m;
}

void sampling_log_softmax(float *out, const float *x, int n) {
    float mx = max_of(x, n);
    double sum = 0;
    for (int i = 0; i < n; i++) sum += exp((double)x[i] - mx);
    double lse = mx + log(sum);
    for (int i = 0; i < n; i++) out[i] = (float)((double)x[i] - lse);
}

static void apply_penalties(const sampler_t *s, float *x) {
    if (!s->track_output) return;
    const float r = s->p.repetition_penalty, inv_r = 1.0f / r;
    const float fp = s->p.frequency_penalty, pp = s->p.presence_penalty;
    for (uint32_t i = 0; i < s->cap; i++) {
        const slot_t *sl = &s->slots[i];
        if (sl->key < 0) continue;
        float *v = &x[sl->key];
        uint32_t count = sl->val & ~IN_PROMPT;
        if (r != 1.0f) *v *= *v > 0 ? inv_r : r;
        if (count) {
            *v -= fp * (float)count;
            *v -= pp;
        }
    }
}

/* a before b in the canonical order: value desc, id asc */
static inline bool cand_before(cand_t a, cand_t b) { return a.v > b.v || (a.v == b.v && a.id < b.id); }

static int cand_cmp(const void *pa, const void *pb) {
    cand_t a = *(const cand_t *)pa, b = *(const cand_t *)pb;
    return cand_before(a, b) ? -1 : cand_before(b, a) ? 1 : 0;
}

static inline void cand_swap(cand_t *c, int i, int j) {
    cand_t t = c[i];
    c[i] = c[j];
    c[j] = t;
}

/* Rearranges c[0..n) so that c[0..k) are its k first in canonical order (unsorted).
 * Quickselect with a median-of-three pivot; the keys are distinct (ids are). */
static void select_first(cand_t *c, int n, int k) {
    int lo = 0, hi = n - 1, rounds = 0;
    while (lo < hi && k > lo && k <= hi) {
        if (++rounds > 64) { /* adversarial input: give up on selecting, sort the range */
            qsort(c + lo, (size_t)(hi - lo + 1), sizeof *c, cand_cmp);
            return;
        }
        int mid = lo + (hi - lo) / 2;
        if (cand_before(c[mid], c[lo])) cand_swap(c, mid, lo);
        if (cand_before(c[hi], c[lo])) cand_swap(c, hi, lo);
        if (cand_before(c[hi], c[mid])) cand_swap(c, hi, mid);
        cand_t pivot = c[mid];
        int i = lo, j = hi;
        while (i <= j) {
            while (cand_before(c[i], pivot)) i++;
            while (cand_before(pivot, c[j])) j--;
            if (i <= j) cand_swap(c, i++, j--);
        }
        /* now c[lo..j] <= pivot-ish before c[i..hi]; elements between j and i equal pivot */
        if (k <= j) hi = j;
        else if (k >= i) lo = i;
        else return;
    }
}

/* Buckets by distance below the max m, monotone in the value: 1/51 nat wide, everything
 * 40 nats or more below in the last one. top-k and top-p only order inside one bucket. */
enum { NB = 2048 };
static inline int bucket_of(float v, float m) {
    double d = (double)m - v;
    return d >= 40 ? NB - 1 : (int)(d * ((NB - 1) / 40.0));
}

/* Steps 1..6 into x; returns false when greedy (x then holds step 2's result). */
static bool process(sampler_t *s, const float *logits, const int32_t *banned, int n_banned, float *x) {
    const int n = s->vocab;
    memcpy(x, logits, sizeof(float) * (size_t)n);
    if (s->p.n_allowed) { /* keep the allowed ones' values, mask everything, put them back */
        const int32_t *allowed = s->p.allowed_ids;
        for (int i = 0; i < s->p.n_allowed; i++) s->kept[i] = x[allowed[i]];
        for (int i = 0; i < n; i++) x[i] = -INFINITY;
        for (int i = 0; i < s->p.n_allowed; i++) x[allowed[i]] = s->kept[i];
    }
    for (int i = 0; i < n_banned; i++)
        if (banned[i] >= 0 && banned[i] < n) x[banned[i]] = -INFINITY;
    for (int i = 0; i < s->p.n_bias; i++) x[s->p.bias_ids[i]] += s->p.bias[i];
    apply_penalties(s, x);
    if (is_greedy(&s->p)) return false;

    const float T = s->p.temperature < MIN_TEMP ? MIN_TEMP : s->p.temperature;
    if (T != 1.0f)
        for (int i = 0; i < n; i++) x[i] /= T;
    const float m = max_of(x, n);
    tl.lse = m;
    if (m == -INFINITY) return true;
    if (s->p.logprobs >= 0 && s->p.logprobs_mode == SAMPLING_LOGPROBS_PROCESSED) { /* the kept mass's denominator */
        double z = 0;
        for (int i = 0; i < n; i++) z += exp((double)x[i] - m);
        tl.lse = m + log(z);
    }

    if (s->p.min_p > 0) { /* p_i < min_p * p_max  <=>  x_i - m < log(min_p) */
        const double lmin = log((double)s->p.min_p);
        for (int i = 0; i < n; i++)
            if ((double)x[i] - m < lmin) x[i] = -INFINITY;
    }
    const bool top_k = s->p.top_k > 0 && s->p.top_k < n, top_p = s->p.top_p < 1.0f;
    if (!top_k && !top_p) return true;

    cand_t *c = tl.c;
    int nc = 0;
    for (int i = 0; i < n; i++)
        if (x[i] > -INFINITY) c[nc++] = (cand_t){x[i], i};
    int keep = nc;
    if (top_k && s->p.top_k < nc) {
        /* count per bucket, then select only inside the bucket that holds the k-th */
        int k = s->p.top_k, cnt[NB] = {0}, b = 0, before = 0;
        for (int i = 0; i < nc; i++) cnt[bucket_of(c[i].v, m)]++;
        while (before + cnt[b] < k) before += cnt[b++];
        int front = 0, end;
        for (int i = 0; i < nc; i++)
            if (bucket_of(c[i].v, m) < b) cand_swap(c, front++, i);
        end = front;
        for (int i = front; i < nc; i++)
            if (bucket_of(c[i].v, m) == b) cand_swap(c, end++, i);
        select_first(c + front, end - front, k - front);
        int worst = front; /* the k-th: last of c[front..k) in canonical order */
        for (int i = front + 1; i < k; i++)
            if (cand_before(c[worst], c[i])) worst = i;
        float v = c[worst].v;
        keep = k;
        for (int i = k; i < end; i++) /* ties with the k-th survive, as in vLLM */
            if (c[i].v == v) cand_swap(c, keep++, i);
    }
    if (top_p) {
        /* The kept set is a canonical prefix, so only the tokens around the cut need an
         * order. Bucket the survivors by distance below the max (monotone in the value),
         * find the bucket where the cumulative mass reaches top_p * Z, keep every bucket
         * before it and sort just that one; a full sort only when all the mass sits in one
         * bucket. */
        double mass[NB] = {0}, z = 0;
        for (int i = 0; i < keep; i++) {
            double e = expf(c[i].v - m);
            mass[bucket_of(c[i].v, m)] += e;
            z += e;
        }
        const double target = (double)s->p.top_p * z;
        double cum = 0;
        int b = 0;
        while (b < NB && cum + mass[b] < target) cum += mass[b++];
        if (b < NB) {
            int front = 0; /* buckets before b: kept; then bucket b, sorted */
            for (int i = 0; i < keep; i++)
                if (bucket_of(c[i].v, m) < b) cand_swap(c, front++, i);
            int end = front;
            for (int i = front; i < keep; i++)
                if (bucket_of(c[i].v, m) == b) cand_swap(c, end++, i);
            qsort(c + front, (size_t)(end - front), sizeof *c, cand_cmp);
            int cut = end;
            for (int r = front; r < end; r++) {
                if (!(cum < target)) {
                    cut = r;
                    break;
                }
                cum += expf(c[r].v - m);
            }
            keep = cut;
        }
    }
    for (int i = keep; i < nc; i++) x[c[i].id] = -INFINITY;
    return true;
}

void sampler_process(sampler_t *s, const float *logits, const int32_t *banned, int n_banned,
                     float *out_logits) {
    scratch_reserve(s->vocab);
    process(s, logits, banned, n_banned, out_logits);
}

/* e[i] = exp(x[i] - max) and returns their sum (double); *mx gets the max. */
static double exps(const float *x, int n, float *e, float *mx) {
    float m = max_of(x, n);
    double z = 0;
    for (int i = 0; i < n; i++) z += e[i] = expf(x[i] - m);
    *mx = m;
    return z;
}

/* Inverse CDF in id order with one uniform u: the first id whose cumulative mass > u * z. */
static int32_t draw(const float *e, int n, double z, double u) {
    const double t = u * z;
    double acc = 0;
    int32_t last = -1;
    for (int i = 0; i < n; i++) {
        if (e[i] <= 0) continue;
        acc += e[i];
        last = i;
        if (t < acc) return i;
    }
    return last; /* t landed on rounding slack */
}

/* Logprobs of x (log_softmax) into out: the token's, its rank and the top n_top. */
static void fill_logprobs(const float *x, int n, int32_t token, int n_top, sample_out_t *out) {
    float m = max_of(x, n);
    double z = 0;
    for (int i = 0; i < n; i++) z += expf(x[i] - m);
    const double lse = (double)m + log(z);
    const float xt = x[token];
    int rank = 0, nt = 0;
    sample_logprob_t *top = out->top; /* holds x values until the end */
    if (n_top > n) n_top = n;
    for (int i = 0; i < n; i++) {
        rank += x[i] >= xt;
        if (n_top == 0) continue;
        if (nt == n_top && !(x[i] > top[nt - 1].logprob)) continue; /* ties: lower id won */
        int j = nt < n_top ? nt++ : nt - 1;
        while (j > 0 && x[i] > top[j - 1].logprob) {
            top[j] = top[j - 1];
            j--;
        }
        top[j] = (sample_logprob_t){i, x[i]};
    }
    for (int i = 0; i < nt; i++)
        top[i].logprob = top[i].logprob == -INFINITY ? -INFINITY : (float)((double)top[i].logprob - lse);
    out->n_top = nt;
    out->rank = rank;
    out->logprob = xt == -INFINITY ? -INFINITY : (float)((double)xt - lse);
}

void sampling_logprobs_of(const float *logits, int n, int32_t token, int n_top, sample_out_t *out) {
    memset(out, 0, sizeof *out);
    out->token = token;
    fill_logprobs(logits, n, token, CS_MIN(n_top, SAMPLING_MAX_LOGPROBS), out);
}

void sampler_resume(sampler_t *s, const int32_t *tokens, int n) {
    for (int i = 0; i < n; i++) {
        sampler_accept(s, tokens[i]);
        if (!is_greedy(&s->p)) (void)cs_rng_uniform(&s->rng); /* sampler_sample's one draw */
    }
}

int32_t sampler_sample(sampler_t *s, const float *logits, const int32_t *banned, int n_banned,
                       sample_out_t *out) {
    const int n = s->vocab;
    scratch_reserve(n);
    float *x = tl.x;
    int32_t token;
    double kept = 0;
    if (!process(s, logits, banned, n_banned, x)) {
        token = sampling_argmax(x, n);
        if (x[token] == -INFINITY) token = -1;
    } else {
        float m;
        double z = exps(x, n, tl.e, &m);
        token = z > 0 ? draw(tl.e, n, z, cs_rng_uniform(&s->rng)) : -1;
        kept = z > 0 ? (double)m + log(z) - tl.lse : 0;
    }
    if (token < 0) return cs_error_set(CS_EINVAL, "sampler: every token is banned or masked");
    if (out) {
        memset(out, 0, sizeof *out);
        out->token = token;
        if (s->p.logprobs >= 0)
            fill_logprobs(s->p.logprobs_mode == SAMPLING_LOGPROBS_RAW ? logits : x, n, token,
                          s->p.logprobs, out);
        if (s->p.logprobs >= 0 && s->p.logprobs_mode == SAMPLING_LOGPROBS_PROCESSED) out->kept_logmass = (float)kept;
    }
    return token;
}

int32_t sampling_sample(const float *logits, int n, const sampling_params_t *p, cs_rng_t *rng) {
    if (is_greedy(p)) return sampling_argmax(logits, n);
    scratch_reserve(n);
    const float T = p->temperature < MIN_TEMP ? MIN_TEMP : p->temperature;
    for (int i = 0; i < n; i++) tl.x[i] = logits[i] / T;
    float m;
    double z = exps(tl.x, n, tl.e, &m);
    int32_t t = draw(tl.e, n, z, cs_rng_uniform(rng));
    return t < 0 ? sampling_argmax(logits, n) : t;
}
