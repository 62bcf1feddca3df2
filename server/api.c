/* api.c: the dispatcher. It finds the request's route in the one table (server/routes.c),
 * answers 404/405/503 from it, parses the JSON body of the routes that take one and calls the
 * route's handler: the OpenAI/vLLM endpoints (api_openai.c), /metrics (api_metrics.c) and
 * the rollout side (rollout_api/routes.c). The jobs that generation requests become live in
 * api_jobs.c, the helpers they share in api_util.c (api_internal.h). */
#include <string.h>

#include "config.h"
#include "rollout_api/routes.h"
#include "rollout_api/weights.h"
#include "server/api_internal.h"
#include "server/keys.h"
#include "server/routes.h"

/* /v1/adapters/{name}/...: GET .../stats; PUT and DELETE .../versions/{v}. A tenant's key
 * reaches only its own adapters (another's is answered as one that does not exist), and
 * pushes or deletes versions only with "push". */
static enum MHD_Result adapter_route(server_t *s, conn_t *cn, struct MHD_Connection *c, const char *method,
                                     const char *url, const char *body, size_t body_len) {
    const char *p = url + strlen("/v1/adapters/"), *slash = strchr(p, '/');
    bool get = !strcmp(method, "GET");
    size_t ul = strlen(url);
    if (get && ul > 6 && !strcmp(url + ul - 6, "/stats")) slash = url + ul - 6; /* a base model's name may hold '/' */
    char name[257];
    if (!slash || slash == p || (size_t)(slash - p) >= sizeof name)
        return http_error(c, 404, NULL, "no route %s %s", method, url);
    memcpy(name, p, (size_t)(slash - p));
    name[slash - p] = 0;
    if (get) {
        if (strcmp(slash, "/stats")) return http_error(c, 404, NULL, "GET /v1/adapters/NAME/stats");
        return api_adapter_stats(s, cn, c, name);
    }
    if (!api_may_use(cn, name)) {
        if (!strcmp(method, "PUT")) return http_error(c, 403, NULL, "this key may not push versions of '%s'", name);
        return http_error(c, 404, NULL, "adapter '%s' does not exist", name);
    }
    if (!api_is_admin(cn) && !cn->who->push)
        return http_error(c, 403, NULL, "this key may use '%s' but not push or delete its versions", name);
    const char *ct = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_TYPE);
    if (!api_is_admin(cn) && !strcmp(method, "PUT") && ct && !strncmp(ct, "application/json", 16))
        return http_error(c, 403, NULL, "a tenant's key pushes a version as its adapter_model.safetensors in the body "
                                        "(?r=&lora_alpha=&target_modules=), not as a path on the server");
    return !strcmp(method, "PUT") ? rollout_route_put_version(s, c, url, body, body_len)
                                  : rollout_route_delete_version(s, c, url);
}

static enum MHD_Result route(server_t *s, conn_t *cn, struct MHD_Connection *c, const char *method, const char *url,
                             const char *body, size_t body_len) {
    const route_t *rt = route_find(url);
    if (!rt) return http_error(c, 404, NULL, "no route %s %s", method, url);
    pthread_mutex_lock(&s->mu);
    bool ready = s->ready, draining = s->draining;
    pthread_mutex_unlock(&s->mu);
    if ((rt->flags & ROUTE_READY) && !ready) return http_error(c, 503, NULL, "the model is loading");
    if (!route_allows(rt, method)) {
        char m[64];
        return http_error(c, 405, NULL, "use %s %s", route_methods_text(rt, m, sizeof m), url);
    }
    if ((rt->flags & ROUTE_AUTH) && !(rt->flags & ROUTE_TENANT) && !api_is_admin(cn))
        return http_error(c, 403, NULL, "%s %s needs an admin key", method, url);
    switch (rt->id) { /* the routes without a JSON body */
    case R_HEALTH:
        if (!ready || draining) return http_error(c, 503, NULL, draining ? "shutting down" : "the model is loading");
        return http_text(c, 200, "text/plain; charset=utf-8", strdup(""), 0);
    case R_VERSION: return http_json(c, 200, json_pack("{s:s}", "version", PACKAGE_VERSION));
    case R_METRICS: return api_metrics(s, c);
    case R_MODELS: return api_models(s, cn, c);
    case R_MODEL: return api_model(s, cn, c, url);
    case R_STATE: return api_state(s, c);
    case R_ADAPTERS: return rollout_route_list_adapters(s, cn, c);
    case R_VLLM_PAUSE: return rollout_route_vllm_pause(s, c);
    case R_VLLM_RESUME: return rollout_route_vllm_resume(s, c);
    case R_IS_PAUSED: return rollout_route_is_paused(s, c);
    case R_SGL_PAUSE: return rollout_route_sgl_pause(s, c, body, body_len);
    case R_SGL_CONTINUE: return rollout_route_sgl_continue(s, c);
    case R_FLUSH_CACHE: return rollout_route_flush_cache(s, c);
    case R_RESET_PREFIX_CACHE: return rollout_route_reset_prefix_cache(s, c);
    case R_SGL_WEIGHT_VERSION: return weights_route_sgl_version(s, c);
    case R_SGL_MODEL_INFO: return weights_route_sgl_model_info(s, c);
    case R_SGL_SERVER_INFO: return weights_route_sgl_server_info(s, c);
    case R_SGL_LOADS: return weights_route_sgl_loads(s, c);
    case R_HEALTH_GENERATE: return weights_route_health_generate(s, c);
    case R_UNSPEAKABLE: return weights_route_unspeakable(s, c, url);
    case R_VLLM_ABORT: return rollout_route_vllm_abort(s, c, body, body_len);
    case R_SLEEP: return rollout_route_sleep(s, c);
    case R_WAKE_UP: return rollout_route_wake_up(s, c);
    case R_IS_SLEEPING: return rollout_route_is_sleeping(s, c);
    case R_WEIGHTS:
        if (!strcmp(method, "GET")) return weights_route_list(s, c);
        break;
    case R_ADAPTER_VERSION: return adapter_route(s, cn, c, method, url, body, body_len);
    default: break;
    }
    CS_ASSERT(rt->flags & ROUTE_JSON);
    json_error_t je;
    json_t *b = json_loadb(body, body_len, 0, &je);
    if (!b) return http_error(c, 400, NULL, "invalid JSON body: %s (line %d, column %d)", je.text, je.line, je.column);
    if (!json_is_object(b)) {
        json_decref(b);
        return http_error(c, 400, NULL, "the request body must be a JSON object");
    }
    enum MHD_Result r;
    if ((rt->flags & ROUTE_GENERATES) && draining) {
        r = http_error(c, 503, NULL, "the server is shutting down");
    } else {
        switch (rt->id) {
        case R_COMPLETIONS: r = api_submit(s, cn, c, b, api_completions_parse); break;
        case R_CHAT: r = api_submit(s, cn, c, b, api_chat_parse); break;
        case R_ROLLOUT: r = rollout_route_rollout(s, cn, c, b); break;
        case R_ROLLOUT_ABORT: r = rollout_route_abort(s, c, b); break;
        case R_GENERATE: r = rollout_route_generate(s, cn, c, b); break;
        case R_ABORT_REQUEST: r = rollout_route_abort_request(s, c, b); break;
        case R_PAUSE: r = rollout_route_pause(s, c, b); break;
        case R_RESUME: r = rollout_route_resume(s, c); break;
        case R_TOKENIZE: r = api_tokenize(s, cn, c, b); break;
        case R_DETOKENIZE: r = api_detokenize(s, cn, c, b); break;
        case R_LOAD_LORA: r = api_load_lora(s, c, b); break;
        case R_UNLOAD_LORA: r = api_unload_lora(s, cn, c, b); break;
        case R_WEIGHTS: r = weights_route_update(s, c, b); break;
        case R_SGL_UPDATE_WEIGHTS: r = weights_route_sgl_update(s, c, b); break;
        case R_SGL_SET_WEIGHT_VERSION: r = weights_route_sgl_set_version(s, c, b); break;
        case R_SGL_LOAD_LORA: r = api_load_lora_sgl(s, c, b); break;
        case R_SGL_UNLOAD_LORA: r = api_unload_lora_sgl(s, cn, c, b); break;
        default: r = http_error(c, 500, NULL, "route %s has no handler", rt->path); break;
        }
    }
    json_decref(b);
    return r;
}

enum MHD_Result api_dispatch(server_t *s, conn_t *cn, struct MHD_Connection *c, const char *method, const char *url,
                             const char *body, size_t body_len) {
    return route(s, cn, c, method, url, body, body_len);
}

