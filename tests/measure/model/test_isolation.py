"""normwatch's own calls of a user's module (the fp16 probe at a flush, the behaviour
test at discovery) run no user hook, no global hook, draw no random number and leave
buffers alone: a watched run's hooks see exactly what an unwatched run's see."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

import normwatch
import normwatch.measure.model.probe as probe_module
from normwatch.measure.model.isolation import hookless_copy, isolated


class SampledNorm(nn.Module):
    """A hand-written RMSNorm: eps a literal, squares in its input dtype, a child module,
    and a random draw per training call (as a norm that samples tokens for logging)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.inner = nn.Identity()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inner(x)
        if self.training:
            torch.rand(1)
        self.calls += 1
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)


def run(watched: bool, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), SampledNorm(16), nn.Linear(16, 4)).half()
    seen: dict[str, Any] = {"pre": [], "inner": 0, "global": 0, "probes": 0}
    model[1].register_forward_pre_hook(lambda m, a: seen["pre"].append(a[0].detach().clone()))
    model[1].inner.register_forward_hook(lambda m, a, o: seen.__setitem__(
        "inner", seen["inner"] + 1))
    handle = register_module_forward_pre_hook(lambda m, a: seen.__setitem__(
        "global", seen["global"] + 1))
    real = probe_module.probe_fp16_safety

    def counted(*args: Any) -> Any:
        seen["probes"] += 1
        return real(*args)

    monkeypatch.setattr(probe_module, "probe_fp16_safety", counted)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            w = normwatch.watch(model, report_dir=None, flush_every=1, stats_every=1) \
                if watched else None
            for step in range(4):
                x = torch.randn(8, 16) * (1.0 if step < 2 else 400.0)  # past the fp16 limit
                loss = model(x.half()).float().square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                if w is not None:
                    w.step(loss)
    finally:
        handle.remove()
    seen["rng"] = torch.get_rng_state()
    seen["calls"] = int(model[1].calls)
    return seen


def test_the_probe_and_discovery_reach_no_user_or_global_hook(
        monkeypatch: pytest.MonkeyPatch) -> None:
    plain = run(False, monkeypatch)
    watched = run(True, monkeypatch)
    assert watched["probes"] >= 1  # the fp16 probe ran on the hand-written norm
    assert len(watched["pre"]) == len(plain["pre"]) == 4
    assert all(torch.equal(a, b) for a, b in zip(watched["pre"], plain["pre"], strict=True))
    assert watched["inner"] == plain["inner"] and watched["global"] == plain["global"]
    assert watched["calls"] == plain["calls"] == 4  # the real module's buffer: untouched
    assert torch.equal(watched["rng"], plain["rng"])


def test_isolated_restores_global_hooks_rng_and_grad_mode() -> None:
    calls = []
    handle = register_module_forward_pre_hook(lambda m, a: calls.append(m))
    norm = SampledNorm(4)
    norm.register_forward_hook(lambda m, a, o: calls.append("user"))
    try:
        state = torch.get_rng_state()
        with isolated():
            y = hookless_copy(norm)(torch.ones(2, 4, requires_grad=True))
            assert torch.is_grad_enabled() is False
        assert torch.equal(torch.get_rng_state(), state) and y.grad_fn is None
        assert calls == [] and int(norm.calls) == 0  # the copy's buffer moved, not norm's
        norm(torch.ones(2, 4))
        assert len(calls) == 3  # global hooks back: norm and its child; then the user's
    finally:
        handle.remove()
