/* What the kernel-launching test clients share (no cuda.h needed): the few driver declarations
 * they use and the `spin` kernel, whose only parameter is the nanoseconds it occupies the
 * simulated GPU's engine. */
#ifndef SPIN_CLIENT_H
#define SPIN_CLIENT_H

#include "cuda_abi.h"

CUresult cuInit(unsigned int);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuCtxSynchronize(void);
CUresult cuModuleLoadData(CUmodule *, const void *);
CUresult cuModuleGetFunction(CUfunction *, CUmodule, const char *);

static const char SPIN_PTX[] = ".version 8.0\n.target sm_90\n.address_size 64\n"
                               ".visible .entry spin(.param .u64 ns)\n{\n    ret;\n}\n";

/* Device 0's primary context made current, and the `spin` kernel loaded; 0 on success. */
static int spin_setup(CUcontext *ctx, CUfunction *fn) {
    CUdevice dev;
    CUmodule mod;
    return cuInit(0) || cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(ctx, dev) || cuCtxSetCurrent(*ctx) ||
           cuModuleLoadData(&mod, SPIN_PTX) || cuModuleGetFunction(fn, mod, "spin");
}

#endif
