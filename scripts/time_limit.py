#!/usr/bin/env python3
"""Runs one command under a time limit, as GNU `timeout` would (macOS has no `timeout`).

    python3 scripts/time_limit.py SECONDS [--mark FILE] -- COMMAND [ARG...]

The command runs in a session of its own, its output going where this script's goes. If it is still
running after SECONDS, the script says so on stderr ("time_limit: timed out after N s: ..."), sends
SIGTERM to the command's whole process group (what it started too), SIGKILL to the group 10 seconds
later if anything is left, writes "timed out" to FILE (--mark) and exits with status 124. Otherwise
it exits with the command's own status (128 + the signal's number when a signal ended it). A SIGINT
or SIGTERM sent to this script (Ctrl-C) goes to the command's group as well.

scripts/mac_acceptance.sh runs every step through it, so that a step that hangs (a GPU wait that never
returns, a deadlock) is recorded as "timed out" with its output, and the run goes on. Standard
library only, Python 3.9+ (the acceptance run uses it before any venv exists).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Optional

TIMED_OUT = 124  # GNU timeout's status
GRACE_SECONDS = 10.0


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run(limit: float, command: list[str], mark: Optional[str] = None, grace: float = GRACE_SECONDS) -> int:
    """The exit status of `command` run under `limit` seconds (TIMED_OUT when it ran out)."""
    try:
        child = subprocess.Popen(command, start_new_session=True)
    except OSError as e:
        print(f"time_limit: cannot run {command[0]}: {e}", file=sys.stderr, flush=True)
        return 127

    def forward(signum, frame):  # (the user's Ctrl-C reaches the command's whole group)
        _signal_group(child.pid, signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    try:
        status = child.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        print(f"\ntime_limit: timed out after {limit:g} s: {' '.join(command)[:300]}", file=sys.stderr, flush=True)
        if mark:
            with open(mark, "w", encoding="utf-8") as f:
                f.write("timed out\n")
        _signal_group(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.1)
        _signal_group(child.pid, signal.SIGKILL)  # (whatever of the group is left)
        child.wait()
        return TIMED_OUT
    return 128 - status if status < 0 else status


def main(argv: list[str]) -> int:
    usage = "usage: time_limit.py SECONDS [--mark FILE] -- COMMAND [ARG...]"
    if "--" not in argv:
        print(usage, file=sys.stderr)
        return 2
    split = argv.index("--")
    options, command = argv[:split], argv[split + 1 :]
    mark = None
    if len(options) == 3 and options[1] == "--mark":
        mark = options[2]
        options = options[:1]
    try:
        limit = float(options[0]) if len(options) == 1 else -1.0
    except ValueError:
        limit = -1.0
    if limit <= 0 or not command:
        print(usage, file=sys.stderr)
        return 2
    return run(limit, command, mark)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
