"""The forward hook on one norm layer: the hot path.

Per counted call it reduces the layer's input and output to a few floats per token on
their device (:func:`~normwatch.measure.reductions.reduce_call`, or the fused Triton
kernel; a common CPU training call through a lane of few lines, :meth:`LayerHook._lane`)
and stages them in the accumulator, with no host synchronisation (no
``.item()``, ``.cpu()``, ``bool(tensor)``, masking or ``nonzero``). Host-side it only
reads metadata (shapes, dtypes, flags). Any exception disables this hook with one
warning; training goes on (:mod:`normwatch.guarded`).

The rooms: this module is the eager path and the wiring; what ``torch.compile`` traces
is :mod:`~normwatch.measure.traced`'s, the output check
:mod:`~normwatch.measure.outputs`', reading a call's arguments
:mod:`~normwatch.measure.calls`'.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from normwatch.catalog import KEY_STRIDE
from normwatch.guarded import Part
from normwatch.measure import fastlane
from normwatch.measure.accumulator import STAGES, Accumulator
from normwatch.measure.autocasting import autocast_made, output_op
from normwatch.measure.calls import dtype_name, dtypes, input_of, other_tensor, output_of
from normwatch.measure.gradients import GradHooks, GradRows, through_formula
from normwatch.measure.native import TAKE, RowReader, ThroughReader
from normwatch.measure.opaque import disown, own
from normwatch.measure.outputs import output_check
from normwatch.measure.reductions import CallRows, fused_call, out_rows, reduce_call, token_view
from normwatch.measure.traced import CompiledPath
from normwatch.measure.triton_kernel import available as triton_available
from normwatch.measure.triton_kernel import row_stats_triton
from normwatch.records import NormLayer


@dataclass(slots=True)
class Runtime:
    """State shared by a watch and its hooks (host-side, plain Python)."""

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
    kernel: str = "auto"
    paused: bool = False
    forward_order: dict[str, int] = field(default_factory=dict)
    gradients: bool = True
    """Whether gradients through the norms are measured (fixed: compiled graphs tap the
    outputs for it)."""
    recomputing: bool = False
    """A training call without grad was counted as one to be recomputed in the backward
    (:attr:`LayerHook.pending_recompute`) since the step began."""

    @property
    def grads_now(self) -> bool:
        """Whether this step's backward is measured (full tier, not paused)."""
        return self.gradients and self.full_stats and not self.paused

    def update(self, **flags: Any) -> None:
        """Set flags (``step``, ``full_stats``, ``paused``, ``check_outputs``,
        ``calls_this_step``)."""
        for name, value in flags.items():
            setattr(self, name, value)

    def fused(self, x: torch.Tensor) -> bool:
        """Whether to use the fused Triton kernel for ``x`` (by its device)."""
        if self.kernel == "torch":
            return False
        if self.kernel == "triton":
            return True
        return x.is_cuda and triton_available()


@dataclass(slots=True)
class HostCounts:
    """What a hook learns without touching tensor values."""

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


class LayerHook:
    """Forward hook measuring one layer; see the module docstring."""

    def __init__(self, layer: NormLayer, module: nn.Module, row: int, runtime: Runtime,
                 home: torch.device | None = None) -> None:
        self.layer = layer
        self.module = module
        self.row = row
        self.rt = runtime
        self.counts = HostCounts()
        self.pending_recompute = 0
        self.part = Part(f"measuring {layer.name!r}", "this layer is no longer watched",
                         off=self.remove)
        self.compiled = CompiledPath(self)
        self._skipped: set[str] = set()
        self._token_ndim = len(layer.normalized_shape) if layer.normalized_shape else 1
        self._eps = 0.0 if math.isnan(layer.eps) else layer.eps
        self._centred = layer.kind != "rmsnorm"
        """Whether the norm subtracts the mean (the full tier's moments then centre)."""
        self._moments = "centred" if self._centred else "rms"
        """The full tier's moments (:data:`~normwatch.measure.native.MOMENTS`)."""
        self._width = layer.token_size
        self._signature: tuple[Any, ...] = ()
        self._rows = RowReader(runtime.accumulator.buffers.take)
        self._tokens: Callable[[torch.Tensor], torch.Tensor] = partial(
            token_view, kind=layer.kind, token_ndim=self._token_ndim,
            groups=layer.num_groups or 1, width=layer.token_size)
        if layer.token_size is not None:  # layer/RMS norms: the common case first
            self._tokens = partial(_chunk_tokens, width=layer.token_size, other=self._tokens)
        self.state: torch.Tensor | None = None
        """This layer's accumulator row on its home device: what names the layer to the
        operators compiled calls make (:mod:`~normwatch.measure.opaque`)."""
        home = home or module_device(module)
        if home is not None and home.type != "meta":  # meta: placed at its first real call
            self.home(home)
        native = runtime.kernel == "auto"
        self._lane_state = fastlane.state(
            runtime, self.counts, runtime.accumulator.buffers.take, row,
            layer.token_size, self._eps, self._centred, self._moments,
            (TAKE, *STAGES, *TAIL)) \
            if native and home is not None and home.type == "cpu" else None
        """The C++ lane's state (``None``: every call is this object's; a layer not on the
        CPU builds nothing): see :mod:`~normwatch.measure.fastlane`."""
        self.handle: RemovableHandle | None = module.register_forward_hook(
            fastlane.hook_for(self, self._lane_state), with_kwargs=True)
        self.grads: GradHooks | None = None
        self._pre_handle: RemovableHandle | None = None
        if runtime.gradients:
            through = None if layer.token_size is None else \
                through_formula(layer.kind, self._eps, layer.weight_form == "1+w")
            weight = getattr(module, "weight", None)
            # the formula is the module's where its weight is `weight`, or it has none
            computable = native and through is not None and (
                isinstance(weight, torch.Tensor) or next(module.parameters(), None) is None)
            take = runtime.accumulator.grad_buffers.take
            formula = ThroughReader(self._centred, self._eps, layer.weight_form == "1+w",
                                    take) if computable else None
            # in C++ where the forward's lane is (the layer on the CPU, tokens its last dim)
            lane = None if self._lane_state is None or layer.token_size is None else partial(
                fastlane.grad_lane, runtime=runtime, take=take, rows_type=GradRows, row=row,
                width=layer.token_size, eps=self._eps,
                through_plan=None if formula is None else formula.plan)
            self.grads = GradHooks(self._tokens, self._grad_target, self._stage_grad,
                                   self._fail, through, layer.token_size,
                                   native=native, take=take, formula=formula, lane=lane)
            self.grads.watch_weight(weight)
            self._pre_handle = module.register_forward_pre_hook(
                fastlane.pre_hook_for(self.compiled.pre, self._lane_state), with_kwargs=True)

    def home(self, device: torch.device) -> None:
        """Place this layer's row on ``device`` (outside any graph): compiled calls name
        the layer by it."""
        if self.state is not None:
            disown(self.state, self.compiled)
        self.state = self.rt.accumulator.row_state(device, self.row)
        own(self.state, self.compiled)

    def remove(self) -> None:
        """Detach from the module (harmless twice)."""
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        if self._pre_handle is not None:
            self._pre_handle.remove()
            self._pre_handle = None
        if self.grads is not None:
            self.grads.close()
        if self.state is not None:
            disown(self.state, self.compiled)

    def _grad_target(self) -> torch.Tensor | None:
        """The row naming this layer, for the gradient hooks: traced, always (the
        operator's body decides); eager, ``None`` when this backward is not measured."""
        if torch.compiler.is_compiling() or self.rt.grads_now:
            return self.state
        return None

    def _stage_grad(self, site: int,
                    rows: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None],
                    width: int) -> None:
        self.rt.accumulator.stage_grad(_new(GradRows, (*rows, self.row, site, width)))

    @property
    def disabled_reason(self) -> str | None:
        """Why this hook failed and was removed (``None``: it works)."""
        return self.part.failed

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any], output: Any
    ) -> torch.Tensor | None:
        # guarded as @guarded does, in place: the hottest hook, and a wrapper's frame
        # costs a few µs a call inside a training step
        try:
            if torch.compiler.is_compiling():
                return self.compiled.trace(module, args, kwargs, output)
            rt = self.rt
            if rt.paused:
                return None
            if not self._lane(module, args, kwargs, output, rt):
                self._observe(module, args, kwargs, output)
        except Exception as exc:  # never take the training run down
            self._fail(exc)
        return None

    def _lane(self, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any],
              output: Any, rt: Runtime) -> bool:
        """A training call in the CPU lane, measured in few lines (inside a training step
        every line costs several times what it costs warm): a plain input and output of
        one layout, a training call, not the interval's output check. On full-tier steps
        its moments too and its gradients hooked; on those and the interval's first call
        its dtypes noted, as :meth:`_observe` does. ``False``: nothing done,
        :meth:`_observe` measures it."""
        c = self.counts
        if not args or (rt.check_outputs and not c.output_checked) or rt.kernel != "auto":
            return False
        x = args[0]
        if type(x) is not torch.Tensor or type(output) is not torch.Tensor or \
                not module.training or not torch.is_grad_enabled() or \
                torch._C._current_graph_task_id() != -1:
            return False
        if not x.dim() or x.shape[-1] != self._width or not output.numel():
            return False
        full = rt.full_stats
        call = self._read(x, output, float(rt.step * KEY_STRIDE + rt.calls_this_step), full)
        if call is None:
            return False
        rt.accumulator.stage(call)
        rt.calls_this_step += 1
        c.calls += 1
        c.tokens += call.n
        c.input_shape = x.shape
        if full or c.calls == 1:
            self._tail(module, args, kwargs, output, full)
        return True

    def _tail(self, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any],
              output: torch.Tensor, full: bool) -> None:
        """The rest of a call the lane measured (this object's or the C++ one's), on
        full-tier steps and the interval's first call: its gradients hooked (``full``),
        its dtypes noted, its place in the forward order (the first)."""
        x = args[0]
        if full:
            self._watch_grads(module, x, output, (len(args) == 1 and not kwargs)
                              or not other_tensor(args, kwargs, x))
        self.record_dtypes(module, x, output)
        if self.counts.calls == 1:
            order = self.rt.forward_order
            order.setdefault(self.layer.name, len(order))

    def _watch_grads(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor | None,
                     alone: bool) -> None:
        """Hook a counted call's gradients, where this step's backward is measured
        (``alone``: ``x`` was the call's only tensor input, ``y`` its output)."""
        grads = self.grads
        if grads is not None and self.rt.grads_now:
            weight = getattr(module, "weight", None)  # (FSDP2 swaps it)
            if y is not None and y.requires_grad:
                grads.watch_call(x, y, alone, weight)
            grads.watch_weight(weight)

    def _fail(self, exc: Exception) -> None:
        """Disable this hook with one warning (while tracing: Dynamo breaks the graph
        here and the recompile drops the hook)."""
        self.part.fail(exc)

    def _counted(self, module: nn.Module) -> bool:
        if torch._C._current_graph_task_id() != -1:
            # Inside backward: an activation-checkpoint recompute. Count it only if the
            # original forward ran without grad (reentrant checkpoint) and was not counted.
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

    def _observe(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any], output: Any
    ) -> None:
        # The common case first, in few lines: inside a training step every line of
        # Python costs several times what it costs warm.
        x = input_of(args, kwargs)
        if x is None or not x.is_floating_point() or x.is_meta:
            return self._skip(x)
        if not self._counted(module):
            return
        y = output_of(output)
        rt = self.rt
        alone = not other_tensor(args, kwargs, x)
        # (alone: only where this call may be the interval's output check, see measure)
        self.measure(module, x, y, alone and rt.check_outputs and not self.counts.output_checked)
        self._watch_grads(module, x, y, alone and type(output) is torch.Tensor)
        if rt.full_stats or self.counts.calls == 1:  # each interval's first call, and
            self.record_dtypes(module, x, y)         # the full-tier steps' calls

    def measure(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor | None,
                alone: bool) -> None:
        """Reduce and stage one counted call (``alone``: ``x`` was its only tensor input,
        which only an output check reads); count it. Eager and compiled calls alike."""
        rt = self.rt
        n_tokens = 0
        if x.numel():
            out = y if y is not None and y.is_floating_point() and y.numel() else None
            call = self._reduce(x, out, float(rt.step * KEY_STRIDE + rt.calls_this_step))
            n_tokens = call.n
            rt.accumulator.stage(call)
            if rt.check_outputs and out is not None and alone and \
                    not self.counts.output_checked:
                check = output_check(self.layer, module, x.detach(), out.detach(), call,
                                     self._tokens)
                self.counts.output_checked = True
                if check is not None:
                    rt.accumulator.update_check(self.row, check[0], check[1])
        # Host bookkeeping last, so a failed measurement leaves no half-counted call.
        rt.calls_this_step += 1
        c = self.counts
        c.calls += 1
        c.tokens += n_tokens
        c.empty_calls += not n_tokens
        c.input_shape = x.shape
        if c.calls == 1:
            rt.forward_order.setdefault(self.layer.name, len(rt.forward_order))

    def _reduce(self, x: torch.Tensor, out: torch.Tensor | None, key: float) -> CallRows:
        """One call's per-token rows (``out``: a non-empty floating output, or ``None``):
        the C kernel for the common CPU call (a layer or RMS norm's input and output
        alike, the last dim one token), else the fused kernel on its devices, else torch.
        A layer or RMS norm whose last dim is one token is read as it is (no reshape)."""
        kind, eps, rt = self.layer.kind, self._eps, self.rt
        whole = x.dim() > 0 and x.shape[-1] == self._width
        if whole and out is not None and rt.kernel == "auto":
            call = self._read(x, out, key, rt.full_stats)
            if call is not None:
                return call
        # Detached tensors record no autograd graph: no no_grad() context needed.
        x, out = x.detach(), None if out is None else out.detach()
        tokens = x if whole else self._tokens(x)
        out_tokens = None
        if out is not None:  # the input's layout, or for a wrong-shaped output its last dim
            out_tokens = (out if whole else self._tokens(out)) if out.shape == x.shape else \
                out.reshape(-1, out.shape[-1]) if out.dim() else out.reshape(1, 1)
        if not rt.fused(x):
            return reduce_call(tokens, out_tokens, kind, eps, rt.full_stats, self.row, key,
                               native=rt.kernel == "auto")
        tokens = tokens.reshape(-1, tokens.shape[-1])
        same = out_tokens is not None and out.shape == x.shape  # type: ignore[union-attr]
        if same:
            out_tokens = out_tokens.reshape(tokens.shape)  # type: ignore[union-attr]
        call = fused_call(row_stats_triton(tokens, out_tokens if same else None), kind, eps,
                          tokens.shape[1], same, self.row, key)
        if out_tokens is not None and not same:
            call = call._replace(out=out_rows(out_tokens))
        return call

    def _read(self, x: torch.Tensor, out: torch.Tensor, key: float,
              full: bool) -> CallRows | None:
        """The call's rows by the C reader (the layer's last dim one token, ``x`` and
        ``out`` alike: its rows line up), or ``None``: left to the general path."""
        v = self._rows(x, out, self._moments if full else None)
        if v is None:
            return None
        width = x.shape[-1]
        return _new(CallRows, (self.row, key, width, self._eps, v, x.numel() // width, True,
                               full, False, self._centred, None))

    def record_dtypes(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor | None) -> None:
        """Note the call's dtypes and autocast state (names built only on a change)."""
        signature = (*dtypes(module, x, y), output_op(y))
        if signature != self._signature:  # names are built only when something changed
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

    def _skip(self, x: torch.Tensor | None) -> None:
        if x is None:
            why = "no tensor argument"
        elif x.is_meta:
            why = "meta-device input"
        else:
            why = f"non-floating-point input ({x.dtype})"
        if why not in self._skipped:
            self._skipped.add(why)
            warnings.warn(f"normwatch: {self.layer.name!r} called with {why}; such calls are "
                          "not measured", RuntimeWarning, stacklevel=4)


TAIL = (LayerHook._tail, LayerHook._watch_grads, LayerHook.record_dtypes,
        GradHooks.watch_call, GradHooks.computes, GradHooks.watch_weight)
"""The methods whose common case the C++ lane runs itself on a full-tier call (where an
object's are still these; see :mod:`~normwatch.measure.fastlane`)."""

_new = tuple.__new__
"""A named tuple made from all its fields, without its ``__new__``'s Python frame (inside a
training step, ~3 µs a call)."""
assert CallRows._fields[-1] == "out" and len(CallRows._fields) == 11  # (as _read makes it)
assert GradRows._fields[3:] == ("layer", "site", "width")  # (as _stage_grad makes it)


def module_device(module: nn.Module) -> torch.device | None:
    """Where ``module``'s parameters or buffers live (``None``: it has none)."""
    for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
        return t.device
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return None


def _chunk_tokens(x: torch.Tensor, width: int,
                  other: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Tokens of ``width`` elements, straight away when the last dim is one token."""
    return x.reshape(-1, width) if x.dim() and x.shape[-1] == width else other(x)
