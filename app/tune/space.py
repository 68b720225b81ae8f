"""Search spaces: ``tune_spaces/*.yaml`` -> a checked ``SearchSpace`` -> Optuna distributions.

A space file (all keys but ``params`` optional)::

    objective: max_metric      # max_metric (default) | time_to_target
    metric: val_top1           # any validation metric the trainer reports (val_top1, val_top5, val_loss)
    mode: max                  # max | min (default: min for *loss, else max)
    target: 0.5                # time_to_target only: the top-1 to reach
    trials: 8                  # --trials overrides
    concurrent: 2              # --concurrent overrides
    budget: {epochs: 3, time_s: 0, total_time_s: 0}   # per trial: schedule.epochs, optional wall-clock cap
                               # (0 = none); total_time_s: the whole search's wall-clock budget (0 = none)
    scheduler: {name: asha, grace_period: 0, reduction_factor: 2, brackets: 1}   # asha | fifo
    share_startup: true        # prepare, decoded tiers and calibration once per experiment (false: per trial)
    trial_runner: auto         # auto | inline | train: where a trial trains (see below)
    searcher: {name: tpe, seed: 0, n_startup_trials: 4, multivariate: true}     # tpe | random
    study_storage: ""          # optuna database URL; "" = sqlite file optuna.db in the experiment folder
    fixed: {data.limit_train: 1024}    # dotted config keys set in every trial
    params:                    # dotted config key -> distribution
      optim.lr_per_256: {dist: loguniform, low: 0.05, high: 3.0}
      schedule.warmup_epochs: {dist: uniform, low: 0.0, high: 1.0}
      optim.label_smoothing: {dist: choice, values: [0.0, 0.1]}
      global_batch: {dist: choice, values: [128, 256, 512]}

``trial_runner``: ``train`` runs each trial as a Ray Train ``TorchTrainer`` (its own worker group);
``inline`` trains a one-worker trial inside the Tune trial's own process (``app/train/inline.py``), which
skips the worker group's start (seconds per trial); ``auto`` is ``inline`` when every trial has exactly one
worker (``scaling.workers: "1"``, not searched) and ``train`` otherwise.

``lr_rule`` (searched only: ``{dist: choice, values: [linear, sqrt]}``) says how the LR follows the global
batch: ``linear`` (the recipes' rule) or ``sqrt`` (see ``apply_lr_rule``).

``global_batch`` is not a config key either: it is the global batch size of the FIRST
phase, and every phase's ``batch_size`` is multiplied by the same factor (global_batch / first phase's
batch_size, rounded, at least 1), so a recipe's dynamic-batch shape (batch shrinking as the images
grow) is kept while the whole run moves to a larger batch. The learning rate follows on its own
because recipes give it per 256 images (``optim.lr_per_256``).

The per-trial budget sets ``schedule.epochs``: phases that would start at or after the budget are
dropped and the last kept phase is cut (or stretched) to end at it; a warm-up longer than the budget is
shortened to it. Everything is checked before any trial runs: an unknown key, inverted bounds or a
distribution that does not fit the key's type raises ``ConfigError`` naming the entry.
"""

from __future__ import annotations

import copy
import importlib.resources
import math
import pathlib
from dataclasses import dataclass, field
from typing import Any

import yaml

from lightray.config import Config, ConfigError, coerce_scalar, config_from_dict, key_type, set_dotted

GLOBAL_BATCH = "global_batch"
LR_RULE = "lr_rule"
LR_RULES = ("linear", "sqrt")
DISTS = ("loguniform", "uniform", "int", "choice")
OBJECTIVES = ("max_metric", "time_to_target")
TRIAL_RUNNERS = ("auto", "inline", "train")
SCHEDULERS = ("asha", "fifo")
SEARCHERS = ("tpe", "random")
TIME_METRIC = "time_to_target_s"
# tune_spaces/ of the checkout, installed as the package data lightray.spaces: found without the repository.
SPACES_DIR = pathlib.Path(str(importlib.resources.files("lightray.spaces")))
TOP_KEYS = ("objective", "metric", "mode", "target", "trials", "concurrent", "budget", "scheduler", "searcher",
            "study_storage", "share_startup", "trial_runner", "fixed", "params")


@dataclass
class Param:
    """One searched key: ``dist`` with ``low``/``high`` (numeric) or ``values`` (choice)."""

    key: str
    dist: str
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False  # int only: sample on a log scale
    values: list[Any] = field(default_factory=list)

    def candidates(self) -> list[Any]:
        """The values that bound this parameter (both ends, or every choice): each must give a valid config."""
        return list(self.values) if self.dist == "choice" else [self.low, self.high]

    def to_optuna(self) -> Any:
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        if self.dist == "choice":
            return CategoricalDistribution(list(self.values))
        if self.dist == "int":
            return IntDistribution(int(self.low), int(self.high), log=self.log)
        return FloatDistribution(float(self.low), float(self.high), log=self.dist == "loguniform")

    def to_dict(self) -> dict[str, Any]:
        if self.dist == "choice":
            return {"dist": "choice", "values": list(self.values)}
        out: dict[str, Any] = {"dist": self.dist, "low": self.low, "high": self.high}
        if self.log:
            out["log"] = True
        return out


@dataclass
class SearchSpace:
    source: str  # the file it came from, for messages
    params: list[Param]
    objective: str = "max_metric"
    metric: str = "val_top1"
    mode: str = "max"
    target: float = 0.5
    trials: int = 8
    concurrent: int = 2
    budget_epochs: int = 0  # 0 = the recipe's schedule.epochs
    budget_time_s: float = 0.0
    budget_total_s: float = 0.0  # the experiment's wall-clock budget (Tune's time_budget_s); 0 = none
    scheduler: str = "asha"
    grace_period: int = 0  # epochs; 0 = from the recipe (see lightray.tune.rungs)
    reduction_factor: float = 2.0
    brackets: int = 1
    searcher: str = "tpe"
    seed: int = 0
    n_startup_trials: int = 4
    multivariate: bool = True
    study_storage: str = ""
    share_startup: bool = True
    trial_runner: str = "auto"
    fixed: dict[str, Any] = field(default_factory=dict)

    @property
    def tune_metric(self) -> str:
        """What Tune, ASHA and Optuna compare: the reported metric, or the time to the target."""
        return TIME_METRIC if self.objective == "time_to_target" else self.metric

    @property
    def tune_mode(self) -> str:
        return "min" if self.objective == "time_to_target" else self.mode

    def optuna_space(self) -> dict[str, Any]:
        return {p.key: p.to_optuna() for p in self.params}

    def to_dict(self) -> dict[str, Any]:
        """The space as a YAML-able mapping that ``parse_space`` reads back to an equal space."""
        return {
            "objective": self.objective, "metric": self.metric, "mode": self.mode, "target": self.target,
            "trials": self.trials, "concurrent": self.concurrent,
            "budget": {"epochs": self.budget_epochs, "time_s": self.budget_time_s,
                       "total_time_s": self.budget_total_s},
            "scheduler": {"name": self.scheduler, "grace_period": self.grace_period,
                          "reduction_factor": self.reduction_factor, "brackets": self.brackets},
            "searcher": {"name": self.searcher, "seed": self.seed, "n_startup_trials": self.n_startup_trials,
                         "multivariate": self.multivariate},
            "study_storage": self.study_storage, "share_startup": self.share_startup,
            "trial_runner": self.trial_runner, "fixed": dict(self.fixed),
            "params": {p.key: p.to_dict() for p in self.params},
        }


def resolve_space_path(path: str | None) -> pathlib.Path:
    """``None`` -> tune_spaces/demo.yaml; a bare name (``large_batch``) -> tune_spaces/NAME.yaml."""
    if not path:
        return SPACES_DIR / "demo.yaml"
    p = pathlib.Path(path)
    if p.is_file():
        return p
    for cand in (SPACES_DIR / p.name, SPACES_DIR / f"{path}.yaml"):
        if cand.is_file() and p.parent in (pathlib.Path("."), pathlib.Path("tune_spaces")):
            return cand
    known = ", ".join(sorted(q.stem for q in SPACES_DIR.glob("*.yaml")))
    raise ConfigError(f"--space: file {path!r} not found; expected a YAML path or one of: {known}")


def load_space(path: str | None, base: Config) -> SearchSpace:
    """Read and check a space file against the base config (every bound must give a valid config)."""
    p = resolve_space_path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML ({str(exc).splitlines()[0]})") from None
    return parse_space(raw, base, str(p))


def _num(where: str, value: Any, integer: bool = False) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{where}: bad value {value!r}; expected {'an integer' if integer else 'a number'}")
    if integer and not float(value).is_integer():
        raise ConfigError(f"{where}: bad value {value!r}; expected an integer")
    return int(value) if integer else value


def _mapping(where: str, value: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: bad value {value!r}; expected a mapping with keys {', '.join(allowed)}")
    for k in value:
        if k not in allowed:
            raise ConfigError(f"{where}.{k}: unknown key; allowed keys: {', '.join(allowed)}")
    return value


def _choice(where: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ConfigError(f"{where}: bad value {value!r}; allowed: {', '.join(allowed)}")
    return str(value)


def _param_type(where: str, key: str) -> Any:
    if key == GLOBAL_BATCH:
        return int
    if key == LR_RULE:
        return str
    if "." not in key:
        raise ConfigError(f"{where}: unknown config key {key!r}; expected a dotted key such as optim.lr_per_256 "
                          f"or {GLOBAL_BATCH}")
    try:
        return key_type(key)
    except ConfigError:
        raise ConfigError(f"{where}: unknown config key {key!r}; expected SECTION.KEY of app/config.py "
                          f"or {GLOBAL_BATCH}") from None


def parse_param(where: str, key: str, spec: Any) -> Param:
    """One ``params`` entry, checked against the declared type of its config key."""
    tp = _param_type(where, key)
    if not isinstance(spec, dict):
        raise ConfigError(f"{where}: bad value {spec!r}; expected a mapping such as "
                          "{dist: loguniform, low: 0.01, high: 1.0} or {dist: choice, values: [...]}")
    dist = spec.get("dist")
    if dist not in DISTS:
        raise ConfigError(f"{where}.dist: bad value {dist!r}; allowed: {', '.join(DISTS)}")
    allowed = ("dist", "values") if dist == "choice" else ("dist", "low", "high") + (("log",) if dist == "int" else ())
    _mapping(where, spec, allowed)
    tname = getattr(tp, "__name__", str(tp))
    if dist == "choice":
        values = spec.get("values")
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{where}.values: bad value {values!r}; expected a non-empty list")
        if tp not in (int, float, str, bool):
            raise ConfigError(f"{where}: key {key} has type {tname}; only numbers, strings and booleans can be "
                              "searched")
        out = []
        for i, v in enumerate(values):
            if isinstance(v, (list, dict)) or v is None:
                raise ConfigError(f"{where}.values[{i}]: bad value {v!r}; expected a {tname}")
            try:
                out.append(coerce_scalar(f"{where}.values[{i}]", v, tp))
            except ConfigError as exc:
                raise ConfigError(f"{exc} (the type of {key})") from None
        if len(set(out)) != len(out):
            raise ConfigError(f"{where}.values: bad value {values!r}; the choices must differ")
        return Param(key, "choice", values=out)
    # numeric distributions
    if tp not in (int, float):
        raise ConfigError(f"{where}.dist: {dist} does not fit key {key} of type {tname}; use dist: choice")
    if tp is int and dist != "int":
        raise ConfigError(f"{where}.dist: {dist} does not fit integer key {key}; use dist: int (log: true for "
                          "a log scale) or dist: choice")
    for end in ("low", "high"):
        if end not in spec:
            raise ConfigError(f"{where}.{end}: missing; {dist} needs low and high")
    integer = dist == "int"
    low = _num(f"{where}.low", spec["low"], integer)
    high = _num(f"{where}.high", spec["high"], integer)
    if not low < high:
        raise ConfigError(f"{where}: inverted bounds low={low!r} high={high!r}; expected low < high")
    log = bool(spec.get("log", False))
    if (dist == "loguniform" or log) and low <= 0:
        raise ConfigError(f"{where}.low: bad value {low!r}; a log scale needs low > 0")
    return Param(key, dist, low=low, high=high, log=log)


def parse_space(raw: Any, base: Config, source: str = "space") -> SearchSpace:
    """Check a space mapping against ``base`` and return it; ConfigError names the bad entry."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping with a params section, got {type(raw).__name__}")
    _mapping(source, raw, TOP_KEYS)
    sp = SearchSpace(source=source, params=[])
    # In file order of the sections, so that the first bad entry is the one reported.
    _parse_objective(sp, raw)
    _parse_counts(sp, raw)
    _parse_budget(sp, raw, base)
    _parse_scheduler(sp, raw)
    _parse_searcher(sp, raw)
    _parse_study_storage(sp, raw)
    share = raw.get("share_startup", True)
    if not isinstance(share, bool):
        raise ConfigError(f"{source}: share_startup: bad value {share!r}; expected true or false")
    sp.share_startup = share
    sp.trial_runner = _choice(f"{source}: trial_runner", raw.get("trial_runner", "auto"), TRIAL_RUNNERS)
    _parse_fixed(sp, raw)
    _parse_params(sp, raw)
    _check_bounds(sp, base)
    return sp


def _parse_objective(sp: SearchSpace, raw: dict[str, Any]) -> None:
    """``objective``, ``metric``, ``mode`` and (time_to_target) ``target``."""
    source = sp.source
    sp.objective = _choice(f"{source}: objective", raw.get("objective", "max_metric"), OBJECTIVES)
    metric = raw.get("metric", "val_top1")
    if not isinstance(metric, str) or not metric.startswith("val_"):
        raise ConfigError(f"{source}: metric: bad value {metric!r}; expected a validation metric such as "
                          "val_top1, val_top5 or val_loss")
    sp.metric = metric
    sp.mode = _choice(f"{source}: mode", raw.get("mode", "min" if metric.endswith("loss") else "max"), ("max", "min"))
    if sp.objective == "time_to_target":
        sp.target = float(_num(f"{source}: target", raw.get("target", 0.5)))
        if not 0.0 < sp.target <= 1.0:
            raise ConfigError(f"{source}: target: bad value {sp.target!r}; expected a top-1 fraction in (0, 1]")
        if sp.metric != "val_top1":
            raise ConfigError(f"{source}: metric: bad value {sp.metric!r}; time_to_target measures val_top1")


def _parse_counts(sp: SearchSpace, raw: dict[str, Any]) -> None:
    """``trials`` and ``concurrent``: integers >= 1."""
    for k in ("trials", "concurrent"):
        v = _num(f"{sp.source}: {k}", raw.get(k, getattr(sp, k)), integer=True)
        if v < 1:
            raise ConfigError(f"{sp.source}: {k}: bad value {v!r}; expected >= 1")
        setattr(sp, k, v)


def _parse_budget(sp: SearchSpace, raw: dict[str, Any], base: Config) -> None:
    """``budget``: epochs per trial (default: the recipe's) and an optional wall-clock cap."""
    source = sp.source
    budget = _mapping(f"{source}: budget", raw.get("budget"), ("epochs", "time_s", "total_time_s"))
    sp.budget_epochs = int(_num(f"{source}: budget.epochs", budget.get("epochs", base.schedule.epochs), True))
    if sp.budget_epochs < 1:
        raise ConfigError(f"{source}: budget.epochs: bad value {sp.budget_epochs!r}; expected >= 1")
    sp.budget_time_s = float(_num(f"{source}: budget.time_s", budget.get("time_s", 0.0)))
    if sp.budget_time_s < 0:
        raise ConfigError(f"{source}: budget.time_s: bad value {sp.budget_time_s!r}; expected >= 0 (0 = no cap)")
    sp.budget_total_s = float(_num(f"{source}: budget.total_time_s", budget.get("total_time_s", 0.0)))
    if sp.budget_total_s < 0:
        raise ConfigError(f"{source}: budget.total_time_s: bad value {sp.budget_total_s!r}; expected >= 0 "
                          "(0 = no budget)")


def _parse_scheduler(sp: SearchSpace, raw: dict[str, Any]) -> None:
    """``scheduler``: asha (rungs in epochs, within the budget) or fifo."""
    source = sp.source
    sched = _mapping(f"{source}: scheduler", raw.get("scheduler"), ("name", "grace_period", "reduction_factor",
                                                                   "brackets"))
    sp.scheduler = _choice(f"{source}: scheduler.name", sched.get("name", "asha"), SCHEDULERS)
    sp.grace_period = int(_num(f"{source}: scheduler.grace_period", sched.get("grace_period", 0), True))
    if not 0 <= sp.grace_period <= sp.budget_epochs:
        raise ConfigError(f"{source}: scheduler.grace_period: bad value {sp.grace_period!r}; expected 1.."
                          f"{sp.budget_epochs} (epochs, at most budget.epochs), or 0 for the end of the "
                          "longest warm-up the space can sample")
    sp.reduction_factor = float(_num(f"{source}: scheduler.reduction_factor", sched.get("reduction_factor", 2)))
    if sp.reduction_factor <= 1:
        raise ConfigError(f"{source}: scheduler.reduction_factor: bad value {sp.reduction_factor!r}; expected > 1")
    sp.brackets = int(_num(f"{source}: scheduler.brackets", sched.get("brackets", 1), True))
    if sp.brackets < 1:
        raise ConfigError(f"{source}: scheduler.brackets: bad value {sp.brackets!r}; expected >= 1")


def _parse_searcher(sp: SearchSpace, raw: dict[str, Any]) -> None:
    """``searcher``: Optuna's TPE or random sampler and their settings."""
    source = sp.source
    srch = _mapping(f"{source}: searcher", raw.get("searcher"), ("name", "seed", "n_startup_trials", "multivariate"))
    sp.searcher = _choice(f"{source}: searcher.name", srch.get("name", "tpe"), SEARCHERS)
    sp.seed = int(_num(f"{source}: searcher.seed", srch.get("seed", 0), True))
    sp.n_startup_trials = int(_num(f"{source}: searcher.n_startup_trials", srch.get("n_startup_trials", 4), True))
    if sp.n_startup_trials < 1:
        raise ConfigError(f"{source}: searcher.n_startup_trials: bad value {sp.n_startup_trials!r}; expected >= 1")
    mv = srch.get("multivariate", True)
    if not isinstance(mv, bool):
        raise ConfigError(f"{source}: searcher.multivariate: bad value {mv!r}; expected true or false")
    sp.multivariate = mv


def _parse_study_storage(sp: SearchSpace, raw: dict[str, Any]) -> None:
    storage = raw.get("study_storage", "") or ""
    if not isinstance(storage, str):
        raise ConfigError(f"{sp.source}: study_storage: bad value {storage!r}; expected a database URL or \"\"")
    sp.study_storage = storage


def _parse_fixed(sp: SearchSpace, raw: dict[str, Any]) -> None:
    """``fixed``: dotted config keys (or global_batch) set in every trial."""
    fixed = raw.get("fixed") or {}
    if not isinstance(fixed, dict):
        raise ConfigError(f"{sp.source}: fixed: bad value {fixed!r}; expected a mapping of dotted config keys")
    for k in fixed:
        if k == LR_RULE:
            raise ConfigError(f"{sp.source}: fixed.{LR_RULE}: only a searched key (linear is what recipes do "
                              "without it); put it under params as {dist: choice, values: [linear, sqrt]}")
        _param_type(f"{sp.source}: fixed.{k}", str(k))
    sp.fixed = {str(k): v for k, v in fixed.items()}


def _parse_params(sp: SearchSpace, raw: dict[str, Any]) -> None:
    """``params``: the searched keys, none of them also fixed."""
    source = sp.source
    params = raw.get("params")
    if not isinstance(params, dict) or not params:
        raise ConfigError(f"{source}: params: bad value {params!r}; expected a mapping of dotted config keys "
                          "to distributions")
    for key, spec in params.items():
        key = str(key)
        if key in sp.fixed:
            raise ConfigError(f"{source}: params.{key}: also set in fixed; a key is either searched or fixed")
        prm = parse_param(f"{source}: params.{key}", key, spec)
        if key == LR_RULE and (prm.dist != "choice" or not set(prm.values) <= set(LR_RULES)):
            raise ConfigError(f"{source}: params.{key}: bad value {spec!r}; expected {{dist: choice, values: "
                              f"[...]}} with values from {', '.join(LR_RULES)}")
        sp.params.append(prm)


def _check_bounds(sp: SearchSpace, base: Config) -> None:
    """Every bound (or choice) on its own must give a valid config: catches ranges the config refuses."""
    try:
        trial_base = base_for_trials(base, sp)
    except ConfigError as exc:
        raise ConfigError(f"{sp.source}: fixed/budget: {exc}") from None
    for prm in sp.params:
        for v in prm.candidates():
            try:
                apply_params(trial_base, {prm.key: v})
            except ConfigError as exc:
                raise ConfigError(f"{sp.source}: params.{prm.key} = {v!r}: {exc}") from None


def scale_batches(tree: dict[str, Any], global_batch: int) -> None:
    """``global_batch`` -> every phase's batch_size times global_batch / first phase's batch_size."""
    phases = tree["schedule"]["phases"]
    factor = global_batch / phases[0]["batch_size"]
    for ph in phases:
        ph["batch_size"] = max(1, round(ph["batch_size"] * factor))


def apply_budget(tree: dict[str, Any], epochs: int) -> None:
    """Set schedule.epochs, cutting or stretching the phases and warm-up to fit (see the module doc)."""
    sched = tree["schedule"]
    if sched["phases"][0].get("until", 0) > 0:  # fractions of the budget stretch by themselves
        sched["epochs"] = epochs
        return
    kept, start = [], 0
    for ph in sched["phases"]:
        if start >= epochs:
            break
        kept.append(dict(ph))
        start = ph["until_epoch"]
    kept[-1]["until_epoch"] = epochs
    sched["phases"] = kept
    sched["epochs"] = epochs
    sched["warmup_epochs"] = min(float(sched["warmup_epochs"]), float(epochs))


def base_for_trials(base: Config, space: SearchSpace) -> Config:
    """The base config with the space's fixed keys and per-trial budget applied (before any params)."""
    tree = copy.deepcopy(base.to_dict())
    for k, v in space.fixed.items():
        if k == GLOBAL_BATCH:
            scale_batches(tree, int(coerce_scalar(k, v, int)))
        else:
            set_dotted(tree, k, v)
    apply_budget(tree, space.budget_epochs)
    return config_from_dict(tree)


def trial_runner(space: SearchSpace, trial_base: Config) -> str:
    """``inline`` or ``train``: where this experiment's trials train (``trial_runner`` resolved)."""
    one_worker = trial_base.worker_range() == (1, 1) and not any(p.key.startswith("scaling.") for p in space.params)
    if space.trial_runner == "inline" and not one_worker:
        raise ConfigError(f"{space.source}: trial_runner: bad value 'inline' with scaling.workers="
                          f"{trial_base.scaling.workers!r} (or scaling.* searched); expected exactly one worker per "
                          "trial (set scaling.workers: \"1\" in fixed, or use trial_runner: train)")
    if space.trial_runner == "auto":
        return "inline" if one_worker else "train"
    return space.trial_runner


def apply_params(base: Config, params: dict[str, Any]) -> Config:
    """A trial's config: ``base`` with the sampled values set (``global_batch`` scales the phases;
    ``lr_rule`` sets how the LR follows the batch, see :func:`apply_lr_rule`)."""
    tree = copy.deepcopy(base.to_dict())
    for k, v in params.items():
        if k == GLOBAL_BATCH:
            scale_batches(tree, int(v))
        elif k != LR_RULE:
            set_dotted(tree, k, v)
    apply_lr_rule(tree, str(params.get(LR_RULE, "linear")))
    return config_from_dict(tree)


def apply_lr_rule(tree: dict[str, Any], rule: str) -> None:
    """``optim.lr_per_256`` is the LR at a batch of 256. ``linear`` (what recipes do: Goyal et al.) scales
    it by batch / 256; ``sqrt`` (Hoffer et al., Krizhevsky's "one weird trick") by sqrt(batch / 256), so
    ``lr_per_256`` becomes lr_per_256 * sqrt(256 / batch) of the first phase's global batch."""
    if rule == "sqrt":
        batch = tree["schedule"]["phases"][0]["batch_size"]
        tree["optim"]["lr_per_256"] = float(tree["optim"]["lr_per_256"]) * math.sqrt(256.0 / batch)


def describe(space: SearchSpace) -> str:
    """One line per parameter, for the console."""
    lines = []
    for p in space.params:
        rng = f"{p.values}" if p.dist == "choice" else f"[{p.low:g}, {p.high:g}]"
        lines.append(f"  {p.key:<28} {p.dist:<10} {rng}")
    return "\n".join(lines)

