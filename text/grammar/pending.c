#include "text/grammar/grammar.h"
int grammar_regex_to_gbnf(const char *re, size_t len, char **gbnf) { (void)re; (void)len; (void)gbnf; return cs_error_set(CS_EINVAL, "this translation is not built yet"); }
int grammar_choice_to_gbnf(const char *const *choices, int n, char **gbnf) { (void)choices; (void)n; (void)gbnf; return cs_error_set(CS_EINVAL, "this translation is not built yet"); }
int grammar_json_schema_to_gbnf(const json_t *schema, const char *ws, char **gbnf, char **err_path) { (void)schema; (void)ws; (void)gbnf; (void)err_path; return cs_error_set(CS_EINVAL, "this translation is not built yet"); }
