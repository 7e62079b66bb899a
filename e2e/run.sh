#!/usr/bin/env bash
# The end-to-end tests on a real one-node Kubernetes (e2e/cluster.sh): brings the cluster up,
# runs every test of e2e/tests/*.sh (or those named: `e2e/run.sh device_plugin dra`), leaves
# every component's log in target/e2e/logs when one fails, and takes the cluster down.
# Needs root, Go 1.26 and `cargo build --workspace` done. E2E_KEEP=1 leaves the cluster up;
# E2E_REUSE=1 runs on a cluster already up (for working on a test).
#
# A group may have a `setup_<group>` and a `teardown_<group>` function (e2e/lib.sh): the setup
# runs before its first test (when it fails, each of its tests fails unrun), the teardown after
# its last, also when a test or the setup failed (when it fails, it counts as a failed test).
#
# The last line is 'e2e: N passed, N failed'; the exit code is 1 when any test failed.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
export E2E_DIR=${E2E_DIR:-/tmp/tessera-e2e}
logs=${E2E_LOGS:-$repo/target/e2e/logs}

t0=$SECONDS
if [ "${E2E_REUSE:-}" = 1 ] && [ -d "$E2E_DIR/pids" ]; then
    echo "== using the cluster already up in $E2E_DIR (E2E_REUSE=1)"
elif [ -d "$E2E_DIR/pids" ]; then
    echo "== a cluster is already up in $E2E_DIR: taking it down first"
    bash "$here/cluster.sh" down
fi
if [ ! -d "$E2E_DIR/pids" ] && ! bash "$here/cluster.sh" up; then
    E2E_LOGS=$logs bash "$here/cluster.sh" logs
    bash "$here/cluster.sh" down
    echo "e2e: 0 passed, 1 failed (the cluster did not come up; logs in $logs)"
    exit 1
fi
echo "== cluster up after $((SECONDS - t0)) s"

. "$here/lib.sh"
for f in "$here"/tests/*.sh; do . "$f"; done
if [ $# -gt 0 ]; then
    groups=("$@")
else
    groups=()
    for f in "$here"/tests/*.sh; do
        n=$(basename "$f" .sh)
        groups+=("${n#[0-9][0-9]_}")
    done
fi

passed=0 failed=0 failures=()
for g in "${groups[@]}"; do
    set_up=1
    if declare -F "setup_${g}" >/dev/null; then
        echo "--- setup_${g}"
        start=$SECONDS
        # Not in an `if`: errexit would be off inside it (as for the tests below).
        ( set -e; "setup_${g}" )
        rc=$?
        if [ $rc = 0 ]; then
            echo "--- ok setup_${g} ($((SECONDS - start)) s)"
        else
            set_up=0
            echo "--- FAILED setup_${g} ($((SECONDS - start)) s): the group's tests are not run"
        fi
    fi
    for t in $(declare -F | awk '{print $3}' | grep "^test_${g}__" ); do
        if [ $set_up = 0 ]; then
            failed=$((failed + 1))
            failures+=("$t")
            echo "--- FAILED $t (not run: setup_${g} failed)"
            continue
        fi
        echo "--- $t"
        start=$SECONDS
        ( set -e; "$t" )
        rc=$?
        if [ $rc = 0 ]; then
            passed=$((passed + 1))
            echo "--- ok $t ($((SECONDS - start)) s)"
        else
            failed=$((failed + 1))
            failures+=("$t")
            echo "--- FAILED $t ($((SECONDS - start)) s)"
        fi
        cleanup_test_objects
    done
    if declare -F "teardown_${g}" >/dev/null; then
        echo "--- teardown_${g}"
        start=$SECONDS
        ( set -e; "teardown_${g}" )
        rc=$?
        if [ $rc = 0 ]; then
            echo "--- ok teardown_${g} ($((SECONDS - start)) s)"
        else
            failed=$((failed + 1))
            failures+=("teardown_${g}")
            echo "--- FAILED teardown_${g} ($((SECONDS - start)) s)"
        fi
    fi
done

if [ $failed -gt 0 ]; then
    E2E_LOGS=$logs bash "$here/cluster.sh" logs
    echo "== failed: ${failures[*]}"
fi
[ "${E2E_KEEP:-}" = 1 ] || bash "$here/cluster.sh" down
echo "== e2e took $((SECONDS - t0)) s"
echo "e2e: $passed passed, $failed failed"
[ $failed = 0 ] && [ $passed -gt 0 ]
