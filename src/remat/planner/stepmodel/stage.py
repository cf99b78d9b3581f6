"""The peak of one pipeline stage's step: one microbatch's terms priced at every moment of
its schedule (see :mod:`remat.planner.pipeline`).

A stage runs the forwards and backwards of ``n`` microbatches in its schedule's order
(:func:`~.schedule.stage_events`). At each moment ``e`` the rank holds

    static + grads(e) + in_flight(e) * kept(plan) + held(e) + term(e, plan)

* ``static``: parameters and buffers, the optimizer's state (later steps), the schedule's
  receive buffers (one input and one output gradient per microbatch, allocated once) and
  the batch the rank passes to ``step()``;
* ``grads(e)``: the parameters' gradients once the step's first backward is done;
* ``kept(plan)``: what one microbatch's forward leaves alive to its backward (its saved
  tensors, its output; the loss on the last stage): measured with every block kept, less
  what the plan's checkpoints save (the sum of its segments' ``saved``);
* ``held(e)``: outputs, input gradients and losses of finished microbatches the schedule
  still references, and the last stage's merged outputs;
* ``term(e, plan)``: the running microbatch's own peak above its start, a forward term
  (before the blocks, each block's forward) or a backward one (each block's backward, the
  head, loss and their backward, the layers before the blocks), from the profile of one
  microbatch's step (:mod:`remat.planner.pipeline.probe`): the profile with the gradients
  freed (``set_to_none=True``) for the step's first backward, which creates them, and the
  one with them kept (``set_to_none=False``) for the later ones, which accumulate into them.
  On stages before the last, the probe's scalar loss is taken back.

The optimizer's step follows: ``static + grads + opt_first`` (the first step, state
created: without it in ``static``) and ``+ opt_later`` (later ones).

The head and the loss run in the last stage's forward, but their window (``top``) is priced
at backward moments: under both schedules the backward of the same microbatch runs with as
much in flight and held (1F1B's last stage runs them back to back; under GPipe the first
backward has every other microbatch in flight, as the last forward has).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..types import Decision, ProfileData, SpanLike
from .peak import activation_terms, plan_terms
from .schedule import Action, Event
from .segments import layout

__all__ = ["Moment", "StageBytes", "held_bytes", "kept_bytes", "phase_terms", "stage_peak"]

_AWAY = 2**50
"""A shift that takes a term out of the largest (no step holds a petabyte)."""


@dataclasses.dataclass(frozen=True)
class StageBytes:
    """The bytes of a stage that no plan moves (see the module's docstring).

    Attributes:
        static: parameters, buffers, receive buffers and the batch (no optimizer state).
        optimizer_state: the optimizer's state after its first step.
        grads: the parameters' gradients.
        kept_keep: what one microbatch's forward leaves alive with every block kept.
        output: one microbatch's output.
        input_grad: one microbatch's input gradient (0 on the first stage).
        loss: one microbatch's loss (the last stage; 0 elsewhere).
        microbatches: microbatches in one step.
        probe_loss: bytes the probe's step holds from its loss on that the schedule does
            not (the scalar of a stage before the last).
        optimizer_first / optimizer_later: the peak inside the first / a later
            ``optimizer.step()`` above what is alive before it.
    """

    static: int
    optimizer_state: int
    grads: int
    kept_keep: int
    output: int
    input_grad: int
    loss: int
    microbatches: int
    probe_loss: int = 0
    optimizer_first: int = 0
    optimizer_later: int = 0


@dataclasses.dataclass(frozen=True)
class Moment:
    """A stage's predicted peak and the moment of its step it falls at (in words)."""

    bytes: int
    at: str


def kept_bytes(
    prof: ProfileData, kept_keep: int, decisions: Sequence[Decision], spans: Sequence[SpanLike] = ()
) -> int:
    """What one microbatch's forward leaves alive to its backward under a plan."""
    blocks, _ = plan_terms(prof, decisions, spans)
    return kept_keep - sum(seg.saved for seg in layout(blocks, decisions, spans))


def phase_terms(
    prof: ProfileData, decisions: Sequence[Decision], spans: Sequence[SpanLike] = ()
) -> tuple[int, int]:
    """The largest forward term and the largest backward term of one step under a plan
    (bytes above the step's start; see the module's docstring)."""
    blocks, top = plan_terms(prof, decisions, spans)
    groups = prof.shared.groups
    fwd_only = [dataclasses.replace(b, bwd_start=b.bwd_start - _AWAY) for b in blocks]
    fwd, _ = activation_terms(
        fwd_only, top - _AWAY, decisions, prof.pre, spans, groups, prof.post - _AWAY
    )
    bwd_only = [dataclasses.replace(b, fwd_start=b.fwd_start - _AWAY) for b in blocks]
    bwd, _ = activation_terms(bwd_only, top, decisions, prof.pre - _AWAY, spans, groups, prof.post)
    return fwd, bwd


def held_bytes(sizes: StageBytes, e: Event, per_mb: int) -> int:
    """What the rank holds at moment ``e`` before the running microbatch's own term: its
    static bytes (with the optimizer's state), the gradients once made, ``per_mb`` bytes per
    microbatch in flight, and what the schedule still references of finished ones."""
    return (
        sizes.static
        + sizes.optimizer_state
        + (sizes.grads if e.grads else 0)
        + e.in_flight * per_mb
        + e.outputs * sizes.output
        + e.input_grads * sizes.input_grad
        + e.losses * sizes.loss
        + (sizes.microbatches * sizes.output if e.merged else 0)
    )


def stage_peak(
    freed: ProfileData,
    kept: ProfileData,
    sizes: StageBytes,
    moments: Sequence[Event],
    decisions: Sequence[Decision],
    spans: Sequence[SpanLike] = (),
) -> Moment:
    """The peak of the stage's step under a plan: the largest over the schedule's moments
    (``moments``: :class:`~.schedule.Event` s) and the optimizer's step.

    Args:
        freed: the profile of one microbatch's step with its gradients freed.
        kept: the same with its gradients kept.
        sizes: the bytes no plan moves.
        moments: the stage's schedule, in order.
        decisions: one per block; ``spans`` as :func:`~.segments.layout` takes them.
    """
    per_mb = kept_bytes(freed, sizes.kept_keep, decisions, spans)
    fwd, bwd_first = phase_terms(freed, decisions, spans)
    _, bwd_later = phase_terms(kept, decisions, spans)
    best = Moment(-1, "")
    for e in moments:
        alive = held_bytes(sizes, e, per_mb)
        if e.action is Action.FORWARD:
            alive += fwd
        elif e.action is Action.BACKWARD:
            alive += (bwd_later if e.grads else bwd_first) - sizes.probe_loss
        if alive > best.bytes:
            best = Moment(alive, str(e))
    if freed.optim.name is not None:
        first = sizes.static + sizes.grads + sizes.optimizer_first
        later = sizes.static + sizes.optimizer_state + sizes.grads + sizes.optimizer_later
        for b, at in ((first, "optimizer.step() (first)"), (later, "optimizer.step()")):
            if b > best.bytes:
                best = Moment(b, at)
    return best
