"""``python -m bench.search``: Optuna TPE + ASHA against random search without early stopping.

Both searches run in this process, one after the other, on the embedded demo with the same space, the
same number of trials, the same per-trial budget and the same concurrency. Figures: the best validation
top-1 each reached and the trial-seconds each spent (sum of Tune's per-trial wall time). Ratios (lightray
over baseline, bigger is better): best top-1 TPE+ASHA / random, and random's trial-seconds / TPE+ASHA's.
Prints one JSON line on stdout; everything else goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import sys
import tempfile
import time

import yaml

from bench.common import Machine, emit

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


def _space(path: pathlib.Path, args: argparse.Namespace, searcher: str, scheduler: str) -> pathlib.Path:
    raw = json.loads(json.dumps(SPACE))
    raw["fixed"].update({"data.limit_train": args.limit_train, "data.limit_val": args.limit_val})
    raw.update(trials=args.trials, concurrent=args.concurrent, budget={"epochs": args.epochs},
               scheduler={"name": scheduler, "grace_period": 1, "reduction_factor": 2},
               searcher={"name": searcher, "seed": args.seed, "n_startup_trials": max(1, args.trials // 2)})
    path.write_text(yaml.safe_dump(raw))
    return path


def _search(name: str, root: pathlib.Path, args: argparse.Namespace, searcher: str, scheduler: str) -> dict:
    from app.config import load_config
    from app.tune.search import run_search

    space = _space(root / f"{name}.yaml", args, searcher, scheduler)
    cfg = load_config("demo", {"storage": str(root / "runs"), "name": name})
    t0 = time.time()
    with contextlib.redirect_stdout(sys.stderr):
        res = run_search(cfg, space=str(space))
    scored = [t["metric"] for t in res["trials"] if t["metric"] is not None]
    return {"best_top1": max(scored) if scored else 0.0,
            "trial_seconds": round(sum(t["time_s"] for t in res["trials"]), 1),
            "wall_s": round(time.time() - t0, 1),
            "early_stopped": sum(t["state"] == "EARLY_STOPPED" for t in res["trials"]),
            "trials": len(res["trials"])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.search", description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=6)
    p.add_argument("--concurrent", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--limit-train", type=int, default=960)
    p.add_argument("--limit-val", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    # Logical CPUs of the local cluster. Headroom on purpose: a trial ASHA stops can leave its Train
    # worker placement group behind when Ray's PlacementGroupCleaner cannot reach the State API (no
    # dashboard, or several Ray instances on one machine), and the baseline must not starve on those.
    p.add_argument("--num-cpus", type=int, default=4 * (os.cpu_count() or 1))
    args = p.parse_args(argv)
    machine = Machine()

    import ray

    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-search-") as tmp:
            root = pathlib.Path(tmp)
            tpe = _search("tpe-asha", root, args, "tpe", "asha")
            rnd = _search("random-fifo", root, args, "random", "fifo")
    finally:
        ray.shutdown()
    figures = {"tpe_asha": tpe, "random_fifo": rnd, "trials": args.trials, "epochs_per_trial": args.epochs,
               "concurrent": args.concurrent, "limit_train": args.limit_train}
    ratios = {
        "best_top1_tpe_asha_over_random": round(tpe["best_top1"] / max(rnd["best_top1"], 1e-9), 3),
        "trial_seconds_random_over_tpe_asha": round(rnd["trial_seconds"] / max(tpe["trial_seconds"], 1e-9), 3),
    }
    emit("search", figures, ratios, machine.finish(argv, ray_num_cpus=args.num_cpus))
    return 0


if __name__ == "__main__":
    sys.exit(main())
