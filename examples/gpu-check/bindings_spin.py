"""Steps 2, 3 and 5 without PyTorch: a tenant that keeps the GPU busy with `spin` kernels.

Usage: bindings_spin.py SECONDS KERNEL_US [HOLD_MIB]
Launches KERNEL_US kernels for SECONDS of wall time, at most 4 in flight (an event per launch),
and counts the ones that completed within the time: its work. Holds HOLD_MIB of device memory
meanwhile. Prints one JSON line.
"""
import os
import sys
import time

from _barrier import linger, wait_for_go
from _bindings import MIB, cu, emit, launch, ok, setup


def main():
    seconds, kernel_us = float(sys.argv[1]), float(sys.argv[2])
    hold = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    _, fn, stream = setup()
    held = ok(cu.cuMemAlloc(hold * MIB)) if hold else None
    ns = int(kernel_us * 1000)
    events = [ok(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)) for _ in range(4)]
    wait_for_go()
    done = launched = 0
    start = time.monotonic()
    while True:
        ev = events[launched % 4]
        if launched >= 4:
            ok(cu.cuEventSynchronize(ev))  # the launch 4 back has completed
            if time.monotonic() - start >= seconds:
                break
            done += 1
        launch(fn, stream, ns)
        ok(cu.cuEventRecord(ev, stream))
        launched += 1
    elapsed = time.monotonic() - start
    ok(cu.cuCtxSynchronize())
    if held is not None:
        ok(cu.cuMemFree(held))
    emit({"pid": os.getpid(), "work": done, "seconds": elapsed, "per_s": done / elapsed,
          "kernel_us": kernel_us})
    linger()


if __name__ == "__main__":
    main()
