"""A real CUDA client (NVIDIA's cuda-bindings, unmodified) for the interposer's tests.

Modes (argv[1]):
  limits          every allocation API against the limit; prints one JSON object
  race N BYTES    N times: allocate BYTES, free it; prints counts of result codes
  serve           reads commands on stdin, answers one JSON line each (for kill/restart/fork)
  info            prints what the process sees (device total, cuMemGetInfo, NVML)

The Rust tests assert on the printed values; this script only fails on unexpected Python errors.
"""
import ctypes
import json
import subprocess
import os
import sys
import time

from cuda.bindings import driver as cu

MIB = 1 << 20
SUCCESS = cu.CUresult.CUDA_SUCCESS


def emit(obj):
    """One JSON line in one write: a forked child shares this stdout, and print() writes the
    line and its newline apart (unbuffered here), so two processes' lines could interleave."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def code(err):
    return int(err)


def ok(result):
    """Unpacks a cuda-bindings result tuple, failing loudly on an error code."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != SUCCESS:
        raise SystemExit(f"CUDA call failed: {err!r}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


def setup():
    ok(cu.cuInit(0))
    dev = ok(cu.cuDeviceGet(0))
    ctx = ok(cu.cuDevicePrimaryCtxRetain(dev))
    ok(cu.cuCtxSetCurrent(ctx))
    return dev


def nvml_memory():
    """nvmlDeviceGetMemoryInfo through ctypes (dlopen + dlsym, like nvidia-smi)."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError as e:
        return {"error": str(e)}

    class Mem(ctypes.Structure):
        _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

    class MemV2(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint), ("total", ctypes.c_ulonglong), ("reserved", ctypes.c_ulonglong),
                    ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

    assert lib.nvmlInit_v2() == 0
    handle = ctypes.c_void_p()
    assert lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle)) == 0
    m = Mem()
    r1 = lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(m))
    m2 = MemV2()
    m2.version = ctypes.sizeof(MemV2) | (2 << 24)
    r2 = lib.nvmlDeviceGetMemoryInfo_v2(handle, ctypes.byref(m2))
    return {"rc": r1, "total": m.total, "free": m.free, "used": m.used,
            "rc_v2": r2, "total_v2": m2.total, "free_v2": m2.free, "used_v2": m2.used}


def info(dev):
    total = ok(cu.cuDeviceTotalMem(dev))
    free, total2 = ok(cu.cuMemGetInfo())
    return {"device_total": total, "free": free, "total": total2, "nvml": nvml_memory()}


def twice(alloc, free, label, out):
    """Allocates 600 MiB, tries a second 600 MiB, frees the first, retries the second."""
    err, a = alloc()
    out[label + "_first"] = code(err)
    if err != SUCCESS:
        return
    err2, b = alloc()
    out[label + "_second"] = code(err2)
    if err2 == SUCCESS:
        free(b)
    out[label + "_free"] = code(free(a))
    err3, c = alloc()
    out[label + "_after_free"] = code(err3)
    if err3 == SUCCESS:
        free(c)
    out[label + "_free_info"] = ok(cu.cuMemGetInfo())[0]


def limits():
    dev = setup()
    out = {"start": info(dev)}
    size = 600 * MIB

    def plain():
        return cu.cuMemAlloc(size)
    twice(plain, lambda p: cu.cuMemFree(p)[0], "alloc", out)
    # While 600 MiB is held, the card shows 424 MiB free.
    p = ok(cu.cuMemAlloc(size))
    out["held_info"] = info(dev)
    ok(cu.cuMemFree(p))

    twice(lambda: cu.cuMemAllocManaged(size, cu.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL.value),
          lambda p: cu.cuMemFree(p)[0], "managed", out)

    stream = ok(cu.cuStreamCreate(0))

    def async_free(p):
        err, = cu.cuMemFreeAsync(p, stream)
        ok(cu.cuStreamSynchronize(stream))
        return err
    twice(lambda: cu.cuMemAllocAsync(size, stream), async_free, "async", out)

    pool = ok(cu.cuDeviceGetDefaultMemPool(dev))
    twice(lambda: cu.cuMemAllocFromPoolAsync(size, pool, stream), async_free, "pool", out)

    # Pitch: 600 rows of 1 MiB (the pitch the driver picks is what is counted).
    def pitch():
        err, ptr, pitch_ = cu.cuMemAllocPitch(MIB, 600, 16)
        return err, ptr
    twice(pitch, lambda p: cu.cuMemFree(p)[0], "pitch", out)

    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    twice(lambda: cu.cuMemCreate(size, prop, 0), lambda h: cu.cuMemRelease(h)[0], "vmm", out)

    # A 2D float4 array of 8192 x 4800 elements = 600 MiB.
    desc = cu.CUDA_ARRAY_DESCRIPTOR()
    desc.Width = 8192
    desc.Height = 4800
    desc.Format = cu.CUarray_format.CU_AD_FORMAT_FLOAT
    desc.NumChannels = 4
    twice(lambda: cu.cuArrayCreate(desc), lambda a: cu.cuArrayDestroy(a)[0], "array", out)

    desc3 = cu.CUDA_ARRAY3D_DESCRIPTOR()
    desc3.Width = 8192
    desc3.Height = 600
    desc3.Depth = 8
    desc3.Format = cu.CUarray_format.CU_AD_FORMAT_FLOAT
    desc3.NumChannels = 4
    twice(lambda: cu.cuArray3DCreate(desc3), lambda a: cu.cuArrayDestroy(a)[0], "array3d", out)

    # Mipmapped: 8192 x 4096 float4, two levels = 512 MiB + 128 MiB.
    mip = cu.CUDA_ARRAY3D_DESCRIPTOR()
    mip.Width = 8192
    mip.Height = 4096
    mip.Depth = 0
    mip.Format = cu.CUarray_format.CU_AD_FORMAT_FLOAT
    mip.NumChannels = 4
    twice(lambda: cu.cuMipmappedArrayCreate(mip, 2), lambda a: cu.cuMipmappedArrayDestroy(a)[0], "mipmap", out)

    # Mixed: 600 MiB plain + a 600 MiB array does not fit either.
    p = ok(cu.cuMemAlloc(size))
    err, _ = cu.cuArrayCreate(desc)
    out["mixed_array_over_plain"] = code(err)
    ok(cu.cuMemFree(p))
    # Frees of pointers the interposer never saw pass through untouched (the driver says 1/400).
    out["free_unknown"] = code(cu.cuMemFree(0x1234)[0])
    out["end"] = info(dev)
    emit(out)


def race(n, size, barrier=None, racers=0):
    """`n` allocations of `size`, freed at once; with `barrier` (a folder) and `racers`, first
    waits until that many racers hold their contexts (each leaves a file there), so that none
    races for the allocations before another has its context: a context asked for beside
    racing siblings is refused when their allocations fill the limit, which is right, but not
    what is being tested."""
    setup()
    if barrier:
        open(os.path.join(barrier, str(os.getpid())), "w").close()
        deadline = time.monotonic() + 120
        while len(os.listdir(barrier)) < racers:
            if time.monotonic() > deadline:
                raise SystemExit("racers did not all start")
            time.sleep(0.005)
    counts = {}
    for _ in range(n):
        err, p = cu.cuMemAlloc(size)
        counts[code(err)] = counts.get(code(err), 0) + 1
        if err == SUCCESS:
            ok(cu.cuMemFree(p))
    emit({str(k): v for k, v in counts.items()})


def serve():
    """One JSON line per command: alloc BYTES | free_all | info | fork_child BYTES | exit."""
    dev = setup()
    held = []
    children = []
    emit({"ready": os.getpid()})
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "alloc":
            err, p = cu.cuMemAlloc(int(cmd[1]))
            if err == SUCCESS:
                held.append(p)
            emit({"alloc": code(err)})
        elif cmd[0] == "free_all":
            codes = [code(cu.cuMemFree(p)[0]) for p in held]
            held.clear()
            emit({"free_all": codes})
        elif cmd[0] == "info":
            emit(info(dev))
        elif cmd[0] == "fork_child":
            # The child allocates on its own (accounted separately) and reports, then waits for
            # a byte on the pipe before exiting, so the test can look at the ledger meanwhile.
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(w)
                err, p = cu.cuMemAlloc(int(cmd[1]))
                emit({"child_alloc": code(err), "child_pid": os.getpid()})
                os.read(r, 1)
                os._exit(0)
            os.close(r)
            emit({"forked": pid, "release_fd": w})
        elif cmd[0] == "release_child":
            w = int(cmd[1])
            pid = int(cmd[2])
            os.write(w, b"x")
            os.close(w)
            _, status = os.waitpid(pid, 0)
            emit({"child_status": status})
        elif cmd[0] == "spawn_bare":
            # A child started without the interposer (and without the token), as a tenant
            # trying to go around it would: it allocates on its own and holds the memory.
            env = {k: v for k, v in os.environ.items()
                   if k not in ("LD_PRELOAD", "TESSERA_TOKEN", "TESSERA_SOCKET")}
            if len(cmd) > 2:
                # The cards it may see: a tenant widening its own view to a card not its own.
                env["CUDA_VISIBLE_DEVICES"] = cmd[2]
            child = subprocess.Popen([sys.executable, __file__, "hold", cmd[1]], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            children.append(child)
            first = json.loads(child.stdout.readline())
            emit({"child": child.pid, "child_alloc": first["held"]})
        elif cmd[0] == "exit":
            return
        else:
            emit({"error": "unknown command " + cmd[0]})


def main():
    mode = sys.argv[1]
    if mode == "limits":
        limits()
    elif mode == "race":
        race(int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:5], *map(int, sys.argv[5:6]))
    elif mode == "serve":
        serve()
    elif mode == "info":
        dev = setup()
        emit(info(dev))
    elif mode == "hold":
        setup()
        err, _ = cu.cuMemAlloc(int(sys.argv[2]))
        emit({"held": code(err)})
        sys.stdin.read()
    else:
        raise SystemExit("unknown mode " + mode)


if __name__ == "__main__":
    main()
