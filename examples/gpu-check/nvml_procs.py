"""Step 5: NVML's per-process figures for one process on GPU 0, through ctypes (no pynvml).

Usage: nvml_procs.py PID SECONDS
Loads libnvidia-ml.so.1 (the real one, or the simulated one under `tessera sim`) and polls it
every 0.25 s until PID exits or SECONDS pass, as the arbiter does: the largest used memory
nvmlDeviceGetComputeRunningProcesses reported for PID, and its kernel time summed from
nvmlDeviceGetProcessUtilization (smUtil x the interval since the previous answer's timestamp).
Prints one JSON line {"pid", "used_bytes", "busy_s", "polled_s"}.
"""
import ctypes
import json
import os
import sys
import time


class ProcessInfo(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("used", ctypes.c_ulonglong),
                ("gi", ctypes.c_uint), ("ci", ctypes.c_uint)]


class UtilSample(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("ts", ctypes.c_ulonglong), ("sm", ctypes.c_uint),
                ("mem", ctypes.c_uint), ("enc", ctypes.c_uint), ("dec", ctypes.c_uint)]


def alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def main():
    pid, seconds = int(sys.argv[1]), float(sys.argv[2])
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError as e:
        print(json.dumps({"error": str(e)}), flush=True)
        return
    if lib.nvmlInit_v2() != 0:
        print(json.dumps({"error": "nvmlInit_v2 failed"}), flush=True)
        return
    dev = ctypes.c_void_p()
    lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(dev))
    infos = (ProcessInfo * 256)()
    samples = (UtilSample * 1024)()
    used, busy = None, 0.0
    last_seen = int(time.time() * 1e6)
    start = time.monotonic()
    while True:
        n = ctypes.c_uint(256)
        if lib.nvmlDeviceGetComputeRunningProcesses_v3(dev, ctypes.byref(n), infos) == 0:
            for p in infos[:n.value]:
                if p.pid == pid:
                    used = max(used or 0, p.used)
        n = ctypes.c_uint(1024)
        if lib.nvmlDeviceGetProcessUtilization(dev, samples, ctypes.byref(n), ctypes.c_ulonglong(last_seen)) == 0:
            mine = sorted((s.ts, s.sm) for s in samples[:n.value] if s.pid == pid and s.ts > last_seen)
            prev = last_seen
            for ts, sm in mine:
                busy += sm / 100.0 * (ts - prev) / 1e6
                prev = ts
            last_seen = max([last_seen] + [s.ts for s in samples[:n.value]])
        if not alive(pid) or time.monotonic() - start >= seconds:
            break
        time.sleep(0.25)
    print(json.dumps({"pid": pid, "used_bytes": used, "busy_s": busy,
                      "polled_s": time.monotonic() - start}), flush=True)
    lib.nvmlShutdown()


if __name__ == "__main__":
    main()
