"""lightray as a package: one CLI with a --help per command and the older flags as aliases, and the Python API."""

from __future__ import annotations

import subprocess
import sys

import pytest

import lightray
from lightray.api import Result, overrides_from_kwargs
from lightray.cli import COMMANDS, main, split_command
from lightray.config import ConfigError


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_has_its_own_help(command, capsys):
    with pytest.raises(SystemExit) as ex:
        main([command, "--help"])
    assert ex.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: lightray {command}")
    if command in ("train", "tune", "prepare"):
        assert "--SECTION.KEY=VALUE" in out and "--data" in out
    if command == "tune":
        assert "--space" in out and "--trials" in out
    if command in ("train", "tune"):
        assert "--resume" in out


@pytest.mark.parametrize(("argv", "command", "rest"), [
    (["--smoke-test"], "train", ["--smoke-test"]),
    ([], "train", []),
    (["train", "--name", "x"], "train", ["--name", "x"]),
    (["--config", "smoke", "--tune", "--trials", "2"], "tune", ["--config", "smoke", "--trials", "2"]),
    (["--prepare-only", "--data", "d"], "prepare", ["--data", "d"]),
    (["--report", "runs/r"], "report", ["runs/r"]),
    (["--report=s3://b/r"], "report", ["s3://b/r"]),
    # a config override of the report section is not the report command
    (["--report.every_steps=1", "--smoke-test"], "train", ["--report.every_steps=1", "--smoke-test"]),
    (["predict", "run", "a.jpg"], "predict", ["run", "a.jpg"]),
])
def test_older_flags_are_aliases_of_the_subcommands(argv, command, rest):
    assert split_command(argv) == (command, rest)


def test_a_flag_of_another_command_is_a_usage_error(capsys):
    # --space belongs to tune: train does not take it as a config key either
    assert main(["train", "--space", "demo"]) == 2
    assert "--space: unknown argument" in capsys.readouterr().err


def test_api_overrides_take_dotted_or_double_underscore_keys():
    assert overrides_from_kwargs({"schedule__epochs": 3, "optim.lr_per_256": 0.4, "data": "/d", "storage": "/s"}) \
        == {"schedule.epochs": 3, "optim.lr_per_256": 0.4, "data.source": "/d", "storage": "/s"}


def test_api_train_refuses_a_bad_key_before_starting_anything(tmp_path):
    with pytest.raises(ConfigError, match="schedule.epochz"):
        lightray.train("smoke", storage=str(tmp_path), schedule__epochz=3)
    assert not any(tmp_path.iterdir())  # nothing written, no Ray started
    with pytest.raises(ConfigError, match="unknown recipe 'nope'"):
        lightray.train("nope")


def test_result_reads_the_summary():
    r = Result({"run_dir": "/r", "status": "finished", "final_top1": 0.5, "final_top5": 0.9})
    assert (r.run_dir, r.status, r.top1, r.top5) == ("/r", "finished", 0.5, 0.9)
    assert lightray.Result is Result


def test_import_lightray_loads_neither_torch_nor_ray():
    code = "import sys, lightray; lightray.load_model; lightray.train; print(sorted(m for m in ('torch', 'ray') " \
           "if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
