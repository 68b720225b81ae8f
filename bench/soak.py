"""A day in the life of a spot run, on this machine: ``python -m bench.soak``.

The deployment users run, in small. Ray's real autoscaler with its fake multi-node provider
(tests/cluster/fake_cluster.py): a head with no CPU, spot and on-demand worker "machines" of 2 CPUs that the
autoscaler launches on demand and replaces when they go. Run storage on a local S3 server (moto,
tests/s3_server.py) behind a relay that can go down (tests/s3_relay.py). The run submitted as users submit it,
``ray job submit -- python app/run.py ...``, elastic (``--workers 1:2``, one Train worker a machine). The
cluster starts with the head alone, so the first worker group waits for the autoscaler.

The faults, in a seeded order, each once the run has trained two steps past its recovery from the one before:

- ``loss``: a machine that holds a Train worker killed without notice (its raylet and every process on it);
- ``notice``: a spot notice (tests/imds_server.py) read by lightray's spot watcher on that machine, which
  drains it with reason PREEMPTION; the machine is killed at the notice's deadline;
- ``hang``: a Train worker stopped (SIGSTOP); its peers' next collective times out after the run's
  ``scaling.collective_timeout_s`` and Ray Train replaces the group;
- ``driver_kill``: the job's driver killed (SIGKILL of its process group); the run submitted again with
  ``--resume``, as a user or a scheduler would;
- ``s3_outage``: the S3 endpoint down for a few seconds (open connections cut, new ones turned away).

The bench adds no machine itself: the autoscaler replaces each lost one. The run's ``scaling.max_failures`` is
0: every machine going away must be charged to Ray Train's preemption budget, and an outage of seconds must be
ridden out by the storage retries, or the run ends.

Figures: per fault kind ``injected``, ``survived``, ``restart_s`` (the worst: from the fault to the first step
after it) and ``lost_samples`` (trained again: the last step reported before the start that followed the fault
minus that start's resume point); per worker-group start Ray Data's CPU share and the machines it was sized
from; the decode placement records; ``audit_exact`` (per epoch, the sample ids the final model carries equal
the epoch plan's as a multiset: none lost, none served twice; tests/faults.py).

Run: ``python -m bench.soak`` (15 machine losses, 3 driver kills, 1 outage); ``--short``: one fault of each
kind, machines first (the CI form, tests/test_soak.py). Prints ONE JSON line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import os
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import Machine, emit, json_stdout, note, stopped_process_ended  # noqa: E402
from tests.faults import carried_samples, planned_samples, same_multiset  # noqa: E402
from tests.s3_server import S3_ENV  # noqa: E402

MACHINE_KINDS = ("loss", "notice", "hang")
KINDS = (*MACHINE_KINDS, "driver_kill", "s3_outage")
# The notice's deadline (AWS gives 120 s): room for Ray Train's drain poll (5 s), a step and the checkpoint's
# upload on two loaded cores, now that the machine goes at the deadline whatever the run did.
NOTICE_S = 20.0
OUTAGE_S = 8.0
COLLECTIVE_TIMEOUT_S = 20  # how long peers wait on a hung worker
CHECKPOINT_EVERY = 4  # steps
BATCH, TRAIN_IMAGES = 64, 512
STEPS_PER_FAULT = 20
STEP_TIMEOUT_S = 420  # no recovery for this long: the run is stuck (a failure of the bench, not a figure)
SUBMIT_RETRY_S = 60  # how long a submission refused for want of a job agent is asked again
NO_AGENT = "No available agent to submit job"  # Ray's dashboard, before a fresh head's agent has registered
BUCKET = "soak"
EXCLUDES = [".git", "**/__pycache__", ".pytest_cache", ".ruff_cache", "runs", "lightray_runs", "data_cache",
            "*.egg-info", ".gl"]


def fake_cluster_module():
    """tests/cluster/fake_cluster.py (a folder of test support files, not a package)."""
    spec = importlib.util.spec_from_file_location("fake_cluster", ROOT / "tests" / "cluster" / "fake_cluster.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("fake_cluster", mod)
    spec.loader.exec_module(mod)
    return mod


def fault_plan(seed: int, machine_losses: int, driver_kills: int, outages: int) -> list[str]:
    """The faults in a seeded order: the machine losses split evenly over loss / notice / hang."""
    plan = [MACHINE_KINDS[i % len(MACHINE_KINDS)] for i in range(machine_losses)]
    plan += ["driver_kill"] * driver_kills + ["s3_outage"] * outages
    random.Random(seed).shuffle(plan)
    return plan


def epochs_for(faults: int) -> int:
    """Epochs enough for every fault. The run trains on while a fault is injected and recovered from: measured
    here, at most about 20 steps a fault (most during a notice's deadline), and the last fault must find it
    still training."""
    steps_per_epoch = TRAIN_IMAGES // BATCH
    return 3 + math.ceil(faults * STEPS_PER_FAULT / steps_per_epoch)


def _train(recs: list[dict]) -> list[dict]:
    return [r for r in recs if "event" not in r and "val_top1" not in r and "samples_seen" in r]


def _starts(recs: list[dict], after: float) -> list[dict]:
    return [r for r in recs if r.get("event") in ("start", "restart") and r.get("time", 0) > after]


def train_workers(fc, fcm) -> dict[str, list[int]]:
    """node id -> the Train worker processes on that machine (below its raylet, titled ``ray::RayTrainWorker``)."""
    table = fcm.process_table()
    out: dict[str, list[int]] = {}
    for pid, node_id in fc.raylets(table).items():
        below = fcm.with_descendants({pid}, table) - {pid}
        workers = sorted(p for p in below if "RayTrainWorker" in table[p][1])
        if workers:
            out[node_id] = workers
    return out


def driver_groups(name: str) -> set[int]:
    """Process groups of the run's job driver (the entrypoint's shell, lightray's guardian and its driver)."""
    import psutil

    groups = set()
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "app/run.py" in cmd and f"--name {name}" in cmd and "job submit" not in cmd:
            try:
                groups.add(os.getpgid(proc.pid))
            except ProcessLookupError:
                continue
    return groups


class Soak:
    """One run submitted to the autoscaling cluster, under the fault plan."""

    def __init__(self, fc, fcm, relay, imds, uri: str, read_uri: str, work: pathlib.Path, name: str,
                 plan: list[str], seed: int, progress_file: str | None = None):
        self.fc, self.fcm, self.relay, self.imds = fc, fcm, relay, imds
        self.progress_file = progress_file
        self.uri, self.read_uri, self.work, self.name, self.plan, self.seed = uri, read_uri, work, name, plan, seed
        self.epochs = epochs_for(len(plan))
        self.max_failures = 0
        self.mirror = pathlib.Path.home() / "lightray_runs" / name  # the driver's local copy of the records
        self.jobs: list[str] = []
        self.injected: list[dict] = []
        self.alive: list[tuple[float, int]] = []  # (time, worker machines alive), sampled at every poll

    # -- the job -----------------------------------------------------------------------------------------
    def entrypoint(self, resume: bool) -> list[str]:
        phases = f"[{{until_epoch: {self.epochs}, resolution: 32, batch_size: {BATCH}}}]"
        cache = self.work / "cache"
        return ["python", "app/run.py", "--smoke-test", "--storage", self.uri, "--name", self.name,
                "--workers", "1:2", "--scaling.cpus_per_worker=1.5", "--scaling.resize_check_s=2",
                f"--scaling.collective_timeout_s={COLLECTIVE_TIMEOUT_S}", f"--scaling.max_failures={self.max_failures}",
                f"--scaling.seed={self.seed}", f"--data.limit_train={TRAIN_IMAGES}", f"--schedule.epochs={self.epochs}",
                f"--schedule.phases={phases}", f"--checkpoint.every_steps={CHECKPOINT_EVERY}", "--checkpoint.keep=3",
                "--report.every_steps=1", "--report.sync_every_s=2", "--report.log_samples=true",
                f"--report.sample_log_dir={self.work / 'sample_log'}", f"--data.cache_dir={cache}",
                f"--data.local_cache_dir={cache / 'local'}", *(["--resume"] if resume else [])]

    def submit(self, resume: bool) -> None:
        job = f"{self.name}-{len(self.jobs)}"
        # As cluster.yaml sets them on every node, at the run's collective timeout.
        env_vars = {**S3_ENV, "RAY_TRAIN_COLLECTIVE_TIMEOUT_S": str(COLLECTIVE_TIMEOUT_S),
                    "RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S": str(COLLECTIVE_TIMEOUT_S)}
        cmd = ["ray", "job", "submit", "--no-wait", "--submission-id", job, "--working-dir", ".",
               "--runtime-env-json", json.dumps({"excludes": EXCLUDES, "env_vars": env_vars}), "--",
               *self.entrypoint(resume)]
        end = time.time() + SUBMIT_RETRY_S
        while True:
            res = subprocess.run(cmd, cwd=ROOT, env=self.fc.env(RAY_ADDRESS=self.fc.dashboard_url),
                                 capture_output=True, text=True, timeout=180)
            # A fresh head's dashboard may not yet know its job agent and says so (CI of 2026-12-06): asked
            # again, as its message says; any other refusal, or this one past the deadline, is the bench's error.
            if res.returncode == 0 or NO_AGENT not in res.stderr + res.stdout or time.time() > end:
                break
            note(f"soak: ray job submit refused ({NO_AGENT!r}); asking again")
            time.sleep(2.0)
        if res.returncode != 0:
            raise RuntimeError(f"soak: ray job submit failed ({res.returncode}):\n{res.stderr[-3000:]}")
        self.jobs.append(job)

    def status(self) -> str:
        return self.fc.get(f"/api/jobs/{self.jobs[-1]}")["status"]

    def logs(self) -> str:
        res = subprocess.run(["ray", "job", "logs", self.jobs[-1]], env=self.fc.env(RAY_ADDRESS=self.fc.dashboard_url),
                             capture_output=True, text=True, timeout=120)
        return (res.stdout + res.stderr)[-6000:]

    def records(self) -> list[dict]:
        from lightray.storage import read_jsonl

        path = self.mirror / "metrics.jsonl"
        return read_jsonl(str(path)) if path.is_file() else []

    def last_step(self) -> dict:
        train = _train(self.records())
        return train[-1] if train else {}

    def wait(self, pred, what: str, timeout: float = STEP_TIMEOUT_S, ended_ok: bool = False):
        """Poll ``pred`` (sampling the machines alive) until it holds; the job ending first is an error unless
        ``ended_ok`` (then None)."""
        end = time.time() + timeout
        while time.time() < end:
            self.alive.append((time.time(), len(self.fc.alive_workers())))
            value = pred()
            if value:
                return value
            status = self.status()
            if status in ("FAILED", "STOPPED", "SUCCEEDED"):
                value = pred()  # the job may have ended after the check above: what it left decides (a CI run, 12-06)
                if value:
                    return value
                if ended_ok and status == "SUCCEEDED":
                    return None
                raise RuntimeError(f"soak: the job ended {status} while waiting for {what}:\n{self.logs()}")
            time.sleep(0.5)
        raise RuntimeError(f"soak: timed out after {timeout:.0f} s waiting for {what}:\n{self.logs()}")

    # -- the faults --------------------------------------------------------------------------------------
    def victim(self) -> str:
        """A machine that holds a Train worker (waits for one: the group may be restarting)."""
        return self.wait(lambda: next(iter(train_workers(self.fc, self.fcm)), None), "a Train worker to fault")

    def inject(self, kind: str) -> dict:
        fault = {"kind": kind, "time": time.time(), "before": self.last_step().get("samples_seen", 0)}
        note(f"soak: {kind} at samples_seen={fault['before']}")
        if kind == "loss":
            node = self.victim()
            self.fc.kill_node({"nodeId": node})
        elif kind == "notice":
            self._notice(fault)
        elif kind == "hang":
            node = self.victim()
            pid = train_workers(self.fc, self.fcm)[node][0]
            os.kill(pid, signal.SIGSTOP)
            fault["stopped_pid"] = pid
        elif kind == "driver_kill":
            groups = driver_groups(self.name)
            for group in groups:
                os.killpg(group, signal.SIGKILL)
            fault["killed_groups"] = len(groups)
            self._wait_job_ended()
            fault["time"] = time.time()  # the new driver counts from its submission
            self.submit(resume=True)
        elif kind == "s3_outage":
            self.relay.set_down(True)
            time.sleep(OUTAGE_S)  # the outage's length: the fault itself, not a wait for anything
            self.relay.set_down(False)
            fault["back"] = time.time()
            fault["turned_away"] = sum(fault["time"] <= t <= fault["back"] for t in self.relay.turned_away)
        self.injected.append(fault)
        return fault

    def _wait_job_ended(self) -> None:
        """Until Ray has marked the killed driver's job ended (a new job of the run must not race the old one)."""
        end = time.time() + 60
        while self.status() not in ("FAILED", "STOPPED", "SUCCEEDED") and time.time() < end:
            time.sleep(0.5)

    def _notice(self, fault: dict) -> None:
        import ray

        from lightray.config import ScalingConfig
        from lightray.driver.spot_watcher import start_watchers, stop_watchers

        node = self.victim()
        if not ray.is_initialized():
            ray.init(address=self.fc.address, logging_level="ERROR", log_to_driver=False)
        cfg = ScalingConfig(spot_watcher="on", spot_endpoint=self.imds.url, spot_poll_s=0.5)
        handles = start_watchers(cfg, f"soak-{self.name}", node_ids=[node])
        fault["time"] = time.time()
        deadline = fault["time"] + NOTICE_S
        self.imds.serve_notice(in_s=NOTICE_S)
        try:
            # The machine goes at the deadline, as a reclaimed one does, whatever the run did with the notice:
            # waiting for the run's checkpoint first (as this bench once did) kept a draining machine up for
            # ever when the run never wrote one (CI of 2026-12-07), which no cloud does.
            time.sleep(max(0.0, deadline - time.time()))  # the notice's length: the fault itself
        finally:
            self.imds.clear()
            stop_watchers(handles)
        self.fc.kill_node({"nodeId": node})

    def recovered(self, fault: dict) -> bool:
        """Steps trained after the start that followed the fault (after the outage for ``s3_outage``), and a
        checkpoint past them: the next fault then has something to roll back to."""
        recs = self.records()
        if fault["kind"] == "s3_outage":
            since, resumed = fault["back"], fault["before"]
        else:
            starts = _starts(recs, fault["time"])
            if not starts:
                return False
            since, resumed = starts[0]["time"], starts[0]["samples_seen"]
        if len([r for r in _train(recs) if r["time"] > since]) < 2:
            return False
        # Saved past both the resume point and where the fault hit: a checkpoint from before the fault does not count.
        return self.newest_checkpoint() > max(resumed, fault["before"])

    def newest_checkpoint(self) -> int:
        """samples_seen of the run's newest checkpoint on S3 (0: none yet)."""
        from lightray import storage
        from lightray.train.state import list_checkpoints

        saved = list_checkpoints(storage.join(self.read_uri, self.name))  # newest first
        return saved[0][0] if saved else 0

    # -- the run -----------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Submit, inject the plan, wait for the job to succeed; times of the first step and of the end."""
        t0 = time.time()
        self.submit(resume=False)
        first = self.wait(lambda: _train(self.records()), "the first step (on the autoscaler's first machines)")
        out: dict[str, Any] = {"first_step_s": round(first[0]["time"] - t0, 1), "not_injected": []}
        shares = self.share_figures(self.records())
        self.progress({"event": "first_step", "first_step_s": out["first_step_s"], "data_share": shares[:1]})
        self.wait(self.newest_checkpoint, "the first checkpoint")  # a fault before it would only start the run over
        for i, kind in enumerate(self.plan):
            fault = self.inject(kind)
            if self.wait(lambda fault=fault: self.recovered(fault), f"recovery from {kind}", ended_ok=True) is None:
                out["not_injected"] = self.plan[i + 1:]  # the run finished first: too late to tell for these
                break
            if "stopped_pid" in fault:  # the stopped worker must not be left behind (it would hold its GPU)
                fault["hung_process_ended"] = stopped_process_ended(fault.pop("stopped_pid"))
            self.progress({"event": "recovered", **self.fault_figure(fault, self.records(), float("inf"))})
        self.wait(lambda: self.status() == "SUCCEEDED", "the run's end", timeout=STEP_TIMEOUT_S * 2)
        out["wall_s"] = round(time.time() - t0, 1)
        return out

    def progress(self, line: dict[str, Any]) -> None:
        """One line to ``--progress`` (a test follows the soak as it goes) and a note for the person watching."""
        note(f"soak: {json.dumps(line)}")
        if self.progress_file is not None:
            with open(self.progress_file, "a") as f:
                f.write(json.dumps(line) + "\n")

    def fault_figure(self, f: dict, recs: list[dict], end: float) -> dict[str, Any]:
        """One fault's figures from the records up to ``end`` (the next fault): the start that followed it, the
        samples trained again (the last step reported before that start minus its resume point) and the seconds
        from the fault to the first step after it (after the endpoint came back, for an outage)."""
        train = _train(recs)
        starts = [s for s in _starts(recs, f["time"]) if s["time"] < end]
        since = f.get("back") or (starts[0]["time"] if starts else None)
        first = next((r for r in train if since is not None and since < r["time"] < end), None)
        lost = None
        if starts:
            reported = [r["samples_seen"] for r in train if r["time"] < starts[0]["time"]]
            lost = max(0, (reported[-1] if reported else 0) - starts[0]["samples_seen"])
        out = {**{k: v for k, v in f.items() if k != "time"}, "at": round(f["time"], 1), "lost_samples": lost,
               "starts": len(starts), "resumed_at": starts[0]["samples_seen"] if starts else None,
               "restart_s": round(first["time"] - f["time"], 1) if first else None}
        if f["kind"] == "notice":  # did the run write its preemption checkpoint before the machine went?
            out["checkpointed_before_deadline"] = any(
                r.get("event") == "preemption_checkpoint" and f["time"] < r.get("time", 0) <= f["time"] + NOTICE_S
                for r in recs)
        return out

    def fault_figures(self, recs: list[dict], finished: bool) -> tuple[dict, list[dict]]:
        """Per kind: injected, survived (a step after it, and the run finished), samples trained again, the worst
        restart; and each fault's own figures."""
        out = {k: {"injected": 0, "survived": 0, "lost_samples": 0, "restart_s": []} for k in KINDS}
        ends = [f["time"] for f in self.injected[1:]] + [float("inf")]
        details = [self.fault_figure(f, recs, end) for f, end in zip(self.injected, ends)]
        for d in details:
            row = out[d["kind"]]
            row["injected"] += 1
            row["survived"] += int(finished and d["restart_s"] is not None)
            row["lost_samples"] += d["lost_samples"] or 0
            if d["restart_s"] is not None:
                row["restart_s"].append(d["restart_s"])
        for row in out.values():
            row["restart_s"] = max(row["restart_s"]) if row["restart_s"] else None  # the worst one of the kind
        return out, details

    def share_figures(self, recs: list[dict]) -> list[dict]:
        """Ray Data's CPU share at each worker-group start, beside the machines alive then (sampled)."""
        rows = []
        for r in recs:
            if r.get("unit") != "data_share":
                continue
            seen = [n for t, n in self.alive if t <= r["time"]]
            rows.append({"time": round(r["time"], 1), "world_size": r["world_size"], "cluster_cpus": r["cluster_cpus"],
                         "train_cpus": r["train_cpus"], "data_cpus": r["data_cpus"],
                         "tasks_in_flight": r.get("tasks_in_flight"),
                         "machines_alive": seen[-1] if seen else None,
                         "sized_from_nodes_then": r["data_cpus"] == max(0.5, r["cluster_cpus"] - r["train_cpus"])
                         and r["cluster_cpus"] >= r["train_cpus"]})
        return rows


def audit(soak: Soak) -> dict[str, Any]:
    """The exact sample audit over the ranks' sample logs and the run's own config and plan (read from S3)."""
    from lightray import storage

    folder = soak.work / "audit"
    folder.mkdir(exist_ok=True)
    run = storage.join(soak.read_uri, soak.name)
    for name in ("config.yaml", "data.json"):
        (folder / name).write_bytes(storage.read_bytes(storage.join(run, name)))
    if not (folder / "sample_log").exists():
        (folder / "sample_log").symlink_to(soak.work / "sample_log")
    diff = same_multiset(carried_samples(folder), planned_samples(folder))
    return {"audit_exact": diff == {}, "audit_diff": {str(k): v for k, v in diff.items()}}


def figures_of(soak: Soak, timings: dict[str, Any]) -> dict[str, Any]:
    from lightray import storage

    summary = json.loads(storage.read_bytes(storage.join(soak.read_uri, soak.name, "summary.json")))
    recs = soak.records()
    finished = summary["status"] == "finished"
    faults, details = soak.fault_figures(recs, finished)
    shares = soak.share_figures(recs)
    placement = [{"time": round(r["time"], 1), "unit": r["unit"], "message": r.get("message", "")}
                 for r in recs if r.get("unit") in ("decode_on", "augment_on")]
    return {
        "status": summary["status"], "samples_seen": summary["samples_seen"], "epochs": soak.epochs,
        "restarts": summary["restarts"], "max_failures": soak.max_failures, "plan": soak.plan, "jobs": len(soak.jobs),
        "machine_losses": sum(soak.plan.count(k) for k in MACHINE_KINDS), "faults": faults, "injections": details,
        "worker_group_starts": len(_starts(recs, 0.0)), "data_share_per_start": shares,
        "every_share_sized_from_nodes_then": bool(shares) and all(r["sized_from_nodes_then"] for r in shares),
        "placement_records": placement, "cost": summary.get("cost"),
        "all_survived": all(r["survived"] == r["injected"] for r in faults.values()),
        "driver_restart_s": [d["restart_s"] for d in details if d["kind"] == "driver_kill"],
        **timings, **audit(soak),
    }


def keep_logs(fc, soak: Soak, dest: pathlib.Path, file_mb: float = 20, total_mb: float = 300) -> pathlib.Path:
    """Every job's driver log and the cluster's own log files (Train controller, raylets, GCS, autoscaler),
    copied to ``dest`` before the cluster stops and its temp dir goes with it: a soak that failed in CI can be
    read afterwards. Files over ``file_mb`` are left out; copying stops at ``total_mb``."""
    import shutil

    dest.mkdir(parents=True, exist_ok=True)
    for job in soak.jobs:
        try:
            res = subprocess.run(["ray", "job", "logs", job], env=fc.env(RAY_ADDRESS=fc.dashboard_url),
                                 capture_output=True, text=True, timeout=60)
            (dest / f"job-{job}.log").write_text(res.stdout + res.stderr)
        except (subprocess.SubprocessError, OSError) as exc:
            (dest / f"job-{job}.log").write_text(f"ray job logs {job} failed: {exc}\n")
    budget = total_mb * 2**20
    for f in sorted(pathlib.Path(fc.temp_dir).rglob("*")):
        if "logs" not in f.parts or not f.is_file() or f.is_symlink():
            continue
        size = f.stat().st_size
        if size > file_mb * 2**20 or size > budget:
            continue
        target = dest / "cluster" / f.relative_to(fc.temp_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, target)
        budget -= size
    return dest


def refused_without_token(fc) -> int | None:
    """The HTTP status the cluster's job API answers a caller without its token (token auth is on: 401 or 403)."""
    import urllib.error

    try:
        fc.get("/api/jobs/", token=False)
    except urllib.error.HTTPError as err:
        return err.code
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--machine-losses", type=int, default=15, help="machines lost (split over loss, notice, hang)")
    p.add_argument("--driver-kills", type=int, default=3)
    p.add_argument("--outages", type=int, default=1, help=f"S3 outages of {OUTAGE_S:g} s")
    p.add_argument("--short", action="store_true", help="one fault of each kind (the CI form)")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault order and of the run")
    p.add_argument("--keep", metavar="DIR", help="keep the run's local files (cache, sample log) here, and on a "
                   "failure the cluster's and the jobs' logs in DIR/logs")
    p.add_argument("--progress", metavar="FILE", help="append a JSON line here at the first step and each recovery")
    return p


def soak_on_a_fresh_stack(plan: list[str], seed: int, work: pathlib.Path, progress: str | None) -> dict[str, Any]:
    """A local S3 server behind its relay, the autoscaling cluster with the head alone, the soak; its figures."""
    import pyarrow.fs as pafs

    from tests.imds_server import ImdsServer
    from tests.ports import free_port
    from tests.s3_relay import S3Relay
    from tests.s3_server import LocalS3Server

    fcm = fake_cluster_module()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the S3 server's line per request
    os.environ.update(S3_ENV)
    server = LocalS3Server()
    server.start()
    moto_port, relay_port = server.get_host_and_port()[1], free_port()
    relay = S3Relay(relay_port, moto_port)
    query = "scheme=http&region=us-east-1"
    try:
        pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{moto_port}", scheme="http", region="us-east-1",
                          allow_bucket_creation=True).create_dir(BUCKET)
        fc = fcm.FakeCluster()
        # cluster.yaml keeps an idle machine 5 minutes; the fake config's 6 s (for the autoscaler test) removes a
        # machine it just launched as surplus while Ray Train places a resized group on it (measured here: the
        # group's start failed and was retried every 30 s for minutes). One minute: idle machines still go.
        fc.config["idle_timeout_minutes"] = 1.0
        fc.config_path.write_text(json.dumps(fc.config))
        with fc, ImdsServer() as imds:
            os.environ.update(fc.env())  # this process joins the cluster for the notices' spot watchers
            soak = Soak(fc, fcm, relay, imds, f"s3://{BUCKET}/runs?endpoint_override=127.0.0.1:{relay_port}&{query}",
                        f"s3://{BUCKET}/runs?endpoint_override=127.0.0.1:{moto_port}&{query}", work,
                        f"soak-{time.strftime('%H%M%S')}", plan, seed, progress)
            timings = {"cluster_temp_dir": fc.temp_dir, "job_api_without_token": refused_without_token(fc)}
            try:
                timings.update(soak.run())
            except BaseException:  # stuck, failed or stopped from outside: what the cluster logged goes too
                note(f"soak: the cluster's and the jobs' logs kept in {keep_logs(fc, soak, work / 'logs')}")
                raise
            finally:
                import ray

                ray.shutdown()
            return figures_of(soak, timings)
    finally:
        relay.close()
        server.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Stopped from outside (a test's timeout, kill): leave through the finally blocks, which stop the cluster.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    plan = fault_plan(args.seed, args.machine_losses, args.driver_kills, args.outages)
    if args.short:  # in this order, so that a test can follow it: the machines, then the outage and the driver
        plan = [*MACHINE_KINDS, "s3_outage", "driver_kill"]
    json_out = json_stdout()
    machine = Machine()
    note(f"soak: {len(plan)} faults in this order: {', '.join(plan)}")
    with tempfile.TemporaryDirectory(prefix="bench-soak-", dir="/tmp") as tmp:
        work = pathlib.Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        figures = soak_on_a_fresh_stack(plan, args.seed, work, args.progress)
    nodes = ("Ray's autoscaler, fake multi-node provider: a head with no CPU, worker machines of 2 CPUs "
             "(3 spot, 1 on demand)")
    emit("soak", figures, {}, machine.finish(argv, nodes=nodes), out=json_out)
    return 0 if figures["all_survived"] and figures["audit_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
