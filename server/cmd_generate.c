/* cmd_generate.c: `caraserve generate` runs one prompt through the model on the CPU backend
 * (with or without a PEFT adapter) and prints the continuation; it is also how tests compare
 * the engine with transformers (--dump-logits). */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "server/setup.h"
#include "engine/model.h"
#include "engine/sampling.h"
#include "text/tokenizer.h"
#include "lora/peft.h"
#include "server/commands.h"
#include "cpu_kernels/cpu_backend.h"
#include "cpu_kernels/kernels.h"

static void usage_generate(FILE *f) {
    fprintf(f,
            "usage: caraserve generate --model DIR [--lora DIR] (--prompt TEXT | --prompt-ids 1,2,3)\n"
            "                          [--max-tokens N] [--temperature T] [--seed S] [--print-ids]\n"
            "                          [--threads N] [--no-special] [--ignore-eos] [--stats]\n"
            "                          [--dump-logits FILE] [--reference-kernels] [--device auto|cpu|cuda]\n"
            "                          [--precision exact|bf16] [--kv-cache-dtype auto|f32|bf16]\n"
            "                          [--lora-dtype auto|bf16] [--mmap | --no-mmap] [--compress-weights[-only]]\n"
            "\n"
            "  --model DIR          Hugging Face model directory (config.json, *.safetensors, tokenizer.json)\n"
            "  --lora DIR           PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors)\n"
            "  --prompt TEXT        prompt text (tokenized with the model's tokenizer.json)\n"
            "  --prompt-ids LIST    prompt as comma-separated token ids (no tokenizer needed)\n"
            "  --max-tokens N       tokens to generate (default 64; 0 only scores the prompt)\n"
            "  --temperature T      0 = greedy (default), else sample with this temperature\n"
            "  --seed S             sampling seed (default 0)\n"
            "  --print-ids          also print the prompt and generated token ids\n"
            "  --threads N          CPU threads (default: all online CPUs)\n"
            "  --no-special         do not add the tokenizer's special tokens (e.g. BOS) to --prompt\n"
            "  --ignore-eos         keep generating past end-of-sequence tokens\n"
            "  --stats              print prefill and decode speed to stderr\n"
            "  --dump-logits FILE   write the logits of every position (binary, for tests)\n"
            "  --reference-kernels  use the plain reference kernels (slow; for checking)\n"
            "  --precision P        exact (default) or bf16: CPU matmuls against BF16 weights on activations\n"
            "                       rounded to BF16, F32 sums (as PyTorch runs a BF16 model; faster)\n"
            "  --kv-cache-dtype K   auto (default: bf16 under --precision bf16 where the backend reads it,\n"
            "                       else f32), f32 or bf16\n"
            "  --lora-dtype D       auto (default: the adapter held as its file has it, F32 stays F32) or\n"
            "                       bf16 (held in BF16, F32 rounded when read: half the bytes per token)\n"
            "  --device D           auto, cpu or cuda (default auto: cuda where a CUDA build sees a GPU)\n"
            "  --mmap, --no-mmap    CPU backend: the weights used in place in the file's mapping, or read\n"
            "                       into this process's memory in 2 MiB huge pages (default: --no-mmap\n"
            "                       where the kernel offers transparent huge pages, else --mmap)\n"
            "  --compress-weights   CPU backend: decode of 1-4 sequences reads the BF16 weights coded\n"
            "                       losslessly in 12 bits (0.75x the bytes per token; 0.75x the weights' size\n"
            "                       more memory)\n"
            "  --compress-weights-only  the same, keeping only the code: 0.75x the weights' memory instead of\n"
            "                       1.75x; decode of 4-32 sequences 0.84-0.94x as fast (not on AMX CPUs: there\n"
            "                       it is --compress-weights)\n");
}

static int parse_ids(const char *s, int32_t **out, int *n) {
    int cap = 16, k = 0;
    int32_t *ids = malloc(sizeof *ids * cap);
    if (!ids) return -1;
    const char *p = s;
    while (*p) {
        while (*p == ' ' || *p == ',') p++;
        if (!*p) break;
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX) {
            fprintf(stderr, "caraserve: --prompt-ids: bad token id near '%.20s'\n", p);
            free(ids);
            return -1;
        }
        if (k == cap) {
            cap *= 2;
            int32_t *ni = realloc(ids, sizeof *ids * cap);
            if (!ni) { free(ids); return -1; }
            ids = ni;
        }
        ids[k++] = (int32_t)v;
        p = end;
    }
    *out = ids;
    *n = k;
    return 0;
}

static int write_logits_header(FILE *f, int32_t rows, int32_t vocab) {
    int32_t hdr[3] = {0x474c5343 /* "CSLG" */, rows, vocab};
    return fwrite(hdr, sizeof hdr, 1, f) == 1 ? 0 : -1;
}

int cmd_generate(int argc, char **argv) {
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},     {"lora", required_argument, 0, 'l'},
        {"prompt", required_argument, 0, 'p'},    {"prompt-ids", required_argument, 0, 'i'},
        {"max-tokens", required_argument, 0, 'n'}, {"temperature", required_argument, 0, 't'},
        {"seed", required_argument, 0, 's'},      {"print-ids", no_argument, 0, 'P'},
        {"threads", required_argument, 0, 'T'},   {"no-special", no_argument, 0, 'N'},
        {"ignore-eos", no_argument, 0, 'E'},      {"stats", no_argument, 0, 'S'},
        {"dump-logits", required_argument, 0, 'D'}, {"reference-kernels", no_argument, 0, 'R'},
        {"device", required_argument, 0, 'V'},    {"precision", required_argument, 0, 'Q'},
        {"kv-cache-dtype", required_argument, 0, 'K'}, {"lora-dtype", required_argument, 0, 'L'},
        {"mmap", no_argument, 0, 'u'},            {"no-mmap", no_argument, 0, 'U'},
        {"compress-weights", no_argument, 0, 'W'}, {"compress-weights-only", no_argument, 0, 'O'},
        {"help", no_argument, 0, 'h'},            {0, 0, 0, 0},
    };
    const char *model_dir = NULL, *lora_dir = NULL, *prompt = NULL, *prompt_ids = NULL, *dump = NULL, *device = NULL;
    int max_tokens = 64, threads = 0, kv_choice = SETUP_KV_AUTO, lora_dtype = 0;
    model_weights_mem weights_mem = MODEL_WEIGHTS_AUTO;
    bool print_ids = false, no_special = false, ignore_eos = false, stats = false, reference = false, bf16 = false;
    bool compress = false, compress_only = false;
    sampling_params_t sp;
    sampling_params_default(&sp);
    sp.temperature = 0;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        char *end = NULL;
        switch (c) {
        case 'm': model_dir = optarg; break;
        case 'u': weights_mem = MODEL_WEIGHTS_MMAP; break;
        case 'U': weights_mem = MODEL_WEIGHTS_COPY; break;
        case 'W': compress = true; break;
        case 'O': compress_only = true; break;
        case 'l': lora_dir = optarg; break;
        case 'p': prompt = optarg; break;
        case 'i': prompt_ids = optarg; break;
        case 'n':
            max_tokens = (int)strtol(optarg, &end, 10);
            if (*end || max_tokens < 0) { fprintf(stderr, "caraserve: --max-tokens must be an integer >= 0\n"); return 2; }
            break;
        case 't':
            sp.temperature = strtof(optarg, &end);
            if (*end || !(sp.temperature >= 0)) { fprintf(stderr, "caraserve: --temperature must be a number >= 0\n"); return 2; }
            break;
        case 's':
            sp.seed = strtoull(optarg, &end, 10);
            if (*end) { fprintf(stderr, "caraserve: --seed must be an integer\n"); return 2; }
            break;
        case 'P': print_ids = true; break;
        case 'T':
            threads = (int)strtol(optarg, &end, 10);
            if (*end || threads < 1) { fprintf(stderr, "caraserve: --threads must be an integer >= 1\n"); return 2; }
            break;
        case 'N': no_special = true; break;
        case 'E': ignore_eos = true; break;
        case 'S': stats = true; break;
        case 'D': dump = optarg; break;
        case 'R': reference = true; break;
        case 'V': device = optarg; break;
        case 'Q': {
            int prec = setup_parse_precision(optarg);
            if (prec < 0) { fprintf(stderr, "caraserve generate: --precision wants exact or bf16, got '%s'\n", optarg); return 2; }
            bf16 = prec == 1;
            break;
        }
        case 'K':
            if ((kv_choice = setup_parse_kv_dtype(optarg)) == -2) {
                fprintf(stderr, "caraserve generate: --kv-cache-dtype wants auto, f32 or bf16, got '%s'\n", optarg);
                return 2;
            }
            break;
        case 'L':
            if ((lora_dtype = setup_parse_lora_dtype(optarg)) < 0) {
                fprintf(stderr, "caraserve generate: --lora-dtype wants auto or bf16, got '%s'\n", optarg);
                return 2;
            }
            break;
        case 'h': usage_generate(stdout); return 0;
        default: usage_generate(stderr); return 2;
        }
    }
    if (optind < argc) { fprintf(stderr, "caraserve generate: unexpected argument '%s'\n", argv[optind]); return 2; }
    if (!model_dir) { fprintf(stderr, "caraserve generate: --model DIR is required\n"); usage_generate(stderr); return 2; }
    if (!prompt == !prompt_ids) {
        fprintf(stderr, "caraserve generate: give exactly one of --prompt or --prompt-ids\n");
        return 2;
    }

    int32_t *ids = NULL;
    int n_prompt = 0;
    if (prompt_ids && parse_ids(prompt_ids, &ids, &n_prompt)) return 2; /* before the slow part */

    int status = 1;
    backend_t *be = NULL;
    model_t *model = NULL;
    tokenizer_t *tok = NULL;
    lora_adapter_t *lora = NULL;
    model_seq_t *seq = NULL;
    float *logits = NULL;
    FILE *df = NULL;
    tokenizer_stream_t *ts = NULL;

    be = setup_backend(&(setup_backend_opts_t){.device = device, .threads = threads, .reference = reference,
                                                .precision_bf16 = bf16, .compress_weights = compress,
                                                .compress_weights_only = compress_only});
    if (!be) { fprintf(stderr, "caraserve: %s\n", cs_error_last()); goto out; }
    double t0 = cs_time_ms();
    if (model_load_how(model_dir, be, weights_mem, &model)) {
        fprintf(stderr, "caraserve: %s: %s\n", model_dir, cs_error_last());
        goto out;
    }
    const model_config_t *cfg = model_get_config(model);
    char *tj = cs_path_join(model_dir, "tokenizer.json");
    bool have_tok = tj && cs_file_exists(tj);
    free(tj);
    if (have_tok && tokenizer_load(model_dir, &tok)) {
        fprintf(stderr, "caraserve: %s: %s\n", model_dir, cs_error_last());
        goto out;
    }
    if (prompt && !tok) { fprintf(stderr, "caraserve: %s has no tokenizer.json; use --prompt-ids\n", model_dir); goto out; }
    if (lora_dir && lora_adapter_load_as(lora_dir, cfg, lora_dtype == 1, &lora)) {
        fprintf(stderr, "caraserve: adapter %s: %s\n", lora_dir, cs_error_last());
        goto out;
    }
    double t_load = cs_time_ms() - t0;
    if (prompt) {
        size_t n;
        if (tokenizer_encode(tok, prompt, strlen(prompt), !no_special, &ids, &n)) {
            fprintf(stderr, "caraserve: tokenize: %s\n", cs_error_last());
            goto out;
        }
        n_prompt = (int)n;
    }
    if (n_prompt == 0) { fprintf(stderr, "caraserve: the prompt is empty (no tokens)\n"); goto out; }
    for (int i = 0; i < n_prompt; i++)
        if (ids[i] >= cfg->vocab_size) {
            fprintf(stderr, "caraserve: prompt token id %d is out of the vocabulary (size %d)\n", ids[i], cfg->vocab_size);
            goto out;
        }
    int capacity = n_prompt + max_tokens;
    seq = model_seq_new(model, capacity, setup_kv_dtype(be, kv_choice, bf16, model_weight_dtype(model)));
    logits = malloc(sizeof(float) * (size_t)n_prompt * cfg->vocab_size);
    int32_t *all = realloc(ids, sizeof(int32_t) * (size_t)(capacity + 1));
    if (!seq) { fprintf(stderr, "caraserve: %s\n", cs_error_last()); goto out; }
    if (!logits || !all) { fprintf(stderr, "caraserve: out of memory\n"); goto out; }
    ids = all;
    if (dump) {
        df = fopen(dump, "wb");
        if (!df) { fprintf(stderr, "caraserve: %s: %s\n", dump, strerror(errno)); goto out; }
        write_logits_header(df, 0, cfg->vocab_size);
    }
    if (tok) ts = tokenizer_stream_new(tok, true);

    double tp0 = cs_time_ms();
    if (model_forward(model, seq, ids, n_prompt, lora, logits, dump != NULL)) {
        fprintf(stderr, "caraserve: forward: %s\n", cs_error_last());
        goto out;
    }
    double t_prefill = cs_time_ms() - tp0;
    int rows = dump ? n_prompt : 1;
    if (df && fwrite(logits, sizeof(float) * cfg->vocab_size, (size_t)rows, df) != (size_t)rows) goto dump_err;
    const float *last = logits + (size_t)(rows - 1) * cfg->vocab_size;
    const int32_t *eos = NULL;
    int n_eos = tok ? tokenizer_eos_ids(tok, &eos) : 0;
    cs_rng_t rng;
    cs_rng_seed(&rng, sp.seed);
    int n_gen = 0;
    double td0 = cs_time_ms();
    while (n_gen < max_tokens) {
        int32_t t = sampling_sample(last, cfg->vocab_size, &sp, &rng);
        ids[n_prompt + n_gen++] = t;
        bool is_eos = false;
        for (int e = 0; e < n_eos; e++) is_eos |= eos[e] == t;
        for (int e = 0; e < cfg->n_eos; e++) is_eos |= cfg->eos_token_ids[e] == t;
        if (ts) {
            char *piece;
            size_t plen;
            if (tokenizer_stream_push(ts, t, &piece, &plen) == CS_OK) {
                fwrite(piece, 1, plen, stdout);
                fflush(stdout);
                free(piece);
            }
        }
        if ((is_eos && !ignore_eos) || n_gen == max_tokens) break;
        if (model_forward(model, seq, &t, 1, lora, logits, false)) {
            fprintf(stderr, "caraserve: forward: %s\n", cs_error_last());
            goto out;
        }
        if (df && fwrite(logits, sizeof(float) * cfg->vocab_size, 1, df) != 1) goto dump_err;
        last = logits;
    }
    double t_decode = cs_time_ms() - td0;
    if (ts) {
        char *piece;
        size_t plen;
        if (tokenizer_stream_flush(ts, &piece, &plen) == CS_OK) { fwrite(piece, 1, plen, stdout); free(piece); }
    }
    if (max_tokens > 0) printf("\n");
    fflush(stdout); /* the text before the stats on stderr */
    if (print_ids) {
        printf("prompt_ids:");
        for (int i = 0; i < n_prompt; i++) printf("%s%d", i ? "," : " ", ids[i]);
        printf("\ngenerated_ids:");
        for (int i = 0; i < n_gen; i++) printf("%s%d", i ? "," : " ", ids[n_prompt + i]);
        printf("\n");
    }
    if (df) {
        int32_t total = rows + (n_gen > 0 ? n_gen - 1 : 0); /* the last token is never run */
        if (fseek(df, 0, SEEK_SET) || write_logits_header(df, total, cfg->vocab_size)) goto dump_err;
    }
    if (stats) {
        char bdesc[160];
        setup_backend_describe(be, bdesc, sizeof bdesc);
        backend_stats_t bs;
        backend_get_stats(be, &bs);
        char coded[128] = "";
        size_t released = model_weights_released(model);
        if (bs.prepared_bytes)
            snprintf(coded, sizeof coded, " (coded in %.1f of %.1f MiB, %llu exceptions%s)", bs.prepared_bytes / 1048576.0,
                     bs.prepared_from / 1048576.0, (unsigned long long)bs.prepared_exceptions,
                     released ? "; the BF16 released" : "");
        fprintf(stderr,
                "stats: load %.1f ms | prefill %d tokens in %.1f ms (%.1f tok/s) | decode %d tokens in %.1f ms "
                "(%.2f tok/s) | %s | weights %s%s | KV %s | params %.1fM\n",
                t_load, n_prompt, t_prefill, n_prompt / (t_prefill / 1e3), n_gen > 1 ? n_gen - 1 : 0, t_decode,
                n_gen > 1 ? (n_gen - 1) / (t_decode / 1e3) : 0.0, bdesc,
                cs_dtype_name(model_weight_dtype(model)), coded, cs_dtype_name(setup_kv_dtype(be, kv_choice, bf16, model_weight_dtype(model))),
                model_n_params(model) / 1e6);
    }
    status = 0;
    goto out;
dump_err:
    fprintf(stderr, "caraserve: %s: write failed\n", dump);
out:
    if (df && fclose(df) && status == 0) { fprintf(stderr, "caraserve: %s: write failed\n", dump); status = 1; }
    tokenizer_stream_free(ts);
    free(logits);
    free(ids);
    model_seq_free(seq);
    lora_adapter_free(lora);
    tokenizer_free(tok);
    model_free(model);
    backend_free(be);
    return status;
}
