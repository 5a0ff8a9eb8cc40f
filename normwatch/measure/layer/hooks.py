"""The hooks of one norm layer: what torch calls, wired to the layer's recorder.

    >>> hook = LayerHook(layer, module, row, runtime)   # registers its hooks on ``module``
    >>> hook.remove()                                    # the module as it was

The forward hook reads a call's arguments (:mod:`~normwatch.measure.layer.calls`), asks
the recorder whether it counts and has it recorded
(:class:`~normwatch.measure.layer.recorder.Recorder`); where ``torch.compile`` traces it,
the compiled path does (:mod:`~normwatch.measure.layer.compiled`); where the native
backend serves the layer, a C++ lane takes the common call with no Python frame and hands
every other call to this hook (:mod:`~normwatch.measure.backends.native.lane`). Any
exception disables the layer with one warning; training goes on (:mod:`normwatch.guarded`).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from normwatch.measure.backends.native import lane as native_lane
from normwatch.measure.backends.native.backend import through_reader
from normwatch.measure.layer.calls import input_of, other_tensor, output_of
from normwatch.measure.layer.compiled import CompiledPath
from normwatch.measure.layer.gradients import GradHooks, through_formula
from normwatch.measure.layer.recorder import Recorder, Runtime
from normwatch.measure.layer.unwatched import Bound, PicklesUnwatched
from normwatch.measure.state.backend import Launcher
from normwatch.records import NormLayer


class LayerHook(PicklesUnwatched):
    """The hooks on one layer; see the module docstring (a pickled model's:
    :mod:`~normwatch.measure.layer.unwatched`)."""

    def __init__(self, layer: NormLayer, module: nn.Module, row: int, runtime: Runtime,
                 home: torch.device | None = None) -> None:
        self.layer = layer
        self.module = module
        self.row = row
        self.rt = runtime
        self.recorder = Recorder(layer, module, row, runtime, off=self.remove)
        self.counts = self.recorder.counts
        self.compiled = CompiledPath(self.recorder)
        home = home or module_device(module)
        if home is not None and home.type != "meta":  # meta: placed at its first real call
            self.home(home)
        native = runtime.backend(torch.device("cpu")).name == "native"
        served = None if home is None or home.type == "meta" else runtime.backend(home)
        launcher = None if served is None else served.launcher()
        self._lane_state = native_lane.state(runtime, self.recorder, row, layer.token_size,
                                             launcher) \
            if (native and home is not None and home.type == "cpu") or launcher else None
        """The C++ lane's state (``None``: every call is this object's): see
        :mod:`~normwatch.measure.backends.native.lane`; on the CPU the native backend's
        reader's, where Triton serves the layer (CUDA) the kernel's launch."""
        self.compiled.serve(self._lane_state)
        built = None if self._lane_state is None else native_lane.module()
        self.handle: RemovableHandle | None = module.register_forward_hook(
            self if built is None else Bound(built.hook, self), with_kwargs=True)
        """Torch calls the lane's hook bound to this one where the layer has a lane state
        (it built the lane), else this one."""
        if runtime.gradients:
            self._hook_gradients(native, launcher)

    def _hook_gradients(self, native: bool, launcher: Launcher | None) -> None:
        """The layer's gradient hooks (in C++ where the forward's lane is: tokens its last
        dim; a launch lane's read by the ``launcher``, a compiled output gradient with
        the one through the norm by its ``lane_through_plan``'s launch)."""
        layer, module, rows, rt = self.layer, self.module, self.recorder.rows, self.rt
        through = None if layer.token_size is None else \
            through_formula(layer.kind, rows.eps, rows.one_plus_w)
        weight = getattr(module, "weight", None)
        # the formula is the module's where its weight is `weight`, or it has none
        computable = native and through is not None and (
            isinstance(weight, torch.Tensor) or next(module.parameters(), None) is None)
        through_plan = None if through is None else \
            partial(launcher.lane_through_plan, rows) if launcher is not None else \
            through_reader(rows).plan if computable else None
        lane = None if self._lane_state is None or layer.token_size is None else partial(
            native_lane.grad_lane, runtime=rt, lender=rt.accumulator.grad_buffers,
            row=self.row, width=layer.token_size, eps=rows.eps, through_plan=through_plan,
            launcher=launcher)
        recorder = self.recorder
        grads = recorder.grads = GradHooks(rows, rt.backend, recorder.grad_target,
                                           recorder.stage_grad, recorder.fail, through,
                                           computable, lane, rt.toggled)
        grads.watch_weight(weight)
        self.compiled.hook_grads(through is not None)

    @property
    def grads(self) -> GradHooks | None:
        """The layer's gradient hooks (``None``: gradients are not measured)."""
        return self.recorder.grads

    def home(self, device: torch.device) -> None:
        """Place this layer on ``device`` (outside any graph): its accumulator's block, and
        the tensor compiled calls name the layer by."""
        self.rt.accumulator.place(device)
        self.recorder.state = self.compiled.place(device)

    def remove(self) -> None:
        """Detach from the module (harmless twice)."""
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        if self.recorder.grads is not None:
            self.recorder.grads.close()
        self.compiled.remove()

    @property
    def disabled_reason(self) -> str | None:
        """Why this hook failed and was removed (``None``: it works)."""
        return self.recorder.failed

    def _fail(self, exc: Exception) -> None:
        self.recorder.fail(exc)

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any], output: Any
    ) -> torch.Tensor | None:
        # guarded as @guarded does, in place: the hottest hook, and a wrapper's frame
        # costs a few µs a call inside a training step
        try:
            if torch.compiler.is_compiling():
                return self.compiled.trace(module, args, kwargs, output)
            if self.rt.paused:
                return None
            x = input_of(args, kwargs)
            recorder = self.recorder
            if x is None or not x.is_floating_point() or x.is_meta:
                recorder.skip(x)
            elif recorder.counts_call(module):
                alone = not other_tensor(args, kwargs, x)
                recorder.record(module, x, output_of(output), alone,
                                alone and type(output) is torch.Tensor)
        except Exception as exc:  # never take the training run down
            self._fail(exc)
        return None

    def _tail(self, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any],
              output: torch.Tensor, full: bool) -> None:
        """The rest of a call the C++ lane counted and staged, on full-tier steps and the
        interval's first call (:meth:`Recorder.after`)."""
        x = args[0]
        self.recorder.after(module, x, output, (len(args) == 1 and not kwargs)
                            or not other_tensor(args, kwargs, x))


def module_device(module: nn.Module) -> torch.device | None:
    """Where ``module``'s parameters or buffers live (``None``: it has none)."""
    for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
        return t.device
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return None
