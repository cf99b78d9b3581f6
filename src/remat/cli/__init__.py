"""The ``remat`` command line: one module per subcommand."""

from __future__ import annotations

import argparse
import importlib
import sys

from . import bench


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``remat`` and ``python -m remat``; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="remat", description="Activation checkpointing for PyTorch: benchmark and plan."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench.add_parser(sub)
    try:
        plan = importlib.import_module(".plan", __name__)
    except ImportError:  # the planner's command is not part of this build
        plan = None
    if plan is not None:
        plan.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return int(args.run(args))
