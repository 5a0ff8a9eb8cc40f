"""False-alarm sweep: every ``transformers`` family with a norm, trained healthy, watched.

Run: ``python -m tests.benchmarks.zoo [--steps 50] [--jobs 2] [--families llama,t5]
[--out zoo.jsonl]``.

Each family (the causal-LM families, plus the encoder-decoder, encoder and vision ones of
:data:`EXTRA`) is built tiny from its default config (``tests/zoo.py``: no download) and
trained on one fixed batch for ``--steps`` steps with ``watch(model, optimizer)`` at its
defaults, three ways:

- ``fp32``: fp32 weights, AdamW (lr 1e-3);
- ``bf16``: fp32 weights under ``torch.autocast("cpu", torch.bfloat16)``;
- ``fp16``: the model in pure fp16 (``model.half()``), AdamW with eps 1e-4 (1e-8 is 0 in
  fp16: the update of a zero second moment would be 0/0); a family whose fp16 forward or
  backward does not run on the CPU is marked "unsupported".

Per family and dtype it prints the steps run, whether every loss was finite (a family that
overflows in fp16 by itself is a true positive of any alarm, not a false one), the
warnings, criticals and verdicts, and the alarms by kind and severity. Each family runs in
a subprocess of its own (a family that hangs or crashes loses only its row).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

DTYPES = ("fp32", "bf16", "fp16")
EXTRA = {"t5": "T5ForConditionalGeneration", "bert": "BertForMaskedLM",
         "vit": "ViTForImageClassification"}
"""Families with a norm that have no causal-LM head (or whose usual head is another)."""
IMAGE = {"vit"}
FAMILY_SECONDS = 180


def families() -> dict[str, str]:
    """Model type -> class name: the causal-LM mapping and :data:`EXTRA`."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {**dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), **EXTRA}


def train(model_type: str, class_name: str, dtype: str, steps: int) -> dict[str, Any]:
    """One healthy run of a family, watched at defaults: what the watch said."""
    import pytest
    import torch

    import normwatch
    from tests import zoo

    row: dict[str, Any] = dict(family=model_type, dtype=dtype, steps=0, finite=True)
    try:
        model = zoo.tiny(model_type, class_name)
    except pytest.skip.Exception as skip:
        return {**row, "skipped": str(skip.msg)}
    if dtype == "fp16":
        model.half()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3,
                                  eps=1e-4 if dtype == "fp16" else 1e-8)
    kwargs = _inputs(model_type, model)
    if dtype == "fp16":
        kwargs = {k: v.half() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                  for k, v in kwargs.items()}
    autocast = torch.autocast("cpu", torch.bfloat16) if dtype == "bf16" \
        else contextlib.nullcontext()
    with tempfile.TemporaryDirectory() as reports:
        w = normwatch.watch(model, optimizer, report_dir=reports, report_console=False)
        losses = []
        for step in range(1, steps + 1):
            try:
                with autocast:
                    loss = model(**kwargs).loss
                loss.float().backward()
            except Exception as exc:  # the family does not train this way on the CPU
                w.close()
                if step == 1:
                    return {**row, "skipped": f"unsupported: {type(exc).__name__}: "
                                              f"{str(exc)[:100]}"}
                raise
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            w.step(loss)
            losses.append(float(loss.detach()))
            row["steps"] = step
            if not math.isfinite(losses[-1]):
                row.update(finite=False, nonfinite_step=step)
                break
        w.close()
    kinds = collections.Counter(f"{a.kind}:{a.severity}" for a in w.alarms)
    loud = [a for a in w.alarms if a.severity in ("warning", "critical")]
    return {**row, "first_loss": losses[0], "last_loss": losses[-1],
            "warnings": sum(a.severity == "warning" for a in w.alarms),
            "criticals": sum(a.severity == "critical" for a in w.alarms),
            "verdicts": len(w.verdicts), "kinds": dict(kinds),
            "loud": [f"step {a.step} {a.severity} {a.kind}: {a.message[:160]}"
                     for a in loud[:5]]}


def _inputs(model_type: str, model: Any) -> dict[str, Any]:
    import torch

    from tests import zoo

    ids = zoo.batch()
    if model_type in IMAGE:
        size = model.config.image_size
        gen = torch.Generator().manual_seed(1)
        return dict(pixel_values=torch.randn(len(ids), model.config.num_channels, size, size,
                                             generator=gen),
                    labels=torch.randint(0, model.config.num_labels, (len(ids),),
                                         generator=gen))
    kwargs = zoo.inputs(model_type, model.config, ids)
    if model_type not in EXTRA:
        kwargs["use_cache"] = False
    return kwargs


def one_family(model_type: str, class_name: str, dtypes: Iterable[str], steps: int) -> None:
    """Runs one family in this process and prints one JSON line per dtype."""
    import torch

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    for dtype in dtypes:
        torch.manual_seed(0)
        try:
            row = train(model_type, class_name, dtype, steps)
        except Exception as exc:
            row = dict(family=model_type, dtype=dtype, error=f"{type(exc).__name__}: "
                                                              f"{str(exc)[:160]}")
        print(json.dumps(row), flush=True)


def sweep(names: dict[str, str], dtypes: Sequence[str], steps: int, jobs: int,
          out: str | None) -> list[dict[str, Any]]:
    """Each family in a subprocess, ``jobs`` at a time; the rows, as they come."""
    def run(item: tuple[str, str]) -> list[dict[str, Any]]:
        cmd = [sys.executable, "-m", "tests.benchmarks.zoo", "--one", item[0], "--class",
               item[1], "--steps", str(steps), "--dtypes", ",".join(dtypes)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=FAMILY_SECONDS,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
            rows = [json.loads(line) for line in done.stdout.splitlines()
                    if line.startswith("{")]
            return rows or [dict(family=item[0], dtype="-", error=done.stderr[-300:])]
        except subprocess.TimeoutExpired:
            return [dict(family=item[0], dtype="-", error=f"over {FAMILY_SECONDS} s")]

    rows: list[dict[str, Any]] = []
    with ThreadPoolExecutor(jobs) as pool, open(out or os.devnull, "w") as sink:
        for done in as_completed([pool.submit(run, item) for item in sorted(names.items())]):
            for row in done.result():
                rows.append(row)
                sink.write(json.dumps(row) + "\n")
                sink.flush()
                print(_line(row), file=sys.stderr, flush=True)
    return rows


def _line(row: dict[str, Any]) -> str:
    if "skipped" in row or "error" in row:
        return f"{row['family']} {row['dtype']}: {row.get('skipped') or row.get('error')}"
    return (f"{row['family']} {row['dtype']}: {row['steps']} steps, "
            f"{'finite' if row['finite'] else 'NON-FINITE'}, {row['warnings']} warnings, "
            f"{row['criticals']} criticals, {row['verdicts']} verdicts "
            f"{' | '.join(row['loud'])}")


def cell(row: dict[str, Any] | None) -> str:
    """One table cell: ``w/c/v`` (warnings, criticals, verdicts), marked when not finite."""
    if row is None:
        return ""
    if "error" in row:
        return "error"
    if "skipped" in row:
        return "unsupported" if row["skipped"].startswith("unsupported") else "skipped"
    text = f"{row['warnings']}/{row['criticals']}/{row['verdicts']}"
    return text if row["finite"] else f"{text} (NaN at {row['nonfinite_step']})"


def table(rows: list[dict[str, Any]], dtypes: Sequence[str]) -> str:
    """The markdown tables: per family and dtype, then the totals and alarms by kind."""
    by = {(r["family"], r["dtype"]): r for r in rows}
    names = sorted({r["family"] for r in rows})
    out = ["| family | " + " | ".join(dtypes) + " |", "|---|" + "---:|" * len(dtypes)]
    out += [f"| {n} | " + " | ".join(cell(by.get((n, d))) for d in dtypes) + " |"
            for n in names]
    out += ["", "| dtype | runs | finite | quiet (0 warnings, 0 criticals, 0 verdicts) | "
            "warnings | criticals | verdicts | not run |", "|---|" + "---:|" * 7]
    kinds: dict[str, collections.Counter[str]] = {d: collections.Counter() for d in dtypes}
    for d in dtypes:
        ran = [r for r in rows if r["dtype"] == d and "warnings" in r]
        quiet = [r for r in ran if not (r["warnings"] or r["criticals"] or r["verdicts"])]
        for r in ran:
            kinds[d].update(r["kinds"])
        out.append(f"| {d} | {len(ran)} | {sum(r['finite'] for r in ran)} | {len(quiet)} | "
                   f"{sum(r['warnings'] for r in ran)} | {sum(r['criticals'] for r in ran)} | "
                   f"{sum(r['verdicts'] for r in ran)} | "
                   f"{sum(1 for r in rows if r['dtype'] == d and 'warnings' not in r)} |")
    every = sorted(set().union(*kinds.values()))
    out += ["", "| alarm kind: severity | " + " | ".join(dtypes) + " |",
            "|---|" + "---:|" * len(dtypes)]
    out += [f"| {k} | " + " | ".join(str(kinds[d][k]) for d in dtypes) + " |" for k in every]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--families", default="", help="comma-separated model types")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--out", default=None, help="write the rows here as JSON lines")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--class", dest="class_name", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    dtypes = [d for d in args.dtypes.split(",") if d]
    if bad := [d for d in dtypes if d not in DTYPES]:
        parser.error(f"--dtypes must be among {', '.join(DTYPES)}: got {', '.join(bad)}")
    if args.one:
        one_family(args.one, args.class_name, dtypes, args.steps)
        return 0
    names = families()
    if args.families:
        wanted = args.families.split(",")
        if unknown := [n for n in wanted if n not in names]:
            parser.error(f"--families: unknown model types {', '.join(unknown)}")
        names = {n: names[n] for n in wanted}
    print(table(sweep(names, dtypes, args.steps, args.jobs, args.out), dtypes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
