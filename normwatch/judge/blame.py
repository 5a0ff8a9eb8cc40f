"""Is normalization to blame? A pure verdict from recent history.

    >>> verdict = judge("loss_spike", step=120, records=history.records(), order=names)
    >>> verdict.blame, verdict.layer, verdict.evidence[0]

Normalization is to blame when a norm's own computation failed or distorted: a
non-finite value born inside it, a reduction that overflows in fp16, eps-dominated or
zero-variance tokens, an output that disagrees with the fp32 formula, or an output
statistic that jumped against the layer's own history. It is not to blame when the first
non-finite value arrived in a norm's input (the block before it produced it) or when
every norm stayed healthy. With the optimizer's steps measured (``updates``), the verdict
names the cause outside the norms: an update that jumped just before the trigger, with no
norm failing, is ``optimizer`` (even when norm statistics moved: they all follow the
parameters); normal updates, healthy norms and a jump only in the loss is ``data``. A
jump in norm *inputs* alone, with healthy outputs and normal updates, is inconclusive.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from normwatch.judge.history import Record, first_nonfinite
from normwatch.judge.updates import UpdateJump, normal_before, update_jump
from normwatch.records import Alarm, FirstNonfinite, LayerStats, Trigger, UpdateStats, Verdict

JUMP_RATIO = 4.0
MIN_HISTORY = 3
MOVED = 1.5
"""A layer's statistic *moved* when it changed by this factor against its history."""


def is_norm_failure(alarm: Alarm) -> bool:
    """Alarms that mean the norm's *own* computation failed or distorted."""
    if alarm.kind == "fp16_overflow":
        return alarm.severity == "critical"  # its reduction squares in fp16 (probed)
    if alarm.kind in ("output_mismatch", "eps_dominance"):
        return alarm.severity in ("warning", "critical")
    return alarm.kind == "nonfinite" and alarm.tag == "norm"


def judge(trigger: Trigger, step: int, records: Sequence[Record], order: Sequence[str],
          updates: Sequence[UpdateStats] = ()) -> Verdict:
    """The verdict for ``trigger`` at ``step`` given recent ``records`` (oldest first),
    the layers' forward ``order`` and the optimizer steps measured (oldest first)."""
    position = {name: i for i, name in enumerate(order)}
    first = first_nonfinite(records)
    jump = update_jump(updates, step)
    if jump is not None and first is not None and first.step <= jump.update.step:
        jump = None  # the forward went non-finite first: the gradient, then the update followed
    failures = sorted(
        (a for r in records for a in r.findings if is_norm_failure(a)),
        key=lambda a: (a.step, position.get(a.layer or "", len(order))),
    )
    if first is not None and first.origin == "norm":
        own = [a for a in failures if a.layer == first.layer and a.kind != "nonfinite"]
        cause = own[0].kind if own else "nonfinite"
        evidence = [f"The first non-finite value was born inside {first.layer!r} at step "
                    f"{first.step}: its input was finite, its output was not."]
        evidence += _sentences(own)
        return Verdict(trigger, step, "normalization", first.layer, cause, tuple(evidence))
    if failures:
        worst = failures[0]
        evidence = _sentences(failures)
        if first is not None:
            evidence.append(f"The first non-finite value then reached {first.layer!r} at step "
                            f"{first.step}, after the norm had already failed.")
        if jump is not None:
            evidence += jump.sentences()  # context: what pushed the norm over
        return Verdict(trigger, step, "normalization", worst.layer, worst.kind, tuple(evidence))
    if first is not None:
        return _arrived(trigger, step, first, order, jump)
    if jump is not None:
        return _optimizer(trigger, step, jump, records, order)
    jumps = _jumps(records, order)
    out_jumps = [j for j in jumps if j[1] == "output"]
    if out_jumps:
        layer, _, ratio, now, before = out_jumps[0]
        return Verdict(trigger, step, "normalization", layer, "stat_jump", (
            f"{layer}: max |output| jumped to {now:.4g}, {ratio:.1f}x its recent median "
            f"{before:.4g}; a norm's output scale should not move with its input.",))
    if jumps:
        evidence = [
            f"{layer}: max |input| jumped to {now:.4g}, {ratio:.1f}x its recent median "
            f"{before:.4g}, while its output stayed in range." for layer, _, ratio, now, before
            in jumps[:3]]
        evidence.append("The norms coped with larger inputs; something upstream grew the "
                        "activations (data, learning rate, a residual branch).")
        return Verdict(trigger, step, "inconclusive", jumps[0][0], "stat_jump", tuple(evidence))
    seen = [n for n in order if any(n in r.snapshot.layers and r.snapshot.layers[n].seen
                                    for r in records)]
    if not seen:
        return Verdict(trigger, step, "inconclusive", None, None, (
            f"No norm call was measured before the {trigger.replace('_', ' ')} at step "
            f"{step} (none of the {len(order)} norm layers ran a counted training forward): "
            "normalization can be neither blamed nor cleared.",))
    healthy = (f"All {len(seen)} norm layers stayed healthy: finite inputs and outputs, no "
               "fp16 overflow, no eps dominance, no output mismatch, no jump against their "
               "history.")
    normal = normal_before(updates, step)
    if normal is not None and trigger == "loss_spike":
        return Verdict(trigger, step, "not_normalization", None, "data", (
            healthy, normal, "Only the loss jumped: look at the batch of that step (corrupted, "
            "mislabelled, out of distribution, a different length or source)."))
    where = ("after the last norm (LM head, loss or labels)" if trigger == "nonfinite_loss"
             else "in the data or the optimisation")
    return Verdict(trigger, step, "not_normalization", None, None, (
        healthy, *([normal] if normal else []),
        f"Look {where}: a corrupted or mislabelled batch, the learning rate or its schedule, "
        "gradient clipping.",
    ))


def _optimizer(trigger: Trigger, step: int, jump: UpdateJump, records: Sequence[Record],
               order: Sequence[str]) -> Verdict:
    evidence = jump.sentences()
    inputs = [r for _, side, r, _, _ in _ratios(records, order) if side == "input"]
    moved = [r for r in inputs if not 1 / MOVED < r < MOVED]
    if inputs:
        together = (f"{len(moved)} of {len(inputs)} norms' inputs moved with it (median "
                    f"change {statistics.median(moved):.1f}x)" if moved else
                    f"None of the {len(inputs)} norms' inputs moved much")
        evidence.append(f"{together}, and no norm failed: no fp16 overflow, no eps dominance, "
                        "no output mismatch, no non-finite value born inside a norm.")
    evidence.append("Look at the optimizer: the learning rate and its schedule, warm-up, "
                    "gradient clipping, the optimizer's state after a resume.")
    return Verdict(trigger, step, "not_normalization", None, "optimizer", tuple(evidence))


def _arrived(trigger: Trigger, step: int, first: FirstNonfinite, order: Sequence[str],
             jump: UpdateJump | None = None) -> Verdict:
    index = order.index(first.layer) if first.layer in order else first.position
    if index <= 0:
        block = f"before {first.layer} (embedding or input data)"
    else:
        previous = order[index - 1]
        parent = previous.rsplit(".", 1)[0] if "." in previous else ""
        inside = f" (inside {parent}, after {previous})" if parent else ""
        block = f"between {previous} and {first.layer}{inside}"
    evidence = (
        f"The first non-finite value arrived in the input of {first.layer!r} at step "
        f"{first.step}; every norm before it saw finite values.",
        f"It was produced {block}: attention, MLP, the residual add or the data, not a norm.",
    )
    if jump is not None:  # the parameters that produced it had just been blown up
        return Verdict(trigger, step, "not_normalization", first.layer, "optimizer",
                       (*jump.sentences(), *evidence), block)
    return Verdict(trigger, step, "not_normalization", first.layer, "nonfinite", evidence, block)


def _jumps(records: Sequence[Record], order: Sequence[str]
           ) -> list[tuple[str, str, float, float, float]]:
    """``(layer, 'input'|'output', ratio, now, median before)`` for statistics of the last
    record that jumped against the layer's own earlier records, outputs first."""
    found = [j for j in _ratios(records, order) if j[2] > JUMP_RATIO]
    return sorted(found, key=lambda j: (j[1] != "output", -j[2]))


def _ratios(records: Sequence[Record], order: Sequence[str]
            ) -> list[tuple[str, str, float, float, float]]:
    """``(layer, 'input'|'output', ratio, now, median before)`` of each layer's max |x| in
    the last record against its earlier records (those with enough history)."""
    if len(records) < MIN_HISTORY + 1:
        return []
    last, earlier = records[-1].snapshot, [r.snapshot for r in records[:-1]]
    found = []
    for name in order:
        now = last.layers.get(name)
        if now is None or not now.seen:
            continue
        past = [s.layers[name] for s in earlier if name in s.layers and s.layers[name].seen]
        for side, get in (("output", _out_absmax), ("input", _in_absmax)):
            values = [v for v in map(get, past) if v is not None and v > 0]
            current = get(now)
            if len(values) >= MIN_HISTORY and current is not None:
                median = statistics.median(values)
                found.append((name, side, current / median, current, median))
    return found


def _in_absmax(stats: LayerStats) -> float | None:
    return stats.absmax


def _out_absmax(stats: LayerStats) -> float | None:
    return stats.out_absmax


def _sentences(alarms: Sequence[Alarm], limit: int = 4) -> list[str]:
    """One sentence per alarm kind (earliest first), naming the layers it hit."""
    by_kind: dict[str, list[Alarm]] = {}
    for alarm in alarms:
        by_kind.setdefault(alarm.kind, []).append(alarm)
    out = []
    for kind, group in list(by_kind.items())[:limit]:
        first = group[0]
        layers = list(dict.fromkeys(a.layer for a in group if a.layer))
        where = ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")
        detail = first.message.split(". ")[0].rstrip(".")
        out.append(f"Step {first.step}: {kind} ({first.severity}) in {where}. {detail}.")
    return out
