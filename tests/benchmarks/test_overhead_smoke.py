"""The benchmark script still runs (tiny sizes, no timing asserted)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.benchmarks import overhead


def test_overhead_benchmark_runs() -> None:
    # no compiled mode: compiling takes 20 s of the suite's 15 minutes (the compiled
    # paths are tested in tests/measure/layer/test_compile.py and tests/test_scripts.py)
    modes = ("normwatch (defaults)", "DebugUnderflowOverflow", "detect_anomaly")
    text = overhead.main(["--rounds", "1", "--steps", "1", "--hidden", "64", "--layers", "1",
                          "--batch", "2", "--seq", "16", "--only", *modes])
    for mode in ("unmonitored", *modes):
        assert f"| {mode} |" in text


def test_size_sweep_runs() -> None:
    text = overhead.sweep(40, ((32, 1, 2, 8),))  # 4 phases: each kind on each copy
    row = text.splitlines()[-1]
    assert row.startswith("| d=32, 1 layers, 2x8 tokens |") and row.count("x (") == 3
    assert row.count(" µs, ") == 3 and row.count("%)") == 3


def test_turns_run() -> None:
    text = overhead.turns(32, 1, 2, 8, 10, ("normwatch + optimizer + guard",))
    for loop in ("plain", "clips"):
        assert f"| unmonitored | {loop} | 0.00 | 1.000x |" in text
        assert f"| normwatch + optimizer + guard | {loop} |" in text


def test_parts_run() -> None:
    text = overhead.main(["--parts", "10", "--hidden", "32", "--layers", "1", "--batch", "2",
                          "--seq", "8"])
    for name in overhead.PARTS:
        assert f"| {name} | plain |" in text
    assert "| clips |" not in text


def test_comparison_with_a_commit_runs() -> None:
    from tests.benchmarks import compare

    text = compare.main(["HEAD", "--hidden", "32", "--layers", "1", "--batch", "2", "--seq",
                         "8", "--steps", "10", "--optimizer"])
    assert "| HEAD |" in text and "| this tree |" in text and "optimizer watched" in text
    assert "| none (a second unwatched copy) | 0.00 | 0.00% |" in text


def test_the_floor_benchmark_builds_compiles_and_runs(tmp_path: Path) -> None:
    # its C++ hooks against torch's headers (~20 s to build): skipped without a compiler
    from normwatch.measure.backends.native import build
    from tests.benchmarks import floor

    if shutil.which("c++") is None or build.library() is None:
        pytest.skip("no C++ compiler, or normwatch's C kernels not built")
    module = floor.build(tmp_path)
    ring = floor.setup(module)
    assert floor.compiles(module).startswith(
        "compiled whole: the Python hook ran while tracing [True], the C++ hook in eager 1 ")
    row = floor.run(module, "1", 32, 1, 2, 8, steps=10, warmup=0)
    assert row.startswith("| d=32, 1 layers, 2x8 | 1 | 3 |") and row.count("x |") == 2
    reads, grads = module.counts()
    assert reads >= 30 and grads >= 60  # 3 norms, 10 steps; two gradients a call
    del ring


def test_the_lane_benchmark_runs() -> None:
    from normwatch.measure.backends.native import lane as fastlane
    from tests.benchmarks import lane

    if fastlane.module() is None:
        pytest.skip("no C++ lane here")
    text = lane.run(32, 1, 2, 8, steps=10, stats_every=2, optimizer=True, warmup=0)
    for row in ("| C++ lane |", "| Python hook |", "| C++ lane / Python hook |"):
        assert row in text


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
    text = host.main(["--rounds", "1"])
    assert torch.get_num_threads() == threads  # (it measures on one: given back)
    rows = {line.split(" | ")[1]: line.split(" | ")[2:] for line in text.splitlines()
            if line.startswith("| sentinel only |")}
    lane_forward, python_forward, static_forward = (
        float(rows[k][0]) for k in ("launch lane", "Python hook", "static launch"))
    assert lane_forward < 25 * 2 and python_forward > 25 * 15, rows
    assert static_forward == lane_forward - 25, rows  # (one frame a call less: the launch)
    defaults = {line.split(" | ")[1]: line.split(" | ")[2:] for line in text.splitlines()
                if line.startswith("| defaults")}
    assert float(defaults["static launch"][1]) == 0 < float(defaults["launch lane"][1])
    compiled, python_bodies = rows["compiled, static launch"], rows["compiled, Python bodies"]
    assert float(compiled[0]) == static_forward + 25 and float(compiled[1]) == 2 * 25, rows
    assert float(python_bodies[0]) > 25 * 15, rows
    assert float(defaults["compiled, static launch"][1]) == 2 * 25, defaults
