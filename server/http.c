/* http.c: the libmicrohttpd side of the server. One access handler for every request:
 * the first call sees the headers (authentication and Content-Length are checked before any
 * body is read), the next ones collect the body within --max-body-bytes, the last one hands
 * it to the dispatcher (api.c). Generation requests suspend their connection while the engine
 * works and are resumed by the engine's sink (api_jobs.c); a finished connection aborts
 * whatever it still had running. */
#include <arpa/inet.h>
#include <netdb.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include "server/routes.h"
#include "server/server.h"

/* ---- responses ---- */
/* CLOSE: the connection ends after this response (a request whose framing cannot be trusted:
 * what follows it on the connection must not run as another request) */
static enum MHD_Result queue_ex(struct MHD_Connection *c, unsigned status, const char *type, char *body, size_t len,
                                bool close) {
    struct MHD_Response *r = MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    if (close) MHD_add_response_header(r, MHD_HTTP_HEADER_CONNECTION, "close");
    if (status == MHD_HTTP_UNAUTHORIZED) MHD_add_response_header(r, "WWW-Authenticate", "Bearer");
    enum MHD_Result ret = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result queue(struct MHD_Connection *c, unsigned status, const char *type, char *body, size_t len) {
    return queue_ex(c, status, type, body, len, false);
}

enum MHD_Result http_text(struct MHD_Connection *c, unsigned status, const char *type, char *body, size_t len) {
    return queue(c, status, type, body, len);
}

enum MHD_Result http_json(struct MHD_Connection *c, unsigned status, json_t *body) {
    char *s = json_dumps(body, JSON_COMPACT);
    json_decref(body);
    if (!s) return MHD_NO;
    return queue(c, status, "application/json", s, strlen(s));
}

static const char *error_type(unsigned status) {
    switch (status) {
    case 400: return "BadRequestError";
    case 401: return "AuthenticationError";
    case 403: return "PermissionDeniedError";
    case 404: return "NotFoundError";
    case 405: return "MethodNotAllowedError";
    case 409: return "ConflictError";
    case 413: return "RequestTooLargeError";
    case 501: return "NotImplementedError";
    case 503: return "ServiceUnavailableError";
    default: return status >= 500 ? "InternalServerError" : "BadRequestError";
    }
}

static json_t *error_object(unsigned status, const char *param, const char *msg);

enum MHD_Result http_error(struct MHD_Connection *c, unsigned status, const char *param, const char *fmt, ...) {
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return http_json(c, status, error_object(status, param, msg));
}

/* an error after which the connection closes */
static enum MHD_Result http_error_close(struct MHD_Connection *c, unsigned status, const char *msg) {
    json_t *o = error_object(status, NULL, msg);
    char *body = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    return body ? queue_ex(c, status, "application/json", body, strlen(body), true) : MHD_NO;
}

/* {"error": {...}} (a new reference) */
static json_t *error_object(unsigned status, const char *param, const char *msg) {
    json_t *e = json_pack("{s:s, s:s, s:o, s:i}", "message", msg, "type", error_type(status), "param",
                          param ? json_string(param) : json_null(), "code", (int)status);
    if (!e) { /* the message was not valid UTF-8 (it quotes user input) */
        e = json_pack("{s:s, s:s, s:n, s:i}", "message", "invalid request (the error message is not valid UTF-8)",
                      "type", error_type(status), "param", "code", (int)status);
    }
    return json_pack("{s:o}", "error", e);
}

/* ---- security ---- */
bool auth_ok(const server_t *s, const char *h) { return route_bearer_ok(s->cfg.api_key, h); }

/* "/a/./b/../c" -> "/a/c" for an absolute path (no file system access) */
static char *lexical_abs(const char *path) {
    char *cwd = path[0] == '/' ? NULL : getcwd(NULL, 0);
    size_t n = strlen(path) + (cwd ? strlen(cwd) + 1 : 0) + 2;
    char *in = malloc(n), *out = malloc(n);
    if (!in || !out) { free(in); free(out); free(cwd); return NULL; }
    snprintf(in, n, "%s%s%s", cwd ? cwd : "", cwd ? "/" : "", path);
    free(cwd);
    size_t o = 0;
    char *save = NULL;
    for (char *tok = strtok_r(in, "/", &save); tok; tok = strtok_r(NULL, "/", &save)) {
        if (!strcmp(tok, ".")) continue;
        if (!strcmp(tok, "..")) {
            while (o > 0 && out[o - 1] != '/') o--;
            if (o > 0) o--;
            continue;
        }
        out[o++] = '/';
        size_t l = strlen(tok);
        memcpy(out + o, tok, l);
        o += l;
    }
    if (o == 0) out[o++] = '/';
    out[o] = 0;
    free(in);
    return out;
}

static int root_of(const server_t *s, const char *p) {
    for (int i = 0; i < s->n_roots; i++) {
        size_t n = strlen(s->roots[i]);
        if (strncmp(p, s->roots[i], n) == 0 && (p[n] == '/' || p[n] == 0 || (n == 1 && s->roots[i][0] == '/')))
            return i;
    }
    return -1;
}

int lora_path_check(const server_t *s, const char *path, char **real, char *err, size_t errlen) {
    *real = NULL;
    if (s->n_roots == 0) {
        snprintf(err, errlen, "loading adapters over HTTP is disabled: start the server with --lora-root DIR");
        return 403;
    }
    char *rp = realpath(path, NULL);
    if (!rp) {
        /* say "missing" only for a path that would be inside a root: no existence oracle
         * for the rest of the file system */
        char *lex = lexical_abs(path);
        bool inside = lex && root_of(s, lex) >= 0;
        free(lex);
        if (!inside) {
            snprintf(err, errlen, "adapter path '%s' is outside the allowed --lora-root directories", path);
            return 403;
        }
        snprintf(err, errlen, "adapter path '%s' does not exist", path);
        return 404;
    }
    int root = root_of(s, rp);
    if (root < 0) {
        free(rp);
        snprintf(err, errlen, "adapter path '%s' is outside the allowed --lora-root directories", path);
        return 403;
    }
    /* the files read from it must not lead out of the root either (symlinked files) */
    static const char *const files[] = {"adapter_config.json", "adapter_model.safetensors"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        char *f = cs_path_join(rp, files[i]);
        char *frp = f ? realpath(f, NULL) : NULL;
        bool bad = frp && root_of(s, frp) != root;
        free(f);
        free(frp);
        if (bad) {
            free(rp);
            snprintf(err, errlen, "adapter path '%s': %s leads outside the allowed --lora-root directories", path,
                     files[i]);
            return 403;
        }
    }
    *real = rp;
    return 0;
}

/* ---- the access handler ---- */
/* an adapter upload may be much larger than a request */
static long long body_limit(const server_t *s, const char *method, const char *url) {
    const route_t *r = route_find(url);
    return r && (r->flags & ROUTE_UPLOAD) && !strcmp(method, "PUT") ? s->cfg.max_adapter_bytes : s->cfg.max_body_bytes;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    (void)version;
    server_t *s = cls;
    conn_t *cn = *con_cls;
    if (!cn) {
        cn = calloc(1, sizeof *cn);
        if (!cn) return MHD_NO;
        cn->srv = s;
        cn->t_arrival = cs_time_ms();
        *con_cls = cn;
        char msg[256];
        unsigned bad = route_framing_check(c, msg, sizeof msg);
        if (bad) {
            cn->answered = true;
            return http_error_close(c, bad, msg);
        }
        if (route_needs_auth(url) && !auth_ok(s, MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION))) {
            cn->answered = true;
            return http_error(c, 401, NULL, "missing or invalid API key (send 'Authorization: Bearer KEY')");
        }
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        cn->limit = body_limit(s, method, url);
        if (cl && strtoll(cl, NULL, 10) > cn->limit) {
            cn->answered = true;
            return http_error(c, 413, NULL, "request body of %s bytes exceeds the limit of %lld bytes", cl, cn->limit);
        }
        return MHD_YES;
    }
    if (cn->answered) { /* an early answer: drop the rest of the upload */
        *upload_size = 0;
        return MHD_YES;
    }
    if (*upload_size) {
        if (cn->too_large) {
            /* a body without Content-Length that went over: read and drop the rest so the
             * client (still sending) gets its 413, but not forever */
            cn->discarded += *upload_size;
            if (cn->discarded > (size_t)8 * (size_t)cn->limit + ((size_t)256 << 20)) return MHD_NO;
        } else {
            if ((long long)(cn->len + *upload_size) > cn->limit) {
                cn->too_large = true;
                free(cn->body);
                cn->body = NULL;
                cn->len = cn->cap = 0;
            } else {
                if (cn->len + *upload_size + 1 > cn->cap) {
                    size_t nc = cn->cap ? cn->cap : 4096;
                    while (nc < cn->len + *upload_size + 1) nc *= 2;
                    char *nb = realloc(cn->body, nc);
                    if (!nb) return MHD_NO;
                    cn->body = nb;
                    cn->cap = nc;
                }
                memcpy(cn->body + cn->len, upload, *upload_size);
                cn->len += *upload_size;
                cn->body[cn->len] = 0;
            }
        }
        *upload_size = 0;
        return MHD_YES;
    }
    if (cn->unload_waiting) return api_unload_resume(s, cn, c);
    if (cn->job) return api_resume(s, cn, c);
    if (cn->started) return MHD_YES;
    cn->started = true;
    if (cn->too_large)
        return http_error(c, 413, NULL, "request body exceeds the limit of %lld bytes", cn->limit);
    return api_dispatch(s, cn, c, method, url, cn->body ? cn->body : "", cn->len);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe) {
    (void)c;
    (void)toe;
    server_t *s = cls;
    conn_t *cn = *con_cls;
    if (!cn) return;
    api_conn_done(s, cn);
    free(cn->unload_name);
    free(cn->body);
    free(cn);
    *con_cls = NULL;
}

int http_start(server_t *s) {
    struct addrinfo hints = {0}, *ai = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    char port[16];
    snprintf(port, sizeof port, "%d", s->cfg.port);
    int gai = getaddrinfo(s->cfg.host, port, &hints, &ai);
    if (gai) return cs_error_set(CS_EINVAL, "--host %s: %s", s->cfg.host, gai_strerror(gai));
    /* "localhost" may list ::1 first: take IPv4 when there is one; "::" takes both */
    struct addrinfo *pick = ai;
    for (struct addrinfo *p = ai; p; p = p->ai_next)
        if (p->ai_family == AF_INET) { pick = p; break; }
    unsigned flags = MHD_USE_AUTO_INTERNAL_THREAD | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG; /* epoll on Linux */
    if (pick->ai_family == AF_INET6) flags |= MHD_USE_DUAL_STACK;
    s->d = MHD_start_daemon(flags, 0, NULL, NULL, on_request, s,
                            MHD_OPTION_SOCK_ADDR, pick->ai_addr,
                            MHD_OPTION_THREAD_POOL_SIZE, (unsigned)(s->cfg.http_threads > 0 ? s->cfg.http_threads : 4),
                            MHD_OPTION_NOTIFY_COMPLETED, on_completed, s,
                            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)600,
                            MHD_OPTION_CONNECTION_LIMIT, (unsigned)4096,
                            MHD_OPTION_LISTENING_ADDRESS_REUSE, (unsigned)1,
                            MHD_OPTION_END);
    freeaddrinfo(ai);
    if (!s->d) return cs_error_set(CS_EIO, "cannot listen on %s:%d (in use, or not a local address?)", s->cfg.host, s->cfg.port);
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->d, MHD_DAEMON_INFO_BIND_PORT);
    s->bound_port = di ? di->port : s->cfg.port;
    return CS_OK;
}

void http_stop(server_t *s) {
    if (!s->d) return;
    MHD_stop_daemon(s->d);
    s->d = NULL;
}
