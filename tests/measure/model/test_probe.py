"""The fp16-safety probe asks each layer, on a copy, whether it squares in fp16."""

from __future__ import annotations

import torch
from torch import nn

import normwatch
from normwatch.demos.toymodel import NaiveRMSNorm
from normwatch.measure.model.probe import probe_fp16_safety


class SumSquaresNorm(nn.Module):
    """Sums squares in the input dtype: fails once sum(x²) > 65504, even with small x."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = x.pow(2).sum(-1, keepdim=True)
        return self.weight * x * torch.rsqrt(total / x.shape[-1] + self.eps)


def probe(module: nn.Module, shape: tuple[int, ...]) -> tuple[bool | None, bool | None]:
    layer = normwatch.find_norm_layers(nn.Sequential(module))[0]
    result = probe_fp16_safety(layer, module, shape, torch.float16, torch.device("cpu"))
    return result.element_safe, result.sum_safe


def test_torch_norms_are_fp16_safe() -> None:
    assert probe(nn.RMSNorm(64), (4, 8, 64)) == (True, True)
    assert probe(nn.LayerNorm(64), (4, 8, 64)) == (True, True)
    assert probe(nn.GroupNorm(2, 8), (4, 8, 6)) == (True, True)


def test_hand_written_norms_are_not() -> None:
    # mean() accumulates in fp32 on the CPU, so only the element probe fails
    assert probe(NaiveRMSNorm(64), (4, 64)) == (False, True)
    assert probe(SumSquaresNorm(64), (4, 64)) == (False, False)


def test_probe_leaves_batchnorm_statistics_alone() -> None:
    bn = nn.BatchNorm1d(8)
    before = bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked)
    probe(bn, (16, 8))
    assert torch.equal(bn.running_mean, before[0]) and torch.equal(bn.running_var, before[1])
    assert int(bn.num_batches_tracked) == before[2]


def test_probe_never_raises() -> None:
    class BrokenNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))
            self.eps = 1e-5

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("no fp16 kernel")

    layer = normwatch.find_norm_layers(nn.Sequential(BrokenNorm()))[0]
    result = probe_fp16_safety(layer, BrokenNorm(), (2, 4), torch.float16, torch.device("cpu"))
    assert result.safe is None and "no fp16 kernel" in result.detail
