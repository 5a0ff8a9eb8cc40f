"""Compile time of a watched model against the unwatched one, by depth (CPU, inductor).

Run: ``python tests/benchmarks/compile_time.py [--depths 1,3,6,12] [--dim 64]``.

Each row compiles a pre-norm GPT-like ``TinyLM`` (``nn.RMSNorm``) with
``torch.compile(fullgraph=True)`` — the whole model, or each block — and times its first
training step (forward, backward, optimizer step: where the graphs are compiled), after
``torch.compiler.reset()``, watched (``flush_every=8, stats_every=2``) and unwatched, in
alternation. A compile is measured once per configuration (seconds, not milliseconds:
noise matters less than for step times); the ratio is watched / unwatched. Inductor's
caches are off (``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``): a cached graph compiles in a
fraction of a second and would make any comparison meaningless.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")  # before torch loads

import torch

import normwatch
from normwatch.demos.toymodel import TinyLM, lm_loss, synthetic_batch


@contextmanager
def compiled_tinylm(depth: int, dim: int, watched: bool, per_block: bool,
                    **options: Any) -> Iterator[tuple[TinyLM, Callable[..., torch.Tensor],
                                                      normwatch.Watch | None, torch.Tensor]]:
    """A fresh pre-norm ``TinyLM`` (``nn.RMSNorm``), watched with ``options`` or not,
    compiled ``fullgraph=True`` whole or per block, after ``torch.compiler.reset()``:
    ``(model, what runs it, the watch, a batch of 4 x 32 tokens)``; the watch closed and
    the compiler reset after."""
    torch.compiler.reset()
    torch.manual_seed(0)
    model = TinyLM(dim=dim, depth=depth, norm="rmsnorm")
    watch = normwatch.watch(model, report_dir=None, **options) if watched else None
    try:
        if per_block:
            for block in model.blocks:
                block.compile(fullgraph=True)
            run: Callable[..., torch.Tensor] = model
        else:
            run = torch.compile(model, fullgraph=True)
        yield model, run, watch, synthetic_batch(torch.Generator().manual_seed(0), batch=4,
                                                 seq=32)
    finally:
        if watch is not None:
            watch.close()
        torch.compiler.reset()


def first_step_seconds(depth: int, dim: int, watched: bool, per_block: bool) -> float:
    """Seconds of the first compiled training step (compilation included)."""
    with compiled_tinylm(depth, dim, watched, per_block, flush_every=8, stats_every=2) \
            as (model, run, watch, tokens):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        start = time.perf_counter()
        lm_loss(run(tokens), tokens).backward()
        opt.step()
        if watch is not None:
            watch.step()
        return time.perf_counter() - start


def table(header: str, rows: Iterable[str]) -> str:
    """A markdown table of ``header``'s columns (``|``-separated names; a trailing ``:``
    right-aligns), its rows printed as they come."""
    names = [n.strip() for n in header.split("|")]
    lines = ["| " + " | ".join(n.rstrip(":") for n in names) + " |",
             "|" + "|".join("---:" if n.endswith(":") else "---" for n in names) + "|"]
    for row in rows:
        lines.append(row)
        print(row, flush=True)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="1,3,6,12")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--modes", default="whole,per-block")
    args = parser.parse_args(argv)

    def rows() -> Iterator[str]:
        first_step_seconds(1, args.dim, False, False)  # untimed: the process's first compile
        # loads the compiler (~9 s), which would count against the first row's unwatched
        for mode in args.modes.split(","):
            for depth in (int(d) for d in args.depths.split(",")):
                plain = first_step_seconds(depth, args.dim, False, mode == "per-block")
                watched = first_step_seconds(depth, args.dim, True, mode == "per-block")
                yield f"| {mode} | {depth} | {plain:.1f} | {watched:.1f} | " \
                      f"{watched / plain:.2f}x |"

    text = table("compile | blocks: | unwatched (s): | watched (s): | ratio:", rows())
    print(text)
    return text


if __name__ == "__main__":
    main()
