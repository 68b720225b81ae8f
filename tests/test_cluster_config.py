"""cluster.yaml, checked offline: Ray's own cluster-config schema plus lightray's cheap and secure rules.

No cloud is reachable from here; what `ray up` would reject, and what would make a cluster expensive or
open to the internet, is caught by reading the file.
"""

from __future__ import annotations

import copy
import importlib.util
import pathlib
import re
import subprocess
from typing import Any

import pytest

from lightray.config import CostConfig

HERE = pathlib.Path(__file__).resolve().parent


def _load_module(name: str):
    spec = importlib.util.spec_from_file_location(name, HERE / "cluster" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


checks = _load_module("checks")
REPO = checks.REPO


@pytest.fixture(scope="module")
def cfg() -> dict[str, Any]:
    return checks.load()


def test_cluster_yaml_passes_rays_schema_as_written_and_with_defaults(cfg):
    assert checks.schema_errors(cfg) == []


def test_cluster_yaml_breaks_no_cheap_or_secure_rule(cfg):
    assert checks.problems(cfg) == []


def test_gpu_workers_are_spot_with_an_on_demand_fallback_of_the_same_shape(cfg):
    gpus = checks.gpu_worker_types(cfg)
    spot = [t for t in gpus.values() if checks.is_spot(t)]
    ondemand = [t for t in gpus.values() if not checks.is_spot(t)]
    assert spot and ondemand
    shapes = {tuple(sorted(t["resources"].items())) for t in gpus.values()}
    assert shapes == {tuple(sorted(spot[0]["resources"].items()))}
    # The default autoscaler breaks score ties by the greater type name: spot must win them.
    spot_names = [n for n, t in gpus.items() if checks.is_spot(t)]
    od_names = [n for n, t in gpus.items() if not checks.is_spot(t)]
    assert min(spot_names) > max(od_names)
    # ...and autoscaler v2 by priority.
    assert min(gpus[n]["priority"] for n in spot_names) > max(gpus[n]["priority"] for n in od_names)
    assert cfg["max_workers"] >= sum(t["max_workers"] for t in gpus.values())


def test_every_node_type_has_a_price_in_the_cost_section(cfg):
    prices = CostConfig().price_per_hour
    for name, t in cfg["available_node_types"].items():
        key = checks.price_key(t)
        assert key in prices, f"{name}: no price for {key!r} in app/config.py CostConfig.price_per_hour"
        label = (t.get("labels") or {}).get("lightray-price-key")
        if name != cfg["head_node_type"]:
            assert label == key, f"{name}: label lightray-price-key={label!r}, expected {key!r}"


def test_every_shell_command_parses(cfg, tmp_path):
    cmds = [c for key in ("initialization_commands", "setup_commands", "head_setup_commands",
                          "worker_setup_commands", "head_start_ray_commands", "worker_start_ray_commands")
            for c in cfg.get(key) or []]
    script = tmp_path / "cmds.sh"
    script.write_text("\n".join(cmds) + "\n")
    res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_nvme_setup_makes_a_cache_folder_even_without_instance_store(cfg, tmp_path):
    # Run the real mount command with the mount point moved into tmp_path and sudo stubbed by a shell
    # function: on a machine without NVMe instance store (this one, or the head) it leaves a plain folder.
    cmd = next(c for c in cfg["setup_commands"] if "/mnt/lightray-cache" in c)
    target = tmp_path / "cache"
    script = "sudo() { \"$@\"; }\nmountpoint() { return 1; }\n" + cmd.replace("/mnt/lightray-cache", str(target))
    res = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert target.is_dir()


def test_documented_local_cache_flag_points_at_the_nvme_mount(cfg):
    doc = (REPO / "docs" / "CLUSTER.md").read_text()
    assert "--data.local_cache_dir=/mnt/lightray-cache" in doc
    assert any("/mnt/lightray-cache" in c for c in cfg["setup_commands"])


def test_fake_cluster_variant_lists_every_top_level_key_and_passes_the_schema():
    fake = checks.load(HERE / "cluster" / "fake-cluster.yaml")
    schema_keys = {"cluster_name", "max_workers", "upscaling_speed", "idle_timeout_minutes", "provider", "auth",
                   "docker", "head_node_type", "file_mounts", "cluster_synced_files",
                   "file_mounts_sync_continuously", "rsync_exclude", "rsync_filter", "initialization_commands",
                   "setup_commands", "head_setup_commands", "worker_setup_commands", "head_start_ray_commands",
                   "worker_start_ray_commands", "available_node_types"}
    assert schema_keys <= set(fake)
    from ray.autoscaler._private.util import validate_config

    validate_config(copy.deepcopy(fake))
    real = checks.load()
    # Same worker roles as the real file: names, spot/on-demand price keys, min 0.
    real_gpu = checks.gpu_worker_types(real)
    for name, t in real_gpu.items():
        assert fake["available_node_types"][name]["labels"] == t["labels"]
        assert fake["available_node_types"][name]["min_workers"] == 0
    assert fake["available_node_types"][fake["head_node_type"]]["resources"]["GPU"] == 0


def _mutate(cfg: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(cfg)
    node: Any = out
    parts = path.split("/")
    for p in parts[:-1]:
        node = node[int(p)] if isinstance(node, list) else node[p]
    last = parts[-1]
    if value is _DELETE:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return out


_DELETE = object()

BROKEN = {
    "worker on demand": ("available_node_types/gpu-spot/node_config/InstanceMarketOptions", _DELETE,
                         "no GPU worker type on spot"),
    "head with a gpu": ("available_node_types/head/resources", {"CPU": 4, "GPU": 8}, "GPU must be 0 on the head"),
    "workers always on": ("available_node_types/gpu-spot/min_workers", 2, "must scale from 0"),
    "no idle timeout": ("idle_timeout_minutes", 0, "idle_timeout_minutes"),
    "worker without token auth": ("worker_start_ray_commands/1",
                                  "ray start --address=$RAY_HEAD_IP:6379", "without RAY_AUTH_MODE=token"),
    "token not shipped": ("file_mounts", {"~/lightray": "."}, "~/.ray/auth_token must be mounted"),
    "dashboard open": ("head_start_ray_commands/1",
                       "RAY_AUTH_MODE=token ray start --head --num-gpus=0 --dashboard-host=0.0.0.0",
                       "dashboard bound to 0.0.0.0"),
    "ray makes the group": ("available_node_types/gpu-spot/node_config/SecurityGroupIds", _DELETE,
                            "SSH open to 0.0.0.0/0"),
    "dashboard port to the world": ("provider/security_group", {"GroupName": "x", "IpPermissions": [
        {"IpProtocol": "tcp", "FromPort": 8265, "ToPort": 8265, "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}]},
        "open to the internet beyond SSH"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_checks_catch_a_broken_cluster_file(cfg, case):
    path, value, message = BROKEN[case]
    found = checks.problems(_mutate(cfg, path, value))
    assert any(message in p for p in found), found


def test_ssh_from_one_cidr_in_a_security_group_is_allowed(cfg):
    ok = _mutate(cfg, "provider/security_group", {"GroupName": "lightray", "IpPermissions": [
        {"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22, "IpRanges": [{"CidrIp": "203.0.113.7/32"}]}]})
    assert checks.problems(ok) == []


def test_schema_check_reports_an_unknown_key(cfg):
    bad = _mutate(cfg, "max_worker", 3)
    errors = checks.schema_errors(bad)
    assert errors and re.search(r"max_worker", errors[0])


def test_comments_mark_every_value_a_user_must_edit():
    text = (REPO / "cluster.yaml").read_text()
    code = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    # Every placeholder left in the values is called out in the header's edit list.
    header = text.split("cluster_name:", 1)[0]
    for anchor in ("&ami", "&sg", "&profile", "LIGHTRAY_STORAGE", "max_workers"):
        assert anchor in header
    assert code.count("REPLACE_ME") >= 4
