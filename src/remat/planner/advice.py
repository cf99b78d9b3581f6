"""Boundary warnings for a plan, from what the planner knows without another step.

The rules of :mod:`remat.measure.diagnose` read an instrumented step (``remat explain``,
``remat.verify``). Two of them apply to a plan before it runs, and the plan's table
prints them (:attr:`remat.Plan.diagnostics`):

* :func:`loss_head`: the plan's predicted peak falls in the loss head, after the last
  block, and the head's own tensors are at least half of what the step holds above its
  start there (``LOSS_HEAD_SHARE``): checkpointing the blocks cannot lower it further;
  chunk the loss. From the profile's terms (:func:`~remat.planner.stepmodel.head_bytes`).
* :func:`nested`: a block the plan checkpoints (``recompute``, ``selective``, ``split``,
  or in a span) that is checkpointed already, by Hugging Face's own gradient
  checkpointing (``model.activation_checkpointing_enable()``), by a remat wrapper or by
  torch's ``checkpoint_wrapper`` inside it: its forward would run three times a step.
  (Applying a plan rewraps a block and its children with parameters, the ones ``split``
  checkpoints, so only wrappers further down remain to nest.)

The other two rules (a region that frees nothing, a wrap that raises the peak) cannot
fire for a plan the planner chose (it checkpoints a block only where that saves bytes at
the peak); ``remat.auto_checkpoint(..., diagnose=True)`` runs them all on a step of the
planned model (:func:`remat.measure.explain.diagnose`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..engine.bytes import fmt_bytes
from ..measure.diagnose import LOSS_HEAD_SHARE, Diagnostic, Kind, hf_checkpointing, related
from ..modules.wrap import is_wrapped
from .apply import split_children
from .stepmodel import attribution, head_bytes, plan_terms
from .types import Decision, Phase, PlanData, ProfileData, SpanLike, StepPeak

#: Where the loss-head warning points (the profile does not name the head's modules).
HEAD = "(head and loss)"


def loss_head(
    prof: ProfileData,
    peak: StepPeak,
    decisions: Sequence[Decision],
    spans: Sequence[SpanLike] = (),
) -> list[Diagnostic]:
    """The loss-head warning, when the plan's peak is the head's (see the module).

    The head's term of the step model (what the step holds after the last block's forward,
    less what the plan saves) must be the peak: after the last block, or in the last
    block's backward window where it starts with the head's backward (a tie).

    Example:
        >>> import torch, remat
        >>> from remat.planner.advice import loss_head
        >>> from remat.planner.stepmodel import step_peak
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        >>> prof = remat.profile(model, torch.randn(4, 8), timer="flops")
        >>> from remat.planner.types import Decision
        >>> keep = [Decision.KEEP] * 2
        >>> loss_head(prof, step_peak(prof, keep), keep)
        []
    """
    if peak.at.phase not in (Phase.AFTER_BLOCKS, Phase.BACKWARD) or not prof.blocks:
        return []
    above = peak.bytes - prof.static_step_bytes
    blocks, top = plan_terms(prof, decisions, spans)
    saved = sum(attribution(blocks, decisions, spans)[0].values())
    head = head_bytes(prof)
    if above <= 0 or top - saved != above or head < LOSS_HEAD_SHARE * above:
        return []
    return [
        Diagnostic(
            Kind.LOSS_HEAD,
            HEAD,
            f"the plan's peak ({fmt_bytes(above)} above the start of the step) falls in the "
            f"loss head, after the last block, and {fmt_bytes(head)} of it are the head's "
            "and the loss's own tensors (logits, their softmax and gradient): no checkpoint "
            "of the blocks lowers that part. Compute the loss in chunks (the head and the "
            "loss on slices of the sequence or batch, each slice checkpointed, as a chunked "
            "cross-entropy does); `remat explain` names the head's largest tensors.",
        )
    ]


def _checkpointed_blocks(plan: PlanData) -> list[str]:
    """The blocks the plan runs again in backward (their own decision, or a span's)."""
    out = [n for n, d in plan.decisions.items() if d.holds_inputs]
    for sp in plan.block_spans:
        out += plan.members(sp)
    return list(dict.fromkeys(out))


def _torch_wrapped(m: nn.Module) -> bool:
    """A module wrapped by torch's ``checkpoint_wrapper`` (``CheckpointWrapper``)."""
    return type(m).__name__ == "CheckpointWrapper" and hasattr(m, "checkpoint_fn")


def nested(model: nn.Module, plan: PlanData) -> list[Diagnostic]:
    """Blocks the plan checkpoints that are checkpointed already (see the module).

    Example:
        >>> import torch, remat
        >>> from remat.planner.advice import nested
        >>> inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        >>> model = torch.nn.Sequential(torch.nn.Sequential(inner, torch.nn.Linear(4, 4)))
        >>> _ = remat.checkpoint_wrapper(inner[0])
        >>> plan = remat.Plan({"0": "recompute"}, 0, 0.0, 0, 0)
        >>> [d.module for d in nested(model, plan)]
        ['0']
    """
    hf = hf_checkpointing(model)
    found: list[Diagnostic] = []
    for name in _checkpointed_blocks(plan):
        try:
            block = model.get_submodule(name)
        except AttributeError:
            continue
        flags = [h for h in hf if related(name, h)]
        if flags:
            found.append(
                Diagnostic(
                    Kind.NESTED,
                    name,
                    "the plan checkpoints it and Hugging Face's own activation checkpointing "
                    f"is on ({flags[0] or 'the model'}): its forward runs three times a step "
                    "(forward, each checkpoint's recompute). Turn Hugging Face's off with "
                    "model.activation_checkpointing_disable() (gradient_checkpointing_disable() "
                    "in older transformers; in a Trainer: TrainingArguments("
                    "activation_checkpointing=False)) before planning, or plan through "
                    "remat.integrations.hf, which takes it over, or keep it and leave remat "
                    "out of these layers.",
                )
            )
            continue
        reset = {id(c) for c in split_children(block)}  # applying a plan rewraps these
        inner = [
            f"{name}.{n}"
            for n, m in block.named_modules()
            if n and id(m) not in reset and (is_wrapped(m) or _torch_wrapped(m))
        ]
        if inner:
            more = f" (and {len(inner) - 1} more)" if len(inner) > 1 else ""
            found.append(
                Diagnostic(
                    Kind.NESTED,
                    name,
                    f"the plan checkpoints it and {inner[0]}{more} inside it is checkpointed "
                    "already: the inner module's forward runs three times a step (forward, "
                    "the block's recompute, its own). Remove the inner checkpoint "
                    "(remat.unwrap) before planning, or leave the block out of the plan "
                    "(check_fn=...).",
                )
            )
    return found


def on_model(
    model: nn.Module,
    plan: PlanData,
    step: tuple[tuple[Any, ...], dict[str, Any]] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> list[Diagnostic]:
    """The plan's warnings on ``model``: its own (:func:`loss_head`), :func:`nested`, and,
    given ``step`` (the model's positional and keyword inputs), every rule of
    :func:`remat.explain` on an instrumented step of the model as it is (the plan
    applied); one warning per rule and module.

    Example:
        >>> import torch, remat
        >>> from remat.planner.advice import on_model
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        >>> prof = remat.profile(model, torch.randn(4, 8), timer="flops")
        >>> on_model(model, remat.plan(prof, "100%"))
        []
    """
    found = [*plan.diagnostics, *nested(model, plan)]
    if step is not None:
        from ..measure.explain import diagnose

        args, kwargs = step
        found += diagnose(model, *args, loss_fn=loss_fn, **kwargs)
    seen: set[tuple[Kind, str]] = set()
    out = []
    for d in found:
        if (d.kind, d.module) not in seen:
            seen.add((d.kind, d.module))
            out.append(d)
    return out
