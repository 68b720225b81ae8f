"""One finished smoke run for every test that only reads one: the end-to-end smoke checks, export, inference
(eval, predict, load_model), the report and the resume tests' uninterrupted reference.

It is the real command, `python app/run.py --smoke-test` on a local Ray cluster with 2 gloo workers, run on a
pseudo-terminal as a user's shell runs it (the console tests read what it drew there), with every
option those readers need: EMA (the export writes the EMA copy), TensorBoard (on by default), the per-step
sample log (the resume tests audit it), each phase's stream opened ahead (``scaling.stream_ahead``) and a data
task worker warmed by each rank (``scaling.warm_data_workers``). Its data
is an ImageFolder tree of 64 px photos in 3 classes told apart
by colour (tests/photos.py), in the smoke recipe's shape (256 train and 64 val images, 2 epochs, 32 then 48 px):
the smoke recipe's 12 steps learn it (100% top-1 here), where on the 10 demo shapes they stay at chance (12.5%).
Made once per CI run when LIGHTRAY_TEST_SHARED is set (the default and the slow suites share it), else once per
test session.

The resume tests start their own drivers with ``finished_run_args`` so that this run is their exact reference."""

from __future__ import annotations

import json
import pathlib
import shutil

from tests.faults import driver_command, run_on_a_terminal
from tests.once import one_maker
from tests.photos import photo_tree

NAME = "finished"
CLASSES = ["c0", "c1", "c2"]
CHANCE = 1 / len(CLASSES)
TOP1_TARGET = 0.9


def photos(shared: pathlib.Path) -> pathlib.Path:
    """The run's source: 90 train and 24 val photos a class (the smoke recipe takes 256 and 64 of them)."""
    root = shared / "finished-run-photos"
    with one_maker(root):
        if not (root / "done").is_file():
            shutil.rmtree(root, ignore_errors=True)
            photo_tree(root, 64, per_class=90, val_per_class=24)
            (root / "done").write_text("")
    return root


def finished_run_args(shared: pathlib.Path) -> tuple[str, ...]:
    """The options of the finished run, for drivers that must train the same model (the resume tests)."""
    # Targets above chance (1/3): a top-1 the run must learn to reach; a top-5 that 3 classes give at once.
    # scaling.stream_ahead and scaling.warm_data_workers are off on a CPU by default: on here, their wiring is read
    # from a real run, and the resume tests stop and resume runs that hold a stream opened ahead.
    return ("--data", str(photos(shared)), "--optim.ema_decay=0.8", f"--report.targets=[{TOP1_TARGET}]",
            "--report.top5_targets=[1.0]", "--scaling.stream_ahead=true", "--scaling.warm_data_workers=1")


def finished_run(shared: pathlib.Path, shared_cache: pathlib.Path) -> pathlib.Path:
    """The run's folder; its console output is kept beside it in ``run.log``."""
    storage = shared / "finished-run"
    run_dir = storage / NAME
    log = storage / "run.log"
    if (run_dir / "summary.json").is_file() and log.is_file():
        if json.loads((run_dir / "summary.json").read_text()).get("status") == "finished":
            return run_dir
    shutil.rmtree(run_dir, ignore_errors=True)  # an earlier attempt cut short: start again, not resume
    storage.mkdir(parents=True, exist_ok=True)
    planted = plant_stale_cluster_address()
    out = run_on_a_terminal(driver_command(storage, NAME, *finished_run_args(shared), cache=shared_cache),
                            timeout=280)
    (storage / STALE_RECORD).write_text(json.dumps(
        {"planted": planted, "left_after_run": planted is not None and _address_file().exists()}))
    log.write_text(out)
    return run_dir


STALE_RECORD = "stale_cluster_address.json"


def _address_file() -> pathlib.Path:
    from lightray.ray_private import address_file

    return pathlib.Path(address_file())


def plant_stale_cluster_address() -> str | None:
    """Write this host's "current cluster" file naming an address nothing answers at, as a cluster killed without
    ``ray stop`` leaves it (the driver must remove it: lightray.ray_private); None when a file is there already
    (a live cluster of someone else's, left alone)."""
    import socket

    f = _address_file()
    if f.exists():
        return None
    with socket.socket() as s:  # a port that was free a moment ago and that nothing listens on now
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(address)
    return address


def stale_cluster_address(run_dir: pathlib.Path) -> dict:
    """What plant_stale_cluster_address planted before the run, and whether the file was still there after it."""
    return json.loads((run_dir.parent / STALE_RECORD).read_text())


def console(run_dir: pathlib.Path) -> str:
    """What the run printed on its terminal (stdout and stderr together), its carriage returns kept."""
    with open(run_dir.parent / "run.log", newline="") as f:  # universal newlines would read each "\r" as "\n"
        return f.read()


def val_source_files(run_dir: pathlib.Path) -> tuple[pathlib.Path, list[str]]:
    """(source root, paths relative to it) of the images in the run's val split, in the shard order."""
    import pyarrow.parquet as pq

    from lightray.data.manifest import Manifest

    data = json.loads((run_dir / "data.json").read_text())
    manifest = Manifest.load(data["manifest"])
    paths = [p for s in manifest.shards("val", data["val_tier"])
             for p in pq.read_table(s.uri, columns=["path"]).column("path").to_pylist()]
    return pathlib.Path(manifest.source), paths
