"""bench.step_env's timing function, where it runs: the recipe's own model, optimizer and loss, the threads asked for,
and the thread it ran on (the bench compares places by these)."""

from __future__ import annotations

import os

import pytest
import torch

from bench.step_env import _in_thread, _thread_in_process, time_steps
from lightray.train.host_memory import MALLOC_ENV


@pytest.fixture
def threads_restored():
    """time_steps pins torch's threads and the OpenMP env for the process: put both back for the next test."""
    threads, env = torch.get_num_threads(), {v: os.environ.get(v) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    yield
    torch.set_num_threads(threads)
    for var, value in env.items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value


def test_the_step_is_timed_with_the_threads_asked_for_on_the_thread_it_ran_on(threads_restored):
    here = time_steps("demo", 32, 8, 2, 1)
    there = _in_thread("demo", 32, 8, 2, 1)
    assert here["threads"] == there["threads"] == 1
    assert (here["thread"], there["thread"]) == ("MainThread", "step-thread")
    assert 0 < here["step_s"] < 10 and 0 < there["step_s"] < 10


def test_the_precision_bench_times_each_recipe_step_in_fp32_and_in_bf16(threads_restored):
    from bench.precision import measure
    from lightray.config import ModelConfig
    from lightray.train.device import precision_for

    runs = measure((("demo", 32, 8),), repeats=1, steps=1, threads=1)
    assert set(runs["demo"]) == {"fp32", "bf16"} and all(len(v) == 1 and v[0] > 0 for v in runs["demo"].values())
    # The steps ran at what was asked for, and auto follows lightray's own rule for this CPU.
    assert time_steps("demo", 32, 8, 1, 1, "bf16")["precision"] == "bf16"
    assert time_steps("demo", 32, 8, 1, 1)["precision"] == precision_for(ModelConfig(), torch.device("cpu"))


def test_the_reused_memory_place_is_a_fresh_processs_thread_started_with_the_settings(monkeypatch):
    with_them = _thread_in_process(("demo", 32, 8, 2, 1), MALLOC_ENV)
    assert with_them["thread"] == "step-thread" and with_them["threads"] == 1
    assert with_them["reused_host_memory"] and 0 < with_them["step_s"] < 10
    # The place beside it has glibc as it comes, also where this process holds them (connect_ray sets them).
    for key, value in MALLOC_ENV.items():
        monkeypatch.setenv(key, value)
    assert not _thread_in_process(("demo", 32, 8, 2, 1), {})["reused_host_memory"]
