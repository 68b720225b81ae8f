"""The driver's node meter bills every attempt's machine time, outside the checkpoints, on a real local
Ray cluster; the summary prices those node-seconds."""

from __future__ import annotations

import time

from app.config import load_config
from app.report.summary import _priced
from app.train.billing import NodeMeter, read_billing


def test_every_attempt_is_billed_and_the_bill_adds_up(tmp_path, ray_local):
    nodes = len([n for n in ray_local.nodes() if n["Alive"]])
    walls = []
    for _ in range(2):  # two driver attempts on the same run, as a failed run and its --resume
        t0 = time.time()
        meter = NodeMeter(str(tmp_path), "local", every_s=0.2, flush_s=0.5).start()
        time.sleep(1.5)
        bill = meter.stop()
        walls.append(time.time() - t0)
    assert len(bill["attempts"]) == 2 and bill == read_billing(str(tmp_path))
    total = bill["node_seconds"]["local"]
    # Each attempt's whole wall time on every live node, the first attempt's time included.
    assert 0.8 * nodes * sum(walls) <= total <= 1.05 * nodes * sum(walls), (total, walls, nodes)
    assert sum(a["node_seconds"]["local"] for a in bill["attempts"]) == total


def test_node_types_without_a_price_are_billed_at_the_configured_type():
    cfg = load_config("smoke", {"cost.node_type": "m6i.2xlarge"})
    priced = _priced(cfg, {"node_seconds": {"g5.48xlarge-spot": 10.0, "unknown-type": 5.0, "m6i.2xlarge": 1.0}})
    assert priced == {"g5.48xlarge-spot": 10.0, "m6i.2xlarge": 6.0}
    assert _priced(cfg, None) is None
