"""The fused Triton kernel against the torch float64 reference (Triton's interpreter on
the CPU; the real kernel on a GPU): the rows every backend writes, folded as any other
call's. Skips cleanly where Triton is absent."""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("triton")

import normwatch
from normwatch.catalog import COLUMNS
from normwatch.measure.backends.torchops import TORCH, reduce_call
from normwatch.measure.backends.triton_folds import fold_grads_fused
from normwatch.measure.backends.triton_kernel import (
    TRITON,
    launch,
    launch_grad,
    row_count,
    row_stats_triton,
)
from normwatch.measure.state.accumulator import _new_state
from normwatch.measure.state.fold import fold_calls, fold_plan
from normwatch.measure.state.grad_fold import fold_grads, grad_plan
from normwatch.measure.state.rows import IN, OUT, WEIGHT, GradRows, LayerRows
from normwatch.records import Limits
from tests.factory import layer

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def row_stats_torch(tokens: torch.Tensor, out: torch.Tensor | None = None, full: bool = True,
                    centred: bool = True) -> torch.Tensor:
    """The reference: the kernel's rows computed with torch, in float64 (a token holding
    NaN or inf: NaN in each of its rows; max |x| for both the max and the min)."""
    x = tokens.double()
    finite = torch.isfinite(x)
    bad = ~finite.all(1)
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=x.device)
    absmax = torch.where(bad, nan, x.abs().amax(1) if x.shape[1] else x.new_zeros(len(x)))
    rows = [absmax, absmax]
    if out is not None:
        y = out.double()
        out_absmax = torch.where(~torch.isfinite(y).all(1), nan,
                                 y.abs().amax(1) if y.shape[1] else y.new_zeros(len(y)))
        rows += [out_absmax, out_absmax]
    if full:
        total = x.sum(1)
        l2 = x.square().sum(1).sqrt()
        spread = (x - total[:, None] / max(x.shape[1], 1)).square().sum(1).sqrt() \
            if centred else l2
        rows += [torch.where(bad, nan, r) for r in (total, l2, spread)]
    return torch.stack(rows)


def assert_rows_match(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    for j in range(got.shape[0]):
        g, w = got[j].double().cpu(), want[j].cpu()
        finite = torch.isfinite(w)
        scale = float(w[finite].abs().max()) if finite.any() else 1.0
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6 * max(1.0, scale),
                                   equal_nan=True, msg=lambda m, j=j: f"row {j}: {m}")


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
@pytest.mark.parametrize("centred", [True, False])
def test_kernel_matches_the_reference(dtype: torch.dtype, width: int, centred: bool) -> None:
    x = hard(6, width, dtype).to(DEVICE)
    y = (torch.randn(6, width) * 2).to(dtype).to(DEVICE)
    y[0, 0] = float("nan")
    rows = row_stats_triton(x, y, True, centred)
    assert_rows_match(rows, row_stats_torch(x, y, True, centred))
    if width > 1:  # a token holding NaN or inf: NaN in its rows, its output's apart
        inputs = [0, 1, 4, 5, 6]
        assert rows[inputs, 4].isnan().all() and not rows[2:4, 4].isnan().any()
        assert rows[2:4, 0].isnan().all() and not rows[inputs, 0].isnan().any()



@pytest.fixture
def tuples() -> Iterator[None]:
    """The chunks' reductions as compiled (reductions of tuples), run by the interpreter
    too (where they are otherwise one reduction a value)."""
    from normwatch.measure.backends import triton_kernel

    names = ("_sum_max", "_maxes", "_moments", "_combine_sum_max", "_combine_maxes",
             "_combine_moments")
    kept = {name: getattr(triton_kernel, name) for name in names}
    triton_kernel._combiners(tuples=True)
    yield
    for name, value in kept.items():
        setattr(triton_kernel, name, value)


@pytest.mark.usefixtures("tuples")
@pytest.mark.parametrize("width", [3, 100])
def test_the_reductions_of_tuples_match_the_reference(width: int) -> None:
    """The kernels as compiled for a GPU (each chunk's values reduced together, by the
    combining functions) give the reference's rows, the gradient kernel's too (the
    interpreter runs them element by element: small tokens only)."""
    x, part = hard(6, width, torch.bfloat16).to(DEVICE), torch.randn(6, width).to(DEVICE)
    y = (torch.randn(6, width) * 2).to(DEVICE)
    y[0, 0] = float("nan")
    for full in (True, False):
        assert_rows_match(row_stats_triton(x, y, full, True), row_stats_torch(x, y, full, True))
    rows = torch.full((2, 6), -1.0, device=DEVICE)
    launch_grad(x, part, rows, 6, width)
    assert_rows_match(rows, grad_rows_reference(x, part))


@pytest.mark.parametrize("tokens", [2, 4, 8])
@pytest.mark.parametrize("width", [3, 100, 2050])
def test_programs_of_several_tokens_give_the_reference_rows(tokens: int, width: int) -> None:
    """#48 item 3: a program may read several tokens (a tile of ``TOKENS`` x ``BLOCK_D``;
    ``gpu.py --parts bandwidth`` times each choice); its rows are the reference's, the
    last program's too where the tokens do not fill it (13 tokens), a token holding NaN
    or inf apart, both tiers, and the gradient kernel's the same."""
    x = torch.cat([hard(6, width, torch.bfloat16), torch.randn(7, width).bfloat16()])
    y = (torch.randn(13, width) * 2).bfloat16()
    y[9, 0] = float("nan")
    x, y, part = x.to(DEVICE), y.to(DEVICE), torch.randn(13, width).to(DEVICE)
    for full in (True, False):
        rows = torch.full((row_count(True, full), 13), -1.0, device=DEVICE)
        launch(x, y, rows, 13, width, (width, 1, width, 1), True, full, True, 4, tokens)
        assert_rows_match(rows, row_stats_torch(x, y, full, True))
    rows = torch.full((2, 13), -1.0, device=DEVICE)
    launch_grad(x, part, rows, 13, width, tokens)
    assert_rows_match(rows, grad_rows_reference(x, part))


_HOPPER = """
import json, re, sys, warnings
warnings.filterwarnings("ignore")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from normwatch.measure.backends.triton_kernel import _grad_kernel, _kernel
from normwatch.measure.backends.triton_through import through_kernel

ROWS = {"x_ptr": "*bf16", "y_ptr": "*bf16", "rows_ptr": "*fp32", "n_tokens": "i32",
        "width": "i32", "sxt": "i32", "sxd": "constexpr", "syt": "i32", "syd": "constexpr",
        "HAS_OUT": "constexpr", "FULL": "constexpr", "CENTRED": "constexpr",
        "BLOCK_D": "constexpr", "TOKENS": "constexpr"}
GRADS = {"g_ptr": "*bf16", "p_ptr": "*bf16", "rows_ptr": "*fp32", "n_tokens": "i32",
         "width": "i32", "HAS_PART": "constexpr", "BLOCK_D": "constexpr", "TOKENS": "constexpr"}
THROUGH = {"g_ptr": "*bf16", "x_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*fp32",
           "in_ptr": "*fp32", "n_tokens": "i32", "width": "i32", "eps": "fp32",
           "HAS_W": "constexpr", "ONE_PLUS_W": "constexpr", "CENTRED": "constexpr",
           "BLOCK_D": "constexpr"}
aligned = [["tt.divisibility", 16]]  # (a 125M call's: 768 wide, 16-byte aligned)
calls, grads = (0, 1, 2, 3, 4, 5, 7), (0, 1, 2, 3, 4)
counts = {}
for name, kernel, signature, constants, at in (
        ("full", _kernel(), ROWS, {"HAS_OUT": True, "FULL": True, "CENTRED": True,
                                   "TOKENS": 1}, calls),
        ("sentinel", _kernel(), ROWS, {"HAS_OUT": True, "FULL": False, "CENTRED": True,
                                       "TOKENS": 1}, calls),
        ("full, 4 tokens", _kernel(), ROWS, {"HAS_OUT": True, "FULL": True, "CENTRED": True,
                                             "TOKENS": 4}, calls),
        ("gradient", _grad_kernel(), GRADS, {"HAS_PART": True, "TOKENS": 1}, grads),
        ("gradient, 4 tokens", _grad_kernel(), GRADS, {"HAS_PART": True, "TOKENS": 4}, grads),
        ("through", through_kernel(), THROUGH,
         {"HAS_W": True, "ONE_PLUS_W": False, "CENTRED": True}, (0, 1, 2, 3, 4, 5, 6))):
    if "sxd" in signature:  # (an int of 1 is a constexpr to Triton's JIT)
        constants = {**constants, "sxd": 1, "syd": 1}
    try:
        made = triton.compile(ASTSource(kernel, signature, {**constants, "BLOCK_D": 1024},
                                        {(i,): aligned for i in at}),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    except Exception as exc:  # no CUDA backend or ptxas in this Triton, another API
        print(json.dumps({"skip": repr(exc)[-400:]}))
        sys.exit(0)
    ptx = made.asm["ptx"]
    counts[name] = [made.asm["ttir"].count('"tt.reduce"('),
                    len(re.findall(r"\\bbar\\.sync\\b", ptx)),
                    re.findall(r"ld\\.global[.\\w]*", ptx)]
print(json.dumps(counts))
"""
"""Compiles the kernels for an sm_90 GPU as Triton's JIT does for a 125M call's launch
(4 warps, bfloat16, 768 wide: 16-byte aligned pointers and widths, unit strides
constant) and prints each one's reductions (Triton's IR), block-wide barriers and
global loads (PTX). Needs no GPU: Triton's compiler and ptxas run on the CPU (not
under its interpreter: hence a process of its own)."""


_PROBE = """
import json, sys, warnings
warnings.filterwarnings("ignore")
try:
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def probe(p, N: tl.constexpr):
        tl.store(p + tl.arange(0, N), tl.zeros((N,), tl.float32))

    made = triton.compile(ASTSource(probe, {"p": "*fp32", "N": "constexpr"}, {"N": 16}),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert "st.global" in made.asm["ptx"]
except Exception as exc:  # no CUDA backend or ptxas in this Triton, another API
    print(json.dumps({"skip": repr(exc)[-400:]}))
    sys.exit(0)
print(json.dumps({}))
"""
"""Compiles a kernel of one store for an sm_90 GPU: whether this Triton can (its CUDA
backend and ptxas), apart from whether normwatch's kernels do."""


def _run_uninterpreted(script: str) -> Any:
    """What ``script`` prints last, as JSON, run from a file in a process of its own, not
    under Triton's interpreter (Triton's JIT reads a kernel's source from its file)."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[3]  # (normwatch importable as here)
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(script)
    try:
        done = subprocess.run([sys.executable, f.name], env=env, capture_output=True,
                              text=True, timeout=600, check=False)
    finally:
        os.unlink(f.name)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@functools.cache
def _sm90_toolchain() -> str | None:
    """Why Triton cannot compile for sm_90 here (``None``: it can)."""
    got = _run_uninterpreted(_PROBE)
    return got.get("skip")


def compiled_for_sm90(script: str) -> Any:
    """What ``script`` (one that compiles normwatch's kernels for an sm_90 GPU) prints
    last, as JSON, run in a process of its own, not under Triton's interpreter (its
    compiler and ptxas run on the CPU); skips where this Triton cannot compile for sm_90
    at all (:data:`_PROBE`), and fails where it can but normwatch's kernels do not
    compile (the script prints ``{"skip": why}``)."""
    why = _sm90_toolchain()
    if why is not None:
        pytest.skip(f"Triton cannot compile for sm_90 here: {why}")
    got = _run_uninterpreted(script)
    assert not (isinstance(got, dict) and "skip" in got), \
        f"normwatch's kernels did not compile for sm_90 where Triton can: {got['skip']}"
    return got


def test_the_kernels_reduce_few_times_a_chunk() -> None:
    """#48 item 3: each reduction costs a program a round through shared memory between
    barriers, so a chunk's are few: one max gives max |x| and whether the token is
    finite, a chunk's count is its width, and the values a chunk reduces alike go in
    one reduction of a tuple (the input's and the output's max, the sum and the squares;
    the centred squares need the mean after). Counted in the kernels as compiled for an
    sm_90 GPU: the row kernel's full tier with its output 2 reductions (was 8, with 16
    barriers), its sentinel tier 1 (was 4, 8 barriers), the gradient kernel's 1 (was 3,
    6 barriers). The kernel of the gradient through the norm (compiled code's, on
    full-tier steps only) reads a token three times: 8 reductions in all."""
    counts = compiled_for_sm90(_HOPPER)
    reductions = {name: c[0] for name, c in counts.items() if "tokens" not in name}
    assert reductions == {"full": 2, "sentinel": 1, "gradient": 1, "through": 8}, counts
    barriers = {name: c[1] for name, c in counts.items()}  # (at most half what they were)
    assert 0 < barriers["full"] <= 8 and 0 < barriers["sentinel"] <= 4 and \
        0 < barriers["gradient"] <= 3 and 0 < barriers["through"] <= 16, counts


def test_the_kernels_read_memory_in_16_byte_loads() -> None:
    """#48 item 3: the per-call and gradient kernels read a token in 16-byte vectors
    (``ld.global.v4.b32``: 8 bf16 a load), as compiled for an sm_90 GPU the way Triton's
    JIT specializes a 125M call: one load a thread a tensor with one token a program and
    4 warps, four with four tokens; the same reductions a chunk either way."""
    counts = compiled_for_sm90(_HOPPER)
    loads = {name: c[2] for name, c in counts.items() if name != "through"}
    assert loads == {"full": ["ld.global.v4.b32"] * 2, "sentinel": ["ld.global.v4.b32"] * 2,
                     "full, 4 tokens": ["ld.global.v4.b32"] * 8,
                     "gradient": ["ld.global.v4.b32"] * 2,
                     "gradient, 4 tokens": ["ld.global.v4.b32"] * 8}, counts
    assert counts["full, 4 tokens"][0] == 2 and counts["gradient, 4 tokens"][0] == 1, counts


def test_the_sentinel_tier_writes_the_extremes_only() -> None:
    x = hard(5, 64, torch.float32).to(DEVICE)
    for out in (None, x * 2):
        rows = row_stats_triton(x, out, full=False)
        assert rows.shape == (row_count(out is not None, False), 5)
        assert_rows_match(rows, row_stats_torch(x, out, full=False))


def test_zero_tokens_and_no_output() -> None:
    empty = torch.empty(0, 64, device=DEVICE)
    assert row_stats_triton(empty).shape == (5, 0)
    x = hard(5, 64, torch.float32).to(DEVICE)
    rows = row_stats_triton(x)
    assert rows.shape == (5, 5)  # extremes, then the moments: no output's rows
    assert_rows_match(rows, row_stats_torch(x))


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


@pytest.mark.parametrize("full", [True, False])
def test_fused_and_torch_paths_fold_to_the_same_statistics(full: bool) -> None:
    """The kernel's rows are folded as any call's: a layer norm's and an RMS norm's calls
    folded together give what torch's row reductions give."""
    calls: dict[str, list] = {"plain": [], "fused": []}  # type: ignore[type-arg]
    for i, kind in enumerate(["rmsnorm", "layernorm", "rmsnorm"]):
        x = hard(6, 256, torch.bfloat16).to(DEVICE) * (i + 1)
        y = torch.randn(6, 256, device=DEVICE).to(torch.bfloat16)
        y[5, 3] = float("inf")
        key = 42.0 + i
        calls["plain"].append(reduce_call(x, y, kind, 1e-5, full, i, key))  # type: ignore[arg-type]
        rows = LayerRows.of(layer(kind=kind, eps=1e-5, width=256), i)  # type: ignore[arg-type]
        calls["fused"].append(TRITON.call_rows(rows, x, y, key, full))
    a, b = (fold_calls(c, fold_plan(c, Limits())) for c in calls.values())
    for i in range(3):
        for name, va, vb in zip(COLUMNS, a[i].tolist(), b[i].tolist(), strict=True):
            if name in ("rms_min", "rms_max", "rms_sum", "sumsq_max", "eps_dominance"):
                assert va == pytest.approx(vb, rel=1e-4, abs=1e-6), (i, name)
            elif name != "common_mode_max":  # (max |x| for the min: extremes exact)
                assert va == pytest.approx(vb, rel=1e-6, abs=1e-9), (i, name)


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


def grad_rows_reference(g: torch.Tensor, part: torch.Tensor | None) -> torch.Tensor:
    """The gradient kernel's rows in float64: each token's L2 norm of ``g`` (plus ``part``),
    then its max |g| (NaN where it holds NaN/inf)."""
    t = g.double() if part is None else g.double() + part.double()
    peak = torch.where(torch.isfinite(t).all(1), t.abs().amax(1), float("nan"))
    return torch.stack([t.square().sum(1).sqrt(), peak])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [1, 3, 100, 2050])
@pytest.mark.parametrize("parts", [1, 2])
def test_gradient_kernel_matches_the_reference(dtype: torch.dtype, width: int,
                                               parts: int) -> None:
    g = hard(6, width, dtype).to(DEVICE)
    part = (torch.randn(6, width) * 3).to(dtype).to(DEVICE) if parts == 2 else None
    rows = torch.full((2, 6), -1.0, device=DEVICE)
    launch_grad(g, part, rows, 6, width)
    want = grad_rows_reference(g, part)
    assert_rows_match(rows, want)
    if width > 1:  # the token holding NaN and inf: NaN norm and peak; the others finite
        assert rows[:, 4].isnan().all() and rows[:, [0, 1, 2, 3, 5]].isfinite().all()


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # (interpreter)
def test_fused_gradients_fold_as_torchs_do() -> None:
    """Gradients read by the kernel (rowwise) and folded by the fold kernel (each block
    cell by one program: two backward passes into one cell, a layer's weight twice) give
    what torch's reductions and fold give: sums, peak max |g|, finite tokens; a gradient
    holding NaN keeps its peak out."""
    rows = LayerRows.of(layer(kind="rmsnorm", eps=1e-5, width=64), 0)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(3)
    grads = [(torch.randn(2, 4, 64, generator=gen) * s).to(DEVICE) for s in (1.0, 5.0, 0.5, 2.0)]
    grads[2][1, 3, 7] = float("nan")
    grads[3][0, 1] = 1e20  # finite, but its sum of squares overflows: a finite token
    where = [(0, OUT), (0, IN), (0, OUT), (1, OUT)]  # (layer, site): layer 0's output twice
    weights = [torch.randn(64, generator=gen).to(DEVICE) * s for s in (1.0, 3.0, 0.1)]
    staged: dict[str, list[GradRows]] = {"torch": [], "triton": []}
    for name, backend in (("torch", TORCH), ("triton", TRITON)):
        for g, (row, site) in zip(grads, where, strict=True):
            norms, lo, hi = backend.grad_rows(rows, site, g, None)
            staged[name].append(GradRows(norms, lo, hi, row, site, 64))
        for w, row in zip(weights, (0, 1, 0), strict=True):
            norms, lo, hi = backend.grad_rows(rows, WEIGHT, w, None)
            staged[name].append(GradRows(norms, lo, hi, row, WEIGHT, 1))
    assert all(s.rowwise for s in staged["triton"] if s.site != WEIGHT) and \
        not any(s.rowwise for s in staged["torch"])
    blocks = {}
    for name, how in (("torch", fold_grads), ("triton", fold_grads),
                      ("fused", TRITON.fold_grads)):
        grads_ = staged["torch" if name == "torch" else "triton"]
        block = _new_state(2, torch.device(DEVICE))
        plan = grad_plan(grads_, DEVICE)
        if name == "fused":
            assert fold_grads_fused(block.clone(), grads_, plan)  # the kernel's, not torch's
        how(block, grads_, plan)
        blocks[name] = block.cpu()
    for name in ("triton", "fused"):
        torch.testing.assert_close(blocks[name], blocks["torch"], rtol=1e-6, atol=0.0)
    at = {c: blocks["fused"][0, COLUMNS.index(c)].item() for c in COLUMNS}
    assert at["grad_out_tokens"] == 16 and at["grad_out_finite"] == 15  # one token NaN
    assert at["grad_out_absmax"] == pytest.approx(grads[0].abs().max().item())  # NaN's out
    assert at["grad_in_absmax"] == pytest.approx(grads[1].abs().max().item())
    kept = grads[2].double().clone()
    kept[1, 3] = 0.0  # the token holding NaN drops out of the sums
    want = grads[0].double().square().sum() + kept.square().sum()
    assert at["grad_out_sumsq"] == pytest.approx(want.item(), rel=1e-5)
    assert at["grad_out_elements"] == 15 * 64
    assert (at["weight_grads"], blocks["fused"][1, COLUMNS.index("weight_grads")].item()) == \
        (2, 1)
    assert at["weight_grad_sumsq"] == pytest.approx(
        (weights[0].double().square().sum() + weights[2].double().square().sum()).item(),
        rel=1e-5)
    layer1 = {c: blocks["fused"][1, COLUMNS.index(c)].item() for c in COLUMNS}
    assert layer1["grad_out_absmax"] == pytest.approx(1e20) and \
        layer1["grad_out_sumsq"] == float("inf")
    assert layer1["grad_out_finite"] == layer1["grad_out_tokens"] == 8


def test_watched_gradients_by_the_kernel_agree_with_torch() -> None:
    """Every gradient site of a watched model read by the kernel (the gradient through
    the norm in two parts, added as read) gives torch's statistics."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.Linear(64, 64),
                          nn.RMSNorm(64), nn.Linear(64, 4)).to(DEVICE)
    inputs = [torch.randn(3, 8, 16, device=DEVICE) * s for s in (1, 30, 1)]
    got = {}
    for kernel in ("triton", "torch"):
        w = normwatch.watch(model, kernel=kernel, stats_every=1, report_dir=None)
        for x in inputs:
            model(x).square().sum().backward()
            w.step()
        got[kernel] = w.flush().layers
        w.close()
    for name in ("1", "3"):
        g, want = got["triton"][name], got["torch"][name]
        for site in ("grad_out", "grad_in", "grad_hidden"):
            for stat in ("absmax", "rms"):
                value = getattr(want, f"{site}_{stat}")
                assert value is not None and value > 0, (name, site, stat)
                assert getattr(g, f"{site}_{stat}") == pytest.approx(value, rel=1e-5), \
                    (name, site, stat)
            assert getattr(g, f"{site}_nonfinite") == getattr(want, f"{site}_nonfinite") == 0
        assert g.weight_grad_norm == pytest.approx(want.weight_grad_norm, rel=1e-6)


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


def through_reference(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                      eps: float, centred: bool, one_plus_w: bool) -> torch.Tensor:
    """The gradient through a layer or RMS norm by float64 autograd (torch's own norm,
    differentiated): its rows as :func:`grad_rows_reference` writes them."""
    xd = x.double().requires_grad_(True)
    w = None if weight is None else weight.double() + (1.0 if one_plus_w else 0.0)
    shape = (x.shape[-1],)
    y = (torch.nn.functional.layer_norm(xd, shape, w, None, eps) if centred
         else torch.nn.functional.rms_norm(xd, shape, w, eps))
    (dx,) = torch.autograd.grad(y, xd, g.double())
    return grad_rows_reference(dx, None)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # (NaN, inf)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [3, 100, 2050])
@pytest.mark.parametrize("centred", [True, False])
@pytest.mark.parametrize("weight", ["none", "w", "1+w"])
def test_through_kernel_matches_float64_autograd(dtype: torch.dtype, width: int,
                                                 centred: bool, weight: str) -> None:
    """One launch gives the output's gradient's rows (as the gradient kernel's) and those
    of the gradient through the norm, against float64 autograd through torch's own
    norm; a token whose gradient or input holds a NaN or an inf has NaN rows there."""
    from normwatch.measure.backends.triton_kernel import launch_through

    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(6, width, generator=gen) * 3 + 1).to(dtype).to(DEVICE)
    g = torch.randn(6, width, generator=gen).to(dtype).to(DEVICE)
    w = None if weight == "none" else (torch.rand(width, generator=gen) + 0.5).to(DEVICE)
    rows = torch.full((2, 6), -1.0, device=DEVICE), torch.full((2, 6), -1.0, device=DEVICE)
    launch_through(g, x, w, *rows, 6, width, 1e-5, centred, weight == "1+w")
    assert_rows_match(rows[0], grad_rows_reference(g, None))
    assert_rows_match(rows[1], through_reference(g, x, w, 1e-5, centred, weight == "1+w"))
    g[4, 1], x[5, 0] = float("nan"), float("inf")
    launch_through(g, x, w, *rows, 6, width, 1e-5, centred, weight == "1+w")
    assert rows[0][:, 4].isnan().all() and rows[1][:, [4, 5]].isnan().all()
    assert rows[0][:, [0, 1, 2, 3, 5]].isfinite().all()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # (interpreter)
def test_compiled_gradients_through_the_norm_by_the_kernel_agree_with_torchs_formula(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled, the gradient through a norm comes from its output's by the formula
    (autograd's nodes are the graph's): where the kernel serves the layer, one launch
    reads the output's gradient and computes and reads the one through the norm (was a
    launch for each and a dozen torch ops between). Its statistics are those of torch's
    formula, the output's gradient's the same."""
    from normwatch.measure.backends import triton_kernel
    from normwatch.measure.backends.triton_kernel import TritonBackend

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.Linear(64, 64),
                         nn.RMSNorm(64), nn.Linear(64, 4)).to(DEVICE)
    inputs = [torch.randn(3, 8, 16, device=DEVICE) * s for s in (1, 30, 1)]
    launched = []
    real = triton_kernel.launch_through
    monkeypatch.setattr(triton_kernel, "launch_through",
                        lambda *a, **k: launched.append(1) or real(*a, **k))
    got = {}
    for kernel in (True, False):
        if not kernel:  # the formula by torch's ops, read by the gradient kernel
            monkeypatch.setattr(TritonBackend, "covers_through", lambda *a: False)
        model = copy.deepcopy(base)
        w = normwatch.watch(model, kernel="triton", stats_every=1, report_dir=None)
        run = torch.compile(model, backend="aot_eager")
        torch.compiler.reset()
        for x in inputs:
            run(x).square().sum().backward()
            w.step()
        torch.compiler.reset()
        got[kernel] = w.flush().layers
        w.close()
        if kernel:
            assert len(launched) == 2 * len(inputs)  # one a norm a step
            launched.clear()
    assert not launched
    for name in ("1", "3"):
        g, want = got[True][name], got[False][name]
        for site in ("grad_out", "grad_in"):
            for stat in ("absmax", "rms"):
                value = getattr(want, f"{site}_{stat}")
                assert value is not None and value > 0, (name, site, stat)
                assert getattr(g, f"{site}_{stat}") == pytest.approx(value, rel=1e-5), \
                    (name, site, stat)
        assert g.grad_gain == pytest.approx(want.grad_gain, rel=1e-5)
