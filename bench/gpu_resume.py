"""A run stopped and resumed on the GPU against an uninterrupted one: is the continuation exact?

Four real drivers (``python app/run.py --smoke-test`` on one GPU, a shared data cache so prepare runs once):
``whole`` straight through, twice (``whole`` and ``whole_again``); ``split`` with
``--checkpoint.stop_after_steps=--stop``, then ``split`` again with ``--resume``. The final checkpoints' model
tensors are compared. The step passes when the resumed run is as close to ``whole`` as ``whole_again`` is, within
a factor of ``SPREAD_FACTOR`` (bitwise when the two uninterrupted runs agree bitwise): with bf16 and
cudnn.benchmark on, two uninterrupted runs differ in their last bits, so a fixed tolerance would fail a correct
resume on ordinary GPU nondeterminism, or pass a wrong one where the noise is large. The line gives both
distances, and whether each comparison is bitwise.

    python -m bench.gpu_resume                # on the GPU machine
    python -m bench.gpu_resume --dry-run      # no training: checks the three command lines parse (the CPU check of
                                              # exact resume is tests/test_resume.py, a slow test)
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from bench.common import REPO, Machine, emit, note


def command(storage: pathlib.Path, cache: pathlib.Path, name: str, gpu: bool, *extra: str) -> list[str]:
    return [sys.executable, "app/run.py", "--smoke-test", "--storage", str(storage), "--name", name,
            "--scaling.ray_address=local", f"--data.cache_dir={cache}", f"--data.local_cache_dir={cache / 'local'}",
            "--gpu", "true" if gpu else "false", "--workers", "1", *extra]


def final_model(run_dir: pathlib.Path) -> dict[str, torch.Tensor]:
    last = sorted(p for p in run_dir.glob("checkpoint_*") if (p / "meta_rank0.json").is_file())[-1]
    return torch.load(last / "state_rank0.pt", map_location="cpu", weights_only=True)["model"]


SPREAD_FACTOR = 2.0  # the resumed run may be this many times as far from ``whole`` as ``whole_again`` is


def judge(whole: dict[str, torch.Tensor], again: dict[str, torch.Tensor],
          resumed: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Whether ``resumed`` ends as an uninterrupted run does: no farther from ``whole`` than ``again`` (a second
    uninterrupted run) is, times SPREAD_FACTOR; bitwise equal when the uninterrupted runs are."""
    noise, got = compare(whole, again), compare(whole, resumed)
    if not (noise["same_keys"] and got["same_keys"]):
        return {"noise": noise, "resume": got, "exact": False}
    bound = SPREAD_FACTOR * noise["max_abs_diff"]
    exact = got["bitwise"] or (not noise["bitwise"] and got["max_abs_diff"] <= bound)
    return {"noise": noise, "resume": got, "bound": bound, "exact": bool(exact)}


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, Any]:
    if a.keys() != b.keys():
        return {"same_keys": False, "bitwise": False, "within_tolerance": False}
    worst, bitwise, close = 0.0, True, True
    for k in a:
        x, y = a[k].float(), b[k].float()
        bitwise &= torch.equal(a[k], b[k])
        close &= torch.allclose(x, y, rtol=1e-4, atol=1e-5)
        if x.numel():
            worst = max(worst, float((x - y).abs().max()))
    return {"same_keys": True, "tensors": len(a), "bitwise": bool(bitwise), "within_tolerance": bool(close),
            "max_abs_diff": worst}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_resume", description=__doc__.split("\n")[0])
    ap.add_argument("--stop", type=int, default=6, help="stop after this many steps (of the smoke run's 12)")
    ap.add_argument("--dry-run", action="store_true", help="check the command lines parse; train nothing")
    args = ap.parse_args(argv)
    machine = Machine()
    work = pathlib.Path(tempfile.mkdtemp(prefix="lightray-gpu-resume-"))
    storage, cache = work / "runs", work / "cache"
    runs = {"whole": command(storage, cache, "whole", not args.dry_run),
            "whole_again": command(storage, cache, "whole_again", not args.dry_run),
            "split_stop": command(storage, cache, "split", not args.dry_run,
                                  f"--checkpoint.stop_after_steps={args.stop}"),
            "split_resume": command(storage, cache, "split", not args.dry_run, "--resume")}
    figures: dict[str, Any] = {"stop_after_steps": args.stop, "seconds": {}}
    try:
        if args.dry_run:
            from lightray.cli import build_parser, config_from_args

            for cmd in runs.values():  # the CLI's own parser and config: a renamed flag or key fails here
                known, rest = build_parser().parse_known_args(cmd[2:])
                config_from_args(known, rest)
            figures["skipped"] = "dry run: four Ray runs do not fit the CPU budget; command lines parsed"
            emit("gpu_resume", figures, {}, machine.finish(argv, dry_run=True))
            return 0
        if not torch.cuda.is_available():
            ap.error("no CUDA device visible; use --dry-run to check the script")
        for name, cmd in runs.items():
            t0 = time.perf_counter()
            note(f"{name}: {' '.join(cmd[1:])}")
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ})
            figures["seconds"][name] = round(time.perf_counter() - t0, 1)
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            if proc.returncode != 0:
                raise SystemExit(f"gpu_resume: {name} failed ({proc.returncode})")
        got = judge(final_model(storage / "whole"), final_model(storage / "whole_again"),
                    final_model(storage / "split"))
        figures.update(got)
        emit("gpu_resume", figures, {}, machine.finish(argv, dry_run=False, gpu=torch.cuda.get_device_name(0)))
        return 0 if got["exact"] else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
