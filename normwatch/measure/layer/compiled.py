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
from normwatch.measure.layer.operators import observe, ticket
from normwatch.measure.layer.recorder import Recorder
from normwatch.measure.state.rows import SITES


class CompiledPath:
    """The traced hooks of a layer and the bodies of its compiled operators (the
    :class:`Owner` of its accumulator row), over its ``recorder``."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def _fail(self, exc: Exception) -> None:
        self.recorder.fail(exc)

    def pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Forward pre-hook, compiled code only: a tensor hook on the input (the hidden
        state's gradient, :meth:`GradHooks.watch_hidden`). Nothing is put between the
        input and the norm: eager calls hook their gradients from the forward hook
        (:meth:`GradHooks.watch_call`), compiled ones from the output's tap. An eager
        call returns at once (before the guard's frame: every norm call pays it); where
        the C++ lane is built, its pre-hook returns in eager code without this frame and
        calls this where Dynamo traces or compiles the frames run
        (:func:`~normwatch.measure.backends.native.lane.pre_hook_for`)."""
        if torch.compiler.is_compiling():
            self._pre(module, args, kwargs)

    @guarded
    def _pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        grads = self.recorder.grads
        if grads is None or not (module.training and torch.is_grad_enabled()):
            return
        x = input_of(args, kwargs)
        if x is not None and x.requires_grad and x.is_floating_point():
            grads.watch_hidden(x)

    def trace(self, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any],
              output: Any) -> torch.Tensor | None:
        """The forward hook's body as ``torch.compile`` traces it; returns the output the
        model goes on with when it taps it (``None``: the output as it was)."""
        recorder = self.recorder
        x = input_of(args, kwargs)
        if x is None or not x.is_floating_point() or x.is_meta or recorder.state is None:
            return None
        if not (recorder.rt.count_eval or (module.training and torch.is_grad_enabled())):
            return None
        y = output_of(output)
        # Python state is neither read nor written here (a checkpointed region is a
        # higher-order op that refuses side effects): the operator's body does that
        observe(x.detach(), None if y is None else y.detach(), recorder.state,
                ticket(recorder.state), not other_tensor(args, kwargs, x))
        grads = recorder.grads
        if grads is not None and y is not None and y.requires_grad \
                and isinstance(output, torch.Tensor):
            weight = getattr(module, "weight", None)
            weight = weight if isinstance(weight, torch.Tensor) else None
            # the formula of the gradient through the norm holds for x alone, whole tokens
            fits = y.shape == x.shape and not other_tensor(args, kwargs, x) and (
                weight is None or weight.numel() == recorder.layer.token_size)
            # the model goes on with the tapped output
            return grads.watch_output(y, x if fits else None, weight)
        return None

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
