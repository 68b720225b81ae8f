"""The residual store every comm mode shares: per-parameter hook state (error-feedback residuals, momentum-correction
velocities) that survives DDP's bucket rebuild."""

from __future__ import annotations

import torch

Layout = list[tuple[str, int]]  # (parameter name, numel) in bucket order

class SlotStore:
    """One kind of per-parameter hook state (residuals, velocities), robust to DDP's bucket rebuild.

    The canonical form is per parameter name; while a bucket's layout stays the same its state is one
    flat fp32 tensor (bucket index -> (layout, flat)). A bucket whose layout differs from the cached
    one (DDP rebuilt its buckets) sends every flat tensor back to per-parameter form first, so state
    is never applied to the wrong parameter.
    """

    def __init__(self) -> None:
        self._flat: dict[int, tuple[Layout, torch.Tensor]] = {}
        self._pending: dict[str, torch.Tensor] = {}

    def get(self, index: int, layout: Layout, n: int, device: torch.device,
            create: bool = True) -> torch.Tensor | None:
        """The flat state of bucket ``index`` (zeros where none is stored); None if ``create`` is off
        and nothing is stored for any of its parameters."""
        entry = self._flat.get(index)
        if entry is not None and entry[0] == layout and entry[1].numel() == n:
            return entry[1]
        if entry is not None:
            self._flush()
        if not create and not any(name in self._pending for name, _ in layout):
            return None
        parts = []
        for name, numel in layout:
            r = self._pending.pop(name, None)
            parts.append(r.reshape(-1).to(device=device, dtype=torch.float32) if r is not None and r.numel() == numel
                         else torch.zeros(numel, dtype=torch.float32, device=device))
        flat = torch.cat(parts) if parts else torch.zeros(n, dtype=torch.float32, device=device)
        self._flat[index] = (list(layout), flat)
        return flat

    def pop(self, index: int, layout: Layout, n: int, device: torch.device) -> torch.Tensor | None:
        """Take bucket ``index``'s state out of the store (None if there is none)."""
        t = self.get(index, layout, n, device, create=False)
        if t is not None:
            del self._flat[index]
        return t

    def _flush(self) -> None:
        for layout, flat in self._flat.values():
            for (name, _), piece in zip(layout, flat.split([nm for _, nm in layout])):
                self._pending[name] = piece.clone()
        self._flat.clear()

    def per_param(self) -> dict[str, torch.Tensor]:
        out = {k: v.detach().cpu().clone() for k, v in self._pending.items()}
        for layout, flat in self._flat.values():
            for (name, _), piece in zip(layout, flat.split([nm for _, nm in layout])):
                out[name] = piece.detach().cpu().clone()
        return out

    def load(self, per_param: dict[str, torch.Tensor], device: torch.device) -> None:
        """Take saved per-parameter state, wherever it was loaded, onto ``device`` (where the buckets live)."""
        self.clear()
        self._pending = {k: v.detach().to(device, copy=True) for k, v in per_param.items()}

    def clear(self) -> None:
        self._flat.clear()
        self._pending.clear()

    def __len__(self) -> int:
        return len(self._pending) + sum(len(layout) for layout, _ in self._flat.values())


# residual: undelivered (velocity or gradient) of error feedback; momentum: local velocity u of momentum correction
# on compressed steps; dense_momentum: the global velocity kept on dense steps under momentum correction (the same
# on every rank), handed to ``momentum`` when compression starts.
SLOTS = ("residual", "momentum", "dense_momentum")


def new_slots() -> dict[str, SlotStore]:
    """One empty store per kind of slot state."""
    return {name: SlotStore() for name in SLOTS}
