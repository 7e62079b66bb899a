/* A program linked against libcuda (no cuda.h needed): calls exported driver symbols directly,
 * resolves through dlsym and cuGetProcAddress, and reports which object answered. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
#include "cuda_abi.h"

CUresult cuInit(unsigned int);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuGetProcAddress_v2(const char *, void **, int, unsigned long long, int *);

typedef CUresult (*alloc_async_t)(CUdeviceptr *, size_t, CUstream);
typedef CUresult (*free_async_t)(CUdeviceptr, CUstream);
typedef CUresult (*gpa_t)(const char *, void **, int, unsigned long long, int *);
typedef CUresult (*alloc_t)(CUdeviceptr *, size_t);

static const char *owner(void *p) {
    Dl_info info;
    if (!p) return "null";
    if (!dladdr(p, &info) || !info.dli_fname) return "unknown";
    return strstr(info.dli_fname, "tessera_interpose") ? "interposer" : "driver";
}

int main(void) {
    const size_t MIB = 1 << 20;
    setvbuf(stdout, NULL, _IOLBF, 0);
    CUdevice dev;
    CUcontext ctx;
    if (cuInit(0) || cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(&ctx, dev) || cuCtxSetCurrent(ctx)) {
        printf("setup=failed\n");
        return 1;
    }
    /* Direct calls to exported symbols. */
    CUdeviceptr a = 0, b = 0;
    printf("direct_first=%d\n", cuMemAlloc_v2(&a, 600 * MIB));
    printf("direct_second=%d\n", cuMemAlloc_v2(&b, 600 * MIB));
    printf("direct_null_out=%d\n", cuMemAlloc_v2(NULL, 1));

    /* dlsym on the driver's handle. */
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    printf("dlsym_free=%s\n", owner(dlsym(h, "cuMemFree_v2")));
    printf("dlsym_unhooked=%s\n", owner(dlsym(h, "cuCtxGetDevice")));
    printf("dlsym_missing=%s\n", owner(dlsym(h, "cuNoSuchFunction")));

    /* cuGetProcAddress: per-thread variant, and cuGetProcAddress itself. */
    int status = -1;
    void *p = NULL;
    CUresult r = cuGetProcAddress_v2("cuMemAllocAsync", &p, 12000, 2, &status);
    printf("gpa_async=%d,%s\n", r, owner(p));
    if (!p) return 2;
    Dl_info info;
    if (p && dladdr(p, &info) && info.dli_sname) printf("gpa_async_name=%s\n", info.dli_sname);
    CUdeviceptr c = 0;
    printf("gpa_async_over_limit=%d\n", ((alloc_async_t)p)(&c, 600 * MIB, NULL));
    void *g = NULL;
    cuGetProcAddress_v2("cuGetProcAddress", &g, 13000, 0, &status);
    printf("gpa_self=%s\n", owner(g));
    void *m = NULL;
    ((gpa_t)g)("cuMemAlloc", &m, 13000, 0, &status);
    printf("gpa_via_wrapper=%s\n", owner(m));
    void *legacy = NULL;
    cuGetProcAddress_v2("cuMemAllocAsync", &legacy, 12000, 1, &status);
    if (legacy && dladdr(legacy, &info) && info.dli_sname) printf("gpa_legacy_name=%s\n", info.dli_sname);

    printf("free_first=%d\n", cuMemFree_v2(a));
    printf("gpa_async_after_free=%d\n", ((alloc_async_t)p)(&c, 600 * MIB, NULL));
    void *fa = NULL;
    cuGetProcAddress_v2("cuMemFreeAsync", &fa, 12000, 2, &status);
    printf("free_async=%d\n", ((free_async_t)fa)(c, NULL));
    CUdeviceptr d = 0, e = 0;
    printf("via_wrapper_first=%d\n", ((alloc_t)m)(&d, 600 * MIB));
    printf("via_wrapper_second=%d\n", ((alloc_t)m)(&e, 600 * MIB));
    printf("via_wrapper_free=%d\n", cuMemFree_v2(d));
    return 0;
}
