"""Host memory reuse (``scaling.reuse_host_memory``): glibc's malloc told to keep freed blocks for the next step.

Why: on a CPU a training step allocates its activations and gradients afresh, blocks of several to hundreds of
MB (cifar10's VGG at batch 1,024: about 100 MB a layer). glibc serves a block above its mmap threshold (128 KB at
first, rising to at most 32 MB) with its own ``mmap`` and gives it back with ``munmap`` when freed, so the next
step faults those pages in again, each zeroed by the kernel. Ray Train v2 makes it worse: it runs the train
function in a thread (``TrainingThread``), and glibc gives a thread its own arena, whose heaps are at most 64 MB.
In a thread, the cifar10 step faulted 1.9 million pages in 11 steps, 0.34 million with the settings below, and
spent 4.2 s against 0.8 s in the kernel (a one-off count). ``python -m bench.step_env --recipe cifar10
--resolution 32 --batch 1024`` times it: 1.41 s a step in a thread as glibc comes, 1.25 s with the settings
(docs/BENCHMARKS.md). torch asks for aligned blocks (``posix_memalign``), which glibc 2.36 reuses less well than
plain ``malloc``'s, so some faults remain.

The settings are environment variables that glibc reads once, when a process starts, so they go to the processes
of a cluster this run starts (they inherit the driver's environment, as ``CLUSTER_ENV`` does). A joined cluster's
nodes keep their own: there the workers are GPU machines, whose step allocates on the device. The worker says what
its own process got, whoever set it.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Any

# One arena (the main one, which grows with brk and has no 64 MB cap), no mmap for large blocks, and no trimming of
# the heap's top: freed blocks stay in the process for the next step. A value a user already set wins.
MALLOC_ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}


def wanted(setting: str, gpus: int) -> bool:
    """Whether a cluster started here should get :data:`MALLOC_ENV`: ``true``/``false`` as said; ``auto`` when the
    run will train on CPUs (no GPU on this machine)."""
    if setting not in ("auto", "true", "false"):
        raise ValueError(f"scaling.reuse_host_memory={setting!r}: expected auto, true or false")
    return setting == "true" or (setting == "auto" and gpus == 0)


def apply(environ: MutableMapping[str, str]) -> dict[str, str]:
    """Set :data:`MALLOC_ENV` in ``environ`` where not already set; returns the values ``environ`` now holds."""
    for key, value in MALLOC_ENV.items():
        environ.setdefault(key, value)
    return {key: environ[key] for key in MALLOC_ENV}


def describe(environ: MutableMapping[str, str] | None = None) -> dict[str, Any]:
    """The ``host_memory`` unit's event: what this process's malloc was started with."""
    env = os.environ if environ is None else environ
    got = {key: env[key] for key in MALLOC_ENV if key in env}
    on = got.get("MALLOC_MMAP_MAX_") == "0" and got.get("MALLOC_ARENA_MAX") == "1"
    if on:
        message = ("freed host blocks are reused: one malloc arena, no mmap for large blocks, no heap trim "
                   f"({', '.join(f'{k}={v}' for k, v in got.items())})")
    else:
        message = ("off: large host blocks are mapped and unmapped every step (glibc's defaults"
                   + (f", with {', '.join(f'{k}={v}' for k, v in got.items())}" if got else "")
                   + "; scaling.reuse_host_memory applies to a cluster the run starts)")
    return {"unit": "host_memory", "enabled": on, "message": message, "env": got}
