"""The C++ lane against the Python one, side by side in one process (CPU).

Run: ``python -m tests.benchmarks.lane [--hidden 128 --layers 4 --batch 8 --seq 64]
[--steps 300] [--stats-every 4] [--optimizer]`` (``--stats-every 0``: the sentinel
alone, no gradients).

Three copies of one tiny Llama take the same batches, one step each in turn, in rotating
order: unwatched, watched with the C++ lane (:mod:`normwatch.measure.backends.native.lane`), watched
with the Python hook alone. Per 10-step block, each step time over the unwatched one's,
and the lane's over the Python hook's; medians over blocks.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

import normwatch
from normwatch.measure.backends.native import lane as fastlane
from tests.benchmarks import overhead


def run(hidden: int, layers: int, batch: int, seq: int, steps: int, stats_every: int,
        optimizer: bool, warmup: int = 20) -> str:
    """The table: each watch's ratio and extra µs a step, and the lane's over Python's."""
    if fastlane.module() is None:
        raise RuntimeError("no C++ lane here (no C++ compiler, torch headers or C library)")
    torch.manual_seed(0)
    base = overhead.tiny_llama(hidden, layers)
    models = [copy.deepcopy(base) for _ in range(3)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-4) for m in models]
    tokens = torch.randint(0, 1024, (batch, seq), generator=torch.Generator().manual_seed(0))
    options = {"report_dir": None, "stats_every": stats_every or 1 << 30,
               "gradients": bool(stats_every)}
    watches: list[normwatch.Watch | None] = [None]
    state = fastlane.state
    for lane in (True, False):
        fastlane.state = state if lane else (lambda *args: None)  # type: ignore[assignment]
        try:
            watches.append(normwatch.watch(models[len(watches)],
                                           optimizers[len(watches)] if optimizer else None,
                                           **options))
        finally:
            fastlane.state = state  # type: ignore[assignment]
    times: list[list[float]] = [[], [], []]
    for i in range(warmup + steps):
        for which in ((i + k) % 3 for k in range(3)):
            start = time.perf_counter()
            overhead.train_step(models[which], optimizers[which], tokens, watches[which])
            times[which].append(time.perf_counter() - start)
    for w in watches[1:]:
        w.close()  # type: ignore[union-attr]
    blocks = [[sum(t[j:j + 10]) for j in range(warmup, len(t) - 9, 10)] for t in times]
    pairs = [list(zip(blocks[0], b, strict=True)) for b in blocks]
    unwatched = statistics.median(times[0][warmup:]) * 1e3
    lines = [f"tiny Llama (hidden {hidden}, {layers} layers, batch {batch} x {seq}), "
             f"stats_every={stats_every or 'never'}, optimizer watched: {optimizer}; "
             f"unwatched step {unwatched:.1f} ms", "",
             "| watch | ratio | +µs/step |", "|---|---:|---:|"]
    for which, name in ((1, "C++ lane"), (2, "Python hook")):
        ratio = statistics.median(b / a for a, b in pairs[which])
        extra = statistics.median(b - a for a, b in pairs[which]) / 10 * 1e6
        lines.append(f"| {name} | {ratio:.4f}x | {extra:.0f} |")
    lane = statistics.median(a / b for a, b in zip(blocks[1], blocks[2], strict=True))
    lines.append(f"| C++ lane / Python hook | {lane:.4f}x | |")
    return "\n".join(lines)


def main() -> None:
    parser = overhead.side_by_side_arguments(__doc__.splitlines()[0])
    parser.add_argument("--stats-every", type=int, default=4)
    parser.add_argument("--optimizer", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    print(run(args.hidden, args.layers, args.batch, args.seq, args.steps, args.stats_every,
              args.optimizer))


if __name__ == "__main__":
    main()
