/* main.c: the `caraserve` command: the subcommand dispatch and `version`; each other
 * subcommand is a cmd_*.c of its own (server/commands.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "server/setup.h"
#include "server/commands.h"
#include "server/api_fields.h"
#include "cpu_kernels/cpu_backend.h"
#include "cpu_kernels/kernels.h"

static void usage(FILE *f) {
    fprintf(f,
            "caraserve %s: multi-LoRA LLM inference server\n"
            "\n"
            "usage: caraserve <command> [options]\n"
            "\n"
            "commands:\n"
            "  serve      the OpenAI-compatible HTTP server (see caraserve serve --help)\n"
            "  router     an HTTP front for several serve replicas (see caraserve router --help)\n"
            "  generate   one-shot generation on the CPU (see caraserve generate --help)\n"
            "  batch      run JSON-lines requests through the batching engine (caraserve batch --help)\n"
            "  fields     the request fields of each route, honoured or refused (--json: as JSON)\n"
            "  version    print the version, the CPU and the kernel paths picked for it\n",
            PACKAGE_VERSION);
}

/* `caraserve version`: the version, the CPU (its model name and the ISA extensions the
 * kernels use) and the kernel paths the CPU backend picks here, exact and --precision bf16,
 * with the CS_NO_* switches of the environment applied: what a benchmark records */
static int cmd_version(void) {
    printf("caraserve %s\n", PACKAGE_VERSION);
    char model[256];
    cs_cpu_name(model, sizeof model);
    printf("cpu: %s (%s%s%s%s)\n", model, cs_cpu_has_avx2() ? "avx2 fma" : "no avx2",
           cs_cpu_has_avx512() ? " avx512f avx512bw avx512vl avx512dq" : "", cs_cpu_has_avx512_bf16() ? " avx512_bf16" : "",
           cs_cpu_has_amx_bf16() ? " amx_bf16" : "");
    const char *path[2] = {"?", "?"};
    backend_t *be[2] = {NULL, NULL};
    for (int i = 0; i < 2; i++) {
        be[i] = setup_backend(&(setup_backend_opts_t){.device = "cpu", .threads = 1, .precision_bf16 = i == 1});
        if (be[i]) path[i] = cpu_backend_path(be[i]);
    }
    printf("kernels: %s (exact), %s (--precision bf16)\n", path[0], path[1]);
#ifdef CS_HAVE_CUDA
    printf("cuda: built in (--device cuda)\n");
#else
    printf("cuda: not built\n");
#endif
    for (int i = 0; i < 2; i++) backend_free(be[i]);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) { usage(stderr); return 2; }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "generate")) return cmd_generate(argc - 1, argv + 1);
    if (!strcmp(cmd, "batch")) return cmd_batch(argc - 1, argv + 1);
    if (!strcmp(cmd, "serve")) return cmd_serve(argc - 1, argv + 1);
    if (!strcmp(cmd, "router")) return cmd_router(argc - 1, argv + 1);
    if (!strcmp(cmd, "version") || !strcmp(cmd, "--version")) return cmd_version();
    if (!strcmp(cmd, "fields")) { /* docs/api-fields.md is this, as Markdown */
        bool json = argc > 2 && !strcmp(argv[2], "--json");
        if (argc > 2 + json) {
            fprintf(stderr, "usage: caraserve fields [--json]\n");
            return 2;
        }
        api_fields_print(stdout, json);
        return 0;
    }
    if (!strcmp(cmd, "help") || !strcmp(cmd, "--help") || !strcmp(cmd, "-h")) { usage(stdout); return 0; }
    fprintf(stderr, "caraserve: unknown command '%s'\n", cmd);
    usage(stderr);
    return 2;
}
