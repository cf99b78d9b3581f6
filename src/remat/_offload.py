"""Host offload: keep tensors in host memory between forward and backward.

The engine (:class:`HostStash`) is shared by the ``*_CPU_OFFLOAD`` policies of
selective checkpointing and by :func:`offload`.

On a device (CUDA or any backend with streams and events)
-------------------------------------------------------------
* A tensor is copied into a pinned host buffer taken from a reusable
  :class:`_PinnedPool` (no per-tensor pinned allocation), on one side stream
  per device. The side stream first waits for an event recorded on the
  compute stream, so the copy reads the finished value; the device tensor is
  marked used by the side stream (``record_stream``) so the caching allocator
  cannot hand its memory out before the copy has read it.
* Bringing it back allocates on the compute stream's allocator, copies on the
  side stream after the copy out (same stream: ordered), records an event,
  and makes the compute stream wait for that event before anyone reads the
  tensor. The compute stream therefore never reads a buffer before its copy
  has finished.
* A host buffer returns to the pool only after the copy back into the device
  has finished; since copies out and back run on the same side stream in
  issue order, a buffer reused for a later copy out is never overwritten
  before the earlier copy back has read it.
* Prefetch: when backward asks for one tensor, the tensors stashed just
  before it (which backward needs next) are brought back on the side stream
  at once, overlapping the copies with compute. The offload policies share one
  stash per thread (:func:`shared_stash`), so this crosses region boundaries:
  recomputing one region prefetches the offloaded outputs of the region
  before it.

On CPU-only setups the tensor already lives in host memory: it is kept as it
is (no copy) and never recomputed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch

_PREFETCH_DEPTH = 2


class _PinnedPool:
    """Free pinned host buffers of one size class, reused across steps."""

    def __init__(self, pin_memory: bool) -> None:
        self.pin = pin_memory
        self.free: dict[int, list[torch.Tensor]] = {}

    @staticmethod
    def _size_class(nbytes: int) -> int:
        return 1 << max(nbytes - 1, 1).bit_length()

    def take(self, nbytes: int) -> torch.Tensor:
        size = self._size_class(nbytes)
        bucket = self.free.get(size)
        if bucket:
            return bucket.pop()
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)

    def give(self, buf: torch.Tensor) -> None:
        self.free.setdefault(buf.numel(), []).append(buf)


class _Ticket:
    """One stashed tensor: on the host, or brought back to its device."""

    __slots__ = (
        "host",
        "device",
        "dtype",
        "shape",
        "stride",
        "offset",
        "out_done",
        "back",
        "back_done",
        "nbytes",
        "__weakref__",
    )

    def __init__(self, t: torch.Tensor, nbytes: int) -> None:
        self.device: torch.device = t.device
        self.dtype: torch.dtype = t.dtype
        self.shape: torch.Size = t.shape
        self.nbytes = nbytes
        self.host: torch.Tensor | None = None
        self.back: torch.Tensor | None = None
        self.out_done: Any = None
        self.back_done: Any = None


class HostStash:
    """Moves device tensors to host memory and back with stream/event ordering."""

    def __init__(self, pin_memory: bool = True) -> None:
        self.pool = _PinnedPool(pin_memory)
        self.streams: dict[torch.device, Any] = {}
        self.order: list[weakref.ref[_Ticket]] = []
        self.current_bytes = 0
        self.peak_bytes = 0
        self.total_bytes = 0
        self.count = 0

    def _stream(self, device: torch.device) -> Any:
        s = self.streams.get(device)
        if s is None:
            mod = torch.get_device_module(device.type)
            s = mod.Stream(device=device)
            self.streams[device] = s
        return s

    def put(self, t: torch.Tensor) -> _Ticket | torch.Tensor:
        """Stash ``t``; return what :meth:`get` takes back (the tensor itself on CPU)."""
        nbytes = t.untyped_storage().nbytes() if t.device.type != "cpu" else t.nbytes
        self.count += 1
        self.total_bytes += nbytes
        self.current_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        if t.device.type == "cpu":
            return t
        mod = torch.get_device_module(t.device.type)
        tk = _Ticket(t, nbytes)
        src = t.detach()
        if not src.is_contiguous():
            src = src.contiguous()
        stream = self._stream(t.device)
        ready = mod.Event()
        ready.record(mod.current_stream(t.device))
        buf = self.pool.take(src.nbytes)
        host = buf[: src.nbytes].view(src.dtype).view(src.shape)
        with mod.stream(stream):
            stream.wait_event(ready)
            host.copy_(src, non_blocking=True)
            done = mod.Event()
            done.record(stream)
        src.record_stream(stream)
        tk.host = host
        tk.out_done = (done, buf)
        self.order.append(weakref.ref(tk))
        if len(self.order) % 1024 == 0:  # forget tickets that are gone
            self.order = [r for r in self.order if r() is not None]
        return tk

    def _bring_back(self, tk: _Ticket) -> None:
        mod = torch.get_device_module(tk.device.type)
        stream = self._stream(tk.device)
        assert tk.host is not None
        with mod.stream(stream):
            dev = torch.empty(tk.shape, dtype=tk.dtype, device=tk.device)
            dev.copy_(tk.host, non_blocking=True)  # after the copy out: same stream
            done = mod.Event()
            done.record(stream)
        dev.record_stream(mod.current_stream(tk.device))
        tk.back, tk.back_done = dev, done

    def get(self, tk: _Ticket | torch.Tensor) -> torch.Tensor:
        """Return the stashed tensor on its device, safe to read on the compute stream."""
        if isinstance(tk, torch.Tensor):
            return tk
        if tk.back is None:
            self._bring_back(tk)
        self._prefetch_before(tk)
        mod = torch.get_device_module(tk.device.type)
        mod.current_stream(tk.device).wait_event(tk.back_done)
        return tk.back  # type: ignore[return-value]

    def release(self, tk: _Ticket | torch.Tensor) -> None:
        """Forget a stashed tensor; its host buffer returns to the pool once safe."""
        if isinstance(tk, torch.Tensor):
            self.current_bytes -= tk.nbytes
            return
        self.current_bytes -= tk.nbytes
        if tk.out_done is not None:
            done, buf = tk.out_done
            if tk.back_done is not None:
                done = tk.back_done
            done.synchronize()
            self.pool.give(buf)
            tk.out_done = None
        tk.host = None
        tk.back = None

    def _prefetch_before(self, tk: _Ticket) -> None:
        # Backward visits tensors in reverse order of forward: fetch the ones stashed just before.
        for i in range(len(self.order) - 1, -1, -1):
            if self.order[i]() is tk:
                for j in range(i - 1, max(i - 1 - _PREFETCH_DEPTH, -1), -1):
                    other = self.order[j]()
                    if other is not None and other.back is None and other.host is not None:
                        self._bring_back(other)
                break


_thread_stash: ContextVar[HostStash | None] = ContextVar("remat_offload_stash", default=None)


def shared_stash() -> HostStash:
    """The host stash of the offload policies in this thread (or task).

    One stash serves every checkpointed region, so backward prefetches the
    tensors of the region it will reach next, and pinned buffers are reused
    across regions and steps.
    """
    stash = _thread_stash.get()
    if stash is None:
        stash = HostStash(pin_memory=torch.cuda.is_available())
        _thread_stash.set(stash)
    return stash


def is_parameter_like(t: torch.Tensor) -> bool:
    """True for a parameter or a view of one (autograd saves ``weight.t()`` for linear)."""
    if isinstance(t, torch.nn.Parameter):
        return True
    base = t._base
    return base is not None and isinstance(base, torch.nn.Parameter)


@dataclasses.dataclass
class OffloadStats:
    """What an :func:`offload` region kept in host memory.

    Attributes:
        offloaded_tensors: tensors kept in host memory.
        offloaded_bytes: their bytes (what left the device; on CPU, what stayed on the host).
        current_bytes: bytes held in host memory now (backward releases them).
        peak_bytes: the most bytes held at once.
        skipped_parameters: saved tensors left in place because they are parameters or views of one.
        skipped_small: saved tensors left in place because they are smaller than ``min_bytes``.
    """

    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    current_bytes: int = 0
    peak_bytes: int = 0
    skipped_parameters: int = 0
    skipped_small: int = 0


class _Stashed:
    """Packed form of a saved tensor that went to host memory."""

    __slots__ = ("ticket", "stash", "stats", "__weakref__")

    def __init__(self, ticket: Any, stash: HostStash, stats: OffloadStats) -> None:
        self.ticket = ticket
        self.stash = stash
        self.stats = stats
        weakref.finalize(self, _release, stash, ticket, stats)


def _release(stash: HostStash, ticket: Any, stats: OffloadStats) -> None:
    stash.release(ticket)
    stats.current_bytes = stash.current_bytes


class _OffloadHooks:
    """Pack/unpack hooks of :func:`offload` (a small class, testable alone)."""

    def __init__(self, stash: HostStash, min_bytes: int, stats: OffloadStats) -> None:
        self.stash = stash
        self.min_bytes = min_bytes
        self.stats = stats

    def pack(self, t: torch.Tensor) -> Any:
        if is_parameter_like(t):
            self.stats.skipped_parameters += 1
            return t
        if t.nbytes < self.min_bytes:
            self.stats.skipped_small += 1
            return t
        ticket = self.stash.put(t)
        s = self.stats
        s.offloaded_tensors = self.stash.count
        s.offloaded_bytes = self.stash.total_bytes
        s.current_bytes = self.stash.current_bytes
        s.peak_bytes = self.stash.peak_bytes
        return _Stashed(ticket, self.stash, self.stats)

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Stashed):
            return self.stash.get(packed.ticket)
        return packed  # type: ignore[no-any-return]


@contextlib.contextmanager
def offload(*, pin_memory: bool = True, min_bytes: int = 1024) -> Iterator[OffloadStats]:
    """Keep the tensors autograd saves inside in host memory until backward.

    Parameters (and views of them) and tensors smaller than ``min_bytes`` are
    left where they are. On a device the copies are asynchronous on a side
    stream, into pinned buffers from a reusable pool, and backward prefetches
    the next tensors (see the module docstring for the ordering rules). On a
    CPU-only setup the tensors already live in host memory and are kept as
    they are. Wrapped around :func:`checkpoint`, only the checkpoint's inputs
    move (the region itself keeps nothing).

    Args:
        pin_memory: use page-locked host buffers (needed for asynchronous
            copies; ignored on CPU-only setups).
        min_bytes: tensors smaller than this stay where they are.

    Yields:
        An :class:`OffloadStats` that counts what was kept in host memory.

    Example:
        >>> import torch, remat
        >>> lin = torch.nn.Linear(64, 64)
        >>> x = torch.randn(32, 64, requires_grad=True)
        >>> with remat.offload(min_bytes=1024) as stats:
        ...     y = lin(x).relu()
        >>> y.sum().backward()
        >>> stats.offloaded_tensors, stats.skipped_parameters
        (2, 1)
    """
    if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
        raise ValueError(
            f"offload: min_bytes must be an int >= 0, got {min_bytes!r}. Pass the size in bytes "
            "below which saved tensors stay where they are."
        )
    pin = bool(pin_memory) and torch.cuda.is_available()
    stats = OffloadStats()
    hooks = _OffloadHooks(HostStash(pin), min_bytes, stats)
    with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
        yield stats
