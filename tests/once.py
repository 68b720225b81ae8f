"""One maker at a time for what the tests of a CI run share (the finished run, the wheel): the default and the
slow suites run each in two pytest processes (pytest-xdist), and the first test of each process to ask would
otherwise build the same thing into the same folder at once. A lock file beside it, held with ``flock``: the
second asker waits, then finds it made."""

from __future__ import annotations

import contextlib
import fcntl
import pathlib
from collections.abc import Iterator


@contextlib.contextmanager
def one_maker(target: pathlib.Path) -> Iterator[None]:
    """Hold ``<target>.lock`` (created beside ``target``) for the block; the lock ends with the process too."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
