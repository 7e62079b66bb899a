"""Step 1 with PyTorch: the memory limit as PyTorch sees it.

Usage: torch_limit.py LIMIT_BYTES
(run.sh runs it twice: with the default caching allocator, and with
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, whose allocations go through cuMemCreate.)
Prints one JSON line: torch.cuda.mem_get_info(), how much it could allocate in 256 MiB tensors
before torch.OutOfMemoryError, and whether that error came at the limit.
"""
import json
import os
import sys

import torch

MIB = 1 << 20


def main():
    limit = int(sys.argv[1])
    free, total = torch.cuda.mem_get_info()
    out = {"alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default"),
           "total": total, "free": free, "limit": limit, "torch": torch.__version__}
    held, block, refused, error = [], 256 * MIB, False, None
    try:
        while len(held) * block <= limit + block:
            held.append(torch.empty(block, dtype=torch.uint8, device="cuda"))
    except torch.OutOfMemoryError as e:
        refused = True
        error = str(e).splitlines()[0][:160]
    out["held"] = len(held) * block
    out["reserved"] = torch.cuda.memory_reserved()
    out["refused_oom"] = refused
    out["error"] = error
    del held
    torch.cuda.empty_cache()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
