/* fuzz_adapter_config.c: adapter_config.json (lora/peft.c) on any bytes, against a small
 * base model: the checks a load makes before it reads a weight, and the bytes it would
 * reserve for the adapter (a bound a cache trusts). */
#include <string.h>

#include "base/model_config.h"
#include "lora/peft.h"
#include "tests/fuzz/fuzz.h"

static model_config_t base;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    static const char cfg[] =
        "{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\", \"vocab_size\": 256,"
        " \"hidden_size\": 64, \"intermediate_size\": 128, \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"
        " \"num_key_value_heads\": 2, \"max_position_embeddings\": 512, \"rms_norm_eps\": 1e-6}";
    if (model_config_parse(cfg, &base) != CS_OK) abort();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    size_t nbytes = 0;
    if (lora_adapter_config_nbytes("fuzz-adapter", (const char *)data, size, &base, &nbytes) == CS_OK) {
        fuzz_accepted++;
        /* ranks are at most 65536: A (r x d_in), B and its transpose (d_out x r) of 7 targets
         * per layer, every dimension at most 128 here */
        size_t bound = (size_t)base.n_layers * 7 * 65536 * (128 + 2 * 128) * sizeof(float);
        FUZZ_CHECK(nbytes <= bound, "%zu bytes for a 2-layer 64-wide base (bound %zu)", nbytes, bound);
    }
    return 0;
}
