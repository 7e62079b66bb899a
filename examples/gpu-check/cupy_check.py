"""Step 4: CuPy start-up and one kernel (CuPy loads the driver its own way).

Prints one JSON line: seconds from start to the first kernel's result, and the result.
"""
import json
import time

start = time.monotonic()
import cupy  # noqa: E402

x = cupy.arange(1 << 20, dtype=cupy.float32)
total = float((x * 2).sum())
free, total_mem = cupy.cuda.runtime.memGetInfo()
print(json.dumps({"startup_s": time.monotonic() - start, "ok": abs(total / ((1 << 20) * ((1 << 20) - 1)) - 1) < 1e-3,
                  "mem_total": total_mem, "cupy": cupy.__version__}), flush=True)
