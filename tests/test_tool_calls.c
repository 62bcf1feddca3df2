/* test_tool_calls.c: tool calls parsed out of text (text/tool_calls.c) for the three formats,
 * as vLLM's hermes, llama3_json and mistral parsers take them: the calls (as compact JSON),
 * the content before them, text that is not a call left whole; the content prefix a stream
 * may send while a marker could still be starting; the format a template teaches. */
#include <check.h>
#include <string.h>

#include "text/tool_calls.h"
#include "testutil.h"

typedef struct {
    tool_format f;
    const char *text;
    const char *calls;      /* compact JSON; NULL: none */
    size_t content;         /* length of the content */
} parse_t;

#define ALL ((size_t)-1)
static const parse_t PARSE[] = {
    {TOOL_FORMAT_HERMES, "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>",
     "[{\"name\":\"f\",\"arguments\":{\"a\":1}}]", 0},
    {TOOL_FORMAT_HERMES, "Let me look.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n"
                         "{\"name\": \"g\", \"arguments\": \"{\\\"x\\\": \\\"y\\\"}\"}\n</tool_call>",
     "[{\"name\":\"f\",\"arguments\":{}},{\"name\":\"g\",\"arguments\":{\"x\":\"y\"}}]", 13},
    {TOOL_FORMAT_HERMES, "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": [1, 2]}}", "[{\"name\":\"f\",\"arguments\":{\"a\":[1,2]}}]", 0},
    {TOOL_FORMAT_HERMES, "no call here", NULL, ALL},
    {TOOL_FORMAT_HERMES, "<tool_call>{\"name\": 5}</tool_call>", NULL, ALL},
    {TOOL_FORMAT_HERMES, "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call> trailing words", NULL, ALL},
    {TOOL_FORMAT_LLAMA3_JSON, "{\"name\": \"f\", \"parameters\": {\"q\": \"x\"}}", "[{\"name\":\"f\",\"arguments\":{\"q\":\"x\"}}]", 0},
    {TOOL_FORMAT_LLAMA3_JSON, "<|python_tag|>{\"name\": \"f\", \"parameters\": {}}; {\"name\": \"g\", \"arguments\": {}}",
     "[{\"name\":\"f\",\"arguments\":{}},{\"name\":\"g\",\"arguments\":{}}]", 0},
    {TOOL_FORMAT_LLAMA3_JSON, "The answer is {\"name\": \"f\"}", NULL, ALL},
    {TOOL_FORMAT_LLAMA3_JSON, "{\"not\": \"a call\"}", NULL, ALL},
    {TOOL_FORMAT_MISTRAL, "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"a\": true}}]", "[{\"name\":\"f\",\"arguments\":{\"a\":true}}]", 0},
    {TOOL_FORMAT_MISTRAL, "ok [TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {}}, {\"name\": \"g\", \"arguments\": {}}]",
     "[{\"name\":\"f\",\"arguments\":{}},{\"name\":\"g\",\"arguments\":{}}]", 3},
    {TOOL_FORMAT_MISTRAL, "[TOOL_CALLS][]", NULL, ALL},
    {TOOL_FORMAT_NONE, "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>", NULL, ALL},
};

START_TEST(parse) {
    const parse_t *c = &PARSE[_i];
    json_t *calls;
    size_t content;
    size_t n = strlen(c->text);
    tool_calls_parse(c->f, c->text, n, &calls, &content);
    ck_assert_uint_eq(content, c->content == ALL ? n : c->content);
    if (!c->calls) {
        ck_assert_ptr_null(calls);
        return;
    }
    ck_assert_ptr_nonnull(calls);
    char *got = json_dumps(calls, JSON_COMPACT | JSON_PRESERVE_ORDER);
    ck_assert_str_eq(got, c->calls);
    free(got);
    json_decref(calls);
}
END_TEST

typedef struct {
    tool_format f;
    const char *text;
    size_t prefix;
} prefix_t;

static const prefix_t PREFIX[] = {
    {TOOL_FORMAT_HERMES, "Hello", 5},
    {TOOL_FORMAT_HERMES, "Hello <tool", 6},
    {TOOL_FORMAT_HERMES, "Hello <tool_call>{", 6},
    {TOOL_FORMAT_HERMES, "a < b", 5},
    {TOOL_FORMAT_MISTRAL, "x [TOOL", 2},
    {TOOL_FORMAT_LLAMA3_JSON, "  {\"na", 0},
    {TOOL_FORMAT_LLAMA3_JSON, "<|python", 0},
    {TOOL_FORMAT_LLAMA3_JSON, "Sure", 4},
    {TOOL_FORMAT_LLAMA3_JSON, " ", 0},
    {TOOL_FORMAT_NONE, "<tool_call>", 11},
};

START_TEST(content_prefix) {
    const prefix_t *c = &PREFIX[_i];
    ck_assert_uint_eq(tool_calls_content_prefix(c->f, c->text, strlen(c->text)), c->prefix);
}
END_TEST

START_TEST(names_and_detect) {
    ck_assert_int_eq(tool_format_by_name("hermes"), TOOL_FORMAT_HERMES);
    ck_assert_int_eq(tool_format_by_name("llama3_json"), TOOL_FORMAT_LLAMA3_JSON);
    ck_assert_int_eq(tool_format_by_name("mistral"), TOOL_FORMAT_MISTRAL);
    ck_assert_int_eq(tool_format_by_name("pythonic"), TOOL_FORMAT_NONE);
    ck_assert_str_eq(tool_format_name(TOOL_FORMAT_MISTRAL), "mistral");
    ck_assert_int_eq(tool_format_detect("{% for t in tools %}<tool_call>{{ t }}</tool_call>{% endfor %}"), TOOL_FORMAT_HERMES);
    ck_assert_int_eq(tool_format_detect("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]"), TOOL_FORMAT_MISTRAL);
    ck_assert_int_eq(tool_format_detect("<|python_tag|>{{ x }}<|eom_id|>"), TOOL_FORMAT_LLAMA3_JSON);
    ck_assert_int_eq(tool_format_detect("{{ messages }}"), TOOL_FORMAT_NONE);
}
END_TEST

int main(void) {
    Suite *s = suite_create("tool_calls");
    TCase *tc = tcase_create("core");
    tcase_add_loop_test(tc, parse, 0, (int)CS_ARRAY_LEN(PARSE));
    tcase_add_loop_test(tc, content_prefix, 0, (int)CS_ARRAY_LEN(PREFIX));
    tcase_add_test(tc, names_and_detect);
    suite_add_tcase(s, tc);
    return cs_check_run(s, CK_NOFORK) ? 1 : 0;
}
