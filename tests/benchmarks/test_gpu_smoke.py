"""The CUDA path's benchmarks still run on a CPU (tiny sizes, no timing asserted): apart
from the CPU's (test_overhead_smoke.py), so that the suite's workers share them."""

from __future__ import annotations

import re

import pytest
import torch


def test_the_gpu_benchmark_runs_on_a_cpu() -> None:
    """Every part of ``gpu.py`` a CPU can run, at tiny sizes: a device session's minutes
    are not lost to a broken script (the CUDA-only parts say so)."""
    from tests.benchmarks import gpu

    text = gpu.main(["--device", "cpu", "--tiny"])
    assert "Traceback" not in text, text
    for part in gpu.PARTS:
        assert f"## {part} (" in text
    for mode in (*gpu.EAGER, "compiled + normwatch (defaults)",
                 "compiled + normwatch + optimizer + guard"):
        assert f"| {mode} |" in text
    assert "| compiled | " in text and "(reduce-overhead)" not in text  # CPU: no CUDA graphs
    assert text.count("(CUDA only: skipped)") == sum(cuda for _, cuda in gpu.PARTS.values())
    assert "| added per norm call" in text and "by a static launch" in text
    # nanoGPT's loop run plain and under `normwatch run`, each in a process of its own
    assert re.search(r"^\| eager \| [\d.]+ \| [\d.]+ \| [\d.]+x \|$", text, re.M), text


def test_the_cuda_paths_host_benchmark_runs() -> None:
    """``host.py``: the launch lane's sentinel forward runs one Python frame of
    normwatch's a norm call (its launch's), the Python hook's some twenty; with static
    launches none: a sentinel step's forward runs the step's bookkeeping alone, a
    full-tier backward no frame at all. Compiled, with static launches, a call runs its
    operator's frame alone and so does each gradient on either tier (two a norm: the
    output's, with the one through the norm, and the hidden state's); with Python's
    bodies some twenty a call."""
    from normwatch.measure.backends.native import lane as fastlane
    from normwatch.measure.backends.triton_kernel import usable
    from tests.benchmarks import host

    if fastlane.module() is None or not usable():
        pytest.skip("no C++ lane or no Triton here")
    threads = torch.get_num_threads()
    text = host.main(["--rounds", "1", "--layers", "2"])  # (n norms a step)
    assert torch.get_num_threads() == threads  # (it measures on one: given back)
    n = 5
    rows = {line.split(" | ")[1]: line.split(" | ")[2:] for line in text.splitlines()
            if line.startswith("| sentinel only |")}
    lane_forward, python_forward, static_forward = (
        float(rows[k][0]) for k in ("launch lane", "Python hook", "static launch"))
    assert python_forward > static_forward + n * 15, rows
    assert static_forward == lane_forward - n, rows  # (one frame a call less: the launch)
    defaults = {line.split(" | ")[1]: line.split(" | ")[2:] for line in text.splitlines()
                if line.startswith("| defaults")}
    assert float(defaults["static launch"][1]) == 0 < float(defaults["launch lane"][1])
    compiled, python_bodies = rows["compiled, static launch"], rows["compiled, Python bodies"]
    assert float(compiled[0]) == static_forward + n and float(compiled[1]) == 2 * n, rows
    assert float(python_bodies[0]) > n * 15, rows
    assert float(defaults["compiled, static launch"][1]) == 2 * n, defaults
