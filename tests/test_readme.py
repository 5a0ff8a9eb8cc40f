"""The README and the docs' pages as a reader meets them: short, every link and picture
there, every ``# example:`` snippet runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = {p.relative_to(ROOT).as_posix(): p.read_text() for p in
         [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]}
EXAMPLES = {f"{page}:{m.group(1)}": m.group(0) for page, text in PAGES.items()
            for m in re.finditer(r"# example: (\w+)\n.*?(?=```)", text, flags=re.S)}


def test_the_examples_are_where_a_reader_looks() -> None:
    assert set(EXAMPLES) == {"README.md:quickstart", "docs/integrations/loop.md:quickstart",
                             "docs/integrations/lightning.md:lightning",
                             "docs/integrations/transformers.md:transformers",
                             "docs/integrations/fabric.md:fabric"}
    # the README's quick start is the plain loop page's, word for word
    assert EXAMPLES["README.md:quickstart"] == EXAMPLES["docs/integrations/loop.md:quickstart"]


@pytest.mark.parametrize("name", sorted(k for k in EXAMPLES if not k.startswith("README")))
def test_example_runs(name: str, tmp_path: Path) -> None:
    script = tmp_path / f"example_{name.rsplit(':', 1)[1]}.py"  # never lightning.py: a shadow
    script.write_text(EXAMPLES[name])
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    if name.endswith("quickstart"):
        assert result.stdout.strip().startswith("[")
    if name.endswith("fabric"):
        assert result.stdout.startswith("20 ['blocks.0.norm1'")


def test_the_readme_reads_in_five_minutes() -> None:
    lines = README.splitlines()
    assert len(lines) <= 150, len(lines)
    assert len(README.split()) <= 1500, len(README.split())
    assert "scripts/demo" in README and "scripts/test" in README


def test_every_relative_link_and_picture_of_the_readme_is_there() -> None:
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [t for t in targets if "://" not in t]
    assert {"docs/images/console.svg", "docs/images/report.png"} <= set(local)
    missing = [t for t in local if not (ROOT / t).exists()]
    assert missing == []


def test_layout_lists_every_folder_once() -> None:
    page = PAGES["docs/inside/layout.md"]
    block = page.split("```", 2)[1]
    listed = [line.split()[0] for line in block.strip().splitlines()]
    folders = {f"{p.name}/" for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")
               and p.name not in ("build", "dist", "normwatch-reports", "site")
               and not p.name.endswith(".egg-info")}
    folders |= {f"normwatch/{p.name}/" for p in (ROOT / "normwatch").iterdir()
                if (p / "__init__.py").exists()}
    assert sorted(listed) == sorted(folders)


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_the_short_options_tables_say_what_the_code_does(page: str) -> None:
    from normwatch.config import option_defaults

    defaults = option_defaults()
    table = PAGES[page].split("| option | default | what |", 1)[1].split("\n\n", 1)[0]
    rows = [r for r in table.strip().splitlines()[1:] if r.startswith("|")]
    assert len(rows) >= 8
    for row in rows:
        names, default = (c.strip() for c in row.strip("|").split("|")[:2])
        for name in re.findall(r"`(\w+)`", names):
            assert name in defaults, name
            assert default.strip("`").replace('"', "'") == repr(defaults[name]), (name, default)
