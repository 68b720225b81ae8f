"""A non-editable install, used from outside the checkout: the wheel holds the package ``lightray`` (recipes and
search spaces inside it), no ``app`` or ``bench``; its commands and Python API train and search."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import venv

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def _run(cmd: list[str], cwd: pathlib.Path, timeout: int, env: dict[str, str]) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, f"{cmd}: exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.mark.slow
def test_wheel_in_a_fresh_venv_trains_and_searches_from_another_folder(tmp_path, lightray_wheel):
    env_dir, work, wheel = tmp_path / "venv", tmp_path / "elsewhere", lightray_wheel
    work.mkdir()
    # Run the way a user outside the checkout would: no PYTHONPATH pointing into it.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # The dependencies (torch, Ray: GBs) come from this interpreter's site-packages; lightray itself only from
    # the wheel, installed into the venv.
    venv.create(env_dir, system_site_packages=True, with_pip=True)
    py, bindir = env_dir / "bin" / "python", env_dir / "bin"
    env["PATH"] = f"{bindir}:{env['PATH']}"
    _run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)], work, 300, env)
    probe = ("import importlib.util, json, lightray; "
             "print(json.dumps({'file': lightray.__file__, 'load_model': callable(lightray.load_model), "
             "'app': importlib.util.find_spec('app') is not None, "
             "'bench': importlib.util.find_spec('bench') is not None}))")
    found = json.loads(_run([str(py), "-c", probe], work, 60, env).stdout.strip().splitlines()[-1])
    assert found["file"].startswith(str(env_dir)), found  # the wheel's copy, not the checkout
    assert found["load_model"] and not found["app"] and not found["bench"], found
    runs = work / "runs"
    common = ["--storage", str(runs), "--scaling.ray_address=local", "--scaling.ray_num_cpus=4"]
    _run([str(bindir / "lightray"), "train", "--smoke-test", "--name", "cli", *common], work, 600, env)
    summary = json.loads((runs / "cli" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["final_top1"] is not None
    # One trial: what is checked is that the installed package finds its search space and Tune runs a trial
    # through it (tests/test_tune_search.py checks the search itself).
    _run([str(bindir / "lightray"), "tune", "--space", "demo", "--trials", "1", "--smoke-test", "--name", "search",
          *common], work, 600, env)
    trials = [p for p in (runs / "search").rglob("summary.json")]
    assert len(trials) == 1, trials
    assert (runs / "search" / "best_recipe.yaml").is_file()
    # The Python API: continue the finished run (nothing left to train) and load its exported model.
    api = ("import json, lightray; "
           f"r = lightray.train('smoke', resume=True, name='cli', storage={str(runs)!r}, "
           "scaling__ray_address='local'); "
           f"model, transform = lightray.load_model({str(runs / 'cli')!r}); "
           "print(json.dumps({'status': r.status, 'top1': r.top1, 'classes': len(model.classes)}))")
    got = json.loads(_run([str(py), "-c", api], work, 600, env).stdout.strip().splitlines()[-1])
    assert got["status"] == "finished" and got["top1"] == summary["final_top1"] and got["classes"] > 1, got
