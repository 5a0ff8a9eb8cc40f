"""The ``normwatch`` console script, run as a user would run it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(sys.executable).parent / "normwatch"


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "120"}
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, check=False)


def test_demo_default_catches_the_overflow_before_the_nan() -> None:
    start = time.monotonic()
    result = run("demo")
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "fault fp16-overflow" in out
    assert "WARN fp16_headroom" in out and "CRIT fp16_overflow" in out
    assert out.index("WARN fp16_headroom") < out.index("CRIT fp16_overflow") \
        < out.index("CRIT nonfinite")
    assert "loss became non-finite at step" in out
    assert "normwatch warned" in out and "steps before the NaN loss" in out
    assert "|blocks.0.norm1" in out  # the final health table
    # alarms grouped by kind: one entry per kind and flush, not one per layer
    alarm_lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert 0 < len(alarm_lines) <= 15, alarm_lines
    assert any("5 layers, blocks.0.norm1 … norm" in line for line in alarm_lines)
    assert "tokens holding NaN/inf" in out  # the table's legend
    # one incident, one post-mortem (it was four: critical alarm, output mismatch,
    # gradient non-finite, NaN), named after the critical alarm that opened it
    reports = set(re.findall(r"normwatch-reports\S*-step(\d+)-(\w+)", out))
    assert len(reports) == 1 and next(iter(reports))[1] == "critical_alarm", reports
    assert "(fp16_headroom at step" in out  # the lead time counts the fault's own warning
    assert elapsed < 60
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("fault,expected", [
    ("none", "no alarms: every norm layer stayed healthy"),
    ("wrong-dim", "CRIT output_mismatch"),
    ("eps-zero", "CRIT eps_dominance"),
])
def test_demo_faults(fault: str, expected: str) -> None:
    result = run("demo", "--fault", fault, "--steps", "30")
    assert result.returncode == 0, result.stderr
    assert expected in result.stdout


@pytest.mark.parametrize("args,message", [
    (("demo", "--fault", "bogus"), "argument --fault: invalid choice: 'bogus'"),
    (("demo", "--steps", "0"), "argument --steps: expected an integer >= 1: got 0"),
    (("demo", "--steps", "many"), "argument --steps: expected an integer >= 1: got 'many'"),
    (("explode",), "invalid choice: 'explode'"),
    ((), "the following arguments are required: COMMAND"),
])
def test_bad_arguments_exit_non_zero_with_a_clear_message(args: tuple[str, ...],
                                                          message: str) -> None:
    result = run(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args", [("--help",), ("demo", "--help")])
def test_help_everywhere(args: tuple[str, ...]) -> None:
    result = run(*args)
    assert result.returncode == 0 and "usage: normwatch" in result.stdout


def test_python_dash_m_and_version() -> None:
    result = subprocess.run([sys.executable, "-m", "normwatch", "--version"],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0 and result.stdout.startswith("normwatch 0.")


def test_demo_device_is_said_and_cuda_without_a_gpu_is_a_clean_error() -> None:
    import torch

    result = run("demo", "--device", "cpu", "--fault", "none", "--steps", "3")
    assert result.returncode == 0, result.stderr
    assert "· on cpu" in result.stdout and "3 steps on cpu" in result.stdout
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is up: tests/demos/test_drills.py runs the drills on it")
    result = run("demo", "--device", "cuda")
    assert result.returncode == 2
    assert "normwatch demo: error: 'device' is 'cuda' but" in result.stderr
    assert "Traceback" not in result.stderr
