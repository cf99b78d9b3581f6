"""Putting planner decisions on modules: keep, recompute, selective, offload."""

from __future__ import annotations

from typing import Any

from torch import nn

from .._errors import PlanError
from .._wrap import checkpoint_wrapper, offload_only, set_wrapping_state, unwrap, wrapping_state
from ..policies import save_matmuls
from .model import DECISIONS


def apply_decision(module: nn.Module, decision: str) -> None:
    """Make ``module`` run as ``decision`` says (in place)."""
    if decision not in DECISIONS:
        raise PlanError(f"unknown decision {decision!r}; expected one of {list(DECISIONS)}.")
    unwrap(module)
    if decision == "recompute":
        checkpoint_wrapper(module)
    elif decision == "selective":
        checkpoint_wrapper(module, policy=save_matmuls())
    elif decision == "offload":
        offload_only(module)


def snapshot_state(blocks: dict[str, nn.Module]) -> dict[str, dict[str, Any]]:
    """The wrapping state of each block, for :func:`restore_state`."""
    return {n: wrapping_state(m) for n, m in blocks.items()}


def restore_state(blocks: dict[str, nn.Module], state: dict[str, dict[str, Any]]) -> None:
    """Put the blocks' wrapping back as :func:`snapshot_state` found it."""
    for n, m in blocks.items():
        set_wrapping_state(m, state[n])


def apply_plan(plan: Any, model: nn.Module) -> nn.Module:
    """Apply every decision of ``plan`` to the named submodules of ``model``."""
    missing = [n for n in plan.decisions if _find(model, n) is None]
    if missing:
        raise PlanError(
            f"Plan.apply: the model has no submodule named {', '.join(missing)}; the plan was made "
            "for another model (plan and model must come from the same architecture)."
        )
    for name, decision in plan.decisions.items():
        module = _find(model, name)
        assert module is not None
        apply_decision(module, decision)
    return model


def _find(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None
