"""The corpus of real idioms (``tests/scripts/``), each run as a subprocess under
``normwatch run``, healthy and with a learning-rate blow-up planted: the model is found
(one attach line, from rank 0 only), every step is counted, a healthy run prints no
warning and writes no report, and the blow-up's verdict is printed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

NORMWATCH = Path(sys.executable).parent / "normwatch"
GPT = Path(__file__).parent / "scripts" / "gpt.py"
STEPS, FAULT_STEP = 24, 16

IDIOMS = {
    "eval-first": {},
    "fp16-gradscaler": {"NW_AMP": "fp16"},
    "accumulate-4": {"NW_ACCUMULATE": "4"},
    "ema-copy": {"NW_EMA": "1"},
    "two-optimizers": {"NW_TWO_OPT": "1"},
}


def run(tmp_path: Path, env: dict[str, str], *launcher: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "NORMWATCH_REPORT_DIR": str(tmp_path / "reports"), "COLUMNS": "200",
            "NW_STEPS": str(STEPS), "NW_FAULT_STEP": str(FAULT_STEP), **env}
    full.pop("PYTHONWARNINGS", None)
    return subprocess.run([str(NORMWATCH), "run", "--flush-every", "4", "--",
                           *(launcher or (sys.executable,)), str(GPT)],
                          cwd=tmp_path, env=full, capture_output=True, text=True, timeout=900,
                          check=False)


def reports(tmp_path: Path) -> list[dict[str, object]]:
    return [json.loads(p.read_text()) for p in sorted((tmp_path / "reports").glob(
        "*/report.json"))]


def check_watched(result: subprocess.CompletedProcess[str]) -> str:
    """The script ran to its end, watched once, every step counted; returns stderr."""
    err = result.stderr
    assert result.returncode == 0, err[-4000:]
    assert "script finished" in result.stdout
    assert len(re.findall(r"^normwatch: watching GPT: 5 norm layers \(5 LayerNorm\), flush "
                          r"every 4 steps", err, re.M)) == 1, err[-4000:]
    assert len(re.findall(rf"^normwatch: GPT: {STEPS} steps watched", err, re.M)) == 1, \
        err[-4000:]
    return err


def check_healthy(result: subprocess.CompletedProcess[str], tmp_path: Path) -> None:
    err = check_watched(result)
    assert "Warning" not in err and not re.search(r" (WARN|CRIT) ", err), err[-4000:]
    assert "alarms: none; verdicts: 0" in err
    assert reports(tmp_path) == []


def check_blow_up(result: subprocess.CompletedProcess[str], tmp_path: Path) -> None:
    err = check_watched(result)
    verdicts = re.findall(r"^normwatch VERDICT .*", err, re.M)
    assert verdicts and "cause optimizer" in verdicts[0], err[-4000:]
    assert len(verdicts) == 1, verdicts  # one incident: what follows the blow-up joins it
    found = reports(tmp_path)
    if verdicts[0].startswith("normwatch VERDICT loss spike"):
        if " CRIT nonfinite: " not in err:
            assert found == []  # a finite spike gets its verdict, not a post-mortem
            return
        # the run went non-finite later: the spike's incident, one post-mortem
        assert [r["trigger"] for r in found] == ["loss_spike"], found
    assert found and found[0]["verdict"]["cause"] == "optimizer"  # type: ignore[index]
    losses = [float(loss) for step, loss in found[0]["loss_history"]  # type: ignore[attr-defined]
              if step < FAULT_STEP]
    assert losses and all(0.5 < loss < 5.0 for loss in losses)  # unscaled, as the script saw
    layers = {la["name"]: la for la in found[0]["layers"]}  # type: ignore[attr-defined]
    assert layers["h.0.ln_1"]["eps"] == pytest.approx(1e-5, rel=1e-3)  # the literal, measured
    assert layers["h.0.ln_1"]["eps_measured"] is True


@pytest.mark.parametrize("fault", [False, True], ids=["healthy", "lr-blow-up"])
@pytest.mark.parametrize("idiom", list(IDIOMS))
def test_an_idiom_is_watched_under_normwatch_run(tmp_path: Path, idiom: str, fault: bool
                                                 ) -> None:
    result = run(tmp_path, {**IDIOMS[idiom], **({"NW_FAULT": "lr"} if fault else {})})
    (check_blow_up if fault else check_healthy)(result, tmp_path)


def test_a_compiled_script_never_recompiles_for_normwatch(tmp_path: Path) -> None:
    # after two warm-up steps the script runs under set_stance("fail_on_recompile"): a
    # recompile caused by the watch (a guard on its Python state) would kill it
    check_blow_up(run(tmp_path, {"NW_COMPILE": "1", "NW_FAULT": "lr"}), tmp_path)


@pytest.mark.parametrize("fault", [False, True], ids=["healthy", "lr-blow-up"])
def test_torchrun_two_ranks_speak_once(tmp_path: Path, fault: bool) -> None:
    result = run(tmp_path, {"NW_FAULT": "lr"} if fault else {},
                 sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", "2")
    if fault:
        check_blow_up(result, tmp_path)
        # both ranks judge alike and write their reports (where the run went non-finite:
        # a finite spike gets its verdict and no post-mortem, on either rank); only rank 0
        # prints its verdicts
        found = reports(tmp_path)
        assert {r["rank"] for r in found} in ({0, 1}, set())
        assert len([r for r in found if r["rank"] == 0]) == \
            len([r for r in found if r["rank"] == 1])
        assert len(re.findall(r"^normwatch VERDICT", result.stderr, re.M)) == \
            max(1, len([r for r in found if r["rank"] == 0]))
    else:
        check_healthy(result, tmp_path)
