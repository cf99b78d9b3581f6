"""What both training callbacks do: plan once on the first batch, then measure every step."""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..planner.checks import check_options
from ..planner.loop import Loop
from .actual import PeakCheck, PeakMeter

log = logging.getLogger("remat")


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The ``torch.optim.Optimizer`` a trainer steps, out of its wrappers (accelerate's
    ``AcceleratedOptimizer`` holds it as ``.optimizer``; it skips ``step()`` between
    accumulated micro-batches, which the planner's steps must not)."""
    seen = 0
    while (
        optimizer is not None
        and isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer)
        and seen < 8
    ):
        optimizer = optimizer.optimizer
        seen += 1
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


class PlannedTraining:
    """The plan made on the first batch and the meter of every step, for one callback.

    Attributes:
        plan: the applied plan (``None`` before the first training batch).
        meter: the :class:`PeakMeter` of the steps (its ``checks``).
    """

    def __init__(
        self,
        budget: int | float | str,
        *,
        loop: Loop,
        measure: bool,
        where: str,
    ) -> None:
        # every option now, before training starts (the plan is made on the first batch)
        check_options(
            where, budget=budget, loss_fn=loop.loss_fn, check_fn=loop.check_fn,
            timer=loop.timer, measure=measure,
        )  # fmt: skip
        if not isinstance(loop.compile, bool):
            raise TypeError(f"{where}: compile must be True or False, got {loop.compile!r}.")
        self.budget = budget
        #: the loop's options known before training (loss, candidate blocks, timer); each
        #: callback adds the trainer's optimizer and how it clears gradients
        self.loop = loop
        # compiled steps are not metered: the tracker cannot see compiled kernels
        self.measure = measure and not loop.compile
        self.where = where
        self.plan: Any = None
        self.meter = PeakMeter()
        self._logged = 0

    def planned(self, plan: Any) -> None:
        """Record the applied plan (the meter compares with it) and log it."""
        self.plan = plan
        self.meter.plan = plan
        log.info("%s: planned on the first training batch:\n%s", self.where, plan)

    def unlogged(self) -> PeakCheck | None:
        """The check with the largest peak among those since the last call (``None``: none)."""
        new = self.meter.checks[self._logged :]
        self._logged = len(self.meter.checks)
        return max(new, key=lambda c: c.peak_bytes) if new else None
