"""The ``host_memory`` unit (``scaling.reuse_host_memory``): which clusters get glibc's reuse settings, what the worker
says it got, and that the settings do what they are for: a thread that frees and allocates a training step's large
blocks again finds them in the process instead of faulting fresh pages in from the kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lightray.train import host_memory
from lightray.train.host_memory import MALLOC_ENV

# A step's shape in miniature, in a thread as Ray Train runs the train function: a forward that keeps activations
# of several sizes (4-96 MB, both sides of glibc's 32 MB mmap ceiling) and a backward that frees them in reverse,
# five times after one warm-up; prints the minor page faults of those five.
STEPS = """
import resource, threading, torch
sizes_mb = [4, 24, 48, 96, 12, 40]
out = {}
def step():
    kept = [torch.ones(mb << 18) for mb in sizes_mb]  # float32: mb << 18 elements = mb MB
    grads = [torch.ones_like(t) for t in reversed(kept)]
    del grads, kept
def loop():
    step()
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        step()
    out["faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0
t = threading.Thread(target=loop)
t.start()
t.join()
print(out["faults"])
"""


def _faults(extra: dict[str, str]) -> int:
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_ENV}  # an in-process connect_ray may have set them
    out = subprocess.run([sys.executable, "-c", STEPS], env={**env, **extra, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, check=True).stdout
    return int(out.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings")
def test_with_the_settings_a_threads_freed_large_blocks_are_reused_not_faulted_in_again():
    plain, reused = _faults({}), _faults(MALLOC_ENV)
    # Five steps touch 2 x 224 MB = 115k pages of 4 KB each; glibc as it comes maps and faults most of them in
    # again every step, with the settings most come back from the heap.
    assert plain > 100_000, plain
    assert reused < plain / 3, (reused, plain)


def test_a_cluster_started_here_gets_the_settings_on_cpus_and_a_users_own_value_wins():
    assert host_memory.wanted("auto", gpus=0) and not host_memory.wanted("auto", gpus=1)
    assert host_memory.wanted("true", gpus=4) and not host_memory.wanted("false", gpus=0)
    with pytest.raises(ValueError, match="scaling.reuse_host_memory='yes'"):
        host_memory.wanted("yes", gpus=0)
    env = {"MALLOC_ARENA_MAX": "2"}
    got = host_memory.apply(env)
    assert got == {**MALLOC_ENV, "MALLOC_ARENA_MAX": "2"} == env
    # The worker says what its own process got: with the user's 2 arenas the unit is not on.
    said = host_memory.describe(env)
    assert said["unit"] == "host_memory" and not said["enabled"] and "MALLOC_ARENA_MAX=2" in said["message"]
    on = host_memory.describe(dict(MALLOC_ENV))
    assert on["enabled"] and on["env"] == MALLOC_ENV
    assert json.dumps(host_memory.describe({}))  # nothing set: off, and still a line for metrics.jsonl
