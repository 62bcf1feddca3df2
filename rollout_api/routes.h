/* routes.h: the rollout API's HTTP routes (rollout_api/README.md), which the server's
 * dispatcher (server/api.c) calls: POST /v1/rollout and /v1/rollout/abort, SGLang's
 * /generate and /abort_request, /v1/pause and /v1/resume, and the versioned adapters (GET
 * /v1/adapters, PUT and DELETE /v1/adapters/NAME/versions/V). Unlike rollout.h they are the
 * server's side (server_t, libmicrohttpd): tools/check-layers.sh counts routes.* in the
 * server layer, rollout.* in the rollout layer. body: the parsed JSON object. */
#ifndef CS_ROLLOUT_ROUTES_H
#define CS_ROLLOUT_ROUTES_H

#include "server/server.h"

struct gen_job;

enum MHD_Result rollout_route_rollout(server_t *s, conn_t *cn, struct MHD_Connection *c, json_t *b);
enum MHD_Result rollout_route_abort(server_t *s, struct MHD_Connection *c, json_t *b);
enum MHD_Result rollout_route_generate(server_t *s, conn_t *cn, struct MHD_Connection *c, json_t *b);
enum MHD_Result rollout_route_abort_request(server_t *s, struct MHD_Connection *c, json_t *b);
enum MHD_Result rollout_route_pause(server_t *s, struct MHD_Connection *c, json_t *b);
enum MHD_Result rollout_route_resume(server_t *s, struct MHD_Connection *c);
/* the same under vLLM's (/pause?mode=, /resume, /is_paused) and SGLang's
 * (/pause_generation, /continue_generation) names and bodies */
enum MHD_Result rollout_route_vllm_pause(server_t *s, struct MHD_Connection *c);
enum MHD_Result rollout_route_vllm_resume(server_t *s, struct MHD_Connection *c);
enum MHD_Result rollout_route_is_paused(server_t *s, struct MHD_Connection *c);
enum MHD_Result rollout_route_sgl_pause(server_t *s, struct MHD_Connection *c, const char *body, size_t len);
enum MHD_Result rollout_route_sgl_continue(server_t *s, struct MHD_Connection *c);
/* vLLM's POST /abort_requests {"request_ids": [...]} */
enum MHD_Result rollout_route_vllm_abort(server_t *s, struct MHD_Connection *c, const char *body, size_t len);
/* vLLM's POST /sleep?level=&mode=, POST /wake_up?tags=..., GET /is_sleeping */
enum MHD_Result rollout_route_sleep(server_t *s, struct MHD_Connection *c);
enum MHD_Result rollout_route_wake_up(server_t *s, struct MHD_Connection *c);
enum MHD_Result rollout_route_is_sleeping(server_t *s, struct MHD_Connection *c);
/* the prefix cache emptied: SGLang's /flush_cache, vLLM's /reset_prefix_cache */
enum MHD_Result rollout_route_flush_cache(server_t *s, struct MHD_Connection *c);
enum MHD_Result rollout_route_reset_prefix_cache(server_t *s, struct MHD_Connection *c);
enum MHD_Result rollout_route_list_adapters(server_t *s, conn_t *cn, struct MHD_Connection *c);
enum MHD_Result rollout_route_put_version(server_t *s, struct MHD_Connection *c, const char *url, const char *body,
                                          size_t len);
enum MHD_Result rollout_route_delete_version(server_t *s, struct MHD_Connection *c, const char *url);
/* the answer of a finished /generate job, in SGLang's shape (under the job's mutex) */
json_t *rollout_route_sglang_json(server_t *s, struct gen_job *j);

#endif
