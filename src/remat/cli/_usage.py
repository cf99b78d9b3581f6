"""What every subcommand shares: the usage error and checks of output paths.

Exit codes of every subcommand: 0 done, 2 a mistake in the command line (a
:class:`UsageError`, found before any work where it can be), 1 a failure while
running (the user's factory or model raised, an output could not be written).
Each error is one line on stderr, without a traceback.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

import torch

import remat


class UsageError(Exception):
    """A mistake in the command line, reported without a traceback (exit code 2)."""


class RunError(Exception):
    """A failure while running, reported without a traceback (exit code 1)."""


class Reported:
    """Where a subcommand's ``main`` runs: a :class:`UsageError` or :class:`RunError` raised
    inside is said as one line on standard error under ``command``'s name, and :attr:`code`
    is then its exit code (2 or 1; 0 when none was raised).

    Example:
        >>> with Reported("remat plan") as run:
        ...     raise UsageError("--budget: expected a size")
        >>> run.code
        2
    """

    def __init__(self, command: str) -> None:
        self.command = command
        self.code = 0

    def __enter__(self) -> Reported:
        return self

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: Any) -> bool:
        if isinstance(e, (UsageError, RunError)):
            print(f"{self.command}: error: {e}", file=sys.stderr)
            self.code = 2 if isinstance(e, UsageError) else 1
            return True
        return False


def check_output_path(flag: str, path: str) -> None:
    """Raise :class:`UsageError` unless ``path`` can be written as a file.

    Checked before any work, so that a long run is not lost to a typo in the
    output path.
    """
    if not path:
        raise UsageError(f"{flag} '': empty file name; pass a file path such as out.json.")
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path}: is a directory; pass a file path inside it.")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(
            f"{flag} {path}: the folder {parent} does not exist; create it or pass another path."
        )
    target = path if os.path.exists(path) else parent
    if not os.access(target, os.W_OK):
        raise UsageError(f"{flag} {path}: {target} is not writable; pass another path.")


def write_text(flag: str, path: str, text: str) -> None:
    """Write ``text`` to ``path``; an ``OSError`` becomes a :class:`RunError` naming ``flag``."""
    try:
        with open(path, "w") as fh:
            fh.write(text)
    except OSError as e:
        raise RunError(f"{flag} {path}: cannot write it: {e.strerror or e}.") from None


def describe(e: BaseException) -> str:
    """``Type: message (at file:line)`` of an exception, in one line.

    The place is the innermost frame of the user's code: not in torch, not in
    remat, not in the import machinery (a ``SyntaxError`` names its own line).
    """
    text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    skip = tuple(os.path.dirname(m.__file__ or "") + os.sep for m in (torch, remat))
    frames = [
        f
        for f in traceback.extract_tb(e.__traceback__)
        if not f.filename.startswith("<") and not f.filename.startswith(skip)
    ]
    if frames and not isinstance(e, SyntaxError):
        text += f" (at {frames[-1].filename}:{frames[-1].lineno})"
    return text
