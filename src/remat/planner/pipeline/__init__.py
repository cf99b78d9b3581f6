"""Pipeline parallelism: each stage planned for the microbatches its schedule holds.

Under ``torch.distributed.pipelining`` every rank runs one stage of the model on ``n``
microbatches per step, in its schedule's order. A stage holds the activations of every
microbatch it has forwarded and not yet backwarded: all ``n`` under GPipe, up to ``stages -
stage`` under 1F1B, so the first stages need several times the last one's activation memory.
:func:`plan_pipeline_stage`, called once on every rank before training, plans that rank's
stage for that rank's budget:

1. **measure** (:mod:`.measure`): two profiles of one microbatch of the stage's module, as
   the stage runs it (:mod:`.probe`: the received activation as a leaf whose gradient is
   sent away, the received gradient injected into the output, or the loss on the last
   stage): with the gradients freed (the step's first backward creates them) and kept (the
   later ones accumulate into them); and what one microbatch's forward leaves alive;
2. **model** (:mod:`remat.planner.stepmodel.stage`, :mod:`remat.planner.stepmodel.schedule`):
   the step's peak is the largest, over every moment of the schedule on this stage (each
   forward, each backward, the points between them, the optimizer's step), of what the
   schedule holds there (microbatches in flight, outputs and input gradients its sends
   still reference, losses, received buffers, gradients, optimizer state) plus the running
   microbatch's own term under the plan;
3. **solve** (:mod:`.solve`): the cheapest plan whose predicted peak fits.

Each rank plans alone (no collective: the stages are different models), so the ranks get
one plan per stage, the first stages checkpointing more.

Exactness: on CPU the predicted peak equals :mod:`remat.memory`'s measured peak of the
schedule's steps (``tests/planner/test_pipeline_ranks.py``). It counts what the stage's
module, the schedule and the rank's batch allocate; not what gloo or NCCL allocate inside
their sends, nor the scratch inside operators (which :func:`remat.plan` adds on GPUs).
Modelled: ``ScheduleGPipe`` and ``Schedule1F1B`` of torch 2.13 (single stage per rank),
stages that send one tensor, the loop ``optimizer.zero_grad(); schedule.step(...);
optimizer.step()`` with the returned outputs dropped. Microbatches of several lengths
(``shapes=``): a plan per size, switched by each microbatch's size (:mod:`.shaped`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, overload

import torch
from torch import nn

from ..shapes import Shapes
from ..sharded import is_ddp, is_sharded
from ..stepmodel import parse_budget
from ..stepmodel.schedule import SCHEDULES
from ..types import Timer
from .measure import StageProfile, profile_stage
from .shaped import StageShapePlans, plan_stage_shapes
from .solve import StagePlan, solve_stage

__all__ = [
    "StagePlan",
    "StageProfile",
    "StageShapePlans",
    "plan_pipeline_stage",
    "profile_stage",
    "solve_stage",
]


def _refuse_data_parallel(module: nn.Module) -> None:
    """Raise ``ValueError`` for a stage module data-parallel inside its stage (FSDP2, DDP):
    the schedule changes how they hold parameters and gradients between microbatches
    (FSDP2 keeps the parameters gathered and the gradients unsharded from the first
    backward to the last; DDP reduces only the last), which the stage model does not count,
    so its prediction would be wrong."""
    if is_ddp(module):
        what = "wrapped in DistributedDataParallel"
    elif is_sharded(module):
        what = "sharded (FSDP2's fully_shard)"
    else:
        return
    raise ValueError(
        f"remat.plan_pipeline_stage: the stage's module is {what}: data parallelism inside "
        "a pipeline stage is not planned yet (the schedule keeps FSDP2's parameters gathered "
        "and its gradients unsharded between microbatches, and DDP reduces only the last; "
        "the stage model does not count either). Plan the stage's plain module before "
        "wrapping it, knowing the prediction leaves those bytes out, or plan one stage per "
        "rank without data parallelism."
    )


def _schedule_name(schedule: str | type) -> str:
    name = schedule if isinstance(schedule, str) else schedule.__name__
    name = name.lower().removeprefix("schedule")
    if name not in SCHEDULES:
        raise ValueError(
            f"remat.plan_pipeline_stage: schedule must be 'gpipe' or '1f1b' (or torch's "
            f"ScheduleGPipe, Schedule1F1B), got {schedule!r}."
        )
    return name


@overload
def plan_pipeline_stage(
    stage: Any,
    *args: Any,
    schedule: str | type,
    microbatches: int,
    budget: int | str,
    stage_index: int | None = None,
    num_stages: int | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    target: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    return_outputs: bool = True,
    timer: Timer = "time",
    max_span: int = 16,
    shapes: None = None,
) -> StagePlan: ...


@overload
def plan_pipeline_stage(
    stage: Any,
    *args: Any,
    schedule: str | type,
    microbatches: int,
    budget: int | str,
    stage_index: int | None = None,
    num_stages: int | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    target: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    return_outputs: bool = True,
    timer: Timer = "time",
    max_span: int = 16,
    shapes: Shapes,
) -> StageShapePlans: ...


def plan_pipeline_stage(
    stage: Any,
    *args: Any,
    schedule: str | type,
    microbatches: int,
    budget: int | str,
    stage_index: int | None = None,
    num_stages: int | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    target: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    return_outputs: bool = True,
    timer: Timer = "time",
    max_span: int = 16,
    shapes: Shapes | None = None,
) -> StagePlan | StageShapePlans:
    """Plan this rank's pipeline stage for ``budget`` bytes: the cheapest checkpointing of
    its blocks whose step (every microbatch of ``schedule``, then ``optimizer.step()``)
    peaks within it.

    Call it on every rank, after building the stage and its optimizer and before the first
    step; then ``plan.apply(stage.submod)``. No collective runs: each rank plans its own
    stage, and may plan while the others do.

    Args:
        stage: the rank's ``torch.distributed.pipelining.PipelineStage`` (its ``submod``,
            ``stage_index`` and ``num_stages`` are read), or the stage's ``nn.Module`` (before
            the ``PipelineStage`` is built) with ``stage_index`` and ``num_stages``.
        *args: one microbatch's inputs of this stage: a slice of the batch on the first
            stage, a tensor shaped like the received activation on the others.
        schedule: ``"gpipe"``, ``"1f1b"`` or torch's ``ScheduleGPipe`` / ``Schedule1F1B``.
        microbatches: the schedule's ``n_microbatches``.
        stage_index / num_stages: the stage's index and the number of stages (read from a
            ``PipelineStage``).
        budget: the rank's peak in bytes (``2**30``, ``"3GiB"``): parameters, gradients,
            optimizer state, the schedule's buffers and held tensors, the batch the rank
            passes to ``step()`` (``microbatches`` times ``args`` on the first stage, times
            ``target`` on the last) and the activations.
        loss_fn: the schedule's ``loss_fn(output, target)`` (the last stage).
        target: one microbatch's target (the last stage).
        optimizer: the stage's optimizer (its state and step counted); ``None``: none.
        return_outputs: as the loop calls ``schedule.step(return_outputs=...)``.
        timer: the cost measure, as :func:`remat.profile` takes it.
        max_span: the longest span of blocks one checkpoint may cover.
        shapes: microbatches of varying size (``remat.Shapes(dims=1, sizes=(512, 1024))``;
            ``args`` and ``target`` at the largest): the stage is planned at each of its
            sizes for the same budget, and a :class:`StageShapePlans` returned, whose
            ``apply(module)`` switches plans by each microbatch's size
            (:mod:`.shaped`: the sizes are agreed across ranks; ``Shapes.larger`` and
            ``checks`` are not used: a larger microbatch raises ``PlanError``).

    Returns:
        The :class:`StagePlan` (its ``predicted_peak_bytes`` is this rank's); with
        ``shapes``, the :class:`StageShapePlans`.

    Raises:
        PlanError: no plan fits the budget.

    Example:
        >>> import torch, remat
        >>> first = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        >>> plan = remat.plan_pipeline_stage(first, torch.randn(32, 64), stage_index=0,
        ...     num_stages=2, schedule="1f1b", microbatches=4, budget=285_000, timer="flops")
        >>> plan.in_flight, plan.predicted_peak_bytes <= 285_000
        (2, True)
        >>> _ = plan.apply(first)  # then PipelineStage(first, 0, 2, ...) and the schedule
    """
    module = stage.submod if hasattr(stage, "submod") else stage
    index = getattr(stage, "stage_index", stage_index) if stage_index is None else stage_index
    count = getattr(stage, "num_stages", num_stages) if num_stages is None else num_stages
    if not isinstance(module, nn.Module) or index is None or count is None:
        raise TypeError(
            "remat.plan_pipeline_stage: stage must be a PipelineStage, or the stage's module "
            f"with stage_index= and num_stages=; got {type(stage).__name__} with "
            f"stage_index={index!r}, num_stages={count!r}."
        )
    _refuse_data_parallel(module)
    name = _schedule_name(schedule)
    if isinstance(budget, str) and budget.strip().endswith("%"):
        raise ValueError(
            f"remat.plan_pipeline_stage: budget must be absolute bytes (2**30, '3GiB'), got "
            f"{budget!r}: a share of a stage's step has no unchecked step of the pipeline to "
            "be a share of."
        )
    limit = parse_budget(budget, 0, 1)
    if shapes is not None:
        return plan_stage_shapes(
            module,
            args,
            shapes,
            schedule=name,
            stage=int(index),
            stages=int(count),
            microbatches=microbatches,
            budget=limit,
            loss_fn=loss_fn,
            target=target,
            optimizer=optimizer,
            return_outputs=return_outputs,
            timer=timer,
            max_span=max_span,
        )
    sp = profile_stage(
        module,
        args,
        schedule=name,
        stage=int(index),
        stages=int(count),
        microbatches=microbatches,
        loss_fn=loss_fn,
        target=target,
        optimizer=optimizer,
        return_outputs=return_outputs,
        timer=timer,
    )
    return solve_stage(sp, limit, max_span=max_span)
