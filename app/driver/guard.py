"""The driver's guardian: the process that speaks for a training run when Ray ends its driver without a word.

When the raylet of the driver's own node stops (``ray stop`` on the head, the head's Ray crashing), Ray's core
worker in the driver ends the process from C++ within a second (``QuickExit``, exit status 1). No Python code
runs after that: no summary.json, no message, no resume command; ``ClusterWatch`` (cluster_loss.py) only covers
a GCS that goes away while the driver lives on. Which of the two a ``ray stop`` produces is a race between the
raylet's and the GCS's shutdown.

So ``python app/run.py`` (and the ``lightray`` command) run the driver of a training run or a search in a
child forked before Ray or torch is imported. This parent, the guardian, only waits. The child tells it
through a pipe which run it drives (``tell_run``), and tells it when Python itself ended the child (a return,
a handled error, an uncaught exception). A child that fails while its cluster is gone, or dies with no word
from Python, was ended from outside, and the guardian does what the child could not: summary.json (status
failed, the cause), one ``lightray: error:`` line, the command that continues the run, and exit status
``EXIT_CLUSTER_LOST`` when the cluster is gone (its GCS or the driver's raylet does not answer), else the
child's own status.

To the user and to process tools the started command is still the driver: the child dies with the guardian
(``PR_SET_PDEATHSIG``), the run lock names the guardian's pid, SIGTERM and SIGHUP sent to the guardian reach
the child, and Ctrl-C (which the terminal sends to both) is left to the child's own handling.
``LIGHTRAY_DRIVER_GUARD=0`` runs the driver in one process, as before.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import json
import os
import signal
import sys
import time
from typing import Any

from lightray.driver.cluster_loss import EXIT_CLUSTER_LOST
from lightray.driver.run_lock import EXIT_LOCK_LOST

GUARD_ENV = "LIGHTRAY_DRIVER_GUARD"
_PR_SET_PDEATHSIG = 1
_FORWARDED = (signal.SIGTERM, signal.SIGHUP)
# How long a silent end waits for the cluster's ports to close before it counts as the driver's own death: a
# raylet stopped with SIGTERM drains for a few seconds before it closes its port.
SETTLE_S = 15.0
PYTHON_SETTLE_S = 5.0  # the same after a failure Python reported (a traceback): the common case waits less

_pipe_w: int | None = None  # the child's end of the pipe to its guardian; None when unguarded
_guardian: int | None = None


def enabled() -> bool:
    """Whether a driver started now would be guarded: on Linux (the child's death with its parent needs
    prctl), unless ``LIGHTRAY_DRIVER_GUARD=0``."""
    return sys.platform.startswith("linux") and os.environ.get(GUARD_ENV, "1").strip().lower() not in (
        "0", "false", "no", "off")


def driver_pid() -> int:
    """The pid that stands for this driver: the guardian's when guarded (the command the user started)."""
    return _guardian if _guardian is not None else os.getpid()


def tell(**fields: Any) -> None:
    """Child side: send the guardian one message (no-op when unguarded): ``run=`` (what it needs to write
    summary.json) once the run is known."""
    if _pipe_w is None:
        return
    data = (json.dumps(fields, default=str) + "\n").encode()
    try:
        while data:
            data = data[os.write(_pipe_w, data):]
    except OSError:
        pass  # the guardian is gone: the child dies with it anyway


def tell_run(run: dict[str, Any]) -> None:
    """Child side, once connected to Ray: tell the guardian the run (``kind`` "run", the default, or "tune";
    ``name``, ``storage``; for a run what summary.json needs) with the addresses that show whether the cluster
    is gone: the GCS and this node's raylet."""
    if _pipe_w is None:
        return
    tell(run={**run, **_cluster_addresses()})


@functools.cache
def _cluster_addresses() -> dict[str, str | None]:
    """This driver's GCS and raylet addresses, asked of Ray once (a run tells its guardian twice)."""
    import ray

    ctx = ray.get_runtime_context()
    me = next((n for n in ray.nodes() if n.get("NodeID") == ctx.get_node_id()), {})
    raylet = f"{me['NodeManagerAddress']}:{me['NodeManagerPort']}" if me.get("NodeManagerPort") else None
    return {"gcs_address": ctx.gcs_address, "raylet_address": raylet}


def guard() -> int | None:
    """Fork the driver off. In the child, returns None (go on and run the driver). In the guardian, waits for
    the child and returns the exit status to end with. Returns None without forking when guarding is off."""
    global _pipe_w, _guardian
    if not enabled():
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    r, w = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the driver
        os.close(r)
        _die_with(parent)
        _pipe_w, _guardian = w, parent
        # Python ending the driver says so (cli.main's finally first, this hook for any other way out); Ray's C++
        # code or a signal ending it does not: the guardian tells the two apart by it.
        atexit.register(tell, python_exit=True)
        return None
    os.close(w)
    return _Guardian(pid, r).wait()


def _die_with(parent: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the guardian died before prctl took effect
        os._exit(1)


class _Guardian:
    def __init__(self, child: int, pipe_r: int):
        self.child, self.pipe_r = child, pipe_r
        self.forwarded: int | None = None

    def _forward(self, signum: int, _frame: Any) -> None:
        self.forwarded = signum
        try:
            os.kill(self.child, signum)
        except ProcessLookupError:
            pass

    def _interrupt(self, signum: int, _frame: Any) -> None:
        # Ctrl-C in a terminal reaches the whole foreground group, the child included; a SIGINT sent to this
        # pid alone (kill -INT, a supervisor) must still reach the child.
        try:
            foreground = os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
        except (OSError, ValueError):
            foreground = False
        if not foreground:
            self._forward(signum, _frame)

    def wait(self) -> int:
        for sig in _FORWARDED:
            signal.signal(sig, self._forward)
        signal.signal(signal.SIGINT, self._interrupt)
        _, status = os.waitpid(self.child, 0)
        messages = self._read_messages()
        code = os.waitstatus_to_exitcode(status)
        run = next((m["run"] for m in reversed(messages) if "run" in m), None)
        if run is None or code in (0, EXIT_CLUSTER_LOST, EXIT_LOCK_LOST) or self.forwarded is not None:
            # EXIT_CLUSTER_LOST: the driver's own ClusterWatch said it all. EXIT_LOCK_LOST: the run is another
            # driver's now, and a summary written here would be written over its run.
            return self._pass_on(code)
        python_exit = any(m.get("python_exit") for m in messages)
        if python_exit and code == 2:  # a usage or data error the CLI reported in its one line
            return self._pass_on(code)
        if run.get("own_cluster"):  # the local cluster it started ends with it: its state says nothing
            return self._pass_on(code) if python_exit else speak_for(run, code, None)
        # A failure while the cluster is gone is the loss, whatever Python said first (a Ray error, a
        # traceback); with the cluster up, a failure Python reported itself is passed on as it is. A Ray
        # error can come a few seconds before the stopping node closes its ports, a silent end sooner still.
        cause = lost_cause(run, code, settle_s=PYTHON_SETTLE_S if python_exit else SETTLE_S)
        if cause is None and python_exit:
            return self._pass_on(code)
        return speak_for(run, code, cause)

    def _read_messages(self) -> list[dict[str, Any]]:
        os.set_blocking(self.pipe_r, False)
        chunks = []
        try:
            while chunk := os.read(self.pipe_r, 65536):
                chunks.append(chunk)
        except BlockingIOError:
            pass
        os.close(self.pipe_r)
        out = []
        for line in b"".join(chunks).splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a message cut off by the child's death
        return out

    def _pass_on(self, code: int) -> int:
        if code < 0:  # died by a signal: end the same way, so that the caller sees the same status
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
            time.sleep(1)
            return 128 - code
        return code


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def lost_cause(run: dict[str, Any], code: int, settle_s: float = SETTLE_S, every_s: float = 0.5) -> str | None:
    """Why the cluster counts as lost, or None when the GCS and the driver's raylet both kept answering for
    ``settle_s``: Ray may end the driver a moment before a stopping node closes its ports."""
    from lightray.driver.cluster_loss import gcs_reachable

    gcs, raylet = run.get("gcs_address"), run.get("raylet_address")
    ended = f"the driver ended ({_how(code)})"
    deadline = time.monotonic() + settle_s
    while True:
        if gcs and not gcs_reachable(gcs):
            return (f"the Ray cluster at {gcs} was lost: its GCS does not answer (the cluster was stopped or "
                    f"its head node went down); {ended}")
        if raylet and not gcs_reachable(raylet):
            return (f"the Ray cluster at {gcs} was lost: the Ray node of this driver (raylet {raylet}) "
                    f"stopped (the cluster was stopped or the node went down); {ended}")
        if time.monotonic() >= deadline:
            return None
        time.sleep(every_s)


def speak_for(run: dict[str, Any], code: int, cause: str | None) -> int:
    """Guardian side, once the child failed with its cluster gone (``cause``) or died without a word from
    Python: summary.json (failed, the cause), the lines that say so, the run lock released; returns the
    status to exit with."""
    from lightray.driver.cluster_loss import ClusterLostError, announce_stop

    tune = run.get("kind") == "tune"
    if cause is not None:
        error: Exception = ClusterLostError(cause)
    else:
        still = "" if run.get("own_cluster") else " while its Ray cluster still answers"
        error = DriverDiedError(f"the driver process ended unexpectedly ({_how(code)}){still}; see its output "
                                "above and Ray's logs")
    if not tune:  # a search's state is Tune's own experiment folder, which --resume reads
        try:
            write_failed_summary(run, error)
        except Exception as exc:  # the lines and the resume command must still come out
            print(f"lightray: warning: could not write summary.json: {exc}", file=sys.stderr, flush=True)
        _release_lock(run["run_dir"])
    announce_stop(str(error), run["name"], run["storage"], tune=tune)
    return EXIT_CLUSTER_LOST if cause is not None else (code if code > 0 else 128 - code)


class DriverDiedError(RuntimeError):
    """The driver process ended without finishing its run, and not because the cluster went away."""


def write_failed_summary(run: dict[str, Any], error: Exception) -> None:
    """summary.json for a run whose driver is gone, from what the run wrote: its config, metrics and bill."""
    from lightray.config import config_from_dict
    from lightray.driver.billing import read_billing
    from lightray.report.summary import write_summary_from_files

    billing = read_billing(run["run_dir"])
    write_summary_from_files(config_from_dict(run["config"]), run["run_dir"], run["local_run_dir"],
                             float(run["t0"]), time.time(), run.get("epochs_planned"),
                             use_gpu=bool(run.get("use_gpu")), error=error,
                             billing=billing if billing["attempts"] else None)


def _release_lock(run_dir: str) -> None:
    """Remove the run lock the dead child took in this guardian's name, so the resume command finds none."""
    from lightray import storage
    from lightray.driver.run_lock import LOCK_NAME, read_holder

    try:
        holder = read_holder(run_dir)
        if holder is not None and holder.pid == os.getpid():
            storage.remove(storage.join(run_dir, LOCK_NAME))
    except OSError:
        pass
