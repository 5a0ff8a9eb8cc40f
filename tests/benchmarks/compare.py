"""This tree's normwatch against an earlier commit's, side by side in one process (CPU).

Run: ``python -m tests.benchmarks.compare REV [--hidden 256 --batch 4 --seq 128]
[--steps 100] [--optimizer] [--stats-every 4]``.

``REV``'s ``normwatch/`` is exported (``git archive``) into a temporary folder as the
package ``normwatch_then``, its imports rewritten to that name. Copies of one tiny
Llama (unwatched, unwatched again: the run's floor, watched by ``REV``'s normwatch, watched
by this tree's; :data:`ORDER`) take the same batches, one step each in turn, in
alternating order; per 10-step block (one flush each) the time inside each normwatch
(its entry points, :data:`overhead.ENTRY_POINTS`) and its step time over the unwatched
one's. Medians over blocks: what a change saved, measured in one machine state (runs of
separate processes on this machine differ by more than most changes).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

import torch

from tests.benchmarks import overhead

ROOT = Path(__file__).resolve().parents[2]
THEN = "normwatch_then"
ORDER = ("plain", "control", "then", "now")
"""The copies, stepping in this order and the reverse by turns: unwatched, unwatched again
(the control: how far two copies of one model differ in this run, the floor under any
ratio it reports), watched by ``REV``'s normwatch, by this tree's."""


def export(rev: str, into: Path) -> ModuleType:
    """``rev``'s ``normwatch`` package, importable as :data:`THEN` from ``into``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "normwatch"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    package = into / THEN
    (into / "normwatch").rename(package)
    for path in package.rglob("*.py"):
        text = path.read_text()
        text = re.sub(r"\bfrom normwatch([. ])", rf"from {THEN}\1", text)
        text = re.sub(r"\bimport normwatch\.", f"import {THEN}.", text)
        text = re.sub(r"^(\s*)import normwatch$", rf"\1import {THEN} as normwatch", text,
                      flags=re.M)
        text = re.sub(r"(['\"])normwatch\.", rf"\1{THEN}.", text)  # lazy imports by name
        text = text.replace("normwatch::", f"{THEN}::")  # its own custom operators
        path.write_text(text)
    sys.path.insert(0, str(into))
    return importlib.import_module(THEN)


def forget(folder: str) -> None:
    """Take the exported package out of the import system again."""
    sys.path.remove(folder)
    for name in [m for m in sys.modules if m == THEN or m.startswith(f"{THEN}.")]:
        del sys.modules[name]


def blocks(values: Iterable[float]) -> list[float]:
    """Means of consecutive 10-step blocks."""
    v = list(values)
    return [statistics.fmean(v[i:i + 10]) for i in range(0, len(v) - 9, 10)]


def compare(rev: str, hidden: int, layers: int, batch: int, seq: int, steps: int,
            optimizer: bool, dtype: torch.dtype = torch.float32, stats_every: int = 4) -> str:
    import normwatch

    with tempfile.TemporaryDirectory() as folder, contextlib.ExitStack() as stack:
        then = export(rev, Path(folder))
        stack.callback(forget, folder)
        totals = {"then": [0.0], "now": [0.0]}
        stack.enter_context(overhead.timed_entry_points(totals["then"], THEN))
        stack.enter_context(overhead.timed_entry_points(totals["now"]))
        torch.manual_seed(0)
        base = overhead.tiny_llama(hidden, layers).to(dtype)
        models = {k: copy.deepcopy(base) for k in ORDER}
        opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
        watches = {k: package.watch(models[k], opts[k] if optimizer else None,
                                    report_dir=None, stats_every=stats_every)
                   for k, package in (("then", then), ("now", normwatch))}
        gen = torch.Generator().manual_seed(0)
        times: dict[str, list[float]] = {k: [] for k in models}
        inside: dict[str, list[float]] = {k: [] for k in watches}
        for i in range(steps + 10):  # the first 10: warm-up
            tokens = torch.randint(0, 1024, (batch, seq), generator=gen)
            for k in ORDER if i % 2 else ORDER[::-1]:
                before = totals[k][0] if k in totals else 0.0
                start = time.perf_counter()
                # no watcher passed: an earlier commit's Watch is another class
                loss = overhead.train_step(models[k], opts[k], tokens, None)
                if k in watches:
                    watches[k].step(loss)
                if i >= 10:
                    times[k].append(time.perf_counter() - start)
                    if k in totals:
                        inside[k].append(totals[k][0] - before)
        for w in watches.values():
            w.close()
    plain = blocks(times["plain"])
    ms = statistics.median(plain) * 1e3
    lines = [f"tiny Llama (hidden {hidden}, {layers} layers, batch {batch} x {seq} tokens, "
             f"{str(dtype).removeprefix('torch.')}"
             f"{', optimizer watched' if optimizer else ''}"
             f"{f', stats_every={stats_every}' if stats_every != 4 else ''}), {steps} steps "
             "each in turn, "
             f"torch {torch.__version__}, {torch.get_num_threads()} threads; unwatched step "
             f"{ms:.1f} ms", "", "| normwatch | inside (ms/step) | share of the step | ratio |",
             "|---|---:|---:|---:|"]
    for k, label in (("control", "none (a second unwatched copy)"), ("then", rev),
                     ("now", "this tree")):
        spent = statistics.median(blocks(inside[k])) * 1e3 if k in inside else 0.0
        ratio = statistics.median(a / b for a, b in zip(blocks(times[k]), plain, strict=True))
        lines.append(f"| {label} | {spent:.2f} | {spent / ms:.2%} | {ratio:.3f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", help="the commit to compare with (e.g. HEAD~3)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=100, help="a multiple of 10")
    parser.add_argument("--optimizer", action="store_true", help="watch the optimizer too")
    parser.add_argument("--stats-every", type=int, default=4)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        default="float32", help="the model's parameters and activations")
    args = parser.parse_args(argv)
    text = compare(args.rev, args.hidden, args.layers, args.batch, args.seq, args.steps,
                   args.optimizer, getattr(torch, args.dtype), args.stats_every)
    print(text)
    return text


if __name__ == "__main__":
    main()
