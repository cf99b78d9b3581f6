"""Lightning: ``RematCallback`` plans for a budget on the first training batch and logs peaks.

How ``Trainer.fit`` (Lightning 2, automatic optimization) runs a batch, and where the
callback acts:

* the batch is moved to the device, then ``on_train_batch_start(batch, batch_idx)``:
  on the first batch the callback plans there, running the module's
  ``training_step(batch, batch_idx)`` as the planner's step (the loss it returns,
  or its ``"loss"`` entry), under the precision plugin's ``train_step_context()``
  (``torch.autocast`` for ``"bf16-mixed"``/``"16-mixed"``; the planner runs backward
  outside it, as Lightning does), with the trainer's optimizer, and applies the plan.
  The candidate blocks are the module's repeated blocks (``check_fn`` to choose).
  While the planner's steps run, ``self.log``/``self.log_dict`` of the module log
  nothing; other side effects of ``training_step`` (metric objects, counters) happen
  in those steps too. Then the meter starts
  (:class:`~remat.integrations.PeakMeter`: parameters, gradients, optimizer state and
  the batch counted from here).
* the closure runs ``training_step``, then ``optimizer.zero_grad()``, then backward:
  the previous step's gradients are alive during forward, so the plan is made for
  gradients kept (``set_to_none=False``), which also covers gradient accumulation.
* ``on_train_batch_end``: the batch's :class:`~remat.integrations.PeakCheck` (a
  ``RuntimeWarning`` when over budget), logged with ``self.log_dict`` on the step
  (``remat/peak_bytes``, ``remat/predicted_bytes``, ``remat/budget_bytes``: Lightning
  logs them as floats; exact integers are in :attr:`RematCallback.checks`).

Example::

    trainer = lightning.Trainer(max_steps=100, callbacks=[RematCallback("60%")])
    trainer.fit(module, loader)
    print(trainer.callbacks[0].plan)

The extra ``remat[lightning]`` installs ``lightning`` (``import lightning``); the
``pytorch_lightning`` package has its own ``Callback`` class, which this is not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .. import auto_checkpoint
from ..planner.loop import Loop
from ..planner.types import Timer
from ._extras import require
from ._session import PlannedTraining, torch_optimizer

require("lightning.pytorch", "lightning", "remat.integrations.lightning")
from lightning.pytorch import Callback  # noqa: E402  (after the check that names the extra)

__all__ = ["RematCallback"]

#: the module's logging methods silenced while the planner runs training_step
_LOGGING = ("log", "log_dict")
_PREFIX = "module."


def _no_log(*args: Any, **kwargs: Any) -> None:
    """Stands in for ``LightningModule.log`` while the planner runs ``training_step``."""


class _TrainingStep(nn.Module):
    """The module's ``training_step`` as a model for the planner (``module.`` prefixes the
    block names); Lightning passes ``batch_idx`` when the step takes it."""

    def __init__(self, module: Any) -> None:
        super().__init__()
        self.module = module
        self.step_fn: Callable[..., Any] = module.training_step
        params = inspect.signature(self.step_fn).parameters.values()
        positional = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
        self.takes_index = positional >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)

    def forward(self, batch: Any, batch_idx: int) -> Any:
        if self.takes_index:
            return self.step_fn(batch, batch_idx)
        return self.step_fn(batch)


@contextlib.contextmanager
def _silenced(module: nn.Module) -> Iterator[None]:
    """``module.log``/``log_dict`` do nothing inside; put back on every exit path."""
    own = {name: module.__dict__[name] for name in _LOGGING if name in module.__dict__}
    try:
        for name in _LOGGING:
            module.__dict__[name] = _no_log
        yield
    finally:
        for name in _LOGGING:
            if name in own:
                module.__dict__[name] = own[name]
            else:
                module.__dict__.pop(name, None)


class RematCallback(Callback):  # type: ignore[misc]
    """Plans remat's checkpointing for a budget on the first training batch; logs peaks.

    See :mod:`remat.integrations.lightning` for where each part happens. The module
    keeps the plan after ``fit``; apply a plan of ``"keep"`` decisions to undo it.

    Args:
        budget: the step's peak: bytes (``2**30``, ``"18GiB"``) or a share of what the
            unchecked step allocates above its static bytes (``"60%"``), as in
            :func:`remat.auto_checkpoint`.
        loss_fn: ``training_step``'s output -> loss (default: the tensor it returns, or
            its ``"loss"`` entry).
        check_fn: ``(name, module) -> bool`` over the LightningModule's submodules
            (names as ``named_modules`` gives them): the candidate blocks. Default: the
            repeated blocks.
        timer: the planner's cost measure, ``"time"`` (default), ``"measured"`` or
            ``"flops"`` (see :func:`remat.profile`).
        measure: measure each batch (on CPU this counts every operator's outputs in
            Python: slower steps); ``False`` plans only.
        compile: compiled plans (see :func:`remat.auto_checkpoint`'s ``compile``): each
            candidate layer compiled on its own at the partitioner budget the plan gives it.
            The steps are then not measured (``measure`` is taken as ``False``: the meter's
            tracker cannot see compiled kernels, and torch.compile runs eagerly under it).

    Attributes:
        plan: the applied :class:`remat.Plan` (block names prefixed ``module.``),
            ``None`` before the first batch.
        checks: one :class:`~remat.integrations.PeakCheck` per measured batch.
    """

    def __init__(
        self,
        budget: int | float | str,
        *,
        loss_fn: Callable[[Any], torch.Tensor] | None = None,
        check_fn: Callable[[str, nn.Module], bool] | None = None,
        timer: Timer = "time",
        measure: bool = True,
        compile: bool = False,
    ) -> None:
        super().__init__()
        self.session = PlannedTraining(
            budget,
            loop=Loop(loss_fn=loss_fn, check_fn=check_fn, timer=timer, compile=compile),
            measure=measure,
            where="remat.integrations.lightning.RematCallback",
        )

    @property
    def plan(self) -> Any:
        return self.session.plan

    @property
    def checks(self) -> list[Any]:
        return self.session.meter.checks

    def _plan(self, trainer: Any, module: nn.Module, batch: Any, batch_idx: int) -> None:
        s = self.session
        if not getattr(module, "automatic_optimization", True):
            raise ValueError(
                f"{s.where}: the module uses manual optimization (automatic_optimization="
                "False), whose step the callback cannot know; call remat.auto_checkpoint on "
                "the model inside it with your loop's optimizer and loss instead."
            )
        optimizers = list(getattr(trainer, "optimizers", []) or [])
        optimizer = torch_optimizer(optimizers[0]) if optimizers else None
        check = s.loop.check_fn
        wanted = None
        if check is not None:

            def wanted(name: str, m: nn.Module) -> bool:
                return name.startswith(_PREFIX) and check(name[len(_PREFIX) :], m)

        step = _TrainingStep(module)
        with _silenced(module), trainer.precision_plugin.train_step_context():
            loop = dataclasses.replace(
                s.loop, optimizer=optimizer, set_to_none=False, check_fn=wanted
            )
            plan = auto_checkpoint(step, batch, batch_idx, budget=s.budget, **loop.keywords())
        s.planned(plan)

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        s = self.session
        s.meter.close()  # a batch that raised left its meter behind
        if s.plan is None:
            self._plan(trainer, pl_module, batch, batch_idx)
        if s.measure:
            optimizers = list(getattr(trainer, "optimizers", []) or [])
            optimizer = torch_optimizer(optimizers[0]) if optimizers else None
            s.meter.start(pl_module, batch, optimizer=optimizer)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        s = self.session
        if not s.meter.running:
            return
        check = s.meter.stop()
        s.unlogged()
        values = {k: torch.tensor(float(v), dtype=torch.float64) for k, v in check.logs().items()}
        pl_module.log_dict(values, on_step=True, on_epoch=False)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.session.meter.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.session.meter.close()
