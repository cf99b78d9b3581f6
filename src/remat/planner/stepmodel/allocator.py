"""The step's peak as the allocator counts it: each term of the step model with the scratch
inside operators of its window (see :mod:`remat.planner.stepmodel`).

An operator's scratch (memory it allocates and frees before it returns: oneDNN's
convolution backward, cuDNN workspaces) is alive only while that operator runs, in one
window of the step. So a term of the step model (a window's peak) adds at most the largest
scratch of an operator that runs in its window (:func:`with_scratch`):

* ``pre`` and ``top`` (the head, the loss and their backward): their windows' scratch;
* block ``i``'s forward term (and its recompute terms inside a span, which rerun its
  forward): its forward window's scratch;
* block ``i``'s backward term: its backward window's scratch and, under a decision that
  recomputes the block in its backward (``recompute``, ``selective``, ``split``), its
  forward window's; the last block's backward term also covers ``top``'s;
* the optimizer step: none measured (the profile's scratch step has none).

The allocator's peak of a plan is the largest of those terms (:func:`allocator_peak`); it
is at least the tensors' peak and at most it plus the largest scratch. A profile without
located scratch (``scratch.located`` false: written before, or measured while another
profiler ran) adds its ``scratch.bytes`` to every term, the optimizer's included.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TypeVar

from ..types import NEVER, ProfileData, SpanLike, StepPeak, as_decisions
from .peak import step_peak

P = TypeVar("P", bound=ProfileData)


def with_scratch(prof: P) -> P:
    """``prof`` with the scratch inside operators in each term (see the module).

    Example:
        >>> import torch, remat
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
        >>> prof = remat.profile(model, torch.randn(8, 16), timer="flops")
        >>> keep = ["keep"] * 3
        >>> 0 <= allocator_peak(prof, keep).bytes - prof.peak(keep).bytes <= prof.scratch.bytes
        True
    """
    scratch = prof.scratch
    if not scratch.bytes:
        return prof
    n = len(prof.blocks)
    if scratch.located:
        pre, top, opt, post = scratch.pre, scratch.top, 0, scratch.post
        fwd = [b.fwd_scratch for b in prof.blocks]
        bwd = [b.bwd_scratch for b in prof.blocks]
    else:
        pre = top = opt = post = scratch.bytes
        fwd = bwd = [scratch.bytes] * n
    blocks = []
    for i, b in enumerate(prof.blocks):
        back = {}
        for d, v in b.bwd_excess.items():
            s = max(bwd[i], fwd[i] if d.holds_inputs else 0, top if i == n - 1 else 0)
            back[d] = v + s if v > NEVER else v
        blocks.append(
            dataclasses.replace(
                b,
                fwd_excess={d: v + fwd[i] for d, v in b.fwd_excess.items()},
                fwd_tail=b.fwd_tail + fwd[i] if b.fwd_tail > NEVER else b.fwd_tail,
                bwd_excess=back,
                pre_exit={d: v + top for d, v in b.pre_exit.items()},
            )
        )
    return dataclasses.replace(
        prof,
        blocks=blocks,
        pre=prof.pre + pre,
        top=prof.top + top,
        post=prof.post + post if prof.post else 0,
        optim=dataclasses.replace(
            prof.optim,
            first_bytes=prof.optim.first_bytes + opt,
            later_bytes=prof.optim.later_bytes + opt,
        ),
    )


def allocator_peak(
    prof: ProfileData, decisions: Sequence[str], spans: Sequence[SpanLike] = ()
) -> StepPeak:
    """The step's peak under a plan with the scratch inside operators where it happens (the
    allocator's peak, as ``torch.cuda.max_memory_allocated()`` or the CPU allocator's
    events count it): :func:`~.peak.step_peak` of :func:`with_scratch`. As
    :meth:`remat.Profile.peak` (its twin for the tensors' peak), it takes the decisions by
    name or as :class:`~remat.planner.types.Decision` s."""
    return step_peak(with_scratch(prof), as_decisions(decisions), spans)
