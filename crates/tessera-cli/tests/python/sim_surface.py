"""The simulated driver's wider surface, driven by NVIDIA's cuda-bindings (unmodified).

usage: sim_surface.py SECTION   (run under `tessera sim`)

Each section checks one area of the driver API and prints one JSON line of measurements; the
Rust test (tests/it/sim_surface.rs) checks those too. Any failed check exits non-zero with the
reason. Raw entry points (to pass NULL, or to call `_ptsz` variants) are taken from
cuGetProcAddress and called through ctypes, as a C client would.
"""
import ctypes
import json
import os
import subprocess
import sys
import threading
import time

from cuda.bindings import driver as cu

R = cu.CUresult
MIB = 1 << 20

PTX = b"""
.version 8.0
.target sm_90
.address_size 64
.visible .entry spin(.param .u64 ns)
{
    ret;
}
\0"""


def ok(result):
    """Unpacks a cuda-bindings result tuple, failing loudly on an error code."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != R.CUDA_SUCCESS:
        raise SystemExit(f"CUDA call failed: {err!r}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


def code(result):
    """The CUresult of a call, as an int."""
    err = result[0] if isinstance(result, tuple) else result
    return int(err)


def expect(result, want, what):
    got = code(result)
    if got != int(want):
        raise SystemExit(f"{what}: expected {int(want)}, got {got}")


def check(cond, what):
    if not cond:
        raise SystemExit(f"check failed: {what}")


def raw(name, restype, *argtypes, version=13000, flags=0):
    """A driver entry point resolved by cuGetProcAddress, callable through ctypes."""
    err, pfn, _status = cu.cuGetProcAddress(name.encode(), version, flags)
    check(err == R.CUDA_SUCCESS and int(pfn) != 0, f"cuGetProcAddress({name}, {version}, {flags}): {err!r}")
    return ctypes.CFUNCTYPE(restype, *argtypes)(int(pfn))


def setup(dev_index=0):
    ok(cu.cuInit(0))
    dev = ok(cu.cuDeviceGet(dev_index))
    ctx = ok(cu.cuDevicePrimaryCtxRetain(dev))
    ok(cu.cuCtxSetCurrent(ctx))
    return dev, ctx


def used():
    free, total = ok(cu.cuMemGetInfo())
    return total - free


OBSERVER = """
from cuda.bindings import driver as cu
cu.cuInit(0)
_, dev = cu.cuDeviceGet(0)
_, ctx = cu.cuDevicePrimaryCtxRetain(dev)
cu.cuCtxSetCurrent(ctx)
err, free, total = cu.cuMemGetInfo()
assert err == cu.CUresult.CUDA_SUCCESS, err
print(total - free)
"""


def used_seen_by_another_process():
    """Device memory in use as cuMemGetInfo_v2 reports it in a fresh process."""
    out = subprocess.run([sys.executable, "-c", OBSERVER], capture_output=True, text=True, timeout=30)
    check(out.returncode == 0, f"observer failed: {out.stderr}")
    return int(out.stdout.strip())


def spin_function():
    mod = ok(cu.cuModuleLoadData(PTX))
    return mod, ok(cu.cuModuleGetFunction(mod, b"spin"))


def launch(fn, stream, ns):
    ok(cu.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, stream, ((ns,), (ctypes.c_uint64,)), 0))


def elapsed_ms(e0, e1):
    ok(cu.cuEventSynchronize(e1))
    return ok(cu.cuEventElapsedTime(e0, e1))


def host_bytes(n, seed):
    return (ctypes.c_ubyte * n)(*[(i * 31 + seed) % 251 for i in range(n)])


# ---------------------------------------------------------------------------------------------

def vmm():
    dev, _ = setup()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    gran = ok(cu.cuMemGetAllocationGranularity(
        prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
    check(gran > 0 and gran & (gran - 1) == 0, f"granularity {gran} is a power of two")
    size = 4 * gran
    base = used()
    seen_before = used_seen_by_another_process()

    h = ok(cu.cuMemCreate(size, prop, 0))
    check(used() - base == size, "cuMemCreate is charged at once")
    seen_created = used_seen_by_another_process()
    check(seen_created - seen_before == size, f"another process sees the handle: {seen_created}")

    ptr = ok(cu.cuMemAddressReserve(size, 0, 0, 0))
    check(int(ptr) % gran == 0, "reservation is aligned to the granularity")
    check(used() - base == size, "reserving address space costs no device memory")
    ok(cu.cuMemMap(ptr, size, 0, h, 0))
    n = 256 * 1024
    src = host_bytes(n, 3)
    back = (ctypes.c_ubyte * n)()
    # Mapped but not yet accessible: an error, not a fault in the host process.
    expect(cu.cuMemcpyHtoD(ptr, src, n), R.CUDA_ERROR_INVALID_VALUE, "a copy before cuMemSetAccess")
    desc = cu.CUmemAccessDesc()
    desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = 0
    desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
    ok(cu.cuMemSetAccess(ptr, size, [desc], 1))
    expect(cu.cuMemcpyHtoD(ptr, src, n), R.CUDA_ERROR_INVALID_VALUE, "a write to a read-only mapping")
    desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    ok(cu.cuMemSetAccess(ptr, size, [desc], 1))

    # Bytes round-trip through the mapped range, at its start and across its last page.
    ok(cu.cuMemcpyHtoD(ptr, src, n))
    ok(cu.cuMemcpyDtoH(back, ptr, n))
    check(bytes(back) == bytes(src), "HtoD/DtoH round trip at the start of the mapping")
    tail = cu.CUdeviceptr(int(ptr) + size - n)
    ok(cu.cuMemsetD8(tail, 0x5A, n))
    ok(cu.cuMemcpyDtoH(back, tail, n))
    check(bytes(back) == b"\x5a" * n, "memset + DtoH at the end of the mapping")
    err, = cu.cuMemcpyHtoD(cu.CUdeviceptr(int(ptr) + size - 16), src, 32)
    check(err == R.CUDA_ERROR_INVALID_VALUE, f"a copy past the mapping is refused: {err!r}")

    # The same physical memory mapped at a second address shows the same bytes.
    ptr2 = ok(cu.cuMemAddressReserve(size, 0, 0, 0))
    ok(cu.cuMemMap(ptr2, size, 0, h, 0))
    ok(cu.cuMemSetAccess(ptr2, size, [desc], 1))
    ok(cu.cuMemcpyDtoH(back, ptr2, n))
    check(bytes(back) == bytes(src), "a second mapping aliases the same physical memory")
    check(used() - base == size, "a second mapping costs nothing")
    ok(cu.cuMemUnmap(ptr2, size))
    ok(cu.cuMemAddressFree(ptr2, size))

    ok(cu.cuMemUnmap(ptr, size))
    err, = cu.cuMemcpyHtoD(ptr, src, 16)
    check(err == R.CUDA_ERROR_INVALID_VALUE, f"an unmapped range is not device memory: {err!r}")
    ok(cu.cuMemAddressFree(ptr, size))
    check(used() - base == size, "unmapping does not release the physical memory")
    ok(cu.cuMemRelease(h))
    check(used() == base, "cuMemRelease returns the memory")
    seen_released = used_seen_by_another_process()
    check(seen_released == seen_before, f"another process sees it returned: {seen_released}")

    # Two handles mapped back to back form one range: a copy crosses the seam.
    ha, hb = ok(cu.cuMemCreate(gran, prop, 0)), ok(cu.cuMemCreate(gran, prop, 0))
    ptr = ok(cu.cuMemAddressReserve(2 * gran, 0, 0, 0))
    ok(cu.cuMemMap(ptr, gran, 0, ha, 0))
    expect(cu.cuMemSetAccess(ptr, 2 * gran, [desc], 1), R.CUDA_ERROR_INVALID_VALUE, "access to a half-mapped range")
    ok(cu.cuMemMap(cu.CUdeviceptr(int(ptr) + gran), gran, 0, hb, 0))
    ok(cu.cuMemSetAccess(ptr, 2 * gran, [desc], 1))
    seam = cu.CUdeviceptr(int(ptr) + gran - n // 2)
    ok(cu.cuMemcpyHtoD(seam, src, n))
    ok(cu.cuMemcpyDtoH(back, seam, n))
    check(bytes(back) == bytes(src), "a copy across two mappings round-trips")
    check(used() - base == 2 * gran, "two handles charged")
    ok(cu.cuMemUnmap(ptr, 2 * gran))
    ok(cu.cuMemRelease(ha))
    ok(cu.cuMemRelease(hb))
    ok(cu.cuMemAddressFree(ptr, 2 * gran))
    check(used() == base, "both returned")

    # Released while still mapped: the memory stays charged (and usable) until unmapped.
    h = ok(cu.cuMemCreate(size, prop, 0))
    ptr = ok(cu.cuMemAddressReserve(size, 0, 0, 0))
    ok(cu.cuMemMap(ptr, size, 0, h, 0))
    ok(cu.cuMemSetAccess(ptr, size, [desc], 1))
    ok(cu.cuMemcpyHtoD(ptr, src, n))
    ok(cu.cuMemRelease(h))
    check(used() - base == size, "a released but mapped handle stays charged")
    ok(cu.cuMemcpyDtoH(back, ptr, n))
    check(bytes(back) == bytes(src), "a released but mapped handle keeps its bytes")
    ok(cu.cuMemUnmap(ptr, size))
    check(used() == base, "the last unmap of a released handle returns the memory")
    ok(cu.cuMemAddressFree(ptr, size))

    # Bad use.
    expect(cu.cuMemCreate(gran + 1, prop, 0), R.CUDA_ERROR_INVALID_VALUE, "size not a granularity multiple")
    bad = cu.CUmemAllocationProp()
    bad.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    bad.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    bad.location.id = 7
    expect(cu.cuMemCreate(gran, bad, 0), R.CUDA_ERROR_INVALID_DEVICE, "cuMemCreate on a missing device")
    h = ok(cu.cuMemCreate(gran, prop, 0))
    ptr = ok(cu.cuMemAddressReserve(gran, 0, 0, 0))
    expect(cu.cuMemMap(ptr, gran, 0, 0xBAD0, 0), R.CUDA_ERROR_INVALID_VALUE, "cuMemMap of an unknown handle")
    expect(cu.cuMemMap(ptr, 2 * gran, 0, h, 0), R.CUDA_ERROR_INVALID_VALUE, "cuMemMap past the reservation")
    ok(cu.cuMemMap(ptr, gran, 0, h, 0))
    expect(cu.cuMemMap(ptr, gran, 0, h, 0), R.CUDA_ERROR_INVALID_VALUE, "cuMemMap over a mapped range")
    ok(cu.cuMemUnmap(ptr, gran))
    expect(cu.cuMemAddressFree(ptr, 2 * gran), R.CUDA_ERROR_INVALID_VALUE, "cuMemAddressFree with a wrong size")
    ok(cu.cuMemAddressFree(ptr, gran))
    expect(cu.cuMemAddressFree(ptr, gran), R.CUDA_ERROR_INVALID_VALUE, "cuMemAddressFree twice")
    ok(cu.cuMemRelease(h))
    expect(cu.cuMemRelease(h), R.CUDA_ERROR_INVALID_VALUE, "cuMemRelease twice")
    check(used() == base, "bad use loses nothing")
    return {"granularity": gran, "size": size, "seen_before": seen_before,
            "seen_created": seen_created, "seen_released": seen_released}


def pitch_managed():
    dev, _ = setup()
    align = ok(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT, dev))
    base = used()
    pitches = {}
    for width in (1, 100, 512, 513, 1000, 4096):
        height = 10
        ptr, pitch = ok(cu.cuMemAllocPitch(width, height, 4))
        check(pitch >= width, f"pitch {pitch} >= width {width}")
        check(pitch % 512 == 0 and pitch % align == 0, f"pitch {pitch} is a multiple of 512 and {align}")
        check(pitch < width + 512, f"pitch {pitch} is the next multiple of 512 after {width}")
        check(used() - base == pitch * height, f"charged pitch x height for width {width}")
        # The whole pitch x height range is addressable.
        n = pitch * height
        src = host_bytes(n, width)
        back = (ctypes.c_ubyte * n)()
        ok(cu.cuMemcpyHtoD(ptr, src, n))
        ok(cu.cuMemcpyDtoH(back, ptr, n))
        check(bytes(back) == bytes(src), "pitched memory round-trips")
        ok(cu.cuMemFree(ptr))
        pitches[width] = pitch
    for elem in (1, 2, 3, 32):
        expect(cu.cuMemAllocPitch(64, 4, elem), R.CUDA_ERROR_INVALID_VALUE, f"element size {elem}")
    expect(cu.cuMemAllocPitch(0, 4, 4), R.CUDA_ERROR_INVALID_VALUE, "zero width")
    expect(cu.cuMemAllocPitch(64, 0, 4), R.CUDA_ERROR_INVALID_VALUE, "zero height")
    check(used() == base, "pitch allocations all returned")

    # Managed memory: charged to the device, and the host reads and writes it directly.
    n = 3 * MIB
    m = ok(cu.cuMemAllocManaged(n, cu.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL.value))
    check(used() - base == n, "managed memory is charged to the device")
    ctypes.memset(int(m), 0x42, n)
    back = (ctypes.c_ubyte * 64)()
    ok(cu.cuMemcpyDtoH(back, cu.CUdeviceptr(int(m) + n - 64), 64))
    check(bytes(back) == b"\x42" * 64, "host writes to managed memory are seen by copies")
    ok(cu.cuMemsetD32(m, 0x01020304, 4))
    check(ctypes.string_at(int(m), 4) == bytes([4, 3, 2, 1]), "device memsets are seen by the host")
    is_managed = ok(cu.cuPointerGetAttribute(cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_MANAGED, m))
    check(bool(is_managed), "CU_POINTER_ATTRIBUTE_IS_MANAGED")
    m2 = ok(cu.cuMemAllocManaged(MIB, cu.CUmemAttach_flags.CU_MEM_ATTACH_HOST.value))
    ok(cu.cuMemFree(m2))
    expect(cu.cuMemAllocManaged(MIB, 0), R.CUDA_ERROR_INVALID_VALUE, "managed with flags 0")
    expect(cu.cuMemAllocManaged(0, 1), R.CUDA_ERROR_INVALID_VALUE, "managed of 0 bytes")
    ok(cu.cuMemFree(m))
    expect(cu.cuMemFree(m), R.CUDA_ERROR_INVALID_VALUE, "managed freed twice")
    check(used() == base, "managed memory returned")
    return {"pitches": pitches, "texture_alignment": align}


def async_pools():
    dev, _ = setup()
    _, spin = spin_function()
    s = ok(cu.cuStreamCreate(0))
    base = used()

    # Stream-ordered free: the memory comes back when the stream reaches the free.
    n = 64 * MIB
    # Timed from the launch: the kernel alone holds the stream for 0.3 s, whatever the load.
    t0 = time.monotonic()
    launch(spin, s, 300_000_000)
    p = ok(cu.cuMemAllocAsync(n, s))
    check(used() - base == n, "cuMemAllocAsync is charged at once")
    ok(cu.cuMemsetD8Async(p, 7, n, s))
    ok(cu.cuMemFreeAsync(p, s))
    check(code(cu.cuStreamQuery(s)) == R.CUDA_ERROR_NOT_READY, "the kernel is still running")
    held = used() - base
    check(held == n, f"not freed before the stream gets there ({held})")
    ok(cu.cuStreamSynchronize(s))
    waited = time.monotonic() - t0
    check(used() == base, "freed once the stream reached cuMemFreeAsync")
    check(waited >= 0.29, f"the free waited for the kernel ({waited:.3f} s)")
    expect(cu.cuMemFreeAsync(cu.CUdeviceptr(0x1234000), s), R.CUDA_ERROR_INVALID_VALUE, "freeing a non-allocation")

    # Per-thread default stream handle and the legacy handle work too.
    p = ok(cu.cuMemAllocAsync(MIB, cu.CUstream(cu.CU_STREAM_PER_THREAD)))
    ok(cu.cuMemFreeAsync(p, cu.CUstream(cu.CU_STREAM_PER_THREAD)))
    ok(cu.cuStreamSynchronize(cu.CUstream(cu.CU_STREAM_PER_THREAD)))
    check(used() == base, "per-thread stream free")

    # Pools.
    default = ok(cu.cuDeviceGetDefaultMemPool(dev))
    current = ok(cu.cuDeviceGetMemPool(dev))
    check(int(default) == int(current) != 0, "the current pool is the default pool")
    props = cu.CUmemPoolProps()
    props.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    props.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    props.location.id = 0
    pool = ok(cu.cuMemPoolCreate(props))
    check(int(pool) != int(default), "a created pool is a new pool")
    attr_used = cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_USED_MEM_CURRENT
    q = ok(cu.cuMemAllocFromPoolAsync(32 * MIB, pool, s))
    r = ok(cu.cuMemAllocFromPoolAsync(8 * MIB, default, s))
    check(used() - base == 40 * MIB, "pool allocations are charged")
    check(int(ok(cu.cuMemPoolGetAttribute(pool, attr_used))) == 32 * MIB, "pool reports its use")
    check(int(ok(cu.cuMemPoolGetAttribute(default, attr_used))) == 8 * MIB, "default pool reports its use")
    src = host_bytes(4096, 9)
    back = (ctypes.c_ubyte * 4096)()
    ok(cu.cuMemcpyHtoDAsync(q, src, 4096, s))
    ok(cu.cuMemcpyDtoHAsync(back, q, 4096, s))
    ok(cu.cuStreamSynchronize(s))
    check(bytes(back) == bytes(src), "pool memory round-trips")
    ok(cu.cuMemFreeAsync(q, s))
    ok(cu.cuMemFreeAsync(r, s))
    ok(cu.cuStreamSynchronize(s))
    check(used() == base, "pool allocations returned")
    check(int(ok(cu.cuMemPoolGetAttribute(pool, attr_used))) == 0, "pool use back to 0")
    ok(cu.cuMemPoolTrimTo(pool, 0))
    ok(cu.cuMemPoolDestroy(pool))
    expect(cu.cuMemPoolDestroy(pool), R.CUDA_ERROR_INVALID_VALUE, "pool destroyed twice")
    expect(cu.cuMemAllocFromPoolAsync(MIB, pool, s), R.CUDA_ERROR_INVALID_VALUE, "allocating from a destroyed pool")
    bad = cu.CUmemPoolProps()
    bad.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    bad.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    bad.location.id = 9
    check(code(cu.cuMemPoolCreate(bad)) != 0, "a pool on a missing device is refused")
    check(used() == base, "nothing lost")
    ok(cu.cuStreamDestroy(s))
    return {"waited_s": waited}


def arrays():
    setup()
    base = used()
    F = cu.CUarray_format

    def d2(w, h, fmt, ch):
        d = cu.CUDA_ARRAY_DESCRIPTOR()
        d.Width, d.Height, d.Format, d.NumChannels = w, h, fmt, ch
        return d

    def d3(w, h, depth, fmt, ch, flags=0):
        d = cu.CUDA_ARRAY3D_DESCRIPTOR()
        d.Width, d.Height, d.Depth, d.Format, d.NumChannels, d.Flags = w, h, depth, fmt, ch, flags
        return d

    sizes = {}
    cases = [
        ("2d_float4", lambda: cu.cuArrayCreate(d2(1000, 100, F.CU_AD_FORMAT_FLOAT, 4)), 1000 * 100 * 16),
        ("1d_u8", lambda: cu.cuArrayCreate(d2(4096, 0, F.CU_AD_FORMAT_UNSIGNED_INT8, 1)), 4096),
        ("2d_half2", lambda: cu.cuArrayCreate(d2(300, 200, F.CU_AD_FORMAT_HALF, 2)), 300 * 200 * 4),
        ("3d_float", lambda: cu.cuArray3DCreate(d3(64, 64, 64, F.CU_AD_FORMAT_FLOAT, 1)), 64 ** 3 * 4),
        ("layered_u16x2", lambda: cu.cuArray3DCreate(d3(256, 256, 4, F.CU_AD_FORMAT_UNSIGNED_INT16, 2, 1)),
         256 * 256 * 4 * 2 * 2),
    ]
    for name, make, want in cases:
        a = ok(make())
        sizes[name] = used() - base
        check(sizes[name] == want, f"{name}: charged {sizes[name]}, expected {want}")
        ok(cu.cuArrayDestroy(a))
        check(used() == base, f"{name}: returned")
        expect(cu.cuArrayDestroy(a), R.CUDA_ERROR_INVALID_HANDLE, f"{name}: destroyed twice")

    # Mipmapped: every level, halving each dimension down to 1; levels are clamped to what exists.
    full = sum((256 >> l) * (256 >> l) * 4 for l in range(9))
    for levels, want in ((1, 256 * 256 * 4), (3, sum((256 >> l) ** 2 * 4 for l in range(3))), (9, full), (20, full)):
        m = ok(cu.cuMipmappedArrayCreate(d3(256, 256, 0, F.CU_AD_FORMAT_FLOAT, 1), levels))
        got = used() - base
        check(got == want, f"mipmapped {levels} levels: charged {got}, expected {want}")
        sizes[f"mip_{levels}"] = got
        expect(cu.cuArrayDestroy(cu.CUarray(int(m))), R.CUDA_ERROR_INVALID_HANDLE,
               "cuArrayDestroy of a mipmapped array")
        ok(cu.cuMipmappedArrayDestroy(m))
        check(used() == base, "mipmapped array returned")
        expect(cu.cuMipmappedArrayDestroy(m), R.CUDA_ERROR_INVALID_HANDLE, "mipmapped destroyed twice")
    a = ok(cu.cuArrayCreate(d2(16, 16, F.CU_AD_FORMAT_FLOAT, 1)))
    expect(cu.cuMipmappedArrayDestroy(cu.CUmipmappedArray(int(a))), R.CUDA_ERROR_INVALID_HANDLE,
           "cuMipmappedArrayDestroy of a plain array")
    ok(cu.cuArrayDestroy(a))

    expect(cu.cuArrayCreate(d2(16, 16, F.CU_AD_FORMAT_FLOAT, 3)), R.CUDA_ERROR_INVALID_VALUE, "3 channels")
    expect(cu.cuArrayCreate(d2(0, 16, F.CU_AD_FORMAT_FLOAT, 1)), R.CUDA_ERROR_INVALID_VALUE, "zero width")
    expect(cu.cuArray3DCreate(d3(16, 0, 16, F.CU_AD_FORMAT_FLOAT, 1)), R.CUDA_ERROR_INVALID_VALUE,
           "depth without height")
    expect(cu.cuArrayDestroy(cu.CUarray(0xBAD0)), R.CUDA_ERROR_INVALID_HANDLE, "unknown array")
    check(used() == base, "nothing lost")
    return {"sizes": sizes}


def graphs():
    setup()
    _, spin = spin_function()
    s = ok(cu.cuStreamCreate(0))
    e0, e1 = ok(cu.cuEventCreate(0)), ok(cu.cuEventCreate(0))
    kernels_ns = 0

    # Stream capture: launches are recorded, not run.
    mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL
    t0 = time.monotonic()
    ok(cu.cuStreamBeginCapture(s, mode))
    status = ok(cu.cuStreamIsCapturing(s))
    check(status == cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE, f"capturing: {status!r}")
    for _ in range(3):
        launch(spin, s, 100_000_000)
    graph = ok(cu.cuStreamEndCapture(s))
    capture_s = time.monotonic() - t0
    check(capture_s < 0.1, f"captured kernels do not run ({capture_s:.3f} s)")
    status = ok(cu.cuStreamIsCapturing(s))
    check(status == cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE, "capture ended")
    exe = ok(cu.cuGraphInstantiate(graph, 0))

    ok(cu.cuEventRecord(e0, s))
    t0 = time.monotonic()
    ok(cu.cuGraphLaunch(exe, s))
    launch_s = time.monotonic() - t0
    ok(cu.cuEventRecord(e1, s))
    captured_ms = elapsed_ms(e0, e1)
    kernels_ns += 300_000_000
    check(launch_s < 0.1, f"cuGraphLaunch returns at once ({launch_s:.3f} s)")
    check(300 <= captured_ms < 400, f"3 x 100 ms captured kernels took {captured_ms} ms")

    # Launched twice back to back: twice the time.
    ok(cu.cuEventRecord(e0, s))
    ok(cu.cuGraphLaunch(exe, s))
    ok(cu.cuGraphLaunch(exe, s))
    ok(cu.cuEventRecord(e1, s))
    twice_ms = elapsed_ms(e0, e1)
    kernels_ns += 600_000_000
    check(600 <= twice_ms < 750, f"two launches took {twice_ms} ms")

    # Built by hand: two kernel nodes, the second after the first.
    g2 = ok(cu.cuGraphCreate(0))
    nodes = []
    for ns in (150_000_000, 50_000_000):
        p = cu.CUDA_KERNEL_NODE_PARAMS()
        p.func = spin
        p.gridDimX = p.gridDimY = p.gridDimZ = 1
        p.blockDimX, p.blockDimY, p.blockDimZ = 64, 1, 1
        p.sharedMemBytes = 0
        p.kernelParams = ((ns,), (ctypes.c_uint64,))
        nodes.append(ok(cu.cuGraphAddKernelNode(g2, nodes[-1:], len(nodes[-1:]), p)))
    exe2 = ok(cu.cuGraphInstantiate(g2, 0))
    ok(cu.cuEventRecord(e0, s))
    ok(cu.cuGraphLaunch(exe2, s))
    ok(cu.cuEventRecord(e1, s))
    built_ms = elapsed_ms(e0, e1)
    kernels_ns += 200_000_000
    check(200 <= built_ms < 300, f"150 + 50 ms kernel nodes took {built_ms} ms")

    # Bad use.
    expect(cu.cuStreamBeginCapture(cu.CUstream(0), mode), R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
           "capturing the legacy stream")
    expect(cu.cuStreamEndCapture(s), R.CUDA_ERROR_STREAM_CAPTURE_UNMATCHED, "ending a capture never begun")
    ok(cu.cuStreamBeginCapture(s, mode))
    expect(cu.cuStreamBeginCapture(s, mode), R.CUDA_ERROR_INVALID_VALUE, "capturing twice")
    g3 = ok(cu.cuStreamEndCapture(s))
    p = cu.CUDA_KERNEL_NODE_PARAMS()
    p.func = spin
    p.gridDimX = p.gridDimY = p.gridDimZ = 1
    p.blockDimX, p.blockDimY, p.blockDimZ = 2048, 1, 1
    expect(cu.cuGraphAddKernelNode(g2, [], 0, p), R.CUDA_ERROR_INVALID_VALUE, "a kernel node of 2048 threads")
    for name, h in (("graph", g3), ("graph", g2), ("graph", graph)):
        ok(cu.cuGraphDestroy(h))
        expect(cu.cuGraphDestroy(h), R.CUDA_ERROR_INVALID_VALUE, f"{name} destroyed twice")
    # An instantiated graph outlives its graph.
    ok(cu.cuGraphLaunch(exe2, s))
    ok(cu.cuStreamSynchronize(s))
    kernels_ns += 200_000_000
    for h in (exe, exe2):
        ok(cu.cuGraphExecDestroy(h))
        expect(cu.cuGraphExecDestroy(h), R.CUDA_ERROR_INVALID_VALUE, "exec destroyed twice")
        expect(cu.cuGraphLaunch(h, s), R.CUDA_ERROR_INVALID_VALUE, "launching a destroyed exec")
    expect(cu.cuGraphInstantiate(g3, 0), R.CUDA_ERROR_INVALID_VALUE, "instantiating a destroyed graph")
    ok(cu.cuStreamDestroy(s))
    return {"captured_ms": captured_ms, "twice_ms": twice_ms, "built_ms": built_ms, "kernels_ns": kernels_ns}


def ptsz():
    dev, ctx = setup()
    _, spin = spin_function()
    u32, vp = ctypes.c_uint32, ctypes.c_void_p

    def addr(name, version, flags):
        err, pfn, status = cu.cuGetProcAddress(name, version, flags)
        check(err == R.CUDA_SUCCESS, f"cuGetProcAddress({name}, {version}, {flags}): {err!r}")
        return int(pfn)

    # Flag 2 selects the per-thread variants, whose full names resolve to the same functions.
    pairs = {}
    for base, version, pt_name, legacy_name in (
        (b"cuLaunchKernel", 13000, b"cuLaunchKernel_ptsz", b"cuLaunchKernel"),
        (b"cuStreamQuery", 13000, b"cuStreamQuery_ptsz", b"cuStreamQuery"),
        (b"cuMemcpyHtoD", 12000, b"cuMemcpyHtoD_v2_ptds", b"cuMemcpyHtoD_v2"),
        (b"cuMemcpyAsync", 12000, b"cuMemcpyAsync_ptsz", b"cuMemcpyAsync"),
        (b"cuGraphLaunch", 12000, b"cuGraphLaunch_ptsz", b"cuGraphLaunch"),
    ):
        pt, legacy = addr(base, version, 2), addr(base, version, 0)
        check(pt != legacy, f"{base}: flag 2 gives a different entry point")
        check(pt == addr(pt_name, version, 0), f"{base}: flag 2 gives {pt_name}")
        check(legacy == addr(legacy_name, version, 0), f"{base}: flag 0 gives {legacy_name}")
        pairs[base.decode()] = pt_name.decode()
    # Functions with no per-thread variant answer the same entry point for both flags.
    check(addr(b"cuMemAlloc", 12000, 2) == addr(b"cuMemAlloc", 12000, 0), "cuMemAlloc has one variant")

    launch_pt = raw("cuLaunchKernel", ctypes.c_int, vp, u32, u32, u32, u32, u32, u32, u32, vp, vp, vp, flags=2)
    query_pt = raw("cuStreamQuery", ctypes.c_int, vp, flags=2)
    sync_pt = raw("cuStreamSynchronize", ctypes.c_int, vp, flags=2)
    query = raw("cuStreamQuery", ctypes.c_int, vp)

    ns = ctypes.c_uint64(300_000_000)
    params = (vp * 1)(ctypes.addressof(ns))
    results = {}
    launched = threading.Event()
    checked = threading.Event()

    def thread_a():
        ok(cu.cuCtxSetCurrent(ctx))
        t0 = time.monotonic()
        results["a_launch"] = launch_pt(int(spin), 1, 1, 1, 32, 1, 1, 0, None, params, None)
        # Stream 0 in a _ptsz function is this thread's own default stream.
        results["a_query_ptsz"] = query_pt(None)
        results["a_query_per_thread_handle"] = query(cu.CU_STREAM_PER_THREAD)
        results["a_query_legacy"] = query(None)
        launched.set()
        checked.wait(30)
        results["a_sync"] = sync_pt(None)
        results["a_waited_s"] = time.monotonic() - t0
        results["a_query_after"] = query_pt(None)

    def thread_b():
        ok(cu.cuCtxSetCurrent(ctx))
        launched.wait(30)
        # Another thread's per-thread default stream is a different stream: idle here.
        results["b_query_ptsz"] = query_pt(None)
        results["b_query_per_thread_handle"] = query(cu.CU_STREAM_PER_THREAD)
        checked.set()

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    want = {"a_launch": 0, "a_query_ptsz": 600, "a_query_per_thread_handle": 600, "a_query_legacy": 0,
            "b_query_ptsz": 0, "b_query_per_thread_handle": 0, "a_sync": 0, "a_query_after": 0}
    for k, v in want.items():
        check(results.get(k) == v, f"{k}: expected {v}, got {results.get(k)}")
    check(results["a_waited_s"] >= 0.29, f"sync on the per-thread stream waited {results['a_waited_s']}")

    # A per-thread copy entry point moves bytes like the legacy one.
    htod_pt = raw("cuMemcpyHtoD", ctypes.c_int, ctypes.c_uint64, vp, ctypes.c_size_t, version=12000, flags=2)
    d = ok(cu.cuMemAlloc(4096))
    src = host_bytes(4096, 5)
    check(htod_pt(int(d), src, 4096) == 0, "cuMemcpyHtoD_v2_ptds")
    back = (ctypes.c_ubyte * 4096)()
    ok(cu.cuMemcpyDtoH(back, d, 4096))
    check(bytes(back) == bytes(src), "bytes copied by the _ptds entry point")
    ok(cu.cuMemFree(d))
    return {"pairs": pairs, "waited_s": results["a_waited_s"]}


def errors():
    # Before cuInit.
    expect(cu.cuMemAlloc(16), R.CUDA_ERROR_NOT_INITIALIZED, "cuMemAlloc before cuInit")
    expect(cu.cuInit(1), R.CUDA_ERROR_INVALID_VALUE, "cuInit with flags")
    ok(cu.cuInit(0))
    expect(cu.cuMemAlloc(16), R.CUDA_ERROR_INVALID_CONTEXT, "cuMemAlloc without a context")
    expect(cu.cuDeviceGet(5), R.CUDA_ERROR_INVALID_DEVICE, "cuDeviceGet(5)")
    dev, ctx = setup()
    base = used()
    vp, sz, u32, u64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32, ctypes.c_uint64
    i32 = ctypes.c_int

    # NULL out-pointers and NULL inputs: CUDA_ERROR_INVALID_VALUE (1), never a crash.
    d = ok(cu.cuMemAlloc(4096))
    nulls = {
        "cuMemAlloc": (raw("cuMemAlloc", i32, vp, sz, version=3020), (None, 1024)),
        "cuMemGetInfo": (raw("cuMemGetInfo", i32, vp, vp, version=3020), (None, None)),
        "cuMemAllocPitch": (raw("cuMemAllocPitch", i32, vp, vp, sz, sz, u32, version=3020), (None, None, 64, 4, 4)),
        "cuMemAllocManaged": (raw("cuMemAllocManaged", i32, vp, sz, u32, version=6000), (None, 64, 1)),
        "cuMemAllocAsync": (raw("cuMemAllocAsync", i32, vp, sz, vp, version=11020), (None, 64, None)),
        "cuMemAllocHost": (raw("cuMemAllocHost", i32, vp, sz, version=3020), (None, 64)),
        "cuMemCreate": (raw("cuMemCreate", i32, vp, sz, vp, u64, version=10020), (None, 2 * MIB, None, 0)),
        "cuMemAddressReserve": (raw("cuMemAddressReserve", i32, vp, sz, sz, u64, u64, version=10020),
                                (None, 2 * MIB, 0, 0, 0)),
        "cuMemGetAllocationGranularity": (raw("cuMemGetAllocationGranularity", i32, vp, vp, u32, version=10020),
                                          (None, None, 0)),
        "cuArrayCreate": (raw("cuArrayCreate", i32, vp, vp, version=3020), (None, None)),
        "cuArray3DCreate": (raw("cuArray3DCreate", i32, vp, vp, version=3020), (None, None)),
        "cuMipmappedArrayCreate": (raw("cuMipmappedArrayCreate", i32, vp, vp, u32, version=5000), (None, None, 1)),
        "cuMemPoolCreate": (raw("cuMemPoolCreate", i32, vp, vp, version=11020), (None, None)),
        "cuMemcpyHtoD": (raw("cuMemcpyHtoD", i32, u64, vp, sz, version=3020), (int(d), None, 16)),
        "cuMemcpyDtoH": (raw("cuMemcpyDtoH", i32, vp, u64, sz, version=3020), (None, int(d), 16)),
        "cuStreamCreate": (raw("cuStreamCreate", i32, vp, u32, version=2000), (None, 0)),
        "cuEventCreate": (raw("cuEventCreate", i32, vp, u32, version=2000), (None, 0)),
        "cuEventElapsedTime": (raw("cuEventElapsedTime", i32, vp, vp, vp, version=2000), (None, None, None)),
        "cuModuleLoadData": (raw("cuModuleLoadData", i32, vp, vp, version=2000), (None, None)),
        "cuDeviceGetCount": (raw("cuDeviceGetCount", i32, vp, version=2000), (None,)),
        "cuDeviceGetName": (raw("cuDeviceGetName", i32, vp, i32, i32, version=2000), (None, 64, 0)),
        "cuCtxGetDevice": (raw("cuCtxGetDevice", i32, vp, version=2000), (None,)),
        "cuDevicePrimaryCtxRetain": (raw("cuDevicePrimaryCtxRetain", i32, vp, i32, version=7000), (None, 0)),
        "cuGraphCreate": (raw("cuGraphCreate", i32, vp, u32, version=10000), (None, 0)),
        "cuStreamEndCapture": (raw("cuStreamEndCapture", i32, vp, vp, version=10000), (None, None)),
        "cuLaunchHostFunc": (raw("cuLaunchHostFunc", i32, vp, vp, vp, version=10000), (None, None, None)),
        "cuPointerGetAttribute": (raw("cuPointerGetAttribute", i32, vp, u32, u64, version=4000), (None, 1, int(d))),
        "cuGetErrorName": (raw("cuGetErrorName", i32, i32, vp, version=6000), (0, None)),
        "cuDriverGetVersion": (raw("cuDriverGetVersion", i32, vp, version=2020), (None,)),
    }
    null_codes = {}
    for name, (fn, args) in nulls.items():
        null_codes[name] = fn(*args)
        check(null_codes[name] == 1, f"{name} with NULL: expected 1, got {null_codes[name]}")
    check(used() - base == 4096, "NULL calls allocated nothing")

    # Double frees and destroyed handles.
    ok(cu.cuMemFree(d))
    expect(cu.cuMemFree(d), R.CUDA_ERROR_INVALID_VALUE, "cuMemFree twice")
    expect(cu.cuMemFree(cu.CUdeviceptr(0x10)), R.CUDA_ERROR_INVALID_VALUE, "cuMemFree of a wild pointer")
    ok(cu.cuMemFree(cu.CUdeviceptr(0)))  # freeing NULL is a no-op, as documented
    d = ok(cu.cuMemAlloc(8192))
    expect(cu.cuMemFree(cu.CUdeviceptr(int(d) + 4096)), R.CUDA_ERROR_INVALID_VALUE, "cuMemFree of an interior pointer")
    ok(cu.cuMemFree(d))
    h = ok(cu.cuMemAllocHost(4096))
    expect(cu.cuMemFree(cu.CUdeviceptr(h)), R.CUDA_ERROR_INVALID_VALUE, "cuMemFree of host memory")
    ok(cu.cuMemFreeHost(h))
    expect(cu.cuMemFreeHost(h), R.CUDA_ERROR_INVALID_VALUE, "cuMemFreeHost twice")
    s = ok(cu.cuStreamCreate(0))
    ok(cu.cuStreamDestroy(s))
    expect(cu.cuStreamDestroy(s), R.CUDA_ERROR_INVALID_HANDLE, "cuStreamDestroy twice")
    expect(cu.cuStreamSynchronize(s), R.CUDA_ERROR_INVALID_HANDLE, "sync of a destroyed stream")
    expect(cu.cuStreamQuery(cu.CUstream(0xBAD0)), R.CUDA_ERROR_INVALID_HANDLE, "query of a wild stream")
    e = ok(cu.cuEventCreate(0))
    ok(cu.cuEventDestroy(e))
    expect(cu.cuEventDestroy(e), R.CUDA_ERROR_INVALID_HANDLE, "cuEventDestroy twice")
    expect(cu.cuEventRecord(e, cu.CUstream(0)), R.CUDA_ERROR_INVALID_HANDLE, "recording a destroyed event")
    e1, e2 = ok(cu.cuEventCreate(0)), ok(cu.cuEventCreate(0))
    expect(cu.cuEventElapsedTime(e1, e2), R.CUDA_ERROR_INVALID_HANDLE, "elapsed time of unrecorded events")
    mod, spin = spin_function()
    ok(cu.cuModuleUnload(mod))
    expect(cu.cuModuleUnload(mod), R.CUDA_ERROR_INVALID_HANDLE, "cuModuleUnload twice")
    expect(cu.cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, 0, ((0,), (ctypes.c_uint64,)), 0),
           R.CUDA_ERROR_INVALID_HANDLE, "launching a function of an unloaded module")
    c2 = ok(cu.cuCtxCreate(None, 0, dev))
    ok(cu.cuCtxDestroy(c2))
    expect(cu.cuCtxDestroy(c2), R.CUDA_ERROR_INVALID_CONTEXT, "cuCtxDestroy twice")
    ok(cu.cuCtxSetCurrent(ctx))
    _, spin = spin_function()
    expect(cu.cuLaunchKernel(spin, 0, 1, 1, 1, 1, 1, 0, 0, ((0,), (ctypes.c_uint64,)), 0),
           R.CUDA_ERROR_INVALID_VALUE, "a launch with a zero grid")
    expect(cu.cuLaunchKernel(spin, 1, 1, 1, 1025, 1, 1, 0, 0, ((0,), (ctypes.c_uint64,)), 0),
           R.CUDA_ERROR_INVALID_VALUE, "a launch of 1025 threads per block")
    check(used() == base, "nothing lost to bad use")
    return {"null_codes": null_codes}


def oom():
    """Run with a 1 GiB card: every allocation kind answers OUT_OF_MEMORY and loses nothing."""
    dev, _ = setup()
    free0, total = ok(cu.cuMemGetInfo())
    check(total == 1 << 30, f"expected a 1 GiB card, got {total}")
    left = 4 * MIB
    # What is free, not the total: the context already holds its memory.
    filler = ok(cu.cuMemAlloc(free0 - left))
    check(used() == total - left, "filled")
    s = ok(cu.cuStreamCreate(0))
    props = cu.CUmemPoolProps()
    props.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    props.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    props.location.id = 0
    pool = ok(cu.cuMemPoolCreate(props))
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    F = cu.CUarray_format

    def arr2(w, h):
        d = cu.CUDA_ARRAY_DESCRIPTOR()
        d.Width, d.Height, d.Format, d.NumChannels = w, h, F.CU_AD_FORMAT_FLOAT, 4
        return d

    def arr3(w, h, depth):
        d = cu.CUDA_ARRAY3D_DESCRIPTOR()
        d.Width, d.Height, d.Depth, d.Format, d.NumChannels, d.Flags = w, h, depth, F.CU_AD_FORMAT_FLOAT, 4, 0
        return d

    # (name, allocate `mib` MiB, free it)
    kinds = [
        ("cuMemAlloc", lambda mib: cu.cuMemAlloc(mib * MIB), cu.cuMemFree),
        ("cuMemAllocPitch", lambda mib: cu.cuMemAllocPitch(4096, mib * 256, 4), lambda p: cu.cuMemFree(p[0])),
        ("cuMemAllocManaged", lambda mib: cu.cuMemAllocManaged(mib * MIB, 1), cu.cuMemFree),
        ("cuMemAllocAsync", lambda mib: cu.cuMemAllocAsync(mib * MIB, s), lambda p: cu.cuMemFreeAsync(p, s)),
        ("cuMemAllocFromPoolAsync", lambda mib: cu.cuMemAllocFromPoolAsync(mib * MIB, pool, s),
         lambda p: cu.cuMemFreeAsync(p, s)),
        ("cuMemCreate", lambda mib: cu.cuMemCreate(mib * MIB, prop, 0), cu.cuMemRelease),
        ("cuArrayCreate", lambda mib: cu.cuArrayCreate(arr2(1024, mib * 64)), cu.cuArrayDestroy),
        ("cuArray3DCreate", lambda mib: cu.cuArray3DCreate(arr3(64, 64, mib * 16)), cu.cuArrayDestroy),
        ("cuMipmappedArrayCreate", lambda mib: cu.cuMipmappedArrayCreate(arr3(1024, mib * 64, 0), 1),
         cu.cuMipmappedArrayDestroy),
    ]
    codes = {}
    for name, alloc, free in kinds:
        res = alloc(8)
        codes[name] = code(res)
        check(codes[name] == int(R.CUDA_ERROR_OUT_OF_MEMORY), f"{name} of 8 MiB with 4 MiB free: {res[0]!r}")
        check(used() == total - left, f"{name}: a refused allocation charges nothing")
        # What fits still works, up to the last byte.
        res = alloc(2)
        check(code(res) == 0, f"{name} of 2 MiB with 4 MiB free: {res[0]!r}")
        check(used() == total - left + 2 * MIB, f"{name}: 2 MiB charged")
        handle = res[1] if len(res) == 2 else res[1:]
        ok(free(handle))
        ok(cu.cuStreamSynchronize(s))
        check(used() == total - left, f"{name}: returned")
    # Host memory is not device memory: pinned host allocations still work on a full card.
    h = ok(cu.cuMemAllocHost(16 * MIB))
    ok(cu.cuMemFreeHost(h))
    last = ok(cu.cuMemAlloc(left))
    check(used() == total, "the last byte can be allocated")
    expect(cu.cuMemAlloc(1), R.CUDA_ERROR_OUT_OF_MEMORY, "one byte more")
    ok(cu.cuMemFree(last))
    ok(cu.cuMemFree(filler))
    check(used() == total - free0, "all returned (the context keeps its own)")
    ok(cu.cuMemPoolDestroy(pool))
    ok(cu.cuStreamDestroy(s))
    return {"codes": codes}


def copies_2d():
    setup()
    s = ok(cu.cuStreamCreate(0))
    MT = cu.CUmemorytype
    width, height = 100, 8
    dptr, pitch = ok(cu.cuMemAllocPitch(width, height, 4))
    check(pitch == 512, f"pitch {pitch}")
    # Fill the whole pitched block (padding too) so the copy below shows which bytes it wrote.
    ok(cu.cuMemsetD2D8(dptr, pitch, 0xEE, pitch, height))
    src = host_bytes(width * height, 1)

    def desc(src_type, src_addr, src_pitch, dst_type, dst_addr, dst_pitch, w, h, sx=0, sy=0, dx=0, dy=0):
        c = cu.CUDA_MEMCPY2D()
        c.srcMemoryType, c.dstMemoryType = src_type, dst_type
        if src_type == MT.CU_MEMORYTYPE_HOST:
            c.srcHost = src_addr
        else:
            c.srcDevice = src_addr
        if dst_type == MT.CU_MEMORYTYPE_HOST:
            c.dstHost = dst_addr
        else:
            c.dstDevice = dst_addr
        c.srcPitch, c.dstPitch = src_pitch, dst_pitch
        c.srcXInBytes, c.srcY, c.dstXInBytes, c.dstY = sx, sy, dx, dy
        c.WidthInBytes, c.Height = w, h
        return c

    # Host (tightly packed) -> device (pitched).
    ok(cu.cuMemcpy2D(desc(MT.CU_MEMORYTYPE_HOST, ctypes.addressof(src), width,
                          MT.CU_MEMORYTYPE_DEVICE, int(dptr), pitch, width, height)))
    raw_back = (ctypes.c_ubyte * (pitch * height))()
    ok(cu.cuMemcpyDtoH(raw_back, dptr, pitch * height))
    for r in range(height):
        row = bytes(raw_back[r * pitch:(r + 1) * pitch])
        check(row[:width] == bytes(src[r * width:(r + 1) * width]), f"row {r} landed at its pitch")
        check(row[width:] == b"\xee" * (pitch - width), f"row {r} padding untouched")

    # Device -> device (a 40 x 4 window at x=10, y=2, stream-ordered) then device -> host.
    d2, pitch2 = ok(cu.cuMemAllocPitch(64, 4, 4))
    ok(cu.cuMemcpy2DAsync(desc(MT.CU_MEMORYTYPE_DEVICE, int(dptr), pitch, MT.CU_MEMORYTYPE_DEVICE, int(d2), pitch2,
                               40, 4, sx=10, sy=2), s))
    out = (ctypes.c_ubyte * (48 * 4))()
    ok(cu.cuMemcpy2DAsync(desc(MT.CU_MEMORYTYPE_DEVICE, int(d2), pitch2, MT.CU_MEMORYTYPE_HOST,
                               ctypes.addressof(out), 48, 40, 4, dx=8), s))
    ok(cu.cuStreamSynchronize(s))
    for r in range(4):
        want = bytes(src[(r + 2) * width + 10:(r + 2) * width + 50])
        check(bytes(out[r * 48 + 8:r * 48 + 48]) == want, f"window row {r}")

    # Unified addressing: device pointers named as CU_MEMORYTYPE_UNIFIED.
    ok(cu.cuMemcpy2D(desc(MT.CU_MEMORYTYPE_UNIFIED, int(dptr), pitch, MT.CU_MEMORYTYPE_UNIFIED, int(d2), pitch2,
                          64, 4)))

    # 2D memsets: 10 u32 per row, rows `pitch` apart; the rest of each row keeps its bytes.
    ok(cu.cuMemsetD2D32(dptr, pitch, 0xAABBCCDD, 10, height))
    ok(cu.cuMemcpyDtoH(raw_back, dptr, pitch * height))
    for r in range(height):
        row = bytes(raw_back[r * pitch:(r + 1) * pitch])
        check(row[:40] == bytes([0xDD, 0xCC, 0xBB, 0xAA]) * 10, f"memset32 row {r}")
        check(row[40:width] == bytes(src[r * width + 40:(r + 1) * width]), f"memset32 row {r} stops at 10")
    ok(cu.cuMemsetD2D8Async(dptr, pitch, 0x11, 3, height, s))
    ok(cu.cuStreamSynchronize(s))
    ok(cu.cuMemcpyDtoH(raw_back, dptr, pitch * height))
    check(all(bytes(raw_back[r * pitch:r * pitch + 4]) == b"\x11\x11\x11\xaa" for r in range(height)), "memset8 async")

    # Per-thread entry points resolve and work.
    vp, i32 = ctypes.c_void_p, ctypes.c_int
    memset_pt = raw("cuMemsetD2D8", i32, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_ubyte, ctypes.c_size_t,
                    ctypes.c_size_t, version=3020, flags=2)
    check(memset_pt(int(dptr), pitch, 0x22, 2, 2) == 0, "cuMemsetD2D8_v2_ptds")
    ok(cu.cuMemcpyDtoH(raw_back, dptr, pitch * 2))
    check(raw_back[0] == 0x22 and raw_back[pitch + 1] == 0x22 and raw_back[2] == 0x11, "ptds memset rows")
    c = desc(MT.CU_MEMORYTYPE_DEVICE, int(dptr), pitch, MT.CU_MEMORYTYPE_HOST, ctypes.addressof(out), 48, 8, 2)
    copy_pt = raw("cuMemcpy2DAsync", i32, vp, vp, version=3020, flags=2)
    check(copy_pt(c.getPtr(), None) == 0, "cuMemcpy2DAsync_v2_ptsz")
    check(bytes(out[:2]) == b"\x22\x22" and bytes(out[48:50]) == b"\x22\x22", "ptsz 2D copy")

    # Bad use.
    E = R.CUDA_ERROR_INVALID_VALUE
    expect(cu.cuMemcpy2D(desc(MT.CU_MEMORYTYPE_HOST, ctypes.addressof(src), 50, MT.CU_MEMORYTYPE_DEVICE, int(dptr),
                              pitch, width, 2)), E, "source pitch below the width")
    expect(cu.cuMemcpy2D(desc(MT.CU_MEMORYTYPE_HOST, ctypes.addressof(src), width, MT.CU_MEMORYTYPE_DEVICE, int(dptr),
                              pitch, width, height + 1)), E, "rows past the allocation")
    expect(cu.cuMemcpy2D(desc(MT.CU_MEMORYTYPE_HOST, ctypes.addressof(src), width, MT.CU_MEMORYTYPE_DEVICE, 0x1000,
                              pitch, width, 2)), E, "a wild device pointer")
    expect(cu.cuMemcpy2D(desc(MT.CU_MEMORYTYPE_HOST, 0, width, MT.CU_MEMORYTYPE_DEVICE, int(dptr), pitch, width, 2)),
           E, "a NULL host pointer")
    arr = desc(MT.CU_MEMORYTYPE_HOST, ctypes.addressof(src), width, MT.CU_MEMORYTYPE_ARRAY, 0, 0, width, 2)
    expect(cu.cuMemcpy2D(arr), R.CUDA_ERROR_NOT_SUPPORTED, "arrays hold no bytes in the simulator")
    expect(cu.cuMemsetD2D32(dptr, pitch, 0, 200, 2), E, "memset rows wider than the pitch")
    expect(cu.cuMemsetD2D32(cu.CUdeviceptr(int(dptr) + 2), pitch, 0, 2, 2), E, "unaligned 32-bit memset")
    expect(cu.cuMemsetD2D8(dptr, pitch, 0, pitch, height + 1), E, "memset past the allocation")
    expect(cu.cuMemcpy2DAsync(desc(MT.CU_MEMORYTYPE_DEVICE, int(dptr), pitch, MT.CU_MEMORYTYPE_DEVICE, int(d2), pitch2,
                                   8, 1), cu.CUstream(0xBAD0)), R.CUDA_ERROR_INVALID_HANDLE, "a wild stream")
    ok(cu.cuMemFree(dptr))
    ok(cu.cuMemFree(d2))
    ok(cu.cuStreamDestroy(s))
    return {"pitch": pitch}


def host_funcs():
    setup()
    _, spin = spin_function()
    s = ok(cu.cuStreamCreate(0))
    calls = []
    CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

    @CB
    def on_stream(data):
        calls.append((data, time.monotonic(), threading.get_ident()))

    fn = cu.CUhostFn(ctypes.cast(on_stream, ctypes.c_void_p).value)
    t0 = time.monotonic()
    launch(spin, s, 200_000_000)
    ok(cu.cuLaunchHostFunc(s, fn, 7))
    launch(spin, s, 100_000_000)
    ok(cu.cuLaunchHostFunc_v2(s, fn, 8, 0))
    ok(cu.cuLaunchHostFunc_v2(s, fn, 9, 1))
    submit_s = time.monotonic() - t0
    check(submit_s < 0.1 and not calls, f"host functions wait for the stream ({submit_s:.3f} s, {calls})")
    ok(cu.cuStreamSynchronize(s))
    check([c[0] for c in calls] == [7, 8, 9], f"called in stream order with their data: {calls}")
    after = [c[1] - t0 for c in calls]
    check(0.2 <= after[0] < after[1] and after[1] >= 0.3, f"each after the kernels before it: {after}")
    check(all(c[2] != threading.get_ident() for c in calls), "called on the stream's thread, not the caller's")
    expect(cu.cuLaunchHostFunc_v2(s, fn, 1, 2), R.CUDA_ERROR_INVALID_VALUE, "an unknown sync mode")
    expect(cu.cuLaunchHostFunc(cu.CUstream(0xBAD0), fn, 1), R.CUDA_ERROR_INVALID_HANDLE, "a wild stream")

    # Captured into a graph, a host function runs at each launch, not at capture.
    calls.clear()
    ok(cu.cuStreamBeginCapture(s, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
    launch(spin, s, 50_000_000)
    ok(cu.cuLaunchHostFunc(s, fn, 42))
    graph = ok(cu.cuStreamEndCapture(s))
    ok(cu.cuStreamSynchronize(s))
    check(not calls, f"not called during capture: {calls}")
    exe = ok(cu.cuGraphInstantiate(graph, 0))
    ok(cu.cuGraphLaunch(exe, s))
    ok(cu.cuGraphLaunch(exe, s))
    ok(cu.cuStreamSynchronize(s))
    check([c[0] for c in calls] == [42, 42], f"called once per graph launch: {calls}")
    ok(cu.cuGraphExecDestroy(exe))
    ok(cu.cuGraphDestroy(graph))
    ok(cu.cuStreamDestroy(s))
    return {"after_s": after}


SECTIONS = {f.__name__: f for f in (vmm, pitch_managed, async_pools, arrays, graphs, ptsz, errors, oom, copies_2d,
                                    host_funcs)}


def main():
    if len(sys.argv) != 2 or sys.argv[1] not in SECTIONS:
        raise SystemExit(f"usage: sim_surface.py {{{'|'.join(SECTIONS)}}}")
    t0 = time.monotonic()
    out = SECTIONS[sys.argv[1]]()
    out["section"] = sys.argv[1]
    out["seconds"] = time.monotonic() - t0
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
