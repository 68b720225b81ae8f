"""k8s/ checked offline: KubeRay's CRD schemas, lightray's cheap and secure rules, the RayJob's command and the
Dockerfile. Every rule is also shown to catch a manifest (or Dockerfile) broken on purpose."""

from __future__ import annotations

import json
import pathlib
import re
import time
import zipfile
from typing import Any

import pytest

from tests.wheel import k8s_checks

HERE = pathlib.Path(__file__).resolve().parent


checks = k8s_checks()
DELETE = object()


@pytest.fixture(scope="module")
def cluster() -> dict[str, Any]:
    return checks.load(checks.RAYCLUSTER)


@pytest.fixture(scope="module")
def job() -> dict[str, Any]:
    return checks.load(checks.RAYJOB)


@pytest.fixture(scope="module")
def prices() -> dict[str, float]:
    from lightray.config import CostConfig

    return CostConfig().price_per_hour


def mutate(doc: dict[str, Any], path: tuple, value: Any) -> dict[str, Any]:
    """A deep copy of ``doc`` with ``path`` set to ``value`` (DELETE removes it; a path ending in ``+`` appends)."""
    out = json.loads(json.dumps(doc))
    node: Any = out
    for p in path[:-1]:
        node = node[p]
    last = path[-1]
    if value is DELETE:
        del node[last]
    elif last == "+":
        node.append(value)
    else:
        node[last] = value
    return out


SPOT = ("spec", "workerGroupSpecs", 0)
ONDEMAND = ("spec", "workerGroupSpecs", 1)
HEAD = ("spec", "headGroupSpec")
SPOT_C = SPOT + ("template", "spec", "containers", 0)
HEAD_C = HEAD + ("template", "spec", "containers", 0)


# -- KubeRay's CRD schemas ------------------------------------------------------------------------------
def test_crds_are_kuberays_v1_schemas_found_beside_the_repository():
    for kind, path in checks.CRD_FILES.items():
        assert path.is_file(), f"{path}: missing; CI puts a copy of shared/ beside the clone"
        crd = checks.crd_schema(kind)
        assert (crd["crd_group"], crd["crd_kind"]) == ("ray.io", kind)
        # Unknown fields are errors, as with kubectl's strict field validation.
        assert crd["schema"]["properties"]["spec"]["additionalProperties"] is False


@pytest.mark.parametrize("name", ["raycluster", "rayjob"])
def test_manifests_pass_kuberays_crd_schemas(name):
    doc = checks.load(checks.K8S / f"{name}.yaml")
    assert checks.schema_errors(doc, f"k8s/{name}.yaml") == []


BAD_SCHEMA = {
    # name: (file, path, value, what the error says)
    "string for an integer": ("raycluster", SPOT + ("maxReplicas",), "4",
                              "spec.workerGroupSpecs[0].maxReplicas: '4' is not of type 'integer'"),
    "integer for a string": ("raycluster", HEAD + ("rayStartParams", "num-gpus"), 0,
                             "spec.headGroupSpec.rayStartParams.num-gpus: 0 is not of type 'string'"),
    "required groupName left out": ("raycluster", SPOT + ("groupName",), DELETE, "'groupName' is a required property"),
    "container without a name": ("raycluster", SPOT_C + ("name",), DELETE, "'name' is a required property"),
    "misspelt field": ("raycluster", ("spec", "enableInTreeAutoScaling"), True,
                       "Additional properties are not allowed ('enableInTreeAutoScaling' was unexpected)"),
    "value outside an enum": ("raycluster", ("spec", "authOptions", "mode"), "tokens", "'tokens' is not one of"),
    "malformed quantity": ("raycluster", HEAD_C + ("resources", "limits", "memory"), "24 GB", "does not match"),
    "env var twice": ("raycluster", SPOT_C + ("env", "+"), {"name": "RAY_AUTH_MODE", "value": "disabled"},
                      "duplicate entries for key {'name': 'RAY_AUTH_MODE'}"),
    "field with CEL rules": ("raycluster", ("spec", "managedBy"), "ray.io/kuberay-operator",
                             "x-kubernetes-validations"),
    "old apiVersion": ("raycluster", ("apiVersion",), "ray.io/v1alpha1", "apiVersion 'ray.io/v1alpha1'"),
    "name that is no DNS label": ("raycluster", ("metadata", "name"), "Lightray_1", "DNS-1035"),
    "entrypoint as a list": ("rayjob", ("spec", "entrypoint"), ["lightray"], "is not of type 'string'"),
    "job cluster without a head": ("rayjob", ("spec", "rayClusterSpec", "headGroupSpec"), DELETE,
                                   "'headGroupSpec' is a required property"),
    "unknown top-level key": ("rayjob", ("specs",), {}, "'specs' was unexpected"),
}


@pytest.mark.parametrize("case", sorted(BAD_SCHEMA))
def test_schema_check_rejects_a_broken_manifest(case):
    name, path, value, message = BAD_SCHEMA[case]
    where = f"k8s/{name}.yaml"
    errors = checks.schema_errors(mutate(checks.load(checks.K8S / f"{name}.yaml"), path, value), where)
    assert any(message in e and e.startswith(where) for e in errors), errors


def test_int_or_string_quantities_take_both_forms_and_nothing_else(cluster):
    for value in (6, "6", "6000m"):
        ok = mutate(cluster, HEAD_C + ("resources", "limits", "cpu"), value)
        assert checks.schema_errors(ok, "raycluster") == [], value
    # A JSON number that is no integer is neither form, for the API server's structural schema too.
    for value in (5.5, True):
        bad = mutate(cluster, HEAD_C + ("resources", "limits", "cpu"), value)
        assert any("is not valid under any of the given schemas" in e for e in checks.schema_errors(bad, "rc")), value


# -- lightray's rules for the cluster ---------------------------------------------------------------------
def test_cluster_spec_breaks_no_cheap_or_secure_rule(cluster, job, prices):
    assert checks.cluster_problems(cluster["spec"], "k8s/raycluster.yaml", prices) == []
    assert checks.cluster_problems(job["spec"]["rayClusterSpec"], "k8s/rayjob.yaml", prices) == []


BROKEN = {
    "autoscaler off": (("spec", "enableInTreeAutoscaling"), False, "enableInTreeAutoscaling must be true"),
    "no idle timeout": (("spec", "autoscalerOptions", "idleTimeoutSeconds"), DELETE, "idleTimeoutSeconds None"),
    "head advertises GPUs": (HEAD + ("rayStartParams", "num-gpus"), "8", "num-gpus: '8'; must be \"0\""),
    "head asks for a GPU": (HEAD_C + ("resources", "limits", "nvidia.com/gpu"), "1", "the head trains nothing"),
    "head on spot": (HEAD + ("template", "spec", "nodeSelector"), {"cloud.google.com/gke-spot": "true"},
                     "the head must not run on spot nodes"),
    "GPU pods always on": (SPOT + ("minReplicas",), 1, "minReplicas: 1; GPU groups must scale from 0"),
    "no spot group": (SPOT + ("template", "spec", "nodeSelector", "eks.amazonaws.com/capacityType"), "ON_DEMAND",
                      "no GPU group selects spot nodes"),
    "spot pods without GPUs": (SPOT_C + ("resources",), {"limits": {"cpu": "188", "memory": "720Gi"}},
                               "no GPU group selects spot nodes"),
    "no on-demand fallback": (("spec", "workerGroupSpecs", 1), DELETE, "no on-demand GPU group to fall back on"),
    "fallback on spot taints": (ONDEMAND + ("template", "spec", "tolerations", "+"),
                                {"key": "kubernetes.azure.com/scalesetpriority", "operator": "Equal", "value": "spot",
                                 "effect": "NoSchedule"}, "must not tolerate spot taints"),
    "fallback of another shape": (ONDEMAND + ("template", "spec", "containers", 0, "resources", "limits",
                                              "nvidia.com/gpu"), "4", "GPU groups differ in shape"),
    "on-demand outranks spot": (ONDEMAND + ("priority",), 20, "spot groups need a higher priority"),
    "on-demand wins name ties": (ONDEMAND + ("groupName",), "gpu-zz-ondemand", "must sort after the on-demand"),
    "price key without a price": (SPOT + ("labels", "lightray-price-key"), "g5.xlarge-spot", "no price in"),
    "worker without token auth": (SPOT_C + ("env",), [], "container ray-worker: without RAY_AUTH_MODE=token"),
    "token written in the manifest": (SPOT_C + ("env", 1), {"name": "RAY_AUTH_TOKEN", "value": "0123abcd"},
                                      "RAY_AUTH_TOKEN has a literal value"),
    "token from another Secret": (HEAD_C + ("env", 1, "valueFrom", "secretKeyRef", "name"), "other",
                                  "RAY_AUTH_TOKEN must come from Secret 'lightray-ray-token'"),
    "no authOptions": (("spec", "authOptions"), DELETE, "authOptions: expected mode token"),
    "head behind a LoadBalancer": (HEAD + ("serviceType",), "LoadBalancer", "serviceType: LoadBalancer"),
    "head service on a NodePort": (HEAD + ("headService",), {"spec": {"type": "NodePort"}}, "type: NodePort"),
    "ingress to the dashboard": (HEAD + ("enableIngress",), True, "no Ingress to the head"),
    "pod on the host network": (SPOT + ("template", "spec", "hostNetwork"), True, "hostNetwork: true"),
    "dashboard on a host port": (HEAD_C + ("ports", 1, "hostPort"), 8265, "hostPort: 8265"),
    "privileged worker": (SPOT_C + ("securityContext", "privileged"), True, "no privileged container"),
    "privileged autoscaler": (("spec", "autoscalerOptions", "securityContext", "privileged"), True,
                              "autoscalerOptions.securityContext.privileged: true"),
    "privilege escalation": (HEAD_C + ("securityContext", "allowPrivilegeEscalation"), True,
                             "allowPrivilegeEscalation: true"),
    "added capability": (SPOT_C + ("securityContext", "capabilities", "add"), ["SYS_ADMIN"], "no added capabilities"),
    "no local cache volume": (SPOT_C + ("volumeMounts",), [{"name": "dshm", "mountPath": "/dev/shm"}],
                              "no node-local volume"),
    "no drain on stop": (SPOT_C + ("lifecycle",), DELETE, "no preStop hook that drains the Ray node"),
    "hook outlives the grace period": (SPOT + ("template", "spec", "terminationGracePeriodSeconds"), 60,
                                       "preStop hold_s 100 must be below terminationGracePeriodSeconds 60"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_rules_catch_a_broken_cluster_spec(cluster, prices, case):
    path, value, message = BROKEN[case]
    found = checks.cluster_problems(mutate(cluster, path, value)["spec"], "k8s/raycluster.yaml", prices)
    assert any(message in p and p.startswith("k8s/raycluster.yaml: ") for p in found), found


def test_rays_kuberay_autoscaler_reads_the_groups_as_intended(cluster, job):
    """Ray's own translation of the spec: the numbers the autoscaler will scale by."""
    view = checks.autoscaler_view(cluster["spec"])
    assert view == checks.autoscaler_view(job["spec"]["rayClusterSpec"])
    types = view["available_node_types"]
    assert types["headgroup"]["resources"]["GPU"] == 0 and types["headgroup"]["resources"]["CPU"] == 4
    spot, ondemand = types["gpu-spot"], types["gpu-ondemand"]
    assert spot["resources"]["GPU"] == 8 and spot["resources"]["CPU"] == 188
    assert spot["resources"] == ondemand["resources"]
    assert (spot["min_workers"], spot["max_workers"], ondemand["min_workers"]) == (0, 4, 0)
    assert spot["priority"] > ondemand["priority"]
    assert spot["labels"] == {"lightray-price-key": "g5.48xlarge-spot"}
    assert view["idle_timeout_minutes"] == 5


# -- one Ray version everywhere --------------------------------------------------------------------------
def test_ray_version_agrees_across_pyproject_the_manifests_and_the_dockerfile(cluster, job):
    series = checks.pinned_ray()
    version = checks.project()["project"]["version"]
    for doc, where in ((cluster["spec"], "raycluster"), (job["spec"]["rayClusterSpec"], "rayjob")):
        assert checks.image_problems(doc, where, series, version) == []
    st = checks.stages(checks.parse_dockerfile(checks.DOCKERFILE.read_text()))
    assert st[-1]["args"]["RAY_VERSION"] == cluster["spec"]["rayVersion"]
    assert st[-1]["image"].startswith(f"rayproject/ray:{cluster['spec']['rayVersion']}-")


@pytest.mark.parametrize("path,value,message", [
    (("spec", "rayVersion"), "2.59.0", "rayVersion '2.59.0'; pyproject.toml pins ray 2.60.*"),
    (HEAD_C + ("image",), "example.com/lightray:0.1.0-ray2.59.0", "expected one"),
    (("spec", "autoscalerOptions", "image"), "rayproject/ray:2.60.0", "expected <registry>/lightray:0.1.0-ray2.60.0"),
])
def test_version_check_catches_a_mismatch(cluster, path, value, message):
    found = checks.image_problems(mutate(cluster, path, value)["spec"], "raycluster", "2.60", "0.1.0")
    assert any(message in p for p in found), found


def test_version_check_follows_the_pin_in_pyproject(cluster):
    # A new pin in pyproject.toml with the manifests and the Dockerfile left behind fails both checks.
    assert any("pins ray 2.61.*" in p for p in checks.image_problems(cluster["spec"], "raycluster", "2.61", "0.1.0"))
    found = checks.dockerfile_problems(checks.DOCKERFILE.read_text(), checks.DOCKERIGNORE.read_text(), "2.61", ">=3.10")
    assert any("pyproject.toml pins 2.61.*" in p for p in found), found


# -- the RayJob --------------------------------------------------------------------------------------------
def test_rayjob_runs_lightray_resumably_within_its_gpu_groups(job, cluster):
    assert checks.job_problems(job, cluster, "k8s/rayjob.yaml") == []
    args, cfg = checks.entrypoint_config(job["spec"]["entrypoint"])
    assert args.config == "imagenet-rn50-dawnbench" and args.resume and cfg.name == args.name
    lo, hi = cfg.worker_range()
    spot = cluster["spec"]["workerGroupSpecs"][0]
    assert 1 <= lo <= hi <= spot["maxReplicas"] * 8


def _entry(job: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    assert old in job["spec"]["entrypoint"]
    return mutate(job, ("spec", "entrypoint"), job["spec"]["entrypoint"].replace(old, new))


BROKEN_JOB = {
    "another subcommand": (lambda j: _entry(j, "lightray train --config", "lightray tune --config"),
                           "runs `lightray tune`; expected `lightray train`"),
    "the checkout's run.py": (lambda j: _entry(j, "lightray train --config", "python app/run.py --config"),
                              "expected the installed console script ['lightray']"),
    "a flag lightray lacks": (lambda j: _entry(j, "--resume", "--resume --epochs 3"), "--epochs: unknown argument"),
    "no --resume": (lambda j: _entry(j, " --resume", ""), "needs --resume and a fixed --name"),
    "runs on the pod's disk": (lambda j: _entry(j, "--storage s3://REPLACE_ME-bucket/lightray", "--storage /tmp/runs"),
                               "runs must go to object storage"),
    "more workers than spot GPUs": (lambda j: _entry(j, "--workers 16:32", "--workers 16:64"),
                                    "--workers 16:64 does not fit gpu-spot: 4 pods x 8 workers = 32"),
    "too many CPUs per worker": (lambda j: _entry(j, "--workers 16:32", "--workers 16:32 --scaling.cpus_per_worker=48"),
                                 "4 pods x 3 workers = 12"),
    "cache dir not on a volume": (lambda j: _entry(j, "=/mnt/lightray-cache", "=/scratch"), "is not a volume"),
    "wrong price key": (lambda j: _entry(j, "=g5.48xlarge-spot", "=p3.16xlarge-spot"), "price key is"),
    "no RayJob retries": (lambda j: mutate(j, ("spec", "backoffLimit"), 0), "backoffLimit 0"),
    "cluster outlives the job": (lambda j: mutate(j, ("spec", "shutdownAfterJobFinishes"), False),
                                 "shutdownAfterJobFinishes must be true"),
    "spec drifted from raycluster.yaml": (lambda j: mutate(j, ("spec", "rayClusterSpec", "workerGroupSpecs", 0,
                                                               "maxReplicas"), 8),
                                          "rayClusterSpec differs from k8s/raycluster.yaml's spec at "
                                          "rayClusterSpec.workerGroupSpecs[0].maxReplicas"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_JOB))
def test_rules_catch_a_broken_rayjob(job, cluster, case):
    change, message = BROKEN_JOB[case]
    found = checks.job_problems(change(job), cluster, "k8s/rayjob.yaml")
    assert any(message in p and p.startswith("k8s/rayjob.yaml: ") for p in found), found


# -- the Dockerfile ----------------------------------------------------------------------------------------
def _dockerfile() -> str:
    return checks.DOCKERFILE.read_text()


def test_dockerfile_parses_into_two_stages_on_rays_gpu_image():
    instructions = checks.parse_dockerfile(_dockerfile())
    st = checks.stages(instructions)
    assert [s["alias"] for s in st] == ["wheel", None]
    assert st[-1]["image"] == "rayproject/ray:2.60.0-py311-gpu" == st[0]["image"]
    # A RUN continued over several lines is one instruction, its --mount flag read apart from the command.
    run = [i for i in st[-1]["instructions"] if i["cmd"] == "RUN"]
    assert len(run) == 1 and run[0]["flags"][0].startswith("--mount=type=bind,from=wheel")
    assert "pip install" in run[0]["args"] and "python -c" in run[0]["args"]
    assert checks.copy_sources(st) == ["pyproject.toml", "README.md", "app", "tune_spaces"]


def test_dockerfile_parser_reads_continuations_comments_and_the_exec_form():
    text = ("# syntax=docker/dockerfile:1\n# check=skip=all\nARG V=2.60.0\n\n"
            "FROM --platform=linux/amd64 rayproject/ray:${V}-py311-gpu AS base\n"
            "RUN echo a \\\n    # a comment inside the continuation\n\n    && echo b\n"
            'CMD ["python", "-c", "print(1)"]\n')
    ins = checks.parse_dockerfile(text)
    assert [(i["line"], i["cmd"]) for i in ins] == [(3, "ARG"), (5, "FROM"), (6, "RUN"), (10, "CMD")]
    assert ins[1]["flags"] == ["--platform=linux/amd64"] and " ".join(ins[2]["args"].split()) == "echo a && echo b"
    assert ins[3]["args"] == ["python", "-c", "print(1)"]
    st = checks.stages(ins)
    assert (st[0]["image"], st[0]["alias"]) == ("rayproject/ray:2.60.0-py311-gpu", "base")
    for bad, message in (('CMD ["python", "-c"\n', "malformed JSON array"), ("RUN cat <<EOF\n", "heredocs"),
                         ("FROM\n", "FROM without arguments")):
        with pytest.raises(checks.DockerfileError, match=message):
            checks.parse_dockerfile(text + bad)
    with pytest.raises(checks.DockerfileError, match="RUN before the first FROM"):
        checks.stages(checks.parse_dockerfile("RUN true\nFROM scratch\n"))


def test_dockerfile_breaks_no_rule():
    requires = checks.project()["project"]["requires-python"]
    assert checks.dockerfile_problems(_dockerfile(), checks.DOCKERIGNORE.read_text(), checks.pinned_ray(),
                                      requires) == []


BROKEN_DOCKERFILE = {
    "misspelt instruction": (("USER 1000:100", "USR 1000:100"), "k8s/Dockerfile:31: unknown instruction 'USR'"),
    "open continuation at the end": (("USER 1000:100", "USER 1000:100\nRUN echo \\"), "inside a line continuation"),
    "another escape character": (("# syntax=docker/dockerfile:1", "# escape=`"), "parser directive 'escape'"),
    "another Ray": (("ARG RAY_VERSION=2.60.0", "ARG RAY_VERSION=2.59.0"), "Ray 2.59.0, but pyproject.toml pins 2.60.*"),
    "CPU image": (("${PYTHON}-gpu\nARG", "${PYTHON}-cpu\nARG"), "expected rayproject/ray:X.Y.Z-py3NN-gpu"),
    "Python below lightray's floor": (("ARG PYTHON=py311", "ARG PYTHON=py39"), "Python 3.9, but lightray requires"),
    "the checkout installed": (("/tmp/wheels/lightray-*.whl", "-e /home/ray/src"), "installs the checkout"),
    "pip free to swap Ray": (("-c /tmp/ray-constraint.txt ", ""), "does not hold pip to the image's Ray"),
    # Without ARG in the stage, ${RAY_VERSION} is empty in its RUN lines: the constraint says `ray==`.
    "version not declared in the stage": (("-gpu\nARG RAY_VERSION\n", "-gpu\n"),
                                          "does not hold pip to the image's Ray"),
    "sources in the final image": (("USER 1000:100", "COPY app /home/ray/app\nUSER 1000:100"),
                                   "from the build context into the final image"),
    "root user": (("USER 1000:100", "USER 0"), "expected a numeric non-root uid"),
    "user inherited": (("USER 1000:100", ""), "'(inherited)'"),
    "token in the environment": (("USER 1000:100", "ENV RAY_AUTH_TOKEN=0123abcd\nUSER 1000:100"),
                                 "no secrets in the image"),
    "token file copied": (("USER 1000:100", "COPY .ray/auth_token /home/ray/.ray/auth_token\nUSER 1000:100"),
                          "no credentials in the image"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_DOCKERFILE))
def test_dockerfile_rules_catch_a_broken_dockerfile(case):
    (old, new), message = BROKEN_DOCKERFILE[case]
    text = _dockerfile()
    assert old in text
    found = checks.dockerfile_problems(text.replace(old, new, 1), checks.DOCKERIGNORE.read_text(), "2.60", ">=3.10")
    assert any(message in p for p in found), found


def test_dockerignore_must_let_every_copied_source_through():
    ignore = checks.DOCKERIGNORE.read_text().replace("!tune_spaces\n", "")
    found = checks.dockerfile_problems(_dockerfile(), ignore, "2.60", ">=3.10")
    assert any("tune_spaces (copied by the Dockerfile) is excluded" in p for p in found), found
    found = checks.dockerfile_problems(_dockerfile(), "!app\n", "2.60", ">=3.10")
    assert any("expected an allowlist" in p for p in found), found


def test_wheel_stage_builds_lightray_from_the_copied_sources_alone(lightray_wheel):
    """What the Dockerfile's first stage runs, offline: `pip wheel` over exactly the files it copies (built once
    per run by tests/wheel.py, which tests/test_install.py installs)."""
    wheel = lightray_wheel
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(zf.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    assert {"lightray/recipes/imagenet-rn50-dawnbench.yaml", "lightray/driver/spot_watcher.py", "lightray/cli.py",
            "lightray/spaces/large_batch.yaml"} <= names
    assert not any(n.startswith(("app/", "bench/")) for n in names)
    assert re.search(r"^lightray = lightray\.cli:console$", entry_points, re.M), entry_points


# -- the cluster docs -----------------------------------------------------------------------------------------
def test_cluster_docs_walk_from_an_empty_cluster_to_a_finished_run(job, cluster):
    text = (checks.REPO / "docs" / "CLUSTER.md").read_text()
    section = text.split("## Run on Kubernetes", 1)[1].split("\n## ", 1)[0]
    assert len(section.strip().splitlines()) <= 30, "docs/CLUSTER.md, Run on Kubernetes: keep it short"
    secret = cluster["spec"]["authOptions"]["secretName"]
    name = job["metadata"]["name"]
    image = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"].split("/", 1)[1]
    for step in ("helm install kuberay-operator",
                 f"kubectl create secret generic {secret} --from-literal={checks.TOKEN_SECRET_KEY}=",
                 "kubectl create serviceaccount lightray",
                 f"docker build -f k8s/Dockerfile -t $REGISTRY/{image} .",
                 "kubectl apply -f k8s/rayjob.yaml",
                 f"kubectl logs -f job/{name}",
                 "kubectl delete -f k8s/rayjob.yaml",
                 "preStop"):
        assert step in section, f"docs/CLUSTER.md, Run on Kubernetes: missing {step!r}"


# -- the preStop hook against a real Ray node (slow: a two-node Ray cluster) ----------------------------------
@pytest.fixture(scope="module")
def ray_cluster():
    """Our own head + one worker node with a (fake) GPU: the worker stands for a GPU pod."""
    from tests.faults import private_cluster

    with private_cluster() as c:
        worker = c.add_node(num_cpus=2, num_gpus=1)
        c.wait_for_nodes()
        yield worker.node_id


# Its worker node once missed Ray's 30 s start limit beside the heavy tests (a red CI, 2026-12-06); tests/conftest.py
# now gives every node start in the tests RAY_START_WAIT_S.
@pytest.mark.own_cluster
@pytest.mark.shares_cpu
@pytest.mark.slow
def test_prestop_hook_drains_its_node_for_preemption_and_waits_for_its_gpus(ray_cluster, cluster):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray_cluster
    pod = cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    command = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["python", "-c"]
    script = command[2]
    here = NodeAffinitySchedulingStrategy(node, soft=False)

    @ray.remote(num_gpus=1, scheduling_strategy=here)
    class TrainWorker:
        def ready(self) -> bool:
            return True

    @ray.remote(num_cpus=0, scheduling_strategy=here)
    def pre_stop(code: str) -> float:
        start = time.monotonic()
        exec(compile(code, "preStop", "exec"), {"__name__": "__main__"})
        return time.monotonic() - start

    gpu_worker = TrainWorker.remote()
    assert ray.get(gpu_worker.ready.remote(), timeout=60)
    before = time.time()
    hook = pre_stop.remote(script)
    # The node is drained with reason PREEMPTION and a deadline hold_s ahead; the hook holds while a GPU is taken.
    # The hook's task may wait many seconds for a worker process on a busy machine (it did in CI), so poll until
    # the drain shows or the hook ends, and bound the deadline by when the drain could have been asked for:
    # after `before`, and no later than the moment it was seen.
    deadline_ms, give_up = None, time.monotonic() + 90
    while not deadline_ms and time.monotonic() < give_up:
        deadline_ms = ray._private.state.state.get_draining_nodes().get(node)
        if not deadline_ms and ray.wait([hook], timeout=0.2)[0]:
            ray.get(hook)  # raises the hook's own error, if that is why it ended
            pytest.fail("the hook returned without draining its node")
    seen = time.time()
    assert deadline_ms, "the hook did not drain its node within 90 s"
    assert before + 95 <= deadline_ms / 1000 <= seen + 105
    ready, _ = ray.wait([hook], timeout=3)
    assert not ready, "the hook returned while a training worker still held the node's GPU"
    ray.kill(gpu_worker)  # the worker has checkpointed and left
    assert ray.get(hook, timeout=30) < 30


def test_first_submission_with_resume_starts_the_run(tmp_path):
    """The RayJob always passes --resume: on a name with nothing in storage yet, that starts a fresh run."""
    from lightray.config import load_config
    from lightray.driver.runner import _open_run_dir, resolve_run

    cfg = load_config("smoke", {"storage": str(tmp_path), "name": "rn50-k8s-1"})
    resolve_run(cfg, resume=True)
    assert cfg.name == "rn50-k8s-1"
    run_dir, _ = _open_run_dir(cfg, resume=True)
    assert pathlib.Path(run_dir) == tmp_path / "rn50-k8s-1"
