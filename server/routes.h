/* routes.h: the server's one route table. The access handler (http.c) asks it whether a
 * path needs the API key and how large its body may be; the dispatcher (api.c) finds the
 * route, answers 404/405/503 from it and calls the route's handler. Adding an endpoint is
 * one row here and one case in api.c's dispatcher. */
#ifndef CS_ROUTES_H
#define CS_ROUTES_H

#include <stdbool.h>
#include <stddef.h>

typedef enum route_id {
    R_HEALTH, R_VERSION, R_METRICS, R_MODELS, R_MODEL, R_COMPLETIONS, R_CHAT, R_LOAD_LORA, R_UNLOAD_LORA, R_TOKENIZE,
    R_DETOKENIZE, R_ADAPTERS, R_ADAPTER_VERSION, R_ROLLOUT, R_ROLLOUT_ABORT, R_GENERATE, R_ABORT_REQUEST, R_PAUSE,
    R_RESUME, R_STATE, R_VLLM_PAUSE, R_VLLM_RESUME, R_IS_PAUSED, R_SGL_PAUSE, R_SGL_CONTINUE,
    R_FLUSH_CACHE, R_RESET_PREFIX_CACHE, R_WEIGHTS, R_SGL_UPDATE_WEIGHTS, R_SGL_WEIGHT_VERSION,
    R_SGL_SET_WEIGHT_VERSION, R_SGL_MODEL_INFO, R_SGL_SERVER_INFO, R_SGL_LOADS, R_HEALTH_GENERATE, R_SGL_LOAD_LORA,
    R_SGL_UNLOAD_LORA, R_UNSPEAKABLE, R_VLLM_ABORT, R_SLEEP, R_WAKE_UP, R_IS_SLEEPING,
} route_id;

enum {
    ROUTE_AUTH = 1u << 0,       /* needs the API key (when one is set) */
    ROUTE_READY = 1u << 1,      /* 503 while the model loads */
    ROUTE_GENERATES = 1u << 2,  /* starts generation: 503 while draining */
    ROUTE_JSON = 1u << 3,       /* the body is a JSON object (400 otherwise) */
    ROUTE_PREFIX = 1u << 4,     /* the path is a prefix: PATH/... */
    ROUTE_UPLOAD = 1u << 5,     /* body limit --max-adapter-bytes instead of --max-body-bytes */
    ROUTE_TENANT = 1u << 6,     /* a tenant's key may call it (the rest of ROUTE_AUTH: admin keys) */
    ROUTE_AUTH_TENANTS = 1u << 7, /* needs an admin key when some key is a tenant's, else open */
};

typedef struct route {
    const char *path;
    const char *methods;        /* the methods it answers, space-separated: "GET", "PUT DELETE" */
    unsigned flags;
    route_id id;
} route_t;

/* the route of URL, or NULL (404) */
const route_t *route_find(const char *url);
/* METHOD is one of the route's */
bool route_allows(const route_t *r, const char *method);
/* "GET", "PUT or DELETE": for a 405's message */
const char *route_methods_text(const route_t *r, char *buf, int len);
/* the API key is checked for this URL: its route's flag, or any other path under /v1 */
bool route_needs_auth(const char *url);
/* URL (the path as libmicrohttpd decoded it) has no "." or ".." segment and no control
 * character: what is routed, checked for keys and forwarded is one path */
bool route_path_ok(const char *url);
/* The request's framing (RFC 9112 section 6), from its headers: 0 when its body's length is
 * unambiguous; else the status with a message in MSG: 400 for Content-Length and
 * Transfer-Encoding together, two Content-Lengths, one that is not a number, two
 * Transfer-Encodings; 501 for a Transfer-Encoding other than chunked. A front end answers such
 * a request and closes its connection: behind a proxy that frames it the other way, what
 * follows would otherwise run as a second, smuggled request. */
struct MHD_Connection;
unsigned route_framing_check(struct MHD_Connection *c, char *msg, size_t msglen);

#endif
