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
* Bringing it back allocates the device tensor from the side stream's
  memory, copies on the side stream after the copy out (same stream: issue
  order), records an event, and makes the compute stream wait for that event
  before anyone reads the tensor; the tensor is marked used by the compute
  stream so its memory outlives the compute that reads it. The compute
  stream therefore never reads a buffer before its copy has finished.
* A released host buffer is parked with the event of the last copy that
  touches it and returns to the pool only once that event has finished
  (a non-blocking query when a buffer is next asked for), so it is never
  overwritten before its copy back has read it, and the CPU never blocks.
* Prefetch: when backward asks for one tensor, the tensors stashed just
  before it (which backward needs next) are brought back on the side stream
  at once, overlapping the copies with compute. The offload policies share one
  stash per thread (:func:`shared_stash`), so this crosses region boundaries:
  recomputing one region prefetches the offloaded outputs of the region
  before it.

On CPU-only setups the tensor already lives in host memory: it is kept as it
is (no copy) and never recomputed.

A copy keeps the tensor's strides when they are dense and non-overlapping
(channels-last, transposed): backward then runs the same kernels, with the same
bits, as without offload. Overlapping or gapped views (``expand``,
``as_strided``, slices) come back contiguous. Sparse and other non-strided
tensors are kept as they are, also on a device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch

from . import observe
from .bytes import element_bytes

_PREFETCH_DEPTH = 2


class _StreamOps:
    """The stream, event, copy and allocation calls the stash makes on one device type.

    Real devices (CUDA, or any backend whose device module has ``Stream`` and
    ``Event``) go through torch's device module. Tests substitute a simulated
    asynchronous device (tests/support/simdevice.py) that defers side-stream work and
    flags any read of a copy that has not finished.
    """

    def __init__(self, device_type: str) -> None:
        self.mod = torch.get_device_module(device_type)
        self.side: dict[torch.device, Any] = {}

    def side_stream(self, device: torch.device) -> Any:
        s = self.side.get(device)
        if s is None:
            s = self.side[device] = self.mod.Stream(device=device)
        return s

    def compute_stream(self, device: torch.device) -> Any:
        return self.mod.current_stream(device)

    def record(self, stream: Any) -> Any:
        event = self.mod.Event()
        event.record(stream)
        return event

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def finished(self, event: Any) -> bool:
        return bool(event.query())

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        with self.mod.stream(stream):
            dst.copy_(src, non_blocking=True)

    def empty(
        self, shape: torch.Size, dtype: torch.dtype, device: torch.device, stream: Any
    ) -> torch.Tensor:
        with self.mod.stream(stream):
            return torch.empty(shape, dtype=dtype, device=device)

    def keep_until_done(self, t: torch.Tensor, stream: Any) -> None:
        t.record_stream(stream)

    def host_buffer(self, nbytes: int, pin: bool) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


class _BlockingOps(_StreamOps):
    """For a device type without streams and events: plain copies, in program order."""

    def __init__(self, device_type: str) -> None:
        self.side = {}

    def side_stream(self, device: torch.device) -> Any:
        return None

    def compute_stream(self, device: torch.device) -> Any:
        return None

    def record(self, stream: Any) -> Any:
        return None

    def wait(self, stream: Any, event: Any) -> None:
        pass

    def finished(self, event: Any) -> bool:
        return True

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        dst.copy_(src)

    def empty(
        self, shape: torch.Size, dtype: torch.dtype, device: torch.device, stream: Any
    ) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    def keep_until_done(self, t: torch.Tensor, stream: Any) -> None:
        pass

    def host_buffer(self, nbytes: int, pin: bool) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)


_ops_cache: dict[str, _StreamOps] = {}


def _dense_strides(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill a block of memory exactly once, in some dimension order."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _restrided(flat: torch.Tensor, shape: torch.Size, stride: tuple[int, ...]) -> torch.Tensor:
    """``flat``'s memory seen with ``shape`` and ``stride`` (a plain tensor, not an autograd view)."""
    with torch._C._AutoDispatchBelowADInplaceOrView():
        return flat.as_strided(shape, stride)


def _ops_for(t: torch.Tensor) -> _StreamOps | None:
    """The stream operations for ``t``'s device; None for tensors kept as they are.

    Host tensors (and meta tensors, which hold no data) are kept as they are.
    A device type whose torch module has ``Stream`` and ``Event`` (CUDA, XPU,
    ...) gets asynchronous copies; others (MPS) get plain blocking copies.
    """
    kind = t.device.type
    if kind == "cpu" or kind == "meta":
        return None
    ops = _ops_cache.get(kind)
    if ops is None:
        mod = torch.get_device_module(kind)
        asynchronous = hasattr(mod, "Stream") and hasattr(mod, "Event")
        ops = _ops_cache[kind] = _StreamOps(kind) if asynchronous else _BlockingOps(kind)
    return ops


class _PinnedPool:
    """Pinned host buffers in size classes, reused across regions and steps.

    A returned buffer is parked with the event of the last copy that reads it
    and is handed out again only once that event has finished (checked with a
    non-blocking query), so the CPU never waits for the device here.
    """

    def __init__(self, pin_memory: bool) -> None:
        self.pin = pin_memory
        self.free: dict[int, list[torch.Tensor]] = {}
        self.parked: list[tuple[_StreamOps, Any, torch.Tensor]] = []

    @staticmethod
    def _size_class(nbytes: int) -> int:
        """Bytes of the buffer that serves ``nbytes``: a power of two up to 4 KiB, above
        that a multiple of a sixteenth of the next power of two (at most 12.5 % unused)."""
        p = 1 << max(nbytes - 1, 1).bit_length()
        if p <= 4096:
            return p
        step = p >> 4
        return -(-nbytes // step) * step

    def take(self, nbytes: int, ops: _StreamOps) -> torch.Tensor:
        size = self._size_class(nbytes)
        if self.parked:
            self._reclaim()
        bucket = self.free.get(size)
        if bucket:
            return bucket.pop()
        return ops.host_buffer(size, self.pin)

    def give(self, buf: torch.Tensor, ops: _StreamOps, last_use: Any) -> None:
        self.parked.append((ops, last_use, buf))

    def _reclaim(self) -> None:
        parked, self.parked = self.parked, []  # a give() during the loop is not lost
        for ops, event, buf in parked:
            if ops.finished(event):
                self.free.setdefault(buf.numel(), []).append(buf)
            else:
                self.parked.append((ops, event, buf))


class _Ticket:
    """One stashed tensor: its host copy, and the copy back once one is under way."""

    __slots__ = (
        "ops",
        "host",
        "buf",
        "device",
        "dtype",
        "shape",
        "stride",
        "last_copy",
        "back",
        "back_done",
        "out_done",
        "nbytes",
        "pos",
        "fetched",
        "solo",
        "__weakref__",
    )

    def __init__(self, t: torch.Tensor, nbytes: int, ops: _StreamOps) -> None:
        self.ops = ops
        self.device: torch.device = t.device
        self.dtype: torch.dtype = t.dtype
        self.shape: torch.Size = t.shape
        self.stride: tuple[int, ...] = t.stride()  # of the host copy (kept if dense)
        self.nbytes = nbytes
        self.host: torch.Tensor | None = None
        self.buf: torch.Tensor | None = None
        self.back: torch.Tensor | None = None
        self.last_copy: Any = None  # event of the latest copy that touches the host buffer
        self.back_done: Any = None
        self.out_done: Any = None  # event of the copy out
        self.pos = 0
        self.fetched = False  # brought back at least once (prefetch does it only once)
        self.solo = False  # brought back only when asked for, and prefetches nothing


class HostStash:
    """Moves device tensors to host memory and back with stream/event ordering."""

    def __init__(self, pin_memory: bool = True) -> None:
        self.pool = _PinnedPool(pin_memory)
        self.order: list[weakref.ref[_Ticket]] = []
        self.current_bytes = 0
        self.peak_bytes = 0
        self.total_bytes = 0
        self.count = 0
        # Backward on several devices runs in one autograd thread per device. Reentrant:
        # release() runs from finalizers, which garbage collection may call inside put().
        self.lock = threading.RLock()

    def put(self, t: torch.Tensor, solo: bool = False) -> _Ticket | torch.Tensor:
        """Stash ``t``; return what :meth:`get` takes back (the tensor itself on the host).

        ``solo``: no prefetch brings it back before it is asked for, and asking for it
        prefetches nothing (its device bytes then depend on no other stashed tensor).
        """
        with self.lock:
            tk = self._put(t)
            if isinstance(tk, _Ticket):
                tk.solo = solo
            return tk

    def _put(self, t: torch.Tensor) -> _Ticket | torch.Tensor:
        ops = _ops_for(t)
        nbytes = element_bytes(t)  # what is copied (a view copies its own elements only)
        self.count += 1
        self.total_bytes += nbytes
        self.current_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        if ops is None or t.layout is not torch.strided:
            return t
        src = t.detach()
        if not _dense_strides(src):  # overlapping or gapped: its elements, contiguous
            src = src.contiguous()
        tk = _Ticket(src, nbytes, ops)
        side = ops.side_stream(t.device)
        ready = ops.record(ops.compute_stream(t.device))
        buf = self.pool.take(nbytes, ops)
        host = _restrided(buf[:nbytes].view(src.dtype), src.shape, tk.stride)
        ops.wait(side, ready)  # the copy reads the value compute has finished writing
        ops.keep_until_done(src, side)  # the allocator keeps src's memory until the copy read it
        ops.copy(host, src, side)
        tk.host, tk.buf = host, buf
        tk.last_copy = tk.out_done = ops.record(side)
        tk.pos = len(self.order)
        self.order.append(weakref.ref(tk))
        if len(self.order) % 1024 == 0:  # forget tickets that are gone
            self._compact()
        return tk

    def _compact(self) -> None:
        live = [r for r in self.order if r() is not None]
        for i, r in enumerate(live):
            r().pos = i  # type: ignore[union-attr]
        self.order = live

    def _bring_back(self, tk: _Ticket) -> None:
        ops = tk.ops
        side = ops.side_stream(tk.device)
        assert tk.host is not None
        flat = ops.empty(torch.Size([tk.shape.numel()]), tk.dtype, tk.device, side)
        dev = _restrided(flat, tk.shape, tk.stride)  # the strides the tensor had
        ops.copy(dev, tk.host, side)  # after the copy out: same stream, issue order
        tk.back_done = tk.last_copy = ops.record(side)
        ops.keep_until_done(dev, ops.compute_stream(tk.device))
        tk.back = dev
        tk.fetched = True

    def get(self, tk: _Ticket | torch.Tensor) -> torch.Tensor:
        """Return the stashed tensor on its device, safe to read on the compute stream.

        The stash does not keep the device tensor it hands out: a second
        backward over a retained graph copies it back again.
        """
        if isinstance(tk, torch.Tensor):
            return tk
        with self.lock:
            return self._get(tk)

    def _get(self, tk: _Ticket) -> torch.Tensor:
        if tk.host is None:
            raise RuntimeError(
                "remat offload: a saved tensor was read after its host copy was released (its "
                "graph was freed). Run backward before the outputs it needs are deleted, or "
                "pass retain_graph=True to the first backward to run it again."
            )
        if tk.back is None:
            self._bring_back(tk)
        self._prefetch_before(tk)
        ops = tk.ops
        ops.wait(ops.compute_stream(tk.device), tk.back_done)
        dev, tk.back = tk.back, None
        return dev  # type: ignore[return-value]

    def settle(self, tk: _Ticket | torch.Tensor) -> None:
        """Make the compute stream wait until ``tk``'s copy out has read the tensor.

        After this, compute may change the tensor in place: the host copy holds the
        value it had when it was stashed. (A no-op for a tensor kept on the host.)
        """
        if isinstance(tk, _Ticket) and tk.out_done is not None:
            tk.ops.wait(tk.ops.compute_stream(tk.device), tk.out_done)
            tk.out_done = None

    def release(self, tk: _Ticket | torch.Tensor | int) -> None:
        """Forget a stashed tensor; its host buffer returns to the pool once its copies are done.

        A tensor kept on the host may be given by its byte count.
        """
        with self.lock:
            if isinstance(tk, torch.Tensor):
                self.current_bytes -= element_bytes(tk)
                return
            if isinstance(tk, int):
                self.current_bytes -= tk
                return
            if tk.buf is None:
                return
            self.current_bytes -= tk.nbytes
            self.pool.give(tk.buf, tk.ops, tk.last_copy)
            tk.buf = tk.host = tk.back = None

    def host_tensor(self, tk: _Ticket | torch.Tensor) -> torch.Tensor | None:
        """The host tensor that holds a stashed tensor (the tensor itself when kept as it is);
        ``None`` once released."""
        if isinstance(tk, torch.Tensor):
            return tk
        return tk.buf

    def _prefetch_before(self, tk: _Ticket) -> None:
        # Backward visits tensors in reverse order of forward: fetch the ones stashed just before.
        i = tk.pos
        if tk.solo or i >= len(self.order) or self.order[i]() is not tk:
            return
        for j in range(i - 1, max(i - 1 - _PREFETCH_DEPTH, -1), -1):
            other = self.order[j]()
            if other is None or other.solo:
                continue
            if not other.fetched and other.host is not None:
                self._bring_back(other)


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
    """Packed form of a saved tensor that went to host memory.

    A tensor kept on the host as it is (CPU) is held detached: the tensor autograd
    hands the pack hook may be the output of the node that saves it, and holding it
    would make a reference cycle that keeps the graph alive until garbage
    collection. Its version is recorded so that an in-place change after it was
    saved raises as in autograd (a device tensor's host copy is a snapshot).
    """

    __slots__ = ("ticket", "stash", "stats", "version", "__weakref__")

    def __init__(self, ticket: Any, stash: HostStash, stats: OffloadStats, version: int) -> None:
        self.ticket = ticket
        self.stash = stash
        self.stats = stats
        self.version = version
        weakref.finalize(self, _release, stash, ticket, stats)


def _release(stash: HostStash, ticket: Any, stats: OffloadStats) -> None:
    stash.release(ticket)
    stats.current_bytes = stash.current_bytes


class _OffloadHooks:
    """Pack/unpack hooks of :func:`offload` (a small class, testable alone)."""

    def __init__(
        self, stash: HostStash, min_bytes: int, stats: OffloadStats, solo: bool = False
    ) -> None:
        self.stash = stash
        self.min_bytes = min_bytes
        self.stats = stats
        self.solo = solo

    def pack(self, t: torch.Tensor) -> Any:
        if is_parameter_like(t):
            self.stats.skipped_parameters += 1
            return t
        if element_bytes(t) < self.min_bytes:
            self.stats.skipped_small += 1
            return t
        version = t._version
        ticket = self.stash.put(t.detach(), self.solo)
        s = self.stats
        s.offloaded_tensors = self.stash.count
        s.offloaded_bytes = self.stash.total_bytes
        s.current_bytes = self.stash.current_bytes
        s.peak_bytes = self.stash.peak_bytes
        return _Stashed(ticket, self.stash, self.stats, version)

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Stashed):
            return packed  # type: ignore[no-any-return]
        tk = packed.ticket
        if isinstance(tk, torch.Tensor) and tk._version != packed.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: [{tk.dtype} {list(tk.shape)}] is at version {tk._version}; "
                f"expected version {packed.version} instead. remat.offload kept it in host "
                "memory as it is (a CPU tensor is not copied), so backward would read the "
                "changed values. Make the in-place operation out-of-place, or clone the "
                "tensor before changing it."
            )
        return self.stash.get(tk)


class _ObservedOffloadHooks(_OffloadHooks):
    """:class:`_OffloadHooks` under :func:`remat.explain`: tells the observer what went to the
    host (picked once per :func:`offload` block: no work for it without an observer)."""

    def __init__(
        self,
        stash: HostStash,
        min_bytes: int,
        stats: OffloadStats,
        solo: bool = False,
        *,
        observer: Any,
    ) -> None:
        super().__init__(stash, min_bytes, stats, solo)
        self.observer = observer

    def pack(self, t: torch.Tensor) -> Any:
        packed = super().pack(t)
        if isinstance(packed, _Stashed):
            host = self.stash.host_tensor(packed.ticket)
            if host is not None:
                self.observer.offloaded(t, host)
        return packed


def _hooks(stash: HostStash, min_bytes: int, stats: OffloadStats, solo: bool) -> _OffloadHooks:
    obs = observe.current()
    if obs is None:
        return _OffloadHooks(stash, min_bytes, stats, solo)
    return _ObservedOffloadHooks(stash, min_bytes, stats, solo, observer=obs)


@contextlib.contextmanager
def offload(*, pin_memory: bool = True, min_bytes: int = 1024) -> Iterator[OffloadStats]:
    """Keep the tensors autograd saves inside in host memory until backward.

    Parameters (and views of them) and tensors smaller than ``min_bytes`` are
    left where they are. On a device the copies are asynchronous on a side
    stream, into pinned buffers from a reusable pool, and backward prefetches
    the next tensors (see the module docstring for the ordering rules). On a
    CPU-only setup the tensors already live in host memory and are kept as
    they are (an in-place change of one before backward raises, as in autograd;
    on a device backward reads the copy taken when it was saved). Sparse
    tensors are kept as they are, also on a device. Wrapped around :func:`checkpoint`, only the checkpoint's inputs
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
    hooks = _hooks(HostStash(pin), min_bytes, stats, False)
    with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
        yield stats


def moves_to_host(t: torch.Tensor) -> bool:
    """Whether offloading ``t`` copies it to host memory (False: it is kept as it is)."""
    return _ops_for(t) is not None


@contextlib.contextmanager
def offload_shared(*, min_bytes: int = 0, prefetch: bool = True) -> Iterator[OffloadStats]:
    """:func:`offload` on this thread's shared stash (:func:`shared_stash`).

    Tensors saved inside share one stash with the offload policies and with
    every other ``offload_shared`` block, so backward prefetches across them:
    bringing back one region's inputs starts copying back the previous one's.
    ``prefetch=False``: the tensors saved inside come back only when backward asks
    for them, and asking for them prefetches nothing.
    """
    stats = OffloadStats()
    hooks = _hooks(shared_stash(), min_bytes, stats, not prefetch)
    with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
        yield stats
