# Helpers of the end-to-end tests (sourced by e2e/run.sh). Each test is a function
# `test_<group>__<name>` in e2e/tests/NN_<group>.sh, run in a subshell with `set -e`; it fails
# by any failing command or by `fail`. Objects a test makes carry the label e2e=1 and are
# deleted after it. A group that changes the cluster for its tests (60_mig: the DRA plugin's
# flags) does it in `setup_<group>` and undoes it in `teardown_<group>`, which e2e/run.sh runs
# after the group's last test whatever happened; a change for one test only is undone in that
# test's own `trap ... EXIT` (50_tier).
D=$E2E_DIR
BIN=${E2E_BIN:-$repo/target/e2e/bin}
RUST=${E2E_RUST_BIN:-${CARGO_TARGET_DIR:-$repo/target}/debug}
NODE=${E2E_NODE:-localhost}
export PATH="$BIN:$PATH"
export KUBECONFIG=$D/admin.kubeconfig
IMAGE=localhost/tessera-e2e/client:1

kc() { kubectl "$@"; }

fail() {
    echo "FAIL: $*" >&2
    exit 1
}

# expect_eq WHAT GOT WANT
expect_eq() { [ "$2" = "$3" ] || fail "$1: got '$2', want '$3'"; }

# expect_match WHAT TEXT REGEX
expect_match() { grep -Eq -- "$3" <<<"$2" || fail "$1: '$3' not in: $2"; }

# eventually SECONDS WHAT COMMAND...: retries COMMAND (quietly) until it succeeds.
eventually() {
    local secs=$1 what=$2
    shift 2
    local end=$((SECONDS + secs))
    until "$@" >/dev/null 2>&1; do
        [ $SECONDS -lt $end ] || fail "timed out after ${secs}s waiting for $what"
        sleep 1
    done
}

phase() { kc get pod "$1" -o jsonpath='{.status.phase}' 2>/dev/null; }
# Whether POD has ended (Succeeded or Failed).
ended() { case $(phase "$1") in Succeeded | Failed) ;; *) return 1 ;; esac; }

# Whether the scheduler refused POD with a message matching REGEX (its FailedScheduling event).
refused_by_scheduler() {
    kc get events --field-selector "involvedObject.name=$1,reason=FailedScheduling" \
        -o jsonpath='{.items[*].message}' | grep -Eq -- "$2"
}

# Whether POD's output has a line matching REGEX yet.
printed() { kc logs "$1" | grep -Eq -- "$2"; }

# The node's ResourceSlices of driver gpu.tessera.dev, as a JSON array.
slice_json() {
    kc get resourceslices -o json | jq -c --arg n "$NODE" \
        '[.items[] | select(.spec.driver == "gpu.tessera.dev" and .spec.nodeName == $n)]'
}

# wait_phase POD PHASE [SECONDS]: fails at once if the pod ends in the other terminal phase.
wait_phase() {
    local pod=$1 want=$2 secs=${3:-120} end p
    end=$((SECONDS + secs))
    while :; do
        p=$(phase "$pod")
        [ "$p" = "$want" ] && return 0
        if { [ "$p" = Failed ] || [ "$p" = Succeeded ]; } && [ "$p" != "$want" ]; then
            kc logs "$pod" --all-containers >&2 || true
            fail "pod $pod ended $p, want $want"
        fi
        if [ $SECONDS -ge $end ]; then
            kc describe pod "$pod" | tail -n 25 >&2 || true
            fail "pod $pod is '$p' after ${secs}s, want $want"
        fi
        sleep 1
    done
}

# A pod of the client image running `sh -c SCRIPT`, with extra spec lines (resources, claims).
# pod NAME SCRIPT [CONTAINER_EXTRA_YAML] [POD_EXTRA_YAML]
pod() {
    local name=$1 script=$2 cextra=${3:-} pextra=${4:-}
    kc apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: $name
  labels: {e2e: "1"}
spec:
  hostNetwork: true
  restartPolicy: Never
  terminationGracePeriodSeconds: 2
  automountServiceAccountToken: false
$pextra
  containers:
  - name: main
    image: $IMAGE
    imagePullPolicy: Never
    command: ["/bin/sh", "-c", $(printf '%s' "$script" | jq -Rs .)]
$cextra
EOF
}

# shares_pod NAME SHARES SCRIPT: a pod asking the device plugin for SHARES units.
shares_pod() {
    pod "$1" "$3" "    resources:
      limits:
        tessera.dev/gpu-shares: \"$2\""
}

# claim_template NAME [SHARES] [MEMORY]: a ResourceClaimTemplate of class gpu.tessera.dev.
claim_template() {
    local name=$1 shares=${2:-} memory=${3:-} caps=""
    [ -n "$shares" ] && caps+="
              shares: \"$shares\""
    [ -n "$memory" ] && caps+="
              memory: $memory"
    local cap=""
    [ -n "$caps" ] && cap="
          capacity:
            requests:$caps"
    kc apply -f - >/dev/null <<EOF
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata:
  name: $name
  labels: {e2e: "1"}
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly:
          deviceClassName: gpu.tessera.dev$cap
EOF
}

# claim_pod NAME TEMPLATE SCRIPT: a pod whose container uses a claim made from TEMPLATE.
claim_pod() {
    pod "$1" "$3" "    resources:
      claims:
      - name: gpu" "  resourceClaims:
  - name: gpu
    resourceClaimTemplateName: $2"
}

# The GPU time a tenant printed ("... = 1.23 s of GPU time in ...").
gpu_seconds() { grep -o '= [0-9.]* s of GPU time' <<<"$1" | awk '{print $2}'; }

# An epoch a few seconds ahead: tenants started apart begin their kernels together.
start_at() { echo $(($(date +%s) + ${1:-20})); }
wait_until() { echo "while [ \$(date +%s) -lt $1 ]; do sleep 0.2; done"; }

# The arbiter's allocations (JSON lines of `tessera status --json`).
allocations_json() {
    "$RUST/tessera" status --json --admin-socket "$D/tessera/admin.sock" | jq -c '[.gpus[].allocations[]]'
}

cleanup_test_objects() {
    kc delete pods -l e2e=1 --grace-period=0 --force --wait=true --timeout=60s >/dev/null 2>&1 || true
    kc delete resourceclaimtemplates,resourceclaims -l e2e=1 --wait=true --timeout=60s \
        >/dev/null 2>&1 || true
}
