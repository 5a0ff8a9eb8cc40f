"""GPU benchmark: #48's table and #49's compiled rows in one run, each part on its own.

    python tests/benchmarks/gpu.py                          # every part, on CUDA
    python tests/benchmarks/gpu.py --parts eager,compiled    # some of them
    python tests/benchmarks/gpu.py --device cpu --tiny       # the script's own check (CI)

The model is the issues' step: a Hugging Face ``LlamaForCausalLM`` of ~125M parameters
(hidden 768, 12 layers, 25 norms), fp32 master weights, bf16 autocast, fused AdamW,
8 x 1024 tokens. Every mode trains its own copy; the copies step in turn, a block of
``--steps`` steps each per round in a shuffled order, and each block is divided by the
unmonitored copy's of the same round (:func:`tests.benchmarks.overhead.run`; a second
unmonitored copy, ``unmonitored (control)``, says how far two copies differ anyway).

Parts (``--parts``, in this order, the issues' rows first, so that a run cut short by its
time keeps them; a part that fails prints its traceback and the next one runs):

- ``bandwidth``: the per-call kernel against a device copy of the same bytes and the
  RMSNorm itself, on a 125M call's input and output ([8192, 768] bf16) and a large one
  ([32768, 2048]), timed on the GPU alone (calls captured in a CUDA graph and replayed,
  over more memory than the L2 cache holds), with the tokens and warps a program of
  ``SWEEP``; and one call from Python between two events (how the first run timed it:
  the host's launch counted in); CUDA only.
- ``eager``: every watch mode of #48's table, and HF's ``DebugUnderflowOverflow`` and
  ``detect_anomaly`` for comparison.
- ``compiled``: ``torch.compile``'s default mode (defaults; optimizer and guard): step
  ratios, graphs, graph breaks, recompiles, cudagraph skips, and the first step's seconds
  (the compile) watched and not; ``cudagraphs``: the same with ``mode="reduce-overhead"``
  (defaults; optimizer), CUDA only.
- ``script``: nanoGPT's shakespeare-char loop (``tests/benchmarks/nanogpt.py``: a sync
  every iteration, as its log line reads the loss), plain and under ``normwatch run``,
  eager and compiled, each run a process of its own: the issues' public-script rows.
- ``1b``: defaults at ~1B parameters (hidden 2048, 16 layers; 16 x 2048 tokens where the
  device has over 100 GB, else 8 x 2048).
- ``ops``: per step, the aten ops and kernel launches (``torch.profiler``) of a watched
  copy (``watch(model, optimizer)``) against an unwatched one, and per norm call.
- ``launch``: the host's µs a launch of the per-call kernel from Python, by its static
  launch against Triton's own; CUDA only.
- ``memory``: the optimizer step's peak memory with and without the watch; CUDA only.
- ``sync``: ``torch.cuda.set_sync_debug_mode("error")`` over 30 guarded steps, eager and
  compiled; CUDA only.

``--tiny`` shrinks every model and count so that the whole script runs on a CPU in
seconds: it checks the script, not the numbers.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch

import normwatch
from tests.benchmarks import overhead
from tests.benchmarks.overhead import Setup, tiny_llama


@dataclass(frozen=True)
class Plan:
    """What each part runs: the setups and the counts (``--tiny`` shrinks them)."""

    step: Setup
    big: Setup
    rounds: int = 6
    steps: int = 10
    big_rounds: int = 4
    big_steps: int = 2
    sync_steps: int = 30
    tiny: bool = False


def plan(device: str, tiny: bool) -> Plan:
    """The issues' setups on ``device`` (``tiny``: a 1-layer model and one step a round)."""
    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else None
    if tiny:
        def small() -> torch.nn.Module:
            return tiny_llama(64, 1)
        setup = Setup(small, 2, 16, device=device, autocast=dtype, fused=cuda)
        return Plan(setup, setup, rounds=1, steps=1, big_rounds=1, big_steps=1, sync_steps=2,
                    tiny=True)

    def llama_125m() -> torch.nn.Module:
        return tiny_llama(768, 12, vocab=32000, intermediate=2048, heads=12, kv_heads=12)

    def llama_1b() -> torch.nn.Module:
        return tiny_llama(2048, 16, vocab=32000, intermediate=5632, heads=16, kv_heads=16)

    roomy = cuda and torch.cuda.get_device_properties(0).total_memory > 100e9
    return Plan(Setup(llama_125m, 8, 1024, 32000, device, dtype, cuda),
                Setup(llama_1b, 16 if roomy else 8, 2048, 32000, device, dtype, cuda))


def time_cuda(fn: Callable[[], object], repeat: int = 50) -> float:
    """Median milliseconds of ``fn`` measured with CUDA events."""
    times = []
    for _ in range(5):
        fn()
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_replayed(calls: list[Callable[[], object]], replays: int = 20) -> float:
    """Median milliseconds of one of ``calls`` on the GPU alone: all of them captured in
    one CUDA graph, the graph replayed (no host time between the kernels, as in a step
    where the host runs ahead); where the capture fails, launched back to back between
    two events. ``calls`` read tensors of their own, together larger than the L2 cache,
    so that each reads device memory as a step's calls do."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # (warm: compiled, planned, buffers made)
        for call in calls * 2:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    def each() -> None:
        for call in calls:
            call()

    run: Callable[[], object] = each
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            each()
        run = graph.replay
    except Exception as exc:  # (the launches back to back, then)
        print(f"(no CUDA graph: {exc!r}; timed back to back)", flush=True)
        torch.cuda.synchronize()
    return time_cuda(run, replays) / len(calls)


def _bandwidth_row(shape: str, nbytes: int, copy_ms: float, what: str, ms: float) -> str:
    return f"| {shape} | {what} | {ms * 1e3:.1f} | {nbytes / ms / 1e6:.0f} | " \
           f"{copy_ms / ms:.1%} |"


SWEEP = {(8192, 768): ((1, 2, 4, 8), (2, 4, 8), (False, True)),
         (32768, 2048): ((1, 2, 4), (4, 8), (False,))}
"""The per-call kernel's programs tried on each shape: tokens a program, warps a
program, tiers (full or not)."""


def bandwidth(p: Plan) -> str:
    """The fused per-call kernel against a device copy of the same bytes and against the
    RMSNorm itself, each timed on the GPU alone (:func:`time_replayed`), with the tokens
    and warps a program of :data:`SWEEP`; and one call from Python between two events
    (the host's launch counted in, as the first GPU run timed it)."""
    from normwatch.measure.backends.triton_kernel import TOKENS, TRITON, launch, row_count
    from normwatch.measure.state.rows import LayerRows
    from normwatch.records import NormLayer

    lines = ["| shape (bf16) | what | µs a call | GB/s | of the copy's |",
             "|---|---|---:|---:|---:|"]
    free = torch.cuda.mem_get_info()[0]
    for (tokens, width), (sweep_tokens, sweep_warps, tiers) in SWEEP.items():
        pair = 2 * tokens * width * 2  # bytes a call reads: the input and the output
        k = max(2, min(8, -(-256 * 2**20 // pair), int(free * 0.3 // (3 * pair / 2))))
        xs = [torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16) for _ in range(k)]
        ys = [torch.randn_like(x) for x in xs]
        outs = [torch.empty_like(x) for x in xs]
        weight = torch.ones(width, device="cuda", dtype=torch.bfloat16)
        copy_ms = time_replayed([partial(o.copy_, x) for o, x in zip(outs, xs, strict=True)])
        row = partial(_bandwidth_row, f"[{tokens}, {width}]", pair, copy_ms)
        lines.append(row("device copy of the input (reads and writes its bytes)", copy_ms))
        lines.append(row("RMSNorm itself (`F.rms_norm`)", time_replayed(
            [partial(torch.nn.functional.rms_norm, x, (width,), weight, 1e-6) for x in xs])))
        layer = LayerRows.of(NormLayer("norm", "rmsnorm", 1e-6, (width,), "w", "RMSNorm"), 0)
        for full in tiers:
            tier = "full tier" if full else "sentinel"
            ms = time_replayed([partial(TRITON.call_rows, layer, x, y, 0.0, full)
                                for x, y in zip(xs, ys, strict=True)])
            lines.append(row(f"normwatch's call, {tier} (as launched: {TOKENS} token(s), "
                             "4 warps a program)", ms))
            v = torch.empty(row_count(True, full), tokens, device="cuda")
            for t in sweep_tokens:
                for warps in sweep_warps:
                    ms = time_replayed([partial(launch, x, y, v, tokens, width,
                                                (width, 1, width, 1), True, full, True,
                                                warps, t) for x, y in zip(xs, ys, strict=True)])
                    lines.append(row(f"the kernel, {tier}, {t} token(s) x {warps} warps", ms))
            lines.append(row(f"one {tier} call from Python between two events", time_cuda(
                partial(TRITON.call_rows, layer, xs[0], ys[0], 0.0, full))))  # (the first
            # run's way: the host's launch counted in)
        del xs, ys, outs
    return "\n".join(lines)


def launch_cost(p: Plan, launches: int = 2000) -> str:
    """The host's µs a launch of the per-call kernel (a sentinel call of 8 tokens),
    from normwatch's Python: by its static launch (``Launch``) against Triton's own."""
    from normwatch.measure.backends.triton_kernel import _ROWS, _kernel, row_count

    x = torch.randn(8, 768, device="cuda", dtype=torch.bfloat16)
    v = torch.empty(row_count(True, False), 8, device="cuda")
    args = (x, x, v, 8, 768, 768, 1, 768, 1)
    constexprs = {"HAS_OUT": True, "FULL": False, "CENTRED": False, "BLOCK_D": 1024,
                  "TOKENS": 1}
    ways = {"static (Launch)": lambda: _ROWS(8, *args, **constexprs),
            "Triton's launch": lambda: _kernel()[(8,)](*args, **constexprs)}
    lines = ["| a launch from Python | µs of host time |", "|---|---:|"]
    for name, way in ways.items():
        for _ in range(50):
            way()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(launches):
            way()
        took = time.perf_counter() - start
        torch.cuda.synchronize()
        lines.append(f"| {name} | {took / launches * 1e6:.1f} |")
    served = any(spec is not None for spec in _ROWS.specs.values())
    return "\n".join(lines) + f"\n\n(a static launch served: {served})"


EAGER = ("unmonitored (control)", "normwatch (defaults)", "normwatch + optimizer",
         "normwatch + optimizer + guard", "normwatch stats_every=1",
         "normwatch gradients=False", "normwatch sentinel only", "normwatch kernel=torch",
         "DebugUnderflowOverflow", "detect_anomaly")
"""#48's table: every mode against the unmonitored copy."""
COMPILED = ("compiled + normwatch (defaults)", "compiled + normwatch + optimizer + guard")
"""#49's rows, default mode (the baseline, compiled unwatched, comes with them)."""
CUDA_GRAPHS = ("compiled (reduce-overhead) + normwatch (defaults)",
               "compiled (reduce-overhead) + normwatch + optimizer")
"""#49's rows under CUDA graphs (``mode="reduce-overhead"``; a part of their own: with a
watch they failed on the first GPU run, and the default mode's rows must not go with
them)."""


def steps_table(p: Plan, names: tuple[str, ...], big: bool = False) -> str:
    setup, rounds, steps = (p.big, p.big_rounds, p.big_steps) if big else \
        (p.step, p.rounds, p.steps)
    rows = overhead.run(rounds, steps, setup, list(names))
    return f"{setup.label()}, {rounds} rounds x {steps} steps\n\n{overhead.table(rows)}"


def eager(p: Plan) -> str:
    return steps_table(p, EAGER)


def compiled(p: Plan, names: tuple[str, ...] = COMPILED) -> str:
    torch.compiler.reset()
    # untimed: the process's first compile loads the compiler (seconds), which would
    # count against the unwatched baseline's first step
    torch.compile(lambda t: (t * 2).sum())(torch.ones(4, device=p.step.device))
    return steps_table(p, names)


def cuda_graphs(p: Plan) -> str:
    import torch._inductor.config as inductor

    # where it fails ("tensors in the cudagraph pool not tracked as outputs"), the error
    # then says where each of them was allocated
    inductor.triton.cudagraph_trees_history_recording = True
    try:
        return compiled(p, CUDA_GRAPHS)
    finally:
        inductor.triton.cudagraph_trees_history_recording = False


def billion(p: Plan) -> str:
    return steps_table(p, ("unmonitored (control)", "normwatch (defaults)"), big=True)


def copies(setup: Setup, **options: Any) -> Iterator[tuple[bool, torch.nn.Module,
                                                           torch.optim.Optimizer,
                                                           normwatch.Watch | None,
                                                           torch.Tensor]]:
    """``(watched, model, optimizer, watch, batch)``: an unwatched copy of ``setup``'s
    model, then one watched with its optimizer (``options``), each with its AdamW, on one
    batch (the watch closed after)."""
    torch.manual_seed(0)
    base = setup.model().to(setup.device)
    tokens = torch.randint(0, setup.vocab, (setup.batch, setup.seq), device=setup.device)
    for watched in (False, True):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=setup.fused or None)
        w = normwatch.watch(model, opt, report_dir=None, **options) if watched else None
        try:
            yield watched, model, opt, w, tokens
        finally:
            if w is not None:
                w.close()


def ops(p: Plan, steps: int = 4) -> str:
    """Aten ops and kernel launches per step, unwatched and ``watch(model, optimizer)``,
    over ``steps`` steps (a ``stats_every`` cycle: sentinel and full-tier steps alike),
    and the difference per norm call."""
    from torch.profiler import ProfilerActivity, profile

    from normwatch.measure.backends import triton_kernel
    from normwatch.measure.backends.triton_launch import Launch

    setup = p.step
    counts = {}
    python = {"launch": 0, "launch_grad": 0}  # Triton's launches from normwatch's Python
    real = {name: getattr(triton_kernel, name) for name in python}
    launched = {True: 0, False: 0}  # Launch's launches (from Python): static, Triton's
    runs = [0]  # Triton's own launches
    call = Launch.__call__

    def counted(name: str, *args: Any, **kwargs: Any) -> None:
        python[name] += 1
        real[name](*args, **kwargs)

    def by_launch(self: Launch, *args: Any, **kwargs: Any) -> None:
        before = runs[0]
        call(self, *args, **kwargs)
        launched[runs[0] == before] += 1

    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        JITFunction = None
    triton_run = getattr(JITFunction, "run", None)

    def counted_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        runs[0] += 1
        return triton_run(self, *args, **kwargs)  # type: ignore[misc]

    for watched, model, opt, w, tokens in copies(setup, flush_every=10**9):
        for _ in range(4):  # warm: the first calls plan, build and allocate
            overhead.train_step(model, opt, tokens, w, autocast=setup.autocast)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                               if setup.device == "cuda" else [])
        for name in python:
            setattr(triton_kernel, name, partial(counted, name))
        Launch.__call__ = by_launch  # type: ignore[method-assign]
        if triton_run is not None:
            JITFunction.run = counted_run
        try:
            with profile(activities=activities) as prof:
                for _ in range(steps):
                    overhead.train_step(model, opt, tokens, w, autocast=setup.autocast)
                if setup.device == "cuda":
                    torch.cuda.synchronize()
        finally:
            for name, fn in real.items():
                setattr(triton_kernel, name, fn)
            Launch.__call__ = call  # type: ignore[method-assign]
            if triton_run is not None:
                JITFunction.run = triton_run
        events = prof.events()
        aten = sum(1 for e in events if e.name.startswith("aten::"))
        launches = sum(1 for e in events if "LaunchKernel" in e.name)
        counts[watched] = (aten / steps, launches / steps)
        if w is not None:  # a Llama calls each norm once a forward
            norms = len(w.flush().layers)
    (a0, k0), (a1, k1) = counts[False], counts[True]
    return ("| per step (`watch(model, optimizer)`) | aten ops | kernel launches |\n"
            "|---|---:|---:|\n"
            f"| unmonitored | {a0:.0f} | {k0:.0f} |\n"
            f"| watched | {a1:.0f} | {k1:.0f} |\n"
            f"| added per norm call ({norms} a forward; cross-layer work included) | "
            f"{(a1 - a0) / norms:.1f} | {(k1 - k0) / norms:.1f} |\n\n"
            f"Triton launched from normwatch's Python per step (0: the lanes' static "
            f"launches from C++): {python['launch'] / steps:g} calls, "
            f"{python['launch_grad'] / steps:g} gradients; all launches from normwatch's "
            f"Python per step (those, and the cross-layer ones): {launched[True] / steps:g} "
            f"by a static launch, {launched[False] / steps:g} by Triton's launch")


def sync(p: Plan) -> str:
    """No host sync over guarded steps, eager and compiled (the flush, the one sync
    there is, kept out of the steps)."""
    setup = p.step
    lines = []
    for compile_it in (False, True):
        torch.compiler.reset()
        torch.manual_seed(0)
        model = setup.model().to(setup.device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=setup.fused or None)
        w = normwatch.watch(model, opt, report_dir=None, guard=True, flush_every=10**9)
        run = cast(torch.nn.Module, torch.compile(model)) if compile_it else model
        tokens = torch.randint(0, setup.vocab, (setup.batch, setup.seq), device=setup.device)
        for _ in range(3):  # warm up (first calls allocate on the device, or compile)
            overhead.train_step(run, opt, tokens, w, autocast=setup.autocast)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(p.sync_steps):
                overhead.train_step(run, opt, tokens, w, autocast=setup.autocast)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert not w.disabled, w.disabled
        calls = w.flush().layers["model.norm"].calls
        assert calls == p.sync_steps + 3, calls
        w.close()
        lines.append(f"set_sync_debug_mode('error'), {p.sync_steps} guarded steps"
                     f"{' compiled' if compile_it else ''}: no sync")
    return "\n".join(lines)


def memory(p: Plan, steps: int = 4) -> str:
    """The optimizer step's peak memory, unwatched and watched with the optimizer (the
    update monitor's kept samples live inside the step)."""
    setup = p.step
    peaks = {}
    for watched, model, opt, w, tokens in copies(setup):
        got = []
        for _ in range(steps):
            with torch.autocast("cuda", setup.autocast or torch.float32,
                                enabled=setup.autocast is not None):
                loss = model(tokens, labels=tokens, use_cache=False).loss
            loss.backward()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            opt.step()
            torch.cuda.synchronize()
            got.append(torch.cuda.max_memory_allocated() - before)
            opt.zero_grad(set_to_none=True)
            if w is not None:
                w.step(loss)
        peaks[watched] = statistics.median(got[1:])
        nbytes = sum(t.numel() * t.element_size() for t in model.parameters())
    return ("| optimizer step peak memory | MiB |\n|---|---:|\n"
            f"| unmonitored | {peaks[False] / 2**20:.1f} |\n"
            f"| what `watch(model, optimizer)` adds | {(peaks[True] - peaks[False]) / 2**20:.1f} |"
            f"\n| 1/16 of the parameters | {nbytes / 16 / 2**20:.1f} |")


def script(p: Plan) -> str:
    """nanoGPT's shakespeare-char loop (:mod:`tests.benchmarks.nanogpt`), each run a
    process of its own, plain and under ``normwatch run``: eager in turn twice each,
    compiled once each (on a CPU, ``--tiny``: eager once each, a few steps); the median
    iteration after the first ones (the compile, the first launches)."""
    path = Path(__file__).with_name("nanogpt.py")
    env = {**os.environ, "NW_DEVICE": p.step.device, "NW_TINY": "1" if p.tiny else "0",
           "NW_ITERS": "6" if p.tiny else "80"}
    env["PYTHONPATH"] = os.pathsep.join([str(path.parents[2]), env.get("PYTHONPATH", "")])
    lines = ["| nanoGPT's loop (6 layers, 384 wide, 64 x 256 tokens, bf16, `loss.item()` "
             "every iteration) | plain (ms an iteration) | under `normwatch run` | ratio |",
             "|---|---:|---:|---:|"]
    for compiled in (False,) if p.tiny else (False, True):
        times: dict[bool, list[float]] = {False: [], True: []}
        for watched in (False, True) * (1 if compiled or p.tiny else 2):
            command = [sys.executable, str(path)]
            if watched:
                command = [sys.executable, "-m", "normwatch", "run", "--", *command]
            done = subprocess.run(command, env={**env, "NW_COMPILE": str(int(compiled))},
                                  capture_output=True, text=True, timeout=240, check=False)
            got = [float(t) for t in re.findall(r"^iter \d+: .*time ([\d.]+)ms$",
                                                done.stdout, re.M)]
            if done.returncode or not got:
                raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n"
                                   f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
            times[watched].append(statistics.median(got[len(got) // 4:]))
        plain, watched_ms = (statistics.mean(times[w]) for w in (False, True))
        lines.append(f"| {'compiled' if compiled else 'eager'} | {plain:.2f} | "
                     f"{watched_ms:.2f} | {watched_ms / plain:.3f}x |")
    return "\n".join(lines)


PARTS: dict[str, tuple[Callable[[Plan], str], bool]] = {
    "bandwidth": (bandwidth, True), "eager": (eager, False), "compiled": (compiled, False),
    "cudagraphs": (cuda_graphs, True), "script": (script, False), "1b": (billion, False),
    "ops": (ops, False), "launch": (launch_cost, True), "memory": (memory, True),
    "sync": (sync, True)}
"""Each part: what runs it, and whether it needs CUDA."""


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes: checks the script")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated, of {', '.join(PARTS)}")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return ""
    chosen = args.parts.split(",")
    unknown = [name for name in chosen if name not in PARTS]
    if unknown:
        parser.error(f"--parts: expected names of {', '.join(PARTS)}; got {unknown}")
    p = plan(args.device, args.tiny)
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    out = [f"{device}, torch {torch.__version__}, normwatch {normwatch.__version__}"]
    print(out[0], flush=True)
    for name in chosen:  # each on its own: one failure does not lose the others
        part, cuda_only = PARTS[name]
        start = time.perf_counter()
        if cuda_only and args.device != "cuda":
            text = "(CUDA only: skipped)"
        else:
            try:
                text = part(p)
            except Exception:  # (printed, then the next part)
                text = traceback.format_exc()
        text = f"## {name} ({time.perf_counter() - start:.0f} s)\n\n{text}\n"
        print(text, flush=True)
        out.append(text)
    return "\n".join(out)


if __name__ == "__main__":
    main()
    sys.exit(0)
