"""The import rules of docs/ARCHITECTURE.md: no cycle in app/, and each package imports only what its row allows."""

from __future__ import annotations

import ast
import pathlib

APP = pathlib.Path(__file__).resolve().parents[1] / "app"

# package -> packages of app/ it may import (function-level imports count too)
ALLOWED = {
    "config": set(),
    "storage": {"storage_retry"},
    "storage_retry": set(),
    "provenance": set(),
    "startup": set(),
    "schedule": {"config"},
    "data": {"config", "storage", "startup"},
    "report": {"config", "storage", "provenance"},
    "train": {"config", "storage", "provenance", "startup", "schedule", "data", "report"},
    "inference": {"config", "storage", "data", "train"},
    "tune": {"config", "storage", "startup", "schedule", "data", "report", "train"},
}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(APP.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """module -> the app modules it imports (``from app.x import y`` counts app.x and app.x.y if that is a module)."""
    modules = {_module_name(p): p for p in APP.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "app":
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.split(".")[0] == "app")
        graph[name] = {d for d in deps if d in modules and d != name and d != "app"}
    return graph


def _package(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def test_app_has_no_import_cycle():
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


def test_each_package_imports_only_what_the_architecture_allows():
    wrong = []
    for module, deps in _imports().items():
        pkg = _package(module)
        if pkg not in ALLOWED:
            continue  # cli and run sit on top and may import everything
        for d in deps:
            target = _package(d)
            if target != pkg and target not in ALLOWED[pkg]:
                wrong.append(f"{module} imports {d}")
    assert wrong == []
