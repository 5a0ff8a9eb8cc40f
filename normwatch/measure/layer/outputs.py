"""The output check of one call: the norm's output against its kind's formula, on the
device (tensor ops only: eager and compiled calls alike).

    >>> check = output_check(layer, module, x, y, call, tokens)   # [mismatch, carried eps]

A few dozen rows are read whatever the call's size: for layer and RMS norms the rows
:func:`~normwatch.measure.model.reference.checked_rows` picks from the call's own rows (the
largest and smallest tokens), else the whole call.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from normwatch.measure.model.reference import (
    carried_eps,
    checked_rows,
    expected_from,
    flattens_heads,
    mismatch,
    reference_params,
)
from normwatch.measure.state.rows import CallRows
from normwatch.records import NormLayer


def output_check(layer: NormLayer, module: nn.Module, x: torch.Tensor, y: torch.Tensor,
                 call: CallRows, tokens: Callable[[torch.Tensor], torch.Tensor]
                 ) -> torch.Tensor | None:
    """``[mismatch, carried eps]`` (float64) of output ``y`` of input ``x`` against the
    kind's formula (``tokens``: the layer's token view); ``None``: no formula applies."""
    params = reference_params(layer, module, x)
    x, y = checked(layer, x, y, params, call)
    ref = expected_from(layer, x, params, module.training)
    if ref is None:
        return None
    if flattens_heads(ref.shape, y.shape):  # heads flattened on the way out
        ref = ref.reshape(y.shape)
    err = torch.ones((), dtype=torch.float64, device=y.device) if ref.shape != y.shape \
        else mismatch(tokens(y), tokens(ref)).double()  # wrong shape: 1
    return torch.stack([err, carried_eps(y)])


def checked(layer: NormLayer, x: torch.Tensor, y: torch.Tensor,
            params: tuple[torch.Tensor | None, ...], call: CallRows
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The part of ``x`` and ``y`` an output check reads: for layer and RMS norms whose
    parameters cover whole rows of trailing dims, the rows :func:`checked_rows` picks;
    else all of them."""
    if layer.kind not in ("layernorm", "rmsnorm") or y.shape != x.shape:
        return x, y
    lowest = max([1] + [p.dim() for p in params if p is not None])
    for d in range(lowest, x.dim()):  # the fewest trailing dims holding tokens
        trailing = x.shape[x.dim() - d:]
        span = math.prod(trailing)
        if span % call.width == 0:
            rows = checked_rows(call.hi, call.lo, span // call.width)
            return x.reshape(-1, *trailing)[rows], y.reshape(-1, *trailing)[rows]
    return x, y
