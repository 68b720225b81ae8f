"""Cost estimate: device-hours, machine-hours and USD from the cost section's prices."""

from __future__ import annotations

import json

import pytest

from lightray.config import ConfigError, CostConfig, load_config
from lightray.report.cost import estimate_cost, validate_cost


def _cfg(**kw) -> CostConfig:
    base = {"node_type": "g5.48xlarge-spot", "gpus_per_node": 8,
            "price_per_hour": {"g5.48xlarge-spot": 4.9, "g5.48xlarge": 16.288, "m6i.2xlarge": 0.384}}
    base.update(kw)
    return CostConfig(**base)


def test_device_seconds_become_node_hours_priced_at_the_configured_node_type():
    # 16 machines x 8 GPUs for 30 minutes = 64 device-hours = 8 machine-hours.
    out = estimate_cost(_cfg(), device_seconds=16 * 8 * 1800.0, node_seconds=None)
    assert out["device_hours"] == pytest.approx(64.0)
    assert out["node_hours"] == pytest.approx(8.0)
    assert out["usd"] == pytest.approx(8.0 * 4.9)
    assert out["prices"] == {"g5.48xlarge-spot": 4.9}


def test_zero_gpus_per_node_counts_one_device_per_machine():
    out = estimate_cost(_cfg(gpus_per_node=0), device_seconds=7200.0, node_seconds=None)
    assert out["node_hours"] == pytest.approx(2.0)
    assert out["usd"] == pytest.approx(9.8)


def test_measured_node_seconds_price_spot_and_on_demand_separately():
    out = estimate_cost(_cfg(), device_seconds=0.0,
                        node_seconds={"g5.48xlarge-spot": 3 * 3600.0, "g5.48xlarge": 3600.0, "m6i.2xlarge": 7200.0})
    assert out["node_hours"] == pytest.approx(6.0)
    assert out["usd"] == pytest.approx(3 * 4.9 + 16.288 + 2 * 0.384)
    assert out["by_node_type"]["g5.48xlarge"]["usd"] == pytest.approx(16.288)
    assert out["prices"] == {"g5.48xlarge-spot": 4.9, "g5.48xlarge": 16.288, "m6i.2xlarge": 0.384}
    json.dumps(out)  # goes into summary.json as is


def test_default_cost_section_prices_a_local_run_at_zero():
    out = estimate_cost(CostConfig(), device_seconds=1234.0, node_seconds=None)
    assert out["usd"] == 0.0
    assert out["device_hours"] == pytest.approx(1234.0 / 3600)


def test_node_type_without_a_price_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"cost\.node_type: bad value 'p4d\.24xlarge-spot'.*g5\.48xlarge"):
        estimate_cost(_cfg(node_type="p4d.24xlarge-spot"), device_seconds=1.0, node_seconds=None)


def test_measured_node_type_without_a_price_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match=r"no price for node type 'x1\.32xlarge'"):
        estimate_cost(_cfg(), device_seconds=1.0, node_seconds={"x1.32xlarge": 10.0})


@pytest.mark.parametrize("bad", [-1.0, float("nan"), "10", True])
def test_bad_seconds_are_rejected(bad):
    with pytest.raises(ConfigError, match="device_seconds: bad value"):
        estimate_cost(_cfg(), device_seconds=bad, node_seconds=None)


def test_negative_price_is_rejected():
    with pytest.raises(ConfigError, match=r"cost\.price_per_hour\.g5\.48xlarge: bad value -1"):
        validate_cost(_cfg(price_per_hour={"g5.48xlarge-spot": 4.9, "g5.48xlarge": -1.0}))


def test_cost_section_overrides_go_through_load_config(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("cost:\n  node_type: g5.48xlarge-spot\n")
    cfg = load_config(str(recipe), {"cost.gpus_per_node": "8"})
    assert estimate_cost(cfg.cost, device_seconds=8 * 3600.0)["usd"] == pytest.approx(4.9)
    with pytest.raises(ConfigError, match="cost.gpus_per_node"):
        load_config(str(recipe), {"cost.gpus_per_node": "-1"})


def test_cost_table_in_the_cluster_docs_matches_the_configured_prices():
    # docs/CLUSTER.md (what a spot run costs) prices a 16 x 8-GPU run (+ 15 min of boot and idle time on every machine,
    # + the head)
    # with the default prices; the table must move when the prices do.
    import pathlib
    import re

    doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "CLUSTER.md").read_text()
    rows = re.findall(r"^\| (\d+) min \| (\d+) \| ([\d.]+) \| \$([\d.]+) \| \$([\d.]+) \|$", doc, flags=re.M)
    assert len(rows) >= 2
    cfg = CostConfig(node_type="g5.48xlarge-spot", gpus_per_node=8)
    for minutes, device_hours, node_hours, spot_usd, ondemand_usd in rows:
        wall = (int(minutes) + 15) * 60.0
        spot = estimate_cost(cfg, 128 * int(minutes) * 60.0, {"g5.48xlarge-spot": 16 * wall, "m6i.2xlarge": wall})
        od = estimate_cost(cfg, 0.0, {"g5.48xlarge": 16 * wall, "m6i.2xlarge": wall})
        assert spot["device_hours"] == pytest.approx(float(device_hours))
        assert spot["node_hours"] == pytest.approx(float(node_hours))
        assert round(spot["usd"], 2) == pytest.approx(float(spot_usd))
        assert round(od["usd"], 2) == pytest.approx(float(ondemand_usd))
