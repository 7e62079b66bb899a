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
    curl -sf http://127.0.0.1:19464/metrics | awk -v re="$1" '$0 ~ re {s += $NF} END {print s + 0}'
}

test_isolation__a_tenant_that_unmounts_the_preload_in_a_user_namespace_is_killed() {
    # Inside its own user and mount namespace the container's root may cover the read-only
    # /etc/ld.so.preload; the driver is then reached with no interposer. 40 GiB against 24.
    shares_pod iso-bypass 30 'echo allocation=$TESSERA_ALLOCATION_ID; unshare -Urm sh -c "mount --bind /dev/null /etc/ld.so.preload &&
        echo preload=\$(cat /etc/ld.so.preload | wc -c) && exec tenant --name X --grab-gib 40 --seconds 20"'
    eventually 120 "the bypass to end" ended iso-bypass
    local l
    l=$(kc logs iso-bypass)
    echo "$l"
    expect_match "the preload was covered" "$l" "preload=0"
    expect_eq "phase" "$(phase iso-bypass)" Failed
    expect_eq "exit code" "$(kc get pod iso-bypass -o jsonpath='{.status.containerStatuses[0].state.terminated.exitCode}')" 137
    local id kill n
    id=$(sed -n 's/^allocation=//p' <<<"$l")
    [ -n "$id" ] || fail "no allocation id in the pod's output"
    # The backstop's reason, in its log and in the allocation's metrics (the pod's events say
    # only that the container was killed).
    kill=$(grep "allocation $id killed" "$D/logs/tessera-arbiter.log" || true)
    echo "$kill"
    expect_match "the backstop's reason" "$kill" "held [0-9.]+ GiB.*allowed 24.06 GiB.*never connected"
    # Killed above the limit (the poll may come at any point past it).
    awk '{for (i = 1; i < NF; i++) if ($i == "held") { exit !($(i + 1) > 24.06) }}' <<<"$kill" ||
        fail "killed at or under the limit: $kill"
    n=$(metric "^tessera_allocation_enforcement_actions.*allocation=\"$id\"")
    echo "enforcement actions of allocation $id: $n"
    [ "${n%.*}" -ge 1 ] || fail "no enforcement action in the arbiter's metrics for $id"
}

test_isolation__a_forged_identity_file_in_a_user_namespace_does_not_escape_the_limit() {
    # Issue 35's attack in a real container: cover the identity file with one naming a token
    # that exists nowhere, and the preload with nothing. The node runs the backstop with
    # --unknown-processes=kill (the shipped chart says report: see docs/security.md).
    local before
    before=$(grep -c "unknown container process .* killed" "$D/logs/tessera-arbiter.log" || true)
    shares_pod iso-forge 30 'echo allocation=$TESSERA_ALLOCATION_ID; unshare -Urm sh -c "
        echo token=forged-0000 > /tmp/id && mount --bind /tmp/id /etc/tessera/tenant &&
        mount --bind /dev/null /etc/ld.so.preload && cat /etc/tessera/tenant &&
        exec tenant --name F --grab-gib 40 --seconds 20"'
    eventually 120 "the forger to end" ended iso-forge
    local l
    l=$(kc logs iso-forge)
    echo "$l"
    expect_match "the identity was covered" "$l" "token=forged-0000"
    expect_eq "exit code" "$(kc get pod iso-forge -o jsonpath='{.status.containerStatuses[0].state.terminated.exitCode}')" 137
    local after
    after=$(grep -c "unknown container process .* killed" "$D/logs/tessera-arbiter.log" || true)
    [ "$after" -gt "$before" ] || fail "no 'unknown container process ... killed' line in the arbiter's log"
    grep "unknown container process .* killed" "$D/logs/tessera-arbiter.log" | tail -n 1
}

test_isolation__a_pod_sees_only_its_own_processes_and_token() {
    shares_pod iso-near 10 "sleep 600"
    wait_phase iso-near Running 120
    # Every token it can read in /proc: how many distinct ones, and how many are not its own
    # (the count of processes carrying its own varies with the moment: the shell, cat, ...).
    shares_pod iso-proc 10 'n=$(ls /proc | grep -c "^[0-9]"); echo procs=$n;
        toks=$(cat /proc/[0-9]*/environ 2>/dev/null | tr "\0" "\n" | grep "^TESSERA_TOKEN=" | sort -u);
        echo distinct=$(echo "$toks" | grep -c .);
        echo foreign=$(echo "$toks" | grep -cvx "TESSERA_TOKEN=$TESSERA_TOKEN")'
    wait_phase iso-proc Succeeded 120
    local l
    l=$(kc logs iso-proc)
    echo "$l"
    # Its own pid namespace: the shell and its few children, never the neighbour's sleep.
    local n
    n=$(sed -n 's/^procs=//p' <<<"$l")
    [ "$n" -le 5 ] || fail "the pod sees $n processes"
    expect_match "one token only" "$l" "^distinct=1$"
    expect_match "and it is its own" "$l" "^foreign=0$"
}
