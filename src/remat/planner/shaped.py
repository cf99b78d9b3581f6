"""Where the profiles :func:`remat.auto_checkpoint` plans from come from: shapes where they can.

A real model is profiled from shapes through a meta twin of it (:func:`~.meta.twin`, made
once: the same modules, wrapping and optimizer, no bytes) and meta copies of each batch's
inputs, so that profiling a model at one size or at ten allocates nothing and runs no real
step. Where shapes cannot profile the model (:func:`no_shapes` says why: a process group,
autocast, FSDP2's parameters, ``timer="measured"``; or the twin's step raised, as a model
whose shapes depend on values does), every profile from then on is of real steps, as
:func:`remat.profile` makes them, and the reason is said once. A profile from shapes counts
no scratch inside operators (``Profile.from_shapes``): the caller measures it in real steps
of the planned model (:func:`~.measure.plan_scratch`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._modelinfo import device_of
from . import measure
from .inputs import Inputs
from .meta import is_meta, on_meta, twin
from .progress import Progress
from .solve import Profile

#: What a profile from shapes may raise where shapes alone do not profile a model.
NOT_FROM_SHAPES = (RuntimeError, NotImplementedError, TypeError, ValueError)


def no_shapes(model: nn.Module, timer: str, agree: bool) -> str | None:
    """Why a real model is not profiled from shapes (``None``: it is)."""
    if timer == "measured":
        return "timer='measured' times real steps"
    if agree:
        return "the ranks of a process group profile together"
    if any(torch.is_autocast_enabled(t) for t in ("cpu", "cuda")):
        return "autocast applies to real devices only"
    if any(type(p) is not nn.Parameter for p in model.parameters()):
        return "its parameters are not plain (FSDP2's, a tensor subclass)"
    return None


def _by_name(
    model: nn.Module, check_fn: Callable[[str, nn.Module], bool]
) -> Callable[[str, nn.Module], bool]:
    """``check_fn`` for the twin: its modules answer as the model's own of the same name."""

    def pick(name: str, _twin: nn.Module) -> bool:
        return check_fn(name, model.get_submodule(name))

    return pick


class ProfileSource:
    """Profiles of one model and training step at any inputs: from shapes where it can (see
    the module docstring), else of real steps.

    Args:
        model, optimizer, set_to_none, loss_fn, check_fn, distributed: as
            :func:`remat.profile` takes them.
        timer: the timer of the profiles (a call may ask for another: the fit's checks
            count FLOPs).
        agree: whether a process group of two or more ranks profiles together.
        device: for a model on the meta device, the device it will train on.
        say: where each profile is said.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        optimizer: torch.optim.Optimizer | None,
        set_to_none: bool,
        loss_fn: Callable[[Any], torch.Tensor] | None,
        check_fn: Callable[[str, nn.Module], bool] | None,
        timer: str,
        distributed: bool | None,
        agree: bool,
        device: str | torch.device | None,
        say: Progress,
    ) -> None:
        self.model, self.optimizer, self.check_fn = model, optimizer, check_fn
        self.options: dict[str, Any] = dict(set_to_none=set_to_none, loss_fn=loss_fn)
        self.timer, self.distributed, self.device, self.say = timer, distributed, device, say
        self.meta = is_meta(model, ())
        #: why profiles are of real steps (``None``: from shapes)
        self.why = None if self.meta else no_shapes(model, timer, agree)
        self._twin: tuple[nn.Module, torch.optim.Optimizer | None] | None = None

    @property
    def from_shapes(self) -> bool:
        """Whether the profiles are made from shapes (so they count no scratch)."""
        return self.why is None

    def __call__(self, inputs: Inputs, at: str = "", timer: str | None = None) -> Profile:
        """The profile at ``inputs`` (on the model's device, or on meta for a meta model);
        ``at`` says which (``" at size 512"``) when there are several."""
        timer = timer or self.timer
        args, kwargs = inputs.args, inputs.kwargs
        options = {**self.options, "timer": timer}
        if self.meta or is_meta(self.model, (args, kwargs)):
            self.say(f"profiling from shapes{at} (a model on the meta device)")
            return measure.profile(
                self.model, inputs, optimizer=self.optimizer, check_fn=self.check_fn,
                distributed=self.distributed, device=self.device, **options,
            )  # fmt: skip
        if self.why is None:
            try:
                if self._twin is None:
                    model, _, _, opt = twin(self.model, (), {}, self.optimizer)
                    self._twin = model, opt
                model, opt = self._twin
                a, k = on_meta((args, kwargs))
                pick = None if self.check_fn is None else _by_name(self.model, self.check_fn)
                self.say(f"profiling from shapes{at} (a meta copy of the model: nothing allocated)")
                return measure.profile(
                    model, Inputs(*a, **k), optimizer=opt, check_fn=pick, distributed=False,
                    device=device_of(self.model, (args, kwargs)), **options,
                )  # fmt: skip
            except NOT_FROM_SHAPES as e:
                first = str(e).splitlines()[0] if str(e) else ""
                self.why = f"shapes alone do not profile it ({type(e).__name__}: {first})"
                self._twin = None
        self.say(f"profiling real steps{at}, the unchecked step among them: {self.why}")
        return measure.profile(
            self.model, inputs, optimizer=self.optimizer, check_fn=self.check_fn,
            distributed=self.distributed, **options,
        )  # fmt: skip
