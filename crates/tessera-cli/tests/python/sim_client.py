"""A real CUDA client (NVIDIA's cuda-bindings, unmodified) exercising the simulated driver.

Run under `tessera sim`; prints one JSON line of measurements and exits 0 when every check held.
"""
import ctypes
import json
import sys
import time

from cuda.bindings import driver as cu

PTX = b"""
.version 8.0
.target sm_90
.address_size 64
.visible .entry spin(.param .u64 ns)
{
    ret;
}
.visible .entry other()
{
    ret;
}
\0"""


def ok(result):
    """Unpacks a cuda-bindings result tuple, failing loudly on an error code."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise SystemExit(f"CUDA call failed: {err!r}")
    return rest[0] if len(rest) == 1 else tuple(rest)


def launch(fn, stream, ns):
    ok(cu.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, stream, ((ns,), (ctypes.c_uint64,)), 0))


def main():
    gib = 1 << 30
    err, _ = cu.cuDeviceGetCount()
    assert err == cu.CUresult.CUDA_ERROR_NOT_INITIALIZED, err
    ok(cu.cuInit(0))
    err, _ = cu.cuMemAlloc(1024)
    assert err == cu.CUresult.CUDA_ERROR_INVALID_CONTEXT, err
    version = ok(cu.cuDriverGetVersion())
    count = ok(cu.cuDeviceGetCount())
    devices = []
    for i in range(count):
        dev = ok(cu.cuDeviceGet(i))
        name = ok(cu.cuDeviceGetName(64, dev)).split(b"\0")[0].decode()
        total = ok(cu.cuDeviceTotalMem(dev))
        major = ok(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))
        devices.append({"name": name, "total": total, "major": major})
    dev = ok(cu.cuDeviceGet(0))
    ctx = ok(cu.cuDevicePrimaryCtxRetain(dev))
    ok(cu.cuCtxSetCurrent(ctx))

    free0, total0 = ok(cu.cuMemGetInfo())
    dptr = ok(cu.cuMemAlloc(3 * gib))
    free1, _ = ok(cu.cuMemGetInfo())
    assert free0 - free1 == 3 * gib, (free0, free1)

    # Real bytes round-trip through device memory.
    src = (ctypes.c_ubyte * 4096)(*([7] * 4096))
    dst = (ctypes.c_ubyte * 4096)()
    ok(cu.cuMemcpyHtoD(dptr, src, 4096))
    ok(cu.cuMemcpyDtoH(dst, dptr, 4096))
    assert bytes(dst) == bytes(src)
    ok(cu.cuMemFree(dptr))
    free2, _ = ok(cu.cuMemGetInfo())
    assert free2 == free0, (free0, free2)

    # A nearly full 80 GiB card works on a small host: memory is only reserved, never touched.
    big = ok(cu.cuMemAlloc(total0 - gib))
    ok(cu.cuMemsetD32(big, 0xABCD, 1024))
    ok(cu.cuMemcpyDtoH(dst, big, 4096))
    assert bytes(dst[:4]) == (0xABCD).to_bytes(4, "little")
    err, _ = cu.cuMemAlloc(2 * gib)
    assert err == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY, err
    ok(cu.cuMemFree(big))
    err, = cu.cuMemFree(big)
    assert err == cu.CUresult.CUDA_ERROR_INVALID_VALUE, err

    # Bad use answers error codes, not crashes.
    err, _ = cu.cuMemAlloc(total0 + 1)
    assert err == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY, err
    err, _, status = cu.cuGetProcAddress(b"cuNoSuchFunction", 13000, 0)
    assert err == cu.CUresult.CUDA_ERROR_NOT_FOUND, err

    mod = ok(cu.cuModuleLoadData(PTX))
    spin = ok(cu.cuModuleGetFunction(mod, b"spin"))
    err, _ = cu.cuModuleGetFunction(mod, b"missing")
    assert err == cu.CUresult.CUDA_ERROR_NOT_FOUND, err

    s1 = ok(cu.cuStreamCreate(0))
    s2 = ok(cu.cuStreamCreate(0))
    events = [ok(cu.cuEventCreate(0)) for _ in range(4)]
    ns1, ns2 = 150_000_000, 250_000_000
    t0 = time.monotonic()
    ok(cu.cuEventRecord(events[0], s1))
    launch(spin, s1, ns1)
    ok(cu.cuEventRecord(events[1], s1))
    ok(cu.cuEventRecord(events[2], s2))
    launch(spin, s2, ns2)
    ok(cu.cuEventRecord(events[3], s2))
    submit_s = time.monotonic() - t0
    err, = cu.cuStreamQuery(s2)
    assert err == cu.CUresult.CUDA_ERROR_NOT_READY, err
    ok(cu.cuStreamSynchronize(s1))
    ok(cu.cuStreamSynchronize(s2))
    wall_s = time.monotonic() - t0
    ms1 = ok(cu.cuEventElapsedTime(events[0], events[1]))
    ms2 = ok(cu.cuEventElapsedTime(events[2], events[3]))
    # One engine: the two streams' kernels ran one after the other.
    assert wall_s >= (ns1 + ns2) / 1e9 * 0.95, wall_s
    assert ms1 >= ns1 / 1e6 * 0.99 and ms2 >= ns2 / 1e6 * 0.99, (ms1, ms2)
    # Alone on the engine, events time a kernel at its requested length.
    ns3 = 200_000_000
    ok(cu.cuEventRecord(events[0], s1))
    launch(spin, s1, ns3)
    ok(cu.cuEventRecord(events[1], s1))
    ok(cu.cuEventSynchronize(events[1]))
    ms3 = ok(cu.cuEventElapsedTime(events[0], events[1]))
    assert ns3 / 1e6 <= ms3 <= ns3 / 1e6 + 40, ms3
    ok(cu.cuCtxSynchronize())
    for ev in events:
        ok(cu.cuEventDestroy(ev))
    ok(cu.cuStreamDestroy(s1))
    ok(cu.cuStreamDestroy(s2))
    ok(cu.cuModuleUnload(mod))
    ok(cu.cuDevicePrimaryCtxRelease(dev))
    print(json.dumps({
        "driver_version": version,
        "devices": devices,
        "free_before": free0,
        "total": total0,
        "submit_s": submit_s,
        "wall_s": wall_s,
        "kernel_ms": [ms1, ms2, ms3],
        "expected_ms": [ns1 / 1e6, ns2 / 1e6, ns3 / 1e6],
    }))


if __name__ == "__main__":
    sys.exit(main())
