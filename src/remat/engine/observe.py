"""The engine's hook point for :func:`remat.explain`: who keeps which tensor, and why.

The engine asks :func:`current` once per region (a ``ContextVar`` read) and,
when an observer is installed, builds the observed variant of what it is
about to make (:class:`remat.engine.nonreentrant` frames, the selective forward
mode, the offload hooks): those tell the observer what they keep. With no
observer, nothing else changes and no per-tensor work is added: the observed
variants are subclasses picked once per region, not checks in the hot path.

The observer itself (:mod:`remat.measure.probe`) lives above the engine; this module
only defines what the engine calls.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, Protocol

import torch


class RegionProbe(Protocol):
    """What one observed checkpoint region reports."""

    def inputs_kept(self) -> None:
        """The region has kept its inputs (saved under the hooks outside it)."""

    def saw(self, x: torch.Tensor) -> None:
        """The region dropped ``x``, a tensor autograd saved inside it (recomputed later)."""

    def forward_end(self) -> None:
        """The region's forward returned (or raised)."""

    def recompute_start(self) -> None:
        """Backward starts recomputing the region."""

    def recompute_end(self) -> None:
        """The recompute ended."""


class Observer(Protocol):
    """What the engine tells :func:`remat.explain`'s probe."""

    def region_start(self, kind: str, fn: Callable[..., Any]) -> RegionProbe:
        """A region starts its forward; the tensors saved until ``inputs_kept`` are its inputs.

        ``kind``: ``"checkpoint"``, ``"reentrant"`` or ``"span"``.
        """

    def keeping_input(self, on: bool) -> None:
        """Tensors saved while ``on`` are inputs a span keeps (its region started earlier)."""

    def kept(self, tensors: list[torch.Tensor], how: str) -> None:
        """Something keeps ``tensors`` for backward: ``how`` is ``"selective"`` (a policy saved
        them), ``"offloaded"`` (host copies) or ``"input"`` (a wrapper's copies of buffers)."""

    def offloaded(self, source: torch.Tensor, host: torch.Tensor) -> None:
        """``host`` holds the saved tensor ``source`` in host memory until backward."""


_current: ContextVar[Observer | None] = ContextVar("remat_observer", default=None)


def current() -> Observer | None:
    """The observer installed in this thread (or task), or ``None``."""
    return _current.get()


@contextlib.contextmanager
def observing(observer: Observer) -> Iterator[Observer]:
    """Install ``observer`` for the code inside (restored on every exit path)."""
    token = _current.set(observer)
    try:
        yield observer
    finally:
        _current.reset(token)
