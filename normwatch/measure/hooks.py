"""The forward hook on one norm layer: the hot path.

Per counted call it reduces the layer's input and output to a few floats per token on
their device (:func:`~normwatch.measure.reductions.reduce_call`, or the fused Triton
kernel) and stages them in the accumulator, with no host synchronisation (no
``.item()``, ``.cpu()``, ``bool(tensor)``, masking or ``nonzero``). Host-side it only
reads metadata (shapes, dtypes, flags). Any exception disables this hook with one
warning; training goes on.
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
from normwatch.measure.accumulator import Accumulator
from normwatch.measure.reductions import (
    CallRows,
    mismatch,
    reduce_call,
    rows_from_fused,
    token_view,
)
from normwatch.measure.reference import expected_output
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
    full_stats: bool = True
    """Whether this step runs the full statistics (else the sentinel tier)."""
    kernel: str = "auto"
    paused: bool = False
    forward_order: dict[str, int] = field(default_factory=dict)

    def fused(self, x: torch.Tensor) -> bool:
        """Whether to use the fused Triton kernel for ``x`` (by its device)."""
        if self.kernel == "torch":
            return False
        if self.kernel == "triton":
            return True
        return x.is_cuda and triton_available()


@dataclass
class HostCounts:
    """What a hook learns without touching tensor values."""

    calls: int = 0
    tokens: int = 0
    input_dtype: str | None = None
    weight_dtype: str | None = None
    output_dtype: str | None = None
    autocast: str | None = None
    input_shape: torch.Size | None = None
    device: torch.device | None = None

    def reset(self) -> None:
        self.calls = 0
        self.tokens = 0


class LayerHook:
    """Forward hook measuring one layer; see the module docstring."""

    def __init__(self, layer: NormLayer, module: nn.Module, row: int, runtime: Runtime) -> None:
        self.layer = layer
        self.module = module
        self.row = row
        self.rt = runtime
        self.counts = HostCounts()
        self.pending_recompute = 0
        self.disabled_reason: str | None = None
        self._skipped: set[str] = set()
        self._token_ndim = len(layer.normalized_shape) if layer.normalized_shape else 1
        self._eps = 0.0 if math.isnan(layer.eps) else layer.eps
        self._signature: tuple[Any, ...] = ()
        self._tokens: Callable[[torch.Tensor], torch.Tensor] = partial(
            token_view, kind=layer.kind, token_ndim=self._token_ndim,
            groups=layer.num_groups or 1, width=layer.token_size)
        if layer.token_size is not None:  # layer/RMS norms: the common case first
            self._tokens = partial(_chunk_tokens, width=layer.token_size, other=self._tokens)
        self.handle: RemovableHandle | None = module.register_forward_hook(self, with_kwargs=True)

    def remove(self) -> None:
        """Detach from the module (harmless twice)."""
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any], output: Any
    ) -> None:
        if self.rt.paused:
            return
        try:
            self._observe(module, args, kwargs, output)
        except Exception as exc:  # never take the training run down
            self.disabled_reason = f"{type(exc).__name__}: {exc}"
            self.remove()
            warnings.warn(
                f"normwatch: measuring {self.layer.name!r} failed ({self.disabled_reason}); "
                "this layer is no longer watched, training continues",
                RuntimeWarning,
                stacklevel=2,
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
        return False

    def _observe(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any], output: Any
    ) -> None:
        # The common case first, in few lines: inside a training step every line of
        # Python costs several times what it costs warm.
        x = args[0] if args and isinstance(args[0], torch.Tensor) else _first_tensor(args, kwargs)
        if x is None or not x.is_floating_point() or x.is_meta:
            return self._skip(x)
        if not self._counted(module):
            return
        y = output if isinstance(output, torch.Tensor) else \
            _first_tensor(output if isinstance(output, tuple | list) else (output,), {})
        # A second tensor input (the gate of a gated RMSNorm) changes what the output is:
        # the formula of x alone no longer applies.
        alone = not self.rt.check_outputs or not _other_tensor(args, kwargs, x)
        # Detached tensors record no autograd graph: no no_grad() context needed.
        x = x.detach()
        y = None if y is None else y.detach()
        rt = self.rt
        n_tokens = 0
        if x.numel():
            tokens = self._tokens(x)
            n_tokens = tokens.shape[0]
            out = y if y is not None and y.is_floating_point() else None
            key = float(rt.step * KEY_STRIDE + rt.calls_this_step)
            rt.accumulator.stage(self._reduce(tokens, x, out, key))
            if rt.check_outputs and out is not None and alone:
                self._check_output(module, x, out)
        # Host bookkeeping last, so a failed measurement leaves no half-counted call.
        rt.calls_this_step += 1
        c = self.counts
        c.calls += 1
        c.tokens += n_tokens
        c.input_shape = x.shape
        if c.calls == 1:
            rt.forward_order.setdefault(self.layer.name, len(rt.forward_order))
        self._record_dtypes(module, x, y)

    def _reduce(self, tokens: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None,
                key: float) -> CallRows:
        """One call's per-token rows: the fused kernel on its devices, else torch."""
        kind, eps = self.layer.kind, self._eps
        if out is None or out.numel() == 0:
            out_tokens = None
        elif out.shape == x.shape:
            out_tokens = self._tokens(out)
        else:  # a wrong-shaped output: its last dim as tokens, whatever they mean
            out_tokens = out.reshape(-1, out.shape[-1]) if out.dim() else out.reshape(1, 1)
        if not self.rt.fused(x):
            return reduce_call(tokens, out_tokens, kind, eps, self.rt.full_stats, self.row, key)
        same = out_tokens is not None and out_tokens.shape == tokens.shape
        rows = row_stats_triton(tokens, out_tokens if same else None)
        call = rows_from_fused(rows, kind, eps, tokens.shape[1], same, self.row, key)
        if out_tokens is not None and not same:
            call = call._replace(out_hi=out_tokens.amax(1), out_lo=out_tokens.amin(1))
        return call

    def _check_output(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        ref = expected_output(self.layer, module, x)
        if ref is None:
            return
        if ref.shape != y.shape:
            err = torch.ones((), device=y.device)  # wrong-shaped output: fully wrong
        else:
            err = mismatch(self._tokens(y), self._tokens(ref))
        self.rt.accumulator.update_mismatch(self.row, err.to(torch.float64))

    def _record_dtypes(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor | None) -> None:
        weight = getattr(module, "weight", None)
        device_type = "cpu" if x.is_cpu else x.device.type
        amp = (torch.get_autocast_dtype(device_type)
               if torch.is_autocast_enabled(device_type) else None)
        signature = (x.dtype, weight.dtype if isinstance(weight, torch.Tensor) else None,
                     None if y is None else y.dtype, amp, device_type)
        if signature != self._signature:  # names are built only when something changed
            self._signature = signature
            c = self.counts
            c.input_dtype, c.weight_dtype, c.output_dtype = (
                None if d is None else _dtype_name(d) for d in signature[:3])
            c.autocast = None if amp is None else f"{device_type}:{_dtype_name(amp)}"
            c.device = x.device

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


def _chunk_tokens(x: torch.Tensor, width: int,
                  other: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Tokens of ``width`` elements, straight away when the last dim is one token."""
    return x.reshape(-1, width) if x.dim() and x.shape[-1] == width else other(x)


def _other_tensor(args: tuple[Any, ...], kwargs: Mapping[str, Any], x: torch.Tensor) -> bool:
    """Whether the call had a tensor input besides ``x``."""
    return any(isinstance(v, torch.Tensor) and v is not x
               for v in (*args, *kwargs.values()))


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
