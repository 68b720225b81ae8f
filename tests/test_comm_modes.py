"""Each comm mode is a small module of ``lightray.comm.modes`` behind one interface (``CommMode.reduce``), as torch's
own DDP comm hooks are laid out; the hook only picks the mode and keeps the books. What each mode computes is
checked against references in tests/test_comm.py, test_dgc.py, test_comm_fp16.py and test_comm_resume.py."""

from __future__ import annotations

import importlib
import pkgutil
import re

import pytest

from lightray.comm import modes
from lightray.comm.modes.base import CommMode
from lightray.config import load_config

SMALL = 150  # lines: a mode module that grows past one screen or two is doing another module's job


def _configurable_modes() -> list[str]:
    """The modes ``comm.mode`` accepts, as its error message lists them."""
    with pytest.raises(ValueError) as err:
        load_config("demo", {"comm.mode": "no-such-mode"})
    return re.search(r"allowed: ([\w, ]+)", str(err.value)).group(1).split(", ")


def _mode_classes() -> dict[str, type]:
    """name -> the CommMode class of that name, over every module of lightray.comm.modes."""
    found: dict[str, type] = {}
    for info in pkgutil.iter_modules(modes.__path__):
        module = importlib.import_module(f"{modes.__name__}.{info.name}")
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, CommMode) and obj.__module__ == module.__name__:
                assert obj.name not in found, f"two CommMode classes named {obj.name!r}"
                found[obj.name] = obj
    return found


def test_every_configurable_mode_is_a_comm_mode_class_and_each_compressing_one_has_a_small_module_of_its_own():
    classes = _mode_classes()
    wanted = set(_configurable_modes()) - {"auto"}  # auto picks one of the others
    assert wanted <= classes.keys(), f"comm.mode values without a CommMode class: {sorted(wanted - classes.keys())}"
    compressing = ["topk", "hierarchical_topk", "powersgd"]
    homes = [classes[m].__module__ for m in compressing]
    assert len(set(homes)) == len(homes), f"compressing modes sharing a module: {homes}"
    for module_name in {classes[m].__module__ for m in wanted}:
        path = importlib.import_module(module_name).__file__
        with open(path) as f:
            lines = sum(1 for _ in f)
        assert lines <= SMALL, f"{module_name} has {lines} lines"
    assert all(classes[m].reduce is not CommMode.reduce for m in wanted)  # each reduces by itself
