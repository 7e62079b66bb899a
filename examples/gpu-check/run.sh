#!/usr/bin/env bash
# Tessera on a GPU, end to end: memory limit, compute shares, cap, overhead, ledger vs NVML,
# the latency tier, MIG (read only). Starts its own arbiter (temp folder: sockets, state), runs seven steps, prints as it goes and
# writes a markdown table of results (stdout and --out FILE). See examples/gpu-check/README.md.
#
#   cargo build --release --workspace && bash examples/gpu-check/run.sh
#
# Without a GPU (no working `nvidia-smi -L`, no libcuda.so.1 with a device) everything runs on
# the simulated GPU through `tessera sim`, and the PyTorch/CuPy/JAX steps are skipped (the
# cuda-bindings workloads stand in where they can).
set -u

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)

usage() {
    cat <<EOF
usage: bash examples/gpu-check/run.sh [options]
  --out FILE            markdown table of results (default gpu-check.md)
  --bin DIR             Tessera binaries (default target/release, else target/debug)
  --python PY           Python for PyTorch/CuPy/JAX (default \$TESSERA_PYTHON, else python3)
  --share-seconds S     each run of steps 2 and 3 (default 20)
  --bench-seconds S     each measurement of step 4 (default 5)
  --ledger-seconds S    the tenant of step 5 (default 6)
  --latency-seconds S   each of the four runs of step 6, the latency tier (default 20; 0 skips it)
  --latency-best-effort N  best-effort tenants beside the latency service in step 6 (1-4, default 2)
  --fraction PCT        memory and share of the limited tenant (default 30)
  --sim                 use the simulated GPU even if a real one is present
  --enforce kill|report the arbiter's memory backstop (default report: a check is never killed)
  --slack S             seconds each command may take beyond its own (imports, CUDA start-up;
                        default 120): a hung command costs this much
  --keep                keep the temp folder (logs, JSON) afterwards
EOF
}

out=gpu-check.md bin= py=${TESSERA_PYTHON:-python3} share_s=20 bench_s=5 ledger_s=6 lat_s=20 lat_be=2 pct=30
force_sim=0 enforce=report keep=0 slack=120
while [ $# -gt 0 ]; do
    case $1 in
        --out) out=${2?"$1 needs a value"}; shift ;;
        --bin) bin=${2?"$1 needs a value"}; shift ;;
        --python) py=${2?"$1 needs a value"}; shift ;;
        --share-seconds) share_s=${2?"$1 needs a value"}; shift ;;
        --bench-seconds) bench_s=${2?"$1 needs a value"}; shift ;;
        --ledger-seconds) ledger_s=${2?"$1 needs a value"}; shift ;;
        --latency-seconds) lat_s=${2?"$1 needs a value"}; shift ;;
        --latency-best-effort) lat_be=${2?"$1 needs a value"}; shift ;;
        --fraction) pct=${2?"$1 needs a value"}; shift ;;
        --sim) force_sim=1 ;;
        --enforce) enforce=${2?"$1 needs a value"}; shift ;;
        --slack) slack=${2?"$1 needs a value"}; shift ;;
        --keep) keep=1 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu-check: unknown argument $1" >&2; usage >&2; exit 2 ;;
    esac
    shift
done

[ "$ledger_s" -le 8 ] 2>/dev/null || { echo "gpu-check: --ledger-seconds is a whole number up to 8 (the ledger's window is 10 s)" >&2; exit 2; }
case $lat_s in ''|*[!0-9]*) echo "gpu-check: --latency-seconds is a whole number of seconds (0 skips step 6)" >&2; exit 2 ;; esac
case $lat_be in [1-4]) ;; *) echo "gpu-check: --latency-best-effort is 1 to 4" >&2; exit 2 ;; esac
case $slack in ''|*[!0-9]*|0) echo "gpu-check: --slack is a whole number of seconds, at least 1" >&2; exit 2 ;; esac
say() { printf '== %s\n' "$*" >&2; }
die() { printf 'gpu-check: %s\n' "$*" >&2; exit 1; }

if [ -z "$bin" ]; then
    bin=$root/target/release
    [ -x "$bin/tessera" ] || bin=$root/target/debug
fi
bin=$(cd "$bin" 2>/dev/null && pwd) || die "no binaries folder $bin (cargo build --release --workspace)"
for f in tessera tessera-arbiter libtessera_interpose.so; do
    [ -e "$bin/$f" ] || die "$bin/$f is missing: run cargo build --release --workspace"
done
command -v python3 >/dev/null || die "python3 is needed (it reads the JSON results)"
command -v timeout >/dev/null || die "timeout (coreutils) is needed"

# ---------------------------------------------------------------- real GPU or simulated one
real=0
if [ $force_sim = 0 ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        real=1
    elif timeout 30 python3 -c '
import ctypes, sys
cu = ctypes.CDLL("libcuda.so.1"); n = ctypes.c_int(0)
sys.exit(0 if cu.cuInit(0) == 0 and cu.cuDeviceGetCount(ctypes.byref(n)) == 0 and n.value > 0 else 1)
' >/dev/null 2>&1; then
        real=1
    fi
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/tessera-gpu-check.XXXXXX")
export TESSERA_SOCKET=$work/tessera.sock TESSERA_ADMIN_SOCKET=$work/admin.sock
W=()
if [ $real = 1 ]; then
    where="real GPU: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader -i 0 2>/dev/null || echo 'libcuda.so.1')"
else
    for f in libtessera_sim_cuda.so libtessera_sim_nvml.so; do
        [ -e "$bin/$f" ] || die "$bin/$f is missing (the simulated GPU): cargo build --workspace"
    done
    export TESSERA_SIM_GPUS=${TESSERA_SIM_GPUS:-1x80GiB} TESSERA_SIM_DIR=$work/sim
    W=("$bin/tessera" sim --lib-dir "$bin" --)
    where="SIMULATED GPU ($TESSERA_SIM_GPUS through \`tessera sim\`; no real GPU found)"
fi
# GPU: a command on the GPU (through `tessera sim` on the simulated one); TR: `tessera run` on it.
GPU=("${W[@]+"${W[@]}"}")
TR=("${W[@]+"${W[@]}"}" "$bin/tessera" run)
gpu() { "${GPU[@]+"${GPU[@]}"}" "$@"; }

arbiter_pid=
bg_pids=()
cleanup() {
    for p in "${bg_pids[@]+"${bg_pids[@]}"}" $arbiter_pid; do
        kill "$p" 2>/dev/null
        wait "$p" 2>/dev/null
    done
    if [ $keep = 1 ]; then say "kept $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

say "Tessera gpu-check on the $where"
say "binaries: $bin; work folder: $work"

# ---------------------------------------------------------------- helpers
rows=$work/rows.md
: >"$rows"
# row STEP MEASURE RESULT TARGET MET
row() {
    printf '| %s | %s | %s | %s | %s |\n' "$1" "$2" "$3" "$4" "$5" >>"$rows"
    printf '   %s %s: %s (target: %s) %s\n' "$1" "$2" "$3" "$4" "$5" >&2
}
# q EXPR NAME=FILE...: evaluates a Python expression over the last JSON line of each FILE.
q() {
    python3 - "$@" <<'EOF'
import json, sys
env = {}
for arg in sys.argv[2:]:
    name, path = arg.split("=", 1)
    try:
        text = open(path).read()
        try:
            env[name] = json.loads(text)
        except ValueError:
            env[name] = json.loads([l for l in text.splitlines() if l.startswith("{")][-1])
    except Exception:
        env[name] = None
try:
    print(eval(sys.argv[1], {"GiB": 1 << 30, "MiB": 1 << 20, "round": round, "abs": abs}, env))
except Exception as e:
    print("?(%s)" % type(e).__name__)
EOF
}
# has_json FILE: the command wrote its JSON line.
has_json() { grep -q '^{' "$1" 2>/dev/null; }
# why NAME: the last line a failed command wrote (for the table).
why() {
    local line
    line=$(grep -v '^\s*$' "$work/$1.err" 2>/dev/null | tail -n 1 | tr '|' '/' | cut -c1-120)
    echo "failed (exit $(cat "$work/$1.rc" 2>/dev/null || echo '?')): ${line:-no output}"
}
# job NAME LIMIT CMD...: runs CMD with a time limit, stdout to NAME.json, stderr to NAME.err.
job() {
    local name=$1 limit=$2
    shift 2
    timeout -k 5 "$limit" "$@" >"$work/$name.json" 2>"$work/$name.err"
    echo $? >"$work/$name.rc"
}
status_json() { timeout 20 "$bin/tessera" status --json; }

# Python: PyTorch (and CuPy, JAX) from --python; cuda-bindings from it or the repo's .venv.
has_mod() { timeout 60 "$1" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('$2') else 1)" >/dev/null 2>&1; }
bpy=
for cand in "$py" "$root/.venv/bin/python"; do
    if timeout 60 "$cand" -c 'import cuda.bindings.driver' >/dev/null 2>&1; then bpy=$cand; break; fi
done
lib_skip() { # lib_skip MODULE NAME: why a library's steps do not run, or nothing.
    if ! has_mod "$py" "$1"; then echo "skipped: $2 not installed"
    elif [ $real = 0 ]; then echo "skipped: simulated GPU ($2 needs a real one)"
    fi
}
torch_skip=$(lib_skip torch PyTorch)
cupy_skip=$(lib_skip cupy CuPy)
jax_skip=$(lib_skip jax JAX)
bindings_note=
[ -n "$bpy" ] || bindings_note="skipped: no Python with cuda-bindings (.ci/test creates .venv)"
say "python: $py (PyTorch: ${torch_skip:-yes}); cuda-bindings: ${bpy:-none}"

pct_of() { python3 -c "print(int($1 * $2 / 100) // (1 << 20) << 20)"; }
gib() { python3 -c "print('%.2f GiB' % ($1 / (1 << 30)))"; }
# Each Python run: start-up (imports, context, cuBLAS) plus its seconds; $slack (--slack) is
# that start-up's allowance.

# ---------------------------------------------------------------- arbiter
say "starting the arbiter (--enforce $enforce)"
(exec "${GPU[@]+"${GPU[@]}"}" "$bin/tessera-arbiter" --state-dir "$work/state" --enforce "$enforce" --metrics-addr none 2>"$work/arbiter.log") &
arbiter_pid=$!
for _ in $(seq 200); do [ -S "$TESSERA_ADMIN_SOCKET" ] && break; sleep 0.05; done
[ -S "$TESSERA_ADMIN_SOCKET" ] || { tail -n 20 "$work/arbiter.log" >&2; die "the arbiter did not start"; }
status_json >"$work/status0.json" || die "tessera status --json failed"
total=$(q 'j["gpus"][0]["memory_total"]' j="$work/status0.json")
gpu_name=$(q 'j["gpus"][0]["name"]' j="$work/status0.json")
case $total in ''|*[!0-9]*) die "cannot read GPU 0's memory from tessera status --json: $(head -c 300 "$work/status0.json")" ;; esac
limit=$(pct_of "$total" "$pct")
rest=$(pct_of "$total" $(( 90 - pct )))
say "GPU 0: $gpu_name, $(gib "$total"); the limited tenant gets --memory $limit ($(gib "$limit"), ${pct}%) --share $pct"

# ---------------------------------------------------------------- step 1: memory limit
say "step 1: memory limit under --memory $limit --share $pct"
s1="1 limit ${pct}%"
if [ -z "$torch_skip" ]; then
    job t1_default $slack "${TR[@]}" --memory "${limit}B" --share "$pct" -- "$py" "$here/torch_limit.py" "$limit"
    job t1_vmm $slack env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        "${TR[@]}" --memory "${limit}B" --share "$pct" -- "$py" "$here/torch_limit.py" "$limit"
    if has_json "$work/t1_default.json"; then
        row "$s1" "torch.cuda.mem_get_info() total" "$(q '"%.2f GiB" % (j["total"] / GiB)' j="$work/t1_default.json")" \
            "= limit ($(gib "$limit"))" "$(q '"yes" if j["total"] == j["limit"] else "NO"' j="$work/t1_default.json")"
    else
        row "$s1" "torch.cuda.mem_get_info() total" "$(why t1_default)" "= limit" "NO"
    fi
    for v in default vmm; do
        label="caching allocator"; [ $v = vmm ] && label="expandable_segments:True (VMM)"
        if has_json "$work/t1_$v.json"; then
            row "$s1" "$label: torch.OutOfMemoryError at the limit" \
                "$(q '"refused after %.2f GiB" % (j["held"] / GiB) if j["refused_oom"] else "not refused (%.2f GiB held)" % (j["held"] / GiB)' j="$work/t1_$v.json")" \
                "refused within 512 MiB of the limit" \
                "$(q '"yes" if j["refused_oom"] and j["free"] - 512 * MiB <= j["held"] <= j["free"] else "NO"' j="$work/t1_$v.json")"
        else
            row "$s1" "$label: torch.OutOfMemoryError at the limit" "$(why "t1_$v")" "refused at the limit" "NO"
        fi
    done
else
    row "$s1" "PyTorch: mem_get_info, OutOfMemoryError, caching allocator and expandable_segments" "$torch_skip" "= limit; refused at the limit" "-"
fi
if [ -n "$bpy" ] && [ -n "$torch_skip" ]; then
    job b1 $slack "${TR[@]}" --memory "${limit}B" --share "$pct" -- "$bpy" "$here/bindings_limit.py" "$limit"
    if has_json "$work/b1.json"; then
        row "$s1" "cuda-bindings: cuMemGetInfo total" "$(q '"%.2f GiB" % (j["total"] / GiB)' j="$work/b1.json")" \
            "= limit ($(gib "$limit"))" "$(q '"yes" if j["total"] == j["limit"] else "NO"' j="$work/b1.json")"
        row "$s1" "cuda-bindings: cuMemAlloc refused at the limit" \
            "$(q '("CUDA_ERROR_OUT_OF_MEMORY after %.2f GiB" if j["plain_refused_oom"] else "not refused (%.2f GiB)") % (j["plain_held"] / GiB)' j="$work/b1.json")" \
            "refused within 64 MiB of the limit" \
            "$(q '"yes" if j["plain_refused_oom"] and j["free"] - 64 * MiB < j["plain_held"] <= j["free"] else "NO"' j="$work/b1.json")"
        row "$s1" "cuda-bindings: cuMemCreate (VMM) counted" \
            "$(q '("CUDA_ERROR_OUT_OF_MEMORY after %.2f GiB" if j["vmm_refused_oom"] else "not refused (%.2f GiB)") % (j["vmm_held"] / GiB)' j="$work/b1.json")" \
            "refused at the limit" "$(q '"yes" if j["vmm_refused_oom"] and j["vmm_held"] <= j["limit"] else "NO"' j="$work/b1.json")"
    else
        row "$s1" "cuda-bindings: limit and refusal" "$(why b1)" "= limit; refused at the limit" "NO"
    fi
elif [ -n "$torch_skip" ]; then
    row "$s1" "cuda-bindings: limit and refusal" "$bindings_note" "= limit; refused at the limit" "-"
fi
if command -v nvidia-smi >/dev/null 2>&1 && [ $real = 1 ]; then
    job smi 60 "${TR[@]}" --memory "${limit}B" --share "$pct" -- nvidia-smi -i 0 --query-gpu=memory.total --format=csv,noheader,nounits
    if [ "$(cat "$work/smi.rc")" = 0 ]; then
        smi=$(head -n 1 "$work/smi.json" | tr -dc 0-9)
        row "$s1" "nvidia-smi inside: memory.total" "${smi} MiB" "= limit ($((limit >> 20)) MiB)" \
            "$([ "${smi:-0}" = $((limit >> 20)) ] && echo yes || echo NO)"
    else
        row "$s1" "nvidia-smi inside: memory.total" "$(why smi)" "= limit" "NO"
    fi
else
    row "$s1" "nvidia-smi inside: memory.total" "skipped: no nvidia-smi (no real GPU)" "= limit" "-"
fi

# ---------------------------------------------------------------- steps 2 and 3: compute
if [ -z "$torch_skip" ]; then
    worker=("$py" "$here/torch_matmul.py") wname="bf16 8192^2 matmuls"
elif [ -n "$bpy" ]; then
    # 1 ms kernels on the simulated GPU; 2 ms spin loops on a real one.
    worker=("$bpy" "$here/bindings_spin.py") wname="cuda-bindings spin kernels"
else
    worker=()
fi
w_args() { # w_args SECONDS: the worker's arguments
    if [ -z "$torch_skip" ]; then echo "$1"; else echo "$1 1000"; fi
}
s2="2 shares $pct/$((100 - pct))"
s3="3 cap $pct%"
if [ ${#worker[@]} = 0 ]; then
    row "$s2" "split of work" "$torch_skip; $bindings_note" "within 3 points of $pct/$((100 - pct))" "-"
    row "$s3" "throughput capped / uncapped" "$torch_skip; $bindings_note" "$pct% ± 3" "-"
else
    [ -n "$torch_skip" ] && row "$s2" "PyTorch bf16 matmuls" "$torch_skip (cuda-bindings spin kernels instead)" "-" "-"
    say "step 2: one tenant alone, then shares $pct and $((100 - pct)) together, ${share_s}s each ($wname)"
    job alone $((share_s + slack)) "${TR[@]}" --memory "${limit}B" --share "$pct" -- "${worker[@]}" $(w_args "$share_s")
    mkdir -p "$work/barrier"
    GPUCHECK_BARRIER=$work/barrier timeout -k 5 $((share_s + slack)) \
        "${TR[@]}" --memory "${limit}B" --share "$pct" -- "${worker[@]}" $(w_args "$share_s") \
        >"$work/a.json" 2>"$work/a.err" &
    a=$!
    GPUCHECK_BARRIER=$work/barrier timeout -k 5 $((share_s + slack)) \
        "${TR[@]}" --memory "${rest}B" --share $((100 - pct)) -- "${worker[@]}" $(w_args "$share_s") \
        >"$work/b.json" 2>"$work/b.err" &
    b=$!
    bg_pids=("$a" "$b")
    for _ in $(seq $((slack * 10))); do
        [ "$(find "$work/barrier" -name 'ready.*' | wc -l)" -ge 2 ] && break
        kill -0 "$a" 2>/dev/null && kill -0 "$b" 2>/dev/null || break
        sleep 0.1
    done
    touch "$work/barrier/go"
    sleep $(( share_s / 2 ))
    status_json >"$work/status2.json"
    wait "$a"; echo $? >"$work/a.rc"
    wait "$b"; echo $? >"$work/b.rc"
    bg_pids=()
    if has_json "$work/a.json" && has_json "$work/b.json"; then
        row "$s2" "work done ($wname)" "$(q '"%d vs %d" % (a["work"], b["work"])' a="$work/a.json" b="$work/b.json")" "-" "-"
        row "$s2" "split of work" "$(q '"%.1f / %.1f" % (100 * a["work"] / (a["work"] + b["work"]), 100 * b["work"] / (a["work"] + b["work"]))' a="$work/a.json" b="$work/b.json")" \
            "within 3 points of $pct/$((100 - pct))" \
            "$(q '"yes" if abs(100 * a["work"] / (a["work"] + b["work"]) - '"$pct"') <= 3 else "NO"' a="$work/a.json" b="$work/b.json")"
        if has_json "$work/alone.json"; then
            row "$s2" "total throughput vs one tenant alone" "$(q '"%.3f" % ((a["per_s"] + b["per_s"]) / o["per_s"])' a="$work/a.json" b="$work/b.json" o="$work/alone.json")" \
                "≈ 1 (sharing loses nothing)" "$(q '"yes" if (a["per_s"] + b["per_s"]) / o["per_s"] >= 0.95 else "NO"' a="$work/a.json" b="$work/b.json" o="$work/alone.json")"
        else
            row "$s2" "total throughput vs one tenant alone" "$(why alone)" "≈ 1" "NO"
        fi
    else
        row "$s2" "split of work" "$(has_json "$work/a.json" || why a) $(has_json "$work/b.json" || why b)" "within 3 points" "NO"
    fi

    say "step 3: a capped $pct% tenant alone, ${share_s}s"
    # The cap promises GPU time: the arbiter's ledger is read near the end of the run (its
    # window is 10 s). Throughput is shown too: on a card it runs above the cap, since a card
    # that idles 70% of the time runs each kernel faster (clock and power headroom: 33% on an
    # H200 for 29.9% of GPU time).
    rm -rf "$work/barrier3"; mkdir -p "$work/barrier3"
    GPUCHECK_BARRIER=$work/barrier3 timeout -k 5 $((share_s + slack)) \
        "${TR[@]}" --memory "${limit}B" --share "$pct" --cap -- "${worker[@]}" $(w_args "$share_s") \
        >"$work/capped.json" 2>"$work/capped.err" &
    c3=$!
    bg_pids=("$c3")
    for _ in $(seq $((slack * 10))); do
        [ -n "$(find "$work/barrier3" -name 'ready.*')" ] && break
        kill -0 "$c3" 2>/dev/null || break
        sleep 0.1
    done
    go3=$(date +%s.%N)
    touch "$work/barrier3/go"
    sleep $(( (share_s < 10 ? share_s : 10) - 1 ))
    status_json >"$work/status3.json"
    el3=$(python3 -c "import time; print(min(10.0, time.time() - $go3))")
    wait "$c3"; echo $? >"$work/capped.rc"
    bg_pids=()
    if has_json "$work/capped.json"; then
        g3='[x for x in s["gpus"][0]["allocations"] if x["processes"] > 0 and x["cap"]][0]["gpu_time_10s_ns"] / 1e9 / '"$el3"
        row "$s3" "GPU time capped / wall (the arbiter's ledger, first $(printf '%.1f' "$el3") s)" "$(q '"%.1f%%" % (100 * '"$g3"')' s="$work/status3.json")" \
            "$pct% ± 3" "$(q '"yes" if abs(100 * '"$g3"' - '"$pct"') <= 3 else "NO"' s="$work/status3.json")"
    else
        row "$s3" "GPU time capped / wall" "$(why capped)" "$pct% ± 3" "NO"
    fi
    if has_json "$work/capped.json" && has_json "$work/alone.json"; then
        row "$s3" "throughput capped / uncapped ($wname)" "$(q '"%.1f%%" % (100 * c["per_s"] / o["per_s"])' c="$work/capped.json" o="$work/alone.json")" \
            "≈ $pct% (above it on a card: see GPU time)" "-"
    else
        row "$s3" "throughput capped / uncapped" "$(has_json "$work/capped.json" && why alone || why capped)" "≈ $pct%" "-"
    fi
fi

# ---------------------------------------------------------------- step 4: overhead
s4="4 overhead"
full=$(pct_of "$total" 90)
overhead_rows() { # overhead_rows KIND LABEL: rows from bare_KIND.json and tess_KIND.json
    local kind=$1 what=$2
    if has_json "$work/bare_$kind.json" && has_json "$work/tess_$kind.json"; then
        for m in large tiny graph; do
            case $m in
                large) label="large kernels ($what)"; target="≤ 2%" lim=2 ;;
                tiny) label="loop of tiny kernels (launch-bound)"; target="≤ 5%" lim=5 ;;
                graph) label="CUDA-graph replay (20 tiny kernels)"; target="≤ 5%" lim=5 ;;
            esac
            row "$s4" "$label" "$(q '"%.1f%% (%.4g/s bare, %.4g/s Tessera)" % (100 * (1 - t["'$m'"] / b["'$m'"]), b["'$m'"], t["'$m'"])' b="$work/bare_$kind.json" t="$work/tess_$kind.json")" \
                "$target" "$(q '"yes" if 100 * (1 - t["'$m'"] / b["'$m'"]) <= '$lim' else "NO"' b="$work/bare_$kind.json" t="$work/tess_$kind.json")"
        done
    else
        row "$s4" "launch paths ($what)" "$(has_json "$work/bare_$kind.json" || why "bare_$kind") $(has_json "$work/tess_$kind.json" || why "tess_$kind")" "≤ 2% / ≤ 5%" "NO"
    fi
}
if [ -z "$torch_skip" ]; then
    say "step 4: PyTorch overhead, bare and under Tessera, ${bench_s}s per measurement"
    job bare_torch $((3 * bench_s + slack)) "${GPU[@]+"${GPU[@]}"}" "$py" "$here/torch_overhead.py" "$bench_s"
    job tess_torch $((3 * bench_s + slack)) "${TR[@]}" --memory "${full}B" --share 100 -- "$py" "$here/torch_overhead.py" "$bench_s"
    overhead_rows torch "bf16 8192^2 matmuls"
else
    row "$s4" "PyTorch matmuls, tiny kernels, CUDA graph" "$torch_skip" "≤ 2% / ≤ 5%" "-"
    if [ -n "$bpy" ]; then
        say "step 4: cuda-bindings overhead, bare and under Tessera, ${bench_s}s per measurement"
        job bare_bindings $((3 * bench_s + slack)) "${GPU[@]+"${GPU[@]}"}" "$bpy" "$here/bindings_overhead.py" "$bench_s"
        job tess_bindings $((3 * bench_s + slack)) "${TR[@]}" --memory "${full}B" --share 100 -- "$bpy" "$here/bindings_overhead.py" "$bench_s"
        overhead_rows bindings "cuda-bindings 1 ms kernels"
    fi
fi
for lib in cupy jax; do
    skip=$cupy_skip name=CuPy
    [ $lib = jax ] && skip=$jax_skip name=JAX
    if [ -n "$skip" ]; then
        row "$s4" "$name start-up and one kernel" "$skip" "runs; start-up ≈ bare" "-"
        continue
    fi
    say "step 4: $name start-up, bare and under Tessera"
    job "bare_$lib" $slack "$py" "$here/${lib}_check.py"
    job "tess_$lib" $slack "${TR[@]}" --memory "${limit}B" --share "$pct" -- "$py" "$here/${lib}_check.py"
    if has_json "$work/bare_$lib.json" && has_json "$work/tess_$lib.json"; then
        row "$s4" "$name start-up and one kernel" "$(q '"%.2f s bare, %.2f s Tessera, result %s" % (b["startup_s"], t["startup_s"], "right" if t["ok"] else "WRONG")' b="$work/bare_$lib.json" t="$work/tess_$lib.json")" \
            "runs; start-up ≈ bare" "$(q '"yes" if t["ok"] else "NO"' t="$work/tess_$lib.json")"
    else
        row "$s4" "$name start-up and one kernel" "$(has_json "$work/bare_$lib.json" || why "bare_$lib") $(has_json "$work/tess_$lib.json" || why "tess_$lib")" "runs" "NO"
    fi
done

# ---------------------------------------------------------------- step 5: ledger vs NVML
s5="5 ledger vs NVML"
if [ ${#worker[@]} = 0 ]; then
    row "$s5" "memory and GPU time" "skipped: no workload (${torch_skip:-}; $bindings_note)" "agree" "-"
else
    say "step 5: a tenant holding 1 GiB for ${ledger_s}s; tessera status --json against NVML"
    rm -rf "$work/barrier5"; mkdir -p "$work/barrier5"
    if [ -z "$torch_skip" ]; then args5=("$ledger_s" 8192 1024); else args5=("$ledger_s" 1000 1024); fi
    GPUCHECK_BARRIER=$work/barrier5 GPUCHECK_LINGER=10 timeout -k 5 $((ledger_s + slack)) \
        "${TR[@]}" --memory "${limit}B" --share "$pct" -- "${worker[@]}" "${args5[@]}" \
        >"$work/l.json" 2>"$work/l.err" &
    l=$!
    bg_pids=("$l")
    for _ in $(seq $((slack * 10))); do
        [ -n "$(find "$work/barrier5" -name 'ready.*')" ] && break
        kill -0 "$l" 2>/dev/null || break
        sleep 0.1
    done
    lpid=$(find "$work/barrier5" -name 'ready.*' | head -n 1 | sed 's/.*ready\.//')
    if [ -n "$lpid" ]; then
        # NVML polled from the start line to the tenant's exit, as the arbiter polls it.
        timeout -k 5 $((ledger_s + 60)) "${GPU[@]+"${GPU[@]}"}" python3 "$here/nvml_procs.py" "$lpid" $((ledger_s + 30)) \
            >"$work/nvml5.json" 2>"$work/nvml5.err" &
        nv=$!
        bg_pids+=("$nv")
    fi
    touch "$work/barrier5/go"
    sleep $(( ledger_s / 2 ))
    status_json >"$work/status5_mem.json"
    # The tenant lingers after its results: the ledger's 10 s window covers the whole run.
    for _ in $(seq $((ledger_s * 10 + slack * 10))); do
        has_json "$work/l.json" && break
        kill -0 "$l" 2>/dev/null || break
        sleep 0.1
    done
    status_json >"$work/status5_time.json"
    kill "$l" 2>/dev/null
    wait "$l"
    [ -n "$lpid" ] && wait "$nv"
    bg_pids=()
    a5='[x for x in s["gpus"][0]["allocations"] if x["processes"] > 0][0]'
    if [ -z "$lpid" ]; then
        row "$s5" "memory and GPU time" "$(why l)" "agree" "NO"
    elif ! has_json "$work/nvml5.json" || [ "$(q '"error" in n' n="$work/nvml5.json")" = True ]; then
        row "$s5" "memory and GPU time" "NVML: $(q 'n.get("error")' n="$work/nvml5.json") $(tail -n 1 "$work/nvml5.err" 2>/dev/null | tr '|' '/')" "agree" "NO"
    else
        row "$s5" "memory: ledger memory_used vs NVML used (pid $lpid)" \
            "$(q '"ledger %.2f GiB, NVML %s" % ('"$a5"'["memory_used"] / GiB, "%.2f GiB" % (n["used_bytes"] / GiB) if n["used_bytes"] is not None else "no figure")' s="$work/status5_mem.json" n="$work/nvml5.json")" \
            "NVML = ledger (which reserves 300 MiB per context) within 512 MiB" \
            "$(q '"yes" if abs(n["used_bytes"] - '"$a5"'["memory_used"]) < 512 * MiB else "NO"' s="$work/status5_mem.json" n="$work/nvml5.json")"
        row "$s5" "GPU time of the run: ledger gpu_time_10s_ns vs NVML process utilization" \
            "$(q '"ledger %.2f s, NVML %.2f s (run %.1f s)" % ([x for x in s["gpus"][0]["allocations"] if x["processes"] > 0][0]["gpu_time_10s_ns"] / 1e9, n["busy_s"], t["seconds"])' s="$work/status5_time.json" n="$work/nvml5.json" t="$work/l.json")" \
            "within 10%" \
            "$(q '"yes" if abs([x for x in s["gpus"][0]["allocations"] if x["processes"] > 0][0]["gpu_time_10s_ns"] / 1e9 - n["busy_s"]) <= 0.1 * max(n["busy_s"], 0.001) else "NO"' s="$work/status5_time.json" n="$work/nvml5.json")"
    fi
fi

# ---------------------------------------------------------------- step 6: the latency tier
# One latency service (small requests at Poisson arrivals) beside two best-effort tenants that
# saturate the GPU (a training loop), as benches/src/bin/latency_tier.rs runs it on the
# simulated GPU: the service alone, then beside them under plain time-slicing (no Tessera),
# under Tessera with shares only, and under Tessera with the service in the latency tier.
s6="6 latency tier"
if [ -z "$torch_skip" ]; then
    lat_w=("$py" "$here/torch_latency.py") lat_name="PyTorch: 4 bf16 4096² products per request, every 10 ms; training: a bf16 MLP of width 8192"
    serve_args=(--gap-ms 10 --kernels 4 --size 4096) train_args=(--size 8192)
elif [ -n "$bpy" ]; then
    # latency_tier's first mix: requests of 4 x 2 ms kernels every 30 ms, 1-10 ms best-effort kernels.
    lat_w=("$bpy" "$here/bindings_latency.py") lat_name="cuda-bindings: 4 x 2 ms kernels per request, every 30 ms; best-effort kernels of 1-10 ms"
    serve_args=(--gap-ms 30 --kernels 4 --size 2000) train_args=(--size 10000)
else
    lat_w=()
fi
if [ "$lat_s" = 0 ]; then
    row "$s6" "latency p50/p99 alone and beside best-effort" "skipped: --latency-seconds 0" "p50 ≤ 1.5x, p99 ≤ 1.2x alone" "-"
elif [ ${#lat_w[@]} = 0 ]; then
    row "$s6" "latency p50/p99 alone and beside best-effort" "${torch_skip:-}; $bindings_note" "p50 ≤ 1.5x, p99 ≤ 1.2x alone" "-"
else
    [ -n "$torch_skip" ] && row "$s6" "PyTorch matmul requests beside a training loop" "$torch_skip (cuda-bindings spin kernels instead)" "-" "-"
    # The service 40 shares and 20% of the memory; the best-effort tenants share the other 60
    # shares, 15% of the memory each.
    m6=$(pct_of "$total" 20) m6be=$(pct_of "$total" 15) be_share=$((60 / lat_be))
    row "$s6" "workload" "$lat_name; shares 40 (service) and $be_share for each of $lat_be best-effort" "-" "-"
    # lat_mode MODE: alone | plain | shares | tier; writes l6_MODE_lat.json and l6_MODE_beI.json
    lat_mode() {
        local m=$1 dir=$work/barrier6_$1 pids=() n=1 i pre=()
        rm -rf "$dir"; mkdir -p "$dir"
        if [ "$m" != alone ]; then
            n=$((lat_be + 1))
            for i in $(seq "$lat_be"); do
                pre=("${GPU[@]+"${GPU[@]}"}")
                [ "$m" = plain ] || pre=("${TR[@]}" --memory "${m6be}B" --share "$be_share" --)
                GPUCHECK_BARRIER=$dir timeout -k 5 $((lat_s + slack)) "${pre[@]+"${pre[@]}"}" \
                    "${lat_w[@]}" train $((lat_s + 3)) "${train_args[@]}" --seed "$i" \
                    >"$work/l6_${m}_be$i.json" 2>"$work/l6_${m}_be$i.err" &
                pids+=($!)
            done
        fi
        pre=("${GPU[@]+"${GPU[@]}"}")
        case $m in
            shares) pre=("${TR[@]}" --memory "${m6}B" --share 40 --) ;;
            tier) pre=("${TR[@]}" --memory "${m6}B" --share 40 --tier latency --) ;;
        esac
        GPUCHECK_BARRIER=$dir timeout -k 5 $((lat_s + slack)) "${pre[@]+"${pre[@]}"}" \
            "${lat_w[@]}" serve "$lat_s" "${serve_args[@]}" --delay 1 \
            >"$work/l6_${m}_lat.json" 2>"$work/l6_${m}_lat.err" &
        pids+=($!)
        bg_pids=("${pids[@]}")
        # The start line once every tenant has set up (or one has died).
        local _ p alive
        for _ in $(seq $((slack * 10))); do
            [ "$(find "$dir" -name 'ready.*' | wc -l)" -ge $n ] && break
            alive=1
            for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null || alive=0; done
            [ $alive = 1 ] || break
            sleep 0.1
        done
        touch "$dir/go"
        for p in "${pids[@]}"; do wait "$p"; done
        bg_pids=()
    }
    for m in alone plain shares tier; do
        say "step 6: the latency service $([ $m = alone ] && echo alone || echo "beside $lat_be best-effort tenant(s): $m"), ${lat_s}s"
        lat_mode $m
    done
    be_of() { local i f=$work/l6_$1_lat.json; for i in $(seq "$lat_be"); do f+=",$work/l6_$1_be$i.json"; done; echo "$f"; }
    while IFS=$'\t' read -r r_m r_res r_tgt r_met; do
        row "$s6" "$r_m" "$r_res" "$r_tgt" "$r_met"
    done < <(python3 "$here/_latency.py" rows alone="$work/l6_alone_lat.json" plain="$(be_of plain)" \
        shares="$(be_of shares)" tier="$(be_of tier)")
fi

# ---------------------------------------------------------------- step 7: MIG, read only
# What the DRA plugin's --mig-dynamic/--mig-static would find on GPU 0 (docs/kubernetes.md,
# "MIG"): the MIG mode, and with MIG on the GPU-instance profiles, their placements and the
# instances that exist. Nothing is switched or created (NVML lists profiles only with MIG on,
# so with MIG off only the mode is reported). The full listings go to the work folder.
if [ $real = 1 ] && command -v nvidia-smi >/dev/null 2>&1; then
    say "step 7: MIG on GPU 0, read only"
    mode=$(nvidia-smi -i 0 --query-gpu=mig.mode.current,mig.mode.pending --format=csv,noheader 2>/dev/null | tr -d ' ')
    case $mode in
    Enabled,*)
        nvidia-smi mig -i 0 -lgip >"$work/mig_profiles.txt" 2>&1
        nvidia-smi mig -i 0 -lgipp >"$work/mig_placements.txt" 2>&1
        nvidia-smi mig -i 0 -lgi >"$work/mig_instances.txt" 2>&1
        profiles=$(grep -cE 'MIG [0-9]+g\.' "$work/mig_profiles.txt")
        instances=$(grep -cE 'MIG [0-9]+g\.' "$work/mig_instances.txt")
        row 7 "MIG on GPU 0 (current,pending)" "$mode; $profiles profiles, $instances GPU instances (listings in $work)" "read only" "info"
        ;;
    '' | *N/A*) row 7 "MIG on GPU 0" "not supported (${mode:-no answer})" "read only" "info" ;;
    *) row 7 "MIG on GPU 0 (current,pending)" "$mode: profiles are listed only with MIG on (not switched: read only)" "read only" "info" ;;
    esac
else
    row 7 "MIG on GPU 0" "not run (the simulated GPU's MIG is tested by the DRA plugin's tests)" "read only" "-"
fi

# ---------------------------------------------------------------- table
# Tenant processes the arbiter's backstop found over their memory (limit + tolerance) or running
# kernels outside their leases (killed with --enforce kill, only logged with report).
enforced=$(grep -c 'backstop: pid .* of allocation' "$work/arbiter.log")
{
    echo "## Tessera gpu-check: $where"
    echo
    echo "GPU 0: $gpu_name, $(gib "$total"); limited tenant: \`--memory $limit --share $pct\` ($(gib "$limit")); $(date -u '+%Y-%m-%d %H:%M UTC'); \`$(basename "$0") --share-seconds $share_s --bench-seconds $bench_s --ledger-seconds $ledger_s --latency-seconds $lat_s\`; backstop \`--enforce $enforce\` (tenant processes it flagged: $enforced)."
    echo
    echo "| step | measure | result | target | met |"
    echo "|---|---|---|---|---|"
    cat "$rows"
} >"$work/table.md"
cp "$work/table.md" "$out" || die "cannot write $out"
echo
cat "$work/table.md"
echo
say "table written to $out"
