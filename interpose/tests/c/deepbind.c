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

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;
CUresult cuInit(unsigned int);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);

typedef int (*deep_alloc_t)(size_t);

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: deepbind MIB LIBRARY\n");
        return 1;
    }
    size_t mib = strtoull(argv[1], NULL, 10);
    CUdevice dev;
    CUcontext ctx;
    CUdeviceptr small;
    if (cuInit(0) || cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(&ctx, dev) || cuCtxSetCurrent(ctx)) {
        fprintf(stderr, "no context\n");
        return 1;
    }
    printf("hooked %d\n", cuMemAlloc_v2(&small, 64u << 20));
    fflush(stdout);
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
