"""The rooms of docs/ARCHITECTURE.md: no import cycle in the package, each room imports only what its row allows,
and no function grows past what one screen shows."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
APP = ROOT / "app"  # installed as the package ``lightray``
MAX_FUNCTION_LINES = 60

# room -> rooms of the package it may import (function-level imports count too). Leaves first, then the layers:
# data and report sit on the leaves; comm (gradient communication) below train (the worker's step); driver (the
# run's orchestration and fault handling) drives train; tune drives runs. api, cli and run sit on top.
LEAVES = {"config", "storage_retry", "provenance", "startup", "units", "plain_rng", "ray_private"}
ALLOWED = {
    **{leaf: set() for leaf in LEAVES},
    "storage": {"storage_retry"},
    "schedule": {"config"},
    "data": {"config", "storage", "startup", "units"},
    "report": {"config", "storage", "provenance"},
    "comm": {"config", "units", "plain_rng"},
    "train": {"config", "storage", "provenance", "startup", "schedule", "data", "report", "comm", "units",
              "plain_rng", "ray_private"},
    "driver": {"config", "storage", "provenance", "startup", "schedule", "data", "report", "train", "ray_private"},
    "inference": {"config", "storage", "data", "train"},
    "recipe_pick": {"config", "data"},
    "tune": {"config", "storage", "startup", "schedule", "data", "report", "train", "driver", "ray_private"},
}
TOP = {"api", "cli", "model_cli", "run"}
# The package lightray.train shares its name with the API call lightray.train(config, ...): its __init__ makes it
# callable, and the call (only the call, at call time) goes to lightray.api.
EXCEPTIONS = {("lightray.train", "lightray.api")}


def _module_name(path: pathlib.Path) -> str:
    parts = ("lightray",) + path.relative_to(APP).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """module -> the package's modules it imports: ``from lightray.x import y`` counts lightray.x.y when that is a
    module, else lightray.x (so ``from lightray import storage`` is an edge to storage, not to the package root)."""
    modules = {_module_name(p): p for p in APP.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lightray":
                subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                deps |= subs if len(subs) == len(node.names) else subs | {node.module}
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.split(".")[0] == "lightray")
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "lightray"


def test_the_package_has_no_import_cycle():
    graph = _imports()
    state: dict[str, int] = {}
    path: list[str] = []
    cycles: list[list[str]] = []

    def visit(u: str) -> None:
        state[u] = 1
        path.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                cycles.append(path[path.index(v):] + [v])
            elif v not in state:
                visit(v)
        path.pop()
        state[u] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert cycles == []


def test_each_room_imports_only_what_the_architecture_allows():
    graph = _imports()
    rooms = {_room(m) for m in graph} - {"lightray"}
    assert rooms <= ALLOWED.keys() | TOP, f"rooms missing from ALLOWED: {sorted(rooms - ALLOWED.keys() - TOP)}"
    wrong = []
    for module, deps in graph.items():
        room = _room(module)
        if room in TOP or room == "lightray":
            continue
        for d in deps:
            target = _room(d)
            if target != room and target not in ALLOWED[room] and (module, d) not in EXCEPTIONS:
                wrong.append(f"{module} imports {d}")
    assert wrong == []


def test_the_package_root_imports_only_the_api_and_inference_lazily():
    """``import lightray`` must stay cheap: its ``__init__`` imports nothing of the package at module level."""
    tree = ast.parse((APP / "__init__.py").read_text())
    top_level = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert all(not (isinstance(n, ast.ImportFrom) and (n.module or "").startswith("lightray")) for n in top_level)


def test_no_function_is_longer_than_a_screen():
    long = []
    for folder in (APP, ROOT / "bench"):
        for path in sorted(folder.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


def test_every_package_folder_is_installed():
    """A folder of app/ with an ``__init__.py`` that pyproject.toml's package list misses works from a checkout (the
    editable install) and is missing from the wheel, the GPU bundle and a cluster image."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {_module_name(p) for p in APP.rglob("__init__.py")}
    assert found - listed == set()


def test_bench_has_one_spread_statistic():
    """One definition of the spread that every bench reports (bench.common.spread)."""
    defs = [f"{p.relative_to(ROOT)}" for p in sorted((ROOT / "bench").rglob("*.py"))
            for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.FunctionDef) and n.name == "spread"]
    assert defs == ["bench/common.py"]
