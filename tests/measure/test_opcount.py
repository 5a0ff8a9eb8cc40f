"""The ops each norm call and each gradient dispatches stay within their budget (counted
by a dispatch mode: deterministic, unlike a timing). A change that adds an op to a hot
path fails here; ``docs/performance.md`` has the table (``tests/benchmarks/opcount.py``)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn

from normwatch.measure.backends.native.build import library, threaded
from normwatch.measure.backends.triton_kernel import usable
from tests.benchmarks import opcount
from tests.benchmarks.opcount import in_kernel

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
    # (16 tokens: the interpreter runs the kernel token by token, the ops are the same)
    first = opcount.forward_call(full=full, kernel="triton", tokens=16)
    assert dict(first.kernels) == {opcount.LAUNCH: 1, "empty": 1}, first.names()
    got = opcount.forward_call(full=full, kernel="triton", tokens=16, steady=True)
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
             "observe_grad": lambda: operators.observe_grad(x, row, 0, None, None)}
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
def test_the_cuda_paths_sentinel_call_runs_no_python_of_normwatch_but_the_launch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """#48: where the fused kernel serves a layer (CUDA; here Triton's interpreter), the
    C++ lane records a sentinel call, and normwatch's only Python left is the launch's
    (``lane_launch``, ``launch`` and its :class:`Launch`'s call; Triton's launch from
    Python, where there is no static launch from C++: ``test_triton_launch.py``): before,
    the hook, the recorder, the backend's choice, the lender and the staging ran some 20
    frames a call."""
    from normwatch.measure.backends import triton_kernel
    from normwatch.measure.backends.native import lane

    if lane.module() is None:
        pytest.skip("no C++ lane here (no C++ compiler, torch headers or C library)")
    monkeypatch.setattr(triton_kernel, "static_launch", lambda *args, **kwargs: None)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # (a GPU: the real launch)
    model = nn.Sequential(nn.Linear(64, 64), nn.RMSNorm(64), nn.RMSNorm(64)).to(device)
    x = torch.randn(8, 64, requires_grad=True, device=device)
    with opcount.watched(model, kernel="triton") as hook:
        hook.rt.update(full_stats=False, check_outputs=False)
        model(x)  # the interval's first calls (their dtypes noted), the lender filled
        hook.rt.accumulator.buffers.give_back()
        frames = opcount.frames_of(lambda: model(x))
        norms = [hook.rt.accumulator._staged[-k].row for k in (1, 2)]
    # the model's own hooks (the step's bookkeeping around its forward), then per norm
    launch = ["lane_launch", "launch", "__call__"]
    assert frames == ["_forward_begins", "forward", "mark", *launch, *launch,
                      "_forward_ends"], frames
    assert sorted(norms) == [0, 1]


@pytest.mark.skipif(not usable(), reason="Triton cannot run here")
def test_the_cuda_paths_full_tier_step_runs_no_python_of_normwatch_but_its_launches(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """#48: on a full-tier step of the fused kernel's path (CUDA; here Triton's
    interpreter), the C++ lane records each call and places its gradient hooks (the
    norm's own nodes found in C++), and the C++ gradient hooks read each norm's
    output's gradient, the hidden state's and the one through the norm with a launch each
    as their only Python (``lane_grad_launch``, ``launch_grad``, its :class:`Launch`'s
    call), and the weight's norm
    with none (Triton's launches from Python, where there is no static launch from C++:
    ``test_triton_launch.py``). Before, each call's hooks were placed by Python (some 20
    frames a norm) and each site ran the Python hook, the backend's choice, the lender and
    the staging (some 50 frames a norm)."""
    import os
    import sys

    import normwatch
    from normwatch.measure.backends.native import lane

    if lane.module() is None:
        pytest.skip("no C++ lane here (no C++ compiler, torch headers or C library)")
    from normwatch.measure.backends import triton_kernel

    monkeypatch.setattr(triton_kernel, "static_launch", lambda *args, **kwargs: None)
    home = os.path.dirname(normwatch.__file__)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # (a GPU: the real launch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.RMSNorm(64), nn.RMSNorm(64)).to(device)
    x = torch.randn(8, 64, requires_grad=True, device=device)
    watch = normwatch.watch(model, report_dir=None, early_warning=False, kernel="triton",
                            stats_every=1, flush_every=1000)
    frames: list[str] = []

    def profile(frame: Any, event: str, arg: object) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(home) and \
                not in_kernel(frame):  # (the interpreter's run)
            frames.append(frame.f_code.co_name)

    forward: list[str] = []
    try:
        for step in range(3):
            if step == 2:
                watch._measure._hooks[0].rt.accumulator.commit()  # (the lender filled)
                sys.setprofile(profile)
            try:
                loss = model(x).square().mean()
            finally:
                sys.setprofile(None)
            forward, frames[:] = frames[:], []
            if step == 2:
                sys.setprofile(profile)
            try:
                loss.backward()
            finally:
                sys.setprofile(None)
            staged = list(watch._measure._hooks[0].rt.accumulator._staged_grads)
            watch.step()
    finally:
        watch.close()
    # per norm: three sites read by a launch each (the gradient through the norm's parts
    # added as it is read), the weight by torch's norm in C++: nothing else of Python's
    assert frames == ["lane_grad_launch", "launch_grad", "__call__"] * 6, frames
    # the forward's calls as a sentinel step's, their gradient hooks placed in C++; the
    # step's bookkeeping around them (a full-tier step notes the RNG's state)
    assert forward == ["_forward_begins", "forward", "rng_states", "_integer_tensors",
                       "_integer_tensors", "mark", "lane_launch", "launch", "__call__",
                       "lane_launch", "launch", "__call__", "_forward_ends"], repr(forward)
    assert sorted((g.layer, g.site) for g in staged) == sorted(
        (row, site) for row in (0, 1) for site in range(4)), staged


def _lines_per_phase(depth: int, stats_every: int = 10**6, steps: int = 6
                     ) -> list[dict[str, Counter[tuple[str, int]]]]:
    """normwatch's Python lines (function, line) run in each phase of each of ``steps``
    training steps (the last steady) of a :class:`TinyLM` of ``depth`` blocks on the fused
    kernel's path, full-tier every ``stats_every`` steps, the early warning folding each
    step as on CUDA, the launches stubbed out (in Triton's interpreter the kernels'
    Python is the interpreter's, not the GPU's)."""
    import copy
    import functools
    import os
    import sys

    import normwatch
    from normwatch.demos.toymodel import TinyLM, lm_loss, synthetic_batch
    from normwatch.measure.step.early import EarlyWarning
    from tests.benchmarks.host import stubbed

    home = os.path.dirname(normwatch.__file__)
    demos = os.path.join(home, "demos")  # (the model's own)
    torch.manual_seed(0)
    model = copy.deepcopy(TinyLM(dim=32, depth=depth))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    w = normwatch.watch(model, optimizer, kernel="triton", report_dir=None,
                        stats_every=stats_every, flush_every=10**6)
    w._early = EarlyWarning(w.config.limits.fp16_limit, opcount._Landed, pin=False)
    each: list[dict[str, Counter[tuple[str, int]]]] = []

    def traced(phase: str, run: Any) -> Any:
        seen = each[-1].setdefault(phase, Counter())

        def trace(frame: Any, event: str, arg: object) -> Any:
            code = frame.f_code
            if not code.co_filename.startswith(home) or code.co_filename.startswith(demos):
                return None
            if event == "line":
                seen[code.co_name, frame.f_lineno] += 1
            return trace

        sys.settrace(trace)
        try:
            return run()
        finally:
            sys.settrace(None)

    try:
        with stubbed():
            for i in range(steps):
                each.append({})
                batch = synthetic_batch(torch.Generator().manual_seed(i), batch=2, seq=8)
                loss = traced("forward", functools.partial(lambda b: lm_loss(model(b), b),
                                                           batch))
                traced("backward", loss.backward)
                traced("optimizer", optimizer.step)
                optimizer.zero_grad()
                traced("watch.step", functools.partial(w.step, loss))
    finally:
        w.close()
    return each


@pytest.mark.skipif(not usable(), reason="Triton cannot run here")
def test_the_cuda_paths_sentinel_step_runs_no_python_per_norm_but_its_launches() -> None:
    """#48: "nothing per tensor or per layer in Python on a step". On the fused kernel's
    path a steady sentinel step of a model with 9 norms runs the same lines of
    normwatch's Python as one with 5, but each call's launch (``lane_launch``'s line, the
    launches stubbed out): the step's commit groups its calls, looks up the fold's plan, gathers
    the rows and gives the buffers back, the early warning polls its copy and the update
    monitor reads its samples by C's iterators (each was a loop of Python a norm or a
    tensor: 17 lines a norm and 2 a parameter, counted before)."""
    from normwatch.measure.backends.native import lane

    if lane.module() is None:
        pytest.skip("no C++ lane here (no C++ compiler, torch headers or C library)")
    small, large = _lines_per_phase(2)[-1], _lines_per_phase(4)[-1]
    for phase in ("forward", "backward", "optimizer", "watch.step"):
        more = large[phase] - small[phase]
        assert {name for name, _ in more} <= {"lane_launch"}, (phase, more)
        assert not (small[phase] - large[phase]), phase
    assert large["forward"] and large["watch.step"] and large["optimizer"]


@pytest.mark.skipif(not usable(), reason="Triton cannot run here")
def test_the_cuda_paths_tiers_change_with_no_python_per_norm_but_launches() -> None:
    """#48: on the fused kernel's path, with a full-tier step every other step, a
    full-tier step and the sentinel step after it each run the same lines of normwatch's
    Python for a model with 9 norms as for one with 5, but the launches (a call's, a
    gradient site's): the C++ weight hooks stay armed between measured steps (returning
    at once on the others) where Python ones were registered and removed, a layer at a
    time, at each change of tier."""
    from normwatch.measure.backends.native import lane

    if lane.module() is None:
        pytest.skip("no C++ lane here (no C++ compiler, torch headers or C library)")
    small, large = (_lines_per_phase(depth, stats_every=2, steps=8)[-2:] for depth in (2, 4))
    launches = {"forward": {"lane_launch"}, "backward": {"lane_grad_launch"}}
    for step, tier in enumerate(("full", "sentinel")):
        for phase in ("forward", "backward", "optimizer", "watch.step"):
            more = large[step][phase] - small[step][phase]
            assert {name for name, _ in more} <= launches.get(phase, set()), (tier, phase, more)
            assert not (small[step][phase] - large[step][phase]), (tier, phase)
    assert large[0]["backward"] and not large[1]["backward"]  # (the tiers as said)

