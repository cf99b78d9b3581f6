"""``remat.profile``: measure what each candidate block costs under each decision.

A few instrumented training steps, one per decision, with every candidate
block under that decision (all ``keep``, all ``recompute``, all ``selective``,
and all ``offload`` on a device). Each step runs from the same RNG state,
with gradients allocated beforehand so that :func:`remat.memory.track_modules`
sees activations only. Per block it records the terms of the planner's model
(:mod:`remat.planner.model`): bytes retained after its forward, the excess peak during
its forward and during its backward, and the bytes alive when its forward and
its backward start (under ``keep``); plus ``top``, the peak between the last
block's forward and its backward (loss, logits).

Time is measured per block, forward plus backward (recompute included), and
the cost of a decision is its extra time over ``keep``. On CPU the steps run
with one thread and use thread CPU time (``time.thread_time``), the minimum
of ``repeats`` runs; on a GPU, wall time around synchronised boundaries. With
``timer="flops"`` the costs are the FLOPs a decision recomputes
(``torch.utils.flop_counter``): deterministic, for tests and for comparing
plans across machines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from .. import memory
from .._config import is_recomputing
from .._modelinfo import (
    BufferSnapshot,
    candidates,
    check_grad_enabled,
    counted_device,
    device_of,
    loss_of,
)
from .._tree import tensors_in
from .apply import apply_decision, restore_state, snapshot_state
from .model import DECISIONS, BlockCosts


@dataclasses.dataclass
class Profile:
    """Measured costs of a model's candidate blocks; input of :func:`remat.plan`.

    Attributes:
        blocks: one :class:`~remat.planner.model.BlockCosts` per candidate, in call order.
        top: peak bytes between the last block's forward and its backward (all ``keep``).
        unchecked_peak_bytes: peak activation bytes of a step with every block kept.
        decisions: the decisions that were measured.
        cost_unit: ``"s"`` or ``"flop"``.
        input_shapes: shapes of the tensor inputs the profile is valid for.
        device: where it was measured.
        torch_version: the torch it was measured with.
        step_cost: cost of one whole step with every block kept, in ``cost_unit``
            (so that ``1 + plan.predicted_overhead_s / step_cost`` is a predicted time ratio).
    """

    blocks: list[BlockCosts]
    top: int
    unchecked_peak_bytes: int
    decisions: list[str]
    cost_unit: str
    input_shapes: list[list[int]]
    device: str
    torch_version: str
    step_cost: float = 0.0

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


class _Timer:
    """Per-block forward and backward time from module and gradient hooks."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.fwd: dict[str, float] = {}
        self.bwd: dict[str, float] = {}
        self.handles: list[Any] = []

    def attach(self, name: str, module: nn.Module) -> None:
        starts: dict[str, float] = {}

        def pre(mod: Any, args: Any) -> None:
            starts["fwd"] = self.clock()

        def post(mod: Any, args: Any, out: Any) -> None:
            self.fwd[name] = self.clock() - starts["fwd"]
            outs: list[torch.Tensor] = []
            ins: list[torch.Tensor] = []
            tensors_in(out, outs)
            tensors_in(args, ins)
            outs = [t for t in outs if t.requires_grad]
            ends = [t for t in ins if t.requires_grad] or [
                p for p in mod.parameters() if p.requires_grad
            ]
            if outs and ends:

                def b_start(_: Any) -> None:
                    starts.setdefault("bwd", self.clock())

                def b_end(_: Any) -> None:
                    self.bwd[name] = self.clock() - starts.pop("bwd", self.clock())

                torch.autograd.graph.register_multi_grad_hook(outs, b_start, mode="any")
                torch.autograd.graph.register_multi_grad_hook(ends, b_end, mode="all")

        self.handles.append(module.register_forward_pre_hook(pre))
        self.handles.append(module.register_forward_hook(post))

    def totals(self) -> dict[str, float]:
        """Forward plus backward time of each block in the last step."""
        return {n: self.fwd.get(n, 0.0) + self.bwd.get(n, 0.0) for n in self.fwd}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@contextlib.contextmanager
def _threads(device: torch.device, threads: int | None) -> Iterator[None]:
    if device.type != "cpu" or threads is None:
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def profile(
    model: nn.Module,
    *args: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    check_fn: Callable[[str, nn.Module], bool] | None = None,
    decisions: Sequence[str] | None = None,
    timer: str = "time",
    repeats: int = 1,
    threads: int | None = 1,
    **kwargs: Any,
) -> Profile:
    """Measure memory and time of each candidate block under each decision.

    Runs ``1 + len(decisions) * (1 + repeats)`` training steps (forward,
    loss, backward; ``1 + len(decisions)`` with ``timer="flops"``): a warm-up,
    then per decision one step that measures memory (at torch's thread count)
    and ``repeats`` timed ones. The model's parameters are not changed, its buffers
    (BatchNorm running statistics and counters) are put back as they were,
    its gradients are left zeroed and its candidate blocks are left as they were.

    Args:
        model: the model.
        *args: example inputs (the profile is valid for their shapes).
        loss_fn: output -> scalar loss; default: sum of the floating outputs.
        check_fn: ``check_fn(name, module)`` picks the candidate blocks;
            default: the children of the largest ``ModuleList``/``Sequential``.
        decisions: what to measure; default ``keep``, ``recompute``,
            ``selective``, and ``offload`` on a device.
        timer: ``"time"`` (seconds) or ``"flops"`` (recomputed FLOPs, deterministic).
            FLOPs count what ``torch.utils.flop_counter`` counts (matmuls,
            convolutions, attention): recomputing norms and activations counts as
            free, so ``selective`` costs 0 under this timer. Use it for tests and
            cross-machine comparisons; plan real runs with ``"time"``.
        repeats: timed steps per decision (the minimum time is kept); the step
            that measures memory is not timed, its tracking would inflate the time.
        threads: CPU only: ``1`` (default) times with one thread and thread CPU
            time, the steadiest numbers; another number sets torch's threads and
            ``None`` keeps them, both with wall time, closer to a multi-threaded
            training run.
        **kwargs: keyword inputs of the model.

    Example:
        >>> import torch, remat
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
        >>> prof = remat.profile(model, torch.randn(8, 16), timer="flops")
        >>> [b.name for b in prof.blocks]
        ['0', '1', '2']
    """
    check_grad_enabled("remat.profile")
    if timer not in ("time", "flops"):
        raise ValueError(f"remat.profile: timer must be 'time' or 'flops', got {timer!r}.")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"remat.profile: repeats must be an int >= 1, got {repeats!r}.")
    device = device_of(model, args)
    if decisions is None:
        decisions = ["keep", "recompute", "selective"] + (
            ["offload"] if device.type != "cpu" else []
        )
    bad = [d for d in decisions if d not in DECISIONS]
    if bad or "keep" not in decisions:
        raise ValueError(
            f"remat.profile: decisions must include 'keep' and come from {list(DECISIONS)}, "
            f"got {list(decisions)}."
        )
    if "offload" in decisions and device.type == "cpu":
        raise ValueError(
            "remat.profile: 'offload' needs a device (on CPU the tensors already live in host "
            "memory); drop it from decisions."
        )
    names = candidates(model, check_fn)
    blocks = {n: model.get_submodule(n) for n in names}
    saved_state = snapshot_state(blocks)
    buffers = BufferSnapshot(model)
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if device.type == "cuda" else None

    step_costs: list[float] = []
    inputs: list[torch.Tensor] = []
    tensors_in((args, kwargs), inputs)
    inputs = [t for t in inputs if t.is_leaf and t.requires_grad]
    input_grads = [(t, t.grad) for t in inputs]  # put back afterwards: the steps are not the user's

    def step() -> None:
        start = time.thread_time() if device.type == "cpu" and threads == 1 else time.perf_counter()
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        loss_of(model(*args, **kwargs), loss_fn).backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        end = time.thread_time() if device.type == "cpu" and threads == 1 else time.perf_counter()
        step_costs.append(end - start)

    keep_step = 0.0
    mem: dict[str, dict[str, memory.ModuleMemory]] = {}
    times: dict[str, dict[str, float]] = {}
    top = unchecked = 0
    tops: dict[str, int] = {}
    try:
        # The inputs' gradients are the profile's own from here on (the user's come back at
        # the end). Warm-up: lazy modules make their parameters, kernels and the allocator
        # warm up (a cold first step is far slower), and every gradient exists from here on
        # and is reused (zeroed in place), so the tracked steps see activations only.
        for t in inputs:
            t.grad = None
        calls = _CallCount()
        count_handles = [m.register_forward_pre_hook(calls.hook(n)) for n, m in blocks.items()]
        try:
            step()
        finally:
            for ch in count_handles:
                ch.remove()
        calls.check(names)
        model.zero_grad(set_to_none=False)
        clock = _clock(device, threads) if timer == "time" else None
        for d in decisions:
            for m in blocks.values():
                apply_decision(m, d)
            last = blocks[names[-1]]
            top_watch = _TopWatch()
            h = last.register_forward_hook(top_watch.forward_end)
            try:
                # Memory: bytes do not depend on threads, so this step runs at full speed;
                # its time is not used (the tracker's per-op work would inflate it).
                with memory.track_modules(blocks, counted_device(device)) as (tracker, stats):
                    top_watch.tracker = tracker
                    step()
            finally:
                h.remove()
            model.zero_grad(set_to_none=False)
            mem[d] = {n: dataclasses.replace(s) for n, s in stats.items()}
            tops[d] = top_watch.peak
            if d == "keep":
                top, unchecked = top_watch.peak, tracker.peak_bytes
            if clock is not None:
                step_costs.clear()
                times[d] = _time_blocks(blocks, step, device, repeats, clock, threads)
                model.zero_grad(set_to_none=False)
                if d == "keep":
                    keep_step = min(step_costs)
        if timer == "flops":
            times = _flop_costs(model, blocks, args, kwargs, loss_fn, decisions)
    finally:
        for t, g in input_grads:
            t.grad = g
        restore_state(blocks, saved_state)
        buffers.restore()
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    costs = []
    saved = dict.fromkeys(decisions, 0)  # bytes each uniform step saved up to this block
    for i, n in enumerate(names):
        keep = mem["keep"][n]
        # What the block leaves alive for the rest of the step: up to the next block's start
        # (the residual add after a block may free its output under keep, while a selective
        # cache holds it), or to its own forward end for the last block.
        if i + 1 < len(names):
            nxt = names[i + 1]
            retained = {d: mem[d][nxt].before_forward - mem[d][n].before_forward for d in decisions}
        else:
            retained = {d: mem[d][n].after_forward - mem[d][n].before_forward for d in decisions}
        bwd_excess = {}
        for d in decisions:
            saved[d] += retained["keep"] - retained[d]
            # Above the start the model assumes (keep's start less what was saved), when more
            # was alive: the last block's output, held by a selective cache but freed after
            # the loss under keep, would otherwise be missing from the prediction.
            assumed = keep.before_backward - saved[d]
            bwd_excess[d] = mem[d][n].backward_peak - min(mem[d][n].before_backward, assumed)
            if n == names[-1] and d in tops:  # the same for the loss and head after it
                bwd_excess[d] = max(bwd_excess[d], tops[d] - assumed)
        costs.append(
            BlockCosts(
                name=n,
                retained=retained,
                fwd_excess={
                    d: mem[d][n].forward_peak - mem[d][n].before_forward for d in decisions
                },
                bwd_excess=bwd_excess,
                cost={
                    d: max(0.0, times[d][n] - times["keep"][n]) if d != "keep" else 0.0
                    for d in decisions
                },
                fwd_start=keep.before_forward,
                bwd_start=keep.before_backward,
                input_bytes=keep.input_bytes,
                param_bytes=keep.param_bytes,
            )
        )
    shapes: list[torch.Tensor] = []
    tensors_in((args, kwargs), shapes)
    return Profile(
        blocks=costs,
        top=top,
        unchecked_peak_bytes=unchecked,
        decisions=list(decisions),
        cost_unit="s" if timer == "time" else "flop",
        input_shapes=[list(t.shape) for t in shapes],
        device=str(device),
        torch_version=torch.__version__,
        step_cost=keep_step if timer == "time" else 3.0 * sum(b.cost["recompute"] for b in costs),
    )


class _CallCount:
    """How often each candidate block runs in one forward (recomputes not counted)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def hook(self, name: str) -> Callable[[Any, Any], None]:
        def pre(module: Any, args: Any) -> None:
            if not is_recomputing():
                self.counts[name] = self.counts.get(name, 0) + 1

        return pre

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


class _TopWatch:
    """Peak between the last block's forward and the start of its backward."""

    def __init__(self) -> None:
        self.tracker: memory.MemoryTracker | None = None
        self.window: memory.Window | None = None
        self.peak = 0

    def forward_end(self, module: Any, args: Any, out: Any) -> None:
        if self.tracker is None:
            return
        self.window = self.tracker.open_window()
        outs: list[torch.Tensor] = []
        tensors_in(out, outs)
        outs = [t for t in outs if t.requires_grad]
        if outs:
            torch.autograd.graph.register_multi_grad_hook(outs, self.backward_start, mode="any")

    def backward_start(self, _: Any) -> None:
        if self.tracker is not None and self.window is not None:
            self.peak = self.tracker.close_window(self.window)
            self.window = None


def _clock(device: torch.device, threads: int | None) -> Callable[[], float]:
    if device.type == "cuda" or threads != 1:

        def clock() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()

        return clock if device.type == "cuda" else time.perf_counter
    return time.thread_time


def _time_blocks(
    blocks: dict[str, nn.Module],
    step: Callable[[], None],
    device: torch.device,
    repeats: int,
    clock: Callable[[], float],
    threads: int | None,
) -> dict[str, float]:
    """Minimum over ``repeats`` steps of each block's forward+backward time."""
    best: dict[str, float] = {}
    timer = _Timer(clock)
    for n, m in blocks.items():
        timer.attach(n, m)
    try:
        with _threads(device, threads):
            for _ in range(repeats):
                timer.fwd.clear()
                timer.bwd.clear()
                step()
                for n, t in timer.totals().items():
                    best[n] = min(best.get(n, t), t)
    finally:
        timer.remove()
    return best


def _flop_costs(
    model: nn.Module,
    blocks: dict[str, nn.Module],
    args: Any,
    kwargs: Any,
    loss_fn: Any,
    decisions: Sequence[str],
) -> dict[str, dict[str, float]]:
    """FLOPs each decision recomputes: the block's forward FLOPs outside the saved ops."""
    from torch.utils.flop_counter import FlopCounterMode

    from ..policies import matmul_ops

    saved = {op.overloadpacket for op in matmul_ops()}
    out: dict[str, dict[str, float]] = {d: {} for d in decisions}
    inputs: dict[str, Any] = {}
    handles = [
        m.register_forward_pre_hook(_InputGrab(n, inputs), with_kwargs=True)
        for n, m in blocks.items()
    ]
    try:
        with torch.no_grad():
            model(*args, **kwargs)  # one forward records every block's inputs
    finally:
        for h in handles:
            h.remove()
    for n, m in blocks.items():
        counter = FlopCounterMode(display=False)
        with torch.no_grad(), counter:
            block_args, block_kwargs = inputs[n]
            m(*block_args, **block_kwargs)
        per_op = counter.get_flop_counts().get("Global", {})
        total = float(sum(per_op.values()))
        unsaved = float(sum(v for op, v in per_op.items() if op not in saved))
        for d in decisions:
            out[d][n] = {"keep": 0.0, "recompute": total, "selective": unsaved, "offload": 0.0}[d]
    return out


class _InputGrab:
    """Forward pre-hook (``with_kwargs=True``) that keeps a block's first inputs, keywords too."""

    def __init__(self, name: str, store: dict[str, Any]) -> None:
        self.name = name
        self.store = store

    def __call__(self, module: Any, args: Any, kwargs: Any) -> None:
        self.store.setdefault(self.name, (args, dict(kwargs)))
