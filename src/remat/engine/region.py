"""What one call of a wrapped module runs: the class's forward, guarded against side effects.

Side effects in recompute
-------------------------
* Buffers (BatchNorm's running statistics, step counters, any buffer the
  forward changes in place) are cloned when the forward starts. The
  recompute runs with those values and the buffers are then put back as the
  forward left them, so after a step every buffer equals the unchecked
  model's and a forward that reads its own buffers recomputes bitwise. This
  holds by name too: a forward that assigns a new tensor to a buffer
  (``self.step = self.step + 1``) recomputes with the buffer it started with.
* Train/eval flags are recorded when the forward starts and put in place for
  the recompute, so ``model.eval()`` between forward and backward changes
  nothing (BatchNorm, dropout). Other Python attributes the forward reads are
  not recorded: change them only after backward, or the recompute differs
  (a :class:`CheckpointError` when shapes change, else other gradients).
* Python objects passed in (a KV cache, lists, dicts, objects) are
  fingerprinted (their type, length and tensor shapes, a few levels deep)
  when the forward starts and again around the recompute. If the recompute
  changes one (a cache append done a second time), a :class:`CheckpointError`
  names the module and the argument, because the side effect happened twice.
  If the recompute fails while an argument differs from what the forward
  started with (the forward appended to a cache it then reads), the error is
  a :class:`CheckpointError` that says so, chained to the original one.
  Arguments changed by the caller after the forward, or by a forward that
  guards its side effect with ``if not remat.is_recomputing():``, are fine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes as _no_modes

from . import config, observe
from .errors import CheckpointError


def _fingerprint(obj: Any, depth: int = 0) -> Any:
    """Type, length and tensor shapes of a container, a few levels deep."""
    if isinstance(obj, torch.Tensor):
        return ("T", tuple(obj.shape))
    if depth >= 4 or obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return None
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, len(obj), tuple(_fingerprint(v, depth + 1) for v in obj[:32]))
    if isinstance(obj, dict):
        items = list(obj.items())[:32]
        return ("dict", len(obj), tuple((str(k), _fingerprint(v, depth + 1)) for k, v in items))
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict) and not isinstance(obj, nn.Module):
        items = list(attrs.items())[:32]
        return (type(obj).__name__, tuple((k, _fingerprint(v, depth + 1)) for k, v in items))
    return None


class _Watched:
    """Python arguments that hold tensors, with their forward-time fingerprints."""

    __slots__ = ("items",)

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any], copied: bool) -> None:
        self.items: list[tuple[str, Any, Any]] = []
        for i, a in enumerate(args):
            self._add(f"argument {i}", a, copied)
        for k, v in kwargs.items():
            self._add(f"argument '{k}'", v, copied)

    def _add(self, label: str, obj: Any, copied: bool, depth: int = 0) -> None:
        if isinstance(obj, torch.Tensor):
            return
        items: Any = None
        if depth < 4:
            if isinstance(obj, tuple):
                # A tuple cannot change, only what it holds: watch that. Holding the tuple
                # would keep its tensors alive until backward, past where a span frees the
                # ``(hidden, state)`` one block passes to the next.
                items = enumerate(obj[:32])
            elif copied and isinstance(obj, list):
                # The recompute gets a copy of a list, dict or dataclass as it was when the
                # forward started (the non-reentrant engine and spans rebuild them), so it
                # cannot change the caller's: watch the objects inside, which it shares.
                # Held, a ``[hidden, state]`` passed between span blocks stayed alive.
                items = enumerate(obj[:32])
            elif copied and isinstance(obj, dict):
                items = ((repr(k), v) for k, v in list(obj.items())[:32])
            elif copied and dataclasses.is_dataclass(obj) and not isinstance(obj, type):
                items = ((f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init)
        if items is not None:
            for j, v in items:
                self._add(f"{label}[{j}]", v, copied, depth + 1)
            return
        fp = _fingerprint(obj)
        if fp is not None:  # a container or an object: it may gain tensors (an empty cache)
            self.items.append((label, obj, fp))

    def now(self) -> list[Any]:
        return [_fingerprint(obj) for _, obj, _ in self.items]

    def differing(self, fps: list[Any]) -> list[str]:
        """The arguments whose fingerprint now differs from ``fps``."""
        return [
            f"{label} ({type(obj).__name__})"
            for (label, obj, _), fp in zip(self.items, fps)
            if _fingerprint(obj) != fp
        ]

    def at_forward_start(self) -> list[Any]:
        return [fp for _, _, fp in self.items]


_CACHE_TIP = (
    "Pass use_cache=False while training with checkpointing, or guard the side effect with "
    "`if not remat.is_recomputing():`."
)


class Region:
    """What one wrapped call runs: the class's forward with the side-effect guards."""

    __slots__ = ("module", "forward", "snapshot", "modes", "watched")

    def __init__(
        self,
        module: nn.Module,
        forward: Callable[..., Any],
        args: Any,
        kwargs: Any,
        copied: bool = True,
    ) -> None:
        """``copied``: the recompute gets copies of list, dict and dataclass arguments
        (non-reentrant and spans; the reentrant engine passes the caller's own)."""
        self.module = module
        self.forward = forward
        # Buffers by owner and name, with the tensor and a copy of its value: a forward
        # may change a buffer in place (BatchNorm) or assign a new tensor to its name
        # (``self.step = self.step + 1``); the recompute must see the buffer as it was.
        self.snapshot: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]] | None = None
        # Train/eval flags: ``model.eval()`` between forward and backward must not
        # change what the recompute computes (BatchNorm, dropout).
        self.modes: list[tuple[nn.Module, bool]] = []
        snapshot = []
        copies: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for m in module.modules():
                self.modes.append((m, m.training))
                for name, b in m._buffers.items():
                    if b is not None:
                        value = copies.get(id(b))
                        if value is None:
                            value = copies[id(b)] = b.detach().clone()
                        snapshot.append((m, name, b, value))
        if snapshot:
            self.snapshot = snapshot
            obs = observe.current()
            if obs is not None:  # remat.explain: the copies are what the recompute starts from
                obs.kept([v for _, _, _, v in snapshot], "input")
        self.watched = _Watched(args, kwargs, copied)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not config.is_recomputing():
            return self.forward(*args, **kwargs)
        watched = self.watched
        if not watched.items:
            return self._recompute(args, kwargs)
        before = watched.now()
        name = type(self.module).__name__
        try:
            out = self._recompute(args, kwargs)
        except BaseException as exc:
            again = watched.differing(before)
            if again:
                raise self._again(name, again) from exc
            since = watched.differing(watched.at_forward_start())
            if since and isinstance(exc, Exception) and not _is_stop(exc):
                raise CheckpointError(
                    f"remat.checkpoint_wrapper: {name}'s recompute failed while "
                    f"{', '.join(since)} differed from what its forward started with: the "
                    "forward changed it (for example a KV cache append) and the recompute read "
                    f"the changed value. {_CACHE_TIP}"
                ) from exc
            raise
        again = watched.differing(before)
        if again:
            raise self._again(name, again)
        return out

    @staticmethod
    def _again(name: str, changed: list[str]) -> CheckpointError:
        return CheckpointError(
            f"remat.checkpoint_wrapper: {name}'s recompute changed {', '.join(changed)} again "
            "after its forward had changed it: a side effect of the forward (for example a KV "
            f"cache append) ran twice. {_CACHE_TIP}"
        )

    def _recompute(self, args: Any, kwargs: Any) -> Any:
        modes_now = [(m, m.training) for m, _ in self.modes]
        changed_modes = any(was != now for (_, was), (_, now) in zip(self.modes, modes_now))
        if self.snapshot is None and not changed_modes:
            return self.forward(*args, **kwargs)
        # Outside any dispatch mode: selective checkpointing must not see these copies.
        # Through .data: putting a value back must not bump the version counter, or the
        # recompute's own saved buffers (batch_norm saves running stats) would look modified.
        after: list[tuple[nn.Module, str, Any]] = []
        values: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        with torch.no_grad(), _no_modes():
            for m, name, _, _ in self.snapshot or ():
                if name not in m._buffers:
                    continue  # the forward deleted it: leave it deleted
                now = m._buffers[name]
                after.append((m, name, now))
                if now is not None and id(now) not in values:
                    values[id(now)] = (now, now.detach().clone())
            for m, name, b, before in self.snapshot or ():
                if name in m._buffers:
                    m._buffers[name] = b
                    b.data.copy_(before)
            if changed_modes:
                for m, mode in self.modes:
                    m.training = mode
        try:
            return self.forward(*args, **kwargs)
        finally:
            with torch.no_grad(), _no_modes():
                for m, name, now in after:
                    m._buffers[name] = now
                for now, value in values.values():
                    now.data.copy_(value)
                if changed_modes:
                    for m, mode in modes_now:
                        m.training = mode


def _is_stop(exc: BaseException) -> bool:
    """The engine's own early-stop signal, which is not a failure."""
    return isinstance(exc, config.StopRecompute)
