"""Start line for tenants that run together (step 2): with GPUCHECK_BARRIER=DIR set, a worker
writes DIR/ready.PID once its set-up is done, then waits (at most 300 s) for DIR/go, which run.sh
creates when every tenant is ready. Without it, returns at once.

`linger()`: with GPUCHECK_LINGER=SECONDS, stays alive that long after printing its results (step 5
reads the ledger while the allocation still exists: it is deleted when its last process exits)."""
import os
import time


def wait_for_go():
    folder = os.environ.get("GPUCHECK_BARRIER")
    if not folder:
        return
    with open(os.path.join(folder, f"ready.{os.getpid()}"), "w") as f:
        f.write(str(os.getpid()))
    until = time.monotonic() + 300
    while not os.path.exists(os.path.join(folder, "go")) and time.monotonic() < until:
        time.sleep(0.01)


def linger():
    time.sleep(float(os.environ.get("GPUCHECK_LINGER", "0")))
