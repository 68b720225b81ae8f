"""A real Ray autoscaler on one host: Ray's fake multi-node provider, started and stopped by pid.

``FakeCluster`` runs ``RAY_FAKE_CLUSTER=1 ray start --head --autoscaling-config=...`` with
tests/cluster/fake-cluster.yaml on ports of its own and a temp dir of its own, with Ray token auth on
(the token lives in a file of its own, so ``~/.ray/auth_token`` of other clusters on this host is left
alone). Worker "machines" are launched by the autoscaler as extra raylets on this host.

Other Ray clusters may be running here, so nothing in this module calls ``ray stop`` (it cannot be
scoped to one cluster): stopping kills the processes whose command line names this cluster's temp dir,
together with their descendants, by pid.
"""

from __future__ import annotations

import json
import os
import pathlib
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from typing import Any

import psutil
import yaml

from tests.ports import free_port

HERE = pathlib.Path(__file__).resolve().parent
FAKE_CONFIG = HERE / "fake-cluster.yaml"
PRICE_LABEL = "lightray-price-key"


def process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) for every live process we can read (zombies left out): one snapshot,
    so that the processes picked by command line and their descendants are looked up in the same table."""
    table: dict[int, tuple[int, str]] = {}
    for proc in psutil.process_iter(["ppid", "cmdline", "status"]):
        info = proc.info
        if info["status"] in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD) or info["cmdline"] is None:
            continue  # dead, waiting to be reaped (nothing left to kill), or not ours to read
        table[proc.pid] = (info["ppid"], " ".join(info["cmdline"]).strip())
    return table


def with_descendants(roots: set[int], table: dict[int, tuple[int, str]]) -> set[int]:
    """``roots`` and every process below them in ``table``."""
    out = set(roots)
    grew = True
    while grew:
        grew = False
        for pid, (ppid, _) in table.items():
            if ppid in out and pid not in out:
                out.add(pid)
                grew = True
    return out


def kill_pids(pids: set[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class FakeCluster:
    """A token-auth Ray cluster whose autoscaler launches worker "machines" on this host."""

    def __init__(self, head_cpus: int = 0) -> None:
        # Unix socket paths under the temp dir must stay short (about 107 bytes): no pytest tmp_path here.
        self.temp_dir = tempfile.mkdtemp(prefix="lrfc", dir="/tmp")
        self.gcs_port = free_port()
        self.dashboard_port = free_port()
        self.address = f"127.0.0.1:{self.gcs_port}"
        self.dashboard_url = f"http://127.0.0.1:{self.dashboard_port}"
        self.token_path = pathlib.Path(self.temp_dir) / "auth_token"
        self.token_path.write_text(secrets.token_hex(32))
        self.token_path.chmod(0o600)
        cfg = yaml.safe_load(FAKE_CONFIG.read_text())
        cfg["provider"]["gcs_address"] = self.address
        self.config = cfg
        self.head_cpus = head_cpus  # 0 as in fake-cluster.yaml: all work goes to autoscaled worker machines
        self.config_path = pathlib.Path(self.temp_dir) / "autoscaling.yaml"
        self.config_path.write_text(json.dumps(cfg))

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a client of this cluster: token auth on, this cluster's token and address."""
        env = dict(os.environ)
        env.pop("RAY_AUTH_TOKEN", None)
        env.update({
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(self.token_path),
            "RAY_ADDRESS": self.address,
            "RAY_USAGE_STATS_ENABLED": "0",
        })
        env.update(extra)
        return env

    def start(self) -> None:
        cmd = [
            "ray", "start", "--head",
            f"--port={self.gcs_port}",
            f"--dashboard-port={self.dashboard_port}",
            "--dashboard-host=127.0.0.1",
            f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--temp-dir={self.temp_dir}",
            f"--autoscaling-config={self.config_path}",
            f"--num-cpus={self.head_cpus}", "--num-gpus=0",
            "--object-store-memory=200000000",
            "--disable-usage-stats",
        ]
        # AUTOSCALER_UPDATE_INTERVAL_S=1: the monitor looks at demand every second instead of every 5.
        env = self.env(RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1")
        env.pop("RAY_ADDRESS")
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout[-3000:]}{res.stderr[-3000:]}")

    # ---- observation -------------------------------------------------------------------------------

    def get(self, path: str, token: bool = True) -> Any:
        """GET a dashboard API path; with this cluster's token unless ``token`` is False."""
        headers = {"Authorization": f"Bearer {self.token_path.read_text().strip()}"} if token else {}
        req = urllib.request.Request(f"{self.dashboard_url}{path}", headers=headers)
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.load(resp)

    def nodes(self) -> list[dict[str, Any]]:
        """Every node the GCS knows (alive and dead), from the dashboard's REST API."""
        data = self.get("/nodes?view=summary")
        return [n["raylet"] for n in data["data"]["summary"]]

    def alive_workers(self) -> list[dict[str, Any]]:
        return [n for n in self.nodes() if n.get("state") == "ALIVE" and not n.get("isHeadNode")]

    # ---- spot loss and shutdown -------------------------------------------------------------------

    def kill_node(self, node: dict[str, Any]) -> set[int]:
        """Kill one worker node the way a spot loss does: its raylet and every child process at once.

        The fake provider gives each node's processes its node id in RAY_OVERRIDE_NODE_ID_FOR_TESTING,
        which is how the node's raylet is told apart from the others on this host.
        """
        node_id = node["nodeId"]
        table = process_table()
        raylets = {pid for pid, of in self.raylets(table).items() if of == node_id}
        if len(raylets) != 1:
            raise RuntimeError(f"expected one raylet of node {node_id} under {self.temp_dir}, found {raylets}")
        victims = with_descendants(raylets, table)
        kill_pids(victims)
        return victims

    def raylets(self, table: dict[int, tuple[int, str]]) -> dict[int, str]:
        """This cluster's raylets: pid -> node id (the fake provider's RAY_OVERRIDE_NODE_ID_FOR_TESTING; the
        head's raylet has none and is left out)."""
        out = {}
        for pid, (_, cmd) in table.items():
            if not (cmd.split(" ")[0].endswith("/raylet") and self.temp_dir in cmd):
                continue
            try:
                node_id = psutil.Process(pid).environ().get("RAY_OVERRIDE_NODE_ID_FOR_TESTING")
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if node_id:
                out[pid] = node_id
        return out

    def own_pids(self) -> set[int]:
        table = process_table()
        roots = {pid for pid, (_, cmd) in table.items() if self.temp_dir in cmd and pid != os.getpid()}
        return with_descendants(roots, table)

    def stop(self) -> None:
        # Twice: a process that forked while the table was taken is caught the second time.
        for _ in range(2):
            kill_pids(self.own_pids())
            time.sleep(0.5)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> FakeCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
