"""Start-up work done once per experiment and handed to every trial: the prepared data, the decoded tiers
in the object store and the preprocessing calibration.

Without it each trial repeats them: it checks the shard cache, decodes the tiers it reads into the object
store (one more copy per concurrent trial) and, on data big enough to time, calibrates its preprocessing
while other trials load the machine (so the answer is skewed as well as late). With it the experiment's
driver does each once, before the first trial: ``build_shared`` prepares, builds the trials' base ingest
spec (which materialises the tiers and calibrates), and keeps the object refs. The trials get a
``SharedStart``: the manifest location (no prepare), the refs of each decoded tier by its shards' sha256
(no decode) and the calibrated preprocessing knobs pinned in their config (no calibration). The refs are
owned by the driver, so they live as long as the experiment does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightray.config import Config


@dataclass
class SharedStart:
    manifest: str  # the prepared manifest's location (``Manifest.load`` reads it)
    tier_refs: dict[str, list] = field(default_factory=dict)  # tier key (shard sha256s) -> decoded shard refs
    preprocess: dict[str, Any] = field(default_factory=dict)  # data.* keys pinned from the one calibration

    def describe(self) -> str:
        pinned = ", ".join(f"{k}={v}" for k, v in self.preprocess.items()) or "none (calibration off)"
        return (f"  shared start-up: data prepared once, {len(self.tier_refs)} decoded tier(s) in the object "
                f"store, preprocessing pinned: {pinned}")


def build_shared(trial_base: Config) -> SharedStart:
    """Prepare, materialise and calibrate once for ``trial_base`` (Ray must be up); see the module doc."""
    import ray

    from lightray.data.ingest import tier_key
    from lightray.data.manifest import Manifest
    from lightray.data.prepare import prepare_main
    from lightray.driver.runner import build_ingest_spec

    location = str(prepare_main(trial_base))
    spec, _ = build_ingest_spec(trial_base, Manifest.load(location))
    refs: dict[str, list] = {}
    for tier in [ph.shards for ph in spec.phases] + [spec.val]:
        if tier.refs is not None:
            refs[tier_key(tier.sha256)] = tier.refs
    flat = [r for group in refs.values() for r in group]
    if flat:  # decoded before the first trial; the pixels stay in the object store (not fetched here)
        ray.wait(flat, num_returns=len(flat), fetch_local=False)
    preprocess: dict[str, Any] = {}
    if spec.map_concurrency:  # calibrated (or pinned): every trial uses the same answer
        preprocess = {"data.preprocess_concurrency": int(spec.map_concurrency),
                      "data.preprocess_cpus": float(spec.map_cpus), "data.block_rows": int(spec.block_rows)}
    return SharedStart(manifest=location, tier_refs=refs, preprocess=preprocess)
