"""The fused kernels launched without Triton's Python: the kernel Triton compiled,
launched through torch's static CUDA launcher (``torch._C._StaticCudaLauncher``,
inductor's: the CUDA driver's ``cuLaunchKernel`` from C++, no CUDA compiler needed).

    >>> spec = static_launch(_kernel(), (x.dtype, y.dtype, torch.float32, n, width, width,
    ...                      1, width, 1), {"HAS_OUT": True, ...}, n, x.device)
    >>> fn, head, args, places, streams = spec   # per call, in C++ (common.cpp's
    >>> fn(*head, args with the call's pointers at `places`, streams(device))  # launch_native)

    >>> fold = Launch(_calls_kernel)               # a step's few cross-layer launches
    >>> fold(n_calls, v, consts, ..., FULL=full)   # as kernel[(n_calls,)](v, consts, ...)

A spec is made once per layout (the C++ lanes': by a lane's planner) or per
specialization (:class:`Launch`'s: as Triton's own, each integer by whether it is 1 or a
multiple of 16), from the kernel Triton compiled for those arguments (its warmup: the
cache its own launches use), the pointers taken as 16-byte aligned (as Triton specializes
a pointer that is); a call whose pointer is not goes to Triton's own launch. ``None``
where there is no static launch: no CUDA, a torch without the launcher, or a kernel that
needs what it does not pass (scratch memory, clusters, cooperative or dependent launches).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)

Spec = tuple[Any, tuple[Any, ...], tuple[Any, ...], tuple[int, ...], Any]
"""``(launcher, head, args, places, streams)``: ``launcher(*head, args, stream)`` launches
the kernel once, with the call's arguments put in ``args`` at ``places`` (each leading
argument's index there; -1: one the compiled kernel does not take, a constant), on
``streams(device index)``, the device's current stream (``None``: 0)."""

_TYPES = {"i1": "i", "i8": "b", "i16": "h", "i32": "i", "i64": "l", "u1": "I", "u8": "B",
          "u16": "H", "u32": "I", "u64": "K", "fp16": "f", "bf16": "f", "fp32": "f",
          "f32": "f", "fp64": "d"}
"""Triton's scalar types as the static launcher's format letters (a pointer's: ``O``)."""

_SCRATCH = ("global_scratch_size", "profile_scratch_size")
"""The scratch buffers a compiled kernel takes as trailing pointers where its metadata
names them (Triton 3.3 on), passed null: the launcher's is refused where one is used."""


def compiled_spec(compiled: Any, values: dict[str, Any], grid: int
                  ) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[int, ...]] | None:
    """``compiled``'s (a Triton ``CompiledKernel``) launch with ``values`` (the kernel's
    arguments by name, constexprs included; a tensor or its dtype for each pointer) on a
    grid of ``grid`` programs: ``(head, args, places)`` of :data:`Spec`, a place for each
    of the kernel's arguments (the function handle, ``compiled.function``, read later: 0
    here), or ``None`` where the static launcher cannot launch it."""
    meta = compiled.metadata
    if getattr(meta, "num_ctas", 1) != 1 or getattr(meta, "launch_cooperative_grid", False) \
            or getattr(meta, "launch_pdl", False) or getattr(meta, "tensordesc_meta", None) \
            or getattr(meta, "instrumentation_mode", ""):
        return None
    src = compiled.src
    names = list(src.fn.arg_names)
    constants = {k[0] if isinstance(k, tuple) else names.index(k) if isinstance(k, str) else k
                 for k in getattr(src, "constants", {})}
    kinds: list[str] = []
    kept: list[int | float | None] = []
    places: list[int] = []
    for i, name in enumerate(names):
        value = values[name]
        kind = src.signature.get(name, "constexpr")
        if kind == "constexpr" or i in constants:
            places.append(-1)
            continue
        places.append(len(kept))
        if kind.startswith("*"):
            if not isinstance(value, torch.Tensor | torch.dtype):
                return None
            kinds.append("O")
            kept.append(None)
        elif kind in _TYPES and isinstance(value, int | float):
            kinds.append(_TYPES[kind])
            kept.append(value)
        else:
            return None
    for size in _SCRATCH:
        if hasattr(meta, size):
            if getattr(meta, size):
                return None
            kinds.append("O")
            kept.append(None)
    head = (0, grid, 1, 1, meta.num_warps, meta.shared, "".join(kinds))
    return head, tuple(kept), tuple(places)


def static_launch(kernel: Any, args: Sequence[Any], constexprs: dict[str, Any], grid: int,
                  device: torch.device, warps: int = 4) -> Spec | None:
    """The :data:`Spec` of ``kernel`` (a ``triton.jit`` function) launched on ``device``
    with ``args`` (its leading arguments; a tensor's dtype for each pointer) and
    ``constexprs`` on ``grid`` programs of ``warps`` warps, or ``None`` (see the module
    docstring; an error on the way: ``None`` too, the caller then launches by Triton)."""
    if device.type != "cuda":
        return None
    try:
        from torch._C import _cuda_getCurrentRawStream, _StaticCudaLauncher

        with torch.cuda.device(device):  # (a dtype for a pointer: an aligned one)
            compiled = kernel.warmup(*args, grid=(grid,), num_warps=warps, **constexprs)
            compiled._init_handles()
        values = dict(zip(kernel.arg_names[:len(args)], args, strict=True))
        spec = compiled_spec(compiled, {**values, **constexprs}, grid)
        if spec is None:
            return None
        head, kept, places = spec
        return _StaticCudaLauncher._launch_kernel, (compiled.function, *head[1:]), kept, \
            places[:len(args)], _cuda_getCurrentRawStream
    except Exception as exc:  # an older torch or Triton: Triton's own launch serves
        log.debug("normwatch: no static launch of %s (%r); Triton launches it",
                  getattr(kernel, "__name__", kernel), exc)
        return None


address = torch.Tensor.data_ptr
"""A tensor's address as a static launch passes it (a stand-in launcher on the CPU, in the
tests, reads from it which tensor a pointer names)."""


class Launch:
    """``kernel[(grid,)](*args, **constexprs)`` from normwatch's Python (a step's
    cross-layer launches: the folds, the update monitor's sample, the guard's check; a
    call's or a gradient's where no C++ lane launches it: a compiled call's operator, the
    Python hook): by a static launch where one serves, made once per device and
    specialization (as Triton's JIT specializes: a pointer by its dtype, an integer by
    whether it is 1, a multiple of 16, 32-bit), else by Triton's own launch (off CUDA, a
    pointer off 16-byte alignment, a tensor not on the current device, an argument no
    static launch passes, a launch the launcher refused: that specialization's for
    good). ``kernel`` is a function returning the ``triton.jit`` kernel (called where a
    spec is made or Triton launches, not on a static launch). One frame a launch."""

    def __init__(self, kernel: Callable[[], Any]) -> None:
        self.kernel = kernel
        self.specs: dict[tuple[Any, ...], Spec | None] = {}

    def __call__(self, grid: int, *args: Any, num_warps: int = 4, **constexprs: Any) -> None:
        device: torch.device | None = None
        key: list[Any] = [num_warps, *constexprs.values()]
        for a in args:  # (inline: no frame an argument)
            if isinstance(a, torch.Tensor):
                key.append(a.dtype)
                if device is None:
                    device = a.device
            elif type(a) is int:
                key.append((a == 1, a % 16 == 0, -2**31 <= a < 2**31))
            else:
                key.append(float if type(a) is float else None)
        key.append(device)
        made = tuple(key)
        if made not in self.specs:
            self.specs[made] = None if None in made or device is None else static_launch(
                self.kernel(), [a.dtype if isinstance(a, torch.Tensor) else a for a in args],
                constexprs, grid, device, num_warps)
        spec = self.specs[made]
        if spec is not None and device is not None and (
                device.type != "cuda" or torch._C._cuda_getDevice() == device.index):
            fn, head, kept, places, streams = spec
            given = list(kept)
            for value, place in zip(args, places, strict=True):
                if isinstance(value, torch.Tensor):
                    value = address(value)
                    if value % 16:  # (compiled for aligned pointers)
                        break
                if place >= 0:
                    given[place] = value
            else:
                try:
                    fn(head[0], grid, *head[2:], tuple(given),
                       0 if streams is None else streams(device.index))
                    return
                except Exception as exc:  # refused: Triton's launch from now on
                    log.debug("normwatch: the static launch of %s refused (%r); Triton "
                              "launches it", getattr(self.kernel(), "__name__", "?"), exc)
                    self.specs[made] = None
        self.kernel()[(grid,)](*args, num_warps=num_warps, **constexprs)
