"""fp32 against bf16 autocast on this CPU: the same training step of each CPU recipe, timed both ways.

``python -m bench.precision [--repeats 3]`` builds each recipe's model, optimizer and loss with lightray's own
builders and times fixed-size steps on one random in-memory batch at the recipe's final resolution and batch, with
the machine's cores as torch threads (``bench.step_env.time_steps``), fp32 and bf16 autocast in interleaved rounds.
Each ratio is fp32 step time over bf16's, per round, judged by ``bench.common.resolved_ratio``: above 1, bf16 is
faster.

Why: ``model.precision: auto`` picks bf16 on a CPU whose flags say it has bf16 in hardware (``avx512_bf16`` or
``amx_bf16``) and fp32 elsewhere. This is the measurement behind that rule, to rerun on any CPU; the line also
says which of those flags the CPU has and what ``auto`` resolves to.
"""

from __future__ import annotations

import argparse
from typing import Any

from bench.common import Machine, emit, machine_cores, note, resolved_ratio, spread
from bench.step_env import time_steps

# Each CPU recipe at its final phase: (recipe, resolution, batch).
STEPS = (("demo", 64, 64), ("cifar10", 32, 512), ("imagenette", 128, 64))


def measure(cases: tuple[tuple[str, int, int], ...], repeats: int, steps: int, threads: int
            ) -> dict[str, dict[str, list[float]]]:
    """Seconds per step of every case in fp32 and bf16, ``repeats`` interleaved rounds."""
    runs: dict[str, dict[str, list[float]]] = {c[0]: {"fp32": [], "bf16": []} for c in cases}
    for r in range(repeats):
        for recipe, resolution, batch in cases:
            for precision in ("fp32", "bf16"):
                got = time_steps(recipe, resolution, batch, steps, threads, precision)
                if got["precision"] != precision:
                    raise RuntimeError(f"{recipe}: asked for {precision}, the step ran in {got['precision']}")
                runs[recipe][precision].append(got["step_s"])
            note(f"round {r + 1}/{repeats} {recipe}: fp32 {runs[recipe]['fp32'][-1]:.3f} s, "
                 f"bf16 {runs[recipe]['bf16'][-1]:.3f} s")
    return runs


def main(argv: list[str] | None = None) -> int:
    import torch

    from lightray.config import ModelConfig
    from lightray.train.device import cpu_bf16_flags, precision_for

    p = argparse.ArgumentParser(prog="python -m bench.precision", description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    p.add_argument("--steps", type=int, default=5, help="timed steps per case, precision and round")
    p.add_argument("--recipes", nargs="+", default=[c[0] for c in STEPS], choices=[c[0] for c in STEPS])
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: this machine's cores)")
    args = p.parse_args(argv)
    threads = args.threads or machine_cores()
    machine = Machine()
    cases = tuple(c for c in STEPS if c[0] in args.recipes)
    runs = measure(cases, args.repeats, args.steps, threads)
    figures: dict[str, Any] = {
        "cpu_bf16_flags": cpu_bf16_flags(), "auto_resolves_to": precision_for(ModelConfig(), torch.device("cpu")),
        "threads": threads, "steps": args.steps,
        "cases": {r: {"resolution": res, "batch": b} for r, res, b in cases},
        "step_s": {r: {prec: spread(v) for prec, v in runs[r].items()} for r, _, _ in cases}}
    ratios = {f"{r}_fp32_over_bf16": resolved_ratio([a / b for a, b in zip(runs[r]["fp32"], runs[r]["bf16"])])
              for r, _, _ in cases}
    emit("precision", figures, ratios, machine.finish(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
