"""Putting planner decisions on modules: keep, recompute, selective, offload, split.

``split`` checkpoints the block and, nested inside it, each of its children that
has parameters (attention, MLP, norms): the block's recompute keeps only the
children's inputs, and each child is recomputed again for its own backward, so
the working set of one recompute is one child's rather than the whole block's
(below the every-block floor, at about twice the recompute time).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..engine.errors import PlanError
from ..modules.spans import apply_span, remove_span, span_of
from ..modules.split import can_split
from ..modules.split import split_children as split_names
from ..modules.wrap import (
    checkpoint_wrapper,
    offload_only,
    set_wrapping_state,
    unwrap,
    wrapping_state,
)
from ..policies import save_matmuls
from .regional import LEVELS, check_compiled_decisions, compile_block, uncompile
from .types import Decision, PlanData


def split_children(module: nn.Module) -> list[nn.Module]:
    """The children ``split`` checkpoints: :func:`remat.modules.split.split_children`'s (the rule
    spans with ``inner="split"`` use too)."""
    return [module.get_submodule(n) for n in split_names(module)]


def apply_decision(module: nn.Module, decision: Decision | str, compiled: bool = False) -> None:
    """Make ``module`` run as ``decision`` (a :class:`~remat.planner.types.Decision`) says,
    in place; with ``compiled``, its forward compiled at the partitioner budget the decision
    means (:data:`~remat.planner.regional.LEVELS`)."""
    try:
        decision = Decision(decision)
    except ValueError:
        raise PlanError(
            f"unknown decision {decision!r}; expected one of {[d.value for d in Decision]}."
        ) from None
    unwrap(module)
    uncompile(module)
    if compiled:
        check_compiled_decisions([decision], "Plan.apply")
        compile_block(module, LEVELS[decision])
        return
    for child in split_children(module):
        unwrap(child)
    if decision is Decision.SPLIT:
        if not can_split(module):
            raise PlanError(
                f"decision 'split' needs a block with two or more children that have "
                f"parameters; {type(module).__name__} has {len(split_children(module))}."
            )
        checkpoint_wrapper(module)
        for child in split_children(module):
            checkpoint_wrapper(child)
    elif decision is Decision.RECOMPUTE:
        checkpoint_wrapper(module)
    elif decision is Decision.SELECTIVE:
        checkpoint_wrapper(module, policy=save_matmuls(prefer=True))
    elif decision is Decision.OFFLOAD:
        offload_only(module)


def snapshot_state(blocks: dict[str, nn.Module]) -> dict[str, list[tuple[nn.Module, Any]]]:
    """The wrapping state of each block and of its children, for :func:`restore_state`."""
    return {n: [(x, wrapping_state(x)) for x in [m, *split_children(m)]] for n, m in blocks.items()}


def restore_state(
    blocks: dict[str, nn.Module], state: dict[str, list[tuple[nn.Module, Any]]]
) -> None:
    """Put the blocks' (and their children's) wrapping back as :func:`snapshot_state` found it."""
    for n in blocks:
        for x, st in state[n]:
            set_wrapping_state(x, st)


def apply_plan(plan: PlanData, model: nn.Module) -> nn.Module:
    """Apply every decision of ``plan`` to the named submodules of ``model``."""
    missing = [n for n in plan.decisions if _find(model, n) is None]
    if missing:
        raise PlanError(
            f"Plan.apply: the model has no submodule named {', '.join(missing)}; the plan was made "
            "for another model (plan and model must come from the same architecture)."
        )
    for name in plan.decisions:  # spans of an earlier plan go first
        if span_of(model.get_submodule(name)) is not None:
            remove_span(model, name)
    spans = [(plan.members(sp), sp.offloaded) for sp in plan.block_spans]
    in_span = {n for members, _ in spans for n in members}
    for name, decision in plan.decisions.items():
        module = _find(model, name)
        assert module is not None
        apply_decision(module, Decision.KEEP if name in in_span else decision, plan.compiled)
    for members, moved in spans:  # moved: as the step model has it, brought back when asked
        inner = plan.decisions[members[0]]
        policy = save_matmuls(prefer=True) if inner is Decision.SELECTIVE else None
        apply_span(
            model, members, inner=inner, policy=policy, offload_inputs=moved, prefetch=not moved
        )
    return model


def _find(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None
