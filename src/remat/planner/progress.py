"""What the planner is doing, said while it runs: one line on standard error per stage.

Planning runs training steps (or, from shapes, steps on meta tensors) that take from a
second to minutes; a user waiting on ``auto_checkpoint`` or on a Trainer's first step sees
which stage it is in and how long the last one took. Where a stage has countable steps (a
profile's steps, one per decision measured, then its costs) a ``tqdm`` bar counts them
(:func:`bar`), on the same stream when it is a terminal (not into a log file or a pipe),
cleared when the stage ends. ``quiet`` silences both.

The bar is found through a context variable that :meth:`Progress.active` sets, so the code
that runs the steps (:mod:`remat.planner.measure`) needs no argument for it: outside
``auto_checkpoint`` (a bare :func:`remat.profile`) there is none and nothing is printed.

Example:
    >>> import io
    >>> out = io.StringIO()
    >>> say = Progress("remat.auto_checkpoint", stream=out)
    >>> say("profiling from shapes")
    >>> out.getvalue().startswith("remat.auto_checkpoint: profiling from shapes")
    True
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import time
from collections.abc import Iterator
from typing import Any, TextIO

#: the Progress of the planning that runs now (its stages' bars), if one says anything
_ACTIVE: contextvars.ContextVar[Progress | None] = contextvars.ContextVar(
    "remat_progress", default=None
)


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
            _write(f"{self.where}: {stage}{took}", self.stream)
        self.last = now

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Inside, :func:`bar` draws on this progress's stream (nothing when ``quiet``)."""
        token = _ACTIVE.set(None if self.quiet else self)
        try:
            yield
        finally:
            _ACTIVE.reset(token)

    def done(self, what: str) -> None:
        """The last line: ``what`` and the whole time."""
        if not self.quiet:
            took = time.perf_counter() - self.start
            _write(f"{self.where}: {what} in {took:.1f} s", self.stream)


def _write(line: str, stream: TextIO | None) -> None:
    """``line`` on ``stream`` (standard error), above any bar drawn there (``tqdm.write``)."""
    from tqdm import tqdm

    tqdm.write(line, file=stream or sys.stderr)


class _NoBar:
    """What :func:`bar` gives where nothing is said: its ``update`` does nothing."""

    def update(self, n: int = 1) -> None:
        pass


@contextlib.contextmanager
def bar(total: int, what: str, unit: str = "step") -> Iterator[Any]:
    """A ``tqdm`` bar of ``total`` ``unit`` s (``what``: the stage, after the planner's
    name) on the active :class:`Progress`'s stream if it is a terminal, cleared at the end;
    outside one, or when it is quiet, an object whose ``update()`` does nothing.

    Example:
        >>> import io
        >>> class Terminal(io.StringIO):
        ...     def isatty(self):
        ...         return True
        >>> out = Terminal()
        >>> with Progress("remat.auto_checkpoint", stream=out).active():
        ...     with bar(3, "profiling") as b:
        ...         b.update()
        >>> "remat.auto_checkpoint: profiling" in out.getvalue()
        True
        >>> with bar(3, "profiling") as b:  # no Progress active: nothing drawn
        ...     b.update()
    """
    say = _ACTIVE.get()
    if say is None:
        yield _NoBar()
        return
    from tqdm import tqdm

    with tqdm(
        total=total,
        desc=f"{say.where}: {what}",
        unit=unit,
        file=say.stream or sys.stderr,
        leave=False,
        mininterval=0.2,
        disable=None,  # tqdm's: drawn on a terminal only, not into logs or pipes
    ) as t:
        yield t
