#include "text/grammar/grammar.h"
int grammar_json_schema_to_gbnf(const json_t *schema, const char *ws, char **gbnf, char **err_path) { (void)schema; (void)ws; (void)gbnf; (void)err_path; return cs_error_set(CS_EINVAL, "this translation is not built yet"); }
