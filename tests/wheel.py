"""The lightray wheel, built once per run (per CI run when LIGHTRAY_TEST_SHARED is set) the way the Dockerfile's
first stage builds it: `pip wheel` over exactly the files the Dockerfile copies. The k8s test checks what it
holds; the install test installs it into a fresh virtual environment."""

from __future__ import annotations

import importlib.util
import pathlib
import shutil
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent


def k8s_checks():
    """tests/k8s/checks.py, which parses the Dockerfile (a folder, not a package: loaded by path)."""
    spec = importlib.util.spec_from_file_location("k8s_checks", HERE / "k8s" / "checks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build_wheel(folder: pathlib.Path) -> pathlib.Path:
    """The wheel in ``folder``, built there first if it is not yet. Built aside and moved in whole, so that a
    build cut short leaves nothing a later session would take for a wheel."""
    found = sorted(folder.glob("lightray-*.whl"))
    if found:
        return found[0]
    checks = k8s_checks()
    st = checks.stages(checks.parse_dockerfile(checks.DOCKERFILE.read_text()))
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        context = pathlib.Path(tmp) / "context"
        context.mkdir()
        for src in checks.copy_sources(st):
            path = checks.REPO / src
            if path.is_dir():
                shutil.copytree(path, context / src, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy(path, context / src)
        out = pathlib.Path(tmp) / "wheels"
        res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                              "--wheel-dir", str(out), str(context)], capture_output=True, text=True, timeout=280)
        assert res.returncode == 0, res.stderr[-2000:]
        wheel, = out.glob("lightray-*.whl")
        shutil.rmtree(folder, ignore_errors=True)
        shutil.move(str(out), str(folder))
    return folder / wheel.name
