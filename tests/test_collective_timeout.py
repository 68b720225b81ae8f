"""Collective timeouts: ``scaling.collective_timeout_s`` reaches the TorchTrainer's process group, and a
gloo group with a short timeout turns a missing peer into an error within seconds."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap
import time

import pytest

from lightray.config import load_config
from tests.ports import free_port

ROOT = pathlib.Path(__file__).parents[1]


def test_the_configured_timeout_is_the_trainers_torch_config(tmp_path):
    from ray.train.torch import TorchConfig

    from lightray.data.spec import IngestSpec, TierShards
    from lightray.driver.runner import _build_trainer
    from lightray.schedule import Schedule

    cfg = load_config("smoke", {"scaling.collective_timeout_s": "7", "name": "t", "storage": str(tmp_path)})
    spec = IngestSpec(seed=0, local_dir=str(tmp_path), train_size=64, phases=[],
                      val=TierShards(48, "jpeg", [], [], []), eval_resolution=48, val_crop_ratio=0.875)
    trainer = _build_trainer(cfg, str(tmp_path / "t"), spec, Schedule(cfg.schedule, cfg.optim, 64), 10, False, None)
    assert isinstance(trainer.backend_config, TorchConfig)
    assert trainer.backend_config.timeout_s == 7
    assert load_config("smoke").scaling.collective_timeout_s == 300  # short by default, not torch's 30 min


# Rank 0 calls all_reduce; rank 1 joins the group but never calls it (a hung peer), sleeping far longer.
RANK = textwrap.dedent("""
    import datetime, os, sys, time
    import torch, torch.distributed as dist
    rank, port, timeout = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=timeout))
    if rank == 1:
        time.sleep(120)
        sys.exit(0)
    t0 = time.time()
    try:
        dist.all_reduce(torch.ones(4))
    except Exception as exc:
        print(f"raised after {time.time() - t0:.1f} s: {type(exc).__name__}", flush=True)
        os._exit(0)
    print("no error", flush=True)
    os._exit(1)
""")


def test_a_collective_with_a_hung_peer_fails_within_the_timeout():
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(port), "2"], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        t0 = time.time()
        out, err = procs[0].communicate(timeout=90)
        assert procs[0].returncode == 0, out + err[-2000:]
        assert out.startswith("raised after"), out
        # 2 s of timeout, measured inside the rank: far below torch's 30-minute default.
        assert float(out.split()[2]) < 15, out
        assert time.time() - t0 < 90
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_hierarchical_subgroups_take_the_configured_timeout():
    from lightray.comm.hook import CommHook
    from lightray.comm.topology import Topology
    from lightray.config import CommConfig

    topology = Topology(world_size=1, rank=0, local_rank=0, local_world_size=1, node_rank=0, num_nodes=1)
    hook = CommHook(CommConfig(mode="hierarchical_topk"), topology, "cpu", timeout_s=9)
    assert hook.group_timeout is not None and hook.group_timeout.total_seconds() == 9


@pytest.mark.timing_bound
@pytest.mark.slow  # two Ray starts in subprocesses
def test_a_failed_group_waits_seconds_not_half_a_minute_for_a_hung_worker_to_leave_its_process_group():
    """Ray Train's controller waits TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S (Ray's default: 30 s) for every worker
    of a failed group to leave its process group, which a hung worker never does. The run's job carries a short
    one to every process Ray starts for it (the controller included), and a value the user set wins."""
    script = textwrap.dedent("""
        import os, ray
        from lightray.config import load_config
        from lightray.driver.runner import connect_ray
        connect_ray(load_config("smoke", {"scaling.ray_address": "local", "scaling.ray_num_cpus": "2"}))
        print(ray.get(ray.remote(lambda: os.environ.get("TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S")).remote()))
        ray.shutdown()
    """)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S"}
    for user_value, expected in ((None, "5"), ("12", "12")):
        run_env = env if user_value is None else {**env, "TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S": user_value}
        out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=run_env, capture_output=True, text=True,
                             timeout=180)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.strip().splitlines()[-1] == expected


def test_every_cluster_lightray_ships_sets_the_short_group_shutdown_wait_on_every_ray_process():
    """cluster.yaml exports it before each `ray start`, and every Ray container of the k8s manifests has it."""
    import yaml

    from lightray.driver.runner import CLUSTER_ENV

    (key, value), = CLUSTER_ENV.items()
    setup = yaml.safe_load((ROOT / "cluster.yaml").read_text())["setup_commands"]
    assert f"echo 'export {key}={value}' >> ~/lightray.env" in setup
    for manifest in ("raycluster.yaml", "rayjob.yaml"):
        containers = [c for doc in yaml.safe_load_all((ROOT / "k8s" / manifest).read_text())
                      for c in _ray_containers(doc)]
        assert containers, manifest
        for c in containers:
            assert {"name": key, "value": value} in c.get("env", []), (manifest, c["name"])


def _ray_containers(node) -> list[dict]:
    """Every container named ray-* anywhere in a manifest."""
    if isinstance(node, list):
        return [c for v in node for c in _ray_containers(v)]
    if not isinstance(node, dict):
        return []
    own = [c for c in node.get("containers", []) if c.get("name", "").startswith("ray-")]
    return own + [c for v in node.values() for c in _ray_containers(v)]
