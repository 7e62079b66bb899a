# The DRA driver (gpu.tessera.dev) on the real kubelet, scheduler and controller manager:
# registration, the published ResourceSlice, placement by consumable capacity, CDI edits applied
# by containerd, limits inside, unprepare on delete, and a memory-only claim.

# The device a pod's claim was allocated ("gpu-0").
claim_device() {
    kc get resourceclaims -o json | jq -r --arg p "$1" '.items[]
        | select(any(.status.reservedFor[]?; .name == $p))
        | .status.allocation.devices.results[0].device'
}

test_dra__a_the_plugin_registers_and_publishes_the_gpus() {
    one_slice() { [ "$(slice_json | jq length)" = 1 ]; }
    eventually 60 "the node's ResourceSlice" one_slice
    local s
    s=$(slice_json)
    expect_eq "devices" "$(jq '.[0].spec.devices | length' <<<"$s")" 2
    expect_eq "shares of gpu-0" \
        "$(jq -r '.[0].spec.devices[] | select(.name == "gpu-0") | .capacity.shares.value' <<<"$s")" 100
    # The kubelet took the plugin: its registration folder's socket was accepted (the
    # kubelet logs the registration; a refused plugin is logged as such).
    eventually 30 "the kubelet's registration of gpu.tessera.dev" \
        grep -q 'Connection changed.*driverName="gpu.tessera.dev".*connected=true' "$D/logs/kubelet.log"
}

test_dra__b_the_scheduler_places_fractions_by_capacity_and_the_limits_hold() {
    claim_template c30 30 20Gi
    claim_template c70 70 40Gi
    claim_template c50 50 16Gi
    claim_template c60 60 8Gi
    local run='echo visible=$CUDA_VISIBLE_DEVICES; tenant --name T --grab-gib 100 --seconds 1; sleep 600'
    claim_pod dra-30 c30 "$run"
    wait_phase dra-30 Running 120
    claim_pod dra-70 c70 "$run"
    wait_phase dra-70 Running 120
    claim_pod dra-50 c50 "$run"
    wait_phase dra-50 Running 120
    local d30 d70 d50
    d30=$(claim_device dra-30)
    d70=$(claim_device dra-70)
    d50=$(claim_device dra-50)
    echo "placed: 30 on $d30, 70 on $d70, 50 on $d50"
    expect_eq "30 and 70 share a GPU" "$d30" "$d70"
    [ "$d50" != "$d30" ] || fail "50 shares placed on the full GPU $d30"
    # A claim that fits nowhere (60 shares: 0 left on one GPU, 50 on the other) stays Pending
    # with the scheduler's own reason.
    claim_pod dra-60 c60 "true"
    eventually 60 "the scheduler's refusal" refused_by_scheduler dra-60 'cannot allocate all claims'
    expect_eq "phase of dra-60" "$(phase dra-60)" Pending
    # Inside: the claim's memory is the card the process sees, and the limit holds.
    eventually 30 "dra-30's tenant output" printed dra-30 'GPU time'
    local l30 l70
    l30=$(kc logs dra-30)
    l70=$(kc logs dra-70)
    echo "$l30"
    expect_match "30's card" "$l30" "T: sees .* with 20\.0 GiB"
    expect_match "30 refused" "$l30" "T: holds 19 GiB; the next 1 GiB was refused: CUDA_ERROR_OUT_OF_MEMORY"
    expect_match "70's card" "$l70" "T: sees .* with 40\.0 GiB"
    # containerd applied Tessera's CDI edits: the preload and the identity are there.
    expect_match "preload" "$(kc exec dra-30 -- cat /etc/ld.so.preload)" "libtessera_interpose"
    kc exec dra-30 -- test -s /etc/tessera/tenant || fail "no identity file in dra-30"
    # Deleting the pod unprepares its claim: its arbiter allocation goes.
    local before after
    before=$(allocations_json | jq 'length')
    kc delete pod dra-30 --grace-period=1 --wait=true --timeout=60s >/dev/null
    fewer() { [ "$(allocations_json | jq 'length')" -lt "$1" ]; }
    eventually 60 "the allocation of dra-30 to go" fewer "$before"
    after=$(allocations_json | jq 'length')
    echo "allocations: $before before the delete, $after after"
    # The freed 30 shares are placeable again.
    claim_template c30b 30 8Gi
    claim_pod dra-30b c30b "sleep 600"
    wait_phase dra-30b Running 120
    expect_eq "the freed room is reused" "$(claim_device dra-30b)" "$d30"
}

test_dra__c_a_memory_only_claim_gets_a_fraction() {
    claim_template cmem "" 8Gi
    claim_pod dra-mem cmem 'tenant --name M --grab-gib 100 --seconds 1; sleep 600'
    wait_phase dra-mem Running 120
    eventually 30 "dra-mem's tenant output" printed dra-mem 'GPU time'
    # The scheduler charged the class's default share, not the whole card, and the plugin
    # made an allocation of exactly that.
    local alloc
    alloc=$(allocations_json | jq -c '.[] | select(.memory_limit == 8589934592)')
    echo "the memory-only claim's allocation: $alloc"
    local share
    share=$(jq -r .share <<<"$alloc")
    [ -n "$share" ] && [ "$share" -lt 100 ] || fail "a memory-only claim got share '$share'"
    expect_eq "consumed shares" "$(kc get resourceclaims -o json | jq -r '.items[] | select(any(.status.reservedFor[]?; .name == "dra-mem")) | .status.allocation.devices.results[0].consumedCapacity.shares')" "$share"
    local l
    l=$(kc logs dra-mem)
    echo "$l"
    expect_match "memory-only card" "$l" "M: sees .* with 8\.0 GiB"
    expect_match "memory-only refused" "$l" "M: holds 7 GiB; the next 1 GiB was refused: CUDA_ERROR_OUT_OF_MEMORY"
}
