"""Named checkpointing strategies for the benchmark.

A strategy configures a freshly built benchmark model in place: most set its
``run_block`` (how each block is called); wrapper strategies wrap the blocks;
``auto-N%`` strategies call :func:`remat.auto_checkpoint` with ``budget="N%"``
(the public API, so they follow whatever the planner's budget means).
Adding one is a function and a line in :func:`registry`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as tuc
from torch import nn

from ..engine.checkpoint import checkpoint
from ..engine.selective import create_selective_checkpoint_contexts
from ..policies import matmul_ops, offload_matmuls, save_matmuls


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A way to checkpoint a benchmark model's blocks.

    Attributes:
        name: what ``--strategies`` takes.
        description: one line for the table's legend.
        configure: ``configure(model, example_input)`` changes the model in place and
            may return details for the results (a plan, a note), else None.
        device_only: True when it only makes sense with a device (offload).
        plans: True when configuring runs the planner (profiling steps: slow).
    """

    name: str
    description: str
    configure: Callable[[nn.Module, Any], dict[str, Any] | None]
    device_only: bool = False
    plans: bool = False


class _Runner:
    """``run_block`` that checkpoints the blocks whose index ``select`` accepts."""

    def __init__(self, call: Callable[..., torch.Tensor], every: int = 1) -> None:
        self.call = call
        self.every = every

    def __call__(self, i: int, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if i % self.every == 0:
            return self.call(block, x)
        return block(x)  # type: ignore[no-any-return]


def _set_runner(
    call: Callable[..., torch.Tensor], every: int = 1
) -> Callable[[nn.Module, Any], None]:
    def configure(model: nn.Module, example: Any) -> None:
        model.run_block = _Runner(call, every)  # type: ignore[assignment]

    return configure


def _remat_full(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return checkpoint(block, x)  # type: ignore[no-any-return]


_SAVE = functools.partial(create_selective_checkpoint_contexts, save_matmuls())
_OFFLOAD = functools.partial(create_selective_checkpoint_contexts, offload_matmuls())
_TORCH_SAVE = functools.partial(
    tuc.create_selective_checkpoint_contexts, sorted(matmul_ops(), key=str)
)


def _remat_selective(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return checkpoint(block, x, context_fn=_SAVE)  # type: ignore[no-any-return]


def _remat_offload(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return checkpoint(block, x, context_fn=_OFFLOAD)  # type: ignore[no-any-return]


def _torch_full(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return tuc.checkpoint(block, x, use_reentrant=False)  # type: ignore[no-any-return]


def _torch_selective(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return tuc.checkpoint(block, x, use_reentrant=False, context_fn=_TORCH_SAVE)  # type: ignore[no-any-return]


def _torch_wrapper(model: nn.Module, example: Any, every: int = 1) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    blocks = _blocks(model)
    for i in range(0, len(blocks), every):
        blocks[i] = checkpoint_wrapper(blocks[i], checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def _offload_blocks(model: nn.Module, example: Any) -> None:
    from ..planner.apply import apply_decision

    for block in _blocks(model):
        apply_decision(block, "offload")  # the planner's "offload": offload(), no recompute


def _blocks(model: nn.Module) -> nn.ModuleList:
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(
            f"{type(model).__name__}: benchmark models keep their blocks in an nn.ModuleList "
            f"named 'blocks', got {type(blocks).__name__}."
        )
    return blocks


def registry() -> dict[str, Strategy]:
    """Every strategy this build of remat offers, by name."""
    items = [
        Strategy("none", "no checkpointing", lambda m, e: None),
        Strategy("full", "remat.checkpoint on every block", _set_runner(_remat_full)),
        Strategy("every-2nd", "remat.checkpoint on every 2nd block", _set_runner(_remat_full, 2)),
        Strategy(
            "selective",
            "remat, save matmul outputs, recompute the rest",
            _set_runner(_remat_selective),
        ),
        Strategy(
            "offload",
            "remat, matmul outputs kept in host memory, the rest recomputed",
            _set_runner(_remat_offload),
            device_only=True,
        ),
        Strategy(
            "offload-blocks",
            "remat.offload around every block: saved tensors in host memory, nothing recomputed",
            _offload_blocks,
            device_only=True,
        ),
        Strategy("torch-full", "torch.utils.checkpoint on every block", _set_runner(_torch_full)),
        Strategy(
            "torch-2nd", "torch.utils.checkpoint on every 2nd block", _set_runner(_torch_full, 2)
        ),
        Strategy(
            "torch-selective",
            "torch selective checkpointing, same op list",
            _set_runner(_torch_selective),
        ),
        Strategy("torch-wrapper", "torch's checkpoint_wrapper on every block", _torch_wrapper),
        Strategy(
            "torch-wrapper-2nd",
            "torch's checkpoint_wrapper on every 2nd block",
            functools.partial(_torch_wrapper, every=2),
        ),
    ]
    items += _extra_strategies()
    return {s.name: s for s in items}


def _extra_strategies() -> list[Strategy]:
    """The module wrapper and the planner at three budgets (sharing one profile)."""
    from ..modules.wrap import checkpoint_wrapper

    def _wrapper(model: nn.Module, example: Any) -> None:
        for block in _blocks(model):
            checkpoint_wrapper(block)

    def _wrapper2(model: nn.Module, example: Any) -> None:
        for i, block in enumerate(_blocks(model)):
            if i % 2 == 0:
                checkpoint_wrapper(block)

    out = [
        Strategy("wrapper", "remat.checkpoint_wrapper on every block", _wrapper),
        Strategy("wrapper-2nd", "remat.checkpoint_wrapper on every 2nd block", _wrapper2),
    ]
    profiles: dict[Any, Any] = {}  # one profile per model for every auto-N% strategy
    for pct in AUTO_BUDGETS:
        out.append(
            Strategy(
                f"auto-{pct}%",
                f'remat.auto_checkpoint(model, x, budget="{pct}%", set_to_none=False)',
                functools.partial(auto, pct=pct, profiles=profiles),
                plans=True,
            )
        )
    for pct in FLOOR_BUDGETS:
        out.append(
            Strategy(
                f"auto-floor-{pct}%",
                f"remat.auto_checkpoint, budget: static bytes + {pct}% of the activations of "
                "checkpointing every block (below the per-block floor)",
                functools.partial(auto_below_floor, pct=pct, profiles=profiles),
                plans=True,
            )
        )
    return out


FLOOR_BUDGETS = (90, 85)
"""The ``auto-floor-N%`` strategies: budgets below what checkpointing every block reaches. On
``--deep``'s model the smallest plan is about 81% of the every-block activations (all
gradients and one split block's backward are alive at its peak), so both are reachable."""


def floor_budget(prof: Any, pct: float) -> int:
    """Static bytes plus ``pct``% of the activation bytes of checkpointing every block, in
    the planner's units (the predicted step peak of ``recompute`` on every block), plus the
    scratch inside operators that budgets leave room for (``Profile.scratch.bytes``).

    Example:
        >>> import torch, remat
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
        >>> prof = remat.profile(model, torch.randn(64, 8), timer="flops")
        >>> every = prof.peak(["recompute"] * 3).bytes
        >>> floor_budget(prof, 100) == every + prof.scratch.bytes
        True
        >>> prof.static_step_bytes < floor_budget(prof, 50) < every
        True
    """
    every = prof.peak(["recompute"] * len(prof.blocks)).bytes
    static = prof.static_step_bytes
    return static + prof.scratch.bytes + int((every - static) * pct / 100)


def shared_profile(model: nn.Module, example: Any, profiles: dict[Any, Any] | None) -> Any:
    """``remat.profile`` of ``model`` for the bench's loop, cached in ``profiles`` by
    :func:`model_key` (one profile serves every ``auto-*`` strategy of a run)."""
    import remat

    cache = {} if profiles is None else profiles
    key = model_key(model, example)
    if key not in cache:
        cache[key] = remat.profile(model, example, set_to_none=LOOP_SET_TO_NONE)
    return cache[key]


def auto_below_floor(
    model: nn.Module, example: Any, *, pct: float, profiles: dict[Any, Any] | None = None
) -> dict[str, Any]:
    """``remat.auto_checkpoint`` with the budget of :func:`floor_budget` (spans of blocks,
    split blocks); returns the plan and the budget in bytes.

    When no plan reaches it, the plan with the smallest predicted peak is applied, with a
    note saying how far below the floor that is (the table footnotes it).
    """
    import remat

    prof = shared_profile(model, example, profiles)
    budget = floor_budget(prof, pct)
    try:
        chosen = remat.auto_checkpoint(
            model, example, budget=budget, quiet=True, profile=prof, set_to_none=LOOP_SET_TO_NONE
        )
        note = None
    except remat.PlanError:
        chosen = remat.plan(prof, prof.floor_bytes + prof.scratch.bytes)
        chosen.apply(model)
        every = floor_budget(prof, 100) - prof.static_step_bytes - prof.scratch.bytes
        reach = 100 * (prof.floor_bytes - prof.static_step_bytes) / max(every, 1)
        note = (
            f"no plan reaches {pct}% of the every-block activations (remat.PlanError); the "
            f"plan with the smallest predicted peak, {reach:.0f}% of them, was used"
        )
    return {"budget": f"{budget} bytes", "plan": json.loads(chosen.to_json()), "note": note}


LOOP_SET_TO_NONE = False
"""The benchmark's loop keeps gradients between steps (``zero_grad(set_to_none=False)``, as
its memory and timed steps run), so the planner plans for that loop: a percentage then
reads as the share of the unchecked step's activations, the table's ``act x``."""

AUTO_BUDGETS = (30, 50, 70)
"""The budgets of the ``auto-N%`` strategies."""


def model_key(model: nn.Module, example: Any) -> tuple[Any, ...]:
    """What identifies a benchmark model for sharing its profile: class, parameter names
    and shapes, input shape (models built from one config with one seed share it).

    Example:
        >>> import torch
        >>> a, b = torch.nn.Linear(2, 3), torch.nn.Linear(2, 3)
        >>> model_key(a, torch.ones(1, 2)) == model_key(b, torch.ones(1, 2))
        True
        >>> model_key(a, torch.ones(1, 2)) == model_key(a, torch.ones(5, 2))
        False
    """
    params = tuple((n, tuple(p.shape)) for n, p in model.named_parameters())
    shape = tuple(example.shape) if isinstance(example, torch.Tensor) else repr(example)
    return (type(model).__name__, params, shape)


def auto(
    model: nn.Module, example: Any, *, pct: float, profiles: dict[Any, Any] | None = None
) -> dict[str, Any]:
    """``remat.auto_checkpoint(model, example, budget=f"{pct}%")``; returns the plan.

    ``profiles`` caches :func:`remat.profile` by :func:`model_key`: the ``auto-N%``
    strategies of one run build identical models, so one profile serves every budget
    (passed as ``auto_checkpoint(..., profile=...)``); profiling is most of the cost.

    When no plan reaches the budget (``remat.PlanError``; a small model, or a budget
    below what checkpointing every block saves), the smallest reachable budget is found
    with :func:`remat.plan` on a profile and that plan is applied, with a note saying
    so (the table footnotes it).

    Returns:
        ``{"plan": <the plan as JSON data>, "budget": "N%", "note": None or the fallback}``.
    """
    import remat

    budget = f"{pct:g}%"
    prof = shared_profile(model, example, profiles)
    try:
        chosen = remat.auto_checkpoint(
            model, example, budget=budget, quiet=True, profile=prof, set_to_none=LOOP_SET_TO_NONE
        )
        note = None
    except remat.PlanError:
        reach = smallest_reachable_percent(prof, lambda b: remat.plan(prof, b))
        chosen = remat.plan(prof, f"{reach}%")
        chosen.apply(model)
        note = (
            f"no plan reaches {budget} (remat.PlanError); the plan with the smallest "
            f"reachable budget, {reach}%, was used"
        )
    return {"budget": budget, "plan": json.loads(chosen.to_json()), "note": note}


def smallest_reachable_percent(profile: Any, make_plan: Callable[[str], Any]) -> int:
    """The smallest whole percentage budget for which a plan exists.

    ``make_plan(budget)`` raises ``remat.PlanError`` when no plan reaches ``budget``.
    Bisection over percentages through the public planner, so it follows the planner's
    meaning of a percentage.

    Example:
        >>> import remat
        >>> def make_plan(budget):  # a planner whose plans reach 36.2% at best
        ...     if int(budget.rstrip("%")) < 36.2:
        ...         raise remat.PlanError("too small")
        >>> smallest_reachable_percent(None, make_plan)
        37
    """
    import remat

    def fits(pct: int) -> bool:
        try:
            make_plan(f"{pct}%")
        except remat.PlanError:
            return False
        return True

    lo, hi = 0, 100
    while not fits(hi):  # past 100% only if even keeping everything was predicted over
        lo, hi = hi, 2 * hi
        if hi > 10_000:
            raise remat.PlanError(
                "remat bench: no plan reaches even 10000% of the reference; the planner "
                "cannot plan this model."
            )
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi


DEFAULT = (
    "none",
    "full",
    "every-2nd",
    "selective",
    "offload",
    "offload-blocks",
    "torch-full",
    "torch-selective",
    "auto-30%",
    "auto-50%",
    "auto-70%",
)
"""What ``remat bench`` runs by default (on CPU without the device-only ones): remat's
main strategies, torch's for comparison and the planner at three budgets."""

DEEP = (
    "none",
    "full",
    "every-2nd",
    "torch-full",
    "torch-2nd",
    "auto-floor-90%",
    "auto-floor-85%",
)
"""What ``remat bench --deep`` runs: checkpointing every (2nd) block, remat's and torch's,
and plans below that per-block floor."""
