/* What the escaping test clients share (no cuda.h needed): the driver declarations they link
 * against and the honest start every one of them makes, which connects it to the arbiter. */
#ifndef ESCAPE_CLIENT_H
#define ESCAPE_CLIENT_H

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include "cuda_abi.h"

CUresult cuInit(unsigned int);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);

/* Device 0's primary context made current, then 64 MiB through the hooked linked symbol (the
 * first allocation connects the process); prints "hooked <CUresult>". Exits 1 without a
 * context. */
static void hooked_start(void) {
    CUdevice dev;
    CUcontext ctx;
    CUdeviceptr small;
    if (cuInit(0) || cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(&ctx, dev) || cuCtxSetCurrent(ctx)) {
        fprintf(stderr, "no context\n");
        exit(1);
    }
    printf("hooked %d\n", cuMemAlloc_v2(&small, 64u << 20));
    fflush(stdout);
}

typedef void *(*glibc_dlsym_t)(void *, const char *);

/* glibc's own `dlsym`, taken through `dlvsym` on libc's handle (the interposer hooks `dlsym`,
 * not `dlvsym`); NULL when it cannot be found. */
static glibc_dlsym_t glibc_dlsym(void) {
    void *libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
    glibc_dlsym_t f = libc ? (glibc_dlsym_t)dlvsym(libc, "dlsym", "GLIBC_2.34") : NULL;
    if (!f && libc)
        f = (glibc_dlsym_t)dlvsym(libc, "dlsym", "GLIBC_2.2.5");
    return f;
}

#endif
