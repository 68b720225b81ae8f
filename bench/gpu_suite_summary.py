"""The end of bench/gpu_suite.sh: one summary line per step from its log, exit status and seconds, then the suite's
one JSON line (``{"bench": "gpu_suite", "figures": {<step>: ...}, "ratios": {<step>_<ratio>: ...}, "machine"}``).

    python -m bench.gpu_suite_summary LOG_DIR DRY(0|1) STEP=BUDGET_S ...
"""

from __future__ import annotations

import json
import pathlib
import re
import sys
from typing import Any

from bench.common import Machine, emit

TIMEOUT_RCS = (124, 137)  # timeout(1)'s own, and SIGKILL after -k


def last_json(log: str) -> dict[str, Any] | None:
    """The step's bench line: the last line of its log that parses as a bench JSON object."""
    for line in reversed(log.splitlines()):
        if line.startswith('{"bench"'):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def key_figures(step: str, res: dict[str, Any] | None, log: str) -> dict[str, Any]:
    """The few figures the summary line shows for ``step``."""
    if step == "sync":
        got = re.findall(r"(\d+) (passed|skipped|failed|error)", log)
        return {word: int(n) for n, word in got}
    if res is None:
        return {}
    f, r = res.get("figures", {}), res.get("ratios", {})
    if step == "env":
        gpu = f.get("gpu") or {}
        d = f.get("decode", {})
        return {"gpu": gpu.get("name", "none"), "torch": f.get("torch"), "decode_device": d.get("device"),
                "decode_single_img_s": d.get("single_img_s"), f"decode_batched{d.get('batched_n')}_img_s":
                d.get("batched_img_s")}
    if step.startswith("tput"):
        out = {k: v for k, v in f.items() if k.endswith("_img_s")}
        out.update({k: v for k, v in r.items() if "over" in k})
        return out
    if step == "e2e":
        out = {}
        for px, ph in f.get("phases", {}).items():
            out.update({f"{px}px_e2e_img_s": ph.get("e2e_img_s"), f"{px}px_synthetic_img_s": ph.get("synthetic_img_s"),
                        f"{px}px_ratio": ph.get("ratio"), f"{px}px_decode_on": ph.get("decode_on")})
        return out
    if step == "pipeline":
        out = {}
        for path, per in f.get("per_core_img_s", {}).items():
            for size, v in per.items():
                out[f"per_core_{path}_{size}px"] = v
        return out
    if step == "comm":
        return {"device": f.get("compression_cost_measured_on"),
                **{f"{m}_s": v for m, v in f.get("per_mode_s", {}).items()}}
    if step == "resume":
        if "skipped" in f:
            return {"skipped": f["skipped"]}
        resume, noise = f.get("resume", {}), f.get("noise", {})
        return {"exact": f.get("exact"), "bitwise": resume.get("bitwise"), "max_abs_diff": resume.get("max_abs_diff"),
                "uninterrupted_max_abs_diff": noise.get("max_abs_diff")}
    return {}


def status(step: str, rc: int, res: dict[str, Any] | None, figs: dict[str, Any], dry: bool) -> str:
    """ok | failed (rc) | timeout | skipped (no CUDA). A skip counts as expected only in the dry run: on the GPU
    a skipped CUDA test means the GPU was not seen."""
    if rc in TIMEOUT_RCS:
        return "timeout"
    if rc != 0:
        return f"failed ({rc})"
    if step == "sync":
        if figs.get("passed"):
            return "ok"
        return "skipped (no CUDA)" if dry and figs.get("skipped") else "failed (not run)"
    if res is None:
        return "failed (no JSON line)"
    if step == "resume" and "skipped" in res.get("figures", {}):
        return "skipped (no CUDA)" if dry else "failed (skipped)"
    return "ok"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    folder, dry = pathlib.Path(argv[0]), argv[1] == "1"
    budgets = dict(a.split("=", 1) for a in argv[2:])
    machine = Machine()
    figures: dict[str, Any] = {}
    ratios: dict[str, Any] = {}
    bench_machine: dict[str, Any] = {}
    lines = []
    all_good = True
    for step, budget in budgets.items():
        def read(ext: str, default: str = "", step: str = step) -> str:
            p = folder / f"{step}{ext}"
            return p.read_text(errors="replace") if p.is_file() else default

        rc = int(read(".rc", "127").strip() or 127)
        seconds = int(read(".s", "0").strip() or 0)
        log = read(".log")
        res = last_json(log)
        figs = key_figures(step, res, log)
        st = status(step, rc, res, figs, dry)
        all_good &= st == "ok" or st.startswith("skipped")
        shown = ", ".join(f"{k} {_fmt(v)}" for k, v in figs.items() if v is not None and k != "skipped")
        lines.append(f"step {step}: {st}, {seconds} s" + (f", {shown}" if shown else "")
                     + ("" if st == "ok" or st.startswith("skipped") else f" (log: {folder / (step + '.log')})"))
        figures[step] = {"status": st, "rc": rc, "seconds": seconds, "budget_s": int(budget), "key": figs,
                         "figures": res.get("figures") if res else None, "log": str(folder / f"{step}.log")}
        if res:
            ratios.update({f"{step}_{k}": v for k, v in res.get("ratios", {}).items()})
            if step == "env":
                bench_machine = {k: v for k, v in res.get("machine", {}).items() if k in ("gpu", "device")}
    for line in lines:
        print(line)
    total = sum(f["seconds"] for f in figures.values())
    print(f"suite: {total} s over {len(figures)} steps; logs in {folder}")
    emit("gpu_suite", figures, ratios, machine.finish(argv, dry_run=dry, steps_s=total, logs=str(folder),
                                                      command="bash bench/gpu_suite.sh" + (" --dry-run" if dry else ""),
                                                      **bench_machine))
    return 0 if all_good else 1


if __name__ == "__main__":
    sys.exit(main())
