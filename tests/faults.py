"""Helpers for the fault-tolerance tests: a real multi-node Ray cluster on this machine, a real driver
process, and the audit of which samples the final model was trained on."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections import defaultdict

import numpy as np
import pyarrow.parquet as pq

from bench.common import kill_processes, process_tree, read_jsonl

ROOT = pathlib.Path(__file__).parents[1]


def wait_for(pred, timeout: float, what: str, proc: subprocess.Popen | None = None, interval: float = 0.5):
    end = time.time() + timeout
    while time.time() < end:
        value = pred()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"driver exited ({proc.returncode}) while waiting for {what}:\n{out[-4000:]}")
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def records(run_dir: pathlib.Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return read_jsonl(path) if path.is_file() else []


def last_samples(run_dir: pathlib.Path) -> int:
    train = [r for r in records(run_dir) if "event" not in r]
    return train[-1]["samples_seen"] if train else 0


def checkpoints(run_dir: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in run_dir.glob("checkpoint_*") if p.is_dir() and (p / "meta_rank0.json").is_file())


def driver_command(storage: pathlib.Path, name: str, *args: str, cache: pathlib.Path,
                   address: str = "local") -> list[str]:
    """`python app/run.py --smoke-test ...` with the run's storage, name, cache and cluster."""
    return [sys.executable, "app/run.py", "--smoke-test", "--storage", str(storage), "--name", name,
            f"--scaling.ray_address={address}", f"--data.cache_dir={cache}",
            f"--data.local_cache_dir={cache / 'local'}", "--report.log_samples=true", *args]


def driver(storage: pathlib.Path, name: str, *args: str, cache: pathlib.Path, address: str = "local",
           env: dict | None = None) -> subprocess.Popen:
    """Start `python app/run.py --smoke-test ...` as a real driver process (own process group)."""
    cmd = driver_command(storage, name, *args, cache=cache, address=address)
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True)


def run_on_a_terminal(cmd: list[str], timeout: float, columns: int = 120) -> str:
    """Run ``cmd`` with a pseudo-terminal as its stdout and stderr, as a user's shell would, and return what it
    printed (the terminal's own "\r\n" line ends read back as "\n"; a program's own "\r" kept). Fails with that
    output when the command does not exit 0 within ``timeout``."""
    import fcntl
    import pty
    import struct
    import termios
    import threading

    main, side = pty.openpty()
    fcntl.ioctl(side, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=side, stderr=side,
                            start_new_session=True)
    os.close(side)  # read() on the main side then ends (EIO) once every process holding the terminal has closed it
    chunks: list[bytes] = []

    def drain() -> None:  # a terminal's buffer is small: unread, it would block the program's writes
        while True:
            try:
                data = os.read(main, 65536)
            except OSError:
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        raise
    finally:
        reader.join(timeout=60)
        os.close(main)
    out = b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")
    assert proc.returncode == 0, out[-6000:]
    return out


def kill_group(proc: subprocess.Popen) -> None:
    """Kill the driver and everything it started, as losing its machine would: the local Ray cluster's
    processes start sessions of their own, so the process group alone does not reach them."""
    tree = process_tree(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    kill_processes(tree)
    proc.wait(timeout=60)
    wait_gone(tree, 60)


def wait_gone(procs: list, timeout: float) -> None:
    """Until every process is gone (exited, or a zombie nobody reaps yet): a killed machine's processes hold
    ports, files and the run lock's owner pid until then."""
    import psutil

    def alive(p) -> bool:
        try:
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    wait_for(lambda: not any(alive(p) for p in procs), timeout, "the killed processes to exit")


def finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        raise
    assert proc.returncode == 0, out[-6000:]
    return out


def carried_samples(run_dir: pathlib.Path) -> dict[int, list[int]]:
    """Per epoch, the sample ids of the steps the final model carries.

    Each worker-group start logs its steps per rank; a later start that resumed from an earlier checkpoint
    replays (and so replaces) the steps after it, so later starts override earlier ones step by step."""
    attempts: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for f in sorted((run_dir / "sample_log").glob("start*_attempt*_rank*.jsonl")):
        parts = f.stem.split("_")
        start = int(parts[1].removeprefix("attempt"))  # attempts in time order (rank 0's clock)
        rank = int(f.stem.split("_rank")[1])
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            attempts[start].setdefault(rec["samples_seen"], {"epoch": rec["epoch"], "ids": {}})
            attempts[start][rec["samples_seen"]]["ids"][rank] = rec["ids"]
    final: dict[int, dict] = {}
    for start in sorted(attempts):
        # A resumed attempt replaces every step from its first one on.
        first = min(attempts[start])
        final = {k: v for k, v in final.items() if k < first}
        final.update(attempts[start])
    per_epoch: dict[int, list[int]] = defaultdict(list)
    for key in sorted(final):
        step = final[key]
        for rank in sorted(step["ids"]):
            per_epoch[step["epoch"]].extend(step["ids"][rank])
    return dict(per_epoch)


def planned_samples(run_dir: pathlib.Path) -> dict[int, list[int]]:
    """Per epoch, the sample ids the epoch plan assigns (in order), from the run's manifest and config."""
    import yaml

    from lightray.config import config_from_dict
    from lightray.data.manifest import Manifest
    from lightray.data.plan import EpochPlan
    from lightray.schedule import Schedule

    cfg = config_from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    data = json.loads((run_dir / "data.json").read_text())
    manifest = Manifest.load(data["manifest"])
    sched = Schedule(cfg.schedule, cfg.optim, data["train_samples"])
    out = {}
    for epoch in range(sched.epochs):
        tier = data["phase_tiers"][sched.phase_index_for_epoch(epoch)]
        shards = manifest.shards("train", tier)
        ids = np.concatenate([pq.read_table(s.uri, columns=["sample_id"]).column(0).to_numpy() for s in shards])
        plan = EpochPlan([s.rows for s in shards], cfg.scaling.seed)
        n = sched.steps_in_epoch(epoch) * sched.phase_for_epoch(epoch).batch_size
        out[epoch] = ids[plan.order(epoch)[:n]].tolist()
    return out


def final_state(run_dir: pathlib.Path | str) -> dict:
    """Rank 0's state in the run's newest checkpoint: a local folder or a storage URI (s3://...)."""
    from lightray.train.state import list_checkpoints, load_rank_state

    (_, newest), *_ = list_checkpoints(str(run_dir))  # newest first
    return load_rank_state(newest, 0)


def assert_same_model(a: dict, b: dict) -> None:
    """Two model state dicts hold the same parameters and buffers (to float tolerance)."""
    import torch

    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), rtol=1e-4, atol=1e-5), k


# --- multi-node clusters on this machine: node loss, elastic resize, preemption notice ---------------------------
def train_records(run_dir: pathlib.Path) -> list[dict]:
    """Training metrics lines (no events, no end-of-epoch validation lines)."""
    return [r for r in records(run_dir) if "event" not in r and "val_top1" not in r]


def events(run_dir: pathlib.Path, name: str) -> list[dict]:
    return [r for r in records(run_dir) if r.get("event") == name]


def same_multiset(carried: dict[int, list[int]], planned: dict[int, list[int]]) -> dict[int, str]:
    """Per epoch, what differs between the carried and planned sample ids (empty when every epoch matches
    exactly as a multiset: no id twice, none missing)."""
    from collections import Counter

    out = {}
    for epoch in sorted(set(carried) | set(planned)):
        c, p = Counter(carried.get(epoch, [])), Counter(planned.get(epoch, []))
        if c != p:
            extra, missing = c - p, p - c
            out[epoch] = (f"{sum(c.values())} carried vs {sum(p.values())} planned; extra/duplicated "
                          f"{sorted(extra.elements())[:10]}, missing {sorted(missing.elements())[:10]}")
    return out


def _refresh_ray_config() -> None:
    from ray._raylet import Config

    Config.initialize("")


@contextlib.contextmanager
def token_auth_pinned():
    """This process and the nodes it starts in Ray's token auth mode (``~/.ray/auth_token`` made if missing),
    whatever a cluster earlier in the process used; the environment is given back afterwards. Once a process has
    run a token-mode cluster, a cluster it starts without token mode destroys the process's actors as soon as
    they are created (the GCS logs its driver as failed): seen when test_machine_loss ran right after
    test_billing's NodeCluster."""
    from ray._private.authentication.authentication_token_setup import (
        _get_default_token_path,
        generate_and_save_token,
    )

    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "token"
    _refresh_ray_config()  # this process caches the auth mode it saw first
    if not _get_default_token_path().is_file():
        generate_and_save_token()
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved
        _refresh_ray_config()


@contextlib.contextmanager
def private_cluster(head_cpus: int = 1):
    """A ``ray.cluster_utils.Cluster`` of this test's own (a head, nodes added by the test), with this process
    connected to it. Cluster() points this host's "current cluster" file at itself: the file is given back
    afterwards, so that other users of this host find their own cluster."""
    import ray
    from ray.cluster_utils import Cluster

    from lightray.ray_private import address_file as ray_address_file

    address_file = pathlib.Path(ray_address_file())
    previous = address_file.read_text() if address_file.exists() else None
    if ray.is_initialized():
        ray.shutdown()
    with token_auth_pinned():
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus, "include_dashboard": False})
        try:
            ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
            yield c
        finally:
            ray.shutdown()
            c.shutdown()
            if previous is not None:
                address_file.parent.mkdir(parents=True, exist_ok=True)
                address_file.write_text(previous)
            elif address_file.exists() and address_file.read_text() == c.address:
                address_file.unlink()


class NodeCluster:
    """A head (no "trainer" resource, so no Train worker lands there) and N worker nodes with one "trainer"
    each, all on this machine through ``ray.cluster_utils.Cluster``; usable as a context manager.

    Cluster() points this host's "current cluster" file at itself: it is put back on exit so that other users
    of the machine (``ray.init(address="auto")``) find their own cluster again. The nodes run with token auth
    (``RAY_AUTH_MODE=token`` and ``~/.ray/auth_token``), which the driver subprocess inherits through the
    environment. A client whose process still has auth disabled is refused by a token GCS ("InvalidAuthToken"),
    and an earlier local ``ray.init()`` in the same process turns token mode on behind one's back, so the mode is
    pinned explicitly (and this process's cached Ray config refreshed) rather than left to history. Ray Train's
    drain poll (5 s by default) is shortened to 0.5 s, and the GCS health check of the nodes runs every second
    instead of every 3 s: a killed node is then marked dead (and its Train workers failed over) after about 6 s
    instead of 15 s, measured here (a restart that must leave a lost node out, after a short worker-group start
    timeout, then finds it dead). The 10 s timeout of each check and the 5 misses in a row it takes stay Ray's
    defaults, so that a loaded but live node is not declared dead.
    """

    ENV = {"RAY_AUTH_MODE": "token", "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.5",
           "RAY_health_check_period_ms": "1000",
           "TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S": "5"}  # as cluster.yaml sets it on every node

    def __init__(self, workers: int = 2, head_cpus: int = 2, worker_cpus: float = 1, env: dict | None = None):
        self.env = {**self.ENV, **(env or {})}  # what a cluster's nodes would be set up with (cluster.yaml)
        self.n_workers = workers
        self.head_cpus = head_cpus
        self.worker_cpus = worker_cpus
        self.cluster = None
        self.nodes: list = []  # worker nodes alive (added and not removed), oldest first
        self._saved_env: dict[str, str | None] = {}
        self._address_file: pathlib.Path | None = None
        self._previous_address: str | None = None

    @property
    def address(self) -> str:
        return self.cluster.address

    def __enter__(self) -> NodeCluster:
        import ray
        import ray._private.utils as ray_utils
        from ray._private.authentication.authentication_token_setup import (
            _get_default_token_path,
            generate_and_save_token,
        )
        from ray.cluster_utils import Cluster

        if ray.is_initialized():
            ray.shutdown()
        for k, v in self.env.items():
            self._saved_env[k] = os.environ.get(k)
            os.environ[k] = v
        _refresh_ray_config()  # this process caches the auth mode it saw first (Ray does the same on enabling it)
        if not _get_default_token_path().is_file():
            generate_and_save_token()
        self._address_file = pathlib.Path(ray_utils.get_ray_address_file(None))
        self._previous_address = self._address_file.read_text() if self._address_file.exists() else None
        try:
            self.cluster = Cluster(initialize_head=True,
                                   head_node_args={"num_cpus": self.head_cpus, "include_dashboard": False})
            for _ in range(self.n_workers):
                self.add_worker()
            self.cluster.wait_for_nodes()
            ray.init(address=self.cluster.address, include_dashboard=False, log_to_driver=False)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def add_worker(self):
        """A replacement machine joining (what the autoscaler would launch)."""
        node = self.cluster.add_node(num_cpus=self.worker_cpus, resources={"trainer": 1})
        self.nodes.append(node)
        return node

    def remove_worker(self, node=None):
        """A machine lost without notice: every process on it stops at once, then is killed.

        ``Cluster.remove_node`` kills only the node's own Ray processes (raylet, agents). The worker processes
        below the raylet go on until they notice their raylet gone (how long was not measured), and in that time a Train
        worker can take steps and write a whole checkpoint after the "loss", which a vanished machine cannot: a CI
        run resumed from one written after the test had read where the run was. So the node's whole process
        tree is frozen first (SIGSTOP: nothing more runs or is written), and killed after Ray's own removal."""
        import psutil
        from ray._private import ray_constants

        node = node if node is not None else self.nodes[0]
        raylet = psutil.Process(node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid)
        frozen = [raylet, *process_tree(raylet.pid)]  # the raylet first: it reports nothing of the others
        for proc in frozen:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGSTOP)
        self.nodes.remove(node)
        self.cluster.remove_node(node, allow_graceful=False)
        kill_processes(frozen)
        return node

    def alive_trainer_nodes(self) -> list[str]:
        import ray

        return [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("trainer")]

    def __exit__(self, *exc) -> None:
        import ray

        try:
            ray.shutdown()
        finally:
            try:
                if self.cluster is not None:
                    self.cluster.shutdown()
            finally:
                for k, v in self._saved_env.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
                _refresh_ray_config()
                f, prev = self._address_file, self._previous_address
                if f is not None and prev is not None:
                    f.parent.mkdir(parents=True, exist_ok=True)
                    f.write_text(prev)
                elif f is not None and self.cluster is not None and f.exists() and \
                        f.read_text() == self.cluster.address:
                    f.unlink()


# A run long enough to interfere with: 2 epochs of 8 steps of 64 at 32 px, then 16 steps of 32 at 48 px
# per further epoch (epochs=4: 48 steps), a checkpoint every 4 steps, one Train worker per "trainer" node.
def long_run(epochs: int = 4) -> tuple[str, ...]:
    return ("--data.limit_train=512", f"--schedule.epochs={epochs}",
            f"--schedule.phases=[{{until_epoch: 2, resolution: 32, batch_size: 64}}, "
            f"{{until_epoch: {epochs}, resolution: 48, batch_size: 32}}]", "--checkpoint.every_steps=4",
            "--scaling.worker_resources={trainer: 1}")


def cluster_driver(nodes: NodeCluster, storage: pathlib.Path, name: str, *args: str, cache: pathlib.Path,
                   epochs: int = 4, env: dict | None = None) -> subprocess.Popen:
    """The real driver against the multi-node cluster, one Train worker per worker node; ``env`` adds to the
    cluster's environment (``python -m bench.chaos --group-start-timeout-s`` sets Ray Train's start timeout so)."""
    return driver(storage, name, *long_run(epochs), *args, cache=cache, address=nodes.address,
                  env={**NodeCluster.ENV, **(env or {})})


def run_schedule(run_dir: pathlib.Path):
    """The run's own Schedule (from its resolved config.yaml and data.json)."""
    import yaml

    from lightray.config import config_from_dict
    from lightray.schedule import Schedule

    cfg = config_from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    return Schedule(cfg.schedule, cfg.optim, json.loads((run_dir / "data.json").read_text())["train_samples"])


def steps_for(sched, samples_seen: int) -> int:
    """Global steps the recipe takes to reach ``samples_seen`` (each step = the phase's global batch)."""
    steps = 0
    for e in range(sched.epochs):
        b = sched.phase_for_epoch(e).batch_size
        if samples_seen >= sched.epoch_start(e + 1):
            steps += sched.steps_in_epoch(e)
        else:
            return steps + (samples_seen - sched.epoch_start(e)) // b
    return steps


def train_worker_pids(nodes: NodeCluster) -> list[int]:
    """The Train worker processes on the worker nodes: the processes below each node's raylet whose title
    Ray sets to ``ray::RayTrainWorker...``."""
    import psutil
    from ray._private import ray_constants

    pids = []
    for node in nodes.nodes:
        raylet = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
        for proc in process_tree(raylet):
            try:
                if "RayTrainWorker" in " ".join(proc.cmdline()):
                    pids.append(proc.pid)
            except psutil.NoSuchProcess:
                continue
    return pids
