"""Gradients through the norms: against a float64 autograd reference, under gradient
accumulation, activation checkpointing and tiers; hooks that keep nothing alive."""

from __future__ import annotations

import copy
import gc
import math
import warnings
import weakref
from functools import partial
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import normwatch
import normwatch.measure.layer.gradients
from normwatch.measure.backends import choose, torchops
from normwatch.measure.backends.native import lane as native_lane
from normwatch.measure.backends.native import readers
from normwatch.records import LayerStats


class Block(nn.Module):
    def __init__(self, d: int, pre: bool, norm: type[nn.Module] = nn.LayerNorm) -> None:
        super().__init__()
        self.pre = pre
        self.norm = norm(d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.ff(self.norm(h)) if self.pre else self.norm(h + self.ff(h))


def model(pre: bool = True, depth: int = 3, d: int = 16) -> nn.Sequential:
    torch.manual_seed(0)
    norms = [nn.LayerNorm, nn.RMSNorm]
    blocks = [Block(d, pre, norms[i % 2]) for i in range(depth)]
    for b in blocks:  # weights away from 1: the weight gradient is not trivially related
        nn.init.uniform_(b.norm.weight, 0.5, 1.5)  # type: ignore[arg-type]
    return nn.Sequential(nn.Linear(d, d), *blocks)


def batch(seed: int = 1, d: int = 16, seq: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, seq, d, generator=g), torch.randn(3, seq, d, generator=g)


def reference(net: nn.Sequential, batches: list[tuple[torch.Tensor, torch.Tensor]]
              ) -> dict[str, dict[str, float]]:
    """Per norm, float64: RMS / max |g| of dL/dy, dL/dx through the norm (autograd.grad
    of its output alone), dL/dx in total, and the weight gradient's norm per backward."""
    ref = {}
    net64 = copy.deepcopy(net).double()
    acc: dict[str, dict[str, list[torch.Tensor]]] = {}
    for x, target in batches:
        seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        handles = []
        for name, mod in net64.named_modules():
            if isinstance(mod, nn.LayerNorm | nn.RMSNorm):
                def post(m: nn.Module, args: tuple[Any, ...], out: torch.Tensor,
                         name: str = name, seen: dict[str, Any] = seen) -> None:
                    seen[name] = (args[0], out)
                handles.append(mod.register_forward_hook(post))
        y = net64(x.double())
        loss = (y * target.double()).sum()
        outs = {n: o for n, (_, o) in seen.items()}
        # dL/dy of every norm, then the gradient through each norm alone
        grads = torch.autograd.grad(loss, [*outs.values(), *[i for i, _ in seen.values()
                                                             if i.requires_grad]],
                                    retain_graph=True)
        gy = dict(zip(outs, grads[:len(outs)], strict=True))
        gx = dict(zip([n for n, (i, _) in seen.items() if i.requires_grad],
                      grads[len(outs):], strict=True))
        for name, (inp, out) in seen.items():
            a = acc.setdefault(name, {"out": [], "in": [], "hidden": [], "w": []})
            a["out"].append(gy[name])
            if inp.requires_grad:
                (through,) = torch.autograd.grad(out, inp, gy[name], retain_graph=True)
                a["in"].append(through)
                a["hidden"].append(gx[name])
            weight = net64.get_submodule(name).weight
            (gw,) = torch.autograd.grad(out, weight, gy[name], retain_graph=True)
            a["w"].append(gw)
        for h in handles:
            h.remove()
    for name, a in acc.items():
        row = {}
        for site in ("out", "in", "hidden"):
            if a[site]:
                flat = torch.cat([g.flatten() for g in a[site]])
                row[f"grad_{site}_rms"] = float(flat.square().mean().sqrt())
                row[f"grad_{site}_absmax"] = float(flat.abs().max())
        row["weight_grad_norm"] = math.sqrt(sum(float(g.square().sum()) for g in a["w"])
                                            / len(a["w"]))
        row["grad_gain"] = row.get("grad_in_rms", math.nan) / row["grad_out_rms"]
        ref[name] = row
    return ref


def measured(stats: LayerStats) -> dict[str, float | None]:
    return {f: getattr(stats, f) for f in (
        "grad_out_rms", "grad_out_absmax", "grad_in_rms", "grad_in_absmax", "grad_hidden_rms",
        "grad_hidden_absmax", "grad_gain", "weight_grad_norm")}


def train(net: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
          run: Any = None, **options: Any) -> normwatch.Snapshot:
    """One optimizer step over ``batches`` (gradient accumulation), flushed."""
    w = normwatch.watch(net, flush_every=1, stats_every=1, report_dir=None, **options)
    for x, target in batches:
        y = (run or net)(x)
        (y * target).sum().backward()
    snap = w.step()
    w.close()
    assert snap is not None
    return snap


@pytest.mark.parametrize("pre", [True, False], ids=["pre-norm", "post-norm"])
@pytest.mark.parametrize("seqs", [(5,), (5, 5, 5), (5, 7, 2)],
                         ids=["one-batch", "accumulate-3", "ragged-3"])
def test_gradient_statistics_match_a_float64_reference(pre: bool, seqs: tuple[int, ...]
                                                       ) -> None:
    """Ragged micro-batches: gradients of different token counts fold token by token,
    alike ones gradient by gradient."""
    net = model(pre)
    batches = [batch(seed, seq=seq) for seed, seq in enumerate(seqs)]
    ref = reference(net, batches)
    snap = train(net, batches)
    for name, expected in ref.items():
        got = measured(snap.layers[name])
        for field, value in expected.items():
            assert got[field] == pytest.approx(value, rel=1e-5), (name, field)
        stats = snap.layers[name]
        assert stats.grad_out_nonfinite == stats.grad_in_nonfinite == 0
    # the gradient through a post-norm is all the gradient its input gets
    for name in ref:
        s = snap.layers[name]
        same = s.grad_hidden_rms == pytest.approx(s.grad_in_rms, rel=1e-6)
        assert same is (not pre), name


class Halves(nn.Module):
    """A norm whose input is the second output of one node (a chunk: ``output_nr`` 1)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.norm = nn.Linear(d, 2 * d), nn.LayerNorm(d)
        nn.init.uniform_(self.norm.weight, 0.5, 1.5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        a, b = self.up(h).chunk(2, -1)
        return a * 0.5 + self.norm(b)


def test_a_norm_reading_a_nodes_second_output_is_measured_at_that_output() -> None:
    """The hidden state's gradient is the one of the tensor the norm read, not of its
    node's first output (which here gets another gradient: a scaled copy of dL/dy)."""
    torch.manual_seed(0)
    net = nn.Sequential(Halves(16))
    batches = [batch(seed) for seed in range(2)]
    ref = reference(net, batches)
    snap = train(net, batches)
    got = measured(snap.layers["0.norm"])
    for field, value in ref["0.norm"].items():
        assert got[field] == pytest.approx(value, rel=1e-5), field


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_float64_or_bf16_model_is_measured_whole(dtype: torch.dtype) -> None:
    # the weight gradient's norm is summed in fp32 for bf16, in float64 for float64 (not
    # narrowed: that failed and disabled every layer after its first backward)
    net = model(pre=True)
    batches = [batch(seed) for seed in range(2)]
    ref = reference(net, [(x.to(dtype).double(), t.to(dtype).double()) for x, t in batches]
                    ) if dtype == torch.float64 else None
    net = net.to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a disabled layer warns
        snap = train(net, [(x.to(dtype), t.to(dtype)) for x, t in batches])
    for name, stats in snap.layers.items():
        assert stats.weight_grad_norm is not None and stats.weight_grad_norm > 0, name
        if ref is not None:
            for field, value in ref[name].items():
                assert measured(stats)[field] == pytest.approx(value, rel=1e-5), (name, field)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_measures_each_backward_once(reentrant: bool) -> None:
    plain = model()
    expected = train(plain, [batch()])
    net = model()

    def run(x: torch.Tensor) -> torch.Tensor:
        h = net[0](x)
        for block in list(net)[1:]:
            h = checkpoint(block, h, use_reentrant=reentrant)
        return h

    x, target = batch()
    got = train(net, [(x.requires_grad_(), target)], run=run)
    for name, stats in expected.layers.items():
        a, b = measured(stats), measured(got.layers[name])
        for field in ("grad_out_rms", "grad_in_rms", "weight_grad_norm"):
            assert b[field] == pytest.approx(a[field], rel=1e-5), (name, field)


@pytest.mark.parametrize("kernel", ["torch", "auto"])
def test_only_full_tier_steps_are_measured_and_the_option_turns_it_off(kernel: str) -> None:
    from normwatch.measure.backends.native import lane

    net = model()
    w = normwatch.watch(net, flush_every=4, stats_every=2, report_dir=None, kernel=kernel)
    grads = [h.grads for h in w._measure._hooks]
    in_cpp = [g is not None and g._lane is not None for g in grads]
    # (kernel="torch": Python hooks; else the C++ lane's, where it is built)
    assert all(in_cpp) == (kernel == "auto" and lane.module() is not None) and \
        (all(in_cpp) or not any(in_cpp))
    hooked = []
    for step in range(4):  # full tier: steps 1 and 3
        # (a Python hook, or the C++ lane's: the layer holds its handle)
        hooked.append([g is not None and g._weight_handle is not None for g in grads])
        x, target = batch()
        scale = 1.0 if step % 2 == 0 else 10.0  # (a sentinel step measured would show)
        (net(x) * target * scale).sum().backward()
        w.step()
    # a Python weight hook is registered for the measured backwards only; a C++ one stays
    # (returning at once on the other steps)
    assert hooked == [[True] * len(grads), in_cpp] * 2
    snap = w.last_snapshot
    assert snap is not None
    one = train(model(), [batch()])
    for name, stats in snap.layers.items():
        assert stats.grad_out_rms == pytest.approx(one.layers[name].grad_out_rms, rel=1e-5)
        assert stats.weight_grad_norm == pytest.approx(one.layers[name].weight_grad_norm,
                                                       rel=1e-5)
    w.close()
    assert all(g is not None and g._weight_handle is None for g in grads)
    off = train(model(), [batch()], gradients=False)
    assert all(s.grad_out_rms is None and s.weight_grad_norm is None
               for s in off.layers.values())
    assert all(not m._forward_pre_hooks for m in model().modules())


def test_a_nonfinite_gradient_is_counted_where_it_arrives() -> None:
    net = model(depth=4)

    class Poison(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, h: torch.Tensor) -> torch.Tensor:
            return h.clone()

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            g = g.clone()
            g[0, 0, 0] = math.nan
            return g

    blocks = list(net)[1:]
    w = normwatch.watch(net, flush_every=1, stats_every=1, report_dir=None)
    x, target = batch()
    h = net[0](x)
    for i, block in enumerate(blocks):
        h = block(Poison.apply(h) if i == 2 else h)
    (h * target).sum().backward()
    snap = w.step()
    assert snap is not None
    order = w.forward_order
    bad = [n for n in order if snap.layers[n].grad_out_nonfinite]
    assert bad == order[:2]  # the poison sits between norms 1 and 2: below it, NaN
    alarm = next(a for a in w.alarms if a.kind == "gradient_nonfinite")
    assert alarm.layer == order[1] and alarm.tag == "born" and alarm.severity == "critical"
    w.close()


def test_hooks_keep_no_tensor_alive_past_the_step() -> None:
    net = model()
    w = normwatch.watch(net, flush_every=1, stats_every=1, report_dir=None)
    x, target = batch()
    y = net(x)
    ref = weakref.ref(y)
    (y * target).sum().backward()
    del y
    gc.collect()
    assert ref() is None
    y = net(x)  # a forward whose backward never runs: its graph goes with it
    ref = weakref.ref(y)
    del y
    gc.collect()
    assert ref() is None
    w.step()
    w.close()


def test_a_failing_gradient_hook_warns_once_and_training_goes_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("boom")

    # every way a gradient is read fails: torch's reductions, the C readers' planning
    # (the Python hooks' and the C++ hooks' alike), the gradient through the norm's
    monkeypatch.setattr(torchops, "token_rows", broken)
    monkeypatch.setattr(readers, "grad_read_plan", broken)
    monkeypatch.setattr(native_lane, "grad_read_plan", broken)
    monkeypatch.setattr(readers.ThroughReader, "plan", broken)
    net = model()
    w = normwatch.watch(net, flush_every=1, stats_every=1, report_dir=None)
    with pytest.warns(RuntimeWarning, match="boom") as caught:
        for _ in range(2):
            x, target = batch()
            (net(x) * target).sum().backward()
            w.step()
    assert len([c for c in caught if "boom" in str(c.message)]) == len(w.layers)
    assert set(w.disabled) == set(w.forward_order)
    w.close()


def test_the_staged_fold_equals_a_float64_reference() -> None:
    """Hooks stage rows that the accumulator folds at once (fold_grads): a float64
    reference's numbers, NaN/inf tokens dropped (and a gradient holding one gives no
    peak), whatever the order, the widths and an early commit."""
    from normwatch.measure.backends.torchops import token_rows
    from normwatch.measure.state.accumulator import Accumulator
    from normwatch.measure.state.rows import SITES, WEIGHT, GradRows

    gen = torch.Generator().manual_seed(3)
    grads = []  # (layer, site, gradient (tokens, width))
    for layer, site, shape in [(0, 0, (7, 16)), (2, 1, (7, 16)), (0, 2, (5, 8)),
                               (1, 0, (9, 32)), (0, 0, (7, 16)), (2, 2, (3, 16))]:
        g = torch.randn(*shape, generator=gen) * 10.0 ** float(torch.randint(-3, 3, (1,)))
        grads.append((layer, site, g))
    grads[1][2][2, 5] = math.nan
    grads[3][2][0, 0] = -math.inf
    grads[4][2][6, :] = math.inf
    weights = [(1, torch.randn(16, generator=gen)), (1, torch.randn(16, generator=gen)),
               (2, torch.randn(8, generator=gen))]

    staged = Accumulator(3, partial(choose, kernel="auto"),
                         max_staged_tokens=20)  # commits part-way through
    for layer, site, g in grads:
        staged.stage_grad(GradRows(*token_rows(g), layer, site, g.shape[1]))
    for layer, w in weights:
        staged.stage_grad(GradRows(torch.linalg.vector_norm(w), None, None, layer, WEIGHT, 1))
    got, _ = staged.read()

    for layer, site in {(la, s) for la, s, _ in grads}:
        mine = [g.double() for la, s, g in grads if (la, s) == (layer, site)]
        ok = [g[torch.isfinite(g).all(1)] for g in mine]
        name = SITES[site]
        want = {f"{name}_tokens": sum(g.shape[0] for g in mine),
                f"{name}_finite": sum(g.shape[0] for g in ok),
                f"{name}_sumsq": sum(float((g * g).sum()) for g in ok),
                f"{name}_elements": sum(g.numel() for g in ok),
                f"{name}_absmax": max((float(g.abs().max()) for g in mine
                                       if torch.isfinite(g).all()), default=-math.inf)}
        for column, value in want.items():
            assert got[layer][column] == pytest.approx(value, rel=1e-5), column
    assert got[1]["weight_grads"] == 2 and got[2]["weight_grads"] == 1
    assert got[1]["weight_grad_sumsq"] == pytest.approx(
        sum(float(w.double().square().sum()) for la, w in weights if la == 1), rel=1e-6)
    assert got[0]["weight_grads"] == 0


def test_a_measured_steps_gradients_are_folded_when_the_step_ends() -> None:
    """Staged gradient rows do not outlive their step (kept until the flush they slowed
    the model's own allocations): folded at ``watch.step()``, read at the flush."""
    from normwatch.measure.state.grad_fold import SUM_AT

    net = model()
    w = normwatch.watch(net, flush_every=10, stats_every=1, report_dir=None)
    acc = w._measure.accumulator
    x, target = batch()
    (net(x) * target).sum().backward()
    assert acc.has_staged_grads
    w.step()
    assert not acc.has_staged_grads
    block = acc.blocks[torch.device("cpu")]
    assert (block[:, SUM_AT["grad_out"]] == 15).all()  # 3 x 5 tokens per norm, one step
    w.close()


def formula_used(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """What :meth:`GradHooks.computes` answers, call by call, from now on."""
    real, answers = normwatch.measure.layer.gradients.GradHooks.computes, []

    def counting(self: Any, *args: Any) -> bool:
        answers.append(real(self, *args))
        return answers[-1]

    monkeypatch.setattr(normwatch.measure.layer.gradients.GradHooks, "computes", counting)
    return answers


def norm_classes() -> dict[str, Any]:
    transformers = pytest.importorskip("transformers")
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    assert transformers is not None
    return {"LayerNorm": nn.LayerNorm, "RMSNorm": nn.RMSNorm, "LlamaRMSNorm": LlamaRMSNorm,
            "GemmaRMSNorm (1 + w)": GemmaRMSNorm,
            "LayerNorm without weight": lambda d: nn.LayerNorm(d, elementwise_affine=False)}


@pytest.mark.parametrize("name", ["LayerNorm", "RMSNorm", "LlamaRMSNorm", "GemmaRMSNorm (1 + w)",
                                  "LayerNorm without weight"])
def test_the_gradient_through_a_float32_cpu_norm_is_computed_as_its_nodes_give_it(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where autograd keeps the norm's input anyway (float32 on the CPU, no checkpoint),
    the gradient through the norm is computed from the output's, the input and the weight
    in one hook: every gradient statistic as the hooks on the norm's own nodes read it
    (autograd's values), for torch's and Hugging Face's norms."""
    make = norm_classes()[name]
    torch.manual_seed(0)
    blocks = [Block(16, pre, make) for pre in (True, False, True)]
    for b in blocks:
        if getattr(b.norm, "weight", None) is not None:
            nn.init.uniform_(b.norm.weight, 0.5, 1.5)  # type: ignore[arg-type]
    net = nn.Sequential(nn.Linear(16, 16), *blocks)
    batches = [batch(seed) for seed in range(2)]
    monkeypatch.setattr(native_lane, "state", lambda *a: None)  # (GradHooks decide alone)
    answers = formula_used(monkeypatch)
    computed = train(copy.deepcopy(net), batches)
    assert answers == [True] * 6  # 3 norms, 2 backwards
    monkeypatch.setattr(normwatch.measure.layer.gradients.GradHooks, "computes",
                        lambda self, *args: False)
    walked = train(copy.deepcopy(net), batches)
    for layer, stats in walked.layers.items():
        want, got = measured(stats), measured(computed.layers[layer])
        for field, value in want.items():
            if value is None:  # (a norm without weight)
                assert field == "weight_grad_norm" and got[field] is None
            else:
                assert got[field] == pytest.approx(value, rel=1e-5), (layer, field)


@pytest.mark.parametrize("case", ["bf16", "checkpoint", "second input"])
def test_where_autograd_would_not_keep_the_input_the_norms_nodes_are_read(
        case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 norm (an RMSNorm casting to float32 keeps the cast, not its input), a
    checkpointed one (its saved tensors are dropped), a norm with a second tensor input
    (the formula of x alone does not hold): the gradient through it is read from its own
    nodes, and measured."""
    class Gated(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(d)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h + self.norm(h) * 2.0

    class GatedNorm(nn.LayerNorm):
        def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None  # type: ignore[override]
                    ) -> torch.Tensor:
            out = super().forward(x)
            return out if gate is None else out * torch.sigmoid(gate)

    class WithGate(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.norm = GatedNorm(d)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h + self.norm(h, h * 0.5)

    torch.manual_seed(0)
    net: nn.Module = nn.Sequential(nn.Linear(16, 16), WithGate(16) if case == "second input"
                                   else Gated(16))
    run = None
    batches = [batch(seed) for seed in range(2)]  # (the second call takes the lane)
    if case == "bf16":
        net, batches = net.bfloat16(), [(x.bfloat16(), t.bfloat16()) for x, t in batches]
    elif case == "checkpoint":
        def run(x: torch.Tensor) -> torch.Tensor:
            return checkpoint(net, x, use_reentrant=False)  # type: ignore[no-any-return]
    answers = formula_used(monkeypatch)
    snap = train(net, batches, run=run)
    assert answers == [False] * 2 if case != "second input" else not answers
    (stats,) = snap.layers.values()
    assert stats.grad_in_rms is not None and stats.grad_in_rms > 0


def test_the_computed_gradient_keeps_no_input_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook that computes the gradient through a norm lets its input go once it ran:
    a loop that keeps the loss (and so the graph's nodes) keeps no activation."""
    seen: list[weakref.ref[torch.Tensor]] = []

    class Watched(nn.LayerNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            seen.append(weakref.ref(x))
            return super().forward(x)

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), Block(16, True, Watched), Block(16, False, Watched))
    answers = formula_used(monkeypatch)
    w = normwatch.watch(net, flush_every=1, stats_every=1, report_dir=None)
    x, target = batch()
    loss = (net(x) * target).sum()
    loss.backward()
    gc.collect()
    assert answers == [True, True] and len(seen) == 2
    assert [r() for r in seen] == [None, None]
    assert loss.grad_fn is not None  # the graph's nodes are still there
    w.step()
    w.close()


def test_an_input_written_in_place_since_is_not_read_for_the_gradient_through(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A norm whose backward keeps its output, not its input (as memory-saving fused norms
    do), lets the model write the input in place afterwards: the gradient through the
    norm is then not computed from the written values (the output's is measured)."""
    class OutputSavingNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            xhat = (x - x.mean(-1, keepdim=True)) * torch.rsqrt(
                x.var(-1, unbiased=False, keepdim=True) + 1e-5)
            rstd = torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5)
            ctx.save_for_backward(xhat, rstd, weight)
            return xhat * weight

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            xhat, rstd, weight = ctx.saved_tensors
            wg = g * weight
            dx = rstd * (wg - wg.mean(-1, keepdim=True)
                         - xhat * (wg * xhat).mean(-1, keepdim=True))
            return dx, (g * xhat).reshape(-1, xhat.shape[-1]).sum(0)

    class SavingLayerNorm(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.ones(d)), 1e-5

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return OutputSavingNorm.apply(x, self.weight)  # type: ignore[no-any-return]

    class Overwrites(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.up, self.norm = nn.Linear(d, d), SavingLayerNorm(d)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            a = self.up(h)
            y = self.norm(a)
            a.mul_(3.0)  # allowed: nothing saved it
            return y + a

    torch.manual_seed(0)
    net = Overwrites(16)
    answers = formula_used(monkeypatch)
    snap = train(net, [batch()])
    assert answers == [True]
    stats = snap.layers["norm"]
    assert stats.grad_out_rms is not None and stats.grad_out_rms > 0
    assert stats.grad_in_rms is None
