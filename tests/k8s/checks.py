"""Offline checks of k8s/: KubeRay's own CRD schemas, lightray's cheap-and-secure rules, and the Dockerfile.

No Kubernetes API server and no Docker engine are reachable from here. What the API server would reject is
caught with KubeRay's CRD schemas (v1.7.0, /work/shared/k8s/crds, beside the repository), read the way the
API server reads them; what would make a cluster expensive, open, or unable to train is caught by the rules
below. Each ``*_problems`` function returns one line per broken rule, naming the file and the key, so that a
test can show every problem at once and can check that a deliberately broken manifest is caught.
"""

from __future__ import annotations

import copy
import functools
import json
import pathlib
import re
import shlex
from typing import Any

import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the test extra installs tomli there
    import tomli as tomllib

REPO = pathlib.Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
RAYCLUSTER = K8S / "raycluster.yaml"
RAYJOB = K8S / "rayjob.yaml"
DOCKERFILE = K8S / "Dockerfile"
DOCKERIGNORE = K8S / "Dockerfile.dockerignore"
# CI runs in a fresh clone with a copy of shared/ beside it.
CRDS = REPO.parent / "shared" / "k8s" / "crds"
CRD_FILES = {"RayCluster": CRDS / "ray.io_rayclusters.yaml", "RayJob": CRDS / "ray.io_rayjobs.yaml"}

TOKEN_SECRET_KEY = "auth_token"  # the Secret key KubeRay's authOptions reads
LOCAL_CACHE = "/mnt/lightray-cache"  # the mount point cluster.yaml uses too
# (label, value) that put a pod on spot capacity, per cloud; a spot taint uses the same pair.
SPOT_SELECTORS = {("eks.amazonaws.com/capacityType", "SPOT"), ("karpenter.sh/capacity-type", "spot"),
                  ("cloud.google.com/gke-spot", "true"), ("kubernetes.azure.com/scalesetpriority", "spot")}
GPU_RESOURCE = "nvidia.com/gpu"
OPEN_SERVICE_TYPES = ("LoadBalancer", "NodePort")
MAX_NAME = {"RayCluster": 53, "RayJob": 47}  # KubeRay: service-name suffixes (RayJob: + 6 for its cluster)


# -- loading -------------------------------------------------------------------------------------------
def load(path: pathlib.Path) -> dict[str, Any]:
    """One manifest, with YAML anchors expanded into independent copies (a mutation of one alias in a test
    must not change the others)."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    if len(docs) != 1 or not isinstance(docs[0], dict):
        raise ValueError(f"{path.name}: expected one Kubernetes object, found {len(docs)}")
    return json.loads(json.dumps(docs[0]))


def pinned_ray() -> str:
    """The Ray series pyproject.toml pins, e.g. ``2.60`` for ``ray[...]==2.60.*``."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in deps:
        m = re.fullmatch(r"ray(\[[^\]]*\])?==(\d+\.\d+)\.\*", dep.replace(" ", ""))
        if m:
            return m.group(2)
    raise ValueError(f"pyproject.toml: no `ray[...]==X.Y.*` pin in [project] dependencies: {deps}")


def project() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


# -- the CRD schemas, read as the API server reads them -------------------------------------------------
@functools.cache
def crd_schema(kind: str) -> dict[str, Any]:
    """The ``v1`` openAPIV3Schema of KubeRay's CRD for ``kind``, made strict for jsonschema:

    - an object schema with ``properties`` gets ``additionalProperties: false`` (the API server drops or, with
      kubectl's default strict field validation, rejects unknown fields; jsonschema would allow them);
    - ``nullable: true`` admits null.
    ``x-kubernetes-*`` keys are checked by the validator below; ``int-or-string`` fields already carry an
    ``anyOf`` of integer and string (and a quantity's ``pattern`` applies to its string form only).
    """
    # 40,000 lines of YAML: libyaml's loader where PyYAML has it (the pure-Python one takes seconds).
    crd = yaml.load(CRD_FILES[kind].read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])

    def strict(node: Any) -> None:
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node \
                    and not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
            if node.get("nullable") is True and isinstance(node.get("type"), str):
                node["type"] = [node["type"], "null"]
            for value in node.values():
                strict(value)
        elif isinstance(node, list):
            for value in node:
                strict(value)

    strict(schema)
    return {"crd_group": crd["spec"]["group"], "crd_kind": crd["spec"]["names"]["kind"], "schema": schema}


@functools.cache
def _validator(kind: str):
    return _validator_class()(crd_schema(kind)["schema"])


def _validator_class():
    import jsonschema

    def list_type(validator, value, instance, schema):
        if not isinstance(instance, list):
            return
        if value == "set":
            seen = [json.dumps(i, sort_keys=True) for i in instance]
            if len(set(seen)) != len(seen):
                yield jsonschema.ValidationError("duplicate entries in a list of type set")
        if value == "map":
            keys = schema.get("x-kubernetes-list-map-keys") or []
            props = (schema.get("items") or {}).get("properties") or {}
            tuples = [tuple(item.get(k, props.get(k, {}).get("default")) for k in keys)
                      for item in instance if isinstance(item, dict)]
            for dup in sorted({t for t in tuples if tuples.count(t) > 1}, key=str):
                yield jsonschema.ValidationError(f"duplicate entries for key {dict(zip(keys, dup))} in a list "
                                                 f"keyed by {keys}")

    def cel_rules(validator, value, instance, schema):
        # CEL rules are not evaluated here: a manifest that uses such a field fails rather than passes unchecked.
        rules = "; ".join(r.get("rule", "?") for r in value)
        yield jsonschema.ValidationError(f"carries x-kubernetes-validations (CEL: {rules}), which this offline "
                                         "check cannot evaluate; check it against a real API server")

    return jsonschema.validators.extend(jsonschema.Draft4Validator, {
        "x-kubernetes-list-type": list_type, "x-kubernetes-validations": cel_rules})


def _path(parts) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


def schema_errors(doc: dict[str, Any], where: str) -> list[str]:
    """What the API server would reject: apiVersion/kind, the name, and the CRD schema of the kind."""
    kind = doc.get("kind")
    if kind not in CRD_FILES:
        return [f"{where}: kind {kind!r}; expected one of {sorted(CRD_FILES)}"]
    crd = crd_schema(kind)
    out = []
    if doc.get("apiVersion") != f"{crd['crd_group']}/v1":
        out.append(f"{where}: apiVersion {doc.get('apiVersion')!r}; expected {crd['crd_group']}/v1")
    name = (doc.get("metadata") or {}).get("name", "")
    if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", str(name)) or len(str(name)) > MAX_NAME[kind]:
        out.append(f"{where}: metadata.name {name!r}; expected a DNS-1035 label of at most {MAX_NAME[kind]} "
                   "characters (KubeRay appends service suffixes)")
    for err in sorted(_validator(kind).iter_errors(doc), key=lambda e: (list(map(str, e.absolute_path)), e.message)):
        out.append(f"{where}: {_path(err.absolute_path)}: {err.message}")
    return out


# -- the cluster spec: cheap, secure, and able to train -------------------------------------------------
def _pod_templates(spec: dict[str, Any]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(key path, group spec, pod spec) of the head and of every worker group."""
    head = spec.get("headGroupSpec") or {}
    out = [("headGroupSpec", head, (head.get("template") or {}).get("spec") or {})]
    for i, group in enumerate(spec.get("workerGroupSpecs") or []):
        out.append((f"workerGroupSpecs[{i}]({group.get('groupName')})", group,
                    (group.get("template") or {}).get("spec") or {}))
    return out


def _ray_container(pod: dict[str, Any]) -> dict[str, Any]:
    return (pod.get("containers") or [{}])[0]  # KubeRay: the Ray container is the first one


def _gpus(group: dict[str, Any]) -> int:
    res = (_ray_container((group.get("template") or {}).get("spec") or {}).get("resources") or {})
    return int(str((res.get("limits") or {}).get(GPU_RESOURCE, 0)))


def gpu_groups(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {g.get("groupName"): g for g in spec.get("workerGroupSpecs") or [] if _gpus(g) > 0}


def _selects_spot(pod: dict[str, Any]) -> bool:
    return any((k, str(v)) in SPOT_SELECTORS for k, v in (pod.get("nodeSelector") or {}).items())


def _tolerates_spot(pod: dict[str, Any]) -> bool:
    return any((t.get("key"), str(t.get("value"))) in SPOT_SELECTORS or
               (t.get("operator") == "Exists" and (t.get("key") in {k for k, _ in SPOT_SELECTORS} or not t.get("key")))
               for t in pod.get("tolerations") or [])


def is_spot(group: dict[str, Any]) -> bool:
    return _selects_spot((group.get("template") or {}).get("spec") or {})


def _walk(node: Any, path: str = ""):
    """Every (path, key, value) of a nested document."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield path, k, v
            yield from _walk(v, f"{path}.{k}" if path else k)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}[{i}]")


def autoscaler_view(spec: dict[str, Any], name: str = "lightray") -> dict[str, Any]:
    """The autoscaling config Ray's own KubeRay autoscaler derives from this cluster spec (it validates it
    against Ray's cluster-config schema on the way): node types, their Ray resources, limits and labels."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    cr = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": name, "namespace": "default"},
          "spec": copy.deepcopy(spec)}
    return _derive_autoscaling_config_from_ray_cr(cr)


def cluster_problems(spec: dict[str, Any], where: str, prices: dict[str, float] | None = None) -> list[str]:
    """lightray's rules for a RayCluster spec (a RayCluster's ``spec`` or a RayJob's ``rayClusterSpec``)."""
    out: list[str] = []
    head = spec.get("headGroupSpec") or {}
    head_pod = (head.get("template") or {}).get("spec") or {}
    gpus = gpu_groups(spec)
    spot = {n: g for n, g in gpus.items() if is_spot(g)}
    ondemand = {n: g for n, g in gpus.items() if not is_spot(g)}

    # Cheap: GPUs only on pods that scale from zero, mostly spot, with an on-demand fallback of the same shape.
    if spec.get("enableInTreeAutoscaling") is not True:
        out.append(f"{where}: enableInTreeAutoscaling must be true (GPU pods come and go with the demand)")
    idle = (spec.get("autoscalerOptions") or {}).get("idleTimeoutSeconds")
    if not isinstance(idle, int) or not 0 < idle <= 1800:
        out.append(f"{where}: autoscalerOptions.idleTimeoutSeconds {idle!r}; expected an idle timeout in (0, 1800]")
    if not spot:
        out.append(f"{where}: workerGroupSpecs: no GPU group selects spot nodes (nodeSelector one of "
                   f"{sorted(SPOT_SELECTORS)})")
    if not ondemand:
        out.append(f"{where}: workerGroupSpecs: no on-demand GPU group to fall back on")
    for name, group in gpus.items():
        for key in ("minReplicas", "replicas"):
            if group.get(key, 0) != 0:
                out.append(f"{where}: workerGroupSpecs({name}).{key}: {group.get(key)!r}; GPU groups must scale from 0")
    for name, group in spot.items():
        if group.get("maxReplicas", 0) < 1:
            out.append(f"{where}: workerGroupSpecs({name}).maxReplicas: must be at least 1")
    for name, group in ondemand.items():
        if _tolerates_spot((group.get("template") or {}).get("spec") or {}):
            out.append(f"{where}: workerGroupSpecs({name}): an on-demand group must not tolerate spot taints")
    if len({json.dumps(_ray_container(g["template"]["spec"]).get("resources"), sort_keys=True)
            for g in gpus.values()}) > 1:
        out.append(f"{where}: workerGroupSpecs: GPU groups differ in shape (resources); a fallback pod must hold "
                   "the same workers")
    # The Ray autoscaler prefers the higher priority and, between equals, the greater group name: spot wins both.
    if spot and ondemand:
        if min(spot) <= max(ondemand):
            out.append(f"{where}: workerGroupSpecs: spot group names {sorted(spot)} must sort after the on-demand "
                       f"ones {sorted(ondemand)}")
        if min(g.get("priority", 0) for g in spot.values()) <= max(g.get("priority", 0) for g in ondemand.values()):
            out.append(f"{where}: workerGroupSpecs: spot groups need a higher priority than on-demand ones")
    for name, group in gpus.items():
        key = (group.get("labels") or {}).get("lightray-price-key")
        expected_suffix = is_spot(group)
        if prices is not None and key not in prices:
            out.append(f"{where}: workerGroupSpecs({name}).labels.lightray-price-key {key!r}: no price in "
                       "app/config.py CostConfig.price_per_hour")
        elif key is not None and str(key).endswith("-spot") != expected_suffix:
            out.append(f"{where}: workerGroupSpecs({name}).labels.lightray-price-key {key!r}: a spot group's key "
                       "ends with -spot, an on-demand group's does not")

    # The head trains nothing and stays off spot.
    params = head.get("rayStartParams") or {}
    if params.get("num-gpus") != "0":
        out.append(f"{where}: headGroupSpec.rayStartParams.num-gpus: {params.get('num-gpus')!r}; must be \"0\"")
    if "num-cpus" not in params:
        out.append(f"{where}: headGroupSpec.rayStartParams.num-cpus: missing")
    if _gpus(head) or GPU_RESOURCE in ((_ray_container(head_pod).get("resources") or {}).get("requests") or {}):
        out.append(f"{where}: headGroupSpec: the head container asks for {GPU_RESOURCE}; the head trains nothing")
    if _selects_spot(head_pod) or _tolerates_spot(head_pod):
        out.append(f"{where}: headGroupSpec: the head must not run on spot nodes")

    # Secure: token auth on every pod from a Secret, nothing reachable from outside the cluster, no privileges.
    auth = spec.get("authOptions") or {}
    secret = auth.get("secretName")
    if auth.get("mode") != "token" or not secret:
        out.append(f"{where}: authOptions: expected mode token with a secretName (the operator gives the "
                   "autoscaler, the submitter and itself the token)")
    for path, _, pod in _pod_templates(spec):
        containers = (pod.get("containers") or []) + (pod.get("initContainers") or [])
        if not containers:
            out.append(f"{where}: {path}: no containers")
        for c in containers:
            env = {e.get("name"): e for e in c.get("env") or []}
            if (env.get("RAY_AUTH_MODE") or {}).get("value") != "token":
                out.append(f"{where}: {path} container {c.get('name')}: without RAY_AUTH_MODE=token")
            token = env.get("RAY_AUTH_TOKEN") or {}
            ref = (token.get("valueFrom") or {}).get("secretKeyRef") or {}
            if "value" in token:
                out.append(f"{where}: {path} container {c.get('name')}: RAY_AUTH_TOKEN has a literal value; it "
                           "must come from a Secret")
            elif ref.get("name") != secret or ref.get("key") != TOKEN_SECRET_KEY:
                out.append(f"{where}: {path} container {c.get('name')}: RAY_AUTH_TOKEN must come from Secret "
                           f"{secret!r} key {TOKEN_SECRET_KEY!r}, got {ref or token!r}")
    for path, key, value in _walk(spec):
        if key in ("serviceType", "type") and value in OPEN_SERVICE_TYPES and (key == "serviceType" or
                                                                              path.endswith("headService.spec")):
            out.append(f"{where}: {path}.{key}: {value}; no LoadBalancer or NodePort service (use kubectl "
                       "port-forward)")
        if key == "enableIngress" and value is True or key == "ingressOptions":
            out.append(f"{where}: {path}.{key}: no Ingress to the head")
        if key in ("hostNetwork", "hostPID", "hostIPC") and value is True:
            out.append(f"{where}: {path}.{key}: true; pods keep their own network and process namespaces")
        if key == "hostPort":
            out.append(f"{where}: {path}.hostPort: {value}; no port on the node's address")
        if key == "privileged" and value is True:
            out.append(f"{where}: {path}.privileged: true; no privileged container")
        if key == "allowPrivilegeEscalation" and value is True:
            out.append(f"{where}: {path}.allowPrivilegeEscalation: true; no privilege escalation")
        if key == "capabilities" and isinstance(value, dict) and value.get("add"):
            out.append(f"{where}: {path}.capabilities.add: {value['add']}; no added capabilities")

    # lightray: NVMe (or an emptyDir) as the node-local cache on every node that reads shards, and a drain on stop.
    for path, group, pod in _pod_templates(spec):
        if path != "headGroupSpec" and _gpus(group) == 0:
            continue
        mounts = {m.get("mountPath"): m.get("name") for m in _ray_container(pod).get("volumeMounts") or []}
        volumes = {v.get("name"): v for v in pod.get("volumes") or []}
        vol = volumes.get(mounts.get(LOCAL_CACHE)) or {}
        if not ("emptyDir" in vol or "hostPath" in vol or "ephemeral" in vol):
            out.append(f"{where}: {path}: no node-local volume (emptyDir, hostPath or ephemeral) mounted at "
                       f"{LOCAL_CACHE} (data.local_cache_dir)")
    for name, group in gpus.items():
        pod = group["template"]["spec"]
        hook = (((_ray_container(pod).get("lifecycle") or {}).get("preStop") or {}).get("exec") or {})
        script = "\n".join(hook.get("command") or [])
        hold = re.search(r"^hold_s = (\d+)$", script, re.M)
        if "drain_node_for_preemption" not in script or not hold:
            out.append(f"{where}: workerGroupSpecs({name}): no preStop hook that drains the Ray node "
                       "(drain_node_for_preemption, hold_s = N)")
        elif int(hold.group(1)) >= int(pod.get("terminationGracePeriodSeconds", 30)):
            out.append(f"{where}: workerGroupSpecs({name}): preStop hold_s {hold.group(1)} must be below "
                       f"terminationGracePeriodSeconds {pod.get('terminationGracePeriodSeconds', 30)}")
    return out


def image_problems(spec: dict[str, Any], where: str, ray_series: str, version: str) -> list[str]:
    """The Ray of the cluster, its image and pyproject.toml agree: rayVersion X.Y.Z in the pinned series,
    one image everywhere, tagged <lightray version>-ray<rayVersion> as the README's build command tags it."""
    out = []
    ray_version = str(spec.get("rayVersion", ""))
    if not re.fullmatch(rf"{re.escape(ray_series)}\.\d+", ray_version):
        out.append(f"{where}: rayVersion {ray_version!r}; pyproject.toml pins ray {ray_series}.*")
    images = {c.get("image") for _, _, pod in _pod_templates(spec) for c in pod.get("containers") or []}
    images.add((spec.get("autoscalerOptions") or {}).get("image") or next(iter(images), None))
    want_tag = f"{version}-ray{ray_version}"
    if len(images) != 1:
        out.append(f"{where}: containers use {len(images)} images {sorted(map(str, images))}; expected one")
    for image in images:
        if not str(image).endswith(f"/lightray:{want_tag}"):
            out.append(f"{where}: image {image!r}; expected <registry>/lightray:{want_tag}")
    return out


# -- the RayJob -----------------------------------------------------------------------------------------
def entrypoint_config(entrypoint: str):
    """(args, Config) of a RayJob entrypoint, parsed by lightray's own CLI; raises ValueError naming the problem."""
    from lightray.cli import build_parser, config_from_args, split_command
    from lightray.config import ConfigError

    argv = shlex.split(entrypoint)
    scripts = project()["project"].get("scripts") or {}
    if not argv or argv[0] not in scripts:
        raise ValueError(f"entrypoint starts with {argv[:1]}; expected the installed console script "
                         f"{sorted(scripts)} (the image holds the package, not the checkout)")
    command, argv = split_command(argv[1:])
    if command != "train":
        raise ValueError(f"entrypoint runs `lightray {command}`; expected `lightray train`")
    args, rest = build_parser(command).parse_known_args(argv)
    try:
        return args, config_from_args(args, rest)
    except ConfigError as exc:
        raise ValueError(f"entrypoint: {exc}") from None


def job_problems(job: dict[str, Any], cluster: dict[str, Any] | None, where: str) -> list[str]:
    """A RayJob that runs lightray on such a cluster, resumes from storage, and fits its GPU groups."""
    spec = job.get("spec") or {}
    out: list[str] = []
    cspec = spec.get("rayClusterSpec")
    if cluster is not None and cspec is not None and cspec != cluster.get("spec"):
        diffs = _diff(cluster.get("spec"), cspec, "rayClusterSpec")
        out.append(f"{where}: rayClusterSpec differs from k8s/raycluster.yaml's spec at {', '.join(diffs[:5])}")
    if cspec is None and not (spec.get("clusterSelector") or {}).get("ray.io/cluster"):
        out.append(f"{where}: spec: neither rayClusterSpec nor clusterSelector ray.io/cluster")
    if spec.get("submissionMode", "K8sJobMode") != "K8sJobMode":
        out.append(f"{where}: submissionMode {spec.get('submissionMode')!r}; K8sJobMode resubmits after a head loss")
    if cspec is not None:
        if not spec.get("backoffLimit"):
            out.append(f"{where}: backoffLimit {spec.get('backoffLimit')!r}; at least 1, so that a failed run is "
                       "retried on a new cluster (and resumes)")
        if spec.get("shutdownAfterJobFinishes") is not True:
            out.append(f"{where}: shutdownAfterJobFinishes must be true (the job's cluster goes when the run ends)")
    try:
        args, cfg = entrypoint_config(str(spec.get("entrypoint", "")))
    except ValueError as exc:
        return out + [f"{where}: spec.entrypoint: {exc}"]
    if not (args.resume and args.name):
        out.append(f"{where}: spec.entrypoint: needs --resume and a fixed --name, so that a resubmitted job "
                   "continues the run from storage")
    if "://" not in str(cfg.storage or ""):
        out.append(f"{where}: spec.entrypoint: --storage {cfg.storage!r}; runs must go to object storage (s3://, "
                   "gs://), not to a pod's disk")
    if cfg.scaling.use_gpu != "true":
        out.append(f"{where}: spec.entrypoint: --gpu {cfg.scaling.use_gpu!r}; expected true")
    groups = gpu_groups(cspec or {})
    spot = [g for g in groups.values() if is_spot(g)]
    if spot:
        g = spot[0]
        res = _ray_container(g["template"]["spec"])["resources"]
        cpus = int(str(res["limits"]["cpu"]))
        per_pod = min(_gpus(g), int(cpus // cfg.scaling.cpus_per_worker))
        lo, hi = cfg.worker_range()
        capacity = per_pod * int(g.get("maxReplicas", 0))
        if hi > capacity:
            out.append(f"{where}: spec.entrypoint: --workers {lo}:{hi} does not fit {g['groupName']}: "
                       f"{g.get('maxReplicas')} pods x {per_pod} workers = {capacity}")
        if cfg.cost.gpus_per_node != _gpus(g):
            out.append(f"{where}: spec.entrypoint: --cost.gpus_per_node={cfg.cost.gpus_per_node}; the spot pods "
                       f"have {_gpus(g)} GPUs")
        key = (g.get("labels") or {}).get("lightray-price-key")
        if cfg.cost.node_type != key:
            out.append(f"{where}: spec.entrypoint: --cost.node_type={cfg.cost.node_type}; the spot group's price "
                       f"key is {key!r}")
        mounts = {m.get("mountPath") for m in _ray_container(g["template"]["spec"]).get("volumeMounts") or []}
        if cfg.data.local_cache_dir not in mounts:
            out.append(f"{where}: spec.entrypoint: --data.local_cache_dir={cfg.data.local_cache_dir!r} is not a "
                       f"volume of the GPU pods (mounted: {sorted(mounts)})")
    return out


def _diff(a: Any, b: Any, path: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _diff(a.get(k), b.get(k), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [path]


# -- the Dockerfile -------------------------------------------------------------------------------------
INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "MAINTAINER", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT",
                "VOLUME", "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}
SECRET_WORDS = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|API_?KEY|ACCESS_?KEY|PRIVATE", re.I)
SECRET_FILES = re.compile(r"(^|/)(\.ray|auth_token|\.aws|\.netrc|\.ssh|id_rsa|\.docker|\.kube|credentials)(/|$)")


class DockerfileError(ValueError):
    """A line the parser cannot read; the message names the file and the line."""


def parse_dockerfile(text: str, name: str = "Dockerfile") -> list[dict[str, Any]]:
    """Instructions of a Dockerfile as ``{"line", "cmd", "flags", "args", "raw"}``, as the Docker builder reads
    them: comment and empty lines dropped (also inside a continuation), ``\\`` joins lines, a JSON array is the
    exec form. The ``escape`` directive (it changes how lines join), a heredoc or an unknown instruction is an
    error; other directives, like unknown ones, read as comments."""
    out: list[dict[str, Any]] = []
    buf, start, directives_open = "", 0, True
    for lineno, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        directive = re.fullmatch(r"#\s*([a-zA-Z]+)\s*=\s*(.*)", stripped) if directives_open else None
        if directive and directive.group(1).lower() == "escape":
            raise DockerfileError(f"{name}:{lineno}: parser directive 'escape' is not supported by this parser")
        directives_open = bool(directive)
        if stripped.startswith("#") or not stripped:
            continue
        if not buf:
            start = lineno
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        out.append(_instruction(buf.strip(), start, name))
        buf = ""
    if buf:
        raise DockerfileError(f"{name}:{start}: the file ends inside a line continuation")
    return out


def _instruction(raw: str, line: int, name: str) -> dict[str, Any]:
    cmd, _, rest = raw.partition(" ")
    if cmd.upper() not in INSTRUCTIONS:
        raise DockerfileError(f"{name}:{line}: unknown instruction {cmd!r}")
    if re.search(r"<<-?[\"']?[A-Za-z_]", rest):
        raise DockerfileError(f"{name}:{line}: heredocs are not supported by this parser")
    flags = []
    rest = rest.strip()
    while cmd.upper() in ("RUN", "COPY", "ADD", "FROM") and rest.startswith("--"):
        flag, _, rest = rest.partition(" ")
        flags.append(flag)
        rest = rest.strip()
    if rest.startswith("["):
        try:
            args = json.loads(rest)
        except json.JSONDecodeError:
            raise DockerfileError(f"{name}:{line}: {cmd} has a malformed JSON array: {rest[:60]}") from None
    else:
        args = rest
    if not args and cmd.upper() not in ("ONBUILD",):
        raise DockerfileError(f"{name}:{line}: {cmd} without arguments")
    return {"line": line, "cmd": cmd.upper(), "flags": flags, "args": args, "raw": raw}


def _substitute(text: str, env: dict[str, str]) -> str:
    def repl(m: re.Match) -> str:
        var, default = m.group(1) or m.group(3), m.group(2)
        return env.get(var) or (default or "")
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)", repl, text)


def stages(instructions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Build stages: base image (global ARGs substituted), alias, and their instructions."""
    global_args: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for ins in instructions:
        if ins["cmd"] == "ARG" and not out:
            k, _, v = ins["args"].partition("=")
            global_args[k.strip()] = v.strip().strip('"')
        elif ins["cmd"] == "FROM":
            words = _substitute(ins["args"], global_args).split()
            out.append({"line": ins["line"], "image": words[0], "alias": words[2] if len(words) == 3 else None,
                        "args": dict(global_args), "instructions": []})
        elif not out:
            raise DockerfileError(f"Dockerfile:{ins['line']}: {ins['cmd']} before the first FROM")
        else:
            out[-1]["instructions"].append(ins)
    if not out:
        raise DockerfileError("Dockerfile: no FROM")
    return out


def stage_vars(stage: dict[str, Any]) -> dict[str, str]:
    """Variables a stage's RUN lines see: only the global ARGs it declares again (with their defaults), its own
    ARGs and its ENVs; Docker leaves every other ``$VAR`` empty."""
    out: dict[str, str] = {}
    for ins in stage["instructions"]:
        if ins["cmd"] == "ARG":
            k, eq, v = ins["args"].partition("=")
            out[k.strip()] = _substitute(v.strip().strip('"'), out) if eq else stage["args"].get(k.strip(), "")
        elif ins["cmd"] == "ENV" and isinstance(ins["args"], str):
            for k, v in re.findall(r'(\w+)=("[^"]*"|\S*)', ins["args"]):
                out[k] = _substitute(v.strip('"'), out)
    return out


def dockerfile_problems(text: str, ignore: str, ray_series: str, requires_python: str) -> list[str]:
    """The image is Ray's GPU image of the pinned Ray, installs the lightray package (not the checkout), keeps
    that Ray, runs as a numeric non-root user, and carries no secret."""
    where = "k8s/Dockerfile"
    try:
        st = stages(parse_dockerfile(text, where))
    except DockerfileError as exc:
        return [str(exc)]
    out = []
    final = st[-1]
    for stage in st:
        m = re.fullmatch(r"rayproject/ray:(\d+\.\d+\.\d+)-py3(\d+)-(gpu|cu\d+)", stage["image"])
        if stage is final and not m:
            out.append(f"{where}:{stage['line']}: FROM {stage['image']}; expected rayproject/ray:X.Y.Z-py3NN-gpu")
            continue
        if m and not m.group(1).startswith(ray_series + "."):
            out.append(f"{where}:{stage['line']}: FROM {stage['image']}: Ray {m.group(1)}, but pyproject.toml pins "
                       f"{ray_series}.*")
        lowest = re.search(r">=\s*3\.(\d+)", requires_python)
        if m and lowest and int(m.group(2)) < int(lowest.group(1)):
            out.append(f"{where}:{stage['line']}: FROM {stage['image']}: Python 3.{m.group(2)}, but lightray "
                       f"requires {requires_python}")
    ray_version = (re.search(r":(\d+\.\d+\.\d+)-", final["image"]) or [None, ""])[1]
    env = stage_vars(final)
    runs = [_substitute(i["args"] if isinstance(i["args"], str) else " ".join(i["args"]), env)
            for i in final["instructions"] if i["cmd"] == "RUN"]
    installs = []  # (pip install command, whether it holds Ray at the image's version)
    for run in runs:
        segments = re.split(r"&&|;|\|\|", run)
        # A constraint file counts when the same RUN writes the pin into it (echo "ray==X" > file).
        pinned_files = {m.group(1) for seg in segments
                        if (m := re.search(rf"ray=={re.escape(ray_version)}\b.*>\s*(\S+)", seg))}
        for seg in segments:
            if re.search(r"\bpip3? install\b", seg):
                words = shlex.split(seg)
                constraints = {w for flag, w in zip(words, words[1:]) if flag in ("-c", "--constraint")}
                held = f"ray=={ray_version}" in words or bool(constraints & pinned_files)
                installs.append((seg.strip(), words, held))
    if not any(re.search(r"lightray[-\w.*]*\.whl|\blightray\b", seg) for seg, _, _ in installs):
        out.append(f"{where}: the final stage does not pip install the lightray package")
    for seg, words, held in installs:
        if {"-e", "--editable"} & set(words) or any(w in (".", "./") for w in words):
            out.append(f"{where}: `{seg}` installs the checkout; install the package (a wheel)")
        if not held:
            out.append(f"{where}: `{seg}` does not hold pip to the image's Ray (ray=={ray_version}, directly or in "
                       "a -c constraint file the same RUN writes)")
    for ins in final["instructions"]:
        if ins["cmd"] in ("COPY", "ADD") and not any(f.startswith("--from=") for f in ins["flags"]):
            out.append(f"{where}:{ins['line']}: {ins['cmd']} from the build context into the final image; only the "
                       "wheel stage reads sources")
    users = [i for i in final["instructions"] if i["cmd"] == "USER"]
    uid = users[-1]["args"].split(":")[0] if users else ""
    if not uid.isdigit() or int(uid) == 0:
        out.append(f"{where}: the final stage's USER is {uid or '(inherited)'!r}; expected a numeric non-root uid "
                   "(runAsNonRoot checks it)")
    for stage in st:
        for ins in stage["instructions"]:
            text_args = ins["args"] if isinstance(ins["args"], str) else " ".join(ins["args"])
            if ins["cmd"] in ("ENV", "ARG", "LABEL"):
                names = re.findall(r"(\w+)\s*=", text_args) or text_args.split()[:1]
                if any(SECRET_WORDS.search(n) for n in names):
                    out.append(f"{where}:{ins['line']}: {ins['cmd']} {text_args[:40]}: no secrets in the image")
            if ins["cmd"] in ("COPY", "ADD") and any(SECRET_FILES.search(w) for w in shlex.split(text_args)):
                out.append(f"{where}:{ins['line']}: {ins['cmd']} {text_args}: no credentials in the image")
            if "RAY_AUTH_TOKEN" in text_args:
                out.append(f"{where}:{ins['line']}: the Ray token must not be baked into the image")
    # The build context: every source the wheel stage copies must survive the .dockerignore allowlist.
    patterns = [p.strip() for p in ignore.splitlines() if p.strip() and not p.strip().startswith("#")]
    if not patterns or patterns[0] != "*":
        out.append("k8s/Dockerfile.dockerignore: expected an allowlist (first pattern `*`) so that nothing but the "
                   "sources reaches the builder")
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    for src in copy_sources(st):
        if src.split("/")[0] not in allowed:
            out.append(f"k8s/Dockerfile.dockerignore: {src} (copied by the Dockerfile) is excluded from the context")
    return out


def copy_sources(st: list[dict[str, Any]]) -> list[str]:
    """Build-context paths that COPY/ADD instructions read (not those copied from another stage)."""
    out = []
    for stage in st:
        for ins in stage["instructions"]:
            if ins["cmd"] in ("COPY", "ADD") and not any(f.startswith("--from=") for f in ins["flags"]):
                words = ins["args"] if isinstance(ins["args"], list) else shlex.split(ins["args"])
                out.extend(w.rstrip("/") for w in words[:-1])
    return out
