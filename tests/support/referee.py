"""An independent meter: the raw CPU allocator events of ``torch.profiler``; and
:func:`check_auto`, the planner's two promises checked with it."""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import remat
from tests.support.steps import loss_of


def referee(run):
    """The profiler's raw CPU allocator events: (peak, peak between operators, final) bytes.

    "Between operators" samples the running total at the end of each outermost
    ``aten::`` operator, which leaves out scratch memory a kernel frees before it
    returns (the tracker's definition); the raw peak includes it.

    The profiler does not report the free of a block allocated before it started (the
    first profiler of a process warns "Memory block of unknown size"): ``run`` must not
    free such blocks, or they stay counted (call ``optimizer.zero_grad()`` before, not
    inside).
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


def alive_bytes(model: nn.Module, opt: torch.optim.Optimizer, inputs: list[torch.Tensor]) -> int:
    """Bytes of the tensors a step starts with: parameters, buffers, gradients, state, inputs."""
    seen: dict[int, int] = {}
    tensors = [*model.parameters(), *model.buffers(), *inputs]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        st = t.untyped_storage()
        seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def check_auto(
    model: nn.Module,
    *args: Any,
    budget: str = "55%",
    loss_fn: Callable[[Any], torch.Tensor] = loss_of,
    set_to_none: bool = True,
    check_fn: Callable[[str, nn.Module], bool] | None = None,
    steps: int = 2,
    amp: torch.dtype | None = None,
    **kwargs: Any,
) -> remat.Plan:
    """``auto_checkpoint`` then ``steps`` steps (the first creates the optimizer state):
    bitwise updates and buffers, peak within budget. ``set_to_none`` and ``check_fn`` go to
    ``auto_checkpoint`` and the loop (``set_to_none=False``: the gradients exist before every
    step, zeroed, as in gradient accumulation); ``kwargs`` go to the model as well. ``amp``:
    the loop of torch's mixed-precision recipe (forward and loss in a CPU autocast region of
    that dtype, backward and the optimizer step after it), planned inside such a region."""
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)

    def region() -> Any:
        return torch.autocast("cpu", dtype=amp, enabled=amp is not None)

    with region():
        p = remat.auto_checkpoint(
            model,
            *args,
            budget=budget,
            optimizer=opt,
            loss_fn=loss_fn,
            timer="flops",
            set_to_none=set_to_none,
            check_fn=check_fn,
            **kwargs,
        )
    inputs = [t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)]

    def step(m: nn.Module, o: torch.optim.Optimizer) -> None:
        torch.manual_seed(5)
        with region():
            loss = loss_fn(m(*args, **kwargs))
        loss.backward()
        o.step()

    if not set_to_none:  # the loop's gradients exist before its first step
        for m in (model, ref):
            torch.manual_seed(5)
            with region():
                loss = loss_fn(m(*args, **kwargs))
            loss.backward()
    for i in range(steps):
        # zero_grad before the meter starts: the profiler does not report the free of a
        # block allocated before it started, so gradients freed inside would stay counted
        opt.zero_grad(set_to_none=set_to_none)
        ref_opt.zero_grad(set_to_none=set_to_none)
        start = alive_bytes(model, opt, inputs)
        raw_peak, _, _ = referee(lambda: step(model, opt))
        assert start + raw_peak <= p.budget_bytes, (i, start + raw_peak, p.budget_bytes)
        step(ref, ref_opt)
        for (name, a), b in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(a, b), (i, name)
        for (name, a), b in zip(model.named_buffers(), ref.buffers()):
            assert torch.equal(a, b), (i, name)
    return p
