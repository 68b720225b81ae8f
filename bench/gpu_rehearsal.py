"""The GPU suite's rehearsal on this machine: ``bash bench/gpu_suite.sh --dry-run`` run by a Python that holds
only what the GPU machine holds, with everything else installed from the bundle alone.

1. The bundle for the GPU machine (Python 3.12) is built and must fit (``bench/gpu_bundle.py``).
2. The same bundle is built for this machine's Python.
3. A fresh virtual environment sees only the GPU machine's packages (``GPU_MACHINE`` and what they require),
   linked from this machine's site-packages: no Ray, no pydantic, no lightray.
4. The suite's dry run runs with that environment's Python; its first step installs the bundle with
   ``pip --no-index --no-deps`` and imports lightray, Ray and torch. A wheel that needs a package neither the
   bundle nor the GPU machine has fails there or in a step.

``python -m bench.gpu_rehearsal [--out-dir DIR]`` prints the suite's output, then one JSON line with the
bundle's size; exits 1 when the bundle does not fit or a step failed.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import PackageNotFoundError, distribution

from bench import gpu_bundle

ROOT = pathlib.Path(__file__).resolve().parents[1]
# What the GPU machine has (its description in the device tool); their own requirements come with them.
GPU_MACHINE = ("torch", "torchvision", "pyarrow", "pandas", "timm", "safetensors", "tensorboard", "psutil", "pytest",
               "pip")


def _requirement_name(req: str) -> str | None:
    if "extra ==" in req:
        return None
    return re.split(r"[ ;<>=!~\[(]", req.strip(), maxsplit=1)[0]


def closure(names: tuple[str, ...]) -> set[str]:
    """The distributions ``names`` need here, themselves included (extras left out)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        todo.extend(n for n in (_requirement_name(r) for r in dist.requires or []) if n)
    return seen


def _top_level(dist_name: str) -> set[str]:
    """The names a distribution puts at the top of site-packages (its packages, modules and dist-info)."""
    dist = distribution(dist_name)
    return {pathlib.PurePath(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}


def machine_like_venv(where: pathlib.Path) -> pathlib.Path:
    """A virtual environment that sees only the GPU machine's packages; returns its Python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where / "venv")], check=True)
    lite = where / "gpu-machine-site"
    lite.mkdir()
    site = pathlib.Path(sysconfig.get_paths()["purelib"])
    for dist_name in sorted(closure(GPU_MACHINE)):
        for top in _top_level(dist_name):
            src = site / top
            if src.exists() and not (lite / top).exists():
                (lite / top).symlink_to(src)
    py = where / "venv" / "bin" / "python"
    venv_site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip()
    pathlib.Path(venv_site, "gpu_machine.pth").write_text(str(lite) + "\n")
    return py


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default=None, help="the suite's logs (default: a temporary folder)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gpu-rehearsal-") as tmp:
        where = pathlib.Path(tmp)
        here = f"{sys.version_info.major}.{sys.version_info.minor}"
        gpu_bundle.build(where / "bundle_here", here, level=1)  # its size is not the question
        # The GPU machine's bundle is only measured: it is built (deflate at level 9, about 20 CPU-s) while the
        # suite runs, which leaves a core idle much of the time. Not beside the build above: both build
        # lightray's wheel in this checkout.
        with ThreadPoolExecutor(1) as pool:
            gpu_build = pool.submit(gpu_bundle.build, where / "bundle312", "3.12")
            py = machine_like_venv(where)
            env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
            env.update(PYTHON=str(py), GPU_BUNDLE=str(where / "bundle_here"), GPU_SITE=str(where / "site"),
                       OUT_DIR=args.out_dir or str(where / "logs"))
            suite = subprocess.run(["bash", "bench/gpu_suite.sh", "--dry-run"], cwd=ROOT, env=env)
            gpu = gpu_build.result()
        gpu["total_mib"] = round(gpu["bundle_mib"] + gpu_bundle.checkout_bytes() / gpu_bundle.MIB, 1)
    fits = gpu["total_mib"] <= 60.0
    print(json.dumps({"bench": "gpu_rehearsal", "bundle_mib": gpu["bundle_mib"], "with_checkout_mib": gpu["total_mib"],
                      "max_mib": 60.0, "fits": fits, "ray_dropped_mib": gpu["ray"]["dropped_mib"],
                      "python_here": here, "suite_rc": suite.returncode}))
    return 0 if fits and suite.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
