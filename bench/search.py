"""``python -m bench.search``: what a trial's start-up costs with and without the shared start-up, and Optuna
TPE + ASHA against random search at the same budget in trial-seconds, over several seeds.

Part 1, start-up: the same small FIFO search three times (random sampler, one trial at a time so that
trials do not slow each other's start): ``before_not_shared`` (each trial a Ray Train worker group that
prepares, decodes its tiers and calibrates: how trials started when the issue was filed), ``train_shared``
(worker groups, with the data work done once per experiment) and ``after_inline_shared`` (shared, and each
one-worker trial trains in its own Tune process: ``trial_runner: inline``). Figures: each trial's seconds
from its start to its first training step, split into phases (``lightray.tune.trial_startup``), medians per
search. Ratio ``startup_after_over_before`` = median first-step seconds, after over before (goal <= 0.25);
``startup_shared_over_before`` isolates what sharing alone gives.

Part 2, the comparison: TPE + ASHA and random search (no early stopping), ``--seeds`` searches each with
different seeds (TPE seeds s, s+1, ...; random seeds s+1000, ...: no two searches share their first
proposals), every search with the same wall-clock budget (Tune's ``time_budget_s`` = trial-seconds budget /
concurrency) and plenty of trials to fill it. Trial-seconds are counted after the fact from each trial's
start and duration, so a search's curve is (trial-seconds spent by the time a trial finished, best top-1
so far). Figures: per method the best top-1 at the budget (mean, stdev, min, max over seeds); the median
of random's bests R; the trial-seconds each search needed to reach R. Ratio
``random_over_tpe_asha_trial_s_to_same_best`` = random's median trial-seconds to R over TPE + ASHA's median
(goal >= 2), with the per-TPE-seed spread; ``null`` with a reason when TPE + ASHA did not reach R within
the budget in most seeds. Prints one JSON line on stdout; everything else goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

import yaml

from bench.common import Machine, emit, note, spread

SPACE = {
    "metric": "val_top1",
    "mode": "max",
    "fixed": {"scaling.workers": "1", "scaling.cpus_per_worker": 0.5, "report.tensorboard": False,
              "schedule.eval_resolution": 0, "global_batch": 64},
    "params": {
        "optim.lr_per_256": {"dist": "loguniform", "low": 0.01, "high": 4.0},
        "schedule.warmup_epochs": {"dist": "uniform", "low": 0.0, "high": 1.0},
        "optim.label_smoothing": {"dist": "choice", "values": [0.0, 0.1]},
        "optim.weight_decay": {"dist": "loguniform", "low": 1e-6, "high": 1e-3},
    },
}


# --- trial-seconds accounting (pure: tested without Ray) ---------------------------------------------------
def curve(trials: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(trial-seconds spent when a trial finished, best metric so far) at each finish, in time order.

    A trial runs from ``start`` for ``time_s``; at wall time t the search has spent the sum over trials of
    the part of each trial's run before t (trials run side by side count side by side)."""
    runs = [(float(t["start"]), float(t["time_s"]), t.get("metric")) for t in trials if t.get("start") is not None]
    out, best = [], None
    for start, dur, metric in sorted(runs, key=lambda r: r[0] + r[1]):
        end = start + dur
        spent = sum(min(max(0.0, end - s), d) for s, d, _ in runs)
        if metric is not None:
            best = metric if best is None else max(best, metric)
        if best is not None:
            out.append((round(spent, 1), best))
    return out


def best_at(points: list[tuple[float, float]], budget_s: float) -> float | None:
    """Best metric of the trials finished within ``budget_s`` trial-seconds (None: none finished)."""
    inside = [b for s, b in points if s <= budget_s + 1e-9]
    return max(inside) if inside else None


def trial_s_to_reach(points: list[tuple[float, float]], target: float) -> float | None:
    """Trial-seconds spent when the best first reached ``target`` (None: never)."""
    return next((s for s, b in points if b >= target - 1e-12), None)


def compare(runs: dict[str, list[list[dict[str, Any]]]], budget_s: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """Figures and ratios of the comparison from each method's searches (lists of trial records)."""
    pts = {m: [curve(trials) for trials in searches] for m, searches in runs.items()}
    bests = {m: [b for b in (best_at(p, budget_s) for p in ps) if b is not None] for m, ps in pts.items()}
    figures: dict[str, Any] = {"budget_trial_s": budget_s,
                               "best_top1_at_budget": {m: spread(v) for m, v in bests.items()}}
    ratios: dict[str, Any] = {}
    if not bests.get("random"):
        figures["note"] = "no random search finished a trial within the budget"
        ratios["random_over_tpe_asha_trial_s_to_same_best"] = None
        return figures, ratios
    target = statistics.median(bests["random"])
    reach = {m: [trial_s_to_reach(p, target) for p in ps] for m, ps in pts.items()}
    figures["random_median_best_top1"] = round(target, 4)
    figures["trial_s_to_random_median_best"] = reach
    # A search that never got there needed more than the budget: it sorts last (above any number).
    med = {m: _median_censored(v) for m, v in reach.items()}
    figures["median_trial_s_to_random_median_best"] = med
    r_rand, r_tpe = med.get("random"), med.get("tpe_asha")
    if r_rand is None or r_tpe is None:
        ratios["random_over_tpe_asha_trial_s_to_same_best"] = None
        figures["ratio_note"] = (f"TPE + ASHA did not reach random's median best {target:.4g} within the "
                                 f"{budget_s:g} trial-s budget in most seeds" if r_tpe is None else
                                 "random did not reach its own median best (no finished trial)")
    else:
        ratios["random_over_tpe_asha_trial_s_to_same_best"] = round(r_rand / max(r_tpe, 1e-9), 3)
        per_seed = [round(r_rand / max(s, 1e-9), 3) for s in reach["tpe_asha"] if s is not None]
        ratios["random_over_tpe_asha_trial_s_to_same_best_per_tpe_seed"] = per_seed
        ratios["random_over_tpe_asha_trial_s_to_same_best_min_max"] = \
            [min(per_seed), max(per_seed)] if per_seed else None
        # The spread of random's own figure swamps a gap smaller than it: say so instead of a bare number.
        rand_vals = [s for s in reach["random"] if s is not None]
        ratios["resolved"] = bool(per_seed) and len(rand_vals) > 1 and min(per_seed) > 1.0 and \
            max(rand_vals) / max(min(rand_vals), 1e-9) < ratios["random_over_tpe_asha_trial_s_to_same_best"]
    mid = {m: figures["best_top1_at_budget"][m]["median"] for m in bests}
    if mid.get("random") and mid.get("tpe_asha") is not None:
        ratios["best_top1_median_tpe_asha_over_random"] = round(mid["tpe_asha"] / mid["random"], 3)
    return figures, ratios


def _median_censored(values: list[float | None]) -> float | None:
    """Median where None (never reached) counts as larger than any number; None when the median is one."""
    if not values:
        return None
    ordered = sorted(values, key=lambda v: (v is None, v or 0.0))
    n = len(ordered)
    mid = ordered[(n - 1) // 2: n // 2 + 1]
    if any(v is None for v in mid):
        return None
    return float(statistics.fmean(mid))


# --- the searches ---------------------------------------------------------------------------------------
def _space(path: pathlib.Path, args: argparse.Namespace, **over: Any) -> pathlib.Path:
    raw = json.loads(json.dumps(SPACE))
    raw["fixed"].update({"data.limit_train": args.limit_train, "data.limit_val": args.limit_val})
    raw.update(concurrent=args.concurrent, budget={"epochs": args.epochs})
    raw.update(over)
    path.write_text(yaml.safe_dump(raw))
    return path


def _search(name: str, root: pathlib.Path, space: pathlib.Path) -> dict[str, Any]:
    from lightray.config import load_config
    from lightray.tune.search import run_search

    cfg = load_config("demo", {"storage": str(root / "runs"), "name": name})
    t0 = time.time()
    with contextlib.redirect_stdout(sys.stderr):
        res = run_search(cfg, space=str(space))
    res["bench_wall_s"] = round(time.time() - t0, 1)
    return res


def startup_part(root: pathlib.Path, args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    out: dict[str, Any] = {}
    settings = (("before_not_shared", False, "train"), ("train_shared", True, "train"),
                ("after_inline_shared", True, "inline"))
    for label, share, runner in settings:
        note(f"start-up: {args.startup_trials} trials, share_startup={share}, trial_runner={runner}")
        space = _space(root / f"startup-{label}.yaml", args, trials=args.startup_trials, concurrent=1,
                       budget={"epochs": 1}, scheduler={"name": "fifo"}, share_startup=share,
                       trial_runner=runner, searcher={"name": "random", "seed": args.seed + 500})
        res = _search(f"startup-{label}", root, space)
        out[label] = dict(res["startup"], shared_build_s=res["shared_build_s"], trial_runner=runner,
                          per_trial=[t["startup"] for t in res["trials"]])
    before = out["before_not_shared"]
    ratios = {}
    for key, label in (("startup_after_over_before", "after_inline_shared"),
                       ("startup_shared_over_before", "train_shared")):
        b, a = before["first_step_s_median"], out[label]["first_step_s_median"]
        ratios[key] = round(a / b, 3) if a and b else None
    # Resolved only when the two searches' ranges do not overlap: under load one trial's start can vary more.
    b_rng, a_rng = before.get("first_step_s_min_max"), out["after_inline_shared"].get("first_step_s_min_max")
    ratios["startup_resolved"] = bool(b_rng and a_rng and (a_rng[1] < b_rng[0] or b_rng[1] < a_rng[0]))
    return out, ratios


def comparison_part(root: pathlib.Path, args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    runs: dict[str, list[list[dict[str, Any]]]] = {"tpe_asha": [], "random": []}
    detail: dict[str, list[dict[str, Any]]] = {"tpe_asha": [], "random": []}
    wall = args.budget_trial_s / args.concurrent
    for i in range(args.seeds):
        for method, searcher, scheduler, seed in (("tpe_asha", "tpe", "asha", args.seed + i),
                                                  ("random", "random", "fifo", args.seed + 1000 + i)):
            note(f"{method} seed {seed}: {wall:.0f} s wall ({args.budget_trial_s:g} trial-s at {args.concurrent} "
                 "at once)")
            space = _space(root / f"{method}-{seed}.yaml", args, trials=args.max_trials,
                           budget={"epochs": args.epochs, "total_time_s": wall},
                           scheduler={"name": scheduler, "reduction_factor": 2},
                           searcher={"name": searcher, "seed": seed, "n_startup_trials": args.n_startup})
            res = _search(f"{method}-{seed}", root, space)
            runs[method].append(res["trials"])
            detail[method].append({"seed": seed, "trials": len(res["trials"]),
                                   "finished_with_metric": sum(t["metric"] is not None for t in res["trials"]),
                                   "early_stopped": sum(t["state"] == "EARLY_STOPPED" for t in res["trials"]),
                                   "trial_s": round(sum(t["time_s"] for t in res["trials"]), 1),
                                   "curve": curve(res["trials"]), "rungs": res.get("rungs")})
    figures, ratios = compare(runs, args.budget_trial_s)
    figures["searches"] = detail
    return figures, ratios


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.search", description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3, help="searches per method (each with its own seed)")
    p.add_argument("--budget-trial-s", type=float, default=900.0, help="trial-seconds each search may spend")
    p.add_argument("--max-trials", type=int, default=40, help="trial cap per search (the budget should bind first)")
    p.add_argument("--n-startup", type=int, default=3, help="TPE's random trials before it models")
    p.add_argument("--concurrent", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--limit-train", type=int, default=960)
    p.add_argument("--limit-val", type=int, default=200)
    p.add_argument("--startup-trials", type=int, default=2, help="trials per start-up search (0: skip part 1)")
    p.add_argument("--skip-comparison", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    # Logical CPUs of the local cluster. Headroom on purpose: a trial ASHA stops can leave its Train
    # worker placement group behind when Ray's PlacementGroupCleaner cannot reach the State API (no
    # dashboard, or several Ray instances on one machine), and the baseline must not starve on those.
    p.add_argument("--num-cpus", type=int, default=4 * (os.cpu_count() or 1))
    args = p.parse_args(argv)
    machine = Machine()


    figures: dict[str, Any] = {"concurrent": args.concurrent, "epochs_per_trial": args.epochs,
                               "limit_train": args.limit_train, "seeds_per_method": args.seeds}
    ratios: dict[str, Any] = {}
    # stdout carries the one JSON line: Ray's own warnings (the raylet's, printed by the driver between
    # searches) go to stderr with everything else.
    with contextlib.redirect_stdout(sys.stderr):
        _run_parts(args, figures, ratios)
    emit("search", figures, ratios, machine.finish(argv, ray_num_cpus=args.num_cpus))
    return 0


def _run_parts(args: argparse.Namespace, figures: dict[str, Any], ratios: dict[str, Any]) -> None:
    import ray

    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-search-") as tmp:
            root = pathlib.Path(tmp)
            if args.startup_trials:
                figures["startup"], r = startup_part(root, args)
                ratios.update(r)
            if not args.skip_comparison:
                figures["comparison"], r = comparison_part(root, args)
                ratios.update(r)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
