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

echo "== two tenants on GPU 0: A (8 GiB, share 30) and B (16 GiB, share 70), each asking for 12 GiB"
sim_bg "$bin/tessera" run --memory 8GiB --share 30 -- \
    "$bin/tenant" --name A --grab-gib 12 --seconds "$seconds" > "$work/a.out" &
a=$!
sim_bg "$bin/tessera" run --memory 16GiB --share 70 -- \
    "$bin/tenant" --name B --grab-gib 12 --seconds "$seconds" > "$work/b.out" &
b=$!
sleep $(( seconds / 2 ))
echo "== tessera status (while they run)"
sim "$bin/tessera" status
wait "$a" "$b"
echo "== what each tenant saw and got"
cat "$work/a.out" "$work/b.out"
echo "== tessera status (after they exit: allocations deleted)"
sim "$bin/tessera" status
