"""The documentation site builds as a reader gets it: MkDocs with warnings as errors (a
broken link, a missing anchor, an unknown reference fail), and its generated references
hold every option, metric, alarm kind and command of the code."""

from __future__ import annotations

import html
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("mkdocs", reason="the docs extras are not installed")


def text(path: Path) -> str:
    """A built page as plain text."""
    page = re.sub(r"<[^>]+>", " ", path.read_text(encoding="utf-8"))
    return re.sub(r"\s+", " ", html.unescape(page))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d",
                             str(out)], cwd=ROOT, capture_output=True, text=True, env=env,
                            timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "WARNING" not in result.stderr, result.stderr[-4000:]
    return out


def test_every_option_is_in_the_generated_reference(site: Path) -> None:
    from normwatch.config import ENV_PREFIX, option_defaults

    page = text(site / "reference" / "options" / "index.html")
    for name, default in option_defaults().items():
        assert re.search(rf"\b{name}\b", page), name
        if name != "sinks":
            assert f"{ENV_PREFIX}{name.upper()}" in page, name
        assert repr(default) in page, (name, default)


def test_every_metric_is_in_the_generated_reference(site: Path) -> None:
    from normwatch.catalog import TABLE

    page = text(site / "reference" / "metrics" / "index.html")
    for s in TABLE:
        if s.metric is not None:
            suffix = "_total" if s.metric.type == "counter" else ""
            assert f"normwatch_{s.metric.name}{suffix}" in page, s.metric.name
    for name in ("normwatch_info", "normwatch_step", "normwatch_loss", "normwatch_alarms_total",
                 "normwatch_optimizer_update_ratio", "normwatch_guard_skipped_steps_total",
                 "normwatch_gradient_depth_ratio", "normwatch_last_flush_timestamp_seconds"):
        assert name in page, name
    for key in ("normwatch/absmax_max", "normwatch/fp16_headroom_min", "normwatch/verdicts",
                "normwatch/alarms/critical", "normwatch/<layer>/absmax"):
        assert key in page, key


def test_every_alarm_kind_has_its_section(site: Path) -> None:
    from normwatch.records import ALARM_KINDS

    page = (site / "concepts" / "alarms" / "index.html").read_text(encoding="utf-8")
    for kind in ALARM_KINDS:
        assert f'id="{kind}"' in page, kind


def test_the_command_line_reference_is_the_parser(site: Path) -> None:
    from normwatch.demos.faults import FAULTS

    page = text(site / "reference" / "cli" / "index.html")
    for flag in ("--fault", "--device", "--steps", "--html", "--flush-every", "--fp16-limit"):
        assert flag in page, flag
    drills = text(site / "getting-started" / "index.html")
    for name in FAULTS:
        assert name in drills, name


def test_the_api_reference_is_the_docstrings(site: Path) -> None:
    page = text(site / "reference" / "api" / "index.html")
    for name in ("normwatch.watching.watch", "normwatch.watching.Watch", "checkpoint_ok",
                 "normwatch.records.Snapshot", "load_report", "NormWatchCallback",
                 "NormWatchTrainerCallback", "register_norm"):
        assert name in page, name
    assert ":meth:" not in page and ":class:" not in page  # reST read as Markdown


def test_the_site_fetches_nothing_from_elsewhere(site: Path) -> None:
    index = (site / "index.html").read_text(encoding="utf-8")
    assert "fonts.googleapis.com" not in index
    assert (site / "images" / "console.svg").exists()


def test_the_pictures_are_remade_from_a_real_run(tmp_path: Path) -> None:
    """``scripts/pictures`` (docs/_tools/pictures.py) on the demo's fp16 drill."""
    sys.path.insert(0, str(ROOT / "docs" / "_tools"))
    try:
        import pictures
    finally:
        sys.path.pop(0)
    made = pictures.main(tmp_path)
    console = (tmp_path / "console.svg").read_text()
    assert "CRIT" in console and "fp16_overflow" in console and "blocks.0.norm1" in console
    panels = json.loads(pictures.DASHBOARD.read_text())["panels"]
    assert made["panels"] == [p["title"] for p in panels]
    drawn = (tmp_path / "grafana-panels.svg").read_text()
    assert drawn.count("<polyline") >= len(panels) - 1  # every panel but the wall clock's
    if "report" in made:
        assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in ("console.svg", "report.png", "grafana-panels.svg"):  # the committed ones
        assert (ROOT / "docs" / "images" / name).stat().st_size > 10_000, name
