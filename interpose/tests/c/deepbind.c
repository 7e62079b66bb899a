/* A connected tenant that goes around the interposer with RTLD_DEEPBIND: it allocates 64 MiB
 * through the (hooked) linked symbol, which connects it to the arbiter, then dlopen()s argv[2]
 * (deepbind_lib.c) with RTLD_NOW | RTLD_DEEPBIND and calls its deepbind_alloc for argv[1] MiB:
 * the library's cuMemAlloc_v2 binds to the real driver, not to the interposer. It prints
 * "hooked <CUresult>", "escaped <CUresult>" and waits 10 s (the backstop should kill it long
 * before). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "escape_client.h"

typedef int (*deep_alloc_t)(size_t);

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: deepbind MIB LIBRARY\n");
        return 1;
    }
    size_t mib = strtoull(argv[1], NULL, 10);
    hooked_start();
    void *lib = dlopen(argv[2], RTLD_NOW | RTLD_DEEPBIND);
    deep_alloc_t deep_alloc = lib ? (deep_alloc_t)dlsym(lib, "deepbind_alloc") : NULL;
    if (!deep_alloc) {
        fprintf(stderr, "could not load %s: %s\n", argv[2], dlerror());
        return 1;
    }
    printf("escaped %d\n", deep_alloc(mib));
    fflush(stdout);
    sleep(10);
    return 0;
}
