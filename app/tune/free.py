"""A trial that ends (stopped by ASHA, finished, failed) gives its Train workers' CPUs back at once.

Ray Train creates the worker group's placement group from its controller actor, so the group's lifetime
is the job's, not the controller's: when Tune stops a trial, the trial's process and its controller die
but the placement group stays reserved until Ray Train's cleaner actor notices, and that cleaner needs the
State API (a dashboard) to tell that the controller is gone. Without it the CPUs are lost for the rest of
the search, and later trials queue behind ghosts.

So the experiment tracks them itself: ``PlacementGroupRecorder`` (a Ray Train worker-group callback, run
in the trial's controller) writes the id of every placement group the run starts into the trial's run
folder, and ``FreeTrialResources`` (a Tune callback, run in the experiment's driver) removes those still
reserved as soon as Tune reports the trial complete or errored.
"""

from __future__ import annotations

import json
import logging
import os

from ray import tune

from lightray import ray_private

log = logging.getLogger("lightray.tune")
PG_FILE = "train_placement_groups.json"


class PlacementGroupRecorder(ray_private.WorkerGroupCallback):
    """Appends the worker group's placement group id to ``<run_dir>/train_placement_groups.json``."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir

    def after_worker_group_start(self, worker_group) -> None:
        try:
            pg = worker_group.get_worker_group_state().placement_group_handle.placement_group
            ids = read_ids(self.run_dir) + [pg.id.hex()]
            path = os.path.join(self.run_dir, PG_FILE)
            with open(path + ".tmp", "w") as f:
                json.dump(ids, f)
            os.replace(path + ".tmp", path)
        except Exception as exc:  # never fail a run over bookkeeping; the group is then left to Ray Train
            log.warning("could not record the worker group's placement group: %s", exc)


def read_ids(run_dir: str) -> list[str]:
    try:
        with open(os.path.join(run_dir, PG_FILE)) as f:
            return list(json.load(f))
    except (OSError, ValueError):
        return []


def free_placement_groups(run_dir: str) -> int:
    """Remove the run's recorded placement groups that are still reserved; returns how many it removed."""
    from ray.util.placement_group import placement_group_table, remove_placement_group

    removed = 0
    for pg_hex in read_ids(run_dir):
        pg = ray_private.placement_group_from_hex(pg_hex)
        try:
            if placement_group_table(pg).get("state") in ("CREATED", "PENDING", "RESCHEDULING"):
                remove_placement_group(pg)
                removed += 1
        except Exception as exc:  # already gone, or the GCS is shutting down with the search
            log.debug("placement group %s: %s", pg_hex, exc)
    return removed


class FreeTrialResources(tune.Callback):
    """Tune callback: frees an ended trial's Train placement groups (see the module doc)."""

    def __init__(self, exp_dir: str) -> None:
        self.exp_dir = exp_dir

    def _free(self, trial) -> None:
        n = free_placement_groups(os.path.join(self.exp_dir, trial.trial_id))
        if n:
            log.info("trial %s: freed %d Train placement group(s) left reserved", trial.trial_id, n)

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._free(trial)

    def on_trial_error(self, iteration, trials, trial, **info):
        self._free(trial)
