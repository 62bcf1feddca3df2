/* fuzz_util.c: the helpers of fuzz.h. */
#define _GNU_SOURCE
#include "tests/fuzz/fuzz.h"

#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

long fuzz_accepted;

char *fuzz_cstr(const uint8_t *data, size_t size) {
    char *s = malloc(size + 1);
    if (!s) abort();
    if (size) memcpy(s, data, size);
    s[size] = 0;
    return s;
}

const char *fuzz_file(const uint8_t *data, size_t size) {
    static int fd = -1;
    static char path[64];
    if (fd < 0) {
        fd = memfd_create("fuzz-input", 0);
        if (fd < 0) { perror("memfd_create"); abort(); }
        snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    }
    if (ftruncate(fd, 0) || pwrite(fd, data, size, 0) != (ssize_t)size) { perror("fuzz_file"); abort(); }
    return path;
}

const char *fuzz_build_path(const char *rel) {
    static char buf[4096];
    const char *dir = getenv("CS_FUZZ_BUILDDIR");
    snprintf(buf, sizeof buf, "%s/%s", dir && *dir ? dir : FUZZ_BUILDDIR, rel);
    return buf;
}
