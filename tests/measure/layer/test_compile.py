"""Under ``torch.compile`` (CPU inductor): no graph breaks, no recompiles after warm-up,
the statistics of eager mode and of an independent float64 reference."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

import normwatch
from normwatch.catalog import PUBLIC
from normwatch.demos.toymodel import TinyLM, lm_loss, synthetic_batch
from normwatch.records import Snapshot


@pytest.fixture(autouse=True)
def fresh_compiler() -> Iterator[None]:
    torch.compiler.reset()
    counters.clear()
    yield
    torch.compiler.set_stance("default")
    torch.compiler.reset()


@contextmanager
def no_recompiles() -> Iterator[None]:
    """Any recompile inside raises (``fail_on_recompile``)."""
    torch.compiler.set_stance("fail_on_recompile")
    try:
        yield
    finally:
        torch.compiler.set_stance("default")


def graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def assert_same_stats(eager: list[Snapshot], compiled: list[Snapshot]) -> None:
    """Every public statistic of every flush agrees (float32 reductions: rel 1e-5)."""
    assert [s.step for s in eager] == [s.step for s in compiled] and eager
    for a, b in zip(eager, compiled, strict=True):
        assert a.layers.keys() == b.layers.keys()
        for name in a.layers:
            for field in PUBLIC:
                x, y = getattr(a.layers[name], field), getattr(b.layers[name], field)
                if field == "output_mismatch":  # float32 rounding of two compiled formulas
                    assert (x is None) == (y is None) and (x is None or abs(x - y) < 1e-5)
                elif isinstance(x, float) and isinstance(y, float):
                    assert y == pytest.approx(x, rel=1e-5, abs=1e-6), (a.step, name, field)
                else:
                    assert x == y, (a.step, name, field)
        assert a.first_nonfinite == b.first_nonfinite


Run = Callable[[nn.Module], nn.Module]


def train_lm(compile_model: Run | None, steps: int, depth: int = 2, warmup: int = 3,
             plant: int | None = None, **options: object) -> tuple[list[Snapshot],
                                                                     normwatch.Watch]:
    """Train a TinyLM under a watch; ``compile_model`` compiles it (``None``: eager).
    After ``warmup`` steps a compiled run may not recompile; at step ``plant`` the
    residual stream is scaled up 40x (an alarm). A paused evaluation forward runs at
    every 7th step."""
    torch.manual_seed(0)
    model = TinyLM(dim=32, depth=depth, norm="layernorm")
    w = normwatch.watch(model, flush_every=10, stats_every=4, output_check_every=2,
                        report_dir=None, **options)
    run = model if compile_model is None else compile_model(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    snaps = []
    for step in range(1, steps + 1):
        if step == warmup + 1 and compile_model is not None:
            torch.compiler.set_stance("fail_on_recompile")
        if step == plant:
            model.residual_scale.fill_(40.0)
        tokens = synthetic_batch(gen, batch=4, seq=16)
        loss = lm_loss(run(tokens), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 7 == 0:
            with w.pause():
                run(tokens)
        snap = w.step(loss)
        if snap is not None:
            snaps.append(snap)
    torch.compiler.set_stance("default")
    return snaps, w


def whole(model: nn.Module) -> nn.Module:
    return torch.compile(model, fullgraph=True)  # type: ignore[return-value]


def per_block(model: nn.Module) -> nn.Module:
    for block in model.blocks:  # type: ignore[union-attr]
        block.compile(fullgraph=True)
    return model


def test_fullgraph_compile_matches_eager_and_never_recompiles() -> None:
    """60 steps: tier switches every 4, flushes every 10, output checks every other
    interval, pauses, and an alarm; one graph, no break, no recompile after step 3."""
    eager, we = train_lm(None, 60, plant=45, fp16_limit=8.0)
    compiled, wc = train_lm(whole, 60, plant=45, fp16_limit=8.0)
    assert graph_breaks() == 0
    assert counters["stats"]["unique_graphs"] == 1
    assert_same_stats(eager, compiled)
    last = compiled[-1].layers["blocks.0.norm1"]
    assert (last.calls, last.tokens, last.stats_tokens) == (10, 640, 128)  # pauses uncounted
    assert last.input_dtype == last.output_dtype == last.weight_dtype == "float32"
    assert compiled[0].layers["norm"].output_mismatch is not None  # checked interval
    assert compiled[1].layers["norm"].output_mismatch is None
    kinds = {a.kind for a in wc.alarms}
    assert "fp16_overflow" in kinds and kinds == {a.kind for a in we.alarms}  # the planted
    # compiled calls place the norms in forward order too (from their first call's key)
    assert wc.forward_order == we.forward_order == [
        "blocks.0.norm1", "blocks.0.norm2", "blocks.1.norm1", "blocks.1.norm2", "norm"]
    wc.close()
    we.close()


def test_per_block_compile_of_12_blocks_does_not_recompile() -> None:
    eager, _ = train_lm(None, 20, depth=12)
    compiled, w = train_lm(per_block, 20, depth=12)
    assert graph_breaks() == 0
    assert counters["stats"]["unique_graphs"] == 1  # one graph serves every block
    assert_same_stats(eager, compiled)
    assert all(s.calls == 10 for s in compiled[-1].layers.values())
    w.close()


def f64_reference(inputs: list[torch.Tensor], eps: float) -> dict[str, float]:
    """Max |x|, RMS and eps dominance of LayerNorm inputs, in float64, written apart."""
    x = torch.cat([t.reshape(-1, t.shape[-1]) for t in inputs]).double()
    rms = x.square().mean(1).sqrt()
    var = x.var(1, unbiased=False)
    return {"absmax": float(x.abs().max()), "rms_max": float(rms.max()),
            "rms_min": float(rms.min()), "rms_mean": float(rms.mean()),
            "eps_dominance": float((eps / (var + eps)).max()), "tokens": float(x.shape[0])}


def test_compiled_statistics_match_a_float64_reference() -> None:
    torch.manual_seed(1)
    model = TinyLM(dim=32, depth=2, norm="layernorm")
    seen: list[torch.Tensor] = []
    probe = model.blocks[1].norm2.register_forward_hook(
        lambda m, args, out: seen.append(args[0].detach().clone()))
    gen = torch.Generator().manual_seed(1)
    batches = [synthetic_batch(gen, batch=3, seq=8) for _ in range(4)]
    for tokens in batches:  # eager, unwatched: the inputs the norm will see
        model(tokens)
    probe.remove()
    w = normwatch.watch(model, stats_every=1, flush_every=100, report_dir=None)
    compiled = torch.compile(model, fullgraph=True)
    for tokens in batches:  # no optimizer step: the same inputs again
        compiled(tokens).float().mean().backward()
        w.step()
    stats = w.flush().layers["blocks.1.norm2"]
    want = f64_reference(seen, 1e-6)
    for field in ("absmax", "rms_max", "rms_min", "rms_mean", "eps_dominance"):
        assert getattr(stats, field) == pytest.approx(want[field], rel=1e-5), field
    assert stats.tokens == want["tokens"] == 4 * 3 * 8
    w.close()


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("compiled", [False, True])
def test_activation_checkpointing_counts_each_token_once(reentrant: bool,
                                                         compiled: bool) -> None:
    """Without ``skip_fwd_side_effects_in_bwd_under_checkpoint``: the compiled hook's
    in-place fold is not replayed by the recomputation."""
    model = TinyLM(dim=32, depth=2)
    blocks = list(model.blocks)

    def forward(tokens: torch.Tensor) -> torch.Tensor:
        h = model.embed(tokens)
        if reentrant:
            h.requires_grad_(True)
        for block in blocks:
            h = checkpoint(block, h, use_reentrant=reentrant)
        return model.head(model.norm(h))

    run = torch.compile(forward, fullgraph=not reentrant) if compiled else forward
    w = normwatch.watch(model, flush_every=3, report_dir=None)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        run(synthetic_batch(gen, batch=2, seq=8)).float().logsumexp(-1).mean().backward()
        snap = w.step()
    assert snap is not None and graph_breaks() == 0
    assert {n: (s.calls, s.tokens) for n, s in snap.layers.items()} == \
        dict.fromkeys(snap.layers, (3, 48))
    w.close()


@pytest.mark.parametrize("same", [True, False], ids=["the model", "another of its class"])
def test_attaching_after_compilation_resets_the_compiled_code(same: bool) -> None:
    """In a fresh process (torch compiles without hook guards) code compiled before the
    first watch, for the model or another instance of its classes, would run without
    the hooks: the watch warns and drops it."""
    model = TinyLM(dim=32, depth=1)
    tokens = synthetic_batch(torch.Generator().manual_seed(0), batch=2, seq=8)
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True):
        torch.compile(model if same else TinyLM(dim=32, depth=1))(tokens).float().mean() \
            .backward()
        with pytest.warns(RuntimeWarning, match=r"compiled before watch\(\).*compiler.reset"):
            w = normwatch.watch(model, report_dir=None)
    torch.compile(model)(tokens).float().mean().backward()
    snap = w.flush()
    assert all(s.calls == 1 and s.tokens == 16 for s in snap.layers.values())  # not zeros
    w.close()


def test_batches_of_varying_length_are_measured_as_in_eager() -> None:
    """Sequences of a new length each step (padding to the batch's longest): torch
    recompiles once, with symbolic shapes (automatic dynamic); every token of every call
    and gradient is measured as in eager."""
    lengths = [16, 24, 20, 9, 31, 16]

    def run(compiled: bool) -> Snapshot:
        torch.manual_seed(0)
        model = TinyLM(dim=32, depth=1, norm="layernorm")
        w = normwatch.watch(model, stats_every=1, report_dir=None)
        forward = torch.compile(model) if compiled else model
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(0)
        for seq in lengths:
            tokens = synthetic_batch(gen, batch=3, seq=seq)
            loss = lm_loss(forward(tokens), tokens)
            loss.backward()
            opt.step()
            opt.zero_grad()
            w.step(loss)
        snap = w.flush()
        w.close()
        return snap

    eager, compiled = run(False), run(True)
    assert graph_breaks() == 0 and counters["stats"]["unique_graphs"] <= 2
    assert compiled.layers["norm"].tokens == 3 * sum(lengths)
    assert compiled.layers["norm"].grad_out_rms is not None
    assert_same_stats([eager], [compiled])


def test_a_model_of_a_class_compiled_after_the_first_watch_needs_no_reset() -> None:
    """A notebook's cell run again, a sweep's next trial: a second TinyLM watched and
    compiled while the first one's watch is still open. Code compiled since the first
    watch checks its hooks, so the second watch neither warns nor drops the first
    model's code, and each watch's statistics are its eager twin's."""
    eager, we = train_lm(None, 20)
    first, w1 = train_lm(whole, 20)
    code = TinyLM.forward.__code__
    kept = [e.code for e in _debug_get_cache_entry_list(code)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        second, w2 = train_lm(whole, 20)
    assert kept and set(map(id, kept)) <= {id(e.code) for e in _debug_get_cache_entry_list(code)}
    assert graph_breaks() == 0
    assert_same_stats(eager, first)
    assert_same_stats(eager, second)
    for w in (we, w1, w2):
        w.close()


def test_an_unwatched_copy_compiled_first_does_not_hide_the_hooks() -> None:
    """Two instances share their classes' compiled code: the watched one must not run
    the graph traced, without hooks, for the unwatched one."""
    plain = TinyLM(dim=32, depth=1)
    watched = TinyLM(dim=32, depth=1)
    w = normwatch.watch(watched, report_dir=None)
    tokens = synthetic_batch(torch.Generator().manual_seed(0), batch=2, seq=8)
    for model in (plain, watched):
        torch.compile(model)(tokens).float().mean().backward()
    assert all(s.calls == 1 for s in w.flush().layers.values())
    w.close()


def test_closing_leaves_the_compiled_model_unwatched() -> None:
    """Dynamo guards the hook count: closing costs one recompile, to the hook-free graph,
    and the statistics are left alone after it."""
    model = TinyLM(dim=32, depth=1)
    w = normwatch.watch(model, report_dir=None)
    compiled = torch.compile(model, fullgraph=True)
    tokens = synthetic_batch(torch.Generator().manual_seed(0), batch=2, seq=8)
    compiled(tokens).float().mean().backward()
    assert w.flush().layers["norm"].calls == 1
    w.close()
    graphs = counters["stats"]["unique_graphs"]
    compiled(tokens).float().mean().backward()
    assert counters["stats"]["unique_graphs"] == graphs + 1
    with no_recompiles():
        compiled(tokens).float().mean().backward()
    block = w._measure.accumulator.blocks[torch.device("cpu")]
    assert float(block[:, 0].abs().sum()) == 0.0  # no call folded after the close
    assert all(not m._forward_hooks for m in model.modules())


def test_a_failing_compiled_measurement_disables_that_layer_only(monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """The failure, inside the compiled call's operator, disables that layer with one
    warning; training goes on; the recompile that drops the hook runs without it and the
    other layer is still measured."""
    from normwatch.measure.backends.native.backend import NativeBackend

    real = NativeBackend.call_rows  # (the backend of CPU tensors: what reads the call)

    def broken(self, layer, x, *args, **kwargs):  # type: ignore[no-untyped-def]
        if x.shape[-1] == 48:
            raise RuntimeError("kernel exploded")
        return real(self, layer, x, *args, **kwargs)

    monkeypatch.setattr(NativeBackend, "call_rows", broken)
    model = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 48), nn.LayerNorm(48))
    w = normwatch.watch(model, report_dir=None)
    compiled = torch.compile(model)
    with pytest.warns(RuntimeWarning, match="measuring '2' failed") as record:
        for _ in range(3):
            compiled(torch.randn(4, 32, requires_grad=True)).sum().backward()
            w.step()
    assert sum("failed" in str(r.message) for r in record) == 1
    assert w.disabled == {"2": "RuntimeError: kernel exploded"}
    snap = w.flush()
    assert snap.layers["0"].calls == 3 and snap.layers["2"].calls == 0
    w.close()


@pytest.mark.parametrize("steps_before", [0, 2])
def test_a_model_built_on_the_meta_device_is_measured_once_materialised(
        steps_before: int) -> None:
    """FSDP2's usual flow: build on meta, watch, materialise (``to_empty``), compile; also
    with steps counted before it is materialised (their tiers set: the next step still
    places the hooks)."""
    with torch.device("meta"):
        model = TinyLM(dim=32, depth=1)
    w = normwatch.watch(model, report_dir=None)
    for _ in range(steps_before):
        w.step()
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
        model.residual_scale.fill_(1.0)
    compiled = torch.compile(model, fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        tokens = synthetic_batch(gen, batch=2, seq=8)
        lm_loss(compiled(tokens), tokens).backward()
        w.step()
    snap = w.flush()
    # the first step ran traced without state; from the second on every call is measured
    assert {s.calls for s in snap.layers.values()} == {2}
    w.close()


@pytest.mark.parametrize("compile_model", [whole, per_block], ids=["whole", "per-block"])
def test_two_micro_batch_forwards_before_one_backward_measure_both(compile_model: Run
                                                                    ) -> None:
    """Gradient accumulation written as one backward of summed losses: both forwards of
    the compiled region get their gradients measured, as eagerly."""
    def run(compiled: bool) -> Snapshot:
        torch.manual_seed(0)
        model = TinyLM(dim=32, depth=2, norm="layernorm")
        w = normwatch.watch(model, flush_every=100, stats_every=1, report_dir=None)
        net = compile_model(model) if compiled else model
        gen = torch.Generator().manual_seed(0)
        for _ in range(3):
            a, b = (synthetic_batch(gen, batch=2, seq=16) for _ in range(2))
            (lm_loss(net(a), a) + 3.0 * lm_loss(net(b), b)).backward()
            w.step()
        return w.flush()

    eager, compiled = run(False), run(True)
    assert_same_stats([eager], [compiled])  # the gradient statistics included
    norm = compiled.layers["blocks.1.norm2"]
    assert norm.tokens == 3 * 2 * (2 * 16)  # steps x forwards x tokens
    assert norm.grad_out_rms is not None and norm.grad_hidden_rms is not None


class InPlaceAfterNorm(nn.Module):
    """A model that modifies the norm's output in place (``y.mul_``, ``y +=``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm, self.out = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        y = self.norm(h)
        y.mul_(2.0)
        y += h
        return self.out(y).sum()


def test_the_norms_output_may_be_modified_in_place_when_compiled() -> None:
    got = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = InPlaceAfterNorm()
        w = normwatch.watch(model, stats_every=1, report_dir=None)
        run = torch.compile(model, fullgraph=True) if compiled else model
        for _ in range(3):
            run(torch.randn(4, 8)).backward()  # type: ignore[operator]
            w.step()
        got[compiled] = w.flush()
        w.close()
    assert_same_stats([got[False]], [got[True]])
    assert got[True].layers["norm"].grad_out_rms is not None


class _Flags:
    """Python state a model sets and reads while it runs (a context flag, a counter)."""

    def __init__(self) -> None:
        self.scale = 1.0


class _FlaggedBlock(nn.Module):
    """Reads and writes ``flags`` on both sides of its norm (the hook on its input,
    an intermediate tensor, is traced between), as a kernel registry's context does."""

    def __init__(self, flags: _Flags) -> None:
        super().__init__()
        self.flags = flags
        self.norm = nn.LayerNorm(16)
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.flags.scale = self.flags.scale + 1.0
        h = self.norm(x)
        self.flags.scale = self.flags.scale * 2.0  # a write after the traced hook, read back
        return x + self.lin(h) * self.flags.scale


def test_the_programs_own_writes_survive_the_traced_hooks() -> None:
    """Watching changes nothing the compiled program computes: Dynamo (torch 2.13) traces
    the hidden state's hook in a speculation that swaps its side-effect table, which lost
    the model's attribute writes after the hook (output and state differed)."""
    flags = _Flags()
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(16, 16), _FlaggedBlock(flags), _FlaggedBlock(flags))
    watched = copy.deepcopy(plain)
    for block in (watched[1], watched[2]):
        block.flags = flags
    x = torch.randn(4, 16)

    def run(model: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]
            ) -> tuple[torch.Tensor, float, list[torch.Tensor]]:
        flags.scale = 1.0
        out = fn(x)
        scale = flags.scale
        out.square().sum().backward()
        return out.detach(), scale, [p.grad for p in model.parameters() if p.grad is not None]

    assert run(plain, plain)[1] == 10.0  # ((1 + 1)·2 + 1)·2, eager
    plain.zero_grad()
    watch = normwatch.watch(watched, stats_every=1, report_dir=None, report_console=False)
    want = run(plain, torch.compile(plain, fullgraph=True))
    got = run(watched, torch.compile(watched, fullgraph=True))
    watch.step()
    assert got[1] == want[1] == 10.0
    assert torch.equal(got[0], want[0])
    assert len(got[2]) == len(want[2]) == 10
    assert all(torch.equal(a, b) for a, b in zip(got[2], want[2], strict=True))
    assert (watch.flush().layers["2.norm"].grad_hidden_rms or 0) > 0  # the hook ran
    watch.close()


@pytest.mark.parametrize("per_block", [False, True], ids=["whole", "per block"])
def test_a_watched_compiled_step_generates_no_kernel_beyond_the_unwatched_ones(
        per_block: bool) -> None:
    """Counted in inductor's code for one training step (``tests/benchmarks/
    compiled_kernels.py``): as many graphs as unwatched (one block's serve every block),
    no kernel more, and normwatch's operators at most 3 per norm call (its forward call and
    two gradients), none in the unwatched code."""
    from tests.benchmarks.compiled_kernels import one_step

    plain, watched = one_step(False, per_block), one_step(True, per_block)
    calls = 2 if per_block else 5  # the norm calls a graph holds: a block's, or the model's
    assert plain.kernels and plain.normwatch_calls == ()
    assert watched.graphs == plain.graphs == 2
    assert len(watched.kernels) <= len(plain.kernels)
    assert watched.normwatch_calls.count("observe") == calls
    assert len(watched.normwatch_calls) <= 3 * calls
    assert watched.gradients_measured == watched.calls_measured == 5  # every norm's


def test_a_skipped_steps_compiled_gradients_are_dropped_as_eager_ones_are() -> None:
    """A loss scaler's skipped step (gradients scaled past fp16): the gradients the
    compiled backward measured are dropped, as eager's staged ones; the interval's
    gradient statistics are step 1's in both."""
    def run(compiled: bool) -> Snapshot:
        torch.manual_seed(0)
        model = TinyLM(dim=16, depth=1)
        w = normwatch.watch(model, report_dir=None, stats_every=1, flush_every=2)
        fwd = whole(model) if compiled else model
        tokens = synthetic_batch(torch.Generator().manual_seed(0), batch=2, seq=8)
        lm_loss(fwd(tokens), tokens).backward()
        w.step()
        (lm_loss(fwd(tokens), tokens) * 1e30).backward()  # as if scaled past fp16
        snap = w.step(skipped=True)
        w.close()
        assert snap is not None
        return snap

    eager, compiled = run(False), run(True)
    assert_same_stats([eager], [compiled])
    norm = compiled.layers["blocks.0.norm1"]
    assert norm.grad_out_rms is not None and norm.grad_out_rms < 1.0
    assert norm.grad_out_nonfinite == norm.grad_hidden_nonfinite == 0


def test_a_model_first_compiled_on_a_sentinel_step_measures_no_gradient_there() -> None:
    """Eager step 1 (full tier, gradients measured), then step 2 (sentinel tier) is the
    first to run compiled: its backward measures nothing, as eager's measures nothing."""
    def run(compiled: bool) -> Snapshot:
        torch.manual_seed(0)
        model = TinyLM(dim=16, depth=1)
        w = normwatch.watch(model, report_dir=None, stats_every=2, flush_every=2)
        gen = torch.Generator().manual_seed(0)
        for fwd in (model, whole(model) if compiled else model):
            tokens = synthetic_batch(gen, batch=2, seq=8)
            lm_loss(fwd(tokens), tokens).backward()
            snap = w.step()
        w.close()
        assert snap is not None
        return snap

    eager, compiled = run(False), run(True)
    assert_same_stats([eager], [compiled])
    assert compiled.layers["blocks.0.norm1"].grad_out_rms is not None  # step 1's


def test_a_watched_models_graphs_are_cached_as_an_unwatched_models_are(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor's FX graph cache and the AOT autograd cache store the watched graphs and
    the next compile loads them (an effectful operator made the first pass them by, a
    custom ``autograd.Function`` tapping each output the second: every process compiled
    a watched model anew, 2.2x the unwatched one's time with warm caches, then 1.5x)."""
    from torch._functorch import config as aot
    from torch._inductor import config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = TinyLM(dim=32, depth=1, norm="rmsnorm")
    w = normwatch.watch(model, report_dir=None, stats_every=1)
    tokens = synthetic_batch(torch.Generator().manual_seed(0), batch=2, seq=8)
    for attempt in range(2):
        torch.compiler.reset()
        counters.clear()
        with config.patch(fx_graph_cache=True), aot.patch(enable_autograd_cache=True):
            lm_loss(torch.compile(model, fullgraph=True)(tokens), tokens).backward()
        w.step()
        found, joint = counters["inductor"], counters["aot_autograd"]
        assert not found["fxgraph_cache_bypass"], dict(found)
        assert found["fxgraph_cache_hit" if attempt else "fxgraph_cache_miss"] == 2, dict(found)
        assert not joint["autograd_cache_bypass"], dict(joint)
        assert joint["autograd_cache_hit" if attempt else "autograd_cache_miss"] == 1, \
            dict(joint)
    snap = w.flush()
    assert snap.layers["blocks.0.norm1"].calls == 2 and snap.layers["blocks.0.norm1"].grad_out_rms
    w.close()


def _guards(model: nn.Module) -> list[str]:
    """The guards of ``model``'s compiled forward (``fullgraph=True``, backend "eager":
    Dynamo's alone), as its guard log prints them, one line a guard."""
    import logging

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.extend(line.split("+- ", 1)[1] for line in record.getMessage().splitlines()
                         if "+- " in line)

    keep = Keep()
    logger = logging.getLogger("torch._dynamo.guards")  # (the guard log's records)
    torch._logging.set_logs(guards=True)
    logger.addHandler(keep)
    try:
        tokens = synthetic_batch(torch.Generator().manual_seed(0), batch=2, seq=8)
        torch.compile(model, fullgraph=True, backend="eager")(tokens)
    finally:
        logger.removeHandler(keep)
        torch._logging.set_logs()
    return [line for line in lines if not line.startswith(("GuardManager", "DictGuardManager",
                                                           "KeyValueManager", "ValueManager"))]


def test_a_watched_norms_compiled_code_checks_few_guards_and_none_across_layers() -> None:
    """Compiled code checks its guards at every call. The traced hook reaches each
    object by one way (the layer's own hook; the device's ticket from one table): no
    guard ties one layer's objects to another's (an alias guard, a Python lambda), and a
    norm adds at most 60 guards to an unwatched model's (2026-12-06: 56; 79, and 9 alias
    guards, when a pre-hook and the recorder's shared objects were traced)."""
    depth = 4
    plain = _guards(TinyLM(dim=16, depth=depth, norm="rmsnorm"))
    torch.compiler.reset()
    model = TinyLM(dim=16, depth=depth, norm="rmsnorm")
    w = normwatch.watch(model, report_dir=None)
    try:
        watched = _guards(model)
    finally:
        w.close()
    across = [g for g in watched if g.startswith("LAMBDA_GUARD") and "_forward_hooks[" in g]
    assert not across, across[:3]
    norms = 2 * depth + 1
    assert (len(watched) - len(plain)) / norms <= 60, (len(watched), len(plain))


def test_normwatch_imported_again_in_a_process_still_measures_compiled_calls() -> None:
    """The operators are defined once a process; imported again (its modules dropped from
    ``sys.modules``, as a test runner or a notebook's reload does), normwatch finds them
    defined, and their bodies find the new watch's layers."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "import normwatch.measure.layer.operators\n"
        "for m in [m for m in sys.modules if m.startswith('normwatch')]:\n"
        "    del sys.modules[m]\n"
        "import normwatch\n"
        "from normwatch.demos.toymodel import TinyLM, lm_loss, synthetic_batch\n"
        "model = TinyLM(dim=16, depth=1, norm='rmsnorm')\n"
        "w = normwatch.watch(model, report_dir=None, stats_every=1)\n"
        "tokens = synthetic_batch(torch.Generator().manual_seed(0), batch=2, seq=8)\n"
        "run = torch.compile(model, fullgraph=True, backend='aot_eager')\n"
        "lm_loss(run(tokens), tokens).backward()\n"
        "w.step()\n"
        "layer = w.flush().layers['blocks.0.norm1']\n"
        "print(layer.calls, layer.grad_out_rms is not None and layer.grad_out_rms > 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=False, timeout=300)
    assert result.stdout.split()[-2:] == ["1", "True"], result.stderr[-2000:]


class _WithLoss(nn.Module):
    """A language model whose forward returns its loss, as Hugging Face's do given
    labels: compiled with ``mode="reduce-overhead"``, the loss is a CUDA graph's output,
    overwritten by the graph's next run."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.lm(tokens), tokens)


def _train_on_cuda(reduce_overhead: bool, steps: int = 24) -> list[Snapshot]:
    torch.manual_seed(0)
    model = _WithLoss(TinyLM(dim=32, depth=2, norm="layernorm")).cuda()
    w = normwatch.watch(model, flush_every=6, stats_every=3, report_dir=None)
    run = torch.compile(model, mode="reduce-overhead") if reduce_overhead else model
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    snaps = []
    for step in range(1, steps + 1):
        if step == 4 and reduce_overhead:
            torch.compiler.set_stance("fail_on_recompile")
        torch.compiler.cudagraph_mark_step_begin()
        loss = run(synthetic_batch(gen, batch=4, seq=16).cuda())
        loss.backward()
        opt.step()
        opt.zero_grad()
        snap = w.step(loss)
        if snap is not None:
            snaps.append(snap)
    torch.compiler.set_stance("default")
    w.close()
    return snaps


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_reduce_overhead_replays_a_watched_model_and_measures_every_replay(
        ) -> None:  # pragma: no cover - runs on GPU machines only
    """``mode="reduce-overhead"`` (CUDA graph trees) on a watched model whose compiled
    forward returns its loss: no CUDA graph skipped, no recompile after the third step,
    and every flush's statistics and losses those of the same run eager (the operators
    run between the graphs' partitions; the rows they stage and the losses kept are not
    the graphs' memory)."""
    eager = _train_on_cuda(False)
    replayed = _train_on_cuda(True)
    assert counters["inductor"]["cudagraph_skips"] == 0 and graph_breaks() == 0
    assert_same_stats(eager, replayed)
    for a, b in zip(eager, replayed, strict=True):
        assert [s for s, _ in a.losses] == [s for s, _ in b.losses]
        assert [v for _, v in b.losses] == pytest.approx([v for _, v in a.losses], rel=1e-5)
