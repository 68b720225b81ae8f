"""Offline checks of a `ray up` cluster file: Ray's own schema plus lightray's cheap-and-secure rules.

``problems(cfg)`` returns one line per broken rule (empty when the file is fine), so that a test can
show every problem at once and can also check that a deliberately broken file is caught.
"""

from __future__ import annotations

import copy
import pathlib
import re
from typing import Any

import yaml

REPO = pathlib.Path(__file__).resolve().parents[2]
CLUSTER_YAML = REPO / "cluster.yaml"
TOKEN_FILE = "~/.ray/auth_token"
WORLD = ("0.0.0.0/0", "::/0")


def load(path: pathlib.Path = CLUSTER_YAML) -> dict[str, Any]:
    cfg = yaml.safe_load(path.read_text())
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a mapping of cluster settings, got {type(cfg).__name__}")
    return cfg


def schema_errors(cfg: dict[str, Any]) -> list[str]:
    """Ray's validation of the file as written and after Ray fills in its AWS defaults (as `ray up` does)."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    out = []
    for stage, fn in (("as written", lambda c: c), ("with Ray's defaults", prepare_config)):
        try:
            validate_config(fn(copy.deepcopy(cfg)))
        except Exception as exc:  # jsonschema.ValidationError, ValueError: Ray's own messages
            out.append(f"ray schema ({stage}): {str(exc).splitlines()[0]}")
    return out


def gpu_worker_types(cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    head = cfg.get("head_node_type")
    return {name: nt for name, nt in cfg.get("available_node_types", {}).items()
            if name != head and (nt.get("resources") or {}).get("GPU", 0) > 0}


def is_spot(node_type: dict[str, Any]) -> bool:
    market = (node_type.get("node_config") or {}).get("InstanceMarketOptions") or {}
    return market.get("MarketType") == "spot"


def _ray_start_lines(commands: list[str]) -> list[str]:
    return [c for c in commands if re.search(r"\bray start\b", c)]


def price_key(node_type: dict[str, Any]) -> str:
    """``<instance type>`` or ``<instance type>-spot``: the key of app/config.py's cost price table."""
    itype = (node_type.get("node_config") or {}).get("InstanceType", "?")
    return f"{itype}-spot" if is_spot(node_type) else itype


def problems(cfg: dict[str, Any]) -> list[str]:
    out: list[str] = []
    types = cfg.get("available_node_types") or {}
    head_name = cfg.get("head_node_type")
    head = types.get(head_name) or {}

    # Cheap: GPUs only on spot workers that scale from zero, plus an on-demand fallback; idle nodes stop.
    gpus = gpu_worker_types(cfg)
    spot = {n: t for n, t in gpus.items() if is_spot(t)}
    if not spot:
        out.append("available_node_types: no GPU worker type on spot (node_config.InstanceMarketOptions.MarketType)")
    if not any(not is_spot(t) for t in gpus.values()):
        out.append("available_node_types: no on-demand GPU worker type to fall back on")
    for name, t in gpus.items():
        if t.get("min_workers", 0) != 0:
            out.append(f"available_node_types.{name}.min_workers: {t.get('min_workers')!r}; GPU workers must "
                       "scale from 0")
    if not 0 < float(cfg.get("idle_timeout_minutes", 0) or 0) <= 30:
        out.append(f"idle_timeout_minutes: {cfg.get('idle_timeout_minutes')!r}; expected an idle timeout in (0, 30]")
    if (cfg.get("provider") or {}).get("cache_stopped_nodes", True):
        out.append("provider.cache_stopped_nodes: stopped nodes keep paying for disks (and spot cannot stop)")

    # The head trains nothing: no GPU advertised, none asked for on `ray start`, and it is not spot.
    if (head.get("resources") or {}).get("GPU", None) != 0:
        out.append(f"available_node_types.{head_name}.resources: GPU must be 0 on the head")
    if "CPU" not in (head.get("resources") or {}):
        out.append(f"available_node_types.{head_name}.resources: CPU missing on the head")
    if is_spot(head):
        out.append(f"available_node_types.{head_name}: the head must be on-demand")
    head_start = _ray_start_lines(cfg.get("head_start_ray_commands") or [])
    if not any("--num-gpus=0" in c for c in head_start):
        out.append("head_start_ray_commands: `ray start --head` must pass --num-gpus=0")

    # Secure: token auth on every node, the token shipped by the file itself, nothing open to the world.
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = _ray_start_lines(cfg.get(key) or [])
        if not starts:
            out.append(f"{key}: no `ray start` command")
        for cmd in starts:
            if not re.search(r"RAY_AUTH_MODE=token\s+ray start\b", cmd):
                out.append(f"{key}: `ray start` without RAY_AUTH_MODE=token in front: {cmd.strip()[:80]}")
            if "--dashboard-host=0.0.0.0" in cmd or "--dashboard-host 0.0.0.0" in cmd:
                out.append(f"{key}: dashboard bound to 0.0.0.0; keep Ray's localhost default")
    mounts = {str(k): str(v) for k, v in (cfg.get("file_mounts") or {}).items()}
    if mounts.get(TOKEN_FILE) != TOKEN_FILE:
        out.append(f"file_mounts: {TOKEN_FILE} must be mounted from {TOKEN_FILE} (ray up does not ship it)")
    sg = (cfg.get("provider") or {}).get("security_group") or {}
    for i, rule in enumerate(sg.get("IpPermissions") or []):
        cidrs = [r.get("CidrIp") for r in rule.get("IpRanges") or []] + \
                [r.get("CidrIpv6") for r in rule.get("Ipv6Ranges") or []]
        ssh_only = rule.get("IpProtocol") == "tcp" and rule.get("FromPort") == 22 and rule.get("ToPort") == 22
        if any(c in WORLD for c in cidrs) and not ssh_only:
            out.append(f"provider.security_group.IpPermissions[{i}]: open to the internet beyond SSH: {rule}")
    # A group Ray creates itself always gets "SSH from 0.0.0.0/0": each node type must name its own group.
    for name, t in types.items():
        if not (t.get("node_config") or {}).get("SecurityGroupIds"):
            out.append(f"available_node_types.{name}.node_config.SecurityGroupIds: missing; Ray would create a "
                       "group with SSH open to 0.0.0.0/0")

    # lightray: the repo synced and installed, storage on S3 through one variable, NVMe as the local cache.
    if not any(v in (".", "./") for v in mounts.values()):
        out.append("file_mounts: the working tree ('.') is not synced to the nodes")
    setup = "\n".join(cfg.get("setup_commands") or [])
    if "pip install" not in setup or "-e ." not in setup:
        out.append("setup_commands: lightray is not installed from the synced tree (pip install -e .)")
    storage = re.findall(r"LIGHTRAY_STORAGE=([^\s'\"]+)", setup)
    if len(storage) != 1 or not storage[0].startswith("s3://"):
        out.append(f"setup_commands: expected LIGHTRAY_STORAGE=s3://... set exactly once, found {storage}")
    if "/mnt/lightray-cache" not in setup or "Instance_Storage" not in setup:
        out.append("setup_commands: the local NVMe instance store is not mounted at /mnt/lightray-cache")
    return out
