"""Trainer state in checkpoints: what is saved, how validity is proven, which one a start resumes from.

A checkpoint folder ``checkpoint_<samples_seen>`` holds, per rank, ``state_rank<r>.pt`` and, written
after it, ``meta_rank<r>.json`` with that file's sha256. Rank 0's file has the replicated state
(model, optimizer, EMA, grad scaler, schedule position, counters); every rank's file has its own
communication residuals and RNG states. A folder counts only when every rank's meta is there and
every hash matches: a half-uploaded or corrupted checkpoint is skipped with a warning and the
previous one used.

State files hold only tensors and plain Python values (dict, list, str, numbers), so they load with
``torch.load(weights_only=True)``: a checkpoint read back from shared storage cannot run code. The meta
records the format; format 1 (before that rule: NumPy's RNG state was pickled as an array) loads only when
``checkpoint.allow_pickle`` says the files are trusted.

State files load to the CPU (``load_rank_state`` takes no device); each part then moves what it needs to the
device it lives on (the model and optimizer through torch's own ``load_state_dict``, the comm hook its residuals,
velocities and PowerSGD memories), so a checkpoint written on one kind of device resumes on another.

Every worker-group start resumes from ``select_resume(run_dir)``: Ray Train calls the dataset
functions (which pick the data position) and then the workers; both read the same choice from
``resume.json`` so the model and the data stream always agree.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
from dataclasses import asdict, dataclass

import torch

from lightray import storage
from lightray.config import ConfigError
from lightray.storage import join, read_bytes, write_bytes

log = logging.getLogger(__name__)
CKPT_RE = re.compile(r"^checkpoint_(\d{12})$")
CHECKPOINT_FORMAT = 2  # 2: loads with weights_only=True; 1 (no "format" in the meta): pickled NumPy arrays


class CheckpointFormatError(ConfigError):
    """A checkpoint this version will not load as it stands (an unsafe older format, or a newer one)."""


def checkpoint_format(meta: dict) -> int:
    return int(meta.get("format", 1))


def check_checkpoint_format(folder: str, meta: dict, allow_pickle: bool) -> int:
    """The folder's format, if this version may load it; CheckpointFormatError naming the format otherwise."""
    fmt = checkpoint_format(meta)
    if fmt > CHECKPOINT_FORMAT:
        raise CheckpointFormatError(f"{folder}: checkpoint format {fmt} was written by a newer lightray; this "
                                    f"version reads formats 1-{CHECKPOINT_FORMAT}")
    if fmt < CHECKPOINT_FORMAT and not allow_pickle:
        raise CheckpointFormatError(
            f"{folder}: checkpoint format {fmt} (pickled, written before lightray loaded checkpoints with "
            f"weights_only=True) can run code when loaded; if you wrote it yourself, resume with "
            f"--checkpoint.allow_pickle=true (the next checkpoint is written in format {CHECKPOINT_FORMAT})")
    return fmt


def checkpoint_name(samples_seen: int) -> str:
    return f"checkpoint_{samples_seen:012d}"


def save_rank_state(folder: str, rank: int, state: dict, meta: dict) -> None:
    """Write this rank's state file, then its meta (with the file's sha256) into a folder."""
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    write_bytes(join(folder, f"state_rank{rank}.pt"), data)
    meta = dict(meta, rank=rank, format=CHECKPOINT_FORMAT, sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    storage.write_json(join(folder, f"meta_rank{rank}.json"), meta)


@dataclass
class ResumePoint:
    checkpoint: str | None  # folder URI, or None for a fresh start
    samples_seen: int
    world_size: int  # of the run that wrote it (0 for a fresh start)
    skipped: list[str]  # newer folders that failed validation
    time: float | None = None  # when the checkpoint was written

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()


def validate_checkpoint(folder: str) -> dict:
    """Rank 0's meta if every rank's file is present and matches its hash; raises ValueError otherwise."""
    try:
        meta0 = storage.read_json(join(folder, "meta_rank0.json"))
    except (OSError, FileNotFoundError, json.JSONDecodeError) as exc:
        raise ValueError(f"{folder}: meta_rank0.json unreadable ({exc})") from None
    for r in range(int(meta0.get("world_size", 1))):
        try:
            meta = meta0 if r == 0 else storage.read_json(join(folder, f"meta_rank{r}.json"))
            data = read_bytes(join(folder, f"state_rank{r}.pt"))
        except (OSError, FileNotFoundError, json.JSONDecodeError) as exc:
            raise ValueError(f"{folder}: rank {r} files missing or unreadable ({exc})") from None
        if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
            raise ValueError(f"{folder}: state_rank{r}.pt does not match its recorded sha256 (corrupt or partial)")
    return meta0


def list_checkpoints(run_dir: str) -> list[tuple[int, str]]:
    """(samples_seen, folder) of every checkpoint folder in the run, newest first."""
    try:
        infos = storage.list_dir(run_dir, detail=True)
    except OSError:
        return []
    out = []
    for info in infos:
        m = CKPT_RE.match(info.base_name)
        if m and info.type == storage.FileType.Directory:
            out.append((int(m.group(1)), join(run_dir, info.base_name)))
    return sorted(out, reverse=True)


def select_resume(run_dir: str) -> ResumePoint:
    """The newest valid checkpoint of the run (or a fresh start), skipping invalid ones with a warning."""
    skipped = []
    for _samples, folder in list_checkpoints(run_dir):
        try:
            meta = validate_checkpoint(folder)
        except ValueError as exc:
            log.warning("skipping checkpoint: %s", exc)
            skipped.append(str(exc))
            continue
        return ResumePoint(folder, int(meta["samples_seen"]), int(meta["world_size"]), skipped, meta.get("time"))
    return ResumePoint(None, 0, 0, skipped)


def newest_meta(run_dir: str) -> tuple[str, dict] | None:
    """(folder, rank 0's meta) of the newest checkpoint whose meta reads, without hashing any state file: a
    cheap look at what a resume will meet (the workers check each file they load again)."""
    for _samples, folder in list_checkpoints(run_dir):
        try:
            return folder, storage.read_json(join(folder, "meta_rank0.json"))
        except (OSError, json.JSONDecodeError):
            continue
    return None


def choose_and_record_resume(run_dir: str) -> ResumePoint:
    point = select_resume(run_dir)
    write_bytes(join(run_dir, "resume.json"), point.to_json())
    return point


def read_recorded_resume(run_dir: str) -> ResumePoint:
    try:
        return ResumePoint(**storage.read_json(join(run_dir, "resume.json")))
    except (OSError, FileNotFoundError):
        return ResumePoint(None, 0, 0, [])


def load_rank_state(folder: str, rank: int, *, allow_pickle: bool = False) -> dict:
    """One rank's state, every tensor on the CPU; ``weights_only=True`` unless the folder is format 1 and
    ``allow_pickle`` trusts it.

    Always the CPU, never the worker's device: a GPU worker's files carry ``cuda:N`` tags that need not exist
    where they are read, and some consumers take only CPU tensors (a generator's ``set_state``). Each part
    moves what it needs to its own device when it loads (module docstring)."""
    fmt = check_checkpoint_format(folder, storage.read_json(join(folder, f"meta_rank{rank}.json")), allow_pickle)
    data = read_bytes(join(folder, f"state_rank{rank}.pt"))
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=fmt >= CHECKPOINT_FORMAT)
