"""The native backend (CPU): the C library's readers and folds where they cover the
tensors, torch's ops (:class:`~normwatch.measure.backends.torchops.TorchBackend`) where
they do not.

    >>> NATIVE.call_rows(layer, x, y, key, full)   # one C call into a lent buffer

A layer's readers (:class:`~normwatch.measure.backends.native.readers.RowReader`, one
:class:`~normwatch.measure.backends.native.readers.GradReader` per gradient site, the
:class:`~normwatch.measure.backends.native.readers.ThroughReader`) live in its
:attr:`~normwatch.measure.state.rows.LayerRows.plans`, each keeping the plan of the last
layout it met, their rows in buffers lent until the fold. The C++ lanes
(:mod:`~normwatch.measure.backends.native.lane`) measure the common case of a call and of
its gradients with these same readers and no Python frame.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from normwatch.measure.backends.native.folds import accumulate, folded_calls, folded_grads
from normwatch.measure.backends.native.readers import (
    GradReader,
    RowReader,
    ThroughReader,
    moments_of,
    row_stats,
)
from normwatch.measure.backends.native.sampler import NativePack, NativeSampler
from normwatch.measure.backends.torchops import TorchBackend, lines_up, reduce_call
from normwatch.measure.state.accumulator import MAX_END, N_SUM
from normwatch.measure.state.backend import Sample
from normwatch.measure.state.fold import FoldPlan
from normwatch.measure.state.grad_fold import GradPlan
from normwatch.measure.state.rows import WEIGHT, CallRows, GradRows, LayerRows


class NativeBackend(TorchBackend):
    """The C library's readers and folds, torch's ops elsewhere (see the module
    docstring)."""

    name = "native"

    def call_rows(self, layer: LayerRows, x: torch.Tensor, out: torch.Tensor | None,
                  key: float | torch.Tensor, full: bool) -> CallRows:
        moments = moments_of(layer.centred) if full else None
        if out is not None and layer.whole(x):  # the common case: read as it is
            v = _row_reader(layer)(x, out, moments)
            if v is not None:
                width = x.shape[-1]
                return CallRows(layer.row, key, width, layer.eps, v, x.numel() // width,
                                True, full, layer.centred, None)
        tokens, out_tokens = layer.token_pair(x, out)
        lined = lines_up(tokens, out_tokens)
        v = row_stats(tokens, out_tokens if lined else None, moments)
        return reduce_call(tokens, out_tokens, layer.kind, layer.eps, full, layer.row, key, v)

    def grad_rows(self, layer: LayerRows, site: int, g: torch.Tensor,
                  part: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        packed = _grad_readers(layer)[site](g, part)  # (the weight's: its norm first)
        return super().grad_rows(layer, site, g, part) if packed is None else \
            (packed, None, None)

    def covers_through(self, layer: LayerRows, x: torch.Tensor, weight: object) -> bool:
        return ThroughReader.covers(x, weight)

    def through_rows(self, layer: LayerRows, g: torch.Tensor, x: torch.Tensor,
                     weight: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        return through_reader(layer)(g, x, weight)

    def fold(self, calls: Sequence[CallRows], plan: FoldPlan) -> torch.Tensor:
        folded = folded_calls(calls, plan)
        return super().fold(calls, plan) if folded is None else folded

    def accumulate(self, lines: torch.Tensor, rows: torch.Tensor, block: torch.Tensor
                   ) -> None:
        if not accumulate(lines, rows, N_SUM, MAX_END, block):
            super().accumulate(lines, rows, block)

    def fold_grads(self, block: torch.Tensor, staged: Sequence[GradRows], plan: GradPlan
                   ) -> None:
        if not folded_grads(block, staged, plan):
            super().fold_grads(block, staged, plan)

    def sample(self, samples: list[torch.Tensor], scales: list[float]) -> Sample | None:
        return NativePack.make(samples, scales)

    def sampler(self, params: list[torch.Tensor], packs: Sequence[tuple[list[int], Sample]]
                ) -> object | None:
        return NativeSampler.make(params, packs)


def _row_reader(layer: LayerRows) -> RowReader:
    reader = layer.plans.get(RowReader)
    if reader is None:
        reader = layer.plans[RowReader] = RowReader(layer.take)
    return reader


def _grad_readers(layer: LayerRows) -> tuple[GradReader, ...]:
    readers = layer.plans.get(GradReader)
    if readers is None:  # per site, then the weight's (read whole)
        readers = layer.plans[GradReader] = tuple(
            GradReader(site == WEIGHT, layer.grad_take) for site in range(WEIGHT + 1))
    return readers


def through_reader(layer: LayerRows) -> ThroughReader:
    """The layer's reader of the gradient through the norm (the C++ lanes plan with its
    :meth:`~normwatch.measure.backends.native.readers.ThroughReader.plan`)."""
    reader = layer.plans.get(ThroughReader)
    if reader is None:
        reader = layer.plans[ThroughReader] = ThroughReader(
            layer.centred, layer.eps, layer.one_plus_w, layer.grad_take)
    return reader


NATIVE = NativeBackend()
