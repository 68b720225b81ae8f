"""The small model and batches the comm-hook tests train on 2 gloo ranks, and the session's gloo groups they
run on (one per world size, shared by every comm test module)."""

from __future__ import annotations

import atexit
import os
import shutil
import time

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
    """Run ``worker(rank, world, folder)`` on the ``world`` ranks of this session's gloo group of that size;
    each saves ``out<rank>.pt`` in ``folder``. The worker finds the group already joined."""
    return rank_pool(world).run(worker, folder)


def rank_pool(world: int) -> RankPool:
    """This session's ranks of a gloo group of ``world``: spawned and joined on first use, kept for every later
    test (torch's import and the group's start are most of a short distributed test's time on 2 cores)."""
    pool = _POOLS.get(world)
    if pool is not None and (not pool.alive() or time.monotonic() - pool.last_used > IDLE_EXIT_S / 2):
        pool.close()  # ended, or close enough to its idle exit to race a new task
        pool = None
    if pool is None:
        pool = _POOLS[world] = RankPool(world)
    return pool


class RankPool:
    """``world`` spawned processes in one gloo group, each running the functions it is sent, one at a time.

    A task that fails on any rank (or outlives ``task_timeout_s``) ends the pool: its ranks may be left inside a
    collective, so the next user gets a fresh one. What a task changes in ``torch.distributed``'s namespace (a
    byte counter wrapping all_reduce) is put back after it."""

    def __init__(self, world: int, task_timeout_s: float = 240.0):
        import tempfile

        import torch.multiprocessing as mp

        self.world, self.task_timeout_s = world, task_timeout_s
        self.last_used = time.monotonic()
        self._store = tempfile.mkdtemp(prefix=f"lightray-ranks{world}-")
        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, world, self._store, child), daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)  # False once a rank ended for idleness

    def run(self, worker, folder) -> list[dict]:
        for conn in self._conns:
            conn.send((worker, str(folder)))
        errors = []
        for rank, conn in enumerate(self._conns):
            if not conn.poll(self.task_timeout_s):
                errors.append(f"rank {rank}: no answer within {self.task_timeout_s} s")
                break
            try:
                answer = conn.recv()
            except EOFError:
                answer = "the rank's process ended"
            if answer != "ok":
                errors.append(f"rank {rank}:\n{answer}")
        self.last_used = time.monotonic()
        if errors:
            self.close()
            raise AssertionError(f"{worker.__qualname__} failed on the rank pool:\n" + "\n".join(errors))
        return [torch.load(f"{folder}/out{r}.pt", weights_only=False) for r in range(self.world)]

    def close(self) -> None:
        for proc in self._procs:
            proc.kill()
        for proc in self._procs:
            proc.join(timeout=30)
        shutil.rmtree(self._store, ignore_errors=True)


def _serve(rank: int, world: int, store: str, conn) -> None:
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    from lightray.units import pop_unit_events

    # A rank that fails alone must not hang its peers for gloo's default 30 minutes.
    dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    while True:
        # An idle group still costs CPU (a few seconds a minute a rank): one left unused for a while ends, and
        # rank_pool() starts a new one for a later user.
        if not conn.poll(IDLE_EXIT_S):
            os._exit(0)
        try:
            worker, folder = conn.recv()
        except EOFError:  # the test session ended
            os._exit(0)
        namespace = dict(vars(dist))
        pop_unit_events()  # the previous task's
        try:
            worker(rank, world, folder)
            dist.barrier()
            conn.send("ok")
        except BaseException:
            conn.send(traceback.format_exc(limit=8))
        for name, value in namespace.items():
            if vars(dist).get(name) is not value:
                setattr(dist, name, value)


_POOLS: dict[int, RankPool] = {}
IDLE_EXIT_S = 60.0


@atexit.register
def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
