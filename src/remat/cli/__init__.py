"""The ``remat`` command line: one module per subcommand."""

from __future__ import annotations

import argparse
import importlib
import sys

import torch

from . import bench, explain

VALUE_OPTIONS = ("--budget",)
"""Options whose value may start with ``-`` (a negative budget): argparse would take
``--budget -5%`` for two options and answer "expected one argument"; they are joined
as ``--budget=-5%`` so that remat's own check reports what is wrong with the value."""


def _join_values(argv: list[str]) -> list[str]:
    """``["--budget", "-5%"]`` -> ``["--budget=-5%"]`` (see :data:`VALUE_OPTIONS`).

    Example:
        >>> _join_values(["plan", "--budget", "-5%", "--json", "x"])
        ['plan', '--budget=-5%', '--json', 'x']
    """
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in VALUE_OPTIONS and i + 1 < len(argv) and argv[i + 1].startswith("-"):
            if argv[i + 1] not in ("-h", "--help") and not argv[i + 1].startswith("--"):
                out.append(f"{a}={argv[i + 1]}")
                i += 2
                continue
        out.append(a)
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``remat`` and ``python -m remat``; returns the exit code.

    0 done, 2 a usage mistake (argparse's own errors included: they are returned,
    not raised, so ``main(argv)`` can be called in-process), 1 a failure while
    running, 130 interrupted (Ctrl-C).
    """
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="remat",
        description="Activation checkpointing for PyTorch: benchmark, plan, verify and explain.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"remat {__version__} (torch {torch.__version__}, Python {sys.version.split()[0]})",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench.add_parser(sub)
    explain.add_parser(sub)
    for name in (".plan", ".verify"):
        try:
            command = importlib.import_module(name, __name__)
        except ImportError:  # the planner's commands are not part of this build
            continue
        command.add_parser(sub)
    try:
        args = parser.parse_args(_join_values(sys.argv[1:] if argv is None else list(argv)))
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
