"""One layer's recorder: the one body that decides whether a norm call counts, what it
records and where it stages. Every way in calls it: the eager hook
(:mod:`~normwatch.measure.layer.hooks`), the compiled graph's operator
(:mod:`~normwatch.measure.layer.compiled`); the native C++ lane runs its common case as
:mod:`~normwatch.measure.backends.native.contract` states it.

    >>> recorder = Recorder(layer, module, row, runtime)
    >>> if recorder.counts_call(module):         # a training call (or eval, if counted)
    ...     recorder.record(module, x, y, alone=True, grads_alone=True)

A counted call is read into per-token rows by its device's backend
(:func:`~normwatch.measure.backends.choose`: ``backend.call_rows``) and staged in the
accumulator, with no host synchronisation (no ``.item()``, ``.cpu()``, ``bool(tensor)``,
masking or ``nonzero``); host-side only metadata is read (shapes, dtypes, flags). Then
its host counts, once per interval its output check
(:mod:`~normwatch.measure.layer.outputs`), on full-tier steps its gradients hooked
(:class:`~normwatch.measure.layer.gradients.GradHooks`), on those and the interval's
first call its dtypes noted.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from normwatch.catalog import KEY_STRIDE
from normwatch.guarded import Part
from normwatch.measure.layer.autocasting import autocast_made, output_op
from normwatch.measure.layer.calls import dtype_name, dtypes
from normwatch.measure.layer.gradients import GradHooks
from normwatch.measure.layer.outputs import output_check
from normwatch.measure.state.accumulator import Accumulator
from normwatch.measure.state.backend import Backend
from normwatch.measure.state.rows import GradRows, LayerRows
from normwatch.records import NormLayer


@dataclass(slots=True)
class Runtime:
    """State shared by a watch and its recorders (host-side, plain Python)."""

    accumulator: Accumulator
    count_eval: bool = False
    step: int = 1
    """The step in progress (1-based); forwards before the first ``watch.step()`` are step 1."""
    calls_this_step: int = 0
    check_outputs: bool = True
    output_checks: bool = True
    """Whether outputs are ever checked (fixed: compiled graphs read it)."""
    full_stats: bool = True
    """Whether this step runs the full statistics (else the sentinel tier)."""
    paused: bool = False
    forward_order: dict[str, int] = field(default_factory=dict)
    gradients: bool = True
    """Whether gradients through the norms are measured (fixed: compiled graphs hook the
    outputs for it)."""
    recomputing: bool = False
    """A training call without grad was counted as one to be recomputed in the backward
    (:attr:`Recorder.pending_recompute`) since the step began."""
    toggled: set[GradHooks] = field(default_factory=set)
    """The gradient hooks whose weight's hook is Python's, armed on measured steps alone
    (:meth:`~normwatch.measure.layer.gradients.GradHooks.arm`)."""

    @property
    def grads_now(self) -> bool:
        """Whether this step's backward is measured (full tier, not paused)."""
        return self.gradients and self.full_stats and not self.paused

    def update(self, **flags: Any) -> None:
        """Set flags (``step``, ``full_stats``, ``paused``, ``check_outputs``,
        ``calls_this_step``)."""
        for name, value in flags.items():
            setattr(self, name, value)

    def backend(self, device: torch.device) -> Backend:
        """The backend of tensors on ``device`` (the accumulator's: what folds what is
        read)."""
        return self.accumulator.backend(device)


@dataclass(slots=True)
class HostCounts:
    """What a recorder learns without touching tensor values."""

    calls: int = 0
    tokens: int = 0
    input_dtype: str | None = None
    weight_dtype: str | None = None
    output_dtype: str | None = None
    autocast: str | None = None
    autocast_made: bool | None = None
    """An fp32 output under autocast made by an op autocast runs in fp32 (``None``: no
    such output, or no autograd node to tell)."""
    input_shape: torch.Size | None = None
    device: torch.device | None = None

    empty_calls: int = 0
    """Counted calls with an empty input (nothing folded on the device)."""
    eval_calls: int = 0
    """Calls not counted for eval mode, since the watch began (never reset)."""
    no_grad_calls: int = 0
    """Calls not counted for running without grad, since the watch began (never reset)."""
    output_checked: bool = False
    """This interval's output check ran (once per layer per checked interval: it looks for
    a wrong formula, eps or dtype, which one call shows; each check is ~30 small ops)."""

    def reset(self) -> None:
        self.calls = 0
        self.tokens = 0
        self.empty_calls = 0
        self.output_checked = False


class Recorder:
    """One layer's recording; see the module docstring. ``off`` detaches the layer (on a
    failure)."""

    def __init__(self, layer: NormLayer, module: nn.Module, row: int, runtime: Runtime,
                 off: Callable[[], None]) -> None:
        self.layer = layer
        self.module = module
        self.row = row
        self.rt = runtime
        self.counts = HostCounts()
        self.pending_recompute = 0
        """Training calls made without grad (a reentrant checkpoint's forward) whose
        recompute inside the backward counts."""
        self.part = Part(f"measuring {layer.name!r}", "this layer is no longer watched",
                         off=off)
        self.grads: GradHooks | None = None
        """The layer's gradient hooks (``None``: gradients are not measured)."""
        self.state: torch.Tensor | None = None
        """What names this layer, on its home device, to the operators compiled calls
        make (:meth:`~normwatch.measure.layer.compiled.CompiledPath.place`)."""
        buffers = runtime.accumulator
        self.rows = LayerRows.of(layer, row, buffers.buffers.take, buffers.grad_buffers.take)
        """What the backends read this layer's calls and gradients with."""
        self._signature: tuple[Any, ...] = ()
        self._skipped: set[str] = set()

    @property
    def failed(self) -> str | None:
        """Why this layer's measurement failed and was switched off (``None``: it works)."""
        return self.part.failed

    def fail(self, exc: Exception) -> None:
        """Disable this layer with one warning (while tracing: Dynamo breaks the graph
        here and the recompile drops the hook)."""
        self.part.fail(exc)

    def counts_call(self, module: nn.Module) -> bool:
        """Whether an eager call of ``module`` counts: a training call with grad (or any,
        with ``count_eval``); inside a backward, only the recompute of a training call
        made without grad (a reentrant activation checkpoint's)."""
        if torch._C._current_graph_task_id() != -1:
            if self.pending_recompute > 0:
                self.pending_recompute -= 1
                return True
            return False
        if self.rt.count_eval:
            return True
        if module.training and torch.is_grad_enabled():
            return True
        if module.training:
            self.pending_recompute += 1
            self.rt.recomputing = True
            self.counts.no_grad_calls += 1
        else:
            self.counts.eval_calls += 1
        return False

    def record(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor | None,
               alone: bool, grads_alone: bool | None = None) -> None:
        """Record one counted call: input ``x`` (floating, not meta), output ``y`` (or
        ``None``); ``alone``: ``x`` was its only tensor input (an output check reads the
        formula of ``x`` alone); ``grads_alone``: its gradients may be computed from
        ``x`` alone (``None``: compiled code, whose gradients its own hooks measure, and which
        notes its dtypes at every call)."""
        rt, c = self.rt, self.counts
        n_tokens = 0
        if x.numel():
            out = y if y is not None and y.is_floating_point() and y.numel() else None
            call = rt.backend(x.device).call_rows(
                self.rows, x, out, float(rt.step * KEY_STRIDE + rt.calls_this_step),
                rt.full_stats)
            n_tokens = call.n
            rt.accumulator.stage(call)
            if rt.check_outputs and out is not None and alone and not c.output_checked:
                check = output_check(self.layer, module, x.detach(), out.detach(), call,
                                     self.rows.tokens)
                c.output_checked = True
                if check is not None:
                    rt.accumulator.update_check(self.row, check[0], check[1])
        # Host bookkeeping last, so a failed measurement leaves no half-counted call.
        rt.calls_this_step += 1
        c.calls += 1
        c.tokens += n_tokens
        c.empty_calls += not n_tokens
        c.input_shape = x.shape
        self.after(module, x, y, grads_alone)

    def after(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor | None,
              grads_alone: bool | None) -> None:
        """The rest of a call once counted and staged (:meth:`record`'s, and the C++
        lane's on full-tier steps and an interval's first call): its place in the forward
        order, its gradients hooked, its dtypes noted."""
        rt, c = self.rt, self.counts
        if c.calls == 1:
            rt.forward_order.setdefault(self.layer.name, len(rt.forward_order))
        if grads_alone is not None:
            self.watch_grads(module, x, y, grads_alone)
        if grads_alone is None or rt.full_stats or c.calls == 1:
            self.record_dtypes(module, x, y)

    def grad_target(self) -> torch.Tensor | None:
        """The row naming this layer, for the gradient hooks: traced, always (the
        operator's body decides); eager, ``None`` when this backward is not measured."""
        if torch.compiler.is_compiling() or self.rt.grads_now:
            return self.state
        return None

    def stage_grad(self, site: int,
                   rows: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None],
                   width: int) -> None:
        """Stage one gradient's rows at ``site`` (:class:`~normwatch.measure.state.rows.
        GradRows`)."""
        self.rt.accumulator.stage_grad(_new(GradRows, (*rows, self.row, site, width)))

    def watch_grads(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor | None,
                    alone: bool) -> None:
        """Hook a counted call's gradients, where this step's backward is measured
        (``alone``: ``x`` was the call's only tensor input, ``y`` its output)."""
        grads = self.grads
        if grads is not None and self.rt.grads_now:
            weight = getattr(module, "weight", None)  # (FSDP2 swaps it)
            if y is not None and y.requires_grad:
                grads.watch_call(x, y, alone, weight)
            grads.watch_weight(weight)

    def record_dtypes(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor | None) -> None:
        """Note the call's dtypes and autocast state (names built only on a change)."""
        signature = (*dtypes(module, x, y), output_op(y))
        if signature != self._signature:
            self._signature = signature
            c = self.counts
            c.input_dtype, c.weight_dtype, c.output_dtype = (
                None if d is None else dtype_name(d) for d in signature[:3])
            amp, device_type, op = signature[3:]
            c.autocast = None if amp is None else f"{device_type}:{dtype_name(amp)}"
            c.device = x.device
            promoted = amp is not None and y is not None and \
                y.dtype == torch.float32 != x.dtype
            c.autocast_made = None if not promoted or op is None else \
                autocast_made(op, x.device, amp, x.dtype)

    def skip(self, x: torch.Tensor | None) -> None:
        """A call with no floating input is not measured: say so once per reason."""
        if x is None:
            why = "no tensor argument"
        elif x.is_meta:
            why = "meta-device input"
        else:
            why = f"non-floating-point input ({x.dtype})"
        if why not in self._skipped:
            self._skipped.add(why)
            warnings.warn(f"normwatch: {self.layer.name!r} called with {why}; such calls are "
                          "not measured", RuntimeWarning, stacklevel=3)


_new = tuple.__new__
"""A named tuple made from all its fields, without its ``__new__``'s Python frame (inside a
training step, ~3 µs a call)."""
assert GradRows._fields[3:] == ("layer", "site", "width")  # (as stage_grad makes it)

