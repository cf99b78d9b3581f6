"""Where the profiles :func:`remat.auto_checkpoint` plans from come from: shapes where they can.

A real model is profiled from shapes through a meta twin of it (:func:`~.meta.twin`, made
once: the same modules, wrapping and optimizer, no bytes) and meta copies of each batch's
inputs, so that profiling a model at one size or at ten allocates nothing and runs no real
step. Inside ``torch.autocast`` (which casts CPU and CUDA tensors, never meta ones) the twin
is a fake one (:func:`~.fake.fake_twin`: fake tensors of the model's device, no bytes
either). Where shapes cannot profile the model (:func:`no_shapes` says why: a process group,
FSDP2's parameters, ``timer="measured"``; or the twin could not be made or its step raised,
as for CPU's recurrent kernels under autocast or a model whose shapes depend on values),
every profile from then on is of real steps, as
:func:`remat.profile` makes them, and the reason is said once. A profile from shapes counts
no scratch inside operators (``Profile.from_shapes``): the caller measures it in real steps
of the planned model (:func:`~.measure.plan_scratch`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from .._errors import PlanError
from .._modelinfo import device_of
from .._tree import tensors_in
from . import measure
from .distributed import agree_same
from .fake import fake_twin, on_fake
from .inputs import Inputs
from .loop import Loop
from .meta import AutocastInForward, is_meta, on_meta, twin
from .progress import Progress
from .shapefit import ShapeFit
from .solve import Profile
from .stepmodel import located

#: What a profile from shapes may raise where shapes alone do not profile a model.
NOT_FROM_SHAPES = (RuntimeError, NotImplementedError, TypeError, ValueError)


def no_shapes(model: nn.Module, timer: str, agree: bool) -> str | None:
    """Why a real model is not profiled from shapes (``None``: it is)."""
    if timer == "measured":
        return "timer='measured' times real steps"
    if agree:
        return "the ranks of a process group profile together"
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
        within: where shapes alone cannot profile the model, fit its profile from real
            profiles at smaller batches (:func:`batch_knots`) rather than run its unchecked
            step, where the batch allows.
    """

    def __init__(
        self,
        model: nn.Module,
        loop: Loop,
        *,
        agree: bool,
        device: str | torch.device | None,
        say: Progress,
        within: bool = False,
    ) -> None:
        self.model, self.loop, self.device, self.say = model, loop, device, say
        self.agree, self.within = agree, within
        self.meta = is_meta(model, ())
        #: why profiles are of real steps (``None``: from shapes)
        self.why = None if self.meta else no_shapes(model, loop.timer, agree)
        self._twin: tuple[nn.Module, torch.optim.Optimizer | None, FakeTensorMode | None] | None
        self._twin = None

    def _make_twin(
        self, optimizer: torch.optim.Optimizer | None
    ) -> tuple[nn.Module, torch.optim.Optimizer | None, FakeTensorMode | None]:
        """The model's twin: a fake one inside autocast (which casts CPU and CUDA tensors,
        never meta ones), else a meta one (replaced by a fake one where the model turns
        autocast on inside its forward: :class:`~.meta.AutocastInForward`)."""
        if any(torch.is_autocast_enabled(t) for t in ("cpu", "cuda")):
            return fake_twin(self.model, optimizer)
        model, _, _, opt = twin(self.model, (), {}, optimizer)
        return model, opt, None

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
                    self._twin = self._make_twin(loop.optimizer)
                model, opt, mode = self._twin
                pick = None if loop.check_fn is None else _by_name(self.model, loop.check_fn)
                on_twin = dataclasses.replace(loop, optimizer=opt, check_fn=pick, distributed=False)
                if mode is not None:  # autocast: a fake twin, which autocast casts
                    a, k = on_fake(mode, (args, kwargs))
                    self.say(f"profiling from shapes{at} (a fake copy of the model, for autocast)")
                    return measure.profile_loop(model, Inputs(*a, **k), on_twin)
                a, k = on_meta((args, kwargs))
                self.say(f"profiling from shapes{at} (a meta copy of the model: nothing allocated)")
                return measure.profile_loop(
                    model, Inputs(*a, **k), on_twin, device=device_of(self.model, (args, kwargs))
                )
            except AutocastInForward:  # the model's forward casts: a fake twin, once
                if self._twin is not None and self._twin[2] is None:
                    self._twin = fake_twin(self.model, loop.optimizer)
                    return self(inputs, at, timer)
                raise
            except NOT_FROM_SHAPES as e:
                cause = e.__cause__ if isinstance(e.__cause__, Exception) else e  # the op's own
                first = str(cause).splitlines()[0] if str(cause) else ""
                self.why = f"shapes alone do not profile it ({type(cause).__name__}: {first})"
                self._twin = None
        if self.within:
            fitted = self._fitted(inputs, loop)
            if fitted is not None:
                return fitted
        self.say(f"profiling real steps{at}, the unchecked step among them: {self.why}")
        return measure.profile_loop(self.model, inputs, loop)

    def _fitted(self, inputs: Inputs, loop: Loop) -> Profile | None:
        """The profile at ``inputs`` fitted from real profiles at smaller batches (no step of
        them holds more than the unchecked step at half the batch), or ``None`` where the
        batch is too small to cut or the cut batches raise; see :func:`batch_knots`."""
        args = (inputs.args, inputs.kwargs)
        knots = batch_knots(args)
        if knots is None:
            return None
        batch = _batch()
        largest = batch.size_of(args)
        if self.agree:  # every rank profiles the same sizes, in lockstep
            agree_same(knots, "the batch sizes profiled")
        self.say(
            f"profiling real steps at batches {', '.join(map(str, knots))} and fitting batch "
            f"{largest} from them (never the unchecked step at {largest}): {self.why}"
        )
        profiles = {}
        try:
            for n in knots:
                a, k = batch.cut(args, largest, n)
                profiles[n] = measure.profile_loop(self.model, Inputs(*a, **k), loop)
        except NOT_FROM_SHAPES as e:
            if self.agree:
                raise  # the other ranks would wait for this one's next step
            first = str(e).splitlines()[0] if str(e) else ""
            self.say(f"a cut batch raised ({type(e).__name__}: {first})")
            return None
        try:
            prof = ShapeFit(profiles).at(largest)
        except PlanError as e:  # other blocks or decisions at the two sizes
            self.say(f"the cut batches do not fit one profile ({str(e).splitlines()[0]})")
            return None
        found: list[torch.Tensor] = []
        tensors_in(args, found)
        # no scratch inside operators is fitted: it is measured under the plan, as for a
        # profile from shapes
        return dataclasses.replace(
            located(prof, None), from_shapes=True, input_shapes=[list(t.shape) for t in found]
        )


def _batch() -> Any:
    """The batch dimension a fitted profile cuts: ``Shapes(dims=0)`` (:mod:`.shapes` builds
    on this module: imported here when used)."""
    from .shapes import Shapes

    return Shapes(dims=0)


def batch_knots(args: object) -> list[int] | None:
    """The batch sizes a profile of ``args`` is fitted from, where shapes alone cannot
    profile the model: a quarter and a half of the batch (dimension 0 of the inputs), each
    at least 2 (a batch of one takes other kernels); ``None`` where the batch is smaller than
    8 (or no input has a batch dimension).

    A byte term of a step is a peak: the largest of sums that each grow linearly in the
    batch where each sample's work is its own (a transformer's, a CNN's), so that past some
    batch one sum (the steepest) is the peak and the term is linear. The line through the
    two largest sizes profiled gives the whole batch's term exactly once they are past that
    point (``tests/planner/test_fitted.py``: a GPT and a routed MLP, exact); a term whose
    largest sum changes between half the batch and the whole is predicted low, and the
    plan's checked steps (real ones, at the whole batch) catch it as a budget missed.

    Example:
        >>> import torch
        >>> batch_knots((torch.zeros(16, 3),)), batch_knots((torch.zeros(4, 3),))
        ([4, 8], None)
    """
    try:
        largest = _batch().size_of(args)
    except ValueError:
        return None
    knots = sorted({n for n in (largest // 4, largest // 2) if n >= 2})
    return knots if len(knots) == 2 else None
