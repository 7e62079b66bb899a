"""Step 6, the latency tier: the parts that need no GPU (tested by test_latency.py).

- `serve(request, ...)`: the latency tenant's open loop. Requests arrive at Poisson times (mean
  gap `gap_ms`); each is `request()` (a few small kernels and a synchronise); its latency is
  arrival to completion, so a request that arrives while the previous one still runs counts
  its wait too (as `compute_tenant --requests` in benches/src/bin/latency_tier.rs does).
- `quantile` / `summary`: the same quantile as latency_tier (the ceil(n q)-th smallest).
- `rows(...)`: the table rows run.sh prints, from the tenants' JSON lines: each mode's p50 and
  p99 against the latency tenant alone (latency_tier's `p50/alone` and `p99/alone`), and the
  best-effort work under the tier against plain time-slicing.
- `parse(argv)`: the workloads' arguments (torch_latency.py, bindings_latency.py).

Command line (run.sh): `_latency.py rows alone=F plain=F,G.. shares=F,G.. tier=F,G..` prints one
row per line, tab-separated (measure, result, target, met); in each list the first file is the
latency tenant's, the rest the best-effort tenants'.
"""
import argparse
import json
import math
import random
import sys
import time

# The targets for best-effort kernels of 1-10 ms (a request cannot preempt a kernel in
# flight, so p50 may pay part of one: docs/compute.md, "Tiers").
P50_TARGET = 1.5
P99_TARGET = 1.2
# Best-effort work kept under the tier, against plain time-slicing beside the same service.
BE_TARGET = 0.85

MODES = (("plain", "time-slicing (no Tessera)"), ("shares", "Tessera, shares only"),
         ("tier", "Tessera, latency tier"))


def parse(argv):
    """The workloads' arguments: `serve` (the latency tenant) or `train` (a best-effort one)."""
    p = argparse.ArgumentParser(prog="latency workload")
    p.add_argument("role", choices=("serve", "train"))
    p.add_argument("seconds", type=float, help="wall time of the loop after the start line")
    p.add_argument("--gap-ms", type=float, default=10.0, help="serve: mean gap between requests")
    p.add_argument("--kernels", type=int, default=4, help="serve: kernels per request")
    p.add_argument("--size", type=int, default=0,
                   help="serve: matrix side (PyTorch) or kernel us (cuda-bindings); "
                        "train: model width (PyTorch) or longest kernel us (cuda-bindings)")
    p.add_argument("--delay", type=float, default=1.0,
                   help="serve: seconds after the start line before the first arrival (the "
                        "best-effort tenants fill the GPU first)")
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args(argv)
    if a.seconds <= 0 or a.gap_ms <= 0 or a.kernels < 1 or a.size < 0 or a.delay < 0:
        p.error("seconds and --gap-ms must be positive, --kernels at least 1, --size and "
                "--delay not negative")
    return a


def serve(request, seconds, gap_ms, seed=1, clock=time.monotonic, sleep=time.sleep):
    """Runs `request()` at Poisson arrivals for `seconds`; returns each latency in seconds."""
    rng = random.Random(seed)
    start = clock()
    arrival = start + rng.expovariate(1000.0 / gap_ms)
    latencies = []
    while arrival < start + seconds:
        now = clock()
        if now < arrival:
            sleep(arrival - now)
        request()
        latencies.append(clock() - arrival)
        arrival += rng.expovariate(1000.0 / gap_ms)
    return latencies


def emit(obj):
    """Prints `obj` as the workload's one JSON line."""
    print(json.dumps(obj), flush=True)


def quantile(values, q):
    """The `q` quantile (0..1) of sorted `values`: latency_tier's ceil(n q)-th smallest."""
    if not values:
        return math.nan
    i = min(max(math.ceil(len(values) * q), 1), len(values)) - 1
    return values[i]


def summary(latencies_s):
    """p50, p99, p99.9 and mean in ms of `latencies_s`, and their number."""
    v = sorted(latencies_s)
    ms = lambda x: round(x * 1000.0, 4)  # noqa: E731
    return {"requests": len(v), "p50_ms": ms(quantile(v, 0.5)), "p99_ms": ms(quantile(v, 0.99)),
            "p999_ms": ms(quantile(v, 0.999)),
            "mean_ms": ms(sum(v) / len(v)) if v else math.nan}


def _load(path):
    """The last JSON line of `path`, or None."""
    try:
        with open(path) as f:
            lines = [l for l in f.read().splitlines() if l.startswith("{")]
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None


def _why(path):
    """`path`'s name and the last line its command wrote to stderr (`NAME.err` beside it)."""
    name = path.rsplit("/", 1)[-1].rsplit(".", 1)[0]
    try:
        with open(path.rsplit(".", 1)[0] + ".err") as f:
            last = [l.strip() for l in f.read().splitlines() if l.strip()][-1:]
    except OSError:
        last = []
    return f"{name} ({last[0][:100]})" if last else name


def rows(runs):
    """Table rows (measure, result, target, met) from `runs`: mode -> [latency tenant's JSON
    path, best-effort tenants' JSON paths...] for modes `alone`, `plain`, `shares`, `tier`."""
    got = {m: [(p, _load(p)) for p in paths] for m, paths in runs.items()}
    out = []
    missing = lambda m: ", ".join(_why(p) for p, j in got.get(m, []) if j is None)  # noqa: E731
    alone = got.get("alone", [(None, None)])[0][1]
    if alone is None or not alone.get("requests"):
        out.append(("latency tenant alone (no Tessera)",
                    f"failed: no result from {missing('alone') or 'it'}", "-", "NO"))
        return out
    out.append(("latency tenant alone (no Tessera)",
                f"p50 {alone['p50_ms']:.2f} ms, p99 {alone['p99_ms']:.2f} ms, "
                f"{alone['requests']} requests", "-", "-"))
    be_per_s = {}
    for mode, label in MODES:
        tenants = got.get(mode)
        if not tenants:
            continue
        lat = tenants[0][1]
        be = [j for _, j in tenants[1:]]
        target = (f"p50 ≤ {P50_TARGET}x, p99 ≤ {P99_TARGET}x alone" if mode == "tier" else "-")
        if lat is None or not lat.get("requests") or any(j is None for j in be):
            out.append((f"beside {len(be)} best-effort: {label}",
                        f"failed: no result from {missing(mode)}", target, "NO"))
            continue
        r50, r99 = lat["p50_ms"] / alone["p50_ms"], lat["p99_ms"] / alone["p99_ms"]
        be_per_s[mode] = sum(j["per_s"] for j in be)
        kernel = [j["kernel_ms"] for j in be if j.get("kernel_ms")]
        floor = (f"; a best-effort kernel ≈ {sum(kernel) / len(kernel):.2f} ms"
                 if mode == "tier" and kernel else "")
        met = ("yes" if r50 <= P50_TARGET and r99 <= P99_TARGET else "NO") if mode == "tier" \
            else "-"
        out.append((f"beside {len(be)} best-effort: {label}",
                    f"p50 {lat['p50_ms']:.2f} ms ({r50:.2f}x), p99 {lat['p99_ms']:.2f} ms "
                    f"({r99:.2f}x alone), {lat['requests']} requests{floor}", target, met))
    if "tier" in be_per_s and be_per_s.get("plain"):
        k = be_per_s["tier"] / be_per_s["plain"]
        out.append(("best-effort work under the tier / under time-slicing",
                    f"{k:.2f} ({be_per_s['tier']:.4g} vs {be_per_s['plain']:.4g} per s)",
                    f"≥ {BE_TARGET}", "yes" if k >= BE_TARGET else "NO"))
    return out


def main(argv):
    if len(argv) < 2 or argv[0] != "rows":
        sys.exit("usage: _latency.py rows alone=F plain=F,G.. shares=F,G.. tier=F,G..")
    runs = {}
    for arg in argv[1:]:
        mode, _, paths = arg.partition("=")
        if mode not in ("alone", "plain", "shares", "tier") or not paths:
            sys.exit(f"_latency.py: bad argument {arg!r}")
        runs[mode] = paths.split(",")
    for r in rows(runs):
        print("\t".join(x.replace("\t", " ").replace("|", "/") for x in r))


if __name__ == "__main__":
    main(sys.argv[1:])
