"""The C++ lanes' Python side: a training call of the common CPU case recorded with no
Python frame around it, the full tier's gradient hooks (:class:`GradLane`) the same, and
(``sampler.cpp``, in the same module) the optimizer's step hooks around the update
sample's kernel (:class:`~normwatch.measure.backends.native.sampler.NativeSampler`).
What they read and write of Python's is :mod:`~normwatch.measure.backends.native.contract`'s.

Inside a training step each line of a hook's Python costs several times what it costs
warm (the model's work leaves the interpreter's code and objects out of the caches): a
sentinel call's C read took 23 µs at d=128 and its Python around it ~80. ``lane.cpp``
records the common call as :meth:`Recorder.record
<normwatch.measure.layer.recorder.Recorder.record>` does with the native backend and
hands every other call to the Python hook; on CUDA, where the Triton backend serves a
layer, the same lane launches the fused kernel instead (a *launch lane*: the launch is
a sentinel call's only Python, against ~20 frames of the hook's). ``grads.cpp``'s
gradient hooks (a node's pre-hook per site, the output node's that also computes the
gradient through the norm, the weight's tensor hook) are C++ objects torch calls with
no Python frame and no ``RemovableHandle``: inside a backward a Python hook that only
returns costs ~40 µs.
The sources are compiled at first use against torch's headers
(:func:`~normwatch.measure.backends.native.build.lane_path`, ~25 s once per machine and
torch).

Torch calls the forward hook as ``functools.partial(hook, layer)``; while Dynamo traces,
a Python stand-in (:func:`torch._dynamo.substitute_in_graph`) calls ``layer`` instead, so
compiled graphs are traced as before. Where a compiled model runs a stretch eagerly and
Dynamo compiles the frames run under it (after a graph break: FSDP2's hooks), the lane
calls ``layer`` too, which Dynamo traces: the Python the lane calls (the lender, the
accumulator, ``_tail``) would each be compiled apart, step after step. Without a C++
compiler, torch's headers or the C library, or with ``NORMWATCH_NATIVE=0`` or
``NORMWATCH_LANE=0``, the Python hook is registered itself.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from normwatch.catalog import KEY_STRIDE
from normwatch.measure.backends.native import build, contract
from normwatch.measure.backends.native.readers import grad_read_plan, moments_of, row_plan
from normwatch.measure.state.backend import Launcher
from normwatch.measure.state.buffers import RowBuffers
from normwatch.measure.state.rows import CallRows, GradRows

log = logging.getLogger(__name__)
assert CallRows._fields == contract.ROWS_FIELDS and GradRows._fields == contract.GRAD_ROWS_FIELDS


@functools.cache
def module() -> ModuleType | None:
    """The compiled lane (built now if not cached), or ``None`` where it cannot be."""
    if os.environ.get("NORMWATCH_LANE", "1") == "0":
        return None
    lib = build.library()
    if lib is None:
        return None
    try:
        built = build.load(build.lane_path())
        built.setup(contract.NAMES, *(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
                                      for name in ("normwatch_rows_planned",
                                                   "normwatch_grad_rows_planned",
                                                   "normwatch_through")),
                    torch._C._dynamo.eval_frame.get_eval_frame_callback, contract.MAX_NODES)
        built.setup_sampler(ctypes.cast(lib.normwatch_sample, ctypes.c_void_p).value)
        _stand_in(built.hook)
    except Exception as exc:  # no C++ compiler, no headers, a failed build: Python's lane
        log.debug("normwatch: the C++ lane is not built (%s)", exc)
        return None
    return built


def compiled_for(path: Any, lane: State | None
                 ) -> tuple[Callable[..., None], Callable[..., None]]:
    """What a compiled call and gradient of a layer run (its
    :class:`~normwatch.measure.layer.compiled.CompiledPath` ``path``'s ``call`` and
    ``grad``): the C++ lane's, bound to it, where the layer has a lane state, else
    ``path.compiled_call`` and ``path.compiled_grad``."""
    built = None if lane is None else module()
    if built is None:
        return path.compiled_call, path.compiled_grad
    return functools.partial(built.observe, path), functools.partial(built.observe_grad, path)


class State:
    """A layer's lane state (its hook's ``_lane_state``): what the lane holds of it, in
    a capsule. A copy of the hook (``copy.deepcopy`` of a watched model: an EMA copy) or
    a pickle of it gets ``None``: its calls are all the Python hook's."""

    __slots__ = ("capsule",)

    def __init__(self, capsule: object) -> None:
        self.capsule = capsule

    def __reduce__(self) -> tuple[Callable[[], None], tuple[()]]:
        return nothing, ()


def nothing() -> None:
    """What a copy of a C++ state is (:meth:`State.__reduce__`): none."""
    return None


def state(runtime: Any, recorder: Any, row: int, width: int | None,
          launcher: Launcher | None = None) -> State | None:
    """A layer's lane state (``recorder``: the layer's
    :class:`~normwatch.measure.layer.recorder.Recorder`), or ``None``: no lane for it
    (tokens that are not its last dim, or no lane built). The lane plans a new layout
    (of an input and output alike) with
    :func:`~normwatch.measure.backends.native.readers.row_plan`, in the full tier with
    the layer's moments, and borrows from the accumulator's lender; a *launch lane*
    (``launcher``: the backend of a layer on CUDA, or in Triton's interpreter) plans and
    reads with the launcher's ``lane_plan`` and ``lane_launch`` instead, and leaves the
    full tier's gradient hooks to Python."""
    built = module()
    if built is None or width is None:
        return None
    rows = recorder.rows
    planner = row_plan if launcher is None else launcher.lane_plan
    return State(built.lane(runtime, recorder, recorder.counts, runtime.accumulator.buffers,
                            planner, CallRows, row, width, rows.eps, rows.centred,
                            KEY_STRIDE, moments_of(rows.centred),
                            None if launcher is None else launcher.lane_launch))


class GradLane:
    """A layer's gradient hooks in C++ (:class:`~normwatch.measure.layer.gradients.GradHooks`'
    ``_lane``): ``site(t, site)`` pre-hooks the node that made ``t`` (its gradient read
    at ``site``), ``out(y, x, weight)`` the node that made the norm's output ``y`` (its
    gradient and the one through the norm), ``through(nodes)`` the norm's own nodes (the
    gradient through it, from their parts), ``weight(w)`` hooks the weight (a handle with
    ``remove()``). Each reads as GradHooks' own hook and calls its method where that is
    not the plain case. Compiled autograd, which runs no C++ hook, gets from each the
    Python hook it stands for. A copy (an EMA ``deepcopy``) gets ``None``: Python's
    hooks."""

    __slots__ = ("_hook_weight", "_unhook", "capsule", "close", "out", "site", "through")

    def __init__(self, built: ModuleType, capsule: object) -> None:
        self.capsule = capsule
        """(what the forward's lane hooks a full-tier call's gradients with)"""
        self.site = functools.partial(built.hook_site, capsule)
        self.out = functools.partial(built.hook_out, capsule)
        self.through = functools.partial(built.hook_through, capsule)
        """``through(nodes)``: post-hooks on the norm's ``(node, k)`` that feed its input,
        gathering the gradient through it; ``False``: a node is not torch's C++ (a Python
        ``autograd.Function``'s): none placed."""
        self._hook_weight = functools.partial(built.hook_weight, capsule)
        self._unhook = built.unhook
        self.close = functools.partial(built.close, capsule)
        """From now on its hooks do nothing (the watch closed)."""

    def weight(self, w: torch.Tensor) -> WeightHandle:
        return WeightHandle(w, self._hook_weight(w), self._unhook)

    def __reduce__(self) -> tuple[Callable[[], None], tuple[()]]:
        return nothing, ()


class WeightHandle:
    """Removes a weight's C++ hook (as a ``RemovableHandle`` does a Python one's)."""

    __slots__ = ("_handle", "_unhook", "_weight")

    def __init__(self, weight: torch.Tensor, handle: int,
                 unhook: Callable[[torch.Tensor, int], None]) -> None:
        self._weight: torch.Tensor | None = weight
        self._handle, self._unhook = handle, unhook

    def remove(self) -> None:
        if self._weight is not None:
            self._unhook(self._weight, self._handle)
            self._weight = None


def grad_lane(owner: object, runtime: Any, lender: RowBuffers, row: int, width: int,
              eps: float, through_plan: Callable[..., object] | None,
              launcher: Launcher | None = None) -> GradLane | None:
    """``owner``'s (a GradHooks') gradient hooks in C++, or ``None``: no lane built. Its
    sites' plans come from :func:`~normwatch.measure.backends.native.readers.
    grad_read_plan`, the gradient through the norm's from ``through_plan`` (its
    ThroughReader's; a launch lane's: its launcher's ``lane_through_plan``, for compiled
    output gradients; ``None``: never computed here); its rows go in ``lender``'s
    buffers. A launch lane's (``launcher``: the backend's of a layer on CUDA) plans and
    reads each site with the launcher's ``lane_grad_plan`` and ``lane_grad_launch``, and
    takes the weight's norm by torch's op."""
    built = module()
    if built is None:
        return None
    planner = grad_read_plan if launcher is None else launcher.lane_grad_plan
    return GradLane(built, built.grads(weakref.ref(owner), runtime, lender, GradRows, row,
                                       width, eps, planner, through_plan or _no_plan,
                                       None if launcher is None else launcher.lane_grad_launch))


def _no_plan(*tensors: object) -> None:
    return None


@functools.cache
def _stand_in(lane_hook: Callable[..., Any]) -> None:
    """While Dynamo traces, the Python hook in the place of the lane's (registered bound
    to it as ``functools.partial(lane_hook, python_hook)``): Dynamo cannot trace a
    builtin. Once per builtin: a module loaded again from its file
    has the same."""

    @torch._dynamo.substitute_in_graph(lane_hook, skip_signature_check=True)
    def hook(python_hook: Callable[..., Any], *args: Any) -> Any:
        return python_hook(*args)


