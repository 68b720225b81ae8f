"""Start Ray Data's task worker processes while the model is built (``scaling.warm_data_workers``).

A start's first map task needs a worker process: Ray starts one and the task imports lightray's map
functions (Ray Data, pandas: about 3 s on two loaded cores, on the training clock as the first step's wait;
docs/BENCHMARKS.md, "Where a start's first step waits"). Ray reuses an idle worker for a task only when both
come from the same job with the same runtime environment; the start-up's own tasks (the driver's) run in
another one than Ray Train's, whose workers, and the map tasks their streams submit, carry the
``RAY_TRAIN_*`` variables. So each rank submits its warm-up tasks itself, at the top of its start, with the map
tasks' CPUs: each imports the map functions' module and ends, and its idle process takes the stream's first
map task.
"""

from __future__ import annotations

import os
import time
from typing import Any

import ray

from lightray.data.spec import rank_task_share


def _warm() -> dict[str, Any]:
    t0 = time.perf_counter()
    import lightray.data.ingest  # noqa: F401  the map functions' module and what it pulls in (Ray Data, pandas)

    return {"pid": os.getpid(), "import_s": round(time.perf_counter() - t0, 3)}


def count(setting: str, on_gpu: bool, map_concurrency: int | None, world_size: int) -> int:
    """Processes a rank warms: its share of the map tasks in flight (one when Ray Data picks), at most
    ``scaling.warm_data_workers`` (``auto``: one on a GPU worker, none on a CPU one)."""
    cap = (1 if on_gpu else 0) if setting == "auto" else int(setting)
    return max(0, min(cap, rank_task_share(map_concurrency, world_size) or 1))


def start(n: int, task_cpus: float) -> list[ray.ObjectRef]:
    """Submit ``n`` warm-up tasks of ``task_cpus`` CPUs each; returns at once. Call from the rank's own process:
    its runtime environment is the one its stream's map tasks get."""
    if n <= 0 or not ray.is_initialized():
        return []
    task = ray.remote(_warm).options(num_cpus=task_cpus, name="warm_data_worker", max_retries=0)
    return [task.remote() for _ in range(n)]


def describe(refs: list[ray.ObjectRef], setting: str, on_gpu: bool, task_cpus: float) -> dict[str, Any]:
    """The unit's line, said before the first batch is asked for: how many warm-up tasks had ended by then."""
    if not refs:
        why = ("scaling.warm_data_workers=0" if setting == "0" else
               "auto: a CPU worker, whose cores build the model" if setting == "auto" and not on_gpu else
               "no Ray Train worker here")
        return {"unit": "warm_data_workers", "enabled": False, "message": f"off ({why})", "started": 0, "ready": 0}
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    ready = []
    for ref in done:
        try:
            ready.append(ray.get(ref))
        except ray.exceptions.RayError:  # a warm-up that failed costs nothing but its own start
            pass
    imports = ", ".join(f"{r['import_s']:.2f}" for r in ready)
    return {"unit": "warm_data_workers", "enabled": True, "started": len(refs), "ready": len(ready),
            "pids": [r["pid"] for r in ready],
            "message": f"{len(refs)} task worker process(es) x {task_cpus:g} CPU started for this rank's map tasks "
                       f"while the model was built; {len(ready)} ready before the first batch was asked for"
                       + (f" (imports {imports} s)" if ready else "")}
