"""A real CUDA client (NVIDIA's cuda-bindings, unmodified) driving the VMM calls step by step,
for the interposer's VMM accounting tests (tests/vmm.rs).

Reads one command a line on stdin and answers one JSON line each: {"rc": CODE, "free": BYTES}
where `free` is cuMemGetInfo_v2's free memory after the step (a memory query also sends the
interposer's pending releases to the arbiter first, so the test reads an exact ledger).
Sizes and offsets are in MiB; handles and reservations are named by the test.

  create H MIB            cuMemCreate on device 0, kept as H
  reserve R MIB           cuMemAddressReserve, kept as R (access is granted on map)
  map R OFF H MIB         cuMemMap(R + OFF, MIB, 0, H), then cuMemSetAccess read-write
  unmap R OFF MIB         cuMemUnmap(R + OFF, MIB)
  retain H2 R OFF         cuMemRetainAllocationHandle(R + OFF), kept as H2
  release H               cuMemRelease(H)
  free_va R               cuMemAddressFree(R)
  export H                cuMemExportToShareableHandle(H) as a POSIX fd; answers "fd" too
  import H PID FD         opens /proc/PID/fd/FD (another process's export) and imports it as H
  alloc MIB               cuMemAlloc (freed at once when it succeeds)
  exit
"""
import json
import os
import sys

from cuda.bindings import driver as cu

MIB = 1 << 20
SUCCESS = cu.CUresult.CUDA_SUCCESS


def ok(result):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != SUCCESS:
        raise SystemExit(f"CUDA call failed: {err!r}")
    return rest[0] if len(rest) == 1 else tuple(rest)


def main():
    ok(cu.cuInit(0))
    dev = ok(cu.cuDeviceGet(0))
    ok(cu.cuCtxSetCurrent(ok(cu.cuDevicePrimaryCtxRetain(dev))))
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    posix_fd = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    prop.requestedHandleTypes = posix_fd
    desc = cu.CUmemAccessDesc()
    desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = 0
    desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    handles, ranges = {}, {}

    def at(name, off_mib):
        return cu.CUdeviceptr(int(ranges[name][0]) + int(off_mib) * MIB)

    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        op, args = cmd[0], cmd[1:]
        rc = 0
        extra = {}
        if op == "create":
            err, h = cu.cuMemCreate(int(args[1]) * MIB, prop, 0)
            rc = int(err)
            if err == SUCCESS:
                handles[args[0]] = h
        elif op == "reserve":
            size = int(args[1]) * MIB
            err, ptr = cu.cuMemAddressReserve(size, 0, 0, 0)
            rc = int(err)
            if err == SUCCESS:
                ranges[args[0]] = (ptr, size)
        elif op == "map":
            ptr, size = at(args[0], args[1]), int(args[3]) * MIB
            rc = int(cu.cuMemMap(ptr, size, 0, handles[args[2]], 0)[0])
            if rc == 0:
                rc = int(cu.cuMemSetAccess(ptr, size, [desc], 1)[0])
        elif op == "unmap":
            rc = int(cu.cuMemUnmap(at(args[0], args[1]), int(args[2]) * MIB)[0])
        elif op == "retain":
            err, h = cu.cuMemRetainAllocationHandle(int(at(args[1], args[2])))
            rc = int(err)
            if err == SUCCESS:
                handles[args[0]] = h
        elif op == "release":
            rc = int(cu.cuMemRelease(handles[args[0]])[0])
        elif op == "free_va":
            ptr, size = ranges.pop(args[0])
            rc = int(cu.cuMemAddressFree(ptr, size)[0])
        elif op == "export":
            err, fd = cu.cuMemExportToShareableHandle(handles[args[0]], posix_fd, 0)
            rc = int(err)
            extra["fd"] = int(fd) if err == SUCCESS else -1
        elif op == "import":
            fd = os.open(f"/proc/{args[1]}/fd/{args[2]}", os.O_RDWR)
            err, h = cu.cuMemImportFromShareableHandle(fd, posix_fd)
            os.close(fd)
            rc = int(err)
            if err == SUCCESS:
                handles[args[0]] = h
        elif op == "alloc":
            err, p = cu.cuMemAlloc(int(args[0]) * MIB)
            rc = int(err)
            if err == SUCCESS:
                ok(cu.cuMemFree(p))
        elif op == "exit":
            return
        else:
            raise SystemExit("unknown command " + op)
        free, _ = ok(cu.cuMemGetInfo())
        print(json.dumps({"rc": rc, "free": int(free), **extra}), flush=True)


if __name__ == "__main__":
    main()
