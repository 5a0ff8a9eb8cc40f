"""Per-layer accumulators that live on the activations' device.

State is declared once, by reduction, in :mod:`normwatch.stats` (``SUM_COLUMNS``,
``MAX_COLUMNS``, ``MIN_COLUMNS``); reset, placement and the host copy are written once
over those declarations. Updates are in-place tensor ops with no host synchronisation;
:meth:`Accumulator.read` is the only device→host copy (one per device).
"""

from __future__ import annotations

import math

import torch

from normwatch.stats import COLUMNS, MAX_COLUMNS, MIN_COLUMNS, SUM_COLUMNS

_N_SUM, _N_MAX, _N_MIN = len(SUM_COLUMNS), len(MAX_COLUMNS), len(MIN_COLUMNS)
_MAX_END = _N_SUM + _N_MAX
MISMATCH_COLUMN = COLUMNS.index("output_mismatch")


def identity_row() -> list[float]:
    """The reduction identities: 0 for sums, -inf for maxes, +inf for mins."""
    return [0.0] * _N_SUM + [-math.inf] * _N_MAX + [math.inf] * _N_MIN


class Accumulator:
    """Sum/max/min state for ``n_layers`` layers: one ``(n_layers, columns)`` block per device."""

    def __init__(self, n_layers: int) -> None:
        self.n_layers = n_layers
        self._blocks: dict[torch.device, torch.Tensor] = {}
        self._staged: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        self._indices: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}

    def stage(self, row: int, values: torch.Tensor) -> None:
        """Queue one call's vector for layer ``row``; :meth:`commit` folds the queue.

        Staging costs no tensor op per call; the fold is a handful of ops per step.
        """
        self._staged.setdefault(values.device, []).append((row, values))

    def commit(self) -> None:
        """Fold every staged vector into the state (in place, no host sync)."""
        for device, staged in self._staged.items():
            if not staged:
                continue
            rows = tuple(r for r, _ in staged)
            values = torch.stack([v for _, v in staged])
            staged.clear()
            index = self._index(device, rows)
            block = self._block(device)
            block[:, :_N_SUM].index_add_(0, index, values[:, :_N_SUM])
            # amax/amin of scatter_reduce propagate NaN: NaN never beats a value
            inf = math.inf
            peaks = values[:, _N_SUM:_MAX_END].nan_to_num(-inf, inf, -inf)
            block[:, _N_SUM:_MAX_END].scatter_reduce_(
                0, index[:, None].expand_as(peaks), peaks, "amax")
            lows = values[:, _MAX_END:].nan_to_num(inf, inf, -inf)
            block[:, _MAX_END:].scatter_reduce_(0, index[:, None].expand_as(lows), lows, "amin")

    def _index(self, device: torch.device, rows: tuple[int, ...]) -> torch.Tensor:
        """A device tensor of ``rows``, built by fill kernels (no host-to-device copy) and
        cached: the same forward pass gives the same sequence every step."""
        index = self._indices.get((device, rows))
        if index is None:
            index = torch.cat([torch.full((1,), r, dtype=torch.int64, device=device)
                               for r in rows])
            if len(self._indices) > 64:
                self._indices.clear()
            self._indices[(device, rows)] = index
        return index

    def _block(self, device: torch.device) -> torch.Tensor:
        block = self._blocks.get(device)
        if block is None:
            dtype = torch.float32 if device.type == "mps" else torch.float64
            block = torch.empty(self.n_layers, len(COLUMNS), dtype=dtype, device=device)
            _reset(block)
            self._blocks[device] = block
        return block

    def update_mismatch(self, row: int, value: torch.Tensor) -> None:
        """Fold an output-mismatch measurement (0-d tensor) into layer ``row``."""
        cell = self._block(value.device)[row, MISMATCH_COLUMN : MISMATCH_COLUMN + 1]
        torch.fmax(cell, value.reshape(1).to(cell.dtype), out=cell)

    def read(
        self, extras: dict[torch.device, torch.Tensor] | None = None
    ) -> tuple[list[dict[str, float]], dict[torch.device, list[float]]]:
        """Copy everything to the host: one copy per device, ``extras`` riding along.

        Returns per-layer ``{column: value}`` dicts (combined across devices) and each
        extra as a list of floats. Does not reset.
        """
        self.commit()
        extras = dict(extras or {})
        rows = [identity_row() for _ in range(self.n_layers)]
        out_extras: dict[torch.device, list[float]] = {}
        for device in dict.fromkeys([*self._blocks, *extras]):
            parts = []
            block = self._blocks.get(device)
            if block is not None:
                parts.append(block.flatten().to(torch.float64))
            extra = extras.get(device)
            if extra is not None:
                parts.append(extra.detach().flatten().to(torch.float64))
            flat = torch.cat(parts).cpu().tolist()
            if block is not None:
                width = len(COLUMNS)
                for i, row in enumerate(rows):
                    _combine(row, flat[i * width : (i + 1) * width])
            if extra is not None:
                out_extras[device] = flat[len(flat) - extra.numel() :]
        return [dict(zip(COLUMNS, row, strict=True)) for row in rows], out_extras

    @property
    def blocks(self) -> dict[torch.device, torch.Tensor]:
        """The live ``(n_layers, columns)`` blocks, by device (read-only use)."""
        return dict(self._blocks)

    def reset(self) -> None:
        """Return every device block to the reduction identities."""
        self._staged.clear()
        for block in self._blocks.values():
            _reset(block)


def _reset(block: torch.Tensor) -> None:
    block[:, :_N_SUM].zero_()
    block[:, _N_SUM:_MAX_END].fill_(-math.inf)
    block[:, _MAX_END:].fill_(math.inf)


def _combine(row: list[float], other: list[float]) -> None:
    for j in range(_N_SUM):
        row[j] += other[j]
    for j in range(_N_SUM, _MAX_END):
        row[j] = max(row[j], other[j])
    for j in range(_MAX_END, len(row)):
        row[j] = min(row[j], other[j])
