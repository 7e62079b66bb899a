/* A library that reaches the driver from inside: linked against libcuda.so.1, it exports
 * deepbind_alloc(mib), which calls cuMemAlloc_v2 for mib MiB and returns the CUresult. Loaded
 * with RTLD_DEEPBIND its references bind to its own dependencies (the real libcuda.so.1) before
 * the global scope, where the LD_PRELOAD interposer sits. Built by tests::common::build_c_lib. */
#include <stddef.h>
#include "cuda_abi.h"

CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);

int deepbind_alloc(size_t mib) {
    CUdeviceptr p;
    return cuMemAlloc_v2(&p, mib << 20);
}
