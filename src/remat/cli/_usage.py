"""What every subcommand shares."""

from __future__ import annotations


class UsageError(Exception):
    """A mistake in the command line, reported without a traceback (exit code 2)."""
