"""bench.common.CpuSampler: the cores each kind of process keeps busy, read from real processes' CPU times."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from bench.common import CpuSampler, process_kind


def test_a_busy_child_is_counted_as_about_one_core_under_its_kind():
    spin = "import time\nend = time.time() + 20\nwhile time.time() < end: pass"
    busy = subprocess.Popen([sys.executable, "-c", spin])
    try:
        with CpuSampler(psutil.Process().pid, every_s=0.2) as sampler:
            t0 = time.time()
            while len([s for s in sampler.samples if s[0] >= t0]) < 8:  # 8 samples after t0: 1.4 s or more
                time.sleep(0.1)
            t1 = time.time()
        cores = sampler.cores_by_kind(t0, t1)
    finally:
        busy.kill()
        busy.wait()
    # The spinning child holds a core while it gets one; two cores and this test's own process share the rest.
    assert 0.4 <= cores["other"] <= 2.05, cores
    assert cores["other"] > 5 * sum(v for k, v in cores.items() if k != "other"), cores


def test_a_ray_worker_is_not_taken_for_a_daemon_by_the_arguments_that_name_them():
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "default_worker.py",
                               "--raylet-name=/tmp/ray/raylet", "--runtime-env-agent-port=0"])
    try:
        proc, deadline = psutil.Process(worker.pid), time.monotonic() + 30
        while "default_worker.py" not in proc.cmdline():  # until the child has exec'd (before, it is this process)
            assert time.monotonic() < deadline, proc.cmdline()
            time.sleep(0.01)
        assert process_kind(proc) == "other_ray_workers"
    finally:
        worker.kill()
        worker.wait()
