"""bench.ray_presence's idle cluster: started as `lightray train` starts one, holding the idle actors asked for,
its processes' CPU measured, gone when the bench is done with it; and the plain side refused beside a cluster."""

from __future__ import annotations

import argparse

import psutil
import pytest

from bench.common import process_kind, process_tree
from bench.ray_presence import IdleCluster, measure, raylets_here, tree_cpu_s


def _idle_actor_pids(holder_pid: int) -> list[int]:
    return [p.pid for p in process_tree(holder_pid) if process_kind(p) == "other_ray_workers" and "Idle" in p.name()]


def test_the_idle_cluster_holds_its_actors_is_measured_and_is_gone_after_and_the_plain_side_is_refused_beside_it():
    with IdleCluster("demo", 2) as cluster:
        pids = [p.pid for p in psutil.Process(cluster.proc.pid).children(recursive=True)]
        assert len(_idle_actor_pids(cluster.proc.pid)) == 2
        assert raylets_here(), "the cluster's raylet is seen as a cluster on this machine"
        assert cluster.settle(below_cores=10.0) >= 0.0  # the first window is under any bound: one window
        assert cluster.cpu_s() > 0 and tree_cpu_s(cluster.proc.pid) >= cluster.cpu_s() - 1e-6
        args = argparse.Namespace(recipe="demo", resolution=16, batch=4, steps=1, threads=1, repeats=1, actors=0)
        with pytest.raises(RuntimeError, match=r"raylet pids \[\d+"):
            measure(args)
    assert cluster.proc.returncode is not None
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_a_killed_raylet_not_yet_reaped_is_not_counted_as_a_cluster_here(tmp_path):
    import os
    import shutil
    import subprocess

    fake = tmp_path / "raylet"  # a process Linux names "raylet", as Ray's own binary is named
    shutil.copy(shutil.which("sleep"), fake)
    proc = subprocess.Popen([str(fake), "60"])
    try:
        assert proc.pid in raylets_here()
        proc.kill()
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # it has ended; left unreaped, a zombie
        assert psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE
        assert proc.pid not in raylets_here()
    finally:
        proc.kill()
        proc.wait()
