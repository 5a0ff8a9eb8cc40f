"""The on-device kernel against an independent float64 reference."""

from __future__ import annotations

import math

import pytest
import torch

from normwatch.catalog import COLUMNS, SCORE_BASE
from normwatch.measure.backends.torchops import reduce_call
from normwatch.measure.model.reference import mismatch
from normwatch.measure.state.fold import fold_calls, fold_plan
from normwatch.measure.state.rows import token_view
from normwatch.records import Limits

TH = Limits(fp16_limit=256.0, eps_tol=0.01, common_mode_tol=0.9)


def reference(tokens: torch.Tensor, kind: str, eps: float) -> dict[str, float]:
    """Per-token statistics in float64, written independently of the kernel."""
    x = tokens.double()
    rows = [r for r in x if bool(torch.isfinite(r).all())]
    out: dict[str, float] = {"finite_tokens": float(len(rows))}
    absmax = [float(r.abs().max()) for r in rows]
    ms = [float((r * r).mean()) for r in rows]
    mean = [float(r.mean()) for r in rows]
    var = [float(((r - r.mean()) ** 2).mean()) for r in rows]
    rms = [math.sqrt(v) for v in ms]
    s = ms if kind == "rmsnorm" else var
    ratio = [1.0 if si + eps == 0 else eps / (si + eps) for si in s]
    common = [abs(m) / r if r > 0 else 0.0 for m, r in zip(mean, rms, strict=True)]
    out.update(
        absmax=max(absmax), sumsq_max=max(m * x.shape[1] for m in ms), rms_max=max(rms),
        rms_min=min(rms), rms_sum=sum(rms), eps_dominance=max(ratio),
        common_mode_max=max(common),
        fp16_overflow_tokens=float(sum(a > 256 for a in absmax)),
        eps_dominated_tokens=float(sum(r > 0.01 for r in ratio)),
        common_mode_tokens=float(sum(c > 0.9 for c in common)),
        nonfinite=float((~torch.isfinite(x)).any(1).sum()),  # tokens holding NaN/inf
    )
    return out


def kernel(tokens: torch.Tensor, kind: str, eps: float, out: torch.Tensor | None = None,
           key: float = 0.0, full: bool = True) -> dict[str, float]:
    """One call through the hook's reduction and the per-step fold."""
    call = reduce_call(tokens, out, kind, eps, full, 0, key)  # type: ignore[arg-type]
    values = fold_calls([call], fold_plan([call], TH))
    assert values.dtype == torch.float64 and values.shape == (1, len(COLUMNS))
    return dict(zip(COLUMNS, values[0].tolist(), strict=True))


def hard_tokens(dtype: torch.dtype, d: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    rows = [
        torch.randn(d, generator=g),                          # ordinary
        torch.zeros(d),                                       # all-zero token
        1e3 + torch.randn(d, generator=g),                    # |mean|/std = 1e3
        torch.cat([torch.tensor([300.0]), torch.zeros(d - 1)]),  # single element of 300
        torch.randn(d, generator=g) * 1e-4,                   # eps-dominated
        torch.full((d,), 7.0),                                # constant: zero variance
        torch.randn(d, generator=g) * 30,                     # sum of squares > 65504
    ]
    return torch.stack(rows).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
@pytest.mark.parametrize("eps", [1e-5, 0.0])
def test_matches_float64_reference(dtype: torch.dtype, kind: str, eps: float) -> None:
    tokens = hard_tokens(dtype)
    want = reference(tokens, kind, eps)
    got = kernel(tokens, kind, eps)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-12), key


def test_counts_on_known_tokens() -> None:
    got = kernel(hard_tokens(torch.float32), "layernorm", 1e-5)
    assert got["fp16_overflow_tokens"] == 2  # the 300 token and the 1e3-offset token
    assert got["absmax"] == pytest.approx(float(hard_tokens(torch.float32)[2].max()))
    # zero token and constant token have zero variance; the 1e-4 token has var 1e-8
    assert got["eps_dominated_tokens"] == 3
    assert got["eps_dominance"] == 1.0
    rms = kernel(hard_tokens(torch.float32), "rmsnorm", 1e-5)
    assert rms["eps_dominated_tokens"] == 2  # zero token and the 1e-4 token
    assert rms["common_mode_tokens"] == 2  # the 1e3-offset token and the constant token


def test_nonfinite_tokens_are_counted_and_excluded() -> None:
    tokens = torch.randn(4, 16)
    tokens[1, 3] = float("nan")
    tokens[2, 0] = float("inf")
    tokens[2, 1] = float("-inf")
    got = kernel(tokens, "rmsnorm", 1e-6)
    assert got["nonfinite"] == 2  # tokens holding NaN/inf, not elements
    assert got["finite_tokens"] == 2
    want = reference(tokens, "rmsnorm", 1e-6)
    assert got["absmax"] == pytest.approx(want["absmax"], rel=1e-6)


@pytest.mark.parametrize("shape,kind,groups,expected", [
    ((2, 5, 8), "layernorm", 1, (10, 8)),
    ((3, 6, 4, 4), "groupnorm", 2, (6, 48)),
    ((3, 6, 4, 4), "batchnorm", 1, (6, 48)),
    ((3, 6), "batchnorm", 1, (6, 3)),
    ((3, 6, 10), "instancenorm", 1, (18, 10)),
])
def test_token_view_layouts(shape: tuple[int, ...], kind: str, groups: int,
                            expected: tuple[int, int]) -> None:
    x = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    view = token_view(x, kind, 1, groups)  # type: ignore[arg-type]
    assert tuple(view.shape) == expected
    if kind == "batchnorm" and len(shape) == 4:
        assert torch.equal(view[1], x[:, 1].flatten())  # one token = one channel
    if kind == "groupnorm":
        assert torch.equal(view[1], x[0, 3:6].flatten())  # second group of sample 0


def test_token_view_multi_dim_normalized_shape() -> None:
    x = torch.randn(2, 3, 4, 5)
    assert tuple(token_view(x, "layernorm", 2).shape) == (6, 20)


def test_output_statistics_and_first_event_scores() -> None:
    x = torch.randn(3, 2)
    y = torch.tensor([[1.0, -5.0], [float("nan"), 2.0], [float("inf"), float("-inf")]])
    got = kernel(x, "rmsnorm", 1e-6, out=y, key=12345.0)
    assert got["out_nonfinite"] == 2 and got["out_absmax"] == 5.0  # max over finite tokens
    assert got["first_arrived_score"] == 0  # input finite: nothing arrived
    assert got["first_born_score"] == SCORE_BASE - 12345.0  # born in the norm
    assert got["output_mismatch"] == -math.inf  # filled only by the output check
    got = kernel(x, "rmsnorm", 1e-6, out=y[:1])
    assert got["out_nonfinite"] == 0 and got["out_absmax"] == 5.0
    x[0, 0] = float("nan")
    got = kernel(x, "rmsnorm", 1e-6, out=y, key=7.0)
    assert got["first_arrived_score"] == SCORE_BASE - 7.0 and got["first_born_score"] == 0
    ref = torch.tensor([[1.0, 0.0], [3.0, 4.0]])
    out = torch.tensor([[1.0, 0.0], [3.0, 4.5]])
    assert float(mismatch(out, ref)) == pytest.approx(0.1)


def test_sentinel_tier_columns() -> None:
    x = torch.randn(5, 16)
    x[1, 3] = 400.0
    x[2, 0] = float("nan")
    y = torch.randn(5, 16)
    y[4, 4] = float("inf")
    got = kernel(x, "rmsnorm", 1e-6, out=y, key=99.0, full=False)
    # max |x| and non-finite flags per token: exact counts on every step
    assert (got["finite_tokens"], got["fp16_overflow_tokens"], got["nonfinite"],
            got["out_nonfinite"]) == (4, 1, 1, 1)
    assert got["absmax"] == 400.0
    assert got["out_absmax"] == pytest.approx(float(y[:4].abs().max()))
    assert got["first_arrived_score"] == SCORE_BASE - 99.0 and got["first_born_score"] == 0
    assert got["stats_tokens"] == 0 and got["rms_sum"] == 0  # full statistics not measured
    assert got["sumsq_max"] == -math.inf and got["rms_min"] == math.inf
    assert got["eps_dominance"] == -math.inf and got["eps_dominated_tokens"] == 0
    born = kernel(x[:2], "rmsnorm", 1e-6, out=y, key=7.0, full=False)  # 5 output tokens
    assert born["first_born_score"] == SCORE_BASE - 7.0 and born["first_arrived_score"] == 0
    assert born["out_nonfinite"] == 1
    clean = kernel(x[:2], "rmsnorm", 1e-6, out=y[:2], key=5.0, full=False)
    assert clean["nonfinite"] == 0 and clean["first_arrived_score"] == 0
    assert (clean["finite_tokens"], clean["absmax"]) == (2, 400.0)


KEY = 1 << 20
Spec = tuple[torch.Tensor, "torch.Tensor | None", str, float, float]


def calls_for_fold(uniform: bool) -> list[Spec]:
    """Calls of four layers: token counts, widths, eps, kinds, keys and values differ."""
    g = torch.Generator().manual_seed(3)
    shapes = [(6, 32), (6, 8), (6, 32), (6, 64)] if uniform else [(6, 32), (3, 8), (1, 32),
                                                                  (9, 64)]
    specs: list[Spec] = []
    for i, (n, d) in enumerate(shapes):
        x = torch.randn(n, d, generator=g) * (10.0 ** (i - 1)) + (3.0 if i == 3 else 0.0)
        y = torch.randn(n, d, generator=g)
        if i == 1:
            x[0, 2] = float("nan")
        if i == 2:
            y[0, 0] = float("inf")
        specs.append((x, y, "rmsnorm" if i % 2 else "layernorm", [1e-5, 0.0, 1e-3, 1e-6][i],
                      float(5 * KEY + i)))
    return specs


@pytest.mark.parametrize("full", [True, False])
@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize("outputs", ["aligned", "mixed"])
def test_fold_of_many_calls_matches_each_call_alone(full: bool, uniform: bool,
                                                    outputs: str) -> None:
    specs = calls_for_fold(uniform)
    if outputs == "mixed":  # a missing and a wrong-shaped output: outputs folded apart
        specs[0] = (specs[0][0], None, *specs[0][2:])
        y3 = specs[3][1]
        assert y3 is not None
        specs[3] = (specs[3][0], y3[:, :5], *specs[3][2:])
    calls = [reduce_call(x, y, kind, eps, full, row, key)  # type: ignore[arg-type]
             for row, (x, y, kind, eps, key) in enumerate(specs)]
    plan = fold_plan(calls, TH)
    assert bool(plan.uniform) == uniform and plan.aligned == (outputs == "aligned")
    together = fold_calls(calls, plan)
    for i, call in enumerate(calls):
        alone = fold_calls([call], fold_plan([call], TH))[0]
        assert together[i].tolist() == pytest.approx(alone.tolist(), rel=1e-6), i
        want = reference(specs[i][0], specs[i][2], specs[i][3])
        got = dict(zip(COLUMNS, together[i].tolist(), strict=True))
        for key in ("finite_tokens", "nonfinite", "absmax", "fp16_overflow_tokens"):
            assert got[key] == pytest.approx(want[key], rel=1e-5), (i, key)
        if full:
            for key in ("rms_max", "rms_min", "rms_sum", "eps_dominance", "sumsq_max",
                        "common_mode_max", "eps_dominated_tokens", "common_mode_tokens"):
                assert got[key] == pytest.approx(want[key], rel=1e-4), (i, key)
    got = dict(zip(COLUMNS, together[1].tolist(), strict=True))
    assert got["nonfinite"] == 1 and got["first_arrived_score"] == SCORE_BASE - (5 * KEY + 1)
    born = dict(zip(COLUMNS, together[2].tolist(), strict=True))
    assert born["first_born_score"] == SCORE_BASE - (5 * KEY + 2)


def test_carried_eps_reads_the_precision_from_the_mantissas() -> None:
    from normwatch.measure.model.reference import carried_eps

    x = torch.randn(64, 16)
    assert float(carried_eps(x)) == torch.finfo(torch.float32).eps  # genuinely fp32
    assert float(carried_eps(x.bfloat16().float())) == 2.0**-7  # rounded in bf16 last
    halves = x.half().float()
    assert float(carried_eps(halves)) == 2.0**-10  # exact in fp16, not in bf16
    halves[0, 0] = float("nan")  # non-finite values say nothing about precision
    assert float(carried_eps(halves)) == 2.0**-10
    assert float(carried_eps(x.bfloat16())) == 2.0**-7
