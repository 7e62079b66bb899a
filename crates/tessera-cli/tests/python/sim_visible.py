"""What a CUDA process sees under CUDA_VISIBLE_DEVICES on the simulated GPUs (cuda-bindings,
unmodified), for tests/it/sim_visible.rs.

  sim_visible.py [MIB NS]

Prints one JSON line: cuInit's and cuDeviceGetCount's codes, then per device ordinal its UUID,
PCI bus id and memory, and NVML's device count (NVML ignores CUDA_VISIBLE_DEVICES). With MIB
and NS, it also makes ordinal 0's primary context current, allocates MIB MiB there, runs a
kernel of NS nanoseconds, reports the context's device and the allocation's device ordinal,
prints the line, and keeps the memory until stdin closes (so the test can look at which
physical GPU holds it).
"""
import ctypes
import json
import sys

from cuda.bindings import driver as cu

from sim_client import PTX, ok  # the same folder


def uuid_text(raw):
    h = bytes(raw).hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def main():
    out = {"init": int(cu.cuInit(0)[0])}
    err, count = cu.cuDeviceGetCount()
    out["count_rc"], out["count"] = int(err), int(count or 0)
    devices = []
    if out["init"] == 0:
        for o in range(count):
            dev = ok(cu.cuDeviceGet(o))
            devices.append({
                "uuid": uuid_text(ok(cu.cuDeviceGetUuid(dev)).bytes),
                "pci": ok(cu.cuDeviceGetPCIBusId(32, dev)).split(b"\0")[0].decode(),
                "total": int(ok(cu.cuDeviceTotalMem(dev))),
            })
        out["beyond"] = int(cu.cuDeviceGet(count)[0])
    out["devices"] = devices
    nvml = ctypes.CDLL("libnvidia-ml.so.1")
    n = ctypes.c_uint(0)
    if nvml.nvmlInit_v2() == 0 and nvml.nvmlDeviceGetCount_v2(ctypes.byref(n)) == 0:
        out["nvml_count"] = n.value
    if len(sys.argv) < 3:
        print(json.dumps(out), flush=True)
        return
    mib, ns = int(sys.argv[1]), int(sys.argv[2])
    dev = ok(cu.cuDeviceGet(0))
    ok(cu.cuCtxSetCurrent(ok(cu.cuDevicePrimaryCtxRetain(dev))))
    out["ctx_device"] = int(ok(cu.cuCtxGetDevice()))
    p = ok(cu.cuMemAlloc(mib << 20))
    out["ptr_ordinal"] = int(ok(cu.cuPointerGetAttribute(
        cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p)))
    free, total = ok(cu.cuMemGetInfo())
    out["info_total"], out["info_used"] = int(total), int(total - free)
    out["by_pci"] = int(ok(cu.cuDeviceGetByPCIBusId(devices[0]["pci"].encode())))
    mod = ok(cu.cuModuleLoadData(PTX))
    spin = ok(cu.cuModuleGetFunction(mod, b"spin"))
    ok(cu.cuLaunchKernel(spin, 1, 1, 1, 32, 1, 1, 0, 0, ((ns,), (ctypes.c_uint64,)), 0))
    ok(cu.cuCtxSynchronize())
    print(json.dumps(out), flush=True)
    sys.stdin.read()
    ok(cu.cuMemFree(p))


if __name__ == "__main__":
    main()
