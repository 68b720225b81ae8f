"""Resume as exact continuation in every comm mode, on a real 2-rank gloo group (2 simulated nodes x 1 worker).

For each mode: train N steps uninterrupted; then train K steps, write each rank's state through the files the
trainer writes (``save_rank_state``), build fresh model, DDP, hook and optimizer, load them back with
``load_rank_state`` (``weights_only=True``) and train N - K steps. The parameters must match the uninterrupted
run's. Buckets are small (three per step), so the run uses DDP's rebuilt buckets from its second step on,
while a fresh DDP starts on one bucket of everything: the resume must replay the saved layout.

One process spawn feeds all tests (a module fixture); every resume is wrapped so that a failure is recorded
per mode and reported by that mode's test instead of taking the whole spawn down.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightray.comm.hook import CommHook
from lightray.comm.topology import Topology
from lightray.config import CommConfig
from lightray.train.state import load_rank_state, save_rank_state
from tests.comm_net import batch, spawn_ranks, three_bucket_model
from tests.devices import lazy_device

WORLD = 2
STEPS, STOP = 8, 4  # resume after 4 of 8 steps: two dense warm-up steps, then compressed ones on both sides
BUCKET_MB = 0.004  # 4 KB: three buckets once DDP has rebuilt them (see _model)
BASE = {"ratio": 0.05, "warmup_steps": 2, "payload": "compact", "resize_dense_steps": 1}
MODES: dict[str, dict[str, Any]] = {
    "dense": {"mode": "dense"},
    "fp16": {"mode": "fp16"},
    "bf16": {"mode": "bf16"},
    "topk": {"mode": "topk"},
    # every DGC unit, and sampled selection (the middle bucket has more than MIN_SAMPLED entries), so the
    # selection generator's position matters
    "topk_dgc": {"mode": "topk", "momentum_correction": True, "momentum_masking": True, "local_clip": 5.0,
                 "selection": "sampled"},
    "hierarchical_topk": {"mode": "hierarchical_topk"},
    "powersgd": {"mode": "powersgd", "powersgd_rank": 2},
    "auto": {"mode": "auto", "link_gbps": 0.001},  # a slow link: picks hierarchical top-k after 2 measured steps
}
# modes whose resume without the saved bucket layouts must differ (the test data would be too weak otherwise)
LAYOUT_SENSITIVE = ("topk", "powersgd")


_model, _batch = three_bucket_model, batch


class Run:
    """One rank's model, DDP wrapper, hook and optimizer, built as the trainer builds them."""

    def __init__(self, topo: Topology, cfg: dict[str, Any]):
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.model = _model()
        self.ddp = DDP(self.model, bucket_cap_mb=BUCKET_MB, gradient_as_bucket_view=True)
        self.hook = CommHook(CommConfig(**{**BASE, **cfg}), topo, torch.device("cpu"), optimizer="sgd")
        self.hook.install(self.ddp)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)

    def train(self, first: int, last: int, rank: int) -> None:
        for step in range(first, last):
            for g in self.opt.param_groups:
                g["momentum"] = self.hook.optimizer_momentum(0.9)  # 0 under momentum correction
            x, y = _batch(rank, step)
            self.opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(self.ddp(x), y).backward()
            self.opt.step()

    def params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])

    def save(self, folder: str, rank: int) -> None:
        """This rank's state file as the trainer writes it: its comm state; rank 0's model and optimizer too."""
        state: dict[str, Any] = {"comm": self.hook.state_dict()}
        if rank == 0:
            state.update(model=self.model.state_dict(), optimizer=self.opt.state_dict())
        save_rank_state(folder, rank, state, {"samples_seen": STOP, "world_size": WORLD})

    def load(self, shared: dict, own: dict) -> None:
        self.model.load_state_dict(shared["model"])
        self.opt.load_state_dict(shared["optimizer"])
        self.hook.load_state_dict(own["comm"], world_size=WORLD)


def _to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to(v, device) for v in obj]
    return obj


def _resume(topo: Topology, cfg: dict, folder: str, rank: int, drop_layouts: bool = False,
            comm_device: torch.device | None = None) -> dict[str, Any]:
    """Fresh objects loaded from ``folder``, trained to the end; the parameters, or the error that stopped it."""
    try:
        shared = load_rank_state(folder, 0)
        own = shared if rank == 0 else load_rank_state(folder, rank)
        if drop_layouts:
            own["comm"].pop("bucket_layouts", None)
        if comm_device is not None:  # as if the file had been loaded onto the worker's (non-CPU) device
            own = {"comm": _to(own["comm"], comm_device)}
        run = Run(topo, cfg)
        run.load(shared, own)
        run.train(STOP, STEPS, rank)
        return {"params": run.params(), "error": None, "describe": run.hook.describe(),
                "compressed": run.hook.compressed_steps, "sampled": run.hook.selection.sampled}
    except Exception:
        return {"params": None, "error": traceback.format_exc(limit=4)}


def _worker(rank: int, world: int, folder: str) -> None:
    topo = Topology.simulated(world, rank, 1)
    lazy = lazy_device()
    out: dict[str, Any] = {"lazy": lazy is not None}
    for name, cfg in MODES.items():
        whole = Run(topo, cfg)
        whole.train(0, STEPS, rank)
        first = Run(topo, cfg)
        first.train(0, STOP, rank)
        ckpt = os.path.join(folder, name)
        first.save(ckpt, rank)
        dist.barrier()
        d = {"whole": whole.params(), "mode": whole.hook.mode, "whole_compressed": whole.hook.compressed_steps,
             "resumed": _resume(topo, cfg, ckpt, rank)}
        if name in LAYOUT_SENSITIVE:
            d["no_layouts"] = _resume(topo, cfg, ckpt, rank, drop_layouts=True)
        if name == "topk_dgc" and lazy is not None:
            d["from_lazy"] = _resume(topo, cfg, ckpt, rank, comm_device=lazy)
        out[name] = d
        dist.barrier()
    torch.save(out, os.path.join(folder, f"out{rank}.pt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    return spawn_ranks(_worker, WORLD, tmp_path_factory.mktemp("comm_resume"))


def _check(resumed: dict, whole: torch.Tensor) -> None:
    assert resumed["error"] is None, resumed["error"]
    torch.testing.assert_close(resumed["params"], whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", list(MODES))
def test_stopped_and_resumed_run_ends_with_the_uninterrupted_parameters(runs, mode):
    for r in range(WORLD):
        d = runs[r][mode]
        _check(d["resumed"], d["whole"])
        if mode != "dense":
            assert d["resumed"]["compressed"] > 0, d["resumed"]["describe"]  # compression ran after the resume
    torch.testing.assert_close(runs[1][mode]["whole"], runs[0][mode]["whole"], rtol=0, atol=1e-6)


def test_auto_resumes_with_its_saved_choice(runs):
    assert runs[0]["auto"]["mode"] == "hierarchical_topk"
    assert "kept from the checkpoint" in runs[0]["auto"]["resumed"]["describe"]


def test_first_step_after_resume_replays_the_saved_bucket_layout(runs):
    for mode in LAYOUT_SENSITIVE:
        for r in range(WORLD):
            d = runs[r][mode]
            assert "saved bucket layout" in d["resumed"]["describe"], d["resumed"]["describe"]
            # Without the layout the first resumed step selects over one bucket of everything: another run.
            assert d["no_layouts"]["error"] is None, d["no_layouts"]["error"]
            assert not torch.allclose(d["no_layouts"]["params"], d["whole"], rtol=1e-5, atol=1e-6), mode


def test_sampled_selection_resumes_its_generator(runs):
    for r in range(WORLD):
        assert runs[r]["topk_dgc"]["resumed"]["sampled"] > 0  # the generator was drawn from after the resume


def test_hook_state_loaded_onto_another_device_resumes_exactly(runs):
    """A GPU worker loaded its files onto its device, and restoring the selection generator from a CUDA
    tensor crashed. Here torch's lazy device stands in for the GPU: the hook moves what it needs."""
    if not runs[0]["lazy"]:
        pytest.skip("torch's lazy-tensor backend is not available in this torch build")
    for r in range(WORLD):
        d = runs[r]["topk_dgc"]
        _check(d["from_lazy"], d["whole"])


# A CUDA generator's state is 16 bytes (seed and offset), a CPU one's 5,056: what the GPU run's checkpoint holds.
CUDA_GENERATOR_STATE = torch.Generator().manual_seed(7).get_state()[:16].clone()


@pytest.mark.parametrize("mode", list(MODES))
def test_a_checkpoint_taken_on_a_gpu_resumes_on_a_cpu_worker_in_every_mode(mode):
    """The hook state a GPU worker writes, loaded by a CPU worker at the same layout: it used to raise in
    ``Generator.set_state`` ("RNG state is wrong size") in every mode, dense included."""
    topo = Topology.simulated(WORLD, 1, 1)
    saved = CommHook(CommConfig(**{**BASE, **MODES[mode]}), topo, torch.device("cpu"), optimizer="sgd")
    sd = saved.state_dict()
    sd.update(selection_rng=CUDA_GENERATOR_STATE, selection_rng_device="cuda")
    resumed = CommHook(CommConfig(**{**BASE, **MODES[mode]}), topo, torch.device("cpu"), optimizer="sgd")
    resumed.load_state_dict(sd, WORLD)
    assert "selection generator saved on a cuda device reseeded on cpu" in resumed.describe(), resumed.describe()
    # The generator draws, and from the same seed on every resume of this rank at this step.
    again = CommHook(CommConfig(**{**BASE, **MODES[mode]}), topo, torch.device("cpu"), optimizer="sgd")
    again.load_state_dict(sd, WORLD)
    assert torch.equal(torch.randint(1000, (8,), generator=resumed.sparse.gen),
                       torch.randint(1000, (8,), generator=again.sparse.gen))


def test_a_checkpoint_from_the_same_kind_of_device_keeps_its_generator_position():
    topo = Topology.simulated(WORLD, 0, 1)
    cfg = CommConfig(**{**BASE, **MODES["topk_dgc"]})
    saved = CommHook(cfg, topo, torch.device("cpu"), optimizer="sgd")
    torch.randint(1000, (5,), generator=saved.sparse.gen)  # moved on from its seed
    sd = saved.state_dict()
    want = torch.randint(1000, (8,), generator=saved.sparse.gen)
    resumed = CommHook(cfg, topo, torch.device("cpu"), optimizer="sgd")
    resumed.load_state_dict(sd, WORLD)
    assert torch.equal(torch.randint(1000, (8,), generator=resumed.sparse.gen), want)
    assert "reseeded" not in resumed.describe()
