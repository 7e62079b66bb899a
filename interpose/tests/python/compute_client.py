"""A real CUDA client (NVIDIA's cuda-bindings, unmodified) that keeps the simulated GPU busy.

On the simulated GPU a kernel's first parameter (u64) is the nanoseconds it occupies the engine.

Usage: compute_client.py MODE SECONDS KERNEL_MS [LINGER_SECONDS]
  MODE is the launch path: kernel | ex | coop | graph | per_thread (CU_STREAM_PER_THREAD) | sync (kernel + cuCtxSynchronize
  after every launch) | sync_stream (+ cuStreamSynchronize) | sync_event (+ cuEventRecord and
  cuEventSynchronize) | sync_host (+ cuStreamSynchronize, then 0.6 ms of host work). Launches as fast as the interposer lets it for SECONDS of wall time, then
  waits for the GPU; prints one JSON line, then stays alive LINGER_SECONDS (holding nothing).
  `first_done_after` is when the first launch's kernel had completed (sync mode only).
  With TESSERA_TEST_GO_FILE set, it first allocates 1 MiB (so it is connected), prints
  {"ready": PID} and launches only once that file exists.
"""
import ctypes
import json
import os
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
\0"""


def ok(result):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise SystemExit(f"CUDA call failed: {err!r}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


def main():
    mode, seconds, kernel_ms = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    linger = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    ns = int(kernel_ms * 1e6)
    ok(cu.cuInit(0))
    dev = ok(cu.cuDeviceGet(0))
    ctx = ok(cu.cuDevicePrimaryCtxRetain(dev))
    ok(cu.cuCtxSetCurrent(ctx))
    mod = ok(cu.cuModuleLoadData(PTX))
    fn = ok(cu.cuModuleGetFunction(mod, b"spin"))
    stream = ok(cu.cuStreamCreate(0))
    args = ((ns,), (ctypes.c_uint64,))

    if mode == "kernel":
        def launch():
            ok(cu.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, stream, args, 0))
    elif mode == "sync":
        def launch():
            ok(cu.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, stream, args, 0))
            ok(cu.cuCtxSynchronize())
    elif mode == "sync_host":
        def launch():
            ok(cu.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, stream, args, 0))
            ok(cu.cuStreamSynchronize(stream))
            until = time.perf_counter() + 0.0006
            while time.perf_counter() < until:
                pass
    elif mode == "sync_stream":
        def launch():
            ok(cu.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, stream, args, 0))
            ok(cu.cuStreamSynchronize(stream))
    elif mode == "sync_event":
        event = ok(cu.cuEventCreate(0))

        def launch():
            ok(cu.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, stream, args, 0))
            ok(cu.cuEventRecord(event, stream))
            ok(cu.cuEventSynchronize(event))
    elif mode == "per_thread":
        per_thread = cu.CUstream(cu.CU_STREAM_PER_THREAD)

        def launch():
            ok(cu.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, per_thread, args, 0))
    elif mode == "ex":
        config = cu.CUlaunchConfig()
        config.gridDimX = config.gridDimY = config.gridDimZ = 1
        config.blockDimX, config.blockDimY, config.blockDimZ = 32, 1, 1
        config.sharedMemBytes = 0
        config.hStream = stream
        config.numAttrs = 0

        def launch():
            ok(cu.cuLaunchKernelEx(config, fn, args, 0))
    elif mode == "coop":
        def launch():
            ok(cu.cuLaunchCooperativeKernel(fn, 1, 1, 1, 32, 1, 1, 0, stream, args))
    elif mode == "capture_busy":
        def launch():
            ok(cu.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, stream, args, 0))
    elif mode == "graph":
        capture = ok(cu.cuStreamCreate(0))
        ok(cu.cuStreamBeginCapture(capture, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
        ok(cu.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, capture, args, 0))
        graph = ok(cu.cuStreamEndCapture(capture))
        exec_ = ok(cu.cuGraphInstantiate(graph, 0))

        def launch():
            ok(cu.cuGraphLaunch(exec_, stream))
    else:
        raise SystemExit("unknown mode " + mode)

    go = os.environ.get("TESSERA_TEST_GO_FILE")
    if go:
        ok(cu.cuMemAlloc(1 << 20))
        print(json.dumps({"ready": os.getpid()}), flush=True)
        while not os.path.exists(go):
            time.sleep(0.01)

    captured = {"captures": 0, "capture_failures": 0, "capture_error": None}
    if mode == "capture_busy":
        import threading

        def capture_loop():
            ok(cu.cuCtxSetCurrent(ctx))
            side = ok(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
            while time.monotonic() - start < seconds:
                err = cu.cuStreamBeginCapture(side, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)[0]
                for _ in range(10):
                    if err == cu.CUresult.CUDA_SUCCESS:
                        err = cu.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, side, args, 0)[0]
                    time.sleep(0.001)
                end_err, graph = cu.cuStreamEndCapture(side)
                err = err if err != cu.CUresult.CUDA_SUCCESS else end_err
                captured["captures"] += 1
                if err != cu.CUresult.CUDA_SUCCESS:
                    captured["capture_failures"] += 1
                    captured["capture_error"] = captured["capture_error"] or repr(err)
                elif graph:
                    ok(cu.cuGraphDestroy(graph))

        start = time.monotonic()
        capturer = threading.Thread(target=capture_loop)
        capturer.start()
    launches = 0
    first_done_after = None
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        launch()
        launches += 1
        if first_done_after is None and mode == "sync":
            first_done_after = time.monotonic() - start
    launched_for = time.monotonic() - start
    if mode == "capture_busy":
        capturer.join()
    ok(cu.cuCtxSynchronize())
    print(json.dumps({
        "pid": os.getpid(),
        "launches": launches,
        "launched_for": launched_for,
        "finished_after": time.monotonic() - start,
        "first_done_after": first_done_after,
        **(captured if mode == "capture_busy" else {}),
    }), flush=True)
    time.sleep(linger)


if __name__ == "__main__":
    main()
