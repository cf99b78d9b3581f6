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

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from .._modelinfo import device_of
from . import measure
from .inputs import Inputs
from .loop import Loop
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
        model: the model.
        loop: the training loop's options; its ``timer`` is that of the profiles (a call may
            ask for another: the fit's checks count FLOPs).
        agree: whether a process group of two or more ranks profiles together.
        device: for a model on the meta device, the device it will train on.
        say: where each profile is said.
    """

    def __init__(
        self,
        model: nn.Module,
        loop: Loop,
        *,
        agree: bool,
        device: str | torch.device | None,
        say: Progress,
    ) -> None:
        self.model, self.loop, self.device, self.say = model, loop, device, say
        self.meta = is_meta(model, ())
        #: why profiles are of real steps (``None``: from shapes)
        self.why = None if self.meta else no_shapes(model, loop.timer, agree)
        self._twin: tuple[nn.Module, torch.optim.Optimizer | None] | None = None

    @property
    def from_shapes(self) -> bool:
        """Whether the profiles are made from shapes (so they count no scratch)."""
        return self.why is None

    def __call__(self, inputs: Inputs, at: str = "", timer: str | None = None) -> Profile:
        """The profile at ``inputs`` (on the model's device, or on meta for a meta model);
        ``at`` says which (``" at size 512"``) when there are several. Its steps are counted
        on a bar of ``say`` (:func:`~remat.planner.progress.bar`)."""
        with self.say.active():
            return self._profile(inputs, at, timer)

    def _profile(self, inputs: Inputs, at: str, timer: str | None) -> Profile:
        loop = dataclasses.replace(self.loop, timer=timer or self.loop.timer)
        args, kwargs = inputs.args, inputs.kwargs
        if self.meta or is_meta(self.model, (args, kwargs)):
            self.say(f"profiling from shapes{at} (a model on the meta device)")
            return measure.profile_loop(self.model, inputs, loop, device=self.device)
        if self.why is None:
            try:
                if self._twin is None:
                    model, _, _, opt = twin(self.model, (), {}, loop.optimizer)
                    self._twin = model, opt
                model, opt = self._twin
                a, k = on_meta((args, kwargs))
                pick = None if loop.check_fn is None else _by_name(self.model, loop.check_fn)
                self.say(f"profiling from shapes{at} (a meta copy of the model: nothing allocated)")
                on_twin = dataclasses.replace(loop, optimizer=opt, check_fn=pick, distributed=False)
                return measure.profile_loop(
                    model, Inputs(*a, **k), on_twin, device=device_of(self.model, (args, kwargs))
                )
            except NOT_FROM_SHAPES as e:
                first = str(e).splitlines()[0] if str(e) else ""
                self.why = f"shapes alone do not profile it ({type(e).__name__}: {first})"
                self._twin = None
        self.say(f"profiling real steps{at}, the unchecked step among them: {self.why}")
        return measure.profile_loop(self.model, inputs, loop)
