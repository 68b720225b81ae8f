"""Reading the shard cache: ``<cache_root>/<key>/manifest.json`` (format pinned in docs/INTERFACES.md).

The manifest is written last by prepare, so its presence means every shard it lists was complete
when it was written; each shard's sha256 lets a reader check a copy before trusting it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightray import storage
from lightray.data.source import DataError, resolve_fs
from lightray.storage import join

MANIFEST = "manifest.json"
BAD_FILES = "bad_files.json"


@dataclass(frozen=True)
class ShardInfo:
    file: str  # name inside the manifest folder: "train-64-00000.parquet"
    rows: int
    sha256: str
    uri: str  # full path or URI, ready for pyarrow / Ray Data
    bytes: int = -1  # file size; -1 when the manifest does not record it


class Manifest:
    """A loaded manifest: classes, splits, tiers and the shard files of each (split, tier)."""

    def __init__(self, data: dict[str, Any], location: str):
        self.data = data
        self.location = location  # the manifest folder, local path or URI
        self._fs, self._path = resolve_fs(location)

    @classmethod
    def load(cls, dir_or_uri: str) -> Manifest:
        location = storage.normalise(str(dir_or_uri))
        if location.endswith("/" + MANIFEST) or location == MANIFEST:
            location = location[: -len(MANIFEST)].rstrip("/")
        fs, path = resolve_fs(location)
        target = f"{path}/{MANIFEST}"
        try:
            data = storage.read_json(target, fs=fs)
        except FileNotFoundError:
            raise DataError(f"{join(location, MANIFEST)}: not found; expected a shard cache written by prepare "
                            "(run `python app/run.py --prepare` or lightray.data.prepare.prepare)") from None
        except (OSError, ValueError) as exc:
            raise DataError(f"{join(location, MANIFEST)}: unreadable ({exc}); expected the JSON manifest "
                            "written by prepare; delete the folder to rebuild it") from None
        for k in ("key", "classes", "splits"):
            if k not in data:
                raise DataError(f"{join(location, MANIFEST)}: missing key {k!r}; expected a prepare manifest")
        return cls(data, location)

    # --- what is in it -----------------------------------------------------------------------
    @property
    def key(self) -> str:
        return self.data["key"]

    @property
    def source(self) -> str:
        return self.data.get("source", "")

    @property
    def classes(self) -> list[str]:
        return list(self.data["classes"])

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.data.get("params", {}))

    @property
    def splits(self) -> list[str]:
        return sorted(self.data["splits"])

    def _split(self, split: str) -> dict[str, Any]:
        try:
            return self.data["splits"][split]
        except KeyError:
            raise DataError(f"{join(self.location, MANIFEST)}: no split {split!r}; it has "
                            f"{', '.join(self.splits) or 'none'}") from None

    def _tier(self, split: str, tier: int | str) -> dict[str, Any]:
        tiers = self._split(split)["tiers"]
        try:
            return tiers[str(int(tier))]
        except (KeyError, ValueError):
            raise DataError(f"{join(self.location, MANIFEST)}: split {split!r} has no tier {tier!r}; it has "
                            f"{', '.join(sorted(tiers, key=int))}") from None

    def num_samples(self, split: str) -> int:
        return int(self._split(split)["num_samples"])

    @property
    def native_short_side(self) -> int | None:
        """The training images' median short side, over every image prepare read (else the probe's estimate;
        None for a cache built before either was kept)."""
        return self.data["splits"].get("train", {}).get("native_short_side") or self.data.get("native_probe")

    def tiers(self, split: str) -> list[int]:
        return sorted(int(t) for t in self._split(split)["tiers"])

    def format(self, split: str, tier: int | str) -> str:
        return self._tier(split, tier)["format"]

    def shards(self, split: str, tier: int | str) -> list[ShardInfo]:
        return [ShardInfo(s["file"], int(s["rows"]), s["sha256"], join(self.location, s["file"]),
                          int(s.get("bytes", -1)))
                for s in self._tier(split, tier)["shards"]]

    def tier_for(self, split: str, resolution: int) -> int:
        """The smallest stored tier at or above ``resolution`` (the largest if none is): least decode work."""
        tiers = self.tiers(split)
        return next((t for t in tiers if t >= resolution), tiers[-1])

    def bad_files(self) -> list[dict[str, Any]]:
        name = self.data.get("bad_files") or BAD_FILES
        try:
            return list(storage.read_json(f"{self._path}/{name}", fs=self._fs))
        except FileNotFoundError:
            return []

    # --- integrity ---------------------------------------------------------------------------
    def verify_shard(self, split: str, tier: int | str, shard: int | ShardInfo, path: str | None = None) -> bool:
        """True when the shard's bytes (at ``path``, e.g. a node-local copy, else its cache URI) hash to the
        manifest's sha256. A False shard must not be read; ``prepare(..., verify=True)`` rebuilds it."""
        info = shard if isinstance(shard, ShardInfo) else self.shards(split, tier)[shard]
        fs, target = resolve_fs(path) if path else (self._fs, f"{self._path}/{info.file}")
        try:
            return storage.sha256(target, fs=fs) == info.sha256
        except FileNotFoundError:
            return False


def find_manifest(cache_root: str, key: str) -> Manifest | None:
    """The manifest for cache key ``key`` under ``cache_root``, or None when it was never completed."""
    try:
        return Manifest.load(join(storage.normalise(cache_root), key))
    except DataError:
        return None
