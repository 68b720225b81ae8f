"""Export: a real smoke run leaves <run>/model/{best,final}.safetensors + model.json; the exporter's rules
(best only on improvement, a failed write never stops training); export to s3:// through a local S3 server."""

from __future__ import annotations

import json
import logging
import pathlib

import pytest
import torch
from safetensors.torch import load_file

from lightray.config import ModelConfig, load_config
from lightray.train.export import ModelExporter, read_model_json, state_from_bytes, write_weights
from lightray.train.model import build_model
from tests.finished_run import CLASSES


@pytest.fixture(scope="module")
def run_dir(finished_run) -> pathlib.Path:
    return finished_run


def test_smoke_run_exports_best_final_and_model_json(run_dir):
    folder = run_dir / "model"
    info = json.loads((folder / "model.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert info["arch"] == "resnet_tiny" and info["num_classes"] == len(CLASSES)
    assert info["classes"] == json.loads((run_dir / "classes.json").read_text())
    assert info["eval_resolution"] == 48 and info["crop_ratio"] == 0.875 and info["val_mode"] == "center"
    assert info["normalize"]["mean"] == [0.485, 0.456, 0.406] and info["ema"] is True
    assert info["recipe"] == "smoke" and info["git_revision"]
    # The figures recorded with each file are the run's own: final = the last validation, best = the best one.
    assert info["weights"]["final"]["val_top1"] == summary["final_top1"]
    assert info["weights"]["final"]["val_top5"] == summary["final_top5"]
    assert info["weights"]["best"]["val_top1"] == summary["best_top1"]
    assert info["weights"]["final"]["epoch"] == 2
    model = build_model(ModelConfig(arch="resnet_tiny"), len(CLASSES))
    for which in ("best", "final"):
        state = load_file(str(folder / f"{which}.safetensors"))  # plain safetensors: no pickle involved
        assert set(state) == set(model.state_dict())
        model.load_state_dict(state, strict=True)


def _tiny_run_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "classes.json").write_text(json.dumps([f"c{i}" for i in range(10)]))
    (run / "data.json").write_text(json.dumps({"val_tier": 48}))
    return run


def test_best_is_rewritten_only_when_top1_improves(tmp_path):
    cfg = load_config("smoke")
    run = _tiny_run_dir(tmp_path)
    exp = ModelExporter(str(run), cfg)
    model = build_model(cfg.model, 10)
    assert exp.on_validation(model, {"val_top1": 0.5, "val_top5": 0.9}, 1, 100)
    first = load_file(str(run / "model" / "best.safetensors"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert not exp.on_validation(model, {"val_top1": 0.4, "val_top5": 0.9}, 2, 200)
    kept = load_file(str(run / "model" / "best.safetensors"))
    assert all(torch.equal(first[k], kept[k]) for k in first)
    assert exp.on_validation(model, {"val_top1": 0.6, "val_top5": 0.95}, 3, 300)
    best = load_file(str(run / "model" / "best.safetensors"))
    assert all(torch.equal(best[k], v) for k, v in model.state_dict().items())
    assert read_model_json(str(run / "model"))["weights"]["best"]["val_top1"] == 0.6
    # A restarted worker group (resume) keeps the best it had: a worse validation does not replace it.
    again = ModelExporter(str(run), cfg, best_top1=0.6)
    assert not again.on_validation(model, {"val_top1": 0.55}, 4, 400)
    assert again.on_end(model, {"val_top1": 0.55, "val_top5": 0.9}, 4, 400)
    weights = read_model_json(str(run / "model"))["weights"]
    assert weights["best"]["val_top1"] == 0.6 and weights["final"]["val_top1"] == 0.55


def test_failed_export_write_is_logged_and_training_goes_on(tmp_path, caplog):
    cfg = load_config("smoke")
    run = _tiny_run_dir(tmp_path)
    (run / "model").write_text("a file where the model folder should be")  # every write below fails
    exp = ModelExporter(str(run), cfg)
    model = build_model(cfg.model, 10)
    with caplog.at_level(logging.WARNING, logger="lightray.export"):
        exp.on_validation(model, {"val_top1": 0.5}, 1, 100)
        assert exp.on_end(model, None, 1, 100) is False
    assert "could not write best weights" in caplog.text and "training goes on" in caplog.text


def test_export_writes_to_s3(s3_storage):
    """A local S3 API server (moto) through pyarrow's S3FileSystem: the weights and model.json round-trip."""
    from lightray import storage
    from lightray.train.export import describe

    cfg = load_config("smoke")
    model = build_model(cfg.model, 3)
    info = describe(cfg, ["a", "b", "c"], 48)
    run = storage.join(s3_storage, "r1")
    uri = write_weights(run, "final", model.state_dict(), info, {"val_top1": 0.25})
    assert uri == storage.join(run, "model", "final.safetensors") and uri.startswith("s3://")
    state = state_from_bytes(storage.read_bytes(uri))
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    on_s3 = read_model_json(storage.join(run, "model"))
    assert on_s3["weights"]["final"]["val_top1"] == 0.25 and on_s3["classes"] == ["a", "b", "c"]
