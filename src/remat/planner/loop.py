"""The training loop the planner models: its options as one type, and the one step runner.

:class:`Loop` is what travels from :func:`remat.auto_checkpoint` (and the integrations'
callbacks) through :class:`~remat.planner.shapes.ShapePlans` and
:class:`~remat.planner.shaped.ProfileSource` to :func:`remat.profile`'s steps: the
optimizer, how gradients are cleared, the loss, the candidate blocks, the timer and
whether ranks agree. Users still pass these as keywords of the public functions.

:class:`Step` runs one step of the default loop (:mod:`remat.planner.stepmodel`) on the
example inputs, again and again from the same RNG state: gradients cleared as the loop
clears them, forward, loss, backward (and ``optimizer.step()`` when asked), ``out`` and
``loss`` alive until backward ends. :func:`remat.profile`'s instrumented steps and
:func:`remat.measure_peak`'s measured ones are both its calls.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..engine.tree import tensors_in
from ..modules.modelinfo import counted_device, device_of, loss_of
from .amp import fresh_region, outside
from .inputs import Inputs
from .meta import check_not_mixed
from .state import StepState
from .types import Timer


@dataclasses.dataclass(frozen=True)
class Loop:
    """The options of the user's training loop, as :func:`remat.profile` takes them.

    Attributes:
        optimizer: the optimizer the loop steps (``None``: no optimizer step).
        set_to_none: gradients freed before each step (``zero_grad()``'s default) or kept
            and zeroed (``False``).
        loss_fn: output -> scalar loss (``None``: the default loss).
        check_fn: ``check_fn(name, module)`` picks the candidate blocks (``None``: the
            repeated blocks).
        timer: the cost measure, ``"time"``, ``"measured"`` or ``"flops"``.
        distributed: whether the ranks of a process group profile and plan together
            (``None``: when one of two or more ranks is initialized).
        compile: each block compiled on its own, the decisions the partitioner's budgets
            (:mod:`remat.planner.regional`).

    Example:
        >>> loop = Loop(set_to_none=False, timer="flops")
        >>> loop.keywords()["set_to_none"], loop.keywords()["timer"]
        (False, 'flops')
    """

    optimizer: torch.optim.Optimizer | None = None
    set_to_none: bool = True
    loss_fn: Callable[[Any], torch.Tensor] | None = None
    check_fn: Callable[[str, nn.Module], bool] | None = None
    timer: Timer = "time"
    distributed: bool | None = None
    compile: bool = False

    def keywords(self) -> dict[str, Any]:
        """The options as the keywords of :func:`remat.auto_checkpoint` and
        :func:`remat.profile`."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


class Step:
    """One training step of ``loop`` on ``inputs``, run again and again from the same RNG
    state; what the steps change is recorded in ``state`` and put back by the caller
    (``state.restore()``).

    Args:
        model: the model.
        inputs: its example inputs.
        loop: the loop's options (its optimizer, ``set_to_none`` and ``loss_fn``).
        threads: CPU only: with ``1`` each step's time is thread CPU time, else wall time.
        target: from shapes: the device the meta tensors stand for (``None``: measured on
            the model's device).
        where: the function named in the default loss's errors.
        device: the model's device where the caller found it (and checked that the model
            and inputs are on one device) already; ``None``: found and checked here.

    Attributes:
        device: the model's device; ``counted`` the device whose bytes are counted.
        costs: each step's time.
    """

    def __init__(
        self,
        model: nn.Module,
        inputs: Inputs,
        loop: Loop,
        *,
        threads: int | None = None,
        target: torch.device | None = None,
        where: str = "remat.profile",
        device: torch.device | None = None,
    ) -> None:
        self.model, self.loop, self.where = model, loop, where
        self.args, self.kwargs = inputs.args, inputs.kwargs
        if device is None:
            check_not_mixed(model, (self.args, self.kwargs), where)
            device = device_of(model, (self.args, self.kwargs))
        self.threads = threads
        self.device = device
        self.target = target
        # from shapes for CPU, everything counts (the optimizer's CPU step counters too)
        real = target if target is not None else self.device
        self.counted = counted_device(real) if target is None or real.type == "cpu" else self.device
        self.inputs: list[torch.Tensor] = []
        tensors_in((self.args, self.kwargs), self.inputs)
        leaves = [t for t in self.inputs if t.is_leaf and t.requires_grad]
        self.state = StepState(model, leaves, loop.optimizer, self.device, self.inputs)
        cpu_one = self.device.type == "cpu" and threads == 1
        self.now = time.thread_time if cpu_one else time.perf_counter
        self.costs: list[float] = []

    def clear_grads(self) -> None:
        """Clear the gradients as the loop does: freed, or zeroed in place."""
        if self.loop.set_to_none:
            for t in self.state.leaves:
                t.grad = None
        else:
            for t in self.state.leaves:
                if t.grad is not None:
                    t.grad.detach_().zero_()

    def __call__(self, end: Callable[[], None] | None = None) -> None:
        """One step, timed: :meth:`begin`, then :meth:`run` (``end`` as it takes it)."""
        start = self.now()
        self.begin()
        self.run(end)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.costs.append(self.now() - start)

    def begin(self) -> None:
        """The step's start: the RNG (and inputs changed in place) put back, a fresh
        autocast cache (in the caller's autocast region: one iteration of the AMP recipe)."""
        self.state.reset_rng()
        fresh_region()

    def run(
        self,
        end: Callable[[], None] | None = None,
        optimizer_step: bool = False,
        before_optimizer: Callable[[], None] | None = None,
    ) -> None:
        """Forward, loss, backward (then ``optimizer.step()`` with ``optimizer_step``, after
        ``before_optimizer()``); ``end`` is called after them while ``out`` and ``loss`` are
        alive, as in the user's loop."""
        out = self.model(*self.args, **self.kwargs)
        loss = loss_of(out, self.loop.loss_fn, self.where)
        with outside():
            loss.backward()
            if optimizer_step and self.loop.optimizer is not None:
                if before_optimizer is not None:
                    before_optimizer()
                self.loop.optimizer.step()
        if end is not None:
            end()
        del out, loss

    def timed(self) -> None:
        """One step from cleared gradients (the blocks' timing runs it)."""
        self.clear_grads()
        self()
