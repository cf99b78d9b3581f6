"""What the profile records during its steps: hooks on the candidate blocks, as named classes.

Each probe is a small class with ``before(i, args, kwargs)`` (block ``i``'s forward is about
to run) and ``after(i, args, kwargs, out)`` (it returned) methods, put on the blocks by
:class:`remat.memory.BlockHooks` (the one implementation of module boundaries, which
:func:`remat.memory.track_modules` uses too); hooks that fire during a checkpoint's
recompute are ignored. The
probes only record; :mod:`remat.planner.stepmodel` turns what they record into terms.

* :class:`CallCount`: how often each block runs, the order of their first calls (the
  order the profile takes them in), which blocks pass their output straight to the next
  (``Profile.chained``), which change an input in place.
* :class:`WindowProbe`: the step's windows (:class:`~remat.planner.types.Window`) from the
  block hooks, each boundary one ``enter(window)`` call; its two users:
* :class:`TimelineProbe`: the bytes at the boundaries of a step's contiguous windows
  (before the blocks, each block's forward, head and loss, each block's backward) into a
  :class:`~remat.planner.types.Timeline`, on :mod:`remat.memory`'s windows, and the
  outputs the next block did not receive that die before their block's backward.
* :class:`WindowMarks`: the same windows' boundaries in a profiler's events (the scratch
  inside operators, counted where it happens).
* :class:`InputFrees`: block outputs the next block frees, block inputs alive to the end of
  forward, tensors passed to several blocks.
* :class:`KeptOutputs` (:func:`kept_outputs`): outputs the model's own code keeps past the
  next block.
* :class:`OffloadProbe` (:func:`offload_inputs`): block inputs nothing else holds once the
  block returns (a span may offload them).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from .. import memory
from ..engine.bytes import (
    held_storages,
    shares_storage,
    storage_bytes,
    storage_key,
    storages,
)
from ..engine.tree import tensors_in
from ..memory import BlockHooks
from .amp import fresh_region
from .apply import apply_decision
from .scratch import mark_window
from .state import StepState, grad_bytes
from .types import Decision, SharedInput, Timeline, Window, WindowKind

_log = logging.getLogger(__name__)

#: Storages with their bytes and keys: alive as long as anything holds their memory (a
#: tensor object can die while its storage lives on: autograd saves an operator's output,
#: ``relu``'s, as a new tensor on the same storage).
Stored = list[tuple[weakref.ref[torch.UntypedStorage], int, int]]


def storage_keys(t: torch.Tensor) -> set[int]:
    """The keys of the storages holding ``t``'s bytes (none for an empty tensor)."""
    return {key for key, nbytes, _ in storages(t) if nbytes}


def stored(tensors: Sequence[torch.Tensor]) -> Stored:
    """The storages of ``tensors`` (each once), with their bytes and keys."""
    out: Stored = []
    seen: set[int] = set()
    for t in tensors:
        for st in held_storages(t):
            key, nbytes = storage_key(st), st.nbytes()
            if nbytes and key not in seen:
                seen.add(key)
                out.append((weakref.ref(st), nbytes, key))
    return out


def dead_storage_bytes(entries: Stored) -> int:
    """The bytes of the storages of ``entries`` that have died."""
    return sum(b for r, b, _ in entries if r() is None)


def storage_sizes(
    refs: list[weakref.ref[torch.Tensor]], device: torch.device | None
) -> list[tuple[weakref.ref[torch.UntypedStorage], int]]:
    """The storages of the live tensors of ``refs`` (on ``device`` when given; each once)
    with their bytes, as weak references: a storage outlives a tensor object whose alias
    something else holds (a selective cache's detached copy)."""
    out, seen = [], set()
    for r in refs:
        t = r()
        # a subclass's storage is its own; a fake tensor's (a profile from shapes) on meta
        if t is None or (type(t) is not torch.Tensor and not isinstance(t, FakeTensor)):
            continue
        if device is not None and t.device != device:
            continue
        st = t.untyped_storage()
        if st.nbytes() and storage_key(st) not in seen:
            seen.add(storage_key(st))
            out.append((weakref.ref(st), st.nbytes()))
    return out


class CallCount:
    """How often each candidate block runs in one forward (recomputes not counted), the
    order of their first calls (:meth:`in_call_order`), whether each block received a
    tensor the block called just before it returned (the blocks a span may join: nothing
    of the model's own code between them), and which blocks change one of their input
    tensors in place (``nn.ReLU(inplace=True)`` as a block). A block that returns a view of
    the previous block's output is not chained to it."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self.counts = [0] * len(self.names)
        self.order: list[int] = []  # the blocks by their first call
        self.links: dict[tuple[int, int], bool] = {}  # (block before, block): chained
        self.last: int | None = None  # the block that returned last
        self.link: tuple[int, int] | None = None  # the running block's
        self.returned: list[weakref.ref[torch.Tensor]] = []
        self.mutating: set[str] = set()
        self.versions: dict[int, list[tuple[torch.Tensor, int]]] = {}  # the running block's

    def before(self, i: int, args: Any, kwargs: Any) -> None:
        if not self.counts[i]:
            self.order.append(i)
        self.counts[i] += 1
        got: list[torch.Tensor] = []
        tensors_in((args, kwargs), got)
        self.versions[i] = [(t, t._version) for t in got]
        self.link = None
        if self.last is not None and self.last != i:
            self.link = (self.last, i)
            self.links[self.link] = any(r() is t for r in self.returned for t in got)

    def after(self, i: int, args: Any, kwargs: Any, out: Any) -> None:
        if any(t._version != v for t, v in self.versions.pop(i, [])):
            self.mutating.add(self.names[i])
        outs: list[torch.Tensor] = []
        tensors_in(out, outs)
        if self.link is not None and self.links[self.link]:
            # A view of what the previous block returned (a Flatten, a reshape): a span
            # that ends here would keep that output alive, which the step model counts
            # as freed. Such blocks do not join the block before them.
            # A tensor both return unchanged (a position bias handed along the stack) is no
            # view: the step model counts it (``Profile.shared.inputs``).
            got = [t for r in self.returned if (t := r()) is not None]
            made = [o for o in outs if not any(o is t for t in got)]
            if any(shares_storage(o, t) for o in made for t in got):
                self.links[self.link] = False
        self.link = None
        self.last = i
        self.returned = [weakref.ref(t) for t in outs]

    def in_call_order(self) -> list[str]:
        """The block names in the order of their first calls (those never called last)."""
        return [self.names[i] for i in self.in_call_indices()]

    def in_call_indices(self) -> list[int]:
        """:meth:`in_call_order` as indices into the names given."""
        return [*self.order, *(i for i in range(len(self.names)) if i not in self.order)]

    @property
    def chained(self) -> list[bool]:
        """For each block in call order but the last, whether the next received a tensor it
        returned (``Profile.chained``)."""
        order = self.in_call_indices()
        return [self.links.get((a, b), False) for a, b in zip(order, order[1:])]

    def check(self) -> None:
        """Raise unless every block ran exactly once: the planner models a chain."""
        bad = {n: c for n, c in zip(self.names, self.counts) if c != 1}
        if bad:
            listed = ", ".join(f"{n!r} ran {c} times" for n, c in bad.items())
            raise ValueError(
                f"remat.profile: every candidate block must run exactly once per forward (the "
                f"planner models a chain of blocks), but {listed}. Pass check_fn=lambda name, "
                "module: ... that selects only blocks the model calls once per step (a block "
                "reused twice, or skipped, cannot be planned alone)."
            )


class WindowProbe:
    """The step's windows from the block hooks: each boundary an :meth:`enter` call.

    Block ``i``'s forward (:meth:`before`) opens ``Window(FWD, i)``, the last block's return
    (:meth:`after`) the ``TOP`` window, the first gradient of a block's outputs
    (:meth:`backward_start`) that block's ``BWD`` window, and the first gradient of an input
    of the first block once every block's backward started (:meth:`inputs_done`) the
    ``POST`` window; the step starts in the ``PRE`` window (:attr:`current`). A subclass
    says what a boundary does (:meth:`enter`: called while :attr:`current` is still the
    window that ends), and may look at a block's return (:meth:`returned`)."""

    def __init__(self, n: int) -> None:
        self.last = n - 1
        self.current = Window(WindowKind.PRE)
        self.seen: set[int] = set()  # the blocks whose backward started

    def enter(self, window: Window) -> None:
        """The window :attr:`current` ends here and ``window`` starts."""
        raise NotImplementedError

    def returned(self, i: int, outs: list[torch.Tensor]) -> None:
        """Block ``i`` returned ``outs`` (after the ``TOP`` window opened, for the last)."""

    def move(self, window: Window) -> None:
        """Enter ``window``: it is :attr:`current` from now on."""
        self.enter(window)
        self.current = window

    def before(self, i: int, args: Any, kwargs: Any) -> None:
        self.move(Window(WindowKind.FWD, i))
        if i == 0:
            watch_first_inputs(args, kwargs, self)

    def after(self, i: int, args: Any, kwargs: Any, out: Any) -> None:
        if i == self.last:
            self.move(Window(WindowKind.TOP))
        outs: list[torch.Tensor] = []
        tensors_in(out, outs)
        self.returned(i, outs)
        outs = [t for t in outs if t.requires_grad]
        if outs:
            torch.autograd.graph.register_multi_grad_hook(outs, BackwardStart(self, i), mode="any")

    def backward_start(self, i: int) -> None:
        if i not in self.seen:
            self.seen.add(i)
            self.move(Window(WindowKind.BWD, i))

    def inputs_done(self) -> None:
        """The first gradient of an input of the first block: its backward is done, the
        backward of the layers before the blocks starts (``POST``), where every block's
        backward was seen (the blocks are one chain there)."""
        if self.current == Window(WindowKind.BWD, 0) and len(self.seen) == self.last + 1:
            self.move(Window(WindowKind.POST))


def put_peak(line: Timeline, window: Window, peak: int, grads: int) -> None:
    """Record in ``line`` that ``window`` ended with ``peak`` bytes its most and ``grads``
    bytes of gradients (for the windows whose end a timeline keeps them of)."""
    kind, i = window.kind, window.block
    if kind is WindowKind.PRE:
        line.pre_peak = peak
    elif kind is WindowKind.FWD:
        line.fwd_peak[i] = peak
    elif kind is WindowKind.TOP:
        line.top_peak, line.top_grads = peak, grads
    elif kind is WindowKind.BWD:
        line.bwd_peak[i], line.bwd_grads[i] = peak, grads
    elif kind is WindowKind.POST:
        line.post_peak = peak


class TimelineProbe(WindowProbe):
    """Reads a tracker at the boundaries of a step's contiguous windows into a
    :class:`~remat.planner.types.Timeline` (``line``).

    ``params``: the parameters whose gradients the step creates (none when they are kept).
    While it is on, ``torch.clear_autocast_cache`` (the end of an autocast region: the
    caller's, emulated before backward by :func:`~remat.planner.amp.outside`, or one inside
    the model's forward) goes through :meth:`_clear_cache`; :meth:`remove` puts it back.
    """

    def __init__(
        self,
        tracker: memory.MemoryTracker,
        n: int,
        params: list[torch.Tensor],
        counted: torch.device | None,
    ) -> None:
        super().__init__(n)
        self.tracker = tracker
        self.params = params
        self.counted = counted
        self.line = Timeline(
            fwd_start=[0] * n, fwd_peak=[0] * n, bwd_start=[None] * n, bwd_peak=[0] * n,
            bwd_grads=[0] * n, input_bytes=[0] * n,
        )  # fmt: skip
        self.line.outputs_freed = [0] * max(n - 1, 0)
        self.line.fwd_tail = [0] * n
        self.inner = 0  # the peak of the open forward window up to its block's return
        self.window = tracker.open_window()
        # each block's outputs, those of them the next block did not receive, and of those
        # the ones alive when the last block returns (``Timeline.outputs_freed``)
        self.outs: list[list[weakref.ref[torch.Tensor]]] = [[] for _ in range(n)]
        self.unpassed: list[list[weakref.ref[torch.Tensor]]] = [[] for _ in range(n)]
        self.held: list[list[tuple[weakref.ref[torch.UntypedStorage], int]]] = [
            [] for _ in range(n)
        ]
        self.seq = [0] * (n + 1)  # tracker.allocations at each block's forward start, and top's
        self.real_clear = torch.clear_autocast_cache
        torch.clear_autocast_cache = self._clear_cache  # type: ignore[assignment]

    def enter(self, window: Window) -> None:
        """Close the open window (its peak goes to :attr:`current`'s terms), open one for
        ``window`` (the bytes at its start go to its terms)."""
        peak = self.tracker.close_window(self.window)
        line, (kind, i) = self.line, (self.current.kind, self.current.block)
        if kind is WindowKind.TOP and line.top_ret_peak is not None and line.top_mid_peak is None:
            peak = max(peak, line.top_ret_peak)  # the model returned after any region's end
        put_peak(line, self.current, peak, grad_bytes(self.params, self.counted))
        if kind is WindowKind.FWD:  # the window's part after the block returned was open
            line.fwd_peak[i], line.fwd_tail[i] = max(peak, self.inner), peak
        self.window = self.tracker.open_window()
        start, j = self.window.start, window.block
        if window.kind is WindowKind.FWD:
            line.fwd_start[j] = start
            self.inner = 0
        elif window.kind is WindowKind.TOP:
            line.top_start = start
            line.fwd_tail[self.last] = line.fwd_peak[self.last]
            self.seq[-1] = self.tracker.allocations
            self.held = [storage_sizes(refs, self.counted) for refs in self.unpassed]
        elif window.kind is WindowKind.BWD:
            line.bwd_start[j] = start
            if j < self.last:
                line.outputs_freed[j] = sum(b for r, b in self.held[j] if r() is None)

    def before(self, i: int, args: Any, kwargs: Any) -> None:
        found: list[torch.Tensor] = []
        tensors_in(args, found)  # the positional inputs (keyword ones are not a block's own)
        self.line.input_bytes[i] = storage_bytes(found, self.counted)
        if i > 0:
            got: list[torch.Tensor] = []
            tensors_in((args, kwargs), got)
            self.unpassed[i - 1] = [
                r for r in self.outs[i - 1] if not any(r() is t for t in got)
            ]
        super().before(i, args, kwargs)
        self.seq[i] = self.tracker.allocations

    def returned(self, i: int, outs: list[torch.Tensor]) -> None:
        if i != self.last:  # the rest of the window (the model's code before the next block)
            self.inner = self.tracker.close_window(self.window)
            self.window = self.tracker.open_window()
        self.outs[i] = [weakref.ref(t) for t in outs]

    def _clear_cache(self) -> None:
        """``torch.clear_autocast_cache`` while the step runs: between the last block's
        forward and its backward (the region's end), split the ``top`` window there and
        count, per block, the bytes of its forward window that die (its cached casts)."""
        if self.current.kind is not WindowKind.TOP:
            self.real_clear()
            return
        line, tracker = self.line, self.tracker
        if line.top_pre_peak is None:
            line.top_pre_peak = tracker.close_window(self.window)
            if line.top_ret_peak is not None:  # the model returned before: its part apart
                line.top_mid_peak = line.top_pre_peak
                line.top_pre_peak = max(line.top_ret_peak, line.top_mid_peak)
            self.window = tracker.open_window()
            line.exit_freed = [0] * len(line.fwd_start)
        for seq, nbytes in tracker.freed_by(self.real_clear):
            i = bisect.bisect_right(self.seq, seq) - 1
            if 0 <= i < len(line.exit_freed):  # allocated in block i's forward window
                line.exit_freed[i] += nbytes
        self.window.peak = self.window.start = tracker.current_bytes

    def model_returned(self) -> None:
        """The model's forward returned (a hook on it): the ``top`` window's peak so far is
        kept apart (``Timeline.top_ret_peak``; ``top_peak`` stays the whole window's)."""
        if self.current.kind is WindowKind.TOP and self.line.top_ret_peak is None:
            self.line.top_ret_peak = self.tracker.close_window(self.window)
            self.window = self.tracker.open_window()

    def finish(self) -> None:
        """Close the last window (backward has returned); read the bytes alive now."""
        self.move(Window(WindowKind.END))
        self.line.end_bytes = self.tracker.current_bytes
        self.line.end_grads = grad_bytes(self.params, self.counted)

    def remove(self) -> None:
        torch.clear_autocast_cache = self.real_clear  # type: ignore[assignment]
        self.tracker.close_window(self.window)


class WindowMarks(WindowProbe):
    """Marks the boundaries of the step's windows, the :class:`TimelineProbe`'s (block
    ``i``'s forward, ``top``, block ``i``'s backward), in a running profiler's events
    (:func:`~remat.planner.scratch.mark_window`), so the scratch inside operators is
    counted in the window it happens in (:func:`~remat.planner.scratch.window_scratch`).
    A checkpoint's recompute runs in its block's backward window (:class:`BlockHooks`
    skips its forwards)."""

    def enter(self, window: Window) -> None:
        mark_window(window)


def watch_first_inputs(args: Any, kwargs: Any, probe: WindowProbe) -> None:
    """Call ``probe.inputs_done()`` at the first gradient of one of the first block's inputs
    (its backward is done there); nothing when none of them needs one."""
    found: list[torch.Tensor] = []
    tensors_in((args, kwargs), found)
    need = [t for t in found if t.requires_grad]
    if need:
        torch.autograd.graph.register_multi_grad_hook(
            need, lambda _: probe.inputs_done(), mode="any"
        )


class BackwardStart:
    """Gradient hook on a block's outputs: its backward window starts."""

    def __init__(self, probe: WindowProbe, i: int) -> None:
        self.probe = probe
        self.i = i

    def __call__(self, _: Any) -> None:
        self.probe.backward_start(self.i)


@dataclasses.dataclass
class _Received:
    """A storage handed to blocks: the blocks that received it, the window it died in."""

    ref: weakref.ref[torch.UntypedStorage]
    nbytes: int
    blocks: list[int] = dataclasses.field(default_factory=list)
    dies: int | None = None


class InputFrees:
    """For the step under ``keep``: the bytes of each block's output that die while the next
    block runs (the next block saves none of it and nothing else holds it), and for the last
    block by the end of the model's forward (the head saves none of it; read under
    ``selective`` too, where the cache may hold it); the shared arguments (``shared``). For that step and the one under ``offload``: each block's
    inputs alive when its window ends and dead when forward returns (``held_to_end``), by
    their storages: a tensor object dies while its storage lives on where autograd saved
    it as an operator's output (``relu``'s: a new tensor on the same storage).

    The step model adds each block's bytes at its own decision, so a free that happens only
    because the block before does not hold its output is a pair effect: under ``selective``
    the block's cache can hold that output (the step model counts it as held). An output
    handed on past the next block (a position bias each block returns again) is not such a
    free: with every storage the blocks received that died in forward, by the blocks that
    received it and the window it died in, it is in ``shared_inputs``
    (:class:`~remat.planner.types.SharedInput`), but one block's input that died in that
    block's own window (its terms have it).

    ``leave_out``: the keys of storages ``held_to_end`` leaves out, asked for as forward
    returns (a pair step's storages handed to several blocks, :class:`SharedArgs`).

    Its forward hook on ``model`` (:meth:`end`) is removed by :meth:`remove`.
    """

    def __init__(
        self,
        model: nn.Module,
        n: int,
        inputs: Sequence[torch.Tensor],
        leave_out: Callable[[], set[int]] | None = None,
    ):
        self.leave_out = leave_out
        self.freed = [0] * n
        # tensors passed to two or more blocks that the model's forward made (not its
        # inputs, parameters or buffers, nor what one block passes to the next)
        self.outside = {id(t) for t in inputs}
        self.outside |= {id(t) for t in model.parameters()} | {id(t) for t in model.buffers()}
        self.args: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}  # id -> (ref, blocks)
        self.arg_sizes: dict[int, Stored] = {}
        self.out_sizes: Stored = []  # the last block's
        self.last = n - 1
        self.shared = 0
        self.outs: list[list[weakref.ref[torch.Tensor]]] = [[] for _ in range(n)]
        self.passed: list[Stored] = [[] for _ in range(n)]
        # each block's tensor arguments (but the model's inputs, parameters and buffers), and
        # those of them still alive when its window ends (the next block starts; the last
        # block's: when it returns): the ones that then die when the forward returns are
        # held into backward only by a checkpoint of the block (``held_to_end``)
        self.inputs: list[Stored] = [[] for _ in range(n)]
        self.alive: list[Stored] = [[] for _ in range(n)]
        self.held_to_end = [0] * n
        self.many: set[int] = set()  # storages of tensors passed to two or more blocks
        # every storage handed to a block (but the above), by key, for ``shared_inputs``
        self.tracked: dict[int, _Received] = {}
        self.done: list[_Received] = []  # entries whose key a later storage took
        self.shared_inputs: dict[str, int] = {}
        self.handle = model.register_forward_hook(self.end)

    # Read when the block after next starts (the model's loop variable has moved on by
    # then; a hook of the next block itself still sees its arguments alive).
    def before(self, i: int, args: Any, kwargs: Any) -> None:
        self._deaths(i - 1)
        got: list[torch.Tensor] = []
        tensors_in((args, kwargs), got)
        self._seen(got, i)
        mine = [t for t in got if id(t) not in self.outside and not storage_keys(t) & self.many]
        self.inputs[i] = stored(mine)
        self._received(i)
        if i == 0:
            return
        self.alive[i - 1] = [e for e in self.inputs[i - 1] if e[0]() is not None]
        self.passed[i - 1] = stored(
            [t for r in self.outs[i - 1] if (t := r()) is not None and any(t is u for u in got)]
        )
        if i >= 2:
            self.freed[i - 2] = self._freed(i - 2, self.passed[i - 2])

    def _freed(self, i: int, passed: Stored) -> int:
        """The bytes of the storages of block ``i``'s outputs in ``passed`` that died, but
        those handed on to a block after the next (a position bias each block returns again:
        in ``shared_inputs``, whose terms count its death)."""
        out = 0
        for ref, nbytes, key in passed:
            if ref() is not None:
                continue
            e = self._entry(key, ref)
            if e is None or set(e.blocks) <= {i + 1}:
                out += nbytes
        return out

    def _entry(self, key: int, ref: weakref.ref[torch.UntypedStorage]) -> _Received | None:
        """The tracked entry of the storage of ``ref`` (dead or alive), ``None`` if no block
        received it: a dead storage's key may have been taken by a later storage, whose
        entry is not this one's (weak references to one storage are one object)."""
        e = self.tracked.get(key)
        if e is not None and e.ref is ref:
            return e
        return next((d for d in self.done if d.ref is ref), None)

    def _received(self, i: int) -> None:
        for ref, nbytes, key in self.inputs[i]:
            e = self.tracked.get(key)
            if e is not None and e.ref is not ref:  # a dead storage's key, taken again
                self.done.append(e)
                e = None
            if e is None:
                e = self.tracked[key] = _Received(ref, nbytes)
            e.blocks.append(i)

    def _deaths(self, window: int) -> None:
        """The tracked storages that died since the last look died in ``window``."""
        for e in self.tracked.values():
            if e.dies is None and e.ref() is None:
                e.dies = window

    def _shared_inputs(self) -> dict[str, int]:
        """The storages that died in forward, by :attr:`~remat.planner.types.SharedInput.key`,
        but those that one block received and that died in its own window (the block's
        terms have them exactly: :mod:`remat.planner.stepmodel`)."""
        out: dict[str, int] = {}
        for key, e in [*((None, e) for e in self.done), *self.tracked.items()]:
            if e.dies is None or key in self.many or e.blocks == [e.dies]:
                continue
            g = SharedInput(tuple(e.blocks), e.dies, e.nbytes)
            out[g.key] = out.get(g.key, 0) + e.nbytes
        return out

    def _seen(self, got: list[torch.Tensor], i: int) -> None:
        prev = {id(t) for r in self.outs[i - 1] if (t := r()) is not None} if i else set()
        for t in got:
            if id(t) in self.outside or id(t) in prev:
                continue
            ref, count = self.args.get(id(t), (None, 0))
            if ref is None or ref() is not t:
                ref, count = weakref.ref(t), 0
                self.arg_sizes[id(t)] = stored([t])
            self.args[id(t)] = (ref, count + 1)
            if count + 1 == 2:  # shared: not one block's input (Profile.shared.bytes); from
                keys = storage_keys(t)
                self.many |= keys  # here on ``many`` keeps it out as it is recorded
                for j in range(i):
                    self.inputs[j] = [e for e in self.inputs[j] if e[2] not in keys]
                    self.alive[j] = [e for e in self.alive[j] if e[2] not in keys]

    def after(self, i: int, args: Any, kwargs: Any, out: Any) -> None:
        got: list[torch.Tensor] = []
        tensors_in(out, got)
        self.outs[i] = [weakref.ref(t) for t in got]
        if i == self.last:
            self._deaths(i)
            self.out_sizes = stored([t for r in self.outs[i] if (t := r()) is not None])
            self.alive[i] = [e for e in self.inputs[i] if e[0]() is not None]

    def end(self, module: Any, args: Any, out: Any) -> None:
        """The model's forward returned: what the last two blocks passed on, and the shared
        arguments, are read now."""
        last = self.last
        if last >= 1:
            self.freed[last - 1] = self._freed(last - 1, self.passed[last - 1])
        self.freed[last] = self._freed(last, self.out_sizes)
        shared = {
            e[2]: e for key, (_, count) in self.args.items() if count >= 2 for e in self.arg_sizes[key]
        }  # each storage once
        self.shared = dead_storage_bytes(list(shared.values()))
        out = self.leave_out() if self.leave_out is not None else set()
        self.held_to_end = [
            dead_storage_bytes([e for e in alive if e[2] not in out]) for alive in self.alive
        ]
        self._deaths(last + 1)
        self.shared_inputs = self._shared_inputs()

    def remove(self) -> None:
        self.handle.remove()


@dataclasses.dataclass
class _Arg:
    """A storage blocks received: its role (the first block that received it, its place
    among that block's tensor arguments), bytes, the blocks that received it, whether one
    received it as the same tensor another did (not as the block before's output)."""

    role: tuple[int, int]
    nbytes: int
    key: int
    ref: weakref.ref[torch.UntypedStorage]
    blocks: list[int]
    many: bool = False


class SharedArgs(WindowProbe):
    """The storages handed to two or more blocks (as arguments to several, or returned by
    one to the next; but the model's inputs, parameters and buffers), by role
    (:class:`_Arg`: the same in every step of the model), and the bytes of those of them
    alive as each block's backward starts (:attr:`at_bwd`, by role) and as the model's forward
    returns (:attr:`at_return`: its forward hook :meth:`end`, removed by :meth:`remove`).

    With ``saves`` (:meth:`saving`: a forward whose saved tensors are recorded and dropped,
    :func:`keep_lifetimes`) it records where each was saved for backward instead: by block
    (its index), before the blocks (-1) or after them (``n``)."""

    def __init__(self, model: nn.Module, n: int, inputs: Sequence[torch.Tensor]) -> None:
        super().__init__(n)
        self.n = n
        self.outside = {id(t) for t in inputs}
        self.outside |= {id(t) for t in model.parameters()} | {id(t) for t in model.buffers()}
        self.args: dict[int, _Arg] = {}  # by storage key, while alive
        self.done: list[_Arg] = []  # entries whose key a later storage took
        self.prev: set[int] = set()  # ids of what the block before returned
        self.at_bwd: list[dict[tuple[int, int], int]] = [{} for _ in range(n)]
        self.at_return: dict[tuple[int, int], int] | None = None
        # role -> the forward window it died in (``n``: as the forward returned)
        self.died: dict[tuple[int, int], int] = {}
        self.saved: dict[tuple[int, int], int] = {}  # role -> first place that saved it
        # storages saved before any block received them: key -> (storage, place)
        self.early: dict[int, tuple[weakref.ref[torch.UntypedStorage], int]] = {}
        self.running = -1  # the block whose forward runs (-1 before the first, n after the last)
        self.handle = model.register_forward_hook(self.end)

    def shared(self) -> list[_Arg]:
        """The storages two or more blocks received (those whose key a later storage took
        included)."""
        return [a for a in [*self.done, *self.args.values()] if len(set(a.blocks)) >= 2]

    def _alive(self) -> dict[tuple[int, int], int]:
        out: dict[tuple[int, int], int] = {}
        for a in self.shared():
            if a.ref() is not None:
                out[a.role] = out.get(a.role, 0) + a.nbytes
        return out

    def enter(self, window: Window) -> None:
        if window.kind is WindowKind.BWD:
            self.at_bwd[window.block] = self._alive()

    def before(self, i: int, args: Any, kwargs: Any) -> None:
        self._deaths(i - 1)
        got: list[torch.Tensor] = []
        tensors_in((args, kwargs), got)
        place = 0
        for t in got:
            if id(t) in self.outside:
                continue
            for st in held_storages(t):
                key, nbytes = storage_key(st), st.nbytes()
                if not nbytes:
                    continue
                found = self.args.get(key)
                if found is None or found.ref() is not st:
                    if found is not None:  # a dead storage's key, taken again
                        self.done.append(found)
                    a = self.args[key] = _Arg((i, place), nbytes, key, weakref.ref(st), [])
                    early = self.early.pop(key, None)
                    if early is not None and early[0]() is st:
                        self.saved.setdefault(a.role, early[1])
                else:
                    a = found
                if a.blocks and id(t) not in self.prev:
                    a.many = True
                a.blocks.append(i)
            place += 1
        self.running = i
        super().before(i, args, kwargs)

    def _deaths(self, window: int) -> None:
        """The storages two or more blocks received that died since the last look died in
        forward window ``window`` (as :class:`InputFrees` counts them)."""
        for a in self.shared():
            if a.ref() is None and a.role not in self.died:
                self.died[a.role] = window

    def after(self, i: int, args: Any, kwargs: Any, out: Any) -> None:
        outs: list[torch.Tensor] = []
        tensors_in(out, outs)
        self.prev = {id(t) for t in outs}
        self.running = self.n if i == self.last else i
        if i == self.last:
            self._deaths(i)
        super().after(i, args, kwargs, out)

    def saving(self, t: torch.Tensor) -> None:
        """``t`` is saved for backward (a pack hook) while :attr:`running` runs."""
        for st in held_storages(t):
            key = storage_key(st)
            a = self.args.get(key)
            if a is not None and a.ref() is st:
                self.saved.setdefault(a.role, self.running)
            else:  # not received by a block yet: looked up when one does
                e = self.early.get(key)
                if e is None or e[0]() is not st:  # the first save of this storage
                    self.early[key] = (weakref.ref(st), self.running)

    def end(self, module: Any, args: Any, out: Any) -> None:
        self.at_return = self._alive()
        self._deaths(self.n)

    def remove(self) -> None:
        self.handle.remove()


def keep_lifetimes(
    model: nn.Module,
    modules: Sequence[nn.Module],
    args: Any,
    kwargs: Any,
    state: StepState,
    inputs: Sequence[torch.Tensor],
) -> SharedArgs:
    """:class:`SharedArgs` of one forward with every block kept whose saved tensors are
    recorded (where, and which storages) and dropped at once, so it holds what a forward
    without gradients holds: where the storages handed to several blocks would live with
    every block kept, without the step that holds every block's activations. No backward
    runs (the dropped tensors could not be unpacked)."""
    for m in modules:
        apply_decision(m, Decision.KEEP)
    probe = SharedArgs(model, len(modules), inputs)

    def pack(t: torch.Tensor) -> None:
        probe.saving(t)

    def unpack(_: None) -> torch.Tensor:
        raise RuntimeError("remat.profile: a lifetime probe's saved tensors were dropped")

    try:
        with BlockHooks(modules, probe), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            state.reset_rng()
            out = model(*args, **kwargs)
            del out
    finally:
        probe.remove()
    return probe


class KeptOutputs:
    """For each block, whether the output it passed to the next block is still alive (its
    storage) when the block after next starts (``kept``). Outputs the next block did not
    receive (a cache the model collects) are not a span's to free; an output that a later
    block returns again, or a view of it, is the later block's."""

    def __init__(self, n: int) -> None:
        self.outs: list[list[weakref.ref[torch.Tensor]]] = [[] for _ in range(n)]
        self.passed: list[Stored] = [[] for _ in range(n)]
        self.kept = [False] * n

    def before(self, i: int, args: Any, kwargs: Any) -> None:
        got: list[torch.Tensor] = []
        tensors_in((args, kwargs), got)
        if i >= 1:  # what the block before handed to this one
            self.passed[i - 1] = stored(
                [t for r in self.outs[i - 1] if (t := r()) is not None and any(t is u for u in got)]
            )
        j = i - 2
        if j < 0:
            return
        later = [t for r in self.outs[j + 1] if (t := r()) is not None] + got
        held = {key for t in later for key in storage_keys(t)}
        self.kept[j] = any(ref() is not None and key not in held for ref, _, key in self.passed[j])

    def after(self, i: int, args: Any, kwargs: Any, out: Any) -> None:
        got: list[torch.Tensor] = []
        tensors_in(out, got)
        self.outs[i] = [weakref.ref(t) for t in got]


def kept_outputs(
    model: nn.Module, modules: Sequence[nn.Module], args: Any, kwargs: Any, state: StepState
) -> list[bool]:
    """:class:`KeptOutputs` of one forward without gradients, where nothing but the model's
    own code keeps a tensor (see ``Profile.kept_outputs``). All ``False`` when that forward
    fails."""
    probe = KeptOutputs(len(modules))
    try:
        with BlockHooks(modules, probe):
            state.reset_rng()
            with torch.no_grad(), warnings.catch_warnings():
                # a model that checkpoints inside with torch's reentrant variant warns that no
                # input requires grad: true here, and not the user's concern
                warnings.simplefilter("ignore")
                out = model(*args, **kwargs)
            del out
    except Exception:  # a model that needs gradients in forward: no limit recorded
        _log.debug("remat.profile: the forward without gradients failed", exc_info=True)
        return [False] * len(modules)
    return probe.kept


class OffloadProbe:
    """One forward of :func:`offload_inputs` under ``pattern`` (a decision per block): block
    ``i``'s first argument's storage, and, when block ``i + 1`` starts, whether the input of
    an offloaded block ``i`` is still alive."""

    def __init__(self, pattern: Sequence[Decision], first: bool, found: OffloadFindings) -> None:
        self.pattern, self.first, self.found = pattern, first, found
        self.refs: list[weakref.ref[torch.UntypedStorage] | None] = [None] * len(pattern)

    def before(self, i: int, args: Any, kwargs: Any) -> None:
        f = self.found
        ref = self.refs[i - 1] if i >= 1 else None
        if ref is not None and self.pattern[i - 1] is Decision.OFFLOAD:
            alive = ref() is not None
            if self.first:
                f.alone[i - 1] = not alive
            elif alive:
                f.by_before[i - 1] = True
            if alive:
                f.held[i - 1] = True
        arg = args[0] if args else None
        if isinstance(arg, torch.Tensor) and arg.requires_grad:
            st = arg.untyped_storage()
            self.refs[i] = weakref.ref(st)
            f.size[i] = st.nbytes()
        else:
            f.held[i] = True  # no tensor argument a span could offload

    def after(self, i: int, args: Any, kwargs: Any, out: Any) -> None:
        pass

    def end(self) -> None:
        """The model's forward returned (its output still alive): whether the input of an
        offloaded last block is alive. No block after it frees it: it dies, if nothing
        holds it, when the forward returns (with every block offloaded, the block before
        saved it to host memory; kept, that block's ``relu`` holds it into backward)."""
        i = len(self.pattern) - 1
        ref = self.refs[i]
        if ref is None or self.pattern[i] is not Decision.OFFLOAD:
            return
        alive = ref() is not None
        if self.first:
            self.found.alone[i] = not alive
        elif alive:
            self.found.by_before[i] = True


class OffloadFindings:
    """What the forwards of :func:`offload_inputs` found, per block."""

    def __init__(self, n: int) -> None:
        self.size = [0] * n
        self.held = [n < 2] * (n - 1) + [True]  # a span needs a block after its first
        self.alone = [False] * n  # freed once the block returns when every block is offloaded
        self.by_before = [False] * n  # ... but held when the block before is kept or selective


def offload_inputs(
    model: nn.Module,
    modules: Sequence[nn.Module],
    args: Any,
    kwargs: Any,
    state: StepState,
    before: Sequence[Decision],
) -> tuple[list[int], list[int]]:
    """For each block, the bytes of its first argument (the input a span starting there
    offloads) when nothing but the block itself holds it on the device once the block has
    returned, whatever decision of ``before`` the block before takes; 0 where something does
    (that block's graph saves its output, the model's code keeps it) or for a last block.
    Second, per block, the bytes of that argument when it dies as the block returns (the
    last block's: as the forward returns) with every block offloaded but lives on when the
    block before is kept or selective (its ``tanh`` or ``relu`` saved it): the ``offload``
    line then counts it freed, a pair effect.

    Forwards with gradients, no backward: every block under ``offload`` (its saved tensors in
    host memory, so it holds its input on the device only while it runs), then, for each
    ``d`` in ``before``, every other block under ``d`` (the blocks after them are probed).
    A block's input is held when its storage is still alive as the next block starts.
    """
    n = len(modules)
    found = OffloadFindings(n)
    offload = Decision.OFFLOAD
    patterns = [[offload] * n] + [
        [d if i % 2 == parity else offload for i in range(n)]
        for d in before
        for parity in (0, 1)
    ]
    for k, pattern in enumerate(patterns):
        for m, d in zip(modules, pattern):
            apply_decision(m, d)
        probe = OffloadProbe(pattern, k == 0, found)
        with BlockHooks(modules, probe):
            state.reset_rng()
            fresh_region()
            out = model(*args, **kwargs)
            probe.end()
            del out
    free = [0 if h else b for h, b in zip(found.held, found.size)]
    pair = [b if a and p else 0 for a, p, b in zip(found.alone, found.by_before, found.size)]
    return free, pair
