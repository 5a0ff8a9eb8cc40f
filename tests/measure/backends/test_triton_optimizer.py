"""The guard's check kernel against float64 (Triton's interpreter on the CPU; the real
kernel on a GPU): the gradients' sum of squares, the NaN/inf elements of a norm's rows,
a poisoned gradient (NaN, inf, or a sum past float32) flagged as torch's float32 norm
flags it; one launch per dtype, whatever the number of tensors."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from normwatch.measure.backends import triton_optimizer
from normwatch.measure.backends.triton_kernel import TRITON, usable

pytestmark = pytest.mark.skipif(not usable(), reason="Triton cannot run here")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def gradients() -> list[torch.Tensor]:
    """fp32 and bf16 gradients: one past a program's 1024 elements, one channels_last, one
    stored transposed, one empty."""
    gen = torch.Generator().manual_seed(0)
    conv = torch.randn(8, 4, 3, 3, generator=gen).to(memory_format=torch.channels_last)
    return [t.to(DEVICE) for t in (
        torch.randn(3000, generator=gen), conv, torch.randn(40, 24, generator=gen).t(),
        torch.zeros(0), (torch.randn(50, 30, generator=gen) * 100).bfloat16())]


def rows(bad: int) -> list[torch.Tensor]:
    """Row tensors as the kernels stage them (float32), ``bad`` of their elements NaN/inf."""
    out = [torch.rand(2, 700, generator=torch.Generator().manual_seed(1)),
           torch.rand(5, 9, generator=torch.Generator().manual_seed(2))]
    picks = [(0, 1, 5), (0, 0, 699), (1, 4, 8), (1, 0, 0)][:bad]
    for i, (t, r, c) in enumerate(picks):
        out[t][r, c] = (float("nan"), float("inf"), -float("inf"), float("nan"))[i]
    return [r.to(DEVICE) for r in out]


def launches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    real = triton_optimizer.launch_check

    def counted(table: torch.Tensor, out: torch.Tensor, n: int, programs: int,
                dtype: str) -> None:
        seen.append(dtype)
        real(table, out, n, programs, dtype)

    monkeypatch.setattr(triton_optimizer, "launch_check", counted)
    return seen


@pytest.mark.parametrize("bad", [0, 1, 4])
def test_the_check_sums_the_gradients_and_counts_bad_rows_as_float64(
        bad: int, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = launches(monkeypatch)
    grads = gradients()
    out = TRITON.check(rows(bad), grads)
    assert out is not None and out.dtype == torch.float64 and out.device.type == DEVICE.type
    want = sum(float(g.double().square().sum()) for g in grads)
    assert float(out[0]) == pytest.approx(want, rel=1e-6)
    assert (float(out[1]), float(out[2])) == (bad, 0)
    assert seen == ["float32", "bfloat16"]  # one launch per dtype


@pytest.mark.parametrize("poison", ["nan", "inf", "past float32"])
def test_a_poisoned_gradient_is_flagged_as_torchs_float32_norm_flags_it(poison: str) -> None:
    grads = gradients()
    value = {"nan": float("nan"), "inf": float("inf"), "past float32": 3e19}[poison]
    grads[0][1234] = value  # (3e19 is finite; its square is past float32's range)
    assert not torch.linalg.vector_norm(grads[0]).isfinite()  # torch's own flag
    out = TRITON.check(rows(0), grads)
    assert out is not None
    assert float(out[2]) >= 1 and float(out[1]) == 0
    assert not float(out[0]) < float("inf")


def test_what_the_kernel_does_not_read_is_left_to_torch() -> None:
    """A tensor whose elements do not fill one block (a slice with gaps), an integer one,
    a sparse gradient: ``None``, and the guard reads them by torch's ops."""
    grads = gradients()
    gaps = torch.randn(10, 20, device=DEVICE)[:, :5]
    assert TRITON.check(rows(0), [*grads, gaps]) is None
    assert TRITON.check([torch.zeros(3, dtype=torch.int32, device=DEVICE)], grads) is None
    sparse = torch.sparse_coo_tensor([[0]], [1.0], (4,), check_invariants=True).to(DEVICE)
    assert TRITON.check(rows(0), [sparse]) is None
    assert TRITON.check([], []) is None


def test_a_table_is_made_once_for_tensors_that_stay_in_place() -> None:
    """The check's table of addresses is kept for tensors at the same places (steady
    state: no copy to the device); a moved tensor makes a new one."""
    grads, staged = gradients(), rows(0)
    triton_optimizer._CHECK_TABLES.pop(DEVICE, None)  # (earlier tests' tables: freed places)
    first = triton_optimizer.check_step(staged, grads)
    tables = triton_optimizer._CHECK_TABLES[DEVICE]
    kept = dict(tables._tables)
    again = triton_optimizer.check_step(staged, grads)
    assert first is not None and again is not None
    assert again.tolist() == pytest.approx(first.tolist(), rel=1e-12)
    assert dict(tables._tables).keys() == kept.keys()
    moved = [g.clone() for g in grads]
    triton_optimizer.check_step(staged, moved)
    assert len(set(tables._tables) - set(kept)) == 2  # fp32's and bf16's


def test_each_program_finds_its_tensor_among_many() -> None:
    """37 gradients of uneven lengths (empty ones among them, several programs each), each
    filled with its own value: a program that read another tensor, or another part of its
    own, would change the sum. The table grows with the tensors, not their elements."""
    lengths = [(i * 997) % 5000 if i % 7 else 0 for i in range(37)]
    grads = [torch.full((n,), float(i + 1), device=DEVICE) for i, n in enumerate(lengths)]
    out = triton_optimizer.check_step([], grads)
    assert out is not None
    assert float(out[0]) == sum(n * (i + 1) ** 2 for i, n in enumerate(lengths))
    key = (*range(37), *lengths, *[triton_optimizer.GRAD] * 37)
    assert len(triton_optimizer._check_table(key)) == 4 * 37
