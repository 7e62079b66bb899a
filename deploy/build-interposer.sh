#!/usr/bin/env bash
# Builds the shipped interposer, libtessera_interpose.so, against glibc 2.17 so that it loads in
# every glibc image from 2.17 on (CentOS 7, UBI 8, Ubuntu 20.04, Debian 11 and newer). A plain
# `cargo build` links against the build machine's glibc: on 2.34+ it then needs dlopen, dlvsym
# and pthread_create at GLIBC_2.34 and the loader of an older image skips it.
#
# Needs cargo-zigbuild and zig (both on PyPI: `pip install cargo-zigbuild ziglang`); looks for
# them in $TESSERA_VENV (default: the repository's .venv, made by .ci/test), then on PATH.
#
# Usage: deploy/build-interposer.sh [--debug] [--target-dir DIR]
# Prints the path of the built library on its last line. Default target folder:
# target/glibc-2.17 (its own, so a build beside a running `cargo test` never waits on it).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
profile=release
target_dir="$root/target/glibc-2.17"
while [ $# -gt 0 ]; do
    case "$1" in
        --debug) profile=debug ;;
        --target-dir) target_dir="$2"; shift ;;
        -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "build-interposer.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
venv="${TESSERA_VENV:-$root/.venv}"
if [ -x "$venv/bin/cargo-zigbuild" ]; then
    # The venv's python3 is the one with the ziglang package: cargo-zigbuild runs
    # `python3 -m ziglang` when no `zig` is on PATH.
    PATH="$venv/bin:$PATH"
elif ! command -v cargo-zigbuild >/dev/null 2>&1; then
    echo "build-interposer.sh: cargo-zigbuild not found; install it with" \
         "'pip install cargo-zigbuild ziglang' (or run .ci/test, which puts both in .venv)" >&2
    exit 1
fi
# The `.2.17` suffix is cargo-zigbuild's: link against glibc 2.17's symbol versions.
triple=x86_64-unknown-linux-gnu
flags=(--locked -p tessera-interpose --target "$triple.2.17" --target-dir "$target_dir")
[ "$profile" = release ] && flags+=(--release)
(cd "$root" && cargo zigbuild "${flags[@]}" >&2)
echo "$target_dir/$triple/$profile/libtessera_interpose.so"
