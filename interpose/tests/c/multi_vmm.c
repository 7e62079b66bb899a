/* VMM memory of one device made accessible from another. Usage: multi_vmm MIB.
 * Retains the primary contexts of devices 0 and 1; with device 0 current, creates MIB MiB on
 * device 1 (prop.location.id = 1; "create <rc>"), reserves an address range, maps the handle
 * and gives both devices read-write access ("mapped <rc>": the first failure or 0), releases
 * the handle ("released <rc>"), copies 4 KiB device to device with cuMemcpyPeer between a
 * device 0 buffer and the mapping ("peer <rc>"), then reports each device's free memory
 * with its context current ("free <d> <bytes>"). Unmaps with device 0 current ("unmapped
 * <rc>") and reports again ("after <d> <bytes>"). Exits 0 unless a context is missing. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "cuda_abi.h"

CUresult cuInit(unsigned int);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
CUresult cuMemCreate(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
CUresult cuMemAddressReserve(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
CUresult cuMemMap(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
CUresult cuMemSetAccess(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
CUresult cuMemRelease(CUmemGenericAllocationHandle);
CUresult cuMemUnmap(CUdeviceptr, size_t);
CUresult cuMemcpyPeer(CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, size_t);

static void report(const char *what, CUcontext *ctx) {
    for (int d = 0; d < 2; d++) {
        size_t f = 0, t = 0;
        cuCtxSetCurrent(ctx[d]);
        cuMemGetInfo_v2(&f, &t);
        printf("%s %d %zu\n", what, d, f);
    }
    cuCtxSetCurrent(ctx[0]);
}

int main(int argc, char **argv) {
    size_t size = (argc > 1 ? strtoull(argv[1], NULL, 10) : 512) << 20;
    setvbuf(stdout, NULL, _IOLBF, 0);
    CUcontext ctx[2];
    if (cuInit(0)) return 1;
    for (int d = 0; d < 2; d++) {
        CUdevice dev;
        if (cuDeviceGet(&dev, d) || cuDevicePrimaryCtxRetain(&ctx[d], dev)) return 1;
    }
    cuCtxSetCurrent(ctx[0]);
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = 1;
    prop.location.type = 1;
    prop.location.id = 1;
    CUmemGenericAllocationHandle h = 0;
    CUresult r = cuMemCreate(&h, size, &prop, 0);
    printf("create %d\n", r);
    if (r) return 0;
    CUdeviceptr va = 0;
    CUmemAccessDesc access[2] = {{{1, 0}, 3}, {{1, 1}, 3}};
    r = cuMemAddressReserve(&va, size, 0, 0, 0);
    if (!r) r = cuMemMap(va, size, 0, h, 0);
    if (!r) r = cuMemSetAccess(va, size, access, 2);
    printf("mapped %d\n", r);
    printf("released %d\n", cuMemRelease(h));
    CUdeviceptr local = 0;
    r = cuMemAlloc_v2(&local, 4096);
    if (!r) r = cuMemcpyPeer(va, ctx[1], local, ctx[0], 4096);
    printf("peer %d\n", r);
    report("free", ctx);
    printf("unmapped %d\n", cuMemUnmap(va, size));
    report("after", ctx);
    return 0;
}
