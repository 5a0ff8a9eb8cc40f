"""The benchmark script still runs (tiny sizes, no timing asserted)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

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
