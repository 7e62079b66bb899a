# The device plugin (tessera.dev/gpu-shares) on the real kubelet: registration, the node's
# capacity, limits inside real containers, the compute split, and the scheduler's refusal.

node_shares() { kc get node "$NODE" -o jsonpath='{.status.allocatable.tessera\.dev/gpu-shares}'; }
node_shares_are() { [ "$(node_shares)" = "$1" ]; }

test_device_plugin__a_the_node_reports_two_hundred_shares() {
    eventually 60 "200 shares on the node" node_shares_are 200
    expect_eq "capacity" \
        "$(kc get node "$NODE" -o jsonpath='{.status.capacity.tessera\.dev/gpu-shares}')" 200
}

test_device_plugin__b_thirty_and_seventy_shares_get_their_memory_and_time() {
    local t
    t=$(start_at 25)
    local run="echo visible=\$NVIDIA_VISIBLE_DEVICES; $(wait_until "$t");"
    shares_pod dp-30 30 "$run tenant --name A --grab-gib 100 --seconds 8"
    shares_pod dp-70 70 "$run tenant --name B --grab-gib 100 --seconds 8"
    wait_phase dp-30 Succeeded 120
    wait_phase dp-70 Succeeded 60
    local a b
    a=$(kc logs dp-30)
    b=$(kc logs dp-70)
    echo "$a"
    echo "$b"
    # Both fractions on one card (the plugin packs), so their time is contended.
    expect_eq "one GPU for both" "$(grep visible= <<<"$a")" "$(grep visible= <<<"$b")"
    # 30 and 70 of a GPU's 100 units: 30% and 70% of its 80 GiB, the context inside.
    expect_match "A's card" "$a" "A: sees .* with 24\.0 GiB"
    expect_match "B's card" "$b" "B: sees .* with 56\.0 GiB"
    expect_match "A refused past its limit" "$a" "A: holds (2[0-3]) GiB; the next 1 GiB was refused: CUDA_ERROR_OUT_OF_MEMORY"
    expect_match "B refused past its limit" "$b" "B: holds (5[0-5]) GiB; the next 1 GiB was refused: CUDA_ERROR_OUT_OF_MEMORY"
    local ga gb
    ga=$(gpu_seconds "$a")
    gb=$(gpu_seconds "$b")
    # The exact split is a benchmark's (compute_share); here a loose bound on real pods.
    awk -v a="$ga" -v b="$gb" 'BEGIN {
        s = a / (a + b); printf "split: A %.1f%% B %.1f%% of the busy time (target 30/70)\n", 100 * s, 100 - 100 * s
        exit !(s > 0.22 && s < 0.38) }' || fail "the split is not near 30/70"
}

test_device_plugin__c_a_share_beyond_the_node_stays_pending() {
    shares_pod dp-full-0 100 "sleep 600"
    shares_pod dp-full-1 100 "sleep 600"
    wait_phase dp-full-0 Running 90
    wait_phase dp-full-1 Running 90
    shares_pod dp-one-more 1 "true"
    eventually 60 "a FailedScheduling event" \
        refused_by_scheduler dp-one-more 'Insufficient tessera.dev/gpu-shares'
    sleep 5
    expect_eq "phase" "$(phase dp-one-more)" Pending
}
