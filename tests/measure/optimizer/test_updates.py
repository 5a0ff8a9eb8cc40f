"""Gradient and update norms from optimizer step hooks, against a float64 reference."""

from __future__ import annotations

import math
import warnings
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import normwatch
import normwatch.measure.optimizer.updates
from normwatch.demos.toymodel import TinyLM, lm_loss, synthetic_batch
from normwatch.errors import ConfigError
from normwatch.measure.backends import choose
from normwatch.measure.backends.native import lane as fastlane
from normwatch.measure.backends.native.build import library
from normwatch.measure.backends.native.sampler import NativePack, NativeSampler
from normwatch.measure.backends.triton_kernel import usable
from normwatch.measure.backends.triton_optimizer import TritonPack
from normwatch.measure.optimizer.updates import Pack
from tests.threads import threads

BACKENDS = partial(choose, kernel="auto")

NATIVE = pytest.mark.skipif(library() is None, reason="no C compiler: no native kernel")
TRITON = pytest.mark.skipif(not usable(), reason="Triton cannot run here")
KEPT = {"auto": NativePack, "triton": TritonPack}
"""The pack each ``kernel=`` keeps its copies in (on the CPU; torch's: a Pack)."""


def held(w: normwatch.Watch) -> tuple[int, set[type]]:
    """``(elements the update monitor's buffers hold now, the kinds of its packs)``."""
    packs = [pack for s in w._updates._sampled.values() for _, pack in s.packs]
    return sum(pack.kept.numel() if isinstance(pack, NativePack | TritonPack) else
               sum(b.numel() for slot in pack.buffers for b in slot if b is not None)
               for pack in packs), {type(pack) for pack in packs}


def memory_order_sample(t: torch.Tensor) -> float:
    """The documented sample's weighted sum of squares in float64, read in ``t``'s memory
    order (a dense tensor's dims by falling stride)."""
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    flat = t.detach().permute(*order).double().flatten()
    n = flat.numel()
    picked = flat if n < 4736 else flat[:n - n % 16].view(-1, 16)[::37].flatten()
    return float(picked.square().sum()) * n / picked.numel()


def reference(params: list[torch.nn.Parameter], before: list[torch.Tensor]
              ) -> tuple[float, ...]:
    """Gradient, update and parameter L2 norms in float64, one parameter at a time, and
    the same three estimated from every 37th block of 16 elements of each tensor of 4736
    or more (the documented sample), scaled by elements per sampled element."""
    def norm(ts: list[torch.Tensor]) -> float:
        return math.sqrt(sum(float(t.double().square().sum()) for t in ts))

    with_grad = [(p, b) for p, b in zip(params, before, strict=True) if b is not None]
    changes = [p.detach() - b[0] for p, b in with_grad]
    now = [p.detach() for p, _ in with_grad]
    return (norm([b[1] for _, b in with_grad]), norm(changes), norm(now),
            math.sqrt(sum(memory_order_sample(b[1]) for _, b in with_grad)),
            math.sqrt(sum(memory_order_sample(c) for c in changes)),
            math.sqrt(sum(memory_order_sample(t) for t in now)))


def exact_step(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer,
               loss: torch.Tensor) -> float:
    """Backward ``loss`` and take the step: the float64 norm of the change it made."""
    loss.backward()
    before = [p.detach().clone() for p in params]
    opt.step()
    opt.zero_grad()
    return math.sqrt(sum(float((p.detach() - b).double().square().sum())
                         for p, b in zip(params, before, strict=True)))


@pytest.mark.parametrize(("kept", "kernel"), [
    pytest.param(True, "auto", marks=NATIVE), (True, "torch"), (False, "torch"),
    pytest.param(True, "triton", marks=TRITON)],
    ids=["copies kept, native", "copies kept, torch", "copies per step", "copies kept, triton"])
def test_norms_match_a_float64_reference_with_two_optimizers_and_accumulation(
        kept: bool, kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU's C kernel (copies kept: ``kernel="auto"``), torch's ops on kept copies,
    the accelerators' torch path (a transient copy per step) and the CUDA path's Triton
    kernel (copies kept)."""
    if not kept:  # the accelerator path: a transient copy per step
        monkeypatch.setattr(normwatch.measure.optimizer.updates, "KEEP_ON", frozenset())
    model = TinyLM(dim=32, depth=2)
    model.blocks[0].requires_grad_(False)  # frozen: no gradient, no update, not counted
    head = [p for n, p in model.named_parameters() if n.startswith("blocks.1")]
    rest = [p for n, p in model.named_parameters()
            if not n.startswith(("blocks.0", "blocks.1"))]
    adam = torch.optim.AdamW(head, lr=1e-2, weight_decay=0.1)
    sgd = torch.optim.SGD(rest, lr=0.05, momentum=0.9)
    w = normwatch.watch(model, adam, flush_every=3, report_dir=None, kernel=kernel)
    w.watch_optimizer(sgd)
    w.watch_optimizer(sgd)  # twice: still one set of hooks
    params = head + rest
    gen = torch.Generator().manual_seed(0)
    expected = []
    for _ in range(6):
        for _ in range(2):  # gradient accumulation: two micro-batches per step
            tokens = synthetic_batch(gen, batch=2, seq=8)
            (lm_loss(model(tokens), tokens) / 2).backward()
        before = [(p.detach().clone(), p.grad.clone()) if p.grad is not None else None
                  for p in params]
        adam.step()
        sgd.step()
        expected.append(reference(params, before))  # type: ignore[arg-type]
        adam.zero_grad()
        sgd.zero_grad()
        w.step()
    got = [u for s in [w.flush()] for u in s.updates]
    snapshots = [u for u in w.court.updates]
    assert [u.step for u in snapshots] == [1, 2, 3, 4, 5, 6] and got == []
    for u, (g, d, _, grad, update, _) in zip(snapshots, expected, strict=True):
        # |p| is measured on full-tier steps (1 and 5: stats_every=4), carried between
        measured = expected[(u.step - 1) // 4 * 4]
        assert u.grad_norm == pytest.approx(grad, rel=1e-6)  # the sample's arithmetic
        assert u.update_norm == pytest.approx(update, rel=1e-5)
        assert u.param_norm == pytest.approx(measured[5], rel=1e-6)
        assert u.grad_norm == pytest.approx(g, rel=3e-2)  # estimates over ~20k elements
        assert u.update_norm == pytest.approx(d, rel=3e-2)
        assert u.param_norm == pytest.approx(measured[2], rel=3e-2)
        assert u.lr == 0.05 and u.update_ratio == pytest.approx(d / measured[2], rel=3e-2)
    assert w._updates._pending == set()
    elements, kinds = held(w)
    assert bool(elements) == kept  # on accelerators the copy lives for the step only
    assert kinds == {KEPT.get(kernel, Pack) if kept else Pack}
    w.close()
    assert w._updates._sampled == {}
    assert not adam._optimizer_step_pre_hooks and not sgd._optimizer_step_post_hooks


@pytest.mark.parametrize("kernel", [pytest.param("auto", marks=NATIVE), "torch",
                                    pytest.param("triton", marks=TRITON)])
def test_the_update_copy_holds_a_sixteenth_of_the_parameters(kernel: str) -> None:
    """What the monitor keeps between steps (CPU) or allocates for a step: every 37th
    block of the large tensors, before and after the step (torch's ops) or the values
    read last (the C kernel, the Triton kernel); the estimated update norm within 1 % of
    the exact one over a real loop (AdamW, a learning-rate spike included)."""
    torch.manual_seed(0)
    model = TinyLM(dim=128, depth=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    w = normwatch.watch(model, opt, flush_every=100, report_dir=None, kernel=kernel)
    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(0)
    exact = []
    for step in range(1, 9):
        for group in opt.param_groups:
            group["lr"] = 1e-3 * (100.0 if step == 6 else 1.0)
        tokens = synthetic_batch(gen, batch=4, seq=16)
        exact.append(exact_step(params, opt, lm_loss(model(tokens), tokens)))
        w.step()
    kept, kinds = held(w)
    total = sum(p.numel() for p in params)
    assert 0 < kept <= total / (16 if kernel == "torch" else 32), (kept, total)
    assert kinds == {KEPT.get(kernel, Pack)}
    got = [u.update_norm for u in w.flush().updates]
    assert got == pytest.approx(exact, rel=1e-2)
    assert max(got) == got[5]  # the spike stands out as it does exactly
    w.close()


@pytest.mark.parametrize("kernel", [pytest.param("auto", marks=NATIVE), "torch",
                                    pytest.param("triton", marks=TRITON)])
def test_a_write_between_steps_is_not_taken_for_the_update(kernel: str) -> None:
    """On the CPU the values after one step stand for the values before the next; a
    parameter written in place between steps (here: halved) is copied again, so each
    update is the optimizer's own change, within the sample's error of the exact one."""
    torch.manual_seed(0)
    model = TinyLM(dim=128, depth=2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    w = normwatch.watch(model, opt, flush_every=100, report_dir=None, kernel=kernel)
    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(0)
    exact = []
    for step in range(1, 6):
        if step == 3:
            with torch.no_grad():
                model.embed.weight.mul_(0.5)
                model.blocks[0].mlp.up.weight.mul_(0.5)
        tokens = synthetic_batch(gen, batch=4, seq=16)
        exact.append(exact_step(params, opt, lm_loss(model(tokens), tokens)))
        w.step()
    got = [u.update_norm for u in w.flush().updates]
    assert got == pytest.approx(exact, rel=6e-2)  # the halving moved them 10x more
    w.close()


def step_allocations(optimizer: str, watched: bool, guard: bool = False, dim: int = 128
                     ) -> tuple[int, int]:
    """``(bytes the second optimizer step allocates, bytes of parameters)``, on the
    accelerator path (a copy per step), every allocation counted, freed or not."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = TinyLM(dim=dim, depth=2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9) \
        if optimizer == "sgd" else \
        torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=optimizer.endswith("h"))
    w = normwatch.watch(model, opt if watched else None, report_dir=None, guard=guard,
                        kernel="torch")  # (as on an accelerator without Triton)
    gen = torch.Generator().manual_seed(0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(normwatch.measure.optimizer.updates, "KEEP_ON", frozenset())
        for _ in range(2):  # the second step: the optimizer's state exists
            tokens = synthetic_batch(gen, batch=2, seq=8)
            lm_loss(model(tokens), tokens).backward()
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                opt.step()
            opt.zero_grad()
            w.step()
    w.close()
    total = sum(e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0)
    return total, sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("optimizer", ["adamw", "adamw foreach", "sgd"])
def test_what_a_step_allocates_is_a_sixteenth_of_the_parameters(optimizer: str) -> None:
    """Measured with the profiler: everything the watched optimizer step allocates beyond
    the unwatched one's is at most 1/16 of the parameters' bytes (a bound on the peak)."""
    plain, params = step_allocations(optimizer, watched=False)
    watched, _ = step_allocations(optimizer, watched=True)
    assert 0 < watched - plain <= params / 16, (watched - plain, params)


def test_what_the_guard_allocates_does_not_grow_with_the_parameters() -> None:
    """The guard's check (a norm per gradient, its flags) allocates scalars: the same few
    KB for a model with 3.5x the parameters (and the monitor then samples no gradient)."""
    extra = []
    for dim in (64, 128):
        guarded, params = step_allocations("adamw", watched=True, guard=True, dim=dim)
        watched, _ = step_allocations("adamw", watched=True, dim=dim)
        extra.append((guarded - watched, params))
    (small, small_params), (large, large_params) = extra
    assert large_params > 3 * small_params
    assert abs(large - small) <= 1024 and large <= 8192, extra


@pytest.mark.parametrize("kernel", ["auto", pytest.param("triton", marks=TRITON)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_with_the_guard_the_gradient_norm_is_the_exact_one(dtype: torch.dtype,
                                                           kernel: str) -> None:
    """The guard reads every gradient before the step (its NaN check; on the CUDA path
    the check kernel's sum): the monitor reports that exact norm, not the sample's
    estimate; the update is still the sample's."""
    torch.manual_seed(0)
    model = TinyLM(dim=64, depth=2).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    w = normwatch.watch(model, opt, guard=True, flush_every=100, report_dir=None,
                        kernel=kernel)
    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(0)
    exact = []
    for _ in range(3):
        tokens = synthetic_batch(gen, batch=2, seq=8)
        lm_loss(model(tokens).float(), tokens).backward()
        exact.append(math.sqrt(sum(float(p.grad.double().square().sum()) for p in params)))
        opt.step()
        opt.zero_grad()
        w.step()
    got = w.flush().updates
    assert [u.grad_norm for u in got] == pytest.approx(exact, rel=1e-5)
    w.close()
    sampled = normwatch.watch(model, opt, flush_every=100, report_dir=None)
    tokens = synthetic_batch(gen, batch=2, seq=8)
    lm_loss(model(tokens).float(), tokens).backward()
    whole = math.sqrt(sum(float(p.grad.double().square().sum()) for p in params))
    opt.step()
    sampled.step()
    (u,) = sampled.flush().updates
    assert u.grad_norm != pytest.approx(whole, rel=1e-5)  # the estimate: not exact
    assert u.grad_norm == pytest.approx(whole, rel=5e-2)
    sampled.close()


def test_half_precision_gradients_sum_without_overflowing() -> None:
    layer = torch.nn.Linear(512, 512, bias=False).half()
    opt = torch.optim.SGD(layer.parameters(), lr=1e-6)
    w = normwatch.watch(torch.nn.Sequential(torch.nn.LayerNorm(512), layer), opt,
                        report_dir=None)
    layer.weight.grad = torch.full_like(layer.weight, 300.0)  # |g|² = 2.4e10 >> 65504
    opt.step()
    w.step()
    (u,) = w.flush().updates
    assert u.grad_norm == pytest.approx(300.0 * 512, rel=1e-3)
    assert math.isfinite(u.update_norm) and u.update_norm > 0


def test_wrappers_are_unwrapped_and_bad_input_names_the_argument() -> None:
    model = TinyLM(dim=16, depth=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = normwatch.watch(model, report_dir=None)
    w.watch_optimizer(SimpleNamespace(optimizer=opt))  # Accelerate/Lightning-style wrapper
    tokens = synthetic_batch(torch.Generator().manual_seed(0), batch=2, seq=8)
    lm_loss(model(tokens), tokens).backward()
    opt.step()
    w.step()
    assert len(w.flush().updates) == 1
    with pytest.raises(ConfigError, match=r"'optimizer' must be a torch.optim.Optimizer.*"
                                          r"got str"):
        w.watch_optimizer("adam")
    w.close()
    with pytest.raises(ConfigError, match="'optimizer'"):
        normwatch.watch(model, optimizer=[opt])


@pytest.mark.parametrize("kernel", [pytest.param("auto", marks=NATIVE), "torch",
                                    pytest.param("triton", marks=TRITON)])
def test_a_failing_hook_warns_once_and_training_goes_on(kernel: str,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    model = TinyLM(dim=16, depth=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    w = normwatch.watch(model, opt, report_dir=None, kernel=kernel)

    def broken(*args: object) -> torch.Tensor:
        raise RuntimeError("no norms today")

    made = NativeSampler.make

    def breaking(*args: object) -> NativeSampler | None:
        lane = made(*args)  # type: ignore[arg-type]
        if lane is not None:  # the C++ path breaks too
            lane.measure = broken
        return lane

    monkeypatch.setattr(Pack, "sumsq", broken)
    monkeypatch.setattr(NativePack, "measure", broken)
    monkeypatch.setattr(TritonPack, "measure", broken)
    monkeypatch.setattr(NativeSampler, "make", breaking)
    gen = torch.Generator().manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            tokens = synthetic_batch(gen, batch=2, seq=8)
            lm_loss(model(tokens), tokens).backward()
            weight = model.norm.weight.detach().clone()
            opt.step()
            assert not torch.equal(weight, model.norm.weight)  # the step still happened
            opt.zero_grad()
            w.step()
    failures = [c for c in caught if "measuring the optimizer step failed" in str(c.message)]
    assert len(failures) == 1 and "no norms today" in str(failures[0].message)
    assert w.flush().updates == () and not opt._optimizer_step_pre_hooks


def test_sparse_embedding_gradients_are_counted_by_their_values() -> None:
    model = nn.Sequential(nn.Embedding(50, 8, sparse=True), nn.LayerNorm(8))
    opt = torch.optim.SparseAdam(list(model[0].parameters()), lr=0.1)
    w = normwatch.watch(model, opt, report_dir=None)
    ids = torch.tensor([[1, 2, 2, 7]])
    model(ids).pow(2).sum().backward()
    grad = model[0].weight.grad.coalesce().values().double().norm()  # type: ignore[union-attr]
    opt.step()
    w.step()
    (u,) = w.flush().updates
    assert u.grad_norm == pytest.approx(float(grad), rel=1e-6) and u.update_norm > 0


def test_a_gradient_laid_out_unlike_its_parameter_is_measured_as_its_own() -> None:
    """A gradient assigned as a view of a wider tensor (its rows further apart than its
    parameter's) is not sampled at the parameter's offsets, which would read the
    elements between its rows: it is measured tensor by tensor, as the values it holds."""
    lin = nn.Linear(64, 128, bias=False)  # 8192 elements: sampled, not copied whole
    opt = torch.optim.SGD(lin.parameters(), lr=0.0)
    w = normwatch.watch(nn.Sequential(lin, nn.LayerNorm(128)), opt, report_dir=None)
    wide = torch.full((128, 128), 1e6)
    wide[:, :64] = torch.randn(128, 64, generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # (the second step: the parameter list is known, the fast path)
        lin.weight.grad = wide[:, :64]
        opt.step()
        w.step()
    updates = w.flush().updates
    assert [u.grad_norm for u in updates] == [pytest.approx(float(wide[:, :64].norm()),
                                                            rel=1e-5)] * 2
    w.close()


@pytest.mark.parametrize("kept", [True, False], ids=["copies kept", "copies per step"])
def test_channels_last_and_transposed_parameters_are_measured_in_memory_order(
        kept: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A channels_last conv (weights and gradients not contiguous, dense in another order),
    a parameter stored transposed and one with gaps in memory: their update norms against
    float64, step by step (a sample taken as a copy once would read stale values)."""
    if not kept:
        monkeypatch.setattr(normwatch.measure.optimizer.updates, "KEEP_ON", frozenset())
    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(16, 64, 3), nn.GroupNorm(4, 64), nn.Conv2d(64, 64, 3))
    conv = conv.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    assert not conv[2].weight.is_contiguous()
    head = nn.Parameter((0.1 * torch.randn(96, 64)).t())  # (64, 96), stored transposed
    gaps = nn.Parameter((0.1 * torch.randn(96, 200))[:, :96])  # not dense: sampled as a copy
    assert not head.is_contiguous() and not gaps.is_contiguous()
    params = [*conv.parameters(), head, gaps]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    w = normwatch.watch(conv, opt, flush_every=100, report_dir=None)
    gen = torch.Generator().manual_seed(0)
    exact = []
    for _ in range(4):
        x = torch.randn(2, 16, 12, 12, generator=gen).to(memory_format=torch.channels_last)
        loss = (conv(x).mean((2, 3)) @ head @ gaps).square().mean() + gaps.square().sum()
        exact.append(exact_step(params, opt, loss))
        w.step()
    got = [u.update_norm for u in w.flush().updates]
    assert got == pytest.approx(exact, rel=8e-2)  # stale copies: 1.3x to 470x off
    w.close()


@pytest.mark.parametrize(("kernel", "rel"), [pytest.param("auto", 1e-9, marks=NATIVE),
                                             pytest.param("triton", 1e-6, marks=TRITON)],
                         ids=["C", "triton"])
def test_the_kernels_sum_the_documented_sample_in_float64(kernel: str, rel: float) -> None:
    """One C call per dtype (here fp32, bf16 and fp16 parameters: three packs), or one
    Triton launch (float32 per program of 1024 sampled elements, float64 across), against
    float64 sums of the documented sample, step by step: parameters stored channels_last
    and transposed (read in memory order), small ones read whole; gradients, updates and
    ``|p|`` on every step (``stats_every=1``)."""
    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(16, 64, 3), nn.GroupNorm(4, 64))
    conv = conv.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    head = nn.Parameter((0.1 * torch.randn(96, 64)).t())  # stored transposed
    low = {dtype: nn.Parameter(torch.randn(80, 100, dtype=dtype)) for dtype in
           (torch.bfloat16, torch.float16)}
    params = [*conv.parameters(), head, *low.values()]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    w = normwatch.watch(conv, opt, flush_every=100, stats_every=1, report_dir=None,
                        kernel=kernel)
    gen = torch.Generator().manual_seed(0)
    expected = []
    for _ in range(3):
        x = torch.randn(2, 16, 12, 12, generator=gen).to(memory_format=torch.channels_last)
        loss = (conv(x).mean((2, 3)) @ head).square().mean() + sum(
            (p.float() - 0.5).square().mean() for p in low.values())
        loss.backward()  # type: ignore[union-attr]
        before = [(p.detach().clone(), p.grad.clone()) for p in params]  # type: ignore[union-attr]
        opt.step()
        expected.append([math.sqrt(sum(memory_order_sample(t) for t in ts)) for ts in (
            [g for _, g in before], [p.detach() - b for p, (b, _) in zip(params, before,
                                                                          strict=True)],
            [p.detach() for p in params])])
        opt.zero_grad()
        w.step()
    _, kinds = held(w)
    assert kinds == {KEPT[kernel]} and len(w._updates._sampled[id(opt)].packs) == 3
    assert (w._updates._sampled[id(opt)].lane is None) == \
        (fastlane.module() is None or kernel == "triton")
    got = [[u.grad_norm, u.update_norm, u.param_norm] for u in w.flush().updates]
    assert len(got) == 3
    for row, want in zip(got, expected, strict=True):
        assert row == pytest.approx(want, rel=rel)
    w.close()


@NATIVE
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_large_sample_split_over_threads_sums_as_one_thread(dtype: torch.dtype) -> None:
    """Past :data:`~normwatch.measure.backends.native.sampler.SPLIT_FROM` blocks the C kernel
    splits each tensor's blocks over torch's threads: the same three sums as one
    thread (to float64 rounding: only their order differs) and as the float64 reference
    of the documented sample, and the same values kept for the next step (the runs
    each thread writes meet end to end: odd block counts, a small tensor read whole)."""
    from normwatch.measure.backends.native import sampler as native_updates

    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=gen).to(dtype)
              for shape in ((1031, 517), (64, 1000), (300,), (777, 129))]
    grads = [torch.randn(p.shape, generator=gen).to(dtype) for p in params]
    sampled = normwatch.measure.optimizer.updates._Sampled(params, BACKENDS)
    (_, pack), = sampled.packs
    assert isinstance(pack, NativePack) and sum(pack._blocks) >= native_updates.SPLIT_FROM
    with threads(2):
        results = []
        for split in (False, True):
            pack._split = split
            pack.store()
            for p in params:
                p.mul_(0.5)  # the step's change: half of each parameter
            row = pack.measure(None, grads, True)
            results.append((row.tolist(), pack.kept.clone()))
            for p in params:
                p.mul_(2.0)  # exact in binary floating point: as they were
    (one, kept_one), (split_row, kept_split) = results
    assert split_row == pytest.approx(one, rel=1e-12)
    assert torch.equal(kept_one, kept_split)
    half = [p.double() * 0.5 for p in params]
    want = [sum(memory_order_sample(t) for t in ts) for ts in (grads, half, half)]
    assert split_row == pytest.approx(want, rel=1e-9)
    for p in params:
        p.mul_(0.5)
    assert torch.equal(kept_split, torch.cat([s.reshape(-1) for s in sampled.samples]))


def test_a_shard_is_scaled_by_its_own_elements() -> None:
    """Under FSDP2 each rank samples its local shard: the sample stands for the shard's
    elements, not the whole parameter's (which would scale each rank's sums by the world
    size). Here a parameter whose ``to_local()`` is half of it, as a DTensor's shard."""
    class Sharded(nn.Parameter):
        def to_local(self) -> torch.Tensor:
            return self.detach()[: self.shape[0] // 2]

    param = Sharded(torch.randn(200, 100))
    sampled = normwatch.measure.optimizer.updates._Sampled([param], BACKENDS)
    (shard,) = sampled.samples
    assert shard.numel() == 17 * 16  # every 37th block of the shard's 625
    assert sampled.scales == [100 * 100 / shard.numel()]


@pytest.mark.parametrize("kernel", [pytest.param("auto", marks=NATIVE), "torch",
                                    pytest.param("triton", marks=TRITON)])
def test_an_empty_parameter_adds_nothing(kernel: str) -> None:
    """A parameter with no elements (a zero-width layer) in the optimizer: read as nothing,
    the norms those of the others."""
    norms = []
    for extra in (False, True):
        torch.manual_seed(0)
        model = TinyLM(dim=16, depth=1)
        empty = nn.Parameter(torch.zeros(0))
        params = [*model.parameters(), empty] if extra else list(model.parameters())
        opt = torch.optim.SGD(params, lr=0.1)
        w = normwatch.watch(model, opt, report_dir=None, kernel=kernel)
        tokens = synthetic_batch(torch.Generator().manual_seed(0), batch=2, seq=8)
        (lm_loss(model(tokens), tokens) + empty.sum()).backward()
        opt.step()
        w.step()
        (u,) = w.flush().updates
        norms.append((u.grad_norm, u.update_norm, u.param_norm))
        w.close()
    assert norms[1] == pytest.approx(norms[0], rel=1e-12) and norms[0][1] > 0


LANE = pytest.mark.skipif(fastlane.module() is None, reason="no C++ module built")


@LANE
def test_the_step_hooks_work_in_cpp_as_the_packs_python_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The C++ sampler (an optimizer whose packs are all NativePacks) against the packs'
    Python path, on two copies of one model trained alike: the same norms bit for bit,
    step by step, through a write between steps (read again), a missing gradient (the
    Python path's per-tensor estimate) and a param group added (the sampler made again);
    on its plain steps the C++ copy calls none of the packs' Python."""
    torch.manual_seed(0)
    models = [TinyLM(dim=64, depth=2) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    extras = [nn.Parameter(torch.full((6000,), 0.01)) for _ in range(2)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    watches = [normwatch.watch(m, o, flush_every=100, report_dir=None)
               for m, o in zip(models, opts, strict=True)]
    calls = {"cpp": 0, "python": 0}
    copy = ["cpp"]
    for cls, name in [(NativePack, "measure"), (NativePack, "store"),
                      (normwatch.measure.optimizer.updates._Sampled, "grads_alike")]:
        def counted(*args: object, _real: object = getattr(cls, name)) -> object:
            calls[copy[0]] += 1
            return _real(*args)  # type: ignore[operator]
        monkeypatch.setattr(cls, name, counted)
    per_step = []
    for step in range(1, 7):
        before = dict(calls)
        for which, (model, opt, w, extra) in enumerate(zip(models, opts, watches, extras,
                                                            strict=True)):
            copy[0] = ["cpp", "python"][which]
            with monkeypatch.context() as patch:
                if which:  # the Python path: no sampler, now or when made again
                    patch.setattr(NativeSampler, "make", classmethod(lambda cls, *a: None))
                    for s in w._updates._sampled.values():
                        s.lane = None
                if step == 3:  # a write between steps
                    with torch.no_grad():
                        model.embed.weight.mul_(0.5)
                if step == 5:
                    opt.add_param_group({"params": [extra]})
                tokens = synthetic_batch(torch.Generator().manual_seed(step), batch=2, seq=8)
                loss = lm_loss(model(tokens), tokens) + (extra.sum() if step >= 5 else 0)
                loss.backward()
                if step == 4:  # a gradient missing: the per-tensor estimate
                    model.norm.weight.grad = None
                opt.step()
                opt.zero_grad()
                w.step()
        per_step.append({k: calls[k] - before[k] for k in calls})
        assert (watches[0]._updates._sampled[id(opts[0])].lane is not None)
    cpp, python = ([(u.grad_norm, u.update_norm, u.param_norm) for u in w.flush().updates]
                   for w in watches)
    assert len(cpp) == 6 and cpp == python
    assert all(u[1] > 0 for u in cpp)
    plain = [n["cpp"] for i, n in enumerate(per_step, 1) if i != 4]
    assert plain == [0] * 5 and per_step[3]["cpp"] > 0  # the missing gradient: Python's
    assert all(n["python"] > 0 for n in per_step)
    for w in watches:
        w.close()
