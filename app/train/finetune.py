"""Fine-tuning: start from pretrained weights (``model.pretrained``) and warm up the new head alone.

``model.pretrained`` names one of:
- a weights file: ``.safetensors``, or a torch state dict (``.pt``/``.pth``/``.bin``, loaded with
  ``weights_only=True``: a file cannot run code); local or a pyarrow URI (s3://...);
- a lightray run folder (its ``model/best.safetensors``) or its ``model/`` folder;
- a hub name: ``timm:<name>``, a torchvision model name, or ``hub`` for the architecture's own name
  (downloads: needs the network).

Every tensor whose name and shape match is copied; the classifier head is left freshly initialised
when the class count differs (its shape does not match). Fewer than half the tensors matching means the
weights belong to another architecture: that is an error, not a silent random start.

``model.head_warmup_epochs`` (a unit that can be switched off, and logs what it did): for that many
epochs only the head's parameters step; the backbone's gradients are dropped before the optimizer step,
so a random head cannot wreck the pretrained features with large early gradients.
"""

from __future__ import annotations

import io
import logging
import os
from typing import Any

import torch
from torch import nn

from lightray import storage
from lightray.config import ConfigError

log = logging.getLogger("lightray.finetune")
WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt")


def _unwrap_state(obj: Any, where: str) -> dict[str, torch.Tensor]:
    """A state dict from a loaded file: plain, or nested under a usual key; wrapper prefixes stripped."""
    for key in ("state_dict", "model", "model_state_dict", "module"):
        if isinstance(obj, dict) and key in obj and isinstance(obj[key], dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not any(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ConfigError(f"model.pretrained: {where} holds no state dict of tensors")
    out = {}
    for k, v in obj.items():
        if not isinstance(v, torch.Tensor):
            continue
        for prefix in ("module.", "_orig_mod."):  # DDP / torch.compile wrappers
            while k.startswith(prefix):
                k = k[len(prefix):]
        out[k] = v
    return out


def read_weights_file(uri: str) -> dict[str, torch.Tensor]:
    """A safetensors file or a torch state dict (``weights_only=True``), local path or URI."""
    try:
        data = storage.read_bytes(uri)
    except (OSError, FileNotFoundError) as exc:
        raise ConfigError(f"model.pretrained: cannot read {uri} ({exc})") from None
    if uri.split("?")[0].endswith(".safetensors") or data[8:9] == b"{":  # safetensors: u64 length + JSON header
        from lightray.train.export import state_from_bytes

        try:
            return state_from_bytes(data)
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            if uri.split("?")[0].endswith(".safetensors"):
                raise ConfigError(f"model.pretrained: {uri} is not a valid safetensors file ({exc})") from None
    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - pickle errors come in many types
        raise ConfigError(f"model.pretrained: {uri} is neither safetensors nor a torch state dict loadable with "
                          f"weights_only=True ({type(exc).__name__}: {str(exc)[:200]})") from None
    return _unwrap_state(obj, uri)


def _hub_state(name: str, arch: str) -> dict[str, torch.Tensor]:
    """Weights of a hub model: ``timm:<name>`` from the Hugging Face hub, else torchvision's DEFAULT weights."""
    if name == "hub":
        name = arch
    try:
        if name.startswith("timm:"):
            import timm

            return timm.create_model(name[len("timm:"):], pretrained=True).state_dict()
        import torchvision

        return torchvision.models.get_model(name, weights="DEFAULT").state_dict()
    except Exception as exc:  # noqa: BLE001 - download / unknown-name errors from two libraries
        raise ConfigError(f"model.pretrained: could not fetch hub weights {name!r} ({type(exc).__name__}: "
                          f"{str(exc)[:200]}); this needs the network (offline: give a weights file or a lightray "
                          "run folder instead)") from None


def resolve_pretrained(spec: str) -> tuple[str, str]:
    """(kind, location): kind ``file`` (a weights file) or ``hub`` (a name to download)."""
    if spec.endswith(WEIGHT_SUFFIXES) or spec.split("?")[0].endswith(WEIGHT_SUFFIXES):
        if not storage.exists(spec):
            raise ConfigError(f"model.pretrained: file {spec} not found")
        return "file", spec
    if "://" in spec or os.path.sep in spec or os.path.exists(spec):
        for rel in (("model", "best.safetensors"), ("best.safetensors",), ("model", "final.safetensors"),
                    ("final.safetensors",)):
            cand = storage.join(spec, *rel)
            if storage.exists(cand):
                return "file", cand
        raise ConfigError(f"model.pretrained: {spec} is neither a weights file nor a lightray run or model folder "
                          "(no model/best.safetensors in it)")
    return "hub", spec


def load_pretrained(model: nn.Module, spec: str, arch: str = "") -> dict[str, Any]:
    """Copy the matching tensors of ``spec``'s weights into ``model``; returns what was loaded and skipped."""
    kind, where = resolve_pretrained(spec)
    state = read_weights_file(where) if kind == "file" else _hub_state(where, arch)
    own = model.state_dict()
    loaded, reshaped = [], []
    new = {}
    for k, v in own.items():
        src = state.get(k)
        if src is None:
            continue
        if tuple(src.shape) != tuple(v.shape):
            reshaped.append(f"{k} {tuple(src.shape)}->{tuple(v.shape)}")
            continue
        new[k] = src.to(v.dtype)
        loaded.append(k)
    floats = [k for k, v in own.items() if v.is_floating_point()]
    matched = sum(1 for k in loaded if k in set(floats))
    if matched < 0.5 * max(1, len(floats)):
        raise ConfigError(f"model.pretrained: {where} matches only {matched} of {len(floats)} weight tensors of "
                          f"{arch or type(model).__name__}; are these weights for another architecture?")
    model.load_state_dict(new, strict=False)
    head = ", ".join(reshaped) if reshaped else "none"
    from lightray.units import unit_log

    unit_log("pretrained", f"loaded {len(loaded)}/{len(own)} tensors from {where}; left at their fresh init "
                           f"(shape differs, e.g. a head for another class count): {head}",
             loaded=len(loaded), total=len(own), reinitialised=len(reshaped), source=where)
    return {"source": where, "loaded": loaded, "reinitialised": reshaped}


def head_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The classifier head's parameters: timm's ``get_classifier()``, else the last Linear layer."""
    get = getattr(model, "get_classifier", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Module) or not list(head.parameters()):
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        head = linears[-1] if linears else None
    return list(head.parameters()) if head is not None else []


class HeadWarmup:
    """For the first ``epochs`` epochs only the head steps: backbone gradients are dropped before each step.

    Dropped means ``grad = None``: the optimizers skip such parameters entirely (no momentum, no weight
    decay), exactly as if they were frozen, while DDP and the communication hooks run unchanged."""

    def __init__(self, model: nn.Module, epochs: float, train_size: int, pretrained: str):
        self.until = int(round(epochs * train_size))
        head = {id(p) for p in head_parameters(model)}
        self.backbone = [p for p in model.parameters() if id(p) not in head]
        self.active = epochs > 0 and bool(head)
        self.done = False
        from lightray.units import unit_log

        if epochs <= 0:
            unit_log("head_warmup", "off (model.head_warmup_epochs=0): every layer trains from the start",
                     enabled=False)
        elif not head:
            unit_log("head_warmup", "not applicable: no classifier head found; every layer trains", enabled=False)
        else:
            if not pretrained:
                log.warning("model.head_warmup_epochs=%g without model.pretrained: the backbone is random too",
                            epochs)
            unit_log("head_warmup", f"only the head ({len(head)} tensors) trains for the first {epochs:g} epochs "
                                    f"({self.until} samples); then every layer", enabled=True, until=self.until)

    def before_step(self, samples_seen: int) -> bool:
        """Drop the backbone's gradients while in the warm-up; True when it did."""
        if not self.active or samples_seen >= self.until:
            return False
        for p in self.backbone:
            p.grad = None
        return True
