# The latency tier through both Kubernetes paths on the real kubelet, scheduler and API server:
# a claim of a latency DeviceClass (rendered from the Helm chart's `dra.deviceClasses` with
# `tier: latency`) gets a latency-tier allocation; a claim that writes {"tier": "latency"} in
# its own config stays best-effort; the device plugin restarted with --latency-shares serves
# tessera.dev/gpu-latency-shares as latency-tier allocations, and a best-effort pod's
# TESSERA_TIER changes nothing. Each tier is read where an operator reads it: `tessera status
# --json` and the arbiter's metric tessera_allocation_latency_tier.

TIER_CLASS=gpu-latency.tessera.dev

# The allocation (JSON) whose FIELD (`claim` or `pod`) is VALUE, or nothing.
tier_allocation() {
    allocations_json | jq -c --arg f "$1" --arg v "$2" '.[] | select(.[$f] == $v)'
}
tier_has_allocation() { [ -n "$(tier_allocation "$1" "$2")" ]; }

# The value of the arbiter's tessera_allocation_latency_tier series of allocation ID.
tier_metric() {
    curl -sf http://127.0.0.1:19464/metrics |
        awk -v id="$1" 'index($0, "tessera_allocation_latency_tier{allocation=\"" id "\"") == 1 {print $NF + 0}'
}

# `namespace/name` of the claim POD's container uses (made from its template).
tier_claim_of() {
    kc get pod "$1" -o jsonpath='{.status.resourceClaimStatuses[0].resourceClaimName}' |
        sed 's|^|default/|'
}

# tier_expect WHAT ALLOCATION_JSON TIER METRIC_VALUE
tier_expect() {
    local id
    id=$(jq -r .id <<<"$2")
    echo "$1: allocation $id tier $(jq -r .tier <<<"$2"), share $(jq -r .share <<<"$2"), metric $(tier_metric "$id")"
    expect_eq "$1: tier in tessera status --json" "$(jq -r .tier <<<"$2")" "$3"
    expect_eq "$1: tessera_allocation_latency_tier" "$(tier_metric "$id")" "$4"
}

# The chart's DeviceClass of `tier: latency`, rendered by Helm as e2e/cluster.sh renders the
# default classes; without helm-sdkpy, the same class as docs/kubernetes.md writes it.
tier_apply_class() {
    local py=${TESSERA_PYTHON:-$repo/.venv/bin/python}
    if "$py" -c 'import helm_sdkpy, yaml' >/dev/null 2>&1; then
        "$py" - "$repo" "$TIER_CLASS" >"$D/tier-class.json" <<'EOF'
import json, sys
from pathlib import Path
root = Path(sys.argv[1])
sys.path.insert(0, str(root / ".ci"))
import check_deploy
objs = check_deploy.render(root / "deploy/helm/tessera", "tessera-system", {
    "dra": {"enabled": True, "deviceClasses": [{"name": sys.argv[2], "tier": "latency"}]},
    "devicePlugin": {"enabled": False}})
classes = [o for o in objs if o.get("kind") == "DeviceClass"]
assert [c["metadata"]["name"] for c in classes] == [sys.argv[2]], classes
print(json.dumps(classes[0]))
EOF
        echo "the latency DeviceClass from the Helm chart:"
    else
        cat >"$D/tier-class.json" <<EOF
{"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": "$TIER_CLASS"},
 "spec": {"selectors": [{"cel": {"expression": "device.driver == \"gpu.tessera.dev\""}}],
          "config": [{"opaque": {"driver": "gpu.tessera.dev", "parameters": {"tier": "latency"}}}]}}
EOF
        echo "the latency DeviceClass as docs/kubernetes.md writes it (no helm-sdkpy to render the chart's):"
    fi
    jq -c .spec "$D/tier-class.json"
    kc apply -f "$D/tier-class.json" >/dev/null
}

# tier_claim_template NAME CLASS SHARES MEMORY [OWN_CONFIG_JSON]: a ResourceClaimTemplate of
# CLASS; OWN_CONFIG_JSON, when given, is the claim's own opaque configuration of the driver.
tier_claim_template() {
    local config=""
    [ -n "${5:-}" ] && config="
      config:
      - requests: [gpu]
        opaque:
          driver: gpu.tessera.dev
          parameters: $5"
    kc apply -f - >/dev/null <<EOF
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata:
  name: $1
  labels: {e2e: "1"}
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly:
          deviceClassName: $2
          capacity:
            requests:
              shares: "$3"
              memory: $4$config
EOF
}

test_tier__a_dra_the_class_sets_the_tier_and_the_claims_own_config_does_not() {
    trap 'kc delete deviceclass "$TIER_CLASS" --ignore-not-found --wait=true --timeout=60s >/dev/null 2>&1 || true' EXIT
    tier_apply_class
    tier_claim_template tier-lat "$TIER_CLASS" 20 8Gi
    # The workload asks for the tier itself, twice over: in its claim's own configuration (the
    # scheduler copies it into the allocation as FromClaim) and in its environment.
    tier_claim_template tier-own gpu.tessera.dev 20 8Gi '{"tier": "latency"}'
    claim_pod tier-dra-lat tier-lat \
        'tenant --name L --grab-gib 100 --seconds 0.5; sleep 600'
    pod tier-dra-own 'tenant --name O --grab-gib 100 --seconds 0.5; sleep 600' "    env:
    - {name: TESSERA_TIER, value: latency}
    resources:
      claims:
      - name: gpu" "  resourceClaims:
  - name: gpu
    resourceClaimTemplateName: tier-own"
    wait_phase tier-dra-lat Running 120
    wait_phase tier-dra-own Running 120
    local lat own
    lat=$(tier_claim_of tier-dra-lat)
    own=$(tier_claim_of tier-dra-own)
    # The claim's own configuration did reach the allocation: it is the workload's and ignored.
    expect_eq "the claim's own config in its allocation" "$(kc get resourceclaim "${own#default/}" \
        -o jsonpath='{.status.allocation.devices.config[0].source}')" FromClaim
    eventually 30 "the latency claim's allocation" tier_has_allocation claim "$lat"
    eventually 30 "the claim-config claim's allocation" tier_has_allocation claim "$own"
    tier_expect "latency DeviceClass" "$(tier_allocation claim "$lat")" latency 1
    tier_expect "claim's own {\"tier\":\"latency\"}" "$(tier_allocation claim "$own")" best-effort 0
    # Both are ordinary tenants inside: their claims' memory, the limit holding.
    eventually 60 "both tenants' output" sh -c \
        "kubectl logs tier-dra-lat | grep -q 'GPU time' && kubectl logs tier-dra-own | grep -q 'GPU time'"
    expect_match "the latency tenant's card" "$(kc logs tier-dra-lat)" "L: sees .* with 8\.0 GiB"
    expect_match "the other tenant's card" "$(kc logs tier-dra-own)" "O: sees .* with 8\.0 GiB"
}

# Allocatable RESOURCE of the node, or nothing.
tier_node_has() {
    local key=${1//./\\.}
    [ "$(kc get node "$NODE" -o jsonpath="{.status.allocatable.$key}")" = "$2" ]
}

# Latency allocations of the device plugin left in the arbiter.
tier_latency_allocations() {
    allocations_json | jq '[.[] | select(.labels["tessera.dev/resource"] == "tessera.dev/gpu-latency-shares")] | length'
}
tier_no_latency_allocations() { [ "$(tier_latency_allocations)" = 0 ]; }

# The plain plugin back after a failure, once this test's pods' allocations are gone.
tier_restore_plugin() {
    kc delete pods -l e2e=1 --grace-period=0 --force --wait=true --timeout=60s >/dev/null 2>&1 || true
    (eventually 60 "the latency allocations to go" tier_no_latency_allocations) || true
    bash "$here/cluster.sh" stop tessera-device-plugin
    bash "$here/cluster.sh" start-device-plugin
}

test_tier__b_device_plugin_the_latency_resource_makes_latency_allocations() {
    # The cluster's plugin runs without a latency split; this test's runs with 30 of each GPU's
    # 100 units as the latency resource, and the plain plugin comes back after it, pass or fail.
    TIER_RESTORED=0
    trap '[ "$TIER_RESTORED" = 1 ] || tier_restore_plugin' EXIT
    bash "$here/cluster.sh" stop tessera-device-plugin
    E2E_DEVICE_PLUGIN_ARGS="--latency-shares 30" bash "$here/cluster.sh" start-device-plugin
    eventually 90 "60 latency units on the node" tier_node_has tessera.dev/gpu-latency-shares 60
    eventually 30 "140 best-effort units on the node" tier_node_has tessera.dev/gpu-shares 140
    pod tier-dp-lat 'tenant --name L --grab-gib 100 --seconds 0.5; sleep 600' "    resources:
      limits:
        tessera.dev/gpu-latency-shares: \"20\""
    # A best-effort pod that says it is latency in its environment.
    pod tier-dp-be 'tenant --name B --grab-gib 100 --seconds 0.5; sleep 600' "    env:
    - {name: TESSERA_TIER, value: latency}
    resources:
      limits:
        tessera.dev/gpu-shares: \"30\""
    wait_phase tier-dp-lat Running 120
    wait_phase tier-dp-be Running 120
    # The plugin names each allocation's pod from the kubelet's PodResources within a second.
    eventually 60 "the latency pod's allocation" tier_has_allocation pod default/tier-dp-lat/main
    eventually 60 "the best-effort pod's allocation" tier_has_allocation pod default/tier-dp-be/main
    local lat be
    lat=$(tier_allocation pod default/tier-dp-lat/main)
    be=$(tier_allocation pod default/tier-dp-be/main)
    tier_expect "tessera.dev/gpu-latency-shares: 20" "$lat" latency 1
    expect_eq "the latency allocation's share" "$(jq -r .share <<<"$lat")" 20
    tier_expect "tessera.dev/gpu-shares: 30 with TESSERA_TIER=latency" "$be" best-effort 0
    expect_eq "the best-effort allocation's share" "$(jq -r .share <<<"$be")" 30
    # 20 and 30 units of a GPU's 100: 16 and 24 GiB of its 80, each process in its own.
    eventually 60 "both tenants' output" sh -c \
        "kubectl logs tier-dp-lat | grep -q 'GPU time' && kubectl logs tier-dp-be | grep -q 'GPU time'"
    expect_match "the latency tenant's card" "$(kc logs tier-dp-lat)" "L: sees .* with 16\.0 GiB"
    expect_match "the best-effort tenant's card" "$(kc logs tier-dp-be)" "B: sees .* with 24\.0 GiB"

    echo "-- the split turned off under a running latency pod, then the pod deleted"
    bash "$here/cluster.sh" stop tessera-device-plugin
    bash "$here/cluster.sh" start-device-plugin
    TIER_RESTORED=1
    eventually 60 "200 best-effort units again" tier_node_has tessera.dev/gpu-shares 200
    # The plain plugin keeps looking after the latency resource's allocations: the running
    # pod's stays, and once no pod holds its units it goes rather than holding 20 shares.
    expect_eq "the running latency pod's allocation" "$(tier_latency_allocations)" 1
    kc delete pods tier-dp-lat tier-dp-be --grace-period=0 --force --wait=true --timeout=60s >/dev/null 2>&1
    eventually 60 "the plain plugin to delete the latency allocation" tier_no_latency_allocations
}
