"""``remat.auto_checkpoint``: profile, plan, apply, then check one real step."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import memory
from .._modelinfo import BufferSnapshot, check_grad_enabled, counted_device, device_of, loss_of
from .measure import profile
from .model import parse_budget
from .plan import Plan, plan

log = logging.getLogger("remat")


def measure_peak(
    model: nn.Module,
    *args: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    **kwargs: Any,
) -> int:
    """Peak activation bytes of one training step (gradients allocated beforehand).

    On a device, the bytes of that device (the device of the first tensor
    argument, else of the parameters); host buffers of offloading are not counted.

    The step starts from the current RNG state, which is restored afterwards,
    as are the model's buffers (BatchNorm running statistics); gradients are
    left zeroed.

    Example:
        >>> import torch, remat
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        >>> remat.measure_peak(model, torch.randn(4, 8)) > 0
        True
    """
    check_grad_enabled("remat.measure_peak")
    rng = torch.get_rng_state()
    buffers = BufferSnapshot(model)
    try:
        # allocate gradients first
        loss_of(model(*args, **kwargs), loss_fn, "remat.measure_peak").backward()
        model.zero_grad(set_to_none=False)
        torch.set_rng_state(rng)
        with memory.track(counted_device(device_of(model, (args, kwargs)))) as t:
            loss_of(model(*args, **kwargs), loss_fn, "remat.measure_peak").backward()
        model.zero_grad(set_to_none=False)
    finally:
        buffers.restore()
        torch.set_rng_state(rng)
    return t.peak_bytes


def auto_checkpoint(
    model: nn.Module,
    *args: Any,
    budget: int | float | str,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    check_fn: Callable[[str, nn.Module], bool] | None = None,
    timer: str = "time",
    quiet: bool = False,
    **kwargs: Any,
) -> Plan:
    """Profile, plan for ``budget``, apply in place, and check one measured step.

    If the measured peak is over the budget (the model is a prediction), the
    plan is made again with the budget lowered by the overshoot, up to three
    times, and this is logged (logger ``"remat"``) unless ``quiet``.

    Args:
        model: changed in place.
        *args: example inputs.
        budget: as in :func:`remat.plan` (bytes, ``"18GiB"`` or ``"60%"`` of the
            unchecked activation peak).
        loss_fn: output -> scalar loss; default: sum of the floating outputs.
        check_fn: picks the candidate blocks (default: the repeated blocks).
        timer: ``"time"`` or ``"flops"`` (see :func:`remat.profile`).
        quiet: do not log re-planning.
        **kwargs: keyword inputs of the model.

    Returns:
        The applied :class:`Plan` (its ``predicted_peak_bytes`` is the model's prediction).

    Example:
        >>> import torch, remat
        >>> def block():
        ...     return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
        >>> model = torch.nn.Sequential(*[block() for _ in range(4)])
        >>> p = remat.auto_checkpoint(model, torch.randn(16, 32), budget="80%", timer="flops")
        >>> p.predicted_peak_bytes <= p.budget_bytes
        True
    """
    check_grad_enabled("remat.auto_checkpoint")
    prof = profile(model, *args, loss_fn=loss_fn, check_fn=check_fn, timer=timer, **kwargs)
    target = parse_budget(budget, prof.unchecked_peak_bytes)
    goal = target
    chosen = plan(prof, goal)
    for attempt in range(4):
        chosen.apply(model)
        measured = measure_peak(model, *args, loss_fn=loss_fn, **kwargs)
        if measured <= target or attempt == 3:
            break
        goal = max(1, goal - (measured - target))  # below 1 byte plan() raises PlanError
        if not quiet:
            log.warning(
                "remat.auto_checkpoint: measured peak %d B is over the budget %d B; planning "
                "again for %d B.",
                measured,
                target,
                goal,
            )
        chosen = plan(prof, goal)
    chosen.budget_bytes = target
    return chosen
