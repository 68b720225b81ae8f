"""The wheels that make the GPU machine ready for ``bash bench/gpu_suite.sh``, small enough to travel with the
checkout (the device tool carries at most 64 MiB a call; the bundle and the checkout must stay under 60 MiB).

The GPU machine has Python 3.12, torch, torchvision, pyarrow, pandas, timm, safetensors, tensorboard, psutil and
pytest, no network, and no Ray, pydantic or optuna. The bundle holds, for one Python on x86-64 Linux:

- lightray itself, as a wheel built from this checkout (the package is the folder ``app/``: ``PYTHONPATH=$PWD``
  cannot import ``lightray``);
- Ray, slimmed of what a Python-only run never loads (``ray/jars``, the Java worker, 31 of its 75 MiB; RLlib,
  Serve, LLM and the dashboard's web client), with its RECORD rewritten to list only what is left;
- the packages lightray and Ray import that the GPU machine lacks (``EXTRA``), each as the wheel pip picks for
  that Python and platform.

``python -m bench.gpu_bundle`` (default: Python 3.12, into ``bench/gpu_bundle/``, which git ignores) prints one
JSON line with the bundle's size and the checkout's, and exits 1 when they are over ``--max-mib``.
``--python-version 3.11`` builds the same bundle for this machine's Python, for the rehearsal
(``bench/gpu_rehearsal.py``). The suite's first step installs the bundle with ``pip --no-index --no-deps``.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib.metadata import version

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "gpu_bundle"
# What a Python-only run of Ray never loads: the Java worker, RLlib, Serve, LLM and the dashboard's web client.
RAY_DROP = ("ray/jars/", "ray/rllib/", "ray/serve/", "ray/llm/", "ray/dashboard/client/build/")
# The packages lightray and Ray import that the GPU machine lacks (pinned to the versions tested here), with what
# needs each. The rehearsal (bench/gpu_rehearsal.py) fails when one is missing.
EXTRA = {
    "pydantic": "lightray.config",
    "pydantic-core": "pydantic",
    "annotated-types": "pydantic",
    "typing-inspection": "pydantic",
    "msgpack": "ray",
    "click": "ray",
    "jsonschema": "ray",
    "jsonschema-specifications": "jsonschema",
    "referencing": "jsonschema",
    "rpds-py": "jsonschema",
    "attrs": "jsonschema",
    "requests": "ray (its accelerator probes)",
    "urllib3": "requests",
    "idna": "requests",
    "certifi": "requests",
    "charset-normalizer": "requests",
}
# Left out: boto3 and botocore (14 MiB), imported only for s3:// storage, which the suite does not use.
MIB = 2**20


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def slim_wheel(src: pathlib.Path, dst: pathlib.Path, drop: tuple[str, ...], level: int = 9) -> dict[str, float]:
    """Copy wheel ``src`` to ``dst`` without the members under ``drop``; RECORD lists exactly what is kept.
    ``level``: the deflate level (9 for the bundle that travels; 1 where only its contents matter)."""
    kept = dropped = 0
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=level) as zout:
        record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        lines = []
        for info in zin.infolist():
            if info.filename == record_name:
                continue
            if info.filename.startswith(drop):
                dropped += info.file_size
                continue
            data = zin.read(info)
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=level)
            lines.append(_record_line(info.filename, data))
            kept += info.file_size
        lines.append(f"{record_name},,")
        zout.writestr(record_name, "\n".join(lines) + "\n")
    return {"kept_mib": round(kept / MIB, 1), "dropped_mib": round(dropped / MIB, 1)}


def download(specs: list[str], dest: pathlib.Path, python_version: str) -> None:
    """Binary wheels for CPython ``python_version`` on x86-64 Linux (manylinux), no dependencies resolved: the
    list is the closure, checked by the rehearsal."""
    abi = "cp" + python_version.replace(".", "")
    platforms = [a for p in ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
                 for a in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--no-deps",
           "--python-version", python_version, "--implementation", "cp", "--abi", abi, "--abi", "abi3",
           "--abi", "none", *platforms, "-d", str(dest), *specs]
    subprocess.run(cmd, check=True)


def _pinned(name: str) -> str:
    try:
        return f"{name}=={version(name)}"
    except Exception:  # not installed here: pip picks the newest wheel for that Python
        return name


def checkout_bytes() -> int:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return sum((ROOT / f).stat().st_size for f in files.decode().split("\0") if f and (ROOT / f).is_file())


def build(out: pathlib.Path, python_version: str, level: int = 9) -> dict:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_dir = pathlib.Path(tmp)
        download([_pinned("ray")], tmp_dir, python_version)
        (ray_wheel,) = tmp_dir.glob("ray-*.whl")
        ray_slim = slim_wheel(ray_wheel, out / ray_wheel.name, RAY_DROP, level)
    download([_pinned(name) for name in EXTRA], out, python_version)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(ROOT)], check=True, cwd=ROOT)
    wheels = sorted(out.glob("*.whl"))
    return {"python": python_version, "ray": ray_slim,
            "wheels": {w.name: round(w.stat().st_size / MIB, 2) for w in wheels},
            "bundle_mib": round(sum(w.stat().st_size for w in wheels) / MIB, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default 3.12)")
    ap.add_argument("--out", default=str(OUT), help="where the wheels go (default bench/gpu_bundle, git-ignored)")
    ap.add_argument("--max-mib", type=float, default=60.0, help="bundle + checkout must stay under this")
    args = ap.parse_args(argv)
    result = build(pathlib.Path(args.out), args.python_version)
    result["checkout_mib"] = round(checkout_bytes() / MIB, 1)
    result["total_mib"] = round(result["bundle_mib"] + result["checkout_mib"], 1)
    result["max_mib"] = args.max_mib
    result["fits"] = result["total_mib"] <= args.max_mib
    (pathlib.Path(args.out) / "bundle.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0 if result["fits"] else 1


if __name__ == "__main__":
    sys.exit(main())
