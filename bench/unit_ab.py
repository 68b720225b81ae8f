"""A speed-up unit switched: the same lightray run as shipped and with config keys changed, side by side.

    python -m bench.unit_ab --set scaling.stream_ahead=true [--pairs 3] [--quick]

Each pair runs the demo recipe twice with the same seed, once as shipped and once with the ``--set`` keys
(the "changed" side), in an order that alternates between pairs (a load drift then favours each side as often). The
same seed gives both sides the same samples in the same order, so both reach each target at the same epoch
unless the unit changes what is learned (the line says when the epochs differ).

Ratios are "changed seconds over shipped seconds" per pair: above 1 the shipped setting is faster. Judged with
:func:`bench.common.resolved_ratio` (a spread wider than the gap from 1 is unresolved):
- ``train_s.<target>``: training seconds to the target (``elapsed_s``, the run's own clock from its first step);
- ``wall_s.<target>``: seconds from the launch to the validation that reached it (start-up included);
- ``first_step_s``: seconds from the launch to the first training step;
- ``total_wall_s``: the whole run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from bench.common import emit, load_avg, note, ratio, read_jsonl, resolved_ratio, spread
from bench.time_to_accuracy import DEFAULT_STORAGE, demo_tree, quick_overrides, run_lightray, summarize_side


def parse_set(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings as config overrides, each value read as YAML (``false``, ``3``, ``[1, 2]``)."""
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE, e.g. scaling.stream_ahead=false")
        out[key] = yaml.safe_load(value)
    return out


def first_step_s(run_dir: str, t_launch: float) -> float | None:
    """Seconds from the launch to the run's first training step (its ``first_step`` event)."""
    return next((float(r["time"]) - t_launch for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
                 if r.get("event") == "first_step"), None)


def run_side(storage: str, overrides: dict[str, Any], targets: list[float], seed: int) -> dict[str, Any]:
    t_launch = time.time()
    res = run_lightray(storage, overrides, targets, seed)
    res["first_step_s"] = first_step_s(res["run_dir"], t_launch)
    return res


def pair_ratios(shipped: list[dict[str, Any]], changed: list[dict[str, Any]], targets: list[float]
                ) -> dict[str, Any]:
    """Changed over shipped seconds, per pair, for every figure of the module docstring."""
    out: dict[str, Any] = {}
    for key in ("train_s", "wall_s"):
        for t in targets:
            out[f"{key}.{t:g}"] = resolved_ratio([ratio(b["by_target"][f"{t:g}"][key], a["by_target"][f"{t:g}"][key])
                                                  for a, b in zip(shipped, changed)])
    for key in ("first_step_s", "total_wall_s"):
        out[key] = resolved_ratio([ratio(b[key], a[key]) for a, b in zip(shipped, changed)])
    return out


def side_figures(runs: list[dict[str, Any]], targets: list[float]) -> dict[str, Any]:
    """One side's figures as the time-to-accuracy bench gives them, with the first step and the run folders."""
    return {**summarize_side(runs, targets), "first_step_s": spread([r["first_step_s"] for r in runs]),
            "run_dirs": [r["run_dir"] for r in runs]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--set", dest="sets", action="append", required=True, metavar="KEY=VALUE",
                   help="a config key of the changed side (repeat for several)")
    p.add_argument("--pairs", type=int, default=3, help="shipped/changed pairs, seeds seed..seed+pairs-1 (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, nargs="+", default=[0.5, 0.8], help="top-1 targets (default 0.5 0.8)")
    p.add_argument("--storage", default=DEFAULT_STORAGE, help="lightray storage; its cache/ holds the demo set")
    p.add_argument("--quick", action="store_true", help="the demo's quick form (a check of the plumbing, 1 pair)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    changed_keys = parse_set(args.sets)
    base = quick_overrides() if args.quick else {}
    pairs = 1 if args.quick else args.pairs
    targets = sorted(args.target)
    demo_tree(args.storage, base)  # written once, before any timed run
    shipped: list[dict[str, Any]] = []
    changed: list[dict[str, Any]] = []
    loads = []
    for k in range(pairs):
        seed = args.seed + k
        loads.append(load_avg())
        for side in (("shipped", "changed") if k % 2 == 0 else ("changed", "shipped")):
            note(f"pair {k + 1}/{pairs}: {side} (seed {seed}, load {load_avg()})")
            runs, keys = (shipped, {}) if side == "shipped" else (changed, changed_keys)
            runs.append(run_side(args.storage, {**base, **keys}, targets, seed))
    figures = {"recipe": "demo", "quick": args.quick, "pairs": pairs,
               "seeds": list(range(args.seed, args.seed + pairs)), "changed": changed_keys, "targets": targets,
               "load_1m_at_pair_start": loads,
               "shipped_side": side_figures(shipped, targets), "changed_side": side_figures(changed, targets),
               "same_epochs": all(a["by_target"][f"{t:g}"]["epochs"] == b["by_target"][f"{t:g}"]["epochs"]
                                  for a, b in zip(shipped, changed) for t in targets)}
    emit("unit_ab", figures, {"changed_over_shipped": pair_ratios(shipped, changed, targets)},
         {"cores": os.cpu_count(), "python": sys.version.split()[0]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
