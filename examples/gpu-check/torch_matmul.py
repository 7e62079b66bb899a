"""Steps 2, 3 and 5 with PyTorch: bf16 matrix products for a fixed time.

Usage: torch_matmul.py SECONDS [N] [HOLD_MIB]
Multiplies two N x N bf16 matrices (default 8192) back to back for SECONDS of wall time,
synchronizing every 8 products, and counts the products that completed: its work. Holds HOLD_MIB
of extra device memory meanwhile. Prints one JSON line.
"""
import json
import os
import sys
import time

import torch

from _barrier import linger, wait_for_go


def main():
    seconds = float(sys.argv[1])
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
    hold = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    extra = torch.empty(hold << 20, dtype=torch.uint8, device="cuda") if hold else None
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    torch.matmul(a, b, out=c)
    torch.cuda.synchronize()
    wait_for_go()
    done = 0
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        for _ in range(8):
            torch.matmul(a, b, out=c)
        torch.cuda.synchronize()
        done += 8
    elapsed = time.monotonic() - start
    del extra
    print(json.dumps({"pid": os.getpid(), "work": done, "seconds": elapsed, "per_s": done / elapsed,
                      "tflops": done * 2 * n ** 3 / elapsed / 1e12}), flush=True)
    linger()


if __name__ == "__main__":
    main()
