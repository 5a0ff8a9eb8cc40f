"""Each alarm fired by a real training loop that reproduces its fault; quiet healthy runs."""

from __future__ import annotations

import io
import logging

import pytest
import torch
from rich.console import Console
from torch import nn

import normwatch
from normwatch.demos.demo import DemoResult, run_demo
from normwatch.demos.toymodel import NaiveRMSNorm, TinyLM, lm_loss, synthetic_batch
from normwatch.judge.alarms import dtype_alarms
from normwatch.measure.layer import autocasting
from normwatch.measure.layer.autocasting import autocast_made
from normwatch.records import SEVERITY_RANK, Alarm, NormLayer
from normwatch.report.document import load_report
from tests import factory
from tests.conftest import tiny_hf


def drill(fault: str, steps: int = 200) -> DemoResult:
    return run_demo(fault, steps=steps, console=Console(file=io.StringIO(), width=200),
                    live=False)


def kinds(alarms: list[Alarm], min_severity: str = "info") -> set[tuple[str, str]]:
    rank = SEVERITY_RANK[min_severity]
    return {(a.kind, a.severity) for a in alarms if SEVERITY_RANK[a.severity] >= rank}


def test_fp16_overflow_warns_long_before_the_nan_loss() -> None:
    result = drill("fp16-overflow")
    assert result.nan_step is not None
    headroom = [a for a in result.alarms if a.kind == "fp16_headroom" and a.severity == "warning"]
    overflow = [a for a in result.alarms if a.kind == "fp16_overflow" and a.severity == "critical"]
    assert headroom
    assert "steps to the fp16 limit" in headroom[0].message
    assert overflow and "squares its input in fp16" in overflow[0].message
    assert headroom[0].step < overflow[0].step < result.nan_step
    assert result.nan_step - headroom[0].step >= 10
    # the loss was still healthy when the first warning fired
    first = result.losses[headroom[0].step - 1]
    assert first < result.losses[0]


def test_fp16_overflow_with_an_upcasting_norm_is_info_until_it_grows() -> None:
    """Past 256 in fp16, a norm that upcasts is not broken: info while max |x| is not
    heading for 65504 by the forecast rule (a healthy fp16 CTRL or Falcon sits at 400-900
    from its first steps), a warning (never critical) once it is."""
    model = nn.Sequential(nn.Linear(16, 32), nn.RMSNorm(32)).half()
    w = normwatch.watch(model, flush_every=1)
    x = torch.randn(4, 16, dtype=torch.half)
    for scale in (300, 300, 300, 300, *(300 * 2 ** k for k in range(1, 7))):
        model(x * scale).float().sum().backward()
        w.step()
    overflow = [a for a in w.alarms if a.kind == "fp16_overflow"]
    assert [a.severity for a in overflow][:1] == ["info"]
    assert "upcasts internally" in overflow[0].message and "Not heading" in overflow[0].message
    assert "warning" in [a.severity for a in overflow]
    assert "critical" not in [a.severity for a in overflow]


def test_fp16_limit_in_bf16_is_only_info() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.RMSNorm(32)).bfloat16()
    w = normwatch.watch(model, flush_every=1)
    model(torch.randn(4, 16, dtype=torch.bfloat16) * 300).float().sum().backward()
    w.step()
    assert kinds(w.alarms) == {("fp16_overflow", "info")}


def test_eps_zero_on_padding_tokens() -> None:
    result = drill("eps-zero", steps=5)
    assert result.nan_step == 1
    found = {(a.kind, a.severity, a.layer) for a in result.alarms}
    assert ("eps_dominance", "critical", "blocks.0.norm1") in found
    nonfinite = [a for a in result.alarms if a.kind == "nonfinite"]
    assert nonfinite[0].layer == "blocks.0.norm1" and "born inside" in nonfinite[0].message


def test_too_large_eps_flattens_small_tokens() -> None:
    norm = nn.LayerNorm(64, eps=1e-1)
    model = nn.Sequential(nn.Linear(64, 64), norm)
    w = normwatch.watch(model, flush_every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        model(torch.randn(16, 64) * 0.05).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        w.step()
    alarm = next(a for a in w.alarms if a.kind == "eps_dominance")
    assert alarm.severity == "warning" and alarm.layer == "1"
    assert alarm.value > 0.5 and "eps = 0.1 dominates 16 of 16 tokens" in alarm.message
    assert "Lower eps to 1e-6..1e-5" in alarm.message


def test_a_literal_eps_is_said_and_reported_as_the_code_wrote_it() -> None:
    """A custom norm with ``+ 1e-5`` in its forward: eps is measured (to ~1e-15), and the
    alarm, its advice and the report say 1e-05, as written; the report keeps the
    measurement at full precision beside it."""
    from tests.measure.model.test_discovery import LiteralEpsRMSNorm

    model = nn.Sequential(nn.Linear(64, 64, bias=False), LiteralEpsRMSNorm(64, 1e-5))
    w = normwatch.watch(model, flush_every=1, report_dir="reports", report_console=False)
    (layer,) = w.layers
    assert layer.eps_measured and layer.eps != 1e-5 and layer.eps == pytest.approx(1e-5)
    model(torch.randn(16, 64) * 5e-4).pow(2).mean().backward()
    w.step()
    alarm = next(a for a in w.alarms if a.kind == "eps_dominance")
    assert "eps = 1e-05 dominates" in alarm.message
    assert "already in the usual range" in alarm.message and "Lower eps" not in alarm.message
    x = torch.randn(16, 64)
    x[0, 0] = float("nan")  # an incident: the report is written
    model(x).sum()
    w.step()
    w.close()
    (folder,) = w.reports
    text = (folder / "report.json").read_text()
    (entry,) = load_report(folder)["layers"]
    assert entry["eps"] == 1e-5 and '"eps": 1e-05' in text
    assert entry["eps_as_measured"] == layer.eps and entry["eps_measured"] is True


def test_eps_advice_reads_the_layers_own_eps() -> None:
    """Small tokens against the usual eps 1e-5: no advice to use what it has."""
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.LayerNorm(64, eps=1e-5))
    w = normwatch.watch(model, flush_every=1, report_dir=None)
    model(torch.randn(16, 64) * 5e-4).pow(2).mean().backward()
    w.step()
    alarm = next(a for a in w.alarms if a.kind == "eps_dominance")
    assert "eps = 1e-05 dominates" in alarm.message
    assert "already in the usual range" in alarm.message and "Lower eps" not in alarm.message
    w.close()


def test_nan_born_in_an_mlp_names_the_next_norm() -> None:
    result = drill("nan-mlp", steps=40)
    assert result.nan_step == 30
    nonfinite = [a for a in result.alarms if a.kind == "nonfinite"]
    assert nonfinite[0].step == 30 and nonfinite[0].layer == "norm"
    assert "arrived in the input of 'norm'" in nonfinite[0].message
    assert not [a for a in result.alarms if a.step < 30 and a.severity != "info"]


def test_wrong_dimension_norm_is_an_output_mismatch() -> None:
    result = drill("wrong-dim", steps=12)
    mismatches = [a for a in result.alarms if a.kind == "output_mismatch"]
    assert mismatches and mismatches[0].severity == "critical"
    assert mismatches[0].step == 1 and mismatches[0].value > 0.1
    assert {a.layer for a in mismatches} >= {"blocks.0.norm1", "norm"}


def test_dtype_mismatch_once_per_layer_and_again_on_change() -> None:
    result = drill("dtype-mismatch", steps=20)
    dtype = [a for a in result.alarms if a.kind == "dtype_mismatch"]
    assert len(dtype) == 1 and dtype[0].layer == "norm" and dtype[0].severity == "warning"
    assert "weight float32 differs from the bfloat16 input" in dtype[0].message
    model = nn.Sequential(nn.Linear(8, 8), NaiveRMSNorm(8))
    w = normwatch.watch(model, flush_every=1)
    model.half()
    model[1].float()
    for _ in range(5):
        model(torch.randn(2, 8, dtype=torch.half))
        w.step()
    model[1].double()
    model(torch.randn(2, 8, dtype=torch.half))
    w.step()
    promoted = [a for a in w.alarms if a.kind == "dtype_mismatch"]
    assert [a.step for a in promoted] == [1, 6]
    assert "output is float32: the float16 stream is promoted" in promoted[0].message
    assert "output is float64" in promoted[1].message


def test_autocast_promotions_are_not_mismatches() -> None:
    model = tiny_hf("llama")
    w = normwatch.watch(model, flush_every=1)
    tokens = torch.randint(0, 64, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(tokens, labels=tokens)
    out.loss.backward()
    snap = w.step(out.loss)
    assert snap is not None and snap.layers["model.norm"].autocast == "cpu:bfloat16"
    assert not [a for a in w.alarms if a.kind == "dtype_mismatch"]


def test_common_mode_in_rmsnorm_inputs() -> None:
    result = drill("common-mode", steps=5)
    common = [a for a in result.alarms if a.kind == "common_mode"]
    assert common and common[0].layer == "blocks.0.norm1" and common[0].severity == "warning"
    assert common[0].value > 0.9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_healthy_200_steps_raise_nothing(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = TinyLM(dim=64, depth=2).to(dtype)
    w = normwatch.watch(model, flush_every=5, output_check_every=2)
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    snaps = []
    for _ in range(200):
        tokens = synthetic_batch(gen)
        loss = lm_loss(model(tokens), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        snaps.append(w.step(loss))
    assert w.flushes == 40
    assert kinds(w.alarms, "warning") == set()
    assert w.verdicts == [] and w.reports == []  # no false spikes, no post-mortems
    assert torch.isfinite(loss) and float(loss) < 4.0
    # the output check ran in the first interval and after every 2nd flush, and agreed
    checked = [i for i, s in enumerate(x for x in snaps if x is not None)
               if all(v.output_mismatch is not None for v in s.layers.values())]
    assert checked == list(range(0, 40, 2))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma", "gpt2", "bert"])
def test_healthy_transformers_models_raise_nothing(arch: str) -> None:
    model = tiny_hf(arch).to(torch.bfloat16)
    w = normwatch.watch(model, flush_every=2, output_check_every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(6):
        tokens = torch.randint(1, 64, (2, 16))
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        w.step(loss)
    assert kinds(w.alarms, "warning") == set()
    assert all(s.calls for s in w.last_snapshot.layers.values())  # type: ignore[union-attr]


def nan_storm(steps: int, **options: object) -> normwatch.Watch:
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    w = normwatch.watch(model, flush_every=1, **options)
    bad = torch.full((4, 8), float("nan"))
    for _ in range(steps):
        model(bad)
        w.step()
    return w


def test_a_nan_storm_gives_a_handful_of_alarms_with_counts(caplog: pytest.LogCaptureFixture
                                                           ) -> None:
    with caplog.at_level(logging.INFO, logger="normwatch"):
        w = nan_storm(1000)
    nonfinite = [a for a in w.alarms if a.kind == "nonfinite"]
    assert [a.step for a in nonfinite] == [1, 10, 100, 1000]
    assert sum(a.count for a in nonfinite) == 1000
    assert "[x900 since step 1]" in nonfinite[-1].message
    lines = [r for r in caplog.records
             if not r.getMessage().startswith(("[verdict]", "[report]"))]
    assert len(lines) == len(w.alarms) <= 8
    assert lines[0].levelno == logging.CRITICAL
    assert len(w.verdicts) == 1 and len(w.reports) == 1  # one episode, one post-mortem


def test_raise_on_critical() -> None:
    with pytest.raises(normwatch.NumericalHealthError) as info:
        nan_storm(3, raise_on="critical")
    assert info.value.alarms[0].kind == "nonfinite"
    assert "First non-finite value at step 1" in str(info.value)


def test_sinks_receive_alarms_and_a_broken_sink_is_disabled() -> None:
    received: list[Alarm] = []

    def broken(alarm: Alarm) -> None:
        raise ValueError("sink down")

    with pytest.warns(RuntimeWarning, match=r"alarm sink .* failed \(ValueError: sink down\)"):
        w = nan_storm(20, sinks=[received.append, broken])
    assert received == w.alarms and len(received) == 2


def test_autocast_promotion_by_a_custom_norm_is_a_dtype_finding_not_a_mismatch() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    found = {}
    for name, norm in (("llama", LlamaRMSNorm(64)), ("torch-ln", nn.LayerNorm(64)),
                       ("torch-rms", nn.RMSNorm(64)), ("torch-gn", nn.GroupNorm(4, 64))):
        model = nn.Sequential(nn.Linear(64, 64), norm)
        w = normwatch.watch(model, flush_every=1, report_dir=None)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.randn(8, 64))
        out.float().sum().backward()
        snap = w.step()
        assert snap is not None and snap.layers["1"].output_mismatch is not None  # checked
        found[name] = kinds(w.alarms)
        w.close()
    # LlamaRMSNorm: weight (fp32) * hidden.to(bf16) -> fp32, by plain type promotion
    assert found["llama"] == {("dtype_mismatch", "info")}
    assert found["torch-ln"] == found["torch-rms"] == found["torch-gn"] == set()


class LayerNormByHand(torch.nn.Module):
    """A custom (not torch's) module that calls ``F.layer_norm``: under CUDA autocast its
    fp32 output is autocast's rule for that op, not this module's promotion."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))
        self.eps = 1e-5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, x.shape[-1:], self.weight, eps=self.eps)


def test_autocast_is_asked_by_op_not_by_module_class(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    # CPU autocast keeps layer_norm in bf16 (CUDA's runs it in fp32): autocast decides
    assert not autocast_made("NativeLayerNormBackward0", cpu, torch.bfloat16, torch.bfloat16)
    assert not autocast_made("MulBackward0", cpu, torch.bfloat16, torch.bfloat16)
    # an op CPU autocast does list in fp32 (cdist), standing in for a norm op: asked, True
    monkeypatch.setitem(autocasting._OPS, "Cdist", lambda x: torch.cdist(x, x))
    assert autocast_made("CdistBackward0", cpu, torch.bfloat16, torch.bfloat16)
    # the rule reads the recorded answer first, the module's class only without one
    layer = NormLayer("n", "layernorm", 1e-5, (64,), "w", "LayerNorm", builtin=True)
    custom = NormLayer("n", "layernorm", 1e-5, (64,), "w", "LayerNormByHand")
    promoted = dict(input_dtype="float16", weight_dtype="float32", output_dtype="float32",
                    autocast="cuda:float16")
    for made, on, noted in ((True, custom, False), (False, layer, True),
                            (None, layer, False), (None, custom, True)):
        stats = factory.stats("n", kind="layernorm", autocast_made=made, **promoted)
        got = [a.severity for a in dtype_alarms(stats, on, 1)]
        assert (got == ["info"]) == noted, (made, on.class_name)


def test_the_op_behind_a_promoted_output_is_recorded_in_training() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    model = nn.Sequential(nn.Linear(64, 64), LlamaRMSNorm(64))
    w = normwatch.watch(model, flush_every=1, report_dir=None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(8, 64))
    out.float().sum().backward()
    snap = w.step()
    assert snap is not None and snap.layers["1"].autocast_made is False  # the weight's mul
    w.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_autocast_layer_norm_in_a_custom_module_is_not_a_mismatch(
        ) -> None:  # pragma: no cover - runs on GPU machines only
    for norm, expect in ((LayerNormByHand(64), set()),
                         (nn.LayerNorm(64), set()),
                         (__import__("transformers").models.llama.modeling_llama.LlamaRMSNorm(
                             64), {("dtype_mismatch", "info")})):
        model = nn.Sequential(nn.Linear(64, 64), norm).cuda()
        w = normwatch.watch(model, flush_every=1, report_dir=None)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(torch.randn(8, 64, device="cuda"))
        out.float().sum().backward()
        snap = w.step()
        assert snap is not None
        assert kinds(w.alarms) == expect, type(norm).__name__
        w.close()


class RMSNormRoundedInBF16(torch.nn.Module):
    """An fp32 RMSNorm whose output passes through bf16 (a custom kernel's last rounding):
    fp32 in, fp32 weight, fp32 out — only the mantissas tell."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        return y.bfloat16().float()


@pytest.mark.parametrize("compiled", [False, True])
def test_output_tolerance_follows_the_precision_the_output_carries(compiled: bool) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), RMSNormRoundedInBF16(64),
                                torch.nn.Linear(64, 64), torch.nn.RMSNorm(64))
    w = normwatch.watch(model, flush_every=1, report_dir=None)
    run = torch.compile(model) if compiled else model
    run(torch.randn(8, 64)).sum().backward()
    snap = w.step()
    assert snap is not None
    rounded, plain = snap.layers["1"], snap.layers["3"]
    assert plain.output_eps == torch.finfo(torch.float32).eps
    if not compiled:
        assert rounded.output_eps == 2.0**-7
        assert rounded.output_mismatch is not None and rounded.output_mismatch > 1e-3
    else:  # inductor does not emulate the bf16 round trip: the output stays fp32-precise
        assert rounded.output_eps == torch.finfo(torch.float32).eps
    assert not [a for a in w.alarms if a.kind == "output_mismatch"]  # not a wrong formula
    w.close()
    torch.compiler.reset()
