"""Run one step of a suite under a time limit and end everything it started, at the limit or after it exits.

    python -m bench.step_limit SECONDS LOG -- COMMAND [ARG ...]

``timeout -k`` signals its child's process group, and that is not enough for a step that starts Ray: Ray's
driver calls ``setpgrp`` and Ray's own processes (GCS, raylet, workers) start in sessions of their own, so a step
killed at its limit, or one that exits leaving its local cluster up, kept a GPU worker and the cores busy under the
next step. Here every process of the step carries a marker in its environment (inherited by Ray's processes as
by any child, whatever group or session it moves to); at the end every process that carries it is sent SIGTERM,
then SIGKILL after a grace period.

Exit status: the command's, 124 when it ran past the limit (as ``timeout``), 2 for a bad call. One line on
stderr when it ran past the limit or left processes behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

MARKER = "LIGHTRAY_STEP_ID"
GRACE_S = 5.0
SCANS = 3  # looks at /proc after the command exits, 50 ms apart
TIMED_OUT = 124


def marked_pids(marker: str, value: str) -> list[int]:
    """Processes (other than this one) whose environment holds ``marker=value``; those not readable are skipped."""
    want = f"{marker}={value}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if want in f.read().split(b"\0"):
                    found.append(int(name))
        except OSError:  # ended meanwhile, or another user's
            continue
    return found


def end_marked(marker: str, value: str, grace_s: float = GRACE_S) -> int:
    """SIGTERM to every marked process, SIGKILL to those still there after ``grace_s``; how many there were."""
    pids = marked_pids(marker, value)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 2.0)
        while (pids := marked_pids(marker, value)) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not pids:
            break
    return len(pids)


def run_limited(limit_s: float, log_path: str, command: list[str]) -> int:
    """The command, its output into ``log_path``, ended with all it started at ``limit_s``; its exit status."""
    value = uuid.uuid4().hex
    env = {**os.environ, MARKER: value}
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            rc = TIMED_OUT
        # A child caught in execve can show an empty environment for that instant: look a few times.
        found: set[int] = set()
        for _ in range(SCANS):
            found.update(marked_pids(MARKER, value))
            time.sleep(0.05)
        left = sorted(found)
        if left:
            end_marked(MARKER, value)
            proc.wait()
    took = time.monotonic() - t0
    if rc == TIMED_OUT:
        print(f"step_limit: {command[0]} ran past its {limit_s:g} s limit; ended it and the {len(left)} "
              f"process(es) it had started", file=sys.stderr)
    elif left:
        print(f"step_limit: {command[0]} exited {rc} after {took:.0f} s leaving {len(left)} process(es); ended them",
              file=sys.stderr)
    return rc


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: python -m bench.step_limit SECONDS LOG -- COMMAND [ARG ...]"
    if len(args) < 4 or args[2] != "--":
        print(f"step_limit: {usage}", file=sys.stderr)
        return 2
    try:
        limit = float(args[0])
    except ValueError:
        limit = -1.0
    if limit <= 0:
        print(f"step_limit: SECONDS: bad value {args[0]!r}; expected a positive number ({usage})", file=sys.stderr)
        return 2
    return run_limited(limit, args[1], args[3:])


if __name__ == "__main__":
    sys.exit(main())
