/* fuzz.h: what the fuzz targets share. Each target is one LLVMFuzzerTestOneInput; it links
 * with libFuzzer (clang, configure --enable-fuzzing: tests/fuzz/run.sh) or with driver.c
 * (any compiler: the corpus, the kept crashes and a fixed number of mutations, in make check).
 * A target checks properties of what it parsed (FUZZ_CHECK), not only that nothing crashed. */
#ifndef CS_FUZZ_H
#define CS_FUZZ_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

/* a property that must hold for every input: abort (a crash to libFuzzer) when it does not */
#define FUZZ_CHECK(cond, ...)                                                            \
    do {                                                                                 \
        if (!(cond)) {                                                                   \
            fprintf(stderr, "%s:%d: FUZZ_CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                                \
            fputc('\n', stderr);                                                         \
            abort();                                                                     \
        }                                                                                \
    } while (0)

/* Inputs the code under test accepted (parsed, loaded, rendered): the driver reports it, so a
 * corpus that only exercises the error paths shows. */
extern long fuzz_accepted;

/* The input as a NUL-terminated string (malloc'd). */
char *fuzz_cstr(const uint8_t *data, size_t size);
/* The input written to an anonymous file: its path (/proc/self/fd/N, valid until the next call). */
const char *fuzz_file(const uint8_t *data, size_t size);
/* A file of the build tree's test data (tests/tokenizer-data/...): $CS_FUZZ_BUILDDIR, else
 * the build directory the target was compiled in; a static buffer. */
const char *fuzz_build_path(const char *rel);

#endif
