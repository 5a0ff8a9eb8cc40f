"""A compiled hook's measurements as opaque operators: one call each in the graph.

Traced inline, a norm call's measurement (its row reductions, the fold into the layer's
row, the output check; in the backward, the gradient folds) adds a few dozen small ops
at every call site; inductor generates, compiles and links code for each (a two-block
model took 87 s to compile watched, 10 s unwatched). Here they are ``torch.library``
custom ops: the compiler sees one extern call per site, with its inputs and the rows it
mutates declared, and runs the same eager functions the eager hooks use
(:func:`fold_in_place`, :func:`~normwatch.measure.gradients.fold_grad`), so compiled and
eager calls give the same numbers and compiling a watched model costs what compiling the
model costs.

What an op needs to know about its layer travels as a string key (:func:`site_key`)
built from the layer's description without its name: identical layers (every block of a
transformer) share one key, so a block compiled once still serves every layer. A failure
inside an op body measures nothing and is kept by the row it was to fold into; the
layer's hook finds it at the next flush (:func:`failure`) and disables itself with one
warning: training goes on.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property, partial

import torch

from normwatch.catalog import KEY_STRIDE, SCORE_BASE
from normwatch.measure.accumulator import MISMATCH_COLUMN, fold_into
from normwatch.measure.gradients import Through, fold_grad, through_formula
from normwatch.measure.reductions import (
    CallRows,
    carried_eps,
    checked_rows,
    fold_one,
    mismatch,
    reduce_call,
    token_view,
)
from normwatch.measure.reference import expected_from, flattens_heads
from normwatch.records import Limits, NormLayer

Params = Sequence[torch.Tensor | None]
"""A layer's reference parameters (:func:`~normwatch.measure.reference.reference_params`)."""


@dataclass(frozen=True)
class Site:
    """What the measurement of one kind of layer needs (its name left out)."""

    layer: NormLayer
    limits: Limits

    @cached_property
    def eps(self) -> float:
        """The eps the fold compares against (0 when it is unknown)."""
        return 0.0 if math.isnan(self.layer.eps) else self.layer.eps

    @cached_property
    def tokens(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The layer's token view (``(tokens, elements)``)."""
        return layer_tokens(self.layer)

    @cached_property
    def through(self) -> Through | None:
        """The gradient through the norm from its output's (``None``: not a layer/RMS norm
        of known width)."""
        layer = self.layer
        return None if layer.token_size is None else \
            through_formula(layer.kind, self.eps, layer.weight_form == "1+w")


_SITES: dict[str, Site] = {}


def site_key(layer: NormLayer, limits: Limits) -> str:
    """The key of ``layer``'s :class:`Site` (registered on first use; the same for layers
    that differ only by name)."""
    layer = dataclasses.replace(layer, name="")
    key = repr((layer, limits))
    _SITES.setdefault(key, Site(layer, limits))
    return key


def site(key: str) -> Site:
    """The :class:`Site` of ``key`` (:func:`site_key`)."""
    return _SITES[key]


def layer_tokens(layer: NormLayer) -> Callable[[torch.Tensor], torch.Tensor]:
    """``layer``'s token view: :func:`~normwatch.measure.reductions.token_view` with its
    shape, straight to ``(-1, width)`` in the common case."""
    token_ndim = len(layer.normalized_shape) if layer.normalized_shape else 1
    view = partial(token_view, kind=layer.kind, token_ndim=token_ndim,
                   groups=layer.num_groups or 1, width=layer.token_size)
    width = layer.token_size
    if width is None:
        return view
    return partial(_chunk_tokens, width=width, other=view)


def _chunk_tokens(x: torch.Tensor, width: int,
                  other: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Tokens of ``width`` elements, straight away when the last dim is one token."""
    return x.reshape(-1, width) if x.dim() and x.shape[-1] == width else other(x)


# -- the forward: one call folded into its layer's row ------------------------------------


def fold_in_place(where: Site, x: torch.Tensor, y: torch.Tensor | None, params: Params,
                  state: torch.Tensor, ctl: torch.Tensor, check: bool, training: bool,
                  meta: torch.Tensor | None = None) -> int:
    """Fold one call (input ``x``, output ``y``, both detached) into ``state`` in place,
    reading the step, tier, call counter, pause and check flags from ``ctl``
    (:data:`~normwatch.measure.hooks.CONTROL`), and count the call in ``ctl``; returns the
    token count. ``check``: run the output check (its flag in ``ctl`` selects it).
    ``meta``: the layer's :data:`~normwatch.measure.accumulator.META` row, where the
    earliest call's score is kept (compiled calls: its place in forward order). Tensor
    ops only, no host sync."""
    tokens = where.tokens(x)
    out = y if y is not None and y.is_floating_point() and y.numel() else None
    out_tokens = output_tokens(where, out, x)
    moved = x.device != state.device
    if moved:  # the model moved after watch(): correct, with a copy per call
        _warn_device(x.device, state.device)
    flags = ctl.to(x.device) if moved else ctl
    key = flags[0] * KEY_STRIDE + flags[2]
    call = reduce_call(tokens, out_tokens, where.layer.kind, where.eps, True, 0, key)
    values = fold_one(call, flags[1] > 0, where.limits)
    result = output_check(where, x, out, params, call, tokens.shape[1], training) \
        if out is not None and check else None
    if result is not None:  # [mismatch, eps]
        result = torch.where(flags[4] > 0, result, -math.inf).to(values.dtype)
        values = torch.cat([values[:MISMATCH_COLUMN], result, values[MISMATCH_COLUMN + 2:]])
    fold_into(state, values.to(state.device) if moved else values, ctl[3] > 0)
    if meta is not None:
        first = meta[4:5]
        score = (SCORE_BASE - key).to(first.device, first.dtype).reshape(1)
        first.copy_(torch.where(ctl[3:4].to(first.device) > 0, first.fmax(score), first))
    ctl[2:3].add_(1.0)
    return int(tokens.shape[0])


def output_tokens(where: Site, out: torch.Tensor | None, x: torch.Tensor
                  ) -> torch.Tensor | None:
    """The output as tokens: the input's layout, or for a wrong-shaped output its last
    dim, whatever those tokens mean; ``None`` for no (or an empty) output."""
    if out is None or out.numel() == 0:
        return None
    if out.shape == x.shape:
        return where.tokens(out)
    return out.reshape(-1, out.shape[-1]) if out.dim() else out.reshape(1, 1)


def output_check(where: Site, x: torch.Tensor, y: torch.Tensor, params: Params,
                 call: CallRows, width: int, training: bool) -> torch.Tensor | None:
    """``[mismatch, carried eps]`` (float64) of output ``y`` against the kind's formula,
    over the rows :func:`checked` picks; ``None``: no formula applies."""
    params = tuple(params)
    x, y = checked(where, x, y, params, call, width)
    ref = expected_from(where.layer, x, params, training)
    if ref is None:
        return None
    if flattens_heads(ref.shape, y.shape):  # heads flattened on the way out
        ref = ref.reshape(y.shape)
    err = torch.ones((), dtype=torch.float64, device=y.device) if ref.shape != y.shape \
        else mismatch(where.tokens(y), where.tokens(ref)).double()  # wrong shape: 1
    return torch.stack([err, carried_eps(y)])


def checked(where: Site, x: torch.Tensor, y: torch.Tensor, params: Params, call: CallRows,
            width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The part of ``x`` and ``y`` an output check reads: for layer and RMS norms whose
    parameters cover whole rows of trailing dims, the rows
    :func:`~normwatch.measure.reductions.checked_rows` picks (a few dozen, whatever the
    call's size); else all of them."""
    if where.layer.kind not in ("layernorm", "rmsnorm") or y.shape != x.shape:
        return x, y
    lowest = max([1] + [p.dim() for p in params if p is not None])
    for d in range(lowest, x.dim()):  # the fewest trailing dims holding tokens
        trailing = x.shape[x.dim() - d:]
        span = math.prod(trailing)
        if span % width == 0:
            rows = checked_rows(call.hi, call.lo, span // width)
            return x.reshape(-1, *trailing)[rows], y.reshape(-1, *trailing)[rows]
    return x, y


_WARNED: set[str] = set()


def _warn_device(got: torch.device, home: torch.device) -> None:
    message = (f"normwatch: a norm runs on {got} but its statistics live on {home} (the "
               "model moved after watch()?); each call copies them across: attach after "
               "moving the model")
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


_FAILURES: dict[int, Exception] = {}
"""The first failure of an op body, by the address of the row it was to fold into."""


def _failed(row: torch.Tensor, exc: Exception) -> None:
    _FAILURES.setdefault(row.data_ptr(), exc)


def failure(*rows: torch.Tensor | None) -> Exception | None:
    """The failure an op body met folding into one of ``rows`` (then forgotten), if any."""
    found = [_FAILURES.pop(row.data_ptr(), None) for row in rows if row is not None]
    return next((exc for exc in found if exc is not None), None)


@torch.library.custom_op("normwatch::fold_call", mutates_args=("state", "ctl", "meta"))
def fold_call(x: torch.Tensor, y: torch.Tensor | None, params: Sequence[torch.Tensor | None],
              state: torch.Tensor, ctl: torch.Tensor, meta: torch.Tensor, key: str,
              check: bool, training: bool) -> None:
    """:func:`fold_in_place` as one operator (what compiled hooks call)."""
    try:
        fold_in_place(site(key), x, y, params, state, ctl, check, training, meta)
    except Exception as exc:  # never take the training run down
        _failed(state, exc)


@fold_call.register_fake
def _(x: torch.Tensor, y: torch.Tensor | None, params: Sequence[torch.Tensor | None],
      state: torch.Tensor, ctl: torch.Tensor, meta: torch.Tensor, key: str, check: bool,
      training: bool) -> None:
    return None


# -- the backward: one gradient folded into its layer's row -------------------------------


def fold_gradient(where: Site, g: torch.Tensor, state: torch.Tensor, gate: torch.Tensor,
                  at: str, x: torch.Tensor | None, weight: torch.Tensor | None) -> None:
    """Fold gradient ``g`` at site ``at`` into ``state`` where ``gate`` > 0; given the
    norm's input ``x`` (and ``weight``), ``g`` is the output's gradient and the gradient
    through the norm is folded too (:func:`~normwatch.measure.gradients.through_formula`)."""
    on = gate > 0
    fold_grad(state, on, at, g, where.tokens)
    if x is not None and where.through is not None:
        into = where.through(where.tokens(g), where.tokens(x), weight)
        fold_grad(state, on, "grad_in", into, _same)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


@torch.library.custom_op("normwatch::fold_grad", mutates_args=("state",))
def fold_grad_op(g: torch.Tensor, state: torch.Tensor, gate: torch.Tensor, at: str, key: str,
                 x: torch.Tensor | None, weight: torch.Tensor | None) -> None:
    """:func:`fold_gradient` as one operator (what compiled gradient hooks call)."""
    try:
        fold_gradient(site(key), g.detach(), state, gate, at, x, weight)
    except Exception as exc:  # never take the training run down
        _failed(state, exc)


@fold_grad_op.register_fake
def _(g: torch.Tensor, state: torch.Tensor, gate: torch.Tensor, at: str, key: str,
      x: torch.Tensor | None, weight: torch.Tensor | None) -> None:
    return None
