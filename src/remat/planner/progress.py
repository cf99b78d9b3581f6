"""What the planner is doing, said while it runs: one line on standard error per stage.

Planning runs training steps (or, from shapes, steps on meta tensors) that take from a
second to minutes; a user waiting on ``auto_checkpoint`` or on a Trainer's first step sees
which stage it is in and how long the last one took. ``quiet`` silences it.

Example:
    >>> import io
    >>> out = io.StringIO()
    >>> say = Progress("remat.auto_checkpoint", stream=out)
    >>> say("profiling from shapes")
    >>> out.getvalue().startswith("remat.auto_checkpoint: profiling from shapes")
    True
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Says each stage on ``stream`` (default: standard error) with the time since the
    previous one; says nothing when ``quiet``."""

    def __init__(self, where: str, quiet: bool = False, stream: TextIO | None = None) -> None:
        self.where, self.quiet, self.stream = where, quiet, stream
        self.start = self.last = time.perf_counter()

    def __call__(self, stage: str) -> None:
        now = time.perf_counter()
        if not self.quiet:
            took = f" (previous stage {now - self.last:.1f} s)" if now - self.start > 0.05 else ""
            print(f"{self.where}: {stage}{took}", file=self.stream or sys.stderr, flush=True)
        self.last = now

    def done(self, what: str) -> None:
        """The last line: ``what`` and the whole time."""
        if not self.quiet:
            took = time.perf_counter() - self.start
            print(f"{self.where}: {what} in {took:.1f} s", file=self.stream or sys.stderr, flush=True)
