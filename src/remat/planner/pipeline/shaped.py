"""A pipeline stage planned for microbatches of varying size (``plan_pipeline_stage(...,
shapes=remat.Shapes(...))``).

Under ``torch.distributed.pipelining`` a stage learns its microbatches' shapes from the first
step (or from ``input_args``), so a pipeline that trains on sequences of several lengths
builds one ``PipelineStage`` and schedule per length bucket, over the same stage module.
:func:`plan_stage_shapes` plans the rank's stage at each size of the :class:`~remat.Shapes`
(its ``sizes`` and the example's, the largest; a half and a quarter without ``sizes``),
each for the same budget: a profile of the stage at that size (:func:`.profile_stage`) and
its plan (:func:`.solve_stage`), no fit between sizes (a stage profile is a few one-
microbatch steps; buckets are few). :meth:`StageShapePlans.apply` installs a forward
pre-hook on the stage module that switches in, before each microbatch's forward, the plan
of the smallest planned size at least the microbatch's (a microbatch between two planned
sizes runs the larger one's plan, whose peak bounds its own where bytes grow with the
size); a microbatch larger than the largest planned size raises ``PlanError``.

Across ranks: every rank plans its own stage for its own budget, as
:func:`remat.plan_pipeline_stage` does; only the sizes planned are agreed (one
``all_gather_object`` before any profile, where a process group is initialized: the
microbatches flow from stage to stage, so every stage sees each size). The switch needs no
collective: every stage of one step runs microbatches of one size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...engine.errors import PlanError
from ..distributed import agree_same
from ..shapes import Shapes
from ..types import Timer
from .measure import profile_stage
from .solve import StagePlan, solve_stage


@dataclasses.dataclass
class StageShapePlans:
    """One stage's plans by microbatch size (see the module docstring).

    Attributes:
        shapes: the :class:`~remat.Shapes` planned for.
        plans: size -> the stage's :class:`~remat.planner.pipeline.StagePlan` at that size
            (each for the same budget).
        applied: the size whose plan the stage last ran, ``None`` before the first forward.

    Example:
        >>> import torch, remat
        >>> stage = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        >>> plans = remat.plan_pipeline_stage(
        ...     stage, torch.randn(2, 32, 64), stage_index=0, num_stages=2, schedule="1f1b",
        ...     microbatches=4, budget=400_000, timer="flops",
        ...     shapes=remat.Shapes(dims=1, sizes=(16,)))
        >>> plans.sizes, plans.size_for(20)
        ([16, 32], 32)
        >>> _ = plans.apply(stage)  # before each forward: the plan of the microbatch's size
        >>> _ = stage(torch.randn(2, 16, 64)).sum().backward()
        >>> plans.applied
        16
        >>> plans.remove()
    """

    shapes: Shapes
    plans: dict[int, StagePlan]
    applied: int | None = None
    _module: nn.Module | None = dataclasses.field(default=None, init=False, repr=False)
    _handle: Any = dataclasses.field(default=None, init=False, repr=False)

    @property
    def sizes(self) -> list[int]:
        """The planned sizes, smallest first."""
        return sorted(self.plans)

    def size_for(self, size: int) -> int:
        """The planned size a microbatch of ``size`` runs the plan of: the smallest at least
        ``size``.

        Raises:
            PlanError: ``size`` is larger than the largest planned size.
        """
        for n in self.sizes:
            if n >= size:
                return n
        raise PlanError(
            f"remat: a microbatch of size {size} along dimension(s) {list(self.shapes.axes)} "
            f"is larger than the largest size this stage was planned for ({self.sizes[-1]}); "
            "plan the stage with the largest microbatch as its example."
        )

    def plan_for(self, size: int) -> StagePlan:
        """The plan a microbatch of ``size`` runs with (:meth:`size_for`)."""
        return self.plans[self.size_for(size)]

    def apply(self, module: nn.Module) -> nn.Module:
        """Apply the largest size's plan to the stage module now and install the forward
        pre-hook that switches plans by the microbatch's size; returns the module."""
        self.remove()
        self._module = module
        self.switch(self.sizes[-1])
        self._handle = module.register_forward_pre_hook(self._before, with_kwargs=True)
        return module

    def switch(self, size: int) -> StagePlan:
        """Apply the plan of ``size``'s planned size (nothing when it is applied already)."""
        if self._module is None:
            raise RuntimeError("StageShapePlans.switch: apply(module) it first.")
        n = self.size_for(size)
        if n != self.applied:
            self.plans[n].apply(self._module)
            self.applied = n
        return self.plans[n]

    def _before(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if torch.is_grad_enabled():
            self.switch(self.shapes.size_of((args, kwargs), "remat.plan_pipeline_stage"))

    def remove(self) -> None:
        """Remove the switching hook (the last applied plan's wrapping stays)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def __str__(self) -> str:
        return "\n".join(f"size {n}: {self.plans[n]}" for n in self.sizes)


def plan_stage_shapes(
    module: nn.Module,
    args: tuple[Any, ...],
    shapes: Shapes,
    *,
    schedule: str,
    stage: int,
    stages: int,
    microbatches: int,
    budget: int,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    target: Any,
    optimizer: torch.optim.Optimizer | None,
    return_outputs: bool,
    timer: Timer,
    max_span: int,
) -> StageShapePlans:
    """The stage's plans at each size of ``shapes`` (``args`` and ``target``: one microbatch
    at the largest size), each for ``budget`` bytes; see the module docstring.

    Raises:
        PlanError: the ranks plan different sizes, or no plan fits at some size.
    """
    if not isinstance(shapes, Shapes):
        raise TypeError(
            f"remat.plan_pipeline_stage: shapes must be a remat.Shapes, got "
            f"{type(shapes).__name__}."
        )
    where = "remat.plan_pipeline_stage(shapes=...)"
    largest = shapes.size_of(args, where)
    sizes = shapes.knots(largest)
    agree_same(sizes, "the microbatch sizes each stage is planned at")
    plans = {}
    for n in sizes:
        a = shapes.cut(args, largest, n)
        t = target if target is None else shapes.cut(target, largest, n)
        sp = profile_stage(
            module,
            a,
            schedule=schedule,
            stage=stage,
            stages=stages,
            microbatches=microbatches,
            loss_fn=loss_fn,
            target=t,
            optimizer=optimizer,
            return_outputs=return_outputs,
            timer=timer,
        )
        try:
            plans[n] = solve_stage(sp, budget, max_span=max_span)
        except PlanError as e:
            raise PlanError(f"at microbatch size {n}: {e}") from None
    return StageShapePlans(shapes, plans)
