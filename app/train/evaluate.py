"""Validation: top-1 / top-5 over the whole validation split, summed exactly across ranks.

The stream's blocks are taken as they come (``batch_size=None``) and cut into chunks of at most
``batch_size``: with rectangular validation each block holds one shape, and re-batching across blocks
would mix shapes.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from lightray.config import Config
from lightray.train import device as dev
from lightray.train.prefetch import DevicePrefetcher
from lightray.train.shift import tta_logits


@torch.no_grad()
def evaluate(model: nn.Module, shard, device: torch.device, precision: str, cfg: Config,
             prefetch_batches: int = 2, batch_size: int = 256, translate: int | None = None) -> dict[str, float]:
    """Each rank scores its part of the split; counts (not means) are all-reduced, so the result is
    exactly the full split's accuracy whatever the number of workers or their share. The counts stay on
    the device until the split is scored: the host reads them once, at the end. ``translate``: the translated
    test-time views' shift (None = ``schedule.tta_translate``)."""
    translate = cfg.schedule.tta_translate if translate is None else translate
    was_training = model.training
    if dist.is_available() and dist.is_initialized():
        # BN running stats drift apart per rank after the last step (each saw its own batch; DDP re-syncs them
        # only at the next forward): score every rank's share with rank 0's, the model that is checkpointed
        # and exported, so the reported accuracy is that model's.
        for buf in model.buffers():
            dist.broadcast(buf, 0)
    model.eval()
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # n, top1, top5, loss sum
    chunks = DevicePrefetcher(_chunks(shard, prefetch_batches, batch_size), device,
                              enabled=cfg.scaling.device_prefetch)
    try:
        for chunk in chunks:
            _score(model, chunk["image"], chunk["label"], device, precision, cfg, translate, loss_fn, totals)
    finally:
        chunks.close()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(totals)
    model.train(was_training)
    n_val, top1, top5, loss = totals.tolist()
    n = max(1.0, n_val)
    return {"val_top1": top1 / n, "val_top5": top5 / n, "val_loss": loss / n, "val_samples": int(n_val)}


def _chunks(shard, prefetch_batches: int, batch_size: int) -> Iterator[dict]:
    for block in shard.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=prefetch_batches):
        for lo in range(0, len(block["label"]), batch_size):
            yield {"image": block["image"][lo:lo + batch_size], "label": block["label"][lo:lo + batch_size]}


def _score(model: nn.Module, images, labels, device: torch.device, precision: str, cfg: Config, translate: int,
           loss_fn: nn.Module, totals: torch.Tensor) -> None:
    """Add [n, top-1 hits, top-5 hits, loss sum] of one uint8 NHWC batch (NumPy, or tensors the prefetcher
    put on the device) to ``totals``, on the device."""
    images = images if isinstance(images, torch.Tensor) else torch.from_numpy(images)
    labels = labels if isinstance(labels, torch.Tensor) else torch.from_numpy(labels)
    x = dev.images_to_device(images, device, cfg.model.channels_last)
    y = dev.host_to_device(labels, device)
    with dev.autocast(precision, device):
        logits = tta_logits(model, x, cfg.schedule.tta_flip, translate)
    k = min(5, logits.shape[1])
    hit = logits.topk(k, dim=1).indices.eq(y.view(-1, 1))
    totals[0] += len(y)
    totals[1] += hit[:, :1].sum()
    totals[2] += hit.any(dim=1).sum()
    totals[3] += loss_fn(logits, y)
