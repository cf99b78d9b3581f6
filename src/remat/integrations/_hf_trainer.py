"""``RematCallback`` for ``transformers.Trainer``: plan on the first batch, log peaks per step.

How the Trainer (transformers 5) runs a step, and where the callback acts:

* ``on_train_begin``: the model and the optimizer exist (accelerate's
  ``AcceleratedOptimizer``; the callback plans with the torch optimizer inside it).
  With ``TrainingArguments(activation_checkpointing=True)`` (the deprecated alias
  ``gradient_checkpointing=True``) the Trainer has just turned transformers' own
  checkpointing on; the callback turns it off (``model.activation_checkpointing_disable()``)
  and plans the layers it would have checkpointed, saying so once (logger ``"remat"``).
  The callback installs the cache hooks of :func:`remat.integrations.hf.checkpoint_layers`
  and a forward pre-hook on the model.
* ``on_step_begin`` (once per optimizer step, before its micro-batches): the meter
  starts (:class:`~remat.integrations.PeakMeter`).
* ``compute_loss`` calls ``model(**inputs)``: the pre-hook sees the inputs. On the
  first training call it plans there, with exactly what the Trainer passes
  (``labels``, ``num_items_in_batch``, ...), the loss the model returns, the torch
  optimizer, and gradients kept between micro-batches when
  ``gradient_accumulation_steps > 1`` (``set_to_none=False``; the Trainer clears them
  with ``model.zero_grad()`` after each optimizer step, ``set_to_none=True`` otherwise).
  Mixed precision needs nothing more: accelerate runs the model's ``forward`` inside
  ``torch.autocast`` (and the loss the model computes), backward outside, and so do
  the planner's steps, which call the same model. The planner puts back every
  parameter, gradient, optimizer state, buffer and RNG state it touches, so the
  training step that follows is the one the Trainer would have run; the meter's
  peak restarts after planning. Each call adds its inputs to the meter's count.
* ``on_step_end`` (after ``optimizer.step()`` and ``zero_grad``): the step's
  :class:`~remat.integrations.PeakCheck`; a ``RuntimeWarning`` when over budget.
* ``on_log``: the largest peak since the last log, with the prediction and the
  budget, is added to the logs (``remat/peak_bytes``, ``remat/predicted_bytes``,
  ``remat/budget_bytes``) and to the entry of ``trainer.state.log_history``. The
  Trainer calls its reporting callbacks (``report_to``) before those passed in
  ``callbacks=``; to have them report these values too, pass the callback first with
  ``report_to="none"`` and add the reporting callback after it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..planner.loop import Loop
from ..planner.types import Timer
from ._extras import require
from ._hf_layers import auto_checkpoint, guard_cache, layer_names, take_over_switch
from ._session import PlannedTraining, torch_optimizer

require("transformers", "hf", "remat.integrations.hf")
from transformers import TrainerCallback  # noqa: E402  (after the check that names the extra)


class _OnForward:
    """Forward pre-hook of the trained model: plan on the first training call, count inputs."""

    def __init__(self, callback: RematCallback) -> None:
        self.callback = callback
        self.busy = False

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.busy or not (module.training and torch.is_grad_enabled()):
            return
        cb = self.callback
        if cb.plan is None:
            self.busy = True
            try:
                cb._plan(module, args, kwargs)
            except BaseException:
                cb._end()
                raise
            finally:
                self.busy = False
            cb.session.meter.reset_peak()
        cb.session.meter.include(args, kwargs)


class RematCallback(TrainerCallback):  # type: ignore[misc]
    """Plans remat's checkpointing for a budget on the first training batch; logs peaks.

    Pass it to the Trainer (``Trainer(..., callbacks=[RematCallback("60%")])``). On the
    first training batch it plans the model's layers (every stack's, as
    :func:`remat.integrations.hf.auto_checkpoint`) for the Trainer's loop: its
    optimizer, the loss the model returns, its mixed precision and its gradient
    accumulation; applies the plan; and from then on measures every optimizer step's
    peak (all its micro-batches) against the plan's prediction and the budget. See
    :mod:`remat.integrations._hf_trainer` for where each happens. The model keeps the
    plan after training; :func:`remat.integrations.hf.uncheckpoint_layers` undoes it.

    With ``TrainingArguments(activation_checkpointing=True)`` (or its deprecated alias
    ``gradient_checkpointing=True``, or ``model.activation_checkpointing_enable()``) the
    callback turns transformers' own checkpointing off and plans the layers it would have
    checkpointed, saying so once (logger ``"remat"``). Every option is checked here, when
    the callback is made, not on the first batch.

    Args:
        budget: the step's peak: bytes (``2**30``, ``"18GiB"``) or a share of what the
            unchecked step allocates above its static bytes (``"60%"``), as in
            :func:`remat.auto_checkpoint`.
        loss_fn: output -> loss, for a Trainer that computes its loss outside the model
            (``compute_loss_func``, ``label_smoothing_factor``): the planner's steps run
            it on the model's output. Default: the ``loss`` the model returns.
        check_fn: ``(name, module) -> bool``: other candidate layers (default: the
            ``GradientCheckpointingLayer`` s).
        timer: the planner's cost measure, ``"time"`` (default), ``"measured"`` or
            ``"flops"`` (see :func:`remat.profile`).
        measure: measure each step (on CPU this counts every operator's outputs in
            Python: slower steps); ``False`` plans only.
        compile: compiled plans (see :func:`remat.auto_checkpoint`'s ``compile``): each
            candidate layer compiled on its own at the partitioner budget the plan gives it.
            The steps are then not measured (``measure`` is taken as ``False``: the meter's
            tracker cannot see compiled kernels, and torch.compile runs eagerly under it).

    Attributes:
        plan: the applied :class:`remat.Plan`, ``None`` before the first batch.
        checks: one :class:`~remat.integrations.PeakCheck` per measured optimizer step.
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
        self.session = PlannedTraining(
            budget,
            loop=Loop(loss_fn=loss_fn, check_fn=check_fn, timer=timer, compile=compile),
            measure=measure,
            where="remat.integrations.hf.RematCallback",
        )
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._set_to_none = True
        self._hook: RemovableHandle | None = None
        self._told = False  # transformers' switch taken over: said once

    @property
    def plan(self) -> Any:
        return self.session.plan

    @property
    def checks(self) -> list[Any]:
        return self.session.meter.checks

    def _plan(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        s = self.session
        loop = dataclasses.replace(s.loop, optimizer=self._optimizer, set_to_none=self._set_to_none)
        plan = auto_checkpoint(model, *args, budget=s.budget, **loop.keywords(), **kwargs)
        s.planned(plan)

    def _end(self) -> None:
        self.session.meter.close()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._end()  # a run that raised left its hook or meter behind
        model = kwargs.get("model")
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"RematCallback: the Trainer passed no model to on_train_begin (got "
                f"{type(model).__name__}); it needs transformers.Trainer's callback arguments."
            )
        self._model = model
        self._optimizer = torch_optimizer(kwargs.get("optimizer"))
        self._set_to_none = int(args.gradient_accumulation_steps) == 1
        layers = layer_names(model, self.session.loop.check_fn)
        # TrainingArguments(activation_checkpointing=True) turned transformers' switch on
        # before this call (at every train()): remat plans those layers instead
        if take_over_switch(model, layers, self.session.where, say=not self._told):
            self._told = True
        if self.plan is None:
            guard_cache(model, layers)
        self._hook = model.register_forward_pre_hook(_OnForward(self), with_kwargs=True)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.session.measure and self._model is not None:
            self.session.meter.close()
            self.session.meter.start(
                self._model, optimizer=self._optimizer, step=int(state.global_step) + 1
            )

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.session.meter.running:
            self.session.meter.stop()

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        check = self.session.unlogged()
        if check is None or logs is None:
            return
        values = check.logs()
        logs.update(values)
        history = state.log_history
        if history and history[-1].get("step") == state.global_step:
            history[-1].update(values)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._end()
