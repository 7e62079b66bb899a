#!/usr/bin/env python3
"""Runs the command blocks of README.md and docs/*.md, so that a flag or a name cannot drift.

Every fenced block of shell (```sh, ```bash, ```shell, ```console) carries a marker on the
nearest non-blank line above it, and a block without one fails the check, so none is skipped
silently:

    <!-- runs: simulated -->         run here, on the simulated GPU
    <!-- needs: REASON -->           not run here; REASON says what it needs (a real cluster,
                                     root on a GPU machine, ...), and the check lists it

The runnable blocks of one file run in order in one bash session (`set -euo pipefail`), from
the repository root, so a block may use what an earlier one exported or started; what is still
running when the file ends (an arbiter started with `&`) is stopped. A command that is meant to
fail says so in its trailing comment, `# ... (exit N)`, and must exit exactly N; every other
command must succeed.

Usage: doc_commands.py [--root DIR] [--list] [FILE.md ...]   (default: README.md docs/*.md)
Exit 0: every runnable block ran as written and every block is marked; 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SHELL_FENCES = {"sh", "bash", "shell", "console"}
MARKER = re.compile(r"^<!--\s*(runs|needs):\s*(.+?)\s*-->$")
EXPECT = re.compile(r"#.*\(exit (\d+)\)\s*$")
# One file's blocks together (the README's tour builds, starts an arbiter and runs the demo).
FILE_TIMEOUT_S = 300


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    kind: str  # "runs" or "needs"
    what: str
    text: str

    def where(self, root: Path) -> str:
        return f"{self.path.relative_to(root)}:{self.line}"


def blocks(path: Path, problems: list[str], root: Path) -> list[Block]:
    """The shell blocks of one Markdown file; unmarked ones are reported in `problems`."""
    lines = path.read_text().split("\n")
    out, i = [], 0
    while i < len(lines):
        fence = re.match(r"^(\s*)```+\s*(\S*)", lines[i])
        if not fence:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith("```"):
            end += 1
        lang = fence.group(2).lower()
        if lang in SHELL_FENCES:
            above = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()),
                         "")
            m = MARKER.match(above)
            where = f"{path.relative_to(root)}:{i + 1}"
            if not m:
                problems.append(f"{where}: a ```{lang} block without <!-- runs: simulated --> "
                                f"or <!-- needs: REASON --> above it")
            elif m.group(1) == "runs" and m.group(2) != "simulated":
                problems.append(f"{where}: unknown marker 'runs: {m.group(2)}' (only "
                                f"'runs: simulated')")
            else:
                out.append(Block(path, i + 1, m.group(1), m.group(2),
                                 "\n".join(lines[i + 1:end])))
        i = end + 1
    return out


def logical_lines(text: str) -> list[str]:
    """Lines with their `\\` continuations joined."""
    out, cur = [], ""
    for line in text.split("\n"):
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        out.append(cur + line)
        cur = ""
    if cur:
        out.append(cur)
    return out


def script(runnable: list[Block], root: Path) -> str:
    """One bash script for a file's runnable blocks, each command checked."""
    parts = ["set -euo pipefail", "cd " + shlex.quote(str(root))]
    for b in runnable:
        where = shlex.quote(b.where(root))
        parts.append(f"echo \"== doc block {b.where(root)}\" >&2")
        for line in logical_lines(b.text):
            m = EXPECT.search(line)
            if not m:
                parts.append(line)
                continue
            want = m.group(1)
            # The command may fail, and must fail with exactly the exit code the doc gives.
            parts.append("set +e")
            parts.append(line)
            parts.append("rc=$?; set -e")
            parts.append(f"[ \"$rc\" -eq {want} ] || {{ echo {where}: "
                         f"{shlex.quote(line.strip())} exited \"$rc\", the doc says {want} >&2; "
                         f"exit 1; }}")
    return "\n".join(parts) + "\n"


def run_file(runnable: list[Block], root: Path) -> tuple[bool, str]:
    with tempfile.NamedTemporaryFile("w", suffix=".sh", delete=False) as f:
        f.write(script(runnable, root))
        path = f.name
    # Output to a file, not a pipe: a process a block left running (`&`) keeps its copy of the
    # descriptor, and reading a pipe to its end would wait for it. Its own process group: what
    # is left running is stopped with the page.
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(["bash", path], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        try:
            ok = proc.wait(timeout=FILE_TIMEOUT_S) == 0
        except subprocess.TimeoutExpired:
            ok = False
            log.write(f"\ntimed out after {FILE_TIMEOUT_S} s\n")
        finally:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                time.sleep(0.5)
            proc.wait()
            os.unlink(path)
        log.seek(0)
        return ok, log.read()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--list", action="store_true", help="list the blocks, run nothing")
    ap.add_argument("files", nargs="*", type=Path)
    args = ap.parse_args()
    root = args.root.resolve()
    files = [f.resolve() for f in args.files] or \
        [root / "README.md"] + sorted((root / "docs").glob("*.md"))

    problems: list[str] = []
    per_file = [(f, blocks(f, problems, root)) for f in files]
    ran = needs = 0
    for f, bs in per_file:
        for b in bs:
            if b.kind == "needs":
                needs += 1
                print(f"  not run here: {b.where(root)}: needs {b.what}")
        runnable = [b for b in bs if b.kind == "runs"]
        if not runnable or args.list:
            continue
        started = time.monotonic()
        ok, output = run_file(runnable, root)
        took = time.monotonic() - started
        if ok:
            ran += len(runnable)
            print(f"  ran {len(runnable)} block(s) of {f.relative_to(root)} ({took:.0f} s)")
        else:
            problems.append(f"{f.relative_to(root)}: a block failed ({took:.0f} s); its "
                            f"output:\n{output[-6000:]}")
    print(f"doc_commands: {ran} blocks ran on the simulated GPU, {needs} need what this "
          f"machine lacks (listed)")
    for p in problems:
        print(f"  FAILED: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
