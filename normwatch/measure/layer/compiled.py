"""The compiled path of one layer's hook: what ``torch.compile`` traces, and what the
compiled graph's operators run.

Inside ``torch.compile`` the hook's traced body reads no Python value that changes
between steps and writes no Python state: it hands the call to one opaque operator
(``normwatch::observe``, :mod:`~normwatch.measure.layer.operators`) whose body, at run
time, is the eager recorder's (:meth:`CompiledPath.compiled_call`), its common case the
C++ lane's where the layer has one (:mod:`~normwatch.measure.backends.native.lane`: no
Python frame but the operator's). The compiled graph neither
breaks nor recompiles, inside activation checkpoints too; compiling it costs what
compiling the model costs; and compiled and eager calls share one path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
from torch import nn

from normwatch.guarded import guarded
from normwatch.measure.backends.native import lane as native_lane
from normwatch.measure.layer.calls import input_of, other_tensor, output_of
from normwatch.measure.layer.operators import disown, observe, observe_grad, own, ticket
from normwatch.measure.layer.recorder import Recorder
from normwatch.measure.state.rows import HIDDEN, OUT


class CompiledPath:
    """The traced hook of a layer and the bodies of its compiled operators (the
    :class:`Owner` of the tensor that names its layer), over its ``recorder``.

    What the traced hook reads is this object's own (the layer's name, set where the
    layer is placed: :meth:`place`; fixed options), its device's ticket and the call's: each
    Python object Dynamo reaches by two ways costs a guard that compiled code checks at
    every call (a watched 12-block model had 3,600 guards more than unwatched, and
    Dynamo traced it 2 s longer)."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self._lane_state: native_lane.State | None = None
        """The layer's C++ lane state (``None``: none; :meth:`serve`)."""
        self.call: Callable[[torch.Tensor, torch.Tensor | None, bool], None] = \
            self.compiled_call
        """What a compiled call runs (``call(x, y, alone)``): the C++ lane where the layer
        has one, else :meth:`compiled_call`."""
        self.grad: Callable[[int, torch.Tensor, torch.Tensor | None, torch.Tensor | None],
                            None] = self.compiled_grad
        """What a compiled gradient runs (``grad(site, g, x, weight)``): the same."""
        self.name: torch.Tensor | None = None
        """The tensor naming the layer to the operators (``None``: not placed yet)."""
        self.count_eval = recorder.rt.count_eval
        self.grads = False
        """Whether gradients are hooked (:meth:`hook_grads`)."""
        self.through = False
        self.width = recorder.layer.token_size

    def serve(self, lane: native_lane.State | None) -> None:
        """Have the C++ lane of ``lane`` (the layer's lane state) record compiled calls'
        common case (``None``: Python records every call)."""
        self._lane_state = lane
        self.call, self.grad = native_lane.compiled_for(self, lane)

    def hook_grads(self, through: bool) -> None:
        """Hook the gradients of traced calls from now on; ``through``: the gradient
        through the norm too, from the output's (where its formula holds)."""
        self.grads, self.through = True, through

    def place(self, device: torch.device) -> torch.Tensor:
        """Name the layer on ``device`` from now on (outside any graph), by a tensor of
        its own that nothing writes (a compiled backward that reads it checks its
        version; the accumulator's row is written every step); returns it."""
        self.remove()
        name = self.name = torch.zeros(1, device=device)
        own(name, self)
        return name

    def remove(self) -> None:
        """Let the operators find this path no more."""
        if self.name is not None:
            disown(self.name, self)

    def _fail(self, exc: Exception) -> None:
        self.recorder.fail(exc)

    def trace(self, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any],
              output: Any) -> torch.Tensor | None:
        """The forward hook's body as ``torch.compile`` traces it (``None``: the model goes
        on with the output as it was). The gradients are hooked with tensor hooks, which
        put no node between the norm and the model: the input's (the hidden state's) and
        the output's, which with the input and the weight measures the gradient through
        the norm too (a custom ``autograd.Function`` tapping the output, as before,
        copied the output and kept the AOT autograd cache from storing the graph)."""
        name = self.name
        x = input_of(args, kwargs)
        if name is None or x is None or not x.is_floating_point() or x.is_meta:
            return None
        training = module.training and torch.is_grad_enabled()
        if not (training or self.count_eval):
            return None
        y = output_of(output)
        alone = not other_tensor(args, kwargs, x)
        # Python state is neither read nor written here (a checkpointed region is a
        # higher-order op that refuses side effects): the operator's body does that
        observe(x.detach(), None if y is None else y.detach(), name, ticket(name), alone)
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
        if fits:
            y.register_hook(partial(self._out, x.detach(), weight))  # type: ignore[no-untyped-call]
        else:
            y.register_hook(self._out_alone)  # type: ignore[no-untyped-call]
        return None

    def _hidden(self, g: torch.Tensor) -> None:
        """The hidden state's gradient (the input's tensor hook)."""
        observe_grad(g, self.name, HIDDEN, None, None)

    def _out(self, x: torch.Tensor, weight: torch.Tensor | None, g: torch.Tensor) -> None:
        """The output's gradient and, from it, ``x`` and ``weight``, the gradient through
        the norm (the output's tensor hook)."""
        observe_grad(g, self.name, OUT, x, weight)

    def _out_alone(self, g: torch.Tensor) -> None:
        """The output's gradient alone (the output's tensor hook)."""
        observe_grad(g, self.name, OUT, None, None)

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

    def compiled_grad(self, site: int, g: torch.Tensor, x: torch.Tensor | None,
                      weight: torch.Tensor | None) -> None:
        """The body of a compiled gradient's operator, at run time (see
        :meth:`GradHooks.measure`)."""
        recorder = self.recorder
        if recorder.grads is not None and recorder.failed is None:
            recorder.grads.measure(site, g, x, weight)
