/* cmd_generate.c: `caraserve generate` runs one prompt through the model on the CPU backend
 * (with or without a PEFT adapter) and prints the continuation; it is also how tests compare
 * the engine with transformers (--dump-logits). */
#include <errno.h>
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
#include "server/options.h"
#include "cpu_kernels/cpu_backend.h"
#include "cpu_kernels/kernels.h"

static void usage_generate(FILE *f) {
    options_usage(f, OPT_CMD_GENERATE,
                  "usage: caraserve generate --model DIR [--lora DIR] (--prompt TEXT | --prompt-ids 1,2,3) [options]", NULL);
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

/* one `caraserve generate` run */
typedef struct gen {
    cs_options_t o;
    sampling_params_t sp;
    backend_t *be;
    model_t *model;
    const model_config_t *cfg;
    tokenizer_t *tok;
    lora_adapter_t *lora;
    model_seq_t *seq;
    tokenizer_stream_t *ts;
    int32_t *ids;             /* the prompt, then the generated tokens */
    int n_prompt, n_gen;
    float *logits;            /* (n_prompt, vocab) */
    FILE *df;                 /* --dump-logits */
    int rows;                 /* the prefill's logits rows dumped */
    double t_load, t_prefill, t_decode;
} gen_t;

/* the flags into G: -1 to go on, else the exit status */
static int gen_parse(gen_t *g, int argc, char **argv) {
    cs_options_t *o = &g->o;
    options_init(o);
    int r = options_parse(o, OPT_CMD_GENERATE, argc, argv);
    if (r == OPT_HELP) { usage_generate(stdout); return 0; }
    if (r == OPT_EUNKNOWN) { usage_generate(stderr); return 2; }
    if (r != OPT_OK) return 2;
    if (!o->model) { fprintf(stderr, "caraserve generate: --model DIR is required\n"); usage_generate(stderr); return 2; }
    if (!o->prompt == !o->prompt_ids) {
        fprintf(stderr, "caraserve generate: give exactly one of --prompt or --prompt-ids\n");
        return 2;
    }
    if (o->prompt_ids && parse_ids(o->prompt_ids, &g->ids, &g->n_prompt)) return 2; /* before the slow part */
    sampling_params_default(&g->sp);
    g->sp.temperature = o->temperature;
    g->sp.seed = o->seed;
    return -1;
}

/* the backend, the model, its tokenizer and the adapter; the prompt's tokens */
static int gen_load(gen_t *g) {
    const cs_options_t *o = &g->o;
    g->be = setup_backend(&(setup_backend_opts_t){.device = o->device, .threads = o->threads,
                                                  .reference = o->reference_kernels, .batch_invariant = o->batch_invariant,
                                                  .precision_bf16 = o->precision == 1, .precision_int8 = o->precision == 2,
                                                  .compress_weights = o->compress_weights,
                                                  .compress_weights_only = o->compress_weights_only});
    if (!g->be) { fprintf(stderr, "caraserve: %s\n", cs_error_last()); return -1; }
    double t0 = cs_time_ms();
    model_set_load_quantization((cs_dtype)o->quantization, backend_n_threads(g->be));
    if (model_load_how(o->model, g->be, o->weights_mem, &g->model)) {
        fprintf(stderr, "caraserve: %s: %s\n", o->model, cs_error_last());
        return -1;
    }
    g->cfg = model_get_config(g->model);
    if (setup_tokenizer(o->model, &g->tok)) {
        fprintf(stderr, "caraserve: %s: %s\n", o->model, cs_error_last());
        return -1;
    }
    if (o->prompt && !g->tok) { fprintf(stderr, "caraserve: %s has no tokenizer; use --prompt-ids\n", o->model); return -1; }
    if (o->lora_dir && lora_adapter_load_as(o->lora_dir, g->cfg, o->lora_bf16, &g->lora)) {
        fprintf(stderr, "caraserve: adapter %s: %s\n", o->lora_dir, cs_error_last());
        return -1;
    }
    g->t_load = cs_time_ms() - t0;
    if (o->prompt) {
        size_t n;
        if (tokenizer_encode(g->tok, o->prompt, strlen(o->prompt), !o->no_special, &g->ids, &n)) {
            fprintf(stderr, "caraserve: tokenize: %s\n", cs_error_last());
            return -1;
        }
        g->n_prompt = (int)n;
    }
    if (g->n_prompt == 0) { fprintf(stderr, "caraserve: the prompt is empty (no tokens)\n"); return -1; }
    for (int i = 0; i < g->n_prompt; i++)
        if (g->ids[i] >= g->cfg->vocab_size) {
            fprintf(stderr, "caraserve: prompt token id %d is out of the vocabulary (size %d)\n", g->ids[i], g->cfg->vocab_size);
            return -1;
        }
    return 0;
}

/* the sequence, the logits, --dump-logits' file and the detokenizer */
static int gen_setup(gen_t *g) {
    const cs_options_t *o = &g->o;
    int capacity = g->n_prompt + o->max_tokens;
    g->seq = model_seq_new(g->model, capacity,
                           setup_kv_dtype(g->be, o->kv_cache_dtype, o->precision == 1, model_weight_dtype(g->model)));
    g->logits = malloc(sizeof(float) * (size_t)g->n_prompt * g->cfg->vocab_size);
    int32_t *all = realloc(g->ids, sizeof(int32_t) * (size_t)(capacity + 1));
    if (all) g->ids = all;
    if (!g->seq) { fprintf(stderr, "caraserve: %s\n", cs_error_last()); return -1; }
    if (!g->logits || !all) { fprintf(stderr, "caraserve: out of memory\n"); return -1; }
    if (o->dump_logits) {
        g->df = fopen(o->dump_logits, "wb");
        if (!g->df) { fprintf(stderr, "caraserve: %s: %s\n", o->dump_logits, strerror(errno)); return -1; }
        write_logits_header(g->df, 0, g->cfg->vocab_size);
    }
    if (g->tok) g->ts = tokenizer_stream_new(g->tok, true);
    return 0;
}

/* the prefill, then decode steps to --max-tokens or an end of sequence, the text on stdout:
 * 0, -1 said, or -2 when the logits could not be written */
static int gen_run(gen_t *g) {
    const cs_options_t *o = &g->o;
    int vocab = g->cfg->vocab_size;
    double tp0 = cs_time_ms();
    if (model_forward(g->model, g->seq, g->ids, g->n_prompt, g->lora, g->logits, g->df != NULL)) {
        fprintf(stderr, "caraserve: forward: %s\n", cs_error_last());
        return -1;
    }
    g->t_prefill = cs_time_ms() - tp0;
    g->rows = g->df ? g->n_prompt : 1;
    if (g->df && fwrite(g->logits, sizeof(float) * vocab, (size_t)g->rows, g->df) != (size_t)g->rows) return -2;
    const float *last = g->logits + (size_t)(g->rows - 1) * vocab;
    const int32_t *eos = NULL;
    int n_eos = g->tok ? tokenizer_eos_ids(g->tok, &eos) : 0;
    cs_rng_t rng;
    cs_rng_seed(&rng, g->sp.seed);
    double td0 = cs_time_ms();
    while (g->n_gen < o->max_tokens) {
        int32_t t = sampling_sample(last, vocab, &g->sp, &rng);
        g->ids[g->n_prompt + g->n_gen++] = t;
        bool is_eos = false;
        for (int e = 0; e < n_eos; e++) is_eos |= eos[e] == t;
        for (int e = 0; e < g->cfg->n_eos; e++) is_eos |= g->cfg->eos_token_ids[e] == t;
        if (g->ts) {
            char *piece;
            size_t plen;
            if (tokenizer_stream_push(g->ts, t, &piece, &plen) == CS_OK) {
                fwrite(piece, 1, plen, stdout);
                fflush(stdout);
                free(piece);
            }
        }
        if ((is_eos && !o->ignore_eos) || g->n_gen == o->max_tokens) break;
        if (model_forward(g->model, g->seq, &t, 1, g->lora, g->logits, false)) {
            fprintf(stderr, "caraserve: forward: %s\n", cs_error_last());
            return -1;
        }
        if (g->df && fwrite(g->logits, sizeof(float) * vocab, 1, g->df) != 1) return -2;
        last = g->logits;
    }
    g->t_decode = cs_time_ms() - td0;
    if (g->ts) {
        char *piece;
        size_t plen;
        if (tokenizer_stream_flush(g->ts, &piece, &plen) == CS_OK) { fwrite(piece, 1, plen, stdout); free(piece); }
    }
    if (o->max_tokens > 0) printf("\n");
    fflush(stdout); /* the text before the stats on stderr */
    return 0;
}

/* --stats: load, prefill and decode times, the backend, the weights and the KV cache */
static void gen_print_stats(gen_t *g) {
    char bdesc[160];
    setup_backend_describe(g->be, bdesc, sizeof bdesc);
    backend_stats_t bs;
    backend_get_stats(g->be, &bs);
    char coded[128] = "";
    size_t released = model_weights_released(g->model);
    if (bs.prepared_bytes)
        snprintf(coded, sizeof coded, " (coded in %.1f of %.1f MiB, %llu exceptions%s)", bs.prepared_bytes / 1048576.0,
                 bs.prepared_from / 1048576.0, (unsigned long long)bs.prepared_exceptions,
                 released ? "; the BF16 released" : "");
    cs_dtype wd = model_weight_dtype(g->model);
    int n_gen = g->n_gen;
    fprintf(stderr,
            "stats: load %.1f ms | prefill %d tokens in %.1f ms (%.1f tok/s) | decode %d tokens in %.1f ms "
            "(%.2f tok/s) | %s | weights %s%s | KV %s | params %.1fM\n",
            g->t_load, g->n_prompt, g->t_prefill, g->n_prompt / (g->t_prefill / 1e3), n_gen > 1 ? n_gen - 1 : 0,
            g->t_decode, n_gen > 1 ? (n_gen - 1) / (g->t_decode / 1e3) : 0.0, bdesc, cs_dtype_name(wd), coded,
            cs_dtype_name(setup_kv_dtype(g->be, g->o.kv_cache_dtype, g->o.precision == 1, wd)),
            model_n_params(g->model) / 1e6);
}

/* --print-ids, the dump's header with its row count, --stats: 0, or -2 when the dump failed */
static int gen_report(gen_t *g) {
    if (g->o.print_ids) {
        printf("prompt_ids:");
        for (int i = 0; i < g->n_prompt; i++) printf("%s%d", i ? "," : " ", g->ids[i]);
        printf("\ngenerated_ids:");
        for (int i = 0; i < g->n_gen; i++) printf("%s%d", i ? "," : " ", g->ids[g->n_prompt + i]);
        printf("\n");
    }
    if (g->df) {
        int32_t total = g->rows + (g->n_gen > 0 ? g->n_gen - 1 : 0); /* the last token is never run */
        if (fseek(g->df, 0, SEEK_SET) || write_logits_header(g->df, total, g->cfg->vocab_size)) return -2;
    }
    if (g->o.stats) gen_print_stats(g);
    return 0;
}

int cmd_generate(int argc, char **argv) {
    gen_t g = {0};
    int status = gen_parse(&g, argc, argv);
    if (status >= 0) {
        free(g.ids);
        options_free(&g.o);
        return status;
    }
    status = 1;
    int rc = gen_load(&g);
    if (!rc) rc = gen_setup(&g);
    if (!rc) rc = gen_run(&g);
    if (!rc) rc = gen_report(&g);
    if (!rc) status = 0;
    if (rc == -2) fprintf(stderr, "caraserve: %s: write failed\n", g.o.dump_logits);
    if (g.df && fclose(g.df) && status == 0) { fprintf(stderr, "caraserve: %s: write failed\n", g.o.dump_logits); status = 1; }
    tokenizer_stream_free(g.ts);
    free(g.logits);
    free(g.ids);
    model_seq_free(g.seq);
    lora_adapter_free(g.lora);
    tokenizer_free(g.tok);
    model_free(g.model);
    backend_free(g.be);
    options_free(&g.o);
    return status;
}
