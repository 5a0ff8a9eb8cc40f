"""The fused kernels launched with no Python per call: the C++ lanes launch the kernel
Triton compiled through torch's static CUDA launcher (``torch._C._StaticCudaLauncher``,
inductor's: the CUDA driver's ``cuLaunchKernel`` from C++, no CUDA compiler needed).

    >>> spec = static_launch(_kernel(), (x.dtype, y.dtype, torch.float32, n, width, width,
    ...                      1, width, 1), {"HAS_OUT": True, ...}, n, x.device)
    >>> fn, head, args, pointers, streams = spec   # per call, in C++ (common.cpp's
    >>> fn(*head, args with the call's pointers at `pointers`, streams(device))  # launch_native)

A spec is made once per layout, by a lane's planner, from the kernel Triton compiled for
those arguments (its warmup: the cache its own launches use), the pointers taken as
16-byte aligned (as Triton specializes a pointer that is); the lanes launch a call whose
pointer is not by Triton's own launcher (the backend's ``lane_launch``). ``None`` where
there is no static launch: no CUDA, a torch without the launcher, or a kernel that needs
what it does not pass (scratch memory, clusters, cooperative or dependent launches).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)

Spec = tuple[Any, tuple[Any, ...], tuple[Any, ...], tuple[int, ...], Any]
"""``(launcher, head, args, pointers, streams)``: ``launcher(*head, args, stream)``
launches the kernel once, with the call's pointers put in ``args`` at the indices
``pointers``, on ``streams(device index)``, the device's current stream (``None``: 0)."""

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
    grid of ``grid`` programs: ``(head, args, pointers)`` of :data:`Spec` (the function handle,
    ``compiled.function``, read later: 0 here), or ``None`` where the static launcher
    cannot launch it."""
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
    pointers: list[int] = []
    for i, name in enumerate(names):
        value = values[name]
        kind = src.signature.get(name, "constexpr")
        if kind == "constexpr" or i in constants:
            continue
        if kind.startswith("*"):
            if not isinstance(value, torch.Tensor | torch.dtype):
                return None
            pointers.append(len(kept))
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
    return head, tuple(kept), tuple(pointers)


def static_launch(kernel: Any, args: Sequence[Any], constexprs: dict[str, Any], grid: int,
                  device: torch.device, warps: int = 4) -> Spec | None:
    """The :data:`Spec` of ``kernel`` (a ``triton.jit`` function) launched on ``device``
    with ``args`` (its leading arguments; a tensor's dtype for each pointer) and
    ``constexprs`` on ``grid`` programs of ``warps`` warps, or ``None`` (see the module
    docstring; an error on the way: ``None`` too, the lane then launches by Triton)."""
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
        head, kept, pointers = spec
        return _StaticCudaLauncher._launch_kernel, (compiled.function, *head[1:]), kept, \
            pointers, _cuda_getCurrentRawStream
    except Exception as exc:  # an older torch or Triton: Triton's own launch serves
        log.debug("normwatch: no static launch of %s (%r); Triton launches it",
                  getattr(kernel, "__name__", kernel), exc)
        return None
