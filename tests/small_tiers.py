"""A small prepared demo cache (3 classes, 48 train + 6 val images, one 64 px tier) on the session's Ray
cluster, for the device-path tests: ``raw_max_resolution`` picks how the tier is stored (64: decoded
pixels, for device augmentation; 0: JPEG, for device decode)."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

from lightray.data.demo import generate_demo
from lightray.data.ingest import IngestSpec, PhaseSpec, tier_shards
from lightray.data.manifest import Manifest
from lightray.data.prepare import prepare
from tests.conftest import start_session_ray

TIER = 64


def prepared_tier(root: pathlib.Path, raw_max_resolution: int) -> Iterator[Manifest]:
    """Yields the manifest with Ray up (tests read the shards through Ray Data)."""
    start_session_ray()
    src = generate_demo(root / "src", num_classes=3, train_per_class=16, val_per_class=2, processes=1)
    yield Manifest.load(str(prepare(str(src), str(root / "cache"), [TIER], raw_max_resolution=raw_max_resolution,
                                    shard_rows=16)))


def one_phase_spec(manifest: Manifest, local_dir: str, resolution: int) -> IngestSpec:
    """An ingest spec of one training phase (batch 16, crop scale 0.25, epochs 0-2) at ``resolution`` from the
    tier, validation at the same size: what the device-path tests plan their placement on."""
    return IngestSpec(seed=5, local_dir=local_dir, train_size=manifest.num_samples("train"),
                      phases=[PhaseSpec(0, resolution, 16, 0.25, 0, 2, tier_shards(manifest, "train", TIER))],
                      val=tier_shards(manifest, "val", TIER), eval_resolution=resolution, val_crop_ratio=0.875)
