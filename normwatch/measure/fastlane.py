"""The forward hook's sentinel lane in C++: a sentinel-tier call of the common CPU case
measured with no Python frame around it.

Inside a training step each line of a hook's Python costs several times what it costs
warm (the model's work leaves the interpreter's code and objects out of the caches): a
sentinel call's C read took 23 µs at d=128 and its Python around it ~80. ``lane.cpp``
(shipped with the package) measures the calls :meth:`LayerHook._lane
<normwatch.measure.hooks.LayerHook._lane>` takes in the sentinel tier exactly as it does
(the same C read, buffer, staged rows and counts) and hands every other call to the
Python hook. It is compiled at first use against torch's headers (~20 s, once per
machine and torch: into :func:`~normwatch.measure.native.cache_dir`, named by a hash of
the source, the compiler, Python and torch).

Torch calls it as ``functools.partial(hook, layer)``; while Dynamo traces, a Python
stand-in (:func:`torch._dynamo.substitute_in_graph`) calls ``layer`` instead, so compiled
graphs are traced as before. Without a C++ compiler, torch's headers or the C library,
or with ``NORMWATCH_NATIVE=0`` or ``NORMWATCH_LANE=0``, the Python hook is registered
itself.
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
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from normwatch.catalog import KEY_STRIDE
from normwatch.measure import native
from normwatch.measure.reductions import CallRows

SOURCE = Path(__file__).with_name("lane.cpp")
NAME = "normwatch_lane"

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
        built.setup(ctypes.cast(lib.normwatch_rows_planned, ctypes.c_void_p).value)
        _stand_in(built.hook)
    except Exception as exc:  # no C++ compiler, no headers, a failed build: Python's lane
        log.debug("normwatch: the C++ lane is not built (%s)", exc)
        return None
    return built


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
        return _none, ()


def _none() -> None:
    return None


def state(runtime: Any, counts: Any, take: Callable[..., Any], row: int, width: int | None,
          eps: float, centred: bool) -> State | None:
    """A layer's lane state, or ``None``: no lane for it (tokens that are not its last
    dim, or no lane built). The lane plans a new layout (of an input and output alike)
    with :func:`~normwatch.measure.native.row_plan`, as the Python lane does."""
    built = module()
    if built is None or width is None:
        return None
    return State(built.lane(runtime, counts, take, native.row_plan, CallRows, row, width,
                            eps, centred, KEY_STRIDE))


@functools.cache
def _stand_in(lane_hook: Callable[..., Any]) -> None:
    """While Dynamo traces, the Python hook in the lane's place (Dynamo cannot trace a
    builtin; once per builtin: a module loaded again from its file has the same)."""

    @torch._dynamo.substitute_in_graph(lane_hook, skip_signature_check=True)
    def hook(layer: Callable[..., Any], module: torch.nn.Module, args: Any, kwargs: Any,
             output: Any) -> Any:
        return layer(module, args, kwargs, output)


def _built() -> Path:
    from torch.utils import cpp_extension

    compiler, version = native.compiler("CXX", ("c++", "g++"), "C++")
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    lib = Path(torch.__file__).parent / "lib"
    command = [compiler, "-O2", "-fPIC", "-shared", "-std=c++20", "-w",
               *(f"-I{p}" for p in includes), str(SOURCE), f"-L{lib}", "-ltorch_python",
               "-ltorch", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}"]
    key = hashlib.sha256(SOURCE.read_bytes() + version.encode() + sys.version.encode()
                         + torch.__version__.encode() + " ".join(command).encode()
                         ).hexdigest()[:16]
    folder = native.cache_dir()
    target = folder / f"lane-{key}{sysconfig.get_config_var('EXT_SUFFIX')}"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    log.info("normwatch: building its C++ lane (once per machine and torch, ~20 s)")
    with tempfile.TemporaryDirectory(dir=folder) as tmp:  # then one atomic rename
        built = Path(tmp) / target.name
        done = subprocess.run([*command, "-o", str(built)], capture_output=True, text=True,
                              timeout=600)
        if done.returncode:
            raise RuntimeError(f"{SOURCE.name} did not build: {done.stderr[-2000:]}")
        os.replace(built, target)
    return target


def _load(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(NAME, str(path))
    spec = importlib.util.spec_from_loader(NAME, loader)
    if spec is None:
        raise ImportError(f"no spec for {path}")
    built = importlib.util.module_from_spec(spec)
    loader.exec_module(built)
    return built
