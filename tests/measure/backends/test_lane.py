"""The lanes in C++ (normwatch.measure.backends.native.lane): registered where they are
built, the Python hooks where they are not; a failure in one disables its hook as the
Python hook's would; copies of a watched model keep working. The gradients' hooks in C++
read what the Python hooks read, with none of their Python. That the forward lane records
as the recorder does: tests/measure/layer/test_hooks.py::test_the_lane_measures_as_the_
general_path; that compiled models trace the Python hook in its place:
tests/measure/layer/test_compile.py."""

from __future__ import annotations

import copy
import functools
import shutil
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import normwatch
from normwatch.measure.backends.native import build
from normwatch.measure.backends.native import lane as fastlane
from normwatch.measure.layer.compiled import CompiledPath
from normwatch.measure.layer.hooks import LayerHook
from normwatch.measure.layer.recorder import Recorder
from tests.benchmarks.overhead import tiny_llama, train_step


@pytest.fixture
def built() -> object:
    module = fastlane.module()
    if module is None:
        pytest.skip("no C++ lane here (no C++ compiler, torch headers or C library)")
    return module


@pytest.fixture
def rebuilt() -> Iterator[None]:
    """``fastlane.module`` asked again in the test, and again after it (first among a
    test's fixtures: after its monkeypatch is undone)."""
    fastlane.module.cache_clear()
    yield
    fastlane.module.cache_clear()


def test_the_lane_builds_where_there_is_a_cpp_compiler() -> None:
    """Where the C library builds and a C++ compiler is on PATH, the lane builds (its
    compiler's errors shown): a lane that stopped compiling is no silent skip."""

    if build.library() is None or shutil.which("c++") is None:
        pytest.skip("no C library or no C++ compiler")
    path = build.lane_path()  # (raises with the compiler's output where it fails)
    assert path.exists() and fastlane.module() is not None


def _registered(model: torch.nn.Module) -> list[object]:
    return [h for m in model.modules() for h in m._forward_hooks.values()
            if isinstance(h, LayerHook) or (isinstance(h, functools.partial)
                                            and isinstance(h.args[0], LayerHook))]


def _pre_registered(model: torch.nn.Module) -> list[object]:
    """The forward pre-hooks of the model's norms (normwatch registers none on a layer:
    compiled code hooks the hidden state from the forward hook)."""
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert len(norms) == 3
    return [h for m in norms for h in m._forward_pre_hooks.values()]


def test_the_lane_is_registered_where_it_is_built_and_the_python_hook_elsewhere(
        rebuilt: None, built: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward hooks: the lane's where it is built and the C reader is used, else
    the Python ones; no pre-hook on a layer either way."""
    model = tiny_llama(32, 1)
    w = normwatch.watch(model, report_dir=None)
    hooks = _registered(model)
    assert len(hooks) == 3 and all(isinstance(h, functools.partial) and h.func is built.hook  # type: ignore[attr-defined]
                                   for h in hooks)
    assert not _pre_registered(model)
    w.close()
    assert not _registered(model) and not _pre_registered(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = normwatch.watch(model, report_dir=None, kernel="torch")  # (no C reader)
    assert [type(h) for h in _registered(model)] == [LayerHook] * 3
    assert not _pre_registered(model)
    w.close()
    monkeypatch.setenv("NORMWATCH_LANE", "0")
    fastlane.module.cache_clear()
    assert fastlane.module() is None
    w = normwatch.watch(model, report_dir=None)
    assert [type(h) for h in _registered(model)] == [LayerHook] * 3
    assert not _pre_registered(model)
    w.close()


def test_without_a_cpp_compiler_there_is_no_lane(
        rebuilt: None, monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    monkeypatch.setenv("NORMWATCH_CACHE", str(tmp_path))  # (nothing built there)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr("shutil.which", lambda name: None)
    monkeypatch.setattr(build, "library", lambda: object())  # (the C one is)
    assert fastlane.module() is None


def _python_recorded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the layers whose calls the Python recorder records from now on."""
    names: list[str] = []
    real = Recorder.record

    def spy(self: Recorder, *args: object) -> None:
        names.append(self.layer.name)
        return real(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(Recorder, "record", spy)
    return names


@pytest.mark.parametrize("compiled", [False, True])
def test_a_failure_in_the_lane_disables_its_hook_with_one_warning(
        built: object, compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A call the C++ lane takes fails (a host count it cannot add to): that layer's hook
    is removed with one warning, the other layers are measured on, and the losses are an
    unwatched run's. So where the call is a compiled graph's (the lane its operator's
    body), against an unwatched compiled copy."""
    torch.manual_seed(0)
    base = tiny_llama(32, 1)
    plain, model = base, copy.deepcopy(base)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, model)]
    tokens = torch.randint(0, 1024, (2, 8), generator=torch.Generator().manual_seed(0))
    w = normwatch.watch(model, report_dir=None, stats_every=1 << 20, gradients=False,
                        flush_every=100)
    python_lane = _python_recorded(monkeypatch)
    runs = [torch.compile(m, backend="aot_eager") if compiled else m for m in (plain, model)]
    losses: list[list[float]] = [[], []]
    caught = []
    torch.compiler.reset()
    try:
        for step in range(6):
            if step == 2:  # each layer has counted calls: the lane takes the next
                target = w._measure._hooks[0]
                target.counts.tokens = None  # type: ignore[assignment]
                python_lane.clear()
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                for i, (r, o) in enumerate(zip(runs, opts, strict=True)):
                    losses[i].append(train_step(r, o, tokens, w if i else None).item())
            caught += [str(x.message) for x in seen if "normwatch" in str(x.message)]
    finally:
        torch.compiler.reset()
    assert losses[0] == losses[1]
    assert len(caught) == 1 and repr(target.layer.name) in caught[0] and "TypeError" in caught[0]
    assert target.disabled_reason is not None and "TypeError" in target.disabled_reason
    assert target.layer.name not in python_lane  # it failed in C++, not in the recorder
    layers = w.flush().layers
    others = [h.layer.name for h in w._measure._hooks[1:]]
    assert all(layers[name].calls == 6 for name in others)
    w.close()


def test_a_copy_of_a_watched_model_runs_on_the_python_hook(built: object) -> None:
    """``copy.deepcopy`` of a watched model (an EMA copy) copies its hooks, each without
    the lane's state: its calls go to the copied Python hook, as before the lane."""
    model = tiny_llama(32, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = normwatch.watch(model, opt, report_dir=None)
    tokens = torch.randint(0, 1024, (2, 8))
    train_step(model, opt, tokens, w)
    ema = copy.deepcopy(model)
    hooks = _registered(ema)
    assert hooks and all(h.args[0]._lane_state is None for h in hooks)  # type: ignore[attr-defined]
    assert all(h.args[0].grads._lane is None for h in hooks)  # type: ignore[attr-defined]
    with torch.no_grad():
        ema(tokens)
    train_step(model, opt, tokens, w)
    assert all(h.disabled_reason is None for h in w._measure._hooks)
    w.close()


def test_a_model_not_on_the_cpu_builds_no_lane(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lane reads CPU tensors only: a model elsewhere (here on the meta device, placed
    at its first call) asks for no build, and its hooks are the Python ones."""

    def refused() -> None:
        raise AssertionError("a lane was asked for")

    monkeypatch.setattr(fastlane, "module", refused)
    with torch.device("meta"):
        model = tiny_llama(32, 1)
    w = normwatch.watch(model, report_dir=None)
    assert [type(h) for h in _registered(model)] == [LayerHook] * 3
    w.close()


def test_the_gradients_are_read_in_cpp_as_the_python_hooks_read_them(
        built: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two copies of one model, one watched with the gradients' C++ hooks, one with the
    Python hooks: every gradient statistic of every flush is the same (the same C
    readers, plans and staging order), the losses too, and the C++ hooks never called the
    Python hooks' methods (the plain case throughout: hidden state, output and through
    the norm, weight)."""
    from normwatch.measure.layer.gradients import GradHooks

    torch.manual_seed(0)
    base = tiny_llama(32, 2)
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    watches = [normwatch.watch(models[0], opts[0], report_dir=None, stats_every=1,
                               flush_every=100)]
    monkeypatch.setattr(fastlane, "grad_lane", lambda *a, **k: None)
    watches.append(normwatch.watch(models[1], opts[1], report_dir=None, stats_every=1,
                                   flush_every=100))
    monkeypatch.undo()
    lanes = [[h.grads._lane for h in w._measure._hooks] for w in watches]  # type: ignore[union-attr]
    assert all(lane is not None for lane in lanes[0]) and not any(lanes[1])
    python = {id(h.grads): i for i, w in enumerate(watches) for h in w._measure._hooks}
    calls = [0, 0]
    for name in ("_node", "_both", "_weight_grad", "_hidden", "_out"):
        def spy(self: GradHooks, *args: object, _real: object = getattr(GradHooks, name)
                ) -> object:
            calls[python[id(self)]] += 1
            return _real(self, *args)  # type: ignore[operator]
        monkeypatch.setattr(GradHooks, name, spy)
    tokens = torch.randint(0, 1024, (2, 8), generator=torch.Generator().manual_seed(0))
    losses: list[list[float]] = [[], []]
    for _ in range(3):
        for i in (0, 1):
            losses[i].append(train_step(models[i], opts[i], tokens, watches[i]).item())
    assert losses[0] == losses[1]
    assert calls[0] == 0 and calls[1] > 0
    snaps = [w.flush() for w in watches]
    fields = ("grad_out_rms", "grad_out_absmax", "grad_in_rms", "grad_hidden_rms",
              "grad_hidden_absmax", "grad_gain", "weight_grad_norm")
    for name, want in snaps[1].layers.items():
        got = snaps[0].layers[name]
        assert want.grad_out_rms and want.weight_grad_norm  # measured
        for field in fields:
            assert getattr(got, field) == getattr(want, field), (name, field)
    for w in watches:
        w.close()


def test_the_lanes_borrow_and_stage_with_no_python_frame(built: object) -> None:
    """Past each layer's first call of an interval, the C++ lanes (the forward's, the
    gradients') run the lender's and the accumulator's common case themselves (a free
    buffer lent: from the second interval on, the calls' buffers given back at the first
    one's fold), and the forward's lane hooks a full-tier call's gradients and checks its
    dtypes itself: no frame of ``RowBuffers.take``, ``Accumulator.stage``,
    ``.stage_grad``, ``LayerHook._tail`` or what it calls (the recorder's rest of a call,
    the gradient hooks' placing, the walk over a norm's nodes), nor of the compiled
    path's ``CompiledPath.trace`` (traced code only) in three steps of both tiers,
    yet every call and gradient is staged (what they stage, against the recorder's:
    tests/measure/layer/test_hooks.py::test_the_lane_measures_as_the_general_path)."""
    from normwatch.measure.layer.gradients import GradHooks, through_nodes
    from normwatch.measure.state.accumulator import Accumulator
    from normwatch.measure.state.buffers import RowBuffers

    torch.manual_seed(0)
    model = tiny_llama(32, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = normwatch.watch(model, opt, report_dir=None, stats_every=2, flush_every=100)
    tokens = torch.randint(0, 1024, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(4):  # an interval: buffers lent, then free again at its flush
        train_step(model, opt, tokens, w)
    w.flush()
    train_step(model, opt, tokens, w)  # (the interval's first calls: the Python lane's)
    python = (RowBuffers.take, Accumulator.stage, Accumulator.stage_grad, LayerHook._tail,
              Recorder.after, Recorder.watch_grads, Recorder.record_dtypes, Recorder.record,
              GradHooks.watch_call, GradHooks.computes, GradHooks.watch_weight,
              through_nodes, CompiledPath.trace)
    codes = {f.__code__: f.__qualname__ for f in python}
    seen: list[str] = []
    committed = [0]
    accumulator = w._measure._rt.accumulator
    real = accumulator.commit_grads

    def commit_grads(step_over: bool = False) -> None:
        committed[0] += len(accumulator._staged_grads)
        real(step_over)

    accumulator.commit_grads = commit_grads  # type: ignore[method-assign]

    def profile(frame: object, event: str, arg: object) -> None:
        if event == "call" and frame.f_code in codes:  # type: ignore[attr-defined]
            seen.append(codes[frame.f_code])  # type: ignore[attr-defined]

    sys.setprofile(profile)
    try:
        for _ in range(3):  # (two tiers by turns: the first interval's buffers fit)
            train_step(model, opt, tokens, w)
    finally:
        sys.setprofile(None)
    assert seen == []
    norms = len(w._measure._hooks)
    assert len(accumulator._staged) == 4 * norms  # every call of the interval's steps
    assert committed[0] >= 3 * norms  # a full-tier step's gradients: 3+ per norm
    snapshot = w.flush()
    assert all(s.calls == 4 and s.grad_out_rms for s in snapshot.layers.values())
    w.close()


class _TwoDtypes(torch.nn.Module):
    """One RMS norm called twice a step: on a bfloat16 input (the Python tail's), then on
    a float32 one (the C++ lane's full-tier tail)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.norm = torch.nn.RMSNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return self.norm(self.norm(h.bfloat16()).float() + h)


def _dtypes_run(monkeypatch: pytest.MonkeyPatch, cpp: bool) -> tuple[list[str], int]:
    """The norm's host counts after each step of a full-tier loop, and how many of its
    calls the Python ``_tail`` took past each interval's first (from step 3)."""
    real_state, real_tail = fastlane.state, LayerHook._tail
    tails = [0]

    def tail(self: LayerHook, *args: object) -> None:
        tails[0] += self.counts.calls > 1
        real_tail(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(fastlane, "state", lambda *a: real_state(*a) if cpp else None)
    torch.manual_seed(0)
    model = _TwoDtypes()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    w = normwatch.watch(model, opt, stats_every=1, flush_every=100, report_dir=None)
    (hook,) = w._measure._hooks
    counts = []
    for step in range(6):
        if step == 3:  # from here the Python tail is counted
            monkeypatch.setattr(LayerHook, "_tail", tail)
        with torch.autocast("cpu", torch.bfloat16, enabled=step >= 4):
            loss = model(torch.randn(4, 8)).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        w.step()
        counts.append(repr(hook.counts))
    w.close()
    monkeypatch.undo()
    return counts, tails[0]


def test_the_lane_notes_a_full_tier_calls_dtypes_where_they_changed(
        built: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C++ lane notes a full-tier call's dtypes (the recorder's record_dtypes) where
    they differ from the last it noted, or the layer's Python noted others since (a
    bfloat16 call of the same norm between), or autocast was turned on: step by step, the
    host counts are the Python hook's (whose last call of a step is the float32 one). The
    bfloat16 call's rest is Python's ``_tail``, the float32 one's the lane's own."""
    cpp, tails = _dtypes_run(monkeypatch, True)
    python, python_tails = _dtypes_run(monkeypatch, False)
    assert cpp == python
    assert all("input_dtype='float32'" in c for c in cpp)
    assert "cpu:bfloat16" in cpp[-1] and "cpu:bfloat16" not in cpp[3]
    assert tails == 3 and python_tails == 0  # (steps 3-5: the bfloat16 call's alone)


@pytest.mark.parametrize("kernel", ["auto", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_autograd_traces_the_python_hooks_in_their_place(
        built: object, dtype: torch.dtype, kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled autograd (the backward traced by Dynamo) runs no C++ hook: each hands it the
    Python hook it stands for, which hands the gradient to the compiled operator (no graph
    break, no Python state written while traced: Dynamo would replay it after the graph,
    over what the operators staged). The backward compiles and runs, the losses are an
    unwatched run's, and the gradients' statistics an eager backward's. So in bfloat16,
    where the gradient through the norm is gathered from the norm's own nodes (one Python
    gatherer standing for their C++ post-hooks), not computed; so where the launch lane
    (``kernel="triton"``) hooks the gradients, gathered in float32 in two parts too."""
    from torch._dynamo import compiled_autograd
    from torch._dynamo.utils import counters

    from normwatch.measure.layer.gradients import GradHooks

    gatherers = []  # the gatherers compiled autograd was handed for the C++ post-hooks
    gather = GradHooks._gather
    monkeypatch.setattr(GradHooks, "_gather", lambda self, n: gatherers.append(n) or gather(
        self, n))
    torch.manual_seed(0)
    base = tiny_llama(32, 1).to(dtype)
    models = [copy.deepcopy(base) for _ in range(3)]  # unwatched, eager, compiled autograd
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    watches = [None, *(normwatch.watch(m, report_dir=None, stats_every=1, flush_every=100,
                                       kernel=kernel) for m in models[1:])]
    assert all(h.grads._lane is not None for h in watches[2]._measure._hooks)  # type: ignore[union-attr]
    tokens = torch.randint(0, 1024, (2, 8), generator=torch.Generator().manual_seed(0))
    losses: list[list[float]] = [[], [], []]
    torch.compiler.reset()
    counters.clear()
    try:
        for _ in range(3):
            for i, (m, o, w) in enumerate(zip(models, opts, watches, strict=True)):
                loss = m(input_ids=tokens, labels=tokens).loss
                losses[i].append(loss.item())
                if i == 2:
                    with compiled_autograd._enable(torch.compile(backend="eager")):
                        loss.backward()
                else:
                    loss.backward()
                o.step()
                o.zero_grad()
                if w is not None:
                    w.step()
    finally:
        torch.compiler.reset()
    assert losses[0] == losses[1] == losses[2]
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert bool(gatherers) == (dtype == torch.bfloat16 or kernel == "triton"), gatherers
    eager, compiled = (w.flush() for w in watches[1:])  # type: ignore[union-attr]
    assert not watches[2].disabled  # type: ignore[union-attr]
    for name, want in eager.layers.items():
        got = compiled.layers[name]
        assert want.grad_out_rms and want.grad_hidden_rms and want.weight_grad_norm
        for field in ("grad_out_rms", "grad_in_rms", "grad_hidden_rms", "weight_grad_norm"):
            assert getattr(got, field) == pytest.approx(getattr(want, field), rel=1e-5), \
                (name, field)
    for w in watches[1:]:
        w.close()  # type: ignore[union-attr]


class _EagerNorm(torch.nn.Module):
    """A block whose norm is called from a frame Dynamo runs as it is but compiles the
    frames under (as FSDP2's graph breaks leave a norm's hooks in a compiled model)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)
        self.norm = torch.nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(_called(self.norm, self.lin(x)))


@torch._dynamo.disable(recursive=False)
def _called(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return norm(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("stats_every", [1, 1 << 20])
def test_in_an_eager_stretch_of_a_compiled_model_the_python_hook_is_traced(
        built: object, stats_every: int) -> None:
    """Where Dynamo compiles the frames run under an eager one, the C++ lane hands the
    call to the Python hook, traced as in a compiled graph: nothing of normwatch's is
    compiled apart step after step (the lane's Python, each tier's), and the statistics
    and losses are an eager watched copy's."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    base = torch.nn.Sequential(_EagerNorm(), _EagerNorm())
    models = [copy.deepcopy(base) for _ in range(2)]  # eager, compiled
    watches = [normwatch.watch(m, report_dir=None, stats_every=stats_every, flush_every=100)
               for m in models]
    runs = [models[0], torch.compile(models[1], backend="eager")]
    gen = torch.Generator().manual_seed(0)
    losses: list[list[float]] = [[], []]
    graphs = []
    torch.compiler.reset()
    try:
        for _ in range(4):
            x = torch.randn(4, 6, 32, generator=gen)
            for i, (run, w) in enumerate(zip(runs, watches, strict=True)):
                loss = run(x).square().mean()
                loss.backward()
                losses[i].append(loss.item())
                w.step()
            graphs.append(counters["stats"]["unique_graphs"])
    finally:
        torch.compiler.reset()
    assert graphs[0] > 0 and graphs[1:] == [graphs[0]] * 3, graphs
    assert losses[0] == losses[1]
    eager, compiled = (w.flush() for w in watches)
    assert not watches[1].disabled
    for name, want in eager.layers.items():
        got = compiled.layers[name]
        assert got.calls == want.calls == 4
        for field in ("absmax", "sumsq_max", "rms_min", "grad_out_rms", "weight_grad_norm"):
            assert getattr(got, field) == pytest.approx(getattr(want, field), rel=1e-5), \
                (name, field)
    for w in watches:
        w.close()


WEIGHT_HOOKED_BEFORE = """
import torch, normwatch
from tests.benchmarks.overhead import tiny_llama, train_step
torch.manual_seed(0)
model = tiny_llama(32, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
seen = []
norm = model.model.norm.weight
handle = norm.register_hook(lambda g: seen.append(float(g.norm())))
handle.remove()  # (torch keeps the weight's hook list once made)
tokens = torch.randint(0, 1024, (2, 8), generator=torch.Generator().manual_seed(0))
for kernel in ("torch", "auto"):  # a watch closed, another made on the same weights
    w = normwatch.watch(model, opt, report_dir=None, stats_every=1, kernel=kernel)
    norm.register_hook(lambda g: seen.append(float(g.norm())))  # the user's, after
    train_step(model, opt, tokens, w)
    print(kernel, w.flush().layers["model.norm"].weight_grad_norm, seen[-1])
    w.close()
"""


def test_a_weight_hooked_in_python_before_takes_the_lanes_hook_beside(built: object) -> None:
    """A norm weight that had a Python hook (the user's, or a watch's on another kernel
    before) gets the C++ weight hook beside it, not an abort of the process (torch's
    ``add_hook`` asserts the weight has no hook list); the weight's gradient norm is the
    one the user's own hook sees. (In a child process: an abort would end this one.)"""
    import subprocess

    run = subprocess.run([sys.executable, "-c", WEIGHT_HOOKED_BEFORE], capture_output=True,
                         text=True, timeout=300, cwd=Path(__file__).resolve().parents[3])
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [line.split() for line in run.stdout.splitlines()]
    assert [line[0] for line in lines] == ["torch", "auto"]
    for _, got, want in lines:
        assert float(got) == pytest.approx(float(want), rel=1e-5)


def _compiled_run(monkeypatch: pytest.MonkeyPatch, cpp: bool
                  ) -> tuple[list[float], list[object], list[str], dict[bool, list[str]]]:
    """A compiled TinyLM (5 RMS norms) trained 12 steps, watched (both tiers by turns,
    flushed every 4; in bfloat16 for steps 6 to 8, from an interval's second step): its
    losses, flushes, host counts after each step and, for a steady step of each tier
    (11, 12), normwatch's frames in its forward and backward. ``cpp``: the compiled
    operators' bodies are the C++ lane's (else Python's)."""
    from functools import partial

    from normwatch.demos.toymodel import TinyLM, lm_loss, synthetic_batch
    from tests.benchmarks.opcount import frames_of

    if not cpp:
        monkeypatch.setattr(fastlane, "compiled_for",
                            lambda path, lane: (path.compiled_call, path.compiled_grad))
    torch.manual_seed(0)
    model = TinyLM(dim=32, depth=2, norm="rmsnorm")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    w = normwatch.watch(model, opt, report_dir=None, stats_every=2, flush_every=4)
    monkeypatch.undo()
    run = torch.compile(model, backend="aot_eager")
    gen = torch.Generator().manual_seed(0)
    losses, snaps, counts, frames = [], [], [], {}
    for step in range(1, 13):
        tokens = synthetic_batch(gen, batch=2, seq=8)
        if step in (6, 9):  # (recompiles; at 6 the lane notes the dtypes: no first call)
            model.to(torch.bfloat16 if step == 6 else torch.float32)
        if step in (11, 12):
            full, outputs = w._measure._rt.full_stats, []
            out = frames_of(partial(lambda t, got: got.append(run(t)), tokens, outputs))
            loss = lm_loss(outputs[0].float(), tokens)
            frames[full] = [*out, "|", *frames_of(loss.backward)]
        else:
            loss = lm_loss(run(tokens).float(), tokens)
            loss.backward()
        opt.step()
        opt.zero_grad()
        snap = w.step(loss)
        losses.append(loss.item())
        counts.append(repr([h.counts for h in w._measure._hooks]))
        if snap is not None:
            snaps.append(snap)
    assert not w.disabled
    w.close()
    return losses, snaps, counts, frames


def test_a_compiled_models_operators_record_in_the_lane_as_python_does(
        built: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bodies of a compiled graph's operators are the C++ lane's: in a steady step of
    either tier a norm call runs no Python of normwatch's but the operator's
    (``_observe``), nor does a gradient (``_observe_grad``: on a sentinel step it returns
    at once; on a full-tier step the C++ gradient hooks read it, the gradient through the
    norm included); before, some 25 frames a call and 6 (sentinel) to 24 a gradient.
    What they record is Python's: the losses, every flush's statistics and the host
    counts after every step (the dtypes noted as the model turns bfloat16 included) are
    those of the same run with Python's bodies."""
    runs = []
    try:
        for cpp in (True, False):
            torch.compiler.reset()
            runs.append(_compiled_run(monkeypatch, cpp))
    finally:
        torch.compiler.reset()
    cpp, python = runs
    assert cpp[0] == python[0]
    assert cpp[2] == python[2]
    assert "input_dtype='bfloat16'" in cpp[2][5] and "input_dtype='bfloat16'" not in cpp[2][4]
    assert len(cpp[1]) == len(python[1]) == 3
    for a, b in zip(cpp[1], python[1], strict=True):
        assert a.layers == b.layers  # type: ignore[attr-defined]
    bookkeeping = {"_forward_begins", "forward", "mark", "_forward_ends", "rng_states",
                   "_integer_tensors", "<listcomp>", "_name", "batch_hash", "_nothing"}
    for full in (False, True):  # a step of each tier
        forward, backward = ([f for f in part.split() if f not in bookkeeping]
                             for part in " ".join(cpp[3][full]).split("|"))
        assert forward == ["_observe"] * 5, cpp[3][full]
        # the output's (with the one through the norm) and the hidden state's (the
        # weight's: its C++ tensor hook, outside the graph)
        assert backward == ["_observe_grad"] * 10, cpp[3][full]
    assert "record" in python[3][False] and "measure" in python[3][True]
