"""The fp32 reference formulas: the design's worked values and torch's own norms."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import normwatch
from normwatch.measure.model.reference import expected_output, layer_norm, rms_norm


def test_worked_values_from_the_design() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0]])
    assert layer_norm(x, 0.0)[0].tolist() == pytest.approx([-1.2247, 0.0, 1.2247], abs=1e-4)
    assert rms_norm(x, 0.0)[0].tolist() == pytest.approx([0.4629, 0.9258, 1.3887], abs=1e-4)
    shifted = torch.tensor([[101.0, 102.0, 103.0]])
    assert rms_norm(shifted, 0.0)[0].tolist() == pytest.approx([0.990, 1.000, 1.010], abs=1e-3)
    assert layer_norm(shifted, 0.0)[0].tolist() == pytest.approx([-1.2247, 0, 1.2247], abs=1e-3)


@pytest.mark.parametrize("scale", [1e-2, 1.0, 1e3])
def test_output_norm_is_sqrt_d_whatever_the_input_scale(scale: float) -> None:
    x = torch.randn(4, 2048, dtype=torch.float64) * scale
    for fn in (rms_norm, layer_norm):
        norms = torch.linalg.vector_norm(fn(x, 1e-12), dim=-1)
        assert norms.tolist() == pytest.approx([2048**0.5] * 4, rel=1e-4)


@pytest.mark.parametrize("module,shape", [
    (nn.LayerNorm(16), (3, 5, 16)),
    (nn.LayerNorm((4, 16)), (3, 4, 16)),
    (nn.RMSNorm(16, eps=1e-5), (3, 5, 16)),
    (nn.GroupNorm(4, 8), (3, 8, 5, 5)),
    (nn.BatchNorm2d(8), (3, 8, 5, 5)),
    (nn.BatchNorm1d(8), (6, 8)),
    (nn.InstanceNorm1d(8, affine=True), (3, 8, 10)),
])
def test_expected_output_matches_torch(module: nn.Module, shape: tuple[int, ...]) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.uniform_(0.5, 1.5)
    layer = normwatch.find_norm_layers(nn.Sequential(module))[0]
    x = torch.randn(shape) * 3 + 1
    want = module(x)
    got = expected_output(layer, module, x)
    assert got is not None
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_gemma_one_plus_w_form() -> None:
    from tests.conftest import tiny_hf

    model = tiny_hf("gemma")
    norm = model.model.norm
    with torch.no_grad():
        norm.weight.uniform_(-0.5, 0.5)
    layer = next(x for x in normwatch.find_norm_layers(model) if x.name == "model.norm")
    x = torch.randn(2, 3, 32)
    torch.testing.assert_close(expected_output(layer, norm, x), norm(x), rtol=1e-5, atol=1e-5)


def test_unknown_shapes_give_none() -> None:
    module = nn.LayerNorm(16)
    layer = normwatch.find_norm_layers(nn.Sequential(module))[0]
    assert expected_output(layer, nn.Linear(3, 3), torch.randn(2, 3)) is None
