/* weights.h: the base weights' HTTP routes (weights.c): POST /v1/weights (an update from a
 * Hugging Face directory under --lora-root) and GET /v1/weights (the versions held); SGLang's
 * /update_weights_from_disk, /get_weight_version, /update_weight_version, /get_model_info,
 * /get_server_info, /v1/loads and /health_generate; the 501 of the routes that take tensors
 * or NCCL groups. The server's side (server_t, libmicrohttpd), as routes.h. */
#ifndef CS_ROLLOUT_WEIGHTS_H
#define CS_ROLLOUT_WEIGHTS_H

#include "server/server.h"

extern const char *const weights_apply_names[]; /* engine_apply's: next_request, abort_inflight, pause_keep */

enum MHD_Result weights_route_update(server_t *s, struct MHD_Connection *c, json_t *b);
enum MHD_Result weights_route_list(server_t *s, struct MHD_Connection *c);
enum MHD_Result weights_route_sgl_update(server_t *s, struct MHD_Connection *c, json_t *b);
enum MHD_Result weights_route_sgl_version(server_t *s, struct MHD_Connection *c);
enum MHD_Result weights_route_sgl_set_version(server_t *s, struct MHD_Connection *c, json_t *b);
enum MHD_Result weights_route_sgl_model_info(server_t *s, struct MHD_Connection *c);
enum MHD_Result weights_route_sgl_server_info(server_t *s, struct MHD_Connection *c);
enum MHD_Result weights_route_sgl_loads(server_t *s, struct MHD_Connection *c);
enum MHD_Result weights_route_health_generate(server_t *s, struct MHD_Connection *c);
enum MHD_Result weights_route_unspeakable(server_t *s, struct MHD_Connection *c, const char *url);

#endif
