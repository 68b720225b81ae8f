"""What a run cost: device-hours, machine-hours and dollars from the ``cost`` section's price table.

Prices are per machine-hour and keyed by *price key*: ``"<instance type>"`` for on-demand and
``"<instance type>-spot"`` for spot (``cluster.yaml`` puts each node's key on it as the node label
``lightray-price-key``). A run measures device-seconds (and, on a cluster, seconds per price key); both
are cumulative totals over all attempts of a run, so that a run that restarts after a spot loss reports
the cost of all of them, not only the last one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from lightray.config import ConfigError, CostConfig


def validate_cost(cfg: CostConfig) -> None:
    """Raise ConfigError unless every price is a finite number >= 0 and ``node_type`` has a price."""
    cfg.check_prices()


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{name}: bad value {value!r}; expected seconds >= 0")
    return float(value)


def estimate_cost(
    cfg: CostConfig, device_seconds: float, node_seconds: dict[str, float] | None = None
) -> dict[str, Any]:
    """Device-hours, machine-hours and USD of a run.

    ``device_seconds`` is the run's total accelerator time (every worker's seconds added up, across
    restarts). ``node_seconds`` maps a price key to machine-seconds spent on machines of that key (two
    machines for an hour = 7200). Without it the machines are inferred from the devices: node-hours =
    device-hours / ``cfg.gpus_per_node`` (one device per machine when 0), priced at ``cfg.node_type``.

    Returns ``{"device_hours", "node_hours", "usd", "prices", "by_node_type"}``; ``prices`` holds the
    price per hour of each key used, ``by_node_type`` the node-hours and USD of each.
    """
    validate_cost(cfg)
    device_hours = _seconds("device_seconds", device_seconds) / 3600.0
    if node_seconds is None:
        per_node = cfg.gpus_per_node or 1
        hours_by_key = {cfg.node_type: device_hours / per_node}
    else:
        if not isinstance(node_seconds, Mapping):
            raise ConfigError(f"node_seconds: bad value {node_seconds!r}; expected a mapping price key -> seconds")
        hours_by_key = {}
        for key, secs in node_seconds.items():
            if key not in cfg.price_per_hour:
                raise ConfigError(
                    f"cost.price_per_hour: no price for node type {key!r} (used {secs!r} s); add it to the "
                    f"cost section; known: {', '.join(sorted(cfg.price_per_hour))}"
                )
            hours_by_key[key] = _seconds(f"node_seconds.{key}", secs) / 3600.0
    prices = {key: float(cfg.price_per_hour[key]) for key in hours_by_key}
    by_type = {
        key: {"node_hours": hours, "price_per_hour": prices[key], "usd": hours * prices[key]}
        for key, hours in hours_by_key.items()
    }
    return {
        "device_hours": device_hours,
        "node_hours": sum(hours_by_key.values()),
        "usd": sum(v["usd"] for v in by_type.values()),
        "prices": prices,
        "by_node_type": by_type,
    }
