"""The update side of a step: gradient and parameter-update norms from optimizer hooks.

    >>> monitor = UpdateMonitor(step=lambda: watch.step_count + 1)
    >>> monitor.attach(optimizer)            # step pre/post hooks on that optimizer
    ... # optimizer.step() records one device row: [|g|², |Δp|², |p|²]
    >>> updates = monitor.resolve(copied)    # at the flush: (UpdateStats, ...)

The pre-hook copies a fixed sample of each trainable parameter: every
:data:`SAMPLE_STRIDE`-th block of :data:`BLOCK` elements (17, prime: it walks across the
columns of any power-of-two width instead of always reading the same ones), tensors
smaller than :data:`EXACT_BELOW` whole. The post-hook sums the squared gradients the step
used (exact) and the squared change and squared values of the sample, scaled up by each
tensor's elements per sampled element (an estimate of the update's and the parameters' sums
of squares where they are spread like the tensor; the relative error of a norm is about
``sqrt(SAMPLE_STRIDE / (2 n))`` for ``n`` elements of similar size: 0.3 % at 1M
elements). The copy costs 1/17 of the optimizer's local parameters (a shard under FSDP2)
in memory: for the duration of ``step()`` on accelerators, kept between steps on the CPU
(:meth:`UpdateMonitor._copy`). Everything stays on the parameters' devices (no host sync)
until the flush copies the rows along with the statistics. Several optimizers stepping in
one training step add up into one row. A failure in a hook detaches the monitor with one
warning; training goes on.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from normwatch.errors import ConfigError
from normwatch.measure.losses import ride_along
from normwatch.measure.reductions import summed_dtype
from normwatch.measure.sharding import local
from normwatch.records import UpdateStats

KEEP_ON = frozenset({"cpu"})
"""Device types whose parameter copies are kept between steps (:meth:`UpdateMonitor._copy`)."""
WIDTH = 3
"""Values per device row: gradient, update and parameter sums of squares."""
SAMPLE_STRIDE = 17
"""The update is measured on every 17th block of a tensor (5.9 %)."""
BLOCK = 16
"""Elements per sampled block (64 bytes of fp32: one cache line, so the sample reads 1/17
of the memory too)."""
EXACT_BELOW = 16 * SAMPLE_STRIDE * BLOCK
"""Tensors with fewer elements are copied whole (a sample of under 16 blocks says little)."""


def sample(t: torch.Tensor) -> torch.Tensor:
    """The elements of ``t`` the update is measured on: every :data:`SAMPLE_STRIDE`-th
    block of :data:`BLOCK` (a view, no copy; the last partial block left out), or all of
    them (flattened)."""
    n = t.numel()
    if n < EXACT_BELOW or not t.is_contiguous():
        return t.reshape(-1)
    return t.view(-1)[:n - n % BLOCK].view(-1, BLOCK)[::SAMPLE_STRIDE]


def unwrap(optimizer: object) -> torch.optim.Optimizer:
    """The torch optimizer inside wrappers, or a clear error. A wrapper may itself
    subclass ``Optimizer`` without being one (Accelerate's steps the one it holds)."""
    inner = optimizer
    while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
        inner = inner.optimizer  # type: ignore[attr-defined]
    if not isinstance(inner, torch.optim.Optimizer):
        raise ConfigError("'optimizer' must be a torch.optim.Optimizer (or a wrapper with an "
                          f"'optimizer' attribute holding one): got {type(optimizer).__name__}")
    return inner


def sumsq(tensors: Iterable[torch.Tensor], weights: Sequence[float] | None = None
          ) -> dict[torch.device, torch.Tensor]:
    """The float64 sum of squares of ``tensors`` per device (0-d tensors, no sync), each
    tensor's counted ``weights[i]`` times (default once)."""
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[torch.Tensor, float]]] = {}
    for i, t in enumerate(tensors):
        if t.is_sparse:  # an embedding's sparse gradient: its stored values
            t = t.coalesce().values()
        groups.setdefault((t.device, t.dtype), []).append((t, 1.0 if weights is None
                                                           else weights[i]))
    out: dict[torch.device, torch.Tensor] = {}
    for (device, dtype), group in groups.items():
        norms = torch._foreach_norm([t for t, _ in group], 2, dtype=summed_dtype(dtype))
        squares = torch.stack(norms).to(torch.float64).square()
        scale = tuple(w for _, w in group)
        if any(w != 1.0 for w in scale):
            squares = squares * _scales(device, scale)
        total = squares.sum()
        out[device] = out[device] + total if device in out else total
    return out


@functools.lru_cache(maxsize=64)
def _scales(device: torch.device, scale: tuple[float, ...]) -> torch.Tensor:
    """``scale`` as a float64 vector on ``device``, made once (by fill kernels: no
    host-to-device copy) for a parameter list."""
    return torch.cat([torch.full((1,), w, dtype=torch.float64, device=device) for w in scale])


class UpdateMonitor:
    """Per-step gradient and update norms of the attached optimizers; see the module
    docstring. ``step()`` gives the number of the training step being taken."""

    def __init__(self, step: Callable[[], int]) -> None:
        self._step = step
        self._handles: list[RemovableHandle] = []
        self._attached: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._before: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._kept: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._rows: list[tuple[int, torch.device, torch.Tensor]] = []
        self._lrs: dict[int, float | None] = {}
        self.failed: str | None = None

    def attach(self, optimizer: object) -> None:
        """Hook ``optimizer`` (once; wrappers are unwrapped)."""
        inner = unwrap(optimizer)
        if inner in self._attached or self.failed is not None:
            return
        self._attached.add(inner)
        self._handles += [inner.register_step_pre_hook(self._pre),
                          inner.register_step_post_hook(self._post)]

    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        try:
            with torch.no_grad():
                params = [p for g in optimizer.param_groups for p in g["params"]
                          if p.requires_grad]
                self._before[id(optimizer)] = (params, self._copy(optimizer, params))
        except Exception as exc:  # never take the training run down
            self._fail(exc)

    def _copy(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor]
              ) -> list[torch.Tensor]:
        """The parameters' values before the step. CPU copies are kept between steps and
        overwritten (a fresh large CPU allocation page-faults: it cost more than AdamW's
        step); on accelerators the caching allocator makes a transient copy cheap."""
        values = [sample(local(p).detach()) for p in params]
        keep = [v.device.type in KEEP_ON for v in values]
        if not any(keep):
            return [v.clone() for v in values]
        kept = self._kept.get(id(optimizer))
        if kept is None or len(kept[0]) != len(params) or \
                any(a is not b for a, b in zip(kept[0], params, strict=True)):
            kept = (params, [v.clone() if k else v for v, k in zip(values, keep, strict=True)])
            self._kept[id(optimizer)] = kept  # (the first step copies once more below)
        out = [c if k else v.clone() for c, v, k in zip(kept[1], values, keep, strict=True)]
        pairs = [(c, v) for c, v, k in zip(out, values, keep, strict=True) if k]
        torch._foreach_copy_([c for c, _ in pairs], [v for _, v in pairs])
        return out

    def _post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        before = self._before.pop(id(optimizer), None)
        if before is None:
            return
        try:
            with torch.no_grad():
                params, copies = before
                now = [local(p).detach() for p in params]
                samples = [sample(t) for t in now]
                torch._foreach_sub_(copies, samples)  # the copies: -Δp
                # the gradients are read after the step: a closure (LBFGS, Lightning)
                # computes them inside step(), after the pre-hook
                grads = sumsq(local(p.grad) for p in params if p.grad is not None)
                # each tensor's elements per sampled element
                weights = [t.numel() / s.numel() if s.numel() else 1.0
                           for t, s in zip(now, samples, strict=True)]
                changes, sizes = sumsq(copies, weights), sumsq(samples, weights)
                step = self._step()
                for device in dict.fromkeys([*grads, *changes]):
                    zero = torch.zeros((), dtype=torch.float64, device=device)
                    self._rows.append((step, device, torch.stack([
                        grads.get(device, zero), changes.get(device, zero),
                        sizes.get(device, zero)])))
                lrs = [g["lr"] for g in optimizer.param_groups]
                lr = max(lrs) if lrs and all(isinstance(v, float | int) for v in lrs) else None
                old = self._lrs.get(step)
                self._lrs[step] = lr if old is None or lr is None else max(old, lr)
        except Exception as exc:
            self._fail(exc)

    def tensors(self) -> dict[torch.device, torch.Tensor]:
        """This interval's rows, flat per device, to ride along the flush copy."""
        return ride_along(*({device: row} for _, device, row in self._rows))

    def resolve(self, copied: Mapping[torch.device, Iterable[float]]) -> tuple[UpdateStats, ...]:
        """One :class:`UpdateStats` per step from ``copied`` (the host values of
        :meth:`tensors`, per device; iterators are consumed), then forget the interval."""
        iters = {d: iter(v) for d, v in copied.items()}
        sums: dict[int, list[float]] = {}
        for step, device, _ in self._rows:
            row = [next(iters[device]) for _ in range(WIDTH)]
            total = sums.setdefault(step, [0.0] * WIDTH)
            total[:] = [a + b for a, b in zip(total, row, strict=True)]
        out = tuple(UpdateStats(step, g**0.5, u**0.5, p**0.5, self._lrs.get(step))
                    for step, (g, u, p) in sorted(sums.items()))
        self._rows.clear()
        self._lrs.clear()
        return out

    def _fail(self, exc: Exception) -> None:
        self.failed = f"{type(exc).__name__}: {exc}"
        self._before.clear()
        self.detach()
        warnings.warn(f"normwatch: measuring the optimizer step failed ({self.failed}); "
                      "gradient and update norms are no longer recorded, training continues",
                      RuntimeWarning, stacklevel=3)

    def detach(self) -> None:
        """Remove the hooks and drop the kept copies (harmless twice)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._kept.clear()
