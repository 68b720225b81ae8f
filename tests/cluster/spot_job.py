"""A small but real training job for the fake cluster: 2 gloo DDP workers, one per worker machine.

Submitted with ``ray job submit --working-dir . -- python tests/cluster/spot_job.py --storage DIR``.
It checkpoints every step and resumes from ``ray.train.get_checkpoint()`` after a worker group restart
(as lightray does), and keeps its device-seconds and machine-seconds per price key in the checkpoint.
It appends one JSON line per worker start to ``<storage>/<name>/events.jsonl`` and writes
``<storage>/<name>/result.json`` at the end, which is what the test reads. Stands in for
``app/run.py --smoke-test`` until that runs on this cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

# The job's working directory is the repository root (--working-dir .): make app importable.
sys.path.insert(0, os.getcwd())

import ray  # noqa: E402
import ray.train  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from ray.train import Checkpoint, CheckpointConfig, FailureConfig, RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402

from lightray.config import CostConfig  # noqa: E402
from lightray.report.cost import estimate_cost  # noqa: E402

# The node label that the cluster file puts on every worker machine (its key in cost.price_per_hour).
PRICE_LABEL = "lightray-price-key"


def node_price_key(default: str) -> str:
    """This machine's price key from its node label; ``default`` on a node without one."""
    value = ray.get_runtime_context().get_node_labels().get(PRICE_LABEL)
    if isinstance(value, list):  # typed as a list in some Ray versions
        value = value[0] if value else None
    return str(value) if value else default


def train_fn(config: dict) -> None:
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    run_dir = pathlib.Path(config["run_dir"])
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # Totals over every attempt: they go into each checkpoint and continue from it after a restart.
    step, device_s, node_s = 0, 0.0, {}
    ckpt = ray.train.get_checkpoint()
    if ckpt:
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=False)
        model.module.load_state_dict(state["model"])
        step = state["step"]
        device_s, node_s = state["cost"]["device_seconds"], dict(state["cost"]["node_seconds"])
    key = node_price_key("local")
    with open(run_dir / "events.jsonl", "a") as f:
        f.write(json.dumps({"event": "start", "rank": rank, "world": world, "step": step, "price_key": key,
                            "node_id": ray.get_runtime_context().get_node_id(), "time": time.time()}) + "\n")
    last = time.monotonic()
    while step < config["steps"]:
        x = torch.randn(16, 8)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(config["step_s"])
        step += 1
        now = time.monotonic()
        # Every worker's time is device time; each machine is counted once (here one worker per machine).
        spent = torch.tensor([now - last])
        dist.all_reduce(spent)
        keys = [None] * world
        dist.all_gather_object(keys, key)
        device_s += float(spent.item())
        for k in keys:
            node_s[k] = node_s.get(k, 0.0) + (now - last)
        last = now
        with tempfile.TemporaryDirectory() as d:
            if rank == 0:
                cost = {"device_seconds": device_s, "node_seconds": node_s}
                torch.save({"model": model.module.state_dict(), "step": step, "cost": cost},
                           os.path.join(d, "state.pt"))
            ray.train.report({"step": step, "loss": float(loss)},
                             checkpoint=Checkpoint.from_directory(d) if rank == 0 else None)
    if rank == 0:
        est = estimate_cost(CostConfig(node_type="g5.48xlarge-spot"), device_s, node_s or None)
        (run_dir / "result.json").write_text(json.dumps({"step": step, "world": world, "cost": est}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--storage", required=True)
    p.add_argument("--name", default="spot-job")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--step-s", type=float, default=1.0)
    args = p.parse_args()
    run_dir = pathlib.Path(args.storage) / args.name
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer = TorchTrainer(
        train_fn,
        train_loop_config={"run_dir": str(run_dir), "steps": args.steps, "step_s": args.step_s},
        # One worker per fake machine (each advertises 2 CPUs), so 2 workers need 2 worker machines.
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1.5}),
        run_config=RunConfig(
            name=args.name, storage_path=args.storage,
            failure_config=FailureConfig(max_failures=-1),  # retry forever, as on spot
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
    )
    result = trainer.fit()
    print("final metrics", result.metrics)


if __name__ == "__main__":
    main()
