/* One process on several devices. Usage: multi_gpu DEVICES CHUNK [HOLD_MS].
 * For each device ordinal d < DEVICES: retains its primary context, makes it current and
 * reports cuMemGetInfo and cuDeviceTotalMem ("dev <d> info <free> <total> <devtotal>"), then
 * allocates CHUNK bytes at a time until refused ("dev <d> got <n> chunks rc <rc>").
 * With device 0 current, reports NVML's total for each NVML device of index d < DEVICES,
 * reached through dlsym as pynvml does ("nvml <d> <total>", -1 when NVML fails).
 * Then holds everything HOLD_MS milliseconds (0 by default; "holding" is printed first).
 * Then, with device 0 current, frees the first chunk of every device ("freed <d> <rc>") and
 * reports each device's free memory again ("dev <d> after <free>"). Prints "peer <rc>" for a
 * cuMemcpyPeer between the first chunks of devices 0 and 1, "done" at the end and exits 0. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include "cuda_abi.h"

CUresult cuInit(unsigned int);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
CUresult cuDeviceTotalMem_v2(size_t *, CUdevice);
CUresult cuMemcpyPeer(CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, size_t);

#define MAXD 8


/* NVML's total memory of device `index`, or -1. */
static long long nvml_total(int index) {
    void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!h) return -1;
    nvml_init_t init = (nvml_init_t)dlsym(h, "nvmlInit_v2");
    nvml_handle_t handle = (nvml_handle_t)dlsym(h, "nvmlDeviceGetHandleByIndex_v2");
    nvml_meminfo_t info = (nvml_meminfo_t)dlsym(h, "nvmlDeviceGetMemoryInfo");
    void *dev = NULL;
    nvml_memory_t m = {0, 0, 0};
    if (!init || !handle || !info || init() != 0 || handle((unsigned)index, &dev) != 0 ||
        info(dev, &m) != 0)
        return -1;
    return (long long)m.total;
}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 2;
    size_t chunk = argc > 2 ? strtoull(argv[2], NULL, 10) : (1u << 30);
    long hold_ms = argc > 3 ? atol(argv[3]) : 0;
    if (n > MAXD) n = MAXD;
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (cuInit(0) != 0) {
        printf("init failed\n");
        return 1;
    }
    CUcontext ctx[MAXD] = {0};
    CUdeviceptr first[MAXD] = {0};
    for (int d = 0; d < n; d++) {
        CUdevice dev = 0;
        CUresult r = cuDeviceGet(&dev, d);
        if (r == 0) r = cuDevicePrimaryCtxRetain(&ctx[d], dev);
        if (r == 0) r = cuCtxSetCurrent(ctx[d]);
        if (r != 0) {
            printf("dev %d context %d\n", d, r);
            continue;
        }
        size_t f = 0, t = 0, dt = 0;
        CUresult ri = cuMemGetInfo_v2(&f, &t);
        CUresult rt = cuDeviceTotalMem_v2(&dt, dev);
        printf("dev %d info %zu %zu %zu rc %d %d\n", d, f, t, dt, ri, rt);
        int got = 0;
        for (;;) {
            CUdeviceptr p = 0;
            r = cuMemAlloc_v2(&p, chunk);
            if (r != 0) break;
            if (got == 0) first[d] = p;
            got++;
            if (got > 100000) break;
        }
        printf("dev %d got %d chunks rc %d\n", d, got, r);
    }
    if (ctx[0]) cuCtxSetCurrent(ctx[0]);
    for (int d = 0; d < n; d++) printf("nvml %d %lld\n", d, nvml_total(d));
    if (hold_ms > 0) {
        printf("holding\n");
        usleep((useconds_t)hold_ms * 1000);
    }
    if (n > 1 && first[0] && first[1])
        printf("peer %d\n", cuMemcpyPeer(first[0], ctx[0], first[1], ctx[1], 4096));
    if (ctx[0]) cuCtxSetCurrent(ctx[0]);
    for (int d = 0; d < n; d++)
        if (first[d]) printf("freed %d %d\n", d, cuMemFree_v2(first[d]));
    for (int d = 0; d < n; d++) {
        if (!ctx[d]) continue;
        cuCtxSetCurrent(ctx[d]);
        size_t f = 0, t = 0;
        cuMemGetInfo_v2(&f, &t);
        printf("dev %d after %zu\n", d, f);
    }
    printf("done\n");
    return 0;
}
