"""Where JPEG tiers are decoded under ``data.decode_on=auto``, decided again at every worker-group start.

A GPU cluster that autoscales from a head alone has no GPU when the driver plans the run: the nvJPEG probe had
nothing to run on, and the CPU path used to stay for the whole run, whatever GPUs came later. Now the driver
keeps its measurements on each JPEG phase (``PhaseSpec.decode_rates``: the CPU path's rate per core, and the GPU's
decode rate when a GPU was free to time it on), and each worker-group start decides from the group it got:

- the GPU's decode rate: the driver's, or else the one rank 0 measured on its own device at this start
  (:func:`probe_on_worker`, logged to the run's log actor, whose newest ``decode_probe`` record the start reads);
- the physical cores behind this start's Ray Data CPU share, per GPU of the group (one per worker);
- then :func:`lightray.data.autotune.estimate_decode`, the rule the driver applies on a cluster that has its GPUs.

``PlanDataConfig`` (app/data/ingest.py) calls :func:`plan_start` once per start, before it makes the map tasks,
and logs one ``decode_on`` unit per phase with ``start: true``. Device augmentation is not re-planned: it
follows ``scaling.use_gpu`` and the tier's format, which no start changes.
"""

from __future__ import annotations

from typing import Any

from lightray.data import autotune
from lightray.data.spec import IngestSpec, PhaseSpec

PROBE_UNIT = "decode_probe"
PROBE_SECONDS = 1.0


def key_of(ph: PhaseSpec) -> str:
    """Phases that read one tier at one crop size share a measurement."""
    return f"{ph.shards.tier}:{ph.resolution}"


def needs_probe(spec: IngestSpec) -> list[PhaseSpec]:
    """The phases decided per start whose GPU decode rate the driver could not measure."""
    return [ph for ph in spec.phases if ph.decode_rates is not None and ph.decode_rates.get("device_img_s") is None]


def probe_on_worker(spec: IngestSpec, device: Any, seconds: float = PROBE_SECONDS) -> dict[str, Any]:
    """Rank 0's record of batched decode_jpeg on its own ``device``, per tier and crop of :func:`needs_probe`
    (the sample the driver timed the CPU path on)."""
    from lightray.data.device_decode import decode_rate

    rates: dict[str, float | None] = {}
    said = []
    for ph in needs_probe(spec):
        key = key_of(ph)
        if key in rates:
            continue
        try:
            sample = autotune.sample_encoded(spec, ph.index)
            rates[key] = round(decode_rate([d for d, _h, _w, _sid in sample], device, seconds), 1)
            said.append(f"tier:crop {key} {rates[key]:.0f} img/s")
        except Exception as exc:  # noqa: BLE001 - a failed timing leaves that tier on the CPU path, said
            rates[key] = None
            said.append(f"tier:crop {key} not timed ({type(exc).__name__}: {str(exc)[:160]})")
    return {"event": "unit", "unit": PROBE_UNIT, "device": str(device), "device_img_s": rates,
            "message": f"rank 0 timed decode_jpeg on {device} for this start's decode placement: {'; '.join(said)}"}


def plan_start(spec: IngestSpec, world_size: int, data_cpus: float, probe: dict[str, Any] | None,
               nodes: list[tuple[float, int]]) -> list[dict[str, Any]]:
    """Set ``device_decode`` of each phase decided per start, for a group of ``world_size`` GPU workers that
    leaves Ray Data ``data_cpus`` of the CPUs on ``nodes`` (:func:`autotune.node_cores`); one record per phase."""
    cpus_per_gpu = data_cpus / max(1, world_size)
    cores = autotune.data_cores_per_gpu(cpus_per_gpu, nodes)
    measured = (probe or {}).get("device_img_s") or {}
    out = []
    for ph in spec.phases:
        if ph.decode_rates is None:
            continue
        rates = ph.decode_rates
        device = rates.get("device_img_s") or measured.get(key_of(ph))
        where = "the driver's probe" if rates.get("device_img_s") else f"rank 0 on {(probe or {}).get('device')}"
        facts = {"world_size": world_size, "gpus": world_size, "cpus_per_gpu": round(cpus_per_gpu, 3),
                 "cores_per_gpu": round(cores, 3), "cpu_img_s_per_cpu": rates["cpu_img_s_per_cpu"],
                 "device_img_s": device, "model_img_s": rates.get("model_img_s")}
        if not device:
            ph.device_decode = False
            why = "no measurement of the workers' device decode (rank 0 logged none): kept the CPU path"
            out.append(_record(ph, "cpu", why, facts))
            continue
        est = autotune.estimate_decode(rates["cpu_img_s_per_cpu"], device, cores, rates.get("model_img_s") or 0.0)
        ph.device_decode = est.on == "device"
        why = (f"{est.rule}; G timed by {where}, C from the {data_cpus:g} CPUs this start leaves Ray Data over "
               f"{world_size} GPU(s) = {cores:.3g} physical cores per GPU")
        out.append(_record(ph, est.on, why, {**facts, "train_img_s": est.train_img_s}))
    return out


def _record(ph: PhaseSpec, on: str, why: str, facts: dict[str, Any]) -> dict[str, Any]:
    where = "batched decode_jpeg in the Train workers" if on == "device" else "Ray Data tasks on the CPU"
    return {"event": "unit", "unit": "decode_on", "start": True, "phase": ph.index, "on": on,
            "message": f"this start: phase {ph.index} ({ph.resolution}px) JPEG decode in {where} ({why})", **facts}
