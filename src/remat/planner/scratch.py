"""Scratch memory inside operators: what the allocator counts and the tracker cannot.

Some kernels allocate memory and free it before they return (oneDNN's
convolution backward on CPU: 2 MiB for a 32-channel 3x3 layer; cuDNN and
attention kernels on a GPU). :mod:`remat.memory` counts tensor storages
between operators, so its peak leaves that memory out, while the allocator's
peak (``torch.cuda.max_memory_allocated()``, the CPU allocator's events in
``torch.profiler``) includes it. An operator's scratch is alive only while it runs, in one
window of the step, so the step model adds to each of its terms the largest scratch of an
operator in that term's window (:mod:`remat.planner.stepmodel.allocator`): an upper bound,
since at any moment one operator runs and adds its own scratch. A budget then holds for the
allocator's peak, not only for the tensors'.

:func:`window_scratch` measures it on one training step under ``torch.profiler`` with
``profile_memory=True``: a dispatch mode marks each operator the tracker sees (a profiler
range around it), and an operator's scratch is the most its allocations reach inside its
range above both the bytes alive when it starts and those alive when it returns (its
outputs are not scratch). Allocations of every thread inside the range count (intra-op
worker threads). The step's windows are marked as it runs (:func:`mark_window`, from
:class:`remat.planner.probes.WindowMarks`), and an operator counts in the window it starts
in. :func:`operator_scratch` is the largest over the whole run.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .types import Window, WindowKind

_MARK = "remat::operator"
_WINDOW = "remat::window::"
log = logging.getLogger("remat")


class _MarkOperators(TorchDispatchMode):
    """Puts a profiler range around every operator that reaches the dispatch modes."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        with _range(_MARK):
            return func(*args, **(kwargs or {}))


def _range(name: str) -> Any:
    fast = getattr(torch._C._profiler, "_RecordFunctionFast", None)
    return fast(name) if fast is not None else torch.autograd.profiler.record_function(name)


@contextlib.contextmanager
def quiet_native_stderr() -> Iterator[None]:
    """Silence what native code prints to file descriptor 2 (some builds log profiler
    start and stop there); Python's own stderr is flushed first and works as before after."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no descriptor 2 (embedded interpreters): nothing to silence
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def mark_window(window: Window) -> None:
    """Mark, in a running profiler's events, that the step's window ``window`` starts here
    (by its :attr:`~remat.planner.types.Window.label`): :func:`window_scratch` gives each
    window the scratch of the operators that start in it."""
    with _range(_WINDOW + window.label):
        pass


def operator_scratch(run: Callable[[], None], device: torch.device) -> int:
    """The most memory of ``device`` one operator run by ``run()`` allocates and frees inside.

    ``run`` is called once, under ``torch.profiler``. Returns 0 when a profiler is
    already running (one cannot be nested in another), and logs it (logger
    ``"remat"``).

    Example:
        >>> import torch
        >>> x = torch.randn(8, 64, requires_grad=True)
        >>> operator_scratch(lambda: x.sin().sum().backward(), torch.device("cpu"))
        0
    """
    found = window_scratch(run, device)
    return max(found.values(), default=0) if found is not None else 0


def window_scratch(run: Callable[[], None], device: torch.device) -> dict[Window, int] | None:
    """Per window of the step ``run()`` runs (marked by :func:`mark_window` as it runs;
    ``WindowKind.PRE`` before the first mark), the most memory of ``device`` one operator starting in
    it allocates and frees inside; windows without scratch are left out.

    ``run`` is called once, under ``torch.profiler``. Returns ``None`` when a profiler is
    already running (one cannot be nested in another: the scratch is not measured), and
    logs it (logger ``"remat"``).

    Example:
        >>> import torch
        >>> x = torch.randn(8, 64, requires_grad=True)
        >>> def run():
        ...     y = x.sin()
        ...     mark_window(Window(WindowKind.TOP))
        ...     y.sum().backward()
        >>> window_scratch(run, torch.device("cpu"))
        {}
    """
    if torch.autograd._profiler_enabled():
        log.warning(
            "remat: a profiler is running, so scratch memory inside operators was not "
            "measured (counted as 0): the plan's peak is the tensors' only."
        )
        run()
        return None

    def marked() -> None:
        with _MarkOperators():
            run()

    return scratch_by_window(profiled(marked), device)


def profiled(run: Callable[[], None]) -> list[Any]:
    """Run ``run()`` once under ``torch.profiler`` with the allocator's events; its events
    (none where the profiler collected nothing).

    Raises:
        RuntimeError: a profiler is already running (one cannot run inside another).
    """
    if torch.autograd._profiler_enabled():
        raise RuntimeError(
            "remat: this step is measured under torch.profiler, and a profiler is already "
            "running: plan (or measure) outside the running profiler."
        )
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with quiet_native_stderr(), warnings.catch_warnings():
        # torch 2.11 with CUDA warns that a profiler's events last one cycle: this one
        # runs one cycle, and pytest's filterwarnings=error must not fail on it
        warnings.filterwarnings("ignore", message=".*Profiler clears events", category=UserWarning)
        prof.__enter__()
    try:
        run()
    finally:
        with quiet_native_stderr():
            prof.__exit__(None, None, None)
    results = None if prof.profiler is None else prof.profiler.kineto_results
    return [] if results is None else list(results.events())


def parse_marks(
    events: list[Any], device: torch.device
) -> tuple[list[tuple[int, int]], list[tuple[int, Window]]]:
    """From profiler ``events``: the allocator events of ``device`` as ``(time, bytes)``
    (a free's bytes negative) and the window marks (:func:`mark_window`) as ``(time,
    window)``, each in time order."""
    kind = device.type.upper()
    index = -1 if device.type == "cpu" else (device.index if device.index is not None else 0)
    allocs = sorted(
        (e.start_ns(), e.nbytes())
        for e in events
        if e.name() == "[memory]"
        and e.device_type().name == kind
        and (device.type == "cpu" or e.device_index() == index)
    )
    marks = sorted((e.start_ns(), e.name()[len(_WINDOW) :]) for e in events
                   if e.name().startswith(_WINDOW))  # fmt: skip
    return allocs, [(t, Window.parse(label)) for t, label in marks]


def largest_scratch(events: list[Any], device: torch.device) -> int:
    """The largest scratch of one marked operator in profiler ``events`` (see the module)."""
    return max(scratch_by_window(events, device).values(), default=0)


def scratch_by_window(events: list[Any], device: torch.device) -> dict[Window, int]:
    """The largest scratch of one marked operator in profiler ``events`` per window (see
    :func:`window_scratch`)."""
    allocs, marks = parse_marks(events, device)
    times = [t for t, _ in allocs]
    starts = [t for t, _ in marks]
    windows = [w for _, w in marks]
    out: dict[Window, int] = {}
    for e in events:
        if e.name() != _MARK:
            continue
        lo = bisect.bisect_left(times, e.start_ns())
        hi = bisect.bisect_right(times, e.end_ns())
        cur = top = 0
        for k in range(lo, hi):
            cur += allocs[k][1]
            top = max(top, cur)
        scratch = top - max(cur, 0)
        if scratch > 0:
            at = bisect.bisect_right(starts, e.start_ns()) - 1
            window = windows[at] if at >= 0 else Window(WindowKind.PRE)
            out[window] = max(out.get(window, 0), scratch)
    return out
