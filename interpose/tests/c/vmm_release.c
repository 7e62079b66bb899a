/* The VMM idiom with no intent to keep a handle, through the hooked symbols: cuMemCreate ->
 * cuMemAddressReserve -> cuMemMap -> cuMemSetAccess -> cuMemRelease at once, leaving only the
 * mapping to hold the memory. Rounds of argv[1..] MiB each (e.g. 4096 512 512 512); each prints
 * "create <mib> <CUresult>" and, when the create succeeded, "mapped <mib> <CUresult>" (the
 * first failure of reserve, map, set access or release, or 0). Nothing is unmapped. It then
 * prints "done" and waits 10 s, mappings in place, so the backstop can look at it. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "cuda_abi.h"

CUresult cuInit(unsigned int);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemCreate(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
CUresult cuMemAddressReserve(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
CUresult cuMemMap(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
CUresult cuMemSetAccess(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
CUresult cuMemRelease(CUmemGenericAllocationHandle);

int main(int argc, char **argv) {
    CUdevice dev;
    CUcontext ctx;
    if (cuInit(0) || cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(&ctx, dev) || cuCtxSetCurrent(ctx)) {
        fprintf(stderr, "no context\n");
        return 1;
    }
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = 1;
    prop.location.type = 1;
    prop.location.id = dev;
    CUmemAccessDesc access = {{1, dev}, 3};
    for (int i = 1; i < argc; i++) {
        size_t mib = strtoull(argv[i], NULL, 10), size = mib << 20;
        CUmemGenericAllocationHandle h;
        CUdeviceptr va;
        CUresult rc = cuMemCreate(&h, size, &prop, 0);
        printf("create %zu %d\n", mib, rc);
        fflush(stdout);
        if (rc)
            continue;
        rc = cuMemAddressReserve(&va, size, 0, 0, 0);
        if (!rc)
            rc = cuMemMap(va, size, 0, h, 0);
        if (!rc)
            rc = cuMemSetAccess(va, size, &access, 1);
        CUresult released = cuMemRelease(h);
        printf("mapped %zu %d\n", mib, rc ? rc : released);
        fflush(stdout);
    }
    printf("done\n");
    fflush(stdout);
    sleep(10);
    return 0;
}
