"""The Triton folds against torch's (Triton's interpreter on the CPU; the real kernels on
a GPU): a step's calls folded into lines and the lines into the per-layer state give
what torch's ops give, column by column; the first-event scores exactly."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from normwatch.catalog import COLUMNS, KEY_STRIDE, decode_score
from normwatch.measure.backends.torchops import TORCH
from normwatch.measure.backends.triton_folds import accumulate_fused, fold_calls_fused
from normwatch.measure.backends.triton_kernel import TRITON
from normwatch.measure.state.accumulator import _new_state
from normwatch.measure.state.fold import fold_plan
from normwatch.measure.state.rows import CallRows, LayerRows
from normwatch.records import Limits
from tests.factory import layer

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
"""(Triton's interpreter computes in NumPy, which warns where a kernel divides 0 by 0.)"""

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
STEP = 123456
"""A late step: keys past float32's exact integers."""


def staged(backend: object, full: bool) -> list[CallRows]:
    """Four calls of three layers (layer 0 called twice; one call longer), with what each
    column counts: |mean|/std = 1e3, an all-zero token, an fp16 overflow, NaN and inf
    inputs, a NaN born in an output."""
    gen = torch.Generator().manual_seed(0)
    calls = []
    for i, (kind, n, eps, row) in enumerate([("rmsnorm", 6, 1e-5, 0), ("layernorm", 6, 1e-2, 1),
                                             ("rmsnorm", 9, 0.0, 0), ("rmsnorm", 6, 1e-5, 2)]):
        x = torch.randn(n, 64, generator=gen) * (i + 1)
        x[1] = 1e3 + torch.randn(64, generator=gen)
        x[2] = 0.0
        x[3, 0] = 300.0
        y = torch.randn(n, 64, generator=gen)
        if i == 1:
            x[4, 3] = float("nan")
        if i == 2:
            x[5, 0] = float("inf")
        if i == 3:
            y[0, 1] = float("nan")
        rows = LayerRows.of(layer(kind=kind, eps=eps, width=64), row)  # type: ignore[arg-type]
        key = float(STEP * KEY_STRIDE + 7 + i)
        calls.append(backend.call_rows(rows, x.to(DEVICE), y.to(DEVICE), key, full))  # type: ignore[attr-defined]
    return calls


@pytest.mark.parametrize("full", [True, False], ids=["full", "sentinel"])
def test_the_calls_fold_and_accumulate_kernels_give_torchs_state(full: bool) -> None:
    got = {}
    for name, backend in (("torch", TORCH), ("triton", TRITON)):
        calls = staged(backend, full)
        plan = fold_plan(calls, Limits())
        lines = backend.fold(calls, plan)
        block = _new_state(3, DEVICE)
        for _ in range(2):  # onto a state that holds a step already
            backend.accumulate(lines, plan.rows, block)
        if name == "triton":  # the kernels', not torch's fallback
            assert fold_calls_fused(calls, plan) is not None
            assert accumulate_fused(lines, plan.rows, block.clone())
        got[name] = (lines.cpu(), block.cpu())
    for (a, b), what in zip(zip(got["triton"], got["torch"], strict=True), ("lines", "state"),
                            strict=True):
        for j, column in enumerate(COLUMNS):
            if column.endswith("_score"):  # exact: they name the step and the call
                assert torch.equal(a[:, j], b[:, j]), (what, column)
            else:
                torch.testing.assert_close(a[:, j], b[:, j], rtol=1e-5, atol=1e-6,
                                           msg=f"{what}: {column}")
    lines, state = got["triton"]
    at = {c: COLUMNS.index(c) for c in COLUMNS}
    assert lines[:, at["nonfinite"]].tolist() == [0, 1, 1, 0]
    assert lines[:, at["out_nonfinite"]].tolist() == [0, 0, 0, 1]
    assert lines[:, at["fp16_overflow_tokens"]].tolist() == [2, 2, 2, 2]  # ~1e3 and 300
    assert decode_score(state[1, at["first_arrived_score"]].item()) == (STEP, 8)
    assert decode_score(state[2, at["first_born_score"]].item()) == (STEP, 10)
    assert state[0, at["calls"]].item() == 4 and state[0, at["tokens"]].item() == 30
    if full:
        assert lines[1, at["eps_dominated_tokens"]].item() >= 1  # eps 1e-2, a zero token
        assert lines[0, at["common_mode_tokens"]].item() == 1


def test_what_the_kernels_do_not_cover_is_left_to_torch() -> None:
    calls = staged(TRITON, True)
    tensor_key = [c._replace(key=torch.tensor(c.key)) for c in calls]  # compiled calls'
    assert fold_calls_fused(tensor_key, fold_plan(tensor_key, Limits())) is None
    apart = [calls[0]._replace(lined_up=False, out=calls[0].v[:2, :3].clone()), *calls[1:]]
    assert fold_calls_fused(apart, fold_plan(apart, Limits())) is None
    plan = fold_plan(calls, Limits())
    lines = TRITON.fold(calls, plan)
    assert not accumulate_fused(lines.float(), plan.rows, _new_state(3, DEVICE))
    assert not accumulate_fused(lines, plan.rows, _new_state(3, DEVICE).t().contiguous().t())
