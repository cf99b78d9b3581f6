"""The ``remat`` command line: one module per subcommand."""

from __future__ import annotations

import argparse
import importlib
import sys

from . import bench


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``remat`` and ``python -m remat``; returns the exit code.

    0 done, 2 a usage mistake (argparse's own errors included: they are returned,
    not raised, so ``main(argv)`` can be called in-process), 1 a failure while
    running, 130 interrupted (Ctrl-C).
    """
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
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error argparse has printed (2)
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.run(args))
    except KeyboardInterrupt:
        print(f"remat {args.command}: interrupted", file=sys.stderr)
        return 130
