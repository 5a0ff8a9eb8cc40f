"""Loss-spike detection: robust baseline, warmup, non-finite losses, state round trip."""

from __future__ import annotations

import json
import math
import random

import pytest

from normwatch.judge.spikes import SpikeDetector


def noisy(n: int, seed: int = 0, start: float = 4.0) -> list[float]:
    rng = random.Random(seed)
    return [start * math.exp(-i / 80) + 0.5 + rng.gauss(0, 0.03) for i in range(n)]


def test_spike_after_warmup_and_not_before() -> None:
    det = SpikeDetector(window=30, warmup=10)
    assert det.observe(1, 100.0) is None  # warmup: no baseline yet
    det = SpikeDetector(window=30, warmup=10)
    losses = noisy(40)
    assert [det.observe(i, v) for i, v in enumerate(losses, 1)] == [None] * 40
    spike = det.observe(41, losses[-1] * 3)
    assert spike is not None and spike.step == 41
    assert spike.baseline == pytest.approx(sorted(losses[-30:])[15], rel=0.05)


def test_nonfinite_losses_always_count() -> None:
    det = SpikeDetector()
    spike = det.observe(1, float("nan"))
    assert spike is not None and spike.nonfinite
    assert det.observe(2, float("inf")) is not None


def test_a_level_shift_becomes_the_new_baseline() -> None:
    det = SpikeDetector(window=20, warmup=5)
    for i in range(20):
        det.observe(i, 1.0 + 0.01 * (i % 3))
    flags = [det.observe(100 + i, 3.0 + 0.01 * (i % 3)) is not None for i in range(30)]
    assert flags[0] and not flags[-1] and flags.index(False) <= 11


def test_no_false_spikes_on_noisy_decreasing_losses() -> None:
    for seed in range(5):
        det = SpikeDetector()
        assert not [s for i, v in enumerate(noisy(500, seed), 1) if (s := det.observe(i, v))]


def test_state_round_trips_through_json() -> None:
    det = SpikeDetector(window=20, warmup=5)
    for i, v in enumerate(noisy(30), 1):
        det.observe(i, v)
    det.observe(31, 50.0)
    restored = SpikeDetector(window=20, warmup=5)
    restored.load_state_dict(json.loads(json.dumps(det.state_dict())))
    assert restored.state_dict() == det.state_dict()
    assert restored.spikes_seen == 1
    for step, value in ((32, 0.7), (33, 9.0), (34, float("nan"))):
        assert (det.observe(step, value) is None) == (restored.observe(step, value) is None)


def test_bad_state_is_rejected_clearly() -> None:
    with pytest.raises(ValueError, match="spike detector state must be a dict with version 1"):
        SpikeDetector().load_state_dict({"losses": []})
