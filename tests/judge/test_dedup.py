"""Which alarms pass: de-duplication with decimal backoff, once-kinds, raise_on."""

from __future__ import annotations

from normwatch.judge.dedup import Dedup, fatal
from normwatch.records import Alarm


def alarm(kind: str = "eps_dominance", severity: str = "warning", step: int = 1,
          layer: str = "n", tag: str = "") -> Alarm:
    return Alarm(kind, severity, layer, step, 0.5, 0.01, f"{kind} at {step}", tag=tag)  # type: ignore[arg-type]


def test_repeats_back_off_by_powers_of_ten_with_counts() -> None:
    d = Dedup()
    passed = [a for step in range(1, 1001) for a in d.sift([alarm(step=step)])[0]]
    assert [a.step for a in passed] == [1, 10, 100, 1000]
    assert [a.count for a in passed] == [1, 9, 90, 900]
    assert passed[1].message.endswith("[x9 since step 1]")
    assert d.history == passed


def test_a_rise_in_severity_always_passes_and_kinds_are_separate() -> None:
    d = Dedup()
    assert d.sift([alarm(severity="info")])[0]
    assert not d.sift([alarm(severity="info", step=2)])[0]
    assert [a.severity for a in d.sift([alarm(severity="critical", step=3)])[0]] == ["critical"]
    assert d.sift([alarm(kind="common_mode", step=4)])[0]  # another kind: its own count
    assert d.sift([alarm(layer="other", step=5)])[0]       # another layer too


def test_dtype_mismatch_once_per_signature() -> None:
    d = Dedup()
    first = alarm("dtype_mismatch", tag="bf16/f32")
    assert d.sift([first])[0]
    assert not any(d.sift([alarm("dtype_mismatch", step=s, tag="bf16/f32")])[0]
                   for s in range(2, 200))
    assert d.sift([alarm("dtype_mismatch", step=300, tag="f16/f32")])[0]


def test_raise_on_severity() -> None:
    assert fatal([alarm(severity="info")], "warning") == []
    assert [a.severity for a in fatal([alarm(severity="critical"), alarm(severity="info")],
                                      "warning")] == ["critical"]
    assert fatal([alarm(severity="critical")], None) == []  # None: never
