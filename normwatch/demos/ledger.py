"""The second source article's gradient ledger, measured by normwatch.

    >>> row = ledger("post", depth=64)      # seeds averaged
    >>> row.ratio, row.article

The article's setting: each sublayer a two-layer ReLU FFN of width ``4d`` without bias
(weights N(0, 1/d) and N(0, 1/4d)), LayerNorm with gamma = 1, beta = 0, eps = 1e-5, one
token h ~ N(0, I), d = 128, a unit random gradient at the top, averaged over 4 seeds.
Post-norm: ``h = LN(h + FFN(h))``; pre-norm: ``h = h + FFN(LN(h))``.

``ratio`` is what normwatch's own gradient statistics say: the depth profile's
first/last hidden-state gradient RMS (:mod:`normwatch.judge.depth`), beside the
article's input-side/output-side parameter-gradient ratio (:data:`ARTICLE`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

ARTICLE = {"post": {16: 0.853, 64: 0.715, 256: 0.167},
           "pre": {16: 2.209, 64: 4.651, 256: 11.164}}
"""The article's input-side/output-side parameter-gradient ratios."""


class LedgerBlock(nn.Module):
    """One sublayer of the article's model."""

    def __init__(self, d: int, placement: Literal["pre", "post"], gen: torch.Generator
                 ) -> None:
        super().__init__()
        k = 4 * d
        self.placement = placement
        self.norm = nn.LayerNorm(d, eps=1e-5)
        self.up = nn.Linear(d, k, bias=False)
        self.down = nn.Linear(k, d, bias=False)
        with torch.no_grad():
            self.up.weight.copy_(torch.randn(k, d, generator=gen) / math.sqrt(d))
            self.down.weight.copy_(torch.randn(d, k, generator=gen) / math.sqrt(k))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor
        if self.placement == "pre":
            out = h + self.down(torch.relu(self.up(self.norm(h))))
        else:
            out = self.norm(h + self.down(torch.relu(self.up(h))))
        return out


@dataclass(frozen=True)
class LedgerRow:
    """One (placement, depth) cell."""

    placement: str
    depth: int
    ratio: float
    """normwatch's depth profile: first/last hidden-state gradient RMS (seed means)."""
    article: float | None


def ledger(placement: Literal["pre", "post"], depth: int, d: int = 128, seeds: int = 8,
           tokens: int = 16, dtype: torch.dtype = torch.float64) -> LedgerRow:
    """Build the article's model for each seed, run ``tokens`` independent tokens (each
    with its own unit top gradient) through one forward/backward under a watch, and
    divide the seed-averaged first and last points of normwatch's depth profile (a ratio
    of means, as the article does)."""
    import normwatch
    from normwatch.judge.depth import depth_profile

    first, last = 0.0, 0.0
    for seed in range(seeds):
        gen = torch.Generator().manual_seed(seed)
        blocks = nn.Sequential(*[LedgerBlock(d, placement, gen) for _ in range(depth)]).to(dtype)
        h = torch.randn(tokens, d, generator=gen, dtype=dtype).requires_grad_()
        top = torch.randn(tokens, d, generator=gen, dtype=dtype)
        top = top / top.norm(dim=1, keepdim=True)
        with normwatch.watch(blocks, flush_every=1, stats_every=1, report_dir=None,
                             output_check_every=0, placement={"*": placement}) as w:
            (blocks(h) * top).sum().backward()
            snap = w.step()
            assert snap is not None
            profile = depth_profile(snap, w.forward_order, {"*": placement})
        assert profile is not None and len(profile.points) == depth
        first += profile.points[0].hidden_rms
        last += profile.points[-1].hidden_rms
    return LedgerRow(placement, depth, first / last, ARTICLE[placement].get(depth))
