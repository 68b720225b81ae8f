"""Recipes that fit the data: the source's native size (median short side) caps phases, tiers and the test
resolution unless ``schedule.allow_upscale``; phases can be stated relative to it."""

from __future__ import annotations

import io
import json
import pathlib

import pytest
from PIL import Image

from lightray.config import ConfigError, load_config
from lightray.data import native
from lightray.data.manifest import Manifest
from lightray.data.prepare import prepare, prepare_main
from lightray.data.sources import list_source
from tests.photos import photo_tree

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_short_side_reads_the_header_and_the_median_is_the_lower_one():
    buf = io.BytesIO()
    Image.new("RGB", (50, 30)).save(buf, format="JPEG")
    assert native.short_side(buf.getvalue()) == 30
    assert native.short_side(b"<html>not an image</html>") is None
    assert native.median([32, 32, 40, 500]) == 32
    assert native.median_of_histogram({24: 1, 32: 2}) == 32
    assert native.median([]) is None


def test_phases_above_the_native_size_are_clipped_and_say_why():
    cfg = load_config("demo")  # 32 -> 48 -> 64 px, eval 64
    notes = native.fit_schedule(cfg, 32)
    assert [p.resolution for p in cfg.schedule.phases] == [32, 32, 32]
    assert cfg.schedule.eval_resolution == 32
    assert sum("clipped to the source's native 32 px" in n for n in notes) == 2  # phases 1 and 2
    assert any("eval resolution 64 px clipped" in n for n in notes)
    assert native.fit_schedule(cfg, 32) == []  # fitted once: nothing left to change


def test_allow_upscale_keeps_the_recipe_and_says_it_upscales():
    cfg = load_config("demo", {"schedule.allow_upscale": True})
    notes = native.fit_schedule(cfg, 32)
    assert [p.resolution for p in cfg.schedule.phases] == [32, 48, 64] and cfg.schedule.eval_resolution == 64
    assert notes and "upscaled" in notes[0]


def test_a_phase_can_be_stated_relative_to_the_native_size():
    phases = [{"until": 0.5, "scale": 0.75, "batch_size": 64}, {"until": 1.0, "scale": 1.0, "batch_size": 64}]
    cfg = load_config("smoke", {"schedule.phases": phases, "schedule.eval_resolution": 0})
    native.fit_schedule(cfg, 32)
    assert [p.resolution for p in cfg.schedule.phases] == [24, 32]
    assert all(p.scale == 0 for p in cfg.schedule.phases)
    with pytest.raises(ConfigError, match=r"schedule.phases\[0\].scale: give resolution \(px\) or scale"):
        load_config("smoke", {"schedule.phases": [{"until": 1.0, "scale": 0.5, "resolution": 32, "batch_size": 8}]})


def test_the_probe_finds_the_native_size_of_each_source_kind(tmp_path):
    from tests.test_source_order import make_hf_parquet
    from tests.test_sources import make_webdataset

    assert prepare_probe(photo_tree(tmp_path / "if", 32)) == 32
    make_hf_parquet(tmp_path / "pq", per_class=10, sort=False)  # JPEGs of 40..119 px a side
    make_webdataset(tmp_path / "wds")  # the same, one of them an error page
    assert 40 <= prepare_probe(tmp_path / "pq") <= 119
    assert 40 <= prepare_probe(tmp_path / "wds") <= 119


def prepare_probe(root: pathlib.Path) -> int | None:
    from lightray.data.prepare import probe_native

    return probe_native(list_source(str(root)))


def test_prepare_builds_no_tier_above_the_native_size_and_records_it(tmp_path, ray_cluster):
    cfg = load_config("demo", {"data.source": str(photo_tree(tmp_path / "src", 32)),
                               "data.cache_dir": str(tmp_path / "cache")})
    man = Manifest.load(str(prepare_main(cfg)))
    assert man.tiers("train") == [32] and man.native_short_side == 32
    kept = list((tmp_path / "cache" / "_native").glob("*.json"))  # the probe is kept: a cache hit samples nothing
    assert len(kept) == 1 and json.loads(kept[0].read_text())["native_short_side"] == 32
    assert [p.resolution for p in cfg.schedule.phases] == [32, 48, 64]  # the run fits its own config, and says so
    direct = Manifest.load(str(prepare(str(tmp_path / "src"), str(tmp_path / "cache2"), [32, 64])))
    assert direct.tiers("train") == [32, 64]  # tiers asked for by hand are built as asked
