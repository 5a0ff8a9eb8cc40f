"""The aten ops each norm call and each gradient dispatches, counted (deterministic: a
``TorchDispatchMode`` sees every op below autograd, so the count does not depend on the
machine's noise).

Run: ``python tests/benchmarks/opcount.py`` (``TRITON_INTERPRET=1`` adds the fused
kernel's rows on a machine without a GPU).

Per path the table gives the *kernels* (ops that compute or allocate: what costs a
launch on a GPU and a dispatch on the CPU) and the *views* (metadata-only ops: reshape,
detach, select). Forward rows are the ops a watched call adds to an unwatched one
(``norm(x)`` watched minus unwatched); gradient rows are one hook's ops on one gradient;
compiled rows are what the operators' bodies run at run time, plus the operator itself.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import normwatch
from normwatch.measure.backends import triton_folds, triton_kernel, triton_optimizer
from normwatch.measure.state.accumulator import Accumulator
from normwatch.measure.state.rows import HIDDEN, IN, OUT

LAUNCH = "triton launch"
NATIVE = "native call"
"""One call of the CPU kernel (:mod:`normwatch.measure.backends.native.readers`): one pass
per tensor."""


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active, split into kernels and views."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels: Counter[str] = Counter()
        self.views: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        (self.views if func.is_view or name in ("detach", "alias") else self.kernels)[name] += 1
        return func(*args, **(kwargs or {}))


def in_kernel(frame: Any) -> bool:
    """Whether ``frame`` runs a kernel's body or one of its helpers, called by Triton's
    interpreter (where there is a GPU, the GPU runs them: not the host's Python); a
    helper is called by the body, from the body's module."""
    caller = frame.f_back
    while caller is not None and caller.f_code.co_filename == frame.f_code.co_filename:
        caller = caller.f_back
    return caller is not None and f"{os.sep}triton{os.sep}" in caller.f_code.co_filename


def frames_of(fn: Callable[[], object]) -> list[str]:
    """The names of normwatch's Python frames ``fn()`` enters, in order (its kernels'
    bodies and helpers aside: see :func:`in_kernel`)."""
    home = os.path.dirname(normwatch.__file__)
    frames: list[str] = []

    def profile(frame: Any, event: str, arg: object) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(home) and \
                not in_kernel(frame):
            frames.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return frames


@dataclass(frozen=True)
class Count:
    kernels: Counter[str]
    views: Counter[str]

    def __sub__(self, other: Count) -> Count:
        return Count(self.kernels - other.kernels, self.views - other.views)

    def __add__(self, other: Count) -> Count:
        return Count(self.kernels + other.kernels, self.views + other.views)

    @property
    def n_kernels(self) -> int:
        return sum(self.kernels.values())

    @property
    def n_views(self) -> int:
        return sum(self.views.values())

    def names(self) -> str:
        return ", ".join(f"{k} ×{v}" if v > 1 else k for k, v in sorted(self.kernels.items()))


@contextmanager
def _one_launch() -> Iterator[None]:
    """The fused kernel as the GPU runs it: one launch (Triton's CPU interpreter copies
    tensors around; those ops are not the kernel's; its output's allocation, where there
    is one, is counted as it is); each call of the
    CPU's compiled kernel (one pass per tensor), which no dispatch mode sees."""
    from torch.utils._python_dispatch import _disable_current_modes

    from normwatch.measure.backends.native import readers as native

    real, real_grad_launch = triton_kernel.launch, triton_kernel.launch_grad
    folds = {(module, name): getattr(module, name)
             for module, name in ((triton_folds, "launch_calls"),
                                  (triton_folds, "launch_accumulate"),
                                  (triton_folds, "launch_grads"),
                                  (triton_optimizer, "launch_sample"),
                                  (triton_optimizer, "launch_check"))}

    def launched(run: Callable[..., None]) -> Callable[..., None]:
        def counted(*args: Any) -> None:
            mode = torch.utils._python_dispatch._get_current_dispatch_mode()
            with _disable_current_modes():
                run(*args)
            if isinstance(mode, OpCounter):
                mode.kernels[LAUNCH] += 1
                _READ.add(id(args[2]))  # (its rows: not the C++ lane's)
        return counted

    def native_call(plan: native.RowPlan, x: torch.Tensor, out: torch.Tensor | None,
                    rows: torch.Tensor | None = None) -> torch.Tensor:
        rows = real_native(plan, x, out, rows)  # (its output's allocation: counted as it is)
        mode = torch.utils._python_dispatch._get_current_dispatch_mode()
        if isinstance(mode, OpCounter):
            mode.kernels[NATIVE] += 1
            _READ.add(id(rows))
        return rows

    def native_grad(plan: Any, a: torch.Tensor, b: torch.Tensor | None,
                    rows: torch.Tensor | None = None) -> torch.Tensor:
        rows = real_grad(plan, a, b, rows)
        mode = torch.utils._python_dispatch._get_current_dispatch_mode()
        if isinstance(mode, OpCounter):
            mode.kernels[NATIVE] += 1
        return rows

    def native_through(self: native.ThroughReader, *args: Any) -> Any:
        rows = real_through(self, *args)
        mode = torch.utils._python_dispatch._get_current_dispatch_mode()
        if isinstance(mode, OpCounter) and rows is not None:
            mode.kernels[NATIVE] += 1
        return rows

    real_native, real_grad = native.read_rows, native.read_grad
    real_through = native.ThroughReader.__call__
    triton_kernel.launch = launched(real)
    triton_kernel.launch_grad = launched(real_grad_launch)
    for (module, name), run in folds.items():
        setattr(module, name, launched(run))
    native.read_rows = native_call
    native.read_grad = native_grad
    native.ThroughReader.__call__ = native_through  # type: ignore[method-assign]
    try:
        yield
    finally:
        triton_kernel.launch, triton_kernel.launch_grad = real, real_grad_launch
        for (module, name), run in folds.items():
            setattr(module, name, run)
        native.read_rows = real_native
        native.read_grad = real_grad
        native.ThroughReader.__call__ = real_through  # type: ignore[method-assign]


_READ: set[int] = set()
"""The rows the recorder had the C reader or the fused kernel read (by id, while counted)."""


def count(fn: Callable[[], object], accumulator: Accumulator | None = None) -> Count:
    """The ops ``fn()`` dispatches; with ``accumulator``, each call the C++ lane read into
    it (into a lent buffer the recorder did not read into) as one C call, which no
    dispatch mode sees."""
    _READ.clear()
    staged = 0 if accumulator is None else len(accumulator._staged)
    with _one_launch(), OpCounter() as c:
        fn()
    if accumulator is not None:
        c.kernels[NATIVE] += sum(id(call.v) not in _READ and any(
            rows is call.v for rows in accumulator.buffers._lent)
            for call in accumulator._staged[staged:])
    return Count(c.kernels, c.views)


def _norm(kind: str, d: int) -> nn.Module:
    return nn.RMSNorm(d) if kind == "rmsnorm" else nn.LayerNorm(d)


@contextmanager
def watched(module: nn.Module, **options: Any) -> Iterator[Any]:
    """``module`` watched with ``options``; yields its one hook."""
    watch = normwatch.watch(module, report_dir=None, early_warning=False, **options)
    try:
        yield watch._measure._hooks[0]
    finally:
        watch.close()


def forward_call(kind: str = "rmsnorm", full: bool = False, dtype: torch.dtype = torch.float32,
                 d: int = 256, tokens: int = 512, steady: bool = False, **options: Any) -> Count:
    """The ops a watched forward call adds (training mode, input requiring grad);
    ``steady``: as in a later step, the rows of the first call folded, so that the call
    counted is lent the buffer they were read into."""
    norm = _norm(kind, d).to(dtype)
    x = torch.randn(tokens // 8, 8, d, dtype=dtype, requires_grad=True)
    plain = count(lambda: norm(x))
    with watched(norm, **options) as hook:
        hook.rt.update(full_stats=full, check_outputs=False)
        norm(x)  # the first call records names once
        if steady:
            hook.rt.accumulator.commit()
        hook.rt.update(calls_this_step=0)
        return count(lambda: norm(x), hook.rt.accumulator) - plain


def gradient(site: str, kind: str = "rmsnorm", dtype: torch.dtype = torch.float32,
             d: int = 256, tokens: int = 512, parts: int = 1, kernel: str = "auto") -> Count:
    """One gradient hook's ops on one gradient (full-tier step); ``parts``: the gradient
    through the norm as its nodes hand it on, in parts."""
    norm = _norm(kind, d).to(dtype)
    g = [torch.randn(tokens // 8, 8, d, dtype=dtype) for _ in range(parts)]
    with watched(norm, kernel=kernel) as hook:
        hook.rt.update(full_stats=True)
        grads = hook.grads
        if site == "weight":
            w = torch.randn(d, dtype=dtype)
            return count(lambda: grads._weight_grad(w))
        index = {"grad_out": OUT, "grad_in": IN, "grad_hidden": HIDDEN}[site]
        return count(lambda: grads._measure(index, *g))


def computed(kind: str = "rmsnorm", d: int = 256, tokens: int = 512) -> Count:
    """The ops of the output gradient's hook that also computes the gradient through the
    norm (an eager float32 CPU call, :meth:`~normwatch.measure.layer.gradients.GradHooks.
    computes`), on one gradient."""
    norm = _norm(kind, d)
    x = torch.randn(tokens // 8, 8, d)
    g = torch.randn_like(x)
    with watched(norm) as hook:
        hook.rt.update(full_stats=True)
        grads = hook.grads
        weight = norm.weight.detach()
        return count(lambda: grads._both(0, [x, weight, x._version], (g,)))


_OPERATOR = Count(Counter({"operator": 1}), Counter())


def compiled_call(kind: str = "rmsnorm", full: bool = False, d: int = 256,
                  tokens: int = 512) -> Count:
    """The run-time ops of one compiled call: the operator and its body (the path's
    ``call``: the C++ lane's where it has one; a dispatch mode sees the operator, not
    what its body runs: the body is counted on its own)."""
    norm = _norm(kind, d)
    x = torch.randn(tokens // 8, 8, d)
    y = norm(x).detach()
    with watched(norm) as hook:
        hook.rt.update(full_stats=full, check_outputs=False)
        hook.compiled.call(x, y, True)
        hook.rt.update(calls_this_step=0)
        return _plus(count(lambda: hook.compiled.call(x, y, True)), _OPERATOR)


def _plus(a: Count, b: Count) -> Count:
    return Count(a.kernels + b.kernels, a.views + b.views)


def compiled_grad(through: bool, kind: str = "rmsnorm", d: int = 256,
                  tokens: int = 512) -> Count:
    """The run-time ops of one compiled output gradient (with the gradient through the
    norm from it, ``through``): the operator and its body (the path's ``grad``)."""
    norm = _norm(kind, d)
    x = torch.randn(tokens // 8, 8, d)
    g = torch.randn_like(x)
    with watched(norm) as hook:
        hook.rt.update(full_stats=True)
        return _plus(count(lambda: hook.compiled.grad(
            OUT, g, x if through else None, norm.weight.detach() if through else None)),
            _OPERATOR)


PHASES = ("forward", "backward", "optimizer", "watch.step")
"""A training step's parts, as :func:`step` counts them: the model's forward (the norm
calls), its backward (the gradient hooks), the optimizer's step (the update monitor,
the guard) and ``watch.step`` (the commit, the early-warning peek, the flush)."""


def step(kernel: str = "triton", guard: bool = False, depth: int = 2, flush_every: int = 10,
         **options: Any) -> dict[str, dict[str, Count]]:
    """The ops the watch adds to whole training steps of a :class:`TinyLM` (``depth``
    blocks, ``2 * depth + 1`` norms), against an unwatched copy stepped alike: per tier
    (``"sentinel"``, ``"full"``), per phase (:data:`PHASES`); a step that flushes is left
    out (counted apart: ``"flush"``); the fifth interval's steps (the first four build the
    fold's plans and fill the lenders). As on CUDA, each step folds its calls for the
    early warning's peek (``early_warning``: on by default)."""
    import copy

    from normwatch.demos.toymodel import TinyLM, synthetic_batch

    torch.manual_seed(0)
    plain = TinyLM(dim=32, depth=depth)
    model = copy.deepcopy(plain)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (plain, model)]
    w = normwatch.watch(model, optimizers[1], kernel=kernel, guard=guard, report_dir=None,
                        flush_every=flush_every, **options)
    if w.config.early_warning:  # as on CUDA: each step folds its calls for the peek
        from normwatch.measure.step.early import EarlyWarning

        w._early = EarlyWarning(w.config.limits.fp16_limit, _Landed, pin=False)
    found: dict[str, dict[str, Count]] = {}
    try:
        for i in range(5 * flush_every):
            batch = synthetic_batch(torch.Generator().manual_seed(i), batch=2, seq=8)
            tier = "full" if w._measure.full_stats else "sentinel"  # (this step's)
            unwatched = _one_step(plain, optimizers[0], batch, None)
            watched_ = _one_step(model, optimizers[1], batch, w)
            if i >= 4 * flush_every:  # steady: every plan built, every lender filled
                added = {k: watched_[k] - unwatched[k] for k in PHASES}
                found["flush" if (i + 1) % flush_every == 0 else tier] = added
    finally:
        w.close()
    return found


class _Landed:
    """A CUDA event stand-in whose copy has always landed."""

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _one_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor,
              watch: Any) -> dict[str, Count]:
    """One training step's ops by phase (:data:`PHASES`; ``watch``: ``None`` for the
    unwatched copy)."""
    from normwatch.demos.toymodel import lm_loss

    parts: dict[str, Count] = {}
    losses: list[torch.Tensor] = []
    parts["forward"] = count(lambda: losses.append(lm_loss(model(batch), batch)))
    parts["backward"] = count(losses[0].backward)
    parts["optimizer"] = count(optimizer.step)
    optimizer.zero_grad()
    parts["watch.step"] = Count(Counter(), Counter()) if watch is None else \
        count(lambda: watch.step(losses[0]))
    return parts


def rows() -> list[tuple[str, Count]]:
    """The table's rows (the fused kernel's where Triton can run here)."""
    from normwatch.measure.backends.triton_kernel import usable

    out = [
        ("eager forward, sentinel (RMSNorm fp32)", forward_call()),
        ("eager forward, sentinel (LayerNorm bf16)",
         forward_call("layernorm", dtype=torch.bfloat16)),
        ("eager forward, full (RMSNorm fp32)", forward_call(full=True)),
        ("eager forward, full (LayerNorm fp32)", forward_call("layernorm", full=True)),
        ("eager forward, full (LayerNorm bf16)", forward_call("layernorm", True, torch.bfloat16)),
        ("gradient grad_out (fp32)", gradient("grad_out")),
        ("gradient grad_in (fp32)", gradient("grad_in")),
        ("gradient grad_hidden (bf16)", gradient("grad_hidden", dtype=torch.bfloat16)),
        ("gradient weight (fp32)", gradient("weight")),
        ("gradient grad_out + grad_in computed (fp32)", computed()),
        ("compiled call, sentinel", compiled_call()),
        ("compiled call, full", compiled_call(full=True)),
        ("compiled gradient (grad_out)", compiled_grad(False)),
        ("compiled gradient (grad_out + grad_in by formula)", compiled_grad(True)),
    ]
    if usable():
        out += [("fused kernel forward, sentinel", forward_call(kernel="triton", steady=True)),
                ("fused kernel forward, full",
                 forward_call(full=True, kernel="triton", steady=True))]
    return out


def host_us(full: bool, d: int = 64, tokens: int = 8, rounds: int = 15, calls: int = 400
            ) -> tuple[float, float]:
    """What a watched call adds to an unwatched one in µs, on an input small enough that
    the host work is all there is (the Python glue and the dispatch of the ops above):
    ``(unwatched call, added)``, medians of interleaved rounds."""
    import statistics
    import time

    plain, norm = nn.RMSNorm(d), nn.RMSNorm(d)
    x = torch.randn(tokens, d, requires_grad=True)
    with watched(norm) as hook:
        hook.rt.update(full_stats=full, check_outputs=False)
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(rounds):
            for is_watched, module in ((False, plain), (True, norm)):
                hook.rt.accumulator.reset()  # nothing staged piles up
                start = time.perf_counter()
                for _ in range(calls):
                    module(x)
                times[is_watched].append((time.perf_counter() - start) / calls * 1e6)
    added = [b - a for a, b in zip(times[False], times[True], strict=True)]
    return statistics.median(times[False]), statistics.median(added)


def table(measured: list[tuple[str, Count]]) -> str:
    lines = ["| path | kernels | views | kernels dispatched |", "|---|---:|---:|---|"]
    lines += [f"| {name} | {c.n_kernels} | {c.n_views} | {c.names()} |" for name, c in measured]
    return "\n".join(lines)


def step_table(guard: bool = True) -> str:
    """The whole CUDA-path step (the fused kernel, Triton's interpreter without a GPU), per
    norm call and per step, against #48's budgets."""
    norms = 5  # TinyLM(depth=2)
    lines = ["| step | forward ops per norm call | gradients' ops per norm call | "
             "cross-layer ops per step (optimizer + watch.step) |", "|---|---:|---:|---:|"]
    for tier, parts in step(guard=guard).items():
        total = {k: c.n_kernels + c.n_views for k, c in parts.items()}
        lines.append(f"| {tier} | {total['forward'] / norms:g} | {total['backward'] / norms:g} "
                     f"| {total['optimizer'] + total['watch.step']} |")
    return "\n".join(lines) + ("\n\nbudgets: sentinel ≤ 2 per call, full ≤ 6 per call with its "
                               "gradients, ≤ 20 cross-layer per step (kernels and views)")


def main() -> str:
    text = table(rows())
    for full in (False, True):
        base, added = host_us(full)
        text += (f"\n\nhost time of a call on 8 tokens x 64 ({'full' if full else 'sentinel'} "
                 f"tier): unwatched {base:.1f} µs, the watch adds {added:.1f} µs")
    if triton_kernel.usable():
        text += "\n\n" + step_table()
    print(f"torch {torch.__version__}, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')}"
          f"\n\n{text}")
    return text


if __name__ == "__main__":
    main()
