"""A simulated asynchronous device: tests the offload engine's stream discipline on a CPU.

The offload engine (:mod:`remat.engine.offload`) reaches streams, events, copies and
allocation only through a ``_StreamOps`` object. :func:`simulated_device`
patches the engine so every tensor it stashes is treated as a device tensor
and served by :class:`SimOps`, which behaves like an asynchronous device:

* the compute stream runs behind the CPU: the CPU computes every value at
  once, but the simulated compute stream finishes operators later (at seeded
  random points), and memory an operator writes counts as unwritten until
  the compute stream has passed it;
* work issued on a side stream is *deferred*: it runs only when someone waits
  for an event recorded after it, or when the device "makes progress" at
  seeded random points (so different seeds give different interleavings);
* fresh device memory and fresh host buffers hold garbage (NaN bytes).

Races are detected, not guessed from values. While :func:`simulated_device`
is active a dispatch mode checks every operator the CPU runs:

* reading memory that a side-stream copy has not finished writing, or
  writing memory that a side-stream copy has not finished reading, raises
  :class:`RaceError`;
* a side-stream copy that runs before the compute stream has finished
  writing its source (the engine forgot to make the side stream wait for an
  event recorded on the compute stream) raises :class:`RaceError`;
* a deferred copy that reads device memory checks the engine marked that
  memory as used by the copy's stream (``record_stream``), without which a
  caching allocator could hand the memory out before the copy read it;
* a copy issued on one stream into memory another stream has not finished
  with raises :class:`RaceError`.
"""

from __future__ import annotations

import contextlib
import random
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _disable_current_modes as _no_modes
from torch.utils._pytree import tree_leaves

import remat.engine.offload as engine


class RaceError(AssertionError):
    """The engine let two streams touch the same memory out of order."""


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class SimStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.pending: deque[Callable[[], None]] = deque()
        self.issued = 0
        self.done = 0

    def run_to(self, n: int) -> None:
        while self.done < n:
            work = self.pending.popleft()
            self.done += 1
            work()

    def __repr__(self) -> str:
        return f"SimStream({self.name}, done {self.done}/{self.issued})"


class SimEvent:
    def __init__(self, stream: SimStream, pos: int) -> None:
        self.stream = stream
        self.pos = pos


class SimOps:
    """Stands in for ``remat.engine.offload._StreamOps`` on a simulated device."""

    def __init__(self, seed: int = 0, progress: float = 0.3) -> None:
        self.rng = random.Random(seed)
        self.progress = progress
        self.compute = SimStream("compute")
        self.sides: dict[Any, SimStream] = {}
        self.pending_reads: dict[int, int] = {}
        self.pending_writes: dict[int, int] = {}
        self.stream_of_write: dict[int, SimStream] = {}
        self.kept: set[tuple[int, int]] = set()
        self.host: dict[int, weakref.ref[torch.Tensor]] = {}  # live host buffers by address
        self.host_buffers = 0
        self.copies: list[tuple[str, int]] = []  # ("out" | "back", nbytes), in issue order
        self.running = False
        self.skip_compute_wait = False  # set by tests that check the detector fires
        self.skip_keep = False
        self.skip_ready_wait = False
        self.last_write: dict[int, int] = {}  # storage -> compute position that wrote it

    # the device "makes progress" on its own at random points
    def step(self) -> None:
        if self.running or self.rng.random() >= self.progress:
            return
        c = self.compute
        c.done = self.rng.randint(c.done, c.issued)
        for s in self.sides.values():
            if s.done < s.issued:
                s.run_to(self.rng.randint(s.done + 1, s.issued))

    def drain(self) -> None:
        for s in self.sides.values():
            s.run_to(s.issued)

    # --- the _StreamOps interface -------------------------------------------------------
    def side_stream(self, device: torch.device) -> SimStream:
        s = self.sides.get(device)
        if s is None:
            s = self.sides[device] = SimStream(f"side:{device}")
        return s

    def compute_stream(self, device: torch.device) -> SimStream:
        return self.compute

    def record(self, stream: SimStream) -> SimEvent:
        self.step()
        return SimEvent(stream, stream.issued)

    def wait(self, stream: SimStream, event: SimEvent) -> None:
        src = event.stream
        if src is stream:
            return  # a stream is ordered with itself
        if src is self.compute:
            if not self.skip_ready_wait:
                self._enqueue(stream, lambda: self._compute_reaches(event.pos))
            return
        if stream is self.compute:
            if not self.skip_compute_wait:
                src.run_to(event.pos)
            return
        self._enqueue(stream, lambda: src.run_to(event.pos))

    def _compute_reaches(self, pos: int) -> None:
        self.compute.done = max(self.compute.done, pos)

    def finished(self, event: SimEvent) -> bool:
        self.step()
        return event.stream.done >= event.pos

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: SimStream) -> None:
        assert stream is not self.compute, "the engine copies on a side stream"
        d, r = _ptr(dst), _ptr(src)
        for p in (d, r):
            other = self.stream_of_write.get(p)
            if self.pending_writes.get(p) and other is not stream:
                raise RaceError(f"copy on {stream} touches memory {other} is still writing")
        if self.pending_reads.get(d) and self.stream_of_write.get(d, stream) is not stream:
            raise RaceError(f"copy on {stream} overwrites memory another stream still reads")
        self.pending_writes[d] = self.pending_writes.get(d, 0) + 1
        self.pending_reads[r] = self.pending_reads.get(r, 0) + 1
        self.stream_of_write[d] = stream
        src_is_device = not self._is_host(r)
        self.copies.append(("out" if src_is_device else "back", src.nbytes))

        def run() -> None:
            if self.last_write.get(r, 0) > self.compute.done:
                raise RaceError(
                    f"a copy on {stream} read memory before the compute stream finished "
                    "writing it (the side stream must wait for an event recorded on compute)"
                )
            if src_is_device and (id(stream), r) not in self.kept:
                raise RaceError(
                    "a deferred copy read device memory that was never marked as used by its "
                    "stream (record_stream): the allocator could have reused it"
                )
            self.running = True
            try:
                with _no_modes():  # device work never passes through Python dispatch modes
                    dst.copy_(src)
            finally:
                self.running = False
            self.pending_writes[d] -= 1
            self.pending_reads[r] -= 1

        self._enqueue(stream, run)

    def empty(
        self, shape: torch.Size, dtype: torch.dtype, device: torch.device, stream: SimStream
    ) -> torch.Tensor:
        self.running = True
        try:
            t = torch.empty(shape, dtype=dtype, device="cpu")
            if t.numel():
                t.reshape(-1).view(torch.uint8).fill_(0xFF)
        finally:
            self.running = False
        return t

    def keep_until_done(self, t: torch.Tensor, stream: SimStream) -> None:
        if not self.skip_keep:
            self.kept.add((id(stream), _ptr(t)))

    def host_buffer(self, nbytes: int, pin: bool) -> torch.Tensor:
        self.running = True
        try:
            with _no_modes():  # host memory: out of sight of a device meter (remat.memory)
                buf = torch.full((nbytes,), 0xFF, dtype=torch.uint8)
        finally:
            self.running = False
        self.host[_ptr(buf)] = weakref.ref(buf)
        self.host_buffers += 1
        return buf

    def _is_host(self, ptr: int) -> bool:
        ref = self.host.get(ptr)
        return ref is not None and ref() is not None

    def _enqueue(self, stream: SimStream, work: Callable[[], None]) -> None:
        stream.pending.append(work)
        stream.issued += 1
        self.step()

    # --- the race checker: every operator the CPU (the compute stream) runs -----------
    def check(self, func: Any, args: Any, kwargs: Any) -> None:
        if self.running:
            return
        self.step()
        if func.is_view or func in _METADATA_OPS:
            return
        schema = func._schema
        written: set[int] = set()
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                v = args[i] if i < len(args) else kwargs.get(a.name)
                for t in tree_leaves(v):
                    if isinstance(t, torch.Tensor):
                        written.add(_ptr(t))
        for t in tree_leaves((args, kwargs)):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            p = _ptr(t)
            if p == 0:  # no memory (an empty tensor)
                continue
            if self.pending_writes.get(p):
                raise RaceError(f"{func} read memory whose copy had not finished")
            if p in written and self.pending_reads.get(p):
                raise RaceError(f"{func} wrote memory a pending copy still reads")


_aten = torch.ops.aten
_METADATA_OPS = frozenset(
    [_aten.detach.default, _aten.empty.memory_format, _aten.empty_strided.default]
)


class _Checker(TorchDispatchMode):
    def __init__(self, ops: SimOps) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        ops = self.ops
        ops.check(func, args, kwargs)
        out = func(*args, **kwargs)
        if not ops.running and not func.is_view:
            # the compute stream finishes this operator later: what it wrote is pending
            ops.compute.issued += 1
            pos = ops.compute.issued
            inputs = {
                _ptr(t)
                for t in tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and t.device.type != "meta"
            }
            for t in tree_leaves(out):
                # fresh memory only: an output aliasing an input (_unsafe_view) writes nothing
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    p = _ptr(t)
                    if p not in inputs:
                        ops.last_write[p] = pos
            for i, a in enumerate(func._schema.arguments):
                if a.alias_info is not None and a.alias_info.is_write and i < len(args):
                    for t in tree_leaves(args[i]):
                        if isinstance(t, torch.Tensor):
                            ops.last_write[_ptr(t)] = pos
        return out


@contextlib.contextmanager
def simulated_device(seed: int = 0, progress: float = 0.3) -> Iterator[SimOps]:
    """Run the block with every stashed tensor on a simulated asynchronous device.

    The offload policies' per-thread stash is replaced by a fresh one for the
    block, so pinned-pool reuse is measured from zero.
    """
    ops = SimOps(seed, progress)
    orig = engine._ops_for
    token = engine._thread_stash.set(None)
    engine._ops_for = lambda t: ops  # type: ignore[assignment]
    try:
        with _Checker(ops):
            yield ops
    finally:
        engine._ops_for = orig  # type: ignore[assignment]
        engine._thread_stash.reset(token)


@contextlib.contextmanager
def stash_events() -> Iterator[list[tuple[str, int]]]:
    """Record ``("get", i)`` and ``("back", i)`` for the ``i``-th stashed tensor (real or simulated)."""
    tickets: list[Any] = []
    events: list[tuple[str, int]] = []
    stash = engine.HostStash
    orig_put, orig_get, orig_back = stash.put, stash.get, stash._bring_back

    def put(self: Any, t: torch.Tensor, solo: bool = False) -> Any:
        tk = orig_put(self, t, solo)
        tickets.append(tk)
        return tk

    def get(self: Any, tk: Any) -> torch.Tensor:
        events.append(("get", tickets.index(tk)))
        return orig_get(self, tk)

    def back(self: Any, tk: Any) -> None:
        events.append(("back", tickets.index(tk)))
        orig_back(self, tk)

    stash.put, stash.get, stash._bring_back = put, get, back  # type: ignore[method-assign]
    try:
        yield events
    finally:
        stash.put, stash.get, stash._bring_back = orig_put, orig_get, orig_back  # type: ignore[method-assign]
