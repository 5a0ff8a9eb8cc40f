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
from collections.abc import Sequence

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")  # before torch loads

import torch

import normwatch
from normwatch.demos.toymodel import TinyLM, lm_loss, synthetic_batch


def first_step_seconds(depth: int, dim: int, watched: bool, per_block: bool) -> float:
    """Seconds of the first compiled training step (compilation included)."""
    torch.compiler.reset()
    torch.manual_seed(0)
    model = TinyLM(dim=dim, depth=depth, norm="rmsnorm")
    watch = normwatch.watch(model, report_dir=None, flush_every=8, stats_every=2) \
        if watched else None
    if per_block:
        for block in model.blocks:
            block.compile(fullgraph=True)
        run = model
    else:
        run = torch.compile(model, fullgraph=True)  # type: ignore[assignment]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tokens = synthetic_batch(torch.Generator().manual_seed(0), batch=4, seq=32)
    start = time.perf_counter()
    lm_loss(run(tokens), tokens).backward()
    opt.step()
    if watch is not None:
        watch.step()
    seconds = time.perf_counter() - start
    if watch is not None:
        watch.close()
    return seconds


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="1,3,6,12")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--modes", default="whole,per-block")
    args = parser.parse_args(argv)
    lines = ["| compile | blocks | unwatched (s) | watched (s) | ratio |",
             "|---|---:|---:|---:|---:|"]
    for mode in args.modes.split(","):
        for depth in (int(d) for d in args.depths.split(",")):
            plain = first_step_seconds(depth, args.dim, False, mode == "per-block")
            watched = first_step_seconds(depth, args.dim, True, mode == "per-block")
            lines.append(f"| {mode} | {depth} | {plain:.1f} | {watched:.1f} | "
                         f"{watched / plain:.2f}x |")
            print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
