"""summary.json: the result of a run with its evidence (config, versions, hardware, git revision)."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from typing import Any

from lightray import storage
from lightray.config import Config
from lightray.provenance import git_revision


def versions() -> dict[str, str]:
    import ray
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "torchvision": _torchvision_version(),
            "ray": ray.__version__}


def _torchvision_version() -> str:
    """torchvision's version as its module says it (``0.29.1+cu130``, the local build tag included), without
    importing it when nothing did yet: that costs the driver about 2 s (torchvision.ops loads torch._dynamo)."""
    import importlib.util
    import pathlib
    import re
    import sys

    loaded = sys.modules.get("torchvision")
    if loaded is not None:
        return loaded.__version__
    spec = importlib.util.find_spec("torchvision")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        return "not installed"
    # torchvision's generated version.py: "__version__ = '0.29.1+cu130'"
    text = (pathlib.Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
    found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
    return found.group(1) if found else "unknown"


def hardware(use_gpu: bool) -> dict[str, Any]:
    import ray

    res = ray.cluster_resources() if ray.is_initialized() else {}
    return {"cluster_cpus": res.get("CPU", 0), "cluster_gpus": res.get("GPU", 0),
            "driver_cpu_count": os.cpu_count(), "nodes": len([n for n in ray.nodes() if n.get("Alive")])
            if ray.is_initialized() else 1, "used_gpu": use_gpu, "platform": platform.platform()}


def time_to_targets(records: list[dict[str, Any]], targets: list[float], key: str = "val_top1"
                    ) -> dict[str, float | None]:
    """Training seconds (accumulated across restarts) until ``key`` first reached each target."""
    out: dict[str, float | None] = {}
    for t in targets:
        hit = next((r for r in records if key in r and r[key] >= t), None)
        out[f"{t:g}"] = None if hit is None else float(hit.get("elapsed_s", 0.0))
    return out


def lost_work(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each restart: samples and seconds between the last checkpoint it resumed from and the failure."""
    out = []
    last_seen: dict[str, Any] | None = None
    for r in records:
        if r.get("event") == "restart":
            if last_seen is not None:
                out.append({"lost_samples": max(0, last_seen["samples_seen"] - r.get("samples_seen", 0)),
                            "lost_seconds": max(0.0, last_seen["time"] - r["ckpt_time"]) if r.get("ckpt_time")
                            else None,
                            # from the last step reported before the failure to the new group's start
                            "restart_overhead_s": max(0.0, r["time"] - last_seen.get("time", r["time"])),
                            "resumed_at": r.get("samples_seen", 0)})
        elif "event" not in r and "samples_seen" in r:
            last_seen = r
    return out


def _priced(cfg: Config, billing: dict | None) -> dict[str, float] | None:
    """Node-seconds per price key; a key without a price in ``cost.price_per_hour`` is billed as
    ``cost.node_type`` (the summary of a finished run must not fail on a missing price)."""
    if not billing or not billing.get("node_seconds"):
        return None
    out: dict[str, float] = {}
    for key, secs in billing["node_seconds"].items():
        key = key if key in cfg.cost.price_per_hour else cfg.cost.node_type
        out[key] = out.get(key, 0.0) + float(secs)
    return out


def write_summary(cfg: Config, run_dir: str, local_run_dir: str, records: list[dict[str, Any]], t0: float,
                  t1: float, epochs_planned: int | None, *, use_gpu: bool, error: BaseException | None = None,
                  spot: dict | None = None, billing: dict | None = None, status: str | None = None,
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """``billing`` (app/driver/billing.py): node-seconds per price key over every attempt of the run; when
    given, the cost bills them (rolled-back work included) instead of inferring machines from devices.
    ``status`` replaces the one the error implies (finished / failed): a search's stopped trial is "stopped".
    ``extra``: more keys, e.g. what stopped it."""
    from lightray.report.cost import estimate_cost

    train = [r for r in records if "event" not in r]
    vals = [r for r in train if "val_top1" in r]
    speeds = [r["images_per_s"] for r in train if "images_per_s" in r and "val_top1" not in r]
    last = train[-1] if train else {}
    events = [r for r in records if "event" in r]
    device_seconds = float(last.get("device_seconds", 0.0))
    summary = {
        "run_name": cfg.name,
        "run_dir": run_dir,
        "status": status or ("failed" if error else "finished"),
        "error": None if error is None else f"{type(error).__name__}: {error}",
        "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t0)),
        "end_time": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t1)),
        "wall_time_s": t1 - t0,
        "train_time_s": float(last.get("elapsed_s", 0.0)),
        "epochs": vals[-1]["epoch"] if vals else 0,
        "epochs_planned": epochs_planned,
        "samples_seen": int(last.get("samples_seen", 0)),
        "final_top1": vals[-1]["val_top1"] if vals else None,
        "final_top5": vals[-1]["val_top5"] if vals else None,
        "best_top1": max((v["val_top1"] for v in vals), default=None),
        "best_top5": max((v["val_top5"] for v in vals), default=None),
        "train_images_per_s": sum(speeds) / len(speeds) if speeds else None,
        "time_to_target_s": time_to_targets(vals, cfg.report.targets),
        "time_to_top5_target_s": time_to_targets(vals, cfg.report.top5_targets, "val_top5"),
        "eval_sweep": next((e for e in reversed(events) if e["event"] == "eval_sweep"), {}).get("results", {}),
        "restarts": sum(1 for e in events if e["event"] == "restart"),
        "resizes": sum(1 for e in events if e["event"] == "resize"),
        "preemption_checkpoints": sum(1 for e in events if e["event"] == "preemption_checkpoint"),
        "lost_work": lost_work(records),
        "spot_watchers": spot or {},
        "comm_mode": cfg.comm.mode,
        "comm_bytes_per_worker": int(last.get("comm_bytes", 0)),
        "device_seconds": device_seconds,
        "cost": estimate_cost(cfg.cost, device_seconds, _priced(cfg, billing)),
        "attempts": len((billing or {}).get("attempts", [])) or None,
        "git_revision": git_revision(),
        "versions": versions(),
        "hardware": hardware(use_gpu),
        "command": " ".join(sys.argv),
        "config": cfg.to_dict(),
        **(extra or {}),
    }
    data = json.dumps(summary, indent=2, default=str).encode()
    # The local copy first: it is there even when the storage is not (an outage at the run's end).
    if local_run_dir != run_dir:
        storage.write_bytes(storage.join(local_run_dir, "summary.json"), data)
    storage.write_bytes(storage.join(run_dir, "summary.json"), data)
    return summary


def write_summary_from_files(cfg: Config, run_dir: str, local_run_dir: str, t0: float, t1: float,
                             epochs_planned: int | None, *, use_gpu: bool, error: BaseException | None = None,
                             billing: dict | None = None, status: str | None = None,
                             extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """summary.json for a run whose driver could not write it (ended from outside, or a search trial that Tune
    stopped), from what the run wrote: its metrics.jsonl (none yet: the summary still names the cause)."""
    from lightray.report.progress import MetricsFileError, read_metrics
    from lightray.report.record_sync import RecordSync

    try:
        records = read_metrics(os.path.join(local_run_dir, "metrics.jsonl"))[0]
    except MetricsFileError:
        records = []
    RecordSync(local_run_dir, run_dir).sync()  # the driver's own copier is gone: the records' last state
    return write_summary(cfg, run_dir, local_run_dir, records, t0, t1, epochs_planned, use_gpu=use_gpu,
                         error=error, billing=billing, status=status, extra=extra)
