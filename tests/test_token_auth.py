"""No one let in: a local Ray cluster started with token auth on, as cluster.yaml starts every node
(``RAY_AUTH_MODE=token ray start --head ...``), refuses a client without the token: it can neither submit a job
(the Jobs API of the dashboard) nor attach a driver (``ray.init`` to the GCS). A client with the token can
do both, so the refusals are the token's doing, not a broken cluster.

The cluster is a real ``ray start --head --block`` with its own temp dir and ports. Its token comes from
``RAY_AUTH_TOKEN`` (Ray's first token source), so this machine's ``~/.ray/auth_token`` is neither used nor
changed; clients run in their own processes, with ``HOME`` pointed at an empty folder so that no default
token file is found either."""

from __future__ import annotations

import os
import pathlib
import secrets
import shutil
import subprocess
import sys
import tempfile
import textwrap
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import requests

from bench.common import stop_processes
from lightray.driver.cluster_loss import gcs_reachable
from tests.faults import wait_for
from tests.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.shares_cpu]


@pytest.fixture(scope="module")
def token_cluster(tmp_path_factory):
    """(GCS address, dashboard URL, token) of a head started with RAY_AUTH_MODE=token."""
    tmp = tmp_path_factory.mktemp("token-cluster")
    token = secrets.token_hex(32)
    port, dash = free_port(), free_port()
    temp_dir = pathlib.Path(f"/tmp/lr-auth-{port}")  # short: Ray's socket paths have a length cap
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    env.pop("RAY_ADDRESS", None)
    log = open(tmp / "head.log", "w")
    head = subprocess.Popen(
        ["ray", "start", "--head", f"--port={port}", "--num-cpus=1", f"--temp-dir={temp_dir}",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
         f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
         "--disable-usage-stats", "--block"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{dash}"
    try:
        wait_for(lambda: gcs_reachable(f"127.0.0.1:{port}"), 180, "the head's GCS")

        def jobs_api_up() -> bool:
            try:
                return requests.get(f"{url}/api/version", timeout=5).status_code in (200, 401, 403)
            except requests.RequestException:
                return False

        wait_for(jobs_api_up, 240, "the dashboard's HTTP server", interval=2)
        yield f"127.0.0.1:{port}", url, token
    finally:
        root = psutil.Process(head.pid)
        procs = root.children(recursive=True) + [root]
        stop_processes(procs)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _client(code: str, home: pathlib.Path, *, mode: str | None, token: str | None, timeout: float = 150,
            env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python process as a client on this machine: the auth mode and token given,
    no token file in reach, no cluster address from the environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    env.update(env_extra or {})
    env["HOME"] = str(home)
    if mode is not None:
        env["RAY_AUTH_MODE"] = mode
    if token is not None:
        env["RAY_AUTH_TOKEN"] = token
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:  # still waiting to be let in when time ran out: not in either
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return subprocess.CompletedProcess(exc.cmd, -9, out + "\nTIMED OUT", "")


SUBMIT = """
    import sys
    from ray.job_submission import JobSubmissionClient
    try:
        client = JobSubmissionClient(sys.argv[1] if len(sys.argv) > 1 else {url!r})
        job = client.submit_job(entrypoint="python -c 'print(42)'")
    except Exception as exc:
        print("REFUSED", type(exc).__name__, str(exc)[:300])
        sys.exit(3)
    print("SUBMITTED", job)
"""

ATTACH = """
    import sys
    import ray
    try:
        ray.init(address={address!r}, log_to_driver=False)
        print("ATTACHED", ray.get(ray.put(7)))
    except Exception as exc:
        print("REFUSED", type(exc).__name__, str(exc)[:300])
        sys.exit(3)
"""


@pytest.mark.parametrize("mode,token", [(None, None), ("token", None), ("token", "wrong-token")],
                         ids=["no-auth-client", "token-mode-without-token", "wrong-token"])
def test_a_client_without_the_token_cannot_submit_a_job(token_cluster, tmp_path, mode, token):
    _, url, _ = token_cluster
    # The plain HTTP call a client without Ray's help would make.
    raw = requests.post(f"{url}/api/jobs/", json={"entrypoint": "python -c 'print(42)'"}, timeout=30,
                        headers={"Authorization": f"Bearer {token}"} if token else {})
    assert raw.status_code in (401, 403), (raw.status_code, raw.text[:300])
    out = _client(SUBMIT.format(url=url), tmp_path, mode=mode, token=token)
    assert out.returncode == 3 and "REFUSED" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "SUBMITTED" not in out.stdout


REFUSED_ATTACH = {"no-auth-client": (None, None), "auth-disabled-client": ("disabled", None),
                  "wrong-token": ("token", "wrong-token")}


def test_a_client_without_the_token_cannot_attach_a_driver(token_cluster, tmp_path):
    """Each client kind at once, in processes of their own: a refused ``ray.init`` waits out its connection
    retries (about 20 s here), which need no CPU, so three in parallel take the time of one."""
    address, _, _ = token_cluster
    for kind in REFUSED_ATTACH:
        (tmp_path / kind).mkdir()  # a home of its own, empty: no token file in reach
    with ThreadPoolExecutor(len(REFUSED_ATTACH)) as pool:
        outs = dict(zip(REFUSED_ATTACH, pool.map(
            lambda kind: _client(ATTACH.format(address=address), tmp_path / kind, mode=REFUSED_ATTACH[kind][0],
                                 token=REFUSED_ATTACH[kind][1]), REFUSED_ATTACH)))
    for kind, out in outs.items():
        assert out.returncode != 0 and "ATTACHED" not in out.stdout, (kind, out.stdout + out.stderr[-2000:])


def test_a_client_with_the_token_submits_and_attaches(token_cluster, tmp_path):
    address, url, token = token_cluster
    out = _client(SUBMIT.format(url=url), tmp_path, mode="token", token=token)
    assert out.returncode == 0 and "SUBMITTED" in out.stdout, out.stdout + out.stderr[-2000:]
    out = _client(ATTACH.format(address=address), tmp_path, mode="token", token=token)
    assert out.returncode == 0 and "ATTACHED 7" in out.stdout, out.stdout + out.stderr[-2000:]


def test_a_driver_refused_by_the_cluster_ray_start_recorded_stops_with_one_line_not_a_private_cluster(
        token_cluster, tmp_path):
    """``scaling.ray_address=auto`` on a host whose `ray start` cluster wants a token this driver lacks: one error
    naming the address and what to do, not a run trained on a cluster of this machine alone (the old fallback)."""
    address, _, _ = token_cluster
    ray_tmp = pathlib.Path(tempfile.mkdtemp(prefix="lr-"))  # short: Ray's socket paths have a length cap
    try:
        (ray_tmp / "ray").mkdir()
        (ray_tmp / "ray" / "ray_current_cluster").write_text(address)  # as `ray start` records it
        out = _client(CONNECT, tmp_path, mode=None, token=None, env_extra={"RAY_TMPDIR": str(ray_tmp)})
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert out.returncode == 2, out.stdout + out.stderr[-3000:]
    (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("ERROR")]
    assert f"recorded at {address}" in line and "refused this driver" in line, line
    assert "--scaling.ray_address=local" in line and "RAY_AUTH_MODE=token" in line, line


CONNECT = """
    import sys
    from lightray.config import ConfigError, load_config
    from lightray.driver.runner import connect_ray
    try:
        started = connect_ray(load_config("smoke", {"scaling.ray_num_cpus": "1"}))
    except ConfigError as exc:
        print("ERROR", exc)
        sys.exit(2)
    print("STARTED A PRIVATE CLUSTER" if started else "JOINED")
"""
