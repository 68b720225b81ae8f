"""The floor under lightray's start-up: a bare Ray Train run, started the way ``app/run.py`` starts one.

``python -m bench.ray_train_floor --workers 2 --cpus-per-worker 0.5 --out FILE`` imports Ray Train, starts a
local cluster with lightray's settings (the same logical CPUs, no dashboard, no log forwarding), and runs a
``TorchTrainer`` whose train function only joins the process group and does one all-reduce: no data, no
model. It writes the times of each step to ``FILE`` as JSON (``time.time()`` values, and the phases in
seconds). ``bench.footprint`` runs it in a subprocess under the same memory sampler as the real run, so
what lightray adds to Ray Train's own start-up and memory is read side by side on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

T_PROCESS = time.time()


def _train_fn(config: dict) -> None:
    import ray.train
    import torch
    import torch.distributed as dist

    entered = time.time()
    t = torch.ones(1)
    dist.all_reduce(t)  # the process group Ray Train set up really works
    if ray.train.get_context().get_world_rank() == 0:
        with open(config["out"] + ".worker", "w") as f:
            json.dump({"entered": entered, "first_collective": time.time(), "world": int(t.item())}, f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ray_train_floor", description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--cpus-per-worker", type=float, default=0.5)
    p.add_argument("--num-cpus", type=int, default=0, help="logical CPUs of the local cluster (0: app's default)")
    p.add_argument("--out", required=True, help="JSON file for the timings")
    args = p.parse_args(argv)
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    t_imports = time.time()
    # lightray's local cluster: twice the cores as logical CPUs, no dashboard (app/train/runner.connect_ray).
    ray.init(address="local", num_cpus=args.num_cpus or 2 * (os.cpu_count() or 1), include_dashboard=False,
             log_to_driver=False)
    t_ray = time.time()
    trainer = TorchTrainer(_train_fn, train_loop_config={"out": args.out},
                           scaling_config=ScalingConfig(num_workers=args.workers,
                                                        resources_per_worker={"CPU": args.cpus_per_worker}),
                           run_config=RunConfig(storage_path=os.path.dirname(os.path.abspath(args.out)),
                                                name="ray_train_floor"))
    t_fit = time.time()
    trainer.fit()
    t_end = time.time()
    ray.shutdown()
    with open(args.out + ".worker") as f:
        worker = json.load(f)
    os.remove(args.out + ".worker")
    out = {"process_start": T_PROCESS, "fit_start": t_fit, **worker, "end": t_end,
           "phases_s": {"imports": round(t_imports - T_PROCESS, 2), "ray_start": round(t_ray - t_imports, 2),
                        "trainer_setup": round(t_fit - t_ray, 2),
                        "worker_group_start": round(worker["entered"] - t_fit, 2),
                        "first_collective": round(worker["first_collective"] - worker["entered"], 2)}}
    with open(args.out, "w") as f:
        json.dump(out, f)
    print(json.dumps(out["phases_s"]))
    return 0 if worker["world"] == args.workers else 1


if __name__ == "__main__":
    sys.exit(main())
