"""The update side of a step: gradient and parameter-update norms from optimizer hooks.

    >>> monitor = UpdateMonitor(step=lambda: watch.step_count + 1)
    >>> monitor.attach(optimizer)            # step pre/post hooks on that optimizer
    ... # optimizer.step() records one device row: [|g|², |Δp|², |p|²]
    >>> updates = monitor.resolve(copied)    # at the flush: (UpdateStats, ...)

The pre-hook copies a fixed sample of each trainable parameter: every
:data:`SAMPLE_STRIDE`-th block of :data:`BLOCK` elements (17, prime: it walks across the
columns of any power-of-two width instead of always reading the same ones), tensors
smaller than :data:`EXACT_BELOW` whole; the samples are views made once per parameter
list, packed per device and dtype end to end into one buffer by one copy
(:class:`_Pack`). The post-hook reuses that buffer for the change, then (on full-tier
steps: ``|p|`` moves slowly, and is carried to the steps between) the values, then the
same sample of the gradients the step used, and reduces each with one norm, every tensor
scaled by its elements per sampled element (an estimate of each sum of squares where the
values are spread like the tensor; the relative error of a norm is about
``sqrt(SAMPLE_STRIDE / (2 n))`` for ``n`` elements of similar size: 0.3 % at 1M
elements): a few ops per step whatever the number of tensors, reading 1/17 of the
parameters and gradients. Where the guard already read every gradient before the step
(``exact``), its exact gradient norm is taken instead of the sample's.
A non-finite gradient element outside the sample is not seen here (the norms' gradient
hooks and the loss see it). The copy costs 1/17 of the optimizer's local parameters (a
shard under FSDP2) in memory: for the duration of ``step()`` on accelerators, kept
between steps on the CPU (:meth:`_Pack.fill`). Everything stays on the
parameters' devices (no host sync) until the flush copies the rows along with the
statistics. Several optimizers stepping in one training step add up into one row. A
failure in a hook detaches the monitor with one warning; training goes on.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from normwatch.errors import ConfigError
from normwatch.guarded import Part, guarded
from normwatch.measure.losses import ride_along
from normwatch.measure.reductions import runs, summed_dtype
from normwatch.measure.sharding import local
from normwatch.records import UpdateStats

KEEP_ON = frozenset({"cpu"})
"""Device types whose parameter copies are kept between steps (:meth:`_Pack.fill`)."""
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
    """The elements of ``t`` the norms are measured on: every :data:`SAMPLE_STRIDE`-th
    block of :data:`BLOCK` (a view, no copy; the last partial block left out), or all of
    them (flattened)."""
    n = t.numel()
    if n < EXACT_BELOW or not t.is_contiguous():
        return t.reshape(-1)
    blocks = -(-(n // BLOCK) // SAMPLE_STRIDE)
    return t.as_strided((blocks, BLOCK), (SAMPLE_STRIDE * BLOCK, 1))


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


class _Pack:
    """The samples of one device and dtype laid end to end in one buffer (one op to fill,
    one to reduce, whatever the number of tensors): the sampled tensors' blocks as
    ``(rows, BLOCK)``, the small tensors flat; each block row weighted by its tensor's
    elements per sampled element (the small ones are whole: weight 1)."""

    def __init__(self, samples: list[torch.Tensor], scales: list[float]) -> None:
        self.blocked = [i for i, s in enumerate(samples) if s.dim() == 2]
        self.flat = [i for i, s in enumerate(samples) if s.dim() != 2]
        first = samples[0]
        self.device = first.device
        self.keep = first.device.type in KEEP_ON
        """Whether the buffers are kept between steps (else made for each step)."""
        counts = [samples[i].shape[0] for i in self.blocked]
        self.summed = summed_dtype(first.dtype)
        self.weights: torch.Tensor | None = None
        """Half precision: the row weights (float64), applied to per-row sums in fp32."""
        self.roots: torch.Tensor | None = None
        """Full precision: the square roots of the row weights, ``(rows, 1)``, to scale the
        buffer by in place (no per-row vector of sums is ever allocated)."""
        if self.blocked and self.summed is None:
            self.roots = runs([math.sqrt(scales[i]) for i in self.blocked], counts,
                              first.dtype, first.device)[:, None]
        elif self.blocked:
            self.weights = runs([scales[i] for i in self.blocked], counts, torch.float64,
                                first.device)
        self.buffers: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        self.views: list[torch.Tensor] = []
        """Views of :attr:`buffers`, one per sample, in sample order."""

    def fill(self, tensors: list[torch.Tensor], keep: bool) -> None:
        """Copy ``tensors`` (laid out like the samples) into the buffers: into the kept
        ones (``keep``), else into new ones."""
        kept = self.buffers if keep else (None, None)
        parts = []
        for index, buffer in zip((self.blocked, self.flat), kept, strict=True):
            picked = [tensors[i] for i in index]
            parts.append(None if not picked else torch.cat(picked) if buffer is None
                         else torch.cat(picked, out=buffer))
        self.buffers = (parts[0], parts[1])
        if not keep or not self.views:
            self.views = [None] * (len(self.blocked) + len(self.flat))  # type: ignore[list-item]
            for index, buffer in ((self.blocked, parts[0]), (self.flat, parts[1])):
                if buffer is not None:
                    sizes = [tensors[i].shape[0] for i in index]
                    for i, view in zip(index, torch.split(buffer, sizes), strict=True):
                        self.views[i] = view

    def sumsq(self) -> torch.Tensor:
        """The buffers' weighted float64 sum of squares (0-d, on their device); full
        precision buffers are scaled in place on the way (refill before reuse)."""
        blocked, flat = self.buffers
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        if blocked is not None and self.roots is not None:
            total = torch.linalg.vector_norm(blocked.mul_(self.roots)).double().square()
        elif blocked is not None and self.weights is not None:  # half: per row, in fp32
            rows = torch.linalg.vector_norm(blocked, dim=1, dtype=self.summed)
            total = rows.double().square() @ self.weights
        if flat is not None:
            total = total + torch.linalg.vector_norm(flat, dtype=self.summed).double().square()
        return total

    def release(self) -> None:
        self.buffers, self.views = (None, None), []


class _Sampled:
    """An optimizer's trainable parameters as last seen: their samples (views), each
    tensor's elements per sampled element, and per device and dtype the :class:`_Pack`
    the sums are taken on."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.addresses = [p.data_ptr() for p in params]
        self.samples = [sample(local(p).detach()) for p in params]
        self.scales = [_scale(p, s) for p, s in zip(params, self.samples, strict=True)]
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, s in enumerate(self.samples):
            groups.setdefault((s.device, s.dtype), []).append(i)
        self.packs = [(index, _Pack([self.samples[i] for i in index],
                                    [self.scales[i] for i in index]))
                      for index in groups.values()]

    def fits(self, params: list[torch.Tensor]) -> bool:
        """Whether ``params`` are these, in place (no parameter replaced or re-allocated)."""
        return len(params) == len(self.params) and all(
            a is b and a.data_ptr() == address
            for a, b, address in zip(params, self.params, self.addresses, strict=True))


def _scale(t: torch.Tensor, s: torch.Tensor) -> float:
    """Elements of ``t`` per element of its sample ``s``."""
    return t.numel() / s.numel() if s.numel() else 1.0


class UpdateMonitor:
    """Per-step gradient and update norms of the attached optimizers; see the module
    docstring. ``step()`` gives the number of the training step being taken."""

    def __init__(self, step: Callable[[], int], full: Callable[[], bool] = lambda: True,
                 exact: Callable[[torch.optim.Optimizer],
                                 Mapping[torch.device, torch.Tensor] | None] | None = None,
                 ) -> None:
        self._step = step
        self._full = full
        """Whether the step under way measures every statistic (then ``|p|²`` too)."""
        self._exact = exact
        """The exact ``|g|²`` per device of an optimizer's step under way, where someone
        (the guard) already read every gradient: then the sample's is not taken."""
        self._handles: list[RemovableHandle] = []
        self._attached: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._sampled: dict[int, _Sampled] = {}
        self._pending: set[int] = set()
        """Optimizers whose step is under way (the pre-hook filled their buffers)."""
        self._rows: list[tuple[int, int, torch.device, torch.Tensor, bool]] = []
        """``(step, optimizer id, device, [|g|², |Δp|², |p|²], whether |p|² was measured)``."""
        self._sizes: dict[int, float] = {}
        """Per optimizer, its last measured ``|p|²`` (carried to the steps between)."""
        self._lrs: dict[int, float | None] = {}
        self.part = Part("measuring the optimizer step",
                         "gradient and update norms are no longer recorded", off=self._off)

    def attach(self, optimizer: object) -> None:
        """Hook ``optimizer`` (once; wrappers are unwrapped)."""
        inner = unwrap(optimizer)
        if inner in self._attached or self.part.failed is not None:
            return
        self._attached.add(inner)
        self._handles += [inner.register_step_pre_hook(self._pre),
                          inner.register_step_post_hook(self._post)]

    @guarded
    @torch.no_grad()
    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        sampled = self._sampled.get(id(optimizer))
        if sampled is None or not sampled.fits(params):
            sampled = self._sampled[id(optimizer)] = _Sampled(params)
        for index, pack in sampled.packs:  # the samples' values before the step
            pack.fill([sampled.samples[i] for i in index], pack.keep)
        self._pending.add(id(optimizer))

    def _post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        sampled = self._sampled.get(id(optimizer))
        if id(optimizer) not in self._pending or sampled is None:
            return
        self._pending.discard(id(optimizer))
        self._measure(optimizer, sampled)

    @guarded
    @torch.no_grad()
    def _measure(self, optimizer: torch.optim.Optimizer, sampled: _Sampled) -> None:
        """The step's rows: ``|g|²``, ``|Δp|²`` and (full-tier steps) ``|p|²`` of the
        samples, per device."""
        exact = None if self._exact is None else self._exact(optimizer)
        sized = self._full() or id(optimizer) not in self._sizes
        rows: dict[torch.device, torch.Tensor] = {}
        if exact is None:
            # the gradients are read after the step: a closure (LBFGS, Lightning)
            # computes them inside step(), after the pre-hook
            grads = [None if p.grad is None else _values(local(p.grad)).detach()
                     for p in sampled.params]
            picked = [None if g is None else sample(g) for g in grads]
            alike = all(g is not None and g.shape == s.shape and g.dtype == s.dtype
                        for g, s in zip(picked, sampled.samples, strict=True))
        else:
            rows = {device: torch.stack([g, torch.zeros_like(g), torch.zeros_like(g)])
                    for device, g in exact.items()}
        for index, pack in sampled.packs:
            samples = [sampled.samples[i] for i in index]
            torch._foreach_sub_(pack.views, samples)  # the buffers: -Δp
            zero = torch.zeros((), dtype=torch.float64, device=pack.device)
            change = pack.sumsq()
            size = zero
            if sized:
                pack.fill(samples, keep=True)
                size = pack.sumsq()
            grad = zero
            if exact is None and alike:  # the gradients' samples have the params' layout
                pack.fill([picked[i] for i in index], keep=True)  # type: ignore[misc]
                grad = pack.sumsq()
            elif exact is None:  # missing or sparse gradients: one norm per tensor
                grad = _grad_sumsq([(grads[i], picked[i]) for i in index], pack.device)
            if not pack.keep:
                pack.release()
            row = torch.stack([grad, change, size])
            device = row.device
            rows[device] = rows[device] + row if device in rows else row
        step = self._step()
        for device, row in rows.items():
            self._rows.append((step, id(optimizer), device, row, sized))
        lrs = [g["lr"] for g in optimizer.param_groups]
        lr = max(lrs) if lrs and all(isinstance(v, float | int) for v in lrs) else None
        old = self._lrs.get(step)
        self._lrs[step] = lr if old is None or lr is None else max(old, lr)
        if sized:
            self._sizes.setdefault(id(optimizer), math.nan)

    def tensors(self) -> dict[torch.device, torch.Tensor]:
        """This interval's rows, flat per device, to ride along the flush copy."""
        return ride_along(*({device: row} for _, _, device, row, _ in self._rows))

    def resolve(self, copied: Mapping[torch.device, Iterable[float]]) -> tuple[UpdateStats, ...]:
        """One :class:`UpdateStats` per step from ``copied`` (the host values of
        :meth:`tensors`, per device; iterators are consumed), then forget the interval.
        A step that did not measure ``|p|²`` reports the optimizer's last measured one."""
        iters = {d: iter(v) for d, v in copied.items()}
        steps: dict[int, dict[int, list[float]]] = {}
        """Per step, per optimizer: ``[|g|², |Δp|², |p|² or NaN where not measured]``."""
        for step, owner, device, _, sized in self._rows:
            g, u, p = (next(iters[device]) for _ in range(WIDTH))
            total = steps.setdefault(step, {}).setdefault(owner, [0.0, 0.0, 0.0])
            total[:] = [total[0] + g, total[1] + u, total[2] + p if sized else math.nan]
        out = []
        for step, owners in sorted(steps.items()):
            for owner, (_, _, p) in owners.items():  # |p|² carried to the steps between
                self._sizes[owner] = self._sizes.get(owner, math.nan) if math.isnan(p) else p
            g = sum(v[0] for v in owners.values())
            u = sum(v[1] for v in owners.values())
            p = sum(self._sizes[owner] for owner in owners)
            out.append(UpdateStats(step, g**0.5, u**0.5, p**0.5, self._lrs.get(step)))
        self._rows.clear()
        self._lrs.clear()
        return tuple(out)

    def _fail(self, exc: Exception) -> None:
        self.part.fail(exc)

    def _off(self) -> None:
        self._pending.clear()
        self.detach()

    def detach(self) -> None:
        """Remove the hooks and drop the kept copies (harmless twice)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._sampled.clear()


def _grad_sumsq(grads: list[tuple[torch.Tensor | None, torch.Tensor | None]],
                device: torch.device) -> torch.Tensor:
    """``|g|²`` estimated tensor by tensor, for gradients not laid out like their
    parameters (missing, sparse): ``(gradient, its sample)`` pairs on ``device``; one norm
    call per dtype, each norm scaled by the square root of its tensor's elements per
    sampled element."""
    by_dtype: dict[torch.dtype, list[tuple[torch.Tensor, float]]] = {}
    for g, s in grads:
        if g is not None and s is not None:
            by_dtype.setdefault(s.dtype, []).append((s, math.sqrt(_scale(g, s))))
    total = torch.zeros((), dtype=torch.float64, device=device)
    for dtype, group in by_dtype.items():
        norms = torch._foreach_norm([s for s, _ in group], 2, dtype=summed_dtype(dtype))
        scaled = torch._foreach_mul(norms, [root for _, root in group])
        total = total + torch.stack(scaled).double().square().sum()
    return total


def _values(t: torch.Tensor) -> torch.Tensor:
    """``t``, or for a sparse gradient (an embedding's) its stored values."""
    return t.coalesce().values() if t.is_sparse else t
