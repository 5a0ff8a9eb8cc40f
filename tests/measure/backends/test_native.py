"""The CPU sentinel's compiled kernel: each row's max and min, exact against float64,
NaN where torch's ``amax``/``amin`` give NaN; torch's reductions wherever it does not
run (no compiler, switched off, what it does not cover), with the same statistics."""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import normwatch
from normwatch.catalog import COLUMNS
from normwatch.measure.backends.native import build
from normwatch.measure.backends.native import folds as native_folds
from normwatch.measure.backends.native import lane as fastlane
from normwatch.measure.backends.native import readers as native
from normwatch.measure.backends.native.backend import NATIVE
from normwatch.measure.backends.native.build import library, threaded
from normwatch.measure.backends.native.readers import GRAIN, MAX_ELEMENTS, grad_rows, row_stats
from normwatch.measure.backends.torchops import reduce_call, token_rows
from normwatch.measure.state.accumulator import _new_state
from normwatch.measure.state.buffers import KEEP_IDLE, RowBuffers
from normwatch.measure.state.fold import fold_calls, fold_plan
from normwatch.measure.state.grad_fold import fold_grads, grad_plan
from normwatch.measure.state.rows import SITES, WEIGHT, CallRows, GradRows, LayerRows
from normwatch.records import Limits
from tests.factory import layer
from tests.threads import threads

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler here")


def reference(t: torch.Tensor) -> torch.Tensor:
    """Each row's max and min in float64, NaN for a row holding one."""
    d = t.double().reshape(-1, t.shape[-1])
    bad = d.isnan().any(1)
    hi = torch.where(bad, torch.nan, d.nan_to_num(-torch.inf).max(1).values)
    lo = torch.where(bad, torch.nan, d.nan_to_num(torch.inf).min(1).values)
    return torch.stack([hi, lo])


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.equal(got.isnan(), want.isnan()) and \
        torch.equal(got.double().nan_to_num(0.0), want.nan_to_num(0.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [1, 7, 16, 33, 256, 1000])
def test_rows_are_exact_with_nan_inf_and_subnormals(dtype: torch.dtype, width: int) -> None:
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(3, 10, width, generator=gen) * 300).to(dtype)  # under GRAIN
    x[0, 0] = -0.0
    x[1, 2, width // 2] = torch.nan
    x[2, 3, -1] = torch.inf
    x[2, 4, 0] = -torch.inf
    x[1, 5] = torch.finfo(dtype).tiny / 4 * (1 + torch.arange(width)).to(dtype)  # subnormal
    x[0, 6] = -torch.finfo(dtype).max
    y = torch.randn(3, 10, width, generator=gen).to(dtype)
    y[0, 1, 0] = torch.nan
    rows = row_stats(x, y)
    assert rows is not None and rows.shape == (4, 3, 10) and rows.dtype == torch.float32
    flat = rows.reshape(4, -1)
    assert same(flat[:2], reference(x)) and same(flat[2:], reference(y))
    assert flat[0].isnan().sum() == 1 and flat[2].isnan().sum() == 1


def moments(t: torch.Tensor, centred: bool) -> torch.Tensor:
    """Each row's sum, L2 norm and spread in float64 (the reference)."""
    d = t.double().reshape(-1, t.shape[-1])
    norm = d.norm(dim=1)
    spread = (d - d.mean(1, keepdim=True)).norm(dim=1) if centred else norm
    return torch.stack([d.sum(1), norm, spread])


def close_moments(got: torch.Tensor, t: torch.Tensor, centred: bool) -> None:
    """``got``'s ``(3, rows)`` are the float64 moments of ``t`` rounded to float32 where
    the row is finite, and not finite where it holds NaN/inf."""
    want = moments(t, centred)
    ok = t.reshape(-1, t.shape[-1]).isfinite().all(1)
    torch.testing.assert_close(got.double()[:, ok], want[:, ok].float().double(),
                               rtol=1e-6, atol=1e-6)
    assert not got[:, ~ok].isfinite().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [1, 7, 33, 1000])
def test_the_full_tiers_moments_are_float64_sums(dtype: torch.dtype, width: int) -> None:
    """Sum, L2 norm and spread (centred: about the row's mean, exact at |mean|/std 300,
    where float32's one-pass E[x²] - E[x]² is all rounding error) after the extremes of
    the input and of the output."""
    gen = torch.Generator().manual_seed(width)
    big = 100.0 if dtype == torch.float16 else 1000.0  # within fp16's sum of squares
    x = (torch.randn(3, 10, width, generator=gen) * big / 300 + big).to(dtype)
    x[1, 2, width // 2] = torch.nan
    x[2, 3, -1] = torch.inf
    y = torch.randn(3, 10, width, generator=gen).to(dtype)
    for kind, centred in (("rms", False), ("centred", True)):
        rows = row_stats(x, y, kind)
        assert rows is not None and rows.shape == (7, 3, 10)
        flat = rows.reshape(7, -1)
        assert same(flat[:2], reference(x)) and same(flat[2:4], reference(y))
        close_moments(flat[4:], x, centred)
        alone = row_stats(x, None, kind)
        assert alone is not None and torch.equal(alone[2:].nan_to_num(7.0),
                                                 rows[4:].nan_to_num(7.0))


def test_strided_rows_and_what_it_leaves_to_torch() -> None:
    base = torch.randn(40, 70)
    rows = base[:, 5:37]  # rows 70 apart
    got = row_stats(rows, None)
    assert got is not None and same(got, reference(rows))
    assert row_stats(base.double(), None) is None  # float64
    assert row_stats(base.t(), None) is None  # columns
    assert row_stats(torch.randn(4, 5, 6).transpose(0, 1), None) is None
    assert row_stats(base, base.double()) is None  # one tensor it cannot read: neither
    assert torch.func.vmap(lambda t: torch.tensor(row_stats(t, None) is None))(base).all()


def test_a_layers_reader_reads_alike_calls_as_row_stats_does() -> None:
    """The per-layer reader (the hook's common CPU call): the same rows as row_stats for
    each layout it meets, its plan redone when the layout changes; ``None`` (the hook's
    general path) for what is not an alike pair of contiguous CPU tensors."""
    read = native.RowReader()
    x = torch.randn(3, 5, 40)
    x[1, 2, 7] = float("nan")
    for t, moments in ((x, None), (x, "rms"), (x.bfloat16(), "centred"), (x[:2], None),
                       (torch.randn(2, 70_000), None), (x, None)):
        y = t * 3 - 1
        got, want = read(t, y, moments), row_stats(t, y, moments)
        assert got is not None and want is not None and got.shape == want.shape
        assert same(got, want), (t.shape, t.dtype, moments)
    with threads(1):  # the thread count is part of the layout it plans for
        big = torch.randn(4, GRAIN)
        assert same(read(big, big), row_stats(big, big))
    assert read(x.transpose(0, 1), x.transpose(0, 1)) is None  # not contiguous
    assert read(x, x[..., :20].contiguous()) is None  # another shape
    assert read(x.double(), x.double()) is None  # float64: torch's
    assert read(x, x.to_sparse()) is None
    assert torch.func.vmap(lambda t: torch.tensor(read(t, t) is None))(x).all()
    assert same(read(x, x), row_stats(x, x))  # and back


def test_a_layers_reader_keeps_a_plan_per_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer's calls switch tiers every few steps (sentinel rows, then the full tier's
    moments): the reader keeps a plan for each, planned once, each read as row_stats
    reads it; a new layout is planned again for that tier only."""
    x = torch.randn(6, 48)
    y = x * 2 + 1
    fewer = x[:4]
    want = {m: row_stats(x, y, m) for m in (None, "rms")}
    want_fewer = row_stats(fewer, fewer * 2)
    planned: list[str | None] = []
    real = native.row_plan

    def counting(x: torch.Tensor, out: torch.Tensor | None, moments: str | None = None
                 ) -> native.RowPlan | None:
        planned.append(moments)
        return real(x, out, moments)

    monkeypatch.setattr(native, "row_plan", counting)
    read = native.RowReader()
    for moments in (None, "rms", None, None, None, "rms", None):
        got = read(x, y, moments)
        assert got is not None and same(got, want[moments]), moments  # type: ignore[arg-type]
    assert planned == [None, "rms"]
    assert same(read(fewer, fewer * 2, None), want_fewer)  # type: ignore[arg-type]
    assert same(read(x, y, "rms"), want["rms"])  # type: ignore[arg-type]
    assert planned == [None, "rms", None]


def test_without_torch_threads_shared_big_float32_is_left_to_torch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A single-threaded build (no OpenMP runtime of torch's to link to) leaves float32
    past the grain to torch's threads, and anything past :data:`MAX_ELEMENTS`."""
    monkeypatch.setattr(native, "threaded", lambda: False)
    big = torch.randn(GRAIN // 64 + 1, 64)
    with threads(2):
        assert row_stats(big, None) is None
        assert row_stats(big.bfloat16(), None) is not None
        assert row_stats(torch.zeros(MAX_ELEMENTS + 1).bfloat16(), None) is None
    with threads(1):
        got = row_stats(big, None)
        assert got is not None and same(got, reference(big))


def task_count() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(build.openmp_runtime() is None,
                    reason="torch's threads are not GNU OpenMP's here: built single-threaded")
def test_past_the_grain_the_rows_are_split_over_torchs_own_threads() -> None:
    """Linked to the OpenMP runtime torch loaded (one runtime in the process), the kernel
    starts no thread of its own: its parallel regions run on torch's pool. Rows split at
    any count (odd, fewer than threads' worth, strided, outputs of another width and
    dtype) are exact, NaN rows at the seams included."""
    assert threaded()
    loaded = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
              if "libgomp" in line}
    assert loaded == {build.openmp_runtime()}
    gen = torch.Generator().manual_seed(3)
    with threads(2):
        torch.randn(1 << 20).sum()  # torch's pool is up
        started = task_count()
        for n, width, dtype in ((1031, 64, torch.float32), (3, GRAIN, torch.bfloat16),
                                (777, 130, torch.float16)):
            x = (torch.randn(n, width + 9, generator=gen) * 100).to(dtype)[:, 4:-5]
            y = torch.randn(n, 2 * width, generator=gen)
            for row in (0, n // 2 - 1, n // 2, n - 1):
                x[row, row % width] = torch.nan
            y[n // 2, 0] = -torch.inf
            got = row_stats(x, y, "centred")
            assert got is not None and same(got[:2], reference(x)) and same(got[2:4],
                                                                            reference(y))
            close_moments(got[4:], x, True)
        assert task_count() == started


def test_the_runtime_linked_to_is_the_one_torch_ships() -> None:
    site = Path("/venv/site-packages")
    line = "7f00-7f10 r-xp 00000000 08:01 42 {}"
    system, torchs = "/usr/lib/x86_64-linux-gnu/libgomp.so.1", f"{site}/torch/lib/libgomp.so.1"
    wheel = f"{site}/torch.libs/libgomp-a34b3233.so.1"
    assert build.torchs_libgomp("\n".join(line.format(p) for p in (system, torchs)),
                                 site / "torch") == torchs
    assert build.torchs_libgomp("\n".join(line.format(p) for p in (system, wheel)),
                                 site / "torch") == wheel
    assert build.torchs_libgomp(line.format(system) + "\n7f20-7f30 rw-p 0 0 0 [heap]",
                                 site / "torch") == system
    assert build.torchs_libgomp(line.format(f"{site}/torchvision/libgomp.so.1"),
                                 site / "torch") == f"{site}/torchvision/libgomp.so.1"
    assert build.torchs_libgomp("", site / "torch") is None


def test_a_compiler_without_openmp_builds_it_single_threaded(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    compiler = tmp_path / "cc"
    compiler.write_text('#!/bin/sh\ncase "$*" in *-fopenmp*) exit 1;; esac\nexec cc "$@"\n')
    compiler.chmod(0o755)
    library.cache_clear()
    monkeypatch.setenv("NORMWATCH_CACHE", str(tmp_path / "made"))
    monkeypatch.setenv("CC", str(compiler))
    try:
        assert library() is not None and not threaded()
        x = torch.randn(GRAIN // 64 + 1, 64).bfloat16()
        with threads(2):
            got = row_stats(x, None)
        assert got is not None and same(got, reference(x))
    finally:
        library.cache_clear()


@pytest.fixture
def no_library(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    library.cache_clear()
    monkeypatch.setenv("NORMWATCH_NATIVE", "0")
    yield
    library.cache_clear()


def test_without_the_library_the_sentinel_runs_torch(no_library: None) -> None:
    assert library() is None and row_stats(torch.randn(4, 8), None) is None


def test_a_missing_compiler_is_no_error(monkeypatch: pytest.MonkeyPatch, tmp_path: object
                                        ) -> None:
    library.cache_clear()
    monkeypatch.setenv("NORMWATCH_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    try:
        assert library() is None
    finally:
        library.cache_clear()


def test_built_into_a_private_cache_named_by_the_source(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    library.cache_clear()
    monkeypatch.setenv("NORMWATCH_CACHE", str(tmp_path / "made"))
    try:
        assert library() is not None
        built = list(build.cache_dir().iterdir())
        assert len(built) == 1 and built[0].suffix == ".so"
        assert build.cache_dir().stat().st_mode & 0o077 == 0
    finally:
        library.cache_clear()


EXACT = ("absmax", "out_absmax", "nonfinite", "fp16_overflow_tokens", "eps_dominated_tokens",
         "common_mode_tokens")
"""Statistics both kernels give bit-equal (extremes, counts far from their thresholds)."""
SUMMED = ("rms_max", "rms_min", "rms_mean", "common_mode_max", "eps_dominance")
"""Statistics of the full tier's sums: the kernel sums in float64, torch in float32."""


def train(kernel: str, steps: int = 6) -> tuple[list[dict[str, float]], list[float]]:
    """Per-layer statistics of every flush and the losses of a small bf16 training run."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.LayerNorm(48), nn.GELU(), nn.Linear(48, 48),
                          nn.RMSNorm(48), nn.Linear(48, 1)).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    snaps: list[dict[str, float]] = []
    watch = normwatch.watch(model, kernel=kernel, flush_every=1, stats_every=3,
                            report_dir=None)
    losses = []
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(16, 32, generator=gen).to(torch.bfloat16) * (1 + 100 * (step == 4))
        loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        snap = watch.step(loss)
        assert snap is not None
        snaps.append({f"{k}/{f}": getattr(v, f) for k, v in snap.layers.items()
                      for f in (*EXACT, *SUMMED)})
        losses.append(loss.item())
    watch.close()
    return snaps, losses


def test_a_watched_run_sees_the_same_with_either_kernel(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """Sentinel and full-tier steps alike, the spike included (step 5: |x| past 256)."""

    passes: list[int] = []
    read = native.read_rows

    def counted(plan: native.RowPlan, x: torch.Tensor, out: torch.Tensor | None,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        passes.append(plan.args[8])  # the moments read: 0 none, 1 RMS, 2 centred
        return read(plan, x, out, rows)

    folds: list[int] = []

    def folded(rows: list[torch.Tensor], *args: object) -> bool:
        folds.append(len(rows))
        return real_fold(rows, *args)  # type: ignore[arg-type]

    real_fold = native_folds.fold_rows
    monkeypatch.setattr(native, "read_rows", counted)
    monkeypatch.setattr(native_folds, "fold_rows", folded)
    # the recorder's reads counted (the C++ lane's are the same: test_hooks.py's
    # test_the_lane_measures_as_the_general_path)
    monkeypatch.setattr(fastlane, "state", lambda *args: None)
    native_snaps, native_losses = train("auto")
    # two norms, six steps: full tier on steps 1 and 4 (stats_every=3)
    assert sorted(passes) == [0] * 8 + [1] * 2 + [2] * 2
    assert sum(folds) == 12  # every call folded by the C kernel
    torch_snaps, torch_losses = train("torch")
    assert sum(folds) == 12  # kernel="torch": torch's fold too
    assert native_losses == torch_losses and len(native_snaps) == 6
    for got, want in zip(native_snaps, torch_snaps, strict=True):
        assert {k: v for k, v in got.items() if k.endswith(EXACT)} == \
            {k: v for k, v in want.items() if k.endswith(EXACT)}
        for key in (k for k in want if k.endswith(SUMMED)):  # None: not measured
            assert (got[key] is None) == (want[key] is None), key
            assert want[key] is None or got[key] == pytest.approx(want[key], rel=1e-5), key
    assert any(v > 0 for s in native_snaps for k, v in s.items() if "fp16_overflow" in k)
    assert any(v > 0 for s in native_snaps for k, v in s.items() if k.endswith("rms_max"))


def test_tensors_it_does_not_cover_never_build_it() -> None:
    """A CUDA run without Triton (or float64) runs no compiler inside its forward."""
    library.cache_clear()
    try:
        assert row_stats(torch.randn(4, 8).double(), None) is None
        assert library.cache_info().currsize == 0
    finally:
        library.cache_clear()


def native_call(x: torch.Tensor, y: torch.Tensor | None, kind: str, eps: float, full: bool,
                row: int, key: float | torch.Tensor) -> CallRows:
    """A call read by the native backend (its C reader where it covers the tensors)."""
    rows = LayerRows.of(layer(kind=kind, eps=eps, width=x.shape[-1]), row)  # type: ignore[arg-type]
    return NATIVE.call_rows(rows, x, y, key, full)


def folds(full: bool, seed: int) -> list[CallRows]:
    """Calls of every shape the fold meets: NaN, inf, all-zero and common-mode tokens,
    |x| at fp16's limit and just past it, eps 0 and eps dominating, outputs missing,
    lined up or overflowing, 1 to 69 wide."""
    g = torch.Generator().manual_seed(seed)
    calls = []
    for i in range(int(torch.randint(1, 7, (1,), generator=g))):
        width = int(torch.randint(1, 70, (1,), generator=g))
        n = int(torch.randint(1, 40, (1,), generator=g))
        x = torch.randn(n, width, generator=g) * float(torch.rand(1, generator=g) * 600)
        x[i % n, 0] = [1.0, math.nan, math.inf, -math.inf][(seed + i) % 4]
        if n > 1:
            x[-1] = [256.0, 256.0 + 2.0**-15, -256.0, 0.5][(seed + i) % 4]  # (float32 ulp)
        if (seed + i) % 3 == 0:
            x[n // 2] = 0.0
        if (seed + i) % 5 == 0:
            x = x + 300.0
        y = None if (seed + i) % 3 == 1 else x * 0.5
        if y is not None and (seed + i) % 4 == 0:
            y[-1, -1] = math.inf
        eps = 0.0 if (seed + i) % 6 == 0 else 1e-5 if i % 2 else 100.0
        calls.append(native_call(x, y, "rmsnorm" if i % 2 else "layernorm", eps, full, i,
                                 float(seed * 1000 + 3 * i)))
    return calls


@pytest.mark.parametrize("full", [False, True])
def test_the_c_fold_gives_torchs_values(full: bool) -> None:
    """Column for column the same as torch's ops (the same float32 arithmetic), but the
    RMS sum, summed in float64 there; one call past the kernel's chunk of tokens."""
    long = native_call(torch.randn(70_000, 2), torch.randn(70_000, 2), "rmsnorm", 1e-6,
                       full, 7, 5.0)
    sets = [folds(full, seed) for seed in range(40)] + [[long]]
    for calls in sets:
        plan = fold_plan(calls, Limits())
        want = fold_calls(calls, plan)
        got = native_folds.folded_calls(calls, plan)
        assert got is not None
        for j, name in enumerate(COLUMNS):
            if name == "rms_sum":
                torch.testing.assert_close(got[:, j], want[:, j], rtol=1e-6, atol=0)
            else:
                assert same(got[:, j], want[:, j]), (name, got[:, j], want[:, j])
    assert any(c.lined_up for calls in sets for c in calls)
    assert any(not c.lined_up for calls in sets for c in calls)


def test_what_the_c_fold_leaves_to_torch() -> None:
    """Rows torch kept in bf16, an output of another shape, a compiled call's tensor key."""
    x = torch.randn(8, 16)
    kept_bf16 = reduce_call(x.bfloat16(), None, "rmsnorm", 1e-6, False, 0, 0.0)
    other_shape = native_call(x, torch.randn(4, 32), "rmsnorm", 1e-6, False, 0, 0.0)
    traced = native_call(x, None, "rmsnorm", 1e-6, False, 0, torch.tensor(0.0))
    for call in (kept_bf16, other_shape, traced):
        plan = fold_plan([call], Limits())
        assert native_folds.folded_calls([call], plan) is None
        assert NATIVE.fold([call], plan).shape == (1, len(COLUMNS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_gradient_in_one_pass(dtype: torch.dtype) -> None:
    """Each row's L2 norm (against float64), then the whole gradient's min and max
    (exact); a second part added as it is read; NaN/inf where torch's reductions give
    them; one thread or several; what it leaves to torch."""
    gen = torch.Generator().manual_seed(3)
    cases = [(5, 7), (3, 4, 16), (64, 250), (2 * GRAIN // 256 + 3, 256), (1, 1)]
    for shape in cases:
        for n_threads in (1, 2):
            a, b = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
            for parts in ((a,), (a, b)):
                with threads(n_threads):
                    got = grad_rows(*parts)
                whole = parts[0].double() + (parts[1].double() if len(parts) > 1 else 0.0)
                whole = whole.float().double()  # (parts are added in float32)
                rows = whole.reshape(-1, shape[-1])
                assert got is not None and got.shape == (rows.shape[0] + 2,)
                torch.testing.assert_close(got[:-2].double(), rows.norm(dim=1),
                                           rtol=1e-5, atol=0)
                assert got[-2] == whole.min() and got[-1] == whole.max(), (shape, got[-2:])
    t = torch.randn(6, 40, generator=gen).to(dtype)
    t[1, 3], t[2, 39], t[3, 0] = math.nan, math.inf, -math.inf
    got = grad_rows(t)
    want = torch.linalg.vector_norm(t.float(), dim=-1)
    assert got is not None  # NaN, inf, inf where the rows hold them
    torch.testing.assert_close(got[:-2], want, rtol=1e-6, atol=0, equal_nan=True)
    assert got[-2:].isnan().all()  # as torch.aminmax: NaN both
    t[1, 3] = 0.0
    got = grad_rows(t)
    assert got is not None and got[-2] == -math.inf and got[-1] == math.inf
    if dtype == torch.float32:  # a sum of squares past float32's range: inf, as torch's
        big = torch.full((2, 16), 1e20)
        assert torch.equal(grad_rows(big)[:-2], torch.linalg.vector_norm(big, dim=-1))
    assert grad_rows(t.double()) is None and grad_rows(t.t()) is None
    assert grad_rows(t, t[:3]) is None and grad_rows(t, t.t().contiguous().t()) is None
    assert grad_rows(torch.zeros(0, 4, dtype=dtype)) is None


def test_row_buffers_are_lent_again_only_once_given_back() -> None:
    """Buffers are lent by shape, none twice before :meth:`give_back` (the rows in them
    wait for a fold); then the same ones are lent again, also after a give-back with
    none lent (a flush folds twice), and a buffer not lent is kept for ``KEEP_IDLE``
    give-backs, then let go (intervals alternate: two full-tier steps in one, three in
    the next; where each step folds, a full-tier step's buffers wait ``stats_every - 1``
    give-backs)."""
    buffers = RowBuffers()
    first = [buffers.take((4, 8)) for _ in range(3)] + [buffers.take((7, 8))]
    assert len({id(b) for b in first}) == 4 and all(b.dtype == torch.float32 for b in first)
    assert first[0].shape == (4, 8) and first[3].shape == (7, 8)
    buffers.give_back()
    buffers.give_back()  # none lent since: the free ones stay
    again = [buffers.take((4, 8)) for _ in range(4)]
    assert {id(b) for b in again[:3]} == {id(b) for b in first[:3]}  # the same three
    assert id(again[3]) not in {id(b) for b in first}  # a fourth: made
    buffers.give_back()  # (7, 8) was not lent since the last give-back: kept
    assert id(buffers.take((7, 8))) == id(first[3])
    buffers.give_back()
    for _ in range(KEEP_IDLE):  # (7, 8) not lent since: kept
        buffers.take((4, 8))
        buffers.give_back()
    assert id(buffers.take((7, 8))) == id(first[3])
    buffers.give_back()
    for _ in range(KEEP_IDLE + 1):  # not lent for longer: let go
        buffers.take((4, 8))
        buffers.give_back()
    assert id(buffers.take((7, 8))) != id(first[3])


def test_a_cuda_buffer_asked_for_on_a_side_stream_is_made_off_the_callers_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA graph trees send every allocation of the thread warming up a graph (on a
    stream of their own) into the graph's pool, where a lent buffer, alive after the
    graph, fails their check: a buffer asked for on a stream other than the device's
    default is made by normwatch's own thread, inside that stream; on the default stream,
    by the caller's thread, as before. (CUDA faked on this CPU: its streams, the stream
    context and ``torch.empty``'s device.)"""
    device = torch.device("cuda", 0)

    class Stream:
        def __init__(self) -> None:
            self.device = device

    default, side = Stream(), Stream()
    current, entered, made = [default], [], []
    empty = torch.empty

    @contextlib.contextmanager
    def stream(s: Stream) -> Iterator[None]:
        entered.append(s)
        yield
        entered.pop()

    def recorded(*args: Any, **kwargs: Any) -> torch.Tensor:
        made.append((threading.current_thread().name, [*entered], kwargs["device"]))
        return empty(*args, **{**kwargs, "device": "cpu"})

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: default)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch, "empty", recorded)
    buffers = RowBuffers()
    assert buffers.take((4, 8), device).shape == (4, 8)
    assert made == [(threading.current_thread().name, [], device)]
    current[0] = side  # as inside a CUDA graph tree's warm-up
    rows = buffers.take((4, 8), device)
    assert rows.shape == (4, 8) and rows.dtype == torch.float32
    assert made[1][0].startswith("normwatch-buffers") and made[1][1:] == ([side], device)
    assert len(made) == 2 and not entered


def test_a_watchs_intervals_read_into_the_last_ones_buffers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """In a watched run the sentinel's rows of an interval go into the buffers the last
    interval's went into, none made again (a flush folds twice: its second give-back,
    with none lent, once let them all go)."""
    seen: list[list[torch.Tensor]] = []
    give_back = RowBuffers.give_back

    def kept(self: RowBuffers) -> None:
        seen[-1].extend(self._lent)  # what was lent since the last fold (held: ids stay)
        give_back(self)

    monkeypatch.setattr(RowBuffers, "give_back", kept)  # (the recorder's loans and C++'s)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 1))
    watch = normwatch.watch(model, flush_every=2, stats_every=1000, gradients=False,
                            report_dir=None)
    for step in range(8):
        if step % 2 == 0:
            seen.append([])
        model(torch.randn(4, 8)).sum().backward()
        watch.step()
    watch.close()
    ids = [{id(rows) for rows in interval if rows.shape[0] == 4} for interval in seen]
    assert len(ids[1]) == 2 and ids[2] == ids[3] == ids[1]  # sentinel calls: 4 rows each


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sites_gradient_reader_plans_once_and_reads_as_grad_rows(
        dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """A site's reader plans a layout once and then reads as :func:`grad_rows` does (a
    second part included); a new layout, or another thread count, is planned again; what
    the C kernel does not take goes to :func:`grad_rows` (torch's, there); a weight's
    reader reads the whole gradient as one row: its norm (against float64), min and max."""
    gen = torch.Generator().manual_seed(5)
    a, b = (torch.randn(3, 7, 32, generator=gen).to(dtype) for _ in range(2))
    fewer = a[:2]
    want, want_parts, want_fewer = grad_rows(a), grad_rows(a, b), grad_rows(fewer)
    planned: list[tuple[int, ...]] = []
    real = native.grad_read_plan

    def counting(a: torch.Tensor, b: torch.Tensor | None = None, whole: bool = False
                 ) -> Any:
        planned.append(tuple(a.shape))
        return real(a, b, whole)

    monkeypatch.setattr(native, "grad_read_plan", counting)
    read, read_parts = native.GradReader(), native.GradReader()
    for _ in range(3):
        assert same(read(a), want) and same(read_parts(a, b), want_parts)  # type: ignore[arg-type]
    assert planned == [(3, 7, 32)] * 2  # once each
    assert same(read(fewer), want_fewer)  # type: ignore[arg-type]
    with threads(torch.get_num_threads() + 1):
        assert same(read(fewer), want_fewer)  # type: ignore[arg-type]
    assert planned == [(3, 7, 32)] * 2 + [(2, 7, 32)] * 2
    planned.clear()
    across = a.transpose(0, 1)  # not contiguous: grad_rows', which leaves it to torch
    assert read(across) is None and read(a, b.transpose(1, 2).contiguous().transpose(1, 2)) \
        is None
    assert planned == [(7, 3, 32), (3, 7, 32)]
    weight = torch.randn(4, 48, generator=gen).to(dtype)
    got = native.GradReader(whole=True)(weight)
    assert got is not None and got.shape == (3,)
    torch.testing.assert_close(got[0].double(), weight.double().norm(), rtol=1e-5, atol=0)
    assert got[1] == weight.min() and got[2] == weight.max()
    assert native.GradReader(whole=True)(weight.t()) is None  # (torch's norm, there)


def test_a_folds_lines_accumulate_into_the_state_as_a_loop_says() -> None:
    """``folds.accumulate`` against a plain loop: per call in order, its sums added, its
    maxima and minima taken where the line value is not NaN (a NaN already in the state
    stays); rows met several times; what it leaves to torch's ops."""
    from normwatch.measure.state.accumulator import MAX_END, N_SUM

    g = torch.Generator().manual_seed(5)
    width = len(COLUMNS)
    for trial in range(20):
        block = _new_state(4, torch.device("cpu"))
        block.add_(torch.randn(block.shape, generator=g).where(block == 0, 0.0))
        block[trial % 4, (trial * 7) % width] = math.nan
        lines = torch.randn(12, width, generator=g, dtype=torch.float64) * 10
        special = torch.tensor([math.nan, math.inf, -math.inf], dtype=torch.float64)
        picks = torch.rand(lines.shape, generator=g) < 0.1
        lines[picks] = special[torch.randint(0, 3, (int(picks.sum()),), generator=g)]
        rows = torch.randint(0, 4, (12,), generator=g)
        want = block.clone()
        for c, r in enumerate(rows.tolist()):
            for j in range(width):
                v, b = float(lines[c, j]), float(want[r, j])
                if j < N_SUM:
                    want[r, j] = b + v
                elif not (math.isnan(v) or math.isnan(b)):
                    want[r, j] = max(b, v) if j < MAX_END else min(b, v)
        got = block.clone()
        assert native_folds.accumulate(lines, rows, N_SUM, MAX_END, got)
        assert same(got, want), trial
    assert not native_folds.accumulate(lines.float(), rows, N_SUM, MAX_END, got)  # float32
    assert not native_folds.accumulate(lines, rows.int(), N_SUM, MAX_END, got)
    assert not native_folds.accumulate(lines[:, :-1], rows, N_SUM, MAX_END, got)  # columns
    assert not native_folds.accumulate(lines, rows[:-1], N_SUM, MAX_END, got)


def test_the_c_gradient_fold_gives_torchs_values_and_float64_sums() -> None:
    """Token counts, elements and peaks as torch's ops give them; each site's sum of
    squares against float64 (where float32's sum overflows, and torch's says inf)."""
    g = torch.Generator().manual_seed(0)
    overflowed = 0
    for trial in range(60):
        staged = []
        for k in range(int(torch.randint(1, 8, (1,), generator=g))):
            n, width = (int(torch.randint(1, 50, (1,), generator=g)) for _ in range(2))
            t = torch.randn(n, width, generator=g) * 10.0 ** (trial % 24 - 3)
            t[k % n, 0] = [1.0, math.nan, math.inf, 1.0, 1.0][(trial + k) % 5]
            t = t.bfloat16() if trial % 3 == 0 else t
            packed = grad_rows(t)  # the C kernel's rows: token norms, then min and max
            assert packed is not None
            staged.append(GradRows(packed, None, None, k % 3, (trial + k) % 3, width))
        for site_layer in (1, trial % 3, 1):  # weight gradients' norms, a layer's twice
            norm = torch.rand((), generator=g) * 10.0 ** (trial % 7)
            staged.insert(site_layer, GradRows(norm, None, None, site_layer, WEIGHT, 5))
        plan = grad_plan(staged, torch.device("cpu"))
        start = _new_state(3, torch.device("cpu"))
        start.copy_(torch.rand(start.shape, generator=g).where(start.isfinite(), start))
        want, got = start.clone(), start.clone()
        fold_grads(want, staged, plan)  # torch's ops, on the same rows unpacked
        acts = [s for s in staged if s.site != WEIGHT]
        weights = [s for s in staged if s.site == WEIGHT]
        assert native_folds.folded_grads(start.clone(), staged, plan)  # it covers them
        mixed = [*acts[:-1], GradRows(*token_rows(t), *acts[-1][3:]), *weights]
        assert not native_folds.folded_grads(start.clone(), mixed, plan)  # torch's
        doubled = [*acts, *(w._replace(norms=w.norms.double()) for w in weights)]
        assert not native_folds.folded_grads(start.clone(), doubled, plan)
        NATIVE.fold_grads(got, staged, plan)
        sumsq = {COLUMNS.index(f"{site}_sumsq") for site in SITES}
        for j in range(len(COLUMNS)):
            if j not in sumsq:
                assert same(got[:, j], want[:, j]), COLUMNS[j]
        for j, site in ((COLUMNS.index(f"{s}_sumsq"), i) for i, s in enumerate(SITES)):
            reference = start[:, j].clone()
            for s in (s.unpacked() for s in acts if s.site == site):
                whole = bool(torch.stack([s.hi, -s.lo]).isfinite().all())  # type: ignore
                norms = s.norms.double().reshape(-1)
                reference[s.layer] += torch.where(norms.isfinite() | whole, norms, 0.0
                                                  ).square().sum()
            torch.testing.assert_close(got[:, j], reference, rtol=1e-12, atol=0)
            overflowed += int((want[:, j].isinf() & reference.isfinite()).sum())
    assert overflowed  # float32 sums overflowed where float64's did not


@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
@pytest.mark.parametrize("form", ["w", "1+w", None])
def test_the_gradient_through_a_norm_is_computed_as_autograd_gives_it(
        kind: str, form: str | None) -> None:
    """:class:`~normwatch.measure.backends.native.readers.ThroughReader` against float64
    autograd of torch's own norm: each row's L2 norm of ``dL/dx`` through the norm (a large
    common mode included), its min and max; the output's gradient read as :func:`grad_rows`
    reads it;
    widths with a tail, one thread or several; NaN rows; what it leaves to torch."""
    gen = torch.Generator().manual_seed(11)
    eps = 1e-5
    for shape in ((5, 7), (3, 4, 16), (64, 250), (2 * GRAIN // 256 + 3, 256), (2, 3)):
        d = shape[-1]
        x = torch.randn(shape, generator=gen) * 3 + (100.0 if kind == "layernorm" else 0.0)
        g = torch.randn(shape, generator=gen)
        w = None if form is None else torch.rand(d, generator=gen) + 0.5
        x64 = x.double().requires_grad_()
        scale = None if w is None else w.double() + (1.0 if form == "1+w" else 0.0)
        y = (torch.nn.functional.layer_norm if kind == "layernorm" else
             torch.nn.functional.rms_norm)(x64, (d,), scale, eps=eps)
        (dx,) = torch.autograd.grad(y, x64, g.double())
        reader = native.ThroughReader(kind == "layernorm", eps, form == "1+w")
        for n_threads in (1, 2):
            with threads(n_threads):
                got = reader(g, x, w)
            assert got is not None
            rows_g, rows_x = got
            want_g = grad_rows(g)
            assert want_g is not None
            torch.testing.assert_close(rows_g[:-2], want_g[:-2], rtol=1e-6, atol=0)
            assert torch.equal(rows_g[-2:], want_g[-2:])
            flat = dx.reshape(-1, d)
            torch.testing.assert_close(rows_x[:-2].double(), flat.norm(dim=1), rtol=2e-4,
                                       atol=1e-6 * float(flat.norm(dim=1).max()))
            torch.testing.assert_close(rows_x[-2:].double(), torch.stack([dx.min(), dx.max()]),
                                       rtol=2e-4, atol=1e-5 * float(dx.abs().max()))
    x = torch.randn(6, 40, generator=gen)
    g = torch.randn(6, 40, generator=gen)
    x[2, 5] = math.nan
    w = None if form is None else torch.ones(40)
    got = native.ThroughReader(kind == "layernorm", eps, form == "1+w")(g, x, w)
    assert got is not None
    assert got[1][:-2].isnan().tolist() == [False, False, True, False, False, False]
    assert got[1][-2:].isnan().all() and not got[0].isnan().any()
    reader = native.ThroughReader(kind == "layernorm", eps, form == "1+w")
    assert reader.covers(x, w) and reader.covers(x, None)  # (the forward's check)
    assert not reader.covers(x.double(), w) and not reader.covers(x.t(), None)
    assert not reader.covers(x, torch.ones(41)) and not reader.covers(x, torch.ones(40).double())
    assert not reader.covers(x.bfloat16(), None) and not reader.covers(x, torch.ones(80)[::2])
    assert reader(g.bfloat16(), x, w) is None  # (the gradient's, in the backward)
    assert reader(g.t().contiguous().t(), x, w) is None and reader(g[:3], x, w) is None
    assert reader(torch.zeros(0, 40), torch.zeros(0, 40), w) is None
    if w is not None:  # a weight let go since (FSDP2 frees the unsharded one's storage)
        gone = w.clone()
        gone.untyped_storage().resize_(0)
        assert reader(g, x, gone) is None
