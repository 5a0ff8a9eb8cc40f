"""The ops each norm call and each gradient dispatches stay within their budget (counted
by a dispatch mode: deterministic, unlike a timing). A change that adds an op to a hot
path fails here; ``docs/performance.md`` has the table (``tests/benchmarks/opcount.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from normwatch.measure.backends.native.build import library, threaded
from normwatch.measure.backends.triton_kernel import usable
from tests.benchmarks import opcount

NATIVE = library() is not None
"""Whether the CPU sentinel's compiled kernel runs here (a C compiler is on PATH)."""
THREADED = threaded()
"""Whether it shares torch's threads (then it reads float32 past torch's grain too)."""

BUDGETS = {  # path: (kernels, views), as measured on 2026-12-01 (the sentinel: 12-02;
    # the eager gradients' views: 12-03, read without a detach)
    "sentinel": ((lambda: opcount.forward_call()), (2 if THREADED else 5, 2)),
    "sentinel bf16 layernorm": ((lambda: opcount.forward_call("layernorm",
                                                              dtype=torch.bfloat16)),
                                (2 if NATIVE else 5, 2)),
    "sentinel, torch's reductions": ((lambda: opcount.forward_call(kernel="torch")), (5, 2)),
    "full rmsnorm": ((lambda: opcount.forward_call(full=True)), (2 if THREADED else 7, 2)),
    "full layernorm": ((lambda: opcount.forward_call("layernorm", full=True)),
                       (2 if THREADED else 10, 6)),
    "full layernorm bf16": ((lambda: opcount.forward_call("layernorm", True, torch.bfloat16)),
                            (2 if NATIVE else 11, 6)),
    "full rmsnorm, torch's reductions": ((lambda: opcount.forward_call(full=True,
                                                                       kernel="torch")),
                                         (7, 2)),
    "full layernorm, torch's reductions": ((lambda: opcount.forward_call(
        "layernorm", full=True, kernel="torch")), (10, 6)),
    "full layernorm bf16, torch's reductions": ((lambda: opcount.forward_call(
        "layernorm", True, torch.bfloat16, kernel="torch")), (11, 6)),
    "grad_out": ((lambda: opcount.gradient("grad_out")), (2, 0 if NATIVE else 1)),
    "grad_in": ((lambda: opcount.gradient("grad_in")), (2, 0 if NATIVE else 1)),
    "grad_in in two parts": ((lambda: opcount.gradient("grad_in", parts=2)),
                             (2 if THREADED else 3, 2)),
    "grad_hidden bf16": ((lambda: opcount.gradient("grad_hidden", dtype=torch.bfloat16)),
                         (2, 0 if NATIVE else 1)),
    "grad_out, torch's reductions": ((lambda: opcount.gradient("grad_out", kernel="torch")),
                                     (2, 1)),
    "grad_in in two parts, torch's reductions": ((lambda: opcount.gradient(
        "grad_in", parts=2, kernel="torch")), (3, 2)),
    "weight gradient": ((lambda: opcount.gradient("weight")), (2, 0) if NATIVE else (1, 1)),
    "compiled sentinel": ((lambda: opcount.compiled_call()), (6, 0 if NATIVE else 2)),
    "compiled full": ((lambda: opcount.compiled_call(full=True)), (8, 0 if NATIVE else 2)),
    "compiled grad_out": ((lambda: opcount.compiled_grad(False)), (3, 1)),
    "compiled grad_out + grad_in": ((lambda: opcount.compiled_grad(True)),
                                    (4, 1) if NATIVE else (17, 7)),  # (C: 2026-12-03)
    "grad_out + grad_in computed": ((lambda: opcount.computed()),
                                    (3, 0) if NATIVE else (16, 6)),
}


@pytest.mark.parametrize("path", list(BUDGETS))
def test_each_path_stays_within_its_op_budget(path: str) -> None:
    measure, (kernels, views) = BUDGETS[path]
    got = measure()
    assert got.n_kernels <= kernels and got.n_views <= views, (got.names(), got.views)


@pytest.mark.skipif(not NATIVE, reason="no C compiler: the sentinel runs torch's reductions")
def test_the_cpu_sentinel_full_tier_and_gradients_are_one_call_into_one_buffer() -> None:
    """16-bit activations, and float32 ones below torch's grain size, or past it where
    the kernel shares torch's threads (see
    :data:`normwatch.measure.backends.native.readers.GRAIN`)."""
    cases = [("rmsnorm", torch.float32, 64), ("layernorm", torch.bfloat16, 512),
             ("layernorm", torch.float16, 512)] + [("rmsnorm", torch.float32, 512),
                                                   ("layernorm", torch.float32, 512)] * THREADED
    for kind, dtype, tokens in cases:
        for full in (False, True):  # the full tier's moments in the same call
            got = opcount.forward_call(kind, full, dtype=dtype, tokens=tokens)
            assert dict(got.kernels) == {opcount.NATIVE: 1, "empty": 1}, \
                (kind, dtype, full, got.names())
    sites = [("grad_out", torch.bfloat16, 1), ("grad_in", torch.float16, 2)] + \
        [("grad_hidden", torch.float32, 1), ("grad_in", torch.float32, 2)] * THREADED
    for site, dtype, parts in sites:  # a gradient: one pass, its parts added as it reads
        got = opcount.gradient(site, dtype=dtype, parts=parts)
        assert dict(got.kernels) == {opcount.NATIVE: 1, "empty": 1}, (site, got.names())


def test_the_sentinel_is_four_row_reductions_stacked_and_a_gradient_two() -> None:
    """What the budgets are made of without the compiled kernel (the fastest torch
    kernels: one-pass ``aminmax`` or an inf-norm along rows run 5-8x slower on the CPU,
    docs/performance.md)."""
    assert dict(opcount.forward_call(kernel="torch").kernels) == {"amax": 2, "amin": 2,
                                                                  "stack": 1}
    assert dict(opcount.gradient("grad_out", kernel="torch").kernels) == {
        "aminmax": 1, "linalg_vector_norm": 1}


@pytest.mark.skipif(not usable(), reason="Triton cannot run here")
@pytest.mark.parametrize("full", [False, True])
def test_the_fused_kernel_is_one_launch_per_call(full: bool) -> None:
    """The CUDA path's call: one launch into a lent buffer, no other op, no view; the
    first step's calls allocate their buffers, later steps' borrow them."""
    first = opcount.forward_call(full=full, kernel="triton")
    assert dict(first.kernels) == {opcount.LAUNCH: 1, "empty": 1}, first.names()
    got = opcount.forward_call(full=full, kernel="triton", steady=True)
    assert dict(got.kernels) == {opcount.LAUNCH: 1} and got.n_views == 0, \
        (got.names(), got.views)


def test_the_counter_sees_an_added_op() -> None:
    """The counter itself: a hook that adds one reduction shows one more kernel."""
    norm = torch.nn.RMSNorm(8)
    x = torch.randn(4, 8)
    plain = opcount.count(lambda: norm(x))
    handle = norm.register_forward_hook(lambda m, a, y: y.sum())
    try:
        hooked = opcount.count(lambda: norm(x))
    finally:
        handle.remove()
    assert (hooked - plain).n_kernels == 1 and dict((hooked - plain).kernels) == {"sum": 1}


CROSS_LAYER = 20
"""#48's budget for a step's cross-layer work (the optimizer's hooks and the guard, the
step's folds, the early warning's copy, the flush), kernels and views: a few launches
and the ops around them, however many layers and tensors."""
NORMS = 5  # TinyLM(depth=2)


@pytest.mark.skipif(not usable(), reason="Triton cannot run here")
@pytest.mark.parametrize("guard", [False, True], ids=["watch(model, optimizer)", "guard"])
def test_the_cuda_paths_whole_step_stays_within_its_op_budget(guard: bool) -> None:
    """Forward, backward, the optimizer's step and ``watch.step`` of a watched model on the
    fused kernel, each tier in steady state, against an unwatched copy: #48's budgets per
    norm call (≤ 2 host ops on a sentinel step, ≤ 6 on a full-tier step with its
    gradients): one launch per call and one per gradient site, the weight's gradient one
    norm; and ≤ 20 for the step's cross-layer work: the update monitor's sample one
    launch, the guard's check of the rows and gradients one more, the step's folds two
    or three."""
    found = opcount.step(guard=guard, flush_every=4)
    assert set(found) == {"sentinel", "full", "flush"}
    for tier, parts in found.items():
        forward, backward = parts["forward"], parts["backward"]
        assert dict(forward.kernels) == {opcount.LAUNCH: NORMS} and not forward.n_views, \
            (tier, forward.names())  # one launch per norm call, nothing else
        if tier == "full":  # grad_out, grad_in, grad_hidden: a launch each; the weight's
            assert dict(backward.kernels) == {opcount.LAUNCH: 3 * NORMS,
                                              "linalg_vector_norm": NORMS}, backward.names()
        else:
            assert not backward.n_kernels, (tier, backward.names())
        assert not backward.n_views, (tier, backward.views)
        per_call = (forward.n_kernels + forward.n_views + backward.n_kernels) / NORMS
        assert per_call <= (6 if tier == "full" else 2), (tier, per_call)
        # the step's folds: its calls' and their accumulation, a full tier's gradients'
        assert parts["watch.step"].kernels[opcount.LAUNCH] == (3 if tier == "full" else 2), \
            (tier, parts["watch.step"].names())
        assert parts["optimizer"].kernels[opcount.LAUNCH] == 1 + guard, \
            (tier, parts["optimizer"].names())
        cross = parts["optimizer"] + parts["watch.step"]
        assert cross.n_kernels + cross.n_views <= CROSS_LAYER, (tier, cross.names(),
                                                                cross.views)


def test_a_compiled_operator_call_is_its_body_and_no_python_around_it() -> None:
    """What a compiled graph's call of ``normwatch::observe`` or ``::observe_grad`` runs
    in Python: the body and the owner's lookup, no wrapper of torch's (a ``custom_op``'s
    autograd, in-place and default-filling wrappers ran ten frames a call: 17.8 µs
    against 1.8 µs on this machine, 2026-12-06)."""
    import sys

    from normwatch.measure.layer import operators

    x, row, ticket = torch.ones(4, 8), torch.zeros(3), torch.zeros(1)  # row: owned by none
    calls = {"observe": lambda: operators.observe(x, x, row, ticket, True),
             "observe_grad": lambda: operators.observe_grad(x, row, "grad_out", None, None)}
    frames: list[str] = []

    def profile(frame: object, event: str, arg: object) -> None:
        if event == "call":
            frames.append(frame.f_code.co_name)  # type: ignore[attr-defined]

    for name, call in calls.items():
        call()  # (first calls load what they need)
        frames.clear()
        sys.setprofile(profile)
        try:
            call()
        finally:
            sys.setprofile(None)
        # the lambda, the operator's __call__, the body and the owners' lookup
        assert frames[2] == f"_{name}" and len(frames) <= 4, (name, frames)


@pytest.mark.skipif(not usable(), reason="Triton cannot run here")
def test_the_cuda_paths_sentinel_call_runs_no_python_of_normwatch_but_the_launch() -> None:
    """#48: where the fused kernel serves a layer (CUDA; here Triton's interpreter), the
    C++ lane records a sentinel call, and normwatch's only Python left is the launch's
    (``lane_launch``, ``launch``): before, the hook, the recorder, the backend's choice,
    the lender and the staging ran some 20 frames a call."""
    import os
    import sys

    import normwatch
    from normwatch.measure.backends.native import lane

    if lane.module() is None:
        pytest.skip("no C++ lane here (no C++ compiler, torch headers or C library)")
    home = os.path.dirname(normwatch.__file__)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # (a GPU: the real launch)
    model = nn.Sequential(nn.Linear(64, 64), nn.RMSNorm(64), nn.RMSNorm(64)).to(device)
    x = torch.randn(8, 64, requires_grad=True, device=device)
    with opcount.watched(model, kernel="triton") as hook:
        hook.rt.update(full_stats=False, check_outputs=False)
        model(x)  # the interval's first calls (their dtypes noted), the lender filled
        hook.rt.accumulator.buffers.give_back()
        frames: list[str] = []

        def profile(frame: Any, event: str, arg: object) -> None:
            if event == "call" and frame.f_code.co_filename.startswith(home) and \
                    not frame.f_code.co_name.endswith("_kernel"):  # (the interpreter's run)
                frames.append(frame.f_code.co_name)

        sys.setprofile(profile)
        try:
            model(x)
        finally:
            sys.setprofile(None)
        norms = [hook.rt.accumulator._staged[-k].row for k in (1, 2)]
    # the model's own hooks (the step's bookkeeping around its forward), then per norm
    assert frames == ["_forward_begins", "forward", "mark", "lane_launch", "launch",
                      "lane_launch", "launch", "_forward_ends"], frames
    assert sorted(norms) == [0, 1]
