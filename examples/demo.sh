#!/usr/bin/env bash
# Tessera's main job, on the simulated GPU (no hardware needed):
# one arbiter, two tenants sharing one 80 GiB card with different memory limits and compute
# shares, and `tessera status` while they run.
#
#   bash examples/demo.sh            # 30/70 shares, 6 s of work each
#   SECONDS_EACH=10 bash examples/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${SECONDS_EACH:-6}
share_a=30 share_b=70
echo "== building (cargo build)"
cargo build --quiet -p tessera-cli -p tessera-arbiter -p tessera-sim-cuda -p tessera-sim-nvml \
    -p tessera-interpose -p tessera-examples
bin=${CARGO_TARGET_DIR:-target}/debug

work=$(mktemp -d /tmp/tessera-demo.XXXXXX)
arbiter_pid=
cleanup() {
    if [ -n "$arbiter_pid" ]; then
        kill "$arbiter_pid" 2>/dev/null || true
        wait "$arbiter_pid" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

# Everything below shares one simulated machine (state folder) and one arbiter (sockets).
export TESSERA_SIM_GPUS=1x80GiB TESSERA_SIM_DIR=$work/sim
export TESSERA_SOCKET=$work/tessera.sock TESSERA_ADMIN_SOCKET=$work/admin.sock
sim() { "$bin/tessera" sim --lib-dir "$bin" -- "$@"; }
# Background jobs exec so that $! is the process itself, not a subshell around it.
sim_bg() { exec "$bin/tessera" sim --lib-dir "$bin" -- "$@"; }

echo "== starting the arbiter (state in $work/state)"
# No metrics port: a node arbiter may already serve 127.0.0.1:9464.
sim_bg "$bin/tessera-arbiter" --state-dir "$work/state" --metrics-addr none 2>"$work/arbiter.log" &
arbiter_pid=$!
for _ in $(seq 100); do [ -S "$TESSERA_ADMIN_SOCKET" ] && break; sleep 0.05; done
[ -S "$TESSERA_ADMIN_SOCKET" ] || { cat "$work/arbiter.log"; exit 1; }

echo "== two tenants on GPU 0: A (8 GiB, share $share_a) and B (16 GiB, share $share_b), each asking for 12 GiB"
sim_bg "$bin/tessera" run --memory 8GiB --share "$share_a" -- \
    "$bin/tenant" --name A --grab-gib 12 --seconds "$seconds" > "$work/a.out" &
a=$!
sim_bg "$bin/tessera" run --memory 16GiB --share "$share_b" -- \
    "$bin/tenant" --name B --grab-gib 12 --seconds "$seconds" > "$work/b.out" &
b=$!
sleep $(( seconds / 2 ))
echo "== tessera status (while they run)"
sim "$bin/tessera" status
wait "$a" "$b"
echo "== what each tenant saw and got"
cat "$work/a.out" "$work/b.out"
# Shares divide the GPU's busy time, not the wall time (the card idles a little at each lease
# hand-off): each tenant's GPU time over both tenants' together, against its share's part of
# the shares. Both run for the same seconds from the same moment, so their times overlap.
echo "== each tenant's share of the GPU's busy time"
awk -v sa="$share_a" -v sb="$share_b" '
    / s of GPU time in / {
        for (i = 1; i < NF; i++) if ($(i + 1) == "s" && $(i + 2) == "of" && $(i + 3) == "GPU") gpu[FNR == NR ? "A" : "B"] = $i
        for (i = 1; i < NF; i++) if ($i == "in" && $(i + 2) == "s") wall = ($(i + 1) > wall ? $(i + 1) : wall)
    }
    END {
        total = gpu["A"] + gpu["B"]
        if (total <= 0) { print "no GPU time measured"; exit 1 }
        printf "A: %.1f%% of busy time (target %.0f%%)\n", 100 * gpu["A"] / total, 100 * sa / (sa + sb)
        printf "B: %.1f%% of busy time (target %.0f%%)\n", 100 * gpu["B"] / total, 100 * sb / (sa + sb)
        printf "(the GPU was busy %.0f%% of the %.1f s)\n", 100 * total / wall, wall
    }' "$work/a.out" "$work/b.out"
echo "== tessera status (after they exit: allocations deleted)"
sim "$bin/tessera" status
