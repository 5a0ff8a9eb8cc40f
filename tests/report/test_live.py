"""The live view: a panel rendered on a fixed-width console, in a real pseudo-terminal,
and the plain-line fallback without one."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

import normwatch
from normwatch.demos.toymodel import TinyLM, lm_loss, synthetic_batch
from normwatch.records import Alarm
from normwatch.report.live import ConsoleView, LivePanel, LiveState, sparkline
from tests.factory import snapshot, stats


def render(panel: LivePanel, width: int = 120) -> str:
    console = Console(record=True, width=width, height=24, force_terminal=True,
                      color_system=None, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(panel)
    return console.export_text()


def state(n_layers: int = 60) -> LiveState:
    layers = [stats(f"blocks.{i}.norm", absmax=2.0 + i / 10) for i in range(n_layers)]
    layers[7] = stats("blocks.7.norm", absmax=300.0, fp16_overflow_tokens=3)
    layers[9] = stats("blocks.9.norm", absmax=20.0, nonfinite=2)
    finding = Alarm("fp16_overflow", "critical", "blocks.7.norm", 12, 300.0, 256.0,
                    "blocks.7.norm: max |x| = 300 > 256.", tag="abs")
    line = Alarm("fp16_overflow", "critical", "blocks.7.norm", 12, 300.0, 256.0,
                 "3 layers, blocks.5.norm … blocks.7.norm · max |x| 250–300", tag="abs")
    history = {"blocks.7.norm": (0.5, 5.0, 50.0, 300.0), "blocks.0.norm": (2.0, 2.0)}
    return LiveState(snapshot(12, *layers), [finding], 256.0, history, [line], 12345.0, 100.0)


def test_panel_shows_the_worst_layers_first_and_folds_the_healthy_ones() -> None:
    text = render(LivePanel(state(), height=24, now=103.0))
    assert "normwatch · step 12 · 12,345 tokens/s · last flush 3 s ago" in text
    rows = [line for line in text.splitlines() if line.startswith("|blocks.")]
    assert rows[0].startswith("|blocks.7.norm") and "CRIT" in rows[0]  # worst first
    assert rows[1].startswith("|blocks.9.norm") and "CRIT" in rows[1]  # non-finite
    assert len(rows) < 20  # capped to the height
    folded = next(line for line in text.splitlines() if line.startswith("|+"))
    assert folded.startswith(f"|+{60 - len(rows)} layers") and "OK" in folded
    assert "▁▄▇!" in text  # the trend of blocks.7.norm: up to past the limit
    assert "step 12 CRIT fp16_overflow: 3 layers, blocks.5.norm … blocks.7.norm" in text
    assert "tokens holding NaN/inf" in text
    assert "fp16_" in text and "headroom" in text  # the logged statistics' names


def test_sparkline_scale() -> None:
    # log scale over limit/1000 .. limit, 8 levels: 0.1 of the limit is 2/3 up
    assert sparkline([0.0001, 0.256, 25.6, 256.0, 257.0], 256.0).plain == "▁▁▆█!"


def test_plain_lines_without_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    model = TinyLM(dim=32, depth=1)
    w = normwatch.watch(model, console="lines", flush_every=2, fp16_limit=2.0, report_dir=None)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        tokens = synthetic_batch(gen, batch=2, seq=8)
        lm_loss(model(tokens), tokens).backward()
        w.step()
    w.close()
    err = capsys.readouterr().err
    assert "normwatch · step 2 · max |x|" in err  # one status line (at most every 5 s)
    assert err.count("normwatch · step") == 1
    # past the limit in fp32: info (harmless in this dtype), counted, not printed
    assert "fp16_overflow" not in err and "alarms: 3 info" in err
    assert "\x1b[" not in err  # no cursor movement in a log


def test_plain_lines_print_warnings_and_criticals_only() -> None:
    """Info alarms stay in the panel (and the log and the exit line): a healthy run prints
    none of them."""
    buf = io.StringIO()
    view = ConsoleView(Console(file=buf, width=120, color_system=None), live=False)
    view.alarm(Alarm("eps_dominance", "info", "a", 3, 0.02, 0.01, "a: small tokens"))
    view.alarm(Alarm("fp16_headroom", "warning", "b", 3, 40.0, 1000.0, "b: growing"))
    view.alarm(Alarm("nonfinite", "critical", "c", 3, 1.0, 0.0, "c: NaN"))
    text = buf.getvalue()
    assert "small tokens" not in text and "growing" in text and "NaN" in text


def test_bad_console_option_is_refused() -> None:
    with pytest.raises(normwatch.ConfigError, match="'console' must be None, 'lines' or 'live'"):
        normwatch.watch(TinyLM(dim=16, depth=1), console="yes")


def test_the_demo_redraws_a_live_panel_in_a_pseudo_terminal(tmp_path: Path) -> None:
    master, slave = pty.openpty()
    script = Path(sys.executable).parent / "normwatch"
    env = {**os.environ, "COLUMNS": "120", "LINES": "40", "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen([str(script), "demo", "--fault", "wrong-dim", "--steps", "12"],
                            stdin=slave, stdout=slave, stderr=slave, cwd=tmp_path, env=env)
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 120)
        if not ready:
            break
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=60) == 0
    out = b"".join(chunks).decode(errors="replace")
    assert "\x1b[" in out and "\x1b[2K" in out  # Live redraws lines in place
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out)
    assert text.count("normwatch · step") >= 2  # redrawn as the run goes
    assert "CRIT" in text and "output_mismatch" in text
    assert "summary · wrong-dim" in text


@pytest.mark.parametrize("width", [80, 100, 120])
def test_the_panel_fits_the_width_and_keeps_the_layer_names(width: int) -> None:
    from dataclasses import replace

    long = [stats(f"model.language_model.layers.{i}.post_attention_layernorm", absmax=2.0 + i)
            for i in range(12)]
    s = replace(state(12), snapshot=snapshot(12, *long))
    text = render(LivePanel(s, height=40, now=103.0), width=width)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width
    # every layer named: cut in the middle, its block number kept
    numbers = {int(m.group(1)) for line in lines
               if (m := re.match(r"\|mo\S*?(\d+)\.post_attention_layernorm ", line))}
    assert numbers == set(range(12)), text
    assert "absmax" in text and "headroom" in text  # the columns that matter stay


def test_without_a_terminal_lines_are_not_wrapped(monkeypatch: pytest.MonkeyPatch) -> None:
    from normwatch.report.console import stderr_console

    monkeypatch.delenv("COLUMNS", raising=False)
    console = stderr_console()
    assert not console.is_terminal and console.width == 160 and console.soft_wrap
    monkeypatch.setenv("COLUMNS", "100")
    assert stderr_console().width == 100


def test_a_first_run_says_what_it_builds_while_a_view_is_open(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first run on a machine waits for normwatch's native parts to build: the console
    says so (the C library here, built into an empty cache; the C++ hooks say it the same
    way), and a closed view says nothing more."""
    import shutil

    from normwatch.measure.backends.native import build
    from normwatch.report.live import ConsoleView

    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("NORMWATCH_CACHE", str(tmp_path / "first"))
    out = io.StringIO()
    view = ConsoleView(Console(file=out, width=200), live=False)
    build.library_path()
    assert "normwatch: building its C kernels (once per machine and compiler" in out.getvalue()
    view.close()
    monkeypatch.setenv("NORMWATCH_CACHE", str(tmp_path / "second"))
    build.library_path()
    assert out.getvalue().count("building") == 1
