"""Decode on the device for JPEG tiers: Ray Data tasks pass each sample's encoded bytes through (with its crop box
and flip bit, drawn as every other path draws them), and the Train worker decodes the batch with one
``torchvision.io.decode_jpeg`` call on its device (batched nvJPEG on CUDA; libjpeg-turbo on the CPU device, the
same library PIL uses, so the pixels there are the CPU path's).

The decoded images differ in size, so each one's *window around its crop box* (``lightray.data.augment.window_boxes``,
the window the device-augmentation path ships) is pasted top-left onto one canvas per batch, the boxes moved into
window coordinates by whole pixels (the same crop), and the rows and columns past each window repeat its last
ones: the batched crop (``lightray.train.device.crop_resize_flip``) then samples edge pixels as PIL's clamp does.
A crop box's aspect is within [3/4, 4/3], so a window, and the canvas, is at most about the short side * 4/3 in
each direction (``augment.window_bound``): a few panoramas in a batch no longer make its canvas their size.

A bad image (bytes that fail to decode: a damaged shard, since prepare rejects bad files) fails the whole
batched call, so that batch is decoded again image by image; the bad ones are dropped with their labels (the
rest keep theirs: no shift), logged and listed in :data:`SKIPPED`. Running out of device memory is not a bad
image: it is raised as it is, never turned into dropped images.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from lightray.data import augment
from lightray.data.timing import images_per_s

log = logging.getLogger(__name__)
SKIPPED: list[int] = []  # sample ids this process could not decode, in the order met


@dataclass
class DecodedBatch:
    canvas: torch.Tensor  # uint8 NHWC on the device (a view of NCHW memory), kept samples only: their windows
    boxes: torch.Tensor  # (n, 4) float32 crop boxes in canvas pixels (each window top-left aligned)
    flips: torch.Tensor  # (n,) bool
    keep: np.ndarray  # bool over the delivered batch: False where the bytes did not decode
    skipped: list[int]  # sample ids dropped from this batch


def as_tensors(encoded: np.ndarray | list) -> list[torch.Tensor]:
    """Each sample's bytes as a 1-D uint8 CPU tensor, without a copy (decode_jpeg only reads them)."""
    with warnings.catch_warnings():
        # bytes are read-only; torch warns that writing through the tensor would be undefined: nothing writes.
        warnings.simplefilter("ignore", UserWarning)
        return [torch.frombuffer(b, dtype=torch.uint8) if len(b) else torch.zeros(0, dtype=torch.uint8)
                for b in encoded]


_DECODE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _decode_stream(device: torch.device) -> torch.cuda.Stream:
    """This process's stream for decode outputs on ``device``, made on first use."""
    key = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    if key not in _DECODE_STREAMS:
        _DECODE_STREAMS[key] = torch.cuda.Stream(key)
    return _DECODE_STREAMS[key]


def decode(data: list[torch.Tensor], device: torch.device | str) -> tuple[list[torch.Tensor | None], list[int]]:
    """(CHW uint8 RGB images on ``device``, None where undecodable; indices of the undecodable ones)."""
    if not data:
        return [], []
    device = torch.device(device)
    if device.type != "cuda":
        return _decode_jpegs(data, device)
    # torchvision's CUDA decoder allocates its outputs on the current stream but writes them from a stream of
    # its own that does not wait for the current one (it only makes the current stream wait for it after):
    # a block the training step freed with its kernels still queued could be handed out and overwritten under
    # them. Host-synchronising the step's stream before each decode avoided that, at the cost of running
    # decode in series with training. Instead the outputs are allocated on a stream used for nothing else,
    # whose blocks the step's kernels never held; the step's stream waits for it on the device, and each
    # output is marked as used there, so its block is not handed to the next decode before those kernels end.
    compute = torch.cuda.current_stream(device)
    side = _decode_stream(device)
    with torch.cuda.stream(side):
        images, bad = _decode_jpegs(data, device)
    compute.wait_stream(side)
    for im in images:
        if im is not None:
            im.record_stream(compute)
    return images, bad


def _decode_jpegs(data: list[torch.Tensor], device: torch.device) -> tuple[list[torch.Tensor | None], list[int]]:
    """:func:`decode` on the current stream: one batched call, image by image when one image fails it."""
    from torchvision.io import ImageReadMode, decode_jpeg

    try:
        return list(decode_jpeg(data, mode=ImageReadMode.RGB, device=device)), []
    except torch.cuda.OutOfMemoryError:
        raise  # the device is full, not the shard damaged: dropping the batch's images would hide it
    except RuntimeError:
        pass  # one bad image fails the whole batched call: find it image by image
    out: list[torch.Tensor | None] = []
    bad: list[int] = []
    for i, t in enumerate(data):
        try:
            out.append(decode_jpeg(t, mode=ImageReadMode.RGB, device=device))
        except torch.cuda.OutOfMemoryError:
            raise
        except RuntimeError:
            out.append(None)
            bad.append(i)
    return out, bad


def _from_host(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host array as a tensor on ``device``. On CUDA it goes through pinned memory with a non-blocking
    copy: from pageable memory the copy would make the host wait, and the host is what queues the kernels."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def paste(images: list[torch.Tensor], windows: np.ndarray | None, device: torch.device | str) -> torch.Tensor:
    """Each CHW image's window (``windows[i]`` = x0, y0, x1, y1, exclusive ends, in its pixels; None: the whole
    images) onto one (n, 3, H+1, W+1) canvas, top-left, H x W the largest window; past its window each
    canvas repeats the window's last row and column (the edge copy PIL's clamp needs; the crop samples
    nothing further out).

    One gather per image (an index with the window's row and column numbers, clamped) and one stack, not three
    copies per image; the row and column numbers of the whole batch reach the device as one array."""
    device = torch.device(device)
    if windows is None:
        windows = np.array([[0, 0, int(im.shape[2]), int(im.shape[1])] for im in images], np.int64)
    wh = windows[:, 3] - windows[:, 1]
    ww = windows[:, 2] - windows[:, 0]
    h, w = int(wh.max()) + 1, int(ww.max()) + 1
    rows = windows[:, 1:2] + np.minimum(np.arange(h), wh[:, None] - 1)
    cols = windows[:, 0:1] + np.minimum(np.arange(w), ww[:, None] - 1)
    idx = _from_host(np.concatenate([rows, cols], axis=1), device)
    return torch.stack([im[:, idx[i, :h, None], idx[i, None, h:]] for i, im in enumerate(images)])


def decode_batch(batch: dict, device: torch.device | str) -> DecodedBatch:
    """A delivered device-decode batch (``jpeg``, ``box``, ``flip``, ``sample_id``; boxes in stored-image
    pixels) decoded on ``device``, each kept image's window around its box pasted onto the canvas and its box
    moved into the window's coordinates."""
    device = torch.device(device)
    images, bad = decode(as_tensors(batch["jpeg"]), device)
    keep = np.ones(len(images), bool)
    skipped: list[int] = []
    if bad:
        keep[bad] = False
        skipped = [int(batch["sample_id"][i]) for i in bad]
        SKIPPED.extend(skipped)
        log.warning("device decode: %d image(s) of a batch of %d did not decode (a damaged shard?); skipped "
                    "sample ids %s", len(bad), len(images), skipped)
    kept = [im for im in images if im is not None]
    if not kept:
        raise RuntimeError(f"device decode: no image of a batch of {len(images)} decoded (sample ids {skipped})")
    # The float32 boxes the CPU side shipped are the crop: the windows are taken around them, and moving a
    # float32 below 2**23 by whole pixels is exact, so each box keeps its place in its image.
    box = np.asarray(batch["box"], dtype=np.float32)[keep].astype(np.float64)
    windows = augment.window_boxes(box, np.array([int(im.shape[1]) for im in kept], np.int64),
                                   np.array([int(im.shape[2]) for im in kept], np.int64))
    canvas = paste(kept, windows, device)
    boxes = _from_host((box - windows[:, [0, 1, 0, 1]]).astype(np.float32), device)
    flips = _from_host(np.asarray(batch["flip"], dtype=bool)[keep], device)
    return DecodedBatch(canvas.permute(0, 2, 3, 1), boxes, flips, keep, skipped)


def describe(device: torch.device, phases: list[int]) -> str:
    """The worker's log line for where its JPEG phases are decoded (labelled when the device is the CPU)."""
    how = "batched nvJPEG" if device.type == "cuda" else "libjpeg-turbo (the device path on the CPU device)"
    return (f"JPEG decode of phases {phases} as one decode_jpeg call per batch on {device} ({how}), then "
            f"crop+resize+flip as one roi_align")


def decode_rate(encoded: list[bytes], device: torch.device | str, seconds: float = 1.0, batch: int = 64) -> float:
    """Images/s of batched decode (plus the canvas paste, of whole images: no boxes here, so an upper bound of
    the windows' paste) of ``encoded`` on ``device`` (timed as :func:`lightray.data.timing.images_per_s` times)."""
    device = torch.device(device)
    data = as_tensors(encoded[:batch])
    if not data:
        return 0.0

    def once() -> None:
        images, _ = decode(data, device)
        paste([im for im in images if im is not None], None, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return images_per_s(once, len(data), seconds)
