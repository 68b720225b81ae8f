"""The ``powersgd`` comm mode: torch's own PowerSGD hook (Vogels et al. 2019) at rank ``comm.powersgd_rank``, with
its state saved as tensors and plain values (a checkpoint that holds it loads with ``weights_only=True``), and
its bytes on the wire counted like every other mode's."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightray.comm.modes.base import Bucket, CommMode, Reduced, Shared
from lightray.comm.wire import done, ring_allreduce_bytes
from lightray.config import CommConfig
from lightray.plain_rng import numpy_rng_from_plain, numpy_rng_to_plain


def new_state(cfg: CommConfig) -> Any:
    """torch's ``PowerSGDState`` for ``cfg``."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    # torch requires start_powerSGD_iter > 1 with error feedback / warm start, because DDP
    # rebuilds its buckets after the first iteration.
    return psgd.PowerSGDState(
        process_group=None, matrix_approximation_rank=cfg.powersgd_rank,
        start_powerSGD_iter=max(2, cfg.warmup_steps), use_error_feedback=cfg.error_feedback,
        warm_start=True, random_seed=0)


# PowerSGDState slots that are the run's position (the rest come from the config of this start).
_PSGD_RUNNING = ("iter", "total_numel_before_compression", "total_numel_after_compression", "next_stats_report")
_PSGD_MEMORIES = ("error_dict", "p_memory_dict", "q_memory_dict")


def state_dict(psgd_state: Any) -> dict[str, Any]:
    """PowerSGD's state as tensors and plain values: its NumPy RandomState as ``numpy_rng_to_plain`` gives it
    (pickled, it would stop ``weights_only=True`` loading the checkpoint), its per-bucket memories on the CPU."""
    out: dict[str, Any] = {k: int(getattr(psgd_state, k)) for k in _PSGD_RUNNING}
    out["matrix_approximation_rank"] = int(psgd_state.matrix_approximation_rank)
    out["rng"] = numpy_rng_to_plain(psgd_state.rng.get_state())
    for key in _PSGD_MEMORIES:
        out[key] = {int(i): t.detach().cpu().clone() for i, t in getattr(psgd_state, key).items()}
    return out


def load_state(psgd_state: Any, saved: dict[str, Any], device: torch.device) -> None:
    """Restore ``state_dict``'s output into a fresh ``PowerSGDState``; P and Q memories only at the same rank."""
    for k in _PSGD_RUNNING:
        if k in saved:
            setattr(psgd_state, k, int(saved[k]))
    rng = saved.get("rng")
    if isinstance(rng, dict):
        psgd_state.rng.set_state(numpy_rng_from_plain(rng))
    elif rng is not None:  # a format-1 checkpoint (loaded with checkpoint.allow_pickle) pickled the RandomState
        psgd_state.rng.set_state(rng.get_state())
    keep_pq = int(saved.get("matrix_approximation_rank", psgd_state.matrix_approximation_rank)) == \
        psgd_state.matrix_approximation_rank  # P and Q have the rank's width; another rank starts them afresh
    for key in _PSGD_MEMORIES:
        memories = (saved.get(key) or {}) if key == "error_dict" or keep_pq else {}
        setattr(psgd_state, key, {int(i): t.to(device, copy=True) for i, t in memories.items()})


def drop_stale_memory(psgd_state: Any, bucket: Any) -> None:
    """Forget restored per-bucket PowerSGD memories that do not fit this bucket (bucket sizes changed)."""
    i = bucket.index()
    err = psgd_state.error_dict.get(i)
    if err is not None and err.numel() != bucket.buffer().numel():
        for d in (psgd_state.error_dict, psgd_state.p_memory_dict, psgd_state.q_memory_dict):
            d.pop(i, None)


class PowerSGD(CommMode):
    """torch's PowerSGD hook on each bucket (or on each saved bucket a resumed step replays); this counts the bytes
    it sends. Its own warm-up (``start_powerSGD_iter``) runs inside torch's hook."""

    name = "powersgd"
    own_warmup = True  # torch's start_powerSGD_iter

    def __init__(self, shared: Shared):
        super().__init__(shared)
        self.state = new_state(shared.cfg)

    def compressed_now(self) -> bool:
        return self.state.iter >= self.state.start_powerSGD_iter  # read before torch's hook advances it

    def passed_over(self) -> None:
        self.state.iter += 1  # keep PowerSGD's own step count in line with the hook's

    def reduce(self, bucket: Bucket, sync: bool) -> Reduced:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        drop_stale_memory(self.state, bucket)
        self.shared.sent(self._bytes(bucket))
        fut = psgd.powerSGD_hook(self.state, bucket)
        if sync:
            return fut.wait()
        if dist.get_backend() == "gloo":
            # The hook issues its second and third all-reduce from future callbacks; with several buckets in
            # flight gloo ranks can then issue them in different orders (seen: "collective mismatch" aborts
            # with 4 CPU workers). Finishing each bucket before DDP hands over the next keeps the order.
            return done(fut.wait())
        return fut

    def _bytes(self, bucket: Bucket) -> int:
        st, world, buf = self.state, self.shared.world_size, bucket.buffer()
        esize = buf.element_size()
        if st.iter < st.start_powerSGD_iter:
            return ring_allreduce_bytes(buf.numel() * esize, world)
        # Mirrors the hook's split: matrices worth compressing send P (rows x r) and Q (cols x r); everything
        # else is all-reduced as is.
        dense_elems = p_elems = q_elems = 0
        for g in bucket.gradients():
            if g.dim() > 1:
                rows, cols = g.shape[0], g.numel() // g.shape[0]
                r = min(rows, cols, st.matrix_approximation_rank)
                if (rows + cols) * r * st.min_compression_rate < rows * cols:
                    p_elems += rows * r
                    q_elems += cols * r
                    continue
            dense_elems += g.numel()
        return sum(ring_allreduce_bytes(e * esize, world) for e in (dense_elems, p_elems, q_elems))
