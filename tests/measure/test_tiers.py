"""Tiers (sentinel every step, full statistics every ``stats_every``), early warnings
without stalls, and a memory soak."""

from __future__ import annotations

import gc
from collections.abc import Callable
from functools import partial

import pytest
import torch
from torch import nn

import normwatch
from normwatch.demos.toymodel import TinyLM, lm_loss, synthetic_batch
from normwatch.measure.backends.torchops import CHUNK_ELEMENTS, reduce_call
from normwatch.measure.step.early import EarlyWarning


def test_sentinel_steps_still_catch_overflow_and_nan() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16))
    w = normwatch.watch(model, flush_every=3, stats_every=3, report_dir=None)
    scales = [1.0, 500.0, 1.0]  # step 1: full; steps 2 and 3: sentinel
    seen: list[torch.Tensor] = []
    model[1].register_forward_hook(lambda m, args, out: seen.append(args[0].detach().double()))
    for scale in scales:
        model(torch.randn(4, 8) * scale).sum().backward()
        w.step()
    over = sum(int((x.abs().amax(1) > 256).sum()) for x in seen)
    assert over > 0
    model(torch.randn(4, 8)).sum().backward()  # step 4: full again
    snap = w.step()
    assert snap is None
    first = w.court.history.records()[0].snapshot.layers["1"]
    assert (first.tokens, first.finite_tokens, first.stats_tokens) == (12, 12, 4)
    assert first.absmax is not None and first.absmax > 256  # seen on a sentinel step
    assert first.fp16_overflow_tokens == over  # per-token max |x| on every step
    assert first.rms_mean is not None  # from the full step only
    nan = torch.full((4, 8), float("nan"))
    model(nan).sum().backward()  # step 5 (sentinel): NaN counted per token
    w.step()
    snap = w.step()  # step 6 ends the interval 4-6
    assert snap is not None
    assert snap.layers["1"].nonfinite == 4  # sentinel: every token holding NaN/inf
    assert snap.first_nonfinite is not None and snap.first_nonfinite.step == 5
    model(nan).sum().backward()  # step 7 (full): the same count
    w.step()
    w.step()
    snap = w.step()
    assert snap is not None and snap.layers["1"].nonfinite == 4
    assert snap.layers["1"].out_nonfinite == 4


class FakeEvent:
    """Reports the copy as landed on the second query, like a busy GPU would."""

    def __init__(self) -> None:
        self.queries = 0

    def record(self) -> None:
        pass

    def query(self) -> bool:
        self.queries += 1
        return self.queries >= 2


def test_early_warning_flushes_within_two_steps_without_waiting() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16))
    w = normwatch.watch(model, flush_every=100, report_dir=None)
    w._early = EarlyWarning(256.0, event_factory=FakeEvent, pin=False)
    flushed_at = []
    for step in range(1, 9):
        x = torch.randn(4, 8) * (1000.0 if step == 3 else 1.0)
        model(x).sum().backward()
        if w.step() is not None:
            flushed_at.append(step)
    assert flushed_at and 3 < flushed_at[0] <= 5  # seen one or two steps late, no stall
    assert any(a.kind == "fp16_overflow" for a in w.alarms)


def test_early_warning_is_quiet_on_healthy_steps() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16))
    w = normwatch.watch(model, flush_every=100, report_dir=None)
    w._early = EarlyWarning(256.0, event_factory=FakeEvent, pin=False)
    for _ in range(20):
        model(torch.randn(4, 8)).sum().backward()
        assert w.step() is None


def _rss_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4


def _live_tensors() -> int:
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def test_soak_2000_steps_memory_is_flat() -> None:
    torch.manual_seed(0)
    model = TinyLM(dim=16, depth=1, heads=2)
    w = normwatch.watch(model, flush_every=10, report_dir=None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(0)
    samples = {}
    for step in range(1, 2001):
        tokens = synthetic_batch(gen, batch=2, seq=8)
        loss = lm_loss(model(tokens), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        w.step(loss)
        if step in (300, 2000):
            gc.collect()
            samples[step] = (_rss_kb(), _live_tensors())
    (rss_a, tensors_a), (rss_b, tensors_b) = samples[300], samples[2000]
    # no growth (the count may fall: objects of earlier tests, e.g. compiled graphs'
    # caches, can be collected meanwhile)
    assert tensors_b <= tensors_a, (tensors_a, tensors_b)
    assert rss_b - rss_a < 8 * 1024, (rss_a, rss_b)  # < 8 MiB drift over 1,700 steps


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak of the bytes allocated and not yet freed while ``fn`` runs (CPU allocator,
    from the profiler's memory events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # an op's own allocations count from its start, its own frees from its end
    moves = sorted((e.time_range.start if e.self_cpu_memory_usage > 0 else e.time_range.end,
                    e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage)
    live = peak = 0
    for _, size in moves:
        live += size
        peak = max(peak, live)
    return peak


def test_peak_bytes_sees_temporaries() -> None:  # the measuring stick itself
    x = torch.randn(1 << 20)
    assert peak_bytes(lambda: torch.empty(1 << 20).add_(1)) >= 4 << 20
    assert peak_bytes(lambda: (x - 1).sum()) >= 4 << 20  # an op's own output
    assert peak_bytes(lambda: x.half().sum(dtype=torch.float32)) >= 2 << 20


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_transient_memory_per_call_is_a_few_floats_per_token(dtype: torch.dtype,
                                                            kind: str, native: bool) -> None:
    """Torch's reductions and the CPU kernel (where it builds: else torch's again)."""
    x = torch.randn(8192, 1024).to(dtype)  # 8192 tokens: 16-32 MiB of activation
    activation = x.numel() * x.element_size()
    for full in (True, False):
        peak = peak_bytes(partial(reduce_call, x, x, kind, 1e-5, full, 0, 1.0, native))
        # two chunk temporaries at most, plus ~16 floats of results per token
        assert peak <= 2 * CHUNK_ELEMENTS * 4 + 16 * 4 * x.shape[0], (full, peak)
        assert peak < activation / 4


def test_each_statistic_is_measured_in_the_tier_the_catalog_declares() -> None:
    """Step 1: full tier, output check, gradients; step 2: the sentinel alone. What the
    catalog says of each statistic's tier is what a flush of each step holds."""
    from normwatch.catalog import TABLE, layer_values
    from normwatch.records import Limits

    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16))
    w = normwatch.watch(model, flush_every=1, stats_every=2, output_check_every=2,
                        report_dir=None)
    flushed = []
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        snap = w.step()
        assert snap is not None
        flushed.append(layer_values(snap.layers["1"], Limits()))
    w.close()
    full, sentinel = flushed
    measured = [s for s in TABLE if s.name in full and not s.integer]
    assert {s.tier for s in measured} == {"sentinel", "full", "check", "gradient"}
    for stat in measured:
        assert full[stat.name] is not None, stat.name
        assert (sentinel[stat.name] is not None) == (stat.tier == "sentinel"), stat.name
