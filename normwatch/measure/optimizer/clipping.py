"""The gradient norm the training loop already computed: ``clip_grad_norm_``'s.

    >>> handle = clipping.install()          # while a watch has an optimizer
    >>> ...  # the loop calls torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    >>> clipping.take(optimizer)             # before its step: what that call measured
    Clipped(finite=tensor(True), sumsq={device(type='cpu'): tensor(0.97...)})
    >>> handle.remove()

Most training loops clip (Lightning's ``gradient_clip_val``, the HF Trainer's
``max_grad_norm``, nanoGPT's ``grad_clip``): ``torch.nn.utils.clip_grad_norm_`` reads every
gradient and returns their total norm, on the device. Installed, this module wraps it
(``torch.nn.utils.clip_grad_norm_`` and ``torch.nn.utils.clip_grad.clip_grad_norm_``, the
names the loops call it by) to remember, per call, the gradients it covered (their
identity and version counter, read after it clipped them) and the norm it returned.
:func:`take` hands that norm to the guard and the update monitor, which then do not read
every gradient again: only when the call covered every gradient of the optimizer and none
changed since (a new backward, ``zero_grad``, any in-place edit bumps the version).

The wrapper calls the real function with the same arguments and returns its result; a
generator of parameters is passed on as a generator (torch warns on an empty one), and
nothing is recorded while compiling. A failure in the recording switches it off with one
warning; the loop's call goes on. Names bound before :func:`install`
(``from torch.nn.utils import clip_grad_norm_`` at import) call the real function: the
norms are then read as without it.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad

from normwatch.guarded import Part
from normwatch.measure.model.sharding import local

_OWNERS = (torch.nn.utils, torch.nn.utils.clip_grad)
"""The modules whose ``clip_grad_norm_`` attribute is wrapped."""
KEEP = 16
"""Calls remembered at most (a call replaces those it overlaps; loops that clip and never
step a watched optimizer must not grow the list)."""


class _Call(NamedTuple):
    grads: dict[int, tuple[weakref.ref[torch.Tensor], int]]
    """Per parameter id: the gradient it clipped (not kept alive) and its version after."""
    total: torch.Tensor
    """The total norm it returned (before clipping; this rank's part under FSDP2)."""
    max_norm: float | None
    """Its ``max_norm`` where ``|g|`` after clipping follows from it (a 2-norm call of
    unsharded gradients), else ``None``."""


class Clipped(NamedTuple):
    """What the clipping calls since an optimizer's gradients were made measured of them."""

    finite: torch.Tensor
    """0-d bool: every gradient was finite (on the first call's device)."""
    sumsq: dict[torch.device, torch.Tensor] | None
    """``|g|²`` after clipping, float64 per device (``None`` unless every call was a
    2-norm)."""


_calls: list[_Call] = []
_installed = [0]
_real: dict[Any, Callable[..., Any]] = {}
part = Part("reading clip_grad_norm_'s norm",
            "the guard and the update monitor read the gradients themselves",
            off=lambda: _uninstall())


class Handle:
    """One user of the wrapper; :meth:`remove` it when done (harmless twice)."""

    def __init__(self) -> None:
        self._on = True

    def remove(self) -> None:
        if self._on:
            self._on = False
            _installed[0] -= 1
            if _installed[0] == 0:
                _uninstall()


def install() -> Handle:
    """Wrap ``clip_grad_norm_`` (once, however many users; see the module docstring)."""
    _installed[0] += 1
    if not _real and part.failed is None:
        for owner in _OWNERS:
            real = owner.clip_grad_norm_
            if hasattr(real, "__normwatch_real__"):
                continue
            _real[owner] = real
            owner.clip_grad_norm_ = _wrap(real)  # type: ignore[attr-defined]
    return Handle()


def _uninstall() -> None:
    for owner, real in _real.items():
        if hasattr(owner.clip_grad_norm_, "__normwatch_real__"):
            owner.clip_grad_norm_ = real
    _real.clear()
    _calls.clear()


def _wrap(real: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(real)
    def clip_grad_norm_(parameters: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if torch.compiler.is_compiling() or part.failed is not None:
            return real(parameters, *args, **kwargs)
        if isinstance(parameters, torch.Tensor):
            params: list[Any] = [parameters]
            passed: Any = parameters
        else:
            params = list(parameters)
            passed = (p for p in params) if isinstance(parameters, types.GeneratorType) \
                else params
        total = real(passed, *args, **kwargs)
        try:
            _record(params, total, *args, **kwargs)
        except Exception as exc:  # never take the training run down
            part.fail(exc)
        return total

    clip_grad_norm_.__normwatch_real__ = real  # type: ignore[attr-defined]
    return clip_grad_norm_


def _record(params: list[Any], total: torch.Tensor, max_norm: float, norm_type: float = 2.0,
            *_: Any, **__: Any) -> None:
    if not isinstance(total, torch.Tensor):
        return
    grads = {id(p): (weakref.ref(p.grad), p.grad._version) for p in params
             if isinstance(p, torch.Tensor) and p.grad is not None}
    mine = local(total)
    sharded, total = mine is not total, mine
    # sharded (FSDP2): this rank's part of the norm, while the clip used the whole one
    known = float(norm_type) == 2.0 and not sharded
    _calls[:] = [c for c in _calls if not c.grads.keys() & grads.keys()][-KEEP + 1:]
    _calls.append(_Call(grads, total, float(max_norm) if known else None))


def take(optimizer: torch.optim.Optimizer) -> Clipped | None:
    """What clipping measured of ``optimizer``'s gradients as they are now (and forget it),
    or ``None``: no call covered every one of them since they last changed."""
    if not _calls:
        return None
    wanted = {id(p): p.grad for g in optimizer.param_groups for p in g["params"]
              if p.grad is not None}
    if not wanted:
        return None
    used = []
    for call in _calls:
        covered = call.grads.keys() & wanted.keys()
        if not covered:
            continue
        if len(covered) < len(call.grads):
            return None  # it clipped other gradients too: its norm is not this optimizer's
        if any(call.grads[i][0]() is not wanted[i] or call.grads[i][1] != wanted[i]._version
               for i in covered):
            return None  # changed since it was clipped
        used.append(call)
    if sum(len(c.grads) for c in used) != len(wanted):
        return None  # some gradient was not clipped
    _calls[:] = [c for c in _calls if all(c is not u for u in used)]
    first = used[0].total
    finite = first.isfinite() if len(used) == 1 else \
        torch.stack([c.total.to(first.device).isfinite() for c in used]).all()
    known = [(c.total, c.max_norm) for c in used if c.max_norm is not None]
    if len(known) < len(used):
        return Clipped(finite, None)
    sumsq: dict[torch.device, torch.Tensor] = {}
    for total, max_norm in known:
        # torch's clip: g * min(1, max_norm / (|g| + 1e-6)); max_norm=inf (measuring): 1
        norm = total.double()
        part = (norm * torch.clamp(max_norm / (norm + 1e-6), max=1.0)).square()
        sumsq[part.device] = sumsq[part.device] + part if part.device in sumsq else part
    return Clipped(finite, sumsq)


def sumsq(optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor] | None:
    """:func:`take`'s ``|g|²`` after clipping, or ``None``."""
    clipped = take(optimizer)
    return None if clipped is None else clipped.sumsq
