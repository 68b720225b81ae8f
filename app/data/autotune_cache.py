"""Calibration results kept per data and machine, so a second run on the same cache does not calibrate.

The preprocessing calibration (``lightray.data.autotune``) costs several seconds of start-up and its answer
depends only on what it timed: the shards of the phase it measured (their sha256), the phase's
resolution and crop scale, the level that serves it (object store or local disk), the CPUs left to Ray
Data, the calibration's own settings, and the machine (host name, physical cores and logical CPUs, the
cluster's CPUs, GPUs and nodes). All of these make up the key; a result is a small JSON file under
``<local cache dir>/autotune/``, which is node-local, like the machine it describes.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from typing import Any

VERSION = 2  # bump when the calibration's method changes: old answers no longer apply


def machine_fingerprint() -> dict[str, Any]:
    """This machine and the cluster: ``cores`` are physical, ``logical_cpus`` what ``os.cpu_count()`` says
    (recorded as ``cores`` before: those records lack ``logical_cpus``, so they no longer match),
    ``cluster_cpus`` Ray's CPU resource (lightray's local cluster offers twice the logical CPUs)."""
    import psutil
    import ray

    res = ray.cluster_resources()
    return {"host": socket.gethostname(), "cores": psutil.cpu_count(logical=False) or os.cpu_count(),
            "logical_cpus": os.cpu_count(), "cluster_cpus": res.get("CPU", 0.0), "cluster_gpus": res.get("GPU", 0.0),
            "nodes": sum(1 for n in ray.nodes() if n.get("Alive"))}


def key_for(spec: Any, phase: int, avail_cpus: float, seconds: float, pinned_concurrency: int | None) -> dict:
    ph = spec.phases[phase]
    key = {"version": VERSION, "shards": hashlib.sha256("".join(ph.shards.sha256).encode()).hexdigest(),
            "resolution": ph.resolution, "min_scale": ph.min_scale, "level": ph.shards.level,
            "avail_cpus": round(float(avail_cpus), 3), "seconds": float(seconds),
            "pinned_concurrency": pinned_concurrency, "machine": machine_fingerprint()}
    if getattr(ph, "device_decode", False):  # same shards, other task work (bytes passed through, no decode)
        key["work"] = "device_decode"
    return key


def path_for(local_dir: str, key: dict) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return os.path.join(local_dir, "autotune", f"{digest}.json")


def load(local_dir: str, key: dict) -> dict | None:
    """The stored result for ``key`` ({concurrency, cpus, rows_per_task, curve, reason, measured_at}), or None."""
    try:
        with open(path_for(local_dir, key)) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    return rec.get("result") if rec.get("key") == key else None


def save(local_dir: str, key: dict, result: dict) -> str | None:
    """Store ``result`` under ``key``; a read-only cache dir only costs the next run a calibration."""
    path = path_for(local_dir, key)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"key": key, "result": dict(result, measured_at=time.time())}, f, indent=1)
        os.replace(tmp, path)
        return path
    except OSError:
        return None
