"""Helpers for the fault-tolerance tests: a real multi-node Ray cluster on this machine, a real driver
process, and the audit of which samples the final model was trained on."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections import defaultdict

import numpy as np
import pyarrow.parquet as pq

ROOT = pathlib.Path(__file__).parents[1]


def wait_for(pred, timeout: float, what: str, proc: subprocess.Popen | None = None, interval: float = 0.5):
    end = time.time() + timeout
    while time.time() < end:
        value = pred()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"driver exited ({proc.returncode}) while waiting for {what}:\n{out[-4000:]}")
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def records(run_dir: pathlib.Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def last_samples(run_dir: pathlib.Path) -> int:
    train = [r for r in records(run_dir) if "event" not in r]
    return train[-1]["samples_seen"] if train else 0


def checkpoints(run_dir: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in run_dir.glob("checkpoint_*") if p.is_dir() and (p / "meta_rank0.json").is_file())


def driver(storage: pathlib.Path, name: str, *args: str, cache: pathlib.Path, address: str = "local",
           env: dict | None = None) -> subprocess.Popen:
    """Start `python app/run.py --smoke-test ...` as a real driver process (own process group)."""
    cmd = [sys.executable, "app/run.py", "--smoke-test", "--storage", str(storage), "--name", name,
           f"--scaling.ray_address={address}", f"--data.cache_dir={cache}",
           f"--data.local_cache_dir={cache / 'local'}", "--report.log_samples=true", *args]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


def finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        raise
    assert proc.returncode == 0, out[-6000:]
    return out


def carried_samples(run_dir: pathlib.Path) -> dict[int, list[int]]:
    """Per epoch, the sample ids of the steps the final model carries.

    Each worker-group start logs its steps per rank; a later start that resumed from an earlier checkpoint
    replays (and so replaces) the steps after it, so later starts override earlier ones step by step."""
    attempts: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for f in sorted((run_dir / "sample_log").glob("start*_rank*.jsonl")):
        start = int(f.name.split("_")[0].removeprefix("start"))
        rank = int(f.stem.split("_rank")[1])
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            attempts[start].setdefault(rec["samples_seen"], {"epoch": rec["epoch"], "ids": {}})
            attempts[start][rec["samples_seen"]]["ids"][rank] = rec["ids"]
    final: dict[int, dict] = {}
    for start in sorted(attempts):
        # A resumed start replaces every step from its first one on.
        first = min(attempts[start])
        final = {k: v for k, v in final.items() if k < first}
        final.update(attempts[start])
    per_epoch: dict[int, list[int]] = defaultdict(list)
    for key in sorted(final):
        step = final[key]
        for rank in sorted(step["ids"]):
            per_epoch[step["epoch"]].extend(step["ids"][rank])
    return dict(per_epoch)


def planned_samples(run_dir: pathlib.Path) -> dict[int, list[int]]:
    """Per epoch, the sample ids the epoch plan assigns (in order), from the run's manifest and config."""
    import yaml

    from app.config import config_from_dict
    from app.data.manifest import Manifest
    from app.data.plan import EpochPlan
    from app.schedule import Schedule

    cfg = config_from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    data = json.loads((run_dir / "data.json").read_text())
    manifest = Manifest.load(data["manifest"])
    sched = Schedule(cfg.schedule, cfg.optim, data["train_samples"])
    out = {}
    for epoch in range(sched.epochs):
        tier = data["phase_tiers"][sched.phase_index_for_epoch(epoch)]
        shards = manifest.shards("train", tier)
        ids = np.concatenate([pq.read_table(s.uri, columns=["sample_id"]).column(0).to_numpy() for s in shards])
        plan = EpochPlan([s.rows for s in shards], cfg.scaling.seed)
        n = sched.steps_in_epoch(epoch) * sched.phase_for_epoch(epoch).batch_size
        out[epoch] = ids[plan.order(epoch)[:n]].tolist()
    return out


def final_state(run_dir: pathlib.Path) -> dict:
    import torch

    last = checkpoints(run_dir)[-1]
    return torch.load(last / "state_rank0.pt", map_location="cpu", weights_only=False)
