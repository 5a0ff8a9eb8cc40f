"""The wheel: ``integrations/`` lands as ``normwatch.integrations``, never top level."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from normwatch.measure import fastlane

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_layout(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("normwatch-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "normwatch/integrations/__init__.py" in names
    assert "normwatch/py.typed" in names
    assert "normwatch/_boot/sitecustomize.py" in names  # what `normwatch run` starts
    assert "normwatch/measure/native_rows.c" in names  # the CPU sentinel, compiled at first use
    for source in fastlane.SOURCES:  # the C++ hooks, the same
        assert f"normwatch/measure/{source.name}" in names
    assert not [n for n in names if n.startswith("integrations/")]
    assert not [n for n in names if n.startswith("tests/")]
    meta = next(n for n in names if n.endswith("entry_points.txt"))
    assert "normwatch = normwatch.cli:main" in zipfile.ZipFile(wheel).read(meta).decode()


def test_import_is_side_effect_free() -> None:
    code = ("import sys, normwatch, normwatch.integrations; "
            "heavy = ('lightning', 'transformers', 'prometheus_client'); "
            "print([m for m in heavy if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
