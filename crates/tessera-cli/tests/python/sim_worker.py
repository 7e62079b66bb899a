"""Helper for the simulator's multi-process tests (cuda-bindings, unmodified).

usage: sim_worker.py ALLOC_BYTES KERNEL_NS KERNELS [WAIT_FOR_USED_BYTES] [hold]
Allocates, prints `ready PID`, optionally waits until the device shows WAIT_FOR_USED_BYTES in
use (another process's memory), runs KERNELS kernels of KERNEL_NS on one stream, prints
`done SECONDS`, and with `hold` sleeps until killed.
"""
import ctypes
import sys
import time

from cuda.bindings import driver as cu


def ok(result):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise SystemExit(f"CUDA call failed: {err!r}")
    return rest[0] if len(rest) == 1 else tuple(rest)


PTX = b".version 8.0\n.target sm_90\n.visible .entry spin(.param .u64 ns) { ret; }\n\0"


def main():
    alloc, ns, kernels = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    wait_used = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    hold = len(sys.argv) > 5 and sys.argv[5] == "hold"
    ok(cu.cuInit(0))
    dev = ok(cu.cuDeviceGet(0))
    ctx = ok(cu.cuDevicePrimaryCtxRetain(dev))
    ok(cu.cuCtxSetCurrent(ctx))
    ptr = ok(cu.cuMemAlloc(alloc)) if alloc else None
    print(f"ready {__import__('os').getpid()}", flush=True)
    deadline = time.monotonic() + 30
    while wait_used:
        free, total = ok(cu.cuMemGetInfo())
        if total - free >= wait_used:
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"never saw {wait_used} bytes in use (saw {total - free})")
        time.sleep(0.01)
    mod = ok(cu.cuModuleLoadData(PTX))
    fn = ok(cu.cuModuleGetFunction(mod, b"spin"))
    stream = ok(cu.cuStreamCreate(0))
    t0 = time.monotonic()
    for _ in range(kernels):
        ok(cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, stream, ((ns,), (ctypes.c_uint64,)), 0))
    ok(cu.cuStreamSynchronize(stream))
    print(f"done {time.monotonic() - t0:.3f}", flush=True)
    while hold:
        time.sleep(1)
    if ptr is not None:
        ok(cu.cuMemFree(ptr))


if __name__ == "__main__":
    main()
