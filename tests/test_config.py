import subprocess
import sys

import pytest

from lightray.cli import parse_overrides
from lightray.config import ConfigError, load_config

RUN = [sys.executable, "app/run.py"]


def cli_in_process(capsys, *argv: str) -> tuple[int, str]:
    """(exit status, stderr) of ``lightray.cli.main(argv)`` in this process: what the program returns."""
    from lightray.cli import main

    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    return code, capsys.readouterr().err


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*RUN, *args], capture_output=True, text=True, timeout=120,
                          cwd=str(__import__("pathlib").Path(__file__).parents[1]))


@pytest.mark.parametrize(
    "args, key",
    [
        (["--optim.no_such_key=1"], "optim.no_such_key"),
        (["--nosection.key=1"], "nosection"),
        (["--optim.lr_per_256=fast"], "optim.lr_per_256"),
        (["--optim.lr_per_256=-1"], "optim.lr_per_256"),
        (["--schedule.epochs=0"], "schedule.epochs"),
        (["--model.arch=vgg"], "model.arch"),
        (["--comm.mode=gossip"], "comm.mode"),
        (["--workers=3:1"], "scaling.workers"),
        (["--model.zero_init_residual=maybe"], "model.zero_init_residual"),
        (["--config", "no-such-recipe"], "--config"),
        (["--schedule.phases=[{until_epoch: 2, resolution: 4, batch_size: 8}]"], "schedule.phases[0].resolution"),
    ],
)
def test_bad_config_exits_2_with_one_line_naming_the_key(args, key, capsys):
    code, err = cli_in_process(capsys, *args, "--smoke-test", "--storage", "/nonexistent-should-not-be-created")
    assert code == 2, err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert key in lines[0]


def test_the_program_exits_2_with_the_one_line_on_stderr():
    """The error paths above run in this process (lightray.cli.main); this one is the real program's exit."""
    proc = run_cli("--optim.lr_per_256=fast", "--smoke-test", "--storage", "/nonexistent-should-not-be-created")
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("lightray: error: ") and "optim.lr_per_256" in lines[0]


def test_error_names_the_bad_value_and_what_is_allowed():
    with pytest.raises(ConfigError) as err:
        load_config("demo", {"model.arch": "vgg"})
    msg = str(err.value)
    assert "'vgg'" in msg and "resnet18" in msg


def test_a_sample_log_on_object_storage_is_refused_naming_the_key():
    # Each rank appends to its sample log at every step: a folder, never an object store.
    with pytest.raises(ConfigError, match=r"^report.sample_log_dir: bad value 's3://b/log'; expected a local"):
        load_config("smoke", {"report.sample_log_dir": "s3://b/log"})
    assert load_config("smoke", {"report.sample_log_dir": "/tmp/log"}).report.sample_log_dir == "/tmp/log"


def test_dotted_overrides_reach_the_typed_config():
    cfg = load_config("demo", parse_overrides(["--optim.lr_per_256=0.8", "--schedule.epochs", "3",
                                               "--data.tiers=[32, 64]", "--model.channels_last=false"]))
    assert cfg.optim.lr_per_256 == 0.8 and isinstance(cfg.schedule.epochs, int) and cfg.schedule.epochs == 3
    assert cfg.data.tiers == [32, 64]
    assert cfg.model.channels_last is False


def test_phases_must_cover_the_epochs():
    # Absolute phase ends (until_epoch) do not stretch: a budget past the last one is an error.
    with pytest.raises(ConfigError, match="cover schedule.epochs"):
        load_config("demo", {"schedule.epochs": 20, "schedule.phases": "[{until_epoch: 16, resolution: 32, "
                                                                         "batch_size: 128}]"})


def test_fraction_phases_stretch_to_any_budget():
    cfg = load_config("demo", {"schedule.epochs": 20})
    assert cfg.schedule.epochs == 20 and cfg.schedule.phases[-1].until == 1.0


@pytest.mark.parametrize("phases, key", [
    ("[{until: 0.5, until_epoch: 4, resolution: 32, batch_size: 8}, {until: 1.0, resolution: 32, batch_size: 8}]",
     "schedule.phases[0].until"),
    ("[{resolution: 32, batch_size: 8}]", "schedule.phases[0].until"),
    ("[{until: 0.5, resolution: 32, batch_size: 8}, {until_epoch: 16, resolution: 32, batch_size: 8}]",
     "schedule.phases[1].until_epoch"),
    ("[{until: 0.5, resolution: 32, batch_size: 8}, {until: 0.9, resolution: 32, batch_size: 8}]",
     "schedule.phases[1].until"),
    ("[{until: 1.5, resolution: 32, batch_size: 8}]", "schedule.phases[0].until"),
])
def test_phase_end_is_one_of_until_or_until_epoch(phases, key):
    with pytest.raises(ConfigError) as err:
        load_config("demo", {"schedule.phases": phases})
    assert str(err.value).startswith(key), str(err.value)


def test_recipe_giving_both_warmups_is_an_error_naming_the_key(tmp_path):
    p = tmp_path / "both.yaml"
    p.write_text("schedule: {epochs: 4, warmup: 0.25, warmup_epochs: 1, phases: [{until: 1.0, resolution: 32, "
                 "batch_size: 16}]}\n")
    with pytest.raises(ConfigError, match=r"^schedule.warmup: .*schedule.warmup_epochs, not both"):
        load_config(str(p))


def test_a_later_warmup_key_replaces_the_recipes_other_one():
    cfg = load_config("demo", {"schedule.warmup_epochs": 2})  # the demo recipe gives a fraction
    assert cfg.schedule.warmup == 0.0 and cfg.schedule.warmup_epochs == 2
    back = load_config("demo", {"schedule.warmup": 0.25})
    assert back.schedule.warmup == 0.25 and back.schedule.warmup_epochs == 0.0


def test_recipe_from_a_yaml_path(tmp_path):
    p = tmp_path / "mine.yaml"
    p.write_text("optim: {lr_per_256: 0.2}\nschedule: {epochs: 1, phases: [{until_epoch: 1, resolution: 32, "
                 "batch_size: 16}]}\n")
    cfg = load_config(str(p))
    assert cfg.optim.lr_per_256 == 0.2 and cfg.recipe == "mine"


def test_help_documents_every_flag():
    proc = run_cli("--help")
    assert proc.returncode == 0
    from lightray.cli import build_parser

    for action in build_parser()._actions:
        for flag in action.option_strings:
            assert flag in proc.stdout, flag
    assert "--SECTION.KEY=VALUE" in proc.stdout


def test_a_saved_config_loads_back_as_a_recipe(tmp_path):
    """A search's best recipe is a saved config: it holds both alternatives of a pair, one at its cleared value."""
    import yaml

    cfg = load_config("demo", {"schedule.epochs": "8"})
    path = tmp_path / "saved.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    again = load_config(str(path))
    assert again.to_dict() == cfg.to_dict()


def test_an_elastic_run_resizes_a_stuck_worker_group_start_after_its_own_timeout_and_a_fixed_one_keeps_rays():
    """Ray Train sizes the group restarting after a spot notice onto the draining machine, then waits for that
    placement group for its start timeout (60 s by default) before it sizes the group again; an elastic run
    shortens that wait. A fixed-size run waits for the autoscaler and keeps Ray's default."""
    from lightray import ray_private
    from lightray.driver.runner import train_env

    elastic = train_env(load_config("smoke", {"scaling.workers": "1:2", "scaling.elastic_start_timeout_s": 15}))
    assert elastic[ray_private.START_TIMEOUT_ENV] == "15.0"
    assert elastic["RAY_TRAIN_COLLECTIVE_TIMEOUT_S"] == elastic[ray_private.HEALTH_CHECK_TIMEOUT_ENV]
    assert ray_private.START_TIMEOUT_ENV not in train_env(load_config("smoke", {"scaling.workers": "2"}))
