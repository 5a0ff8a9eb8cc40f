"""MkDocs hook: the reference pages' tables, generated from the code at build time.

A page asks for a table with a marker line, ``<!-- generated: NAME -->``; the marker is
replaced by :data:`TABLES` ``[NAME]()``. So the options reference is ``WatchConfig``'s
fields and their docstrings, the metrics reference the families a real watch's collector
yields, the command-line reference the parser's own help: none of them can drift from
the code.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import re
from collections.abc import Callable
from typing import Any

MARKER = re.compile(r"^<!-- generated: (\w+) -->$", flags=re.M)


def on_page_markdown(markdown: str, **_: Any) -> str:
    """Replace each marker with its generated table (an unknown name fails the build)."""
    def table(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in TABLES:
            raise KeyError(f"no generated table {name!r} (known: {', '.join(TABLES)})")
        return TABLES[name]()

    return MARKER.sub(table, markdown)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _attribute_docs(cls: type) -> dict[str, str]:
    """A dataclass's attribute docstrings (the string right after each field)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for field, after in itertools.pairwise(body):
        if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name) and \
                isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[field.target.id] = inspect.cleandoc(str(after.value.value))
    return docs


def _rst(text: str) -> str:
    """Sphinx roles and double backticks as Markdown code."""
    text = re.sub(r":\w+:`~?([^`]+)`", lambda m: f"`{m.group(1).split('.')[-1]}`", text)
    return text.replace("``", "`")


def options() -> str:
    """Every option of ``normwatch.watch(...)``, the limits by name."""
    from normwatch.config import ENV_PREFIX, WatchConfig, option_defaults
    from normwatch.records import Limits

    docs = {**_attribute_docs(WatchConfig), **_attribute_docs(Limits)}
    types = {f.name: f.type for f in (*dataclasses.fields(WatchConfig),
                                      *dataclasses.fields(Limits))}
    rows = ["| option | default | meaning |", "|---|---|---|"]
    for name, default in option_defaults().items():
        env = "" if name == "sinks" else f" · `{ENV_PREFIX}{name.upper()}`"
        rows.append(f"| `{name}` | `{default!r}` | {_cell(_rst(docs.get(name, '')))}"
                    f"<br>*type* `{_cell(str(types[name]))}`{env} |")
    return "\n".join(rows)


def _watched_run(*sinks: object) -> Any:
    """A tiny model trained a few steps, optimizer watched and guarded: a watch whose
    collector and flushes hold every family (``sinks`` added to it)."""
    import torch

    import normwatch
    from normwatch.demos.toymodel import TinyLM, lm_loss, synthetic_batch

    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    watch = normwatch.watch(model, optimizer, flush_every=4, stats_every=1, report_dir=None,
                            guard=True)
    for sink in sinks:
        watch.add_sink(sink)
    generator = torch.Generator().manual_seed(0)
    for _ in range(8):
        batch = synthetic_batch(generator)
        loss = lm_loss(model(batch), batch)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad()
        watch.step(loss)
    return watch


def metrics() -> str:
    """The Prometheus families a real watch's collector yields."""
    watch = _watched_run()
    try:
        families = list(watch.collector.collect())
    finally:
        watch.close()
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for family in sorted(families, key=lambda f: f.name):
        name = family.name + {"counter": "_total", "info": "_info"}.get(family.type, "")
        labels = sorted({k for s in family.samples for k in s.labels}
                        - {"run_id", "rank"})
        shown = ", ".join(f"`{k}`" for k in labels) or "—"
        rows.append(f"| `{name}` | {family.type} | {shown} | {_cell(family.documentation)} |")
    return "\n".join(rows)


def logger_metrics() -> str:
    """The keys the trainer callbacks log at a flush (defaults, then ``log_layers=True``),
    as their sink gives them on a real run."""
    from normwatch.export.metrics import LoggerMetrics

    summary: dict[str, float] = {}
    full: dict[str, float] = {}
    _watched_run(LoggerMetrics(summary.update), LoggerMetrics(full.update, per_layer=True)
                 ).close()
    layers = {k.split("/")[1] for k in set(full) - set(summary)}
    per_layer = sorted({k.rsplit("/", 1)[1] for k in full if k.split("/")[1] in layers})
    rows = ["| key | logged |", "|---|---|"]
    rows += [f"| `{k}` | always |" for k in sorted(summary)]
    rows += [f"| `normwatch/<layer>/{s}` | with `log_layers=True` |" for s in per_layer]
    return "\n".join(rows)


def cli() -> str:
    """``normwatch --help`` and each subcommand's, as the parser prints them."""
    import argparse

    from normwatch.cli import build_parser

    parser = build_parser()
    parts = [("normwatch", parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            parts += [(f"normwatch {name}", sub) for name, sub in action.choices.items()]
    out = []
    for title, sub in parts:
        sub.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=90)
        out += [f"## `{title}`", "", "```text", sub.format_help().rstrip(), "```", ""]
    return "\n".join(out)


def drills() -> str:
    """The demo's failure drills."""
    from normwatch.demos.faults import DEFAULT_FAULT, FAULTS

    rows = ["| `--fault` | what it reproduces |", "|---|---|"]
    rows += [f"| `{f.name}`{' (default)' if f.name == DEFAULT_FAULT else ''} | "
             f"{_cell(f.summary)} |" for f in FAULTS.values()]
    return "\n".join(rows)


TABLES: dict[str, Callable[[], str]] = {
    "options": options, "metrics": metrics, "logger_metrics": logger_metrics, "cli": cli,
    "drills": drills,
}
