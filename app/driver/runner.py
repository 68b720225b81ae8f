"""Driver side of a run: Ray connection, data preparation, the TorchTrainer, summary.json.

``run_training(cfg)`` is the one function behind ``python app/run.py``, the tuner's trials and the
benchmarks. It blocks until the run ends and returns the summary it wrote.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import ray
import yaml

from lightray import ray_private, startup
from lightray.config import Config, ConfigError, check_arch, default_eval_resolution
from lightray.data.ingest import (
    IngestSpec,
    PhaseSpec,
    add_eval_sweep,
    finalize_spec,
    make_blocks_dataset,
    phase_blocks,
    tier_shards,
    val_dataset,
)
from lightray.data.shard_cache import default_local_dir
from lightray.driver import guard as driver_guard
from lightray.driver import placement
from lightray.schedule import Schedule
from lightray.storage import join, write_bytes
from lightray.train import host_memory
from lightray.train.state import check_checkpoint_format, choose_and_record_resume, list_checkpoints, newest_meta

log = logging.getLogger("lightray")
def default_storage() -> str:
    return os.environ.get("LIGHTRAY_STORAGE", str(pathlib.Path.cwd() / "lightray_runs"))


def resolve_run(cfg: Config, resume: bool = False) -> None:
    """Fill in storage and name (``--resume`` without a name picks the newest run in the storage)."""
    if not cfg.storage:
        cfg.storage = default_storage()
    if "://" not in cfg.storage:
        cfg.storage = str(pathlib.Path(cfg.storage).expanduser().resolve())
    if not cfg.name and resume:
        cfg.name = newest_run(cfg.storage)
        if cfg.name is None:
            raise FileNotFoundError(f"--resume: no run found in storage {cfg.storage}")
    if not cfg.name:
        cfg.name = f"{cfg.recipe}-{time.strftime('%Y%m%d-%H%M%S')}"


def newest_run(storage_path: str) -> str | None:
    """The run in ``storage_path`` (a folder or a URI such as s3://) that started last: every start writes its
    ``config.yaml``, so the newest one names it. None when no folder there holds one (the shard cache does not)."""
    from lightray.storage import FileType, list_dir, resolve_fs

    fs, base = resolve_fs(storage_path)  # one filesystem for the listing and every run's config.yaml
    folders = [e.path for e in list_dir(base, detail=True, fs=fs) if e.type == FileType.Directory]
    configs = [i for i in fs.get_file_info([f"{f}/config.yaml" for f in folders])
               if i.type == FileType.File and i.mtime is not None]
    if not configs:
        return None
    return max(configs, key=lambda i: i.mtime).path.rsplit("/", 2)[-2]


# Ray Train's controller waits this long for every worker to leave its process group before it kills a failed
# group (Ray's default: 30 s). A healthy worker leaves in milliseconds; a hung one (stopped, wedged in a driver
# call) never does, so the default adds 30 s to every hung-peer restart, after the collective timeout. The
# controller reads it from its process's environment: a cluster lightray starts inherits it from this process;
# cluster.yaml and the k8s manifests set it on every node (a job-level runtime_env would also carry it, but
# costs every worker start a round trip to the runtime-env agent: 3 s on a smoke run here).
CLUSTER_ENV = {"TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S": "5"}


def train_env(cfg: Config) -> dict[str, str]:
    """Ray Train's settings that a run puts in the driver's environment, where Ray Train reads them."""
    env = {
        # Ray Train's own barriers (a report with a checkpoint waits for every rank at its synchronization actor)
        # wait forever by default: a peer stopped just before one hung the run for good, where a peer stopped
        # inside a gloo/NCCL collective fails the group after scaling.collective_timeout_s (CI saw it once,
        # 2026-12-05). The same limit for both.
        "RAY_TRAIN_COLLECTIVE_TIMEOUT_S": str(cfg.scaling.collective_timeout_s),
        # A lone worker that hangs has no peer whose collective times out: only the controller's health check sees
        # it, after 10 minutes by default. The same limit for it.
        ray_private.HEALTH_CHECK_TIMEOUT_ENV: str(cfg.scaling.collective_timeout_s),
    }
    lo, hi = cfg.worker_range()
    if lo < hi:  # scaling.elastic_start_timeout_s: a notice's restart waited a minute for its draining machine
        env[ray_private.START_TIMEOUT_ENV] = str(cfg.scaling.elastic_start_timeout_s)
    return env


def connect_ray(cfg: Config, verbose: bool = False, dashboard: bool = False) -> bool:
    """Join the cluster RAY_ADDRESS names or this host's `ray start` recorded, else start a local one, private to
    this run, with more logical CPUs than cores
    (Train workers reserve CPUs; Ray Data's tasks need some left or the run stalls). Returns True when
    this call started the cluster (a local one, which no autoscaler grows).

    ``dashboard``: start the dashboard with a local cluster. Tune needs it: it brings the State API, which
    Ray Train needs to clean up the placement group of a trial that Tune stopped early; without it stopped
    trials keep their CPUs and later trials wait forever. A single run does not, and the dashboard is about
    ten processes (its head and one per module) and several hundred MB on a laptop."""
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"log_to_driver": verbose, "include_dashboard": dashboard}
    try:
        from lightray.report.progress import quiet_ray_logging

        kwargs.update(quiet_ray_logging(verbose))
    except ImportError:
        pass
    address = cfg.scaling.ray_address
    ncpu = cfg.scaling.ray_num_cpus or 2 * (os.cpu_count() or 1)
    # A cluster started below inherits them, and Ray Train hands its own on to its controller and workers; a
    # value the user set wins.
    for key, value in {**CLUSTER_ENV, **train_env(cfg)}.items():
        os.environ.setdefault(key, value)
    ray_private.check()
    if address in ("local", "auto"):  # a cluster may start here: Ray's State API must not ask a dead one
        stale = ray_private.drop_stale_cluster_address()
        if stale:
            log.info("removed Ray's current-cluster file: nothing answers at %s", stale)
    if address == "local":  # always a fresh local cluster (tests, isolated runs)
        _start_local(cfg, ncpu, kwargs)
        return True
    if address == "auto" and not os.environ.get("RAY_ADDRESS"):
        return _join_recorded_or_start(cfg, ncpu, kwargs)
    ray.init(address=None if address == "auto" else address,
             **{k: v for k, v in kwargs.items() if k != "include_dashboard"})
    return False


def _join_recorded_or_start(cfg: Config, ncpu: int, kwargs: dict[str, Any]) -> bool:
    """``auto`` without RAY_ADDRESS: only the cluster this host recorded (`ray start`, as ray up and KubeRay's
    nodes run it), as a bare ray.init() would; else a local one, started here (returns True). Ray's own "auto"
    also joins any GCS process it finds on the host: another run's private local cluster, which ended this run
    when that run ended ("cluster lost")."""
    recorded = ray_private.recorded_cluster_address()
    if not recorded:
        _start_local(cfg, ncpu, kwargs)
        return True
    try:
        ray.init(address=recorded, **{k: v for k, v in kwargs.items() if k != "include_dashboard"})
    except (ConnectionError, RuntimeError, ValueError) as exc:
        # It answers (a dead one's file was dropped before) but refused this driver, a missing auth token most
        # often: training on a private cluster of this machine alone instead would be a silent surprise.
        raise ConfigError(
            f"scaling.ray_address=auto: the Ray cluster this host's `ray start` recorded at {recorded} "
            f"({ray_private.address_file()}) refused this driver: {type(exc).__name__}: {str(exc)[:300]}; "
            "expected to join it (with token auth: RAY_AUTH_MODE=token and its token, as cluster.yaml sets "
            "them), or --scaling.ray_address=local for a private local cluster") from exc
    return False


def _start_local(cfg: Config, ncpu: int, kwargs: dict[str, Any]) -> None:
    """A local cluster; its processes inherit this one's environment, with host memory reuse where wanted."""
    import torch

    setting = cfg.scaling.reuse_host_memory  # only auto asks the CUDA driver (it costs a driver start on a GPU host)
    if host_memory.wanted(setting, torch.cuda.device_count() if setting == "auto" else 0):
        host_memory.apply(os.environ)
    with ray_private.own_address_for_a_local_cluster() as address:
        ray.init(address="local", num_cpus=ncpu, **kwargs)
    started_at = ray.get_runtime_context().gcs_address
    if started_at.rpartition(":")[2] != address.rpartition(":")[2]:
        log.warning("the local Ray cluster's GCS is at %s, not at %s as %s asked (lightray.ray_private): Ray Train's "
                    "placement-group cleaner may ask another cluster on this host about this run",
                    started_at, address, ray_private.GCS_PORT_ENV)


def describe_cluster(started_here: bool) -> str:
    """Which cluster the run is on: started here or joined, its address, nodes, CPUs and GPUs."""
    address = ray.get_runtime_context().gcs_address
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    res = ray.cluster_resources()
    how = "started a local Ray cluster" if started_here else "joined the Ray cluster"
    return (f"{how} at {address}: {len(nodes)} node(s), {res.get('CPU', 0):g} CPUs, "
            f"{res.get('GPU', 0):g} GPUs")


def eval_resolution(cfg: Config) -> int:
    return default_eval_resolution(cfg.schedule)


def build_ingest_spec(cfg: Config, manifest, shared_tiers: dict[str, list] | None = None
                      ) -> tuple[IngestSpec, Schedule]:
    train_size = manifest.num_samples("train")
    sched = Schedule(cfg.schedule, cfg.optim, train_size)
    phases = [PhaseSpec(i, ph.resolution, ph.batch_size, ph.min_scale, ph.first_epoch, ph.end_epoch,
                        tier_shards(manifest, "train", ph.resolution))
              for i, ph in enumerate(sched.resolved.phases)]
    spec = IngestSpec(seed=cfg.scaling.seed, local_dir=cfg.data.local_cache_dir or default_local_dir(),
                      train_size=train_size, phases=phases,
                      val=tier_shards(manifest, "val", _val_tier_want(cfg, eval_resolution(cfg))),
                      eval_resolution=eval_resolution(cfg), val_crop_ratio=cfg.data.val_crop_ratio,
                      map_concurrency=cfg.data.preprocess_concurrency or None,
                      prefetch_batches=cfg.data.prefetch_batches, flip=cfg.data.flip,
                      local_max_bytes=int(cfg.data.local_cache_max_gb * 2**30))
    # Rect val plan, object-store cache level and preprocessing autotune: these run Ray tasks, so Ray is up.
    ranks = cfg.worker_range()[1]
    finalize_spec(spec, cfg.data, ranks * cfg.scaling.cpus_per_worker, gpu_wanted(cfg), shared_tiers, ranks=ranks)
    if cfg.report.eval_sweep:
        tiers = {r: tier_shards(manifest, "val", _val_tier_want(cfg, r)) for r in cfg.report.eval_sweep}
        add_eval_sweep(spec, cfg.report.eval_sweep,
                       {r: spec.val if t.tier == spec.val.tier else t for r, t in tiers.items()}, cfg.data)
    return spec, sched


def _val_tier_want(cfg: Config, resolution: int) -> int:
    """The stored size validation at ``resolution`` reads: a centre crop needs its margin, rect does not."""
    return round(resolution / cfg.data.val_crop_ratio) if cfg.data.val_mode == "center" else resolution


def _train_dataset(run_dir: str, spec: IngestSpec, sched: Schedule, phase: int):
    """Called by Ray Train at every worker-group start: the phase's stream from the resume point."""
    point = choose_and_record_resume(run_dir)
    pos = sched.locate(point.samples_seen)
    return make_blocks_dataset(phase_blocks(spec, phase, pos.epoch, pos.step_in_epoch)
                              if point.samples_seen < sched.total_samples else [])


def _limit_data_resources(cfg: Config) -> None:
    """Cap the driver's Ray Data below what the most Train workers would reserve (ray#44687: starved Data tasks
    deadlock); each worker-group start sizes the workers' share again from the cluster then (PlanDataConfig)."""
    from ray.data import DataContext, ExecutionResources

    from lightray.data.data_share import data_cpu_share

    share = data_cpu_share(cfg.worker_range()[1], cfg.scaling.cpus_per_worker)
    ctx = DataContext.get_current()
    ctx.execution_options.resource_limits = ExecutionResources(cpu=share["data_cpus"])
    ctx.enable_progress_bars = False


def record_to_runlog(run_name: str, record: dict[str, Any]) -> None:
    """Append ``record`` to the run's records from any process of the cluster (the run's log actor)."""
    from lightray.report.runlog import get_runlog

    runlog = get_runlog(run_name)
    if runlog is not None:
        runlog.log.remote(record)


def run_training(cfg: Config, *, resume: bool = False, progress: bool = True, verbose: bool = False,
                 stream=None, callbacks: list | None = None, manifest: str | None = None,
                 shared_tiers: dict[str, list] | None = None, inline: bool = False,
                 on_report: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run (or with ``resume``, continue) one training run; returns the summary written to summary.json.

    ``callbacks`` are Ray Train ``UserCallback``s (the tuner passes ``TuneReportCallback``). ``manifest``
    (a prepared manifest's location) and ``shared_tiers`` (decoded tiers by ``tier_key``) let several runs
    share one prepare and one object-store copy (a search's trials). ``inline`` trains a run of exactly one
    worker in this process instead of a Ray Train worker group (app/train/inline.py; a search's one-worker
    trials); ``on_report`` then gets the metrics of each checkpoint report, as ``callbacks`` would. A second
    driver on a run that a live driver holds raises RunLockedError (a FileExistsError: exit status 2)."""
    from lightray.driver.run_lock import RunLock

    # The worker code (torch, and torchvision with torch._dynamo for a torchvision model) is imported first,
    # while the working directory exists: torch._dynamo reads os.getcwd() at import, and a Ray job's driver can
    # lose its working directory (the unpacked working_dir package) once Ray is up, which failed the job at
    # trainer build. lightray's own models need neither torchvision nor torch._dynamo (2 s of every start).
    from lightray.train.worker import train_loop_per_worker  # noqa: F401

    if check_arch(cfg.model.arch) == "torchvision" or cfg.model.compile:
        import torch._dynamo  # noqa: F401
        import torchvision  # noqa: F401

    resolve_run(cfg, resume)
    # Before anything else touches the run folder: a second driver must not even check its checkpoints.
    with RunLock(join(cfg.storage, cfg.name), pid=driver_guard.driver_pid()) as lock:
        return _run_locked(cfg, resume=resume, progress=progress, verbose=verbose, stream=stream,
                           callbacks=callbacks, manifest_at=manifest, shared_tiers=shared_tiers, lock=lock,
                           inline=inline, on_report=on_report)


def _run_locked(cfg: Config, *, resume: bool, progress: bool, verbose: bool, stream, callbacks: list | None,
                manifest_at: str | None = None, shared_tiers: dict[str, list] | None = None,
                lock=None, inline: bool = False, on_report=None) -> dict[str, Any]:
    from lightray.data.manifest import Manifest
    from lightray.data.prepare import prepare_main
    from lightray.report.record_sync import RecordSync

    run_dir, local_run_dir = _open_run_dir(cfg, resume)
    if resume:  # nothing left to train: the stored summary, without Ray or a worker group (app/driver/finished.py)
        from lightray.driver.finished import already_finished, say_finished

        done = already_finished(cfg, run_dir)
        if done is not None:
            if progress:
                print(say_finished(done, run_dir), file=stream or sys.stdout, flush=True)
            return done
    t0 = time.time()
    # metrics.jsonl, TensorBoard and startup.json follow the run into its storage (a no-op for a local one)
    records = RecordSync(local_run_dir, run_dir, cfg.report.sync_every_s).start()
    startup.reset()
    with startup.phase("ray_start"):
        started_here = connect_ray(cfg, verbose)
    if progress:
        print(f"lightray: {describe_cluster(started_here)}", file=stream or sys.stdout, flush=True)
    if not started_here:  # a cluster that an earlier driver of this run used: free what that driver still books
        _release_dead_runs(cfg, local_run_dir, stream or sys.stdout)
    from lightray.driver.billing import NodeMeter

    meter = NodeMeter(run_dir, cfg.cost.node_type).start()  # every attempt's machine time, kept outside checkpoints
    known: dict[str, Any] = {"own_cluster": started_here}  # what a summary written on a cluster loss can say
    watch = _watch_cluster(cfg, run_dir, local_run_dir, t0, meter, known, lock)
    _tell_guardian(cfg, run_dir, local_run_dir, t0, known)
    try:
        use_gpu = gpu_wanted(cfg)
        waiting = _check_placement(cfg, use_gpu, started_here, stream or sys.stdout)
        with startup.phase("data_prepare"):
            manifest = Manifest.load(manifest_at or str(prepare_main(cfg)))
        fit = fit_to_source(cfg, manifest, stream=(stream or sys.stdout) if progress else None)
        spec, sched = build_ingest_spec(cfg, manifest, shared_tiers)
        spec.event("native_size", fit["message"], native=fit["native_short_side"], changes=fit["changes"])
        known.update(epochs_planned=sched.epochs, use_gpu=use_gpu)
        _tell_guardian(cfg, run_dir, local_run_dir, t0, known)
        setup_start = time.time()
        _write_run_files(cfg, run_dir, manifest, spec, fit)
        _announce_schedule(sched, run_dir, eval_resolution(cfg), stream=(stream or sys.stdout) if progress else None)
        _limit_data_resources(cfg)
        trainer, flush_log = _make_trainer(cfg, run_dir, local_run_dir, spec, sched, len(manifest.classes),
                                           use_gpu, callbacks, inline, on_report)
        startup.add("trainer_setup", setup_start)
        startup.write(local_run_dir)
        error, spot = _fit(trainer, cfg, local_run_dir, flush_log, None if inline else waiting,
                           stream=(stream or sys.stdout) if progress else None)
    finally:
        # Never raises: an error here must not replace the one the run is failing with.
        billing, close_error = close_out(meter, watch, records, local_run_dir)
    summary = _write_result(cfg, run_dir, local_run_dir, t0, sched, use_gpu, error, spot, billing)
    if close_error is not None:  # the run itself finished: say that its records did not all reach storage
        raise close_error
    return summary


def close_out(meter, watch, records, local_run_dir: str) -> tuple[dict | None, Exception | None]:
    """Stop the run's helpers, each whatever the others did: the machine meter (its bill), the cluster watch
    and the records' last copy to storage. Returns (the bill or None, the first error); each error is logged
    with where the records still are, so that one at the end (a storage outage) neither hides the run's own
    error nor stops summary.json from being written."""
    done: dict[str, Any] = {}
    first = None
    for name, stop in (("machine meter", meter.stop), ("cluster watch", watch.stop),
                       ("records' copy to storage", records.stop)):
        try:
            done[name] = stop()
        except Exception as exc:  # noqa: BLE001 - logged here and returned, never lost
            log.error("stopping the %s failed: %s (the run's records are complete in %s)", name, exc,
                      local_run_dir)
            first = first or exc
    return done.get("machine meter"), first


def _make_trainer(cfg: Config, run_dir: str, local_run_dir: str, spec, sched: Schedule, num_classes: int,
                  use_gpu: bool, callbacks: list | None, inline: bool, on_report) -> tuple[Any, Callable[[], None]]:
    """(the trainer to fit, a function that flushes the run's log): a Ray Train worker group whose log an actor
    writes, or with ``inline`` the one worker in this process, which writes the log itself."""
    from lightray.report.runlog import RunLogWriter, start_runlog

    if inline:
        writer = RunLogWriter(local_run_dir, cfg.report.tensorboard)
        trainer = _build_inline(cfg, run_dir, spec, sched, num_classes, on_report, writer.log)
        startup.name_group_phase("inline_start")  # building its streams here, no worker group
        return trainer, writer.flush
    runlog = start_runlog(cfg.name, local_run_dir, cfg.report.tensorboard)
    trainer = _build_trainer(cfg, run_dir, spec, sched, num_classes, use_gpu, callbacks)

    def flush_log() -> None:
        ray.get(runlog.flush.remote())

    return trainer, flush_log


def _release_dead_runs(cfg: Config, local_run_dir: str, stream) -> None:
    """app/driver/stale_runs.py: a resumed run should not wait minutes for its dead drivers' bookings to lapse."""
    from lightray.driver.stale_runs import recorded_run_ids, release_bookings
    from lightray.report.progress import MetricsFileError, read_metrics

    try:
        records = read_metrics(os.path.join(local_run_dir, "metrics.jsonl"))[0]
    except MetricsFileError:
        return  # a new run: no earlier driver
    try:
        released = release_bookings(recorded_run_ids(records))
    except Exception as exc:  # never worth failing a run for: the bookings lapse by themselves in 3 minutes
        print(f"lightray: warning: could not cancel the bookings of earlier drivers of {cfg.name}: {exc}",
              file=stream, flush=True)
        return
    if released:
        print(f"lightray: cancelled the resource bookings of {len(released)} earlier attempt(s) of this run "
              "(their drivers are gone), so the worker group need not wait for them to lapse", file=stream,
              flush=True)


def _watch_cluster(cfg: Config, run_dir: str, local_run_dir: str, t0: float, meter, known: dict[str, Any],
                   lock) -> Any:
    """Watch the cluster's GCS for the whole run: when it is lost, write summary.json (failed, the cause),
    say so, print the resume command and exit (app/driver/cluster_loss.py)."""
    from lightray.driver.cluster_loss import ClusterLostError, ClusterWatch, report_and_exit

    def write(error: ClusterLostError) -> None:
        from lightray.report.summary import write_summary_from_files

        billing = meter.flush()  # no last sample: it asks the cluster that is gone
        try:  # what the run wrote so far; the same summary the driver's guardian writes (guard.py)
            write_summary_from_files(cfg, run_dir, local_run_dir, t0, time.time(), known.get("epochs_planned"),
                                     use_gpu=bool(known.get("use_gpu")), error=error, billing=billing)
        finally:
            if lock is not None:
                lock.release()

    return ClusterWatch(ray.get_runtime_context().gcs_address,
                        lambda cause: report_and_exit(cause, cfg.name, cfg.storage, write)).start()


def _tell_guardian(cfg: Config, run_dir: str, local_run_dir: str, t0: float, known: dict[str, Any]) -> None:
    """What the driver's guardian (app/driver/guard.py) needs to write summary.json, should Ray end this
    process without a word: what the cluster-loss handler above knows, and the run."""
    driver_guard.tell_run({"name": cfg.name, "storage": cfg.storage, "run_dir": run_dir,
                           "local_run_dir": local_run_dir, "t0": t0, "config": cfg.to_dict(), **known})


def _check_placement(cfg: Config, use_gpu: bool, started_here: bool, stream) -> placement.WaitReporter:
    """Fail at once when a cluster this run started (no autoscaler) can never place the worker group; else a
    reporter that says, while the group waits to be placed, what it waits for. Warns when ``auto`` left a
    joined cluster's workers on CPUs."""
    warning = auto_gpu_warning(cfg, use_gpu, started_here)
    if warning:
        log.warning(warning)
        print(warning, file=stream, flush=True)
    lo, hi = cfg.worker_range()
    request = placement.worker_request(cfg.scaling.cpus_per_worker, cfg.scaling.worker_resources, use_gpu)
    if started_here:
        placement.check_local_fit(request, lo, ray.cluster_resources())
    return placement.WaitReporter(request, f"{lo}-{hi}" if lo < hi else str(hi), stream=stream,
                                  can_grow=not started_here)


def _open_run_dir(cfg: Config, resume: bool) -> tuple[str, str]:
    """(run folder, its local mirror for logs); a new run may not reuse a folder that has checkpoints."""
    from lightray.report.record_sync import mirror_dir, pull

    run_dir = join(cfg.storage, cfg.name)
    local_run_dir = mirror_dir(run_dir, cfg.name)
    os.makedirs(local_run_dir, exist_ok=True)
    if not resume and list_checkpoints(run_dir):
        raise FileExistsError(f"run {run_dir} already has checkpoints; pass --resume to continue it or use "
                              "another --name")
    newest = newest_meta(run_dir) if resume else None
    if newest is not None:  # refuse an unsafe format here, once, not in every worker; metas only, no hashing
        check_checkpoint_format(*newest, cfg.checkpoint.allow_pickle)
    if resume:  # on another machine the mirror is empty: the resumed run appends to the stored history
        pull(run_dir, local_run_dir)
    return run_dir, local_run_dir


def fit_to_source(cfg: Config, manifest, stream=None) -> dict[str, Any]:
    """Fit the recipe to the source's native size (app/data/native.py), in place; print what changed and why."""
    from lightray.data import native

    size = manifest.native_short_side
    changes = native.fit_schedule(cfg, size)
    if size is None:
        message = "native size unknown (a cache built before prepare recorded it): phases as the recipe gives them"
    elif changes:
        message = f"native size {size} px (median short side): " + "; ".join(changes)
    else:
        message = f"native size {size} px (median short side): every phase and the eval resolution at or below it"
    if stream is not None:
        print(f"lightray: {message}", file=stream, flush=True)
    return {"native_short_side": size, "changes": changes, "message": message}


def _write_run_files(cfg: Config, run_dir: str, manifest, spec: IngestSpec, fit: dict[str, Any]) -> None:
    """config.yaml, classes.json and data.json: what the run trains, on what data."""
    write_bytes(join(run_dir, "config.yaml"), yaml.safe_dump(cfg.to_dict(), sort_keys=False).encode())
    write_bytes(join(run_dir, "classes.json"), json.dumps(list(manifest.classes)).encode())
    write_bytes(join(run_dir, "data.json"), json.dumps(
        {"manifest": str(manifest.location), "train_samples": spec.train_size, "val_samples": sum(spec.val.rows),
         "phase_tiers": [p.shards.tier for p in spec.phases], "val_tier": spec.val.tier,
         "holdout": manifest.data.get("holdout"), "native_short_side": fit["native_short_side"],
         "fitted_to_native": fit["changes"]}).encode())


def _announce_schedule(sched: Schedule, run_dir: str, eval_res: int, stream=None) -> None:
    """Print the schedule resolved for this budget and save it as schedule.json: what the run will do."""
    resolved = {**sched.resolved.to_dict(), "eval_resolution": eval_res}
    write_bytes(join(run_dir, "schedule.json"), json.dumps(resolved, indent=2).encode())
    if stream is not None:
        print(sched.resolved.describe() + f"\n  eval at {eval_res}px", file=stream, flush=True)


def gpu_wanted(cfg: Config) -> bool:
    """``scaling.use_gpu``: "true", or "auto" when the cluster has a GPU."""
    return cfg.scaling.use_gpu == "true" or (
        cfg.scaling.use_gpu == "auto" and ray.cluster_resources().get("GPU", 0) >= 1)


def auto_gpu_warning(cfg: Config, use_gpu: bool, started_here: bool) -> str | None:
    """The warning for ``scaling.use_gpu=auto`` resolved to the CPU on a cluster the run joined: Ray Train's
    workers ask for CPUs for the whole run, so GPU machines an autoscaler launches later (a cluster that starts
    from a head alone) would train on their CPUs. The autoscaler's node types are not in Ray's public API."""
    if cfg.scaling.use_gpu != "auto" or use_gpu or started_here:
        return None
    return ("lightray: warning: scaling.use_gpu=auto and the cluster has no GPU now: the workers train on CPUs for "
            "the whole run, also on GPU machines an autoscaler adds later; on a cluster that scales GPU machines "
            "from zero, pass --gpu true")


def _build_trainer(cfg: Config, run_dir: str, spec: IngestSpec, sched: Schedule, num_classes: int, use_gpu: bool,
                   callbacks: list | None):
    """The TorchTrainer: elastic worker range, failure and checkpoint policy, one dataset per phase."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from lightray.data.ingest import PlanDataConfig
    from lightray.data.start_decode import PROBE_UNIT
    from lightray.driver.machine_loss import MachineLossCallback
    from lightray.report.runlog import latest_unit
    from lightray.train.worker import train_loop_per_worker

    lo, hi = cfg.worker_range()
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"cfg": cfg.to_dict(), "spec": spec, "run_dir": run_dir, "num_classes": num_classes},
        # Every collective of the process group (gloo and NCCL) fails after this long: a hung peer becomes
        # a worker-group restart within minutes, not after torch's 30-minute default.
        torch_config=TorchConfig(timeout_s=cfg.scaling.collective_timeout_s),
        scaling_config=ScalingConfig(num_workers=(lo, hi) if lo < hi else hi, use_gpu=use_gpu,
                                     resources_per_worker={"CPU": cfg.scaling.cpus_per_worker,
                                                           **cfg.scaling.worker_resources},
                                     elastic_resize_monitor_interval_s=cfg.scaling.resize_check_s),
        run_config=RunConfig(name=cfg.name, **_ray_storage(cfg.storage),
                             failure_config=FailureConfig(max_failures=cfg.scaling.max_failures,
                                                          max_preemption_failures=-1),
                             checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep),
                             # a machine gone without notice: Ray's preemption budget, not max_failures
                             callbacks=[MachineLossCallback(), *(callbacks or [])]),
        datasets=_datasets(run_dir, spec, sched),
        dataset_config=PlanDataConfig(spec, cfg.scaling.cpus_per_worker, partial(record_to_runlog, cfg.name),
                                      partial(latest_unit, cfg.name, PROBE_UNIT)),
    )


def _datasets(run_dir: str, spec: IngestSpec, sched: Schedule) -> dict[str, Any]:
    """Name -> factory of every dataset a run reads, called at each (worker-group) start."""
    datasets = {f"train_p{i}": partial(_train_dataset, run_dir, spec, sched, i) for i in range(len(spec.phases))}
    datasets["val"] = partial(val_dataset, spec)
    for r, sub in spec.sweep.items():
        datasets[f"val_r{r}"] = partial(val_dataset, sub)
    return datasets


def _build_inline(cfg: Config, run_dir: str, spec: IngestSpec, sched: Schedule, num_classes: int, on_report,
                  log: Callable[[dict[str, Any]], None]):
    """The run's one worker in this process (app/train/inline.py), with the same datasets and data config."""
    from lightray.data.ingest import PlanDataConfig
    from lightray.train.inline import InlineTrainer

    lo, hi = cfg.worker_range()
    if (lo, hi) != (1, 1):
        raise ConfigError(f"scaling.workers: bad value {cfg.scaling.workers!r} for a run in this process; "
                          "expected exactly 1 (more workers need Ray Train's worker group)")
    return InlineTrainer({"cfg": cfg.to_dict(), "spec": spec, "run_dir": run_dir, "num_classes": num_classes},
                         _datasets(run_dir, spec, sched), PlanDataConfig(spec), keep=cfg.checkpoint.keep,
                         timeout_s=cfg.scaling.collective_timeout_s, cpus=cfg.scaling.cpus_per_worker,
                         on_report=on_report, log=log)


def _ray_storage(storage_path: str) -> dict[str, Any]:
    """RunConfig storage arguments: an object-store URI goes to Ray Train as the same pyarrow filesystem our
    own storage uses (its endpoint and options, delayed open: Ray's writes of empty marker files otherwise go
    up as empty multipart uploads, which S3-compatible servers may reject)."""
    from lightray.storage import is_uri, resolve_fs

    if not is_uri(storage_path):
        return {"storage_path": storage_path}
    fs, inner = resolve_fs(storage_path)
    return {"storage_path": inner, "storage_filesystem": fs}


def _fit(trainer, cfg: Config, local_run_dir: str, flush_log: Callable[[], Any],
         waiting: placement.WaitReporter | None,
         stream) -> tuple[Exception | None, list[dict]]:
    """Run the trainer to its end with the progress printer (to ``stream``; None = off) and the spot-notice
    watchers around it; returns (the error it ended with, the watchers' statuses). ``waiting`` None: no
    worker group to place and no notices to act on (a run in this process), so neither helper runs."""
    from lightray.driver.spot_watcher import WatcherKeeper

    printer = None
    if stream is not None:
        from lightray.report.progress import ProgressPrinter

        printer = ProgressPrinter(local_run_dir, stream=stream, every_s=cfg.report.progress_every_s,
                                  verbose=cfg.report.verbose).start()
    # One spot-notice watcher per (GPU) node, kept up to date as spot replacements join.
    keeper = None
    if waiting is not None:
        keeper = WatcherKeeper(cfg.scaling, cfg.name, every_s=cfg.scaling.resize_check_s).start()
        waiting.start()
    error = None
    spot: list[dict] = []
    try:
        trainer.fit()
    except Exception as exc:  # summary.json is written for failed runs too
        error = exc
    finally:
        if keeper is not None:
            waiting.stop()
            spot = keeper.statuses()
            keeper.stop()
        flush_log()
        if printer is not None:
            printer.stop()
    return error, spot


def _write_result(cfg: Config, run_dir: str, local_run_dir: str, t0: float, sched: Schedule, use_gpu: bool,
                  error: Exception | None, spot: list[dict], billing: dict | None = None) -> dict[str, Any]:
    """Write summary.json from the run's metrics; re-raise the run's error after writing it."""
    from lightray.report.progress import MetricsFileError, read_metrics
    from lightray.report.summary import write_summary

    try:
        records = read_metrics(os.path.join(local_run_dir, "metrics.jsonl"))[0]
    except MetricsFileError:
        if error is None:
            raise
        records = []  # the run failed before its first metrics line: summary.json must still name the cause
    try:
        summary = write_summary(cfg, run_dir, local_run_dir, records, t0, time.time(), sched.epochs,
                                use_gpu=use_gpu, error=error,
                                spot={"watched_nodes": len(spot),
                                      "notices": sum(s.get("notices", 0) > 0 for s in spot),
                                      "drained": sum(bool(s.get("drained")) for s in spot)},
                                billing=billing)
    except Exception as exc:
        if error is None:
            raise
        # the storage failed too: the run's own error is the one to see (the local summary.json is written first)
        log.error("summary.json not written to %s: %s", run_dir, exc)
    if error is not None:
        raise error
    return summary
