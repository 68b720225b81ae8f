"""Where a result came from: the git revision of the code that produced it."""

from __future__ import annotations

import os
import subprocess

_HERE = os.path.dirname(os.path.abspath(__file__))


def git_revision(cwd: str | None = None, short: int = 0) -> str:
    """HEAD's hash of the repository holding ``cwd`` (default: this package), ``short`` hex digits of it when
    given, with ``-dirty`` when tracked files differ from it; "unknown" outside a repository or without git.
    Runs only read-only git commands."""
    where = cwd or _HERE
    head = ["git", "rev-parse", f"--short={short}", "HEAD"] if short else ["git", "rev-parse", "HEAD"]
    try:
        rev = subprocess.run(head, cwd=where, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if rev.returncode != 0:
        return "unknown"
    return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
