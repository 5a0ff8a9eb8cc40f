"""Every drill of ``normwatch demo`` says what it should, on the CPU and on a GPU.

The CUDA cases run where a GPU is up and skip cleanly elsewhere; the CPU cases hold the
same table, so the expectations themselves are checked on every machine.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from normwatch.demos.demo import DemoResult, pick_device, run_demo
from normwatch.demos.faults import FAULTS
from normwatch.errors import ConfigError

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=CUDA)]

# drill: (steps, warnings and criticals that must fire, the first verdict or None)
EXPECTED: dict[str, tuple[int, set[str], tuple[str, str | None, str] | None]] = {
    "fp16-overflow": (200, {"warning fp16_headroom", "critical fp16_overflow"},
                      ("normalization", "blocks.0.norm1", "fp16_overflow")),
    "eps-zero": (3, {"critical eps_dominance", "critical nonfinite"},
                 ("normalization", "blocks.0.norm1", "eps_dominance")),
    "nan-mlp": (40, {"critical nonfinite"}, ("not_normalization", "norm", "nonfinite")),
    "wrong-dim": (20, {"critical output_mismatch"},
                  ("normalization", "blocks.0.norm1", "output_mismatch")),
    "dtype-mismatch": (20, {"warning dtype_mismatch"}, None),
    "common-mode": (20, {"warning common_mode"}, None),
    "bad-batch": (100, set(), ("not_normalization", None, "data")),
    "lr-spike": (100, set(), ("not_normalization", None, "optimizer")),
    "none": (100, set(), None),
}


def test_the_table_covers_every_drill() -> None:
    assert set(EXPECTED) == set(FAULTS)


def drill(fault: str, device: str, steps: int, report_dir: Path | None = None) -> DemoResult:
    return run_demo(fault, steps=steps, console=Console(file=io.StringIO(), width=200),
                    live=False, report_dir=None if report_dir is None else str(report_dir),
                    device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fault", sorted(EXPECTED))
def test_each_drill_says_what_it_should(fault: str, device: str) -> None:
    steps, loud, verdict = EXPECTED[fault]
    result = drill(fault, device, steps)
    said = {f"{a.severity} {a.kind}" for a in result.alarms if a.severity != "info"}
    assert loud <= said, (loud, said)
    if not loud:
        assert said == set(), said  # quiet drills stay quiet (no false alarm on either device)
    got = result.verdicts[0] if result.verdicts else None
    assert (None if got is None else (got.blame, got.layer, got.cause)) == verdict
    assert result.device.startswith(device)
    if fault == "fp16-overflow":  # the lead the demo exists to show
        warning = result.first_step("warning")
        assert result.nan_step is not None and warning is not None
        assert result.nan_step - warning >= 10


@pytest.mark.parametrize("device", DEVICES)
def test_the_report_and_the_summary_say_where_it_ran(device: str, tmp_path: Path) -> None:
    out = io.StringIO()
    result = run_demo("nan-mlp", steps=40, console=Console(file=out, width=200), live=False,
                      report_dir=str(tmp_path), device=device)
    [folder] = result.reports
    environment = json.loads((folder / "report.json").read_text())["environment"]
    assert environment["ran_on"] == [result.device]
    assert result.device.startswith(f"{device}:0 (") if device == "cuda" else \
        result.device == "cpu"
    assert f"steps on {result.device}" in out.getvalue()


def test_auto_picks_the_gpu_where_one_is_up() -> None:
    assert pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert pick_device("cpu").type == "cpu"
    with pytest.raises(ConfigError, match=r"'device' must be one of auto, cpu, cuda: got 'tpu'"):
        pick_device("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is up")
def test_cuda_without_a_gpu_says_so() -> None:
    with pytest.raises(ConfigError, match=r"'device' is 'cuda' but .*use --device cpu or auto"):
        pick_device("cuda")
