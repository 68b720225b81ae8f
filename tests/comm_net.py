"""The small model and batches the comm-hook tests train on 2 gloo ranks."""

from __future__ import annotations

import torch


def three_bucket_model() -> torch.nn.Module:
    torch.manual_seed(0)
    # fc2's weight (32,768 entries) alone passes a 4 KB cap: DDP rebuilds the buckets as [fc3], [fc2], [fc1]
    return torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.ReLU(), torch.nn.Linear(128, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 4))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(32, 16, generator=g)
    return x, (x[:, :4] * 3).argmax(1)


def spawn_ranks(worker, world: int, folder) -> list[dict]:
    """Run ``worker(rank, world, folder)`` on ``world`` spawned ranks; each saves ``out<rank>.pt`` in ``folder``."""
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(world, str(folder)), nprocs=world, join=True)
    return [torch.load(f"{folder}/out{r}.pt", weights_only=False) for r in range(world)]
