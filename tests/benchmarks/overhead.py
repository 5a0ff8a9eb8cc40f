"""Step-time overhead of normwatch on a tiny ``transformers`` Llama training step (CPU).

Run: ``python tests/benchmarks/overhead.py [--rounds N] [--steps K]`` (or ``--sweep``,
``--turns``, ``--parts`` STEPS).

Every mode trains its own copy of the same model. Modes are interleaved round by round
in one process, in a shuffled order, and each round's step time is divided by the
unmonitored step time *of the same round*; the table reports the median of those
paired ratios (noisy machines: medians, never single timings). A round runs each mode
for one flush interval (10 steps), so every sample includes exactly one flush.

Compiled modes (``torch.compile`` of the whole model, inductor) are divided by the
compiled unmonitored step of the same round; their rows also give the graphs compiled,
the graph breaks, and the graphs compiled after the warm-up round (recompiles).

``--sweep STEPS`` (the size sweep: :data:`SWEEP` x :data:`SWEPT`), ``--turns STEPS`` and
``--parts STEPS`` pair finer: the modes step in turn, one step each (:func:`in_turn`).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

import normwatch

Row = tuple[str, float, float, "tuple[int, int, int, int, float] | None"]
"""``(mode, median step ms, median paired ratio, compiled: (graphs, breaks, recompiles,
cudagraph skips, first step s))``"""

BASELINES = {None: "unmonitored", "default": "compiled",
             "reduce-overhead": "compiled (reduce-overhead)"}
"""Each compile mode's unmonitored mode (``None``: eager): what its modes are divided by."""


@dataclass
class Mode:
    name: str
    attach: Callable[[torch.nn.Module, torch.optim.Optimizer], object]
    context: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext
    compiled: str | None = None
    """``torch.compile``'s mode for this mode's model (``None``: eager)."""
    times: list[float] = field(default_factory=list)
    graphs: int = 0
    breaks: int = 0
    recompiles: int = 0
    skips: int = 0
    first: float = 0.0
    """Seconds of its first step (a compiled mode's compile included)."""


@dataclass(frozen=True)
class Setup:
    """What the modes of :func:`run` train, and where: each mode a copy of ``model()``
    on ``device``, on batches of ``batch`` x ``seq`` tokens below ``vocab``; ``autocast``:
    the forward under ``torch.autocast`` to that dtype (fp32 master weights); ``fused``:
    a fused AdamW."""

    model: Callable[[], torch.nn.Module]
    batch: int
    seq: int
    vocab: int = 1024
    device: str = "cpu"
    autocast: torch.dtype | None = None
    fused: bool = False

    def label(self) -> str:
        with torch.device("meta"):  # counted, not built
            params = sum(p.numel() for p in self.model().parameters()) / 1e6
        return (f"Llama {params:.1f}M on {self.device}"
                f"{f', {self.autocast} autocast' if self.autocast else ''}"
                f"{', fused AdamW' if self.fused else ''}, {self.batch} x {self.seq} tokens")


def tiny_llama(hidden: int, layers: int, vocab: int = 1024, intermediate: int | None = None,
               heads: int = 8, kv_heads: int = 4) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden,
                         intermediate_size=intermediate or 2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=4096)
    return LlamaForCausalLM(config)


def debug_underflow_overflow(model: torch.nn.Module) -> object:
    from transformers.debug_utils import DebugUnderflowOverflow

    return DebugUnderflowOverflow(model)


@contextlib.contextmanager
def anomaly() -> Iterator[None]:
    with torch.autograd.detect_anomaly(check_nan=True):
        yield


def watching(**options: object) -> Callable[[torch.nn.Module, torch.optim.Optimizer], object]:
    return lambda m, o: normwatch.watch(m, report_dir=None, **options)


def optimizer_and(**options: object) -> Callable[[torch.nn.Module, torch.optim.Optimizer],
                                                  object]:
    return lambda m, o: normwatch.watch(m, o, report_dir=None, **options)


def guarded(m: torch.nn.Module, o: torch.optim.Optimizer) -> object:
    return normwatch.watch(m, o, report_dir=None, guard=True)


def modes() -> list[Mode]:
    return [
        Mode("unmonitored", lambda m, o: None),
        Mode("unmonitored (control)", lambda m, o: None),
        Mode("normwatch (defaults)", watching()),
        Mode("normwatch + optimizer", optimizer_and()),
        Mode("normwatch + optimizer + guard", guarded),
        Mode("normwatch stats_every=1", watching(stats_every=1)),
        Mode("normwatch stats_every=8", watching(stats_every=8)),
        Mode("normwatch gradients=False", watching(gradients=False)),
        Mode("normwatch stats_every=1 gradients=False", watching(stats_every=1, gradients=False)),
        Mode("normwatch sentinel only", watching(stats_every=1 << 30, gradients=False)),
        Mode("normwatch kernel=torch", watching(kernel="torch")),
        Mode("normwatch + optimizer stats_every=8", optimizer_and(stats_every=8)),
        Mode("normwatch + optimizer gradients=False", optimizer_and(gradients=False)),
        Mode("normwatch + optimizer stats_every=1", optimizer_and(stats_every=1)),
        Mode("DebugUnderflowOverflow", lambda m, o: debug_underflow_overflow(m)),
        Mode("detect_anomaly", lambda m, o: None, anomaly),
        Mode("compiled", lambda m, o: None, compiled="default"),
        Mode("compiled + normwatch (defaults)", watching(), compiled="default"),
        Mode("compiled + normwatch + optimizer", optimizer_and(), compiled="default"),
        Mode("compiled + normwatch + optimizer + guard", guarded, compiled="default"),
        Mode("compiled + normwatch gradients=False", watching(gradients=False),
             compiled="default"),
        Mode("compiled + normwatch stats_every=1", watching(stats_every=1), compiled="default"),
        Mode("compiled + normwatch output_check_every=0", watching(output_check_every=0),
             compiled="default"),
        Mode("compiled (reduce-overhead)", lambda m, o: None, compiled="reduce-overhead"),
        Mode("compiled (reduce-overhead) + normwatch (defaults)", watching(),
             compiled="reduce-overhead"),
        Mode("compiled (reduce-overhead) + normwatch + optimizer", optimizer_and(),
             compiled="reduce-overhead"),
    ]


def _compile_counts() -> tuple[int, int, int]:
    """Graphs compiled, graph breaks and cudagraph skips so far in this process."""
    from torch._dynamo.utils import counters

    return (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()),
            counters["inductor"]["cudagraph_skips"])


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor,
               watcher: object, clip: bool = False,
               context: Callable[[], contextlib.AbstractContextManager[object]] =
               contextlib.nullcontext, autocast: torch.dtype | None = None) -> torch.Tensor:
    """One training step of the benchmark loop, its loss returned; ``clip``: clip the
    gradients first (a loop without a normwatch watch calls torch's own
    ``clip_grad_norm_``, not the wrapper another mode's watch installed in this process);
    ``autocast``: the forward under ``torch.autocast`` to that dtype."""
    with context(), torch.autocast(tokens.device.type, autocast or torch.float32,
                                   enabled=autocast is not None):
        loss = model(tokens, labels=tokens, use_cache=False).loss
        loss.backward()
    if clip:
        clip_grad_norm_ = torch.nn.utils.clip_grad_norm_
        if not isinstance(watcher, normwatch.Watch):
            clip_grad_norm_ = getattr(clip_grad_norm_, "__normwatch_real__", clip_grad_norm_)
        clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if isinstance(watcher, normwatch.Watch):
        watcher.step(loss)
    return loss


def run(rounds: int, steps: int, setup: Setup, only: list[str] | None = None,
        clip: bool = False) -> list[Row]:
    """Return ``(mode, median step ms, median paired ratio, compile counts)`` rows (a
    watched mode's graphs serve the next watched mode of its compile mode, so the first
    of them has the compile: its first step against its baseline's is the compile time);
    ``only``: these modes and their baselines (``None``: all, but CUDA graphs only on a
    GPU); ``clip``: every loop clips its gradients (``clip_grad_norm_``) before the step."""
    torch.manual_seed(0)
    base = setup.model().to(setup.device)
    chosen = [m for m in modes() if m.name in only] if only is not None else [
        m for m in modes() if m.compiled != "reduce-overhead" or setup.device != "cpu"]
    wanted = {BASELINES[m.compiled] for m in chosen} | {m.name for m in chosen}
    selected = [m for m in modes() if m.name in wanted]
    runs = []
    for mode in selected:
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=setup.fused or None)
        watcher = mode.attach(model, opt)
        runs.append((mode, torch.compile(model, mode=mode.compiled) if mode.compiled
                     else model, opt, watcher))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, setup.vocab, (setup.batch, setup.seq), generator=gen)
    tokens = tokens.to(setup.device)
    cuda = tokens.device.type == "cuda"
    order = list(range(len(runs)))
    for r in range(rounds + 1):  # round 0 warms up (and compiles) and is discarded
        if r:  # round 0 in order: each baseline compiles before its watched modes
            random.Random(r).shuffle(order)
        for i in order:
            mode, model, opt, watcher = runs[i]
            counts = _compile_counts()
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            for k in range(steps):
                train_step(model, opt, tokens, watcher, clip, mode.context, setup.autocast)
                if r == 0 and k == 0:
                    if cuda:
                        torch.cuda.synchronize()
                    mode.first = time.perf_counter() - start
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            graphs, breaks, skips = (a - b for a, b in zip(_compile_counts(), counts,
                                                           strict=True))
            mode.graphs += graphs
            mode.breaks += breaks
            mode.skips += skips
            if r:
                mode.times.append(elapsed / steps)
                mode.recompiles += graphs
    baselines = {m.compiled: m.times for m, *_ in runs if m.name == BASELINES[m.compiled]}
    rows = []
    for mode, _, _, watcher in runs:
        if isinstance(watcher, normwatch.Watch):
            watcher.close()
        base = baselines[mode.compiled]
        ratios = [t / b for t, b in zip(mode.times, base, strict=True)]
        counts = None if mode.compiled is None else (mode.graphs, mode.breaks,
                                                       mode.recompiles, mode.skips, mode.first)
        rows.append((mode.name, statistics.median(mode.times) * 1e3, statistics.median(ratios),
                     counts))
    return rows


def table(rows: list[Row]) -> str:
    """:func:`run`'s rows as a markdown table (compiled modes: what was compiled, and the
    first step's seconds, its compile included)."""
    lines = ["| mode | median step (ms) | median paired ratio | graphs / breaks / recompiles / "
             "cudagraph skips | first step (s) |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {name} | {ms:.1f} | {ratio:.3f}x | "
              f"{'' if c is None else ' / '.join(map(str, c[:4]))} | "
              f"{'' if c is None else f'{c[4]:.1f}'} |"
              for name, ms, ratio, c in rows]
    return "\n".join(lines)


SWEEP = ((128, 4, 8, 64), (256, 4, 4, 128), (512, 8, 4, 128), (1024, 4, 4, 128))
"""``(hidden, layers, batch, seq)``: the model sizes of ``--sweep``."""
SWEPT = ("normwatch (defaults)", "normwatch + optimizer", "normwatch stats_every=1")


ENTRY_POINTS = (
    ("normwatch.measure.layer.hooks|normwatch.measure.hooks", "LayerHook", ("__call__",)),
    ("normwatch.measure.layer.compiled|normwatch.measure.traced", "CompiledPath", ("pre",)),
    ("normwatch.measure.layer.gradients|normwatch.measure.gradients", "GradHooks",
     ("_out", "_in", "_hidden", "_node", "_both", "_weight_grad")),
    ("normwatch.measure.layer.gradients|normwatch.measure.gradients", "_Through", ("_part",)),
    ("normwatch.measure.measurement", "Measurement", ("_forward_begins", "_forward_ends")),
    ("normwatch.measure.optimizer.updates|normwatch.measure.updates", "UpdateMonitor",
     ("_pre", "_post")),
    ("normwatch.measure.optimizer.guard|normwatch.measure.guard", "StepGuard",
     ("_flags", "_decide_on_host")),
    ("normwatch.watching", "Watch", ("step",)),
    ("normwatch.measure.optimizer.clipping|normwatch.measure.clipping", None, ("_record",)),
)
"""Everything normwatch runs during a training step: its hooks, ``watch.step``, and what
it records of the loop's ``clip_grad_norm_`` (``None``: a module's function; ``a|b``: the
module where it is now, then where an earlier commit had it). The C++ lanes' own time is
not in it, nor the Python they call (``LayerHook._tail`` on an interval's first call, the
fallbacks)."""


@contextlib.contextmanager
def timed_entry_points(total: list[float], package: str = "normwatch") -> Iterator[None]:
    """Add the seconds spent inside :data:`ENTRY_POINTS` to ``total[0]`` (outermost
    calls only: a hook running inside ``watch.step`` is counted once); ``package``: a copy
    of normwatch under another name (an earlier commit's: the entry points it lacks are
    skipped)."""
    import importlib

    depth = [0]
    saved = []
    for modules, owner, names in ENTRY_POINTS:
        imported = None
        for module in modules.split("|"):
            try:
                imported = importlib.import_module(module.replace("normwatch", package, 1))
                break
            except ImportError:
                continue
        if imported is None:
            continue
        cls = imported if owner is None else getattr(imported, owner, None)
        for name in names:
            real = getattr(cls, name, None)
            if real is None:
                continue

            def timed(*args: object, _real: Callable[..., object] = real, **kw: object) -> object:
                depth[0] += 1
                start = time.perf_counter()
                try:
                    return _real(*args, **kw)
                finally:
                    depth[0] -= 1
                    if depth[0] == 0:
                        total[0] += time.perf_counter() - start
            saved.append((cls, name, real))
            setattr(cls, name, timed)
    try:
        yield
    finally:
        for cls, name, real in saved:
            setattr(cls, name, real)


def sweep(steps: int, sizes: tuple[tuple[int, int, int, int], ...] = SWEEP,
          clip: bool = False) -> str:
    """Per model size, each :data:`SWEPT` mode stepping in turn with the unmonitored loop
    (:func:`in_turn`): the median ratio of 10-step blocks, and what the mode spends inside
    normwatch per norm per step (µs; a Llama has ``2 * layers + 1`` norms) and as a share
    of the unmonitored step."""
    head = " | ".join(f"{m.removeprefix('normwatch ')}" for m in SWEPT)
    lines = [f"| model | unmonitored step (ms) | {head} |",
             "|---|---:|" + "---:|" * len(SWEPT)]
    for hidden, layers, batch, seq in sizes:
        got = in_turn(hidden, layers, batch, seq, steps, SWEPT, (clip,))
        plain = got["unmonitored", clip].step
        norms = 2 * layers + 1
        cells = [f"{got[m, clip].ratio:.3f}x ({got[m, clip].inside * 1e3 / norms:.0f} µs, "
                 f"{got[m, clip].inside / plain:.2%})" for m in SWEPT]
        lines.append(f"| d={hidden}, {layers} layers, {batch}x{seq} tokens | {plain:.1f} | "
                     f"{' | '.join(cells)} |")
    return "\n".join(lines)


TURNED = ("normwatch (defaults)", "normwatch + optimizer", "normwatch + optimizer + guard")
"""The modes of ``--turns``."""
PARTS = ("normwatch sentinel only", "normwatch (defaults)", "normwatch gradients=False",
         "normwatch + optimizer", "normwatch + optimizer stats_every=8",
         "normwatch + optimizer gradients=False", "normwatch + optimizer stats_every=1")
"""The modes of ``--parts``: what each part of the watch costs (the sentinel tier alone,
then the full tier's gradients, the optimizer, the full tier's cadence)."""


@dataclass(frozen=True)
class Turned:
    """A mode's medians over the 10-step blocks of :func:`in_turn`."""

    ratio: float
    """Its block's time over the unmonitored loop's of the same kind and block."""
    inside: float
    """ms per step inside normwatch (:data:`ENTRY_POINTS`)."""
    step: float
    """ms per step."""


def in_turn(hidden: int, layers: int, batch: int, seq: int, steps: int,
            names: tuple[str, ...], loops: tuple[bool, ...] = (False, True)
            ) -> dict[tuple[str, bool], Turned]:
    """Every mode of ``names`` with the loop plain and clipping (``clip_grad_norm_``; or
    as ``loops`` says), and the unmonitored loops, in one process, stepping in turn one
    step each on the same batch (a new one each step), in an order reversed every other
    step (the same machine state for all: the pairing is per step, not per block).

    Each kind runs on a copy of one model, and the kinds rotate over the copies: in
    phase ``p`` kind ``j`` is attached to copy ``(j + p) % n`` (watches closed and
    attached again), so that every kind steps every copy for about as many 10-step
    blocks. Two copies of one model differ by up to ~1 % for a whole run on this
    machine (where their memory lies), as much as what is measured; rotated, that is
    spread over every kind alike. Per mode and loop: the medians over 10-step blocks
    (one flush each; ``steps``: a multiple of 10), each phase after 10 warm-up steps."""
    kinds = [*(("unmonitored", clip) for clip in loops),
             *((name, clip) for clip in loops for name in names)]
    n = len(kinds)
    attach = {m.name: m.attach for m in modes()}
    torch.manual_seed(0)
    base = tiny_llama(hidden, layers)
    models = [copy.deepcopy(base) for _ in kinds]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-4) for m in models]
    gen = torch.Generator().manual_seed(0)
    total = [0.0]
    inside: dict[tuple[str, bool], list[float]] = {k: [] for k in kinds}
    whole: dict[tuple[str, bool], list[float]] = {k: [] for k in kinds}
    blocks = steps // 10
    with timed_entry_points(total):
        for phase in range(min(n, blocks)):
            runs = []
            for j, key in enumerate(kinds):
                c = (j + phase) % n
                runs.append((key, models[c], opts[c], attach[key[0]](models[c], opts[c])))
            taken = 10 * (blocks // n + (phase < blocks % n))
            for i in range(taken + 10):  # 10 warm-up steps (the first interval)
                tokens = torch.randint(0, 1024, (batch, seq), generator=gen)
                for key, model, opt, watcher in runs if i % 2 else runs[::-1]:
                    before, start = total[0], time.perf_counter()
                    train_step(model, opt, tokens, watcher, key[1])
                    if i >= 10:
                        inside[key].append(total[0] - before)
                        whole[key].append(time.perf_counter() - start)
            for _, _, _, watcher in runs:
                if isinstance(watcher, normwatch.Watch):
                    watcher.close()
    spans = [slice(j, j + 10) for j in range(0, 10 * blocks, 10)]
    return {key: Turned(
        statistics.median(sum(whole[key][b]) / sum(whole["unmonitored", key[1]][b])
                          for b in spans),
        statistics.median(sum(inside[key][b]) / len(inside[key][b]) * 1e3 for b in spans),
        statistics.median(whole[key]) * 1e3) for key in kinds}


def turns(hidden: int, layers: int, batch: int, seq: int, steps: int,
          names: tuple[str, ...] = TURNED, loops: tuple[bool, ...] = (False, True)) -> str:
    """:func:`in_turn`'s table: per mode and loop, the median time inside normwatch per
    step, and the median ratio to the unmonitored loop of the same kind (which calls
    torch's own ``clip_grad_norm_``, not the wrapper the watches installed)."""
    got = in_turn(hidden, layers, batch, seq, steps, names, loops)
    lines = [f"tiny Llama (hidden {hidden}, {layers} layers, batch {batch} x {seq} tokens), "
             f"{steps} steps per mode taken in turn, torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads", "",
             "| mode | loop | inside normwatch (ms/step) | ratio | step (ms) |",
             "|---|---|---:|---:|---:|"]
    lines += [f"| {name} | {'clips' if clip else 'plain'} | {t.inside:.2f} | {t.ratio:.3f}x | "
              f"{t.step:.1f} |" for (name, clip), t in got.items()]
    return "\n".join(lines)


def side_by_side_arguments(description: str) -> argparse.ArgumentParser:
    """The arguments of a benchmark running copies of the tiny Llama side by side in one
    process: the model's size and the steps (``floor.py``, ``lane.py``)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    return parser


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    # 10 steps = one flush interval at the default flush_every: every sample pays exactly
    # one flush, so the median cannot skip the flushes
    parser.add_argument("--steps", type=int, default=10, help="steps per mode per round")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--only", nargs="*", help="mode names (the baselines always run)")
    parser.add_argument("--clip", action="store_true",
                        help="every loop clips its gradients (clip_grad_norm_, max norm 1) "
                             "before the step, as most training loops do")
    parser.add_argument("--sweep", type=int, metavar="STEPS",
                        help="the size sweep: ratios and µs per norm per step of "
                             "defaults, the optimizer watched and stats_every=1, stepping "
                             "in turn for STEPS steps (a multiple of 10)")
    parser.add_argument("--turns", type=int, metavar="STEPS",
                        help="defaults, optimizer and guard, each plain and clipping, "
                             "stepping in turn for STEPS steps (a multiple of 10)")
    parser.add_argument("--parts", type=int, metavar="STEPS",
                        help="what each part costs (the modes of PARTS), stepping in turn "
                             "for STEPS steps (a multiple of 10)")
    args = parser.parse_args(argv)
    if args.turns or args.parts:
        text = turns(args.hidden, args.layers, args.batch, args.seq, args.turns) \
            if args.turns else turns(args.hidden, args.layers, args.batch, args.seq,
                                     args.parts, PARTS, (False,))
        print(text)
        return text
    if args.sweep:
        text = (f"size sweep, {args.sweep} steps per mode taken in turn, torch "
                f"{torch.__version__}, {torch.get_num_threads()} threads; in brackets the "
                "time inside normwatch per norm per step and as a share of the unmonitored "
                f"step{'; every loop clips' if args.clip else ''}\n\n"
                f"{sweep(args.sweep, clip=args.clip)}")
        print(text)
        return text
    setup = Setup(lambda: tiny_llama(args.hidden, args.layers), args.batch, args.seq)
    rows = run(args.rounds, args.steps, setup, args.only, args.clip)
    text = (f"tiny Llama (hidden {args.hidden}, {args.layers} layers, batch {args.batch} x "
            f"{args.seq} tokens{', clipped' if args.clip else ''}), {args.rounds} rounds x "
            f"{args.steps} steps, "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads\n\n{table(rows)}")
    print(text)
    return text


if __name__ == "__main__":
    main()
