/* api_fields.c: the request-field inventory (api_fields.h). */
#include "server/api_fields.h"

#include <stdlib.h>
#include <string.h>

#define CMP EP_COMPLETIONS
#define CHT EP_CHAT
#define TOK EP_TOKENIZE
#define DET EP_DETOKENIZE
#define GEN EP_GENERATE
#define ROL EP_ROLLOUT
#define OAI (EP_COMPLETIONS | EP_CHAT)

/* H: honoured (bad: a fragment the route must refuse); R: refused unless one of neutral */
#define H(name, eps, origin, bad, note) {name, eps, true, origin, NULL, bad, note}
#define R(name, eps, origin, neutral, note) {name, eps, false, origin, neutral, NULL, note}

const api_field_t api_fields[] = {
    /* what a request names and sends */
    H("model", OAI | TOK | DET, "OpenAI", "{\"model\": 5}", "the base model's served name or an adapter's; \"\" is the base model"),
    H("prompt", CMP | TOK, "OpenAI", "{\"prompt\": 5}", "a string, token ids, or a list of either (completions)"),
    H("messages", CHT | TOK, "OpenAI", "{\"messages\": \"x\"}", "rendered with the chat template; text parts only"),
    H("tokens", DET, "vLLM", "{\"tokens\": \"x\"}", "the token ids to decode"),
    /* sampling */
    H("temperature", OAI, "OpenAI", "{\"temperature\": \"x\"}", "[0, 100]; 0 is greedy"),
    H("top_p", OAI, "OpenAI", "{\"top_p\": \"x\"}", "(0, 1]"),
    H("top_k", OAI, "vLLM", "{\"top_k\": \"x\"}", "0 or -1: off"),
    H("min_p", OAI, "vLLM", "{\"min_p\": \"x\"}", "[0, 1]"),
    H("repetition_penalty", OAI, "vLLM", "{\"repetition_penalty\": \"x\"}", "(0, 100]; prompt and output tokens"),
    H("presence_penalty", OAI, "OpenAI", "{\"presence_penalty\": \"x\"}", "[-2, 2]"),
    H("frequency_penalty", OAI, "OpenAI", "{\"frequency_penalty\": \"x\"}", "[-2, 2]"),
    H("seed", OAI, "OpenAI", "{\"seed\": \"x\"}", "sample i is seeded seed + i"),
    H("max_tokens", OAI, "OpenAI", "{\"max_tokens\": \"x\"}", "completions default 16, chat up to the context"),
    H("max_completion_tokens", CHT, "OpenAI", "{\"max_completion_tokens\": \"x\"}", "chat: before max_tokens"),
    H("min_tokens", OAI, "vLLM", "{\"min_tokens\": \"x\"}", "EOS and stop tokens banned until this many"),
    H("n", OAI, "OpenAI", "{\"n\": \"x\"}", "samples per prompt, up to --max-n"),
    H("best_of", OAI, "OpenAI", "{\"best_of\": 2}", "only equal to n (one sample per choice)"),
    H("stop", OAI, "OpenAI", "{\"stop\": 5}", "up to 64 strings, not included in the text"),
    H("stop_token_ids", OAI, "vLLM", "{\"stop_token_ids\": \"x\"}", "up to 256 ids"),
    H("ignore_eos", OAI, "vLLM", "{\"ignore_eos\": \"x\"}", "generate past EOS"),
    H("logit_bias", OAI, "OpenAI", "{\"logit_bias\": \"x\"}", "{\"token id\": bias in [-100, 100]}, added before sampling"),
    H("allowed_token_ids", OAI, "vLLM", "{\"allowed_token_ids\": \"x\"}", "every other token is masked"),
    /* logprobs */
    H("logprobs", OAI, "OpenAI", "{\"logprobs\": \"x\"}", "completions: N alternatives; chat: true or false"),
    H("top_logprobs", CHT, "OpenAI", "{\"top_logprobs\": \"x\"}", "chat: alternatives per token, with logprobs: true"),
    H("prompt_logprobs", OAI, "vLLM", "{\"prompt_logprobs\": \"x\"}", "the prompt tokens' logprobs and N alternatives"),
    H("echo", CMP, "OpenAI", "{\"echo\": \"x\"}", "completions: the prompt before the text (and its logprobs)"),
    H("return_tokens_as_token_ids", OAI, "vLLM", "{\"return_tokens_as_token_ids\": \"x\"}", "logprobs name tokens 'token_id:N'"),
    /* the response */
    H("stream", OAI, "OpenAI", "{\"stream\": \"x\"}", "server-sent events"),
    H("stream_options", OAI, "OpenAI", "{\"stream\": true, \"stream_options\": \"x\"}", "with stream: true"),
    H("stream_options.include_usage", OAI, "OpenAI", "{\"stream\": true, \"stream_options\": {\"include_usage\": \"x\"}}",
      "a last chunk with usage"),
    H("stream_options.continuous_usage_stats", OAI, "vLLM",
      "{\"stream\": true, \"stream_options\": {\"include_usage\": true, \"continuous_usage_stats\": \"x\"}}",
      "usage in every chunk (with include_usage)"),
    H("skip_special_tokens", OAI, "vLLM", "{\"skip_special_tokens\": \"x\"}", "special tokens left out of the text"),
    H("user", OAI, "OpenAI", "{\"user\": 5}", "a string; it changes nothing"),
    H("slo", OAI | ROL, "caraserve", "{\"slo\": \"x\"}", "{\"ttft_ms\", \"tpot_ms\"} for the slo scheduler and metrics"),
    /* prompts and templates */
    H("add_special_tokens", OAI | TOK, "vLLM", "{\"add_special_tokens\": \"x\"}", "the tokenizer's BOS (completions default true, chat false)"),
    H("add_generation_prompt", CHT | TOK, "vLLM", "{\"add_generation_prompt\": \"x\"}", "default true"),
    H("continue_final_message", CHT | TOK, "vLLM", "{\"continue_final_message\": \"x\"}", "the final message left open to continue"),
    H("chat_template", CHT | TOK, "vLLM", "{\"chat_template\": 5}", "a Jinja template instead of the model's"),
    H("chat_template_kwargs", CHT | TOK, "vLLM", "{\"chat_template_kwargs\": \"x\"}", "extra template variables"),
    H("documents", CHT | TOK, "vLLM", "{\"documents\": \"x\"}", "a list, shown to the chat template"),
    H("tools", CHT | TOK, "OpenAI", "{\"tools\": \"x\"}",
      "shown to the chat template; with tool_choice auto the calls are read out of the reply (--tool-call-parser)"),
    H("tool_choice", CHT, "OpenAI", "{\"tool_choice\": \"sometimes\"}",
      "none, auto (calls read out of the reply), required or a named function (the reply constrained to calls)"),
    H("return_token_strs", TOK, "vLLM", "{\"return_token_strs\": \"x\"}", "the tokens' strings too"),
    /* structured output */
    H("response_format", OAI, "OpenAI", "{\"response_format\": {\"type\": \"xml\"}}",
      "text, json_object (any JSON object) or json_schema: the output follows it (structured output)"),
    H("guided_json", OAI, "vLLM", "{\"guided_json\": 42}", "a JSON schema the output follows"),
    H("guided_regex", OAI, "vLLM", "{\"guided_regex\": \"(a\"}", "a regular expression the output matches in full"),
    H("guided_choice", OAI, "vLLM", "{\"guided_choice\": []}", "the output is one of these strings"),
    H("guided_grammar", OAI, "vLLM", "{\"guided_grammar\": \"root ::= nothing\"}", "a grammar the output follows: GBNF, or Lark (start rule start) when it has no ::="),
    H("guided_decoding_backend", OAI, "vLLM", "{\"guided_decoding_backend\": 5}",
      "any name: caraserve's own grammar engine serves every backend's requests"),
    H("guided_whitespace_pattern", OAI, "vLLM", "{\"guided_whitespace_pattern\": 5}",
      "the whitespace a JSON schema's output may hold between tokens (default: none, compact JSON)"),
    H("structured_outputs", OAI, "vLLM", "{\"structured_outputs\": {\"regex\": 5}}",
      "{json | regex | choice | grammar | json_object, whitespace_pattern}; structural_tag is refused"),
    H("regex", OAI, "SGLang", "{\"regex\": \"(a\"}", "as guided_regex"),
    H("ebnf", OAI, "SGLang", "{\"ebnf\": \"root ::= nothing\"}", "as guided_grammar (GBNF, or Lark when it has no ::=)"),
    H("json_schema", OAI, "SGLang", "{\"json_schema\": \"[\"}", "as guided_json (JSON text or an object)"),
    H("use_beam_search", OAI, "vLLM", "{\"use_beam_search\": \"x\"}",
      "vLLM's beam search: n beams (1 to 10), the best n returned"),
    H("length_penalty", OAI, "vLLM", "{\"length_penalty\": \"x\"}",
      "beams ranked by cum_logprob / (prompt + output tokens)^length_penalty; only with use_beam_search"),
    /* refused: not built, or not meaningful here */
    R("suffix", CMP, "OpenAI", "\"\"", "insertion (fill-in-the-middle) is not supported"),
    R("early_stopping", OAI, "vLLM", "false", "a beam search runs max_tokens steps, as vLLM's does"),
    R("include_stop_str_in_output", OAI, "vLLM", "false", "stop strings are always left out of the text"),
    R("spaces_between_special_tokens", OAI, "vLLM", "true", "special tokens are always decoded as the tokenizer joins them"),
    R("truncate_prompt_tokens", OAI, "vLLM", NULL, "prompts are not truncated: a long one is a 400"),
    R("bad_words", OAI, "vLLM", "[]", "not supported"),
    R("logits_processors", OAI, "vLLM", NULL, "custom logits processors are not supported"),
    R("priority", OAI, "vLLM", "0", "priority scheduling is not supported (use slo)"),
    R("request_id", OAI, "vLLM", NULL, "not supported: responses carry the server's own ids"),
    R("cache_salt", OAI, "vLLM", NULL, "the prefix cache is not salted per request"),
    R("kv_transfer_params", OAI, "vLLM", NULL, "disaggregated prefill is not supported"),
    R("vllm_xargs", OAI, "vLLM", NULL, "not supported"),
    R("return_token_ids", OAI, "vLLM", "false", "not supported (logprobs with return_tokens_as_token_ids name the ids)"),
    R("prompt_embeds", CMP, "vLLM", NULL, "prompts are text or token ids"),
    R("mm_processor_kwargs", CHT | TOK, "vLLM", NULL, "the models served are text-only"),
    R("echo", CHT, "vLLM", "false", "chat echo is not supported"),
    H("parallel_tool_calls", CHT, "OpenAI", "{\"parallel_tool_calls\": \"x\"}", "false: the first tool call only"),
    R("functions", CHT, "OpenAI", "[]", "deprecated function calling is not supported (use tools)"),
    R("function_call", CHT, "OpenAI", "\"none\"", "deprecated function calling is not supported (use tools)"),
    R("store", OAI, "OpenAI", "false", "completions are not stored"),
    R("metadata", OAI, "OpenAI", NULL, "completions are not stored"),
    R("service_tier", OAI, "OpenAI", "\"auto\"; \"default\"", "one tier"),
    R("modalities", CHT, "OpenAI", "[\"text\"]", "text only"),
    R("audio", CHT, "OpenAI", NULL, "text only"),
    R("prediction", CHT, "OpenAI", NULL, "predicted outputs are not supported"),
    R("reasoning_effort", CHT, "OpenAI", NULL, "not supported"),
    R("web_search_options", CHT, "OpenAI", NULL, "not supported"),
    /* SGLang's /generate */
    H("text", GEN, "SGLang", "{\"text\": 5}", "a string or a list of them"),
    H("input_ids", GEN, "SGLang", "{\"input_ids\": \"x\"}", "token ids or a list of them"),
    H("sampling_params", GEN, "SGLang", "{\"sampling_params\": \"x\"}", "the fields below"),
    H("sampling_params.temperature", GEN, "SGLang", "{\"sampling_params\": {\"temperature\": \"x\"}}", ""),
    H("sampling_params.top_p", GEN, "SGLang", "{\"sampling_params\": {\"top_p\": \"x\"}}", ""),
    H("sampling_params.top_k", GEN, "SGLang", "{\"sampling_params\": {\"top_k\": \"x\"}}", ""),
    H("sampling_params.min_p", GEN, "SGLang", "{\"sampling_params\": {\"min_p\": \"x\"}}", ""),
    H("sampling_params.repetition_penalty", GEN, "SGLang", "{\"sampling_params\": {\"repetition_penalty\": \"x\"}}", ""),
    H("sampling_params.presence_penalty", GEN, "SGLang", "{\"sampling_params\": {\"presence_penalty\": \"x\"}}", ""),
    H("sampling_params.frequency_penalty", GEN, "SGLang", "{\"sampling_params\": {\"frequency_penalty\": \"x\"}}", ""),
    H("sampling_params.max_new_tokens", GEN, "SGLang", "{\"sampling_params\": {\"max_new_tokens\": \"x\"}}", "default 128"),
    H("sampling_params.min_new_tokens", GEN, "SGLang", "{\"sampling_params\": {\"min_new_tokens\": \"x\"}}", ""),
    H("sampling_params.stop", GEN, "SGLang", "{\"sampling_params\": {\"stop\": 5}}", ""),
    H("sampling_params.stop_token_ids", GEN, "SGLang", "{\"sampling_params\": {\"stop_token_ids\": \"x\"}}", ""),
    H("sampling_params.ignore_eos", GEN, "SGLang", "{\"sampling_params\": {\"ignore_eos\": \"x\"}}", ""),
    R("sampling_params.n", GEN, "SGLang", "1", "one sample per prompt here (/v1/rollout groups take n)"),
    H("sampling_params.regex", GEN, "SGLang", "{\"sampling_params\": {\"regex\": \"(a\"}}", "the output matches it in full"),
    H("sampling_params.json_schema", GEN, "SGLang", "{\"sampling_params\": {\"json_schema\": \"[\"}}",
      "a JSON schema (JSON text) the output follows"),
    H("sampling_params.ebnf", GEN, "SGLang", "{\"sampling_params\": {\"ebnf\": \"root ::= x\"}}", "a GBNF grammar the output follows"),
    R("sampling_params.structural_tag", GEN, "SGLang", NULL, "structural tags are not supported"),
    H("sampling_params.no_stop_trim", GEN, "SGLang", "{\"sampling_params\": {\"no_stop_trim\": \"x\"}}", "true: the text keeps the stop string"),
    H("sampling_params.skip_special_tokens", GEN, "SGLang", "{\"sampling_params\": {\"skip_special_tokens\": \"x\"}}", "false: the text keeps special tokens"),
    R("sampling_params.spaces_between_special_tokens", GEN, "SGLang", "true", "not supported"),
    R("sampling_params.logit_bias", GEN, "SGLang", "{}", "not supported on /generate (use /v1/completions)"),
    R("sampling_params.custom_params", GEN, "SGLang", NULL, "custom logit processors are not supported"),
    R("sampling_params.stop_regex", GEN, "SGLang", NULL, "not supported"),
    H("sampling_params.sampling_seed", GEN, "SGLang", "{\"sampling_params\": {\"sampling_seed\": \"x\"}}", "each prompt's sample is seeded with it"),
    H("return_logprob", GEN, "SGLang", "{\"return_logprob\": \"x\"}", "meta_info.output_token_logprobs"),
    H("lora_path", GEN, "SGLang", "{\"lora_path\": 5}", "an adapter's served name"),
    H("rid", GEN, "SGLang", "{\"rid\": 5}", "the request's id, for /abort_request"),
    R("stream", GEN, "SGLang", "false", "not supported on /generate (use /v1/completions, or /v1/rollout with stream)"),
    R("logprob_start_len", GEN, "SGLang", "-1", "prompt logprobs are not supported on /generate"),
    H("top_logprobs_num", GEN, "SGLang", "{\"top_logprobs_num\": \"x\"}", "meta_info.output_top_logprobs"),
    R("token_ids_logprob", GEN, "SGLang", NULL, "not supported"),
    H("return_text_in_logprobs", GEN, "SGLang", "{\"return_text_in_logprobs\": \"x\"}", "each logprob entry's third element is its token's text"),
    R("return_hidden_states", GEN, "SGLang", "false", "not supported"),
    R("image_data", GEN, "SGLang", NULL, "text only"),
    R("audio_data", GEN, "SGLang", NULL, "text only"),
    R("video_data", GEN, "SGLang", NULL, "text only"),
    R("input_embeds", GEN, "SGLang", NULL, "prompts are text or token ids"),
    R("custom_logit_processor", GEN, "SGLang", NULL, "not supported"),
    R("session_params", GEN, "SGLang", NULL, "not supported"),
    R("lora_id", GEN, "SGLang", NULL, "name the adapter with lora_path"),
    R("data_parallel_rank", GEN, "SGLang", NULL, "one replica (the router places requests)"),
    /* /v1/rollout (docs/rollout.md) */
    H("groups", ROL, "caraserve", "{\"groups\": \"x\"}", "group_id, input_ids, n, seed, continue_from, turns"),
    H("tool_calls", ROL, "caraserve", "{\"tool_calls\": \"x\"}", "each sample's text and the tool calls in it"),
    H("sampling", ROL, "caraserve", "{\"sampling\": \"x\"}", "the engine's sampling fields"),
    H("structured_outputs", ROL, "caraserve", "{\"structured_outputs\": {\"regex\": 5}}",
      "every group's constraint, in vLLM's form (json, regex, choice, grammar, json_object); a group's own replaces it"),
    H("sampling.temperature", ROL, "caraserve", "{\"sampling\": {\"temperature\": \"x\"}}", ""),
    H("sampling.top_p", ROL, "caraserve", "{\"sampling\": {\"top_p\": \"x\"}}", ""),
    H("sampling.top_k", ROL, "caraserve", "{\"sampling\": {\"top_k\": \"x\"}}", ""),
    H("sampling.min_p", ROL, "caraserve", "{\"sampling\": {\"min_p\": \"x\"}}", ""),
    H("sampling.repetition_penalty", ROL, "caraserve", "{\"sampling\": {\"repetition_penalty\": \"x\"}}", ""),
    H("sampling.presence_penalty", ROL, "caraserve", "{\"sampling\": {\"presence_penalty\": \"x\"}}", ""),
    H("sampling.frequency_penalty", ROL, "caraserve", "{\"sampling\": {\"frequency_penalty\": \"x\"}}", ""),
    H("sampling.max_tokens", ROL, "caraserve", "{\"sampling\": {\"max_tokens\": \"x\"}}", ""),
    H("sampling.min_tokens", ROL, "caraserve", "{\"sampling\": {\"min_tokens\": \"x\"}}", ""),
    H("sampling.stop", ROL, "caraserve", "{\"sampling\": {\"stop\": 5}}", ""),
    H("sampling.stop_token_ids", ROL, "caraserve", "{\"sampling\": {\"stop_token_ids\": \"x\"}}", ""),
    H("sampling.ignore_eos", ROL, "caraserve", "{\"sampling\": {\"ignore_eos\": \"x\"}}", ""),
    H("sampling.logprobs", ROL, "caraserve", "{\"sampling\": {\"logprobs\": \"x\"}}", "true, false or {\"mode\", \"top_k\"}"),
    H("adapter", ROL, "caraserve", "{\"adapter\": 5}", "a name or {\"name\", \"version\"}"),
    H("base_version", ROL, "caraserve", "{\"base_version\": \"x\"}", "pins the base weights' version (GET /v1/weights)"),
    H("batch_id", ROL, "caraserve", "{\"batch_id\": 5}", "names the batch for /v1/rollout/abort"),
    H("completion", ROL, "caraserve", "{\"completion\": \"x\"}", "{\"target_groups\", \"on_target\"}"),
    H("stream", ROL, "caraserve", "{\"stream\": \"x\"}", "NDJSON, a line per group"),
};
const int api_n_fields = (int)(sizeof api_fields / sizeof api_fields[0]);

/* the value at a dotted path of b, NULL when absent */
static const json_t *at_path(const json_t *b, const char *path) {
    char key[96];
    for (;;) {
        const char *dot = strchr(path, '.');
        size_t n = dot ? (size_t)(dot - path) : strlen(path);
        if (n >= sizeof key || !json_is_object(b)) return NULL;
        memcpy(key, path, n);
        key[n] = 0;
        b = json_object_get(b, key);
        if (!dot || !b) return b;
        path = dot + 1;
    }
}

/* v is null or one of the ';'-separated JSON values of neutral */
static bool is_neutral(const json_t *v, const char *neutral) {
    if (json_is_null(v)) return true;
    for (const char *p = neutral; p && *p;) {
        const char *e = strchr(p, ';');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        json_t *x = json_loadb(p, n, JSON_DECODE_ANY, NULL);
        bool eq = x && (json_equal(x, v) || (json_is_number(x) && json_is_number(v) &&
                                             json_number_value(x) == json_number_value(v)));
        json_decref(x);
        if (eq) return true;
        p = e ? e + 1 : NULL;
    }
    return false;
}

int api_fields_refused(unsigned ep, const json_t *b, const api_field_t **field) {
    for (int i = 0; i < api_n_fields; i++) {
        const api_field_t *f = &api_fields[i];
        if (f->honoured || !(f->endpoints & ep)) continue;
        const json_t *v = at_path(b, f->name);
        if (v && !is_neutral(v, f->neutral)) {
            *field = f;
            return 1;
        }
    }
    return 0;
}

static const char *const EP_NAMES[] = {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
                                       "/generate", "/v1/rollout"};

void api_fields_print(FILE *f, bool as_json) {
    if (as_json) {
        json_t *a = json_array();
        for (int i = 0; i < api_n_fields; i++) {
            const api_field_t *x = &api_fields[i];
            json_t *eps = json_array();
            for (int k = 0; k < 6; k++)
                if (x->endpoints & (1u << k)) json_array_append_new(eps, json_string(EP_NAMES[k]));
            json_t *o = json_pack("{s:s, s:o, s:b, s:s, s:s}", "name", x->name, "endpoints", eps, "honoured",
                                  x->honoured, "origin", x->origin, "note", x->note);
            json_object_set_new(o, "bad", x->bad ? json_loads(x->bad, 0, NULL) : json_null());
            json_object_set_new(o, "neutral", x->neutral ? json_string(x->neutral) : json_null());
            json_array_append_new(a, o);
        }
        char *s = json_dumps(a, JSON_INDENT(1));
        fprintf(f, "%s\n", s ? s : "[]");
        free(s);
        json_decref(a);
        return;
    }
    fprintf(f, "# Request fields\n\n"
               "Every field that OpenAI's API reference, vLLM's protocol and SGLang's `io_struct` define for these\n"
               "routes, and what caraserve does with it. A refused field set to anything but its neutral value\n"
               "(or null) is a 400 that names it; no field is dropped silently. Fields no one defines are ignored,\n"
               "as vLLM ignores them. Printed by `caraserve fields` from the table the routes read\n"
               "(`server/api_fields.c`).\n\n");
    for (int k = 0; k < 6; k++) {
        fprintf(f, "## `%s`\n\n| field | defined by | | what it does |\n|---|---|---|---|\n", EP_NAMES[k]);
        for (int i = 0; i < api_n_fields; i++) {
            const api_field_t *x = &api_fields[i];
            if (!(x->endpoints & (1u << k))) continue;
            fprintf(f, "| `%s` | %s | %s | %s", x->name, x->origin, x->honoured ? "honoured" : "**refused**", x->note);
            if (!x->honoured && x->neutral) fprintf(f, " (accepted: `%s`)", x->neutral);
            fprintf(f, " |\n");
        }
        fprintf(f, "\n");
    }
}
