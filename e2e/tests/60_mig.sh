# shellcheck shell=bash disable=SC2016
# MIG on the real kubelet, scheduler and controller manager (issue 40): the cluster's third GPU,
# a simulated H200 (e2e/cluster.sh: GPUS=2x80GiB,1xH200), which the cluster's plugins leave out
# (`--gpus 0,1`). setup_mig restarts the DRA plugin with it published as MIG partitions
# (`--gpus 0,1,2 --mig-dynamic 2`); teardown_mig, which e2e/run.sh runs after the group's last
# test whatever happened, deletes the group's pods and claims, waits until their instances are
# gone and restarts the plugin as the cluster runs it.
#
# What is checked: the slices (the H200's partitions and counter set, the 80 GiB GPUs as
# before); the exclusions the scheduler makes through the counters alone (the whole H200 and its
# MIG devices, 1g@0 and 2g@0, 3g+3g+1g), each beside an allocation that shows the request was
# allocatable otherwise; two fractions of one 1g.18gb instance (one instance, both limits held,
# one CUDA_VISIBLE_DEVICES); the instance removed at the last unprepare and adopted across a
# plugin restart. Instances are read where NVML reads them: the simulator's MIG state
# ($D/sim/mig, docs/simulator.md "MIG"), beside the plugin's checkpoint and the arbiter.

# The H200's NVML index in e2e/cluster.sh's GPUS.
MIG_GPU=2
MIG_PLUGIN_GPUS=0,1,2
MIG_PLUGIN_ARGS="--mig-dynamic $MIG_GPU"
# Seconds for a MIG pod to run: scheduled, its instance made, the arbiter reading the new
# device, the container started (a 2-core CI machine).
MIG_WAIT=${E2E_MIG_WAIT:-240}
# The simulator's MIG layout (what NVML answers from) and the DRA plugin's checkpoint.
MIG_SIM=$D/sim/mig
MIG_CHECKPOINT=$D/tessera/dra/mig.json
# The H200's GPU-instance profile ids (NVML's; docs/simulator.md, "MIG").
MIG_ID_1G=19 MIG_ID_2G=14 MIG_ID_3G=9 MIG_ID_4G=5

# ---- the plugin and what it publishes

mig_plugin_serving() { test -S "$D/kubelet/plugins_registry/gpu.tessera.dev-reg.sock"; }

# shellcheck disable=SC2154 # $here is e2e/run.sh's
# mig_restart_plugin GPUS ARGS: the DRA plugin again with `--gpus GPUS` (empty: the cluster's)
# and the extra flags ARGS; returns once it serves its registration socket.
mig_restart_plugin() {
    local gpus=$1 args=$2 pid end=$((SECONDS + 90))
    bash "$here/cluster.sh" stop tessera-dra
    # A plugin killed rather than stopped leaves its socket: not to be taken for the new one's.
    rm -f "$D/kubelet/plugins_registry/gpu.tessera.dev-reg.sock"
    E2E_DRA_GPUS=$gpus E2E_DRA_PLUGIN_ARGS=$args bash "$here/cluster.sh" start-dra-plugin
    pid=$(cat "$D/pids/tessera-dra")
    until mig_plugin_serving; do
        if ! kill -0 "$pid" 2>/dev/null || [ $SECONDS -ge $end ]; then
            tail -n 20 "$D/logs/tessera-dra.log" >&2
            fail "the DRA plugin (--gpus ${gpus:-of the cluster} $args) does not serve"
        fi
        sleep 1
    done
}

# Every device of the node's slices, as a JSON array.
mig_devices() { slice_json | jq -c '[.[].spec.devices[]?]'; }

# Whether the H200's partitions and counter set are published.
mig_published() {
    local s
    s=$(slice_json)
    jq -e --arg p "gpu-$MIG_GPU-mig-" --arg c "gpu-$MIG_GPU-counters" \
        'any(.[].spec.devices[]?; .name | startswith($p)) and any(.[].spec.sharedCounters[]?; .name == $c)' \
        <<<"$s" >/dev/null
}

# Whether the node's pool is what the cluster's plugin publishes: one slice, gpu-0 and gpu-1,
# no counters.
mig_plain_published() {
    [ "$(slice_json | jq -c '[.[] | (.spec.devices // [] | map(.name)), (.spec.sharedCounters // [] | length)]')" = '[["gpu-0","gpu-1"],0]' ]
}

# The 80 GiB GPUs' devices (gpu-0, gpu-1) of a devices array, in a comparable form.
mig_plain_of() { jq -S -c '[.[] | select(.name == "gpu-0" or .name == "gpu-1")]'; }

# ---- claims and pods

mig_attr() { printf 'device.attributes["gpu.tessera.dev"].%s' "$1"; }

# mig_sel PROFILE [START]: a CEL selector for a partition of PROFILE (at placement START).
mig_sel() {
    local e
    e="$(mig_attr profile) == \"$1\""
    [ -z "${2:-}" ] || e+=" && $(mig_attr placementStart) == $2"
    printf '%s' "$e"
}

# A CEL selector for the whole H200 (class gpu.tessera.dev: type gpu).
mig_whole_sel() { printf '%s == %s' "$(mig_attr index)" "$MIG_GPU"; }

# mig_template NAME CLASS SHARES MEMORY [CEL]: a ResourceClaimTemplate of CLASS for SHARES and
# MEMORY of one device that CEL (none when empty) selects.
mig_template() {
    jq -n --arg n "$1" --arg class "$2" --arg s "$3" --arg m "$4" --arg cel "${5:-}" '{
        apiVersion: "resource.k8s.io/v1", kind: "ResourceClaimTemplate",
        metadata: {name: $n, labels: {e2e: "1"}},
        spec: {spec: {devices: {requests: [{name: "gpu", exactly: (
            {deviceClassName: $class, capacity: {requests: {shares: $s, memory: $m}}}
            + (if $cel == "" then {} else {selectors: [{cel: {expression: $cel}}]} end))}]}}}}' |
        kc apply -f - >/dev/null
}

# The claim POD's container uses (made from its template), or nothing yet.
mig_claim_of() {
    kc get pod "$1" -o jsonpath='{.status.resourceClaimStatuses[0].resourceClaimName}' 2>/dev/null || true
}

# The device POD's claim was allocated, or nothing.
mig_device_of() {
    local c
    c=$(mig_claim_of "$1")
    [ -n "$c" ] || return 0
    kc get resourceclaim "$c" -o jsonpath='{.status.allocation.devices.results[0].device}' \
        2>/dev/null || true
}
mig_allocated() { [ -n "$(mig_device_of "$1")" ]; }

# mig_allocated_to POD DEVICE: waits for POD's claim to be allocated, and checks the device.
mig_allocated_to() {
    eventually 120 "$1's claim to be allocated" mig_allocated "$1"
    expect_eq "$1's device" "$(mig_device_of "$1")" "$2"
}

# Whether the scheduler refused this very POD (its uid: events outlive a deleted pod of the
# same name) for its claims.
mig_refused_by_scheduler() {
    local uid
    uid=$(kc get pod "$1" -o jsonpath='{.metadata.uid}')
    [ -n "$uid" ] &&
        kc get events --field-selector "involvedObject.uid=$uid,reason=FailedScheduling" \
            -o jsonpath='{.items[*].message}' | grep -q 'cannot allocate all claims'
}

# mig_refused POD WHY: the scheduler refuses POD (its FailedScheduling reason for claims), the
# pod stays Pending and its claim unallocated.
mig_refused() {
    eventually 120 "the scheduler's refusal of $1 ($2)" mig_refused_by_scheduler "$1"
    expect_eq "phase of $1 ($2)" "$(phase "$1")" Pending
    expect_eq "the device of $1's claim ($2)" "$(mig_device_of "$1")" ""
    echo "$1 refused: $2"
}

mig_gone() { ! kc get "$1" "$2" >/dev/null 2>&1; }

# mig_delete POD...: deletes the pods and waits until their claims are gone too (unprepared,
# deallocated and deleted).
mig_delete() {
    local p c claims=()
    for p in "$@"; do
        c=$(mig_claim_of "$p")
        [ -z "$c" ] || claims+=("$c")
    done
    kc delete pod "$@" --grace-period=1 --wait=true --timeout=120s >/dev/null
    for c in "${claims[@]}"; do
        eventually 120 "claim $c to go" mig_gone resourceclaim "$c"
    done
}

# What POD printed as `visible=...` (its CUDA_VISIBLE_DEVICES).
mig_visible() { kc logs "$1" | sed -n 's/^visible=//p' | head -n 1; }

# mig_limited POD GIB: a process started in POD now sees a 1g.18gb instance of GIB GiB and is
# refused past it.
mig_limited() {
    local out
    out=$(kc exec "$1" -- tenant --name X --grab-gib 100 --seconds 0.2 2>&1) || fail "exec in $1: $out"
    echo "$out"
    expect_match "$1's card" "$out" "X: sees NVIDIA H200 MIG 1g\.18gb with $2\.0 GiB"
    expect_match "$1 refused" "$out" \
        "X: holds $(($2 - 1)) GiB; the next 1 GiB was refused: CUDA_ERROR_OUT_OF_MEMORY"
}

# ---- instances

# The H200's GPU instances in the simulator's MIG state (docs/simulator.md, "MIG": lines
# `gi GPU ID PROFILE_ID START SIZE` and `ci GPU GI ID PROFILE START SIZE UUIDHEX`), one line
# each, by placement: "START PROFILE_ID MIG-<uuid>" (lower case; `-` before its compute
# instance exists).
mig_instances() {
    [ -f "$MIG_SIM" ] || return 0
    awk -v g="$MIG_GPU" '
        $1 == "gi" && $2 == g { start[$3] = $5; prof[$3] = $4; if (!($3 in uuid)) uuid[$3] = "-" }
        $1 == "ci" && $2 == g { h = tolower($8); uuid[$3] = sprintf("MIG-%s-%s-%s-%s-%s",
            substr(h, 1, 8), substr(h, 9, 4), substr(h, 13, 4), substr(h, 17, 4), substr(h, 21, 12)) }
        END { for (i in start) print start[i], prof[i], uuid[i] }' "$MIG_SIM" | sort -n
}
mig_no_instances() { [ -z "$(mig_instances)" ]; }
# The instances' "START PROFILE_ID" pairs, one line each.
mig_placements() { mig_instances | cut -d' ' -f1,2; }
mig_mode_on() { [ -f "$MIG_SIM" ] && grep -qx "gpu $MIG_GPU on" "$MIG_SIM"; }
mig_mode_off() { ! mig_mode_on; }

# The checkpoint's records as "PROFILE START STATE CLAIMS" lines.
mig_records() {
    [ -f "$MIG_CHECKPOINT" ] || return 0
    jq -r '.records[] | "\(.profile) \(.start) \(.state) \(.claims | length)"' "$MIG_CHECKPOINT"
}
mig_no_records() { [ -z "$(mig_records)" ]; }
mig_records_are() { [ "$(mig_records)" = "$1" ]; }

# A MIG UUID as the simulator's state spells it: `MIG-` and lower-case hex.
mig_uuid() {
    local x=${1,,}
    printf 'MIG-%s' "${x#mig-}"
}

# The arbiter's allocations on device UUID, as a JSON array (`tessera status --json` lists
# them under their device).
mig_allocations_on() {
    "$RUST/tessera" status --json --admin-socket "$D/tessera/admin.sock" |
        jq -c --arg u "${1,,}" '[.gpus[] | select((.uuid | ascii_downcase) == $u) | .allocations[]]'
}
mig_allocation_count_is() { [ "$(mig_allocations_on "$1" | jq length)" = "$2" ]; }

# How many lines of the DRA plugin's log match REGEX.
mig_log_count() { grep -cE -- "$1" "$D/logs/tessera-dra.log" || true; }
mig_log_count_above() { [ "$(mig_log_count "$1")" -gt "$2" ]; }

# Each test starts with no instance on the H200 (the run's cleanup deleted the last test's pods;
# their unprepares destroy the instances) and the partitions published.
mig_clean_start() {
    eventually 180 "no MIG instance on GPU $MIG_GPU (the earlier claims unprepared)" mig_no_instances
    eventually 60 "no instance in the DRA plugin's checkpoint" mig_no_records
    eventually 60 "the H200's MIG devices in the node's slices" mig_published
}

# ---- the group's setup and teardown (e2e/run.sh)

setup_mig() {
    eventually 60 "the cluster's DRA plugin to publish gpu-0 and gpu-1 only" mig_plain_published
    mig_devices >"$D/mig-plain-devices.json"
    mig_restart_plugin "$MIG_PLUGIN_GPUS" "$MIG_PLUGIN_ARGS"
    eventually 120 "the H200's MIG devices and counters in the node's slices" mig_published
    # The plugin turned MIG on to read the profiles, and off again.
    mig_mode_off || fail "MIG mode left on on GPU $MIG_GPU after the plugin read its profiles"
    mig_no_instances || fail "MIG instances on GPU $MIG_GPU before any claim: $(mig_instances)"
}

teardown_mig() {
    local rc=0
    cleanup_test_objects
    # The claims' unprepares destroy their instances: they need the MIG plugin (a test that
    # restarted it may have failed before it served again).
    mig_plugin_serving || (mig_restart_plugin "$MIG_PLUGIN_GPUS" "$MIG_PLUGIN_ARGS") || rc=1
    (eventually 180 "every MIG instance on GPU $MIG_GPU to go" mig_no_instances) || rc=1
    # Restarted whatever the instances did: the next groups must see the cluster's plugin.
    mig_restart_plugin "" ""
    (eventually 120 "the cluster's DRA plugin to publish gpu-0 and gpu-1 only again" \
        mig_plain_published) || rc=1
    if [ -s "$D/mig-plain-devices.json" ]; then
        (expect_eq "gpu-0 and gpu-1 after the MIG tests" "$(mig_devices | mig_plain_of)" \
            "$(mig_plain_of <"$D/mig-plain-devices.json")") || rc=1
    fi
    (eventually 60 "MIG mode off on GPU $MIG_GPU" mig_mode_off) || rc=1
    return "$rc"
}

# ---- the tests

test_mig__a_the_slices_publish_the_h200s_partitions_and_counters() {
    local s devs one whole n
    s=$(slice_json)
    jq -c '[.[] | {name: .metadata.name, devices: (.spec.devices // [] | length),
        counterSets: (.spec.sharedCounters // [] | map(.name))}]' <<<"$s"
    # Devices and counters are in separate slices (upstream allows one or the other).
    expect_eq "slices of the pool" "$(jq length <<<"$s")" 2
    devs=$(jq -c '[.[].spec.devices[]?]' <<<"$s")
    # The H200: its whole device and every profile at every placement NVML reports (1g.18gb and
    # 1g.18gb+me at 0-6, 1g.35gb at 0/2/4/6, 2g.35gb at 0/2/4, 3g.71gb at 0/4, 4g.71gb and
    # 7g.141gb at 0): 26. The 80 GiB GPUs: one device each.
    expect_eq "devices" "$(jq length <<<"$devs")" 28
    expect_eq "the H200's devices" "$(jq --arg w "gpu-$MIG_GPU" \
        '[.[] | select(.name == $w or (.name | startswith($w + "-mig-")))] | length' <<<"$devs")" 26
    for n in 1g-18gb-0 1g-18gb-6 1g-18gb-me-3 1g-35gb-6 2g-35gb-4 3g-71gb-4 4g-71gb-0 7g-141gb-0; do
        jq -e --arg n "gpu-$MIG_GPU-mig-$n" 'any(.[]; .name == $n)' <<<"$devs" >/dev/null ||
            fail "no device gpu-$MIG_GPU-mig-$n"
    done
    # No device where the profile has no placement.
    for n in 4g-71gb-4 3g-71gb-2 2g-35gb-6 1g-18gb-7; do
        ! jq -e --arg n "gpu-$MIG_GPU-mig-$n" 'any(.[]; .name == $n)' <<<"$devs" >/dev/null ||
            fail "a device gpu-$MIG_GPU-mig-$n, a placement the H200 does not have"
    done

    # A partition: what the tests' selectors use, its instance's memory, and its counters.
    one=$(jq -c --arg n "gpu-$MIG_GPU-mig-1g-18gb-0" '.[] | select(.name == $n)' <<<"$devs")
    whole=$(jq -c --arg n "gpu-$MIG_GPU" '.[] | select(.name == $n)' <<<"$devs")
    echo "gpu-$MIG_GPU-mig-1g-18gb-0: $one"
    expect_eq "its type" "$(jq -r .attributes.type.string <<<"$one")" mig
    expect_eq "its profile" "$(jq -r .attributes.profile.string <<<"$one")" 1g.18gb
    expect_eq "its placementStart" "$(jq -r .attributes.placementStart.int <<<"$one")" 0
    expect_eq "its GPU index" "$(jq -r .attributes.index.int <<<"$one")" "$MIG_GPU"
    expect_eq "its parentUUID" "$(jq -r .attributes.parentUUID.string <<<"$one")" \
        "$(jq -r .attributes.uuid.string <<<"$whole")"
    expect_eq "a uuid of its own (none before the instance exists)" \
        "$(jq -r '.attributes | has("uuid")' <<<"$one")" false
    expect_eq "shared" "$(jq -r .allowMultipleAllocations <<<"$one")" true
    expect_eq "its memory (the instance's 16384 MiB)" "$(jq -r .capacity.memory.value <<<"$one")" 16Gi
    expect_eq "its shares" "$(jq -r .capacity.shares.value <<<"$one")" 100
    expect_eq "its counters" \
        "$(jq -S -c '.consumesCounters | map({set: .counterSet, counters: (.counters | map_values(.value))})' <<<"$one")" \
        "[{\"counters\":{\"compute-slices\":\"1\",\"memory-slice-0\":\"1\"},\"set\":\"gpu-$MIG_GPU-counters\"}]"
    # The whole H200: a GPU that consumes every counter.
    expect_eq "the whole H200's type" "$(jq -r .attributes.type.string <<<"$whole")" gpu
    expect_eq "the whole H200's product" "$(jq -r .attributes.productName.string <<<"$whole")" "NVIDIA H200"
    local all
    all='{"compute-slices":"7","memory-slice-0":"1","memory-slice-1":"1","memory-slice-2":"1","memory-slice-3":"1","memory-slice-4":"1","memory-slice-5":"1","memory-slice-6":"1","memory-slice-7":"1"}'
    expect_eq "the whole H200's counters" \
        "$(jq -S -c '.consumesCounters | map(.counters | map_values(.value))' <<<"$whole")" "[$all]"
    # The counter set: 7 compute slices, 8 memory slices.
    expect_eq "the counter set gpu-$MIG_GPU-counters" "$(jq -S -c --arg c "gpu-$MIG_GPU-counters" \
        '[.[].spec.sharedCounters[]? | select(.name == $c) | .counters | map_values(.value)]' <<<"$s")" "[$all]"

    # The 80 GiB GPUs: exactly as the cluster's plugin published them (setup_mig kept them).
    expect_eq "gpu-0 and gpu-1 beside the H200" "$(mig_plain_of <<<"$devs")" \
        "$(mig_plain_of <"$D/mig-plain-devices.json")"
    expect_eq "counters of gpu-0 and gpu-1" \
        "$(jq -c '[.[] | select(.name == "gpu-0" or .name == "gpu-1") | has("consumesCounters")]' <<<"$devs")" \
        '[false,false]'
}

test_mig__b_the_whole_h200_and_its_mig_devices_exclude_each_other() {
    mig_clean_start
    mig_template mig-b-whole gpu.tessera.dev 50 8Gi "$(mig_whole_sel)"
    mig_template mig-b-any mig.tessera.dev 10 1Gi
    mig_template mig-b-1g mig.tessera.dev 50 8Gi "$(mig_sel 1g.18gb)"

    echo "-- a fraction of the whole H200: no MIG device of it is allocatable"
    claim_pod mig-b-whole1 mig-b-whole 'tenant --name W --grab-gib 100 --seconds 0.5; sleep 600'
    mig_allocated_to mig-b-whole1 "gpu-$MIG_GPU"
    claim_pod mig-b-mig1 mig-b-any 'sleep 600'
    mig_refused mig-b-mig1 "any MIG device, beside a fraction of the whole H200"
    wait_phase mig-b-whole1 Running "$MIG_WAIT"
    eventually 60 "mig-b-whole1's tenant output" printed mig-b-whole1 'GPU time'
    local l
    l=$(kc logs mig-b-whole1)
    echo "$l"
    expect_match "the whole H200's fraction" "$l" "W: sees NVIDIA H200 with 8\.0 GiB"
    expect_match "refused past it" "$l" "W: holds 7 GiB; the next 1 GiB was refused: CUDA_ERROR_OUT_OF_MEMORY"
    mig_no_instances || fail "MIG instances on GPU $MIG_GPU under its whole device's claim: $(mig_instances)"
    mig_mode_off || fail "MIG mode on on GPU $MIG_GPU under its whole device's claim"

    echo "-- its claim gone: a MIG device is allocatable, and then the whole H200 is not"
    mig_delete mig-b-whole1 mig-b-mig1
    claim_pod mig-b-mig2 mig-b-1g 'echo visible=$CUDA_VISIBLE_DEVICES; sleep 600'
    eventually 120 "mig-b-mig2's claim to be allocated" mig_allocated mig-b-mig2
    expect_match "mig-b-mig2's device" "$(mig_device_of mig-b-mig2)" "^gpu-$MIG_GPU-mig-1g-18gb-[0-6]$"
    claim_pod mig-b-whole2 mig-b-whole 'sleep 600'
    mig_refused mig-b-whole2 "the whole H200, beside a MIG device of it"
    wait_phase mig-b-mig2 Running "$MIG_WAIT"
    eventually 30 "mig-b-mig2's output" printed mig-b-mig2 '^visible='
    local u
    u=$(mig_visible mig-b-mig2)
    echo "mig-b-mig2 runs on $u; the H200's instances: $(mig_instances | tr '\n' ';')"
    expect_match "mig-b-mig2's CUDA_VISIBLE_DEVICES" "$u" '^MIG-'
    expect_eq "the H200's instances" "$(mig_instances | cut -d' ' -f2,3)" "$MIG_ID_1G $(mig_uuid "$u")"
    expect_eq "phase of mig-b-whole2" "$(phase mig-b-whole2)" Pending
}

test_mig__c_1g_at_0_excludes_2g_at_0_and_not_2g_at_2() {
    mig_clean_start
    mig_template mig-c-1g0 mig.tessera.dev 50 4Gi "$(mig_sel 1g.18gb 0)"
    mig_template mig-c-2g0 mig.tessera.dev 50 4Gi "$(mig_sel 2g.35gb 0)"
    mig_template mig-c-2g2 mig.tessera.dev 50 4Gi "$(mig_sel 2g.35gb 2)"
    claim_pod mig-c-1g0 mig-c-1g0 'sleep 600'
    mig_allocated_to mig-c-1g0 "gpu-$MIG_GPU-mig-1g-18gb-0"
    # 2g.35gb at 0 spans memory slices 0 and 1; 1g.18gb at 0 holds slice 0.
    claim_pod mig-c-2g0 mig-c-2g0 'sleep 600'
    mig_refused mig-c-2g0 "2g.35gb at memory slice 0, beside 1g.18gb there"
    # The same profile at 2 (slices 2 and 3) is allocated: the refusal was the overlap.
    claim_pod mig-c-2g2 mig-c-2g2 'sleep 600'
    mig_allocated_to mig-c-2g2 "gpu-$MIG_GPU-mig-2g-35gb-2"
    wait_phase mig-c-1g0 Running "$MIG_WAIT"
    wait_phase mig-c-2g2 Running "$MIG_WAIT"
    echo "the H200's instances: $(mig_instances | tr '\n' ';')"
    expect_eq "the H200's instances (placement, profile)" "$(mig_placements)" \
        "$(printf '0 %s\n2 %s' "$MIG_ID_1G" "$MIG_ID_2G")"
    expect_eq "phase of mig-c-2g0" "$(phase mig-c-2g0)" Pending
}

test_mig__d_4g_and_3g_fit_and_3g_3g_and_1g_do_not() {
    mig_clean_start
    mig_template mig-d-4g mig.tessera.dev 50 4Gi "$(mig_sel 4g.71gb)"
    mig_template mig-d-3g mig.tessera.dev 50 4Gi "$(mig_sel 3g.71gb)"
    mig_template mig-d-3g0 mig.tessera.dev 50 4Gi "$(mig_sel 3g.71gb 0)"
    mig_template mig-d-3g4 mig.tessera.dev 50 4Gi "$(mig_sel 3g.71gb 4)"
    mig_template mig-d-1g mig.tessera.dev 50 4Gi "$(mig_sel 1g.18gb)"

    echo "-- 4g.71gb + 3g.71gb: 4 + 3 compute slices, memory slices 0-3 and 4-7"
    claim_pod mig-d-4g mig-d-4g 'sleep 600'
    mig_allocated_to mig-d-4g "gpu-$MIG_GPU-mig-4g-71gb-0"
    # Any 3g: the scheduler finds the placement the 4g leaves.
    claim_pod mig-d-3g mig-d-3g 'sleep 600'
    mig_allocated_to mig-d-3g "gpu-$MIG_GPU-mig-3g-71gb-4"
    wait_phase mig-d-4g Running "$MIG_WAIT"
    wait_phase mig-d-3g Running "$MIG_WAIT"
    echo "the H200's instances: $(mig_instances | tr '\n' ';')"
    expect_eq "the H200's instances (placement, profile)" "$(mig_placements)" \
        "$(printf '0 %s\n4 %s' "$MIG_ID_4G" "$MIG_ID_3G")"

    echo "-- 3g.71gb + 3g.71gb + 1g.18gb: the two 3g hold every memory slice"
    mig_delete mig-d-4g mig-d-3g
    eventually 180 "the 4g and 3g instances to go" mig_no_instances
    # Each 3g at its own placement (two claims of 50 shares could share one 3g device).
    claim_pod mig-d-3a mig-d-3g0 'sleep 600'
    claim_pod mig-d-3b mig-d-3g4 'sleep 600'
    mig_allocated_to mig-d-3a "gpu-$MIG_GPU-mig-3g-71gb-0"
    mig_allocated_to mig-d-3b "gpu-$MIG_GPU-mig-3g-71gb-4"
    claim_pod mig-d-1g mig-d-1g 'sleep 600'
    mig_refused mig-d-1g "1g.18gb at any placement, beside 3g.71gb at 0 and at 4"
    wait_phase mig-d-3a Running "$MIG_WAIT"
    wait_phase mig-d-3b Running "$MIG_WAIT"
    echo "the H200's instances: $(mig_instances | tr '\n' ';')"
    expect_eq "the H200's instances (placement, profile)" "$(mig_placements)" \
        "$(printf '0 %s\n4 %s' "$MIG_ID_3G" "$MIG_ID_3G")"
    expect_eq "phase of mig-d-1g" "$(phase mig-d-1g)" Pending
}

test_mig__e_two_fractions_share_one_1g_instance() {
    mig_clean_start
    # Half of the 1g.18gb instance at 0 each: 50 shares and 8 GiB of its 16.
    mig_template mig-e-half mig.tessera.dev 50 8Gi "$(mig_sel 1g.18gb 0)"
    claim_pod mig-e-1 mig-e-half \
        'echo visible=$CUDA_VISIBLE_DEVICES; tenant --name E1 --grab-gib 100 --seconds 1; sleep 600'
    claim_pod mig-e-2 mig-e-half \
        'echo visible=$CUDA_VISIBLE_DEVICES; tenant --name E2 --grab-gib 100 --seconds 1; sleep 600'
    mig_allocated_to mig-e-1 "gpu-$MIG_GPU-mig-1g-18gb-0"
    mig_allocated_to mig-e-2 "gpu-$MIG_GPU-mig-1g-18gb-0"
    wait_phase mig-e-1 Running "$MIG_WAIT"
    wait_phase mig-e-2 Running "$MIG_WAIT"
    eventually 60 "mig-e-1's tenant output" printed mig-e-1 'GPU time'
    eventually 60 "mig-e-2's tenant output" printed mig-e-2 'GPU time'
    local l1 l2 u1 u2 a
    l1=$(kc logs mig-e-1)
    l2=$(kc logs mig-e-2)
    echo "$l1"
    echo "$l2"
    u1=$(mig_visible mig-e-1)
    u2=$(mig_visible mig-e-2)
    expect_match "mig-e-1's CUDA_VISIBLE_DEVICES" "$u1" '^MIG-[0-9a-fA-F-]+$'
    expect_eq "one instance for both claims" "$(mig_uuid "$u2")" "$(mig_uuid "$u1")"
    expect_eq "the H200's instances" "$(mig_instances)" "0 $MIG_ID_1G $(mig_uuid "$u1")"
    # Each sees its 8 GiB of the instance and is refused past it (its context inside).
    expect_match "E1's card" "$l1" "E1: sees NVIDIA H200 MIG 1g\.18gb with 8\.0 GiB"
    expect_match "E1 refused past its limit" "$l1" "E1: holds 7 GiB; the next 1 GiB was refused: CUDA_ERROR_OUT_OF_MEMORY"
    expect_match "E2's card" "$l2" "E2: sees NVIDIA H200 MIG 1g\.18gb with 8\.0 GiB"
    expect_match "E2 refused past its limit" "$l2" "E2: holds 7 GiB; the next 1 GiB was refused: CUDA_ERROR_OUT_OF_MEMORY"
    # The arbiter schedules the instance as a device: two allocations on it, 50 shares each.
    a=$(mig_allocations_on "$u1")
    echo "the arbiter's allocations on $u1: $a"
    expect_eq "allocations on the instance (share, memory limit, device)" \
        "$(jq -c '[.[] | [.share, .memory_limit, .labels["tessera.dev/claim-device"]]]' <<<"$a")" \
        "[[50,8589934592,\"gpu-$MIG_GPU-mig-1g-18gb-0\"],[50,8589934592,\"gpu-$MIG_GPU-mig-1g-18gb-0\"]]"
    expect_eq "the plugin's checkpoint" "$(mig_records)" "1g.18gb 0 PrepareCompleted 2"
}

test_mig__f_the_last_unprepare_removes_the_instance_and_a_restart_adopts_it() {
    mig_clean_start
    mig_template mig-f-half mig.tessera.dev 50 4Gi "$(mig_sel 1g.18gb 0)"
    claim_pod mig-f1 mig-f-half 'echo visible=$CUDA_VISIBLE_DEVICES; sleep 900'
    claim_pod mig-f2 mig-f-half 'echo visible=$CUDA_VISIBLE_DEVICES; sleep 900'
    wait_phase mig-f1 Running "$MIG_WAIT"
    wait_phase mig-f2 Running "$MIG_WAIT"
    eventually 30 "mig-f1's output" printed mig-f1 '^visible='
    eventually 30 "mig-f2's output" printed mig-f2 '^visible='
    local u before
    u=$(mig_visible mig-f1)
    expect_match "mig-f1's CUDA_VISIBLE_DEVICES" "$u" '^MIG-'
    expect_eq "one instance for both claims" "$(mig_uuid "$(mig_visible mig-f2)")" "$(mig_uuid "$u")"
    before=$(mig_instances)
    expect_eq "the H200's instances" "$before" "0 $MIG_ID_1G $(mig_uuid "$u")"
    expect_eq "the plugin's checkpoint" "$(mig_records)" "1g.18gb 0 PrepareCompleted 2"

    echo "-- the DRA plugin restarts with the instance in use: it adopts it"
    local n line
    n=$(mig_log_count 'MIG at start:')
    mig_restart_plugin "$MIG_PLUGIN_GPUS" "$MIG_PLUGIN_ARGS"
    eventually 60 "the restarted plugin's MIG reconciliation" mig_log_count_above 'MIG at start:' "$n"
    line=$(grep -E 'MIG at start:' "$D/logs/tessera-dra.log" | tail -n 1)
    echo "$line"
    expect_match "the reconciliation" "$line" 'MIG at start: 1 adopted, 0 destroyed, 0 records dropped'
    # A claim check (every 5 s here, and at start) that took the claims for unused would
    # unprepare them now: give it two rounds.
    sleep 12
    expect_eq "mig-f1 after the restart" "$(phase mig-f1)" Running
    expect_eq "mig-f2 after the restart" "$(phase mig-f2)" Running
    expect_eq "the instance after the restart" "$(mig_instances)" "$before"
    expect_eq "the checkpoint after the restart" "$(mig_records)" "1g.18gb 0 PrepareCompleted 2"
    mig_mode_on || fail "MIG mode off on GPU $MIG_GPU with an instance in use"
    mig_limited mig-f1 4

    echo "-- one of its two claims unprepared: the instance stays"
    mig_delete mig-f1
    eventually 60 "mig-f1's claim to leave the checkpoint" mig_records_are "1g.18gb 0 PrepareCompleted 1"
    expect_eq "the instance with one claim left" "$(mig_instances)" "$before"
    mig_allocation_count_is "$u" 1 ||
        fail "allocations on $u with one claim left: $(mig_allocations_on "$u")"
    mig_limited mig-f2 4

    echo "-- the last unprepared: the instance goes, and MIG mode with it"
    mig_delete mig-f2
    eventually 120 "the instance to go" mig_no_instances
    eventually 60 "MIG mode off on GPU $MIG_GPU" mig_mode_off
    expect_eq "the plugin's checkpoint" "$(mig_records)" ""
    eventually 60 "the allocations on $u to go" mig_allocation_count_is "$u" 0
}
