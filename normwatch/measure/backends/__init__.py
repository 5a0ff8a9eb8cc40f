"""How statistics are computed, per device, behind one protocol
(:class:`~normwatch.measure.state.backend.Backend`), chosen in one place
(:func:`choose`):

- :mod:`~normwatch.measure.backends.torchops` (``"torch"``): torch's own ops, any device;
  the universal fallback the others use for what their kernels do not cover;
- :mod:`~normwatch.measure.backends.triton_kernel` (``"triton"``): a call's rows and a
  gradient's in one fused pass each (CUDA; the CPU in Triton's interpreter), the step's
  folds in a launch or two (:mod:`~normwatch.measure.backends.triton_folds`), the update
  monitor's sample and the guard's check a launch each
  (:mod:`~normwatch.measure.backends.triton_optimizer`); the C++ lanes launch a call's
  and a gradient's kernel themselves, through torch's static CUDA launcher
  (:mod:`~normwatch.measure.backends.triton_launch`);
- :mod:`~normwatch.measure.backends.native` (``"native"``): the CPU's C readers and folds,
  the C++ lanes that measure common calls with no Python frame, the update sample.
"""

from __future__ import annotations

import torch

from normwatch.measure.state.backend import Backend

KERNELS = ("auto", "torch", "triton")
"""The values of ``kernel=`` (:class:`~normwatch.config.WatchConfig`)."""

_CHOSEN: dict[tuple[str, str], Backend] = {}


def choose(device: torch.device | str, kernel: str = "auto") -> Backend:
    """The backend for tensors on ``device`` under ``kernel=``: ``"torch"`` torch's ops,
    ``"triton"`` the fused kernel wherever it runs, ``"auto"`` the native backend on the
    CPU, the fused kernel on CUDA where Triton imports, torch's ops elsewhere."""
    kind = device if isinstance(device, str) else device.type
    chosen = _CHOSEN.get((kind, kernel))
    if chosen is None:
        chosen = _CHOSEN[(kind, kernel)] = _choice(kind, kernel)
    return chosen


def _choice(kind: str, kernel: str) -> Backend:
    from normwatch.measure.backends.torchops import TORCH

    if kernel not in KERNELS:
        raise ValueError(f"'kernel' must be one of {', '.join(map(repr, KERNELS))}: got "
                         f"{kernel!r}")
    if kernel == "torch":
        return TORCH
    from normwatch.measure.backends.triton_kernel import TRITON, available

    if kernel == "triton" or (kind == "cuda" and available()):
        return TRITON
    if kind == "cpu":
        from normwatch.measure.backends.native.backend import NATIVE

        return NATIVE
    return TORCH
