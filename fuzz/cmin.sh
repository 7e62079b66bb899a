#!/usr/bin/env bash
# Minimises the AFL queue of each target given (default: all with a queue in out/) into
# corpus/<target>/q-NNNN, replacing the previous q-* files (seed-* stay).
# Uses afl-cmin.bash: the Python afl-cmin that `cargo afl cmin` runs (AFL++ 4.3x) recorded
# no tuples for these persistent-mode Rust targets.
set -euo pipefail
cd "$(dirname "$0")"
bin=$(ls -d "${XDG_DATA_HOME:-$HOME/.local/share}"/afl.rs/rustc-*/afl.rs-*/afl/bin | tail -1)
export AFL_PATH=$bin AFL_SKIP_CPUFREQ=1 AFL_NO_AFFINITY=1
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=($(ls out/*/default/queue -d 2>/dev/null | cut -d/ -f2))
for t in "${targets[@]}"; do
    rm -rf "min/$t"
    mkdir -p min
    nice -n 15 "$bin/afl-cmin.bash" -i "out/$t/default/queue" -o "min/$t" -- "target/release/$t" \
        > "min/$t.log" 2>&1 || { echo "$t: afl-cmin failed, see min/$t.log"; continue; }
    rm -f "corpus/$t"/q-*
    i=0
    for f in "min/$t"/*; do cp "$f" "corpus/$t/$(printf 'q-%04d' $i)"; i=$((i + 1)); done
    echo "$t: $i files, $(cat "corpus/$t"/q-* | wc -c) bytes"
done
