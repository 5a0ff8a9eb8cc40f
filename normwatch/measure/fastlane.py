"""The hooks' lanes in C++: a training call of the common CPU case measured with no
Python frame around it, the full tier's gradient hooks (:class:`GradLane`) the same, and
(``sampler.cpp``, in the same module) the optimizer's step hooks around the update
sample's kernel (:class:`~normwatch.measure.native_updates.NativeSampler`).

Inside a training step each line of a hook's Python costs several times what it costs
warm (the model's work leaves the interpreter's code and objects out of the caches): a
sentinel call's C read took 23 µs at d=128 and its Python around it ~80. ``lane.cpp``
(shipped with the package) measures the calls :meth:`LayerHook._lane
<normwatch.measure.hooks.LayerHook._lane>` takes exactly as it does (the same C read,
buffer, staged rows and counts, the lender's and the accumulator's common case run in
C++; in the full tier with the layer's moments; on an interval's first call
:meth:`LayerHook._tail <normwatch.measure.hooks.LayerHook._tail>` hooks the call's
gradients and notes its dtypes, and on a full-tier call the lane does that itself where
it is the common case: its only argument a float32 input with an autograd node, the
gradient through the norm computed, the weight already hooked; the dtypes are noted
where they changed, and a replaced method of the tail's is called) and hands every
other call to the Python hook. Its sources are compiled at first use against torch's
headers, side by side (~25 s, once per machine and torch: into
:func:`~normwatch.measure.native.cache_dir`, named by a hash of the sources, the
compiler, Python and torch).

The gradients' hooks (a node's pre-hook per site, the output node's that also computes
the gradient through the norm, the weight's tensor hook) are C++ objects torch calls
with no Python frame and no ``RemovableHandle``: inside a backward a Python hook that
only returns costs ~40 µs, and the full tier's four a norm took several times their C
reads. They read, plan, borrow buffers and stage rows as
:class:`~normwatch.measure.gradients.GradHooks`' hooks do, and call its methods for
every other case.

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
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import subprocess
import sys
import sysconfig
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from normwatch.catalog import KEY_STRIDE
from normwatch.measure import native
from normwatch.measure.reductions import CallRows

SOURCES = (Path(__file__).with_name("lane.cpp"), Path(__file__).with_name("sampler.cpp"))
"""The module's sources: the hooks' lanes, the update monitor's step hooks."""
NAME = "normwatch_lane"
PLAIN = (torch.Tensor, torch.nn.Parameter)
"""The tensor types the C++ hooks read as they are (no subclass: a DTensor is Python's)."""

log = logging.getLogger(__name__)


@functools.cache
def module() -> ModuleType | None:
    """The compiled lane (built now if not cached), or ``None`` where it cannot be."""
    if os.environ.get("NORMWATCH_LANE", "1") == "0":
        return None
    lib = native.library()
    if lib is None:
        return None
    try:
        built = _load(_built())
        built.setup(*(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in (
            "normwatch_rows_planned", "normwatch_grad_rows_planned", "normwatch_through")),
            torch._C._dynamo.eval_frame.get_eval_frame_callback)
        built.setup_sampler(ctypes.cast(lib.normwatch_sample, ctypes.c_void_p).value)
        _stand_in(built.hook)
        _stand_in(built.pre)
    except Exception as exc:  # no C++ compiler, no headers, a failed build: Python's lane
        log.debug("normwatch: the C++ lane is not built (%s)", exc)
        return None
    return built


def pre_hook_for(pre: Callable[..., Any], lane: State | None) -> Callable[..., Any]:
    """What torch is to call as a layer's forward pre-hook ``pre`` (``CompiledPath.pre``,
    which acts only in compiled code): the lane's, which returns at once in eager code,
    where the layer has a lane state (:func:`state`), else ``pre`` itself."""
    built = None if lane is None else module()  # (a state means it is built)
    return pre if built is None else functools.partial(built.pre, pre)


def hook_for(layer: Any, lane: State | None) -> Callable[..., Any]:
    """What torch is to call as ``layer``'s forward hook: the lane bound to it where it
    has a lane state (:func:`state`), else ``layer`` itself."""
    built = None if lane is None else module()  # (a state means it is built)
    return layer if built is None else functools.partial(built.hook, layer)


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


def state(runtime: Any, counts: Any, take: Callable[..., Any], row: int, width: int | None,
          eps: float, centred: bool, moments: str,
          own: tuple[Callable[..., Any], ...]) -> State | None:
    """A layer's lane state, or ``None``: no lane for it (tokens that are not its last
    dim, or no lane built). The lane plans a new layout (of an input and output alike)
    with :func:`~normwatch.measure.native.row_plan`, as the Python lane does: in the full
    tier with ``moments``. ``own``: ``RowBuffers.take``, ``Accumulator.stage`` and
    ``.stage_grad`` as their classes define them; where a lender's or accumulator's are
    still these, the lanes (this one's, the gradients') run their common case themselves;
    then :data:`~normwatch.measure.hooks.TAIL`, whose common case the lane runs on a
    full-tier call where a layer's and its gradient hooks' are still these."""
    built = module()
    if built is None or width is None:
        return None
    built.own(*own)
    return State(built.lane(runtime, counts, take, native.row_plan, CallRows, row, width,
                            eps, centred, KEY_STRIDE, moments))


class GradLane:
    """A layer's gradient hooks in C++ (:class:`~normwatch.measure.gradients.GradHooks`'
    ``_lane``): ``site(t, site)`` pre-hooks the node that made ``t`` (its gradient read
    at ``site``), ``out(y, x, weight)`` the node that made the norm's output ``y`` (its
    gradient and the one through the norm), ``weight(w)`` hooks the weight (a handle with
    ``remove()``). Each reads as GradHooks' own hook and calls its method where that is
    not the plain case. Compiled autograd, which runs no C++ hook, gets from each the
    Python hook it stands for. A copy (an EMA ``deepcopy``) gets ``None``: Python's
    hooks."""

    __slots__ = ("_hook_weight", "_unhook", "capsule", "close", "out", "site")

    def __init__(self, built: ModuleType, capsule: object) -> None:
        self.capsule = capsule
        """(what the forward's lane hooks a full-tier call's gradients with)"""
        self.site = functools.partial(built.hook_site, capsule)
        self.out = functools.partial(built.hook_out, capsule)
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


def grad_lane(owner: object, runtime: Any, take: Callable[..., Any], rows_type: type,
              row: int, width: int, eps: float,
              through_plan: Callable[[torch.Tensor], object] | None) -> GradLane | None:
    """``owner``'s (a GradHooks') gradient hooks in C++, or ``None``: no lane built. Its
    sites' plans come from :func:`~normwatch.measure.native.grad_read_plan`, the gradient
    through the norm's from ``through_plan`` (its ThroughReader's; ``None``: never
    computed here)."""
    built = module()
    if built is None:
        return None
    return GradLane(built, built.grads(weakref.ref(owner), runtime, take, rows_type, row,
                                       width, eps, native.grad_read_plan,
                                       through_plan or _no_plan))


def _no_plan(g: torch.Tensor) -> None:
    return None


@functools.cache
def _stand_in(lane_hook: Callable[..., Any]) -> None:
    """While Dynamo traces, the Python hook in the place of the lane's (``hook`` or
    ``pre``, registered bound to it as ``functools.partial(lane_hook, python_hook)``):
    Dynamo cannot trace a builtin. Once per builtin: a module loaded again from its file
    has the same."""

    @torch._dynamo.substitute_in_graph(lane_hook, skip_signature_check=True)
    def hook(python_hook: Callable[..., Any], *args: Any) -> Any:
        return python_hook(*args)


def _built() -> Path:
    from torch.utils import cpp_extension

    compiler, version = native.compiler("CXX", ("c++", "g++"), "C++")
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    lib = Path(torch.__file__).parent / "lib"
    compile_ = [compiler, "-O2", "-fPIC", "-std=c++20", "-w", *(f"-I{p}" for p in includes)]
    link = [compiler, "-shared", f"-L{lib}", "-ltorch_python", "-ltorch", "-ltorch_cpu",
            "-lc10", f"-Wl,-rpath,{lib}"]
    key = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES) + version.encode()
                         + sys.version.encode() + torch.__version__.encode()
                         + " ".join(compile_ + link).encode()).hexdigest()[:16]
    folder = native.cache_dir()
    target = folder / f"lane-{key}{sysconfig.get_config_var('EXT_SUFFIX')}"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    log.info("normwatch: building its C++ lane (once per machine and torch, ~20 s)")
    with tempfile.TemporaryDirectory(dir=folder) as tmp:  # then one atomic rename
        objects = [Path(tmp) / f"{s.stem}.o" for s in SOURCES]
        _run([[*compile_, "-c", str(s), "-o", str(o)] for s, o in zip(SOURCES, objects,
                                                                       strict=True)])
        built = Path(tmp) / target.name
        _run([[link[0], *map(str, objects), *link[1:], "-o", str(built)]])
        os.replace(built, target)
    return target


def _run(commands: list[list[str]]) -> None:
    """Run ``commands`` side by side (each source compiles on a core of its own); a
    failure raises with the compiler's words."""
    running = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True) for c in commands]
    try:
        for command, process in zip(commands, running, strict=True):
            _, err = process.communicate(timeout=600)
            if process.returncode:
                raise RuntimeError(f"{' '.join(command[-3:])} did not build: {err[-2000:]}")
    finally:  # (a failure or a timeout leaves no compiler writing into the folder)
        for process in running:
            if process.poll() is None:
                process.kill()
                process.wait()


def _load(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(NAME, str(path))
    spec = importlib.util.spec_from_loader(NAME, loader)
    if spec is None:
        raise ImportError(f"no spec for {path}")
    built = importlib.util.module_from_spec(spec)
    loader.exec_module(built)
    return built
