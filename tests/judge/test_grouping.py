"""Alarms grouped as people read them: by kind, severity and tag, layers as a range."""

from __future__ import annotations

import re

import torch

import normwatch
from normwatch.demos.toymodel import TinyLM, lm_loss, synthetic_batch
from normwatch.judge.dedup import Dedup
from normwatch.judge.grouping import group_alarms
from normwatch.records import Alarm
from normwatch.report.console import HealthTable
from normwatch.report.html import _alarms

LAYERS = [f"blocks.{i}.norm" for i in range(60)]


def headroom(layer: str, step: int, steps_left: float) -> Alarm:
    return Alarm("fp16_headroom", "warning", layer, step, steps_left, 50.0,
                 f"{layer}: ~{steps_left:g} steps to the fp16 limit. Act now.")


def test_groups_follow_kind_severity_tag_and_forward_order() -> None:
    alarms = [headroom(LAYERS[i], 5, 30.0 - i) for i in (3, 1, 2)]
    alarms.append(Alarm("fp16_overflow", "critical", LAYERS[0], 5, 300.0, 256.0,
                        "blocks.0.norm: max |x| = 300 > 256.", tag="abs"))
    alarms.append(Alarm("fp16_overflow", "info", LAYERS[1], 5, 7e4, 65504.0, "sumsq",
                        tag="sumsq"))
    groups = group_alarms(alarms, order=LAYERS)
    assert [(g.kind, g.severity, len(g.alarms)) for g in groups] == [
        ("fp16_headroom", "warning", 3), ("fp16_overflow", "critical", 1),
        ("fp16_overflow", "info", 1)]
    first = groups[0]
    assert first.layers == (LAYERS[1], LAYERS[2], LAYERS[3])  # forward order
    assert first.worst.layer == LAYERS[3]  # fewest steps to the limit
    assert first.text() == ("3 layers, blocks.1.norm … blocks.3.norm · steps to the limit "
                            "27–29 · worst 'blocks.3.norm': ~27 steps to the fp16 limit. Act now.")
    assert first.text(detail=False) == ("3 layers, blocks.1.norm … blocks.3.norm · steps to "
                                        "the limit 27–29")
    assert groups[1].text() == "blocks.0.norm: max |x| = 300 > 256."  # one alarm: as is


def test_output_scales_with_kinds_not_layers() -> None:
    """60 layers warning for 1,000 flushes: the history keeps every layer, the logger
    and the sinks get a handful of group lines."""
    lines: list[Alarm] = []
    d = Dedup()
    passed = []
    for step in range(1, 1001):
        layers = LAYERS[:30] if step < 5 else LAYERS  # the other 30 join at step 5
        got, emitted = d.sift([headroom(layer, step, 40.0) for layer in layers], LAYERS)
        passed += got
        lines += emitted
    assert {a.layer for a in passed} == set(LAYERS)  # per-layer detail kept
    assert len(passed) == 60 * 4 - 30 * 1  # 1st, 10th, 100th, 1000th per layer
    assert [a.step for a in lines] == [1, 5, 10, 100, 1000]
    assert lines[0].message.startswith("30 layers, blocks.0.norm … blocks.29.norm")
    assert lines[1].message.startswith("60 layers, blocks.0.norm … blocks.59.norm")
    assert lines[3].count == 90 and lines[3].message.endswith("[x90 since step 1]")


def test_once_kinds_repeat_only_when_layers_join() -> None:
    lines: list[Alarm] = []
    d = Dedup()
    for step in range(1, 30):
        lines += d.sift([Alarm("dtype_mismatch", "warning", layer, step, 0.0, 0.0, f"{layer}: cast",
                         tag="f16/f32") for layer in LAYERS[:2 if step < 20 else 3]])[1]
    assert [a.step for a in lines] == [1, 20]


def test_html_alarm_table_folds_the_layers_of_a_group() -> None:
    alarms = [dict(kind="fp16_headroom", severity="warning", layer=layer, step=7, value=20.0,
                   threshold=50.0, message=f"{layer}: <soon>", count=1) for layer in LAYERS[:5]]
    html = _alarms(alarms)
    assert html.count("<details>") == 1 and "<summary>5 layers, blocks.0.norm … blocks.4.norm" \
        in html
    assert len(re.findall(r"<tr class='warn'>", html)) == 1  # one row for the group
    assert html.count("&lt;soon&gt;") == 6 and "<soon>" not in html  # 5 folded + the line


def test_health_keeps_the_last_output_check_between_checks() -> None:
    """An RMSNorm reducing over the batch is CRITICAL in the table at every flush, not
    only at the flushes that check outputs."""
    model = TinyLM(dim=32, depth=1, norm="batchdim_rmsnorm")
    w = normwatch.watch(model, flush_every=1, output_check_every=3, report_dir=None)
    gen = torch.Generator().manual_seed(0)
    health = []
    for _ in range(5):
        tokens = synthetic_batch(gen, batch=4, seq=8)
        lm_loss(model(tokens), tokens).backward()
        w.step()
        snap = w.last_snapshot
        assert snap is not None
        rows = dict((s.name, h) for h, s in HealthTable(snap, w.health_findings).rows())
        health.append(rows["norm"])
    assert health == ["critical"] * 5
    assert any(a.kind == "output_mismatch" for a in w.alarms)
    w.close()
