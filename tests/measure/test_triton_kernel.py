"""The fused Triton kernel against the torch float64 reference (Triton's interpreter on
the CPU; the real kernel on a GPU). Skips cleanly where Triton is absent."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

pytest.importorskip("triton")

import normwatch
from normwatch.catalog import COLUMNS
from normwatch.measure.reductions import (
    fold_calls,
    fold_plan,
    fused_call,
    reduce_call,
)
from normwatch.measure.triton_kernel import ROW_COLUMNS, row_stats_torch, row_stats_triton
from normwatch.records import Limits

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def assert_rows_match(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    for j, name in enumerate(ROW_COLUMNS):
        g, w = got[:, j].double().cpu(), want[:, j].cpu()
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-3 * max(1.0, float(
            w[torch.isfinite(w)].abs().max()) if torch.isfinite(w).any() else 1.0) * 1e-3,
            msg=lambda m, name=name: f"{name}: {m}")


def hard(n: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(width)
    x = torch.randn(n, width, generator=g)
    if n > 1:
        x[1] = 1e3 + torch.randn(width, generator=g)  # |mean|/std = 1e3
    if n > 2:
        x[2] = 0.0  # all-zero token
    if n > 3:
        x[3, 0] = 300.0
    if n > 4 and width > 1:
        x[4, 1] = float("nan")
        x[4, 0] = float("inf")
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [1, 3, 100, 2048, 2050, 16384])
def test_kernel_matches_the_reference(dtype: torch.dtype, width: int) -> None:
    x = hard(6, width, dtype).to(DEVICE)
    y = (torch.randn(6, width) * 2).to(dtype).to(DEVICE)
    y[0, 0] = float("nan")
    assert_rows_match(row_stats_triton(x, y), row_stats_torch(x, y))


def test_zero_tokens_and_no_output() -> None:
    empty = torch.empty(0, 64, device=DEVICE)
    assert row_stats_triton(empty).shape == (0, 7)
    x = hard(5, 64, torch.float32).to(DEVICE)
    rows = row_stats_triton(x)
    assert_rows_match(rows, row_stats_torch(x))
    assert rows[:, 5].eq(-math.inf).all() and rows[:, 6].eq(0).all()


@pytest.mark.parametrize("view", ["strided", "transposed"])
def test_non_contiguous_inputs(view: str) -> None:
    base = torch.randn(8, 128, device=DEVICE)
    x = base[:, ::2] if view == "strided" else base.t()
    assert not x.is_contiguous()
    assert_rows_match(row_stats_triton(x, x * 2), row_stats_torch(x, x * 2))


def test_bad_shapes_are_rejected_clearly() -> None:
    with pytest.raises(ValueError, match=r"'tokens' must be 2-D \(tokens, elements\): got "
                       r"shape \(2, 3, 4\)"):
        row_stats_triton(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="'out' must have the shape of 'tokens'"):
        row_stats_triton(torch.zeros(2, 4), torch.zeros(2, 5))


def test_fused_and_torch_paths_fold_to_the_same_statistics() -> None:
    """The kernel's raw rows are converted at the fold, for every call at once: a layer
    norm's and an RMS norm's calls folded together give what the torch path gives."""
    calls = {"plain": [], "fused": []}
    for i, kind in enumerate(["rmsnorm", "layernorm", "rmsnorm"]):
        x = hard(6, 256, torch.bfloat16).to(DEVICE) * (i + 1)
        y = torch.randn(6, 256, device=DEVICE).to(torch.bfloat16)
        y[5, 3] = float("inf")
        key = 42.0 + i
        calls["plain"].append(reduce_call(x, y, kind, 1e-5, True, i, key))  # type: ignore[arg-type]
        calls["fused"].append(fused_call(row_stats_triton(x, y), kind, 1e-5,  # type: ignore[arg-type]
                                         x.shape[1], True, i, key))
    a, b = (fold_calls(c, fold_plan(c, Limits())) for c in calls.values())
    for i in range(3):
        for name, va, vb in zip(COLUMNS, a[i].tolist(), b[i].tolist(), strict=True):
            assert va == pytest.approx(vb, rel=1e-4, abs=1e-6), (i, name)


def test_watch_with_the_fused_kernel_agrees_with_torch() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.Linear(64, 64), nn.RMSNorm(64))
    model = model.to(DEVICE)
    fused = normwatch.watch(model, kernel="triton", stats_every=1, report_dir=None)
    inputs = [torch.randn(8, 16, device=DEVICE) * s for s in (1, 30, 1)]
    for x in inputs:
        model(x).sum().backward()
    got = fused.flush()
    fused.close()
    plain = normwatch.watch(model, kernel="torch", stats_every=1, report_dir=None)
    for x in inputs:
        model(x).sum().backward()
    want = plain.flush()
    for name in ("1", "3"):
        g, w = got.layers[name], want.layers[name]
        for field in ("absmax", "sumsq_max", "rms_mean", "rms_min", "rms_max", "eps_dominance",
                      "common_mode_max", "out_absmax"):
            assert getattr(g, field) == pytest.approx(getattr(w, field), rel=1e-4), field
        assert (g.tokens, g.nonfinite, g.out_nonfinite) == (w.tokens, w.nonfinite,
                                                            w.out_nonfinite)


class HalfOut(nn.Module):
    """A norm with a wrong-shaped output (half the features): measured apart."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.eps = 1e-6
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        return y[..., : x.shape[-1] // 2] * 3


def test_fused_kernel_with_a_wrong_shaped_output_agrees_with_torch() -> None:
    normwatch.register_norm(HalfOut, kind="rmsnorm")
    model = nn.Sequential(nn.Linear(8, 32), HalfOut(32)).to(DEVICE)
    x = torch.randn(6, 8, device=DEVICE)
    got = {}
    for kernel in ("triton", "torch"):
        w = normwatch.watch(model, kernel=kernel, stats_every=1, report_dir=None)
        model(x).sum().backward()
        got[kernel] = w.flush().layers["1"]
        w.close()
    fused, plain = got["triton"], got["torch"]
    assert fused.out_absmax == pytest.approx(plain.out_absmax, rel=1e-5)
    assert fused.out_absmax is not None and fused.out_absmax > 0
    assert (fused.finite_tokens, fused.out_nonfinite) == (plain.finite_tokens, 0) == (6, 0)
