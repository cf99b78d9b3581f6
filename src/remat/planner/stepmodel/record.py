"""A profile's data from the raw record of its steps: every derived term made here.

:func:`remat.profile` measures and returns one :class:`~remat.planner.types.Measurements`;
:func:`profile_data` reads the profile's fields from it (the per-block terms through
:func:`~.derive.derive_blocks`, the head's ``pre``, ``top`` and ``post`` from the timelines,
the step's cost from the timer's record) and :func:`located` puts the scratch inside
operators of each window of the step where it happens.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

from ..types import (
    Decision,
    Measurements,
    OptimizerTerms,
    ProfileData,
    ScratchTerms,
    SharedTerms,
    Window,
    WindowKind,
)
from .derive import derive_blocks

P = TypeVar("P", bound=ProfileData)


def profile_data(m: Measurements, kind: type[P]) -> P:
    """The profile of the record ``m``, as a ``kind`` (:class:`~remat.Profile`): its scratch
    located where ``m.scratch`` says (:func:`located`)."""
    keep = m.lines[Decision.KEEP]
    flops = m.timer == "flops"
    prof = kind(
        blocks=derive_blocks(m),
        top=keep.top_peak,
        pre=keep.pre_peak,
        decisions=list(m.decisions),
        cost_unit="flop" if flops else "s",
        input_shapes=m.input_shapes,
        device=m.device,
        from_shapes=m.from_shapes,
        compiled=m.compiled,
        steps=m.steps,
        torch_version=m.torch_version,
        # a whole step's FLOPs are three times the blocks' forwards
        step_cost=3.0 * sum(m.costs[Decision.RECOMPUTE].values()) if flops else m.keep_cost,
        static_bytes=m.static_bytes,
        grad_bytes=m.grad_bytes,
        grads_kept=m.grads_kept,
        optim=OptimizerTerms(
            m.optimizer, m.optimizer_state_bytes, m.optimizer_first_bytes, m.optimizer_later_bytes
        ),
        end_bytes=keep.end_bytes,
        end_grads=keep.end_grads,
        top_grads=keep.top_grads,
        chained=m.chained,
        kept_outputs=m.kept_outputs,
        shared=SharedTerms(m.shared_bytes, dict(m.shared_inputs)),
        # the same whatever the plan (every block's backward is done): the largest seen
        post=max((t.post_peak or 0 for t in m.lines.values()), default=0),
    )
    return located(prof, m.scratch)


def located(prof: P, scratch: dict[Window, int] | None) -> P:
    """``prof`` with the scratch inside operators of each window of the step
    (:func:`~remat.planner.scratch.window_scratch`'s record; ``None``: not measured, none)."""
    where = scratch or {}
    fwd, bwd = WindowKind.FWD, WindowKind.BWD
    blocks = [
        dataclasses.replace(
            b, fwd_scratch=where.get(Window(fwd, i), 0), bwd_scratch=where.get(Window(bwd, i), 0)
        )
        for i, b in enumerate(prof.blocks)
    ]
    return dataclasses.replace(
        prof,
        blocks=blocks,
        scratch=ScratchTerms(
            bytes=max(where.values(), default=0),
            located=scratch is not None,
            pre=where.get(Window(WindowKind.PRE), 0),
            top=where.get(Window(WindowKind.TOP), 0),
            post=where.get(Window(WindowKind.POST), 0),
        ),
    )
