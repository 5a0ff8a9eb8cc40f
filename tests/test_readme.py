"""Every ``# example:`` snippet in the README runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
EXAMPLES = {m.group(1): m.group(0) for m in
            re.finditer(r"# example: (\w+)\n.*?(?=```)", README, flags=re.S)}


def test_readme_has_the_examples() -> None:
    assert set(EXAMPLES) == {"quickstart", "lightning", "transformers"}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_runs(name: str, tmp_path: Path) -> None:
    script = tmp_path / f"readme_{name}.py"  # not lightning.py: it would shadow the package
    script.write_text(EXAMPLES[name])
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    if name == "quickstart":
        assert result.stdout.strip().startswith("[")


def test_layout_lists_every_folder_once() -> None:
    root = Path(__file__).resolve().parents[1]
    block = README.split("## Layout", 1)[1].split("```", 2)[1]
    listed = [line.split()[0] for line in block.strip().splitlines()]
    folders = {f"{p.name}/" for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")
               and p.name not in ("build", "dist", "normwatch-reports")
               and not p.name.endswith(".egg-info")}
    folders |= {f"normwatch/{p.name}/" for p in (root / "normwatch").iterdir()
                if (p / "__init__.py").exists()}
    assert sorted(listed) == sorted(folders)
