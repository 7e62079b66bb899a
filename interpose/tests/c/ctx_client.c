/* Contexts count against the limit. Usage: ctx_client CONTEXTS BYTES.
 * Retains the primary context ("primary <rc>"), allocates BYTES in it unless 0 ("alloc <rc>"),
 * then makes CONTEXTS - 1 more, in turn through the linked cuCtxCreate_v2, dlsym's
 * cuCtxCreate_v2 and cuGetProcAddress("cuCtxCreate", 12080), i.e. cuCtxCreate_v4
 * ("create <i> <rc>"); says which object answered each route ("routes ..."), reports the
 * free memory cuMemGetInfo and NVML (reached through dlsym, as pynvml does) give it then
 * ("memfree <bytes>", "nvmlfree <bytes>"), prints "ready" and holds everything until stdin
 * closes, allocating BYTES in the primary context for each line "alloc BYTES" ("got <rc>"). Then it destroys the contexts it made
 * ("destroyed <n> <first failure or 0>"), reports the free memory of the primary context
 * ("free <bytes>") and releases it ("released <rc>"). A refused step stops the making, never
 * the program: it always reaches "ready" and exits 0. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "cuda_abi.h"

CUresult cuInit(unsigned int);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuCtxCreate_v2(CUcontext *, unsigned int, CUdevice);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
CUresult cuGetProcAddress_v2(const char *, void **, int, unsigned long long, int *);

typedef CUresult (*create_v2_t)(CUcontext *, unsigned int, CUdevice);
typedef CUresult (*create_v4_t)(CUcontext *, void *, unsigned int, CUdevice);
typedef CUresult (*destroy_t)(CUcontext);

/* Free memory by NVML, or -1. */
static long long nvml_free(void) {
    void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!h) return -1;
    nvml_init_t init = (nvml_init_t)dlsym(h, "nvmlInit_v2");
    nvml_handle_t handle = (nvml_handle_t)dlsym(h, "nvmlDeviceGetHandleByIndex_v2");
    nvml_meminfo_t info = (nvml_meminfo_t)dlsym(h, "nvmlDeviceGetMemoryInfo");
    void *dev = NULL;
    nvml_memory_t m = {0, 0, 0};
    if (!init || !handle || !info || init() != 0 || handle(0, &dev) != 0 || info(dev, &m) != 0)
        return -1;
    return (long long)m.free;
}

static const char *owner(void *p) {
    Dl_info info;
    if (!p) return "null";
    if (!dladdr(p, &info) || !info.dli_fname) return "unknown";
    return strstr(info.dli_fname, "tessera_interpose") ? "interposer" : "driver";
}

int main(int argc, char **argv) {
    int contexts = argc > 1 ? atoi(argv[1]) : 1;
    size_t bytes = argc > 2 ? strtoull(argv[2], NULL, 10) : 0;
    setvbuf(stdout, NULL, _IOLBF, 0);
    CUdevice dev = 0;
    CUcontext primary = NULL;
    CUresult r = cuInit(0);
    if (r == 0) r = cuDeviceGet(&dev, 0);
    if (r == 0) r = cuDevicePrimaryCtxRetain(&primary, dev);
    printf("primary %d\n", r);
    int have_primary = r == 0;
    if (have_primary) cuCtxSetCurrent(primary);
    if (have_primary && bytes > 0) {
        CUdeviceptr p = 0;
        printf("alloc %d\n", cuMemAlloc_v2(&p, bytes));
    }

    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    create_v2_t via_dlsym = h ? (create_v2_t)dlsym(h, "cuCtxCreate_v2") : NULL;
    destroy_t destroy = h ? (destroy_t)dlsym(h, "cuCtxDestroy_v2") : NULL;
    void *v4 = NULL;
    int status = -1;
    cuGetProcAddress_v2("cuCtxCreate", &v4, 12080, 0, &status);
    printf("routes dlsym=%s gpa=%s destroy=%s\n", owner((void *)via_dlsym), owner(v4),
           owner((void *)destroy));

    CUcontext *made = calloc(contexts > 0 ? contexts : 1, sizeof(CUcontext));
    int n = 0;
    for (int i = 1; have_primary && i < contexts; i++) {
        CUcontext c = NULL;
        switch (i % 3) {
        case 0: r = cuCtxCreate_v2(&c, 0, dev); break;
        case 1: r = via_dlsym ? via_dlsym(&c, 0, dev) : -1; break;
        default: r = v4 ? ((create_v4_t)v4)(&c, NULL, 0, dev) : -1; break;
        }
        printf("create %d %d\n", i, r);
        if (r != 0) break;
        made[n++] = c;
    }
    if (have_primary) {
        cuCtxSetCurrent(primary);
        size_t free_bytes = 0, total = 0;
        cuMemGetInfo_v2(&free_bytes, &total);
        printf("memfree %zu\n", free_bytes);
        printf("nvmlfree %lld\n", nvml_free());
    }
    printf("ready\n");

    char line[128];
    while (fgets(line, sizeof line, stdin)) {
        unsigned long long more = 0;
        if (have_primary && sscanf(line, "alloc %llu", &more) == 1) {
            CUdeviceptr p = 0;
            cuCtxSetCurrent(primary);
            printf("got %d\n", cuMemAlloc_v2(&p, (size_t)more));
        }
    }

    CUresult first = 0;
    for (int i = 0; i < n; i++) {
        CUresult d = destroy ? destroy(made[i]) : -1;
        if (d != 0 && first == 0) first = d;
    }
    printf("destroyed %d %d\n", n, first);
    if (have_primary) {
        cuCtxSetCurrent(primary);
        size_t free_bytes = 0, total = 0;
        cuMemGetInfo_v2(&free_bytes, &total);
        printf("free %zu\n", free_bytes);
        printf("released %d\n", cuDevicePrimaryCtxRelease_v2(dev));
    }
    return 0;
}
