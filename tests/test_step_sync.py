"""A step that never waits for the host: what the CPU can show, and the CUDA check where a GPU is present.

A host read of a device value (``.item()``, ``float()``, ``.tolist()``) is PyTorch's ``aten._local_scalar_dense``
(or a copy to the host); a tensor built from Python numbers is ``aten.lift_fresh`` followed by a copy to the
device (on CUDA a blocking copy from pageable memory). A ``TorchDispatchMode`` sees every op PyTorch runs, so it
counts both on the CPU exactly where, on a GPU, the host would wait. Nothing is replaced: the ops run as they are.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from lightray.comm.topology import Topology
from lightray.config import ModelConfig, load_config
from lightray.data.ingest import IngestSpec, TierShards
from lightray.train import device as dev
from lightray.train.evaluate import evaluate
from lightray.train.model import build_model
from lightray.train.prefetch import DevicePrefetcher, pin_batch
from lightray.train.trainer import Trainer

CPU = torch.device("cpu")
HOST_READS = ("aten._local_scalar_dense.default",)
FROM_HOST_NUMBERS = ("aten.lift_fresh.default", "aten.lift_fresh_copy.default")


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops run inside it (on this thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def count(self, names: tuple[str, ...]) -> int:
        return sum(self.ops[n] for n in names)


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"file://{tmp_path_factory.mktemp('pg') / 'store'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def make_trainer(run_dir, **overrides) -> tuple[Trainer, list[dict]]:
    cfg = load_config("smoke", {"optim.ema_decay": 0.9, "report.every_steps": 1000, **overrides})
    empty = TierShards(32, "raw", [], [], [])
    spec = IngestSpec(seed=0, local_dir=str(run_dir), train_size=256, phases=[], val=empty, eval_resolution=32,
                      val_crop_ratio=cfg.data.val_crop_ratio)
    records: list[dict] = []
    trainer = Trainer(cfg, spec, str(run_dir), 10, rank=0, world=1, topology=Topology(1, 0, 0, 1, 0, 1),
                      report=records.append)
    return trainer, records


def batches(n: int, size: int = 64, res: int = 32, seed: int = 0):
    rng = np.random.default_rng(seed)
    for i in range(n):
        yield {"image": rng.integers(0, 256, (size, res, res, 3), dtype=np.uint8),
               "label": rng.integers(0, 10, size).astype(np.int64), "sample_id": np.arange(i * size, (i + 1) * size),
               "epoch": np.zeros(size, np.int64)}


# --- normalisation constants ----------------------------------------------------------------------------------
def test_normalisation_constants_are_made_once_per_device():
    img = torch.from_numpy(next(batches(1))["image"])
    first = dev.images_to_device(img, CPU, channels_last=True)
    with OpCounter() as ops:
        again = [dev.images_to_device(img, CPU, channels_last=True) for _ in range(3)]
        boxes = torch.tensor([[0.0, 0.0, 32.0, 32.0]]).repeat(len(img), 1)
        dev.augmented_to_device(img, boxes, torch.zeros(len(img), dtype=torch.bool), 16, CPU, True)
    # Only the boxes above come from Python numbers; the old code built the mean and std at every call.
    assert ops.count(FROM_HOST_NUMBERS) == 1, ops.ops
    assert all(torch.equal(a, first) for a in again)
    mean, std = dev.normalization_constants(CPU)
    assert mean is dev.normalization_constants(CPU)[0] and std is dev.normalization_constants(CPU)[1]
    key = ("cpu", dev.IMAGENET_MEAN, dev.IMAGENET_STD)
    assert key in dev.normalization_cache()
    assert torch.allclose(mean.view(3), torch.tensor(dev.IMAGENET_MEAN) * 255)
    expected = (img.permute(0, 3, 1, 2).float() - mean) / std
    assert torch.allclose(first, expected)


# --- the loss is read at report steps only ---------------------------------------------------------------------
def test_training_steps_read_nothing_back_until_the_report_step(tmp_path, one_rank_group):
    trainer, records = make_trainer(tmp_path)
    run = trainer.phase_run(0)
    stream = DevicePrefetcher(batches(5), trainer.device)
    trainer.train_step(next(stream), run)  # the first step: DDP builds its buckets
    with OpCounter() as ops:
        for b in stream:
            trainer.train_step(b, run)
    assert ops.count(HOST_READS) == 0, {k: v for k, v in ops.ops.items() if "scalar" in k or "item" in k}
    assert isinstance(trainer.window["loss"], torch.Tensor) and trainer.window["steps"] == 5
    window_loss = trainer.window["loss"].clone()
    with OpCounter() as ops:
        trainer._report_window(0, run, 0.1, 0.9)
    assert ops.count(HOST_READS) >= 1  # read here, once for the interval
    line = records[-1]
    assert isinstance(line["loss"], float) and line["loss"] == pytest.approx(float(window_loss) / 5)
    assert 0 < line["loss"] < 10 and line["step"] == 5


# --- validation totals stay on the device ----------------------------------------------------------------------
class ValShard:
    def __init__(self, blocks: int):
        self.blocks = blocks

    def iter_batches(self, **_):
        rng = np.random.default_rng(3)
        for _ in range(self.blocks):
            yield {"image": rng.integers(0, 256, (20, 32, 32, 3), dtype=np.uint8),
                   "label": rng.integers(0, 10, 20).astype(np.int64)}


def test_validation_reads_its_totals_once_whatever_the_number_of_batches():
    cfg = load_config("smoke")
    model = build_model(ModelConfig(arch="resnet_tiny", channels_last=False), 10)
    reads = []
    for blocks in (1, 4):
        with OpCounter() as ops:
            got = evaluate(model, ValShard(blocks), CPU, "fp32", cfg, batch_size=8)  # 3 chunks a block
        reads.append(ops.count(HOST_READS))
        assert got["val_samples"] == 20 * blocks
    assert reads[0] == reads[1] <= 1, reads  # the old code read 3 numbers per chunk
    # The totals are the split's, computed here independently.
    model.eval()
    hits1 = hits5 = 0
    for block in ValShard(4).iter_batches():
        logits = model(dev.images_to_device(torch.from_numpy(block["image"]), CPU, False))
        top = logits.topk(5, dim=1).indices
        y = torch.from_numpy(block["label"]).view(-1, 1)
        hits1 += int((top[:, :1] == y).sum())
        hits5 += int((top == y).any(dim=1).sum())
    assert got["val_top1"] == pytest.approx(hits1 / 80) and got["val_top5"] == pytest.approx(hits5 / 80)


# --- the prefetcher ------------------------------------------------------------------------------------------
def test_the_prefetcher_yields_the_streams_batches_in_order():
    plain = list(batches(6, seed=4))
    got = list(DevicePrefetcher(batches(6, seed=4), CPU))
    assert len(got) == len(plain)
    for a, b in zip(got, plain):
        assert a.keys() == b.keys()
        assert isinstance(a["image"], torch.Tensor) and isinstance(a["label"], torch.Tensor)
        assert np.array_equal(a["image"].numpy(), b["image"]) and np.array_equal(a["label"].numpy(), b["label"])
        assert isinstance(a["sample_id"], np.ndarray) and np.array_equal(a["sample_id"], b["sample_id"])
    off = list(DevicePrefetcher(iter(plain), CPU, enabled=False))
    assert all(a is b for a, b in zip(off, plain))  # switched off: the stream's own batches, untouched
    jpeg = {"jpeg": np.array([b"x"], dtype=object), "label": np.zeros(1, np.int64)}
    assert next(DevicePrefetcher(iter([jpeg]), CPU)) is jpeg  # decoded on the device from host memory


def test_the_prefetcher_raises_the_streams_error_after_the_batches_before_it():
    def failing():
        yield from batches(2)
        raise OSError("shard gone")

    stream = DevicePrefetcher(failing(), CPU)
    assert len([next(stream), next(stream)]) == 2
    with pytest.raises(OSError, match="shard gone"):
        next(stream)
    with pytest.raises(StopIteration):
        next(stream)


def test_closing_the_prefetcher_stops_its_thread():
    def endless():
        i = 0
        while True:
            i += 1
            yield {"image": np.full((1, 2, 2, 3), i % 256, np.uint8), "label": np.array([i])}

    stream = DevicePrefetcher(endless(), CPU)
    assert int(next(stream)["label"][0]) == 1 and int(next(stream)["label"][0]) == 2
    stream.close()
    deadline = time.time() + 5
    while any(t.name == "lightray-prefetch" and t.is_alive() for t in threading.enumerate()) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(t.name == "lightray-prefetch" and t.is_alive() for t in threading.enumerate())
    with pytest.raises(StopIteration):
        next(stream)


def test_pinning_is_a_no_op_on_the_cpu():
    b = next(batches(1))
    pinned = pin_batch(b, CPU)
    for key in ("image", "label"):
        assert isinstance(pinned[key], torch.Tensor) and not pinned[key].is_pinned()
        assert pinned[key].data_ptr() == b[key].__array_interface__["data"][0]  # the array's memory, not a copy
    assert pinned["sample_id"] is b["sample_id"]


def test_the_trainer_logs_what_the_prefetch_unit_does(tmp_path, one_rank_group):
    for enabled in (True, False):
        trainer, records = make_trainer(tmp_path, **{"scaling.device_prefetch": enabled})
        trainer._log_units()
        [unit] = [r for r in records if r.get("unit") == "device_prefetch"]
        assert unit["enabled"] is enabled
        assert ("off (scaling.device_prefetch=false)" in unit["message"]) is (not enabled)


# --- on a GPU: steady-state steps under CUDA's sync debug mode -----------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_steady_state_steps_never_synchronise_with_the_host(tmp_path, one_rank_group):
    trainer, _ = make_trainer(tmp_path, **{"model.precision": "bf16", "model.compile": False})
    assert trainer.device.type == "cuda"
    for micro in (1, 2):
        run = trainer.phase_run(0)
        run.micro_steps = micro
        stream = DevicePrefetcher(batches(8, seed=micro), trainer.device)
        for _ in range(3):  # warm-up: DDP's bucket rebuild, cuDNN's autotune, the allocator's first blocks
            trainer.train_step(trainer._next_batch(stream, 0), run)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(4):
                trainer.train_step(trainer._next_batch(stream, 0), run)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        stream.close()
    assert float(trainer.window["loss"]) > 0
