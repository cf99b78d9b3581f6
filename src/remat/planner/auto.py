"""``remat.auto_checkpoint``: profile, plan, apply, then check real steps; ``measure_peak``."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, overload

import torch
from torch import nn

from .. import memory
from ..engine.bytes import fmt_bytes, storage_bytes
from ..engine.errors import PlanError
from ..engine.tree import tensors_in
from ..memory import BlockHooks
from ..modules.modelinfo import (
    candidates,
    check_grad_enabled,
    check_module,
    device_of,
)
from . import advice
from .apply import restore_state, snapshot_state
from .checks import check_options
from .compiled import allocator_peak
from .distributed import active, agree_max, agree_min, agree_profile, agree_same
from .inputs import Inputs, model_inputs
from .loop import Loop, Step
from .meta import check_not_mixed, is_meta
from .probes import WindowMarks
from .progress import Progress
from .regional import compiled_level, refuse_process_group
from .scratch import mark_window, profiled, window_scratch
from .shaped import ProfileSource
from .shapes import ShapePlans, Shapes, shape_plans
from .sharded import unsharded_storages
from .solve import Plan, Profile, plan
from .state import (
    check_step_options,
    grad_bytes,
    optimizer_tensors,
    static_bytes,
)
from .stepmodel import budget_of, located, share_note
from .types import Timer, Window, WindowKind

log = logging.getLogger("remat")


def step_peaks(
    model: nn.Module,
    *args: Any,
    optimizer: torch.optim.Optimizer | None = None,
    set_to_none: bool = True,
    steps: int = 2,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    **kwargs: Any,
) -> list[int]:
    """The peak of each of ``steps`` steps of the default loop, absolute bytes.

    The loop is the one :mod:`remat.planner.stepmodel` describes (gradients
    cleared as ``set_to_none`` says, forward, loss, backward,
    ``optimizer.step()``), from an empty optimizer state, so the first step
    creates it. Bytes are static (parameters, buffers, inputs), kept
    gradients and optimizer state at the step's start, plus the peak of what
    the step allocates (:func:`remat.memory.track`), on the model's device.
    Everything the steps change is put back afterwards (see
    :class:`~remat.planner.state.StepState`). ``args`` may be one :class:`remat.Inputs`.
    """
    args, kwargs = model_inputs(args, kwargs, "remat.measure_peak")
    check_module(model, "remat.measure_peak")
    check_grad_enabled("remat.measure_peak")
    check_options(
        "remat.measure_peak", optimizer=optimizer, set_to_none=set_to_none, loss_fn=loss_fn
    )
    # blocks compiled by a compiled plan: measured at the allocator (the tracker cannot see
    # compiled kernels)
    compiled = any(compiled_level(m) is not None for m in model.modules())
    loop = Loop(optimizer=optimizer, set_to_none=set_to_none, loss_fn=loss_fn, compile=compiled)
    return loop_peaks(model, Inputs(*args, **kwargs), loop, steps)[0]


def loop_peaks(
    model: nn.Module,
    inputs: Inputs,
    loop: Loop,
    steps: int,
    scratch_of: Sequence[str] | None = None,
    device: torch.device | None = None,
) -> tuple[list[int], dict[Window, int] | None]:
    """:func:`step_peaks` of the training ``loop`` (its options checked), and with
    ``scratch_of`` (the blocks' names in call order) the scratch inside operators of each
    window of the last step, which then also runs under ``torch.profiler``
    (:func:`~.measure.plan_scratch`'s record; the optimizer's step apart): one real step
    fewer than measuring it on its own. Without ``scratch_of`` the scratch is ``None``.
    ``device``: the model's, where the caller found it (and checked the inputs) already. With
    ``loop.compile`` each step's peak is the allocator's (:mod:`.compiled`), scratch inside
    kernels included, and no scratch is measured apart."""
    step = Step(model, inputs, loop, where="remat.measure_peak", device=device)
    state, optimizer, counted = step.state, loop.optimizer, step.counted
    peaks: list[int] = []
    found: dict[Window, int] | None = None
    try:
        state.fresh_optimizer_state()
        storages = unsharded_storages(model)  # FSDP2: every rank (a collective)
        if not loop.set_to_none:  # the gradients exist before the step, as in the user's loop
            step.begin()
            step.run()
        for _ in range(steps):
            step.clear_grads()
            base = (
                static_bytes(model, (inputs.args, inputs.kwargs), counted)
                + grad_bytes(state.grad_params, counted)
                + storage_bytes(optimizer_tensors(optimizer), counted)
            )
            step.begin()
            if loop.compile:  # compiled kernels: the allocator's events (scratch included)
                events = profiled(lambda: step.run(optimizer_step=True))
                peaks.append(base + allocator_peak(events, step.device))
                continue
            with memory.track(counted) as tracker:
                tracker.watch(storages)
                if scratch_of is not None and len(peaks) == steps - 1:
                    modules = [model.get_submodule(n) for n in scratch_of]
                    with BlockHooks(modules, WindowMarks(len(modules))):
                        found = window_scratch(
                            lambda: step.run(optimizer_step=True, before_optimizer=_opt_window),
                            step.device,
                        )
                else:
                    step.run(optimizer_step=True)
            peaks.append(base + tracker.peak_bytes)
    finally:
        state.restore()
    return peaks, found


def _opt_window() -> None:
    """The optimizer's step is a window of its own: its scratch is not a block's."""
    mark_window(Window(WindowKind.OPT))


def measure_peak(
    model: nn.Module,
    *args: Any,
    optimizer: torch.optim.Optimizer | None = None,
    set_to_none: bool = True,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    **kwargs: Any,
) -> int:
    """Peak bytes of a training step of the default loop, in the units of a budget.

    The larger of the first step (the optimizer creates its state) and a
    later one; absolute bytes (parameters, buffers, inputs, gradients,
    optimizer state, activations) on the model's device (the device of the
    first tensor argument, else of the parameters; host buffers of offloading
    are not counted). The steps start from the current RNG state and leave
    everything as it was: parameters, gradients, optimizer state, buffers
    (BatchNorm running statistics), RNG. Inside a ``torch.autocast`` region each step
    is an iteration of torch's mixed-precision recipe (:mod:`remat.planner.amp`).

    Args:
        model: the model.
        *args: inputs, or one :class:`remat.Inputs` holding the model's positional and
            keyword inputs (for a model whose ``forward`` takes a keyword named like an
            option here).
        optimizer: the optimizer the loop steps (``None``: no optimizer step).
        set_to_none: gradients freed before each step (``zero_grad()``'s default)
            or kept and zeroed (``False``).
        loss_fn: output -> scalar loss; default: the output's ``loss`` (entry or attribute: a
            model that computes its own loss), else the sum of its floating outputs.
        **kwargs: keyword inputs of the model.

    Example:
        >>> import torch, remat
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        >>> x = torch.randn(4, 8)
        >>> remat.measure_peak(model, x) >= 4 * (8 * 8 + 8) + 4 * 4 * 8   # parameters, input
        True
    """
    args, kwargs = model_inputs(args, kwargs, "remat.measure_peak")
    return max(
        step_peaks(
            model,
            Inputs(*args, **kwargs),
            optimizer=optimizer,
            set_to_none=set_to_none,
            steps=2 if optimizer is not None else 1,
            loss_fn=loss_fn,
        )
    )


def _peak(model: nn.Module, inputs: Inputs, loop: Loop, device: torch.device | None = None) -> int:
    """:func:`measure_peak`'s steps of the training ``loop`` (the model, inputs and options
    checked by the caller; ``device``: the model's, found by it), at the allocator where the
    blocks are compiled. Looked up when called: a test may replace it."""
    compiled = loop.compile or any(compiled_level(m) is not None for m in model.modules())
    steps = 2 if loop.optimizer is not None else 1
    peaks, _ = loop_peaks(model, inputs, dataclasses.replace(loop, compile=compiled), steps,
                          device=device)  # fmt: skip
    return max(peaks)


def _peak_and_scratch(
    model: nn.Module,
    inputs: Inputs,
    loop: Loop,
    names: Sequence[str],
    device: torch.device | None = None,
    *,
    agree: bool = False,
) -> tuple[int, dict[Window, int] | None]:
    """:func:`measure_peak`'s two steps, the second also under the profiler: the peak and
    the scratch inside operators of each window (blocks ``names`` in call order; ``device``:
    the model's, found by the caller). ``agree``: under a process group, each window's
    scratch is the largest over the ranks (ranks that planned again from their own scratch
    could choose different plans and hang in their next collective)."""
    peaks, found = loop_peaks(model, inputs, loop, 2, scratch_of=names, device=device)
    if agree and found is not None:
        keys = sorted(found, key=str)
        agree_same([str(k) for k in keys], "the windows of the plan's scratch")
        found = dict(zip(keys, agree_max([found[k] for k in keys])))
    return max(peaks), found


def check_profile_matches(
    prof: Profile,
    model: nn.Module,
    inputs: Inputs,
    loop: Loop,
    *,
    blocks: Sequence[str] | None = None,
) -> None:
    """Raise ``ValueError`` unless ``prof`` was measured for this model, inputs and ``loop``
    (``blocks``: the model's candidate blocks, where the caller found them already).

    Example:
        >>> import torch, remat
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        >>> prof = remat.profile(model, torch.randn(2, 4), timer="flops")
        >>> from remat.planner.loop import Loop
        >>> check_profile_matches(prof, model, remat.Inputs(torch.randn(2, 4)), Loop())
        >>> check_profile_matches(prof, model, remat.Inputs(torch.randn(3, 4)), Loop())
        Traceback (most recent call last):
        ...
        ValueError: remat.auto_checkpoint: profile= was measured for inputs of shapes [[2, 4]], not [[3, 4]]; profile this model with these inputs (or pass profile=None).
    """
    if not isinstance(prof, Profile):
        raise TypeError(
            f"remat.auto_checkpoint: profile= must be a remat.Profile (from remat.profile), "
            f"got {type(prof).__name__}."
        )
    optimizer, set_to_none = loop.optimizer, loop.set_to_none
    names = [b.name for b in prof.blocks]
    want = list(candidates(model, loop.check_fn) if blocks is None else blocks)
    problems = []
    if names != want:
        problems.append(f"blocks {names}, not this model's candidate blocks {want}")
    found: list[torch.Tensor] = []
    tensors_in((inputs.args, inputs.kwargs), found)
    shapes = [list(t.shape) for t in found]
    if shapes != prof.input_shapes:
        problems.append(f"inputs of shapes {prof.input_shapes}, not {shapes}")
    opt = type(optimizer).__name__ if optimizer is not None else None
    if opt != prof.optim.name:
        problems.append(f"optimizer={prof.optim.name}, not {opt}")
    if prof.grads_kept == set_to_none:
        problems.append(f"set_to_none={not prof.grads_kept}, not {set_to_none}")
    if problems:
        raise ValueError(
            "remat.auto_checkpoint: profile= was measured for "
            + "; ".join(problems)
            + "; profile this model with these inputs (or pass profile=None)."
        )


@overload
def auto_checkpoint(
    model: nn.Module,
    *args: Any,
    budget: int | float | str,
    optimizer: torch.optim.Optimizer | None = None,
    set_to_none: bool = True,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    check_fn: Callable[[str, nn.Module], bool] | None = None,
    timer: Timer = "time",
    quiet: bool = False,
    profile: Profile | None = None,
    distributed: bool | None = None,
    diagnose: bool = False,
    shapes: None = None,
    compile: bool = False,
    **kwargs: Any,
) -> Plan: ...


@overload
def auto_checkpoint(
    model: nn.Module,
    *args: Any,
    budget: int | float | str,
    optimizer: torch.optim.Optimizer | None = None,
    set_to_none: bool = True,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    check_fn: Callable[[str, nn.Module], bool] | None = None,
    timer: Timer = "time",
    quiet: bool = False,
    profile: Profile | None = None,
    distributed: bool | None = None,
    shapes: Shapes,
    compile: bool = False,
    **kwargs: Any,
) -> ShapePlans: ...


def auto_checkpoint(
    model: nn.Module,
    *args: Any,
    budget: int | float | str,
    optimizer: torch.optim.Optimizer | None = None,
    set_to_none: bool = True,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    check_fn: Callable[[str, nn.Module], bool] | None = None,
    timer: Timer = "time",
    quiet: bool = False,
    profile: Profile | None = None,
    distributed: bool | None = None,
    diagnose: bool = False,
    shapes: Shapes | None = None,
    device: str | torch.device | None = None,
    compile: bool = False,
    **kwargs: Any,
) -> Plan | ShapePlans:
    """Profile, plan for ``budget``, apply in place, and check real steps.

    The profile is made from shapes (:mod:`remat.planner.meta`): a meta copy of the
    model, its inputs and optimizer runs the profile's steps without allocating, so a model
    whose unchecked step does not fit is planned all the same, in seconds. The real steps
    that follow run the *planned* model, whose predicted peak is within the budget: the
    two steps :func:`measure_peak` measures, the second also under ``torch.profiler`` for the
    scratch inside operators (which only the device shows), after which the plan is made again with
    that scratch where it happens. Inside ``torch.autocast`` (which never casts meta tensors)
    the copy is a fake one (:mod:`remat.planner.fake`: fake tensors of the model's device, no
    bytes either). Where shapes alone cannot profile the model (shapes that depend on values,
    as a mixture of experts' routing; a model sharded by FSDP2 or wrapped in DDP;
    ``timer="measured"``; CPU's recurrent kernels, ``nn.LSTM``/``nn.GRU``, under autocast)
    the model is profiled in real steps (this is said) at two smaller batches (dimension 0
    of the inputs, 4 or more) and the whole batch's profile fitted from them
    (:func:`remat.planner.shaped.batch_pairs`), so that no step holds the unchecked step's
    bytes: first at batches 2 and 4 (2 and 3 for a batch under 8) in pair steps (below),
    then at the largest halvings of the batch (up to a quarter and a half) whose unchecked
    steps that first fit predicts within the budget, which the fit is made from. So no
    profiling step holds an unchecked step over the budget. A batch under 4 is profiled at the whole
    batch from pair steps (:mod:`remat.planner.grouped`: two blocks under each decision at a
    time, the others recomputed), never the unchecked step, unless tensors handed to
    several blocks meet an autocast region that ends before backward (then as
    :func:`remat.profile` does, which runs it; said).
    A model on the meta device is planned and the plan applied, with no real step.
    Each stage is said on standard error unless ``quiet``.

    After applying, the first and a later step are measured
    (:func:`measure_peak`), plus the scratch inside operators the plan's peak has
    (``Plan.scratch_bytes``: the allocator counts it, the tensors do not). If that
    is over the budget (the model is a prediction), the plan is made again with the
    budget lowered by the overshoot, up to three times, and this is logged (logger
    ``"remat"``) unless ``quiet``. If it still misses, the blocks are put back as they were
    and :class:`~remat.PlanError` is raised: a plan known to be over budget is
    never returned. A span the model refuses when it runs (a block's output kept
    past the next block in a way the profile's forward without gradients did not show,
    ``Profile.kept_outputs``) is logged and the plan made again without spans; whatever
    fails, the model is left as it was.

    For a mixed-precision loop, call it inside the loop's ``torch.autocast`` region: the
    steps it measures are then iterations of torch's recipe (:mod:`remat.planner.amp`).

    Args:
        model: changed in place.
        *args: example inputs, or one :class:`remat.Inputs` holding the model's positional
            and keyword inputs: for a model whose ``forward`` takes a keyword named like an
            option of this function (``timer``, ``profile``, ``budget``, ...), pass
            ``auto_checkpoint(model, remat.Inputs(x, timer=t), budget=...)``.
        budget: as in :func:`remat.plan`: the step's peak in bytes (``2**30``,
            ``"18GiB"``, ``"50B"``) or ``"60%"`` of what the unchecked step allocates above
            its static bytes (a percentage no plan reaches: ``PlanError`` names the
            smallest reachable one). A bare number string (``"50"``) is refused, naming
            both readings. Its form is checked before any step, with every other option.
        optimizer: the optimizer of the training loop (its state and step are
            part of the peak); ``None`` models no optimizer step.
        set_to_none: how the loop clears gradients (see :func:`remat.profile`).
        loss_fn: output -> scalar loss; default: the output's ``loss`` (entry or attribute: a
            model that computes its own loss), else the sum of its floating outputs.
        check_fn: picks the candidate blocks (default: the repeated blocks).
        timer: ``"time"``, ``"measured"`` or ``"flops"`` (see :func:`remat.profile`).
        quiet: print nothing: no stage lines, no progress bar (a ``tqdm`` bar counts each
            profile's steps), no re-planning warnings.
        profile: a :class:`~remat.Profile` of this model measured before (by
            :func:`remat.profile` with the same inputs, optimizer, ``set_to_none``
            and ``check_fn``), to plan several budgets without profiling again;
            ``timer`` is then unused. ``None``: profile now.
        distributed: ``None`` (default): under a ``torch.distributed`` process group
            of two or more ranks (DDP, FSDP2), every rank calls ``auto_checkpoint``
            and all of them apply the same plan: the profile is agreed (see
            :func:`remat.profile`), the budget in bytes is the smallest any rank
            asked for, and each measured peak is the largest over the ranks, so
            every rank re-plans (or gives up) together. The budget is one rank's
            step peak. ``False``: this rank alone.
        diagnose: also run every boundary diagnostic of :func:`remat.explain` on one
            instrumented step of the planned model (two more steps: a plain one and a
            probed one, which runs slower), and add what they find to
            ``Plan.diagnostics``. Without it the plan carries the warnings the planner
            knows without a step (:mod:`remat.planner.advice`: blocks checkpointed
            already, a peak in the loss head).

        shapes: for batches whose shape varies (variable-length sequences, multi-scale
            images): a :class:`remat.Shapes` naming the dimension that varies; the example
            inputs are then the largest batch. The model is profiled at a few sizes, the
            step model fitted in the size, and before each forward the plan for the batch's
            size is switched in: the fastest one within ``budget`` at that size (the budget
            is that of the largest batch's step). A larger batch raises ``PlanError``. See
            :mod:`remat.planner.shapes`; ``profile`` is then unused.
        device: for a model on the meta device: the device it will train on (see
            :func:`remat.profile`); ``None``: CPU.
        compile: compiled plans: each candidate block compiled on its own
            (``torch.compile``), the plan choosing per block the partitioner's activation
            budget (``keep`` 1.0, ``selective`` 0.5, ``recompute`` 0.0) for the byte budget of
            the whole step; see :func:`remat.profile`'s ``compile`` and
            :mod:`remat.planner.regional`. The profile runs real steps of the compiled
            blocks (each level compiled once per block class and shapes: the first call
            takes the compile time), timed; the checked steps are measured at the allocator
            (kernels' scratch included). The plan leaves the blocks compiled; the rest of the
            model is not compiled. Not with ``shapes`` or on the meta device yet.
        **kwargs: keyword inputs of the model.

    Returns:
        The applied :class:`Plan` (its ``predicted_peak_bytes`` is the model's
        prediction; the measured peak plus ``scratch_bytes`` is within ``budget_bytes``).
        With ``shapes``: the :class:`~remat.planner.shapes.ShapePlans`, installed (its
        ``remove()`` puts the model back).

    Raises:
        PlanError: no plan reaches the budget, or the measured peak stays over it.

    Example:
        >>> import torch, remat
        >>> def block():
        ...     return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
        >>> model = torch.nn.Sequential(*[block() for _ in range(4)])
        >>> opt = torch.optim.AdamW(model.parameters())
        >>> x = torch.randn(64, 32)
        >>> p = remat.auto_checkpoint(model, x, budget="80%", optimizer=opt, timer="flops")
        >>> remat.measure_peak(model, x, optimizer=opt) <= p.budget_bytes
        True
    """
    args, kwargs = model_inputs(args, kwargs, "remat.auto_checkpoint")
    check_module(model, "remat.auto_checkpoint")
    check_grad_enabled("remat.auto_checkpoint")
    # every option before any step (and before any twin of the model is made)
    check_options(
        "remat.auto_checkpoint", budget=budget, optimizer=optimizer, set_to_none=set_to_none,
        loss_fn=loss_fn, check_fn=check_fn, timer=timer, distributed=distributed, quiet=quiet,
        diagnose=diagnose, shapes=shapes, device=device,
    )  # fmt: skip
    check_not_mixed(model, (args, kwargs), "remat.auto_checkpoint")
    # the model's device: found once, passed to the steps that check the plan
    model_device = device_of(model, (args, kwargs))
    if profile is not None and not isinstance(profile, Profile):
        raise TypeError(
            f"remat.auto_checkpoint: profile= must be a remat.Profile (from remat.profile), "
            f"got {type(profile).__name__}. Pass the profile of this model, or None to profile now."
        )
    if not isinstance(compile, bool):
        raise TypeError(f"remat.auto_checkpoint: compile must be True or False, got {compile!r}.")
    if compile and (shapes is not None or is_meta(model, (args, kwargs))):
        raise ValueError(
            "remat.auto_checkpoint: compile=True plans the compiled blocks of a real model at "
            "one batch shape: leave shapes= out, and build the model on its device."
        )
    loop = Loop(optimizer, set_to_none, loss_fn, check_fn, timer, distributed, compile)
    agree = active(distributed)
    if agree and compile:
        refuse_process_group("remat.auto_checkpoint")
    inputs = Inputs(*args, **kwargs)
    if shapes is not None:
        if diagnose:
            raise ValueError(
                "remat.auto_checkpoint: diagnose=True runs on one batch shape, got it with "
                "shapes=...: leave it out, and call remat.explain(model, batch) on a batch "
                "after planning to see its warnings."
            )
        return _auto_shapes(model, inputs, shapes, budget, loop, quiet)
    check_step_options("remat.auto_checkpoint", optimizer, set_to_none)
    say = Progress("remat.auto_checkpoint", quiet)
    meta = is_meta(model, (args, kwargs))
    if device is not None and not meta:
        raise ValueError(
            f"remat.auto_checkpoint: device={device!r} is for a model on the meta device; this "
            f"model's tensors are on {model_device}: leave device out."
        )
    if profile is None:
        source = ProfileSource(
            model, loop, agree=agree, device=device, say=say,
            within=lambda whole: budget_of(whole, budget),
        )
        prof = source(inputs)
        names = source.blocks
    else:
        names = candidates(model, check_fn)
        check_profile_matches(profile, model, inputs, loop, blocks=names)
        prof = agree_profile(profile) if agree else profile  # a no-op on an agreed profile
    target = budget_of(prof, budget)
    if agree:
        (target,) = agree_min([target])
    say(f"planning for {fmt_bytes(target)}")
    try:
        chosen = plan(prof, target)
    except PlanError as e:  # a share no plan reaches: say what is fixed, what is reachable
        note = share_note(prof, budget, prof.smallest_budget_bytes)
        raise PlanError(f"{e}{note}") from None
    blocks = {n: model.get_submodule(n) for n in names}
    if meta:  # nothing to run: the plan is the answer
        chosen.apply(model)
        chosen.budget_bytes = target
        chosen.diagnostics = advice.on_model(model, chosen, None, loss_fn)
        say.done(f"planned from shapes, predicted peak {fmt_bytes(chosen.predicted_peak_bytes)}")
        return chosen
    wrapping = snapshot_state(blocks)
    goal = target
    measured = 0
    spans = not prof.compiled  # spans of compiled blocks are not planned
    scratch_known = not prof.from_shapes
    for attempt in range(4):
        if agree:  # plan() is deterministic on the agreed profile; checked all the same
            agree_same((chosen.decisions, chosen.spans), "the plan's decisions")
        try:
            chosen.apply(model)
            say(f"checking the plan in real steps (predicted {fmt_bytes(chosen.predicted_peak_bytes)})")
            if scratch_known:
                measured = _peak(model, inputs, loop, model_device)
            else:  # the second checked step also under the profiler, for the scratch
                names = [b.name for b in prof.blocks]
                measured, where = _peak_and_scratch(
                    model, inputs, loop, names, model_device, agree=agree
                )
                prof = located(prof, where)
                scratch_known = True
                moved = budget_of(prof, budget) - target  # a share's scratch is now known
                if agree:
                    (moved,) = agree_max([moved])
                target, goal = target + moved, goal + moved
                again = plan(prof, max(goal, 1), spans=spans)
                if (again.decisions, again.spans) != (chosen.decisions, chosen.spans):
                    chosen = again  # the scratch moved the plan: check the new one
                    continue
                chosen = again
        except PlanError as e:
            if not chosen.spans:
                restore_state(blocks, wrapping)
                raise
            # The model refused a span the plan chose (a block's output kept past the next
            # block that Profile.kept_outputs did not show: held only through autograd).
            spans = False
            if not quiet:
                log.warning("remat.auto_checkpoint: %s Planning again without spans.", e)
            try:
                chosen = plan(prof, max(goal, 1), spans=False)
            except PlanError as again:
                restore_state(blocks, wrapping)
                raise PlanError(
                    f"remat.auto_checkpoint: the model refused the plan's span ({e}); without "
                    f"spans, {again} The model was left as it was."
                ) from None
            continue
        except BaseException:
            restore_state(blocks, wrapping)  # never a model left half planned
            raise
        if agree:  # every rank takes the same branch below
            (measured,) = agree_max([measured])
        # the scratch inside operators the plan's peak has: not in measure_peak, in the
        # allocator's (its window's, Plan.scratch_bytes)
        scratch = chosen.scratch_bytes
        if measured + scratch <= target:
            chosen.budget_bytes = target
            chosen.diagnostics = advice.on_model(
                model, chosen, (inputs.args, inputs.kwargs) if diagnose else None, loss_fn
            )
            off = measured - chosen.predicted_peak_bytes  # the tensors' bytes: exact, or said
            missed = f" ({fmt_bytes(abs(off))} {'above' if off > 0 else 'below'} the prediction)"
            say.done(f"planned, measured peak {fmt_bytes(measured + scratch)}{missed if off else ''}")
            return chosen
        if attempt == 3:
            break
        goal -= measured + scratch - target
        if not quiet:
            log.warning(
                "remat.auto_checkpoint: measured peak %d B (plus %d B scratch inside "
                "operators) is over the budget %d B; planning again for %d B.",
                measured,
                scratch,
                target,
                goal,
            )
        try:
            chosen = plan(prof, max(goal, 1), spans=spans)
        except PlanError:
            break
    restore_state(blocks, wrapping)
    scratch = chosen.scratch_bytes
    plus = f" + {scratch} scratch inside operators" if scratch else ""
    raise PlanError(
        f"remat.auto_checkpoint: the measured step peak {fmt_bytes(measured)} ({measured} bytes"
        f"{plus}) stays over the budget {fmt_bytes(target)} ({target} bytes) after re-planning "
        f"(predicted {fmt_bytes(chosen.predicted_peak_bytes)}); the model was left as it was. "
        "Raise the budget, use a smaller batch, or pick finer blocks (check_fn=...); if the "
        "prediction is far off, please report the model."
    )


def _auto_shapes(
    model: nn.Module,
    inputs: Inputs,
    shapes: Shapes,
    budget: int | float | str,
    loop: Loop,
    quiet: bool,
) -> ShapePlans:
    """``auto_checkpoint(shapes=...)``: the plans of :func:`~remat.planner.shapes.shape_plans`,
    installed, with real steps at each profiled size measured through the hook (as one plan's
    are): over the budget, every size is planned again below it by the largest overshoot.

    Profiled from shapes, the sizes' scratch inside operators is measured in one more real
    step of each size's plan (under the profiler), and every size planned again with it, as
    :func:`auto_checkpoint` does for one plan."""
    say = Progress("remat.auto_checkpoint", quiet)
    plans = shape_plans(model, inputs, shapes, budget, loop, quiet=quiet, say=say)
    agree = active(loop.distributed)
    target = plans.budget_bytes
    args = (inputs.args, inputs.kwargs)
    names = [b.name for b in plans.fit.profiles[plans.largest].blocks]
    unknown = set(plans.fit.sizes) if plans.fit.profiles[plans.largest].from_shapes else set()
    over = 0
    plans.install()
    try:
        for attempt in range(4):
            peaks = {}
            scratched = bool(unknown)
            for n in plans.fit.sizes:
                a, k = shapes.cut(args, plans.largest, n)
                at = Inputs(*a, **k)
                say(
                    f"checking the plan at size {n} in real steps (predicted "
                    f"{fmt_bytes(plans.plan_for(n).predicted_peak_bytes)})"
                )
                if n in unknown:  # the hook applied the plan at n: the scratch where it is
                    peaks[n], scratch = _peak_and_scratch(model, at, loop, names, agree=agree)
                    plans.fit.add_scratch(n, located(plans.fit.profiles[n], scratch))
                    unknown.discard(n)
                else:
                    peaks[n] = _peak(model, at, loop)
                if agree:
                    (peaks[n],) = agree_max([peaks[n]])
            if scratched:  # a share's scratch is known now: the budget and the plans move
                before = {n: _choice(plans.plan_for(n)) for n in plans.fit.sizes}
                moved = budget_of(plans.fit.profiles[plans.largest], budget) - target
                target += moved
                plans.replan(plans.goal + moved, budget_bytes=target)
                if any(_choice(plans.plan_for(n)) != before[n] for n in plans.fit.sizes):
                    continue  # the scratch moved a plan: check the new ones
            # the scratch the plan at each size adds at its own peak (Plan.scratch_bytes)
            over = max(peaks[n] + plans.plan_for(n).scratch_bytes - target for n in peaks)
            if over <= 0:
                say.done(f"planned {len(peaks)} sizes, each measured peak within the budget")
                return plans
            if attempt == 3:
                break
            if not quiet:
                log.warning(
                    "remat.auto_checkpoint: a measured peak is %d B over the budget %d B; "
                    "planning every size again for %d B.", over, target, plans.goal - over,
                )  # fmt: skip
            plans.replan(plans.goal - over)
    except PlanError as e:
        plans.remove()
        top = plans.fit.profiles[plans.largest]
        low = top.smallest_budget_bytes
        if low <= target:
            raise
        # a share no plan reaches at the largest size: what is fixed, what is reachable
        raise PlanError(f"{e}{share_note(top, budget, low)}") from None
    except BaseException:
        plans.remove()
        raise
    plans.remove()
    raise PlanError(
        f"remat.auto_checkpoint: with shapes=, a measured step peak stays {over} bytes over the "
        f"budget {fmt_bytes(target)} ({target} bytes) after re-planning; the model was left as "
        "it was. Raise the budget or pick finer blocks (check_fn=...)."
    )


def _choice(chosen: Plan) -> tuple[object, ...]:
    """What a plan does to the blocks (its decisions and spans)."""
    return tuple(chosen.decisions.items()), tuple(map(tuple, chosen.spans))
