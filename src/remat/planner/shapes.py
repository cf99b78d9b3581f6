"""Plans for batches of varying shape: one budget for every size up to the declared largest.

A plan made for one batch shape holds for that shape only: a longer batch of the same model
can peak far above the budget, and a plan made for the longest batch makes every shorter
batch pay the longest one's recompute. With :class:`Shapes` (``remat.auto_checkpoint(...,
shapes=remat.Shapes(dims=1))``) the planner instead:

1. profiles the model at a few sizes of the varying dimension (the example inputs' size, the
   largest, and shorter ones it cuts from them: a half and a quarter, or ``sizes=``), fits
   every byte term of the step model as a polynomial in the size
   (:class:`~remat.planner.shapefit.ShapeFit`) and checks the fit against profiles at sizes
   between those (terms that miss are named in a warning; where the fit was not found exact,
   a size is profiled when a batch of it first comes, instead of trusting the fit);
2. installs a forward pre-hook on the model (:class:`ShapeSwitch`): before each forward that
   records gradients, the batch's size is read from its inputs, rounded up to its bucket (a
   multiple of ``multiple``; at least the smallest profiled size: below it the fit is not
   checked), and the plan for that bucket is switched in (wrappers toggled
   on the blocks; nothing when it is the plan already applied): the fastest plan whose
   predicted peak at that size, plus the scratch inside operators, is within the budget.
   Plans are cached per bucket: the same size always gets the same plan;
3. refuses a batch larger than the largest planned size with :class:`~remat.PlanError` naming
   it, or, with ``larger="smallest"``, runs the plan of the smallest predicted peak at the
   largest size and warns (that batch may be over the budget).

Under ``torch.distributed`` (DDP, FSDP2), the profiles and the budget are agreed across ranks
as for one plan (:mod:`remat.planner.distributed`), and before each forward the ranks agree
on the bucket (the largest over the ranks, one ``all_reduce`` of one integer), so every rank
runs the same plan: the same recomputes, hence the same FSDP2 all-gathers in the same order.
Each rank's own batch is at most that bucket's size.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from typing import Any, Literal, get_args

import torch
from torch import nn

from ..engine.bytes import fmt_bytes
from ..engine.errors import PlanError
from ..engine.tree import replace_tensors, tensors_in
from .apply import restore_state, snapshot_state
from .distributed import active, agree_max, agree_min
from .inputs import Inputs
from .loop import Loop
from .progress import Progress, bar
from .shaped import ProfileSource
from .shapefit import ShapeFit
from .solve import Plan, Profile, plan
from .stepmodel import budget_of
from .types import Timer

__all__ = ["ShapePlans", "ShapeSwitch", "Shapes", "shape_plans"]

log = logging.getLogger("remat")

#: What a batch larger than the largest planned size does (:attr:`Shapes.larger`).
Larger = Literal["error", "smallest"]
LARGER: tuple[Larger, ...] = get_args(Larger)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Which dimension of the model's inputs varies from batch to batch, for
    :func:`remat.auto_checkpoint` (``shapes=``).

    The example inputs given to ``auto_checkpoint`` are the largest batch; every tensor input
    whose size along ``dims`` equals that largest size varies with the batch (the others,
    a mask of fixed size, say, stay). Shorter example batches are cut from the largest one
    (the first ``n`` positions along ``dims``).

    Args:
        dims: the varying dimension of the inputs (``1``: the sequence of a ``(batch, seq)``
            batch of tokens), or several that vary together (``(2, 3)``: square images).
        sizes: sizes to profile besides the largest; default: half and a quarter of it.
        multiple: batches are planned in buckets: a size is rounded up to a multiple of
            this (at most the largest size); use the model's stride for images. The
            default, ``1``, plans each size for itself.
        larger: a batch larger than the largest planned size: ``"error"`` (the default)
            raises :class:`~remat.PlanError`; ``"smallest"`` runs the plan of the smallest
            predicted peak at the largest size and warns (it may be over the budget).
        checks: the most profiles (counting FLOPs: the cheapest steps) that check the fit
            between the profiled sizes; ``0`` trusts no fit: every size is profiled when a
            batch of it first comes.

    Example:
        >>> import torch, remat
        >>> def block():
        ...     return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
        >>> model = torch.nn.Sequential(*[block() for _ in range(4)])
        >>> longest = torch.randn(4, 64, 16)                 # (batch, seq, features)
        >>> plans = remat.auto_checkpoint(model, longest, budget="60%", timer="flops",
        ...                               shapes=remat.Shapes(dims=1))
        >>> short = torch.randn(4, 8, 16)
        >>> remat.measure_peak(model, short) <= plans.budget_bytes   # a plan for 8 switched in
        True
        >>> plans.plan_for(8).decisions == plans.plan_for(64).decisions   # short: less recompute
        False
        >>> plans.remove()   # back to the model as it was
    """

    dims: int | tuple[int, ...] = 1
    sizes: tuple[int, ...] = ()
    multiple: int = 1
    larger: Larger = "error"
    checks: int = 4

    def __post_init__(self) -> None:
        dims = (self.dims,) if isinstance(self.dims, int) else tuple(self.dims)
        if not dims or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in dims):
            raise ValueError(
                f"remat.Shapes: dims must be a dimension (an int >= 0) or a tuple of them, got "
                f"{self.dims!r}. Pass the dimension of the inputs that varies, e.g. dims=1."
            )
        object.__setattr__(self, "dims", dims)
        try:
            sizes = tuple(self.sizes)
        except TypeError:
            raise ValueError(
                f"remat.Shapes: sizes must be a tuple of ints >= 1, got {self.sizes!r}. Pass "
                f"the sizes to profile besides the largest, e.g. sizes=({self.sizes!r},)."
            ) from None
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
            raise ValueError(
                f"remat.Shapes: sizes must be ints >= 1, got {self.sizes!r}. Pass the sizes "
                "to profile besides the largest (or leave it out)."
            )
        object.__setattr__(self, "sizes", sizes)
        m = self.multiple
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(
                f"remat.Shapes: multiple must be an int >= 1, got {m!r}. Pass the stride sizes "
                "are rounded up to (the model's stride for images), or 1."
            )
        c = self.checks
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise ValueError(
                f"remat.Shapes: checks must be an int >= 0, got {c!r}. Pass the most profiles "
                "that check the fit (0: profile each size when a batch of it first comes)."
            )
        if self.larger not in LARGER:
            raise ValueError(
                f"remat.Shapes: larger must be one of {LARGER}, got {self.larger!r}: 'error' "
                "raises on a batch larger than the largest planned, 'smallest' runs the plan "
                "of the smallest peak."
            )

    @property
    def axes(self) -> tuple[int, ...]:
        """``dims`` as a tuple."""
        return self.dims if isinstance(self.dims, tuple) else (self.dims,)

    def size_of(self, args: Any, where: str = "remat.Shapes") -> int:
        """The varying size of a batch: the size along ``dims`` of its first tensor input
        that has them.

        Raises:
            ValueError: no tensor input has the dimensions, or their sizes differ.
        """
        found: list[torch.Tensor] = []
        tensors_in(args, found)
        for t in found:
            if t.dim() > max(self.axes):
                sizes = {t.shape[d] for d in self.axes}
                if len(sizes) != 1:
                    raise ValueError(
                        f"{where}: the dimensions {list(self.axes)} of an input of shape "
                        f"{list(t.shape)} differ; Shapes(dims=...) plans one size for all of "
                        "them (square images), pass the dimension that varies."
                    )
                return int(sizes.pop())
        raise ValueError(
            f"{where}: no tensor input has dimension {max(self.axes)} (inputs of shapes "
            f"{[list(t.shape) for t in found]}); pass Shapes(dims=...) naming a dimension of "
            "the inputs."
        )

    def cut(self, args: Any, largest: int, size: int) -> Any:
        """``args`` with every tensor of size ``largest`` along ``dims`` cut to its first
        ``size`` positions (fresh tensors, not views of the larger ones)."""
        found: list[torch.Tensor] = []
        tensors_in(args, found)
        out = []
        for t in found:
            if t.dim() > max(self.axes) and all(t.shape[d] == largest for d in self.axes):
                c = t.detach()
                for d in self.axes:
                    c = c.narrow(d, 0, size)
                c = c.clone(memory_format=torch.contiguous_format)
                out.append(c.requires_grad_(t.requires_grad) if t.is_leaf else c)
            else:
                out.append(t)
        return replace_tensors(args, out, [0])

    def bucket(self, size: int, largest: int) -> int:
        """The size a batch of ``size`` is planned at: rounded up to ``multiple``, at most
        ``largest``."""
        return min(largest, math.ceil(size / self.multiple) * self.multiple)

    def knots(self, largest: int) -> list[int]:
        """The sizes profiled: ``sizes`` (or half and a quarter of ``largest``, each rounded
        up to ``multiple``) and ``largest``."""
        asked = self.sizes or (largest // 2, largest // 4)
        out = {self.bucket(max(n, 1), largest) for n in asked} | {largest}
        return sorted(out)


class ShapePlans:
    """The plans of a model for every batch size up to the largest, switched in before each
    forward (what :func:`remat.auto_checkpoint` returns with ``shapes=``; see
    :mod:`remat.planner.shapes`).

    Attributes:
        shapes: the :class:`Shapes` it plans for.
        largest: the largest planned size; ``largest_shapes`` its inputs' shapes.
        budget_bytes: the budget every size's plan meets (the step's absolute peak, the
            units of :func:`remat.measure_peak`).
        fit: the profiles and their fit (:class:`~remat.planner.shapefit.ShapeFit`).
        measured: sizes profiled when a batch of them came, where the fit was not trusted.
        applied: the plan the last forward ran with (``None`` before the first).
    """

    def __init__(
        self,
        model: nn.Module,
        example: Inputs,
        shapes: Shapes,
        fit: ShapeFit,
        budget_bytes: int,
        loop: Loop,
        source: ProfileSource,
    ) -> None:
        self.model = model
        self.shapes = shapes
        self.fit = fit
        self.largest = fit.largest
        self.largest_shapes = fit.profiles[self.largest].input_shapes
        self.budget_bytes = budget_bytes
        self.measured: dict[int, Profile] = {}
        self.goal = budget_bytes
        self._example = example
        self._loop = loop
        self._source = source
        self._agree = active(loop.distributed)
        self._plans: dict[int, Plan] = {}
        self._smallest: Plan | None = None
        self._blocks = {n: model.get_submodule(n) for n in source.blocks}
        self._wrapping = snapshot_state(self._blocks)
        self._applied: Any = None
        self.applied: Plan | None = None
        self._busy = False
        self._handle: Any = None

    def profile_at(self, size: int) -> Profile:
        """The profile at ``size``: the fit's where it is trusted, else the bytes measured
        now (a profile counting FLOPs) with the fit's times."""
        if not self.fit.trusted(size):
            log.info("remat: no checked shape fit at size %d; profiling it.", size)
            args = self.shapes.cut((self._example.args, self._example.kwargs), self.largest, size)
            self._busy = True
            try:
                self.measured[size] = self._source(
                    Inputs(*args[0], **args[1]),
                    f" at size {size} (the fit is not checked there)",
                    timer="flops",
                )
            finally:
                self._busy = False
                self._applied = None  # the profile put the wrapping back as it found it
            self.fit.add(size, self.measured[size])
        return self.fit.at(size)

    def plan_for(self, size: int) -> Plan:
        """The plan a batch of ``size`` runs with (cached per bucket).

        Raises:
            PlanError: ``size`` is larger than the largest planned size (with
                ``larger="error"``), or no plan meets the budget at that size.
        """
        if size > self.largest:
            if self.shapes.larger == "error":
                raise PlanError(
                    f"remat: a batch of size {size} along dimension(s) {list(self.shapes.axes)} "
                    f"is larger than the largest planned size {self.largest} (inputs of shapes "
                    f"{self.largest_shapes}); plan with the largest batch (auto_checkpoint's "
                    "example inputs), or pass Shapes(larger='smallest') to run such batches "
                    "with the smallest-peak plan (possibly over the budget)."
                )
            if self._smallest is None:
                top = self.fit.profiles[self.largest]
                self._smallest = plan(top, top.smallest_budget_bytes)
            warnings.warn(
                f"remat: a batch of size {size} is larger than the largest planned size "
                f"{self.largest}; running the smallest-peak plan of size {self.largest} "
                f"(predicted {fmt_bytes(self._smallest.predicted_peak_bytes)} there): this "
                f"batch may exceed the budget {fmt_bytes(self.budget_bytes)}.",
                stacklevel=2,
            )
            return self._smallest
        # Below the smallest profiled size the fit is not checked: such a batch runs the
        # plan of that size (a shorter batch of the same model holds fewer bytes).
        b = max(self.shapes.bucket(size, self.largest), self.fit.sizes[0])
        if b not in self._plans:
            prof = self.profile_at(b)
            try:
                chosen = plan(prof, self.goal)
            except PlanError as e:
                raise PlanError(f"remat: at size {b} (bucket of {size}): {e}") from None
            chosen.budget_bytes = self.budget_bytes
            self._plans[b] = chosen
        return self._plans[b]

    @property
    def plans(self) -> dict[int, Plan]:
        """The plans made so far, by bucket size."""
        return dict(sorted(self._plans.items()))

    def switch(self, size: int) -> Plan:
        """Apply the plan for a batch of ``size`` (a no-op when it is applied already)."""
        chosen = self.plan_for(size)
        key = (tuple(chosen.decisions.items()), tuple(map(tuple, chosen.spans)))
        if key != self._applied:
            chosen.apply(self.model)
            self._applied = key
        self.applied = chosen
        return chosen

    def replan(self, goal: int, *, budget_bytes: int | None = None) -> None:
        """Plan every size again for ``goal`` bytes (below the budget when real steps were
        over it), and for a new budget when ``budget_bytes`` is given."""
        self.goal = goal
        if budget_bytes is not None:
            self.budget_bytes = budget_bytes
        self._plans.clear()
        self._applied = None

    def install(self) -> None:
        """Register the forward pre-hook that switches plans (:class:`ShapeSwitch`)."""
        if self._handle is None:
            # First of the model's pre-hooks: a size profiled now (the fit not trusted there)
            # runs whole steps, which must end before FSDP2's root gathers its parameters.
            self._handle = self.model.register_forward_pre_hook(
                ShapeSwitch(self), with_kwargs=True, prepend=True
            )

    def remove(self) -> None:
        """Remove the hook and put the blocks' wrapping back as it was before planning."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        restore_state(self._blocks, self._wrapping)
        self._applied = None

    def __str__(self) -> str:
        lines = [
            f"plans for sizes up to {self.largest} along dimension(s) {list(self.shapes.axes)} "
            f"(budget {fmt_bytes(self.budget_bytes)}), profiled at {self.fit.sizes}"
            + (f", measured at {sorted(self.measured)}" if self.measured else "")
        ]
        for b, p in self.plans.items():
            kinds = [str(d) for d in p.decisions.values()]
            lines.append(
                f"  {b:>6}: predicted {fmt_bytes(p.predicted_peak_bytes)}, "
                f"{sum(k != 'keep' for k in kinds)} of {len(kinds)} blocks checkpointed"
                + (f", {len(p.spans)} spans" if p.spans else "")
            )
        return "\n".join(lines)


class ShapeSwitch:
    """The forward pre-hook of :class:`ShapePlans`: before a forward that records gradients,
    the plan for the batch's size (agreed across ranks: the largest) is switched in."""

    def __init__(self, plans: ShapePlans) -> None:
        self.plans = plans

    def __call__(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        p = self.plans
        if p._busy or not torch.is_grad_enabled():
            return
        size = p.shapes.size_of((args, kwargs), "remat.auto_checkpoint(shapes=...)")
        if p._agree:
            (size,) = agree_max([p.shapes.bucket(size, p.largest) if size <= p.largest else size])
        p.switch(size)


def shape_plans(
    model: nn.Module,
    example: Inputs,
    shapes: Shapes,
    budget: int | float | str,
    loop: Loop,
    *,
    quiet: bool = False,
    say: Progress | None = None,
) -> ShapePlans:
    """Profile ``model`` at the knots of ``shapes`` (``example`` is the largest batch) for the
    training ``loop``, fit,
    check the fit between the knots, and return the :class:`ShapePlans` (hook not installed;
    :func:`remat.auto_checkpoint` checks real steps and installs it).

    The budget (``"40%"`` or bytes) is that of the largest size's step; under a process
    group of two or more ranks it is the smallest any rank asked for. Each size is profiled
    from shapes where the model can be (:class:`~remat.planner.shaped.ProfileSource`: no
    real step runs), else in real steps that never include the unchecked step (pair steps,
    or cut batches with a budget, as for one shape: the largest size first, whose profile
    gives the budget in bytes); each profile is said on ``say`` (default: standard error,
    unless ``quiet``).
    """
    if not isinstance(shapes, Shapes):
        raise TypeError(
            f"remat.auto_checkpoint: shapes must be a remat.Shapes, got {type(shapes).__name__}."
        )
    args = (example.args, example.kwargs)
    largest = shapes.size_of(args, "remat.auto_checkpoint(shapes=...)")
    knots = shapes.knots(largest)
    if len(knots) < 2:
        raise ValueError(
            f"remat.auto_checkpoint: shapes= needs two or more sizes to profile, got {knots} "
            f"(largest {largest}, multiple={shapes.multiple}); pass larger example inputs or "
            "Shapes(sizes=...)."
        )
    say = say or Progress("remat.auto_checkpoint", quiet)
    agree = active(loop.distributed)
    known: list[int] = []  # the budget in bytes, once the largest size's profile gives it

    def within(whole: Profile) -> int:
        return known[0] if known else budget_of(whole, budget)

    # where shapes cannot profile the model, the sizes' profiles hold no more than the budget
    # where the model allows (pair steps, or cut batches: see ProfileSource)
    source = ProfileSource(model, loop, agree=agree, device=None, say=say, within=within)
    count = [0]

    def profile_at(size: int, timer: Timer) -> Profile:
        a, k = shapes.cut(args, largest, size)
        count[0] += 1
        what = f"{count[0]} of {len(knots)}" if count[0] <= len(knots) else "checking the fit"
        return source(Inputs(*a, **k), f" at size {size} ({what})", timer=timer)

    with say.active(), bar(len(knots), "profiling sizes", unit="size") as sizes:
        profiles = {}
        for n in sorted(knots, reverse=True):  # the largest first: its profile gives the budget
            profiles[n] = profile_at(n, loop.timer)
            if not known:
                first = budget_of(profiles[n], budget)
                known.append(agree_min([first])[0] if agree else first)
            sizes.update()
    fit = ShapeFit(dict(sorted(profiles.items())))
    # Bytes do not depend on the timer: the checks count FLOPs, the cheapest steps.
    missed = fit.refine(
        lambda n: profile_at(n, "flops"), multiple=shapes.multiple, limit=shapes.checks
    )
    if missed and not quiet:
        log.warning(
            "remat.auto_checkpoint: the shape fit missed %d byte terms (%s%s); sizes between "
            "knots %s where it was not found exact are profiled when a batch of them first "
            "comes.",
            len(missed),
            "; ".join(missed[:3]),
            ", ..." if len(missed) > 3 else "",
            fit.knots,
        )
    target = budget_of(fit.profiles[largest], budget)
    if active(loop.distributed):
        (target,) = agree_min([target])
    return ShapePlans(model, example, shapes, fit, target, loop, source)
