/* tool_calls.h: tool calls parsed out of a model's text, in the formats the chat templates of
 * the models we serve teach them (vLLM's --tool-call-parser names):
 *   hermes       <tool_call>{"name": "f", "arguments": {...}}</tool_call>, one block per call
 *                (Hermes 2 Pro, Qwen2.5, Qwen3); text before the first block is content
 *   llama3_json  {"name": "f", "parameters": {...}}, the whole output, after an optional
 *                <|python_tag|>; several calls separated by ";" (Llama 3.1, 3.2)
 *   mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...] (Mistral); text before
 *                the marker is content
 * "arguments" may also be a JSON string holding the object (some models write it so). Text
 * that does not parse as the format's calls is content, whole, as vLLM's parsers treat it. */
#ifndef CS_TOOL_CALLS_H
#define CS_TOOL_CALLS_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

typedef enum tool_format {
    TOOL_FORMAT_NONE = 0,
    TOOL_FORMAT_HERMES,
    TOOL_FORMAT_LLAMA3_JSON,
    TOOL_FORMAT_MISTRAL,
} tool_format;

/* vLLM's parser names ("hermes", "llama3_json", "mistral"); NONE when unknown */
tool_format tool_format_by_name(const char *name);
const char *tool_format_name(tool_format f);
/* the format a chat template teaches (from the markers it writes); NONE when it shows none */
tool_format tool_format_detect(const char *chat_template);
/* The calls in text: *calls (a new JSON array of {"name": string, "arguments": object}) and
 * *content_len, the length of the text before them; *calls NULL (and *content_len = len) when
 * the text holds no call of the format, or one that does not parse. */
void tool_calls_parse(tool_format f, const char *text, size_t len, json_t **calls, size_t *content_len);
/* While a reply streams: how much of text (all generated so far) is content for certain (it
 * cannot be, or begin, a call of the format); the rest is held back. */
size_t tool_calls_content_prefix(tool_format f, const char *text, size_t len);

#endif
