"""Plan vs actual: a training step's measured peak beside the plan's prediction and the budget.

:class:`PeakMeter` measures the peak of each step of a training loop in the units of
a budget (:func:`remat.plan`): absolute bytes on the model's device, parameters,
buffers, gradients, optimizer state, inputs and activations together.

* On CPU (and any device without allocator statistics) it counts tensor storages
  with :func:`remat.memory.track`: the tensors the step starts with (parameters,
  buffers, gradients, optimizer state, the inputs given to :meth:`PeakMeter.start`
  or :meth:`PeakMeter.include`) are counted from the start
  (:meth:`~remat.memory.MemoryTracker.include`), everything allocated during the
  step as it is allocated, and every storage as freed when it dies. This is what
  :func:`remat.measure_peak` and the plan's ``predicted_peak_bytes`` count.
* On CUDA it reads the allocator (``torch.cuda.max_memory_allocated`` after
  ``reset_peak_memory_stats`` at the step's start): the number the budget is
  defined by, scratch inside operators included (``Plan.scratch_bytes``), and no
  Python call per operator.

Example:
    >>> import torch, remat
    >>> from remat.integrations import PeakMeter
    >>> model = torch.nn.Linear(8, 8)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> x = torch.randn(4, 8)
    >>> meter = PeakMeter(budget=10_000)
    >>> for _ in range(2):
    ...     with meter.step(model, x, optimizer=opt):
    ...         opt.zero_grad()
    ...         out = model(x)
    ...         out.sum().backward()
    ...         opt.step()
    >>> [c.peak_bytes for c in meter.checks]       # the default loop's: remat.measure_peak's
    [840, 840]
    >>> remat.measure_peak(model, x, optimizer=opt)
    840
    >>> meter.last.over_budget
    False
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .. import memory
from ..engine.bytes import fmt_bytes
from ..engine.tree import tensors_in
from ..modules.modelinfo import device_of
from ..planner.state import optimizer_tensors, trainable

__all__ = ["PeakCheck", "PeakMeter"]


@dataclasses.dataclass(frozen=True)
class PeakCheck:
    """One step's measured peak beside the plan's prediction and the budget (bytes).

    Attributes:
        step: the step's number, as the loop counts (the Trainer's global step, ...).
        peak_bytes: the measured step peak, in a budget's units: parameters, buffers,
            inputs, gradients, optimizer state and activations together (the number
            :func:`remat.measure_peak` and the plan's table give).
        predicted_bytes: the plan's ``predicted_peak_bytes`` (tensor bytes; on CUDA the
            allocator may add up to the plan's ``scratch_bytes``); ``None`` without a plan.
        budget_bytes: the budget; ``None`` without one.
        source: ``"tensors"`` (:func:`remat.memory.track`) or ``"allocator"`` (CUDA's).
    """

    step: int
    peak_bytes: int
    predicted_bytes: int | None
    budget_bytes: int | None
    source: str

    @property
    def over_budget(self) -> bool:
        """Whether the measured peak is above the budget."""
        return self.budget_bytes is not None and self.peak_bytes > self.budget_bytes

    def logs(self, prefix: str = "remat/") -> dict[str, int]:
        """The numbers as a flat dict for a trainer's logs: ``peak_bytes``,
        ``predicted_bytes``, ``budget_bytes`` (those known), each with ``prefix``."""
        out = {f"{prefix}peak_bytes": self.peak_bytes}
        if self.predicted_bytes is not None:
            out[f"{prefix}predicted_bytes"] = self.predicted_bytes
        if self.budget_bytes is not None:
            out[f"{prefix}budget_bytes"] = self.budget_bytes
        return out

    def __str__(self) -> str:
        parts = [f"step {self.step}: peak {fmt_bytes(self.peak_bytes)}"]
        if self.predicted_bytes is not None:
            parts.append(f"predicted {fmt_bytes(self.predicted_bytes)}")
        if self.budget_bytes is not None:
            verdict = "OVER" if self.over_budget else "within"
            parts.append(f"budget {fmt_bytes(self.budget_bytes)} ({verdict})")
        return ", ".join(parts)


def _step_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Parameters, buffers, existing gradients and optimizer state: what a step starts with."""
    params = list({id(p): p for p in [*model.parameters(), *trainable(model, optimizer)]}.values())
    grads = [p.grad for p in params if p.grad is not None]
    return [*params, *model.buffers(), *grads, *optimizer_tensors(optimizer)]


class PeakMeter:
    """Measures the peak of each training step and compares it with a plan and a budget.

    Call :meth:`start` where a step begins (before ``zero_grad``/forward) and :meth:`stop`
    where it ends (after ``optimizer.step()``), or use :meth:`step` around it. Each
    :meth:`stop` appends a :class:`PeakCheck` to :attr:`checks` and, when the peak is
    over the budget, warns (``RuntimeWarning``). A meter measures one step at a time,
    in the thread that started it.

    Args:
        plan: the applied :class:`~remat.Plan`: its ``predicted_peak_bytes`` and
            ``budget_bytes`` go into each check. ``None``: measure only.
        budget: the budget in bytes (default: the plan's ``budget_bytes``).

    Attributes:
        checks: the :class:`PeakCheck` of every measured step, in order.
    """

    def __init__(self, plan: Any = None, *, budget: int | None = None) -> None:
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0
        ):
            raise ValueError(
                f"PeakMeter: budget must be a positive number of bytes or None, got {budget!r}; "
                "pass the plan's budget_bytes (or leave it to the plan)."
            )
        self.plan = plan
        self.budget = budget
        self.checks: list[PeakCheck] = []
        self._stack: contextlib.ExitStack | None = None
        self._tracker: memory.MemoryTracker | None = None
        self._cuda: torch.device | None = None
        self._step = 0

    @property
    def budget_bytes(self) -> int | None:
        """The budget the checks compare with (the explicit one, else the plan's)."""
        if self.budget is not None:
            return self.budget
        return None if self.plan is None else int(self.plan.budget_bytes)

    @property
    def last(self) -> PeakCheck | None:
        """The latest check, ``None`` before the first."""
        return self.checks[-1] if self.checks else None

    @property
    def running(self) -> bool:
        """Whether a step is being measured (between :meth:`start` and :meth:`stop`)."""
        return self._stack is not None

    def start(
        self,
        model: nn.Module,
        *inputs: Any,
        optimizer: torch.optim.Optimizer | None = None,
        step: int | None = None,
    ) -> None:
        """Begin measuring a step of ``model`` (with ``optimizer`` and ``inputs``).

        Raises:
            RuntimeError: a step is being measured already (call :meth:`stop` first).
        """
        if self._stack is not None:
            raise RuntimeError(
                "PeakMeter.start: a step is being measured already; call stop() at the end of "
                "each step (or close() to drop it)."
            )
        self._step = len(self.checks) if step is None else step
        device = device_of(model, inputs)
        stack = contextlib.ExitStack()
        if device.type == "cuda":
            self._cuda = device
            torch.cuda.reset_peak_memory_stats(device)
        else:
            self._cuda = None
            self._tracker = stack.enter_context(memory.track(device))
            self._tracker.include(_step_tensors(model, optimizer))
        self._stack = stack
        self.include(*inputs)

    def include(self, *inputs: Any) -> None:
        """Count the tensors inside ``inputs`` (nested in lists, dicts, ...) as alive in the
        step from now on; those counted already are not counted again (a no-op on CUDA,
        where the allocator sees everything, and when no step is being measured)."""
        if self._tracker is not None:
            found: list[torch.Tensor] = []
            tensors_in(inputs, found)
            self._tracker.include(found)

    def reset_peak(self) -> None:
        """Restart the step's peak from the bytes alive now (after work inside the step that
        is not the step's, such as planning it)."""
        if self._tracker is not None:
            self._tracker.reset_peak()
        elif self._cuda is not None:
            torch.cuda.reset_peak_memory_stats(self._cuda)

    def stop(self) -> PeakCheck:
        """End the step: its :class:`PeakCheck`, also appended to :attr:`checks`.

        Raises:
            RuntimeError: no step is being measured.
        """
        if self._stack is None:
            raise RuntimeError("PeakMeter.stop: no step is being measured; call start() first.")
        if self._cuda is not None:
            peak, source = int(torch.cuda.max_memory_allocated(self._cuda)), "allocator"
        else:
            assert self._tracker is not None
            peak, source = self._tracker.peak_bytes, "tensors"
        self.close()
        plan = self.plan
        check = PeakCheck(
            step=self._step,
            peak_bytes=peak,
            predicted_bytes=None if plan is None else int(plan.predicted_peak_bytes),
            budget_bytes=self.budget_bytes,
            source=source,
        )
        self.checks.append(check)
        if check.over_budget:
            warnings.warn(
                f"remat: the measured peak of step {check.step}, {check.peak_bytes} bytes, is over "
                f"the budget of {check.budget_bytes} bytes ({check}). Plan for a lower budget, or "
                "check that the plan was made for this loop (optimizer, gradient accumulation, "
                "mixed precision, batch shape).",
                RuntimeWarning,
                stacklevel=2,
            )
        return check

    def close(self) -> None:
        """Stop measuring without a check (also after an exception inside the step)."""
        stack, self._stack, self._tracker, self._cuda = self._stack, None, None, None
        if stack is not None:
            stack.close()

    @contextlib.contextmanager
    def step(
        self,
        model: nn.Module,
        *inputs: Any,
        optimizer: torch.optim.Optimizer | None = None,
        step: int | None = None,
    ) -> Iterator[PeakMeter]:
        """Measure the step run inside the block (:meth:`start` ... :meth:`stop`); an
        exception inside leaves no check and the meter closed."""
        self.start(model, *inputs, optimizer=optimizer, step=step)
        try:
            yield self
        except BaseException:
            self.close()
            raise
        self.stop()
