/* fuzz_request.c: the request parsers, JSON body -> validated request, as the server runs
 * them (server/api_openai.c, rollout_api/rollout.c) but with nothing submitted. Built three
 * times: FUZZ_COMPLETIONS (/v1/completions), FUZZ_CHAT (/v1/chat/completions, the chat
 * template rendered with the real Llama 3.1 tokenizer and template) and FUZZ_ROLLOUT
 * (/v1/rollout). The server is a real server_t with that tokenizer, one served adapter, no
 * model and no engine. Properties of every accepted request: its prompts are non-empty token
 * ids below the vocabulary, shorter than the context, its samples and logprobs within the
 * limits; of every refused one: a 4xx status and a message. After either, no job and no pin
 * of the adapter is left behind. */
#include <string.h>

#include "rollout_api/rollout.h"
#include "server/api_internal.h"
#include "tests/fuzz/fuzz.h"

#define MAX_N 16
#define MAX_LOGPROBS 20
#define MAX_LEN 512

static server_t srv;
static served_adapter_t adapter = {.name = "fuzz-lora", .path = "/nonexistent/fuzz-lora"};

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    server_t *s = &srv;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->model_name = "fuzz-model";
    s->max_model_len = MAX_LEN;
    s->cfg.max_n = MAX_N;
    s->cfg.max_logprobs = MAX_LOGPROBS;
    s->adapters = &adapter;
    if (tokenizer_load(fuzz_build_path("tests/fuzz-data/llama-3.1"), &s->tok) != CS_OK) {
        fprintf(stderr, "fuzz_request: %s (make tests/fuzz-data.stamp, or set CS_FUZZ_BUILDDIR)\n", cs_error_last());
        abort();
    }
    s->vocab_size = tokenizer_vocab_size(s->tok);
    const char *src = tokenizer_chat_template(s->tok);
    if (!src || chat_template_parse(src, strlen(src), &s->tmpl)) {
        fprintf(stderr, "fuzz_request: the Llama 3.1 template: %s\n", src ? cs_error_last() : "missing");
        abort();
    }
    s->bos_token = "<|begin_of_text|>";
    s->eos_token = "<|eot_id|>";
    return 0;
}

static void check_refusal(unsigned status, const char *msg) {
    FUZZ_CHECK(status >= 400 && status < 500, "a bad request answered %u (%s)", status, msg);
    FUZZ_CHECK(msg[0], "a refusal without a message");
}

static void check_nothing_left(void) {
    FUZZ_CHECK(srv.n_jobs == 0 && srv.jobs == NULL, "%d jobs left", srv.n_jobs);
    FUZZ_CHECK(adapter.in_flight == 0, "the adapter keeps %d pins", adapter.in_flight);
}

#if defined(FUZZ_COMPLETIONS) || defined(FUZZ_CHAT)
static void check_job(const gen_job_t *j, const gen_opts_t *o) {
    FUZZ_CHECK(j->n_parts >= 1 && j->n >= 1 && j->n_parts * j->n <= MAX_N, "%d prompts x %d samples", j->n_parts,
               j->n);
    FUZZ_CHECK(j->logprobs >= -1 && j->logprobs <= MAX_LOGPROBS, "logprobs %d", j->logprobs);
    FUZZ_CHECK(o->rq.max_tokens >= -1, "max_tokens %d", o->rq.max_tokens);
    for (int i = 0; i < j->n_parts; i++) {
        const gen_part_t *p = &j->parts[i];
        FUZZ_CHECK(p->n_prompt >= 1 && p->n_prompt < MAX_LEN, "prompt %d of %d tokens", i, p->n_prompt);
        FUZZ_CHECK(o->rq.max_tokens <= 0 || p->n_prompt + o->rq.max_tokens <= MAX_LEN, "%d + %d tokens", p->n_prompt,
                   o->rq.max_tokens);
        for (int k = 0; k < p->n_prompt; k++)
            FUZZ_CHECK(p->prompt[k] >= 0 && p->prompt[k] < srv.vocab_size, "token %d", p->prompt[k]);
    }
    for (int k = 0; k < o->rq.n_stop_token_ids; k++)
        FUZZ_CHECK(o->rq.stop_token_ids[k] >= 0 && o->rq.stop_token_ids[k] < srv.vocab_size, "stop id %d",
                   o->rq.stop_token_ids[k]);
    for (int k = 0; k < o->rq.n_stop; k++) FUZZ_CHECK(o->rq.stop[k] && o->rq.stop[k][0], "an empty stop string");
}
#endif

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    json_t *b = json_loadb((const char *)data, size, 0, NULL); /* as server/api.c parses bodies */
    if (!json_is_object(b)) {
        json_decref(b);
        return 0;
    }
#if defined(FUZZ_COMPLETIONS) || defined(FUZZ_CHAT)
    conn_t cn = {.srv = &srv};
    gen_opts_t o;
    perr_t e = {0};
#ifdef FUZZ_CHAT
    gen_job_t *j = api_chat_parse(&srv, &cn, b, &o, &e);
#else
    gen_job_t *j = api_completions_parse(&srv, &cn, b, &o, &e);
#endif
    if (j) {
        fuzz_accepted++;
        check_job(j, &o);
        api_request_drop(&srv, j, &o);
    } else {
        check_refusal(e.status ? e.status : 400, e.msg);
    }
#else
    rollout_limits_t lim = {.max_samples = MAX_N, .max_logprobs = MAX_LOGPROBS, .base_name = "fuzz-model",
                            .vocab = srv.vocab_size};
    rollout_request_t rq = {.body = b, .lim = &lim};
    int rc = rollout_validate(&rq);
    if (rc) check_refusal(api_status_of(rc), cs_error_last());
    else fuzz_accepted++;
#endif
    check_nothing_left();
    json_decref(b);
    return 0;
}
