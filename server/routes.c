/* routes.c: see routes.h. */
#include "server/routes.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/types.h>

#include <microhttpd.h>

#define API (ROUTE_AUTH | ROUTE_READY | ROUTE_JSON)
#define T ROUTE_TENANT

static const route_t routes[] = {
    {"/health", "GET", 0, R_HEALTH},
    {"/version", "GET", 0, R_VERSION},
    {"/metrics", "GET", ROUTE_AUTH_TENANTS, R_METRICS},
    {"/v1/models", "GET", ROUTE_AUTH | ROUTE_READY | T, R_MODELS},
    {"/v1/models", "GET", ROUTE_AUTH | ROUTE_READY | ROUTE_PREFIX | T, R_MODEL},
    {"/v1/state", "GET", ROUTE_AUTH | ROUTE_READY, R_STATE},
    {"/v1/completions", "POST", API | ROUTE_GENERATES | T, R_COMPLETIONS},
    {"/v1/chat/completions", "POST", API | ROUTE_GENERATES | T, R_CHAT},
    {"/v1/load_lora_adapter", "POST", API, R_LOAD_LORA},
    {"/v1/unload_lora_adapter", "POST", API, R_UNLOAD_LORA},
    {"/tokenize", "POST", API | T, R_TOKENIZE},
    {"/detokenize", "POST", API | T, R_DETOKENIZE},
    /* the rollout side (rollout_api/README.md) */
    {"/v1/adapters", "GET", ROUTE_AUTH | ROUTE_READY | T, R_ADAPTERS},
    {"/v1/adapters", "GET PUT DELETE", ROUTE_AUTH | ROUTE_READY | ROUTE_PREFIX | ROUTE_UPLOAD | T, R_ADAPTER_VERSION},
    {"/v1/rollout", "POST", API | ROUTE_GENERATES | T, R_ROLLOUT},
    {"/v1/rollout/abort", "POST", API, R_ROLLOUT_ABORT},
    {"/generate", "POST", API | ROUTE_GENERATES | T, R_GENERATE},
    {"/abort_request", "POST", API, R_ABORT_REQUEST},
    {"/v1/pause", "POST", API, R_PAUSE},
    {"/v1/resume", "POST", API, R_RESUME},
    /* vLLM's and SGLang's names for pause and resume (bodies optional or absent) */
    {"/pause", "POST", ROUTE_AUTH | ROUTE_READY, R_VLLM_PAUSE},
    {"/resume", "POST", ROUTE_AUTH | ROUTE_READY, R_VLLM_RESUME},
    {"/is_paused", "GET", ROUTE_AUTH | ROUTE_READY, R_IS_PAUSED},
    {"/pause_generation", "POST", ROUTE_AUTH | ROUTE_READY, R_SGL_PAUSE},
    {"/continue_generation", "POST", ROUTE_AUTH | ROUTE_READY, R_SGL_CONTINUE},
    {"/flush_cache", "GET POST", ROUTE_AUTH | ROUTE_READY, R_FLUSH_CACHE},
    {"/reset_prefix_cache", "POST", ROUTE_AUTH | ROUTE_READY, R_RESET_PREFIX_CACHE},
    {"/abort_requests", "POST", ROUTE_AUTH | ROUTE_READY, R_VLLM_ABORT},
    {"/sleep", "POST", ROUTE_AUTH | ROUTE_READY, R_SLEEP},
    {"/wake_up", "POST", ROUTE_AUTH | ROUTE_READY, R_WAKE_UP},
    {"/is_sleeping", "GET", ROUTE_AUTH | ROUTE_READY, R_IS_SLEEPING},
    /* the base weights (rollout_api/weights.c), ours and SGLang's */
    {"/v1/weights", "GET POST", API, R_WEIGHTS},
    {"/update_weights_from_disk", "POST", API, R_SGL_UPDATE_WEIGHTS},
    {"/get_weight_version", "GET", ROUTE_AUTH | ROUTE_READY, R_SGL_WEIGHT_VERSION},
    {"/update_weight_version", "POST", API, R_SGL_SET_WEIGHT_VERSION},
    {"/get_model_info", "GET", ROUTE_AUTH | ROUTE_READY | T, R_SGL_MODEL_INFO},
    {"/model_info", "GET", ROUTE_AUTH | ROUTE_READY | T, R_SGL_MODEL_INFO},
    {"/get_server_info", "GET", ROUTE_AUTH | ROUTE_READY, R_SGL_SERVER_INFO},
    {"/server_info", "GET", ROUTE_AUTH | ROUTE_READY, R_SGL_SERVER_INFO},
    {"/v1/loads", "GET", ROUTE_AUTH | ROUTE_READY, R_SGL_LOADS},
    {"/health_generate", "GET", ROUTE_READY, R_HEALTH_GENERATE},
    {"/load_lora_adapter", "POST", API, R_SGL_LOAD_LORA},
    {"/unload_lora_adapter", "POST", API, R_SGL_UNLOAD_LORA},
    {"/update_weights_from_tensor", "POST", ROUTE_AUTH | ROUTE_READY, R_UNSPEAKABLE},
    {"/update_weights_from_distributed", "POST", ROUTE_AUTH | ROUTE_READY, R_UNSPEAKABLE},
    {"/init_weights_update_group", "POST", ROUTE_AUTH | ROUTE_READY, R_UNSPEAKABLE},
    {"/destroy_weights_update_group", "POST", ROUTE_AUTH | ROUTE_READY, R_UNSPEAKABLE},
    {"/update_weights_from_ipc", "POST", ROUTE_AUTH | ROUTE_READY, R_UNSPEAKABLE},
};

const route_t *route_find(const char *url) {
    for (size_t i = 0; i < sizeof routes / sizeof *routes; i++) {
        const route_t *r = &routes[i];
        size_t n = strlen(r->path);
        if (r->flags & ROUTE_PREFIX) {
            if (!strncmp(url, r->path, n) && url[n] == '/') return r;
        } else if (!strcmp(url, r->path)) {
            return r;
        }
    }
    return NULL;
}

bool route_allows(const route_t *r, const char *method) {
    size_t n = strlen(method);
    for (const char *p = r->methods; (p = strstr(p, method)); p += n)
        if ((p == r->methods || p[-1] == ' ') && (p[n] == 0 || p[n] == ' ')) return true;
    return false;
}

const char *route_methods_text(const route_t *r, char *buf, int len) {
    int k = 0;
    for (const char *p = r->methods; *p && k < len - 1;) {
        const char *e = strchr(p, ' ');
        int w = e ? (int)(e - p) : (int)strlen(p);
        k += snprintf(buf + k, (size_t)(len - k), "%s%.*s", k ? " or " : "", w, p);
        p += w + (e ? 1 : 0);
    }
    return buf;
}

bool route_needs_auth(const char *url) {
    const route_t *r = route_find(url);
    if (r) return r->flags & ROUTE_AUTH;
    return !strncmp(url, "/v1/", 4) || !strcmp(url, "/v1");
}

bool route_path_ok(const char *url) {
    if (url[0] != '/') return false;
    for (const char *p = url; *p; p++) {
        if ((unsigned char)*p < 0x20 || *p == 0x7f) return false;
        if (*p == '/' && p[1] == '.' && (p[2] == '/' || p[2] == 0 || (p[2] == '.' && (p[3] == '/' || p[3] == 0))))
            return false;
    }
    return true;
}

/* ---- request framing (RFC 9112 section 6) ---- */
typedef struct framing {
    int n_length, n_te;
    const char *length, *te;
} framing_t;

static enum MHD_Result count_framing(void *cls, enum MHD_ValueKind kind, const char *key, const char *value) {
    (void)kind;
    framing_t *f = cls;
    if (!strcasecmp(key, MHD_HTTP_HEADER_CONTENT_LENGTH)) {
        f->n_length++;
        f->length = value;
    } else if (!strcasecmp(key, MHD_HTTP_HEADER_TRANSFER_ENCODING)) {
        f->n_te++;
        f->te = value;
    }
    return MHD_YES;
}

/* S without the optional whitespace around it (RFC 9110 5.5): its start, its length in *N */
static const char *ows_trimmed(const char *s, size_t *n) {
    while (*s == ' ' || *s == '\t') s++;
    size_t k = strlen(s);
    while (k && (s[k - 1] == ' ' || s[k - 1] == '\t')) k--;
    *n = k;
    return s;
}

unsigned route_framing_check(struct MHD_Connection *c, char *msg, size_t msglen) {
    framing_t f = {0};
    MHD_get_connection_values(c, MHD_HEADER_KIND, count_framing, &f);
    if (f.n_te && f.n_length) {
        snprintf(msg, msglen, "a request with both Transfer-Encoding and Content-Length is refused (RFC 9112 6.3)");
        return 400;
    }
    if (f.n_length > 1) {
        snprintf(msg, msglen, "more than one Content-Length header");
        return 400;
    }
    if (f.n_length) {
        size_t n;
        const char *p = ows_trimmed(f.length, &n);
        if (n == 0 || n > 18 || strspn(p, "0123456789") != n) {
            snprintf(msg, msglen, "Content-Length '%.64s' is not a number of bytes", f.length);
            return 400;
        }
    }
    if (f.n_te > 1) {
        snprintf(msg, msglen, "more than one Transfer-Encoding header (only one, chunked, is supported)");
        return 400;
    }
    if (f.n_te) {
        size_t n;
        const char *p = ows_trimmed(f.te, &n);
        if (!(n == 7 && !strncasecmp(p, "chunked", 7))) {
            snprintf(msg, msglen, "Transfer-Encoding '%.64s' is not supported (only chunked)", f.te);
            return 501;
        }
    }
    return 0;
}
