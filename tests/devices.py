"""A device that is not the CPU, for tests on machines without a GPU."""

from __future__ import annotations

import torch


def lazy_device() -> torch.device | None:
    """torch's lazy-tensor device (TorchScript backend): not the CPU, but holds real data and copies to and
    from the CPU, so code that must move tensors off a worker's device can be checked without a GPU. None
    where this torch build lacks it."""
    try:
        import torch._lazy
        import torch._lazy.ts_backend

        torch._lazy.ts_backend.init()
        torch.zeros(1, device="lazy").cpu()
        return torch.device("lazy")
    except Exception:
        return None
