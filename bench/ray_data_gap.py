"""Ray Data's idle time between map tasks: what rows per task must amortise (``lightray.data.autotune.TASK_SECONDS``).

Map tasks that each sleep ``--task-s`` seconds (no CPU, so nothing competes with Ray Data's scheduling loop), at
most ``--in-flight`` at once, through ``map_batches`` and ``iter_batches`` as lightray's ingest runs them. For each
task length: the elapsed time against the ideal (tasks x length / in flight), the tasks in flight on average (Ray
Data's own stats: the tasks' summed wall time over the operator's) and the idle time each task slot lost per task.
Baseline, side by side: the same tasks as plain Ray tasks kept ``--in-flight`` deep with ``ray.wait``.

Run: ``python -m bench.ray_data_gap`` (``--quick`` for a seconds-long check). Prints ONE JSON line.
"""

from __future__ import annotations

import argparse
import sys
import time

from bench.common import Machine, emit, note


def _sleep_block(batch: dict, seconds: float) -> dict:
    time.sleep(seconds)
    return batch


def ray_data_run(tasks: int, seconds: float, in_flight: int) -> dict:
    """(elapsed s, mean tasks in flight) of ``tasks`` Ray Data map tasks of ``seconds`` each."""
    import ray.data

    ds = ray.data.from_items([{"i": i} for i in range(tasks)], override_num_blocks=tasks)
    mapped = ds.map_batches(_sleep_block, batch_size=1, batch_format="numpy", num_cpus=1.0,
                            compute=ray.data.TaskPoolStrategy(size=in_flight), fn_kwargs={"seconds": seconds})
    t0 = time.perf_counter()
    for _ in mapped.iter_batches(batch_size=1, batch_format="numpy", prefetch_batches=2):
        pass
    elapsed = time.perf_counter() - t0
    ops = [o for o in mapped.get_stats_summary().operators_stats if o.operator_name.startswith("MapBatches")]
    flight = ops[0].wall_time.sum / max(1e-9, ops[0].time_total_s) if ops and ops[0].wall_time else None
    return {"elapsed_s": round(elapsed, 3), "tasks_in_flight_mean": None if flight is None else round(flight, 2)}


def plain_run(tasks: int, seconds: float, in_flight: int) -> float:
    """Elapsed seconds of the same tasks as plain Ray tasks, kept ``in_flight`` deep."""
    import ray

    task = ray.remote(num_cpus=1.0)(_sleep_block)
    t0 = time.perf_counter()
    pending, sent = [], 0
    while sent < tasks or pending:
        while sent < tasks and len(pending) < in_flight:
            pending.append(task.remote({}, seconds))
            sent += 1
        _, pending = ray.wait(pending, num_returns=1)
    return time.perf_counter() - t0


def measure(task_s: list[float], tasks: int, in_flight: int) -> tuple[dict, dict]:
    """Figures and ratios for every task length."""
    figures: dict = {}
    ratios: dict = {}
    for s in task_s:
        note(f"{tasks} tasks of {s:g} s, {in_flight} in flight")
        ideal = tasks * s / in_flight
        rd = ray_data_run(tasks, s, in_flight)
        plain = plain_run(tasks, s, in_flight)
        key = f"task_{s:g}s"
        figures[key] = {"ideal_s": round(ideal, 3), "ray_data": rd, "plain_ray_s": round(plain, 3),
                        "ray_data_idle_per_task_s": round((rd["elapsed_s"] - ideal) * in_flight / tasks, 3)}
        ratios[f"{key}_ray_data_over_ideal_time"] = round(rd["elapsed_s"] / ideal, 2)
        ratios[f"{key}_plain_ray_over_ideal_time"] = round(plain / ideal, 2)
    return figures, ratios


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task-s", default="0.3,1,2", help="task lengths to try, seconds")
    ap.add_argument("--tasks", type=int, default=20, help="tasks per length")
    ap.add_argument("--in-flight", type=int, default=2, help="tasks at once (Ray's CPUs: as many)")
    ap.add_argument("--quick", action="store_true", help="a few short tasks: a correctness run")
    args = ap.parse_args(argv)
    if args.quick:
        args.task_s, args.tasks = "0.05", 4
    task_s = [float(s) for s in args.task_s.split(",")]
    if args.tasks < 1 or args.in_flight < 1 or min(task_s) <= 0:
        ap.error("--tasks, --in-flight and --task-s: expected positive values")
    import ray
    from ray.data import DataContext

    machine = Machine()
    # address="local": a cluster of exactly these CPUs, never someone else's.
    ray.init(address="local", num_cpus=args.in_flight, include_dashboard=False, log_to_driver=False)
    DataContext.get_current().enable_progress_bars = False
    try:
        figures, ratios = measure(task_s, args.tasks, args.in_flight)
    finally:
        ray.shutdown()
    emit("ray_data_gap", figures, ratios, machine.finish(argv, tasks=args.tasks, in_flight=args.in_flight))
    return 0


if __name__ == "__main__":
    sys.exit(main())
