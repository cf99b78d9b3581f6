"""``remat.profile``: measure a training step and what each decision does to its blocks.

A few instrumented training steps of the default loop (see
:mod:`remat.planner.model`), all from the same RNG state:

* one warm-up step (lazy modules, allocator and kernels warm up; it checks
  that every candidate block runs once per forward: the planner models a chain);
* per decision one memory step, every candidate block under that decision,
  whose bytes are read at the boundaries of contiguous windows (before the
  blocks, each block's forward, the head and loss, each block's backward) into a
  :class:`~remat.planner.model.Timeline`; gradients start as ``None`` (or kept,
  with ``set_to_none=False``), as in the user's step;
* per decision ``repeats`` timed steps (not tracked: the tracker's per-op work
  would inflate the time);
* with an ``optimizer``: two ``optimizer.step()`` calls from an empty state,
  tracked (the first creates the state), after which the parameters, the
  optimizer's state and hyper-parameters are put back.

The profile records measurements; the step model that turns them into a
predicted peak lives in :mod:`remat.planner.model`.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import logging
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .. import memory
from .._config import is_recomputing
from .._modelinfo import (
    candidates,
    check_grad_enabled,
    check_module,
    counted_device,
    device_of,
    loss_of,
)
from .._offload import moves_to_host
from .._split import can_split
from .._tree import tensors_in
from .amp import fresh_region, outside
from .apply import apply_decision, restore_state, snapshot_state
from .distributed import active, agree_profile, agree_same
from .model import (
    DECISIONS,
    BlockCosts,
    StepPeak,
    Timeline,
    checkpointed_view,
    derive_blocks,
    equalize_costs,
    exit_view,
    has_exit,
    step_peak,
)
from .scratch import operator_scratch
from .sharded import is_ddp, reshard, unsharded_storages
from .solve import smallest_chain
from .state import (
    StepState,
    check_step_options,
    grad_bytes,
    optimizer_tensors,
    static_bytes,
    storage_bytes,
)
from .timing import flop_costs, make_clock, time_blocks

_log = logging.getLogger(__name__)


@dataclasses.dataclass
class Profile:
    """Measured costs of a model's training step and candidate blocks; input of :func:`remat.plan`.

    Bytes are on the model's device (everything on CPU), as :mod:`remat.memory` counts them.

    Attributes:
        blocks: one :class:`~remat.planner.model.BlockCosts` per candidate, in call order.
        top: peak bytes (from the step's start) between the last block's forward and
            its backward (all ``keep``).
        pre: peak bytes before the first block's forward.
        decisions: the decisions that were measured.
        cost_unit: ``"s"`` or ``"flop"``.
        input_shapes: shapes of the tensor inputs the profile is valid for.
        device: where it was measured.
        torch_version: the torch it was measured with.
        step_cost: cost of one whole step with every block kept, in ``cost_unit``
            (so that ``1 + plan.predicted_overhead_s / step_cost`` is a predicted time ratio).
        static_bytes: parameters, buffers and inputs.
        grad_bytes: the gradients of one step.
        grads_kept: ``True`` when the step starts with its gradients allocated
            (``zero_grad(set_to_none=False)``, gradient accumulation).
        optimizer: the optimizer's class name, or ``None`` (no optimizer step modelled).
        optimizer_state_bytes: the optimizer's state after its first step.
        optimizer_first_bytes / optimizer_later_bytes: peak bytes allocated inside
            the first / a later ``optimizer.step()`` (state creation included).
        end_bytes / end_grads: bytes alive when backward returns (from the step's
            start), and how many of them are gradients.
        top_grads: gradient bytes alive at the end of the ``top`` window.
        chained: for each block but the last, whether the next block received a tensor
            this one returned (no code of the model between them): the blocks a span
            may join. Empty (a profile from an older version): no spans.
        kept_outputs: for each block, whether the model's own code still referenced its
            output when the block after next started (a skip connection, a list of hidden
            states): a span may not hold it and the two blocks after it together (it would
            refuse the model at run time). Seen in one forward without gradients, where
            only the model's code keeps tensors. Empty: not recorded (no such limit).
        shared_bytes: tensors the model's forward makes and passes to several blocks (an
            attention mask, rotary tables) that die when the forward returns with every
            block kept; a checkpointed block keeps them until its backward
            (:func:`~remat.planner.model.checkpointed_view`).
        scratch_bytes: the most memory one operator of the step's forward and backward
            allocates and frees before it returns, which the allocator counts and
            :mod:`remat.memory` cannot (:mod:`remat.planner.scratch`); plans keep the
            predicted peak plus this within the budget.
    """

    blocks: list[BlockCosts]
    top: int
    decisions: list[str]
    cost_unit: str
    input_shapes: list[list[int]]
    device: str
    torch_version: str
    step_cost: float = 0.0
    pre: int = 0
    static_bytes: int = 0
    grad_bytes: int = 0
    grads_kept: bool = False
    optimizer: str | None = None
    optimizer_state_bytes: int = 0
    optimizer_first_bytes: int = 0
    optimizer_later_bytes: int = 0
    end_bytes: int = 0
    end_grads: int = 0
    top_grads: int = 0
    chained: list[bool] = dataclasses.field(default_factory=list)
    scratch_bytes: int = 0
    kept_outputs: list[bool] = dataclasses.field(default_factory=list)
    shared_bytes: int = 0

    @property
    def static_step_bytes(self) -> int:
        """Bytes a later step starts with: static, kept gradients, optimizer state."""
        kept = self.grad_bytes if self.grads_kept else 0
        return self.static_bytes + kept + self.optimizer_state_bytes

    @property
    def unchecked_peak_bytes(self) -> int:
        """Predicted peak of a step with every block kept (absolute bytes of tensors; the
        allocator's adds at most ``scratch_bytes``)."""
        return self.peak(["keep"] * len(self.blocks)).bytes

    @property
    def floor_bytes(self) -> int:
        """The smallest predicted step peak any plan reaches (absolute bytes of tensors):
        the smallest budget :func:`remat.plan` meets is this plus ``scratch_bytes``."""
        blocks, top = self.blocks, self.top
        if self.shared_bytes:
            blocks, top = checkpointed_view(blocks, top, self.shared_bytes)
        if has_exit(blocks):  # an autocast region ends before backward: safe terms
            blocks = exit_view(blocks, safe=True)
        floor = self.peak(
            *smallest_chain(blocks, top, self.decisions, 16, self.chained, self.kept or None)
        ).bytes
        return min(floor, self.peak(["keep"] * len(blocks)).bytes)

    @property
    def kept(self) -> list[bool]:
        """``kept_outputs`` when recorded for every block, else empty (no limit)."""
        ok = len(self.kept_outputs) == len(self.blocks)
        return list(self.kept_outputs) if ok else []

    def peak(self, decisions: Sequence[str], spans: Sequence[Sequence[int]] = ()) -> StepPeak:
        """The step model's peak for a plan: one decision per block and ``(first, last)``
        block indices of spans (see :mod:`remat.planner.model`)."""
        return step_peak(self, decisions, spans)

    def to_json(self) -> str:
        """Plain JSON."""
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        """Read a profile written by :meth:`to_json`."""
        data = json.loads(text)
        data["blocks"] = [BlockCosts(**b) for b in data["blocks"]]
        return cls(**data)

    def save(self, path: str) -> None:
        """Write the profile to ``path`` as JSON."""
        with open(path, "w") as fh:
            fh.write(self.to_json())

    @classmethod
    def load(cls, path: str) -> Profile:
        """Read a profile saved with :meth:`save`."""
        with open(path) as fh:
            return cls.from_json(fh.read())


def profile(
    model: nn.Module,
    *args: Any,
    optimizer: torch.optim.Optimizer | None = None,
    set_to_none: bool = True,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    check_fn: Callable[[str, nn.Module], bool] | None = None,
    decisions: Sequence[str] | None = None,
    timer: str = "time",
    repeats: int = 3,
    threads: int | None = 1,
    distributed: bool | None = None,
    **kwargs: Any,
) -> Profile:
    """Measure a training step and each candidate block under each decision.

    Runs ``2 + len(decisions) * (1 + repeats)`` training steps (forward,
    loss, backward; ``2 + len(decisions)`` with ``timer="flops"``), plus two
    ``optimizer.step()`` calls when an optimizer is given. One of the steps runs
    under ``torch.profiler`` to measure the scratch memory inside operators
    (``Profile.scratch_bytes``). Everything they
    change is put back: parameter values, gradients (of parameters and inputs:
    the very tensors, untouched), optimizer state and hyper-parameters,
    buffers (BatchNorm running statistics), the RNG, and the blocks' wrapping.

    Called inside a ``torch.autocast`` region, the steps are iterations of torch's
    mixed-precision recipe: forward and loss in the region, backward and the optimizer
    step after its end (:mod:`remat.planner.amp`).

    Args:
        model: the model.
        *args: example inputs (the profile is valid for their shapes).
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
            default: the children of the largest ``ModuleList``/``Sequential``.
        decisions: what to measure; default ``keep``, ``recompute``,
            ``selective``, ``offload`` on a device, and ``split`` (the block
            checkpointed with each of its children nested inside, below the
            every-block floor) when a block has two or more children with parameters.
            A block that changes one of its input tensors in place
            (``nn.ReLU(inplace=True)`` as a block of an ``nn.Sequential``) can only be
            kept: a checkpoint keeps its input for the recompute, which the block
            changes (and keeping it costs what keeping the block does).
        timer: ``"time"`` (seconds) or ``"flops"`` (recomputed FLOPs, deterministic).
            FLOPs count what ``torch.utils.flop_counter`` counts (matmuls,
            convolutions, attention): recomputing norms and activations counts as
            free, so ``selective`` costs 0 under this timer. Use it for tests and
            cross-machine comparisons; plan real runs with ``"time"``.
        repeats: timed steps per decision; a block's cost is the median, and half
            the range of the samples is its noise (near-ties within it go to the
            simpler plan).
        threads: CPU only: ``1`` (default) times with one thread and thread CPU
            time, the steadiest numbers; another number sets torch's threads and
            ``None`` keeps them, both with wall time, closer to a multi-threaded
            training run.
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
        **kwargs: keyword inputs of the model.

    Example:
        >>> import torch, remat
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> prof = remat.profile(model, torch.randn(8, 16), optimizer=opt, timer="flops")
        >>> [b.name for b in prof.blocks], prof.optimizer_state_bytes  # one momentum buffer a parameter
        (['0', '1', '2'], 3264)
    """
    check_module(model, "remat.profile")
    check_grad_enabled("remat.profile")
    if timer not in ("time", "flops"):
        raise ValueError(f"remat.profile: timer must be 'time' or 'flops', got {timer!r}.")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"remat.profile: repeats must be an int >= 1, got {repeats!r}.")
    check_step_options("remat.profile", optimizer, set_to_none)
    device = device_of(model, args)
    if decisions is None:
        decisions = ["keep", "recompute", "selective"] + (
            ["offload"] if _offloads(model, (args, kwargs)) else []
        )
        if any(can_split(m) for m in candidate_modules(model, check_fn)):
            decisions.append("split")
    bad = [d for d in decisions if d not in DECISIONS]
    if bad or "keep" not in decisions:
        raise ValueError(
            f"remat.profile: decisions must include 'keep' and come from {list(DECISIONS)}, "
            f"got {list(decisions)}."
        )
    if "offload" in decisions and not _offloads(model, (args, kwargs)):
        raise ValueError(
            "remat.profile: 'offload' needs a device (on CPU the tensors already live in host "
            "memory); drop it from decisions."
        )
    names = candidates(model, check_fn)
    agree = active(distributed)
    if agree:  # before any step: ranks that would run different steps would hang
        agree_same((names, list(decisions), repeats, timer), "the blocks, decisions and steps")
    blocks = {n: model.get_submodule(n) for n in names}
    splittable = {n for n, m in blocks.items() if can_split(m)}
    if "split" in decisions and not splittable:
        raise ValueError(
            "remat.profile: decision 'split' needs blocks with two or more children that have "
            "parameters (attention, MLP); none of the candidate blocks has. Drop it from "
            "decisions."
        )
    counted = counted_device(device)
    inputs: list[torch.Tensor] = []
    tensors_in((args, kwargs), inputs)
    leaves = [t for t in inputs if t.is_leaf and t.requires_grad]
    wrapping = snapshot_state(blocks)
    state = StepState(model, leaves, optimizer, device, inputs)
    params = state.grad_params
    step_costs: list[float] = []
    clock_now = time.thread_time if device.type == "cpu" and threads == 1 else time.perf_counter

    def clear_grads() -> None:
        if set_to_none:
            for t in state.leaves:
                t.grad = None
        else:
            for t in state.leaves:
                if t.grad is not None:
                    t.grad.detach_().zero_()

    def step(watch: _Windows | None = None) -> None:
        start = clock_now()
        state.reset_rng()
        fresh_region()  # in the caller's autocast region: one iteration of the AMP recipe
        out = model(*args, **kwargs)
        loss = loss_of(out, loss_fn)
        with outside():
            loss.backward()
        if watch is not None:  # `out` and `loss` are alive here, as in the user's loop
            watch.finish()
        del out, loss
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_costs.append(clock_now() - start)

    def timed_step() -> None:
        clear_grads()
        step()

    lines: dict[str, Timeline] = {}
    times: dict[str, dict[str, float]] = {}
    noise: dict[str, dict[str, float]] = {}
    keep_step = 0.0
    opt_terms = (0, 0, 0)
    mutating: set[str] = set()
    freed = [0] * len(names)
    offload_inputs = [0] * len(names)
    held_before = [0] * len(names)
    held_to_end: dict[str, list[int]] = {}
    shared = 0
    try:
        calls = _CallCount(names)
        count_handles = [
            m.register_forward_pre_hook(calls.hook(n), with_kwargs=True) for n, m in blocks.items()
        ] + [m.register_forward_hook(calls.post(n), with_kwargs=True) for n, m in blocks.items()]
        try:
            step()  # warm-up; with set_to_none=False its gradients stay for every later step
        finally:
            for ch in count_handles:
                ch.remove()
        calls.check(names)
        kept_outputs = _kept_outputs(model, blocks, names, args, kwargs, state)
        if "offload" in decisions and len(names) >= 2:
            offload_inputs, held_before = _offload_inputs(
                model, blocks, names, args, kwargs, state,
                [d for d in ("keep", "selective") if d in decisions],
            )  # fmt: skip
        # A block that changes its input in place cannot be recomputed from that input
        # (the region keeps it; autograd raises when backward reads it): it is kept, alone.
        mutating = calls.mutating
        if is_ddp(model):  # DDP rebuilds its buckets in the second step: not in a measured one
            step()
        clear_grads()
        scratch = operator_scratch(step, device)
        storages = unsharded_storages(model)
        gbytes = grad_bytes(params, counted)
        clock = make_clock(device, threads) if timer == "time" else None
        for d in decisions:
            for n, m in blocks.items():  # a block that cannot split is recomputed meanwhile
                if n in mutating:
                    apply_decision(m, "keep")
                else:
                    apply_decision(m, "recompute" if d == "split" and n not in splittable else d)
            clear_grads()
            # Memory: bytes do not depend on threads, so this step runs at full speed.
            frees = _InputFrees(model, names, blocks, inputs) if d in _HELD_LINES else None
            with memory.track(counted) as tracker:
                tracker.watch(storages)
                watch = _Windows(tracker, names, blocks, params if set_to_none else [], counted)
                try:
                    step(watch)
                finally:
                    watch.remove()
                    if frees is not None:
                        frees.remove()
            if frees is not None:
                held_to_end[d] = frees.held_to_end
                if d == "keep":
                    freed, shared = frees.freed, frees.shared
            lines[d] = watch.line
            if d == "keep" and optimizer is not None:  # on this step's gradients
                opt_terms = _optimizer_terms(state, optimizer, counted)
            if clock is not None:
                step_costs.clear()
                clear_grads()
                times[d], noise[d] = time_blocks(
                    blocks, timed_step, device, repeats, clock, threads
                )
                if d == "keep":
                    keep_step = float(sorted(step_costs)[len(step_costs) // 2])
        if timer == "flops":
            # "recompute" as well: a whole step's FLOPs are three times the blocks' forwards
            times = flop_costs(
                model, blocks, args, kwargs, loss_fn, list(dict.fromkeys([*decisions, "recompute"]))
            )
            noise = {d: dict.fromkeys(names, 0.0) for d in decisions}
    finally:
        restore_state(blocks, wrapping)
        state.restore()
        reshard(model)  # the step's start: FSDP2's parameters sharded
    keep_line = lines["keep"]
    costs = derive_blocks(
        names,
        lines,
        times,
        noise,
        keep_line.input_bytes,
        [storage_bytes([*m.parameters(), *m.buffers()], counted) for m in blocks.values()],
    )
    for b, f in zip(costs, freed):
        # The next block (kept) frees this one's output as it runs, which the selective
        # cache may hold instead (a block ending in a saved matmul): counted as held, so a
        # selective block is never predicted low (over by ``f`` where nothing frees it).
        if f and "selective" in b.retained:
            b.retained["selective"] += f
            if b.bwd_excess["selective"] > -(2**62):  # a backward window was seen
                b.bwd_excess["selective"] -= f  # its own backward: as measured
    _held_to_end(costs, held_to_end)
    for b, f, h in zip(costs, offload_inputs, held_before):
        b.offload_input = 0 if b.name in mutating else f
        if h and "offload" in b.retained:
            # The offload line freed this block's input as it ran; after a kept or selective
            # block that saved it, it lives on: counted as held (high by ``h`` after a block
            # that does not hold it, never low).
            b.retained["offload"] += h
    for b in costs:
        dropped = [d for d in decisions if d != "keep"] if b.name in mutating else ["split"]
        if b.name in mutating or b.name not in splittable:
            for terms in (b.retained, b.fwd_excess, b.bwd_excess, b.cost, b.noise):
                for d in dropped:
                    terms.pop(d, None)
    equalize_costs(
        costs,
        [
            (_signature(m, b.input_bytes), b.name in mutating)
            for m, b in zip(blocks.values(), costs)
        ],
    )
    shapes: list[torch.Tensor] = []
    tensors_in((args, kwargs), shapes)
    first, later, opt_state = opt_terms
    prof = Profile(
        blocks=costs,
        top=keep_line.top_peak,
        pre=keep_line.pre_peak,
        decisions=list(decisions),
        cost_unit="s" if timer == "time" else "flop",
        input_shapes=[list(t.shape) for t in shapes],
        device=str(device),
        torch_version=torch.__version__,
        step_cost=keep_step if timer == "time" else 3.0 * sum(times["recompute"].values()),
        static_bytes=static_bytes(model, (args, kwargs), counted),
        grad_bytes=gbytes,
        grads_kept=not set_to_none,
        optimizer=None if optimizer is None else type(optimizer).__name__,
        optimizer_state_bytes=opt_state,
        optimizer_first_bytes=first,
        optimizer_later_bytes=later,
        end_bytes=keep_line.end_bytes,
        end_grads=keep_line.end_grads,
        top_grads=keep_line.top_grads,
        chained=calls.chained,
        scratch_bytes=scratch,
        kept_outputs=kept_outputs,
        shared_bytes=shared,
    )
    return agree_profile(prof) if agree else prof


def _offloads(model: nn.Module, args: Any) -> bool:
    """Whether offload moves the model's tensors to host memory (on a device; on CPU they
    are there already and offload keeps them as they are)."""
    found: list[torch.Tensor] = []
    tensors_in(args, found)
    first = next(model.parameters(), None)
    return any(moves_to_host(t) for t in [*found[:1], *([first] if first is not None else [])])


#: The lines whose steps see which block inputs die when forward returns (``_held_to_end``):
#: the others (checkpoints) hold every block input into backward.
_HELD_LINES = ("keep", "offload")


def _held_to_end(costs: list[BlockCosts], held: dict[str, list[int]]) -> None:
    """Block inputs that live to the end of forward and then die, measured per line in
    ``held``: the model's code keeps them (a list of hidden states) and the block keeps none
    of them on the device (under ``keep``: it saves none, or only autocast's copy; under
    ``offload``: its saved copy is in host memory), while a checkpoint of the block holds
    them into its backward. They count as kept in forward and not after it under that
    decision (``exit_freed``, in place), so every backward term from the block's on has
    them exactly when the plan holds them. The uniform lines' derived backward terms had
    them (or not) for every block before: moved out of them here."""
    n = len(costs)
    lines = {d: held.get(d, [0] * n) for d in _HELD_LINES}
    total: dict[str, int] = {}
    for i, b in enumerate(costs):
        mine = {d: v[i] for d, v in lines.items() if v[i] and d in b.retained}
        b.held_to_end = mine.get("keep", 0)
        if mine:
            x = dict(b.exit_freed) or dict.fromkeys(b.retained, 0)
            for d, h in mine.items():
                b.retained[d] -= h
                x[d] = x.get(d, 0) + h
            b.exit_freed = x
        for d in b.bwd_excess:  # what keep's line freed and d's line held, from block 0 on
            total[d] = total.get(d, 0) + mine.get("keep", 0) - mine.get(d, 0)
            if total[d] and b.bwd_excess[d] > -(2**62):
                b.bwd_excess[d] -= total[d]


def candidate_modules(
    model: nn.Module, check_fn: Callable[[str, nn.Module], bool] | None
) -> list[nn.Module]:
    return [model.get_submodule(n) for n in candidates(model, check_fn)]


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


class _Windows:
    """Reads the tracker at the boundaries of a step's contiguous windows into a Timeline.

    ``params``: the parameters whose gradients the step creates (none when they are kept).
    """

    def __init__(
        self,
        tracker: memory.MemoryTracker,
        names: Sequence[str],
        blocks: dict[str, nn.Module],
        params: list[torch.Tensor],
        counted: torch.device | None,
    ) -> None:
        n = len(names)
        self.tracker = tracker
        self.params = params
        self.counted = counted
        self.index = {name: i for i, name in enumerate(names)}
        self.last = names[-1]
        self.line = Timeline(
            fwd_start=[0] * n, fwd_peak=[0] * n, bwd_start=[None] * n, bwd_peak=[0] * n,
            bwd_grads=[0] * n, input_bytes=[0] * n,
        )  # fmt: skip
        self.phase: tuple[str, int] = ("pre", -1)
        self.window = tracker.open_window()
        self.seq = [0] * (n + 1)  # tracker.allocations at each block's forward start, and top's
        self.handles = []
        for name, m in blocks.items():
            self.handles.append(m.register_forward_pre_hook(self._pre(name)))
            self.handles.append(m.register_forward_hook(self._post(name)))
        # The end of an autocast region (the caller's, emulated before backward by
        # ``amp.outside``, or one inside the model's forward) drops its cast cache through
        # ``torch.clear_autocast_cache``: seen here, while this step runs.
        self.real_clear = torch.clear_autocast_cache
        torch.clear_autocast_cache = self._clear_cache  # type: ignore[assignment]

    def _switch(self, phase: tuple[str, int]) -> int:
        """Close the open window (its peak goes to its phase), open one for ``phase``."""
        peak = self.tracker.close_window(self.window)
        kind, i = self.phase
        line = self.line
        grads = grad_bytes(self.params, self.counted)
        if kind == "pre":
            line.pre_peak = peak
        elif kind == "fwd":
            line.fwd_peak[i] = peak
        elif kind == "top":
            line.top_peak, line.top_grads = peak, grads
        elif kind == "bwd":
            line.bwd_peak[i], line.bwd_grads[i] = peak, grads
        self.window = self.tracker.open_window()
        self.phase = phase
        return self.window.start

    def _pre(self, name: str) -> Callable[[Any, Any], None]:
        def hook(module: Any, args: Any) -> None:
            if is_recomputing():
                return
            i = self.index[name]
            found: list[torch.Tensor] = []
            tensors_in(args, found)
            self.line.input_bytes[i] = storage_bytes(found, self.counted)
            self.line.fwd_start[i] = self._switch(("fwd", i))
            self.seq[i] = self.tracker.allocations

        return hook

    def _post(self, name: str) -> Callable[[Any, Any, Any], None]:
        def hook(module: Any, args: Any, out: Any) -> None:
            if is_recomputing():
                return
            i = self.index[name]
            if name == self.last:
                self.line.top_start = self._switch(("top", -1))
                self.seq[-1] = self.tracker.allocations
            outs: list[torch.Tensor] = []
            tensors_in(out, outs)
            outs = [t for t in outs if t.requires_grad]
            if outs:
                torch.autograd.graph.register_multi_grad_hook(
                    outs, _BackwardStart(self, i), mode="any"
                )

        return hook

    def _clear_cache(self) -> None:
        """``torch.clear_autocast_cache`` while the step runs: between the last block's
        forward and its backward (the region's end), split the ``top`` window there and
        count, per block, the bytes of its forward window that die (its cached casts)."""
        if self.phase[0] != "top":
            self.real_clear()
            return
        line, tracker = self.line, self.tracker
        if line.top_pre_peak is None:
            line.top_pre_peak = tracker.close_window(self.window)
            self.window = tracker.open_window()
            line.exit_freed = [0] * len(line.fwd_start)
        for seq, nbytes in tracker.freed_by(self.real_clear):
            i = bisect.bisect_right(self.seq, seq) - 1
            if 0 <= i < len(line.exit_freed):  # allocated in block i's forward window
                line.exit_freed[i] += nbytes
        self.window.peak = self.window.start = tracker.current_bytes

    def backward_start(self, i: int) -> None:
        if self.line.bwd_start[i] is None:
            self.line.bwd_start[i] = self._switch(("bwd", i))

    def finish(self) -> None:
        """Close the last window (backward has returned); read the bytes alive now."""
        self._switch(("end", -1))
        self.line.end_bytes = self.tracker.current_bytes
        self.line.end_grads = grad_bytes(self.params, self.counted)

    def remove(self) -> None:
        torch.clear_autocast_cache = self.real_clear  # type: ignore[assignment]
        self.tracker.close_window(self.window)
        for h in self.handles:
            h.remove()


class _BackwardStart:
    """Gradient hook on a block's outputs: its backward window starts."""

    def __init__(self, windows: _Windows, i: int) -> None:
        self.windows = windows
        self.i = i

    def __call__(self, _: Any) -> None:
        self.windows.backward_start(self.i)


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        sa, sb = a.untyped_storage(), b.untyped_storage()
        return bool(sa.nbytes() and sa.data_ptr() == sb.data_ptr())  # empty ones share none
    except (RuntimeError, NotImplementedError):  # no storage (a tensor subclass)
        return False


class _InputFrees:
    """For the step under ``keep``: the bytes of each block's output that die while the next
    block runs (the next block saves none of it and nothing else holds it), and for the last
    block by the end of the model's forward (the head saves none of it); the shared
    arguments (``shared``). For that step and the one under ``offload``: each block's
    inputs alive when its window ends and dead when forward returns (``held_to_end``).

    The step model adds each block's bytes at its own decision, so a free that happens only
    because the block before does not hold its output is a pair effect: under ``selective``
    the block's cache can hold that output (:func:`profile` counts it as held)."""

    def __init__(
        self,
        model: nn.Module,
        names: Sequence[str],
        blocks: dict[str, nn.Module],
        inputs: Sequence[torch.Tensor],
    ):
        n = len(names)
        self.freed = [0] * n
        # tensors passed to two or more blocks that the model's forward made (not its
        # inputs, parameters or buffers, nor what one block passes to the next)
        self.outside = {id(t) for t in inputs}
        self.outside |= {id(t) for t in model.parameters()} | {id(t) for t in model.buffers()}
        self.args: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}  # id -> (ref, blocks)
        self.arg_sizes: dict[int, list[tuple[weakref.ref[torch.Tensor], int]]] = {}
        self.out_sizes: list[tuple[weakref.ref[torch.Tensor], int]] = []  # the last block's
        self.last = n - 1
        self.shared = 0
        self.outs: list[list[weakref.ref[torch.Tensor]]] = [[] for _ in range(n)]
        self.passed: list[list[tuple[weakref.ref[torch.Tensor], int]]] = [[] for _ in range(n)]
        # each block's tensor arguments (but the model's inputs, parameters and buffers), and
        # those of them still alive when its window ends (the next block starts; the last
        # block's: when it returns): the ones that then die when the forward returns are
        # held into backward only by a checkpoint of the block (``held_to_end``)
        self.inputs: list[list[tuple[weakref.ref[torch.Tensor], int]]] = [[] for _ in range(n)]
        self.alive: list[list[tuple[weakref.ref[torch.Tensor], int]]] = [[] for _ in range(n)]
        self.held_to_end = [0] * n
        self.many: set[int] = set()  # storages of tensors passed to two or more blocks
        index = {name: i for i, name in enumerate(names)}
        self.handles = []
        for name, m in blocks.items():
            i = index[name]
            self.handles.append(m.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self.handles.append(m.register_forward_hook(self._post(i)))
        self.handles.append(model.register_forward_hook(self._end))

    # Read when the block after next starts (the model's loop variable has moved on by
    # then; a hook of the next block itself still sees its arguments alive).
    def _pre(self, i: int) -> Callable[..., None]:
        def hook(module: Any, args: Any, kwargs: Any) -> None:
            if is_recomputing():
                return
            got: list[torch.Tensor] = []
            tensors_in((args, kwargs), got)
            self._seen(got, i)
            mine = [t for t in got if id(t) not in self.outside and not _storage(t) & self.many]
            self.inputs[i] = _sizes([weakref.ref(t) for t in mine])
            if i == 0:
                return
            self.alive[i - 1] = [(r, b) for r, b in self.inputs[i - 1] if r() is not None]
            self.passed[i - 1] = _sizes([r for r in self.outs[i - 1] if any(r() is t for t in got)])
            if i >= 2:
                self.freed[i - 2] = _dead(self.passed[i - 2])

        return hook

    def _seen(self, got: list[torch.Tensor], i: int) -> None:
        prev = {id(t) for r in self.outs[i - 1] if (t := r()) is not None} if i else set()
        for t in got:
            if id(t) in self.outside or id(t) in prev:
                continue
            ref, count = self.args.get(id(t), (None, 0))
            if ref is None or ref() is not t:
                ref, count = weakref.ref(t), 0
                self.arg_sizes[id(t)] = _sizes([ref])  # read while it is alive
            self.args[id(t)] = (ref, count + 1)
            if count + 1 == 2:  # shared: not one block's input (Profile.shared_bytes); from
                self.many |= _storage(t)  # here on ``many`` keeps it out as it is recorded
                for j in range(i):
                    self.inputs[j] = [(r, b) for r, b in self.inputs[j] if r() is not t]
                    self.alive[j] = [(r, b) for r, b in self.alive[j] if r() is not t]

    def _post(self, i: int) -> Callable[..., None]:
        def hook(module: Any, args: Any, out: Any) -> None:
            if is_recomputing():
                return
            got: list[torch.Tensor] = []
            tensors_in(out, got)
            self.outs[i] = [weakref.ref(t) for t in got]
            if i == self.last:
                self.out_sizes = _sizes(self.outs[i])
                self.alive[i] = [(r, b) for r, b in self.inputs[i] if r() is not None]

        return hook

    def _end(self, module: Any, args: Any, out: Any) -> None:
        """The model's forward returned: what the last two blocks passed on, and the shared
        arguments, are read now."""
        last = self.last
        if last >= 1:
            self.freed[last - 1] = _dead(self.passed[last - 1])
        self.freed[last] = _dead(self.out_sizes)
        shared = [
            s for key, (_, count) in self.args.items() if count >= 2 for s in self.arg_sizes[key]
        ]
        self.shared = _dead(shared)
        self.held_to_end = [_dead(alive) for alive in self.alive]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _storage(t: torch.Tensor) -> set[int]:
    """``{data_ptr}`` of ``t``'s storage (empty for none: a tensor subclass, an empty one)."""
    try:
        st = t.untyped_storage()
        return {st.data_ptr()} if st.nbytes() else set()
    except (RuntimeError, NotImplementedError):
        return set()


def _dead(sized: list[tuple[weakref.ref[torch.Tensor], int]]) -> int:
    return sum(b for r, b in sized if r() is None)


def _sizes(refs: list[weakref.ref[torch.Tensor]]) -> list[tuple[weakref.ref[torch.Tensor], int]]:
    """Each live tensor's storage bytes, each storage once."""
    out, seen = [], set()
    for r in refs:
        t = r()
        if t is None:
            continue
        try:
            st = t.untyped_storage()
            key, nbytes = st.data_ptr(), st.nbytes()
        except (RuntimeError, NotImplementedError):  # no storage (a tensor subclass)
            continue
        if nbytes and key not in seen:
            seen.add(key)
            out.append((r, nbytes))
    return out


def _offload_inputs(
    model: nn.Module,
    blocks: dict[str, nn.Module],
    names: Sequence[str],
    args: Any,
    kwargs: Any,
    state: Any,
    before: Sequence[str],
) -> tuple[list[int], list[int]]:
    """For each block, the bytes of its first argument (the input a span starting there
    offloads) when nothing but the block itself holds it on the device once the block has
    returned, whatever decision of ``before`` the block before takes; 0 where something does
    (that block's graph saves its output, the model's code keeps it) or for a last block.
    Second, per block, the bytes of that argument when it dies as the block returns with
    every block offloaded but lives on when the block before is kept or selective (its
    ``tanh`` or ``relu`` saved it): the ``offload`` line then counts it freed, a pair effect.

    Forwards with gradients, no backward: every block under ``offload`` (its saved tensors in
    host memory, so it holds its input on the device only while it runs), then, for each
    ``d`` in ``before``, every other block under ``d`` (the blocks after them are probed).
    A block's input is held when its storage is still alive as the next block starts.
    """
    n = len(names)
    size = [0] * n
    held = [n < 2] * (n - 1) + [True]  # a span needs a block after its first
    alone = [False] * n  # freed once the block returns when every block is offloaded
    by_before = [False] * n  # ... but held when the block before is kept or selective
    mods = list(blocks.values())
    patterns = [["offload"] * n] + [
        [d if i % 2 == parity else "offload" for i in range(n)] for d in before for parity in (0, 1)
    ]
    for k, pattern in enumerate(patterns):
        refs: list[Any] = [None] * n

        def pre(i: int, refs: list[Any] = refs, pattern: list[str] = pattern, k: int = k) -> Any:
            def hook(module: Any, args: Any) -> None:
                if i >= 1 and refs[i - 1] is not None and pattern[i - 1] == "offload":
                    alive = refs[i - 1]() is not None
                    if k == 0:
                        alone[i - 1] = not alive
                    elif alive:
                        by_before[i - 1] = True
                    if alive:
                        held[i - 1] = True
                first = args[0] if args else None
                if isinstance(first, torch.Tensor) and first.requires_grad:
                    st = first.untyped_storage()
                    refs[i] = weakref.ref(st)
                    size[i] = st.nbytes()
                else:
                    held[i] = True  # no tensor argument a span could offload

            return hook

        for m, d in zip(mods, pattern):
            apply_decision(m, d)
        handles = [m.register_forward_pre_hook(pre(i)) for i, m in enumerate(mods)]
        try:
            state.reset_rng()
            fresh_region()
            out = model(*args, **kwargs)
            del out
        finally:
            for h in handles:
                h.remove()
    free = [0 if h else b for h, b in zip(held, size)]
    pair = [b if a and p else 0 for a, p, b in zip(alone, by_before, size)]
    return free, pair


def _kept_outputs(
    model: nn.Module,
    blocks: dict[str, nn.Module],
    names: Sequence[str],
    args: Any,
    kwargs: Any,
    state: Any,
) -> list[bool]:
    """For each block, whether the output it passed to the next block is still alive when
    the block after next starts, in a forward without gradients (nothing but the model's
    own code keeps a tensor then; see ``Profile.kept_outputs``). Outputs the next block did
    not receive (a cache the model collects) are not a span's to free; an output that a
    later block returns again, or a view of it, is the later block's. All ``False`` when
    that forward fails."""
    outs: list[list[weakref.ref[torch.Tensor]]] = [[] for _ in names]
    passed: list[list[weakref.ref[torch.Tensor]]] = [[] for _ in names]
    kept = [False] * len(names)
    index = {n: i for i, n in enumerate(names)}

    def pre(name: str) -> Callable[..., None]:
        def hook(module: Any, args: Any, kwargs: Any) -> None:
            i = index[name]
            got: list[torch.Tensor] = []
            tensors_in((args, kwargs), got)
            if i >= 1:  # what the block before handed to this one
                passed[i - 1] = [r for r in outs[i - 1] if any(r() is t for t in got)]
            j = i - 2
            if j < 0:
                return
            alive = [t for r in passed[j] if (t := r()) is not None]
            later = [t for r in outs[j + 1] if (t := r()) is not None] + got
            kept[j] = any(not any(t is u or _shares_storage(t, u) for u in later) for t in alive)

        return hook

    def post(name: str) -> Callable[..., None]:
        def hook(module: Any, args: Any, kwargs: Any, out: Any) -> None:
            got: list[torch.Tensor] = []
            tensors_in(out, got)
            outs[index[name]] = [weakref.ref(t) for t in got]

        return hook

    handles = [m.register_forward_pre_hook(pre(n), with_kwargs=True) for n, m in blocks.items()]
    handles += [m.register_forward_hook(post(n), with_kwargs=True) for n, m in blocks.items()]
    try:
        state.reset_rng()
        with torch.no_grad(), warnings.catch_warnings():
            # a model that checkpoints inside with torch's reentrant variant warns that no
            # input requires grad: true here, and not the user's concern
            warnings.simplefilter("ignore")
            out = model(*args, **kwargs)
        del out
    except Exception:  # a model that needs gradients in forward: no limit recorded
        _log.debug("remat.profile: the forward without gradients failed", exc_info=True)
        return [False] * len(names)
    finally:
        for h in handles:
            h.remove()
    return kept


class _CallCount:
    """How often each candidate block runs in one forward (recomputes not counted),
    whether each block received a tensor the block called just before it returned (the
    blocks a span may join: nothing of the model's own code between them), and which
    blocks change one of their input tensors in place (``nn.ReLU(inplace=True)`` as a
    block: see :func:`profile`). A block that returns a view of the previous block's
    output is not chained to it."""

    def __init__(self, names: Sequence[str]) -> None:
        self.counts: dict[str, int] = {}
        self.names = list(names)
        self.chained = [False] * max(len(self.names) - 1, 0)
        self.last: str | None = None  # the block that returned last
        self.returned: list[weakref.ref[torch.Tensor]] = []
        self.mutating: set[str] = set()
        self.versions: dict[str, list[tuple[torch.Tensor, int]]] = {}  # the running block's

    def hook(self, name: str) -> Callable[[Any, Any, Any], None]:
        def pre(module: Any, args: Any, kwargs: Any) -> None:
            if is_recomputing():
                return
            self.counts[name] = self.counts.get(name, 0) + 1
            got: list[torch.Tensor] = []
            tensors_in((args, kwargs), got)
            self.versions[name] = [(t, t._version) for t in got]
            i = self.names.index(name)
            if i > 0 and self.last == self.names[i - 1]:
                self.chained[i - 1] = any(r() is t for r in self.returned for t in got)

        return pre

    def post(self, name: str) -> Callable[[Any, Any, Any, Any], None]:
        def hook(module: Any, args: Any, kwargs: Any, out: Any) -> None:
            if is_recomputing():
                return
            if any(t._version != v for t, v in self.versions.pop(name, [])):
                self.mutating.add(name)
            outs: list[torch.Tensor] = []
            tensors_in(out, outs)
            i = self.names.index(name)
            if i > 0 and self.chained[i - 1]:
                # A view of what the previous block returned (a Flatten, a reshape): a span
                # that ends here would keep that output alive, which the step model counts
                # as freed. Such blocks do not join the block before them.
                got = [t for r in self.returned if (t := r()) is not None]
                if any(_shares_storage(o, t) for o in outs for t in got):
                    self.chained[i - 1] = False
            self.last = name
            self.returned = [weakref.ref(t) for t in outs]

        return hook

    def check(self, names: Sequence[str]) -> None:
        """Raise unless every block ran exactly once: the planner models a chain."""
        bad = {n: self.counts.get(n, 0) for n in names if self.counts.get(n, 0) != 1}
        if bad:
            listed = ", ".join(f"{n!r} ran {c} times" for n, c in bad.items())
            raise ValueError(
                f"remat.profile: every candidate block must run exactly once per forward (the "
                f"planner models a chain of blocks), but {listed}. Pass check_fn=lambda name, "
                "module: ... that selects only blocks the model calls once per step (a block "
                "reused twice, or skipped, cannot be planned alone)."
            )
