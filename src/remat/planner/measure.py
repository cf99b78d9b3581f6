"""``remat.profile``: measure a training step and what each decision does to its blocks.

A few instrumented training steps of the default loop (see
:mod:`remat.planner.stepmodel`), all from the same RNG state, in a short pipeline:

1. one warm-up step (lazy modules, allocator and kernels warm up; :class:`~.probes.CallCount`
   checks that every candidate block runs once per forward, and records the order forward
   calls them in: the planner models a chain, in that order, whatever the module tree's);
2. one forward without gradients (:func:`~.probes.kept_outputs`) and, on a device,
   forwards that find which block inputs a span may offload (:func:`~.probes.offload_inputs`);
3. one step under ``torch.profiler`` for the scratch inside operators, per window of the
   step (:mod:`remat.planner.scratch`, :class:`~.probes.WindowMarks`);
4. per decision one memory step, every candidate block under that decision, whose bytes
   are read at the boundaries of contiguous windows (:class:`~.probes.TimelineProbe`)
   (``paired``: the lines of ``keep``, ``selective`` and ``split`` assembled from steps
   holding two blocks under the decision at a time, :mod:`.grouped`, with no scratch step
   and the warm-up recomputing every block);
   gradients start as ``None`` (or kept, with ``set_to_none=False``), as in the user's
   step; with ``timer="measured"`` then ``repeats`` timed steps (not tracked: the
   tracker's per-op work would inflate the time); with ``timer="time"`` (the default) and
   ``timer="flops"`` the blocks' work is counted instead (:mod:`.counting`: one forward
   without gradients, then each block alone) and priced with the device's calibration
   (:mod:`.calibration`; ``"time"``) or left in FLOPs;
5. with an ``optimizer``: two ``optimizer.step()`` calls from an empty state, tracked (the
   first creates the state), after which the parameters, the optimizer's state and
   hyper-parameters are put back.

It records one raw :class:`~remat.planner.types.Measurements`, nothing derived; every term
of the profile (the blocks', the head's ``pre``, ``top`` and ``post``, the step's cost, where
the scratch is) is read from it by :func:`remat.planner.stepmodel.profile_data`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .. import memory
from ..engine.bytes import storage_bytes
from ..engine.offload import moves_to_host
from ..engine.tree import tensors_in
from ..memory import BlockHooks
from ..modules.modelinfo import (
    candidates,
    check_grad_enabled,
    check_module,
    device_of,
)
from ..modules.split import can_split
from .amp import outside
from .apply import apply_decision, restore_state, snapshot_state
from .calibration import make_clock
from .checks import TIMERS, check_options
from .compiled import AllocatorTimeline, whole_step_costs
from .distributed import active, agree_max, agree_profile, agree_same
from .fake import fake_mode_of, fake_steps
from .grouped import (
    PAIRED,
    KeptShared,
    NotPaired,
    PairStep,
    assemble,
    pair_patterns,
    single_steps,
    step_of,
)
from .inputs import Inputs, model_inputs
from .loop import Loop, Step
from .meta import (
    NoAutocast,
    check_no_autocast,
    check_not_mixed,
    is_meta,
    shapes_only,
    target_device,
)
from .probes import (
    CallCount,
    InputFrees,
    SharedArgs,
    TimelineProbe,
    WindowMarks,
    keep_lifetimes,
    kept_outputs,
    offload_inputs,
)
from .progress import bar
from .regional import LEVELS, check_compiled_decisions, refuse_process_group
from .scratch import profiled, window_scratch
from .sharded import is_ddp, is_sharded, reshard, unsharded_storages
from .solve import Profile
from .state import (
    StepState,
    check_step_options,
    grad_bytes,
    optimizer_tensors,
    static_bytes,
)
from .stepmodel import HELD_LINES, profile_data
from .timing import flop_costs, modelled_costs, time_blocks
from .types import (
    KEEP,
    OFFLOAD,
    RECOMPUTE,
    SELECTIVE,
    SPLIT,
    Decision,
    Measurements,
    SharedInput,
    Timeline,
    Timer,
    Window,
)


def profile(
    model: nn.Module,
    *args: Any,
    optimizer: torch.optim.Optimizer | None = None,
    set_to_none: bool = True,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    check_fn: Callable[[str, nn.Module], bool] | None = None,
    decisions: Sequence[str] | None = None,
    timer: Timer = "time",
    repeats: int = 3,
    threads: int | None = 1,
    distributed: bool | None = None,
    device: str | torch.device | None = None,
    calibration: str | None = None,
    compile: bool = False,
    paired: bool = False,
    **kwargs: Any,
) -> Profile:
    """Measure a training step and each candidate block under each decision.

    Runs ``2 + len(decisions)`` training steps (forward, loss, backward;
    ``2 + len(decisions) * (1 + repeats)`` with ``timer="measured"``), plus two
    ``optimizer.step()`` calls when an optimizer is given. One of the steps runs
    under ``torch.profiler`` to measure the scratch memory inside operators
    (``Profile.scratch``). Everything they
    change is put back: parameter values, gradients (of parameters and inputs:
    the very tensors, untouched), optimizer state and hyper-parameters,
    buffers (BatchNorm running statistics), the RNG, and the blocks' wrapping.

    Called inside a ``torch.autocast`` region, the steps are iterations of torch's
    mixed-precision recipe: forward and loss in the region, backward and the optimizer
    step after its end (:mod:`remat.planner.amp`).

    Args:
        model: the model.
        *args: example inputs (the profile is valid for their shapes), or one
            :class:`remat.Inputs` holding the model's positional and keyword inputs (for a
            model whose ``forward`` takes a keyword named like an option here).
        optimizer: the optimizer of the training loop; its state and the
            peak inside ``step()`` (first and later steps) are part of the
            step's peak. ``None``: no optimizer step is modelled.
        set_to_none: how the loop clears gradients: ``True`` (PyTorch's default,
            ``zero_grad()``) frees them, so backward creates them while
            activations are alive; ``False`` (``zero_grad(set_to_none=False)``, or
            gradient accumulation) keeps them allocated for the whole step.
        loss_fn: output -> scalar loss; default: the output's ``loss`` (entry or attribute: a
            model that computes its own loss), else the sum of its floating outputs.
        check_fn: ``check_fn(name, module)`` picks the candidate blocks;
            default: the repeated blocks of every stack (:mod:`remat.modules.blocks`). The
            profile takes them in the order the warm-up step's forward first calls them.
        decisions: what to measure; default ``keep``, ``recompute``,
            ``selective``, ``offload`` on a device, and ``split`` (the block
            checkpointed with each of its children nested inside, below the
            every-block floor) when a block has two or more children with parameters.
            A block that changes one of its input tensors in place
            (``nn.ReLU(inplace=True)`` as a block of an ``nn.Sequential``) can only be
            kept: a checkpoint keeps its input for the recompute, which the block
            changes (and keeping it costs what keeping the block does).
        timer: the cost measure. ``"time"`` (default; seconds): every operator each
            decision runs again is counted (FLOPs, bytes moved, one call), and the
            counts are priced by constants timed once per device, dtype and thread
            count and cached on disk (:mod:`remat.planner.calibration`): the same
            model, inputs and budget give the same plan in every process that reads
            the calibration, however busy the machine. ``"measured"`` (seconds):
            each block timed in ``repeats`` steps per decision, the median its cost,
            half the range its noise (near-ties within it go to the simpler plan);
            closest to the machine as it is now, but plans may differ from run to run
            where two decisions cost about the same. ``"flops"``: recomputed FLOPs,
            what ``torch.utils.flop_counter`` counts (matmuls, convolutions,
            attention): recomputing norms and activations counts as free, so
            ``selective`` costs 0 under this timer; for tests and cross-machine
            comparisons.
        repeats: with ``timer="measured"``: timed steps per decision.
        threads: CPU only: ``1`` (default) times (the calibration, or the blocks with
            ``timer="measured"``) with one thread and thread CPU time, the steadiest
            numbers; another number sets torch's threads and ``None`` keeps them, both
            with wall time, closer to a multi-threaded training run (a calibration is
            kept per thread count).
        distributed: ``None`` (default): when a ``torch.distributed`` process group of
            two or more ranks is initialized, every rank of it must call ``profile``
            with the same model and inputs of the same shapes; the ranks run the
            same steps in lockstep, check that they profile the same blocks and
            decisions, and return the same profile, each number the largest over
            the ranks (see :mod:`remat.planner.distributed`), so that
            :func:`remat.plan` chooses one plan for all of them. ``False``: this
            rank alone (a model that is not data-parallel). Bytes are one rank's
            (FSDP2's shards and unsharded parameters, DDP's buckets: see
            :mod:`remat.planner.sharded`).
        device: for a model (and inputs) on the meta device only: the device it will train
            on, ``"cpu"`` (default) or ``"cuda"``. A meta model is profiled from its shapes
            alone (:mod:`remat.planner.meta`): the same steps on meta tensors, every
            storage counted at its size, nothing allocated, in seconds; the byte terms are
            those of a profile on that device, but for the scratch inside operators, which
            only a real device shows (not counted: ``Profile.from_shapes``), and ``offload``,
            which is not measured. Its costs are priced with ``device``'s calibration.
        calibration: with ``timer="time"``: whose constants price the counted work:
            ``None`` (default) the device's own, measured once and cached; or a device's
            name (``"NVIDIA H200"``) or a file saved by
            :func:`remat.planner.calibration.save`, to price a plan for a device this
            machine does not have (``benchmarks/gpu_check.py`` saves the GPU's).
        compile: each candidate block compiled on its own (``torch.compile``, regional
            compilation: :mod:`remat.planner.regional`), a decision the partitioner's
            activation budget for it: ``keep`` 1.0, ``selective`` 0.5, ``recompute`` 0.0 (the
            default decisions; ``offload`` and ``split`` are not planned, nor spans). Each
            level is compiled in a warm-up step of its own (once per block class and
            shapes), then its step measured at the allocator
            (:mod:`remat.planner.compiled`: the tracker cannot see compiled kernels), so
            every byte term is the allocator's, kernels' scratch included. Compiled
            recompute is fused into backward and not counted work: costs are timed
            (``timer="measured"``; ``"time"``, the default, is taken as it, ``"flops"``
            is refused). Not from shapes (a model on the meta device) and not inside
            ``torch.autocast``.
        paired: a real model whose unchecked step does not fit: no step holds every block
            kept. The lines of ``keep``, ``selective`` and ``split`` are assembled from
            *pair steps*, each with two blocks under the decision and the others recomputed
            (:mod:`remat.planner.grouped`; ``len(blocks) - 1`` steps a decision): the same
            byte terms as the uniform steps, no scratch inside operators measured
            (``Profile.from_shapes``: ``auto_checkpoint`` measures it under the plan). A
            model they cannot profile raises ``ValueError`` with the reason.
            ``auto_checkpoint`` chooses this itself where shapes cannot profile a model.
        **kwargs: keyword inputs of the model.

    Example:
        >>> import torch, remat
        >>> with torch.device("meta"):  # from shapes: no bytes allocated, none needed
        ...     big = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(4)])
        >>> prof = remat.profile(big, torch.empty(8192, 4096, device="meta"), timer="flops")
        >>> prof.from_shapes, prof.static_bytes // 2**20  # 4 x 64 MiB of weights, a 128 MiB input
        (True, 384)
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> prof = remat.profile(model, torch.randn(8, 16), optimizer=opt, timer="flops")
        >>> [b.name for b in prof.blocks], prof.optim.state_bytes  # one momentum buffer a parameter
        (['0', '1', '2'], 3264)
    """
    args, kwargs = model_inputs(args, kwargs, "remat.profile")
    check_options(
        "remat.profile", optimizer=optimizer, set_to_none=set_to_none, loss_fn=loss_fn,
        check_fn=check_fn, timer=timer, distributed=distributed, device=device,
        repeats=repeats, threads=threads, calibration=calibration,
    )  # fmt: skip
    if not isinstance(compile, bool):
        raise TypeError(f"remat.profile: compile must be True or False, got {compile!r}.")
    if not isinstance(paired, bool):
        raise TypeError(f"remat.profile: paired must be True or False, got {paired!r}.")
    loop = Loop(optimizer, set_to_none, loss_fn, check_fn, timer, distributed, compile)
    check_module(model, "remat.profile")
    if paired and (compile or is_meta(model, (args, kwargs))):
        what = "compile=True" if compile else "a model on the meta device (profiled from shapes)"
        raise ValueError(
            f"remat.profile: paired=True is for a real model's eager steps, got {what}: "
            "leave paired out."
        )
    try:
        return profile_loop(
            model, Inputs(*args, **kwargs), loop, decisions=decisions, repeats=repeats,
            threads=threads, device=device, calibration=calibration, paired=paired,
        )  # fmt: skip
    except NotPaired as e:
        raise ValueError(
            f"remat.profile: paired=True: pair steps cannot profile this model ({e}); leave "
            "paired out to profile it in uniform steps (its unchecked step among them)."
        ) from None


def profile_loop(
    model: nn.Module,
    inputs: Inputs,
    loop: Loop,
    *,
    decisions: Sequence[str] | None = None,
    repeats: int = 3,
    threads: int | None = 1,
    device: str | torch.device | None = None,
    calibration: str | None = None,
    blocks: Sequence[str] | None = None,
    paired: bool = False,
) -> Profile:
    """:func:`profile` of ``model`` (an ``nn.Module``: its caller checked) at ``inputs`` for
    the training ``loop`` (the other arguments as :func:`profile` takes them); ``blocks``: the
    candidate blocks' names where the caller found them already (they are looked up once a
    model: :class:`~remat.planner.shaped.ProfileSource`), else found here. ``paired`` (a
    real model): no step holds every block kept (:mod:`.grouped`), and no scratch is
    measured (the profile counts none: ``from_shapes``, measured under the plan)."""
    args, kwargs = inputs.args, inputs.kwargs
    timer = loop.timer
    check_grad_enabled("remat.profile")
    if timer not in TIMERS:
        raise ValueError(
            f"remat.profile: timer must be one of {list(TIMERS)}, got {timer!r}."
        )
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"remat.profile: repeats must be an int >= 1, got {repeats!r}.")
    check_step_options("remat.profile", loop.optimizer, loop.set_to_none)
    check_not_mixed(model, (args, kwargs), "remat.profile")
    found = device_of(model, (args, kwargs))  # the model's device: found once, passed on
    if loop.compile:
        loop = _compiled_loop(model, (args, kwargs), loop)
    fake = fake_mode_of(model, (args, kwargs))
    shaped = fake is not None or is_meta(model, (args, kwargs))
    if fake is not None:  # a fake twin: the device its tensors report
        if device is not None:
            raise ValueError(
                f"remat.profile: device={device!r} is for a model on the meta device; this "
                "model's tensors are fake tensors of a device: leave device out."
            )
        target: torch.device | None = found
    elif shaped:
        target = target_device(device, "remat.profile")
        check_no_autocast("remat.profile")
    else:
        target = None
    if shaped:
        if timer == "measured":
            raise ValueError(
                "remat.profile: timer='measured' times real steps, and a model on the meta "
                "device has none: use timer='time' (counted work priced by a calibration) "
                "or 'flops'."
            )
    elif device is not None:
        raise ValueError(
            f"remat.profile: device={device!r} is for a model on the meta device (the device "
            "it will train on); this model's tensors are on "
            f"{found}: leave device out."
        )
    names = list(blocks) if blocks is not None else candidates(model, loop.check_fn)
    modules = {n: model.get_submodule(n) for n in names}
    if loop.compile:
        chosen = [Decision(d) for d in (decisions or list(LEVELS))]
        check_compiled_decisions(chosen, "remat.profile")
        if Decision.KEEP not in chosen:
            raise ValueError(
                f"remat.profile: decisions must include 'keep', got {list(decisions or [])}."
            )
    else:
        chosen = _decisions(model, args, kwargs, modules, decisions, shaped)
    agree = active(loop.distributed)
    if agree and loop.compile:
        refuse_process_group("remat.profile")
    if agree:  # before any step: ranks that would run different steps would hang
        agree_same((names, [str(d) for d in chosen], repeats, timer), "the blocks, decisions and steps")
    try:
        if fake is not None:
            mode: Any = fake_steps(fake)
        elif target is not None:  # a meta model: autocast turned on inside it is refused
            mode = NoAutocast(target.type, "remat.profile")
        else:
            mode = contextlib.nullcontext()
        with mode, shapes_only(target, "position_ids" not in inputs.kwargs):
            prof = _profile(model, inputs, loop, modules, chosen, repeats, threads, calibration,
                            target, found, paired and not shaped)  # fmt: skip
    except (RuntimeError, NotImplementedError) as e:
        if not shaped:
            raise
        raise RuntimeError(
            "remat.profile: this model cannot be profiled from shapes alone (on the meta "
            f"device): {str(e).splitlines()[0]}. Its code reads tensor values (a mixture of "
            "experts' routing, a mask checked with .item() or .all()) or runs an operator "
            "without a meta kernel: profile it on its device (remat.auto_checkpoint does so "
            "by itself for a real model)."
        ) from e
    return agree_profile(prof) if agree else prof


def _compiled_loop(model: nn.Module, args: Any, loop: Loop) -> Loop:
    """``loop`` for a compiled profile, its options checked: timed costs."""
    if is_meta(model, args) or fake_mode_of(model, args) is not None:
        raise ValueError(
            "remat.profile: compile=True measures compiled kernels on the device, and a model "
            "on the meta device (or of fake tensors) runs none: profile the real model."
        )
    if any(torch.is_autocast_enabled(t) for t in ("cpu", "cuda")):
        raise ValueError(
            "remat.profile: compile=True is not planned inside torch.autocast yet: profile "
            "outside the region, or without compile=True."
        )
    if loop.timer == "flops":
        raise ValueError(
            "remat.profile: compile=True with timer='flops': compiled recompute is fused into "
            "backward, not counted work; use timer='measured' (or leave timer out)."
        )
    return dataclasses.replace(loop, timer="measured")


def _profile(
    model: nn.Module,
    inputs: Inputs,
    loop: Loop,
    blocks: dict[str, nn.Module],
    chosen: list[Decision],
    repeats: int,
    threads: int | None,
    calibration: str | None,
    target: torch.device | None,
    device: torch.device | None = None,
    paired: bool = False,
) -> Profile:
    """The steps of :func:`profile` and its record (``target``: from shapes, for it;
    ``device``: the model's, found by the caller; ``paired``: see :func:`profile_loop`)."""
    step = Step(model, inputs, loop, threads=threads, target=target, device=device)
    wrapping = snapshot_state(blocks)
    try:
        m = _measure(step, blocks, chosen, repeats, calibration, paired)
    finally:
        restore_state(blocks, wrapping)
        step.state.restore()
        reshard(model)  # the step's start: FSDP2's parameters sharded
    # the static bytes as a step starts: FSDP2's parameters sharded again (without
    # reshard_after_forward the steps leave them gathered)
    m.static_bytes = static_bytes(model, (step.args, step.kwargs), step.counted)
    if paired:
        m.from_shapes = True  # no scratch measured: under the plan, as for one from shapes
    return profile_data(m, Profile)


def plan_scratch(
    model: nn.Module, inputs: Inputs, names: Sequence[str], loop: Loop
) -> dict[Window, int] | None:
    """The scratch inside operators of each window of one real step of ``model`` as it is
    (a plan applied: the step holds what the plan's peak does, not the unchecked step's),
    blocks ``names`` in call order; everything the step changes is put back.

    A recomputed block's forward runs in its backward window and is counted there, so
    the window's scratch bounds what any decision of the block runs there."""
    step = Step(model, inputs, loop)
    modules = [model.get_submodule(n) for n in names]
    try:
        step.clear_grads()
        with BlockHooks(modules, WindowMarks(len(modules))):
            return window_scratch(step, step.device)
    finally:
        step.state.restore()


def _decisions(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    blocks: dict[str, nn.Module],
    decisions: Sequence[str] | None,
    shaped: bool = False,
) -> list[Decision]:
    """The decisions to measure: the given ones, checked, or the default (``shaped``: a
    profile from shapes, which cannot measure ``offload``)."""
    moves = not shaped and _offloads(model, (args, kwargs))
    if decisions is None:
        out = [KEEP, RECOMPUTE, SELECTIVE] + ([OFFLOAD] if moves else [])
        if any(can_split(m) for m in blocks.values()):
            out.append(SPLIT)
        return out
    known = {d.value for d in Decision}
    if any(d not in known for d in decisions) or KEEP not in decisions:
        raise ValueError(
            f"remat.profile: decisions must include 'keep' and come from "
            f"{[d.value for d in Decision]}, got {list(decisions)}."
        )
    out = [Decision(d) for d in decisions]
    if OFFLOAD in out and shaped:
        raise ValueError(
            "remat.profile: 'offload' is not measured from shapes (a model on the meta "
            "device has no bytes to copy); drop it from decisions, or profile on the device."
        )
    if OFFLOAD in out and not moves:
        raise ValueError(
            "remat.profile: 'offload' needs a device (on CPU the tensors already live in host "
            "memory); drop it from decisions."
        )
    if SPLIT in out and not any(can_split(m) for m in blocks.values()):
        raise ValueError(
            "remat.profile: decision 'split' needs blocks with two or more children that have "
            "parameters (attention, MLP); none of the candidate blocks has. Drop it from "
            "decisions."
        )
    return out


def _measure(
    step: Step,
    blocks: dict[str, nn.Module],
    decisions: list[Decision],
    repeats: int,
    calibration: str | None = None,
    paired: bool = False,
) -> Measurements:
    """Steps 1-5 of the module docstring: their raw record, counted on a progress bar
    (:func:`~remat.planner.progress.bar`: the warm-up, the probes, the scratch step, one
    step per decision, the costs). ``paired``: the lines of the decisions that hold
    activations from pair steps (:mod:`.grouped`; no scratch step, no step with every block
    kept)."""
    n = len(blocks)
    steps = len(decisions)
    if paired and n >= 2:
        steps += sum(n - 2 for d in decisions if d in PAIRED)
    total = 3 + steps + (1 if step.target is None and not paired else 0)
    with bar(total, "profiling") as ticks:
        return _measure_steps(step, blocks, decisions, repeats, calibration, ticks.update, paired)


def _measure_steps(
    step: Step,
    blocks: dict[str, nn.Module],
    decisions: list[Decision],
    repeats: int,
    calibration: str | None,
    tick: Callable[[], object],
    paired: bool = False,
) -> Measurements:
    """:func:`_measure`'s steps; ``tick()`` after each."""
    model, names, modules = step.model, list(blocks), list(blocks.values())
    timer, optimizer = step.loop.timer, step.loop.optimizer
    compiled = step.loop.compile  # the allocator's bytes: no scratch step of its own
    n = len(names)
    calls = CallCount(names)
    if paired:  # the model's own wrapping may be the unchecked step: every block recomputed
        changing = _mutating(step, modules, names)  # but those that change their input in place
        for nm, mod in zip(names, modules):
            apply_decision(mod, KEEP if nm in changing else RECOMPUTE)
    with BlockHooks(modules, calls):
        step()  # warm-up; with set_to_none=False its gradients stay for every later step
    tick()
    calls.check()
    names = calls.in_call_order()  # the chain the step model plans: the order forward runs
    blocks = {nm: blocks[nm] for nm in names}
    modules = list(blocks.values())
    kept = kept_outputs(model, modules, step.args, step.kwargs, step.state)
    offload = [0] * n, [0] * n
    probed = OFFLOAD in decisions and n >= 2
    if probed:
        before = [d for d in (KEEP, SELECTIVE) if d in decisions]
        offload = offload_inputs(model, modules, step.args, step.kwargs, step.state, before)
    if is_ddp(model):  # DDP rebuilds its buckets in the second step: not in a measured one
        step()
        if paired:  # with static_graph, the third step still differs (where the scratch
            step()  # step runs in a profile of uniform steps)
    tick()
    # The scratch of each window with the blocks kept, whatever the model's own wrapping (put
    # back by the caller). After the offload probes the blocks stay as their last forward
    # left them (some checkpointed: their forward's scratch is then also counted in their
    # backward window, never low); unwrapping them there would change the steps a
    # simulated device's copy timing depends on.
    for nm, state in snapshot_state(blocks).items():
        if not probed and not paired and any(st for _, st in state):
            apply_decision(blocks[nm], KEEP)
    # From shapes no scratch is seen (Profile.from_shapes), and no step is run for it: the
    # warm-up's gradients are those the scratch step would leave (the same bytes).
    scratch: dict[Window, int] | None = {} if compiled else None
    if step.target is None and not compiled and not paired:
        step.clear_grads()
        with BlockHooks(modules, WindowMarks(n)):
            scratch = window_scratch(step, step.device)
        tick()
    storages = unsharded_storages(model)
    grads = grad_bytes(step.state.grad_params, step.counted)
    splittable = {nm for nm, mod in blocks.items() if can_split(mod)}
    lines: dict[Decision, Timeline] = {}
    times: dict[Decision, dict[str, float]] = {}
    noise: dict[Decision, dict[str, float]] = {}
    held: dict[Decision, list[int]] = {}
    freed = [0] * n
    head_freed: dict[Decision, int] = {}
    shared_inputs: dict[str, int] = {}
    opt_terms = (0, 0, 0)
    shared, keep_cost = 0, 0.0
    clock = make_clock(step.device, step.threads) if timer == "measured" else None
    line_times: dict[Decision, list[float]] = {}  # each timed step's time, per decision
    fixed = {i: KEEP for i, nm in enumerate(names) if nm in calls.mutating}
    # from pair steps: the lines of the decisions that hold activations, once recompute's
    # (their step times are read against its) is measured
    paired_lines = [d for d in decisions if paired and n >= 2 and d in PAIRED]
    single = False  # single steps (one block under the decision) where the model allows
    lifetimes: SharedArgs | None = None
    # inside the loop's autocast region blocks save casts of what they receive and the pair
    # effects differ (tests); FSDP2's parameters stay gathered after a forward without
    # backward (no reshard after forward): pair steps there, no recording forward first
    amp = any(torch.is_autocast_enabled(t) for t in ("cpu", "cuda"))
    may_single = bool(paired_lines) and not (amp or is_sharded(model) or fixed)
    for d in [*(d for d in decisions if d not in paired_lines), *paired_lines]:
        if d in paired_lines:
            if lifetimes is None and may_single:
                # where storages live with every block kept, and who saves what: one forward
                lifetimes = keep_lifetimes(
                    model, modules, step.args, step.kwargs, step.state, step.inputs
                )
                single = single_steps(lifetimes.saved, fixed)
                if active(step.loop.distributed):  # the same steps on every rank
                    (pairs_needed,) = agree_max([int(not single)])
                    single = not pairs_needed
            roles: set[tuple[int, int]] = set()  # of storages handed to several blocks
            pairs: list[PairStep] = []
            pair_frees: list[InputFrees] = []
            pair_times: list[tuple[dict[str, float], dict[str, float]]] = []
            for pattern in pair_patterns(n, d, fixed, single):
                for nm, mod, p in zip(names, modules, pattern):
                    apply_decision(mod, RECOMPUTE if p is SPLIT and nm not in splittable else p)
                step.clear_grads()
                pair, found, args = _pair_step(step, modules, storages)
                pairs.append(pair)
                pair_frees.append(found)
                roles |= {a.role for a in args.shared()}
                if d is KEEP and optimizer is not None and len(pairs) == 1:
                    opt_terms = _optimizer_terms(step.state, optimizer, step.counted)
                if clock is not None:
                    step.clear_grads()
                    pair_times.append(
                        time_blocks(blocks, step.timed, step.device, repeats, clock, step.threads)
                    )
                tick()
            lives: KeptShared | None = None
            probe: SharedArgs | None = None
            handed = bool(roles)
            if active(step.loop.distributed):  # the same terms on every rank
                (handed,) = map(bool, agree_max([int(handed)]))
            if handed and d is KEEP:  # where they live with every block kept: one forward
                probe = lifetimes or keep_lifetimes(
                    model, modules, step.args, step.kwargs, step.state, step.inputs
                )
                lives = _kept_shared(probe, n, pairs[-1].line)
            lines[d] = assemble(pairs, lives, single)
            head_freed[d] = pair_frees[-1].freed[-1]
            if d in HELD_LINES:
                held[d] = [pairs[step_of(i, single)].held_to_end[i] for i in range(n)]
            if d is KEEP:  # block i's output as block i + 1 runs: the step of the two (of
                # block i + 1 alone: block i's output is its recomputed checkpoint's, free)
                nxt = 1 if single else 0
                freed = [pair_frees[i + nxt].freed[i] for i in range(n - 1)]
                freed.append(pair_frees[-1].freed[-1])
                shared = max(f.shared for f in pair_frees)
                for f in pair_frees:
                    shared_inputs.update(f.shared_inputs)
                if lives is not None and probe is not None:
                    shared, shared_inputs = _kept_terms(probe, lives, n, held[d], shared_inputs)
            if clock is not None:
                times[d] = {nm: pair_times[step_of(i, single)][0][nm] for i, nm in enumerate(names)}
                noise[d] = {nm: pair_times[step_of(i, single)][1][nm] for i, nm in enumerate(names)}
                if d is KEEP:  # recompute's step less what recomputing costs its blocks
                    rec = sorted(line_times[RECOMPUTE])[len(line_times[RECOMPUTE]) // 2]
                    keep_cost = rec - sum(times[RECOMPUTE][nm] - times[KEEP][nm] for nm in names)
            continue
        for nm, mod in blocks.items():  # a block that cannot split is recomputed meanwhile
            if nm in calls.mutating:
                apply_decision(mod, KEEP, compiled)
            else:
                apply_decision(
                    mod, RECOMPUTE if d is SPLIT and nm not in splittable else d, compiled
                )
        if compiled:  # compiles this level (once per block class and shapes), unmeasured
            step.clear_grads()
            step()
        step.clear_grads()
        # the selective step for what the head frees of the last block's output: what its
        # cache holds of it the head cannot free (derive_blocks)
        sees = d in (*HELD_LINES, SELECTIVE)
        if compiled:
            line, frees = _allocator_step(step, modules, sees)
        else:
            line, frees = _memory_step(step, modules, storages, sees)
        lines[d] = line
        if frees is not None:
            head_freed[d] = frees.freed[-1]
        if frees is not None and d in HELD_LINES:
            held[d] = frees.held_to_end
            if d is KEEP:
                freed, shared = frees.freed, frees.shared
                shared_inputs = frees.shared_inputs
        if d is KEEP and optimizer is not None:  # on this step's gradients
            opt_terms = _optimizer_terms(step.state, optimizer, step.counted)
        if clock is not None:
            step.costs.clear()
            step.clear_grads()
            times[d], noise[d] = time_blocks(
                blocks, step.timed, step.device, repeats, clock, step.threads
            )
            if d is KEEP:
                keep_cost = float(sorted(step.costs)[len(step.costs) // 2])
            line_times[d] = list(step.costs)
        tick()
    lines = {d: lines[d] for d in decisions}  # in the decisions' order, however measured
    if compiled and clock is not None:
        times, noise = whole_step_costs(times, line_times)
    if timer == "time":
        moved = _offloaded(names, lines) if OFFLOAD in lines else None
        priced = step.target if step.target is not None else step.device
        modelled, keep_cost = modelled_costs(
            model, blocks, step.args, step.kwargs, decisions, priced, step.threads, moved,
            calibration,
        )
        times = modelled
        noise = {d: dict.fromkeys(names, 0.0) for d in decisions}
    if timer == "flops":
        # "recompute" as well: a whole step's FLOPs are three times the blocks' forwards
        measured = list(dict.fromkeys([*decisions, RECOMPUTE]))
        flops = flop_costs(model, blocks, step.args, step.kwargs, step.loop.loss_fn, measured)
        times = flops
        noise = {d: dict.fromkeys(names, 0.0) for d in decisions}
    tick()
    return Measurements(
        names=names,
        decisions=list(decisions),
        lines=lines,
        costs=times,
        noise=noise,
        param_bytes=[
            storage_bytes([*mod.parameters(), *mod.buffers()], step.counted) for mod in modules
        ],
        signatures=[
            (_signature(mod, b), nm in calls.mutating)
            for nm, mod, b in zip(names, modules, lines[KEEP].input_bytes)
        ],
        freed=freed,
        held_to_end=held,
        offload_inputs=offload[0],
        held_before=offload[1],
        mutating=set(calls.mutating),
        splittable=splittable,
        shared_inputs=shared_inputs,
        head_freed=head_freed,
        timer=timer,
        keep_cost=keep_cost,
        grad_bytes=grads,
        shared_bytes=shared,
        optimizer=None if optimizer is None else type(optimizer).__name__,
        optimizer_first_bytes=opt_terms[0],
        optimizer_later_bytes=opt_terms[1],
        optimizer_state_bytes=opt_terms[2],
        static_bytes=0,  # read by _profile once the steps are undone (FSDP2 resharded)
        grads_kept=not step.loop.set_to_none,
        input_shapes=[list(t.shape) for t in step.inputs],
        device=str(step.target if step.target is not None else step.device),
        from_shapes=step.target is not None,
        torch_version=torch.__version__,
        chained=calls.chained,
        kept_outputs=kept,
        scratch=scratch,
        compiled=compiled,
        steps=("singles" if single else "pairs") if paired_lines else "uniform",
    )


def _pair_step(
    step: Step, modules: list[nn.Module], storages: list[torch.UntypedStorage]
) -> tuple[PairStep, InputFrees, SharedArgs]:
    """One tracked pair step (:mod:`.grouped`, :func:`_memory_step` with its storages handed
    to several blocks found): its record, what :class:`InputFrees` saw, and those storages."""
    args = SharedArgs(step.model, len(modules), step.inputs)
    try:
        line, found = _memory_step(step, modules, storages, True, shared=args)
    finally:
        args.remove()
    assert found is not None
    pair = PairStep(line, found.held_to_end, args.at_bwd, args.at_return or {}, dict(args.died))
    return pair, found, args


def _kept_shared(probe: SharedArgs, n: int, last: Timeline) -> KeptShared:
    """:class:`KeptShared` from :func:`keep_lifetimes`' ``probe``, or :class:`NotPaired`
    where an autocast region ends between the last block and backward (``last``: the last
    pair step's line), whose window the pair steps do not split at the region's end and the
    model's return both."""
    if last.top_pre_peak is not None and last.top_mid_peak is None:
        raise NotPaired(
            "an autocast region ends inside the model's forward, after its blocks, and a "
            "tensor is handed to several blocks: the pair steps do not split the last "
            "window at both"
        )
    nbytes: dict[tuple[int, int], int] = {}
    for a in probe.shared():
        nbytes[a.role] = nbytes.get(a.role, 0) + a.nbytes
    held = {r for r, b in (probe.at_return or {}).items() if b}
    return KeptShared(n, nbytes, dict(probe.saved), held, dict(probe.died))


def _kept_terms(
    probe: SharedArgs,
    lives: KeptShared,
    n: int,
    held: list[int],
    shared_inputs: dict[str, int],
) -> tuple[int, dict[str, int]]:
    """The terms :class:`InputFrees` reads of the storages handed to several blocks, as with
    every block kept (``lives``, from ``probe``): the bytes of those passed as the same
    tensor to several blocks that die in forward (``shared``), and of the others, their
    receivers' inputs held to the end (added to ``held``, in place) and the
    :class:`SharedInput` they make (in the ``shared_inputs`` returned, which keeps of the
    pair steps' only those of one block)."""
    shared = 0
    inputs = {k: v for k, v in shared_inputs.items() if "," not in k.partition(">")[0]}
    for a in probe.shared():
        w = lives.dies_in(a.role)
        if w is None:
            continue
        if a.many:
            shared += a.nbytes
            continue
        for i in sorted(set(a.blocks)):
            if i < w:  # alive as its window ended, dead as forward returned
                held[i] += a.nbytes
        g = SharedInput(tuple(a.blocks), w, a.nbytes)
        inputs[g.key] = inputs.get(g.key, 0) + a.nbytes
    return shared, inputs


def _mutating(step: Step, modules: list[nn.Module], names: list[str]) -> set[str]:
    """The blocks that change one of their input tensors in place (:class:`CallCount`), seen
    in one forward without gradients (none where that forward fails)."""
    calls = CallCount(names)
    try:
        with BlockHooks(modules, calls), torch.no_grad():
            step.state.reset_rng()
            out = step.model(*step.args, **step.kwargs)
            del out
    except Exception:  # a model that needs gradients in forward
        return set()
    return calls.mutating


def _offloaded(names: list[str], lines: dict[Decision, Timeline]) -> dict[str, int]:
    """Per block, what it keeps for backward under ``keep`` less under ``offload``: the bytes
    ``offload`` moves to the host."""
    out = {}
    for i, nm in enumerate(names):
        kept = [
            (t.fwd_start[i + 1] if i + 1 < len(names) else t.top_start) - t.fwd_start[i]
            for t in (lines[KEEP], lines[OFFLOAD])
        ]
        out[nm] = max(kept[0] - kept[1], 0)
    return out


def _memory_step(
    step: Step,
    modules: list[nn.Module],
    storages: list[torch.UntypedStorage],
    frees: bool,
    shared: SharedArgs | None = None,
) -> tuple[Timeline, InputFrees | None]:
    """One tracked step: its timeline, and with ``frees`` the :class:`InputFrees` it saw.
    Bytes do not depend on threads, so this step runs at full speed. With ``shared`` (a pair
    step, :mod:`.grouped`) that probe runs too, the ``top`` window's peak up to the model's
    return is kept apart, and the held-to-end bytes leave out the storages it finds handed
    to several blocks."""
    leave_out = None if shared is None else (lambda: {a.key for a in shared.shared()})
    found = InputFrees(step.model, len(modules), step.inputs, leave_out) if frees else None
    hooks = [BlockHooks(modules, p) for p in (found, shared) if p is not None]
    try:
        with memory.track(step.counted) as tracker:
            tracker.watch(storages)
            params = step.state.grad_params if step.loop.set_to_none else []
            timeline = TimelineProbe(tracker, len(modules), params, step.counted)
            ret = None
            if shared is not None:
                ret = step.model.register_forward_hook(lambda *_: timeline.model_returned())
            try:
                with BlockHooks(modules, timeline):
                    step(timeline.finish)
            finally:
                if ret is not None:
                    ret.remove()
                timeline.remove()
    finally:
        for h in hooks:
            h.remove()
        if found is not None:
            found.remove()
    return timeline.line, found


def _allocator_step(
    step: Step,
    modules: list[nn.Module],
    frees: bool,
) -> tuple[Timeline, InputFrees | None]:
    """One step under ``torch.profiler``: its timeline from the allocator's events
    (:class:`~.compiled.AllocatorTimeline`: what compiled blocks allocate, which the tracker
    cannot see), and with ``frees`` the :class:`InputFrees` it saw."""
    found = InputFrees(step.model, len(modules), step.inputs) if frees else None
    hooks = BlockHooks(modules, found) if found is not None else None
    params = step.state.grad_params if step.loop.set_to_none else []

    def inputs(args: Any) -> int:
        got: list[torch.Tensor] = []
        tensors_in(args, got)  # the positional inputs (keyword ones are not a block's own)
        return storage_bytes(got, step.counted)

    probe = AllocatorTimeline(len(modules), lambda: grad_bytes(params, step.counted), inputs)
    try:
        with BlockHooks(modules, probe):
            events = profiled(lambda: step(probe.finish))
    finally:
        if hooks is not None:
            hooks.remove()
        if found is not None:
            found.remove()
    return probe.line(events, step.device), found


def _offloads(model: nn.Module, args: Any) -> bool:
    """Whether offload moves the model's tensors to host memory (on a device; on CPU they
    are there already and offload keeps them as they are)."""
    found: list[torch.Tensor] = []
    tensors_in(args, found)
    first = next(model.parameters(), None)
    return any(moves_to_host(t) for t in [*found[:1], *([first] if first is not None else [])])


def _signature(module: nn.Module, input_bytes: int) -> tuple[Any, ...]:
    """What makes two blocks the same layer: class, parameter and buffer shapes, input bytes."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return (
        type(module).__qualname__,
        input_bytes,
        tuple((n, tuple(t.shape), str(t.dtype), t.requires_grad) for n, t in tensors),
        tuple(type(m).__qualname__ for m in module.modules()),
    )


def _optimizer_terms(
    state: StepState, optimizer: torch.optim.Optimizer, counted: torch.device | None
) -> tuple[int, int, int]:
    """Peaks inside the first and a later ``optimizer.step()``, and the state's bytes.

    Runs from an empty optimizer state on the gradients there are now; the
    parameters, the state and the hyper-parameters are put back by ``state.restore()``
    (and the parameter values right here, for the steps that follow).
    """
    state.fresh_optimizer_state()
    try:
        with outside(), memory.track(counted) as t:
            optimizer.step()
        first = t.peak_bytes
        opt_state = storage_bytes(optimizer_tensors(optimizer), counted)
        with outside(), memory.track(counted) as t:
            optimizer.step()
        later = t.peak_bytes
    finally:
        optimizer.state = state.opt_state
        with torch.no_grad():
            for p, v in zip(state.params, state.values):
                p.copy_(v)
    return first, later, opt_state
