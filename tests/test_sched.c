/* test_sched.c: the scheduling policies and the cost model, without an engine: the cost
 * model recovers known coefficients from synthetic steps (with noise, a term that does not
 * matter, a speed change it must follow), saves and loads; fcfs answers as the engine's
 * old hard-coded policy did; the per-model SLO table applies its levels in order. */
#include <check.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/rng.h"
#include "sched/cost.h"
#include "sched/fcfs.h"
#include "sched/route.h"
#include "sched/slo.h"
#include "testutil.h"

static cs_rng_t rng;

static double gauss(void) { /* Box-Muller */
    double u = cs_rng_uniform(&rng), v = cs_rng_uniform(&rng);
    return sqrt(-2 * log(u > 1e-300 ? u : 1e-300)) * cos(2 * M_PI * v);
}

/* a random batch: prefill tokens, decode rows, up to 8 adapters of ranks {8,16,32,64} over
 * its rows */
static sched_step_t random_step(void) {
    static const int ranks[4] = {8, 16, 32, 64};
    sched_step_t st = {0};
    st.prefill_tokens = cs_rng_uniform(&rng) < 0.4 ? 0 : (int)(cs_rng_uniform(&rng) * 512);
    st.decode_rows = (int)(cs_rng_uniform(&rng) * 33);
    int rows = st.prefill_tokens + st.decode_rows;
    st.n_adapters = (int)(cs_rng_uniform(&rng) * 9);
    if (rows == 0) { st.decode_rows = rows = 1; }
    int left = rows;
    for (int a = 0; a < st.n_adapters && left > 0; a++) {
        int r = ranks[(int)(cs_rng_uniform(&rng) * 4)];
        int n = a == st.n_adapters - 1 ? left : 1 + (int)(cs_rng_uniform(&rng) * left / 2);
        left -= n;
        st.rank_sum += r;
        st.max_rank = CS_MAX(st.max_rank, r);
        st.row_rank_sum += (long)n * r;
    }
    st.n_seqs = st.decode_rows + (st.prefill_tokens > 0);
    return st;
}

static double true_ms(const double *c, const sched_step_t *st) {
    double x[COST_N_TERMS];
    cost_terms(st, x);
    double t = 0;
    for (int i = 0; i < COST_N_TERMS; i++) t += c[i] * x[i];
    return t;
}

static void feed(cost_model_t *m, const double *c, int n, double noise) {
    for (int k = 0; k < n; k++) {
        sched_step_t st = random_step();
        double t = true_ms(c, &st);
        st.forward_ms = t * (1 + noise * gauss());
        cost_model_observe(m, &st);
    }
}

/* feeds M N random steps priced by C with NOISE, fits it and writes the fit to F */
static void fit_on(cost_model_t *m, const double *c, int n, double noise, cost_fit_t *f) {
    feed(m, c, n, noise);
    ck_assert_int_eq(cost_model_fit(m), CS_OK);
    cost_model_get(m, f);
}

START_TEST(cost_recovers_coefficients) {
    /* ms: fixed, per prefill token, per decode row, per adapter rank, per row x max rank, per row rank */
    static const double c[COST_N_TERMS] = {2.0, 0.05, 0.3, 0.02, 0.001, 0.004};
    cost_model_t *m = cost_model_new(1);
    cs_error_clear();
    ck_assert_int_eq(cost_model_fit(m), CS_EAGAIN);
    cost_fit_t f;
    fit_on(m, c, 4000, 0.01, &f);
    for (int i = 0; i < COST_N_TERMS; i++) {
        fprintf(stderr, "cost %-16s true %.4f fitted %.4f\n", cost_term_names[i], c[i], f.coef[i]);
        ck_assert_msg(fabs(f.coef[i] - c[i]) <= 0.05 * c[i], "%s: %g, true %g", cost_term_names[i], f.coef[i], c[i]);
    }
    fprintf(stderr, "cost R² %.5f, held-out error %.4f over %ld steps (fit on %ld)\n", f.r2, f.heldout_mape, f.n_heldout,
            f.n_fit);
    ck_assert(f.r2 > 0.99);
    ck_assert(f.heldout_mape < 0.02); /* 1% noise: the held-out error is about 0.8% */
    ck_assert_int_eq(f.n_heldout, 256); /* every fifth step, the last 256 */
    ck_assert_int_eq(f.n_fit, 3200);
    sched_step_t st = random_step();
    ck_assert(fabs(cost_model_predict(m, &st) - true_ms(c, &st)) < 0.03 * true_ms(c, &st));
    cost_model_free(m);
}
END_TEST

/* a term that costs nothing gets 0, never a negative coefficient; nothing learnt of a term
 * never seen (no adapters at all): 0 */
START_TEST(cost_nonnegative) {
    static const double c[COST_N_TERMS] = {1.5, 0.04, 0.25, 0.0, 0.0, 0.006};
    cost_model_t *m = cost_model_new(1);
    cost_fit_t f;
    fit_on(m, c, 3000, 0.02, &f);
    for (int i = 0; i < COST_N_TERMS; i++) {
        fprintf(stderr, "cost (zeros) %-16s true %.4f fitted %.5f\n", cost_term_names[i], c[i], f.coef[i]);
        ck_assert(f.coef[i] >= 0);
    }
    ck_assert(f.coef[3] < 0.002 && f.coef[4] < 0.0002);
    ck_assert(f.heldout_mape < 0.04);
    cost_model_free(m);

    m = cost_model_new(1); /* base model only */
    for (int k = 0; k < 200; k++) {
        sched_step_t st = {.prefill_tokens = k % 3 ? 0 : 64 + k, .decode_rows = 1 + k % 16};
        st.forward_ms = 1.0 + 0.05 * st.prefill_tokens + 0.2 * st.decode_rows;
        cost_model_observe(m, &st);
    }
    ck_assert_int_eq(cost_model_fit(m), CS_OK);
    cost_model_get(m, &f);
    ck_assert(fabs(f.coef[0] - 1.0) < 1e-6 && fabs(f.coef[1] - 0.05) < 1e-9 && fabs(f.coef[2] - 0.2) < 1e-8);
    ck_assert(f.coef[3] == 0 && f.coef[4] == 0 && f.coef[5] == 0);
    ck_assert(f.r2 > 0.999999);
    cost_model_free(m);
}
END_TEST

/* with forgetting, the model follows a machine that became twice as slow */
START_TEST(cost_follows_drift) {
    static const double c[COST_N_TERMS] = {2.0, 0.05, 0.3, 0.02, 0.001, 0.004};
    double c2[COST_N_TERMS];
    for (int i = 0; i < COST_N_TERMS; i++) c2[i] = 2 * c[i];
    cost_model_t *m = cost_model_new(0.99), *still = cost_model_new(1);
    feed(m, c, 2000, 0.01);
    feed(m, c2, 1000, 0.01);
    feed(still, c, 2000, 0.01);
    feed(still, c2, 1000, 0.01);
    ck_assert_int_eq(cost_model_fit(m), CS_OK);
    ck_assert_int_eq(cost_model_fit(still), CS_OK);
    double err = 0, err_still = 0;
    for (int k = 0; k < 200; k++) {
        sched_step_t st = random_step();
        double t = true_ms(c2, &st);
        err += fabs(cost_model_predict(m, &st) - t) / t;
        err_still += fabs(cost_model_predict(still, &st) - t) / t;
    }
    fprintf(stderr, "cost after a 2x slow-down: forgetting %.4f, not %.4f mean error\n", err / 200, err_still / 200);
    ck_assert(err / 200 < 0.03);
    ck_assert(err_still / 200 > 0.1);
    cost_model_free(m);
    cost_model_free(still);
}
END_TEST

START_TEST(cost_save_load) {
    static const double c[COST_N_TERMS] = {2.0, 0.05, 0.3, 0.02, 0.001, 0.004};
    cost_model_t *m = cost_model_new(1), *m2 = cost_model_new(1);
    feed(m, c, 1000, 0.01);
    ck_assert_int_eq(cost_model_fit(m), CS_OK);
    char path[] = "/tmp/cs_cost_XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    close(fd);
    ck_assert_int_eq(cost_model_save(m, path), CS_OK);
    ck_assert_int_eq(cost_model_load(m2, path), CS_OK);
    cost_fit_t a, b;
    cost_model_get(m, &a);
    cost_model_get(m2, &b);
    for (int i = 0; i < COST_N_TERMS; i++) ck_assert(fabs(a.coef[i] - b.coef[i]) <= 1e-12 * (1 + fabs(a.coef[i])));
    ck_assert_int_eq(a.n_fit, b.n_fit);
    sched_step_t st = random_step();
    ck_assert(fabs(cost_model_predict(m, &st) - cost_model_predict(m2, &st)) < 1e-9);
    FILE *f = fopen(path, "w");
    fputs("{\"terms\": {\"fixed\": -1}}", f);
    fclose(f);
    ck_assert_int_eq(cost_model_load(m2, path), CS_EFORMAT);
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "terms.fixed"));
    unlink(path);
    cost_model_free(m);
    cost_model_free(m2);
}
END_TEST

/* fcfs: the queues in their order, whole chunks, head of line, the newest preempted */
START_TEST(fcfs_policy) {
    sched_t *s = sched_fcfs_new(NULL);
    ck_assert_str_eq(sched_name(s), "fcfs");
    sched_view_t v[4] = {{.admit_order = 3}, {.admit_order = 9}, {.admit_order = 1}, {.admit_order = 9}};
    int perm[4];
    s->iface->order_running(s, v, 4, perm);
    for (int i = 0; i < 4; i++) ck_assert_int_eq(perm[i], i);
    s->iface->order_waiting(s, v, 4, perm);
    for (int i = 0; i < 4; i++) ck_assert_int_eq(perm[i], i);
    ck_assert_int_eq(s->iface->chunk(s, &v[0], 77), 77);
    ck_assert(!s->iface->pass_blocked(s, &v[0]));
    ck_assert_int_eq(s->iface->victim(s, v, 4), 1); /* the first of the newest */
    sched_free(s);
}
END_TEST


/* ---- the slo policy on scripted queues ---- */
static double fake_now;
static double clock_of(void *u) { (void)u; return fake_now; }

/* ms: fixed 2, prefill token 0.05, decode row 0.5, adapter rank 0.05 (a rank-64 adapter: 3.2) */
static cost_model_t *priced(void) {
    cost_model_t *m = cost_model_new(1);
    cost_fit_t f = {.coef = {2.0, 0.05, 0.5, 0.05, 0, 0}, .r2 = 1};
    cost_model_set(m, &f);
    return m;
}

static sched_view_t decoding(uint64_t id, const char *adapter, int rank, double tpot) {
    sched_view_t v = {.req_id = id, .running = true, .admitted_once = true, .admit_order = id, .n_prompt = 10,
                      .n_tokens = 15, .n_computed = 14, .n_generated = 5, .max_tokens = 100, .n = 1,
                      .adapter = adapter, .lora_known = adapter != NULL, .slo_tpot_ms = tpot};
    v.lora.max_rank = rank;
    v.tier = adapter ? SCHED_TIER_DEVICE : SCHED_TIER_BASE;
    return v;
}

/* 8 base decode rows (ids 1 to 8) with a TPOT SLO of TPOT ms, each with its 5 tokens out on
 * time: nothing banked */
static void on_time_rows(sched_view_t run[8], double tpot) {
    for (int i = 0; i < 8; i++) {
        run[i] = decoding((uint64_t)i + 1, NULL, 0, tpot);
        run[i].t_first_ms = fake_now - 5 * tpot;
    }
}

static sched_view_t waiting(uint64_t id, const char *adapter, int rank, int prompt, double t_submit) {
    sched_view_t v = {.req_id = id, .n_prompt = prompt, .n_tokens = prompt, .max_tokens = 10, .n = 1,
                      .t_submit_ms = t_submit, .adapter = adapter, .lora_known = adapter != NULL};
    v.lora.max_rank = rank;
    return v;
}

/* one iteration's protocol up to the waiting ones: the running views each take their chunk */
static void run_iteration(sched_t *s, sched_view_t *run, int n) {
    int perm[16];
    s->iface->order_running(s, run, n, perm);
    for (int k = 0; k < n; k++) ck_assert_int_eq(s->iface->chunk(s, &run[perm[k]], 1), 1);
}

/* the slo policy on cost model M at HEADROOM (0: its default), reading the fake clock */
static sched_t *slo_at(cost_model_t *m, double headroom) {
    return sched_slo_new(&(sched_slo_params_t){.cost = m, .now_ms = clock_of, .headroom = headroom});
}

/* one iteration of RUN[0..n), then the chunk S gives waiting W of MAX tokens */
static int chunk_after(sched_t *s, sched_view_t *run, int n, sched_view_t *w, int max) {
    run_iteration(s, run, n);
    return s->iface->chunk(s, w, max);
}

/* at fake time 100000 on the priced model: 8 on-time base decode rows with a TPOT SLO of
 * TPOT ms (they cost 2 + 8 x 0.5 = 6) and a base prompt of 100 tokens waiting */
typedef struct queue {
    cost_model_t *m;
    sched_view_t run[8];
    sched_view_t w;
} queue_t;

static void queue_init(queue_t *q, double tpot) {
    q->m = priced();
    fake_now = 100000;
    on_time_rows(q->run, tpot);
    q->w = waiting(20, NULL, 0, 100, fake_now);
}

/* one iteration of Q's rows under S, then the chunk of Q's prompt S admits */
static int queue_chunk(sched_t *s, queue_t *q) { return chunk_after(s, q->run, 8, &q->w, 100); }

START_TEST(slo_admits_what_fits) {
    cost_model_t *m = priced();
    fake_now = 100000;
    sched_t *s = slo_at(m, 1);
    ck_assert_str_eq(sched_name(s), "slo");
    /* 8 base decode rows, the default SLO: 1.5 x (2 + 8 x 0.5) = 9 ms; they cost 6 */
    sched_view_t run[8];
    for (int i = 0; i < 8; i++) run[i] = decoding((uint64_t)i + 1, NULL, 0, 0);
    run_iteration(s, run, 8);
    sched_view_t w[3] = {waiting(20, "r64", 64, 20, fake_now), waiting(21, NULL, 0, 20, fake_now),
                         waiting(22, NULL, 0, 1000, fake_now)};
    /* the rank-64 adapter would cost 6 + 0.8 + 3.2 = 10 > 9 even at 16 tokens: not now */
    ck_assert_int_eq(s->iface->chunk(s, &w[0], 20), 0);
    /* the base request fits whole: 6 + 1 = 7 */
    ck_assert_int_eq(s->iface->chunk(s, &w[1], 20), 20);
    /* a long prompt is cut to what still fits: 7 + 0.05 c <= 9: c = 40 */
    ck_assert_int_eq(s->iface->chunk(s, &w[2], 512), 40);
    sched_free(s);

    /* the same rank-64 request past its deadline + starve_ms: admitted whatever the cost, and
     * nobody passes it while the cache cannot hold it */
    s = sched_slo_new(&(sched_slo_params_t){.cost = m, .now_ms = clock_of, .headroom = 1, .default_ttft_ms = 1000, .starve_ms = 500});
    run_iteration(s, run, 8);
    sched_view_t old = waiting(30, "r64", 64, 20, fake_now - 1501);
    ck_assert_int_eq(s->iface->chunk(s, &old, 20), 20);
    ck_assert(!s->iface->pass_blocked(s, &old));
    sched_view_t young = waiting(31, "r64", 64, 20, fake_now - 1499); /* 1 ms short of starving */
    ck_assert_int_eq(s->iface->chunk(s, &young, 20), 0);
    /* with a TTFT SLO of its own that one more iteration would break, it goes now: its deadline
     * is 10 ms away, this iteration (6: old was taken back by pass_blocked) and twice its own
     * prefill (2 + 0.05 x 20) take 12 */
    sched_view_t urgent = waiting(32, "r64", 64, 20, fake_now - 990);
    urgent.slo_ttft_ms = 1000;
    ck_assert_int_eq(s->iface->chunk(s, &urgent, 20), 20);
    sched_view_t calm = waiting(33, "r64", 64, 20, fake_now - 900); /* 100 ms left: it can wait */
    calm.slo_ttft_ms = 1000;
    ck_assert_int_eq(s->iface->chunk(s, &calm, 20), 0);
    sched_free(s);
    cost_model_free(m);
}
END_TEST

/* TPOT is a mean: time a running request has banked (faster iterations than its SLO) may go
 * to a longer iteration, a bigger prefill chunk; a request with nothing banked holds the
 * iteration to its SLO */
START_TEST(slo_tpot_budget) {
    queue_t q;
    queue_init(&q, 7);
    sched_t *s = slo_at(q.m, 1);
    ck_assert_int_eq(queue_chunk(s, &q), 20); /* 6 + 0.05 c <= 7 */
    /* the same rows 20 ms ahead of their SLO (the 6th token is due at t_first + 35): the
     * iteration may take 20 ms, the whole prompt fits (6 + 5 = 11) */
    for (int i = 0; i < 8; i++) q.run[i].t_first_ms = fake_now - 15;
    ck_assert_int_eq(queue_chunk(s, &q), 100);
    /* one row behind its SLO holds it to 7 ms again, never less */
    q.run[3].t_first_ms = fake_now - 60;
    ck_assert_int_eq(queue_chunk(s, &q), 20);
    sched_free(s);
    cost_model_free(q.m);
}
END_TEST

/* every TPOT bound is planned to headroom x the SLO, so a prediction that misses by a little
 * does not cost the SLO */
START_TEST(slo_headroom) {
    queue_t q;
    queue_init(&q, 10);
    /* 6 + 0.05 c <= 10 at headroom 1, <= 9 at 0.9 (the default), and with the default SLO too
     * (the rows' own cleared before the last): 6 + 0.05 c <= 0.9 x 1.5 x 6 = 8.1 */
    static const struct { double headroom, tpot; int chunk; } cases[] = {{1, 10, 80}, {0, 10, 60}, {0.9, 0, 42}};
    for (size_t i = 0; i < CS_ARRAY_LEN(cases); i++) {
        for (int r = 0; r < 8; r++) q.run[r].slo_tpot_ms = cases[i].tpot;
        sched_t *s = slo_at(q.m, cases[i].headroom);
        int c = queue_chunk(s, &q);
        ck_assert_msg(c == cases[i].chunk, "headroom %g, TPOT SLO %g: chunk %d, want %d", cases[i].headroom,
                      cases[i].tpot, c, cases[i].chunk);
        sched_free(s);
    }
    cost_model_free(q.m);
}
END_TEST

/* iterations measured slower than the model predicts (a busy neighbour) are priced as they are
 * now, before the model itself follows */
START_TEST(slo_drift) {
    queue_t q;
    queue_init(&q, 10);
    sched_t *s = slo_at(q.m, 1);
    ck_assert_int_eq(queue_chunk(s, &q), 80);
    /* 31 steps of those 8 rows, each measured at twice the predicted 6 ms (the 32nd would refit) */
    for (int k = 0; k < 31; k++) {
        sched_step_t st = {.n_seqs = 8, .decode_rows = 8, .forward_ms = 12};
        s->iface->feedback(s, &st);
    }
    cost_fit_t f;
    cost_model_get(q.m, &f);
    ck_assert(f.coef[0] == 2.0 && f.coef[2] == 0.5); /* the model has not moved */
    /* the rows alone are now priced over 10 ms: nothing joins them */
    ck_assert_int_eq(queue_chunk(s, &q), 0);
    /* rows with a 20 ms SLO: the whole prompt (6 + 5 = 11 by the model alone) no longer fits */
    for (int i = 0; i < 8; i++) {
        q.run[i].slo_tpot_ms = 20;
        q.run[i].t_first_ms = fake_now - 5 * 20;
    }
    int c = queue_chunk(s, &q);
    ck_assert_int_gt(c, 16);
    ck_assert_int_lt(c, 100);
    sched_free(s);
    cost_model_free(q.m);
}
END_TEST

/* requests of an adapter already in the batch pay no new adapter term: they group */
START_TEST(slo_groups_adapters) {
    cost_model_t *m = priced();
    fake_now = 5000;
    sched_t *s = slo_at(m, 1);
    /* 8 decode rows with an explicit 10 ms SLO, one on rank-64 adapter A: 2 + 4 + 3.2 = 9.2 */
    sched_view_t run[8];
    for (int i = 0; i < 8; i++) run[i] = decoding((uint64_t)i + 1, i == 0 ? "A" : NULL, 64, 10);
    run_iteration(s, run, 8);
    sched_view_t a = waiting(40, "A", 64, 16, fake_now), b = waiting(41, "B", 64, 16, fake_now);
    ck_assert_int_eq(s->iface->chunk(s, &b, 16), 0);  /* 9.2 + 0.8 + 3.2 = 13.2 > 10 */
    ck_assert_int_eq(s->iface->chunk(s, &a, 16), 16); /* 9.2 + 0.8 = 10.0 */
    sched_free(s);
    cost_model_free(m);
}
END_TEST

/* admission by slack (the preempted first), preemption of the one with the most slack; and
 * fcfs's order while the cost model has no fit */
START_TEST(slo_order_and_victim) {
    cost_model_t *m = priced();
    fake_now = 50000;
    sched_t *s = slo_at(m, 1);
    run_iteration(s, NULL, 0);
    sched_view_t w[4] = {waiting(1, NULL, 0, 10, fake_now - 100), waiting(2, NULL, 0, 10, fake_now - 50),
                         waiting(3, NULL, 0, 10, fake_now - 10), waiting(4, NULL, 0, 10, fake_now - 5)};
    w[1].slo_ttft_ms = 200;    /* deadline now + 150: the most urgent of the new ones */
    w[3].admitted_once = true; /* preempted: first of all */
    int perm[4];
    s->iface->order_waiting(s, w, 4, perm);
    ck_assert_int_eq(perm[0], 3);
    ck_assert_int_eq(perm[1], 1);
    ck_assert_int_eq(perm[2], 0); /* then by deadline: submitted earliest */
    ck_assert_int_eq(perm[3], 2);
    sched_view_t r[3] = {decoding(1, NULL, 0, 10), decoding(2, NULL, 0, 0), decoding(3, NULL, 0, 0)};
    ck_assert_int_eq(s->iface->victim(s, r, 3), 2); /* no SLO of its own, admitted last */
    r[2].slo_tpot_ms = 10;
    ck_assert_int_eq(s->iface->victim(s, r, 3), 1);
    sched_free(s);
    cost_model_free(m);

    cost_model_t *fresh = cost_model_new(1); /* no fit yet: fcfs */
    s = slo_at(fresh, 1);
    run_iteration(s, NULL, 0);
    s->iface->order_waiting(s, w, 4, perm);
    for (int i = 0; i < 4; i++) ck_assert_int_eq(perm[i], i);
    sched_view_t big = waiting(9, "r64", 64, 900, fake_now);
    ck_assert_int_eq(s->iface->chunk(s, &big, 900), 900);
    sched_free(s);
    cost_model_free(fresh);
    cs_error_clear();
    ck_assert_ptr_null(sched_slo_new(&(sched_slo_params_t){0}));
    ck_assert_ptr_nonnull(strstr(cs_error_last(), "cost model"));
}
END_TEST

/* ---- routing (sched/route.h) ---- */
/* a replica whose iteration costs 1 ms + 0.01/prefill token + 0.1/decode row + 0.05 per unit
 * of Σ rank over distinct adapters: adapters' ranks dominate, as on a CPU */
static route_replica_t replica(const route_seq_t *seqs, int n, int n_requests) {
    route_replica_t r = {.healthy = true, .fitted = true, .seqs = seqs, .n_seqs = n, .n_requests = n_requests};
    r.coef[0] = 1.0, r.coef[1] = 0.01, r.coef[2] = 0.1, r.coef[3] = 0.05;
    return r;
}

START_TEST(route_rank_aware) {
    /* A runs two rank-64 requests of adapter "x", B two rank-8 ones of "y" */
    route_seq_t a[] = {{"x", 64, 0, 0, true}, {"x", 64, 0, 0, true}};
    route_seq_t b[] = {{"y", 8, 0, 0, true}, {"y", 8, 0, 0, true}};
    route_replica_t r[2] = {replica(a, 2, 2), replica(b, 2, 2)};
    route_req_t q = {.adapter = "x", .rank = 64, .prompt_tokens = 100, .n = 1, .expected_output = 50};
    route_eval_t ea, eb;
    route_evaluate(&r[0], &q, 0, &ea);
    route_evaluate(&r[1], &q, 0, &eb);
    /* on A its adapter is already in the batch: one more decode row; on B a new rank-64 adapter */
    ck_assert_double_eq_tol(ea.dec_running, 1 + 0.2 + 0.05 * 64, 1e-9);
    ck_assert_double_eq_tol(ea.dec_with - ea.dec_running, 0.1, 1e-9);
    ck_assert_double_eq_tol(eb.dec_with - eb.dec_running, 0.1 + 0.05 * 64, 1e-9);
    ck_assert_double_eq_tol(ea.pre_queue, 0, 1e-12); /* nothing to prefill: no iteration */
    ck_assert_double_eq_tol(ea.pre_with, 1 + 0.01 * 100 + 0.05 * 64, 1e-9);
    /* the default TPOT bound: 1.5 × the base model's iteration of 3 rows = 1.5 × 1.3 = 1.95 ms:
     * both break it (4.5 and 4.7 ms): every replica breaks the SLO, where it finishes first wins
     * (Pre 5.2 ms on each, then 50 × 4.5 on A against 50 × 4.7 on B) */
    ck_assert(isinf(ea.cost) && isinf(eb.cost));
    unsigned rr = 1;
    ck_assert_int_eq(route_pick(ROUTE_RANK_AWARE, r, 2, &q, 0, &rr), 0);
    /* with a TPOT SLO of its own that both keep, the lower score: A (no new adapter) */
    q.slo_tpot_ms = 10;
    rr = 1;
    ck_assert_int_eq(route_pick(ROUTE_RANK_AWARE, r, 2, &q, 0, &rr), 0);
    route_evaluate(&r[0], &q, 0, &ea);
    ck_assert_double_eq_tol(ea.cost, (ea.pre_with - ea.pre_queue) / 50 + 0.1, 1e-9);
    ck_assert_double_eq_tol(ea.score, ea.cost * 2, 1e-9);
    /* a rank-8 request of "y" belongs on B by the same reasoning */
    route_req_t qy = {.adapter = "y", .rank = 8, .prompt_tokens = 100, .n = 1, .expected_output = 50, .slo_tpot_ms = 10};
    rr = 0;
    ck_assert_int_eq(route_pick(ROUTE_RANK_AWARE, r, 2, &qy, 0, &rr), 1);
    /* an SLO that only A keeps */
    route_evaluate(&r[0], &q, 0, &ea);
    route_evaluate(&r[1], &q, 0, &eb);
    q.slo_tpot_ms = 4.55; /* A: 4.5 keeps it, B: 1+0.3+0.05*72 = 4.9 breaks it */
    rr = 1;
    ck_assert_int_eq(route_pick(ROUTE_RANK_AWARE, r, 2, &q, 0, &rr), 0);
    /* an idle replica scores 0 and takes it whatever the cost */
    route_replica_t r3[3] = {r[0], r[1], replica(NULL, 0, 0)};
    rr = 0;
    ck_assert_int_eq(route_pick(ROUTE_RANK_AWARE, r3, 3, &q, 0, &rr), 2);
    /* an unhealthy one never */
    r3[2].healthy = false;
    rr = 2;
    ck_assert_int_eq(route_pick(ROUTE_RANK_AWARE, r3, 3, &q, 0, &rr), 0);
    /* none healthy: -1 */
    for (int i = 0; i < 3; i++) r3[i].healthy = false;
    ck_assert_int_eq(route_pick(ROUTE_RANK_AWARE, r3, 3, &q, 0, &rr), -1);
}
END_TEST

/* When every replica breaks the SLO, a queue still counts: 4 rank-64 prompts waiting on
 * replica 0 (nothing running: its decode iteration is the idle one's) send a rank-64 request
 * to an idle replica, whatever the turn; and a paused replica is passed over by every policy
 * while another is not paused */
START_TEST(route_queue_and_pause) {
    route_seq_t w[4];
    for (int i = 0; i < 4; i++) w[i] = (route_seq_t){"x", 64, 64, 64, false};
    route_replica_t r[3] = {replica(w, 4, 4), replica(NULL, 0, 0), replica(NULL, 0, 0)};
    route_req_t q = {.adapter = "x", .rank = 64, .prompt_tokens = 5, .n = 1, .expected_output = 2};
    route_eval_t e0, e1;
    route_evaluate(&r[0], &q, 0, &e0);
    route_evaluate(&r[1], &q, 0, &e1);
    ck_assert(isinf(e0.cost) && isinf(e1.cost)); /* 1 + 0.1 + 3.2 > 1.5 × 1.1 */
    ck_assert_double_eq_tol(e0.dec_with, e1.dec_with, 1e-12);
    ck_assert_double_eq_tol(e0.pre_with - e1.pre_with, 0.01 * 256, 1e-9); /* the queue's prompts */
    for (unsigned start = 0; start < 3; start++) {
        unsigned rr = start;
        int got = route_pick(ROUTE_RANK_AWARE, r, 3, &q, 0, &rr);
        ck_assert_int_ne(got, 0);
        ck_assert_int_ge(got, 1);
    }
    /* the same queue with an SLO each keeps: the score (cost × 4 requests against 0) */
    q.slo_tpot_ms = 100;
    for (unsigned start = 0; start < 3; start++) {
        unsigned rr = start;
        ck_assert_int_ne(route_pick(ROUTE_RANK_AWARE, r, 3, &q, 0, &rr), 0);
    }
    /* paused: an idle paused replica 1 is passed over by every policy, however loaded the rest */
    route_replica_t p[3] = {replica(w, 4, 4), replica(NULL, 0, 0), replica(w, 4, 4)};
    p[1].paused = true;
    p[0].in_flight = 9, p[2].in_flight = 9;
    for (int pol = ROUTE_RANK_AWARE; pol <= ROUTE_LEAST_LOADED; pol++)
        for (unsigned start = 0; start < 3; start++) {
            unsigned rr = start;
            ck_assert_int_ne(route_pick((route_policy)pol, p, 3, &q, 0, &rr), 1);
        }
    /* ... but not when every healthy one is paused (an unhealthy unpaused one does not count) */
    p[0].paused = true;
    p[2].healthy = false;
    for (int pol = ROUTE_RANK_AWARE; pol <= ROUTE_LEAST_LOADED; pol++) {
        unsigned rr = 0;
        ck_assert_int_eq(route_pick((route_policy)pol, p, 3, &q, 0, &rr), pol == ROUTE_ROUND_ROBIN ? 0 : 1);
    }
}
END_TEST

START_TEST(route_queue_and_ties) {
    /* the same running set; A also has 400 prompt tokens queued of a new adapter */
    route_seq_t a[] = {{"x", 8, 0, 0, true}, {"z", 32, 0, 400, false}};
    route_seq_t b[] = {{"x", 8, 0, 0, true}};
    route_replica_t r[2] = {replica(a, 2, 2), replica(b, 1, 1)};
    route_req_t q = {.adapter = "x", .rank = 8, .prompt_tokens = 50, .n = 1, .expected_output = 10, .slo_tpot_ms = 100};
    route_eval_t ea;
    route_evaluate(&r[0], &q, 0, &ea);
    ck_assert_double_eq_tol(ea.pre_queue, 1 + 0.01 * 400 + 0.05 * 32, 1e-9);
    ck_assert_double_eq_tol(ea.pre_with - ea.pre_queue, 0.01 * 50 + 0.05 * 8, 1e-9);
    unsigned rr = 0;
    ck_assert_int_eq(route_pick(ROUTE_RANK_AWARE, r, 2, &q, 0, &rr), 1); /* load 2 vs 1 */
    /* equal replicas: in turn */
    route_replica_t e[3] = {replica(b, 1, 1), replica(b, 1, 1), replica(b, 1, 1)};
    rr = 0;
    int seen[3] = {0};
    for (int i = 0; i < 6; i++) seen[route_pick(ROUTE_RANK_AWARE, e, 3, &q, 0, &rr)]++;
    ck_assert(seen[0] == 2 && seen[1] == 2 && seen[2] == 2);
    /* unfitted replicas: load alone (in flight through the router), then in turn */
    for (int i = 0; i < 3; i++) e[i].fitted = false, e[i].in_flight = 3 - i;
    rr = 0;
    ck_assert_int_eq(route_pick(ROUTE_LEAST_LOADED, e, 3, &q, 0, &rr), 2);
    rr = 0;
    ck_assert_int_eq(route_pick(ROUTE_ROUND_ROBIN, e, 3, &q, 0, &rr), 0);
    ck_assert_int_eq(route_pick(ROUTE_ROUND_ROBIN, e, 3, &q, 0, &rr), 1);
    ck_assert_int_eq(route_policy_parse("rank-aware"), ROUTE_RANK_AWARE);
    ck_assert_int_eq(route_policy_parse("least-loaded"), ROUTE_LEAST_LOADED);
    ck_assert_int_eq(route_policy_parse("fastest"), -1);
}
END_TEST

/* the per-model SLO table (serve --adapter-slos): the request's own bounds, then the entry,
 * then "*", field by field; null is none and stops "*"; bad entries are refused by name */
static void apply(const sched_slo_table_t *t, const char *name, double own_ttft, double own_tpot, double want_ttft,
                  double want_tpot) {
    double ttft = own_ttft, tpot = own_tpot;
    sched_slo_table_apply(t, name, &ttft, &tpot);
    ck_assert_msg(ttft == want_ttft && tpot == want_tpot, "%s (own %g/%g): %g/%g, want %g/%g", name ? name : "(null)",
                  own_ttft, own_tpot, ttft, tpot, want_ttft, want_tpot);
}

static sched_slo_table_t *table_of(const char *text, char *err, size_t errlen) {
    json_error_t je;
    json_t *root = json_loads(text, 0, &je);
    ck_assert_msg(root != NULL, "%s: %s", text, je.text);
    sched_slo_table_t *t;
    if (sched_slo_table_parse(root, &t)) snprintf(err, errlen, "%s", cs_error_last());
    json_decref(root);
    return t;
}

START_TEST(slo_table) {
    char err[256];
    sched_slo_table_t *t = table_of("{\"a\": {\"ttft_ms\": 100}, \"b\": {\"ttft_ms\": 200, \"tpot_ms\": 20},"
                                    " \"c\": {\"tpot_ms\": null}, \"d\": null, \"e\": {},"
                                    " \"*\": {\"ttft_ms\": 1000, \"tpot_ms\": 50}}", err, sizeof err);
    ck_assert_msg(t != NULL, "%s", err);
    apply(t, "a", 0, 0, 100, 50);       /* the entry's TTFT, "*"'s TPOT */
    apply(t, "b", 0, 0, 200, 20);
    apply(t, "b", 7, 0, 7, 20);         /* the request's own, field by field */
    apply(t, "b", 0, 3, 200, 3);
    apply(t, "c", 0, 0, 1000, 0);       /* null: no TPOT, "*" does not fill it */
    apply(t, "d", 0, 0, 0, 0);          /* a null entry: none at all */
    apply(t, "d", 5, 0, 5, 0);
    apply(t, "e", 0, 0, 1000, 50);      /* an empty one: "*" */
    apply(t, "unlisted", 0, 0, 1000, 50);
    apply(t, NULL, 0, 0, 1000, 50);
    sched_slo_table_free(t);
    t = table_of("{\"a\": {\"ttft_ms\": 100}}", err, sizeof err); /* no "*": unlisted names get nothing */
    apply(t, "a", 0, 0, 100, 0);
    apply(t, "z", 0, 9, 0, 9);
    sched_slo_table_free(t);
    apply(NULL, "a", 4, 0, 4, 0);       /* no table */
    t = table_of("{}", err, sizeof err);
    ck_assert(t != NULL);
    apply(t, "a", 0, 0, 0, 0);
    sched_slo_table_free(t);
    static const struct { const char *text, *msg; } bad[] = {
        {"{\"a\": {\"ttft\": 1}}", "\"a\": slo.ttft: unknown (slo has ttft_ms and tpot_ms)"},
        {"{\"a\": {\"tpot_ms\": -1}}", "\"a\": slo.tpot_ms must be a number of milliseconds > 0"},
        {"{\"*\": {\"ttft_ms\": \"fast\"}}", "\"*\": slo.ttft_ms must be a number of milliseconds > 0"},
        {"{\"a\": 3}", "\"a\": 'slo' must be an object"},
        {"{\"\": {}}", "an empty name"},
        {"[]", "must be a JSON object"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = 0;
        ck_assert_msg(table_of(bad[i].text, err, sizeof err) == NULL, "%s was taken", bad[i].text);
        ck_assert_msg(strstr(err, bad[i].msg) != NULL, "%s: '%s' lacks '%s'", bad[i].text, err, bad[i].msg);
    }
    char path[] = "/tmp/cs_slo_table_XXXXXX";
    int fd = mkstemp(path);
    ck_assert(fd >= 0);
    const char *dup = "{\"a\": {}, \"a\": {}}";
    ck_assert(write(fd, dup, strlen(dup)) == (ssize_t)strlen(dup));
    close(fd);
    t = NULL;
    ck_assert_int_eq(sched_slo_table_load(path, &t), CS_EFORMAT);
    ck_assert(t == NULL);
    ck_assert_msg(strstr(cs_error_last(), "duplicate") != NULL, "%s", cs_error_last());
    unlink(path);
    ck_assert_int_ne(sched_slo_table_load(path, &t), CS_OK); /* gone */
    ck_assert(t == NULL);
}
END_TEST

int main(void) {
    cs_rng_seed(&rng, 12345);
    const TTest *const tests[] = {
        cost_recovers_coefficients, cost_nonnegative, cost_follows_drift, cost_save_load, fcfs_policy,
        slo_admits_what_fits, slo_groups_adapters, slo_tpot_budget, slo_headroom, slo_drift,
        slo_order_and_victim, route_rank_aware, route_queue_and_pause, route_queue_and_ties, slo_table,
    };
    return cs_check_main("sched", tests, CS_ARRAY_LEN(tests), 0, CK_FORK);
}
