"""A step of compiled blocks measured at the allocator (regional compilation, :mod:`.regional`).

A compiled kernel allocates its buffers without going through the dispatcher, and
``torch.compile`` runs its frames eagerly while a dispatch mode is active, so the tracker of
:mod:`remat.memory` cannot see a compiled step. Its bytes are read from the allocator's
events instead (``torch.profiler`` with ``profile_memory=True``: :func:`~.scratch.profiled`) at the window boundaries
the block hooks mark (:class:`AllocatorTimeline`): the same
:class:`~remat.planner.types.Timeline` the tracker gives (equal to it on an eager step but
for the scratch inside operators, which the allocator's peaks include: a compiled profile
has no separate scratch), from which the step model's terms are derived as for any
profile. :func:`allocator_peak` is the checked steps' meter.

Not recorded (left empty, as the step model allows): the peak after a block returned
(``fwd_tail``), outputs the next block did not receive (``outputs_freed``) and the autocast
terms (compiled plans refuse autocast).
"""

from __future__ import annotations

import bisect
import itertools
import statistics
from collections.abc import Callable
from typing import Any

import torch

from .probes import WindowProbe, put_peak
from .scratch import mark_window, parse_marks
from .types import Decision, Timeline, Window, WindowKind


class AllocatorTimeline(WindowProbe):
    """The step's window boundaries marked in a running profiler's events (as
    :class:`~remat.planner.probes.WindowMarks` does), with the gradients' and block
    inputs' bytes read at each: :meth:`line` turns the allocator's events into a
    :class:`~remat.planner.types.Timeline`, as :class:`~remat.planner.probes.TimelineProbe`
    makes one from the tracker. Not recorded (left empty): ``fwd_tail``, ``outputs_freed``
    and the autocast terms."""

    def __init__(self, n: int, grads: Callable[[], int], inputs: Callable[[Any], int]) -> None:
        super().__init__(n)
        self.n = n
        self.grads = grads
        self.inputs = inputs
        self.windows: list[Window] = []
        self.grads_at: list[int] = []
        self.input_bytes = [0] * n

    def enter(self, window: Window) -> None:
        self.grads_at.append(self.grads())  # those of the window that ends here
        self.windows.append(window)
        mark_window(window)

    def before(self, i: int, args: Any, kwargs: Any) -> None:
        self.input_bytes[i] = self.inputs(args)
        super().before(i, args, kwargs)

    def finish(self) -> None:
        self.move(Window(WindowKind.END))

    def line(self, events: list[Any], device: torch.device) -> Timeline:
        """The timeline of the step whose profiler ``events`` these are (bytes counted from
        the step's start, the allocator's: kernels' scratch included).

        Raises:
            RuntimeError: the events do not hold the boundaries this probe marked."""
        allocs, marks = parse_marks(events, device)
        if [w for _, w in marks] != self.windows:
            raise RuntimeError(
                "remat: the profiler's window marks differ from the step's windows "
                f"({len(marks)} marks, {len(self.windows)} windows)."
            )
        times = [t for t, _ in allocs]
        running = _running(allocs)

        def alive(t: int) -> int:
            return running[bisect.bisect_right(times, t)]

        def peak(lo: int, hi: int) -> int:  # over the times in (lo, hi]
            a, z = bisect.bisect_right(times, lo), bisect.bisect_right(times, hi)
            return max(running[a : z + 1])

        n = self.n
        line = Timeline(
            fwd_start=[0] * n, fwd_peak=[0] * n, bwd_start=[None] * n, bwd_peak=[0] * n,
            bwd_grads=[0] * n, input_bytes=list(self.input_bytes),
        )  # fmt: skip
        ending, since = Window(WindowKind.PRE), -1
        for (t, window), grads in zip(marks, self.grads_at):
            put_peak(line, ending, peak(since, t), grads)
            if window.kind is WindowKind.FWD:
                line.fwd_start[window.block] = alive(t)
            elif window.kind is WindowKind.TOP:
                line.top_start = alive(t)
            elif window.kind is WindowKind.BWD:
                line.bwd_start[window.block] = alive(t)
            elif window.kind is WindowKind.END:
                line.end_bytes, line.end_grads = alive(t), grads
            ending, since = window, t
        return line


def allocator_peak(events: list[Any], device: torch.device) -> int:
    """The most bytes the allocator of ``device`` held at once in ``events``, counted from
    their start."""
    allocs, _ = parse_marks(events, device)
    return max(_running(allocs))


def _running(allocs: list[tuple[int, int]]) -> list[int]:
    """The bytes alive before the first of ``allocs`` (0) and after each."""
    return list(itertools.accumulate((b for _, b in allocs), initial=0))


def whole_step_costs(
    blocks: dict[Decision, dict[str, float]], steps: dict[Decision, list[float]]
) -> tuple[dict[Decision, dict[str, float]], dict[Decision, dict[str, float]]]:
    """Each block's time under each compiled level from the whole steps' times: ``keep``'s
    block times (``blocks[KEEP]``, each block's windows), and for every other level that
    time plus the level's whole-step difference to ``keep`` (median of ``steps``), shared
    by the blocks in proportion to their ``keep`` times; the noise is half the range of the
    level's steps, shared the same way.

    A level changes more than its blocks' windows: what the step allocates (on CPU, fresh
    pages the allocator faults in; the optimizer and head run with less memory alive), so a
    level that recomputes can make the whole step faster than keeping. The blocks' own
    windows cannot show that; the whole step does, and its difference may be negative
    (the plan then recomputes where it is faster).

    Example:
        >>> keep = {"a": 1.0, "b": 3.0}
        >>> times, noise = whole_step_costs(
        ...     {Decision.KEEP: keep, Decision.RECOMPUTE: keep},
        ...     {Decision.KEEP: [10.0, 10.0], Decision.RECOMPUTE: [9.0, 9.0]},
        ... )
        >>> times[Decision.RECOMPUTE]
        {'a': 0.75, 'b': 2.25}
    """
    keep = blocks[Decision.KEEP]
    total = sum(keep.values()) or 1.0
    base = statistics.median(steps[Decision.KEEP])
    times: dict[Decision, dict[str, float]] = {}
    noise: dict[Decision, dict[str, float]] = {}
    for d, seen in steps.items():
        delta = 0.0 if d is Decision.KEEP else statistics.median(seen) - base
        half = (max(seen) - min(seen)) / 2
        times[d] = {n: t + delta * t / total for n, t in keep.items()}
        noise[d] = {n: half * t / total for n, t in keep.items()}
    return times, noise
