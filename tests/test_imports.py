"""The house: stages are sub-packages, imports flow one way, nothing cycles.

The graph is read from the source (every ``import`` statement, at any depth, outside
``if TYPE_CHECKING:``), so a lazy import inside a function counts too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def modules() -> dict[str, Path]:
    found = {}
    for base, package in ((ROOT / "normwatch", "normwatch"),
                          (ROOT / "integrations", "normwatch.integrations")):
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


MODULES = modules()


def imports(name: str) -> set[str]:
    """Modules ``name`` imports (ours and third-party roots), TYPE_CHECKING blocks aside."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for n in ast.walk(node)}
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES}
    return out


def ours(name: str) -> set[str]:
    return {m for m in imports(name) if m in MODULES and m != name}


def reachable(name: str) -> set[str]:
    seen: set[str] = set()
    todo = [name]
    while todo:
        for m in ours(todo.pop()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def test_the_stages_are_sub_packages() -> None:
    for stage in ("measure", "judge", "report", "export", "demos"):
        assert f"normwatch.{stage}" in MODULES
    top = {n for n in MODULES if n.count(".") == 1 and not n.startswith("normwatch.integrations")}
    assert top <= {"normwatch._version", "normwatch.records", "normwatch.catalog",
                   "normwatch.config", "normwatch.errors", "normwatch.watching", "normwatch.cli",
                   "normwatch.pipeline", "normwatch.guarded",
                   "normwatch.__main__", "normwatch.measure", "normwatch.judge",
                   "normwatch.report", "normwatch.export", "normwatch.demos",
                   "normwatch.integrations"}


def test_no_import_cycle() -> None:
    cyclic = sorted(n for n in MODULES if n in reachable(n))
    assert cyclic == []


def test_records_is_a_leaf_and_judge_needs_no_torch() -> None:
    assert ours("normwatch.records") == set()
    assert "normwatch._version" not in reachable("normwatch._version")
    for name in MODULES:
        if name.startswith("normwatch.judge"):
            closure = {name} | reachable(name)
            assert not any(m.split(".")[0] == "torch" for n in closure for m in imports(n)), name
            assert not any(n.startswith(("normwatch.measure", "normwatch.report",
                                         "normwatch.export")) for n in closure), name


def test_the_version_is_declared_once() -> None:
    declared = [n for n, p in MODULES.items() if "__version__ =" in p.read_text()]
    assert declared == ["normwatch._version"]


def test_every_module_imports_alone() -> None:
    """Each module imports in a process where no other module of ours was loaded."""
    names = [n for n in MODULES if n != "normwatch.__main__"]
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    for loaded in [m for m in sys.modules if m.startswith('normwatch')]:\n"
        "        del sys.modules[loaded]\n"
        "    importlib.import_module(name)\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT / "tests", check=False)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_the_launcher_and_the_package_load_no_torch_until_used() -> None:
    """``normwatch run``'s launcher only starts the script: importing the package, the
    command line and its parser, and checking a report folder load no torch (seconds of
    start-up); the first use of ``normwatch.watch`` loads it and is the function."""
    code = (
        "import sys, tempfile\n"
        "import normwatch, normwatch.cli\n"
        "from normwatch.report.document import prepare_report_dir\n"
        "normwatch.cli.build_parser(); prepare_report_dir(tempfile.mkdtemp())\n"
        "assert 'torch' not in sys.modules, 'torch loaded'\n"
        "assert {'watch', 'Watch', 'load_report'} <= set(dir(normwatch))\n"
        "assert callable(normwatch.watch) and normwatch.watch.__name__ == 'watch'\n"
        "assert 'torch' in sys.modules\n"
        "import normwatch.watching\n"
        "assert normwatch.watch is normwatch.watching.watch\n"
        "try:\n"
        "    normwatch.nothing\n"
        "except AttributeError as exc:\n"
        "    assert 'nothing' in str(exc)\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr


ROOMS = {"state": 0, "backends": 1, "model": 2, "step": 2, "optimizer": 3, "layer": 3}
"""``normwatch.measure``'s rooms, in the order imports flow (a room imports its own and the
rooms below it; ``normwatch.measure.measurement`` sits above them all)."""


def _room(name: str) -> str | None:
    parts = name.split(".")
    return parts[2] if len(parts) > 3 and parts[:2] == ["normwatch", "measure"] else None


def test_the_measure_rooms_import_one_way() -> None:
    """The hot path's rooms: what is recorded (state) under how it is computed (backends)
    under the model and step sides, the optimizer side and the layer's ways in; TYPE_CHECKING
    imports too (a cycle there is still one to read)."""
    rooms = {n for n in MODULES if n.startswith("normwatch.measure.")}
    assert {_room(n) for n in rooms} == {*ROOMS, None}
    wrong = []
    for name in rooms:
        room = _room(name)
        tree = ast.parse(MODULES[name].read_text())
        targets = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                   and n.module} | {a.name for n in ast.walk(tree)
                                    if isinstance(n, ast.Import) for a in n.names}
        for target in targets:
            other = _room(target)
            if other is None:
                if target == "normwatch.measure.measurement" and name != target:
                    wrong.append((name, target))
                continue
            if room is None or other == room:
                continue
            if ROOMS[other] >= ROOMS[room]:
                wrong.append((name, target))
    assert wrong == []


def test_the_measure_rooms_say_what_they_own_and_stay_small() -> None:
    """Each room's ``__init__`` says what it owns; no source file of the hot path is over
    ~500 lines (Python, C, C++)."""
    base = ROOT / "normwatch" / "measure"
    for room in ROOMS:
        assert ast.get_docstring(ast.parse((base / room / "__init__.py").read_text())), room
    sizes = {str(p.relative_to(base)): len(p.read_text().splitlines())
             for p in base.rglob("*") if p.suffix in (".py", ".c", ".cpp", ".h")}
    assert {p: n for p, n in sizes.items() if n > 520} == {}


def test_the_docstrings_cross_references_resolve() -> None:
    """Every ``:mod:``/``:class:``/``:func:``/``:meth:``/``:data:``/``:attr:`` reference to
    normwatch in the source names something that exists (a module moved or a function
    renamed leaves none behind)."""
    import importlib
    import re

    pattern = re.compile(r":(?:mod|class|func|meth|data|attr):`~?(normwatch[\w.]*"
                         r"(?:\.\s*\n\s*[\w.]+)*)`")
    refs = {(name, re.sub(r"\s+", "", m.group(1))) for name, path in MODULES.items()
            for m in pattern.finditer(path.read_text())}
    unresolved = []
    for where, ref in sorted(refs):
        parts = ref.split(".")
        for i in range(len(parts), 0, -1):
            try:
                obj: object = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            try:
                for attribute in parts[i:]:
                    obj = getattr(obj, attribute)
            except AttributeError:
                unresolved.append((where, ref))
            break
        else:
            unresolved.append((where, ref))
    assert unresolved == []
