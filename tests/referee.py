"""An independent meter: the raw CPU allocator events of ``torch.profiler``."""

from __future__ import annotations

import gc

from torch.profiler import ProfilerActivity, profile


def referee(run):
    """The profiler's raw CPU allocator events: (peak, peak between operators, final) bytes.

    "Between operators" samples the running total at the end of each outermost
    ``aten::`` operator, which leaves out scratch memory a kernel frees before it
    returns (the tracker's definition); the raw peak includes it.
    """
    gc.collect()  # a cycle collected inside the window would be an unrelated free
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = list(prof.profiler.kineto_results.events())
    allocs = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    ops = sorted(
        (e for e in events if e.name().startswith("aten::")),
        key=lambda e: (e.start_thread_id(), e.start_ns(), -e.end_ns()),
    )
    ends, outer_end, thread = [], -1, None
    for op in ops:  # outermost: not inside the previous outermost op of the same thread
        if op.start_thread_id() != thread or op.start_ns() > outer_end:
            thread, outer_end = op.start_thread_id(), op.end_ns()
            ends.append(outer_end)
    ends.sort()
    cur = peak = between = 0
    i = 0
    for e in allocs:
        while i < len(ends) and ends[i] < e.start_ns():
            between = max(between, cur)
            i += 1
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak, max(between, cur), cur
