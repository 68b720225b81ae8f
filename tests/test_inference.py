"""After training, without Ray: `eval` reproduces the run's top-1, `predict` agrees with it, bad files are
skipped with a clear line, and `from app import load_model` classifies an image in a few lines."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from lightray.cli import main
from lightray.config import ModelConfig
from lightray.inference import EvalTransform, evaluate_folder, predict
from lightray.train.device import precision_for
from tests.finished_run import val_source_files

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_dir(finished_run) -> pathlib.Path:
    return finished_run


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "app/run.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_eval_on_the_runs_val_split_reproduces_its_reported_top1(run_dir, tmp_path):
    summary = json.loads((run_dir / "summary.json").read_text())
    proc = cli("eval", str(run_dir), "--weights", "final", "--device", "cpu", "--out", str(tmp_path / "f.json"))
    assert proc.returncode == 0, proc.stderr
    final = json.loads((tmp_path / "f.json").read_text())
    assert final["images"] == 64
    assert final["top1"] == summary["final_top1"] and final["top5"] == summary["final_top5"]
    assert f"top-1 {summary['final_top1']:.4f}" in proc.stdout
    (run_dir / "eval.json").unlink(missing_ok=True)  # the shared run may hold one from an earlier session
    best = evaluate_folder(str(run_dir), weights="best", device="cpu")
    assert best["top1"] == summary["best_top1"]
    assert (run_dir / "eval.json").is_file()  # default place: next to the run's summary.json
    per_class = best["per_class"]
    assert sum(v["images"] for v in per_class.values()) == 64
    assert sum(v["top1"] * v["images"] for v in per_class.values()) == pytest.approx(best["top1"] * 64)


def test_predict_on_the_val_images_agrees_with_eval(run_dir):
    ev = evaluate_folder(str(run_dir), weights="best", device="cpu", out="")
    root, rel = val_source_files(run_dir)
    assert [p["path"] for p in ev["predictions"]] == rel
    results = predict(str(run_dir), [str(root / r) for r in rel], top=3, weights="best", device="cpu")
    assert [r["top"][0]["label"] for r in results] == [p["pred"] for p in ev["predictions"]]
    assert [r["top"][0]["prob"] for r in results] == pytest.approx([p["prob"] for p in ev["predictions"]], abs=1e-5)


def test_eval_on_a_folder_scores_it_with_the_runs_preprocessing(run_dir, tmp_path):
    root, rel = val_source_files(run_dir)
    for r in rel:  # an ImageFolder tree holding exactly the run's val images
        (tmp_path / "data" / r).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / r, tmp_path / "data" / r)
    from_cache = evaluate_folder(str(run_dir), weights="best", device="cpu", out="")
    from_files = evaluate_folder(str(run_dir), data=str(tmp_path / "data"), weights="best", device="cpu", out="")
    assert from_files["images"] == 64 and from_files["top1"] == from_cache["top1"]
    proc = cli("eval", str(run_dir), "--data", str(tmp_path / "nowhere"))
    assert proc.returncode == 2 and "not found" in proc.stderr


def test_predict_skips_an_unreadable_file_and_scores_the_others(run_dir, tmp_path):
    root, rel = val_source_files(run_dir)
    good = [tmp_path / f"good{i}.jpg" for i in range(2)]
    for src, dst in zip(rel[:2], good):
        shutil.copy(root / src, dst)
    (tmp_path / "broken.jpg").write_bytes(b"this is not a jpeg")
    (tmp_path / "cut.jpg").write_bytes((root / rel[2]).read_bytes()[:300])  # a truncated JPEG
    proc = cli("predict", str(run_dir), str(tmp_path), "--top", "2", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    scored = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert len(scored) == 2 and all(ln.startswith(str(tmp_path / "good")) for ln in scored)
    assert len(scored[0].split(": ", 1)[1].split(", ")) == 2  # --top 2: two labels with probabilities
    skipped = [ln for ln in proc.stderr.splitlines() if ln.startswith("lightray: skipped")]
    assert len(skipped) == 2 and any("broken.jpg" in ln for ln in skipped) and any("cut.jpg" in ln for ln in skipped)
    as_json = cli("predict", str(run_dir), str(good[0]), str(tmp_path / "broken.jpg"), "--json", "--top", "1")
    assert as_json.returncode == 0
    out = json.loads(as_json.stdout)
    assert "top" in out[0] and len(out[0]["top"]) == 1 and "error" in out[1]
    nothing = cli("predict", str(run_dir), str(tmp_path / "broken.jpg"), str(tmp_path / "missing.jpg"))
    assert nothing.returncode == 1 and "none of the 2 inputs could be scored" in nothing.stderr


def test_load_model_classifies_one_image_in_five_lines(run_dir):
    root, rel = val_source_files(run_dir)
    path = str(root / rel[0])
    code = f"""
import sys, torch
from lightray import load_model
model, transform = load_model({str(run_dir)!r})
probs = model(transform({path!r})[None]).softmax(1)[0]
print(model.classes[int(probs.argmax())], float(probs.max()), 'ray' in sys.modules)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    label, prob, ray_loaded = proc.stdout.split()
    scored = predict(str(run_dir), [path], top=1, device="cpu")[0]
    expected = scored["top"][0]
    # load_model's model runs in fp32; predict autocasts as the run did (bf16 on a CPU with bf16 in hardware).
    tol = 1e-5 if precision_for(ModelConfig(precision="auto"), torch.device("cpu")) == "fp32" else 2e-2
    assert label == expected["label"] and float(prob) == pytest.approx(expected["prob"], abs=tol)
    assert ray_loaded == "False"


def test_import_app_imports_neither_torch_nor_ray():
    proc = subprocess.run([sys.executable, "-c", "import sys, app; print(sorted({'torch', 'ray'} & set(sys.modules)))"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_missing_run_is_exit_2_with_a_clear_line(tmp_path):
    assert main(["eval", str(tmp_path)]) == 2
    assert main(["predict", str(tmp_path), str(tmp_path)]) == 2


def test_rect_transform_keeps_the_aspect_and_centre_crops_a_square():
    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (60, 120, 3), dtype=np.uint8))
    rect = EvalTransform(size=32, mode="rect", resize_short=40)
    center = EvalTransform(size=32, mode="center", crop_ratio=0.875, resize_short=40)
    assert tuple(rect(img).shape) == (3, 32, 64)  # short side 32, the 2:1 aspect kept
    assert tuple(center(img).shape) == (3, 32, 32)
    x = center(img)
    assert abs(float(x.mean())) < 1.5  # normalised, not raw 0..255


def _val_rows(run_dir: pathlib.Path) -> tuple[list[bytes], list[str]]:
    root, rel = val_source_files(run_dir)
    return [(root / r).read_bytes() for r in rel], [r.split("/")[-2] for r in rel]


def test_eval_takes_the_val_split_as_parquet_or_tars_local_or_on_s3(run_dir, tmp_path, s3_storage):
    import io
    import tarfile

    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.test_s3_data import upload

    blobs, names = _val_rows(run_dir)
    classes = json.loads((run_dir / "classes.json").read_text())
    order = np.random.default_rng(0).permutation(len(blobs))  # a held-out split in its own row order
    # Hugging Face layout: test-*.parquet (a split name training does not take), ClassLabel names in the schema.
    meta = {b"huggingface": json.dumps({"info": {"features": {"label": {"names": classes,
                                                                         "_type": "ClassLabel"}}}}).encode()}
    table = pa.table({"image": pa.array([{"bytes": blobs[i], "path": f"{i}.jpg"} for i in order],
                                        pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
                      "label": pa.array([classes.index(names[i]) for i in order], pa.int64())})
    (tmp_path / "pq").mkdir()
    pq.write_table(table.replace_schema_metadata(meta), tmp_path / "pq" / "test-00000-of-00001.parquet")
    (tmp_path / "wds").mkdir()
    with tarfile.open(tmp_path / "wds" / "test-00000.tar", "w") as tar:  # string labels (.txt) + classes.json
        for k, i in enumerate(order):
            for ext, data in (("jpg", blobs[i]), ("txt", names[i].encode())):
                info = tarfile.TarInfo(f"{k:05d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    (tmp_path / "wds" / "classes.json").write_text(json.dumps(classes))
    from_cache = evaluate_folder(str(run_dir), weights="best", device="cpu", out="")
    on_s3 = upload(tmp_path / "pq", s3_storage.replace("/runs?", "/evalpq?"))
    for data in (str(tmp_path / "pq"), str(tmp_path / "wds"), on_s3):
        res = evaluate_folder(str(run_dir), data=data, weights="best", device="cpu", out="")
        assert res["images"] == 64 and res["top1"] == from_cache["top1"], data
        assert sum(v["images"] for v in res["per_class"].values()) == 64
    (tmp_path / "wds" / "classes.json").write_text(json.dumps(["x", "y"]))
    proc = cli("eval", str(run_dir), "--data", str(tmp_path / "wds"))
    assert proc.returncode == 2 and "not among the model's classes" in proc.stderr
