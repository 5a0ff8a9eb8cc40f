"""The compiled path of one layer's hook: what ``torch.compile`` traces, and what the
compiled graph's operators run.

Inside ``torch.compile`` the hook's traced body reads no Python value that changes
between steps and writes no Python state: it hands the call to one opaque operator
(``normwatch::observe``, :mod:`~normwatch.measure.layer.operators`) whose body, at run
time, is the eager recorder's (:meth:`CompiledPath.compiled_call`). The compiled graph neither
breaks nor recompiles, inside activation checkpoints too; compiling it costs what
compiling the model costs; and compiled and eager calls share one path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from normwatch.guarded import guarded
from normwatch.measure.layer.calls import input_of, other_tensor, output_of
from normwatch.measure.layer.operators import disown, observe, observe_grad, own, ticket
from normwatch.measure.layer.recorder import Recorder
from normwatch.measure.state.rows import SITES


class CompiledPath:
    """The traced hook of a layer and the bodies of its compiled operators (the
    :class:`Owner` of its accumulator row), over its ``recorder``.

    What the traced hook reads is this object's own (the layer's row, set where the row
    is placed: :meth:`place`; fixed options), its device's ticket and the call's: each
    Python object Dynamo reaches by two ways costs a guard that compiled code checks at
    every call (a watched 12-block model had 3,600 guards more than unwatched, and
    Dynamo traced it 2 s longer)."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.row: torch.Tensor | None = None
        """The layer's accumulator row (``None``: not placed yet)."""
        self.count_eval = recorder.rt.count_eval
        self.grads = False
        """Whether gradients are hooked (:meth:`hook_grads`)."""
        self.through = False
        self.width = recorder.layer.token_size

    def hook_grads(self, through: bool) -> None:
        """Hook the gradients of traced calls from now on; ``through``: the gradient
        through the norm too, from the output's (where its formula holds)."""
        self.grads, self.through = True, through

    def place(self, row: torch.Tensor) -> None:
        """Name the layer by ``row`` from now on (outside any graph)."""
        if self.row is not None:
            disown(self.row, self)
        own(row, self)
        self.row = row

    def remove(self) -> None:
        """Let the operators find this path no more."""
        if self.row is not None:
            disown(self.row, self)

    def _fail(self, exc: Exception) -> None:
        self.recorder.fail(exc)

    def trace(self, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any],
              output: Any) -> torch.Tensor | None:
        """The forward hook's body as ``torch.compile`` traces it; returns the output the
        model goes on with when it taps it (``None``: the output as it was). The hidden
        state's gradient is hooked on the input (a tensor hook: nothing is put between
        the input and the norm), the output's and the one through the norm on a tap in
        the output's place (:class:`_Tap`)."""
        row = self.row
        x = input_of(args, kwargs)
        if row is None or x is None or not x.is_floating_point() or x.is_meta:
            return None
        training = module.training and torch.is_grad_enabled()
        if not (training or self.count_eval):
            return None
        y = output_of(output)
        alone = not other_tensor(args, kwargs, x)
        # Python state is neither read nor written here (a checkpointed region is a
        # higher-order op that refuses side effects): the operator's body does that
        observe(x.detach(), None if y is None else y.detach(), row, ticket(row), alone)
        if not self.grads:
            return None
        if training and x.requires_grad and not isinstance(x, nn.Parameter):
            x.register_hook(self._hidden)  # type: ignore[no-untyped-call]
        if y is None or not y.requires_grad or not isinstance(output, torch.Tensor):
            return None
        weight = getattr(module, "weight", None)
        weight = weight.detach() if isinstance(weight, torch.Tensor) else None
        # the formula of the gradient through the norm holds for x alone, whole tokens
        fits = self.through and alone and y.shape == x.shape and (
            weight is None or weight.numel() == self.width)
        # the model goes on with the tapped output
        return _Tap.apply(y, row, x.detach() if fits else None,  # type: ignore[no-any-return, no-untyped-call]
                          weight)

    def _hidden(self, g: torch.Tensor) -> None:
        """The hidden state's gradient (the input's tensor hook)."""
        observe_grad(g, self.row, "grad_hidden", None, None)

    @guarded
    def compiled_call(self, x: torch.Tensor, y: torch.Tensor | None, alone: bool) -> None:
        """The body of a compiled call's operator, at run time: the recorder's (a call
        traced as counted; an activation checkpoint's recompute, inside the backward, is
        not counted again)."""
        recorder = self.recorder
        if recorder.rt.paused or recorder.failed is not None or \
                torch._C._current_graph_task_id() != -1:
            return
        recorder.record(recorder.module, x, y, alone)

    def compiled_grad(self, at: str, g: torch.Tensor, x: torch.Tensor | None,
                      weight: torch.Tensor | None) -> None:
        """The body of a compiled gradient's operator, at run time (see
        :meth:`GradHooks.measure`)."""
        recorder = self.recorder
        if recorder.grads is not None and recorder.failed is None:
            recorder.grads.measure(SITES.index(at), g, x, weight)


class _Tap(torch.autograd.Function):
    """Identity on a norm's output whose backward hands the gradient, with the norm's
    input and weight (detached: no edge to them), to ``normwatch::observe_grad``; the
    layer's row (what names it to the operator) travels on ``ctx``."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, row: torch.Tensor, x: torch.Tensor | None = None,
                weight: torch.Tensor | None = None) -> torch.Tensor:
        ctx.row, ctx.x, ctx.weight = row, x, weight
        # The norm's output goes on into the model, which may modify it in place: a copy
        # (a view of a custom Function's output may not be).
        return t.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        observe_grad(g, ctx.row, "grad_out", ctx.x, ctx.weight)
        return g, None, None, None
