"""The fold of a step's staged gradients into the per-layer state, by torch's ops.

    >>> plan = grad_plan(staged, device)      # once per distinct backward pass (cached)
    >>> fold_grads(block, staged, plan)       # in place, a couple of dozen ops

Each staged gradient (:class:`~normwatch.measure.state.rows.GradRows`) adds to its
layer's site columns (:data:`~normwatch.catalog.GRAD_SUMS`: tokens, finite tokens, sum of
squares, elements) and raises its peak max |g|; a weight gradient adds its count and
squared norm. A backend may fold them its own way (the native one: one C call).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from normwatch.catalog import COLUMNS, GRAD_SITES, GRAD_SUMS
from normwatch.measure.state.rows import SITES, WEIGHT, GradRows, runs

SUM_AT = {site: COLUMNS.index(f"{site}_tokens") for site in GRAD_SITES}
"""Where each site's summed columns start (adjacent, :data:`GRAD_SUMS` order)."""
PEAK_AT = {site: COLUMNS.index(f"{site}_absmax") for site in GRAD_SITES}
WEIGHT_AT = COLUMNS.index("weight_grads")
assert all(COLUMNS[SUM_AT[s]:SUM_AT[s] + len(GRAD_SUMS)] == tuple(f"{s}_{c}" for c in GRAD_SUMS)
           for s in GRAD_SITES)
assert COLUMNS[WEIGHT_AT + 1] == "weight_grad_sumsq"
assert all(SUM_AT[s] == SUM_AT[SITES[0]] + i * len(GRAD_SUMS) and
           PEAK_AT[s] == PEAK_AT[SITES[0]] + i for i, s in enumerate(SITES))  # one slice each


def unscale(rows: Sequence[dict[str, float]], scale: float) -> None:
    """Divide the gradient columns of raw ``rows`` (in place, host side) by a loss
    scaler's ``scale``: the statistics of the gradients the optimizer sees."""
    if not scale or scale == 1.0 or not math.isfinite(scale):
        return
    for row in rows:
        for site in GRAD_SITES:
            row[f"{site}_sumsq"] /= scale * scale
            row[f"{site}_absmax"] /= scale
        row["weight_grad_sumsq"] /= scale * scale


@dataclass(frozen=True)
class GradPlan:
    """The constant vectors of :func:`fold_grads`, built once per distinct backward pass
    (by fill kernels: no host-to-device copy): per token, where it folds (``layer *
    len(SITES) + site``), its width and its gradient's position among the staged ones;
    per gradient, where it folds; per weight gradient, its layer."""

    index: torch.Tensor
    width: torch.Tensor
    segment: torch.Tensor
    where: torch.Tensor
    weights: torch.Tensor
    uniform: int
    """Tokens per gradient when every gradient has the same count (then each one's sums
    are plain reductions over a view, and only those are scattered), else 0."""
    widths: torch.Tensor
    """Per gradient, its width."""
    table: torch.Tensor | None = None
    """On the CPU, the C fold's per-gradient line (float64: tokens, width, where its
    sums and its peak go in the flat block: ``G_...`` in the C source), else ``None``."""
    weights_at: torch.Tensor | None = None
    """On the CPU, where each weight gradient goes in the flat block (float64)."""
    cells: torch.Tensor | None = None
    """The staged gradients grouped by the block cells they fold into, for a fold that
    gives each cell to one program (:func:`cell_table`)."""
    acts_at: tuple[int, ...] = ()
    """Where the activations' gradients stand among the staged (read each step by C's
    getters: no Python a gradient)."""
    weights_from: tuple[int, ...] = ()
    """Where the weights' gradients stand among the staged."""
    whole: bool = True
    """Whether no activation's gradient was staged with its min and max apart."""
    n_layers: int = 0
    """Layers with a weight's gradient staged."""


def grad_plan(staged: Sequence[GradRows], device: torch.device) -> GradPlan:
    """The :class:`GradPlan` of ``staged`` (all on ``device``)."""
    acts = [s for s in staged if s.site != WEIGHT]
    counts = [s.tokens for s in acts]
    where = [s.layer * len(SITES) + s.site for s in acts]
    weights = [s.layer for s in staged if s.site == WEIGHT]
    widths = [float(s.width) for s in acts]
    return GradPlan(
        index=runs(where, counts, torch.int64, device),
        width=runs(widths, counts, torch.float32, device),
        segment=runs(list(range(len(acts))), counts, torch.int64, device),
        where=runs(where, [1] * len(where), torch.int64, device),
        weights=runs(weights, [1] * len(weights), torch.int64, device),
        uniform=counts[0] if counts and len(set(counts)) == 1 else 0,
        widths=runs(widths, [1] * len(widths), torch.float32, device),
        table=torch.tensor([[n, w, s.layer * len(COLUMNS) + SUM_AT[SITES[s.site]],
                             s.layer * len(COLUMNS) + PEAK_AT[SITES[s.site]]]
                            for s, n, w in zip(acts, counts, widths, strict=True)],
                           dtype=torch.float64).reshape(-1, 4)
        if device.type == "cpu" else None,
        weights_at=torch.tensor([layer * len(COLUMNS) + WEIGHT_AT for layer in weights],
                                dtype=torch.float64) if device.type == "cpu" else None,
        cells=cell_table(staged, device),
        acts_at=tuple(i for i, s in enumerate(staged) if s.site != WEIGHT),
        weights_from=tuple(i for i, s in enumerate(staged) if s.site == WEIGHT),
        whole=all(s.lo is None for s in acts), n_layers=len(set(weights)))


def cell_table(staged: Sequence[GradRows], device: torch.device) -> torch.Tensor:
    """The staged gradients by the cells of the flat block they fold into, as one int64
    vector of seven parts: the activations' gradients' positions (among them) grouped by
    site cell, each cell's start in that order (and the end), each cell's sums' and
    peak's offsets in the flat block; then the weights' positions (among them) grouped
    by layer, each layer's start (and the end), its offset. A cell's gradients in one
    program: two backward passes of one step (gradient accumulation) never race."""
    acts = [s for s in staged if s.site != WEIGHT]
    sites: dict[int, list[int]] = {}
    for i, s in enumerate(acts):
        sites.setdefault(s.layer * len(SITES) + s.site, []).append(i)
    layers: dict[int, list[int]] = {}
    for i, s in enumerate(s for s in staged if s.site == WEIGHT):
        layers.setdefault(s.layer, []).append(i)
    width = len(COLUMNS)
    values = [*_grouped(sites.values()),
              *(c // len(SITES) * width + SUM_AT[SITES[c % len(SITES)]] for c in sites),
              *(c // len(SITES) * width + PEAK_AT[SITES[c % len(SITES)]] for c in sites),
              *_grouped(layers.values()), *(layer * width + WEIGHT_AT for layer in layers)]
    if device.type == "cpu":
        return torch.tensor(values, dtype=torch.int64)
    return runs(values, [1] * len(values), torch.int64, device)  # (no host-to-device copy)


def _grouped(groups: Collection[list[int]]) -> list[int]:
    """Groups of positions laid end to end, then where each starts (and the end)."""
    order = [i for group in groups for i in group]
    starts = [0]
    for group in groups:
        starts.append(starts[-1] + len(group))
    return order + starts


def fold_grads(block: torch.Tensor, staged: Sequence[GradRows], plan: GradPlan) -> None:
    """Fold staged gradients (one device: ``block``'s) into ``block``'s gradient columns
    in place, by torch's ops: a couple of dozen, however many gradients.

    A token counts as finite where its norm is, or where its whole gradient is finite
    (then only its sum of squares overflowed, and counts as inf); the peak max |g| of a
    gradient holding NaN/inf is not known (its finite tokens' is not measured)."""
    acts = [s for s in staged if s.site != WEIGHT]
    weights = [s.norms for s in staged if s.site == WEIGHT]
    if acts:
        norms, peak = _norms_and_peaks(acts)  # peak NaN/inf: the gradient holds them
        whole = peak.abs() < math.inf  # (isfinite in two ops: NaN is not below)
        n_rows, n = block.shape[0], len(GRAD_SUMS)
        if plan.uniform:  # summed per gradient over a view, then scattered
            norms = norms.view(len(acts), plan.uniform)
            ok = (norms < math.inf) | whole[:, None]  # (norms >= 0)
            index, width = plan.where, plan.widths
        else:  # scattered per token
            ok = (norms < math.inf) | whole[plan.segment]
            index, width = plan.index, plan.width
        okf, squares = ok.float(), torch.where(ok, norms * norms, 0.0)
        if plan.uniform:
            okf, squares = okf.sum(1), squares.sum(1)
        sums = torch.stack([torch.full_like(okf, plan.uniform or 1), okf, squares, okf * width],
                           1)
        total = sums.new_zeros(n_rows * len(SITES), n).index_add_(0, index, sums)
        known = torch.where(whole, peak, -math.inf)
        peaks = known.new_full((n_rows * len(SITES),), -math.inf).scatter_reduce_(
            0, plan.where, known, "amax")
        sums_at, peaks_at = SUM_AT[SITES[0]], PEAK_AT[SITES[0]]  # every site's, adjacent
        block[:, sums_at:sums_at + n * len(SITES)] += \
            total.view(n_rows, len(SITES) * n).to(block.dtype)
        cells = block[:, peaks_at:peaks_at + len(SITES)]
        torch.fmax(cells, peaks.view(n_rows, len(SITES)).to(block.dtype), out=cells)
    if weights:
        norms = (torch.stack(weights) if all(w.dim() == 0 for w in weights) else
                 torch.cat([w.reshape(-1)[:1] for w in weights])).to(block.dtype)
        both = torch.stack([torch.ones_like(norms), norms * norms], 1)
        block[:, WEIGHT_AT:WEIGHT_AT + 2].index_add_(0, plan.weights, both)


def _norms_and_peaks(acts: Sequence[GradRows]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every gradient's tokens' norms (float32; ``(gradients, tokens)`` or flat) and each
    gradient's max |g|: a few ops however many gradients when they are the fused kernel's
    alike (:attr:`~normwatch.measure.state.rows.GradRows.rowwise`)."""
    shape = acts[0].norms.shape
    if acts[0].rowwise and all(s.rowwise and s.norms.shape == shape for s in acts):
        rows = torch.stack([s.norms for s in acts])
        return rows[:, 0], rows[:, 1].amax(1)
    acts = [s.unpacked() for s in acts]
    bounds = torch.stack([t for s in acts for t in (s.lo, s.hi) if t is not None]
                         ).float().view(-1, 2)
    shape = acts[0].norms.shape
    norms = torch.stack([s.norms for s in acts]).view(-1).float() \
        if all(s.norms.shape == shape for s in acts) else \
        torch.cat([s.norms.reshape(-1).float() for s in acts])  # one op when alike
    return norms, torch.maximum(bounds[:, 1], -bounds[:, 0])
