"""Code that CI does not run still calls lightray's and the shared test helpers' functions as they are now.

The benches (``python -m bench.<name>``) and the tests marked ``bench`` run by hand, not in CI. A change to a
helper's parameters that forgets one of their calls breaks them silently: on 2026-12-07 a review dropped
``tests.faults.cluster_driver``'s ``env`` parameter, and every ``python -m bench.chaos`` failed at its first driver
with a TypeError until the README's command was run again that evening. This reads every call in ``bench/`` and
``tests/`` to a function or class imported from ``lightray``, ``bench`` or ``tests`` and binds the call's
arguments to the callee's real signature."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib

from tests.faults import ROOT

PACKAGES = ("lightray", "bench", "tests")


def _imported_callables(tree: ast.Module, package: str) -> dict[str, object]:
    """The names a module imports from lightray, bench or tests (``from X import name [as alias]``), resolved
    to the objects themselves; only functions and classes."""
    found: dict[str, object] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        module = node.module or ""
        if node.level:  # ``from .common import x`` inside bench/
            module = f"{package}.{module}" if module else package
        if module.split(".")[0] not in PACKAGES:
            continue
        source = importlib.import_module(module)
        for alias in node.names:
            obj = getattr(source, alias.name, None)
            if inspect.isfunction(obj) or inspect.isclass(obj):
                found[alias.asname or alias.name] = obj
    return found


def _misfit(sig: inspect.Signature, call: ast.Call) -> str | None:
    """Why ``call``'s arguments cannot bind to ``sig``, or None. A ``*args`` or ``**kwargs`` in the call hides
    how many arguments it passes: then only the keyword names it spells out are checked."""
    kinds = {p.kind for p in sig.parameters.values()}
    named = [k.arg for k in call.keywords if k.arg is not None]
    if inspect.Parameter.VAR_KEYWORD not in kinds:
        takes = {n for n, p in sig.parameters.items()
                 if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
        unknown = sorted(set(named) - takes)
        if unknown:
            return f"no parameter {', '.join(unknown)}"
    if any(isinstance(a, ast.Starred) for a in call.args) or len(named) < len(call.keywords):
        return None
    try:
        sig.bind(*[None] * len(call.args), **dict.fromkeys(named))
    except TypeError as e:
        return str(e)
    return None


def _signature(obj: object) -> inspect.Signature | None:
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):  # a class whose signature Python cannot tell (a C base, a metaclass)
        return None


def misfits(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """``file:line: callee(...): why`` for each call in ``path`` that does not fit its callee's signature."""
    tree = ast.parse(path.read_text(), filename=str(path))
    callables = _imported_callables(tree, path.parent.name)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in callables:
            sig = _signature(callables[node.func.id])
            why = sig and _misfit(sig, node)
            if why:
                out.append(f"{path.relative_to(root)}:{node.lineno}: {node.func.id}(...): {why}")
    return out


def test_a_call_with_an_argument_the_callee_no_longer_takes_is_found(tmp_path):
    (tmp_path / "bench").mkdir()
    source = tmp_path / "bench" / "probe.py"
    source.write_text("from tests.faults import driver_command\n"
                      "driver_command('s', 'n', cache='c', address='a')\n"
                      "driver_command('s', 'n', cache='c', env={})\n"
                      "driver_command('s', cache='c', *more)\n"
                      "driver_command('s')\n")
    assert misfits(source, root=tmp_path) == ["bench/probe.py:3: driver_command(...): no parameter env",
                     "bench/probe.py:5: driver_command(...): missing a required argument: 'name'"]


def test_every_call_in_the_benches_and_tests_fits_its_callee():
    files = sorted((ROOT / "bench").glob("*.py")) + sorted((ROOT / "tests").glob("*.py"))
    assert len(files) > 50
    found = [line for f in files for line in misfits(f)]
    assert not found, "\n".join(found)
