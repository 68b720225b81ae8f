"""Use a trained model without Ray: load it, score a labelled folder, classify images.

``load_model(run)`` returns the torch module (eval mode) and the transform that turns an image into
the input the run validated with: the image decoded upright to RGB, its short side resized to the size
the run stored its val images at, then the run's centre crop (eval resolution, crop ratio) or, when the
run validated with ``data.val_mode=rect``, a resize that keeps the aspect ratio; normalised with the
ImageNet mean/std as in training.

``evaluate_folder(run)`` with no data scores the run's own val split from its shard cache (the very
pixels the run validated on, so it reproduces the run's top-1 exactly); with a folder it scores
``<folder>/val/<class>/*`` or ``<folder>/<class>/*`` decoded with the same transform.
"""

from __future__ import annotations

import copy
import json
import logging
import pathlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

from lightray import storage
from lightray.data import augment, images
from lightray.train import device as dev
from lightray.train.export import MODEL_DIR, MODEL_JSON, state_from_bytes
from lightray.train.shift import tta_logits

log = logging.getLogger("lightray.inference")
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class ModelNotFound(FileNotFoundError):
    """No exported model at the given place; ``str(err)`` says where it looked."""


# --- preprocessing ----------------------------------------------------------------------------------
@dataclass
class EvalTransform:
    """Image -> normalised float CHW tensor, as the run's validation prepared it."""

    size: int
    crop_ratio: float = 0.875
    mode: str = "center"  # center | rect
    resize_short: int | None = None  # short side the val images were stored at; None = decode at full size
    mean: tuple[float, float, float] = dev.IMAGENET_MEAN
    std: tuple[float, float, float] = dev.IMAGENET_STD

    def load(self, src: str | bytes | pathlib.Path | Image.Image) -> Image.Image:
        """Upright RGB with the short side at ``resize_short``; raises images.BadImage for unusable data."""
        if isinstance(src, Image.Image):
            img = src if src.mode == "RGB" else src.convert("RGB")
            return images.resize_short(img, self.resize_short) if self.resize_short else img
        data = src if isinstance(src, bytes) else storage.read_bytes(str(src))
        return images.decode_rgb(data, self.resize_short)

    def rect_shape(self, aspect: float) -> tuple[int, int]:
        return augment.rect_target(aspect, self.size)

    def pixels(self, img: Image.Image, shape: tuple[int, int] | None = None) -> np.ndarray:
        """uint8 HWC: the centre crop, or the aspect-keeping rectangle (``shape`` = (w, h) of its batch)."""
        if self.mode == "rect":
            w, h = shape or self.rect_shape(img.width / img.height)
            return augment.rect_crop(img, w, h)
        return augment.center_crop(img, self.size, self.crop_ratio)

    def normalise(self, batch: np.ndarray, device: torch.device | str = "cpu",
                  channels_last: bool = False) -> torch.Tensor:
        """uint8 NHWC batch -> normalised float NCHW on ``device`` (the training path's own function)."""
        batch = np.ascontiguousarray(batch)
        if not batch.flags.writeable:  # a view of a PIL image's buffer; torch wants to own writable memory
            batch = batch.copy()
        return dev.images_to_device(torch.from_numpy(batch), torch.device(device),
                                    channels_last, mean=self.mean, std=self.std)

    def __call__(self, src: str | bytes | pathlib.Path | Image.Image) -> torch.Tensor:
        return self.normalise(self.pixels(self.load(src))[None])[0]


# --- loading ------------------------------------------------------------------------------------------
@dataclass
class LoadedModel:
    model: nn.Module
    transform: EvalTransform
    classes: list[str]
    info: dict[str, Any]
    folder: str  # the model folder (``<run>/model``)
    weights: str
    device: torch.device
    precision: str = "fp32"
    channels_last: bool = False
    tta_flip: bool = False
    tta_translate: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @torch.no_grad()
    def logits(self, batch: np.ndarray) -> torch.Tensor:
        """Float logits (on CPU) of a uint8 NHWC batch, computed as the run's validation computed them."""
        x = self.transform.normalise(batch, self.device, self.channels_last)
        with dev.autocast(self.precision, self.device):
            out = tta_logits(self.model, x, self.tta_flip, self.tta_translate)
        return out.cpu()


def find_model_dir(run_or_model_dir: str) -> str:
    """``<run>/model`` for a run folder, or the folder itself when it holds model.json."""
    src = str(run_or_model_dir)
    for cand in (storage.join(src, MODEL_DIR), src):
        if storage.exists(storage.join(cand, MODEL_JSON)):
            return cand
    raise ModelNotFound(f"{src}: no exported model ({MODEL_DIR}/{MODEL_JSON} not found); expected a lightray run "
                        "folder that trained at least one epoch, or its model/ folder")


def _pick_device(device: str | torch.device | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def open_model(run_or_model_dir: str, weights: str = "best", device: str | torch.device | None = "auto"
               ) -> LoadedModel:
    """Load an exported model (no Ray): the module in eval mode, its transform, classes and model.json."""
    from lightray.config import config_from_dict
    from lightray.train.model import build_model

    if weights not in ("best", "final"):
        raise ValueError(f"weights: bad value {weights!r}; expected best or final")
    folder = find_model_dir(run_or_model_dir)
    info = json.loads(storage.read_bytes(storage.join(folder, MODEL_JSON)))
    entry = info.get("weights", {}).get(weights)
    if not entry:
        have = ", ".join(sorted(info.get("weights", {}))) or "none"
        raise ModelNotFound(f"{folder}: no {weights} weights exported (have: {have})")
    cfg = config_from_dict(info["config"])
    mcfg = copy.copy(cfg.model)
    mcfg.pretrained = ""  # the exported file holds every weight; nothing to fetch
    model = build_model(mcfg, int(info["num_classes"]))
    state = state_from_bytes(storage.read_bytes(storage.join(folder, entry["file"])))
    model.load_state_dict(state, strict=True)
    dev_ = _pick_device(device)
    model = model.to(dev_).eval()
    channels_last = bool(info.get("channels_last", False))
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    try:
        precision = dev.precision_for(mcfg, dev_)
    except Exception:  # noqa: BLE001 - e.g. fp16 asked for on a CPU: score in fp32
        precision = "fp32"
    norm = info.get("normalize", {})
    transform = EvalTransform(size=int(info["eval_resolution"]), crop_ratio=float(info["crop_ratio"]),
                              mode=info.get("val_mode", "center"), resize_short=info.get("resize_short"),
                              mean=tuple(norm.get("mean", dev.IMAGENET_MEAN)),
                              std=tuple(norm.get("std", dev.IMAGENET_STD)))
    model.classes = list(info["classes"])  # so that five lines can print a label
    return LoadedModel(model, transform, list(info["classes"]), info, folder, weights, dev_, precision,
                       channels_last, bool(info.get("tta_flip", False)), int(info.get("tta_translate", 0)))


def load_model(run_or_model_dir: str, weights: str = "best", device: str | torch.device | None = "cpu"
               ) -> tuple[nn.Module, EvalTransform]:
    """(torch module in eval mode, preprocessing transform) of a run's exported model; no Ray needed.

    ``model.classes`` holds the class names: ``model(transform(path)[None]).argmax(1)`` indexes them."""
    loaded = open_model(run_or_model_dir, weights, device)
    return loaded.model, loaded.transform


# --- sources of labelled images ---------------------------------------------------------------------
@dataclass
class Item:
    name: str
    label: int  # -1 when unknown (predict)
    load: Callable[[], Image.Image]  # raises images.BadImage / OSError for an unusable file


def _list_files(root: str) -> list[str]:
    """Image files under a local folder or URI, recursively, sorted."""
    from pyarrow import fs as pafs

    fs, path = storage.resolve_fs(root)
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    files = sorted(i.path for i in infos if i.type == pafs.FileType.File and i.base_name.lower().endswith(
        IMAGE_EXTENSIONS) and not i.base_name.startswith("."))
    if "://" in root:
        scheme = root.split("://", 1)[0]
        query = root.partition("?")[2]
        return [f"{scheme}://{f}" + (f"?{query}" if query else "") for f in files]
    return files


def folder_items(data: str, classes: list[str], transform: EvalTransform) -> list[Item]:
    """``<data>/val/<class>/*`` or ``<data>/validation/<class>/*`` (an ImageFolder tree with splits) or
    ``<data>/<class>/*``; class folders are matched to the model's classes by name."""
    from lightray.data.source import SPLIT_FOLDERS

    info = storage.file_info(data)
    if info.type == storage.FileType.NotFound:
        raise FileNotFoundError(f"--data: {data} not found")
    vals = [storage.join(data, d) for d in SPLIT_FOLDERS["val"]]
    root = next((v for v in vals if storage.file_info(v).type == storage.FileType.Directory), data)
    subdirs = [i.base_name for i in storage.list_dir(root, detail=True)
               if i.type == storage.FileType.Directory and not i.base_name.startswith(".")]
    unknown = [d for d in subdirs if d not in classes]
    if not subdirs or unknown:
        raise FileNotFoundError(f"--data: {root} must hold one folder per class named as the model's classes "
                                f"({', '.join(classes[:5])}{', ...' if len(classes) > 5 else ''}); "
                                f"{'found none' if not subdirs else 'unknown: ' + ', '.join(unknown[:5])}")
    index = {c: i for i, c in enumerate(classes)}
    return [Item(f, index[d], (lambda f=f: transform.load(f)))
            for d in subdirs for f in _list_files(storage.join(root, d))]


def source_items(data: str, classes: list[str], transform: EvalTransform) -> list[Item]:
    """Labelled images of any source kind training takes (app/data/labelled.py): class folders, Parquet or tars."""
    from lightray.data.labelled import row_items
    from lightray.data.source import detect_kind

    if detect_kind(data) == "imagefolder":
        return folder_items(data, classes, transform)
    return row_items(data, classes, Item, transform.load)


def run_val_items(folder: str, info: dict[str, Any]) -> list[Item]:
    """The run's own val split, read from the shard cache it trained from (data.json names it)."""
    from lightray.data.manifest import Manifest
    from lightray.data.shard_cache import ParquetShard, read_columns
    from lightray.data.source import DataError

    run_dir = folder.rstrip("/").rpartition("/")[0] if folder.rstrip("/").endswith("/" + MODEL_DIR) else folder
    try:
        data = json.loads(storage.read_bytes(storage.join(run_dir, "data.json")))
        manifest = Manifest.load(data["manifest"])
    except (OSError, ValueError, KeyError, DataError) as exc:
        raise FileNotFoundError(f"{run_dir}: the run's val split is not readable ({exc}); pass --data PATH with a "
                                "folder of labelled images") from None
    tier = int(data.get("val_tier") or info.get("resize_short"))
    fmt = manifest.format("val", tier)
    out: list[Item] = []
    for shard in manifest.shards("val", tier):
        table = read_columns(shard.uri, ["image", "label", "sample_id", "height", "width", "path"])
        view = ParquetShard(table, fmt)
        paths = table.column("path").to_pylist()
        for r in range(len(view)):
            out.append(Item(paths[r], int(view.labels[r]), (lambda v=view, r=r: v.image(r))))
    return out


# --- scoring ------------------------------------------------------------------------------------------
def _batches(loaded: LoadedModel, items: list[Item], batch_size: int, skipped: list[dict[str, str]]
             ) -> Iterator[tuple[list[Item], np.ndarray]]:
    """(items, uint8 NHWC batch) in groups the model can take at once; unreadable items go to ``skipped``.

    Rectangular mode: sorted by aspect ratio and cut into batches of the run's val batch size, each at one
    rectangle near its mean aspect, exactly as the run's rectangular validation did."""
    tf = loaded.transform

    def opened(group: Iterable[Item]) -> Iterator[tuple[Item, Image.Image]]:
        for it in group:
            try:
                yield it, it.load()
            except (images.BadImage, OSError, ValueError) as exc:
                skipped.append({"path": it.name, "error": getattr(exc, "reason", None) or str(exc)})

    if tf.mode != "rect":
        for lo in range(0, len(items), batch_size):
            pairs = list(opened(items[lo:lo + batch_size]))
            if pairs:
                yield [p[0] for p in pairs], np.stack([tf.pixels(img) for _, img in pairs])
        return
    pairs = list(opened(items))
    aspect = np.array([img.width / img.height for _, img in pairs], dtype=np.float64)
    order = np.argsort(aspect, kind="stable")
    per = int(loaded.info.get("val_batch_size") or batch_size)
    for s in range(0, len(order), per):
        idx = order[s:s + per]
        shape = tf.rect_shape(float(aspect[idx].mean()))
        for lo in range(0, len(idx), batch_size):
            part = idx[lo:lo + batch_size]
            yield [pairs[i][0] for i in part], np.stack([tf.pixels(pairs[i][1], shape) for i in part])


def evaluate_folder(run: str, data: str | None = None, weights: str = "best", device: str | None = "auto",
                    batch_size: int = 64, out: str | None = None) -> dict[str, Any]:
    """Top-1, top-5 and per-class accuracy of ``run``'s model on labelled images; writes eval.json.

    ``data`` None: the run's own val split (exactly the pixels the run validated on). ``out``: where to
    write eval.json (default ``<run>/eval.json``; "" = do not write)."""
    loaded = open_model(run, weights, device)
    items = run_val_items(loaded.folder, loaded.info) if data is None else \
        source_items(data, loaded.classes, loaded.transform)
    k = min(5, len(loaded.classes))
    per_n = np.zeros(len(loaded.classes), np.int64)
    per_hit = np.zeros(len(loaded.classes), np.int64)
    n = top1 = top5 = 0
    preds: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    for group, batch in _batches(loaded, items, batch_size, skipped):
        logits = loaded.logits(batch)
        probs = logits.softmax(1)
        topk = logits.topk(k, dim=1).indices
        for it, row, p in zip(group, topk.tolist(), probs):
            n += 1
            per_n[it.label] += 1
            hit1 = row[0] == it.label
            top1 += hit1
            top5 += it.label in row
            per_hit[it.label] += hit1
            preds.append({"path": it.name, "label": loaded.classes[it.label], "pred": loaded.classes[row[0]],
                          "prob": round(float(p[row[0]]), 6)})
    if n == 0:
        raise FileNotFoundError(f"no image could be scored ({len(skipped)} unreadable)")
    result = {
        "run": str(run), "weights": weights, "data": data or "the run's val split", "images": n,
        "top1": top1 / n, "top5": top5 / n,
        "per_class": {c: {"images": int(per_n[i]), "top1": (float(per_hit[i] / per_n[i]) if per_n[i] else None)}
                      for i, c in enumerate(loaded.classes)},
        "exported_val_top1": loaded.info["weights"][weights].get("val_top1"),
        "preprocess": {"mode": loaded.transform.mode, "size": loaded.transform.size,
                       "crop_ratio": loaded.transform.crop_ratio, "resize_short": loaded.transform.resize_short},
        "device": str(loaded.device), "precision": loaded.precision, "unreadable": skipped, "predictions": preds,
    }
    if out is None:
        base = loaded.folder.rstrip("/")
        out = storage.join(base.rpartition("/")[0] if base.endswith("/" + MODEL_DIR) else base, "eval.json")
    if out:
        storage.write_bytes(out, json.dumps(result, indent=1).encode())
        result["written"] = out
    return result


def predict(run: str, inputs: list[str], top: int = 5, weights: str = "best", device: str | None = "auto",
            batch_size: int = 32) -> list[dict[str, Any]]:
    """Top-``top`` labels with probabilities for each image (directories are searched recursively).

    Each result is ``{"path", "top": [{"label", "prob"}, ...]}`` or, for a file that could not be read or
    decoded, ``{"path", "error"}``: one bad file never stops the others."""
    loaded = open_model(run, weights, device)
    files: list[str] = []
    from pyarrow import fs as pafs

    for src in inputs:
        try:
            fs, path = storage.resolve_fs(src)
            kind = fs.get_file_info(path).type
        except (OSError, ValueError):
            kind = pafs.FileType.NotFound
        files.extend(_list_files(src) if kind == pafs.FileType.Directory else [src])
    items = [Item(f, -1, (lambda f=f: loaded.transform.load(f))) for f in files]
    skipped: list[dict[str, str]] = []
    scored: dict[str, list[dict[str, Any]]] = {}
    k = max(1, min(top, len(loaded.classes)))
    if loaded.transform.mode == "rect":  # each image at the rectangle of its own aspect
        groups = (([it], loaded.transform.pixels(img)[None]) for it, img in _opened_one(items, skipped))
    else:
        groups = _batches(loaded, items, batch_size, skipped)
    for group, batch in groups:
        probs = loaded.logits(batch).softmax(1)
        vals, idx = probs.topk(k, dim=1)
        for it, v, i in zip(group, vals.tolist(), idx.tolist()):
            scored[it.name] = [{"label": loaded.classes[c], "prob": round(p, 6)} for p, c in zip(v, i)]
    errors = {s["path"]: s["error"] for s in skipped}
    return [{"path": f, "top": scored[f]} if f in scored else {"path": f, "error": errors.get(f, "not scored")}
            for f in files]


def _opened_one(items: list[Item], skipped: list[dict[str, str]]) -> Iterator[tuple[Item, Image.Image]]:
    for it in items:
        try:
            yield it, it.load()
        except (images.BadImage, OSError, ValueError) as exc:
            skipped.append({"path": it.name, "error": getattr(exc, "reason", None) or str(exc)})


def classify(run: str, image: str | bytes | Image.Image, weights: str = "best") -> tuple[str, float]:
    """(label, probability) of one image: the shortest path from a run to an answer."""
    model, transform = load_model(run, weights)
    with torch.no_grad():
        probs = model(transform(image)[None]).softmax(1)[0]
    i = int(probs.argmax())
    return model.classes[i], float(probs[i])
