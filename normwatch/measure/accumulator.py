"""Per-layer accumulators that live on the activations' device.

State is declared once, by reduction, in :mod:`normwatch.catalog` (``SUM_COLUMNS``,
``MAX_COLUMNS``, ``MIN_COLUMNS``); reset, placement and the host copy are written once
over those declarations. Updates are in-place tensor ops with no host synchronisation;
:meth:`Accumulator.read` is the only device→host copy (one per device).
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

import torch

from normwatch.catalog import COLUMNS, MAX_COLUMNS, SUM_COLUMNS, combine
from normwatch.measure.gradients import GradPlan, GradRows, fold_grads, grad_plan
from normwatch.measure.reductions import CallRows, FoldPlan, fold_calls, fold_plan
from normwatch.records import Limits

_N_SUM, _N_MAX = len(SUM_COLUMNS), len(MAX_COLUMNS)
_Plan = TypeVar("_Plan", FoldPlan, GradPlan)
_MAX_END = _N_SUM + _N_MAX
MISMATCH_COLUMN = COLUMNS.index("output_mismatch")
OUTPUT_EPS_COLUMN = COLUMNS.index("output_eps")
assert OUTPUT_EPS_COLUMN == MISMATCH_COLUMN + 1  # an output check writes both at once


class Accumulator:
    """Sum/max/min state for ``n_layers`` layers: one ``(n_layers, columns)`` block per device.

    Hooks :meth:`stage` each call's per-token rows (and :meth:`stage_grad` each gradient's);
    :meth:`commit` folds them with :func:`~normwatch.measure.reductions.fold_calls` (and
    :func:`~normwatch.measure.gradients.fold_grads`), at the flush (or every step where
    early warnings peek at the state; the gradients, :meth:`commit_grads`, at the end of
    each measured step): a few dozen ops per fold, however many calls.
    Staging more than ``max_staged_tokens`` tokens commits at once, so the staged rows
    stay small.
    """

    def __init__(self, n_layers: int, limits: Limits | None = None,
                 max_staged_tokens: int = 1 << 20) -> None:
        self.n_layers = n_layers
        self.limits = limits or Limits()
        self.max_staged_tokens = max_staged_tokens
        self._blocks: dict[torch.device, torch.Tensor] = {}
        self._staged: list[CallRows] = []
        self._staged_grads: list[GradRows] = []
        self._staged_tokens = 0
        self._commits = 0
        self._plans: dict[tuple[Any, ...], FoldPlan | GradPlan] = {}
        self._meta: dict[torch.device, torch.Tensor] = {}
        self._grads: dict[tuple[torch.device, int], torch.Tensor] = {}

    def stage(self, call: CallRows) -> None:
        """Queue one call's rows; no tensor op (the fold is a few dozen ops per step)."""
        self._staged.append(call)
        self._staged_tokens += call.hi.shape[0]
        if self._staged_tokens >= self.max_staged_tokens:
            self.commit()

    def stage_grad(self, grad: GradRows) -> None:
        """Queue one gradient's rows (backward hooks); no tensor op."""
        self._staged_grads.append(grad)
        self._staged_tokens += grad.rows.shape[1]
        if self._staged_tokens >= self.max_staged_tokens:
            self.commit()

    @property
    def has_staged_grads(self) -> bool:
        """Whether gradients wait for :meth:`commit_grads`."""
        return bool(self._staged_grads)

    def drop_grads(self) -> None:
        """Drop the staged gradients (not yet folded)."""
        self._staged_grads = []
        self._staged_tokens = sum(c.hi.shape[0] for c in self._staged)

    def mark(self) -> tuple[int, int]:
        """Where staging stands now, for :meth:`drop_since`."""
        return self._commits, len(self._staged)

    def drop_since(self, mark: tuple[int, int]) -> bool:
        """Drop the calls staged since ``mark``; ``False`` if they were folded already."""
        if mark[0] != self._commits:
            return False
        del self._staged[mark[1]:]
        self._staged_tokens = sum(c.hi.shape[0] for c in self._staged) + \
            sum(g.rows.shape[1] for g in self._staged_grads)
        return True

    def on_cuda(self) -> bool:
        """Whether any state or staged call lives on a CUDA device."""
        return any(d.type == "cuda" for d in self._blocks) or \
            any(c.hi.device.type == "cuda" for c in self._staged[:1]) or \
            any(g.rows.device.type == "cuda" for g in self._staged_grads[:1])

    def commit(self) -> None:
        """Fold every staged call into the state (in place, no host sync). Staged rows
        are dropped even when the fold fails."""
        groups: dict[tuple[torch.device, bool], list[CallRows]] = {}
        for call in self._staged:  # one fold per device and tier
            groups.setdefault((call.hi.device, call.full), []).append(call)
        self._staged = []
        self._commits += 1
        self.commit_grads()
        self._staged_tokens = 0
        for (device, _), calls in groups.items():
            plan = self._plan(device, calls)
            index = plan.rows
            values = fold_calls(calls, plan)
            block = self._block(device)
            block[:, :_N_SUM].index_add_(0, index, values[:, :_N_SUM].to(block.dtype))
            # amax/amin of scatter_reduce propagate NaN: NaN never beats a value
            inf = math.inf
            peaks = values[:, _N_SUM:_MAX_END].nan_to_num(-inf, inf, -inf).to(block.dtype)
            block[:, _N_SUM:_MAX_END].scatter_reduce_(
                0, index[:, None].expand_as(peaks), peaks, "amax")
            lows = values[:, _MAX_END:].nan_to_num(inf, inf, -inf).to(block.dtype)
            block[:, _MAX_END:].scatter_reduce_(0, index[:, None].expand_as(lows), lows, "amin")

    def commit_grads(self) -> None:
        """Fold the staged gradients only: at the end of each measured step (small tensors
        kept from one step to the next slow the model's own allocations: 1.040x against
        1.023x for folding each step, measured), and at every :meth:`commit`."""
        staged, self._staged_grads = self._staged_grads, []
        grads: dict[torch.device, list[GradRows]] = {}
        for grad in staged:
            grads.setdefault(grad.rows.device, []).append(grad)
            self._staged_tokens -= grad.rows.shape[1]
        for device, group in grads.items():
            fold_grads(self._block(device), group, self._grad_plan(device, group))

    def _plan(self, device: torch.device, calls: list[CallRows]) -> FoldPlan:
        """The fold's constant vectors, cached: the same forward pass stages the same
        sequence of calls every step."""
        key0 = calls[0].key
        signature = (device, calls[0].full, tuple(c.signature(key0) for c in calls))
        plan = self._plans.get(signature)
        if not isinstance(plan, FoldPlan):
            plan = self._cache(signature, fold_plan(calls, self.limits))
        return plan

    def _grad_plan(self, device: torch.device, staged: list[GradRows]) -> GradPlan:
        """:func:`~normwatch.measure.gradients.grad_plan`, cached like :meth:`_plan`."""
        signature = (device, "grad", tuple((g.layer, g.site, g.rows.shape[1], g.width)
                                           for g in staged))
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
        return block

    def row_state(self, device: torch.device, row: int) -> torch.Tensor:
        """Layer ``row``'s state on ``device``: a view of the device block, which compiled
        hooks update in place (:func:`fold_into`); made ahead of the first call so that
        traced code only reads it."""
        return self._block(device)[row]

    def row_meta(self, device: torch.device, row: int) -> torch.Tensor:
        """Layer ``row``'s :data:`META` codes on ``device``, written by compiled calls
        (which may not touch Python state) and read at the flush."""
        meta = self._meta.get(device)
        if meta is None:
            meta = self._meta[device] = torch.zeros(self.n_layers, len(META),
                                                    dtype=torch.float64, device=device)
            torch._dynamo.mark_static_address(meta)
        return meta[row]

    def grad_row(self, device: torch.device, row: int) -> torch.Tensor:
        """Layer ``row``'s gradient state on ``device``: a row of :data:`COLUMNS` of its
        own (the backward hooks fold only its gradient columns). Its own storage: the
        compiled backward saves it, so the forward's in-place folds into the block must
        not touch its version counter."""
        grads = self._grads.get((device, row))
        if grads is None:
            grads = self._grads[(device, row)] = _new_state(1, device)
        return grads[0]

    def update_check(self, row: int, error: torch.Tensor, eps: torch.Tensor) -> None:
        """Fold an output check (0-d tensors: the mismatch and the precision the output
        carries) into layer ``row``; NaN never beats a value."""
        block = self._block(error.device)
        for column, value in ((MISMATCH_COLUMN, error), (OUTPUT_EPS_COLUMN, eps)):
            cell = block[row, column : column + 1]
            torch.fmax(cell, value.reshape(1).to(cell.dtype), out=cell)

    def read(
        self, extras: dict[torch.device, torch.Tensor] | None = None
    ) -> tuple[list[dict[str, float]], dict[torch.device, list[float]]]:
        """Copy everything to the host: one copy per device, ``extras`` riding along.

        Returns per-layer ``{column: value}`` dicts (combined across devices, with the
        :data:`META` codes) and each extra as a list of floats. Does not reset.
        """
        self.commit()
        extras = dict(extras or {})
        per_device: list[list[dict[str, float]]] = []
        out_extras: dict[torch.device, list[float]] = {}
        metas: list[list[float]] = [[0.0] * len(META) for _ in range(self.n_layers)]
        grad_rows: list[list[dict[str, float]]] = [[] for _ in range(self.n_layers)]
        for device in dict.fromkeys([*self._blocks, *extras]):
            parts = []
            block = self._blocks.get(device)
            grads = {row: t for (d, row), t in self._grads.items() if d == device}
            meta = self._meta.get(device)
            if meta is not None:
                parts.append(meta.flatten())
            if block is not None:
                parts.append(block.flatten().to(torch.float64))
            parts += [t.flatten().to(torch.float64) for t in grads.values()]
            extra = extras.get(device)
            if extra is not None:
                parts.append(extra.detach().flatten().to(torch.float64))
            flat = torch.cat(parts).cpu().tolist()
            if meta is not None:
                codes, flat = flat[:meta.numel()], flat[meta.numel():]
                for i, row in enumerate(metas):
                    row[:] = [max(a, b) for a, b in zip(row, codes[i * len(META):], strict=False)]
            width = len(COLUMNS)
            if block is not None:
                per_device.append([dict(zip(COLUMNS, flat[i * width : (i + 1) * width],
                                            strict=True)) for i in range(self.n_layers)])
                flat = flat[block.numel():]
            for i, layer in enumerate(grads):  # gradient rows: combined like a device's
                grad_rows[layer].append(dict(zip(COLUMNS, flat[i * width : (i + 1) * width],
                                               strict=True)))
            if extra is not None:
                out_extras[device] = flat[len(flat) - extra.numel() :]
        rows = [combine([d[i] for d in per_device] + grad_rows[i], COLUMNS)
                | dict(zip(META, metas[i], strict=True)) for i in range(self.n_layers)]
        return rows, out_extras

    @property
    def blocks(self) -> dict[torch.device, torch.Tensor]:
        """The live ``(n_layers, columns)`` blocks, by device (read-only use)."""
        return dict(self._blocks)

    def reset(self) -> None:
        """Return every device block to the reduction identities."""
        self._staged, self._staged_grads = [], []
        self._staged_tokens = 0
        for block in self._blocks.values():
            _reset(block)
        for grads in self._grads.values():
            _reset(grads.data)  # .data: compiled backwards that saved it stay valid


META = ("meta_input", "meta_weight", "meta_output", "meta_autocast", "meta_first")
"""Per-layer codes compiled calls leave (:func:`dtype_code` of the input, weight, output
and autocast dtypes; 0: none seen; and the score of the layer's first call, as
:func:`~normwatch.catalog.decode_score` reads: its place in forward order), riding along
in :meth:`Accumulator.read`'s rows (never reset)."""
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64,
          torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64, torch.complex128)


def dtype_code(dtype: torch.dtype | None) -> float:
    """A dtype as a float code for :data:`META` (0: none or unknown)."""
    return float(DTYPES.index(dtype) + 1) if dtype in DTYPES else 0.0


def code_dtype(code: float) -> torch.dtype | None:
    """The dtype of a :func:`dtype_code`."""
    i = int(code) - 1
    return DTYPES[i] if 0 <= i < len(DTYPES) else None


def fold_into(state: torch.Tensor, values: torch.Tensor, gate: torch.Tensor) -> None:
    """Fold one call's ``values`` (:func:`~normwatch.measure.reductions.fold_one`) into a
    layer's ``state`` in place where the 0-d ``gate`` is true: the staged fold's
    arithmetic (sums add, NaN never beats a peak) as tensor ops a compiler can trace."""
    inf = math.inf
    values = values.to(state.dtype)
    merged = torch.cat([
        state[:_N_SUM] + values[:_N_SUM],
        torch.maximum(state[_N_SUM:_MAX_END], values[_N_SUM:_MAX_END].nan_to_num(-inf, inf, -inf)),
        torch.minimum(state[_MAX_END:], values[_MAX_END:].nan_to_num(inf, inf, -inf))])
    state.copy_(torch.where(gate, merged, state))


def _new_state(rows: int, device: torch.device) -> torch.Tensor:
    """``rows`` rows of :data:`COLUMNS` at their identities, kept at a fixed address (the
    compiler treats it as static; CUDA graphs keep it)."""
    dtype = torch.float32 if device.type == "mps" else torch.float64
    state = torch.empty(rows, len(COLUMNS), dtype=dtype, device=device)
    _reset(state)
    torch._dynamo.mark_static_address(state)
    return state


def _reset(block: torch.Tensor) -> None:
    block[:, :_N_SUM].zero_()
    block[:, _N_SUM:_MAX_END].fill_(-math.inf)
    block[:, _MAX_END:].fill_(math.inf)
