"""Typed configuration: one dataclass per component, YAML recipes, dotted overrides.

Each component owns its section (``data``, ``model``, ``optim``, ``schedule``, ``scaling``,
``comm``, ``checkpoint``, ``report``, ``cost``). A recipe is a YAML file with those sections; the
command line overrides single keys as ``--section.key=value``. Every problem with a value raises
``ConfigError`` naming the key, the bad value and what is allowed; the CLI turns it into exit
status 2 with that one line.
"""

from __future__ import annotations

import dataclasses
import pathlib
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

RECIPES_DIR = pathlib.Path(__file__).parent / "recipes"


class ConfigError(ValueError):
    """A bad configuration value; ``str(err)`` is the one line shown to the user."""


@dataclass
class Phase:
    """One stage of progressive resizing: applies to epochs before ``until_epoch``."""

    until_epoch: int
    resolution: int
    batch_size: int
    min_scale: float = 0.35


@dataclass
class DataConfig:
    source: str = "demo"  # "demo", a local ImageFolder path, or a pyarrow URI (s3://...)
    cache_dir: str = ""  # shared shard cache; "" = <storage>/cache
    local_cache_dir: str = ""  # node-local copy of shards (NVMe); "" = /tmp/lightray-cache
    memory_budget_mb: int = 1024  # tiers whose decoded size fits go to the object store
    jpeg_quality: int = 90
    raw_max_resolution: int = 64  # tiers at or below this store raw uint8 pixels, not JPEG
    shard_rows: int = 512
    tiers: list[int] = field(default_factory=list)  # [] = derived from the schedule
    val_mode: str = "center"  # center | rect
    val_crop_ratio: float = 0.875
    preprocess_concurrency: int = 0  # preprocessing tasks in flight, all ranks together; 0 = autotune
    preprocess_cpus: float = 0.0  # logical CPUs each preprocessing task reserves; 0 = autotune (else 0.25)
    unit_rows: int = 0  # global rows per preprocessing task (before the split across ranks); 0 = autotune
    autotune_seconds: float = 4.0  # length of the start-up calibration; 0 = off (defaults or pinned values)
    val_batch_size: int = 256  # images per rectangular validation batch (val_mode=rect), all ranks together
    prefetch_batches: int = 2
    demo_seed: int = 0
    demo_classes: int = 10
    demo_train_per_class: int = 320
    demo_val_per_class: int = 60
    limit_train: int = 0  # 0 = all; smoke runs use a small subset
    limit_val: int = 0
    verify_cache: bool = False  # prepare re-hashes every cached shard (sha256) and rebuilds any that fail
    prepare_cpus_per_task: float = 0.5  # fractional: prepare must never starve Train workers of whole CPUs
    prepare_concurrency: int = 0  # max prepare tasks at once; 0 = one per logical CPU of the cluster
    prepare_io_threads: int = 8  # source reads in flight per prepare task (object stores are latency-bound)


@dataclass
class ModelConfig:
    arch: str = "resnet_tiny"  # resnet_tiny | resnet18 | resnet34 | resnet50
    zero_init_residual: bool = True
    channels_last: bool = True
    compile: bool = False  # torch.compile, GPU only
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16 | fp16
    compile_mode: str = "default"  # torch.compile mode: default | reduce-overhead | max-autotune
    cudnn_benchmark: bool = True  # let cuDNN time conv algorithms per shape (GPU only)
    tf32: bool = True  # TF32 matmul/conv for the parts that stay fp32 (Ampere+ GPUs only)


@dataclass
class OptimConfig:
    name: str = "sgd"  # sgd | lars | lamb
    lr_per_256: float = 0.4
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 5e-5
    bn_bias_decay: bool = False  # fast.ai / Goyal et al.: no weight decay on BN and bias
    trust_coefficient: float = 0.001  # LARS
    label_smoothing: float = 0.1
    ema_decay: float = 0.0  # 0 = off
    grad_clip: float = 0.0  # 0 = off
    fused: bool = True  # fused (GPU) / foreach multi-tensor optimizer kernels; false = per-tensor loop
    lamb_beta2: float = 0.999  # LAMB second-moment decay (beta1 = momentum)
    lamb_eps: float = 1e-6
    lars_eps: float = 1e-8  # LARS trust-ratio denominator guard


@dataclass
class ScheduleConfig:
    epochs: int = 8
    warmup_epochs: float = 1.0
    warmup_start_factor: float = 0.1
    decay: str = "cosine"  # linear | cosine | poly | step | none
    poly_power: float = 2.0
    step_milestones: list[float] = field(default_factory=list)  # epochs, for decay=step
    step_gamma: float = 0.1
    final_lr_factor: float = 0.0
    momentum_schedule: bool = False  # cycle momentum inversely to the LR (one-cycle style)
    phases: list[Phase] = field(
        default_factory=lambda: [Phase(until_epoch=8, resolution=64, batch_size=256)]
    )
    eval_resolution: int = 0  # 0 = the last phase's resolution
    tta_flip: bool = False


@dataclass
class ScalingSection:
    workers: str = "2"  # "N" or "MIN:MAX" (elastic)
    use_gpu: str = "auto"  # auto | true | false
    cpus_per_worker: float = 0.5
    ray_address: str = "auto"  # auto: join a running cluster, else start one; local: always a new local one
    ray_num_cpus: int = 0  # logical CPUs for a local cluster; 0 = 2 x cores
    max_failures: int = 10  # worker/node failures tolerated (preemptions with notice are not counted)
    resize_check_s: float = 60.0  # how often an elastic run looks for more nodes
    worker_resources: dict[str, float] = field(default_factory=dict)  # extra per-worker resources, e.g. {GPU_node: 1}
    seed: int = 0
    # Spot interruption watcher (app/train/spot_watcher.py): auto = on for nodes with GPUs, or on every node
    # when spot_endpoint is changed from the AWS default; on = every node; off = none.
    spot_watcher: str = "auto"
    spot_endpoint: str = "http://169.254.169.254"  # instance metadata service (IMDSv2) base URL
    spot_poll_s: float = 5.0  # AWS gives two minutes' notice; 5 s polls leave ~115 s to checkpoint


@dataclass
class CommConfig:
    mode: str = "dense"  # dense | fp16 | bf16 | topk | hierarchical_topk | powersgd
    ratio: float = 0.01
    warmup_steps: int = 20
    error_feedback: bool = True
    bucket_mb: float = 0.0  # 0 = adaptive fusion measures it
    powersgd_rank: int = 2
    resize_dense_steps: int = 1  # dense steps after a resume with a different worker set (residuals reset)
    # Deep Gradient Compression units (app/train/dgc.py), for topk / hierarchical_topk:
    momentum_correction: bool = False  # the hook accumulates velocity; the SGD optimizer then runs momentum 0
    local_clip: float = 0.0  # clip each local bucket gradient to local_clip / sqrt(world) before accumulating; 0 = off
    momentum_masking: bool = False  # zero the velocity where entries were sent (with momentum_correction)
    sparsity_warmup_epochs: float = 0.0  # ratio ramps exponentially from sparsity_warmup_start to ratio; 0 = off
    sparsity_warmup_start: float = 0.25
    selection: str = "exact"  # exact | sampled (threshold from a random sample, exact top-k as fallback)
    per_layer: bool = False  # topk: ratio of each parameter tensor in a bucket (as DGC), not of the whole bucket


@dataclass
class CheckpointSection:
    every_steps: int = 0  # 0 = every epoch
    every_minutes: float = 0.0
    keep: int = 3
    stop_after_steps: int = 0  # end the run (with a checkpoint) after this many steps; --resume continues


@dataclass
class ReportSection:
    every_steps: int = 20
    tensorboard: bool = True
    targets: list[float] = field(default_factory=lambda: [0.5, 0.8])  # top-1 targets
    top5_targets: list[float] = field(default_factory=list)  # e.g. [0.93] for the DAWNBench target
    log_samples: bool = False  # each rank records the sample ids of every step (audits of the epoch plan)
    mlflow: str = ""
    verbose: bool = False
    progress_every_s: float = 1.0  # console progress poll interval (ProgressPrinter every_s)


@dataclass
class CostSection:
    # Price key (of price_per_hour) of the training machines, used when a run did not measure seconds per
    # node type: "<instance type>" for on-demand, "<instance type>-spot" for spot. On a cluster built from
    # cluster.yaml each node also carries its key as the node label ``lightray-price-key``.
    node_type: str = "local"
    gpus_per_node: int = 0  # devices per machine, to turn device-hours into node-hours; 0 = one device per node
    # USD per machine-hour. On-demand: AWS us-west-2 Linux list prices; spot: typical recent us-west-2 spot
    # prices (they move; check the console's spot pricing history before a large run).
    price_per_hour: dict[str, float] = field(
        default_factory=lambda: {"local": 0.0, "m6i.2xlarge": 0.384,
                                 "g5.48xlarge-spot": 4.9, "g5.48xlarge": 16.288,
                                 "p3.16xlarge-spot": 7.34, "p3.16xlarge": 24.48}
    )


@dataclass
class Config:
    name: str = ""
    storage: str = ""
    recipe: str = "demo"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    scaling: ScalingSection = field(default_factory=ScalingSection)
    comm: CommConfig = field(default_factory=CommConfig)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    report: ReportSection = field(default_factory=ReportSection)
    cost: CostSection = field(default_factory=CostSection)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def worker_range(self) -> tuple[int, int]:
        return parse_workers(self.scaling.workers)


# Allowed values, checked after every load and override.
CHOICES: dict[str, tuple[str, ...]] = {
    "model.arch": ("resnet_tiny", "resnet18", "resnet34", "resnet50"),
    "model.precision": ("auto", "fp32", "bf16", "fp16"),
    "model.compile_mode": ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
    "optim.name": ("sgd", "lars", "lamb"),
    "schedule.decay": ("linear", "cosine", "poly", "step", "none"),
    "scaling.use_gpu": ("auto", "true", "false"),
    "scaling.spot_watcher": ("auto", "on", "off"),
    "comm.mode": ("dense", "fp16", "bf16", "topk", "hierarchical_topk", "powersgd"),
    "comm.selection": ("exact", "sampled"),
    "data.val_mode": ("center", "rect"),
}
# (low, high, inclusive-low): numbers must lie in [low, high].
RANGES: dict[str, tuple[float, float]] = {
    "optim.lr_per_256": (0.0, 100.0),
    "optim.momentum": (0.0, 0.9999),
    "optim.weight_decay": (0.0, 1.0),
    "optim.label_smoothing": (0.0, 0.99),
    "optim.ema_decay": (0.0, 0.99999),
    "optim.trust_coefficient": (0.0, 10.0),
    "optim.grad_clip": (0.0, 1e6),
    "optim.lamb_beta2": (0.0, 0.99999),
    "optim.lamb_eps": (0.0, 1.0),
    "optim.lars_eps": (0.0, 1.0),
    "schedule.epochs": (1, 10000),
    "schedule.warmup_epochs": (0.0, 10000),
    "schedule.warmup_start_factor": (0.0, 1.0),
    "schedule.final_lr_factor": (0.0, 1.0),
    "schedule.step_gamma": (0.0, 1.0),
    "schedule.eval_resolution": (0, 2048),
    "comm.ratio": (1e-6, 1.0),
    "comm.warmup_steps": (0, 10**9),
    "comm.bucket_mb": (0.0, 4096),
    "comm.powersgd_rank": (1, 1024),
    "comm.resize_dense_steps": (0, 10**6),
    "comm.local_clip": (0.0, 1e6),
    "comm.sparsity_warmup_epochs": (0.0, 10000),
    "comm.sparsity_warmup_start": (1e-6, 1.0),
    "data.jpeg_quality": (1, 100),
    "data.memory_budget_mb": (0, 10**7),
    "data.shard_rows": (1, 10**7),
    "data.val_crop_ratio": (0.1, 1.0),
    "data.demo_classes": (2, 1000),
    "data.demo_train_per_class": (1, 10**6),
    "data.demo_val_per_class": (1, 10**6),
    "data.preprocess_concurrency": (0, 4096),
    "data.preprocess_cpus": (0.0, 64),
    "data.unit_rows": (0, 10**6),
    "data.autotune_seconds": (0.0, 600),
    "data.val_batch_size": (1, 10**6),
    "data.prefetch_batches": (0, 64),
    "data.limit_train": (0, 10**9),
    "data.limit_val": (0, 10**9),
    "data.prepare_cpus_per_task": (0.01, 64),
    "data.prepare_concurrency": (0, 100000),
    "data.prepare_io_threads": (1, 256),
    "scaling.cpus_per_worker": (0.01, 1024),
    "scaling.ray_num_cpus": (0, 100000),
    "scaling.max_failures": (-1, 10**6),
    "scaling.resize_check_s": (0.1, 10**6),
    "scaling.spot_poll_s": (0.05, 60.0),
    "checkpoint.every_steps": (0, 10**9),
    "checkpoint.every_minutes": (0.0, 10**6),
    "checkpoint.keep": (1, 10**6),
    "checkpoint.stop_after_steps": (0, 10**9),
    "report.every_steps": (1, 10**9),
    "report.progress_every_s": (0.05, 3600.0),
    "cost.gpus_per_node": (0, 1024),
}


def parse_workers(text: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"1:4"`` -> (1, 4). Raises ConfigError otherwise."""
    parts = str(text).split(":")
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        nums = []
    if len(nums) not in (1, 2) or min(nums, default=0) < 1 or (len(nums) == 2 and nums[0] > nums[1]):
        raise ConfigError(
            f"scaling.workers: bad value {text!r}; expected a positive integer N or MIN:MAX with MIN <= MAX"
        )
    return (nums[0], nums[-1])


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Convert ``value`` (from YAML or the command line) to ``tp`` or raise ConfigError."""
    origin = typing.get_origin(tp)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key}: bad value {value!r}; expected true or false")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: bad value {value!r}; expected an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: bad value {value!r}; expected an integer")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: bad value {value!r}; expected a number")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: bad value {value!r}; expected a number")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: bad value {value!r}; expected a string")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str):
            value = yaml.safe_load(value) if value.strip() else []
        if not isinstance(value, list):
            raise ConfigError(f"{key}: bad value {value!r}; expected a list")
        return [_coerce(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if origin is dict:
        _, val_tp = typing.get_args(tp)
        if isinstance(value, str):
            value = yaml.safe_load(value)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: bad value {value!r}; expected a mapping")
        return {str(k): _coerce(f"{key}.{k}", v, val_tp) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: bad value {value!r}; expected a mapping of {_type_name(tp)} fields")
        return _build(tp, value, key)
    raise ConfigError(f"{key}: unsupported type {_type_name(tp)}")


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in names:
            raise ConfigError(f"{key}: unknown key; allowed keys: {', '.join(sorted(names))}")
        kwargs[k] = _coerce(key, v, hints[k])
    missing = [f.name for f in dataclasses.fields(cls)
               if f.name not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{prefix}.{missing[0]}: missing; a value is required")
    return cls(**kwargs)


def recipe_path(name_or_path: str) -> pathlib.Path:
    """A recipe name (``demo``) or a path to a YAML file."""
    p = pathlib.Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.is_file():
            raise ConfigError(f"--config: file {name_or_path!r} not found")
        return p
    candidate = RECIPES_DIR / f"{name_or_path}.yaml"
    if not candidate.is_file():
        names = sorted(q.stem for q in RECIPES_DIR.glob("*.yaml"))
        raise ConfigError(f"--config: unknown recipe {name_or_path!r}; known recipes: {', '.join(names)}")
    return candidate


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``tree["a"]["b"] = value`` for ``dotted == "a.b"``, creating mappings on the way."""
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        child = node.get(p)
        if not isinstance(child, dict):
            child = {}
            node[p] = child
        node = child
    node[parts[-1]] = value


def load_config(recipe: str = "demo", overrides: dict[str, Any] | None = None) -> Config:
    """Load a recipe (name or YAML path) and apply dotted overrides, then validate."""
    path = recipe_path(recipe)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config: {path} is not valid YAML ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--config: {path} must hold a mapping of sections, got {type(raw).__name__}")
    raw.setdefault("recipe", path.stem)
    tree: dict[str, Any] = {}
    for dotted, value in (overrides or {}).items():
        set_dotted(tree, dotted, value)
    cfg = _build(Config, _merge(raw, tree), "")
    validate(cfg)
    return cfg


def config_from_dict(data: dict[str, Any]) -> Config:
    """Rebuild a Config from ``Config.to_dict()`` output (e.g. a saved run)."""
    cfg = _build(Config, data, "")
    validate(cfg)
    return cfg


def get_dotted(cfg: Config, dotted: str) -> Any:
    node: Any = cfg
    for p in dotted.split("."):
        if not dataclasses.is_dataclass(node) or p not in {f.name for f in dataclasses.fields(node)}:
            raise ConfigError(f"{dotted}: unknown key")
        node = getattr(node, p)
    return node


def key_type(dotted: str) -> Any:
    """The declared type of a dotted key, or ConfigError if there is no such key."""
    cls: Any = Config
    tp: Any = None
    for p in dotted.split("."):
        if not dataclasses.is_dataclass(cls):
            raise ConfigError(f"{dotted}: unknown key")
        hints = typing.get_type_hints(cls)
        if p not in hints:
            raise ConfigError(f"{dotted}: unknown key")
        tp = hints[p]
        cls = tp
    return tp


def validate(cfg: Config) -> None:
    """Range and choice checks that the type system does not express."""
    for key, allowed in CHOICES.items():
        val = get_dotted(cfg, key)
        if val not in allowed:
            raise ConfigError(f"{key}: bad value {val!r}; allowed: {', '.join(allowed)}")
    for key, (lo, hi) in RANGES.items():
        val = get_dotted(cfg, key)
        if not (lo <= val <= hi):
            raise ConfigError(f"{key}: bad value {val!r}; expected a number in [{lo:g}, {hi:g}]")
    parse_workers(cfg.scaling.workers)
    phases = cfg.schedule.phases
    if not phases:
        raise ConfigError("schedule.phases: bad value []; expected at least one phase")
    prev = 0.0
    for i, ph in enumerate(phases):
        key = f"schedule.phases[{i}]"
        if ph.until_epoch <= prev:
            raise ConfigError(f"{key}.until_epoch: bad value {ph.until_epoch!r}; expected > {prev:g} (phases in order)")
        if not 8 <= ph.resolution <= 2048:
            raise ConfigError(f"{key}.resolution: bad value {ph.resolution!r}; expected 8..2048 px")
        if ph.batch_size < 1:
            raise ConfigError(f"{key}.batch_size: bad value {ph.batch_size!r}; expected >= 1")
        if not 0.0 < ph.min_scale <= 1.0:
            raise ConfigError(f"{key}.min_scale: bad value {ph.min_scale!r}; expected in (0, 1]")
        prev = ph.until_epoch
    if phases[-1].until_epoch < cfg.schedule.epochs:
        raise ConfigError(
            f"schedule.phases[{len(phases) - 1}].until_epoch: bad value {phases[-1].until_epoch!r}; "
            f"the phases must cover schedule.epochs={cfg.schedule.epochs:g}"
        )
    if cfg.schedule.warmup_epochs > cfg.schedule.epochs:
        raise ConfigError(
            f"schedule.warmup_epochs: bad value {cfg.schedule.warmup_epochs!r}; expected <= schedule.epochs"
        )
    from app.report.cost import validate_cost

    validate_cost(cfg.cost)
    for key in ("targets", "top5_targets"):
        for t in getattr(cfg.report, key):
            if not 0.0 < t <= 1.0:
                raise ConfigError(f"report.{key}: bad value {t!r}; expected fractions in (0, 1]")
