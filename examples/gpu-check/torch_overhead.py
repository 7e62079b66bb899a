"""Step 4 with PyTorch: run once bare and once under `tessera run` by run.sh.

Usage: torch_overhead.py SECONDS
For SECONDS each: `large` (8192^2 bf16 matrix products per second), `tiny` (a loop of
single-element adds: launch-bound, kernels per second) and `graph` (CUDA-graph replays of 20
tiny kernels, kernels per second). Prints one JSON line.
"""
import json
import sys
import time

import torch


def rate(seconds, step, per_step, sync_every):
    step()
    torch.cuda.synchronize()
    n = 0
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        for _ in range(sync_every):
            step()
        torch.cuda.synchronize()
        n += sync_every
    return n * per_step / (time.monotonic() - start)


def main():
    seconds = float(sys.argv[1])
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    x = torch.zeros(1, device="cuda")
    out = {"large": rate(seconds, lambda: torch.matmul(a, b, out=c), 1, 8),
           "tiny": rate(seconds, lambda: x.add_(1), 1, 256)}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            x.add_(1)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            x.add_(1)
    out["graph"] = rate(seconds, graph.replay, 20, 16)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
