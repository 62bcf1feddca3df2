/* http.c: the libmicrohttpd side of both servers (http.h). One access handler for every
 * request: the first call sees the headers (framing, authentication and Content-Length are
 * checked before any body is read), the next ones collect the body within the site's limits,
 * the last one hands it to the site's dispatcher; calls after that (a suspended connection
 * resumed) go to the site's resume. `caraserve serve`'s site is here too (http_start): its
 * dispatcher is api.c; generation requests suspend their connection while the engine works
 * and are resumed by the engine's sink (api_jobs.c); a finished connection aborts whatever it
 * still had running. */
#include <arpa/inet.h>
#include <dirent.h>
#include <netdb.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include "server/keys.h"
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
    if (type) MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    if (close) MHD_add_response_header(r, MHD_HTTP_HEADER_CONNECTION, "close");
    if (status == MHD_HTTP_UNAUTHORIZED) MHD_add_response_header(r, "WWW-Authenticate", "Bearer");
    enum MHD_Result ret = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return ret;
}

enum MHD_Result http_text(struct MHD_Connection *c, unsigned status, const char *type, char *body, size_t len) {
    return queue_ex(c, status, type, body, len, false);
}

enum MHD_Result http_json(struct MHD_Connection *c, unsigned status, json_t *body) {
    char *s = json_dumps(body, JSON_COMPACT);
    json_decref(body);
    if (!s) return MHD_NO;
    return http_text(c, status, "application/json", s, strlen(s));
}

/* ---- errors ---- */
bool fail(perr_t *e, unsigned status, const char *param, const char *fmt, ...) {
    e->status = status;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
    return false;
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

char *http_error_body(const perr_t *e) {
    json_t *o = error_object(e->status, e->param[0] ? e->param : NULL, e->msg);
    char *body = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    return body;
}

/* the site's error body of E, queued (CLOSE: the connection ends after it) */
static enum MHD_Result site_error_ex(struct MHD_Connection *c, const http_site_t *site, const perr_t *e, bool close) {
    perr_t e400;
    if (!e->status) {
        e400 = *e;
        e400.status = 400;
        e = &e400;
    }
    char *body = (site && site->error_body ? site->error_body : http_error_body)(e);
    return body ? queue_ex(c, e->status, "application/json", body, strlen(body), close) : MHD_NO;
}

enum MHD_Result http_site_error(struct MHD_Connection *c, const http_site_t *site, const perr_t *e) {
    return site_error_ex(c, site, e, false);
}

enum MHD_Result reply_err(struct MHD_Connection *c, const perr_t *e) { return site_error_ex(c, NULL, e, false); }

enum MHD_Result http_error(struct MHD_Connection *c, unsigned status, const char *param, const char *fmt, ...) {
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return http_json(c, status, error_object(status, param, msg));
}

/* ---- security ---- */
struct keyring *server_keys(server_t *s) {
    pthread_mutex_lock(&s->mu);
    struct keyring *r = s->keys;
    keyring_ref(r);
    pthread_mutex_unlock(&s->mu);
    return r;
}

static struct keyring *serve_keys(void *ctx) { return server_keys(ctx); }

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

/* realpath(PATH) inside a root, and every file of it read (FILES; NULL: every entry of the
 * directory) inside the same root: symlinked files must not lead out. WHAT names it. */
static int root_path_check(const server_t *s, const char *path, const char *what, const char *const *files,
                           char **real, perr_t *e) {
    *real = NULL;
    if (s->n_roots == 0) {
        fail(e, 403, NULL, "loading %ss over HTTP is disabled: start the server with --lora-root DIR", what);
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
            fail(e, 403, NULL, "%s path '%s' is outside the allowed --lora-root directories", what, path);
            return 403;
        }
        fail(e, 404, NULL, "%s path '%s' does not exist", what, path);
        return 404;
    }
    int root = root_of(s, rp);
    if (root < 0) {
        free(rp);
        fail(e, 403, NULL, "%s path '%s' is outside the allowed --lora-root directories", what, path);
        return 403;
    }
    DIR *d = files ? NULL : opendir(rp);
    struct dirent *de = NULL;
    for (size_t i = 0;; i++) {
        const char *name = files ? files[i] : (d && (de = readdir(d))) ? de->d_name : NULL;
        if (!name) break;
        if (!strcmp(name, ".") || !strcmp(name, "..")) continue;
        char *f = cs_path_join(rp, name);
        char *frp = f ? realpath(f, NULL) : NULL;
        bool bad = frp && root_of(s, frp) != root;
        free(f);
        free(frp);
        if (bad) {
            fail(e, 403, NULL, "%s path '%s': %s leads outside the allowed --lora-root directories", what, path, name);
            if (d) closedir(d);
            free(rp);
            return 403;
        }
    }
    if (d) closedir(d);
    *real = rp;
    return 0;
}

int lora_path_check(const server_t *s, const char *path, char **real, perr_t *e) {
    static const char *const files[] = {"adapter_config.json", "adapter_model.safetensors", NULL};
    return root_path_check(s, path, "adapter", files, real, e);
}

int weights_path_check(const server_t *s, const char *path, char **real, perr_t *e) {
    return root_path_check(s, path, "weights", NULL, real, e);
}

/* ---- streamed bodies ---- */
ssize_t http_stream_take(cs_buf_t *out, size_t *off, bool finished, bool *suspended, struct MHD_Connection *c,
                         char *buf, size_t max) {
    if (*off < out->len) {
        size_t n = out->len - *off;
        if (n > max) n = max;
        memcpy(buf, out->p + *off, n);
        *off += n;
        if (*off == out->len) *off = out->len = 0;
        return (ssize_t)n;
    }
    if (finished) return MHD_CONTENT_READER_END_OF_STREAM;
    *suspended = true;
    MHD_suspend_connection(c);
    return 0;
}

enum MHD_Result http_stream_queue(struct MHD_Connection *c, unsigned status, const char *type, const char *hdr,
                                  const char *val, MHD_ContentReaderCallback reader, void *cls,
                                  MHD_ContentReaderFreeCallback free_cb) {
    struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, reader, cls, free_cb);
    if (!r) {
        free_cb(cls);
        return MHD_NO;
    }
    if (type) MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    if (hdr) MHD_add_response_header(r, hdr, val);
    enum MHD_Result ret = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return ret;
}

/* ---- the access handler ---- */
/* an adapter upload may be much larger than a request */
static long long body_limit(const http_site_t *site, const char *method, const char *url) {
    const route_t *r = route_find(url);
    return r && (r->flags & ROUTE_UPLOAD) && !strcmp(method, "PUT") ? site->max_adapter_bytes : site->max_body_bytes;
}

/* the first call: the headers only. The request is answered here when its framing, its key
 * or its Content-Length says so. */
static enum MHD_Result on_headers(const http_site_t *site, struct MHD_Connection *c, const char *url,
                                  const char *method, void **con_cls) {
    http_conn_t *h = calloc(1, sizeof *h);
    if (!h) return MHD_NO;
    h->app = site->conn_new(site->ctx);
    if (!h->app) {
        free(h);
        return MHD_NO;
    }
    *con_cls = h;
    perr_t e = {0};
    e.status = route_framing_check(c, e.msg, sizeof e.msg);
    if (e.status) {
        h->answered = true;
        return site_error_ex(c, site, &e, true);
    }
    if (!e.status && !route_path_ok(url)) {
        h->answered = true;
        fail(&e, 400, NULL, "a path with a '.' or '..' segment or a control character is refused");
        return site_error_ex(c, site, &e, false);
    }
    const route_t *rt = route_find(url);
    if (site->keys && (route_needs_auth(url) || (rt && (rt->flags & ROUTE_AUTH_TENANTS)))) {
        h->ring = site->keys(site->ctx);
        if (h->ring && !route_needs_auth(url) && !keyring_has_tenants(h->ring)) { /* open without tenants */
            keyring_unref(h->ring);
            h->ring = NULL;
            goto keyed;
        }
        h->who = h->ring ? keyring_check(h->ring, MHD_lookup_connection_value(c, MHD_HEADER_KIND,
                                                                               MHD_HTTP_HEADER_AUTHORIZATION))
                         : NULL;
        if (!h->who) {
            h->answered = true;
            fail(&e, 401, NULL, "missing or invalid API key (send 'Authorization: Bearer KEY')");
            return site_error_ex(c, site, &e, false);
        }
        if (rt && (rt->flags & ROUTE_AUTH_TENANTS) && !key_is_admin(h->who)) {
            h->answered = true;
            fail(&e, 403, NULL, "%s %s needs an admin key (it names every tenant's adapters)", method, url);
            return site_error_ex(c, site, &e, false);
        }
    }
keyed:;
    const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    h->limit = body_limit(site, method, url);
    if (cl && strtoll(cl, NULL, 10) > h->limit) {
        h->answered = true;
        fail(&e, 413, NULL, "request body of %s bytes exceeds the limit of %lld bytes", cl, h->limit);
        return site_error_ex(c, site, &e, false);
    }
    return MHD_YES;
}

/* a piece of the body */
static enum MHD_Result on_upload(http_conn_t *h, const char *upload, size_t *upload_size) {
    if (h->too_large) {
        /* a body without Content-Length that went over: read and drop the rest so the client
         * (still sending) gets its 413, but not forever */
        h->discarded += *upload_size;
        if (h->discarded > (size_t)8 * (size_t)h->limit + ((size_t)256 << 20)) return MHD_NO;
    } else if ((long long)(h->body.len + *upload_size) > h->limit) {
        h->too_large = true;
        cs_buf_free(&h->body);
    } else if (!cs_buf_add(&h->body, upload, *upload_size)) {
        return MHD_NO;
    }
    *upload_size = 0;
    return MHD_YES;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    (void)version;
    const http_site_t *site = cls;
    http_conn_t *h = *con_cls;
    if (!h) return on_headers(site, c, url, method, con_cls);
    if (h->answered) { /* an early answer: drop the rest of the upload */
        *upload_size = 0;
        return MHD_YES;
    }
    if (*upload_size) return on_upload(h, upload, upload_size);
    if (h->started) return site->resume ? site->resume(site->ctx, h, c) : MHD_YES;
    h->started = true;
    if (h->too_large) {
        perr_t e;
        fail(&e, 413, NULL, "request body exceeds the limit of %lld bytes", h->limit);
        return site_error_ex(c, site, &e, false);
    }
    return site->dispatch(site->ctx, h, c, method, url);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe) {
    (void)c;
    (void)toe;
    const http_site_t *site = cls;
    http_conn_t *h = *con_cls;
    if (!h) return;
    site->conn_done(site->ctx, h->app);
    keyring_unref(h->ring);
    cs_buf_free(&h->body);
    free(h);
    *con_cls = NULL;
}

int http_listen(const http_site_t *site, const char *host, int port, unsigned threads, struct MHD_Daemon **d,
                int *bound_port) {
    struct addrinfo hints = {0}, *ai = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    int gai = getaddrinfo(host, ps, &hints, &ai);
    if (gai) return cs_error_set(CS_EINVAL, "--host %s: %s", host, gai_strerror(gai));
    /* "localhost" may list ::1 first: take IPv4 when there is one; "::" takes both */
    struct addrinfo *pick = ai;
    for (struct addrinfo *p = ai; p; p = p->ai_next)
        if (p->ai_family == AF_INET) { pick = p; break; }
    unsigned flags = MHD_USE_AUTO_INTERNAL_THREAD | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG; /* epoll on Linux */
    if (pick->ai_family == AF_INET6) flags |= MHD_USE_DUAL_STACK;
    *d = MHD_start_daemon(flags, 0, NULL, NULL, on_request, (void *)site,
                          MHD_OPTION_SOCK_ADDR, pick->ai_addr,
                          MHD_OPTION_THREAD_POOL_SIZE, threads,
                          MHD_OPTION_NOTIFY_COMPLETED, on_completed, (void *)site,
                          MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)600,
                          MHD_OPTION_CONNECTION_LIMIT, (unsigned)4096,
                          MHD_OPTION_LISTENING_ADDRESS_REUSE, (unsigned)1,
                          MHD_OPTION_END);
    freeaddrinfo(ai);
    if (!*d) return cs_error_set(CS_EIO, "cannot listen on %s:%d (in use, or not a local address?)", host, port);
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(*d, MHD_DAEMON_INFO_BIND_PORT);
    *bound_port = di ? di->port : port;
    return CS_OK;
}

/* ---- `caraserve serve`'s site (api.c dispatches) ---- */
static void *serve_conn_new(void *ctx) {
    conn_t *cn = calloc(1, sizeof *cn);
    if (!cn) return NULL;
    cn->srv = ctx;
    cn->t_arrival = cs_time_ms();
    return cn;
}

static enum MHD_Result serve_dispatch(void *ctx, http_conn_t *h, struct MHD_Connection *c, const char *method,
                                      const char *url) {
    ((conn_t *)h->app)->who = h->who;
    return api_dispatch(ctx, h->app, c, method, url, h->body.p ? h->body.p : "", h->body.len);
}

static enum MHD_Result serve_resume(void *ctx, http_conn_t *h, struct MHD_Connection *c) {
    conn_t *cn = h->app;
    if (cn->unload_waiting) return api_unload_resume(ctx, cn, c);
    if (cn->job) return api_resume(ctx, cn, c);
    return MHD_YES;
}

static void serve_conn_done(void *ctx, void *app) {
    conn_t *cn = app;
    api_conn_done(ctx, cn);
    free(cn->unload_name);
    free(cn);
}

int http_start(server_t *s) {
    s->site = (http_site_t){.ctx = s, .keys = serve_keys, .max_body_bytes = s->cfg.max_body_bytes,
                            .max_adapter_bytes = s->cfg.max_adapter_bytes, .conn_new = serve_conn_new,
                            .dispatch = serve_dispatch, .resume = serve_resume, .conn_done = serve_conn_done};
    unsigned threads = (unsigned)(s->cfg.http_threads > 0 ? s->cfg.http_threads : 4);
    return http_listen(&s->site, s->cfg.host, s->cfg.port, threads, &s->d, &s->bound_port);
}

void http_stop(server_t *s) {
    if (!s->d) return;
    MHD_stop_daemon(s->d);
    s->d = NULL;
}
