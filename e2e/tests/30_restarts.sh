# Restarts under running pods: the device plugin, the DRA plugin and the arbiter each go down
# and come back; the pods keep running and keep their limits, the kubelet takes the plugins
# again, and the node's ResourceSlice is neither deleted nor re-created.

# limited POD GIB: a process started in POD now sees a GIB GiB card and is refused past it.
limited() {
    local out
    out=$(kc exec "$1" -- tenant --name X --grab-gib 200 --seconds 0.2 2>&1) || fail "exec in $1: $out"
    expect_match "$1's card" "$out" "X: sees .* with $2\.0 GiB"
    expect_match "$1 refused" "$out" "X: holds [0-9]+ GiB; the next 1 GiB was refused: CUDA_ERROR_OUT_OF_MEMORY"
}

slice_uid() { slice_json | jq -r '.[].metadata.uid'; }

test_restarts__pods_keep_running_and_limited_across_plugin_and_arbiter_restarts() {
    shares_pod rs-dp 30 "sleep 900"
    claim_template rs-c 40 16Gi
    claim_pod rs-dra rs-c "sleep 900"
    wait_phase rs-dp Running 120
    wait_phase rs-dra Running 120
    limited rs-dp 24
    limited rs-dra 16

    echo "-- the device plugin restarts"
    bash "$here/cluster.sh" stop tessera-device-plugin
    bash "$here/cluster.sh" start-device-plugin
    eventually 60 "the kubelet to take the device plugin again" sh -c \
        "test \$(grep -c 'Registered device plugin\|Got registration request from device plugin' '$D/logs/kubelet.log') -ge 2"
    eventually 60 "200 shares again" node_shares_are 200
    expect_eq "rs-dp after the plugin's restart" "$(phase rs-dp)" Running
    limited rs-dp 24
    shares_pod rs-dp-new 10 "tenant --name N --grab-gib 100 --seconds 0.2"
    wait_phase rs-dp-new Succeeded 120
    expect_match "a new pod's card" "$(kc logs rs-dp-new)" "N: sees .* with 8\.0 GiB"

    echo "-- the DRA plugin restarts"
    local uid
    uid=$(slice_uid)
    [ -n "$uid" ] || fail "no ResourceSlice before the restart"
    bash "$here/cluster.sh" stop tessera-dra
    sleep 3
    expect_eq "the slice while the plugin is down" "$(slice_uid)" "$uid"
    bash "$here/cluster.sh" start-dra-plugin
    sleep 8
    expect_eq "the slice after the restart" "$(slice_uid)" "$uid"
    expect_eq "rs-dra after the plugin's restart" "$(phase rs-dra)" Running
    limited rs-dra 16
    claim_template rs-c2 10 4Gi
    claim_pod rs-dra-new rs-c2 "tenant --name N --grab-gib 100 --seconds 0.2"
    wait_phase rs-dra-new Succeeded 120
    expect_match "a new claim's card" "$(kc logs rs-dra-new)" "N: sees .* with 4\.0 GiB"

    echo "-- the arbiter restarts"
    bash "$here/cluster.sh" stop tessera-arbiter
    bash "$here/cluster.sh" start-arbiter
    eventually 30 "the arbiter's admin socket" allocations_json
    expect_eq "rs-dp after the arbiter's restart" "$(phase rs-dp)" Running
    expect_eq "rs-dra after the arbiter's restart" "$(phase rs-dra)" Running
    limited rs-dp 24
    limited rs-dra 16
}
