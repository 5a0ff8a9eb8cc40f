"""The ``normwatch`` command line: ``normwatch demo``, ``normwatch layers``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rich.console import Console

from normwatch import __version__


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
    from normwatch.demo import DEFAULT_FAULT, FAULTS

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
        description="Train a small pre-norm transformer on synthetic data on the CPU, "
        "reproduce a fault, and show the health table and alarms live.",
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
    demo.add_argument("--no-live", action="store_true",
                      help="no live table; print alarms and the final table only")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``normwatch`` console script."""
    args = build_parser().parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 120)
    if args.command == "demo":
        from normwatch.demo import run_demo

        run_demo(args.fault, steps=args.steps, seed=args.seed, console=console,
                 live=False if args.no_live else None, flush_every=args.flush_every)
        return 0
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
