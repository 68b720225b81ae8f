"""Where a training step runs, and what that costs: the same step timed in a plain process, in a thread of a plain
process (with glibc's malloc as it comes, and with lightray's ``host_memory`` settings), in a Ray actor, in a
thread of that actor, and in a Ray Train worker's training thread (the Ray places on a cluster started here
without those settings: Ray's own defaults).

``python -m bench.step_env [--recipe imagenette] [--resolution 128] [--repeats 3]`` builds the recipe's model,
optimizer and loss with lightray's own builders (as ``bench/plain_recipe.py`` does), then times fixed-size steps on
one in-memory batch (no data pipeline, no DDP) with the same torch threads in each place, in interleaved rounds.
Each ratio is plain step time over the place's, per round, judged by ``bench.common.resolved_ratio``.

Why: lightray's worker runs its step where Ray Train puts it, a thread of a Ray actor (Ray Train v2 runs the train
function in a ``TrainingThread``). What the place itself costs is Ray's, not lightray's: this separates it from the
rest of the gap between lightray and the same recipe by hand (``bench.time_to_accuracy``).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

from bench.common import Machine, emit, machine_cores, note, pin_threads, resolved_ratio, spread
from lightray.train import host_memory

PLACES = ("plain", "thread", "thread_reused_memory", "ray_actor", "ray_actor_thread", "ray_train_worker")


def time_steps(recipe: str, resolution: int, batch: int, steps: int, threads: int,
               precision: str = "auto") -> dict[str, Any]:
    """Median seconds per step over ``steps`` timed steps (after one warm-up step) of ``recipe``'s model on one
    random channels_last batch, with ``threads`` torch threads, where this is called, at ``precision`` (``auto``:
    what lightray resolves for the recipe on this CPU)."""
    import torch

    from lightray.config import load_config
    from lightray.train.device import autocast, precision_for
    from lightray.train.model import build_model
    from lightray.train.optim import build_loss, build_optimizer

    pin_threads(threads)
    cfg = load_config(recipe, {"model.precision": precision})
    cpu = torch.device("cpu")
    got = precision_for(cfg.model, cpu)
    torch.manual_seed(0)
    model = build_model(cfg.model, 10)
    fmt = torch.channels_last if cfg.model.channels_last else torch.contiguous_format
    model = model.to(memory_format=fmt)
    opt, loss_fn = build_optimizer(model, cfg.optim, cpu), build_loss(cfg.optim)
    x = torch.randn(batch, 3, resolution, resolution).contiguous(memory_format=fmt)
    y = torch.randint(0, 10, (batch,))
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        with autocast(got, cpu):
            loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times[1:]), "threads": torch.get_num_threads(),
            "thread": threading.current_thread().name, "precision": got,
            "reused_host_memory": host_memory.describe()["enabled"]}


def _in_thread(*args: Any) -> dict[str, Any]:
    box: dict[str, Any] = {}
    t = threading.Thread(target=lambda: box.update(time_steps(*args)), name="step-thread")
    t.start()
    t.join()
    return box


def _thread_in_process(step_args: tuple, extra_env: dict[str, str]) -> dict[str, Any]:
    """The step in a thread of a fresh process whose environment adds ``extra_env`` (glibc reads its malloc
    settings once, at a process's start: lightray's ``host_memory`` unit gives them to the processes of a cluster
    it starts)."""
    import json
    import os
    import subprocess
    import sys

    code = ("import json, sys; from bench.step_env import _in_thread; "
            "print(json.dumps(_in_thread(*json.loads(sys.argv[1]))))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = {k: v for k, v in os.environ.items() if k not in host_memory.MALLOC_ENV}  # glibc as it comes, unless given
    out = subprocess.run([sys.executable, "-c", code, json.dumps(list(step_args))], cwd=root, check=True,
                         env={**base, **extra_env}, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _train_worker(args: tuple, cpus: int) -> dict[str, Any]:
    """One TorchTrainer run of one worker with ``cpus`` CPUs that times the steps in its train function (the
    figures come back through a file: the worker and this driver share the machine)."""
    import json
    import os
    import tempfile

    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    def loop(config: dict) -> None:
        with open(config["out"], "w") as f:
            json.dump(time_steps(*config["args"]), f)

    with tempfile.TemporaryDirectory() as storage:
        out = os.path.join(storage, "step.json")
        TorchTrainer(loop, train_loop_config={"args": args, "out": out},
                     scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": cpus}),
                     run_config=RunConfig(storage_path=storage, name="step_env")).fit()
        with open(out) as f:
            return json.load(f)


def measure(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    import ray

    step_args = (args.recipe, args.resolution, args.batch, args.steps, args.threads)
    ray.init(num_cpus=2 * machine_cores(), include_dashboard=False, log_to_driver=False)
    try:
        actor_cls = ray.remote(num_cpus=args.threads)(_StepActor)
        actor = actor_cls.remote()
        runs: dict[str, list[dict[str, Any]]] = {p: [] for p in PLACES}
        for r in range(args.repeats):
            note(f"round {r + 1}/{args.repeats}")
            runs["plain"].append(time_steps(*step_args))
            runs["thread"].append(_thread_in_process(step_args, {}))
            runs["thread_reused_memory"].append(_thread_in_process(step_args, host_memory.MALLOC_ENV))
            runs["ray_actor"].append(ray.get(actor.main.remote(step_args)))
            runs["ray_actor_thread"].append(ray.get(actor.thread.remote(step_args)))
            runs["ray_train_worker"].append(_train_worker(step_args, args.threads))
        return runs
    finally:
        ray.shutdown()


class _StepActor:
    def main(self, step_args: tuple) -> dict[str, Any]:
        return time_steps(*step_args)

    def thread(self, step_args: tuple) -> dict[str, Any]:
        return _in_thread(*step_args)


def step_parser(prog: str, description: str, recipe: str, resolution: int, batch: int, steps: int,
                repeats: int) -> argparse.ArgumentParser:
    """The arguments of a bench that times ``time_steps`` in several places, with its own defaults."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--recipe", default=recipe)
    p.add_argument("--resolution", type=int, default=resolution)
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--steps", type=int, default=steps, help="timed steps per place and round")
    p.add_argument("--repeats", type=int, default=repeats, help="interleaved rounds")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: this machine's cores)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = step_parser("python -m bench.step_env", __doc__.split("\n")[0], "imagenette", 128, 64, 6, 3)
    args = p.parse_args(argv)
    args.threads = args.threads or machine_cores()
    machine = Machine()
    runs = measure(args)
    plain = [r["step_s"] for r in runs["plain"]]
    figures = {"recipe": args.recipe, "resolution": args.resolution, "batch": args.batch, "threads": args.threads,
               "step_s": {p: spread([r["step_s"] for r in runs[p]]) for p in PLACES},
               "threads_seen": {p: sorted({r["threads"] for r in runs[p]}) for p in PLACES},
               "thread_names": {p: sorted({r["thread"] for r in runs[p]}) for p in PLACES},
               "reused_host_memory": {p: sorted({r["reused_host_memory"] for r in runs[p]}) for p in PLACES}}
    ratios = {f"plain_over_{p}": resolved_ratio([a / r["step_s"] for a, r in zip(plain, runs[p])])
              for p in PLACES if p != "plain"}
    emit("step_env", figures, ratios, machine.finish(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
