"""Step 6 with PyTorch: a latency-bound service (`serve`) or a training loop (`train`).

Usage: torch_latency.py serve SECONDS [--gap-ms G] [--kernels K] [--size N] [--delay D]
       torch_latency.py train SECONDS [--size D]
`serve`: requests at Poisson arrivals (mean gap G ms, default 10), each K (4) bf16 N x N
matrix products (N 4096) and a synchronise; prints the latencies' p50/p99/p99.9 (arrival to
completion, _latency.serve). `train`: a two-layer bf16 MLP of width D (8192, batch D), forward,
backward and an SGD step back to back, synchronising every 4 steps; prints the steps done and
the mean kernel time measured before the start line (the floor a request may wait behind).
Both wait for the start line (_barrier) and print one JSON line.
"""
import os
import sys
import time

import torch

from _barrier import linger, wait_for_go
from _latency import emit, parse, serve, summary


def main():
    a = parse(sys.argv[1:])
    if a.role == "serve":
        n = a.size or 4096
        x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(x)

        def request():
            for _ in range(a.kernels):
                torch.matmul(x, w, out=out)
            torch.cuda.synchronize()

        for _ in range(3):  # cuBLAS picks its kernels before the first measured request
            request()
        wait_for_go()
        time.sleep(a.delay)
        lat = serve(request, a.seconds, a.gap_ms, a.seed)
        emit({"pid": os.getpid(), "role": "serve", "size": n, "kernels": a.kernels,
              "gap_ms": a.gap_ms, **summary(lat)})
    else:
        d = a.size or 8192
        x = torch.randn(d, d, device="cuda", dtype=torch.bfloat16)
        w1 = (torch.randn(d, d, device="cuda", dtype=torch.bfloat16) / d ** 0.5).requires_grad_()
        w2 = (torch.randn(d, d, device="cuda", dtype=torch.bfloat16) / d ** 0.5).requires_grad_()

        def step():
            loss = torch.relu(x @ w1).matmul(w2).float().pow(2).mean()
            loss.backward()
            with torch.no_grad():
                for w in (w1, w2):
                    w -= 1e-3 * w.grad
                    w.grad = None

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        t = time.monotonic()
        for _ in range(4):
            step()
        torch.cuda.synchronize()
        # 5 products per step (2 forward; dW2, dH, dW1 backward) carry nearly all its time.
        kernel_ms = (time.monotonic() - t) / (4 * 5) * 1000
        wait_for_go()
        done = 0
        start = time.monotonic()
        while time.monotonic() - start < a.seconds:
            for _ in range(4):
                step()
            torch.cuda.synchronize()
            done += 4
        elapsed = time.monotonic() - start
        emit({"pid": os.getpid(), "role": "train", "work": done, "seconds": elapsed,
              "per_s": done / elapsed, "kernel_ms": round(kernel_ms, 3), "width": d})
    linger()


if __name__ == "__main__":
    main()
