"""Thread- and task-local settings and flags, all on :mod:`contextvars`.

Nothing here is process-global: every setting is a ``ContextVar`` that a
context manager sets and restores on exit (exceptions included), so two
threads or asyncio tasks that checkpoint at once never see each other's flags.

The ``ContextVar`` objects are this module's alone. The rest of the package
reads the user's overrides through :func:`early_stop_override`,
:func:`debug_override` and :func:`checkpointing_disabled`, and marks the code
that runs inside a region with :func:`entering_region` (a checkpointed
forward) or :func:`recomputing_region` (a recompute), which raise the depth
counters behind :func:`is_checkpointing` and :func:`is_recomputing` and
restore them on every exit path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar, Token
from typing import Any

import torch
import torch.utils.checkpoint as _tuc


class StopRecompute(Exception):
    """The engine's own early-stop signal, not a failure: raised in a recompute once it has
    reproduced every tensor backward needs (``early_stop``); the region that recomputes
    ``frame`` (a non-reentrant region's frame) catches it, and a wrapper's side-effect
    guard lets it pass."""

    def __init__(self, frame: object) -> None:
        self.frame = frame


_early_stop: ContextVar[bool | None] = ContextVar("remat_early_stop", default=None)
_debug: ContextVar[bool | None] = ContextVar("remat_debug", default=None)
_disabled: ContextVar[bool] = ContextVar("remat_disabled", default=False)
# Depth counters rather than bools so that nested regions restore correctly.
_checkpointing: ContextVar[int] = ContextVar("remat_checkpointing", default=0)
_recomputing: ContextVar[int] = ContextVar("remat_recomputing", default=0)
_group: ContextVar[Any] = ContextVar("remat_graph_exec_group", default=None)


@contextlib.contextmanager
def set_checkpoint_early_stop(enable: bool) -> Iterator[None]:
    """Override ``early_stop`` of every non-reentrant ``checkpoint`` inside.

    With early stop, recomputation stops as soon as every tensor the backward
    needs has been recomputed, instead of running the rest of the function.

    Args:
        enable: ``True`` to stop early, ``False`` to always run the whole function.

    Example:
        >>> import torch, remat
        >>> x = torch.randn(4, requires_grad=True)
        >>> with remat.set_checkpoint_early_stop(False):
        ...     y = remat.checkpoint(torch.sin, x)
        >>> y.sum().backward()
    """
    if not isinstance(enable, bool):
        raise TypeError(
            f"set_checkpoint_early_stop: enable must be a bool, got {enable!r}. "
            "Pass True to stop recomputation early or False to run the whole function."
        )
    token = _early_stop.set(enable)
    try:
        yield
    finally:
        _early_stop.reset(token)


@contextlib.contextmanager
def set_checkpoint_debug_enabled(enabled: bool | None) -> Iterator[None]:
    """Override ``debug`` of every ``checkpoint`` call inside.

    Args:
        enabled: ``True`` or ``False`` override each call's ``debug`` argument;
            ``None`` leaves it to the call.

    Example:
        >>> import torch, remat
        >>> x = torch.randn(4, requires_grad=True)
        >>> with remat.set_checkpoint_debug_enabled(True):
        ...     y = remat.checkpoint(torch.sin, x)
        >>> y.sum().backward()
    """
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(
            f"set_checkpoint_debug_enabled: enabled must be True, False or None, got {enabled!r}."
        )
    token = _debug.set(enabled)
    try:
        yield
    finally:
        _debug.reset(token)


@contextlib.contextmanager
def disable_checkpointing() -> Iterator[None]:
    """Run every ``checkpoint`` call and checkpointed module inside as a plain call.

    Useful to compare a model with and without checkpointing, or for evaluation
    code that runs with gradients.

    Example:
        >>> import torch, remat
        >>> x = torch.randn(4, requires_grad=True)
        >>> with remat.disable_checkpointing():
        ...     y = remat.checkpoint(torch.sin, x)   # just torch.sin(x)
        >>> y.grad_fn.name()
        'SinBackward0'
    """
    token = _disabled.set(True)
    try:
        yield
    finally:
        _disabled.reset(token)


def is_checkpointing() -> bool:
    """True while a checkpointed function runs, in its forward or in its recompute.

    Example:
        >>> import torch, remat
        >>> remat.is_checkpointing()
        False
        >>> remat.checkpoint(lambda x: remat.is_checkpointing(), torch.ones(1, requires_grad=True))
        True
    """
    return _checkpointing.get() > 0


def is_recomputing() -> bool:
    """True while a checkpointed function is being recomputed for backward.

    Guard side effects (appending to a cache, logging, counters) with it so
    that they happen once per step, not again in recompute.

    Example:
        >>> import torch, remat
        >>> calls = []
        >>> def f(x):
        ...     if not remat.is_recomputing():
        ...         calls.append(1)
        ...     return x.sin()
        >>> remat.checkpoint(f, torch.ones(2, requires_grad=True)).sum().backward()
        >>> len(calls)
        1
    """
    return _recomputing.get() > 0


def early_stop_override() -> bool | None:
    """The ``early_stop`` set by :func:`set_checkpoint_early_stop` around the caller, or
    ``None`` (each call's own argument decides)."""
    return _early_stop.get()


def debug_override() -> bool | None:
    """The ``debug`` set by :func:`set_checkpoint_debug_enabled` around the caller, or
    ``None`` (each call's own argument decides)."""
    return _debug.get()


def checkpointing_disabled() -> bool:
    """True inside :func:`disable_checkpointing`: checkpoints run as plain calls."""
    return _disabled.get()


class RegionDepth:
    """Inside, :func:`is_checkpointing` (and, for a recompute, :func:`is_recomputing`)
    says so; the depths are put back on exit, exceptions included.

    One instance serves one ``with`` (it keeps the tokens to restore). A class, not a
    generator: every checkpoint call enters one or two.
    """

    __slots__ = ("recompute", "tokens")

    def __init__(self, recompute: bool) -> None:
        self.recompute = recompute
        self.tokens: tuple[Token[int], Token[int] | None] | None = None

    def __enter__(self) -> None:
        c = _checkpointing.set(_checkpointing.get() + 1)
        r = _recomputing.set(_recomputing.get() + 1) if self.recompute else None
        self.tokens = (c, r)

    def __exit__(self, *exc: object) -> None:
        tokens = self.tokens
        if tokens is not None:
            self.tokens = None
            c, r = tokens
            if r is not None:
                _recomputing.reset(r)
            _checkpointing.reset(c)


def entering_region() -> RegionDepth:
    """Context manager for a checkpointed region's forward (depths nest).

    Example:
        >>> with entering_region():
        ...     is_checkpointing(), is_recomputing()
        (True, False)
        >>> is_checkpointing()
        False
    """
    return RegionDepth(False)


def recomputing_region() -> RegionDepth:
    """Context manager for a region's recompute: checkpointing and recomputing both.

    Example:
        >>> with recomputing_region():
        ...     is_checkpointing(), is_recomputing()
        (True, True)
    """
    return RegionDepth(True)


class _GraphExecGroupFallback:
    """``GraphExecGroup`` for torch versions that lack it (same contract, task-local).

    Backward calls made inside one instance recompute each non-reentrant
    region at most once; they must not need the same saved tensor twice.
    """

    def __init__(self) -> None:
        self._token: Token[Any] | None = None

    def __enter__(self) -> _GraphExecGroupFallback:
        current = current_graph_exec_group()
        if current is not None:
            raise RuntimeError(
                f"GraphExecGroup contexts cannot be nested. Already inside group {current}; "
                "leave it before entering another one."
            )
        self._token = _group.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _group.reset(self._token)
            self._token = None


#: torch's own class where torch has it (2.13 does), so that torch's and remat's
#: checkpoints inside one group share it; otherwise remat's equivalent.
GraphExecGroup: Any = getattr(_tuc, "GraphExecGroup", _GraphExecGroupFallback)
_torch_group = getattr(torch._C, "_get_graph_exec_group", None)


def current_graph_exec_group() -> Any:
    """The ``GraphExecGroup`` entered in this thread, or ``None``."""
    if _torch_group is not None:
        group = _torch_group()
        if group is not None:
            return group
    return _group.get()
