"""Exact memory measurement: tensor storage bytes alive, on any device.

:func:`track` counts the bytes of every tensor *storage* created inside the
context and still alive, per device, with the peak, across forward and
backward. How:

* A ``TorchDispatchMode`` sees every ATen operator, including the ones the
  autograd engine runs in backward (the mode is part of the thread-local
  state the engine carries to its worker threads).
* A storage is counted when it first appears as an operator's output and is
  not one of that operator's inputs' storages (so views and in-place results
  never count twice) and was not seen before as an input (tensors that
  existed before the context are never counted).
* Its bytes are subtracted when the storage dies: a ``weakref.finalize`` on
  the storage's Python object, which PyTorch keeps for as long as the storage
  lives. Frees can come from any thread, so counters are updated under a lock.

What is not counted: scratch buffers that a kernel allocates and frees inside
one operator (cuBLAS workspaces, SDPA's per-thread buffers), allocator
rounding and fragmentation. Those are not tensor storages that outlive an
operator. On the tests' Linear/ReLU chains the peak equals the peak of
torch.profiler's raw allocator events exactly; on blocks whose kernels use
scratch space the bytes alive between operators still match exactly.

:func:`track_modules` adds a per-module breakdown (bytes alive after each
module's forward, peak during it, bytes alive when its backward starts and
the peak during its backward), which the planner uses.

Example:
    >>> import torch, remat
    >>> lin = torch.nn.Linear(256, 256)
    >>> x = torch.randn(64, 256, requires_grad=True)
    >>> with remat.memory.track() as t:
    ...     y = lin(x).relu()
    >>> t.current_bytes == 64 * 256 * 4      # relu's output (relu saves it for backward)
    True
    >>> t.peak_bytes == 2 * 64 * 256 * 4     # with the Linear's output, freed after relu
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["MemoryTracker", "ModuleMemory", "track", "track_modules"]


class _Window:
    """Peak of the bytes alive since the window was opened (for per-module stats)."""

    __slots__ = ("peak",)

    def __init__(self, current: int) -> None:
        self.peak = current


class MemoryTracker:
    """Counts of tensor storage bytes alive, filled by :func:`track`.

    Attributes:
        current_bytes: bytes alive now (all devices).
        peak_bytes: the most bytes alive at once since the context opened.
        current_bytes_by_device: ``{"cpu": ..., "cuda:0": ...}``.
        peak_bytes_by_device: the peak of each device on its own.
        allocations: number of storages counted.
    """

    def __init__(self) -> None:
        self.current_bytes = 0
        self.peak_bytes = 0
        self.current_bytes_by_device: dict[str, int] = {}
        self.peak_bytes_by_device: dict[str, int] = {}
        self.allocations = 0
        self._lock = threading.Lock()
        self._live: dict[int, int] = {}  # storage cdata -> nbytes
        self._foreign: set[int] = set()
        self._windows: list[_Window] = []

    # -- bookkeeping -----------------------------------------------------------------
    def _alloc(self, key: int, nbytes: int, device: str) -> None:
        with self._lock:
            self._live[key] = nbytes
            self.allocations += 1
            cur = self.current_bytes + nbytes
            self.current_bytes = cur
            if cur > self.peak_bytes:
                self.peak_bytes = cur
            for w in self._windows:
                if cur > w.peak:
                    w.peak = cur
            d = self.current_bytes_by_device.get(device, 0) + nbytes
            self.current_bytes_by_device[device] = d
            if d > self.peak_bytes_by_device.get(device, 0):
                self.peak_bytes_by_device[device] = d

    def _free(self, key: int, device: str) -> None:
        with self._lock:
            nbytes = self._live.pop(key, None)
            if nbytes is None:
                return
            self.current_bytes -= nbytes
            self.current_bytes_by_device[device] -= nbytes

    def open_window(self) -> _Window:
        """Start measuring a peak from the bytes alive now (see :meth:`close_window`)."""
        w = _Window(self.current_bytes)
        with self._lock:
            self._windows.append(w)
        return w

    def close_window(self, w: _Window) -> int:
        """Stop measuring ``w``; return the peak bytes alive while it was open."""
        with self._lock:
            self._windows.remove(w)
        return w.peak

    def __repr__(self) -> str:
        return (
            f"MemoryTracker(current_bytes={self.current_bytes}, peak_bytes={self.peak_bytes}, "
            f"by_device={self.peak_bytes_by_device})"
        )


def _storage_keys(args: Any, out: set[int]) -> None:
    for a in args:
        if isinstance(a, torch.Tensor):
            out.add(a.untyped_storage()._cdata)
        elif isinstance(a, (list, tuple)):
            _storage_keys(a, out)


class _TrackMode(TorchDispatchMode):
    def __init__(self, trackers: list[MemoryTracker]) -> None:
        super().__init__()
        self.trackers = trackers

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs: set[int] = set()
        _storage_keys(args, inputs)
        _storage_keys(kwargs.values(), inputs)
        for t in self.trackers:
            t._foreign.update(k for k in inputs if k not in t._live)
        self._record(out, inputs)
        return out

    def _record(self, out: Any, inputs: set[int]) -> None:
        if isinstance(out, torch.Tensor):
            if out.device.type == "meta":
                return
            st = out.untyped_storage()
            key = st._cdata
            if key in inputs:
                return
            fresh = [t for t in self.trackers if key not in t._live and key not in t._foreign]
            if not fresh:
                return
            nbytes = st.nbytes()
            device = str(out.device)
            for t in fresh:
                t._alloc(key, nbytes, device)
                weakref.finalize(st, t._free, key, device)
        elif isinstance(out, (list, tuple)):
            for o in out:
                self._record(o, inputs)


@contextlib.contextmanager
def track() -> Iterator[MemoryTracker]:
    """Count the tensor storage bytes allocated inside and still alive, with the peak.

    Trackers nest: an inner tracker counts what is allocated inside it, the
    outer one counts that too. Storages freed inside the context are
    subtracted; tensors that existed before it are never counted. Frees that
    happen after the context closed are still subtracted.

    Yields:
        A :class:`MemoryTracker`.

    Example:
        >>> import torch, remat
        >>> with remat.memory.track() as t:
        ...     a = torch.ones(1000)          # 4000 bytes
        ...     b = a.view(10, 100)           # a view: not counted again
        ...     del a, b                      # freed: subtracted
        ...     c = torch.zeros(250)          # 1000 bytes
        >>> t.current_bytes, t.peak_bytes
        (1000, 4000)
    """
    tracker = MemoryTracker()
    mode = _TrackMode([tracker])
    with mode:
        yield tracker


@dataclasses.dataclass
class ModuleMemory:
    """Per-module bytes, from :func:`track_modules` (latest call of each module).

    Attributes:
        before_forward: bytes alive when the module's forward started.
        after_forward: bytes alive when it returned.
        forward_peak: peak bytes alive during its forward.
        before_backward: bytes alive when its backward started (gradients of its outputs ready).
        backward_peak: peak bytes alive during its backward.
    """

    before_forward: int = 0
    after_forward: int = 0
    forward_peak: int = 0
    before_backward: int = 0
    backward_peak: int = 0


class _ModuleHooks:
    """Forward and backward hooks that read a tracker at module boundaries."""

    def __init__(self, tracker: MemoryTracker, name: str, stats: ModuleMemory) -> None:
        self.tracker = tracker
        self.name = name
        self.stats = stats
        self.fwd: _Window | None = None
        self.bwd: _Window | None = None

    def forward_pre(self, module: Any, args: Any) -> None:
        self.stats.before_forward = self.tracker.current_bytes
        self.fwd = self.tracker.open_window()

    def forward_post(self, module: Any, args: Any, out: Any) -> None:
        self.stats.after_forward = self.tracker.current_bytes
        if self.fwd is not None:
            self.stats.forward_peak = self.tracker.close_window(self.fwd)
            self.fwd = None

    def backward_pre(self, module: Any, grad_out: Any) -> None:
        self.stats.before_backward = self.tracker.current_bytes
        self.bwd = self.tracker.open_window()

    def backward_post(self, module: Any, grad_in: Any, grad_out: Any) -> None:
        if self.bwd is not None:
            self.stats.backward_peak = self.tracker.close_window(self.bwd)
            self.bwd = None


@contextlib.contextmanager
def track_modules(
    modules: dict[str, torch.nn.Module] | torch.nn.Module,
) -> Iterator[tuple[MemoryTracker, dict[str, ModuleMemory]]]:
    """:func:`track` plus a per-module breakdown at each module's boundaries.

    Args:
        modules: a model (every named submodule is measured) or a dict
            ``name -> module`` of the modules to measure.

    Yields:
        ``(tracker, stats)`` where ``stats`` maps module names to
        :class:`ModuleMemory`.

    Example:
        >>> import torch, remat
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> with remat.memory.track_modules(model) as (t, stats):
        ...     model(x).sum().backward()
        >>> stats["0"].after_forward - stats["0"].before_forward   # the Linear's output
        128
    """
    if isinstance(modules, torch.nn.Module):
        named = {n: m for n, m in modules.named_modules() if n}
    else:
        named = dict(modules)
    stats = {n: ModuleMemory() for n in named}
    with track() as tracker:
        handles = []
        try:
            for name, mod in named.items():
                h = _ModuleHooks(tracker, name, stats[name])
                handles.append(mod.register_forward_pre_hook(h.forward_pre))
                handles.append(mod.register_forward_hook(h.forward_post))
                handles.append(mod.register_full_backward_pre_hook(h.backward_pre))
                handles.append(mod.register_full_backward_hook(h.backward_post))
            yield tracker, stats
        finally:
            for h in handles:
                h.remove()
