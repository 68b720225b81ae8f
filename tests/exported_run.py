"""One real smoke run shared by the export and inference tests: `python app/run.py --smoke-test` on a local
Ray cluster with 2 gloo workers, a timm architecture and EMA on, so that the exported weights are the
EMA copy of a model that did not come from torchvision. Run once per test session (cached in the
session's temp folder), whichever test module asks first."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMM_ARCH = "timm:mobilenetv3_small_050"  # ~0.6M parameters: a timm model small enough for two CPU workers


def exported_run(tmp_path_factory, shared_cache: pathlib.Path) -> pathlib.Path:
    base = tmp_path_factory.getbasetemp() / "exported-run"
    run_dir = base / "runs" / "timm1"
    if (run_dir / "summary.json").is_file():
        return run_dir
    base.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [sys.executable, "app/run.py", "--smoke-test", "--storage", str(base / "runs"), "--name", "timm1",
         "--scaling.ray_address=local", f"--model.arch={TIMM_ARCH}", "--optim.ema_decay=0.8",
         f"--data.cache_dir={shared_cache}", f"--data.local_cache_dir={shared_cache / 'local'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    (base / "run.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "finished"
    return run_dir


def val_source_files(run_dir: pathlib.Path) -> tuple[pathlib.Path, list[str]]:
    """(source root, paths relative to it) of the images in the run's val split, in the shard order."""
    import pyarrow.parquet as pq

    from lightray.data.manifest import Manifest

    data = json.loads((run_dir / "data.json").read_text())
    manifest = Manifest.load(data["manifest"])
    paths = [p for s in manifest.shards("val", data["val_tier"])
             for p in pq.read_table(s.uri, columns=["path"]).column("path").to_pylist()]
    return pathlib.Path(manifest.source), paths
