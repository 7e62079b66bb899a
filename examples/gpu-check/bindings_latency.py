"""Step 6 without PyTorch: the latency scenario with cuda-bindings `spin` kernels.

Usage: bindings_latency.py serve SECONDS [--gap-ms G] [--kernels K] [--size US] [--delay D]
       bindings_latency.py train SECONDS [--size US]
`serve`: requests at Poisson arrivals (mean gap G ms), each K kernels of US microseconds
(default 2000, as latency_tier's first mix) and a stream synchronise; prints the latencies'
p50/p99/p99.9 (_latency.serve). `train`: kernels of US/10 to US microseconds (default 10000:
1-10 ms, latency_tier's best-effort kernels) back to back, at most 4 in flight; prints the
kernels done and their mean length. Both wait for the start line and print one JSON line.
"""
import os
import random
import sys
import time

from _barrier import linger, wait_for_go
from _bindings import cu, launch, ok, setup
from _latency import emit, parse, serve, summary


def main():
    a = parse(sys.argv[1:])
    _, fn, stream = setup()
    if a.role == "serve":
        ns = int((a.size or 2000) * 1000)

        def request():
            for _ in range(a.kernels):
                launch(fn, stream, ns)
            ok(cu.cuStreamSynchronize(stream))

        request()
        wait_for_go()
        time.sleep(a.delay)
        lat = serve(request, a.seconds, a.gap_ms, a.seed)
        emit({"pid": os.getpid(), "role": "serve", "kernel_us": ns / 1000, "kernels": a.kernels,
              "gap_ms": a.gap_ms, **summary(lat)})
    else:
        hi = int((a.size or 10000) * 1000)
        rng = random.Random(a.seed)
        events = [ok(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)) for _ in range(4)]
        wait_for_go()
        done = launched = 0
        start = time.monotonic()
        while True:
            ev = events[launched % 4]
            if launched >= 4:
                ok(cu.cuEventSynchronize(ev))  # the launch 4 back has completed
                if time.monotonic() - start >= a.seconds:
                    break
                done += 1
            launch(fn, stream, rng.randint(hi // 10, hi))
            ok(cu.cuEventRecord(ev, stream))
            launched += 1
        elapsed = time.monotonic() - start
        ok(cu.cuCtxSynchronize())
        emit({"pid": os.getpid(), "role": "train", "work": done, "seconds": elapsed,
              "per_s": done / elapsed, "kernel_ms": round((hi // 10 + hi) / 2 / 1e6, 3)})
    linger()


if __name__ == "__main__":
    main()
