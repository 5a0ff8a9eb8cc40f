"""Gradients through one norm: what arrives at its output, what it passes back, and the
hidden state's gradient where it reads it; and its weight's gradient.

    >>> hooks = GradHooks(tokens, target, fail)       # one per norm layer
    >>> view = hooks.watch_input(x)  # forward pre-hook: the norm reads the view
    >>> hooks.watch_output(y)        # forward hook

Tensor hooks registered in the forward (on full-tier steps) fire in the backward with
``dL/dy`` (``grad_out``, on the output), ``dL/dx`` through the norm only (``grad_in``, on
a view of the input that only the norm reads) and ``dL/dx`` in total (``grad_hidden``, on
the input itself: the residual stream of a pre-norm block). Each folds a few numbers into
the layer's accumulator row in place (:func:`fold_grad`): tensor ops only, no host sync.
Compiled code taps the input and output with :class:`_Tap` instead (an autograd function
carrying the row on ``ctx``, traced into the backward graph); the hidden state keeps its
tensor hook. Hooks and taps live on the step's autograd graph and go with it: no tensor
is kept past the step.

The weight's gradient is measured by a hook on the parameter, registered once: it fires
with each backward's local gradient, before DDP reduces it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from normwatch.catalog import COLUMNS, GRAD_SITES, GRAD_SUMS

SUM_AT = {site: COLUMNS.index(f"{site}_tokens") for site in GRAD_SITES}
"""Where each site's summed columns start (adjacent, :data:`GRAD_SUMS` order)."""
PEAK_AT = {site: COLUMNS.index(f"{site}_absmax") for site in GRAD_SITES}
WEIGHT_AT = COLUMNS.index("weight_grads")
assert all(COLUMNS[SUM_AT[s]:SUM_AT[s] + len(GRAD_SUMS)] == tuple(f"{s}_{c}" for c in GRAD_SUMS)
           for s in GRAD_SITES)
assert COLUMNS[WEIGHT_AT + 1] == "weight_grad_sumsq"

Tokens = Callable[[torch.Tensor], torch.Tensor]
"""A layer's token view (``(tokens, elements)``, as its forward hook reads x and y)."""
Target = Callable[[], "tuple[torch.Tensor, torch.Tensor] | None"]


def reduce_grad(g: torch.Tensor, tokens: Tokens) -> tuple[torch.Tensor, torch.Tensor]:
    """One gradient as ``([tokens, finite tokens, sum of squares, elements], max |g|)``
    over its finite tokens (``tokens`` gives the layer's token view): float32 on its
    device, six row reductions."""
    t = tokens(g).float()
    a = t.abs().amax(1)  # NaN/inf exactly on the tokens holding them
    ok = a.isfinite()
    okf = ok.float()
    sumsq = torch.where(ok, (t * t).sum(1), 0.0).sum()
    finite = okf.sum()
    sums = torch.stack([torch.ones_like(okf).sum(), finite, sumsq, finite * t.shape[1]])
    return sums, torch.where(ok, a, -math.inf).amax()


def fold_grad(state: torch.Tensor, gate: torch.Tensor, site: str, g: torch.Tensor,
              tokens: Tokens) -> None:
    """Fold gradient ``g`` measured at ``site`` into a layer's accumulator row ``state``
    in place, where the 0-d bool ``gate`` is true."""
    sums, peak = reduce_grad(g.detach(), tokens)
    start, n = SUM_AT[site], len(GRAD_SUMS)
    cells = state[start:start + n]
    cells.add_(torch.where(gate, sums, 0.0).to(state.dtype))
    at = PEAK_AT[site]
    cell = state[at:at + 1]
    cell.copy_(torch.fmax(cell, torch.where(gate, peak, -math.inf).to(state.dtype).reshape(1)))


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (a DTensor's local shard; a plain tensor itself)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def fold_weight_grad(state: torch.Tensor, gate: torch.Tensor, g: torch.Tensor) -> None:
    """Fold one backward's weight gradient (its local shard, for a DTensor) into
    ``state``: one backward pass and its squared norm."""
    shard = local(g).detach().float()
    both = torch.stack([torch.ones((), device=shard.device), (shard * shard).sum()])
    cells = state[WEIGHT_AT:WEIGHT_AT + 2]
    cells.add_(torch.where(gate.to(shard.device), both, 0.0).to(state.dtype))


class _Tap(torch.autograd.Function):
    """Identity whose backward folds the gradient into a layer's row; the row travels
    on ``ctx`` (not ``save_for_backward``: no version check when another backward of the
    same compiled region folded into it first)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, state: torch.Tensor, gate: torch.Tensor,
                site: str, hooks: GradHooks) -> torch.Tensor:
        ctx.state, ctx.gate, ctx.site, ctx.tokens = state, gate, site, hooks.tokens
        # The norm's output goes on into the model, which may modify it in place: a copy
        # (a view of a custom Function's output may not be). Its input is only read.
        return t.clone() if site == "grad_out" else t.view_as(t)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        fold_grad(ctx.state, ctx.gate > 0, ctx.site, g, ctx.tokens)
        return g, None, None, None, None


class GradHooks:
    """The gradient side of one layer's hook (see the module docstring).

    ``target()`` gives the layer's gradient row and gate (0-d), or ``None`` while
    it has no home; ``fail`` disables the layer on an exception (eager only: a traced
    hook must not touch Python state).
    """

    def __init__(self, tokens: Tokens, target: Target,
                 fail: Callable[[Exception], None]) -> None:
        self.tokens = tokens
        self._target = target
        self._fail = fail
        self._weight: torch.Tensor | None = None
        self._weight_handle: RemovableHandle | None = None

    def watch_input(self, x: torch.Tensor) -> torch.Tensor:
        """Hook ``x`` (the hidden state's gradient) and return the view of it the norm
        must read instead (the gradient through the norm only)."""
        if not isinstance(x, nn.Parameter):  # a leaf that lives on keeps its hooks
            x.register_hook(self._hidden)  # type: ignore[no-untyped-call]
        return self._tap(x, "grad_in", self._in, view=True)

    def watch_output(self, y: torch.Tensor) -> torch.Tensor:
        """Hook the norm's output (the gradient arriving at it); returns the tensor the
        model must go on with (compiled code: a tap in its place)."""
        return self._tap(y, "grad_out", self._out, view=False)

    def _tap(self, t: torch.Tensor, site: str, hook: Callable[[torch.Tensor], None],
             view: bool) -> torch.Tensor:
        """An identity view of ``t`` whose gradient is measured at ``site``. Compiled:
        :class:`_Tap` carries the row on ``ctx`` (hooks traced into a compiled backward
        save it with a version check, so two forwards before one backward failed)."""
        target = self._target() if torch.compiler.is_compiling() else None
        if target is None:
            hooked = t.view_as(t) if view else t
            hooked.register_hook(hook)  # type: ignore[no-untyped-call]
            return hooked
        return _Tap.apply(t, target[0], target[1], site, self)  # type: ignore[no-any-return, no-untyped-call]

    def watch_weight(self, weight: object) -> None:
        """Hook the layer's weight once (again when the module's weight is replaced, as
        FSDP2 does with the unsharded parameter)."""
        if weight is self._weight or not isinstance(weight, torch.Tensor) \
                or not weight.requires_grad:
            return
        self.remove()
        self._weight = weight
        self._weight_handle = weight.register_hook(  # type: ignore[no-untyped-call]
            self._weight_grad)

    def remove(self) -> None:
        """Remove the weight's hook (the activation hooks go with their graphs)."""
        if self._weight_handle is not None:
            self._weight_handle.remove()
            self._weight_handle = None
        self._weight = None

    def _out(self, g: torch.Tensor) -> None:
        self._fold("grad_out", g)

    def _in(self, g: torch.Tensor) -> None:
        self._fold("grad_in", g)

    def _hidden(self, g: torch.Tensor) -> None:
        self._fold("grad_hidden", g)

    def _fold(self, site: str, g: torch.Tensor) -> None:
        try:
            target = self._target()
            if target is None or not g.numel():
                return
            state, flag = target
            if g.device == state.device:
                fold_grad(state, flag > 0, site, g, self.tokens)
                return
            moved = state.to(g.device)  # the model moved after watch(): a copy per call
            fold_grad(moved, (flag > 0).to(g.device), site, g, self.tokens)
            state.copy_(moved.to(state.device))
        except Exception as exc:  # never take the training run down
            self._fail(exc)

    def _weight_grad(self, g: torch.Tensor) -> None:
        try:
            target = self._target()
            if target is not None and g is not None:
                state, flag = target
                fold_weight_grad(state, flag > 0, g)
        except Exception as exc:  # never take the training run down
            self._fail(exc)
