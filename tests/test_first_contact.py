"""A new user's first minutes: ``scripts/setup`` on a fresh checkout says what it installs
and how long it takes, and nothing else (no pip or setuptools notice the user did not
cause); the first demo prints no warning."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def checkout(to: Path) -> None:
    """The tracked files, as a fresh clone has them."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            (to / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, to / name)


@pytest.mark.slow
def test_setup_and_the_first_demo_say_only_what_the_user_needs(tmp_path: Path) -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    checkout(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    setup = subprocess.run(["bash", "scripts/setup"], cwd=tmp_path, capture_output=True,
                           text=True, env=env, timeout=900, check=False)
    assert setup.returncode == 0, setup.stderr[-3000:]
    lines = setup.stderr.strip().splitlines()
    assert len(lines) == 2, setup.stderr[-3000:]
    assert lines[0] == ("normwatch setup: installing torch 2.13.0 (CPU build) and normwatch "
                        "into .venv, once (about 30 s)...")
    assert re.fullmatch(r"normwatch setup: done in \d+ s", lines[1]), lines[1]
    assert setup.stdout == ""
    again = subprocess.run(["bash", "scripts/setup"], cwd=tmp_path, capture_output=True,
                           text=True, env=env, timeout=120, check=False)
    assert (again.returncode, again.stdout, again.stderr) == (0, "", "")  # once only
    demo = subprocess.run([str(tmp_path / ".venv" / "bin" / "normwatch"), "demo", "--fault",
                           "none", "--steps", "5", "--device", "cpu", "--report-dir",
                           str(tmp_path / "reports")], cwd=tmp_path, capture_output=True,
                          text=True, env=env, timeout=300, check=False)
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert demo.stderr == "", demo.stderr[-3000:]
    assert "5 steps on cpu" in demo.stdout and "no alarms" in demo.stdout
