"""Measure one stage of a pipeline: two profiles of one microbatch's step and the bytes no
plan moves (:class:`~remat.planner.stepmodel.stage.StageBytes`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ...engine.bytes import storage_bytes
from ..measure import profile
from ..solve import Profile
from ..stepmodel.schedule import Event, stage_events
from ..stepmodel.stage import StageBytes
from ..types import Timer
from .probe import PROBE_LOSS_BYTES, StageProbe, forward_bytes, injected, tensor_bytes


@dataclasses.dataclass
class StageProfile:
    """What a stage's plan is made from (:func:`profile_stage`).

    Attributes:
        freed: one microbatch's step, gradients freed (``set_to_none=True``).
        kept: the same, gradients kept (``set_to_none=False``).
        sizes: the bytes no plan moves.
        events: the moments of the stage's step under its schedule.
        schedule: ``"gpipe"`` or ``"1f1b"``.
        stage: the stage's index; ``stages`` how many there are.
    """

    freed: Profile
    kept: Profile
    sizes: StageBytes
    events: list[Event]
    schedule: str
    stage: int
    stages: int


def _received(args: Sequence[Any]) -> tuple[Any, ...]:
    """The example inputs as the stage receives them: floating tensors a fresh leaf that
    requires grad (the schedule's receive buffer)."""
    return tuple(
        a.detach().clone().requires_grad_(True)
        if isinstance(a, torch.Tensor) and a.is_floating_point()
        else a
        for a in args
    )


def _last_loss(loss_fn: Callable[[Any, Any], torch.Tensor], target: Any, out: Any) -> torch.Tensor:
    return loss_fn(out, target)


def profile_stage(
    module: nn.Module,
    args: Sequence[Any],
    *,
    schedule: str,
    stage: int,
    stages: int,
    microbatches: int,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    target: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    return_outputs: bool = True,
    timer: Timer = "time",
) -> StageProfile:
    """Profile one microbatch of ``module`` as the stage ``stage`` of ``stages`` runs it.

    ``args`` is one microbatch's inputs of the stage (the batch's on the first stage, the
    received activation on the others); ``loss_fn(output, target)`` and one microbatch's
    ``target`` are needed on the last stage. The batch the rank passes to ``step()`` (the
    first stage's inputs, the last stage's target) is counted as ``microbatches`` times one
    microbatch's.
    """
    # the schedule's counts first: options are checked before any step runs
    events = stage_events(
        schedule,
        stage=stage,
        stages=stages,
        microbatches=microbatches,
        return_outputs=return_outputs,
    )
    first, last = stage == 0, stage == stages - 1
    probe = StageProbe(module)
    loss: Callable[[Any], torch.Tensor]
    inputs = args if first else _received(args)
    if last:
        if loss_fn is None or target is None:
            raise ValueError(
                "remat: the last stage needs loss_fn (the schedule's) and one microbatch's "
                "target to be planned."
            )
        loss = functools.partial(_last_loss, loss_fn, target)
        kept_loss: Callable[[Any], torch.Tensor] | None = loss
    else:
        with torch.no_grad():
            out = probe(*inputs)
        if not isinstance(out, torch.Tensor):
            raise ValueError(
                "remat: a stage before the last must return one tensor (the activation it "
                f"sends), got {type(out).__name__}."
            )
        grad = torch.zeros_like(out)
        del out
        loss = injected(grad)
        kept_loss = None
    fwd = forward_bytes(probe, tuple(inputs), kept_loss)
    common = dict(loss_fn=loss, check_fn=None, distributed=False)
    freed = profile(probe, *inputs, optimizer=optimizer, timer=timer, **common)  # type: ignore[arg-type]
    kept = profile(
        probe,
        *inputs,
        set_to_none=False,
        timer="flops",
        decisions=freed.decisions,
        **common,  # type: ignore[arg-type]
    )
    n = microbatches
    received = 0 if first else n * tensor_bytes(list(args))
    grads_in = 0 if last else n * fwd.output
    batch = n * (tensor_bytes(list(args)) if first else 0) + n * (
        tensor_bytes(target) if last else 0
    )
    sizes = StageBytes(
        static=storage_bytes([*module.parameters(), *module.buffers()])
        + received
        + grads_in
        + batch,
        optimizer_state=freed.optim.state_bytes,
        grads=freed.grad_bytes,
        kept_keep=fwd.kept,
        output=fwd.output,
        input_grad=0 if first else tensor_bytes(list(args)),
        loss=fwd.loss,
        microbatches=n,
        probe_loss=0 if last else PROBE_LOSS_BYTES,
        optimizer_first=freed.optim.first_bytes,
        optimizer_later=freed.optim.later_bytes,
    )
    return StageProfile(freed, kept, sizes, events, schedule, stage, stages)
