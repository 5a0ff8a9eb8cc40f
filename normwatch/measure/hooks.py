"""The forward hook on one norm layer: the hot path.

Per counted call it reduces the layer's input and output to a few floats per token on
their device (:func:`~normwatch.measure.reductions.reduce_call`, or the fused Triton
kernel) and stages them in the accumulator, with no host synchronisation (no
``.item()``, ``.cpu()``, ``bool(tensor)``, masking or ``nonzero``). Host-side it only
reads metadata (shapes, dtypes, flags). Any exception disables this hook with one
warning; training goes on.

Inside ``torch.compile`` the hook takes its *traced* path: one opaque operator per call
(``normwatch::fold_call``, :mod:`~normwatch.measure.opaque`) folding the call straight
into the layer's accumulator row in place, with the step, the tier, the call counter,
the pause and the output-check flag read from a small control tensor (:class:`Runtime`
writes it between steps) — no Python value that changes between steps is read and no
Python state is written (dtypes and the place in forward order go to a device row), so
the compiled graph neither breaks nor recompiles, inside activation checkpoints too, and
compiling it costs what compiling the model costs. Eager keeps the staged fold (faster there) until a
flush finds compiled calls: eager hooks then fold in place too, so that the calls of a
step share one counter. Both give the same numbers.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from normwatch.catalog import KEY_STRIDE
from normwatch.measure.accumulator import Accumulator, code_dtype, dtype_code
from normwatch.measure.autocasting import autocast_made, output_op
from normwatch.measure.gradients import GradHooks, GradRows
from normwatch.measure.opaque import (
    failure,
    fold_call,
    fold_in_place,
    output_check,
    output_tokens,
    site,
    site_key,
)
from normwatch.measure.reductions import CallRows, reduce_call, rows_from_fused
from normwatch.measure.reference import reference_params
from normwatch.measure.triton_kernel import available as triton_available
from normwatch.measure.triton_kernel import row_stats_triton
from normwatch.records import NormLayer

_INPUT_KWARGS = ("hidden_states", "input", "x", "inputs")


@dataclass
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
    traced: bool = False
    """A flush found compiled calls: eager hooks fold in place too (one call counter)."""
    controls: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    """Per device, the flags compiled hooks read (:data:`CONTROL` order, float64)."""
    gradients: bool = True
    """Whether gradients through the norms are measured (fixed: compiled graphs read it)."""
    gates: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    """Per device, the gradient hooks' flag (:meth:`gate`)."""

    @property
    def grads_now(self) -> bool:
        """Whether this step's backward is measured (full tier, not paused)."""
        return self.gradients and self.full_stats and not self.paused

    def control(self, device: torch.device) -> torch.Tensor:
        """The control tensor of ``device`` (made, outside any graph, on first use)."""
        ctl = self.controls.get(device)
        if ctl is None:
            ctl = torch.zeros(len(CONTROL), dtype=torch.float64, device=device)
            _static(ctl)
            self._write(ctl)
            self.controls[device] = ctl
        return ctl

    def gate(self, device: torch.device) -> torch.Tensor:
        """The 0-d flag gradient hooks read on ``device`` (1: measure this backward).
        Its own tensor, written through ``.data``: compiled backwards save it, and their
        saved copy must stay valid while it changes."""
        gate = self.gates.get(device)
        if gate is None:
            gate = torch.zeros((), dtype=torch.float64, device=device)
            _static(gate)
            gate.data.fill_(float(self.grads_now))
            self.gates[device] = gate
        return gate

    def update(self, **flags: Any) -> None:
        """Set flags (``step``, ``full_stats``, ``paused``, ``check_outputs``,
        ``calls_this_step``) and write them into every control tensor: a few fills, no
        host copy."""
        for name, value in flags.items():
            setattr(self, name, value)
        for ctl in self.controls.values():
            self._write(ctl)
        for gate in self.gates.values():
            gate.data.fill_(float(self.grads_now))

    def _write(self, ctl: torch.Tensor) -> None:
        values = (self.step, self.full_stats, self.calls_this_step, not self.paused,
                  self.check_outputs)
        for i, value in enumerate(values):
            ctl[i].fill_(float(value))

    def fused(self, x: torch.Tensor) -> bool:
        """Whether to use the fused Triton kernel for ``x`` (by its device)."""
        if self.kernel == "torch":
            return False
        if self.kernel == "triton":
            return True
        return x.is_cuda and triton_available()


CONTROL = ("step", "full", "call", "active", "check")
"""The control tensor's slots: step, full tier, calls so far this step, not paused,
check outputs."""


def _static(t: torch.Tensor) -> None:
    """Mark a long-lived buffer static for the compiler (CUDA graphs keep its address)."""
    torch._dynamo.mark_static_address(t)


@dataclass
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

    def reset(self) -> None:
        self.calls = 0
        self.tokens = 0
        self.empty_calls = 0

    def adopt(self, codes: Sequence[float], device: torch.device | None) -> None:
        """Take the dtypes compiled calls recorded (:data:`META` codes), when no eager
        call did."""
        if not codes[0] or self.input_dtype is not None:
            return
        x, weight, y, amp = (code_dtype(c) for c in codes[:4])
        self.input_dtype, self.weight_dtype, self.output_dtype = (
            None if d is None else _dtype_name(d) for d in (x, weight, y))
        if amp is not None and device is not None:
            self.autocast = f"{device.type}:{_dtype_name(amp)}"
        self.device = device


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
        self.disabled_reason: str | None = None
        self._skipped: set[str] = set()
        self._signature: tuple[Any, ...] = ()
        self.key = site_key(layer, runtime.accumulator.limits)
        """What compiled calls pass their operators (:mod:`~normwatch.measure.opaque`)."""
        self.site = site(self.key)
        self._tokens: Callable[[torch.Tensor], torch.Tensor] = self.site.tokens
        self.state: torch.Tensor | None = None
        """This layer's accumulator row on its home device (what compiled calls update)."""
        self.ctl: torch.Tensor | None = None
        self.grad_state: torch.Tensor | None = None
        """This layer's gradient row (:meth:`Accumulator.grad_row`)."""
        self.grad_gate: torch.Tensor | None = None
        """The gradient hooks' flag (:meth:`Runtime.gate`)."""
        self.meta: torch.Tensor | None = None
        """Dtype codes compiled calls write (:data:`~normwatch.measure.accumulator.META`)."""
        self._warned_device = False
        home = home or module_device(module)
        if home is not None and home.type != "meta":  # meta: placed at its first real call
            self.home(home)
        self.handle: RemovableHandle | None = module.register_forward_hook(self, with_kwargs=True)
        self.grads: GradHooks | None = None
        self._pre_handle: RemovableHandle | None = None
        if runtime.gradients:
            self.grads = GradHooks(self._tokens, self._grad_target, self._stage_grad,
                                   self._fail, self.key, self.site.through is not None)
            self.grads.watch_weight(getattr(module, "weight", None))
            self._pre_handle = module.register_forward_pre_hook(self._pre, with_kwargs=True)

    def home(self, device: torch.device) -> None:
        """Place this layer's in-place state on ``device`` (outside any graph)."""
        self.state = self.rt.accumulator.row_state(device, self.row)
        self.meta = self.rt.accumulator.row_meta(device, self.row)
        self.ctl = self.rt.control(device)
        if self.rt.gradients:
            self.grad_state = self.rt.accumulator.grad_row(device, self.row)
            self.grad_gate = self.rt.gate(device)

    def remove(self) -> None:
        """Detach from the module (harmless twice)."""
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        if self._pre_handle is not None:
            self._pre_handle.remove()
            self._pre_handle = None
        if self.grads is not None:
            self.grads.remove()

    def _grad_target(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This layer's gradient row and gate, for the gradient hooks (``None`` when
        there is nothing to measure: eager hooks skip the gated-off tensor work)."""
        if self.grad_state is None or self.grad_gate is None:
            return None
        if not torch.compiler.is_compiling() and not self.rt.grads_now:
            return None  # the gate reads 0 (compiled code reads the gate, never this flag)
        return self.grad_state, self.grad_gate

    def _stage_grad(self, site: int, rows: torch.Tensor, width: int) -> None:
        self.rt.accumulator.stage_grad(GradRows(rows, self.row, site, width))

    def _pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Forward pre-hook, compiled code only: a tensor hook on the input (the hidden
        state's gradient, :meth:`GradHooks.watch_hidden`). Nothing is put between the
        input and the norm: eager calls hook their gradients from the forward hook
        (:meth:`GradHooks.watch_call`), compiled ones from the output's tap."""
        if not torch.compiler.is_compiling():
            return None
        try:
            if not (module.training and torch.is_grad_enabled()):
                return None
            x = _input(args, kwargs)
            if x is None or not x.requires_grad or not x.is_floating_point() \
                    or self.grads is None:
                return None
            self.grads.watch_hidden(x)
        except Exception as exc:  # never take the training run down
            self._fail(exc)
        return None

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any], output: Any
    ) -> torch.Tensor | None:
        try:
            if torch.compiler.is_compiling():
                return self._traced(module, args, kwargs, output)
            if not self.rt.paused:
                self._observe(module, args, kwargs, output)
        except Exception as exc:  # never take the training run down
            self._fail(exc)
        return None

    def poll(self) -> None:
        """Disable this hook if a compiled call's operator failed (:func:`failure`)."""
        exc = failure(self.state, self.grad_state)
        if exc is not None:
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        """Disable this hook with one warning (while tracing: Dynamo breaks the graph
        here and the recompile drops the hook). Once: the hooks already registered on
        this step's tensors may fail again."""
        if self.disabled_reason is not None:
            return
        self.disabled_reason = f"{type(exc).__name__}: {exc}"
        self.remove()
        warnings.warn(
            f"normwatch: measuring {self.layer.name!r} failed ({self.disabled_reason}); "
            "this layer is no longer watched, training continues",
            RuntimeWarning,
            stacklevel=3,
        )

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
            self.counts.no_grad_calls += 1
        else:
            self.counts.eval_calls += 1
        return False

    def _observe(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any], output: Any
    ) -> None:
        # The common case first, in few lines: inside a training step every line of
        # Python costs several times what it costs warm.
        x = _input(args, kwargs)
        if x is None or not x.is_floating_point() or x.is_meta:
            return self._skip(x)
        x0 = x
        if not self._counted(module):
            return
        y = y0 = _output(output)
        # A second tensor input (the gate of a gated RMSNorm) changes what the output is:
        # the formula of x alone no longer applies.
        alone = not self.rt.check_outputs or not _other_tensor(args, kwargs, x)
        # Detached tensors record no autograd graph: no no_grad() context needed.
        x = x.detach()
        y = None if y is None else y.detach()
        rt = self.rt
        n_tokens = 0
        if x.numel() and rt.traced:  # compiled hooks run too: share their call counter
            if self.state is None or self.state.device != x.device:
                self.home(x.device)
            n_tokens = int(self._fold_in_place(module, x, y, alone))
        elif x.numel():
            tokens = self._tokens(x)
            n_tokens = tokens.shape[0]
            out = y if y is not None and y.is_floating_point() else None
            key = float(rt.step * KEY_STRIDE + rt.calls_this_step)
            call = self._reduce(tokens, x, out, key)
            rt.accumulator.stage(call)
            if rt.check_outputs and out is not None and alone:
                check = output_check(self.site, x, out, reference_params(self.layer, module, x),
                                     call, tokens.shape[1], module.training)
                if check is not None:
                    rt.accumulator.update_check(self.row, check[0], check[1])
        # Host bookkeeping last, so a failed measurement leaves no half-counted call.
        rt.calls_this_step += 1
        c = self.counts
        c.calls += 1
        c.tokens += n_tokens
        c.empty_calls += not n_tokens
        c.input_shape = x.shape
        if self.grads is not None and rt.grads_now:
            if y0 is not None and y0.requires_grad:
                self.grads.watch_call(x0, y0)
            self.grads.watch_weight(getattr(module, "weight", None))  # FSDP2 swaps it
        if c.calls == 1:
            rt.forward_order.setdefault(self.layer.name, len(rt.forward_order))
        self._record_dtypes(module, x, y0)

    def _traced(self, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                output: Any) -> torch.Tensor | None:
        """The hook body ``torch.compile`` traces (see the module docstring); returns the
        output the model goes on with when it taps it (``None``: the output as it was)."""
        x = _input(args, kwargs)
        if x is None or not x.is_floating_point() or x.is_meta or self.state is None:
            return None
        if not (self.rt.count_eval or (module.training and torch.is_grad_enabled())):
            return None
        y = _output(output)
        # Python state is neither read nor written here (a checkpointed region is a
        # higher-order op that refuses side effects): dtypes go to a device row
        assert self.meta is not None
        self.meta[:4].copy_(torch.tensor([dtype_code(d) for d in _dtypes(module, x, y)[:4]],
                                         dtype=torch.float64, device=self.meta.device))
        if x.numel():
            assert self.ctl is not None
            xd = x.detach()
            # one opaque call (its body runs eagerly): inlined, the fold's few dozen ops
            # per call site cost minutes of code generation
            check = self.rt.output_checks and not _other_tensor(args, kwargs, x)
            fold_call(xd, None if y is None else y.detach(),
                      reference_params(self.layer, module, xd), self.state, self.ctl,
                      self.meta, self.key, check, module.training)
        if self.grads is not None and y is not None and y.requires_grad \
                and isinstance(output, torch.Tensor):
            weight = getattr(module, "weight", None)
            weight = weight if isinstance(weight, torch.Tensor) else None
            # the formula of the gradient through the norm holds for x alone, whole tokens
            fits = y.shape == x.shape and not _other_tensor(args, kwargs, x) and (
                weight is None or weight.numel() == self.layer.token_size)
            # the model goes on with the tapped output
            return self.grads.watch_output(y, x if fits else None, weight)
        return None

    def _fold_in_place(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor | None,
                       alone: bool) -> int:
        """Eager calls once compiled ones run too: :func:`fold_in_place` (what compiled
        calls run as one operator), straight; returns the token count."""
        assert self.state is not None and self.ctl is not None
        rt = self.rt
        return fold_in_place(self.site, x, y, reference_params(self.layer, module, x),
                             self.state, self.ctl,
                             alone and rt.output_checks and rt.check_outputs, module.training)

    def _reduce(self, tokens: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None,
                key: float) -> CallRows:
        """One call's per-token rows: the fused kernel on its devices, else torch."""
        kind, eps = self.layer.kind, self.site.eps
        out_tokens = output_tokens(self.site, out, x)
        if not self.rt.fused(x):
            return reduce_call(tokens, out_tokens, kind, eps, self.rt.full_stats, self.row, key)
        same = out_tokens is not None and out_tokens.shape == tokens.shape
        rows = row_stats_triton(tokens, out_tokens if same else None)
        call = rows_from_fused(rows, kind, eps, tokens.shape[1], same, self.row, key)
        if out_tokens is not None and not same:
            call = call._replace(out_hi=out_tokens.amax(1), out_lo=out_tokens.amin(1))
        return call

    def _record_dtypes(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor | None) -> None:
        signature = (*_dtypes(module, x, y), output_op(y))
        if signature != self._signature:  # names are built only when something changed
            self._signature = signature
            c = self.counts
            c.input_dtype, c.weight_dtype, c.output_dtype = (
                None if d is None else _dtype_name(d) for d in signature[:3])
            amp, device_type, op = signature[3:]
            c.autocast = None if amp is None else f"{device_type}:{_dtype_name(amp)}"
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


def module_device(module: nn.Module) -> torch.device | None:
    """Where ``module``'s parameters or buffers live (``None``: it has none)."""
    for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
        return t.device
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return None


def _other_tensor(args: tuple[Any, ...], kwargs: Mapping[str, Any], x: torch.Tensor) -> bool:
    """Whether the call had a tensor input besides ``x``."""
    return any(isinstance(v, torch.Tensor) and v is not x
               for v in (*args, *kwargs.values()))


def _input(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    """The norm's input: its first positional tensor (the common case first), else the
    first tensor found."""
    return args[0] if args and isinstance(args[0], torch.Tensor) else _first_tensor(args, kwargs)


def _output(output: Any) -> torch.Tensor | None:
    """The norm's output tensor (the first one of a tuple or list)."""
    if isinstance(output, torch.Tensor):
        return output
    return _first_tensor(output if isinstance(output, tuple | list) else (output,), {})


def _dtypes(module: nn.Module, x: torch.Tensor, y: torch.Tensor | None
            ) -> tuple[torch.dtype, torch.dtype | None, torch.dtype | None, torch.dtype | None,
                       str]:
    """Input, weight, output and autocast dtypes of a call, and the device type (reads
    flags and metadata only: traceable)."""
    weight = getattr(module, "weight", None)
    device_type = "cpu" if x.is_cpu else x.device.type
    amp = (torch.get_autocast_dtype(device_type)
           if torch.is_autocast_enabled(device_type) else None)
    return (x.dtype, weight.dtype if isinstance(weight, torch.Tensor) else None,
            None if y is None else y.dtype, amp, device_type)


def _first_tensor(
    args: tuple[Any, ...] | list[Any], kwargs: Mapping[str, Any]
) -> torch.Tensor | None:
    for value in args:
        if isinstance(value, torch.Tensor):
            return value
    for name in _INPUT_KWARGS:
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor):
            return value
    for value in kwargs.values():
        if isinstance(value, torch.Tensor):
            return value
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
