"""Per-layer accumulators that live on the activations' device.

State is declared once, by reduction, in :mod:`normwatch.catalog` (``SUM_COLUMNS``,
``MAX_COLUMNS``, ``MIN_COLUMNS``); reset, placement and the host copy are written once
over those declarations. Updates are in-place tensor ops with no host synchronisation;
:meth:`Accumulator.read` is the only device→host copy (one per device).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping, Sequence
from itertools import repeat
from typing import Any, TypeVar

import torch

from normwatch.catalog import COLUMNS, MAX_COLUMNS, SUM_COLUMNS, combine
from normwatch.measure.state.backend import Backend
from normwatch.measure.state.buffers import RowBuffers
from normwatch.measure.state.fold import FoldPlan, fold_plan
from normwatch.measure.state.grad_fold import GradPlan, grad_plan
from normwatch.measure.state.rows import CallRows, GradRows
from normwatch.records import Limits

N_SUM, MAX_END = len(SUM_COLUMNS), len(SUM_COLUMNS) + len(MAX_COLUMNS)
"""Where the state's summed columns end, and its maxima (then its minima)."""
_Plan = TypeVar("_Plan", FoldPlan, GradPlan)
MISMATCH_COLUMN = COLUMNS.index("output_mismatch")
OUTPUT_EPS_COLUMN = COLUMNS.index("output_eps")
assert OUTPUT_EPS_COLUMN == MISMATCH_COLUMN + 1  # an output check writes both at once


class Accumulator:
    """Sum/max/min state for ``n_layers`` layers: one ``(n_layers, columns)`` block per device.

    Hooks :meth:`stage` each call's per-token rows (and :meth:`stage_grad` each gradient's);
    :meth:`commit` folds them with each device's backend (``backend(device)``, the
    :class:`~normwatch.measure.state.backend.Backend` of its tensors), at the flush (or
    every step where early warnings peek at the state; the gradients,
    :meth:`commit_grads`, at the end of each measured step): a few dozen ops per fold,
    however many calls (the native backend: one call of the C library and a few ops).
    Staging more than ``max_staged_tokens`` tokens commits at once, so the staged rows
    stay small.
    """

    def __init__(self, n_layers: int, backend: Callable[[torch.device], Backend],
                 limits: Limits | None = None, max_staged_tokens: int = 1 << 20) -> None:
        self.n_layers = n_layers
        self.backend = backend
        """Each device's backend (what folds its rows)."""
        self.limits = limits or Limits()
        self.max_staged_tokens = max_staged_tokens
        self._blocks: dict[torch.device, torch.Tensor] = {}
        self._fresh: dict[torch.device, torch.Tensor] = {}
        """Per device, a block at the identities: :meth:`reset` copies it (one op)."""
        self._staged: list[CallRows] = []
        self._staged_grads: list[GradRows] = []
        self._staged_tokens = 0
        self._commits = 0
        self._plans: dict[tuple[Any, ...], FoldPlan | GradPlan] = {}
        self.watch_poison = False
        """Whether :meth:`poisoned` is asked (the guard): folds then note it first."""
        self._poisoned: list[torch.Tensor] = []
        self._step_from = 0
        """Where this step's calls begin in the staged list."""
        self._cuda = False
        """Whether a block or a staged call was seen on a CUDA device (:meth:`on_cuda`)."""
        self.buffers = RowBuffers()
        """Where the C reader's calls put their rows (lent until :meth:`commit` folds them)."""
        self.grad_buffers = RowBuffers()
        """Where the C reader's gradients go (lent until :meth:`commit_grads` folds them)."""

    def stage(self, call: CallRows) -> None:
        """Queue one call's rows; no tensor op (the fold is a few dozen ops per step). The
        C++ lanes stage as this does (:mod:`~normwatch.measure.backends.native.contract`)."""
        self._staged.append(call)
        self._staged_tokens += call.n
        if self._staged_tokens >= self.max_staged_tokens:
            self.commit()

    def stage_grad(self, grad: GradRows) -> None:
        """Queue one gradient's rows (backward hooks); no tensor op. The C++ hooks stage as
        this does."""
        self._staged_grads.append(grad)
        self._staged_tokens += grad.norms.numel()
        if self._staged_tokens >= self.max_staged_tokens:
            self.commit()

    @property
    def has_staged_grads(self) -> bool:
        """Whether gradients wait for :meth:`commit_grads`."""
        return bool(self._staged_grads)

    def drop_grads(self) -> None:
        """Drop the staged gradients (not yet folded)."""
        self._staged_grads = []
        self.grad_buffers.give_back()
        self._staged_tokens = sum(c.n for c in self._staged)

    def mark(self) -> tuple[int, int]:
        """Where staging stands now, for :meth:`drop_since`."""
        return self._commits, len(self._staged)

    def begin_step(self) -> None:
        """A new step: :meth:`poisoned` forgets the last one's."""
        self._poisoned = []
        self._step_from = len(self._staged)

    def poisoned(self) -> list[torch.Tensor]:
        """Whether this step's calls or gradients held NaN/inf: 0-d bool tensors, per
        device and per fold since the step began (no sync)."""
        return self._poisoned + _nonfinite(self.step_rows()[1])

    def step_rows(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """What :meth:`poisoned` reads: the flags of the folds since the step began, and
        the rows staged since (the calls' inputs' and outputs', the gradients')."""
        return self._poisoned, _rows(self._staged[self._step_from:], self._staged_grads)

    def drop_since(self, mark: tuple[int, int]) -> bool:
        """Drop the calls staged since ``mark``; ``False`` if they were folded already."""
        if mark[0] != self._commits:
            return False
        del self._staged[mark[1]:]
        self._step_from = min(self._step_from, len(self._staged))
        self._staged_tokens = sum(c.n for c in self._staged) + \
            sum(g.norms.numel() for g in self._staged_grads)
        return True

    def on_cuda(self) -> bool:
        """Whether any state or staged call lives on a CUDA device (once seen, for good:
        asked every step)."""
        if not self._cuda and self._staged:  # (a block made on CUDA says so: _block)
            self._cuda = self._staged[0].v.is_cuda
        return self._cuda

    def commit(self, step_over: bool = False) -> None:
        """Fold every staged call into the state (in place, no host sync). Staged rows
        are dropped even when the fold fails. ``step_over``: the step has ended (its
        poison is not asked again: not noted)."""
        if self.watch_poison and not step_over:
            self._poisoned += _nonfinite(_rows(self._staged[self._step_from:], []))
        self._step_from = 0
        staged, self._staged = self._staged, []
        places = set(map(_place, staged))  # one fold per device and tier
        groups = {places.pop(): staged} if len(places) == 1 else _grouped(staged)
        self._commits += 1
        self.commit_grads(step_over)
        self._staged_tokens = 0
        try:
            self._fold(groups)
        finally:
            self.buffers.give_back()  # (the rows were read: folded, or dropped)

    def _fold(self, groups: dict[tuple[torch.device, bool], list[CallRows]]) -> None:
        for (device, _), calls in groups.items():
            plan = self._plan(device, calls)
            backend = self.backend(device)
            backend.accumulate(backend.fold(calls, plan), plan.rows, self._block(device))

    def commit_grads(self, step_over: bool = False) -> None:
        """Fold the staged gradients only: at the end of each measured step (small tensors
        kept from one step to the next slow the model's own allocations: 1.040x against
        1.023x for folding each step, measured), and at every :meth:`commit`
        (``step_over``: as there)."""
        staged, self._staged_grads = self._staged_grads, []
        if not staged:
            return self.grad_buffers.give_back()
        if self.watch_poison and not step_over:
            self._poisoned += _nonfinite(_rows([], staged))
        norms = list(map(_norms, staged))  # (over every gradient at once, in C)
        self._staged_tokens -= sum(map(torch.Tensor.numel, norms))
        devices = set(map(_device, norms))
        grads: dict[torch.device, list[GradRows]] = {}
        if len(devices) == 1:
            grads[devices.pop()] = staged
        else:
            for grad, t in zip(staged, norms, strict=True):
                grads.setdefault(t.device, []).append(grad)
        try:
            for device, group in grads.items():
                self.backend(device).fold_grads(self._block(device), group,
                                                self._grad_plan(device, group))
        finally:
            self.grad_buffers.give_back()  # (the rows were read: folded, or dropped)

    def _plan(self, device: torch.device, calls: list[CallRows]) -> FoldPlan:
        """The fold's constant vectors, cached: the same forward pass stages the same
        sequence of calls every step."""
        key0 = calls[0].key
        if all(map(_lined_up, calls)):  # (the common case: read by C's getters, no frame)
            signature: tuple[Any, ...] = (device, calls[0].full, tuple(map(_layout, calls)),
                                          tuple(map(operator.sub, map(_key, calls),
                                                    repeat(key0))))
        else:
            signature = (device, calls[0].full, tuple(c.signature(key0) for c in calls))
        plan = self._plans.get(signature)
        if not isinstance(plan, FoldPlan):
            plan = self._cache(signature, fold_plan(calls, self.limits))
        return plan

    def _grad_plan(self, device: torch.device, staged: list[GradRows]) -> GradPlan:
        """:func:`~normwatch.measure.state.grad_fold.grad_plan`, cached like :meth:`_plan`."""
        signature = (device, "grad", tuple(map(_where, staged)),
                     tuple(map(torch.Tensor.numel, map(_norms, staged))),
                     tuple(map(operator.is_, map(_lo, staged), repeat(None))))
        plan = self._plans.get(signature)
        if not isinstance(plan, GradPlan):
            plan = self._cache(signature, grad_plan(staged, device))
        return plan

    def _cache(self, signature: tuple[Any, ...], plan: _Plan) -> _Plan:
        if len(self._plans) >= 64:
            self._plans.clear()
        self._plans[signature] = plan
        return plan

    def _block(self, device: torch.device) -> torch.Tensor:
        block = self._blocks.get(device)
        if block is None:
            block = self._blocks[device] = _new_state(self.n_layers, device)
            self._fresh[device] = block.clone()
            self._cuda = self._cuda or device.type == "cuda"
        return block

    def place(self, device: torch.device) -> None:
        """Make ``device``'s block ahead of the calls it will hold (outside any graph: a
        compiled call's fold then allocates no state)."""
        self._block(device)

    def update_check(self, row: int, error: torch.Tensor, eps: torch.Tensor) -> None:
        """Fold an output check (0-d tensors: the mismatch and the precision the output
        carries) into layer ``row``; NaN never beats a value."""
        block = self._block(error.device)
        for column, value in ((MISMATCH_COLUMN, error), (OUTPUT_EPS_COLUMN, eps)):
            cell = block[row, column : column + 1]
            torch.fmax(cell, value.reshape(1).to(cell.dtype), out=cell)

    def read(
        self, extras: Mapping[torch.device, torch.Tensor | Sequence[torch.Tensor]] | None = None
    ) -> tuple[list[dict[str, float]], dict[torch.device, list[float]]]:
        """Copy everything to the host: one copy per device, ``extras`` (a tensor or flat
        tensors per device) riding along, joined with the state as float64 in one op.

        Returns per-layer ``{column: value}`` dicts (combined across devices) and each
        extra as a list of floats. Does not reset.
        """
        self.commit()
        extras = dict(extras or {})
        per_device: list[list[dict[str, float]]] = []
        out_extras: dict[torch.device, list[float]] = {}
        for device in dict.fromkeys([*self._blocks, *extras]):
            block = self._blocks.get(device)
            extra = extras.get(device)
            riding = [] if extra is None else [extra.detach().reshape(-1)] \
                if isinstance(extra, torch.Tensor) else list(extra)
            parts = riding if block is None else [block.view(-1), *riding]
            flat = (torch.cat(parts) if len(parts) > 1 else parts[0]).to(torch.float64) \
                .cpu().tolist()
            width = len(COLUMNS)
            if block is not None:
                per_device.append([dict(zip(COLUMNS, flat[i * width : (i + 1) * width],
                                            strict=True)) for i in range(self.n_layers)])
            if extra is not None:
                out_extras[device] = flat[len(flat) - sum(t.numel() for t in riding):]
        rows = [combine([d[i] for d in per_device], COLUMNS) for i in range(self.n_layers)]
        return rows, out_extras

    @property
    def blocks(self) -> dict[torch.device, torch.Tensor]:
        """The live ``(n_layers, columns)`` blocks, by device (read-only use)."""
        return dict(self._blocks)

    def reset(self) -> None:
        """Return every device block to the reduction identities."""
        self._staged, self._staged_grads = [], []
        self._step_from = 0
        self._staged_tokens = 0
        for device, block in self._blocks.items():
            block.copy_(self._fresh[device])


_norms, _lo, _device = (operator.attrgetter(a) for a in ("norms", "lo", "device"))
_where = operator.attrgetter("layer", "site", "width")
_place = operator.attrgetter("v.device", "full")
_lined_up, _key = operator.attrgetter("lined_up"), operator.attrgetter("key")
_layout = operator.attrgetter("row", "n", "width", "eps", "centred")
"""What a lined-up call's :meth:`~normwatch.measure.state.rows.CallRows.signature` is
made of but its key (its output's tokens are its input's)."""


def _grouped(calls: list[CallRows]) -> dict[tuple[torch.device, bool], list[CallRows]]:
    """``calls`` by device and tier."""
    groups: dict[tuple[torch.device, bool], list[CallRows]] = {}
    for call in calls:
        groups.setdefault(_place(call), []).append(call)
    return groups


def _rows(calls: list[CallRows], grads: list[GradRows]) -> list[torch.Tensor]:
    """The row tensors of ``calls`` and ``grads`` (a token holding NaN/inf has NaN/inf
    rows)."""
    return [*(c.v for c in calls), *(c.out for c in calls if c.out is not None),
            *(g.norms for g in grads)]


def _nonfinite(rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per device, whether any of ``rows`` is NaN/inf (a 0-d bool): rows of one shape
    stacked (a model's calls and gradients are mostly alike), a few ops per device."""
    parts: dict[torch.device, dict[tuple[object, ...], list[torch.Tensor]]] = {}
    for row in rows:
        parts.setdefault(row.device, {}).setdefault((row.dtype, *row.shape), []).append(row)
    return [~(torch.cat([(torch.stack(p) if len(p) > 1 else p[0]).view(-1)
                         for p in alike.values()]).abs() < math.inf).all()
            for alike in parts.values()]


def _new_state(rows: int, device: torch.device) -> torch.Tensor:
    """``rows`` rows of :data:`COLUMNS` at their identities, kept at a fixed address (the
    compiler treats it as static: compiled calls name their layer by its rows)."""
    dtype = torch.float32 if device.type == "mps" else torch.float64
    state = torch.empty(rows, len(COLUMNS), dtype=dtype, device=device)
    _reset(state)
    torch._dynamo.mark_static_address(state)
    return state


def _reset(block: torch.Tensor) -> None:
    block[:, :N_SUM].zero_()
    block[:, N_SUM:MAX_END].fill_(-math.inf)
    block[:, MAX_END:].fill_(math.inf)

