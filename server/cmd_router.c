/* router.c: `caraserve router`, an HTTP front for several `caraserve serve` replicas of one
 * base model. The server's access handler (server/http.c) takes the requests, with the same
 * route table (server/routes.c), API key and body limits; each proxied request gets a thread
 * of its own that sends it upstream with libcurl (connections to the replicas are kept and
 * shared) and feeds the response back into the suspended client connection: Server-Sent
 * Events and NDJSON streams chunk by chunk as they come (http.c's stream reader), anything
 * else in one piece with its status. A poller thread reads every replica's GET /v1/state each
 * --poll-interval-ms (running and waiting sequences with their ranks, its cost model); the
 * policy (sched/route.h) places each generation request from those states plus what this
 * router sent since. Admin requests (adapter loads and uploads, pause/resume, aborts) go to
 * every healthy replica.
 *
 * Failures: a replica that refuses connections or fails its poll is taken out until a poll
 * succeeds again; a request whose connection could not be made is sent to another replica
 * (it never reached the first); one that was sent and then lost its replica fails with 502
 * (an error event when its stream had begun). A client that hangs up has its upstream
 * transfer cut, and the replica aborts the request as it does for any client. */
#define _GNU_SOURCE 1 /* POLLRDHUP */
#include <curl/curl.h>
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <microhttpd.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "config.h"
#include "base/common.h"
#include "sched/route.h"
#include "server/commands.h"
#include "server/http.h"
#include "server/metrics.h"
#include "server/keys.h"
#include "server/routes.h"

typedef struct router_config {
    char *host;
    int port;
    char **replicas;
    int n_replicas;
    route_policy policy;
    int poll_ms;
    char *api_key;
    char *api_keys;             /* --api-keys FILE: the keys of incoming requests (SIGHUP rereads it) */
    int http_threads;
    long long max_body_bytes, max_adapter_bytes;
    double tpot_factor;
    double shutdown_timeout;
    int default_output;         /* expected output tokens of a request without max_tokens */
} router_config_t;

typedef struct proxy proxy_t;

typedef struct replica {
    char *url;                  /* "http://host:port", no trailing slash */
    /* under router.mu */
    bool healthy, ever_polled, paused;
    char why_down[256];
    route_seq_t *seqs;          /* the latest state's sequences; adapter names in names */
    char *names;
    int n_seqs, n_requests;
    int n_running, n_waiting;   /* sequences */
    bool fitted;
    double coef[COST_N_TERMS];
    json_t *adapters;           /* name -> {"rank", "rank_sum"} */
    double t_state;             /* cs_time_ms() when the poll behind the state was sent */
    int in_flight;              /* requests open on it through this router */
} replica_t;

typedef struct router {
    router_config_t cfg;
    replica_t *rep;
    int n_rep;
    http_site_t site;           /* what http.c's access handler calls */
    struct MHD_Daemon *d;
    int bound_port;
    CURLSH *share;
    pthread_mutex_t share_mu[CURL_LOCK_DATA_LAST];

    pthread_mutex_t mu;
    pthread_cond_t cv;
    keyring_t *keys;            /* under mu: the keys in force (server/keys.h) */
    unsigned rr;                /* round-robin cursor of the policy */
    unsigned rr_any;            /* ... of requests any replica may answer */
    proxy_t *proxies;           /* open ones */
    int n_proxies;
    bool stop;
    pthread_t poller, watcher;

    metrics_t *reg;
    metric_t *m_requests, *m_up, *m_retries, *m_failed, *m_dispatch, *m_in_flight;
} router_t;

typedef enum proxy_kind { PK_ROUTED, PK_ANY, PK_BROADCAST_ALL, PK_BROADCAST_ANY } proxy_kind;

struct proxy {
    router_t *rt;
    proxy_kind kind;
    char *method, *path;        /* path with its query string */
    char *body;
    size_t body_len;
    char *content_type, *authorization, *accept;
    route_req_t est;            /* what routing knows of it */
    char *adapter;              /* est.adapter's storage */
    double t_ready;             /* cs_time_ms(): body complete */

    pthread_mutex_t mu;         /* everything below */
    int refs;                   /* the connection, the thread, the stream reader */
    struct MHD_Connection *conn; /* NULL once the connection is done */
    bool suspended, responded, hung_up;
    int replica;                /* where it went (-1: not yet) */
    double t_sent;              /* when it was handed to that replica */
    bool counted;               /* in that replica's in_flight */
    long status;
    char *resp_type;
    bool headers_done, stream;
    cs_buf_t out;
    size_t out_off;
    bool finished, failed;      /* failed: the upstream broke (after headers: mid-stream) */
    perr_t err;                 /* why, when failed */
    proxy_t *next, *prev;       /* router.proxies */
};

/* ---- proxies ---- */
static void proxy_unref(proxy_t *p) {
    pthread_mutex_lock(&p->mu);
    int left = --p->refs;
    pthread_mutex_unlock(&p->mu);
    if (left) return;
    pthread_mutex_destroy(&p->mu);
    free(p->method);
    free(p->path);
    free(p->body);
    free(p->content_type);
    free(p->authorization);
    free(p->accept);
    free(p->adapter);
    free(p->resp_type);
    cs_buf_free(&p->out);
    free(p);
}

/* Under p->mu: whether the suspended connection has something to do now; if so it counts as
 * resumed and the caller resumes it after unlocking (it cannot go away while suspended). */
static bool take_resume(proxy_t *p) {
    if (!p->suspended || !p->conn) return false;
    bool ready = p->finished || (p->headers_done && p->stream && (!p->responded || p->out.len > p->out_off));
    if (!ready) return false;
    p->suspended = false;
    return true;
}

static void resume_if_ready(proxy_t *p) {
    pthread_mutex_lock(&p->mu);
    struct MHD_Connection *c = p->conn;
    bool r = take_resume(p);
    pthread_mutex_unlock(&p->mu);
    if (r) MHD_resume_connection(c);
}

/* ---- the upstream side (libcurl) ---- */
typedef struct upstream {
    proxy_t *p;                 /* NULL: a poll or a broadcast leg (buffered here) */
    long status;
    char *ctype;
    bool headers_done, stream;
    cs_buf_t body;
    bool got_bytes;
    const char *req;            /* the request body curl reads (READFUNCTION, no rewind: */
    size_t req_len, req_off;    /* curl may not resend it on a connection of its choosing) */
    bool req_read;              /* curl took some of it: it may have reached the replica */
} upstream_t;

static size_t on_read(char *buf, size_t size, size_t n, void *user) {
    upstream_t *u = user;
    size_t k = size * n, left = u->req_len - u->req_off;
    if (k > left) k = left;
    memcpy(buf, u->req + u->req_off, k);
    u->req_off += k;
    if (k) u->req_read = true;
    return k;
}

static size_t on_header(char *buf, size_t size, size_t n, void *user) {
    upstream_t *u = user;
    size_t len = size * n;
    if (len >= 5 && !strncmp(buf, "HTTP/", 5)) {
        const char *sp = memchr(buf, ' ', len);
        u->status = sp ? strtol(sp + 1, NULL, 10) : 0;
        free(u->ctype);
        u->ctype = NULL;
        u->got_bytes = true;
    } else if (len > 13 && !strncasecmp(buf, "Content-Type:", 13)) {
        const char *v = buf + 13;
        size_t k = len - 13;
        while (k && (*v == ' ' || *v == '\t')) v++, k--;
        while (k && (v[k - 1] == '\r' || v[k - 1] == '\n' || v[k - 1] == ' ')) k--;
        free(u->ctype);
        u->ctype = strndup(v, k);
    } else if ((len == 2 && buf[0] == '\r') || (len == 1 && buf[0] == '\n')) {
        if (u->status >= 200) { /* not a 100 Continue */
            u->headers_done = true;
            u->stream = u->ctype && (!strncasecmp(u->ctype, "text/event-stream", 17) ||
                                     !strncasecmp(u->ctype, "application/x-ndjson", 20));
            proxy_t *p = u->p;
            if (p) {
                pthread_mutex_lock(&p->mu);
                p->status = u->status;
                free(p->resp_type);
                p->resp_type = u->ctype ? strdup(u->ctype) : NULL;
                p->stream = u->stream;
                p->headers_done = true;
                pthread_mutex_unlock(&p->mu);
                if (u->stream) resume_if_ready(p);
            }
        }
    }
    return len;
}

static size_t on_body(char *buf, size_t size, size_t n, void *user) {
    upstream_t *u = user;
    size_t len = size * n;
    u->got_bytes = true;
    proxy_t *p = u->p;
    if (!p || !u->stream) return cs_buf_add(&u->body, buf, len) ? len : 0;
    pthread_mutex_lock(&p->mu);
    bool gone = p->hung_up;
    bool ok = !gone && cs_buf_add(&p->out, buf, len);
    pthread_mutex_unlock(&p->mu);
    if (!ok) return 0; /* cuts the transfer: the replica sees the hang-up */
    resume_if_ready(p);
    return len;
}

static int on_progress(void *user, curl_off_t dt, curl_off_t dn, curl_off_t ut, curl_off_t un) {
    (void)dt, (void)dn, (void)ut, (void)un;
    upstream_t *u = user;
    if (!u->p) return 0;
    pthread_mutex_lock(&u->p->mu);
    bool gone = u->p->hung_up;
    pthread_mutex_unlock(&u->p->mu);
    return gone ? 1 : 0;
}

static void share_lock(CURL *h, curl_lock_data d, curl_lock_access a, void *user) {
    (void)h, (void)a;
    router_t *rt = user;
    pthread_mutex_lock(&rt->share_mu[d]);
}

static void share_unlock(CURL *h, curl_lock_data d, void *user) {
    (void)h;
    router_t *rt = user;
    pthread_mutex_unlock(&rt->share_mu[d]);
}

/* One transfer to replica R (blocking). CURLcode; the response in U. */
static CURLcode upstream_send(router_t *rt, int r, const char *method, const char *path, const char *body,
                              size_t body_len, const char *ctype, const char *auth, const char *accept,
                              upstream_t *u, long timeout_ms) {
    CURL *h = curl_easy_init();
    if (!h) return CURLE_OUT_OF_MEMORY;
    size_t n = strlen(rt->rep[r].url) + strlen(path) + 1;
    char *url = malloc(n);
    if (!url) {
        curl_easy_cleanup(h);
        return CURLE_OUT_OF_MEMORY;
    }
    snprintf(url, n, "%s%s", rt->rep[r].url, path);
    struct curl_slist *hd = curl_slist_append(NULL, "Expect:");
    char line[8192];
    if (ctype) snprintf(line, sizeof line, "Content-Type: %s", ctype), hd = curl_slist_append(hd, line);
    /* a client's request goes on with its own key (AUTH; "" for none), never the router's:
     * that one is for the router's own polls (AUTH NULL) */
    if (auth && *auth) snprintf(line, sizeof line, "Authorization: %s", auth), hd = curl_slist_append(hd, line);
    else if (!auth && rt->cfg.api_key) snprintf(line, sizeof line, "Authorization: Bearer %s", rt->cfg.api_key), hd = curl_slist_append(hd, line);
    if (accept) snprintf(line, sizeof line, "Accept: %s", accept), hd = curl_slist_append(hd, line);
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_PATH_AS_IS, 1L); /* the path as checked here, dot segments and all */
    curl_easy_setopt(h, CURLOPT_SHARE, rt->share);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hd);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_TCP_NODELAY, 1L);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, 2000L);
    if (timeout_ms > 0) curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, timeout_ms);
    curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(h, CURLOPT_HEADERDATA, u);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, u);
    curl_easy_setopt(h, CURLOPT_NOPROGRESS, 0L);
    curl_easy_setopt(h, CURLOPT_XFERINFOFUNCTION, on_progress);
    curl_easy_setopt(h, CURLOPT_XFERINFODATA, u);
    if (!strcmp(method, "GET")) {
        curl_easy_setopt(h, CURLOPT_HTTPGET, 1L);
    } else {
        if (strcmp(method, "POST")) curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, method);
        if (body_len || !strcmp(method, "POST") || !strcmp(method, "PUT")) {
            /* read through a callback with no seek: when a kept connection turns out dead,
             * curl would resend the body on a new one by itself; without a rewind it fails
             * instead, and the caller decides (a request that may have arrived is not sent
             * twice) */
            u->req = body ? body : "";
            u->req_len = body_len;
            u->req_off = 0;
            curl_easy_setopt(h, CURLOPT_POST, 1L);
            curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)body_len);
            curl_easy_setopt(h, CURLOPT_READFUNCTION, on_read);
            curl_easy_setopt(h, CURLOPT_READDATA, u);
        }
    }
    double t0 = cs_time_ms();
    CURLcode rc = curl_easy_perform(h);
    if (u->p) { /* the router's own part: to here, then curl's connection (or reuse) */
        curl_off_t pre = 0;
        if (curl_easy_getinfo(h, CURLINFO_PRETRANSFER_TIME_T, &pre) == CURLE_OK && pre > 0)
            metric_observe(rt->m_dispatch, NULL, (t0 - u->p->t_ready) / 1000.0 + (double)pre / 1e6);
    }
    curl_easy_cleanup(h);
    curl_slist_free_all(hd);
    free(url);
    return rc;
}

/* ---- health ---- */
static void mark_down(router_t *rt, int r, const char *why) {
    pthread_mutex_lock(&rt->mu);
    replica_t *rp = &rt->rep[r];
    bool was = rp->healthy || !rp->ever_polled;
    rp->healthy = false;
    rp->ever_polled = true;
    snprintf(rp->why_down, sizeof rp->why_down, "%s", why);
    pthread_mutex_unlock(&rt->mu);
    metric_set(rt->m_up, (const char *[]){rp->url}, 0);
    if (was) fprintf(stderr, "caraserve router: replica %s is out: %s\n", rp->url, why);
}

/* a /v1/state body into replica R (the poll was sent at T0): CS_OK, else an error */
static int take_state(router_t *rt, int r, const char *body, double t0) {
    json_error_t je;
    json_t *st = json_loads(body, 0, &je);
    json_t *run = st ? json_object_get(st, "running") : NULL, *wait = st ? json_object_get(st, "waiting") : NULL;
    if (!json_is_array(run) || !json_is_array(wait)) {
        cs_error_set(CS_EFORMAT, "GET /v1/state: not a state (%s)", st ? "no running/waiting arrays" : je.text);
        json_decref(st);
        return CS_EFORMAT;
    }
    if (json_is_true(json_object_get(st, "draining"))) {
        json_decref(st);
        return cs_error_set(CS_EAGAIN, "draining (shutting down)");
    }
    int n = (int)(json_array_size(run) + json_array_size(wait));
    route_seq_t *seqs = calloc((size_t)(n ? n : 1), sizeof *seqs);
    cs_buf_t names = {0};
    size_t *name_at = calloc((size_t)(n ? n : 1), sizeof *name_at);
    if (!seqs || !name_at) {
        free(seqs);
        free(name_at);
        json_decref(st);
        return cs_error_set(CS_ENOMEM, "out of memory");
    }
    int k = 0, n_req = 0;
    json_int_t last_id = -1;
    for (int w = 0; w < 2; w++) {
        json_t *a = w ? wait : run;
        size_t i;
        json_t *o;
        json_array_foreach(a, i, o) {
            route_seq_t *s = &seqs[k];
            const char *ad = json_string_value(json_object_get(o, "adapter"));
            name_at[k] = (size_t)-1;
            if (ad) {
                name_at[k] = names.len;
                cs_buf_add(&names, ad, strlen(ad) + 1);
            }
            s->rank = (int)json_integer_value(json_object_get(o, "rank"));
            s->rank_sum = (long)json_integer_value(json_object_get(o, "rank_sum"));
            int prompt = (int)json_integer_value(json_object_get(o, "prompt_tokens"));
            int computed = (int)json_integer_value(json_object_get(o, "computed_tokens"));
            s->prefill_left = prompt > computed ? prompt - computed : 0;
            s->running = !w;
            json_int_t id = json_integer_value(json_object_get(o, "id"));
            if (id != last_id) n_req++; /* samples of one request are listed together */
            last_id = id;
            k++;
        }
    }
    for (int i = 0; i < k; i++) seqs[i].adapter = name_at[i] == (size_t)-1 ? NULL : names.p + name_at[i];
    free(name_at);
    json_t *cm = json_object_get(st, "cost_model");
    double coef[COST_N_TERMS] = {0};
    bool fitted = json_is_true(json_object_get(cm, "fitted"));
    bool paused = json_is_true(json_object_get(st, "paused"));
    for (int i = 0; i < COST_N_TERMS; i++)
        coef[i] = json_number_value(json_object_get(json_object_get(cm, "terms"), cost_term_names[i]));
    json_t *ads = json_object_get(st, "adapters");
    pthread_mutex_lock(&rt->mu);
    replica_t *rp = &rt->rep[r];
    bool was = rp->healthy;
    free(rp->seqs);
    free(rp->names);
    json_decref(rp->adapters);
    rp->seqs = seqs;
    rp->names = names.p;
    rp->n_seqs = k;
    rp->n_requests = n_req;
    rp->n_running = (int)json_array_size(run);
    rp->n_waiting = (int)json_array_size(wait);
    rp->fitted = fitted;
    rp->paused = paused;
    memcpy(rp->coef, coef, sizeof coef);
    rp->adapters = json_is_object(ads) ? json_incref(ads) : json_object();
    rp->t_state = t0;
    rp->healthy = true;
    rp->ever_polled = true;
    rp->why_down[0] = 0;
    pthread_mutex_unlock(&rt->mu);
    json_decref(st);
    metric_set(rt->m_up, (const char *[]){rp->url}, 1);
    if (!was) fprintf(stderr, "caraserve router: replica %s is in\n", rp->url);
    return CS_OK;
}

/* GET /v1/state of replica R into it: CS_OK, else an error */
static int poll_state(router_t *rt, int r) {
    upstream_t u = {0};
    double t0 = cs_time_ms();
    CURLcode rc = upstream_send(rt, r, "GET", "/v1/state", NULL, 0, NULL, NULL, NULL, &u, 2000);
    int st;
    if (rc != CURLE_OK)
        st = cs_error_set(CS_EIO, "GET /v1/state: %s", curl_easy_strerror(rc));
    else if (u.status != 200)
        st = cs_error_set(CS_EIO, "GET /v1/state: HTTP %ld%s%.200s", u.status, u.body.p ? ": " : "", u.body.p ? u.body.p : "");
    else
        st = take_state(rt, r, u.body.p ? u.body.p : "", t0);
    free(u.ctype);
    cs_buf_free(&u.body);
    return st;
}

static void poll_one(router_t *rt, int r) {
    if (poll_state(rt, r)) mark_down(rt, r, cs_error_last());
}

typedef struct poll_arg { router_t *rt; int r; } poll_arg_t;

static void *poll_thread(void *arg) {
    poll_arg_t *pa = arg;
    router_t *rt = pa->rt;
    int r = pa->r;
    free(pa);
    pthread_mutex_lock(&rt->mu);
    while (!rt->stop) {
        pthread_mutex_unlock(&rt->mu);
        poll_one(rt, r);
        pthread_mutex_lock(&rt->mu);
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        long ns = ts.tv_nsec + (long)rt->cfg.poll_ms * 1000000L;
        ts.tv_sec += ns / 1000000000L;
        ts.tv_nsec = ns % 1000000000L;
        while (!rt->stop && pthread_cond_timedwait(&rt->cv, &rt->mu, &ts) == 0) {}
    }
    pthread_mutex_unlock(&rt->mu);
    return NULL;
}

/* ---- placing a request ---- */
static void route_replica_of(router_t *rt, int r, route_replica_t *out, route_seq_t **extra_seqs) {
    replica_t *rp = &rt->rep[r];
    /* requests sent since its state was taken wait there, as far as we know */
    int extra = 0;
    for (proxy_t *p = rt->proxies; p; p = p->next)
        if (p->replica == r && p->counted && p->t_sent >= rp->t_state) extra++;
    route_seq_t *seqs = malloc(sizeof *seqs * (size_t)(rp->n_seqs + extra + 1));
    int k = 0;
    if (seqs) {
        if (rp->n_seqs) memcpy(seqs, rp->seqs, sizeof *seqs * (size_t)rp->n_seqs);
        k = rp->n_seqs;
        for (proxy_t *p = rt->proxies; p; p = p->next)
            if (p->replica == r && p->counted && p->t_sent >= rp->t_state)
                seqs[k++] = (route_seq_t){.adapter = p->est.adapter, .rank = p->est.rank,
                                          .prefill_left = p->est.prompt_tokens * (p->est.n > 0 ? p->est.n : 1)};
    }
    *extra_seqs = seqs;
    *out = (route_replica_t){.healthy = rp->healthy, .paused = rp->paused, .fitted = rp->fitted, .seqs = seqs, .n_seqs = seqs ? k : 0,
                             .n_requests = rp->n_requests + extra, .in_flight = rp->in_flight};
    memcpy(out->coef, rp->coef, sizeof rp->coef);
}

/* Under rt->mu: pick a replica for P not in TRIED (a bitmask of attempted ones); -1: none */
static int pick_locked(router_t *rt, proxy_t *p, const bool *tried) {
    int n = rt->n_rep;
    route_replica_t *rr = calloc((size_t)n, sizeof *rr);
    route_seq_t **keep = calloc((size_t)n, sizeof *keep);
    int best = -1;
    if (rr && keep) {
        for (int i = 0; i < n; i++) {
            route_replica_of(rt, i, &rr[i], &keep[i]);
            if (tried[i]) rr[i].healthy = false;
        }
        if (p->kind == PK_ROUTED) {
            if (p->est.rank < 0 && p->est.adapter) { /* the rank from any replica's adapter table */
                bool polled = false;
                for (int i = 0; i < n && p->est.rank < 0; i++) {
                    json_t *a = json_object_get(rt->rep[i].adapters, p->est.adapter);
                    polled |= rt->rep[i].adapters != NULL;
                    if (a) p->est.rank = (int)json_integer_value(json_object_get(a, "rank"));
                }
                if (p->est.rank < 0 && polled) { /* no replica serves it as an adapter: the base model */
                    p->est.adapter = NULL;
                    p->est.rank = 0;
                }
            }
            best = route_pick(rt->cfg.policy, rr, n, &p->est, rt->cfg.tpot_factor, &rt->rr);
        } else {
            best = route_pick(ROUTE_ROUND_ROBIN, rr, n, &p->est, rt->cfg.tpot_factor, &rt->rr_any);
        }
        for (int i = 0; i < n; i++) free(keep[i]);
    }
    free(rr);
    free(keep);
    return best;
}

static void proxy_fail(proxy_t *p, long status, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void proxy_fail(proxy_t *p, long status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    pthread_mutex_lock(&p->mu);
    p->err.status = (unsigned)status;
    vsnprintf(p->err.msg, sizeof p->err.msg, fmt, ap);
    p->failed = true;
    if (!p->headers_done) p->status = status;
    pthread_mutex_unlock(&p->mu);
    va_end(ap);
}

/* one request to one replica, retried on another while the connection cannot be made */
static void run_routed(proxy_t *p) {
    router_t *rt = p->rt;
    bool *tried = calloc((size_t)rt->n_rep, sizeof *tried);
    for (;;) {
        pthread_mutex_lock(&rt->mu);
        int r = tried ? pick_locked(rt, p, tried) : -1;
        if (r >= 0) {
            p->replica = r;
            p->t_sent = cs_time_ms();
            p->counted = true;
            rt->rep[r].in_flight++;
            metric_set(rt->m_in_flight, (const char *[]){rt->rep[r].url}, rt->rep[r].in_flight);
        }
        pthread_mutex_unlock(&rt->mu);
        if (r < 0) {
            proxy_fail(p, 503, "no healthy replica to send the request to (%d configured)", rt->n_rep);
            metric_inc(rt->m_failed, (const char *[]){"no_replica"}, 1);
            break;
        }
        upstream_t u = {.p = p};
        CURLcode rc = upstream_send(rt, r, p->method, p->path, p->body, p->body_len, p->content_type,
                                    p->authorization, p->accept, &u, 0);
        pthread_mutex_lock(&rt->mu);
        p->counted = false;
        rt->rep[r].in_flight--;
        metric_set(rt->m_in_flight, (const char *[]){rt->rep[r].url}, rt->rep[r].in_flight);
        pthread_mutex_unlock(&rt->mu);
        pthread_mutex_lock(&p->mu);
        bool gone = p->hung_up;
        pthread_mutex_unlock(&p->mu);
        if (rc == CURLE_COULDNT_CONNECT && !u.got_bytes && !u.req_read && !gone) {
            /* it never reached that replica: take it out and send the request elsewhere */
            char why[256];
            snprintf(why, sizeof why, "connect: %s", curl_easy_strerror(rc));
            mark_down(rt, r, why);
            metric_inc(rt->m_retries, (const char *[]){rt->rep[r].url}, 1);
            tried[r] = true;
            free(u.ctype);
            cs_buf_free(&u.body);
            continue;
        }
        metric_inc(rt->m_requests, (const char *[]){rt->rep[r].url}, 1);
        if (gone) {
            metric_inc(rt->m_failed, (const char *[]){"client_gone"}, 1);
        } else if (rc != CURLE_OK) {
            proxy_fail(p, 502, "replica %s failed: %s", rt->rep[r].url, curl_easy_strerror(rc));
            metric_inc(rt->m_failed, (const char *[]){"replica_failed"}, 1);
        } else if (!u.stream) {
            pthread_mutex_lock(&p->mu);
            cs_buf_free(&p->out);
            p->out = u.body;
            u.body = (cs_buf_t){0};
            pthread_mutex_unlock(&p->mu);
        }
        free(u.ctype);
        cs_buf_free(&u.body);
        break;
    }
    free(tried);
}

/* an admin request to every healthy replica: ALL needs each to succeed, ANY one of them */
static void run_broadcast(proxy_t *p) {
    router_t *rt = p->rt;
    int n = rt->n_rep, sent = 0, ok = 0, chosen = -1;
    upstream_t *u = calloc((size_t)n, sizeof *u);
    CURLcode *rc = calloc((size_t)n, sizeof *rc);
    bool *up = calloc((size_t)n, sizeof *up);
    if (!u || !rc || !up) {
        proxy_fail(p, 500, "out of memory");
        goto out;
    }
    pthread_mutex_lock(&rt->mu);
    for (int i = 0; i < n; i++) up[i] = rt->rep[i].healthy;
    pthread_mutex_unlock(&rt->mu);
    for (int i = 0; i < n; i++) {
        if (!up[i]) continue;
        rc[i] = upstream_send(rt, i, p->method, p->path, p->body, p->body_len, p->content_type, p->authorization,
                              p->accept, &u[i], 0);
        sent++;
        bool good = rc[i] == CURLE_OK && u[i].status >= 200 && u[i].status < 300;
        if (good) ok++;
        if (rc[i] == CURLE_COULDNT_CONNECT) mark_down(rt, i, "connect failed");
        /* the answer passed back: ALL: the first failure, else the first success; ANY: the
         * first success, else the first answer */
        bool answered = rc[i] == CURLE_OK;
        if (chosen < 0 && answered) chosen = i;
        else if (answered && p->kind == PK_BROADCAST_ALL && !good && u[chosen].status < 300) chosen = i;
        else if (answered && p->kind == PK_BROADCAST_ANY && good && u[chosen].status >= 300) chosen = i;
    }
    if (!sent) {
        proxy_fail(p, 503, "no healthy replica to send the request to (%d configured)", n);
    } else if (chosen < 0) {
        proxy_fail(p, 502, "no replica answered (%d tried)", sent);
    } else {
        if (p->kind == PK_BROADCAST_ALL && ok < sent && ok > 0)
            fprintf(stderr, "caraserve router: %s %s succeeded on %d of %d replicas\n", p->method, p->path, ok, sent);
        pthread_mutex_lock(&p->mu);
        p->status = u[chosen].status;
        p->resp_type = u[chosen].ctype ? strdup(u[chosen].ctype) : NULL;
        p->headers_done = true;
        p->replica = chosen;
        p->out = u[chosen].body;
        u[chosen].body = (cs_buf_t){0};
        pthread_mutex_unlock(&p->mu);
    }
out:
    for (int i = 0; u && i < n; i++) {
        free(u[i].ctype);
        cs_buf_free(&u[i].body);
    }
    free(u);
    free(rc);
    free(up);
}

/* the thread's part is over: off the router's list (shutdown waits for it to empty), the
 * answer ready for the connection, the thread's reference dropped */
static void proxy_done(proxy_t *p) {
    router_t *rt = p->rt;
    pthread_mutex_lock(&rt->mu);
    if (p->prev) p->prev->next = p->next;
    else rt->proxies = p->next;
    if (p->next) p->next->prev = p->prev;
    rt->n_proxies--;
    pthread_cond_broadcast(&rt->cv);
    pthread_mutex_unlock(&rt->mu);
    pthread_mutex_lock(&p->mu);
    p->finished = true;
    pthread_mutex_unlock(&p->mu);
    resume_if_ready(p);
    proxy_unref(p);
}

static void *proxy_thread(void *arg) {
    proxy_t *p = arg;
    if (p->kind == PK_BROADCAST_ALL || p->kind == PK_BROADCAST_ANY) run_broadcast(p);
    else run_routed(p);
    proxy_done(p);
    return NULL;
}

/* ---- what routing knows of a request (the router has no tokenizer) ---- */
static int est_text_tokens(json_t *v) {
    if (json_is_string(v)) return (int)(json_string_length(v) / 4) + 1; /* ~4 bytes a token */
    if (json_is_integer(v)) return 1;
    int t = 0;
    size_t i;
    json_t *x;
    const char *k;
    if (json_is_array(v)) json_array_foreach(v, i, x) t += est_text_tokens(x);
    else if (json_is_object(v)) json_object_foreach(v, k, x) t += est_text_tokens(x);
    return t;
}

static void estimate(router_t *rt, proxy_t *p, route_id id) {
    p->est = (route_req_t){.rank = 0, .n = 1, .expected_output = rt->cfg.default_output};
    json_t *b = json_loadb(p->body ? p->body : "", p->body_len, 0, NULL);
    if (!json_is_object(b)) {
        json_decref(b);
        return;
    }
    const char *adapter = NULL;
    json_t *sp = b;
    if (id == R_ROLLOUT) {
        json_t *a = json_object_get(b, "adapter");
        adapter = json_is_string(a) ? json_string_value(a) : json_string_value(json_object_get(a, "name"));
        sp = json_object_get(b, "sampling");
        int prompt = 0, n = 0;
        size_t i;
        json_t *g;
        json_array_foreach(json_object_get(b, "groups"), i, g) {
            int gn = json_is_integer(json_object_get(g, "n")) ? (int)json_integer_value(json_object_get(g, "n")) : 1;
            prompt += est_text_tokens(json_object_get(g, "input_ids"));
            n += gn > 0 ? gn : 1;
        }
        p->est.prompt_tokens = prompt;
        p->est.n = n > 0 ? n : 1;
    } else {
        adapter = json_string_value(json_object_get(b, "model"));
        if (id == R_GENERATE && json_object_get(b, "adapter")) adapter = json_string_value(json_object_get(b, "adapter"));
        json_t *pr = json_object_get(b, id == R_CHAT ? "messages" : "prompt");
        if (!pr) pr = json_object_get(b, "input_ids");
        p->est.prompt_tokens = est_text_tokens(pr);
        json_t *n = json_object_get(b, "n");
        if (json_is_integer(n) && json_integer_value(n) > 0) p->est.n = (int)json_integer_value(n);
        if (id == R_GENERATE) sp = json_object_get(b, "sampling_params") ? json_object_get(b, "sampling_params") : b;
    }
    json_t *mt = json_object_get(sp, "max_tokens");
    if (!mt) mt = json_object_get(sp, "max_completion_tokens");
    if (!mt) mt = json_object_get(sp, "max_new_tokens");
    if (json_is_integer(mt) && json_integer_value(mt) > 0) p->est.expected_output = (int)json_integer_value(mt);
    json_t *slo = json_object_get(b, "slo");
    if (json_is_number(json_object_get(slo, "tpot_ms"))) p->est.slo_tpot_ms = json_number_value(json_object_get(slo, "tpot_ms"));
    /* an adapter (its rank is looked up in the replicas' tables when the request is placed)
     * or the base model's name */
    if (adapter && *adapter && (p->adapter = strdup(adapter))) {
        p->est.adapter = p->adapter;
        p->est.rank = -1;
    }
    json_decref(b);
}

/* ---- the client side (http.c's access handler) ---- */
/* a request's own state (http_conn_t.app) */
typedef struct rconn {
    proxy_t *p;                 /* the request's proxy, once it has one */
} rconn_t;

/* The router's error objects: the server's fields, fewer "type" names (403, 404, 405 and 409
 * are BadRequestError) and never a "param". */
static char *router_error_body(const perr_t *e) {
    unsigned status = e->status;
    const char *type = status == 503 ? "ServiceUnavailableError" : status == 401 ? "AuthenticationError"
                     : status == 413 ? "RequestTooLargeError" : status == 501 ? "NotImplementedError" : status >= 500 ? "InternalServerError" : "BadRequestError";
    json_t *o = json_pack("{s:{s:s, s:s, s:n, s:i}}", "error", "message", e->msg, "type", type, "param", "code", (int)status);
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    return s ? s : strdup("{\"error\":{\"message\":\"out of memory\"}}");
}

static enum MHD_Result router_error(router_t *rt, struct MHD_Connection *c, unsigned status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static enum MHD_Result router_error(router_t *rt, struct MHD_Connection *c, unsigned status, const char *fmt, ...) {
    perr_t e = {.status = status};
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e.msg, sizeof e.msg, fmt, ap);
    va_end(ap);
    return http_site_error(c, &rt->site, &e);
}

/* the reader of a streamed upstream response */
static ssize_t stream_reader(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    proxy_t *p = cls;
    pthread_mutex_lock(&p->mu);
    ssize_t n;
    if (p->out_off >= p->out.len && p->finished && p->failed && p->err.msg[0]) {
        /* the stream broke: say so in the stream's own format */
        perr_t e = p->err;
        e.status = 502;
        char *body = router_error_body(&e);
        bool sse = p->resp_type && !strncasecmp(p->resp_type, "text/event-stream", 17);
        int k = snprintf(buf, max, sse ? "data: %s\n\n" : "%s\n", body);
        free(body);
        p->err.msg[0] = 0;
        n = k > 0 && (size_t)k < max ? k : MHD_CONTENT_READER_END_OF_STREAM;
    } else {
        n = http_stream_take(&p->out, &p->out_off, p->finished, &p->suspended, p->conn, buf, max);
    }
    pthread_mutex_unlock(&p->mu);
    return n;
}

static void stream_free(void *cls) {
    proxy_t *p = cls;
    pthread_mutex_lock(&p->mu);
    if (!p->finished) p->hung_up = true; /* the client went before the stream ended */
    pthread_mutex_unlock(&p->mu);
    proxy_unref(p);
}

/* the resumed connection of P: its answer, if there is one now */
static enum MHD_Result proxy_answer(proxy_t *p, struct MHD_Connection *c) {
    pthread_mutex_lock(&p->mu);
    if (p->responded) { /* a streamed response being read */
        pthread_mutex_unlock(&p->mu);
        return MHD_YES;
    }
    if (p->headers_done && p->stream && !p->failed) {
        p->responded = true;
        p->refs++; /* the reader's */
        long status = p->status;
        char *type = p->resp_type ? strdup(p->resp_type) : NULL;
        int rep = p->replica;
        pthread_mutex_unlock(&p->mu);
        enum MHD_Result ret = http_stream_queue(c, (unsigned)status, type, rep >= 0 ? "X-Caraserve-Replica" : NULL,
                                                rep >= 0 ? p->rt->rep[rep].url : NULL, stream_reader, p, stream_free);
        free(type);
        return ret;
    }
    if (!p->finished) { /* not yet: wait again */
        p->suspended = true;
        MHD_suspend_connection(c);
        pthread_mutex_unlock(&p->mu);
        return MHD_YES;
    }
    p->responded = true;
    long status = p->status;
    bool failed = p->failed || !p->headers_done;
    char *body = NULL;
    size_t len = 0;
    const char *type = "application/json";
    char *own_type = NULL;
    if (failed) {
        perr_t e = p->err;
        e.status = status ? (unsigned)status : 502;
        if (!e.msg[0]) snprintf(e.msg, sizeof e.msg, "the replica gave no answer");
        body = router_error_body(&e);
        len = strlen(body);
        if (!status || status < 400) status = 502;
    } else {
        body = p->out.p ? p->out.p : strdup("");
        len = p->out.len;
        p->out = (cs_buf_t){0};
        own_type = p->resp_type ? strdup(p->resp_type) : NULL;
        type = own_type;
    }
    int rep = p->replica;
    pthread_mutex_unlock(&p->mu);
    struct MHD_Response *r = MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(body);
        free(own_type);
        return MHD_NO;
    }
    if (type) MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    if (rep >= 0 && !failed) MHD_add_response_header(r, "X-Caraserve-Replica", p->rt->rep[rep].url);
    free(own_type);
    enum MHD_Result ret = MHD_queue_response(c, (unsigned)status, r);
    MHD_destroy_response(r);
    return ret;
}

static json_t *router_state_json(router_t *rt) {
    json_t *reps = json_array();
    pthread_mutex_lock(&rt->mu);
    for (int i = 0; i < rt->n_rep; i++) {
        replica_t *rp = &rt->rep[i];
        json_t *coef = json_object();
        for (int k = 0; k < COST_N_TERMS; k++) json_object_set_new(coef, cost_term_names[k], json_real(rp->coef[k]));
        json_array_append_new(reps, json_pack("{s:s, s:b, s:s?, s:b, s:i, s:i, s:i, s:i, s:b, s:o}", "url", rp->url,
                                              "healthy", rp->healthy, "why_down", rp->why_down[0] ? rp->why_down : NULL,
                                              "paused", rp->paused,
                                              "running", rp->n_running, "waiting", rp->n_waiting, "requests",
                                              rp->n_requests, "in_flight", rp->in_flight, "fitted", rp->fitted,
                                              "cost_model", coef));
    }
    pthread_mutex_unlock(&rt->mu);
    return json_pack("{s:s, s:i, s:o}", "policy", route_policy_name(rt->cfg.policy), "poll_interval_ms",
                     rt->cfg.poll_ms, "replicas", reps);
}

static int healthy_count(router_t *rt) {
    int n = 0;
    pthread_mutex_lock(&rt->mu);
    for (int i = 0; i < rt->n_rep; i++) n += rt->rep[i].healthy;
    pthread_mutex_unlock(&rt->mu);
    return n;
}

/* the query string of the request, "?a=b&c=d" escaped again ("" when none) */
typedef struct qs_acc { cs_buf_t b; } qs_acc_t;
static enum MHD_Result qs_add(void *cls, enum MHD_ValueKind kind, const char *key, const char *value) {
    (void)kind;
    qs_acc_t *q = cls;
    char *k = curl_easy_escape(NULL, key, 0), *v = value ? curl_easy_escape(NULL, value, 0) : NULL;
    cs_buf_add(&q->b, q->b.len ? "&" : "?", 1);
    if (k) cs_buf_add(&q->b, k, strlen(k));
    if (v) {
        cs_buf_add(&q->b, "=", 1);
        cs_buf_add(&q->b, v, strlen(v));
    }
    curl_free(k);
    curl_free(v);
    return MHD_YES;
}

static char *dup_header(struct MHD_Connection *c, const char *name) {
    const char *v = MHD_lookup_connection_value(c, MHD_HEADER_KIND, name);
    return v ? strdup(v) : NULL;
}

static enum MHD_Result start_proxy(router_t *rt, http_conn_t *h, struct MHD_Connection *c, const char *method,
                                   const char *url, const route_t *route) {
    proxy_t *p = calloc(1, sizeof *p);
    if (!p) return router_error(rt, c, 500, "out of memory");
    pthread_mutex_init(&p->mu, NULL);
    p->rt = rt;
    p->refs = 2; /* the connection and the thread */
    p->conn = c;
    p->replica = -1;
    p->t_ready = cs_time_ms();
    qs_acc_t q = {0};
    MHD_get_connection_values(c, MHD_GET_ARGUMENT_KIND, qs_add, &q);
    /* the path as libmicrohttpd decoded it, encoded again: a decoded '?', '#' or space stays
     * part of the path the replica sees */
    cs_buf_t pb = {0};
    for (const unsigned char *u = (const unsigned char *)url; *u; u++) {
        char esc[4];
        bool plain = (*u >= 'a' && *u <= 'z') || (*u >= 'A' && *u <= 'Z') || (*u >= '0' && *u <= '9') ||
                     strchr("-._~/!$&'()*+,;=:@", *u);
        snprintf(esc, sizeof esc, "%%%02X", *u);
        cs_buf_add(&pb, plain ? (const char *)u : esc, plain ? 1 : 3);
    }
    size_t n = pb.len + q.b.len + 1;
    p->path = malloc(n);
    if (p->path) snprintf(p->path, n, "%.*s%s", (int)pb.len, pb.p ? pb.p : "", q.b.p ? q.b.p : "");
    cs_buf_free(&pb);
    cs_buf_free(&q.b);
    p->method = strdup(method);
    p->body = h->body.p;
    p->body_len = h->body.len;
    h->body = (cs_buf_t){0};
    p->content_type = dup_header(c, MHD_HTTP_HEADER_CONTENT_TYPE);
    p->authorization = dup_header(c, MHD_HTTP_HEADER_AUTHORIZATION);
    if (!p->authorization) p->authorization = strdup(""); /* none: not the router's key either */
    p->accept = dup_header(c, MHD_HTTP_HEADER_ACCEPT);
    route_id id = route ? route->id : R_HEALTH;
    if (!route) p->kind = PK_ANY;
    else if (route->flags & ROUTE_GENERATES) p->kind = PK_ROUTED;
    else if (id == R_ROLLOUT_ABORT || id == R_ABORT_REQUEST || id == R_VLLM_ABORT) p->kind = PK_BROADCAST_ANY;
    else if (id == R_ADAPTER_VERSION && !strcmp(method, "GET")) p->kind = PK_BROADCAST_ANY; /* one replica's stats */
    else if (id == R_LOAD_LORA || id == R_UNLOAD_LORA || id == R_ADAPTER_VERSION || id == R_PAUSE || id == R_RESUME ||
             id == R_VLLM_PAUSE || id == R_VLLM_RESUME || id == R_SGL_PAUSE || id == R_SGL_CONTINUE ||
             id == R_FLUSH_CACHE || id == R_RESET_PREFIX_CACHE || id == R_WEIGHTS || id == R_SGL_UPDATE_WEIGHTS ||
             id == R_SGL_SET_WEIGHT_VERSION || id == R_SGL_LOAD_LORA || id == R_SGL_UNLOAD_LORA || id == R_SLEEP ||
             id == R_WAKE_UP)
        p->kind = PK_BROADCAST_ALL;
    else p->kind = PK_ANY;
    if (p->kind == PK_ROUTED) estimate(rt, p, id);
    if (!p->path || !p->method) {
        p->refs = 1;
        proxy_unref(p);
        return router_error(rt, c, 500, "out of memory");
    }
    ((rconn_t *)h->app)->p = p;
    pthread_mutex_lock(&rt->mu);
    p->next = rt->proxies;
    if (rt->proxies) rt->proxies->prev = p;
    rt->proxies = p;
    rt->n_proxies++;
    pthread_mutex_unlock(&rt->mu);
    /* suspended before the thread can resume it */
    pthread_mutex_lock(&p->mu);
    p->suspended = true;
    MHD_suspend_connection(c);
    pthread_mutex_unlock(&p->mu);
    pthread_t th;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&at, 256 << 10);
    int e = pthread_create(&th, &at, proxy_thread, p);
    pthread_attr_destroy(&at);
    if (e) { /* the thread's part done here */
        proxy_fail(p, 503, "cannot start a thread");
        proxy_done(p);
    }
    return MHD_YES;
}

/* the router's own routes, answered here */
static enum MHD_Result own_route(router_t *rt, struct MHD_Connection *c, const char *method, const char *url,
                                 const route_t *r) {
    if (strcmp(method, "GET")) return router_error(rt, c, 405, "use GET %s", url);
    if (r->id == R_HEALTH) {
        int h = healthy_count(rt);
        if (!h) return router_error(rt, c, 503, "no healthy replica (%d configured)", rt->n_rep);
        return http_text(c, 200, "text/plain; charset=utf-8", strdup(""), 0);
    }
    if (r->id == R_VERSION) {
        char *s = strdup("{\"version\":\"" PACKAGE_VERSION "\",\"role\":\"router\"}");
        return http_text(c, 200, "application/json", s, s ? strlen(s) : 0);
    }
    if (r->id == R_METRICS) {
        size_t len = 0;
        char *txt = metrics_render(rt->reg, &len);
        if (!txt) return router_error(rt, c, 500, "out of memory");
        return http_text(c, 200, "text/plain; version=0.0.4; charset=utf-8", txt, len);
    }
    json_t *st = router_state_json(rt);
    char *s = st ? json_dumps(st, JSON_COMPACT) : NULL;
    json_decref(st);
    if (!s) return router_error(rt, c, 500, "out of memory");
    return http_text(c, 200, "application/json", s, strlen(s));
}

/* ---- the site's callbacks ---- */
static void *router_conn_new(void *ctx) {
    (void)ctx;
    return calloc(1, sizeof(rconn_t));
}

static enum MHD_Result router_dispatch(void *ctx, http_conn_t *h, struct MHD_Connection *c, const char *method,
                                       const char *url) {
    router_t *rt = ctx;
    const route_t *r = route_find(url);
    if (r && (r->flags & ROUTE_AUTH) && !(r->flags & ROUTE_TENANT) && h->who && !key_is_admin(h->who)) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s %.256s needs an admin key", method, url);
        return router_error(rt, c, 403, msg);
    }
    if (r && (r->id == R_HEALTH || r->id == R_VERSION || r->id == R_METRICS || r->id == R_STATE))
        return own_route(rt, c, method, url, r);
    pthread_mutex_lock(&rt->mu);
    bool stopping = rt->stop;
    pthread_mutex_unlock(&rt->mu);
    if (stopping) return router_error(rt, c, 503, "the router is shutting down");
    return start_proxy(rt, h, c, method, url, r);
}

static enum MHD_Result router_resume(void *ctx, http_conn_t *h, struct MHD_Connection *c) {
    (void)ctx;
    rconn_t *cn = h->app;
    return cn->p ? proxy_answer(cn->p, c) : MHD_YES;
}

static void router_conn_done(void *ctx, void *app) {
    (void)ctx;
    rconn_t *cn = app;
    proxy_t *p = cn->p;
    if (p) {
        pthread_mutex_lock(&p->mu);
        p->conn = NULL;
        if (!p->finished) p->hung_up = true;
        pthread_mutex_unlock(&p->mu);
        proxy_unref(p);
    }
    free(cn);
}

/* MHD does not notice a client hanging up while its connection is suspended (waiting for a
 * replica's answer): look at those sockets every 100 ms and cut their upstream transfers. */
static void *watch_thread(void *arg) {
    router_t *rt = arg;
    pthread_mutex_lock(&rt->mu);
    while (!rt->stop || rt->n_proxies) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 100 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&rt->cv, &rt->mu, &ts);
        for (proxy_t *p = rt->proxies; p; p = p->next) {
            pthread_mutex_lock(&p->mu);
            if (p->suspended && p->conn && !p->finished && !p->hung_up) {
                const union MHD_ConnectionInfo *ci = MHD_get_connection_info(p->conn, MHD_CONNECTION_INFO_CONNECTION_FD);
                struct pollfd pf = {.fd = ci ? ci->connect_fd : -1, .events = POLLRDHUP};
                if (pf.fd >= 0 && poll(&pf, 1, 0) == 1 && (pf.revents & (POLLRDHUP | POLLHUP | POLLERR))) p->hung_up = true;
            }
            pthread_mutex_unlock(&p->mu);
        }
        if (rt->stop && !rt->n_proxies) break;
    }
    pthread_mutex_unlock(&rt->mu);
    return NULL;
}

/* ---- the command ---- */
static int sig_pipe[2] = {-1, -1};

static void on_signal(int sig) {
    int saved = errno;
    unsigned char b = (unsigned char)sig;
    if (write(sig_pipe[1], &b, 1) < 0) {}
    errno = saved;
}

static void usage_router(FILE *f) {
    fprintf(f,
            "usage: caraserve router --replica URL [--replica URL ...] [options]\n"
            "An HTTP front for `caraserve serve` replicas of one base model: the OpenAI and rollout routes\n"
            "pass through (streams as they come), each generation request placed by the policy from\n"
            "every replica's GET /v1/state; admin requests (adapter loads and uploads, pause, resume,\n"
            "aborts) go to every healthy replica.\n"
            "\n"
            "  --replica URL                 a replica (http://host:port); repeat for each\n"
            "  --policy P                    rank-aware (default), round-robin or least-loaded\n"
            "  --host ADDR                   address to listen on (default 127.0.0.1)\n"
            "  --port N                      port (default 8080; 0: any free one, printed)\n"
            "  --poll-interval-ms N          read each replica's /v1/state this often (default 50)\n"
            "  --api-key KEY                 require 'Authorization: Bearer KEY' (default:\n"
            "                                $CARASERVE_API_KEY; also sent to the replicas for its polls)\n"
            "  --api-keys FILE               the replicas' key file: tenant keys reach the routes a tenant may\n"
            "                                call, admin keys all (docs/tenants.md); requests go on with their\n"
            "                                own key. SIGHUP rereads it. --api-key is then only the key of polls\n"
            "  --tpot-factor F               rank-aware: a request without a TPOT SLO is held to F times\n"
            "                                the base model's decode iteration (default 1.5)\n"
            "  --default-output-tokens N     rank-aware: expected output of a request without max_tokens\n"
            "                                (default 256)\n"
            "  --http-threads N              connection threads (default 4)\n"
            "  --max-body-bytes N            request body limit (default 32M)\n"
            "  --max-adapter-bytes N         PUT /v1/adapters/... body limit (default 2G)\n"
            "  --shutdown-timeout S          on SIGTERM/SIGINT, seconds to let requests finish (default 30)\n"
            "  -h, --help                    this text\n");
}

enum {
    O_REPLICA = 1000, O_POLICY, O_HOST, O_PORT, O_POLL, O_API_KEY, O_API_KEYS, O_TPOT, O_DEFOUT, O_HTTP_THREADS, O_MAX_BODY,
    O_MAX_ADAPTER, O_SHUTDOWN,
};

static bool parse_num(const char *flag, const char *s, double lo, double hi, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= lo && v <= hi)) {
        fprintf(stderr, "caraserve router: bad --%s '%s' (a number in [%g, %g])\n", flag, s, lo, hi);
        return false;
    }
    *out = v;
    return true;
}

static bool url_ok(const char *u) {
    if (strncmp(u, "http://", 7)) return false;
    const char *h = u + 7;
    return *h && *h != '/' && !strchr(h, '?') && !strchr(h, '#') && !strchr(h, ' ');
}

static int usage_error(void) {
    usage_router(stderr);
    return 2;
}

/* the options into CFG: -1 to go on, else the exit status (the message printed) */
static int parse_args(int argc, char **argv, router_config_t *cfg) {
    static const struct option opts[] = {
        {"replica", required_argument, 0, O_REPLICA}, {"policy", required_argument, 0, O_POLICY},
        {"host", required_argument, 0, O_HOST}, {"port", required_argument, 0, O_PORT},
        {"poll-interval-ms", required_argument, 0, O_POLL}, {"api-key", required_argument, 0, O_API_KEY},
        {"api-keys", required_argument, 0, O_API_KEYS},
        {"tpot-factor", required_argument, 0, O_TPOT}, {"default-output-tokens", required_argument, 0, O_DEFOUT},
        {"http-threads", required_argument, 0, O_HTTP_THREADS}, {"max-body-bytes", required_argument, 0, O_MAX_BODY},
        {"max-adapter-bytes", required_argument, 0, O_MAX_ADAPTER},
        {"shutdown-timeout", required_argument, 0, O_SHUTDOWN}, {"help", no_argument, 0, 'h'}, {0, 0, 0, 0},
    };
    optind = 1;
    opterr = 0;
    for (;;) {
        int o = getopt_long(argc, argv, ":h", opts, NULL);
        if (o == -1) break;
        double v;
        bool ok = true;
        switch (o) {
        case O_REPLICA: {
            if (!url_ok(optarg)) {
                fprintf(stderr, "caraserve router: bad --replica '%s' (http://host:port)\n", optarg);
                return 2;
            }
            char *u = strdup(optarg);
            size_t n = strlen(u);
            while (n > 7 && u[n - 1] == '/') u[--n] = 0;
            for (int i = 0; i < cfg->n_replicas; i++)
                if (!strcmp(cfg->replicas[i], u)) {
                    fprintf(stderr, "caraserve router: --replica %s given twice\n", u);
                    free(u);
                    return 2;
                }
            cfg->replicas[cfg->n_replicas++] = u;
            break;
        }
        case O_POLICY: {
            int p = route_policy_parse(optarg);
            if (p < 0) {
                fprintf(stderr, "caraserve router: bad --policy '%s' (rank-aware, round-robin or least-loaded)\n", optarg);
                return 2;
            }
            cfg->policy = (route_policy)p;
            break;
        }
        case O_HOST: cfg->host = optarg; break;
        case O_PORT: ok = parse_num("port", optarg, 0, 65535, &v) && v == (int)v; cfg->port = (int)v; break;
        case O_POLL: ok = parse_num("poll-interval-ms", optarg, 1, 3600000, &v); cfg->poll_ms = (int)v; break;
        case O_API_KEY: cfg->api_key = optarg; break;
        case O_API_KEYS: cfg->api_keys = optarg; break;
        case O_TPOT: ok = parse_num("tpot-factor", optarg, 1, 100, &v); cfg->tpot_factor = v; break;
        case O_DEFOUT: ok = parse_num("default-output-tokens", optarg, 1, 1 << 20, &v); cfg->default_output = (int)v; break;
        case O_HTTP_THREADS: ok = parse_num("http-threads", optarg, 1, 256, &v); cfg->http_threads = (int)v; break;
        case O_MAX_BODY:
        case O_MAX_ADAPTER: {
            long long b = cs_parse_size(optarg, &ok);
            if (!ok || b < 1024) {
                fprintf(stderr, "caraserve router: bad --%s '%s' (at least 1K)\n",
                        o == O_MAX_BODY ? "max-body-bytes" : "max-adapter-bytes", optarg);
                return 2;
            }
            *(o == O_MAX_BODY ? &cfg->max_body_bytes : &cfg->max_adapter_bytes) = b;
            break;
        }
        case O_SHUTDOWN: ok = parse_num("shutdown-timeout", optarg, 0, 86400, &v); cfg->shutdown_timeout = v; break;
        case 'h': usage_router(stdout); return 0;
        case ':': fprintf(stderr, "caraserve router: %s needs a value\n", argv[optind - 1]); return usage_error();
        default: fprintf(stderr, "caraserve router: unknown option '%s'\n", argv[optind - 1]); return usage_error();
        }
        if (!ok) return 2;
    }
    if (optind < argc) {
        fprintf(stderr, "caraserve router: unexpected argument '%s'\n", argv[optind]);
        return usage_error();
    }
    if (!cfg->n_replicas) {
        fprintf(stderr, "caraserve router: give at least one --replica URL\n");
        return usage_error();
    }
    if (!cfg->api_key && getenv("CARASERVE_API_KEY") && getenv("CARASERVE_API_KEY")[0])
        cfg->api_key = getenv("CARASERVE_API_KEY");
    return -1;
}

static void router_metrics_init(router_t *rt) {
    static const double lat[] = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1};
    rt->m_requests = metrics_counter(rt->reg, "caraserve_router_requests_total", "Requests sent to each replica (after retries).", (const char *[]){"replica", NULL});
    rt->m_up = metrics_gauge(rt->reg, "caraserve_router_replica_up", "1 while the replica is healthy and takes requests, else 0.", (const char *[]){"replica", NULL});
    rt->m_retries = metrics_counter(rt->reg, "caraserve_router_retries_total", "Requests that could not connect to a replica and were sent to another.", (const char *[]){"replica", NULL});
    rt->m_failed = metrics_counter(rt->reg, "caraserve_router_failed_requests_total", "Requests that failed in the router, by reason (no_replica, replica_failed, client_gone).", (const char *[]){"reason", NULL});
    rt->m_dispatch = metrics_histogram(rt->reg, "caraserve_router_dispatch_seconds", "From a request's complete body to its first byte sent upstream.", NULL, lat, (int)(sizeof lat / sizeof *lat));
    rt->m_in_flight = metrics_gauge(rt->reg, "caraserve_router_in_flight", "Requests open on each replica through this router.", (const char *[]){"replica", NULL});
}

/* the replicas, the shared curl handle and the metrics (libcurl initialised): CS_OK, else the
 * message printed */
static int router_init(router_t *rt) {
    rt->n_rep = rt->cfg.n_replicas;
    rt->rep = calloc((size_t)rt->n_rep, sizeof *rt->rep);
    rt->share = curl_share_init();
    rt->reg = metrics_new();
    if (!rt->rep || !rt->share || !rt->reg) {
        fprintf(stderr, "caraserve router: out of memory\n");
        return CS_ENOMEM;
    }
    pthread_mutex_init(&rt->mu, NULL);
    pthread_cond_init(&rt->cv, NULL);
    for (int i = 0; i < CURL_LOCK_DATA_LAST; i++) pthread_mutex_init(&rt->share_mu[i], NULL);
    curl_share_setopt(rt->share, CURLSHOPT_LOCKFUNC, share_lock);
    curl_share_setopt(rt->share, CURLSHOPT_UNLOCKFUNC, share_unlock);
    curl_share_setopt(rt->share, CURLSHOPT_USERDATA, rt);
    curl_share_setopt(rt->share, CURLSHOPT_SHARE, CURL_LOCK_DATA_CONNECT);
    curl_share_setopt(rt->share, CURLSHOPT_SHARE, CURL_LOCK_DATA_DNS);
    router_metrics_init(rt);
    for (int i = 0; i < rt->n_rep; i++) {
        rt->rep[i].url = rt->cfg.replicas[i];
        snprintf(rt->rep[i].why_down, sizeof rt->rep[i].why_down, "not polled yet");
        metric_set(rt->m_up, (const char *[]){rt->rep[i].url}, 0);
        metric_set(rt->m_in_flight, (const char *[]){rt->rep[i].url}, 0);
    }
    return CS_OK;
}

static void router_free(router_t *rt) {
    for (int i = 0; rt->rep && i < rt->n_rep; i++) {
        free(rt->rep[i].seqs);
        free(rt->rep[i].names);
        json_decref(rt->rep[i].adapters);
    }
    free(rt->rep);
    if (rt->share) curl_share_cleanup(rt->share);
    metrics_free(rt->reg);
    keyring_unref(rt->keys);
    curl_global_cleanup();
}

static keyring_t *router_keys(void *ctx) {
    router_t *rt = ctx;
    pthread_mutex_lock(&rt->mu);
    keyring_t *r = rt->keys;
    keyring_ref(r);
    pthread_mutex_unlock(&rt->mu);
    return r;
}

/* SIGHUP: --api-keys read again (a file that does not parse leaves the keys as they were) */
static void router_reload_keys(router_t *rt) {
    if (!rt->cfg.api_keys) return;
    keyring_t *r = keyring_load(rt->cfg.api_keys);
    if (!r) {
        fprintf(stderr, "caraserve router: SIGHUP: the keys stay as they were: %s\n", cs_error_last());
        return;
    }
    pthread_mutex_lock(&rt->mu);
    keyring_t *old = rt->keys;
    rt->keys = r;
    pthread_mutex_unlock(&rt->mu);
    keyring_unref(old);
    fprintf(stderr, "caraserve router: SIGHUP: %d keys from %s\n", keyring_count(r), rt->cfg.api_keys);
}

/* the signals that end the router, then the listening socket: CS_OK or an error */
static int router_listen(router_t *rt) {
    if (pipe(sig_pipe)) return CS_EIO;
    struct sigaction sa = {0};
    sa.sa_handler = on_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    rt->keys = rt->cfg.api_keys ? keyring_load(rt->cfg.api_keys) : keyring_single(rt->cfg.api_key);
    if (!rt->keys) {
        fprintf(stderr, "caraserve router: %s\n", cs_error_last());
        return CS_EINVAL;
    }
    rt->site = (http_site_t){.ctx = rt, .keys = router_keys, .max_body_bytes = rt->cfg.max_body_bytes,
                             .max_adapter_bytes = rt->cfg.max_adapter_bytes, .conn_new = router_conn_new,
                             .dispatch = router_dispatch, .resume = router_resume, .conn_done = router_conn_done,
                             .error_body = router_error_body};
    int rc = http_listen(&rt->site, rt->cfg.host, rt->cfg.port, (unsigned)rt->cfg.http_threads, &rt->d, &rt->bound_port);
    if (rc) fprintf(stderr, "caraserve router: %s\n", cs_error_last());
    return rc;
}

/* no new connections; the requests in flight get --shutdown-timeout, then are cut */
static void router_drain(router_t *rt) {
    MHD_socket lfd = MHD_quiesce_daemon(rt->d);
    if (lfd != MHD_INVALID_SOCKET) close(lfd);
    pthread_mutex_lock(&rt->mu);
    rt->stop = true;
    pthread_cond_broadcast(&rt->cv);
    double until = cs_time_ms() + rt->cfg.shutdown_timeout * 1000;
    while (rt->n_proxies && cs_time_ms() < until) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 50 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&rt->cv, &rt->mu, &ts);
    }
    for (proxy_t *p = rt->proxies; p; p = p->next) { /* out of time: cut the rest */
        pthread_mutex_lock(&p->mu);
        p->hung_up = true;
        pthread_mutex_unlock(&p->mu);
    }
    while (rt->n_proxies) pthread_cond_wait(&rt->cv, &rt->mu);
    pthread_cond_broadcast(&rt->cv);
    pthread_mutex_unlock(&rt->mu);
}

/* the pollers and the watcher, until SIGTERM or SIGINT; then the drain: the exit status */
static int router_serve(router_t *rt) {
    int rc = 1;
    pthread_t *pollers = calloc((size_t)rt->n_rep, sizeof *pollers);
    int n_pollers = 0;
    for (int i = 0; pollers && i < rt->n_rep; i++) {
        poll_arg_t *pa = malloc(sizeof *pa);
        if (!pa) break;
        *pa = (poll_arg_t){rt, i};
        if (pthread_create(&pollers[i], NULL, poll_thread, pa)) {
            free(pa);
            break;
        }
        n_pollers++;
    }
    bool watching = !pthread_create(&rt->watcher, NULL, watch_thread, rt);
    fprintf(stderr, "caraserve router: listening on http://%s:%d (%d replicas, policy %s)\n", rt->cfg.host,
            rt->bound_port, rt->n_rep, route_policy_name(rt->cfg.policy));
    fflush(stderr);
    if (n_pollers == rt->n_rep && watching) {
        unsigned char b = 0;
        while ((read(sig_pipe[0], &b, 1) < 0 && errno == EINTR) || b == SIGHUP) {
            if (b == SIGHUP) router_reload_keys(rt);
            b = 0;
        }
        pthread_mutex_lock(&rt->mu);
        int in_flight = rt->n_proxies;
        pthread_mutex_unlock(&rt->mu);
        fprintf(stderr, "caraserve router: signal %d: finishing %d requests (at most %g s)\n", b, in_flight,
                rt->cfg.shutdown_timeout);
        rc = 0;
    } else {
        fprintf(stderr, "caraserve router: cannot start a thread\n");
    }
    router_drain(rt);
    for (int i = 0; i < n_pollers; i++) pthread_join(pollers[i], NULL);
    free(pollers);
    if (watching) pthread_join(rt->watcher, NULL);
    MHD_stop_daemon(rt->d);
    return rc;
}

int cmd_router(int argc, char **argv) {
    router_t *rt = calloc(1, sizeof *rt);
    if (!rt) return 1;
    router_config_t *cfg = &rt->cfg;
    *cfg = (router_config_t){.host = "127.0.0.1", .port = 8080, .policy = ROUTE_RANK_AWARE, .poll_ms = 50,
                             .http_threads = 4, .max_body_bytes = 32LL << 20, .max_adapter_bytes = 2LL << 30,
                             .tpot_factor = 1.5, .shutdown_timeout = 30, .default_output = 256};
    cfg->replicas = calloc((size_t)(argc + 1), sizeof *cfg->replicas);
    int rc = parse_args(argc, argv, cfg);
    if (rc < 0) {
        rc = 1;
        if (curl_global_init(CURL_GLOBAL_ALL)) {
            fprintf(stderr, "caraserve router: cannot initialise libcurl\n");
        } else {
            if (!router_init(rt) && !router_listen(rt)) rc = router_serve(rt);
            router_free(rt);
        }
    }
    for (int i = 0; i < cfg->n_replicas; i++) free(cfg->replicas[i]);
    free(cfg->replicas);
    free(rt);
    return rc;
}
