"""``python app/run.py --tune``: a Ray Tune experiment whose trials are lightray training runs.

Each trial is a function (Train V2 style) that builds the trial's config from the base recipe and the
sampled values and calls ``run_training`` with storage = the experiment folder and name = the Tune
trial id, so the trial's run (checkpoints, metrics.jsonl, summary.json) lives in
``<experiment>/<trial_id>/`` and a restarted trial continues from its own checkpoints. The Train run
reports to Tune through ``TrialReportCallback`` (a ``TuneReportCallback``) in its RunConfig callbacks.
Optuna (TPE, seeded, multivariate; or random) proposes, ASHA stops the weak trials at epoch rungs.

Experiment folder ``<storage>/<name>/``: ``tune_space.yaml`` + ``base_config.yaml`` (what ``--resume``
reads back), ``optuna.db`` (the study), Tune's own state (``Tuner.restore``), one run folder per
trial, and at the end ``trials.json``, ``best_recipe.yaml``, ``search.png`` and ``report/``.
"""

from __future__ import annotations

import json
import logging
import math
import pathlib
import sys
import time
import warnings
from typing import Any, TextIO

import yaml
from ray import tune

from lightray.config import Config, ConfigError, config_from_dict
from lightray.driver import guard as driver_guard
from lightray.tune.free import FreeTrialResources, PlacementGroupRecorder
from lightray.tune.objective import REACHED, Objective, TrialReportCallback
from lightray.tune.report import fmt_value as _fmt
from lightray.tune.report import importances, write_search_report
from lightray.tune.rungs import TIME_ATTR, make_asha, rung_milestones, stop_rung
from lightray.tune.shared import SharedStart, build_shared
from lightray.tune.space import (
    SearchSpace,
    apply_params,
    base_for_trials,
    describe,
    load_space,
    parse_space,
    resolve_space_path,
    trial_runner,
)
from lightray.tune.trial_startup import TRIAL_START_FILE, trial_startup
from lightray.tune.trial_startup import summarize as summarize_startup

log = logging.getLogger("lightray.tune")

SPACE_FILE = "tune_space.yaml"
BASE_FILE = "base_config.yaml"
TRIALS_FILE = "trials.json"
BEST_FILE = "best_recipe.yaml"
PLOT_FILE = "search.png"
STUDY_FILE = "optuna.db"
# The trial function only builds a config and waits on its TorchTrainer (whose controller asks for no
# CPU); the real CPU goes to the Train workers, which reserve their own resources outside the trial.
TRIAL_CPU = 0.1
# Left free per concurrent trial for Ray Data's preprocessing tasks (ray#44687: starved Data deadlocks).
DATA_CPU_PER_TRIAL = 0.5


# --- the trial --------------------------------------------------------------------------------------------
def trial_dirname(trial) -> str:
    return f"tune_{trial.trial_id}"


def run_trial(config: dict[str, Any], *, base: dict[str, Any], exp_dir: str, objective: dict[str, Any],
              shared: SharedStart | None = None, inline: bool = False) -> None:
    """Tune trial function: one lightray run with the sampled values, reporting through the callback.
    With ``shared`` the run skips the prepare, the decode and the calibration the experiment did once.
    With ``inline`` its one worker trains in this process and reports to Tune itself (no worker group)."""
    from lightray import storage
    from lightray.driver.runner import run_training
    from lightray.train.state import list_checkpoints

    started = time.time()  # the trial's clock for its start-up breakdown (the actor process may be older)
    trial_id = tune.get_context().get_trial_id()
    cfg = apply_params(config_from_dict(base), {**(shared.preprocess if shared else {}), **config})
    cfg.storage, cfg.name = exp_dir, trial_id
    # A trial restarted by Tuner.restore finds its earlier checkpoints and continues from them.
    resume = bool(list_checkpoints(storage.join(exp_dir, trial_id)))
    storage.write_json(storage.join(exp_dir, trial_id, TRIAL_START_FILE),
                       {"start": started, "shared": shared is not None, "runner": "inline" if inline else "train"})
    common = {"resume": resume, "progress": False, "manifest": shared.manifest if shared else None,
              "shared_tiers": shared.tier_refs if shared else None}
    if inline:
        run_training(cfg, inline=True, on_report=inline_reporter(Objective(**objective)), **common)
        return
    callbacks = [TrialReportCallback(Objective(**objective)), PlacementGroupRecorder(storage.join(exp_dir, trial_id))]
    run_training(cfg, callbacks=callbacks, **common)


# --- sizing -----------------------------------------------------------------------------------------------
def trial_bundles(cfg: Config, inline: bool = False, gpu: bool = False) -> list[dict[str, float]]:
    """The trial's placement group: its own bundle, plus one slot for driver-side shard tasks.

    Tune places every task the trial process starts inside the trial's placement group (never in its
    first bundle, which is the trial's), and the run's driver side starts shard tasks (prepare,
    object-store materialize) of ``data.prepare_cpus_per_task`` CPUs each: one slot runs them in turn.
    A ``train`` trial only waits on its worker group (which reserves its own resources), so its bundle is
    small; an ``inline`` trial is the worker, so its bundle holds the worker's CPUs (and, with ``gpu``, a GPU)."""
    if not inline:
        return [{"CPU": TRIAL_CPU}, {"CPU": cfg.data.prepare_cpus_per_task}]
    own = {"CPU": cfg.scaling.cpus_per_worker, **cfg.scaling.worker_resources}
    if gpu:
        own["GPU"] = 1.0
    return [own, {"CPU": cfg.data.prepare_cpus_per_task}]


def inline_reporter(objective: Objective):
    """What an inline trial reports to Tune: the validated checkpoint reports, with the objective's fields
    (the same filter ``TrialReportCallback`` applies to a Train run's reports)."""

    def report(metrics: dict[str, Any]) -> None:
        out = objective.for_tune(metrics)
        if out is not None:
            tune.report(out)

    return report


def trial_cpus(cfg: Config, inline: bool = False) -> float:
    return round(sum(b["CPU"] for b in trial_bundles(cfg, inline)), 3)


def fit_concurrency(cfg: Config, wanted: int, resources: dict[str, float],
                    inline: bool = False) -> tuple[int, str]:
    """How many trials fit the cluster at once (at most ``wanted``), and a note when fewer than asked."""
    _, hi = cfg.worker_range()
    cpus = resources.get("CPU", 0.0)
    group = 0 if inline else hi  # an inline trial's worker is in its own bundle (counted in trial_cpus)
    per_trial_cpu = trial_cpus(cfg, inline) + group * cfg.scaling.cpus_per_worker + DATA_CPU_PER_TRIAL
    fit = int(cpus // per_trial_cpu + 1e-9)
    why = f"{cpus:g} CPUs / ({trial_cpus(cfg, inline):g} trial + {group} x {cfg.scaling.cpus_per_worker:g} " \
          f"worker + {DATA_CPU_PER_TRIAL:g} data) CPUs per trial"
    gpus = resources.get("GPU", 0.0)
    if cfg.scaling.use_gpu == "true" or (cfg.scaling.use_gpu == "auto" and gpus >= 1):
        fit = min(fit, int(gpus // hi))
        why += f", {gpus:g} GPUs / {hi} per trial"
    if fit < 1:
        raise ConfigError(f"--concurrent: one trial needs more than the cluster has ({why}); lower "
                          "scaling.workers or scaling.cpus_per_worker in the space's fixed keys")
    if fit < wanted:
        return fit, f"--concurrent {wanted} does not fit the cluster ({why}): running {fit} at once"
    return wanted, ""


class ConsoleLines(tune.Callback):
    """One line per validated trial result and one per finished trial, instead of Tune's big tables.
    (Prints to sys.stdout: Tune pickles its callbacks with the experiment, so it holds no stream.)"""

    def __init__(self, metric: str) -> None:
        self.metric = metric

    def on_trial_result(self, iteration, trials, trial, result, **info):
        print(f"  trial {trial.trial_id}: epoch {result.get('epoch')} {self.metric}={_fmt(result.get(self.metric))} "
              f"({result.get('time_total_s', 0):.0f} s)", flush=True)

    def on_trial_complete(self, iteration, trials, trial, **info):
        print(f"  trial {trial.trial_id}: done", flush=True)

    def on_trial_error(self, iteration, trials, trial, **info):
        print(f"  trial {trial.trial_id}: error (see {trial.path})", flush=True)


# --- the experiment ---------------------------------------------------------------------------------------
def _resolve_experiment(cfg: Config, space_arg: str | None, resume: bool) -> tuple[pathlib.Path, str]:
    from lightray.driver.runner import default_storage

    storage = cfg.storage or default_storage()
    if "://" in storage:
        raise ConfigError(f"storage: bad value {storage!r}; --tune keeps its study and trial table in a local "
                          "(or mounted shared) folder; expected a path")
    root = pathlib.Path(storage).expanduser().resolve()
    name = cfg.name
    if resume and not name:
        found = sorted(root.glob(f"*/{SPACE_FILE}"), key=lambda p: p.stat().st_mtime)
        if not found:
            raise FileNotFoundError(f"--tune --resume: no tune experiment (a folder with {SPACE_FILE}) in {root}")
        name = found[-1].parent.name
    if not name:
        name = f"tune-{resolve_space_path(space_arg).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    return root / name, str(root)


def _prepare_base(cfg: Config, storage: str) -> Config:
    """The config every trial starts from: shared shard cache, no run name of its own."""
    from lightray.data.prepare import resolve_cache_root

    base = config_from_dict(cfg.to_dict())
    base.storage, base.name = storage, ""
    # Trials run under the experiment folder; they must still share one shard cache (the default run's).
    cache = resolve_cache_root(base)
    base.data.cache_dir = cache if "://" in cache else str(pathlib.Path(cache).resolve())
    return base


def _study_storage(space: SearchSpace, exp_dir: pathlib.Path):
    import optuna

    url = space.study_storage or f"sqlite:///{exp_dir / STUDY_FILE}"
    try:
        return optuna.storages.RDBStorage(url=url)
    except Exception as exc:  # optuna raises several types for a bad URL; the user needs the URL named
        raise ConfigError(f"study_storage: cannot open {url!r} ({type(exc).__name__}: {exc})") from None


def _searcher(space: SearchSpace, exp_dir: pathlib.Path):
    import optuna
    from ray.tune.search.optuna import OptunaSearch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if space.searcher == "tpe":
            sampler = optuna.samplers.TPESampler(seed=space.seed, multivariate=space.multivariate,
                                                 n_startup_trials=space.n_startup_trials, constant_liar=True)
        else:
            sampler = optuna.samplers.RandomSampler(seed=space.seed)
    return OptunaSearch(space=space.optuna_space(), metric=space.tune_metric, mode=space.tune_mode,
                        sampler=sampler, study_name=exp_dir.name, storage=_study_storage(space, exp_dir))


def _scheduler(space: SearchSpace, rungs: dict[str, Any]):
    from ray.tune.schedulers import FIFOScheduler

    if space.scheduler == "fifo":
        return FIFOScheduler()
    return make_asha(space, rungs)  # rungs in samples seen, at phase boundaries (lightray.tune.rungs)


def _stop(space: SearchSpace) -> dict[str, float] | None:
    stop: dict[str, float] = {}
    if space.budget_time_s:
        stop["time_total_s"] = space.budget_time_s
    if space.objective == "time_to_target":
        stop[REACHED] = 1  # nothing more to learn from a trial once it is there
    return stop or None


def run_search(cfg: Config, space: str | None = None, trials: int | None = None, concurrent: int | None = None,
               resume: bool = False, *, stream: TextIO | None = None, verbose: int = 0) -> dict[str, Any]:
    """Run (or with ``resume``, continue) a search; returns {experiment_dir, trials, best, files}."""
    out = stream or sys.stdout
    exp_dir, storage = _resolve_experiment(cfg, space, resume)
    base, sp = _load_experiment(cfg, space, exp_dir, storage, resume)
    _apply_counts(sp, trials, concurrent, resume, out)
    trial_base = base_for_trials(base, sp)
    inline = trial_runner(sp, trial_base) == "inline"
    _save_experiment(exp_dir, base, sp, resume)
    k, manifest = _start_cluster(cfg, trial_base, sp, exp_dir, out, inline)
    t0 = time.time()
    shared = None
    if sp.share_startup:
        shared = build_shared(trial_base)
        print(shared.describe() + f" ({time.time() - t0:.1f} s)", file=out, flush=True)
    shared_s = time.time() - t0
    rungs = rung_milestones(trial_base, sp, manifest.num_samples("train"))
    if sp.scheduler == "asha":
        print(f"  ASHA rungs at epochs {rungs['epochs']} = samples seen {rungs['samples']}", file=out, flush=True)
    grid = _tuner(trial_base, sp, exp_dir, storage, k, resume, verbose, out, shared, rungs, inline).fit()
    result = _finish(grid, sp, exp_dir, trial_base, t0, out, rungs)
    result["shared_build_s"] = round(shared_s, 2)  # once per experiment, before the first trial
    return result


def _load_experiment(cfg: Config, space: str | None, exp_dir: pathlib.Path, storage: str,
                     resume: bool) -> tuple[Config, SearchSpace]:
    """The base config and the space: read back from the experiment folder, or new from ``cfg``."""
    saved = exp_dir / SPACE_FILE
    if resume:
        if not saved.is_file():
            raise FileNotFoundError(f"--tune --resume: {exp_dir} is not a tune experiment (no {SPACE_FILE})")
        base = config_from_dict(yaml.safe_load((exp_dir / BASE_FILE).read_text()))
        raw_space = yaml.safe_load(saved.read_text())
        return base, parse_space(raw_space, base, str(saved))
    if saved.is_file():
        raise FileExistsError(f"tune experiment {exp_dir} exists; pass --resume to continue it or use "
                              "another --name")
    base = _prepare_base(cfg, storage)
    return base, load_space(space, base)


def _apply_counts(sp: SearchSpace, trials: int | None, concurrent: int | None, resume: bool, out: TextIO) -> None:
    """``--trials`` / ``--concurrent`` over the space's own (a resumed experiment keeps what it started with)."""
    if resume and (trials is not None or concurrent is not None):
        print("  note: a resumed experiment keeps the trial count and concurrency it was started with",
              file=out, flush=True)
        trials = concurrent = None
    if trials is not None:
        if trials < 1:
            raise ConfigError(f"--trials: bad value {trials!r}; expected >= 1")
        sp.trials = trials
    if concurrent is not None:
        if concurrent < 1:
            raise ConfigError(f"--concurrent: bad value {concurrent!r}; expected >= 1")
        sp.concurrent = concurrent


def _save_experiment(exp_dir: pathlib.Path, base: Config, sp: SearchSpace, resume: bool) -> None:
    """What ``--resume`` reads back: the base config and the resolved space (written once, at the start)."""
    exp_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        (exp_dir / BASE_FILE).write_text(yaml.safe_dump(base.to_dict(), sort_keys=False))
        (exp_dir / SPACE_FILE).write_text(f"# resolved from {sp.source}\n"
                                          + yaml.safe_dump(sp.to_dict(), sort_keys=False))


def _start_cluster(cfg: Config, trial_base: Config, sp: SearchSpace, exp_dir: pathlib.Path, out: TextIO,
                   inline: bool = False):
    """Connect to Ray, size the concurrency to the cluster, print the plan and prepare the shard cache.

    Returns how many trials run at once and the prepared manifest."""
    import ray

    from lightray.data.manifest import Manifest
    from lightray.data.prepare import prepare_main
    from lightray.driver.runner import connect_ray

    started_here = connect_ray(trial_base, bool(cfg.report.verbose), dashboard=True)
    # Should Ray end this driver (the cluster gone), its guardian says so and prints the --resume command.
    driver_guard.tell_run({"kind": "tune", "name": exp_dir.name, "storage": str(exp_dir.parent),
                           "own_cluster": started_here})
    k, note = fit_concurrency(trial_base, sp.concurrent, ray.cluster_resources(), inline)
    where = "in the trial's own process" if inline else "as Ray Train worker groups"
    print(f"tune experiment {exp_dir}\n  {sp.trials} trials, {k} at once, {sp.budget_epochs} epochs each, trained "
          f"{where}; {sp.searcher} + {sp.scheduler} on {sp.tune_metric} ({sp.tune_mode})\n{describe(sp)}",
          file=out, flush=True)
    if note:
        print(f"  note: {note}", file=out, flush=True)
    # Once here, so that concurrent trials all find the shard cache ready (and the rungs know the data size).
    return k, Manifest.load(str(prepare_main(trial_base)))


def _tuner(trial_base: Config, sp: SearchSpace, exp_dir: pathlib.Path, storage: str, k: int, resume: bool,
           verbose: int, out: TextIO, shared: SharedStart | None, rungs: dict[str, Any],
           inline: bool = False) -> tune.Tuner:
    """A new Tuner, or on ``resume`` the experiment's own restored from its folder."""
    from lightray.driver.runner import gpu_wanted

    objective = {"kind": sp.objective, "metric": sp.metric, "target": sp.target}
    trainable = tune.with_resources(
        tune.with_parameters(run_trial, base=trial_base.to_dict(), exp_dir=str(exp_dir), objective=objective,
                             shared=shared, inline=inline),
        tune.PlacementGroupFactory(trial_bundles(trial_base, inline, inline and gpu_wanted(trial_base))))
    if resume and tune.Tuner.can_restore(str(exp_dir)):
        print("  resuming: finished trials are kept, unfinished ones restart from their checkpoints",
              file=out, flush=True)
        return tune.Tuner.restore(str(exp_dir), trainable, resume_unfinished=True, resume_errored=False,
                                  restart_errored=False)
    return tune.Tuner(
        trainable,
        tune_config=tune.TuneConfig(num_samples=sp.trials, max_concurrent_trials=k,
                                    search_alg=_searcher(sp, exp_dir), scheduler=_scheduler(sp, rungs),
                                    trial_dirname_creator=trial_dirname,
                                    # No actor reuse: Tune errors a trial whose predecessor's thread is still
                                    # unwinding its Train run instead of starting a fresh process.
                                    time_budget_s=sp.budget_total_s or None, reuse_actors=False),
        run_config=tune.RunConfig(name=exp_dir.name, storage_path=storage, stop=_stop(sp),
                                  failure_config=tune.FailureConfig(max_failures=0), verbose=verbose,
                                  callbacks=[ConsoleLines(sp.tune_metric), FreeTrialResources(str(exp_dir))]),
    )


def _finish(grid, sp: SearchSpace, exp_dir: pathlib.Path, trial_base: Config, t0: float,
            out: TextIO, rungs: dict[str, Any]) -> dict[str, Any]:
    """Collect the trials, write the outputs and print the table, the best trial and where things are."""
    records = collect_trials(grid, sp, exp_dir, rungs)
    summarize_ended_trials(records)
    result = write_outputs(exp_dir, sp, trial_base, records)
    result["startup"] = summarize_startup(records)
    result["rungs"] = rungs
    result["wall_s"] = time.time() - t0
    print(format_table(records, sp), file=out)
    best = result["best"]
    if best:
        print(f"best: {best['trial_id']} {sp.tune_metric}={_fmt(best['metric'])}  recipe: {result['best_recipe']}\n"
              f"  run it: python app/run.py --config {result['best_recipe']}", file=out)
    else:
        print("best: no trial reported a metric", file=out)
    print(f"plot: {result['plot']}\nreport: {result.get('report')}", file=out, flush=True)
    return result


# --- results ----------------------------------------------------------------------------------------------
def _trial_state(res, sp: SearchSpace, metrics: dict[str, Any]) -> str:
    if res.error is not None:
        return "ERROR"
    if sp.tune_metric not in metrics:
        return "NO_RESULT"
    if sp.objective == "time_to_target" and metrics.get(REACHED):
        return "REACHED_TARGET"
    if metrics.get("epoch", 0) < sp.budget_epochs:
        return "EARLY_STOPPED"
    return "COMPLETED"


def collect_trials(grid, sp: SearchSpace, exp_dir: pathlib.Path,
                   rungs: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One record per trial: {trial_id, params, metric, time_s, state, run_dir, epochs, samples_seen,
    stop_rung, start, startup}."""
    milestones = (rungs or {}).get("samples", []) if sp.scheduler == "asha" else []
    names = {p.key for p in sp.params}
    records = []
    for res in grid:
        metrics = res.metrics or {}
        tid = metrics.get("trial_id") or pathlib.Path(res.path).name.removeprefix("tune_")
        val = metrics.get(sp.tune_metric)
        records.append({
            "trial_id": tid,
            "params": {k: v for k, v in (res.config or {}).items() if k in names},
            "metric": val if isinstance(val, (int, float)) and math.isfinite(val) else None,
            "time_s": round(float(metrics.get("time_total_s", 0.0)), 2),
            "state": _trial_state(res, sp, metrics),
            "run_dir": str(exp_dir / tid),
            "epochs": metrics.get("epoch", 0),
            "val_top1": metrics.get("val_top1"),
            "error": None if res.error is None else str(res.error).splitlines()[0][:300],
            "samples_seen": metrics.get(TIME_ATTR),
            "stop_rung": stop_rung(metrics.get(TIME_ATTR), milestones),
            "start": _trial_start(exp_dir / tid),
            "startup": trial_startup(str(exp_dir / tid)),
        })
    return records  # Tune's order: the order the searcher proposed them


class TrialError(RuntimeError):
    """A trial that Tune reports failed and whose own code wrote no summary.json."""


def summarize_ended_trials(records: list[dict[str, Any]]) -> int:
    """summary.json for each trial whose own code did not write one, from the files the trial wrote.

    Tune ends a trial it stops (ASHA at a rung, the trial's time budget, a reached target) with its process,
    while the trial waits inside ``tune.report``: the run's own end, which writes summary.json, never comes.
    Its status here is "stopped" with ``stopped_by`` (Tune's state and the rung), or "failed" with Tune's
    error. Returns how many were written."""
    from lightray.driver.billing import read_billing
    from lightray.driver.runner import gpu_wanted
    from lightray.report.summary import write_summary_from_files

    written = 0
    for r in records:
        run_dir = pathlib.Path(r["run_dir"])
        if (run_dir / "summary.json").exists() or not (run_dir / "config.yaml").is_file():
            continue  # finished by itself, or ended before it wrote anything a summary could say
        try:
            cfg = config_from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
            planned = json.loads((run_dir / "schedule.json").read_text()).get("epochs")
        except (OSError, ValueError, ConfigError) as exc:
            log.warning("no summary.json for trial %s: %s", r["trial_id"], exc)
            continue
        t0 = r["start"] or (run_dir / "config.yaml").stat().st_mtime
        failed = r["state"] in ("ERROR", "NO_RESULT")
        billing = read_billing(str(run_dir))
        write_summary_from_files(
            cfg, str(run_dir), str(run_dir), t0, t0 + r["time_s"], planned, use_gpu=gpu_wanted(cfg),
            error=TrialError(r["error"] or "the trial reported no result") if failed else None,
            billing=billing if billing["attempts"] else None, status=None if failed else "stopped",
            extra=None if failed else {"stopped_by": {"tune_state": r["state"], "stop_rung": r["stop_rung"],
                                                      "samples_seen": r["samples_seen"]}})
        written += 1
    return written


def _trial_start(run_dir: pathlib.Path) -> float | None:
    try:
        return float(json.loads((run_dir / TRIAL_START_FILE).read_text())["start"])
    except (OSError, ValueError, KeyError):
        return None


def best_trial(records: list[dict[str, Any]], sp: SearchSpace) -> dict[str, Any] | None:
    scored = [r for r in records if r["metric"] is not None]
    if not scored:
        return None
    return (max if sp.tune_mode == "max" else min)(scored, key=lambda r: r["metric"])


def write_outputs(exp_dir: pathlib.Path, sp: SearchSpace, trial_base: Config,
                  records: list[dict[str, Any]]) -> dict[str, Any]:
    (exp_dir / TRIALS_FILE).write_text(json.dumps(records, indent=1, default=str))
    best = best_trial(records, sp)
    out: dict[str, Any] = {"experiment_dir": str(exp_dir), "trials": records, "best": best,
                           "trials_file": str(exp_dir / TRIALS_FILE), "best_recipe": None}
    if best is not None:
        out["best_recipe"] = str(write_best_recipe(exp_dir / BEST_FILE, trial_base, best, sp))
    out["plot"] = str(plot_search(exp_dir / PLOT_FILE, records, sp, exp_dir))
    try:
        out["search_report"] = write_search_report(exp_dir)
    except Exception as exc:  # the search's own outputs stand without the drawings
        log.warning("search report failed: %s", exc)
        out["search_report"] = None
    try:
        from lightray.report.markdown import make_report

        out["report"] = str(make_report(str(exp_dir)))
    except Exception as exc:  # the search's own outputs stand without the markdown report
        log.warning("experiment report failed: %s", exc)
        out["report"] = None
    return out


def write_best_recipe(path: pathlib.Path, trial_base: Config, best: dict[str, Any], sp: SearchSpace) -> pathlib.Path:
    cfg = apply_params(trial_base, best["params"])
    tree = cfg.to_dict()
    for k in ("name", "storage", "recipe"):
        tree.pop(k, None)
    head = (f"# Best trial {best['trial_id']} of tune experiment {path.parent.name}: "
            f"{sp.tune_metric} = {_fmt(best['metric'])} ({sp.tune_mode}) after {best['epochs']} epochs.\n"
            f"# Searched: {json.dumps(best['params'])}\n"
            f"# The per-trial budget is kept (schedule.epochs={sp.budget_epochs}); raise it for a full run.\n"
            f"# Run: python app/run.py --config {path}\n")
    path.write_text(head + yaml.safe_dump(tree, sort_keys=False))
    return path


def plot_search(path: pathlib.Path, records: list[dict[str, Any]], sp: SearchSpace,
                exp_dir: pathlib.Path) -> pathlib.Path:
    """Left: each trial's metric in trial order and the best so far. Right: Optuna parameter importance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    imp = importances(exp_dir, sp)
    fig, axes = plt.subplots(1, 2 if imp else 1, figsize=(12 if imp else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    xs = [i for i, r in enumerate(records) if r["metric"] is not None]
    ys = [records[i]["metric"] for i in xs]
    colors = {"COMPLETED": "tab:blue", "EARLY_STOPPED": "tab:orange", "REACHED_TARGET": "tab:green"}
    for state, color in colors.items():
        pts = [(x, y) for x, y in zip(xs, ys) if records[x]["state"] == state]
        if pts:
            ax.scatter(*zip(*pts), color=color, label=state.lower().replace("_", " "), zorder=3)
    if ys:
        best, run = [], None
        for y in ys:
            run = y if run is None else (max(run, y) if sp.tune_mode == "max" else min(run, y))
            best.append(run)
        ax.step(xs, best, where="post", color="gray", label="best so far")
    ax.set_xticks(range(len(records)))
    ax.set_xticklabels([r["trial_id"] for r in records], rotation=45, fontsize=7)
    ax.set_xlabel("trial (in the order proposed)")
    ax.set_ylabel(sp.tune_metric)
    ax.set_title(f"search: {sp.searcher} + {sp.scheduler}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if imp:
        ax2 = axes[0][1]
        keys = list(imp)[::-1]
        ax2.barh(keys, [imp[k] for k in keys], color="tab:purple")
        ax2.set_xlabel("importance (Optuna fANOVA)")
        ax2.set_title("parameter importance")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def format_table(records: list[dict[str, Any]], sp: SearchSpace) -> str:
    """The trial table: id, each parameter, the metric, trial seconds, epochs run and state."""
    keys = [p.key for p in sp.params]
    header = ["trial"] + keys + [sp.tune_metric, "time_s", "epochs", "state"]
    rows = [[r["trial_id"]] + [_fmt(r["params"].get(k)) for k in keys]
            + [_fmt(r["metric"]), f"{r['time_s']:.1f}", str(r["epochs"]), r["state"]] for r in records]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])

