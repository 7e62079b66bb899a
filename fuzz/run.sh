#!/usr/bin/env bash
# Runs fuzz targets with `cargo afl fuzz`, PAR at a time, each for SECS seconds, then prints
# each target's executions, corpus size, edge coverage and crashes (from fuzzer_stats).
#   fuzz/run.sh [SECS] [PAR] [TARGET...]     (default: 600 s, 2 at a time, every target)
# Findings land in fuzz/out/<target>/default/{crashes,hangs,queue}.
set -euo pipefail
cd "$(dirname "$0")"
secs=${1:-600}; par=${2:-2}; shift $(( $# > 2 ? 2 : $# )) || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(frame_stream hello server_hello tenant_request tenant_reply admin_request admin_reply identity)

nice -n 15 cargo afl build --release -j 1
export AFL_NO_UI=1 AFL_SKIP_CPUFREQ=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 AFL_NO_AFFINITY=1
running=0
for t in "${targets[@]}"; do
    mkdir -p out
    # -V: stop after $secs seconds; a resumed run (-i -) keeps the earlier queue.
    input=corpus/$t; [ -d "out/$t/default/queue" ] && input=-
    nice -n 15 cargo afl fuzz -V "$secs" -i "$input" -o "out/$t" "target/release/$t" \
        > "out/$t.log" 2>&1 &
    running=$((running + 1))
    if [ "$running" -ge "$par" ]; then wait -n || true; running=$((running - 1)); fi
done
wait || true

printf '%-16s %12s %10s %10s %8s %8s %6s\n' target execs execs/s corpus edges bitmap crashes
for t in "${targets[@]}"; do
    s=out/$t/default/fuzzer_stats
    [ -f "$s" ] || { echo "$t: no stats (see out/$t.log)"; continue; }
    v() { awk -F' *: *' -v k="$1" '$1==k {print $2}' "$s"; }
    printf '%-16s %12s %10s %10s %8s %8s %6s\n' "$t" "$(v execs_done)" "$(v execs_per_sec)" \
        "$(v corpus_count)" "$(v edges_found)/$(v total_edges)" "$(v bitmap_cvg)" "$(v saved_crashes)"
done
