"""Exact memory measurement: tensor storage bytes alive, per device, with the peak.

:func:`track` counts the bytes of every tensor *storage* allocated inside the
context and still alive, per device and in total, with the peak, across
forward and backward. Design (each point checked by ``tests/measure/test_memory.py``):

* **Seeing allocations.** A ``TorchDispatchMode`` sees every ATen operator
  below autograd, including those the autograd engine runs in backward
  (gradient formulas, gradient accumulation, the ``ones_like`` seed of
  ``loss.backward()``) and those of a checkpoint's recompute: the mode stack
  is part of the thread-local state the engine carries to its device
  threads. Factory functions (``torch.empty``, ``zeros``, ``randn``) are
  operators too; ``torch.tensor(data)`` shows up as ``aten.lift_fresh`` of
  the tensor it just built, which is counted (unless its memory is borrowed
  from NumPy and not allocated by torch).
* **New storages only.** An output's storage is counted when it is not yet
  known and is not the storage of one of the operator's inputs: views,
  in-place and ``out=`` results are never counted twice, and storages that
  existed before the context (parameters, earlier activations) are never
  counted, even when an operator returns a view of them.
* **Frees.** A weak reference to the storage's Python object (which PyTorch
  keeps alive exactly as long as the C++ storage) has a callback that only
  appends to a ``deque``: safe from any thread and from inside garbage
  collection. The pending frees are applied, under a lock, before every
  allocation is recorded and whenever the counters are read, so the peak
  is exact. Storages still alive when the context closes are subtracted
  when they die later.
* **Resizes.** When a counted storage grows or shrinks in place
  (``resize_``, an ``out=`` argument that had the wrong size) the
  difference is counted.

The hot path is one Python call per operator: a dict lookup per output, and
the input storages are only collected when an output is not yet known.

Not counted: scratch memory a kernel allocates and frees inside one operator
(cuBLAS workspaces, oneDNN's convolution backward; the planner measures the
largest with the profiler, :mod:`remat.planner.scratch`), allocator rounding and
caching, memory of tensor storages that existed before the context even when
resized inside it, and anything run in threads the context does not reach
(a ``DataLoader`` worker). Between operators, the bytes alive match the
allocator exactly: ``tests/measure/test_memory.py`` compares them with the raw
allocation events of ``torch.profiler`` on CPU and with
``torch.cuda.max_memory_allocated`` on a GPU.

:func:`track_modules` adds a per-module breakdown (bytes alive before and
after each module's forward, the peak during it, the bytes alive when its
backward starts and the peak during its backward). Both it and the planner's
probes (:mod:`remat.planner.probes`) read the tracker at module boundaries through
:class:`BlockHooks` and its :meth:`~MemoryTracker.open_window` windows.

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

import collections
import contextlib
import dataclasses
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .engine.bytes import is_plain, leaves, meta_counts, storage_bytes, storage_key
from .engine.config import is_recomputing
from .engine.tree import tensors_in

__all__ = ["BlockHooks", "MemoryTracker", "ModuleMemory", "Probe", "track", "track_modules"]



class _StorageRef(weakref.ref):  # type: ignore[type-arg]
    """Weak reference to a counted storage; remembers its key, bytes, device and ``seq``
    (how many storages the tracker had counted before it: the order of allocation)."""

    __slots__ = ("device", "key", "nbytes", "seq")

    key: int
    nbytes: int
    device: str
    seq: int


class Window:
    """Peak of the bytes alive since it was opened (see :meth:`MemoryTracker.open_window`)."""

    __slots__ = ("peak", "start")

    def __init__(self, current: int) -> None:
        self.start = current
        self.peak = current


class MemoryTracker:
    """Tensor storage bytes alive, filled by :func:`track`.

    Device keys are ``str(tensor.device)``: ``"cpu"``, ``"cuda:0"``, ...
    A tracker made with ``device`` counts the tensors of that device only.

    Attributes:
        peak_bytes: the most bytes alive at once (all devices together) since
            the context opened or :meth:`reset_peak`.
        peak_bytes_by_device: the peak of each device on its own.
        allocations: number of storages counted.
    """

    def __init__(self, device: str | torch.device | None = None) -> None:
        self.device = None if device is None else _device_key(torch.device(device))
        self.peak_bytes = 0
        self.peak_bytes_by_device: dict[str, int] = {}
        self.allocations = 0
        self._current = 0
        self._by_device: dict[str, int] = {}
        self._lock = threading.Lock()
        self._live: dict[int, _StorageRef] = {}
        self._freed: collections.deque[_StorageRef] = collections.deque()
        self._windows: list[Window] = []
        self._watched: list[list[Any]] = []  # [storage, bytes last seen, device]
        self._watched_keys: set[int] = set()
        #: whether meta storages hold bytes for this tracker: made inside
        #: :func:`remat.engine.bytes.meta_holds_bytes` (a profile from shapes), never for a tracker
        #: made outside, around one (a fake tensor's storage is on meta, its device real)
        self.holds_meta = meta_counts()

    @property
    def current_bytes(self) -> int:
        """Bytes alive now, all devices together."""
        with self._lock:
            self._apply_frees()
            return self._current

    @property
    def current_bytes_by_device(self) -> dict[str, int]:
        """Bytes alive now per device (a copy)."""
        with self._lock:
            self._apply_frees()
            return dict(self._by_device)

    def reset_peak(self) -> None:
        """Set the peaks (total and per device) to the bytes alive now.

        Example:
            >>> import torch, remat
            >>> with remat.memory.track() as t:
            ...     a = torch.empty(100)
            ...     del a
            ...     t.reset_peak()
            ...     b = torch.empty(10)
            >>> t.peak_bytes
            40
        """
        with self._lock:
            self._apply_frees()
            self.peak_bytes = self._current
            self.peak_bytes_by_device = dict(self._by_device)

    def open_window(self) -> Window:
        """Start measuring a peak from the bytes alive now; end it with :meth:`close_window`."""
        with self._lock:
            self._apply_frees()
            w = Window(self._current)
            self._windows.append(w)
        return w

    def close_window(self, window: Window) -> int:
        """Stop measuring ``window``; return the peak bytes alive while it was open."""
        with self._lock:
            self._apply_frees()
            if window in self._windows:
                self._windows.remove(window)
        return window.peak

    def watch(self, storages: Iterable[torch.UntypedStorage]) -> None:
        """Also count the size changes of ``storages``: storages that exist already and are
        resized in place by ``UntypedStorage.resize_``, which no operator sees (FSDP2's
        unsharded parameters: resized to full size before a module runs, to 0 after).

        Their bytes at this call are not counted (they existed before, like every
        storage the tracker did not see allocated); each later change of their size
        is, read before every operator's outputs are recorded and whenever the
        counters or a window are read. A storage grown and shrunk again with no
        operator in between is not seen.

        Example:
            >>> import torch, remat
            >>> buf = torch.empty(0)
            >>> with remat.memory.track() as t:
            ...     t.watch([buf.untyped_storage()])
            ...     _ = buf.untyped_storage().resize_(400)  # no operator: seen by the watch
            ...     x = torch.ones(25)                       # 100 bytes
            ...     _ = buf.untyped_storage().resize_(0)
            >>> t.peak_bytes, t.current_bytes
            (500, 100)
        """
        with self._lock:
            self._apply_frees()
            for st in storages:
                device = _device_key(st.device)
                if self.device is not None and device != self.device:
                    continue
                key = storage_key(st)
                if key not in self._watched_keys:
                    self._watched_keys.add(key)
                    self._watched.append([st, st.nbytes(), device])

    def include(self, tensors: Iterable[Any]) -> int:
        """Count the storages of ``tensors`` that exist already as alive from now on.

        For a peak in absolute bytes: the tensors a step starts with (parameters,
        gradients, optimizer state, inputs) are counted as if allocated now, and
        subtracted when they die, like every storage the tracker counts (a gradient
        set to ``None`` inside the context lowers the bytes alive). A storage the
        tracker counts already (allocated inside, or included before), one on another
        device than the tracker's, and a watched one are skipped; non-tensors are
        ignored.

        Returns:
            The bytes added.

        Example:
            >>> import torch, remat
            >>> w = torch.zeros(100)                     # 400 bytes, before the context
            >>> with remat.memory.track() as t:
            ...     t.include([w, w[:10], 3])            # a view of w counts once
            ...     x = torch.ones(25)                   # 100 bytes
            ...     del w                                # w dies: subtracted
            400
            >>> t.peak_bytes, t.current_bytes
            (500, 100)
        """
        added = 0
        for obj in tensors:
            if not isinstance(obj, torch.Tensor):
                continue
            for t in (obj,) if is_plain(obj) else leaves(obj):
                st = t.untyped_storage()
                if st.device.type == "meta" and not (self.holds_meta and meta_counts()):
                    continue
                device = _device_key(t.device)
                if self.device is not None and device != self.device:
                    continue
                key = storage_key(st)
                with self._lock:
                    known = self._knows(key) is not None or key in self._watched_keys
                if not known:
                    self._add(st, key, device)
                    added += st.nbytes()
        return added

    def freed_by(self, fn: Callable[[], Any]) -> list[tuple[int, int]]:
        """Call ``fn()``; return ``(seq, nbytes)`` of each counted storage that died during
        the call, ``seq`` being the number of storages counted before it was (compare with
        :attr:`allocations` read earlier to tell when it was allocated).

        Example:
            >>> import torch, remat
            >>> with remat.memory.track() as t:
            ...     held = [torch.empty(10), torch.empty(20)]
            ...     t.freed_by(held.clear)
            [(0, 40), (1, 80)]
        """
        with self._lock:
            self._apply_frees()
            before = list(self._live.values())
        fn()
        with self._lock:
            self._apply_frees()
            live = self._live
            return [(r.seq, r.nbytes) for r in before if live.get(r.key) is not r]

    def __repr__(self) -> str:
        return (
            f"MemoryTracker(current_bytes={self.current_bytes}, peak_bytes={self.peak_bytes}, "
            f"peak_bytes_by_device={self.peak_bytes_by_device})"
        )

    # -- called by the dispatch mode ------------------------------------------------
    def _apply_frees(self) -> None:  # caller holds the lock
        freed = self._freed
        while freed:
            ref = freed.popleft()
            if self._live.get(ref.key) is ref:
                del self._live[ref.key]
                self._current -= ref.nbytes
                self._by_device[ref.device] -= ref.nbytes
        if self._watched:
            self._poll()

    def _poll(self) -> None:  # caller holds the lock
        """Count the size changes of the watched storages: shrinks first, then growths."""
        grown = []
        for w in self._watched:
            n = w[0].nbytes()
            if n != w[1]:
                delta, w[1] = n - w[1], n
                if delta < 0:
                    self._grow(delta, w[2])
                else:
                    grown.append((delta, w[2]))
        for delta, device in grown:
            self._grow(delta, device)

    def _knows(self, key: int) -> _StorageRef | None:
        ref = self._live.get(key)
        return ref if ref is not None and ref() is not None else None

    def _add(self, storage: torch.UntypedStorage, key: int, device: str) -> None:
        ref = _StorageRef(storage, self._freed.append)
        ref.key, ref.nbytes, ref.device = key, storage.nbytes(), device
        with self._lock:
            self._apply_frees()
            ref.seq = self.allocations
            self._live[key] = ref
            self.allocations += 1
            self._grow(ref.nbytes, device)

    def _resize(self, ref: _StorageRef, nbytes: int) -> None:
        with self._lock:
            self._apply_frees()
            if self._live.get(ref.key) is not ref:
                return
            delta, ref.nbytes = nbytes - ref.nbytes, nbytes
            self._grow(delta, ref.device)

    def _grow(self, nbytes: int, device: str) -> None:  # caller holds the lock
        cur = self._current = self._current + nbytes
        if cur > self.peak_bytes:
            self.peak_bytes = cur
        for w in self._windows:
            if cur > w.peak:
                w.peak = cur
        d = self._by_device[device] = self._by_device.get(device, 0) + nbytes
        if d > self.peak_bytes_by_device.get(device, 0):
            self.peak_bytes_by_device[device] = d


def _device_key(device: torch.device) -> str:
    """``"cpu"``, ``"cuda:0"``, ...: a device without an index means the current one.

    CPU tensors report ``cpu`` whatever index the device was given (``"cpu:0"``).
    """
    if device.type in ("cpu", "meta"):
        return device.type
    if device.index is not None:
        return str(device)
    return f"{device.type}:{torch.get_device_module(device.type).current_device()}"


def _input_keys(args: Any, keys: set[int]) -> None:
    for a in args:
        if is_plain(a):
            keys.add(storage_key(a.untyped_storage()))
        elif isinstance(a, torch.Tensor):
            for leaf in leaves(a):
                keys.add(storage_key(leaf.untyped_storage()))
        elif isinstance(a, (list, tuple)):
            _input_keys(a, keys)
        elif isinstance(a, torch.UntypedStorage):
            keys.add(storage_key(a))
        elif isinstance(a, torch.TypedStorage):
            keys.add(storage_key(a._untyped_storage))


class _TrackMode(TorchDispatchMode):
    """Feeds one :class:`MemoryTracker` with the outputs of every operator."""

    def __init__(self, tracker: MemoryTracker) -> None:
        super().__init__()
        self.tracker = tracker
        self._lift_fresh = torch.ops.aten.lift_fresh.default

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tracker = self.tracker
        if tracker._watched:  # resizes since the last operator, before this one allocates
            with tracker._lock:
                tracker._apply_frees()
        out = func(*args, **kwargs)
        if is_plain(out):
            self._record((out,), func, args, kwargs)
        elif isinstance(out, (tuple, list, torch.Tensor)):
            flat: list[torch.Tensor] = []
            _flatten(out, flat)
            if flat:
                self._record(flat, func, args, kwargs)
        return out

    def _record(self, outs: Any, func: Any, args: Any, kwargs: Any) -> None:
        tracker = self.tracker
        inputs: set[int] | None = None
        for out in outs:
            for t in (out,) if is_plain(out) else leaves(out):
                st = t.untyped_storage()
                if st.device.type == "meta" and not (tracker.holds_meta and meta_counts()):
                    continue
                device = str(t.device)
                if tracker.device is not None and device != tracker.device:
                    continue
                key = storage_key(st)
                ref = tracker._knows(key)
                if ref is not None:
                    if ref.nbytes != st.nbytes():
                        tracker._resize(ref, st.nbytes())
                    continue
                if func is self._lift_fresh:  # torch.tensor(data): its new storage
                    if not st.resizable():  # memory borrowed from NumPy: not torch's
                        continue
                else:
                    if inputs is None:
                        inputs = set()
                        _input_keys(args, inputs)
                        _input_keys(kwargs.values(), inputs)
                    if key in inputs:
                        continue
                if key in tracker._watched_keys:  # counted by its size changes
                    continue
                tracker._add(st, key, device)


def _flatten(out: Any, flat: list[torch.Tensor]) -> None:
    if isinstance(out, torch.Tensor):
        flat.append(out)
    elif isinstance(out, (tuple, list)):
        for o in out:
            _flatten(o, flat)


@contextlib.contextmanager
def track(device: str | torch.device | None = None) -> Iterator[MemoryTracker]:
    """Count the tensor storage bytes allocated inside and still alive, with the peak.

    Trackers nest: an inner tracker counts what is allocated inside it, the
    outer one counts that too. Storages freed inside the context are
    subtracted; tensors that existed before it are never counted. Frees that
    happen after the context closed are still subtracted. Only operators run
    in this thread (and the autograd engine's threads serving it) are seen.

    Args:
        device: count only the tensors on this device (``"cuda:0"``, a
            ``torch.device``; ``"cuda"`` means the current CUDA device), for
            example to leave out the host buffers of offloading. Default: all.

    Yields:
        A :class:`MemoryTracker`: ``peak_bytes``, ``current_bytes``,
        ``peak_bytes_by_device``, ``current_bytes_by_device``.

    Example:
        >>> import torch, remat
        >>> with remat.memory.track() as t:
        ...     a = torch.ones(1000)          # 4000 bytes
        ...     b = a.view(10, 100)           # a view: not counted again
        ...     _ = a.mul_(2)                 # in place: not counted again
        ...     del a, b, _                   # freed: subtracted
        ...     c = torch.zeros(250)          # 1000 bytes
        >>> t.current_bytes, t.peak_bytes, t.peak_bytes_by_device
        (1000, 4000, {'cpu': 4000})
    """
    tracker = MemoryTracker(device)
    with _TrackMode(tracker):
        yield tracker


@dataclasses.dataclass
class ModuleMemory:
    """Per-module bytes from :func:`track_modules`.

    All values are bytes alive as counted by the tracker (storages allocated
    inside :func:`track_modules`). For a module called more than once, the
    values are those of the last forward and of the last backward to finish.

    Attributes:
        calls: forward calls seen (recomputes of checkpointed code excluded).
        before_forward: bytes alive when its forward started.
        after_forward: bytes alive when its forward returned; the difference
            to ``before_forward`` is what the module leaves behind (its
            output and what autograd saved for its backward).
        forward_peak: peak bytes alive during its forward.
        before_backward: bytes alive when its backward started (the first
            gradient of one of its outputs was ready); 0 when it had none.
        backward_peak: peak bytes alive from then until the gradients of its
            inputs (of its parameters, when no input requires grad) were computed.
        input_bytes: bytes of the distinct storages of its tensor inputs.
        param_bytes: bytes of its parameters and buffers (distinct storages).
    """

    calls: int = 0
    before_forward: int = 0
    after_forward: int = 0
    forward_peak: int = 0
    before_backward: int = 0
    backward_peak: int = 0
    input_bytes: int = 0
    param_bytes: int = 0


def _grad_tensors(obj: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    tensors_in(obj, found)
    return [t for t in found if t.requires_grad]


class _BackwardWatch:
    """Opens a window when a module's backward starts and closes it when it ends."""

    def __init__(self, tracker: MemoryTracker, stats: ModuleMemory) -> None:
        self.tracker = tracker
        self.stats = stats
        self.window: Window | None = None

    def start(self, grad: Any) -> None:
        if self.window is None:
            self.window = self.tracker.open_window()

    def end(self, grads: Any) -> None:
        if self.window is not None:
            self.stats.before_backward = self.window.start
            self.stats.backward_peak = self.tracker.close_window(self.window)
            self.window = None


class Probe(Protocol):
    """What :class:`BlockHooks` calls at block ``i``'s boundaries."""

    def before(self, i: int, args: Any, kwargs: Any) -> None:
        """Block ``i``'s forward is about to run on ``args``, ``kwargs``."""

    def after(self, i: int, args: Any, kwargs: Any, out: Any) -> None:
        """Block ``i``'s forward returned ``out`` (``None`` when it raised, with
        ``always_call``)."""


class _Before:
    """Forward pre-hook of block ``i``: ``probe.before(i, args, kwargs)`` (not in recompute)."""

    __slots__ = ("i", "probe")

    def __init__(self, probe: Probe, i: int) -> None:
        self.probe, self.i = probe, i

    def __call__(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if not is_recomputing():
            self.probe.before(self.i, args, kwargs)


class _After:
    """Forward hook of block ``i``: ``probe.after(i, args, kwargs, out)`` (not in recompute)."""

    __slots__ = ("i", "probe")

    def __init__(self, probe: Probe, i: int) -> None:
        self.probe, self.i = probe, i

    def __call__(self, module: torch.nn.Module, args: Any, kwargs: Any, out: Any) -> None:
        if not is_recomputing():
            self.probe.after(self.i, args, kwargs, out)


class BlockHooks:
    """A probe's forward pre- and post-hooks on each of ``modules`` (block ``i`` is
    ``modules[i]``), skipping the forwards a checkpoint's recompute runs; removed by
    :meth:`remove` or on leaving the ``with`` block. With ``always_call`` the post-hook also
    runs, with ``out=None``, when the forward raised. :func:`track_modules` and the
    planner's probes read the tracker at module boundaries through it.

    Example:
        >>> import torch, remat
        >>> class Starts:
        ...     def __init__(self, tracker): self.tracker, self.at = tracker, []
        ...     def before(self, i, args, kwargs): self.at.append(self.tracker.current_bytes)
        ...     def after(self, i, args, kwargs, out): pass
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        >>> with remat.memory.track() as t, remat.memory.BlockHooks(list(model), Starts(t)) as h:
        ...     _ = model(torch.randn(2, 4))
        >>> h.probe.at  # bytes alive as each Linear started: the input, then the first's output too
        [32, 64]
    """

    def __init__(
        self, modules: Sequence[torch.nn.Module], probe: Probe, always_call: bool = False
    ) -> None:
        self.probe = probe
        self.handles = []
        for i, m in enumerate(modules):
            self.handles.append(m.register_forward_pre_hook(_Before(probe, i), with_kwargs=True))
            self.handles.append(
                m.register_forward_hook(_After(probe, i), with_kwargs=True, always_call=always_call)
            )

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def __enter__(self) -> BlockHooks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class _ModuleStats:
    """A probe that reads a tracker at modules' boundaries into :class:`ModuleMemory`."""

    def __init__(
        self, tracker: MemoryTracker, modules: list[torch.nn.Module], stats: list[ModuleMemory]
    ) -> None:
        self.tracker = tracker
        self.modules = modules
        self.stats = stats
        self.stacks: list[list[tuple[Window, list[torch.Tensor]]]] = [[] for _ in modules]

    def before(self, i: int, args: Any, kwargs: Any) -> None:
        s = self.stats[i]
        s.calls += 1
        found: list[torch.Tensor] = []
        tensors_in((args, kwargs), found)
        s.input_bytes = storage_bytes(found)
        module = self.modules[i]
        s.param_bytes = storage_bytes([*module.parameters(), *module.buffers()])
        window = self.tracker.open_window()
        s.before_forward = window.start
        self.stacks[i].append((window, [t for t in found if t.requires_grad]))

    def after(self, i: int, args: Any, kwargs: Any, out: Any) -> None:
        # also runs, with out=None, when the forward raised (always_call), so that its
        # window is closed and its stack entry popped
        if not self.stacks[i]:
            return
        window, grad_inputs = self.stacks[i].pop()
        s = self.stats[i]
        s.forward_peak = self.tracker.close_window(window)
        s.after_forward = self.tracker.current_bytes
        outputs = _grad_tensors(out)
        ends = grad_inputs or [p for p in self.modules[i].parameters() if p.requires_grad]
        if outputs and ends:
            watch = _BackwardWatch(self.tracker, s)
            torch.autograd.graph.register_multi_grad_hook(outputs, watch.start, mode="any")
            torch.autograd.graph.register_multi_grad_hook(ends, watch.end, mode="all")


@contextlib.contextmanager
def track_modules(
    modules: dict[str, torch.nn.Module] | torch.nn.Module,
    device: str | torch.device | None = None,
) -> Iterator[tuple[MemoryTracker, dict[str, ModuleMemory]]]:
    """:func:`track` plus a per-module breakdown at each module's boundaries.

    Forward boundaries come from forward pre/post hooks; backward boundaries
    from gradient hooks on the module's outputs (start) and on its inputs
    (end; its parameters when no input requires grad). The autograd graph
    is not changed, so in-place operations on a module's outputs keep
    working. Forward hooks that fire during a checkpoint's recompute are
    ignored.

    Args:
        modules: a model (each of its named submodules is measured) or a dict
            ``name -> module`` of the modules to measure.
        device: count only the tensors on this device (see :func:`track`).

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
        >>> stats["0"].param_bytes                                  # weight and bias
        288
    """
    if isinstance(modules, torch.nn.Module):
        named = {n: m for n, m in modules.named_modules() if n}
    else:
        named = dict(modules)
    stats = {n: ModuleMemory() for n in named}
    with track(device) as tracker:
        probe = _ModuleStats(tracker, list(named.values()), list(stats.values()))
        with BlockHooks(list(named.values()), probe, always_call=True):
            yield tracker, stats
