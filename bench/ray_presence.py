"""What a Ray cluster's mere presence costs a training step on this machine: the same step, in a fresh plain
process, timed with no Ray on the machine and beside an idle local cluster started as ``lightray train`` starts
one, holding as many idle Ray processes as a run's driver, controller, Ray Train's and Ray Data's actors and the
pooled workers add up to.

``python -m bench.ray_presence [--recipe cifar10] [--resolution 32] [--batch 1024] [--actors 10] [--repeats 5]``
alternates the two sides (alone first in even rounds, beside first in odd ones) and reports, besides the step
times, the cores the cluster's processes used while the step ran beside them.

Why: every Ray worker process, busy or idle, wakes its main thread every 10 ms to check for signals (a period
set in Ray's core worker's code; none of the five ``RAY_`` settings tried changed it, docs/BENCHMARKS.md); on two
cores a dozen of them take a share of the machine that
a plain process never pays. ``bench.step_env`` cannot see this: all its places, its plain one too, run beside the
cluster it starts. This bench is the part of lightray's gap to the same recipe by hand
(``bench.time_to_accuracy``) that is Ray's, not lightray's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

import psutil

from bench.common import REPO, Machine, emit, kill_processes, machine_cores, note, process_tree, resolved_ratio, spread
from bench.step_env import step_parser

# The Ray worker processes a steady single-worker run holds besides its Train worker (counted on a cifar10 run):
# Ray Train's controller, synchronisation actor, dataset manager, preemption watcher and placement-group cleaner,
# Ray Data's stats and autoscaling-coordinator actors, lightray's run-log writer, and two pooled idle workers.
RUN_ACTORS = 10

_STEP = ("import json, sys; from bench.step_env import time_steps; "
         "print(json.dumps(time_steps(*json.loads(sys.argv[1]))))")

_HOLD = """
import os, sys
from lightray.config import load_config
from lightray.driver.runner import connect_ray
import ray
connect_ray(load_config(sys.argv[1], {"scaling.ray_address": "local"}))

@ray.remote(num_cpus=0)
class Idle:
    def pid(self):
        return os.getpid()

held = [Idle.remote() for _ in range(int(sys.argv[2]))]
ray.get([h.pid.remote() for h in held])
print("ready", flush=True)
sys.stdin.read()  # until the bench closes the pipe
"""


def raylets_here() -> list[int]:
    """Pids of raylets running on this machine (another cluster would sit beside both sides); a killed one not yet
    reaped (a zombie) runs nothing and is left out."""
    out = []
    for proc in psutil.process_iter(["name", "cmdline", "status"]):
        try:
            named = "raylet" in (proc.info["name"] or "") or any("/raylet" in a for a in proc.info["cmdline"] or ())
            if named and proc.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def tree_cpu_s(pid: int) -> float:
    """CPU-seconds so far of ``pid`` and every process below it."""
    total = 0.0
    for proc in [psutil.Process(pid), *process_tree(pid)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.NoSuchProcess:
            continue
    return total


def time_step(step_args: tuple) -> dict[str, Any]:
    """The step timed in a fresh plain process (its main thread), with the machine as it is now."""
    out = subprocess.run([sys.executable, "-c", _STEP, json.dumps(list(step_args))], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


class IdleCluster:
    """A local Ray cluster started by ``lightray.driver.runner.connect_ray`` in a process of its own, holding
    ``actors`` idle actors, until the context ends."""

    def __init__(self, recipe: str, actors: int):
        self.args = [sys.executable, "-c", _HOLD, recipe, str(actors)]

    def __enter__(self) -> IdleCluster:
        self.proc = subprocess.Popen(self.args, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.__exit__()
            raise RuntimeError(f"the idle cluster did not start (exit {self.proc.poll()}, said {line!r})")
        return self

    def cpu_s(self) -> float:
        return tree_cpu_s(self.proc.pid)

    def settle(self, below_cores: float = 0.25, window_s: float = 1.0, limit_s: float = 60.0) -> float:
        """Wait until the cluster's start-up work is over (a window of ``window_s`` in which its processes used
        under ``below_cores``), as in a run's steady epochs; returns the last window's cores."""
        deadline = time.monotonic() + limit_s
        while True:
            c0 = self.cpu_s()
            time.sleep(window_s)  # the measurement window itself, not a wait for an event
            cores = (self.cpu_s() - c0) / window_s
            if cores < below_cores or time.monotonic() > deadline:
                return cores

    def __exit__(self, *exc: object) -> None:
        procs = process_tree(self.proc.pid)
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        kill_processes(procs)  # ray.shutdown stops its daemons; anything left would sit beside the next "alone" side


def beside_cluster(step_args: tuple, recipe: str, actors: int) -> dict[str, Any]:
    with IdleCluster(recipe, actors) as cluster:
        cluster.settle()
        c0, t0 = cluster.cpu_s(), time.time()
        got = time_step(step_args)
        got["cluster_cores"] = (cluster.cpu_s() - c0) / (time.time() - t0)
    return got


def measure(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    step_args = (args.recipe, args.resolution, args.batch, args.steps, args.threads)
    runs: dict[str, list[dict[str, Any]]] = {"alone": [], "beside_ray": []}
    for r in range(args.repeats):
        note(f"round {r + 1}/{args.repeats}")
        order = ("alone", "beside_ray") if r % 2 == 0 else ("beside_ray", "alone")
        for side in order:
            if side == "alone":
                if raylets_here():
                    raise RuntimeError(f"a Ray cluster is running on this machine (raylet pids {raylets_here()}): "
                                       "stop it (`ray stop`) so that the plain side runs with no Ray beside it")
                runs[side].append(time_step(step_args))
            else:
                runs[side].append(beside_cluster(step_args, args.recipe, args.actors))
    return runs


def main(argv: list[str] | None = None) -> int:
    p = step_parser("python -m bench.ray_presence", __doc__.split("\n")[0], "cifar10", 32, 1024, 8, 5)
    p.add_argument("--actors", type=int, default=RUN_ACTORS, help="idle actors the cluster holds")
    args = p.parse_args(argv)
    args.threads = args.threads or machine_cores()
    machine = Machine()
    runs = measure(args)
    alone = [r["step_s"] for r in runs["alone"]]
    figures = {"recipe": args.recipe, "resolution": args.resolution, "batch": args.batch, "threads": args.threads,
               "actors": args.actors, "cores": machine_cores(),
               "step_s": {side: spread([r["step_s"] for r in got]) for side, got in runs.items()},
               "cluster_cores_beside": spread([r["cluster_cores"] for r in runs["beside_ray"]], 3)}
    ratios = {"beside_ray_vs_alone": resolved_ratio([a / b["step_s"] for a, b in zip(alone, runs["beside_ray"])])}
    emit("ray_presence", figures, ratios, machine.finish(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
