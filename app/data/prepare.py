"""Prepare: source images -> the content-addressed, resumable shard cache read by ingest.

Layout (docs/INTERFACES.md, "Shard cache")::

    <cache_root>/<key>/manifest.json                  written last: its presence means "complete"
    <cache_root>/<key>/bad_files.json                 files skipped, with the reason
    <cache_root>/<key>/<split>-<tier>-<j:05d>.parquet  shard j of a split at one tier
    <cache_root>/<key>/_progress/<split>-<j:05d>.json  per-shard sidecar: files, rows, sha256, bad files

``key`` = sha256(source listing (paths, sizes, mtimes) + every preprocessing parameter), so a rerun
with the same inputs finds the finished manifest and does nothing, and any change gets a fresh folder.

Work: one Ray Data task per shard (``shard_rows`` entries of the listing, in a seeded mix). The driver
holds the listing as columns and the shard order as one integer array; a unit carries a range of that
order, and its task takes its files from the listing table, put once in the object store. The task
reads each source file once, decodes it once (JPEG draft mode for the largest tier), derives the
smaller tiers from that image, and writes one Parquet file per tier. Because one task writes every tier
of a shard, row i of shard j is the same sample at every tier. Each file is written to a temp name and
renamed; the sidecar, written after the files, records their sha256. An interrupted prepare keeps every
shard with a sidecar and builds only the rest next time. Tasks ask for fractional CPUs, so a cluster
that also runs Train workers is never starved (ray#44687).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import pathlib
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from lightray import storage
from lightray.data import images, mix, native, remix, sources_parquet, sources_webdataset
from lightray.data.manifest import BAD_FILES, MANIFEST, Manifest
from lightray.data.mix import SHARD_MIX_SEED, shard_order
from lightray.data.shard_cache import default_local_dir
from lightray.data.shard_files import PROGRESS_DIR, parquet_bytes, shard_file
from lightray.data.source import DataError, SourceListing, resolve_fs, run_val_fraction
from lightray.data.sources import list_source
from lightray.data.sources_rows import RowListing
from lightray.storage import is_uri, join

if TYPE_CHECKING:
    from lightray.config import Config

log = logging.getLogger("lightray.prepare")
FORMAT_VERSION = 2  # bump when the shard bytes change for the same inputs (forces new cache keys)
MIN_TIER, MAX_TIER = 8, 4096


# --- parameters and key ------------------------------------------------------------------------
def tier_format(tier: int, raw_max_resolution: int) -> str:
    """Small tiers store raw pixels (no decode cost when read; they fit in memory); larger ones JPEG."""
    return "raw" if tier <= raw_max_resolution else "jpeg"


def _check_params(tiers: list[int], jpeg_quality: int, raw_max_resolution: int, shard_rows: int,
                  limit: dict[str, int] | None, splits: list[str]) -> list[int]:
    if not tiers:
        raise DataError("tiers: bad value []; expected at least one short-side size in pixels (e.g. [64, 128])")
    out = []
    for t in tiers:
        if isinstance(t, bool) or not isinstance(t, int) or not MIN_TIER <= t <= MAX_TIER:
            raise DataError(f"tiers: bad value {t!r}; expected integers in {MIN_TIER}..{MAX_TIER} px")
        out.append(int(t))
    if not 1 <= int(jpeg_quality) <= 100:
        raise DataError(f"jpeg_quality: bad value {jpeg_quality!r}; expected 1..100")
    if int(raw_max_resolution) < 0:
        raise DataError(f"raw_max_resolution: bad value {raw_max_resolution!r}; expected >= 0 px")
    if int(shard_rows) < 1:
        raise DataError(f"shard_rows: bad value {shard_rows!r}; expected >= 1")
    for split, n in (limit or {}).items():
        if split not in ("train", "val"):
            raise DataError(f"limit: bad key {split!r}; expected 'train' or 'val'")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise DataError(f"limit[{split!r}]: bad value {n!r}; expected an integer >= 0 (0 = all)")
    return sorted(set(out))


def cache_key(listing: SourceListing | RowListing, params: dict[str, Any]) -> str:
    """sha256 of the listing fingerprint and the canonical JSON of every preprocessing parameter."""
    h = hashlib.sha256()
    h.update(listing.fingerprint().encode())
    h.update(json.dumps(params, sort_keys=True, separators=(",", ":")).encode())
    return h.hexdigest()


def selected_ids(n: int, k: int) -> np.ndarray:
    """Listing indices of the entries a limit of ``k`` takes (0 = all): evenly spaced, so every class stays
    represented (the first k of a sorted listing would be one class), and sample ids stay listing indices."""
    if k and k < n:
        return np.arange(k, dtype=np.int64) * n // k
    return np.arange(n, dtype=np.int64)


def _unit_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}"


# --- the per-shard task (runs in Ray Data workers) ---------------------------------------------
def _read_or_reason(fs: pafs.FileSystem, path: str, expected_size: int) -> tuple[bytes | None, str]:
    last = ""
    for _ in range(2):  # one retry: a transient object-store error should not mark a good image bad forever
        try:
            data = storage.read_bytes(path, fs=fs)
        except FileNotFoundError:
            return None, "file disappeared after the listing"
        except OSError as exc:
            last = f"unreadable ({exc})"
            continue
        if len(data) != expected_size:
            return None, f"changed since the listing ({expected_size} bytes listed, {len(data)} read)"
        return data, ""
    return None, last


def build_shard(unit: dict[str, Any]) -> dict[str, Any]:
    """Build every tier of one shard and its sidecar; returns the sidecar (see the module docstring)."""
    split, index = unit["split"], int(unit["index"])
    tiers = sorted(unit["tiers"], reverse=True)
    formats = {int(t): f for t, f in unit["formats"].items()}
    src_fs, src_base = resolve_fs(unit["source"])
    out_fs, out_base = resolve_fs(unit["out_dir"])
    base = {"sample_id": [], "label": [], "orig_height": [], "orig_width": [], "path": []}
    per_tier = {t: {"image": [], "height": [], "width": []} for t in tiers}
    bad: list[dict[str, Any]] = []
    listed = 0

    with _samples(unit, src_fs, src_base) as samples:
        for sid, path, label, data, reason in samples:
            listed += 1
            if data is None:
                bad.append({"split": split, "sample_id": sid, "path": path, "reason": reason})
                continue
            try:
                dec = images.decode(data, tiers[0])
                del data
                img = dec.image
                encoded = []
                for t in tiers:  # largest first: each smaller tier is resampled from the largest one
                    im = img if t == tiers[0] else images.resize_short(img, t)
                    encoded.append((t, images.encode(im, formats[t], unit["jpeg_quality"]), im.width, im.height))
            except images.BadImage as exc:
                bad.append({"split": split, "sample_id": sid, "path": path, "reason": exc.reason})
                continue
            base["sample_id"].append(sid)
            base["label"].append(label)
            base["orig_height"].append(dec.orig_height)
            base["orig_width"].append(dec.orig_width)
            base["path"].append(path)
            for t, blob, w, h in encoded:
                per_tier[t]["image"].append(blob)
                per_tier[t]["height"].append(h)
                per_tier[t]["width"].append(w)

    rows = len(base["sample_id"])
    files: dict[str, dict[str, Any]] = {}
    if rows:
        for t in tiers:
            blob = parquet_bytes({**base, **per_tier[t]})
            name = shard_file(split, t, index)
            storage.write_bytes(f"{out_base}/{name}", blob, fs=out_fs)
            files[str(t)] = {"file": name, "rows": rows, "sha256": hashlib.sha256(blob).hexdigest(),
                             "bytes": len(blob), "format": formats[t]}
    # The originals' short sides: the split's native size (app/data/native.py).
    short_sides = remix.counts([min(h, w) for h, w in zip(base["orig_height"], base["orig_width"])])
    sidecar = {"split": split, "index": index, "rows": rows, "listed": listed, "files": files, "bad": bad,
               "max_label": max(base["label"], default=-1), "short_sides": short_sides,
               "label_counts": remix.counts(base["label"])}
    # The sidecar goes last: its existence certifies that every file it names was renamed into place whole.
    storage.write_json(f"{out_base}/{PROGRESS_DIR}/{_unit_name(split, index)}.json", sidecar, fs=out_fs)
    return sidecar


@contextmanager
def _samples(unit: dict[str, Any], fs: pafs.FileSystem, base: str
             ) -> Iterator[Iterator[tuple[int, str, int | None, bytes | None, str]]]:
    """(sample_id, path, label, bytes or None, reason) for each sample of a unit, whatever the source."""
    kind = unit.get("kind", "imagefolder")
    if kind != "imagefolder":
        module = sources_parquet if kind == "parquet" else sources_webdataset
        yield module.iter_samples(unit, fs, base)
        return
    if "entries" in unit:  # [[sample_id, rel_path, size, label], ...]
        entries = unit["entries"]
    else:  # the same, as columns
        entries = list(zip(unit["ids"], unit["paths"], unit["sizes"], unit["labels"]))

    def fetch(e: list) -> tuple[bytes | None, str]:
        return _read_or_reason(fs, f"{base}/{e[1]}", int(e[2]))

    threads = max(1, int(unit.get("io_threads", 8)))
    with ThreadPoolExecutor(threads) as pool:  # reads run ahead of the (single-threaded) decode
        yield ((sid, path, label, data, reason)
               for (sid, path, _size, label), (data, reason) in zip(entries, pool.map(fetch, entries)))


def _unit_files(files: pa.Table, order: np.ndarray, lo: int, hi: int) -> dict[str, list]:
    """A unit's rows [lo, hi) of its split's shard order as the lists build_shard reads (that shard only)."""
    ids = order[lo:hi]
    cols = files.take(pa.array(ids)).to_pydict()
    return {"ids": ids.tolist(), "paths": cols["path"], "sizes": cols["size"], "labels": cols["label"]}


def _map_unit(row: dict[str, Any], tables: dict[str, Any] | None = None) -> dict[str, Any]:
    unit = json.loads(row["unit"])
    if "rows" in unit:  # an ImageFolder shard: rows [lo, hi) of its split's plan table, in the object store
        import ray

        plan = ray.get(tables[unit["split"]])
        unit.update(_unit_files(plan["files"], plan["order"], *unit.pop("rows")))
    return {"sidecar": json.dumps(build_shard(unit))}


# --- the driver ----------------------------------------------------------------------------------
@dataclass
class _Cache:
    """One cache folder being built: where it is, what goes in it, and the parameters in its key."""

    listing: SourceListing | RowListing
    params: dict[str, Any]
    key: str
    location: str  # <cache_root>/<key>, local path or URI
    fs: pafs.FileSystem
    base: str  # ``location`` inside ``fs``
    tiers: list[int]
    formats: dict[int, str]
    # Per ImageFolder split, the listing indices (sample ids) in shard order: unit j of a split covers
    # order[j * shard_rows:(j + 1) * shard_rows]. Filled by _plan_shards.
    orders: dict[str, np.ndarray] = field(default_factory=dict)
    probed: int | None = None  # the native size the tiers were chosen for (probe_native), when asked


def _sizes(fs: pafs.FileSystem, folder: str) -> dict[str, int]:
    return {i.base_name: int(i.size or 0) for i in storage.list_dir(folder, detail=True, fs=fs)
            if i.type == pafs.FileType.File}


def _shard_ok(fs: pafs.FileSystem, base: str, info: dict[str, Any], sizes: dict[str, int], verify: bool) -> str:
    """'' when the file is present and intact, else why not."""
    name = info["file"]
    if name not in sizes:
        return f"{name}: missing"
    if int(info.get("bytes", -1)) >= 0 and sizes[name] != int(info["bytes"]):
        return f"{name}: {sizes[name]} bytes, expected {info['bytes']}"
    if verify:
        got = storage.sha256(f"{base}/{name}", fs=fs)
        if got != info["sha256"]:
            return f"{name}: sha256 {got[:12]} does not match the recorded {info['sha256'][:12]}"
    return ""


def _as_result(location: str) -> pathlib.Path | str:
    return location if is_uri(location) else pathlib.Path(location)


def _plan_cache(listing: SourceListing | RowListing, cache_root: str, tiers: list[int], jpeg_quality: int,
                raw_max_resolution: int, shard_rows: int, limit: dict[str, int] | None) -> _Cache:
    """Check the parameters and name the cache folder they and the listing key."""
    tiers = _check_params(list(tiers), jpeg_quality, raw_max_resolution, shard_rows, limit, list(listing.splits))
    formats = {t: tier_format(t, raw_max_resolution) for t in tiers}
    limit = {k: int(v) for k, v in (limit or {}).items() if v}
    params = {"tiers": tiers, "formats": {str(t): f for t, f in formats.items()}, "jpeg_quality": int(jpeg_quality),
              "raw_max_resolution": int(raw_max_resolution), "shard_rows": int(shard_rows), "limit": limit,
              "resample": images.RESAMPLE.name, "alpha_background": list(images.ALPHA_BACKGROUND),
              "format_version": FORMAT_VERSION, "shard_mix_seed": SHARD_MIX_SEED}
    key = cache_key(listing, params)
    location = join(storage.normalise(cache_root), key)
    fs, base = resolve_fs(location)
    return _Cache(listing, params, key, location, fs, base, tiers, formats)


def _manifest_intact(cache: _Cache, sizes: dict[str, int]) -> bool:
    """The fast path: a complete manifest whose files are all present (one listing call, no Ray)."""
    try:
        man = Manifest.load(cache.location)
        problems = [p for split in man.splits for tier in man.tiers(split)
                    for s in man.data["splits"][split]["tiers"][str(tier)]["shards"]
                    if (p := _shard_ok(cache.fs, cache.base, s, sizes, False))]
    except DataError as exc:
        problems = [str(exc)]
    if not problems:
        log.info("prepare: cache hit %s (%d train samples, tiers %s): nothing to do", cache.location,
                 man.num_samples("train"), cache.tiers)
        return True
    log.warning("prepare: cache %s is damaged (%s); rebuilding those shards", cache.location,
                "; ".join(problems[:5]))
    return False


def _plan_shards(cache: _Cache, limit: dict[str, int] | None, shard_rows: int, jpeg_quality: int,
                 io_threads: int) -> list[dict[str, Any]]:
    """One work unit per shard, in (split, index) order."""
    if isinstance(cache.listing, RowListing):
        return _plan_row_shards(cache, limit, shard_rows, jpeg_quality)
    units: list[dict[str, Any]] = []
    for split, files in sorted(cache.listing.splits.items()):
        ids = selected_ids(len(files), (limit or {}).get(split, 0))
        # Shards get a seeded random mix of the listing (sorted by class): a shard of consecutive entries
        # would hold one or two classes, and the epoch plan reads shard by shard. Sample ids stay the
        # listing indices, so labels and ids never depend on this order.
        # Units carry ranges of this order, never per-file lists: the driver holds the listing's columns
        # and 8 bytes a file here, and each task takes its own rows (see _map_unit).
        cache.orders[split] = order = ids[shard_order(len(ids), split)]
        for j, lo in enumerate(range(0, len(order), shard_rows)):
            hi = min(lo + shard_rows, len(order))
            units.append({"split": split, "index": j, "source": cache.listing.root, "out_dir": cache.location,
                          "tiers": cache.tiers, "formats": {str(t): f for t, f in cache.formats.items()},
                          "jpeg_quality": int(jpeg_quality), "io_threads": int(io_threads), "listed": hi - lo,
                          "rows": [lo, hi]})
    return units


def unit_rows(cache: _Cache, unit: dict[str, Any]) -> list[tuple[int, str, int, int]]:
    """(sample_id, path, size, label) of one planned ImageFolder unit: that shard's files only."""
    f = _unit_files(cache.listing.splits[unit["split"]].table, cache.orders[unit["split"]], *unit["rows"])
    return list(zip(f["ids"], f["paths"], f["sizes"], f["labels"]))


def _plan_row_shards(cache: _Cache, limit: dict[str, int] | None, shard_rows: int,
                     jpeg_quality: int) -> list[dict[str, Any]]:
    """Units of a Parquet / WebDataset source: a Parquet split whose rows are clustered by class gets
    shards of a seeded mix of its rows (``lightray.data.mix``), a shuffled one row ranges of one file each;
    WebDataset units are one tar each."""
    listing = cache.listing
    module = sources_parquet if listing.kind == "parquet" else sources_webdataset
    units = []
    for split in sorted(listing.splits):
        for j, u in enumerate(module.plan_units(listing, split, (limit or {}).get(split, 0), shard_rows)):
            units.append({**u, "split": split, "index": j, "kind": listing.kind, "source": listing.root,
                          "out_dir": cache.location, "tiers": cache.tiers, "jpeg_quality": int(jpeg_quality),
                          "formats": {str(t): f for t, f in cache.formats.items()}, "classes": listing.classes,
                          "options": listing.options})
    return units


def _listed(unit: dict[str, Any]) -> int:
    """Samples a unit covers, or -1 when only reading tells (a tar)."""
    return int(unit["listed"]) if "listed" in unit else len(unit["entries"])


def _find_built(cache: _Cache, units: list[dict[str, Any]], sizes: dict[str, int],
                verify: bool) -> dict[str, dict[str, Any]]:
    """Sidecars of the shards already built (an interrupted or damaged earlier run). A sidecar counts only
    when every file it names is present with its recorded size (and sha256, when verifying)."""
    fs, base = cache.fs, cache.base
    progress_sizes = _sizes(fs, f"{base}/{PROGRESS_DIR}")
    done: dict[str, dict[str, Any]] = {}
    rejected: list[str] = []

    def check(u: dict[str, Any]) -> tuple[str, dict[str, Any] | None, str]:
        name = _unit_name(u["split"], u["index"])
        if f"{name}.json" not in progress_sizes:
            return name, None, ""
        try:
            sc = storage.read_json(f"{base}/{PROGRESS_DIR}/{name}.json", fs=fs)
        except (OSError, ValueError) as exc:
            return name, None, f"{name}: unreadable sidecar ({exc})"
        bad = [p for f in sc.get("files", {}).values() if (p := _shard_ok(fs, base, f, sizes, verify))]
        if _listed(u) not in (-1, sc.get("listed")) or set(sc.get("files", {})) != (
                {str(t) for t in cache.tiers} if sc.get("rows") else set()):
            bad.append(f"{name}: sidecar does not match this shard's plan")
        return name, (None if bad else sc), "; ".join(bad)

    with ThreadPoolExecutor(16) as pool:  # sidecar reads are small; on object stores they are latency-bound
        for name, sc, why in pool.map(check, units):
            if sc is not None:
                done[name] = sc
            elif why:
                rejected.append(why)
    if rejected:
        log.warning("prepare: %d cached shard(s) fail their check and will be rebuilt: %s", len(rejected),
                    "; ".join(rejected[:5]))
    return done


def _clear_for_rebuild(cache: _Cache, sizes: dict[str, int]) -> None:
    """Drop the stale manifest (written last again, once the rebuilt shards are in) and the temp files of
    tasks killed mid-write; make sure the sidecar folder exists."""
    if MANIFEST in sizes:
        storage.remove(f"{cache.base}/{MANIFEST}", fs=cache.fs)
    for name in sizes:
        if name.startswith(".") and storage.TMP_MARK in name:
            storage.remove(f"{cache.base}/{name}", fs=cache.fs)
    storage.makedirs(f"{cache.base}/{PROGRESS_DIR}", fs=cache.fs)


def _build_shards(todo: list[dict[str, Any]], done: dict[str, dict[str, Any]], num_cpus: float,
                  concurrency: int | None, progress: Callable[[int, int], None] | None, t0: float,
                  cache: _Cache | None = None) -> int:
    """Build the missing shards as Ray Data tasks, adding each sidecar to ``done``; returns how many. Units
    with ``rows`` find their files in the split's listing table and shard order, put in the object store
    once per split (workers map it, no copy)."""
    if not todo:
        return 0
    import ray  # deferred: listing errors and cache hits must not pay for starting Ray
    import ray.data

    if not ray.is_initialized():
        ray.init()  # what Ray Data would do on first use; needed here to size the default concurrency
    if not concurrency:
        # Fractional CPUs keep prepare schedulable beside Train workers, but more tasks than logical CPUs
        # only adds worker processes (each pays the imports) competing for the same cores.
        concurrency = max(1, int(ray.cluster_resources().get("CPU", 1)))
    needed = {u["split"] for u in todo if "rows" in u}
    # Nested in a dict so Ray Data passes the refs as they are; each task gets the one of its split.
    refs = {split: ray.put({"files": cache.listing.splits[split].table, "order": cache.orders[split]})
            for split in sorted(needed)} if cache is not None else {}
    ds = ray.data.from_items([{"unit": json.dumps(u)} for u in todo], override_num_blocks=len(todo))
    ds = ds.map(_map_unit, fn_kwargs={"tables": refs}, num_cpus=num_cpus,
                compute=ray.data.TaskPoolStrategy(size=min(concurrency, len(todo))))
    step = max(1, len(todo) // 10)
    built = 0
    for row in ds.iter_rows():
        sc = json.loads(row["sidecar"])
        done[_unit_name(sc["split"], sc["index"])] = sc
        built += 1
        if progress is not None:
            progress(built, len(todo))
        if built % step == 0 or built == len(todo):
            log.info("prepare: %d/%d shards built (%.0f s)", built, len(todo), time.perf_counter() - t0)
    return built


def _remix_clustered(cache: _Cache, units: list[dict[str, Any]], done: dict[str, dict[str, Any]], shard_rows: int,
                     num_cpus: float, concurrency: int | None) -> tuple[list[dict[str, Any]], dict[str, dict]]:
    """Tar shards clustered by class are cut again into shards of a seeded mix (``lightray.data.remix``); returns the
    units and sidecars the manifest lists (the remixed train shards carry the first pass's bad files)."""
    if not (isinstance(cache.listing, RowListing) and cache.listing.kind == "webdataset"):
        return units, done
    first = [done[_unit_name("train", u["index"])] for u in units if u["split"] == "train"]
    score = remix.clustered_shards(first)
    if score <= mix.LIMIT:
        return units, done
    mixed = remix.plan(first, shard_rows)
    log.warning("prepare: the train tars of %s are clustered by class (their shards are %.0f standard deviations "
                "from fair samples); cutting their %d rows again into %d shards of a seeded mix (reads up to %d "
                "first-pass shards per shard)", cache.listing.root, score, sum(sc["rows"] for sc in first),
                len(mixed), len(first))
    import ray

    if not ray.is_initialized():
        ray.init()
    built = remix.run(mixed, cache.location, num_cpus, concurrency or max(1, int(ray.cluster_resources()["CPU"])))
    out = {k: v for k, v in done.items() if not k.startswith("train-")}
    for u in mixed:
        out[_unit_name("train", u["index"])] = dict(built[remix.unit_name("train", u["index"])])
    bad = [b for sc in first for b in sc["bad"]]
    if mixed and bad:  # the first pass's bad files, listed once
        head = out[_unit_name("train", 0)]
        out[_unit_name("train", 0)] = {**head, "bad": bad, "listed": head["listed"] + len(bad)}
    new_units = [u for u in units if u["split"] != "train"] + [{"split": "train", "index": u["index"]} for u in mixed]
    return sorted(new_units, key=lambda u: (u["split"], u["index"])), out


def _write_manifest(cache: _Cache, units: list[dict[str, Any]], done: dict[str, dict[str, Any]], built: int,
                    t0: float) -> None:
    """bad_files.json, then manifest.json: the manifest goes last, so its presence means complete."""
    man = _manifest(cache.key, cache.listing, cache.params, units, done, cache.tiers, cache.formats, cache.probed)
    bad = [b for u in units for b in done[_unit_name(u["split"], u["index"])]["bad"]]
    bad.sort(key=lambda b: (b["split"], b["sample_id"]))
    storage.write_json(f"{cache.base}/{BAD_FILES}", bad, fs=cache.fs, indent=1)
    storage.write_json(f"{cache.base}/{MANIFEST}", man, fs=cache.fs, indent=1)
    counts = ", ".join(f"{s} {man['splits'][s]['num_samples']}" for s in sorted(man["splits"]))
    log.info("prepare: wrote %s (%s samples; %d bad files skipped; %d shards built, %d reused) in %.1f s",
             join(cache.location, MANIFEST), counts, len(bad), built, len(units) - built, time.perf_counter() - t0)
    if bad:
        log.warning("prepare: %d unreadable source files skipped, listed in %s (first: %s: %s)", len(bad),
                    join(cache.location, BAD_FILES), bad[0]["path"], bad[0]["reason"])


def probe_native(listing: SourceListing | RowListing, samples: int = native.PROBE_SAMPLES) -> int | None:
    """The median short side of ``samples`` evenly spaced training images, from their headers (no decode): what
    prepare needs to know before it chooses the tiers. None when none could be read."""
    fs, base = resolve_fs(listing.root)
    if isinstance(listing, RowListing):
        module = sources_parquet if listing.kind == "parquet" else sources_webdataset
        # A tar is read from its start: a few from each of the first tars, not one from every tar.
        units = module.plan_units(listing, "train", samples, samples)[:8]
        extra = {"classes": listing.classes, "options": listing.options}
        streams = [module.iter_samples({**u, **extra, "max_rows": u.get("max_rows") and -(-samples // 8)}, fs, base)
                   for u in units]
    else:
        table = listing.splits["train"].table
        ids = selected_ids(len(table), samples)
        cols = table.take(pa.array(ids)).to_pydict()
        entries = [[int(i), p, int(z), int(lab)] for i, p, z, lab in zip(ids, cols["path"], cols["size"],
                                                                         cols["label"])]
        streams = [_samples_now({"entries": entries, "io_threads": 16}, fs, base)]
    sizes = [s for stream in streams for *_, data, _ in stream if data is not None
             and (s := native.short_side(data)) is not None]
    found = native.median(sizes[:samples])
    # DEBUG: the run prints what the native size does to its phases in one line of its own (native.py)
    log.debug("prepare: native size of %s: median short side %s px over %d sampled images", listing.root, found,
              len(sizes[:samples]))
    return found


def native_size_of(listing: SourceListing | RowListing, cache_root: str) -> int | None:
    """The probed native size, kept beside the caches under the listing's fingerprint: a run that finds its cache
    reads one small file instead of sampling the source's images again."""
    path = join(storage.normalise(cache_root), "_native", f"{listing.fingerprint()[:32]}.json")
    try:
        return storage.read_json(path)["native_short_side"]
    except (OSError, ValueError, KeyError):
        pass
    found = probe_native(listing)
    try:
        storage.write_json(path, {"native_short_side": found, "source": listing.root})
    except OSError as exc:  # a read-only cache root still trains; it samples again next time
        log.info("prepare: could not keep the native size at %s (%s)", path, exc)
    return found


def _samples_now(unit: dict[str, Any], fs: pafs.FileSystem, base: str) -> Iterator[tuple]:
    with _samples(unit, fs, base) as samples:
        yield from samples


def prepare(source: str, cache_root: str, tiers: list[int], *, jpeg_quality: int = 90,
            raw_max_resolution: int = 64, shard_rows: int = 512, limit: dict[str, int] | None = None,
            verify: bool = False, num_cpus: float = 0.5, concurrency: int | None = None, io_threads: int = 8,
            progress: Callable[[int, int], None] | None = None, val_fraction: float = 0.0,
            val_seed: int = 0, tiers_at_native: Callable[[int | None], list[int]] | None = None,
            val_fraction_explicit: bool = True) -> pathlib.Path | str:
    """Build (or find) the shard cache of ``source`` and return its manifest folder.

    ``tiers``: short-side sizes to store. ``limit``: {"train": N, "val": M} takes N evenly spaced samples
    (0 = all). ``verify``: re-hash every cached shard and rebuild any whose sha256 fails (otherwise only
    presence and size are checked). ``num_cpus`` per task is fractional on purpose; ``concurrency`` caps
    tasks in flight (default: the cluster's logical CPU count). ``progress(done, total)`` is called on the
    driver after each finished shard. ``val_fraction``/``val_seed``: the hold-out of a source without
    ``val/`` (``lightray.data.source.hold_out``); it is part of the cache key and recorded in the manifest.
    ``tiers_at_native``: when given, the tiers come from it, called with the source's native size probed
    from a sample of image headers (:func:`probe_native`), in place of ``tiers``.
    Returns a ``pathlib.Path`` for a local cache root, the URI string for a remote one.
    """
    t0 = time.perf_counter()
    # every input error surfaces here, before any worker starts; the hold-out applies to ImageFolder trees
    listing = list_source(source, val_fraction, val_seed, val_fraction_explicit)
    probed = None
    if tiers_at_native is not None:
        probed = native_size_of(listing, cache_root)
        tiers = tiers_at_native(probed)
    cache = _plan_cache(listing, cache_root, tiers, jpeg_quality, raw_max_resolution, shard_rows, limit)
    cache.probed = probed
    sizes = _sizes(cache.fs, cache.base)
    if MANIFEST in sizes and not verify and _manifest_intact(cache, sizes):
        return _as_result(cache.location)

    units = _plan_shards(cache, limit, shard_rows, jpeg_quality, io_threads)
    done = _find_built(cache, units, sizes, verify)
    todo = [u for u in units if _unit_name(u["split"], u["index"]) not in done]
    if not todo and MANIFEST in sizes:
        log.info("prepare: cache hit %s: all %d shards verified; nothing to do", cache.location, len(units))
        return _as_result(cache.location)

    _clear_for_rebuild(cache, sizes)
    if done:
        log.info("prepare: resuming %s: %d of %d shards already built, %d to build", cache.location, len(done),
                 len(units), len(todo))
    else:
        log.info("prepare: building %s: %d shards x %d tiers %s from %s", cache.location, len(units),
                 len(cache.tiers), cache.tiers, listing.root)
    built = _build_shards(todo, done, num_cpus, concurrency, progress, t0, cache)
    units, done = _remix_clustered(cache, units, done, shard_rows, num_cpus, concurrency)
    _write_manifest(cache, units, done, built, t0)
    return _as_result(cache.location)


def _manifest(key: str, listing: SourceListing | RowListing, params: dict[str, Any], units: list[dict[str, Any]],
              done: dict[str, dict[str, Any]], tiers: list[int], formats: dict[int, str],
              probed: int | None = None) -> dict[str, Any]:
    splits: dict[str, Any] = {}
    for u in units:  # units are in (split, index) order
        sc = done[_unit_name(u["split"], u["index"])]
        sp = splits.setdefault(u["split"], {
            "num_samples": 0, "num_listed": listing.num_files(u["split"]), "num_selected": 0, "num_bad": 0,
            "tiers": {str(t): {"format": formats[t], "shards": []} for t in tiers}})
        sp["num_samples"] += sc["rows"]
        sp["num_selected"] += sc["listed"]
        sp["num_bad"] += len(sc["bad"])
        if not sc["rows"]:
            continue  # an all-bad shard has no files; it is left out of every tier alike
        for t in tiers:
            f = sc["files"][str(t)]
            sp["tiers"][str(t)]["shards"].append(
                {"file": f["file"], "rows": f["rows"], "sha256": f["sha256"], "bytes": f["bytes"]})
    for split, sp in splits.items():
        if sp["num_listed"] < 0:  # tar shards: counted while reading
            sp["num_listed"] = sp["num_selected"]
        hist: dict[int, int] = {}
        for u in units:
            if u["split"] == split:
                for size, n in done[_unit_name(split, u["index"])].get("short_sides", {}).items():
                    hist[int(size)] = hist.get(int(size), 0) + int(n)
        sp["native_short_side"] = native.median_of_histogram(hist)  # None for shards built before it was kept
    classes = listing.classes
    if not classes:  # integer labels without names: "0".."max" over every built shard
        classes = [str(i) for i in range(max((sc.get("max_label", -1) for sc in done.values()), default=-1) + 1)]
    return {"key": key, "source": listing.root, "classes": classes, "params": params, "splits": splits,
            "native_probe": probed,
            "holdout": getattr(listing, "holdout", None), "bad_files": BAD_FILES,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


# --- CLI hook ------------------------------------------------------------------------------------
def resolve_cache_root(cfg: Config) -> str:
    """``data.cache_dir``, else ``<storage>/cache`` (storage defaults to ./lightray_runs)."""
    if cfg.data.cache_dir:
        return cfg.data.cache_dir
    return join(cfg.storage or "lightray_runs", "cache")


def tiers_for(cfg: Config) -> list[int]:
    """``data.tiers``, else every phase's resolution plus the eval resolution.

    ``report.eval_sweep`` adds no tiers: each sweep resolution is scored from the nearest tier at or above
    it (else the largest), resized on the fly, so a sweep never costs another pass over the source."""
    from lightray.config import default_eval_resolution

    if cfg.data.tiers:
        return sorted(set(cfg.data.tiers))
    phases = cfg.schedule.phases
    return sorted({p.resolution for p in phases} | {default_eval_resolution(cfg.schedule)})


def prepare_main(cfg: Config) -> pathlib.Path | str:
    """Prepare the shard cache for ``cfg`` ("demo" makes the synthetic ImageFolder tree first)."""
    cache_root = resolve_cache_root(cfg)
    source = cfg.data.source
    if source == "demo":
        from lightray.data.demo import ensure_demo

        # The demo tree is written with local file I/O: next to a local cache, else in the node-local dir.
        demo_parent = cache_root if not is_uri(cache_root) else (cfg.data.local_cache_dir or default_local_dir())
        os.makedirs(demo_parent, exist_ok=True)
        source = ensure_demo(demo_parent, cfg.data)
    limit = {"train": cfg.data.limit_train, "val": cfg.data.limit_val}

    def fitted_tiers(native_size: int | None) -> list[int]:
        # The tiers of the recipe as the run will fit it to this source (app/driver/runner.py fits the run's own
        # config from the manifest, and says what it changed): none is built above the native size.
        fitted = copy.deepcopy(cfg)
        native.fit_schedule(fitted, native_size)
        return tiers_for(fitted)

    return prepare(source, cache_root, tiers_for(cfg), jpeg_quality=cfg.data.jpeg_quality,
                   raw_max_resolution=cfg.data.raw_max_resolution, shard_rows=cfg.data.shard_rows,
                   limit={k: v for k, v in limit.items() if v} or None, verify=cfg.data.verify_cache,
                   num_cpus=cfg.data.prepare_cpus_per_task, concurrency=cfg.data.prepare_concurrency or None,
                   io_threads=cfg.data.prepare_io_threads, val_fraction=run_val_fraction(source, cfg.data.val_fraction),
                   val_seed=cfg.data.val_seed, tiers_at_native=None if cfg.data.tiers else fitted_tiers,
                   val_fraction_explicit=cfg.data.val_fraction > 0)
