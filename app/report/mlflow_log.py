"""``--mlflow URI``: copy a finished run (params, metrics, summary, report) into an MLflow tracking server.

MLflow (``mlflow-skinny``, a declared dependency) is imported only here, only when asked for, so a run
without ``--mlflow`` never loads it. Metric names are the TensorBoard tags (``train/loss``, ``val/top1``, ...) so the
two views of a run agree.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightray import storage
from lightray.report.progress import METRICS_FILE, read_metrics
from lightray.report.tensorboard_log import TAGS

MAX_PARAM_LEN = 500  # the smallest value limit among MLflow server versions still in use
PARAM_BATCH = 100  # MLflow's log_batch limit on params per request


class MissingExtraError(ImportError):
    """MLflow is not importable (an install that skipped dependencies); the message says how to install it."""


def _import_mlflow() -> Any:
    try:
        import mlflow
    except ImportError:
        raise MissingExtraError(
            '--mlflow needs the "mlflow" package (lightray depends on mlflow-skinny), which is not '
            'installed; install it with: pip install "mlflow-skinny>=2.10"'
        ) from None
    return mlflow


def flatten_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow params: dotted keys, list items indexed, values as strings.

    ``{"schedule": {"phases": [{"resolution": 128}]}}`` -> ``{"schedule.phases.0.resolution": "128"}``;
    a list of plain values stays one param (``"[0.5, 0.8]"``) so it reads as it was written.
    """
    if not isinstance(config, dict):
        raise TypeError(f"config: expected a mapping (the resolved config), got {type(config).__name__}")
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict):
            if value:
                out.update(flatten_params(value, name))
            else:
                out[name] = "{}"
        elif isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
            out.update(flatten_params({str(i): v for i, v in enumerate(value)}, name))
        else:
            text = json.dumps(value) if isinstance(value, list) else str(value)
            if len(text) > MAX_PARAM_LEN:
                text = text[: MAX_PARAM_LEN - 3] + "..."
            out[name] = text
    return out


def _run_config(run_dir: Path, summary: dict[str, Any]) -> dict[str, Any]:
    cfg = summary.get("config")
    if isinstance(cfg, dict):
        return cfg
    path = run_dir / "config.yaml"
    if path.is_file():
        import yaml

        data = yaml.safe_load(storage.read_text(str(path)))
        if isinstance(data, dict):
            return data
    return {}


def log_run(uri: str, run_dir: str, experiment: str = "lightray") -> str:
    """Log the run folder ``run_dir`` to the MLflow server at ``uri``; returns the MLflow run id."""
    mlflow = _import_mlflow()
    d = Path(run_dir)
    if not (d / METRICS_FILE).is_file():
        raise FileNotFoundError(f"{d}: no {METRICS_FILE}; expected a run folder <storage>/<name>/")
    summary_path = d / "summary.json"
    summary = storage.read_json(str(summary_path)) if summary_path.is_file() else {}
    records, _ = read_metrics(d / METRICS_FILE)

    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(experiment)
    with mlflow.start_run(run_name=str(summary.get("name") or d.name)) as active:
        params = list(flatten_params(_run_config(d, summary)).items())
        for i in range(0, len(params), PARAM_BATCH):
            mlflow.log_params(dict(params[i: i + PARAM_BATCH]))
        for rec in records:
            step = rec.get("step")
            if "event" in rec or not isinstance(step, int):
                continue
            metrics = {TAGS[k]: float(v) for k, v in rec.items()
                       if k in TAGS and isinstance(v, (int, float)) and not isinstance(v, bool)}
            if metrics:
                mlflow.log_metrics(metrics, step=step)
        finals = {f"final/{k}": float(v) for k, v in summary.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if finals:
            mlflow.log_metrics(finals)
        if summary:
            mlflow.log_dict(summary, "summary.json")
        if (d / "report").is_dir():
            mlflow.log_artifacts(str(d / "report"), artifact_path="report")
        return str(active.info.run_id)
