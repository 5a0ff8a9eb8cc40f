"""The wheel: ``integrations/`` lands as ``normwatch.integrations``, never top level."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from normwatch.measure.backends.native import build

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_layout(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("normwatch-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "normwatch/integrations/__init__.py" in names
    assert "normwatch/py.typed" in names
    assert "normwatch/_boot/sitecustomize.py" in names  # what `normwatch run` starts
    for source in (*build.C_SOURCES, *build.C_HEADERS, *build.CPP_SOURCES,
                   *build.CPP_HEADERS):  # the native backend's, compiled at first use
        assert f"normwatch/measure/backends/native/{source.name}" in names
    packages = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "normwatch").rglob("*.py")}
    assert packages <= {n.rsplit("/", 1)[0] for n in names}  # every sub-package
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
