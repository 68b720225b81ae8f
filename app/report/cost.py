"""What a run cost: device-hours, machine-hours and dollars from the ``cost`` section's price table.

Prices are per machine-hour and keyed by *price key*: ``"<instance type>"`` for on-demand and
``"<instance type>-spot"`` for spot (``cluster.yaml`` puts each node's key on it as the node label
``lightray-price-key``). A run measures device-seconds (and, on a cluster, seconds per price key); both
are cumulative totals kept in the checkpoint through ``CostMeter`` so that a run that restarts after a
spot loss reports the cost of all its attempts, not only the last one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from app.config import ConfigError, CostSection

# The node label that cluster.yaml sets on every node type.
PRICE_LABEL = "lightray-price-key"


def validate_cost(cfg: CostSection) -> None:
    """Raise ConfigError unless every price is a finite number >= 0 and ``node_type`` has a price."""
    for key, price in cfg.price_per_hour.items():
        if not isinstance(price, (int, float)) or isinstance(price, bool) or not math.isfinite(price) or price < 0:
            raise ConfigError(
                f"cost.price_per_hour.{key}: bad value {price!r}; expected a price in USD per hour >= 0"
            )
    if cfg.node_type not in cfg.price_per_hour:
        raise ConfigError(
            f"cost.node_type: bad value {cfg.node_type!r}; expected a key of cost.price_per_hour "
            f"({', '.join(sorted(cfg.price_per_hour))})"
        )
    if cfg.gpus_per_node < 0:
        raise ConfigError(f"cost.gpus_per_node: bad value {cfg.gpus_per_node!r}; expected an integer >= 0")


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{name}: bad value {value!r}; expected seconds >= 0")
    return float(value)


def estimate_cost(
    cfg: CostSection, device_seconds: float, node_seconds: dict[str, float] | None = None
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


def node_seconds_for_group(node_keys: Iterable[str], elapsed_s: float) -> dict[str, float]:
    """Machine-seconds of one worker group that held the machines in ``node_keys`` for ``elapsed_s``.

    ``node_keys`` has one price key per distinct machine (not per worker): eight workers on one 8-GPU
    machine are one machine-second per second.
    """
    elapsed = _seconds("elapsed_s", elapsed_s)
    out: dict[str, float] = {}
    for key in node_keys:
        out[key] = out.get(key, 0.0) + elapsed
    return out


class CostMeter:
    """Cumulative device-seconds and machine-seconds per price key; lives in the trainer checkpoint.

    ``add`` is called with the time since the last call; ``state_dict`` goes into each checkpoint and
    ``CostMeter.from_state`` restores it after a restart, so totals keep growing across attempts.
    """

    def __init__(self) -> None:
        self.device_seconds = 0.0
        self.node_seconds: dict[str, float] = {}

    def add(self, device_seconds: float, node_seconds: Mapping[str, float] | None = None) -> None:
        self.device_seconds += _seconds("device_seconds", device_seconds)
        for key, secs in (node_seconds or {}).items():
            self.node_seconds[key] = self.node_seconds.get(key, 0.0) + _seconds(f"node_seconds.{key}", secs)

    def state_dict(self) -> dict[str, Any]:
        return {"device_seconds": self.device_seconds, "node_seconds": dict(self.node_seconds)}

    @classmethod
    def from_state(cls, state: Mapping[str, Any] | None) -> CostMeter:
        """A meter continuing from a checkpoint's ``state_dict`` (a fresh one for None)."""
        meter = cls()
        if state is None:
            return meter
        if not isinstance(state, Mapping) or "device_seconds" not in state:
            raise ConfigError(f"cost state: bad value {state!r}; expected a CostMeter.state_dict()")
        meter.add(state["device_seconds"], state.get("node_seconds") or {})
        return meter

    def estimate(self, cfg: CostSection) -> dict[str, Any]:
        """``estimate_cost`` of the totals; machine time measured per key when any was recorded."""
        return estimate_cost(cfg, self.device_seconds, dict(self.node_seconds) or None)


def current_price_key(default: str) -> str:
    """The price key of the machine this Ray process runs on (its ``lightray-price-key`` label).

    ``default`` (normally ``cfg.cost.node_type``) when Ray is not initialized or the node has no label,
    as on a local cluster.
    """
    import ray

    if not ray.is_initialized():
        return default
    labels = ray.get_runtime_context().get_node_labels()
    value = labels.get(PRICE_LABEL)
    if isinstance(value, list):  # typed as a list in some Ray versions
        value = value[0] if value else None
    return str(value) if value else default
