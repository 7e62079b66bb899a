# Isolation in real containers: no GPU without a request, and a tenant that steps around the
# interposer from inside its container is stopped by the backstop, with the reason in metrics.

test_isolation__a_pod_without_a_gpu_request_gets_no_interposer_and_no_gpu() {
    pod iso-none 'test ! -e /etc/ld.so.preload && echo no-preload;
        env | grep -c "^TESSERA_\|^NVIDIA_VISIBLE" || true; hello_gpu; echo rc=$?'
    wait_phase iso-none Succeeded 120
    local l
    l=$(kc logs iso-none)
    echo "$l"
    expect_match "no preload" "$l" "^no-preload$"
    expect_match "no Tessera variables" "$l" "^0$"
    expect_match "no driver" "$l" "libcuda.so.1 not found"
    expect_match "hello_gpu failed" "$l" "rc=[1-9]"
}

metric() { # SERIES-REGEX: the sum of the arbiter's samples whose line matches
    curl -sf http://127.0.0.1:19464/metrics | grep -E "$1" | awk '{s += $NF} END {print s + 0}'
}

test_isolation__a_tenant_that_unmounts_the_preload_in_a_user_namespace_is_killed() {
    # Inside its own user and mount namespace the container's root may cover the read-only
    # /etc/ld.so.preload; the driver is then reached with no interposer. 40 GiB against 24.
    shares_pod iso-bypass 30 'unshare -Urm sh -c "mount --bind /dev/null /etc/ld.so.preload &&
        echo preload=\$(cat /etc/ld.so.preload | wc -c) && exec tenant --name X --grab-gib 40 --seconds 20"'
    eventually 120 "the bypass to end" sh -c \
        "kubectl get pod iso-bypass -o jsonpath='{.status.phase}' | grep -Eq 'Failed|Succeeded'"
    local l
    l=$(kc logs iso-bypass)
    echo "$l"
    expect_match "the preload was covered" "$l" "preload=0"
    expect_eq "phase" "$(phase iso-bypass)" Failed
    expect_eq "exit code" "$(kc get pod iso-bypass -o jsonpath='{.status.containerStatuses[0].state.terminated.exitCode}')" 137
    grep -q "iso-bypass\|killed" "$D/logs/tessera-arbiter.log" || fail "no kill in the arbiter's log"
    local n
    n=$(metric 'tessera_allocation_enforcement_actions\{.*pod="iso-bypass"')
    echo "enforcement actions for iso-bypass: $n"
    [ "${n%.*}" -ge 1 ] || fail "no enforcement action in the arbiter's metrics for iso-bypass"
}
