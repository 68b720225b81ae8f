"""Typed configuration: one dataclass per component, YAML recipes, dotted overrides.

Each component owns its section (``data``, ``model``, ``optim``, ``schedule``, ``scaling``,
``comm``, ``checkpoint``, ``report``, ``cost``). A recipe is a YAML file with those sections; the
command line overrides single keys as ``--section.key=value``. Every problem with a value raises
``ConfigError`` naming the key, the bad value and what is allowed; the CLI turns it into exit
status 2 with that one line.

The sections are plain dataclasses (constructing one in code checks nothing, as before); pydantic v2
builds and checks them from YAML and command-line values (``_adapter()``): types through the scalar
types below, allowed values and ranges through ``OneOf``/``Range`` in the field annotations, and the
rules that span several keys in ``check_config``. docs/CONFIG.md says why the scalar conversions are
our own rather than pydantic's lax mode.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import pathlib
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any

import yaml
from pydantic import AfterValidator, BeforeValidator, ConfigDict, TypeAdapter, ValidationError, with_config
from pydantic_core import PydanticCustomError

RECIPES_DIR = pathlib.Path(__file__).parent / "recipes"


class ConfigError(ValueError):
    """A bad configuration value; ``str(err)`` is the one line shown to the user."""


# --- value types: what a YAML or command-line value may be for each declared type ---------------------------
def _bad(value: Any, expected: str) -> PydanticCustomError:
    """A validation error whose message is the part of the user's line after ``key: ``."""
    return PydanticCustomError("config", "{line}", {"line": f"bad value {value!r}; {expected}"})


_BOOL_WORDS = ("true", "false", "1", "0", "yes", "no")


def _to_bool(value: Any) -> bool:
    # Strict on purpose: pydantic's lax bool also takes 1/0, "on"/"off", "t"/"f" and "y"/"n".
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in _BOOL_WORDS:
        return value.lower() in ("true", "1", "yes")
    raise _bad(value, "expected true or false")


def _to_int(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise _bad(value, "expected an integer")


def _to_float(value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise _bad(value, "expected a number")


def _to_str(value: Any) -> str:
    # YAML reads ``workers: 2`` as an int; a string key takes numbers as their text.
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise _bad(value, "expected a string")


def _yaml_list(value: Any) -> list[Any]:
    """A list, or its YAML text from the command line (``"[32, 64]"``; ``""`` = empty)."""
    if isinstance(value, str):
        value = yaml.safe_load(value) if value.strip() else []
    if not isinstance(value, list):
        raise _bad(value, "expected a list")
    return value


def _yaml_mapping(value: Any) -> dict[str, Any]:
    """A mapping, or its YAML text from the command line (``"{GPU_node: 1}"``)."""
    if isinstance(value, str):
        value = yaml.safe_load(value)
    if not isinstance(value, dict):
        raise _bad(value, "expected a mapping")
    return {str(k): v for k, v in value.items()}


Bool = Annotated[bool, BeforeValidator(_to_bool)]
Int = Annotated[int, BeforeValidator(_to_int)]
Float = Annotated[float, BeforeValidator(_to_float)]
Str = Annotated[str, BeforeValidator(_to_str)]
_SCALARS: dict[type, typing.Callable[[Any], Any]] = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}


def OneOf(*allowed: str) -> AfterValidator:  # capitalised: reads as a type in annotations
    """Field constraint: the value must be one of ``allowed``."""

    def check(value: Any) -> Any:
        if value not in allowed:
            raise _bad(value, f"allowed: {', '.join(allowed)}")
        return value

    return AfterValidator(check)


def Range(low: float, high: float) -> AfterValidator:  # capitalised: reads as a type in annotations
    """Field constraint: the number must lie in [low, high]."""

    def check(value: Any) -> Any:
        if not low <= value <= high:
            raise _bad(value, f"expected a number in [{low:g}, {high:g}]")
        return value

    return AfterValidator(check)


def coerce_scalar(where: str, value: Any, tp: type) -> Any:
    """``value`` converted as a config key of type ``tp`` (bool, int, float or str) would be.

    Raises ConfigError ``"<where>: bad value ...; expected ..."``."""
    convert = _SCALARS.get(tp)
    if convert is None:
        raise ConfigError(f"{where}: unsupported type {getattr(tp, '__name__', tp)}")
    try:
        return convert(value)
    except PydanticCustomError as exc:
        raise ConfigError(f"{where}: {exc.message()}") from None


# Every section rejects keys it does not declare.
_section = with_config(ConfigDict(extra="forbid"))


@_section
@dataclass
class Phase:
    """One stage of progressive resizing: applies to epochs before its end.

    The end is ``until`` (a fraction of the budget in (0, 1], so a recipe stretches with
    ``schedule.epochs``) or ``until_epoch`` (an absolute epoch); a recipe gives one kind for every phase.
    0 means "not given"; app/schedule.py resolves both to whole epochs."""

    until_epoch: Int = 0
    resolution: Int = 0
    batch_size: Int = 0
    min_scale: Float = 0.35
    until: Annotated[Float, Range(0.0, 1.0)] = 0.0
    # resolution relative to the source's native size (median short side), instead of resolution: 0.75 on
    # 32 px photos is 24 px; resolved once the data is prepared (app/data/native.py)
    scale: Annotated[Float, Range(0.0, 8.0)] = 0.0


@_section
@dataclass
class DataConfig:
    source: Str = "demo"  # "demo", a local ImageFolder path, or a pyarrow URI (s3://...)
    cache_dir: Str = ""  # shared shard cache; "" = <storage>/cache
    local_cache_dir: Str = ""  # node-local copy of shards (NVMe); "" = /tmp/lightray-cache
    # disk budget of those node-local copies in GiB, least recently used evicted first; 0 = unlimited
    local_cache_max_gb: Annotated[Float, Range(0.0, 10**6)] = 0.0
    memory_budget_mb: Annotated[Int, Range(0, 10**7)] = 1024  # tiers whose decoded size fits go to the object store
    jpeg_quality: Annotated[Int, Range(1, 100)] = 90
    raw_max_resolution: Int = 64  # tiers at or below this store raw uint8 pixels, not JPEG
    shard_rows: Annotated[Int, Range(1, 10**7)] = 512
    tiers: Annotated[list[Int], BeforeValidator(_yaml_list)] = field(default_factory=list)  # [] = from the schedule
    val_mode: Annotated[Str, OneOf("center", "rect")] = "center"
    val_crop_ratio: Annotated[Float, Range(0.1, 1.0)] = 0.875
    # preprocessing tasks in flight, all ranks together; 0 = autotune
    preprocess_concurrency: Annotated[Int, Range(0, 4096)] = 0
    # logical CPUs each preprocessing task reserves; 0 = autotune (else 0.25)
    preprocess_cpus: Annotated[Float, Range(0.0, 64)] = 0.0
    # global rows per preprocessing task (before the split across ranks); 0 = autotune
    block_rows: Annotated[Int, Range(0, 10**6)] = 0
    # length of the start-up calibration; 0 = off (defaults or pinned values)
    autotune_seconds: Annotated[Float, Range(0.0, 600)] = 4.0
    # images per rectangular validation batch (val_mode=rect), all ranks together
    val_batch_size: Annotated[Int, Range(1, 10**6)] = 256
    prefetch_batches: Annotated[Int, Range(0, 64)] = 2
    # where training crops run: auto = the workers' device when they use CUDA (raw tiers), else Ray Data tasks
    augment_on: Annotated[Str, OneOf("auto", "cpu", "device")] = "auto"
    # shift each training image by up to this many pixels each way, edges reflected, on the device after the
    # crop (airbench's translate; app/train/shift.py); 0 = off
    translate: Annotated[Int, Range(0, 64)] = 0
    # training flips: random = a coin per sample and epoch; alternate = a coin per sample, the other way in every
    # odd epoch (airbench's alternating flip: every image seen both ways over any two epochs)
    flip: Annotated[Str, OneOf("random", "alternate")] = "random"
    # where JPEG tiers are decoded: auto = timed at start (CPU tasks vs decode_jpeg on the workers' CUDA device)
    decode_on: Annotated[Str, OneOf("auto", "cpu", "device")] = "auto"
    # decode_on=auto: the model's training images/s per GPU with decode elsewhere (device decode adds to its
    # step time); 0 = unknown: the device only when the GPU decodes >= 1.62x what the CPUs feed
    decode_model_img_s: Annotated[Float, Range(0.0, 10**7)] = 0.0
    demo_seed: Int = 0
    demo_classes: Annotated[Int, Range(2, 1000)] = 10
    demo_train_per_class: Annotated[Int, Range(1, 10**6)] = 320
    demo_val_per_class: Annotated[Int, Range(1, 10**6)] = 60
    # a source without val/ holds out this fraction of each train class as val (0 = 0.1 there; a source with
    # val/ must keep 0: it is scored on val/); seeded by val_seed, recorded in the manifest and data.json
    val_fraction: Annotated[Float, Range(0.0, 0.9)] = 0.0
    val_seed: Int = 0
    limit_train: Annotated[Int, Range(0, 10**9)] = 0  # 0 = all; smoke runs use a small subset
    limit_val: Annotated[Int, Range(0, 10**9)] = 0
    verify_cache: Bool = False  # prepare re-hashes every cached shard (sha256) and rebuilds any that fail
    # fractional: prepare must never starve Train workers of whole CPUs
    prepare_cpus_per_task: Annotated[Float, Range(0.01, 64)] = 0.5
    # max prepare tasks at once; 0 = one per logical CPU of the cluster
    prepare_concurrency: Annotated[Int, Range(0, 100000)] = 0
    # source reads in flight per prepare task (object stores are latency-bound)
    prepare_io_threads: Annotated[Int, Range(1, 256)] = 8


@_section
@dataclass
class ModelConfig:
    # resnet_tiny | any torchvision classification model (resnet50, convnext_tiny) | timm:<name>; checked by check_arch
    arch: Str = "resnet_tiny"
    # channel widths of lightray's own networks, one per stage ([] = the arch's own: resnet_tiny 32/64/128,
    # cifar_vgg 64/256/256)
    widths: Annotated[list[Int], BeforeValidator(_yaml_list)] = field(default_factory=list)
    # Start from these weights: a .safetensors / torch state-dict file, a lightray run folder (its
    # model/best.safetensors), or a hub name (timm:<name> or a torchvision model; needs the network).
    pretrained: Str = ""
    # with pretrained weights: train only the classifier head for this many epochs first
    head_warmup_epochs: Annotated[Float, Range(0.0, 10000)] = 0.0
    zero_init_residual: Bool = True
    channels_last: Bool = True
    # torch.compile the training forward: batch dimension dynamic, each phase resolution static (one compile per
    # phase resolution); on a GPU only unless compile_on_cpu
    compile: Bool = False
    # with compile: compile on a CPU device too (inductor's C++ backend; needs a C compiler): for tests of the
    # compiled path on machines without a GPU, not a speed-up
    compile_on_cpu: Bool = False
    # auto = bf16 on a GPU with bf16 (else fp16); on a CPU bf16 where it has bf16 in hardware (avx512_bf16,
    # amx_bf16), else fp32
    precision: Annotated[Str, OneOf("auto", "fp32", "bf16", "fp16")] = "auto"
    # torch.compile mode
    compile_mode: Annotated[Str, OneOf("default", "reduce-overhead", "max-autotune",
                                       "max-autotune-no-cudagraphs")] = "default"
    cudnn_benchmark: Bool = True  # let cuDNN time conv algorithms per shape (GPU only)
    tf32: Bool = True  # TF32 matmul/conv for the parts that stay fp32 (Ampere+ GPUs only)
    # BatchNorm statistics over the global batch (an all-reduce per BN layer), so the steps do not depend on
    # the worker count; false = each worker normalises its own share (app/comm/global_bn.py says why)
    global_bn: Bool = False
    # set the first conv's filters from the first batch's whitened 2x2 patches and freeze them (cifar_vgg's stem;
    # app/train/whiten.py)
    whiten_stem: Bool = False


@_section
@dataclass
class OptimConfig:
    name: Annotated[Str, OneOf("sgd", "lars", "lamb")] = "sgd"
    lr_per_256: Annotated[Float, Range(0.0, 100.0)] = 0.4
    momentum: Annotated[Float, Range(0.0, 0.9999)] = 0.9
    nesterov: Bool = True
    weight_decay: Annotated[Float, Range(0.0, 1.0)] = 5e-5
    bn_bias_decay: Bool = False  # fast.ai / Goyal et al.: no weight decay on BN and bias
    trust_coefficient: Annotated[Float, Range(0.0, 10.0)] = 0.001  # LARS
    label_smoothing: Annotated[Float, Range(0.0, 0.99)] = 0.1
    ema_decay: Annotated[Float, Range(0.0, 0.99999)] = 0.0  # 0 = off
    # BatchNorm parameters train at this multiple of the LR, their weight decay divided by it so each step decays
    # them as much as the weights (airbench94's 64x bias LR)
    bn_lr_factor: Annotated[Float, Range(0.0, 10000.0)] = 1.0
    # lookahead: every N steps the weights move to a slow average whose decay grows with progress, and take it at
    # the end (airbench94; app/train/lookahead.py); 0 = off
    lookahead_every: Annotated[Int, Range(0, 100000)] = 0
    grad_clip: Annotated[Float, Range(0.0, 1e6)] = 0.0  # 0 = off
    fused: Bool = True  # fused (GPU) / foreach multi-tensor optimizer kernels; false = per-tensor loop
    lamb_beta2: Annotated[Float, Range(0.0, 0.99999)] = 0.999  # LAMB second-moment decay (beta1 = momentum)
    lamb_eps: Annotated[Float, Range(0.0, 1.0)] = 1e-6
    lars_eps: Annotated[Float, Range(0.0, 1.0)] = 1e-8  # LARS trust-ratio denominator guard


@_section
@dataclass
class ScheduleConfig:
    epochs: Annotated[Int, Range(1, 10000)] = 8
    warmup_epochs: Annotated[Float, Range(0.0, 10000)] = 1.0
    # warm-up as a fraction of the budget; > 0 replaces warmup_epochs (setting one key clears the other)
    warmup: Annotated[Float, Range(0.0, 1.0)] = 0.0
    warmup_start_factor: Annotated[Float, Range(0.0, 1.0)] = 0.1
    decay: Annotated[Str, OneOf("linear", "cosine", "poly", "step", "none")] = "cosine"
    poly_power: Float = 2.0
    step_milestones: Annotated[list[Float], BeforeValidator(_yaml_list)] = field(default_factory=list)  # epochs
    step_gamma: Annotated[Float, Range(0.0, 1.0)] = 0.1
    final_lr_factor: Annotated[Float, Range(0.0, 1.0)] = 0.0
    momentum_schedule: Bool = False  # cycle momentum inversely to the LR (one-cycle style)
    phases: Annotated[list[Phase], BeforeValidator(_yaml_list)] = field(
        default_factory=lambda: [Phase(until_epoch=8, resolution=64, batch_size=256)]
    )
    eval_resolution: Annotated[Int, Range(0, 2048)] = 0  # 0 = default_eval_resolution (FixRes rule)
    tta_flip: Bool = False
    # validation also scores each image moved this many pixels diagonally both ways (airbench's "level 2" views)
    tta_translate: Annotated[Int, Range(0, 64)] = 0
    # validate after every Nth epoch and after the last (MLPerf's evaluation interval); 0 = after the last only.
    # Validation runs on the training clock: each epoch's, with flip TTA, costs about a tenth of a CIFAR-10 epoch here
    eval_every_epochs: Annotated[Int, Range(0, 10000)] = 1
    # train and test above the source's native size (upscaled images); off: such phases are clipped to it
    allow_upscale: Bool = False


def _auto_or_whole(what: str) -> typing.Callable[[str], str]:
    """A key that takes ``auto`` or a whole number (of ``what``: its unit and what 0 means), kept as text."""
    def check(value: str) -> str:
        if value != "auto" and not (value.isdigit() and int(value) >= 0):
            raise _bad(value, f"expected auto or a whole number of {what}")
        return value
    return check


_auto_or_count = _auto_or_whole("images >= 0 (0 = no cap)")  # scaling.max_batch_per_device


@_section
@dataclass
class ScalingConfig:
    workers: Str = "2"  # "N" or "MIN:MAX" (elastic)
    use_gpu: Annotated[Str, OneOf("auto", "true", "false")] = "auto"
    cpus_per_worker: Annotated[Float, Range(0.01, 1024)] = 0.5
    # auto: join RAY_ADDRESS's or this host's `ray start` cluster, else start a private one; local: always a new one
    ray_address: Str = "auto"
    ray_num_cpus: Annotated[Int, Range(0, 100000)] = 0  # logical CPUs for a local cluster; 0 = 2 x cores
    # worker/node failures tolerated (preemptions with notice are not counted)
    max_failures: Annotated[Int, Range(-1, 10**6)] = 10
    resize_check_s: Annotated[Float, Range(0.1, 10**6)] = 60.0  # how often an elastic run looks for more nodes
    # How long an elastic run's new worker group waits for its placement before Ray Train sizes it again from the
    # machines then up. Ray counts a machine draining for a spot notice until it is gone, so the group that
    # restarts after the notice's checkpoint is sized onto it and waits this long (Ray's default: 60 s). A
    # fixed-size run keeps Ray's default: it waits for the autoscaler.
    elastic_start_timeout_s: Annotated[Float, Range(1.0, 86400)] = 20.0
    # extra per-worker resources, e.g. {GPU_node: 1}
    worker_resources: Annotated[dict[str, Float], BeforeValidator(_yaml_mapping)] = field(default_factory=dict)
    seed: Int = 0
    # Spot interruption watcher (app/driver/spot_watcher.py): auto = on for nodes with GPUs, or on every node
    # when spot_endpoint is changed from the AWS default; on = every node; off = none.
    spot_watcher: Annotated[Str, OneOf("auto", "on", "off")] = "auto"
    spot_endpoint: Str = "http://169.254.169.254"  # instance metadata service (IMDSv2) base URL
    # AWS gives two minutes' notice; 5 s polls leave ~115 s to checkpoint
    spot_poll_s: Annotated[Float, Range(0.05, 60.0)] = 5.0
    # seconds before a collective (gloo or NCCL) with a missing or hung peer fails and the group restarts
    collective_timeout_s: Annotated[Int, Range(1, 86400)] = 300
    # images one device takes per forward/backward; a rank's share of a phase's global batch is cut into
    # micro-steps of at most this many that accumulate to one optimizer step (app/train/accumulate.py).
    # auto: from the model, resolution and free memory on CUDA, no cap on CPU; 0 = no cap
    max_batch_per_device: Annotated[Str, AfterValidator(_auto_or_count)] = "auto"
    # pin batches in a loader thread and copy them to the GPU one step ahead on a side stream (app/train/prefetch.py)
    device_prefetch: Bool = True
    # open each phase's data stream before its first step: the first while the model is built, the next at the
    # start of the current phase's last epoch (app/train/phase_streams.py). Off by default: on a 2-CPU machine
    # Ray Data's start is CPU work on the step's own cores, and opening it early cost wall time (bench.unit_ab)
    stream_ahead: Bool = False
    # task worker processes each rank starts for its stream's map tasks while its model is built, so that the first
    # map task finds one with its imports done (app/data/warm_workers.py). auto: one on a GPU worker, none on a CPU
    # one, where the warm-up's start is work on the cores that build the model (bench.unit_ab: first step later)
    warm_data_workers: Annotated[Str, AfterValidator(_auto_or_whole("processes >= 0 (0 = none)"))] = "auto"
    # glibc malloc keeps freed blocks for the next step in the processes of a cluster this run starts
    # (app/train/host_memory.py); auto: when it trains on CPUs
    reuse_host_memory: Annotated[Str, OneOf("auto", "true", "false")] = "auto"


@_section
@dataclass
class CommConfig:
    # auto: dense, bf16/fp16 or hierarchical_topk, picked at start by the crossover model (app/comm/auto.py)
    mode: Annotated[Str, OneOf("dense", "fp16", "bf16", "topk", "hierarchical_topk", "powersgd", "auto")] = "dense"
    # the link between nodes, Gbit/s per node, for mode=auto (Ray cannot measure it); 0 = not given
    link_gbps: Annotated[Float, Range(0.0, 1e6)] = 0.0
    ratio: Annotated[Float, Range(1e-6, 1.0)] = 0.01
    warmup_steps: Annotated[Int, Range(0, 10**9)] = 20
    error_feedback: Bool = True
    bucket_mb: Annotated[Float, Range(0.0, 4096)] = 0.0  # 0 = adaptive fusion measures it
    powersgd_rank: Annotated[Int, Range(1, 1024)] = 2
    # dense steps after a resume with a different worker set (residuals reset)
    resize_dense_steps: Annotated[Int, Range(0, 10**6)] = 1
    # Deep Gradient Compression units (app/comm/dgc.py), for topk / hierarchical_topk:
    momentum_correction: Bool = False  # the hook accumulates velocity; the SGD optimizer then runs momentum 0
    # clip each local bucket gradient to local_clip / sqrt(world) before accumulating; 0 = off
    local_clip: Annotated[Float, Range(0.0, 1e6)] = 0.0
    momentum_masking: Bool = False  # zero the velocity where entries were sent (with momentum_correction)
    # the ratio ramps exponentially from sparsity_warmup_start to ratio over these epochs; 0 = off
    sparsity_warmup_epochs: Annotated[Float, Range(0.0, 10000)] = 0.0
    sparsity_warmup_start: Annotated[Float, Range(1e-6, 1.0)] = 0.25
    # exact | sampled (threshold from a random sample, exact top-k as fallback)
    selection: Annotated[Str, OneOf("exact", "sampled")] = "exact"
    per_layer: Bool = False  # topk: ratio of each parameter tensor in a bucket (as DGC), not of the whole bucket
    # sparse all-gather payload: compact = fp16 values (rounding error kept in the residual) + 16-bit block
    # offsets of the sorted indices (4 bytes an entry); fp32 = fp32 values + int32 indices (8 bytes an entry)
    payload: Annotated[Str, OneOf("compact", "fp32")] = "compact"
    # dense, and fp16/bf16 without a dense warm-up, through DDP's own all-reduce / torch's compress hooks (no
    # Python call per bucket) where no lightray unit needs the bucket; false: lightray's hook for every mode
    builtin: Bool = True


@_section
@dataclass
class CheckpointConfig:
    every_steps: Annotated[Int, Range(0, 10**9)] = 0  # 0 = every epoch
    every_minutes: Annotated[Float, Range(0.0, 10**6)] = 0.0
    keep: Annotated[Int, Range(1, 10**6)] = 3
    # end the run (with a checkpoint) after this many steps; --resume continues
    stop_after_steps: Annotated[Int, Range(0, 10**9)] = 0
    # resume from format-1 checkpoints (pickled: loading one can run code); only for files you wrote
    allow_pickle: Bool = False


@_section
@dataclass
class ReportConfig:
    every_steps: Annotated[Int, Range(1, 10**9)] = 20
    tensorboard: Bool = True
    # top-1 targets
    targets: Annotated[list[Float], BeforeValidator(_yaml_list)] = field(default_factory=lambda: [0.5, 0.8])
    # e.g. [0.93] for the DAWNBench target
    top5_targets: Annotated[list[Float], BeforeValidator(_yaml_list)] = field(default_factory=list)
    log_samples: Bool = False  # each rank records the sample ids of every step (audits of the epoch plan)
    # where each rank writes that log: "" = the run folder (local storage only); a local or shared folder, which
    # a run on object storage needs (a per-step append there would be one object write a step)
    sample_log_dir: Str = ""
    mlflow: Str = ""
    verbose: Bool = False
    # console progress poll interval (ProgressPrinter every_s)
    progress_every_s: Annotated[Float, Range(0.05, 3600.0)] = 1.0
    # a run on object storage copies metrics.jsonl and TensorBoard from the driver's disk this often
    sync_every_s: Annotated[Float, Range(0.1, 3600.0)] = 15.0
    # test resolutions scored at the end of a run (FixRes check); [] = none
    eval_sweep: Annotated[list[Int], BeforeValidator(_yaml_list)] = field(default_factory=list)


@_section
@dataclass
class CostConfig:
    # Price key (of price_per_hour) of the training machines, used when a run did not measure seconds per
    # node type: "<instance type>" for on-demand, "<instance type>-spot" for spot. On a cluster built from
    # cluster.yaml each node also carries its key as the node label ``lightray-price-key``.
    node_type: Str = "local"
    # devices per machine, to turn device-hours into node-hours; 0 = one device per node
    gpus_per_node: Annotated[Int, Range(0, 1024)] = 0
    # USD per machine-hour. On-demand: AWS us-west-2 Linux list prices; spot: typical recent us-west-2 spot
    # prices (they move; check the console's spot pricing history before a large run).
    price_per_hour: Annotated[dict[str, Float], BeforeValidator(_yaml_mapping)] = field(
        default_factory=lambda: {"local": 0.0, "m6i.2xlarge": 0.384,
                                 "g5.48xlarge-spot": 4.9, "g5.48xlarge": 16.288,
                                 "p3.16xlarge-spot": 7.34, "p3.16xlarge": 24.48}
    )

    def check_prices(self) -> None:
        """Raise ConfigError unless every price is a finite number >= 0 and ``node_type`` has a price.

        Not a field check: code builds a CostConfig and then asks for an estimate, which checks it here."""
        for key, price in self.price_per_hour.items():
            if not isinstance(price, (int, float)) or isinstance(price, bool) or not math.isfinite(price) \
                    or price < 0:
                raise ConfigError(
                    f"cost.price_per_hour.{key}: bad value {price!r}; expected a price in USD per hour >= 0"
                )
        if self.node_type not in self.price_per_hour:
            raise ConfigError(
                f"cost.node_type: bad value {self.node_type!r}; expected a key of cost.price_per_hour "
                f"({', '.join(sorted(self.price_per_hour))})"
            )
        if self.gpus_per_node < 0:
            raise ConfigError(f"cost.gpus_per_node: bad value {self.gpus_per_node!r}; expected an integer >= 0")


@_section
@dataclass
class Config:
    name: Str = ""
    storage: Str = ""
    recipe: Str = "demo"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    cost: CostConfig = field(default_factory=CostConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def worker_range(self) -> tuple[int, int]:
        return parse_workers(self.scaling.workers)


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


# --- building a Config from a mapping ------------------------------------------------------------------------
@functools.cache
def _adapter() -> TypeAdapter[Config]:
    return TypeAdapter(Config)


def _dotted_key(loc: tuple[str | int, ...]) -> str:
    """Pydantic's error location as the user writes the key: ``schedule.phases[0].resolution``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _section_at(loc: tuple[str | int, ...]) -> Any:
    """The dataclass that holds the key at ``loc`` (list indices step into the item type)."""
    cls: Any = Config
    for part in loc:
        if isinstance(part, int):
            continue
        cls = typing.get_type_hints(cls)[part]
        if typing.get_origin(cls) is list:
            (cls,) = typing.get_args(cls)
    return cls


def _error_line(exc: ValidationError) -> str:
    """The one line for the first problem pydantic found."""
    err = exc.errors(include_url=False)[0]
    key = _dotted_key(err["loc"])
    kind = err["type"]
    if kind == "config":
        return f"{key}: {err['msg']}"
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        names = sorted(f.name for f in dataclasses.fields(_section_at(err["loc"][:-1])))
        return f"{key}: unknown key; allowed keys: {', '.join(names)}"
    if kind in ("missing", "missing_argument"):
        return f"{key}: missing; a value is required"
    if kind == "dataclass_type":
        return f"{key}: bad value {err['input']!r}; expected a mapping of {err['ctx']['class_name']} fields"
    return f"{key}: bad value {err['input']!r}; {err['msg']}"


def _build(data: dict[str, Any]) -> Config:
    try:
        cfg = _adapter().validate_python(data)
    except ValidationError as exc:
        raise ConfigError(_error_line(exc)) from None
    check_config(cfg)
    return cfg


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
    if dotted in ALTERNATIVES:
        other, cleared = ALTERNATIVES[dotted]
        node[other.split(".")[-1]] = cleared


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
    _check_alternatives(raw, str(path))
    if isinstance(raw.get("schedule"), dict):  # a recipe's own warm-up replaces the default one
        for key, (other, cleared) in ALTERNATIVES.items():
            if key.split(".")[1] in raw["schedule"]:
                raw["schedule"].setdefault(other.split(".")[1], cleared)
    tree: dict[str, Any] = {}
    for dotted, value in (overrides or {}).items():
        set_dotted(tree, dotted, value)
    return _build(_merge(raw, tree))


def config_from_dict(data: dict[str, Any]) -> Config:
    """Rebuild a Config from ``Config.to_dict()`` output (e.g. a saved run)."""
    return _build(data)


def get_dotted(cfg: Config, dotted: str) -> Any:
    node: Any = cfg
    for p in dotted.split("."):
        if not dataclasses.is_dataclass(node) or p not in {f.name for f in dataclasses.fields(node)}:
            raise ConfigError(f"{dotted}: unknown key")
        node = getattr(node, p)
    return node


def key_type(dotted: str) -> Any:
    """The declared type of a dotted key (``int``, ``list[float]``, a section class), or ConfigError."""
    cls: Any = Config
    tp: Any = None
    for p in dotted.split("."):
        if not dataclasses.is_dataclass(cls):
            raise ConfigError(f"{dotted}: unknown key")
        hints = typing.get_type_hints(cls)  # without the Annotated validators
        if p not in hints:
            raise ConfigError(f"{dotted}: unknown key")
        tp = hints[p]
        cls = tp
    return tp


# --- architecture names: checked here so that a bad name fails at load time, before any worker starts ------
# the ones the recipes use; any other name works too
ARCHS = ("resnet_tiny", "cifar_vgg", "resnet18", "resnet34", "resnet50")
TIMM_PREFIX = "timm:"


@functools.lru_cache(maxsize=1)
def torchvision_archs() -> tuple[str, ...]:
    """torchvision's classification models (``resnet18``, ``convnext_tiny``, ``vit_b_16``, ...)."""
    import torchvision  # only when a name is not one of the built-in ones: config stays light to import

    return tuple(torchvision.models.list_models(module=torchvision.models))


@functools.lru_cache(maxsize=1)
def timm_archs() -> tuple[str, ...]:
    import timm  # a second or two to import: only when a name is not one of the built-in ones

    return tuple(timm.list_models())


def check_arch(arch: str) -> str:
    """``arch``'s family (``lightray``, ``torchvision`` or ``timm``); ConfigError with close matches otherwise."""
    if arch in ("resnet_tiny", "cifar_vgg"):
        return "lightray"
    if arch.startswith(TIMM_PREFIX):
        name = arch[len(TIMM_PREFIX):]
        if name in timm_archs():
            return "timm"
        close = [TIMM_PREFIX + m for m in difflib.get_close_matches(name, timm_archs(), n=5, cutoff=0.6)]
    else:
        if arch in torchvision_archs():
            return "torchvision"
        names = ("resnet_tiny", *torchvision_archs(), *(TIMM_PREFIX + m for m in timm_archs()))
        close = difflib.get_close_matches(arch, names, n=5, cutoff=0.6)
        # "convnext_tinyy" is close to timm's name too: match the bare name against timm's list as well.
        close += [TIMM_PREFIX + m for m in difflib.get_close_matches(arch, timm_archs(), n=3, cutoff=0.6)
                  if TIMM_PREFIX + m not in close and m not in close]
    hint = f"close matches: {', '.join(close[:6])}" if close else "no close match"
    raise ConfigError(f"model.arch: bad value {arch!r}; {hint} (allowed: {', '.join(ARCHS)}, any torchvision "
                      f"classification model, or timm:<name> from timm.list_models())")


# --- rules that span several keys (each value on its own already passed its field's checks) ------------------
def _check_phases(sched: ScheduleConfig) -> None:
    phases = sched.phases
    if not phases:
        raise ConfigError("schedule.phases: bad value []; expected at least one phase")
    fractions = phases[0].until > 0
    prev = 0.0
    for i, ph in enumerate(phases):
        key = f"schedule.phases[{i}]"
        if ph.until > 0 and ph.until_epoch > 0:
            raise ConfigError(f"{key}.until: give until (fraction of the budget) or until_epoch (absolute), not both")
        if ph.until <= 0 and ph.until_epoch <= 0:
            raise ConfigError(f"{key}.until: missing; give until (fraction of the budget, in (0, 1]) or until_epoch")
        if (ph.until > 0) != fractions:
            raise ConfigError(f"{key}.{'until' if ph.until > 0 else 'until_epoch'}: every phase of a recipe gives "
                              f"the same kind of end (until fractions or until_epoch epochs), as phase 0 does")
        end = ph.until if fractions else ph.until_epoch
        name = "until" if fractions else "until_epoch"
        if end <= prev:
            raise ConfigError(f"{key}.{name}: bad value {end!r}; expected > {prev:g} (phases in order)")
        if ph.scale > 0 and ph.resolution:
            raise ConfigError(f"{key}.scale: give resolution (px) or scale (of the native size), not both")
        if ph.scale <= 0 and not 8 <= ph.resolution <= 2048:
            raise ConfigError(f"{key}.resolution: bad value {ph.resolution!r}; expected 8..2048 px (or scale, "
                              "a fraction of the source's native size)")
        if ph.batch_size < 1:
            raise ConfigError(f"{key}.batch_size: bad value {ph.batch_size!r}; expected >= 1")
        if not 0.0 < ph.min_scale <= 1.0:
            raise ConfigError(f"{key}.min_scale: bad value {ph.min_scale!r}; expected in (0, 1]")
        prev = end
    if fractions and phases[-1].until != 1.0:
        raise ConfigError(f"schedule.phases[{len(phases) - 1}].until: bad value {phases[-1].until!r}; "
                          "the last phase ends the budget: expected 1.0")
    if not fractions and phases[-1].until_epoch < sched.epochs:
        raise ConfigError(
            f"schedule.phases[{len(phases) - 1}].until_epoch: bad value {phases[-1].until_epoch!r}; "
            f"the phases must cover schedule.epochs={sched.epochs:g}"
        )
    if sched.warmup > 0:
        sched.warmup_epochs = 0.0  # the fraction replaces it; the saved config then shows one warm-up
    if sched.warmup_epochs > sched.epochs:
        raise ConfigError(
            f"schedule.warmup_epochs: bad value {sched.warmup_epochs!r}; expected <= schedule.epochs"
        )


def default_eval_resolution(sched: ScheduleConfig) -> int:
    """``schedule.eval_resolution``, else the FixRes rule: test above the final train resolution.

    Random-resized crops make objects look larger in training than in a centre crop at the same size, so
    a network tests best somewhat above its final train resolution (Touvron et al., FixRes; FFCV trains
    at 192 and tests at 256). The rule: round(final * 1.15 / 8) * 8 (192 -> 224, 128 -> 144), multiples
    of 8 as tiers and kernels prefer."""
    if sched.eval_resolution:
        return sched.eval_resolution
    final = sched.phases[-1].resolution
    return max(8, round(final * EVAL_RES_FACTOR / 8) * 8)


EVAL_RES_FACTOR = 1.15

# Keys that say the same thing two ways: setting one (a recipe layer, an override, a tune param) clears the
# other, so the last one given wins; a recipe that gives both in one mapping is a ConfigError.
ALTERNATIVES = {"schedule.warmup": ("schedule.warmup_epochs", 0.0),
                "schedule.warmup_epochs": ("schedule.warmup", 0.0)}


def _check_alternatives(raw: dict[str, Any], where: str) -> None:
    """A recipe gives one of each pair. A saved config (``Config.to_dict``, e.g. a search's best recipe) holds
    both keys, the unused one at its cleared value: that one counts as not given."""
    for key, (other, cleared) in ALTERNATIVES.items():
        section, k = key.split(".")
        o = other.split(".")[1]
        node = raw.get(section)
        if (isinstance(node, dict) and node.get(k, cleared) != cleared and node.get(o, cleared) != cleared
                and key < other):
            raise ConfigError(f"{key}: give {key} (fraction of the budget) or {other}, not both ({where})")


def check_config(cfg: Config) -> None:
    """The checks that no single field expresses: worker range, phases, prices and accuracy targets."""
    parse_workers(cfg.scaling.workers)
    if cfg.model.arch not in ARCHS:
        check_arch(cfg.model.arch)
    _check_phases(cfg.schedule)
    cfg.cost.check_prices()
    if cfg.comm.mode == "auto" and cfg.comm.link_gbps <= 0:
        raise ConfigError("comm.link_gbps: bad value 0; comm.mode=auto needs the link speed between nodes in Gbit/s "
                          "(e.g. 25), which Ray cannot measure")
    if "://" in cfg.report.sample_log_dir:
        raise ConfigError(f"report.sample_log_dir: bad value {cfg.report.sample_log_dir!r}; expected a local or "
                          "shared folder (each rank appends to its log at every step)")
    for key in ("targets", "top5_targets"):
        for t in getattr(cfg.report, key):
            if not 0.0 < t <= 1.0:
                raise ConfigError(f"report.{key}: bad value {t!r}; expected fractions in (0, 1]")
