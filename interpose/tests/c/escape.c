/* A connected tenant that then goes around the interposer: it allocates 64 MiB through the
 * (hooked) linked symbol, which connects it to the arbiter, then takes glibc's own `dlsym`
 * through `dlvsym` on libc's handle (the interposer hooks `dlsym`, not `dlvsym`), resolves the
 * real `cuMemAlloc_v2` with it and allocates argv[1] MiB more, past its limit. It prints
 * "escaped <CUresult>" and waits 10 s (the backstop should kill it long before). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "escape_client.h"

typedef CUresult (*alloc_t)(CUdeviceptr *, size_t);

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoull(argv[1], NULL, 10) : 4096;
    CUdeviceptr big;
    hooked_start();
    glibc_dlsym_t real_dlsym = glibc_dlsym();
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    alloc_t real_alloc = (real_dlsym && cuda) ? (alloc_t)real_dlsym(cuda, "cuMemAlloc_v2") : NULL;
    if (!real_alloc || real_alloc == cuMemAlloc_v2) {
        fprintf(stderr, "could not reach the real cuMemAlloc_v2\n");
        return 1;
    }
    printf("escaped %d\n", real_alloc(&big, mib << 20));
    fflush(stdout);
    sleep(10);
    return 0;
}
