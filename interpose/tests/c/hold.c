/* Holds device memory without the interposer. Usage: hold MIB [SECONDS].
 * Makes a context on device 0, allocates MIB MiB, prints "holding <CUresult>" and sleeps
 * SECONDS (30 by default). Built under other names too: as `nvidia-cuda-mps-server` it stands
 * for NVIDIA's MPS server, one process holding GPU memory that belongs to no allocation (the
 * simulated card has no MPS of its own; what the backstop sees of a real server is the same: a
 * process of that executable on the card, with memory, in no allocation). */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include "cuda_abi.h"

CUresult cuInit(unsigned int);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoull(argv[1], NULL, 10) : 1024;
    unsigned seconds = argc > 2 ? (unsigned)atoi(argv[2]) : 30;
    CUdevice dev = 0;
    CUcontext ctx = NULL;
    CUdeviceptr p = 0;
    CUresult r = cuInit(0);
    if (r == 0) r = cuDeviceGet(&dev, 0);
    if (r == 0) r = cuDevicePrimaryCtxRetain(&ctx, dev);
    if (r == 0) r = cuCtxSetCurrent(ctx);
    if (r == 0) r = cuMemAlloc_v2(&p, mib << 20);
    printf("holding %d\n", (int)r);
    fflush(stdout);
    sleep(seconds);
    return 0;
}
