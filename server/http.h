/* http.h: the libmicrohttpd edge that `caraserve serve` (server.h) and `caraserve router`
 * (cmd_router.c) share: one access handler (framing, API key and body limits checked on the
 * headers, the body collected, the request handed on), the HTTP error type and the error
 * objects clients see, responses, and the reader of streamed bodies. What differs between the
 * two servers comes in as an http_site_t: their limits and key, and callbacks. */
#ifndef CS_HTTP_H
#define CS_HTTP_H

#include <jansson.h>
#include <microhttpd.h>
#include <stdbool.h>
#include <sys/types.h>

#include "base/common.h"

/* An HTTP request's error: its status, the field it concerns ("" for none) and the message. */
typedef struct perr {
    unsigned status;
    char param[64];
    char msg[1536];
} perr_t;

/* sets *e; returns false, so that a parser ends with `return fail(e, ...)` */
bool fail(perr_t *e, unsigned status, const char *param, const char *fmt, ...) __attribute__((format(printf, 4, 5)));

/* The request as the access handler collects it; app is the server's own state of it. */
typedef struct http_conn {
    cs_buf_t body;                  /* the body so far (within limit) */
    long long limit;                /* body limit of this request */
    size_t discarded;               /* body bytes dropped after too_large */
    bool answered;                  /* answered on its headers: the rest of the body is dropped */
    bool too_large, started;        /* started: handed to dispatch */
    struct keyring *ring;           /* the keys it was let in with (held until it is done) */
    const struct key_grant *who;    /* its key's grant in ring (NULL: a route without keys) */
    void *app;
} http_conn_t;

/* A server on the access handler. It must outlive the daemon that http_listen starts. */
typedef struct http_site {
    void *ctx;                      /* the first argument of every callback */
    /* a reference to the keys in force now (server/keys.h), asked for each request to a route
     * with ROUTE_AUTH; NULL: no keys */
    struct keyring *(*keys)(void *ctx);
    long long max_body_bytes;
    long long max_adapter_bytes;    /* PUT bodies of ROUTE_UPLOAD routes */
    /* the server's state of a new request (h->app; NULL: out of memory) */
    void *(*conn_new)(void *ctx);
    /* the request with its whole body: queues its answer or suspends the connection */
    enum MHD_Result (*dispatch)(void *ctx, http_conn_t *h, struct MHD_Connection *c, const char *method,
                                const char *url);
    /* a later call for a dispatched request (its connection resumed); NULL: nothing to do */
    enum MHD_Result (*resume)(void *ctx, http_conn_t *h, struct MHD_Connection *c);
    /* the connection is finished (normally or not): app goes */
    void (*conn_done)(void *ctx, void *app);
    /* the body of an error answer, malloc'd (NULL: http_error_body) */
    char *(*error_body)(const perr_t *e);
} http_site_t;

/* Listens on HOST:PORT with THREADS connection threads, every request to SITE. CS_OK with *d
 * and *bound_port set, else an error (cs_error_last). */
int http_listen(const http_site_t *site, const char *host, int port, unsigned threads, struct MHD_Daemon **d,
                int *bound_port);

/* Responses (each queues exactly one response on the connection). */
enum MHD_Result http_json(struct MHD_Connection *c, unsigned status, json_t *body); /* steals body */
enum MHD_Result http_error(struct MHD_Connection *c, unsigned status, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* BODY (malloc'd, taken) as TYPE (NULL: no Content-Type) */
enum MHD_Result http_text(struct MHD_Connection *c, unsigned status, const char *type, char *body, size_t len);
/* SITE's error object of E (400 when it has no status) */
enum MHD_Result http_site_error(struct MHD_Connection *c, const http_site_t *site, const perr_t *e);
/* answers the error (400 when it has no status) */
enum MHD_Result reply_err(struct MHD_Connection *c, const perr_t *e);
/* {"error": {"message", "type", "param", "code"}} as text, malloc'd (NULL: out of memory) */
char *http_error_body(const perr_t *e);

/* Streamed bodies. The reader (MHD_create_response_from_callback) of a producer's buffer
 * OUT, called under the producer's lock: what OUT holds from *OFF on, into BUF; when it is
 * empty, the end once FINISHED, else 0 after suspending C (*SUSPENDED set: the producer
 * resumes it when it adds to OUT or finishes). */
ssize_t http_stream_take(cs_buf_t *out, size_t *off, bool finished, bool *suspended, struct MHD_Connection *c,
                         char *buf, size_t max);
/* Queues a response of STATUS and TYPE whose body READER produces (with Cache-Control:
 * no-cache, and HDR: VAL unless NULL). CLS is the reader's reference: FREE releases it, on
 * failure here too. */
enum MHD_Result http_stream_queue(struct MHD_Connection *c, unsigned status, const char *type, const char *hdr,
                                  const char *val, MHD_ContentReaderCallback reader, void *cls,
                                  MHD_ContentReaderFreeCallback free_cb);

#endif
