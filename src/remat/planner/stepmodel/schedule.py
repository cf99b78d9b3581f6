"""What a pipeline schedule holds at each moment of one step, on one stage.

``torch.distributed.pipelining``'s single-stage schedules (``ScheduleGPipe``,
``Schedule1F1B``; torch 2.13's ``schedules.py`` and ``stage.py``) run, on each rank, a
sequence of microbatch forwards (``F``) and backwards (``B``). What is alive when one of
them runs, besides what the rank always holds (parameters, optimizer state, the receive
buffers, the batch), is counted here in units of one microbatch's tensors:

* **in flight**: microbatches forwarded and not yet backwarded: the stage keeps each one's
  saved activations and its output (``fwd_cache``) until its backward;
* **outputs held**: outputs of microbatches whose backward is done, still referenced:
  on the last stage by ``output_chunks`` (``step(return_outputs=True)``, the default) or
  by the loop's ``output`` variable; on other stages by a send that keeps its tensor until
  the ``dist.Work`` (or the ``P2POp`` list naming it) is dropped: GPipe keeps every forward
  send's work to the end of the step; 1F1B keeps the last warm-up send it fired until the
  steady phase ends, and the last forward's send ops to the end;
* **input gradients held**: gradients a stage sent back, still referenced by their send
  (GPipe: every one to the end of the step; 1F1B: the latest one, until the next is sent);
* **losses held**: the last stage keeps every microbatch's loss (``_internal_losses``);
* **gradients**: the parameters' gradients exist from the end of the first backward of the
  step on (the loop clears them with ``zero_grad()`` before each step), so a later
  backward accumulates into them.

:func:`stage_events` lists, for one stage of a schedule, every moment the peak can be at
(a forward, a backward, and the points between them where only held tensors are alive),
each with these counts: the step model of a stage
(:mod:`remat.planner.stepmodel.stage`) prices them with one microbatch's terms.

Example:
    >>> [str(e) for e in stage_events("1f1b", stage=0, stages=2, microbatches=3)][:4]
    ['F0 (in flight 0)', 'F1 (in flight 1)', 'B0 (in flight 1)', 'after B0 (in flight 1, grads, outputs 1)']
"""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["Action", "Event", "SCHEDULES", "in_flight", "stage_events"]


class Action(enum.Enum):
    """What the stage runs at an event."""

    FORWARD = "F"
    BACKWARD = "B"
    BETWEEN = "-"
    """No computation: a point where only held tensors are alive (after a backward, the
    step's end)."""


@dataclasses.dataclass(frozen=True)
class Event:
    """One moment of a stage's step and what is alive at it besides the rank's static bytes
    and the running microbatch's own tensors.

    Attributes:
        action: forward, backward or between.
        microbatch: the running microbatch (between: the one just backwarded; ``-1`` at
            the step's end).
        in_flight: other microbatches forwarded and not yet backwarded.
        grads: whether the parameters' gradients exist when it starts.
        outputs: outputs of finished microbatches still referenced.
        input_grads: gradients sent to the previous stage still referenced.
        losses: losses of finished microbatches still referenced.
        merged: the last stage's outputs concatenated (``step()``'s return value).
    """

    action: Action
    microbatch: int
    in_flight: int
    grads: bool
    outputs: int = 0
    input_grads: int = 0
    losses: int = 0
    merged: bool = False

    def __str__(self) -> str:
        if self.action is Action.BETWEEN:
            name = f"after B{self.microbatch}" if self.microbatch >= 0 else "end"
        else:
            name = f"{self.action.value}{self.microbatch}"
        extra = [f"in flight {self.in_flight}"]
        extra += ["grads"] if self.grads else []
        extra += [f"outputs {self.outputs}"] if self.outputs else []
        extra += [f"input grads {self.input_grads}"] if self.input_grads else []
        extra += [f"losses {self.losses}"] if self.losses else []
        extra += ["merged"] if self.merged else []
        return f"{name} ({', '.join(extra)})"


SCHEDULES = ("gpipe", "1f1b")
"""The schedules :func:`stage_events` models (lower case; torch's ``ScheduleGPipe``,
``Schedule1F1B``)."""


def in_flight(schedule: str, stage: int, stages: int, microbatches: int) -> int:
    """The most microbatches a stage holds at once: all of them under GPipe, ``stages -
    stage`` (at most ``microbatches``) under 1F1B.

    Example:
        >>> [in_flight("1f1b", s, 4, 8) for s in range(4)], in_flight("gpipe", 0, 4, 8)
        ([4, 3, 2, 1], 8)
    """
    name = _name(schedule)
    return microbatches if name == "gpipe" else min(microbatches, stages - stage)


def _name(schedule: str) -> str:
    name = schedule.lower().removeprefix("schedule")
    if name not in SCHEDULES:
        raise ValueError(
            f"remat: schedule must be one of {list(SCHEDULES)} (torch's ScheduleGPipe, "
            f"Schedule1F1B), got {schedule!r}."
        )
    return name


def stage_events(
    schedule: str,
    *,
    stage: int,
    stages: int,
    microbatches: int,
    return_outputs: bool = True,
) -> list[Event]:
    """Every moment of one step of ``schedule`` on ``stage`` (of ``stages``) where its
    peak can fall, in order.

    Args:
        schedule: ``"gpipe"`` or ``"1f1b"`` (or torch's class names).
        stage: the stage's index.
        stages: the number of stages.
        microbatches: the microbatches of one step.
        return_outputs: ``schedule.step(return_outputs=...)``: the last stage keeps every
            output to merge them.

    Raises:
        ValueError: an unknown schedule, or counts torch's schedule refuses.
    """
    name = _name(schedule)
    if not 0 <= stage < stages:
        raise ValueError(f"remat: stage must be in [0, {stages}), got {stage}.")
    if microbatches < 1 or (name == "1f1b" and microbatches < stages):
        raise ValueError(
            f"remat: {microbatches} microbatches for {stages} stages: 1F1B needs at least "
            "as many microbatches as stages (GPipe at least one)."
        )
    walk = _Walk(stage == 0, stage == stages - 1, microbatches, return_outputs)
    if name == "gpipe":
        walk.gpipe()
    else:
        walk.one_f_one_b(in_flight(name, stage, stages, microbatches))
    return walk.events


@dataclasses.dataclass
class _Walk:
    """The schedule's loop, run on counts: which microbatches are in flight and finished,
    and which of their tensors the schedule's variables still reference."""

    first: bool
    last: bool
    n: int
    return_outputs: bool
    events: list[Event] = dataclasses.field(default_factory=list)
    flying: set[int] = dataclasses.field(default_factory=set)
    done: int = 0
    outputs: set[int] = dataclasses.field(default_factory=set)  # finished, still referenced
    input_grads: set[int] = dataclasses.field(default_factory=set)
    last_output: int = -1  # the loop's `output` variable (the latest forward's output)

    def _held_outputs(self) -> int:
        if self.last and self.return_outputs:  # output_chunks: every finished microbatch's
            return self.done
        held = set(self.outputs) | ({self.last_output} if self.last_output >= 0 else set())
        return len(held - self.flying)

    def _event(self, action: Action, mb: int) -> None:
        grads = self.done > 0
        self.events.append(
            Event(
                action,
                mb,
                len(self.flying - {mb}),
                grads,
                outputs=self._held_outputs(),
                input_grads=len(self.input_grads) if not self.first else 0,
                losses=self.done if self.last else 0,
            )
        )

    def forward(self, mb: int) -> None:
        self._event(Action.FORWARD, mb)
        self.flying.add(mb)
        self.last_output = mb

    def backward(self, mb: int) -> None:
        self._event(Action.BACKWARD, mb)
        self.flying.discard(mb)
        self.done += 1

    def between(self, mb: int = -1) -> None:
        self._event(Action.BETWEEN, mb)

    def gpipe(self) -> None:
        # every forward send's work is kept to the end of the step, and every backward's
        for mb in range(self.n):
            self.forward(mb)
        for mb in range(self.n):
            self.backward(mb)
            if not self.last:
                self.outputs.add(mb)
            self.input_grads.add(mb)
            self.between(mb)
        self._end()

    def one_f_one_b(self, k: int) -> None:
        warm_send = -1  # `send_work`: the last warm-up send fired (not the last warm-up)
        for mb in range(k):
            self.forward(mb)
            if mb != k - 1 and not self.last:
                warm_send = mb
        f, b = k, 0
        fwd_sends = k - 1 if not self.last else -1  # `fwd_sends`: the latest forward's send
        while True:
            self.backward(b)
            self.outputs = {m for m in (warm_send, fwd_sends) if m >= 0}
            # `bwd_sends` now names b's gradient; the previous one's is dropped
            self.input_grads = {b}
            self.between(b)
            b += 1
            if f == self.n:
                break
            self.forward(f)
            if not self.last:
                fwd_sends = f
            f += 1
        warm_send = -1  # `send_work` rebound to the last steady backward's send
        self.outputs = {fwd_sends} if fwd_sends >= 0 else set()
        while b < self.n:
            self.backward(b)
            # the previous gradient's send work is held until the next is fired
            self.input_grads = {b - 1, b}
            self.between(b)
            self.input_grads = {b}
            b += 1
        self._end()

    def _end(self) -> None:
        self.between()
        if self.last and self.return_outputs:
            grads = self.done > 0
            self.events.append(
                Event(
                    Action.BETWEEN,
                    -1,
                    0,
                    grads,
                    outputs=self._held_outputs(),
                    input_grads=len(self.input_grads) if not self.first else 0,
                    losses=self.n,
                    merged=True,
                )
            )
