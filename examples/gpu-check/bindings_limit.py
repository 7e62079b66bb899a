"""Step 1 without PyTorch: the memory limit as a cuda-bindings client sees it.

Usage: bindings_limit.py LIMIT_BYTES
Prints one JSON line: cuMemGetInfo's total and free, whether allocating 1 MiB past the limit
(plain cuMemAlloc in 64 MiB blocks) is refused with CUDA_ERROR_OUT_OF_MEMORY, and whether VMM
(cuMemCreate) allocations count against the same limit.
"""
import sys

from _bindings import MIB, OOM, SUCCESS, cu, emit, ok, setup


def fill(alloc, free, limit, block):
    """Allocates `block`-sized pieces until refused; returns (bytes held, refusal code, handles)."""
    held, handles, err = 0, [], SUCCESS
    while held <= limit + block:
        err, h = alloc(block)
        if err != SUCCESS:
            break
        handles.append(h)
        held += block
    return held, err, handles


def main():
    limit = int(sys.argv[1])
    setup()
    free0, total = ok(cu.cuMemGetInfo())
    out = {"total": total, "free": free0, "limit": limit}
    block = 64 * MIB
    held, err, handles = fill(cu.cuMemAlloc, cu.cuMemFree, limit, block)
    out["plain_held"] = held
    out["plain_refused_oom"] = err == OOM
    out["plain_free_at_refusal"] = ok(cu.cuMemGetInfo())[0]
    for h in handles:
        ok(cu.cuMemFree(h))

    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    gran = ok(cu.cuMemGetAllocationGranularity(
        prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
    vblock = max(block, gran) // gran * gran
    held, err, handles = fill(lambda n: cu.cuMemCreate(n, prop, 0), None, limit, vblock)
    out["vmm_held"] = held
    out["vmm_refused_oom"] = err == OOM
    for h in handles:
        ok(cu.cuMemRelease(h))
    emit(out)


if __name__ == "__main__":
    main()
