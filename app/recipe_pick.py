"""The recipe for ``--data`` when no ``--config`` names one: picked from the data and the hardware.

A newcomer runs ``lightray train --data <their photos>``. The demo recipe (a tiny ResNet at 32-64 px) fits
neither CIFAR-sized photos nor ImageNet-sized ones, and the native-size rule only ever lowers a recipe's sizes.
So the run looks at what it was given, the way a practitioner would before choosing a recipe:

- the photos' native size: the median short side of 64 sampled image headers, the same probe prepare makes
  (kept beside the shard cache, so prepare reads it back instead of sampling again);
- how many training images and classes the source lists;
- the GPUs of this machine (``/proc/driver/nvidia/gpus``, read without importing torch: the driver forks its
  guardian after this), or ``scaling.use_gpu`` when the user set it.

It prints one line that says what it picked and why. The rules, first match wins:

| data | hardware | recipe |
|---|---|---|
| native size unknown (no image header read) | any | ``demo`` |
| native size at most 48 px (CIFAR-sized photos) | any | ``cifar10`` |
| at least 96 px and 300,000 images (ImageNet-sized) | GPUs | ``imagenet-rn18-16ep``, one worker a GPU |
| at least 96 px and 2,000 images | any | ``imagenette`` |
| anything else (few or mid-sized photos) | any | ``demo`` |

ImageNet-sized data on CPUs gets the ``imagenette`` recipe: on CPUs a full ImageNet budget is days, and the
ImageNet GPU recipes assume GPUs. A cluster that autoscales from zero has no GPU up when the driver starts, so
a run for GPU nodes names its recipe (``--config``) or sets ``--scaling.use_gpu=true``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

SMALL_PHOTOS = 48  # px, at or below: CIFAR-sized photos
IMAGENET_PHOTOS = 96  # px, at or above: photos with ImageNet's kind of detail
MIN_IMAGES = 2_000  # fewer: too few to train an ImageNet-style ResNet from scratch; the demo's small one
FULL_IMAGENET = 300_000  # at least: an ImageNet-scale budget, worth GPUs and the ImageNet recipes


@dataclass
class Pick:
    recipe: str
    overrides: dict[str, Any] = field(default_factory=dict)  # under the user's own: a key the user set wins
    reason: str = ""

    def line(self) -> str:
        return f"lightray: recipe {self.recipe} (no --config given): {self.reason}"


@dataclass
class DataFacts:
    native: int | None  # median short side, px
    images: int  # images of the train and val splits (a hold-out is drawn from them); -1: only known once read
    classes: int  # 0 when only known after reading (integer labels)


def gpus_here(use_gpu: str = "auto") -> int:
    """GPUs this machine has: the NVIDIA driver's device folders, narrowed by CUDA_VISIBLE_DEVICES.
    ``use_gpu`` "false" is 0 GPUs; "true" at least 1."""
    if use_gpu == "false":
        return 0
    try:
        found = len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        found = 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        found = min(found, len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"]))
    return max(found, 1) if use_gpu == "true" else found


def choose(facts: DataFacts, gpus: int) -> Pick:
    """The rules of the module's table, on facts already gathered."""
    size = f"{facts.native} px" if facts.native else "unknown size"
    count = f"{facts.images:,} training images" if facts.images >= 0 else "training images of unknown count"
    seen = f"{count} of {size}" + (f" in {facts.classes} classes" if facts.classes else "")
    hw = f"{gpus} GPU(s)" if gpus else f"no GPU, {os.cpu_count()} CPU cores"
    if facts.native is None:
        return Pick("demo", reason=f"{seen}: no image header could be read to size a recipe")
    if facts.native <= SMALL_PHOTOS:
        return Pick("cifar10", reason=f"{seen}: CIFAR-sized photos (at most {SMALL_PHOTOS} px), a VGG for 32 px")
    if facts.native >= IMAGENET_PHOTOS and facts.images >= FULL_IMAGENET and gpus:
        return Pick("imagenet-rn18-16ep", {"scaling.workers": str(gpus)},
                    reason=f"{seen}, {hw}: ImageNet-scale data on GPUs, ResNet-18 in 16 epochs, one worker a GPU")
    if facts.native >= IMAGENET_PHOTOS and (facts.images < 0 or facts.images >= MIN_IMAGES):
        why = "a ResNet-18 at 96-128 px for 5 epochs"
        if facts.images >= FULL_IMAGENET:
            why += " (the ImageNet recipes need GPUs)"
        return Pick("imagenette", reason=f"{seen}, {hw}: ImageNet-style photos, {why}")
    return Pick("demo", reason=f"{seen}: fewer than {MIN_IMAGES:,} images or smaller than {IMAGENET_PHOTOS} px, "
                             "the demo's small ResNet at up to 64 px")


def facts_of(cfg: Any) -> DataFacts:
    """List ``cfg.data.source`` and probe its native size (kept beside the run's shard cache, as prepare keeps
    it). Input errors are the listing's DataErrors, naming the path."""
    from lightray.data.prepare import native_size_of, resolve_cache_root
    from lightray.data.source import run_val_fraction
    from lightray.data.sources import list_source

    source = cfg.data.source
    # The listing prepare makes (same hold-out, same fingerprint), so the probe it keeps is the one prepare reads.
    listing = list_source(source, run_val_fraction(source, cfg.data.val_fraction), cfg.data.val_seed,
                          cfg.data.val_fraction > 0)
    images = sum(max(listing.num_files(s), 0) for s in ("train", "val")) if listing.num_files("train") >= 0 else -1
    return DataFacts(native_size_of(listing, resolve_cache_root(cfg)), images, len(listing.classes))


def pick_recipe(cfg: Any) -> Pick:
    """The recipe for ``cfg``'s source (``cfg`` is the default recipe with the user's overrides)."""
    return choose(facts_of(cfg), gpus_here(cfg.scaling.use_gpu))
