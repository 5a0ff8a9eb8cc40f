"""Is a layer's own reduction fp16-safe? Ask it, once, with two probe tokens.

* an *element* probe: one token holding a single 300 (300² = 90000 > 65504); torch's
  norms upcast and return a normal output, ``x.pow(2).mean()`` in fp16 returns zeros;
* a *sum* probe: a token of ±v with every v² < 65504 but Σv² > 65504; it catches a
  kernel that sums squares in fp16 even when every element is below 256.

The probe runs the layer's forward on a hookless copy, isolated
(:mod:`~normwatch.measure.model.isolation`: no user or global hook sees it, batch-norm running
statistics, the real module and the RNG are untouched, no grad), on the layer's device,
in the dtype it was asked about. It is a host-side side effect, called from ``flush()``
only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import torch
from torch import nn

from normwatch.measure.model.isolation import hookless_copy, isolated
from normwatch.measure.model.reference import expected_output
from normwatch.measure.state.rows import token_view
from normwatch.records import FP16_MAX, LayerStats, NormLayer, ProbeResult, Snapshot

ProbeTarget = tuple[tuple[int, ...] | None, torch.device | None]
"""A layer's last input shape and device (``None`` before its first counted call)."""

PROBE_VALUE = 300.0


def probe_shape(layer: NormLayer, input_shape: tuple[int, ...]) -> tuple[int, ...]:
    """A small input shape of the layer's layout: one sample, spatial dims shrunk."""
    if layer.kind in ("layernorm", "rmsnorm"):
        nd = len(layer.normalized_shape) if layer.normalized_shape else 1
        tail = input_shape[len(input_shape) - nd :]
        return (1, *tail)
    if len(input_shape) < 2:
        return tuple(input_shape)
    spatial = tuple(2 for _ in input_shape[2:])
    batch = 2 if layer.kind == "batchnorm" else 1
    return (batch, input_shape[1], *spatial)


def probe_fp16_safety(
    layer: NormLayer,
    module: nn.Module,
    input_shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> ProbeResult:
    """Run both probes on a copy of ``module``; never raises."""
    name = str(dtype).removeprefix("torch.")
    try:
        clone = hookless_copy(module)
        shape = probe_shape(layer, input_shape)
        element = torch.zeros(shape, dtype=torch.float32)
        element.view(-1)[0] = PROBE_VALUE
        element_safe = _passes(layer, clone, element, dtype, device)
        width = token_view(element, layer.kind, _token_ndim(layer), layer.num_groups or 1).shape[1]
        value = min(200.0, 2.0 * math.sqrt(FP16_MAX / max(width, 1)))
        sum_safe: bool | None = element_safe
        if width * value * value > FP16_MAX:
            signs = torch.ones(math.prod(shape))
            signs[1::2] = -1.0
            sum_safe = _passes(layer, clone, (signs * value).reshape(shape), dtype, device)
        return ProbeResult(name, element_safe, sum_safe)
    except Exception as exc:  # a probe must never take training down
        return ProbeResult(name, None, None, f"probe failed: {type(exc).__name__}: {exc}")


def _token_ndim(layer: NormLayer) -> int:
    return len(layer.normalized_shape) if layer.normalized_shape else 1


def _passes(
    layer: NormLayer, module: nn.Module, x32: torch.Tensor, dtype: torch.dtype,
    device: torch.device,
) -> bool | None:
    x = x32.to(device=device, dtype=dtype)
    with isolated(device):
        out = module(x)
        if isinstance(out, tuple | list):
            out = out[0]
        if not isinstance(out, torch.Tensor):
            return None
        expected = expected_output(layer, module, x)
        if not bool(torch.isfinite(out).all()):
            return False
        if expected is None or expected.shape != out.shape:
            return bool(out.abs().amax() > 0)
        err = torch.linalg.vector_norm(out.float() - expected)
        scale = torch.linalg.vector_norm(expected).clamp_min(1e-6)
        return bool(err / scale < 0.05)


class ProbeCache:
    """Probe results per layer and dtype, each layer probed at most once per dtype.

    Only layers of an fp16 run whose inputs came near the limits are worth a probe
    (:meth:`wanted`); ``paused`` is a context in which the watch's hooks stand aside while
    the probe runs its copy of the layer.
    """

    def __init__(self, paused: Callable[[], AbstractContextManager[object]]) -> None:
        self._paused = paused
        self._results: dict[tuple[str, str], ProbeResult] = {}

    @staticmethod
    def wanted(stats: LayerStats, fp16_limit: float) -> bool:
        """Whether the interval's statistics make the layer's fp16 safety matter."""
        big = (stats.absmax or 0.0) > fp16_limit or (stats.sumsq_max or 0.0) > FP16_MAX
        return stats.seen and stats.fp16 and big

    def results(self, snapshot: Snapshot, fp16_limit: float,
                targets: Iterator[tuple[NormLayer, nn.Module, ProbeTarget]]
                ) -> dict[str, ProbeResult]:
        """Probe (once) every wanted layer; ``targets`` yields each layer, its module and
        where its last input lived."""
        out: dict[str, ProbeResult] = {}
        for layer, module, (shape, device) in targets:
            if shape is None or device is None or \
                    not self.wanted(snapshot.layers[layer.name], fp16_limit):
                continue
            key = (layer.name, "float16")
            if key not in self._results:
                with self._paused():
                    self._results[key] = probe_fp16_safety(layer, module, tuple(shape),
                                                           torch.float16, device)
            out[layer.name] = self._results[key]
        return out
