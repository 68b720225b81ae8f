"""The trained model, ready to take away: ``<run>/model/{final,best}.safetensors`` + ``model.json``.

``best.safetensors`` is rewritten whenever validation top-1 improves, ``final.safetensors`` at the end of
the run; both hold the weights that were validated (the EMA copy when EMA is on), so scoring the run's
own val split with them gives the top-1 the run reported. ``model.json`` holds what a reader needs to
rebuild the network and its preprocessing without the run's config: architecture, classes, eval
resolution and crop, normalisation, and each file's validation figures.

Safetensors, not pickle: loading a file from shared storage cannot run code. Files go through pyarrow.fs,
so a run on s3:// exports to s3:// too.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from lightray import storage

log = logging.getLogger("lightray.export")

MODEL_DIR = "model"
MODEL_JSON = "model.json"
FORMAT = "lightray-model/1"
WEIGHTS = ("best", "final")


def model_dir(run_dir: str) -> str:
    return storage.join(run_dir, MODEL_DIR)


# --- safetensors ---------------------------------------------------------------------------------------
def state_to_bytes(state: dict[str, Any], metadata: dict[str, str] | None = None) -> bytes:
    """A state dict as safetensors bytes (tensors copied to CPU, contiguous, unshared)."""
    from safetensors.torch import save

    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items() if hasattr(v, "detach")}
    return save(tensors, metadata=metadata)


def state_from_bytes(data: bytes) -> dict[str, Any]:
    from safetensors.torch import load

    return load(data)


# --- the run's model folder ----------------------------------------------------------------------------
def describe(cfg: Any, classes: list[str], val_tier: int | None) -> dict[str, Any]:
    """model.json's fixed part: how to rebuild the network and the run's eval preprocessing."""
    from lightray.provenance import git_revision
    from lightray.train.device import IMAGENET_MEAN, IMAGENET_STD

    eval_res = cfg.schedule.eval_resolution or cfg.schedule.phases[-1].resolution
    return {
        "format": FORMAT,
        "arch": cfg.model.arch,
        "num_classes": len(classes),
        "classes": list(classes),
        "eval_resolution": eval_res,
        "crop_ratio": cfg.data.val_crop_ratio,
        "val_mode": cfg.data.val_mode,
        "val_batch_size": cfg.data.val_batch_size,
        # The val images were stored with this short side before the crop (the run's val shard tier):
        # resizing to it first gives the pixels the run validated on.
        "resize_short": val_tier,
        "tta_flip": cfg.schedule.tta_flip,
        "tta_translate": cfg.schedule.tta_translate,
        "normalize": {"mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD), "input": "RGB uint8 / 255"},
        "channels_last": cfg.model.channels_last,
        "precision": cfg.model.precision,
        "ema": cfg.optim.ema_decay > 0,
        "recipe": cfg.recipe,
        "run_name": cfg.name,
        "pretrained": getattr(cfg.model, "pretrained", ""),
        "git_revision": git_revision(),
        "config": cfg.to_dict(),
        "weights": {},
    }


def write_weights(run_dir: str, which: str, state: dict[str, Any], info: dict[str, Any],
                  figures: dict[str, Any]) -> str:
    """Write ``<run>/model/<which>.safetensors``, then ``model.json`` with ``figures`` under weights.<which>.

    The weights go first: a model.json entry always names a file that is there and complete."""
    if which not in WEIGHTS:
        raise ValueError(f"which: bad value {which!r}; expected one of {', '.join(WEIGHTS)}")
    folder = model_dir(run_dir)
    name = f"{which}.safetensors"
    weights = state_to_bytes(state, {"format": FORMAT, "arch": str(info.get("arch", ""))})
    storage.write_bytes(storage.join(folder, name), weights)
    info["weights"][which] = {"file": name, "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              **figures}
    storage.write_bytes(storage.join(folder, MODEL_JSON), json.dumps(info, indent=1, default=str).encode())
    return storage.join(folder, name)


def read_model_json(folder: str) -> dict[str, Any]:
    return json.loads(storage.read_bytes(storage.join(folder, MODEL_JSON)))


class ModelExporter:
    """Rank 0's export hook: best weights on every top-1 improvement, final weights at the end.

    A failed write is logged and the run goes on: losing an export must never cost the training."""

    def __init__(self, run_dir: str, cfg: Any, best_top1: float = 0.0):
        self.run_dir = run_dir
        self.cfg = cfg
        self.best_top1 = best_top1
        self.info: dict[str, Any] | None = None
        try:
            self.has_best = storage.exists(storage.join(model_dir(run_dir), "best.safetensors"))
        except Exception:  # storage unreachable now: the first write will say so
            self.has_best = False

    def _info(self) -> dict[str, Any]:
        if self.info is None:
            classes = json.loads(storage.read_bytes(storage.join(self.run_dir, "classes.json")))
            try:
                val_tier = json.loads(storage.read_bytes(storage.join(self.run_dir, "data.json"))).get("val_tier")
            except (OSError, ValueError):
                val_tier = None
            self.info = describe(self.cfg, classes, val_tier)
            try:  # keep what an earlier start of this run exported (resume)
                self.info["weights"] = read_model_json(model_dir(self.run_dir)).get("weights", {})
            except (OSError, ValueError):
                pass
        return self.info

    def _write(self, which: str, model: Any, figures: dict[str, Any]) -> bool:
        from lightray.train.device import unwrap_model

        t0 = time.time()
        try:
            path = write_weights(self.run_dir, which, unwrap_model(model).state_dict(), self._info(), figures)
        except Exception as exc:  # noqa: BLE001 - any storage error: say it, keep training
            log.warning("export: could not write %s weights to %s (%s: %s); training goes on", which,
                        model_dir(self.run_dir), type(exc).__name__, exc)
            return False
        log.info("export: %s weights -> %s (%.2f s)", which, path, time.time() - t0)
        return True

    def on_validation(self, model: Any, val: dict[str, Any], epoch: int, samples_seen: int) -> bool:
        """Write best.safetensors when ``val`` beats the best so far (or none is written yet)."""
        top1 = float(val["val_top1"])
        if self.has_best and top1 <= self.best_top1:
            return False
        self.best_top1 = max(self.best_top1, top1)
        figures = {"val_top1": top1, "val_top5": val.get("val_top5"), "val_samples": val.get("val_samples"),
                   "epoch": epoch, "samples_seen": samples_seen}
        self.has_best = self._write("best", model, figures) or self.has_best
        return True

    def on_end(self, model: Any, last_val: dict[str, Any] | None, epoch: int, samples_seen: int) -> bool:
        """Write final.safetensors; ``last_val`` = the validation of these very weights, if there was one."""
        figures: dict[str, Any] = {"epoch": epoch, "samples_seen": samples_seen}
        if last_val:
            figures.update(val_top1=last_val.get("val_top1"), val_top5=last_val.get("val_top5"),
                           val_samples=last_val.get("val_samples"))
        return self._write("final", model, figures)
