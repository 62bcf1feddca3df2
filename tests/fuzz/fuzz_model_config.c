/* fuzz_model_config.c: config.json (base/model_config.c) on any bytes. What it accepts
 * has the shapes the model loader and the kernels divide and index by. */
#include "base/model_config.h"
#include "tests/fuzz/fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *s = fuzz_cstr(data, size);
    model_config_t c;
    if (model_config_parse(s, &c) == CS_OK) {
        fuzz_accepted++;
        FUZZ_CHECK(c.vocab_size > 0 && c.hidden_size > 0 && c.intermediate_size > 0 && c.n_layers > 0,
                   "non-positive sizes");
        FUZZ_CHECK(c.n_heads > 0 && c.n_kv_heads > 0 && c.n_heads % c.n_kv_heads == 0, "heads %d kv %d", c.n_heads,
                   c.n_kv_heads);
        FUZZ_CHECK(c.head_dim > 0 && c.head_dim % 2 == 0, "head_dim %d", c.head_dim);
        FUZZ_CHECK(c.max_position_embeddings > 0, "max_position_embeddings %d", c.max_position_embeddings);
        FUZZ_CHECK(c.rms_norm_eps >= 0 && c.rope_theta > 0, "eps %g theta %g", c.rms_norm_eps, c.rope_theta);
        FUZZ_CHECK(c.n_eos >= 0 && c.n_eos <= MODEL_MAX_EOS, "%d eos ids", c.n_eos);
        FUZZ_CHECK(c.sliding_window >= 0, "sliding_window %d", c.sliding_window);
    }
    free(s);
    return 0;
}
