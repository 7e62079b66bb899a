"""Step 4 without PyTorch: launch paths through cuda-bindings, run once bare and once under
`tessera run` by run.sh.

Usage: bindings_overhead.py SECONDS
For SECONDS each: `large` (1 ms kernels, a stand-in for large matrix products), `tiny`
(back-to-back 1 µs kernels: launch-bound) and `graph` (replays of a captured graph of 20 tiny
kernels). Prints one JSON line of completed kernels per second.
"""
import sys
import time

from _bindings import cu, emit, launch, ok, setup


def rate(seconds, step, per_step):
    n = 0
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        step()
        n += 1
        if n % 64 == 0:
            ok(cu.cuCtxSynchronize())
    ok(cu.cuCtxSynchronize())
    return n * per_step / (time.monotonic() - start)


def main():
    seconds = float(sys.argv[1])
    _, fn, stream = setup()
    out = {"large": rate(seconds, lambda: launch(fn, stream, 1_000_000), 1),
           "tiny": rate(seconds, lambda: launch(fn, stream, 1_000), 1)}
    capture = ok(cu.cuStreamCreate(0))
    ok(cu.cuStreamBeginCapture(capture, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
    for _ in range(20):
        launch(fn, capture, 1_000)
    graph = ok(cu.cuStreamEndCapture(capture))
    exe = ok(cu.cuGraphInstantiate(graph, 0))
    out["graph"] = rate(seconds, lambda: ok(cu.cuGraphLaunch(exe, stream)), 20)
    emit(out)


if __name__ == "__main__":
    main()
