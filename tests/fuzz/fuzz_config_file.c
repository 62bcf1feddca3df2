/* fuzz_config_file.c: `caraserve serve --config FILE` (server/options.c) on any bytes. What
 * it accepts becomes argv words: "--NAME" then, unless NAME is a switch, its value. */
#include <string.h>

#include "server/options.h"
#include "tests/fuzz/fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char **words = NULL;
    int n = 0;
    int rc = options_read_config(fuzz_file(data, size), OPT_CMD_SERVE, &words, &n);
    if (rc == 0) fuzz_accepted++;
    /* (a value may itself look like a flag, "--help": getopt takes it as the value) */
    if (rc == 0 && n > 0) FUZZ_CHECK(!strncmp(words[0], "--", 2), "the first word is '%s'", words[0]);
    for (int i = 0; i < n; i++) {
        FUZZ_CHECK(words[i], "word %d is NULL", i);
        if (rc == 0 && (!strcmp(words[i], "--config") || !strcmp(words[i], "--help")))
            FUZZ_CHECK(i > 0 && strncmp(words[i - 1], "--", 2) == 0, "'%s' as an option from a config file", words[i]);
    }
    for (int i = 0; i < n; i++) free(words[i]);
    free(words);
    return 0;
}
