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

from ..engine.bytes import fmt_bytes, storage_bytes
from ..engine.errors import PlanError
from ..engine.tree import tensors_in
from ..modules.modelinfo import candidates, device_of
from . import measure
from .distributed import agree_min, agree_same
from .fake import fake_twin, on_fake
from .grouped import NotPaired, pair_peak
from .inputs import Inputs
from .loop import Loop
from .meta import AutocastInForward, is_meta, on_meta, twin
from .progress import Progress
from .shapefit import ShapeFit
from .solve import Profile
from .stepmodel import located
from .types import Timer

#: What a profile from shapes may raise where shapes alone do not profile a model.
NOT_FROM_SHAPES = (RuntimeError, NotImplementedError, TypeError, ValueError)


def no_shapes(model: nn.Module, timer: str, agree: bool, compile: bool = False) -> str | None:
    """Why a real model is not profiled from shapes (``None``: it is)."""
    if compile:
        return "compile=True measures compiled kernels in real steps"
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
            profiles at smaller batches (:func:`batch_pairs`) rather than run its unchecked
            step, where the batch allows: ``True``, at the largest pair; a callable (the
            budget in bytes of a whole-batch profile), at the largest pair whose unchecked
            steps are predicted within that budget.

    Its :attr:`blocks` (the model's candidate blocks, by ``loop.check_fn``) are found once,
    as it is made, and every profile (of the model, of its twin, of a cut batch) is of them:
    the callers that plan the model read them here rather than look them up again.
    """

    def __init__(
        self,
        model: nn.Module,
        loop: Loop,
        *,
        agree: bool,
        device: str | torch.device | None,
        say: Progress,
        within: bool | Callable[[Profile], int] = False,
    ) -> None:
        self.model, self.loop, self.device, self.say = model, loop, device, say
        self.agree, self.within = agree, within
        #: the candidate blocks' names (a twin's are the same: its modules answer
        #: ``check_fn`` as the model's own of the same name)
        self.blocks = candidates(model, loop.check_fn)
        self.meta = is_meta(model, ())
        #: why profiles are of real steps (``None``: from shapes)
        self.why = None if self.meta else no_shapes(model, loop.timer, agree, loop.compile)
        self._twin: tuple[nn.Module, torch.optim.Optimizer | None, FakeTensorMode | None] | None
        self._twin = None
        self._found: torch.device | None = None  # the model's device, found once
        #: why pair steps cannot profile the model (``None``: not found so far)
        self.paired_why: str | None = None

    def _device_of(self, args: Any) -> torch.device:
        """The model's device (its inputs' ``args``), found at the first profile."""
        if self._found is None:
            self._found = device_of(self.model, args)
        return self._found

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

    def __call__(self, inputs: Inputs, at: str = "", timer: Timer | None = None) -> Profile:
        """The profile at ``inputs`` (on the model's device, or on meta for a meta model);
        ``at`` says which (``" at size 512"``) when there are several. Its steps are counted
        on a bar of ``say`` (:func:`~remat.planner.progress.bar`)."""
        with self.say.active():
            return self._profile(inputs, at, timer)

    def _profile(self, inputs: Inputs, at: str, timer: Timer | None) -> Profile:
        loop = dataclasses.replace(self.loop, timer=timer or self.loop.timer)
        args, kwargs = inputs.args, inputs.kwargs
        if self.meta or is_meta(self.model, (args, kwargs)):
            self.say(f"profiling from shapes{at} (a model on the meta device)")
            return measure.profile_loop(
                self.model, inputs, loop, device=self.device, blocks=self.blocks
            )
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
                    return measure.profile_loop(model, Inputs(*a, **k), on_twin, blocks=self.blocks)
                a, k = on_meta((args, kwargs))
                self.say(f"profiling from shapes{at} (a meta copy of the model: nothing allocated)")
                return measure.profile_loop(
                    model,
                    Inputs(*a, **k),
                    on_twin,
                    device=self._device_of((args, kwargs)),
                    blocks=self.blocks,
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
        if self.within and not self.loop.compile:  # a compile per cut batch: not worth it
            fitted = self._fitted(inputs, loop)
            if fitted is not None:
                return fitted
            self.say(
                f"profiling real steps{at}, one or two blocks kept at a time (never the unchecked "
                f"step): {self.why}"
            )
            try:
                prof = self._real(inputs, loop, paired=True, fall_back=False)
            except NotPaired as e:
                self.say(f"pair steps cannot profile this model: {e}")
            else:
                if callable(self.within):
                    held, target = pair_peak(prof), self.within(prof)
                    if held > target:
                        what = "single" if prof.steps == "singles" else "pair"
                        self.say(
                            f"the {what} steps held up to {fmt_bytes(held)}, above the budget "
                            f"{fmt_bytes(target)} (the unchecked step: "
                            f"{fmt_bytes(prof.unchecked_peak_bytes)})"
                        )
                return prof
        self.say(f"profiling real steps{at}, the unchecked step among them: {self.why}")
        return measure.profile_loop(self.model, inputs, loop, blocks=self.blocks)

    def _real(
        self, inputs: Inputs, loop: Loop, paired: bool, fall_back: bool = True
    ) -> Profile:
        """A profile of real steps at ``inputs``; ``paired``: from pair steps
        (:mod:`.grouped`), or, where the model cannot be paired and ``fall_back``, of
        uniform steps (said once; :class:`~.grouped.NotPaired` raised without)."""
        if paired and self.paired_why is None:
            try:
                return measure.profile_loop(
                    self.model, inputs, loop, blocks=self.blocks, paired=True
                )
            except NotPaired as e:
                self.paired_why = str(e)
                if not fall_back:
                    raise
                self.say(f"pair steps cannot profile this model: {e}")
        elif paired and not fall_back:
            raise NotPaired(self.paired_why)
        return measure.profile_loop(self.model, inputs, loop, blocks=self.blocks)

    def _fitted(self, inputs: Inputs, loop: Loop) -> Profile | None:
        """The profile at ``inputs`` fitted from real profiles at two smaller batches (never
        the unchecked step at the whole batch), or ``None`` where the batch is too small to
        cut or the cut batches raise; see :func:`batch_pairs`.

        With a budget (``within`` a callable: the budget in bytes of a whole-batch profile)
        the smallest pair is profiled first, the budget read from its fit, and the largest
        pair whose unchecked steps that fit predicts within the budget (each with the whole
        batch's inputs alive beside it) is profiled and fitted instead, where it is larger:
        no step holds more than the budget unless the smallest pair's already does."""
        args = (inputs.args, inputs.kwargs)
        pairs = batch_pairs(args)
        if not pairs:
            return None
        batch = _batch()
        largest = batch.size_of(args)
        budgeted = callable(self.within) and len(pairs) > 1
        first = pairs[0] if budgeted else pairs[-1]
        if self.agree:  # every rank profiles the same sizes, in lockstep
            agree_same(pairs, "the batch sizes profiled")
        # with a budget, not yet known, the first pair's steps hold two blocks under each
        # decision at a time (pair steps), not their unchecked steps
        paired = callable(self.within)
        how = "in pair steps " if paired else ""
        self.say(
            f"profiling real steps {how}at batches {first[0]}, {first[1]} and fitting batch "
            f"{largest} from them (never the unchecked step at {largest}): {self.why}"
        )
        profiles: dict[int, Profile] = {}
        prof = self._fit_pair(first, args, largest, loop, profiles, paired=paired)
        if prof is None or not budgeted:
            return prof
        within = self.within
        assert callable(within)
        target = within(prof)
        cut = _cut_bytes(args, largest)
        fit = ShapeFit({n: profiles[n] for n in first})

        def held(n: int) -> int:  # the unchecked step at batch n, the whole batch beside it
            at = fit.at(n)
            return at.unchecked_peak_bytes + at.scratch.bytes + cut

        fitting = [i for i, (_, b) in enumerate(pairs) if held(b) <= target]
        best = fitting[-1] if fitting else 0
        if not fitting:
            self.say(
                f"the unchecked step at batch {first[1]} held up to {fmt_bytes(held(first[1]))} "
                f"with the whole batch's inputs, above the budget {fmt_bytes(target)}: no "
                "smaller batch is cut"
            )
        if self.agree:  # the ranks' fits may differ by their inputs: the smallest pair of all
            (best,) = agree_min([best])
        if best == 0:
            return prof
        pair = pairs[best]
        self.say(
            f"profiling real steps at batches {pair[0]}, {pair[1]} too (their unchecked steps "
            f"predicted within the budget {fmt_bytes(target)}), and fitting batch {largest} "
            "from them"
        )
        return self._fit_pair(pair, args, largest, loop, profiles) or prof

    def _fit_pair(
        self,
        pair: tuple[int, int],
        args: tuple[Any, Any],
        largest: int,
        loop: Loop,
        profiles: dict[int, Profile],
        paired: bool = False,
    ) -> Profile | None:
        """The profile at the whole batch ``largest`` fitted from real profiles at the two
        sizes of ``pair`` (kept in ``profiles``; ``paired``: from pair steps where the model
        allows, :mod:`.grouped`), or ``None`` (said) where a cut batch raises or the two do
        not fit one profile."""
        batch = _batch()
        try:
            for n in pair:
                if n not in profiles:
                    a, k = batch.cut(args, largest, n)
                    profiles[n] = self._real(Inputs(*a, **k), loop, paired)
        except NOT_FROM_SHAPES as e:
            if self.agree:
                raise  # the other ranks would wait for this one's next step
            first = str(e).splitlines()[0] if str(e) else ""
            self.say(f"a cut batch raised ({type(e).__name__}: {first})")
            return None
        try:
            prof = ShapeFit({n: profiles[n] for n in pair}).at(largest)
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


def batch_pairs(args: object) -> list[tuple[int, int]]:
    """The pairs of batch sizes a profile of ``args`` may be fitted from, where shapes alone
    cannot profile the model, smallest first: consecutive halvings of the batch (dimension
    0 of the inputs; a half, a quarter, ... each at least 2, as a batch of one takes other
    kernels), or ``(2, 3)`` for a batch of 4 to 7; none below 4 (or where no input has a
    batch dimension).

    A byte term of a step is a peak: the largest of sums that each grow linearly in the
    batch where each sample's work is its own (a transformer's, a CNN's), so that past some
    batch one sum (the steepest) is the peak and the term is linear. The line through the
    two sizes profiled gives the whole batch's term exactly once they are past that point
    (``tests/planner/test_fitted.py``: a GPT and a routed MLP, exact from a batch of 2); a
    term whose largest sum changes between the larger size and the whole batch is predicted
    low, and the plan's checked steps (real ones, at the whole batch) catch it as a budget
    missed.

    Example:
        >>> import torch
        >>> batch_pairs((torch.zeros(16, 3),)), batch_pairs((torch.zeros(5, 3),))
        ([(2, 4), (4, 8)], [(2, 3)])
    """
    try:
        largest = _batch().size_of(args)
    except ValueError:
        return []
    sizes = sorted({largest >> j for j in range(1, largest.bit_length()) if largest >> j >= 2})
    if len(sizes) < 2 and largest >= 4:
        sizes = [2, 3]
    return list(zip(sizes, sizes[1:]))


def batch_knots(args: object) -> list[int] | None:
    """The largest pair of :func:`batch_pairs` (a quarter and a half of a batch of 8 or
    more), the sizes profiled where no budget is known; ``None`` where there is none.

    Example:
        >>> import torch
        >>> batch_knots((torch.zeros(16, 3),)), batch_knots((torch.zeros(3, 3),))
        ([4, 8], None)
    """
    pairs = batch_pairs(args)
    return list(pairs[-1]) if pairs else None


def _cut_bytes(args: object, largest: int) -> int:
    """The bytes of the whole batch's tensors that a cut batch copies (alive beside it)."""
    found: list[torch.Tensor] = []
    tensors_in(args, found)
    return storage_bytes([t for t in found if t.dim() > 0 and t.shape[0] == largest])
