#!/usr/bin/env python3
"""The workspace's `rust-version` is at least every locked dependency's.

Cargo refuses to build a dependency whose `rust-version` is newer than the toolchain, so a
workspace that declares less than its lock file needs promises a toolchain that cannot build
it (1.88 was declared while the locked kube 5.0.0 declares 1.89). `cargo metadata --locked
--offline` lists every package of the lock file that the host platform builds, with its
`rust-version`; this compares them, without building anything.

Exit 0: the declared version covers the lock; 1: it does not (the packages that need more are
listed); 2: cargo metadata failed.
"""

from __future__ import annotations

import json
import subprocess
import sys


def version(text: str) -> tuple[int, int, int]:
    """`1.89` and `1.89.0` are the same version."""
    parts = [int(p) for p in text.split(".")] + [0, 0]
    return parts[0], parts[1], parts[2]


def main() -> int:
    host = subprocess.run(["rustc", "-vV"], capture_output=True, text=True, check=True).stdout
    triple = next(line.split(": ", 1)[1] for line in host.splitlines()
                  if line.startswith("host: "))
    out = subprocess.run(["cargo", "metadata", "--format-version", "1", "--locked", "--offline",
                          "--filter-platform", triple], capture_output=True, text=True)
    if out.returncode != 0:
        print(f"check_msrv: cargo metadata failed:\n{out.stderr}", file=sys.stderr)
        return 2
    meta = json.loads(out.stdout)
    packages = {p["id"]: p for p in meta["packages"]}
    deps = {n["id"]: [d["pkg"] for d in n["deps"]] for n in meta["resolve"]["nodes"]}
    members = meta["workspace_members"]
    problems, newest = [], "0"
    # Each member against everything it builds with (dev and build dependencies too: the
    # tests are built with the same toolchain); a member without rust-version promises nothing.
    for member in members:
        declared = packages[member].get("rust_version")
        seen, todo = set(), list(deps.get(member, []))
        while todo:
            pid = todo.pop()
            if pid in seen:
                continue
            seen.add(pid)
            todo.extend(deps.get(pid, []))
        for pid in seen:
            rv = packages[pid].get("rust_version")
            if not rv:
                continue
            newest = max(newest, rv, key=version)
            if declared and version(rv) > version(declared):
                problems.append((packages[member]["name"], declared, packages[pid]["name"],
                                 packages[pid]["version"], rv))
    if problems:
        print("check_msrv: a rust-version is older than what the lock file needs:",
              file=sys.stderr)
        for member, declared, name, ver, rv in sorted(set(problems)):
            print(f"  {member} declares {declared}; it builds {name} {ver}, rust-version {rv}",
                  file=sys.stderr)
        return 1
    print(f"check_msrv: every member's rust-version covers its locked dependencies (the "
          f"newest needs {newest})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
