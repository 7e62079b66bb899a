"""Shared pieces of the bindings_*.py workloads (NVIDIA's cuda-bindings, CUDA driver API).

`spin(ns)` occupies the GPU for `ns` nanoseconds: on a real GPU the PTX below loops on
%globaltimer; on the simulated GPU (`tessera sim`) every kernel's first u64 parameter is the time
it occupies the engine, whatever its body.
"""
import ctypes
import json
import sys

from cuda.bindings import driver as cu

SUCCESS = cu.CUresult.CUDA_SUCCESS
OOM = cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY
MIB = 1 << 20

PTX = b"""
.version 8.0
.target sm_90
.address_size 64
.visible .entry spin(.param .u64 ns)
{
    .reg .u64 %t0, %t1, %d, %n;
    .reg .pred %p;
    ld.param.u64 %n, [ns];
    mov.u64 %t0, %globaltimer;
WAIT:
    mov.u64 %t1, %globaltimer;
    sub.u64 %d, %t1, %t0;
    setp.lt.u64 %p, %d, %n;
    @%p bra WAIT;
    ret;
}
\0"""


def ok(result):
    """Unpacks a cuda-bindings result tuple, exiting with the error code on failure."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != SUCCESS:
        raise SystemExit(f"CUDA call failed: {err!r}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


def setup():
    """Primary context of device 0; returns (device, the `spin` function, a stream)."""
    ok(cu.cuInit(0))
    dev = ok(cu.cuDeviceGet(0))
    ctx = ok(cu.cuDevicePrimaryCtxRetain(dev))
    ok(cu.cuCtxSetCurrent(ctx))
    mod = ok(cu.cuModuleLoadData(PTX))
    fn = ok(cu.cuModuleGetFunction(mod, b"spin"))
    stream = ok(cu.cuStreamCreate(0))
    return dev, fn, stream


def launch(fn, stream, ns):
    ok(cu.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, stream, ((ns,), (ctypes.c_uint64,)), 0))


def emit(obj):
    print(json.dumps(obj), flush=True)
    sys.stdout.flush()
