"""The ``normwatch`` command line: ``normwatch demo``, ``normwatch report``,
``normwatch run -- python train.py ARGS``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rich.console import Console

from normwatch._version import __version__


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1: got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1: got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (``--help`` on every subcommand)."""
    from normwatch.demos.faults import DEFAULT_FAULT, FAULTS

    parser = argparse.ArgumentParser(
        prog="normwatch",
        description="Numerical-health monitor for normalization layers in PyTorch training.",
    )
    parser.add_argument("--version", action="version", version=f"normwatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    demo = sub.add_parser(
        "demo",
        help="train a tiny transformer into a numerical fault and watch normwatch catch it",
        description="Train a small pre-norm transformer on synthetic data (on the CPU or "
        "a GPU), reproduce a fault, and show the health table and alarms live.",
    )
    demo.add_argument("--fault", choices=sorted(FAULTS), default=DEFAULT_FAULT,
                      help=f"the fault to reproduce (default: {DEFAULT_FAULT}); "
                      + "; ".join(f"{f.name}: {f.summary}" for f in FAULTS.values()).replace(
                          "%", "%%"))
    demo.add_argument("--steps", type=_positive_int, default=200,
                      help="maximum training steps (default: 200)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    demo.add_argument("--flush-every", type=_positive_int, default=1,
                      help="flush statistics every N steps (default: 1)")
    demo.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                      help="where to train: auto (the GPU where one is up, else the CPU), "
                      "cpu or cuda (default: auto)")
    demo.add_argument("--no-live", action="store_true",
                      help="no live table; print alarms and the final table only")
    demo.add_argument("--report-dir", default="normwatch-reports",
                      help="where post-mortem reports go (default: ./normwatch-reports)")
    report = sub.add_parser(
        "report",
        help="re-render a post-mortem report folder to the console (or to HTML)",
        description="Read a normwatch report (a folder or its report.json; JSON only) and "
        "print its verdict, evidence and per-layer summary.",
    )
    report.add_argument("path", help="report folder or report.json")
    report.add_argument("--html", metavar="OUT", help="also write the HTML report to OUT")
    run = sub.add_parser(
        "run",
        help="watch any training script without editing it: normwatch run -- python train.py",
        description="Run COMMAND (a Python training script) with normwatch watching it: norm "
        "layers are found as models are called, steps counted from optimizer steps, the loss "
        "read where backward() starts, a post-mortem written if the script dies. Options: "
        "the flags below or any watch option as a NORMWATCH_<OPTION> environment variable "
        "(e.g. NORMWATCH_STATS_EVERY=1).",
    )
    run.add_argument("--flush-every", type=_positive_int, help="flush every N steps")
    run.add_argument("--report-dir", help="where post-mortem reports go ('none': nowhere)")
    run.add_argument("--console", choices=("lines", "live"),
                     help="console output (default: lines)")
    run.add_argument("--fp16-limit", type=float, help="the |x| limit alarms measure against")
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                     help="the command to run, after --")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``normwatch`` console script."""
    args = build_parser().parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 120)
    if args.command == "demo":
        from normwatch.demos.demo import run_demo
        from normwatch.errors import ConfigError

        try:
            run_demo(args.fault, steps=args.steps, seed=args.seed, console=console,
                     live=False if args.no_live else None, flush_every=args.flush_every,
                     report_dir=args.report_dir, device=args.device)
        except ConfigError as exc:
            print(f"normwatch demo: error: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.command == "report":
        return _report(args.path, args.html, console)
    if args.command == "run":
        return _run(args)
    return 2  # pragma: no cover - argparse rejects unknown commands


def _report(path: str, html_out: str | None, console: Console) -> int:
    from pathlib import Path

    from normwatch.report.console import ReportSummary
    from normwatch.report.document import ReportError, load_report
    from normwatch.report.html import render_html

    try:
        report = load_report(path)
    except ReportError as exc:
        print(f"normwatch report: error: {exc}", file=sys.stderr)
        return 2
    console.print(ReportSummary(report, path))
    if html_out:
        try:
            Path(html_out).write_text(render_html(report), encoding="utf-8")
        except OSError as exc:
            print(f"normwatch report: error: cannot write --html {html_out!r}: {exc}",
                  file=sys.stderr)
            return 2
        console.print(f"HTML written to {html_out}")
    return 0


def _run(args: argparse.Namespace) -> int:
    import os
    import subprocess
    from pathlib import Path

    from normwatch.config import WatchConfig, options_from_env
    from normwatch.errors import ConfigError
    from normwatch.report.document import prepare_report_dir

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("normwatch run: error: no command: normwatch run -- python train.py ARGS",
              file=sys.stderr)
        return 2
    env = dict(os.environ)
    for flag in ("flush_every", "report_dir", "console", "fp16_limit"):
        value = getattr(args, flag)
        if value is not None:
            env[f"NORMWATCH_{flag.upper()}"] = str(value)
    try:  # bad options and an unusable report folder fail here, before the script starts
        config = WatchConfig.from_options(**{"console": "lines", **options_from_env(env)})
        if config.report_dir is not None:
            prepare_report_dir(config.report_dir)
    except ConfigError as exc:
        print(f"normwatch run: error: {exc}", file=sys.stderr)
        return 2
    boot = str(Path(__file__).resolve().parent / "_boot")
    env["PYTHONPATH"] = os.pathsep.join([boot, *filter(None, [env.get("PYTHONPATH")])])
    env["NORMWATCH_RUN"] = "1"
    try:
        return subprocess.run(cmd, env=env, check=False).returncode
    except FileNotFoundError:
        print(f"normwatch run: error: command not found: {cmd[0]!r}", file=sys.stderr)
        return 127
    except KeyboardInterrupt:  # the script got the signal too
        return 130


if __name__ == "__main__":
    sys.exit(main())
